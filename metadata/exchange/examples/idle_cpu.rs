//! CPU used by an idle exchange: two managers with P2P listeners and a TCPStore (Ferry's
//! own server) fetch each other's metadata both ways, so every thread exists (listener
//! and connection threads, P2P readers, the TCPStore workers and direct reader), then
//! sit idle. Prints the CPU time all threads of this process used while idle.
//!
//! Run: `cargo run --release -p ferry-exchange --example idle_cpu [SECONDS]` (default 10).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_exchange::tcpstore::{serve, ServerConfig};
use ferry_exchange::{Event, ExchangeConfig, Manager, P2pConfig, StoreConfig, TcpStoreConfig, Via};

/// CPU time of every thread of this process so far (from /proc, in nanoseconds), and
/// the thread count.
fn cpu_ns() -> (u64, usize) {
    let mut total = 0;
    let mut threads = 0;
    for task in std::fs::read_dir("/proc/self/task").expect("/proc is mounted") {
        let path = task.expect("task entry").path().join("schedstat");
        if let Ok(s) = std::fs::read_to_string(path) {
            total += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            threads += 1;
        }
    }
    (total, threads)
}

fn fetch(m: &Manager, agent: &str, via: Via) {
    m.fetch_remote_md(agent, via, None).expect("queued");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut done = false;
    while !done {
        assert!(Instant::now() < deadline, "fetch of {agent} timed out");
        m.wait(Duration::from_millis(100));
        m.poll(|e| match e {
            Event::Load { .. } => done = true,
            Event::FetchFailed { error, .. } => panic!("fetch of {agent} failed: {error}"),
            _ => {}
        });
    }
}

fn main() {
    let seconds: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let config = || {
        let mut c = ExchangeConfig {
            store: StoreConfig::TcpStore(TcpStoreConfig::new(server.local_addr().to_string())),
            namespace: format!("idle/{}", std::process::id()),
            ..ExchangeConfig::default()
        };
        c.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
        c
    };
    let a = Manager::new("idle-a", config()).unwrap();
    let b = Manager::new("idle-b", config()).unwrap();
    for (m, name) in [(&a, "idle-a"), (&b, "idle-b")] {
        m.set_local_md(Arc::from(format!("metadata of {name}").into_bytes()));
        m.send_local_md(Via::Store).unwrap();
    }
    // Twice each way and route: the second fetches go over the direct paths.
    for _ in 0..2 {
        fetch(&b, "idle-a", Via::Peer(a.p2p_listen_addr().unwrap()));
        fetch(&a, "idle-b", Via::Peer(b.p2p_listen_addr().unwrap()));
        fetch(&b, "idle-a", Via::Store);
        fetch(&a, "idle-b", Via::Store);
    }
    println!(
        "direct fetches: a {}, b {}",
        a.direct_fetches(),
        b.direct_fetches()
    );
    let (before, threads) = cpu_ns();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(seconds));
    let (after, _) = cpu_ns();
    let wall = t.elapsed();
    let used = Duration::from_nanos(after - before);
    println!(
        "idle for {wall:.1?} with {threads} threads: {used:?} of CPU ({:.4}% of one core)",
        100.0 * used.as_secs_f64() / wall.as_secs_f64()
    );
}
