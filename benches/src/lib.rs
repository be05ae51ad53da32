//! Ferry benchmarks: criterion benches live in `benches/`; rerunnable scenario
//! benchmarks that a command-line tool can also drive live here as modules.
// Reason: benchmarks register their own buffers, the caller-side promise that
// `Agent::register` (an `unsafe fn`) asks for; no other unsafe code lives here.
#![allow(unsafe_code)]

pub mod shm;
pub mod ucx;
pub mod ucx_md;

/// Point UCX at loopback (`UCX_NET_DEVICES=lo` unless set; its unused-variable warning
/// off) for benches that run UCX agents in one process. `Err` carries why UCX cannot be
/// used here (`FERRY_UCX_LIBRARY` names the libucp).
pub fn ucx_loopback() -> Result<(), String> {
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    std::env::set_var("UCX_WARN_UNUSED_ENV_VARS", "n");
    match ferry::Agent::available_backends()
        .iter()
        .find(|f| f.name == "UCX")
        .map(|f| f.available.clone())
    {
        Some(available) => available,
        None => Err("no UCX backend in this build".into()),
    }
}

/// An agent with a unique name from `name` and a UCX backend with `params`, then any
/// of `FERRY_BENCH_UCX_PARAMS` (`key=value;key=value`, e.g.
/// `progress_thread_spin_us=0`), which replace them.
pub fn ucx_bench_agent(name: &str, params: &[(&str, &str)]) -> ferry::Agent {
    let agent =
        ferry::Agent::new(ferry::AgentConfig::named(ferry_tests::unique(name))).expect("agent");
    let mut all: ferry::Params = params
        .iter()
        .map(|&(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if let Ok(extra) = std::env::var("FERRY_BENCH_UCX_PARAMS") {
        all.extend(ucx::decode_params(&extra));
    }
    agent.create_backend("UCX", &all).expect("UCX backend");
    agent
}
