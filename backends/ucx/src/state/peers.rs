//! Peers: endpoints (created lazily, closed on unload), remote keys, and the graveyard
//! of endpoints whose close UCX has not confirmed yet.
//!
//! # Who owns an endpoint's callback state
//!
//! Each endpoint gets its own [`PeerLink`] (the argument of its error handler), boxed so
//! its address is stable. UCX may call the error handler until the endpoint's close has
//! completed, so the link lives until then: closing is `ucp_ep_close_nbx(FORCE)`, which
//! cancels the endpoint's outstanding requests (their callbacks report them, see
//! `requests`); if UCX confirms the close within a few progress rounds, the link and the
//! rkeys unpacked on the endpoint are released at once; otherwise they move, with the
//! close request, into [`Grave`]s, checked at every `pump` and released when UCX
//! confirms — or, at the latest, after the worker is destroyed (`Core::drop`). No close
//! blocks the caller: unloading a peer never waits on the network.

use super::*;
use crate::wire::ConnInfo;

/// What an endpoint whose close is still pending leaves behind (see the module docs).
pub(super) struct Grave {
    /// The endpoint's worker (progressed to finish the close).
    pub(super) worker: ucp_worker_h,
    /// The close request (null once freed or when there was none).
    pub(super) request: *mut c_void,
    /// The error-handler argument UCX may still call.
    pub(super) link: Option<Box<PeerLink>>,
    /// Rkeys unpacked on the endpoint.
    pub(super) rkeys: Vec<ucp_rkey_h>,
    /// An endpoint not closed yet: it waits for its wireup (and the answer to a ping)
    /// first, see [`Core::settle_wireup`]. `request` is null while this is set.
    pub(super) settle: Option<Settle>,
}

/// What an endpoint no request used waits for before its close is issued.
pub(super) struct Settle {
    pub(super) ep: ucp_ep_h,
    /// The load's wireup flush, still running (null once it completed and was freed).
    pub(super) flush: *mut c_void,
    /// Ping the peer once the flush is done, and wait for its answer.
    pub(super) ping: bool,
    /// The pong count when the ping went (`None`: not sent yet).
    pub(super) pongs_before: Option<u64>,
    pub(super) deadline: Instant,
    pub(super) force: bool,
}

pub(super) struct PeerState {
    pub(super) name: String,
    pub(super) worker: usize,
    pub(super) remote_address: Vec<u8>,
    pub(super) ep: ucp_ep_h,
    /// The error-handler argument of `ep` (None while there is no endpoint).
    pub(super) link: Option<Box<PeerLink>>,
    pub(super) regions: Arc<dyn PeerRegions>,
    pub(super) rkeys: HashMap<u64, RemoteKey>,
    /// Set once UCX reported the endpoint dead; cleared by a reload with new info.
    pub(super) down: Option<ucs_status_t>,
    pub(super) transports: String,
    /// The endpoint's progress deadline (`deadline.rs`).
    pub(super) watch: Watch,
    /// Batch message size on its endpoint (`batch.rs`), decided per endpoint; 0 = small
    /// ranges are not batched.
    pub(super) am_msg_bytes: usize,
    /// Whether its connection info says it handles batch messages
    /// (`wire::FEATURE_BATCH_AM`); without it nothing is batched to it.
    pub(super) accepts_batches: bool,
    /// Whether puts/gets on its endpoint go over tcp, where UCX sends inline for as long
    /// as the socket takes data: a post then paces itself (`requests::IssueBudget`).
    pub(super) paced: bool,
    /// Whether every DRAM range to it goes in batch messages (`am_tcp`), never as a
    /// UCX put or get.
    pub(super) am_all: bool,
    /// Whether its connection info says it receives WRITE pieces by rendezvous
    /// (`wire::FEATURE_RNDV_PIECES`).
    pub(super) accepts_rndv: bool,
    /// Whether `am_all` WRITE pieces that fill a message go to it by rendezvous
    /// (`am_tcp_rndv`, and it accepts them).
    pub(super) rndv_pieces: bool,
    /// The peer's listening TCP sockets our endpoint connected to (`sockets.rs`): reset
    /// before a failed endpoint is closed, so nothing queued in the kernel goes later.
    pub(super) tcp_remotes: Vec<std::net::SocketAddr>,
    /// Whether the endpoint's full `ucp_ep_print_info` was logged (at debug level) for
    /// its first VRAM request: which lanes GPU memory takes (`cuda_ipc` or not).
    pub(super) vram_logged: bool,
    /// The flush issued on a new endpoint at load (`connect_on_load`) that had not
    /// completed when the load returned: its completion means the wireup is done.
    /// Waited for (bounded) before the endpoint closes; null when none.
    pub(super) wireup: *mut c_void,
    /// The load's ping (sent where the peer answers them: `am_msg_bytes > 0`) went
    /// unanswered, or was not sent because the wireup was still running: nothing has
    /// yet shown that the peer's way back to us is connected. Until a request uses the
    /// endpoint, its close pings again and waits (bounded) for the answer; see
    /// [`Core::settle_wireup`].
    pub(super) unanswered: bool,
}

/// A peer region's rkey, unpacked on its endpoint.
#[derive(Clone, Copy)]
pub(super) struct RemoteKey {
    pub(super) rkey: ucp_rkey_h,
    /// UCX can map the region into this process (`ucp_rkey_ptr` succeeded: a segment
    /// UCX allocated, or any memory with xpmem): puts to it are plain stores UCX does
    /// one-sided, so small ranges to it are never batched (measured, UCX-allocated
    /// peer over shared memory, 4 KiB x 1024 WRITE: 20.4 GB/s as puts, 5.1 batched).
    pub(super) mapped: bool,
}

/// Longest a load waits for a new endpoint's wireup (`connect_on_load`); on loopback,
/// with the peer progressing, it took 1–4 ms (UCX 1.13). A peer that has not answered
/// by then (it is busy, or not progressing, as two agents on one thread) finishes in the
/// background, with the first request or the progress thread.
const LOAD_WIREUP_WAIT: Duration = Duration::from_millis(5);

/// Longest a load then waits for the answer to its ping (see [`Core::ping_peer`]): on
/// loopback with UCX 1.13 the first message answered from the peer took 2.5–6 ms more
/// than the wireup flush, and the first request used to pay it.
const LOAD_PING_WAIT: Duration = Duration::from_millis(10);

/// The ping's payload (its cookie); static, so it outlives the send.
static PING: [u8; 8] = crate::wire::PING_COOKIE.to_le_bytes();

/// Longest an endpoint no request used waits, at its close, for a wireup the load left
/// running and the answer to a ping ([`Core::settle_wireup`]).
const CLOSE_WIREUP_WAIT: Duration = Duration::from_millis(100);

impl Core {
    pub(crate) fn load_remote(
        &mut self,
        peer: PeerId,
        name: &str,
        info: Option<ConnInfo>,
        regions: Arc<dyn PeerRegions>,
        standby: bool,
        ready_ranges: usize,
    ) -> Result<()> {
        if let Some(state) = self.peers.get_mut(&peer) {
            state.regions = regions;
            state.name.clear();
            state.name.push_str(name);
            if let Some(info) = info {
                let remote = info.addresses[state.worker % info.addresses.len()].clone();
                if remote != state.remote_address
                    || info.batches() != state.accepts_batches
                    || info.rndv_pieces() != state.accepts_rndv
                {
                    // The peer restarted (or moved, or came back as another build):
                    // forget its endpoint and rkeys.
                    self.teardown_peer(peer);
                    let state = self.peers.get_mut(&peer).expect("present");
                    state.remote_address = remote;
                    state.accepts_batches = info.batches();
                    state.accepts_rndv = info.rndv_pieces();
                    state.down = None;
                }
            }
            self.prepare_on_load(peer, standby, ready_ranges);
            return Ok(());
        }
        let info = info.ok_or_else(|| Error::InvalidMetadata {
            reason: format!("UCX: first metadata of peer '{name}' has no connection info").into(),
        })?;
        self.start_workers()?;
        let addresses = &info.addresses;
        let worker = self.next_worker % self.workers.len();
        self.next_worker += 1;
        let remote_address = addresses[worker % addresses.len()].clone();
        self.peers.insert(
            peer,
            PeerState {
                name: name.to_string(),
                worker,
                remote_address,
                ep: ptr::null_mut(),
                link: None,
                regions,
                rkeys: HashMap::default(),
                down: None,
                transports: String::new(),
                watch: Watch::default(),
                am_msg_bytes: 0,
                accepts_batches: info.batches(),
                paced: false,
                am_all: false,
                accepts_rndv: info.rndv_pieces(),
                rndv_pieces: false,
                tcp_remotes: Vec::new(),
                vram_logged: false,
                wireup: ptr::null_mut(),
                unanswered: false,
            },
        );
        self.prepare_on_load(peer, standby, ready_ranges);
        Ok(())
    }

    /// With `connect_on_load`: make the endpoint to a just-loaded peer (and with
    /// `unpack_on_load` unpack the rkeys of its regions not unpacked yet) and wait a
    /// little for its wireup, so its first request costs what the second does. Nothing
    /// here fails the load: an endpoint that cannot be made, or an rkey UCX refuses, is
    /// tried again by the first request that needs it, which reports the error then (as
    /// without `connect_on_load`).
    ///
    /// Not for a peer another backend of the agent serves (`standby`: SHM for a peer of
    /// this host, by default) while it has no endpoint: the endpoint waits for the first
    /// request that goes through UCX, as without `connect_on_load`, and no connection is
    /// made to it until then. Once one exists, a reload prepares as usual (the rkeys of
    /// regions the peer added).
    ///
    /// `ready_ranges` ([`ferry_backend_api::RemoteAgent::ready_ranges`]): the per-post
    /// rkey list gets room for a request of that many ranges.
    fn prepare_on_load(&mut self, peer: PeerId, standby: bool, ready_ranges: usize) {
        if !self.connect_on_load {
            return;
        }
        if standby && self.peers[&peer].ep.is_null() {
            self.standby_loads += 1;
            log::debug!(
                "UCX: peer '{}' is served by an earlier backend of this agent; its \
                 endpoint waits for the first request that goes through UCX",
                self.peers[&peer].name
            );
            return;
        }
        let ep = match self.peer_ep(peer) {
            Ok((ep, _)) => ep,
            Err(e) => {
                log::info!("UCX: no endpoint made at load ({e}); the first request tries again");
                return;
            }
        };
        let state = &self.peers[&peer];
        let mode = self.unpack_on_load;
        // Unpacked from the public metadata the listing hands over (no lookup per
        // region), kept after the listing (the cache is read during it).
        let mut unpacked: Vec<(u64, RemoteKey)> = Vec::new();
        let (mut refused, mut mapped) = (0usize, 0usize);
        if mode != crate::UnpackOnLoad::Never {
            let ucp = &self.ucp;
            state
                .regions
                .for_each_region(crate::BACKEND, &mut |token, desc, md| {
                    if state.rkeys.contains_key(&token) {
                        return;
                    }
                    match unpack_peer_rkey(ucp, ep, &state.name, token, desc.addr, md) {
                        Err(e) => {
                            if refused == 0 {
                                log::warn!(
                                    "UCX: at load: {e} (its first request reports it again)"
                                );
                            }
                            refused += 1;
                        }
                        Ok(key) if key.mapped && mode == crate::UnpackOnLoad::Unmapped => {
                            // A segment of the peer's, now mapped here: not kept mapped for
                            // a region that may never be used; its first use unpacks it
                            // again.
                            // SAFETY: unpacked just above on this peer's live endpoint and
                            // never cached, so nothing else holds or frees it.
                            unsafe { ucp.api().ucp_rkey_destroy(key.rkey) };
                            mapped += 1;
                        }
                        Ok(key) => unpacked.push((token, key)),
                    }
                });
        }
        let kept = unpacked.len();
        self.ready_requests(ready_ranges);
        let state = self.peers.get_mut(&peer).expect("present");
        state.rkeys.reserve(kept);
        for (token, key) in unpacked {
            // A token is listed once; were one listed again, its first key is released.
            if let Some(twice) = state.rkeys.insert(token, key) {
                // SAFETY: unpacked above on this peer's live endpoint, replaced in the
                // cache just now, so nothing else holds or frees it.
                unsafe { self.ucp.api().ucp_rkey_destroy(twice.rkey) };
            }
        }
        let worker = self.peers[&peer].worker;
        let wired = self.finish_wireup(peer, ep, worker);
        log::debug!(
            "UCX: peer '{}' loaded: endpoint made{}, {} rkey(s) unpacked, {mapped} left for \
             first use (mapped here), {refused} refused",
            self.peers[&peer].name,
            if wired {
                " and wired up"
            } else {
                " (wireup still running)"
            },
            kept
        );
    }

    /// Flush a new endpoint and progress its worker until the flush completes (its
    /// wireup is done) or [`LOAD_WIREUP_WAIT`] passed; a flush still running then is
    /// kept in the peer's state ([`Core::settle_wireup`] waits for it before the
    /// endpoint closes). Returns whether the wireup completed. Besides sparing the first
    /// request the round trip, this keeps an endpoint from closing mid-wireup when its
    /// agent goes away right after the load: UCX 1.13's tcp transport then aborts the
    /// *peer's* process on an assertion (`ucp_request_send_state_ff`: "got REP message",
    /// seen with Debian's 1.13.1).
    fn finish_wireup(&mut self, peer: PeerId, ep: ucp_ep_h, worker: usize) -> bool {
        let api = self.ucp.api();
        let param = request_param();
        // SAFETY: ep is live (just made); without a callback the request is only polled
        // and freed by us, once (here or in `settle_wireup`).
        let request = unsafe { api.ucp_ep_flush_nbx(ep, &param) };
        if !ucs_ptr_is_ptr(request) {
            return ucs_ptr_status(request).is_ok();
        }
        let handle = self.workers[worker].handle;
        let deadline = Instant::now() + LOAD_WIREUP_WAIT;
        loop {
            // SAFETY: worker live; request is our flush request, not freed yet.
            let status = unsafe {
                api.ucp_worker_progress(handle);
                api.ucp_request_check_status(request)
            };
            if status != ucs_status_t::UCS_INPROGRESS {
                // SAFETY: our request, completed; freed once.
                unsafe { api.ucp_request_free(request) };
                if status.is_ok() && self.peers[&peer].am_msg_bytes > 0 {
                    let answered = self.ping_peer(ep, handle, Instant::now() + LOAD_PING_WAIT);
                    self.peers.get_mut(&peer).expect("present").unanswered = !answered;
                }
                return status.is_ok();
            }
            if Instant::now() >= deadline {
                let state = self.peers.get_mut(&peer).expect("present");
                state.wireup = request;
                state.unanswered = state.am_msg_bytes > 0;
                self.wiring.push(peer);
                return false;
            }
        }
    }

    /// Send a ping to a just-wired peer whose ranges go in Ferry's messages and progress
    /// `worker` until its answer arrives or [`LOAD_PING_WAIT`] passed. The flush only
    /// proves the path to the peer; the answer comes back the way the peer's acks will,
    /// and whatever UCX sets up for that (measured with UCX 1.13 on loopback: 2.5–6 ms
    /// on the first answered message) is then done at load instead of in the first
    /// request. Nothing fails here: a peer that does not answer in time (busy, not
    /// progressing, or a build without the handler, which drops the message) leaves the
    /// rest to the first request, as before.
    fn ping_peer(&mut self, ep: ucp_ep_h, worker: ucp_worker_h, deadline: Instant) -> bool {
        let api = self.ucp.api();
        let Some(before) = self.send_ping(ep) else {
            return false;
        };
        let pongs = &self.events.batch.pongs;
        loop {
            if pongs.load(Ordering::Acquire) != before {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            // SAFETY: the worker is live (the backend's).
            unsafe { api.ucp_worker_progress(worker) };
        }
    }

    /// Check the wireup flushes loads left running ([`Core::wiring`]): once one is done,
    /// free it and ping its peer (where the peer answers pings), without waiting for the
    /// answer, so the peer's way back to us is set up before the first request (and a
    /// peer with `progress_thread_spin_us=auto` opens its window for it). The peer
    /// stays [`PeerState::unanswered`]: a pong is not tied to its peer. Returns whether
    /// a flush finished.
    pub(super) fn advance_wireups(&mut self) -> bool {
        let mut finished = false;
        let mut i = 0;
        while i < self.wiring.len() {
            let peer = self.wiring[i];
            let Some(state) = self.peers.get_mut(&peer) else {
                self.wiring.swap_remove(i);
                continue;
            };
            let request = state.wireup;
            if request.is_null() {
                // A request or the endpoint's close took the flush over.
                self.wiring.swap_remove(i);
                continue;
            }
            let api = self.ucp.api();
            // SAFETY: our flush request, not freed yet (the peer's state still holds it).
            let status = unsafe { api.ucp_request_check_status(request) };
            if status == ucs_status_t::UCS_INPROGRESS {
                i += 1;
                continue;
            }
            // SAFETY: our request, completed; freed once (the state forgets it here).
            unsafe { api.ucp_request_free(request) };
            state.wireup = ptr::null_mut();
            let failed = state
                .link
                .as_ref()
                .is_some_and(|l| l.status.load(Ordering::Acquire) != 0);
            let ping = state.am_msg_bytes > 0 && status.is_ok() && !failed;
            // A wireup that failed leaves nothing to prove at the close either: an
            // endpoint UCX reported failed is never pinged.
            if !ping {
                state.unanswered = false;
            }
            let ep = state.ep;
            self.wiring.swap_remove(i);
            finished = true;
            if ping && !ep.is_null() {
                // Refused sends only cost the head start; the close pings again.
                let _ = self.send_ping(ep);
            }
        }
        finished
    }

    /// Send a ping on `ep`; returns the pong count before it, or `None` if UCX refused
    /// the send.
    fn send_ping(&self, ep: ucp_ep_h) -> Option<u64> {
        let api = self.ucp.api();
        let before = self.events.batch.pongs.load(Ordering::Acquire);
        let mut param = request_param();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
        // SAFETY: ep live (wired, not closed); the payload is static; without a callback
        // the request is ours to free, which UCX defers until it completes.
        let request = unsafe {
            api.ucp_am_send_nbx(
                ep,
                crate::wire::PING_AM_ID,
                ptr::null(),
                0,
                PING.as_ptr() as *const c_void,
                PING.len(),
                &param,
            )
        };
        if ucs_ptr_is_ptr(request) {
            // SAFETY: our request; UCX releases it once complete.
            unsafe { api.ucp_request_free(request) };
        } else if ucs_ptr_is_err(request) {
            return None;
        }
        Some(before)
    }

    /// Before the endpoint to `peer` closes, when no request has used it since its load:
    /// wait (bounded by [`CLOSE_WIREUP_WAIT`] in all) for a wireup flush the load left
    /// running, then free it; and if nothing has shown yet that the peer's way back to
    /// us is connected ([`PeerState::unanswered`]), ping it and wait for the answer.
    ///
    /// Why: with UCX 1.13's tcp transport the peer answers our wireup on an endpoint of
    /// its own, which connects back to us. An agent that went away before that
    /// connection was made has the peer's connect refused, and UCX 1.13 then aborts the
    /// *peer's* process on an assertion while purging the pending wireup reply
    /// (`ucp_request_send_state_ff`: "got REP message", seen with Debian's 1.13.1; the
    /// assertion was removed upstream in openucx/ucx#8175). A pong comes back over that
    /// connection.
    ///
    /// Nothing here blocks: the endpoint waits in the graveyard, not yet closed, and
    /// [`Core::reap_graves`] (every progress) issues its close once the wait is over.
    /// Returns what it waits for, or `None` when there is nothing to wait for (or `wait`
    /// is false: the flush, if any, is freed).
    fn settle_wireup(&mut self, peer: PeerId, force: bool, wait: bool) -> Option<Settle> {
        let state = self.peers.get_mut(&peer)?;
        let flush = std::mem::replace(&mut state.wireup, ptr::null_mut());
        let ping = std::mem::replace(&mut state.unanswered, false);
        if !wait || (flush.is_null() && !ping) || state.ep.is_null() {
            if !flush.is_null() {
                // SAFETY: our flush request, freed once.
                unsafe { self.ucp.api().ucp_request_free(flush) };
            }
            return None;
        }
        Some(Settle {
            ep: state.ep,
            flush,
            ping,
            pongs_before: None,
            deadline: Instant::now() + CLOSE_WIREUP_WAIT,
            force,
        })
    }

    /// Advance a settling endpoint; true once its close may be issued. `failed`: UCX
    /// reported an error on the endpoint (it is then closed at once, never pinged).
    fn settled(&self, settle: &mut Settle, failed: bool) -> bool {
        let api = self.ucp.api();
        let expired = failed || Instant::now() >= settle.deadline;
        if !settle.flush.is_null() {
            // SAFETY: our flush request, not freed yet.
            let status = unsafe { api.ucp_request_check_status(settle.flush) };
            if status == ucs_status_t::UCS_INPROGRESS && !expired {
                return false;
            }
            // SAFETY: our request, freed once; UCX releases one still in progress when
            // it completes or the endpoint's close cancels it.
            unsafe { api.ucp_request_free(settle.flush) };
            settle.flush = ptr::null_mut();
            if !status.is_ok() {
                return true;
            }
        }
        if expired || !settle.ping {
            return true;
        }
        match settle.pongs_before {
            None => match self.send_ping(settle.ep) {
                Some(before) => {
                    settle.pongs_before = Some(before);
                    false
                }
                None => true,
            },
            Some(before) => self.events.batch.pongs.load(Ordering::Acquire) != before,
        }
    }

    /// Close the peer's endpoint (UCX cancels its in-flight requests, whose callbacks
    /// then report them) and release its rkeys and error-handler argument once UCX
    /// confirmed the close (at once, or later from the graveyard).
    pub(super) fn teardown_peer(&mut self, peer: PeerId) {
        let Some(state) = self.peers.get(&peer) else {
            return;
        };
        let ep = state.ep;
        // A failed endpoint, or one with work in flight (or no count of it: without a
        // deadline nothing is counted): what the kernel still queues must not go later.
        let failing =
            state.down.is_some() || state.watch.outstanding > 0 || self.deadline_disabled();
        if !ep.is_null() && failing && !state.tcp_remotes.is_empty() {
            let reset = super::sockets::abort_connections_to(&state.tcp_remotes);
            log::debug!(
                "UCX: endpoint to '{}' closes after a failure: {reset} TCP connection(s) to \
                 {:?} reset (queued data dropped)",
                state.name,
                state.tcp_remotes
            );
        }
        if !ep.is_null() {
            // What the window kept from UCX never will go: fail it and flush now.
            self.cut_deferred(ep, ucs_status_t::UCS_ERR_CANCELED);
            // Acks that will not come: fail their requests now, once each.
            self.am_fail_ep(ep);
        }
        // An endpoint no request used may first wait for its wireup (not a failing one:
        // what it has queued must go now).
        let close_force = self.close_force;
        let settle = self.settle_wireup(peer, close_force, !failing);
        let Some(state) = self.peers.get_mut(&peer) else {
            return;
        };
        let ep = std::mem::replace(&mut state.ep, ptr::null_mut());
        let link = state.link.take();
        let worker = self.workers[state.worker].handle;
        let rkeys: Vec<ucp_rkey_h> = state.rkeys.drain().map(|(_, r)| r.rkey).collect();
        if let Some(settle) = settle {
            // Its close is issued by reap_graves once the wait is over.
            log::debug!("UCX: endpoint close waits for its wireup in the graveyard");
            self.graves.push(Grave {
                worker,
                request: ptr::null_mut(),
                link,
                rkeys,
                settle: Some(settle),
            });
            return;
        }
        let pending = if ep.is_null() {
            None
        } else {
            self.close_ep(worker, ep, self.close_force)
        };
        let grave = Grave {
            worker,
            request: pending.unwrap_or(ptr::null_mut()),
            link,
            rkeys,
            settle: None,
        };
        if pending.is_some() {
            log::debug!("UCX: endpoint close pending; its state waits in the graveyard");
            self.graves.push(grave);
        } else {
            self.bury(grave);
        }
    }

    /// Release what a closed endpoint left: its rkeys, its link, its close request.
    pub(super) fn bury(&mut self, grave: Grave) {
        let api = self.ucp.api();
        for rkey in grave.rkeys {
            // SAFETY: unpacked on the endpoint whose close UCX has confirmed: every
            // operation that used the rkey has completed or been canceled. (UCX asks for
            // rkeys to be destroyed before the endpoint is; its force close cancels the
            // operations only as part of the close, and releasing an rkey does not touch
            // the endpoint, so this is the earliest point that is safe for both.)
            unsafe { api.ucp_rkey_destroy(rkey) };
        }
        if !grave.request.is_null() {
            // SAFETY: our close request, completed; freed once.
            unsafe { api.ucp_request_free(grave.request) };
        }
        drop(grave.link);
    }

    /// Release the graves whose close UCX has confirmed meanwhile. Returns how many.
    pub(super) fn reap_graves(&mut self) -> usize {
        let mut reaped = 0;
        let mut i = 0;
        while i < self.graves.len() {
            if let Some(mut settle) = self.graves[i].settle.take() {
                let failed = self.graves[i]
                    .link
                    .as_ref()
                    .is_some_and(|l| l.status.load(Ordering::Acquire) != 0);
                if !self.settled(&mut settle, failed) {
                    self.graves[i].settle = Some(settle);
                    i += 1;
                    continue;
                }
                let worker = self.graves[i].worker;
                match self.close_ep(worker, settle.ep, settle.force) {
                    Some(request) => {
                        self.graves[i].request = request;
                        i += 1;
                    }
                    None => {
                        let grave = self.graves.swap_remove(i);
                        self.bury(grave);
                        reaped += 1;
                    }
                }
                continue;
            }
            // SAFETY: the close request is ours and not freed yet; its worker is live.
            let status = unsafe {
                self.ucp
                    .api()
                    .ucp_request_check_status(self.graves[i].request)
            };
            if status == ucs_status_t::UCS_INPROGRESS {
                i += 1;
                continue;
            }
            let grave = self.graves.swap_remove(i);
            self.bury(grave);
            reaped += 1;
        }
        reaped
    }

    /// Endpoints whose close UCX has not confirmed yet (diagnostics and tests).
    pub(crate) fn closing_endpoints(&self) -> usize {
        self.graves.len()
    }

    pub(crate) fn unload_remote(&mut self, peer: PeerId) {
        if !self.peers.contains_key(&peer) {
            return;
        }
        self.teardown_peer(peer);
        if let Some(state) = self.peers.remove(&peer) {
            self.watch_forget(state.watch);
        }
        // Callbacks of the canceled requests have been queued; turn them into
        // completions now (they map to RemoteDisconnect: the peer is gone).
        self.handle_events();
    }

    pub(crate) fn disconnect(&mut self, peer: PeerId) -> Result<()> {
        if !self.peers.contains_key(&peer) {
            return Err(Error::not_found(Subject::Peer(peer)));
        }
        self.teardown_peer(peer);
        self.handle_events();
        Ok(())
    }

    /// Close `ep` (forced: UCX cancels its outstanding requests; see `ep_close`) and
    /// progress its worker a
    /// bounded number of rounds. Returns the close request if UCX has not confirmed the
    /// close yet (the caller keeps the endpoint's state alive until it has).
    pub(super) fn close_ep(
        &mut self,
        worker: ucp_worker_h,
        ep: ucp_ep_h,
        force: bool,
    ) -> Option<*mut c_void> {
        let api = self.ucp.api();
        let mut param = request_param();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        // Force (`ep_close=force`, the default) cancels what is outstanding; flush lets it
        // finish first.
        param.flags = if force { UCP_EP_CLOSE_FLAG_FORCE } else { 0 };
        // SAFETY: ep is live and owned by us; param valid for the call.
        let request = unsafe { api.ucp_ep_close_nbx(ep, &param) };
        if !ucs_ptr_is_ptr(request) {
            return None;
        }
        for _ in 0..self.close_rounds {
            // SAFETY: worker is live; request is the close request we own.
            let status = unsafe {
                api.ucp_worker_progress(worker);
                api.ucp_request_check_status(request)
            };
            if status != ucs_status_t::UCS_INPROGRESS {
                // SAFETY: our close request, completed; freed once.
                unsafe { api.ucp_request_free(request) };
                return None;
            }
        }
        Some(request)
    }

    pub(super) fn create_ep(
        &self,
        worker: usize,
        address: &[u8],
        link: Option<&PeerLink>,
    ) -> Result<ucp_ep_h> {
        let api = self.ucp.api();
        // SAFETY: plain C struct, zero = no fields.
        let mut params: ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
        params.address = address.as_ptr() as *const ucp_address_t;
        if let (Some(link), ErrorMode::Peer) = (link, self.err_mode) {
            params.field_mask |=
                u64::from(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
            params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler = ucp_err_handler_t {
                cb: Some(on_ep_error),
                arg: link as *const PeerLink as *mut c_void,
            };
        }
        let mut ep: ucp_ep_h = ptr::null_mut();
        // SAFETY: worker live; the address bytes are valid for the call (UCX copies what
        // it needs); the error handler arg is boxed and outlives the ep: it stays in the
        // peer state, then in the graveyard, until UCX confirmed the ep's close.
        let status = unsafe { api.ucp_ep_create(self.workers[worker].handle, &params, &mut ep) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_ep_create", status));
        }
        Ok(ep)
    }

    /// The endpoint to `peer`, created on first use.
    pub(super) fn peer_ep(&mut self, peer: PeerId) -> Result<(ucp_ep_h, usize)> {
        let state = self
            .peers
            .get(&peer)
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        if state.down.is_some() {
            return Err(Error::RemoteDisconnect {
                subject: Subject::PeerName(state.name.clone()),
            });
        }
        if !state.ep.is_null() {
            let (ep, worker) = (state.ep, state.worker);
            if state.unanswered || !state.wireup.is_null() {
                let state = self.peers.get_mut(&peer).expect("present");
                // A request now goes to the peer; its answers come back the way a pong
                // would, and it follows the load's wireup flush on this endpoint (and
                // completes only after it): stop tracking either.
                state.unanswered = false;
                let request = std::mem::replace(&mut state.wireup, ptr::null_mut());
                if !request.is_null() {
                    // SAFETY: our flush request, freed once; UCX releases it when it
                    // completes if it has not yet.
                    unsafe { self.ucp.api().ucp_request_free(request) };
                }
            }
            return Ok((ep, worker));
        }
        let worker = state.worker;
        // A fresh link per endpoint: the link of an earlier endpoint may still be in the
        // graveyard, where UCX can still report on it.
        let link = Box::new(PeerLink {
            events: Arc::as_ptr(&self.events),
            status: AtomicI8::new(0),
        });
        // The TCP connections UCX opens for the endpoint appear during the create.
        let bracket = super::sockets::BRACKET
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let sockets_before = super::sockets::socket_inodes();
        let ep = self.create_ep(worker, &state.remote_address, Some(&link));
        let mut tcp_remotes = super::sockets::new_remotes(&sockets_before);
        drop(bracket);
        let ep = ep?;
        let address = &self.peers[&peer].remote_address;
        tcp_remotes.retain(|r| super::sockets::in_worker_address(r, address));
        let transports = self.ep_transports(ep);
        let state = self.peers.get_mut(&peer).expect("present");
        let am_msg_bytes = if state.accepts_batches {
            self.am.suits(&transports)
        } else {
            0
        };
        state.link = Some(link);
        state.tcp_remotes = tcp_remotes;
        state.am_msg_bytes = am_msg_bytes;
        state.paced = super::requests::rma_over_tcp(&transports);
        let am_all = am_msg_bytes > 0 && self.am.all_ranges(&transports);
        state.am_all = am_all;
        state.rndv_pieces = am_all && state.accepts_rndv && self.am.rndv;
        log::info!(
            "UCX {}: endpoint to '{}' on worker {worker} uses {transports}; small ranges {}",
            self.ucp.version(),
            state.name,
            if state.rndv_pieces {
                format!(
                    "batched in messages of up to {am_msg_bytes} bytes, large ones in pieces \
                     received by rendezvous"
                )
            } else if state.am_all {
                format!("and large ones go in Ferry's messages of up to {am_msg_bytes} bytes")
            } else if am_msg_bytes > 0 {
                format!("batched in messages of up to {am_msg_bytes} bytes")
            } else if !state.accepts_batches {
                "put/get one by one (its connection info has no batch-message feature)".to_string()
            } else {
                "put/get one by one".to_string()
            }
        );
        state.ep = ep;
        state.transports = transports;
        if am_msg_bytes > 0 {
            // The first request's messages: with every range in messages (`am_tcp`) one
            // piece message holds 1,024 ranges of 64 bytes; batches of small ranges
            // alone take two of `am_msg_bytes`.
            let (bytes, count) = if am_all {
                (super::requests::PIECE_MSG_BYTES as usize, 1)
            } else {
                (am_msg_bytes, super::batch::READIED_MSGS)
            };
            self.am.prepare(bytes, count);
        }
        self.watch_new_endpoint(peer);
        Ok((ep, worker))
    }

    pub(super) fn local_ep(&mut self) -> Result<ucp_ep_h> {
        if self.self_ep.is_null() {
            self.start_workers()?;
            let address = self.workers[0].address.clone();
            self.self_ep = self.create_ep(0, &address, None)?;
            log::info!(
                "UCX {}: local endpoint uses {}",
                self.ucp.version(),
                self.ep_transports(self.self_ep)
            );
        }
        Ok(self.self_ep)
    }

    /// Make the endpoint to `peer`. A peer declared down (UCX reported its endpoint
    /// dead, or its deadline passed) is reconnected: a fresh endpoint to the same
    /// address, so requests work again once the peer is reachable.
    pub(crate) fn connect(&mut self, peer: PeerId) -> Result<()> {
        if let Some(state) = self.peers.get_mut(&peer) {
            if let Some(status) = state.down.take() {
                log::info!(
                    "UCX: reconnecting to '{}' (down: {})",
                    state.name,
                    self.ucp.status_string(status)
                );
            }
        }
        self.peer_ep(peer).map(|_| ())
    }

    pub(super) fn rkey_for(
        &mut self,
        endpoint: Endpoint,
        ep: ucp_ep_h,
        token: u64,
        remote_addr: u64,
    ) -> Result<RemoteKey> {
        let api = self.ucp.api();
        match endpoint {
            Endpoint::Local => {
                let index = self
                    .mem_index(token)
                    .ok_or_else(|| Error::not_found(token_subject(token)))?;
                let entry = self.mems[index].as_mut().expect("checked");
                if entry.self_rkey.is_null() {
                    let mut rkey: ucp_rkey_h = ptr::null_mut();
                    // SAFETY: ep live; packed bytes from our own ucp_rkey_pack.
                    let status = unsafe {
                        api.ucp_ep_rkey_unpack(
                            ep,
                            entry.packed_rkey.as_ptr() as *const c_void,
                            &mut rkey,
                        )
                    };
                    if !status.is_ok() {
                        return Err(ucx_error(&self.ucp, "ucp_ep_rkey_unpack (local)", status));
                    }
                    entry.self_rkey = rkey;
                }
                // Local transfers are never batched: `mapped` is not asked.
                Ok(RemoteKey {
                    rkey: entry.self_rkey,
                    mapped: false,
                })
            }
            Endpoint::Peer(peer) => {
                let state = self.peers.get_mut(&peer).expect("peer_ep checked");
                if let Some(&key) = state.rkeys.get(&token) {
                    return Ok(key);
                }
                let packed = state.regions.public_md(token).ok_or_else(|| {
                    Error::not_found(Subject::Named(
                        format!("region token {token:#x} of peer '{}'", state.name).into(),
                    ))
                })?;
                let key = unpack_peer_rkey(&self.ucp, ep, &state.name, token, remote_addr, packed)?;
                state.rkeys.insert(token, key);
                Ok(key)
            }
        }
    }
}

/// Unpack the rkey of a peer's region from its public metadata (`packed`, as framed by
/// `wire::frame_rkey`) on `ep`, and ask UCX whether it maps the region here.
fn unpack_peer_rkey(
    ucp: &Ucp,
    ep: ucp_ep_h,
    peer_name: &str,
    token: u64,
    remote_addr: u64,
    packed: &[u8],
) -> Result<RemoteKey> {
    let api = ucp.api();
    let packed = crate::wire::unframe_rkey(packed).map_err(|why| Error::InvalidMetadata {
        reason: format!("UCX rkey of region token {token:#x} of peer '{peer_name}': {why}").into(),
    })?;
    let mut rkey: ucp_rkey_h = ptr::null_mut();
    // SAFETY: ep live (the caller's); UCX parses the packed rkey (peer bytes) and reports
    // malformed input as an error status.
    let status = unsafe { api.ucp_ep_rkey_unpack(ep, packed.as_ptr() as *const c_void, &mut rkey) };
    if !status.is_ok() {
        return Err(Error::InvalidMetadata {
            reason: format!(
                "UCX rkey of region token {token:#x} of peer '{peer_name}': {}",
                ucp.status_string(status)
            )
            .into(),
        });
    }
    let mut mapped_at: *mut c_void = ptr::null_mut();
    // SAFETY: rkey was just unpacked; UCX only reports whether (and where) it can map the
    // peer's address, nothing is accessed through it here.
    let mapped = unsafe { api.ucp_rkey_ptr(rkey, remote_addr, &mut mapped_at) }.is_ok();
    if mapped {
        log::debug!(
            "UCX: region token {token:#x} of peer '{peer_name}' is mapped here: small ranges \
             to it go as puts"
        );
    }
    Ok(RemoteKey { rkey, mapped })
}
