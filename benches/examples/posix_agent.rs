//! POSIX file I/O through the Agent, as a command with the same arguments and output
//! line as `ferry-posix`'s `posix_bench` example (which drives the backend directly):
//! `backends/posix/bench/fio-compare.sh` runs this one beside fio by default.
//!
//! ```text
//! cargo run --release -p ferry-benches --example posix_agent -- \
//!     --file /tmp/ferry-bench.bin --size-mib 1024 --block-kib 1024 --batch 32 \
//!     --op read --direct --engine uring --no-huge-pages --reps 5
//! ```
//!
//! One request per `batch` blocks, all made before timing; each repetition posts every
//! request in one flush and checks them oldest first until all are done. The POSIX
//! backend's queue depth is the batch (`fio --iodepth=<batch>`). Within a request the
//! memory blocks are laid out in the opposite order of their file blocks, so the
//! engine cannot merge them: every I/O is one block, as fio's are. Before each
//! repetition the file's page cache is flushed and dropped (as fio's `invalidate=1`).
//! Memory is one block per file block unless `--mem-blocks N` (a multiple of the batch)
//! makes the requests cycle through N blocks: `--mem-blocks <batch>` is fio's footprint
//! (iodepth × bs buffers, reused). A WRITE's memory is written before it is registered,
//! a READ's is not (fio fills its buffers for write jobs only).
//! Prints `ferry-agent-posix <op> <buffered|direct> bs=<KiB>KiB batch=<n> engine=<e>
//! huge_pages=<bool> mem_blocks=<n> median_gbps=<x> reps=<a,b,c>`.

// Reason: the benchmark registers its own buffer (`Agent::register` is an `unsafe fn`)
// and allocates it aligned; each block says why it is sound.
#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use ferry::{
    Agent, AgentConfig, CommandBuffer, Desc, FileMode, MemKind, Op, Params, Side, XferStatus,
};

struct Config {
    path: PathBuf,
    total: u64,
    block: u64,
    batch: u64,
    op: Op,
    direct: bool,
    engine: String,
    register: bool,
    huge_pages: bool,
    reps: usize,
    /// Memory blocks the requests cycle through (default: one per file block).
    mem_blocks: Option<u64>,
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: posix_agent --file PATH [--size-mib N] [--block-kib N] [--batch N] \
         [--op read|write] [--direct] [--engine uring|threads|auto] [--no-register] \
         [--no-huge-pages] [--reps N] [--mem-blocks N]"
    );
    ExitCode::from(2)
}

fn parse() -> Option<Config> {
    let mut cfg = Config {
        path: std::env::temp_dir().join("ferry-posix-bench.bin"),
        total: 1 << 30,
        block: 1 << 20,
        batch: 32,
        op: Op::Read,
        direct: false,
        engine: "uring".into(),
        register: true,
        huge_pages: true,
        reps: 5,
        mem_blocks: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = || args.next().and_then(|s| s.parse::<u64>().ok());
        match arg.as_str() {
            "--file" => cfg.path = args.next()?.into(),
            "--size-mib" => cfg.total = number()? << 20,
            "--block-kib" => cfg.block = number()? << 10,
            "--batch" => cfg.batch = number()?,
            "--reps" => cfg.reps = number()? as usize,
            "--mem-blocks" => cfg.mem_blocks = Some(number()?),
            "--op" => {
                cfg.op = match args.next()?.as_str() {
                    "read" => Op::Read,
                    "write" => Op::Write,
                    _ => return None,
                }
            }
            "--engine" => cfg.engine = args.next()?,
            "--direct" => cfg.direct = true,
            "--no-register" => cfg.register = false,
            "--no-huge-pages" => cfg.huge_pages = false,
            _ => return None,
        }
    }
    let sane = cfg.block > 0
        && cfg.total.is_multiple_of(cfg.block)
        && cfg.batch > 0
        && (cfg.total / cfg.block).is_multiple_of(cfg.batch)
        && cfg.reps > 0
        && cfg
            .mem_blocks
            .is_none_or(|m| m > 0 && m.is_multiple_of(cfg.batch) && m <= cfg.total / cfg.block);
    sane.then_some(cfg)
}

/// 2 MiB-aligned heap memory, freed on drop.
struct Aligned {
    ptr: *mut u8,
    layout: Layout,
}

impl Aligned {
    /// `fill`: write every byte first (a WRITE's source). A READ's destination is left
    /// untouched, as fio leaves its buffers for read jobs: its pages are then faulted in
    /// by the POSIX backend's registration (io_uring fixed buffers pin them), which on
    /// the development VM gave O_DIRECT reads of 1 MiB on 4 KiB pages 1.4-2.4x the rate
    /// of memory written first (`backends/posix/bench/RESULTS.md`, 2026-12-07).
    fn new(len: usize, huge_pages: bool, fill: bool) -> Result<Aligned, String> {
        let layout = Layout::from_size_align(len.max(1), 2 << 20).map_err(|e| e.to_string())?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(format!("cannot allocate {len} bytes"));
        }
        // SAFETY: advisory calls on memory we own; then, for a WRITE, every byte is
        // written, which also faults the pages in before timing.
        unsafe {
            let advice = if huge_pages {
                libc::MADV_HUGEPAGE
            } else {
                libc::MADV_NOHUGEPAGE
            };
            libc::madvise(ptr.cast(), len, advice);
            if fill {
                std::ptr::write_bytes(ptr, 0xa5, len);
            }
        }
        Ok(Aligned { ptr, layout })
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { alloc::dealloc(self.ptr, self.layout) }
    }
}

fn invalidate(path: &std::path::Path) -> Result<(), String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    file.sync_all().map_err(|e| format!("fsync: {e}"))?;
    // SAFETY: advisory call on a descriptor we own.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

fn run(cfg: &Config) -> Result<Vec<f64>, String> {
    let blocks = cfg.total / cfg.block;
    let requests = blocks / cfg.batch;
    // The file at full size with real blocks (as fio lays it out).
    {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&cfg.path)
            .map_err(|e| format!("{}: {e}", cfg.path.display()))?;
        if file.metadata().map(|m| m.len()).unwrap_or(0) < cfg.total {
            let chunk = vec![0x5au8; 1 << 20];
            let mut off = 0;
            while off < cfg.total {
                let n = (cfg.total - off).min(chunk.len() as u64) as usize;
                file.write_all_at(&chunk[..n], off)
                    .map_err(|e| e.to_string())?;
                off += n as u64;
            }
        }
    }
    let mem_blocks = cfg.mem_blocks.unwrap_or(blocks);
    let mem_len = mem_blocks * cfg.block;
    let mem = Aligned::new(mem_len as usize, cfg.huge_pages, cfg.op == Op::Write)?;
    let agent = Agent::new(AgentConfig::named("posix-agent-bench")).map_err(|e| e.to_string())?;
    let mut params = Params::new();
    let flag = if cfg.register { "true" } else { "false" };
    for (k, v) in [
        ("engine", cfg.engine.clone()),
        ("queue_depth", cfg.batch.to_string()),
        ("max_ops", blocks.to_string()),
        ("max_requests", requests.to_string()),
        ("register_buffers", flag.into()),
        ("register_files", flag.into()),
        // fio's default fadvise_hint=1 gives sequential jobs POSIX_FADV_SEQUENTIAL.
        ("access_hint", "sequential".into()),
    ] {
        params.insert(k.into(), v);
    }
    agent
        .create_backend("POSIX", &params)
        .map_err(|e| format!("POSIX backend: {e}"))?;
    // SAFETY: `mem` is declared before `agent` and outlives it; it is touched only by
    // the requests, each waited for before the next repetition.
    unsafe { agent.register(MemKind::Dram, Desc::new(mem.ptr as u64, mem_len, 0)) }
        .map_err(|e| e.to_string())?;
    let mode = FileMode {
        write: true,
        direct: cfg.direct,
        ..FileMode::default()
    };
    agent
        .register_file(&cfg.path, mode, Desc::new(0, 0, 1))
        .map_err(|e| e.to_string())?;
    let mut cmds = CommandBuffer::with_capacity(4 * requests as usize);
    let mut tickets = Vec::with_capacity(requests as usize);
    for r in 0..requests {
        let first = r * cfg.batch;
        let local: Vec<Desc> = (0..cfg.batch)
            .map(|j| {
                Desc::new(
                    mem.ptr as u64 + ((first + cfg.batch - 1 - j) % mem_blocks) * cfg.block,
                    cfg.block,
                    0,
                )
            })
            .collect();
        let file: Vec<Desc> = (0..cfg.batch)
            .map(|j| Desc::new((first + j) * cfg.block, cfg.block, 1))
            .collect();
        let l = cmds.prep(Side::Local, MemKind::Dram, &local);
        let f = cmds.prep(Side::Local, MemKind::File, &file);
        tickets.push(cmds.make(cfg.op, l, &[], f, &[]).ticket());
    }
    agent.flush(&mut cmds);
    if let Some((i, e)) = cmds.errors().next() {
        return Err(format!("set-up command #{i}: {e}"));
    }
    let xfers = tickets
        .iter()
        .map(|&t| cmds.created(t).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut posts = CommandBuffer::with_capacity(xfers.len());
    let mut gbps = Vec::with_capacity(cfg.reps);
    for _ in 0..cfg.reps {
        invalidate(&cfg.path)?;
        posts.clear();
        let start = Instant::now();
        for &x in &xfers {
            posts.post(x);
        }
        agent.flush(&mut posts);
        if let Some((i, e)) = posts.errors().next() {
            return Err(format!("post #{i}: {e}"));
        }
        for &x in &xfers {
            loop {
                match agent.check(x).map_err(|e| e.to_string())? {
                    XferStatus::Done => break,
                    XferStatus::InProgress => {}
                    other => return Err(format!("a request ended as {other:?}")),
                }
            }
        }
        gbps.push(cfg.total as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    for x in xfers {
        agent.release(x).map_err(|e| e.to_string())?;
    }
    drop(agent);
    Ok(gbps)
}

fn main() -> ExitCode {
    let Some(cfg) = parse() else { return usage() };
    match run(&cfg) {
        Ok(gbps) => {
            let mut sorted = gbps.clone();
            sorted.sort_by(f64::total_cmp);
            let n = sorted.len();
            let median = if n % 2 == 1 {
                sorted[n / 2]
            } else {
                (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
            };
            let reps: Vec<String> = gbps.iter().map(|g| format!("{g:.3}")).collect();
            println!(
                "ferry-agent-posix {} {} bs={}KiB batch={} engine={} huge_pages={} mem_blocks={} median_gbps={median:.3} reps={}",
                if cfg.op == Op::Read { "read" } else { "write" },
                if cfg.direct { "direct" } else { "buffered" },
                cfg.block >> 10,
                cfg.batch,
                cfg.engine,
                cfg.huge_pages,
                cfg.mem_blocks.unwrap_or(cfg.total / cfg.block),
                reps.join(",")
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("posix_agent: {e}");
            ExitCode::FAILURE
        }
    }
}
