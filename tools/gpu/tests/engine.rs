//! GPU memory through the engine, on a machine without a GPU: what `ferry backends`
//! reports for GDS and UCX-VRAM, GDS moving FILE ↔ DRAM through an agent over the
//! stand-in cuFile, and the VRAM demo's and check tool's typed refusal without a driver.
//! (Real VRAM: `ferry-gpu-check all`, run by `tools/gpu-check.sh run`.)

use std::path::{Path, PathBuf};

use ferry::{Agent, AgentConfig, Desc, FileMode, MemKind, Op, Params, Side, XferStatus};

fn gpu_run() -> bool {
    ferry_cuda::gpu_tests_requested()
}

#[test]
fn backends_report_gds_and_vram_with_the_reason() {
    let infos = Agent::available_backends();
    let gds = infos
        .iter()
        .find(|i| i.name == "GDS")
        .expect("GDS is in the registry");
    assert!(gds.mem_kinds.contains(&MemKind::Vram) && gds.mem_kinds.contains(&MemKind::File));
    let ucx = infos.iter().find(|i| i.name == "UCX").unwrap();
    let ucx_vram = ucx
        .kinds
        .iter()
        .find(|(k, _)| *k == MemKind::Vram)
        .map(|(_, r)| r.clone())
        .expect("UCX lists VRAM");
    if gpu_run() {
        eprintln!("GPU run: GDS {:?}, UCX VRAM {ucx_vram:?}", gds.available);
        return;
    }
    match &gds.available {
        Err(why) => {
            assert!(why.contains("GDS needs cuFile"), "{why}");
            assert!(why.contains("libcufile.so.0"), "{why}");
        }
        Ok(()) => eprintln!("cuFile is installed here"),
    }
    if ucx.available.is_err() {
        return ferry_testkit::ci::skip("UCX", "libucp.so.0 not found");
    }
    let why = ucx_vram.expect_err("no GPU here, so UCX cannot move VRAM");
    assert!(why.contains("CUDA"), "{why}");
    if ferry_cuda::driver().is_err() {
        assert!(why.contains("libcuda.so.1"), "{why}");
    }
    // DRAM stays available.
    assert!(ucx
        .kinds
        .iter()
        .any(|(k, r)| *k == MemKind::Dram && r.is_ok()));
}

#[test]
fn vram_registration_without_a_gpu_is_refused_with_the_reason() {
    if gpu_run() || ferry_cuda::driver().is_ok() {
        eprintln!("skipping: this machine has a CUDA driver");
        return;
    }
    let agent = Agent::new(AgentConfig::named("no-gpu")).unwrap();
    if agent.create_backend("UCX", &Params::new()).is_err() {
        return ferry_testkit::ci::skip("UCX", "libucp.so.0 not found");
    }
    // SAFETY: the address is never touched: registration is refused before any
    // backend maps it.
    #[allow(unsafe_code)]
    let err = unsafe { agent.register(MemKind::Vram, Desc::new(0x7f00_0000_0000, 1 << 20, 0)) }
        .unwrap_err();
    assert!(err.to_string().contains("VRAM"), "{err}");
    assert!(err.to_string().contains("CUDA"), "{err}");
}

#[test]
fn the_vram_demo_and_the_check_tool_say_why_without_a_driver() {
    if gpu_run() || ferry_cuda::driver().is_ok() {
        eprintln!("skipping: this machine has a CUDA driver");
        return;
    }
    let err = ferry_gpu::demo::run(&ferry_gpu::GpuSetup::default(), 8).unwrap_err();
    assert!(
        err.starts_with("VRAM needs a CUDA driver: libcuda.so.1 not found"),
        "{err}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferry-gpu-check"))
        .args(["demo", "--mib", "8"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("VRAM needs a CUDA driver"), "{stderr}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferry-gpu-check"))
        .args(["bogus"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// The stand-in cuFile of the GDS backend's tests, built here too.
fn standin() -> Option<PathBuf> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../backends/gds/tests/standin/cufile_standin.c");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("libcufile_standin_engine.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&out)
        .arg(&source)
        .arg("-lpthread")
        .status()
    {
        Ok(s) if s.success() => Some(out),
        other => {
            ferry_testkit::ci::skip(
                "a C compiler for the GDS stand-in cuFile",
                format!("{cc}: {other:?}"),
            );
            None
        }
    }
}

#[test]
fn gds_moves_file_and_dram_through_an_agent() {
    let Some(lib) = standin() else { return };
    let agent = Agent::new(AgentConfig::named("gds-engine")).unwrap();
    let mut params = Params::new();
    params.insert("cufile_library".into(), lib.display().to_string());
    // The stand-in needs no GPU: skip the NVIDIA device pre-check.
    params.insert("device_check".into(), "false".into());
    params.insert("engine".into(), "batch".into());
    agent.create_backend("GDS", &params).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kv.bin");
    let mode = FileMode {
        write: true,
        create: true,
        direct: false,
        sync: false,
    };
    agent
        .register_file(&path, mode, Desc::new(0, 0, 5))
        .unwrap();
    let block = 64 << 10;
    let blocks = 64;
    let src = ferry_gpu::pattern(block * blocks, 4);
    let back = vec![0u8; src.len()];
    let host = |v: &[u8]| Desc::new(v.as_ptr() as u64, v.len() as u64, 0);
    // SAFETY: both buffers outlive the agent (declared before it is dropped at the end)
    // and are read only after the transfers completed.
    #[allow(unsafe_code)]
    unsafe {
        agent.register(MemKind::Dram, host(&src)).unwrap();
        agent.register(MemKind::Dram, host(&back)).unwrap();
    }
    let order = ferry_gpu::shuffled(blocks, 3);
    let local = |v: &[u8]| -> Vec<Desc> {
        (0..blocks)
            .map(|i| Desc::new(v.as_ptr() as u64 + (i * block) as u64, block as u64, 0))
            .collect()
    };
    let file: Vec<Desc> = order
        .iter()
        .map(|&j| Desc::new((j * block) as u64, block as u64, 5))
        .collect();
    for (op, buf) in [(Op::Write, &src), (Op::Read, &back)] {
        let x = agent
            .create(
                op,
                MemKind::Dram,
                &local(buf),
                Side::Local,
                MemKind::File,
                &file,
                None,
            )
            .unwrap();
        ferry_gpu::run_once(&agent, x).unwrap();
        assert_eq!(agent.check(x).unwrap(), XferStatus::Done);
        agent.release(x).unwrap();
    }
    assert!(back == src, "bytes read back through GDS differ");
    let on_disk = std::fs::read(&path).unwrap();
    for (i, &j) in order.iter().enumerate() {
        assert!(on_disk[j * block..][..block] == src[i * block..][..block]);
    }
    drop(agent);
}
