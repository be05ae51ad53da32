//! Shared helpers of Ferry's integration tests: test buffers and two-agent set-ups on
//! the loopback backend; the RNG and the counting allocator come from `ferry-testkit`.
// Reason: tests register their own buffers, which is the caller-side promise that
// `Agent::register` asks for (an `unsafe fn`); no other unsafe code lives here.
#![allow(unsafe_code)]

use ferry::{Agent, AgentConfig, Desc, MemKind, Params, PeerId, RegionId};
use std::sync::atomic::{AtomicU64, Ordering};

pub use ferry_testkit::Rng;

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

/// Each agent loads the other's metadata (by side channel: the blobs are just bytes
/// handed over). Returns (`b` as seen by `a`, `a` as seen by `b`).
pub fn exchange_md(a: &Agent, b: &Agent) -> (PeerId, PeerId) {
    let b_at_a = a
        .load_remote_md(&b.local_md().expect("md b"))
        .expect("load b");
    let a_at_b = b
        .load_remote_md(&a.local_md().expect("md a"))
        .expect("load a");
    (b_at_a, a_at_b)
}

/// Register `a_buf` at a new agent A and `b_buf` at B, then exchange metadata by side
/// channel (the blobs are just bytes handed over).
pub fn pair(a_buf: &Buffer, b_buf: &Buffer) -> Pair {
    let a = loopback_agent("a");
    let b = loopback_agent("b");
    register(&a, a_buf);
    register(&b, b_buf);
    let (b_at_a, a_at_b) = exchange_md(&a, &b);
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

/// The counting global allocator of the no-allocation tests (`ferry_testkit::alloc`).
pub use ferry_testkit::alloc as counting;

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

/// One DRAM WRITE from `agent`'s `local` into `remote` of `side`, created, posted once
/// and released: the status `post` gave (a backend that copies inside `post` is done
/// then), or why create or post refused it.
pub fn write_once(
    agent: &Agent,
    local: Desc,
    side: impl Into<ferry::Side>,
    remote: Desc,
    notif: Option<&[u8]>,
) -> ferry::Result<ferry::XferStatus> {
    let x = agent.create(
        ferry::Op::Write,
        MemKind::Dram,
        &[local],
        side,
        MemKind::Dram,
        &[remote],
        notif,
    )?;
    let status = agent.post(x);
    agent.release(x).expect("release a request after its post");
    status
}

/// One DRAM WRITE of `local[i]` → `remote[i]` from `agent` to `peer`: created,
/// posted, checked until done (at most 30 s) and released. Panics on any error or on
/// the deadline. Allocates nothing of its own, so no-allocation tests can count it.
pub fn write_and_wait(agent: &Agent, peer: PeerId, local: &[Desc], remote: &[Desc]) {
    transfer_and_wait(agent, ferry::Op::Write, peer, local, remote)
}

/// [`write_and_wait`] for either operation (a READ fills `local[i]` from `remote[i]`).
pub fn transfer_and_wait(
    agent: &Agent,
    op: ferry::Op,
    peer: PeerId,
    local: &[Desc],
    remote: &[Desc],
) {
    let x = agent
        .create(op, MemKind::Dram, local, peer, MemKind::Dram, remote, None)
        .expect("create");
    post_and_wait(agent, x);
    agent.release(x).expect("release");
}

/// Post request `x` and check it until it is done (at most 30 s; panics on an error
/// or on the deadline). Allocates nothing of its own.
pub fn post_and_wait(agent: &Agent, x: ferry::XferId) {
    use ferry::XferStatus;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut status = agent.post(x).expect("post");
    while status != XferStatus::Done {
        assert!(
            std::time::Instant::now() < deadline,
            "a request did not complete in 30 s"
        );
        status = agent.check(x).expect("check");
    }
}

/// One KV cache's layers as strided runs, as the strided benchmarks use them: `layers`
/// layers of `blocks` blocks of `block` bytes, side by side in `src` (local runs, in
/// layer order) and `2 × block` apart in `dst` (remote runs, layers in shuffled order).
pub fn kv_layer_runs(
    src: &Buffer,
    dst: &Buffer,
    (layers, blocks, block): (u64, u64, u64),
    rng: &mut Rng,
) -> (Vec<ferry::StridedDesc>, Vec<ferry::StridedDesc>) {
    let mut order: Vec<u64> = (0..layers).collect();
    rng.shuffle(&mut order);
    let local = (0..layers)
        .map(|l| {
            ferry::StridedDesc::new(
                src.whole().addr + l * blocks * block,
                blocks,
                block,
                block,
                0,
            )
        })
        .collect();
    let remote = order
        .iter()
        .map(|&l| {
            let base = dst.whole().addr + l * blocks * 2 * block;
            ferry::StridedDesc::new(base, blocks, 2 * block, block, 0)
        })
        .collect();
    (local, remote)
}
