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

/// Read the 22-byte hello of a Ferry listener.
fn raw_hello(to: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = [0u8; 22];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..4], b"FRYX");
    s
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

    // A valid hello (claiming auth), then an oversized frame header.
    let mut o = raw_hello(to);
    let mut hello = *b"FRYX\x01\x01................";
    hello[6..].copy_from_slice(&[7; 16]);
    o.write_all(&hello).unwrap();
    o.write_all(&(64u32 << 20).to_le_bytes()).unwrap();
    assert!(closed(o));

    // A valid hello, then a well-formed Load frame with a forged tag.
    let mut f = raw_hello(to);
    f.write_all(&hello).unwrap();
    let mut body = vec![1u8];
    body.extend_from_slice(&0u64.to_le_bytes());
    body.push(7);
    body.extend_from_slice(b"mallory");
    body.push(8);
    body.extend_from_slice(b"metadata");
    body.extend_from_slice(b"evil metadata");
    body.extend_from_slice(&[0xAB; 32]);
    f.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
    f.write_all(&body).unwrap();
    assert!(closed(f));

    // A frame whose name length runs past the body (malformed), on a no-auth listener.
    let mut open = FakeAgent::new("open", listening(None));
    let mut m = raw_hello(addr(&open));
    m.write_all(b"FRYX\x01\x00................").unwrap();
    let body = [1u8, 0, 0, 0, 0, 0, 0, 0, 0, 200, b'x'];
    m.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
    m.write_all(&body).unwrap();
    assert!(closed(m));
    assert_eq!(
        open.manager
            .p2p_stats()
            .unwrap()
            .connections_refused
            .load(Ordering::Relaxed),
        1
    );
    open.pump();
    assert!(open.peers.is_empty());

    let stats = a.manager.p2p_stats().unwrap();
    assert!(stats.connections_refused.load(Ordering::Relaxed) >= 3);
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
