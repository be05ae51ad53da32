//! [`PosixBackend`]: registration tables, request/operation pools, the pending queue,
//! and the glue to whichever engine is active.

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::time::Duration;

use ferry_backend_api::{
    Backend, Capabilities, Completions, Desc, Endpoint, Error, Failure, FailureKind, MemKind, Op,
    Params, PeerId, Post, QueryResult, Range, RegionSpec, Registered, RemoteAgent, Result, Subject,
};

use crate::pool::{
    BufEntry, DirectAlign, FileEntry, IoOp, OpState, Ops, Request, Requests, Slab, Table,
    NO_FIXED_BUF,
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
    requests: Requests,
    ops: Ops,
    /// Operation slots waiting for room in the engine, oldest first. Capacity = the
    /// operation pool's, so it never grows.
    pending: VecDeque<u32>,
    /// Scratch for reaped `(user_data, result)` pairs; capacity = queue depth.
    reaped: Vec<(u64, i32)>,
}

fn param_u32(params: &Params, name: &str, min: u32, max: u32) -> Result<u32> {
    let raw = params.get(name).map(String::as_str).unwrap_or("");
    match raw.parse::<u32>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(Error::invalid(
            Subject::BackendName(NAME.into()),
            format!("parameter '{name}' must be an integer in {min}..={max}, got '{raw}'"),
        )),
    }
}

fn param_bool(params: &Params, name: &str) -> Result<bool> {
    match params.get(name).map(String::as_str) {
        Some("true" | "1" | "yes" | "on") => Ok(true),
        Some("false" | "0" | "no" | "off") => Ok(false),
        other => Err(Error::invalid(
            Subject::BackendName(NAME.into()),
            format!(
                "parameter '{name}' must be true or false, got '{}'",
                other.unwrap_or("")
            ),
        )),
    }
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

/// The O_DIRECT alignment the kernel reports for `fd`, or the default.
fn direct_alignment(fd: RawFd) -> DirectAlign {
    // SAFETY: statx is plain data; zeroed is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    // SAFETY: `empty` is a NUL-terminated string, `stx` is writable and outlives the
    // call; AT_EMPTY_PATH makes statx describe `fd` itself.
    let rc = unsafe {
        libc::statx(
            fd,
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    let reported = rc == 0
        && stx.stx_mask & libc::STATX_DIOALIGN != 0
        && stx.stx_dio_mem_align != 0
        && stx.stx_dio_offset_align != 0;
    if reported {
        DirectAlign {
            mem_bytes: u64::from(stx.stx_dio_mem_align),
            offset_bytes: u64::from(stx.stx_dio_offset_align),
        }
    } else {
        DirectAlign {
            mem_bytes: DIRECT_ALIGN_DEFAULT,
            offset_bytes: DIRECT_ALIGN_DEFAULT,
        }
    }
}

impl PosixBackend {
    /// A backend from effective parameters (see [`crate::PARAMS`]; use
    /// [`ferry_backend_api::effective_params`] to fill defaults). Logs the active
    /// engine on stderr.
    pub fn new(params: Params) -> Result<PosixBackend> {
        let depth = param_u32(&params, "queue_depth", 1, 32768)?;
        let workers = param_u32(&params, "workers", 1, 1024)?;
        let max_requests = param_u32(&params, "max_requests", 1, 1 << 24)?;
        let max_ops = param_u32(&params, "max_ops", 1, 1 << 26)?;
        let max_files = param_u32(&params, "max_files", 1, 1 << 20)?;
        let max_buffers = param_u32(&params, "max_buffers", 1, 16384)?;
        let register_buffers = param_bool(&params, "register_buffers")?;
        let register_files = param_bool(&params, "register_files")?;
        let access_hint = match params
            .get("access_hint")
            .map(String::as_str)
            .unwrap_or("normal")
        {
            "normal" => libc::POSIX_FADV_NORMAL,
            "sequential" => libc::POSIX_FADV_SEQUENTIAL,
            "random" => libc::POSIX_FADV_RANDOM,
            other => {
                return Err(Error::invalid(
                    Subject::Named("POSIX parameter access_hint".into()),
                    format!("'{other}' is not normal, sequential or random"),
                ))
            }
        };
        let engine_name = params.get("engine").map(String::as_str).unwrap_or("auto");

        let threads = || {
            ThreadEngine::new(workers, depth)
                .map_err(|e| os_error(errno_of(&e), format!("cannot start worker threads: {e}")))
        };
        let uring = || {
            UringEngine::new(
                depth,
                register_buffers.then_some(max_buffers),
                register_files.then_some(max_files),
            )
        };
        let engine = match engine_name {
            "uring" => {
                Engine::Uring(Box::new(uring().map_err(|e| {
                    os_error(errno_of(&e), format!("io_uring setup failed: {e}"))
                })?))
            }
            "threads" => Engine::Threads(threads()?),
            "auto" => match uring() {
                Ok(e) => Engine::Uring(Box::new(e)),
                Err(e) => {
                    eprintln!(
                        "ferry[posix]: io_uring unavailable ({e}); falling back to the thread engine"
                    );
                    Engine::Threads(threads()?)
                }
            },
            other => {
                return Err(Error::invalid(
                    Subject::BackendName(NAME.into()),
                    format!("parameter 'engine' must be auto, uring or threads, got '{other}'"),
                ))
            }
        };
        match &engine {
            Engine::Uring(e) => eprintln!(
                "ferry[posix]: engine io_uring (queue depth {}, fixed buffers {}, fixed files {})",
                e.depth(),
                if e.fixed_buffers { "on" } else { "off" },
                if e.fixed_files { "on" } else { "off" },
            ),
            Engine::Threads(e) => eprintln!(
                "ferry[posix]: engine threads ({workers} workers, queue depth {})",
                e.depth()
            ),
        }
        Ok(PosixBackend {
            params,
            engine,
            register_buffers,
            register_files,
            access_hint,
            files: Table::new(max_files),
            buffers: Table::new(max_buffers),
            requests: Slab::new(max_requests, None),
            ops: Ops::new(max_ops),
            pending: VecDeque::with_capacity(max_ops as usize),
            reaped: Vec::with_capacity(depth as usize),
        })
    }

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

    /// Check range `index` of a request against its FILE region: the region exists,
    /// covers the range, and — for O_DIRECT files — the memory address, length and file
    /// offset are aligned. The error names the descriptor, the file and the alignment.
    pub fn check_range(&self, index: usize, range: &Range) -> Result<()> {
        let subject = || descriptor(index, range.remote_addr, range.len, range.remote_dev);
        let Some(slot) = self.files.slot(range.remote_token) else {
            return Err(Error::not_found(subject()));
        };
        let Some(file) = self.files.get(slot) else {
            return Err(Error::not_found(subject()));
        };
        if !file.covers(range.remote_addr, range.len) {
            return Err(Error::invalid(
                subject(),
                format!(
                    "outside the registered region of {} (offset {}, len {})",
                    file.describe(),
                    file.start,
                    if file.len_bytes == 0 {
                        "unbounded".to_string()
                    } else {
                        file.len_bytes.to_string()
                    }
                ),
            ));
        }
        if range.local_addr.checked_add(range.len).is_none() {
            return Err(Error::invalid(
                descriptor(index, range.local_addr, range.len, range.local_dev),
                "memory range wraps the address space",
            ));
        }
        if range.local_token != 0 {
            let buf = self
                .buffers
                .slot(range.local_token)
                .and_then(|s| self.buffers.get(s));
            match buf {
                None => {
                    return Err(Error::not_found(descriptor(
                        index,
                        range.local_addr,
                        range.len,
                        range.local_dev,
                    )))
                }
                Some(b) if !b.covers(range.local_addr, range.len) => {
                    return Err(Error::invalid(
                        descriptor(index, range.local_addr, range.len, range.local_dev),
                        "outside its registered DRAM region",
                    ))
                }
                Some(_) => {}
            }
        }
        self.check_alignment(index, range)
    }

    /// For O_DIRECT files: whether range `index` has an aligned memory address, length
    /// and file offset. Always `Ok` for buffered files and unknown tokens.
    pub fn check_alignment(&self, index: usize, range: &Range) -> Result<()> {
        let Some(file) = self
            .files
            .slot(range.remote_token)
            .and_then(|s| self.files.get(s))
        else {
            return Ok(());
        };
        let Some(align) = file.direct else {
            return Ok(());
        };
        let what = if range.local_addr % align.mem_bytes != 0 {
            Some(("memory address", range.local_addr, range.local_dev))
        } else if range.len % align.offset_bytes != 0 {
            Some(("length", range.len, range.remote_dev))
        } else if range.remote_addr % align.offset_bytes != 0 {
            Some(("file offset", range.remote_addr, range.remote_dev))
        } else {
            None
        };
        match what {
            None => Ok(()),
            Some((name, value, dev)) => {
                let addr = if name == "memory address" {
                    range.local_addr
                } else {
                    range.remote_addr
                };
                Err(Error::invalid(
                    descriptor(index, addr, range.len, dev),
                    format!(
                        "O_DIRECT on {} needs {}-byte alignment of address and {}-byte alignment \
                         of length and offset; {name} {value:#x} is not aligned",
                        file.describe(),
                        align.mem_bytes,
                        align.offset_bytes,
                    ),
                ))
            }
        }
    }

    /// Validate a whole request as `post` would, without starting it (the hook for the
    /// executor's prep phase).
    pub fn check_post(&self, endpoint: Endpoint, post: &Post<'_>) -> Result<()> {
        if let Endpoint::Peer(_) = endpoint {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: "transfers to other agents (POSIX is local only)".into(),
            });
        }
        if post.local_kind != MemKind::Dram || post.remote_kind != MemKind::File {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!(
                    "{} ↔ {} transfers (only DRAM ↔ FILE)",
                    post.local_kind, post.remote_kind
                )
                .into(),
            });
        }
        for (i, range) in post.ranges.iter().enumerate() {
            self.check_range(i, range)?;
        }
        Ok(())
    }

    /// Progress, and if nothing completed, sleep until something does or `timeout`
    /// passes (instead of spinning). Returns how many completions were pushed.
    pub fn wait(&mut self, done: &mut Completions, timeout: Duration) -> Result<usize> {
        let before = done.len();
        self.drain_engine(done);
        self.fill(done);
        if done.len() > before || self.engine.in_flight() == 0 {
            if let Err(e) = self.engine.submit() {
                self.fail_queued(errno_of(&e), done);
            }
            return Ok(done.len() - before);
        }
        // Submit what `fill` queued and sleep for a completion in one syscall.
        match &mut self.engine {
            Engine::Uring(e) => e
                .wait(timeout)
                .map_err(|e| os_error(errno_of(&e), format!("io_uring wait failed: {e}")))?,
            Engine::Threads(e) => e.wait(timeout),
        }
        self.progress(done);
        Ok(done.len() - before)
    }

    fn register_file(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        let desc = region.desc;
        let Some(slot) = self.files.vacant() else {
            return Err(Error::Capacity {
                what: "POSIX FILE regions (parameter max_files)",
                limit: self.files.capacity(),
            });
        };
        let mut entry = match region.path {
            Some((path, mode)) => {
                if mode.create && !mode.write {
                    return Err(Error::invalid(
                        Subject::Named(format!("file '{}'", path.display()).into()),
                        "create needs write mode",
                    ));
                }
                let mut flags = libc::O_CLOEXEC;
                if mode.direct {
                    flags |= libc::O_DIRECT;
                }
                if mode.sync {
                    flags |= libc::O_SYNC;
                }
                let file = OpenOptions::new()
                    .read(true)
                    .write(mode.write)
                    .create(mode.create)
                    .mode(0o644)
                    .custom_flags(flags)
                    .open(path)
                    .map_err(|e| {
                        os_error(
                            errno_of(&e),
                            format!("cannot open file '{}': {e}", path.display()),
                        )
                    })?;
                let fd: std::os::fd::OwnedFd = file.into();
                FileEntry {
                    fd: fd.as_raw_fd(),
                    _owned: Some(fd),
                    path: Some(path.to_path_buf()),
                    start: desc.addr,
                    len_bytes: desc.len,
                    direct: None,
                    fixed: false,
                }
            }
            None => {
                let fd = RawFd::try_from(desc.dev).map_err(|_| {
                    Error::invalid(
                        descriptor(0, desc.addr, desc.len, desc.dev),
                        "device id is not a file descriptor",
                    )
                })?;
                FileEntry {
                    fd,
                    _owned: None,
                    path: None,
                    start: desc.addr,
                    len_bytes: desc.len,
                    direct: None,
                    fixed: false,
                }
            }
        };
        // SAFETY: F_GETFL only reads the descriptor's status flags.
        let flags = unsafe { libc::fcntl(entry.fd, libc::F_GETFL) };
        if flags < 0 {
            let e = io::Error::last_os_error();
            return Err(Error::Backend {
                backend: NAME.into(),
                errno: errno_of(&e),
                desc: Some(0),
                detail: format!("{} is not usable: {e}", entry.describe()).into(),
            });
        }
        if desc.addr.checked_add(desc.len).is_none() {
            return Err(Error::invalid(
                descriptor(0, desc.addr, desc.len, desc.dev),
                "file region wraps the offset space",
            ));
        }
        if flags & libc::O_DIRECT != 0 {
            entry.direct = Some(direct_alignment(entry.fd));
        }
        if self.access_hint != libc::POSIX_FADV_NORMAL {
            // SAFETY: posix_fadvise only records advice for an open descriptor; a
            // failure (e.g. a pipe) is harmless and ignored: it is a hint.
            unsafe { libc::posix_fadvise(entry.fd, 0, 0, self.access_hint) };
        }
        if let Engine::Uring(ring) = &self.engine {
            if self.register_files && ring.fixed_files {
                entry.fixed = ring.register_file(slot, entry.fd).is_ok();
            }
        }
        let token = self.files.fill(slot, entry);
        Ok(Registered {
            token,
            public_md: Vec::new(),
        })
    }

    fn register_dram(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        let desc = region.desc;
        if desc.len == 0 || desc.end().is_none() {
            return Err(Error::invalid(
                descriptor(0, desc.addr, desc.len, desc.dev),
                "DRAM region must be non-empty and not wrap",
            ));
        }
        let mut token = 0;
        if let Engine::Uring(ring) = &self.engine {
            if self.register_buffers && ring.fixed_buffers && desc.len <= FIXED_BUFFER_BYTES_MAX {
                if let Some(slot) = self.buffers.vacant() {
                    // A refusal (memlock limit, file-backed memory) only means plain
                    // reads/writes for this region.
                    if ring.register_buffer(slot, desc.addr, desc.len).is_ok() {
                        token = self.buffers.fill(
                            slot,
                            BufEntry {
                                addr: desc.addr,
                                len_bytes: desc.len,
                            },
                        );
                    }
                }
            }
        }
        Ok(Registered {
            token,
            public_md: Vec::new(),
        })
    }

    fn fail(&mut self, request: u32, failure: Failure) {
        if let Some(req) = self.requests.get_mut(request) {
            let keep = match (req.failure, failure.range) {
                (None, _) => false,
                (Some(old), Some(new)) => old.range.is_some_and(|o| o <= new),
                (Some(_), None) => true,
            };
            if !keep {
                req.failure = Some(failure);
            }
        }
    }

    /// Free op `slot` and its uses of a file and a fixed buffer.
    fn release_op(&mut self, slot: u32) {
        let op = self.ops.slab.get(slot);
        let (file, fixed_buf) = (op.file, op.fixed_buf);
        self.files.release(file);
        if fixed_buf != NO_FIXED_BUF {
            self.buffers.release(u32::from(fixed_buf));
        }
        self.ops.release(slot);
    }

    /// Free op `slot`; complete its request if it was the last.
    fn finish_op(&mut self, slot: u32, done: &mut Completions) {
        let request = self.ops.slab.get(slot).request;
        self.release_op(slot);
        let last = match self.requests.get_mut(request) {
            Some(req) => {
                req.ops_left -= 1;
                req.ops_left == 0
            }
            None => false,
        };
        if last {
            self.complete_request(request, done);
        }
    }

    fn complete_request(&mut self, request: u32, done: &mut Completions) {
        if let Some(req) = self.requests.get_mut(request).take() {
            match req.failure {
                None => done.success(req.tag),
                Some(f) => done.failure(req.tag, f),
            }
            self.requests.give_back(request);
        }
    }

    /// Account one engine result for the op `user_data` names.
    fn on_result(&mut self, user_data: u64, result: i32, done: &mut Completions) {
        let Some(slot) = self.ops.resolve(user_data) else {
            // Not ours or stale: nothing to free. Cannot happen while the bookkeeping
            // holds; never dereference it.
            debug_assert!(false, "unknown io user_data {user_data:#x}");
            return;
        };
        let op = *self.ops.slab.get(slot);
        if let Some(req) = self.requests.get_mut(op.request) {
            req.ops_in_flight -= 1;
        }
        let failure = |kind, errno| Failure {
            kind,
            errno,
            range: Some(op.range_index),
        };
        if result < 0 {
            self.fail(op.request, failure(FailureKind::Backend, -result));
            self.finish_op(slot, done);
            return;
        }
        if result == 0 && op.done_bytes < op.len_bytes {
            let f = match op.op {
                Op::Read => failure(FailureKind::ShortRead, 0),
                // A write that moves nothing and reports no error: call it an I/O error.
                Op::Write => failure(FailureKind::Backend, libc::EIO),
            };
            self.fail(op.request, f);
            self.finish_op(slot, done);
            return;
        }
        let moved = op.done_bytes + result as u64;
        if moved >= op.len_bytes {
            self.finish_op(slot, done);
            return;
        }
        // Short transfer or next chunk: queue the rest.
        let entry = self.ops.slab.get_mut(slot);
        entry.done_bytes = moved;
        entry.state = OpState::Pending;
        self.pending.push_back(slot);
    }

    /// Hand queued operations to the engine while it has room, then submit them all in
    /// one go (also retrying SQEs a transient refusal left queued).
    fn feed(&mut self, done: &mut Completions) -> io::Result<()> {
        self.fill(done);
        self.engine.submit()
    }

    /// Hand queued operations to the engine while it has room, without submitting.
    fn fill(&mut self, done: &mut Completions) {
        while self.engine.has_room() {
            let Some(slot) = self.pending.pop_front() else {
                break;
            };
            let op = *self.ops.slab.get(slot);
            let request_failed =
                !matches!(self.requests.get(op.request), Some(r) if r.failure.is_none());
            if request_failed {
                // Do not start more work for a request that already failed.
                self.finish_op(slot, done);
                continue;
            }
            let Some(file) = self.files.get(op.file) else {
                // The region vanished under a queued op (the executor should prevent
                // this); fail the range rather than touch a stale descriptor.
                self.fail(
                    op.request,
                    Failure {
                        kind: FailureKind::Backend,
                        errno: libc::EBADF,
                        range: Some(op.range_index),
                    },
                );
                self.finish_op(slot, done);
                continue;
            };
            let remaining = op.len_bytes - op.done_bytes;
            let cmd = IoCmd {
                write: op.op == Op::Write,
                fd: file.fd,
                fixed_file: file.fixed.then_some(op.file),
                buf: op.mem_addr + op.done_bytes,
                len: remaining.min(CHUNK_BYTES_MAX) as u32,
                offset: op.file_offset + op.done_bytes,
                fixed_buf: op.fixed_buf,
                user_data: self.ops.user_data(slot),
            };
            self.ops.slab.get_mut(slot).state = OpState::InFlight;
            if let Some(req) = self.requests.get_mut(op.request) {
                req.ops_in_flight += 1;
            }
            self.engine.push(&cmd);
        }
    }

    fn drain_engine(&mut self, done: &mut Completions) {
        let mut reaped = std::mem::take(&mut self.reaped);
        loop {
            reaped.clear();
            let cap = reaped.capacity();
            let n = self.engine.reap(|ud, res| {
                if reaped.len() < cap {
                    reaped.push((ud, res));
                }
            });
            debug_assert_eq!(n, reaped.len(), "more completions than queue depth");
            for &(ud, res) in &reaped {
                self.on_result(ud, res, done);
            }
            if n < cap || n == 0 {
                break;
            }
        }
        self.reaped = reaped;
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
        let subject = || Subject::Named(format!("{kind} region with token {token:#x}").into());
        match kind {
            MemKind::File => {
                let slot = self
                    .files
                    .slot(token)
                    .ok_or_else(|| Error::not_found(subject()))?;
                if self.files.in_use(slot) {
                    return Err(Error::NotAllowed {
                        subject: subject(),
                        reason: "a posted request still uses it".into(),
                    });
                }
                if let Some(entry) = self.files.take(slot) {
                    if entry.fixed {
                        if let Engine::Uring(ring) = &self.engine {
                            // Clearing can only fail if the table is gone, and then
                            // nothing refers to the fd any more.
                            let _unused = ring.register_file(slot, -1);
                        }
                    }
                    // `entry.owned` (if any) closes the file here.
                    drop(entry);
                }
                Ok(())
            }
            MemKind::Dram => {
                if token == 0 {
                    return Ok(());
                }
                let slot = self
                    .buffers
                    .slot(token)
                    .ok_or_else(|| Error::not_found(subject()))?;
                if self.buffers.in_use(slot) {
                    return Err(Error::NotAllowed {
                        subject: subject(),
                        reason: "a posted request still uses it".into(),
                    });
                }
                if let Engine::Uring(ring) = &self.engine {
                    ring.unregister_buffer(slot).map_err(|e| {
                        os_error(
                            errno_of(&e),
                            format!("cannot unregister fixed buffer {slot}: {e}"),
                        )
                    })?;
                }
                self.buffers.take(slot);
                Ok(())
            }
            other => Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!("memory kind {other}").into(),
            }),
        }
    }

    fn conn_info(&self) -> Vec<u8> {
        Vec::new()
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
        // Validate everything and check capacity before starting anything.
        let mut ops_needed: usize = 0;
        for post in batch {
            self.check_post(endpoint, post)?;
            ops_needed += post.ranges.iter().filter(|r| r.len > 0).count();
        }
        if batch.len() > self.requests.available() {
            return Err(Error::Capacity {
                what: "POSIX requests outstanding (parameter max_requests)",
                limit: self.requests.capacity(),
            });
        }
        if ops_needed > self.ops.slab.available() {
            return Err(Error::Capacity {
                what: "POSIX ranges outstanding (parameter max_ops)",
                limit: self.ops.slab.capacity(),
            });
        }

        for post in batch {
            let ops_left = post.ranges.iter().filter(|r| r.len > 0).count() as u32;
            if ops_left == 0 {
                done.success(post.tag);
                continue;
            }
            let Some(request) = self.requests.take() else {
                unreachable!("request capacity checked above");
            };
            *self.requests.get_mut(request) = Some(Request {
                tag: post.tag,
                ops_left,
                ops_in_flight: 0,
                failure: None,
            });
            for (i, range) in post.ranges.iter().enumerate() {
                if range.len == 0 {
                    continue;
                }
                let Some(slot) = self.ops.slab.take() else {
                    unreachable!("operation capacity checked above");
                };
                let file = self.files.slot(range.remote_token).unwrap_or(0);
                let fixed_buf = match self.buffers.slot(range.local_token) {
                    Some(b) if range.local_token != 0 => b as u16,
                    _ => NO_FIXED_BUF,
                };
                // Per-region use counts (released with the operation) let deregistration
                // refuse a region in use without scanning the operation slab.
                self.files.acquire(file);
                if fixed_buf != NO_FIXED_BUF {
                    self.buffers.acquire(u32::from(fixed_buf));
                }
                let generation = self.ops.slab.get(slot).generation;
                *self.ops.slab.get_mut(slot) = IoOp {
                    generation,
                    state: OpState::Pending,
                    request,
                    range_index: i as u32,
                    op: post.op,
                    file,
                    mem_addr: range.local_addr,
                    file_offset: range.remote_addr,
                    len_bytes: range.len,
                    done_bytes: 0,
                    fixed_buf,
                };
                self.pending.push_back(slot);
            }
        }
        // Submission failures past this point are reported per request by progress
        // (the operations stay queued), since requests are already accepted.
        if let Err(e) = self.feed(done) {
            self.fail_queued(errno_of(&e), done);
        }
        Ok(())
    }

    fn progress(&mut self, done: &mut Completions) {
        self.drain_engine(done);
        if let Err(e) = self.feed(done) {
            self.fail_queued(errno_of(&e), done);
        }
    }

    fn cancel(&mut self, tag: u64) -> Result<bool> {
        let found = self
            .requests
            .iter()
            .find_map(|(slot, r)| r.filter(|r| r.tag == tag).map(|r| (slot, r)));
        let Some((request, req)) = found else {
            return Err(Error::not_found(Subject::Named(
                format!("POSIX request with tag {tag:#x}").into(),
            )));
        };
        if req.ops_in_flight > 0 {
            return Ok(false);
        }
        let mut kept = 0;
        for i in 0..self.pending.len() {
            let slot = self.pending[i];
            if self.ops.slab.get(slot).request == request {
                self.release_op(slot);
            } else {
                self.pending[kept] = slot;
                kept += 1;
            }
        }
        self.pending.truncate(kept);
        *self.requests.get_mut(request) = None;
        self.requests.give_back(request);
        Ok(true)
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

fn is_absent(errno: i32) -> bool {
    errno == libc::ENOENT || errno == libc::ENOTDIR
}

fn query_path(path: &Path) -> Result<QueryResult> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(QueryResult {
            exists: true,
            size: m.len(),
            mode: m.mode(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
        }),
        Err(e) if is_absent(errno_of(&e)) => Ok(QueryResult::default()),
        Err(e) => Err(os_error(
            errno_of(&e),
            format!("cannot stat file '{}': {e}", path.display()),
        )),
    }
}

fn query_fd(index: usize, desc: &Desc) -> Result<QueryResult> {
    let Ok(fd) = RawFd::try_from(desc.dev) else {
        return Ok(QueryResult::default());
    };
    // SAFETY: stat is plain data; zeroed is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is writable and outlives the call.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        let e = io::Error::last_os_error();
        return match errno_of(&e) {
            libc::EBADF => Ok(QueryResult::default()),
            errno => Err(Error::Backend {
                backend: NAME.into(),
                errno,
                desc: Some(index as u32),
                detail: format!("cannot stat file descriptor {fd}: {e}").into(),
            }),
        };
    }
    Ok(QueryResult {
        exists: true,
        size: st.st_size as u64,
        mode: st.st_mode,
        mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec,
    })
}

impl PosixBackend {
    /// The engine refused a submission outright (not a transient refusal): fail every
    /// operation it holds queued so each request still completes exactly once.
    fn fail_queued(&mut self, errno: i32, done: &mut Completions) {
        while let Some(slot) = self.pending.pop_front() {
            let op = *self.ops.slab.get(slot);
            self.fail(
                op.request,
                Failure {
                    kind: FailureKind::Backend,
                    errno,
                    range: Some(op.range_index),
                },
            );
            self.finish_op(slot, done);
        }
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
