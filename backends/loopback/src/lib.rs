//! `LOOPBACK`: Ferry's built-in backend for DRAM ↔ DRAM transfers between agents in one
//! process (and within one agent). It really copies the bytes, delivers notifications
//! after the copy, and is the embedded default and the test vehicle of the engine.
//!
//! Connection info is the process id plus a process-unique backend id; loading a peer
//! resolves the peer's inbox once, so a post does no lookup. A peer from another
//! process is refused at load time.
//!
//! # Fault injection
//!
//! Every instance has a [`Faults`] control, reachable from tests with [`faults`] by
//! agent name: fail the next N requests, hold completions for N progress calls
//! ("complete late"), or drop a peer so posts to it fail with remote-disconnect.
// Reason: the backend copies bytes between registered addresses, which is raw-pointer
// work by nature. Every block states why the pointers are valid.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crossbeam_queue::ArrayQueue;
use ferry_backend_api::{
    effective_params, Backend, BackendFactory, BackendInit, Capabilities, Completions, Endpoint,
    Error, Failure, FailureKind, MemKind, NotifSink, ParamSpec, Params, PeerId, Post, Range,
    RegionSpec, Registered, RemoteAgent, Result, Subject,
};
use smallvec::SmallVec;

/// Backend type name.
pub const NAME: &str = "LOOPBACK";

const KINDS: &[MemKind] = &[MemKind::Dram];

const PARAMS: &[ParamSpec] = &[ParamSpec {
    name: "notif_queue",
    default: "65536",
    doc: "notifications an inbox holds before senders get a capacity error",
}];

/// An inbound notification. Payloads up to 64 bytes are stored inline (no allocation).
struct Message {
    from: Arc<str>,
    payload: SmallVec<[u8; 64]>,
}

/// One backend instance's mailbox, shared with every peer that loaded it.
struct Inbox {
    queue: ArrayQueue<Message>,
    /// Set when the owning backend is dropped.
    closed: AtomicBool,
}

/// Fault-injection controls of one backend instance (all default off).
#[derive(Debug, Default)]
pub struct Faults {
    fail_next: AtomicU32,
    late_progress_calls: AtomicU32,
    /// Whether any peer is dropped: lets a post skip the lock in the common case.
    any_dropped: AtomicBool,
    dropped: Mutex<Vec<String>>,
    panic_next_post: AtomicBool,
    refuse_cancel: AtomicBool,
}

impl Faults {
    /// Fail the next `count` posted requests with an I/O error (errno `EIO`).
    pub fn fail_next(&self, count: u32) {
        self.fail_next.store(count, Ordering::SeqCst);
    }
    /// Hold every completion for `calls` progress calls before reporting it.
    pub fn complete_late(&self, calls: u32) {
        self.late_progress_calls.store(calls, Ordering::SeqCst);
    }
    /// Act as if peer agent `name` went away: posts and notifications to it fail with
    /// remote-disconnect until [`Faults::restore_peer`].
    pub fn drop_peer(&self, name: &str) {
        let mut dropped = self.dropped.lock().unwrap_or_else(|e| e.into_inner());
        if !dropped.iter().any(|n| n == name) {
            dropped.push(name.to_string());
        }
        self.any_dropped.store(true, Ordering::SeqCst);
    }
    /// Undo [`Faults::drop_peer`].
    pub fn restore_peer(&self, name: &str) {
        let mut dropped = self.dropped.lock().unwrap_or_else(|e| e.into_inner());
        dropped.retain(|n| n != name);
        self.any_dropped
            .store(!dropped.is_empty(), Ordering::SeqCst);
    }
    /// Panic inside the next `post` (to test what a panic in a flush leaves behind).
    pub fn panic_next_post(&self) {
        self.panic_next_post.store(true, Ordering::SeqCst);
    }
    /// Make `cancel` answer "cannot cancel now" (`Ok(false)`), as a transport whose
    /// request is already on the wire does: the request then completes on its own.
    pub fn refuse_cancel(&self, refuse: bool) {
        self.refuse_cancel.store(refuse, Ordering::SeqCst);
    }
    /// Clear every fault.
    pub fn clear(&self) {
        self.panic_next_post.store(false, Ordering::SeqCst);
        self.refuse_cancel.store(false, Ordering::SeqCst);
        self.fail_next.store(0, Ordering::SeqCst);
        self.late_progress_calls.store(0, Ordering::SeqCst);
        self.dropped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
    fn take_failure(&self) -> bool {
        self.fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
    fn is_dropped(&self, name: &str) -> bool {
        if !self.any_dropped.load(Ordering::Relaxed) {
            return false;
        }
        let dropped = self.dropped.lock().unwrap_or_else(|e| e.into_inner());
        dropped.iter().any(|n| n == name)
    }
}

struct Directory {
    inboxes: HashMap<u64, Weak<Inbox>>,
    faults: HashMap<String, Weak<Faults>>,
}

fn directory() -> &'static Mutex<Directory> {
    static DIRECTORY: OnceLock<Mutex<Directory>> = OnceLock::new();
    DIRECTORY.get_or_init(|| {
        Mutex::new(Directory {
            inboxes: HashMap::new(),
            faults: HashMap::new(),
        })
    })
}

/// The fault controls of the loopback backend of agent `agent`, if it has one.
pub fn faults(agent: &str) -> Option<Arc<Faults>> {
    let dir = directory().lock().unwrap_or_else(|e| e.into_inner());
    dir.faults.get(agent).and_then(Weak::upgrade)
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Factory of [`Loopback`] backends.
#[derive(Debug, Default, Clone, Copy)]
pub struct LoopbackFactory;

impl BackendFactory for LoopbackFactory {
    fn name(&self) -> &'static str {
        NAME
    }
    fn params(&self) -> &'static [ParamSpec] {
        PARAMS
    }
    fn mem_kinds(&self) -> &'static [MemKind] {
        KINDS
    }
    fn create(&self, init: &BackendInit<'_>) -> Result<Box<dyn Backend>> {
        Ok(Box::new(Loopback::new(init)?))
    }
}

/// A peer as seen by this backend.
struct RemotePeer {
    name: String,
    inbox: Weak<Inbox>,
}

/// A completion waiting for its "late" delay to pass.
struct Held {
    tag: u64,
    result: std::result::Result<(), Failure>,
    calls_left: u32,
}

/// The in-process DRAM backend.
pub struct Loopback {
    params: Params,
    id: u64,
    agent: Arc<str>,
    inbox: Arc<Inbox>,
    faults: Arc<Faults>,
    peers: HashMap<PeerId, RemotePeer>,
    held: VecDeque<Held>,
}

impl Loopback {
    /// Make an instance for agent `init.agent_name`.
    pub fn new(init: &BackendInit<'_>) -> Result<Loopback> {
        let params = effective_params(NAME, PARAMS, init.params)?;
        let capacity: usize = params["notif_queue"]
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                Error::invalid(
                    Subject::Named("notif_queue".into()),
                    "must be a positive integer",
                )
            })?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let inbox = Arc::new(Inbox {
            queue: ArrayQueue::new(capacity),
            closed: AtomicBool::new(false),
        });
        let faults = Arc::new(Faults::default());
        {
            let mut dir = directory().lock().unwrap_or_else(|e| e.into_inner());
            dir.inboxes.retain(|_, w| w.strong_count() > 0);
            dir.faults.retain(|_, w| w.strong_count() > 0);
            dir.inboxes.insert(id, Arc::downgrade(&inbox));
            dir.faults
                .insert(init.agent_name.to_string(), Arc::downgrade(&faults));
        }
        Ok(Loopback {
            params,
            id,
            agent: Arc::from(init.agent_name),
            inbox,
            faults,
            peers: HashMap::new(),
            held: VecDeque::with_capacity(64),
        })
    }

    /// This instance's fault controls.
    pub fn faults(&self) -> Arc<Faults> {
        self.faults.clone()
    }

    fn target_inbox(&self, endpoint: Endpoint) -> std::result::Result<Arc<Inbox>, Error> {
        match endpoint {
            Endpoint::Local => Ok(self.inbox.clone()),
            Endpoint::Peer(peer) => {
                let remote = self
                    .peers
                    .get(&peer)
                    .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
                if self.faults.is_dropped(&remote.name) {
                    return Err(Error::RemoteDisconnect {
                        subject: Subject::PeerName(remote.name.clone()),
                    });
                }
                match remote.inbox.upgrade() {
                    Some(inbox) if !inbox.closed.load(Ordering::Acquire) => Ok(inbox),
                    _ => Err(Error::RemoteDisconnect {
                        subject: Subject::PeerName(remote.name.clone()),
                    }),
                }
            }
        }
    }

    fn deliver(&self, inbox: &Inbox, payload: &[u8]) -> Result<()> {
        let message = Message {
            from: self.agent.clone(),
            payload: SmallVec::from_slice(payload),
        };
        inbox.queue.push(message).map_err(|_| Error::Capacity {
            what: "loopback notification inbox",
            limit: inbox.queue.capacity(),
        })
    }

    fn finish(
        &mut self,
        tag: u64,
        result: std::result::Result<(), Failure>,
        done: &mut Completions,
    ) {
        let late = self.faults.late_progress_calls.load(Ordering::Relaxed);
        if late == 0 {
            done.push(ferry_backend_api::Completion { tag, result });
        } else {
            self.held.push_back(Held {
                tag,
                result,
                calls_left: late,
            });
        }
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.inbox.closed.store(true, Ordering::Release);
        let mut dir = directory().lock().unwrap_or_else(|e| e.into_inner());
        dir.inboxes.remove(&self.id);
    }
}

/// Copy one range. Returns the range index on an address overflow.
fn copy_range(op: ferry_backend_api::Op, range: &Range) {
    let (src, dst) = match op {
        ferry_backend_api::Op::Write => (range.local_addr, range.remote_addr),
        ferry_backend_api::Op::Read => (range.remote_addr, range.local_addr),
    };
    // SAFETY: the executor hands us only ranges that lie inside regions registered on
    // both sides (it resolved every descriptor against the section indexes), and the
    // registrants promised (`register` is unsafe) that those bytes stay valid and
    // writable while registered and that no Rust reference aliases them during a
    // transfer. Both agents live in this process (checked at `load_remote`), so the
    // addresses are ours. `copy` tolerates overlap between source and destination.
    unsafe {
        std::ptr::copy(src as *const u8, dst as *mut u8, range.len as usize);
    }
}

impl Backend for Loopback {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            remote: true,
            local: true,
            notifications: true,
            mem_kinds: KINDS,
        }
    }

    fn params(&self) -> &Params {
        &self.params
    }

    fn register(&mut self, region: &RegionSpec<'_>) -> Result<Registered> {
        if region.kind != MemKind::Dram {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!("memory kind {}", region.kind).into(),
            });
        }
        if region.desc.addr == 0 || region.desc.end().is_none_or(|end| end > isize::MAX as u64) {
            return Err(Error::invalid(
                Subject::Descriptor {
                    index: 0,
                    addr: region.desc.addr,
                    len: region.desc.len,
                    dev: region.desc.dev,
                },
                "not a valid host address range",
            ));
        }
        Ok(Registered {
            token: 0,
            public_md: Vec::new(),
        })
    }

    fn deregister(&mut self, _kind: MemKind, _token: u64) -> Result<()> {
        Ok(())
    }

    fn conn_info(&self) -> Vec<u8> {
        let mut info = Vec::with_capacity(12);
        info.extend_from_slice(&std::process::id().to_le_bytes());
        info.extend_from_slice(&self.id.to_le_bytes());
        info
    }

    fn load_remote(&mut self, peer: PeerId, remote: RemoteAgent<'_>) -> Result<()> {
        if remote.conn_info.is_empty() {
            // Partial metadata without connection info: keep what we have.
            return if self.peers.contains_key(&peer) {
                Ok(())
            } else {
                Err(Error::not_found(Subject::PeerName(format!(
                    "{} (no loopback connection info loaded yet)",
                    remote.name
                ))))
            };
        }
        let bytes: [u8; 12] = remote.conn_info.try_into().map_err(|_| {
            Error::invalid(
                Subject::PeerName(remote.name.to_string()),
                "loopback connection info must be 12 bytes",
            )
        })?;
        let pid = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
        let id = u64::from_le_bytes(bytes[4..].try_into().expect("8 bytes"));
        if pid != std::process::id() {
            return Err(Error::NotSupported {
                backend: NAME.into(),
                what: format!(
                    "peer '{}' lives in process {pid}; loopback only reaches agents of this process",
                    remote.name
                )
                .into(),
            });
        }
        let inbox = {
            let dir = directory().lock().unwrap_or_else(|e| e.into_inner());
            dir.inboxes.get(&id).cloned()
        }
        .filter(|w| w.strong_count() > 0)
        .ok_or_else(|| Error::RemoteDisconnect {
            subject: Subject::PeerName(remote.name.to_string()),
        })?;
        self.peers.insert(
            peer,
            RemotePeer {
                name: remote.name.to_string(),
                inbox,
            },
        );
        Ok(())
    }

    fn unload_remote(&mut self, peer: PeerId) {
        self.peers.remove(&peer);
    }

    fn connect(&mut self, peer: PeerId) -> Result<()> {
        self.target_inbox(Endpoint::Peer(peer)).map(|_| ())
    }

    fn post(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()> {
        if self.faults.panic_next_post.swap(false, Ordering::SeqCst) {
            panic!("loopback fault injection: panic inside post");
        }
        let inbox = self.target_inbox(endpoint)?;
        for post in batch {
            if self.faults.take_failure() {
                let failure = Failure {
                    kind: FailureKind::Backend,
                    errno: 5, // EIO
                    range: Some(0),
                };
                self.finish(post.tag, Err(failure), done);
                continue;
            }
            for range in post.ranges {
                copy_range(post.op, range);
            }
            let mut result = Ok(());
            if let Some(payload) = post.notif {
                if self.deliver(&inbox, payload).is_err() {
                    result = Err(Failure {
                        kind: FailureKind::Backend,
                        errno: 105, // ENOBUFS
                        range: None,
                    });
                }
            }
            self.finish(post.tag, result, done);
        }
        Ok(())
    }

    fn progress(&mut self, done: &mut Completions) {
        for _ in 0..self.held.len() {
            let Some(mut held) = self.held.pop_front() else {
                break;
            };
            held.calls_left -= 1;
            if held.calls_left == 0 {
                done.push(ferry_backend_api::Completion {
                    tag: held.tag,
                    result: held.result,
                });
            } else {
                self.held.push_back(held);
            }
        }
    }

    fn cancel(&mut self, tag: u64) -> Result<bool> {
        if self.faults.refuse_cancel.load(Ordering::SeqCst) {
            return Ok(false);
        }
        let before = self.held.len();
        self.held.retain(|h| h.tag != tag);
        Ok(self.held.len() != before)
    }

    fn notify(&mut self, endpoint: Endpoint, payload: &[u8]) -> Result<()> {
        let inbox = self.target_inbox(endpoint)?;
        self.deliver(&inbox, payload)
    }

    fn drain_notifications(&mut self, sink: &mut dyn NotifSink) -> usize {
        let mut count = 0;
        while let Some(message) = self.inbox.queue.pop() {
            sink.deliver(&message.from, &message.payload);
            count += 1;
        }
        count
    }
}
