//! KV-cache offload to a file and back through the POSIX backend (io_uring, or its
//! `pread`/`pwrite` pool where io_uring is unavailable).
//!
//! ```sh
//! cargo run -p ferry --example kv_offload [-- DIR]   # default: the temp dir
//! ```
//!
//! A request that goes idle (a paused conversation) has its KV blocks evicted from
//! the DRAM pool to a file: one WRITE of every layer × block of the request, the
//! blocks scattered in the pool, packed contiguously at the request's slot in the
//! file. The pool blocks are then reused (zeroed here). When the request resumes, one
//! READ brings the blocks back into *other* free pool blocks, and every byte is
//! checked. The lists are prepared once (pool and file), requests are made from
//! indices, and the command buffer is flushed in a loop until both are done.

mod common;

use std::process::ExitCode;
use std::time::Instant;

use common::{KvPool, KvShape, PREFILL_SEED};
use ferry::{
    Agent, AgentConfig, CommandBuffer, Desc, FileMode, MemKind, Op, Params, Side, XferStatus,
};

const SHAPE: KvShape = KvShape {
    layers: 16,
    blocks: 128,
    block_bytes: 32 << 10,
};
/// Blocks of the request that goes idle (in every layer).
const REQUEST_BLOCKS: u32 = 24;
/// The file's "device" number: FILE descriptors name their region by it.
const FILE_DEV: u64 = 1;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv_offload: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let dir = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let path = dir.join(format!("ferry-kv-offload-{}.bin", std::process::id()));
    // Removed at the end, also on failure.
    struct Remove<'a>(&'a std::path::Path);
    impl Drop for Remove<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0);
        }
    }
    let _remove = Remove(&path);

    let mut pool = KvPool::new(SHAPE);
    pool.fill(PREFILL_SEED);
    let agent = Agent::new(AgentConfig::named("offload-0")).map_err(|e| e.to_string())?;
    agent
        .create_backend("POSIX", &Params::new())
        .map_err(|e| format!("creating POSIX: {e}"))?;
    pool.register(&agent)
        .map_err(|e| format!("register: {e}"))?;
    let mode = FileMode {
        write: true,
        create: true,
        ..FileMode::default()
    };
    agent
        .register_file(&path, mode, Desc::new(0, 0, FILE_DEV))
        .map_err(|e| format!("{}: {e}", path.display()))?;

    // Prepared once: every pool block (layer-major), and file slots for one request.
    let n = SHAPE.layers * REQUEST_BLOCKS;
    let pool_list: Vec<Desc> = (0..SHAPE.layers)
        .flat_map(|l| (0..SHAPE.blocks).map(move |b| (l, b)))
        .map(|(l, b)| pool.block(l, b))
        .collect();
    let file_list: Vec<Desc> = (0..u64::from(n))
        .map(|i| Desc::new(i * SHAPE.block_bytes, SHAPE.block_bytes, FILE_DEV))
        .collect();
    let pool_prep = agent
        .prep(Side::Local, MemKind::Dram, &pool_list)
        .map_err(|e| format!("prep pool: {e}"))?;
    let file_prep = agent
        .prep(Side::Local, MemKind::File, &file_list)
        .map_err(|e| format!("prep file: {e}"))?;

    // The idle request's blocks: scattered in the pool.
    let blocks = common::shuffled(SHAPE.blocks, 7)[..REQUEST_BLOCKS as usize].to_vec();
    let pool_idx = |blocks: &[u32]| -> Vec<u32> {
        (0..SHAPE.layers)
            .flat_map(|l| blocks.iter().map(move |&b| l * SHAPE.blocks + b))
            .collect()
    };
    let file_idx: Vec<u32> = (0..n).collect();

    let started = Instant::now();
    move_blocks(
        &agent,
        Op::Write,
        pool_prep,
        &pool_idx(&blocks),
        file_prep,
        &file_idx,
    )?;
    let evicted = started.elapsed();
    // The pool blocks go to other requests (zeroed here, so the check below means
    // something).
    for l in 0..SHAPE.layers {
        for &b in &blocks {
            let at = SHAPE.offset(l, b) as usize;
            pool.bytes_mut()[at..at + SHAPE.block_bytes as usize].fill(0);
        }
    }
    // Resume: back into blocks the allocator hands out now (other ones).
    let back: Vec<u32> = common::shuffled(SHAPE.blocks, 99)
        .into_iter()
        .filter(|b| !blocks.contains(b))
        .take(REQUEST_BLOCKS as usize)
        .collect();
    let started = Instant::now();
    move_blocks(
        &agent,
        Op::Read,
        pool_prep,
        &pool_idx(&back),
        file_prep,
        &file_idx,
    )?;
    let restored = started.elapsed();
    for l in 0..SHAPE.layers {
        for (&now, &was) in back.iter().zip(&blocks) {
            if !pool.holds(PREFILL_SEED, l, now, was) {
                return Err(format!(
                    "layer {l}: block {was} came back wrong (into {now})"
                ));
            }
        }
    }
    let bytes = u64::from(n) * SHAPE.block_bytes;
    println!(
        "offloaded {n} blocks ({} layers × {REQUEST_BLOCKS} of {} KiB, {:.1} MB) to {} in {:.2} ms and read them back in {:.2} ms; every byte checked",
        SHAPE.layers,
        SHAPE.block_bytes >> 10,
        bytes as f64 / 1e6,
        path.display(),
        evicted.as_secs_f64() * 1e3,
        restored.as_secs_f64() * 1e3,
    );
    drop(agent); // before the pool it registered
    Ok(())
}

/// One request `op` between pool blocks and file slots, flushed until done.
fn move_blocks(
    agent: &Agent,
    op: Op,
    pool: ferry::PrepId,
    pool_idx: &[u32],
    file: ferry::PrepId,
    file_idx: &[u32],
) -> Result<(), String> {
    let mut cmds = CommandBuffer::with_capacity(8);
    let x = cmds.make(op, pool, pool_idx, file, file_idx).ticket();
    let posted = cmds.post(x);
    agent.flush(&mut cmds);
    if let Some((i, e)) = cmds.errors().next() {
        return Err(format!("{op:?}: command {i}: {e}"));
    }
    let x = cmds.created(x).map_err(|e| e.to_string())?;
    let mut status = cmds.status(posted).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + common::TIMEOUT;
    while status != XferStatus::Done {
        if Instant::now() > deadline {
            return Err(format!("{op:?} not done after {:?}", common::TIMEOUT));
        }
        // The loop a scheduler would run: record a check, flush, read it.
        cmds.clear();
        let check = cmds.check(x);
        agent.flush(&mut cmds);
        status = cmds.status(check).map_err(|e| format!("{op:?}: {e}"))?;
    }
    agent.release(x).map_err(|e| e.to_string())
}
