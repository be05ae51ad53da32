//! Discovery through a real etcd server (crate feature `etcd`). The endpoint comes from
//! `FERRY_TEST_ETCD` (e.g. `http://127.0.0.1:23790`); under `CI=true` a missing endpoint
//! fails the tests, elsewhere they say why they skip. Outages are made with a loopback
//! TCP proxy in front of etcd that the test cuts and restores.

mod common;

#[cfg(not(feature = "etcd"))]
#[test]
fn etcd_tests_need_the_feature() {
    assert!(
        !ferry_testkit::ci::under_ci(),
        "CI=true but ferry-exchange was built without the `etcd` feature: the etcd tests \
         did not run (tools/test.sh enables it; protoc and libprotobuf-dev are needed)"
    );
    eprintln!("skipping: the etcd tests need `cargo test -p ferry-exchange --features etcd`");
}

#[cfg(feature = "etcd")]
mod with_etcd {
    use std::io::{Read, Write};
    use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    use super::common::{blob, FakeAgent, LONG};
    use ferry_exchange::{
        EtcdConfig, EtcdTls, EtcdUser, ExchangeConfig, Route, StoreConfig, Via, FULL_LABEL,
    };
    use ferry_storage::Error;
    use ferry_testkit::ci::under_ci;

    /// The test etcd's endpoint, or `None` (skip) outside CI.
    fn endpoint() -> Option<String> {
        match std::env::var("FERRY_TEST_ETCD") {
            Ok(e) if !e.is_empty() => Some(e),
            _ if under_ci() => {
                panic!("CI=true but FERRY_TEST_ETCD is not set: the etcd tests need a running etcd")
            }
            _ => {
                eprintln!("skipping: FERRY_TEST_ETCD is not set (e.g. http://127.0.0.1:23790)");
                None
            }
        }
    }

    /// A namespace of its own for each test run and test.
    fn config(endpoint: &str, test: &str) -> ExchangeConfig {
        let mut etcd = EtcdConfig::new(vec![endpoint.to_owned()]);
        etcd.lease_ttl = Duration::from_secs(2);
        ExchangeConfig {
            store: StoreConfig::Etcd(etcd),
            namespace: format!("ferry-test/{}-{}/{test}", std::process::id(), nanos()),
            io_timeout: Duration::from_secs(2),
            fetch_timeout: Duration::from_secs(5),
            ..ExchangeConfig::default()
        }
    }

    fn nanos() -> u128 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    }

    #[test]
    fn agents_discover_each_other_and_see_deletion() {
        let Some(ep) = endpoint() else { return };
        let cfg = config(&ep, "discover");
        let mut a = FakeAgent::new("prefill-0", cfg.clone());
        let mut b = FakeAgent::new("decode-0", cfg);
        assert_eq!(b.manager.store().map(|s| s.0), Some(Route::Etcd));

        // Fetch first, publish later: the watch picks up the put.
        b.manager
            .fetch_remote_md("prefill-0", Via::Store, None)
            .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let md_a = blob("prefill-0", 20_000);
        a.manager.set_local_md(md_a.clone());
        a.manager.send_local_md(Via::Store).unwrap();
        b.wait_md("prefill-0", FULL_LABEL, &md_a, LONG);

        // Already published: a plain get.
        let md_b = blob("decode-0", 100);
        b.manager.set_local_md(md_b.clone());
        b.manager.send_local_md(Via::Store).unwrap();
        a.manager
            .fetch_remote_md("decode-0", Via::Store, None)
            .unwrap();
        a.wait_md("decode-0", FULL_LABEL, &md_b, LONG);

        // Partial metadata under its label.
        let part = blob("prefill-0/layer-2", 77);
        a.manager
            .send_local_partial_md("layer-2", part.clone(), Via::Store)
            .unwrap();
        b.manager
            .fetch_remote_md("prefill-0", Via::Store, Some("layer-2"))
            .unwrap();
        b.wait_md("prefill-0", "layer-2", &part, LONG);

        // A withdraws: the watch on its key tells B.
        a.manager.invalidate_local_md(Via::Store).unwrap();
        b.wait_invalidated("prefill-0", LONG);
        assert!(
            a.send_failures.is_empty() && b.send_failures.is_empty(),
            "{:?} {:?}",
            a.send_failures,
            b.send_failures
        );
    }

    #[test]
    fn a_crashed_agents_metadata_expires_with_its_lease() {
        let Some(ep) = endpoint() else { return };
        let cfg = config(&ep, "lease");
        let a = FakeAgent::new("short-lived", cfg.clone());
        let mut b = FakeAgent::new("watcher", cfg);
        let md = blob("short-lived", 10);
        a.manager.set_local_md(md.clone());
        a.manager.send_local_md(Via::Store).unwrap();
        b.manager
            .fetch_remote_md("short-lived", Via::Store, None)
            .unwrap();
        b.wait_md("short-lived", FULL_LABEL, &md, LONG);
        // Outlive the TTL a few times while A is alive: the lease is kept.
        std::thread::sleep(Duration::from_secs(3));
        b.pump();
        assert!(
            b.invalidated.is_empty(),
            "invalidated while A kept its lease alive"
        );
        // "Crash": A goes away without invalidating; its lease (2 s) expires.
        let t = Instant::now();
        drop(a);
        b.wait_invalidated("short-lived", Duration::from_secs(15));
        assert!(
            t.elapsed() >= Duration::from_secs(1),
            "expired too early: {:?}",
            t.elapsed()
        );
    }

    #[test]
    fn missing_agent_times_out_with_a_clear_error() {
        let Some(ep) = endpoint() else { return };
        let mut cfg = config(&ep, "missing");
        cfg.fetch_timeout = Duration::from_millis(300);
        let mut b = FakeAgent::new("b", cfg);
        b.manager
            .fetch_remote_md("ghost", Via::Store, None)
            .unwrap();
        let e = b.wait_fetch_failure("ghost", LONG);
        assert!(matches!(e, Error::Backend { .. }), "{e}");
        assert!(
            e.to_string().contains("ghost")
                && e.to_string().contains("not published within 300 ms"),
            "{e}"
        );
    }

    /// A loopback TCP proxy in front of etcd that can be cut (all connections closed,
    /// port closed) and restored on the same port.
    struct Proxy {
        addr: SocketAddr,
        upstream: SocketAddr,
        stop: Arc<AtomicBool>,
        conns: Arc<Mutex<Vec<TcpStream>>>,
        accept: Option<JoinHandle<()>>,
    }

    impl Proxy {
        fn start(addr: SocketAddr, upstream: SocketAddr) -> Proxy {
            let listener = TcpListener::bind(addr).expect("proxy port");
            let addr = listener.local_addr().unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let conns = Arc::new(Mutex::new(Vec::new()));
            let accept = {
                let (stop, conns) = (stop.clone(), conns.clone());
                std::thread::spawn(move || {
                    for client in listener.incoming() {
                        if stop.load(Ordering::Acquire) {
                            return;
                        }
                        let Ok(client) = client else { continue };
                        let Ok(server) = TcpStream::connect(upstream) else {
                            continue;
                        };
                        let mut list = conns.lock().unwrap();
                        list.push(client.try_clone().unwrap());
                        list.push(server.try_clone().unwrap());
                        for (mut from, mut to) in [
                            (client.try_clone().unwrap(), server.try_clone().unwrap()),
                            (server, client),
                        ] {
                            std::thread::spawn(move || {
                                let mut buf = [0u8; 16384];
                                while let Ok(n @ 1..) = from.read(&mut buf) {
                                    if to.write_all(&buf[..n]).is_err() {
                                        break;
                                    }
                                }
                                let _unused = to.shutdown(Shutdown::Both);
                            });
                        }
                    }
                })
            };
            Proxy {
                addr,
                upstream,
                stop,
                conns,
                accept: Some(accept),
            }
        }

        fn cut(&mut self) {
            self.stop.store(true, Ordering::Release);
            let _unused = TcpStream::connect(self.addr);
            if let Some(t) = self.accept.take() {
                t.join().unwrap();
            }
            for c in self.conns.lock().unwrap().drain(..) {
                let _unused = c.shutdown(Shutdown::Both);
            }
        }

        fn restore(&self) -> Proxy {
            Proxy::start(self.addr, self.upstream)
        }
    }

    impl Drop for Proxy {
        fn drop(&mut self) {
            self.cut();
        }
    }

    fn upstream(endpoint: &str) -> SocketAddr {
        use std::net::ToSocketAddrs;
        let hostport = endpoint.trim_start_matches("http://").trim_end_matches('/');
        hostport.to_socket_addrs().unwrap().next().unwrap()
    }

    #[test]
    fn etcd_outage_gives_errors_then_recovers() {
        let Some(ep) = endpoint() else { return };
        let mut proxy = Proxy::start("127.0.0.1:0".parse().unwrap(), upstream(&ep));
        let via_proxy = format!("http://{}", proxy.addr);
        let mut cfg = config(&via_proxy, "outage");
        cfg.io_timeout = Duration::from_secs(1);
        let mut a = FakeAgent::new("a", cfg.clone());
        let mut b = FakeAgent::new("b", cfg.clone());
        let md = blob("a", 1000);
        a.manager.set_local_md(md.clone());
        a.manager.send_local_md(Via::Store).unwrap();
        b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
        b.wait_md("a", FULL_LABEL, &md, LONG);

        proxy.cut();
        let t = Instant::now();
        b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
        let e = b.wait_fetch_failure("a", LONG);
        assert!(matches!(e, Error::Backend { .. }), "{e}");
        assert!(
            t.elapsed() < Duration::from_secs(6),
            "took {:?}",
            t.elapsed()
        );
        a.manager
            .send_local_partial_md("p", blob("a/p", 5), Via::Store)
            .unwrap();
        assert!(a.pump_until(LONG, |a| !a.send_failures.is_empty()));

        // etcd is reachable again: fetches work, and A's lease and keys are there.
        let _proxy = proxy.restore();
        b.peers.clear();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
            let answered = b.pump_until(LONG, |b| {
                b.md("a", FULL_LABEL).is_some() || !b.fetch_failures.is_empty()
            });
            assert!(answered, "a fetch neither succeeded nor failed");
            if b.md("a", FULL_LABEL).is_some() {
                break;
            }
            // The gRPC channel reconnects on its own schedule: ask again.
            b.fetch_failures.clear();
            assert!(
                Instant::now() < deadline,
                "no recovery after etcd came back"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        assert_eq!(b.md("a", FULL_LABEL), Some(&md[..]));
        // The label whose publish failed during the outage is published after it
        // (checked directly, not through the proxy).
        let mut check_cfg = cfg;
        check_cfg.store = StoreConfig::Etcd(EtcdConfig::new(vec![ep.clone()]));
        let mut c = FakeAgent::new("checker", check_cfg);
        c.manager
            .fetch_remote_md("a", Via::Store, Some("p"))
            .unwrap();
        c.wait_md("a", "p", &blob("a/p", 5), Duration::from_secs(20));
    }

    /// An etcd of the test's own (temp data dir, free ports; killed on drop), for what
    /// must not touch the shared one (enabling authentication). The binary comes from
    /// `FERRY_TEST_ETCD_BIN` or `etcd` on the PATH; under `CI=true` a missing one fails.
    struct OwnEtcd {
        child: std::process::Child,
        dir: std::path::PathBuf,
        endpoint: String,
    }

    impl OwnEtcd {
        fn start() -> Option<OwnEtcd> {
            OwnEtcd::start_with(false)
        }

        /// With `tls`: `https://` with the test certificates of `tests/tls/` (server
        /// certificate for 127.0.0.1, client certificates required).
        fn start_with(tls: bool) -> Option<OwnEtcd> {
            let bin = std::env::var("FERRY_TEST_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
            let runs = std::process::Command::new(&bin)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success());
            if !runs {
                assert!(!under_ci(), "CI=true but no etcd binary ('{bin}') to start");
                eprintln!("skipping: no etcd binary ('{bin}'; set FERRY_TEST_ETCD_BIN)");
                return None;
            }
            let port = || {
                TcpListener::bind("127.0.0.1:0")
                    .unwrap()
                    .local_addr()
                    .unwrap()
                    .port()
            };
            let (client, peer) = (port(), port());
            let dir =
                std::env::temp_dir().join(format!("ferry-etcd-{}-{}", std::process::id(), nanos()));
            std::fs::create_dir_all(&dir).unwrap();
            let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
            let scheme = if tls { "https" } else { "http" };
            let endpoint = format!("{scheme}://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let mut command = std::process::Command::new(&bin);
            if tls {
                let dir = tls_dir();
                command
                    .arg("--cert-file")
                    .arg(dir.join("server.pem"))
                    .arg("--key-file")
                    .arg(dir.join("server-key.pem"))
                    .arg("--trusted-ca-file")
                    .arg(dir.join("ca.pem"))
                    .arg("--client-cert-auth");
            }
            let child = command
                .args(["--name", "own", "--data-dir"])
                .arg(dir.join("data"))
                .args(["--listen-client-urls", &endpoint])
                .args(["--advertise-client-urls", &endpoint])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("own={peer_url}")])
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap();
            let own = OwnEtcd {
                child,
                dir,
                endpoint,
            };
            let deadline = Instant::now() + LONG;
            while TcpStream::connect(("127.0.0.1", client)).is_err() {
                assert!(Instant::now() < deadline, "our etcd did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
            Some(own)
        }
    }

    impl Drop for OwnEtcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// With authentication enabled in etcd, agents configured with the user discover
    /// each other; one without the user, or with a wrong password, gets errors.
    #[test]
    fn an_etcd_with_authentication_serves_only_its_users() {
        let Some(etcd) = OwnEtcd::start() else {
            return;
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut c = etcd_client::Client::connect([&etcd.endpoint], None)
                .await
                .unwrap();
            c.user_add("root", "root-pw", None).await.unwrap();
            c.user_grant_role("root", "root").await.unwrap();
            c.auth_enable().await.unwrap();
        });
        let with_user = |name: &str, password: &str| {
            let mut cfg = config(&etcd.endpoint, "auth");
            if let StoreConfig::Etcd(e) = &mut cfg.store {
                e.user = Some(EtcdUser {
                    name: name.into(),
                    password: password.into(),
                });
            }
            cfg
        };
        let good = with_user("root", "root-pw");
        let a = FakeAgent::new("a", good.clone());
        let mut b = FakeAgent::new("b", good.clone());
        let md_a = blob("a", 500);
        a.manager.set_local_md(md_a.clone());
        a.manager.send_local_md(Via::Store).unwrap();
        b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
        b.wait_md("a", FULL_LABEL, &md_a, LONG);
        assert!(a.send_failures.is_empty(), "{:?}", a.send_failures);

        // No user (same namespace), and a wrong password: refused by etcd.
        let mut anonymous = good.clone();
        if let StoreConfig::Etcd(e) = &mut anonymous.store {
            e.user = None;
        }
        for cfg in [anonymous, with_user("root", "guess")] {
            let mut m = FakeAgent::new("m", cfg);
            m.manager.set_local_md(blob("m", 10));
            m.manager.send_local_md(Via::Store).unwrap();
            assert!(m.pump_until(LONG, |m| !m.send_failures.is_empty()));
            m.manager.fetch_remote_md("a", Via::Store, None).unwrap();
            let e = m.wait_fetch_failure("a", LONG);
            assert!(matches!(e, Error::Backend { .. }), "{e}");
            assert!(m.md("a", FULL_LABEL).is_none());
        }
        // The user's agents still work.
        b.peers.clear();
        b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
        b.wait_md("a", FULL_LABEL, &md_a, LONG);
    }

    /// TLS settings need the `etcd-tls` feature; with it, unreadable files are refused
    /// when the manager starts.
    #[test]
    fn tls_settings_are_checked_at_start() {
        let mut etcd = EtcdConfig::new(vec!["https://127.0.0.1:1".into()]);
        etcd.tls = Some(EtcdTls {
            ca_cert: Some("/nonexistent/ca.pem".into()),
            ..EtcdTls::default()
        });
        let cfg = ExchangeConfig {
            store: StoreConfig::Etcd(etcd),
            ..ExchangeConfig::default()
        };
        let e = ferry_exchange::Manager::new("t", cfg)
            .err()
            .expect("refused");
        if cfg!(feature = "etcd-tls") {
            assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
        } else {
            assert!(matches!(e, Error::NotSupported { .. }), "{e}");
            assert!(e.to_string().contains("etcd-tls"), "{e}");
        }
    }

    /// The test certificates (a CA valid until 2126, a server certificate for
    /// 127.0.0.1 and a client certificate it signed; test fixtures, no secret).
    fn tls_dir() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tls")
    }

    /// TLS to etcd with a client certificate (feature `etcd-tls`): agents with the CA
    /// and the client certificate discover each other over `https://`; without the
    /// client certificate etcd refuses the connection.
    #[cfg(feature = "etcd-tls")]
    #[test]
    fn tls_with_a_client_certificate() {
        let Some(etcd) = OwnEtcd::start_with(true) else {
            return;
        };
        let dir = tls_dir();
        let base = config(&etcd.endpoint, "tls");
        let with_tls = |client_cert: bool| {
            let mut cfg = base.clone();
            if let StoreConfig::Etcd(e) = &mut cfg.store {
                e.tls = Some(EtcdTls {
                    ca_cert: Some(dir.join("ca.pem")),
                    client_cert: client_cert.then(|| dir.join("client.pem")),
                    client_key: client_cert.then(|| dir.join("client-key.pem")),
                    domain: None,
                });
            }
            cfg
        };
        let a = FakeAgent::new("a", with_tls(true));
        let mut b = FakeAgent::new("b", with_tls(true));
        let md_a = blob("a", 300);
        a.manager.set_local_md(md_a.clone());
        a.manager.send_local_md(Via::Store).unwrap();
        b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
        b.wait_md("a", FULL_LABEL, &md_a, LONG);

        let mut m = FakeAgent::new("m", with_tls(false));
        m.manager.fetch_remote_md("a", Via::Store, None).unwrap();
        let e = m.wait_fetch_failure("a", LONG);
        assert!(matches!(e, Error::Backend { .. }), "{e}");
    }
}
