//! What logging costs a steady-state flush: the same turn (make + post + check + release
//! of a 64-descriptor request on the loopback backend, prepared lists, 64-byte blocks)
//! timed with
//!
//! 1. `off`: no logger installed (`log`'s max level is Off: a log statement is one
//!    relaxed atomic load);
//! 2. `subscriber_info`: the `ferry` tool's setup — a `tracing-subscriber` fmt
//!    subscriber with an `info` filter, receiving the libraries' `log` records through
//!    tracing-log (its `try_init` sets `log`'s max level to Info), writing to stderr;
//! 3. `subscriber_info_log_trace`: the same subscriber, but `log`'s max level raised to
//!    Trace by hand (what an application gets that sets it itself): every disabled
//!    statement then asks the subscriber, which refuses;
//! 4. `subscriber_trace_to_sink`: the flush summary on (`ferry::flush=trace`), formatted
//!    and written to `io::sink` — what turning it on costs.
//!
//! Between 3 and 4, `interleaved` runs the three "off" settings turn by turn (switching
//! `log`'s max level) and prints their medians: a fairer comparison on a shared machine
//! whose speed drifts between criterion's cases.
//!
//! A global subscriber cannot be removed, so the cases run in this order in one
//! process; run the whole file (`cargo bench -p ferry-benches --bench logging`), not a
//! filter that skips `off`. Each turn checks that it succeeded. As in `control_path`,
//! each turn is timed alone and criterion gets the median turn × the sample's turns
//! (a preemption on a shared machine costs one turn, not a sample).

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Bencher, Criterion, Throughput};
use ferry::{CommandBuffer, Desc, MemKind, Op, Side, XferStatus};
use ferry_tests::{pair, Buffer, Rng};
use tracing_subscriber::EnvFilter;

const BLOCK: usize = 64;
const N: usize = 64;

/// Which filter the reloadable subscriber applies (0 = info, 1 = trace for the flush).
static FILTER: AtomicU8 = AtomicU8::new(0);

fn flush_with_logging(c: &mut Criterion) {
    let mut rng = Rng::new(7);
    let src = Buffer::random(N * BLOCK, &mut rng);
    let dst = Buffer::zeroed(N * BLOCK);
    let p = pair(&src, &dst);
    let local: Vec<Desc> = (0..N).map(|i| src.desc(i * BLOCK, BLOCK)).collect();
    let mut order: Vec<usize> = (0..N).collect();
    rng.shuffle(&mut order);
    let remote: Vec<Desc> = order.iter().map(|&j| dst.desc(j * BLOCK, BLOCK)).collect();
    let l = p.a.prep(Side::Local, MemKind::Dram, &local).unwrap();
    let r = p.a.prep(p.b_at_a, MemKind::Dram, &remote).unwrap();
    let mut cmds = CommandBuffer::with_capacity(8);
    let mut turn = || {
        cmds.clear();
        let x = cmds.make(Op::Write, l, &[], r, &[]).ticket();
        let posted = cmds.post(x);
        cmds.release(x);
        p.a.flush(&mut cmds);
        assert!(cmds.errors().next().is_none(), "a timed flush failed");
        assert_eq!(cmds.status(posted), Ok(XferStatus::Done));
    };

    let mut group = c.benchmark_group("logging/flush");
    group.throughput(Throughput::Elements(1));
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));

    assert_eq!(log::max_level(), log::LevelFilter::Off);
    group.bench_function("off", |b| per_turn_median(b, &mut turn));

    let (filter, reload) = tracing_subscriber::reload::Layer::new(EnvFilter::new("info"));
    {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        let writer = || -> Box<dyn std::io::Write> {
            match FILTER.load(Ordering::Relaxed) {
                0 => Box::new(std::io::stderr()),
                _ => Box::new(std::io::sink()),
            }
        };
        tracing_subscriber::registry()
            .with(filter)
            .with(tracing_subscriber::fmt::layer().with_writer(writer))
            .try_init()
            .expect("install the subscriber");
    }
    assert_eq!(log::max_level(), log::LevelFilter::Info);
    group.bench_function("subscriber_info", |b| per_turn_median(b, &mut turn));

    log::set_max_level(log::LevelFilter::Trace);
    group.bench_function("subscriber_info_log_trace", |b| {
        per_turn_median(b, &mut turn)
    });

    interleaved(&mut turn);

    FILTER.store(1, Ordering::Relaxed);
    reload
        .reload(EnvFilter::new("info,ferry::flush=trace"))
        .expect("reload the filter");
    // `log`'s max level is still Trace (case 3), so the summary's records get through.
    group.bench_function("subscriber_trace_to_sink", |b| {
        per_turn_median(b, &mut turn)
    });
    group.finish();
    ferry_tests::assert_shuffled_copy(&src, &dst, &order, BLOCK, "logging bench");
}

/// Turns of each setting in [`interleaved`].
const ROUNDS: usize = 20_000;

/// The three "off" settings turn by turn in one loop — `log`'s max level Off (for the
/// libraries, which log only through `log`, the same as no logger: every statement
/// stops at that level check), Info (the subscriber's own), Trace (every statement asks
/// the subscriber) — so a shared machine's changing speed hits all three alike; prints
/// each one's median turn.
fn interleaved(turn: &mut impl FnMut()) {
    let levels = [
        ("log off", log::LevelFilter::Off),
        ("subscriber at info", log::LevelFilter::Info),
        ("subscriber at info, log at trace", log::LevelFilter::Trace),
    ];
    let mut times: [Vec<Duration>; 3] = std::array::from_fn(|_| Vec::with_capacity(ROUNDS));
    for _ in 0..ROUNDS {
        for (k, &(_, level)) in levels.iter().enumerate() {
            log::set_max_level(level);
            let t0 = Instant::now();
            turn();
            times[k].push(t0.elapsed());
        }
    }
    log::set_max_level(log::LevelFilter::Trace);
    for ((what, _), t) in levels.iter().zip(&mut times) {
        t.sort_unstable();
        eprintln!(
            "logging/flush interleaved ({ROUNDS} turns each): {what}: median {} ns",
            t[ROUNDS / 2].as_nanos()
        );
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

criterion_group!(benches, flush_with_logging);
criterion_main!(benches);
