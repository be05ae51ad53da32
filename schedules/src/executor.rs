//! The executor: one flush runs the phases of [`Phase::ORDER`], in that order, each a
//! plain function over the world's tables. The order is data, written once: the
//! `phase_list!` macro holds the list and hands it to the macros that declare [`Phase`]
//! and [`Phase::ORDER`] and that expand the executor's sequence of phase calls (one call
//! per phase, unrolled at compile time: no loop, no dispatch; a phase that reads what an
//! earlier phase produced does not compile if the list puts it first). The agent's own
//! steps (the exchange pre-phase and the publish post-phase) are phases of the same list,
//! run by the agent around the executor's span [`Phase::EXECUTOR`]:
//!
//! | phase | what |
//! |---|---|
//! | [`Phase::Exchange`] | (agent) metadata-exchange commands: send / fetch / check through its exchange manager, no network wait |
//! | [`Phase::Metadata`] | load / invalidate peer metadata, make connections |
//! | [`Phase::Register`] | register regions with backends, index them in sections |
//! | [`Phase::Prep`] | resolve descriptor lists against sections (a `create`'s remote side only) |
//! | [`Phase::Make`] | build requests: index lists → ranges, merged on the fly; pin regions; `create` in one pass where one backend serves both lists |
//! | [`Phase::Dispatch`] | validate posts, sort by backend × endpoint × op (record order kept within each), one batch per backend × endpoint |
//! | [`Phase::Progress`] | drive backends, route completions by tag, answer checks |
//! | [`Phase::Notify`] | standalone notifications, drain inbound ones into the buffer |
//! | [`Phase::Retire`] | release requests / prepared lists, deregister regions |
//! | [`Phase::Publish`] | (agent) refresh the metadata snapshot the exchange serves |
//!
//! Every command gets its own [`Outcome`]; one bad command fails alone. A command whose
//! input is the result of a failed command fails with `DependencyFailed`; a ticket must
//! name an *earlier* command of the buffer (a later one is refused, whatever the phase
//! order would allow). A buffer is flushed once: flushing it again without `clear()` (or
//! recording, which starts a new batch) is refused and every outcome says so.
//!
//! # Ordering a caller can rely on
//!
//! - Phases run in [`Phase::ORDER`], whatever the record order: a `post` recorded before
//!   the `make` it names (by ticket) is refused, but `release` recorded before `post` of
//!   the same request still runs after it (retire is last).
//! - Within one phase, commands run in record order.
//! - Posts to the same backend × endpoint × op reach the backend in record order, in one
//!   batch. Posts to different endpoints, backends or ops go in separate batches whose
//!   order is unspecified; and no backend promises that the *bytes* of two requests of
//!   one batch land in order (a NIC may complete them out of order). A caller that needs
//!   B after A waits for A's completion (or its notification) before posting B.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Instant;

use bumpalo::collections::Vec as BumpVec;
use ferry_backend_api::{NotifSink, Post};
use ferry_storage::{handle_to_tag, Endpoint, Error, PeerId, Subject, XferId};

use crate::command::{
    Command, CommandBuffer, Created, FromCreated, NotifEntry, Outcome, PrepDescs, Ref, Releasable,
    Side, Span, XferStatus,
};
use crate::logging::{BackendNames, DescText, FlushTrace, PathText};
use crate::merge::dispatch_key;
use crate::world::{DeregStatus, World, XferState};

macro_rules! phase_span {
    ($name:literal) => {
        #[cfg(feature = "tracy")]
        let _span = tracy_client::span!($name);
    };
}

/// Loads peer metadata for the metadata phase. Implemented by the engine, which owns the
/// codec; the executor never parses metadata itself.
pub trait MetadataLoader {
    /// Validate `blob` and load it into `world` (creating or refreshing a peer).
    fn load(&mut self, world: &mut World, blob: &[u8]) -> Result<PeerId, Error>;
    /// `peer` was invalidated (its row is gone): drop what the loader keeps for it.
    fn forget(&mut self, peer: PeerId);
}

/// What one flush did, in numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushSummary {
    /// Commands that failed.
    pub failed: u32,
    /// Requests handed to backends.
    pub posted: u32,
    /// Completions routed to requests.
    pub completed: u32,
    /// Inbound notifications collected.
    pub notifications: u32,
}

/// The phases of a flush, in order: the one list. It hands itself to the macro `$then`,
/// so the enum and [`Phase::ORDER`] (`declare_phases`) and the executor's sequence of
/// phase calls (`flush`, unrolled at compile time: no loop, no dispatch) all come from it.
macro_rules! phase_list {
    ($then:ident) => {
        $then! {
            /// Metadata-exchange commands (run by the agent, before the executor).
            Exchange,
            /// Load / invalidate peer metadata; make connections.
            Metadata,
            /// Register regions.
            Register,
            /// Prepare descriptor lists.
            Prep,
            /// Build requests.
            Make,
            /// Post requests, one batch per backend × endpoint.
            Dispatch,
            /// Drive backends, route completions, answer checks.
            Progress,
            /// Send and drain notifications.
            Notify,
            /// Release requests and lists, deregister regions.
            Retire,
            /// Refresh the published metadata snapshot (run by the agent, after the
            /// executor).
            Publish,
        }
    };
}

macro_rules! declare_phases {
    ($($(#[$doc:meta])* $phase:ident),* $(,)?) => {
        /// One phase of a flush. [`Phase::ORDER`] is the order; [`Phase::of`] says where
        /// each command runs.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Phase {
            $($(#[$doc])* $phase,)*
        }

        impl Phase {
            /// Every phase in the order a flush runs them (declared from the one list).
            pub const ORDER: [Phase; [$(stringify!($phase)),*].len()] = [$(Phase::$phase),*];
        }
    };
}

phase_list!(declare_phases);

impl Phase {
    /// Number of phases.
    pub const COUNT: usize = Phase::ORDER.len();

    /// The executor's part of [`Phase::ORDER`]: the agent steps before it and after it
    /// are run by the agent (computed from `ORDER`, checked to be one run).
    pub const EXECUTOR: std::ops::Range<usize> = {
        let mut start = 0;
        while Phase::ORDER[start].is_agent_step() {
            start += 1;
        }
        let mut end = start;
        while end < Phase::COUNT && !Phase::ORDER[end].is_agent_step() {
            end += 1;
        }
        let mut rest = end;
        while rest < Phase::COUNT {
            assert!(
                Phase::ORDER[rest].is_agent_step(),
                "the executor's phases are one run"
            );
            rest += 1;
        }
        start..end
    };

    /// Position of the phase in [`Phase::ORDER`] (the variants are declared from the
    /// same list; a test checks it).
    #[inline]
    pub const fn position(self) -> usize {
        self as usize
    }

    /// Whether the agent runs this phase itself (around the executor's phases).
    pub const fn is_agent_step(self) -> bool {
        matches!(self, Phase::Exchange | Phase::Publish)
    }

    /// The phase a command runs in.
    pub fn of(command: &Command) -> Phase {
        match command {
            Command::Exchange(_) => Phase::Exchange,
            Command::LoadMd { .. } | Command::InvalidateMd { .. } | Command::Connect { .. } => {
                Phase::Metadata
            }
            Command::Register { .. } => Phase::Register,
            Command::Prep { .. } | Command::Create { .. } => Phase::Prep,
            Command::Make { .. } => Phase::Make,
            Command::Post { .. } => Phase::Dispatch,
            Command::Check { .. } => Phase::Progress,
            Command::Notify { .. } | Command::DrainNotifications => Phase::Notify,
            Command::Release { .. } | Command::Deregister { .. } => Phase::Retire,
        }
    }
}

/// Flush `cmds` against `world`: the executor's phases of [`Phase::ORDER`]. Outcomes
/// land in the buffer. The agent phases ([`Phase::is_agent_step`]) are the caller's;
/// exchange commands still pending afterwards fail with not-supported.
pub fn flush(
    world: &mut World,
    loader: &mut dyn MetadataLoader,
    cmds: &mut CommandBuffer,
) -> FlushSummary {
    phase_span!("ferry::flush");
    let mut summary = FlushSummary::default();
    if cmds.flushed {
        let error = Error::NotAllowed {
            subject: Subject::Named("command buffer".into()),
            reason: "already flushed: clear() it (or record a new command, which starts a new batch) before flushing again".into(),
        };
        for outcome in &mut cmds.outcomes {
            *outcome = Outcome::Failed(error.clone());
        }
        summary.failed = cmds.outcomes.len() as u32;
        return summary;
    }
    let mut trace = FlushTrace::start();
    if let Some(t) = trace.as_mut() {
        t.count(&cmds.commands);
    }
    let mut arena = std::mem::take(&mut world.arena);
    arena.reset();
    {
        let buckets = classify(&arena, cmds);
        // Set by their phases (the compiler checks they run before their readers).
        let created_preps: CreatedPreps<'_>;
        let posted: BumpVec<'_, Posted>;
        // One call per phase, in the order of the one list (expanded at compile time).
        macro_rules! run_phase {
            (Exchange) => {}; // the agent's step, before the executor
            (Publish) => {};  // the agent's step, after the executor
            (Metadata) => {
                phase_metadata(world, loader, cmds, &buckets[Phase::Metadata.position()])
            };
            (Register) => {
                phase_register(world, cmds, &buckets[Phase::Register.position()])
            };
            (Prep) => {
                created_preps = phase_prep(world, &arena, cmds, &buckets[Phase::Prep.position()])
            };
            (Make) => {
                phase_make(
                    world,
                    cmds,
                    &buckets[Phase::Make.position()],
                    &created_preps,
                )
            };
            (Dispatch) => {
                posted = phase_dispatch(world, &arena, cmds, &buckets[Phase::Dispatch.position()]);
                summary.posted = posted.len() as u32;
                if let Some(t) = trace.as_mut() {
                    t.bytes = posted
                        .iter()
                        .filter(|p| !cmds.outcomes[p.command as usize].is_err())
                        .map(|p| world.xfers.telemetry[p.row as usize].total_bytes)
                        .sum();
                }
            };
            (Progress) => {
                summary.completed =
                    phase_progress(world, cmds, &posted, &buckets[Phase::Progress.position()])
            };
            (Notify) => {
                summary.notifications =
                    phase_notify(world, cmds, &buckets[Phase::Notify.position()])
            };
            (Retire) => {
                phase_retire(world, cmds, &buckets[Phase::Retire.position()])
            };
        }
        macro_rules! run_phases {
            ($($(#[$doc:meta])* $phase:ident),* $(,)?) => {
                $( run_phase!($phase); )*
            };
        }
        phase_list!(run_phases);
        // The agent's steps are the agent's: a buffer flushed without one says so.
        for &i in buckets[Phase::Exchange.position()].iter() {
            if cmds.outcomes[i as usize] == Outcome::Pending {
                cmds.outcomes[i as usize] = Outcome::Failed(Error::NotSupported {
                    backend: "executor".into(),
                    what: "metadata-exchange commands run in Agent::flush".into(),
                });
            }
        }
    }
    world.arena = arena;
    cmds.flushed = true;
    for outcome in &cmds.outcomes {
        if let Outcome::Failed(e) = outcome {
            summary.failed += 1;
            if let Error::Capacity { what, limit } = e {
                world.limits.hit(&world.name, what, *limit);
            }
        }
    }
    if let Some(t) = trace {
        t.finish(&world.name, &summary);
    }
    summary
}

fn classify<'a>(
    arena: &'a bumpalo::Bump,
    cmds: &CommandBuffer,
) -> [BumpVec<'a, u32>; Phase::COUNT] {
    phase_span!("ferry::classify");
    let mut buckets: [BumpVec<'a, u32>; Phase::COUNT] =
        std::array::from_fn(|_| BumpVec::new_in(arena));
    for (i, command) in cmds.commands.iter().enumerate() {
        buckets[Phase::of(command).position()].push(i as u32);
    }
    buckets
}

/// Resolve a handle-or-ticket of command `at` against earlier outcomes.
fn resolve<H: FromCreated + Copy>(outcomes: &[Outcome], at: u32, r: Ref<H>) -> Result<H, Error> {
    match r {
        Ref::Handle(h) => Ok(h),
        Ref::Ticket(i) if i >= at => Err(Error::invalid(
            Subject::Command(i),
            format!("a ticket must name an earlier command; command #{at} names command #{i}"),
        )),
        Ref::Ticket(i) => match outcomes.get(i as usize) {
            Some(Outcome::Created(c)) => H::from_created(*c).ok_or_else(|| {
                Error::invalid(
                    Subject::Command(i),
                    "ticket names a command that creates another kind of object",
                )
            }),
            Some(Outcome::Failed(_)) => Err(Error::DependencyFailed { command: i }),
            _ => Err(Error::invalid(
                Subject::Command(i),
                "ticket names a command that creates nothing (or runs in a later phase)",
            )),
        },
    }
}

fn set(cmds: &mut CommandBuffer, index: u32, result: Result<Outcome, Error>) {
    cmds.outcomes[index as usize] = match result {
        Ok(o) => o,
        Err(e) => Outcome::Failed(e),
    };
}

// ---------------------------------------------------------------- 1. metadata

fn phase_metadata(
    world: &mut World,
    loader: &mut dyn MetadataLoader,
    cmds: &mut CommandBuffer,
    bucket: &[u32],
) {
    phase_span!("ferry::metadata");
    for &i in bucket {
        let result = match cmds.commands[i as usize] {
            Command::LoadMd { bytes } => loader
                .load(world, &cmds.bytes[bytes.range()])
                .map(|p| Outcome::Created(Created::Peer(p))),
            Command::InvalidateMd { peer } => resolve(&cmds.outcomes, i, peer).and_then(|p| {
                world.invalidate_peer(p)?;
                loader.forget(p);
                Ok(Outcome::Done)
            }),
            Command::Connect { peer } => resolve(&cmds.outcomes, i, peer)
                .and_then(|p| world.connect_peer(p))
                .map(|()| Outcome::Done),
            _ => unreachable!("classified as metadata"),
        };
        set(cmds, i, result);
    }
}

// ---------------------------------------------------------------- 2. register

fn phase_register(world: &mut World, cmds: &mut CommandBuffer, bucket: &[u32]) {
    phase_span!("ferry::register");
    for &i in bucket {
        let Command::Register {
            kind,
            desc,
            hint,
            path,
        } = cmds.commands[i as usize]
        else {
            unreachable!("classified as register")
        };
        let path = path.map(|(span, mode)| {
            (
                Path::new(std::ffi::OsStr::from_bytes(&cmds.bytes[span.range()])),
                mode,
            )
        });
        let result = world.register_region(kind, desc, hint, path);
        match &result {
            Ok(id) => log::debug!(
                "agent '{}': registered {kind} region {id:?}: {}{} with {}",
                world.name,
                DescText(kind, desc),
                PathText(path.map(|(p, _)| p)),
                BackendNames::new(
                    world,
                    world
                        .regions
                        .row(*id)
                        .map_or(ferry_storage::BackendMask::EMPTY, |row| {
                            world.regions.backends[row]
                        })
                ),
            ),
            Err(e) => log::debug!(
                "agent '{}': registering {kind} {}{} failed: {e}",
                world.name,
                DescText(kind, desc),
                PathText(path.map(|(p, _)| p)),
            ),
        }
        set(
            cmds,
            i,
            result.map(|id| Outcome::Created(Created::Region(id))),
        );
    }
}

// ---------------------------------------------------------------- 3. prep

/// The `create` commands of the prep phase, built in the make phase: (command, the
/// peer its remote list names, or why that side could not be resolved).
type CreatedPreps<'a> = BumpVec<'a, (u32, Result<Option<PeerId>, Error>)>;

fn phase_prep<'a>(
    world: &mut World,
    arena: &'a bumpalo::Bump,
    cmds: &mut CommandBuffer,
    bucket: &[u32],
) -> CreatedPreps<'a> {
    phase_span!("ferry::prep");
    let mut created = BumpVec::new_in(arena);
    for &i in bucket {
        match cmds.commands[i as usize] {
            Command::Prep {
                side,
                kind,
                descs,
                hint,
            } => {
                let result = resolve_side(&cmds.outcomes, i, side)
                    .and_then(|side| match descs {
                        PrepDescs::List(span) => {
                            world.prep_list(side, kind, &cmds.descs[span.range()], hint)
                        }
                        PrepDescs::Strided(span) => {
                            world.prep_strided(side, kind, &cmds.strided[span.range()], hint)
                        }
                    })
                    .map(|p| Outcome::Created(Created::Prep(p)));
                set(cmds, i, result);
            }
            Command::Create { remote_side, .. } => {
                created.push((i, resolve_side(&cmds.outcomes, i, remote_side)));
            }
            _ => unreachable!("classified as prep"),
        }
    }
    created
}

fn resolve_side(outcomes: &[Outcome], at: u32, side: Side) -> Result<Option<PeerId>, Error> {
    match side {
        Side::Local => Ok(None),
        Side::Peer(p) => resolve(outcomes, at, p).map(Some),
    }
}

// ---------------------------------------------------------------- 4. make

fn phase_make(
    world: &mut World,
    cmds: &mut CommandBuffer,
    makes: &[u32],
    created: &CreatedPreps<'_>,
) {
    phase_span!("ferry::make");
    // `create` commands: in one pass where it applies (`World::create_fused`), else
    // from two temporary prepared lists, dropped afterwards.
    for (i, side) in created.iter() {
        let Command::Create {
            op,
            local_kind,
            local,
            remote_kind,
            remote,
            notif,
            hint,
            ..
        } = cmds.commands[*i as usize]
        else {
            unreachable!("created preps come from create commands")
        };
        let result = side.clone().and_then(|side| {
            let notif = notif.map(|s| &cmds.bytes[s.range()]);
            let (local, remote) = (&cmds.descs[local.range()], &cmds.descs[remote.range()]);
            if let Some(x) = world.create_fused(
                op,
                local_kind,
                local,
                side,
                remote_kind,
                remote,
                notif,
                hint,
            ) {
                return Ok(x);
            }
            let l = world.prep_list(None, local_kind, local, hint)?;
            let r = match world.prep_list(side, remote_kind, remote, hint) {
                Ok(r) => r,
                Err(e) => {
                    let _ = world.release_prep(l);
                    return Err(e);
                }
            };
            let made = world.make_xfer(op, l, &[], r, &[], notif, hint);
            let _ = world.release_prep(l);
            let _ = world.release_prep(r);
            made
        });
        set(cmds, *i, result.map(|x| Outcome::Created(Created::Xfer(x))));
    }
    for &i in makes {
        let Command::Make {
            op,
            local,
            local_idx,
            remote,
            remote_idx,
            notif,
            hint,
        } = cmds.commands[i as usize]
        else {
            unreachable!("classified as make")
        };
        let result = (|| {
            let l = resolve(&cmds.outcomes, i, local)?;
            let r = resolve(&cmds.outcomes, i, remote)?;
            let notif = notif.map(|s| &cmds.bytes[s.range()]);
            world.make_xfer(
                op,
                l,
                &cmds.indices[local_idx.range()],
                r,
                &cmds.indices[remote_idx.range()],
                notif,
                hint,
            )
        })()
        .map(|x| Outcome::Created(Created::Xfer(x)));
        set(cmds, i, result);
    }
}

// ---------------------------------------------------------------- 5. dispatch

/// A request accepted for posting this flush: (sort key, command, request).
#[derive(Clone, Copy)]
pub(crate) struct Posted {
    key: u128,
    command: u32,
    xfer: XferId,
    row: u32,
}

fn endpoint_rank(endpoint: Endpoint) -> u64 {
    match endpoint {
        Endpoint::Local => 0,
        Endpoint::Peer(p) => handle_to_tag(p),
    }
}

// Reason: calls the backends' `unsafe fn post` (backend safety contract).
#[allow(unsafe_code)]
fn phase_dispatch<'a>(
    world: &mut World,
    arena: &'a bumpalo::Bump,
    cmds: &mut CommandBuffer,
    bucket: &[u32],
) -> BumpVec<'a, Posted> {
    phase_span!("ferry::dispatch");
    let mut posted: BumpVec<'a, Posted> = BumpVec::with_capacity_in(bucket.len(), arena);
    for &i in bucket {
        let Command::Post { xfer } = cmds.commands[i as usize] else {
            unreachable!("classified as post")
        };
        let accepted = resolve(&cmds.outcomes, i, xfer).and_then(|id| {
            let row = world.accept_post(id)?;
            let key = dispatch_key(
                world.xfers.slots[row],
                endpoint_rank(world.xfers.endpoints[row]),
                world.xfers.ops[row] as u8,
            );
            Ok(Posted {
                key,
                command: i,
                xfer: id,
                row: row as u32,
            })
        });
        match accepted {
            Ok(p) => posted.push(p),
            Err(e) => {
                world.metrics.error(&e);
                cmds.outcomes[i as usize] = Outcome::Failed(e);
            }
        }
    }
    // Command indices are unique, so this unstable sort keeps record order among posts
    // of one backend × endpoint × op (a stable order without a stable sort's buffer).
    posted.sort_unstable_by_key(|p| (p.key, p.command));

    let telemetry = world.bounds.telemetry;
    let mut start = 0;
    while start < posted.len() {
        let row0 = posted[start].row as usize;
        let slot = usize::from(world.xfers.slots[row0]);
        let endpoint = world.xfers.endpoints[row0];
        let mut end = start + 1;
        while end < posted.len() && posted[end].key >> 8 == posted[start].key >> 8 {
            end += 1;
        }
        let group = &posted[start..end];
        let x = &world.xfers;
        let mut batch: BumpVec<'_, Post<'_>> = BumpVec::with_capacity_in(group.len(), arena);
        for p in group {
            let row = p.row as usize;
            batch.push(Post {
                tag: handle_to_tag(p.xfer),
                op: x.ops[row],
                local_kind: x.kinds[row].0,
                remote_kind: x.kinds[row].1,
                ranges: &x.ranges[row],
                notif: x.has_notif[row].then(|| x.notifs[row].as_slice()),
            });
        }
        let t0 = telemetry.then(Instant::now);
        // The backend may take this reading as "now" (`Completions::now`).
        world.completions.set_posted_at(t0);
        let backend = world.backends.backends[slot]
            .as_mut()
            .expect("request slot is filled");
        // SAFETY: every range was resolved by `make` against the section index, so its
        // local side (and a local transfer's remote side) lies inside a region registered
        // with this backend under the range's token; the request pins those regions from
        // `make` until it is released (a draining one until its backend confirmed the
        // end), and `deregister_region` refuses a pinned region, so they stay registered
        // (and their memory valid by `register`'s promise) for the whole post.
        let result = unsafe { backend.post(endpoint, &batch, &mut world.completions) };
        world.completions.set_posted_at(None);
        drop(batch);
        let post_duration = match t0 {
            Some(t0) => {
                let ended = Instant::now();
                world.dispatched_at = Some(ended);
                ended - t0
            }
            None => Default::default(),
        };
        for p in group {
            let row = p.row as usize;
            match &result {
                Ok(()) => {
                    world.xfers.states[row] = XferState::InProgress;
                    world.metrics.posted(
                        slot,
                        world.xfers.telemetry[row].total_bytes,
                        world.xfers.ranges[row].len() as u64,
                    );
                    if let Some(t0) = t0 {
                        let t = &mut world.xfers.telemetry[row];
                        t.start = Some(t0);
                        t.post_duration = post_duration;
                        t.xfer_duration = Default::default();
                    }
                }
                Err(e) => {
                    world.metrics.post_refused(slot, e);
                    world.xfers.states[row] = XferState::Failed(e.clone());
                    cmds.outcomes[p.command as usize] = Outcome::Failed(e.clone());
                }
            }
        }
        start = end;
    }
    posted
}

// ---------------------------------------------------------------- 6. progress

fn phase_progress(
    world: &mut World,
    cmds: &mut CommandBuffer,
    posted: &[Posted],
    checks: &[u32],
) -> u32 {
    phase_span!("ferry::progress");
    let routed = world.progress();
    for p in posted {
        if cmds.outcomes[p.command as usize] == Outcome::Pending {
            cmds.outcomes[p.command as usize] = status_outcome(&world.xfers.states[p.row as usize]);
        }
    }
    for &i in checks {
        let Command::Check { xfer } = cmds.commands[i as usize] else {
            unreachable!("classified as check")
        };
        let result = resolve(&cmds.outcomes, i, xfer)
            .and_then(|id| world.xfer_state(id).map(status_outcome));
        set(cmds, i, result);
    }
    routed
}

fn status_outcome(state: &XferState) -> Outcome {
    match state {
        XferState::NotPosted => Outcome::Status(XferStatus::NotPosted),
        XferState::InProgress => Outcome::Status(XferStatus::InProgress),
        XferState::Done => Outcome::Status(XferStatus::Done),
        XferState::Failed(e) | XferState::Draining(e) => Outcome::Failed(e.clone()),
    }
}

// ---------------------------------------------------------------- 7. notify

struct BufferSink<'a> {
    notifs: &'a mut Vec<NotifEntry>,
    bytes: &'a mut Vec<u8>,
    count: u32,
}

impl NotifSink for BufferSink<'_> {
    fn deliver(&mut self, from: &str, payload: &[u8]) {
        let f = Span {
            start: self.bytes.len() as u32,
            len: from.len() as u32,
        };
        self.bytes.extend_from_slice(from.as_bytes());
        let p = Span {
            start: self.bytes.len() as u32,
            len: payload.len() as u32,
        };
        self.bytes.extend_from_slice(payload);
        self.notifs.push(NotifEntry {
            from: f,
            payload: p,
        });
        self.count += 1;
    }
}

fn phase_notify(world: &mut World, cmds: &mut CommandBuffer, bucket: &[u32]) -> u32 {
    phase_span!("ferry::notify");
    let mut drained = 0;
    for &i in bucket {
        match cmds.commands[i as usize] {
            Command::Notify { to, payload } => {
                let result = resolve_side(&cmds.outcomes, i, to)
                    .and_then(|peer| world.send_notification(peer, &cmds.bytes[payload.range()]))
                    .map(|()| Outcome::Done);
                set(cmds, i, result);
            }
            Command::DrainNotifications => {
                let mut sink = BufferSink {
                    notifs: &mut cmds.notifs,
                    bytes: &mut cmds.notif_bytes,
                    count: 0,
                };
                world.drain_notifications(&mut sink);
                drained += sink.count;
                cmds.outcomes[i as usize] = Outcome::Drained(sink.count);
            }
            _ => unreachable!("classified as notify"),
        }
    }
    drained
}

// ---------------------------------------------------------------- 8. retire

fn phase_retire(world: &mut World, cmds: &mut CommandBuffer, bucket: &[u32]) {
    phase_span!("ferry::retire");
    for &i in bucket {
        let result = match cmds.commands[i as usize] {
            Command::Release {
                what: Releasable::Xfer(x),
            } => resolve(&cmds.outcomes, i, x)
                .and_then(|x| world.release_xfer(x))
                .map(|()| Outcome::Done),
            Command::Release {
                what: Releasable::Prep(p),
            } => resolve(&cmds.outcomes, i, p)
                .and_then(|p| world.release_prep(p))
                .map(|()| Outcome::Done),
            Command::Deregister { region } => resolve(&cmds.outcomes, i, region).and_then(|r| {
                // Looked up for the log line only.
                let region = log::log_enabled!(log::Level::Debug)
                    .then(|| world.regions.row(r))
                    .flatten()
                    .map(|row| (world.regions.kinds[row], world.regions.descs[row]));
                let result = world.deregister_region(r);
                match (&result, region) {
                    (Ok(DeregStatus::Done), Some((kind, desc))) => log::debug!(
                        "agent '{}': deregistered {kind} region {r:?}: {}",
                        world.name,
                        DescText(kind, desc),
                    ),
                    (Err(e), _) => log::debug!(
                        "agent '{}': deregistering region {r:?} failed: {e}",
                        world.name
                    ),
                    _ => {}
                }
                result.map(|status| match status {
                    DeregStatus::Done => Outcome::Done,
                    DeregStatus::Pending => Outcome::Withdrawing,
                })
            }),
            _ => unreachable!("classified as retire"),
        };
        set(cmds, i, result);
    }
}

#[cfg(test)]
mod tests {
    use super::Phase;

    #[test]
    fn phase_positions_follow_the_one_order() {
        for (i, phase) in Phase::ORDER.iter().enumerate() {
            assert_eq!(phase.position(), i, "{phase:?}");
        }
        assert_eq!(Phase::EXECUTOR, 1..Phase::COUNT - 1);
        assert!(Phase::ORDER[Phase::EXECUTOR]
            .iter()
            .all(|p| !p.is_agent_step()));
    }
}
