//! Two agents find each other by name through Ferry's own TCPStore server, embedded in
//! one of them (no external service), then move KV blocks.
//!
//! ```sh
//! cargo run -p ferry --example discovery
//! ```
//!
//! The prefill process starts its agent's exchange with an embedded TCPStore server
//! on 127.0.0.1 (port chosen by the kernel), publishes its metadata under its name,
//! and puts one application key beside it: where its KV pool is. It starts the
//! decode process with nothing but the store's address, in `FERRY_TCPSTORE_ENDPOINT`
//! — the variable any agent's `ExchangeConfig::with_env_overrides` reads. Decode asks
//! the store for `prefill-0` (the fetch never blocks: the loop polls
//! `check_remote_md`), reads the pool address, and runs the decode loop of
//! `kv_transfer.rs`. Both agents have the default backends, so the same-host peer
//! is reached through SHM. The same code works with etcd: `FERRY_ETCD_ENDPOINTS`
//! instead, in a build with the `etcd` feature.

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use common::{KvPool, KvShape, Workload, PREFILL_SEED};
use ferry::exchange::tcpstore::{ClientOptions, TcpStoreClient};
use ferry::exchange::{ExchangeConfig, Via};
use ferry::{Agent, AgentConfig, Params};

const SHAPE: KvShape = KvShape {
    layers: 4,
    blocks: 64,
    block_bytes: 8 << 10,
};
const WORK: Workload = Workload {
    requests: 16,
    blocks_per_request: 16,
    in_flight: 2,
};
/// The application's own key in the store, beside the agents' metadata.
const POOL_KEY: &[u8] = b"example/prefill-0/kv-pool-addr";

fn main() -> ExitCode {
    let result = match std::env::args().nth(1).as_deref() {
        None | Some("prefill") => prefill(),
        Some("decode") => decode(),
        Some(other) => Err(format!("unknown role {other:?} (prefill or decode)")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("discovery: {e}");
            ExitCode::FAILURE
        }
    }
}

fn agent(name: &str) -> Result<Agent, String> {
    let agent = Agent::new(AgentConfig::named(name)).map_err(|e| e.to_string())?;
    agent
        .create_default_backends(|_| Params::new())
        .map_err(|e| format!("backends: {e}"))?;
    Ok(agent)
}

fn store_client(endpoint: &str) -> Result<TcpStoreClient, String> {
    TcpStoreClient::connect(endpoint, ClientOptions::default())
        .map_err(|e| format!("TCPStore {endpoint}: {e}"))
}

fn prefill() -> Result<(), String> {
    let mut pool = KvPool::new(SHAPE);
    pool.fill(PREFILL_SEED);
    let agent = agent("prefill-0")?;
    pool.register(&agent)
        .map_err(|e| format!("register: {e}"))?;
    agent
        .start_exchange(ExchangeConfig {
            embedded_store: Some(([127, 0, 0, 1], 0).into()),
            ..ExchangeConfig::default()
        })
        .map_err(|e| format!("exchange: {e}"))?;
    let endpoint = agent
        .exchange_store_addr()
        .ok_or("no embedded store address")?
        .to_string();
    agent
        .send_local_md(Via::Store)
        .map_err(|e| format!("publish: {e}"))?;
    store_client(&endpoint)?
        .set(POOL_KEY, &pool.desc().addr.to_le_bytes())
        .map_err(|e| format!("set {POOL_KEY:?}: {e}"))?;
    println!("prefill: TCPStore serving on {endpoint}; published prefill-0");
    let (child, stdin) =
        common::spawn_self("decode", &[], &[("FERRY_TCPSTORE_ENDPOINT", endpoint)])?;
    common::serve_until_notified(&agent, WORK.requests)?;
    println!("prefill: all {} req-N notifications arrived", WORK.requests);
    drop(stdin);
    common::wait_child(child, "decode")?;
    // Withdraw our metadata (a store outlives its agents in real deployments).
    let _ = agent.invalidate_local_md(Via::Store);
    Ok(())
}

fn decode() -> Result<(), String> {
    let _ = common::read_hello()?;
    let pool = KvPool::new(SHAPE);
    let agent = agent("decode-0")?;
    pool.register(&agent)
        .map_err(|e| format!("register: {e}"))?;
    let config = ExchangeConfig::default()
        .with_env_overrides()
        .map_err(|e| format!("exchange config from the environment: {e}"))?;
    agent
        .start_exchange(config)
        .map_err(|e| format!("exchange: {e}"))?;
    // Ask by name; the answer arrives while we do other work.
    agent
        .fetch_remote_md("prefill-0", Via::Store, None)
        .map_err(|e| format!("fetch: {e}"))?;
    let deadline = Instant::now() + common::TIMEOUT;
    while !agent
        .check_remote_md("prefill-0", None)
        .map_err(|e| format!("prefill-0: {e}"))?
    {
        if let Some((to, what, e)) = agent.drain_exchange_failures().into_iter().next() {
            return Err(format!("{what} to {to} failed: {e}"));
        }
        if Instant::now() > deadline {
            return Err("prefill-0 not found in the store".into());
        }
        std::thread::sleep(Duration::from_millis(5)); // a scheduler would work here
    }
    let peer = agent
        .peer("prefill-0")
        .ok_or("prefill-0 loaded but unknown")?;
    let endpoint = std::env::var("FERRY_TCPSTORE_ENDPOINT").map_err(|e| e.to_string())?;
    let addr = store_client(&endpoint)?
        .get(POOL_KEY)
        .map_err(|e| format!("get {POOL_KEY:?}: {e}"))?;
    let remote_base = u64::from_le_bytes(
        addr.as_slice()
            .try_into()
            .map_err(|_| format!("{POOL_KEY:?} holds {} bytes, not 8", addr.len()))?,
    );
    println!("decode: found prefill-0 through the TCPStore at {endpoint}");
    let stats = common::decode_loop(&agent, &pool, peer, remote_base, WORK, &mut |_| {})?;
    println!(
        "decode: {}; every byte checked",
        common::summary(&stats, &SHAPE)
    );
    common::linger_until_stdin_closes(&agent)
}
