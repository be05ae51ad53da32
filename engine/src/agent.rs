//! The agent: one participant with a unique name, owning backends, registered memory,
//! peers and requests. All methods take `&self`; an agent is `Send + Sync` and command
//! buffers may be recorded on any thread and flushed from there.
//!
//! # One path
//!
//! Every direct method that changes or drives the agent (`register`, `post`,
//! `progress`, `drain_notifications`, `load_remote_md`, `invalidate_remote_md`,
//! `make_connection`, …) records one command into a reused scratch buffer and runs it
//! through [`Agent::flush`]'s steps, so a direct call and the same command in a buffer
//! behave the same (phases, exchange pre-step, snapshot refresh); the scratch buffer
//! stays in the agent's state, and one lock of it covers recording, the executor and
//! reading the outcome.
//!
//! # Panic policy
//!
//! A panic inside a flush (a backend bug, say) may stop the executor between two table
//! updates. The agent does not guess what is left: the world's lock is poisoned by the
//! unwinding, and from then on the agent refuses work — every command of a flush fails
//! with [`Error::Poisoned`], direct methods return it, and the methods that cannot
//! fail (`progress`, `drain_notifications`, `counts`, …) report nothing. Drop the agent
//! and make a new one. [`Agent::is_poisoned`] tells.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, OnceLock};

use ferry_backend_api::{
    effective_params, BackendInit, Capabilities, FileMode, Params, QueryResult,
};
use ferry_schedules::{
    flush, Bounds, CommandBuffer, DeregStatus, FlushSummary, Phase, Side, Telemetry, World,
    XferStatus,
};
use ferry_storage::{
    BackendId, Desc, Error, MemKind, Op, PeerId, PrepId, RegionId, Result, StridedDesc, Subject,
    XferId,
};

use crate::md::MdState;
use crate::registry;

/// How to build an agent.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Name (what peers know it by; unique within the process unless `name_policy`
    /// says otherwise).
    pub name: String,
    /// Capacities and bounds of every table and queue.
    pub bounds: Bounds,
    /// Whether another live agent of this process may have the same name.
    pub name_policy: NamePolicy,
}

/// Whether an agent's name must be unique among the live agents of its process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NamePolicy {
    /// Refuse a name another live agent of this process has (the default).
    #[default]
    Unique,
    /// Allow it, as NIXL does (its Python tests and examples make two agents with one
    /// name). Peers still tell agents apart by name only, so two such agents must not
    /// both be loaded by one peer.
    Shared,
}

impl AgentConfig {
    /// Defaults for an agent called `name`.
    pub fn named(name: impl Into<String>) -> AgentConfig {
        AgentConfig {
            name: name.into(),
            bounds: Bounds::default(),
            name_policy: NamePolicy::Unique,
        }
    }

    /// Replace the name policy.
    pub fn with_name_policy(mut self, policy: NamePolicy) -> AgentConfig {
        self.name_policy = policy;
        self
    }

    /// Replace the bounds.
    pub fn with_bounds(mut self, bounds: Bounds) -> AgentConfig {
        self.bounds = bounds;
        self
    }
}

/// A backend instance on an agent.
#[derive(Clone, Debug)]
pub struct BackendInfo {
    /// Its handle.
    pub id: BackendId,
    /// Type name.
    pub name: &'static str,
    /// What it can do.
    pub capabilities: Capabilities,
    /// Effective parameter values.
    pub params: Params,
}

pub(crate) struct AgentState {
    pub(crate) world: World,
    pub(crate) md: MdState,
    /// Reused by the one-command convenience methods.
    scratch: CommandBuffer,
}

/// One participant in data movement.
pub struct Agent {
    name: String,
    state: Mutex<AgentState>,
    /// Metadata exchange (hook for `crate::exchange`; empty until `start_exchange`).
    exchange: crate::exchange::ExchangeSlot,
    /// The world's metrics, kept here too so they are readable without the lock.
    pub(crate) metrics: std::sync::Arc<ferry_schedules::Metrics>,
}

/// Live agents of this process, by name.
fn names_in_use() -> &'static Mutex<HashMap<String, usize>> {
    static NAMES: OnceLock<Mutex<HashMap<String, usize>>> = OnceLock::new();
    NAMES.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Backends go first (they may hold peers' inboxes), then the name is free again.
        if let Ok(mut state) = self.state.lock() {
            state.md.peers.clear();
        }
        let mut names = names_in_use().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(live) = names.get_mut(&self.name) {
            *live -= 1;
            if *live == 0 {
                names.remove(&self.name);
            }
        }
    }
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// Make an agent. Fails if another live agent of this process has the same name,
    /// unless `config.name_policy` is [`NamePolicy::Shared`].
    pub fn new(config: AgentConfig) -> Result<Agent> {
        if config.name.is_empty() {
            return Err(Error::invalid(
                Subject::Named("agent name".into()),
                "must not be empty",
            ));
        }
        {
            let mut names = names_in_use().lock().unwrap_or_else(|e| e.into_inner());
            let live = names.entry(config.name.clone()).or_insert(0);
            if *live > 0 && config.name_policy == NamePolicy::Unique {
                return Err(Error::NotAllowed {
                    subject: Subject::PeerName(config.name),
                    reason: "an agent with this name already exists in this process".into(),
                });
            }
            *live += 1;
        }
        #[cfg(feature = "tracy")]
        let _ = tracy_client::Client::start();
        let world = match World::new(&config.name, config.bounds) {
            Ok(world) => world,
            Err(e) => {
                let mut names = names_in_use().lock().unwrap_or_else(|e| e.into_inner());
                if let Some(live) = names.get_mut(&config.name) {
                    *live -= 1;
                    if *live == 0 {
                        names.remove(&config.name);
                    }
                }
                return Err(e);
            }
        };
        let metrics = world.metrics().clone();
        #[cfg(feature = "prometheus")]
        crate::prometheus::agent_created(&config.name, &metrics);
        log::debug!(
            "agent '{}' created (bounds: {} regions, {} prepared lists, {} requests, {} peers; \
             telemetry {})",
            config.name,
            world.bounds.regions_max,
            world.bounds.preps_max,
            world.bounds.xfers_max,
            world.bounds.peers_max,
            if world.bounds.telemetry { "on" } else { "off" },
        );
        Ok(Agent {
            state: Mutex::new(AgentState {
                world,
                md: MdState::new(),
                scratch: CommandBuffer::with_capacity(4),
            }),
            name: config.name,
            exchange: crate::exchange::ExchangeSlot::default(),
            metrics,
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The metadata-exchange state (see `crate::exchange`).
    pub(crate) fn exchange_slot(&self) -> &crate::exchange::ExchangeSlot {
        &self.exchange
    }

    /// The agent's state, or [`Error::Poisoned`] once a panic interrupted a flush (see
    /// the module docs: the tables may be half-updated, so nobody touches them again).
    #[inline]
    pub(crate) fn lock(&self) -> Result<MutexGuard<'_, AgentState>> {
        self.state.lock().map_err(|_| Error::Poisoned {
            agent: self.name.clone(),
        })
    }

    /// Whether a panic inside an earlier flush poisoned this agent (it refuses all work).
    pub fn is_poisoned(&self) -> bool {
        self.state.is_poisoned()
    }

    /// Backend types compiled into this build, with parameters and availability.
    pub fn available_backends() -> Vec<registry::FactoryInfo> {
        registry::describe()
    }

    /// Create a backend of type `name` with `params` (unknown keys are refused; missing
    /// ones take their defaults).
    pub fn create_backend(&self, name: &str, params: &Params) -> Result<BackendId> {
        let factory = registry::factory(name)
            .ok_or_else(|| Error::not_found(Subject::BackendName(name.to_string())))?;
        let params = effective_params(factory.name(), factory.params(), params)?;
        if let Err(reason) = factory.available_with(&params) {
            return Err(Error::NotSupported {
                backend: factory.name().into(),
                what: format!("not available on this machine: {reason}").into(),
            });
        }
        self.add_backend(factory, &params)
    }

    /// Create and add a backend from `factory` with effective `params` whose
    /// availability was checked.
    fn add_backend(
        &self,
        factory: &'static dyn ferry_backend_api::BackendFactory,
        params: &Params,
    ) -> Result<BackendId> {
        let backend = factory
            .create(&BackendInit {
                agent_name: &self.name,
                params,
            })
            .inspect_err(|e| {
                log::debug!(
                    "agent '{}': creating backend {} failed: {e}",
                    self.name,
                    factory.name()
                )
            })?;
        let mut state = self.lock()?;
        if state
            .world
            .backend_ids()
            .any(|id| state.world.backend(id).map(|b| b.name()) == Ok(factory.name()))
        {
            return Err(Error::NotAllowed {
                subject: Subject::BackendName(factory.name().to_string()),
                reason: "this agent already has a backend of this type".into(),
            });
        }
        if log::log_enabled!(log::Level::Debug) {
            let caps = backend.capabilities();
            log::debug!(
                "agent '{}': backend {} created{}; memory {}{}; parameters {}",
                self.name,
                factory.name(),
                backend
                    .describe()
                    .map(|d| format!(": {d}"))
                    .unwrap_or_default(),
                caps.mem_kinds
                    .iter()
                    .map(|k| k.name())
                    .collect::<Vec<_>>()
                    .join(", "),
                if caps.remote {
                    ", reaches peers"
                } else {
                    ", local only"
                },
                params
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
        state.world.add_backend(backend)
    }

    /// Create the backends of [`DEFAULT_BACKENDS`](crate::DEFAULT_BACKENDS) that are
    /// available here and that this agent does not have yet, in that order, each with
    /// `params_of(type name)` (an empty map: its defaults). What an agent gets when its
    /// caller names no backend: the `ferry` tool's `--backend default` and Python's
    /// `nixl_agent(name)` without backends call this. Returns the names created. A type
    /// unavailable here is skipped (logged with the reason); a failure to create an
    /// available one is returned.
    pub fn create_default_backends(
        &self,
        params_of: impl Fn(&str) -> Params,
    ) -> Result<Vec<&'static str>> {
        let have: Vec<&'static str> = self.backends().iter().map(|b| b.name).collect();
        let mut created = Vec::with_capacity(registry::DEFAULT_BACKENDS.len());
        for &name in registry::DEFAULT_BACKENDS {
            let Some(factory) = registry::factory(name) else {
                continue;
            };
            if have.contains(&factory.name()) {
                continue;
            }
            let mut params = params_of(factory.name());
            for &(ty, key, value) in registry::DEFAULT_SET_PARAMS {
                if ty == factory.name() && !params.contains_key(key) {
                    params.insert(key.to_string(), value.to_string());
                }
            }
            let effective = effective_params(factory.name(), factory.params(), &params)?;
            if let Err(reason) = factory.available_with(&effective) {
                log::info!(
                    "agent '{}': default backend {} left out: {reason}",
                    self.name,
                    factory.name()
                );
                continue;
            }
            self.add_backend(factory, &effective)?;
            created.push(factory.name());
        }
        log::debug!(
            "agent '{}': default backends created: {}",
            self.name,
            created.join(", ")
        );
        Ok(created)
    }

    /// Backends created on this agent.
    pub fn backends(&self) -> Vec<BackendInfo> {
        let Ok(state) = self.lock() else {
            return Vec::new();
        };
        state
            .world
            .backend_ids()
            .filter_map(|id| {
                let b = state.world.backend(id).ok()?;
                Some(BackendInfo {
                    id,
                    name: b.name(),
                    capabilities: b.capabilities(),
                    params: b.params().clone(),
                })
            })
            .collect()
    }

    /// Run every recorded command of `cmds`: the phases of [`Phase::ORDER`] — the
    /// exchange pre-step, the executor's phases under the agent's lock, the publish
    /// post-step. Outcomes, statuses and drained notifications are read from `cmds`
    /// afterwards. A buffer already flushed (not cleared since) is refused; a poisoned
    /// agent refuses every command with [`Error::Poisoned`].
    pub fn flush(&self, cmds: &mut CommandBuffer) -> FlushSummary {
        // Decided once: a poisoned agent or an already flushed buffer runs no agent step.
        let steps = !cmds.is_flushed() && !self.is_poisoned();
        for &phase in &Phase::ORDER[..Phase::EXECUTOR.start] {
            self.agent_step(phase, steps, cmds);
        }
        let summary = self.run_executor(cmds);
        for &phase in &Phase::ORDER[Phase::EXECUTOR.end..] {
            self.agent_step(phase, steps, cmds);
        }
        #[cfg(feature = "tracy")]
        crate::metrics::trace_flush(&self.metrics);
        summary
    }

    /// One of the agent's own phases (see [`Phase::is_agent_step`]).
    fn agent_step(&self, phase: Phase, run: bool, cmds: &mut CommandBuffer) {
        match phase {
            Phase::Exchange if run => self.run_exchange_commands(cmds),
            Phase::Publish => self.publish_step(run),
            _ => {}
        }
    }

    /// The publish step: keep what P2P peers get from "send me yours" current.
    fn publish_step(&self, run: bool) {
        if run && self.exchange_slot().is_started() {
            let _ = self.refresh_snapshot();
        }
    }

    /// The executor's phases, under the world lock (or every command refused with
    /// [`Error::Poisoned`]).
    fn run_executor(&self, cmds: &mut CommandBuffer) -> FlushSummary {
        match self.lock() {
            Ok(mut state) => {
                let AgentState { world, md, .. } = &mut *state;
                execute(world, md, cmds)
            }
            Err(poisoned) => {
                cmds.fail_all(poisoned);
                FlushSummary {
                    failed: cmds.len() as u32,
                    ..FlushSummary::default()
                }
            }
        }
    }

    /// Record into the reused scratch buffer and flush it, holding the agent's lock once
    /// for both and for reading the outcome: [`Agent::flush`]'s steps for a buffer
    /// without exchange commands (the exchange step applies the exchange events, before
    /// the lock; the snapshot refresh runs after it), without moving the buffer out of
    /// the state and back. [`Error::Poisoned`] once the agent is.
    fn scratch_flush<T>(
        &self,
        record: impl FnOnce(&mut CommandBuffer) -> u32,
        read: impl FnOnce(&CommandBuffer, u32, &FlushSummary) -> T,
    ) -> Result<T> {
        let steps = !self.is_poisoned();
        if steps {
            self.apply_exchange_events();
        }
        let out = {
            let mut state = self.lock()?;
            let AgentState {
                world, md, scratch, ..
            } = &mut *state;
            scratch.clear();
            let index = record(scratch);
            debug_assert!(
                scratch
                    .commands()
                    .iter()
                    .all(|c| !Phase::of(c).is_agent_step()),
                "exchange commands go through Agent::flush"
            );
            let summary = execute(world, md, scratch);
            read(scratch, index, &summary)
        };
        self.publish_step(steps);
        #[cfg(feature = "tracy")]
        crate::metrics::trace_flush(&self.metrics);
        Ok(out)
    }

    /// Flush one command with the reused scratch buffer and give its outcome.
    fn one<T>(
        &self,
        record: impl FnOnce(&mut CommandBuffer) -> u32,
        read: impl FnOnce(&CommandBuffer, u32) -> Result<T>,
    ) -> Result<T> {
        self.scratch_flush(record, |c, i, _| read(c, i))?
    }

    /// Register one region with every backend that supports `kind`.
    ///
    /// # Safety
    ///
    /// As for [`CommandBuffer::register`]: for DRAM/VRAM, `desc` must name memory that
    /// stays allocated until deregistration and that no Rust reference accesses while a
    /// transfer using it is in flight.
    // Reason: declares the caller's promise only; no unsafe operation here.
    #[allow(unsafe_code)]
    pub unsafe fn register(&self, kind: MemKind, desc: Desc) -> Result<RegionId> {
        // SAFETY: the caller made the promise `CommandBuffer::register` asks for.
        self.one(
            |c| unsafe { c.register(kind, desc) }.index(),
            |c, i| c.created(ferry_schedules::Ticket::<RegionId>::at(i)),
        )
    }

    /// Allocate `len` bytes of `kind` memory through `backend` (the memory that backend
    /// moves best; for UCX a shared-memory segment that same-host peers' puts and gets
    /// reach with one copy) and register it with every backend that supports `kind`, as
    /// [`Agent::register`] would. Returns the region and where the memory is: `len`
    /// bytes at `desc.addr`, valid until the region is deregistered (that frees
    /// it; so does dropping the agent). Reading or writing it from Rust is up to the
    /// caller (a raw pointer: not while a transfer that writes it is in flight).
    ///
    /// Errors: `NotSupported` when the backend does not allocate memory (or not of this
    /// kind), `InvalidParam` for a zero or oversized `len`, `Backend` when the
    /// transport's allocation fails, `Capacity` when the region table is full.
    pub fn alloc(&self, backend: BackendId, kind: MemKind, len: u64) -> Result<(RegionId, Desc)> {
        self.lock()?.world.alloc_region(backend, kind, len)
    }

    /// Register a FILE region by path (opened with `mode` by the backend, closed at
    /// deregistration). See [`CommandBuffer::register_file`].
    pub fn register_file(&self, path: &Path, mode: FileMode, desc: Desc) -> Result<RegionId> {
        self.one(
            |c| c.register_file(path, mode, desc).index(),
            |c, i| c.created(ferry_schedules::Ticket::<RegionId>::at(i)),
        )
    }

    /// Register an OBJECT region by name (a key in the backend's bucket, or
    /// `s3://bucket/key`). See [`CommandBuffer::register_object`].
    pub fn register_object(&self, name: &str, desc: Desc) -> Result<RegionId> {
        self.one(
            |c| c.register_object(name, desc).index(),
            |c, i| c.created(ferry_schedules::Ticket::<RegionId>::at(i)),
        )
    }

    /// Deregister a region. Refused while a request using it is in flight.
    ///
    /// Where a backend's peers may still reach the region (SHM peers copying into it),
    /// the first call withdraws it — out of the tables and the published metadata, so
    /// nothing new can name it — and answers [`DeregStatus::Pending`]: keep the memory
    /// and call again with the same handle (it never blocks); [`DeregStatus::Done`]
    /// once no backend touches the memory again. With no peer holding it, the first
    /// call is `Done`.
    pub fn deregister(&self, region: RegionId) -> Result<DeregStatus> {
        self.one(
            |c| c.deregister(region).index(),
            |c, i| match &c.outcomes()[i as usize] {
                ferry_schedules::Outcome::Failed(e) => Err(e.clone()),
                ferry_schedules::Outcome::Withdrawing => Ok(DeregStatus::Pending),
                _ => Ok(DeregStatus::Done),
            },
        )
    }

    /// Prepare a descriptor list once (local, or a peer's).
    pub fn prep(&self, side: impl Into<Side>, kind: MemKind, descs: &[Desc]) -> Result<PrepId> {
        let side = side.into();
        self.one(
            |c| c.prep(side, kind, descs).index(),
            |c, i| c.created(ferry_schedules::Ticket::<PrepId>::at(i)),
        )
    }

    /// Prepare the list made of `runs`' descriptors, run after run (a strided list: each
    /// run is `count` descriptors `stride` bytes apart), without the caller building it.
    /// The result is the prepared list [`Agent::prep`] gives for the same descriptors:
    /// `make` indexes it the same way.
    pub fn prep_strided(
        &self,
        side: impl Into<Side>,
        kind: MemKind,
        runs: &[StridedDesc],
    ) -> Result<PrepId> {
        let side = side.into();
        self.one(
            |c| c.prep_strided(side, kind, runs).index(),
            |c, i| c.created(ferry_schedules::Ticket::<PrepId>::at(i)),
        )
    }

    /// Build a request from prepared lists and index lists (empty = all, in order).
    pub fn make(
        &self,
        op: Op,
        local: PrepId,
        local_idx: &[u32],
        remote: PrepId,
        remote_idx: &[u32],
        notif: Option<&[u8]>,
    ) -> Result<XferId> {
        self.one(
            |c| {
                let b = c.make(op, local, local_idx, remote, remote_idx);
                let b = match notif {
                    Some(n) => b.notify(n),
                    None => b,
                };
                b.ticket().index()
            },
            |c, i| c.created(ferry_schedules::Ticket::<XferId>::at(i)),
        )
    }

    /// Build a request in one shot from raw descriptor lists.
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        &self,
        op: Op,
        local_kind: MemKind,
        local: &[Desc],
        remote_side: impl Into<Side>,
        remote_kind: MemKind,
        remote: &[Desc],
        notif: Option<&[u8]>,
    ) -> Result<XferId> {
        let side = remote_side.into();
        self.one(
            |c| {
                let b = c.create(op, local_kind, local, side, remote_kind, remote);
                let b = match notif {
                    Some(n) => b.notify(n),
                    None => b,
                };
                b.ticket().index()
            },
            |c, i| c.created(ferry_schedules::Ticket::<XferId>::at(i)),
        )
    }

    /// Post (or repost) a request; gives its status after one progress pass.
    pub fn post(&self, xfer: XferId) -> Result<XferStatus> {
        self.one(
            |c| c.post(xfer).index(),
            |c, i| c.status(ferry_schedules::Ticket::<XferStatus>::at(i)),
        )
    }

    /// Drive backends once and give the request's status.
    pub fn check(&self, xfer: XferId) -> Result<XferStatus> {
        self.one(
            |c| c.check(xfer).index(),
            |c, i| c.status(ferry_schedules::Ticket::<XferStatus>::at(i)),
        )
    }

    /// Release a request (an in-flight one only if its backend can cancel it).
    pub fn release(&self, xfer: XferId) -> Result<()> {
        self.one(|c| c.release(xfer).index(), done)
    }

    /// Release a prepared list.
    pub fn release_prep(&self, prep: PrepId) -> Result<()> {
        self.one(|c| c.release_prep(prep).index(), done)
    }

    /// Send a standalone notification (`Side::Local` = to oneself).
    pub fn notify(&self, to: impl Into<Side>, payload: &[u8]) -> Result<()> {
        let to = to.into();
        self.one(|c| c.notify(to, payload).index(), done)
    }

    /// Drive every backend once, then take every inbound notification: (sender agent,
    /// payload) — as NIXL's `getNotifs`, so a caller without a progress thread sees
    /// what arrived. Allocates; batch users drain into their command buffer instead.
    pub fn drain_notifications(&self) -> Vec<(String, Vec<u8>)> {
        self.scratch_flush(
            |c| c.drain_notifications().index(),
            |c, _, _| {
                c.notifications()
                    .map(|(from, payload)| (from.to_string(), payload.to_vec()))
                    .collect()
            },
        )
        .unwrap_or_default()
    }

    /// Drive every backend once; returns how many requests completed (an empty flush:
    /// its progress phase).
    pub fn progress(&self) -> u32 {
        self.scratch_flush(|_| 0, |_, _, summary| summary.completed)
            .unwrap_or(0)
    }

    /// Telemetry of a request: start, post and transfer durations, bytes, descriptor
    /// count after merging.
    pub fn telemetry(&self, xfer: XferId) -> Result<Telemetry> {
        self.lock()?.world.telemetry(xfer)
    }

    /// The type name of the backend a request goes through (`make` chose it: the first
    /// hinted backend both sides have, else the first common one).
    pub fn xfer_backend(&self, xfer: XferId) -> Result<&'static str> {
        self.lock()?.world.xfer_backend(xfer)
    }

    /// Number of merged ranges of a request.
    pub fn xfer_ranges(&self, xfer: XferId) -> Result<usize> {
        self.lock()?.world.xfer_range_count(xfer)
    }

    /// Our full metadata: name, generation, connection info of every remote-capable
    /// backend, every registered region's public metadata.
    pub fn local_md(&self) -> Result<Vec<u8>> {
        let mut state = self.lock()?;
        let state = &mut *state;
        state.md.encode_local(&state.world, None, true)
    }

    /// Partial metadata: only `regions`, with or without connection info.
    pub fn local_partial_md(
        &self,
        regions: &[RegionId],
        include_conn_info: bool,
    ) -> Result<Vec<u8>> {
        let mut state = self.lock()?;
        let state = &mut *state;
        state
            .md
            .encode_local(&state.world, Some(regions), include_conn_info)
    }

    /// Validate and load a peer's metadata blob (idempotent for identical content;
    /// conflicting content refused; partial metadata accumulates; new content of a new
    /// generation replaces the old and invalidates requests built on it; metadata
    /// carrying this agent's own name is refused).
    pub fn load_remote_md(&self, blob: &[u8]) -> Result<PeerId> {
        let peer = self.one(
            |c| c.load_md(blob).index(),
            |c, i| c.created(ferry_schedules::Ticket::<PeerId>::at(i)),
        )?;
        // The one-shot `create` records both lists of a request into the scratch: room
        // for the two lists the load readied the request path for.
        if let Ok(mut state) = self.lock() {
            let descs = state.world.ready_descs();
            state.scratch.ready_descs(2 * descs);
        }
        Ok(peer)
    }

    /// Forget a peer's metadata: the peer's handle goes stale, requests built on it fail
    /// with not-found, and those in flight drain until their backend confirms the end
    /// (their regions stay pinned until then).
    pub fn invalidate_remote_md(&self, peer: PeerId) -> Result<()> {
        self.one(|c| c.invalidate_md(peer).index(), done)
    }

    /// Establish the connections to a loaded peer now (NIXL's `makeConnection`), where
    /// a backend has not at load (UCX does by default: its `connect_on_load`) — and
    /// reconnect a peer declared down.
    pub fn make_connection(&self, peer: PeerId) -> Result<()> {
        self.one(|c| c.make_connection(peer).index(), done)
    }

    /// The peer known by agent name `name`.
    pub fn peer(&self, name: &str) -> Option<PeerId> {
        self.lock().ok()?.world.peer_by_name(name)
    }

    /// Ask backend `backend` about memory or files (one result per descriptor).
    pub fn query(
        &self,
        backend: BackendId,
        kind: MemKind,
        descs: &[Desc],
        paths: &[Option<&Path>],
    ) -> Result<Vec<QueryResult>> {
        self.lock()?.world.query(backend, kind, descs, paths)
    }

    /// Live (requests, prepared lists, regions, peers).
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        self.lock().map(|s| s.world.counts()).unwrap_or_default()
    }

    /// Slots the peer table holds (live and free): flat while peers come and go.
    pub fn peer_slots(&self) -> usize {
        self.lock()
            .map(|s| s.world.peer_slots())
            .unwrap_or_default()
    }
}

/// The executor's phases over `cmds`, with the agent's state locked, counted in the
/// agent's metrics: what [`Agent::flush`] and the direct methods both run.
fn execute(world: &mut World, md: &mut MdState, cmds: &mut CommandBuffer) -> FlushSummary {
    let summary = flush(world, md, cmds);
    world.metrics().flushed(world.counts().3);
    summary
}

fn done(c: &CommandBuffer, i: u32) -> Result<()> {
    match &c.outcomes()[i as usize] {
        ferry_schedules::Outcome::Failed(e) => Err(e.clone()),
        _ => Ok(()),
    }
}
