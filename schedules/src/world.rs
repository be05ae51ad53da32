//! The executor's state: backends, regions and their sections, prepared lists,
//! transfer requests and peers, each a struct-of-arrays table keyed by handles.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_backend_api::{Backend, Capabilities, Completions, PeerRegions, Range};
use ferry_storage::{
    BackendId, BackendMask, Desc, Endpoint, Error, MemKind, Op, PeerId, PrepId, RegionTable, Rows,
    SectionIndex, Subject, XferId, MAX_BACKENDS,
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

/// Which agent a prepared list belongs to, and the peer generation it was built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrepSide {
    /// Local regions.
    Local,
    /// A peer's regions, resolved against generation `generation`.
    Peer {
        /// The peer.
        peer: PeerId,
        /// Its generation at prep time.
        generation: u32,
    },
}

/// One resolved descriptor of a prepared list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrepEntry {
    /// The descriptor.
    pub desc: Desc,
    /// Local: the covering region's handle as a tag. Peer: the region token for the
    /// first backend slot of the list's mask.
    pub target: u64,
}

/// Prepared lists. Columns indexed by row.
#[derive(Default)]
pub struct PrepTable {
    pub(crate) rows: Rows<PrepId>,
    /// Local or a peer (with generation).
    pub(crate) sides: Vec<PrepSide>,
    /// Memory kind.
    pub(crate) kinds: Vec<MemKind>,
    /// Backend slots that cover every descriptor.
    pub(crate) masks: Vec<BackendMask>,
    /// Resolved descriptors.
    pub(crate) entries: Vec<Vec<PrepEntry>>,
    /// Reusable entry vectors.
    pub(crate) pool: Vec<Vec<PrepEntry>>,
}

/// Request telemetry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Telemetry {
    /// When the last post started.
    pub start: Option<Instant>,
    /// Time spent in the post call (dispatch to the backend).
    pub post_duration: Duration,
    /// Time from post to completion (zero while in progress).
    pub xfer_duration: Duration,
    /// Bytes moved per post.
    pub total_bytes: u64,
    /// Descriptors after merging.
    pub desc_count: u64,
    /// Descriptors before merging.
    pub desc_count_unmerged: u64,
}

/// State of a request row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XferState {
    /// Never posted.
    NotPosted,
    /// Posted, completion pending.
    InProgress,
    /// Last post succeeded.
    Done,
    /// Last post failed.
    Failed(Error),
}

/// Transfer requests. Columns indexed by row.
#[derive(Default)]
pub struct XferTable {
    pub(crate) rows: Rows<XferId>,
    /// Direction.
    pub(crate) ops: Vec<Op>,
    /// Chosen backend slot.
    pub(crate) slots: Vec<u8>,
    /// Target.
    pub(crate) endpoints: Vec<Endpoint>,
    /// Peer generation the request was built against (0 for local).
    pub(crate) generations: Vec<u32>,
    /// (local kind, remote kind).
    pub(crate) kinds: Vec<(MemKind, MemKind)>,
    /// Merged ranges.
    pub(crate) ranges: Vec<Vec<Range>>,
    /// Notification payload (empty vec + `has_notif` false = none).
    pub(crate) notifs: Vec<Vec<u8>>,
    /// Whether the request carries a notification.
    pub(crate) has_notif: Vec<bool>,
    /// Lifecycle state.
    pub(crate) states: Vec<XferState>,
    /// Telemetry.
    pub(crate) telemetry: Vec<Telemetry>,
    /// Reusable range vectors.
    pub(crate) range_pool: Vec<Vec<Range>>,
    /// Reusable notification buffers.
    pub(crate) notif_pool: Vec<Vec<u8>>,
}

/// Peers. Columns indexed by row.
#[derive(Default)]
pub struct PeerTable {
    pub(crate) rows: Rows<PeerId>,
    /// Agent name.
    pub(crate) names: Vec<String>,
    /// Bumped by every invalidation and every reload with new content.
    pub(crate) generations: Vec<u32>,
    /// The loaded metadata, if any.
    pub(crate) views: Vec<Option<Arc<dyn PeerView>>>,
    /// For each local backend slot, the peer's backend index of the same type.
    pub(crate) slot_maps: Vec<[Option<u8>; MAX_BACKENDS]>,
    /// Local backend slots that accepted the peer.
    pub(crate) loaded: Vec<BackendMask>,
    /// Name → handle.
    pub(crate) by_name: HashMap<String, PeerId>,
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
    /// Section index per backend slot and memory kind.
    pub(crate) sections: Vec<[SectionIndex; 5]>,
    /// Prepared lists.
    pub(crate) preps: PrepTable,
    /// Transfer requests.
    pub(crate) xfers: XferTable,
    /// Peers.
    pub(crate) peers: PeerTable,
    /// Completion sink shared by all backends.
    pub(crate) completions: Completions,
    /// Per-flush scratch.
    pub(crate) arena: bumpalo::Bump,
}

impl World {
    /// An empty world for agent `name`.
    pub fn new(name: &str, bounds: Bounds) -> World {
        let xfers = bounds.xfers_max.min(1 << 14);
        World {
            name: name.to_string(),
            backends: BackendSlots {
                backends: (0..MAX_BACKENDS).map(|_| None).collect(),
                caps: vec![None; MAX_BACKENDS],
                ..BackendSlots::default()
            },
            regions: RegionTable::with_capacity(bounds.regions_max.min(1 << 12)),
            sections: (0..MAX_BACKENDS).map(|_| Default::default()).collect(),
            preps: PrepTable::default(),
            xfers: XferTable::default(),
            peers: PeerTable::default(),
            completions: Completions::with_capacity(xfers),
            arena: bumpalo::Bump::with_capacity(64 * 1024),
            bounds,
        }
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
        let id = self.backends.keys.insert(slot as u8);
        self.backends.ids[slot] = Some(id);
        self.backends.caps[slot] = Some(backend.capabilities());
        self.backends.backends[slot] = Some(backend);
        Ok(id)
    }

    /// Slot of backend `id`.
    pub fn backend_slot(&self, id: BackendId) -> Result<usize, Error> {
        self.backends
            .keys
            .get(id)
            .map(|&s| usize::from(s))
            .ok_or_else(|| Error::not_found(Subject::Backend(id)))
    }

    /// The backend with handle `id`.
    pub fn backend(&self, id: BackendId) -> Result<&dyn Backend, Error> {
        let slot = self.backend_slot(id)?;
        Ok(self.backends.backends[slot].as_deref().expect("slot of a live id is filled"))
    }

    /// The backend with handle `id`, mutably.
    pub fn backend_mut(&mut self, id: BackendId) -> Result<&mut (dyn Backend + 'static), Error> {
        let slot = self.backend_slot(id)?;
        Ok(self.backends.backends[slot].as_deref_mut().expect("slot of a live id is filled"))
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
        self.peers.by_name.get(name).copied()
    }

    /// Agent name of a peer.
    pub fn peer_name(&self, peer: PeerId) -> Result<&str, Error> {
        let row = self.peers.rows.row(peer).ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        Ok(&self.peers.names[row])
    }

    /// Current metadata view and generation of a peer.
    pub fn peer_view(&self, peer: PeerId) -> Result<(Option<&Arc<dyn PeerView>>, u32), Error> {
        let row = self.peers.rows.row(peer).ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        Ok((self.peers.views[row].as_ref(), self.peers.generations[row]))
    }

    /// Telemetry of a request.
    pub fn telemetry(&self, xfer: XferId) -> Result<Telemetry, Error> {
        let row = self.xfers.rows.row(xfer).ok_or_else(|| Error::not_found(Subject::Xfer(xfer)))?;
        let t = self.xfers.telemetry[row];
        if !self.bounds.telemetry || t.start.is_none() {
            return Err(Error::NoTelemetry { xfer });
        }
        Ok(t)
    }

    /// State of a request.
    pub fn xfer_state(&self, xfer: XferId) -> Result<&XferState, Error> {
        let row = self.xfers.rows.row(xfer).ok_or_else(|| Error::not_found(Subject::Xfer(xfer)))?;
        Ok(&self.xfers.states[row])
    }

    /// Number of live requests, prepared lists, regions and peers.
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        (
            self.xfers.rows.len(),
            self.preps.rows.len(),
            self.regions.len(),
            self.peers.rows.len(),
        )
    }

    /// Number of merged ranges of a request.
    pub fn xfer_range_count(&self, xfer: XferId) -> Result<usize, Error> {
        let row = self.xfers.rows.row(xfer).ok_or_else(|| Error::not_found(Subject::Xfer(xfer)))?;
        Ok(self.xfers.ranges[row].len())
    }
}

impl World {
    /// Capabilities of the backend in `slot`.
    pub fn slot_capabilities(&self, slot: usize) -> Option<Capabilities> {
        self.backends.caps.get(slot).copied().flatten()
    }

    /// Connection info of the backend in `slot`.
    pub fn slot_conn_info(&self, slot: usize) -> Option<Vec<u8>> {
        self.backends.backends.get(slot)?.as_ref().map(|b| b.conn_info())
    }

    /// Slot of the backend in `id`'s position, with its handle.
    pub fn slot_id(&self, slot: usize) -> Option<BackendId> {
        self.backends.ids.get(slot).copied().flatten()
    }
}
