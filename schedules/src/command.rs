//! Recording: commands are plain `Copy` data (handles plus spans into side arrays), so
//! the executor can validate, bucket, sort and trace them.

use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::Path;

use ferry_backend_api::FileMode;
use ferry_storage::{
    BackendMask, Desc, Error, MemKind, Op, PeerId, PrepId, RegionId, StridedDesc, XferId,
};

/// A reference to a result of an earlier command of the same buffer.
#[derive(Debug)]
pub struct Ticket<H> {
    pub(crate) index: u32,
    _handle: PhantomData<fn() -> H>,
}

impl<H> Clone for Ticket<H> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<H> Copy for Ticket<H> {}

impl<H> Ticket<H> {
    pub(crate) fn new(index: u32) -> Self {
        Ticket {
            index,
            _handle: PhantomData,
        }
    }
    /// Position of the command in its buffer.
    pub fn index(self) -> u32 {
        self.index
    }
}

/// A handle, or the handle a not-yet-flushed command of the same buffer will create.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ref<H> {
    /// An existing object.
    Handle(H),
    /// The object created by command `index` of the same buffer.
    Ticket(u32),
}

impl<H> From<Ticket<H>> for Ref<H> {
    fn from(t: Ticket<H>) -> Self {
        Ref::Ticket(t.index)
    }
}
macro_rules! ref_from_handle {
    ($($h:ty),*) => {$(
        impl From<$h> for Ref<$h> {
            fn from(h: $h) -> Self { Ref::Handle(h) }
        }
    )*};
}
ref_from_handle!(RegionId, PrepId, XferId, PeerId);

/// Which agent a descriptor list (or a notification) refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The local agent's own regions.
    Local,
    /// A peer's published regions.
    Peer(Ref<PeerId>),
}

impl From<PeerId> for Side {
    fn from(p: PeerId) -> Self {
        Side::Peer(Ref::Handle(p))
    }
}
impl From<Ticket<PeerId>> for Side {
    fn from(t: Ticket<PeerId>) -> Self {
        Side::Peer(t.into())
    }
}

/// A range into one of the buffer's side arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Span {
    /// First element.
    pub start: u32,
    /// Number of elements.
    pub len: u32,
}

impl Span {
    pub(crate) fn range(self) -> std::ops::Range<usize> {
        self.start as usize..(self.start + self.len) as usize
    }
}

/// What can be released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Releasable {
    /// A prepared list.
    Prep(Ref<PrepId>),
    /// A transfer request.
    Xfer(Ref<XferId>),
}

/// Where a metadata-exchange command goes: the configured store (etcd or TCPStore), or
/// the P2P listener of a peer at an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MdRoute {
    /// The configured store.
    Store,
    /// A peer's P2P listener.
    Peer(SocketAddr),
}

/// A metadata-exchange command. The agent runs these itself, before the executor's
/// phases, through its exchange manager (nothing waits on the network).
#[derive(Clone, Copy, Debug)]
pub enum ExchangeCmd {
    /// Send or publish our full metadata.
    SendLocal {
        /// Where.
        route: MdRoute,
    },
    /// Send or publish partial metadata of some regions under a label.
    SendPartial {
        /// Regions (span of the buffer's region array).
        regions: Span,
        /// Label (bytes span, UTF-8).
        label: Span,
        /// Where.
        route: MdRoute,
    },
    /// Ask for an agent's metadata (full, or partial under a label).
    Fetch {
        /// Agent name (bytes span, UTF-8).
        agent: Span,
        /// Label, if partial.
        label: Option<Span>,
        /// Where.
        route: MdRoute,
    },
    /// Withdraw our metadata.
    InvalidateLocal {
        /// Where.
        route: MdRoute,
    },
    /// Whether an agent's metadata is loaded (outcome [`Outcome::MdReady`]).
    Check {
        /// Agent name (bytes span, UTF-8).
        agent: Span,
    },
}

/// The descriptors of a [`Command::Prep`].
#[derive(Clone, Copy, Debug)]
pub enum PrepDescs {
    /// A plain list: a span of the buffer's descriptor array.
    List(Span),
    /// Strided runs ([`StridedDesc`]): a span of the buffer's run array; the list is
    /// every run's descriptors in order.
    Strided(Span),
}

/// One recorded command. Bulk data (descriptors, indices, bytes) lives in the buffer's
/// side arrays and is named by [`Span`]s.
#[derive(Clone, Copy, Debug)]
pub enum Command {
    /// Load a peer's metadata blob (bytes span). Creates or refreshes a peer.
    LoadMd {
        /// The blob.
        bytes: Span,
    },
    /// Forget a peer's metadata; its generation is bumped.
    InvalidateMd {
        /// The peer.
        peer: Ref<PeerId>,
    },
    /// Establish the endpoints to a loaded peer now (NIXL's `makeConnection`) instead of
    /// on first use.
    Connect {
        /// The peer.
        peer: Ref<PeerId>,
    },
    /// Register one region with every backend that supports its kind (or the hinted ones).
    Register {
        /// Memory kind.
        kind: MemKind,
        /// The range.
        desc: Desc,
        /// Restrict to these backend slots (`ALL` = any).
        hint: BackendMask,
        /// FILE by path: the UTF-8/OS path bytes and the open mode.
        path: Option<(Span, FileMode)>,
    },
    /// Deregister a region (runs in the last phase).
    Deregister {
        /// The region.
        region: Ref<RegionId>,
    },
    /// Resolve a descriptor list against sections once.
    Prep {
        /// Local or a peer.
        side: Side,
        /// Memory kind of every descriptor.
        kind: MemKind,
        /// Descriptors: a span of the desc array, or of the strided-run array.
        descs: PrepDescs,
        /// Restrict to these backends.
        hint: BackendMask,
    },
    /// Build a transfer request from two prepared lists and index lists.
    Make {
        /// Direction.
        op: Op,
        /// Local list.
        local: Ref<PrepId>,
        /// Indices into the local list (empty span = all, in order).
        local_idx: Span,
        /// Remote list.
        remote: Ref<PrepId>,
        /// Indices into the remote list (empty span = all, in order).
        remote_idx: Span,
        /// Notification payload (bytes span), if any.
        notif: Option<Span>,
        /// Preferred backends.
        hint: BackendMask,
    },
    /// Build a request in one shot from raw descriptor lists (no prep to keep).
    Create {
        /// Direction.
        op: Op,
        /// Memory kind of the local list.
        local_kind: MemKind,
        /// Local descriptors.
        local: Span,
        /// Whose regions the remote list names.
        remote_side: Side,
        /// Memory kind of the remote list.
        remote_kind: MemKind,
        /// Remote descriptors.
        remote: Span,
        /// Notification payload, if any.
        notif: Option<Span>,
        /// Preferred backends.
        hint: BackendMask,
    },
    /// Start (or restart) a request.
    Post {
        /// The request.
        xfer: Ref<XferId>,
    },
    /// Read a request's status after this flush's progress phase.
    Check {
        /// The request.
        xfer: Ref<XferId>,
    },
    /// Release a prepared list or a request (runs in the last phase).
    Release {
        /// What.
        what: Releasable,
    },
    /// Send a standalone notification.
    Notify {
        /// To whom (`Local` = to oneself).
        to: Side,
        /// Payload (bytes span).
        payload: Span,
    },
    /// Collect inbound notifications into this buffer.
    DrainNotifications,
    /// Metadata exchange (run by the agent before the executor's phases).
    Exchange(ExchangeCmd),
}

/// Status of a transfer request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XferStatus {
    /// Made but never posted.
    NotPosted,
    /// Posted; completion pending.
    InProgress,
    /// All data moved (and the notification, if any, sent).
    Done,
}

/// An object a command created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Created {
    /// A region.
    Region(RegionId),
    /// A prepared list.
    Prep(PrepId),
    /// A transfer request.
    Xfer(XferId),
    /// A peer.
    Peer(PeerId),
}

/// The result of one command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Not flushed yet.
    Pending,
    /// Done; nothing to report.
    Done,
    /// Created an object.
    Created(Created),
    /// A request's status (from post or check).
    Status(XferStatus),
    /// Inbound notifications drained into the buffer (how many).
    Drained(u32),
    /// Whether the asked-for agent's metadata is loaded.
    MdReady(bool),
    /// A deregistration withdrew the region (it is out of the tables and the published
    /// metadata) but a peer may still reach it: keep the memory and deregister the same
    /// handle again later (see `DeregStatus::Pending`).
    Withdrawing,
    /// Failed, alone.
    Failed(Error),
}

impl Outcome {
    /// The error, if the command failed.
    pub fn error(&self) -> Option<&Error> {
        match self {
            Outcome::Failed(e) => Some(e),
            _ => None,
        }
    }
    /// Whether it failed.
    pub fn is_err(&self) -> bool {
        matches!(self, Outcome::Failed(_))
    }
}

/// A recorded notification in the buffer after a drain: spans of `notif_bytes`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NotifEntry {
    pub(crate) from: Span,
    pub(crate) payload: Span,
}

/// Records commands without doing I/O and without touching an agent; flush it with
/// `Agent::flush`. Reuse it: [`CommandBuffer::clear`] keeps every allocation, so a
/// warmed-up buffer records without allocating.
#[derive(Debug, Default)]
pub struct CommandBuffer {
    pub(crate) commands: Vec<Command>,
    pub(crate) outcomes: Vec<Outcome>,
    pub(crate) descs: Vec<Desc>,
    pub(crate) strided: Vec<StridedDesc>,
    pub(crate) indices: Vec<u32>,
    pub(crate) bytes: Vec<u8>,
    pub(crate) regions: Vec<RegionId>,
    pub(crate) notifs: Vec<NotifEntry>,
    pub(crate) notif_bytes: Vec<u8>,
    pub(crate) flushed: bool,
}

/// Fluent handle to a just-recorded `make`/`create`, to attach options.
pub struct MakeBuilder<'a> {
    buffer: &'a mut CommandBuffer,
    index: u32,
}

impl MakeBuilder<'_> {
    /// Attach a notification delivered to the target after all data is visible there.
    pub fn notify(self, payload: &[u8]) -> Self {
        let span = self.buffer.push_bytes(payload);
        match &mut self.buffer.commands[self.index as usize] {
            Command::Make { notif, .. } | Command::Create { notif, .. } => *notif = Some(span),
            _ => unreachable!("MakeBuilder always points at make/create"),
        }
        self
    }
    /// Prefer these backend slots.
    pub fn prefer(self, backends: BackendMask) -> Self {
        match &mut self.buffer.commands[self.index as usize] {
            Command::Make { hint, .. } | Command::Create { hint, .. } => *hint = backends,
            _ => unreachable!("MakeBuilder always points at make/create"),
        }
        self
    }
    /// The ticket of the request this command creates.
    pub fn ticket(&self) -> Ticket<XferId> {
        Ticket::new(self.index)
    }
}

impl CommandBuffer {
    /// A buffer with room for `commands` commands before it grows.
    pub fn with_capacity(commands: usize) -> Self {
        CommandBuffer {
            commands: Vec::with_capacity(commands),
            outcomes: Vec::with_capacity(commands),
            descs: Vec::with_capacity(commands),
            strided: Vec::new(),
            indices: Vec::with_capacity(commands),
            bytes: Vec::with_capacity(256),
            regions: Vec::new(),
            notifs: Vec::with_capacity(64),
            notif_bytes: Vec::with_capacity(1024),
            flushed: false,
        }
    }

    /// Make room for `descs` descriptors (in all, across the buffer's lists) and touch
    /// it, so recording up to that many allocates nothing and faults in no page. A
    /// buffer that already has the room is left as it is. Whatever was recorded stays.
    pub fn ready_descs(&mut self, descs: usize) {
        let len = self.descs.len();
        if self.descs.capacity() >= descs {
            return;
        }
        self.descs.reserve(descs - len);
        self.descs.resize(self.descs.capacity(), Desc::default());
        self.descs.truncate(len);
    }

    /// Forget every command and result, keeping the allocations.
    pub fn clear(&mut self) {
        self.commands.clear();
        self.outcomes.clear();
        self.descs.clear();
        self.strided.clear();
        self.indices.clear();
        self.bytes.clear();
        self.regions.clear();
        self.notifs.clear();
        self.notif_bytes.clear();
        self.flushed = false;
    }

    /// Whether the buffer was flushed and not cleared since (flushing it again is
    /// refused; recording a new command starts a new batch).
    pub fn is_flushed(&self) -> bool {
        self.flushed
    }

    /// Mark every recorded command failed with `error` and the buffer flushed (for an
    /// agent that refuses a whole flush).
    pub fn fail_all(&mut self, error: Error) {
        for outcome in &mut self.outcomes {
            *outcome = Outcome::Failed(error.clone());
        }
        self.flushed = true;
    }

    /// Number of recorded commands.
    pub fn len(&self) -> usize {
        self.commands.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }

    /// The recorded commands.
    pub fn commands(&self) -> &[Command] {
        &self.commands
    }

    fn push(&mut self, command: Command) -> u32 {
        if self.flushed {
            // Recording after a flush starts a new batch.
            self.clear();
        }
        let index = self.commands.len() as u32;
        self.commands.push(command);
        self.outcomes.push(Outcome::Pending);
        index
    }

    fn push_descs(&mut self, descs: &[Desc]) -> Span {
        if self.flushed {
            self.clear();
        }
        let start = self.descs.len() as u32;
        copy_in_chunks(&mut self.descs, descs);
        Span {
            start,
            len: descs.len() as u32,
        }
    }

    fn push_indices(&mut self, indices: &[u32]) -> Span {
        if self.flushed {
            self.clear();
        }
        let start = self.indices.len() as u32;
        self.indices.extend_from_slice(indices);
        Span {
            start,
            len: indices.len() as u32,
        }
    }

    fn push_bytes(&mut self, bytes: &[u8]) -> Span {
        if self.flushed {
            self.clear();
        }
        let start = self.bytes.len() as u32;
        self.bytes.extend_from_slice(bytes);
        Span {
            start,
            len: bytes.len() as u32,
        }
    }

    /// Load a peer's metadata blob; gives the peer.
    pub fn load_md(&mut self, blob: &[u8]) -> Ticket<PeerId> {
        let bytes = self.push_bytes(blob);
        Ticket::new(self.push(Command::LoadMd { bytes }))
    }

    /// Forget a peer's metadata: its row is freed (the handle goes stale), requests built
    /// on it fail with not-found, and those in flight drain until their backend confirms
    /// the end.
    pub fn invalidate_md(&mut self, peer: impl Into<Ref<PeerId>>) -> Ticket<()> {
        Ticket::new(self.push(Command::InvalidateMd { peer: peer.into() }))
    }

    /// Register one memory region with every backend that supports `kind`.
    ///
    /// # Safety
    ///
    /// For DRAM (and VRAM) the caller promises that `desc` names memory it owns, that
    /// stays allocated until the region is deregistered, and that no Rust reference
    /// reads or writes it while a transfer using it is in flight: backends (and peers)
    /// read and write it behind the compiler's back.
    // Reason: this only declares the caller's promise about the memory; no unsafe
    // operation happens here (backends do the raw-pointer work).
    #[allow(unsafe_code)]
    pub unsafe fn register(&mut self, kind: MemKind, desc: Desc) -> Ticket<RegionId> {
        Ticket::new(self.push(Command::Register {
            kind,
            desc,
            hint: BackendMask::ALL,
            path: None,
        }))
    }

    /// Register a region with only the backends in `hint`.
    ///
    /// # Safety
    ///
    /// As for [`CommandBuffer::register`].
    // Reason: this only declares the caller's promise about the memory; no unsafe
    // operation happens here (backends do the raw-pointer work).
    #[allow(unsafe_code)]
    pub unsafe fn register_with(
        &mut self,
        kind: MemKind,
        desc: Desc,
        hint: BackendMask,
    ) -> Ticket<RegionId> {
        Ticket::new(self.push(Command::Register {
            kind,
            desc,
            hint,
            path: None,
        }))
    }

    /// Register a FILE region by path: the backend opens the file with `mode` and closes
    /// it at deregistration. `desc.addr` is the starting offset, `desc.len` the length
    /// (0 = whole file), `desc.dev` a caller-chosen file id that descriptors use.
    pub fn register_file(&mut self, path: &Path, mode: FileMode, desc: Desc) -> Ticket<RegionId> {
        let span = self.push_bytes(path.as_os_str().as_encoded_bytes());
        Ticket::new(self.push(Command::Register {
            kind: MemKind::File,
            desc,
            hint: BackendMask::ALL,
            path: Some((span, mode)),
        }))
    }

    /// Register an OBJECT region by name: `name` is the object's key in the backend's
    /// bucket, or `s3://bucket/key` (NIXL's `metaInfo`). `desc.addr` is the starting
    /// offset inside the object, `desc.len` the length (0 = whole object), `desc.dev` a
    /// caller-chosen object id that descriptors use. (Registered with
    /// [`CommandBuffer::register`], an OBJECT region is named by its id in decimal, as
    /// NIXL names one without `metaInfo`.)
    pub fn register_object(&mut self, name: &str, desc: Desc) -> Ticket<RegionId> {
        let span = self.push_bytes(name.as_bytes());
        Ticket::new(self.push(Command::Register {
            kind: MemKind::Object,
            desc,
            hint: BackendMask::ALL,
            path: Some((span, FileMode::default())),
        }))
    }

    /// Deregister a region (in the flush's last phase, after its transfers of this flush
    /// were posted).
    pub fn deregister(&mut self, region: impl Into<Ref<RegionId>>) -> Ticket<()> {
        Ticket::new(self.push(Command::Deregister {
            region: region.into(),
        }))
    }

    /// Prepare a descriptor list of `kind` on `side` once, for use by index later.
    pub fn prep(&mut self, side: impl Into<Side>, kind: MemKind, descs: &[Desc]) -> Ticket<PrepId> {
        let side = side.into();
        let descs = PrepDescs::List(self.push_descs(descs));
        Ticket::new(self.push(Command::Prep {
            side,
            kind,
            descs,
            hint: BackendMask::ALL,
        }))
    }

    /// Prepare the list made of `runs`' descriptors, run after run, each run `count`
    /// descriptors `stride` bytes apart ([`StridedDesc`]). The prepared list is the one
    /// [`CommandBuffer::prep`] of the same descriptors gives (same entries, same
    /// indices for `make`), but only the runs are recorded: 64 layers of 1,024 blocks
    /// are 64 values here instead of 65,536 descriptors.
    pub fn prep_strided(
        &mut self,
        side: impl Into<Side>,
        kind: MemKind,
        runs: &[StridedDesc],
    ) -> Ticket<PrepId> {
        let side = side.into();
        if self.flushed {
            self.clear();
        }
        let start = self.strided.len() as u32;
        self.strided.extend_from_slice(runs);
        let descs = PrepDescs::Strided(Span {
            start,
            len: runs.len() as u32,
        });
        Ticket::new(self.push(Command::Prep {
            side,
            kind,
            descs,
            hint: BackendMask::ALL,
        }))
    }

    /// Build a request moving `local[local_idx[i]]` ↔ `remote[remote_idx[i]]`. Empty
    /// index lists mean "every descriptor, in order".
    pub fn make(
        &mut self,
        op: Op,
        local: impl Into<Ref<PrepId>>,
        local_idx: &[u32],
        remote: impl Into<Ref<PrepId>>,
        remote_idx: &[u32],
    ) -> MakeBuilder<'_> {
        let local = local.into();
        let remote = remote.into();
        let local_idx = self.push_indices(local_idx);
        let remote_idx = self.push_indices(remote_idx);
        let index = self.push(Command::Make {
            op,
            local,
            local_idx,
            remote,
            remote_idx,
            notif: None,
            hint: BackendMask::ALL,
        });
        MakeBuilder {
            buffer: self,
            index,
        }
    }

    /// Build a request in one shot from raw lists (no prepared lists kept).
    pub fn create(
        &mut self,
        op: Op,
        local_kind: MemKind,
        local: &[Desc],
        remote_side: impl Into<Side>,
        remote_kind: MemKind,
        remote: &[Desc],
    ) -> MakeBuilder<'_> {
        let remote_side = remote_side.into();
        let local = self.push_descs(local);
        let remote = self.push_descs(remote);
        let index = self.push(Command::Create {
            op,
            local_kind,
            local,
            remote_side,
            remote_kind,
            remote,
            notif: None,
            hint: BackendMask::ALL,
        });
        MakeBuilder {
            buffer: self,
            index,
        }
    }

    /// Post (or repost) a request.
    pub fn post(&mut self, xfer: impl Into<Ref<XferId>>) -> Ticket<XferStatus> {
        Ticket::new(self.push(Command::Post { xfer: xfer.into() }))
    }

    /// Ask for a request's status (read after this flush's progress phase).
    pub fn check(&mut self, xfer: impl Into<Ref<XferId>>) -> Ticket<XferStatus> {
        Ticket::new(self.push(Command::Check { xfer: xfer.into() }))
    }

    /// Release a request (in the flush's last phase).
    pub fn release(&mut self, xfer: impl Into<Ref<XferId>>) -> Ticket<()> {
        Ticket::new(self.push(Command::Release {
            what: Releasable::Xfer(xfer.into()),
        }))
    }

    /// Release a prepared list (in the flush's last phase).
    pub fn release_prep(&mut self, prep: impl Into<Ref<PrepId>>) -> Ticket<()> {
        Ticket::new(self.push(Command::Release {
            what: Releasable::Prep(prep.into()),
        }))
    }

    /// Send a standalone notification (`Side::Local` = to oneself). Empty payloads are fine.
    pub fn notify(&mut self, to: impl Into<Side>, payload: &[u8]) -> Ticket<()> {
        let to = to.into();
        let payload = self.push_bytes(payload);
        Ticket::new(self.push(Command::Notify { to, payload }))
    }

    /// Collect inbound notifications into this buffer (read them with
    /// [`CommandBuffer::notifications`] after the flush).
    pub fn drain_notifications(&mut self) -> Ticket<u32> {
        Ticket::new(self.push(Command::DrainNotifications))
    }

    /// Send our full metadata to a peer's listener, or publish it in the store.
    pub fn send_local_md(&mut self, route: MdRoute) -> Ticket<()> {
        Ticket::new(self.push(Command::Exchange(ExchangeCmd::SendLocal { route })))
    }

    /// Send or publish partial metadata (only `regions`, with connection info) under
    /// `label`.
    pub fn send_local_partial_md(
        &mut self,
        regions: &[RegionId],
        label: &str,
        route: MdRoute,
    ) -> Ticket<()> {
        if self.flushed {
            self.clear();
        }
        let start = self.regions.len() as u32;
        self.regions.extend_from_slice(regions);
        let regions = Span {
            start,
            len: regions.len() as u32,
        };
        let label = self.push_bytes(label.as_bytes());
        Ticket::new(self.push(Command::Exchange(ExchangeCmd::SendPartial {
            regions,
            label,
            route,
        })))
    }

    /// Ask for `agent`'s metadata (full, or partial under `label`); record
    /// [`CommandBuffer::check_remote_md`] in later flushes to see it arrive.
    pub fn fetch_remote_md(
        &mut self,
        agent: &str,
        label: Option<&str>,
        route: MdRoute,
    ) -> Ticket<()> {
        let agent = self.push_bytes(agent.as_bytes());
        let label = label.map(|l| self.push_bytes(l.as_bytes()));
        Ticket::new(self.push(Command::Exchange(ExchangeCmd::Fetch {
            agent,
            label,
            route,
        })))
    }

    /// Withdraw our metadata from a peer or from the store.
    pub fn invalidate_local_md(&mut self, route: MdRoute) -> Ticket<()> {
        Ticket::new(self.push(Command::Exchange(ExchangeCmd::InvalidateLocal { route })))
    }

    /// Whether `agent`'s metadata has been loaded (outcome `MdReady`; the fetch's error
    /// if it failed).
    pub fn check_remote_md(&mut self, agent: &str) -> Ticket<bool> {
        let agent = self.push_bytes(agent.as_bytes());
        Ticket::new(self.push(Command::Exchange(ExchangeCmd::Check { agent })))
    }

    /// Make the connections to a loaded peer now (NIXL's `makeConnection`); otherwise
    /// backends connect at load (UCX by default) or on first use.
    pub fn make_connection(&mut self, peer: impl Into<Ref<PeerId>>) -> Ticket<()> {
        Ticket::new(self.push(Command::Connect { peer: peer.into() }))
    }

    /// The regions recorded by a `SendPartial` command.
    pub fn exchange_regions(&self, span: Span) -> &[RegionId] {
        &self.regions[span.range()]
    }

    /// The UTF-8 text recorded at `span` (agent names, labels).
    pub fn exchange_text(&self, span: Span) -> &str {
        std::str::from_utf8(&self.bytes[span.range()]).unwrap_or("")
    }

    /// Set the outcome of command `index` (used by the agent for exchange commands,
    /// which it runs before the executor).
    pub fn set_outcome(&mut self, index: u32, outcome: Outcome) {
        if let Some(slot) = self.outcomes.get_mut(index as usize) {
            *slot = outcome;
        }
    }

    /// Outcome of the command behind `ticket`.
    pub fn outcome<H>(&self, ticket: Ticket<H>) -> &Outcome {
        &self.outcomes[ticket.index as usize]
    }

    /// Every outcome, in command order.
    pub fn outcomes(&self) -> &[Outcome] {
        &self.outcomes
    }

    /// The handle created by `ticket`'s command, or its error.
    pub fn created<H: FromCreated>(&self, ticket: Ticket<H>) -> Result<H, Error> {
        match &self.outcomes[ticket.index as usize] {
            Outcome::Created(c) => H::from_created(*c).ok_or_else(|| {
                Error::invalid(
                    ferry_storage::Subject::Command(ticket.index),
                    "command created another kind of object",
                )
            }),
            Outcome::Failed(e) => Err(e.clone()),
            _ => Err(Error::invalid(
                ferry_storage::Subject::Command(ticket.index),
                "command has not created anything (not flushed?)",
            )),
        }
    }

    /// The status reported by a post/check, or its error.
    pub fn status(&self, ticket: Ticket<XferStatus>) -> Result<XferStatus, Error> {
        match &self.outcomes[ticket.index as usize] {
            Outcome::Status(s) => Ok(*s),
            Outcome::Failed(e) => Err(e.clone()),
            _ => Err(Error::invalid(
                ferry_storage::Subject::Command(ticket.index),
                "no status (not flushed?)",
            )),
        }
    }

    /// Every failed command with its error.
    pub fn errors(&self) -> impl Iterator<Item = (u32, &Error)> {
        self.outcomes
            .iter()
            .enumerate()
            .filter_map(|(i, o)| o.error().map(|e| (i as u32, e)))
    }

    /// Notifications drained by this buffer's last flush: (sender agent, payload).
    pub fn notifications(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.notifs.iter().map(|n| {
            let from =
                std::str::from_utf8(&self.notif_bytes[n.from.range()]).unwrap_or("<non-utf8>");
            (from, &self.notif_bytes[n.payload.range()])
        })
    }

    /// Number of notifications drained by the last flush.
    pub fn notification_count(&self) -> usize {
        self.notifs.len()
    }
}

/// Handle types a [`Created`] can hold.
pub trait FromCreated: Sized {
    /// The handle, if `created` is of this type.
    fn from_created(created: Created) -> Option<Self>;
}
macro_rules! from_created {
    ($($h:ty => $v:ident),*) => {$(
        impl FromCreated for $h {
            fn from_created(c: Created) -> Option<Self> {
                match c { Created::$v(h) => Some(h), _ => None }
            }
        }
    )*};
}
from_created!(RegionId => Region, PrepId => Prep, XferId => Xfer, PeerId => Peer);

impl<H> Ticket<H> {
    /// The ticket of command `index` (for code that stores indices).
    pub fn at(index: u32) -> Self {
        Ticket::new(index)
    }
}

/// Append `from` to `to` four descriptors (96 bytes) at a time, each a fixed-size copy
/// the compiler inlines, instead of one `memcpy` of the whole list: glibc's `memcpy`
/// (2.36 on this AMD EPYC VM) moves large blocks with `rep movsb`, which runs several
/// times slower for some source/destination address pairs. `perf` of
/// `control_path/ucx/create/contiguous/1024` after other cases had run in the process:
/// 37 % of the time in that one `memcpy` of the caller's lists, and 13 ns/desc instead
/// of 7.
fn copy_in_chunks(to: &mut Vec<Desc>, from: &[Desc]) {
    to.reserve(from.len());
    let (chunks, rest) = from.as_chunks::<4>();
    for chunk in chunks {
        to.extend_from_slice(chunk);
    }
    to.extend_from_slice(rest);
}
