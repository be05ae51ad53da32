//! The executor's state: backends, regions and their sections, prepared lists,
//! transfer requests and peers, each a struct-of-arrays table (declared with
//! [`ferry_storage::table!`], which owns the columns) keyed by handles. The domain logic
//! of each table lives beside it:
//!
//! - [`regions`]: register / deregister, the section index, pins;
//! - [`preps`]: prepared lists (descriptors resolved once);
//! - [`xfers`]: requests — make, completion routing, draining, release;
//! - [`peers`]: peers — load, invalidate (the row is freed), generations;
//! - [`notifs`]: standalone notifications and draining inbound ones.
//!
//! Mutators that could hand a backend an address nobody promised to keep valid are not
//! public: registration runs only through `CommandBuffer::register` (an `unsafe fn`),
//! and loading a peer view is an `unsafe fn`.

mod create;
pub mod notifs;
pub mod peers;
pub mod preps;
pub mod regions;
pub mod xfers;

pub use peers::{LoadKind, PeerTable};
pub use preps::{PrepEntry, PrepRun, PrepSide, PrepTable};
pub use regions::DeregStatus;
pub use xfers::{Telemetry, XferState, XferTable};

use std::collections::HashMap;
use std::sync::Arc;

use ferry_backend_api::{Backend, Capabilities, Completions, PeerRegions, Range};
use ferry_storage::{
    AgentTag, BackendId, Desc, Error, MdArena, MdEntries, MemKind, PeerId, RegionId, RegionTable,
    SectionIndex, Subject, MAX_BACKENDS, SLOTS_MAX, TAG_MAX,
};

/// Bounds chosen at start-up. Every table and queue is limited by one of these.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Registered regions.
    pub regions_max: usize,
    /// Live prepared lists.
    pub preps_max: usize,
    /// Live transfer requests.
    pub xfers_max: usize,
    /// Loaded peers.
    pub peers_max: usize,
    /// Descriptors in one list or request.
    pub descs_per_list_max: usize,
    /// Bytes of one notification.
    pub notif_len_max: usize,
    /// Record per-request telemetry (start, durations, bytes, descriptor count).
    pub telemetry: bool,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            regions_max: 1 << 20,
            preps_max: 1 << 16,
            xfers_max: 1 << 16,
            peers_max: 1 << 12,
            descs_per_list_max: 1 << 20,
            notif_len_max: 1 << 20,
            telemetry: true,
        }
    }
}

/// A peer's metadata as the executor needs it: find regions, read public metadata.
/// Implemented by the engine over the validated, archived blobs (read in place).
pub trait PeerView: PeerRegions {
    /// The metadata generation the peer published.
    fn md_generation(&self) -> u64;
    /// Index of backend type `name` in the peer's metadata.
    fn backend_index(&self, name: &str) -> Option<u8>;
    /// The peer's connection info for backend `index` (None if not included).
    fn conn_info(&self, index: u8) -> Option<&[u8]>;
    /// Token of the peer region of (backend, kind) that covers all of `desc`.
    fn find(&self, backend: u8, kind: MemKind, desc: Desc) -> Option<u64>;
    /// Like [`PeerView::find`], also giving the region's own range, so the caller can
    /// test following descriptors against it without searching.
    fn find_bounds(&self, backend: u8, kind: MemKind, desc: Desc) -> Option<(u64, Desc)>;
    /// Like [`PeerView::find_bounds`], trying first the region after the one of token
    /// `last` (a walk over consecutive regions then costs no search).
    fn find_bounds_after(
        &self,
        backend: u8,
        kind: MemKind,
        desc: Desc,
        last: u64,
    ) -> Option<(u64, Desc)> {
        let _ = last;
        self.find_bounds(backend, kind, desc)
    }
    /// Regions the view describes (over all its backends and memory kinds; a region
    /// published in several blobs counts once). For logs and counts, not lookups.
    fn region_count(&self) -> usize;
}

/// The last region a lookup hit: (dev, start, end) and what it resolved to.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hit {
    pub(crate) dev: u64,
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) value: u64,
}

impl Hit {
    /// An impossible hit (matches nothing).
    pub(crate) const NONE: Hit = Hit {
        dev: u64::MAX,
        start: 1,
        end: 0,
        value: 0,
    };

    /// Whether `desc` lies inside the remembered region.
    #[inline]
    pub(crate) fn covers(&self, desc: Desc) -> bool {
        desc.dev == self.dev
            && desc.addr >= self.start
            && desc.len <= self.end.saturating_sub(desc.addr)
    }
}

/// The backends of one agent, by slot.
#[derive(Default)]
pub struct BackendSlots {
    /// Handle → slot.
    pub(crate) keys: slotmap::SlotMap<BackendId, u8>,
    /// Handle of each slot.
    pub(crate) ids: [Option<BackendId>; MAX_BACKENDS],
    /// The backend in each slot.
    pub(crate) backends: Vec<Option<Box<dyn Backend>>>,
    /// Capabilities of each slot.
    pub(crate) caps: Vec<Option<Capabilities>>,
}

/// Vectors of released rows, kept for the next row that needs one.
#[derive(Default)]
pub(crate) struct Pools {
    /// Prepared-list entries.
    pub(crate) entries: Vec<Vec<PrepEntry>>,
    /// Request range lists.
    pub(crate) ranges: Vec<Vec<Range>>,
    /// Notification payloads.
    pub(crate) notifs: Vec<Vec<u8>>,
    /// Request pin lists.
    pub(crate) pins: Vec<Vec<RegionId>>,
    /// Strided prepared lists' runs.
    pub(crate) runs: Vec<Vec<preps::PrepRun>>,
    /// Scratch of `prep_strided`: the runs' descriptors, written out (where a list is
    /// not kept as runs).
    pub(crate) strided_descs: Vec<Desc>,
}

/// Everything the executor works on.
pub struct World {
    /// The agent's name.
    pub name: String,
    /// Bounds.
    pub bounds: Bounds,
    /// Backends.
    pub(crate) backends: BackendSlots,
    /// Registered regions.
    pub(crate) regions: RegionTable,
    /// The regions' public metadata (rows point into it: `regions.public_md`).
    pub(crate) region_md: MdArena,
    /// Section index per backend slot and memory kind.
    pub(crate) sections: Vec<[SectionIndex; 5]>,
    /// Prepared lists.
    pub(crate) preps: PrepTable,
    /// Transfer requests.
    pub(crate) xfers: XferTable,
    /// Peers.
    pub(crate) peers: PeerTable,
    /// Peer name → handle.
    pub(crate) peer_names: HashMap<String, PeerId>,
    /// Reusable vectors of released rows (no allocation in steady state).
    pub(crate) pools: Pools,
    /// Completion sink shared by all backends.
    pub(crate) completions: Completions,
    /// When this flush's last post returned (telemetry on): the completion time of
    /// what the posts completed at once, so routing them reads no clock of its own.
    pub(crate) dispatched_at: Option<std::time::Instant>,
    /// Per-flush scratch.
    pub(crate) arena: bumpalo::Bump,
    /// Descriptors a request can have before its range list grows (see
    /// [`World::ready_requests`]); 0 until the first load.
    pub(crate) ready_descs: usize,
    /// Regions deregistered so far (part of the published metadata generation).
    pub(crate) deregistrations: u64,
    /// Regions whose memory a backend allocated (`alloc_region`): region, the
    /// allocating backend's slot, address to free at deregistration.
    pub(crate) allocations: Vec<(RegionId, usize, u64)>,
    /// Counters and histograms (`crate::metrics`), shared with readers.
    pub(crate) metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// Measured cost model per backend slot (`crate::cost`).
    pub(crate) costs: [crate::cost::CostModel; MAX_BACKENDS],
    /// Per-size-class recent durations, indexed by backend slot (`cost.rs`).
    pub(crate) size_costs: [crate::cost::SizeClasses; MAX_BACKENDS],
    /// Hits of capacity bounds, for rate-limited log lines (`crate::logging`).
    pub(crate) limits: crate::logging::LimitLog,
    /// This agent's identity inside its handles (returned to the pool on drop).
    pub(crate) tag: TagLease,
    /// Regions out of the tables whose deregistration waits for peers (`regions.rs`).
    pub(crate) withdrawing: Vec<regions::Withdrawing>,
}

/// Tags of live worlds: bit `n` set = tag `n` in use (tag 0 is never handed out).
static TAGS_IN_USE: std::sync::Mutex<[u64; (TAG_MAX as usize + 64) / 64]> =
    std::sync::Mutex::new([0; (TAG_MAX as usize + 64) / 64]);

/// One live world's [`AgentTag`], unique among the process's live worlds.
#[derive(Debug)]
pub(crate) struct TagLease(AgentTag);

impl TagLease {
    /// The lowest free tag, or `Capacity` when TAG_MAX worlds are alive.
    fn take() -> Result<TagLease, Error> {
        let mut used = TAGS_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
        for n in 1..=TAG_MAX {
            let (word, bit) = (usize::from(n) / 64, n % 64);
            if used[word] & (1 << bit) == 0 {
                used[word] |= 1 << bit;
                return Ok(TagLease(AgentTag::new(n).expect("in range")));
            }
        }
        Err(Error::Capacity {
            what: "live agents per process",
            limit: usize::from(TAG_MAX),
        })
    }

    pub(crate) fn get(&self) -> AgentTag {
        self.0
    }
}

impl Drop for TagLease {
    fn drop(&mut self) {
        let n = self.0.get();
        let mut used = TAGS_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
        used[usize::from(n) / 64] &= !(1 << (n % 64));
    }
}

impl World {
    /// An empty world for agent `name`. Fails if a bound exceeds what a table can hold
    /// ([`SLOTS_MAX`] − 1 rows) or [`TAG_MAX`] worlds are alive.
    pub fn new(name: &str, bounds: Bounds) -> Result<World, Error> {
        for (what, value) in [
            ("regions_max", bounds.regions_max),
            ("preps_max", bounds.preps_max),
            ("xfers_max", bounds.xfers_max),
            ("peers_max", bounds.peers_max),
        ] {
            if value >= SLOTS_MAX {
                return Err(Error::invalid(
                    Subject::Named(format!("bound {what}").into()),
                    format!(
                        "{value} is more than a table holds ({} rows)",
                        SLOTS_MAX - 1
                    ),
                ));
            }
        }
        let tag = TagLease::take()?;
        let xfers = bounds.xfers_max.min(1 << 14);
        Ok(World {
            name: name.to_string(),
            backends: BackendSlots {
                backends: (0..MAX_BACKENDS).map(|_| None).collect(),
                caps: vec![None; MAX_BACKENDS],
                ..BackendSlots::default()
            },
            regions: RegionTable::tagged(bounds.regions_max.min(1 << 12), tag.get()),
            region_md: MdArena::new(),
            sections: (0..MAX_BACKENDS).map(|_| Default::default()).collect(),
            preps: PrepTable::tagged(bounds.preps_max.min(1 << 10), tag.get()),
            xfers: XferTable::tagged(bounds.xfers_max.min(1 << 10), tag.get()),
            peers: PeerTable::tagged(bounds.peers_max.min(1 << 8), tag.get()),
            peer_names: HashMap::new(),
            pools: Pools::default(),
            completions: Completions::with_capacity(xfers),
            dispatched_at: None,
            arena: bumpalo::Bump::with_capacity(64 * 1024),
            ready_descs: 0,
            deregistrations: 0,
            allocations: Vec::new(),
            metrics: Default::default(),
            costs: Default::default(),
            size_costs: Default::default(),
            limits: Default::default(),
            tag,
            // Room for a few pending deregistrations, so one in a flush does not allocate.
            withdrawing: Vec::with_capacity(16),
            bounds,
        })
    }

    /// The agent's metrics (counters recorded by the phases; readable from any thread).
    pub fn metrics(&self) -> &std::sync::Arc<crate::metrics::Metrics> {
        &self.metrics
    }

    /// Put a backend in the first free slot.
    pub fn add_backend(&mut self, backend: Box<dyn Backend>) -> Result<BackendId, Error> {
        let slot = self
            .backends
            .backends
            .iter()
            .position(Option::is_none)
            .ok_or(Error::Capacity {
                what: "backends per agent",
                limit: MAX_BACKENDS,
            })?;
        let id = self.tag.get().stamp(self.backends.keys.insert(slot as u8));
        self.backends.ids[slot] = Some(id);
        self.backends.caps[slot] = Some(backend.capabilities());
        self.metrics.set_backend(slot, backend.name());
        // Sized now, so that recording a completion (in a flush) never allocates.
        self.size_costs[slot] = crate::cost::SizeClasses::new();
        self.backends.backends[slot] = Some(backend);
        Ok(id)
    }

    /// Slot of backend `id`.
    pub fn backend_slot(&self, id: BackendId) -> Result<usize, Error> {
        self.backends
            .keys
            .get(self.tag.get().stamp(id))
            .map(|&s| usize::from(s))
            .ok_or_else(|| Error::not_found(Subject::Backend(id)))
    }

    /// The backend with handle `id`.
    pub fn backend(&self, id: BackendId) -> Result<&dyn Backend, Error> {
        let slot = self.backend_slot(id)?;
        Ok(self.backends.backends[slot]
            .as_deref()
            .expect("slot of a live id is filled"))
    }

    /// The backend with handle `id`, mutably (the crate's own use: a `&mut dyn Backend`
    /// would let safe code call backend methods behind the executor's checks).
    pub(crate) fn backend_mut(
        &mut self,
        id: BackendId,
    ) -> Result<&mut (dyn Backend + 'static), Error> {
        let slot = self.backend_slot(id)?;
        Ok(self.backends.backends[slot]
            .as_deref_mut()
            .expect("slot of a live id is filled"))
    }

    /// Ask backend `id` about memory or files (one result per descriptor).
    pub fn query(
        &mut self,
        id: BackendId,
        kind: MemKind,
        descs: &[Desc],
        paths: &[Option<&std::path::Path>],
    ) -> Result<Vec<ferry_backend_api::QueryResult>, Error> {
        self.backend_mut(id)?.query(kind, descs, paths)
    }

    /// Handles of all backends, in slot order.
    pub fn backend_ids(&self) -> impl Iterator<Item = BackendId> + '_ {
        self.backends.ids.iter().flatten().copied()
    }

    /// Slots holding a backend, with the backend.
    pub(crate) fn live_backends(&mut self) -> impl Iterator<Item = (usize, &mut Box<dyn Backend>)> {
        self.backends
            .backends
            .iter_mut()
            .enumerate()
            .filter_map(|(s, b)| b.as_mut().map(|b| (s, b)))
    }

    /// The registered regions.
    pub fn regions(&self) -> &RegionTable {
        &self.regions
    }

    /// The public metadata of the region in `row` of [`World::regions`]: (backend slot,
    /// bytes), one entry per backend that published any.
    #[inline]
    pub fn region_public_md(&self, row: usize) -> MdEntries<'_> {
        let span = self.regions.public_md.get(row).copied().unwrap_or_default();
        self.region_md.entries(span)
    }

    /// Type name of the backend in `slot`.
    pub fn slot_name(&self, slot: usize) -> Option<&'static str> {
        self.backends.backends.get(slot)?.as_ref().map(|b| b.name())
    }

    /// Section of (slot, kind).
    pub fn section(&self, slot: usize, kind: MemKind) -> &SectionIndex {
        &self.sections[slot][kind as usize]
    }

    /// Find a peer by agent name.
    pub fn peer_by_name(&self, name: &str) -> Option<PeerId> {
        self.peer_names.get(name).copied()
    }

    /// Agent name of a peer.
    pub fn peer_name(&self, peer: PeerId) -> Result<&str, Error> {
        let row = self
            .peers
            .row(peer)
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        Ok(&self.peers.names[row])
    }

    /// Current metadata view and generation of a peer.
    #[allow(clippy::type_complexity)]
    pub fn peer_view(&self, peer: PeerId) -> Result<(Option<&Arc<dyn PeerView>>, u32), Error> {
        let row = self
            .peers
            .row(peer)
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        Ok((self.peers.views[row].as_ref(), self.peers.generations[row]))
    }

    /// Number of live requests, prepared lists, regions and peers.
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        (
            self.xfers.len(),
            self.preps.len(),
            self.regions.len(),
            self.peers.len(),
        )
    }
}

impl World {
    /// How many regions were deregistered so far.
    pub fn deregistrations(&self) -> u64 {
        self.deregistrations
    }

    /// Capabilities of the backend in `slot`.
    pub fn slot_capabilities(&self, slot: usize) -> Option<Capabilities> {
        self.backends.caps.get(slot).copied().flatten()
    }

    /// Connection info of the backend in `slot` (`None`: no backend there).
    pub fn slot_conn_info(&self, slot: usize) -> Option<Result<Vec<u8>, Error>> {
        self.backends
            .backends
            .get(slot)?
            .as_ref()
            .map(|b| b.conn_info())
    }

    /// Slot of the backend in `id`'s position, with its handle.
    pub fn slot_id(&self, slot: usize) -> Option<BackendId> {
        self.backends.ids.get(slot).copied().flatten()
    }
}
