//! Metadata of many UCX-registered regions, in one process with two agents: the size
//! of the blob `Agent::local_md` produces, the time to produce it (encode) and the
//! time a second agent takes to validate and load it (`Agent::load_remote_md`).
//!
//! The regions are `count` blocks of `region_bytes`, `stride` bytes apart, in one
//! anonymous `MAP_NORESERVE` mapping that is never touched (registration with UCX's
//! shared-memory and TCP memory domains does not pin), each registered with the UCX
//! backend on its own: real rkeys, as a KV cache of `count` blocks would publish.
//! `backends/ucx/bench/nixl_md.py` does the same through NIXL for the comparison.

use std::time::{Duration, Instant};

use ferry::{Agent, AgentConfig, Desc, MemKind, Params};

/// What one run measured.
#[derive(Clone, Debug)]
pub struct MdReport {
    /// Registered regions.
    pub regions: usize,
    /// Bytes of the metadata blob.
    pub bytes: usize,
    /// Median time of `local_md`, over every call (the first one included).
    pub encode: Duration,
    /// Median time of `load_remote_md` into a fresh agent (one that never saw the peer,
    /// its UCX workers made beforehand, untimed).
    pub load: Duration,
    /// Median time of loading the same blob again after `invalidate_remote_md` on one
    /// agent (what the backend kept from the first load is reused).
    pub reload: Duration,
    /// Timed iterations of each.
    pub iters: usize,
}

/// An untouched anonymous mapping, unmapped on drop.
struct Reserved {
    map: *mut libc::c_void,
    len: usize,
}

impl Reserved {
    fn new(len: usize) -> Result<Reserved, String> {
        // SAFETY: anonymous private mapping without an address hint; checked below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(format!(
                "mmap of {len} bytes: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Reserved { map, len })
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in new(); the agents that registered parts
        // of it are dropped before (see `run`).
        unsafe { libc::munmap(self.map, self.len) };
    }
}

/// Register `count` regions with a UCX backend made with `params`, then time
/// `local_md` and `load_remote_md` for at least `min_time` each.
pub fn run(
    count: usize,
    region_bytes: u64,
    stride: u64,
    params: &[(String, String)],
    min_time: Duration,
) -> Result<MdReport, String> {
    if region_bytes == 0 || stride < region_bytes {
        return Err(format!(
            "regions of {region_bytes} bytes need a stride of at least that (got {stride})"
        ));
    }
    let space = Reserved::new((count as u64 * stride) as usize)?;
    let backend_params: Params = params.iter().cloned().collect();
    let make = |name: &str| -> Result<Agent, String> {
        let agent = Agent::new(AgentConfig::named(name)).map_err(|e| e.to_string())?;
        agent
            .create_backend("UCX", &backend_params)
            .map_err(|e| e.to_string())?;
        Ok(agent)
    };
    let (a, b) = (make("md-bench-a")?, make("md-bench-b")?);
    for i in 0..count as u64 {
        let desc = Desc::new(space.map as u64 + i * stride, region_bytes, 0);
        // SAFETY: the range lies inside `space`, which outlives both agents (they are
        // dropped at the end of this function, before `space`); nothing reads it.
        unsafe { a.register(MemKind::Dram, desc) }.map_err(|e| e.to_string())?;
    }
    let time = |mut once: Box<dyn FnMut() -> Result<Duration, String> + '_>| {
        let mut times = Vec::new();
        let started = Instant::now();
        while times.len() < 5 || started.elapsed() < min_time {
            times.push(once()?);
        }
        times.sort_unstable();
        Ok::<_, String>((times[times.len() / 2], times.len()))
    };
    // Every call of `local_md` is timed, the first one too (whatever it builds and keeps
    // is part of what a caller pays); the first call's blob is the one loaded below.
    let mut first_blob = None;
    let (encode, encode_iters) = time(Box::new(|| {
        let start = Instant::now();
        let blob = a.local_md().map_err(|e| e.to_string())?;
        let took = start.elapsed();
        if first_blob.is_none() {
            first_blob = Some(blob);
        } else {
            std::hint::black_box(blob);
        }
        Ok(took)
    }))?;
    let blob = first_blob.ok_or("no local_md call was timed")?;
    // Each load into an agent that never saw this peer: loading, forgetting and loading
    // the same blob again lets the backend keep what it built the first time.
    let mut fresh_count = 0u32;
    let (load, load_iters) = time(Box::new(|| {
        fresh_count += 1;
        let fresh = make(&format!("md-bench-fresh-{fresh_count}"))?;
        // Its own metadata first, untimed: that makes its UCX workers (made on first
        // need since 2026-12-03; NIXL's agent makes its worker when created), so the
        // load is timed alone, as NIXL's `add_remote_agent` on an agent made before.
        std::hint::black_box(fresh.local_md().map_err(|e| e.to_string())?);
        let start = Instant::now();
        fresh.load_remote_md(&blob).map_err(|e| e.to_string())?;
        Ok(start.elapsed())
    }))?;
    let peer = b.load_remote_md(&blob).map_err(|e| e.to_string())?;
    b.invalidate_remote_md(peer).map_err(|e| e.to_string())?;
    let (reload, _) = time(Box::new(|| {
        let start = Instant::now();
        let peer = b.load_remote_md(&blob).map_err(|e| e.to_string())?;
        let took = start.elapsed();
        b.invalidate_remote_md(peer).map_err(|e| e.to_string())?;
        Ok(took)
    }))?;
    drop((a, b));
    drop(space);
    Ok(MdReport {
        regions: count,
        bytes: blob.len(),
        encode,
        load,
        reload,
        iters: encode_iters.min(load_iters),
    })
}

impl std::fmt::Display for MdReport {
    /// One line, parsed by `backends/ucx/bench/nixl_compare.py`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "METADATA regions {} bytes {} encode median {:.1} µs load median {:.1} µs (reload after invalidate {:.1} µs) ({} iters)",
            self.regions,
            self.bytes,
            self.encode.as_secs_f64() * 1e6,
            self.load.as_secs_f64() * 1e6,
            self.reload.as_secs_f64() * 1e6,
            self.iters
        )
    }
}
