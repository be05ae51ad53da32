//! Notifications: the bounded inbox, sending after the data, standalone ones.

use super::*;

/// Inbound notifications waiting for `drain_notifications`. Storage is reused, so
/// steady-state receiving does not allocate.
///
/// Bounded by entries and bytes (parameters `notif_queue`, `notif_queue_bytes`): a
/// notification that does not fit is refused whole — a local sender gets a typed error
/// (`Capacity` for a standalone one, an `ENOBUFS` failure for one attached to a
/// transfer); one from a peer cannot be answered (UCX active messages have no reply), so
/// it is counted (`UcxBackend::refused_notifications`) and logged at the next drain. A
/// notification that was accepted stays until `drain` hands it over.
///
/// A notification this agent attaches to a request to itself is *reserved* when the
/// request is posted (entries and bytes counted against the bounds, `reserve`), so a
/// post is refused up front (`Capacity`, nothing moved) rather than failed after its
/// data moved; the reservation is consumed when the data is in place
/// (`push_reserved`, which cannot fail) or returned if the request fails first.
pub(crate) struct Inbox {
    pub(super) bytes: Vec<u8>,
    /// (start in `bytes`, sender name length, payload length)
    pub(super) entries: Vec<(usize, u32, u32)>,
    entries_max: usize,
    bytes_max: usize,
    /// Entries and bytes reserved by posted requests to this agent itself.
    reserved_entries: usize,
    reserved_bytes: usize,
}

impl Inbox {
    /// An empty inbox holding at most `entries_max` notifications of `bytes_max` bytes
    /// (sender names included) in all.
    pub(crate) fn new(entries_max: usize, bytes_max: usize) -> Inbox {
        Inbox {
            bytes: Vec::new(),
            entries: Vec::new(),
            entries_max,
            bytes_max,
            reserved_entries: 0,
            reserved_bytes: 0,
        }
    }

    fn fits(&self, need: usize) -> bool {
        self.entries.len() + self.reserved_entries < self.entries_max
            && self
                .bytes
                .len()
                .saturating_add(self.reserved_bytes)
                .saturating_add(need)
                <= self.bytes_max
    }

    /// Reserve room for one notification of `need` bytes (sender name included);
    /// false if there is none.
    #[must_use]
    pub(crate) fn reserve(&mut self, need: usize) -> bool {
        if !self.fits(need) {
            return false;
        }
        self.reserved_entries += 1;
        self.reserved_bytes += need;
        true
    }

    /// Give back a reservation of `need` bytes that will not be used.
    pub(crate) fn unreserve(&mut self, need: usize) {
        self.reserved_entries = self.reserved_entries.saturating_sub(1);
        self.reserved_bytes = self.reserved_bytes.saturating_sub(need);
    }

    /// Store a notification whose room was reserved (never refused).
    pub(crate) fn push_reserved(&mut self, from: &[u8], payload: &[u8]) {
        self.unreserve(from.len() + payload.len());
        let stored = self.push(from, payload);
        debug_assert!(stored, "a reserved notification always fits");
    }

    /// The configured entry bound.
    pub(crate) fn entries_max(&self) -> usize {
        self.entries_max
    }

    /// Accept one notification; false (nothing stored) if it does not fit.
    #[must_use]
    pub(crate) fn push(&mut self, from: &[u8], payload: &[u8]) -> bool {
        let need = from.len() + payload.len();
        if !self.fits(need) {
            return false;
        }
        let start = self.bytes.len();
        self.bytes.extend_from_slice(from);
        self.bytes.extend_from_slice(payload);
        self.entries
            .push((start, from.len() as u32, payload.len() as u32));
        true
    }

    /// Hand every entry to `deliver` as (sender, payload) and forget them.
    pub(crate) fn drain(&mut self, mut deliver: impl FnMut(&str, &[u8])) -> usize {
        let count = self.entries.len();
        for &(start, name_len, payload_len) in &self.entries {
            let name_end = start + name_len as usize;
            let from = std::str::from_utf8(&self.bytes[start..name_end]).unwrap_or("<invalid>");
            deliver(from, &self.bytes[name_end..name_end + payload_len as usize]);
        }
        self.entries.clear();
        self.bytes.clear();
        count
    }
}

impl Core {
    /// Send the slot's notification (after its data is complete).
    pub(super) fn send_notif(&mut self, index: u32) {
        let peer = self.slots[index as usize].peer;
        let Some(peer) = peer else {
            // To oneself: straight into the inbox, the data is already in place, into
            // the room reserved at post.
            let slot = &mut self.slots[index as usize];
            debug_assert!(
                slot.reserved,
                "a notification to oneself is reserved at post"
            );
            slot.reserved = false;
            self.events
                .inbox
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_reserved(&self.agent_name, &slot.notif);
            self.finish(index);
            return;
        };
        let ep = match self.peer_ep(peer) {
            Ok((ep, _)) => ep,
            Err(_) => {
                self.slots[index as usize].failure =
                    Some(failure_of(ucs_status_t::UCS_ERR_NOT_CONNECTED, true, None));
                self.finish(index);
                return;
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.state = SlotState::WaitNotif;
        let mut param = request_param();
        param.op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_AM_SEND_FLAG_EAGER;
        param.cb.send = Some(on_op_done);
        param.user_data = self.cells.get(index * 2 + 1) as *const OpCell as *mut c_void;
        // SAFETY: ep live; header (our name) and payload (slot buffer) stay untouched until
        // the send completes: the slot is not reused before its notif cell reports.
        let request = unsafe {
            self.ucp.api().ucp_am_send_nbx(
                ep,
                NOTIF_AM_ID,
                self.agent_name.as_ptr() as *const c_void,
                self.agent_name.len(),
                slot.notif.as_ptr() as *const c_void,
                slot.notif.len(),
                &param,
            )
        };
        if !ucs_ptr_is_ptr(request) {
            self.notif_sent(index, ucs_ptr_status(request));
        }
    }

    pub(super) fn notif_sent(&mut self, index: u32, status: ucs_status_t) {
        let peer_gone = self.peer_gone(self.slots[index as usize].peer);
        let slot = &mut self.slots[index as usize];
        if status.is_err() && slot.failure.is_none() {
            slot.failure = Some(failure_of(status, peer_gone, None));
        }
        self.finish(index);
    }

    /// A standalone notification.
    pub(crate) fn notify(&mut self, endpoint: Endpoint, payload: &[u8]) -> Result<()> {
        if payload.len() > NOTIF_LEN_MAX {
            return Err(Error::invalid(
                Subject::Named("notification".into()),
                format!(
                    "{} bytes exceed the UCX limit of {NOTIF_LEN_MAX}",
                    payload.len()
                ),
            ));
        }
        let peer = match endpoint {
            Endpoint::Local => {
                let mut inbox = self.events.inbox.lock().unwrap_or_else(|e| e.into_inner());
                return if inbox.push(&self.agent_name, payload) {
                    Ok(())
                } else {
                    Err(Error::Capacity {
                        what: "UCX notification inbox (parameters notif_queue, notif_queue_bytes)",
                        limit: inbox.entries_max(),
                    })
                };
            }
            Endpoint::Peer(peer) => {
                self.peer_ep(peer)?;
                peer
            }
        };
        let index = self.take_slot().ok_or(Error::Capacity {
            what: "UCX requests in flight (parameter max_requests)",
            limit: self.slot_max,
        })?;
        let slot = &mut self.slots[index as usize];
        slot.tag = None;
        slot.peer = Some(peer);
        slot.failure = None;
        slot.has_notif = true;
        slot.notif.clear();
        slot.notif.extend_from_slice(payload);
        slot.next = NONE;
        slot.state = SlotState::WaitNotif;
        self.watch_started(peer, 1);
        self.send_notif(index);
        Ok(())
    }
}
