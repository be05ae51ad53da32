//! What the examples share: a paged KV-cache pool, the decode side's scheduler loop and
//! the prefill side's serving loop, and a way to run one side in a child process.
//!
//! The shape is vLLM's disaggregated prefill/decode as NIXL users drive it: the
//! prefill engine computed KV blocks for a request; the decode engine READs them out
//! of prefill's pool into its own (one descriptor per layer × block, blocks scattered
//! in both pools) and attaches a notification, so prefill learns when it may free
//! them.
#![allow(dead_code)]
// Reason: the pool is memory that Ferry's backends read and write by address; the
// example registers it and reads it between transfers, each block saying why it holds.
#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::io::{Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{
    Agent, CommandBuffer, Desc, MemKind, Op, PeerId, PrepId, Side, Ticket, XferId, XferStatus,
};

/// Bound on every wait of the examples: a missing peer ends them with a message.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Geometry of a paged KV cache: `layers` × `blocks` blocks of `block_bytes` each.
#[derive(Clone, Copy, Debug)]
pub struct KvShape {
    /// Model layers (each has its own block array).
    pub layers: u32,
    /// Blocks per layer in the pool.
    pub blocks: u32,
    /// Bytes of one block of one layer (tokens per block × heads × head dim × 2 × dtype).
    pub block_bytes: u64,
}

impl KvShape {
    /// Bytes of the whole pool.
    pub fn pool_bytes(&self) -> u64 {
        u64::from(self.layers) * u64::from(self.blocks) * self.block_bytes
    }

    /// Offset of block `b` of layer `l` in the pool (layer-major).
    pub fn offset(&self, l: u32, b: u32) -> u64 {
        (u64::from(l) * u64::from(self.blocks) + u64::from(b)) * self.block_bytes
    }
}

/// Page-aligned, zeroed host memory for a KV pool. Ferry's backends read and write it
/// by address; Rust reads it only through [`KvPool::bytes`], between transfers.
pub struct KvPool {
    ptr: *mut u8,
    layout: Layout,
    /// The pool's geometry.
    pub shape: KvShape,
}

// SAFETY: the pool is plain memory; who touches it when is what the transfer
// protocol (post, wait for completion, then read) decides, not the thread.
unsafe impl Send for KvPool {}

impl KvPool {
    /// A zeroed pool of `shape`.
    pub fn new(shape: KvShape) -> KvPool {
        let layout = Layout::from_size_align(shape.pool_bytes() as usize, 4096).expect("pool size");
        // SAFETY: the layout has a non-zero size (checked by the caller's shape).
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(
            !ptr.is_null(),
            "out of memory for a {} B pool",
            layout.size()
        );
        KvPool { ptr, layout, shape }
    }

    /// The whole pool, for registration.
    pub fn desc(&self) -> Desc {
        Desc::new(self.ptr as u64, self.layout.size() as u64, 0)
    }

    /// Block `b` of layer `l`.
    pub fn block(&self, l: u32, b: u32) -> Desc {
        Desc::new(
            self.ptr as u64 + self.shape.offset(l, b),
            self.shape.block_bytes,
            0,
        )
    }

    /// Register the pool with every backend of `agent` that moves DRAM.
    pub fn register(&self, agent: &Agent) -> ferry::Result<ferry::RegionId> {
        // SAFETY: the pool outlives the agent's use of it (callers drop the agent
        // first) and Rust reads it only between transfers.
        unsafe { agent.register(MemKind::Dram, self.desc()) }
    }

    /// The pool's bytes. Call only while no transfer that writes the pool is in flight.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` holds `layout.size()` initialized (zeroed) bytes; the caller
        // guarantees no transfer writes them meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }

    /// Mutable bytes. Same rule as [`KvPool::bytes`].
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and `&mut self` makes this the only Rust access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }

    /// Fill every block with a pattern that names it (what "prefill computed" means here).
    pub fn fill(&mut self, seed: u8) {
        let shape = self.shape;
        for l in 0..shape.layers {
            for b in 0..shape.blocks {
                let at = shape.offset(l, b) as usize;
                let block = &mut self.bytes_mut()[at..at + shape.block_bytes as usize];
                for (i, x) in block.iter_mut().enumerate() {
                    *x = pattern(seed, l, b, i);
                }
            }
        }
    }

    /// Whether block `b` of layer `l` holds what [`KvPool::fill`] put in block `src`.
    pub fn holds(&self, seed: u8, l: u32, b: u32, src: u32) -> bool {
        let at = self.shape.offset(l, b) as usize;
        self.bytes()[at..at + self.shape.block_bytes as usize]
            .iter()
            .enumerate()
            .all(|(i, &x)| x == pattern(seed, l, src, i))
    }
}

impl Drop for KvPool {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

fn pattern(seed: u8, l: u32, b: u32, i: usize) -> u8 {
    seed ^ (l as u8).wrapping_mul(31) ^ (b as u8).wrapping_mul(7) ^ (i as u8)
}

/// A small deterministic shuffle (xorshift), so the examples need no RNG crate.
pub fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// One request of the decode loop: which prefill blocks go to which decode blocks.
struct Request {
    id: u32,
    /// Prefill's block numbers (the same in every layer).
    remote_blocks: Vec<u32>,
    /// Where they land in decode's pool.
    local_blocks: Vec<u32>,
    xfer: Option<XferId>,
    make: Option<Ticket<XferId>>,
}

/// What the decode loop moves.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// Requests in all.
    pub requests: u32,
    /// Blocks per request (in every layer).
    pub blocks_per_request: u32,
    /// Requests in flight at most.
    pub in_flight: usize,
}

/// What the decode loop did.
#[derive(Debug, Default)]
pub struct LoopStats {
    /// Turns of the loop.
    pub ticks: u64,
    /// Requests moved.
    pub requests: u32,
    /// Descriptors (layer × block) moved.
    pub descs: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Wall time of the loop.
    pub elapsed: Duration,
    /// The backend the requests went through.
    pub via: &'static str,
}

/// The decode side: READ `work.requests` requests of `work.blocks_per_request` blocks
/// (in every layer) from `peer`'s pool at `remote_base` into `pool`, at most
/// `work.in_flight` at once,
/// each notifying the peer `req-<id>` when its bytes have landed; verify each as it
/// completes. One command buffer, one flush per turn; lists prepared once. `on_tick`
/// is called at the start of every turn with the requests in flight (a profiler hook).
pub fn decode_loop(
    agent: &Agent,
    pool: &KvPool,
    peer: PeerId,
    remote_base: u64,
    work: Workload,
    on_tick: &mut dyn FnMut(usize),
) -> Result<LoopStats, String> {
    let Workload {
        requests,
        blocks_per_request,
        in_flight,
    } = work;
    let shape = pool.shape;
    // Prepared once: every block of every layer, on both sides; a request then names
    // blocks by index (layer-major: index = layer × blocks + block).
    let local_list: Vec<Desc> = (0..shape.layers)
        .flat_map(|l| (0..shape.blocks).map(move |b| (l, b)))
        .map(|(l, b)| pool.block(l, b))
        .collect();
    let remote_list: Vec<Desc> = (0..shape.layers)
        .flat_map(|l| (0..shape.blocks).map(move |b| (l, b)))
        .map(|(l, b)| Desc::new(remote_base + shape.offset(l, b), shape.block_bytes, 0))
        .collect();
    let local: PrepId = agent
        .prep(Side::Local, MemKind::Dram, &local_list)
        .map_err(|e| format!("prep local: {e}"))?;
    let remote: PrepId = agent
        .prep(peer, MemKind::Dram, &remote_list)
        .map_err(|e| format!("prep remote: {e}"))?;

    let mut cmds = CommandBuffer::with_capacity(1024);
    let mut queue: Vec<Request> = (0..requests)
        .map(|id| {
            // Paged: each request's blocks are scattered in both pools.
            let order = shuffled(shape.blocks, 0x9e37 + u64::from(id));
            let remote_blocks = order[..blocks_per_request as usize].to_vec();
            Request {
                id,
                remote_blocks,
                local_blocks: Vec::new(),
                xfer: None,
                make: None,
            }
        })
        .rev()
        .collect();
    let mut active: Vec<Request> = Vec::new();
    // Decode's block allocator: free blocks of its pool, in shuffled order.
    if in_flight * blocks_per_request as usize > shape.blocks as usize {
        return Err(format!(
            "{in_flight} requests of {blocks_per_request} blocks do not fit a pool of {} blocks",
            shape.blocks
        ));
    }
    let mut free = shuffled(shape.blocks, 0x51ed);
    let mut stats = LoopStats::default();
    let (mut local_idx, mut remote_idx) = (Vec::new(), Vec::new());
    let started = Instant::now();
    while !queue.is_empty() || !active.is_empty() {
        if started.elapsed() > TIMEOUT {
            return Err(format!(
                "{} requests still in flight after {TIMEOUT:?}",
                active.len()
            ));
        }
        stats.ticks += 1;
        on_tick(active.len());
        cmds.clear();
        // New work this turn: make and post (recording does no I/O).
        while active.len() < in_flight {
            let Some(mut r) = queue.pop() else { break };
            r.local_blocks = free.split_off(free.len() - r.remote_blocks.len());
            local_idx.clear();
            remote_idx.clear();
            for l in 0..shape.layers {
                for (&lb, &rb) in r.local_blocks.iter().zip(&r.remote_blocks) {
                    local_idx.push(l * shape.blocks + lb);
                    remote_idx.push(l * shape.blocks + rb);
                }
            }
            let tag = format!("req-{}", r.id);
            let x = cmds
                .make(Op::Read, local, &local_idx, remote, &remote_idx)
                .notify(tag.as_bytes())
                .ticket();
            cmds.post(x);
            r.make = Some(x);
            active.push(r);
        }
        // Older work: check every request already posted.
        let checks: Vec<(usize, Ticket<XferStatus>)> = active
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.xfer.map(|x| (i, cmds.check(x))))
            .collect();
        agent.flush(&mut cmds); // never blocks
        if let Some((i, e)) = cmds.errors().next() {
            return Err(format!("command {i} failed: {e}"));
        }
        // Requests made this turn get their handles.
        for r in active.iter_mut().filter(|r| r.xfer.is_none()) {
            let x = cmds
                .created(r.make.take().expect("made this turn"))
                .map_err(|e| format!("make req-{}: {e}", r.id))?;
            if stats.via.is_empty() {
                stats.via = agent.xfer_backend(x).unwrap_or("?");
            }
            r.xfer = Some(x);
        }
        // Finished requests: check the bytes, release, free the slot.
        let mut finished = Vec::new();
        for (i, t) in checks {
            if cmds.status(t).map_err(|e| format!("check: {e}"))? == XferStatus::Done {
                finished.push(i);
            }
        }
        for &i in finished.iter().rev() {
            let r = active.swap_remove(i);
            for l in 0..shape.layers {
                for (&lb, &rb) in r.local_blocks.iter().zip(&r.remote_blocks) {
                    if !pool.holds(PREFILL_SEED, l, lb, rb) {
                        return Err(format!(
                            "req-{}: layer {l} block {lb} has wrong bytes",
                            r.id
                        ));
                    }
                }
            }
            agent
                .release(r.xfer.expect("posted"))
                .map_err(|e| format!("release: {e}"))?;
            stats.requests += 1;
            let descs = u64::from(shape.layers) * r.local_blocks.len() as u64;
            stats.descs += descs;
            stats.bytes += descs * shape.block_bytes;
            // The model consumed the blocks: back to the allocator.
            free.extend(&r.local_blocks);
        }
    }
    stats.elapsed = started.elapsed();
    Ok(stats)
}

/// The pattern seed prefill fills its pool with.
pub const PREFILL_SEED: u8 = 0xa5;

/// The prefill side: progress and drain notifications until `req-0 .. req-<n-1>` have
/// all arrived (each says decode has the request's blocks and prefill may free them).
pub fn serve_until_notified(agent: &Agent, n: u32) -> Result<(), String> {
    let mut seen = vec![false; n as usize];
    let mut left = n;
    let mut cmds = CommandBuffer::with_capacity(4);
    let deadline = Instant::now() + TIMEOUT;
    while left > 0 {
        if Instant::now() > deadline {
            return Err(format!(
                "{left} of {n} notifications missing after {TIMEOUT:?}"
            ));
        }
        cmds.clear();
        cmds.drain_notifications();
        agent.flush(&mut cmds);
        for (from, payload) in cmds.notifications() {
            let id = std::str::from_utf8(payload)
                .ok()
                .and_then(|s| s.strip_prefix("req-"))
                .and_then(|s| s.parse::<usize>().ok())
                .filter(|&id| id < seen.len())
                .ok_or_else(|| format!("unexpected notification from {from}: {payload:?}"))?;
            if !std::mem::replace(&mut seen[id], true) {
                left -= 1;
            }
        }
        if cmds.notification_count() == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(())
}

/// Run this example's binary again as `role`, with `hello` on its stdin (length
/// first). The returned stdin stays open: dropping it tells the child to go
/// ([`linger_until_stdin_closes`]).
pub fn spawn_self(
    role: &str,
    hello: &[u8],
    env: &[(&str, String)],
) -> Result<(Child, ChildStdin), String> {
    let exe = std::env::current_exe().map_err(|e| format!("this binary: {e}"))?;
    let mut child = Command::new(exe)
        .arg(role)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawning the {role} process: {e}"))?;
    let mut stdin = child.stdin.take().expect("piped");
    stdin
        .write_all(&(hello.len() as u64).to_le_bytes())
        .and_then(|()| stdin.write_all(hello))
        .and_then(|()| stdin.flush())
        .map_err(|e| format!("writing to the {role} process: {e}"))?;
    Ok((child, stdin))
}

/// What [`spawn_self`] wrote (bounded at 64 MiB).
pub fn read_hello() -> Result<Vec<u8>, String> {
    let mut len = [0u8; 8];
    let mut stdin = std::io::stdin();
    stdin
        .read_exact(&mut len)
        .map_err(|e| format!("stdin: {e}"))?;
    let len = u64::from_le_bytes(len);
    if len > 64 << 20 {
        return Err(format!("a {len}-byte hello on stdin"));
    }
    let mut v = vec![0u8; len as usize];
    stdin
        .read_exact(&mut v)
        .map_err(|e| format!("stdin: {e}"))?;
    Ok(v)
}

/// Progress `agent` until the parent closes our stdin (bounded by [`TIMEOUT`]), so
/// that what the last flushes queued (notifications) goes out before we exit.
pub fn linger_until_stdin_closes(agent: &Agent) -> Result<(), String> {
    let closed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = closed.clone();
    std::thread::spawn(move || {
        let mut sink = [0u8; 64];
        while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let deadline = Instant::now() + TIMEOUT;
    while !closed.load(std::sync::atomic::Ordering::Relaxed) {
        if Instant::now() > deadline {
            return Err("the parent never closed our stdin".into());
        }
        agent.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Wait for `child` (bounded) and turn its exit status into a result.
pub fn wait_child(mut child: Child, role: &str) -> Result<(), String> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match child.try_wait().map_err(|e| e.to_string())? {
            Some(s) if s.success() => return Ok(()),
            Some(s) => return Err(format!("the {role} process failed ({s})")),
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("the {role} process did not finish in {TIMEOUT:?}"));
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// A one-line summary of a decode loop. Its time includes checking every byte as
/// requests finish (and, under `cargo run`, a debug build): a demonstration, not a
/// benchmark — `ferry bench kv` measures this loop.
pub fn summary(s: &LoopStats, shape: &KvShape) -> String {
    let secs = s.elapsed.as_secs_f64().max(1e-9);
    format!(
        "{} requests, {} descriptors of {} B ({} layers), {:.1} MB in {:.1} ms over {} ({} loop turns, byte checks included): {:.2} GB/s, {:.0} descriptors/s",
        s.requests,
        s.descs,
        shape.block_bytes,
        shape.layers,
        s.bytes as f64 / 1e6,
        secs * 1e3,
        s.via,
        s.ticks,
        s.bytes as f64 / secs / 1e9,
        s.descs as f64 / secs
    )
}
