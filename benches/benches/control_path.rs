//! Control-path benchmarks on the loopback backend with 64-byte descriptors (the
//! loopback's real 64-byte copies included): record + flush per turn.
//!
//! - `prepared/{contiguous,shuffled}/N`: lists prepped once; make + post + check +
//!   release every turn.
//! - `full/{contiguous,shuffled}/N`: prep + make + post + check + release every turn.
//! - `create/{contiguous,shuffled}/N`: one-shot `create` (prep of both lists + make) +
//!   release, nothing posted: the work of NIXL's `initialize_xfer` +
//!   `release_xfer_handle` (`backends/ucx/bench/control-compare.sh` runs both).
//! - `ucx/create/{contiguous,shuffled}/N`: the same between two agents of this process
//!   over the UCX backend (skipped, with the reason, where UCX cannot load;
//!   `FERRY_UCX_LIBRARY` names the libucp). Only N = 1,024 and 16,384.
//! - `ucx/make/{contiguous,shuffled}/N`: over UCX, `make` from lists prepped once +
//!   release, nothing posted (the prepared path's control work; NIXL's
//!   `make_prepped_xfer`).
//! - `ucx/kv_layers/{plain,strided}/65536`: over UCX, 64 KV layers × 1,024 blocks of
//!   256 bytes (remote layers in shuffled order, blocks 512 bytes apart): `create`
//!   from plain lists built once (NIXL's `initialize_xfer` of the same lists,
//!   `backends/ucx/bench/strided-compare.sh`), and prep of 64 strided runs per side +
//!   make; both + release, nothing posted.
//! - `round_trip/1`: one-descriptor post + check of an existing request.
//! - `idle_progress/{shm,default,default_with_peer}`: one `Agent::progress` of an agent
//!   with nothing to do: SHM alone, the default backends, and the default backends with
//!   a peer loaded and connected (another agent of this process, each turn progressing
//!   both; LOOPBACK serves it, so UCX is on standby and `make_connection` makes its
//!   endpoint: over tcp an idle worker's progress is an `epoll_wait` unless the backend
//!   rests, see `ferry_ucx`'s docs, "Progress").
//!
//! Throughput is in descriptors, so criterion reports descriptors per second; divide
//! the time by N for nanoseconds per descriptor.
//!
//! The `control_path` cases time each turn on its own and hand criterion the median
//! turn × the sample's turns ([`per_turn_median`]): on a shared machine a preemption
//! then costs one turn, not a whole sample. The two clock reads per turn add ~50 ns per
//! turn (under 0.05 ns per descriptor at 1,024). `round_trip` is timed as criterion
//! does by default.
//!
//! Every timed turn checks that it succeeded (no command failed, the request is done:
//! a scan of a few outcomes, in the bench profile too), and after each layout's
//! benchmarks the destination is compared with the source block by block.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Bencher, BenchmarkId, Criterion, Throughput};
use ferry::{
    Agent, AgentConfig, CommandBuffer, Desc, MemKind, Op, Params, Side, StridedDesc, Ticket,
    XferStatus,
};
use ferry_tests::{assert_shuffled_copy, pair, register, unique, Buffer, Pair, Rng};

const BLOCK: usize = 64;

struct Setup {
    p: Pair,
    local: Vec<Desc>,
    remote: Vec<Desc>,
    /// Block `i` of `src` goes to block `order[i]` of `dst`.
    order: Vec<usize>,
    src: Buffer,
    dst: Buffer,
}

/// A timed turn succeeded: no command of the flush failed and the request is done.
fn assert_done(cmds: &CommandBuffer, done: Ticket<XferStatus>) {
    if let Some((index, error)) = cmds.errors().next() {
        panic!("command {index} of the timed flush failed: {error}");
    }
    assert_eq!(cmds.status(done), Ok(XferStatus::Done));
}

fn setup(n: usize, shuffled: bool) -> Setup {
    let mut rng = Rng::new(n as u64);
    let src = Buffer::random(n * BLOCK, &mut rng);
    let dst = Buffer::zeroed(n * BLOCK);
    let p = pair(&src, &dst);
    let local: Vec<Desc> = (0..n).map(|i| src.desc(i * BLOCK, BLOCK)).collect();
    let mut order: Vec<usize> = (0..n).collect();
    if shuffled {
        rng.shuffle(&mut order);
    }
    let remote: Vec<Desc> = order.iter().map(|&j| dst.desc(j * BLOCK, BLOCK)).collect();
    Setup {
        p,
        local,
        remote,
        order,
        src,
        dst,
    }
}

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

/// A flush's commands all succeeded.
fn assert_no_errors(cmds: &CommandBuffer) {
    if let Some((index, error)) = cmds.errors().next() {
        panic!("command {index} of the timed flush failed: {error}");
    }
}

/// One `create` + release turn (nothing posted), checked: no command failed (a failed
/// create fails its release too).
fn create_turn(
    cmds: &mut CommandBuffer,
    a: &Agent,
    peer: ferry::PeerId,
    local: &[Desc],
    remote: &[Desc],
) {
    cmds.clear();
    let x = cmds
        .create(Op::Write, MemKind::Dram, local, peer, MemKind::Dram, remote)
        .ticket();
    cmds.release(x);
    a.flush(cmds);
    assert_no_errors(cmds);
}

/// `ucx/create/{layout}/N`: `create` + release between two agents of this process over
/// UCX (`UCX_NET_DEVICES=lo` unless set), each with one registered buffer.
fn ucx_create(c: &mut Criterion) {
    if let Err(reason) = ferry_benches::ucx_loopback() {
        eprintln!("skipping control_path/ucx: UCX unavailable ({reason})");
        return;
    }
    let n_max = 16384;
    let mut rng = Rng::new(12);
    let src = Buffer::random(n_max * BLOCK, &mut rng);
    let dst = Buffer::zeroed(n_max * BLOCK);
    let agent = |name: &str| {
        let agent = Agent::new(AgentConfig::named(unique(name))).expect("agent");
        agent
            .create_backend("UCX", &Params::new())
            .expect("UCX backend");
        agent
    };
    let (a, b) = (agent("ctl-ucx-a"), agent("ctl-ucx-b"));
    register(&a, &src);
    register(&b, &dst);
    let b_at_a = a
        .load_remote_md(&b.local_md().expect("md b"))
        .expect("load b");
    let mut group = c.benchmark_group("control_path/ucx");
    let mut cmds = CommandBuffer::with_capacity(4);
    for &n in &[1024usize, 16384] {
        for &shuffled in &[false, true] {
            let layout = if shuffled { "shuffled" } else { "contiguous" };
            let mut order: Vec<usize> = (0..n).collect();
            if shuffled {
                rng.shuffle(&mut order);
            }
            let local: Vec<Desc> = (0..n).map(|i| src.desc(i * BLOCK, BLOCK)).collect();
            let remote: Vec<Desc> = order.iter().map(|&j| dst.desc(j * BLOCK, BLOCK)).collect();
            group.throughput(Throughput::Elements(n as u64));
            group.bench_function(BenchmarkId::new(format!("create/{layout}"), n), |bench| {
                per_turn_median(bench, || {
                    create_turn(&mut cmds, &a, b_at_a, &local, &remote)
                })
            });
            let local_prep = a.prep(Side::Local, MemKind::Dram, &local).expect("prep");
            let remote_prep = a.prep(b_at_a, MemKind::Dram, &remote).expect("prep");
            group.bench_function(BenchmarkId::new(format!("make/{layout}"), n), |bench| {
                per_turn_median(bench, || {
                    cmds.clear();
                    let x = cmds
                        .make(Op::Write, local_prep, &[], remote_prep, &[])
                        .ticket();
                    cmds.release(x);
                    a.flush(&mut cmds);
                    assert_no_errors(&cmds);
                })
            });
            a.release_prep(local_prep).expect("release");
            a.release_prep(remote_prep).expect("release");
        }
    }
    group.finish();
    kv_layers(c, &agent);
}

/// `ucx/kv_layers/{plain,strided}/65536` (see the module doc).
fn kv_layers(c: &mut Criterion, agent: &dyn Fn(&str) -> Agent) {
    const LAYERS: u64 = 64;
    const BLOCKS: u64 = 1024;
    const BLOCK: u64 = 256;
    let mut rng = Rng::new(64);
    let src = Buffer::random((LAYERS * BLOCKS * BLOCK) as usize, &mut rng);
    let dst = Buffer::zeroed((LAYERS * BLOCKS * 2 * BLOCK) as usize);
    let (a, b) = (agent("ctl-kv-a"), agent("ctl-kv-b"));
    register(&a, &src);
    register(&b, &dst);
    let peer = a
        .load_remote_md(&b.local_md().expect("md b"))
        .expect("load b");
    let (local_runs, remote_runs) =
        ferry_tests::kv_layer_runs(&src, &dst, (LAYERS, BLOCKS, BLOCK), &mut rng);
    let plain =
        |runs: &[StridedDesc]| -> Vec<Desc> { runs.iter().flat_map(|r| r.descs()).collect() };
    let (local, remote) = (plain(&local_runs), plain(&remote_runs));
    let n = LAYERS * BLOCKS;
    let mut group = c.benchmark_group("control_path/ucx");
    group.throughput(Throughput::Elements(n));
    group.sample_size(20);
    let mut cmds = CommandBuffer::with_capacity(8);
    group.bench_function(BenchmarkId::new("kv_layers/plain", n), |bench| {
        per_turn_median(bench, || create_turn(&mut cmds, &a, peer, &local, &remote))
    });
    group.bench_function(BenchmarkId::new("kv_layers/strided", n), |bench| {
        per_turn_median(bench, || {
            cmds.clear();
            let l = cmds.prep_strided(Side::Local, MemKind::Dram, &local_runs);
            let r = cmds.prep_strided(peer, MemKind::Dram, &remote_runs);
            let x = cmds.make(Op::Write, l, &[], r, &[]).ticket();
            cmds.release(x);
            cmds.release_prep(l);
            cmds.release_prep(r);
            a.flush(&mut cmds);
            assert_no_errors(&cmds);
        })
    });
    group.finish();
}

fn control_path(c: &mut Criterion) {
    let mut group = c.benchmark_group("control_path");
    for &n in &[1usize, 32, 1024, 16384] {
        for &shuffled in &[false, true] {
            let layout = if shuffled { "shuffled" } else { "contiguous" };
            let s = setup(n, shuffled);
            group.throughput(Throughput::Elements(n as u64));

            let local = s.p.a.prep(Side::Local, MemKind::Dram, &s.local).unwrap();
            let remote = s.p.a.prep(s.p.b_at_a, MemKind::Dram, &s.remote).unwrap();
            let mut cmds = CommandBuffer::with_capacity(16);
            group.bench_function(BenchmarkId::new(format!("prepared/{layout}"), n), |b| {
                per_turn_median(b, || {
                    cmds.clear();
                    let x = cmds.make(Op::Write, local, &[], remote, &[]).ticket();
                    cmds.post(x);
                    let done = cmds.check(x);
                    cmds.release(x);
                    s.p.a.flush(&mut cmds);
                    assert_done(&cmds, done);
                })
            });

            group.bench_function(BenchmarkId::new(format!("full/{layout}"), n), |b| {
                per_turn_median(b, || {
                    cmds.clear();
                    let l = cmds.prep(Side::Local, MemKind::Dram, &s.local);
                    let r = cmds.prep(s.p.b_at_a, MemKind::Dram, &s.remote);
                    let x = cmds.make(Op::Write, l, &[], r, &[]).ticket();
                    cmds.post(x);
                    let done = cmds.check(x);
                    cmds.release(x);
                    cmds.release_prep(l);
                    cmds.release_prep(r);
                    s.p.a.flush(&mut cmds);
                    assert_done(&cmds, done);
                })
            });
            group.bench_function(BenchmarkId::new(format!("create/{layout}"), n), |b| {
                per_turn_median(b, || {
                    create_turn(&mut cmds, &s.p.a, s.p.b_at_a, &s.local, &s.remote)
                })
            });
            // One untimed turn, so the copy is checked also when a filter skipped the
            // timed ones.
            cmds.clear();
            let x = cmds.make(Op::Write, local, &[], remote, &[]).ticket();
            cmds.post(x);
            let done = cmds.check(x);
            cmds.release(x);
            s.p.a.flush(&mut cmds);
            assert_done(&cmds, done);
            assert_shuffled_copy(&s.src, &s.dst, &s.order, BLOCK, "control_path");
        }
    }
    group.finish();
    ucx_create(c);
    idle_progress(c);

    // One-descriptor post + check round trip of an existing request.
    let s = setup(1, false);
    let x =
        s.p.a
            .create(
                Op::Write,
                MemKind::Dram,
                &s.local,
                s.p.b_at_a,
                MemKind::Dram,
                &s.remote,
                None,
            )
            .unwrap();
    let mut cmds = CommandBuffer::with_capacity(4);
    cmds.post(x);
    s.p.a.flush(&mut cmds);
    c.bench_function("round_trip/post+check/1", |b| {
        b.iter(|| {
            cmds.clear();
            cmds.post(x);
            let done = cmds.check(x);
            s.p.a.flush(&mut cmds);
            assert_done(&cmds, done);
        })
    });
    assert_shuffled_copy(&s.src, &s.dst, &s.order, BLOCK, "round_trip");
}

/// `idle_progress/*`: `Agent::progress` with nothing in flight.
fn idle_progress(c: &mut Criterion) {
    let default_agent = |name: &str| {
        let agent = Agent::new(AgentConfig::named(unique(name))).expect("agent");
        agent
            .create_default_backends(|_| Params::new())
            .expect("default backends");
        agent
    };
    let shm = Agent::new(AgentConfig::named(unique("idle-shm"))).expect("agent");
    shm.create_backend("SHM", &Params::new())
        .expect("SHM backend");
    let mut group = c.benchmark_group("control_path/idle_progress");
    group.bench_function("shm", |b| b.iter(|| shm.progress()));
    let alone = default_agent("idle-default");
    group.bench_function("default", |b| b.iter(|| alone.progress()));
    if let Err(reason) = ferry_benches::ucx_loopback() {
        eprintln!(
            "skipping control_path/idle_progress/default_with_peer: UCX unavailable ({reason})"
        );
    } else {
        let (a, b) = (default_agent("idle-a"), default_agent("idle-b"));
        let (b_at_a, a_at_b) = ferry_tests::exchange_md(&a, &b);
        // Every backend that loaded the peer connects, UCX on standby too.
        a.make_connection(b_at_a).expect("connect a to b");
        b.make_connection(a_at_b).expect("connect b to a");
        group.bench_function("default_with_peer", |bench| {
            bench.iter(|| {
                b.progress();
                a.progress()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, control_path);
criterion_main!(benches);
