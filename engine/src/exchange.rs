//! Metadata exchange wired into the agent: discovery of peers by address (P2P) or by
//! name (etcd, TCPStore) through an agent-owned [`ferry_exchange::Manager`].
//!
//! # How it fits the agent
//! The manager's workers never touch agent state. The agent hands the manager
//! snapshots of its serialized metadata (refreshed whenever its regions or backends
//! changed, checked on every exchange call), and results come back as events that the
//! agent applies on the caller's thread through its normal load path
//! ([`Agent::load_remote_md`], [`Agent::invalidate_remote_md`]) — in every
//! [`Agent::flush`] (its first step), [`Agent::check_remote_md`] and
//! [`Agent::poll_exchange`]. Metadata that came for agent X is loaded only if the blob
//! itself names X (else [`Error::Mismatch`] naming both, nothing loaded; the same check
//! as [`Agent::load_remote_md_as`]). An [`Event::Overflow`] (events dropped while the
//! queue was full) drops the peer if a withdrawal was lost and reports the capacity
//! error for it. See `metadata/exchange/README.md`. So the agent's own locking
//! does not depend on whether exchange workers run;
//! [`Agent::exchange_workers_running`] reports it.
//!
//! Every call returns without waiting on the network; `check_remote_md` is polled.
//!
//! ```no_run
//! use ferry::exchange::{ExchangeConfig, Via};
//! use ferry::{Agent, AgentConfig};
//!
//! let agent = Agent::new(AgentConfig::named("decode-0")).unwrap();
//! // FERRY_TCPSTORE_ENDPOINT=127.0.0.1:29500 (or etcd, see ferry_exchange::config)
//! agent.start_exchange(ExchangeConfig::default().with_env_overrides().unwrap()).unwrap();
//! agent.send_local_md(Via::Store).unwrap();
//! agent.fetch_remote_md("prefill-0", Via::Store, None).unwrap();
//! while !agent.check_remote_md("prefill-0", None).unwrap() {
//!     // do other work of the scheduler loop
//! }
//! ```

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use ferry_storage::{Desc, Error, MemKind, RegionId, Result, Subject, MAX_BACKENDS};

use crate::Agent;
use ferry_schedules::{Command, CommandBuffer, ExchangeCmd, ExchangeEvent, MdRoute, Outcome};

pub use ferry_exchange::{
    check_agent_name, check_label, config, p2p, tcpstore, EtcdConfig, Event, ExchangeConfig, Lost,
    Manager, P2pConfig, Route, StoreConfig, TcpStoreConfig, Via, FULL_LABEL,
};

/// Most exchange send failures kept for [`Agent::drain_exchange_failures`].
const SEND_FAILURES_MAX: usize = 64;
/// Most agents with an unchecked fetch (or load) failure kept for
/// [`Agent::check_remote_md`]; more are counted ([`Agent::exchange_failures_dropped`]).
pub const FAILURES_MAX: usize = 1024;

/// The agent's exchange state: the manager, once started, and what came back.
#[derive(Default)]
pub(crate) struct ExchangeSlot {
    manager: OnceLock<Manager>,
    inner: Mutex<Inner>,
    /// Set while some thread applies events. Applying an event flushes a command
    /// (load, invalidate), and every flush starts by applying events: without this
    /// guard the nested flush would apply the *next* events before the current one's
    /// command ran, out of order (a withdrawal before the load it follows).
    applying: AtomicBool,
}

#[derive(Default)]
struct Inner {
    /// The (region count, deregistrations, backend count) the manager's snapshot was
    /// made at.
    snapshot_of: Option<(usize, u64, usize)>,
    /// Failed fetches (or loads of fetched metadata) by agent name, until checked; at
    /// most `FAILURES_MAX` agents.
    failures: HashMap<String, Error>,
    /// Failures not kept because `failures` was full.
    failures_dropped: u64,
    /// Failed sends, publishes and invalidations: (target, what, error).
    send_failures: VecDeque<(String, String, Error)>,
}

impl ExchangeSlot {
    /// Whether `Agent::start_exchange` ran.
    pub(crate) fn is_started(&self) -> bool {
        self.manager.get().is_some()
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn not_started() -> Error {
    Error::NotAllowed {
        subject: Subject::Named("metadata exchange".into()),
        reason: "not started: call Agent::start_exchange first".into(),
    }
}

impl Agent {
    /// Start the metadata exchange: the P2P listener, the store backend and the embedded
    /// TCPStore server that `config` asks for (see [`ferry_exchange::config`] for the
    /// `FERRY_*` environment overrides: `config.with_env_overrides()`). Once per agent.
    pub fn start_exchange(&self, config: ExchangeConfig) -> Result<()> {
        let slot = self.exchange_slot();
        if slot.manager.get().is_some() {
            return Err(Error::NotAllowed {
                subject: Subject::PeerName(self.name().to_owned()),
                reason: "the metadata exchange is already started".into(),
            });
        }
        let manager = Manager::new(self.name(), config)?;
        if slot.manager.set(manager).is_err() {
            return Err(Error::NotAllowed {
                subject: Subject::PeerName(self.name().to_owned()),
                reason: "the metadata exchange was started concurrently".into(),
            });
        }
        self.refresh_snapshot()
    }

    fn manager(&self) -> Result<&Manager> {
        self.exchange_slot().manager.get().ok_or_else(not_started)
    }

    /// Where this agent's P2P listener listens, if it runs.
    pub fn exchange_listen_addr(&self) -> Option<std::net::SocketAddr> {
        self.exchange_slot().manager.get()?.p2p_listen_addr()
    }

    /// Where the embedded TCPStore server of this agent listens, if it runs.
    pub fn exchange_store_addr(&self) -> Option<std::net::SocketAddr> {
        self.exchange_slot().manager.get()?.embedded_store_addr()
    }

    /// Whether any exchange worker thread runs for this agent.
    pub fn exchange_workers_running(&self) -> bool {
        self.exchange_slot()
            .manager
            .get()
            .is_some_and(Manager::workers_running)
    }

    /// Give the manager a fresh snapshot of our full metadata if regions or backends
    /// changed since the last one.
    pub(crate) fn refresh_snapshot(&self) -> Result<()> {
        let manager = self.manager()?;
        let now = {
            let state = self.lock()?;
            (
                state.world.regions().len(),
                state.world.deregistrations(),
                state.world.backend_ids().count(),
            )
        };
        let slot = self.exchange_slot();
        if slot.inner().snapshot_of == Some(now) {
            return Ok(());
        }
        let blob = self.local_md()?;
        manager.set_local_md(Arc::from(blob));
        slot.inner().snapshot_of = Some(now);
        Ok(())
    }

    /// Send our full metadata to the P2P listener at `Via::Peer(addr)`, or publish it in
    /// the store (`Via::Store`, under `<namespace>/<name>/metadata`).
    pub fn send_local_md(&self, via: Via) -> Result<()> {
        self.refresh_snapshot()?;
        self.manager()?.send_local_md(via)
    }

    /// Send (or publish under `label`) partial metadata: only `regions`, with our
    /// connection info. Peers accumulate partial metadata.
    pub fn send_local_partial_md(&self, regions: &[RegionId], label: &str, via: Via) -> Result<()> {
        check_label(label)?;
        let manager = self.manager()?;
        self.refresh_snapshot()?;
        let blob = self.local_partial_md(regions, true)?;
        manager.send_local_partial_md(label, Arc::from(blob), via)
    }

    /// Ask for `agent`'s metadata (full, or partial under `label`) from the listener at
    /// `Via::Peer(addr)` or from the store. Poll [`Agent::check_remote_md`] for the
    /// result.
    pub fn fetch_remote_md(&self, agent: &str, via: Via, label: Option<&str>) -> Result<()> {
        let manager = self.manager()?;
        self.refresh_snapshot()?;
        self.exchange_slot().inner().failures.remove(agent);
        self.metrics.exchange(ExchangeEvent::Fetch);
        manager.fetch_remote_md(agent, via, label)
    }

    /// Withdraw our metadata: tell the listener at `Via::Peer(addr)` to drop it, or
    /// delete what we published in the store (watchers of it drop us).
    pub fn invalidate_local_md(&self, via: Via) -> Result<()> {
        self.manager()?.invalidate_local_md(via)
    }

    /// Apply what the exchange brought back (metadata to load, peers to drop, failures)
    /// without blocking. Returns how many events were applied.
    pub fn poll_exchange(&self) -> Result<usize> {
        let manager = self.manager()?;
        self.refresh_snapshot()?;
        Ok(self.apply_events_of(manager))
    }

    /// Apply pending exchange events (the first step of every flush, so an
    /// application that only flushes still sees lease expiries, deletions and pushed
    /// metadata). Nothing when the exchange is not started; no allocation when no
    /// event is pending.
    pub(crate) fn apply_exchange_events(&self) {
        if let Some(manager) = self.exchange_slot().manager.get() {
            self.apply_events_of(manager);
        }
    }

    /// Apply `manager`'s events in queue order, unless this agent is applying already
    /// (a flush nested in `apply`, or another thread, which then applies them). Applied
    /// as they are popped: the queue holds no lock while `apply` runs, and nothing is
    /// collected on the way (no allocation beyond the events' own).
    fn apply_events_of(&self, manager: &Manager) -> usize {
        let applying = &self.exchange_slot().applying;
        if applying
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return 0;
        }
        // Cleared on unwind too, so a panicking load cannot stop event delivery.
        struct Clear<'a>(&'a AtomicBool);
        impl Drop for Clear<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _clear = Clear(applying);
        manager.poll(|event| self.apply(event))
    }

    /// Load `blob`, received on a side channel as the metadata of `agent`: the agent
    /// name inside it is checked *before* anything is loaded, so metadata naming
    /// another agent can never replace that agent's (a [`Error::Mismatch`] naming
    /// both). [`Agent::load_remote_md`] loads whatever agent a blob names.
    pub fn load_remote_md_as(&self, agent: &str, blob: &[u8]) -> Result<ferry_storage::PeerId> {
        self.load_checked(agent, blob, "given")
    }

    fn load_checked(
        &self,
        agent: &str,
        blob: &[u8],
        origin: &str,
    ) -> Result<ferry_storage::PeerId> {
        // Parsed once here to read the name (the loader validates again; metadata
        // loads are rare next to transfers).
        let md = ferry_metadata::PeerMd::from_bytes(blob)?;
        if md.agent() != agent {
            return Err(Error::Mismatch {
                subject: Subject::PeerName(agent.to_owned()),
                reason: format!(
                    "metadata {origin} for agent '{agent}' describes agent '{}'; not loaded",
                    md.agent().escape_debug()
                )
                .into(),
            });
        }
        self.load_remote_md(blob)
    }

    /// Keep `error` as the failure of `agent` until checked; the map holds at most
    /// [`FAILURES_MAX`] agents (peers choose the names of the loads they push).
    fn record_failure(&self, agent: String, error: Error) {
        let mut inner = self.exchange_slot().inner();
        if inner.failures.len() >= FAILURES_MAX && !inner.failures.contains_key(&agent) {
            inner.failures_dropped = inner.failures_dropped.saturating_add(1);
            return;
        }
        inner.failures.insert(agent, error);
    }

    fn record_send_failure(&self, target: String, what: String, error: Error) {
        let mut inner = self.exchange_slot().inner();
        if inner.send_failures.len() == SEND_FAILURES_MAX {
            inner.send_failures.pop_front();
        }
        inner.send_failures.push_back((target, what, error));
    }

    fn apply(&self, event: Event) {
        match event {
            Event::Load {
                agent, blob, route, ..
            } => {
                let origin = match route {
                    Route::P2p => "pushed or sent over p2p",
                    Route::Etcd => "fetched from etcd",
                    Route::TcpStore => "fetched from tcpstore",
                    Route::InProcess => "fetched from the in-process store",
                };
                match self.load_checked(&agent, &blob, origin) {
                    Ok(_) => self.metrics.exchange(ExchangeEvent::Loaded),
                    Err(error) => {
                        log::debug!(
                            "agent '{}': metadata {origin} for '{agent}' not loaded: {error}",
                            self.name()
                        );
                        self.metrics.exchange(ExchangeEvent::LoadFailed);
                        self.record_failure(agent, error);
                    }
                }
            }
            Event::Invalidate { agent, .. } => {
                self.metrics.exchange(ExchangeEvent::Invalidated);
                self.drop_peer(&agent);
            }
            Event::FetchFailed { agent, error, .. } => {
                self.metrics.exchange(ExchangeEvent::FetchFailed);
                self.record_failure(agent, error);
            }
            Event::Overflow {
                agent: Some(agent),
                lost,
                error,
            } => {
                // What came after the last applied event is unknown: if a withdrawal
                // was among it, the peer is dropped; the failure tells the caller to
                // fetch again.
                log::debug!(
                    "agent '{}': {} exchange event(s) about '{agent}' were lost to a full \
                     queue{}",
                    self.name(),
                    lost.events,
                    if lost.invalidation {
                        "; one was a withdrawal, so the peer is dropped"
                    } else {
                        ""
                    }
                );
                if lost.invalidation {
                    self.drop_peer(&agent);
                }
                self.record_failure(agent, error);
            }
            Event::Overflow {
                agent: None,
                lost,
                error,
            } => self.record_send_failure(
                "exchange".into(),
                format!("{} event(s) about unnamed agents or sends", lost.events),
                error,
            ),
            Event::SendFailed {
                target,
                what,
                error,
            } => {
                self.metrics.exchange(ExchangeEvent::SendFailed);
                self.record_send_failure(target, what, error);
            }
        }
    }

    fn drop_peer(&self, agent: &str) {
        if let Some(peer) = self.peer(agent) {
            // Already gone is fine: the goal is that it is gone.
            let _unused = self.invalidate_remote_md(peer);
        }
    }

    /// Failures of fetches (or of loads of pushed metadata) that were not kept because
    /// [`FAILURES_MAX`] agents already had unchecked ones.
    pub fn exchange_failures_dropped(&self) -> u64 {
        self.exchange_slot().inner().failures_dropped
    }

    /// Poll for `agent`'s metadata: `Ok(true)` once it is loaded and, if `regions` is
    /// given, covers every one of those descriptors; `Ok(false)` while not yet; the
    /// fetch's error if it failed (reported once).
    pub fn check_remote_md(
        &self,
        agent: &str,
        regions: Option<(MemKind, &[Desc])>,
    ) -> Result<bool> {
        // Without an exchange (metadata loaded from a side channel) there is nothing to
        // poll; the answer is whether the peer is loaded.
        if self.exchange_slot().manager.get().is_some() {
            self.poll_exchange()?;
        }
        if let Some(error) = self.exchange_slot().inner().failures.remove(agent) {
            return Err(error);
        }
        let Some(peer) = self.peer(agent) else {
            return Ok(false);
        };
        let state = self.lock()?;
        // A peer whose load is under way has no view yet.
        let Some(view) = state.world.peer_view(peer)?.0 else {
            return Ok(false);
        };
        let Some((kind, descs)) = regions else {
            return Ok(true);
        };
        let covered = descs
            .iter()
            .all(|&d| (0..MAX_BACKENDS as u8).any(|b| view.find(b, kind, d).is_some()));
        Ok(covered)
    }

    /// Run the metadata-exchange commands of `cmds` (the agent's pre-phase; see
    /// `ferry_schedules::executor`). Commands of other kinds are left alone.
    pub(crate) fn run_exchange_commands(&self, cmds: &mut CommandBuffer) {
        #[cfg(feature = "tracy")]
        let _span = tracy_client::span!("ferry::exchange");
        self.apply_exchange_events();
        for i in 0..cmds.len() {
            let Command::Exchange(op) = cmds.commands()[i] else {
                continue;
            };
            let via = |route: MdRoute| match route {
                MdRoute::Store => Via::Store,
                MdRoute::Peer(addr) => Via::Peer(addr),
            };
            let result = match op {
                ExchangeCmd::SendLocal { route } => {
                    self.send_local_md(via(route)).map(|()| Outcome::Done)
                }
                ExchangeCmd::SendPartial {
                    regions,
                    label,
                    route,
                } => {
                    let regions = cmds.exchange_regions(regions).to_vec();
                    let label = cmds.exchange_text(label).to_owned();
                    self.send_local_partial_md(&regions, &label, via(route))
                        .map(|()| Outcome::Done)
                }
                ExchangeCmd::Fetch {
                    agent,
                    label,
                    route,
                } => {
                    let label = label.map(|l| cmds.exchange_text(l).to_owned());
                    self.fetch_remote_md(cmds.exchange_text(agent), via(route), label.as_deref())
                        .map(|()| Outcome::Done)
                }
                ExchangeCmd::InvalidateLocal { route } => {
                    self.invalidate_local_md(via(route)).map(|()| Outcome::Done)
                }
                ExchangeCmd::Check { agent } => self
                    .check_remote_md(cmds.exchange_text(agent), None)
                    .map(Outcome::MdReady),
            };
            cmds.set_outcome(i as u32, result.unwrap_or_else(Outcome::Failed));
        }
    }

    /// Failed sends, publishes and invalidations since the last call (at most the 64
    /// most recent): (target, what, error).
    pub fn drain_exchange_failures(&self) -> Vec<(String, String, Error)> {
        self.exchange_slot()
            .inner()
            .send_failures
            .drain(..)
            .collect()
    }
}
