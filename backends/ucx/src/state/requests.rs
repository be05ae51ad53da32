//! Posting requests, their completion state machine, and progress.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotState {
    Free,
    WaitFlush,
    WaitNotif,
}

/// One in-flight request. Columns would buy nothing here: a slot is touched as a whole.
pub(super) struct Slot {
    pub(super) state: SlotState,
    /// Tag to report; `None` for a standalone notification.
    pub(super) tag: Option<u64>,
    /// Where the request goes (None = local).
    pub(super) peer: Option<PeerId>,
    /// First failure seen while posting.
    pub(super) failure: Option<Failure>,
    /// Notification to send after the flush (payload copied here; capacity reused).
    pub(super) notif: Vec<u8>,
    pub(super) has_notif: bool,
    /// Its notification (to this agent itself) holds a reservation in the inbox.
    pub(super) reserved: bool,
    /// Next slot of the same flushed batch.
    pub(super) next: u32,
    /// Head slot of a batch: the endpoint its flush goes to.
    pub(super) ep: ucp_ep_h,
    /// Head slot of a batch: its ranges still in `Core::deferred`; the batch's flush is
    /// issued when this reaches 0.
    pub(super) deferred: u32,
    /// Head slot of a batch: its batch messages (`batch.rs`) whose ack is not in yet.
    pub(super) acks: u32,
    /// Head slot of a batch: the flush's status, kept while acks are missing.
    pub(super) flushed: Option<ucs_status_t>,
}

/// Bytes a batch message needs besides one range's data (header and entry).
/// Message size an `am_tcp` piece is cut for: 256 KiB of data (a WRITE's in the message,
/// a READ's in its reply; measured on UCX 1.13 over tcp/lo against 64 KiB, see the
/// README).
pub(super) const PIECE_MSG_BYTES: u32 = (252 << 10) + AM_RANGE_OVERHEAD_BYTES as u32;
/// Batch messages in flight before an `am_tcp` piece waits for acks: bounds the buffers
/// large pieces take (32 × 256 KiB) whatever `am_batch_messages` allows.
const PIECES_IN_FLIGHT_MAX: usize = 32;
const AM_RANGE_OVERHEAD_BYTES: usize =
    crate::wire::BATCH_HEADER_LEN_BYTES + crate::wire::BATCH_ENTRY_LEN_BYTES;

/// (The rest of) a range of a posted batch that the window kept from UCX so far.
#[derive(Clone, Copy)]
pub(super) struct Deferred {
    /// Head slot of the batch.
    pub(super) head: u32,
    /// Slot of the request the range belongs to.
    pub(super) slot: u32,
    /// Index of the range in its request (for failures).
    pub(super) range: u32,
    pub(super) op: ferry_backend_api::Op,
    pub(super) ep: ucp_ep_h,
    pub(super) rkey: ucp_rkey_h,
    /// The local region's memory handle (null: none).
    pub(super) memh: ucp_mem_h,
    pub(super) local_addr: u64,
    pub(super) remote_addr: u64,
    pub(super) len: u64,
    /// For a range to pack into batch messages (`batch.rs`): the endpoint's message
    /// size; 0 = a put/get. A small range goes whole into one message; with `am_only`
    /// any range goes in pieces of a message.
    pub(super) am_bytes: u32,
    /// Only in messages (`am_tcp`): with no message free it waits, never a put/get.
    pub(super) am_only: bool,
    /// Its WRITE pieces of at least `batch::RNDV_PIECE_MIN` go by rendezvous
    /// (`am_tcp_rndv`), in pieces of up to `am_tcp_rndv_piece_bytes`: the target
    /// receives them straight into the region.
    pub(super) rndv: bool,
    /// The CUDA device whose context is current while it is issued ([`NO_DEVICE`]: host
    /// memory on both sides, none needed).
    pub(super) dev: u16,
}

/// [`Deferred::dev`] of a piece between host memories.
pub(super) const NO_DEVICE: u16 = u16::MAX;

/// What one post or one pump may still hand to UCX: at most a window of bytes
/// (`post_window_bytes`), and in a post to an endpoint whose puts go over tcp also about
/// [`ISSUE_BUDGET`] of time. UCX sends inline where it can (a tcp put is a `sendmsg`,
/// which on loopback also runs the receiver's side), so bytes alone do not bound the
/// time there: a 1 MiB window took ~0.5–1.2 ms over tcp on the development VM. Such a
/// post issues puts and gets in steps of at most [`ISSUE_STEP_BYTES`] and reads the
/// clock after every [`ISSUE_CLOCK_BYTES`] issued (never per small range); once past the
/// time budget, the rest waits for the progress phase. Elsewhere a window is one copy
/// (shared memory: ~30–100 µs per MiB) and steps would only cost: 256 KiB puts into a
/// UCX-allocated peer segment measured 40–46 µs per MiB against 30–35 for one 1 MiB put.
/// A pump keeps whole windows (measured: the same time budget there cost a 64 MiB tcp
/// WRITE ~30 % of its bandwidth, 17.4 → 25 ms).
///
/// An untimed budget never issues a piece shorter than a window or a chunk
/// (`chunk_bytes`), whichever is smaller, unless its range ends there: the last piece of
/// a window runs past the window's edge by less than that.
/// Cutting at the window's edge split every 1 MiB range of a shuffled 1 MiB × 32 tcp
/// WRITE into a 256 KiB and a 768 KiB put, two `sendmsg`s and two protocol headers where
/// one does.
pub(super) struct IssueBudget {
    bytes: u64,
    /// Smallest piece an untimed budget issues while any bytes are left (the smaller of
    /// the window and `chunk_bytes`).
    piece: u64,
    /// When the time budget started; `None`: untimed (a pump, an endpoint that is not
    /// tcp, or `post_window_bytes=0`: everything in the post, as documented).
    started: Option<Instant>,
    since_clock: u64,
}

/// Time a post spends handing data to UCX before it leaves the rest for the progress phase.
pub(super) const ISSUE_BUDGET: Duration = Duration::from_micros(100);
/// Largest put/get step while a budget runs (below `chunk_bytes` when that is larger).
pub(super) const ISSUE_STEP_BYTES: u64 = 256 << 10;
/// Bytes issued between two looks at the clock.
pub(super) const ISSUE_CLOCK_BYTES: u64 = 64 << 10;

/// Whether an endpoint's lane summary (`ucp_ep_print_info`, as `diagnostics.rs` makes
/// it: `transport/device [roles]`, comma separated) has a tcp lane for puts/gets.
pub(super) fn rma_over_tcp(summary: &str) -> bool {
    summary.split(", ").any(|lane| {
        let (transport, roles) = lane.split_once(" [").unwrap_or((lane, ""));
        transport.starts_with("tcp")
            && roles
                .trim_end_matches(']')
                .split(' ')
                .any(|role| role.starts_with("rma"))
    })
}

impl IssueBudget {
    /// A window of `window_bytes` (`u64::MAX`: unbounded), timed if `timed` and bounded;
    /// untimed, no piece is shorter than `piece_bytes` (`chunk_bytes`) or the window.
    pub(super) fn new(window_bytes: u64, timed: bool, piece_bytes: u64) -> IssueBudget {
        IssueBudget {
            bytes: window_bytes,
            piece: piece_bytes.min(window_bytes),
            started: (timed && window_bytes != u64::MAX).then(Instant::now),
            since_clock: 0,
        }
    }

    /// Whether anything may still be issued.
    pub(super) fn left(&self) -> bool {
        self.bytes > 0
    }

    /// How much of a piece of `len` bytes to issue next.
    pub(super) fn step(&self, len: u64) -> u64 {
        if self.bytes == 0 {
            0
        } else if self.started.is_some() {
            len.min(self.bytes).min(ISSUE_STEP_BYTES)
        } else {
            len.min(self.bytes.max(self.piece))
        }
    }

    /// `n` bytes went to UCX.
    pub(super) fn spend(&mut self, n: u64) {
        self.bytes = self.bytes.saturating_sub(n);
        let Some(started) = self.started else {
            return;
        };
        self.since_clock += n;
        if self.since_clock >= ISSUE_CLOCK_BYTES {
            self.since_clock = 0;
            if started.elapsed() > ISSUE_BUDGET {
                self.bytes = 0;
            }
        }
    }
}

impl Core {
    /// Validate a batch completely (so an error means nothing started), resolving rkeys:
    /// each range's lands in `range_keys`, in the batch's order, for `post` to take
    /// (nothing between the two progresses a worker, so none is released meanwhile).
    pub(super) fn validate(
        &mut self,
        endpoint: Endpoint,
        ep: ucp_ep_h,
        batch: &[Post<'_>],
    ) -> Result<()> {
        let mut last_remote: Option<(u64, RemoteKey)> = None;
        self.range_keys.clear();
        for post in batch {
            for kind in [post.local_kind, post.remote_kind] {
                if !self.vram.may_move(kind) {
                    return Err(Error::NotSupported {
                        backend: BACKEND.into(),
                        what: format!("{kind} memory").into(),
                    });
                }
            }
            if let Some(notif) = post.notif {
                if notif.len() > NOTIF_LEN_MAX {
                    return Err(Error::invalid(
                        Subject::Named("notification".into()),
                        format!(
                            "{} bytes exceed the UCX limit of {NOTIF_LEN_MAX}",
                            notif.len()
                        ),
                    ));
                }
            }
            for (index, range) in post.ranges.iter().enumerate() {
                let desc = || Subject::Descriptor {
                    index: index as u32,
                    addr: range.local_addr,
                    len: range.len,
                    dev: range.local_dev,
                };
                let mem = self
                    .mem_index(range.local_token)
                    .and_then(|i| self.mems[i].as_ref())
                    .ok_or_else(|| Error::not_found(token_subject(range.local_token)))?;
                let end = range.local_addr.checked_add(range.len);
                if range.local_addr < mem.addr || end.is_none_or(|e| e > mem.addr + mem.len) {
                    return Err(Error::invalid(desc(), "outside its registered UCX region"));
                }
                let key = match last_remote {
                    Some((token, key)) if token == range.remote_token => key,
                    _ => {
                        let key =
                            self.rkey_for(endpoint, ep, range.remote_token, range.remote_addr)?;
                        last_remote = Some((range.remote_token, key));
                        key
                    }
                };
                self.range_keys.push(key);
            }
        }
        Ok(())
    }

    pub(crate) fn post(&mut self, endpoint: Endpoint, batch: &[Post<'_>]) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let (ep, peer) = match endpoint {
            Endpoint::Local => (self.local_ep()?, None),
            Endpoint::Peer(p) => (self.peer_ep(p)?.0, Some(p)),
        };
        if self.slots_available() < batch.len() {
            return Err(Error::Capacity {
                what: "UCX requests in flight (parameter max_requests)",
                limit: self.slot_max,
            });
        }
        self.validate(endpoint, ep, batch)?;
        self.vram.prepare(batch)?;
        if let Some(p) = peer {
            self.log_first_vram(p, ep, batch);
        }
        if peer.is_none() {
            self.reserve_own_notifs(batch)?;
        }

        let mut head = NONE;
        let mut tail = NONE;
        // Each range's rkey, as `validate` found it (one lookup per range, not two).
        let mut key_at = 0usize;
        // What this post may hand to UCX; the rest waits in `deferred` for `pump`.
        let paced = peer
            .and_then(|p| self.peers.get(&p))
            .is_some_and(|s| s.paced);
        let mut budget = IssueBudget::new(self.window_bytes, paced, self.chunk_bytes);
        let mut deferred = 0u32;
        let (am_bytes, am_all, rndv) = peer
            .and_then(|p| self.peers.get(&p))
            .map_or((0, false, false), |s| {
                (s.am_msg_bytes, s.am_all, s.rndv_pieces)
            });
        for post in batch {
            let batch_post = am_bytes > 0
                && post.local_kind == MemKind::Dram
                && post.remote_kind == MemKind::Dram;
            let slot_index = self.take_slot().expect("checked capacity");
            if head == NONE {
                head = slot_index;
            }
            // Linked (and its peer known) before its ranges go: a batch message that
            // fails at once marks every request it carries (`batch.rs`).
            self.slots[slot_index as usize].next = NONE;
            self.slots[slot_index as usize].peer = peer;
            if tail != NONE {
                self.slots[tail as usize].next = slot_index;
            }
            let mut failure = None;
            let keys_at = key_at;
            key_at += post.ranges.len();
            for (index, range) in post.ranges.iter().enumerate() {
                if range.len == 0 {
                    continue;
                }
                let RemoteKey { rkey, mapped } = self.range_keys[keys_at + index];
                // The registered memh: UCX then skips its registration-cache lookup
                // for protocols that need the local buffer registered (zero-copy).
                let memh = self
                    .mem_index(range.local_token)
                    .and_then(|i| self.mems[i].as_ref())
                    .map_or(ptr::null_mut(), |mem| mem.memh);
                let mut piece = Deferred {
                    head,
                    slot: slot_index,
                    range: index as u32,
                    op: post.op,
                    ep,
                    rkey,
                    memh,
                    local_addr: range.local_addr,
                    remote_addr: range.remote_addr,
                    len: range.len,
                    am_bytes: if batch_post
                        && !mapped
                        && (am_all
                            || (range.len <= self.am.range_max
                                && range.len as usize + AM_RANGE_OVERHEAD_BYTES <= am_bytes))
                    {
                        am_bytes as u32
                    } else {
                        0
                    },
                    am_only: batch_post && !mapped && am_all,
                    rndv: batch_post
                        && !mapped
                        && am_all
                        && rndv
                        && post.op == ferry_backend_api::Op::Write,
                    dev: self.vram.piece_device(post, range),
                };
                if piece.am_only {
                    // Pieces of 256 KiB (a READ's travel in the reply).
                    piece.am_bytes = PIECE_MSG_BYTES;
                }
                if piece.am_bytes > 0 {
                    self.am_pack_piece(&mut piece, &mut budget);
                    if piece.len == 0 {
                        continue;
                    }
                    if piece.am_only || !budget.left() {
                        // The rest waits for a free message (or the next window).
                        self.deferred.push_back(piece);
                        deferred += 1;
                        continue;
                    }
                    // No batch message free: the (small) range takes the put path.
                }
                while piece.len > 0 && budget.left() {
                    let now = budget.step(piece.len);
                    if let Err(status) = self.issue(&piece, now) {
                        failure = Some(failure_of(status, false, Some(index as u32)));
                        break;
                    }
                    budget.spend(now);
                    piece.local_addr += now;
                    piece.remote_addr += now;
                    piece.len -= now;
                }
                if failure.is_some() {
                    break;
                }
                if piece.len > 0 {
                    self.deferred.push_back(piece);
                    deferred += 1;
                }
            }
            let slot = &mut self.slots[slot_index as usize];
            slot.state = SlotState::WaitFlush;
            slot.tag = Some(post.tag);
            slot.peer = peer;
            slot.failure = slot.failure.or(failure);
            slot.has_notif = post.notif.is_some();
            slot.reserved = peer.is_none() && post.notif.is_some();
            slot.notif.clear();
            if let Some(notif) = post.notif {
                slot.notif.extend_from_slice(notif);
            }
            slot.next = NONE;
            slot.deferred = 0;
            if tail != NONE {
                self.slots[tail as usize].next = slot_index;
            }
            tail = slot_index;
        }
        if let Some(peer) = peer {
            self.watch_started(peer, batch.len() as u32);
        }
        self.slots[head as usize].ep = ep;
        self.slots[head as usize].deferred = deferred;
        self.am_send_open();
        if deferred == 0 {
            self.flush_batch(head);
        }
        Ok(())
    }

    /// At debug level, the endpoint's full `ucp_ep_print_info` for the first request
    /// to `peer` that touches VRAM (whether UCX took `cuda_ipc`, `cuda_copy` or a host
    /// path for it; `error_handling=peer` can change that choice).
    fn log_first_vram(&mut self, peer: PeerId, ep: ucp_ep_h, batch: &[Post<'_>]) {
        if !log::log_enabled!(log::Level::Debug) {
            return;
        }
        let vram = batch
            .iter()
            .any(|p| p.local_kind == MemKind::Vram || p.remote_kind == MemKind::Vram);
        if !vram || self.peers.get(&peer).is_none_or(|s| s.vram_logged) {
            return;
        }
        let info = self.ep_info(ep);
        if let Some(state) = self.peers.get_mut(&peer) {
            state.vram_logged = true;
            log::debug!(
                "UCX: first VRAM request to '{}'; its endpoint:\n{info}",
                state.name
            );
        }
    }

    /// Hand `len` bytes from the start of `piece` to UCX, as puts/gets of at most
    /// `chunk_bytes`.
    fn issue(&self, piece: &Deferred, len: u64) -> std::result::Result<(), ucs_status_t> {
        let api = self.ucp.api();
        self.vram.bind_for(piece.dev);
        let mut param = request_param();
        if !piece.memh.is_null() {
            param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
            param.memh = piece.memh;
        }
        // Large ranges are issued in chunks: UCX pipelines several operations better
        // than one huge one (measured with UCX 1.13 over shm and tcp).
        let mut offset = 0u64;
        while offset < len {
            let chunk = (len - offset).min(self.chunk_bytes);
            // SAFETY: ep and rkey are live (a peer's deferred pieces are cut before its
            // endpoint closes and its rkeys go, see `cut_deferred`); the local range lies
            // inside a registered region (validated at post) and, per the backend
            // contract, stays valid until this request completes; the remote range was
            // published by the peer.
            let status = unsafe {
                match piece.op {
                    ferry_backend_api::Op::Write => api.ucp_put_nbx(
                        piece.ep,
                        (piece.local_addr + offset) as *const c_void,
                        chunk as usize,
                        piece.remote_addr + offset,
                        piece.rkey,
                        &param,
                    ),
                    ferry_backend_api::Op::Read => api.ucp_get_nbx(
                        piece.ep,
                        (piece.local_addr + offset) as *mut c_void,
                        chunk as usize,
                        piece.remote_addr + offset,
                        piece.rkey,
                        &param,
                    ),
                }
            };
            if ucs_ptr_is_ptr(status) {
                // Completion is observed through the flush; release the request.
                // SAFETY: we own this request and never touch it again.
                unsafe { api.ucp_request_free(status) };
            } else if ucs_ptr_is_err(status) {
                return Err(ucs_ptr_status(status));
            }
            offset += chunk;
        }
        Ok(())
    }

    /// Issue the flush that completes the batch starting at `head` (all of its ranges
    /// are with UCX): when it completes, every put/get issued on the endpoint before it
    /// has.
    fn flush_batch(&mut self, head: u32) {
        let api = self.ucp.api();
        let ep = self.slots[head as usize].ep;
        let mut param = request_param();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = Some(on_op_done);
        param.user_data = self.cells.get(head * 2) as *const OpCell as *mut c_void;
        // SAFETY: ep live; the user_data cell outlives the request (see Events).
        let request = unsafe { api.ucp_ep_flush_nbx(ep, &param) };
        if !ucs_ptr_is_ptr(request) {
            self.batch_flushed(head, ucs_ptr_status(request));
        }
    }

    /// Pack as much of `piece` into batch messages as the window and the free messages
    /// allow: whole if it is small, else in pieces of one message each (`am_only`).
    /// Advances `piece` past what went.
    fn am_pack_piece(&mut self, piece: &mut Deferred, budget: &mut IssueBudget) {
        let cap = if piece.rndv {
            self.am.rndv_piece
        } else {
            (piece.am_bytes as usize - AM_RANGE_OVERHEAD_BYTES) as u64
        };
        while piece.len > 0 && budget.left() {
            if piece.am_only && self.am.in_flight() >= PIECES_IN_FLIGHT_MAX {
                return;
            }
            let now = if piece.am_only {
                piece.len.min(cap)
            } else {
                piece.len
            };
            if !self.am_pack(
                piece.op,
                piece.head,
                piece.slot,
                piece.ep,
                piece.local_addr,
                piece.remote_addr,
                now,
                piece.am_bytes as usize,
                piece.rndv,
            ) {
                return;
            }
            budget.spend(now);
            piece.local_addr += now;
            piece.remote_addr += now;
            piece.len -= now;
        }
    }

    /// Hand deferred ranges to UCX, at most one window. Returns whether it did.
    pub(super) fn issue_deferred(&mut self) -> bool {
        let mut budget = IssueBudget::new(self.window_bytes, false, self.chunk_bytes);
        let mut any = false;
        while budget.left() {
            let Some(piece) = self.deferred.front() else {
                break;
            };
            let piece = *piece;
            let (head, slot) = (piece.head, piece.slot as usize);
            let mut done = self.slots[slot].failure.is_some();
            if !done && piece.am_bytes > 0 {
                let mut rest = piece;
                self.am_pack_piece(&mut rest, &mut budget);
                any |= rest.len < piece.len;
                *self.deferred.front_mut().expect("present") = rest;
                done = rest.len == 0;
                if !done && (rest.am_only || !budget.left()) {
                    // Waits for a free message (acks free them) or the next window.
                    break;
                }
            }
            let piece = *self.deferred.front().expect("present");
            if !done {
                let piece = &piece;
                let now = budget.step(piece.len);
                match self.issue(piece, now) {
                    Ok(()) => {
                        budget.spend(now);
                        let piece = self.deferred.front_mut().expect("present");
                        piece.local_addr += now;
                        piece.remote_addr += now;
                        piece.len -= now;
                        done = piece.len == 0;
                    }
                    Err(status) => {
                        let range = Some(piece.range);
                        self.slots[slot].failure = Some(failure_of(status, false, range));
                        done = true;
                    }
                }
                any = true;
            }
            if done {
                self.deferred.pop_front();
                self.piece_done(head);
            }
        }
        self.am_send_open();
        any
    }

    /// One deferred range of the batch at `head` is with UCX (or dropped): flush the
    /// batch once none is left.
    fn piece_done(&mut self, head: u32) {
        let slot = &mut self.slots[head as usize];
        slot.deferred -= 1;
        if slot.deferred == 0 {
            self.flush_batch(head);
        }
    }

    /// Drop the deferred ranges that go to `ep` (about to be closed: its rkeys go too),
    /// failing their requests with `status`; their batches are flushed now, while the
    /// endpoint is still open, so each is reported from its flush's callback as usual.
    pub(super) fn cut_deferred(&mut self, ep: ucp_ep_h, status: ucs_status_t) {
        if !self.deferred.iter().any(|piece| piece.ep == ep) {
            return;
        }
        let mut kept = VecDeque::with_capacity(self.deferred.len());
        let mut cut: Vec<u32> = Vec::new();
        for piece in std::mem::take(&mut self.deferred) {
            if piece.ep == ep {
                let slot = &mut self.slots[piece.slot as usize];
                slot.failure.get_or_insert(failure_of(status, true, None));
                cut.push(piece.head);
            } else {
                kept.push_back(piece);
            }
        }
        self.deferred = kept;
        for head in cut {
            self.piece_done(head);
        }
    }

    /// The flush of the batch starting at `head` finished with `status`: the batch is
    /// complete unless some of its batch messages wait for their ack.
    pub(super) fn batch_flushed(&mut self, head: u32, status: ucs_status_t) {
        let slot = &mut self.slots[head as usize];
        if slot.acks > 0 {
            slot.flushed = Some(status);
            return;
        }
        self.batch_complete(head, status);
    }

    /// Every part of the batch starting at `head` is done (`status`: its flush's).
    pub(super) fn batch_complete(&mut self, head: u32, status: ucs_status_t) {
        let mut index = head;
        while index != NONE {
            let next = self.slots[index as usize].next;
            let peer = self.slots[index as usize].peer;
            let peer_gone = self.peer_gone(peer);
            let slot = &mut self.slots[index as usize];
            if slot.failure.is_none() && (status.is_err() || peer_gone) {
                slot.failure = Some(failure_of(
                    if status.is_err() {
                        status
                    } else {
                        ucs_status_t::UCS_ERR_CONNECTION_RESET
                    },
                    peer_gone,
                    None,
                ));
            }
            if slot.failure.is_none() && slot.has_notif {
                self.send_notif(index);
            } else {
                self.finish(index);
            }
            index = next;
        }
    }

    pub(super) fn peer_gone(&self, peer: Option<PeerId>) -> bool {
        match peer {
            None => false,
            Some(p) => self
                .peers
                .get(&p)
                .is_none_or(|s| s.down.is_some() || s.ep.is_null()),
        }
    }

    /// Reserve inbox room for the notifications of a batch to this agent itself: all
    /// or none (`Capacity`, nothing posted).
    fn reserve_own_notifs(&mut self, batch: &[Post<'_>]) -> Result<()> {
        let name = self.agent_name.len();
        let mut inbox = self.events.inbox.lock().unwrap_or_else(|e| e.into_inner());
        for (i, post) in batch.iter().enumerate() {
            let Some(notif) = post.notif else { continue };
            if !inbox.reserve(name + notif.len()) {
                for earlier in &batch[..i] {
                    if let Some(n) = earlier.notif {
                        inbox.unreserve(name + n.len());
                    }
                }
                return Err(Error::Capacity {
                    what: "UCX notification inbox (parameters notif_queue, notif_queue_bytes)",
                    limit: inbox.entries_max(),
                });
            }
        }
        Ok(())
    }

    /// Report the slot's outcome (if it has a tag) and free it.
    pub(super) fn finish(&mut self, index: u32) {
        if let Some(peer) = self.slots[index as usize].peer {
            self.watch_ended(peer);
        }
        if std::mem::take(&mut self.slots[index as usize].reserved) {
            // Failed before its notification: the room goes back.
            let need = self.agent_name.len() + self.slots[index as usize].notif.len();
            self.events
                .inbox
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .unreserve(need);
        }
        let slot = &mut self.slots[index as usize];
        debug_assert!(slot.state != SlotState::Free);
        if let Some(tag) = slot.tag {
            self.ready.push(Completion {
                tag,
                result: slot.failure.map_or(Ok(()), Err),
            });
        }
        slot.state = SlotState::Free;
        slot.tag = None;
        slot.failure = None;
        slot.has_notif = false;
        slot.next = NONE;
        slot.ep = ptr::null_mut();
        slot.deferred = 0;
        debug_assert_eq!(slot.acks, 0, "a slot freed with batch messages pending");
        slot.flushed = None;
        self.free_slots.push(index);
    }

    /// Progress every worker (bounded) and turn callback events into completions.
    /// Returns whether anything happened.
    pub(crate) fn pump(&mut self) -> bool {
        self.watch_tick();
        let api = self.ucp.api();
        let mut progressed = false;
        let started = Instant::now();
        let calls = self.events.calls.load(Ordering::Relaxed);
        for worker in &self.workers {
            for round in 1..=PROGRESS_ROUNDS_MAX {
                // SAFETY: worker live; callbacks only push into `events`.
                if unsafe { api.ucp_worker_progress(worker.handle) } == 0 {
                    break;
                }
                progressed = true;
                if round % PROGRESS_CLOCK_ROUNDS == 0 && started.elapsed() > PROGRESS_BUDGET {
                    break;
                }
            }
        }
        self.ucx_own_work = progressed && self.events.calls.load(Ordering::Relaxed) == calls;
        let buried = !self.graves.is_empty() && self.reap_graves() > 0;
        let wired = !self.wiring.is_empty() && self.advance_wireups();
        let issued = !self.deferred.is_empty() && self.issue_deferred();
        let handled = self.handle_events();
        let any = progressed | handled | buried | wired | issued | self.watch_expire();
        self.last_pump = started;
        if any {
            self.last_work = started;
        }
        any
    }

    /// Whether the caller's progress may skip this pump: nothing of ours is pending (no
    /// request in flight, no completion to hand over, no wireup, close or deferred post
    /// to advance), no pump has found work for [`QUIET_AFTER`], and the workers were
    /// progressed less than [`REST_POLL`] ago. Work that arrives unasked (a peer's
    /// request served by our messages, a notification, a connection) is then seen by
    /// the next pump at most `REST_POLL` later, and from there on every call pumps
    /// again until the workers have been quiet for `QUIET_AFTER`. Our own requests never
    /// wait for it: one in flight ends the rest. The progress thread, a drop's flush and
    /// the neighbours' pumps always pump.
    /// The clock is read only when nothing is pending, so a busy backend pays nothing
    /// for the check.
    pub(crate) fn resting(&mut self) -> bool {
        let idle = self.in_flight() == 0
            && self.ready.is_empty()
            && self.graves.is_empty()
            && self.wiring.is_empty()
            && self.deferred.is_empty();
        if !idle {
            return false;
        }
        let now = Instant::now();
        let rest = now.saturating_duration_since(self.last_work) >= QUIET_AFTER
            && now.saturating_duration_since(self.last_pump) < REST_POLL;
        self.rested += u64::from(rest);
        rest
    }

    pub(super) fn handle_events(&mut self) -> bool {
        let mut any = false;
        if self.events.ep_error.swap(false, Ordering::AcqRel) {
            any = true;
            let failed: Vec<(PeerId, i8)> = self
                .peers
                .iter()
                .filter(|(_, s)| s.down.is_none())
                .filter_map(|(&p, s)| {
                    let status = s
                        .link
                        .as_ref()
                        .map_or(0, |l| l.status.load(Ordering::Acquire));
                    (status != 0).then_some((p, status))
                })
                .collect();
            for (peer, status) in failed {
                let status = ucs_status_t(status);
                if let Some(state) = self.peers.get_mut(&peer) {
                    log::warn!(
                        "UCX: peer '{}' disconnected: {}",
                        state.name,
                        self.ucp.status_string(status)
                    );
                    state.down = Some(status);
                }
                self.teardown_peer(peer);
            }
        }
        while let Some((cell, status)) = self.events.completions.pop(|i| self.cells.get(i)) {
            any = true;
            self.cell_done(cell, status);
        }
        any |= self.am_take_acks();
        if self.events.completions.overflowed() {
            for cell in self.cells.made() {
                if let Some(status) = self.cells.get(cell).take() {
                    any = true;
                    self.cell_done(cell, status);
                }
            }
        }
        any
    }

    /// The request of callback cell `cell` finished with `status`.
    fn cell_done(&mut self, cell: u32, status: ucs_status_t) {
        if let Some(m) = self.am_cell(cell) {
            self.am_sent(m, status);
            return;
        }
        let slot = cell / 2;
        if cell & 1 == 0 {
            self.batch_flushed(slot, status);
        } else {
            self.notif_sent(slot, status);
        }
    }

    /// Arm every worker for sleeping on its event fd. False if some worker has events
    /// pending (progress again instead of sleeping).
    /// Pings answered so far (see `BatchEvents::pings`).
    pub(crate) fn pings_answered(&self) -> u64 {
        self.events.batch.pings.load(Ordering::Relaxed)
    }

    /// Whether the last [`Core::pump`] saw UCX make progress that ran none of our
    /// callbacks (`Events::calls`): UCX's own work, such as an endpoint's wireup.
    pub(crate) fn ucx_own_work(&self) -> bool {
        self.ucx_own_work
    }

    pub(crate) fn arm(&mut self) -> bool {
        let api = self.ucp.api();
        for worker in &self.workers {
            // SAFETY: worker live and created with WAKEUP.
            let status = unsafe { api.ucp_worker_arm(worker.handle) };
            if status == ucs_status_t::UCS_ERR_BUSY {
                return false;
            }
        }
        true
    }

    /// Move finished completions into `done`.
    pub(crate) fn drain_ready(&mut self, done: &mut Completions) {
        for completion in self.ready.as_slice() {
            done.push(*completion);
        }
        self.ready.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn posts_are_paced_where_puts_go_over_tcp() {
        assert!(rma_over_tcp("tcp/lo [rma_bw#0 am keepalive]"));
        assert!(rma_over_tcp("cma/memory [am], tcp/lo [rma#0]"));
        assert!(!rma_over_tcp(
            "tcp/lo [am keepalive], cma/memory [rma_bw#0]"
        ));
        assert!(!rma_over_tcp(
            "sysv/memory [rma#0 am], cma/memory [rma_bw#0]"
        ));
        assert!(!rma_over_tcp(""));
    }

    #[test]
    fn a_timed_budget_steps_and_stops_once_its_time_is_spent() {
        let mut budget = IssueBudget::new(4 << 20, true, 1 << 20);
        assert_eq!(budget.step(16 << 20), ISSUE_STEP_BYTES);
        assert_eq!(budget.step(100), 100);
        // Small spends below the clock interval never stop it, however late.
        std::thread::sleep(ISSUE_BUDGET * 2);
        budget.spend(ISSUE_CLOCK_BYTES - 1);
        assert!(budget.left());
        // The next spend crosses the interval, reads the clock and ends the budget.
        budget.spend(1);
        assert!(!budget.left());
        assert_eq!(budget.step(1 << 20), 0);
    }

    #[test]
    fn an_untimed_or_unbounded_budget_counts_bytes_only() {
        let mut pump = IssueBudget::new(1 << 20, false, 1 << 20);
        assert_eq!(pump.step(16 << 20), 1 << 20);
        std::thread::sleep(ISSUE_BUDGET * 2);
        pump.spend(512 << 10);
        assert!(pump.left());
        pump.spend(512 << 10);
        assert!(!pump.left());
        assert_eq!(pump.step(1 << 20), 0);
        // post_window_bytes=0: everything in the post, no clock.
        let mut all = IssueBudget::new(u64::MAX, true, 1 << 20);
        assert_eq!(all.step(64 << 20), 64 << 20);
        std::thread::sleep(ISSUE_BUDGET * 2);
        all.spend(64 << 20);
        assert!(all.left());
    }

    #[test]
    fn an_untimed_window_ends_a_piece_at_a_chunk_boundary_not_at_its_edge() {
        // What a timed post left of a 1 MiB range, then the next 1 MiB range: both whole.
        let mut pump = IssueBudget::new(1 << 20, false, 1 << 20);
        assert_eq!(pump.step(768 << 10), 768 << 10);
        pump.spend(768 << 10);
        assert_eq!(pump.step(1 << 20), 1 << 20);
        pump.spend(1 << 20);
        assert!(!pump.left());
        // A long merged range is still cut into windows of one chunk.
        let pump = IssueBudget::new(1 << 20, false, 1 << 20);
        assert_eq!(pump.step(32 << 20), 1 << 20);
        // Less than a chunk left of a larger window: one more whole chunk.
        let mut pump = IssueBudget::new(4 << 20, false, 1 << 20);
        pump.spend((3 << 20) + (512 << 10));
        assert_eq!(pump.step(32 << 20), 1 << 20);
        // Small ranges fill the window as before.
        let pump = IssueBudget::new(1 << 20, false, 1 << 20);
        assert_eq!(pump.step(4096), 4096);
        // Chunks larger than the window: pieces of one window, never a whole chunk.
        let mut pump = IssueBudget::new(1 << 20, false, 32 << 20);
        assert_eq!(pump.step(64 << 20), 1 << 20);
        pump.spend(512 << 10);
        assert_eq!(pump.step(64 << 20), 1 << 20);
        // A window smaller than a chunk cuts at its edge, in pieces of at least a window.
        let mut pump = IssueBudget::new(4096, false, 1 << 20);
        pump.spend(1000);
        assert_eq!(pump.step(20_000), 4096);
    }
}
