//! Steady state: after warm-up, posting and progressing allocate nothing on any thread,
//! and a long loop leaves no request or operation state behind (the reference backend
//! leaked one allocation per request). One test only in this binary, so the global
//! allocation counter sees nothing but the backend and this loop.

// A counting global allocator has to implement the unsafe `GlobalAlloc` trait.
#![allow(unsafe_code)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use ferry_backend_api::{Completions, Endpoint, Op};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

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
            let op = if i % 2 == 0 { Op::Write } else { Op::Read };
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
        ALLOCATIONS.store(0, Ordering::SeqCst);
        COUNTING.store(true, Ordering::SeqCst);
        let iterations = 2_000;
        let started = std::time::Instant::now();
        for i in 200..200 + iterations {
            cycle(&mut b, i);
        }
        COUNTING.store(false, Ordering::SeqCst);
        let allocations = ALLOCATIONS.load(Ordering::SeqCst);
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
