//! Ferry's UCX backend: DRAM transfers between agents with UCP RMA (`ucp_put_nbx` /
//! `ucp_get_nbx`), completion by endpoint flush, notifications as active messages.
//!
//! # How it maps onto UCX
//!
//! - **Connection info** = the addresses of this backend's UCP workers
//!   (`num_workers`, default 1). Each peer is served by one local worker (round-robin)
//!   and talks to the remote worker with the same index (modulo the peer's count).
//! - **Registration** (DRAM) = `ucp_mem_map`; the token names the mapping in a
//!   generational table; the public metadata is the packed rkey.
//! - **Peers**: a peer's endpoint is created, and its wireup waited for (up to 5 ms),
//!   when its metadata is loaded (`connect_on_load`, the default: the first request
//!   pays no wireup); the packed rkeys of the regions it lists are unpacked then too
//!   (`unpack_on_load`: by default all but those UCX maps here, a peer's shared-memory
//!   segments, which wait for first use); with `connect_on_load=false` everything
//!   waits for the first use (or [`Backend::connect`]).
//!   Error handling is `peer` by default; rkeys are cached per region token until the
//!   peer is unloaded, reloaded with new connection info, or reported dead.
//! - **Posting** a batch issues one put/get per merged range on the batch's endpoint,
//!   then one `ucp_ep_flush_nbx`; each request of the batch completes when the flush
//!   does. A post hands about `post_window_bytes` of the batch to UCX (which sends
//!   inline where it can; a window's last piece is never shorter than a window or a
//!   `chunk_bytes` piece, whichever is smaller, unless its range ends), and over tcp
//!   stops after ~100 µs of sending (puts and gets in steps of at most 256 KiB); every
//!   progress call hands over one more window, and the flush goes once the whole batch
//!   is with UCX. A notification attached to a request is sent (active message, eager,
//!   header = sender agent name) only *after* that flush, so the target sees it only once the
//!   data is there; the request completes when the notification is sent.
//! - **Batched small ranges**: on endpoints whose transports emulate small RMA with
//!   active messages (shared memory, tcp), ranges of at most `am_batch_range_bytes`
//!   travel packed into active messages of at most `am_batch_bytes` (WRITE: the data;
//!   READ: a request and a reply carrying the data); the target checks each range
//!   against its registered memory and acks. See `state/batch.rs`.
//! - **Local** transfers (both sides registered here) go through an endpoint to our own
//!   worker 0; local notifications go straight to the inbox.
//! - **Progress**: by default the executor's progress phase calls
//!   `ucp_worker_progress` (no thread). When nothing of ours is pending (no request in
//!   flight, no wireup, close or deferred post) and the workers have found no work for
//!   1 ms, that call **rests**: it progresses the workers at most every 50 µs
//!   ([`UcxBackend::progress_rests`] counts the calls that skipped them). Over tcp an
//!   idle worker's progress is an `epoll_wait` system call, paid on every progress of
//!   an agent with an idle tcp endpoint (a peer loaded but rarely used); work that
//!   arrives unasked (a peer's request into our memory, a
//!   notification) is seen at most 50 µs later, and every call progresses again from
//!   then until the workers are quiet for 1 ms. A post of our own ends the rest at
//!   once. With `progress_thread=true` a thread progresses
//!   the workers (and polls on for `progress_thread_spin_us` after its last progress)
//!   and, when there is nothing to do, **sleeps on the workers' event
//!   fds** (`ucp_worker_arm` + `poll`), so it costs ~0% CPU when idle; it never rests.
//! - **Failure**: when UCX reports a peer's endpoint dead, or the peer's requests made
//!   no progress for `peer_timeout_ms` (default 10 s; a link that silently went down —
//!   see `state/deadline.rs`), its requests complete with
//!   [`FailureKind::RemoteDisconnect`](ferry_backend_api::FailureKind), later posts to
//!   it fail with [`Error::RemoteDisconnect`] until a reconnect ([`Backend::connect`])
//!   or its metadata is reloaded with new connection info.
//! - **Unloading** a peer force-closes its endpoint: its in-flight requests are canceled
//!   by UCX and reported, once each, from their callbacks; the endpoint's callback state
//!   and rkeys live until UCX confirms the close (see `state/peers.rs`).
//!
//! # Which UCX
//!
//! The library is loaded at run time: `libucp.so.0` from the system by default, or the
//! file named by the `ucx_library` parameter (e.g. the `libucp.so` of the `libucx-cu12`
//! wheel or the one bundled with NIXL's wheel, to compare on the same UCX). UCX's own
//! environment (`UCX_TLS`, `UCX_NET_DEVICES`, …) applies; the `transports` and `devices`
//! parameters override `UCX_TLS` and `UCX_NET_DEVICES`. The version in use and the transports of every new
//! endpoint are logged (`log` crate, target `ferry_ucx`), and
//! [`UcxBackend::endpoint_transports`] returns them.
//!
//! # Ordinary user memory between processes
//!
//! What UCX does for a put into plain (malloc'd, `ucp_mem_map`-registered) memory of
//! another process on the same host depends on the version; see `backends/ucx/README.md`
//! for what was observed with each version.
// Reason: a backend over a C library: handles, callbacks and raw buffers cross the FFI
// boundary. Every unsafe block states why it is sound.
#![allow(unsafe_code)]

mod state;
mod thread;
pub mod wire;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use ferry_backend_api::{
    Allocation, Backend, BackendFactory, BackendInit, Capabilities, Completions, Endpoint, Error,
    MemKind, NotifSink, ParamSpec, Params, PeerId, Post, RegionSpec, Registered, RemoteAgent,
    Result, Subject,
};
pub use ferry_ucx_sys::UcxVersion;
use ferry_ucx_sys::{LoadError, Ucp};

use crate::state::Core;
use crate::thread::ProgressThread;
pub use crate::thread::Spin;

/// The backend's type name.
pub const BACKEND: &str = "UCX";

/// Tracy plot: UCX requests (and standalone notifications) in flight.
static IN_FLIGHT: ferry_backend_api::trace::Plot =
    ferry_backend_api::trace::Plot::new("ferry-ucx in-flight");

/// Longest allocation [`Backend::alloc`] accepts, in bytes.
pub const ALLOC_LEN_MAX: u64 = state::ALLOC_LEN_MAX;

/// Largest notification payload this backend carries.
pub const NOTIF_LEN_MAX: usize = state::NOTIF_LEN_MAX;

const MEM_KINDS: &[MemKind] = state::MEM_KINDS;

/// Parameters of the UCX backend.
pub const PARAMS: &[ParamSpec] = &[
    ParamSpec {
        name: "num_workers",
        default: "1",
        doc: "UCP workers per backend (1..=64); peers are spread over them round-robin",
    },
    ParamSpec {
        name: "error_handling",
        default: "peer",
        doc: "endpoint error handling: 'peer' (detect dead peers, fail their requests) or 'none'",
    },
    ParamSpec {
        name: "devices",
        default: "",
        doc: "comma-separated network devices (overrides UCX_NET_DEVICES); empty = UCX's choice",
    },
    ParamSpec {
        name: "transports",
        default: "",
        doc: "comma-separated UCX transports (overrides UCX_TLS, e.g. 'tcp'); empty = UCX's choice",
    },
    ParamSpec {
        name: "ucx_library",
        default: "",
        doc: "path of the libucp to load; empty = $FERRY_UCX_LIBRARY if set, else the system's \
              libucp.so.0",
    },
    ParamSpec {
        name: "progress_thread",
        default: "false",
        doc: "progress UCX on a thread that sleeps on the workers' event fds when idle",
    },
    ParamSpec {
        name: "progress_thread_spin_us",
        default: "auto",
        doc: "with progress_thread, how long the thread keeps polling after the last \
              progress before it sleeps on the event fds (a request that follows within \
              this time finds it awake: no wake-up); 0 = sleep at once; auto = up to 100 \
              us, only while requests keep coming back within it (3 wake-ups in a row \
              each within 100 us of the progress before), off again once 100 us pass \
              with nothing, and for 1 ms after progress that was UCX's own work (a \
              wireup: UCX 1.13's tcp does not wake a sleeping worker for every step); \
              auto:N = the same with a window of N us",
    },
    ParamSpec {
        name: "connect_on_load",
        default: "true",
        doc: "when a peer's metadata is loaded, create its endpoint and wait up to 5 ms for \
              its wireup (NIXL also connects at load), so the first request pays none; not \
              for a peer an earlier backend of the agent serves (standby: the first request \
              through UCX connects); false = on first use (a peer that is loaded but never \
              used costs no connection)",
    },
    ParamSpec {
        name: "unpack_on_load",
        default: "auto",
        doc: "with connect_on_load, also unpack at load the rkeys of the regions the peer \
              lists (as NIXL does), so the first request pays none: auto = every region \
              but those UCX maps into this process (a peer's UCX-allocated shared-memory \
              segments: their rkey is released at once and unpacked on first use, so no \
              segment stays mapped here unused); true = all, mapped ones too; false = \
              none, each on first use (an idle loaded peer then holds no unpacked rkeys)",
    },
    ParamSpec {
        name: "chunk_bytes",
        default: "1048576",
        doc: "largest single put/get; longer merged ranges are issued in pieces of this size",
    },
    ParamSpec {
        name: "post_window_bytes",
        default: "1048576",
        doc: "bytes a post hands to UCX at once; the rest of a batch is handed over by later \
              progress calls, a window each (UCX sends inline, so this bounds the time a post \
              or one progress call spends moving data; a window's last piece runs to the end \
              of its range, a window or a chunk_bytes piece, whichever is smallest; over tcp a post also stops after ~100 us of \
              sending, in steps of at most 256 KiB); 0 = everything in the post",
    },
    ParamSpec {
        name: "shm_fifo_size",
        default: "auto",
        doc: "receive FIFO entries of UCX's shared-memory transports (UCX_MM_FIFO_SIZE), a power \
              of two 2..=65536; 'auto' = 256 unless UCX_MM_FIFO_SIZE, UCX_SYSV_FIFO_SIZE or \
              UCX_POSIX_FIFO_SIZE is set; 'ucx' = UCX's own default (64)",
    },
    ParamSpec {
        name: "shm_seg_bytes",
        default: "auto",
        doc: "segment size of UCX's shared-memory transports (UCX_MM_SEG_SIZE), 4096..=32768; \
              'auto' = 32768 unless UCX_MM_SEG_SIZE, UCX_SYSV_SEG_SIZE or UCX_POSIX_SEG_SIZE is \
              set; 'ucx' = UCX's own default (8256)",
    },
    ParamSpec {
        name: "tcp_seg_bytes",
        default: "auto",
        doc: "send segment of UCX's tcp transport (UCX_TCP_TX_SEG_SIZE; the receive segment, \
              UCX_TCP_RX_SEG_SIZE, is set to 4x it), 8192..=1048576; 'auto' = 262144 unless \
              UCX_TCP_TX_SEG_SIZE, UCX_TCP_RX_SEG_SIZE or UCX_TCP_SEG_SIZE is set; 'ucx' = \
              UCX's own defaults (8 KiB / 64 KiB)",
    },
    ParamSpec {
        name: "notif_queue",
        default: "65536",
        doc: "inbound notifications the inbox holds until drained; past it a local sender gets a \
              capacity error and a peer's notification is refused and counted",
    },
    ParamSpec {
        name: "notif_queue_bytes",
        default: "67108864",
        doc: "bytes (payloads and sender names) the inbox holds until drained; past it as for \
              notif_queue",
    },
    ParamSpec {
        name: "ep_close",
        default: "force",
        doc: "how unload/disconnect close an endpoint: 'force' (UCX cancels outstanding \
              requests at once) or 'flush' (they finish first; the close may take as long as \
              the peer needs, in the background)",
    },
    ParamSpec {
        name: "close_progress_rounds",
        default: "256",
        doc: "worker progress rounds an endpoint close may take inside unload/disconnect; a \
              close still pending then finishes in the background (0 = always)",
    },
    ParamSpec {
        name: "peer_timeout_ms",
        default: "10000",
        doc: "a peer whose requests make no progress for this long (progressed time) is \
              declared unreachable: its requests fail with remote-disconnect, and so do later \
              posts until a reconnect (make_connection) or new metadata; 0 = never. A batch \
              completes as a whole: raise it above the longest batch (bytes / link rate)",
    },
    ParamSpec {
        name: "am_batch",
        default: "auto",
        doc: "pack small WRITE and READ ranges of a batch into active messages ('auto': on endpoints \
              whose lanes are all shared memory, tcp or self, where UCX emulates small puts \
              with active messages; 'on'; 'off')",
    },
    ParamSpec {
        name: "am_tcp",
        default: "auto",
        doc: "carry every DRAM range (not only small ones) in Ferry's active messages, in \
              pieces of a batch message, instead of UCX's puts and gets ('auto': on endpoints \
              whose puts go over tcp, where UCX emulates them with active messages anyway and \
              UCX 1.13 aborts a target whose connection is reset under a put; the target \
              checks every range against its registrations; 'on'; 'off')",
    },
    ParamSpec {
        name: "am_tcp_rndv",
        default: "on",
        doc: "am_tcp WRITE pieces of 64 KiB or more go by rendezvous, in pieces of up to \
              am_tcp_rndv_piece_bytes: the target checks the range, then UCX receives the \
              data straight into the region (zero-copy at both ends on tcp) instead of into \
              a UCX buffer that Ferry's handler copies from; used with peers that announce \
              it ('on'; 'off': eager pieces of 252 KiB)",
    },
    ParamSpec {
        name: "am_tcp_rndv_piece_bytes",
        default: "auto",
        doc: "largest WRITE piece sent by rendezvous (am_tcp_rndv); pieces of 64 KiB or more \
              go that way, shorter tails are packed ('auto': 1 MiB from UCX 1.16, 768 KiB \
              before; or 65536..=16777216)",
    },
    ParamSpec {
        name: "am_tcp_rndv_receives_max",
        default: "4096",
        doc: "rendezvous pieces from peers this backend receives at once (1..=1048576); a \
              piece beyond is refused and its request fails with ENOBUFS (an initiator \
              keeps at most 32 in flight)",
    },
    ParamSpec {
        name: "vmm_spanning",
        default: "refuse",
        doc: "a VRAM region of VMM memory spanning several physical allocations mapped back \
              to back (PyTorch expandable segments): 'refuse' (UCX's cuda_ipc exports only \
              the first allocation, openucx/ucx#11283) or 'allow' (where no cuda_ipc runs \
              between the agents, or the UCX in use has that fix)",
    },
    ParamSpec {
        name: "am_batch_range_bytes",
        default: "4096",
        doc: "largest range that is batched into active messages (0 = batching off; \
              at most am_batch_bytes - 28)",
    },
    ParamSpec {
        name: "am_batch_bytes",
        default: "auto",
        doc: "largest batch message (header, range entries and data; for a READ also the \
              data of its reply), 1024..=65536; 'auto' = 16384 where active messages go over \
              shared memory, 65536 where they go over tcp (measured best for each; larger \
              messages measured far slower on shared memory)",
    },
    ParamSpec {
        name: "am_batch_messages",
        default: "256",
        doc: "batch messages in flight at once (their buffers are allocated on first use and \
              reused); with none free a small range is put one by one",
    },
    ParamSpec {
        name: "max_requests",
        default: "8192",
        doc: "requests (and standalone notifications) in flight at once",
    },
];

/// When small WRITE ranges are batched into active messages (`am_batch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmBatchMode {
    /// On endpoints whose transports emulate small RMA with active messages.
    Auto,
    /// On every peer endpoint.
    On,
    /// Never.
    Off,
}

/// Batch message size of `am_batch_bytes=auto` on endpoints whose active messages go
/// over shared memory (measured: larger messages fall into a slow mode more often).
pub const AM_BATCH_BYTES_SHM: usize = 16384;

/// Batch message size of `am_batch_bytes=auto` on endpoints whose active messages go over
/// tcp (measured ~2× the rate of 16 KiB messages at 64 B and 4 KiB ranges).
pub const AM_BATCH_BYTES_TCP: usize = 65536;

/// Counters of the batched-WRITE protocol (see [`UcxBackend::batch_counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchCounts {
    /// Batch messages from peers refused here (malformed, or a range outside registered
    /// memory); nothing of them was written.
    pub refused: u64,
    /// Acks received here that were malformed or did not fit the ack queue.
    pub dropped_acks: u64,
    /// Acks received here that named no message waiting for one.
    pub stale_acks: u64,
    /// Batch messages this backend sent (WRITE data and READ requests).
    pub sent: u64,
    /// Acks this backend could not send back (no reply endpoint, or the send failed).
    pub unsent_acks: u64,
    /// Acks whose send buffer had to be allocated (the pool was empty).
    pub allocated_acks: u64,
    /// READ replies whose buffer had to be allocated (none free for reuse).
    pub allocated_replies: u64,
    /// Batch messages of this initiator whose buffer a request had to allocate (or
    /// grow): each message keeps its buffer, and the first ones a new endpoint's first
    /// request fills are made when the endpoint is (at the load by default).
    pub grown_messages: u64,
    /// Answers received to the pings loads send (one per load of a peer whose ranges go
    /// in Ferry's messages, `connect_on_load`).
    pub pongs: u64,
    /// Pings this target answered (one per load of it by a peer whose ranges go in
    /// Ferry's messages).
    pub pings: u64,
    /// WRITE pieces peers sent here by rendezvous (`am_tcp_rndv`) that landed in a
    /// region.
    pub rndv_received: u64,
    /// Such pieces whose receive failed (its sender's request fails).
    pub rndv_failed: u64,
    /// Such pieces refused because `am_tcp_rndv_receives_max` receives were in flight.
    pub rndv_refused: u64,
    /// Such receives in flight now (a withdrawal of a region they reach waits for them).
    pub rndv_in_flight: usize,
    /// This backend's batch messages in flight now.
    pub in_flight: usize,
}

/// Which rkeys a load unpacks (`unpack_on_load`, with `connect_on_load`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnpackOnLoad {
    /// None: each on its first use.
    Never,
    /// Every region's, except those UCX maps into this process (`ucp_rkey_ptr`
    /// succeeds: a peer's shared-memory segment), which are released at once and
    /// unpacked on first use, so no segment stays mapped here unused (`auto`, the
    /// default).
    Unmapped,
    /// Every region's, mapped ones too (`true`).
    All,
}

/// Endpoint error-handling mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorMode {
    /// `UCP_ERR_HANDLING_MODE_PEER`: peer failures are detected and reported.
    Peer,
    /// `UCP_ERR_HANDLING_MODE_NONE`: fastest, a dead peer is not detected.
    None,
}

/// Parsed backend parameters.
#[derive(Clone, Debug)]
pub struct Config {
    /// Number of UCP workers.
    pub workers: usize,
    /// Endpoint error handling.
    pub error_mode: ErrorMode,
    /// Network devices, if overridden.
    pub devices: Option<String>,
    /// Transports, if overridden.
    pub transports: Option<String>,
    /// Library to load (`None` = system default).
    pub library: Option<PathBuf>,
    /// Whether to run a progress thread.
    pub progress_thread: bool,
    /// When the progress thread polls on after progress instead of sleeping.
    pub progress_spin: Spin,
    /// Whether loading a peer's metadata creates its endpoint (and waits for its wireup).
    pub connect_on_load: bool,
    /// Which rkeys of the peer's regions it also unpacks.
    pub unpack_on_load: UnpackOnLoad,
    /// Requests in flight at once.
    pub max_requests: usize,
    /// How long a peer's requests may make no progress before the peer is declared
    /// unreachable (`None` = never).
    pub peer_timeout: Option<std::time::Duration>,
    /// Largest single put/get in bytes.
    pub chunk_bytes: u64,
    /// Bytes handed to UCX per post or progress call (`u64::MAX` = no window).
    pub window_bytes: u64,
    /// Notifications the inbox holds until drained.
    pub notif_entries_max: usize,
    /// Bytes the inbox holds until drained.
    pub notif_bytes_max: usize,
    /// Progress rounds a close may take before it finishes in the background.
    pub close_rounds: u32,
    /// Close endpoints forcibly (`ep_close=force`) rather than after a flush.
    pub close_force: bool,
    /// Receive FIFO entries of UCX's shared-memory transports to set (`None` = leave
    /// UCX's configuration alone).
    pub shm_fifo_size: Option<u32>,
    /// Segment size of UCX's shared-memory transports to set (`None` = leave UCX's
    /// configuration alone).
    pub shm_seg_bytes: Option<u32>,
    /// Send segment of UCX's tcp transport to set (receive: 4×; `None` = UCX's).
    pub tcp_seg_bytes: Option<u32>,
    /// When small WRITEs are batched into active messages.
    pub am_batch: AmBatchMode,
    /// When every DRAM range goes in active messages (`Auto`: where puts go over tcp).
    pub am_tcp: AmBatchMode,
    /// Whether such WRITE pieces of 64 KiB or more go by rendezvous.
    pub am_tcp_rndv: bool,
    /// Largest rendezvous piece (`None` = by UCX version).
    pub am_tcp_rndv_piece_bytes: Option<u64>,
    /// Rendezvous receives in flight at once (target side).
    pub am_tcp_rndv_receives_max: usize,
    /// Largest batched range (0 = off).
    pub am_batch_range_bytes: u64,
    /// Whether a VMM region spanning several physical allocations is accepted.
    pub vmm_spanning: bool,
    /// Largest batch message (`None` = per endpoint: [`AM_BATCH_BYTES_SHM`] or
    /// [`AM_BATCH_BYTES_TCP`]).
    pub am_batch_bytes: Option<usize>,
    /// Batch messages in flight at once.
    pub am_batch_messages: usize,
}

/// Shared-memory FIFO size applied by `shm_fifo_size=auto`. UCX's default of 64 entries
/// made a batch of more than 64 small puts wait for the target to drain the FIFO (with
/// UCX 1.13, ~5× fewer descriptors per second, measured before small ranges went in
/// batch messages). 256 holds as many messages as `am_batch_messages` sends at once;
/// 4096 (the value until 2026-12-03) measured no faster with batching and cost ~34 MB
/// of resident memory per worker (UCX touches every FIFO entry's buffer at creation:
/// 40.8 MB per agent against 6.2 MB when workers were made with the backend; see the
/// README).
pub const SHM_FIFO_SIZE_AUTO: u32 = 256;

/// Environment variables through which a user already chose the shared-memory FIFO size.
const FIFO_SIZE_ENV: [&str; 3] = [
    "UCX_MM_FIFO_SIZE",
    "UCX_SYSV_FIFO_SIZE",
    "UCX_POSIX_FIFO_SIZE",
];

/// Shared-memory segment size applied by `shm_seg_bytes=auto`. UCX 1.13 emulates a put
/// into user memory with active messages of one segment each; 32 KiB segments instead of
/// ~8 KiB move 1 MiB ranges ~1.3× faster (see the README). UCX's FIFO element carries the
/// length in 16 bits, so 64 KiB is out of reach.
pub const SHM_SEG_BYTES_AUTO: u32 = 32768;

/// tcp send segment applied by `tcp_seg_bytes=auto` (the receive segment is 4× it).
/// UCX 1.13 has no RMA over tcp: it carries puts and gets in active messages of one send
/// segment each, 8 KiB by default. 256 KiB segments (set as UCX's `TX_SEG_SIZE` and
/// `RX_SEG_SIZE`, which only tcp has) move one request across two network namespaces
/// 2–3× faster (UCX 1.13.1, medians of 3 interleaved runs of `ucx` vs `auto`: 256 KiB
/// WRITE 0.56 → 1.17 GB/s, 16 MiB WRITE 0.60 → 1.76, 256 KiB READ 0.61 → 1.97, 16 MiB
/// READ 0.76 → 2.29; see `backends/ucx/README.md`).
pub const TCP_SEG_BYTES_AUTO: u32 = 262_144;

/// Environment variables through which a user already chose tcp segment sizes.
const TCP_SEG_ENV: [&str; 3] = [
    "UCX_TCP_TX_SEG_SIZE",
    "UCX_TCP_RX_SEG_SIZE",
    "UCX_TCP_SEG_SIZE",
];

/// Environment variables through which a user already chose the shared-memory segment size.
const SEG_SIZE_ENV: [&str; 3] = ["UCX_MM_SEG_SIZE", "UCX_SYSV_SEG_SIZE", "UCX_POSIX_SEG_SIZE"];

/// `auto` (the given value unless one of `env` is set), `ucx` (None) or a number in
/// `range` that `valid` accepts.
fn ucx_tuning(
    text: &str,
    auto: u32,
    env: &[&str],
    range: std::ops::RangeInclusive<u32>,
    valid: impl Fn(u32) -> bool,
) -> std::result::Result<Option<u32>, ()> {
    match text.trim() {
        "auto" => Ok(env
            .iter()
            .all(|name| std::env::var_os(name).is_none())
            .then_some(auto)),
        "ucx" => Ok(None),
        text => text
            .parse::<u32>()
            .ok()
            .filter(|n| range.contains(n) && valid(*n))
            .map(Some)
            .ok_or(()),
    }
}

impl Config {
    /// Parse effective parameters (see [`PARAMS`]).
    pub fn from_params(params: &Params) -> Result<Config> {
        let get = |key: &str| -> &str {
            params
                .get(key)
                .map(String::as_str)
                .or_else(|| PARAMS.iter().find(|p| p.name == key).map(|p| p.default))
                .unwrap_or("")
        };
        let bad = |key: &str, why: &str| {
            Error::invalid(
                Subject::BackendName(BACKEND.into()),
                format!("parameter {key}='{}': {why}", get(key)),
            )
        };
        // A whole number in `range`; with `auto`, also that word (then `None`).
        let number = |key: &str, range: std::ops::RangeInclusive<u64>| -> Result<u64> {
            get(key)
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|n| range.contains(n))
                .ok_or_else(|| {
                    bad(
                        key,
                        &format!("expected {}..={}", range.start(), range.end()),
                    )
                })
        };
        let auto_or_number = |key: &str, range: std::ops::RangeInclusive<u64>| {
            if get(key) == "auto" {
                return Ok(None);
            }
            let why = format!("expected 'auto' or {}..={}", range.start(), range.end());
            number(key, range).map(Some).map_err(|_| bad(key, &why))
        };
        let workers = number("num_workers", 1..=64)? as usize;
        let error_mode = match get("error_handling") {
            "peer" => ErrorMode::Peer,
            "none" => ErrorMode::None,
            _ => return Err(bad("error_handling", "expected 'peer' or 'none'")),
        };
        let devices = Some(get("devices").trim())
            .filter(|d| !d.is_empty())
            .map(str::to_string);
        let transports = Some(get("transports").trim())
            .filter(|d| !d.is_empty())
            .map(str::to_string);
        let library = Some(get("ucx_library").trim())
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(library_from_env);
        let progress_thread = match get("progress_thread") {
            "true" | "1" | "yes" => true,
            "false" | "0" | "no" => false,
            _ => return Err(bad("progress_thread", "expected true or false")),
        };
        let progress_spin = {
            let key = "progress_thread_spin_us";
            let value = get(key).trim();
            let us = |n: &str, range: std::ops::RangeInclusive<u64>| {
                n.parse::<u64>()
                    .ok()
                    .filter(|n| range.contains(n))
                    .map(std::time::Duration::from_micros)
                    .ok_or_else(|| bad(key, "expected 'auto', 'auto:1..=1000000' or 0..=1000000"))
            };
            match value.strip_prefix("auto") {
                Some("") => Spin::Auto(thread::AUTO_WINDOW),
                Some(window) => match window.strip_prefix(':') {
                    Some(n) => Spin::Auto(us(n, 1..=1_000_000)?),
                    None => {
                        return Err(bad(
                            key,
                            "expected 'auto', 'auto:1..=1000000' or 0..=1000000",
                        ))
                    }
                },
                None => Spin::Fixed(us(value, 0..=1_000_000)?),
            }
        };
        let connect_on_load = match get("connect_on_load") {
            "true" | "1" | "yes" => true,
            "false" | "0" | "no" => false,
            _ => return Err(bad("connect_on_load", "expected true or false")),
        };
        let unpack_on_load = match get("unpack_on_load") {
            "auto" => UnpackOnLoad::Unmapped,
            "true" | "1" | "yes" => UnpackOnLoad::All,
            "false" | "0" | "no" => UnpackOnLoad::Never,
            _ => return Err(bad("unpack_on_load", "expected auto, true or false")),
        };
        let max_requests: usize = get("max_requests")
            .parse()
            .ok()
            .filter(|n| (1..=1 << 20).contains(n))
            .ok_or_else(|| bad("max_requests", "expected 1..=1048576"))?;
        let notif_entries_max: usize = get("notif_queue")
            .parse()
            .ok()
            .filter(|n| (1..=1 << 24).contains(n))
            .ok_or_else(|| bad("notif_queue", "expected 1..=16777216"))?;
        let notif_bytes_max: usize = get("notif_queue_bytes")
            .parse()
            .ok()
            .filter(|n| (1024..=1 << 40).contains(n))
            .ok_or_else(|| bad("notif_queue_bytes", "expected 1024..=2^40"))?;
        let close_force = match get("ep_close") {
            "force" => true,
            "flush" => false,
            _ => return Err(bad("ep_close", "expected 'force' or 'flush'")),
        };
        let close_rounds: u32 = get("close_progress_rounds")
            .parse()
            .ok()
            .filter(|n| *n <= 65536)
            .ok_or_else(|| bad("close_progress_rounds", "expected 0..=65536"))?;
        let peer_timeout_ms: u64 = get("peer_timeout_ms")
            .parse()
            .ok()
            .filter(|n| *n <= 86_400_000)
            .ok_or_else(|| bad("peer_timeout_ms", "expected 0..=86400000"))?;
        let peer_timeout =
            (peer_timeout_ms > 0).then(|| std::time::Duration::from_millis(peer_timeout_ms));
        let chunk_bytes: u64 = get("chunk_bytes")
            .parse()
            .ok()
            .filter(|n| *n >= 4096)
            .ok_or_else(|| bad("chunk_bytes", "expected at least 4096"))?;
        let window_bytes = match get("post_window_bytes").parse::<u64>() {
            Ok(0) => u64::MAX,
            Ok(n) if n >= 4096 => n,
            _ => return Err(bad("post_window_bytes", "expected 0 or at least 4096")),
        };
        let shm_fifo_size = ucx_tuning(
            get("shm_fifo_size"),
            SHM_FIFO_SIZE_AUTO,
            &FIFO_SIZE_ENV,
            2..=65536,
            u32::is_power_of_two,
        )
        .map_err(|()| {
            bad(
                "shm_fifo_size",
                "expected 'auto', 'ucx' or a power of two 2..=65536",
            )
        })?;
        let shm_seg_bytes = ucx_tuning(
            get("shm_seg_bytes"),
            SHM_SEG_BYTES_AUTO,
            &SEG_SIZE_ENV,
            4096..=32768,
            |_| true,
        )
        .map_err(|()| bad("shm_seg_bytes", "expected 'auto', 'ucx' or 4096..=32768"))?;
        let tcp_seg_bytes = ucx_tuning(
            get("tcp_seg_bytes"),
            TCP_SEG_BYTES_AUTO,
            &TCP_SEG_ENV,
            8192..=1 << 20,
            |_| true,
        )
        .map_err(|()| bad("tcp_seg_bytes", "expected 'auto', 'ucx' or 8192..=1048576"))?;
        let am_batch = match get("am_batch") {
            "auto" => AmBatchMode::Auto,
            "on" | "true" => AmBatchMode::On,
            "off" | "false" => AmBatchMode::Off,
            _ => return Err(bad("am_batch", "expected 'auto', 'on' or 'off'")),
        };
        let am_tcp = match get("am_tcp") {
            "auto" => AmBatchMode::Auto,
            "on" | "true" => AmBatchMode::On,
            "off" | "false" => AmBatchMode::Off,
            _ => return Err(bad("am_tcp", "expected 'auto', 'on' or 'off'")),
        };
        let am_tcp_rndv = match get("am_tcp_rndv") {
            "on" | "true" => true,
            "off" | "false" => false,
            _ => return Err(bad("am_tcp_rndv", "expected 'on' or 'off'")),
        };
        let am_tcp_rndv_piece_bytes = auto_or_number("am_tcp_rndv_piece_bytes", 1 << 16..=1 << 24)?;
        let am_tcp_rndv_receives_max = number("am_tcp_rndv_receives_max", 1..=1 << 20)? as usize;
        let vmm_spanning = match get("vmm_spanning") {
            "refuse" => false,
            "allow" => true,
            _ => return Err(bad("vmm_spanning", "expected 'refuse' or 'allow'")),
        };
        let am_batch_bytes = auto_or_number("am_batch_bytes", 1024..=1 << 16)?.map(|n| n as usize);
        let range_max = am_batch_bytes.unwrap_or(AM_BATCH_BYTES_SHM)
            - wire::BATCH_HEADER_LEN_BYTES
            - wire::BATCH_ENTRY_LEN_BYTES;
        let am_batch_range_bytes: u64 = get("am_batch_range_bytes")
            .parse()
            .ok()
            .filter(|n| *n <= range_max as u64)
            .ok_or_else(|| {
                bad(
                    "am_batch_range_bytes",
                    &format!("expected 0..={range_max} (am_batch_bytes, or 16384, - 28)"),
                )
            })?;
        let am_batch_messages = number("am_batch_messages", 1..=65536)? as usize;
        Ok(Config {
            am_batch,
            am_tcp,
            am_tcp_rndv,
            am_tcp_rndv_piece_bytes,
            am_tcp_rndv_receives_max,
            vmm_spanning,
            am_batch_range_bytes,
            am_batch_bytes,
            am_batch_messages,
            notif_entries_max,
            notif_bytes_max,
            close_rounds,
            close_force,
            shm_fifo_size,
            shm_seg_bytes,
            tcp_seg_bytes,
            chunk_bytes,
            window_bytes,
            workers,
            error_mode,
            devices,
            transports,
            library,
            progress_thread,
            progress_spin,
            connect_on_load,
            unpack_on_load,
            max_requests,
            peer_timeout,
        })
    }
}

/// Environment variable naming the libucp to load when `ucx_library` is not given, so
/// that tests, benchmarks and tools all run on one UCX build without loading the
/// system's as well.
pub const LIBRARY_ENV: &str = "FERRY_UCX_LIBRARY";

fn library_from_env() -> Option<PathBuf> {
    std::env::var_os(LIBRARY_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Libraries loaded so far, by the name they were loaded under. Kept for the life of the
/// process: unloading UCX while anything might still reference it is not worth the risk.
fn load_library(library: Option<&Path>) -> std::result::Result<Arc<Ucp>, String> {
    static LOADED: OnceLock<Mutex<Vec<Arc<Ucp>>>> = OnceLock::new();
    let name = library.unwrap_or(Path::new(ferry_ucx_sys::DEFAULT_LIBRARY));
    let mut loaded = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(ucp) = loaded.iter().find(|u| u.library() == name) {
        return Ok(ucp.clone());
    }
    let ucp = Ucp::load(name).map_err(|e: LoadError| e.to_string())?;
    log::info!(
        "UCX {} ({}) loaded from {}",
        ucp.version(),
        ucp.version_string(),
        name.display()
    );
    let ucp = Arc::new(ucp);
    loaded.push(ucp.clone());
    Ok(ucp)
}

/// How many backend drops in this process ran out the time they give their workers'
/// flush (100 ms) before destroying them. A flush waits for peers to answer what is
/// still being wired up; a drop progresses its peers among the process's other UCX
/// backends meanwhile (a peer agent in the same process answers then), so this counts
/// peers elsewhere that did not answer. With UCX 1.13 a wireup reply still pending then aborts the
/// process in `ucp_worker_destroy` (an upstream assertion, see the README).
pub fn drop_flush_timeouts() -> u64 {
    state::DROP_FLUSH_TIMEOUTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Creates UCX backends. Registered under the name `UCX`.
#[derive(Clone, Copy, Debug, Default)]
pub struct UcxFactory;

impl BackendFactory for UcxFactory {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn params(&self) -> &'static [ParamSpec] {
        PARAMS
    }

    fn mem_kinds(&self) -> &'static [MemKind] {
        MEM_KINDS
    }

    fn available(&self) -> std::result::Result<(), String> {
        load_library(library_from_env().as_deref()).map(|_| ())
    }

    fn available_with(&self, params: &Params) -> std::result::Result<(), String> {
        match params.get("ucx_library").map(|s| s.trim()) {
            Some(path) if !path.is_empty() => load_library(Some(Path::new(path))).map(|_| ()),
            _ => self.available(),
        }
    }

    fn kind_available(&self, kind: MemKind) -> std::result::Result<(), String> {
        static VRAM: OnceLock<std::result::Result<(), String>> = OnceLock::new();
        let ucp = load_library(None)?;
        match kind {
            MemKind::Dram => Ok(()),
            MemKind::Vram => VRAM.get_or_init(|| state::vram_available(&ucp)).clone(),
            other => Err(format!("UCX does not move {other}")),
        }
    }

    fn create(&self, init: &BackendInit<'_>) -> Result<Box<dyn Backend>> {
        Ok(Box::new(UcxBackend::new(init)?))
    }
}

/// One UCX backend instance (a UCP context and its workers).
pub struct UcxBackend {
    core: Arc<Mutex<Core>>,
    params: Params,
    version: UcxVersion,
    /// Refused notifications already logged.
    refused_reported: u64,
    // Declared last: dropped (thread stopped and joined) before `core` is released.
    thread: Option<ProgressThread>,
}

impl UcxBackend {
    /// Create a backend (what [`UcxFactory::create`] does, with the concrete type).
    pub fn new(init: &BackendInit<'_>) -> Result<UcxBackend> {
        let params = ferry_backend_api::effective_params(BACKEND, PARAMS, init.params)?;
        let config = Config::from_params(&params)?;
        if init.agent_name.is_empty() || init.agent_name.len() > 1024 {
            return Err(Error::invalid(
                Subject::BackendName(BACKEND.into()),
                "agent name must be 1..=1024 bytes (it is the notification header)",
            ));
        }
        let ucp = load_library(config.library.as_deref()).map_err(|reason| Error::Backend {
            backend: BACKEND.into(),
            errno: libc::ENOENT,
            desc: None,
            detail: reason.into(),
        })?;
        let version = ucp.version();
        let core = Core::new(ucp, init.agent_name, &config)?;
        let core = Arc::new(Mutex::new(core));
        state::enlist(&core);
        let thread = if config.progress_thread {
            Some(ProgressThread::start(core.clone(), config.progress_spin)?)
        } else {
            None
        };
        Ok(UcxBackend {
            core,
            params,
            version,
            refused_reported: 0,
            thread,
        })
    }

    fn core(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The version of the UCX library in use.
    pub fn ucx_version(&self) -> UcxVersion {
        self.version
    }

    /// The UCX library file in use and its version string.
    pub fn ucx_library(&self) -> (PathBuf, String) {
        let core = self.core();
        (
            core.ucp().library().to_path_buf(),
            core.ucp().version_string(),
        )
    }

    /// The transports the endpoint to `endpoint` uses (a one-line summary) and UCX's full
    /// description of it; creates the endpoint if needed.
    pub fn endpoint_transports(&self, endpoint: Endpoint) -> Result<(String, String)> {
        self.core().endpoint_info(endpoint)
    }

    /// Whether UCX reported the endpoint to `peer` dead (`None` if the peer is unknown).
    pub fn peer_down(&self, peer: PeerId) -> Option<bool> {
        self.core().peer_down(peer)
    }

    /// Whether the endpoint to `peer` exists, and how many of its regions' rkeys are
    /// unpacked (`None` if the peer is unknown). With `connect_on_load` both are done
    /// when the peer is loaded; otherwise by its first request.
    pub fn peer_connection(&self, peer: PeerId) -> Option<(bool, usize)> {
        self.core().peer_connection(peer)
    }

    /// Requests (and standalone notifications) currently in flight.
    pub fn in_flight(&self) -> usize {
        self.core().in_flight()
    }

    /// Notifications dropped because they did not arrive in one eager message.
    pub fn dropped_notifications(&self) -> u64 {
        self.core()
            .events
            .dropped_notifs
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Peers' notifications refused because the inbox was full (see the `notif_queue`
    /// and `notif_queue_bytes` parameters). Local senders get an error instead.
    pub fn refused_notifications(&self) -> u64 {
        self.core()
            .events
            .refused_notifs
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Endpoints whose close UCX has not confirmed yet (their error-handler state and
    /// rkeys are kept until it has; see `state/peers.rs`).
    pub fn closing_endpoints(&self) -> usize {
        self.core().closing_endpoints()
    }

    /// Whether the loaded UCX offers its performance model (`ucp_ep_evaluate_perf`), which [`Backend::estimate`] then uses.
    pub fn has_perf_model(&self) -> bool {
        self.core().has_perf_model()
    }

    /// Allocations made through [`Backend::alloc`] and not freed yet.
    pub fn allocations(&self) -> usize {
        self.core().allocations()
    }

    /// Counters of the batched-WRITE protocol (both roles).
    pub fn batch_counts(&self) -> BatchCounts {
        self.core().batch_counts()
    }

    /// Whether small WRITEs to `peer` are batched into active messages (`None` while
    /// the peer is unknown or has no endpoint yet). Even then, ranges into a peer region
    /// UCX maps here (`ucp_rkey_ptr`: UCX-allocated memory over shared memory) go as
    /// puts and gets.
    pub fn batches_to(&self, peer: PeerId) -> Option<bool> {
        self.core().batches_to(peer)
    }

    /// Whether the UCP workers exist yet: they are made on first need (the first
    /// registration or allocation, the connection info, a peer's load, a local
    /// transfer), or with the backend where a progress thread runs.
    pub fn workers_started(&self) -> bool {
        self.core().workers_started()
    }

    /// The progress thread's Linux thread id (`None` without one, or before it started):
    /// for reading its CPU time (`/proc/self/task/<tid>/stat`).
    pub fn progress_thread_tid(&self) -> Option<i32> {
        self.thread.as_ref().and_then(|t| t.tid())
    }

    /// How many times the progress thread has started polling on instead of sleeping
    /// (each a spin window opened after progress; 0 without a thread).
    pub fn progress_thread_spins(&self) -> u64 {
        self.thread.as_ref().map_or(0, |t| t.stats().0)
    }

    /// How many passes the progress thread's loop has made (each one progress of the
    /// workers): a sleeping thread makes one per wake-up, a polling one many per
    /// millisecond (0 without a thread).
    pub fn progress_thread_passes(&self) -> u64 {
        self.thread.as_ref().map_or(0, |t| t.stats().1)
    }

    /// How many times the progress thread has polled on after progress that was UCX's
    /// own work rather than ours (a new peer's wireup, a connection accepted or
    /// closed): `progress_thread_spin_us=auto` keeps the thread awake for
    /// 1 ms (renewed while it lasts) then, because UCX 1.13's tcp transport does not wake
    /// a sleeping worker for every step of a wireup (0 without a thread).
    pub fn progress_thread_settles(&self) -> u64 {
        self.thread.as_ref().map_or(0, |t| t.stats().2)
    }

    /// How many calls of [`Backend::progress`] rested instead of progressing the
    /// workers: nothing of ours pending, the workers quiet for 1 ms, and the last pump
    /// less than 50 µs before (see the crate docs, "Progress").
    pub fn progress_rests(&self) -> u64 {
        self.core().rested
    }

    /// How many loads made no endpoint because an earlier backend of the agent serves
    /// the peer ([`RemoteAgent::standby`](ferry_backend_api::RemoteAgent)).
    pub fn standby_loads(&self) -> u64 {
        self.core().standby_loads
    }

    /// Whether a progress thread runs.
    pub fn has_progress_thread(&self) -> bool {
        self.thread.is_some()
    }
}

impl Backend for UcxBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            remote: true,
            local: true,
            notifications: true,
            mem_kinds: MEM_KINDS,
        }
    }

    fn params(&self) -> &Params {
        &self.params
    }

    fn describe(&self) -> Option<String> {
        let (library, version) = self.ucx_library();
        let v = self.ucx_version();
        let old = (v.major, v.minor) < (1, 16);
        Some(format!(
            "UCX {version} from {}{}{}",
            library.display(),
            if self.has_progress_thread() {
                ", progress thread"
            } else {
                ""
            },
            if old {
                " (this UCX emulates RMA over tcp and into ordinary memory over shared \
                 memory with active messages: with the default backends a same-host peer \
                 goes to SHM; a newer libucp through ucx_library= drives tcp faster)"
            } else {
                ""
            }
        ))
    }

    unsafe fn register(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        if region.kind != MemKind::Dram && region.kind != MemKind::Vram {
            return Err(Error::NotSupported {
                backend: BACKEND.into(),
                what: format!("{} memory", region.kind).into(),
            });
        }
        let desc = region.desc;
        if desc.len == 0 || desc.addr == 0 || desc.end().is_none() {
            return Err(Error::invalid(
                Subject::Descriptor {
                    index: 0,
                    addr: desc.addr,
                    len: desc.len,
                    dev: desc.dev,
                },
                "a UCX region needs a non-null address and a non-zero length",
            ));
        }
        let mut core = self.core();
        // An agent that registers memory is about to publish it or move it: its workers
        // are made now rather than in the load of its first peer (6-14 ms with UCX
        // 1.13's shared-memory transports), which a first transfer would wait for.
        core.start_workers()?;
        let (token, public_md) = if region.kind == MemKind::Vram {
            core.register_vram(desc.addr, desc.len, desc.dev)?
        } else {
            core.register(desc.addr, desc.len)?
        };
        Ok(Registered { token, public_md })
    }

    fn withdraw(&mut self, kind: MemKind, token: u64) -> Result<bool> {
        if kind != MemKind::Dram {
            // Peers reach VRAM through UCX's own RMA, which cannot be fenced (README).
            return Ok(true);
        }
        self.core().withdraw(token)
    }

    unsafe fn deregister(&mut self, kind: MemKind, token: u64) -> Result<()> {
        if kind != MemKind::Dram && kind != MemKind::Vram {
            return Err(Error::NotSupported {
                backend: BACKEND.into(),
                what: format!("{kind} memory").into(),
            });
        }
        let mut core = self.core();
        core.vram_bind();
        core.deregister(token)
    }

    fn alloc(&mut self, kind: MemKind, len: u64) -> Result<Allocation> {
        if kind != MemKind::Dram {
            return Err(Error::NotSupported {
                backend: BACKEND.into(),
                what: format!("allocating {kind} memory (only DRAM)").into(),
            });
        }
        let mut core = self.core();
        core.start_workers()?;
        core.alloc(len)
    }

    unsafe fn free(&mut self, kind: MemKind, addr: u64) -> Result<()> {
        if kind != MemKind::Dram {
            return Err(Error::NotSupported {
                backend: BACKEND.into(),
                what: format!("allocating {kind} memory (only DRAM)").into(),
            });
        }
        self.core().free(addr)
    }

    fn conn_info(&self) -> Result<Vec<u8>> {
        // Every build that writes format 2 handles batch messages (the handlers are
        // registered on every worker, whatever `am_batch` says about sending them).
        let mut core = self.core();
        // Peers that load this metadata send batches checked against the index of
        // registered memory: built now, not by the first of them; and the buffers
        // their first READ batches are answered from.
        core.settle_region_index();
        core.ready_read_replies();
        let addresses = core.worker_addresses()?;
        drop(core);
        Ok(wire::encode(
            &addresses,
            wire::FEATURE_BATCH_AM | wire::FEATURE_RNDV_PIECES,
        ))
    }

    fn load_remote(&mut self, peer: PeerId, remote: RemoteAgent<'_>) -> Result<()> {
        let addresses = if remote.conn_info.is_empty() {
            None
        } else {
            Some(wire::decode(remote.conn_info)?)
        };
        self.core().load_remote(
            peer,
            remote.name,
            addresses,
            remote.regions,
            remote.standby,
            remote.ready_ranges,
        )
    }

    fn unload_remote(&mut self, peer: PeerId) {
        self.core().unload_remote(peer);
    }

    fn connect(&mut self, peer: PeerId) -> Result<()> {
        self.core().connect(peer)
    }

    fn disconnect(&mut self, peer: PeerId) -> Result<()> {
        self.core().disconnect(peer)
    }

    unsafe fn post(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()> {
        let _span = ferry_backend_api::trace_span!("ferry-ucx::post");
        let mut core = self.core();
        core.vram_bind();
        let result = core.post(endpoint, batch);
        core.drain_ready(done);
        IN_FLIGHT.value(core.in_flight() as f64);
        result
    }

    fn progress(&mut self, done: &mut Completions) {
        let _span = ferry_backend_api::trace_span!("ferry-ucx::progress");
        let mut core = self.core();
        if core.resting() {
            return;
        }
        core.vram_bind();
        core.pump();
        core.drain_ready(done);
        IN_FLIGHT.value(core.in_flight() as f64);
    }

    fn notify(&mut self, endpoint: Endpoint, payload: &[u8]) -> Result<()> {
        self.core().notify(endpoint, payload)
    }

    fn estimate(
        &mut self,
        endpoint: Endpoint,
        _op: ferry_backend_api::Op,
        ranges: &[ferry_backend_api::Range],
    ) -> Option<ferry_backend_api::CostEstimate> {
        self.core().estimate(endpoint, ranges)
    }

    fn drain_notifications(&mut self, sink: &mut dyn NotifSink) -> usize {
        let core = self.core.lock().unwrap_or_else(|e| e.into_inner());
        let refused = core
            .events
            .refused_notifs
            .load(std::sync::atomic::Ordering::Relaxed);
        if refused != self.refused_reported {
            log::warn!(
                "UCX: {} notification(s) from peers refused: inbox full (notif_queue, \
                 notif_queue_bytes)",
                refused - self.refused_reported
            );
            self.refused_reported = refused;
        }
        let mut inbox = core.events.inbox.lock().unwrap_or_else(|e| e.into_inner());
        inbox.drain(|from, payload| sink.deliver(from, payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_parse_and_refuse_bad_values() {
        let defaults =
            ferry_backend_api::effective_params(BACKEND, PARAMS, &Params::new()).unwrap();
        let config = Config::from_params(&defaults).unwrap();
        assert_eq!(config.workers, 1);
        assert_eq!(config.error_mode, ErrorMode::Peer);
        assert!(config.devices.is_none());
        assert_eq!(config.library, library_from_env());
        assert!(!config.progress_thread);

        for (key, value) in [
            ("num_workers", "0"),
            ("num_workers", "x"),
            ("error_handling", "maybe"),
            ("progress_thread", "sometimes"),
            ("progress_thread_spin_us", "soon"),
            ("progress_thread_spin_us", "2000000"),
            ("progress_thread_spin_us", "auto:0"),
            ("progress_thread_spin_us", "auto:"),
            ("progress_thread_spin_us", "automatic"),
            ("max_requests", "0"),
            ("shm_fifo_size", "100"),
            ("shm_fifo_size", "1"),
            ("shm_fifo_size", "big"),
            ("shm_seg_bytes", "65536"),
            ("tcp_seg_bytes", "4096"),
            ("tcp_seg_bytes", "2097152"),
            ("shm_seg_bytes", "1"),
            ("notif_queue", "0"),
            ("notif_queue_bytes", "10"),
            ("ep_close", "gently"),
            ("close_progress_rounds", "-1"),
            ("peer_timeout_ms", "soon"),
            ("peer_timeout_ms", "-5"),
            ("post_window_bytes", "100"),
            ("am_batch", "sometimes"),
            ("am_batch_bytes", "100"),
            ("am_batch_range_bytes", "40000"),
            ("am_batch_bytes", "131072"),
            ("am_batch_messages", "0"),
        ] {
            let mut params = defaults.clone();
            params.insert(key.into(), value.into());
            let err = Config::from_params(&params).unwrap_err();
            assert!(err.to_string().contains(key), "{err}");
        }
        let mut unknown = Params::new();
        unknown.insert("no_such".into(), "1".into());
        assert!(ferry_backend_api::effective_params(BACKEND, PARAMS, &unknown).is_err());
    }

    #[test]
    fn missing_library_is_a_typed_error() {
        let mut params = Params::new();
        params.insert("ucx_library".into(), "/nonexistent/libucp.so".into());
        let err = UcxBackend::new(&BackendInit {
            agent_name: "a",
            params: &params,
        })
        .err()
        .expect("must fail");
        assert!(matches!(err, Error::Backend { .. }), "{err}");
        assert!(err.to_string().contains("/nonexistent/libucp.so"), "{err}");
    }

    #[test]
    fn lane_summary_reads_print_info() {
        let info = "#\n# UCP endpoint\n#\n#               peer: <no debug data>\n#                 lane[0]:  8:self/memory.0 md[5]           -> md[5]/self/sysdev[255] rma_bw#0 am am_bw#0\n#                 lane[1]:  3:cma/memory.0 md[3]          -> md[3]/cma/sysdev[255] rma_bw#1\n";
        assert_eq!(
            state::summarize_lanes(info),
            "self/memory [rma_bw#0 am am_bw#0], cma/memory [rma_bw#1]"
        );
    }
}
