//! Scaling axes (issue 25): costs that should stay flat per unit as the work grows.
//! A regression on one axis shows as a per-element time that climbs with its size.
//!
//! - `scaling/create/N`, N = 1, 64, 1,024, 16,384, 262,144: one-shot `create` (prep of
//!   both lists + make) + release of N 64-byte descriptors in shuffled remote order
//!   between two loopback agents, nothing posted. Criterion's throughput is in
//!   descriptors: the time ÷ N is the cost per descriptor.
//! - `scaling/md_encode/N`, N = 1,000, 15,000, 100,000: `Agent::local_md` of an agent
//!   with N registered regions (loopback backend; 64-byte regions side by side).
//! - `scaling/md_writer_ucx/N`: the codec alone (`MdWriter`), N DRAM regions 2 MiB apart
//!   each with a 27-byte UCX rkey, as `Agent::local_md` feeds it for a UCX agent.
//! - `scaling/md_load/N`: `load_remote_md` of that agent's blob (validate + index) into
//!   an agent that knew it (`invalidate_remote_md` between turns, not timed).
//!
//! - `scaling/ucx_md_encode/N`, N = 1,000, 15,000, 100,000: `local_md` of an agent with
//!   N regions registered with UCX (real rkeys in the blob).
//! - `scaling/ucx_first_request/N` and `scaling/ucx_second_request/N`, N = 1,000 and
//!   15,000: over UCX (two agents of this process, `UCX_NET_DEVICES=lo`), an agent
//!   that just loaded the metadata of a peer with N registered regions makes, posts
//!   and waits for one WRITE of N 64-byte descriptors, one into each region: the first
//!   such request after the load, then the second. Whatever the load deferred (the
//!   endpoint, rkey unpacking) shows as the first's excess over the second.
//!   `scaling/ucx_first_request_lazy/N` is the first with `connect_on_load=false`
//!   (what the load then defers), `scaling/ucx_load/N` the load itself. Skipped,
//!   with the reason, where UCX cannot load (`FERRY_UCX_LIBRARY` names the libucp).
//!   `FERRY_BENCH_UCX_PARAMS` (`key=value;key=value`) adds backend parameters to both
//!   agents.
//!
//! - `strided/prep_make/{plain,plain_built,strided}`: prep of both lists + make +
//!   release of 64 layers × 1,024 blocks of 256 bytes (remote layers in shuffled order,
//!   blocks 512 bytes apart), between two loopback agents: from plain lists built
//!   once, from plain lists built every turn (what a caller without strided lists
//!   pays), and from 64 strided runs per side (`prep_strided`).
//!
//! - `scaling/in_flight/N`, N = 1, 100, 10,000: N one-descriptor requests (64 bytes,
//!   made once) between two loopback agents whose backend holds every completion for
//!   two progress calls, so all N are in flight at once: one flush posts all N, then
//!   flushes of N checks run until every one is done. Throughput in requests: the time
//!   ÷ N is post + check per request with N in flight.
//! - `scaling/loaded_peers/N`, N = 1, 100, 10,000: an agent that has loaded N peers
//!   (N metadata blobs under N names, all naming one loopback target) flushes one
//!   buffer of create + post + release of a 64-byte WRITE to one of them (a different
//!   one each turn). The time per flush should not grow with the peers loaded.
//!
//! Each turn is timed alone and criterion gets the median turn × the sample's turns
//! (as `control_path` does), so a preemption on a shared machine costs one turn.
//!
//! Run: `cargo bench -p ferry-benches --bench scaling -- --warm-up-time 1 --measurement-time 3`

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Bencher, BenchmarkId, Criterion, Throughput};
use ferry::{
    Agent, AgentConfig, CommandBuffer, Desc, MemKind, Op, Outcome, Params, Side, StridedDesc,
    XferStatus,
};
use ferry_metadata::{MdWriter, PeerMd};
use ferry_tests::{loopback_agent, pair, register, try_register, unique, Buffer, Rng};

/// Bytes per descriptor of the create axis.
const BLOCK: usize = 64;

/// Run `turn` `iters` times, each timed alone, and report `iters` × the median turn.
fn per_turn_median(b: &mut Bencher<'_>, mut turn: impl FnMut()) {
    let mut times: Vec<Duration> = Vec::new();
    b.iter_custom(|iters| {
        times.clear();
        for _ in 0..iters {
            let t0 = Instant::now();
            turn();
            times.push(t0.elapsed());
        }
        times.sort_unstable();
        times[times.len() / 2] * iters as u32
    })
}

fn create(c: &mut Criterion) {
    let mut group = c.benchmark_group("scaling");
    for &n in &[1usize, 64, 1024, 16384, 262_144] {
        let mut rng = Rng::new(n as u64);
        let src = Buffer::random(n * BLOCK, &mut rng);
        let dst = Buffer::zeroed(n * BLOCK);
        let p = pair(&src, &dst);
        let local: Vec<Desc> = (0..n).map(|i| src.desc(i * BLOCK, BLOCK)).collect();
        let mut order: Vec<usize> = (0..n).collect();
        rng.shuffle(&mut order);
        let remote: Vec<Desc> = order.iter().map(|&j| dst.desc(j * BLOCK, BLOCK)).collect();
        let mut cmds = CommandBuffer::with_capacity(4);
        group.throughput(Throughput::Elements(n as u64));
        if n >= 16384 {
            group.sample_size(10);
        }
        group.bench_function(BenchmarkId::new("create", n), |b| {
            per_turn_median(b, || {
                cmds.clear();
                let x = cmds
                    .create(
                        Op::Write,
                        MemKind::Dram,
                        &local,
                        p.b_at_a,
                        MemKind::Dram,
                        &remote,
                    )
                    .ticket();
                cmds.release(x);
                p.a.flush(&mut cmds);
                if let Some((index, error)) = cmds.errors().next() {
                    panic!("command {index} of the timed flush failed: {error}");
                }
            })
        });
        group.sample_size(100);
    }
    group.finish();
}

/// A 27-byte UCX rkey frame, the same for every region (see `benches/metadata.rs`).
const UCX_RKEY: [u8; 27] = [
    0x46, 0x52, 0x4b, 0x31, 0x0b, 0x00, 0x00, 0x00, 0xc1, 0x94, 0x6f, 0xe2, 0xe3, 0xe1, 0xcc, 0x97,
    0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff,
];

fn metadata(c: &mut Criterion) {
    let mut group = c.benchmark_group("scaling");
    for &n in &[1000usize, 15_000, 100_000] {
        group.throughput(Throughput::Elements(n as u64));
        if n >= 15_000 {
            group.sample_size(20);
        }
        // The codec alone, with UCX-sized public metadata.
        group.bench_function(BenchmarkId::new("md_writer_ucx", n), |b| {
            per_turn_median(b, || {
                let mut writer = MdWriter::new("prefill-worker-0", 1);
                let ucx = writer.backend("UCX", Some(&[0xab; 64]));
                writer.reserve(ucx, MemKind::Dram, n, n * UCX_RKEY.len());
                for i in 0..n as u64 {
                    let desc = Desc::new(0x7f00_0000_0000 + i * (2 << 20), 1 << 20, 0);
                    writer.region(ucx, MemKind::Dram, desc, &UCX_RKEY);
                }
                std::hint::black_box(writer.finish().expect("valid metadata"));
            })
        });
        // Through an agent: N regions of 64 bytes side by side in one buffer.
        let buffer = Buffer::zeroed(n * BLOCK);
        let a = loopback_agent("scaling-md-a");
        for i in 0..n {
            try_register(&a, MemKind::Dram, buffer.desc(i * BLOCK, BLOCK)).expect("register");
        }
        group.bench_function(BenchmarkId::new("md_encode", n), |b| {
            per_turn_median(b, || {
                std::hint::black_box(a.local_md().expect("local md"));
            })
        });
        let blob = a.local_md().expect("local md");
        let b_agent = loopback_agent("scaling-md-b");
        group.bench_function(BenchmarkId::new("md_load", n), |b| {
            let mut times: Vec<Duration> = Vec::new();
            b.iter_custom(|iters| {
                times.clear();
                for _ in 0..iters {
                    let t0 = Instant::now();
                    let peer = b_agent.load_remote_md(&blob).expect("load");
                    times.push(t0.elapsed());
                    b_agent.invalidate_remote_md(peer).expect("invalidate");
                }
                times.sort_unstable();
                times[times.len() / 2] * iters as u32
            })
        });
        group.sample_size(100);
    }
    group.finish();
}

/// Bytes per region (and per descriptor) of the UCX first-request axis.
const UCX_REGION: usize = 256;

/// An agent with a UCX backend; `progress_thread` for the target, which nothing else
/// progresses.
fn ucx_agent(name: &str, progress_thread: bool) -> Agent {
    ucx_agent_with(name, progress_thread, true)
}

fn ucx_agent_with(name: &str, progress_thread: bool, connect_on_load: bool) -> Agent {
    let mut params = Vec::new();
    if progress_thread {
        params.push(("progress_thread", "true"));
    }
    if !connect_on_load {
        params.push(("connect_on_load", "false"));
    }
    ferry_benches::ucx_bench_agent(name, &params)
}

fn ucx_first_request(c: &mut Criterion) {
    if let Err(reason) = ferry_benches::ucx_loopback() {
        eprintln!("skipping scaling/ucx_*_request: UCX unavailable ({reason})");
        return;
    }
    let mut group = c.benchmark_group("scaling");
    group.sample_size(10);
    // `local_md` of an agent with N UCX-registered regions (4 KiB apart in untouched
    // memory), real rkeys in its metadata.
    for &n in &[1000usize, 15_000, 100_000] {
        let space = Buffer::zeroed(n * 4096);
        let a = ucx_agent("scaling-ucx-md", false);
        for i in 0..n {
            try_register(&a, MemKind::Dram, space.desc(i * 4096, 4096)).expect("register");
        }
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(BenchmarkId::new("ucx_md_encode", n), |b| {
            per_turn_median(b, || {
                std::hint::black_box(a.local_md().expect("local md"));
            })
        });
    }
    for &n in &[1000usize, 15_000] {
        let dst = Buffer::zeroed(n * UCX_REGION);
        let mut rng = Rng::new(3);
        let src = Buffer::random(n * BLOCK, &mut rng);
        // A target agent with N UCX regions in `dst`: (agent, its metadata).
        let target_of = |name: &str, dst: &Buffer| {
            let target = ucx_agent(name, true);
            for i in 0..n {
                try_register(&target, MemKind::Dram, dst.desc(i * UCX_REGION, UCX_REGION))
                    .expect("register");
            }
            let blob = target.local_md().expect("md");
            (target, blob)
        };
        let (_target, blob) = target_of("scaling-ucx-target", &dst);
        // A second peer of the same shape, for `_used_agent`: its request warms what
        // belongs to the initiator (its tables, UCX's pools), not to the peer timed.
        let other_dst = Buffer::zeroed(n * UCX_REGION);
        let (_other, other_blob) = target_of("scaling-ucx-other", &other_dst);
        let other_remote: Vec<Desc> = (0..n)
            .map(|i| other_dst.desc(i * UCX_REGION, BLOCK))
            .collect();
        let local: Vec<Desc> = (0..n).map(|i| src.desc(i * BLOCK, BLOCK)).collect();
        let remote: Vec<Desc> = (0..n).map(|i| dst.desc(i * UCX_REGION, BLOCK)).collect();
        group.throughput(Throughput::Elements(n as u64));
        // A fresh initiator per turn (made and loaded untimed): the timed request is
        // the first after the load.
        // `_lazy`: with `connect_on_load=false` (the endpoint and rkeys wait for the
        // first request); `ucx_load`: the load itself, with the default.
        // `_used_agent`: the initiator first loads the other peer and makes one request
        // of the same shape to it (untimed), so the timed first request to this peer
        // pays only what this peer's load deferred, not the agent's own first use.
        for (name, warm_turns, eager, used) in [
            ("ucx_first_request", 0, true, false),
            ("ucx_second_request", 1, true, false),
            ("ucx_first_request_used_agent", 0, true, true),
            ("ucx_first_request_lazy", 0, false, false),
            ("ucx_load", usize::MAX, true, false),
        ] {
            group.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter_custom(|iters| {
                    let mut times = Vec::new();
                    for _ in 0..iters {
                        let a = ucx_agent_with("scaling-ucx-initiator", false, eager);
                        register(&a, &src);
                        if used {
                            let warm = a.load_remote_md(&other_blob).expect("load");
                            ferry_tests::write_and_wait(&a, warm, &local, &other_remote);
                        }
                        let t0 = Instant::now();
                        let peer = a.load_remote_md(&blob).expect("load");
                        if warm_turns == usize::MAX {
                            times.push(t0.elapsed());
                            continue;
                        }
                        for _ in 0..warm_turns {
                            ferry_tests::write_and_wait(&a, peer, &local, &remote);
                        }
                        let t0 = Instant::now();
                        ferry_tests::write_and_wait(&a, peer, &local, &remote);
                        times.push(t0.elapsed());
                    }
                    times.sort_unstable();
                    times[times.len() / 2] * iters as u32
                })
            });
        }
    }
    group.finish();
}

fn strided(c: &mut Criterion) {
    const LAYERS: u64 = 64;
    const BLOCKS: u64 = 1024;
    const BLOCK: u64 = 256;
    let mut rng = Rng::new(64);
    let src = Buffer::random((LAYERS * BLOCKS * BLOCK) as usize, &mut rng);
    let dst = Buffer::zeroed((LAYERS * BLOCKS * 2 * BLOCK) as usize);
    let p = pair(&src, &dst);
    let (local_runs, remote_runs) =
        ferry_tests::kv_layer_runs(&src, &dst, (LAYERS, BLOCKS, BLOCK), &mut rng);
    let plain =
        |runs: &[StridedDesc]| -> Vec<Desc> { runs.iter().flat_map(|r| r.descs()).collect() };
    let (local, remote) = (plain(&local_runs), plain(&remote_runs));
    let mut group = c.benchmark_group("strided");
    group.throughput(Throughput::Elements(LAYERS * BLOCKS));
    group.sample_size(20);
    let mut cmds = CommandBuffer::with_capacity(8);
    let turn = |cmds: &mut CommandBuffer,
                p: &ferry_tests::Pair,
                strided: bool,
                local: &[Desc],
                remote: &[Desc]| {
        cmds.clear();
        let (l, r) = if strided {
            (
                cmds.prep_strided(Side::Local, MemKind::Dram, &local_runs),
                cmds.prep_strided(p.b_at_a, MemKind::Dram, &remote_runs),
            )
        } else {
            (
                cmds.prep(Side::Local, MemKind::Dram, local),
                cmds.prep(p.b_at_a, MemKind::Dram, remote),
            )
        };
        let x = cmds.make(Op::Write, l, &[], r, &[]).ticket();
        cmds.release(x);
        cmds.release_prep(l);
        cmds.release_prep(r);
        p.a.flush(cmds);
        if let Some((index, error)) = cmds.errors().next() {
            panic!("command {index} of the timed flush failed: {error}");
        }
    };
    group.bench_function("prep_make/plain", |b| {
        per_turn_median(b, || turn(&mut cmds, &p, false, &local, &remote))
    });
    group.bench_function("prep_make/plain_built", |b| {
        per_turn_median(b, || {
            let (local, remote) = (plain(&local_runs), plain(&remote_runs));
            turn(&mut cmds, &p, false, &local, &remote)
        })
    });
    group.bench_function("prep_make/strided", |b| {
        per_turn_median(b, || turn(&mut cmds, &p, true, &[], &[]))
    });
    group.finish();
}

fn in_flight(c: &mut Criterion) {
    let mut group = c.benchmark_group("scaling");
    for &n in &[1usize, 100, 10_000] {
        let mut rng = Rng::new(n as u64 + 7);
        let src = Buffer::random(n * BLOCK, &mut rng);
        let dst = Buffer::zeroed(n * BLOCK);
        let p = pair(&src, &dst);
        let local: Vec<Desc> = (0..n).map(|i| src.desc(i * BLOCK, BLOCK)).collect();
        let remote: Vec<Desc> = (0..n).map(|i| dst.desc(i * BLOCK, BLOCK)).collect();
        let l =
            p.a.prep(Side::Local, MemKind::Dram, &local)
                .expect("prep local");
        let r =
            p.a.prep(p.b_at_a, MemKind::Dram, &remote)
                .expect("prep remote");
        let xfers: Vec<ferry::XferId> = (0..n as u32)
            .map(|i| p.a.make(Op::Write, l, &[i], r, &[i], None).expect("make"))
            .collect();
        ferry::loopback::faults(p.a.name())
            .expect("loopback faults")
            .complete_late(2);
        let mut cmds = CommandBuffer::with_capacity(n);
        let mut checks = Vec::with_capacity(n);
        group.throughput(Throughput::Elements(n as u64));
        if n >= 10_000 {
            group.sample_size(20);
        }
        group.bench_function(BenchmarkId::new("in_flight", n), |b| {
            per_turn_median(b, || {
                cmds.clear();
                for &x in &xfers {
                    cmds.post(x);
                }
                p.a.flush(&mut cmds);
                let mut in_progress = 0;
                for (i, o) in cmds.outcomes().iter().enumerate() {
                    match o {
                        Outcome::Status(XferStatus::InProgress) => in_progress += 1,
                        Outcome::Status(_) => {}
                        other => panic!("post {i}: {other:?}"),
                    }
                }
                assert_eq!(in_progress, n, "every request is in flight after the post");
                loop {
                    cmds.clear();
                    checks.clear();
                    checks.extend(xfers.iter().map(|&x| cmds.check(x)));
                    p.a.flush(&mut cmds);
                    let done = checks
                        .iter()
                        .filter(|&&t| cmds.status(t).expect("check") == XferStatus::Done)
                        .count();
                    if done == n {
                        break;
                    }
                }
            })
        });
        group.sample_size(100);
    }
    group.finish();
}

/// `blob` under another agent name (the same backends, connection info and regions).
fn renamed(blob: &[u8], name: &str) -> Vec<u8> {
    let md = PeerMd::from_bytes(blob).expect("valid metadata");
    let mut writer = MdWriter::new(name, md.generation());
    let backends: Vec<u8> = (0..md.backend_count() as u8)
        .map(|i| {
            let (backend, conn) = md.backend(i).expect("backend");
            writer.backend(backend, conn)
        })
        .collect();
    for region in md.regions() {
        writer.region(
            backends[usize::from(region.backend)],
            region.kind,
            region.desc,
            region.public_md,
        );
    }
    writer.finish().expect("valid metadata")
}

fn loaded_peers(c: &mut Criterion) {
    let mut group = c.benchmark_group("scaling");
    let mut rng = Rng::new(11);
    let src = Buffer::random(BLOCK, &mut rng);
    let dst = Buffer::zeroed(BLOCK);
    let target = loopback_agent("scaling-peers-target");
    register(&target, &dst);
    let blob = target.local_md().expect("md");
    for &n in &[1usize, 100, 10_000] {
        let mut config = AgentConfig::named(unique("scaling-peers"));
        config.bounds.peers_max = config.bounds.peers_max.max(2 * n);
        let a = Agent::new(config).expect("agent");
        a.create_backend("LOOPBACK", &Params::new())
            .expect("loopback backend");
        register(&a, &src);
        let peers: Vec<ferry::PeerId> = (0..n)
            .map(|i| {
                a.load_remote_md(&renamed(&blob, &format!("peer-{i}")))
                    .expect("load")
            })
            .collect();
        let mut cmds = CommandBuffer::with_capacity(4);
        let mut turn = 0usize;
        group.throughput(Throughput::Elements(1));
        group.bench_function(BenchmarkId::new("loaded_peers", n), |b| {
            per_turn_median(b, || {
                turn += 1;
                cmds.clear();
                let x = cmds
                    .create(
                        Op::Write,
                        MemKind::Dram,
                        &[src.whole()],
                        peers[turn % n],
                        MemKind::Dram,
                        &[dst.whole()],
                    )
                    .ticket();
                cmds.post(x);
                cmds.release(x);
                a.flush(&mut cmds);
                if let Some((index, error)) = cmds.errors().next() {
                    panic!("command {index} of the timed flush failed: {error}");
                }
            })
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    create,
    in_flight,
    loaded_peers,
    metadata,
    strided,
    ucx_first_request
);
criterion_main!(benches);
