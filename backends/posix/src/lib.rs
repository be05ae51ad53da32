//! Ferry's POSIX file backend: moves bytes between host memory (DRAM) and files (FILE),
//! within the local agent, on **io_uring** with a portable **thread-pool** fallback.
//!
//! # Shape
//!
//! - READ is file → memory, WRITE is memory → file. In a [`Post`](ferry_backend_api::Post)
//!   the local side is DRAM and the "remote" side is the FILE region: its registration
//!   token is [`Range::remote_token`](ferry_backend_api::Range::remote_token) and the
//!   file offset is `remote_addr`.
//! - Every posted request takes one slot of a fixed-size **request pool** and one slot
//!   per non-empty range of a fixed-size **operation pool** (sizes from the parameters
//!   `max_requests` and `max_ops`); nothing is allocated per post once warm. An
//!   operation's slot index and generation travel through the kernel as the io_uring
//!   `user_data` and are checked when the completion comes back.
//! - Operations wait in a FIFO **pending queue** until the engine has room (at most
//!   `queue_depth` in flight); completions drained by
//!   [`Backend::progress`] free room and the queue
//!   is fed again. A batch larger than the ring is therefore queued, never dropped and
//!   never spun on.
//! - A request completes when all its operations have; the failure reported is the one
//!   with the lowest range index (errno + range index). Operations still queued for a
//!   request that already failed are not started.
//!
//! # Engines
//!
//! - `uring`: one `io_uring_enter` per flushed batch; DRAM regions registered as fixed
//!   buffers (`READ_FIXED`/`WRITE_FIXED`) and FILE regions as fixed files when the
//!   parameters `register_buffers` / `register_files` allow.
//! - `threads`: `workers` threads doing `pread`/`pwrite` from a bounded queue; they
//!   sleep on a condition variable when idle.
//! - `auto` (default) tries io_uring and falls back to threads, saying so on stderr.
//!
//! # O_DIRECT
//!
//! Files opened with `O_DIRECT` (by path with [`FileMode::direct`], or an fd whose
//! flags carry it) require aligned memory addresses, lengths and file offsets; the
//! required alignment comes from `statx(STATX_DIOALIGN)` (4096 when the kernel or file
//! system does not say). [`PosixBackend::check_post`] validates a request up front, and
//! `post` refuses a misaligned request before starting anything.

// This crate drives the kernel directly: io_uring submissions that name raw buffer
// addresses, fixed-buffer registration, and pread/pwrite/fstat/statx through libc.
#![allow(unsafe_code)]

mod backend;
pub mod bench;
mod pool;
mod threads;
mod uring;

pub use backend::{EngineKind, PoolStats, PosixBackend};
pub use ferry_backend_api::FileMode;

use ferry_backend_api::{
    effective_params, Backend, BackendFactory, BackendInit, MemKind, ParamSpec, Result,
};

/// The backend type name.
pub const NAME: &str = "POSIX";

/// Memory kinds the backend serves.
pub const MEM_KINDS: &[MemKind] = &[MemKind::Dram, MemKind::File];

/// Parameters the backend understands, with their defaults.
pub const PARAMS: &[ParamSpec] = &[
    ParamSpec {
        name: "engine",
        default: "auto",
        doc: "I/O engine: `uring` (io_uring), `threads` (pread/pwrite worker pool), or \
              `auto` (io_uring, falling back to threads when it cannot be set up)",
    },
    ParamSpec {
        name: "queue_depth",
        default: "256",
        doc: "most I/O operations in flight at once (io_uring submission-queue size; \
              thread engine queue bound); more are queued until completions free room",
    },
    ParamSpec {
        name: "workers",
        default: "4",
        doc: "worker threads of the `threads` engine",
    },
    ParamSpec {
        name: "max_requests",
        default: "4096",
        doc: "pooled request slots: most posted requests outstanding at once",
    },
    ParamSpec {
        name: "max_ops",
        default: "65536",
        doc: "pooled operation slots: most non-empty ranges outstanding at once \
              (in flight or queued)",
    },
    ParamSpec {
        name: "max_files",
        default: "1024",
        doc: "most FILE regions registered at once (also the io_uring fixed-file table size)",
    },
    ParamSpec {
        name: "max_buffers",
        default: "1024",
        doc:
            "most DRAM regions registered as io_uring fixed buffers (others use plain reads/writes)",
    },
    ParamSpec {
        name: "register_buffers",
        default: "true",
        doc: "register DRAM regions (each at most 1 GiB) as io_uring fixed buffers",
    },
    ParamSpec {
        name: "register_files",
        default: "true",
        doc: "register FILE regions' descriptors in the io_uring fixed-file table",
    },
    ParamSpec {
        name: "access_hint",
        default: "normal",
        doc: "posix_fadvise hint for FILE regions at registration: normal | sequential (larger readahead, like fio's default for sequential jobs) | random",
    },
];

/// Creates [`PosixBackend`]s.
#[derive(Clone, Copy, Debug, Default)]
pub struct PosixFactory;

impl BackendFactory for PosixFactory {
    fn name(&self) -> &'static str {
        NAME
    }

    fn params(&self) -> &'static [ParamSpec] {
        PARAMS
    }

    fn mem_kinds(&self) -> &'static [MemKind] {
        MEM_KINDS
    }

    fn available(&self) -> std::result::Result<(), String> {
        // The thread engine works wherever pread/pwrite do.
        Ok(())
    }

    fn create(&self, init: &BackendInit<'_>) -> Result<Box<dyn Backend>> {
        let params = effective_params(NAME, PARAMS, init.params)?;
        Ok(Box::new(PosixBackend::new(params)?))
    }
}

/// Whether this kernel (and sandbox) lets a process set up an io_uring with the
/// operations the backend uses; the reason when not.
pub fn uring_supported() -> std::result::Result<(), String> {
    uring::probe()
}
