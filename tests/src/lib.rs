//! Shared helpers of Ferry's integration tests: test buffers, a deterministic RNG, and
//! two-agent set-ups on the loopback backend.
// Reason: tests register their own buffers, which is the caller-side promise that
// `Agent::register` asks for (an `unsafe fn`); no other unsafe code lives here.
#![allow(unsafe_code)]

use ferry::{Agent, AgentConfig, Desc, MemKind, Params, PeerId, RegionId};
use std::sync::atomic::{AtomicU64, Ordering};

/// A small deterministic xorshift generator (tests must be reproducible).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator (seed 0 is remapped).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// Shuffle a slice in place.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
    /// Fill bytes.
    pub fn fill(&mut self, bytes: &mut [u8]) {
        for b in bytes {
            *b = self.next_u64() as u8;
        }
    }
}

/// A unique agent name for this process (tests run in parallel threads).
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{prefix}-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// A heap buffer whose bytes a test reads only while no transfer is in flight.
pub struct Buffer {
    bytes: Box<[u8]>,
}

impl Buffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Buffer {
        Buffer {
            bytes: vec![0u8; len].into_boxed_slice(),
        }
    }
    /// `len` random bytes.
    pub fn random(len: usize, rng: &mut Rng) -> Buffer {
        let mut b = Buffer::zeroed(len);
        rng.fill(&mut b.bytes);
        b
    }
    /// Descriptor of `len` bytes at `offset`.
    pub fn desc(&self, offset: usize, len: usize) -> Desc {
        assert!(offset + len <= self.bytes.len());
        Desc::new(self.bytes.as_ptr() as u64 + offset as u64, len as u64, 0)
    }
    /// Descriptor of the whole buffer.
    pub fn whole(&self) -> Desc {
        self.desc(0, self.bytes.len())
    }
    /// The bytes (read them only when no transfer touching them is in flight).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// The bytes, mutably (same rule).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// An agent with a loopback backend.
pub fn loopback_agent(prefix: &str) -> Agent {
    let agent = Agent::new(AgentConfig::named(unique(prefix))).expect("agent");
    agent
        .create_backend("LOOPBACK", &Params::new())
        .expect("loopback backend");
    agent
}

/// Register a test buffer as DRAM.
pub fn register(agent: &Agent, buffer: &Buffer) -> RegionId {
    // SAFETY: test buffers outlive the agents that register them in every test, and
    // tests read them only after the transfers touching them completed.
    unsafe { agent.register(MemKind::Dram, buffer.whole()) }.expect("register")
}

/// Two loopback agents, each knowing the other's metadata.
pub struct Pair {
    /// The initiator.
    pub a: Agent,
    /// The target.
    pub b: Agent,
    /// `b` as seen by `a`.
    pub b_at_a: PeerId,
    /// `a` as seen by `b`.
    pub a_at_b: PeerId,
}

/// Register `a_buf` at a new agent A and `b_buf` at B, then exchange metadata by side
/// channel (the blobs are just bytes handed over).
pub fn pair(a_buf: &Buffer, b_buf: &Buffer) -> Pair {
    let a = loopback_agent("a");
    let b = loopback_agent("b");
    register(&a, a_buf);
    register(&b, b_buf);
    let b_at_a = a
        .load_remote_md(&b.local_md().expect("md b"))
        .expect("load b");
    let a_at_b = b
        .load_remote_md(&a.local_md().expect("md a"))
        .expect("load a");
    Pair {
        a,
        b,
        b_at_a,
        a_at_b,
    }
}

/// Register an arbitrary descriptor and give the result (for tests of refusals).
///
/// Only call it with descriptors inside live test buffers, or ones the agent must refuse.
pub fn try_register(agent: &Agent, kind: MemKind, desc: Desc) -> ferry::Result<RegionId> {
    // SAFETY: callers pass ranges inside buffers that outlive the agent, or ranges the
    // agent refuses before any backend touches them.
    unsafe { agent.register(kind, desc) }
}

/// A global allocator that counts allocations while counting is switched on; the
/// no-allocation tests install it with `#[global_allocator]`.
pub mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// Forwards to the system allocator, counting `alloc`/`realloc` calls while on.
    pub struct CountingAlloc;

    static ON: AtomicBool = AtomicBool::new(false);
    static COUNT: AtomicUsize = AtomicUsize::new(0);
    static LARGEST: AtomicUsize = AtomicUsize::new(0);

    // SAFETY: every method forwards to the system allocator with the caller's
    // arguments unchanged; counting has no effect on the memory handed out.
    unsafe impl GlobalAlloc for CountingAlloc {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            if ON.load(Ordering::Relaxed) {
                COUNT.fetch_add(1, Ordering::Relaxed);
                LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
            }
            // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract for us.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: `ptr` came from `System` through this allocator with `layout`.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            if ON.load(Ordering::Relaxed) {
                COUNT.fetch_add(1, Ordering::Relaxed);
                LARGEST.fetch_max(new_size, Ordering::Relaxed);
            }
            // SAFETY: `ptr` came from `System` through this allocator with `layout`.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    /// Run `f` and give how many allocations happened (process-wide) meanwhile.
    pub fn counted<R>(f: impl FnOnce() -> R) -> (R, usize) {
        COUNT.store(0, Ordering::SeqCst);
        ON.store(true, Ordering::SeqCst);
        let r = f();
        ON.store(false, Ordering::SeqCst);
        (r, COUNT.load(Ordering::SeqCst))
    }

    /// Run `f` and give the largest single allocation (or reallocation), in bytes,
    /// that happened (process-wide) meanwhile.
    pub fn largest<R>(f: impl FnOnce() -> R) -> (R, usize) {
        LARGEST.store(0, Ordering::SeqCst);
        ON.store(true, Ordering::SeqCst);
        let r = f();
        ON.store(false, Ordering::SeqCst);
        (r, LARGEST.load(Ordering::SeqCst))
    }
}

/// `n` blocks of `block` bytes: block `i` of `src` goes to block `order[i]` of `dst`, with
/// `order` a random permutation. Returns (local descriptors, remote descriptors, order).
pub fn shuffled_blocks(
    src: &Buffer,
    dst: &Buffer,
    n: usize,
    block: usize,
    rng: &mut Rng,
) -> (Vec<Desc>, Vec<Desc>, Vec<usize>) {
    let mut order: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut order);
    let local = (0..n).map(|i| src.desc(i * block, block)).collect();
    let remote = order.iter().map(|&j| dst.desc(j * block, block)).collect();
    (local, remote, order)
}

/// Assert that block `i` of `src` landed at block `order[i]` of `dst`.
pub fn assert_shuffled_copy(src: &Buffer, dst: &Buffer, order: &[usize], block: usize, what: &str) {
    for (i, &j) in order.iter().enumerate() {
        assert_eq!(
            &dst.bytes()[j * block..(j + 1) * block],
            &src.bytes()[i * block..(i + 1) * block],
            "{what}: block {i}"
        );
    }
}

impl Pair {
    /// A one-shot DRAM request at A: `local` (A's memory) ↔ `remote` (B's memory).
    pub fn create(
        &self,
        op: ferry::Op,
        local: &[Desc],
        remote: &[Desc],
        notif: Option<&[u8]>,
    ) -> ferry::XferId {
        self.a
            .create(
                op,
                MemKind::Dram,
                local,
                self.b_at_a,
                MemKind::Dram,
                remote,
                notif,
            )
            .expect("create request")
    }
}
