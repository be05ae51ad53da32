//! Ferry's GDS backend: FILE ↔ VRAM and FILE ↔ DRAM through NVIDIA cuFile (GPUDirect
//! Storage), within one agent.
//!
//! # How it maps onto cuFile
//!
//! - **Library**: cuFile is loaded at run time (`libcufile.so.0`, or the file named by
//!   the `cufile_library` parameter, e.g. the `nvidia-cufile` wheel's), so the default
//!   build needs neither CUDA nor cuFile; without them `ferry backends` says why GDS is
//!   unavailable.
//! - **What is probed when**: availability checks (`available`, `available_with`,
//!   `kind_available`: `ferry backends`, every agent's backend list) load the library
//!   and look its symbols up — `dlopen` + `dlsym`, no call into cuFile — and, with
//!   `device_check` (the default), refuse at once where no NVIDIA device node
//!   ([`cufile::DEVICE_NODES`]) or no `libcuda.so.1` exists: a real cuFile without a GPU
//!   cannot open its driver, and some builds spin forever trying. `cuFileDriverOpen`
//!   runs only when a backend is created ([`cufile::open`]; [`probe_mode`] too), once
//!   per loaded library and process, on a thread of its own, waited for at most
//!   `driver_open_timeout_ms`. An open that does not return in time fails creation with
//!   `ETIMEDOUT`; its thread stays inside cuFile (nothing can stop it), and later
//!   creations are refused at once, starting no second open, until it returns.
//! - **Mode**: with the nvidia-fs kernel module, cuFile DMAs between storage and GPU
//!   memory; without it (*compatibility mode*) cuFile does POSIX I/O through bounce
//!   buffers. [`GdsBackend::io_mode`] says which, and it is logged at creation.
//! - **Regions**: FILE by descriptor (`desc.dev`) or by path + [`FileMode`](ferry_backend_api::FileMode) (opened at
//!   registration, closed at deregistration; `O_DIRECT` as the mode says), registered
//!   with `cuFileHandleRegister`; length 0 = unbounded. DRAM and VRAM buffers are
//!   registered with `cuFileBufRegister` (parameter `register_buffers`); VRAM needs the
//!   `cuda` feature and a CUDA driver, the device is `desc.dev` and its context is made
//!   current on every thread that moves its bytes.
//! - **Requests**: the local side is DRAM or VRAM, the target a FILE region of the same
//!   agent ([`Endpoint::Local`]); `Op::Read` = file → memory, `Op::Write` = memory →
//!   file. Each merged range is cut into operations of at most `chunk_bytes`.
//! - **Engines**: `threads` — a bounded pool of workers calling `cuFileRead` /
//!   `cuFileWrite` (short transfers continue where they stopped); `batch` — cuFile's
//!   batch API: operations are submitted in batches of up to `batch_entries`
//!   (`cuFileBatchIOSubmit`) on a fixed set of batch handles set up at creation, and
//!   polled with a zero timeout (`cuFileBatchIOGetStatus`) in `progress`, never
//!   blocking. `auto` picks `batch` in GDS mode when the library has it, else `threads`
//!   (older cuFile refuses batches in compatibility mode).
//! - **Bounds**: request and operation slots are fixed slabs (`max_requests`,
//!   `max_ops`); a batch that does not fit is refused whole with a `Capacity` error
//!   before anything starts, so nothing grows and nothing is allocated per post.
//! - **Deregistration** of a region that a queued or running operation uses is refused
//!   (`NotAllowed`); the count is taken when an operation is made and released with it.
// Reason: a backend over a C library: raw buffers, file handles and function pointers
// cross the FFI boundary. Every unsafe block states why it is sound.
#![allow(unsafe_code)]

pub mod cufile;
mod engine;
mod slots;

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferry_backend_api::{
    Backend, BackendFactory, BackendInit, Capabilities, Completions, Endpoint, Error, Failure,
    FailureKind, MemKind, Op, ParamSpec, Params, PeerId, Post, RegionSpec, Registered, RemoteAgent,
    Result, Subject,
};

use crate::cufile::{CUfileDescr, CUfileDescrHandle, CUfileHandle, CuFile, IoMode, OpenError};
use crate::engine::{BatchEngine, IoJob, IoOutcome, ThreadEngine};
use crate::slots::Slots;

/// The backend's type name.
pub const NAME: &str = "GDS";

const MEM_KINDS: &[MemKind] = &[MemKind::Dram, MemKind::Vram, MemKind::File];

/// Parameters of the GDS backend.
pub const PARAMS: &[ParamSpec] = &[
    ParamSpec {
        name: "cufile_library",
        default: "",
        doc: "path of the libcufile to load; empty = libcufile.so.0 from the loader's path",
    },
    ParamSpec {
        name: "driver_open_timeout_ms",
        default: "5000",
        doc: "longest wait for cuFileDriverOpen at creation (1..=600000); past it creation \
              fails and the call is left running on its own thread",
    },
    ParamSpec {
        name: "device_check",
        default: "true",
        doc: "refuse at once, before cuFileDriverOpen, when no NVIDIA device node or no \
              libcuda.so.1 is here (false: only for a cuFile that needs no GPU, such as a \
              test stand-in)",
    },
    ParamSpec {
        name: "engine",
        default: "auto",
        doc: "'threads' (worker pool calling cuFileRead/cuFileWrite), 'batch' (cuFile batch \
              API, polled), or 'auto' (batch in GDS mode when available, else threads)",
    },
    ParamSpec {
        name: "threads",
        default: "4",
        doc: "worker threads of the threads engine (1..=64)",
    },
    ParamSpec {
        name: "batch_entries",
        default: "128",
        doc: "operations per cuFile batch (1..=1024, and at most the driver's max_batch_io_size)",
    },
    ParamSpec {
        name: "batches",
        default: "8",
        doc: "cuFile batch handles in flight at once (1..=64), set up at creation",
    },
    ParamSpec {
        name: "chunk_bytes",
        default: "16777216",
        doc: "largest single cuFile operation; longer ranges are cut into pieces of this size",
    },
    ParamSpec {
        name: "max_requests",
        default: "1024",
        doc: "requests in flight at once (1..=65536)",
    },
    ParamSpec {
        name: "max_ops",
        default: "8192",
        doc: "operations (pieces of ranges) queued or in flight at once (1..=1048576)",
    },
    ParamSpec {
        name: "register_buffers",
        default: "true",
        doc: "register DRAM/VRAM regions with cuFileBufRegister (false: cuFile stages \
              through its own bounce buffers)",
    },
];

/// Which engine moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// Worker threads calling `cuFileRead` / `cuFileWrite`.
    Threads,
    /// cuFile's batch API, polled in `progress`.
    Batch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EngineChoice {
    Auto,
    Only(EngineKind),
}

/// Parsed parameters.
#[derive(Clone, Debug)]
struct Config {
    library: PathBuf,
    driver_open_timeout: Duration,
    device_check: bool,
    engine: EngineChoice,
    threads: usize,
    batch_entries: usize,
    batches: usize,
    chunk_bytes: u64,
    max_requests: usize,
    max_ops: usize,
    register_buffers: bool,
}

fn bad_param(params: &Params, key: &str, why: &str) -> Error {
    Error::invalid(
        Subject::BackendName(NAME.into()),
        format!(
            "parameter {key}='{}': {why}",
            params.get(key).map(String::as_str).unwrap_or("")
        ),
    )
}

fn number<T: std::str::FromStr + PartialOrd>(
    params: &Params,
    key: &str,
    range: std::ops::RangeInclusive<T>,
    why: &str,
) -> Result<T> {
    params
        .get(key)
        .and_then(|v| v.trim().parse::<T>().ok())
        .filter(|n| range.contains(n))
        .ok_or_else(|| bad_param(params, key, why))
}

fn flag(params: &Params, key: &str) -> Result<bool> {
    match params.get(key).map(String::as_str) {
        Some("true" | "1" | "yes") => Ok(true),
        Some("false" | "0" | "no") => Ok(false),
        _ => Err(bad_param(params, key, "expected true or false")),
    }
}

impl Config {
    fn from_params(params: &Params) -> Result<Config> {
        let library = match params.get("cufile_library").map(|s| s.trim()) {
            Some(path) if !path.is_empty() => PathBuf::from(path),
            _ => PathBuf::from(cufile::DEFAULT_LIBRARY),
        };
        let engine = match params.get("engine").map(String::as_str) {
            Some("auto") => EngineChoice::Auto,
            Some("threads") => EngineChoice::Only(EngineKind::Threads),
            Some("batch") => EngineChoice::Only(EngineKind::Batch),
            _ => {
                return Err(bad_param(
                    params,
                    "engine",
                    "expected auto, threads or batch",
                ))
            }
        };
        Ok(Config {
            library,
            driver_open_timeout: Duration::from_millis(number(
                params,
                "driver_open_timeout_ms",
                1..=600_000,
                "expected 1..=600000",
            )?),
            device_check: flag(params, "device_check")?,
            engine,
            threads: number(params, "threads", 1..=64, "expected 1..=64")?,
            batch_entries: number(params, "batch_entries", 1..=1024, "expected 1..=1024")?,
            batches: number(params, "batches", 1..=64, "expected 1..=64")?,
            chunk_bytes: number(
                params,
                "chunk_bytes",
                4096..=(1 << 30),
                "expected 4096..=1073741824",
            )?,
            max_requests: number(params, "max_requests", 1..=65536, "expected 1..=65536")?,
            max_ops: number(params, "max_ops", 1..=1 << 20, "expected 1..=1048576")?,
            register_buffers: flag(params, "register_buffers")?,
        })
    }
}

/// Why GDS cannot work here with `config`, or the loaded library: `dlopen` + `dlsym`,
/// the device pre-check (unless `device_check=false`) and what an earlier open in this
/// process left behind (a failure, or an open still running past the timeout). Nothing
/// in cuFile is called: `cuFileDriverOpen` happens only when a backend is created.
fn availability(config: &Config) -> std::result::Result<Arc<cufile::Library>, OpenError> {
    let lib = cufile::load(&config.library)?;
    if let Some(e) = lib.known_failure(&config.library, config.driver_open_timeout) {
        return Err(e);
    }
    if config.device_check {
        cufile::device_check(&lib, &config.library)?;
    }
    Ok(lib)
}

/// The configuration of the default parameters.
fn default_config() -> Config {
    let params = ferry_backend_api::effective_params(NAME, PARAMS, &Params::new())
        .expect("the defaults are valid");
    Config::from_params(&params).expect("the defaults are valid")
}

/// Load cuFile as a backend would (`config`): the checks of [`availability`], then its
/// driver opened within `driver_open_timeout_ms`.
fn open_cufile(config: &Config) -> std::result::Result<CuFile, OpenError> {
    let lib = availability(config)?;
    cufile::open(&lib, &config.library, config.driver_open_timeout)
}

/// How cuFile from `library` (`None` = `libcufile.so.0`) would move bytes here: GDS or
/// compatibility mode, and why — without making a backend. Like creation this opens
/// cuFile's driver (after the device pre-check, within the default
/// `driver_open_timeout_ms`); availability checks never do.
pub fn probe_mode(library: Option<&Path>) -> std::result::Result<IoMode, String> {
    let mut config = default_config();
    if let Some(library) = library {
        config.library = library.to_path_buf();
    }
    let cufile = open_cufile(&config).map_err(|e| e.to_string())?;
    Ok(cufile::detect_mode(&cufile))
}

/// Creates GDS backends. Registered under the name `GDS`.
#[derive(Clone, Copy, Debug, Default)]
pub struct GdsFactory;

impl BackendFactory for GdsFactory {
    fn name(&self) -> &'static str {
        NAME
    }

    fn params(&self) -> &'static [ParamSpec] {
        PARAMS
    }

    fn mem_kinds(&self) -> &'static [MemKind] {
        MEM_KINDS
    }

    /// The library loads and has cuFile's symbols, and (with the default
    /// `device_check`) the machine has an NVIDIA device and a CUDA driver library.
    /// Never calls into cuFile.
    fn available(&self) -> std::result::Result<(), String> {
        availability(&default_config())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn available_with(&self, params: &Params) -> std::result::Result<(), String> {
        let config = ferry_backend_api::effective_params(NAME, PARAMS, params)
            .and_then(|p| Config::from_params(&p))
            .map_err(|e| e.to_string())?;
        availability(&config).map(|_| ()).map_err(|e| e.to_string())
    }

    fn kind_available(&self, kind: MemKind) -> std::result::Result<(), String> {
        self.available()?;
        match kind {
            MemKind::Vram => vram_available(),
            MemKind::Dram | MemKind::File => Ok(()),
            other => Err(format!("GDS does not move {other}")),
        }
    }

    fn create(&self, init: &BackendInit<'_>) -> Result<Box<dyn Backend>> {
        Ok(Box::new(GdsBackend::new(init)?))
    }
}

/// The CUDA driver library loads and a device node exists; `cuInit` waits for a VRAM
/// registration.
#[cfg(feature = "cuda")]
fn vram_available() -> std::result::Result<(), String> {
    ferry_cuda::probe().map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn vram_available() -> std::result::Result<(), String> {
    Err("this build of ferry-gds has no VRAM support (feature `cuda`)".into())
}

/// A device context to make current on the thread that moves a VRAM region's bytes.
#[derive(Clone, Debug)]
pub(crate) struct DeviceCtx {
    #[cfg(feature = "cuda")]
    device: ferry_cuda::Device,
}

impl DeviceCtx {
    /// Make it current on this thread.
    pub(crate) fn bind(&self) -> std::result::Result<(), String> {
        #[cfg(feature = "cuda")]
        {
            self.device.bind().map_err(|e| e.to_string())
        }
        #[cfg(not(feature = "cuda"))]
        {
            Ok(())
        }
    }
}

struct FileEntry {
    handle: CUfileHandle,
    fd: RawFd,
    _owned: Option<OwnedFd>,
    path: Option<PathBuf>,
    start: u64,
    /// 0 = unbounded.
    len_bytes: u64,
    in_use: u32,
}

struct BufEntry {
    kind: MemKind,
    addr: u64,
    len_bytes: u64,
    registered: bool,
    ctx: Option<DeviceCtx>,
    in_use: u32,
}

struct Request {
    tag: u64,
    outstanding: u32,
    failure: Option<Failure>,
}

/// One piece of a range.
struct OpEntry {
    request: u64,
    range: u32,
    file: u64,
    buf: u64,
    job: IoJob,
}

/// The GDS backend. See the crate docs.
pub struct GdsBackend {
    params: Params,
    config: Config,
    cufile: Arc<CuFile>,
    mode: IoMode,
    files: Slots<FileEntry>,
    bufs: Slots<BufEntry>,
    requests: Slots<Request>,
    ops: Slots<OpEntry>,
    /// Operation tokens waiting for the engine (capacity = `max_ops`, never grows).
    pending: VecDeque<u64>,
    /// Finished or refused operations of one drain (capacity = `max_ops`).
    scratch: Vec<(u64, IoOutcome)>,
    engine: Engine,
    /// The batch engine left for the thread engine (cuFile refused batches here), kept
    /// until its batches in flight are reported.
    retired: Option<BatchEngine>,
    /// Why the thread engine runs although batches were asked for.
    fallback: Option<String>,
}

enum Engine {
    Threads(ThreadEngine),
    Batch(BatchEngine),
}

// SAFETY: the raw cuFile handles are owned by this backend and used only through
// `&mut self` (or by workers, which cuFile allows: its calls are thread-safe).
unsafe impl Send for GdsBackend {}

fn descriptor(index: usize, addr: u64, len: u64, dev: u64) -> Subject {
    Subject::Descriptor {
        index: index as u32,
        addr,
        len,
        dev,
    }
}

/// The engine's error for a cuFile that cannot be loaded or opened: a machine without
/// a GPU or CUDA driver is `NotSupported`; a missing library, a failed or timed-out
/// driver open is `Backend` (errno `ENOENT`, `EIO`, `ETIMEDOUT`). Each names the library.
fn open_error(e: OpenError) -> Error {
    let errno = match &e {
        OpenError::NoNvidiaDevice { .. } | OpenError::NoCudaDriver { .. } => {
            return Error::NotSupported {
                backend: NAME.into(),
                what: e.to_string().into(),
            }
        }
        OpenError::NotFound { .. } | OpenError::NotCuFile { .. } => libc::ENOENT,
        OpenError::Driver { .. } => libc::EIO,
        OpenError::TimedOut { .. } => libc::ETIMEDOUT,
        OpenError::Spawn { .. } => libc::EAGAIN,
    };
    Error::Backend {
        backend: NAME.into(),
        errno,
        desc: None,
        detail: e.to_string().into(),
    }
}

fn cufile_error(what: &str, err: cufile::CUfileError) -> Error {
    Error::Backend {
        backend: NAME.into(),
        errno: libc::EIO,
        desc: None,
        detail: format!("{what}: {}", cufile::describe(err)).into(),
    }
}

impl GdsBackend {
    /// Create a backend (what [`GdsFactory::create`] does, with the concrete type).
    pub fn new(init: &BackendInit<'_>) -> Result<GdsBackend> {
        let params = ferry_backend_api::effective_params(NAME, PARAMS, init.params)?;
        let config = Config::from_params(&params)?;
        let cufile = Arc::new(open_cufile(&config).map_err(open_error)?);
        let mode = cufile::detect_mode(&cufile);
        let max_batch = cufile.props.max_batch_io_size as usize;
        if max_batch != 0 && config.batch_entries > max_batch {
            return Err(bad_param(
                &params,
                "batch_entries",
                &format!("the driver takes at most {max_batch} entries per batch"),
            ));
        }
        let kind = match config.engine {
            EngineChoice::Only(kind) => kind,
            EngineChoice::Auto
                if cufile.api.batch.is_some() && matches!(mode, IoMode::Direct { .. }) =>
            {
                EngineKind::Batch
            }
            EngineChoice::Auto => EngineKind::Threads,
        };
        let mut fallback = None;
        let engine = match kind {
            EngineKind::Threads => Engine::Threads(Self::threads(&cufile, &config)?),
            EngineKind::Batch => {
                let Some(batch) = cufile.api.batch else {
                    return Err(Error::NotSupported {
                        backend: NAME.into(),
                        what: format!(
                            "engine=batch: {} has no batch API (cuFileBatchIOSetUp)",
                            cufile.library.display()
                        )
                        .into(),
                    });
                };
                match BatchEngine::new(batch, config.batches, config.batch_entries) {
                    Ok(engine) => Engine::Batch(engine),
                    // cuFile cannot run batches here (older cuFile in compatibility
                    // mode): its limit, not a reason to fail; threads move the bytes.
                    Err(e)
                        if cufile::batch_unsupported(e.err)
                            || !matches!(mode, IoMode::Direct { .. }) =>
                    {
                        fallback = Some(format!(
                            "cuFileBatchIOSetUp refused batches: {}",
                            cufile::describe(e)
                        ));
                        Engine::Threads(Self::threads(&cufile, &config)?)
                    }
                    Err(e) => return Err(cufile_error("cuFileBatchIOSetUp", e)),
                }
            }
        };
        let backend = GdsBackend {
            params,
            files: Slots::with_capacity(64),
            bufs: Slots::with_capacity(64),
            requests: Slots::with_capacity(config.max_requests),
            ops: Slots::with_capacity(config.max_ops),
            pending: VecDeque::with_capacity(config.max_ops),
            scratch: Vec::with_capacity(config.max_ops),
            config,
            cufile,
            mode,
            engine,
            retired: None,
            fallback,
        };
        match &backend.fallback {
            Some(_) => log::warn!("GDS: {}", backend.description()),
            None => log::info!("GDS: {}", backend.description()),
        }
        Ok(backend)
    }

    fn threads(cufile: &CuFile, config: &Config) -> Result<ThreadEngine> {
        ThreadEngine::new(cufile.api, config.threads, config.max_ops).map_err(|e| Error::Backend {
            backend: NAME.into(),
            errno: e.raw_os_error().unwrap_or(libc::EAGAIN),
            desc: None,
            detail: format!("cannot start worker threads: {e}").into(),
        })
    }

    /// Move every later operation with the thread engine: cuFile said `why` about
    /// batches. The batch engine stays until its batches in flight are reported.
    fn fall_back(&mut self, why: String) {
        let threads = match Self::threads(&self.cufile, &self.config) {
            Ok(t) => t,
            Err(e) => {
                log::error!("GDS: cannot leave the batch engine ({why}): {e}");
                return;
            }
        };
        if let Engine::Batch(batch) = std::mem::replace(&mut self.engine, Engine::Threads(threads))
        {
            self.retired = Some(batch);
        }
        log::warn!("GDS: {why}; the thread engine moves the bytes from now on");
        self.fallback = Some(why);
    }

    /// Why the thread engine runs although batches were asked for (`None`: as asked).
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Library, mode and engine in words (`cuFile from <path>, GDS (nvidia-fs 2.26),
    /// engine Batch`): logged at creation and in the agent's "backend created" line.
    fn description(&self) -> String {
        format!(
            "cuFile from {}, {}, engine {:?}{}",
            self.cufile.library.display(),
            self.mode,
            self.engine(),
            match &self.fallback {
                Some(why) => format!(" (batch asked for; {why})"),
                None => String::new(),
            }
        )
    }

    /// How cuFile moves bytes here (GDS or compatibility mode, and why).
    pub fn io_mode(&self) -> &IoMode {
        &self.mode
    }

    /// The engine in use.
    pub fn engine(&self) -> EngineKind {
        match self.engine {
            Engine::Threads(_) => EngineKind::Threads,
            Engine::Batch(_) => EngineKind::Batch,
        }
    }

    /// The cuFile library in use.
    pub fn library(&self) -> &Path {
        &self.cufile.library
    }

    /// Requests and operations in flight (queued or running).
    pub fn in_flight(&self) -> (usize, usize) {
        (self.requests.len(), self.ops.len())
    }

    fn register_file(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        let desc = region.desc;
        if desc.addr.checked_add(desc.len).is_none() || desc.addr > i64::MAX as u64 {
            return Err(Error::invalid(
                descriptor(0, desc.addr, desc.len, desc.dev),
                "file region wraps the offset space",
            ));
        }
        let (fd, owned, path) = match region.path {
            Some((path, mode)) => {
                let fd = mode.open(path, NAME)?;
                (fd.as_raw_fd(), Some(fd), Some(path.to_path_buf()))
            }
            None => {
                let fd = RawFd::try_from(desc.dev).map_err(|_| {
                    Error::invalid(
                        descriptor(0, desc.addr, desc.len, desc.dev),
                        "device id is not a file descriptor",
                    )
                })?;
                // SAFETY: F_GETFL only reads the descriptor's status flags.
                if unsafe { libc::fcntl(fd, libc::F_GETFL) } < 0 {
                    let e = std::io::Error::last_os_error();
                    return Err(Error::Backend {
                        backend: NAME.into(),
                        errno: e.raw_os_error().unwrap_or(libc::EBADF),
                        desc: Some(0),
                        detail: format!("file descriptor {fd} is not usable: {e}").into(),
                    });
                }
                (fd, None, None)
            }
        };
        let mut descr = CUfileDescr {
            type_: cufile::CU_FILE_HANDLE_TYPE_OPAQUE_FD,
            handle: CUfileDescrHandle { fd },
            fs_ops: std::ptr::null(),
        };
        let mut handle: CUfileHandle = std::ptr::null_mut();
        // SAFETY: descr names an open descriptor (owned above, or promised by the caller
        // to stay open until deregistration); both pointers are valid for the call.
        let status = unsafe { (self.cufile.api.handle_register)(&mut handle, &mut descr) };
        if status.err != cufile::CU_FILE_SUCCESS {
            let name = path
                .as_ref()
                .map(|p| format!("file '{}'", p.display()))
                .unwrap_or_else(|| format!("file descriptor {fd}"));
            return Err(cufile_error(
                &format!("cuFileHandleRegister({name})"),
                status,
            ));
        }
        let token = self.files.insert(FileEntry {
            handle,
            fd,
            _owned: owned,
            path,
            start: desc.addr,
            len_bytes: desc.len,
            in_use: 0,
        });
        Ok(Registered {
            token,
            public_md: Vec::new(),
        })
    }

    fn register_buf(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        let desc = region.desc;
        if desc.addr == 0 || desc.len == 0 || desc.end().is_none() {
            return Err(Error::invalid(
                descriptor(0, desc.addr, desc.len, desc.dev),
                "a GDS buffer needs a non-null address and a non-zero length",
            ));
        }
        let ctx = if region.kind == MemKind::Vram {
            Some(self.device_ctx(desc.addr, desc.len, desc.dev)?)
        } else {
            None
        };
        let mut registered = false;
        if self.config.register_buffers {
            // SAFETY: the caller promises the range stays valid until deregistration
            // (Backend::register); cuFile pins or maps it for that long.
            let status = unsafe {
                (self.cufile.api.buf_register)(desc.addr as *const _, desc.len as usize, 0)
            };
            if status.err != cufile::CU_FILE_SUCCESS {
                return Err(cufile_error(
                    &format!(
                        "cuFileBufRegister({} at {:#x}, {} bytes)",
                        region.kind, desc.addr, desc.len
                    ),
                    status,
                ));
            }
            registered = true;
        }
        let token = self.bufs.insert(BufEntry {
            kind: region.kind,
            addr: desc.addr,
            len_bytes: desc.len,
            registered,
            ctx,
            in_use: 0,
        });
        Ok(Registered {
            token,
            public_md: Vec::new(),
        })
    }

    #[cfg(feature = "cuda")]
    fn device_ctx(&self, addr: u64, len: u64, dev: u64) -> Result<DeviceCtx> {
        let device = ferry_cuda::Device::open(dev).map_err(|e| e.into_error(NAME))?;
        device.bind().map_err(|e| e.into_error(NAME))?;
        ferry_cuda::check_device_range(addr, len, dev).map_err(|e| e.into_error(NAME))?;
        Ok(DeviceCtx { device })
    }

    #[cfg(not(feature = "cuda"))]
    fn device_ctx(&self, _addr: u64, _len: u64, _dev: u64) -> Result<DeviceCtx> {
        Err(Error::NotSupported {
            backend: NAME.into(),
            what: "VRAM: this build of ferry-gds has no CUDA support (feature `cuda`)".into(),
        })
    }

    fn check_post(&self, endpoint: Endpoint, post: &Post<'_>) -> Result<()> {
        if let Endpoint::Peer(_) = endpoint {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: "transfers to other agents (GDS is local only)".into(),
            });
        }
        if !matches!(post.local_kind, MemKind::Dram | MemKind::Vram)
            || post.remote_kind != MemKind::File
        {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!(
                    "{} ↔ {} transfers (only DRAM/VRAM ↔ FILE)",
                    post.local_kind, post.remote_kind
                )
                .into(),
            });
        }
        for (i, range) in post.ranges.iter().enumerate() {
            let subject = || descriptor(i, range.local_addr, range.len, range.local_dev);
            let buf = self
                .bufs
                .get(range.local_token)
                .ok_or_else(|| Error::not_found(subject()))?;
            if buf.kind != post.local_kind {
                return Err(Error::invalid(
                    subject(),
                    format!("region is {}, request says {}", buf.kind, post.local_kind),
                ));
            }
            let end = range.local_addr.checked_add(range.len);
            if range.local_addr < buf.addr || end.is_none_or(|e| e > buf.addr + buf.len_bytes) {
                return Err(Error::invalid(subject(), "range outside its buffer region"));
            }
            let file = self.files.get(range.remote_token).ok_or_else(|| {
                Error::not_found(descriptor(
                    i,
                    range.remote_addr,
                    range.len,
                    range.remote_dev,
                ))
            })?;
            let file_end = range.remote_addr.checked_add(range.len);
            let inside = range.remote_addr >= file.start
                && file_end.is_some_and(|e| {
                    e <= i64::MAX as u64
                        && (file.len_bytes == 0 || e <= file.start + file.len_bytes)
                });
            if !inside {
                return Err(Error::invalid(
                    descriptor(i, range.remote_addr, range.len, range.remote_dev),
                    "range outside its file region",
                ));
            }
        }
        Ok(())
    }

    /// Operations `post` would make (pieces of `chunk_bytes`).
    fn ops_of(&self, post: &Post<'_>) -> usize {
        post.ranges
            .iter()
            .map(|r| r.len.div_ceil(self.config.chunk_bytes) as usize)
            .sum()
    }

    fn complete_op(&mut self, token: u64, outcome: IoOutcome, done: &mut Completions) {
        let Some(op) = self.ops.get_mut(token) else {
            log::error!("GDS: completion for unknown operation {token:#x}");
            return;
        };
        let failure = match outcome {
            IoOutcome::Done(bytes) if bytes >= op.job.len => None,
            IoOutcome::Done(bytes) if bytes > 0 => {
                // Partial: continue where it stopped (the batch engine reports these).
                op.job.buf_offset += bytes as i64;
                op.job.file_offset += bytes as i64;
                op.job.len -= bytes;
                self.pending.push_front(token);
                return;
            }
            IoOutcome::Done(_) => Some(Failure {
                kind: if op.job.write {
                    FailureKind::Backend
                } else {
                    FailureKind::ShortRead
                },
                errno: if op.job.write { libc::EIO } else { 0 },
                range: Some(op.range),
            }),
            IoOutcome::Short => Some(Failure {
                kind: FailureKind::ShortRead,
                errno: 0,
                range: Some(op.range),
            }),
            IoOutcome::Errno(errno) => Some(Failure {
                kind: FailureKind::Backend,
                errno,
                range: Some(op.range),
            }),
            IoOutcome::CuFile(code) => {
                log::warn!(
                    "GDS: operation on range #{} failed: {} ({code})",
                    op.range,
                    cufile::error_name(code)
                );
                Some(Failure {
                    kind: FailureKind::Backend,
                    errno: libc::EIO,
                    range: Some(op.range),
                })
            }
        };
        let op = self.ops.remove(token).expect("checked above");
        if let Some(file) = self.files.get_mut(op.file) {
            file.in_use -= 1;
        }
        if let Some(buf) = self.bufs.get_mut(op.buf) {
            buf.in_use -= 1;
        }
        let Some(request) = self.requests.get_mut(op.request) else {
            log::error!("GDS: operation of unknown request {:#x}", op.request);
            return;
        };
        if request.failure.is_none() {
            request.failure = failure;
        }
        request.outstanding -= 1;
        if request.outstanding == 0 {
            let request = self.requests.remove(op.request).expect("checked above");
            match request.failure {
                None => done.success(request.tag),
                Some(failure) => done.failure(request.tag, failure),
            }
        }
    }

    /// Hand queued operations to the engine as far as it has room; operations whose
    /// submission the engine refused fail here.
    fn feed(&mut self, done: &mut Completions) {
        let mut refused = std::mem::take(&mut self.scratch);
        match &mut self.engine {
            Engine::Threads(threads) => {
                while let Some(token) = self.pending.pop_front() {
                    let op = self.ops.get(token).expect("queued operations exist");
                    threads.push(token, op.job.clone());
                }
                threads.wake();
            }
            Engine::Batch(batch) => {
                let mut unsupported = None;
                while !self.pending.is_empty() {
                    let Some(slot) = batch.idle_slot() else { break };
                    let n = self.pending.len().min(batch.entries());
                    for _ in 0..n {
                        let token = self.pending.pop_front().expect("counted");
                        let op = self.ops.get(token).expect("queued operations exist");
                        batch.add(slot, token, &op.job);
                    }
                    unsupported = batch.launch(slot, &mut refused, &mut self.pending);
                    if unsupported.is_some() {
                        break;
                    }
                }
                if let Some(e) = unsupported {
                    for (token, outcome) in refused.drain(..) {
                        self.complete_op(token, outcome, done);
                    }
                    self.scratch = refused;
                    self.fall_back(format!(
                        "cuFileBatchIOSubmit refused batches: {}",
                        cufile::describe(e)
                    ));
                    if matches!(self.engine, Engine::Threads(_)) {
                        // Nothing of them moved: the threads take them now.
                        self.feed(done);
                    }
                    return;
                }
            }
        }
        for (token, outcome) in refused.drain(..) {
            self.complete_op(token, outcome, done);
        }
        self.scratch = refused;
    }

    fn drain_engine(&mut self, done: &mut Completions) {
        let mut finished = std::mem::take(&mut self.scratch);
        let mut unsupported = None;
        match &mut self.engine {
            Engine::Threads(t) => t.reap(&mut finished),
            Engine::Batch(b) => {
                b.poll(&mut finished);
                unsupported = b.take_unsupported();
            }
        }
        if let Some(retired) = &mut self.retired {
            retired.poll(&mut finished);
            if !retired.busy() {
                if let Some(mut retired) = self.retired.take() {
                    retired.shutdown();
                }
            }
        }
        for (token, outcome) in finished.drain(..) {
            self.complete_op(token, outcome, done);
        }
        self.scratch = finished;
        if let Some(e) = unsupported {
            self.fall_back(format!(
                "cuFileBatchIOGetStatus refused batches: {}",
                cufile::describe(e)
            ));
        }
    }
}

impl Backend for GdsBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            remote: false,
            local: true,
            notifications: false,
            mem_kinds: MEM_KINDS,
        }
    }

    fn params(&self) -> &Params {
        &self.params
    }

    fn describe(&self) -> Option<String> {
        Some(self.description())
    }

    unsafe fn register(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        match region.kind {
            MemKind::File => self.register_file(region),
            MemKind::Dram | MemKind::Vram => self.register_buf(region),
            other => Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!("memory kind {other}").into(),
            }),
        }
    }

    unsafe fn deregister(&mut self, kind: MemKind, token: u64) -> Result<()> {
        let subject = || Subject::Named(format!("GDS {kind} region token {token:#x}").into());
        match kind {
            MemKind::File => {
                let entry = self
                    .files
                    .get(token)
                    .ok_or_else(|| Error::not_found(subject()))?;
                if entry.in_use > 0 {
                    return Err(Error::NotAllowed {
                        subject: subject(),
                        reason: format!("in use by {} operation(s)", entry.in_use).into(),
                    });
                }
                let entry = self.files.remove(token).expect("checked above");
                // SAFETY: registered by us; no operation uses it (checked above).
                unsafe { (self.cufile.api.handle_deregister)(entry.handle) };
                let _ = entry.fd;
                Ok(())
            }
            MemKind::Dram | MemKind::Vram => {
                let entry = self
                    .bufs
                    .get(token)
                    .filter(|b| b.kind == kind)
                    .ok_or_else(|| Error::not_found(subject()))?;
                if entry.in_use > 0 {
                    return Err(Error::NotAllowed {
                        subject: subject(),
                        reason: format!("in use by {} operation(s)", entry.in_use).into(),
                    });
                }
                let entry = self.bufs.remove(token).expect("checked above");
                if entry.registered {
                    if let Some(ctx) = &entry.ctx {
                        let _ = ctx.bind();
                    }
                    // SAFETY: registered by us at this base; no operation uses it.
                    let status =
                        unsafe { (self.cufile.api.buf_deregister)(entry.addr as *const _) };
                    if status.err != cufile::CU_FILE_SUCCESS {
                        return Err(cufile_error("cuFileBufDeregister", status));
                    }
                }
                Ok(())
            }
            other => Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!("memory kind {other}").into(),
            }),
        }
    }

    fn conn_info(&self) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }

    fn load_remote(&mut self, _peer: PeerId, _remote: RemoteAgent<'_>) -> Result<()> {
        // Local only: nothing of a peer is usable, but knowing it does no harm.
        Ok(())
    }

    fn unload_remote(&mut self, _peer: PeerId) {}

    fn validate(&self, endpoint: Endpoint, post: &Post<'_>) -> Result<()> {
        self.check_post(endpoint, post)
    }

    fn describe_target(&self, kind: MemKind, token: u64) -> Option<String> {
        (kind == MemKind::File)
            .then(|| self.files.get(token)?.path.as_ref())
            .flatten()
            .map(|p| format!("file '{}'", p.display()))
    }

    unsafe fn post(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()> {
        let _span = ferry_backend_api::trace_span!("ferry-gds::post");
        for post in batch {
            self.check_post(endpoint, post)?;
        }
        let ops_needed: usize = batch.iter().map(|p| self.ops_of(p)).sum();
        if batch.len() > self.requests.vacant() {
            return Err(Error::Capacity {
                what: "GDS requests in flight (parameter max_requests)",
                limit: self.config.max_requests,
            });
        }
        if ops_needed > self.ops.vacant() {
            return Err(Error::Capacity {
                what: "GDS operations in flight (parameter max_ops)",
                limit: self.config.max_ops,
            });
        }
        let chunk = self.config.chunk_bytes;
        for post in batch {
            let request = self.requests.insert(Request {
                tag: post.tag,
                outstanding: 0,
                failure: None,
            });
            let mut count = 0u32;
            for (i, range) in post.ranges.iter().enumerate() {
                if range.len == 0 {
                    continue;
                }
                let (buf_base, ctx, registered) = {
                    let buf = self.bufs.get(range.local_token).expect("validated");
                    (buf.addr, buf.ctx.clone(), buf.registered)
                };
                let handle = self
                    .files
                    .get(range.remote_token)
                    .expect("validated")
                    .handle;
                let mut offset = 0u64;
                loop {
                    let len = (range.len - offset).min(chunk);
                    // A registered buffer is named by its base plus an offset (cuFile
                    // looks the base up); an unregistered one by its address.
                    let (base, buf_offset) = if registered {
                        (buf_base, (range.local_addr - buf_base + offset) as i64)
                    } else {
                        (range.local_addr + offset, 0)
                    };
                    let job = IoJob {
                        handle: handle as usize,
                        buf_base: base,
                        buf_offset,
                        file_offset: (range.remote_addr + offset) as i64,
                        len,
                        write: post.op == Op::Write,
                        ctx: ctx.clone(),
                    };
                    let token = self.ops.insert(OpEntry {
                        request,
                        range: i as u32,
                        file: range.remote_token,
                        buf: range.local_token,
                        job,
                    });
                    self.pending.push_back(token);
                    self.bufs
                        .get_mut(range.local_token)
                        .expect("validated")
                        .in_use += 1;
                    self.files
                        .get_mut(range.remote_token)
                        .expect("validated")
                        .in_use += 1;
                    count += 1;
                    offset += len;
                    if offset >= range.len {
                        break;
                    }
                }
            }
            if count == 0 {
                self.requests.remove(request);
                done.success(post.tag);
            } else {
                self.requests
                    .get_mut(request)
                    .expect("just made")
                    .outstanding = count;
            }
        }
        self.feed(done);
        self.drain_engine(done);
        Ok(())
    }

    fn progress(&mut self, done: &mut Completions) {
        let _span = ferry_backend_api::trace_span!("ferry-gds::progress");
        self.drain_engine(done);
        self.feed(done);
    }
}

impl Drop for GdsBackend {
    fn drop(&mut self) {
        // Let every operation that names caller memory finish before handles and
        // buffers are deregistered; queued ones never started.
        match &mut self.engine {
            Engine::Threads(t) => t.shutdown(),
            Engine::Batch(b) => b.shutdown(),
        }
        if let Some(retired) = &mut self.retired {
            retired.shutdown();
        }
        let api = self.cufile.api;
        for entry in self.files.drain() {
            // SAFETY: registered by us; the engine is stopped, nothing uses it.
            unsafe { (api.handle_deregister)(entry.handle) };
        }
        for entry in self.bufs.drain() {
            if entry.registered {
                if let Some(ctx) = &entry.ctx {
                    let _ = ctx.bind();
                }
                // SAFETY: registered by us; nothing uses it any more.
                unsafe { (api.buf_deregister)(entry.addr as *const _) };
            }
        }
    }
}
