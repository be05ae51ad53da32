//! P2P exchange between two managers on loopback: discovery by address, partial
//! metadata, invalidation, authentication, and a listener that keeps serving while
//! garbage, oversized and unauthenticated frames arrive.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{blob, FakeAgent, LONG};
use ferry_exchange::p2p::frame::{hello_proof, FrameSettings, FrameWriter, Hello, Kind, Role};
use ferry_exchange::{ExchangeConfig, Manager, P2pConfig, Via, FULL_LABEL};
use ferry_storage::Error;

fn listening(secret: Option<&[u8]>) -> ExchangeConfig {
    let mut c = ExchangeConfig::default();
    c.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
    c.p2p.secret = secret.map(Arc::from);
    c.p2p.max_frame_bytes = 1 << 20;
    c.io_timeout = Duration::from_secs(2);
    c
}

fn addr(a: &FakeAgent) -> SocketAddr {
    a.manager.p2p_listen_addr().expect("listener runs")
}

#[test]
fn two_agents_exchange_full_and_partial_metadata_and_invalidate() {
    let mut a = FakeAgent::new("prefill-0", listening(None));
    let mut b = FakeAgent::new("decode-0", listening(None));
    assert!(addr(&a).ip().is_loopback());
    let md_a = blob("prefill-0", 4000);
    let md_b = blob("decode-0", 300);
    a.manager.set_local_md(md_a.clone());
    b.manager.set_local_md(md_b.clone());

    // B asks A for its metadata; A pushes B nothing yet.
    b.manager
        .fetch_remote_md("prefill-0", Via::Peer(addr(&a)), None)
        .unwrap();
    b.wait_md("prefill-0", FULL_LABEL, &md_a, LONG);

    // B pushes its metadata to A.
    b.manager.send_local_md(Via::Peer(addr(&a))).unwrap();
    a.wait_md("decode-0", FULL_LABEL, &md_b, LONG);

    // Partial metadata by label, pushed and fetched.
    let part = blob("prefill-0/layer-3", 100);
    a.manager
        .send_local_partial_md("layer-3", part.clone(), Via::Peer(addr(&b)))
        .unwrap();
    b.wait_md("prefill-0", "layer-3", &part, LONG);
    b.peers.clear();
    b.manager
        .fetch_remote_md("prefill-0", Via::Peer(addr(&a)), Some("layer-3"))
        .unwrap();
    b.wait_md("prefill-0", "layer-3", &part, LONG);

    // A label A never had: a clear not-found.
    b.manager
        .fetch_remote_md("prefill-0", Via::Peer(addr(&a)), Some("layer-9"))
        .unwrap();
    let e = b.wait_fetch_failure("prefill-0", LONG);
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
    assert!(e.to_string().contains("layer-9"), "{e}");

    // Asking the wrong agent's listener: mismatch, not a silent load.
    b.manager
        .fetch_remote_md("someone-else", Via::Peer(addr(&a)), None)
        .unwrap();
    let e = b.wait_fetch_failure("someone-else", LONG);
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");

    // A withdraws its metadata at B.
    a.manager.invalidate_local_md(Via::Peer(addr(&b))).unwrap();
    b.wait_invalidated("prefill-0", LONG);
    assert!(b.md("prefill-0", FULL_LABEL).is_none());
    assert!(a.send_failures.is_empty() && b.send_failures.is_empty());
}

#[test]
fn fetches_on_idle_connections_go_direct_and_survive_a_restarted_peer() {
    let a = FakeAgent::new("a", listening(None));
    let mut b = FakeAgent::new("b", ExchangeConfig::default());
    let md_a = blob("a", 200_000);
    a.manager.set_local_md(md_a.clone());
    let to = addr(&a);

    // The first fetch connects (worker); the next ones find the connection idle.
    for round in 0..3u64 {
        b.peers.clear();
        b.manager.fetch_remote_md("a", Via::Peer(to), None).unwrap();
        b.wait_md("a", FULL_LABEL, &md_a, LONG);
        assert_eq!(b.manager.direct_fetches(), round);
    }

    // Two fetches back to back (the second usually finds the first pending, so the
    // worker writes it after it): both come back.
    b.peers.clear();
    let part = blob("a/l", 10);
    // Sent to A itself: what matters here is A's snapshot under "l".
    a.manager
        .send_local_partial_md("l", part.clone(), Via::Peer(to))
        .unwrap();
    b.manager.fetch_remote_md("a", Via::Peer(to), None).unwrap();
    b.manager
        .fetch_remote_md("a", Via::Peer(to), Some("l"))
        .unwrap();
    b.wait_md("a", FULL_LABEL, &md_a, LONG);
    b.wait_md("a", "l", &part, LONG);

    // A goes away and comes back on the same port: B's connection to the old A is
    // closed; the next fetch reaches the new A.
    drop(a);
    let mut cfg = listening(None);
    cfg.p2p.listen = Some(to);
    let a2 = FakeAgent::new("a", cfg);
    let md_a2 = blob("a", 300);
    a2.manager.set_local_md(md_a2.clone());
    b.peers.clear();
    b.manager.fetch_remote_md("a", Via::Peer(to), None).unwrap();
    b.wait_md("a", FULL_LABEL, &md_a2, LONG);
    assert!(b.fetch_failures.is_empty(), "{:?}", b.fetch_failures);
}

#[test]
fn authenticated_peers_talk_and_wrong_secrets_are_refused() {
    let mut a = FakeAgent::new("a", listening(Some(b"team secret")));
    let mut b = FakeAgent::new("b", listening(Some(b"team secret")));
    let md_a = blob("a", 1000);
    a.manager.set_local_md(md_a.clone());
    b.manager
        .fetch_remote_md("a", Via::Peer(addr(&a)), None)
        .unwrap();
    b.wait_md("a", FULL_LABEL, &md_a, LONG);

    // An agent with another secret, and one with none: refused at the hello or the
    // first frame; the caller gets an error event, A logs and drops the connection.
    for secret in [Some(&b"guess"[..]), None] {
        let mut mallory = FakeAgent::new("mallory", listening(secret));
        mallory.manager.set_local_md(blob("mallory", 10));
        mallory
            .manager
            .fetch_remote_md("a", Via::Peer(addr(&a)), None)
            .unwrap();
        let e = mallory.wait_fetch_failure("a", LONG);
        assert!(
            matches!(e, Error::Backend { .. } | Error::RemoteDisconnect { .. }),
            "{e}"
        );
        mallory.manager.send_local_md(Via::Peer(addr(&a))).unwrap();
        assert!(mallory.pump_until(LONG, |m| !m.send_failures.is_empty()));
    }
    let refused = a
        .manager
        .p2p_stats()
        .unwrap()
        .connections_refused
        .load(Ordering::Relaxed);
    assert!(refused >= 2, "refused {refused}");
    a.pump();
    assert!(
        a.md("mallory", FULL_LABEL).is_none(),
        "unauthenticated metadata was loaded"
    );

    // B still gets served.
    b.peers.clear();
    b.manager
        .fetch_remote_md("a", Via::Peer(addr(&a)), None)
        .unwrap();
    b.wait_md("a", FULL_LABEL, &md_a, LONG);
}

/// Connect to a Ferry listener and read its hello.
fn raw_hello(to: SocketAddr) -> (TcpStream, Hello) {
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut fixed = [0u8; 23];
    s.read_exact(&mut fixed).unwrap();
    assert_eq!(&fixed[..4], b"FRYX");
    let mut name = vec![0u8; usize::from(fixed[22])];
    s.read_exact(&mut name).unwrap();
    let mut all = fixed.to_vec();
    all.extend_from_slice(&name);
    let (hello, _) = Hello::decode(&all).unwrap();
    (s, hello)
}

/// Whether the listener closed `s` (EOF or reset) within the read timeout.
fn closed(mut s: TcpStream) -> bool {
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

fn refused(a: &FakeAgent) -> u64 {
    a.manager
        .p2p_stats()
        .unwrap()
        .connections_refused
        .load(Ordering::Relaxed)
}

/// A hand-made client of the listener at `to`: hello as `name` (with `secret`, the
/// proof too), then a writer of frames. Returns the socket and the writer.
fn rogue(to: SocketAddr, name: &str, secret: Option<&[u8]>) -> (TcpStream, FrameWriter<TcpStream>) {
    let (mut s, theirs) = raw_hello(to);
    let ours = Hello {
        auth: secret.is_some(),
        nonce: [0x5A; 16],
        name: name.into(),
    };
    s.write_all(&ours.encode()).unwrap();
    if let Some(secret) = secret {
        let proof = hello_proof(secret, Role::Connecting, &ours, &theirs).unwrap();
        s.write_all(&proof).unwrap();
        let mut their_proof = [0u8; 32];
        s.read_exact(&mut their_proof).unwrap();
        assert_eq!(
            their_proof,
            hello_proof(secret, Role::Accepting, &theirs, &ours).unwrap()
        );
    }
    let settings = FrameSettings {
        secret: secret.map(Arc::from),
        max_frame_bytes: 1 << 20,
        io_timeout: Duration::from_secs(2),
    };
    let w = FrameWriter::new(s.try_clone().unwrap(), &settings, theirs.nonce);
    (s, w)
}

#[test]
fn garbage_oversized_and_forged_frames_leave_the_listener_serving() {
    let secret: &[u8] = b"k";
    let mut a = FakeAgent::new("a", listening(Some(secret)));
    let md_a = blob("a", 2000);
    a.manager.set_local_md(md_a.clone());
    let to = addr(&a);

    // A silent connection that holds a thread: others are still served.
    let silent = TcpStream::connect(to).unwrap();

    // Garbage instead of a hello.
    let mut g = TcpStream::connect(to).unwrap();
    g.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    g.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nxxxxxxxxxxxxxxxxxxxxxx")
        .unwrap();
    assert!(closed(g));

    // A valid hello claiming auth, then a 64 MiB frame header where the proof belongs:
    // refused at the proof, nothing allocated for the "frame".
    let hello = Hello {
        auth: true,
        nonce: [7; 16],
        name: "mallory".into(),
    };
    let (mut o, _) = raw_hello(to);
    o.write_all(&hello.encode()).unwrap();
    o.write_all(&(64u32 << 20).to_le_bytes()).unwrap();
    o.write_all(&[0; 28]).unwrap();
    assert!(closed(o));

    // A forged proof.
    let (mut f, _) = raw_hello(to);
    f.write_all(&hello.encode()).unwrap();
    f.write_all(&[0xAB; 32]).unwrap();
    assert!(closed(f));

    // A hello that echoes the listener's own nonce (a reflection): refused.
    let (mut r, theirs) = raw_hello(to);
    r.write_all(&theirs.encode()).unwrap();
    assert!(closed(r));

    // A frame whose name length runs past the body (malformed), on a no-auth listener.
    let mut open = FakeAgent::new("open", listening(None));
    let (mut m, _) = raw_hello(addr(&open));
    let plain = Hello {
        auth: false,
        nonce: [1; 16],
        name: "x".into(),
    };
    m.write_all(&plain.encode()).unwrap();
    let body = [1u8, 0, 0, 0, 0, 0, 0, 0, 0, 200, b'x'];
    m.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
    m.write_all(&body).unwrap();
    assert!(closed(m));
    assert_eq!(refused(&open), 1);
    open.pump();
    assert!(open.peers.is_empty());

    assert!(refused(&a) >= 4, "refused {}", refused(&a));
    a.pump();
    assert!(
        a.md("mallory", FULL_LABEL).is_none(),
        "forged metadata was loaded"
    );

    // A good peer is served throughout.
    let mut b = FakeAgent::new("b", listening(Some(secret)));
    b.manager.fetch_remote_md("a", Via::Peer(to), None).unwrap();
    b.wait_md("a", FULL_LABEL, &md_a, LONG);
    drop(silent);
}

/// Send `bytes` one at a time, 100 ms apart, until the listener closes the
/// connection; returns how many were sent.
fn trickle(s: &mut TcpStream, bytes: &[u8]) -> usize {
    for (i, b) in bytes.iter().enumerate() {
        if s.write_all(&[*b]).is_err() {
            return i;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bytes.len()
}

/// A hello or a frame trickled one byte at a time is cut off by its deadline (the I/O
/// timeout, 1 s here), however steadily the bytes come: not held open for the 20 s the
/// trickle would take.
#[test]
fn trickled_hellos_and_frames_are_cut_off_by_their_deadline() {
    let mut cfg = listening(None);
    cfg.io_timeout = Duration::from_secs(1);
    let a = FakeAgent::new("a", cfg);
    let to = addr(&a);
    let hello = Hello {
        auth: false,
        nonce: [2; 16],
        name: "slow".into(),
    };
    let mut long_hello = hello.encode();
    long_hello.resize(200, b'x'); // more than the hello, sent forever
    let (mut s, _) = raw_hello(to);
    let sent = trickle(&mut s, &long_hello);
    assert!(
        sent < long_hello.len(),
        "a trickled hello was never cut off"
    );

    // A complete hello, then a frame head trickled.
    let (mut s, _) = raw_hello(to);
    s.write_all(&hello.encode()).unwrap();
    let mut frame = (1000u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 4]);
    frame.extend_from_slice(b"slow");
    frame.resize(200, 0);
    let sent = trickle(&mut s, &frame);
    assert!(sent < frame.len(), "a trickled frame was never cut off");
}

#[test]
fn a_connection_speaks_only_for_the_agent_of_its_hello() {
    for secret in [None, Some(&b"team"[..])] {
        let mut a = FakeAgent::new("a", listening(secret));
        let to = addr(&a);
        // B is known at A.
        let b = FakeAgent::new("b", listening(secret));
        let md_b = blob("b", 100);
        b.manager.set_local_md(md_b.clone());
        b.manager.send_local_md(Via::Peer(to)).unwrap();
        a.wait_md("b", FULL_LABEL, &md_b, LONG);

        // Mallory (with the secret, when there is one: an insider) connects as
        // herself and sends a Load, then an Invalidate, naming B: refused at the
        // frame, the connection closed, B untouched.
        for kind in [Kind::Load, Kind::Invalidate] {
            let before = refused(&a);
            let (s, mut w) = rogue(to, "mallory", secret);
            w.send(kind, "b", FULL_LABEL, b"evil").unwrap();
            assert!(closed(s));
            assert_eq!(refused(&a), before + 1, "{kind:?} secret {secret:?}");
        }
        a.pump();
        assert_eq!(a.md("b", FULL_LABEL), Some(&md_b[..]));
        assert!(a.invalidated.is_empty(), "{:?}", a.invalidated);

        // Her own name works (the metadata's content is checked by the agent).
        let (s, mut w) = rogue(to, "mallory", secret);
        w.send(Kind::Load, "mallory", FULL_LABEL, b"hers").unwrap();
        a.pump_until(LONG, |a| a.md("mallory", FULL_LABEL).is_some());
        assert_eq!(a.md("mallory", FULL_LABEL), Some(&b"hers"[..]));
        drop(s);

        // Without the secret nobody gets past the hello of a listener that has one.
        if secret.is_some() {
            let before = refused(&a);
            let (s, _) = raw_hello(to);
            let mut s2 = s.try_clone().unwrap();
            let h = Hello {
                auth: true,
                nonce: [3; 16],
                name: "b".into(),
            };
            s2.write_all(&h.encode()).unwrap();
            s2.write_all(&hello_proof(b"guess", Role::Connecting, &h, &h).unwrap())
                .unwrap();
            assert!(closed(s));
            assert_eq!(refused(&a), before + 1);
        }
    }
}

#[test]
fn a_full_event_queue_refuses_pushes_with_an_error_and_reports_an_overflow() {
    let mut cfg = listening(None);
    cfg.event_capacity = 2;
    let mut a = FakeAgent::new("a", cfg);
    let mut b = FakeAgent::new("b", listening(None));
    let to = addr(&a);
    // A does not poll while B pushes five labels, one after the other.
    for i in 0..5 {
        b.manager
            .send_local_partial_md(&format!("l{i}"), blob("b", 10), Via::Peer(to))
            .unwrap();
    }
    assert!(b.pump_until(LONG, |b| b.send_failures.len() == 3));
    for (_, _, e) in &b.send_failures {
        assert!(e.to_string().contains("event queue is full"), "{e}");
    }
    let stats = a.manager.p2p_stats().unwrap();
    assert_eq!(stats.frames_dropped.load(Ordering::Relaxed), 3);
    assert_eq!(a.manager.events_dropped(), 3);
    a.pump();
    assert_eq!(a.peers["b"].len(), 2, "the two queued loads");
    assert_eq!(a.overflows.len(), 1, "{:?}", a.overflows);
    let (agent, lost) = &a.overflows[0];
    assert_eq!(agent.as_deref(), Some("b"));
    assert_eq!(
        (lost.events, lost.loads, lost.invalidation),
        (3, true, false)
    );
}

#[test]
fn oversized_metadata_is_refused_before_sending() {
    let a = FakeAgent::new("a", listening(None));
    let mut b = FakeAgent::new("b", listening(None));
    b.manager.set_local_md(blob("b", 2 << 20));
    b.manager.send_local_md(Via::Peer(addr(&a))).unwrap();
    assert!(b.pump_until(LONG, |b| !b.send_failures.is_empty()));
    let e = &b.send_failures[0].2;
    assert!(e.to_string().contains("over the limit"), "{e}");
}

#[test]
fn unreachable_peer_and_missing_store_give_clear_errors() {
    let mut b = FakeAgent::new("b", ExchangeConfig::default());
    assert!(
        !b.manager.workers_running(),
        "no listener, no store: no threads"
    );
    // A port nobody listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    b.manager
        .fetch_remote_md("a", Via::Peer(dead), None)
        .unwrap();
    assert!(b.manager.workers_running(), "the P2P client worker started");
    let e = b.wait_fetch_failure("a", LONG);
    assert!(e.to_string().contains(&dead.to_string()), "{e}");

    let e = b
        .manager
        .fetch_remote_md("a", Via::Store, None)
        .unwrap_err();
    assert!(matches!(e, Error::NotSupported { .. }), "{e}");
    assert!(e.to_string().contains("no metadata store"), "{e}");
    let e = b.manager.send_local_md(Via::Store).unwrap_err();
    assert!(
        matches!(e, Error::NotAllowed { .. }),
        "no local metadata yet: {e}"
    );
    assert!(b.manager.fetch_remote_md("a/b", Via::Store, None).is_err());
    assert!(b
        .manager
        .send_local_partial_md(FULL_LABEL, blob("b", 3), Via::Store)
        .is_err());
}

#[test]
fn listener_binds_only_what_it_is_told() {
    let m = Manager::new("x", listening(None)).unwrap();
    let a = m.p2p_listen_addr().unwrap();
    assert!(a.ip().is_loopback() && a.port() != 0);
    assert!(m.workers_running());
    drop(m);
    // The port is free again after drop: the listener and its threads are gone.
    std::net::TcpListener::bind(a).expect("port released");
}

/// A fetch from a fresh agent `b` to `a`: time from the call to the load.
fn timed_fetch(b: &mut FakeAgent, a: &FakeAgent, md: &[u8]) -> Duration {
    let start = std::time::Instant::now();
    b.manager
        .fetch_remote_md(a.manager.agent_name(), Via::Peer(addr(a)), None)
        .unwrap();
    b.wait_md(a.manager.agent_name(), FULL_LABEL, md, LONG);
    start.elapsed()
}

#[test]
fn a_black_holed_peer_does_not_delay_fetches_from_others() {
    let a = FakeAgent::new("healthy-0", listening(None));
    let md = blob("healthy-0", 2000);
    a.manager.set_local_md(md.clone());
    // Baseline: fetches over a fresh connection (connect and hello included).
    let mut baseline = Duration::ZERO;
    for i in 0..3 {
        let mut b = FakeAgent::new(&format!("base-{i}"), listening(None));
        baseline = baseline.max(timed_fetch(&mut b, &a, &md));
    }
    // Listeners that accept and never answer: each hello to them waits out the I/O
    // timeout (2 s here).
    let holes: Vec<std::net::TcpListener> = (0..4)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let mut held = Vec::new();
    let mut b = FakeAgent::new("fetcher-0", listening(None));
    for (i, hole) in holes.iter().enumerate() {
        b.manager
            .fetch_remote_md(
                &format!("hole-{i}"),
                Via::Peer(hole.local_addr().unwrap()),
                None,
            )
            .unwrap();
    }
    for hole in &holes {
        let (s, _) = hole.accept().unwrap();
        held.push(s);
    }
    // Every black-holed hello is in flight; a fetch from a healthy peer is not held up.
    let delayed = timed_fetch(&mut b, &a, &md);
    println!("fresh fetch: baseline {baseline:?}, beside 4 black holes {delayed:?}");
    assert!(
        delayed <= baseline + Duration::from_millis(100),
        "fetch beside black-holed peers took {delayed:?} (baseline {baseline:?})"
    );
    // The black-holed fetches fail with a timeout, each on its own.
    for i in 0..holes.len() {
        let e = b.wait_fetch_failure(&format!("hole-{i}"), LONG);
        assert!(e.to_string().contains("timed out"), "{e}");
    }
    drop(held);
}

/// An invalidation queued right before the agent goes away still reaches the peer: the
/// manager's drop lets the queued P2P commands go out first (what NIXL's Python flow
/// does: `invalidate_local_metadata`, then the agent is released).
#[test]
fn an_invalidation_right_before_the_drop_still_arrives() {
    let mut b = FakeAgent::new("decode-0", listening(None));
    for round in 0..5 {
        let name = format!("prefill-{round}");
        let a = FakeAgent::new(&name, listening(None));
        let md_a = blob(&name, 1000);
        a.manager.set_local_md(md_a.clone());
        a.manager.send_local_md(Via::Peer(addr(&b))).unwrap();
        b.wait_md(&name, FULL_LABEL, &md_a, LONG);
        a.manager.invalidate_local_md(Via::Peer(addr(&b))).unwrap();
        drop(a);
        b.wait_invalidated(&name, LONG);
        assert!(b.md(&name, FULL_LABEL).is_none(), "round {round}");
    }
}
