//! # Ferry
//!
//! A data-movement engine for AI inference: it moves bytes (above all KV-cache blocks)
//! between host memory, files and remote agents through one batched API, whatever
//! backend does the work. The backends today are `LOOPBACK` (in-process DRAM), `POSIX`
//! (DRAM ↔ FILE), `UCX` (DRAM between agents) and `SHM` (DRAM between processes of
//! one host); GPU memory ([`MemKind::Vram`]) and
//! the `BLOCK`/`OBJECT` kinds are named in the API but no backend moves them yet
//! (registering them fails with [`Error::NotSupported`]).
//!
//! Callers record commands into a [`CommandBuffer`] (no I/O, no agent borrow) and
//! submit it with [`Agent::flush`], which runs fixed phases: resolve → register → prep
//! → make (merge adjacent ranges) → dispatch (one batch per backend × endpoint) →
//! progress → notifications → retire. Each command gets its own [`Outcome`]. Objects
//! are named by generational handles ([`RegionId`], [`PrepId`], [`XferId`],
//! [`PeerId`], [`BackendId`]); a stale handle is an error, never a wrong object.
//!
//! ```
//! use ferry::{Agent, AgentConfig, CommandBuffer, Desc, MemKind, Op, Params, Side, XferStatus};
//!
//! let a = Agent::new(AgentConfig::named("doc-a")).unwrap();
//! let b = Agent::new(AgentConfig::named("doc-b")).unwrap();
//! a.create_backend("LOOPBACK", &Params::new()).unwrap();
//! b.create_backend("LOOPBACK", &Params::new()).unwrap();
//! let src = vec![7u8; 4096];
//! let mut dst = vec![0u8; 4096];
//! // SAFETY: both buffers outlive their registration and are not touched while a
//! // transfer is in flight.
//! let _ = unsafe { a.register(MemKind::Dram, Desc::of_slice(&src)).unwrap() };
//! let _ = unsafe { b.register(MemKind::Dram, Desc::of_slice(&dst)).unwrap() };
//! let peer = a.load_remote_md(&b.local_md().unwrap()).unwrap();
//!
//! let mut cmds = CommandBuffer::with_capacity(8);
//! let local = cmds.prep(Side::Local, MemKind::Dram, &[Desc::of_slice(&src)]);
//! let remote = cmds.prep(peer, MemKind::Dram, &[Desc::of_slice(&dst)]);
//! let x = cmds.make(Op::Write, local, &[], remote, &[]).notify(b"kv-ready").ticket();
//! cmds.post(x);
//! let done = cmds.check(x);
//! a.flush(&mut cmds);
//! assert_eq!(cmds.status(done).unwrap(), XferStatus::Done);
//! assert_eq!(dst, src);
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

mod agent;
pub mod exchange;
mod md;
pub mod metrics;
#[cfg(feature = "prometheus")]
pub mod prometheus;
mod registry;

pub use agent::{Agent, AgentConfig, BackendInfo, NamePolicy};
pub use ferry_backend_api::{
    Backend, BackendFactory, Capabilities, CostEstimate, CostMethod, FileMode, ParamSpec, Params,
    QueryResult,
};
pub use ferry_schedules::{
    Bounds, Command, CommandBuffer, Created, DeregStatus, ExchangeCmd, FlushSummary, MakeBuilder,
    MdRoute, Outcome, PrepDescs, Ref, Side, Telemetry, Ticket, XferStatus,
};
pub use ferry_storage::{
    BackendId, BackendMask, Desc, Endpoint, Error, MemKind, Op, PeerId, PrepId, RegionId, Result,
    StridedDesc, Subject, XferId,
};
pub use registry::{factories, factory, FactoryInfo, DEFAULT_BACKENDS};

/// Metadata codec (wire format, descriptor-list encoding), for tools and side channels.
pub mod metadata {
    pub use ferry_metadata::{decode_descs, encode_descs, MdWriter, PeerMd, RegionView};
}

/// Same-host shareable memory and the `SHM` backend: allocate memory other local
/// processes can map ([`shm::SharedMemory`]), register it like any DRAM range, and a
/// same-host peer's SHM transfers into it are plain copies.
pub mod shm {
    pub use ferry_shm::{HugePages, SharedMemory, ShmFactory, ShmOptions, HUGE_PAGE_BYTES, NAME};
}

/// Fault injection of the built-in loopback backend, for tests.
pub mod loopback {
    pub use ferry_loopback::{faults, Faults, LoopbackFactory, NAME};
}
