//! Peers: loading a peer's metadata view into the table and the backends, generations,
//! invalidation.
//!
//! Peers come and go for the life of an agent: an invalidated peer's row is freed (its
//! handle goes stale; a later load of the same agent makes a new peer), so the table
//! holds only live peers and loading and invalidating any number of distinct agents one
//! after another keeps it flat. Requests and prepared lists built on a peer carry its
//! handle and generation; a stale handle or a moved-on generation fails them with
//! not-found before a backend sees an address.

use std::sync::Arc;

use ferry_backend_api::{PeerRegions, Range, RemoteAgent};
use ferry_storage::{
    handle_to_tag, BackendMask, Desc, Endpoint, Error, MemKind, PeerId, RegionId, Subject,
    MAX_BACKENDS,
};

use super::{preps::PrepEntry, PeerView, World, XferState};
use crate::logging::BackendNames;

/// Fewest descriptors a load readies the request path for ([`World::ready_requests`]).
const READY_DESCS_MIN: usize = 1024;
/// Most descriptors a load readies the request path for.
const READY_DESCS_MAX: usize = 16 * 1024;

/// Ready the `lists` lists a pool hands out next (its last ones; made if missing) for
/// `n` items each: allocated and written once, so their pages are faulted in, then
/// emptied. Two prepared lists (a request's local and remote sides) take two distinct
/// lists, hence `lists`. The pool also gets room to take back as many lists as it
/// holds and as many again (a release pushes a list whether or not its request took
/// one from the pool).
fn ready_pool<T: Clone>(pool: &mut Vec<Vec<T>>, lists: usize, n: usize, fill: T) {
    if pool.len() < lists {
        pool.resize_with(lists, Vec::new);
    }
    pool.reserve(lists);
    let next = pool.len() - lists;
    for list in &mut pool[next..] {
        list.clear();
        list.resize(n, fill.clone());
        list.clear();
    }
}

/// `; refused by UCX: <error>` when some backend refused a peer that others took.
struct Refused<'a>(&'a World, BackendMask, Option<&'a Error>);

impl std::fmt::Display for Refused<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.2 {
            Some(e) if !self.1.is_empty() => {
                write!(
                    f,
                    "; refused by {} ({e})",
                    BackendNames::new(self.0, self.1)
                )
            }
            _ => Ok(()),
        }
    }
}

/// How a load changes a known peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadKind {
    /// New content that replaces what was known: the generation moves on and requests
    /// built on the old metadata fail with not-found.
    Replace,
    /// The same or additional content (idempotent reload, partial metadata that
    /// accumulates): the generation stays.
    Extend,
}

ferry_storage::table! {
    /// Loaded peers, one row per peer.
    pub struct PeerTable[PeerId] / PeerRow {
        /// Agent name, indexed by row.
        pub(crate) names: String,
        /// Bumped by every reload with new content, indexed by row.
        pub(crate) generations: u32,
        /// The loaded metadata, indexed by row (`None` only while a load is under way).
        pub(crate) views: Option<Arc<dyn PeerView>>,
        /// For each local backend slot, the peer's backend index of the same type,
        /// indexed by row.
        pub(crate) slot_maps: [Option<u8>; MAX_BACKENDS],
        /// Local backend slots that accepted the peer, indexed by row.
        pub(crate) loaded: BackendMask,
    }
}

impl World {
    /// Load (or refresh) peer `name` with `view`. Every local backend whose type the
    /// peer published takes the peer's connection info and regions; the load succeeds if
    /// at least one does (or if the view carries no connection info at all). Metadata
    /// naming this agent itself is refused.
    ///
    /// # Safety
    ///
    /// `view` must describe regions that agent `name` really registered (metadata
    /// validated by the codec, as the engine's loader does): backends will move bytes
    /// to and from the addresses it names.
    // Reason: declares the caller's promise only; no unsafe operation here.
    #[allow(unsafe_code)]
    pub unsafe fn load_peer(
        &mut self,
        name: &str,
        view: Arc<dyn PeerView>,
        kind: LoadKind,
    ) -> Result<PeerId, Error> {
        if name == self.name {
            return Err(Error::NotAllowed {
                subject: Subject::PeerName(name.to_string()),
                reason: "the metadata names this agent itself; an agent does not load its own metadata as a peer".into(),
            });
        }
        let (peer, row, is_new) = match self.peer_names.get(name) {
            Some(&p) => (
                p,
                self.peers.row(p).expect("name index points at live rows"),
                false,
            ),
            None => {
                if self.peers.len() >= self.bounds.peers_max {
                    return Err(Error::Capacity {
                        what: "peers",
                        limit: self.bounds.peers_max,
                    });
                }
                let p = self.peers.insert(PeerRow {
                    names: name.to_string(),
                    generations: 1,
                    views: None,
                    slot_maps: [None; MAX_BACKENDS],
                    loaded: BackendMask::EMPTY,
                });
                self.peer_names.insert(name.to_string(), p);
                (p, self.peers.row(p).expect("just inserted"), true)
            }
        };
        let replace = kind == LoadKind::Replace && !is_new;
        let mut ended = 0;
        if replace {
            ended = self.unload_everywhere(peer, row, "reloaded with new content");
            self.peers.generations[row] = self.peers.generations[row].wrapping_add(1);
        }
        let mut slot_map = [None; MAX_BACKENDS];
        let mut loaded = if replace {
            BackendMask::EMPTY
        } else {
            self.peers.loaded[row]
        };
        let mut first_error = None;
        let mut refused = BackendMask::EMPTY;
        let mut any_conn = false;
        let ready_ranges = self.ready_size(view.region_count());
        for (slot, entry) in slot_map.iter_mut().enumerate() {
            let Some(name_here) = self.backends.backends[slot].as_ref().map(|b| b.name()) else {
                continue;
            };
            let Some(index) = view.backend_index(name_here) else {
                continue;
            };
            let standby = self.standby(peer, slot, loaded, &*view);
            let backend = self.backends.backends[slot]
                .as_mut()
                .expect("checked just above");
            *entry = Some(index);
            let conn_info = view.conn_info(index).unwrap_or(&[]);
            any_conn |= !conn_info.is_empty();
            let regions: Arc<dyn PeerRegions> = view.clone();
            let remote = RemoteAgent {
                name,
                conn_info,
                regions,
                standby,
                ready_ranges,
            };
            match backend.load_remote(peer, remote) {
                Ok(()) => loaded.insert(slot),
                Err(e) => {
                    refused.insert(slot);
                    first_error.get_or_insert(e);
                }
            }
        }
        if loaded.is_empty() && (any_conn || is_new) {
            let error = first_error.unwrap_or_else(|| Error::NotSupported {
                backend: "agent".into(),
                what: format!("peer '{name}' published no backend type this agent has").into(),
            });
            if is_new {
                self.remove_peer_row(peer);
            }
            // The loader logs the failure (it also sees those before this point).
            return Err(error);
        }
        log::debug!(
            "agent '{}': metadata of peer '{name}' {} (generation {:#x}, {} region(s)); \
             taken by {}{}",
            self.name,
            match (is_new, replace) {
                (true, _) => "loaded".to_string(),
                (false, true) =>
                    format!("reloaded with new content ({ended} request(s) in flight to it ended)"),
                (false, false) => "extended (partial metadata accumulates)".to_string(),
            },
            view.md_generation(),
            view.region_count(),
            BackendNames::new(self, loaded),
            Refused(self, refused, first_error.as_ref()),
        );
        self.peers.views[row] = Some(view);
        self.peers.slot_maps[row] = slot_map;
        self.peers.loaded[row] = loaded;
        self.ready_requests(ready_ranges);
        Ok(peer)
    }

    /// Descriptors a load readies the request path for, given the peer's `regions`:
    /// one per region, at least [`READY_DESCS_MIN`] and at most [`READY_DESCS_MAX`]
    /// (nor more than a list may hold). The backends get it as
    /// [`RemoteAgent::ready_ranges`].
    fn ready_size(&self, regions: usize) -> usize {
        regions
            .clamp(READY_DESCS_MIN, READY_DESCS_MAX)
            .min(self.bounds.descs_per_list_max)
    }

    /// Ready the request path, at a load, for a request of `n` descriptors
    /// ([`World::ready_size`]): a pooled range list, two prepared-list entry lists and
    /// a pin list of that many, allocated and touched, and a notification buffer in its
    /// pool (so the pools themselves have room for what a release returns). The first
    /// request after the load then takes memory a second would find, instead of growing
    /// and faulting in its own (issue 25: the first request no slower than the second).
    /// Grows only: a later load of a smaller peer does nothing. Costs 128 bytes per
    /// descriptor (range 56, two entries 64, pin 8): 128 KiB at the minimum, 2 MiB at
    /// the most; the agent's scratch command buffer adds 48 bytes per descriptor and
    /// the backends their own (UCX's rkey list and LOOPBACK's pin list 16 each). An
    /// agent that loaded nothing pays nothing.
    fn ready_requests(&mut self, n: usize) {
        if n <= self.ready_descs {
            return;
        }
        self.ready_descs = n;
        ready_pool(&mut self.pools.ranges, 1, n, Range::default());
        let entry = PrepEntry {
            desc: Desc::default(),
            target: 0,
        };
        ready_pool(&mut self.pools.entries, 2, n, entry);
        // A released list returns its (for a plain list, empty) runs too.
        self.pools.runs.reserve(2);
        ready_pool(&mut self.pools.pins, 1, n, RegionId::default());
        if self.pools.notifs.is_empty() {
            self.pools.notifs.push(Vec::new());
        }
    }

    /// Descriptors the request path was readied for by the loads so far (each load
    /// readies it for one descriptor per region the peer published, within fixed
    /// bounds; 0 before the first): the caller's command buffer can be readied for as
    /// many ([`crate::CommandBuffer::ready_descs`]).
    pub fn ready_descs(&self) -> usize {
        self.ready_descs
    }

    /// Whether backend `slot` is on standby for `peer` ([`RemoteAgent::standby`]): a
    /// slot before it in `loaded` reaches every region the peer published for that
    /// slot, published at least as many regions there as for `slot`, and `slot` holds
    /// no local device-memory region (the earlier one could not cover a list of it).
    /// One pass over the peer's regions per earlier slot, at load time only.
    fn standby(&self, peer: PeerId, slot: usize, loaded: BackendMask, view: &dyn PeerView) -> bool {
        let Some(here) = self.backends.backends[slot].as_ref() else {
            return false;
        };
        if !loaded.iter().any(|e| e < slot)
            || !self.sections[slot][MemKind::Vram as usize].is_empty()
        {
            return false;
        }
        let count = |name: &str| {
            let mut n = 0usize;
            view.for_each_region(name, &mut |_, _, _| n += 1);
            n
        };
        let wanted = count(here.name());
        loaded.iter().filter(|&e| e < slot).any(|e| {
            let Some(earlier) = self.backends.backends[e].as_ref() else {
                return false;
            };
            let (mut published, mut reached) = (0usize, true);
            view.for_each_region(earlier.name(), &mut |token, _, _| {
                published += 1;
                reached = reached && earlier.reaches(peer, token);
            });
            reached && published >= wanted
        })
    }

    /// Forget a peer: backends drop its keys and endpoints, requests in flight to it
    /// report not-found and drain until their backend confirms the end, and its row is
    /// freed (the handle goes stale; a later load of the same agent makes a new peer).
    pub(crate) fn invalidate_peer(&mut self, peer: PeerId) -> Result<(), Error> {
        let row = self
            .peers
            .row(peer)
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        let ended = self.unload_everywhere(peer, row, "invalidated");
        log::debug!(
            "agent '{}': peer '{}' invalidated: dropped by {}; {ended} request(s) in flight \
             to it ended",
            self.name,
            self.peers.names[row],
            BackendNames::new(self, self.peers.loaded[row]),
        );
        self.remove_peer_row(peer);
        Ok(())
    }

    /// Establish the endpoint to `peer` now on every backend that loaded it (NIXL's
    /// `makeConnection`); otherwise on load or first use, as each backend does.
    pub(crate) fn connect_peer(&mut self, peer: PeerId) -> Result<(), Error> {
        let row = self
            .peers
            .row(peer)
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        let mut result = Ok(());
        for slot in self.peers.loaded[row].iter() {
            if let Some(b) = self.backends.backends[slot].as_mut() {
                if let Err(e) = b.connect(peer) {
                    result = result.and(Err(e));
                }
            }
        }
        match &result {
            Ok(()) => log::debug!(
                "agent '{}': connected to peer '{}' through {}",
                self.name,
                self.peers.names[row],
                BackendNames::new(self, self.peers.loaded[row]),
            ),
            Err(e) => log::debug!(
                "agent '{}': connecting to peer '{}' failed: {e}",
                self.name,
                self.peers.names[row],
            ),
        }
        result
    }

    /// End the requests in flight to `peer` (they report not-found now; those whose
    /// backend cannot confirm a cancel drain until its completion) and make every
    /// backend drop the peer. Returns how many requests it ended.
    fn unload_everywhere(&mut self, peer: PeerId, row: usize, why: &str) -> usize {
        let mut ended = 0;
        for x in 0..self.xfers.len() {
            if self.xfers.endpoints[x] != Endpoint::Peer(peer)
                || self.xfers.states[x] != XferState::InProgress
            {
                continue;
            }
            let error = Error::NotFound {
                subject: Subject::PeerName(format!(
                    "{} (metadata {why} while the request was in flight)",
                    self.peers.names[row]
                )),
            };
            let slot = usize::from(self.xfers.slots[x]);
            let confirmed = self.backends.backends[slot]
                .as_mut()
                .is_some_and(|b| matches!(b.cancel(handle_to_tag(self.xfers.key(x))), Ok(true)));
            self.xfers.states[x] = if confirmed {
                XferState::Failed(error)
            } else {
                XferState::Draining(error)
            };
            ended += 1;
        }
        for slot in self.peers.loaded[row].iter() {
            if let Some(b) = self.backends.backends[slot].as_mut() {
                b.unload_remote(peer);
            }
        }
        ended
    }

    fn remove_peer_row(&mut self, peer: PeerId) {
        if let Some(row) = self.peers.remove(peer) {
            self.peer_names.remove(&row.names);
        }
    }

    /// Slots the peer table's handle map holds (live and free). It stays flat while
    /// peers come and go.
    pub fn peer_slots(&self) -> usize {
        self.peers.slot_capacity()
    }
}
