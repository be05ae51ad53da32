//! Ferry on GPU memory, end to end through the engine: the demo in VRAM
//! ([`demo::run`], what `ferry demo --vram` runs) and the measurements of
//! `tools/gpu-check.sh` ([`check`]): VRAM → VRAM between two processes (UCX `cuda_ipc`),
//! VRAM ↔ DRAM, FILE ↔ VRAM through GDS, each verified byte for byte and timed beside a
//! plain CUDA copy of the same buffers.
//!
//! Without a CUDA driver every entry point returns the typed reason (e.g. "VRAM needs
//! a CUDA driver: libcuda.so.1 not found"), never panics.
// Reason: registering memory with an agent and copying device memory are `unsafe fn`s
// (the caller promises the buffers); each block states why the promise holds.
#![allow(unsafe_code)]

pub mod check;
pub mod demo;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferry::{Agent, AgentConfig, Params, XferId, XferStatus};

/// Where the GPU work runs.
#[derive(Clone, Debug, Default)]
pub struct GpuSetup {
    /// CUDA device ordinal.
    pub dev: u64,
    /// The CUDA-capable libucp to load (e.g. the libucx-cu13 wheel's); `None` = the
    /// system's `libucp.so.0`.
    pub ucx_library: Option<PathBuf>,
}

impl GpuSetup {
    /// UCX backend parameters for this setup.
    pub fn ucx_params(&self) -> Params {
        let mut params = Params::new();
        if let Some(library) = &self.ucx_library {
            params.insert("ucx_library".into(), library.display().to_string());
        }
        params
    }

    /// An agent named `name` with a UCX backend.
    pub fn ucx_agent(&self, name: &str) -> Result<Agent, String> {
        let agent = Agent::new(AgentConfig::named(name)).map_err(|e| e.to_string())?;
        agent
            .create_backend("UCX", &self.ucx_params())
            .map_err(|e| format!("UCX backend: {e}"))?;
        Ok(agent)
    }
}

/// Post `xfer` and check it until it is done; the time it took.
pub fn run_once(agent: &Agent, xfer: XferId) -> Result<Duration, String> {
    let start = Instant::now();
    let mut status = agent.post(xfer).map_err(|e| e.to_string())?;
    while status == XferStatus::InProgress {
        status = agent.check(xfer).map_err(|e| e.to_string())?;
    }
    if status != XferStatus::Done {
        return Err(format!("transfer ended as {status:?}"));
    }
    Ok(start.elapsed())
}

/// Median of `samples` (sorted in place).
pub fn median(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

/// Bytes of a deterministic pattern (xorshift from `seed`).
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.max(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A permutation of `0..n` (fixed seed), so consecutive blocks land apart and the
/// engine cannot merge them into one range.
pub fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut x = seed.max(1);
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}

/// GB/s for `bytes` in `time`.
pub fn gbps(bytes: usize, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64().max(1e-12) / 1e9
}
