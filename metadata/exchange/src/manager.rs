//! The agent-owned manager: routes each call — a peer address to P2P, a name to the
//! configured store (started by `stores::start`, driven through the store contract in
//! `contract.rs`) — and owns the workers and the event queue. It knows no store.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use ferry_storage::{Error, Subject};

use crate::config::ExchangeConfig;
use crate::contract::{Shared, StoreCmd, StoreWorker};
use crate::events::{Event, Route, FULL_LABEL};
use crate::local::{check_agent_name, check_label};
use crate::p2p::{self, ListenerStats};
use crate::stores;
use crate::tcpstore::ServerHandle;
use crate::util::lock;

/// Where a call goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// The P2P listener of a peer at this address.
    Peer(SocketAddr),
    /// The configured store (etcd or TCPStore), by agent name.
    Store,
}

/// `Some(x)` as `x`, `None` as `none`, for log lines.
struct Opt<T>(Option<T>);

impl<T: std::fmt::Display> std::fmt::Display for Opt<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(x) => x.fmt(f),
            None => f.write_str("none"),
        }
    }
}

/// Where a request goes, for log lines: `p2p 127.0.0.1:5000` or `the store (tcpstore
/// at …)`.
struct ViaText<'a>(Via, &'a Manager);

impl std::fmt::Display for ViaText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.0, self.1.store()) {
            (Via::Peer(addr), _) => write!(f, "p2p {addr}"),
            (Via::Store, Some((route, endpoint))) => {
                write!(f, "the store ({} at {endpoint})", route.name())
            }
            (Via::Store, None) => f.write_str("the store (none configured)"),
        }
    }
}

/// The agent's metadata-exchange manager. See the crate docs.
pub struct Manager {
    shared: Arc<Shared>,
    listener: Option<p2p::Listener>,
    p2p_client: Mutex<Option<p2p::Client>>,
    store: Option<StoreWorker>,
    embedded: Option<ServerHandle>,
}

impl Manager {
    /// A manager for agent `agent`: starts the P2P listener, the embedded TCPStore server
    /// and the store that `config` asks for. The P2P client starts on the
    /// first call that names a peer address.
    pub fn new(agent: &str, config: ExchangeConfig) -> Result<Manager, Error> {
        check_agent_name(agent)?;
        let mut config = config.validated()?;
        let namespace = config.normalized_namespace()?;
        let embedded = stores::start_embedded(&mut config)?;
        let shared = Arc::new(Shared::new(agent, config, namespace));
        let mut manager = Manager {
            shared: shared.clone(),
            listener: None,
            p2p_client: Mutex::new(None),
            store: None,
            embedded,
        };
        // From here on, an error drops `manager`, which stops what already started.
        manager.store = stores::start(&shared)?;
        if let Some(listen) = shared.config.p2p.listen {
            manager.listener = Some(p2p::Listener::start(shared.clone(), listen)?);
        }
        log::debug!(
            "exchange of '{agent}' started: p2p listener {}, store {}, embedded tcpstore \
             server {}, namespace '{}', event queue of {}",
            Opt(manager.p2p_listen_addr()),
            match manager.store() {
                Some((route, endpoint)) => format!("{} at {endpoint}", route.name()),
                None => "none".into(),
            },
            Opt(manager.embedded_store_addr()),
            shared.namespace,
            shared.config.event_capacity,
        );
        Ok(manager)
    }

    /// This agent's name.
    pub fn agent_name(&self) -> &str {
        &self.shared.agent
    }

    /// Whether any worker thread of this manager exists (listener, P2P client, store
    /// backend, embedded server). The one answer to that question: workers never touch
    /// agent state, they only read the snapshots given to the manager and queue events.
    pub fn workers_running(&self) -> bool {
        self.listener.is_some()
            || self.store.is_some()
            || self.embedded.is_some()
            || lock(&self.p2p_client).is_some()
    }

    /// Where the P2P listener listens, if it runs.
    pub fn p2p_listen_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref().map(p2p::Listener::local_addr)
    }

    /// Counters of the P2P listener's connection core (refused at the limits, evicted,
    /// timed out, open), if it runs.
    pub fn p2p_conn_stats(&self) -> Option<&crate::ConnStats> {
        self.listener.as_ref().map(p2p::Listener::conn_stats)
    }

    /// Counters of the P2P listener, if it runs.
    pub fn p2p_stats(&self) -> Option<&ListenerStats> {
        self.listener.as_ref().map(|l| &*l.stats)
    }

    /// How many fetches were written by the caller's own thread on an idle connection
    /// (P2P, TCPStore) rather than handed to a worker. For tests and monitoring.
    pub fn direct_fetches(&self) -> u64 {
        self.shared.direct_fetches.load(Ordering::Relaxed)
    }

    /// Events dropped because the event queue was full (each reported to the agent in
    /// an [`Event::Overflow`]).
    pub fn events_dropped(&self) -> u64 {
        self.shared.events.dropped()
    }

    /// The store in use (`etcd` or `tcpstore`) and its endpoint, if any.
    pub fn store(&self) -> Option<(Route, &str)> {
        self.store.as_ref().map(|s| (s.route, s.endpoint.as_str()))
    }

    /// Where the embedded TCPStore server listens, if it runs.
    pub fn embedded_store_addr(&self) -> Option<SocketAddr> {
        self.embedded.as_ref().map(ServerHandle::local_addr)
    }

    /// Replace the snapshot of this agent's full serialized metadata, used to publish and
    /// to answer peers that ask for it.
    pub fn set_local_md(&self, blob: Arc<[u8]>) {
        self.shared.local.set_full(blob);
    }

    /// Send the full metadata (set by [`Self::set_local_md`]) to a peer, or publish it
    /// in the store. Returns once the work is queued.
    pub fn send_local_md(&self, via: Via) -> Result<(), Error> {
        let blob = self
            .shared
            .local
            .get(FULL_LABEL)
            .ok_or_else(|| Error::NotAllowed {
                subject: Subject::PeerName(self.shared.agent.clone()),
                reason: "no local metadata to send: call set_local_md first".into(),
            })?;
        self.send(FULL_LABEL, blob, via)
    }

    /// Keep `blob` (partial metadata, serialized by the agent for some regions) as the
    /// snapshot under `label` and send it to a peer, or publish it under `label`.
    pub fn send_local_partial_md(
        &self,
        label: &str,
        blob: Arc<[u8]>,
        via: Via,
    ) -> Result<(), Error> {
        check_label(label)?;
        self.shared.local.set_partial(label, blob.clone());
        self.send(label, blob, via)
    }

    fn send(&self, label: &str, blob: Arc<[u8]>, via: Via) -> Result<(), Error> {
        if blob.is_empty() {
            return Err(Error::invalid(
                Subject::Named(format!("metadata '{label}'").into()),
                "is empty",
            ));
        }
        log::debug!(
            "exchange of '{}': sending metadata '{label}' ({} bytes) to {}",
            self.shared.agent,
            blob.len(),
            ViaText(via, self)
        );
        match via {
            Via::Peer(to) => self.p2p(|c| c.send(to, label, blob)),
            Via::Store => self.store_cmd(
                StoreCmd::Publish {
                    label: label.to_owned(),
                    blob,
                },
                "send_local_md",
            ),
        }
    }

    /// Ask for `agent`'s metadata (full when `label` is `None`). The answer arrives as an
    /// [`Event::Load`] (or [`Event::FetchFailed`]) from [`Self::poll`].
    pub fn fetch_remote_md(&self, agent: &str, via: Via, label: Option<&str>) -> Result<(), Error> {
        check_agent_name(agent)?;
        let label = match label {
            Some(l) => {
                check_label(l)?;
                l
            }
            None => FULL_LABEL,
        };
        log::debug!(
            "exchange of '{}': fetching metadata '{label}' of '{agent}' from {}",
            self.shared.agent,
            ViaText(via, self)
        );
        match via {
            Via::Peer(to) => self.p2p(|c| c.fetch(to, agent, label)),
            Via::Store => self.store_cmd(
                StoreCmd::Fetch {
                    agent: agent.to_owned(),
                    label: label.to_owned(),
                },
                "fetch_remote_md",
            ),
        }
    }

    /// Withdraw this agent's metadata: tell the peer at an address to drop it, or delete
    /// everything this agent published in the store (its watchers see the deletion).
    pub fn invalidate_local_md(&self, via: Via) -> Result<(), Error> {
        log::debug!(
            "exchange of '{}': withdrawing our metadata at {}",
            self.shared.agent,
            ViaText(via, self)
        );
        match via {
            Via::Peer(to) => self.p2p(|c| c.invalidate(to)),
            Via::Store => self.store_cmd(StoreCmd::Withdraw, "invalidate_local_md"),
        }
    }

    /// Hand every queued event to `each`, without blocking. Returns how many there were.
    pub fn poll(&self, mut each: impl FnMut(Event)) -> usize {
        self.shared.events.drain(&mut each)
    }

    /// Block until an event is queued or `timeout` passes; returns whether one is. For
    /// callers with nothing else to do (start-up, tools, benchmarks); a scheduler loop
    /// polls instead.
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        self.shared.events.wait(timeout)
    }

    /// Run `call` on the P2P client, starting it on first use.
    fn p2p(&self, call: impl FnOnce(&p2p::Client) -> Result<(), Error>) -> Result<(), Error> {
        let mut client = lock(&self.p2p_client);
        if client.is_none() {
            *client = Some(p2p::Client::start(self.shared.clone())?);
        }
        match client.as_ref() {
            Some(c) => call(c),
            None => Err(Error::backend("p2p", "the client did not start")),
        }
    }

    fn store_cmd(&self, cmd: StoreCmd, what: &'static str) -> Result<(), Error> {
        let Some(store) = &self.store else {
            return Err(Error::NotSupported {
                backend: "exchange".into(),
                what: format!(
                    "{what} by agent name: no metadata store is configured (set FERRY_ETCD_ENDPOINTS or \
                     FERRY_TCPSTORE_ENDPOINT, or FERRY_TCPSTORE_SERVE, or give a peer address)"
                )
                .into(),
            });
        };
        store.submit(cmd, self.shared.config.command_capacity)
    }
}

/// Longest a manager's drop waits for the P2P commands still queued (sends,
/// invalidations) to be written; `io_timeout` when that is shorter.
const DROP_DRAIN_MAX: std::time::Duration = std::time::Duration::from_secs(2);

impl Drop for Manager {
    fn drop(&mut self) {
        // What was queued last still goes out: an agent that invalidates its metadata at
        // a peer and is dropped right after must not lose the invalidation.
        if let Some(client) = lock(&self.p2p_client).as_ref() {
            let wait = self.shared.config.io_timeout.min(DROP_DRAIN_MAX);
            let left = client.drain(std::time::Instant::now() + wait);
            if left > 0 {
                log::warn!(
                    "exchange of '{}': {left} P2P command(s) not written within {wait:?} of \
                     the agent's drop; dropped",
                    self.shared.agent
                );
            }
        }
        self.shared.stop.store(true, Ordering::Release);
        if let Some(mut listener) = self.listener.take() {
            listener.stop();
        }
        drop(lock(&self.p2p_client).take());
        if let Some(store) = self.store.take() {
            store.stop();
        }
        if let Some(server) = self.embedded.take() {
            server.stop();
        }
    }
}
