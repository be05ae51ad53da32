//! [`PosixBackend`]: registration tables, request/operation pools, the pending queue,
//! and the glue to whichever engine is active.
//!
//! Split by concern: [`params`] (parameters and construction), [`registration`] (FILE
//! and DRAM regions, deregistration, query), [`validation`] (ranges, O_DIRECT
//! alignment), [`requests`] (posting, feeding the engine, completions, cancel).

mod params;
mod registration;
mod requests;
mod validation;

use registration::{query_fd, query_path};

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use ferry_backend_api::{
    Backend, Capabilities, Completions, Desc, Endpoint, Error, Failure, FailureKind, MemKind, Op,
    Params, PeerId, Post, QueryResult, Range, RegionSpec, Registered, RemoteAgent, Result, Subject,
};

use crate::pool::{
    BufEntry, DirectAlign, FileEntry, IoOp, OpState, Ops, Request, Requests, Slab, Table,
    NO_FIXED_BUF, NO_PLAIN, PLAIN_DRAM, PLAIN_DRAM_MAX,
};
use crate::threads::ThreadEngine;
use crate::uring::UringEngine;
use crate::{MEM_KINDS, NAME};

/// Largest single read/write handed to the kernel (it caps one call at 2 GiB − 4 KiB);
/// longer ranges continue where the previous chunk ended. A multiple of any O_DIRECT
/// alignment.
const CHUNK_BYTES_MAX: u64 = 1 << 30;

/// Largest io_uring fixed buffer the kernel accepts.
const FIXED_BUFFER_BYTES_MAX: u64 = 1 << 30;

/// Alignment assumed for O_DIRECT when `statx` does not say.
const DIRECT_ALIGN_DEFAULT: u64 = 4096;

/// One operation as an engine sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct IoCmd {
    /// Memory → file.
    pub write: bool,
    /// The file descriptor.
    pub fd: RawFd,
    /// The io_uring fixed-file index, if the file has one.
    pub fixed_file: Option<u32>,
    /// Memory address.
    pub buf: u64,
    /// Bytes (≤ [`CHUNK_BYTES_MAX`]).
    pub len: u32,
    /// File offset.
    pub offset: u64,
    /// io_uring fixed-buffer index, or [`NO_FIXED_BUF`].
    pub fixed_buf: u16,
    /// Names the operation slot and generation.
    pub user_data: u64,
}

/// Which I/O engine a backend runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// io_uring.
    Uring,
    /// Worker threads doing pread/pwrite.
    Threads,
}

enum Engine {
    // Boxed: the ring is much larger than the thread pool's handle.
    Uring(Box<UringEngine>),
    Threads(ThreadEngine),
}

impl Engine {
    fn has_room(&self) -> bool {
        match self {
            Engine::Uring(e) => e.has_room(),
            Engine::Threads(e) => e.has_room(),
        }
    }
    fn push(&mut self, cmd: &IoCmd) {
        match self {
            Engine::Uring(e) => e.push(cmd),
            Engine::Threads(e) => e.push(cmd),
        }
    }
    fn submit(&mut self) -> io::Result<()> {
        match self {
            Engine::Uring(e) => e.submit(),
            Engine::Threads(e) => {
                e.submit();
                Ok(())
            }
        }
    }
    fn reap(&mut self, each: impl FnMut(u64, i32)) -> usize {
        match self {
            Engine::Uring(e) => e.reap(each),
            Engine::Threads(e) => e.reap(each),
        }
    }
    fn in_flight(&self) -> u32 {
        match self {
            Engine::Uring(e) => e.in_flight(),
            Engine::Threads(e) => e.in_flight(),
        }
    }
}

/// Occupancy of the backend's pools (for leak checks and monitoring).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Request slots in use (posted, not yet completed).
    pub requests_in_use: usize,
    /// Operation slots in use.
    pub ops_in_use: usize,
    /// Operations waiting for room in the engine.
    pub ops_queued: usize,
    /// Operations handed to the engine and not yet reaped.
    pub ops_in_flight: usize,
    /// FILE regions registered.
    pub files_registered: usize,
    /// DRAM regions registered as fixed buffers.
    pub fixed_buffers_registered: usize,
}

/// The POSIX backend. See the crate docs.
pub struct PosixBackend {
    params: Params,
    engine: Engine,
    register_buffers: bool,
    register_files: bool,
    /// `posix_fadvise` advice applied to FILE regions at registration.
    access_hint: libc::c_int,
    files: Table<FileEntry>,
    buffers: Table<BufEntry>,
    /// DRAM regions that are not fixed buffers (their tokens carry [`PLAIN_DRAM`]), so a
    /// request naming one deregistered since is refused at post like any other.
    plain: Table<BufEntry>,
    requests: Requests,
    ops: Ops,
    /// Operation slots waiting for room in the engine, oldest first. Capacity = the
    /// operation pool's, so it never grows.
    pending: VecDeque<u32>,
    /// Scratch for reaped `(user_data, result)` pairs; capacity = queue depth.
    reaped: Vec<(u64, i32)>,
}

fn os_error(errno: i32, detail: String) -> Error {
    Error::Backend {
        backend: NAME.into(),
        errno,
        desc: None,
        detail: detail.into(),
    }
}

fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn descriptor(index: usize, addr: u64, len: u64, dev: u64) -> Subject {
    Subject::Descriptor {
        index: index as u32,
        addr,
        len,
        dev,
    }
}

impl PosixBackend {
    /// The engine in use.
    pub fn engine(&self) -> EngineKind {
        match self.engine {
            Engine::Uring(_) => EngineKind::Uring,
            Engine::Threads(_) => EngineKind::Threads,
        }
    }

    /// Pool occupancy now.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            requests_in_use: self.requests.in_use(),
            ops_in_use: self.ops.slab.in_use(),
            ops_queued: self.pending.len(),
            ops_in_flight: self.engine.in_flight() as usize,
            files_registered: self.files.len(),
            fixed_buffers_registered: self.buffers.len(),
        }
    }

    /// The path of the FILE region `token` names, when it was registered by path.
    pub fn file_path(&self, token: u64) -> Option<&Path> {
        let slot = self.files.slot(token)?;
        self.files.get(slot)?.path.as_deref()
    }
}

impl Backend for PosixBackend {
    fn validate(&self, endpoint: Endpoint, post: &Post<'_>) -> Result<()> {
        self.check_post(endpoint, post)
    }

    fn describe_target(&self, kind: MemKind, token: u64) -> Option<String> {
        (kind == MemKind::File)
            .then(|| {
                self.file_path(token)
                    .map(|p| format!("file '{}'", p.display()))
            })
            .flatten()
    }

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
        Some(self.engine_text())
    }

    unsafe fn register(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        match region.kind {
            MemKind::File => self.register_file(region),
            MemKind::Dram => self.register_dram(region),
            other => Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!("memory kind {other}").into(),
            }),
        }
    }

    unsafe fn deregister(&mut self, kind: MemKind, token: u64) -> Result<()> {
        self.deregister_region(kind, token)
    }

    fn conn_info(&self) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }

    fn load_remote(&mut self, _peer: PeerId, _remote: RemoteAgent<'_>) -> Result<()> {
        // Local only: nothing of a peer is usable, but knowing it does no harm.
        Ok(())
    }

    fn unload_remote(&mut self, _peer: PeerId) {}

    unsafe fn post(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()> {
        let _span = ferry_backend_api::trace_span!("ferry-posix::post");
        // SAFETY: the same promise, passed on (see `requests`).
        unsafe { self.post_batch(endpoint, batch, done) }
    }

    fn progress(&mut self, done: &mut Completions) {
        let _span = ferry_backend_api::trace_span!("ferry-posix::progress");
        self.drain_engine(done);
        if let Err(e) = self.feed(done) {
            self.fail_queued(errno_of(&e), done);
        }
    }

    fn cancel(&mut self, tag: u64) -> Result<bool> {
        self.cancel_request(tag)
    }

    fn query(
        &mut self,
        kind: MemKind,
        descs: &[Desc],
        paths: &[Option<&Path>],
    ) -> Result<Vec<QueryResult>> {
        if kind != MemKind::File {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!("query of memory kind {kind}").into(),
            });
        }
        descs
            .iter()
            .enumerate()
            .map(|(i, desc)| match paths.get(i).copied().flatten() {
                Some(path) => query_path(path),
                None => query_fd(i, desc),
            })
            .collect()
    }
}

impl Drop for PosixBackend {
    fn drop(&mut self) {
        // Let the kernel finish every operation that names caller memory before the
        // files close and the ring goes away; queued ones never started.
        if let Engine::Uring(ring) = &mut self.engine {
            ring.drain_blocking(|_, _| {});
        }
        if let Engine::Threads(threads) = &mut self.engine {
            threads.shutdown();
        }
        for (_, entry) in self.files.drain() {
            drop(entry);
        }
    }
}
