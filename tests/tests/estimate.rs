//! `Agent::estimate` (NIXL's `estimateXferCost`): before any completion there is nothing
//! to estimate from (no-telemetry); after requests of several sizes the measured model
//! answers for LOOPBACK and POSIX (and for UCX where the loaded UCX lacks
//! `ucp_ep_evaluate_perf`), larger requests are estimated longer, and UCX answers
//! through its own model where it has it (Debian's 1.13 does). Each case prints estimate vs measured (not asserted: timing).

use std::time::{Duration, Instant};

use ferry::{
    Agent, AgentConfig, CostMethod, Desc, Error, FileMode, MemKind, Op, Params, Side, XferId,
    XferStatus,
};
use ferry_tests::{pair, register, unique, Buffer, Rng};

const SIZES: [usize; 4] = [4 << 10, 64 << 10, 256 << 10, 1 << 20];

/// Post `x` and check until done, progressing `target` too (UCX in one process: the
/// target must progress for a put into its memory).
fn run(agent: &Agent, target: Option<&Agent>, x: XferId) -> Duration {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(60);
    let mut status = agent.post(x).expect("post");
    while status == XferStatus::InProgress {
        assert!(Instant::now() < deadline, "request did not finish");
        if let Some(target) = target {
            target.progress();
        }
        status = agent.check(x).expect("check");
    }
    start.elapsed()
}

/// Warm the model with every size a few times, then check and print its estimates.
fn check_model(what: &str, agent: &Agent, target: Option<&Agent>, make: impl Fn(usize) -> XferId) {
    let first = make(SIZES[0]);
    assert!(
        matches!(agent.estimate(first), Err(Error::NoTelemetry { .. })),
        "{what}: an estimate from nothing"
    );
    agent.release(first).unwrap();
    for _ in 0..8 {
        for &size in &SIZES {
            let x = make(size);
            run(agent, target, x);
            agent.release(x).unwrap();
        }
    }
    // All estimates first (each completion refines the model), then the runs.
    let xfers: Vec<XferId> = SIZES.iter().map(|&size| make(size)).collect();
    let estimates: Vec<_> = xfers
        .iter()
        .map(|&x| agent.estimate(x).expect("estimate"))
        .collect();
    let mut last = Duration::ZERO;
    for ((&size, &x), estimate) in SIZES.iter().zip(&xfers).zip(estimates) {
        let measured = run(agent, target, x);
        agent.release(x).unwrap();
        eprintln!(
            "{what}: {size:>8} B  estimate {:>10.1?} ± {:>9.1?} ({:?})  measured {measured:>10.1?}",
            estimate.duration, estimate.margin, estimate.method
        );
        // Every size was measured eight times: its own class answers (a median of what
        // was measured, so not asserted to grow with the size: two sizes that cost the
        // same syscall may swap places by noise).
        assert_eq!(estimate.method, CostMethod::Measured, "{what}: {size} B");
        assert!(
            estimate.duration > Duration::ZERO && estimate.duration < Duration::from_secs(60),
            "{what}: {size} B estimated {:?}",
            estimate.duration
        );
        last = last.max(estimate.duration);
    }
    assert!(
        last > Duration::ZERO,
        "{what}: a 1 MiB request costs something"
    );
}

#[test]
fn loopback_estimates_come_from_what_it_measured() {
    let mut rng = Rng::new(1);
    let src = Buffer::random(1 << 20, &mut rng);
    let dst = Buffer::zeroed(1 << 20);
    let p = pair(&src, &dst);
    check_model("LOOPBACK", &p.a, None, |size| {
        p.create(Op::Write, &[src.desc(0, size)], &[dst.desc(0, size)], None)
    });
    let x = p.create(Op::Write, &[src.whole()], &[dst.whole()], None);
    assert_eq!(p.a.estimate(x).unwrap().method, CostMethod::Measured);
    p.a.release(x).unwrap();
    assert!(matches!(p.a.estimate(x), Err(Error::NotFound { .. })));
}

#[test]
fn posix_estimates_come_from_what_it_measured() {
    let agent = Agent::new(AgentConfig::named(unique("est-posix"))).unwrap();
    let mut params = Params::new();
    params.insert("engine".into(), "threads".into());
    agent.create_backend("POSIX", &params).unwrap();
    let mut rng = Rng::new(2);
    let src = Buffer::random(1 << 20, &mut rng);
    register(&agent, &src);
    let dir = std::env::temp_dir().join(unique(&format!("ferry-est-{}", std::process::id())));
    std::fs::create_dir_all(&dir).unwrap();
    let mode = FileMode {
        write: true,
        create: true,
        ..FileMode::default()
    };
    agent
        .register_file(&dir.join("f"), mode, Desc::new(0, 0, 3))
        .unwrap();
    check_model("POSIX", &agent, None, |size| {
        agent
            .create(
                Op::Write,
                MemKind::Dram,
                &[src.desc(0, size)],
                Side::Local,
                MemKind::File,
                &[Desc::new(0, size as u64, 3)],
                None,
            )
            .unwrap()
    });
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ucx_estimates_through_its_model_or_what_it_measured() {
    std::env::set_var("UCX_NET_DEVICES", "lo");
    std::env::set_var("UCX_WARN_UNUSED_ENV_VARS", "n");
    let info = Agent::available_backends();
    if let Err(reason) = &info.iter().find(|f| f.name == "UCX").unwrap().available {
        return ferry_testkit::ci::skip("UCX", reason);
    }
    let mut rng = Rng::new(3);
    // Declared before the agents: they are dropped (deregistering) first.
    let src = Buffer::random(1 << 20, &mut rng);
    let dst = Buffer::zeroed(1 << 20);
    let a = Agent::new(AgentConfig::named(unique("est-ucx-a"))).unwrap();
    let b = Agent::new(AgentConfig::named(unique("est-ucx-b"))).unwrap();
    for agent in [&a, &b] {
        agent.create_backend("UCX", &Params::new()).unwrap();
    }
    register(&a, &src);
    register(&b, &dst);
    let peer = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let make = |size: usize| {
        a.create(
            Op::Write,
            MemKind::Dram,
            &[src.desc(0, size)],
            peer,
            MemKind::Dram,
            &[dst.desc(0, size)],
            None,
        )
        .unwrap()
    };
    let probe = make(4096);
    match a.estimate(probe) {
        // UCX's own model (`ucp_ep_evaluate_perf`), available before any completion.
        Ok(e) => {
            assert_eq!(e.method, CostMethod::Analytical);
            a.release(probe).unwrap();
            let mut last = Duration::ZERO;
            for &size in &SIZES {
                let x = make(size);
                let estimate = a.estimate(x).unwrap();
                assert_eq!(estimate.method, CostMethod::Analytical);
                let measured = run(&a, Some(&b), x);
                a.release(x).unwrap();
                eprintln!(
                    "UCX (its model): {size:>8} B  estimate {:>10.1?}  measured {measured:>10.1?}",
                    estimate.duration
                );
                assert!(estimate.duration > last, "larger requests take longer");
                last = estimate.duration;
            }
        }
        // A UCX without the function: the measured model after completions.
        Err(Error::NoTelemetry { .. }) => {
            a.release(probe).unwrap();
            check_model("UCX (measured)", &a, Some(&b), make);
        }
        Err(e) => panic!("UCX estimate: {e}"),
    }
    assert_eq!(dst.bytes(), src.bytes());
}
