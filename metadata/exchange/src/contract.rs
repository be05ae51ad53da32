//! The store contract: what every metadata store receives, what it emits, what it
//! must guarantee, and the handle the manager keeps of it. Everything a new store needs
//! to know is in this file; `stores/in_process/` is the smallest store that follows it
//! (README, "Adding a store").
//!
//! # What a store receives
//! - At start, `start(shared: Arc<Shared>, config: &ItsConfig) -> Result<StoreWorker,
//!   Error>` (one function per store folder, registered in `stores/mod.rs`). [`Shared`]
//!   carries the agent's name, the namespace, the exchange-wide settings
//!   ([`crate::ExchangeConfig`]: I/O and fetch timeouts, queue capacities), the local
//!   metadata snapshots ([`Shared::local`]) and the stop flag.
//! - Then [`StoreCmd`]s through the queues it returned ([`CommandQueue`]), in the
//!   order the caller made them (per queue). A store may give fetches a queue of their
//!   own ([`StoreWorker::fetches`]) and may offer a direct path written on the caller's
//!   thread ([`DirectFetch`]).
//!
//! # What it emits
//! Only [`Event`]s, through [`Shared::emit`] (never blocks; a full queue is the event
//! queue's business, see `events.rs`). For every `Fetch` exactly one `Load` or
//! `FetchFailed`; for a failed `Publish` or `Withdraw` one `SendFailed`; an `Invalidate`
//! for a fetched peer whose metadata is gone (below). A store never touches agent
//! state and never loads anything itself.
//!
//! # What it guarantees
//! 1. **Bounded.** Every network operation has a deadline (the I/O timeout), every
//!    fetch ends within the fetch timeout, every queue and table is bounded.
//! 2. **Publish survives the store.** What was published and not withdrawn is published
//!    again after the store lost it (restart, lease loss), without the agent asking.
//! 3. **Withdraw is seen.** After a `Withdraw`, every watcher of this agent gets an
//!    `Invalidate` (within the store's watch bound).
//! 4. **Liveness.** A fetched peer (full metadata) stays watched: if its owner crashes or
//!    is partitioned away, its watchers get an `Invalidate` within a bound the store
//!    documents (etcd: the lease TTL; TCPStore: the heartbeat bound; in-process: at
//!    once when the owner's manager is dropped). A restarted owner is picked up again:
//!    its next publication is fetchable (and, where the store can see it, reloaded
//!    at its watchers without a new fetch).
//! 5. **Stops.** When the stop flag is raised and the queues are dropped, every thread
//!    of the store ends within the I/O timeout, so [`StoreWorker::stop`] returns.
//!
//! Keys are `<namespace>/<agent>/<label>` ([`Shared::key`]); labels never contain `/`
//! and are never empty, so `<namespace>/<agent>/` and keys with a further `/` are free
//! for a store's own bookkeeping (TCPStore: withdrawal marks and heartbeats).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use ferry_storage::Error;

use crate::config::{store_key, ExchangeConfig};
use crate::events::{Event, EventQueue, EventText, Route};
use crate::local::LocalMd;

/// State shared by the manager and every worker (stores, P2P). Workers read the local
/// snapshots and push events; they hold nothing of the agent's.
pub(crate) struct Shared {
    pub(crate) agent: String,
    pub(crate) local: LocalMd,
    pub(crate) events: EventQueue,
    pub(crate) stop: AtomicBool,
    /// Fetches written by the caller's thread (P2P and the stores' direct paths).
    pub(crate) direct_fetches: AtomicU64,
    pub(crate) config: ExchangeConfig,
    pub(crate) namespace: String,
}

impl Shared {
    pub(crate) fn new(agent: &str, config: ExchangeConfig, namespace: String) -> Shared {
        Shared {
            agent: agent.to_owned(),
            local: LocalMd::default(),
            events: EventQueue::new(config.event_capacity),
            stop: AtomicBool::new(false),
            direct_fetches: AtomicU64::new(0),
            config,
            namespace,
        }
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Queue an event for the agent without waiting. False when it was not queued:
    /// shutting down, or the queue is full (then it is reported to the agent as an
    /// [`Event::Overflow`], see `EventQueue`).
    pub(crate) fn emit(&self, event: Event) -> bool {
        log::debug!("exchange of '{}': {}", self.agent, EventText(&event));
        self.events.push(event, &self.stop)
    }

    /// Store key of `agent`'s metadata under `label`.
    pub(crate) fn key(&self, agent: &str, label: &str) -> String {
        store_key(&self.namespace, agent, label)
    }
}

/// Work for a store.
pub(crate) enum StoreCmd {
    /// Publish our metadata under `label` (also kept in [`Shared::local`]).
    Publish { label: String, blob: Arc<[u8]> },
    /// Fetch `agent`'s metadata under `label`, waiting up to the fetch timeout.
    Fetch { agent: String, label: String },
    /// A fetch whose first look (at `since`) found the key missing, handed from a
    /// store's direct path to its worker: wait for it, up to the fetch timeout counted
    /// from `since`. Stores without a direct path treat it as a `Fetch`.
    WaitFor {
        agent: String,
        label: String,
        since: Instant,
    },
    /// Delete everything we published (and tell watchers).
    Withdraw,
}

/// Why a command was not queued.
pub(crate) enum QueueError {
    /// The queue is at its capacity.
    Full,
    /// The worker behind it has stopped.
    Closed,
}

/// The sending end of a store's bounded command queue. A std channel implements it;
/// a store with another runtime (etcd: tokio) implements it in its folder.
pub(crate) trait CommandQueue: Send + Sync {
    /// Queue `cmd` without waiting.
    fn try_send(&self, cmd: StoreCmd) -> Result<(), QueueError>;
}

impl CommandQueue for SyncSender<StoreCmd> {
    fn try_send(&self, cmd: StoreCmd) -> Result<(), QueueError> {
        match SyncSender::try_send(self, cmd) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(QueueError::Full),
            Err(TrySendError::Disconnected(_)) => Err(QueueError::Closed),
        }
    }
}

/// A store's fast path for fetches, tried on the caller's thread before a fetch is
/// queued. It must never wait on the network (write into an idle connection or give
/// up), and a fetch it takes obeys the same contract as a queued one (one `Load` or
/// `FetchFailed`, handing over to the worker when needed).
pub(crate) trait DirectFetch: Send + Sync {
    /// Take the fetch of `agent`'s metadata under `label`; `false` when not taken (the
    /// manager then queues it).
    fn try_fetch(&self, agent: &str, label: &str) -> bool;
    /// Close the path and join its threads (the stop flag is raised).
    fn stop(&self);
}

/// A running store, as the manager keeps it: its queues, its direct path, its threads.
pub(crate) struct StoreWorker {
    pub(crate) route: Route,
    /// Where the store is, for logs and error messages.
    pub(crate) endpoint: String,
    /// Publish and withdraw (and fetch when `fetches` is `None`).
    pub(crate) ops: Box<dyn CommandQueue>,
    /// Fetches, when the store runs them on a thread of their own.
    pub(crate) fetches: Option<Box<dyn CommandQueue>>,
    /// A direct path for fetches, if the store has one.
    pub(crate) direct: Option<Arc<dyn DirectFetch>>,
    pub(crate) threads: Vec<JoinHandle<()>>,
}

impl StoreWorker {
    /// Queue `cmd` (fetches to the fetch queue when there is one, after the direct
    /// path declined), or a typed error: `Capacity` when the queue is full.
    pub(crate) fn submit(&self, cmd: StoreCmd, limit: usize) -> Result<(), Error> {
        if let (StoreCmd::Fetch { agent, label }, Some(direct)) = (&cmd, &self.direct) {
            if direct.try_fetch(agent, label) {
                return Ok(());
            }
        }
        let queue = match (&cmd, &self.fetches) {
            (StoreCmd::Fetch { .. }, Some(fetches)) => fetches,
            _ => &self.ops,
        };
        const WHAT: &str = "store command queue";
        match queue.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(QueueError::Full) => Err(Error::Capacity { what: WHAT, limit }),
            Err(QueueError::Closed) => Err(Error::backend(
                "exchange",
                format!(
                    "the {} worker behind the {WHAT} has stopped",
                    self.route.name()
                ),
            )),
        }
    }

    /// Stop: close the direct path, drop the queues (which ends the workers), join
    /// the threads. The caller has raised the stop flag.
    pub(crate) fn stop(self) {
        if let Some(direct) = &self.direct {
            direct.stop();
        }
        drop(self.ops);
        drop(self.fetches);
        for t in self.threads {
            let _unused = t.join();
        }
    }
}
