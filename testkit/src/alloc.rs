//! A global allocator that counts allocations while counting is on, for the
//! no-allocation proofs. A test binary installs it with
//!
//! ```
//! use ferry_testkit::alloc::{counted, CountingAlloc};
//!
//! #[global_allocator]
//! static GLOBAL: CountingAlloc = CountingAlloc;
//!
//! let (v, allocations) = counted(|| vec![1u8; 3]);
//! assert_eq!((v.len(), allocations), (3, 1));
//! ```
//!
//! and measures with [`counted`] (or [`start`] / [`stop`] around a loop). The count is
//! process-wide (every thread), so such a binary should hold one test, or tests that do
//! not run concurrently with a measurement.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Forwards to the system allocator, counting `alloc`, `alloc_zeroed` and `realloc`
/// calls while counting is on.
pub struct CountingAlloc;

static ON: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);
/// Of `COUNT`: allocations on the measuring thread or a thread named with one of
/// `OWN_PREFIXES` (see [`counted_by_thread`]).
static OWN: AtomicUsize = AtomicUsize::new(0);
static OWN_PREFIXES: OnceLock<&'static [&'static str]> = OnceLock::new();

thread_local! {
    /// Set on the thread inside [`counted_by_thread`].
    static MEASURING: Cell<bool> = const { Cell::new(false) };
    /// Set while this thread looks up its own name (an allocation meanwhile is not
    /// classified again).
    static CLASSIFYING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the current thread is the measuring one or named with an own prefix.
/// Threads started by `std` know their name without allocating.
fn own_thread() -> bool {
    if MEASURING.try_with(Cell::get).unwrap_or(false) {
        return true;
    }
    let Some(prefixes) = OWN_PREFIXES.get() else {
        return false;
    };
    CLASSIFYING
        .try_with(|busy| {
            if busy.replace(true) {
                return false;
            }
            let own = std::thread::current()
                .name()
                .is_some_and(|n| prefixes.iter().any(|p| n.starts_with(p)));
            busy.set(false);
            own
        })
        .unwrap_or(false)
}

fn note(size: usize) {
    if ON.load(Ordering::Relaxed) {
        COUNT.fetch_add(1, Ordering::Relaxed);
        LARGEST.fetch_max(size, Ordering::Relaxed);
        if own_thread() {
            OWN.fetch_add(1, Ordering::Relaxed);
        }
    }
}

// SAFETY: every method forwards to the system allocator with the caller's arguments
// unchanged; counting touches only atomics and thread-locals and never the memory handed out.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which is System's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: `ptr` came from `System` through this allocator with `layout`; the
        // caller upholds the rest of `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Reset the count and switch counting on.
pub fn start() {
    COUNT.store(0, Ordering::SeqCst);
    LARGEST.store(0, Ordering::SeqCst);
    OWN.store(0, Ordering::SeqCst);
    ON.store(true, Ordering::SeqCst);
}

/// Switch counting off and give the allocations since [`start`].
pub fn stop() -> usize {
    ON.store(false, Ordering::SeqCst);
    COUNT.load(Ordering::SeqCst)
}

/// Run `f` and give how many allocations happened (process-wide) meanwhile.
pub fn counted<R>(f: impl FnOnce() -> R) -> (R, usize) {
    start();
    let r = f();
    (r, stop())
}

/// Run `f` and give the largest single allocation (or reallocation), in bytes, that
/// happened (process-wide) meanwhile.
pub fn largest<R>(f: impl FnOnce() -> R) -> (R, usize) {
    start();
    let r = f();
    ON.store(false, Ordering::SeqCst);
    (r, LARGEST.load(Ordering::SeqCst))
}

/// Allocations seen by [`counted_by_thread`].
#[derive(Clone, Copy, Debug)]
pub struct ThreadCounts {
    /// On the measuring thread and threads named with one of the given prefixes.
    pub own: usize,
    /// On any other thread.
    pub elsewhere: usize,
}

/// Run `f` on this thread and count the allocations meanwhile, split into this thread
/// plus threads whose name starts with one of `own_prefixes` (e.g. a backend's workers)
/// and all others. The prefixes are fixed by the first call in a process.
pub fn counted_by_thread<R>(
    own_prefixes: &'static [&'static str],
    f: impl FnOnce() -> R,
) -> (R, ThreadCounts) {
    let _ = OWN_PREFIXES.set(own_prefixes);
    MEASURING.with(|m| m.set(true));
    let (r, all) = counted(f);
    MEASURING.with(|m| m.set(false));
    let own = OWN.load(Ordering::SeqCst);
    (
        r,
        ThreadCounts {
            own,
            elsewhere: all.saturating_sub(own),
        },
    )
}
