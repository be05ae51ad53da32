//! Our own bindings to cuFile (`cufile.h`), loaded at run time with libloading.
//!
//! Only what the backend calls is declared. The struct layouts follow `cufile.h` of
//! CUDA 12/13 (unchanged since cuFile 1.x added the batch API) and are pinned by the
//! `const` assertions below; the stand-in library the tests compile asserts the same
//! sizes and offsets with `_Static_assert`, so a drift shows on both sides.

use std::ffi::{c_int, c_long, c_uint, c_void};
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// The file name of cuFile in a CUDA install or the `nvidia-cufile` wheel.
pub const DEFAULT_LIBRARY: &str = "libcufile.so.0";

/// `CUfileError_t`: a cuFile error code plus the CUDA driver's for `CU_FILE_CUDA_DRIVER_ERROR`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CUfileError {
    /// `CUfileOpError` (0 = success; 5000 + n otherwise).
    pub err: c_uint,
    /// `CUresult`.
    pub cu_err: c_uint,
}

/// `CU_FILE_SUCCESS`.
pub const CU_FILE_SUCCESS: c_uint = 0;
/// `CU_FILE_DRIVER_NOT_INITIALIZED`.
pub const CU_FILE_DRIVER_NOT_INITIALIZED: c_uint = 5001;
/// `CU_FILE_DRIVER_ALREADY_OPEN` (accepted as success by [`open`]).
pub const CU_FILE_DRIVER_ALREADY_OPEN: c_uint = 5026;
/// `CU_FILE_CUDA_DRIVER_ERROR`.
pub const CU_FILE_CUDA_DRIVER_ERROR: c_uint = 5011;
/// `CU_FILE_HANDLE_TYPE_OPAQUE_FD`.
pub const CU_FILE_HANDLE_TYPE_OPAQUE_FD: c_uint = 1;
/// `CUFILE_BATCH` (the only `CUfileBatchMode_t`).
pub const CUFILE_BATCH: c_uint = 1;
/// `CUFILE_READ`.
pub const CUFILE_READ: c_uint = 0;
/// `CUFILE_WRITE`.
pub const CUFILE_WRITE: c_uint = 1;
/// `CUfileStatus_t` values.
pub const CUFILE_WAITING: c_uint = 1;
/// Submitted, not finished.
pub const CUFILE_PENDING: c_uint = 2;
/// Bad parameters.
pub const CUFILE_INVALID: c_uint = 4;
/// Canceled.
pub const CUFILE_CANCELED: c_uint = 8;
/// Done (`ret` = bytes).
pub const CUFILE_COMPLETE: c_uint = 16;
/// Timed out.
pub const CUFILE_TIMEOUT: c_uint = 32;
/// Failed (`ret` = error).
pub const CUFILE_FAILED: c_uint = 64;
/// Bit of `CUfileDrvProps::nvfs.dcontrolflags`: compatibility mode allowed.
pub const CU_FILE_ALLOW_COMPAT_MODE_BIT: c_uint = 1;

/// The handle union of `CUfileDescr_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union CUfileDescrHandle {
    /// For `CU_FILE_HANDLE_TYPE_OPAQUE_FD`.
    pub fd: c_int,
    /// Other handle types.
    pub handle: *mut c_void,
}

/// `CUfileDescr_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUfileDescr {
    /// `CUfileFileHandleType`.
    pub type_: c_uint,
    /// The file.
    pub handle: CUfileDescrHandle,
    /// `const CUfileFSOps_t *` (NULL for ordinary files).
    pub fs_ops: *const c_void,
}

/// `CUfileHandle_t`.
pub type CUfileHandle = *mut c_void;
/// `CUfileBatchHandle_t`.
pub type CUfileBatchHandle = *mut c_void;

/// The `batch` member of `CUfileIOParams_t::u`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUfileBatchIo {
    /// Buffer base (as registered).
    pub dev_ptr_base: *mut c_void,
    /// File offset.
    pub file_offset: i64,
    /// Offset from the buffer base.
    pub dev_ptr_offset: i64,
    /// Bytes.
    pub size: usize,
}

/// `CUfileIOParams_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUfileIOParams {
    /// `CUFILE_BATCH`.
    pub mode: c_uint,
    /// The I/O.
    pub batch: CUfileBatchIo,
    /// The registered file.
    pub fh: CUfileHandle,
    /// `CUFILE_READ` / `CUFILE_WRITE`.
    pub opcode: c_uint,
    /// Returned in the event.
    pub cookie: *mut c_void,
}

/// `CUfileIOEvents_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUfileIOEvents {
    /// The params' cookie.
    pub cookie: *mut c_void,
    /// `CUfileStatus_t`.
    pub status: c_uint,
    /// Bytes moved, or an error.
    pub ret: usize,
}

/// `CUfileDrvProps_t::nvfs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUfileNvfsProps {
    /// nvidia-fs major version (0 when it is not loaded).
    pub major_version: c_uint,
    /// nvidia-fs minor version.
    pub minor_version: c_uint,
    /// Poll-mode threshold.
    pub poll_thresh_size: usize,
    /// Largest direct I/O.
    pub max_direct_io_size: usize,
    /// `CUfileDriverStatusFlags` bits.
    pub dstatusflags: c_uint,
    /// `CUfileDriverControlFlags` bits.
    pub dcontrolflags: c_uint,
}

/// `CUfileDrvProps_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUfileDrvProps {
    /// nvidia-fs.
    pub nvfs: CUfileNvfsProps,
    /// `CUfileFeatureFlags` bits.
    pub fflags: c_uint,
    /// Device cache (KiB).
    pub max_device_cache_size: c_uint,
    /// Per-buffer cache (KiB).
    pub per_buffer_cache_size: c_uint,
    /// Pinned device memory (KiB).
    pub max_device_pinned_mem_size: c_uint,
    /// Entries per batch.
    pub max_batch_io_size: c_uint,
    /// Batch timeout.
    pub max_batch_io_timeout_msecs: c_uint,
}

// The layouts of cufile.h on LP64 (the stand-in asserts the same numbers).
const _: () = {
    assert!(size_of::<CUfileError>() == 8);
    assert!(size_of::<CUfileDescr>() == 24);
    assert!(offset_of!(CUfileDescr, handle) == 8);
    assert!(offset_of!(CUfileDescr, fs_ops) == 16);
    assert!(size_of::<CUfileIOParams>() == 64);
    assert!(offset_of!(CUfileIOParams, batch) == 8);
    assert!(offset_of!(CUfileIOParams, fh) == 40);
    assert!(offset_of!(CUfileIOParams, opcode) == 48);
    assert!(offset_of!(CUfileIOParams, cookie) == 56);
    assert!(size_of::<CUfileIOEvents>() == 24);
    assert!(offset_of!(CUfileIOEvents, status) == 8);
    assert!(offset_of!(CUfileIOEvents, ret) == 16);
    assert!(size_of::<CUfileNvfsProps>() == 32);
    assert!(size_of::<CUfileDrvProps>() == 56);
    assert!(offset_of!(CUfileDrvProps, max_batch_io_size) == 48);
};

/// `struct timespec`.
pub type Timespec = libc::timespec;

type ErrFn0 = unsafe extern "C" fn() -> CUfileError;

/// The batch API (absent from old cuFile builds).
#[derive(Clone, Copy)]
pub struct BatchApi {
    /// `cuFileBatchIOSetUp`.
    pub set_up: unsafe extern "C" fn(*mut CUfileBatchHandle, c_uint) -> CUfileError,
    /// `cuFileBatchIOSubmit`.
    pub submit:
        unsafe extern "C" fn(CUfileBatchHandle, c_uint, *mut CUfileIOParams, c_uint) -> CUfileError,
    /// `cuFileBatchIOGetStatus`.
    pub get_status: unsafe extern "C" fn(
        CUfileBatchHandle,
        c_uint,
        *mut c_uint,
        *mut CUfileIOEvents,
        *mut Timespec,
    ) -> CUfileError,
    /// `cuFileBatchIOCancel`.
    pub cancel: unsafe extern "C" fn(CUfileBatchHandle) -> CUfileError,
    /// `cuFileBatchIODestroy`.
    pub destroy: unsafe extern "C" fn(CUfileBatchHandle),
}

/// The function table. Plain function pointers: `Copy`, shareable with worker threads.
#[derive(Clone, Copy)]
pub struct Api {
    /// `cuFileDriverOpen`.
    pub driver_open: ErrFn0,
    /// `cuFileDriverGetProperties`.
    pub driver_get_properties: unsafe extern "C" fn(*mut CUfileDrvProps) -> CUfileError,
    /// `cuFileHandleRegister`.
    pub handle_register: unsafe extern "C" fn(*mut CUfileHandle, *mut CUfileDescr) -> CUfileError,
    /// `cuFileHandleDeregister`.
    pub handle_deregister: unsafe extern "C" fn(CUfileHandle),
    /// `cuFileBufRegister`.
    pub buf_register: unsafe extern "C" fn(*const c_void, usize, c_int) -> CUfileError,
    /// `cuFileBufDeregister`.
    pub buf_deregister: unsafe extern "C" fn(*const c_void) -> CUfileError,
    /// `cuFileRead`.
    pub read: unsafe extern "C" fn(CUfileHandle, *mut c_void, usize, i64, i64) -> isize,
    /// `cuFileWrite`.
    pub write: unsafe extern "C" fn(CUfileHandle, *const c_void, usize, i64, i64) -> isize,
    /// `cuFileUseCount` (optional).
    pub use_count: Option<unsafe extern "C" fn() -> c_long>,
    /// The batch API, when the library has it.
    pub batch: Option<BatchApi>,
}

// SAFETY: function pointers into a library that stays loaded for the process's life
// (see `load`); cuFile's entry points are thread-safe.
unsafe impl Send for Api {}
// SAFETY: as above; the table is never mutated.
unsafe impl Sync for Api {}

/// A loaded cuFile: its table, where it came from, and the driver state.
pub struct CuFile {
    /// The functions.
    pub api: Api,
    /// The library as named when loading.
    pub library: PathBuf,
    /// Driver properties read after `cuFileDriverOpen`.
    pub props: CUfileDrvProps,
}

impl std::fmt::Debug for CuFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CuFile")
            .field("library", &self.library)
            .finish()
    }
}

/// The text of a cuFile error code.
pub fn error_name(code: c_uint) -> &'static str {
    match code {
        0 => "CU_FILE_SUCCESS",
        5001 => "CU_FILE_DRIVER_NOT_INITIALIZED",
        5002 => "CU_FILE_DRIVER_INVALID_PROPS",
        5004 => "CU_FILE_DRIVER_VERSION_MISMATCH",
        5007 => "CU_FILE_PLATFORM_NOT_SUPPORTED",
        5008 => "CU_FILE_IO_NOT_SUPPORTED",
        5009 => "CU_FILE_DEVICE_NOT_SUPPORTED",
        5010 => "CU_FILE_NVFS_DRIVER_ERROR",
        5011 => "CU_FILE_CUDA_DRIVER_ERROR",
        5012 => "CU_FILE_CUDA_POINTER_INVALID",
        5013 => "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
        5014 => "CU_FILE_CUDA_POINTER_RANGE_ERROR",
        5015 => "CU_FILE_CUDA_CONTEXT_MISMATCH",
        5018 => "CU_FILE_INVALID_FILE_TYPE",
        5019 => "CU_FILE_INVALID_FILE_OPEN_FLAG",
        5020 => "CU_FILE_DIO_NOT_SET",
        5022 => "CU_FILE_INVALID_VALUE",
        5023 => "CU_FILE_MEMORY_ALREADY_REGISTERED",
        5024 => "CU_FILE_MEMORY_NOT_REGISTERED",
        5025 => "CU_FILE_PERMISSION_DENIED",
        5026 => "CU_FILE_DRIVER_ALREADY_OPEN",
        5027 => "CU_FILE_HANDLE_NOT_REGISTERED",
        5028 => "CU_FILE_HANDLE_ALREADY_REGISTERED",
        5029 => "CU_FILE_DEVICE_NOT_FOUND",
        5030 => "CU_FILE_INTERNAL_ERROR",
        5034 => "CU_FILE_IO_DISABLED",
        5049 => "CU_FILE_BATCH_NOCOMPAT_ERROR",
        _ => "cuFile error",
    }
}

/// Whether `code` says this cuFile cannot run batches here (compatibility mode without
/// nvidia-fs, I/O or platform unsupported) rather than that one batch was wrong: the
/// GDS backend then moves the batch's operations with its thread engine instead.
pub fn batch_unsupported(code: c_uint) -> bool {
    matches!(code, 5007 | 5008 | 5034 | 5049)
}

/// `err` as text, with the CUDA code when cuFile blames the driver.
pub fn describe(err: CUfileError) -> String {
    if err.err == CU_FILE_CUDA_DRIVER_ERROR {
        format!(
            "{} ({}, CUresult {})",
            error_name(err.err),
            err.err,
            err.cu_err
        )
    } else {
        format!("{} ({})", error_name(err.err), err.err)
    }
}

/// The loader's own words for a failed `dlopen` (libloading's message alone says only
/// "dlopen failed").
pub fn loader_error(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => source.to_string(),
        None => e.to_string(),
    }
}

/// Why cuFile cannot be loaded, checked or opened. Each names the library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpenError {
    /// The dynamic loader cannot load the library.
    NotFound {
        /// The library as named.
        library: PathBuf,
        /// The loader's words.
        reason: String,
    },
    /// The library loads but lacks an entry point the backend calls.
    NotCuFile {
        /// The library as named.
        library: PathBuf,
        /// The missing symbol.
        symbol: &'static str,
        /// The loader's words.
        reason: String,
    },
    /// No NVIDIA device node exists: cuFile's driver cannot open (and a real cuFile may
    /// spin forever trying), so it is not called.
    NoNvidiaDevice {
        /// The library as named.
        library: PathBuf,
        /// The file the loader found for it.
        found: PathBuf,
    },
    /// No CUDA driver library loads: cuFile's driver cannot open, so it is not called.
    NoCudaDriver {
        /// The library as named.
        library: PathBuf,
        /// The file the loader found for it.
        found: PathBuf,
        /// The loader's words for [`CUDA_DRIVER_LIBRARY`].
        reason: String,
    },
    /// `cuFileDriverOpen` or `cuFileDriverGetProperties` returned an error.
    Driver {
        /// The library as named.
        library: PathBuf,
        /// Which call.
        call: &'static str,
        /// What it returned.
        status: CUfileError,
    },
    /// `cuFileDriverOpen` did not return in time. The call goes on, on its own thread
    /// ([`OPEN_THREAD`]); nothing can stop it.
    TimedOut {
        /// The library as named.
        library: PathBuf,
        /// How long it has been running.
        waited: Duration,
    },
    /// The thread for `cuFileDriverOpen` could not be started.
    Spawn {
        /// The library as named.
        library: PathBuf,
        /// The OS's words.
        reason: String,
    },
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::NotFound { library, reason } => write!(
                f,
                "GDS needs cuFile: {} not found ({reason})",
                library.display()
            ),
            OpenError::NotCuFile {
                library,
                symbol,
                reason,
            } => write!(
                f,
                "{} is not a usable cuFile: {symbol} missing ({reason})",
                library.display()
            ),
            OpenError::NoNvidiaDevice { library, found } => write!(
                f,
                "cuFile found ({}) but this machine has no NVIDIA device ({} absent), so \
                 its driver cannot open; cuFileDriverOpen is not called",
                found_as(library, found),
                DEVICE_NODES.join(", ")
            ),
            OpenError::NoCudaDriver {
                library,
                found,
                reason,
            } => write!(
                f,
                "cuFile found ({}) but no CUDA driver: {CUDA_DRIVER_LIBRARY} not found \
                 ({reason}), so its driver cannot open; cuFileDriverOpen is not called",
                found_as(library, found)
            ),
            OpenError::Driver {
                library,
                call,
                status,
            } => write!(
                f,
                "{call} failed: {} (from {})",
                describe(*status),
                library.display()
            ),
            OpenError::TimedOut { library, waited } => write!(
                f,
                "cuFileDriverOpen of {} has not returned after {} ms (parameter \
                 driver_open_timeout_ms); the call is left running on thread '{OPEN_THREAD}' \
                 and GDS backends on this library are refused until it returns",
                library.display(),
                waited.as_millis()
            ),
            OpenError::Spawn { library, reason } => write!(
                f,
                "cannot start the thread for cuFileDriverOpen of {}: {reason}",
                library.display()
            ),
        }
    }
}

impl std::error::Error for OpenError {}

/// `name`, and the file it resolved to when that differs.
fn found_as(name: &Path, found: &Path) -> String {
    if name == found || found.as_os_str().is_empty() {
        name.display().to_string()
    } else {
        format!("{} at {}", name.display(), found.display())
    }
}

/// The CUDA driver library cuFile needs (the pre-check loads it; nothing calls it).
pub const CUDA_DRIVER_LIBRARY: &str = "libcuda.so.1";

/// Paths one of which exists where an NVIDIA GPU is usable: the control device node
/// (bare metal and containers), the kernel driver's proc directory, WSL's GPU node.
pub const DEVICE_NODES: &[&str] = &["/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg"];

/// The name of the thread that runs `cuFileDriverOpen`.
pub const OPEN_THREAD: &str = "ferry-cufile-open";

/// The driver state of one loaded library (shared by every name it was loaded under).
#[derive(Debug)]
enum DriverState {
    /// Nothing called yet.
    Closed,
    /// The open thread is inside `cuFileDriverOpen` since `started`.
    Opening { started: Instant },
    /// Open; the properties it reported.
    Open(CUfileDrvProps),
    /// The open failed (for good: cuFile is not asked again in this process).
    Failed(OpenError),
}

/// One cuFile loaded into the process, with its symbols looked up. Loading calls
/// nothing in it; [`open`] opens its driver.
pub struct Library {
    /// The functions.
    pub api: Api,
    /// The library as first named.
    pub path: PathBuf,
    /// The file the loader found (`dladdr` of an entry point; empty if it says nothing).
    pub found: PathBuf,
    state: Mutex<DriverState>,
    changed: Condvar,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library").field("path", &self.path).finish()
    }
}

impl Library {
    fn lock(&self) -> MutexGuard<'_, DriverState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why backends on this library are refused without asking cuFile again: an open
    /// that failed, or one still running after `limit`. `None` when nothing is known
    /// against it (never tried, open, or opening for less than `limit`).
    pub fn known_failure(&self, named: &Path, limit: Duration) -> Option<OpenError> {
        match &*self.lock() {
            DriverState::Failed(e) => Some(renamed(e, named)),
            DriverState::Opening { started } if started.elapsed() >= limit => {
                Some(OpenError::TimedOut {
                    library: named.to_path_buf(),
                    waited: started.elapsed(),
                })
            }
            _ => None,
        }
    }
}

/// `e` as if it were about the library named `named`.
fn renamed(e: &OpenError, named: &Path) -> OpenError {
    let mut e = e.clone();
    match &mut e {
        OpenError::NotFound { library, .. }
        | OpenError::NotCuFile { library, .. }
        | OpenError::NoNvidiaDevice { library, .. }
        | OpenError::NoCudaDriver { library, .. }
        | OpenError::Driver { library, .. }
        | OpenError::TimedOut { library, .. }
        | OpenError::Spawn { library, .. } => *library = named.to_path_buf(),
    }
    e
}

/// Load cuFile from `library` (a bare name is searched like the dynamic loader does) and
/// look its symbols up: `dlopen` and `dlsym`, nothing called. This is all availability
/// checks do. Loaded libraries stay loaded for the process's life; the same library
/// under two names (a bare name and the path it resolved to, or a preloaded copy) is
/// one [`Library`] with one driver state.
pub fn load(library: &Path) -> Result<Arc<Library>, OpenError> {
    type Loaded = Vec<(PathBuf, Arc<Library>)>;
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    let mut loaded = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some((_, found)) = loaded.iter().find(|(name, _)| name == library) {
        return Ok(found.clone());
    }
    // SAFETY: loading cuFile runs its constructors (its own state only); each symbol is
    // looked up with the signature of cufile.h, and the library is leaked below so the
    // pointers stay valid.
    let lib = unsafe { libloading::Library::new(library.as_os_str()) }.map_err(|e| {
        OpenError::NotFound {
            library: library.to_path_buf(),
            reason: loader_error(&e),
        }
    })?;
    let api = {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol has the signature declared for the field it fills.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                    OpenError::NotCuFile {
                        library: library.to_path_buf(),
                        symbol: $name,
                        reason: e.to_string(),
                    }
                })?
            };
        }
        macro_rules! opt {
            ($name:literal) => {
                // SAFETY: as above.
                unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .ok()
                    .map(|s| *s)
            };
        }
        let batch = (|| {
            Some(BatchApi {
                set_up: opt!("cuFileBatchIOSetUp")?,
                submit: opt!("cuFileBatchIOSubmit")?,
                get_status: opt!("cuFileBatchIOGetStatus")?,
                cancel: opt!("cuFileBatchIOCancel")?,
                destroy: opt!("cuFileBatchIODestroy")?,
            })
        })();
        Api {
            driver_open: sym!("cuFileDriverOpen"),
            driver_get_properties: sym!("cuFileDriverGetProperties"),
            handle_register: sym!("cuFileHandleRegister"),
            handle_deregister: sym!("cuFileHandleDeregister"),
            buf_register: sym!("cuFileBufRegister"),
            buf_deregister: sym!("cuFileBufDeregister"),
            read: sym!("cuFileRead"),
            write: sym!("cuFileWrite"),
            use_count: opt!("cuFileUseCount"),
            batch,
        }
    };
    std::mem::forget(lib);
    // The same library under another name: its entry points are the same addresses.
    let same = loaded
        .iter()
        .find(|(_, l)| l.api.driver_open as usize == api.driver_open as usize)
        .map(|(_, l)| l.clone());
    let found = same.unwrap_or_else(|| {
        Arc::new(Library {
            api,
            path: library.to_path_buf(),
            found: file_of(api.driver_open as *const c_void),
            state: Mutex::new(DriverState::Closed),
            changed: Condvar::new(),
        })
    });
    loaded.push((library.to_path_buf(), found.clone()));
    Ok(found)
}

/// The file of the loaded object that holds `addr`, as the loader reports it.
fn file_of(addr: *const c_void) -> PathBuf {
    // SAFETY: dladdr only reads the loader's tables; `info` is plain data it fills.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `addr` is an entry point of a loaded library.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return PathBuf::new();
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader, valid while
    // the library stays loaded (for good: it is leaked).
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    use std::os::unix::ffi::OsStrExt;
    PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes()))
}

/// The cheap check before cuFile's driver is opened: an NVIDIA device node exists
/// ([`DEVICE_NODES`]) and the CUDA driver library loads (`dlopen` only, once per
/// process). Without them a real cuFile cannot open its driver — and some builds spin
/// forever trying — so it is refused here, at once.
pub fn device_check(lib: &Library, library: &Path) -> Result<(), OpenError> {
    if !DEVICE_NODES.iter().any(|p| Path::new(p).exists()) {
        return Err(OpenError::NoNvidiaDevice {
            library: library.to_path_buf(),
            found: lib.found.clone(),
        });
    }
    static DRIVER: OnceLock<Result<(), String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: the CUDA driver's constructors set up its own state only; nothing
            // in it is called here. Leaked: cuFile and cudarc load it by name anyway.
            unsafe { libloading::Library::new(CUDA_DRIVER_LIBRARY) }
                .map(std::mem::forget)
                .map_err(|e| loader_error(&e))
        })
        .clone()
        .map_err(|reason| OpenError::NoCudaDriver {
            library: library.to_path_buf(),
            found: lib.found.clone(),
            reason,
        })
}

/// Open the driver of `lib` (named `named` in messages) and read its properties, giving
/// `cuFileDriverOpen` at most `timeout` from when it was first called.
///
/// The call runs on a thread of its own ([`OPEN_THREAD`]). When it does not return in
/// time the thread is left behind, still inside cuFile (nothing can stop it) and this is
/// [`OpenError::TimedOut`]; every later open of the same library is refused at once
/// while it has not returned — no second thread is started — and succeeds or fails
/// with its result once it does. A failed open is remembered and not retried.
pub fn open(lib: &Arc<Library>, named: &Path, timeout: Duration) -> Result<CuFile, OpenError> {
    let mut state = lib.lock();
    loop {
        match &*state {
            DriverState::Open(props) => {
                return Ok(CuFile {
                    api: lib.api,
                    library: named.to_path_buf(),
                    props: *props,
                })
            }
            DriverState::Failed(e) => return Err(renamed(e, named)),
            DriverState::Closed => {
                let shared = Arc::clone(lib);
                std::thread::Builder::new()
                    .name(OPEN_THREAD.into())
                    .spawn(move || {
                        let result = open_now(&shared.api, &shared.path);
                        let mut state = shared.lock();
                        *state = match result {
                            Ok(props) => DriverState::Open(props),
                            Err(e) => DriverState::Failed(e),
                        };
                        shared.changed.notify_all();
                    })
                    .map_err(|e| OpenError::Spawn {
                        library: named.to_path_buf(),
                        reason: e.to_string(),
                    })?;
                *state = DriverState::Opening {
                    started: Instant::now(),
                };
            }
            DriverState::Opening { started } => {
                let waited = started.elapsed();
                let Some(left) = timeout.checked_sub(waited).filter(|d| !d.is_zero()) else {
                    return Err(OpenError::TimedOut {
                        library: named.to_path_buf(),
                        waited,
                    });
                };
                state = lib
                    .changed
                    .wait_timeout(state, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
    }
}

/// `cuFileDriverOpen` then `cuFileDriverGetProperties`, on the calling thread.
fn open_now(api: &Api, library: &Path) -> Result<CUfileDrvProps, OpenError> {
    // SAFETY: no arguments; opening twice in a process is allowed (already-open is
    // accepted below).
    let status = unsafe { (api.driver_open)() };
    if status.err != CU_FILE_SUCCESS && status.err != CU_FILE_DRIVER_ALREADY_OPEN {
        return Err(OpenError::Driver {
            library: library.to_path_buf(),
            call: "cuFileDriverOpen",
            status,
        });
    }
    let mut props = CUfileDrvProps::default();
    // SAFETY: props is writable and has the layout asserted above.
    let status = unsafe { (api.driver_get_properties)(&mut props) };
    if status.err != CU_FILE_SUCCESS {
        return Err(OpenError::Driver {
            library: library.to_path_buf(),
            call: "cuFileDriverGetProperties",
            status,
        });
    }
    Ok(props)
}

/// How cuFile moves bytes on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// GPUDirect Storage through nvidia-fs (DMA between storage and GPU memory).
    Direct {
        /// nvidia-fs version.
        nvfs_version: String,
    },
    /// Compatibility mode: no nvidia-fs, so cuFile does POSIX I/O through host bounce
    /// buffers. Correct, not direct.
    Compat {
        /// Why.
        reason: String,
    },
}

impl std::fmt::Display for IoMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoMode::Direct { nvfs_version } => write!(f, "GDS (nvidia-fs {nvfs_version})"),
            IoMode::Compat { reason } => write!(f, "compatibility mode: {reason}"),
        }
    }
}

/// Where the nvidia-fs kernel module reports its version.
pub const NVFS_VERSION_FILE: &str = "/proc/driver/nvidia-fs/version";

/// Decide the mode from what the kernel module file says (`None`: absent) and the
/// driver properties cuFile reported.
pub fn io_mode(nvfs_file: Option<&str>, props: &CUfileDrvProps) -> IoMode {
    match nvfs_file {
        Some(text) if props.nvfs.major_version != 0 || !text.trim().is_empty() => {
            let version = if props.nvfs.major_version != 0 {
                format!("{}.{}", props.nvfs.major_version, props.nvfs.minor_version)
            } else {
                text.trim().lines().next().unwrap_or("").to_string()
            };
            IoMode::Direct {
                nvfs_version: version,
            }
        }
        _ => IoMode::Compat {
            reason: format!(
                "nvidia-fs is not loaded ({NVFS_VERSION_FILE} absent); cuFile does POSIX I/O \
                 through host bounce buffers{}",
                if props.nvfs.dcontrolflags & (1 << CU_FILE_ALLOW_COMPAT_MODE_BIT) != 0 {
                    " (allow_compat_mode is on)"
                } else {
                    ""
                }
            ),
        },
    }
}

/// The mode of this machine for a loaded cuFile.
pub fn detect_mode(cufile: &CuFile) -> IoMode {
    let text = std::fs::read_to_string(NVFS_VERSION_FILE).ok();
    io_mode(text.as_deref(), &cufile.props)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_follows_nvidia_fs() {
        let mut props = CUfileDrvProps::default();
        let compat = io_mode(None, &props);
        assert!(matches!(compat, IoMode::Compat { .. }), "{compat}");
        assert!(compat.to_string().contains("nvidia-fs is not loaded"));
        props.nvfs.major_version = 2;
        props.nvfs.minor_version = 26;
        assert_eq!(
            io_mode(Some("version: 2.26.6\n"), &props),
            IoMode::Direct {
                nvfs_version: "2.26".into()
            }
        );
        props.nvfs.major_version = 0;
        assert_eq!(
            io_mode(Some("2.17\n"), &props),
            IoMode::Direct {
                nvfs_version: "2.17".into()
            }
        );
    }

    #[test]
    fn missing_library_is_a_message_not_a_panic() {
        let err = load(Path::new("/nonexistent/libcufile.so.0"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("GDS needs cuFile"), "{err}");
        assert!(err.contains("/nonexistent/libcufile.so.0"), "{err}");
    }
}
