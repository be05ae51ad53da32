//! Everything that touches UCX: context, workers, registered memory, peers with their
//! endpoints and unpacked rkeys, the pool of request slots, and the completion state
//! machine driven by UCX callbacks.
//!
//! # Request state machine (one slot per posted request)
//!
//! ```text
//!  post ─▶ put/get per merged range ─▶ WaitFlush ──flush done──▶ (notif?) ──▶ WaitNotif ──am sent──▶ done
//!                                        │ (one ep flush per batch,            │
//!                                        │  slots of a batch linked by `next`) └──────────no notif─────▶ done
//! ```
//!
//! With a window (`post_window_bytes`), the part of a batch beyond the window waits in
//! `Core::deferred` (pieces of ranges, in post order); each [`Core::pump`] issues one
//! more window (a post also stops after about `requests::ISSUE_BUDGET` of sending:
//! `requests::IssueBudget`), and the batch's flush is issued when its last piece is (the head slot
//! counts its pieces). A peer's pieces are cut before its endpoint closes: their
//! requests fail and their batches are flushed at once, so each is still reported from
//! its flush's callback.
//!
//! A standalone notification takes a slot in `WaitNotif` directly and completes without
//! a report (it has no tag). UCX callbacks never touch the core: they store their status
//! in the request's cell and queue the cell's index in a bounded lock-free queue that
//! [`Core::pump`] drains (see `callbacks::CompletionQueue` for why it never loses one).
//! A slot is freed only from its last callback's report, also when its peer was
//! unloaded meanwhile (the force close cancels the request and UCX reports it): every
//! post yields exactly one completion, after UCX is done with its buffers.
//!
//! Small ranges to a peer whose transports emulate RMA with active messages travel in
//! Ferry's own batch messages ([`batch`]); a batch then also waits for their acks
//! (`Slot::acks`) before the notification step.
//!
//! Split by concern: [`batch`] (batched small transfers), [`callbacks`] (what UCX calls,
//! and the bounded queue it feeds),
//! [`config`] (UCX configuration and tuning), [`memory`] (registration), [`peers`]
//! (endpoints, rkeys, closing), [`requests`] (posting, completion, progress),
//! [`notifications`] (the inbox, sending), [`diagnostics`] (transport summaries, counts).

mod batch;
mod callbacks;
mod config;
mod cost;
mod deadline;
mod diagnostics;
mod memory;
mod neighbours;
mod notifications;
mod peers;
mod requests;
mod sockets;
mod vram;

use std::collections::VecDeque;
use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
// The peer and rkey maps are looked up once or twice per range a post carries: Fx
// hashes a u64 key in a multiply, SipHash (std's default) in ~20 ns.
use ferry_backend_api::{
    Completion, Completions, Endpoint, Error, Failure, FailureKind, MemKind, PeerId, PeerRegions,
    Post, Result, Subject,
};
use ferry_ucx_sys::*;
use rustc_hash::FxHashMap as HashMap;

use crate::{Config, ErrorMode, BACKEND};

use batch::{
    on_batch_ack, on_batch_read, on_batch_read_reply, on_batch_write, on_batch_write_one, on_ping,
    AmBatch, BatchEvents,
};
pub(crate) use callbacks::Events;
use callbacks::{
    on_ep_error, on_notif, on_op_done, Cells, CompletionQueue, OpCell, PeerLink, SLOT_CHUNK,
};
use config::{may_use_shared_memory, may_use_tcp, rndv_thresh_override, zcopy_thresh_override};
use deadline::{Deadline, Watch};
pub(crate) use diagnostics::errno_of;
#[cfg(test)]
pub(crate) use diagnostics::summarize_lanes;
use diagnostics::ucx_error;
pub(crate) use memory::ALLOC_LEN_MAX;
use memory::{AllocEntry, MemEntry};
pub(crate) use neighbours::enlist;
use notifications::Inbox;
use peers::{Grave, PeerState, RemoteKey};
use requests::{Deferred, Slot, SlotState};
use vram::VramState;
pub(crate) use vram::{vram_available, MEM_KINDS};

/// Active-message id of Ferry notifications.
const NOTIF_AM_ID: u32 = 0x4652;
/// Largest notification payload (sent eagerly, so the receiver gets it in one piece).
pub(crate) const NOTIF_LEN_MAX: usize = 64 * 1024;
/// Bound on `ucp_worker_progress` rounds per pump, so a pump never spins for long.
const PROGRESS_ROUNDS_MAX: u32 = 256;
/// Rounds between two looks at the clock inside a pump.
const PROGRESS_CLOCK_ROUNDS: u32 = 8;
/// Time after which a pump stops progressing a worker that still has work. Over TCP
/// every round moves up to a socket buffer of data, so without it one pump (and with
/// it the `post` whose flush ends in the progress phase) could carry a whole 64 MiB
/// transfer; the rest is left to the next progress phase or the progress thread.
const PROGRESS_BUDGET: Duration = Duration::from_micros(100);
/// How long the workers must have had nothing to do (no request of ours in flight, no
/// progress that found work) before the caller's progress starts resting: see
/// [`Core::resting`].
const QUIET_AFTER: Duration = Duration::from_millis(1);
/// While resting, the caller's progress progresses the workers at most this long after
/// the last time: unsolicited work (a peer's request into our memory, a notification,
/// a peer's wireup) waits at most this much longer to be seen. Over tcp an idle
/// worker's progress is an `epoll_wait` system call (UCX's tcp transport polls its
/// sockets), which a scheduler loop calling progress for its other backends (SHM, the
/// default for a same-host peer) would otherwise pay on every call.
const REST_POLL: Duration = Duration::from_micros(50);
/// How long closing an endpoint may take before it is abandoned.
const EP_CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest the backend's drop waits for its workers' flush (see [`Core::flush_workers`]).
const DROP_FLUSH_WAIT: Duration = Duration::from_millis(100);
/// Drops in this process whose flush ran out [`DROP_FLUSH_WAIT`]
/// ([`crate::drop_flush_timeouts`]).
pub(crate) static DROP_FLUSH_TIMEOUTS: AtomicU64 = AtomicU64::new(0);
/// Slot link terminator.
const NONE: u32 = u32::MAX;

/// The type of an active-message handler.
type AmRecvFn = unsafe extern "C" fn(
    *mut c_void,
    *const c_void,
    usize,
    *mut c_void,
    usize,
    *const ucp_am_recv_param_t,
) -> ucs_status_t;

struct Worker {
    handle: ucp_worker_h,
    address: Vec<u8>,
    efd: i32,
    /// The `arg` of its handler of rendezvous WRITE pieces (freed after the worker).
    arg: Box<batch::WorkerArg>,
}

/// The UCX state of one backend instance. Accessed by one thread at a time (the backend
/// wraps it in a mutex); workers use `UCS_THREAD_MODE_SERIALIZED` accordingly.
pub(crate) struct Core {
    ucp: Arc<Ucp>,
    context: ucp_context_h,
    /// Created on first need (`start_workers`: the first registration or allocation,
    /// the connection info, a peer's load, the local endpoint), not with the backend:
    /// UCX's workers hold most of its memory (~4.4 MB each with the shared-memory
    /// transports, UCX 1.13), which an idle agent never uses.
    workers: Vec<Worker>,
    /// Workers to create (`num_workers`), and whether with event fds (progress thread).
    worker_count: usize,
    wakeup: bool,
    agent_name: Box<[u8]>,
    err_mode: ErrorMode,
    pub(crate) events: Arc<Events>,
    cells: Cells,
    /// Request slots made so far (up to `slot_max`, as the requests in flight first
    /// need them), and those of them free.
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    /// `max_requests`.
    slot_max: usize,
    mems: Vec<Option<MemEntry>>,
    /// Memory UCX allocated for this backend (`memory.rs`).
    allocs: Vec<AllocEntry>,
    mem_generations: Vec<u32>,
    free_mems: Vec<u32>,
    peers: HashMap<PeerId, PeerState>,
    next_worker: usize,
    self_ep: ucp_ep_h,
    /// Endpoints whose close UCX has not confirmed yet, with what they still own.
    graves: Vec<Grave>,
    /// Peers whose load left its wireup flush running ([`PeerState::wireup`]): each
    /// progress checks them and pings the peer once the flush is done.
    wiring: Vec<PeerId>,
    /// Whether the last `pump` saw UCX progress that ran none of our callbacks (UCX's
    /// own work; the progress thread polls on after it).
    ucx_own_work: bool,
    /// When the last `pump` started, and the last one that found work (see
    /// [`Core::resting`]).
    last_pump: Instant,
    last_work: Instant,
    /// Caller progress calls that rested instead of progressing the workers.
    pub(crate) rested: u64,
    /// Loads that made no endpoint because another backend serves the peer.
    pub(crate) standby_loads: u64,
    /// Progress rounds a close may take before it finishes in the graveyard.
    close_rounds: u32,
    /// Close endpoints with `UCP_EP_CLOSE_FLAG_FORCE` (else flush first).
    close_force: bool,
    /// Create a peer's endpoint when its metadata is loaded.
    connect_on_load: bool,
    /// And unpack which of its regions' rkeys then.
    unpack_on_load: crate::UnpackOnLoad,
    /// Completions produced outside a `post` call (callbacks, progress thread).
    pub(crate) ready: Completions,
    /// Largest single put/get; longer ranges are split.
    chunk_bytes: u64,
    /// The progress deadline of peer endpoints (`deadline.rs`).
    deadline: Deadline,
    /// VRAM support and the device context to bind (`vram.rs`).
    vram: VramState,
    /// Bytes handed to UCX per post or pump (`post_window_bytes`).
    window_bytes: u64,
    /// Ranges of posted batches not handed to UCX yet, in post order.
    deferred: VecDeque<Deferred>,
    /// Batched small WRITEs, initiator side (`batch.rs`).
    am: AmBatch,
    /// The rkey of each range of the batch being posted (`validate` fills it; its
    /// capacity is kept, so a warmed-up post allocates nothing).
    range_keys: Vec<RemoteKey>,
}

// SAFETY: the raw UCX handles in Core are only used by whichever thread holds the core
// (the backend keeps it behind a mutex), and the workers are created in
// UCS_THREAD_MODE_SERIALIZED, which permits use from different threads one at a time.
unsafe impl Send for Core {}

fn failure_of(status: ucs_status_t, peer_gone: bool, range: Option<u32>) -> Failure {
    let kind = if peer_gone || status.is_disconnect() {
        FailureKind::RemoteDisconnect
    } else if status == ucs_status_t::UCS_ERR_CANCELED {
        FailureKind::Canceled
    } else {
        FailureKind::Backend
    };
    Failure {
        kind,
        errno: errno_of(status),
        range,
    }
}

fn token_subject(token: u64) -> Subject {
    Subject::Named(format!("UCX region token {token:#x}").into())
}

/// A zeroed request parameter block (no fields set).
fn request_param() -> ucp_request_param_t {
    // SAFETY: ucp_request_param_t is plain C data; all-zero is its documented "no
    // fields" state (callbacks are Options, so zero is None).
    unsafe { std::mem::zeroed() }
}

impl Core {
    /// Create the context and workers.
    pub(crate) fn new(ucp: Arc<Ucp>, agent_name: &str, config: &Config) -> Result<Core> {
        let api = ucp.api();
        // Read UCX's environment (UCX_TLS, UCX_NET_DEVICES …), then apply our overrides.
        let mut ucp_config: *mut ucp_config_t = ptr::null_mut();
        // SAFETY: NULL prefix/file mean "UCX_ environment only"; out-pointer is valid.
        let status = unsafe { api.ucp_config_read(ptr::null(), ptr::null(), &mut ucp_config) };
        if !status.is_ok() {
            return Err(ucx_error(&ucp, "ucp_config_read", status));
        }
        // Shared-memory settings only where a shared-memory transport may be used (UCX
        // warns about settings no transport takes, e.g. with `UCX_TLS=tcp`).
        let tls = config
            .transports
            .clone()
            .or_else(|| std::env::var("UCX_TLS").ok());
        let shm = tls.as_deref().is_none_or(may_use_shared_memory);
        let fifo_size = config.shm_fifo_size.filter(|_| shm).map(|n| n.to_string());
        let seg_size = config.shm_seg_bytes.filter(|_| shm).map(|n| n.to_string());
        let tcp = tls.as_deref().is_none_or(may_use_tcp);
        let tcp_tx = config.tcp_seg_bytes.filter(|_| tcp);
        let (tcp_tx_seg, tcp_rx_seg) = (
            tcp_tx.map(|n| n.to_string()),
            tcp_tx.map(|n| (u64::from(n) * 4).to_string()),
        );
        let zcopy_thresh = zcopy_thresh_override(ucp.version());
        let rndv_thresh = rndv_thresh_override();
        // (name, value, whether it is Ferry's own tuning: a libucp that refuses one of
        // those gets a warning and UCX's own value, never a failed backend — e.g. UCX
        // 1.23 refuses `TX_SEG_SIZE` through `ucp_config_modify`).
        let overrides = [
            (c"NET_DEVICES", &config.devices, false),
            (c"TLS", &config.transports, false),
            // A transport setting: UCX keeps it and applies it to the mm transports.
            (c"MM_FIFO_SIZE", &fifo_size, true),
            (c"MM_SEG_SIZE", &seg_size, true),
            (c"TX_SEG_SIZE", &tcp_tx_seg, true),
            (c"RX_SEG_SIZE", &tcp_rx_seg, true),
            (c"ZCOPY_THRESH", &zcopy_thresh, true),
            (c"RNDV_THRESH", &rndv_thresh, true),
        ];
        for (name, value, tuning) in overrides {
            let Some(value) = value else { continue };
            // UCX 1.23 refuses tcp's segment sizes by their bare names (no transport's
            // table is searched for them) but takes them with the transport prefix.
            let fallback = match name.to_bytes() {
                b"TX_SEG_SIZE" => Some(c"TCP_TX_SEG_SIZE"),
                b"RX_SEG_SIZE" => Some(c"TCP_RX_SEG_SIZE"),
                _ => None,
            };
            let value = std::ffi::CString::new(value.as_str()).map_err(|_| {
                Error::invalid(
                    Subject::BackendName(BACKEND.into()),
                    "parameter contains NUL",
                )
            });
            let modify = |name: &std::ffi::CStr, value: &std::ffi::CString| {
                // SAFETY: config is valid, both strings are NUL-terminated.
                unsafe { api.ucp_config_modify(ucp_config, name.as_ptr(), value.as_ptr()) }
            };
            let status = value.as_ref().map(|value| {
                let status = modify(name, value);
                match fallback {
                    Some(prefixed) if !status.is_ok() => modify(prefixed, value),
                    _ => status,
                }
            });
            match status {
                Ok(status) if status.is_ok() => {}
                Ok(status) if tuning => log::warn!(
                    "UCX {}: ucp_config_modify({}={}) refused ({}); UCX's own value stays",
                    ucp.version(),
                    name.to_string_lossy(),
                    value
                        .as_ref()
                        .map(|v| v.to_string_lossy())
                        .unwrap_or_default(),
                    ucp.status_string(status)
                ),
                other => {
                    // SAFETY: releasing the config we read; not used afterwards.
                    unsafe { api.ucp_config_release(ucp_config) };
                    return Err(match other {
                        Ok(status) => ucx_error(
                            &ucp,
                            &format!("ucp_config_modify({})", name.to_string_lossy()),
                            status,
                        ),
                        Err(e) => e.clone(),
                    });
                }
            }
        }
        let mut features = u64::from(UCP_FEATURE_RMA | UCP_FEATURE_AM);
        if config.progress_thread {
            features |= u64::from(UCP_FEATURE_WAKEUP);
        }
        // SAFETY: plain C struct, zero = no fields.
        let mut params: ucp_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED);
        params.features = features;
        params.mt_workers_shared = 0;
        let mut context: ucp_context_h = ptr::null_mut();
        // SAFETY: params/config valid for the call; context is an out-pointer.
        let status = unsafe { ucp.init(&params, ucp_config, &mut context) };
        // SAFETY: the config is no longer needed after init.
        unsafe { api.ucp_config_release(ucp_config) };
        if !status.is_ok() {
            return Err(ucx_error(&ucp, "ucp_init", status));
        }

        let slot_count = config.max_requests;
        let messages = config.am_batch_messages;
        let events = Arc::new_cyclic(|weak: &std::sync::Weak<Events>| Events {
            // One report per slot and one per batch message at most (see CompletionQueue).
            completions: CompletionQueue::new(slot_count, messages),
            ep_error: AtomicBool::new(false),
            inbox: Mutex::new(Inbox::new(config.notif_entries_max, config.notif_bytes_max)),
            refused_notifs: AtomicU64::new(0),
            dropped_notifs: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            request_free: api.ucp_request_free,
            batch: BatchEvents::new(
                api,
                weak.as_ptr(),
                messages,
                config.am_tcp_rndv_receives_max,
            ),
        });
        let events_ptr = Arc::as_ptr(&events);
        // Two cells per slot (flush, notification), then one per batch message (send).
        let cells = Cells::new(events_ptr, slot_count, messages);
        let mut core = Core {
            ucp: ucp.clone(),
            context,
            workers: Vec::with_capacity(config.workers),
            worker_count: config.workers,
            wakeup: config.progress_thread,
            agent_name: agent_name.as_bytes().into(),
            err_mode: config.error_mode,
            events,
            cells,
            slots: Vec::new(),
            free_slots: Vec::new(),
            slot_max: slot_count,
            mems: Vec::new(),
            allocs: Vec::new(),
            mem_generations: Vec::new(),
            free_mems: Vec::new(),
            peers: HashMap::default(),
            next_worker: 0,
            self_ep: ptr::null_mut(),
            ready: Completions::with_capacity(0),
            chunk_bytes: config.chunk_bytes,
            window_bytes: config.window_bytes,
            deferred: VecDeque::new(),
            am: AmBatch::new(
                config,
                (slot_count * 2) as u32,
                config
                    .am_tcp_rndv_piece_bytes
                    .unwrap_or_else(|| config::rndv_piece_bytes_auto(ucp.version())),
            ),
            range_keys: Vec::new(),
            graves: Vec::new(),
            wiring: Vec::new(),
            ucx_own_work: false,
            last_pump: Instant::now(),
            last_work: Instant::now(),
            rested: 0,
            standby_loads: 0,
            close_rounds: config.close_rounds,
            close_force: config.close_force,
            connect_on_load: config.connect_on_load,
            unpack_on_load: config.unpack_on_load,
            deadline: Deadline::new(config.peer_timeout),
            vram: VramState::new(&ucp, context, config.vmm_spanning),
        };
        // The progress thread polls the workers' event fds from its start.
        if config.progress_thread {
            core.start_workers()?;
        }
        Ok(core)
    }

    /// Create the workers if they are not yet. A failure leaves none half made: the
    /// next call tries again.
    pub(crate) fn start_workers(&mut self) -> Result<()> {
        while self.workers.len() < self.worker_count {
            let index = self.workers.len();
            if let Err(e) = self.add_worker(index, self.wakeup) {
                if self.workers.len() > index {
                    let worker = self.workers.pop().expect("pushed by add_worker");
                    // SAFETY: created just now; no endpoint or request uses it yet.
                    unsafe { self.ucp.api().ucp_worker_destroy(worker.handle) };
                }
                return Err(e);
            }
        }
        Ok(())
    }

    fn add_worker(&mut self, index: usize, wakeup: bool) -> Result<()> {
        let api = self.ucp.api();
        // SAFETY: plain C struct, zero = no fields.
        let mut params: ucp_worker_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(UCP_WORKER_PARAM_FIELD_THREAD_MODE);
        params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
        let mut handle: ucp_worker_h = ptr::null_mut();
        // SAFETY: context is live; params valid; handle is an out-pointer.
        let status = unsafe { api.ucp_worker_create(self.context, &params, &mut handle) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_worker_create", status));
        }
        // Push first so Drop destroys it whatever fails next.
        self.workers.push(Worker {
            handle,
            address: Vec::new(),
            efd: -1,
            arg: Box::new(batch::WorkerArg {
                events: Arc::as_ptr(&self.events),
                worker: handle,
            }),
        });
        let mut address: *mut ucp_address_t = ptr::null_mut();
        let mut address_len: usize = 0;
        // SAFETY: worker is live; out-pointers valid.
        let status = unsafe { api.ucp_worker_get_address(handle, &mut address, &mut address_len) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_worker_get_address", status));
        }
        // SAFETY: UCX returned `address_len` readable bytes at `address`; we copy them and
        // release the buffer with the matching call.
        let bytes = unsafe {
            let bytes = std::slice::from_raw_parts(address as *const u8, address_len).to_vec();
            api.ucp_worker_release_address(handle, address);
            bytes
        };
        self.workers[index].address = bytes;

        // SAFETY: plain C struct, zero = no fields.
        let mut am: ucp_am_handler_param_t = unsafe { std::mem::zeroed() };
        am.field_mask = u64::from(
            UCP_AM_HANDLER_PARAM_FIELD_ID
                | UCP_AM_HANDLER_PARAM_FIELD_CB
                | UCP_AM_HANDLER_PARAM_FIELD_ARG
                | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        );
        am.id = NOTIF_AM_ID;
        am.flags = UCP_AM_FLAG_WHOLE_MSG;
        am.cb = Some(on_notif);
        am.arg = Arc::as_ptr(&self.events) as *mut c_void;
        let handlers = [
            (NOTIF_AM_ID, on_notif as AmRecvFn),
            (crate::wire::BATCH_WRITE_AM_ID, on_batch_write),
            (crate::wire::BATCH_WRITE_ONE_AM_ID, on_batch_write_one),
            (crate::wire::PING_AM_ID, on_ping),
            (crate::wire::BATCH_ACK_AM_ID, on_batch_ack),
            (crate::wire::BATCH_READ_AM_ID, on_batch_read),
            (crate::wire::BATCH_READ_REPLY_AM_ID, on_batch_read_reply),
        ];
        let events_arg = am.arg;
        let worker_arg = &*self.workers[index].arg as *const batch::WorkerArg as *mut c_void;
        for (id, cb) in handlers {
            am.id = id;
            am.cb = Some(cb);
            // The one-range WRITE handler may receive by rendezvous, on its own worker.
            am.arg = if id == crate::wire::BATCH_WRITE_ONE_AM_ID {
                worker_arg
            } else {
                events_arg
            };
            // SAFETY: worker live; the arg outlives the worker (see Events).
            let status = unsafe { api.ucp_worker_set_am_recv_handler(handle, &am) };
            if !status.is_ok() {
                return Err(ucx_error(
                    &self.ucp,
                    "ucp_worker_set_am_recv_handler",
                    status,
                ));
            }
        }
        if wakeup {
            let mut efd = -1;
            // SAFETY: worker created with the WAKEUP feature; out-pointer valid.
            let status = unsafe { api.ucp_worker_get_efd(handle, &mut efd) };
            if !status.is_ok() {
                return Err(ucx_error(&self.ucp, "ucp_worker_get_efd", status));
            }
            self.workers[index].efd = efd;
        }
        Ok(())
    }

    /// Request slots that can be taken now (free, or not made yet).
    fn slots_available(&self) -> usize {
        self.free_slots.len() + (self.slot_max - self.slots.len())
    }

    /// A free request slot: a recycled one, else a new one (with its callback cells)
    /// while fewer than `max_requests` exist. `None` when every slot is in flight.
    fn take_slot(&mut self) -> Option<u32> {
        if let Some(index) = self.free_slots.pop() {
            return Some(index);
        }
        let index = self.slots.len();
        if index >= self.slot_max {
            return None;
        }
        self.cells.cover(index);
        self.slots.push(Slot {
            state: SlotState::Free,
            tag: None,
            peer: None,
            failure: None,
            notif: Vec::new(),
            has_notif: false,
            reserved: false,
            next: NONE,
            ep: ptr::null_mut(),
            deferred: 0,
            acks: 0,
            flushed: None,
        });
        Some(index as u32)
    }

    /// Make, at a load, what the first request after it would otherwise grow: room in
    /// the per-post rkey list for `ranges` ranges (as many as the agent readied its own
    /// request path for), and the first chunk of request slots ([`SLOT_CHUNK`]: the
    /// slot table, its free list, the completions handed over, and the slots' callback
    /// cells, 8 KiB). Grows only; a backend that has made requests has all of it.
    pub(super) fn ready_requests(&mut self, ranges: usize) {
        self.range_keys
            .reserve(ranges.saturating_sub(self.range_keys.len()));
        let slots = SLOT_CHUNK.min(self.slot_max);
        self.slots.reserve(slots.saturating_sub(self.slots.len()));
        self.free_slots
            .reserve(slots.saturating_sub(self.free_slots.len()));
        self.ready.reserve(slots.saturating_sub(self.ready.len()));
        self.cells.cover(0);
        self.ready_batch_reads(ranges);
    }

    /// The loaded library.
    pub(crate) fn ucp(&self) -> &Arc<Ucp> {
        &self.ucp
    }

    /// Whether the workers exist.
    pub(crate) fn workers_started(&self) -> bool {
        !self.workers.is_empty()
    }

    /// Worker addresses, in worker order (the workers are created if they are not yet).
    pub(crate) fn worker_addresses(&mut self) -> Result<Vec<Vec<u8>>> {
        self.start_workers()?;
        Ok(self.workers.iter().map(|w| w.address.clone()).collect())
    }

    /// Event fds of the workers (progress-thread mode only).
    pub(crate) fn event_fds(&self) -> Vec<i32> {
        self.workers.iter().map(|w| w.efd).collect()
    }
}

impl Core {
    /// Close `ep`, an endpoint with no state of ours beside it; a close UCX has not
    /// confirmed yet waits in the graveyard.
    fn close_into_grave(&mut self, worker: ucp_worker_h, ep: ucp_ep_h, force: bool) {
        if let Some(request) = self.close_ep(worker, ep, force) {
            self.graves.push(Grave {
                worker,
                request,
                link: None,
                rkeys: Vec::new(),
                settle: None,
            });
        }
    }
}

impl Core {
    /// Flush every worker, progressing it until the flush completes or [`DROP_FLUSH_WAIT`]
    /// passed. A worker's flush covers the endpoints UCX made itself for peers that
    /// connected to us, and completes once their wireup is done. With UCX 1.13's tcp
    /// transport such an endpoint holds our wireup reply until its connection back to
    /// the peer is made, and destroying the worker before then aborts this process on
    /// an assertion (`ucp_request_send_state_ff`: "got REP message", in
    /// `ucp_worker_destroy`). A peer that died before that connection was made aborts
    /// it whatever we do (the connect is refused, the same purge runs); upstream
    /// removed that assertion (openucx/ucx#8175), Debian's 1.13.1 still has it.
    fn flush_workers(&mut self, kin: &neighbours::Kin) {
        let api = self.ucp.api();
        let deadline = Instant::now() + DROP_FLUSH_WAIT;
        for worker in &self.workers {
            let param = request_param();
            // SAFETY: the worker is live; without a callback the request is only polled
            // and freed by us, once.
            let request = unsafe { api.ucp_worker_flush_nbx(worker.handle, &param) };
            if !ucs_ptr_is_ptr(request) {
                continue;
            }
            loop {
                // SAFETY: worker live; request is our flush request, not freed yet.
                let status = unsafe {
                    api.ucp_worker_progress(worker.handle);
                    api.ucp_request_check_status(request)
                };
                if status != ucs_status_t::UCS_INPROGRESS {
                    break;
                }
                // A peer in this process answers only if someone progresses it.
                neighbours::pump_peers(kin);
                if Instant::now() >= deadline {
                    DROP_FLUSH_TIMEOUTS.fetch_add(1, Ordering::Relaxed);
                    log::warn!(
                        "UCX: a worker's flush did not finish within {DROP_FLUSH_WAIT:?} of the \
                         backend's drop; a wireup still pending is purged with the worker"
                    );
                    break;
                }
            }
            // SAFETY: our request, freed once; one still in progress is released by UCX
            // when it completes or with the worker.
            unsafe { api.ucp_request_free(request) };
        }
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        let kin = self.kin();
        self.flush_workers(&kin);
        // Our own endpoints, closed below by their owners: UCX matches a peer's
        // connection to us with the endpoint we made to it, so a rendezvous receive's
        // reply endpoint can be one of them, and must not be closed twice.
        let mut owned: Vec<ucp_ep_h> = self.peers.values().map(|s| s.ep).collect();
        owned.extend(
            self.graves
                .iter()
                .filter_map(|g| g.settle.as_ref().map(|s| s.ep)),
        );
        owned.push(self.self_ep);
        let peers: Vec<PeerId> = self.peers.keys().copied().collect();
        for peer in peers {
            self.teardown_peer(peer);
        }
        self.peers.clear();
        if !self.self_ep.is_null() {
            let ep = std::mem::replace(&mut self.self_ep, ptr::null_mut());
            self.close_into_grave(self.workers[0].handle, ep, self.close_force);
        }
        // Rendezvous receives still in flight (their initiator went away mid-piece) are
        // requests on the endpoints UCX made for those peers, and UCX 1.13 aborts when a
        // worker is destroyed with a request left on an endpoint: close those endpoints
        // (forced: UCX cancels the receives) first.
        for (worker, ep) in self.events.batch.rndv_endpoints() {
            if owned.contains(&ep) {
                continue;
            }
            self.close_into_grave(worker, ep, true);
        }
        // Give pending closes a bounded time to finish, so their state is released in
        // UCX's order (rkeys before the worker goes).
        let deadline = Instant::now() + EP_CLOSE_TIMEOUT;
        while !self.graves.is_empty() && Instant::now() < deadline {
            for grave in &self.graves {
                // SAFETY: the worker is live (destroyed below).
                unsafe { self.ucp.api().ucp_worker_progress(grave.worker) };
            }
            self.reap_graves();
            neighbours::pump_peers(&kin);
        }
        let mut unconfirmed = std::mem::take(&mut self.graves);
        if !unconfirmed.is_empty() {
            log::warn!(
                "UCX: {} endpoint close(s) not confirmed within {EP_CLOSE_TIMEOUT:?}; their \
                 state is released after the workers are destroyed",
                unconfirmed.len()
            );
        }
        let api = self.ucp.api();
        for grave in &mut unconfirmed {
            // A settling endpoint resolves within CLOSE_WIREUP_WAIT, far inside the wait
            // above; should one be left, the worker's destruction closes it.
            if let Some(settle) = grave.settle.take() {
                if !settle.flush.is_null() {
                    // SAFETY: our flush request, freed once.
                    unsafe { api.ucp_request_free(settle.flush) };
                }
            }
            if !grave.request.is_null() {
                // SAFETY: our pending close request; UCX allows freeing a request before
                // it completes (it is then released when done, or with the worker).
                unsafe { api.ucp_request_free(grave.request) };
                grave.request = ptr::null_mut();
            }
        }
        // Dropping the backend frees everything, including what was not deregistered.
        for entry in self.mems.iter_mut().filter_map(Option::take) {
            // SAFETY: our own rkey and mapping; no endpoint is left to use them.
            unsafe {
                if !entry.self_rkey.is_null() {
                    api.ucp_rkey_destroy(entry.self_rkey);
                }
                // A registration inside an allocation borrows its mapping (freed below).
                if entry.alloc_addr.is_none() {
                    api.ucp_mem_unmap(self.context, entry.memh);
                }
            }
        }
        for alloc in self.allocs.drain(..) {
            // SAFETY: our own allocation; its registrations are gone (above) and no
            // endpoint is left to use it.
            unsafe { api.ucp_mem_unmap(self.context, alloc.memh) };
        }
        for worker in self.workers.drain(..) {
            // SAFETY: all eps of this worker are closed; callbacks during destroy only
            // touch `events`/`cells`, which are still alive (fields of self).
            unsafe { api.ucp_worker_destroy(worker.handle) };
        }
        for grave in unconfirmed {
            for rkey in grave.rkeys {
                // SAFETY: the workers (and with them every endpoint and operation that
                // could use the rkey) are gone; the context still is not.
                unsafe { api.ucp_rkey_destroy(rkey) };
            }
            // The links are released only now: no endpoint is left to report on them.
            drop(grave.link);
        }
        // SAFETY: every worker of the context is destroyed.
        unsafe { api.ucp_cleanup(self.context) };
    }
}
