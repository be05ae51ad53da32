//! Our own bindings to cuFile (`cufile.h`), loaded at run time with libloading.
//!
//! Only what the backend calls is declared. The struct layouts follow `cufile.h` of
//! CUDA 12/13 (unchanged since cuFile 1.x added the batch API) and are pinned by the
//! `const` assertions below; the stand-in library the tests compile asserts the same
//! sizes and offsets with `_Static_assert`, so a drift shows on both sides.

use std::ffi::{c_int, c_long, c_uint, c_void};
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

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

/// Load cuFile from `library` (a bare name is searched like the dynamic loader does) and
/// open its driver. Loaded libraries stay loaded for the process's life and their driver
/// open (cuFile counts opens per process; closing under another backend's feet is not
/// worth the risk), so a second backend on the same library shares the first's.
pub fn load(library: &Path) -> Result<Arc<CuFile>, String> {
    static LOADED: OnceLock<Mutex<Vec<Arc<CuFile>>>> = OnceLock::new();
    let mut loaded = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(found) = loaded.iter().find(|c| c.library == library) {
        return Ok(found.clone());
    }
    // SAFETY: loading cuFile runs its constructors (its own state only); each symbol is
    // looked up with the signature of cufile.h, and the library is leaked below so the
    // pointers stay valid.
    let lib = unsafe { libloading::Library::new(library.as_os_str()) }.map_err(|e| {
        format!(
            "GDS needs cuFile: {} not found ({})",
            library.display(),
            loader_error(&e)
        )
    })?;
    let api = {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol has the signature declared for the field it fills.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                    format!(
                        "{} is not a usable cuFile: {} missing ({e})",
                        library.display(),
                        $name
                    )
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
    // SAFETY: no arguments; opening twice in a process is allowed (already-open is
    // accepted below).
    let status = unsafe { (api.driver_open)() };
    if status.err != CU_FILE_SUCCESS && status.err != 5026 {
        return Err(format!(
            "cuFileDriverOpen failed: {} (from {})",
            describe(status),
            library.display()
        ));
    }
    let mut props = CUfileDrvProps::default();
    // SAFETY: props is writable and has the layout asserted above.
    let status = unsafe { (api.driver_get_properties)(&mut props) };
    if status.err != CU_FILE_SUCCESS {
        return Err(format!(
            "cuFileDriverGetProperties failed: {}",
            describe(status)
        ));
    }
    let cufile = Arc::new(CuFile {
        api,
        library: library.to_path_buf(),
        props,
    });
    loaded.push(cufile.clone());
    Ok(cufile)
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
        let err = load(Path::new("/nonexistent/libcufile.so.0")).unwrap_err();
        assert!(err.contains("GDS needs cuFile"), "{err}");
        assert!(err.contains("/nonexistent/libcufile.so.0"), "{err}");
    }
}
