//! `LOOPBACK`: Ferry's built-in backend for DRAM ↔ DRAM transfers between agents in one
//! process (and within one agent). It really copies the bytes, delivers notifications
//! after the copy, and is the embedded default and the test vehicle of the engine.
//!
//! Connection info is the process id plus a process-unique backend id; loading a peer
//! resolves the peer's shared state (inbox and region table) once, so a post does no
//! lookup. A peer from another process is refused at load time.
//!
//! # Remote regions are checked at post
//!
//! The initiator copies straight into (or out of) the target agent's memory, which the
//! target may deregister at any time. Each backend instance therefore keeps a table of
//! its regions shared with the peers that loaded it: a region's token is
//! `generation << 32 | slot`, and its public metadata is that token. A post pins each
//! peer region it touches with one compare-and-swap on the region's slot (once per run of
//! ranges with the same token), which succeeds only while the slot holds the token's
//! generation; its own regions it only checks (their `deregister` cannot overlap the
//! post: both take the backend `&mut`). A request that names a region deregistered since
//! fails the post with [`Error::NotFound`] naming the region, and no byte moves. The slot
//! also holds the bounds the owner really registered, and every target range must lie
//! inside them: a peer's metadata (which may come over the network) cannot make a copy
//! reach past a registration. `deregister` bumps the generation once no copy has the
//! region pinned (a copy in progress on another thread is waited for; it is a bounded
//! `memmove`, never a wait on anything else). Cost: O(1) per range, no lock.
//!
//! # Fault injection
//!
//! Every instance has a [`Faults`] control, reachable from tests with [`faults`] by
//! agent name: fail the next N requests, hold completions for N progress calls
//! ("complete late"), or drop a peer so posts to it fail with remote-disconnect.
// Reason: the backend copies bytes between registered addresses, which is raw-pointer
// work by nature. Every block states why the pointers are valid.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};

use slotmap::SparseSecondaryMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use ferry_backend_api::{
    effective_params, Backend, BackendFactory, BackendInit, Capabilities, Completions, Endpoint,
    Error, Failure, FailureKind, MemKind, NotifSink, ParamSpec, Params, PeerId, PeerRegions, Post,
    Range, RegionSpec, Registered, RemoteAgent, Result, Subject,
};
use smallvec::SmallVec;

/// Backend type name.
pub const NAME: &str = "LOOPBACK";

const KINDS: &[MemKind] = &[MemKind::Dram];

const PARAMS: &[ParamSpec] = &[ParamSpec {
    name: "notif_queue",
    default: "65536",
    doc: "notifications an inbox holds before senders get a capacity error",
}];

/// An inbound notification. Payloads up to 64 bytes are stored inline; longer ones in a
/// buffer taken from the target's pool of drained buffers (so steady-state sending
/// allocates nothing at any length).
struct Message {
    from: Arc<str>,
    payload: Payload,
}

enum Payload {
    Inline(SmallVec<[u8; 64]>),
    Pooled(Vec<u8>),
}

/// Drained payload buffers kept for reuse (at most this many).
const PAYLOAD_POOL_LEN: usize = 1024;

/// One backend instance's state shared with every peer that loaded it: its mailbox and
/// its region table.
struct Shared {
    /// Inbound notifications. Bounded: a sender whose notification does not fit gets a
    /// typed error (see [`Loopback::deliver`]); an accepted one stays until drained.
    queue: Bounded<Message>,
    /// Buffers of drained long payloads, reused by senders.
    payload_pool: Bounded<Vec<u8>>,
    /// Set when the owning backend is dropped.
    closed: AtomicBool,
    /// Liveness of the owner's regions, read by every initiator at post.
    regions: RegionSlots,
}

/// A FIFO that holds at most `capacity` items and grows only as they come: an idle
/// instance holds none (a queue allocated at its bound up front, as `ArrayQueue` is,
/// cost every agent with a LOOPBACK backend 7 MB at the default `notif_queue`).
struct Bounded<T> {
    items: Mutex<VecDeque<T>>,
    capacity: usize,
}

impl<T> Bounded<T> {
    fn new(capacity: usize) -> Bounded<T> {
        Bounded {
            items: Mutex::new(VecDeque::new()),
            capacity,
        }
    }

    /// Append `item`, or give it back when the queue is full.
    fn push(&self, item: T) -> std::result::Result<(), T> {
        let mut items = self.items.lock().unwrap_or_else(|e| e.into_inner());
        if items.len() >= self.capacity {
            return Err(item);
        }
        items.push_back(item);
        Ok(())
    }

    fn pop(&self) -> Option<T> {
        self.items
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
    }

    fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Regions one backend can hold at once.
pub const REGIONS_MAX: usize = SLOTS_PER_CHUNK * CHUNKS;
const SLOTS_PER_CHUNK: usize = 4096;
const CHUNKS: usize = 256;

/// The region table: per slot, `state` = `generation << 32 | pins` plus the region's
/// address and length. An odd generation is a live region, an even one a free slot.
/// Slots are allocated in chunks of 4,096 as registrations need them (at `register`,
/// never at post), and a chunk once made is never freed or moved, so a reader needs no
/// lock. The bounds are written before the generation that publishes them and do not
/// change while the region is pinned.
struct RegionSlots {
    chunks: Box<[OnceLock<Box<[RegionSlot]>>]>,
}

#[derive(Default)]
struct RegionSlot {
    state: AtomicU64,
    addr: AtomicU64,
    len: AtomicU64,
}

/// A live region's bounds, read while it is pinned.
#[derive(Clone, Copy)]
struct Bounds {
    addr: u64,
    len: u64,
}

impl Bounds {
    #[inline]
    fn covers(self, addr: u64, len: u64) -> bool {
        // Offset into the region (wraps to a huge value below it), then room left: no
        // overflow anywhere.
        let offset = addr.wrapping_sub(self.addr);
        offset <= self.len && len <= self.len - offset
    }
}

fn slot_of(token: u64) -> usize {
    (token & u64::from(u32::MAX)) as usize
}

fn generation_of(token: u64) -> u32 {
    (token >> 32) as u32
}

impl RegionSlots {
    fn new() -> RegionSlots {
        RegionSlots {
            chunks: (0..CHUNKS).map(|_| OnceLock::new()).collect(),
        }
    }

    fn slot(&self, index: usize) -> Option<&RegionSlot> {
        self.chunks
            .get(index / SLOTS_PER_CHUNK)?
            .get()?
            .get(index % SLOTS_PER_CHUNK)
    }

    /// Make the free slot `index` live for the region `addr`, `len`; returns its token.
    fn activate(&self, index: usize, addr: u64, len: u64) -> u64 {
        let chunk = self.chunks[index / SLOTS_PER_CHUNK].get_or_init(|| {
            (0..SLOTS_PER_CHUNK)
                .map(|_| RegionSlot::default())
                .collect()
        });
        let slot = &chunk[index % SLOTS_PER_CHUNK];
        let generation = generation_of(slot.state.load(Ordering::Acquire)).wrapping_add(1);
        debug_assert!(generation & 1 == 1, "activating a live slot");
        // Only the owner writes a free slot (readers fail on its even generation); the
        // bounds are published by the release store of the generation.
        slot.addr.store(addr, Ordering::Relaxed);
        slot.len.store(len, Ordering::Relaxed);
        slot.state
            .store(u64::from(generation) << 32, Ordering::Release);
        (u64::from(generation) << 32) | index as u64
    }

    /// Whether `token` names a live region.
    fn is_live(&self, token: u64) -> bool {
        let generation = generation_of(token);
        generation & 1 == 1
            && self
                .slot(slot_of(token))
                .is_some_and(|slot| generation_of(slot.state.load(Ordering::Acquire)) == generation)
    }

    /// The bounds of the live region `token`, without pinning it: for the owner's own
    /// posts, which cannot overlap its `deregister` (both take the backend `&mut`).
    fn bounds(&self, token: u64) -> Option<Bounds> {
        let generation = generation_of(token);
        let slot = self.slot(slot_of(token))?;
        (generation & 1 == 1 && generation_of(slot.state.load(Ordering::Acquire)) == generation)
            .then(|| Bounds {
                addr: slot.addr.load(Ordering::Relaxed),
                len: slot.len.load(Ordering::Relaxed),
            })
    }

    /// Pin the region named by `token` for a copy; its bounds, or `None` if it is not
    /// live.
    fn pin(&self, token: u64) -> Option<Bounds> {
        let generation = generation_of(token);
        if generation & 1 == 0 {
            return None;
        }
        let slot = self.slot(slot_of(token))?;
        let mut current = slot.state.load(Ordering::Acquire);
        loop {
            if generation_of(current) != generation || current as u32 == u32::MAX {
                return None;
            }
            match slot.state.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Some(Bounds {
                        addr: slot.addr.load(Ordering::Relaxed),
                        len: slot.len.load(Ordering::Relaxed),
                    })
                }
                Err(now) => current = now,
            }
        }
    }

    /// Undo one [`RegionSlots::pin`] of `token`.
    fn unpin(&self, token: u64) {
        if let Some(slot) = self.slot(slot_of(token)) {
            let before = slot.state.fetch_sub(1, Ordering::Release);
            debug_assert!(before as u32 != 0, "unpin without pin");
        }
    }

    /// Retire the live region `token` (its slot becomes free) once no copy pins it.
    /// False if `token` is not live.
    fn retire(&self, token: u64) -> bool {
        let generation = generation_of(token);
        let Some(slot) = self.slot(slot_of(token)) else {
            return false;
        };
        let mut spins = 0u32;
        loop {
            let current = slot.state.load(Ordering::Acquire);
            if generation & 1 == 0 || generation_of(current) != generation {
                return false;
            }
            if current as u32 == 0 {
                let free = u64::from(generation.wrapping_add(1)) << 32;
                if slot
                    .state
                    .compare_exchange(current, free, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return true;
                }
                continue;
            }
            // A peer's copy out of or into this region runs on another thread right now.
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Fault-injection controls of one backend instance (all default off).
#[derive(Debug, Default)]
pub struct Faults {
    fail_next: AtomicU32,
    late_progress_calls: AtomicU32,
    /// Whether any peer is dropped: lets a post skip the lock in the common case.
    any_dropped: AtomicBool,
    dropped: Mutex<Vec<String>>,
    panic_next_post: AtomicBool,
    refuse_cancel: AtomicBool,
    withdraw_pending: AtomicU32,
}

impl Faults {
    /// Fail the next `count` posted requests with an I/O error (errno `EIO`).
    pub fn fail_next(&self, count: u32) {
        self.fail_next.store(count, Ordering::SeqCst);
    }
    /// Hold every completion for `calls` progress calls before reporting it.
    pub fn complete_late(&self, calls: u32) {
        self.late_progress_calls.store(calls, Ordering::SeqCst);
    }
    /// Act as if peer agent `name` went away: posts and notifications to it fail with
    /// remote-disconnect until [`Faults::restore_peer`].
    pub fn drop_peer(&self, name: &str) {
        let mut dropped = self.dropped.lock().unwrap_or_else(|e| e.into_inner());
        if !dropped.iter().any(|n| n == name) {
            dropped.push(name.to_string());
        }
        self.any_dropped.store(true, Ordering::SeqCst);
    }
    /// Undo [`Faults::drop_peer`].
    pub fn restore_peer(&self, name: &str) {
        let mut dropped = self.dropped.lock().unwrap_or_else(|e| e.into_inner());
        dropped.retain(|n| n != name);
        self.any_dropped
            .store(!dropped.is_empty(), Ordering::SeqCst);
    }
    /// Panic inside the next `post` (to test what a panic in a flush leaves behind).
    pub fn panic_next_post(&self) {
        self.panic_next_post.store(true, Ordering::SeqCst);
    }
    /// Make `cancel` answer "cannot cancel now" (`Ok(false)`), as a transport whose
    /// request is already on the wire does: the request then completes on its own.
    pub fn refuse_cancel(&self, refuse: bool) {
        self.refuse_cancel.store(refuse, Ordering::SeqCst);
    }
    /// Answer the next `count` withdrawals "a peer may still reach it" (`Ok(false)`), as
    /// a backend whose peer is mid-copy does: deregistrations then go pending.
    pub fn withdraw_pending(&self, count: u32) {
        self.withdraw_pending.store(count, Ordering::SeqCst);
    }
    /// Clear every fault.
    pub fn clear(&self) {
        self.withdraw_pending.store(0, Ordering::SeqCst);
        self.panic_next_post.store(false, Ordering::SeqCst);
        self.refuse_cancel.store(false, Ordering::SeqCst);
        self.fail_next.store(0, Ordering::SeqCst);
        self.late_progress_calls.store(0, Ordering::SeqCst);
        self.dropped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.any_dropped.store(false, Ordering::SeqCst);
    }
    fn take_failure(&self) -> bool {
        self.fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
    fn is_dropped(&self, name: &str) -> bool {
        if !self.any_dropped.load(Ordering::Relaxed) {
            return false;
        }
        let dropped = self.dropped.lock().unwrap_or_else(|e| e.into_inner());
        dropped.iter().any(|n| n == name)
    }
}

struct Directory {
    inboxes: HashMap<u64, Weak<Shared>>,
    faults: HashMap<String, Weak<Faults>>,
}

fn directory() -> &'static Mutex<Directory> {
    static DIRECTORY: OnceLock<Mutex<Directory>> = OnceLock::new();
    DIRECTORY.get_or_init(|| {
        Mutex::new(Directory {
            inboxes: HashMap::new(),
            faults: HashMap::new(),
        })
    })
}

/// The fault controls of the loopback backend of agent `agent`, if it has one.
pub fn faults(agent: &str) -> Option<Arc<Faults>> {
    let dir = directory().lock().unwrap_or_else(|e| e.into_inner());
    dir.faults.get(agent).and_then(Weak::upgrade)
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Factory of [`Loopback`] backends.
#[derive(Debug, Default, Clone, Copy)]
pub struct LoopbackFactory;

impl BackendFactory for LoopbackFactory {
    fn name(&self) -> &'static str {
        NAME
    }
    fn params(&self) -> &'static [ParamSpec] {
        PARAMS
    }
    fn mem_kinds(&self) -> &'static [MemKind] {
        KINDS
    }
    fn create(&self, init: &BackendInit<'_>) -> Result<Box<dyn Backend>> {
        Ok(Box::new(Loopback::new(init)?))
    }
}

/// A peer as seen by this backend.
struct RemotePeer {
    name: String,
    /// The last (metadata token, region-table token) resolved through `regions`: a
    /// request's ranges usually name one region, so most posts skip the lookup.
    resolved: std::cell::Cell<(u64, u64)>,
    shared: Weak<Shared>,
    regions: Arc<dyn PeerRegions>,
}

/// A completion waiting for its "late" delay to pass.
struct Held {
    tag: u64,
    result: std::result::Result<(), Failure>,
    calls_left: u32,
}

/// The in-process DRAM backend.
pub struct Loopback {
    params: Params,
    id: u64,
    agent: Arc<str>,
    shared: Arc<Shared>,
    /// Region slots free for reuse (their generation is even).
    free_slots: Vec<u32>,
    /// Slots used so far (the next never-used slot).
    slots_used: usize,
    /// Pins of the post in progress (capacity reused: no allocation in steady state).
    pinned: Vec<(Table, u64)>,
    faults: Arc<Faults>,
    /// Loaded peers, by handle: a sparse secondary map hashes its keys, with Fx here
    /// (they are the engine's own peer handles; SipHash cost a post tens of ns).
    peers: SparseSecondaryMap<PeerId, RemotePeer, rustc_hash::FxBuildHasher>,
    held: VecDeque<Held>,
}

impl Loopback {
    /// Make an instance for agent `init.agent_name`.
    pub fn new(init: &BackendInit<'_>) -> Result<Loopback> {
        let params = effective_params(NAME, PARAMS, init.params)?;
        let capacity: usize = params["notif_queue"]
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                Error::invalid(
                    Subject::Named("notif_queue".into()),
                    "must be a positive integer",
                )
            })?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(Shared {
            queue: Bounded::new(capacity),
            payload_pool: Bounded::new(PAYLOAD_POOL_LEN.min(capacity)),
            closed: AtomicBool::new(false),
            regions: RegionSlots::new(),
        });
        let faults = Arc::new(Faults::default());
        {
            let mut dir = directory().lock().unwrap_or_else(|e| e.into_inner());
            dir.inboxes.retain(|_, w| w.strong_count() > 0);
            dir.faults.retain(|_, w| w.strong_count() > 0);
            dir.inboxes.insert(id, Arc::downgrade(&shared));
            dir.faults
                .insert(init.agent_name.to_string(), Arc::downgrade(&faults));
        }
        Ok(Loopback {
            params,
            id,
            agent: Arc::from(init.agent_name),
            shared,
            free_slots: Vec::new(),
            slots_used: 0,
            pinned: Vec::with_capacity(64),
            faults,
            peers: SparseSecondaryMap::with_hasher(rustc_hash::FxBuildHasher),
            held: VecDeque::with_capacity(64),
        })
    }

    /// This instance's fault controls.
    pub fn faults(&self) -> Arc<Faults> {
        self.faults.clone()
    }

    /// The shared state of the target of `endpoint` (ours for `Local`).
    fn target(&self, endpoint: Endpoint) -> std::result::Result<Arc<Shared>, Error> {
        self.target_and_peer(endpoint).map(|(shared, _)| shared)
    }

    /// The target's shared state, and for a peer its entry (one lookup).
    fn target_and_peer(
        &self,
        endpoint: Endpoint,
    ) -> std::result::Result<(Arc<Shared>, Option<&RemotePeer>), Error> {
        match endpoint {
            Endpoint::Local => Ok((self.shared.clone(), None)),
            Endpoint::Peer(peer) => {
                let remote = self
                    .peers
                    .get(peer)
                    .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
                if self.faults.is_dropped(&remote.name) {
                    return Err(Error::RemoteDisconnect {
                        subject: Subject::PeerName(remote.name.clone()),
                    });
                }
                match remote.shared.upgrade() {
                    Some(shared) if !shared.closed.load(Ordering::Acquire) => {
                        Ok((shared, Some(remote)))
                    }
                    _ => Err(Error::RemoteDisconnect {
                        subject: Subject::PeerName(remote.name.clone()),
                    }),
                }
            }
        }
    }

    /// Push a notification into `inbox`. A full inbox refuses it with a capacity error
    /// to the sender (never a silent drop); once pushed it stays until drained.
    fn deliver(&self, inbox: &Shared, payload: &[u8]) -> Result<()> {
        let payload = if payload.len() <= 64 {
            Payload::Inline(SmallVec::from_slice(payload))
        } else {
            let mut buffer = inbox.payload_pool.pop().unwrap_or_default();
            buffer.clear();
            buffer.extend_from_slice(payload);
            Payload::Pooled(buffer)
        };
        let message = Message {
            from: self.agent.clone(),
            payload,
        };
        inbox.queue.push(message).map_err(|refused| {
            if let Payload::Pooled(buffer) = refused.payload {
                let _ = inbox.payload_pool.push(buffer);
            }
            Error::Capacity {
                what: "loopback notification inbox",
                limit: inbox.queue.capacity(),
            }
        })
    }

    fn finish(
        &mut self,
        tag: u64,
        result: std::result::Result<(), Failure>,
        done: &mut Completions,
    ) {
        let late = self.faults.late_progress_calls.load(Ordering::Relaxed);
        if late == 0 {
            done.push(ferry_backend_api::Completion { tag, result });
        } else {
            self.held.push_back(Held {
                tag,
                result,
                calls_left: late,
            });
        }
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        let mut dir = directory().lock().unwrap_or_else(|e| e.into_inner());
        dir.inboxes.remove(&self.id);
    }
}

/// Copy one range.
///
/// # Safety
///
/// Both sides of `range` lie inside live regions registered in this process (pinned by
/// the caller for the duration of the copy), whose registrants promised (`register` is
/// unsafe) that the bytes stay valid while registered and that no Rust reference aliases
/// them during a transfer.
unsafe fn copy_range(op: ferry_backend_api::Op, range: &Range) {
    let (src, dst) = match op {
        ferry_backend_api::Op::Write => (range.local_addr, range.remote_addr),
        ferry_backend_api::Op::Read => (range.remote_addr, range.local_addr),
    };
    // SAFETY: per this function's contract both ranges are valid, registered and pinned
    // (so neither side can be deregistered during the copy); both agents live in this
    // process (checked at `load_remote`). `copy_bytes` tolerates overlap.
    unsafe { ferry_backend_api::copy_bytes(src as *const u8, dst as *mut u8, range.len as usize) };
}

/// The error of a post that names a region deregistered since, or a range outside it.
fn refused_range(owner: &str, side: &str, addr: u64, len: u64, why: &str) -> Error {
    Error::NotFound {
        subject: Subject::Named(
            format!("{side} region of agent '{owner}' holding {addr:#x} (len {len}): {why}").into(),
        ),
    }
}

/// The target agent's token of a peer region, from its public metadata.
fn peer_token(regions: &dyn PeerRegions, token: u64) -> Option<u64> {
    let md = regions.public_md(token)?;
    Some(u64::from_le_bytes(md.try_into().ok()?))
}

/// Which side of a batch's ranges to pin, and how its tokens name regions.
#[derive(Clone, Copy)]
enum Side<'a> {
    /// Local ranges, our own table.
    Local,
    /// Remote ranges of a local transfer: tokens of our own table.
    OwnTarget,
    /// Remote ranges of a peer transfer: tokens through the peer's metadata.
    Peer(&'a RemotePeer),
}

impl Side<'_> {
    /// The region-table token `key` names (`None` where the peer's metadata does not
    /// know the region).
    fn resolve(self, key: u64) -> Option<u64> {
        match self {
            Side::Local | Side::OwnTarget => Some(key),
            Side::Peer(peer) => {
                let (cached_key, token) = peer.resolved.get();
                if cached_key == key && token != 0 {
                    return Some(token);
                }
                let token = peer_token(&*peer.regions, key)?;
                peer.resolved.set((key, token));
                Some(token)
            }
        }
    }
}

/// Which table a pin was taken in.
#[derive(Clone, Copy)]
enum Table {
    /// The initiator's own (local ranges).
    Own,
    /// The target's (remote ranges; the own table again for a local transfer).
    Target,
}

/// Pin every region `batch` names on both sides, once per run of ranges with the same
/// token (merged ranges of one region share it, so this is usually once per request
/// side), resolving a peer's token only when it changes, and check that every remote
/// range lies inside the bounds its region really has (a peer's metadata cannot widen
/// them; a local range is checked when its run starts). Pins
/// taken are recorded in `pinned`; on a region that is not live or a range outside it,
/// the offending range, which side, and the reason are returned (the caller releases
/// what `pinned` holds). One pass, O(1) per range.
fn pin_batch<'a>(
    own: &RegionSlots,
    target: &RegionSlots,
    remote_side: Side<'_>,
    batch: &'a [Post<'a>],
    pinned: &mut Vec<(Table, u64)>,
) -> std::result::Result<(), (&'a Range, Side<'static>, &'static str)> {
    // The current run on each side: its token (and the remote region's bounds).
    let mut local: Option<u64> = None;
    // The current target run's bounds (set when the run starts).
    let mut remote_key: Option<u64> = None;
    let mut remote_bounds = Bounds { addr: 0, len: 0 };
    for post in batch {
        for range in post.ranges {
            // The local side's bounds are the caller's promise (`post` is unsafe) and the
            // executor's section index keeps it; checked once per run, when pinned.
            if local != Some(range.local_token) {
                let key = range.local_token;
                let bounds = pin_run(own, Table::Own, Side::Local, key, pinned).ok_or((
                    range,
                    Side::Local,
                    STALE,
                ))?;
                local = Some(key);
                if !bounds.covers(range.local_addr, range.len) {
                    return Err((range, Side::Local, OUTSIDE));
                }
            }
            if remote_key != Some(range.remote_token) {
                let key = range.remote_token;
                remote_bounds = pin_run(target, Table::Target, remote_side, key, pinned)
                    .ok_or((range, Side::OwnTarget, STALE))?;
                remote_key = Some(key);
            }
            if !remote_bounds.covers(range.remote_addr, range.len) {
                return Err((range, Side::OwnTarget, OUTSIDE));
            }
        }
    }
    Ok(())
}

/// Start a run: resolve `key` on `side` and check its region in `table`. A peer's region
/// is pinned (its owner may deregister it from another thread; the pin is recorded);
/// this backend's own regions need no pin, since their `deregister` cannot overlap this
/// post.
#[inline(never)]
fn pin_run(
    table: &RegionSlots,
    which: Table,
    side: Side<'_>,
    key: u64,
    pinned: &mut Vec<(Table, u64)>,
) -> Option<Bounds> {
    let token = side.resolve(key)?;
    if !matches!(side, Side::Peer(_)) {
        return table.bounds(token);
    }
    let bounds = table.pin(token)?;
    pinned.push((which, token));
    Some(bounds)
}

/// Release the pins [`pin_batch`] recorded.
fn unpin_all(own: &RegionSlots, target: &RegionSlots, pinned: &[(Table, u64)]) {
    for &(which, token) in pinned {
        match which {
            Table::Own => own.unpin(token),
            Table::Target => target.unpin(token),
        }
    }
}

/// Why a post was refused: the region is gone.
const STALE: &str = "deregistered since the request was built (stale region)";
/// Why a post was refused: the range is not inside the region.
const OUTSIDE: &str = "the range lies outside the region registered there";

impl Backend for Loopback {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            remote: true,
            local: true,
            notifications: true,
            mem_kinds: KINDS,
        }
    }

    fn params(&self) -> &Params {
        &self.params
    }

    fn describe(&self) -> Option<String> {
        Some(format!(
            "in-process memmove, instance {} (peers in this process only)",
            self.id
        ))
    }

    unsafe fn register(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        if region.kind != MemKind::Dram {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!("memory kind {}", region.kind).into(),
            });
        }
        if region.desc.addr == 0 || region.desc.end().is_none_or(|end| end > isize::MAX as u64) {
            return Err(Error::invalid(
                Subject::Descriptor {
                    index: 0,
                    addr: region.desc.addr,
                    len: region.desc.len,
                    dev: region.desc.dev,
                },
                "not a valid host address range",
            ));
        }
        let index = match self.free_slots.pop() {
            Some(index) => index as usize,
            None if self.slots_used < REGIONS_MAX => {
                self.slots_used += 1;
                self.slots_used - 1
            }
            None => {
                return Err(Error::Capacity {
                    what: "loopback regions",
                    limit: REGIONS_MAX,
                })
            }
        };
        let token = self
            .shared
            .regions
            .activate(index, region.desc.addr, region.desc.len);
        Ok(Registered {
            token,
            // Peers check the region's liveness through this token at post.
            public_md: token.to_le_bytes().to_vec(),
        })
    }

    fn withdraw(&mut self, kind: MemKind, token: u64) -> Result<bool> {
        if kind != MemKind::Dram || !self.shared.regions.is_live(token) {
            return Err(Error::not_found(Subject::Named(
                format!("loopback {kind} region token {token:#x}").into(),
            )));
        }
        // Peers check the target's registrations at every post, so a region is
        // unreachable as soon as it is deregistered; only the fault says otherwise.
        Ok(self
            .faults
            .withdraw_pending
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_err())
    }

    unsafe fn deregister(&mut self, kind: MemKind, token: u64) -> Result<()> {
        if kind != MemKind::Dram || !self.shared.regions.is_live(token) {
            return Err(Error::not_found(Subject::Named(
                format!("loopback {kind} region token {token:#x}").into(),
            )));
        }
        // Waits only for a peer's copy that has the region pinned right now.
        let retired = self.shared.regions.retire(token);
        debug_assert!(retired, "only the owner retires its regions");
        self.free_slots.push(slot_of(token) as u32);
        Ok(())
    }

    fn conn_info(&self) -> Result<Vec<u8>> {
        let mut info = Vec::with_capacity(12);
        info.extend_from_slice(&std::process::id().to_le_bytes());
        info.extend_from_slice(&self.id.to_le_bytes());
        Ok(info)
    }

    fn load_remote(&mut self, peer: PeerId, remote: RemoteAgent<'_>) -> Result<()> {
        if remote.conn_info.is_empty() {
            // Partial metadata without connection info: keep what we have.
            return if self.peers.contains_key(peer) {
                Ok(())
            } else {
                Err(Error::not_found(Subject::PeerName(format!(
                    "{} (no loopback connection info loaded yet)",
                    remote.name
                ))))
            };
        }
        let bytes: [u8; 12] = remote.conn_info.try_into().map_err(|_| {
            Error::invalid(
                Subject::PeerName(remote.name.to_string()),
                "loopback connection info must be 12 bytes",
            )
        })?;
        let pid = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
        let id = u64::from_le_bytes(bytes[4..].try_into().expect("8 bytes"));
        if pid != std::process::id() {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!(
                    "peer '{}' lives in process {pid}; loopback only reaches agents of this process",
                    remote.name
                )
                .into(),
            });
        }
        let shared = {
            let dir = directory().lock().unwrap_or_else(|e| e.into_inner());
            dir.inboxes.get(&id).cloned()
        }
        .filter(|w| w.strong_count() > 0)
        .ok_or_else(|| Error::RemoteDisconnect {
            subject: Subject::PeerName(remote.name.to_string()),
        })?;
        // Room to pin one peer region per range of a request as large as the agent
        // readied its request path for, so the first post's pin list does not grow.
        self.pinned
            .reserve(remote.ready_ranges.saturating_sub(self.pinned.len()));
        self.peers.insert(
            peer,
            RemotePeer {
                name: remote.name.to_string(),
                shared,
                regions: remote.regions,
                resolved: std::cell::Cell::new((0, 0)),
            },
        );
        Ok(())
    }

    fn unload_remote(&mut self, peer: PeerId) {
        self.peers.remove(peer);
    }

    fn connect(&mut self, peer: PeerId) -> Result<()> {
        self.target(Endpoint::Peer(peer)).map(|_| ())
    }

    unsafe fn post(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()> {
        let _span = ferry_backend_api::trace_span!("ferry-loopback::post");
        if self.faults.panic_next_post.swap(false, Ordering::SeqCst) {
            panic!("loopback fault injection: panic inside post");
        }
        // The reused pin list is taken out of `self` while the peer entry is borrowed.
        let mut pinned = std::mem::take(&mut self.pinned);
        pinned.clear();
        let (target, remote) = match self.target_and_peer(endpoint) {
            Ok(found) => found,
            Err(e) => {
                self.pinned = pinned;
                return Err(e);
            }
        };
        let remote_side = remote.map_or(Side::OwnTarget, Side::Peer);
        // Pin every region the batch touches, on both sides, before moving any byte: a
        // region deregistered since the request was built (or a range outside its
        // region) fails the whole post.
        let checked = pin_batch(
            &self.shared.regions,
            &target.regions,
            remote_side,
            batch,
            &mut pinned,
        );
        if let Err((range, side, why)) = checked {
            unpin_all(&self.shared.regions, &target.regions, &pinned);
            let error = match side {
                Side::Local => {
                    refused_range(&self.agent, "local", range.local_addr, range.len, why)
                }
                _ => {
                    let owner = remote.map_or(&*self.agent, |r| r.name.as_str());
                    refused_range(owner, "target", range.remote_addr, range.len, why)
                }
            };
            self.pinned = pinned;
            return Err(error);
        }
        for post in batch {
            if self.faults.take_failure() {
                let failure = Failure {
                    kind: FailureKind::Backend,
                    errno: 5, // EIO
                    range: Some(0),
                };
                self.finish(post.tag, Err(failure), done);
                continue;
            }
            for range in post.ranges {
                // SAFETY: the caller promised (`post` is unsafe) that the local ranges
                // (and a local transfer's remote ranges) lie inside registered regions
                // that stay valid until completion; a peer's ranges come from its
                // published metadata and lie inside its regions. Every region on both
                // sides is pinned above, so no side can be deregistered during the copy.
                unsafe { copy_range(post.op, range) };
            }
            let mut result = Ok(());
            if let Some(payload) = post.notif {
                if self.deliver(&target, payload).is_err() {
                    result = Err(Failure {
                        kind: FailureKind::Backend,
                        errno: 105, // ENOBUFS
                        range: None,
                    });
                }
            }
            self.finish(post.tag, result, done);
        }
        unpin_all(&self.shared.regions, &target.regions, &pinned);
        self.pinned = pinned;
        Ok(())
    }

    fn progress(&mut self, done: &mut Completions) {
        let _span = ferry_backend_api::trace_span!("ferry-loopback::progress");
        for _ in 0..self.held.len() {
            let Some(mut held) = self.held.pop_front() else {
                break;
            };
            held.calls_left -= 1;
            if held.calls_left == 0 {
                done.push(ferry_backend_api::Completion {
                    tag: held.tag,
                    result: held.result,
                });
            } else {
                self.held.push_back(held);
            }
        }
    }

    fn cancel(&mut self, tag: u64) -> Result<bool> {
        if self.faults.refuse_cancel.load(Ordering::SeqCst) {
            return Ok(false);
        }
        let before = self.held.len();
        self.held.retain(|h| h.tag != tag);
        Ok(self.held.len() != before)
    }

    fn notify(&mut self, endpoint: Endpoint, payload: &[u8]) -> Result<()> {
        let target = self.target(endpoint)?;
        self.deliver(&target, payload)
    }

    fn drain_notifications(&mut self, sink: &mut dyn NotifSink) -> usize {
        let mut count = 0;
        while let Some(message) = self.shared.queue.pop() {
            match message.payload {
                Payload::Inline(bytes) => sink.deliver(&message.from, &bytes),
                Payload::Pooled(buffer) => {
                    sink.deliver(&message.from, &buffer);
                    // A full pool lets the buffer go (bounded memory).
                    let _ = self.shared.payload_pool.push(buffer);
                }
            }
            count += 1;
        }
        count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `copy_range` copies local → remote for a WRITE and remote → local for a READ,
    /// inline sizes and `memmove` alike (the copy itself, with every overlap, is
    /// `ferry_backend_api::copy_bytes`'s test).
    #[test]
    fn copy_range_copies_in_the_direction_of_the_op() {
        let pattern: Vec<u8> = (0..256u32).map(|i| (i * 37 % 251) as u8).collect();
        for len in [1usize, 16, 64, 100] {
            for op in [ferry_backend_api::Op::Write, ferry_backend_api::Op::Read] {
                let mut got = pattern.clone();
                let base = got.as_mut_ptr() as u64;
                let (local_addr, remote_addr) = (base, base + 128);
                let range = Range {
                    local_addr,
                    remote_addr,
                    len: len as u64,
                    ..Range::default()
                };
                // SAFETY: both sides lie inside `got` (128 + 100 < 256), which nothing
                // else references during the call.
                unsafe { copy_range(op, &range) };
                let mut want = pattern.clone();
                match op {
                    ferry_backend_api::Op::Write => want.copy_within(0..len, 128),
                    ferry_backend_api::Op::Read => want.copy_within(128..128 + len, 0),
                }
                assert_eq!(got, want, "len {len}, {op:?}");
            }
        }
    }
}
