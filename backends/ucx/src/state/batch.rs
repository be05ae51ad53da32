//! Batched small transfers: the small ranges of one posted batch to one peer travel
//! packed into active messages instead of one `ucp_put_nbx` / `ucp_get_nbx` each.
//!
//! # Why
//!
//! On shared memory and TCP, UCX carries a small put as an active message of its own
//! (software emulation, ~80–100 ns and one message per range). Packing many ranges into
//! one message of at most `am_batch_bytes` (by default 16 KiB where the active messages
//! go over shared memory, 64 KiB over tcp: [`am_batch_bytes_for`]) costs a memcpy at
//! each end and one message.
//! On RDMA transports a put needs no target CPU, so there batching is off (see
//! [`am_batch_suits`]).
//!
//! # Protocol (wire format in `crate::wire`)
//!
//! - **Initiator.** A range of a WRITE to a peer whose endpoint suits batching, DRAM on
//!   both sides, of at most `am_batch_range_bytes`, is copied into the open message of
//!   its batch (a pooled buffer: `am_batch_messages` of them, allocated on first use
//!   and reused). A message belongs to one batch; it is sent (eager, with a reply
//!   endpoint) when full, when the batch's ranges are all issued, or at the end of a
//!   window. The head slot of the batch counts its messages without an ack (`acks`);
//!   the batch completes when its flush (the existing path, for its puts) **and** every
//!   ack are in, so notifications still go after all data. With no free message a
//!   range takes the put path.
//! - **Target.** The AM handler checks the whole message (every length against the
//!   message, every range fully inside memory registered with this backend, from the
//!   [`RegionIndex`] kept beside the callbacks), copies the ranges only if all pass, and
//!   answers on UCX's reply endpoint with an ack (cookie, status). It works inside the
//!   callback: the reply endpoint is only sure to be valid there, the data need not be
//!   kept, and the region index cannot change meanwhile (registration and progress
//!   both hold the core). A refused message writes nothing and is counted
//!   ([`BatchEvents::refused`]); the initiator's request fails with
//!   [`FailureKind::Backend`] and errno `EFAULT` (outside registered memory) or `EPROTO`
//!   (malformed).
//! - **READ** works the same way with a request message listing (target address,
//!   length) and at most `am_batch_bytes` of data in all; the target checks every range
//!   as above and replies with one message carrying the data (reply buffers are pooled,
//!   [`REPLY_POOL_MAX`] kept for reuse). The initiator's reply handler scatters the
//!   data into the local ranges the message was posted with, found by cookie in
//!   `BatchEvents::reads` — under a lock that the core also takes to forget a message's
//!   cookie before its request may complete (failure, unload), so a late reply never
//!   writes into memory the caller may have reused. Then it queues the ack.
//! - **Acks** arrive in a bounded queue ([`BatchEvents`]) that `Core::pump` drains. An
//!   ack whose cookie (message index + generation) names no message waiting for one is
//!   ignored and counted. When a peer's endpoint closes (unload, death, deadline), its
//!   messages still waiting for an ack fail their requests (remote-disconnect) once,
//!   and a message's buffer returns to the pool only after UCX reported its send.
//!
//! - **Lost acks**: a target that cannot answer (no reply endpoint, a failed ack send —
//!   counted in `unsent_acks`) or a peer whose build has no handler for these ids (UCX
//!   drops the message) leaves the request waiting until its endpoint closes (unload,
//!   failure) or, if nothing else completes on the endpoint, `peer_timeout_ms` ends it
//!   with remote-disconnect. (UCX always hands a reply endpoint when the sender asks
//!   for one, as ours do; an ack send fails when the link does.)
//!
//! Bounds: messages in flight (`am_batch_messages`), the ack queue (as many), the
//! target's ack buffers ([`ACK_POOL_LEN`]; beyond, an ack's 16-byte buffer is allocated
//! and counted rather than lost), a READ reply (at most
//! [`wire::BATCH_READ_DATA_MAX`] whatever a peer asks).

use std::cell::UnsafeCell;

use super::callbacks::{am_received, AmReceived};
use super::*;
use crate::wire::{self, BatchStatus};
use crate::AmBatchMode;

/// Smallest WRITE piece sent by rendezvous (`am_tcp_rndv`); a shorter one (the tail of
/// a range) is packed into a message and copied, as small ranges are.
pub(super) const RNDV_PIECE_MIN: u64 = 64 << 10;

/// Ack buffers a target keeps for sends UCX has not completed yet.
pub(super) const ACK_POOL_LEN: usize = 1024;
/// READ reply buffers a target keeps for reuse (more may be in flight; those are freed).
const REPLY_POOL_MAX: usize = 64;

/// Memory registered (DRAM) with this backend, as the AM handler checks a peer's target
/// ranges against it: a range must lie inside the union of registered regions.
pub(crate) struct RegionIndex {
    /// (start, end) of each registration, in no order.
    regions: Vec<(u64, u64)>,
    /// Sorted, disjoint union of `regions`; rebuilt on the first check after a change.
    union: Vec<(u64, u64)>,
    dirty: bool,
}

impl RegionIndex {
    pub(super) fn new() -> RegionIndex {
        RegionIndex {
            regions: Vec::new(),
            union: Vec::new(),
            dirty: false,
        }
    }

    pub(super) fn add(&mut self, addr: u64, len: u64) {
        self.regions.push((addr, addr.saturating_add(len)));
        self.dirty = true;
    }

    pub(super) fn remove(&mut self, addr: u64, len: u64) {
        let key = (addr, addr.saturating_add(len));
        if let Some(i) = self.regions.iter().position(|&r| r == key) {
            self.regions.swap_remove(i);
            self.dirty = true;
        }
    }

    /// Rebuild the sorted union now if a registration changed since it was built, so
    /// the first batch after the change finds it built. Called when the agent hands out
    /// its metadata (`conn_info`): a peer sends batches only after loading it, and
    /// a rebuild then (sorting every registration: about 15 µs for 1,000) would delay
    /// the first request's completion.
    #[inline]
    pub(crate) fn settle(&mut self) {
        if self.dirty {
            self.rebuild();
        }
    }

    #[cold]
    #[inline(never)]
    fn rebuild(&mut self) {
        self.union.clear();
        self.union.extend_from_slice(&self.regions);
        self.union.sort_unstable();
        let mut merged = 0usize;
        for i in 0..self.union.len() {
            let (start, end) = self.union[i];
            if merged > 0 && start <= self.union[merged - 1].1 {
                let last = &mut self.union[merged - 1];
                last.1 = last.1.max(end);
            } else {
                self.union[merged] = (start, end);
                merged += 1;
            }
        }
        self.union.truncate(merged);
        self.dirty = false;
    }

    /// Whether `[addr, addr + len)` lies inside registered memory.
    pub(super) fn covers(&mut self, addr: u64, len: u64) -> bool {
        self.settle();
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        let i = self.union.partition_point(|&(start, _)| start <= addr);
        i > 0 && end <= self.union[i - 1].1
    }
}

type AmSendFn = unsafe extern "C" fn(
    ucp_ep_h,
    std::ffi::c_uint,
    *const c_void,
    usize,
    *const c_void,
    usize,
    *const ucp_request_param_t,
) -> ucs_status_ptr_t;

type RecvDataFn = unsafe extern "C" fn(
    ucp_worker_h,
    *mut c_void,
    *mut c_void,
    usize,
    *const ucp_request_param_t,
) -> ucs_status_ptr_t;

/// The `arg` of a worker's [`wire::BATCH_WRITE_ONE_AM_ID`] handler (one per worker, in
/// its `Worker`, freed after the worker): a rendezvous piece is received on the worker
/// that got its announcement.
pub(super) struct WorkerArg {
    pub(super) events: *const Events,
    pub(super) worker: ucp_worker_h,
}

/// A rendezvous receive in flight (the `user_data` of its `ucp_am_recv_data_nbx`).
struct RndvRecv {
    events: *const Events,
    /// The target range, [start, end).
    range: (u64, u64),
    /// Where the ack goes once the data has landed: the message's reply endpoint (the
    /// receive runs on it, so it lives while the receive can still succeed) and cookie.
    reply_ep: Option<ucp_ep_h>,
    cookie: Option<u64>,
}

/// Rendezvous receives into registered memory that UCX has not completed yet: a
/// withdrawal of a region they overlap waits for them ([`BatchEvents::receiving_into`]).
#[derive(Default)]
struct RndvRecvs {
    /// Target range [start, end), worker and reply endpoint of each.
    in_flight: Vec<((u64, u64), ucp_worker_h, Option<ucp_ep_h>)>,
    /// Boxes of finished receives, for reuse (a box's address travels through UCX).
    #[allow(clippy::vec_box)]
    pool: Vec<Box<RndvRecv>>,
}

/// One ack's send buffer (the `user_data` of its send).
pub(super) struct AckBuf {
    events: *const Events,
    /// Index in the pool; `u32::MAX` for one allocated because the pool was empty.
    index: u32,
    bytes: UnsafeCell<[u8; wire::BATCH_ACK_LEN_BYTES]>,
}

/// What the batch AM handlers and ack sends touch (inside [`Events`]).
pub(crate) struct BatchEvents {
    regions: Mutex<RegionIndex>,
    /// Acks received: (cookie, status), for `Core::pump`.
    acks_in: ArrayQueue<(u64, u32)>,
    /// Batch messages from peers this backend refused (malformed, or a range outside
    /// registered memory); nothing of them was written.
    pub(crate) refused: AtomicU64,
    /// Acks not taken: malformed, or the ack queue was full.
    pub(crate) dropped_acks: AtomicU64,
    /// Acks this target could not send (no reply endpoint, or the send failed).
    pub(crate) unsent_acks: AtomicU64,
    /// Acks whose buffer was allocated because the pool was empty.
    pub(crate) allocated_acks: AtomicU64,
    /// Answers to this initiator's pings ([`wire::PING_COOKIE`]) so far.
    pub(super) pongs: AtomicU64,
    /// Pings this target answered: each a peer that just loaded us (its requests are
    /// likely to follow; the progress thread keeps awake for them).
    pub(crate) pings: AtomicU64,
    /// READ replies whose buffer was allocated (none free in the pool).
    pub(crate) allocated_replies: AtomicU64,
    ack_pool: Box<[AckBuf]>,
    free_acks: ArrayQueue<u32>,
    /// Initiator: per batch message, where a READ reply's data goes.
    reads: Mutex<Vec<ReadWait>>,
    /// Target: READ reply buffers for reuse. Boxed on purpose: a box's address is what
    /// travels through UCX as `user_data`, taken back without allocating.
    #[allow(clippy::vec_box)]
    replies: Mutex<Vec<Box<ReplyBuf>>>,
    /// Target: rendezvous receives in flight, at most `rndv_max` (`am_tcp_rndv_receives_max`:
    /// a peer announcing pieces it never sends cannot make this grow without bound).
    rndv: Mutex<RndvRecvs>,
    rndv_max: usize,
    /// Rendezvous pieces refused because `rndv_max` receives were in flight.
    pub(crate) rndv_refused: AtomicU64,
    /// Rendezvous pieces received into a region, and those whose receive failed.
    pub(crate) rndv_received: AtomicU64,
    pub(crate) rndv_failed: AtomicU64,
    am_send: AmSendFn,
    recv_data: RecvDataFn,
    request_free: unsafe extern "C" fn(*mut c_void),
}

/// Where the data of a READ batch message's reply goes (initiator).
#[derive(Default)]
pub(super) struct ReadWait {
    /// The message's cookie while its reply is awaited.
    cookie: Option<u64>,
    /// Bytes the reply must carry.
    data_bytes: usize,
    /// (local address, length) per range, in request order.
    locals: Vec<(u64, u32)>,
}

/// A READ reply's send buffer (the `user_data` of its send).
struct ReplyBuf {
    events: *const Events,
    bytes: Vec<u8>,
}

impl BatchEvents {
    /// State for `messages` initiator messages in flight; `events` is where the
    /// enclosing [`Events`] will live.
    pub(super) fn new(
        api: &UcpApi,
        events: *const Events,
        messages: usize,
        rndv_max: usize,
    ) -> BatchEvents {
        let free_acks = ArrayQueue::new(ACK_POOL_LEN);
        for i in 0..ACK_POOL_LEN as u32 {
            let _ = free_acks.push(i);
        }
        BatchEvents {
            regions: Mutex::new(RegionIndex::new()),
            acks_in: ArrayQueue::new(messages.max(1)),
            refused: AtomicU64::new(0),
            dropped_acks: AtomicU64::new(0),
            unsent_acks: AtomicU64::new(0),
            allocated_acks: AtomicU64::new(0),
            pongs: AtomicU64::new(0),
            pings: AtomicU64::new(0),
            allocated_replies: AtomicU64::new(0),
            reads: Mutex::new((0..messages).map(|_| ReadWait::default()).collect()),
            replies: Mutex::new(Vec::with_capacity(REPLY_POOL_MAX)),
            ack_pool: (0..ACK_POOL_LEN as u32)
                .map(|index| AckBuf {
                    events,
                    index,
                    bytes: UnsafeCell::new([0; wire::BATCH_ACK_LEN_BYTES]),
                })
                .collect(),
            free_acks,
            rndv: Mutex::new(RndvRecvs::default()),
            rndv_max,
            rndv_refused: AtomicU64::new(0),
            rndv_received: AtomicU64::new(0),
            rndv_failed: AtomicU64::new(0),
            am_send: api.ucp_am_send_nbx,
            recv_data: api.ucp_am_recv_data_nbx,
            request_free: api.ucp_request_free,
        }
    }

    /// The index of registered DRAM the handlers check ranges against.
    pub(super) fn regions(&self) -> std::sync::MutexGuard<'_, RegionIndex> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where each READ message's reply goes (by message index).
    fn reads(&self) -> std::sync::MutexGuard<'_, Vec<ReadWait>> {
        self.reads.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rendezvous receives in flight.
    pub(super) fn rndv_in_flight(&self) -> usize {
        self.rndv
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .in_flight
            .len()
    }

    /// The endpoints (with their workers) rendezvous receives in flight run on, each
    /// once.
    pub(super) fn rndv_endpoints(&self) -> Vec<(ucp_worker_h, ucp_ep_h)> {
        let mut eps: Vec<(ucp_worker_h, ucp_ep_h)> = self
            .rndv
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .in_flight
            .iter()
            .filter_map(|&(_, worker, ep)| Some((worker, ep?)))
            .collect();
        eps.sort_unstable();
        eps.dedup();
        eps
    }

    /// Whether a rendezvous receive into [addr, addr + len) is in flight.
    pub(super) fn receiving_into(&self, addr: u64, len: u64) -> bool {
        let end = addr.saturating_add(len);
        self.rndv
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .in_flight
            .iter()
            .any(|&((start, stop), _, _)| start < end && addr < stop)
    }

    /// A target handler's answer to message `got` with `cookie` (its first 8 bytes, if
    /// it had them): `status` counted if a refusal, then acked on the reply endpoint, or
    /// counted as unsent where there is no cookie or no endpoint.
    fn answer(&self, got: &AmReceived<'_>, cookie: Option<&[u8; 8]>, status: BatchStatus) {
        if status != BatchStatus::Written {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        match (cookie, got.reply_ep) {
            (Some(cookie), Some(ep)) => {
                self.send_ack(got.events_ptr, ep, u64::from_le_bytes(*cookie), status)
            }
            _ => {
                self.unsent_acks.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Send an ack on `ep` (a reply endpoint, valid for the duration of the handler).
    fn send_ack(&self, events: *const Events, ep: ucp_ep_h, cookie: u64, status: BatchStatus) {
        let buf: *const AckBuf = match self.free_acks.pop() {
            Some(i) => &self.ack_pool[i as usize],
            None => {
                self.allocated_acks.fetch_add(1, Ordering::Relaxed);
                Box::into_raw(Box::new(AckBuf {
                    events,
                    index: u32::MAX,
                    bytes: UnsafeCell::new([0; wire::BATCH_ACK_LEN_BYTES]),
                }))
            }
        };
        // SAFETY: `buf` is ours alone until it is released (popped from the free list or
        // just allocated); nothing else reads or writes its bytes meanwhile.
        let bytes = unsafe {
            *(*buf).bytes.get() = wire::encode_ack(cookie, status);
            (*buf).bytes.get() as *const c_void
        };
        let mut param = request_param();
        param.op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_AM_SEND_FLAG_EAGER;
        param.cb.send = Some(on_ack_sent);
        param.user_data = buf as *mut c_void;
        // SAFETY: `ep` is the reply endpoint UCX handed to the running handler; the buffer
        // stays untouched until the send's callback (or the immediate return) releases it.
        let request = unsafe {
            (self.am_send)(
                ep,
                wire::BATCH_ACK_AM_ID,
                ptr::null(),
                0,
                bytes,
                wire::BATCH_ACK_LEN_BYTES,
                &param,
            )
        };
        if !ucs_ptr_is_ptr(request) {
            if ucs_ptr_is_err(request) {
                self.unsent_acks.fetch_add(1, Ordering::Relaxed);
            }
            // SAFETY: UCX is done with the buffer (completed or failed at once).
            unsafe { release_ack(buf) };
        }
    }

    /// A rendezvous piece announced to `arg`'s worker: check its range like an eager
    /// one's, then have UCX receive the data straight into it. A refused piece is
    /// answered at once (and not received: UCX completes the sender's send without
    /// data); an accepted one is acked when its data has landed ([`rndv_done`]). The
    /// initiator counts the piece done only when both the ack and its send's completion
    /// are in.
    ///
    /// # Safety
    ///
    /// Called from the handler with the worker's `arg`, `data_desc`/`length` as UCX
    /// passed them for a rendezvous message.
    unsafe fn receive_rndv(
        &self,
        arg: &WorkerArg,
        got: &AmReceived<'_>,
        data_desc: *mut c_void,
        length: usize,
    ) {
        let cookie = got.header.first_chunk::<8>();
        let Ok((_, addr, len)) = wire::parse_batch_write_one_header(got.header, length) else {
            self.answer(got, cookie, BatchStatus::Malformed);
            return;
        };
        let cell = {
            let mut regions = self.regions();
            if !regions.covers(addr, len as u64) {
                drop(regions);
                self.answer(got, cookie, BatchStatus::OutsideRegistered);
                return;
            }
            // Recorded under the regions lock: a withdrawal either sees it or its region
            // is gone from the index before the check above.
            let mut recvs = self.rndv.lock().unwrap_or_else(|e| e.into_inner());
            if recvs.in_flight.len() >= self.rndv_max {
                drop((recvs, regions));
                self.rndv_refused.fetch_add(1, Ordering::Relaxed);
                self.answer(got, cookie, BatchStatus::Busy);
                return;
            }
            let range = (addr, addr + len as u64);
            recvs.in_flight.push((range, arg.worker, got.reply_ep));
            let mut cell = recvs.pool.pop().unwrap_or_else(|| {
                Box::new(RndvRecv {
                    events: arg.events,
                    range,
                    reply_ep: None,
                    cookie: None,
                })
            });
            cell.range = range;
            cell.reply_ep = got.reply_ep;
            cell.cookie = cookie.map(|c| u64::from_le_bytes(*c));
            Box::into_raw(cell)
        };
        let mut param = request_param();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.recv_am = Some(on_rndv_received);
        param.user_data = cell as *mut c_void;
        // SAFETY: the worker is the one running this handler; `data_desc` is its
        // rendezvous descriptor, received once; the range lies in memory registered with
        // this backend (checked above; a withdrawal of it waits for this receive), which
        // the caller keeps valid and lets peers write; the cell lives until the callback.
        let request =
            unsafe { (self.recv_data)(arg.worker, data_desc, addr as *mut c_void, len, &param) };
        if !ucs_ptr_is_ptr(request) {
            // SAFETY: UCX will not call back for a receive that ended at once; the reply
            // endpoint is valid (still in the handler).
            unsafe { rndv_done(cell, ucs_ptr_status(request)) };
        }
    }
}

/// A rendezvous receive ended: forget it (a withdrawal may go on), count it, and ack a
/// landed one on its reply endpoint. A failed one is not acked: its endpoint may be gone
/// (the receive runs on it), and the initiator learns of the failure from its send,
/// which UCX fails too, or from its endpoint.
///
/// # Safety
///
/// `cell` came from [`BatchEvents::receive_rndv`] and UCX no longer uses it; once. Called
/// from the handler or from the receive's completion callback (the reply endpoint is
/// alive in both: the receive just succeeded on it).
unsafe fn rndv_done(cell: *mut RndvRecv, status: ucs_status_t) {
    // SAFETY: per the contract, the box is live and ours again.
    let cell = unsafe { Box::from_raw(cell) };
    let events_ptr = cell.events;
    // SAFETY: `events` outlives every worker.
    let batch = unsafe { &(*events_ptr).batch };
    if status.is_ok() {
        batch.rndv_received.fetch_add(1, Ordering::Relaxed);
        match (cell.reply_ep, cell.cookie) {
            (Some(ep), Some(cookie)) => {
                batch.send_ack(events_ptr, ep, cookie, BatchStatus::Written)
            }
            _ => {
                batch.unsent_acks.fetch_add(1, Ordering::Relaxed);
            }
        }
    } else {
        batch.rndv_failed.fetch_add(1, Ordering::Relaxed);
    }
    let mut recvs = batch.rndv.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = recvs
        .in_flight
        .iter()
        .position(|&(r, _, ep)| r == cell.range && ep == cell.reply_ep)
    {
        recvs.in_flight.swap_remove(i);
    }
    recvs.pool.push(cell);
}

unsafe extern "C" fn on_rndv_received(
    request: *mut c_void,
    status: ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    let cell = user_data as *mut RndvRecv;
    // SAFETY: user_data is the cell given to this receive; `events` outlives workers.
    let events = unsafe { &*(*cell).events };
    events.called();
    // SAFETY: the receive is complete; the cell is released once, here.
    unsafe { rndv_done(cell, status) };
    // SAFETY: the request this callback completes; freeing it here is allowed.
    unsafe { (events.batch.request_free)(request) };
}

/// Return an ack buffer to its pool (or free an allocated one).
///
/// # Safety
///
/// `buf` came from [`BatchEvents::send_ack`] and UCX no longer uses it; called once.
unsafe fn release_ack(buf: *const AckBuf) {
    // SAFETY: per the contract, `buf` is live; its `events` outlives every worker.
    unsafe {
        if (*buf).index == u32::MAX {
            drop(Box::from_raw(buf as *mut AckBuf));
        } else {
            let _ = (*(*buf).events).batch.free_acks.push((*buf).index);
        }
    }
}

unsafe extern "C" fn on_ack_sent(
    request: *mut c_void,
    status: ucs_status_t,
    user_data: *mut c_void,
) {
    let buf = user_data as *const AckBuf;
    // SAFETY: user_data is the ack buffer given to this send; `events` outlives workers.
    let events = unsafe { &*(*buf).events };
    events.called();
    if status.is_err() {
        events.batch.unsent_acks.fetch_add(1, Ordering::Relaxed);
    }
    // SAFETY: the send is complete: UCX is done with the buffer; released once.
    unsafe { release_ack(buf) };
    // SAFETY: the request this callback completes; freeing it here is allowed.
    unsafe { (events.batch.request_free)(request) };
}

/// Check a WRITE batch message against the region index and write it: all or nothing.
fn apply_batch_write(regions: &mut RegionIndex, msg: &[u8]) -> BatchStatus {
    match wire::parse_batch_write(msg) {
        Ok(batch) => write_ranges(regions, batch.ranges()),
        Err(_) => BatchStatus::Malformed,
    }
}

/// Write `(target address, data)` ranges if every one lies in registered memory, else
/// none.
fn write_ranges<'a>(
    regions: &mut RegionIndex,
    ranges: impl Iterator<Item = (u64, &'a [u8])> + Clone,
) -> BatchStatus {
    if !ranges
        .clone()
        .all(|(addr, data)| regions.covers(addr, data.len() as u64))
    {
        return BatchStatus::OutsideRegistered;
    }
    for (addr, data) in ranges {
        // SAFETY: the range lies inside memory registered with this backend (checked just
        // above, with registration excluded meanwhile: it needs the core, which the
        // progressing thread holds). Registered memory is the caller's promise to keep
        // valid and to let peers write (as for UCX's own RMA); the source is the message.
        unsafe { ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
    }
    BatchStatus::Written
}

/// Handler of [`wire::BATCH_WRITE_AM_ID`] (target side).
pub(super) unsafe extern "C" fn on_batch_write(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: as UCX called this handler, registered with the core's events as `arg`.
    let got = unsafe { am_received(arg, header, header_length, data, length, param) };
    let batch = &got.events.batch;
    let msg = got.payload.unwrap_or_default();
    let status = {
        let mut regions = batch.regions();
        apply_batch_write(&mut regions, msg)
    };
    batch.answer(&got, msg.first_chunk::<8>(), status);
    ucs_status_t::UCS_OK
}

/// Handler of [`wire::BATCH_WRITE_ONE_AM_ID`] (target side): one range, its entry in the
/// message header, its data the message; checked and acked as a batch message is.
pub(super) unsafe extern "C" fn on_batch_write_one(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: this handler is registered with its worker's WorkerArg as `arg`, which
    // outlives the worker.
    let worker_arg = unsafe { &*(arg as *const WorkerArg) };
    // SAFETY: as UCX called this handler; `events` is the core's events.
    let got = unsafe {
        am_received(
            worker_arg.events as *mut c_void,
            header,
            header_length,
            data,
            length,
            param,
        )
    };
    let batch = &got.events.batch;
    if got.rendezvous {
        // SAFETY: called from the handler with the worker's arg and UCX's descriptor.
        unsafe { batch.receive_rndv(worker_arg, &got, data, length) };
        return ucs_status_t::UCS_OK;
    }
    let status = match got
        .payload
        .map(|d| wire::parse_batch_write_one(got.header, d))
    {
        Some(Ok((_, addr, data))) => {
            let mut regions = batch.regions();
            write_ranges(&mut regions, std::iter::once((addr, data)))
        }
        _ => BatchStatus::Malformed,
    };
    batch.answer(&got, got.header.first_chunk::<8>(), status);
    ucs_status_t::UCS_OK
}

/// Handler of [`wire::PING_AM_ID`] (target side): answer with an ack of the ping's
/// cookie on the reply endpoint.
pub(super) unsafe extern "C" fn on_ping(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: as UCX called this handler, registered with the core's events as `arg`.
    let got = unsafe { am_received(arg, header, header_length, data, length, param) };
    let batch = &got.events.batch;
    let cookie = got.payload.and_then(|p| p.first_chunk::<8>());
    batch.answer(&got, cookie, BatchStatus::Written);
    batch.pings.fetch_add(1, Ordering::Relaxed);
    ucs_status_t::UCS_OK
}

/// Handler of [`wire::BATCH_ACK_AM_ID`] (initiator side).
pub(super) unsafe extern "C" fn on_batch_ack(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: as UCX called this handler, registered with the core's events as `arg`.
    let got = unsafe { am_received(arg, header, header_length, data, length, param) };
    let batch = &got.events.batch;
    match wire::parse_ack(got.payload.unwrap_or_default()) {
        Ok((wire::PING_COOKIE, _)) => {
            batch.pongs.fetch_add(1, Ordering::Release);
        }
        Ok(ack) if batch.acks_in.push(ack).is_ok() => {}
        _ => {
            batch.dropped_acks.fetch_add(1, Ordering::Relaxed);
        }
    }
    ucs_status_t::UCS_OK
}

unsafe extern "C" fn on_reply_sent(
    request: *mut c_void,
    status: ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: user_data is the Box<ReplyBuf> given to this send, now done.
    let buf = unsafe { Box::from_raw(user_data as *mut ReplyBuf) };
    // SAFETY: `events` outlives every worker.
    let events = unsafe { &*buf.events };
    events.called();
    if status.is_err() {
        events.batch.unsent_acks.fetch_add(1, Ordering::Relaxed);
    }
    events.batch.recycle_reply(buf);
    // SAFETY: the request this callback completes; freeing it here is allowed.
    unsafe { (events.batch.request_free)(request) };
}

impl BatchEvents {
    /// Put READ reply buffers in the pool until it holds `count`, each with room for
    /// `bytes` and its pages written, so the first READ batches a peer sends are
    /// answered without an allocation (called when this backend's metadata is made: a
    /// peer that loads it may read). A buffer already there is left as it is.
    pub(super) fn ready_replies(&self, events: *const Events, count: usize, bytes: usize) {
        let mut pool = self.replies.lock().unwrap_or_else(|e| e.into_inner());
        while pool.len() < count.min(REPLY_POOL_MAX) {
            pool.push(Box::new(ReplyBuf {
                events,
                bytes: written_empty(bytes),
            }));
        }
    }

    fn recycle_reply(&self, buf: Box<ReplyBuf>) {
        let mut pool = self.replies.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < REPLY_POOL_MAX {
            pool.push(buf);
        }
    }

    /// Answer a READ batch request on `ep` (a reply endpoint, valid during the handler).
    fn send_read_reply(&self, events: *const Events, ep: ucp_ep_h, msg: &[u8]) {
        let popped = self.replies.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut buf = popped.unwrap_or_else(|| {
            self.allocated_replies.fetch_add(1, Ordering::Relaxed);
            Box::new(ReplyBuf {
                events,
                bytes: Vec::new(),
            })
        });
        buf.bytes.clear();
        let mut cookie = [0u8; 8];
        cookie.copy_from_slice(&msg[..8]);
        let cookie = u64::from_le_bytes(cookie);
        let status = match wire::parse_batch_read(msg) {
            Err(_) => BatchStatus::Malformed,
            Ok(read) => {
                let mut regions = self.regions();
                if read
                    .ranges()
                    .all(|(addr, len)| regions.covers(addr, u64::from(len)))
                {
                    buf.bytes
                        .reserve(wire::BATCH_ACK_LEN_BYTES + read.data_bytes);
                    buf.bytes
                        .extend_from_slice(&wire::encode_ack(cookie, BatchStatus::Written));
                    for (addr, len) in read.ranges() {
                        // SAFETY: inside memory registered with this backend (checked
                        // above, registration excluded meanwhile as for writes); only
                        // read. Registered memory is the caller's promise to keep valid
                        // and to let peers read.
                        let data =
                            unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
                        buf.bytes.extend_from_slice(data);
                    }
                    BatchStatus::Written
                } else {
                    BatchStatus::OutsideRegistered
                }
            }
        };
        if status != BatchStatus::Written {
            self.refused.fetch_add(1, Ordering::Relaxed);
            buf.bytes
                .extend_from_slice(&wire::encode_ack(cookie, status));
        }
        let mut param = request_param();
        param.op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_AM_SEND_FLAG_EAGER;
        param.cb.send = Some(on_reply_sent);
        let (data, len) = (buf.bytes.as_ptr() as *const c_void, buf.bytes.len());
        let raw = Box::into_raw(buf);
        param.user_data = raw as *mut c_void;
        // SAFETY: `ep` is the reply endpoint of the running handler; the buffer (a Box
        // handed over as user_data) stays untouched until the send reports.
        let request = unsafe {
            (self.am_send)(
                ep,
                wire::BATCH_READ_REPLY_AM_ID,
                ptr::null(),
                0,
                data,
                len,
                &param,
            )
        };
        if !ucs_ptr_is_ptr(request) {
            if ucs_ptr_is_err(request) {
                self.unsent_acks.fetch_add(1, Ordering::Relaxed);
            }
            // SAFETY: UCX is done with the buffer; the Box is taken back once.
            self.recycle_reply(unsafe { Box::from_raw(raw) });
        }
    }
}

/// Handler of [`wire::BATCH_READ_AM_ID`] (target side).
pub(super) unsafe extern "C" fn on_batch_read(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: as UCX called this handler, registered with the core's events as `arg`.
    let got = unsafe { am_received(arg, header, header_length, data, length, param) };
    let batch = &got.events.batch;
    let msg = got.payload.unwrap_or_default();
    let Some(reply_ep) = got.reply_ep.filter(|_| msg.len() >= 8) else {
        batch.refused.fetch_add(1, Ordering::Relaxed);
        batch.unsent_acks.fetch_add(1, Ordering::Relaxed);
        return ucs_status_t::UCS_OK;
    };
    batch.send_read_reply(got.events_ptr, reply_ep, msg);
    ucs_status_t::UCS_OK
}

/// Handler of [`wire::BATCH_READ_REPLY_AM_ID`] (initiator side): scatter the data into
/// the local ranges the message was posted with, then queue its ack.
pub(super) unsafe extern "C" fn on_batch_read_reply(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: as UCX called this handler, registered with the core's events as `arg`.
    let got = unsafe { am_received(arg, header, header_length, data, length, param) };
    let batch = &got.events.batch;
    let Ok((cookie, mut status, payload)) = wire::parse_read_reply(got.payload.unwrap_or_default())
    else {
        batch.dropped_acks.fetch_add(1, Ordering::Relaxed);
        return ucs_status_t::UCS_OK;
    };
    {
        let mut reads = batch.reads();
        let index = (cookie & u64::from(u32::MAX)) as usize;
        let Some(wait) = reads.get_mut(index).filter(|w| w.cookie == Some(cookie)) else {
            drop(reads);
            batch.dropped_acks.fetch_add(1, Ordering::Relaxed);
            return ucs_status_t::UCS_OK;
        };
        wait.cookie = None;
        if status == BatchStatus::Written as u32 {
            if payload.len() == wait.data_bytes {
                let mut at = 0usize;
                for &(addr, len) in &wait.locals {
                    let len = len as usize;
                    // SAFETY: the local ranges were validated inside registered regions
                    // at post, and stay valid until the request completes, which waits
                    // for this reply (or forgets the cookie, under this lock, first).
                    unsafe {
                        ptr::copy_nonoverlapping(
                            payload[at..at + len].as_ptr(),
                            addr as *mut u8,
                            len,
                        )
                    };
                    at += len;
                }
            } else {
                status = BatchStatus::Malformed as u32;
            }
        }
    }
    if batch.acks_in.push((cookie, status)).is_err() {
        batch.dropped_acks.fetch_add(1, Ordering::Relaxed);
    }
    ucs_status_t::UCS_OK
}

/// Whether an endpoint whose lanes are `summary` (see `summarize_lanes`) should batch
/// small WRITEs under `am_batch=auto`: when no lane is an RDMA or GPU transport, i.e.
/// UCX would emulate small RMA with active messages (shared memory: posix, sysv, cma,
/// knem, xpmem; tcp; self). On InfiniBand/RoCE (rc, dc, ud), uGNI, CUDA IPC, GDR copy or
/// ROCm a put needs no target CPU, and batching stays off.
pub(crate) fn am_batch_suits(summary: &str) -> bool {
    const ONE_SIDED: [&str; 9] = ["rc", "dc", "ud", "ib", "cuda", "gdr", "rocm", "ugni", "ze"];
    if summary == "unknown transports" {
        return false;
    }
    summary.split(", ").all(|lane| {
        let transport = lane.split('/').next().unwrap_or(lane).trim();
        !ONE_SIDED.iter().any(|p| transport.starts_with(p))
    })
}

/// Whether puts and gets on an endpoint with lanes `summary` go over tcp: a tcp lane
/// has an RMA role, or no lane has one (UCX then emulates them with active messages)
/// and active messages go over tcp (UCX 1.13: `tcp/lo [am am_bw#0 keepalive]`).
pub(crate) fn puts_over_tcp(summary: &str) -> bool {
    let lanes = || {
        summary.split(", ").map(|lane| {
            let (transport, roles) = lane.split_once(" [").unwrap_or((lane, ""));
            (transport, roles.trim_end_matches(']'))
        })
    };
    let tcp_with = |prefix: &str| {
        lanes().any(|(t, roles)| {
            t.starts_with("tcp") && roles.split(' ').any(|r| r.starts_with(prefix))
        })
    };
    let any_rma = lanes().any(|(_, roles)| roles.split(' ').any(|r| r.starts_with("rma")));
    tcp_with("rma") || (!any_rma && tcp_with("am"))
}

/// `am_batch_bytes=auto`: [`crate::AM_BATCH_BYTES_TCP`] when the lane that carries
/// active messages (role `am`) is tcp, else [`crate::AM_BATCH_BYTES_SHM`].
pub(crate) fn am_batch_bytes_for(summary: &str) -> usize {
    let am_over_tcp = summary.split(", ").any(|lane| {
        let (transport, roles) = lane.split_once(" [").unwrap_or((lane, ""));
        transport.starts_with("tcp") && roles.trim_end_matches(']').split(' ').any(|r| r == "am")
    });
    if am_over_tcp {
        crate::AM_BATCH_BYTES_TCP
    } else {
        crate::AM_BATCH_BYTES_SHM
    }
}

/// One batch message of the initiator.
pub(super) struct AmMsg {
    op: ferry_backend_api::Op,
    /// READ: (local address, length) per range (moved to `BatchEvents::reads` at send).
    locals: Vec<(u64, u32)>,
    /// READ: data the reply will carry.
    data_bytes: usize,
    generation: u32,
    in_use: bool,
    /// Its send is with UCX (the buffer may not be touched).
    sending: bool,
    /// Its ack arrived (or it failed): it no longer counts in its batch's `acks`.
    acked: bool,
    /// Head slot of its batch.
    head: u32,
    /// First and last request slot with a range in it (linked by `Slot::next`).
    first: u32,
    last: u32,
    ep: ucp_ep_h,
    count: u32,
    /// Header and packed ranges; capacity `am_batch_bytes` once first used.
    buf: Vec<u8>,
    /// A WRITE of one range that fills a message by itself, sent as
    /// [`wire::BATCH_WRITE_ONE_AM_ID`]: `buf` holds the header and the entry (UCX's
    /// message header), the data goes from the caller's memory (`(address, length)`),
    /// never copied into `buf`. `None`: all in `buf`.
    lent: Option<(u64, u64)>,
    /// A lent range sent by rendezvous: its ack (sent once the data landed) and its
    /// send's completion (UCX may report it earlier) must both be in before it counts
    /// as done in its batch.
    rndv: bool,
}

/// The initiator's batching state.
pub(super) struct AmBatch {
    msgs: Vec<AmMsg>,
    free: Vec<u32>,
    /// The message being filled (`NONE`: none).
    open: u32,
    /// Largest range that is batched (0: batching off).
    pub(super) range_max: u64,
    /// `am_batch_bytes` (`None`: per endpoint, see [`am_batch_bytes_for`]).
    msg_bytes: Option<usize>,
    mode: AmBatchMode,
    /// `am_tcp`: every DRAM range in messages, where puts go over tcp.
    all_mode: AmBatchMode,
    /// `am_tcp_rndv`: such WRITE pieces of at least [`RNDV_PIECE_MIN`] go by
    /// rendezvous, in pieces of up to `rndv_piece` bytes.
    pub(super) rndv: bool,
    pub(super) rndv_piece: u64,
    /// Index in `Core::cells` of message 0's send cell.
    cell_base: u32,
    /// Acks that named no message waiting for one.
    pub(super) stale_acks: u64,
    /// Messages handed to UCX.
    pub(super) sent: u64,
    /// Message buffers a request allocated or grew.
    pub(super) grown: u64,
}

impl AmBatch {
    pub(super) fn new(config: &crate::Config, cell_base: u32, rndv_piece: u64) -> AmBatch {
        let count = config.am_batch_messages;
        AmBatch {
            msgs: (0..count)
                .map(|_| AmMsg {
                    op: ferry_backend_api::Op::Write,
                    locals: Vec::new(),
                    data_bytes: 0,
                    generation: 0,
                    in_use: false,
                    sending: false,
                    acked: false,
                    head: NONE,
                    first: NONE,
                    last: NONE,
                    ep: ptr::null_mut(),
                    count: 0,
                    buf: Vec::new(),
                    lent: None,
                    rndv: false,
                })
                .collect(),
            free: (0..count as u32).rev().collect(),
            open: NONE,
            range_max: if config.am_batch == AmBatchMode::Off {
                0
            } else {
                config.am_batch_range_bytes
            },
            msg_bytes: config.am_batch_bytes,
            mode: config.am_batch,
            all_mode: config.am_tcp,
            rndv: config.am_tcp_rndv,
            rndv_piece,
            cell_base,
            stale_acks: 0,
            sent: 0,
            grown: 0,
        }
    }

    /// The batch message size on an endpoint whose lanes are `summary`; 0 = batching
    /// is not used there.
    pub(super) fn suits(&self, summary: &str) -> usize {
        let on = self.range_max > 0
            && match self.mode {
                AmBatchMode::Off => false,
                AmBatchMode::On => true,
                AmBatchMode::Auto => am_batch_suits(summary),
            };
        if on {
            self.msg_bytes
                .unwrap_or_else(|| am_batch_bytes_for(summary))
        } else {
            0
        }
    }

    /// Whether every DRAM range to an endpoint that batches (`suits` > 0) goes in
    /// messages; `Auto`: where its puts go over tcp ([`puts_over_tcp`]).
    pub(super) fn all_ranges(&self, summary: &str) -> bool {
        match self.all_mode {
            AmBatchMode::Off => false,
            AmBatchMode::On => true,
            AmBatchMode::Auto => puts_over_tcp(summary),
        }
    }

    /// Give the next `count` messages a request will fill a buffer of `msg_bytes` with
    /// its pages touched, so the first request to a peer whose ranges go in messages
    /// writes into memory that is there (a buffer is otherwise made on first use and
    /// kept: the first request paid its allocation and page faults, the second did
    /// not). Called when such an endpoint is made, at the peer's load by default; a
    /// buffer already that large is left as it is.
    pub(super) fn prepare(&mut self, msg_bytes: usize, count: usize) {
        for &m in self.free.iter().rev().take(count) {
            let buf = &mut self.msgs[m as usize].buf;
            if buf.capacity() < msg_bytes {
                *buf = written_empty(msg_bytes);
            }
        }
    }

    /// Give the next `count` messages, and the reply records their READs would be
    /// swapped into, room for the local ranges of a READ: as many as such a message can
    /// list, at most `ranges` (the request the load readies). A message's list of local
    /// ranges and its record trade places at each send, so both need the room, or the
    /// first READs through a message grow them step by step.
    pub(super) fn ready_reads(&mut self, count: usize, ranges: usize, reads: &mut [ReadWait]) {
        for &m in self.free.iter().rev().take(count) {
            let msg = &mut self.msgs[m as usize];
            let bytes = msg.buf.capacity().clamp(
                wire::BATCH_WRITE_ONE_HEADER_LEN_BYTES,
                crate::AM_BATCH_BYTES_TCP,
            );
            let entries =
                ((bytes - wire::BATCH_HEADER_LEN_BYTES) / wire::BATCH_ENTRY_LEN_BYTES).min(ranges);
            msg.locals.reserve(entries.saturating_sub(msg.locals.len()));
            if let Some(wait) = reads.get_mut(m as usize) {
                wait.locals
                    .reserve(entries.saturating_sub(wait.locals.len()));
            }
        }
    }

    /// Messages in flight (sent or open, not yet acked and reported).
    pub(super) fn in_flight(&self) -> usize {
        self.msgs.len() - self.free.len()
    }
}

/// Most batch messages a new endpoint readies for the first request
/// ([`AmBatch::prepare`] at connect; [`Core::ready_batch_reads`] at the load).
pub(super) const READIED_MSGS: usize = 2;

/// An empty buffer with room for `bytes`, every page of which was written (so its
/// first use does not fault pages in).
fn written_empty(bytes: usize) -> Vec<u8> {
    // Reason: written, not just allocated: `vec![0; n]` is a zeroed allocation, which
    // may be fresh pages the kernel has not mapped yet.
    #[allow(clippy::slow_vector_initialization)]
    let mut fresh = Vec::with_capacity(bytes);
    fresh.resize(bytes, 0u8);
    fresh.clear();
    fresh
}

impl Core {
    /// At a load ([`Core::ready_requests`]): room for the local ranges of a READ of
    /// `ranges` in the messages the endpoint readied ([`AmBatch::prepare`]).
    pub(super) fn ready_batch_reads(&mut self, ranges: usize) {
        let mut reads = self.events.batch.reads();
        self.am.ready_reads(READIED_MSGS, ranges, &mut reads);
    }

    /// This backend's metadata is being made: ready the pool of READ reply buffers for
    /// the first peers that read (two of the largest READ message's reply).
    pub(crate) fn ready_read_replies(&self) {
        self.events.batch.ready_replies(
            Arc::as_ptr(&self.events),
            2,
            wire::BATCH_ACK_LEN_BYTES + crate::AM_BATCH_BYTES_TCP,
        );
    }

    /// Add the range to the open message of batch `head` (starting one if needed): a
    /// WRITE's data is copied in, a READ's local range kept for the reply. False if no
    /// message is free (the caller then puts or gets the range).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn am_pack(
        &mut self,
        op: ferry_backend_api::Op,
        head: u32,
        slot: u32,
        ep: ucp_ep_h,
        local_addr: u64,
        remote_addr: u64,
        len: u64,
        msg_bytes: usize,
        rndv: bool,
    ) -> bool {
        let write = op == ferry_backend_api::Op::Write;
        let rndv = write && rndv && len >= RNDV_PIECE_MIN;
        // A WRITE range that fills a message by itself (an `am_tcp` piece of a long
        // range) is sent from the caller's memory, not copied into the message: it took
        // a message of its own anyway, so this adds no message or ack. Shorter ranges are
        // packed as before (a copy costs less than a message of their own).
        let lend = rndv
            || (write
                && wire::BATCH_HEADER_LEN_BYTES + wire::BATCH_ENTRY_LEN_BYTES + len as usize
                    >= msg_bytes);
        if lend {
            self.am_send_open();
        }
        if self.am.open != NONE {
            let msg = &self.am.msgs[self.am.open as usize];
            let fits = if write {
                msg.buf.len() + wire::BATCH_ENTRY_LEN_BYTES + len as usize <= msg_bytes
            } else {
                msg.buf.len() + wire::BATCH_ENTRY_LEN_BYTES <= msg_bytes
                    && wire::BATCH_ACK_LEN_BYTES + msg.data_bytes + len as usize <= msg_bytes
            };
            if msg.head != head || msg.ep != ep || msg.op != op || !fits {
                self.am_send_open();
            }
        }
        if self.am.open == NONE {
            let Some(m) = self.am.free.pop() else {
                return false;
            };
            let msg = &mut self.am.msgs[m as usize];
            // A READ's message holds only its entries (its data comes in the reply).
            let want = if write {
                msg_bytes
            } else {
                msg_bytes.min(crate::AM_BATCH_BYTES_TCP)
            };
            if msg.buf.capacity() < want {
                msg.buf = Vec::with_capacity(want);
                self.am.grown += 1;
            }
            msg.buf.clear();
            msg.buf
                .extend_from_slice(&[0u8; wire::BATCH_HEADER_LEN_BYTES]);
            msg.op = op;
            msg.locals.clear();
            msg.data_bytes = 0;
            msg.in_use = true;
            msg.sending = false;
            msg.acked = false;
            msg.head = head;
            msg.first = slot;
            msg.ep = ep;
            msg.count = 0;
            msg.lent = None;
            msg.rndv = false;
            self.am.open = m;
            self.slots[head as usize].acks += 1;
        }
        let msg = &mut self.am.msgs[self.am.open as usize];
        msg.buf
            .extend_from_slice(&wire::batch_entry(remote_addr, len as u32));
        if lend {
            msg.lent = Some((local_addr, len));
            msg.rndv = rndv;
            msg.count += 1;
            msg.last = slot;
            self.am_send_open();
            return true;
        }
        if write {
            // SAFETY: the local range lies inside a registered region (validated at post)
            // and stays valid until the request completes (backend contract); only read.
            let data = unsafe { std::slice::from_raw_parts(local_addr as *const u8, len as usize) };
            msg.buf.extend_from_slice(data);
        } else {
            msg.locals.push((local_addr, len as u32));
            msg.data_bytes += len as usize;
        }
        msg.count += 1;
        msg.last = slot;
        true
    }

    /// Send the open message, if any.
    pub(super) fn am_send_open(&mut self) {
        let m = std::mem::replace(&mut self.am.open, NONE);
        if m == NONE {
            return;
        }
        let cell = self.am.cell_base + m;
        let msg = &mut self.am.msgs[m as usize];
        let cookie = (u64::from(msg.generation) << 32) | u64::from(m);
        msg.buf[..wire::BATCH_HEADER_LEN_BYTES]
            .copy_from_slice(&wire::batch_header(cookie, msg.count));
        msg.sending = true;
        self.am.sent += 1;
        let am_id = if msg.op == ferry_backend_api::Op::Write {
            wire::BATCH_WRITE_AM_ID
        } else {
            // Where the reply's data goes, for its handler (swapped: no allocation).
            let mut reads = self.events.batch.reads();
            let wait = &mut reads[m as usize];
            wait.cookie = Some(cookie);
            wait.data_bytes = msg.data_bytes;
            std::mem::swap(&mut wait.locals, &mut msg.locals);
            wire::BATCH_READ_AM_ID
        };
        let mut param = request_param();
        param.op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
        // A rendezvous piece: UCX announces it and the target, having checked the range,
        // receives the data straight into the region (zero-copy on tcp, both ends).
        param.flags = if msg.rndv {
            UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY
        } else {
            UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY
        };
        param.cb.send = Some(on_op_done);
        param.user_data = self.cells.get(cell) as *const OpCell as *mut c_void;
        // A lent range: header and entry as UCX's message header, the data from the
        // caller's memory as the message (contiguous, so UCX sends it zero-copy in one
        // fragment; a gather list of the two would take its multi-fragment protocol,
        // which the receiver reassembles with a copy).
        let (am_id, header, data) = match msg.lent {
            None => (
                am_id,
                &[][..],
                (msg.buf.as_ptr() as *const c_void, msg.buf.len()),
            ),
            Some((addr, len)) => (
                wire::BATCH_WRITE_ONE_AM_ID,
                &msg.buf[..],
                (addr as *const c_void, len as usize),
            ),
        };
        // SAFETY: ep live (messages of an endpoint are failed before it closes and none is
        // open across calls); the buffer stays untouched until the send's callback
        // reports (`sending`; UCX copies a message header at once); a lent range lies in
        // registered memory that the
        // caller keeps valid until its request completes, which waits for the target's
        // ack, sent only once the whole message arrived, or for the endpoint's force
        // close when it fails (the same hold as a put of that range has on its source);
        // the cell outlives the request.
        let request = unsafe {
            self.ucp.api().ucp_am_send_nbx(
                msg.ep,
                am_id,
                header.as_ptr() as *const c_void,
                header.len(),
                data.0,
                data.1,
                &param,
            )
        };
        if !ucs_ptr_is_ptr(request) {
            self.am_sent(m, ucs_ptr_status(request));
        }
    }

    /// Cell `cell` belongs to a batch message.
    pub(super) fn am_cell(&self, cell: u32) -> Option<u32> {
        cell.checked_sub(self.am.cell_base)
    }

    /// UCX reported the send of message `m`.
    pub(super) fn am_sent(&mut self, m: u32, status: ucs_status_t) {
        let msg = &mut self.am.msgs[m as usize];
        msg.sending = false;
        let head = msg.head;
        if !msg.acked && status.is_err() {
            let gone = self.peer_gone(self.slots[head as usize].peer);
            self.am_fail(m, failure_of(status, gone, None));
            self.am_acked(m);
        } else if msg.acked {
            let waited = msg.rndv;
            if waited && status.is_err() {
                let gone = self.peer_gone(self.slots[head as usize].peer);
                self.am_fail(m, failure_of(status, gone, None));
            }
            self.am_release(m);
            if waited {
                // Its ack came first (`am_acked`): it counts now that the data landed.
                self.am_counted(head);
            }
        }
    }

    /// Take the acks that arrived. Returns whether there were any.
    pub(super) fn am_take_acks(&mut self) -> bool {
        let mut any = false;
        while let Some((cookie, status)) = self.events.batch.acks_in.pop() {
            any = true;
            let m = (cookie & u64::from(u32::MAX)) as u32;
            let generation = (cookie >> 32) as u32;
            let waiting = self.am.msgs.get(m as usize).is_some_and(|msg| {
                msg.in_use && !msg.acked && msg.generation == generation && m != self.am.open
            });
            if !waiting {
                self.am.stale_acks += 1;
                continue;
            }
            match BatchStatus::from_wire(status) {
                Some(BatchStatus::Written) => {}
                refused => {
                    let errno = match refused {
                        Some(BatchStatus::OutsideRegistered) => libc::EFAULT,
                        Some(BatchStatus::NotReceived) => libc::EIO,
                        Some(BatchStatus::Busy) => libc::ENOBUFS,
                        _ => libc::EPROTO,
                    };
                    self.am_fail(
                        m,
                        Failure {
                            kind: FailureKind::Backend,
                            errno,
                            range: None,
                        },
                    );
                }
            }
            self.am_acked(m);
        }
        any
    }

    /// Record `failure` on every request with a range in message `m` (first one wins).
    fn am_fail(&mut self, m: u32, failure: Failure) {
        let (first, last) = {
            let msg = &self.am.msgs[m as usize];
            (msg.first, msg.last)
        };
        let mut index = first;
        while index != NONE {
            let slot = &mut self.slots[index as usize];
            slot.failure.get_or_insert(failure);
            if index == last {
                break;
            }
            index = slot.next;
        }
    }

    /// Message `m` no longer waits for its ack: its batch may complete.
    fn am_acked(&mut self, m: u32) {
        let msg = &mut self.am.msgs[m as usize];
        msg.acked = true;
        if msg.op == ferry_backend_api::Op::Read {
            // A reply that comes after this must not scatter: the request may complete.
            let cookie = (u64::from(msg.generation) << 32) | u64::from(m);
            let mut reads = self.events.batch.reads();
            if reads[m as usize].cookie == Some(cookie) {
                reads[m as usize].cookie = None;
            }
        }
        let msg = &mut self.am.msgs[m as usize];
        let head = msg.head;
        if msg.sending && msg.rndv {
            // Landed, but UCX may still hold the caller's memory: `am_sent` counts it.
            return;
        }
        if !msg.sending {
            self.am_release(m);
        }
        self.am_counted(head);
    }

    /// One message of batch `head` is done: the batch completes with the last, once
    /// flushed.
    fn am_counted(&mut self, head: u32) {
        let slot = &mut self.slots[head as usize];
        slot.acks -= 1;
        if slot.acks == 0 {
            if let Some(status) = slot.flushed.take() {
                self.batch_complete(head, status);
            }
        }
    }

    fn am_release(&mut self, m: u32) {
        let msg = &mut self.am.msgs[m as usize];
        debug_assert!(msg.in_use && msg.acked && !msg.sending);
        msg.in_use = false;
        msg.generation = msg.generation.wrapping_add(1);
        msg.head = NONE;
        msg.ep = ptr::null_mut();
        self.am.free.push(m);
    }

    /// `ep` is about to close: its messages still waiting for an ack fail their requests
    /// (remote-disconnect), once each.
    pub(super) fn am_fail_ep(&mut self, ep: ucp_ep_h) {
        for m in 0..self.am.msgs.len() as u32 {
            let msg = &self.am.msgs[m as usize];
            if msg.in_use && !msg.acked && msg.ep == ep && m != self.am.open {
                self.am_fail(
                    m,
                    failure_of(ucs_status_t::UCS_ERR_CONNECTION_RESET, true, None),
                );
                self.am_acked(m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puts_go_over_tcp_with_a_tcp_rma_lane_or_with_no_rma_lane_and_tcp_active_messages() {
        assert!(puts_over_tcp("tcp/lo [am am_bw#0 keepalive]"));
        assert!(puts_over_tcp("tcp/eth0 [am rma_bw#0 keepalive]"));
        assert!(!puts_over_tcp(
            "posix/memory [am], cma/memory [rma_bw#0], tcp/lo [keepalive]"
        ));
        assert!(!puts_over_tcp("rc_mlx5/mlx5_0:1 [am rma_bw#0]"));
        assert!(!puts_over_tcp("posix/memory [am]"));
    }

    #[test]
    fn region_index_covers_only_registered_memory() {
        let mut index = RegionIndex::new();
        assert!(!index.covers(0x1000, 1));
        index.add(0x1000, 0x1000);
        index.add(0x2000, 0x1000);
        index.add(0x8000, 0x100);
        assert!(index.covers(0x1000, 0x2000), "adjacent regions together");
        assert!(index.covers(0x80ff, 1));
        assert!(!index.covers(0x80ff, 2));
        assert!(!index.covers(0xfff, 2));
        assert!(!index.covers(0x3000, 1));
        assert!(!index.covers(u64::MAX, 2), "overflow");
        index.remove(0x2000, 0x1000);
        assert!(!index.covers(0x1000, 0x2000));
        assert!(index.covers(0x1000, 0x1000));
    }

    #[test]
    fn a_forged_message_writes_nothing_unless_every_range_is_registered() {
        let mut target = vec![0u8; 4096];
        let base = target.as_mut_ptr() as u64;
        let mut regions = RegionIndex::new();
        regions.add(base, 4096);
        let good = wire::encode_batch_write(1, &[(base + 10, b"abc"), (base + 4093, b"xyz")]);
        assert_eq!(apply_batch_write(&mut regions, &good), BatchStatus::Written);
        assert_eq!(&target[10..13], b"abc");
        assert_eq!(&target[4093..], b"xyz");
        // One range a byte past the registered end: the whole message is refused.
        let past = wire::encode_batch_write(2, &[(base, b"123"), (base + 4094, b"xyz")]);
        assert_eq!(
            apply_batch_write(&mut regions, &past),
            BatchStatus::OutsideRegistered
        );
        assert_eq!(
            &target[..3],
            &[0, 0, 0],
            "nothing of a refused message is written"
        );
        // Malformed: truncated, inflated length, trailing bytes.
        let mut bad = wire::encode_batch_write(3, &[(base, b"123")]);
        for cut in 0..bad.len() {
            assert_eq!(
                apply_batch_write(&mut regions, &bad[..cut]),
                BatchStatus::Malformed
            );
        }
        bad[16 + 8] = 200;
        assert_eq!(
            apply_batch_write(&mut regions, &bad),
            BatchStatus::Malformed
        );
        assert_eq!(&target[..3], &[0, 0, 0]);
        // Deregistered: refused.
        regions.remove(base, 4096);
        assert_eq!(
            apply_batch_write(&mut regions, &good),
            BatchStatus::OutsideRegistered
        );
        drop(target);
    }

    #[test]
    fn batching_suits_emulated_transports_only() {
        assert!(am_batch_suits(
            "posix/memory [am am_bw#0], cma/memory [rma_bw#0]"
        ));
        assert!(am_batch_suits("tcp/lo [rma_bw#0 am am_bw#0]"));
        assert!(!am_batch_suits(
            "rc_mlx5/mlx5_0:1 [rma_bw#0 am], posix/memory [am]"
        ));
        assert!(!am_batch_suits("cuda_ipc/cuda [rma_bw#0]"));
        assert!(!am_batch_suits("unknown transports"));
        assert_eq!(
            am_batch_bytes_for("tcp/lo [am keepalive], cma/memory [rma_bw#0]"),
            crate::AM_BATCH_BYTES_TCP
        );
        assert_eq!(
            am_batch_bytes_for("sysv/memory [am am_bw#0], posix/memory [], cma/memory [rma_bw#0]"),
            crate::AM_BATCH_BYTES_SHM
        );
        assert_eq!(
            am_batch_bytes_for("posix/memory [am], tcp/lo [am_bw#0]"),
            crate::AM_BATCH_BYTES_SHM
        );
    }
}
