//! A warmed-up flush allocates nothing: proven with a counting global allocator, through
//! the `Agent`, on LOOPBACK, POSIX (both engines where the kernel allows io_uring),
//! UCX (when libucp is there; required under `CI=true`) and SHM (both kinds of remote
//! memory: a mapped shareable segment and process_vm_writev/readv), with notifications longer than
//! 64 bytes (past any inline buffer) and with the metadata exchange running and used
//! (P2P listeners, metadata fetched both ways first). (Its own test binary, because the
//! allocator is global.)
//!
//! What is counted: every allocation on the flushing thread (which also runs the
//! exchange pre-phase and the backends' post and progress) and on the backends' own
//! worker threads (`ferry-posix-*`, `ferry-ucx-*`). The exchange's network threads are
//! counted apart and printed, not asserted: they serve peers, not the flush, and (at the
//! time of writing) allocate while idle connections are open — see the report in
//! `assert_no_allocation`.
//!
//! Logging: every part runs twice — with no logger, then with the `ferry` tool's
//! subscriber installed at `info` (a `tracing-subscriber` fmt subscriber receiving the
//! libraries' `log` records, writing to stderr): debug and trace stay off, and a flush
//! still allocates nothing. The loopback part runs a third time with `log`'s max level
//! raised to Trace by hand, so every disabled log statement reaches the subscriber and
//! is refused there — still nothing allocated.
//!
//! Also (`first_request_after_a_load`): an agent's very first request after it loaded a
//! peer — a one-shot `create` of 1,024 descriptors, or two prepared lists and `make`,
//! WRITE or READ, then post, checks, release, on LOOPBACK and on UCX — allocates
//! nothing either: the load readied the request path for it
//! (issue 25: the first request no slower than the second).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferry::exchange::{ExchangeConfig, P2pConfig, Via};
use ferry::{
    Agent, AgentConfig, CommandBuffer, Desc, FileMode, MemKind, Op, Outcome, Params, Side,
    XferStatus,
};
use ferry_tests::counting::{counted_by_thread, CountingAlloc};
use ferry_tests::{pair, register, unique, Buffer, Rng};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Turns before counting (pools, arenas and queues reach their high-water marks).
const WARM_TURNS: usize = 8;
/// Turns counted.
const COUNTED_TURNS: usize = 64;
/// A notification attached to a transfer: over 64 bytes.
const ATTACHED: &[u8] = &[0xA5; 100];
/// A standalone notification: over 64 bytes.
const STANDALONE: &[u8] = &[0x5A; 300];

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Start the metadata exchange with a P2P listener on 127.0.0.1.
fn start_exchange(agent: &Agent) {
    let mut config = ExchangeConfig::default();
    config.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
    agent.start_exchange(config).expect("start the exchange");
    assert!(agent.exchange_workers_running());
}

/// Have `a` fetch `b`'s metadata over P2P and wait until it is loaded: every exchange
/// thread of both agents (listener, connection, client worker, reader) has then run
/// and reached its idle wait, so their one-time start-up allocations (a thread's first
/// blocking channel receive allocates its wait context, for one) fall before the
/// counting window instead of racing into it.
fn exercise_exchange(a: &Agent, b: &Agent) {
    let to = Via::Peer(b.exchange_listen_addr().expect("b listens"));
    a.fetch_remote_md(b.name(), to, None)
        .expect("fetch over P2P");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !a.check_remote_md(b.name(), None).expect("check") {
        assert!(Instant::now() < deadline, "P2P fetch did not complete");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Events that trail the fetch (the other side's view of the exchange) are applied
    // here, not by a counted flush: poll both until neither got one for 50 ms.
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_millis(50) {
        assert!(Instant::now() < deadline, "the exchange never went quiet");
        let applied = a.poll_exchange().expect("poll a") + b.poll_exchange().expect("poll b");
        if applied > 0 {
            quiet_since = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Run `turn` warm, then counted, and require zero allocations on the flush's threads.
fn assert_no_allocation(what: &str, mut turn: impl FnMut()) {
    for _ in 0..WARM_TURNS {
        turn();
    }
    let ((), counts) = counted(|| {
        for _ in 0..COUNTED_TURNS {
            turn();
        }
    });
    if counts.elsewhere > 0 {
        eprintln!(
            "{what}: {} allocation(s) on other threads (the exchange's) during \
             {COUNTED_TURNS} turns",
            counts.elsewhere
        );
    }
    assert_eq!(counts.flush, 0, "{what}: a warmed-up flush allocated");
}

/// Threads that work for the flush besides the flushing one: the backends' workers.
const FLUSH_THREADS: &[&str] = &["ferry-posix", "ferry-ucx"];

/// Run `f` and count allocations on the flush's threads and elsewhere.
fn counted<R>(f: impl FnOnce() -> R) -> (R, Counts) {
    let (r, c) = counted_by_thread(FLUSH_THREADS, f);
    (
        r,
        Counts {
            flush: c.own,
            elsewhere: c.elsewhere,
        },
    )
}

/// Allocations seen while counting.
#[derive(Clone, Copy, Debug)]
struct Counts {
    /// On the flushing thread and the backends' workers.
    flush: usize,
    /// On any other thread (the exchange's).
    elsewhere: usize,
}

/// Only one test in this binary: the counter (and the log subscriber) is process-wide.
#[test]
fn steady_state_flushes_do_not_allocate() {
    assert_eq!(log::max_level(), log::LevelFilter::Off, "no logger yet");
    first_request_after_a_load();
    loopback();
    posix();
    ucx();
    shm();
    // The same with a subscriber at info, as `ferry -v` installs it.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init()
        .expect("install the subscriber");
    assert_eq!(log::max_level(), log::LevelFilter::Info);
    assert!(!log::log_enabled!(log::Level::Debug));
    loopback();
    posix();
    ucx();
    shm();
    // Every disabled statement now asks the subscriber (which says no).
    log::set_max_level(log::LevelFilter::Trace);
    assert!(!log::log_enabled!(target: "ferry::flush", log::Level::Trace));
    loopback();
    // The counter works: an allocation inside the window is seen, and one on a backend
    // worker thread counts as the flush's.
    let (v, counts) = counted(|| vec![1u8; 3]);
    assert_eq!(counts.flush, 1);
    drop(v);
    let (v, counts) = counted(|| {
        std::thread::Builder::new()
            .name("ferry-posix-test".into())
            .spawn(|| vec![1u8; 3])
            .unwrap()
            .join()
            .unwrap()
    });
    assert!(counts.flush >= 2, "{counts:?}");
    drop(v);
}

fn loopback() {
    let block = 64;
    let n = 1024;
    let mut rng = Rng::new(41);
    let src = Buffer::random(n * block, &mut rng);
    let dst = Buffer::zeroed(n * block);
    let p = pair(&src, &dst);
    start_exchange(&p.a);
    start_exchange(&p.b);
    exercise_exchange(&p.a, &p.b);
    exercise_exchange(&p.b, &p.a);
    let local_descs: Vec<Desc> = (0..n).map(|i| src.desc(i * block, block)).collect();
    let mut order: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut order);
    let remote_descs: Vec<Desc> = order.iter().map(|&j| dst.desc(j * block, block)).collect();
    let local = p.a.prep(Side::Local, MemKind::Dram, &local_descs).unwrap();
    let remote = p.a.prep(p.b_at_a, MemKind::Dram, &remote_descs).unwrap();
    let half: Vec<u32> = (0..n as u32 / 2).collect();

    let mut cmds = CommandBuffer::with_capacity(64);
    let mut peer_cmds = CommandBuffer::with_capacity(8);
    // The metrics are recorded inside the counted window (read outside it: a snapshot
    // allocates its vectors).
    let before = p.a.metrics();
    // Prepared path: make + post + check + release, with a notification, and the
    // full path: prep + make + post + check + release every turn.
    assert_no_allocation("LOOPBACK", || {
        cmds.clear();
        let x = cmds
            .make(Op::Write, local, &half, remote, &half)
            .notify(ATTACHED)
            .ticket();
        let posted = cmds.post(x);
        let checked = cmds.check(x);
        cmds.release(x);
        let l = cmds.prep(Side::Local, MemKind::Dram, &local_descs[..256]);
        let r = cmds.prep(p.b_at_a, MemKind::Dram, &remote_descs[..256]);
        let y = cmds.make(Op::Read, l, &[], r, &[]).ticket();
        cmds.post(y);
        let checked_y = cmds.check(y);
        cmds.release(y);
        cmds.release_prep(l);
        cmds.release_prep(r);
        cmds.notify(p.b_at_a, STANDALONE);
        p.a.flush(&mut cmds);
        assert_eq!(cmds.status(posted), Ok(XferStatus::Done));
        assert_eq!(cmds.status(checked), Ok(XferStatus::Done));
        assert_eq!(cmds.status(checked_y), Ok(XferStatus::Done));
        assert!(cmds.errors().next().is_none());
        peer_cmds.clear();
        let drained = peer_cmds.drain_notifications();
        p.b.flush(&mut peer_cmds);
        assert_eq!(peer_cmds.outcome(drained), &Outcome::Drained(2));
    });
    let after = p.a.metrics();
    let turns = (WARM_TURNS + COUNTED_TURNS) as u64;
    let (b0, b1) = (
        before.backend("LOOPBACK").unwrap(),
        after.backend("LOOPBACK").unwrap(),
    );
    assert_eq!(b1.posted - b0.posted, 2 * turns, "metrics: posts recorded");
    assert_eq!(b1.completed - b0.completed, 2 * turns);
    assert_eq!(b1.latency_count() - b0.latency_count(), 2 * turns);
    assert_eq!(
        b1.bytes - b0.bytes,
        turns * (n as u64 / 2 + 256) * block as u64
    );
    assert!(after.flushes - before.flushes >= turns);
}

/// A fresh agent with `backend` loads a target with `n` regions, then makes its very
/// first request (a one-shot WRITE of one 64-byte descriptor into each region, remote
/// order shuffled), posts it, checks it to the end and releases it: counted, nothing
/// allocated on the flush's threads. Then the same through two prepared lists and
/// `make` (the lists released too), and both again as READs, each on a fresh agent.
fn first_request_after_a_load() {
    let n = 1024;
    let block = 64;
    let region = 256;
    let mut backends = vec!["LOOPBACK"];
    match ucx_available() {
        Ok(()) => backends.push("UCX"),
        Err(reason) => eprintln!("first request after a load: no UCX part ({reason})"),
    }
    for backend in backends {
        let mut params = Params::new();
        if backend == "UCX" {
            // The target is progressed by its own thread; nothing else drives it.
            params.insert("progress_thread".into(), "true".into());
        }
        let agent = |name: &str, params: &Params| {
            let agent = Agent::new(AgentConfig::named(unique(name))).unwrap();
            agent.create_backend(backend, params).expect("backend");
            agent
        };
        let target = agent("noalloc-first-target", &params);
        let mut rng = Rng::new(53);
        let src = Buffer::random(n * block, &mut rng);
        let dst = Buffer::zeroed(n * region);
        for i in 0..n {
            ferry_tests::try_register(&target, MemKind::Dram, dst.desc(i * region, region))
                .expect("register");
        }
        let blob = target.local_md().expect("metadata");
        let local: Vec<Desc> = (0..n).map(|i| src.desc(i * block, block)).collect();
        let mut order: Vec<usize> = (0..n).collect();
        rng.shuffle(&mut order);
        let remote: Vec<Desc> = order.iter().map(|&j| dst.desc(j * region, block)).collect();
        // Each first request by an agent that has just loaded the target, one-shot and
        // through two prepared lists, WRITE then READ. A READ fills `back` from the
        // regions the WRITEs filled (the prepared WRITE wrote the same bytes again).
        let back = Buffer::zeroed(n * block);
        let back_descs: Vec<Desc> = (0..n).map(|i| back.desc(i * block, block)).collect();
        for (op, prepared) in [
            (Op::Write, false),
            (Op::Write, true),
            (Op::Read, false),
            (Op::Read, true),
        ] {
            let what = format!(
                "{backend}: the first {op:?} request{} after a load",
                if prepared {
                    " through prepared lists"
                } else {
                    ""
                }
            );
            let (buffer, local) = match op {
                Op::Write => (&src, &local),
                Op::Read => (&back, &back_descs),
            };
            let a = agent("noalloc-first-initiator", &Params::new());
            register(&a, buffer);
            let peer = a.load_remote_md(&blob).expect("load");
            let ((), counts) = counted(|| {
                if !prepared {
                    return ferry_tests::transfer_and_wait(&a, op, peer, local, &remote);
                }
                let l = a
                    .prep(Side::Local, MemKind::Dram, local)
                    .expect("prep local");
                let r = a.prep(peer, MemKind::Dram, &remote).expect("prep remote");
                let x = a.make(op, l, &[], r, &[], None).expect("make");
                ferry_tests::post_and_wait(&a, x);
                a.release(x).expect("release");
                a.release_prep(l).expect("release local list");
                a.release_prep(r).expect("release remote list");
            });
            for (i, &j) in order.iter().enumerate() {
                let there = match op {
                    Op::Write => &dst.bytes()[j * region..j * region + block],
                    Op::Read => &back.bytes()[i * block..(i + 1) * block],
                };
                assert_eq!(
                    there,
                    &src.bytes()[i * block..(i + 1) * block],
                    "{what}: descriptor {i}"
                );
            }
            assert_eq!(counts.flush, 0, "{what} allocated ({counts:?})");
        }
    }
}

/// Whether UCX can be used here (required under `CI=true`).
fn ucx_available() -> Result<(), String> {
    std::env::set_var("UCX_NET_DEVICES", "lo");
    std::env::set_var("UCX_WARN_UNUSED_ENV_VARS", "n");
    let info = Agent::available_backends();
    let available = info
        .iter()
        .find(|f| f.name == "UCX")
        .expect("UCX is compiled in")
        .available
        .clone();
    if let Err(reason) = &available {
        assert!(!ci(), "UCX is required under CI=true: {reason}");
    }
    available
}

/// Removes the scratch file when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn posix() {
    for engine in ["threads", "uring"] {
        let agent = Agent::new(AgentConfig::named(unique("noalloc-posix"))).unwrap();
        let mut params = Params::new();
        params.insert("engine".into(), engine.into());
        if let Err(e) = agent.create_backend("POSIX", &params) {
            assert!(engine == "uring" && !ci(), "POSIX {engine}: {e}");
            eprintln!("skipping POSIX with io_uring: {e}");
            continue;
        }
        start_exchange(&agent);
        // A partner to run the exchange with once both ways (POSIX is local-only, so
        // both also have a LOOPBACK backend for their metadata to name).
        agent.create_backend("LOOPBACK", &Params::new()).unwrap();
        let partner = Agent::new(AgentConfig::named(unique("noalloc-partner"))).unwrap();
        partner.create_backend("LOOPBACK", &Params::new()).unwrap();
        start_exchange(&partner);
        exercise_exchange(&agent, &partner);
        exercise_exchange(&partner, &agent);
        let scratch = Scratch(std::env::temp_dir().join(unique("ferry-noalloc")));
        let mode = FileMode {
            write: true,
            create: true,
            ..FileMode::default()
        };
        agent
            .register_file(&scratch.0, mode, Desc::new(0, 0, 1))
            .expect("register the scratch file");
        let block = 4096;
        let n = 64;
        let mut rng = Rng::new(43);
        let src = Buffer::random(n * block, &mut rng);
        register(&agent, &src);
        let mem: Vec<Desc> = (0..n).map(|i| src.desc(i * block, block)).collect();
        let file: Vec<Desc> = (0..n)
            .map(|i| Desc::new(((n - 1 - i) * block) as u64, block as u64, 1))
            .collect();
        let local = agent.prep(Side::Local, MemKind::Dram, &mem).unwrap();
        let target = agent.prep(Side::Local, MemKind::File, &file).unwrap();
        let mut cmds = CommandBuffer::with_capacity(16);
        let all: Vec<u32> = (0..n as u32).collect();
        let what = format!("POSIX {engine}");
        assert_no_allocation(&what, || {
            for op in [Op::Write, Op::Read] {
                cmds.clear();
                let x = cmds.make(op, local, &all, target, &all).ticket();
                let posted = cmds.post(x);
                agent.flush(&mut cmds);
                assert!(cmds.errors().next().is_none(), "{what}");
                let mut status = cmds.status(posted).unwrap();
                let xfer = cmds.created(x).expect("made");
                let deadline = Instant::now() + Duration::from_secs(30);
                while status == XferStatus::InProgress {
                    assert!(Instant::now() < deadline, "{what}: request did not finish");
                    cmds.clear();
                    let checked = cmds.check(xfer);
                    agent.flush(&mut cmds);
                    status = cmds.status(checked).unwrap();
                }
                assert_eq!(status, XferStatus::Done, "{what}");
                cmds.clear();
                cmds.release(xfer);
                agent.flush(&mut cmds);
                assert!(cmds.errors().next().is_none(), "{what}");
            }
        });
    }
}

fn ucx() {
    if let Err(reason) = ucx_available() {
        eprintln!("skipping the UCX part: UCX unavailable ({reason})");
        return;
    }
    let a = Agent::new(AgentConfig::named(unique("noalloc-ucx-a"))).unwrap();
    let b = Agent::new(AgentConfig::named(unique("noalloc-ucx-b"))).unwrap();
    for agent in [&a, &b] {
        agent
            .create_backend("UCX", &Params::new())
            .expect("UCX backend");
        start_exchange(agent);
    }
    let block = 64;
    let n = 256;
    let mut rng = Rng::new(47);
    let src = Buffer::random(n * block, &mut rng);
    let dst = Buffer::zeroed(n * block);
    register(&a, &src);
    register(&b, &dst);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    b.load_remote_md(&a.local_md().unwrap()).unwrap();
    exercise_exchange(&a, &b);
    exercise_exchange(&b, &a);
    let local_descs: Vec<Desc> = (0..n).map(|i| src.desc(i * block, block)).collect();
    let remote_descs: Vec<Desc> = (0..n).rev().map(|j| dst.desc(j * block, block)).collect();
    let local = a.prep(Side::Local, MemKind::Dram, &local_descs).unwrap();
    let remote = a.prep(b_at_a, MemKind::Dram, &remote_descs).unwrap();
    let all: Vec<u32> = (0..n as u32).collect();
    let mut cmds = CommandBuffer::with_capacity(16);
    let mut peer_cmds = CommandBuffer::with_capacity(4);
    let mut received = 0u32;
    assert_no_allocation("UCX", || {
        cmds.clear();
        let x = cmds
            .make(Op::Write, local, &all, remote, &all)
            .notify(ATTACHED)
            .ticket();
        let posted = cmds.post(x);
        cmds.notify(b_at_a, STANDALONE);
        a.flush(&mut cmds);
        assert!(cmds.errors().next().is_none(), "UCX post");
        let xfer = cmds.created(x).expect("made");
        let mut status = cmds.status(posted).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while status == XferStatus::InProgress {
            assert!(Instant::now() < deadline, "UCX request did not finish");
            b.progress();
            cmds.clear();
            let checked = cmds.check(xfer);
            a.flush(&mut cmds);
            status = cmds.status(checked).unwrap();
        }
        assert_eq!(status, XferStatus::Done);
        cmds.clear();
        cmds.release(xfer);
        a.flush(&mut cmds);
        // Both notifications of this turn reach b.
        let deadline = Instant::now() + Duration::from_secs(30);
        received = 0;
        while received < 2 {
            assert!(
                Instant::now() < deadline,
                "UCX notifications did not arrive"
            );
            a.progress();
            peer_cmds.clear();
            let drained = peer_cmds.drain_notifications();
            b.flush(&mut peer_cmds);
            if let Outcome::Drained(k) = peer_cmds.outcome(drained) {
                received += k;
            }
        }
    });
    assert_eq!(received, 2);
}

fn shm() {
    let a = Agent::new(AgentConfig::named(unique("noalloc-shm-a"))).unwrap();
    let b = Agent::new(AgentConfig::named(unique("noalloc-shm-b"))).unwrap();
    for agent in [&a, &b] {
        agent
            .create_backend("SHM", &Params::new())
            .expect("SHM backend");
    }
    let block = 64;
    let n = 1024;
    let mut rng = Rng::new(53);
    let src = Buffer::random(n * block, &mut rng);
    let ordinary = Buffer::zeroed(n * block);
    let shared = ferry::shm::SharedMemory::alloc(n * block, &Default::default()).unwrap();
    register(&a, &src);
    register(&b, &ordinary);
    ferry_tests::try_register(&b, MemKind::Dram, shared.desc()).unwrap();
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let mut order: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut order);
    let local_descs: Vec<Desc> = (0..n).map(|i| src.desc(i * block, block)).collect();
    let to_shared: Vec<Desc> = order
        .iter()
        .map(|&j| shared.desc_at(j * block, block).unwrap())
        .collect();
    let to_ordinary: Vec<Desc> = order
        .iter()
        .map(|&j| ordinary.desc(j * block, block))
        .collect();
    let local = a.prep(Side::Local, MemKind::Dram, &local_descs).unwrap();
    let remote_shared = a.prep(b_at_a, MemKind::Dram, &to_shared).unwrap();
    let remote_ordinary = a.prep(b_at_a, MemKind::Dram, &to_ordinary).unwrap();
    let all: Vec<u32> = (0..n as u32).collect();
    let mut cmds = CommandBuffer::with_capacity(16);
    let mut peer_cmds = CommandBuffer::with_capacity(4);
    assert_no_allocation("SHM", || {
        cmds.clear();
        let x = cmds
            .make(Op::Write, local, &all, remote_shared, &all)
            .notify(ATTACHED)
            .ticket();
        let posted_x = cmds.post(x);
        cmds.release(x);
        let y = cmds
            .make(Op::Read, local, &all, remote_ordinary, &all)
            .ticket();
        let posted_y = cmds.post(y);
        cmds.release(y);
        cmds.notify(b_at_a, STANDALONE);
        a.flush(&mut cmds);
        assert!(cmds.errors().next().is_none(), "SHM turn");
        assert_eq!(cmds.status(posted_x), Ok(XferStatus::Done));
        assert_eq!(cmds.status(posted_y), Ok(XferStatus::Done));
        peer_cmds.clear();
        let drained = peer_cmds.drain_notifications();
        b.flush(&mut peer_cmds);
        assert_eq!(peer_cmds.outcome(drained), &Outcome::Drained(2));
    });
}
