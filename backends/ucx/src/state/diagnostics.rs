//! Diagnostics: error texts, transport summaries of endpoints, counts.

use super::*;

pub(super) fn ucx_error(ucp: &Ucp, what: &str, status: ucs_status_t) -> Error {
    Error::Backend {
        backend: BACKEND.into(),
        errno: errno_of(status),
        desc: None,
        detail: format!("{what}: {} ({})", ucp.status_string(status), status.0).into(),
    }
}

/// The closest errno for a UCS status (so error texts do not mislead).
pub(crate) fn errno_of(status: ucs_status_t) -> i32 {
    match status {
        ucs_status_t::UCS_OK | ucs_status_t::UCS_INPROGRESS => 0,
        ucs_status_t::UCS_ERR_CONNECTION_RESET => libc::ECONNRESET,
        ucs_status_t::UCS_ERR_ENDPOINT_TIMEOUT | ucs_status_t::UCS_ERR_TIMED_OUT => libc::ETIMEDOUT,
        ucs_status_t::UCS_ERR_UNREACHABLE => libc::EHOSTUNREACH,
        ucs_status_t::UCS_ERR_NOT_CONNECTED => libc::ENOTCONN,
        ucs_status_t::UCS_ERR_REJECTED => libc::ECONNREFUSED,
        ucs_status_t::UCS_ERR_CANCELED => libc::ECANCELED,
        ucs_status_t::UCS_ERR_NO_MEMORY => libc::ENOMEM,
        ucs_status_t::UCS_ERR_INVALID_PARAM | ucs_status_t::UCS_ERR_INVALID_ADDR => libc::EINVAL,
        ucs_status_t::UCS_ERR_UNSUPPORTED | ucs_status_t::UCS_ERR_NOT_IMPLEMENTED => libc::ENOTSUP,
        ucs_status_t::UCS_ERR_BUSY => libc::EBUSY,
        ucs_status_t::UCS_ERR_NO_RESOURCE => libc::EAGAIN,
        ucs_status_t::UCS_ERR_NO_DEVICE => libc::ENODEV,
        _ => libc::EIO,
    }
}

impl Core {
    /// A one-line summary of the lanes an endpoint uses, from `ucp_ep_print_info`.
    pub(super) fn ep_transports(&self, ep: ucp_ep_h) -> String {
        let info = self.ep_info(ep);
        summarize_lanes(&info)
    }

    /// The full `ucp_ep_print_info` text of an endpoint.
    pub(super) fn ep_info(&self, ep: ucp_ep_h) -> String {
        let mut buffer: *mut libc::c_char = ptr::null_mut();
        let mut size: libc::size_t = 0;
        // SAFETY: open_memstream allocates a growing buffer; both out-pointers are valid
        // until fclose, after which we copy and free the buffer.
        unsafe {
            let stream = libc::open_memstream(&mut buffer, &mut size);
            if stream.is_null() {
                return String::new();
            }
            self.ucp.api().ucp_ep_print_info(ep, stream as *mut FILE);
            libc::fclose(stream);
            let text = if buffer.is_null() {
                String::new()
            } else {
                String::from_utf8_lossy(std::slice::from_raw_parts(buffer as *const u8, size))
                    .into_owned()
            };
            libc::free(buffer as *mut c_void);
            text
        }
    }

    /// Transport summary of the endpoint to `endpoint` (creating it if needed).
    pub(crate) fn endpoint_info(&mut self, endpoint: Endpoint) -> Result<(String, String)> {
        let ep = match endpoint {
            Endpoint::Local => self.local_ep()?,
            Endpoint::Peer(peer) => self.peer_ep(peer)?.0,
        };
        let info = self.ep_info(ep);
        Ok((summarize_lanes(&info), info))
    }

    /// Whether the peer's endpoint has been reported dead (for tests and diagnostics).
    pub(crate) fn peer_down(&self, peer: PeerId) -> Option<bool> {
        self.peers.get(&peer).map(|s| s.down.is_some())
    }

    pub(crate) fn peer_connection(&self, peer: PeerId) -> Option<(bool, usize)> {
        self.peers
            .get(&peer)
            .map(|s| (!s.ep.is_null(), s.rkeys.len()))
    }

    /// Counters of the batched-WRITE protocol.
    pub(crate) fn batch_counts(&self) -> crate::BatchCounts {
        let b = &self.events.batch;
        crate::BatchCounts {
            refused: b.refused.load(Ordering::Relaxed),
            dropped_acks: b.dropped_acks.load(Ordering::Relaxed),
            stale_acks: self.am.stale_acks,
            sent: self.am.sent,
            unsent_acks: b.unsent_acks.load(Ordering::Relaxed),
            allocated_acks: b.allocated_acks.load(Ordering::Relaxed),
            allocated_replies: b.allocated_replies.load(Ordering::Relaxed),
            grown_messages: self.am.grown,
            pongs: b.pongs.load(Ordering::Relaxed),
            pings: b.pings.load(Ordering::Relaxed),
            rndv_received: b.rndv_received.load(Ordering::Relaxed),
            rndv_failed: b.rndv_failed.load(Ordering::Relaxed),
            rndv_refused: b.rndv_refused.load(Ordering::Relaxed),
            rndv_in_flight: b.rndv_in_flight(),
            in_flight: self.am.in_flight(),
        }
    }

    /// Whether small WRITEs to `peer` are batched (None: unknown peer or no endpoint).
    pub(crate) fn batches_to(&self, peer: PeerId) -> Option<bool> {
        self.peers
            .get(&peer)
            .filter(|s| !s.ep.is_null())
            .map(|s| s.am_msg_bytes > 0)
    }

    /// Number of requests in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.slots.len() - self.free_slots.len()
    }
}

/// Reduce `ucp_ep_print_info` text to the transports of its lanes, e.g.
/// `rma_bw: posix/memory, cma/memory; am: posix/memory`.
pub(crate) fn summarize_lanes(info: &str) -> String {
    // Lines look like: "#                lane[0]:  2:posix/memory.0 md[2]  -> ... am am_bw#0"
    let mut lanes: Vec<String> = Vec::new();
    for line in info.lines() {
        let Some(rest) = line.split("lane[").nth(1) else {
            continue;
        };
        let Some((_, after)) = rest.split_once("]:") else {
            continue;
        };
        let mut words = after.split_whitespace();
        let Some(tl) = words.next() else { continue };
        let transport = tl.split_once(':').map_or(tl, |(_, t)| t);
        let transport = transport.rsplit_once('.').map_or(transport, |(t, _)| t);
        let roles: Vec<&str> = after
            .split_whitespace()
            .filter(|w| {
                [
                    "am",
                    "rma",
                    "rma_bw",
                    "amo",
                    "am_bw",
                    "rkey_ptr",
                    "keepalive",
                    "tag",
                    "cm",
                ]
                .iter()
                .any(|r| w.split('#').next() == Some(r))
            })
            .collect();
        lanes.push(format!("{transport} [{}]", roles.join(" ")));
    }
    if lanes.is_empty() {
        "unknown transports".to_string()
    } else {
        lanes.join(", ")
    }
}
