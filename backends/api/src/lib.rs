//! The backend contract: what a transport (loopback, UCX, POSIX/io_uring and GDS/cuFile)
//! must do for the Ferry executor, and what it may rely on.
//!
//! # State machine
//!
//! ```text
//!   BackendFactory::create ──▶ Ready
//!   Ready: register / deregister            (regions: token + public metadata)
//!          load_remote / unload_remote      (peers: connection info + public metadata)
//!          connect / disconnect             (optional; endpoints may be made lazily)
//!          post(batch) ──▶ each Post is in flight until exactly one Completion
//!                          carrying its tag is pushed (from post itself or a later
//!                          progress call)
//!          progress(completions)            (never blocks)
//!          notify / drain_notifications
//!   drop ──▶ outstanding posts are abandoned (no completion), but drop returns only
//!            once the transport can no longer touch their buffers; the backend frees
//!            everything it owns
//! ```
//!
//! # Safety contract: who guarantees what
//!
//! A backend makes the kernel, a NIC, UCX or a plain `memmove` read and write raw
//! addresses that Rust cannot check. The methods through which that happens are
//! `unsafe fn`s, each with a `# Safety` section (in the manner of wgpu-hal), so safe
//! code cannot reach them without taking on the promise:
//!
//! - [`Backend::register`]: the caller promises that the region's bytes (DRAM) or file
//!   descriptor (FILE by fd) stay valid until [`Backend::deregister`] of the returned
//!   token returns. A backend may pin, map or register that memory with the kernel or
//!   the NIC (`ucp_mem_map`, io_uring fixed buffers) for that whole time.
//! - [`Backend::post`]: the caller promises that every local range (and, for
//!   [`Endpoint::Local`], every remote range) lies inside a region registered with this
//!   backend under the range's token, and that the region stays registered and its bytes
//!   valid until the request's completion has been pushed — not merely until `post`
//!   returns. No Rust reference may alias bytes that a request in flight writes.
//! - [`Backend::deregister`]: the caller promises that no request naming the token is
//!   in flight (each one's completion has been pushed). Afterwards the backend never
//!   touches the region's bytes again.
//! - [`Backend::free`]: the caller promises that the allocation (made by
//!   [`Backend::alloc`], which is safe: the backend owns that memory) is no longer
//!   registered with any backend and that nothing will touch its bytes again.
//!
//! The executor (`ferry-schedules`) keeps these promises for registrations it made: a
//! registration comes only from `CommandBuffer::register`, itself an `unsafe fn` whose
//! caller promises the memory; ranges are resolved against the section index, so they
//! lie inside registered regions; a region that an in-flight request uses cannot be
//! deregistered; and a request whose peer went away stays pinned until its backend
//! reports its one completion.
//!
//! What the caller *cannot* promise is the far side of a peer transfer: the target
//! agent owns that memory and may deregister it at any time. Each backend guards the
//! remote side with what its transport offers: LOOPBACK checks at post that the target
//! region is still registered and really covers each range (and pins it for the copy).
//! UCX cannot do as much: with the
//! transports UCX 1.13 picks for ordinary memory (put emulated over active messages on
//! tcp or shared memory, CMA) the target's UCX writes to the address it is given
//! without checking that the region is still mapped, so a target must make its peers
//! drop its metadata (a new metadata generation, an invalidation) before the memory is
//! reused; between the deregistration and the peers' reload there is a window the UCX
//! backend does not close (see `backends/ucx/README.md`).
//!
//! Everything else is safe: a backend must cope with any argument to a safe method
//! (unknown tokens, peers that went away, bad peer metadata) with a typed error.
//! Slices passed *into* a call (`Post::ranges`, notification payloads, metadata bytes)
//! are borrowed only for the duration of that call; a backend copies what it keeps.
//!
//! # No byte after a failure is reported
//!
//! A request reported failed (peer timeout, disconnect, unload with it in flight) must
//! not write into the target afterwards: its data is undefined *where it had landed
//! by then*, and nothing more of it arrives later. What each backend does for that:
//!
//! - **LOOPBACK**: copies inside `post` or a later `progress`; a failure is reported
//!   only for ranges not copied, and nothing is queued anywhere else. Guaranteed.
//! - **SHM**: one-sided CMA or memcpy from the initiator's own thread inside
//!   `post`/`progress`; nothing is queued in the kernel. Guaranteed.
//! - **UCX**: the force close cancels what UCX holds; what the kernel already took
//!   for a TCP connection is dropped too (its connections to the peer are reset with
//!   `connect(AF_UNSPEC)` before the close, `backends/ucx/src/state/sockets.rs`), so
//!   nothing of a failed request is retransmitted once a link that went down comes
//!   back (tested across network namespaces, `tests/tests/netns.rs`). Over tcp every
//!   range travels in Ferry's own messages (`am_tcp`), so UCX 1.13's put handler, which
//!   aborts the target when its connection was reset, is not used. Not covered: packets
//!   the initiator's NIC still held when it lost carrier and sends when it regains it
//!   (seen with a veth end whose peer went down; a purge needs `CAP_NET_ADMIN`), data
//!   the peer sends on connections it opened (READ replies: Ferry drops replies whose
//!   message is no longer awaited), and RDMA transports (not run here).
//!
//! # Deregistration fences peers where the target checks
//!
//! [`Backend::withdraw`] is the first step of every deregistration: a backend answers
//! whether a peer can still reach the region. LOOPBACK (checks the target's
//! registrations at post) and UCX over tcp (the target's message handler checks every
//! range) say yes at once; SHM says yes once every live sender is idle or has seen the
//! withdrawal (`backends/shm/src/ring.rs`). UCX puts over shared memory, CMA or RDMA
//! are not fenced (the default answer is yes; documented in `backends/ucx/README.md`).
//!
//! # Every post yields exactly one completion
//!
//! Once `post` has returned `Ok`, each of its requests produces exactly one
//! [`Completion`] (from `post` itself or a later `progress`), also when its peer is
//! unloaded meanwhile ([`Backend::unload_remote`]): the backend reports the request
//! only after the transport confirmed that it finished or was canceled and will not
//! touch its buffers again. Only [`Backend::cancel`] returning `Ok(true)` ends a
//! request without a completion, and only when nothing of it is in flight any more.
//!
//! # Errors a caller can expect
//!
//! Synchronous calls return [`Error`]: `InvalidParam` for ranges the backend cannot
//! serve (e.g. O_DIRECT misalignment), `NotFound` for unknown tokens or peers (also a
//! token whose region was deregistered since: tokens are generational, so a stale one
//! never names a newer region), `NotAllowed` where a backend refuses to deregister a
//! region in use,
//! `NotSupported` for operations outside its capabilities, `Backend` with an errno for
//! OS or transport failures. Asynchronous outcomes arrive as [`Completion`]s; a failed
//! transfer reports a [`Failure`] with the errno and the range index.

// Reason: copying bytes between raw addresses is what a backend's ranges are.
#[allow(unsafe_code)]
mod copy;
pub mod trace;
pub use copy::copy_bytes;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

pub use ferry_storage::{Desc, Endpoint, Error, MemKind, Op, PeerId, Result, Subject};

/// Named backend parameters: string keys to string values, like the reference system.
pub type Params = BTreeMap<String, String>;

/// One parameter a backend understands.
#[derive(Clone, Copy, Debug)]
pub struct ParamSpec {
    /// The key.
    pub name: &'static str,
    /// The value used when the caller gives none.
    pub default: &'static str,
    /// What it does.
    pub doc: &'static str,
}

/// What a backend can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Transfers to other agents.
    pub remote: bool,
    /// Transfers within the local agent (e.g. DRAM ↔ FILE).
    pub local: bool,
    /// Notifications (with transfers and standalone).
    pub notifications: bool,
    /// Memory kinds it can register.
    pub mem_kinds: &'static [MemKind],
}

impl Capabilities {
    /// Whether `kind` is supported.
    pub fn supports(&self, kind: MemKind) -> bool {
        self.mem_kinds.contains(&kind)
    }
}

/// How a FILE region registered by path is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FileMode {
    /// Open for writing too (otherwise read-only).
    pub write: bool,
    /// Create the file if it does not exist (needs `write`).
    pub create: bool,
    /// Bypass the page cache (`O_DIRECT`): addresses, lengths and offsets must be aligned.
    pub direct: bool,
    /// Synchronous writes (`O_SYNC`).
    pub sync: bool,
}

impl FileMode {
    /// Open `path` as this mode says (close-on-exec; `O_DIRECT`/`O_SYNC` as asked;
    /// created with mode 0644). `backend` names the backend in the error: `InvalidParam`
    /// for `create` without `write`, `Backend` (with the errno) when the open fails.
    pub fn open(&self, path: &Path, backend: &'static str) -> Result<std::os::fd::OwnedFd> {
        use std::os::unix::fs::OpenOptionsExt;
        if self.create && !self.write {
            return Err(Error::invalid(
                Subject::Named(format!("file '{}'", path.display()).into()),
                "create needs write mode",
            ));
        }
        let mut flags = libc::O_CLOEXEC;
        if self.direct {
            flags |= libc::O_DIRECT;
        }
        if self.sync {
            flags |= libc::O_SYNC;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(self.write)
            .create(self.create)
            .mode(0o644)
            .custom_flags(flags)
            .open(path)
            .map_err(|e| Error::Backend {
                backend: backend.into(),
                errno: e.raw_os_error().unwrap_or(libc::EIO),
                desc: None,
                detail: format!("cannot open file '{}': {e}", path.display()).into(),
            })?;
        Ok(file.into())
    }
}

/// A region to register.
#[derive(Clone, Copy, Debug)]
pub struct RegionSpec<'a> {
    /// Memory kind.
    pub kind: MemKind,
    /// The range. For FILE, `addr` is the starting offset, `len` may be 0 meaning
    /// "whole file / unbounded", and `dev` is the open file descriptor unless `path`
    /// is given. For OBJECT, `addr` is the starting offset inside the object, `len` may
    /// be 0 ("whole object / unbounded") and `dev` is the object id descriptors use.
    pub desc: Desc,
    /// For FILE regions registered by path: the file and how to open it. The backend
    /// opens it at registration and closes it at deregistration. For OBJECT regions: the
    /// object's name (a key, or `s3://bucket/key`; NIXL's `metaInfo`), the mode unused;
    /// `None` names the object by its id (`desc.dev` in decimal, as NIXL does without
    /// `metaInfo`).
    pub path: Option<(&'a Path, FileMode)>,
}

/// What registration produced.
#[derive(Clone, Debug, Default)]
pub struct Registered {
    /// Backend-private token for the region (a memory handle, an fd …); handed back in
    /// every posted range that uses the region and at deregistration.
    pub token: u64,
    /// Metadata a peer needs to reach the region (an rkey …); may be empty.
    pub public_md: Vec<u8>,
}

/// Memory a backend allocated ([`Backend::alloc`]): `len` bytes at `addr`, owned by the
/// backend until [`Backend::free`] (or until the backend is dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// First byte.
    pub addr: u64,
    /// Bytes usable from `addr` (the length asked for).
    pub len: u64,
}

/// A peer's published regions for this backend, readable in place. `token` is what the
/// executor puts in [`Range::remote_token`] for that peer.
pub trait PeerRegions: Send + Sync {
    /// The peer's agent name.
    fn agent_name(&self) -> &str;
    /// Public metadata of the region named by `token`, or `None` if unknown.
    fn public_md(&self, token: u64) -> Option<&[u8]>;
    /// Every region the peer published for backend type `backend`: (token, range,
    /// public metadata), for a backend that checks what it was given when it loads a
    /// peer. The default lists nothing.
    fn for_each_region(&self, backend: &str, visit: &mut dyn FnMut(u64, Desc, &[u8])) {
        let _ = (backend, visit);
    }
}

/// What a backend receives about a peer when its metadata is loaded (or reloaded).
#[derive(Clone)]
pub struct RemoteAgent<'a> {
    /// Peer agent name.
    pub name: &'a str,
    /// The peer's connection info for this backend (may be empty for partial metadata
    /// loaded without connection info; the earlier info stays in force then).
    pub conn_info: &'a [u8],
    /// The peer's regions for this backend.
    pub regions: Arc<dyn PeerRegions>,
    /// A backend before this one in the agent's order took the peer and reaches every
    /// region the peer published (for it, and at least as many as for this backend),
    /// and this backend holds no local region of a kind the earlier one lacks (device
    /// memory): requests to the peer go there unless one names this backend, or a list
    /// registered later only this one covers. A backend may leave its connection work
    /// for such a peer to the first request that needs it (UCX does, instead of
    /// `connect_on_load`); it must still serve that request.
    pub standby: bool,
    /// Ranges the agent readied its own request path for at this load (one per region
    /// the peer published, within fixed bounds): a backend with per-post scratch that
    /// grows with a request's ranges can size it now, so the first request after the
    /// load finds it made instead of growing it. 0: ready nothing.
    pub ready_ranges: usize,
}

/// One resolved, merged range of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Range {
    /// Local address (or offset for FILE).
    pub local_addr: u64,
    /// Remote address (or offset for FILE).
    pub remote_addr: u64,
    /// Bytes.
    pub len: u64,
    /// Local device id.
    pub local_dev: u64,
    /// Remote device id.
    pub remote_dev: u64,
    /// The local region's registration token.
    pub local_token: u64,
    /// For [`Endpoint::Local`]: the target region's registration token. For a peer:
    /// the token to pass to [`PeerRegions::public_md`].
    pub remote_token: u64,
}

/// One transfer request inside a posted batch.
#[derive(Clone, Copy, Debug)]
pub struct Post<'a> {
    /// The handle tag to report in the completion.
    pub tag: u64,
    /// Direction.
    pub op: Op,
    /// Memory kind of the local side.
    pub local_kind: MemKind,
    /// Memory kind of the remote (target) side.
    pub remote_kind: MemKind,
    /// Merged ranges, in order.
    pub ranges: &'a [Range],
    /// Notification to deliver after all data is visible at the target.
    pub notif: Option<&'a [u8]>,
}

impl Post<'_> {
    /// Total bytes of the request.
    pub fn len_bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.len).sum()
    }
}

/// How an estimate of a request's duration was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostMethod {
    /// The transport's own performance model (UCX: `ucp_ep_evaluate_perf`).
    Analytical,
    /// A fit of the durations this agent measured for the backend's completed requests.
    Measured,
}

/// An estimate of a request's duration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostEstimate {
    /// Expected time from post to completion.
    pub duration: std::time::Duration,
    /// How far off it may be (one standard deviation of the fit's residuals; zero when
    /// the method gives none).
    pub margin: std::time::Duration,
    /// How it was made.
    pub method: CostMethod,
}

/// Why an asynchronous transfer failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The transport or OS reported an error (see `errno`).
    Backend,
    /// The peer went away.
    RemoteDisconnect,
    /// The transfer was canceled.
    Canceled,
    /// A short read: the file ended before the range did.
    ShortRead,
    /// The target does not exist (an object store's missing bucket or key).
    NotFound,
    /// The target refused access (an object store's 403: bad or missing credentials, a
    /// policy that forbids the operation).
    Denied,
    /// The target kept asking to slow down (429, 503 SlowDown) until the backend's
    /// retries ran out.
    Throttled,
}

/// An asynchronous failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// What kind of failure.
    pub kind: FailureKind,
    /// OS / transport error number, 0 if none.
    pub errno: i32,
    /// Index of the failing range within the post, if known.
    pub range: Option<u32>,
}

/// The outcome of one posted request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The tag from [`Post::tag`].
    pub tag: u64,
    /// Success, or why not.
    pub result: Result<(), Failure>,
}

/// Where a backend pushes completions. Owned by the executor, sized from the agent's
/// bounds so pushing does not allocate in steady state.
#[derive(Debug, Default)]
pub struct Completions {
    items: Vec<Completion>,
    /// The clock reading the engine took as it handed over the batch being posted.
    posted_at: Option<std::time::Instant>,
}

impl Completions {
    /// A sink sized for `capacity` completions.
    pub fn with_capacity(capacity: usize) -> Self {
        Completions {
            items: Vec::with_capacity(capacity),
            posted_at: None,
        }
    }

    /// The time now, for a backend that needs one during [`Backend::post`] (a liveness
    /// answer's age): the clock reading the engine took as it handed over the batch
    /// (its telemetry reads one), or, where it took none, a fresh one. A vDSO clock
    /// read costs ~25 ns on a VM, a tenth of a small request.
    #[inline]
    pub fn now(&self) -> std::time::Instant {
        self.posted_at.unwrap_or_else(std::time::Instant::now)
    }

    /// Set (before a post) or clear (after it) the reading [`Completions::now`] gives.
    /// For the engine.
    #[inline]
    pub fn set_posted_at(&mut self, at: Option<std::time::Instant>) {
        self.posted_at = at;
    }
    /// Report one outcome.
    #[inline]
    pub fn push(&mut self, completion: Completion) {
        self.items.push(completion);
    }
    /// Report success for `tag`.
    #[inline]
    pub fn success(&mut self, tag: u64) {
        self.push(Completion {
            tag,
            result: Ok(()),
        });
    }
    /// Report failure for `tag`.
    #[inline]
    pub fn failure(&mut self, tag: u64, failure: Failure) {
        self.push(Completion {
            tag,
            result: Err(failure),
        });
    }
    /// Outcomes pushed so far.
    pub fn as_slice(&self) -> &[Completion] {
        &self.items
    }
    /// Forget all outcomes (keeps the capacity).
    pub fn clear(&mut self) {
        self.items.clear();
    }
    /// Make room for `additional` more outcomes than are pushed now.
    pub fn reserve(&mut self, additional: usize) {
        self.items.reserve(additional);
    }
    /// Number of outcomes pushed.
    pub fn len(&self) -> usize {
        self.items.len()
    }
    /// Whether none were pushed.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// Where a backend delivers inbound notifications while draining.
pub trait NotifSink {
    /// One notification from agent `from`.
    fn deliver(&mut self, from: &str, payload: &[u8]);
}

/// The answer of [`Backend::query`] for one descriptor.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct QueryResult {
    /// Whether the thing exists.
    pub exists: bool,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (POSIX mode).
    pub mode: u32,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
}

/// Everything a backend needs at creation.
#[derive(Clone, Debug)]
pub struct BackendInit<'a> {
    /// The owning agent's name.
    pub agent_name: &'a str,
    /// Effective parameters (caller's values over the defaults).
    pub params: &'a Params,
}

/// Creates backends of one type. Registered with the agent's backend registry.
pub trait BackendFactory: Send + Sync {
    /// The type name (`LOOPBACK`, `UCX`, `POSIX` …).
    fn name(&self) -> &'static str;
    /// Parameters it understands, with defaults.
    fn params(&self) -> &'static [ParamSpec];
    /// Memory kinds its backends support.
    fn mem_kinds(&self) -> &'static [MemKind];
    /// Whether it can work on this machine (library found, kernel support …); the
    /// reason when not.
    fn available(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    /// Whether it can work with these (effective) parameters, e.g. a library named by a
    /// parameter instead of the default one. The default follows
    /// [`BackendFactory::available`].
    fn available_with(&self, params: &Params) -> std::result::Result<(), String> {
        let _ = params;
        self.available()
    }
    /// Whether one of its memory kinds works on this machine (e.g. VRAM needs a CUDA
    /// driver and, for UCX, a UCX built with CUDA); the reason when not. The default
    /// follows [`BackendFactory::available`].
    fn kind_available(&self, kind: MemKind) -> std::result::Result<(), String> {
        let _ = kind;
        self.available()
    }
    /// Make a backend instance.
    fn create(&self, init: &BackendInit<'_>) -> Result<Box<dyn Backend>>;
}

/// Fill in defaults for every parameter the caller left out; refuse unknown keys.
pub fn effective_params(
    backend: &'static str,
    specs: &[ParamSpec],
    given: &Params,
) -> Result<Params> {
    for key in given.keys() {
        if !specs.iter().any(|s| s.name == key) {
            return Err(Error::invalid(
                Subject::BackendName(backend.to_string()),
                format!("unknown parameter '{key}'"),
            ));
        }
    }
    Ok(specs
        .iter()
        .map(|s| {
            let value = given
                .get(s.name)
                .cloned()
                .unwrap_or_else(|| s.default.to_string());
            (s.name.to_string(), value)
        })
        .collect())
}

/// A transport. See the crate docs for the state machine and the safety contract.
// Reason: the methods through which a backend touches raw addresses are `unsafe fn`s,
// so that their callers take on the promise (see "Safety contract" in the crate docs).
#[allow(unsafe_code)]
pub trait Backend: Send {
    /// The type name (matches its factory).
    fn name(&self) -> &'static str;

    /// What it can do.
    fn capabilities(&self) -> Capabilities;

    /// Effective parameter values.
    fn params(&self) -> &Params;

    /// What this instance runs on, in a few words for the agent's "backend created" log
    /// line: the engine it chose, the library it loaded and that library's version where
    /// it has one (`engine io_uring (queue depth 256, …)`, `cuFile from …, GDS mode`).
    /// Called once, at creation. The default says nothing more than the type name.
    fn describe(&self) -> Option<String> {
        None
    }

    /// Register a region; returns a private token and public metadata.
    ///
    /// # Safety
    ///
    /// For DRAM, `region.desc` names memory the caller owns that stays allocated and
    /// valid (not freed, unmapped or reused) until [`Backend::deregister`] of the
    /// returned token has returned; the backend may pin or map it and, during posts,
    /// have the kernel, the NIC or a copy read and write it. For FILE by descriptor,
    /// `desc.dev` stays an open descriptor of the same file for as long. Nothing is
    /// promised about a path (the backend opens and owns the file itself).
    unsafe fn register(&mut self, region: &RegionSpec<'_>) -> Result<Registered>;

    /// Withdraw a region from peers: the first step of a fenced deregistration (issue
    /// 21). `Ok(true)` once no peer can reach the region any more — a peer that still
    /// names it (stale metadata) has its transfers refused, and none is running — so
    /// [`Backend::deregister`] may follow; `Ok(false)` while a peer may still be moving
    /// bytes into or out of it: the engine asks again later (the caller polls; nothing
    /// waits). Asking again for a region being withdrawn only checks.
    ///
    /// The default answers `Ok(true)`: right for a backend whose peers cannot reach a
    /// region without the target checking it at that moment (LOOPBACK checks at post;
    /// UCX where ranges travel in Ferry's messages; local-only backends). A backend whose
    /// transport writes into a peer region unchecked (UCX puts over shared memory, CMA or
    /// RDMA) cannot withdraw and says so in its docs.
    fn withdraw(&mut self, kind: MemKind, token: u64) -> Result<bool> {
        let _ = (kind, token);
        Ok(true)
    }

    /// Release a region registered with `token`. An unknown or already released token
    /// is a `NotFound` error.
    ///
    /// # Safety
    ///
    /// No request that names `token` (as its local token, or as a remote token of an
    /// [`Endpoint::Local`] request) is in flight: every post that used it has had its
    /// completion pushed. After this returns the backend never touches the region.
    unsafe fn deregister(&mut self, kind: MemKind, token: u64) -> Result<()>;

    /// Allocate `len` bytes of `kind` memory in the form this backend moves best (UCX:
    /// `ucp_mem_map(ALLOCATE)`, a shared-memory segment a same-host peer attaches
    /// through the rkey). Registering a range inside it with this backend reuses the
    /// allocation's own mapping; other backends may register it as ordinary memory.
    /// The memory stays valid until [`Backend::free`] or until the backend is dropped.
    /// Errors: `NotSupported` (the default: the backend allocates nothing, or not this
    /// kind), `InvalidParam` for a zero or oversized `len`, `Backend` when the
    /// transport's allocation fails.
    fn alloc(&mut self, kind: MemKind, len: u64) -> Result<Allocation> {
        let _ = (kind, len);
        Err(Error::NotSupported {
            backend: self.name().into(),
            what: "allocating memory".into(),
        })
    }

    /// Free an allocation made by [`Backend::alloc`] (named by its `addr`). `NotFound`
    /// if there is none at `addr`; `NotAllowed` while a region of this backend is still
    /// registered inside it.
    ///
    /// # Safety
    ///
    /// No backend has the allocation registered any more and nothing reads or writes its
    /// bytes after this call (they are unmapped).
    unsafe fn free(&mut self, kind: MemKind, addr: u64) -> Result<()> {
        let _ = (kind, addr);
        Err(Error::NotSupported {
            backend: self.name().into(),
            what: "allocating memory".into(),
        })
    }

    /// Connection info peers need to reach this backend (empty for local-only ones).
    /// An error where making it needs resources that could not be had (UCX creates its
    /// workers on first need).
    fn conn_info(&self) -> Result<Vec<u8>>;

    /// Take in (or refresh) a peer's connection info and regions.
    fn load_remote(&mut self, peer: PeerId, remote: RemoteAgent<'_>) -> Result<()>;

    /// Forget a peer: drop cached remote keys and endpoints. Requests still in flight
    /// to it are canceled; each still produces its one completion (usually a failure),
    /// but only once the transport confirmed it will not touch their buffers any more —
    /// possibly in a later [`Backend::progress`] call. Until then the caller keeps their
    /// regions registered (see the crate docs).
    fn unload_remote(&mut self, peer: PeerId);

    /// Establish the endpoint to `peer` now instead of on first use.
    fn connect(&mut self, peer: PeerId) -> Result<()> {
        let _ = peer;
        Ok(())
    }

    /// Tear down the endpoint to `peer` (it is re-made on next use).
    fn disconnect(&mut self, peer: PeerId) -> Result<()> {
        let _ = peer;
        Ok(())
    }

    /// Whether this backend can move bytes to and from the peer's region named by
    /// `remote_token` (the token [`PeerRegions::public_md`] takes). Asked when a remote
    /// descriptor list is prepared: a backend that says no leaves that list's
    /// candidates, so another backend common to both agents serves it (SHM says no for
    /// a peer's ordinary memory where the kernel refuses cross-memory attach). The
    /// default reaches every region of a loaded peer.
    fn reaches(&self, peer: PeerId, remote_token: u64) -> bool {
        let _ = (peer, remote_token);
        true
    }

    /// Check a request when it is built (before any post): ranges the backend can never
    /// serve (O_DIRECT misalignment, unsupported kinds, ranges past a region) are
    /// refused here with an error naming the range, so they fail their own `make`
    /// instead of a whole batch at post time. The default accepts everything.
    fn validate(&self, endpoint: Endpoint, post: &Post<'_>) -> Result<()> {
        let _ = (endpoint, post);
        Ok(())
    }

    /// A human-readable name for the target of `token` (e.g. a file's path), used in
    /// error messages of failed transfers. The default knows none.
    fn describe_target(&self, kind: MemKind, token: u64) -> Option<String> {
        let _ = (kind, token);
        None
    }

    /// Start a batch of requests to one endpoint. Every post must later produce
    /// exactly one completion with its tag (pushed here or in [`Backend::progress`]).
    /// An `Err` means none of the batch was started, no byte moved and no completion
    /// will come.
    ///
    /// # Safety
    ///
    /// Every range's local bytes (and, for [`Endpoint::Local`], its remote bytes) lie
    /// inside a region registered with this backend under the range's token, and that
    /// region stays registered and its bytes valid until this request's completion has
    /// been pushed. No Rust reference aliases bytes the request writes until then. The
    /// remote side of a peer transfer is not the caller's to promise: the backend checks
    /// it as far as its transport allows (see the crate docs).
    unsafe fn post(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()>;

    /// Advance outstanding work and push completions. Never blocks.
    fn progress(&mut self, done: &mut Completions);

    /// The backend's own estimate of how long a request of `ranges` (merged, to
    /// `endpoint`) takes (NIXL's `estimateXferCost`), or `None` when it has no model
    /// of its own (the engine then uses what it measured; see `Agent::estimate`).
    fn estimate(&mut self, endpoint: Endpoint, op: Op, ranges: &[Range]) -> Option<CostEstimate> {
        let _ = (endpoint, op, ranges);
        None
    }

    /// Cancel an in-flight request. Returns `Ok(true)` if it was canceled (no
    /// completion will follow, and the backend no longer touches its buffers),
    /// `Ok(false)` if it cannot be canceled now (its completion will still come).
    fn cancel(&mut self, tag: u64) -> Result<bool> {
        let _ = tag;
        Ok(false)
    }

    /// Send a standalone notification to `endpoint` (`Local` = to oneself).
    fn notify(&mut self, endpoint: Endpoint, payload: &[u8]) -> Result<()> {
        let _ = (endpoint, payload);
        Err(Error::NotSupported {
            backend: self.name().into(),
            what: "notifications".into(),
        })
    }

    /// Hand every inbound notification received so far to `sink`; returns how many.
    fn drain_notifications(&mut self, sink: &mut dyn NotifSink) -> usize {
        let _ = sink;
        0
    }

    /// Describe memory or files (one result per descriptor, in order).
    fn query(
        &mut self,
        kind: MemKind,
        descs: &[Desc],
        paths: &[Option<&Path>],
    ) -> Result<Vec<QueryResult>> {
        let _ = (kind, descs, paths);
        Err(Error::NotSupported {
            backend: self.name().into(),
            what: "query".into(),
        })
    }
}
