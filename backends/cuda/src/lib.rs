//! CUDA for Ferry, through cudarc's driver API loaded at run time.
//!
//! Nothing here links against CUDA: cudarc is built with `dynamic-loading`, so a build
//! needs no toolkit and a machine without a GPU runs everything else. cudarc panics when
//! asked for a library it cannot find, so every entry point first checks, once per
//! process, that the driver library ([`DRIVER_LIBRARY`]) can be opened and initialized;
//! a missing driver is [`CudaError::NoDriver`], a device the driver does not have is
//! [`CudaError::NoDevice`] — typed errors, never a panic.
//!
//! What is probed when: [`probe`] (what availability checks call) only loads the driver
//! library and looks for a device node ([`DEVICE_NODES`]) — nothing in the driver is
//! called. [`driver`] (every other entry point, so the first VRAM registration or
//! buffer) also runs `cuInit`, on a thread of its own and bounded by [`INIT_TIMEOUT`],
//! and refuses at once, without `cuInit`, where no device node exists.
//!
//! What the backends need: [`Device`] (a device's primary context, made current on the
//! thread that registers or moves its memory), [`pointer_device`] (which device owns
//! an address), [`check_device_range`] (every byte of a range is device memory of one
//! device, in one `cuMemAlloc` allocation or in VMM allocations mapped back to back;
//! the logic is [`range_extents`] over any [`AddressInfo`], tested against a stand-in
//! table). What tests, demos and benchmarks need: [`DeviceBuffer`] (device memory
//! with host copies in and out), [`VmmBuffer`] (VMM memory as PyTorch's expandable
//! segments make it), [`IpcBuffer`] (another process's buffer opened through a CUDA IPC
//! handle) and [`copy_dtod`] (the plain device-to-device copy Ferry's numbers are
//! compared with).
//!
//! **Run on a GPU: not yet.** Only the paths without a driver or device are tested (here
//! and in CI); `gpu_present_when_requested` and the GPU tests of the backends run with
//! `FERRY_TEST_GPU=1` on a GPU machine (`tools/gpu-check.sh`).
// Reason: an FFI crate over the CUDA driver; raw device pointers cross the boundary.
// Every unsafe block states why it is sound.
#![allow(unsafe_code)]

use std::path::Path;
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::{result, sys, CudaContext, DriverError};
use ferry_storage::{Error, Subject};

/// The CUDA driver library every CUDA call goes through.
pub const DRIVER_LIBRARY: &str = "libcuda.so.1";

/// Paths one of which exists where an NVIDIA GPU is usable: the control device node
/// (bare metal and containers), the kernel driver's proc directory, WSL's GPU node.
pub const DEVICE_NODES: &[&str] = &["/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg"];

/// The longest [`driver`] waits for `cuInit`. Past it the call is left running on its
/// thread (`ferry-cuda-init`) and the process's answer is [`CudaError::InitTimedOut`].
pub const INIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Why CUDA cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// The driver library is absent or does not initialize.
    #[error("VRAM needs a CUDA driver: {library} not found ({reason})")]
    NoDriver {
        /// The library looked for.
        library: &'static str,
        /// What the loader (or `cuInit`) said.
        reason: String,
    },
    /// The driver library loads but no NVIDIA device node exists ([`DEVICE_NODES`]), so
    /// `cuInit` is not called.
    #[error(
        "VRAM needs an NVIDIA device: {library} loads but none of {} exists",
        DEVICE_NODES.join(", ")
    )]
    NoDeviceNode {
        /// The driver library.
        library: &'static str,
    },
    /// `cuInit` did not return within [`INIT_TIMEOUT`]; it goes on on its own thread.
    #[error("cuInit of {library} has not returned after {waited_ms} ms; CUDA is refused in this process")]
    InitTimedOut {
        /// The driver library.
        library: &'static str,
        /// How long it was waited for.
        waited_ms: u128,
    },
    /// The driver is there but has no device with this ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// The device asked for.
        ordinal: u64,
        /// How many devices the driver has.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA call {call} failed: {detail}")]
    Driver {
        /// Which call.
        call: &'static str,
        /// The driver's error name and text.
        detail: String,
    },
    /// An address is not device memory of the expected device.
    #[error("address {addr:#x}: {reason}")]
    NotDeviceMemory {
        /// The address.
        addr: u64,
        /// What it is instead.
        reason: String,
    },
}

impl CudaError {
    /// The engine error for this, on behalf of `backend`: no driver or device is
    /// `NotSupported` (the machine cannot do it), a bad address `InvalidParam`, a failed
    /// call `Backend`.
    pub fn into_error(self, backend: &'static str) -> Error {
        match self {
            CudaError::NoDriver { .. }
            | CudaError::NoDevice { .. }
            | CudaError::NoDeviceNode { .. } => Error::NotSupported {
                backend: backend.into(),
                what: self.to_string().into(),
            },
            CudaError::NotDeviceMemory { .. } => {
                Error::invalid(Subject::Named("VRAM region".into()), self.to_string())
            }
            CudaError::Driver { .. } | CudaError::InitTimedOut { .. } => {
                Error::backend(backend, self.to_string())
            }
        }
    }
}

fn driver_error(call: &'static str, e: DriverError) -> CudaError {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    CudaError::Driver {
        call,
        detail: format!("{name}: {text}"),
    }
}

/// Whether CUDA can work here, without initializing it: the driver library loads
/// (`dlopen`, once per process) and a device node exists. What availability checks
/// call: it never runs `cuInit` and never blocks.
pub fn probe() -> Result<(), CudaError> {
    static LIBRARY: OnceLock<Result<(), CudaError>> = OnceLock::new();
    LIBRARY
        .get_or_init(|| {
            // SAFETY: opening the driver library runs its constructors, which only set up
            // the driver's own state. The handle is leaked on purpose: cudarc opens the
            // same library by name, and keeping ours open keeps it loaded for good.
            let library = unsafe { libloading::Library::new(DRIVER_LIBRARY) }.map_err(|e| {
                CudaError::NoDriver {
                    library: DRIVER_LIBRARY,
                    reason: std::error::Error::source(&e)
                        .map(|s| s.to_string())
                        .unwrap_or_else(|| e.to_string()),
                }
            })?;
            std::mem::forget(library);
            Ok(())
        })
        .clone()?;
    if !DEVICE_NODES.iter().any(|p| Path::new(p).exists()) {
        return Err(CudaError::NoDeviceNode {
            library: DRIVER_LIBRARY,
        });
    }
    Ok(())
}

/// Check, once per process, that [`probe`] passes and `cuInit` succeeds within
/// [`INIT_TIMEOUT`]. Every other function calls this first; call it to ask "is there a
/// usable CUDA driver here". The answer, a timeout included, is kept for the process:
/// `cuInit` is called at most once.
pub fn driver() -> Result<(), CudaError> {
    static STATE: OnceLock<Result<(), CudaError>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            probe()?;
            let (done, outcome) = mpsc::channel();
            std::thread::Builder::new()
                .name("ferry-cuda-init".into())
                .spawn(move || {
                    let _ = done.send(result::init());
                })
                .map_err(|e| CudaError::Driver {
                    call: "cuInit",
                    detail: format!("cannot start its thread: {e}"),
                })?;
            let init = match outcome.recv_timeout(INIT_TIMEOUT) {
                Ok(init) => init,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(CudaError::InitTimedOut {
                        library: DRIVER_LIBRARY,
                        waited_ms: INIT_TIMEOUT.as_millis(),
                    })
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(CudaError::Driver {
                        call: "cuInit",
                        detail: "its thread ended without an answer".into(),
                    })
                }
            };
            init.map_err(|e| match e.0 {
                sys::CUresult::CUDA_ERROR_NO_DEVICE => CudaError::NoDevice {
                    ordinal: 0,
                    count: 0,
                },
                _ => CudaError::NoDriver {
                    library: DRIVER_LIBRARY,
                    reason: driver_error("cuInit", e).to_string(),
                },
            })
        })
        .clone()
}

/// Number of CUDA devices.
pub fn device_count() -> Result<usize, CudaError> {
    driver()?;
    result::device::get_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| driver_error("cuDeviceGetCount", e))
}

/// One device's primary context. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Device {
    ctx: Arc<CudaContext>,
}

impl Device {
    /// Open device `ordinal` (retains its primary context and makes it current on this
    /// thread).
    pub fn open(ordinal: u64) -> Result<Device, CudaError> {
        let count = match device_count() {
            Err(CudaError::NoDevice { .. }) => 0,
            other => other?,
        };
        if ordinal >= count as u64 {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal as usize).map_err(|e| driver_error("cuCtx", e))?;
        Ok(Device { ctx })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u64 {
        self.ctx.ordinal() as u64
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_default()
    }

    /// Make this device's context current on the calling thread (`cuCtxSetCurrent`):
    /// what UCX's CUDA transports and cuFile need on the thread that registers or moves
    /// device memory.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))
    }

    /// Wait for all work on the device.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        result::ctx::synchronize().map_err(|e| driver_error("cuCtxSynchronize", e))
    }
}

/// The device that owns `addr` if it is device memory, `None` if it is host memory
/// the driver does not know (plain `malloc`).
pub fn pointer_device(addr: u64) -> Result<Option<u64>, CudaError> {
    driver()?;
    let mut mem_type: u32 = 0;
    // SAFETY: cuPointerGetAttribute writes one unsigned int for MEMORY_TYPE; any address
    // is accepted (an unknown one is an error code, not a fault).
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&mut mem_type as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Ok(None);
    }
    if mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Ok(None);
    }
    let mut ordinal: i32 = -1;
    // SAFETY: DEVICE_ORDINAL writes one int; the address is device memory (above).
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            addr,
        )
    };
    rc.result()
        .map_err(|e| driver_error("cuPointerGetAttribute", e))?;
    Ok(Some(ordinal.max(0) as u64))
}

/// One allocation of device memory as the driver reports it (`cuMemGetAddressRange`):
/// a whole `cuMemAlloc` allocation, or one physical allocation (`cuMemCreate`) mapped
/// into a virtual range (VMM, what PyTorch's expandable segments use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// First address of the allocation.
    pub base: u64,
    /// Its bytes.
    pub len: u64,
    /// The device that owns it.
    pub device: u64,
    /// Whether it is VMM memory (`cuMemCreate` + `cuMemMap`), where neighbouring
    /// allocations may be mapped back to back into one virtual range.
    pub vmm: bool,
}

impl Extent {
    /// One past its last byte.
    pub fn end(&self) -> u64 {
        self.base.saturating_add(self.len)
    }
}

/// What the range check asks about one address: the driver ([`Driver`]) or, in tests,
/// a stand-in table of allocations.
pub trait AddressInfo {
    /// The allocation holding `addr`, `None` if `addr` is not device memory.
    fn extent(&self, addr: u64) -> Result<Option<Extent>, CudaError>;
}

/// The CUDA driver as [`AddressInfo`]: `cuPointerGetAttribute` (memory type, device) and
/// `cuMemGetAddressRange` (the allocation's bounds), `cuMemRetainAllocationHandle`
/// (whether it is VMM memory).
#[derive(Clone, Copy, Debug, Default)]
pub struct Driver;

impl AddressInfo for Driver {
    fn extent(&self, addr: u64) -> Result<Option<Extent>, CudaError> {
        let Some(device) = pointer_device(addr)? else {
            return Ok(None);
        };
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: two out-pointers to live locals; any address is accepted (an unknown
        // one is an error code).
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }
            .result()
            .map_err(|e| driver_error("cuMemGetAddressRange", e))?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer to a live local; the address is device memory (above). A
        // legacy allocation answers with an error code, not a fault.
        let vmm = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, addr as *mut _) }
            == sys::CUresult::CUDA_SUCCESS;
        if vmm {
            // SAFETY: the retain above succeeded; this drops the reference it took.
            let _ = unsafe { sys::cuMemRelease(handle) };
        }
        Ok(Some(Extent {
            base,
            len: size as u64,
            device,
            vmm,
        }))
    }
}

/// The most allocations one checked range may span (a 128 GiB range of PyTorch's 2 MiB
/// expandable-segment pages is 65,536 of them).
pub const MAX_EXTENTS: usize = 1 << 16;

/// The allocations that hold `addr..addr+len`, in address order, each of device `dev`,
/// asked of `info`. Every byte must be device memory of `dev`; a `cuMemAlloc`
/// allocation must hold the whole range (a range that runs from one into the next —
/// they may be adjacent — is refused: a CUDA IPC handle, and so UCX's `cuda_ipc`, covers
/// one allocation); VMM allocations mapped back to back may hold it together (then more
/// than one [`Extent`] comes back and the caller decides whether its transport can move
/// such a range).
pub fn range_extents(
    info: &impl AddressInfo,
    addr: u64,
    len: u64,
    dev: u64,
) -> Result<Vec<Extent>, CudaError> {
    let end = addr.checked_add(len).ok_or(CudaError::NotDeviceMemory {
        addr,
        reason: format!("a range of {len} bytes wraps around the address space"),
    })?;
    let mut extents: Vec<Extent> = Vec::new();
    let mut at = addr;
    while at < end || extents.is_empty() {
        let extent = info.extent(at)?.ok_or_else(|| CudaError::NotDeviceMemory {
            addr: at,
            reason: match extents.last() {
                None => format!("not device memory (expected device {dev})"),
                Some(prev) => format!(
                    "the range {addr:#x}+{len:#x} runs {} bytes past the device allocation \
                     {:#x}..{:#x} into memory that is not device memory",
                    end - at,
                    prev.base,
                    prev.end()
                ),
            },
        })?;
        if extent.device != dev {
            return Err(CudaError::NotDeviceMemory {
                addr: at,
                reason: format!(
                    "device memory of device {}, not of device {dev}",
                    extent.device
                ),
            });
        }
        if extent.base > at || extent.end() <= at {
            return Err(CudaError::NotDeviceMemory {
                addr: at,
                reason: format!(
                    "the driver reports the allocation {:#x}..{:#x}, which does not hold it",
                    extent.base,
                    extent.end()
                ),
            });
        }
        if let Some(prev) = extents.last() {
            if !(prev.vmm && extent.vmm) {
                return Err(CudaError::NotDeviceMemory {
                    addr,
                    reason: format!(
                        "the range {addr:#x}+{len:#x} spans two CUDA allocations \
                         ({:#x}..{:#x} and {:#x}..{:#x}); a cuMemAlloc region must lie in one \
                         allocation: register each allocation on its own",
                        prev.base,
                        prev.end(),
                        extent.base,
                        extent.end()
                    ),
                });
            }
            if extents.len() >= MAX_EXTENTS {
                return Err(CudaError::NotDeviceMemory {
                    addr,
                    reason: format!(
                        "the range {addr:#x}+{len:#x} spans more than {MAX_EXTENTS} VMM allocations"
                    ),
                });
            }
        }
        at = extent.end();
        extents.push(extent);
    }
    Ok(extents)
}

/// Check that `addr..addr+len` is device memory of device `dev` ([`range_extents`]
/// through the driver); the allocations that hold it.
pub fn check_device_range(addr: u64, len: u64, dev: u64) -> Result<Vec<Extent>, CudaError> {
    range_extents(&Driver, addr, len, dev)
}

/// The CUDA version the driver supports, as `cuDriverGetVersion` gives it
/// (1000 × major + 10 × minor: 13000 is CUDA 13.0).
pub fn driver_version() -> Result<i32, CudaError> {
    driver()?;
    let mut version: i32 = 0;
    // SAFETY: out-pointer to a live local.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| driver_error("cuDriverGetVersion", e))?;
    Ok(version)
}

/// Refuse a copy of `len` bytes into or out of a `cap`-byte buffer at `ptr` that runs past it.
fn fits(ptr: u64, cap: usize, len: usize) -> Result<(), CudaError> {
    if len > cap {
        return Err(CudaError::NotDeviceMemory {
            addr: ptr + cap as u64,
            reason: format!("a copy of {len} bytes runs past the {cap}-byte buffer"),
        });
    }
    Ok(())
}

/// Device memory allocated with `cuMemAlloc`, freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    dev: Device,
    ptr: u64,
    len: usize,
}

impl DeviceBuffer {
    /// Allocate `len` bytes on `dev`.
    pub fn alloc(dev: &Device, len: usize) -> Result<DeviceBuffer, CudaError> {
        dev.bind()?;
        // SAFETY: a plain allocation in the context made current above.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }
            .map_err(|e| driver_error("cuMemAlloc", e))?;
        Ok(DeviceBuffer {
            dev: dev.clone(),
            ptr,
            len,
        })
    }

    /// The device address.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    fn fits(&self, len: usize) -> Result<(), CudaError> {
        fits(self.ptr, self.len, len)
    }

    /// Copy `src` to the start of the buffer (synchronous).
    pub fn write(&self, src: &[u8]) -> Result<(), CudaError> {
        self.fits(src.len())?;
        self.dev.bind()?;
        // SAFETY: the destination holds at least src.len() bytes (checked above).
        unsafe { result::memcpy_htod_sync(self.ptr, src) }
            .map_err(|e| driver_error("cuMemcpyHtoD", e))
    }

    /// Copy the start of the buffer into `dst` (synchronous).
    pub fn read(&self, dst: &mut [u8]) -> Result<(), CudaError> {
        self.fits(dst.len())?;
        self.dev.bind()?;
        // SAFETY: the source holds at least dst.len() bytes (checked above).
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr) }
            .map_err(|e| driver_error("cuMemcpyDtoH", e))
    }

    /// A CUDA IPC handle another process can open with [`IpcBuffer::open`].
    pub fn ipc_handle(&self) -> Result<[u8; 64], CudaError> {
        self.dev.bind()?;
        // SAFETY: plain data; zero is a valid bit pattern.
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: the pointer is our allocation; the handle is writable.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, self.ptr) }
            .result()
            .map_err(|e| driver_error("cuIpcGetMemHandle", e))?;
        Ok(handle.reserved.map(|c| c as u8))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: our allocation; nothing uses it after drop.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Device memory the way PyTorch's expandable segments make it (CUDA's virtual memory
/// management): one reserved virtual range with `chunks` physical allocations
/// (`cuMemCreate`, shareable as POSIX file descriptors) mapped back to back and made
/// readable and writable on the device. Unmapped and freed on drop.
#[derive(Debug)]
pub struct VmmBuffer {
    dev: Device,
    ptr: u64,
    len: usize,
    handles: Vec<sys::CUmemGenericAllocationHandle>,
    mapped: usize,
}

impl VmmBuffer {
    /// Reserve `chunks × chunk_bytes` (each rounded up to the allocation granularity)
    /// on `dev` and map `chunks` separate physical allocations into it.
    pub fn alloc(dev: &Device, chunk_bytes: usize, chunks: usize) -> Result<VmmBuffer, CudaError> {
        dev.bind()?;
        // SAFETY: plain C data; zero is valid for every field.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev.ordinal() as i32;
        let mut granularity: usize = 0;
        // SAFETY: out-pointer to a live local; `prop` is initialized.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()
        .map_err(|e| driver_error("cuMemGetAllocationGranularity", e))?;
        let granularity = granularity.max(1);
        let chunk = chunk_bytes.max(1).div_ceil(granularity) * granularity;
        let len = chunk * chunks.max(1);
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a live local; size is a multiple of the granularity.
        unsafe { sys::cuMemAddressReserve(&mut ptr, len, granularity, 0, 0) }
            .result()
            .map_err(|e| driver_error("cuMemAddressReserve", e))?;
        let mut buf = VmmBuffer {
            dev: dev.clone(),
            ptr,
            len,
            handles: Vec::with_capacity(chunks.max(1)),
            mapped: 0,
        };
        for i in 0..chunks.max(1) {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: out-pointer to a live local; `prop` is initialized.
            unsafe { sys::cuMemCreate(&mut handle, chunk, &prop, 0) }
                .result()
                .map_err(|e| driver_error("cuMemCreate", e))?;
            buf.handles.push(handle);
            // SAFETY: the chunk lies inside our reservation and is not mapped yet.
            unsafe { sys::cuMemMap(ptr + (i * chunk) as u64, chunk, 0, handle, 0) }
                .result()
                .map_err(|e| driver_error("cuMemMap", e))?;
            buf.mapped += 1;
        }
        // SAFETY: plain C data; zero is valid for every field.
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location = prop.location;
        access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the whole range is mapped (above); one access descriptor.
        unsafe { sys::cuMemSetAccess(ptr, len, &access, 1) }
            .result()
            .map_err(|e| driver_error("cuMemSetAccess", e))?;
        Ok(buf)
    }

    /// The device address.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Bytes (all chunks).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of each physical allocation.
    pub fn chunk_bytes(&self) -> usize {
        self.len / self.handles.len().max(1)
    }

    /// Copy `src` to the start of the buffer (synchronous).
    pub fn write(&self, src: &[u8]) -> Result<(), CudaError> {
        fits(self.ptr, self.len, src.len())?;
        // SAFETY: the destination is mapped for at least src.len() bytes (checked above).
        unsafe { copy_htod(&self.dev, self.ptr, src) }
    }

    /// Copy the start of the buffer into `dst` (synchronous).
    pub fn read(&self, dst: &mut [u8]) -> Result<(), CudaError> {
        fits(self.ptr, self.len, dst.len())?;
        // SAFETY: the source is mapped for at least dst.len() bytes (checked above).
        unsafe { copy_dtoh(&self.dev, dst, self.ptr) }
    }
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        if self.dev.bind().is_err() {
            return;
        }
        let chunk = self.chunk_bytes();
        for i in 0..self.mapped {
            // SAFETY: chunk i was mapped by alloc; nothing uses it after drop.
            let _ = unsafe { sys::cuMemUnmap(self.ptr + (i * chunk) as u64, chunk) };
        }
        for handle in self.handles.drain(..) {
            // SAFETY: our handle, unmapped above.
            let _ = unsafe { sys::cuMemRelease(handle) };
        }
        // SAFETY: our reservation, nothing mapped in it any more.
        let _ = unsafe { sys::cuMemAddressFree(self.ptr, self.len) };
    }
}

/// Another process's device buffer, opened from its CUDA IPC handle; closed on drop.
#[derive(Debug)]
pub struct IpcBuffer {
    dev: Device,
    ptr: u64,
    len: usize,
}

impl IpcBuffer {
    /// Open `handle` (from [`DeviceBuffer::ipc_handle`] in another process) on `dev`.
    pub fn open(dev: &Device, handle: &[u8; 64], len: usize) -> Result<IpcBuffer, CudaError> {
        dev.bind()?;
        // SAFETY: plain data; zero is a valid bit pattern.
        let mut raw: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (cell, byte) in raw.reserved.iter_mut().zip(handle) {
            *cell = *byte as _;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the handle is plain bytes; the driver validates it and writes the
        // mapped address through a valid pointer.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| driver_error("cuIpcOpenMemHandle", e))?;
        Ok(IpcBuffer {
            dev: dev.clone(),
            ptr,
            len,
        })
    }

    /// The mapped device address in this process.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Bytes (as the exporting process said).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcBuffer {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: mapped by us in open; nothing uses it after drop.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Copy `len` bytes from device address `src` to device address `dst` on `dev` and wait
/// for it (`cuMemcpyDtoD`): the plain copy Ferry's VRAM numbers are compared with.
///
/// # Safety
/// Both ranges are device memory (of any device with unified addressing) that stays
/// allocated during the call, and they do not overlap.
pub unsafe fn copy_dtod(dev: &Device, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
    dev.bind()?;
    // SAFETY: the caller's promise (above).
    unsafe { result::memcpy_dtod_sync(dst, src, len) }.map_err(|e| driver_error("cuMemcpyDtoD", e))
}

/// Copy each `(dst, src, len)` device range, queued on the default stream and waited
/// for once at the end (`cuMemcpyDtoDAsync` per range, then `cuCtxSynchronize`): the
/// fastest plain way to copy many ranges, Ferry's reference for batches.
///
/// # Safety
/// As [`copy_dtod`], for every range.
pub unsafe fn copy_dtod_ranges(
    dev: &Device,
    ranges: &[(u64, u64, usize)],
) -> Result<(), CudaError> {
    dev.bind()?;
    let stream = result::stream::null();
    for &(dst, src, len) in ranges {
        // SAFETY: the caller's promise, per range.
        unsafe { result::memcpy_dtod_async(dst, src, len, stream) }
            .map_err(|e| driver_error("cuMemcpyDtoDAsync", e))?;
    }
    result::ctx::synchronize().map_err(|e| driver_error("cuCtxSynchronize", e))
}

/// Copy host bytes to device address `dst` (synchronous, `cuMemcpyHtoD`).
///
/// # Safety
/// `dst..dst+src.len()` is device memory that stays allocated during the call.
pub unsafe fn copy_htod(dev: &Device, dst: u64, src: &[u8]) -> Result<(), CudaError> {
    dev.bind()?;
    // SAFETY: the caller's promise.
    unsafe { result::memcpy_htod_sync(dst, src) }.map_err(|e| driver_error("cuMemcpyHtoD", e))
}

/// Copy device bytes at `src` into `dst` (synchronous, `cuMemcpyDtoH`).
///
/// # Safety
/// `src..src+dst.len()` is device memory that stays allocated during the call.
pub unsafe fn copy_dtoh(dev: &Device, dst: &mut [u8], src: u64) -> Result<(), CudaError> {
    dev.bind()?;
    // SAFETY: the caller's promise.
    unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(|e| driver_error("cuMemcpyDtoH", e))
}

/// Whether GPU tests are asked for (`FERRY_TEST_GPU=1`): then a missing driver or
/// device fails them; otherwise they say why they skip.
pub fn gpu_tests_requested() -> bool {
    std::env::var("FERRY_TEST_GPU").is_ok_and(|v| v == "1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_a_typed_error_and_device_checks_follow_it() {
        match driver() {
            Ok(()) => {
                // A machine with a driver: a device far past the count is NoDevice.
                let count = device_count().unwrap();
                let err = Device::open(1 << 20).unwrap_err();
                assert_eq!(
                    err,
                    CudaError::NoDevice {
                        ordinal: 1 << 20,
                        count
                    }
                );
            }
            Err(err) => {
                assert!(!gpu_tests_requested(), "FERRY_TEST_GPU=1 but {err}");
                eprintln!("no CUDA driver here (checked): {err}");
                match &err {
                    CudaError::NoDriver { library, .. } => {
                        assert_eq!(*library, DRIVER_LIBRARY);
                        assert!(err
                            .to_string()
                            .starts_with("VRAM needs a CUDA driver: libcuda.so.1 not found"));
                    }
                    CudaError::NoDevice { .. } | CudaError::NoDeviceNode { .. } => {}
                    other => panic!("unexpected {other}"),
                }
                // The probe (what availability checks call) says the same, without
                // cuInit, unless it was cuInit that refused.
                if !matches!(err, CudaError::NoDevice { .. }) {
                    assert_eq!(probe().unwrap_err(), err);
                }
                // Every entry point gives the same error instead of panicking.
                assert_eq!(Device::open(0).unwrap_err(), err);
                assert_eq!(device_count().unwrap_err(), err);
                assert_eq!(pointer_device(0x1000).unwrap_err(), err);
                let engine = err.clone().into_error("UCX");
                assert!(matches!(engine, Error::NotSupported { .. }), "{engine:?}");
                assert!(engine.to_string().contains("libcuda.so.1"), "{engine}");
            }
        }
    }

    #[test]
    fn the_probe_never_initializes_the_driver_and_returns_at_once() {
        let started = std::time::Instant::now();
        let probed = probe();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        if let Err(e) = &probed {
            assert!(
                matches!(
                    e,
                    CudaError::NoDriver { .. } | CudaError::NoDeviceNode { .. }
                ),
                "{e}"
            );
        }
        let no_node = CudaError::NoDeviceNode {
            library: DRIVER_LIBRARY,
        };
        assert!(no_node.to_string().contains("/dev/nvidiactl"), "{no_node}");
        assert!(matches!(
            no_node.into_error("GDS"),
            Error::NotSupported { .. }
        ));
        let late = CudaError::InitTimedOut {
            library: DRIVER_LIBRARY,
            waited_ms: 60_000,
        };
        assert!(late.to_string().contains("cuInit"), "{late}");
        assert!(matches!(late.into_error("UCX"), Error::Backend { .. }));
    }

    #[test]
    fn error_kinds_map_to_engine_errors() {
        let no_device = CudaError::NoDevice {
            ordinal: 3,
            count: 1,
        };
        assert_eq!(
            no_device.to_string(),
            "no CUDA device 3: the driver reports 1 device(s)"
        );
        assert!(matches!(
            no_device.into_error("GDS"),
            Error::NotSupported { .. }
        ));
        let bad = CudaError::NotDeviceMemory {
            addr: 0x10,
            reason: "not device memory".into(),
        };
        assert!(matches!(bad.into_error("UCX"), Error::InvalidParam { .. }));
        let call = CudaError::Driver {
            call: "cuMemAlloc",
            detail: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        };
        assert!(matches!(call.into_error("UCX"), Error::Backend { .. }));
    }

    /// A stand-in driver: a table of allocations.
    struct Table(Vec<Extent>);

    impl AddressInfo for Table {
        fn extent(&self, addr: u64) -> Result<Option<Extent>, CudaError> {
            Ok(self
                .0
                .iter()
                .find(|e| e.base <= addr && addr < e.end())
                .copied())
        }
    }

    fn legacy(base: u64, len: u64, device: u64) -> Extent {
        Extent {
            base,
            len,
            device,
            vmm: false,
        }
    }

    fn vmm(base: u64, len: u64) -> Extent {
        Extent {
            base,
            len,
            device: 0,
            vmm: true,
        }
    }

    #[test]
    fn a_range_across_two_adjacent_allocations_is_refused() {
        // Two cuMemAlloc allocations back to back: both ends are device memory of
        // device 0, which a first/last-byte probe would have accepted.
        let table = Table(vec![legacy(0x10000, 0x1000, 0), legacy(0x11000, 0x1000, 0)]);
        let err = range_extents(&table, 0x10800, 0x1000, 0).unwrap_err();
        assert!(
            err.to_string().contains("spans two CUDA allocations"),
            "{err}"
        );
        assert!(err.to_string().contains("0x10000..0x11000"), "{err}");
        // Inside one: one extent; exactly one whole allocation too.
        assert_eq!(range_extents(&table, 0x10800, 0x800, 0).unwrap().len(), 1);
        assert_eq!(range_extents(&table, 0x11000, 0x1000, 0).unwrap().len(), 1);
        // Running past the last allocation into nothing.
        let err = range_extents(&table, 0x11800, 0x1000, 0).unwrap_err();
        assert!(err.to_string().contains("not device memory"), "{err}");
        // Not device memory at all, the wrong device, wrapping.
        assert!(range_extents(&table, 0x100, 0x10, 0).is_err());
        let err = range_extents(&table, 0x10000, 0x10, 1).unwrap_err();
        assert!(err.to_string().contains("not of device 1"), "{err}");
        assert!(range_extents(&table, u64::MAX - 4, 0x10, 0).is_err());
    }

    #[test]
    fn vmm_allocations_mapped_back_to_back_hold_a_range_together() {
        // Three 2 MiB physical allocations in one virtual range (expandable segments).
        let m = 2u64 << 20;
        let table = Table(vec![
            vmm(0x4000_0000, m),
            vmm(0x4000_0000 + m, m),
            vmm(0x4000_0000 + 2 * m, m),
        ]);
        let got = range_extents(&table, 0x4000_0000 + 100, 2 * m, 0).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].base, 0x4000_0000);
        // A hole in the mapping ends the range's device memory.
        let holed = Table(vec![vmm(0x4000_0000, m), vmm(0x4000_0000 + 2 * m, m)]);
        let err = range_extents(&holed, 0x4000_0000, 3 * m, 0).unwrap_err();
        assert!(err.to_string().contains("runs"), "{err}");
        // A VMM allocation next to a cuMemAlloc one does not join it.
        let mixed = Table(vec![vmm(0x4000_0000, m), legacy(0x4000_0000 + m, m, 0)]);
        assert!(range_extents(&mixed, 0x4000_0000, 2 * m, 0).is_err());
    }

    #[test]
    fn gpu_present_when_requested() {
        if !gpu_tests_requested() {
            eprintln!("skipping: GPU tests run with FERRY_TEST_GPU=1 (none requested here)");
            return;
        }
        let dev = Device::open(0).expect("FERRY_TEST_GPU=1 needs device 0");
        let buf = DeviceBuffer::alloc(&dev, 1 << 20).unwrap();
        let pattern: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + 3) as u8).collect();
        buf.write(&pattern).unwrap();
        let copy = DeviceBuffer::alloc(&dev, 1 << 20).unwrap();
        // SAFETY: two separate live allocations of 1 MiB.
        unsafe { copy_dtod(&dev, copy.addr(), buf.addr(), 1 << 20) }.unwrap();
        let mut back = vec![0u8; 1 << 20];
        copy.read(&mut back).unwrap();
        assert_eq!(back, pattern);
        assert_eq!(pointer_device(buf.addr()).unwrap(), Some(0));
        assert_eq!(check_device_range(buf.addr(), 1 << 20, 0).unwrap().len(), 1);
        // Two cuMemAlloc allocations are never one range, even where they are adjacent.
        if copy.addr() == buf.addr() + (1 << 20) || buf.addr() == copy.addr() + (1 << 20) {
            let low = buf.addr().min(copy.addr());
            assert!(check_device_range(low, 2 << 20, 0).is_err());
        }
        // VMM memory: three physical allocations mapped back to back.
        let vmm = VmmBuffer::alloc(&dev, 2 << 20, 3).unwrap();
        let extents = check_device_range(vmm.addr(), vmm.len() as u64, 0).unwrap();
        assert_eq!(extents.len(), 3, "{extents:?}");
        assert!(extents.iter().all(|e| e.vmm));
        let bytes: Vec<u8> = (0..vmm.len()).map(|i| (i * 11 + 1) as u8).collect();
        vmm.write(&bytes).unwrap();
        let mut back = vec![0u8; vmm.len()];
        vmm.read(&mut back).unwrap();
        assert_eq!(back, bytes);
        assert!(driver_version().unwrap() >= 12000);
        let host = [0u8; 64];
        assert_eq!(pointer_device(host.as_ptr() as u64).unwrap(), None);
    }
}
