//! `ferry`: the command-line tool.
//!
//! ```text
//! ferry demo [--mib N]                 two agents move N MiB (default 256) both ways
//!                                      through the loopback backend, verify, print GB/s
//! ferry bench control [--batch N] [--shuffled] [--path prepared|full] [--seconds S]
//!                                      control-path ns per descriptor (median of rounds)
//! ferry bench posix [--op read|write] [--direct] [--block-kib K] [--batch N] [--size-mib M]
//!                                      DRAM <-> FILE GB/s (median of reps)
//! ferry backends                       backend types, parameters, availability
//! ferry inspect FILE                   summarize a metadata blob
//! ferry store serve [--listen ADDR]    Ferry's own TCPStore server (c10d wire protocol),
//!                                      for name-based discovery without torch or etcd;
//!                                      limits from FERRY_TCPSTORE_MAX_* and
//!                                      FERRY_TCPSTORE_*_TIMEOUT_MS (metadata/exchange/README.md)
//! ```
// Reason: the tool registers its own buffers, which is the caller-side promise
// `Agent::register` asks for; each block says why it holds.
#![allow(unsafe_code)]

mod bench;
mod buffers;
mod demo;

use std::process::ExitCode;

fn usage() -> ExitCode {
    eprintln!(
        "usage:\n  ferry demo [--mib N]\n  ferry bench control [--batch N] [--shuffled] [--path prepared|full] [--seconds S]\n  ferry bench posix [--op read|write] [--direct] [--block-kib K] [--batch N] [--size-mib M] [--engine uring|threads]\n  ferry backends\n  ferry inspect FILE\n  ferry store serve [--listen 127.0.0.1:29500]"
    );
    ExitCode::from(2)
}

/// Value of `--name V` in `args`, parsed.
pub(crate) fn opt<T: std::str::FromStr>(args: &[String], name: &str) -> Result<Option<T>, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => {
            let v = args
                .get(i + 1)
                .ok_or_else(|| format!("{name} needs a value"))?;
            v.parse()
                .map(Some)
                .map_err(|_| format!("{name}: cannot parse '{v}'"))
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("demo") => demo::run(&args[1..]),
        Some("bench") => bench::run(&args[1..]),
        Some("backends") => {
            for info in ferry::Agent::available_backends() {
                let status = match &info.available {
                    Ok(()) => "available".to_string(),
                    Err(why) => format!("unavailable: {why}"),
                };
                let kinds: Vec<&str> = info.mem_kinds.iter().map(|k| k.name()).collect();
                println!("{} ({}) memory: {}", info.name, status, kinds.join(", "));
                if info.available.is_ok() {
                    for (kind, why) in info
                        .kinds
                        .iter()
                        .filter_map(|(k, r)| Some((k, r.as_ref().err()?)))
                    {
                        println!("  {kind} unavailable: {why}");
                    }
                }
                for p in info.params {
                    println!("    {} = {:<10} {}", p.name, p.default, p.doc);
                }
            }
            Ok(())
        }
        Some("inspect") => inspect(&args[1..]),
        Some("store") if args.get(1).map(String::as_str) == Some("serve") => {
            store_serve(&args[2..])
        }
        _ => return usage(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry: {e}");
            ExitCode::FAILURE
        }
    }
}

fn inspect(args: &[String]) -> Result<(), String> {
    let path = args.first().ok_or("inspect needs a file")?;
    let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    let md = ferry::metadata::PeerMd::from_bytes(&bytes).map_err(|e| e.to_string())?;
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
        println!("  … {} more", md.region_count() - 20);
    }
    Ok(())
}

fn store_serve(args: &[String]) -> Result<(), String> {
    let listen: std::net::SocketAddr =
        opt(args, "--listen")?.unwrap_or_else(|| ([127, 0, 0, 1], 29500).into());
    if listen.ip().is_unspecified() {
        eprintln!("ferry: warning: listening on every interface ({listen}); the TCPStore protocol has no authentication");
    }
    // Limits from FERRY_TCPSTORE_MAX_* / FERRY_TCPSTORE_*_TIMEOUT_MS (the exchange
    // crate's README has the table).
    let config = ferry::exchange::tcpstore::ServerConfig::default()
        .with_env_overrides()
        .map_err(|e| e.to_string())?;
    let server = ferry::exchange::tcpstore::serve(listen, config).map_err(|e| e.to_string())?;
    println!("ferry TCPStore server listening on {}", server.local_addr());
    // Serve until killed.
    loop {
        std::thread::park();
    }
}
