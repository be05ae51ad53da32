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

/// Every backend factory compiled in, in preference order.
pub fn factories() -> Vec<&'static dyn BackendFactory> {
    vec![&LOOPBACK, &UCX, &POSIX, &GDS, &SHM]
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
