//! Liveness on TCPStore: an owner process publishing through Ferry's TCPStore server is
//! SIGKILLed; its watcher must invalidate it within the documented bound
//! (`TcpStoreConfig::liveness_bound`), must not invalidate it while it lives, and must
//! load the metadata of a restarted owner again (by itself, and on a new fetch).
//!
//! Its own `main` (harness = false): run with `FERRY_LIVENESS_OWNER=<endpoint>` it is
//! the owner (publishes, says `ready`, lives until killed).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{blob, FakeAgent};
use ferry_exchange::tcpstore::{serve, ServerConfig};
use ferry_exchange::{ExchangeConfig, StoreConfig, TcpStoreConfig, Via, FULL_LABEL};

const OWNER_VAR: &str = "FERRY_LIVENESS_OWNER";
const OWNER: &str = "owner-0";
// Short enough for a quick test, long enough that a loaded machine (a starved owner
// process) does not look dead: grace 2 × 200 ms + 1 s, bound 4 × 200 ms + 1 s.
const WATCH_INTERVAL: Duration = Duration::from_millis(200);
const IO_TIMEOUT: Duration = Duration::from_secs(1);

fn config(endpoint: &str) -> ExchangeConfig {
    let mut ts = TcpStoreConfig::new(endpoint);
    ts.watch_interval = WATCH_INTERVAL;
    ExchangeConfig {
        store: StoreConfig::TcpStore(ts),
        namespace: "liveness".into(),
        io_timeout: IO_TIMEOUT,
        fetch_timeout: Duration::from_secs(10),
        ..ExchangeConfig::default()
    }
}

/// The owner: publish metadata of `len` bytes, say `ready`, live until killed.
fn owner(endpoint: &str, len: usize) {
    let a = FakeAgent::new(OWNER, config(endpoint));
    a.manager.set_local_md(blob(OWNER, len));
    a.manager.send_local_md(Via::Store).expect("publish");
    println!("ready");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

struct Owner(Child);

impl Owner {
    fn start(endpoint: &str, len: usize) -> Owner {
        let mut child = Command::new(std::env::current_exe().expect("test executable"))
            .env(OWNER_VAR, endpoint)
            .env("FERRY_LIVENESS_LEN", len.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the owner process");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("owner output");
        assert_eq!(line.trim(), "ready", "owner did not start");
        Owner(child)
    }

    /// SIGKILL (std's `kill` sends it) and reap.
    fn kill(&mut self) {
        self.0.kill().expect("SIGKILL the owner");
        self.0.wait().expect("reap the owner");
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        let _unused = self.0.kill();
        let _unused = self.0.wait();
    }
}

fn sigkilled_owner_is_invalidated_and_picked_up_again() {
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap();
    let endpoint = server.local_addr().to_string();
    let cfg = config(&endpoint);
    let bound = match &cfg.store {
        StoreConfig::TcpStore(ts) => ts.liveness_bound(cfg.io_timeout),
        _ => unreachable!(),
    };
    let mut owner = Owner::start(&endpoint, 1000);
    let mut b = FakeAgent::new("watcher-0", cfg);
    b.manager.fetch_remote_md(OWNER, Via::Store, None).unwrap();
    b.wait_md(
        OWNER,
        FULL_LABEL,
        &blob(OWNER, 1000),
        Duration::from_secs(10),
    );

    // Alive: not invalidated over two bounds.
    let alive = b.pump_until(2 * bound, |b| !b.invalidated.is_empty());
    assert!(!alive, "a live owner was invalidated: {:?}", b.invalidated);

    // SIGKILL: its keys stay in the store, its heartbeat stops.
    owner.kill();
    let killed = Instant::now();
    // Scheduling slack on a loaded machine: one more second past the bound.
    let slack = Duration::from_secs(1);
    b.wait_invalidated(OWNER, bound + slack);
    let took = killed.elapsed();
    println!(
        "invalidated {} ms after SIGKILL (bound {} ms)",
        took.as_millis(),
        bound.as_millis()
    );
    assert!(took <= bound + slack, "{took:?} > bound {bound:?}");
    assert!(b.md(OWNER, FULL_LABEL).is_none());

    // Restarted with new metadata: loaded again without a new fetch.
    let _owner = Owner::start(&endpoint, 2000);
    b.wait_md(OWNER, FULL_LABEL, &blob(OWNER, 2000), bound + slack);
    // And a new fetch finds it too.
    b.peers.clear();
    b.manager.fetch_remote_md(OWNER, Via::Store, None).unwrap();
    b.wait_md(
        OWNER,
        FULL_LABEL,
        &blob(OWNER, 2000),
        Duration::from_secs(10),
    );
    assert!(b.fetch_failures.is_empty(), "{:?}", b.fetch_failures);
}

fn main() {
    if let Ok(endpoint) = std::env::var(OWNER_VAR) {
        let len = std::env::var("FERRY_LIVENESS_LEN")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000);
        owner(&endpoint, len);
        return;
    }
    // `cargo test` passes harness arguments (filters, --list); a listing asks for names.
    if std::env::args().any(|a| a == "--list") {
        println!("sigkilled_owner_is_invalidated_and_picked_up_again: test");
        return;
    }
    sigkilled_owner_is_invalidated_and_picked_up_again();
    println!("test sigkilled_owner_is_invalidated_and_picked_up_again ... ok");
}
