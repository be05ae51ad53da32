//! The per-endpoint progress deadline: a peer whose endpoint has requests in flight and
//! has completed none of them for `peer_timeout_ms` of *progressed* time is declared
//! unreachable — its endpoint is force-closed, its requests fail with remote-disconnect
//! (errno `ETIMEDOUT`), and later posts to it fail the same way until a reconnect
//! (`Backend::connect`, the engine's `make_connection`) or a reload with new connection
//! info.
//!
//! # Why not only UCX's own detection
//!
//! With peer error handling UCX reports an endpoint whose transport failed, but over TCP
//! a link that silently went down leaves unacknowledged data in the kernel, which
//! retransmits for many minutes before it gives up (UCX's keepalive only probes idle
//! endpoints). So the bound is kept here, whatever the store and whether or not anyone
//! polls the exchange: only the backend's progress (the executor's progress phase — what
//! `check` runs — or the progress thread) is needed.
//!
//! # Progressed time
//!
//! The clock is virtual: each pump advances it by the time since the previous pump, but
//! by at most [`GAP_COUNTED_MAX`]. A caller that stops progressing for a minute and then
//! checks does not see its requests time out for a pause that was its own (UCX over TCP
//! only moves data while progressed). The progress thread wakes at least once a second,
//! so with it the clock runs at wall-clock speed.
//!
//! # Cost
//!
//! One `Instant::now()` per pump while any peer request is in flight and one when an idle
//! endpoint gets a batch; a completion reads the cached clock. The scan over peers runs
//! at most every [`SCAN_INTERVAL`] of virtual time.

use super::*;

/// Largest pause between two pumps that counts towards a deadline.
pub(super) const GAP_COUNTED_MAX: Duration = Duration::from_secs(2);
/// Largest virtual time between two scans for expired deadlines.
const SCAN_INTERVAL: Duration = Duration::from_millis(50);

/// The deadline state of one peer's endpoint.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Watch {
    /// Requests (and standalone notifications) to the peer that hold a slot.
    pub(super) outstanding: u32,
    /// Virtual time of the last completion on the endpoint, or of the post that found it
    /// idle.
    since: Duration,
}

/// The backend's clock and bound.
#[derive(Debug)]
pub(super) struct Deadline {
    /// The bound (`None` = `peer_timeout_ms=0`: never).
    timeout: Option<Duration>,
    /// Progressed time so far.
    clock: Duration,
    /// Wall time of the last pump that read it.
    last_pump: Option<Instant>,
    /// Virtual time of the last scan.
    last_scan: Duration,
    /// Peer requests holding a slot, all peers together.
    outstanding: u32,
}

impl Deadline {
    pub(super) fn new(timeout: Option<Duration>) -> Deadline {
        Deadline {
            timeout,
            clock: Duration::ZERO,
            last_pump: None,
            last_scan: Duration::ZERO,
            outstanding: 0,
        }
    }
}

impl Core {
    /// `count` slots started on the endpoint to `peer`.
    pub(super) fn watch_started(&mut self, peer: PeerId, count: u32) {
        if self.deadline.timeout.is_none() {
            return;
        }
        let Some(state) = self.peers.get_mut(&peer) else {
            return;
        };
        if state.watch.outstanding == 0 {
            // The endpoint was idle: its deadline starts now. Bring the clock up to date
            // first (the last pump may be long ago).
            self.deadline.tick(Instant::now());
            state.watch.since = self.deadline.clock;
        }
        state.watch.outstanding += count;
        self.deadline.outstanding += count;
    }

    /// A slot of `peer` ended (the endpoint made progress).
    pub(super) fn watch_ended(&mut self, peer: PeerId) {
        if self.deadline.timeout.is_none() {
            return;
        }
        if let Some(state) = self.peers.get_mut(&peer) {
            if state.watch.outstanding > 0 {
                state.watch.outstanding -= 1;
                self.deadline.outstanding -= 1;
            }
            state.watch.since = self.deadline.clock;
        }
    }

    /// A new endpoint to `peer`: its deadline starts afresh (slots of an earlier,
    /// closed endpoint may still be counted until UCX reports them).
    pub(super) fn watch_new_endpoint(&mut self, peer: PeerId) {
        let clock = self.deadline.clock;
        if let Some(state) = self.peers.get_mut(&peer) {
            state.watch.since = clock;
        }
    }

    /// A peer's state goes away with `outstanding` slots still counted (unload).
    pub(super) fn watch_forget(&mut self, watch: Watch) {
        self.deadline.outstanding -= watch.outstanding.min(self.deadline.outstanding);
    }

    /// Whether `peer_timeout_ms=0` (no deadline, so nothing in flight is counted).
    pub(super) fn deadline_disabled(&self) -> bool {
        self.deadline.timeout.is_none()
    }

    /// Advance the clock (at the start of a pump) if anything is watched.
    pub(super) fn watch_tick(&mut self) {
        if self.deadline.outstanding > 0 {
            self.deadline.tick(Instant::now());
        } else {
            // Nothing in flight: the clock may stand still; the next post restarts it.
            self.deadline.last_pump = None;
        }
    }

    /// Declare unreachable every peer whose deadline passed (after a pump handled what
    /// completed). Returns whether any was.
    pub(super) fn watch_expire(&mut self) -> bool {
        let Some(timeout) = self.deadline.timeout else {
            return false;
        };
        if self.deadline.outstanding == 0
            || self.deadline.clock < self.deadline.last_scan + SCAN_INTERVAL
        {
            return false;
        }
        self.deadline.last_scan = self.deadline.clock;
        let clock = self.deadline.clock;
        let mut any = false;
        // Bounded by the number of peers; runs at most every SCAN_INTERVAL. Collected
        // first (teardown needs `&mut self`) without allocating unless one expired.
        loop {
            let expired = self
                .peers
                .iter()
                .find(|(_, s)| {
                    s.down.is_none()
                        && !s.ep.is_null()
                        && s.watch.outstanding > 0
                        && clock.saturating_sub(s.watch.since) >= timeout
                })
                .map(|(&p, _)| p);
            let Some(peer) = expired else { break };
            any = true;
            if let Some(state) = self.peers.get_mut(&peer) {
                log::warn!(
                    "UCX: peer '{}' unreachable: {} request(s) made no progress for {:?} \
                     (parameter peer_timeout_ms); its endpoint is closed",
                    state.name,
                    state.watch.outstanding,
                    timeout
                );
                state.down = Some(ucs_status_t::UCS_ERR_ENDPOINT_TIMEOUT);
                state.watch.since = clock;
            }
            // The force close cancels the endpoint's requests; their callbacks report
            // them as remote-disconnect (the peer is down).
            self.teardown_peer(peer);
        }
        if any {
            self.handle_events();
        }
        any
    }
}

impl Deadline {
    fn tick(&mut self, now: Instant) {
        if let Some(last) = self.last_pump {
            self.clock += now.saturating_duration_since(last).min(GAP_COUNTED_MAX);
        }
        self.last_pump = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_counts_pauses_only_up_to_the_cap() {
        let mut d = Deadline::new(Some(Duration::from_secs(1)));
        let t0 = Instant::now();
        d.tick(t0);
        assert_eq!(d.clock, Duration::ZERO);
        d.tick(t0 + Duration::from_millis(300));
        assert_eq!(d.clock, Duration::from_millis(300));
        d.tick(t0 + Duration::from_secs(60));
        assert_eq!(d.clock, Duration::from_millis(300) + GAP_COUNTED_MAX);
        // Time never runs backwards, even if the wall clock is read out of order.
        d.tick(t0);
        assert_eq!(d.clock, Duration::from_millis(300) + GAP_COUNTED_MAX);
    }
}
