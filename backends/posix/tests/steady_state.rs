//! Steady state: after warm-up, posting and progressing allocate nothing on any thread,
//! and a long loop leaves no request or operation state behind (the reference backend
//! leaked one allocation per request). One test only in this binary, so the global
//! allocation counter sees nothing but the backend and this loop.

mod common;

use std::time::Duration;

use common::*;
use ferry_backend_api::{Completions, Endpoint, Op};
use ferry_testkit::alloc::{self as counting, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn long_loop_allocates_nothing_and_leaks_nothing() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loop.bin");
        // A small queue depth so the pending queue is exercised too.
        let mut b = backend(engine, &[("queue_depth", "2")]);
        let file = register_path(&mut b, &path, rw_create()).unwrap();
        let mut buf = vec![0u8; 4 * 4096];
        Rng::new(3).fill(&mut buf);
        let token = register_dram(&mut b, &buf);
        let base = buf.as_ptr() as u64;
        let ranges: Vec<_> = (0..4)
            .map(|i| range(base + i * 4096, i * 4096, 4096, token, file))
            .collect();
        let mut done = Completions::with_capacity(4);
        let mut cycle = |b: &mut ferry_posix::PosixBackend, i: u64| {
            done.clear();
            let op = if i.is_multiple_of(2) {
                Op::Write
            } else {
                Op::Read
            };
            let batch = [post(i, op, &ranges), post(i + (1 << 40), op, &ranges[..1])];
            b.post_t(Endpoint::Local, &batch, &mut done).unwrap();
            while done.len() < 2 {
                b.wait(&mut done, Duration::from_millis(100)).unwrap();
            }
            for c in done.as_slice() {
                assert_eq!(c.result, Ok(()));
            }
        };
        for i in 0..200 {
            cycle(&mut b, i);
        }
        counting::start();
        let iterations = 2_000;
        let started = std::time::Instant::now();
        for i in 200..200 + iterations {
            cycle(&mut b, i);
        }
        let allocations = counting::stop();
        let stats = b.stats();
        assert_eq!(
            allocations, 0,
            "{engine}: {allocations} allocations over {iterations} post/progress cycles"
        );
        assert_eq!(stats.requests_in_use, 0, "{engine}: leaked request slots");
        assert_eq!(stats.ops_in_use, 0, "{engine}: leaked operation slots");
        assert_eq!(stats.ops_queued + stats.ops_in_flight, 0);
        eprintln!(
            "{engine}: {iterations} cycles in {:?}, 0 allocations, pools empty",
            started.elapsed()
        );
    }
}
