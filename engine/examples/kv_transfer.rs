//! Prefill → decode KV-cache transfer between two processes over UCX: the scheduler
//! loop of the README, with notifications.
//!
//! ```sh
//! UCX_NET_DEVICES=lo cargo run -p ferry --example kv_transfer
//! ```
//!
//! The process started by cargo is the prefill engine: it owns a KV pool (8 layers ×
//! 64 blocks of 16 KiB), fills it ("computed" KV), and starts itself again as the
//! decode engine, handing it its metadata blob and pool address on stdin (a side
//! channel; `discovery.rs` uses a store instead). Decode READs 32 requests of 8 blocks
//! per layer — 64 scattered descriptors each — out of prefill's pool, at most 4 in
//! flight, from one command buffer flushed once per loop turn; each READ carries a
//! notification `req-N` that reaches prefill once the blocks have landed, which is
//! when prefill may reuse them. Decode checks every block's bytes.
//!
//! Needs UCX (`libucp.so.0`, Debian's `libucx0`); without it the example says so and
//! fails.

mod common;

use std::process::ExitCode;

use common::{KvPool, KvShape, Workload, PREFILL_SEED};
use ferry::{Agent, AgentConfig, Params};

const SHAPE: KvShape = KvShape {
    layers: 8,
    blocks: 64,
    block_bytes: 16 << 10,
};
const WORK: Workload = Workload {
    requests: 32,
    blocks_per_request: 8,
    in_flight: 4,
};

fn main() -> ExitCode {
    let result = match std::env::args().nth(1).as_deref() {
        None | Some("prefill") => prefill(),
        Some("decode") => decode(),
        Some(other) => Err(format!("unknown role {other:?} (prefill or decode)")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv_transfer: {e}");
            ExitCode::FAILURE
        }
    }
}

/// An agent with the UCX backend alone (so the two processes talk over UCX, not SHM).
fn ucx_agent(name: &str) -> Result<Agent, String> {
    if let Some(Err(why)) = Agent::available_backends()
        .into_iter()
        .find(|b| b.name == "UCX")
        .map(|b| b.available)
    {
        return Err(format!("this example needs UCX: {why}"));
    }
    let agent = Agent::new(AgentConfig::named(name)).map_err(|e| e.to_string())?;
    agent
        .create_backend("UCX", &Params::new())
        .map_err(|e| format!("creating UCX: {e}"))?;
    Ok(agent)
}

fn prefill() -> Result<(), String> {
    // The pool before the agent: the agent (and its registration) is dropped first.
    let mut pool = KvPool::new(SHAPE);
    pool.fill(PREFILL_SEED);
    let agent = ucx_agent("prefill-0")?;
    pool.register(&agent)
        .map_err(|e| format!("register: {e}"))?;
    // What decode needs to reach us: our metadata, and where the pool is.
    let mut hello = pool.desc().addr.to_le_bytes().to_vec();
    hello.extend(agent.local_md().map_err(|e| e.to_string())?);
    let (child, stdin) = common::spawn_self("decode", &hello, &[])?;
    // Serve: progress and drain notifications until every request has landed.
    common::serve_until_notified(&agent, WORK.requests)?;
    println!(
        "prefill: all {} req-N notifications arrived; their blocks may be reused",
        WORK.requests
    );
    drop(stdin); // tells decode it may go
    common::wait_child(child, "decode")
}

fn decode() -> Result<(), String> {
    let hello = common::read_hello()?;
    let (addr, blob) = hello.split_at(8);
    let remote_base = u64::from_le_bytes(addr.try_into().expect("8 bytes"));
    let pool = KvPool::new(SHAPE);
    let agent = ucx_agent("decode-0")?;
    pool.register(&agent)
        .map_err(|e| format!("register: {e}"))?;
    let peer = agent
        .load_remote_md(blob)
        .map_err(|e| format!("prefill's metadata: {e}"))?;
    let stats = common::decode_loop(&agent, &pool, peer, remote_base, WORK, &mut |_| {})?;
    println!(
        "decode: {}; every byte checked",
        common::summary(&stats, &SHAPE)
    );
    // Keep progressing (the last notifications go out) until prefill says goodbye.
    common::linger_until_stdin_closes(&agent)
}
