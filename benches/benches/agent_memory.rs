//! Memory per idle agent (issue 25: ≤ 1 MB for an agent that registered nothing and
//! moved nothing). Makes `FERRY_BENCH_AGENTS` (default 1,000) agents in this process,
//! default bounds, and prints the growth of the resident set per agent: agents with no
//! backend, then agents with a LOOPBACK backend, then (a tenth as many) with SHM,
//! POSIX and UCX each, where available. Then criterion times `Agent::new` +
//! drop (`scaling/agent_new`), which allocating less up front also makes cheaper.
//!
//! Run: `cargo bench -p ferry-benches --bench agent_memory`

use criterion::Criterion;
use ferry::{Agent, AgentConfig, Params};
use ferry_tests::unique;

/// The resident set of this process, in bytes (`VmRSS` of /proc/self/status).
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Resident bytes per agent of `count` agents made by `make` (all kept alive).
fn per_agent(count: usize, make: impl Fn(usize) -> Agent) -> Option<u64> {
    let before = rss_bytes()?;
    let agents: Vec<Agent> = (0..count).map(make).collect();
    let after = rss_bytes()?;
    drop(agents);
    Some(after.saturating_sub(before) / count as u64)
}

fn main() {
    let count = std::env::var("FERRY_BENCH_AGENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000usize);
    let bare = per_agent(count, |i| {
        Agent::new(AgentConfig::named(format!("idle-{i}"))).expect("agent")
    });
    let loopback = per_agent(count, |i| {
        let agent = Agent::new(AgentConfig::named(format!("idle-lb-{i}"))).expect("agent");
        agent
            .create_backend("LOOPBACK", &Params::new())
            .expect("loopback backend");
        agent
    });
    // The other backends an agent gets by default (`Agent::create_default_backends`),
    // one at a time, fewer agents (UCX makes a context and a worker per agent).
    let mut others = Vec::new();
    for name in ["SHM", "POSIX", "UCX"] {
        let available = Agent::available_backends()
            .iter()
            .any(|f| f.name == name && f.available.is_ok());
        if !available {
            continue;
        }
        let n = (count / 10).max(1);
        let per = per_agent(n, |i| {
            let agent = Agent::new(AgentConfig::named(format!("idle-{name}-{i}"))).expect("agent");
            agent.create_backend(name, &Params::new()).expect("backend");
            agent
        });
        others.push((name, n, per));
    }
    let show = |v: Option<u64>| {
        v.map_or("unknown (no /proc/self/status)".to_string(), |b| {
            format!("{b} B ({:.2} MB)", b as f64 / 1e6)
        })
    };
    println!(
        "IDLE AGENT RSS per agent, {count} agents, default bounds: no backend {}; LOOPBACK {}",
        show(bare),
        show(loopback)
    );
    for (name, n, per) in others {
        println!("IDLE AGENT RSS per agent, {n} agents: {name} {}", show(per));
    }

    let mut c = Criterion::default().configure_from_args();
    c.bench_function("scaling/agent_new", |b| {
        b.iter(|| {
            std::hint::black_box(Agent::new(AgentConfig::named(unique("idle"))).expect("agent"))
        })
    });
    c.final_summary();
}
