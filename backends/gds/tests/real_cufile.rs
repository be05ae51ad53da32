//! The GDS backend with a real libcufile loaded and (on CI) no GPU: the state PyTorch's
//! CUDA wheel makes (it brings the `nvidia-cufile` wheel's `libcufile.so.0`), in which
//! some cuFile builds spin forever inside `cuFileDriverOpen`. Nothing may hang there:
//! availability checks must not call into cuFile at all, creation must refuse at once
//! without an NVIDIA device, and a driver open that is let through must be bounded.
//!
//! `FERRY_TEST_CUFILE` names the libraries (`:`-separated; tools/test.sh installs the
//! wheels and sets it). Unset, the tests fail under CI=true and skip elsewhere.
//!
//! Each case runs in a child process (this test binary, re-run on one test): it loads
//! one library process-wide first (`RTLD_GLOBAL`, as `import torch` does), the parent
//! kills it and fails when it does not finish within [`CHILD_LIMIT`] — a hang fails the
//! test instead of hanging CI — and a thread left stuck in cuFile dies with the child.
// Reason: the child loads the library with dlopen flags of its own.
#![allow(unsafe_code)]

mod common;

use common::{create, params};

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_backend_api::{BackendFactory, Error, MemKind};
use ferry_gds::{cufile, GdsFactory};

/// The longest a child may run.
const CHILD_LIMIT: Duration = Duration::from_secs(20);
/// Set in a child: the library it loads.
const CHILD_ENV: &str = "FERRY_TEST_REAL_CUFILE_CHILD";

fn machine_has_nvidia_device() -> bool {
    cufile::DEVICE_NODES.iter().any(|p| Path::new(p).exists())
}

/// Run test `name` of this binary in a child for `lib`, within [`CHILD_LIMIT`].
fn in_child(name: &str, lib: &Path) {
    let scratch = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, lib)
        // cuFile writes cufile.log into the working directory.
        .current_dir(scratch.path())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(
                status.success(),
                "{name} with {} failed ({status}); its output is above",
                lib.display()
            );
            eprintln!(
                "{name} with {}: passed in {:?}",
                lib.display(),
                started.elapsed()
            );
            return;
        }
        if started.elapsed() > CHILD_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{name} with {} did not finish within {CHILD_LIMIT:?}: something blocks or \
                 spins",
                lib.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// In a child: the library it is to load, loaded process-wide. `None` in the parent.
fn child_library() -> Option<PathBuf> {
    let lib = PathBuf::from(std::env::var_os(CHILD_ENV)?);
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading cuFile runs its constructors only (its own state); leaked so it
    // stays loaded for the process, as a Python process that imported torch has it.
    let loaded = unsafe { Library::open(Some(&lib), RTLD_NOW | RTLD_GLOBAL) }
        .unwrap_or_else(|e| panic!("cannot load {}: {e}", lib.display()));
    std::mem::forget(loaded);
    Some(lib)
}

fn timed<T>(what: &str, limit: Duration, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = f();
    let took = started.elapsed();
    eprintln!("{what}: {took:?}");
    assert!(took < limit, "{what} took {took:?} (limit {limit:?})");
    out
}

#[test]
fn probing_with_a_real_cufile_loaded_returns_at_once() {
    let Some(lib) = child_library() else {
        for lib in common::real_cufile() {
            in_child("probing_with_a_real_cufile_loaded_returns_at_once", &lib);
        }
        return;
    };
    let fast = Duration::from_millis(100);
    // The default library name finds the loaded one (its soname).
    let default = timed("GdsFactory.available()", fast, || GdsFactory.available());
    let named = timed("available_with(cufile_library)", fast, || {
        GdsFactory.available_with(&params(&lib, &[]))
    });
    for kind in [MemKind::Dram, MemKind::Vram, MemKind::File] {
        let r = timed(&format!("kind_available({kind})"), fast, || {
            GdsFactory.kind_available(kind)
        });
        eprintln!("  {kind}: {r:?}");
    }
    let created = timed("GdsBackend::new", Duration::from_secs(6), || {
        create(&params(&lib, &[]))
    });
    if machine_has_nvidia_device() {
        eprintln!("NVIDIA device here: available {default:?} / {named:?}");
        match &created {
            Ok(b) => eprintln!("created: {}", b.io_mode()),
            Err(e) => eprintln!("creation refused: {e}"),
        }
        if ferry_cuda_requested() {
            created.expect("FERRY_TEST_GPU=1: GDS over the real cuFile must open");
        }
        return;
    }
    for why in [default.unwrap_err(), named.unwrap_err()] {
        assert!(why.contains("no NVIDIA device"), "{why}");
        assert!(why.contains("cuFileDriverOpen is not called"), "{why}");
    }
    let err = created.err().expect("no GPU: creation is refused");
    assert!(matches!(err, Error::NotSupported { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&lib.display().to_string()), "{text}");
    assert!(text.contains("no NVIDIA device"), "{text}");
}

/// With the pre-check turned off, the real `cuFileDriverOpen` runs — and without a GPU
/// it either fails or never returns. Either way creation ends within the timeout with a
/// typed error naming the library, and a second creation ends at once.
#[test]
fn a_real_driver_open_let_through_is_bounded() {
    let Some(lib) = child_library() else {
        if machine_has_nvidia_device() {
            eprintln!("NVIDIA device here: the driver open is expected to work, not tested here");
            return;
        }
        for lib in common::real_cufile() {
            in_child("a_real_driver_open_let_through_is_bounded", &lib);
        }
        return;
    };
    let p = params(
        &lib,
        &[
            ("device_check", "false"),
            ("driver_open_timeout_ms", "2000"),
        ],
    );
    let err = timed(
        "GdsBackend::new (device_check=false)",
        Duration::from_secs(4),
        || create(&p),
    )
    .err()
    .expect("no GPU: the open cannot succeed");
    eprintln!("refused: {err}");
    match &err {
        Error::Backend { errno, detail, .. } => {
            assert!(
                *errno == libc::ETIMEDOUT || *errno == libc::EIO,
                "errno {errno}: {err}"
            );
            assert!(detail.contains(&lib.display().to_string()), "{err}");
            assert!(detail.contains("cuFileDriverOpen"), "{err}");
        }
        other => panic!("expected a Backend error, got {other:?}"),
    }
    let again = timed("second GdsBackend::new", Duration::from_millis(100), || {
        create(&p)
    })
    .err()
    .expect("still refused");
    match &err {
        Error::Backend { errno, .. } if *errno == libc::ETIMEDOUT => {
            let text = again.to_string();
            assert!(text.contains("has not returned"), "{text}");
            assert!(text.contains(&lib.display().to_string()), "{text}");
        }
        _ => assert_eq!(again.to_string(), err.to_string()),
    }
    // Availability reports the failure without calling cuFile again.
    let why = timed(
        "available_with after the failure",
        Duration::from_millis(100),
        || GdsFactory.available_with(&p),
    )
    .unwrap_err();
    assert!(why.contains("cuFileDriverOpen"), "{why}");
}

fn ferry_cuda_requested() -> bool {
    std::env::var("FERRY_TEST_GPU").is_ok_and(|v| v == "1")
}
