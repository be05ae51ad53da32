//! Metadata exchange wired into the agent: discovery of peers by address (P2P) or by
//! name (etcd, TCPStore) through an agent-owned [`ferry_exchange::Manager`].
//!
//! # How it fits the agent
//! The manager's workers never touch agent state. The agent hands the manager
//! snapshots of its serialized metadata (refreshed whenever its regions or backends
//! changed, checked on every exchange call), and results come back as events that the
//! agent applies on the caller's thread through its normal load path
//! ([`Agent::load_remote_md`], [`Agent::invalidate_remote_md`]) — in
//! [`Agent::check_remote_md`] and [`Agent::poll_exchange`]. So the agent's own locking
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
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use ferry_exchange::{Event, Manager};
use ferry_storage::{Desc, Error, MemKind, RegionId, Result, Subject, MAX_BACKENDS};

use crate::Agent;
use ferry_schedules::{Command, CommandBuffer, ExchangeCmd, MdRoute, Outcome};

pub use ferry_exchange::{
    check_agent_name, check_label, config, p2p, tcpstore, EtcdConfig, ExchangeConfig, P2pConfig,
    Route, StoreConfig, TcpStoreConfig, Via, FULL_LABEL,
};

/// Most exchange send failures kept for [`Agent::drain_exchange_failures`].
const SEND_FAILURES_MAX: usize = 64;

/// The agent's exchange state: the manager, once started, and what came back.
#[derive(Default)]
pub(crate) struct ExchangeSlot {
    manager: OnceLock<Manager>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// The (region count, deregistrations, backend count) the manager's snapshot was
    /// made at.
    snapshot_of: Option<(usize, u64, usize)>,
    /// Failed fetches (or loads of fetched metadata) by agent name, until checked.
    failures: HashMap<String, Error>,
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
        // Applied as they are popped: the queue holds no lock while `apply` runs, and
        // nothing is collected on the way (no allocation beyond the events' own).
        Ok(manager.poll(|event| self.apply(event)))
    }

    fn apply(&self, event: Event) {
        let slot = self.exchange_slot();
        match event {
            Event::Load { agent, blob, .. } => {
                match self.load_remote_md(&blob) {
                    Ok(peer) => {
                        let name_ok = self
                            .lock()
                            .is_ok_and(|s| s.world.peer_name(peer).is_ok_and(|n| n == agent));
                        if !name_ok {
                            slot.inner().failures.insert(
                            agent.clone(),
                            Error::Mismatch {
                                subject: Subject::PeerName(agent),
                                reason: "the metadata that came for this agent describes another agent".into(),
                            },
                        );
                        }
                    }
                    Err(error) => {
                        slot.inner().failures.insert(agent, error);
                    }
                }
            }
            Event::Invalidate { agent, .. } => {
                if let Some(peer) = self.peer(&agent) {
                    // Already gone is fine: the goal is that it is gone.
                    let _unused = self.invalidate_remote_md(peer);
                }
            }
            Event::FetchFailed { agent, error, .. } => {
                slot.inner().failures.insert(agent, error);
            }
            Event::SendFailed {
                target,
                what,
                error,
            } => {
                let mut inner = slot.inner();
                if inner.send_failures.len() == SEND_FAILURES_MAX {
                    inner.send_failures.pop_front();
                }
                inner.send_failures.push_back((target, what, error));
            }
        }
    }

    /// Poll for `agent`'s metadata: `Ok(true)` once it is loaded and, if `regions` is
    /// given, covers every one of those descriptors; `Ok(false)` while not yet; the
    /// fetch's error if it failed (reported once).
    pub fn check_remote_md(
        &self,
        agent: &str,
        regions: Option<(MemKind, &[Desc])>,
    ) -> Result<bool> {
        self.poll_exchange()?;
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
