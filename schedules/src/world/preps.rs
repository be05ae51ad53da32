//! Prepared lists: descriptor lists resolved once against sections.
//!
//! A local list's entries carry the covering region's handle; a deregistration after
//! prep makes the handle stale, so `make` refuses the list with [`Error::StaleRegion`]
//! naming the region (nothing reaches a backend).

use ferry_storage::{
    handle_to_tag, BackendMask, Desc, Error, MemKind, PeerId, PrepId, StridedDesc, Subject,
    MAX_BACKENDS,
};

use super::{Hit, World};

/// Which agent a prepared list belongs to, and the peer generation it was built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrepSide {
    /// Local regions.
    Local,
    /// A peer's regions, resolved against generation `generation`.
    Peer {
        /// The peer.
        peer: PeerId,
        /// Its generation at prep time.
        generation: u32,
    },
}

/// One resolved descriptor of a prepared list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrepEntry {
    /// The descriptor.
    pub desc: Desc,
    /// Local: the covering region's handle as a tag. Peer: the region token for the
    /// first backend slot of the list's mask.
    pub target: u64,
}

/// A run of a strided prepared list: `run.count` descriptors, `run.stride` bytes
/// apart, that all lie in one region (so share one target), the first of them at
/// position `start` of the list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrepRun {
    /// The run's descriptors.
    pub run: StridedDesc,
    /// Their target, as [`PrepEntry::target`].
    pub target: u64,
    /// Position of the run's first descriptor in the list.
    pub start: u64,
}

/// A prepared list's descriptors as `make` reads them: one entry per descriptor (a
/// plain list), or runs (a strided list that resolved run by run).
#[derive(Clone, Copy, Debug)]
pub(crate) enum EntriesView<'a> {
    /// One entry per descriptor.
    Plain(&'a [PrepEntry]),
    /// Runs (non-empty, in list order).
    Runs(&'a [PrepRun]),
}

impl<'a> EntriesView<'a> {
    /// Number of descriptors.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        match self {
            EntriesView::Plain(entries) => entries.len(),
            EntriesView::Runs(runs) => runs.last().map_or(0, |r| (r.start + r.run.count) as usize),
        }
    }

    /// Entry `i` (`i < len`, which `make` checked): a binary search over the runs of a
    /// strided list.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> PrepEntry {
        match self {
            EntriesView::Plain(entries) => entries[i],
            EntriesView::Runs(runs) => {
                let i = i as u64;
                let r = &runs[runs.partition_point(|r| r.start <= i) - 1];
                PrepEntry {
                    desc: r.run.desc(i - r.start),
                    target: r.target,
                }
            }
        }
    }

    /// Every entry, in order.
    #[inline]
    pub(crate) fn iter(&self) -> EntryIter<'a> {
        match self {
            EntriesView::Plain(entries) => EntryIter::Plain(entries.iter()),
            EntriesView::Runs(runs) => EntryIter::Runs {
                runs: runs.iter(),
                addr: 0,
                left: 0,
                stride: 0,
                len: 0,
                dev: 0,
                target: 0,
            },
        }
    }
}

/// The entries of an [`EntriesView`], by value: a strided list's are computed from its
/// runs (one add per descriptor), never stored.
pub(crate) enum EntryIter<'a> {
    /// A plain list's stored entries.
    Plain(std::slice::Iter<'a, PrepEntry>),
    /// Runs: the one being walked (`left` entries to go, the next at `addr`). Its
    /// fields are kept apart, not as a `PrepEntry` updated in place and copied out:
    /// that copy read back 16 bytes written as two 8-byte halves, a store-forwarding
    /// stall per descriptor (88 % of a 64 × 1,024 strided `make` over UCX in `perf`).
    Runs {
        runs: std::slice::Iter<'a, PrepRun>,
        addr: u64,
        left: u64,
        stride: u64,
        len: u64,
        dev: u64,
        target: u64,
    },
}

impl Iterator for EntryIter<'_> {
    type Item = PrepEntry;

    #[inline]
    fn next(&mut self) -> Option<PrepEntry> {
        match self {
            EntryIter::Plain(it) => it.next().copied(),
            EntryIter::Runs {
                runs,
                addr,
                left,
                stride,
                len,
                dev,
                target,
            } => {
                if *left == 0 {
                    let r = runs.next()?;
                    *addr = r.run.base;
                    *left = r.run.count;
                    *stride = r.run.stride;
                    *len = r.run.len;
                    *dev = r.run.dev;
                    *target = r.target;
                }
                let at = *addr;
                *addr = at.wrapping_add(*stride);
                *left -= 1;
                Some(PrepEntry {
                    desc: Desc::new(at, *len, *dev),
                    target: *target,
                })
            }
        }
    }
}

ferry_storage::table! {
    /// Prepared lists, one row per list.
    pub struct PrepTable[PrepId] / PrepRow {
        /// Local or a peer (with generation), indexed by row.
        pub(crate) sides: PrepSide,
        /// Memory kind, indexed by row.
        pub(crate) kinds: MemKind,
        /// Backend slots that cover every descriptor, indexed by row.
        pub(crate) masks: BackendMask,
        /// Resolved descriptors, indexed by row (empty for a list kept as runs).
        pub(crate) entries: Vec<PrepEntry>,
        /// A strided list's resolved runs, indexed by row (empty for a plain list;
        /// a list has entries or runs, never both).
        pub(crate) runs: Vec<PrepRun>,
        /// Whether every entry lies in one region of the first slot of `masks` (one
        /// target, one device), indexed by row.
        pub(crate) single_region: bool,
    }
}

impl PrepTable {
    /// The descriptors of the list at `row`.
    #[inline]
    pub(crate) fn view(&self, row: usize) -> EntriesView<'_> {
        if self.runs[row].is_empty() {
            EntriesView::Plain(&self.entries[row])
        } else {
            EntriesView::Runs(&self.runs[row])
        }
    }
}

pub(crate) fn desc_subject(index: usize, d: Desc) -> ferry_storage::Subject {
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
/// Also says whether every descriptor lies in one region of that slot (one lookup only,
/// so one target and one device for the whole list: `make` then resolves the list's
/// tokens once). With more than one candidate slot it answers `false` (not computed).
///
/// `Err(None)` means every descriptor was covered by some slot but no one slot covers
/// them all.
/// The runs of a strided list, each split where its descriptors change region, into
/// `out`: `lookup(desc)` gives the covering region's target and range. Returns whether
/// every descriptor lies in one region (one target for the whole list), or `None` when
/// a descriptor is not covered.
fn split_runs(
    runs: &[StridedDesc],
    out: &mut Vec<PrepRun>,
    lookup: impl Fn(Desc) -> Option<(u64, Desc)>,
) -> Option<bool> {
    let mut start = 0u64;
    let mut first_target = None;
    let mut single = true;
    let mut push = |out: &mut Vec<PrepRun>, run: StridedDesc, target: u64, start: u64| {
        single &= *first_target.get_or_insert(target) == target;
        out.push(PrepRun { run, target, start });
    };
    for run in runs {
        let (target, region) = lookup(run.desc(0))?;
        let hit = Hit {
            dev: region.dev,
            start: region.addr,
            end: region.addr.saturating_add(region.len),
            value: target,
        };
        if hit.covers(run.desc(run.count - 1)) {
            // Descriptors go up from the first to the last: all lie in the region.
            push(out, *run, target, start);
            start += run.count;
            continue;
        }
        // Crosses regions: walk it, a new piece where the region changes.
        let (mut hit, mut piece) = (hit, StridedDesc { count: 0, ..*run });
        for k in 0..run.count {
            let d = run.desc(k);
            if !hit.covers(d) {
                let (target, region) = lookup(d)?;
                if piece.count > 0 {
                    push(out, piece, hit.value, start);
                    start += piece.count;
                }
                piece = StridedDesc {
                    base: d.addr,
                    count: 0,
                    ..*run
                };
                hit = Hit {
                    dev: region.dev,
                    start: region.addr,
                    end: region.addr.saturating_add(region.len),
                    value: target,
                };
            }
            piece.count += 1;
        }
        push(out, piece, hit.value, start);
        start += piece.count;
    }
    Some(single)
}

fn resolve_descs(
    descs: &[Desc],
    mut mask: BackendMask,
    out: &mut Vec<PrepEntry>,
    lookup: impl Fn(usize, Desc) -> Option<(u64, Desc)>,
) -> Result<(BackendMask, bool), Option<Error>> {
    out.reserve(descs.len());
    let start = out.len();
    let Some(mut recorded) = mask.first() else {
        return Err(None);
    };
    if mask == BackendMask::single(recorded) {
        // One candidate slot (the usual case): one remembered region, no slot loop.
        // Each lookup is followed by the run of descriptors its region covers: found by
        // a read-only scan, then written in one pass with no per-entry branch. A
        // non-empty descriptor inside the remembered region cannot wrap (its end is at
        // most the region's), so the scan is one test per descriptor.
        let mut lookups = 0u32;
        let mut i = 0;
        while let Some(&d) = descs.get(i) {
            if d.len == 0 || d.end().is_none() {
                return Err(Some(Error::invalid(
                    desc_subject(i, d),
                    "empty or wrapping descriptor",
                )));
            }
            lookups = lookups.saturating_add(1);
            let Some((value, region)) = lookup(recorded, d) else {
                return Err(Some(Error::NotFound {
                    subject: desc_subject(i, d),
                }));
            };
            let hit = Hit {
                dev: region.dev,
                start: region.addr,
                end: region.addr.saturating_add(region.len),
                value,
            };
            // `d` itself is taken whatever `covers` says of it (the lookup found it).
            let rest = &descs[i + 1..];
            let run = 1 + rest
                .iter()
                .position(|d| d.len == 0 || !hit.covers(*d))
                .unwrap_or(rest.len());
            out.extend(descs[i..i + run].iter().map(|&desc| PrepEntry {
                desc,
                target: value,
            }));
            i += run;
        }
        return Ok((mask, lookups == 1));
    }
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
    Ok((mask, false))
}

impl World {
    /// Resolve `descs` (all of `kind`) against the local sections (`peer` = None) or a
    /// peer's published sections, once.
    pub(crate) fn prep_list(
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
        if self.preps.len() >= self.bounds.preps_max {
            return Err(Error::Capacity {
                what: "prepared lists",
                limit: self.bounds.preps_max,
            });
        }
        let mut entries = self.pools.entries.pop().unwrap_or_default();
        entries.clear();
        let result = match peer {
            None => self
                .resolve_local(kind, descs, hint, &mut entries)
                .map(|found| (PrepSide::Local, found)),
            Some(p) => self.resolve_peer(p, kind, descs, hint, &mut entries),
        };
        match result {
            Ok((side, (mask, single_region))) => {
                let runs = self.pools.runs.pop().unwrap_or_default();
                Ok(self.preps.insert(PrepRow {
                    sides: side,
                    kinds: kind,
                    masks: mask,
                    entries,
                    runs,
                    single_region,
                }))
            }
            Err(e) => {
                self.pools.entries.push(entries);
                Err(e)
            }
        }
    }

    /// [`World::prep_list`] of the list made of `runs`' descriptors, run after run.
    ///
    /// Each run is checked first (non-empty, no descriptor wrapping the address space,
    /// the total within `descs_per_list_max`), naming the run. Where the list has one
    /// candidate backend slot (the usual case), it is resolved run by run and kept as
    /// runs ([`PrepRun`]): a run whose first and last descriptors lie in one region
    /// lies there whole (its descriptors go up by `stride` from the first), so it costs
    /// one lookup and no per-descriptor work; a run that crosses regions is walked and
    /// split where the region changes. Otherwise (several candidate slots, or any
    /// descriptor not found), its descriptors are written to a scratch list the world
    /// keeps and resolved as a plain list, which gives the same list or names the same
    /// error as the plain list of those descriptors.
    pub(crate) fn prep_strided(
        &mut self,
        peer: Option<PeerId>,
        kind: MemKind,
        runs: &[StridedDesc],
        hint: BackendMask,
    ) -> Result<PrepId, Error> {
        let mut total: u64 = 0;
        for (r, run) in runs.iter().enumerate() {
            let subject = || Subject::Named(format!("strided run #{r}: {run:?}").into());
            if run.count == 0 || run.len == 0 {
                return Err(Error::invalid(
                    subject(),
                    "a strided run needs count and len of at least 1",
                ));
            }
            if run.end().is_none() {
                return Err(Error::invalid(
                    subject(),
                    "a descriptor of the run wraps the address space",
                ));
            }
            total = total.saturating_add(run.count);
        }
        if total > self.bounds.descs_per_list_max as u64 {
            return Err(Error::Capacity {
                what: "descriptors per list",
                limit: self.bounds.descs_per_list_max,
            });
        }
        if !runs.is_empty() && self.preps.len() < self.bounds.preps_max {
            let mut resolved = self.pools.runs.pop().unwrap_or_default();
            resolved.clear();
            match self.resolve_runs(peer, kind, runs, hint, &mut resolved) {
                Some((side, mask, single_region)) => {
                    let entries = self.pools.entries.pop().unwrap_or_default();
                    return Ok(self.preps.insert(PrepRow {
                        sides: side,
                        kinds: kind,
                        masks: mask,
                        entries,
                        runs: resolved,
                        single_region,
                    }));
                }
                None => self.pools.runs.push(resolved),
            }
        }
        let mut descs = std::mem::take(&mut self.pools.strided_descs);
        descs.clear();
        descs.reserve(total as usize);
        for run in runs {
            descs.extend(run.descs());
        }
        let result = self.prep_list(peer, kind, &descs, hint);
        self.pools.strided_descs = descs;
        result
    }

    /// Resolve checked, non-empty `runs` run by run into `out` where the list has one
    /// candidate slot: (side, mask, whether every descriptor lies in one region), or
    /// `None` where that does not apply or a descriptor is not found (the caller then
    /// resolves the plain list, which names the error).
    fn resolve_runs(
        &self,
        peer: Option<PeerId>,
        kind: MemKind,
        runs: &[StridedDesc],
        hint: BackendMask,
        out: &mut Vec<PrepRun>,
    ) -> Option<(PrepSide, BackendMask, bool)> {
        match peer {
            None => {
                let mask = self.local_mask(kind, hint);
                let slot = mask.first()?;
                if mask != BackendMask::single(slot) {
                    return None;
                }
                let sections = &self.sections[slot][kind as usize];
                let single = split_runs(runs, out, |d| {
                    sections
                        .covering_bounds(d)
                        .map(|(region, dev, start, end)| {
                            (handle_to_tag(region), Desc::new(start, end - start, dev))
                        })
                })?;
                Some((PrepSide::Local, mask, single))
            }
            Some(p) => {
                let row = self.peers.row(p)?;
                let view = self.peers.views[row].as_ref()?;
                let mask = self.peer_mask(row, kind, hint);
                let slot = mask.first()?;
                if mask != BackendMask::single(slot) {
                    return None;
                }
                let index = self.peers.slot_maps[row][slot]?;
                let backend = self.backends.backends[slot].as_ref()?;
                let single = split_runs(runs, out, |d| {
                    let found = view.find_bounds(index, kind, d)?;
                    backend.reaches(p, found.0).then_some(found)
                })?;
                let side = PrepSide::Peer {
                    peer: p,
                    generation: self.peers.generations[row],
                };
                Some((side, mask, single))
            }
        }
    }

    /// The backend slots a local list of `kind` may resolve against: hinted, supporting
    /// the kind, with regions of it.
    pub(crate) fn local_mask(&self, kind: MemKind, hint: BackendMask) -> BackendMask {
        let mut mask = BackendMask::EMPTY;
        for slot in hint.iter() {
            if self.backends.caps[slot].is_some_and(|c| c.supports(kind))
                && !self.sections[slot][kind as usize].is_empty()
            {
                mask.insert(slot);
            }
        }
        mask
    }

    /// The backend slots a list of `kind` naming the regions of the peer at `row` may
    /// resolve against: loaded for the peer, hinted, remote-capable, supporting the kind.
    pub(crate) fn peer_mask(&self, row: usize, kind: MemKind, hint: BackendMask) -> BackendMask {
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
        mask
    }

    fn resolve_local(
        &self,
        kind: MemKind,
        descs: &[Desc],
        hint: BackendMask,
        out: &mut Vec<PrepEntry>,
    ) -> Result<(BackendMask, bool), Error> {
        let mask = self.local_mask(kind, hint);
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
    ) -> Result<(PrepSide, (BackendMask, bool)), Error> {
        let row = self
            .peers
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
        let mask = self.peer_mask(row, kind, hint);
        let backends = &self.backends.backends;
        let found = resolve_descs(descs, mask, out, |slot, d| {
            let found = view.find_bounds(slot_map[slot]?, kind, d)?;
            // A backend that cannot reach this region of the peer drops out here, so a
            // list naming it goes to another common backend.
            backends[slot]
                .as_ref()
                .is_some_and(|b| b.reaches(peer, found.0))
                .then_some(found)
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
            found,
        ))
    }

    /// Release a prepared list.
    pub(crate) fn release_prep(&mut self, id: PrepId) -> Result<(), Error> {
        let row = self
            .preps
            .remove(id)
            .ok_or_else(|| Error::not_found(Subject::Prep(id)))?;
        self.pools.entries.push(row.entries);
        self.pools.runs.push(row.runs);
        Ok(())
    }

    /// Number of descriptors in a prepared list.
    pub fn prep_len(&self, id: PrepId) -> Result<usize, Error> {
        let row = self
            .preps
            .row(id)
            .ok_or_else(|| Error::not_found(Subject::Prep(id)))?;
        Ok(self.preps.view(row).len())
    }
}
