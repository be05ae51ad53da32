//! Where the first request after a load spends what the second does not (issue 25's
//! "first request no slower than the second"). Over UCX (two agents of this process,
//! `UCX_NET_DEVICES=lo`, the target with a progress thread), like the `scaling` bench's
//! `ucx_first_request` / `ucx_second_request` cases, but each request is split into its
//! parts, timed on the caller's thread: `create`, `post` (until it returns) and `wait`
//! (checks until done), plus the thread's minor page faults.
//!
//! ```text
//! cargo run --release -p ferry-benches --example first_request -- \
//!     [--regions 1000] [--turns 41] [--gap-us 0] [--evict-kib 0] [--touch-target]
//!     [--warm-target] [--other-bytes]
//! ```
//!
//! Each turn makes a fresh initiator, loads the target's metadata (N regions, one
//! 64-byte descriptor into each), waits `--gap-us`, then makes the first request and
//! the second. `--evict-kib K` touches K KiB of other memory between the two, so the
//! second finds the caches about as cold as the load leaves them for the first: what
//! is left of the first's excess is then work the first does and the second does not.
//! `--touch-target` writes every page of the target's memory before the first turn (as
//! a KV pool in use has been): without it, the first WRITE of a fresh process also
//! pays the target's first touch of its pages (64 page faults at 1,000 regions), which
//! is this program's memory, not Ferry's work. Within a process only the first turn
//! differs. `--warm-target`: a second initiator, made once, makes the same request to
//! the target right before each turn's first request (untimed), so the first finds the
//! target's side as warm as the second does, except for what belongs to the new
//! connection. `--other-bytes`: the second request moves other bytes than the first
//! (its own descriptor lists, source bytes and destination bytes: 128 bytes further
//! into each region, out of reach of the adjacent-line prefetch), so both requests find
//! the caller's data as cold as a turn leaves it;
//! without it the second re-reads the descriptors and bytes the first just touched.
//! Prints the median of each part over the turns, for both requests.
//! `FERRY_BENCH_UCX_PARAMS` (`key=value;key=value`) adds backend parameters to both
//! agents.

use std::time::{Duration, Instant};

use ferry::{Desc, MemKind, Op, XferStatus};
use ferry_tests::{register, try_register, Buffer, Rng};

/// Bytes per target region (one descriptor of 64 bytes goes into each).
const REGION: usize = 256;
const DESC: usize = 64;

/// Minor page faults of this thread so far (`/proc/thread-self/stat`, field 10).
fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/thread-self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.get(s.rfind(')')? + 2..)?.to_string();
            rest.split(' ').nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} takes a number, not '{v}'"))
        })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n = arg(&args, "--regions", 1000);
    let turns = arg(&args, "--turns", 41).max(1);
    let gap = Duration::from_micros(arg(&args, "--gap-us", 0) as u64);
    let rest = Duration::from_micros(arg(&args, "--rest-us", 0) as u64);
    let mut evict = vec![1u8; arg(&args, "--evict-kib", 0) * 1024];
    if let Err(reason) = ferry_benches::ucx_loopback() {
        eprintln!("first_request: UCX unavailable ({reason})");
        std::process::exit(2);
    }
    let mut dst = Buffer::zeroed(n * REGION);
    if args.iter().any(|a| a == "--touch-target") {
        for byte in dst.bytes_mut().iter_mut().step_by(4096) {
            *byte = std::hint::black_box(0);
        }
    }
    let other_bytes = args.iter().any(|a| a == "--other-bytes");
    // The first request's source is the first half, `--other-bytes`' second the other.
    let src = Buffer::random(2 * n * DESC, &mut Rng::new(3));
    let target =
        ferry_benches::ucx_bench_agent("first-request-target", &[("progress_thread", "true")]);
    for i in 0..n {
        try_register(&target, MemKind::Dram, dst.desc(i * REGION, REGION)).expect("register");
    }
    let blob = target.local_md().expect("metadata");
    let local: Vec<Desc> = (0..n).map(|i| src.desc(i * DESC, DESC)).collect();
    let remote: Vec<Desc> = (0..n).map(|i| dst.desc(i * REGION, DESC)).collect();
    let (local_b, remote_b): (Vec<Desc>, Vec<Desc>) = if other_bytes {
        (
            (0..n).map(|i| src.desc((n + i) * DESC, DESC)).collect(),
            (0..n)
                .map(|i| dst.desc(i * REGION + 2 * DESC, DESC))
                .collect(),
        )
    } else {
        (local.clone(), remote.clone())
    };
    // `--warm-target`: an initiator that warms the target before each first request.
    let warmer = args.iter().any(|a| a == "--warm-target").then(|| {
        let w = ferry_benches::ucx_bench_agent("first-request-warmer", &[]);
        register(&w, &src);
        let peer = w.load_remote_md(&blob).expect("load");
        (w, peer)
    });
    // [request][create, post, wait, faults]
    let mut parts = [[(); 4].map(|_| Vec::new()), [(); 4].map(|_| Vec::new())];
    let mut loads = Vec::with_capacity(turns);
    for _ in 0..turns {
        let a = ferry_benches::ucx_bench_agent("first-request-initiator", &[]);
        register(&a, &src);
        let loaded = Instant::now();
        let peer = a.load_remote_md(&blob).expect("load");
        loads.push(loaded.elapsed().as_secs_f64() * 1e6);
        if !gap.is_zero() {
            std::thread::sleep(gap);
        }
        if let Some((w, wpeer)) = &warmer {
            ferry_tests::write_and_wait(w, *wpeer, &local, &remote);
        }
        for (k, request) in parts.iter_mut().enumerate() {
            if k == 1 && !evict.is_empty() {
                for byte in evict.iter_mut().step_by(64) {
                    *byte = byte.wrapping_add(1);
                }
                std::hint::black_box(&evict);
            }
            let (l, r) = if k == 0 {
                (&local, &remote)
            } else {
                (&local_b, &remote_b)
            };
            let faults = minor_faults();
            let t0 = Instant::now();
            let x = a
                .create(Op::Write, MemKind::Dram, l, peer, MemKind::Dram, r, None)
                .expect("create");
            let t1 = Instant::now();
            let mut status = a.post(x).expect("post");
            let t2 = Instant::now();
            while status != XferStatus::Done {
                status = a.check(x).expect("check");
            }
            let t3 = Instant::now();
            a.release(x).expect("release");
            let us = |from: Instant, to: Instant| (to - from).as_secs_f64() * 1e6;
            request[0].push(us(t0, t1));
            request[1].push(us(t1, t2));
            request[2].push(us(t2, t3));
            request[3].push(minor_faults().saturating_sub(faults) as f64);
        }
        drop(a);
        if !rest.is_zero() {
            std::thread::sleep(rest);
        }
    }
    let load_us = median(&mut loads);
    println!(
        "regions={n} turns={turns} load {load_us:.1} us (p10-p90 {:.0}-{:.0})",
        loads[loads.len() / 10],
        loads[loads.len() * 9 / 10]
    );
    for (k, request) in parts.iter_mut().enumerate() {
        let spread = {
            let mut w = request[2].clone();
            w.sort_by(f64::total_cmp);
            format!("{:.0}-{:.0}", w[w.len() / 10], w[w.len() * 9 / 10])
        };
        let [c, p, w, f] = request.each_mut().map(|v| median(v));
        println!(
            "regions={n} turns={turns} evict_kib={} other_bytes={other_bytes} {} request: create {c:.1} us, post \
             {p:.1} us, wait {w:.1} us (p10-p90 {spread}), total {:.1} us, minor faults {f:.0}",
            evict.len() / 1024,
            ["first", "second"][k],
            c + p + w
        );
    }
}
