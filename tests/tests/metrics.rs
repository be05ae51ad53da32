//! The agent's metrics: counters move with transfers, errors are counted by kind, the
//! exchange's fetches and loads are counted, and the Prometheus endpoint started by
//! `FERRY_METRICS_LISTEN` answers a scrape that parses and shows the same counters.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Once;
use std::time::{Duration, Instant};

use ferry::exchange::{tcpstore, ExchangeConfig, StoreConfig, TcpStoreConfig, Via};
use ferry::{Desc, Error, Op, XferStatus};
use ferry_tests::{loopback_agent, pair, register, Buffer, Rng};

/// Every test starts here, before it makes an agent: the first agent of the process
/// reads the variable.
fn env() {
    static ENV: Once = Once::new();
    ENV.call_once(|| std::env::set_var("FERRY_METRICS_LISTEN", "127.0.0.1:0"));
}

/// `GET path` on the endpoint: (status line, body).
fn get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(conn, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").expect("HTTP reply");
    if path == "/metrics" {
        assert!(head.contains("application/openmetrics-text"), "{head}");
        assert!(
            body.ends_with("# EOF\n"),
            "an OpenMetrics body ends with # EOF"
        );
    }
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// Parse the text format: every sample line is `name{labels} value`; returns
/// (name with labels, value). Panics on a line that does not parse.
fn samples(body: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for line in body.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample line");
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("value of: {line}"));
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "metric name: {line}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "labels: {line}");
        }
        out.push((series.to_string(), value));
    }
    out
}

fn value(samples: &[(String, f64)], series: &str) -> f64 {
    samples
        .iter()
        .find(|(s, _)| s == series)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no series {series}"))
}

#[test]
fn counters_move_with_transfers_and_errors_are_counted_by_kind() {
    env();
    let mut rng = Rng::new(3);
    let src = Buffer::random(64 << 10, &mut rng);
    let dst = Buffer::zeroed(64 << 10);
    let p = pair(&src, &dst);
    let before = p.a.metrics();
    assert_eq!(before.backend("LOOPBACK").unwrap().posted, 0);
    // 16 blocks of 4 KiB, contiguous on both sides: one merged range.
    let blocks: Vec<Desc> = (0..16).map(|i| src.desc(i * 4096, 4096)).collect();
    let remote: Vec<Desc> = (0..16).map(|i| dst.desc(i * 4096, 4096)).collect();
    for _ in 0..3 {
        let x = p.create(Op::Write, &blocks, &remote, None);
        assert_eq!(p.a.post(x).unwrap(), XferStatus::Done);
        p.a.release(x).unwrap();
    }
    let after = p.a.metrics();
    let b = after.backend("LOOPBACK").unwrap();
    assert_eq!(b.posted, 3);
    assert_eq!(b.completed, 3);
    assert_eq!(b.bytes, 3 * (64 << 10));
    assert_eq!(b.descriptors, 3, "merged to one range per request");
    assert_eq!(b.latency_count(), 3);
    assert!(b.latency_quantile(0.99).is_some());
    assert_eq!(after.peers, 1);
    assert!(after.flushes >= 6);

    // A repost of an active request and a post of a released one.
    let slow = ferry::loopback::faults(p.a.name()).expect("loopback faults");
    slow.complete_late(8);
    let x = p.create(Op::Write, &blocks, &remote, None);
    assert_eq!(p.a.post(x).unwrap(), XferStatus::InProgress);
    assert!(matches!(p.a.post(x), Err(Error::RepostActive { .. })));
    while p.a.check(x).unwrap() != XferStatus::Done {
        std::thread::sleep(Duration::from_millis(1));
    }
    p.a.release(x).unwrap();
    assert!(matches!(p.a.post(x), Err(Error::NotFound { .. })));
    // A failure reported by the backend.
    slow.complete_late(0);
    slow.fail_next(1);
    let y = p.create(Op::Write, &blocks, &remote, None);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut status = p.a.post(y);
    while status == Ok(XferStatus::InProgress) {
        assert!(Instant::now() < deadline, "the failing request never ended");
        status = p.a.check(y);
    }
    assert!(matches!(status, Err(Error::Backend { .. })), "{status:?}");
    let s = p.a.metrics();
    assert_eq!(s.errors_of("REPOST_ACTIVE"), 1);
    assert_eq!(s.errors_of("NOT_FOUND"), 1);
    assert!(s.backend("LOOPBACK").unwrap().failed >= 1, "{s:?}");
    assert_eq!(
        s.errors.iter().map(|(_, n)| n).sum::<u64>(),
        2 + s.backend("LOOPBACK").unwrap().failed + s.backend("LOOPBACK").unwrap().refused
    );
    assert_eq!(p.a.metrics_handle().in_flight(), 0);
}

#[test]
fn exchange_fetches_and_loads_are_counted() {
    env();
    let server = tcpstore::serve("127.0.0.1:0".parse().unwrap(), Default::default()).unwrap();
    let mut ts = TcpStoreConfig::new(server.local_addr().to_string());
    ts.watch_interval = Duration::from_millis(50);
    let cfg = ExchangeConfig {
        store: StoreConfig::TcpStore(ts),
        namespace: ferry_tests::unique("metrics-ns"),
        fetch_timeout: Duration::from_millis(300),
        ..ExchangeConfig::default()
    };
    let buf = Buffer::zeroed(4096);
    let a = loopback_agent("ma");
    let b = loopback_agent("mb");
    register(&a, &buf);
    a.start_exchange(cfg.clone()).unwrap();
    b.start_exchange(cfg).unwrap();
    a.send_local_md(Via::Store).unwrap();
    b.fetch_remote_md(a.name(), Via::Store, None).unwrap();
    b.fetch_remote_md("nobody-here", Via::Store, None).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        b.poll_exchange().unwrap();
        let s = b.metrics();
        if s.loads == 1 && s.fetch_failures == 1 {
            assert_eq!(s.fetches, 2);
            break;
        }
        assert!(Instant::now() < deadline, "{s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(b.metrics().load_failures, 0);
}

#[test]
fn a_scrape_parses_and_its_counters_move_after_a_transfer() {
    env();
    let mut rng = Rng::new(4);
    let src = Buffer::random(8192, &mut rng);
    let dst = Buffer::zeroed(8192);
    let p = pair(&src, &dst);
    let addr = ferry::prometheus::env_server_addr().expect("FERRY_METRICS_LISTEN started it");
    assert!(addr.ip().is_loopback());
    let series = |name: &str| format!("{name}{{agent=\"{}\",backend=\"LOOPBACK\"}}", p.a.name());
    let (status, body) = get(addr, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK");
    let first = samples(&body);
    assert_eq!(value(&first, &series("ferry_requests_posted_total")), 0.0);
    assert!(
        body.contains("# TYPE ferry_request_latency_seconds histogram"),
        "{body}"
    );

    let x = p.create(Op::Write, &[src.whole()], &[dst.whole()], None);
    assert_eq!(p.a.post(x).unwrap(), XferStatus::Done);
    let (_, body) = get(addr, "/metrics");
    if std::env::var_os("FERRY_PRINT_SCRAPE").is_some() {
        eprintln!("{body}");
    }
    let second = samples(&body);
    assert_eq!(value(&second, &series("ferry_requests_posted_total")), 1.0);
    assert_eq!(value(&second, &series("ferry_bytes_posted_total")), 8192.0);
    assert_eq!(
        value(&second, &series("ferry_requests_completed_total")),
        1.0
    );
    assert_eq!(
        value(&second, &series("ferry_request_latency_seconds_count")),
        1.0
    );
    let inf = format!(
        "ferry_request_latency_seconds_bucket{{le=\"+Inf\",agent=\"{}\",backend=\"LOOPBACK\"}}",
        p.a.name()
    );
    assert_eq!(value(&second, &inf), 1.0);
    let peers = format!("ferry_peers{{agent=\"{}\"}}", p.a.name());
    assert_eq!(value(&second, &peers), 1.0);

    // Anything but GET /metrics is refused.
    assert_eq!(get(addr, "/other").0, "HTTP/1.1 404 Not Found");
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.write_all(b"POST /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 405"), "{reply}");
}
