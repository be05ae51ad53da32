//! GDS with real cuFile and real VRAM: runs only with `FERRY_TEST_GPU=1` (then a missing
//! GPU, driver or cuFile is a failure) and the `cuda` feature; otherwise it says why it
//! skips. cuFile comes from `FERRY_TEST_CUFILE` (a path) or `libcufile.so.0`.

// Reason: the test calls the backend's unsafe methods (through `TestCalls`).
#![allow(unsafe_code)]

#[cfg(feature = "cuda")]
#[test]
fn file_vram_round_trip_with_both_engines() {
    use std::time::{Duration, Instant};

    use ferry_backend_api::{
        Backend, BackendInit, Completions, Desc, Endpoint, FileMode, MemKind, Op, Params, Post,
        Range, RegionSpec,
    };
    use ferry_cuda::{Device, DeviceBuffer};
    use ferry_gds::GdsBackend;
    use ferry_testkit::backend::TestCalls;

    if !ferry_cuda::gpu_tests_requested() {
        eprintln!("skipping (GDS with VRAM): GPU tests run with FERRY_TEST_GPU=1");
        return;
    }
    let dev = Device::open(0).expect("FERRY_TEST_GPU=1 needs CUDA device 0");
    let library = std::env::var("FERRY_TEST_CUFILE").unwrap_or_default();
    let dir =
        tempfile::tempdir_in(std::env::var("FERRY_TEST_GDS_DIR").unwrap_or("/tmp".into())).unwrap();
    let len = 16usize << 20;
    let block = 1u64 << 20;
    let src = DeviceBuffer::alloc(&dev, len).unwrap();
    let dst = DeviceBuffer::alloc(&dev, len).unwrap();
    let bytes: Vec<u8> = (0..len).map(|i| (i * 13 + (i >> 12)) as u8).collect();
    src.write(&bytes).unwrap();
    for engine in ["threads", "batch"] {
        let mut params = Params::new();
        params.insert("cufile_library".into(), library.clone());
        params.insert("engine".into(), engine.into());
        // cuFile that cannot run batches here (older cuFile in compatibility mode)
        // makes the backend fall back to threads, which it says (`fallback`).
        let mut gds = GdsBackend::new(&BackendInit {
            agent_name: "gds-gpu",
            params: &params,
        })
        .unwrap_or_else(|e| panic!("{engine}: {e}"));
        if let Some(why) = gds.fallback() {
            eprintln!("GDS {engine}: fell back to threads: {why}");
        }
        eprintln!("GDS {engine}: {}", gds.io_mode());
        dst.write(&vec![0u8; len]).unwrap();
        let vram = |b: &DeviceBuffer| RegionSpec {
            kind: MemKind::Vram,
            desc: Desc::new(b.addr(), len as u64, 0),
            path: None,
        };
        let s = gds.register_t(&vram(&src)).unwrap().token;
        let d = gds.register_t(&vram(&dst)).unwrap().token;
        let path = dir.path().join(format!("{engine}.bin"));
        // O_DIRECT where the file system takes it (tmpfs does not).
        let direct = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .is_ok()
        };
        eprintln!(
            "GDS {engine}: file {} ({})",
            path.display(),
            if direct { "O_DIRECT" } else { "buffered" }
        );
        let mode = FileMode {
            write: true,
            create: true,
            direct,
            sync: false,
        };
        let f = gds
            .register_t(&RegionSpec {
                kind: MemKind::File,
                desc: Desc::new(0, 0, 1),
                path: Some((&path, mode)),
            })
            .unwrap_or_else(|e| panic!("{engine}: O_DIRECT file in {:?}: {e}", dir.path()))
            .token;
        let n = len as u64 / block;
        let ranges = |base: u64, token: u64| -> Vec<Range> {
            (0..n)
                .map(|i| Range {
                    local_addr: base + i * block,
                    remote_addr: (n - 1 - i) * block,
                    len: block,
                    local_dev: 0,
                    remote_dev: 1,
                    local_token: token,
                    remote_token: f,
                })
                .collect()
        };
        for (op, r, tag) in [
            (Op::Write, ranges(src.addr(), s), 1u64),
            (Op::Read, ranges(dst.addr(), d), 2),
        ] {
            let post = Post {
                tag,
                op,
                local_kind: MemKind::Vram,
                remote_kind: MemKind::File,
                ranges: &r,
                notif: None,
            };
            let mut done = Completions::with_capacity(4);
            gds.post_t(Endpoint::Local, &[post], &mut done).unwrap();
            let deadline = Instant::now() + Duration::from_secs(60);
            while done.is_empty() {
                assert!(Instant::now() < deadline, "{engine}: no completion");
                gds.progress(&mut done);
            }
            assert_eq!(done.as_slice()[0].result, Ok(()), "{engine} {op:?}");
        }
        let mut back = vec![0u8; len];
        dst.read(&mut back).unwrap();
        assert!(back == bytes, "{engine}: FILE -> VRAM bytes differ");
        let on_disk = std::fs::read(&path).unwrap();
        let b = block as usize;
        for i in 0..n as usize {
            assert!(
                on_disk[(n as usize - 1 - i) * b..][..b] == bytes[i * b..][..b],
                "{engine}: block {i} on disk"
            );
        }
        gds.deregister_t(MemKind::Vram, s).unwrap();
        gds.deregister_t(MemKind::Vram, d).unwrap();
        gds.deregister_t(MemKind::File, f).unwrap();
        let _ = gds.capabilities();
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_tests_need_the_cuda_feature() {
    assert!(
        !std::env::var("FERRY_TEST_GPU").is_ok_and(|v| v == "1"),
        "FERRY_TEST_GPU=1 but ferry-gds was built without the `cuda` feature"
    );
    eprintln!("skipping (GDS with VRAM): built without the `cuda` feature");
}
