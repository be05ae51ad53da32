//! `ferry backends` and agent creation with a real libcufile loaded and no GPU — the
//! state PyTorch's CUDA wheel makes (it brings the `nvidia-cufile` wheel's
//! `libcufile.so.0`), where some cuFile builds spin forever inside `cuFileDriverOpen`.
//! Probing must not call it: both return at once.
//!
//! `FERRY_TEST_CUFILE` names the libraries (`:`-separated; tools/test.sh installs the
//! wheels and sets it). Unset, the tests fail under CI=true and skip elsewhere. Every
//! case runs in a child process that is killed, failing the test, past [`LIMIT`]: a hang
//! fails instead of hanging CI.
// Reason: the agent child loads the library process-wide with dlopen itself.
#![allow(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferry::{Agent, AgentConfig, Params};

/// The longest a child may run.
const LIMIT: Duration = Duration::from_secs(10);
/// Set in a child of the agent test: run the agent body.
const CHILD_ENV: &str = "FERRY_TEST_REAL_CUFILE_AGENT_CHILD";

fn libraries() -> Vec<PathBuf> {
    let what = "a real libcufile (the nvidia-cufile wheel)";
    let Some(list) = std::env::var_os("FERRY_TEST_CUFILE").filter(|v| !v.is_empty()) else {
        ferry_testkit::ci::skip(what, "FERRY_TEST_CUFILE is not set (tools/test.sh sets it)");
        return Vec::new();
    };
    let paths: Vec<PathBuf> = std::env::split_paths(&list).collect();
    if let Some(missing) = paths.iter().find(|p| !p.is_file()) {
        ferry_testkit::ci::skip(what, format!("{} does not exist", missing.display()));
        return Vec::new();
    }
    paths
}

fn machine_has_nvidia_device() -> bool {
    ["/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg"]
        .iter()
        .any(|p| Path::new(p).exists())
}

/// Wait for `child` at most [`LIMIT`]; kill it and fail past that.
fn bounded(what: &str, mut child: Child) -> (Output, Duration) {
    let started = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            return (out, started.elapsed());
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} did not finish within {LIMIT:?} (it blocks or spins); its output:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn ferry_backends_with_a_real_cufile_preloaded_returns_at_once() {
    for lib in libraries() {
        let scratch = tempfile::tempdir().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .arg("backends")
            .env("LD_PRELOAD", &lib)
            .env_remove("RUST_LOG")
            .current_dir(scratch.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let what = format!("LD_PRELOAD={} ferry backends", lib.display());
        let (out, took) = bounded(&what, child);
        let stdout = String::from_utf8_lossy(&out.stdout);
        eprintln!("{what}: {took:?}");
        assert!(
            out.status.success(),
            "{what}: {}{}",
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(took < Duration::from_secs(2), "{what} took {took:?}");
        let gds = stdout
            .lines()
            .find(|l| l.starts_with("GDS "))
            .unwrap_or_else(|| panic!("no GDS line in:\n{stdout}"));
        eprintln!("{gds}");
        if !machine_has_nvidia_device() {
            assert!(gds.contains("no NVIDIA device"), "{gds}");
            assert!(gds.contains("cuFileDriverOpen is not called"), "{gds}");
        }
        // A cuFile that was called writes cufile.log into the working directory.
        assert!(
            !scratch.path().join("cufile.log").exists(),
            "{what}: cuFile was called (cufile.log written)"
        );
    }
}

/// What `ferry.nixl_agent(name)` does: list the backends and create every available
/// one, then create GDS by name (refused without a GPU, with a reason, at once).
#[test]
fn agent_creation_with_a_real_cufile_loaded_returns_at_once() {
    if let Some(lib) = std::env::var_os(CHILD_ENV) {
        return agent_child(Path::new(&lib));
    }
    for lib in libraries() {
        let scratch = tempfile::tempdir().unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "agent_creation_with_a_real_cufile_loaded_returns_at_once",
                "--exact",
                "--nocapture",
            ])
            .env(CHILD_ENV, &lib)
            .current_dir(scratch.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let what = format!("agent creation with {} loaded", lib.display());
        let (out, took) = bounded(&what, child);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{what}: {took:?}\n{text}");
        assert!(out.status.success(), "{what}: {text}");
    }
}

fn agent_child(lib: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::CString::new(lib.as_os_str().as_bytes()).unwrap();
    // SAFETY: loading cuFile runs its own constructors only; never closed, so it stays
    // loaded, as in a Python process that imported torch.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(!handle.is_null(), "cannot load {}", lib.display());
    let started = Instant::now();
    let infos = Agent::available_backends();
    let listed = started.elapsed();
    eprintln!("available_backends: {listed:?}");
    assert!(listed < Duration::from_secs(1), "{listed:?}");
    let started = Instant::now();
    let agent = Agent::new(AgentConfig::named("real-cufile")).unwrap();
    let made = started.elapsed();
    eprintln!("Agent::new: {made:?}");
    assert!(made < Duration::from_millis(100), "{made:?}");
    // Every available backend, as `instantiate_all` does (UCX's context takes what it
    // takes; the child's limit bounds the whole). OBJ (built with feature `obj`) has no
    // default bucket: it gets one (creation contacts no server).
    for info in infos.iter().filter(|i| i.available.is_ok()) {
        let mut params = Params::new();
        if info.name == "OBJ" {
            params.insert("bucket".into(), "real-cufile".into());
        }
        let started = Instant::now();
        agent
            .create_backend(info.name, &params)
            .unwrap_or_else(|e| panic!("{} is available but not created: {e}", info.name));
        eprintln!("create_backend({}): {:?}", info.name, started.elapsed());
    }
    let gds = infos
        .iter()
        .find(|i| i.name == "GDS")
        .expect("GDS compiled in");
    let mut params = Params::new();
    params.insert("cufile_library".into(), lib.display().to_string());
    let started = Instant::now();
    let result = agent.create_backend("GDS", &params);
    let took = started.elapsed();
    eprintln!("create_backend(GDS, cufile_library): {took:?}: {result:?}");
    if !machine_has_nvidia_device() {
        let why = gds.available.as_ref().unwrap_err();
        assert!(why.contains("no NVIDIA device"), "{why}");
        let err = result.expect_err("no GPU: GDS is refused");
        assert!(matches!(err, ferry::Error::NotSupported { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&lib.display().to_string()),
            "{err}"
        );
        assert!(took < Duration::from_millis(100), "{took:?}");
    }
}
