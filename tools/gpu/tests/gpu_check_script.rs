//! `tools/gpu-check.sh run` on a machine without a CUDA driver (this one, and CI): it
//! must end at once with exit status 1, one "FAIL (no CUDA driver)" line per step and
//! the driver's reason, never a panic or a hang. The run is staged the way `pack` lays
//! it out (only the binary the driver check needs).

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn run_without_a_cuda_driver_fails_fast_with_one_line_per_step() {
    if ferry_cuda::driver().is_ok() {
        eprintln!("skipping: this machine has a CUDA driver (the GPU run itself is the check)");
        return;
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let stage = tempfile::tempdir().unwrap();
    std::fs::create_dir(stage.path().join("bin")).unwrap();
    std::fs::copy(
        env!("CARGO_BIN_EXE_ferry-gpu-check"),
        stage.path().join("bin/ferry-gpu-check"),
    )
    .unwrap();
    std::fs::copy(
        root.join("tools/gpu-check.sh"),
        stage.path().join("gpu-check.sh"),
    )
    .unwrap();
    std::fs::copy(
        root.join("tools/gpu/cufile.json"),
        stage.path().join("cufile.json"),
    )
    .unwrap();
    let started = Instant::now();
    let out = Command::new("timeout")
        .arg("60")
        .arg(stage.path().join("gpu-check.sh"))
        .arg("run")
        .output()
        .unwrap();
    let took = started.elapsed();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(took < Duration::from_secs(60), "{took:?}\n{text}");
    let fails = text
        .lines()
        .filter(|l| l.ends_with("FAIL (no CUDA driver)"))
        .count();
    assert_eq!(fails, 8, "one line per step:\n{text}");
    assert!(
        text.contains("CUDA driver: VRAM needs a CUDA driver"),
        "{text}"
    );
    assert!(text.contains("gpu-check: FAIL"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}
