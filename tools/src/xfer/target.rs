//! The two-process side of `ferry bench xfer` (UCX): the target role, the spawning of
//! a target process, and how the initiator finds the targets through the metadata
//! exchange.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::exchange::tcpstore::{self, ServerConfig, ServerHandle};
use ferry::exchange::{StoreConfig, TcpStoreConfig, Via};
use ferry::metadata::PeerMd;

use super::sweep::{agent, DONE_NOTIFICATION};
use super::vram::registered;
use super::{BackendArg, Plan, Role};

/// Target agent `k`'s name.
pub fn target_name(plan: &Plan, k: usize) -> String {
    format!("{}-target-{k}", plan.args.run_id)
}

/// A target as the initiator found it.
pub struct TargetInfo {
    /// Agent name.
    pub name: String,
    /// Its metadata blob.
    pub blob: Vec<u8>,
    /// Address of its buffer.
    pub base: u64,
    /// Device of its buffer.
    pub dev: u64,
    /// Length of its buffer.
    pub len: u64,
}

/// The targets, and the process and store this initiator started for them.
pub struct Peers {
    /// Targets in index order.
    pub targets: Vec<TargetInfo>,
    /// Where the targets run, in words.
    pub placement: String,
    child: Option<Child>,
    server: Option<ServerHandle>,
}

impl Drop for Peers {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            // Closing its stdin (dropping the pipe) tells it to stop too.
            drop(child.stdin.take());
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => {
                        if !status.success() {
                            tracing::warn!("the target process ended with {status}");
                        }
                        break;
                    }
                    Ok(None) if Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        tracing::warn!("the target process did not stop within 10 s; killing it");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
        if let Some(server) = self.server.take() {
            server.stop();
        }
    }
}

/// The arguments a spawned target needs to mirror this plan.
fn target_args(plan: &Plan, store: &str) -> Vec<String> {
    let a = &plan.args;
    let mut v: Vec<String> = [
        "bench",
        "xfer",
        "--role",
        "target",
        "--backend",
        plan.args.backend.flag(),
        "--watch-stdin",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend([
        "--tcpstore".into(),
        store.into(),
        "--run-id".into(),
        a.run_id.clone(),
        "--threads".into(),
        a.threads.to_string(),
        "--buffer".into(),
        plan.area_bytes.to_string(),
        "--start-block".into(),
        a.start_block.to_string(),
        "--max-block".into(),
        a.max_block.to_string(),
        "--connect-timeout".into(),
        a.connect_timeout.as_secs_f64().to_string(),
    ]);
    v.extend(super::vram::target_args(plan));
    if let Some(ns) = &a.exchange.namespace {
        v.extend(["--namespace".into(), ns.clone()]);
    }
    for (k, val) in &a.params {
        v.extend(["--param".into(), format!("{k}={val}")]);
    }
    v
}

/// Find the targets: spawn them first in `--role auto` (with a TCPStore server of our
/// own unless a store was given), then fetch each one's metadata from the store.
pub fn connect(plan: &Plan) -> Result<Peers, String> {
    let mut config = plan.args.exchange.config()?;
    let mut peers = Peers {
        targets: Vec::new(),
        placement: "a target process found through the store".into(),
        child: None,
        server: None,
    };
    let mut plan = plan.clone();
    if plan.args.role == Role::Auto {
        if plan.args.run_id == "ferry-bench" {
            plan.args.run_id = format!("ferry-bench-{}", std::process::id());
        }
        let store = match &config.store {
            StoreConfig::TcpStore(ts) => ts.endpoint.clone(),
            StoreConfig::None => {
                let server = tcpstore::serve(([127, 0, 0, 1], 0).into(), ServerConfig::default())
                    .map_err(|e| format!("starting a TCPStore server: {e}"))?;
                let addr = server.local_addr().to_string();
                peers.server = Some(server);
                config.store = StoreConfig::TcpStore(TcpStoreConfig::new(addr.clone()));
                addr
            }
            StoreConfig::Etcd(_) | StoreConfig::InProcess(_) => {
                return Err("--role auto spawns its target with a TCPStore: give --tcpstore, or run the sides with --role initiator|target".into())
            }
        };
        let exe = std::env::current_exe().map_err(|e| format!("finding this binary: {e}"))?;
        // Its own process group: a Ctrl-C at the terminal reaches only this process,
        // which finishes its outputs and then stops the target (closing its stdin). A
        // signal sent to the target itself still stops it.
        let child = Command::new(exe)
            .process_group(0)
            .args(target_args(&plan, &store))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawning the target process: {e}"))?;
        peers.placement = format!(
            "target process (pid {}) on this host, found through TCPStore {store}",
            child.id()
        );
        peers.child = Some(child);
    }
    for k in 0..plan.threads() {
        let name = target_name(&plan, k);
        let child = &mut peers.child;
        let mut alive = || {
            if super::sweep::STOP.load(Ordering::Relaxed) {
                return Err("interrupted while waiting for the targets".to_string());
            }
            match child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(status))) => Err(format!(
                "the target process ended ({status}) before publishing '{name}'; its messages are above"
            )),
            _ => Ok(()),
        }
        };
        let blob = crate::md::fetch_blob(
            config.clone(),
            &name,
            Via::Store,
            None,
            plan.args.connect_timeout,
            &mut alive,
        )?;
        let md = PeerMd::from_bytes(&blob).map_err(|e| format!("metadata of '{name}': {e}"))?;
        // The target's buffer, as any of its backends registered it (with the default
        // set every backend that moves memory registered the same range).
        let backend = match plan.args.backend {
            BackendArg::Default => None,
            other => Some(
                md.backend_index(other.name())
                    .ok_or_else(|| format!("'{name}' has no {} backend", other.name()))?,
            ),
        };
        let region = md
            .regions()
            .find(|r| backend.is_none_or(|b| r.backend == b) && r.kind == plan.target_kind)
            .ok_or_else(|| {
                format!(
                    "'{name}' published no {} region (use the same --target-mem on both sides)",
                    plan.target_kind
                )
            })?;
        let need = plan.buffer_bytes(k);
        if region.desc.len < need {
            return Err(format!(
                "'{name}' has a {}-byte buffer; this sweep needs {need} (use the same --threads and --buffer on both sides)",
                region.desc.len
            ));
        }
        peers.targets.push(TargetInfo {
            name,
            base: region.desc.addr,
            dev: region.desc.dev,
            len: region.desc.len,
            blob,
        });
    }
    Ok(peers)
}

/// The target role: `--threads` agents, each with a registered buffer, published in
/// the store; progress them until the initiator says it is done (or stdin closes
/// with `--watch-stdin`, or Ctrl-C).
pub fn serve(plan: &Plan) -> Result<(), String> {
    let config = plan.args.exchange.config()?;
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        if let Err(e) = ctrlc::set_handler(move || stop.store(true, Ordering::Relaxed)) {
            tracing::warn!("no Ctrl-C handler: {e}");
        }
    }
    if plan.args.watch_stdin {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sink = [0u8; 64];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            stop.store(true, Ordering::Relaxed);
        });
    }
    // A passive target needs progress only for what its transport cannot do without
    // it (TCP emulates RMA with active messages). Unless told otherwise, UCX's
    // progress thread does that, sleeping on the workers' event fds, so the target
    // does not spin a core that the initiator on the same host would want.
    let mut plan = plan.clone();
    if !plan.args.params.iter().any(|(k, _)| k == "progress_thread") {
        plan.args
            .params
            .push(("progress_thread".into(), "true".into()));
    }
    let threaded = plan
        .args
        .params
        .iter()
        .any(|(k, v)| k == "progress_thread" && v == "true");
    let plan = &plan;
    // Buffers first, so that they are dropped after the agents.
    let mut buffers = Vec::new();
    let mut agents = Vec::new();
    for k in 0..plan.threads() {
        let a = agent(plan, &target_name(plan, k))?;
        buffers.push(registered(
            &a,
            plan.target_placement(),
            plan.buffer_bytes(k),
        )?);
        a.start_exchange(config.clone())
            .map_err(|e| e.to_string())?;
        a.send_local_md(Via::Store).map_err(|e| e.to_string())?;
        agents.push(a);
    }
    println!(
        "{} target agent(s) publishing as {}-target-0..{}; serving until the initiator is done (Ctrl-C stops; a failed publish stops it with the reason)",
        agents.len(),
        plan.args.run_id,
        agents.len() - 1
    );
    let mut done = vec![false; agents.len()];
    let mut heard_at: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) && done.iter().any(|d| !d) {
        if threaded {
            std::thread::sleep(Duration::from_millis(1));
        }
        for (k, a) in agents.iter().enumerate() {
            // A publish that failed (an unreachable store, say) leaves nobody to find
            // this target: stop with the reason instead of serving forever.
            if let Some((to, what, e)) = a.drain_exchange_failures().into_iter().next() {
                return Err(format!("target {}: {what} to {to} failed: {e}", a.name()));
            }
            for _ in 0..if threaded { 1 } else { 64 } {
                a.progress();
            }
            for (_, payload) in a.drain_notifications() {
                // A spawned target stays until its stdin closes: the initiator
                // closes it after its own agents are gone, so no side sees the other
                // vanish mid-connection.
                if payload == DONE_NOTIFICATION && !plan.args.watch_stdin {
                    done[k] = true;
                }
            }
        }
        // Worker 0 tells every target; one that never hears it (a lost message)
        // stops a few seconds after the first one did.
        match heard_at {
            None if done.iter().any(|&d| d) => heard_at = Some(Instant::now()),
            Some(t) if t.elapsed() > Duration::from_secs(3) => break,
            _ => {}
        }
    }
    // Linger a moment, so that the initiator closes its endpoints first and neither
    // side reports the other as lost.
    let linger = Instant::now() + Duration::from_secs(1);
    while !stop.load(Ordering::Relaxed) && Instant::now() < linger {
        for a in &agents {
            a.progress();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    for a in &agents {
        if let Err(e) = a.invalidate_local_md(Via::Store) {
            tracing::debug!("withdrawing {}: {e}", a.name());
        }
    }
    // Let the withdrawals go out.
    std::thread::sleep(Duration::from_millis(100));
    drop(agents);
    drop(buffers);
    Ok(())
}
