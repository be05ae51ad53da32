//! The encrypted metadata plane (cargo feature `tls`): mutual TLS round trips on
//! Ferry's TCPStore server and client and on the P2P listener and client, with the
//! certificates of `tests/tls/` (server certificate for 127.0.0.1, client certificate,
//! one CA); a client without TLS, or without a certificate, is refused. Without the
//! feature, TLS settings are a `NotSupported` error at start.

// Without the feature only the refusal test runs; the round trips' imports stay unused.
#![cfg_attr(not(feature = "tls"), allow(unused_imports))]

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{blob, FakeAgent, LONG};
use ferry_exchange::tcpstore::{serve, ClientOptions, ServerConfig, TcpStoreClient};
use ferry_exchange::{
    ExchangeConfig, P2pConfig, StoreConfig, TcpStoreConfig, TlsConfig, TlsContext, Via, FULL_LABEL,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/tls")
        .join(name)
}

/// Server certificate as a server, client certificate as a client, one CA.
fn tls() -> TlsConfig {
    TlsConfig {
        client_cert: Some(fixture("client.pem")),
        client_key: Some(fixture("client-key.pem")),
        ..TlsConfig::new(
            fixture("ca.pem"),
            fixture("server.pem"),
            fixture("server-key.pem"),
        )
    }
}

#[cfg(not(feature = "tls"))]
#[test]
fn tls_settings_without_the_feature_are_refused() {
    let e = TlsContext::load(&tls()).unwrap_err();
    assert!(e.to_string().contains("`tls` cargo feature"), "{e}");
    let c = ServerConfig {
        tls: Some(tls()),
        ..ServerConfig::default()
    };
    assert!(serve("127.0.0.1:0".parse().unwrap(), c).is_err());
    eprintln!("the TLS round trips need `--features tls`");
}

#[cfg(feature = "tls")]
#[test]
fn tcpstore_round_trip_over_tls() {
    let c = ServerConfig {
        tls: Some(tls()),
        ..ServerConfig::default()
    };
    let server = serve("127.0.0.1:0".parse().unwrap(), c).unwrap();
    let endpoint = server.local_addr().to_string();
    let options = ClientOptions {
        tls: Some(TlsContext::load(&tls()).unwrap()),
        ..ClientOptions::default()
    };
    let mut client = TcpStoreClient::connect(&endpoint, options.clone()).unwrap();
    client.set(b"/k", b"encrypted").unwrap();
    assert_eq!(client.get(b"/k").unwrap(), b"encrypted");
    // A WAIT woken by another connection's SET: the wake-up byte is written by the
    // setter's thread into the waiter's TLS session.
    let setter_options = options.clone();
    let setter_endpoint = endpoint.clone();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        let mut c = TcpStoreClient::connect(&setter_endpoint, setter_options).unwrap();
        c.set(b"/later", b"here").unwrap();
        c.get(b"/later").unwrap()
    });
    assert!(client.wait(&[b"/later"], LONG).unwrap());
    assert_eq!(setter.join().unwrap(), b"here");
    // A large value crosses many TLS records.
    let big: Vec<u8> = (0..3 << 20).map(|i| (i % 251) as u8).collect();
    client.set(b"/big", &big).unwrap();
    assert_eq!(client.get(b"/big").unwrap(), big);

    // A plain client is refused (its VALIDATE is not TLS).
    let plain = TcpStoreClient::connect(&endpoint, ClientOptions::default());
    assert!(plain.and_then(|mut c| c.get(b"/k")).is_err());
    // Mutual TLS: a client certificate not made for clients (the server's, whose
    // extended key usage is serverAuth only) is refused by the server.
    let wrong_role = TlsConfig {
        client_cert: Some(fixture("server.pem")),
        client_key: Some(fixture("server-key.pem")),
        ..tls()
    };
    let wrong = ClientOptions {
        tls: Some(TlsContext::load(&wrong_role).unwrap()),
        ..ClientOptions::default()
    };
    let refused = TcpStoreClient::connect(&endpoint, wrong);
    assert!(refused.and_then(|mut c| c.get(b"/k")).is_err());
    // A certificate with a key that is not its own is a typed error at load.
    let mismatched = TlsConfig {
        client_cert: Some(fixture("client.pem")),
        client_key: Some(fixture("server-key.pem")),
        ..tls()
    };
    assert!(TlsContext::load(&mismatched).is_err());

    // Two managers discover each other through the TLS store.
    let mut ts = TcpStoreConfig::new(endpoint);
    ts.tls = Some(tls());
    ts.watch_interval = Duration::from_millis(100);
    let cfg = ExchangeConfig {
        store: StoreConfig::TcpStore(ts),
        namespace: "tls".into(),
        ..ExchangeConfig::default()
    };
    let a = FakeAgent::new("tls-a", cfg.clone());
    let mut b = FakeAgent::new("tls-b", cfg);
    let md = blob("tls-a", 100_000);
    a.manager.set_local_md(md.clone());
    a.manager.send_local_md(Via::Store).unwrap();
    b.manager
        .fetch_remote_md("tls-a", Via::Store, None)
        .unwrap();
    b.wait_md("tls-a", FULL_LABEL, &md, LONG);
    // Again, on the direct path (written by the caller's thread).
    let deadline = std::time::Instant::now() + LONG;
    while b.manager.direct_fetches() == 0 && std::time::Instant::now() < deadline {
        b.peers.clear();
        b.manager
            .fetch_remote_md("tls-a", Via::Store, None)
            .unwrap();
        b.wait_md("tls-a", FULL_LABEL, &md, LONG);
    }
    assert!(b.manager.direct_fetches() > 0);
    a.manager.invalidate_local_md(Via::Store).unwrap();
    b.wait_invalidated("tls-a", LONG);
    assert!(b.fetch_failures.is_empty(), "{:?}", b.fetch_failures);
}

#[cfg(feature = "tls")]
#[test]
fn p2p_round_trip_over_tls() {
    let listening = |tls_on: bool| {
        let mut c = ExchangeConfig::default();
        c.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
        c.p2p.tls = tls_on.then(tls);
        c.io_timeout = Duration::from_secs(2);
        c
    };
    let mut a = FakeAgent::new("p2p-tls-a", listening(true));
    let mut b = FakeAgent::new("p2p-tls-b", listening(true));
    let to_a = Via::Peer(a.manager.p2p_listen_addr().unwrap());
    let md_a = blob("p2p-tls-a", 200_000);
    let md_b = blob("p2p-tls-b", 1000);
    a.manager.set_local_md(md_a.clone());
    b.manager.set_local_md(md_b.clone());
    // Fetch (lane, then the direct path on the idle connection) and push, both ways.
    b.manager.fetch_remote_md("p2p-tls-a", to_a, None).unwrap();
    b.wait_md("p2p-tls-a", FULL_LABEL, &md_a, LONG);
    b.peers.clear();
    b.manager.fetch_remote_md("p2p-tls-a", to_a, None).unwrap();
    b.wait_md("p2p-tls-a", FULL_LABEL, &md_a, LONG);
    assert!(b.manager.direct_fetches() > 0);
    b.manager.send_local_md(to_a).unwrap();
    a.wait_md("p2p-tls-b", FULL_LABEL, &md_b, LONG);
    b.manager.invalidate_local_md(to_a).unwrap();
    a.wait_invalidated("p2p-tls-b", LONG);

    // A peer without TLS gets nothing from the TLS listener.
    let mut plain = FakeAgent::new("plain", listening(false));
    plain
        .manager
        .fetch_remote_md("p2p-tls-a", to_a, None)
        .unwrap();
    plain.wait_fetch_failure("p2p-tls-a", LONG);
    assert!(plain.md("p2p-tls-a", FULL_LABEL).is_none());
}
