//! A rerunnable throughput benchmark: move a file of `total_bytes` through the backend
//! in blocks of `block_bytes`, `batch` ranges per request, with the queue depth equal to
//! the batch (so it compares with `fio --iodepth=<batch>`), and report GB/s per
//! repetition and the median.
//!
//! Like fio's default (`invalidate=1`), the file's page cache is flushed and dropped
//! (`fsync` + `posix_fadvise(DONTNEED)`) before each repetition, so buffered reads come
//! from the device rather than from memory.

use std::alloc::{self, Layout};
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferry_backend_api::{
    effective_params, Backend, Completions, Desc, Endpoint, Error, FileMode, MemKind, Op, Params,
    Post, Range, RegionSpec, Result, Subject,
};

use crate::{PosixBackend, NAME, PARAMS};

/// One benchmark configuration.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// The scratch file (created or overwritten; left in place for the next run).
    pub path: PathBuf,
    /// Bytes moved per repetition.
    pub total_bytes: u64,
    /// Bytes per range.
    pub block_bytes: u64,
    /// Ranges per request, and the queue depth.
    pub batch: u32,
    /// READ (file → memory) or WRITE (memory → file).
    pub op: Op,
    /// Open the file with O_DIRECT.
    pub direct: bool,
    /// Engine parameter (`uring`, `threads`, `auto`).
    pub engine: String,
    /// Register the memory as an io_uring fixed buffer and the file as a fixed file.
    pub register: bool,
    /// Repetitions (the median is reported).
    pub reps: u32,
    /// Ask for transparent huge pages for the memory (`madvise(MADV_HUGEPAGE)`).
    pub huge_pages: bool,
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct BenchResult {
    /// GB/s (10^9 bytes per second) of each repetition, in run order.
    pub gbps: Vec<f64>,
    /// Median of `gbps`.
    pub median_gbps: f64,
    /// Whether the memory went through an io_uring fixed buffer.
    pub fixed_buffer: bool,
}

/// Alignment of the benchmark buffer (a transparent huge page).
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Huge-page-aligned heap memory, freed on drop.
struct AlignedMem {
    ptr: *mut u8,
    layout: Layout,
}

impl AlignedMem {
    fn new(len: usize, huge_pages: bool) -> Result<AlignedMem> {
        let layout = Layout::from_size_align(len.max(1), HUGE_PAGE_BYTES)
            .map_err(|e| Error::invalid(Subject::Named("benchmark size".into()), e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(Error::backend(NAME, format!("cannot allocate {len} bytes")));
        }
        if huge_pages {
            // Transparent huge pages make each block physically contiguous, so an
            // O_DIRECT block needs a few DMA segments instead of one per 4 KiB page
            // (virtio-blk allows 254): about twice the read throughput here. A KV-cache
            // pool would be allocated this way too. Advisory: ignored where THP is off.
            // SAFETY: advisory call on memory we own.
            unsafe { libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) };
        }
        // SAFETY: `ptr` is a fresh allocation of `len` bytes; writing every byte also
        // faults the pages in before timing starts.
        unsafe { std::ptr::write_bytes(ptr, 0xa5, len) };
        Ok(AlignedMem { ptr, layout })
    }
}

impl Drop for AlignedMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { alloc::dealloc(self.ptr, self.layout) }
    }
}

fn invalidate(path: &std::path::Path) -> Result<()> {
    let file = std::fs::File::open(path)
        .map_err(|e| Error::backend(NAME, format!("open {}: {e}", path.display())))?;
    file.sync_all()
        .map_err(|e| Error::backend(NAME, format!("fsync {}: {e}", path.display())))?;
    // SAFETY: advisory call on a descriptor we own; no memory is passed.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

/// Run one configuration.
pub fn run(cfg: &BenchConfig) -> Result<BenchResult> {
    let bad = |why: &'static str| Error::invalid(Subject::Named("benchmark config".into()), why);
    if cfg.block_bytes == 0 || !cfg.total_bytes.is_multiple_of(cfg.block_bytes) {
        return Err(bad(
            "total_bytes must be a non-zero multiple of block_bytes",
        ));
    }
    if cfg.batch == 0 || cfg.reps == 0 {
        return Err(bad("batch and reps must be at least 1"));
    }
    let blocks = cfg.total_bytes / cfg.block_bytes;
    let mem = AlignedMem::new(cfg.total_bytes as usize, cfg.huge_pages)?;

    // Lay the file out to full size with real blocks (as fio does), so writes
    // overwrite and reads find data.
    {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&cfg.path)
            .map_err(|e| Error::backend(NAME, format!("create {}: {e}", cfg.path.display())))?;
        let have = file.metadata().map(|m| m.len()).unwrap_or(0);
        if have < cfg.total_bytes {
            use std::os::unix::fs::FileExt;
            let chunk = vec![0x5au8; 1 << 20];
            let mut off = 0;
            while off < cfg.total_bytes {
                let n = (cfg.total_bytes - off).min(chunk.len() as u64) as usize;
                file.write_all_at(&chunk[..n], off)
                    .map_err(|e| Error::backend(NAME, format!("lay out file: {e}")))?;
                off += n as u64;
            }
        }
    }

    let mut given = Params::new();
    given.insert("engine".into(), cfg.engine.clone());
    given.insert("queue_depth".into(), cfg.batch.to_string());
    given.insert(
        "max_ops".into(),
        blocks.max(u64::from(cfg.batch)).to_string(),
    );
    given.insert(
        "max_requests".into(),
        blocks.div_ceil(u64::from(cfg.batch)).max(1).to_string(),
    );
    let flag = if cfg.register { "true" } else { "false" };
    given.insert("register_buffers".into(), flag.into());
    given.insert("register_files".into(), flag.into());
    // The pattern is sequential: give the kernel the same hint fio gives by default
    // (fadvise_hint=1 → POSIX_FADV_SEQUENTIAL for sequential jobs).
    given.insert("access_hint".into(), "sequential".into());
    let mut backend = PosixBackend::new(effective_params(NAME, PARAMS, &given)?)?;

    // SAFETY: `mem` is declared before `backend`, so it outlives every registration
    // (the backend is dropped first); it is deregistered below after the last request.
    let mem_token = unsafe {
        backend.register(&RegionSpec {
            kind: MemKind::Dram,
            desc: Desc::new(mem.ptr as u64, cfg.total_bytes, 0),
            path: None,
        })
    }?
    .token;
    let fixed_buffer = mem_token & crate::pool::PLAIN_DRAM == 0;
    // SAFETY: a FILE region by path: the backend opens and owns the file.
    let file_token = unsafe {
        backend.register(&RegionSpec {
            kind: MemKind::File,
            desc: Desc::new(0, 0, 0),
            path: Some((
                &cfg.path,
                FileMode {
                    write: true,
                    direct: cfg.direct,
                    ..FileMode::default()
                },
            )),
        })
    }?
    .token;

    let ranges: Vec<Range> = (0..blocks)
        .map(|i| Range {
            local_addr: mem.ptr as u64 + i * cfg.block_bytes,
            remote_addr: i * cfg.block_bytes,
            len: cfg.block_bytes,
            local_dev: 0,
            remote_dev: 0,
            local_token: mem_token,
            remote_token: file_token,
        })
        .collect();
    let posts: Vec<Post<'_>> = ranges
        .chunks(cfg.batch as usize)
        .enumerate()
        .map(|(i, chunk)| Post {
            tag: i as u64,
            op: cfg.op,
            local_kind: MemKind::Dram,
            remote_kind: MemKind::File,
            ranges: chunk,
            notif: None,
        })
        .collect();
    let mut done = Completions::with_capacity(posts.len());

    let mut gbps = Vec::with_capacity(cfg.reps as usize);
    for _ in 0..cfg.reps {
        invalidate(&cfg.path)?;
        done.clear();
        let start = Instant::now();
        // SAFETY: every range lies inside `mem` and the file region, both registered
        // above; the loop below waits for every completion before the next round, and
        // nothing else reads or writes `mem` meanwhile.
        unsafe { backend.post(Endpoint::Local, &posts, &mut done) }?;
        while done.len() < posts.len() {
            backend.wait(&mut done, Duration::from_millis(100))?;
        }
        let secs = start.elapsed().as_secs_f64();
        if let Some(failed) = done.as_slice().iter().find(|c| c.result.is_err()) {
            return Err(Error::backend(
                NAME,
                format!("benchmark request failed: {:?}", failed.result),
            ));
        }
        gbps.push(cfg.total_bytes as f64 / secs / 1e9);
    }
    // SAFETY: every request completed (waited for above).
    unsafe {
        backend.deregister(MemKind::File, file_token)?;
        backend.deregister(MemKind::Dram, mem_token)?;
    }
    drop(backend);

    let mut sorted = gbps.clone();
    sorted.sort_by(f64::total_cmp);
    let median_gbps = if sorted.len() % 2 == 1 {
        sorted[sorted.len() / 2]
    } else {
        (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2]) / 2.0
    };
    Ok(BenchResult {
        gbps,
        median_gbps,
        fixed_buffer,
    })
}
