//! The executor: one flush runs these phases, in this order, each a plain function over
//! the world's tables (the order is written here and nowhere else):
//!
//! (−1. **exchange** – metadata-exchange commands, run by the agent before the
//!      executor: send / fetch / check through its exchange manager, no network wait)
//! 0. **classify**   – bucket command indices by phase (arena scratch)
//! 1. **metadata**   – load / invalidate peer metadata
//! 2. **register**   – register regions with backends, index them in sections
//! 3. **prep**       – resolve descriptor lists against sections (incl. `create`'s lists)
//! 4. **make**       – build requests: index lists → ranges, merged on the fly
//! 5. **dispatch**   – validate posts, sort by backend × endpoint × op, one batch each
//! 6. **progress**   – drive backends, route completions by tag, answer checks
//! 7. **notify**     – standalone notifications, drain inbound ones into the buffer
//! 8. **retire**     – release requests / prepared lists, deregister regions
//!
//! Every command gets its own [`Outcome`]; one bad command fails alone. A command whose
//! input is the result of a failed command fails with `DependencyFailed`.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Instant;

use bumpalo::collections::Vec as BumpVec;
use ferry_backend_api::{Completion, FailureKind, NotifSink, Post, Range, RegionSpec};
use ferry_storage::{
    handle_from_tag, handle_to_tag, BackendMask, Desc, Endpoint, Error, MemKind, Op, PeerId,
    PrepId, RegionId, Subject, XferId, MAX_BACKENDS,
};

use crate::command::{
    Command, CommandBuffer, Created, FromCreated, NotifEntry, Outcome, Ref, Releasable, Side, Span,
    XferStatus,
};
use crate::merge::{dispatch_key, push_merged};
use crate::world::{Hit, PrepEntry, PrepSide, World, XferState};

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

const PHASES: usize = 9;

fn phase_of(command: &Command) -> usize {
    match command {
        Command::LoadMd { .. } | Command::InvalidateMd { .. } => 0,
        Command::Register { .. } => 1,
        Command::Prep { .. } | Command::Create { .. } => 2,
        Command::Make { .. } => 3,
        Command::Post { .. } => 4,
        Command::Check { .. } => 5,
        Command::Notify { .. } | Command::DrainNotifications => 6,
        Command::Release { .. } | Command::Deregister { .. } => 7,
        Command::Exchange(_) => 8,
    }
}

/// Flush `cmds` against `world`. Outcomes land in the buffer.
pub fn flush(
    world: &mut World,
    loader: &mut dyn MetadataLoader,
    cmds: &mut CommandBuffer,
) -> FlushSummary {
    phase_span!("ferry::flush");
    let mut arena = std::mem::take(&mut world.arena);
    arena.reset();
    let mut summary = FlushSummary::default();
    {
        let buckets = classify(&arena, cmds);
        phase_metadata(world, loader, cmds, &buckets[0]);
        phase_register(world, cmds, &buckets[1]);
        let created_preps = phase_prep(world, &arena, cmds, &buckets[2]);
        phase_make(world, cmds, &buckets[3], &created_preps);
        let posted = phase_dispatch(world, &arena, cmds, &buckets[4]);
        summary.posted = posted.len() as u32;
        summary.completed = phase_progress(world, cmds, &posted, &buckets[5]);
        summary.notifications = phase_notify(world, cmds, &buckets[6]);
        phase_retire(world, cmds, &buckets[7]);
        for &i in buckets[8].iter() {
            // Exchange commands are the agent's; a buffer flushed without one says so.
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
    summary.failed = cmds.outcomes.iter().filter(|o| o.is_err()).count() as u32;
    summary
}

fn classify<'a>(arena: &'a bumpalo::Bump, cmds: &CommandBuffer) -> [BumpVec<'a, u32>; PHASES] {
    phase_span!("ferry::classify");
    let mut buckets: [BumpVec<'a, u32>; PHASES] = std::array::from_fn(|_| BumpVec::new_in(arena));
    for (i, command) in cmds.commands.iter().enumerate() {
        buckets[phase_of(command)].push(i as u32);
    }
    buckets
}

/// Resolve a handle-or-ticket against earlier outcomes.
fn resolve<H: FromCreated + Copy>(outcomes: &[Outcome], r: Ref<H>) -> Result<H, Error> {
    match r {
        Ref::Handle(h) => Ok(h),
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
                "ticket does not name an earlier command",
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
            Command::InvalidateMd { peer } => resolve(&cmds.outcomes, peer)
                .and_then(|p| world.invalidate_peer(p))
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
        let result = world
            .register_region(kind, desc, hint, path)
            .map(|id| Outcome::Created(Created::Region(id)));
        set(cmds, i, result);
    }
}

impl World {
    /// Register one region with every backend in `hint` that supports `kind`; succeeds
    /// if at least one accepts. Overlap with a region of the same section is refused.
    // Reason: calls the backends' `unsafe fn register` (backend safety contract).
    #[allow(unsafe_code)]
    pub fn register_region(
        &mut self,
        kind: MemKind,
        desc: Desc,
        hint: BackendMask,
        path: Option<(&Path, ferry_backend_api::FileMode)>,
    ) -> Result<RegionId, Error> {
        let subject = || Subject::Descriptor {
            index: 0,
            addr: desc.addr,
            len: desc.len,
            dev: desc.dev,
        };
        // A FILE region of length 0 means "unbounded": index it up to the end of the offset space.
        let indexed = if kind == MemKind::File && desc.len == 0 {
            Desc::new(desc.addr, u64::MAX - desc.addr, desc.dev)
        } else {
            desc
        };
        if indexed.len == 0 {
            return Err(Error::invalid(subject(), "a region must not be empty"));
        }
        if indexed.end().is_none() {
            return Err(Error::invalid(subject(), "range wraps the address space"));
        }
        if self.regions.len() >= self.bounds.regions_max {
            return Err(Error::Capacity {
                what: "registered regions",
                limit: self.bounds.regions_max,
            });
        }
        let mut candidates = BackendMask::EMPTY;
        for slot in 0..MAX_BACKENDS {
            if hint.contains(slot) && self.backends.caps[slot].is_some_and(|c| c.supports(kind)) {
                candidates.insert(slot);
            }
        }
        if candidates.is_empty() {
            return Err(Error::NotSupported {
                backend: "agent".into(),
                what: format!("no backend (of those hinted) supports memory kind {kind}").into(),
            });
        }
        // Refuse overlap before any backend does work.
        for slot in candidates.iter() {
            let section = &self.sections[slot][kind as usize];
            let probe_start = section.covering(Desc::new(indexed.addr, 1, indexed.dev));
            let overlapping = probe_start.or_else(|| {
                section
                    .iter()
                    .find(|&(_, dev, start, end)| {
                        dev == indexed.dev
                            && start < indexed.addr + indexed.len
                            && indexed.addr < end
                    })
                    .map(|(id, ..)| id)
            });
            if let Some(other) = overlapping {
                return Err(Error::NotAllowed {
                    subject: subject(),
                    reason: format!("overlaps registered region {other:?}").into(),
                });
            }
        }
        let spec = RegionSpec { kind, desc, path };
        let mut tokens = [0u64; MAX_BACKENDS];
        let mut public = Vec::new();
        let mut accepted = BackendMask::EMPTY;
        let mut first_error = None;
        for slot in candidates.iter() {
            let backend = self.backends.backends[slot]
                .as_mut()
                .expect("candidate slot is filled");
            // SAFETY: the region comes from `CommandBuffer::register` (an `unsafe fn`),
            // whose caller promised that the memory (or fd) stays valid until it is
            // deregistered through this world, which calls `Backend::deregister` first.
            match unsafe { backend.register(&spec) } {
                Ok(reg) => {
                    tokens[slot] = reg.token;
                    public.push((slot as u8, reg.public_md.into_boxed_slice()));
                    accepted.insert(slot);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if accepted.is_empty() {
            return Err(first_error.expect("at least one candidate failed"));
        }
        let id = self.regions.insert(kind, desc, accepted, tokens, public);
        for slot in accepted.iter() {
            self.sections[slot][kind as usize]
                .insert(indexed, id)
                .expect("overlap was checked before registering");
        }
        Ok(id)
    }

    /// Deregister a region from every backend that holds it. Refused while an in-flight
    /// request uses it.
    // Reason: calls the backends' `unsafe fn deregister` (backend safety contract).
    #[allow(unsafe_code)]
    pub fn deregister_region(&mut self, id: RegionId) -> Result<(), Error> {
        let row = self
            .regions
            .row(id)
            .ok_or_else(|| Error::not_found(Subject::Region(id)))?;
        let kind = self.regions.kinds[row];
        let desc = self.regions.descs[row];
        let tokens = self.regions.tokens[row];
        let backends = self.regions.backends[row];
        // In-flight check: a request's local ranges carry the region's token for its
        // slot, and its ranges lie inside the region's span.
        let end = if kind == MemKind::File && desc.len == 0 {
            u64::MAX
        } else {
            desc.addr + desc.len
        };
        for x in 0..self.xfers.rows.len() {
            if self.xfers.states[x] != XferState::InProgress {
                continue;
            }
            let slot = usize::from(self.xfers.slots[x]);
            if !backends.contains(slot) {
                continue;
            }
            let (lk, rk) = self.xfers.kinds[x];
            let local_target = self.xfers.endpoints[x] == Endpoint::Local;
            let uses = self.xfers.ranges[x].iter().any(|r| {
                (lk == kind
                    && r.local_dev == desc.dev
                    && r.local_addr >= desc.addr
                    && r.local_addr < end)
                    || (local_target
                        && rk == kind
                        && r.remote_dev == desc.dev
                        && r.remote_addr >= desc.addr
                        && r.remote_addr < end)
            });
            if uses {
                return Err(Error::NotAllowed {
                    subject: Subject::Region(id),
                    reason: format!(
                        "transfer request {:?} using it is in flight",
                        self.xfers.rows.key(x)
                    )
                    .into(),
                });
            }
        }
        let indexed = if kind == MemKind::File && desc.len == 0 {
            Desc::new(desc.addr, u64::MAX - desc.addr, desc.dev)
        } else {
            desc
        };
        let mut first_error = None;
        for slot in backends.iter() {
            if let Some(backend) = self.backends.backends[slot].as_mut() {
                // SAFETY: the scan above refused deregistration while any in-flight
                // request of this backend uses the region, so no post naming its token
                // is outstanding.
                if let Err(e) = unsafe { backend.deregister(kind, tokens[slot]) } {
                    first_error.get_or_insert(e);
                }
            }
            self.sections[slot][kind as usize].remove(indexed, id);
        }
        self.regions.remove(id);
        self.deregistrations += 1;
        first_error.map_or(Ok(()), Err)
    }
}

// ---------------------------------------------------------------- 3. prep

/// The temporary prepared lists of `create` commands: (command, local, remote).
type CreatedPreps<'a> = BumpVec<'a, (u32, Result<(PrepId, PrepId), Error>)>;

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
                let result = resolve_side(&cmds.outcomes, side)
                    .and_then(|side| world.prep_list(side, kind, &cmds.descs[descs.range()], hint))
                    .map(|p| Outcome::Created(Created::Prep(p)));
                set(cmds, i, result);
            }
            Command::Create {
                local_kind,
                local,
                remote_side,
                remote_kind,
                remote,
                hint,
                ..
            } => {
                let pair = (|| {
                    let side = resolve_side(&cmds.outcomes, remote_side)?;
                    let l = world.prep_list(None, local_kind, &cmds.descs[local.range()], hint)?;
                    match world.prep_list(side, remote_kind, &cmds.descs[remote.range()], hint) {
                        Ok(r) => Ok((l, r)),
                        Err(e) => {
                            let _ = world.release_prep(l);
                            Err(e)
                        }
                    }
                })();
                created.push((i, pair));
            }
            _ => unreachable!("classified as prep"),
        }
    }
    created
}

fn resolve_side(outcomes: &[Outcome], side: Side) -> Result<Option<PeerId>, Error> {
    match side {
        Side::Local => Ok(None),
        Side::Peer(p) => resolve(outcomes, p).map(Some),
    }
}

fn desc_subject(index: usize, d: Desc) -> Subject {
    Subject::Descriptor {
        index: index as u32,
        addr: d.addr,
        len: d.len,
        dev: d.dev,
    }
}

/// Resolve `descs` against the backend slots of `mask`: `lookup(slot, desc)` gives the
/// target (region tag or peer token) and the covering region's range. Each entry gets
/// the target of the lowest slot that covers every descriptor (the list's first slot);
/// slots that miss a descriptor leave the mask. Consecutive descriptors in the same
/// region cost one range check per slot, not a search.
///
/// `Err(None)` means every descriptor was covered by some slot but no one slot covers
/// them all.
fn resolve_descs(
    descs: &[Desc],
    mut mask: BackendMask,
    out: &mut Vec<PrepEntry>,
    lookup: impl Fn(usize, Desc) -> Option<(u64, Desc)>,
) -> Result<BackendMask, Option<Error>> {
    out.reserve(descs.len());
    let start = out.len();
    let Some(mut recorded) = mask.first() else {
        return Err(None);
    };
    let mut hits = [Hit::NONE; MAX_BACKENDS];
    for (i, &d) in descs.iter().enumerate() {
        if d.len == 0 || d.end().is_none() {
            return Err(Some(Error::invalid(
                desc_subject(i, d),
                "empty or wrapping descriptor",
            )));
        }
        let mut target = None;
        for slot in mask.iter() {
            if !hits[slot].covers(d) {
                match lookup(slot, d) {
                    Some((value, region)) => {
                        hits[slot] = Hit {
                            dev: region.dev,
                            start: region.addr,
                            end: region.addr.saturating_add(region.len),
                            value,
                        };
                    }
                    None => {
                        mask.remove(slot);
                        continue;
                    }
                }
            }
            target.get_or_insert(hits[slot].value);
        }
        let Some(target) = target else {
            return Err(Some(Error::NotFound {
                subject: desc_subject(i, d),
            }));
        };
        if mask.first() != Some(recorded) {
            // The slot whose targets were recorded so far dropped out: re-resolve the
            // earlier entries for the new first slot (rare: mixed coverage).
            recorded = mask.first().expect("a slot covered this descriptor");
            for entry in &mut out[start..] {
                entry.target = lookup(recorded, entry.desc).map(|(v, _)| v).ok_or(None)?;
            }
        }
        out.push(PrepEntry { desc: d, target });
    }
    Ok(mask)
}

impl World {
    /// Resolve `descs` (all of `kind`) against the local sections (`peer` = None) or a
    /// peer's published sections, once.
    pub fn prep_list(
        &mut self,
        peer: Option<PeerId>,
        kind: MemKind,
        descs: &[Desc],
        hint: BackendMask,
    ) -> Result<PrepId, Error> {
        if descs.len() > self.bounds.descs_per_list_max {
            return Err(Error::Capacity {
                what: "descriptors per list",
                limit: self.bounds.descs_per_list_max,
            });
        }
        if self.preps.rows.len() >= self.bounds.preps_max {
            return Err(Error::Capacity {
                what: "prepared lists",
                limit: self.bounds.preps_max,
            });
        }
        let mut entries = self.preps.pool.pop().unwrap_or_default();
        entries.clear();
        let result = match peer {
            None => self
                .resolve_local(kind, descs, hint, &mut entries)
                .map(|mask| (PrepSide::Local, mask)),
            Some(p) => self.resolve_peer(p, kind, descs, hint, &mut entries),
        };
        match result {
            Ok((side, mask)) => {
                let (id, _) = self.preps.rows.push();
                self.preps.sides.push(side);
                self.preps.kinds.push(kind);
                self.preps.masks.push(mask);
                self.preps.entries.push(entries);
                Ok(id)
            }
            Err(e) => {
                self.preps.pool.push(entries);
                Err(e)
            }
        }
    }

    fn resolve_local(
        &self,
        kind: MemKind,
        descs: &[Desc],
        hint: BackendMask,
        out: &mut Vec<PrepEntry>,
    ) -> Result<BackendMask, Error> {
        let mut mask = BackendMask::EMPTY;
        for slot in 0..MAX_BACKENDS {
            if hint.contains(slot)
                && self.backends.caps[slot].is_some_and(|c| c.supports(kind))
                && !self.sections[slot][kind as usize].is_empty()
            {
                mask.insert(slot);
            }
        }
        resolve_descs(descs, mask, out, |slot, d| {
            self.sections[slot][kind as usize].covering_bounds(d).map(
                |(region, dev, start, end)| {
                    (handle_to_tag(region), Desc::new(start, end - start, dev))
                },
            )
        })
        .map_err(|e| {
            e.unwrap_or_else(|| Error::NotFound {
                subject: Subject::Named(
                    format!("a single backend whose {kind} regions cover every descriptor").into(),
                ),
            })
        })
    }

    fn resolve_peer(
        &self,
        peer: PeerId,
        kind: MemKind,
        descs: &[Desc],
        hint: BackendMask,
        out: &mut Vec<PrepEntry>,
    ) -> Result<(PrepSide, BackendMask), Error> {
        let row = self
            .peers
            .rows
            .row(peer)
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        let view = self.peers.views[row]
            .as_ref()
            .ok_or_else(|| Error::NotFound {
                subject: Subject::PeerName(format!(
                    "{} (metadata invalidated)",
                    self.peers.names[row]
                )),
            })?;
        let slot_map = &self.peers.slot_maps[row];
        let mut mask = BackendMask::EMPTY;
        for slot in self.peers.loaded[row].iter() {
            if hint.contains(slot)
                && slot_map[slot].is_some()
                && self.backends.caps[slot].is_some_and(|c| c.remote && c.supports(kind))
            {
                mask.insert(slot);
            }
        }
        let mask = resolve_descs(descs, mask, out, |slot, d| {
            view.find_bounds(slot_map[slot]?, kind, d)
        })
        .map_err(|e| {
            e.unwrap_or_else(|| Error::NotFound {
                subject: Subject::Named(
                    format!(
                        "a backend shared with peer '{}' whose {kind} sections cover every descriptor",
                        self.peers.names[row]
                    )
                    .into(),
                ),
            })
        })?;
        Ok((
            PrepSide::Peer {
                peer,
                generation: self.peers.generations[row],
            },
            mask,
        ))
    }

    /// Release a prepared list.
    pub fn release_prep(&mut self, id: PrepId) -> Result<(), Error> {
        let row = self
            .preps
            .rows
            .remove(id)
            .ok_or_else(|| Error::not_found(Subject::Prep(id)))?;
        self.preps.sides.swap_remove(row);
        self.preps.kinds.swap_remove(row);
        self.preps.masks.swap_remove(row);
        let entries = self.preps.entries.swap_remove(row);
        self.preps.pool.push(entries);
        Ok(())
    }

    /// Number of descriptors in a prepared list.
    pub fn prep_len(&self, id: PrepId) -> Result<usize, Error> {
        let row = self
            .preps
            .rows
            .row(id)
            .ok_or_else(|| Error::not_found(Subject::Prep(id)))?;
        Ok(self.preps.entries[row].len())
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
    // `create` commands: build from their temporary lists, then drop the lists.
    for (i, pair) in created.iter() {
        let Command::Create {
            op, notif, hint, ..
        } = cmds.commands[*i as usize]
        else {
            unreachable!("created preps come from create commands")
        };
        let result = match pair {
            Ok((l, r)) => {
                let notif = notif.map(|s| &cmds.bytes[s.range()]);
                let made = world.make_xfer(op, *l, &[], *r, &[], notif, hint);
                let _ = world.release_prep(*l);
                let _ = world.release_prep(*r);
                made.map(|x| Outcome::Created(Created::Xfer(x)))
            }
            Err(e) => Err(e.clone()),
        };
        set(cmds, *i, result);
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
            let l = resolve(&cmds.outcomes, local)?;
            let r = resolve(&cmds.outcomes, remote)?;
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

fn check_indices(indices: &[u32], len: usize, which: &'static str) -> Result<(), Error> {
    for (pos, &ix) in indices.iter().enumerate() {
        if ix as usize >= len {
            return Err(Error::invalid(
                Subject::Named(format!("{which} index list entry #{pos}").into()),
                format!("index {ix} is out of range for a list of {len} descriptors"),
            ));
        }
    }
    Ok(())
}

impl World {
    /// Build a request from two prepared lists and index lists (empty = all, in order).
    #[allow(clippy::too_many_arguments)]
    pub fn make_xfer(
        &mut self,
        op: Op,
        local: PrepId,
        local_idx: &[u32],
        remote: PrepId,
        remote_idx: &[u32],
        notif: Option<&[u8]>,
        hint: BackendMask,
    ) -> Result<XferId, Error> {
        let lrow = self
            .preps
            .rows
            .row(local)
            .ok_or_else(|| Error::not_found(Subject::Prep(local)))?;
        let rrow = self
            .preps
            .rows
            .row(remote)
            .ok_or_else(|| Error::not_found(Subject::Prep(remote)))?;
        if self.preps.sides[lrow] != PrepSide::Local {
            return Err(Error::invalid(
                Subject::Prep(local),
                "the local list of a request must name local regions",
            ));
        }
        let (endpoint, generation) = match self.preps.sides[rrow] {
            PrepSide::Local => (Endpoint::Local, 0),
            PrepSide::Peer { peer, generation } => {
                self.check_peer_generation(peer, generation)?;
                (Endpoint::Peer(peer), generation)
            }
        };
        let local_len = self.preps.entries[lrow].len();
        let remote_len = self.preps.entries[rrow].len();
        check_indices(local_idx, local_len, "local")?;
        check_indices(remote_idx, remote_len, "remote")?;
        let n = if local_idx.is_empty() {
            local_len
        } else {
            local_idx.len()
        };
        let m = if remote_idx.is_empty() {
            remote_len
        } else {
            remote_idx.len()
        };
        if n != m {
            return Err(Error::Mismatch {
                subject: Subject::Prep(remote),
                reason: format!("local side has {n} descriptors, remote side {m}").into(),
            });
        }
        if n == 0 {
            return Err(Error::invalid(
                Subject::Prep(local),
                "a request needs at least one descriptor",
            ));
        }
        if let Some(payload) = notif {
            if payload.len() > self.bounds.notif_len_max {
                return Err(Error::Capacity {
                    what: "notification bytes",
                    limit: self.bounds.notif_len_max,
                });
            }
        }
        if self.xfers.rows.len() >= self.bounds.xfers_max {
            return Err(Error::Capacity {
                what: "transfer requests",
                limit: self.bounds.xfers_max,
            });
        }
        // Pick the backend: first hinted one common to both lists, else the first common.
        let mut common = self.preps.masks[lrow].and(self.preps.masks[rrow]);
        for slot in common.iter() {
            let caps = self.backends.caps[slot].expect("masked slot is filled");
            let ok = match endpoint {
                Endpoint::Local => caps.local,
                Endpoint::Peer(_) => caps.remote,
            };
            if !ok || (notif.is_some() && !caps.notifications) {
                common.remove(slot);
            }
        }
        let slot = common
            .and(hint)
            .first()
            .or_else(|| common.first())
            .ok_or_else(|| Error::NotSupported {
                backend: "agent".into(),
                what: "no backend covers both lists for this kind of transfer".into(),
            })?;
        let (lkind, rkind) = (self.preps.kinds[lrow], self.preps.kinds[rrow]);
        let lfirst = self.preps.masks[lrow].first();
        let rfirst = self.preps.masks[rrow].first();

        let mut ranges = self.xfers.range_pool.pop().unwrap_or_default();
        ranges.clear();
        ranges.reserve(n);
        let mut bytes = 0u64;
        // Consecutive descriptors mostly share a region: remember the last lookups.
        let (mut last_local, mut last_remote) = ((u64::MAX, 0u64), (u64::MAX, 0u64));
        let built = (|| {
            for k in 0..n {
                let li = if local_idx.is_empty() {
                    k
                } else {
                    local_idx[k] as usize
                };
                let ri = if remote_idx.is_empty() {
                    k
                } else {
                    remote_idx[k] as usize
                };
                let le = self.preps.entries[lrow][li];
                let re = self.preps.entries[rrow][ri];
                if le.desc.len != re.desc.len {
                    return Err(Error::Mismatch {
                        subject: desc_subject(k, re.desc),
                        reason: format!(
                            "length {} differs from the local descriptor's {}",
                            re.desc.len, le.desc.len
                        )
                        .into(),
                    });
                }
                let local_token = if le.target == last_local.0 {
                    last_local.1
                } else {
                    let t = self.region_token(le, slot, lkind, Some(slot) == lfirst, k)?;
                    last_local = (le.target, t);
                    t
                };
                let remote_token = match endpoint {
                    Endpoint::Local if re.target == last_remote.0 => last_remote.1,
                    Endpoint::Local => {
                        let t = self.region_token(re, slot, rkind, Some(slot) == rfirst, k)?;
                        last_remote = (re.target, t);
                        t
                    }
                    Endpoint::Peer(peer) => {
                        if Some(slot) == rfirst {
                            re.target
                        } else {
                            self.peer_token(peer, slot, rkind, re.desc, k)?
                        }
                    }
                };
                bytes += le.desc.len;
                push_merged(
                    &mut ranges,
                    Range {
                        local_addr: le.desc.addr,
                        remote_addr: re.desc.addr,
                        len: le.desc.len,
                        local_dev: le.desc.dev,
                        remote_dev: re.desc.dev,
                        local_token,
                        remote_token,
                    },
                );
            }
            Ok(())
        })();
        let built = built.and_then(|()| {
            let backend = self.backends.backends[slot]
                .as_ref()
                .expect("chosen slot is filled");
            backend.validate(
                endpoint,
                &Post {
                    tag: 0,
                    op,
                    local_kind: lkind,
                    remote_kind: rkind,
                    ranges: &ranges,
                    notif,
                },
            )
        });
        if let Err(e) = built {
            self.xfers.range_pool.push(ranges);
            return Err(e);
        }
        let mut payload = self.xfers.notif_pool.pop().unwrap_or_default();
        payload.clear();
        if let Some(p) = notif {
            payload.extend_from_slice(p);
        }
        let telemetry = crate::world::Telemetry {
            total_bytes: bytes,
            desc_count: ranges.len() as u64,
            desc_count_unmerged: n as u64,
            ..Default::default()
        };
        let x = &mut self.xfers;
        let (id, _) = x.rows.push();
        x.ops.push(op);
        x.slots.push(slot as u8);
        x.endpoints.push(endpoint);
        x.generations.push(generation);
        x.kinds.push((lkind, rkind));
        x.ranges.push(ranges);
        x.notifs.push(payload);
        x.has_notif.push(notif.is_some());
        x.states.push(XferState::NotPosted);
        x.telemetry.push(telemetry);
        Ok(id)
    }

    #[inline]
    fn region_token(
        &self,
        entry: PrepEntry,
        slot: usize,
        kind: MemKind,
        first_slot: bool,
        k: usize,
    ) -> Result<u64, Error> {
        let region: RegionId = handle_from_tag(entry.target);
        let row = match self.regions.row(region) {
            Some(row) if self.regions.backends[row].contains(slot) => row,
            Some(_) if !first_slot => {
                // Another region covers the descriptor for this backend.
                let other = self.sections[slot][kind as usize]
                    .covering(entry.desc)
                    .ok_or(Error::NotFound {
                        subject: desc_subject(k, entry.desc),
                    })?;
                self.regions.row(other).ok_or(Error::NotFound {
                    subject: Subject::Region(other),
                })?
            }
            _ => {
                return Err(Error::NotFound {
                    subject: Subject::Named(
                        format!("region {region:?} of descriptor #{k} (deregistered after prep)")
                            .into(),
                    ),
                })
            }
        };
        Ok(self.regions.tokens[row][slot])
    }

    fn peer_token(
        &self,
        peer: PeerId,
        slot: usize,
        kind: MemKind,
        desc: Desc,
        k: usize,
    ) -> Result<u64, Error> {
        let row = self
            .peers
            .rows
            .row(peer)
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        let view = self.peers.views[row]
            .as_ref()
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        let index =
            self.peers.slot_maps[row][slot].ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        view.find(index, kind, desc).ok_or(Error::NotFound {
            subject: desc_subject(k, desc),
        })
    }

    fn check_peer_generation(&self, peer: PeerId, generation: u32) -> Result<(), Error> {
        let row = self
            .peers
            .rows
            .row(peer)
            .ok_or_else(|| Error::not_found(Subject::Peer(peer)))?;
        if self.peers.generations[row] != generation || self.peers.views[row].is_none() {
            return Err(Error::NotFound {
                subject: Subject::PeerName(format!(
                    "{} (metadata generation {generation} was invalidated or reloaded; now {})",
                    self.peers.names[row], self.peers.generations[row]
                )),
            });
        }
        Ok(())
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
        let accepted = (|| {
            let id = resolve(&cmds.outcomes, xfer)?;
            let row = world
                .xfers
                .rows
                .row(id)
                .ok_or_else(|| Error::not_found(Subject::Xfer(id)))?;
            // A request posted earlier in this buffer is already marked in progress,
            // so a second post of it is refused like any repost of an active request.
            if world.xfers.states[row] == XferState::InProgress {
                return Err(Error::RepostActive { xfer: id });
            }
            if let Endpoint::Peer(peer) = world.xfers.endpoints[row] {
                world.check_peer_generation(peer, world.xfers.generations[row])?;
            }
            world.xfers.states[row] = XferState::InProgress;
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
        })();
        match accepted {
            Ok(p) => posted.push(p),
            Err(e) => cmds.outcomes[i as usize] = Outcome::Failed(e),
        }
    }
    posted.sort_unstable_by_key(|p| p.key);

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
        let backend = world.backends.backends[slot]
            .as_mut()
            .expect("request slot is filled");
        // SAFETY: every range was resolved by `make` against the section index, so its
        // local side (and a local transfer's remote side) lies inside a region registered
        // with this backend under the range's token; `deregister_region` refuses while
        // the request is in flight, so those regions stay registered, and their memory
        // valid by `register`'s promise, until the request's completion is routed.
        let result = unsafe { backend.post(endpoint, &batch, &mut world.completions) };
        drop(batch);
        let post_duration = t0.map(|t| t.elapsed()).unwrap_or_default();
        for p in group {
            let row = p.row as usize;
            match &result {
                Ok(()) => {
                    world.xfers.states[row] = XferState::InProgress;
                    if let Some(t0) = t0 {
                        let t = &mut world.xfers.telemetry[row];
                        t.start = Some(t0);
                        t.post_duration = post_duration;
                        t.xfer_duration = Default::default();
                    }
                }
                Err(e) => {
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
        let result =
            resolve(&cmds.outcomes, xfer).and_then(|id| world.xfer_state(id).map(status_outcome));
        set(cmds, i, result);
    }
    routed
}

fn status_outcome(state: &XferState) -> Outcome {
    match state {
        XferState::NotPosted => Outcome::Status(XferStatus::NotPosted),
        XferState::InProgress => Outcome::Status(XferStatus::InProgress),
        XferState::Done => Outcome::Status(XferStatus::Done),
        XferState::Failed(e) => Outcome::Failed(e.clone()),
    }
}

impl World {
    /// Drive every backend once and route completions to their requests. Returns how
    /// many completions were routed. Never blocks.
    pub fn progress(&mut self) -> u32 {
        for slot in 0..MAX_BACKENDS {
            if let Some(backend) = self.backends.backends[slot].as_mut() {
                backend.progress(&mut self.completions);
            }
        }
        let mut routed = 0;
        let now = self.bounds.telemetry.then(Instant::now);
        let mut completions = std::mem::take(&mut self.completions);
        for c in completions.as_slice() {
            routed += u32::from(self.route(*c, now));
        }
        completions.clear();
        self.completions = completions;
        routed
    }

    /// Name the remote target of range `range` of request `row`, if its backend can.
    fn failure_target(&self, row: usize, range: Option<u32>) -> Option<String> {
        let r = self.xfers.ranges[row].get(range? as usize)?;
        let slot = usize::from(self.xfers.slots[row]);
        let kind = self.xfers.kinds[row].1;
        self.backends.backends[slot]
            .as_ref()?
            .describe_target(kind, r.remote_token)
    }

    fn route(&mut self, c: Completion, now: Option<Instant>) -> bool {
        let id: XferId = handle_from_tag(c.tag);
        let Some(row) = self.xfers.rows.row(id) else {
            return false;
        };
        if self.xfers.states[row] != XferState::InProgress {
            return false;
        }
        self.xfers.states[row] = match c.result {
            Ok(()) => XferState::Done,
            Err(f) => {
                let slot = usize::from(self.xfers.slots[row]);
                let backend = self.slot_name(slot).unwrap_or("?");
                XferState::Failed(match f.kind {
                    FailureKind::RemoteDisconnect => {
                        let subject = match self.xfers.endpoints[row] {
                            Endpoint::Peer(p) => self
                                .peer_name(p)
                                .map(|n| Subject::PeerName(n.to_string()))
                                .unwrap_or(Subject::Peer(p)),
                            Endpoint::Local => Subject::Named("the local agent".into()),
                        };
                        Error::RemoteDisconnect { subject }
                    }
                    FailureKind::Canceled => Error::Canceled { xfer: id },
                    FailureKind::ShortRead => Error::Backend {
                        backend: backend.into(),
                        errno: f.errno,
                        desc: f.range,
                        detail: format!(
                            "short read: {} ended before the range did",
                            self.failure_target(row, f.range)
                                .unwrap_or_else(|| "the file".into())
                        )
                        .into(),
                    },
                    FailureKind::Backend => Error::Backend {
                        backend: backend.into(),
                        errno: f.errno,
                        desc: f.range,
                        detail: self
                            .failure_target(row, f.range)
                            .map_or("transfer failed".into(), |t| {
                                format!("transfer failed on {t}").into()
                            }),
                    },
                })
            }
        };
        if let (Some(now), Some(start)) = (now, self.xfers.telemetry[row].start) {
            self.xfers.telemetry[row].xfer_duration = now.saturating_duration_since(start);
        }
        true
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
                let result = resolve_side(&cmds.outcomes, to)
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

impl World {
    /// Send a standalone notification to a peer (`None` = to oneself) through the first
    /// backend that supports notifications and knows the peer.
    pub fn send_notification(&mut self, peer: Option<PeerId>, payload: &[u8]) -> Result<(), Error> {
        if payload.len() > self.bounds.notif_len_max {
            return Err(Error::Capacity {
                what: "notification bytes",
                limit: self.bounds.notif_len_max,
            });
        }
        let (endpoint, mask) = match peer {
            None => (Endpoint::Local, BackendMask::ALL),
            Some(p) => {
                let row = self
                    .peers
                    .rows
                    .row(p)
                    .ok_or_else(|| Error::not_found(Subject::Peer(p)))?;
                if self.peers.views[row].is_none() {
                    return Err(Error::NotFound {
                        subject: Subject::PeerName(format!(
                            "{} (metadata invalidated)",
                            self.peers.names[row]
                        )),
                    });
                }
                (Endpoint::Peer(p), self.peers.loaded[row])
            }
        };
        let slot = (0..MAX_BACKENDS)
            .find(|&s| mask.contains(s) && self.backends.caps[s].is_some_and(|c| c.notifications))
            .ok_or_else(|| Error::NotSupported {
                backend: "agent".into(),
                what: "no backend that supports notifications reaches this peer".into(),
            })?;
        self.backends.backends[slot]
            .as_mut()
            .expect("slot is filled")
            .notify(endpoint, payload)
    }

    /// Hand every inbound notification of every backend to `sink`.
    pub fn drain_notifications(&mut self, sink: &mut dyn NotifSink) -> usize {
        let mut n = 0;
        for (_, backend) in self.live_backends() {
            n += backend.drain_notifications(sink);
        }
        n
    }
}

// ---------------------------------------------------------------- 8. retire

fn phase_retire(world: &mut World, cmds: &mut CommandBuffer, bucket: &[u32]) {
    phase_span!("ferry::retire");
    for &i in bucket {
        let result = match cmds.commands[i as usize] {
            Command::Release {
                what: Releasable::Xfer(x),
            } => resolve(&cmds.outcomes, x).and_then(|x| world.release_xfer(x)),
            Command::Release {
                what: Releasable::Prep(p),
            } => resolve(&cmds.outcomes, p).and_then(|p| world.release_prep(p)),
            Command::Deregister { region } => {
                resolve(&cmds.outcomes, region).and_then(|r| world.deregister_region(r))
            }
            _ => unreachable!("classified as retire"),
        };
        set(cmds, i, result.map(|()| Outcome::Done));
    }
}

impl World {
    /// Release a request. An in-flight request is canceled if its backend can; otherwise
    /// the release is refused and the request stays.
    pub fn release_xfer(&mut self, id: XferId) -> Result<(), Error> {
        let row = self
            .xfers
            .rows
            .row(id)
            .ok_or_else(|| Error::not_found(Subject::Xfer(id)))?;
        if self.xfers.states[row] == XferState::InProgress {
            let slot = usize::from(self.xfers.slots[row]);
            let backend = self.backends.backends[slot]
                .as_mut()
                .expect("request slot is filled");
            if !backend.cancel(handle_to_tag(id))? {
                return Err(Error::NotAllowed {
                    subject: Subject::Xfer(id),
                    reason: "in progress and its backend cannot cancel it; check until done, then release".into(),
                });
            }
        }
        let x = &mut self.xfers;
        let row = x.rows.remove(id).expect("row checked above");
        x.ops.swap_remove(row);
        x.slots.swap_remove(row);
        x.endpoints.swap_remove(row);
        x.generations.swap_remove(row);
        x.kinds.swap_remove(row);
        let ranges = x.ranges.swap_remove(row);
        x.range_pool.push(ranges);
        let notif = x.notifs.swap_remove(row);
        x.notif_pool.push(notif);
        x.has_notif.swap_remove(row);
        x.states.swap_remove(row);
        x.telemetry.swap_remove(row);
        Ok(())
    }
}
