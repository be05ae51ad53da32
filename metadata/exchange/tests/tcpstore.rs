//! Ferry's TCPStore client against Ferry's TCPStore server, and two managers that
//! discover each other by name through it (outage and recovery included). The client
//! against a real `torch.distributed.TCPStore` runs when `FERRY_TEST_TORCH_PYTHON`
//! names a Python with torch.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::{blob, FakeAgent, LONG};
use ferry_exchange::tcpstore::{serve, user_key, ClientOptions, ServerConfig, TcpStoreClient};
use ferry_exchange::{ExchangeConfig, Route, StoreConfig, TcpStoreConfig, Via, FULL_LABEL};
use ferry_storage::Error;

fn client(addr: SocketAddr) -> TcpStoreClient {
    TcpStoreClient::connect(&addr.to_string(), ClientOptions::default()).unwrap()
}

#[test]
fn client_and_server_speak_the_protocol() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let mut c = client(server.local_addr());
    c.set(b"/k", b"v1").unwrap();
    assert_eq!(c.get(b"/k").unwrap(), b"v1");
    assert_eq!(
        c.get(b"/missing").unwrap(),
        b"",
        "missing key reads empty (as libuv)"
    );
    assert!(c.check(&[b"/k"]).unwrap());
    assert!(!c.check(&[b"/k", b"/missing"]).unwrap());
    assert!(c.check(&[]).unwrap(), "n=0 is READY");
    assert_eq!(c.add(b"/n", 5).unwrap(), 5);
    assert_eq!(c.add(b"/n", -7).unwrap(), -2);
    assert_eq!(c.get(b"/n").unwrap(), b"-2", "ADD stores ASCII decimal");
    assert_eq!(c.num_keys().unwrap(), 2);
    assert_eq!(c.compare_set(b"/cas", b"", b"x").unwrap(), b"x");
    assert_eq!(c.compare_set(b"/cas", b"y", b"z").unwrap(), b"x");
    assert_eq!(c.compare_set(b"/cas", b"x", b"z").unwrap(), b"z");
    assert_eq!(c.compare_set(b"/nope", b"e", b"d").unwrap(), b"e");
    assert!(c.delete_key(b"/k").unwrap());
    assert!(!c.delete_key(b"/k").unwrap());
    assert_eq!(server.num_keys(), 2);

    // WAIT with a deadline: times out, the connection stays usable.
    let t = Instant::now();
    assert!(!c.wait(&[b"/later"], Duration::from_millis(100)).unwrap());
    assert!(t.elapsed() >= Duration::from_millis(100));
    assert_eq!(c.get(b"/n").unwrap(), b"-2", "usable after a canceled wait");

    // WAIT woken by another connection's SET.
    let addr = server.local_addr();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        client(addr).set(b"/later", b"here").unwrap();
    });
    assert!(c.wait(&[b"/later"], LONG).unwrap());
    assert_eq!(c.get(b"/later").unwrap(), b"here");
    setter.join().unwrap();
}

/// The operations of torch's client beyond the basic ones, on one connection: the
/// checks that every reply was read in step are the next operation's answer.
fn torch_ops_round(c: &mut TcpStoreClient, addr: SocketAddr, queues: bool, barrier: bool) {
    c.multi_set(&[(b"/m1", b"one"), (b"/m2", b""), (b"/m3", b"three")])
        .unwrap();
    assert_eq!(
        c.multi_get(&[b"/m1", b"/m2", b"/m3"]).unwrap(),
        vec![b"one".to_vec(), Vec::new(), b"three".to_vec()]
    );
    assert_eq!(
        c.multi_get_wait(&[b"/m3", b"/m1"], LONG).unwrap(),
        Some(vec![b"three".to_vec(), b"one".to_vec()])
    );
    assert_eq!(
        c.multi_get_wait(&[b"/m1", b"/never"], Duration::from_millis(50))
            .unwrap(),
        None
    );
    c.append(b"/ap", b"ab").unwrap();
    c.append(b"/ap", b"cd").unwrap();
    assert_eq!(c.get(b"/ap").unwrap(), b"abcd");
    // The store-based barrier works on every server (ADD + WAIT).
    let other = std::thread::spawn(move || client(addr).add_barrier(b"/ab", 2, LONG).unwrap());
    assert!(c.add_barrier(b"/ab", 2, LONG).unwrap());
    assert!(other.join().unwrap());
    if queues {
        assert_eq!(c.queue_len(b"/q").unwrap(), 0);
        assert_eq!(c.queue_pop(b"/q").unwrap(), None);
        c.queue_push(b"/q", b"first").unwrap();
        c.queue_push(b"/q", b"second").unwrap();
        assert_eq!(c.queue_len(b"/q").unwrap(), 2);
        assert_eq!(c.queue_pop(b"/q").unwrap().as_deref(), Some(&b"first"[..]));
        assert_eq!(
            c.queue_pop_wait(b"/q", LONG).unwrap().as_deref(),
            Some(&b"second"[..])
        );
        // A blocking pop woken by another client's push.
        let pusher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            client(addr).queue_push(b"/q", b"late").unwrap();
        });
        assert_eq!(
            c.queue_pop_wait(b"/q", LONG).unwrap().as_deref(),
            Some(&b"late"[..])
        );
        pusher.join().unwrap();
        assert_eq!(
            c.queue_pop_wait(b"/q", Duration::from_millis(50)).unwrap(),
            None
        );
    }
    if barrier {
        // BARRIER: a single client times out (the wait is canceled, the connection
        // stays usable), the second one releases both.
        assert!(!c.barrier(b"/bar", 3, Duration::from_millis(50)).unwrap());
        assert_eq!(
            c.get(b"/m1").unwrap(),
            b"one",
            "usable after a canceled barrier"
        );
        let other = std::thread::spawn(move || client(addr).barrier(b"/bar", 3, LONG).unwrap());
        assert!(c.barrier(b"/bar", 3, LONG).unwrap());
        assert!(other.join().unwrap());
    }
}

#[test]
fn client_speaks_torch_operations_to_ferry_server() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let mut c = client(server.local_addr());
    torch_ops_round(&mut c, server.local_addr(), true, true);
    assert!(!c.is_broken());
}

#[test]
fn server_drops_protocol_violations_and_keeps_serving() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let addr = server.local_addr();
    let closed = |mut s: TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 8];
        matches!(s.read(&mut b), Ok(0) | Err(_))
    };
    // No VALIDATE first.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&[3, 1, 0, 0, 0, 0, 0, 0, 0, b'k']).unwrap();
    assert!(closed(s));
    // Wrong magic.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&[0, 1, 2, 3, 4]).unwrap();
    assert!(closed(s));
    // Unknown opcode after a good handshake; then an oversized key.
    for tail in [vec![99u8], {
        let mut v = vec![3u8];
        v.extend_from_slice(&(1u64 << 40).to_le_bytes());
        v
    }] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&[0, 0xCE, 0xF7, 0x85, 0x3C]).unwrap();
        s.write_all(&tail).unwrap();
        assert!(closed(s));
    }
    let mut c = client(addr);
    c.set(b"/ok", b"1").unwrap();
    assert_eq!(c.get(b"/ok").unwrap(), b"1");
}

fn store_config(endpoint: SocketAddr, namespace: &str) -> ExchangeConfig {
    let mut ts = TcpStoreConfig::new(endpoint.to_string());
    ts.watch_interval = Duration::from_millis(50);
    ExchangeConfig {
        store: StoreConfig::TcpStore(ts),
        namespace: namespace.to_owned(),
        io_timeout: Duration::from_secs(2),
        fetch_timeout: Duration::from_secs(5),
        ..ExchangeConfig::default()
    }
}

#[test]
fn agents_discover_each_other_by_name() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let cfg = store_config(server.local_addr(), "test/discover/");
    let mut a = FakeAgent::new("prefill-0", cfg.clone());
    let mut b = FakeAgent::new("decode-0", cfg);
    assert_eq!(b.manager.store().map(|s| s.0), Some(Route::TcpStore));
    assert!(b.manager.workers_running());

    // B asks before A has published: the fetch waits, no false negative.
    b.manager
        .fetch_remote_md("prefill-0", Via::Store, None)
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    b.pump();
    assert!(b.fetch_failures.is_empty(), "{:?}", b.fetch_failures);
    let md_a = blob("prefill-0", 50_000);
    a.manager.set_local_md(md_a.clone());
    a.manager.send_local_md(Via::Store).unwrap();
    b.wait_md("prefill-0", FULL_LABEL, &md_a, LONG);

    // The key is where torch code would find it, without a double slash.
    let mut c = client(server.local_addr());
    assert_eq!(
        c.get(user_key("test/discover/prefill-0/metadata").as_bytes())
            .unwrap(),
        &*md_a
    );

    // Partial metadata under its label.
    let part = blob("prefill-0/layer-1", 64);
    a.manager
        .send_local_partial_md("layer-1", part.clone(), Via::Store)
        .unwrap();
    b.manager
        .fetch_remote_md("prefill-0", Via::Store, Some("layer-1"))
        .unwrap();
    b.wait_md("prefill-0", "layer-1", &part, LONG);

    // And the other way round.
    let md_b = blob("decode-0", 10);
    b.manager.set_local_md(md_b.clone());
    b.manager.send_local_md(Via::Store).unwrap();
    a.manager
        .fetch_remote_md("decode-0", Via::Store, None)
        .unwrap();
    a.wait_md("decode-0", FULL_LABEL, &md_b, LONG);

    // A withdraws: its keys are deleted and B, which fetched it, drops it.
    a.manager.invalidate_local_md(Via::Store).unwrap();
    b.wait_invalidated("prefill-0", LONG);
    assert!(!c
        .check(&[user_key("test/discover/prefill-0/metadata").as_bytes()])
        .unwrap());
    assert!(!c
        .check(&[user_key("test/discover/prefill-0/layer-1").as_bytes()])
        .unwrap());
    assert!(a.send_failures.is_empty() && b.send_failures.is_empty());
}

/// Fetch `agent` through `b` until one fetch was written by the caller's thread (the
/// fetch worker makes the direct connection after its first successful fetch).
fn fetch_until_direct(b: &mut FakeAgent, agent: &str, md: &[u8]) {
    let deadline = Instant::now() + LONG;
    while b.manager.direct_fetches() == 0 {
        assert!(Instant::now() < deadline, "no fetch went direct");
        b.peers.clear();
        b.manager.fetch_remote_md(agent, Via::Store, None).unwrap();
        b.wait_md(agent, FULL_LABEL, md, LONG);
    }
}

#[test]
fn direct_fetches_load_wait_for_missing_keys_and_watch() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let cfg = store_config(server.local_addr(), "test/direct");
    let a = FakeAgent::new("a", cfg.clone());
    let mut b = FakeAgent::new("b", cfg.clone());
    let md_a = blob("a", 70_000);
    a.manager.set_local_md(md_a.clone());
    a.manager.send_local_md(Via::Store).unwrap();
    fetch_until_direct(&mut b, "a", &md_a);

    // Published: one direct GET loads it.
    b.peers.clear();
    let direct = b.manager.direct_fetches();
    b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
    b.wait_md("a", FULL_LABEL, &md_a, LONG);
    assert_eq!(b.manager.direct_fetches(), direct + 1);

    // Not yet published: the direct GET finds nothing and the worker waits for it.
    b.manager.fetch_remote_md("late", Via::Store, None).unwrap();
    assert_eq!(b.manager.direct_fetches(), direct + 2);
    std::thread::sleep(Duration::from_millis(200));
    b.pump();
    assert!(b.fetch_failures.is_empty(), "{:?}", b.fetch_failures);
    let late = FakeAgent::new("late", cfg);
    let md_late = blob("late", 100);
    late.manager.set_local_md(md_late.clone());
    late.manager.send_local_md(Via::Store).unwrap();
    b.wait_md("late", FULL_LABEL, &md_late, LONG);

    // Peers loaded through the direct path are watched: a withdrawal reaches B.
    a.manager.invalidate_local_md(Via::Store).unwrap();
    b.wait_invalidated("a", LONG);
    late.manager.invalidate_local_md(Via::Store).unwrap();
    b.wait_invalidated("late", LONG);

    // The server goes away: a direct fetch is handed to the worker, which reports it.
    server.stop();
    b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
    let e = b.wait_fetch_failure("a", LONG);
    assert!(matches!(e, Error::Backend { .. }), "{e}");
}

#[test]
fn many_pending_fetches_do_not_wait_behind_each_other() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let mut cfg = store_config(server.local_addr(), "test/pending");
    cfg.fetch_timeout = Duration::from_secs(30);
    let mut b = FakeAgent::new("b", cfg.clone());
    for i in 0..5 {
        b.manager
            .fetch_remote_md(&format!("never-{i}"), Via::Store, None)
            .unwrap();
    }
    b.manager.fetch_remote_md("late", Via::Store, None).unwrap();
    let late = FakeAgent::new("late", cfg);
    let md = blob("late", 100);
    late.manager.set_local_md(md.clone());
    late.manager.send_local_md(Via::Store).unwrap();
    // Well within the 30 s timeout of the fetches queued before it.
    b.wait_md("late", FULL_LABEL, &md, Duration::from_secs(5));
}

#[test]
fn missing_agent_times_out_with_a_clear_error() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let mut cfg = store_config(server.local_addr(), "test/missing");
    cfg.fetch_timeout = Duration::from_millis(300);
    let mut b = FakeAgent::new("b", cfg);
    b.manager
        .fetch_remote_md("ghost", Via::Store, None)
        .unwrap();
    let e = b.wait_fetch_failure("ghost", LONG);
    match &e {
        Error::Backend { errno, detail, .. } => {
            assert_eq!(*errno, libc_etimedout());
            assert!(
                detail.contains("ghost") && detail.contains("not published within 300 ms"),
                "{e}"
            );
        }
        other => panic!("expected a timeout, got {other}"),
    }
}

fn libc_etimedout() -> i32 {
    110
}

#[test]
fn store_outage_gives_errors_then_recovers() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let endpoint = server.local_addr();
    let cfg = store_config(endpoint, "test/outage");
    let mut a = FakeAgent::new("a", cfg.clone());
    let mut b = FakeAgent::new("b", cfg);
    let md_a = blob("a", 1000);
    a.manager.set_local_md(md_a.clone());
    a.manager.send_local_md(Via::Store).unwrap();
    b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
    b.wait_md("a", FULL_LABEL, &md_a, LONG);

    server.stop();
    // Fetches and publishes fail promptly instead of hanging.
    let t = Instant::now();
    b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
    let e = b.wait_fetch_failure("a", LONG);
    assert!(
        e.to_string().contains("unreachable") || e.to_string().contains("closed"),
        "{e}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );
    a.manager.send_local_md(Via::Store).unwrap();
    assert!(a.pump_until(LONG, |a| !a.send_failures.is_empty()));

    // The store comes back, empty, on the same port: A publishes again by itself.
    let server = serve(endpoint, ServerConfig::default()).unwrap();
    let mut c = client(server.local_addr());
    let key = user_key("test/outage/a/metadata");
    assert!(
        c.wait(&[key.as_bytes()], LONG).unwrap(),
        "A did not publish again"
    );
    b.peers.clear();
    b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
    b.wait_md("a", FULL_LABEL, &md_a, LONG);
}

/// A store that restarts empty on the same port does not make watchers drop live
/// peers: the owner publishes again and the watcher waits out its grace period for a
/// key missing without a withdrawal mark. A real withdrawal still reaches it, and so
/// does the key of a dead owner that stays missing.
#[test]
fn a_store_restart_does_not_invalidate_live_peers() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let endpoint = server.local_addr();
    // The owner checks its keys every 300 ms; the watcher looks every 50 ms, so it
    // sees A's key missing well before A publishes it again (grace: 2 × 50 ms + 2 s).
    let mut a_cfg = store_config(endpoint, "test/restart");
    if let StoreConfig::TcpStore(ts) = &mut a_cfg.store {
        ts.watch_interval = Duration::from_millis(300);
    }
    let b_cfg = store_config(endpoint, "test/restart");
    let mut a = FakeAgent::new("a", a_cfg.clone());
    let mut b = FakeAgent::new("b", b_cfg.clone());
    let dead = FakeAgent::new("dead", a_cfg);
    let md_a = blob("a", 1000);
    a.manager.set_local_md(md_a.clone());
    a.manager.send_local_md(Via::Store).unwrap();
    dead.manager.set_local_md(blob("dead", 10));
    dead.manager.send_local_md(Via::Store).unwrap();
    b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
    b.wait_md("a", FULL_LABEL, &md_a, LONG);
    b.manager.fetch_remote_md("dead", Via::Store, None).unwrap();
    assert!(b.pump_until(LONG, |b| b.md("dead", FULL_LABEL).is_some()));
    // "dead" crashes: its keys stay until the store loses them.
    drop(dead);

    server.stop();
    let server = serve(endpoint, ServerConfig::default()).unwrap();
    let mut c = client(server.local_addr());
    let key = user_key("test/restart/a/metadata");
    assert!(
        c.wait(&[key.as_bytes()], LONG).unwrap(),
        "A did not publish again"
    );
    // The dead owner's key stays missing: B drops it after the grace period. By then
    // B has watched A's key (missing, then back) for as long: A must still be there.
    b.wait_invalidated("dead", LONG);
    b.pump();
    assert_eq!(b.md("a", FULL_LABEL), Some(&md_a[..]));
    assert_eq!(b.invalidated, ["dead"], "a live peer was dropped");

    // A withdraws: B drops it (the withdrawal mark says so, no grace needed).
    a.manager.invalidate_local_md(Via::Store).unwrap();
    b.wait_invalidated("a", LONG);
    assert!(c.check(&[user_key("test/restart/a/").as_bytes()]).unwrap());
    // Publishing again clears the mark.
    a.manager.send_local_md(Via::Store).unwrap();
    assert!(c.wait(&[key.as_bytes()], LONG).unwrap());
    a.pump_until(LONG, |_| {
        !c.check(&[user_key("test/restart/a/").as_bytes()]).unwrap()
    });
    assert!(!c.check(&[user_key("test/restart/a/").as_bytes()]).unwrap());
    assert!(a.send_failures.is_empty(), "{:?}", a.send_failures);
}

#[test]
fn embedded_store_serves_discovery() {
    let host = FakeAgent::new(
        "host",
        ExchangeConfig {
            embedded_store: Some("127.0.0.1:0".parse().unwrap()),
            ..ExchangeConfig::default()
        },
    );
    let addr = host
        .manager
        .embedded_store_addr()
        .expect("embedded store runs");
    assert_eq!(host.manager.store().map(|s| s.0), Some(Route::TcpStore));
    let md = blob("host", 500);
    host.manager.set_local_md(md.clone());
    host.manager.send_local_md(Via::Store).unwrap();
    let mut guest = FakeAgent::new(
        "guest",
        store_config(addr, ExchangeConfig::default().namespace.as_str()),
    );
    guest
        .manager
        .fetch_remote_md("host", Via::Store, None)
        .unwrap();
    guest.wait_md("host", FULL_LABEL, &md, LONG);
}

const TORCH_SCRIPT: &str = r#"
import sys, datetime, torch.distributed as dist
mode, port, libuv = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
t = datetime.timedelta(seconds=20)
if mode == "server":
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=t, use_libuv=libuv)
    print(s.port, flush=True)
    s.set("from-torch", b"hello ferry")
    print(s.get("from-ferry").decode(), flush=True)   # waits for our client
    sys.stdin.read()
else:
    s = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=t)
    s.set("torch-client", b"hi")
    print(s.get("from-ferry-server").decode(), flush=True)
    print(s.add("counter", 3), flush=True)
    print(s.check(["torch-client", "nope"]), flush=True)
    print(s.delete_key("torch-client"), flush=True)
    print(s.num_keys(), flush=True)
"#;

/// A python with torch, if `FERRY_TEST_TORCH_PYTHON` names one.
fn torch_python() -> Option<std::ffi::OsString> {
    let python = std::env::var_os("FERRY_TEST_TORCH_PYTHON");
    if python.is_none() && std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but FERRY_TEST_TORCH_PYTHON is not set (tools/test.sh sets it to its venv's python with torch)");
    }
    if python.is_none() {
        eprintln!(
            "skipping: FERRY_TEST_TORCH_PYTHON is not set (a python with torch runs this test)"
        );
    }
    python
}

/// A torch `TCPStore` master (libuv or legacy server) in a child process; killed on drop.
struct TorchServer {
    child: std::process::Child,
    out: std::io::BufReader<std::process::ChildStdout>,
    addr: SocketAddr,
}

impl TorchServer {
    fn start(python: &std::ffi::OsStr, libuv: bool) -> TorchServer {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let mut child = Command::new(python)
            .args([
                "-c",
                TORCH_SCRIPT,
                "server",
                "0",
                if libuv { "1" } else { "0" },
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the torch python");
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let port: u16 = line.trim().parse().expect("torch printed its port");
        TorchServer {
            child,
            out,
            addr: ([127, 0, 0, 1], port).into(),
        }
    }

    fn line(&mut self) -> String {
        use std::io::BufRead;
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }
}

impl Drop for TorchServer {
    fn drop(&mut self) {
        let _unused = self.child.kill();
        let _unused = self.child.wait();
    }
}

/// Ferry's client against torch's servers (libuv, the default since 2.4, and legacy),
/// and two managers discovering each other through them.
#[test]
fn interop_ferry_client_with_torch_servers() {
    let Some(python) = torch_python() else { return };
    for libuv in [true, false] {
        let mut torch = TorchServer::start(&python, libuv);
        let mut c = client(torch.addr);
        assert!(c.wait(&[user_key("from-torch").as_bytes()], LONG).unwrap());
        assert_eq!(
            c.get(user_key("from-torch").as_bytes()).unwrap(),
            b"hello ferry"
        );
        assert!(!c
            .wait(
                &[user_key("nothing").as_bytes()],
                Duration::from_millis(100)
            )
            .unwrap());
        assert!(c.check(&[user_key("from-torch").as_bytes()]).unwrap());
        assert_eq!(c.add(user_key("n").as_bytes(), 2).unwrap(), 2);
        c.set(user_key("from-ferry").as_bytes(), b"hello torch")
            .unwrap();
        assert_eq!(torch.line(), "hello torch", "libuv={libuv}");
        // torch's further operations (QUEUE_* need libuv; BARRIER needs torch 2.12, so
        // it is exercised against Ferry's server only).
        torch_ops_round(&mut c, torch.addr, libuv, false);

        // Discovery through torch's server, fetch before publish included.
        let cfg = store_config(torch.addr, "interop");
        let mut a = FakeAgent::new(&format!("ta-{libuv}"), cfg.clone());
        let mut b = FakeAgent::new(&format!("tb-{libuv}"), cfg);
        let name_a = a.manager.agent_name().to_owned();
        b.manager
            .fetch_remote_md(&name_a, Via::Store, None)
            .unwrap();
        std::thread::sleep(Duration::from_millis(150));
        let md = blob(&name_a, 100_000);
        a.manager.set_local_md(md.clone());
        a.manager.send_local_md(Via::Store).unwrap();
        b.wait_md(&name_a, FULL_LABEL, &md, LONG);
        a.manager.invalidate_local_md(Via::Store).unwrap();
        b.wait_invalidated(&name_a, LONG);
        a.pump();
        assert!(
            a.send_failures.is_empty() && b.send_failures.is_empty(),
            "libuv={libuv}"
        );
    }
}

/// torch's client against Ferry's server.
#[test]
fn interop_torch_client_with_ferry_server() {
    let Some(python) = torch_python() else { return };
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let mut c = client(server.local_addr());
    c.set(user_key("from-ferry-server").as_bytes(), b"served by ferry")
        .unwrap();
    let output = std::process::Command::new(&python)
        .args([
            "-c",
            TORCH_SCRIPT,
            "client",
            &server.local_addr().port().to_string(),
            "1",
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run the torch client");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "torch client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    // get, add, check (a missing key: False), delete_key (True), num_keys (from-ferry-server,
    // counter).
    assert_eq!(lines, ["served by ferry", "3", "False", "True", "2"]);
    assert!(!c.check(&[user_key("torch-client").as_bytes()]).unwrap());
    assert_eq!(c.get(user_key("counter").as_bytes()).unwrap(), b"3");
}

/// A WAIT that times out never returns before its timeout (the kernel's receive timeout
/// counts in scheduler ticks and can fire one early; the client reads on for what is
/// left). Whole numbers of ticks (10 ms at the usual 100, 250 and 1000 Hz), where the
/// kernel rounds nothing up, many times over.
#[test]
fn a_wait_never_returns_before_its_timeout() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let mut c = client(server.local_addr());
    for i in 0..20u64 {
        let timeout = Duration::from_millis(10);
        let t = Instant::now();
        assert!(!c.wait(&[b"/never"], timeout).unwrap());
        let took = t.elapsed();
        assert!(took >= timeout, "wait {i}: {took:?} < {timeout:?}");
    }
    assert!(c.set(b"/after", b"x").is_ok(), "usable after the waits");
}
