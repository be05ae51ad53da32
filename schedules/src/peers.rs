//! Peer bookkeeping: loading a peer's metadata view into the tables and the backends,
//! generations, invalidation.

use std::sync::Arc;

use ferry_backend_api::{PeerRegions, RemoteAgent};
use ferry_storage::{handle_to_tag, BackendMask, Endpoint, Error, PeerId, Subject, MAX_BACKENDS};

use crate::world::{PeerView, World, XferState};

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

impl World {
    /// Load (or refresh) peer `name` with `view`. Every local backend whose type the
    /// peer published takes the peer's connection info and regions; the load succeeds if
    /// at least one does (or if the view carries no connection info at all).
    pub fn load_peer(&mut self, name: &str, view: Arc<dyn PeerView>, kind: LoadKind) -> Result<PeerId, Error> {
        let (peer, row, is_new) = match self.peers.by_name.get(name) {
            Some(&p) => (p, self.peers.rows.row(p).expect("name index points at live rows"), false),
            None => {
                if self.peers.rows.len() >= self.bounds.peers_max {
                    return Err(Error::Capacity { what: "peers", limit: self.bounds.peers_max });
                }
                let (p, row) = self.peers.rows.push();
                self.peers.names.push(name.to_string());
                self.peers.generations.push(1);
                self.peers.views.push(None);
                self.peers.slot_maps.push([None; MAX_BACKENDS]);
                self.peers.loaded.push(BackendMask::EMPTY);
                self.peers.by_name.insert(name.to_string(), p);
                (p, row, true)
            }
        };
        let replace = kind == LoadKind::Replace && !is_new;
        if replace {
            self.unload_everywhere(peer, row, "reloaded with new content");
            self.peers.generations[row] = self.peers.generations[row].wrapping_add(1);
        }
        let mut slot_map = [None; MAX_BACKENDS];
        let mut loaded = if replace { BackendMask::EMPTY } else { self.peers.loaded[row] };
        let mut first_error = None;
        let mut any_conn = false;
        for slot in 0..MAX_BACKENDS {
            let Some(backend) = self.backends.backends[slot].as_mut() else { continue };
            let Some(index) = view.backend_index(backend.name()) else { continue };
            slot_map[slot] = Some(index);
            let conn_info = view.conn_info(index).unwrap_or(&[]);
            any_conn |= !conn_info.is_empty();
            let regions: Arc<dyn PeerRegions> = view.clone();
            let remote = RemoteAgent { name, conn_info, regions };
            match backend.load_remote(peer, remote) {
                Ok(()) => loaded.insert(slot),
                Err(e) => {
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
            return Err(error);
        }
        self.peers.views[row] = Some(view);
        self.peers.slot_maps[row] = slot_map;
        self.peers.loaded[row] = loaded;
        Ok(peer)
    }

    /// Forget a peer's metadata: backends drop its keys and endpoints, its generation
    /// moves on, in-flight requests to it fail. The peer handle stays valid so a later
    /// load of the same agent reuses it.
    pub fn invalidate_peer(&mut self, peer: PeerId) -> Result<(), Error> {
        let row = self.peers.rows.row(peer).ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        self.unload_everywhere(peer, row, "invalidated");
        self.peers.generations[row] = self.peers.generations[row].wrapping_add(1);
        self.peers.views[row] = None;
        self.peers.loaded[row] = BackendMask::EMPTY;
        Ok(())
    }

    fn unload_everywhere(&mut self, peer: PeerId, row: usize, why: &str) {
        // Requests in flight to the peer end now; a late completion is ignored.
        for x in 0..self.xfers.rows.len() {
            if self.xfers.endpoints[x] == Endpoint::Peer(peer) && self.xfers.states[x] == XferState::InProgress {
                let slot = usize::from(self.xfers.slots[x]);
                if let Some(b) = self.backends.backends[slot].as_mut() {
                    let _ = b.cancel(handle_to_tag(self.xfers.rows.key(x)));
                }
                self.xfers.states[x] = XferState::Failed(Error::NotFound {
                    subject: Subject::PeerName(format!("{} (metadata {why} while the request was in flight)", self.peers.names[row])),
                });
            }
        }
        for slot in self.peers.loaded[row].iter() {
            if let Some(b) = self.backends.backends[slot].as_mut() {
                b.unload_remote(peer);
            }
        }
    }

    fn remove_peer_row(&mut self, peer: PeerId) {
        if let Some(row) = self.peers.rows.remove(peer) {
            let name = self.peers.names.swap_remove(row);
            self.peers.by_name.remove(&name);
            self.peers.generations.swap_remove(row);
            self.peers.views.swap_remove(row);
            self.peers.slot_maps.swap_remove(row);
            self.peers.loaded.swap_remove(row);
        }
    }
}
