//! `ferry md fetch` (a peer's metadata blob through the metadata exchange, to a file)
//! and `ferry inspect` (what a blob holds, or what is wrong with it, in words).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use ferry::exchange::{Event, ExchangeConfig, Manager, StoreConfig, TcpStoreConfig, Via};
use ferry::metadata::PeerMd;
use serde_json::json;

/// `ferry md` subcommands.
#[derive(Subcommand, Debug)]
pub enum MdCmd {
    /// Fetch AGENT's metadata blob through the metadata exchange and write it to a file
    /// (for `ferry inspect`). The store comes from the flags, else from the FERRY_*
    /// environment variables (README, "Metadata exchange").
    Fetch(FetchArgs),
}

/// Where the metadata exchange finds agents: flags over `FERRY_*` variables.
#[derive(Args, Debug, Clone, Default)]
pub struct ExchangeArgs {
    /// A TCPStore server (Ferry's or torch's), HOST:PORT.
    #[arg(long, value_parser = crate::args::host_port, conflicts_with = "etcd")]
    pub tcpstore: Option<String>,
    /// etcd endpoints, comma-separated URLs (needs a build with the `etcd` feature).
    #[arg(long, value_name = "URL")]
    pub etcd: Option<String>,
    /// Key prefix in the store (default: FERRY_STORE_NAMESPACE, else ferry/agents).
    #[arg(long)]
    pub namespace: Option<String>,
}

impl ExchangeArgs {
    /// The exchange config: defaults, then `FERRY_*` variables, then these flags.
    pub fn config(&self) -> Result<ExchangeConfig, String> {
        let mut config = ExchangeConfig::default()
            .with_env_overrides()
            .map_err(|e| e.to_string())?;
        if let Some(endpoint) = &self.tcpstore {
            config.store = StoreConfig::TcpStore(TcpStoreConfig::new(endpoint.clone()));
        }
        if let Some(urls) = &self.etcd {
            // A build without the exchange's `etcd` feature refuses this config when
            // the manager starts, saying so.
            let endpoints: Vec<String> = urls
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            if endpoints.is_empty() {
                return Err("--etcd needs at least one URL".into());
            }
            config.store = StoreConfig::Etcd(ferry::exchange::EtcdConfig::new(endpoints));
        }
        if let Some(ns) = &self.namespace {
            config.namespace = ns.clone();
        }
        config.check().map_err(|e| e.to_string())?;
        Ok(config)
    }
}

/// `ferry md fetch` arguments.
#[derive(Args, Debug)]
pub struct FetchArgs {
    /// The agent whose metadata to fetch.
    agent: String,
    /// Where to write the blob.
    #[arg(short, long, value_name = "FILE")]
    output: PathBuf,
    #[command(flatten)]
    exchange: ExchangeArgs,
    /// Ask the agent's P2P listener at HOST:PORT instead of a store.
    #[arg(long, value_parser = crate::args::host_port, conflicts_with_all = ["tcpstore", "etcd"])]
    peer: Option<String>,
    /// Partial metadata published under this label instead of the full metadata.
    #[arg(long)]
    label: Option<String>,
    /// How long to wait for the agent to publish, in seconds.
    #[arg(allow_negative_numbers = true, long, default_value = "10", value_parser = crate::args::seconds)]
    timeout: Duration,
    #[command(flatten)]
    pub metrics: crate::metrics::MetricsArgs,
}

/// Run one `ferry md` command.
pub fn run(cmd: MdCmd) -> Result<(), String> {
    match cmd {
        MdCmd::Fetch(a) => fetch(&a),
    }
}

fn fetch(args: &FetchArgs) -> Result<(), String> {
    let _metrics = args.metrics.start()?;
    let config = args.exchange.config()?;
    let via = match &args.peer {
        Some(addr) => Via::Peer(crate::store::resolve(addr)?),
        None => {
            if matches!(config.store, StoreConfig::None) {
                return Err(
                    "no metadata store: give --tcpstore HOST:PORT, --etcd URL or --peer HOST:PORT (or set FERRY_TCPSTORE_ENDPOINT / FERRY_ETCD_ENDPOINTS)"
                        .into(),
                );
            }
            Via::Store
        }
    };
    let blob = fetch_blob(
        config,
        &args.agent,
        via,
        args.label.as_deref(),
        args.timeout,
        &mut || Ok(()),
    )?;
    std::fs::write(&args.output, &blob).map_err(|e| format!("{}: {e}", args.output.display()))?;
    println!(
        "{} bytes of metadata of '{}' written to {}",
        blob.len(),
        args.agent,
        args.output.display()
    );
    Ok(())
}

/// Fetch `agent`'s blob through a metadata-exchange manager of our own (a fetch-only
/// participant with no regions), waiting at most `timeout`; `alive` is asked every
/// 200 ms whether waiting still makes sense (an error ends the wait with it).
pub fn fetch_blob(
    config: ExchangeConfig,
    agent: &str,
    via: Via,
    label: Option<&str>,
    timeout: Duration,
    alive: &mut dyn FnMut() -> Result<(), String>,
) -> Result<Vec<u8>, String> {
    let mut config = config;
    config.fetch_timeout = timeout;
    let me = format!("ferry-fetch-{}", std::process::id());
    // The manager serves our own (empty) metadata to anyone who asks in return.
    let empty = ferry::Agent::new(ferry::AgentConfig::named(me.clone()))
        .and_then(|a| a.local_md())
        .map_err(|e| e.to_string())?;
    let manager = Manager::new(&me, config).map_err(|e| e.to_string())?;
    manager.set_local_md(Arc::from(empty));
    manager
        .fetch_remote_md(agent, via, label)
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + timeout + Duration::from_secs(1);
    let wanted = label.unwrap_or(ferry::exchange::FULL_LABEL);
    loop {
        let mut result: Option<Result<Vec<u8>, String>> = None;
        manager.poll(|event| match event {
            Event::Load {
                agent: a,
                label: l,
                blob,
                ..
            } if a == agent && l == wanted => result = Some(Ok(blob)),
            Event::FetchFailed {
                agent: a, error, ..
            } if a == agent => result = Some(Err(format!("fetching '{agent}': {error}"))),
            other => tracing::debug!("exchange event ignored: {other:?}"),
        });
        if let Some(r) = result {
            return r;
        }
        alive()?;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "'{agent}' published no metadata within {:.1} s",
                timeout.as_secs_f64()
            ));
        }
        manager.wait(left.min(Duration::from_millis(200)));
    }
}

/// `ferry inspect` arguments.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The metadata blob (e.g. from `ferry md fetch`).
    file: PathBuf,
    /// Print JSON (every region) instead of a summary.
    #[arg(long)]
    json: bool,
}

/// Header of a Ferry metadata blob: magic, version (LE u16), flags (LE u16).
const MAGIC: &[u8; 4] = b"FRMD";
const HEADER_LEN_BYTES: usize = 8;

/// What is wrong with `bytes`, in words, when it is not a valid metadata blob.
fn diagnose(bytes: &[u8]) -> Result<PeerMd, String> {
    if bytes.is_empty() {
        return Err("the file is empty".into());
    }
    if bytes.len() < HEADER_LEN_BYTES {
        return Err(format!(
            "the file is {} bytes, too short for the {HEADER_LEN_BYTES}-byte header of a metadata blob",
            bytes.len()
        ));
    }
    if &bytes[..4] != MAGIC {
        let what = if &bytes[..4] == b"FRDL" {
            "an encoded descriptor list, not agent metadata".to_string()
        } else {
            format!(
                "not Ferry metadata: it starts with {:02x?} instead of \"FRMD\"",
                &bytes[..4]
            )
        };
        return Err(format!("the file is {what}"));
    }
    PeerMd::from_bytes(bytes).map_err(|e| {
        let reason = match &e {
            ferry::Error::InvalidMetadata { reason } => reason.to_string(),
            other => other.to_string(),
        };
        if reason.starts_with("archive structure check failed") {
            // The validator's own words name internal types; keep them for -vv.
            tracing::debug!("{reason}");
            format!(
                "the blob is damaged: the {} bytes after its header do not form a valid metadata archive (truncated, or bytes changed); run with -vv for the validator's detail",
                bytes.len() - HEADER_LEN_BYTES
            )
        } else {
            format!("the blob is invalid: {reason}")
        }
    })
}

/// Run `ferry inspect`.
pub fn inspect(args: &InspectArgs) -> Result<(), String> {
    let path = args.file.display();
    let bytes = std::fs::read(&args.file).map_err(|e| format!("{path}: {e}"))?;
    let md = match diagnose(&bytes) {
        Ok(md) => md,
        Err(problem) => {
            if args.json {
                let out = json!({
                    "file": path.to_string(),
                    "bytes": bytes.len(),
                    "valid": false,
                    "problem": problem,
                });
                println!("{out:#}");
            }
            return Err(format!("{path}: {problem}"));
        }
    };
    if args.json {
        let backends: Vec<_> = (0..md.backend_count())
            .filter_map(|i| md.backend(i as u8))
            .map(|(name, conn)| json!({"name": name, "connection_info_bytes": conn.map(<[u8]>::len)}))
            .collect();
        let regions: Vec<_> = md
            .regions()
            .map(|r| {
                json!({
                    "backend": md.backend(r.backend).map(|b| b.0),
                    "kind": r.kind.name(),
                    "addr": r.desc.addr,
                    "len": r.desc.len,
                    "dev": r.desc.dev,
                    "public_md_bytes": r.public_md.len(),
                })
            })
            .collect();
        let out = json!({
            "file": path.to_string(),
            "bytes": bytes.len(),
            "valid": true,
            "agent": md.agent(),
            "generation": md.generation(),
            "partial": md.is_partial(),
            "backends": backends,
            "regions": regions,
        });
        println!("{out:#}");
        return Ok(());
    }
    println!(
        "agent {} generation {:#x}{} — {} bytes, {} regions",
        md.agent(),
        md.generation(),
        if md.is_partial() { " (partial)" } else { "" },
        bytes.len(),
        md.region_count()
    );
    for i in 0..md.backend_count() {
        if let Some((name, conn)) = md.backend(i as u8) {
            println!(
                "  backend {name}: connection info {}",
                conn.map_or("not included".to_string(), |c| format!("{} bytes", c.len()))
            );
        }
    }
    for r in md.regions().take(20) {
        println!(
            "  {} {} addr {:#x} len {} dev {} md {} bytes",
            md.backend(r.backend).map_or("?", |b| b.0),
            r.kind,
            r.desc.addr,
            r.desc.len,
            r.desc.dev,
            r.public_md.len()
        );
    }
    if md.region_count() > 20 {
        println!("  … {} more (--json lists all)", md.region_count() - 20);
    }
    Ok(())
}
