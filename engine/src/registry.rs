//! The backend types this build of Ferry knows.

use ferry_backend_api::{BackendFactory, MemKind, ParamSpec};

/// A backend type: its name, parameters and memory kinds, and whether it works here.
#[derive(Clone, Debug)]
pub struct FactoryInfo {
    /// Type name (`LOOPBACK`, `UCX`, `POSIX` …).
    pub name: &'static str,
    /// Parameters with defaults.
    pub params: &'static [ParamSpec],
    /// Memory kinds.
    pub mem_kinds: &'static [MemKind],
    /// `Err(reason)` when it cannot work on this machine.
    pub available: Result<(), String>,
    /// Per memory kind: `Err(reason)` when that kind cannot work here (VRAM without a
    /// CUDA driver, a UCX without CUDA support …).
    pub kinds: Vec<(MemKind, Result<(), String>)>,
}

static LOOPBACK: ferry_loopback::LoopbackFactory = ferry_loopback::LoopbackFactory;
static POSIX: ferry_posix::PosixFactory = ferry_posix::PosixFactory;
/// UCX loads libucp at run time, so it is always compiled in; `available()` says
/// whether the library is present.
static UCX: ferry_ucx::UcxFactory = ferry_ucx::UcxFactory;
/// GDS loads cuFile at run time; `available()` says whether it is present.
static GDS: ferry_gds::GdsFactory = ferry_gds::GdsFactory;

/// Same-host transfers: memcpy through mapped peer segments, or batched CMA.
static SHM: ferry_shm::ShmFactory = ferry_shm::ShmFactory;

/// Object storage (S3, Azure Blob, GCS) through `object_store` (feature `obj`).
#[cfg(feature = "obj")]
static OBJ: ferry_obj::ObjFactory = ferry_obj::ObjFactory;

/// The backends an agent gets when its caller names none
/// ([`Agent::create_default_backends`](crate::Agent::create_default_backends)), in
/// preference order: a request takes the first of them that both sides have and that
/// accepted the peer, so each peer gets the fastest path that reaches it —
///
/// - `LOOPBACK`: a peer in this process (it refuses any other at load);
/// - `SHM`: a peer on this host, in this pid namespace (it refuses others at load): a
///   memcpy through the peer's mapped segment, or one-sided batched CMA into its
///   ordinary memory, with the peer's death seen through a pidfd. (UCX 1.13, the
///   distributions' UCX, reaches such a peer over `tcp/lo` with emulated RMA when its
///   endpoints detect peer failure, and without that detection still emulates RMA into
///   ordinary memory with shared-memory active messages: several times slower);
/// - `UCX`: every other peer (another host: tcp or RDMA, with UCX's peer error
///   handling), and VRAM;
/// - `POSIX`: files (DRAM ↔ FILE of this agent).
///
/// A type that is unavailable here (no libucp, no io_uring and no fallback …) is left
/// out and the reason logged. `GDS` is not among them: it needs a GPU and cuFile, and a
/// caller who has them names it.
pub const DEFAULT_BACKENDS: &[&str] = &["LOOPBACK", "SHM", "UCX", "POSIX"];

/// Parameters a backend gets in the default set unless the caller sets them: (type, key,
/// value). UCX's shared-memory tuning (`shm_fifo_size`/`shm_seg_bytes=auto`: 4096 FIFO
/// entries of 32 KiB until 2026-12-03, 256 now) made UCX allocate and zero ~128 MiB of shared memory per
/// transport when the backend is created (measured: `ucx_info` creating a worker takes
/// 173 ms with it, 29 ms without, UCX 1.13.1); in the default set a same-host peer's
/// DRAM goes through SHM, so UCX keeps its own defaults there and an agent with the
/// default set is made in tens of milliseconds.
pub const DEFAULT_SET_PARAMS: &[(&str, &str, &str)] = &[
    ("UCX", "shm_fifo_size", "ucx"),
    ("UCX", "shm_seg_bytes", "ucx"),
];

/// Every backend factory compiled in, in preference order.
pub fn factories() -> Vec<&'static dyn BackendFactory> {
    #[allow(unused_mut)]
    let mut all: Vec<&'static dyn BackendFactory> = vec![&LOOPBACK, &UCX, &POSIX, &GDS, &SHM];
    #[cfg(feature = "obj")]
    all.push(&OBJ);
    all
}

/// The factory of backend type `name` (case-insensitive).
pub fn factory(name: &str) -> Option<&'static dyn BackendFactory> {
    factories()
        .into_iter()
        .find(|f| f.name().eq_ignore_ascii_case(name))
}

/// Describe every compiled-in backend type.
pub fn describe() -> Vec<FactoryInfo> {
    factories()
        .into_iter()
        .map(|f| FactoryInfo {
            name: f.name(),
            params: f.params(),
            mem_kinds: f.mem_kinds(),
            available: f.available(),
            kinds: f
                .mem_kinds()
                .iter()
                .map(|&kind| (kind, f.kind_available(kind)))
                .collect(),
        })
        .collect()
}
