//! What UCX calls back into: completion of requests, endpoint errors, inbound
//! notifications. Callbacks never touch the core; they write into [`Events`].

use super::notifications::Inbox;
use super::*;

// ---------------------------------------------------------------------------------------
// State shared with UCX callbacks (and the progress thread).

/// One event produced by a UCX completion callback.
#[derive(Clone, Copy, Debug)]
pub(super) struct OpEvent {
    /// Callback cell index: slot * 2 (+1 for the notification cell).
    pub(super) cell: u32,
    pub(super) status: ucs_status_t,
}

/// What callbacks may touch. Lives in an `Arc` so its address is stable and it outlives
/// every worker (workers are destroyed in `Core::drop`, which still holds the `Arc`).
pub(crate) struct Events {
    pub(super) ops: ArrayQueue<OpEvent>,
    pub(super) ep_error: AtomicBool,
    pub(crate) inbox: Mutex<Inbox>,
    /// Notifications dropped because they arrived in a form we cannot take (rendezvous).
    pub(crate) dropped_notifs: AtomicU64,
    pub(super) request_free: unsafe extern "C" fn(*mut c_void),
}

/// `user_data` of a UCX request: where to report its completion.
pub(super) struct OpCell {
    pub(super) events: *const Events,
    pub(super) index: u32,
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
    let pushed = events.ops.push(OpEvent {
        cell: cell.index,
        status,
    });
    debug_assert!(
        pushed.is_ok(),
        "one event per cell in flight, queue sized for all"
    );
    // SAFETY: `request` is the UCX request this callback completes; freeing it from its
    // own callback is allowed by the UCP API.
    unsafe { (events.request_free)(request) };
}

pub(super) unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    // SAFETY: arg is the Box<PeerLink> owned by the peer, kept until its ep is closed.
    let link = unsafe { &*(arg as *const PeerLink) };
    link.status.store(status.0.min(-1), Ordering::Release);
    // SAFETY: `events` points into the core's Arc<Events>, alive while any ep exists.
    unsafe { &*link.events }
        .ep_error
        .store(true, Ordering::Release);
}

pub(super) unsafe extern "C" fn on_notif(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: arg is the core's Arc<Events>, registered per worker and alive until the
    // worker is destroyed.
    let events = unsafe { &*(arg as *const Events) };
    // SAFETY: UCX passes a valid param for the duration of the callback.
    let recv_attr = unsafe { (*param).recv_attr };
    if recv_attr & u64::from(UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 {
        // Senders force eager; a rendezvous message is not one of ours.
        events.dropped_notifs.fetch_add(1, Ordering::Relaxed);
        return ucs_status_t::UCS_OK;
    }
    let from: &[u8] = if header_length == 0 {
        &[]
    } else {
        // SAFETY: UCX guarantees header/header_length describe readable memory during the
        // callback.
        unsafe { std::slice::from_raw_parts(header as *const u8, header_length) }
    };
    let payload: &[u8] = if length == 0 {
        &[]
    } else {
        // SAFETY: as for the header; eager data is readable during the callback.
        unsafe { std::slice::from_raw_parts(data as *const u8, length) }
    };
    events
        .inbox
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(from, payload);
    ucs_status_t::UCS_OK
}

// SAFETY: Events is only read through shared references: the queue and atomics are
// Sync, the inbox is a Mutex, and `request_free` is a plain function pointer.
unsafe impl Send for Events {}
// SAFETY: see above.
unsafe impl Sync for Events {}
