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
//! A standalone notification takes a slot in `WaitNotif` directly and completes without
//! a report (it has no tag). UCX callbacks never touch the core: they push
//! `(cell, status)` into a bounded lock-free queue that [`Core::pump`] drains.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicI8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use ferry_backend_api::{
    Completion, Completions, Endpoint, Error, Failure, FailureKind, MemKind, PeerId, PeerRegions,
    Post, Result, Subject,
};
use ferry_ucx_sys::*;

use crate::{Config, ErrorMode, BACKEND};

/// Active-message id of Ferry notifications.
const NOTIF_AM_ID: u32 = 0x4652;
/// Largest notification payload (sent eagerly, so the receiver gets it in one piece).
pub(crate) const NOTIF_LEN_MAX: usize = 64 * 1024;
/// Bound on `ucp_worker_progress` rounds per pump, so a pump never spins for long.
const PROGRESS_ROUNDS_MAX: u32 = 256;
/// How long closing an endpoint may take before it is abandoned.
const EP_CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// Slot link terminator.
const NONE: u32 = u32::MAX;

// ---------------------------------------------------------------------------------------
// State shared with UCX callbacks (and the progress thread).

/// One event produced by a UCX completion callback.
#[derive(Clone, Copy, Debug)]
struct OpEvent {
    /// Callback cell index: slot * 2 (+1 for the notification cell).
    cell: u32,
    status: ucs_status_t,
}

/// Inbound notifications waiting for `drain_notifications`. Storage is reused, so
/// steady-state receiving does not allocate.
#[derive(Default)]
pub(crate) struct Inbox {
    bytes: Vec<u8>,
    /// (start in `bytes`, sender name length, payload length)
    entries: Vec<(usize, u32, u32)>,
}

impl Inbox {
    pub(crate) fn push(&mut self, from: &[u8], payload: &[u8]) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(from);
        self.bytes.extend_from_slice(payload);
        self.entries
            .push((start, from.len() as u32, payload.len() as u32));
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

/// What callbacks may touch. Lives in an `Arc` so its address is stable and it outlives
/// every worker (workers are destroyed in `Core::drop`, which still holds the `Arc`).
pub(crate) struct Events {
    ops: ArrayQueue<OpEvent>,
    ep_error: AtomicBool,
    pub(crate) inbox: Mutex<Inbox>,
    /// Notifications dropped because they arrived in a form we cannot take (rendezvous).
    pub(crate) dropped_notifs: AtomicU64,
    request_free: unsafe extern "C" fn(*mut c_void),
}

/// `user_data` of a UCX request: where to report its completion.
struct OpCell {
    events: *const Events,
    index: u32,
}

/// `arg` of an endpoint's error handler.
struct PeerLink {
    events: *const Events,
    /// The failure status UCX reported for the endpoint, 0 while healthy.
    status: AtomicI8,
}

unsafe extern "C" fn on_op_done(
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

unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    // SAFETY: arg is the Box<PeerLink> owned by the peer, kept until its ep is closed.
    let link = unsafe { &*(arg as *const PeerLink) };
    link.status.store(status.0.min(-1), Ordering::Release);
    // SAFETY: `events` points into the core's Arc<Events>, alive while any ep exists.
    unsafe { &*link.events }
        .ep_error
        .store(true, Ordering::Release);
}

unsafe extern "C" fn on_notif(
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

// ---------------------------------------------------------------------------------------
// Core tables.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    WaitFlush,
    WaitNotif,
}

/// One in-flight request. Columns would buy nothing here: a slot is touched as a whole.
struct Slot {
    state: SlotState,
    /// Tag to report; `None` for a standalone notification.
    tag: Option<u64>,
    /// Where the request goes (None = local).
    peer: Option<PeerId>,
    /// First failure seen while posting.
    failure: Option<Failure>,
    /// Notification to send after the flush (payload copied here; capacity reused).
    notif: Vec<u8>,
    has_notif: bool,
    /// Next slot of the same flushed batch.
    next: u32,
}

struct MemEntry {
    memh: ucp_mem_h,
    addr: u64,
    len: u64,
    packed_rkey: Vec<u8>,
    /// Rkey unpacked on the self endpoint, for local transfers.
    self_rkey: ucp_rkey_h,
}

struct Worker {
    handle: ucp_worker_h,
    address: Vec<u8>,
    efd: i32,
}

struct PeerState {
    name: String,
    worker: usize,
    remote_address: Vec<u8>,
    ep: ucp_ep_h,
    link: Box<PeerLink>,
    regions: Arc<dyn PeerRegions>,
    rkeys: HashMap<u64, ucp_rkey_h>,
    /// Set once UCX reported the endpoint dead; cleared by a reload with new info.
    down: Option<ucs_status_t>,
    transports: String,
}

/// The UCX state of one backend instance. Accessed by one thread at a time (the backend
/// wraps it in a mutex); workers use `UCS_THREAD_MODE_SERIALIZED` accordingly.
pub(crate) struct Core {
    ucp: Arc<Ucp>,
    context: ucp_context_h,
    workers: Vec<Worker>,
    agent_name: Box<[u8]>,
    err_mode: ErrorMode,
    pub(crate) events: Arc<Events>,
    cells: Box<[OpCell]>,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    mems: Vec<Option<MemEntry>>,
    mem_generations: Vec<u32>,
    free_mems: Vec<u32>,
    peers: HashMap<PeerId, PeerState>,
    next_worker: usize,
    self_ep: ucp_ep_h,
    /// Completions produced outside a `post` call (callbacks, progress thread).
    pub(crate) ready: Completions,
    /// Largest single put/get; longer ranges are split.
    chunk_bytes: u64,
}

// SAFETY: the raw UCX handles in Core are only used by whichever thread holds the core
// (the backend keeps it behind a mutex), and the workers are created in
// UCS_THREAD_MODE_SERIALIZED, which permits use from different threads one at a time.
unsafe impl Send for Core {}
// SAFETY: Events is only read through shared references: the queue and atomics are
// Sync, the inbox is a Mutex, and `request_free` is a plain function pointer.
unsafe impl Send for Events {}
// SAFETY: see above.
unsafe impl Sync for Events {}

fn ucx_error(ucp: &Ucp, what: &str, status: ucs_status_t) -> Error {
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

/// `ZCOPY_THRESH` Ferry sets on UCX >= 1.14 unless `UCX_ZCOPY_THRESH` is set.
///
/// With UCX's `auto`, the protocol selection of 1.23 (observed with the NIXL wheel's
/// build, `UCX_PROTO_INFO=y`) picks CMA zero-copy (`process_vm_writev`, one system call
/// that pins the target's pages) for puts and gets of every size between processes on
/// one host, ~1.7 µs per 64 B descriptor. With any explicit threshold it picks the
/// shared-memory software emulation below ~1.6 KiB and CMA above, which moves 64 B × 1024
/// shuffled ~9× faster and leaves 1 MiB ranges on CMA (see the README).
pub(crate) const ZCOPY_THRESH_NEW_UCX: &str = "16k";

/// Whether a `UCX_TLS` value may select a shared-memory (mm) transport: an exclusion
/// list (`^…`) may, an inclusion list must name one.
fn may_use_shared_memory(tls: &str) -> bool {
    let tls = tls.trim();
    tls.starts_with('^')
        || tls.split(',').any(|t| {
            matches!(
                t.trim(),
                "all" | "sm" | "shm" | "mm" | "posix" | "sysv" | "xpmem"
            )
        })
}

/// The `ZCOPY_THRESH` override for this UCX version, if any.
fn zcopy_thresh_override(version: ferry_ucx_sys::UcxVersion) -> Option<String> {
    let new_protocols = version
        >= (ferry_ucx_sys::UcxVersion {
            major: 1,
            minor: 14,
            release: 0,
        });
    (new_protocols && std::env::var_os("UCX_ZCOPY_THRESH").is_none())
        .then(|| ZCOPY_THRESH_NEW_UCX.to_string())
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
        let zcopy_thresh = zcopy_thresh_override(ucp.version());
        let overrides = [
            (c"NET_DEVICES", &config.devices),
            (c"TLS", &config.transports),
            // A transport setting: UCX keeps it and applies it to the mm transports.
            (c"MM_FIFO_SIZE", &fifo_size),
            (c"MM_SEG_SIZE", &seg_size),
            (c"ZCOPY_THRESH", &zcopy_thresh),
        ];
        for (name, value) in overrides {
            let Some(value) = value else { continue };
            let value = std::ffi::CString::new(value.as_str()).map_err(|_| {
                Error::invalid(
                    Subject::BackendName(BACKEND.into()),
                    "parameter contains NUL",
                )
            });
            // SAFETY: config is valid, both strings are NUL-terminated.
            let status = value.as_ref().map(|value| unsafe {
                api.ucp_config_modify(ucp_config, name.as_ptr(), value.as_ptr())
            });
            match status {
                Ok(status) if status.is_ok() => {}
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
        let events = Arc::new(Events {
            ops: ArrayQueue::new(slot_count * 2),
            ep_error: AtomicBool::new(false),
            inbox: Mutex::new(Inbox::default()),
            dropped_notifs: AtomicU64::new(0),
            request_free: api.ucp_request_free,
        });
        let events_ptr = Arc::as_ptr(&events);
        let cells: Box<[OpCell]> = (0..slot_count as u32 * 2)
            .map(|index| OpCell {
                events: events_ptr,
                index,
            })
            .collect();
        let slots = (0..slot_count)
            .map(|_| Slot {
                state: SlotState::Free,
                tag: None,
                peer: None,
                failure: None,
                notif: Vec::new(),
                has_notif: false,
                next: NONE,
            })
            .collect();
        let mut core = Core {
            ucp: ucp.clone(),
            context,
            workers: Vec::with_capacity(config.workers),
            agent_name: agent_name.as_bytes().into(),
            err_mode: config.error_mode,
            events,
            cells,
            slots,
            free_slots: (0..slot_count as u32).rev().collect(),
            mems: Vec::new(),
            mem_generations: Vec::new(),
            free_mems: Vec::new(),
            peers: HashMap::new(),
            next_worker: 0,
            self_ep: ptr::null_mut(),
            ready: Completions::with_capacity(slot_count),
            chunk_bytes: config.chunk_bytes,
        };
        for index in 0..config.workers {
            core.add_worker(index, config.progress_thread)?;
        }
        Ok(core)
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
        // SAFETY: worker live; the arg outlives the worker (see Events).
        let status = unsafe { api.ucp_worker_set_am_recv_handler(handle, &am) };
        if !status.is_ok() {
            return Err(ucx_error(
                &self.ucp,
                "ucp_worker_set_am_recv_handler",
                status,
            ));
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

    /// The loaded library.
    pub(crate) fn ucp(&self) -> &Arc<Ucp> {
        &self.ucp
    }

    /// Worker addresses, in worker order.
    pub(crate) fn worker_addresses(&self) -> Vec<Vec<u8>> {
        self.workers.iter().map(|w| w.address.clone()).collect()
    }

    /// Event fds of the workers (progress-thread mode only).
    pub(crate) fn event_fds(&self) -> Vec<i32> {
        self.workers.iter().map(|w| w.efd).collect()
    }

    // -----------------------------------------------------------------------------------
    // Registration.

    pub(crate) fn register(&mut self, addr: u64, len: u64) -> Result<(u64, Vec<u8>)> {
        let api = self.ucp.api();
        // SAFETY: plain C struct, zero = no fields.
        let mut params: ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
        params.field_mask =
            u64::from(UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH);
        params.address = addr as *mut c_void;
        params.length = len as usize;
        let mut memh: ucp_mem_h = ptr::null_mut();
        // SAFETY: the caller owns the range (BackendApi contract: it stays valid until
        // deregistered); UCX only pins/registers it.
        let status = unsafe { api.ucp_mem_map(self.context, &params, &mut memh) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_mem_map", status));
        }
        let mut buffer: *mut c_void = ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: memh was just mapped in this context; out-pointers valid.
        let status = unsafe { api.ucp_rkey_pack(self.context, memh, &mut buffer, &mut size) };
        if !status.is_ok() {
            // SAFETY: undo the mapping made above.
            unsafe { api.ucp_mem_unmap(self.context, memh) };
            return Err(ucx_error(&self.ucp, "ucp_rkey_pack", status));
        }
        // SAFETY: UCX returned `size` readable bytes; copied, then released.
        let packed = unsafe {
            let packed = std::slice::from_raw_parts(buffer as *const u8, size).to_vec();
            api.ucp_rkey_buffer_release(buffer);
            packed
        };
        let public_md = crate::wire::frame_rkey(&packed);
        let entry = MemEntry {
            memh,
            addr,
            len,
            packed_rkey: packed,
            self_rkey: ptr::null_mut(),
        };
        let index = match self.free_mems.pop() {
            Some(i) => {
                self.mems[i as usize] = Some(entry);
                i
            }
            None => {
                self.mems.push(Some(entry));
                self.mem_generations.push(0);
                (self.mems.len() - 1) as u32
            }
        };
        let token = (u64::from(self.mem_generations[index as usize]) << 32) | u64::from(index);
        Ok((token, public_md))
    }

    fn mem_index(&self, token: u64) -> Option<usize> {
        let index = (token & u64::from(u32::MAX)) as usize;
        let generation = (token >> 32) as u32;
        match (self.mems.get(index), self.mem_generations.get(index)) {
            (Some(Some(_)), Some(&g)) if g == generation => Some(index),
            _ => None,
        }
    }

    pub(crate) fn deregister(&mut self, token: u64) -> Result<()> {
        let index = self
            .mem_index(token)
            .ok_or_else(|| Error::not_found(token_subject(token)))?;
        let entry = self.mems[index].take().expect("mem_index checked");
        let api = self.ucp.api();
        if !entry.self_rkey.is_null() {
            // SAFETY: rkey unpacked by us on the self ep, not used after this.
            unsafe { api.ucp_rkey_destroy(entry.self_rkey) };
        }
        // SAFETY: memh mapped by us in this context; the executor guarantees no request
        // in flight uses it.
        let status = unsafe { api.ucp_mem_unmap(self.context, entry.memh) };
        self.mem_generations[index] = self.mem_generations[index].wrapping_add(1);
        self.free_mems.push(index as u32);
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_mem_unmap", status));
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------
    // Peers and endpoints.

    pub(crate) fn load_remote(
        &mut self,
        peer: PeerId,
        name: &str,
        addresses: Option<Vec<Vec<u8>>>,
        regions: Arc<dyn PeerRegions>,
    ) -> Result<()> {
        if let Some(state) = self.peers.get_mut(&peer) {
            state.regions = regions;
            state.name.clear();
            state.name.push_str(name);
            if let Some(addresses) = addresses {
                let remote = addresses[state.worker % addresses.len()].clone();
                if remote != state.remote_address {
                    // The peer restarted (or moved): forget its endpoint and rkeys.
                    self.teardown_peer(peer);
                    let state = self.peers.get_mut(&peer).expect("present");
                    state.remote_address = remote;
                    state.down = None;
                    state.link.status.store(0, Ordering::Release);
                }
            }
            return Ok(());
        }
        let addresses = addresses.ok_or_else(|| Error::InvalidMetadata {
            reason: format!("UCX: first metadata of peer '{name}' has no connection info").into(),
        })?;
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
                link: Box::new(PeerLink {
                    events: Arc::as_ptr(&self.events),
                    status: AtomicI8::new(0),
                }),
                regions,
                rkeys: HashMap::new(),
                down: None,
                transports: String::new(),
            },
        );
        Ok(())
    }

    /// Close the peer's endpoint (in-flight requests to it fail) and drop its rkeys.
    fn teardown_peer(&mut self, peer: PeerId) {
        let Some(state) = self.peers.get_mut(&peer) else {
            return;
        };
        let ep = std::mem::replace(&mut state.ep, ptr::null_mut());
        let worker = self.workers[state.worker].handle;
        let rkeys: Vec<ucp_rkey_h> = state.rkeys.drain().map(|(_, r)| r).collect();
        if !ep.is_null() {
            self.close_ep(worker, ep);
        }
        let api = self.ucp.api();
        for rkey in rkeys {
            // SAFETY: rkeys unpacked on the now-closed ep; nothing uses them any more.
            unsafe { api.ucp_rkey_destroy(rkey) };
        }
    }

    pub(crate) fn unload_remote(&mut self, peer: PeerId) {
        if !self.peers.contains_key(&peer) {
            return;
        }
        self.teardown_peer(peer);
        self.peers.remove(&peer);
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

    /// Force-close `ep` and progress until UCX confirms (bounded by a timeout).
    fn close_ep(&mut self, worker: ucp_worker_h, ep: ucp_ep_h) {
        let api = self.ucp.api();
        let mut param = request_param();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: ep is live and owned by us; param valid for the call.
        let request = unsafe { api.ucp_ep_close_nbx(ep, &param) };
        if ucs_ptr_is_ptr(request) {
            let deadline = Instant::now() + EP_CLOSE_TIMEOUT;
            loop {
                // SAFETY: worker is live; request is the close request we own.
                let status = unsafe {
                    api.ucp_worker_progress(worker);
                    api.ucp_request_check_status(request)
                };
                if status != ucs_status_t::UCS_INPROGRESS {
                    break;
                }
                if Instant::now() > deadline {
                    log::warn!("UCX: endpoint close did not finish within {EP_CLOSE_TIMEOUT:?}");
                    break;
                }
            }
            // SAFETY: we own the close request; freeing an unfinished one lets UCX release
            // it when done.
            unsafe { api.ucp_request_free(request) };
        }
    }

    fn create_ep(
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
        // it needs); the error handler arg outlives the ep (owned by the peer state).
        let status = unsafe { api.ucp_ep_create(self.workers[worker].handle, &params, &mut ep) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_ep_create", status));
        }
        Ok(ep)
    }

    /// The endpoint to `peer`, created on first use.
    fn peer_ep(&mut self, peer: PeerId) -> Result<(ucp_ep_h, usize)> {
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
            return Ok((state.ep, state.worker));
        }
        let worker = state.worker;
        let ep = self.create_ep(worker, &state.remote_address, Some(&state.link))?;
        let transports = self.ep_transports(ep);
        let state = self.peers.get_mut(&peer).expect("present");
        log::info!(
            "UCX {}: endpoint to '{}' on worker {worker} uses {transports}",
            self.ucp.version(),
            state.name
        );
        state.ep = ep;
        state.transports = transports;
        Ok((ep, worker))
    }

    fn local_ep(&mut self) -> Result<ucp_ep_h> {
        if self.self_ep.is_null() {
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

    pub(crate) fn connect(&mut self, peer: PeerId) -> Result<()> {
        self.peer_ep(peer).map(|_| ())
    }

    /// A one-line summary of the lanes an endpoint uses, from `ucp_ep_print_info`.
    fn ep_transports(&self, ep: ucp_ep_h) -> String {
        let info = self.ep_info(ep);
        summarize_lanes(&info)
    }

    /// The full `ucp_ep_print_info` text of an endpoint.
    fn ep_info(&self, ep: ucp_ep_h) -> String {
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

    fn rkey_for(&mut self, endpoint: Endpoint, ep: ucp_ep_h, token: u64) -> Result<ucp_rkey_h> {
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
                Ok(entry.self_rkey)
            }
            Endpoint::Peer(peer) => {
                let state = self.peers.get_mut(&peer).expect("peer_ep checked");
                if let Some(&rkey) = state.rkeys.get(&token) {
                    return Ok(rkey);
                }
                let packed = state.regions.public_md(token).ok_or_else(|| {
                    Error::not_found(Subject::Named(
                        format!("region token {token:#x} of peer '{}'", state.name).into(),
                    ))
                })?;
                let packed =
                    crate::wire::unframe_rkey(packed).map_err(|why| Error::InvalidMetadata {
                        reason: format!(
                            "UCX rkey of region token {token:#x} of peer '{}': {why}",
                            state.name
                        )
                        .into(),
                    })?;
                let mut rkey: ucp_rkey_h = ptr::null_mut();
                // SAFETY: ep live; UCX parses the packed rkey (peer bytes) and reports
                // malformed input as an error status.
                let status = unsafe {
                    api.ucp_ep_rkey_unpack(ep, packed.as_ptr() as *const c_void, &mut rkey)
                };
                if !status.is_ok() {
                    return Err(Error::InvalidMetadata {
                        reason: format!(
                            "UCX rkey of region token {token:#x} of peer '{}': {}",
                            state.name,
                            self.ucp.status_string(status)
                        )
                        .into(),
                    });
                }
                state.rkeys.insert(token, rkey);
                Ok(rkey)
            }
        }
    }

    // -----------------------------------------------------------------------------------
    // Posting.

    /// Validate a batch completely (so an error means nothing started), resolving rkeys.
    fn validate(&mut self, endpoint: Endpoint, ep: ucp_ep_h, batch: &[Post<'_>]) -> Result<()> {
        let mut last_remote: Option<u64> = None;
        for post in batch {
            for kind in [post.local_kind, post.remote_kind] {
                if kind != MemKind::Dram {
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
                if last_remote != Some(range.remote_token) {
                    self.rkey_for(endpoint, ep, range.remote_token)?;
                    last_remote = Some(range.remote_token);
                }
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
        if self.free_slots.len() < batch.len() {
            return Err(Error::Capacity {
                what: "UCX requests in flight (parameter max_requests)",
                limit: self.slots.len(),
            });
        }
        self.validate(endpoint, ep, batch)?;

        let ucp = self.ucp.clone();
        let api = ucp.api();
        let mut head = NONE;
        let mut tail = NONE;
        let mut rkey_cache: (u64, ucp_rkey_h) = (u64::MAX, ptr::null_mut());
        for post in batch {
            let slot_index = self.free_slots.pop().expect("checked capacity");
            let mut failure = None;
            for (index, range) in post.ranges.iter().enumerate() {
                if range.len == 0 {
                    continue;
                }
                let rkey = if rkey_cache.0 == range.remote_token && !rkey_cache.1.is_null() {
                    rkey_cache.1
                } else {
                    let rkey = self
                        .rkey_for(endpoint, ep, range.remote_token)
                        .expect("validated");
                    rkey_cache = (range.remote_token, rkey);
                    rkey
                };
                // The registered memh: UCX then skips its registration-cache lookup
                // for protocols that need the local buffer registered (zero-copy).
                let mut param = request_param();
                if let Some(mem) = self
                    .mem_index(range.local_token)
                    .and_then(|i| self.mems[i].as_ref())
                {
                    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
                    param.memh = mem.memh;
                }
                // Large ranges are issued in chunks: UCX pipelines several operations
                // better than one huge one (measured with UCX 1.13 over shm and tcp).
                let mut offset = 0u64;
                while offset < range.len {
                    let len = (range.len - offset).min(self.chunk_bytes);
                    // SAFETY: ep and rkey are live; the local range lies inside a
                    // registered region (validated) and, per the backend contract, stays
                    // valid until this request completes; the remote range was published
                    // by the peer.
                    let status = unsafe {
                        match post.op {
                            ferry_backend_api::Op::Write => api.ucp_put_nbx(
                                ep,
                                (range.local_addr + offset) as *const c_void,
                                len as usize,
                                range.remote_addr + offset,
                                rkey,
                                &param,
                            ),
                            ferry_backend_api::Op::Read => api.ucp_get_nbx(
                                ep,
                                (range.local_addr + offset) as *mut c_void,
                                len as usize,
                                range.remote_addr + offset,
                                rkey,
                                &param,
                            ),
                        }
                    };
                    if ucs_ptr_is_ptr(status) {
                        // Completion is observed through the flush; release the request.
                        // SAFETY: we own this request and never touch it again.
                        unsafe { api.ucp_request_free(status) };
                    } else if ucs_ptr_is_err(status) {
                        failure = Some(failure_of(
                            ucs_ptr_status(status),
                            false,
                            Some(index as u32),
                        ));
                        break;
                    }
                    offset += len;
                }
                if failure.is_some() {
                    break;
                }
            }
            let slot = &mut self.slots[slot_index as usize];
            slot.state = SlotState::WaitFlush;
            slot.tag = Some(post.tag);
            slot.peer = peer;
            slot.failure = failure;
            slot.has_notif = post.notif.is_some();
            slot.notif.clear();
            if let Some(notif) = post.notif {
                slot.notif.extend_from_slice(notif);
            }
            slot.next = NONE;
            if head == NONE {
                head = slot_index;
            } else {
                self.slots[tail as usize].next = slot_index;
            }
            tail = slot_index;
        }

        // One flush for the whole batch: when it completes, every put/get above has.
        let mut param = request_param();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = Some(on_op_done);
        param.user_data = &self.cells[head as usize * 2] as *const OpCell as *mut c_void;
        // SAFETY: ep live; the user_data cell outlives the request (see Events).
        let request = unsafe { api.ucp_ep_flush_nbx(ep, &param) };
        if !ucs_ptr_is_ptr(request) {
            self.batch_flushed(head, ucs_ptr_status(request));
        }
        Ok(())
    }

    /// The flush of the batch starting at `head` finished with `status`.
    fn batch_flushed(&mut self, head: u32, status: ucs_status_t) {
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

    fn peer_gone(&self, peer: Option<PeerId>) -> bool {
        match peer {
            None => false,
            Some(p) => self
                .peers
                .get(&p)
                .is_none_or(|s| s.down.is_some() || s.ep.is_null()),
        }
    }

    /// Send the slot's notification (after its data is complete).
    fn send_notif(&mut self, index: u32) {
        let peer = self.slots[index as usize].peer;
        let Some(peer) = peer else {
            // To oneself: straight into the inbox, the data is already in place.
            let slot = &self.slots[index as usize];
            self.events
                .inbox
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(&self.agent_name, &slot.notif);
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
        param.user_data = &self.cells[index as usize * 2 + 1] as *const OpCell as *mut c_void;
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

    fn notif_sent(&mut self, index: u32, status: ucs_status_t) {
        let peer_gone = self.peer_gone(self.slots[index as usize].peer);
        let slot = &mut self.slots[index as usize];
        if status.is_err() && slot.failure.is_none() {
            slot.failure = Some(failure_of(status, peer_gone, None));
        }
        self.finish(index);
    }

    /// Report the slot's outcome (if it has a tag) and free it.
    fn finish(&mut self, index: u32) {
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
        self.free_slots.push(index);
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
                self.events
                    .inbox
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(&self.agent_name, payload);
                return Ok(());
            }
            Endpoint::Peer(peer) => {
                self.peer_ep(peer)?;
                peer
            }
        };
        let index = self.free_slots.pop().ok_or(Error::Capacity {
            what: "UCX requests in flight (parameter max_requests)",
            limit: self.slots.len(),
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
        self.send_notif(index);
        Ok(())
    }

    // -----------------------------------------------------------------------------------
    // Progress.

    /// Progress every worker (bounded) and turn callback events into completions.
    /// Returns whether anything happened.
    pub(crate) fn pump(&mut self) -> bool {
        let api = self.ucp.api();
        let mut progressed = false;
        for worker in &self.workers {
            for _ in 0..PROGRESS_ROUNDS_MAX {
                // SAFETY: worker live; callbacks only push into `events`.
                if unsafe { api.ucp_worker_progress(worker.handle) } == 0 {
                    break;
                }
                progressed = true;
            }
        }
        progressed | self.handle_events()
    }

    fn handle_events(&mut self) -> bool {
        let mut any = false;
        if self.events.ep_error.swap(false, Ordering::AcqRel) {
            any = true;
            let failed: Vec<(PeerId, i8)> = self
                .peers
                .iter()
                .filter(|(_, s)| s.down.is_none())
                .filter_map(|(&p, s)| {
                    let status = s.link.status.load(Ordering::Acquire);
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
        while let Some(event) = self.events.ops.pop() {
            any = true;
            let slot = event.cell / 2;
            if event.cell % 2 == 0 {
                self.batch_flushed(slot, event.status);
            } else {
                self.notif_sent(slot, event.status);
            }
        }
        any
    }

    /// Arm every worker for sleeping on its event fd. False if some worker has events
    /// pending (progress again instead of sleeping).
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

    /// Whether the peer's endpoint has been reported dead (for tests and diagnostics).
    pub(crate) fn peer_down(&self, peer: PeerId) -> Option<bool> {
        self.peers.get(&peer).map(|s| s.down.is_some())
    }

    /// Number of requests in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.slots.len() - self.free_slots.len()
    }

    /// Move finished completions into `done`.
    pub(crate) fn drain_ready(&mut self, done: &mut Completions) {
        for completion in self.ready.as_slice() {
            done.push(*completion);
        }
        self.ready.clear();
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        let peers: Vec<PeerId> = self.peers.keys().copied().collect();
        for peer in peers {
            self.teardown_peer(peer);
        }
        self.peers.clear();
        if !self.self_ep.is_null() {
            let ep = std::mem::replace(&mut self.self_ep, ptr::null_mut());
            let worker = self.workers[0].handle;
            self.close_ep(worker, ep);
        }
        let api = self.ucp.api();
        // Dropping the backend frees everything, including what was not deregistered.
        for entry in self.mems.iter_mut().filter_map(Option::take) {
            // SAFETY: our own rkey and mapping; no endpoint is left to use them.
            unsafe {
                if !entry.self_rkey.is_null() {
                    api.ucp_rkey_destroy(entry.self_rkey);
                }
                api.ucp_mem_unmap(self.context, entry.memh);
            }
        }
        for worker in self.workers.drain(..) {
            // SAFETY: all eps of this worker are closed; callbacks during destroy only
            // touch `events`/`cells`, which are still alive (fields of self).
            unsafe { api.ucp_worker_destroy(worker.handle) };
        }
        // SAFETY: every worker of the context is destroyed.
        unsafe { api.ucp_cleanup(self.context) };
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

#[cfg(test)]
mod shm_tests {
    use super::may_use_shared_memory;

    #[test]
    fn shared_memory_settings_follow_the_transport_list() {
        assert!(may_use_shared_memory("sm,self"));
        assert!(may_use_shared_memory("posix,tcp"));
        assert!(may_use_shared_memory("^cma"));
        assert!(may_use_shared_memory("all"));
        assert!(!may_use_shared_memory("tcp"));
        assert!(!may_use_shared_memory("tcp,self"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version(major: u32, minor: u32) -> UcxVersion {
        UcxVersion {
            major,
            minor,
            release: 0,
        }
    }

    #[test]
    fn zcopy_thresh_is_left_alone_before_1_14() {
        assert_eq!(zcopy_thresh_override(version(1, 13)), None);
    }

    #[test]
    fn zcopy_thresh_is_set_from_1_14_unless_the_user_chose_one() {
        let expected = std::env::var_os("UCX_ZCOPY_THRESH")
            .is_none()
            .then(|| ZCOPY_THRESH_NEW_UCX.to_string());
        assert_eq!(zcopy_thresh_override(version(1, 14)), expected);
        assert_eq!(zcopy_thresh_override(version(1, 23)), expected);
    }
}
