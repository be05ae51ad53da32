//! GPU memory in `ferry bench xfer`: the `--dev` and `--ucx-library` flags, the checks
//! that decide whether a sweep may use VRAM, and [`Memory`], the buffer of a worker or
//! target (host memory, or device memory allocated with ferry-cuda in a build with the
//! `cuda` feature).
//!
//! VRAM moves over UCX, and to and from files over GDS (LOOPBACK and POSIX copy host
//! memory with the CPU). The
//! initiator checks for the CUDA driver and device before it spawns the target, so a
//! machine without a GPU gets the driver's typed reason ("VRAM needs a CUDA driver: …")
//! and nothing else starts. The byte check (`--check`) reads and writes device memory
//! through host copies, in bounded chunks, only between transfers.

use std::path::PathBuf;

use clap::Args;
use ferry::{Agent, Desc, MemKind};

use super::buffer::Buffer;
use super::{InitiatorMem, MemArg, Plan, Role, XferArgs};

/// The GPU flags of `ferry bench xfer`.
#[derive(Args, Debug, Clone, Default)]
pub struct GpuArgs {
    /// CUDA device of the VRAM buffers, on both sides (the spawned target too); with
    /// --initiator-mem vram or --target-mem vram (default 0).
    #[arg(allow_negative_numbers = true, long, value_parser = clap::value_parser!(u32).range(0..=1023))]
    pub dev: Option<u32>,
    /// The libucp every agent loads (both sides): the UCX backend's `ucx_library`
    /// parameter. VRAM needs a UCX built with CUDA, e.g. the libucx-cu13 wheel's
    /// libucx/lib/libucp.so.0.
    #[arg(long, value_name = "PATH")]
    pub ucx_library: Option<PathBuf>,
}

/// The message for VRAM in a build without the `cuda` feature.
pub const NO_CUDA_FEATURE: &str = "VRAM in bench xfer needs the `cuda` feature: this ferry was \
    built without it (cargo build -p ferry-tools --features cuda)";

/// Check the GPU side of `args` and fold `--ucx-library` into the backend parameters
/// (so that a spawned target gets it with the other `--param`s).
pub fn check(args: &mut XferArgs) -> Result<(), String> {
    if let Some(library) = &args.gpu.ucx_library {
        if !args.backend.has_ucx() {
            return Err(format!(
                "--ucx-library needs --backend ucx or default ({} does not load UCX)",
                args.backend.name()
            ));
        }
        if args.params.iter().any(|(k, _)| k == "ucx_library") {
            return Err(
                "the UCX library is given twice: use --ucx-library or --param ucx_library=PATH"
                    .into(),
            );
        }
        args.params
            .push(("ucx_library".into(), library.display().to_string()));
    }
    let vram = args.initiator_mem == InitiatorMem::Vram || args.target_mem == MemArg::Vram;
    if !vram {
        if let Some(dev) = args.gpu.dev {
            return Err(format!(
                "--dev {dev} names the CUDA device of VRAM buffers: use it with --initiator-mem vram or --target-mem vram"
            ));
        }
        return Ok(());
    }
    // The sides whose buffers this process allocates: both in `--role auto` (the
    // target it spawns runs here), else its own.
    let allocates_vram = match args.role {
        Role::Auto => true,
        Role::Initiator => args.initiator_mem == InitiatorMem::Vram,
        Role::Target => args.target_mem == MemArg::Vram,
    };
    if allocates_vram && !cfg!(feature = "cuda") {
        return Err(NO_CUDA_FEATURE.into());
    }
    if args.backend == super::BackendArg::Gds && args.target_mem == MemArg::Vram {
        return Err(
            "GDS moves VRAM to and from files: use --initiator-mem vram --target-mem file".into(),
        );
    }
    if !args.backend.moves_vram() {
        return Err(format!(
            "VRAM moves over UCX (or GDS, to files): use --backend ucx, default or gds ({} copies host memory with the CPU)",
            args.backend.name()
        ));
    }
    if !allocates_vram {
        // The other host's memory: nothing CUDA happens here.
        return Ok(());
    }
    // Fail before anything starts (the target process included) on a machine without
    // the driver or the device.
    device_present(u64::from(args.gpu.dev.unwrap_or(0)))
}

#[cfg(feature = "cuda")]
fn device_present(dev: u64) -> Result<(), String> {
    ferry_cuda::Device::open(dev)
        .map(drop)
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn device_present(_dev: u64) -> Result<(), String> {
    Err(NO_CUDA_FEATURE.into())
}

/// The arguments a spawned target needs for its memory: `--target-mem vram` and the
/// device (the UCX library travels as a `--param`).
pub fn target_args(plan: &Plan) -> Vec<String> {
    let mut v = Vec::new();
    if plan.args.target_mem == MemArg::Vram {
        v.extend(["--target-mem".to_string(), "vram".to_string()]);
    }
    if let Some(dev) = plan.args.gpu.dev {
        if plan.args.target_mem == MemArg::Vram {
            v.extend(["--dev".to_string(), dev.to_string()]);
        }
    }
    v
}

/// Where a buffer lives: its memory kind and device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// DRAM or VRAM.
    pub kind: MemKind,
    /// CUDA device for VRAM, 0 for DRAM.
    pub dev: u64,
}

impl Placement {
    /// In words, for the run's configuration: `DRAM` or `VRAM (device N)`.
    pub fn describe(&self) -> String {
        match self.kind {
            MemKind::Vram => format!("VRAM (device {})", self.dev),
            other => other.name().to_string(),
        }
    }
}

impl Plan {
    fn dev(&self) -> u64 {
        u64::from(self.args.gpu.dev.unwrap_or(0))
    }

    /// Where the workers' buffers live.
    pub fn initiator_placement(&self) -> Placement {
        match self.args.initiator_mem {
            InitiatorMem::Vram => Placement {
                kind: MemKind::Vram,
                dev: self.dev(),
            },
            InitiatorMem::Dram => Placement {
                kind: MemKind::Dram,
                dev: 0,
            },
        }
    }

    /// Where the target agents' buffers live (memory targets; POSIX registers files).
    pub fn target_placement(&self) -> Placement {
        match self.args.target_mem {
            MemArg::Vram => Placement {
                kind: MemKind::Vram,
                dev: self.dev(),
            },
            MemArg::Dram | MemArg::File | MemArg::Object => Placement {
                kind: MemKind::Dram,
                dev: 0,
            },
        }
    }
}

/// A worker's or target's buffer: host memory, or device memory (feature `cuda`).
///
/// The tool writes and checks it ([`Memory::fill`], [`Memory::zero`],
/// [`Memory::verify`]) only between transfers, as [`Buffer`] says.
pub enum Memory {
    /// Host memory.
    Host(Buffer),
    /// Device memory of one CUDA device.
    #[cfg(feature = "cuda")]
    Device(ferry_cuda::DeviceBuffer),
}

/// Bytes staged through host memory per copy in the byte check of device memory.
#[cfg(feature = "cuda")]
const STAGE_BYTES: usize = 8 << 20;

#[cfg(feature = "cuda")]
fn cuda(e: ferry_cuda::CudaError) -> String {
    e.to_string()
}

impl Memory {
    /// `len` zeroed bytes at `place`.
    pub fn alloc(place: Placement, len: u64) -> Result<Memory, String> {
        let len = usize::try_from(len).map_err(|_| format!("a {len}-byte buffer"))?;
        match place.kind {
            MemKind::Dram => Ok(Memory::Host(Buffer::zeroed(len))),
            #[cfg(feature = "cuda")]
            MemKind::Vram => {
                let dev = ferry_cuda::Device::open(place.dev).map_err(cuda)?;
                let buffer = ferry_cuda::DeviceBuffer::alloc(&dev, len.max(1)).map_err(|e| {
                    format!("allocating {len} bytes on CUDA device {}: {e}", place.dev)
                })?;
                let memory = Memory::Device(buffer);
                memory.zero(0, len)?;
                Ok(memory)
            }
            #[cfg(not(feature = "cuda"))]
            MemKind::Vram => Err(NO_CUDA_FEATURE.into()),
            other => Err(format!("bench xfer allocates DRAM or VRAM, not {other}")),
        }
    }

    /// Memory kind.
    pub fn kind(&self) -> MemKind {
        match self {
            Memory::Host(_) => MemKind::Dram,
            #[cfg(feature = "cuda")]
            Memory::Device(_) => MemKind::Vram,
        }
    }

    /// Device id of its descriptors (the CUDA ordinal; 0 for host memory).
    pub fn dev(&self) -> u64 {
        match self {
            Memory::Host(_) => 0,
            #[cfg(feature = "cuda")]
            Memory::Device(b) => b.device().ordinal(),
        }
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        match self {
            Memory::Host(b) => b.addr(),
            #[cfg(feature = "cuda")]
            Memory::Device(b) => b.addr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Memory::Host(b) => b.len(),
            #[cfg(feature = "cuda")]
            Memory::Device(b) => b.len(),
        }
    }

    /// Descriptor of the whole buffer.
    pub fn whole(&self) -> Desc {
        Desc::new(self.addr(), self.len() as u64, self.dev())
    }

    fn inside(&self, offset: usize, len: usize) -> Result<(), String> {
        if offset > self.len() || len > self.len() - offset {
            return Err(format!(
                "{len} bytes at offset {offset} run past the {}-byte buffer",
                self.len()
            ));
        }
        Ok(())
    }

    /// Write `pattern(seed)` into `len` bytes at `offset`.
    pub fn fill(&self, offset: usize, len: usize, seed: u64) -> Result<(), String> {
        self.inside(offset, len)?;
        match self {
            Memory::Host(b) => {
                b.fill(offset, len, seed);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Memory::Device(b) => {
                let mut stage = vec![0u8; STAGE_BYTES.min(len)];
                for start in (0..len).step_by(STAGE_BYTES) {
                    let chunk = &mut stage[..STAGE_BYTES.min(len - start)];
                    for (i, byte) in chunk.iter_mut().enumerate() {
                        *byte = super::buffer::pattern((start + i) as u64, seed);
                    }
                    // SAFETY: `inside` checked that offset+start+chunk.len() lies in the
                    // allocation, which `b` keeps; no transfer touches it now (the type's
                    // usage rule).
                    unsafe {
                        ferry_cuda::copy_htod(b.device(), b.addr() + (offset + start) as u64, chunk)
                    }
                    .map_err(cuda)?;
                }
                Ok(())
            }
        }
    }

    /// Zero `len` bytes at `offset`.
    pub fn zero(&self, offset: usize, len: usize) -> Result<(), String> {
        self.inside(offset, len)?;
        match self {
            Memory::Host(b) => {
                b.zero(offset, len);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Memory::Device(b) => {
                let zeros = vec![0u8; STAGE_BYTES.min(len)];
                for start in (0..len).step_by(STAGE_BYTES) {
                    let chunk = &zeros[..STAGE_BYTES.min(len - start)];
                    // SAFETY: as in `fill`.
                    unsafe {
                        ferry_cuda::copy_htod(b.device(), b.addr() + (offset + start) as u64, chunk)
                    }
                    .map_err(cuda)?;
                }
                Ok(())
            }
        }
    }

    /// The first offset (relative to `offset`) whose byte differs from
    /// `pattern(seed)`, if any; device memory is copied back to host memory for it.
    pub fn verify(&self, offset: usize, len: usize, seed: u64) -> Result<Option<usize>, String> {
        self.inside(offset, len)?;
        match self {
            Memory::Host(b) => Ok(b.verify(offset, len, seed)),
            #[cfg(feature = "cuda")]
            Memory::Device(b) => {
                let mut stage = vec![0u8; STAGE_BYTES.min(len)];
                for start in (0..len).step_by(STAGE_BYTES) {
                    let chunk = &mut stage[..STAGE_BYTES.min(len - start)];
                    // SAFETY: as in `fill`.
                    unsafe {
                        ferry_cuda::copy_dtoh(b.device(), chunk, b.addr() + (offset + start) as u64)
                    }
                    .map_err(cuda)?;
                    let wrong = chunk.iter().enumerate().position(|(i, &byte)| {
                        byte != super::buffer::pattern((start + i) as u64, seed)
                    });
                    if let Some(i) = wrong {
                        return Ok(Some(start + i));
                    }
                }
                Ok(None)
            }
        }
    }
}

/// A buffer of `len` bytes at `place`, registered with `agent`. The caller keeps the
/// buffer alive longer than the agent (Worker and Targets declare the agent first).
pub fn registered(agent: &Agent, place: Placement, len: u64) -> Result<Memory, String> {
    let memory = Memory::alloc(place, len)?;
    // SAFETY: the caller keeps `memory` alive until `agent` is dropped, and the tool
    // touches its bytes only between transfers.
    unsafe { agent.register(memory.kind(), memory.whole()) }.map_err(|e| {
        format!(
            "registering {} bytes of {}: {e}",
            memory.len(),
            place.describe()
        )
    })?;
    Ok(memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_fills_zeroes_and_verifies_within_bounds() {
        let m = Memory::alloc(
            Placement {
                kind: MemKind::Dram,
                dev: 0,
            },
            8192,
        )
        .unwrap();
        assert_eq!((m.kind(), m.dev(), m.len()), (MemKind::Dram, 0, 8192));
        assert_eq!(m.whole().len, 8192);
        m.fill(100, 1000, 7).unwrap();
        assert_eq!(m.verify(100, 1000, 7).unwrap(), None);
        assert_eq!(m.verify(100, 1000, 8).map(|o| o.is_some()), Ok(true));
        m.zero(600, 10).unwrap();
        assert_eq!(m.verify(100, 1000, 7).unwrap(), Some(500));
        assert!(m.fill(8000, 193, 1).unwrap_err().contains("run past"));
        assert!(m.verify(usize::MAX, 1, 1).is_err());
    }

    #[test]
    fn vram_without_a_gpu_is_the_typed_reason() {
        let place = Placement {
            kind: MemKind::Vram,
            dev: 0,
        };
        assert_eq!(place.describe(), "VRAM (device 0)");
        if cfg!(feature = "cuda") && std::env::var("FERRY_TEST_GPU").is_ok_and(|v| v == "1") {
            let m = Memory::alloc(place, 1 << 20).unwrap();
            m.fill(4096, 100_000, 3).unwrap();
            assert_eq!(m.verify(4096, 100_000, 3).unwrap(), None);
            m.zero(5000, 1).unwrap();
            assert_eq!(m.verify(4096, 100_000, 3).unwrap(), Some(904));
            return;
        }
        // Device 1023 exists nowhere: no GPU work, whatever the machine has.
        let nowhere = Placement {
            kind: MemKind::Vram,
            dev: 1023,
        };
        match Memory::alloc(nowhere, 4096) {
            Ok(_) => panic!("allocated VRAM on device 1023"),
            Err(e) if cfg!(feature = "cuda") => assert!(
                e.starts_with("VRAM needs a CUDA driver: libcuda.so.1 not found")
                    || e.starts_with("no CUDA device 1023: the driver reports"),
                "{e}"
            ),
            Err(e) => assert_eq!(e, NO_CUDA_FEATURE),
        }
    }
}
