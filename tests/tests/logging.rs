//! The library's log lines, captured by a `log` logger of the test's own: one `debug`
//! line per control-plane event (agent, backend, region registered and deregistered,
//! peer loaded / reloaded / invalidated, connection, failures), a bound hit logged at
//! its 1st, 2nd, 4th, 8th … hit only, and one `trace` summary per flush (target
//! `ferry::flush`), the metadata exchange's requests and events. (Its own test binary
//! with one test: the logger is process-wide.)

use std::sync::Mutex;
use std::time::{Duration, Instant};

use ferry::exchange::{ExchangeConfig, P2pConfig, Via};

use ferry::{Agent, AgentConfig, Bounds, CommandBuffer, Desc, MemKind, Op, Params, Side};
use ferry_tests::{register, unique, Buffer, Rng};

/// Every record at or above the logger's level, as `LEVEL target: message`.
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        LINES.lock().unwrap().push(format!(
            "{} {}: {}",
            record.level(),
            record.target(),
            record.args()
        ));
    }
    fn flush(&self) {}
}

/// The lines captured since the last call.
fn take() -> Vec<String> {
    std::mem::take(&mut *LINES.lock().unwrap())
}

#[track_caller]
fn one_line(lines: &[String], needle: &str) -> String {
    let found: Vec<&String> = lines.iter().filter(|l| l.contains(needle)).collect();
    assert_eq!(found.len(), 1, "one line with '{needle}' in {lines:#?}");
    found[0].clone()
}

#[test]
fn control_plane_events_are_logged_once_each_and_flushes_summarized_at_trace() {
    log::set_logger(&Capture).unwrap();
    log::set_max_level(log::LevelFilter::Debug);

    // Agents and backends.
    let name_a = unique("log-a");
    let name_b = unique("log-b");
    let bounds = Bounds {
        xfers_max: 1,
        ..Bounds::default()
    };
    let a = Agent::new(AgentConfig::named(&name_a).with_bounds(bounds)).unwrap();
    let b = Agent::new(AgentConfig::named(&name_b)).unwrap();
    a.create_backend("LOOPBACK", &Params::new()).unwrap();
    b.create_backend("LOOPBACK", &Params::new()).unwrap();
    let mut posix = Params::new();
    posix.insert("engine".into(), "threads".into());
    a.create_backend("POSIX", &posix).unwrap();
    let lines = take();
    let created = one_line(&lines, &format!("agent '{name_a}' created"));
    assert!(
        created.starts_with("DEBUG ferry::agent:") && created.contains("1 requests"),
        "{created}"
    );
    one_line(&lines, &format!("agent '{name_b}' created"));
    let posix_line = one_line(&lines, &format!("agent '{name_a}': backend POSIX created"));
    assert!(
        posix_line.contains("engine threads (4 workers")
            && posix_line.contains("memory DRAM, FILE, local only")
            && posix_line.contains("engine=threads"),
        "{posix_line}"
    );
    let loopback = one_line(
        &lines,
        &format!("agent '{name_a}': backend LOOPBACK created"),
    );
    assert!(loopback.contains("reaches peers"), "{loopback}");

    // Regions: one line per register command (DRAM goes to both of a's backends).
    let mut rng = Rng::new(5);
    let src = Buffer::random(4096, &mut rng);
    let dst = Buffer::zeroed(4096);
    let region = register(&a, &src);
    register(&b, &dst);
    let lines = take();
    let registered = one_line(&lines, &format!("agent '{name_a}': registered DRAM region"));
    assert!(
        registered.contains("4096 bytes at") && registered.contains("with LOOPBACK, POSIX"),
        "{registered}"
    );
    one_line(&lines, &format!("agent '{name_b}': registered DRAM region"));

    // Peers: loaded, identical reload, a blob that is not metadata, connection.
    let md_b = b.local_md().unwrap();
    let peer = a.load_remote_md(&md_b).unwrap();
    a.load_remote_md(&md_b).unwrap();
    assert!(a.load_remote_md(b"not metadata").is_err());
    a.make_connection(peer).unwrap();
    let lines = take();
    let loaded = one_line(
        &lines,
        &format!("agent '{name_a}': metadata of peer '{name_b}' loaded ("),
    );
    assert!(
        loaded.contains("1 region(s)); taken by LOOPBACK"),
        "{loaded}"
    );
    one_line(&lines, "loaded again: identical content, nothing changed");
    one_line(
        &lines,
        &format!("agent '{name_a}': peer metadata (12 bytes) not loaded"),
    );
    one_line(
        &lines,
        &format!("agent '{name_a}': connected to peer '{name_b}' through LOOPBACK"),
    );

    // A bound hit again and again: logged at the 1st, 2nd, 4th, 8th, 16th hit.
    let local = a
        .prep(Side::Local, MemKind::Dram, &[src.desc(0, 64)])
        .unwrap();
    let remote = a.prep(peer, MemKind::Dram, &[dst.desc(0, 64)]).unwrap();
    let held = a.make(Op::Write, local, &[], remote, &[], None).unwrap();
    take();
    for _ in 0..20 {
        assert!(a.make(Op::Write, local, &[], remote, &[], None).is_err());
    }
    let lines = take();
    let hits: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("limit hit: transfer requests (limit 1)"))
        .collect();
    assert_eq!(hits.len(), 5, "{lines:#?}");
    assert!(hits[4].contains("16 hit(s) so far"), "{}", hits[4]);

    // Reload with new content: b registers more and deregisters, so its generation
    // moves on; the finished request built on the old one is not in flight.
    assert_eq!(a.post(held).unwrap(), ferry::XferStatus::Done);
    let more = Buffer::zeroed(4096);
    let extra = register(&b, &more);
    b.deregister(extra).unwrap();
    let lines = take();
    let deregistered = one_line(
        &lines,
        &format!("agent '{name_b}': deregistered DRAM region"),
    );
    assert!(deregistered.contains("4096 bytes at"), "{deregistered}");
    let peer = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let lines = take();
    let reloaded = one_line(
        &lines,
        &format!("agent '{name_a}': metadata of peer '{name_b}' reloaded with new content"),
    );
    assert!(
        reloaded.contains("(0 request(s) in flight to it ended)")
            && reloaded.contains("1 region(s)); taken by LOOPBACK"),
        "{reloaded}"
    );
    a.release(held).unwrap();

    // Invalidation: which backends dropped the peer, how many requests it ended.
    a.invalidate_remote_md(peer).unwrap();
    let lines = take();
    let invalidated = one_line(
        &lines,
        &format!("agent '{name_a}': peer '{name_b}' invalidated"),
    );
    assert!(
        invalidated.contains("dropped by LOOPBACK; 0 request(s) in flight"),
        "{invalidated}"
    );
    let peer = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    take();

    // Trace: a summary line per flush and nothing per descriptor, even for a request
    // of many descriptors.
    log::set_max_level(log::LevelFilter::Trace);
    let descs: Vec<Desc> = (0..64).map(|i| src.desc(i * 64, 64)).collect();
    let targets: Vec<Desc> = (0..64).map(|i| dst.desc((63 - i) * 64, 64)).collect();
    let mut cmds = CommandBuffer::with_capacity(8);
    let x = cmds
        .create(
            Op::Write,
            MemKind::Dram,
            &descs,
            peer,
            MemKind::Dram,
            &targets,
        )
        .ticket();
    cmds.post(x);
    cmds.release(x);
    a.flush(&mut cmds);
    assert!(cmds.errors().next().is_none());
    let lines = take();
    assert_eq!(lines.len(), 1, "{lines:#?}");
    let summary = &lines[0];
    assert!(
        summary.starts_with(&format!(
            "TRACE ferry::flush: agent '{name_a}': flush: 3 command(s)"
        )) && summary.contains("[create 1, post 1, release 1]")
            && summary.contains("1 posted (4096 bytes), 1 completion(s)")
            && summary.contains("0 failed"),
        "{summary}"
    );
    a.deregister(region).unwrap();
    let lines = take();
    one_line(
        &lines,
        &format!("agent '{name_a}': deregistered DRAM region"),
    );
    one_line(&lines, "flush: 1 command(s) [deregister 1]");
    log::set_max_level(log::LevelFilter::Debug);

    // The exchange: started, a fetch over P2P, the metadata arriving, a withdrawal.
    let c = ferry_tests::loopback_agent("log-c");
    let name_c = c.name().to_string();
    for agent in [&b, &c] {
        let mut config = ExchangeConfig::default();
        config.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
        agent.start_exchange(config).unwrap();
    }
    let at_b = b.exchange_listen_addr().unwrap();
    c.fetch_remote_md(&name_b, Via::Peer(at_b), None).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.check_remote_md(&name_b, None).unwrap() {
        assert!(Instant::now() < deadline, "the fetch never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    b.invalidate_local_md(Via::Peer(c.exchange_listen_addr().unwrap()))
        .unwrap();
    while c.peer(&name_b).is_some() {
        assert!(Instant::now() < deadline, "the withdrawal never arrived");
        c.poll_exchange().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let lines = take();
    let started = one_line(&lines, &format!("exchange of '{name_c}' started"));
    assert!(
        started.contains("p2p listener 127.0.0.1:") && started.contains("store none"),
        "{started}"
    );
    one_line(
        &lines,
        &format!(
            "exchange of '{name_c}': fetching metadata 'metadata' of '{name_b}' from p2p {at_b}"
        ),
    );
    let arrived = one_line(
        &lines,
        &format!("exchange of '{name_c}': metadata 'metadata' of '{name_b}' arrived over p2p ("),
    );
    assert!(arrived.contains(" bytes)"), "{arrived}");
    one_line(
        &lines,
        &format!("agent '{name_c}': metadata of peer '{name_b}' loaded ("),
    );
    one_line(
        &lines,
        &format!("exchange of '{name_b}': withdrawing our metadata at p2p"),
    );
    one_line(
        &lines,
        &format!("exchange of '{name_c}': '{name_b}' withdrew its metadata (learned over p2p"),
    );
    one_line(
        &lines,
        &format!("agent '{name_c}': peer '{name_b}' invalidated"),
    );
}
