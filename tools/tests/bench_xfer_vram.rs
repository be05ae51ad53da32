//! `ferry bench xfer` (and `ferry demo --vram`) with GPU memory: the flags are checked before anything runs; a
//! build without the `cuda` feature refuses VRAM naming the feature; a build with it
//! gives the CUDA driver's typed reason on a machine without one (or without the
//! device asked for). With `FERRY_TEST_GPU=1` (and `FERRY_UCX_LIBRARY` naming a
//! CUDA-capable libucp) a short VRAM → VRAM sweep between two processes runs and checks
//! every byte.

use std::process::{Command, Output};

fn ferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("FERRY_TCPSTORE_ENDPOINT")
        .env(
            "UCX_NET_DEVICES",
            std::env::var("UCX_NET_DEVICES").unwrap_or("lo".into()),
        )
        .output()
        .expect("run ferry")
}

/// `args` parse but the work fails: status 1, `ferry: error:` and `says`; the message.
#[track_caller]
fn fails(args: &[&str], says: &str) -> String {
    let o = ferry(args);
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{args:?}: {out}{err}");
    assert!(
        err.contains("ferry: error:") && err.contains(says),
        "{args:?}: expected '{says}' in: {err}"
    );
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    err
}

const XFER: [&str; 2] = ["bench", "xfer"];

fn xfer(extra: &[&str]) -> Vec<String> {
    XFER.iter().chain(extra).map(|s| s.to_string()).collect()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn gpu_flags_are_checked_before_anything_runs() {
    fails(
        &refs(&xfer(&["--dev", "1"])),
        "--dev 1 names the CUDA device of VRAM buffers",
    );
    fails(
        &refs(&xfer(&[
            "--backend",
            "loopback",
            "--ucx-library",
            "/nowhere/libucp.so.0",
        ])),
        "--ucx-library needs --backend ucx or default",
    );
    fails(
        &refs(&xfer(&[
            "--backend",
            "ucx",
            "--ucx-library",
            "/a/libucp.so.0",
            "--param",
            "ucx_library=/b/libucp.so.0",
        ])),
        "the UCX library is given twice",
    );
    // An initiator with host memory whose target (elsewhere) has VRAM does nothing
    // CUDA itself: no feature or driver asked for; here it fails finding the target.
    let err = fails(
        &refs(&xfer(&[
            "--backend",
            "ucx",
            "--role",
            "initiator",
            "--tcpstore",
            "127.0.0.1:1",
            "--target-mem",
            "vram",
            "--connect-timeout",
            "1",
        ])),
        "",
    );
    assert!(!err.to_lowercase().contains("cuda"), "{err}");
    assert!(
        err.contains("127.0.0.1:1") || err.contains("UCX is unavailable"),
        "{err}"
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn vram_is_refused_naming_the_cuda_feature() {
    for args in [
        xfer(&["--initiator-mem", "vram"]),
        xfer(&["--target-mem", "vram"]),
        xfer(&[
            "--backend",
            "ucx",
            "--initiator-mem",
            "vram",
            "--target-mem",
            "vram",
            "--dev",
            "0",
        ]),
    ] {
        fails(
            &refs(&args),
            "VRAM in bench xfer needs the `cuda` feature: this ferry was built without it",
        );
    }
}

#[cfg(feature = "cuda")]
#[test]
fn vram_needs_ucx_and_a_cuda_driver_and_device() {
    fails(
        &refs(&xfer(&["--backend", "loopback", "--target-mem", "vram"])),
        "VRAM moves over UCX (or GDS, to files): use --backend ucx, default or gds (LOOPBACK",
    );
    fails(
        &refs(&xfer(&["--backend", "posix", "--initiator-mem", "vram"])),
        "VRAM moves over UCX (or GDS, to files)",
    );
    // Device 1023 exists nowhere: the driver's typed reason on a machine without one,
    // the device count on a machine with one; no GPU work either way, and nothing
    // (no target process) starts.
    let err = fails(
        &refs(&xfer(&[
            "--backend",
            "ucx",
            "--initiator-mem",
            "vram",
            "--target-mem",
            "vram",
            "--dev",
            "1023",
        ])),
        "",
    );
    let no_driver = err.contains("VRAM needs a CUDA driver: libcuda.so.1 not found");
    let no_device = err.contains("no CUDA device 1023: the driver reports");
    assert!(no_driver || no_device, "{err}");
    if no_driver {
        assert!(
            std::env::var("FERRY_TEST_GPU").map_or(true, |v| v != "1"),
            "FERRY_TEST_GPU=1 but {err}"
        );
        // Either side alone, on the default device, says the same.
        for side in ["--initiator-mem", "--target-mem"] {
            fails(
                &refs(&xfer(&["--backend", "ucx", side, "vram"])),
                "VRAM needs a CUDA driver: libcuda.so.1 not found",
            );
        }
    }
}

/// `ferry demo --vram` in the same build: the same typed reasons.
#[cfg(feature = "cuda")]
#[test]
fn the_vram_demo_gives_the_same_reasons() {
    let err = fails(&["demo", "--vram", "--dev", "1023", "--mib", "1"], "");
    assert!(
        err.contains("VRAM needs a CUDA driver: libcuda.so.1 not found")
            || err.contains("no CUDA device 1023: the driver reports"),
        "{err}"
    );
}

#[cfg(feature = "cuda")]
#[test]
fn vram_sweep_between_two_processes_checks_every_byte() {
    if std::env::var("FERRY_TEST_GPU").map_or(true, |v| v != "1") {
        eprintln!("skipping: GPU tests run with FERRY_TEST_GPU=1 (none requested here)");
        return;
    }
    let library = std::env::var("FERRY_UCX_LIBRARY")
        .expect("FERRY_TEST_GPU=1: set FERRY_UCX_LIBRARY to a CUDA-capable libucp (libucx-cu13)");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("vram.json");
    for (initiator, target) in [("vram", "vram"), ("vram", "dram"), ("dram", "vram")] {
        let args = xfer(&[
            "--backend",
            "ucx",
            "--initiator-mem",
            initiator,
            "--target-mem",
            target,
            "--ucx-library",
            &library,
            "--start-block",
            "64K",
            "--max-block",
            "1M",
            "--block-factor",
            "16",
            "--max-batch",
            "32",
            "--batch-factor",
            "32",
            "--op",
            "read,write",
            "--iters",
            "5",
            "--warmup",
            "2",
            "--check",
            "--json",
            json.to_str().unwrap(),
        ]);
        let o = ferry(&refs(&args));
        let out = String::from_utf8_lossy(&o.stdout);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{initiator} -> {target}: {out}{err}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let described = |mem: &str| match mem {
            "vram" => "VRAM (device 0)",
            _ => "DRAM",
        };
        assert_eq!(
            v["config"]["initiator"],
            format!("{} (1 workers)", described(initiator)),
            "{v}"
        );
        assert_eq!(v["config"]["target"], described(target), "{v}");
        let rows = v["rows"].as_array().unwrap();
        // 2 ops × 2 blocks (64K, 1M) × 2 batches (1, 32).
        assert_eq!(rows.len(), 8, "{v}");
        for r in rows {
            assert_eq!(r["check"], true, "{r}");
            assert!(r["gbps"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
}
