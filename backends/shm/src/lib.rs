//! `SHM`: Ferry's same-host backend. Between agents of one host a transfer is a copy,
//! not a network operation:
//!
//! - into or out of **shareable memory** ([`SharedMemory`], a sealed memfd the peer
//!   allocated through Ferry), the initiator maps the peer's segment once (cached per
//!   peer, unmapped at `unload_remote`) and each merged range is one `memmove`;
//! - into or out of **ordinary memory** of the peer, ranges go in batches of up to
//!   1,024 through one `process_vm_writev`/`process_vm_readv` each (cross-memory
//!   attach, "CMA"), where the kernel allows it (ptrace rules; probed per peer at load);
//!   where it does not, [`Backend::reaches`] says so for those regions, so the engine
//!   picks another common backend (UCX) for lists that name them.
//!
//! Notifications go after the data through a bounded ring in the target's inbox
//! segment (one lane per sending peer; see [`ring`]): a send is a few stores and one
//! release store, no system call; the target drains its lanes in its progress phase.
//!
//! A peer on another host (its host identity — boot id, host name, pid namespace —
//! differs from ours) is refused at `load_remote` with `NotSupported`, so it never
//! counts as sharing SHM and the engine uses another common backend for it. A peer
//! whose process is gone (pidfd readable) or whose backend closed its inbox fails
//! posts with remote-disconnect; its mappings stay valid until unload, so nothing of
//! ours faults.
//!
//! Every post completes inside `post` (copies are synchronous): there is never work in
//! flight at `progress`, `cancel` or `unload_remote`.
// Reason: the backend maps peers' segments and copies between raw addresses; the
// kernel calls (memfd, mmap, process_vm_*, pidfd) are FFI. Every block states why its
// pointers are valid.
#![allow(unsafe_code)]

pub mod host;
pub mod ring;
mod segment;
pub mod wire;

use std::cell::Cell;
// Looked up per range a post carries (a region token each): Fx hashes a u64 in a multiply.
use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_backend_api::{
    effective_params, Backend, BackendFactory, BackendInit, Capabilities, Completions, Endpoint,
    Error, Failure, FailureKind, MemKind, NotifSink, Op, ParamSpec, Params, PeerId, PeerRegions,
    Post, Range, RegionSpec, Registered, RemoteAgent, Result, Subject,
};
use slotmap::SparseSecondaryMap;

pub use segment::{HugePages, SharedMemory, ShmOptions, HUGE_PAGE_BYTES};

use host::Liveness;
use ring::{Inbox, Lane, Withdrawn, WITHDRAWN_MAX};
use segment::PeerMapping;
use wire::{fnv1a, ConnInfo, RegionMd};

/// Backend type name.
pub const NAME: &str = "SHM";

const KINDS: &[MemKind] = &[MemKind::Dram];

/// How long a peer's "alive" answer (a pidfd poll) is reused before asking again. A
/// peer that died less than this ago may still see posts into its mapped segment
/// succeed (the bytes land in pages only we still map); CMA to it fails at once.
pub const LIVENESS_TTL: Duration = Duration::from_micros(50);

/// Most ranges one `process_vm_readv`/`writev` takes (the kernel's `IOV_MAX`).
pub const CMA_IOVECS_MAX: usize = 1024;

const PARAMS: &[ParamSpec] = &[
    ParamSpec {
        name: "notif_lanes",
        default: "64",
        doc: "sending peers the notification inbox has room for (1..=64)",
    },
    ParamSpec {
        name: "notif_lane_bytes",
        default: "65536",
        doc: "bytes of each peer's notification ring (a multiple of 8, ≥ 256); a sender \
              whose notification does not fit gets a capacity error",
    },
    ParamSpec {
        name: "cma",
        default: "auto",
        doc: "process_vm_readv/writev to peers' ordinary memory: auto (probe each peer) \
              or off (only shareable memory is reached)",
    },
    ParamSpec {
        name: "host_identity",
        default: "",
        doc: "host identity to publish and compare; empty: boot id, host name and pid \
              namespace (override only to split one host into separate domains)",
    },
];

/// Factory of [`Shm`] backends.
#[derive(Debug, Default, Clone, Copy)]
pub struct ShmFactory;

impl BackendFactory for ShmFactory {
    fn name(&self) -> &'static str {
        NAME
    }
    fn params(&self) -> &'static [ParamSpec] {
        PARAMS
    }
    fn mem_kinds(&self) -> &'static [MemKind] {
        KINDS
    }
    fn available(&self) -> std::result::Result<(), String> {
        if std::path::Path::new("/proc/self/fd").is_dir() {
            Ok(())
        } else {
            Err("/proc is not mounted (peers reach segments through /proc/<pid>/fd)".into())
        }
    }
    fn create(&self, init: &BackendInit<'_>) -> Result<Box<dyn Backend>> {
        Ok(Box::new(Shm::new(init)?))
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One of our registered regions.
#[derive(Clone, Copy, Debug, Default)]
struct LocalSlot {
    /// Odd: live; even: free.
    generation: u32,
    addr: u64,
    len: u64,
}

/// Where a peer region's bytes are reached.
#[derive(Clone, Copy, Debug)]
enum Target {
    /// Through our mapping of its segment.
    Mapped(Segment),
    /// Through process_vm_readv/writev.
    Cma,
}

/// A peer's segment as we map it: `here` is its first byte in our address space,
/// `base`/`len` the segment in the owner's.
#[derive(Clone, Copy, Debug)]
struct Segment {
    here: usize,
    base: u64,
    len: u64,
}

impl Segment {
    /// Our address of the owner's `addr..addr + len`, if inside the segment.
    #[inline]
    fn translate(self, addr: u64, len: u64) -> Option<usize> {
        let offset = addr.wrapping_sub(self.base);
        (offset <= self.len && len <= self.len - offset).then(|| self.here + offset as usize)
    }
}

/// Copy the leading ranges of `ranges` that name `token` (a region of `segment`),
/// `WRITE` into the segment or else out of it, and return how many; or the position of
/// the first of them that does not lie inside the segment (nothing copied from there
/// on). The loop of a many-small-ranges request: the direction, the target and the
/// token's resolution are fixed, so each range costs its bounds check and its copy.
///
/// # Safety
///
/// Every range's local side lies in memory registered with this backend, valid for the
/// call (the contract of `Backend::post`); `segment.here` is our mapping of
/// `segment.len` bytes, valid for the call.
#[inline(always)]
unsafe fn copy_mapped<const WRITE: bool>(
    ranges: &[Range],
    token: u64,
    segment: Segment,
) -> std::result::Result<usize, usize> {
    for (n, range) in ranges.iter().enumerate() {
        if range.remote_token != token {
            return Ok(n);
        }
        let there = segment.translate(range.remote_addr, range.len).ok_or(n)?;
        let (src, dst) = if WRITE {
            (range.local_addr as usize, there)
        } else {
            (there, range.local_addr as usize)
        };
        // SAFETY: the local side per this function's contract, the remote side inside
        // the mapping (checked just above).
        unsafe {
            ferry_backend_api::copy_bytes(src as *const u8, dst as *mut u8, range.len as usize)
        };
    }
    Ok(ranges.len())
}

/// A loaded peer.
struct Peer {
    name: String,
    pid: i32,
    /// The nonce of the peer's inbox (names the peer backend instance).
    inbox_nonce: [u8; 16],
    /// Host identity hash regions must carry.
    host_hash: u64,
    live: Liveness,
    /// Until when `live`'s last "alive" answer serves (that answer + LIVENESS_TTL): a
    /// comparison per batch, no duration arithmetic.
    live_until: Cell<Option<Instant>>,
    /// Our lane in the peer's inbox. Declared before the mapping it points into.
    lane: Lane,
    inbox: Inbox,
    /// Whether CMA reaches the peer, or why not.
    cma: std::result::Result<(), String>,
    regions: Arc<dyn PeerRegions>,
    /// Resolved remote tokens (filled on first use; cleared on reload).
    resolved: HashMap<u64, Target>,
    last: Option<(u64, Target)>,
    /// Mapped segments of the peer, by nonce.
    segments: Vec<([u8; 16], PeerMapping)>,
    /// Our copy of the peer's withdrawn ranges (`ring.rs`): checked before each copy.
    withdrawn: Withdrawn,
    _inbox_map: PeerMapping,
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.lane.release();
    }
}

/// One CMA iovec (the layout of `libc::iovec`, kept as integers so the backend stays
/// `Send`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Iov {
    base: usize,
    len: usize,
}

/// The same-host backend.
pub struct Shm {
    params: Params,
    agent: String,
    /// Owner id of our lanes: pid << 32 | process-unique backend id.
    owner_id: u64,
    host_id: String,
    host_hash: u64,
    cma_enabled: bool,
    inbox_mem: SharedMemory,
    inbox: Inbox,
    self_lane: Lane,
    /// Sender names per lane of our inbox, by owner id.
    lane_names: Vec<(u64, String)>,
    regions: Vec<LocalSlot>,
    free_slots: Vec<u32>,
    /// Fx-hashed: the keys are the engine's own peer handles, and every batch looks its
    /// peer up (SipHash was ~8 % of a one-range request).
    peers: SparseSecondaryMap<PeerId, Peer, rustc_hash::FxBuildHasher>,
    /// Scratch of one request's CMA ranges and iovecs (capacity kept: no allocation
    /// once warm).
    cma: CmaScratch,
    /// Corrupt records seen in our inbox (a peer wrote garbage into its lane).
    corrupt_lanes: u64,
    /// Our withdrawn ranges, oldest first (published in our inbox's header).
    withdrawn: Vec<(u64, u64)>,
    /// Regions being withdrawn: token → the table sequence peers must have reached.
    withdrawing: HashMap<u64, u64>,
}

fn positive(params: &Params, key: &'static str) -> Result<usize> {
    params[key]
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| Error::invalid(Subject::Named(key.into()), "must be a positive integer"))
}

fn peer_subject(name: &str) -> Subject {
    Subject::PeerName(name.to_string())
}

fn unsupported(what: String) -> Error {
    Error::NotSupported {
        backend: NAME.into(),
        what: what.into(),
    }
}

impl Shm {
    /// Make an instance for agent `init.agent_name`.
    pub fn new(init: &BackendInit<'_>) -> Result<Shm> {
        let params = effective_params(NAME, PARAMS, init.params)?;
        let lanes = positive(&params, "notif_lanes")?;
        let lane_bytes = positive(&params, "notif_lane_bytes")?;
        if lanes > ring::LANES_MAX
            || !lane_bytes.is_multiple_of(8)
            || !(256..=1 << 30).contains(&lane_bytes)
        {
            return Err(Error::invalid(
                Subject::BackendName(NAME.into()),
                format!(
                    "notif_lanes must be 1..={} and notif_lane_bytes a multiple of 8 in 256..=2^30",
                    ring::LANES_MAX
                ),
            ));
        }
        let cma_enabled = match params["cma"].as_str() {
            "auto" => true,
            "off" => false,
            other => {
                return Err(Error::invalid(
                    Subject::Named("cma".into()),
                    format!("'{other}': expected auto or off"),
                ))
            }
        };
        let host_id = match params["host_identity"].as_str() {
            "" => host::host_identity().to_string(),
            given => given.to_string(),
        };
        if host_id.len() > wire::HOST_ID_MAX {
            return Err(Error::invalid(
                Subject::Named("host_identity".into()),
                "longer than 1,024 bytes",
            ));
        }
        if init.agent_name.len() > ring::NAME_MAX {
            return Err(Error::invalid(
                Subject::BackendName(NAME.into()),
                format!(
                    "agent names longer than {} bytes are not supported",
                    ring::NAME_MAX
                ),
            ));
        }
        let inbox_mem =
            SharedMemory::alloc(ring::inbox_len(lanes, lane_bytes), &ShmOptions::default())?;
        // SAFETY: a fresh zeroed mapping of at least inbox_len bytes, owned by this
        // backend for as long as the view (both live in `Shm`; the view is dropped first).
        let inbox = unsafe {
            Inbox::init(
                inbox_mem.as_ptr(),
                inbox_mem.len(),
                &inbox_mem.live().nonce,
                lanes,
                lane_bytes,
            )
        };
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed) & u64::from(u32::MAX);
        let owner_id = (u64::from(std::process::id()) << 32) | id.max(1);
        let self_lane = inbox
            .claim(owner_id, init.agent_name)
            .map_err(|e| Error::Backend {
                backend: NAME.into(),
                errno: 0,
                desc: None,
                detail: format!("claiming our own notification lane: {e}").into(),
            })?;
        Ok(Shm {
            params,
            agent: init.agent_name.to_string(),
            owner_id,
            host_hash: fnv1a(host_id.as_bytes()),
            host_id,
            cma_enabled,
            inbox_mem,
            inbox,
            self_lane,
            lane_names: vec![(0, String::new()); lanes],
            regions: Vec::new(),
            free_slots: Vec::new(),
            peers: SparseSecondaryMap::with_hasher(rustc_hash::FxBuildHasher),
            cma: CmaScratch {
                pending: Vec::with_capacity(CMA_IOVECS_MAX),
                local: Vec::with_capacity(CMA_IOVECS_MAX),
                remote: Vec::with_capacity(CMA_IOVECS_MAX),
            },
            corrupt_lanes: 0,
            withdrawn: Vec::new(),
            withdrawing: HashMap::default(),
        })
    }

    /// The host identity this backend publishes.
    pub fn host_identity(&self) -> &str {
        &self.host_id
    }

    /// Corrupt records skipped in our inbox so far.
    pub fn corrupt_lanes(&self) -> u64 {
        self.corrupt_lanes
    }

    fn local_bounds(&self, token: u64) -> Option<LocalSlot> {
        let slot = *self.regions.get((token & u64::from(u32::MAX)) as usize)?;
        (slot.generation & 1 == 1 && u64::from(slot.generation) == token >> 32).then_some(slot)
    }

    fn conn(&self) -> ConnInfo {
        let live = self.inbox_mem.live();
        ConnInfo {
            pid: std::process::id(),
            backend_id: self.owner_id & u64::from(u32::MAX),
            inbox_fd: live.fd,
            inbox_nonce: live.nonce,
            inbox_base: live.base,
            inbox_len: live.len,
            host_id: self.host_id.clone(),
        }
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        self.inbox.close();
        self.self_lane.release();
        // Peers (lanes into their inboxes, mappings) go with the map.
    }
}

/// Parse, and check against the peer, a region's public metadata.
fn region_md(peer: &Peer, token: u64) -> Result<RegionMd> {
    let bytes = peer
        .regions
        .public_md(token)
        .ok_or_else(|| Error::NotFound {
            subject: Subject::Named(
                format!("SHM region token {token:#x} of peer '{}'", peer.name).into(),
            ),
        })?;
    let md = RegionMd::parse(bytes)?;
    if md.host_hash != peer.host_hash || md.pid != peer.pid as u32 {
        return Err(Error::Mismatch {
            subject: peer_subject(&peer.name),
            reason: format!(
                "a region's metadata names process {} on host hash {:#x}, the peer is process \
                 {} on {:#x}",
                md.pid, md.host_hash, peer.pid, peer.host_hash
            )
            .into(),
        });
    }
    Ok(md)
}

/// Whether `post`'s attached notification (if any) fits in `lane` now. Checked before
/// the data moves: a post that could not notify moves nothing. This backend is the
/// lane's only producer, so the room stays until [`notify_after`] uses it.
fn notif_fits(lane: &Lane, post: &Post<'_>) -> bool {
    post.notif.is_none_or(|payload| lane.fits(payload.len()))
}

/// Deliver `post`'s attached notification once its data moved (`result` Ok), into the
/// room [`notif_fits`] found.
fn notify_after(
    lane: &mut Lane,
    post: &Post<'_>,
    result: std::result::Result<(), Failure>,
) -> std::result::Result<(), Failure> {
    let (Ok(()), Some(payload)) = (result, post.notif) else {
        return result;
    };
    let pushed = lane.push(payload);
    debug_assert!(pushed, "room was checked before the data moved");
    if pushed {
        Ok(())
    } else {
        Err(fail(FailureKind::Backend, libc::ENOBUFS, None))
    }
}

/// Check every region a peer published for this backend before any is used: its
/// metadata parses, names the peer's process and host, and a shareable region lies
/// inside its segment, which is mapped now (the mapping checks the fd, the memfd's name
/// against the nonce, its sealed size against the length). A forged or stale region
/// refuses the whole load (`InvalidMetadata`, naming it), instead of failing its first
/// transfer. Mappings are kept for the transfers (`Peer::segments`).
fn validate_regions(peer: &mut Peer) -> Result<()> {
    let regions = peer.regions.clone();
    let mut first_error = None;
    let mut seen = 0usize;
    regions.for_each_region(NAME, &mut |token, desc, bytes| {
        if first_error.is_some() {
            return;
        }
        seen += 1;
        let bad = |why: String| Error::InvalidMetadata {
            reason: format!(
                "SHM region {:#x}+{} (token {token:#x}) of peer '{}': {why}",
                desc.addr, desc.len, peer.name
            )
            .into(),
        };
        let md = match region_md(peer, token) {
            Ok(md) => md,
            Err(e) => {
                first_error = Some(bad(e.to_string()));
                return;
            }
        };
        debug_assert_eq!(RegionMd::parse(bytes).ok(), Some(md));
        let Some(seg) = md.segment else { return };
        let inside = desc.addr >= seg.base
            && desc
                .addr
                .checked_add(desc.len)
                .is_some_and(|end| end <= seg.base + seg.len);
        if !inside {
            first_error = Some(bad(format!(
                "outside its segment {:#x}+{}",
                seg.base, seg.len
            )));
            return;
        }
        if let Some((_, m)) = peer.segments.iter().find(|(n, _)| *n == seg.nonce) {
            if m.len() as u64 != seg.len {
                first_error = Some(bad(format!(
                    "its segment was published with {} bytes elsewhere",
                    m.len()
                )));
            }
            return;
        }
        match PeerMapping::open(md.pid, seg.fd, &seg.nonce, seg.len) {
            Ok(m) => peer.segments.push((seg.nonce, m)),
            Err(e) => first_error = Some(bad(format!("its segment: {e}"))),
        }
    });
    if let Some(e) = first_error {
        return Err(e);
    }
    log::trace!("SHM: peer '{}': {seen} region(s) checked", peer.name);
    Ok(())
}

/// Resolve (and on first use map) the peer region `token`.
fn resolve(peer: &mut Peer, token: u64) -> std::result::Result<Target, (i32, String)> {
    if let Some((t, target)) = peer.last {
        if t == token {
            return Ok(target);
        }
    }
    let target = match peer.resolved.get(&token) {
        Some(&t) => t,
        None => {
            let md = region_md(peer, token).map_err(|e| (libc::EINVAL, e.to_string()))?;
            let target = match md.segment {
                None => Target::Cma,
                Some(seg) => {
                    let here = match peer.segments.iter().find(|(n, _)| *n == seg.nonce) {
                        Some((_, m)) => m.base() as usize,
                        None => {
                            let m = PeerMapping::open(md.pid, seg.fd, &seg.nonce, seg.len)
                                .map_err(|e| {
                                    log::warn!(
                                        "SHM: peer '{}': segment not mapped: {e}",
                                        peer.name
                                    );
                                    (libc::EACCES, e)
                                })?;
                            let here = m.base() as usize;
                            peer.segments.push((seg.nonce, m));
                            here
                        }
                    };
                    Target::Mapped(Segment {
                        here,
                        base: seg.base,
                        len: seg.len,
                    })
                }
            };
            peer.resolved.insert(token, target);
            target
        }
    };
    peer.last = Some((token, target));
    Ok(target)
}

/// One range of a request that goes through CMA.
#[derive(Clone, Copy, Debug)]
struct CmaRange {
    remote: u64,
    /// Position in the request (keeps equal remote starts in request order).
    index: u32,
    local: u64,
    len: u64,
}

/// The scratch lists of one request's CMA calls.
struct CmaScratch {
    pending: Vec<CmaRange>,
    local: Vec<Iov>,
    remote: Vec<Iov>,
}

/// Move `pending` with as few system calls as the kernel allows. The local and remote
/// iovec lists of `process_vm_writev`/`readv` are separate streams (the bytes of the
/// local list, in order, fill the remote list, in order), so the ranges are sorted by
/// remote address and remote neighbours merge into one remote iovec: the kernel's cost
/// is per remote iovec (it pins the target's pages for each), the local side's per
/// iovec is a plain copy. At most [`CMA_IOVECS_MAX`] iovecs on either side per call.
///
/// Ranges of one request that overlap at the target land in remote-address order, not
/// necessarily request order (no transport promises an order within a request).
///
/// # Safety
///
/// The local ranges lie in memory registered with this backend whose validity the
/// caller of `post` promised; the remote ones are the peer's, checked by the kernel.
unsafe fn cma_run(
    pid: i32,
    op: Op,
    pending: &mut [CmaRange],
    local: &mut Vec<Iov>,
    remote: &mut Vec<Iov>,
) -> std::result::Result<(), Failure> {
    if !pending.is_sorted_by_key(|r| (r.remote, r.index)) {
        // In place, no allocation.
        pending.sort_unstable_by_key(|r| (r.remote, r.index));
    }
    local.clear();
    remote.clear();
    for r in pending.iter() {
        let (l, rm, len) = (r.local as usize, r.remote as usize, r.len as usize);
        let local_joins = local.last().is_some_and(|v| v.base + v.len == l);
        let remote_joins = remote.last().is_some_and(|v| v.base + v.len == rm);
        if (!local_joins && local.len() == CMA_IOVECS_MAX)
            || (!remote_joins && remote.len() == CMA_IOVECS_MAX)
        {
            // SAFETY: forwarded from this function's contract.
            unsafe { cma_call(pid, op, local, remote)? };
        }
        match local.last_mut() {
            Some(v) if v.base + v.len == l => v.len += len,
            _ => local.push(Iov { base: l, len }),
        }
        match remote.last_mut() {
            Some(v) if v.base + v.len == rm => v.len += len,
            _ => remote.push(Iov { base: rm, len }),
        }
    }
    // SAFETY: as above.
    unsafe { cma_call(pid, op, local, remote) }
}

/// One `process_vm_writev`/`readv` of the queued iovecs (equal byte totals on both
/// sides); clears them. The failure if the kernel refused or moved less.
///
/// # Safety
///
/// As for [`cma_run`].
unsafe fn cma_call(
    pid: i32,
    op: Op,
    local: &mut Vec<Iov>,
    remote: &mut Vec<Iov>,
) -> std::result::Result<(), Failure> {
    if local.is_empty() {
        return Ok(());
    }
    let expected: usize = local.iter().map(|v| v.len).sum();
    debug_assert_eq!(expected, remote.iter().map(|v| v.len).sum::<usize>());
    let (l, nl) = (
        local.as_ptr() as *const libc::iovec,
        local.len() as libc::c_ulong,
    );
    let (r, nr) = (
        remote.as_ptr() as *const libc::iovec,
        remote.len() as libc::c_ulong,
    );
    // SAFETY: `Iov` has `iovec`'s layout (two machine words: base, len); the local
    // ranges are valid per this function's contract; the kernel checks the remote ones.
    let done = unsafe {
        match op {
            Op::Write => libc::process_vm_writev(pid, l, nl, r, nr, 0),
            Op::Read => libc::process_vm_readv(pid, l, nl, r, nr, 0),
        }
    };
    local.clear();
    remote.clear();
    if done < 0 {
        let errno = host::errno();
        let kind = if errno == libc::ESRCH {
            FailureKind::RemoteDisconnect
        } else {
            FailureKind::Backend
        };
        return Err(Failure {
            kind,
            errno,
            range: None,
        });
    }
    if done as usize != expected {
        return Err(Failure {
            kind: FailureKind::Backend,
            errno: libc::EFAULT,
            range: None,
        });
    }
    Ok(())
}

fn fail(kind: FailureKind, errno: i32, range: Option<u32>) -> Failure {
    Failure { kind, errno, range }
}

impl Shm {
    /// Run one request to `peer`: map what is not mapped, copy what is mapped, batch
    /// the rest into CMA calls.
    ///
    /// # Safety
    ///
    /// As for [`Backend::post`].
    unsafe fn run_peer(
        p: &mut Peer,
        cma: &mut CmaScratch,
        post: &Post<'_>,
    ) -> std::result::Result<(), Failure> {
        let pending = &mut cma.pending;
        pending.clear();
        let ranges = post.ranges;
        // The ranges go in runs of one remote token: each run's target is resolved
        // once, and a run into a mapped segment is copied by a loop that checks and
        // copies nothing else (`copy_mapped`), one per direction.
        let mut i = 0;
        while let Some(first) = ranges.get(i) {
            let index = Some(i as u32);
            let target = resolve(p, first.remote_token)
                .map_err(|(errno, _)| fail(FailureKind::Backend, errno, index))?;
            match target {
                Target::Mapped(segment) => {
                    let run = &ranges[i..];
                    // SAFETY: the local side lies in a registered region (the caller's
                    // promise); `copy_mapped` copies only what lies inside our mapping
                    // of the peer's sealed segment, which stays mapped until the peer
                    // is unloaded (not while `p`, borrowed from the backend, is held).
                    let copied = unsafe {
                        match post.op {
                            Op::Write => copy_mapped::<true>(run, first.remote_token, segment),
                            Op::Read => copy_mapped::<false>(run, first.remote_token, segment),
                        }
                    };
                    match copied {
                        Ok(n) => i += n,
                        Err(n) => {
                            return Err(fail(
                                FailureKind::Backend,
                                libc::EFAULT,
                                Some((i + n) as u32),
                            ))
                        }
                    }
                }
                Target::Cma => {
                    if p.cma.is_err() {
                        return Err(fail(FailureKind::Backend, libc::EPERM, index));
                    }
                    for range in &ranges[i..] {
                        if range.remote_token != first.remote_token {
                            break;
                        }
                        if range.len > isize::MAX as u64 / 2 {
                            return Err(fail(FailureKind::Backend, libc::EINVAL, Some(i as u32)));
                        }
                        pending.push(CmaRange {
                            remote: range.remote_addr,
                            index: i as u32,
                            local: range.local_addr,
                            len: range.len,
                        });
                        i += 1;
                    }
                }
            }
        }
        // SAFETY: local ranges per `post`'s contract.
        unsafe { cma_run(p.pid, post.op, pending, &mut cma.local, &mut cma.remote) }
    }

    /// Run a batch to `peer` between `Lane::begin_copies` and `end_copies`: a request
    /// naming a range the peer withdrew fails (`EFAULT`) and moves nothing.
    ///
    /// # Safety
    ///
    /// As for [`Backend::post`].
    unsafe fn post_to_peer(
        p: &mut Peer,
        cma: &mut CmaScratch,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) {
        for post in batch {
            let withdrawn = (!p.withdrawn.is_empty())
                .then(|| {
                    post.ranges
                        .iter()
                        .position(|r| p.withdrawn.hits(r.remote_addr, r.len))
                })
                .flatten();
            let room = notif_fits(&p.lane, post);
            let result = if let Some(i) = withdrawn {
                Err(fail(FailureKind::Backend, libc::EFAULT, Some(i as u32)))
            } else if room {
                // SAFETY: forwarded from the caller of `post`. The peer was alive when
                // the batch started (a pidfd poll at most LIVENESS_TTL old); a peer that
                // dies during the copies leaves our mapping of its segment valid, and a
                // CMA call to it fails ESRCH.
                unsafe { Self::run_peer(p, cma, post) }
            } else {
                Err(fail(FailureKind::Backend, libc::ENOBUFS, None))
            };
            let result = notify_after(&mut p.lane, post, result);
            done.push(ferry_backend_api::Completion {
                tag: post.tag,
                result,
            });
        }
    }

    /// Run one request within this agent.
    ///
    /// # Safety
    ///
    /// As for [`Backend::post`].
    unsafe fn run_local(&self, post: &Post<'_>) -> std::result::Result<(), Failure> {
        for (i, range) in post.ranges.iter().enumerate() {
            let ok = |token: u64, addr: u64| {
                self.local_bounds(token).is_some_and(|s| {
                    let offset = addr.wrapping_sub(s.addr);
                    offset <= s.len && range.len <= s.len - offset
                })
            };
            if !ok(range.local_token, range.local_addr)
                || !ok(range.remote_token, range.remote_addr)
            {
                return Err(fail(FailureKind::Backend, libc::EFAULT, Some(i as u32)));
            }
            let (src, dst) = match post.op {
                Op::Write => (range.local_addr, range.remote_addr),
                Op::Read => (range.remote_addr, range.local_addr),
            };
            // SAFETY: both sides lie inside our live registrations (checked), whose
            // validity the caller of `post` promised; `copy_bytes` tolerates overlap.
            unsafe {
                ferry_backend_api::copy_bytes(src as *const u8, dst as *mut u8, range.len as usize)
            };
        }
        Ok(())
    }

    /// The peer's refusal reason if it cannot take a post now.
    fn check_peer(&self, peer: PeerId) -> Result<()> {
        let p = self
            .peers
            .get(peer)
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        Self::peer_ready(p, Instant::now())
    }

    /// [`Shm::check_peer`] for a peer already looked up, at `now` (a post passes the
    /// engine's reading, [`Completions::now`]).
    fn peer_ready(p: &Peer, now: Instant) -> Result<()> {
        let gone = || {
            Err(Error::RemoteDisconnect {
                subject: peer_subject(&p.name),
            })
        };
        if p.inbox.is_closed() {
            return gone();
        }
        // The pidfd poll is a system call; one answer serves the batches of the next
        // LIVENESS_TTL (timed by the engine's clock reading for a post, or a vDSO clock
        // read). A dead peer is polled every time.
        if p.live_until.get().is_none_or(|until| now >= until) {
            if !p.live.alive() {
                return gone();
            }
            p.live_until.set(now.checked_add(LIVENESS_TTL));
        }
        Ok(())
    }
}

impl Backend for Shm {
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
            "memfd inbox of {} bytes ({} notification lanes of {} bytes), cross-memory \
             attach {}, host identity {}",
            self.inbox_mem.len(),
            self.params["notif_lanes"],
            self.params["notif_lane_bytes"],
            if self.cma_enabled { "auto" } else { "off" },
            self.host_id,
        ))
    }

    unsafe fn register(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        if region.kind != MemKind::Dram {
            return Err(unsupported(format!("memory kind {}", region.kind)));
        }
        let d = region.desc;
        if d.addr == 0 || d.len == 0 || d.end().is_none_or(|end| end > isize::MAX as u64) {
            return Err(Error::invalid(
                Subject::Descriptor {
                    index: 0,
                    addr: d.addr,
                    len: d.len,
                    dev: d.dev,
                },
                "not a valid host address range",
            ));
        }
        let index = match self.free_slots.pop() {
            Some(i) => i as usize,
            None if self.regions.len() < u32::MAX as usize => {
                self.regions.push(LocalSlot::default());
                self.regions.len() - 1
            }
            None => {
                return Err(Error::Capacity {
                    what: "SHM regions",
                    limit: u32::MAX as usize,
                })
            }
        };
        // Memory registered again is reachable again: forget withdrawn ranges in it.
        let before = self.withdrawn.len();
        self.withdrawn
            .retain(|&(lo, hi)| !(lo < d.addr + d.len && d.addr < hi));
        if self.withdrawn.len() != before {
            self.inbox.set_withdrawn(&self.withdrawn);
        }
        let slot = &mut self.regions[index];
        slot.generation = slot.generation.wrapping_add(1) | 1;
        slot.addr = d.addr;
        slot.len = d.len;
        let token = (u64::from(slot.generation) << 32) | index as u64;
        let segment = segment::live_segment(d.addr, d.len).map(|s| wire::SegmentRef {
            fd: s.fd,
            nonce: s.nonce,
            base: s.base,
            len: s.len,
        });
        let md = RegionMd {
            pid: std::process::id(),
            host_hash: self.host_hash,
            segment,
        };
        Ok(Registered {
            token,
            public_md: md.encode(),
        })
    }

    fn withdraw(&mut self, kind: MemKind, token: u64) -> Result<bool> {
        let Some(bounds) = (kind == MemKind::Dram)
            .then(|| self.local_bounds(token))
            .flatten()
        else {
            return Err(Error::not_found(Subject::Named(
                format!("SHM {kind} region token {token:#x}").into(),
            )));
        };
        let own = self.self_lane.index();
        if let Some(&seq) = self.withdrawing.get(&token) {
            return Ok(self.inbox.senders_past(seq, own));
        }
        if !self.inbox.has_senders(own) {
            // No peer holds a lane, so none can copy (the common case: nothing to do).
            return Ok(true);
        }
        let range = (bounds.addr, bounds.addr + bounds.len);
        self.withdrawn.push(range);
        if self.withdrawn.len() > WITHDRAWN_MAX {
            let (lo, hi) = self.withdrawn.remove(0);
            log::warn!(
                "SHM: more than {WITHDRAWN_MAX} withdrawn regions: the oldest                  ({lo:#x}..{hi:#x}) is no longer refused to peers with stale metadata"
            );
        }
        let seq = self.inbox.set_withdrawn(&self.withdrawn);
        self.withdrawing.insert(token, seq);
        Ok(self.inbox.senders_past(seq, own))
    }

    unsafe fn deregister(&mut self, kind: MemKind, token: u64) -> Result<()> {
        if kind != MemKind::Dram || self.local_bounds(token).is_none() {
            return Err(Error::not_found(Subject::Named(
                format!("SHM {kind} region token {token:#x}").into(),
            )));
        }
        self.withdrawing.remove(&token);
        let index = (token & u64::from(u32::MAX)) as usize;
        let slot = &mut self.regions[index];
        slot.generation = slot.generation.wrapping_add(1);
        self.free_slots.push(index as u32);
        Ok(())
    }

    fn conn_info(&self) -> Result<Vec<u8>> {
        Ok(self.conn().encode())
    }

    fn load_remote(&mut self, peer: PeerId, remote: RemoteAgent<'_>) -> Result<()> {
        if remote.conn_info.is_empty() {
            // Partial metadata without connection info: keep what we have, with the
            // accumulated regions (tokens may name other regions now: forget them).
            return match self.peers.get_mut(peer) {
                Some(p) => {
                    let old = std::mem::replace(&mut p.regions, remote.regions);
                    if let Err(e) = validate_regions(p) {
                        p.regions = old;
                        return Err(e);
                    }
                    p.resolved.clear();
                    p.last = None;
                    Ok(())
                }
                None => Err(Error::not_found(peer_subject(&format!(
                    "{} (no SHM connection info loaded yet)",
                    remote.name
                )))),
            };
        }
        let conn = ConnInfo::parse(remote.conn_info)?;
        if conn.host_id != self.host_id {
            // The engine keeps this error only when no other backend takes the peer.
            log::info!(
                "SHM: peer '{}' is on another host ('{}'); another backend must serve it",
                remote.name,
                conn.host_id
            );
            return Err(unsupported(format!(
                "peer '{}' is on another host (its host identity '{}' is not ours, '{}'); \
                 SHM reaches only agents of this host",
                remote.name, conn.host_id, self.host_id
            )));
        }
        if let Some(p) = self.peers.get_mut(peer) {
            if p.inbox_nonce == conn.inbox_nonce && !p.inbox.is_closed() {
                // Same peer process: keep mappings and lane, take the new regions (once
                // they pass; the old ones stay otherwise).
                let old = std::mem::replace(&mut p.regions, remote.regions);
                if let Err(e) = validate_regions(p) {
                    p.regions = old;
                    return Err(e);
                }
                p.resolved.clear();
                p.last = None;
                return Ok(());
            }
            self.peers.remove(peer);
        }
        let pid = i32::try_from(conn.pid)
            .map_err(|_| Error::invalid(peer_subject(remote.name), "pid out of range"))?;
        // The pidfd first: what the checks below see belongs to the process it names.
        let live = Liveness::open(pid);
        let refused = |why: String| Error::NotSupported {
            backend: NAME.into(),
            what: format!(
                "peer '{}' (process {pid}) is unreachable: {why}",
                remote.name
            )
            .into(),
        };
        let inbox_map =
            PeerMapping::open(conn.pid, conn.inbox_fd, &conn.inbox_nonce, conn.inbox_len)
                .map_err(|e| refused(format!("its notification inbox: {e}")))?;
        // SAFETY: the mapping lives in the same `Peer` as the view and is dropped after
        // it (field order), and is inbox_len bytes long.
        let inbox = unsafe { Inbox::attach(inbox_map.base(), inbox_map.len(), &conn.inbox_nonce) }
            .map_err(|e| refused(format!("its notification inbox: {e}")))?;
        if !live.alive() {
            return Err(Error::RemoteDisconnect {
                subject: peer_subject(remote.name),
            });
        }
        let cma = if !self.cma_enabled {
            Err("process_vm_readv/writev disabled by the backend's cma=off parameter".to_string())
        } else {
            // Read the peer's inbox header through CMA and compare with our mapping.
            let mut seen = [0u8; 24];
            match host::cma_read(pid, conn.inbox_base, &mut seen) {
                Ok(()) => {
                    let mut expected = [0u8; 24];
                    expected[..8].copy_from_slice(&ring::MAGIC.to_le_bytes());
                    expected[8..].copy_from_slice(&conn.inbox_nonce);
                    if seen == expected {
                        Ok(())
                    } else {
                        Err(format!(
                            "process_vm_readv of process {pid} read other bytes than its inbox \
                             holds (wrong address in its connection info)"
                        ))
                    }
                }
                Err(errno) => Err(format!(
                    "process_vm_readv of process {pid} failed: {} ({})",
                    std::io::Error::from_raw_os_error(errno),
                    host::ptrace_policy()
                )),
            }
        };
        if let Err(why) = &cma {
            log::info!(
                "SHM: peer '{}': only its shareable memory is reachable ({why}); lists naming \
                 its ordinary memory go to another backend",
                remote.name
            );
        }
        let lane = inbox
            .claim(self.owner_id, &self.agent)
            .map_err(|e| refused(format!("its notification inbox: {e}")))?;
        let mut new = Peer {
            name: remote.name.to_string(),
            pid,
            inbox_nonce: conn.inbox_nonce,
            host_hash: fnv1a(conn.host_id.as_bytes()),
            live,
            live_until: Cell::new(None),
            lane,
            inbox,
            cma,
            regions: remote.regions,
            resolved: HashMap::default(),
            last: None,
            segments: Vec::new(),
            withdrawn: Withdrawn::default(),
            _inbox_map: inbox_map,
        };
        validate_regions(&mut new)?;
        self.peers.insert(peer, new);
        Ok(())
    }

    fn unload_remote(&mut self, peer: PeerId) {
        // Dropping the peer releases its lane and unmaps its segments and inbox. No
        // request is in flight: every post completed inside `post`.
        self.peers.remove(peer);
    }

    fn connect(&mut self, peer: PeerId) -> Result<()> {
        self.check_peer(peer)
    }

    fn reaches(&self, peer: PeerId, remote_token: u64) -> bool {
        let Some(p) = self.peers.get(peer) else {
            return false;
        };
        if p.cma.is_ok() {
            return true;
        }
        region_md(p, remote_token).is_ok_and(|md| md.segment.is_some())
    }

    fn validate(&self, endpoint: Endpoint, post: &Post<'_>) -> Result<()> {
        let Endpoint::Peer(peer) = endpoint else {
            return Ok(());
        };
        let Some(p) = self.peers.get(peer) else {
            return Err(Error::not_found(Subject::Peer(peer)));
        };
        if let Some(payload) = post.notif {
            if payload.len() > p.inbox.payload_max() {
                return Err(Error::Capacity {
                    what: "SHM notification bytes (half a peer's ring)",
                    limit: p.inbox.payload_max(),
                });
            }
            // Refused before anything moves when the target's ring has no room now (a
            // batch's later posts are checked again in `post`, before their data).
            if !p.lane.fits(payload.len()) {
                return Err(Error::Capacity {
                    what: "SHM notification ring records (the target has not drained its ring)",
                    limit: p.inbox.payload_max(),
                });
            }
        }
        let Err(why) = &p.cma else {
            return Ok(());
        };
        let mut last = None;
        for range in post.ranges {
            if last == Some(range.remote_token) {
                continue;
            }
            last = Some(range.remote_token);
            if region_md(p, range.remote_token)?.segment.is_none() {
                return Err(unsupported(format!(
                    "peer '{}': ordinary memory at {:#x} can only be reached through \
                     process_vm_writev/readv, and {why}",
                    p.name, range.remote_addr
                )));
            }
        }
        Ok(())
    }

    unsafe fn post(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()> {
        match endpoint {
            Endpoint::Local => {
                for post in batch {
                    let result = if notif_fits(&self.self_lane, post) {
                        // SAFETY: forwarded from the caller of `post`.
                        unsafe { self.run_local(post) }
                    } else {
                        Err(fail(FailureKind::Backend, libc::ENOBUFS, None))
                    };
                    let result = notify_after(&mut self.self_lane, post, result);
                    done.push(ferry_backend_api::Completion {
                        tag: post.tag,
                        result,
                    });
                }
            }
            Endpoint::Peer(peer) => {
                // One lookup of the peer serves the whole batch.
                let p = self
                    .peers
                    .get_mut(peer)
                    .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
                Self::peer_ready(p, done.now())?;
                // The fence of the target's deregistrations (`ring.rs`): announce the
                // withdrawn table this batch is checked against; ranges it names fail.
                if !p.lane.begin_copies(&mut p.withdrawn) {
                    return Err(Error::backend(
                        NAME,
                        format!("peer '{}' kept rewriting its withdrawn ranges", p.name),
                    ));
                }
                // SAFETY: forwarded from the caller of `post`.
                unsafe { Self::post_to_peer(p, &mut self.cma, batch, done) };
                p.lane.end_copies();
            }
        }
        Ok(())
    }

    fn progress(&mut self, _done: &mut Completions) {
        // Every post completed inside `post`.
    }

    fn notify(&mut self, endpoint: Endpoint, payload: &[u8]) -> Result<()> {
        let (lane, payload_max) = match endpoint {
            Endpoint::Local => (&mut self.self_lane, self.inbox.payload_max()),
            Endpoint::Peer(peer) => {
                self.check_peer(peer)?;
                let p = self.peers.get_mut(peer).expect("checked");
                (&mut p.lane, p.inbox.payload_max())
            }
        };
        if payload.len() > payload_max {
            return Err(Error::Capacity {
                what: "SHM notification bytes (half the target's ring)",
                limit: payload_max,
            });
        }
        if lane.push(payload) {
            Ok(())
        } else {
            Err(Error::Capacity {
                what: "SHM notification ring records (the target has not drained its ring)",
                limit: payload_max,
            })
        }
    }

    fn drain_notifications(&mut self, sink: &mut dyn NotifSink) -> usize {
        let (delivered, corrupt) = self.inbox.drain(&mut self.lane_names, |from, payload| {
            sink.deliver(from, payload)
        });
        self.corrupt_lanes += corrupt as u64;
        delivered
    }
}

#[cfg(test)]
mod tests;
