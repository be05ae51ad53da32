//! Fetch-to-loaded latency per backend, against a bare round trip of the same size.
//!
//! Run: `cargo bench -p ferry-exchange --bench fetch` (`--features tls` adds the
//! `p2p_tls` and `tcpstore_tls` rows: mutual TLS with the certificates of `tests/tls/`;
//! add `--features etcd` and set
//! `FERRY_TEST_ETCD=http://127.0.0.1:PORT` for the etcd rows; `etcdctl` on the PATH
//! adds the `etcdctl get` reference row). Prints medians and 90th percentiles.
//!
//! By default the paths take turns sample by sample, so load changes of a shared
//! machine hit them alike (and every sample starts from sleeping threads, as an
//! occasional fetch in a scheduler loop does). `FERRY_BENCH_SEQUENTIAL=1` runs each
//! path back to back instead (threads stay hot: the best case of each path).
//! `FERRY_BENCH_SPIN=1` makes the fetching caller poll without sleeping (a busy
//! scheduler loop) instead of blocking in `Manager::wait` between polls.
//!
//! One sample = `fetch_remote_md` on agent B, then polling B's manager (as the
//! agent's `check_remote_md` would, sleeping in `Manager::wait` in between) until the
//! metadata event arrives. Metadata blobs
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

/// The certificates of `tests/tls/` (mutual TLS).
#[cfg(feature = "tls")]
fn tls_config() -> ferry_exchange::TlsConfig {
    let f = |n: &str| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/tls")
            .join(n)
    };
    ferry_exchange::TlsConfig {
        client_cert: Some(f("client.pem")),
        client_key: Some(f("client-key.pem")),
        ..ferry_exchange::TlsConfig::new(f("ca.pem"), f("server.pem"), f("server-key.pem"))
    }
}

/// P2P and TCPStore over TLS: (A's P2P, B's P2P, A's address, A on the TLS store, B on
/// it, the server).
#[cfg(feature = "tls")]
fn tls_pair(
    md: &Arc<[u8]>,
) -> (
    Manager,
    Manager,
    Via,
    Manager,
    Manager,
    ferry_exchange::tcpstore::ServerHandle,
) {
    let mut cfg = ExchangeConfig::default();
    cfg.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
    cfg.p2p.tls = Some(tls_config());
    let a = Manager::new("bench-a", cfg.clone()).unwrap();
    a.set_local_md(md.clone());
    cfg.p2p.listen = None;
    let b = Manager::new("bench-b", cfg).unwrap();
    let to = Via::Peer(a.p2p_listen_addr().unwrap());
    let server = serve(
        "127.0.0.1:0".parse().unwrap(),
        ServerConfig {
            tls: Some(tls_config()),
            ..ServerConfig::default()
        },
    )
    .unwrap();
    let mut ts = TcpStoreConfig::new(server.local_addr().to_string());
    ts.tls = Some(tls_config());
    let cfg = ExchangeConfig {
        store: StoreConfig::TcpStore(ts),
        namespace: format!("bench-tls/{}", std::process::id()),
        ..ExchangeConfig::default()
    };
    let ts_a = Manager::new("bench-a", cfg.clone()).unwrap();
    ts_a.set_local_md(md.clone());
    ts_a.send_local_md(Via::Store).unwrap();
    let ts_b = Manager::new("bench-b", cfg).unwrap();
    (a, b, to, ts_a, ts_b, server)
}

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

/// A named way to take one sample.
type Path<'a> = (&'static str, Box<dyn FnMut() -> Duration + 'a>);

struct Stats {
    median: Duration,
    p90: Duration,
}

#[cfg(feature = "etcd")]
fn measure(iterations: usize, sample: impl FnMut() -> Duration) -> Stats {
    let mut paths: Vec<Path<'_>> = vec![("one", Box::new(sample))];
    interleaved(iterations, &mut paths).remove(0)
}

/// Whether the caller polls without sleeping (`FERRY_BENCH_SPIN=1`), as a busy scheduler
/// loop does, instead of blocking in `Manager::wait` between polls.
fn spin() -> bool {
    static SPIN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| std::env::var("FERRY_BENCH_SPIN").is_ok_and(|v| v == "1"))
}

/// One fetch through `b`, then poll (blocking in `Manager::wait` between polls, as a
/// caller with nothing else to do would) until loaded. The loaded blob must be
/// `expected`, from `agent` (compared after the clock stops).
fn fetch_once(b: &Manager, agent: &str, via: Via, expected: &[u8]) -> Duration {
    let t = Instant::now();
    b.fetch_remote_md(agent, via, None).expect("queued");
    let mut loaded = None;
    while loaded.is_none() {
        b.poll(|e| match e {
            Event::Load {
                agent: from, blob, ..
            } => loaded = Some((from, blob)),
            Event::FetchFailed { error, .. } => panic!("fetch failed: {error}"),
            _ => {}
        });
        if loaded.is_none() {
            if spin() {
                std::thread::yield_now();
            } else {
                b.wait(Duration::from_secs(10));
            }
        }
    }
    let elapsed = t.elapsed();
    let (from, blob) = loaded.expect("loop ends when loaded");
    assert_eq!(from, agent, "metadata of the wrong agent");
    assert!(
        blob == expected,
        "fetched metadata differs from the published"
    );
    elapsed
}

/// A loopback TCP server that answers each 32-byte request with `len_bytes` bytes;
/// returns one-sample closure (the server thread ends when the closure is dropped).
fn bare_round_trip(len_bytes: usize) -> impl FnMut() -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
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
    move || {
        let t = Instant::now();
        c.write_all(&[0u8; 32]).unwrap();
        c.read_exact(&mut buf).unwrap();
        t.elapsed()
    }
}

/// Run `paths` in interleaved rounds (one sample of each per round), so that a change
/// of machine load hits every path alike; returns each path's stats.
fn interleaved(rounds: usize, paths: &mut [Path<'_>]) -> Vec<Stats> {
    let mut samples: Vec<Vec<Duration>> = vec![Vec::with_capacity(rounds); paths.len()];
    let warm_up = rounds.div_ceil(10);
    if std::env::var("FERRY_BENCH_SEQUENTIAL").is_ok_and(|v| v == "1") {
        // Back to back: each path's threads stay hot between its samples.
        for (i, (_, sample)) in paths.iter_mut().enumerate() {
            for round in 0..rounds + warm_up {
                let d = sample();
                if round >= warm_up {
                    samples[i].push(d);
                }
            }
        }
    } else {
        for round in 0..rounds + warm_up {
            for (i, (_, sample)) in paths.iter_mut().enumerate() {
                let d = sample();
                if round >= warm_up {
                    samples[i].push(d);
                }
            }
        }
    }
    samples
        .into_iter()
        .map(|mut t| {
            t.sort();
            Stats {
                median: t[t.len() / 2],
                p90: t[t.len() * 9 / 10],
            }
        })
        .collect()
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
        let len = md.len();

        // P2P: B asks A's listener.
        let mut cfg = ExchangeConfig::default();
        cfg.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
        let p2p_a = Manager::new("bench-a", cfg).unwrap();
        p2p_a.set_local_md(md.clone());
        let p2p_b = Manager::new("bench-b", ExchangeConfig::default()).unwrap();
        let to = Via::Peer(p2p_a.p2p_listen_addr().unwrap());
        // P2P with a shared secret (authenticated hello and frames).
        let mut cfg = ExchangeConfig::default();
        cfg.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
        cfg.p2p.secret = Some(Arc::from(&b"bench secret"[..]));
        let auth_a = Manager::new("bench-a", cfg.clone()).unwrap();
        auth_a.set_local_md(md.clone());
        cfg.p2p.listen = None;
        let auth_b = Manager::new("bench-b", cfg).unwrap();
        let auth_to = Via::Peer(auth_a.p2p_listen_addr().unwrap());

        // TCPStore: Ferry's own server.
        let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
        let cfg = ExchangeConfig {
            store: StoreConfig::TcpStore(TcpStoreConfig::new(server.local_addr().to_string())),
            namespace: format!("bench/{}", std::process::id()),
            ..ExchangeConfig::default()
        };
        let ts_a = Manager::new("bench-a", cfg.clone()).unwrap();
        ts_a.set_local_md(md.clone());
        ts_a.send_local_md(Via::Store).unwrap();
        let ts_b = Manager::new("bench-b", cfg).unwrap();
        #[cfg(feature = "tls")]
        let tls = tls_pair(&md);

        let mut paths: Vec<Path<'_>> = vec![
            ("bare_tcp", Box::new(bare_round_trip(len))),
            ("p2p", Box::new(|| fetch_once(&p2p_b, "bench-a", to, &md))),
            (
                "p2p_secret",
                Box::new(|| fetch_once(&auth_b, "bench-a", auth_to, &md)),
            ),
            (
                "tcpstore",
                Box::new(|| fetch_once(&ts_b, "bench-a", Via::Store, &md)),
            ),
        ];
        #[cfg(feature = "tls")]
        {
            let (p2p_b, to, ts_b) = (&tls.1, tls.2, &tls.4);
            let (md_p, md_t) = (md.clone(), md.clone());
            paths.push((
                "p2p_tls",
                Box::new(move || fetch_once(p2p_b, "bench-a", to, &md_p)),
            ));
            paths.push((
                "tcpstore_tls",
                Box::new(move || fetch_once(ts_b, "bench-a", Via::Store, &md_t)),
            ));
        }
        let stats = interleaved(n, &mut paths);
        row("bare_tcp", regions, len, &stats[0], None);
        row("p2p", regions, len, &stats[1], Some(&stats[0]));
        row("p2p_secret", regions, len, &stats[2], Some(&stats[0]));
        row("tcpstore", regions, len, &stats[3], Some(&stats[0]));
        #[cfg(feature = "tls")]
        {
            row("p2p_tls", regions, len, &stats[4], Some(&stats[0]));
            row("tcpstore_tls", regions, len, &stats[5], Some(&stats[0]));
        }
        drop(paths);
        println!(
            "(fetches written by the caller's thread: p2p {}, p2p_secret {}, tcpstore {}, of {} each)",
            p2p_b.direct_fetches(),
            auth_b.direct_fetches(),
            ts_b.direct_fetches(),
            n + n.div_ceil(10)
        );
        drop((p2p_a, p2p_b, auth_a, auth_b, ts_a, ts_b, server));

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
    fetch_once(&b, "bench-a", Via::Store, md);
    let reference = etcdctl_get(
        endpoint,
        &format!("{namespace}/bench-a/metadata"),
        md.len(),
        n.min(30),
    );
    let s = measure(n, || fetch_once(&b, "bench-a", Via::Store, md));
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
