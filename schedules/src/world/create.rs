//! One-shot `create` in one pass: both raw lists are resolved and merged into the
//! request's ranges pair by pair, with no prepared entries in between.
//!
//! `create` is `prep` of both lists, `make` of every pair in order, and the release of
//! both lists. Done that way, each descriptor is written out as a prepared entry
//! (32 bytes a side) and read back by `make`: at 256k descriptors those tables are
//! 16 MiB that go to memory and come back, against a 32 MiB L3 other processes share,
//! and `create` costs several times more per descriptor than at 16k. The fused pass
//! reads each pair once and writes only its range.
//!
//! It takes the usual case only: each list has one candidate backend slot, the same
//! one. Anything else, and any check that fails on the way, goes back to the three-step
//! path, which gives the same request or names the same error as ever (the fused pass
//! has changed nothing when it gives up: its vectors go back to their pools).

use ferry_backend_api::Range;
use ferry_storage::{
    handle_to_tag, BackendMask, Desc, Endpoint, MemKind, Op, PeerId, RegionId, XferId,
};

use super::xfers::XferParts;
use super::{Hit, World};
use crate::merge::merge_into;

/// What the fused pass resolves a remote descriptor against.
enum RemoteSide {
    /// The local agent's regions (a request to oneself): tokens and pins like the
    /// local side's.
    Local,
    /// A loaded peer at `row`, its backend index `index` for the slot.
    Peer { peer: PeerId, row: usize, index: u8 },
}

impl World {
    /// `create` of `local` (of `lkind`, local regions) ↔ `remote` (of `rkind`, the
    /// peer's regions or, for `None`, local ones) in one pass, or `None` where this
    /// pass does not apply or any check fails (the caller then takes prep + make).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create_fused(
        &mut self,
        op: Op,
        lkind: MemKind,
        local: &[Desc],
        peer: Option<PeerId>,
        rkind: MemKind,
        remote: &[Desc],
        notif: Option<&[u8]>,
        hint: BackendMask,
    ) -> Option<XferId> {
        let n = local.len();
        let max = self.bounds.descs_per_list_max;
        if n == 0 || n != remote.len() || n > max || self.preps.len() + 2 > self.bounds.preps_max {
            return None;
        }
        if self.xfers.len() >= self.bounds.xfers_max
            || notif.is_some_and(|p| p.len() > self.bounds.notif_len_max)
        {
            return None;
        }
        let lmask = self.local_mask(lkind, hint);
        let slot = lmask.first()?;
        if lmask != BackendMask::single(slot) {
            return None;
        }
        let (side, rmask, endpoint, generation) = match peer {
            None => (
                RemoteSide::Local,
                self.local_mask(rkind, hint),
                Endpoint::Local,
                0,
            ),
            Some(p) => {
                let row = self.peers.row(p)?;
                self.peers.views[row].as_ref()?;
                let index = self.peers.slot_maps[row][slot]?;
                (
                    RemoteSide::Peer {
                        peer: p,
                        row,
                        index,
                    },
                    self.peer_mask(row, rkind, hint),
                    Endpoint::Peer(p),
                    self.peers.generations[row],
                )
            }
        };
        if rmask != lmask {
            return None;
        }
        let caps = self.backends.caps[slot]?;
        let reachable = match endpoint {
            Endpoint::Local => caps.local,
            Endpoint::Peer(_) => caps.remote,
        };
        if !reachable || (notif.is_some() && !caps.notifications) {
            return None;
        }
        let mut ranges = self.pools.ranges.pop().unwrap_or_default();
        ranges.clear();
        ranges.reserve(n);
        let mut pins = self.pools.pins.pop().unwrap_or_default();
        pins.clear();
        let filled = match side {
            RemoteSide::Local => {
                let sections = &self.sections[slot][rkind as usize];
                self.fill_fused(slot, lkind, local, remote, &mut ranges, &mut pins, |d| {
                    let (region, dev, start, end) = sections.covering_bounds(d)?;
                    Some((
                        handle_to_tag(region),
                        Desc::new(start, end - start, dev),
                        true,
                    ))
                })
            }
            RemoteSide::Peer { peer, row, index } => {
                let view = self.peers.views[row].as_ref()?;
                let backend = self.backends.backends[slot].as_ref()?;
                // The region after the last one found is tried first.
                let mut last = u64::MAX;
                self.fill_fused(slot, lkind, local, remote, &mut ranges, &mut pins, |d| {
                    let (token, region) = view.find_bounds_after(index, rkind, d, last)?;
                    last = token;
                    backend
                        .reaches(peer, token)
                        .then_some((token, region, false))
                })
            }
        };
        let Some(bytes) = filled else {
            self.pools.ranges.push(ranges);
            self.pools.pins.push(pins);
            return None;
        };
        self.finish_xfer(
            XferParts {
                op,
                slot,
                endpoint,
                generation,
                kinds: (lkind, rkind),
                descs: n,
            },
            Ok(bytes),
            ranges,
            pins,
            notif,
        )
        .ok()
    }

    /// The fused pass proper: for each pair, the checks prep and make do (non-empty,
    /// not wrapping, covered, equal lengths), a region lookup only where a descriptor
    /// leaves the last region found on its side, and the merge step of
    /// [`World::fill_ranges`] (so the ranges are the ones `make` builds). `lookup`
    /// gives a remote descriptor's (value, covering region, whether the value is a
    /// local region's tag to resolve and pin). Returns the bytes of all pairs, or
    /// `None` at the first problem.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn fill_fused(
        &self,
        slot: usize,
        lkind: MemKind,
        local: &[Desc],
        remote: &[Desc],
        ranges: &mut Vec<Range>,
        pins: &mut Vec<RegionId>,
        mut lookup: impl FnMut(Desc) -> Option<(u64, Desc, bool)>,
    ) -> Option<u64> {
        let lsections = &self.sections[slot][lkind as usize];
        let (mut lhit, mut rhit) = (Hit::NONE, Hit::NONE);
        // Tokens of the regions last hit on each side.
        let (mut ltoken, mut rtoken) = (0u64, 0u64);
        let mut cur: Option<Range> = None;
        let mut bytes = 0u64;
        for (&ld, &rd) in local.iter().zip(remote) {
            let len = ld.len;
            if len == 0 || len != rd.len {
                return None;
            }
            if !lhit.covers(ld) {
                // (`covering_bounds` refuses a wrapping descriptor.)
                let (region, dev, start, end) = lsections.covering_bounds(ld)?;
                let tag = handle_to_tag(region);
                // A new lookup that finds the region of the last one is the same run
                // of `make` (no new pin), as there.
                if tag != lhit.value || lhit.end < lhit.start {
                    ltoken = self.region_slot_token(region, slot)?;
                    pins.push(region);
                }
                lhit = Hit {
                    dev,
                    start,
                    end,
                    value: tag,
                };
            }
            if !rhit.covers(rd) {
                rd.end()?;
                let (value, region, local_region) = lookup(rd)?;
                let changed = value != rhit.value || rhit.end < rhit.start;
                if changed {
                    rtoken = if local_region {
                        let region: RegionId = ferry_storage::handle_from_tag(value);
                        let t = self.region_slot_token(region, slot)?;
                        pins.push(region);
                        t
                    } else {
                        value
                    };
                }
                rhit = Hit {
                    dev: region.dev,
                    start: region.addr,
                    end: region.addr.saturating_add(region.len),
                    value,
                };
            }
            bytes = bytes.wrapping_add(len);
            let next = Range {
                local_addr: ld.addr,
                remote_addr: rd.addr,
                len,
                local_dev: ld.dev,
                remote_dev: rd.dev,
                local_token: ltoken,
                remote_token: rtoken,
            };
            match &mut cur {
                Some(c) => merge_into(ranges, c, next),
                None => cur = Some(next),
            }
        }
        ranges.extend(cur);
        Some(bytes)
    }

    /// The token of local region `region` for `slot`, if it is registered with it.
    #[inline]
    fn region_slot_token(&self, region: RegionId, slot: usize) -> Option<u64> {
        let row = self.regions.row(region)?;
        self.regions.backends[row]
            .contains(slot)
            .then(|| self.regions.tokens[row][slot])
    }
}
