//! Steady state over the stand-in cuFile: after warm-up, posting and progressing
//! allocate nothing on any thread (both engines), and a long loop leaves no request or
//! operation behind. One test only in this binary, so the global allocation counter
//! sees nothing but the backend and this loop.
// Reason: the test calls the backend's unsafe methods (through `TestCalls`).
#![allow(unsafe_code)]

mod common;

use ferry_backend_api::{
    Backend, BackendInit, Completions, Desc, Endpoint, FileMode, MemKind, Op, Params, Post, Range,
    RegionSpec,
};
use ferry_gds::GdsBackend;
use ferry_testkit::alloc::{self as counting, CountingAlloc};
use ferry_testkit::backend::TestCalls;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn long_loop_allocates_nothing_and_leaks_nothing() {
    let Some(lib) = common::standin() else { return };
    for engine in ["threads", "batch"] {
        let mut params = Params::new();
        params.insert("cufile_library".into(), lib.display().to_string());
        // The stand-in needs no GPU: skip the NVIDIA device pre-check.
        params.insert("device_check".into(), "false".into());
        params.insert("engine".into(), engine.into());
        // Small batches so a post spans several and the queue is exercised.
        params.insert("batch_entries".into(), "2".into());
        params.insert("batches".into(), "2".into());
        let mut gds = GdsBackend::new(&BackendInit {
            agent_name: "steady",
            params: &params,
        })
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loop.bin");
        let buf = vec![7u8; 8 * 4096];
        let b = gds
            .register_t(&RegionSpec {
                kind: MemKind::Dram,
                desc: Desc::new(buf.as_ptr() as u64, buf.len() as u64, 0),
                path: None,
            })
            .unwrap()
            .token;
        let mode = FileMode {
            write: true,
            create: true,
            direct: false,
            sync: false,
        };
        let f = gds
            .register_t(&RegionSpec {
                kind: MemKind::File,
                desc: Desc::new(0, 0, 1),
                path: Some((&path, mode)),
            })
            .unwrap()
            .token;
        let base = buf.as_ptr() as u64;
        let ranges: Vec<Range> = (0..8u64)
            .map(|i| Range {
                local_addr: base + i * 4096,
                remote_addr: (7 - i) * 4096,
                len: 4096,
                local_dev: 0,
                remote_dev: 1,
                local_token: b,
                remote_token: f,
            })
            .collect();
        let mut done = Completions::with_capacity(4);
        let mut cycle = |gds: &mut GdsBackend, i: u64| {
            done.clear();
            let op = if i.is_multiple_of(2) {
                Op::Write
            } else {
                Op::Read
            };
            let post = |tag, ranges| Post {
                tag,
                op,
                local_kind: MemKind::Dram,
                remote_kind: MemKind::File,
                ranges,
                notif: None,
            };
            let batch = [post(i, &ranges[..]), post(i + (1 << 40), &ranges[..1])];
            gds.post_t(Endpoint::Local, &batch, &mut done).unwrap();
            while done.len() < 2 {
                gds.progress(&mut done);
                std::thread::yield_now();
            }
            for c in done.as_slice() {
                assert_eq!(c.result, Ok(()), "{engine}");
            }
        };
        for i in 0..200 {
            cycle(&mut gds, i);
        }
        counting::start();
        let iterations = 2_000;
        for i in 200..200 + iterations {
            cycle(&mut gds, i);
        }
        let allocations = counting::stop();
        assert_eq!(
            allocations, 0,
            "{engine}: {allocations} allocations over {iterations} post/progress cycles"
        );
        assert_eq!(
            gds.in_flight(),
            (0, 0),
            "{engine}: leaked request/operation slots"
        );
        eprintln!("{engine}: {iterations} cycles, 0 allocations, pools empty");
    }
}
