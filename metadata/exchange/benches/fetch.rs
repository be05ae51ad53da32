//! Fetch-to-loaded latency per backend, against a bare round trip of the same size.
//!
//! Run: `cargo bench -p ferry-exchange --bench fetch` (add `--features etcd` and set
//! `FERRY_TEST_ETCD=http://127.0.0.1:PORT` for the etcd rows; `etcdctl` on the PATH
//! adds the `etcdctl get` reference row). Prints medians and 90th percentiles.
//!
//! One sample = `fetch_remote_md` on agent B, then polling B's manager (as the
//! agent's `check_remote_md` would) until the metadata event arrives. Metadata blobs
//! are real codec blobs of 1 and 15,000 regions (32 bytes of public metadata each).
//! The bare round trip sends a small request on a kept-open loopback TCP connection
//! and reads a reply of the blob's size.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_exchange::tcpstore::{serve, ServerConfig};
use ferry_exchange::{Event, ExchangeConfig, Manager, P2pConfig, StoreConfig, TcpStoreConfig, Via};
use ferry_metadata::MdWriter;
use ferry_storage::{Desc, MemKind};

fn md_blob(agent: &str, regions: usize) -> Arc<[u8]> {
    let mut w = MdWriter::new(agent, 1);
    let b = w.backend("UCX", Some(&[7u8; 64]));
    for i in 0..regions as u64 {
        w.region(
            b,
            MemKind::Dram,
            Desc::new(0x1000_0000 + i * 0x10000, 0x8000, 0),
            &[i as u8; 32],
        );
    }
    Arc::from(w.finish().expect("valid metadata"))
}

struct Stats {
    median: Duration,
    p90: Duration,
}

fn measure(iterations: usize, mut sample: impl FnMut() -> Duration) -> Stats {
    for _ in 0..iterations.div_ceil(10) {
        sample();
    }
    let mut times: Vec<Duration> = (0..iterations).map(|_| sample()).collect();
    times.sort();
    Stats {
        median: times[times.len() / 2],
        p90: times[times.len() * 9 / 10],
    }
}

/// One fetch through `b`, polled until loaded.
fn fetch_once(b: &Manager, agent: &str, via: Via, len_bytes: usize) -> Duration {
    let t = Instant::now();
    b.fetch_remote_md(agent, via, None).expect("queued");
    let mut done = false;
    while !done {
        b.poll(|e| match e {
            Event::Load { blob, .. } => {
                assert_eq!(blob.len(), len_bytes);
                done = true;
            }
            Event::FetchFailed { error, .. } => panic!("fetch failed: {error}"),
            _ => {}
        });
        if !done {
            std::thread::yield_now();
        }
    }
    t.elapsed()
}

/// A loopback TCP server that answers each 32-byte request with `len_bytes` bytes.
fn bare_round_trip(len_bytes: usize, iterations: usize) -> Stats {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let reply = vec![1u8; len_bytes + 4];
        let mut req = [0u8; 32];
        while s.read_exact(&mut req).is_ok() {
            if s.write_all(&reply).is_err() {
                break;
            }
        }
    });
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let mut buf = vec![0u8; len_bytes + 4];
    let stats = measure(iterations, || {
        let t = Instant::now();
        c.write_all(&[0u8; 32]).unwrap();
        c.read_exact(&mut buf).unwrap();
        t.elapsed()
    });
    drop(c);
    server.join().unwrap();
    stats
}

fn row(name: &str, regions: usize, len_bytes: usize, s: &Stats, reference: Option<&Stats>) {
    let ratio = reference.map_or(String::from("-"), |r| {
        format!("{:.2}x", s.median.as_secs_f64() / r.median.as_secs_f64())
    });
    println!(
        "{name:<14} {regions:>6} {len_bytes:>10} {:>12.1} {:>12.1} {ratio:>8}",
        s.median.as_secs_f64() * 1e6,
        s.p90.as_secs_f64() * 1e6
    );
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this quickly.
    let quick = !std::env::args().any(|a| a == "--bench");
    let etcd = std::env::var("FERRY_TEST_ETCD")
        .ok()
        .filter(|e| !e.is_empty());
    println!(
        "{:<14} {:>6} {:>10} {:>12} {:>12} {:>8}",
        "path", "regions", "bytes", "median_us", "p90_us", "vs_ref"
    );
    for regions in [1usize, 15_000] {
        let md = md_blob("bench-a", regions);
        let n = match (quick, regions) {
            (true, _) => 5,
            (false, 1) => 2000,
            (false, _) => 200,
        };
        let bare = bare_round_trip(md.len(), n);
        row("bare_tcp", regions, md.len(), &bare, None);

        // P2P: B asks A's listener.
        let mut cfg = ExchangeConfig::default();
        cfg.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
        let a = Manager::new("bench-a", cfg).unwrap();
        a.set_local_md(md.clone());
        let b = Manager::new("bench-b", ExchangeConfig::default()).unwrap();
        let to = Via::Peer(a.p2p_listen_addr().unwrap());
        let s = measure(n, || fetch_once(&b, "bench-a", to, md.len()));
        row("p2p", regions, md.len(), &s, Some(&bare));
        drop((a, b));

        // TCPStore: Ferry's own server.
        let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
        let cfg = ExchangeConfig {
            store: StoreConfig::TcpStore(TcpStoreConfig::new(server.local_addr().to_string())),
            namespace: format!("bench/{}", std::process::id()),
            ..ExchangeConfig::default()
        };
        let a = Manager::new("bench-a", cfg.clone()).unwrap();
        a.set_local_md(md.clone());
        a.send_local_md(Via::Store).unwrap();
        let b = Manager::new("bench-b", cfg).unwrap();
        let s = measure(n, || fetch_once(&b, "bench-a", Via::Store, md.len()));
        row("tcpstore", regions, md.len(), &s, Some(&bare));
        drop((a, b, server));

        if let Some(endpoint) = &etcd {
            etcd_rows(endpoint, regions, &md, if quick { 5 } else { n.min(500) });
        }
    }
    if etcd.is_none() {
        println!("(etcd rows: build with --features etcd and set FERRY_TEST_ETCD)");
    }
}

#[cfg(feature = "etcd")]
fn etcd_rows(endpoint: &str, regions: usize, md: &Arc<[u8]>, n: usize) {
    use ferry_exchange::EtcdConfig;
    let namespace = format!("ferry-bench/{}", std::process::id());
    let cfg = ExchangeConfig {
        store: StoreConfig::Etcd(EtcdConfig::new(vec![endpoint.to_owned()])),
        namespace: namespace.clone(),
        ..ExchangeConfig::default()
    };
    let mut a = Manager::new("bench-a", cfg.clone()).unwrap();
    a.set_local_md(md.clone());
    a.send_local_md(Via::Store).unwrap();
    let b = Manager::new("bench-b", cfg).unwrap();
    // Wait until published.
    fetch_once(&b, "bench-a", Via::Store, md.len());
    let reference = etcdctl_get(
        endpoint,
        &format!("{namespace}/bench-a/metadata"),
        md.len(),
        n.min(30),
    );
    let s = measure(n, || fetch_once(&b, "bench-a", Via::Store, md.len()));
    match &reference {
        Some(r) => row("etcdctl_get", regions, md.len(), r, None),
        None => println!("(etcdctl not found: no etcdctl reference row)"),
    }
    row("etcd", regions, md.len(), &s, reference.as_ref());
    a.invalidate_local_md(Via::Store).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let _unused = &mut a;
}

#[cfg(not(feature = "etcd"))]
fn etcd_rows(_: &str, _: usize, _: &Arc<[u8]>, _: usize) {
    println!("(etcd rows: this bench was built without --features etcd)");
}

/// `etcdctl get` of the same key, the process start included (that is what a shell
/// user of etcd pays).
#[cfg(feature = "etcd")]
fn etcdctl_get(endpoint: &str, key: &str, len_bytes: usize, n: usize) -> Option<Stats> {
    use std::process::Command;
    let run = || {
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", endpoint, "get", key, "--print-value-only"])
            .output()
    };
    run().ok().filter(|o| o.status.success())?;
    Some(measure(n, || {
        let t = Instant::now();
        let out = run().expect("etcdctl runs");
        assert!(
            out.stdout.len() >= len_bytes,
            "etcdctl printed {} bytes",
            out.stdout.len()
        );
        t.elapsed()
    }))
}
