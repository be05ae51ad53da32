//! The GDS backend against a stand-in cuFile (`tests/standin/cufile_standin.c`, compiled
//! here with the system C compiler): the same entry points and struct layouts as cuFile,
//! moving bytes with pread/pwrite between files and host memory. So every code path of
//! the backend runs without a GPU: registration, both engines, short reads, bounds,
//! refusals, deregistration while in use, capacity. Real VRAM is tested in `gpu.rs`.
// Reason: the test loads the stand-in's knobs (C functions) itself.
#![allow(unsafe_code)]

mod common;

use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::standin;
use ferry_backend_api::{
    Backend, BackendFactory, BackendInit, Completion, Completions, Desc, Endpoint, Error,
    FailureKind, FileMode, MemKind, Op, Params, PeerId, Post, Range, RegionSpec,
};
use ferry_gds::cufile::IoMode;
use ferry_gds::{EngineKind, GdsBackend, GdsFactory};
use ferry_testkit::backend::TestCalls;

/// The stand-in's knobs are process-wide: tests that use them run one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

struct Knobs {
    lib: libloading::Library,
}

impl Knobs {
    fn new(path: &Path) -> Knobs {
        // SAFETY: the stand-in was built by this test; loading it again returns the same
        // handle the backend uses.
        let lib = unsafe { libloading::Library::new(path) }.unwrap();
        Knobs { lib }
    }
    fn hold(&self, on: bool) {
        // SAFETY: declared in cufile_standin.c as void standin_hold(int).
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(i32)>(b"standin_hold\0")
                .unwrap();
            f(i32::from(on));
        }
    }
    fn max_io(&self, bytes: usize) {
        // SAFETY: declared as void standin_set_max_io(size_t).
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(usize)>(b"standin_set_max_io\0")
                .unwrap();
            f(bytes);
        }
    }
    /// 0: batches work; 1: set-up, 2: submit, 3: status polls refuse them with
    /// CU_FILE_BATCH_NOCOMPAT_ERROR (what older cuFile says in compatibility mode).
    fn refuse_batches(&self, at: i32) {
        // SAFETY: declared as void standin_refuse_batches(int).
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(i32)>(b"standin_refuse_batches\0")
                .unwrap();
            f(at);
        }
    }
    fn fail_status(&self, on: bool) {
        // SAFETY: declared as void standin_fail_status(int).
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(i32)>(b"standin_fail_status\0")
                .unwrap();
            f(i32::from(on));
        }
    }
    /// (file handles, registered buffers, batch handles, I/O calls).
    fn counts(&self) -> (i32, i32, i32, u64) {
        let (mut h, mut b, mut n, mut ios) = (0i32, 0i32, 0i32, 0u64);
        // SAFETY: declared as void standin_counts(int*, int*, int*, unsigned long*).
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(*mut i32, *mut i32, *mut i32, *mut u64)>(
                    b"standin_counts\0",
                )
                .unwrap();
            f(&mut h, &mut b, &mut n, &mut ios);
        }
        (h, b, n, ios)
    }
}

impl Drop for Knobs {
    fn drop(&mut self) {
        self.fail_status(false);
        self.hold(false);
        self.max_io(0);
    }
}

fn backend(lib: &Path, extra: &[(&str, &str)]) -> GdsBackend {
    let mut params = Params::new();
    params.insert("cufile_library".into(), lib.display().to_string());
    // The stand-in needs no GPU: skip the NVIDIA device pre-check.
    params.insert("device_check".into(), "false".into());
    for (k, v) in extra {
        params.insert((*k).into(), (*v).into());
    }
    GdsBackend::new(&BackendInit {
        agent_name: "gds-test",
        params: &params,
    })
    .unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

fn dram(buf: &[u8]) -> RegionSpec<'static> {
    RegionSpec {
        kind: MemKind::Dram,
        desc: Desc {
            addr: buf.as_ptr() as u64,
            len: buf.len() as u64,
            dev: 0,
        },
        path: None,
    }
}

fn file_by_path(path: &Path, len: u64, mode: FileMode) -> RegionSpec<'_> {
    RegionSpec {
        kind: MemKind::File,
        desc: Desc {
            addr: 0,
            len,
            dev: 0,
        },
        path: Some((path, mode)),
    }
}

const RW: FileMode = FileMode {
    write: true,
    create: true,
    direct: false,
    sync: false,
};

/// Post one request and progress until its completion.
fn run(backend: &mut GdsBackend, op: Op, ranges: &[Range], tag: u64) -> Completion {
    let post = Post {
        tag,
        op,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::File,
        ranges,
        notif: None,
    };
    let mut done = Completions::with_capacity(16);
    backend.post_t(Endpoint::Local, &[post], &mut done).unwrap();
    wait(backend, &mut done);
    assert_eq!(done.len(), 1, "one completion per post");
    done.as_slice()[0]
}

fn wait(backend: &mut GdsBackend, done: &mut Completions) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while done.is_empty() {
        assert!(Instant::now() < deadline, "no completion within 20 s");
        backend.progress(done);
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// `n` ranges of `len` bytes: buffer offset i*len → file offset (n-1-i)*len (reversed,
/// so a mix-up of offsets shows).
fn ranges(buf: &[u8], buf_token: u64, file_token: u64, n: usize, len: u64) -> Vec<Range> {
    (0..n)
        .map(|i| Range {
            local_addr: buf.as_ptr() as u64 + i as u64 * len,
            remote_addr: (n - 1 - i) as u64 * len,
            len,
            local_dev: 0,
            remote_dev: 0,
            local_token: buf_token,
            remote_token: file_token,
        })
        .collect()
}

fn round_trip(engine: &str, chunk: &str) {
    let Some(lib) = standin() else { return };
    let _serial = serial();
    let knobs = Knobs::new(lib);
    let mut gds = backend(lib, &[("engine", engine), ("chunk_bytes", chunk)]);
    assert!(
        matches!(gds.io_mode(), IoMode::Compat { .. })
            || Path::new(ferry_gds::cufile::NVFS_VERSION_FILE).exists()
    );
    let expected_engine = if engine == "batch" {
        EngineKind::Batch
    } else {
        EngineKind::Threads
    };
    assert_eq!(gds.engine(), expected_engine);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.bin");
    let (n, len) = (16usize, 256 * 1024u64);
    let src = pattern(n * len as usize, 7);
    let dst = vec![0u8; src.len()];
    let s = gds.register_t(&dram(&src)).unwrap().token;
    let d = gds.register_t(&dram(&dst)).unwrap().token;
    let f = gds.register_t(&file_by_path(&path, 0, RW)).unwrap().token;
    let ios_before = knobs.counts().3;

    let c = run(&mut gds, Op::Write, &ranges(&src, s, f, n, len), 1);
    assert_eq!(c.result, Ok(()), "{engine}: write");
    let on_disk = std::fs::read(&path).unwrap();
    for i in 0..n {
        let file = &on_disk[(n - 1 - i) * len as usize..][..len as usize];
        assert!(
            file == &src[i * len as usize..][..len as usize],
            "{engine}: range {i} on disk"
        );
    }
    let c = run(&mut gds, Op::Read, &ranges(&dst, d, f, n, len), 2);
    assert_eq!(c.result, Ok(()), "{engine}: read");
    assert!(dst == src, "{engine}: bytes read back differ");
    let ios = knobs.counts().3 - ios_before;
    let pieces = (n as u64) * len.div_ceil(chunk.parse().unwrap());
    assert!(
        ios >= 2 * pieces,
        "{engine}: {ios} I/O calls for {pieces} pieces each way"
    );
    assert_eq!(gds.in_flight(), (0, 0));

    // Everything registered is released: by deregistration here, by drop for the rest.
    // SAFETY: no request in flight (in_flight above).
    gds.deregister_t(MemKind::Dram, s).unwrap();
    gds.deregister_t(MemKind::File, f).unwrap();
    let (handles, bufs, _, _) = knobs.counts();
    assert_eq!(
        (handles, bufs),
        (0, 1),
        "{engine}: one buffer left registered"
    );
    drop(gds);
    let (handles, bufs, batches, _) = knobs.counts();
    assert_eq!(
        (handles, bufs, batches),
        (0, 0, 0),
        "{engine}: drop released everything"
    );
}

#[test]
fn threads_engine_moves_bytes_both_ways() {
    round_trip("threads", "65536");
}

#[test]
fn batch_engine_moves_bytes_both_ways() {
    round_trip("batch", "65536");
}

#[test]
fn whole_ranges_in_one_piece_each() {
    round_trip("threads", "16777216");
    round_trip("batch", "16777216");
}

#[test]
fn partial_transfers_continue_where_they_stopped() {
    let Some(lib) = standin() else { return };
    let _serial = serial();
    let knobs = Knobs::new(lib);
    // cuFile may move fewer bytes than asked; the stand-in caps every call at 10000.
    knobs.max_io(10_000);
    for engine in ["threads", "batch"] {
        let mut gds = backend(lib, &[("engine", engine)]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let src = pattern(300_000, 3);
        let dst = vec![0u8; src.len()];
        let s = gds.register_t(&dram(&src)).unwrap().token;
        let d = gds.register_t(&dram(&dst)).unwrap().token;
        let f = gds.register_t(&file_by_path(&path, 0, RW)).unwrap().token;
        let c = run(&mut gds, Op::Write, &ranges(&src, s, f, 3, 100_000), 1);
        assert_eq!(c.result, Ok(()), "{engine}");
        let c = run(&mut gds, Op::Read, &ranges(&dst, d, f, 3, 100_000), 2);
        assert_eq!(c.result, Ok(()), "{engine}");
        assert!(dst == src, "{engine}: bytes differ after partial transfers");
    }
}

#[test]
fn reading_past_the_end_of_the_file_is_a_short_read() {
    let Some(lib) = standin() else { return };
    let _serial = serial();
    for engine in ["threads", "batch"] {
        let mut gds = backend(lib, &[("engine", engine)]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small");
        std::fs::write(&path, pattern(1000, 1)).unwrap();
        let buf = vec![0u8; 8192];
        let b = gds.register_t(&dram(&buf)).unwrap().token;
        let f = gds
            .register_t(&file_by_path(&path, 0, FileMode::default()))
            .unwrap()
            .token;
        let c = run(&mut gds, Op::Read, &ranges(&buf, b, f, 1, 4096), 9);
        let failure = c.result.expect_err("the file has 1000 bytes");
        assert_eq!(
            failure.kind,
            FailureKind::ShortRead,
            "{engine}: {failure:?}"
        );
        assert_eq!(failure.range, Some(0));
        // The 1000 bytes that were there did arrive.
        assert!(buf[..1000] == pattern(1000, 1)[..], "{engine}");
        // Writing to a read-only file fails with the OS error, not a panic.
        let c = run(&mut gds, Op::Write, &ranges(&buf, b, f, 1, 4096), 10);
        let failure = c.result.expect_err("read-only file");
        assert_eq!(failure.kind, FailureKind::Backend, "{engine}: {failure:?}");
        assert_ne!(failure.errno, 0, "{engine}: {failure:?}");
    }
}

#[test]
fn out_of_bounds_and_unsupported_requests_are_refused() {
    let Some(lib) = standin() else { return };
    let _serial = serial();
    let mut gds = backend(lib, &[]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bounded");
    std::fs::write(&path, vec![0u8; 1 << 16]).unwrap();
    let buf = vec![0u8; 1 << 16];
    let b = gds.register_t(&dram(&buf)).unwrap().token;
    // A file region of 8 KiB starting at 4 KiB.
    let f = gds
        .register_t(&RegionSpec {
            kind: MemKind::File,
            desc: Desc {
                addr: 4096,
                len: 8192,
                dev: 0,
            },
            path: Some((&path, RW)),
        })
        .unwrap()
        .token;
    let base = buf.as_ptr() as u64;
    let range = |local_addr: u64, remote_addr: u64, len: u64| Range {
        local_addr,
        remote_addr,
        len,
        local_dev: 0,
        remote_dev: 0,
        local_token: b,
        remote_token: f,
    };
    let post = |ranges: &[Range]| -> ferry_backend_api::Result<()> {
        let p = Post {
            tag: 1,
            op: Op::Read,
            local_kind: MemKind::Dram,
            remote_kind: MemKind::File,
            ranges,
            notif: None,
        };
        gds.validate(Endpoint::Local, &p)
    };
    assert!(post(&[range(base, 4096, 8192)]).is_ok());
    for (what, r) in [
        ("past the buffer", range(base + (1 << 16) - 100, 4096, 200)),
        ("before the buffer", range(base - 1, 4096, 10)),
        ("before the file region", range(base, 0, 4096)),
        ("past the file region", range(base, 8192, 8192)),
        ("wrapping", range(base, u64::MAX - 10, 100)),
    ] {
        let err = post(&[r]).expect_err(what);
        assert!(matches!(err, Error::InvalidParam { .. }), "{what}: {err}");
    }
    let stale = Range {
        remote_token: f ^ (1 << 40),
        ..range(base, 4096, 10)
    };
    assert!(matches!(post(&[stale]), Err(Error::NotFound { .. })));

    // Refused at post as well: nothing starts, no completion comes.
    let mut done = Completions::with_capacity(4);
    let bad = [range(base, 8192, 8192)];
    let p = Post {
        tag: 2,
        op: Op::Read,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::File,
        ranges: &bad,
        notif: None,
    };
    assert!(gds.post_t(Endpoint::Local, &[p], &mut done).is_err());
    let peer = Post {
        ranges: &bad[..0],
        ..p
    };
    let mut peers = slotmap::SlotMap::<PeerId, ()>::with_key();
    let err = gds
        .post_t(Endpoint::Peer(peers.insert(())), &[peer], &mut done)
        .unwrap_err();
    assert!(matches!(err, Error::NotSupported { .. }), "{err}");
    let dram_to_dram = Post {
        remote_kind: MemKind::Dram,
        ..p
    };
    let err = gds.validate(Endpoint::Local, &dram_to_dram).unwrap_err();
    assert!(matches!(err, Error::NotSupported { .. }), "{err}");
    assert!(done.is_empty());
    assert_eq!(gds.in_flight(), (0, 0));

    // Registration refusals.
    let err = gds
        .register_t(&RegionSpec {
            kind: MemKind::File,
            desc: Desc {
                addr: 0,
                len: 0,
                dev: 987_654,
            },
            path: None,
        })
        .unwrap_err();
    assert!(err.to_string().contains("987654"), "{err}");
    let err = gds
        .register_t(&RegionSpec {
            kind: MemKind::Dram,
            desc: Desc {
                addr: 0,
                len: 10,
                dev: 0,
            },
            path: None,
        })
        .unwrap_err();
    assert!(matches!(err, Error::InvalidParam { .. }), "{err}");
    let err = gds
        .register_t(&file_by_path(
            &dir.path().join("missing"),
            0,
            FileMode::default(),
        ))
        .unwrap_err();
    assert!(err.to_string().contains("missing"), "{err}");
    let err = gds
        .register_t(&file_by_path(
            &path,
            0,
            FileMode {
                create: true,
                ..FileMode::default()
            },
        ))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidParam { .. }), "{err}");
    // The same buffer twice: cuFile refuses, and says so.
    let err = gds.register_t(&dram(&buf)).unwrap_err();
    assert!(err.to_string().contains("ALREADY_REGISTERED"), "{err}");
    // VRAM without a CUDA driver (or without the cuda feature) is refused with a reason.
    let vram = RegionSpec {
        kind: MemKind::Vram,
        desc: Desc {
            addr: 0x7000_0000_0000,
            len: 4096,
            dev: 0,
        },
        path: None,
    };
    if ferry_gds_cuda_missing() {
        let err = gds.register_t(&vram).unwrap_err();
        assert!(matches!(err, Error::NotSupported { .. }), "{err}");
        assert!(
            err.to_string().contains("libcuda.so.1") || err.to_string().contains("feature"),
            "{err}"
        );
    }
    assert!(matches!(
        gds.deregister_t(MemKind::Dram, b ^ (1 << 33)),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        gds.deregister_t(MemKind::Block, b),
        Err(Error::NotSupported { .. })
    ));
    gds.deregister_t(MemKind::Dram, b).unwrap();
    assert!(matches!(
        gds.deregister_t(MemKind::Dram, b),
        Err(Error::NotFound { .. })
    ));
}

/// Whether this machine has no CUDA driver (so VRAM must be refused).
fn ferry_gds_cuda_missing() -> bool {
    // SAFETY: probing for the driver library only.
    unsafe { libloading::Library::new("libcuda.so.1") }.is_err()
}

#[test]
fn deregistering_a_region_in_use_is_refused_until_it_completes() {
    let Some(lib) = standin() else { return };
    let _serial = serial();
    let knobs = Knobs::new(lib);
    for engine in ["threads", "batch"] {
        let mut gds = backend(lib, &[("engine", engine)]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let src = pattern(1 << 20, 5);
        let s = gds.register_t(&dram(&src)).unwrap().token;
        let f = gds.register_t(&file_by_path(&path, 0, RW)).unwrap().token;
        knobs.hold(true);
        let r = ranges(&src, s, f, 4, 1 << 18);
        let post = Post {
            tag: 77,
            op: Op::Write,
            local_kind: MemKind::Dram,
            remote_kind: MemKind::File,
            ranges: &r,
            notif: None,
        };
        let mut done = Completions::with_capacity(4);
        gds.post_t(Endpoint::Local, &[post], &mut done).unwrap();
        for _ in 0..20 {
            gds.progress(&mut done);
        }
        assert!(done.is_empty(), "{engine}: held I/O completed");
        for (kind, token) in [(MemKind::Dram, s), (MemKind::File, f)] {
            let err = gds.deregister_t(kind, token).unwrap_err();
            assert!(matches!(err, Error::NotAllowed { .. }), "{engine}: {err}");
            assert!(err.to_string().contains("in use"), "{err}");
        }
        knobs.hold(false);
        wait(&mut gds, &mut done);
        assert_eq!(done.as_slice()[0].tag, 77);
        assert_eq!(done.as_slice()[0].result, Ok(()));
        gds.deregister_t(MemKind::Dram, s).unwrap();
        gds.deregister_t(MemKind::File, f).unwrap();
        assert_eq!(std::fs::read(&path).unwrap().len(), 1 << 20);
    }
}

#[test]
fn a_batch_that_does_not_fit_is_refused_whole() {
    let Some(lib) = standin() else { return };
    let _serial = serial();
    let mut gds = backend(lib, &[("max_ops", "4"), ("max_requests", "2")]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let src = pattern(1 << 16, 2);
    let s = gds.register_t(&dram(&src)).unwrap().token;
    let f = gds.register_t(&file_by_path(&path, 0, RW)).unwrap().token;
    let r = ranges(&src, s, f, 5, 4096);
    let post = |tag| Post {
        tag,
        op: Op::Write,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::File,
        ranges: &r,
        notif: None,
    };
    let mut done = Completions::with_capacity(4);
    let err = gds
        .post_t(Endpoint::Local, &[post(1)], &mut done)
        .unwrap_err();
    assert!(
        matches!(err, Error::Capacity { what, .. } if what.contains("max_ops")),
        "{err}"
    );
    let small = &r[..1];
    let one = |tag| Post {
        ranges: small,
        ..post(tag)
    };
    let err = gds
        .post_t(Endpoint::Local, &[one(1), one(2), one(3)], &mut done)
        .unwrap_err();
    assert!(
        matches!(err, Error::Capacity { what, .. } if what.contains("max_requests")),
        "{err}"
    );
    assert!(done.is_empty());
    assert_eq!(
        gds.in_flight(),
        (0, 0),
        "nothing of a refused batch started"
    );
    // What fits still works.
    gds.post_t(Endpoint::Local, &[one(4), one(5)], &mut done)
        .unwrap();
    while done.len() < 2 {
        gds.progress(&mut done);
    }
    assert!(done.as_slice().iter().all(|c| c.result.is_ok()));
    let _ = std::fs::metadata(&path).unwrap();
}

#[test]
fn parameters_are_validated() {
    let Some(lib) = standin() else { return };
    for (key, value) in [
        ("engine", "fast"),
        ("threads", "0"),
        ("threads", "65"),
        ("batch_entries", "0"),
        ("batch_entries", "257"), // more than the stand-in's max_batch_io_size
        ("batches", "0"),
        ("chunk_bytes", "100"),
        ("max_requests", "0"),
        ("max_ops", "x"),
        ("register_buffers", "maybe"),
        ("driver_open_timeout_ms", "0"),
        ("device_check", "maybe"),
    ] {
        let mut params = Params::new();
        params.insert("cufile_library".into(), lib.display().to_string());
        // The stand-in needs no GPU: skip the NVIDIA device pre-check.
        params.insert("device_check".into(), "false".into());
        params.insert(key.into(), value.into());
        let err = GdsBackend::new(&BackendInit {
            agent_name: "a",
            params: &params,
        })
        .err()
        .unwrap_or_else(|| panic!("{key}={value} accepted"));
        assert!(err.to_string().contains(key), "{key}={value}: {err}");
    }
    let mut params = Params::new();
    params.insert("no_such".into(), "1".into());
    assert!(GdsBackend::new(&BackendInit {
        agent_name: "a",
        params: &params
    })
    .is_err());
}

#[test]
fn unregistered_buffers_work_too() {
    let Some(lib) = standin() else { return };
    let _serial = serial();
    let knobs = Knobs::new(lib);
    let mut gds = backend(lib, &[("register_buffers", "false"), ("engine", "batch")]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let src = pattern(1 << 18, 9);
    let dst = vec![0u8; src.len()];
    let s = gds.register_t(&dram(&src)).unwrap().token;
    let d = gds.register_t(&dram(&dst)).unwrap().token;
    assert_eq!(knobs.counts().1, 0, "nothing registered with cuFile");
    let f = gds.register_t(&file_by_path(&path, 0, RW)).unwrap().token;
    assert_eq!(
        run(&mut gds, Op::Write, &ranges(&src, s, f, 8, 1 << 15), 1).result,
        Ok(())
    );
    assert_eq!(
        run(&mut gds, Op::Read, &ranges(&dst, d, f, 8, 1 << 15), 2).result,
        Ok(())
    );
    assert!(dst == src);
}

#[test]
fn without_cufile_gds_is_unavailable_and_says_why() {
    let err = GdsBackend::new(&BackendInit {
        agent_name: "a",
        params: &[(
            "cufile_library".to_string(),
            "/nonexistent/libcufile.so".to_string(),
        )]
        .into_iter()
        .collect(),
    })
    .err()
    .expect("no such library");
    assert!(matches!(err, Error::Backend { .. }), "{err}");
    assert!(
        err.to_string().contains("/nonexistent/libcufile.so"),
        "{err}"
    );
    // The default library: absent on a machine without cuFile (CI), found but refused
    // for want of a GPU where a wheel put it on the loader's path, present on a GPU
    // machine with nvidia-cufile.
    match GdsFactory.available() {
        Ok(()) => eprintln!("cuFile is installed here"),
        Err(why) => {
            assert!(
                why.contains("GDS needs cuFile") || why.contains("no NVIDIA device"),
                "{why}"
            );
            assert!(why.contains("libcufile.so.0"), "{why}");
            let vram = GdsFactory.kind_available(MemKind::Vram).unwrap_err();
            assert_eq!(vram, why);
        }
    }
}

#[test]
fn a_failing_batch_poll_cancels_the_batch_and_fails_its_requests() {
    let Some(lib) = standin() else { return };
    let _serial = serial();
    let knobs = Knobs::new(lib);
    let mut gds = backend(lib, &[("engine", "batch")]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let src = pattern(1 << 16, 8);
    let s = gds.register_t(&dram(&src)).unwrap().token;
    let f = gds.register_t(&file_by_path(&path, 0, RW)).unwrap().token;
    knobs.hold(true);
    let r = ranges(&src, s, f, 4, 1 << 14);
    let post = Post {
        tag: 5,
        op: Op::Write,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::File,
        ranges: &r,
        notif: None,
    };
    let mut done = Completions::with_capacity(4);
    gds.post_t(Endpoint::Local, &[post], &mut done).unwrap();
    knobs.fail_status(true);
    gds.progress(&mut done);
    assert_eq!(done.len(), 1, "one completion, once");
    let failure = done.as_slice()[0].result.expect_err("the poll failed");
    assert_eq!(failure.kind, FailureKind::Backend);
    assert_eq!(gds.in_flight(), (0, 0));
    knobs.fail_status(false);
    knobs.hold(false);
    for _ in 0..10 {
        gds.progress(&mut done);
    }
    assert_eq!(done.len(), 1, "no second completion");
    gds.deregister_t(MemKind::Dram, s).unwrap();
    gds.deregister_t(MemKind::File, f).unwrap();
    // The handle is usable again afterwards.
    let s = gds.register_t(&dram(&src)).unwrap().token;
    let f = gds.register_t(&file_by_path(&path, 0, RW)).unwrap().token;
    assert_eq!(
        run(&mut gds, Op::Write, &ranges(&src, s, f, 4, 1 << 14), 6).result,
        Ok(())
    );
}

/// cuFile that cannot run batches here (older cuFile in compatibility mode) refuses at
/// set-up, at submit or at a status poll: the backend moves the bytes with threads
/// instead, says so, and no request is lost or reported twice. A refusal at submit moved
/// nothing, so those operations go to the threads and succeed; one at a status poll may
/// have moved part of them, so they fail with a typed error and later ones succeed.
#[test]
fn batches_refused_by_cufile_fall_back_to_threads() {
    let Some(lib) = standin() else { return };
    let _serial = serial();
    let knobs = Knobs::new(lib);
    let dir = tempfile::tempdir().unwrap();
    let src = pattern(1 << 16, 9);
    let mut back = vec![0u8; 1 << 16];
    for at in [1, 2, 3] {
        knobs.refuse_batches(at);
        let mut gds = backend(lib, &[("engine", "batch")]);
        if at == 1 {
            assert_eq!(gds.engine(), EngineKind::Threads);
        } else {
            assert_eq!(gds.engine(), EngineKind::Batch);
        }
        let path = dir.path().join(format!("refused-{at}"));
        let s = gds.register_t(&dram(&src)).unwrap().token;
        let b = gds.register_t(&dram(&back)).unwrap().token;
        let f = gds.register_t(&file_by_path(&path, 0, RW)).unwrap().token;
        let first = run(&mut gds, Op::Write, &ranges(&src, s, f, 4, 1 << 14), 1);
        if at == 3 {
            let failure = first.result.expect_err("the status poll refused the batch");
            assert_eq!(failure.kind, FailureKind::Backend);
            let again = run(&mut gds, Op::Write, &ranges(&src, s, f, 4, 1 << 14), 2);
            assert_eq!(again.result, Ok(()));
        } else {
            assert_eq!(first.result, Ok(()), "refusal at {at}");
        }
        assert_eq!(gds.engine(), EngineKind::Threads, "refusal at {at}");
        let why = gds.fallback().expect("the fallback is said");
        assert!(why.contains("CU_FILE_BATCH_NOCOMPAT_ERROR"), "{why}");
        assert_eq!(
            run(&mut gds, Op::Read, &ranges(&back, b, f, 4, 1 << 14), 3).result,
            Ok(())
        );
        assert_eq!(back, src, "refusal at {at}");
        back.fill(0);
        assert_eq!(gds.in_flight(), (0, 0));
        gds.deregister_t(MemKind::Dram, s).unwrap();
        gds.deregister_t(MemKind::Dram, b).unwrap();
        gds.deregister_t(MemKind::File, f).unwrap();
    }
    knobs.refuse_batches(0);
    // The batch engine's handles are gone once the fallback's batches are reported.
    assert_eq!(knobs.counts().2, 0);
}
