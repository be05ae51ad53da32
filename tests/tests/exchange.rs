//! Two agents discover each other by name (or address) through each exchange backend —
//! P2P, TCPStore (Ferry's own server), etcd (`FERRY_TEST_ETCD`) — then transfer through
//! the loopback backend. Also: partial metadata by label with region checks,
//! invalidation reaching the transfer path, and a missing agent's clear timeout.

use std::time::{Duration, Instant};

use std::sync::Arc;

use ferry::exchange::{
    tcpstore, EtcdConfig, ExchangeConfig, Manager, P2pConfig, StoreConfig, TcpStoreConfig, Via,
};
use ferry::{Agent, Desc, Error, MemKind, Op, XferStatus};
use ferry_tests::{loopback_agent, register, Buffer, Rng};

const LONG: Duration = Duration::from_secs(10);

/// Poll `check_remote_md` until it says yes (or fails, or time runs out).
fn wait_checked(agent: &Agent, peer: &str, regions: Option<(MemKind, &[Desc])>) {
    let deadline = Instant::now() + LONG;
    loop {
        match agent.check_remote_md(peer, regions) {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => panic!("{}: checking '{peer}' failed: {e}", agent.name()),
        }
        assert!(
            Instant::now() < deadline,
            "{}: '{peer}' not loaded in time",
            agent.name()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// B reads A's buffer after discovering A through the exchange (`via(&a)`), then A
/// withdraws its metadata (`withdraw(&b)`: where B hears of it).
fn discover_then_transfer(
    a_cfg: ExchangeConfig,
    b_cfg: ExchangeConfig,
    via: impl Fn(&Agent) -> Via,
    withdraw: impl Fn(&Agent) -> Via,
) {
    let mut rng = Rng::new(11);
    let src = Buffer::random(256 << 10, &mut rng);
    let dst = Buffer::zeroed(256 << 10);
    let a = loopback_agent("xa");
    let b = loopback_agent("xb");
    register(&a, &src);
    register(&b, &dst);
    a.start_exchange(a_cfg).unwrap();
    b.start_exchange(b_cfg).unwrap();
    assert!(a.exchange_workers_running());
    if via(&a) == Via::Store {
        a.send_local_md(Via::Store).unwrap();
    }
    b.fetch_remote_md(a.name(), via(&a), None).unwrap();
    wait_checked(&b, a.name(), Some((MemKind::Dram, &[src.whole()])));
    let peer = b.peer(a.name()).expect("A is a known peer");
    let x = b
        .create(
            Op::Read,
            MemKind::Dram,
            &[dst.whole()],
            peer,
            MemKind::Dram,
            &[src.whole()],
            None,
        )
        .unwrap();
    assert_eq!(b.post(x).unwrap(), XferStatus::Done);
    assert_eq!(dst.bytes(), src.bytes());

    // A withdraws; B drops it, and a transfer to it fails instead of touching memory.
    a.invalidate_local_md(withdraw(&b)).unwrap();
    let deadline = Instant::now() + LONG;
    while b.check_remote_md(a.name(), None).unwrap() {
        assert!(Instant::now() < deadline, "invalidation did not reach B");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        b.post(x).is_err(),
        "a transfer to a withdrawn peer must fail"
    );
    assert!(b.drain_exchange_failures().is_empty());
    assert!(a.drain_exchange_failures().is_empty());
}

fn p2p_config() -> ExchangeConfig {
    let mut c = ExchangeConfig::default();
    c.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
    c
}

fn tcpstore_config(endpoint: std::net::SocketAddr) -> ExchangeConfig {
    let mut ts = TcpStoreConfig::new(endpoint.to_string());
    ts.watch_interval = Duration::from_millis(50);
    ExchangeConfig {
        store: StoreConfig::TcpStore(ts),
        namespace: format!("exchange-e2e/{}", ferry_tests::unique("ns")),
        fetch_timeout: Duration::from_secs(5),
        ..ExchangeConfig::default()
    }
}

#[test]
fn p2p_discovery_then_loopback_transfer() {
    // A listens (with a shared secret on both sides); B asks A's address.
    let mut a = p2p_config();
    a.p2p.secret = Some(b"e2e".as_slice().into());
    let mut b = p2p_config();
    b.p2p.secret = a.p2p.secret.clone();
    let listener = |x: &Agent| Via::Peer(x.exchange_listen_addr().unwrap());
    discover_then_transfer(a, b, listener, listener);
}

#[test]
fn tcpstore_discovery_then_loopback_transfer() {
    let server = tcpstore::serve(
        "127.0.0.1:0".parse().unwrap(),
        tcpstore::ServerConfig::default(),
    )
    .unwrap();
    let cfg = tcpstore_config(server.local_addr());
    discover_then_transfer(cfg.clone(), cfg, |_| Via::Store, |_| Via::Store);
}

#[test]
fn embedded_tcpstore_discovery_then_loopback_transfer() {
    // A runs Ferry's TCPStore server itself; B points at it.
    let host = loopback_agent("xhost");
    host.start_exchange(ExchangeConfig {
        embedded_store: Some("127.0.0.1:0".parse().unwrap()),
        ..ExchangeConfig::default()
    })
    .unwrap();
    let addr = host.exchange_store_addr().unwrap();
    let mut cfg = tcpstore_config(addr);
    cfg.namespace = ferry::exchange::config::DEFAULT_NAMESPACE.to_owned();
    discover_then_transfer(cfg.clone(), cfg, |_| Via::Store, |_| Via::Store);
}

#[test]
fn etcd_discovery_then_loopback_transfer() {
    let endpoint = match std::env::var("FERRY_TEST_ETCD") {
        Ok(e) if !e.is_empty() => e,
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but FERRY_TEST_ETCD is not set: this test needs a running etcd")
        }
        _ => {
            eprintln!("skipping: FERRY_TEST_ETCD is not set");
            return;
        }
    };
    let cfg = ExchangeConfig {
        store: StoreConfig::Etcd(EtcdConfig::new(vec![endpoint])),
        namespace: format!("exchange-e2e/{}", ferry_tests::unique("ns")),
        fetch_timeout: Duration::from_secs(5),
        ..ExchangeConfig::default()
    };
    // A build without the etcd feature says so when the exchange starts.
    let probe = loopback_agent("xprobe");
    match probe.start_exchange(cfg.clone()) {
        Ok(()) => {}
        Err(Error::NotSupported { what, .. }) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("CI=true but etcd is not built in ({what}): test with --features ferry-exchange/etcd");
            }
            eprintln!("skipping: {what}");
            return;
        }
        Err(e) => panic!("starting the etcd exchange: {e}"),
    }
    drop(probe);
    discover_then_transfer(cfg.clone(), cfg, |_| Via::Store, |_| Via::Store);
}

#[test]
fn partial_metadata_by_label_covers_only_its_regions() {
    let server = tcpstore::serve(
        "127.0.0.1:0".parse().unwrap(),
        tcpstore::ServerConfig::default(),
    )
    .unwrap();
    let cfg = tcpstore_config(server.local_addr());
    let one = Buffer::zeroed(4096);
    let two = Buffer::zeroed(4096);
    let a = loopback_agent("xpa");
    let b = loopback_agent("xpb");
    let r1 = register(&a, &one);
    let _r2 = register(&a, &two);
    a.start_exchange(cfg.clone()).unwrap();
    b.start_exchange(cfg).unwrap();
    a.send_local_partial_md(&[r1], "kv-layer-0", Via::Store)
        .unwrap();
    b.fetch_remote_md(a.name(), Via::Store, Some("kv-layer-0"))
        .unwrap();
    wait_checked(&b, a.name(), Some((MemKind::Dram, &[one.whole()])));
    // The other region is not covered by the partial metadata.
    assert!(!b
        .check_remote_md(a.name(), Some((MemKind::Dram, &[two.whole()])))
        .unwrap());
    // Full metadata covers both.
    a.send_local_md(Via::Store).unwrap();
    b.fetch_remote_md(a.name(), Via::Store, None).unwrap();
    wait_checked(
        &b,
        a.name(),
        Some((MemKind::Dram, &[one.whole(), two.whole()])),
    );
}

#[test]
fn fetching_a_missing_agent_times_out_with_a_clear_error() {
    let server = tcpstore::serve(
        "127.0.0.1:0".parse().unwrap(),
        tcpstore::ServerConfig::default(),
    )
    .unwrap();
    let mut cfg = tcpstore_config(server.local_addr());
    cfg.fetch_timeout = Duration::from_millis(200);
    let b = loopback_agent("xmb");
    b.start_exchange(cfg).unwrap();
    b.fetch_remote_md("nobody-here", Via::Store, None).unwrap();
    let deadline = Instant::now() + LONG;
    let error = loop {
        match b.check_remote_md("nobody-here", None) {
            Ok(false) => {}
            Ok(true) => panic!("a missing agent was found"),
            Err(e) => break e,
        }
        assert!(Instant::now() < deadline, "no timeout error");
        std::thread::sleep(Duration::from_millis(5));
    };
    let text = error.to_string();
    assert!(
        text.contains("nobody-here") && text.contains("not published within 200 ms"),
        "{text}"
    );
    // Without a store or an address, name-based calls say so.
    let c = loopback_agent("xmc");
    assert!(
        c.fetch_remote_md("x", Via::Store, None).is_err(),
        "not started"
    );
    c.start_exchange(ExchangeConfig::default()).unwrap();
    let e = c.fetch_remote_md("x", Via::Store, None).unwrap_err();
    assert!(e.to_string().contains("no metadata store"), "{e}");
    assert!(!c.exchange_workers_running());
}

#[test]
fn command_buffer_exchange_commands_discover_then_transfer() {
    // The same discovery as above, recorded into command buffers and flushed.
    use ferry::{CommandBuffer, MdRoute, Outcome, Side};
    let server = tcpstore::serve(
        "127.0.0.1:0".parse().unwrap(),
        tcpstore::ServerConfig::default(),
    )
    .unwrap();
    let cfg = tcpstore_config(server.local_addr());
    let mut rng = Rng::new(17);
    let src = Buffer::random(64 << 10, &mut rng);
    let dst = Buffer::zeroed(64 << 10);
    let a = loopback_agent("cba");
    let b = loopback_agent("cbb");
    let region = register(&a, &src);
    register(&b, &dst);

    // Before the exchange starts, its commands fail alone with a clear error.
    let mut cmds = CommandBuffer::with_capacity(8);
    let early = cmds.send_local_md(MdRoute::Store);
    let notify_self = cmds.notify(Side::Local, b"still runs");
    a.flush(&mut cmds);
    assert!(
        matches!(cmds.outcome(early).error(), Some(Error::NotAllowed { .. })),
        "{:?}",
        cmds.outcome(early)
    );
    assert_eq!(cmds.outcome(notify_self), &Outcome::Done);

    a.start_exchange(cfg.clone()).unwrap();
    b.start_exchange(cfg).unwrap();
    cmds.clear();
    let sent = cmds.send_local_md(MdRoute::Store);
    let partial = cmds.send_local_partial_md(&[region], "blocks", MdRoute::Store);
    a.flush(&mut cmds);
    assert_eq!(cmds.outcome(sent), &Outcome::Done);
    assert_eq!(cmds.outcome(partial), &Outcome::Done);

    let mut bcmds = CommandBuffer::with_capacity(8);
    let fetch = bcmds.fetch_remote_md(a.name(), None, MdRoute::Store);
    b.flush(&mut bcmds);
    assert_eq!(bcmds.outcome(fetch), &Outcome::Done);
    let deadline = Instant::now() + LONG;
    loop {
        bcmds.clear();
        let ready = bcmds.check_remote_md(a.name());
        b.flush(&mut bcmds);
        match bcmds.outcome(ready) {
            Outcome::MdReady(true) => break,
            Outcome::MdReady(false) => {}
            other => panic!("check failed: {other:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "A's metadata did not arrive in time"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let peer = b.peer(a.name()).unwrap();
    let x = b
        .create(
            Op::Read,
            MemKind::Dram,
            &[dst.whole()],
            peer,
            MemKind::Dram,
            &[src.whole()],
            None,
        )
        .unwrap();
    assert_eq!(b.post(x).unwrap(), XferStatus::Done);
    assert_eq!(dst.bytes(), src.bytes());
}

/// Poll `check_remote_md` until it fails; returns the error.
fn wait_failed(agent: &Agent, peer: &str) -> Error {
    let deadline = Instant::now() + LONG;
    loop {
        match agent.check_remote_md(peer, None) {
            Ok(true) => panic!("{}: '{peer}' was loaded", agent.name()),
            Ok(false) => {}
            Err(e) => return e,
        }
        assert!(Instant::now() < deadline, "no failure for '{peer}' in time");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `e` is a mismatch naming both agents.
fn names_both(e: &Error, claimed: &str, real: &str) {
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains(claimed) && text.contains(real), "{text}");
}

/// Metadata that names agent C but arrives as agent B's — over the side channel, a P2P
/// push (with and without a secret), a TCPStore fetch and an etcd fetch — is refused
/// before it is loaded, with an error naming both, and C's metadata stays as it was.
#[test]
fn metadata_naming_another_agent_is_refused_before_it_is_loaded() {
    let c = loopback_agent("imp-c");
    let src = Buffer::zeroed(4096);
    let region = register(&c, &src);
    let md_c = c.local_md().unwrap();
    // C's next generation (another region): what an impostor sends. Loading it would
    // replace C's metadata at A (and `src` would no longer be covered).
    let other = Buffer::zeroed(4096);
    c.deregister(region).unwrap();
    register(&c, &other);
    let md_c2 = c.local_md().unwrap();
    assert_ne!(md_c, md_c2);
    let victim = |a: &Agent| {
        a.load_remote_md_as(c.name(), &md_c).unwrap();
        a.peer(c.name()).unwrap()
    };
    let unchanged = |a: &Agent, before| {
        assert_eq!(a.peer(c.name()), Some(before));
        assert!(a
            .check_remote_md(c.name(), Some((MemKind::Dram, &[src.whole()])))
            .unwrap());
        assert!(a.peer("imp-b").is_none());
    };

    // Side channel.
    let a = loopback_agent("imp-a");
    a.start_exchange(ExchangeConfig::default()).unwrap();
    let before = victim(&a);
    names_both(
        &a.load_remote_md_as("imp-b", &md_c2).unwrap_err(),
        "imp-b",
        c.name(),
    );
    unchanged(&a, before);

    // P2P: "imp-b" pushes C's metadata to A.
    for secret in [None, Some(Arc::<[u8]>::from(&b"s"[..]))] {
        let a = loopback_agent("imp-a");
        let before = victim(&a);
        let mut cfg = p2p_config();
        cfg.p2p.secret = secret.clone();
        a.start_exchange(cfg).unwrap();
        let mut b_cfg = ExchangeConfig::default();
        b_cfg.p2p.secret = secret;
        let b = Manager::new("imp-b", b_cfg).unwrap();
        b.set_local_md(Arc::from(&md_c2[..]));
        b.send_local_md(Via::Peer(a.exchange_listen_addr().unwrap()))
            .unwrap();
        names_both(&wait_failed(&a, "imp-b"), "imp-b", c.name());
        unchanged(&a, before);
    }

    // TCPStore: "imp-b" publishes C's metadata under its own key; A fetches "imp-b".
    let server = tcpstore::serve(
        "127.0.0.1:0".parse().unwrap(),
        tcpstore::ServerConfig::default(),
    )
    .unwrap();
    let cfg = tcpstore_config(server.local_addr());
    let b = Manager::new("imp-b", cfg.clone()).unwrap();
    b.set_local_md(Arc::from(&md_c2[..]));
    b.send_local_md(Via::Store).unwrap();
    let a = loopback_agent("imp-a");
    let before = victim(&a);
    a.start_exchange(cfg).unwrap();
    a.fetch_remote_md("imp-b", Via::Store, None).unwrap();
    names_both(&wait_failed(&a, "imp-b"), "imp-b", c.name());
    unchanged(&a, before);

    // etcd, when one runs.
    if let Ok(endpoint) = std::env::var("FERRY_TEST_ETCD") {
        let cfg = ExchangeConfig {
            store: StoreConfig::Etcd(EtcdConfig::new(vec![endpoint])),
            namespace: format!("exchange-e2e/{}", ferry_tests::unique("ns")),
            fetch_timeout: Duration::from_secs(5),
            ..ExchangeConfig::default()
        };
        if let Ok(b) = Manager::new("imp-b", cfg.clone()) {
            b.set_local_md(Arc::from(&md_c2[..]));
            b.send_local_md(Via::Store).unwrap();
            let a = loopback_agent("imp-a");
            let before = victim(&a);
            a.start_exchange(cfg).unwrap();
            a.fetch_remote_md("imp-b", Via::Store, None).unwrap();
            names_both(&wait_failed(&a, "imp-b"), "imp-b", c.name());
            unchanged(&a, before);
        }
    }
}

/// An application that only flushes (here: posts) sees pushed metadata and a
/// withdrawal: every flush applies pending exchange events first.
#[test]
fn flushing_alone_applies_exchange_events() {
    let mut rng = Rng::new(5);
    let src = Buffer::random(8192, &mut rng);
    let dst = Buffer::zeroed(8192);
    let a = loopback_agent("fl-a");
    let b = loopback_agent("fl-b");
    register(&a, &dst);
    register(&b, &src);
    a.start_exchange(p2p_config()).unwrap();
    b.start_exchange(ExchangeConfig::default()).unwrap();
    let to = Via::Peer(a.exchange_listen_addr().unwrap());
    b.send_local_md(to).unwrap();
    let deadline = Instant::now() + LONG;
    let peer = loop {
        // An empty flush: only the exchange pre-phase does anything.
        a.flush(&mut ferry::CommandBuffer::with_capacity(1));
        if let Some(p) = a.peer(b.name()) {
            break p;
        }
        assert!(Instant::now() < deadline, "the push never reached A");
        std::thread::sleep(Duration::from_millis(1));
    };
    let x = a
        .create(
            Op::Read,
            MemKind::Dram,
            &[dst.whole()],
            peer,
            MemKind::Dram,
            &[src.whole()],
            None,
        )
        .unwrap();
    assert_eq!(a.post(x).unwrap(), XferStatus::Done);
    assert_eq!(dst.bytes(), src.bytes());
    b.invalidate_local_md(to).unwrap();
    let deadline = Instant::now() + LONG;
    while a.post(x).is_ok() {
        assert!(Instant::now() < deadline, "the withdrawal never reached A");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A peer cannot make an agent keep more than 1024 blobs of one generation: partial
/// metadata that adds something is kept up to that bound, then refused with a
/// capacity error (identical blobs cost nothing at all).
#[test]
fn partial_blobs_per_peer_are_bounded() {
    const BLOBS_MAX: usize = 1024;
    let c = loopback_agent("pb-c");
    let buffers: Vec<Buffer> = (0..=BLOBS_MAX).map(|_| Buffer::zeroed(64)).collect();
    let regions: Vec<_> = buffers.iter().map(|b| register(&c, b)).collect();
    let a = loopback_agent("pb-a");
    for (i, r) in regions.iter().enumerate() {
        let blob = c.local_partial_md(&[*r], true).unwrap();
        let loaded = a.load_remote_md_as(c.name(), &blob);
        if i < BLOBS_MAX {
            loaded.unwrap();
            // The same blob again: nothing new, nothing kept.
            a.load_remote_md_as(c.name(), &blob).unwrap();
        } else {
            let e = loaded.unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Capacity {
                        limit: BLOBS_MAX,
                        ..
                    }
                ),
                "{e}"
            );
        }
    }
}
