//! `ferry bench kv`: a KV-cache-shaped workload, the pattern a disaggregated decode
//! engine drives (vLLM's `NixlConnector` through NIXL).
//!
//! Both sides hold a paged KV pool: `layers` × `pool_blocks` blocks of `block_size`,
//! layer-major, prepared once as one descriptor list per side. A request moves
//! `blocks_per_request` blocks in every layer (so `layers × blocks_per_request`
//! descriptors), the remote blocks drawn at random from the peer's pool and the local
//! ones from a free slot of this side's (`paged`: both scattered through the pool, so
//! nothing merges; `contiguous`: consecutive blocks, which merge per layer). Each turn
//! of the scheduler loop (a tick) admits up to `new_per_tick` requests while fewer than
//! `in_flight` are outstanding (make from the prepared lists, attach a notification
//! `req-N`, post), checks every older one, and releases the finished ones at the next
//! tick — all recorded into one command buffer and flushed once.
//!
//! Measured after `warmup` requests: tick latency (the time the loop spent in Ferry
//! per tick: recording and the flush) p50 / p99 / max, request latency (admitted →
//! seen done) p50 / p99, GB/s and descriptors/s of the finished requests over the
//! timed wall time. The peer is a target process found through a TCPStore, as in
//! `ferry bench xfer` (its `--role target`); `loopback` keeps both in this process.
//! `tools/bench/kv_nixl.py` runs the same loop through NIXL's Python API and
//! `tools/bench/kv-compare.sh` runs both on one libucp in interleaved rounds.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, Parser, ValueEnum};
use ferry::{Agent, CommandBuffer, Desc, MemKind, PrepId, Side, Ticket, XferId, XferStatus};
use serde_json::json;

use super::vram::{registered, Memory};
use super::{sweep, target, BackendArg, Plan, Shape, XferArgs};
use crate::args::{human_bytes, size};
use crate::bench::OpArg;

/// `ferry bench kv` arguments.
#[derive(Args, Debug, Clone)]
#[command(
    after_help = "Output: one line of configuration and one KV line: ticks, tick µs p50/p99/max \
    (time in Ferry per loop turn), request µs p50/p99 (admitted to seen done), GB/s and \
    descriptors/s of the timed requests, ranges per request after merging, the backend used."
)]
pub struct KvArgs {
    /// The backend: default (the default set: a same-host peer gets SHM), ucx, shm, or
    /// loopback (both sides in this process).
    #[arg(long, value_enum, default_value_t = BackendArg::Default, ignore_case = true)]
    pub backend: BackendArg,
    /// READ (decode pulls from prefill, vLLM's direction) or WRITE (prefill pushes).
    #[arg(long, value_enum, default_value_t = OpArg::Read, ignore_case = true)]
    pub op: OpArg,
    /// Model layers (each a block array of its own).
    #[arg(allow_negative_numbers = true, long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub layers: u32,
    /// Bytes of one block of one layer (K and V of `block tokens` tokens).
    #[arg(allow_negative_numbers = true, long, default_value = "16K", value_parser = size)]
    pub block_size: u64,
    /// Blocks of each request, in every layer (descriptors per request: × layers).
    #[arg(allow_negative_numbers = true, long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub blocks_per_request: u32,
    /// Requests outstanding at most.
    #[arg(allow_negative_numbers = true, long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub in_flight: u32,
    /// Requests admitted per tick at most.
    #[arg(allow_negative_numbers = true, long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub new_per_tick: u32,
    /// Blocks per layer in each side's pool (default: twice what the requests in flight
    /// hold, at least 256).
    #[arg(allow_negative_numbers = true, long, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub pool_blocks: Option<u32>,
    /// Where a request's blocks are: paged (scattered, shuffled) or contiguous.
    #[arg(long, value_enum, default_value_t = KvLayout::Paged)]
    pub layout: KvLayout,
    /// Timed requests.
    #[arg(allow_negative_numbers = true, long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
    pub requests: u32,
    /// Untimed requests before them.
    #[arg(allow_negative_numbers = true, long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(0..=100_000_000))]
    pub warmup: u32,
    /// Backend parameter, KEY=VALUE or TYPE.KEY=VALUE (as `bench xfer --param`).
    #[arg(long = "param", value_name = "KEY=VALUE", value_parser = crate::args::key_value)]
    pub params: Vec<(String, String)>,
    /// The libucp every agent loads (the UCX backend's `ucx_library`).
    #[arg(long, value_name = "PATH")]
    pub ucx_library: Option<PathBuf>,
    /// How long to wait for the target process, in seconds.
    #[arg(allow_negative_numbers = true, long, default_value = "30", value_parser = crate::args::seconds)]
    pub connect_timeout: Duration,
    /// Also write the configuration and results as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub metrics: crate::metrics::MetricsArgs,
}

/// Where a request's blocks sit in the pools.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLayout {
    /// Scattered through both pools (shuffled block ids): nothing merges.
    Paged,
    /// Consecutive blocks: each layer's run merges into one range.
    Contiguous,
}

/// `bench xfer`'s arguments for the same peer: one worker, one target whose buffer is
/// the pool, blocks of `block_size`.
fn xfer_args(a: &KvArgs, pool_bytes: u64) -> Result<XferArgs, String> {
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        x: XferArgs,
    }
    let mut x = Wrap::try_parse_from(["xfer"]).map_err(|e| e.to_string())?.x;
    x.backend = a.backend;
    x.start_block = a.block_size;
    x.max_block = a.block_size;
    x.buffer = Some(pool_bytes);
    x.params = a.params.clone();
    x.gpu.ucx_library = a.ucx_library.clone();
    x.connect_timeout = a.connect_timeout;
    x.run_id = "ferry-bench-kv".into();
    Ok(x)
}

/// What one run measured.
struct KvResult {
    ticks: u64,
    tick_us: Vec<f64>,
    request_us: Vec<f64>,
    bytes: u64,
    descs: u64,
    elapsed: Duration,
    ranges: usize,
    via: &'static str,
}

/// One outstanding request.
struct Active {
    slot: u32,
    admitted: Instant,
    made: Option<Ticket<XferId>>,
    posted: Option<Ticket<XferStatus>>,
    xfer: Option<XferId>,
    checked: Option<Ticket<XferStatus>>,
    timed: bool,
}

/// Run `ferry bench kv`.
pub fn run(a: &KvArgs) -> Result<(), String> {
    if matches!(a.backend.shape(), Shape::OwnFile | Shape::OwnObjects) {
        return Err(format!(
            "bench kv moves memory between two agents: {} moves files or objects (use default, ucx, shm or loopback)",
            a.backend.name()
        ));
    }
    let need = a
        .in_flight
        .checked_mul(a.blocks_per_request)
        .ok_or("--in-flight × --blocks-per-request overflows")?;
    let pool_blocks = a.pool_blocks.unwrap_or((2 * need).max(256));
    if pool_blocks < need {
        return Err(format!(
            "--pool-blocks {pool_blocks} cannot hold {} requests of {} blocks in flight ({need} blocks)",
            a.in_flight, a.blocks_per_request
        ));
    }
    let pool_bytes = u64::from(a.layers)
        .checked_mul(u64::from(pool_blocks))
        .and_then(|n| n.checked_mul(a.block_size))
        .filter(|&b| b <= 32 << 30)
        .ok_or("the pool (layers × pool blocks × block size) is over 32 GiB")?;
    if u64::from(a.layers) * u64::from(pool_blocks) > u64::from(u32::MAX) {
        return Err("layers × pool blocks is over 2^32 descriptors".into());
    }
    let plan = super::plan(&xfer_args(a, pool_bytes)?)?;
    let _metrics = a.metrics.start()?;
    super::interrupt_stops_the_sweep();

    // The peer: a target process (or an agent of this process for LOOPBACK).
    let agent = sweep::agent(&plan, &sweep::initiator_name(&plan, 0))?;
    let local = registered(&agent, plan.initiator_placement(), pool_bytes)?;
    let mut _in_process: Option<(Agent, Memory)> = None;
    let mut _peers = None;
    let (side, remote_base, placement) = match plan.args.backend.shape() {
        Shape::InProcess => {
            let t = sweep::agent(&plan, &target::target_name(&plan, 0))?;
            let buf = registered(&t, plan.target_placement(), pool_bytes)?;
            let peer = agent
                .load_remote_md(&t.local_md().map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
            let base = buf.addr();
            _in_process = Some((t, buf));
            (
                Side::from(peer),
                base,
                "an agent of this process".to_string(),
            )
        }
        _ => {
            let peers = target::connect(&plan)?;
            let t = peers.targets.first().ok_or("no target")?;
            let peer = agent
                .load_remote_md_as(&t.name, &t.blob)
                .map_err(|e| e.to_string())?;
            let out = (Side::from(peer), t.base, peers.placement.clone());
            _peers = Some(peers);
            out
        }
    };
    let config = describe(a, &plan, pool_blocks, pool_bytes, &placement, &agent);
    let cfg: Vec<String> = config
        .iter()
        .map(|(k, v)| match v.as_str() {
            Some(text) => format!("{k}: {text}"),
            None => format!("{k}: {v}"),
        })
        .collect();
    println!("ferry bench kv — {}", cfg.join("; "));

    let result = kv_loop(a, &agent, &local, side, remote_base, pool_blocks);
    // Tell a target process we are done, whatever happened.
    if _peers.is_some() {
        let _ = agent.notify(side, sweep::DONE_NOTIFICATION);
        let until = Instant::now() + Duration::from_millis(200);
        while Instant::now() < until {
            agent.progress();
        }
    }
    let r = result?;
    let line = summary(&r);
    println!("{line}");
    if let Some(path) = &a.json {
        let doc = json!({
            "tool": "ferry bench kv",
            "version": env!("CARGO_PKG_VERSION"),
            "config": config.iter().cloned().collect::<serde_json::Map<String, serde_json::Value>>(),
            "ticks": r.ticks,
            "tick_p50_us": quantile(&r.tick_us, 0.50),
            "tick_p99_us": quantile(&r.tick_us, 0.99),
            "tick_max_us": quantile(&r.tick_us, 1.0),
            "request_p50_us": quantile(&r.request_us, 0.50),
            "request_p99_us": quantile(&r.request_us, 0.99),
            "requests": r.request_us.len(),
            "gbps": r.bytes as f64 / r.elapsed.as_secs_f64() / 1e9,
            "descs_per_s": r.descs as f64 / r.elapsed.as_secs_f64(),
            "ranges_per_request": r.ranges,
            "via": r.via,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    }
    drop(agent); // before the memory it registered
    Ok(())
}

fn describe(
    a: &KvArgs,
    plan: &Plan,
    pool_blocks: u32,
    pool_bytes: u64,
    placement: &str,
    agent: &Agent,
) -> Vec<(String, serde_json::Value)> {
    let mut c: Vec<(String, serde_json::Value)> = vec![
        ("backend".into(), json!(plan.args.backend.name())),
        ("op".into(), json!(a.op.op().to_string())),
        ("layers".into(), json!(a.layers)),
        ("block_bytes".into(), json!(a.block_size)),
        ("blocks_per_request".into(), json!(a.blocks_per_request)),
        (
            "descs_per_request".into(),
            json!(a.layers * a.blocks_per_request),
        ),
        ("in_flight".into(), json!(a.in_flight)),
        ("new_per_tick".into(), json!(a.new_per_tick)),
        (
            "layout".into(),
            json!(format!("{:?}", a.layout).to_lowercase()),
        ),
        (
            "pool".into(),
            json!(format!(
                "{pool_blocks} blocks × {} layers = {} per side",
                a.layers,
                human_bytes(pool_bytes)
            )),
        ),
        (
            "requests".into(),
            json!(format!("{} (+{} warm-up)", a.requests, a.warmup)),
        ),
        ("notification".into(), json!("req-N on every request")),
        ("peer".into(), json!(placement)),
    ];
    let backends: Vec<String> = agent
        .backends()
        .into_iter()
        .map(|b| {
            let p: Vec<String> = b
                .params
                .iter()
                .filter(|(k, _)| {
                    [
                        "transports",
                        "error_handling",
                        "progress_thread",
                        "am_tcp",
                        "ucx_library",
                    ]
                    .contains(&k.as_str())
                })
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            if p.is_empty() {
                b.name.to_string()
            } else {
                format!("{} ({})", b.name, p.join(","))
            }
        })
        .collect();
    c.push(("backends".into(), json!(backends.join(", "))));
    for var in ["UCX_TLS", "UCX_NET_DEVICES"] {
        if let Ok(v) = std::env::var(var) {
            c.push((var.into(), json!(v)));
        }
    }
    c
}

fn summary(r: &KvResult) -> String {
    let secs = r.elapsed.as_secs_f64().max(1e-9);
    format!(
        "KV ticks {} tick_p50_us {:.2} tick_p99_us {:.2} tick_max_us {:.2} request_p50_us {:.2} request_p99_us {:.2} requests {} gbps {:.4} descs_per_s {:.0} ranges_per_request {} via {}",
        r.ticks,
        quantile(&r.tick_us, 0.50),
        quantile(&r.tick_us, 0.99),
        quantile(&r.tick_us, 1.0),
        quantile(&r.request_us, 0.50),
        quantile(&r.request_us, 0.99),
        r.request_us.len(),
        r.bytes as f64 / secs / 1e9,
        r.descs as f64 / secs,
        r.ranges,
        r.via
    )
}

/// The `q` quantile of `v` (nearest rank; 0 when empty).
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// A small deterministic generator (xorshift64*), so runs repeat.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }
    fn shuffle(&mut self, v: &mut [u32]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u32 + 1) as usize);
        }
    }
}

/// Block ids of a request: `n` distinct blocks of a pool of `pool` (paged: random;
/// contiguous: a random run), written into `out`.
fn pick_remote(
    rng: &mut Rng,
    layout: KvLayout,
    pool: u32,
    n: u32,
    out: &mut Vec<u32>,
    seen: &mut [bool],
) {
    out.clear();
    match layout {
        KvLayout::Contiguous => {
            let start = rng.below(pool - n + 1);
            out.extend(start..start + n);
        }
        KvLayout::Paged => {
            // Rejection sampling: requests are small beside the pool.
            while out.len() < n as usize {
                let b = rng.below(pool);
                if !std::mem::replace(&mut seen[b as usize], true) {
                    out.push(b);
                }
            }
            for &b in out.iter() {
                seen[b as usize] = false;
            }
        }
    }
}

fn kv_loop(
    a: &KvArgs,
    agent: &Agent,
    local: &Memory,
    side: Side,
    remote_base: u64,
    pool_blocks: u32,
) -> Result<KvResult, String> {
    let err = |what: &str, e: ferry::Error| format!("{what}: {e}");
    let (layers, bs) = (a.layers, a.block_size);
    let kind = MemKind::Dram;
    let at = |base: u64, l: u32, b: u32| {
        base + (u64::from(l) * u64::from(pool_blocks) + u64::from(b)) * bs
    };
    // The pools, prepared once, layer-major (index = layer × pool_blocks + block).
    let local_list: Vec<Desc> = (0..layers)
        .flat_map(|l| (0..pool_blocks).map(move |b| (l, b)))
        .map(|(l, b)| Desc::new(at(local.addr(), l, b), bs, local.dev()))
        .collect();
    let remote_list: Vec<Desc> = (0..layers)
        .flat_map(|l| (0..pool_blocks).map(move |b| (l, b)))
        .map(|(l, b)| Desc::new(at(remote_base, l, b), bs, 0))
        .collect();
    let local_prep: PrepId = agent
        .prep(Side::Local, local.kind(), &local_list)
        .map_err(|e| err("prep of the local pool", e))?;
    let remote_prep: PrepId = agent
        .prep(side, kind, &remote_list)
        .map_err(|e| err("prep of the remote pool", e))?;
    drop((local_list, remote_list));

    // This side's block allocator: slot s owns blocks [s·n, (s+1)·n) of a (paged:
    // shuffled) permutation of the pool, so requests in flight never share a block.
    let n = a.blocks_per_request;
    let mut rng = Rng(0x6b76_5f62_656e_6368);
    let mut local_map: Vec<u32> = (0..pool_blocks).collect();
    if a.layout == KvLayout::Paged {
        rng.shuffle(&mut local_map);
    }
    let mut free_slots: Vec<u32> = (0..a.in_flight).rev().collect();
    let mut seen = vec![false; pool_blocks as usize];
    let mut remote_blocks = Vec::with_capacity(n as usize);
    let descs = (layers * n) as usize;
    let (mut local_idx, mut remote_idx) = (Vec::with_capacity(descs), Vec::with_capacity(descs));

    let total = u64::from(a.warmup) + u64::from(a.requests);
    let mut cmds = CommandBuffer::with_capacity(4 * a.in_flight as usize + 64);
    let mut active: Vec<Active> = Vec::with_capacity(a.in_flight as usize);
    let mut to_release: Vec<XferId> = Vec::with_capacity(a.in_flight as usize);
    let mut admitted: u64 = 0;
    let mut finished: u64 = 0;
    let mut r = KvResult {
        ticks: 0,
        tick_us: Vec::with_capacity(a.requests as usize * 4),
        request_us: Vec::with_capacity(a.requests as usize),
        bytes: 0,
        descs: 0,
        elapsed: Duration::ZERO,
        ranges: 0,
        via: "",
    };
    // Timing starts with the tick that admits the first timed request.
    let mut timed_since: Option<Instant> = None;
    let mut tag = String::with_capacity(32);
    let op = a.op.op();
    while finished < total {
        if sweep::STOP.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(format!("interrupted after {finished} of {total} requests"));
        }
        let t0 = Instant::now();
        cmds.clear();
        for x in to_release.drain(..) {
            cmds.release(x);
        }
        // New requests this tick.
        let mut new = 0;
        while new < a.new_per_tick && admitted < total {
            let Some(slot) = free_slots.pop() else { break };
            if admitted == u64::from(a.warmup) {
                timed_since = Some(t0);
            }
            pick_remote(
                &mut rng,
                a.layout,
                pool_blocks,
                n,
                &mut remote_blocks,
                &mut seen,
            );
            local_idx.clear();
            remote_idx.clear();
            for l in 0..layers {
                for (k, &rb) in remote_blocks.iter().enumerate() {
                    local_idx.push(l * pool_blocks + local_map[(slot * n) as usize + k]);
                    remote_idx.push(l * pool_blocks + rb);
                }
            }
            tag.clear();
            use std::fmt::Write;
            let _ = write!(tag, "req-{admitted}");
            let made = cmds
                .make(op, local_prep, &local_idx, remote_prep, &remote_idx)
                .notify(tag.as_bytes())
                .ticket();
            let posted = cmds.post(made);
            active.push(Active {
                slot,
                admitted: t0,
                made: Some(made),
                posted: Some(posted),
                xfer: None,
                checked: None,
                timed: admitted >= u64::from(a.warmup),
            });
            admitted += 1;
            new += 1;
        }
        // Older requests: check.
        for x in active.iter_mut().filter(|x| x.xfer.is_some()) {
            x.checked = Some(cmds.check(x.xfer.expect("posted")));
        }
        agent.flush(&mut cmds);
        let flushed = Instant::now();
        if let Some((i, e)) = cmds.errors().next() {
            return Err(format!("command {i} of a tick failed: {e}"));
        }
        let mut k = 0;
        while k < active.len() {
            let x = &mut active[k];
            let status = if let Some(made) = x.made.take() {
                let id = cmds.created(made).map_err(|e| err("make", e))?;
                x.xfer = Some(id);
                if r.via.is_empty() {
                    r.via = agent.xfer_backend(id).unwrap_or("?");
                    r.ranges = agent.xfer_ranges(id).unwrap_or(0);
                }
                cmds.status(x.posted.take().expect("posted with its make"))
                    .map_err(|e| err("post", e))?
            } else {
                cmds.status(x.checked.take().expect("checked this tick"))
                    .map_err(|e| err("check", e))?
            };
            if status == XferStatus::Done {
                let done = active.swap_remove(k);
                to_release.push(done.xfer.expect("made"));
                free_slots.push(done.slot);
                finished += 1;
                if done.timed {
                    r.request_us
                        .push(flushed.duration_since(done.admitted).as_secs_f64() * 1e6);
                    r.bytes += u64::from(layers * n) * bs;
                    r.descs += u64::from(layers * n);
                }
            } else {
                k += 1;
            }
        }
        if timed_since.is_some() {
            r.ticks += 1;
            r.tick_us
                .push(flushed.duration_since(t0).as_secs_f64() * 1e6);
        }
    }
    r.elapsed = timed_since.map_or(Duration::ZERO, |t| t.elapsed());
    for x in to_release {
        agent.release(x).map_err(|e| err("release", e))?;
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_blocks_are_distinct_and_in_the_pool() {
        let mut rng = Rng(7);
        let mut seen = vec![false; 64];
        let mut out = Vec::new();
        for _ in 0..100 {
            pick_remote(&mut rng, KvLayout::Paged, 64, 16, &mut out, &mut seen);
            let mut s = out.clone();
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len(), 16);
            assert!(s.iter().all(|&b| b < 64));
            assert!(seen.iter().all(|&x| !x));
            pick_remote(&mut rng, KvLayout::Contiguous, 64, 16, &mut out, &mut seen);
            assert!(out.windows(2).all(|w| w[1] == w[0] + 1) && out[15] < 64);
        }
        assert_eq!(quantile(&[3.0, 1.0, 2.0, 4.0], 0.5), 2.0);
        assert_eq!(quantile(&[3.0, 1.0, 2.0, 4.0], 0.99), 4.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
