//! `ferry bench kv`: the KV-cache loop on LOOPBACK (in-process) and on the default set
//! (a target process, reached through SHM), its JSON, and its argument checks.

use std::process::Command;

fn ferry(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .env(
            "UCX_NET_DEVICES",
            std::env::var("UCX_NET_DEVICES").unwrap_or("lo".into()),
        )
        .output()
        .expect("run ferry")
}

fn kv(backend: &str, extra: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("kv.json");
    let mut args = vec![
        "bench",
        "kv",
        "--backend",
        backend,
        "--layers",
        "4",
        "--block-size",
        "4K",
        "--blocks-per-request",
        "8",
        "--in-flight",
        "4",
        "--requests",
        "40",
        "--warmup",
        "4",
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend(extra);
    let o = ferry(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{args:?}\n{out}\n{err}");
    assert!(out.lines().any(|l| l.starts_with("KV ticks ")), "{out}");
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

fn check(v: &serde_json::Value, via: &str) {
    assert_eq!(v["requests"], 40, "{v}");
    assert_eq!(v["via"], via, "{v}");
    assert_eq!(v["config"]["descs_per_request"], 32, "{v}");
    for k in ["gbps", "descs_per_s", "tick_p50_us", "request_p50_us"] {
        assert!(v[k].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
    assert!(
        v["tick_p99_us"].as_f64() >= v["tick_p50_us"].as_f64(),
        "{v}"
    );
    assert!(
        v["request_p99_us"].as_f64() >= v["request_p50_us"].as_f64(),
        "{v}"
    );
    assert!(v["ticks"].as_u64().unwrap() >= 10, "{v}");
}

#[test]
fn kv_loop_in_process_paged_and_contiguous() {
    let v = kv("loopback", &[]);
    check(&v, "LOOPBACK");
    // Paged blocks are scattered on both sides: nothing merges.
    assert_eq!(v["ranges_per_request"], 32, "{v}");
    let v = kv("loopback", &["--layout", "contiguous", "--op", "write"]);
    check(&v, "LOOPBACK");
    // Contiguous runs: at most one range per layer (fewer where layers meet).
    assert!(v["ranges_per_request"].as_u64().unwrap() <= 4, "{v}");
}

#[test]
fn kv_loop_against_a_target_process_goes_through_shm() {
    let v = kv("default", &[]);
    check(&v, "SHM");
    assert!(
        v["config"]["peer"]
            .as_str()
            .unwrap()
            .contains("target process"),
        "{v}"
    );
}

#[test]
fn kv_arguments_are_checked_before_anything_runs() {
    for (args, says) in [
        (
            vec![
                "--in-flight",
                "8",
                "--blocks-per-request",
                "64",
                "--pool-blocks",
                "100",
            ],
            "cannot hold",
        ),
        (vec!["--backend", "posix"], "moves files"),
        (vec!["--layers", "0"], "--layers"),
    ] {
        let mut all = vec!["bench", "kv"];
        all.extend(&args);
        let o = ferry(&all);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(o.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn kv_loop_over_ucx_between_two_processes() {
    match ferry::Agent::available_backends()
        .into_iter()
        .find(|b| b.name == "UCX")
        .map(|b| b.available)
    {
        Some(Ok(())) => {}
        Some(Err(why)) => return ferry_testkit::ci::skip("UCX", why),
        None => return ferry_testkit::ci::skip("UCX", "no UCX backend in this build"),
    }
    for op in ["read", "write"] {
        let v = kv("ucx", &["--op", op]);
        check(&v, "UCX");
        assert_eq!(v["config"]["op"], op.to_uppercase(), "{v}");
    }
}
