//! What UCX calls back into: completion of requests, endpoint errors, inbound
//! notifications. Callbacks never touch the core; they write into [`Events`].

use super::batch::BatchEvents;
use super::notifications::Inbox;
use super::*;

// ---------------------------------------------------------------------------------------
// State shared with UCX callbacks (and the progress thread).

/// A cell's status while no completion waits in it.
const NO_STATUS: i32 = i32::MAX;

/// Request slots whose callback cells are allocated together (two cells each: 8 KiB).
pub(super) const SLOT_CHUNK: usize = 256;

/// Reports the completion queue holds at most (besides one per batch message); past
/// that the consumer's scan takes them (see [`CompletionQueue`]).
const QUEUE_SLOTS_MAX: usize = 1024;

/// Completions reported by UCX callbacks, waiting for `Core::pump`.
///
/// # Why it never loses a completion
///
/// A callback stores its status in its request's [`OpCell`] and queues the cell's
/// index. A slot never has more than one callback-bearing UCX request outstanding: a
/// batch's slots share one endpoint flush (reported on the head slot's even cell) and
/// each slot's notification is sent only after that flush was handled (reported on its
/// odd cell); put/get requests carry no callback. A slot is freed only after its last
/// report was taken. Batch messages (`batch.rs`) have one cell each, after the slots'
/// cells, and one send outstanding at most. So at most one index per slot and one per
/// message is queued at any time. The queue holds that many up to
/// [`QUEUE_SLOTS_MAX`] slots (so a large `max_requests` costs no memory up front); a
/// report that does not fit sets `overflow`, and the consumer then takes every cell's
/// stored status in one scan (each status is taken exactly once, by whoever swaps it
/// out of its cell first), so nothing is lost either way.
pub(super) struct CompletionQueue {
    ready: ArrayQueue<u32>,
    overflow: AtomicBool,
}

impl CompletionQueue {
    /// A queue for the callback cells of `slots` request slots and `messages` batch
    /// messages.
    pub(super) fn new(slots: usize, messages: usize) -> CompletionQueue {
        CompletionQueue {
            ready: ArrayQueue::new((slots.min(QUEUE_SLOTS_MAX) + messages).max(1)),
            overflow: AtomicBool::new(false),
        }
    }

    /// The next reported completion: (cell index, status); `cell` finds a cell by index.
    pub(super) fn pop<'c>(&self, cell: impl Fn(u32) -> &'c OpCell) -> Option<(u32, ucs_status_t)> {
        while let Some(index) = self.ready.pop() {
            if let Some(status) = cell(index).take() {
                return Some((index, status));
            }
        }
        None
    }

    /// Whether a report did not fit since the last call (the caller then scans every
    /// cell with [`OpCell::take`]).
    pub(super) fn overflowed(&self) -> bool {
        self.overflow.swap(false, Ordering::AcqRel)
    }
}

/// What callbacks may touch. Lives in an `Arc` so its address is stable and it outlives
/// every worker (workers are destroyed in `Core::drop`, which still holds the `Arc`).
pub(crate) struct Events {
    pub(super) completions: CompletionQueue,
    pub(super) ep_error: AtomicBool,
    pub(crate) inbox: Mutex<Inbox>,
    /// Notifications dropped because they arrived in a form we cannot take (rendezvous).
    pub(crate) dropped_notifs: AtomicU64,
    /// Peers' notifications refused because the inbox was full.
    pub(crate) refused_notifs: AtomicU64,
    pub(super) request_free: unsafe extern "C" fn(*mut c_void),
    /// Batched transfers (`batch.rs`): what the AM handlers and ack sends touch.
    pub(super) batch: BatchEvents,
    /// Calls UCX made into this backend's callbacks (message handlers, completions,
    /// endpoint errors): progress that moved none of them was UCX's own work, such as
    /// an endpoint's wireup (see `thread.rs`).
    pub(super) calls: AtomicU64,
}

impl Events {
    /// One call into a callback of ours (see [`Events::calls`]).
    #[inline]
    pub(super) fn called(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }
}

/// `user_data` of a UCX request: where to report its completion.
pub(super) struct OpCell {
    pub(super) events: *const Events,
    pub(super) index: u32,
    /// The reported status (`ucs_status_t` widened), [`NO_STATUS`] while none waits.
    status: AtomicI32,
}

impl OpCell {
    pub(super) fn new(events: *const Events, index: u32) -> OpCell {
        OpCell {
            events,
            index,
            status: AtomicI32::new(NO_STATUS),
        }
    }

    /// Record the completion `status` of this cell's request and queue the cell.
    pub(super) fn report(&self, queue: &CompletionQueue, status: ucs_status_t) {
        let previous = self.status.swap(i32::from(status.0), Ordering::AcqRel);
        debug_assert_eq!(previous, NO_STATUS, "one outstanding request per cell");
        if queue.ready.push(self.index).is_err() {
            queue.overflow.store(true, Ordering::Release);
        }
    }

    /// Take the reported status, if one waits.
    pub(super) fn take(&self) -> Option<ucs_status_t> {
        let status = self.status.swap(NO_STATUS, Ordering::AcqRel);
        (status != NO_STATUS).then_some(ucs_status_t(status as i8))
    }
}

/// The callback cells: two per request slot (flush, notification), allocated a chunk
/// of [`SLOT_CHUNK`] slots at a time as the slot table grows, then one per batch
/// message. A chunk never moves once made (UCX holds pointers to its cells as
/// `user_data`) and lives until the core drops, after every worker.
pub(super) struct Cells {
    chunks: Vec<Box<[OpCell]>>,
    messages: Box<[OpCell]>,
    /// Index of the first message cell: two per slot of `max_requests`.
    base: u32,
    events: *const Events,
}

impl Cells {
    /// Cells for up to `slots` request slots (none made yet) and `messages` batch
    /// messages; `events` is where their reports go.
    pub(super) fn new(events: *const Events, slots: usize, messages: usize) -> Cells {
        let base = (slots * 2) as u32;
        Cells {
            chunks: Vec::new(),
            messages: (0..messages as u32)
                .map(|m| OpCell::new(events, base + m))
                .collect(),
            base,
            events,
        }
    }

    /// Make the cells of slot `slot` (and the rest of its chunk) if they are not yet.
    pub(super) fn cover(&mut self, slot: usize) {
        let slots_max = self.base as usize / 2;
        while self.chunks.len() * SLOT_CHUNK <= slot {
            let first = self.chunks.len() * SLOT_CHUNK;
            let count = SLOT_CHUNK.min(slots_max - first);
            let cells = (first * 2..(first + count) * 2)
                .map(|index| OpCell::new(self.events, index as u32))
                .collect();
            self.chunks.push(cells);
        }
    }

    /// Cell `index` (a slot's, made by [`Self::cover`], or a message's).
    pub(super) fn get(&self, index: u32) -> &OpCell {
        match index.checked_sub(self.base) {
            Some(m) => &self.messages[m as usize],
            None => {
                let (chunk, at) = (
                    index as usize / (SLOT_CHUNK * 2),
                    index as usize % (SLOT_CHUNK * 2),
                );
                &self.chunks[chunk][at]
            }
        }
    }

    /// The indices of every cell made so far.
    pub(super) fn made(&self) -> impl Iterator<Item = u32> {
        let slot_cells = self.chunks.iter().map(|chunk| chunk.len() as u32).sum();
        (0..slot_cells).chain(self.base..self.base + self.messages.len() as u32)
    }
}

/// `arg` of an endpoint's error handler.
pub(super) struct PeerLink {
    pub(super) events: *const Events,
    /// The failure status UCX reported for the endpoint, 0 while healthy.
    pub(super) status: AtomicI8,
}

pub(super) unsafe extern "C" fn on_op_done(
    request: *mut c_void,
    status: ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: user_data is a pointer into `Core::cells`, which lives (unmoved, immutable)
    // until after every worker is destroyed; `events` points into the core's Arc<Events>.
    let cell = unsafe { &*(user_data as *const OpCell) };
    // SAFETY: see above.
    let events = unsafe { &*cell.events };
    events.called();
    cell.report(&events.completions, status);
    // SAFETY: `request` is the UCX request this callback completes; freeing it from its
    // own callback is allowed by the UCP API.
    unsafe { (events.request_free)(request) };
}

pub(super) unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    // SAFETY: arg is the endpoint's Box<PeerLink>, kept (in the peer state, then in the
    // graveyard) until UCX has confirmed the endpoint's close or the worker is destroyed.
    let link = unsafe { &*(arg as *const PeerLink) };
    link.status.store(status.0.min(-1), Ordering::Release);
    // SAFETY: `events` points into the core's Arc<Events>, alive while any ep exists.
    let events = unsafe { &*link.events };
    events.called();
    events.ep_error.store(true, Ordering::Release);
}

/// What one of our active-message handlers got from UCX, read once.
pub(super) struct AmReceived<'a> {
    /// The core's events (the handler's `arg`).
    pub(super) events: &'a Events,
    /// The same, as the pointer reply sends carry as their user data.
    pub(super) events_ptr: *const Events,
    /// The eager payload; `None` for a rendezvous message (its data is not readable
    /// here; only `am_tcp` WRITE pieces are sent that way, every other message eager).
    pub(super) payload: Option<&'a [u8]>,
    /// A rendezvous message: `data` is UCX's descriptor of data still at the sender.
    pub(super) rendezvous: bool,
    /// The endpoint to answer on, when UCX passed one.
    pub(super) reply_ep: Option<ucp_ep_h>,
    /// The message's user header (empty when it has none).
    pub(super) header: &'a [u8],
}

/// Read an active message's arguments.
///
/// # Safety
///
/// The arguments as UCX passed them to a handler registered with the core's
/// `Arc<Events>` as its `arg` (alive until the worker is destroyed); the result is used
/// only during the callback.
pub(super) unsafe fn am_received<'a>(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> AmReceived<'a> {
    let events_ptr = arg as *const Events;
    // SAFETY: the caller's promise: `arg` is the live events, `param` valid now.
    let (events, recv_attr, reply_ep) =
        unsafe { (&*events_ptr, (*param).recv_attr, (*param).reply_ep) };
    events.called();
    let rendezvous = recv_attr & u64::from(UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let payload = if rendezvous {
        None
    } else if length == 0 {
        Some(&[][..])
    } else {
        // SAFETY: eager data is readable during the callback (the caller's promise).
        Some(unsafe { std::slice::from_raw_parts(data as *const u8, length) })
    };
    let header = if header_length == 0 {
        &[][..]
    } else {
        // SAFETY: UCX guarantees header/header_length describe readable memory during the
        // callback (the caller's promise).
        unsafe { std::slice::from_raw_parts(header as *const u8, header_length) }
    };
    AmReceived {
        events,
        events_ptr,
        payload,
        rendezvous,
        reply_ep: (recv_attr & u64::from(UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0).then_some(reply_ep),
        header,
    }
}

pub(super) unsafe extern "C" fn on_notif(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: as UCX called this handler, registered with the core's events as `arg`.
    let got = unsafe { am_received(arg, header, header_length, data, length, param) };
    let events = got.events;
    let Some(payload) = got.payload else {
        events.dropped_notifs.fetch_add(1, Ordering::Relaxed);
        return ucs_status_t::UCS_OK;
    };
    let from = got.header;
    let accepted = events
        .inbox
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(from, payload);
    if !accepted {
        // A peer's notification that does not fit: refused whole and counted (an active
        // message cannot be answered); what was accepted before stays.
        events.refused_notifs.fetch_add(1, Ordering::Relaxed);
    }
    ucs_status_t::UCS_OK
}

// SAFETY: Events is only read through shared references: the queue and atomics are
// Sync, the inbox is a Mutex, and `request_free` is a plain function pointer.
unsafe impl Send for Events {}
// SAFETY: see above.
unsafe impl Sync for Events {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_loses_no_completion_and_reports_each_once() {
        // A queue far smaller than the cells reporting into it (past QUEUE_SLOTS_MAX
        // slots, or were the slot discipline to fail; this checks the fallback).
        let queue = CompletionQueue::new(1, 1);
        let cells: Vec<OpCell> = (0..16).map(|i| OpCell::new(ptr::null(), i)).collect();
        for (i, cell) in cells.iter().enumerate() {
            cell.report(&queue, ucs_status_t(-(i as i8)));
        }
        let mut seen = Vec::new();
        while let Some((cell, status)) = queue.pop(|i| &cells[i as usize]) {
            seen.push((cell, status));
        }
        assert_eq!(seen.len(), 2, "the queue held two");
        assert!(queue.overflowed(), "the rest is flagged");
        for cell in &cells {
            if let Some(status) = cell.take() {
                seen.push((cell.index, status));
            }
        }
        seen.sort_by_key(|&(cell, _)| cell);
        let expected: Vec<(u32, ucs_status_t)> =
            (0..16).map(|i| (i, ucs_status_t(-(i as i8)))).collect();
        assert_eq!(seen, expected, "every report exactly once");
        assert!(!queue.overflowed());
        // A cell reused after its report was taken reports again.
        cells[3].report(&queue, ucs_status_t::UCS_OK);
        assert_eq!(
            queue.pop(|i| &cells[i as usize]),
            Some((3, ucs_status_t::UCS_OK))
        );
        assert_eq!(queue.pop(|i| &cells[i as usize]), None);
    }

    #[test]
    fn cells_are_made_a_chunk_at_a_time_and_found_by_index() {
        // 300 slots: one full chunk and a short one; 3 message cells after 600.
        let mut cells = Cells::new(ptr::null(), 300, 3);
        assert_eq!(cells.made().collect::<Vec<_>>(), vec![600, 601, 602]);
        cells.cover(0);
        assert_eq!(cells.made().count(), SLOT_CHUNK * 2 + 3);
        let first = cells.get(0) as *const OpCell;
        cells.cover(299);
        cells.cover(299);
        assert_eq!(
            cells.made().count(),
            600 + 3,
            "the short chunk ends at max_requests"
        );
        assert_eq!(
            cells.get(0) as *const OpCell,
            first,
            "a made cell never moves"
        );
        for index in cells.made() {
            assert_eq!(cells.get(index).index, index);
        }
    }

    #[test]
    fn a_report_taken_by_the_scan_is_not_delivered_again_from_the_queue() {
        let queue = CompletionQueue::new(2, 2);
        let cells: Vec<OpCell> = (0..4).map(|i| OpCell::new(ptr::null(), i)).collect();
        cells[1].report(&queue, ucs_status_t::UCS_OK);
        assert_eq!(cells[1].take(), Some(ucs_status_t::UCS_OK));
        assert_eq!(queue.pop(|i| &cells[i as usize]), None);
    }
}
