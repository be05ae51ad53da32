//! The `kv_transfer` loop under Tracy: the same prefill → decode READs over UCX with
//! notifications, both agents in this process, with Ferry's Tracy instrumentation on.
//!
//! ```sh
//! UCX_NET_DEVICES=lo cargo run -p ferry --features tracy-ondemand --example kv_transfer_tracy
//! KV_ROUNDS=100 UCX_NET_DEVICES=lo cargo run --release -p ferry --features tracy-ondemand \
//!     --example kv_transfer_tracy    # long enough to connect a viewer
//! ```
//!
//! With `tracy` the first agent starts Tracy's client, listening on 127.0.0.1:8086
//! only; `tracy-ondemand` collects only while a viewer (the Tracy profiler, or
//! `tracy-capture -a 127.0.0.1 -o kv.tracy`) is connected, so a run nobody watches
//! accumulates nothing. What a viewer sees: a span per executor phase of every flush
//! (resolve, prep, make, dispatch, progress, notifications), spans in the backends'
//! post and progress, a secondary frame `ferry::flush` per flush, plots `ferry
//! in-flight requests` and `ferry-ucx in-flight` — and from this example a frame
//! `decode tick` per loop turn, a plot `decode requests in flight`, and a span
//! `decode round` around each round.

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
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv_transfer_tracy: {e}");
            ExitCode::FAILURE
        }
    }
}

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

fn run() -> Result<(), String> {
    let rounds: u32 = match std::env::var("KV_ROUNDS") {
        Ok(v) => v
            .parse()
            .map_err(|_| format!("KV_ROUNDS={v:?} is not a number"))?,
        Err(_) => 1,
    };
    let mut prefill_pool = KvPool::new(SHAPE);
    prefill_pool.fill(PREFILL_SEED);
    let decode_pool = KvPool::new(SHAPE);
    let prefill = ucx_agent("prefill-0")?; // starts the Tracy client
    let decode = ucx_agent("decode-0")?;
    let client = tracy_client::Client::running().ok_or("the Tracy client is not running")?;
    println!("Tracy client running (127.0.0.1:8086; collects while a viewer is connected)");
    prefill_pool
        .register(&prefill)
        .map_err(|e| format!("register: {e}"))?;
    decode_pool
        .register(&decode)
        .map_err(|e| format!("register: {e}"))?;
    let peer = decode
        .load_remote_md(&prefill.local_md().map_err(|e| e.to_string())?)
        .map_err(|e| format!("prefill's metadata: {e}"))?;
    let tick = tracy_client::frame_name!("decode tick");
    let in_flight = tracy_client::plot_name!("decode requests in flight");
    for round in 0..rounds {
        let _span = tracy_client::span!("decode round");
        let stats = std::thread::scope(|s| {
            // Prefill serves on its own thread, as its engine would.
            let server = s.spawn(|| common::serve_until_notified(&prefill, WORK.requests));
            let stats = common::decode_loop(
                &decode,
                &decode_pool,
                peer,
                prefill_pool.desc().addr,
                WORK,
                &mut |active| {
                    client.secondary_frame_mark(tick);
                    client.plot(in_flight, active as f64);
                },
            );
            let served = server
                .join()
                .map_err(|_| "the prefill thread panicked".to_string());
            let stats = stats?;
            served??;
            Ok::<_, String>(stats)
        })?;
        if round == 0 || round + 1 == rounds {
            println!(
                "round {}/{rounds}: {}; every byte checked",
                round + 1,
                common::summary(&stats, &SHAPE)
            );
        }
    }
    Ok(())
}
