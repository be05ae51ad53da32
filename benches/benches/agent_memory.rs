//! Memory per idle agent (issue 25: ≤ 1 MB for an agent that registered nothing and
//! moved nothing). Makes `FERRY_BENCH_AGENTS` (default 1,000) agents in this process,
//! default bounds, and prints the growth of the resident set per agent, each case in a
//! process of its own: agents with no backend, then agents with a LOOPBACK backend,
//! then (a tenth as many) with SHM, POSIX and UCX each, where available, with the
//! default backends, and UCX agents that made their metadata once (UCX's workers exist
//! from then on). Then criterion
//! times `Agent::new` + drop (`scaling/agent_new`), which allocating less up front also
//! makes cheaper.
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

/// What one measuring process makes: `(label, agents, how)`.
type Case = (&'static str, usize, Box<dyn Fn(usize) -> Agent>);

/// The cases: agents with no backend and with LOOPBACK (`count` each), then (a tenth as
/// many) with SHM, POSIX and UCX each, where available, and UCX agents that made their
/// metadata once (which creates UCX's workers).
fn cases(count: usize) -> Vec<Case> {
    let with = |name: &'static str, publish: bool| {
        move |i: usize| {
            let agent = Agent::new(AgentConfig::named(format!("idle-{name}-{i}"))).expect("agent");
            agent.create_backend(name, &Params::new()).expect("backend");
            if publish {
                agent.local_md().expect("metadata");
            }
            agent
        }
    };
    let mut cases: Vec<Case> = vec![
        (
            "no backend",
            count,
            Box::new(|i| Agent::new(AgentConfig::named(format!("idle-{i}"))).expect("agent")),
        ),
        ("LOOPBACK", count, Box::new(with("LOOPBACK", false))),
    ];
    let fewer = (count / 10).max(1);
    for name in ["SHM", "POSIX", "UCX"] {
        let available = Agent::available_backends()
            .iter()
            .any(|f| f.name == name && f.available.is_ok());
        if available {
            cases.push((name, fewer, Box::new(with(name, false))));
        }
    }
    cases.push((
        "default backends (create_default_backends)",
        fewer,
        Box::new(|i| {
            let agent = Agent::new(AgentConfig::named(format!("idle-default-{i}"))).expect("agent");
            agent
                .create_default_backends(|_| Params::new())
                .expect("default backends");
            agent
        }),
    ));
    if cases.iter().any(|c| c.0 == "UCX") {
        cases.push((
            "UCX, metadata made (workers created)",
            fewer,
            Box::new(with("UCX", true)),
        ));
    }
    cases
}

/// Set in the child process that measures one case (by its position in [`cases`]).
const CASE_ENV: &str = "FERRY_BENCH_AGENT_CASE";

fn main() {
    let count = std::env::var("FERRY_BENCH_AGENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000usize);
    // Each case runs in a process of its own: memory freed by an earlier case stays in
    // the allocator and would hide the next one's growth.
    if let Some(case) = std::env::var(CASE_ENV)
        .ok()
        .and_then(|c| c.parse::<usize>().ok())
    {
        let (name, n, make) = cases(count).swap_remove(case);
        let shown = per_agent(n, make).map_or("unknown (no /proc/self/status)".to_string(), |b| {
            format!("{b} B ({:.2} MB)", b as f64 / 1e6)
        });
        println!("IDLE AGENT RSS per agent, {n} agents, default bounds: {name} {shown}");
        return;
    }
    let exe = std::env::current_exe().expect("this bench's path");
    for case in 0..cases(count).len() {
        let status = std::process::Command::new(&exe)
            .env(CASE_ENV, case.to_string())
            .status()
            .expect("measuring process");
        assert!(status.success(), "case {case} failed: {status}");
    }

    let mut c = Criterion::default().configure_from_args();
    c.bench_function("scaling/agent_new", |b| {
        b.iter(|| {
            std::hint::black_box(Agent::new(AgentConfig::named(unique("idle"))).expect("agent"))
        })
    });
    c.final_summary();
}
