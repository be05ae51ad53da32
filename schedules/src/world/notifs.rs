//! Notifications: standalone sends and draining inbound ones.

use ferry_backend_api::NotifSink;
use ferry_storage::{BackendMask, Endpoint, Error, PeerId, Subject, MAX_BACKENDS};

use super::World;

impl World {
    /// Send a standalone notification to a peer (`None` = to oneself) through the first
    /// backend that supports notifications and knows the peer.
    pub(crate) fn send_notification(
        &mut self,
        peer: Option<PeerId>,
        payload: &[u8],
    ) -> Result<(), Error> {
        if payload.len() > self.bounds.notif_len_max {
            return Err(Error::Capacity {
                what: "notification bytes",
                limit: self.bounds.notif_len_max,
            });
        }
        let (endpoint, mask) = match peer {
            None => (Endpoint::Local, BackendMask::ALL),
            Some(p) => {
                let row = self
                    .peers
                    .row(p)
                    .ok_or_else(|| Error::not_found(Subject::Peer(p)))?;
                if self.peers.views[row].is_none() {
                    return Err(Error::NotFound {
                        subject: Subject::PeerName(format!(
                            "{} (metadata invalidated)",
                            self.peers.names[row]
                        )),
                    });
                }
                (Endpoint::Peer(p), self.peers.loaded[row])
            }
        };
        let slot = (0..MAX_BACKENDS)
            .find(|&s| mask.contains(s) && self.backends.caps[s].is_some_and(|c| c.notifications))
            .ok_or_else(|| Error::NotSupported {
                backend: "agent".into(),
                what: "no backend that supports notifications reaches this peer".into(),
            })?;
        self.backends.backends[slot]
            .as_mut()
            .expect("slot is filled")
            .notify(endpoint, payload)
    }

    /// Hand every inbound notification of every backend to `sink`.
    pub(crate) fn drain_notifications(&mut self, sink: &mut dyn NotifSink) -> usize {
        let mut n = 0;
        for (_, backend) in self.live_backends() {
            n += backend.drain_notifications(sink);
        }
        n
    }
}
