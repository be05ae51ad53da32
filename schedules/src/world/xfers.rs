//! Transfer requests: building (make), completion routing, draining, release.
//!
//! # Lifecycle
//!
//! ```text
//! make ──▶ NotPosted ──post──▶ InProgress ──completion──▶ Done | Failed
//!                                  │
//!                                  └─peer invalidated / reloaded──▶ Draining ──completion──▶ Failed
//! ```
//!
//! A request pins every local region it names (its local side, and its target side when
//! the target is the local agent) from `make` until `release`: the region's pin count
//! makes `deregister` refuse, so no posted range can outlive its registration (O(1) per
//! deregistration, O(regions named) per make and release; nothing is scanned).
//!
//! A request whose peer went away while it was in flight reports not-found at once, but
//! stays **draining** until its backend confirms the end (a `cancel` that returns
//! `Ok(true)`, or its one completion, which the backend contract promises for every
//! post). A draining request cannot be reposted or released, so its regions stay
//! registered while a NIC or kernel may still touch them.

use std::time::{Duration, Instant};

use ferry_backend_api::{Completion, FailureKind, Post, Range};
use ferry_storage::{
    handle_from_tag, handle_to_tag, BackendMask, Desc, Endpoint, Error, MemKind, Op, PeerId,
    PrepId, RegionId, Subject, XferId, MAX_BACKENDS,
};

use super::preps::{desc_subject, EntriesView, PrepEntry, PrepSide};
use super::World;
use crate::merge::merge_into;

/// Request telemetry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Telemetry {
    /// When the last post started.
    pub start: Option<Instant>,
    /// Time spent in the post call (dispatch to the backend).
    pub post_duration: Duration,
    /// Time from post to completion (zero while in progress).
    pub xfer_duration: Duration,
    /// Bytes moved per post.
    pub total_bytes: u64,
    /// Descriptors after merging.
    pub desc_count: u64,
    /// Descriptors before merging.
    pub desc_count_unmerged: u64,
}

/// State of a request row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XferState {
    /// Never posted.
    NotPosted,
    /// Posted, completion pending.
    InProgress,
    /// Last post succeeded.
    Done,
    /// Last post failed.
    Failed(Error),
    /// Its peer went away while it was in flight: callers see the error, but the
    /// backend has not yet confirmed the end, so it can be neither reposted nor
    /// released (and its regions stay pinned) until its completion arrives.
    Draining(Error),
}

ferry_storage::table! {
    /// Transfer requests, one row per request.
    pub struct XferTable[XferId] / XferRow {
        /// Direction, indexed by row.
        pub(crate) ops: Op,
        /// Chosen backend slot, indexed by row.
        pub(crate) slots: u8,
        /// Target, indexed by row.
        pub(crate) endpoints: Endpoint,
        /// Peer generation the request was built against (0 for local), indexed by row.
        pub(crate) generations: u32,
        /// (local kind, remote kind), indexed by row.
        pub(crate) kinds: (MemKind, MemKind),
        /// Merged ranges, indexed by row.
        pub(crate) ranges: Vec<Range>,
        /// Notification payload, indexed by row (meaningful when `has_notif`).
        pub(crate) notifs: Vec<u8>,
        /// Whether the request carries a notification, indexed by row.
        pub(crate) has_notif: bool,
        /// Lifecycle state, indexed by row.
        pub(crate) states: XferState,
        /// Telemetry, indexed by row.
        pub(crate) telemetry: Telemetry,
        /// Local regions the request pins (one entry per run of descriptors in one
        /// region; a region may appear more than once), indexed by row.
        pub(crate) pins: Vec<RegionId>,
    }
}

/// Pair `k`'s remote descriptor `remote` is not `len` bytes long like its local one.
#[cold]
fn length_mismatch(k: usize, len: u64, remote: Desc) -> Error {
    Error::Mismatch {
        subject: desc_subject(k, remote),
        reason: format!(
            "length {} differs from the local descriptor's {len}",
            remote.len
        )
        .into(),
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

/// What a built request is, besides its ranges and pins ([`World::finish_xfer`]).
pub(crate) struct XferParts {
    pub(crate) op: Op,
    pub(crate) slot: usize,
    pub(crate) endpoint: Endpoint,
    pub(crate) generation: u32,
    pub(crate) kinds: (MemKind, MemKind),
    /// Descriptor pairs before merging.
    pub(crate) descs: usize,
}

/// What [`World::fill_ranges`] needs to know of the request, fixed for every pair.
struct Plan {
    slot: usize,
    lkind: MemKind,
    rkind: MemKind,
    /// Whether `slot` is the local list's first slot (its entries carry its regions).
    local_first: bool,
    remote: RemoteTokens,
}

/// Where the remote tokens of a request come from.
#[derive(Clone, Copy)]
enum RemoteTokens {
    /// Local target regions, resolved like the local side; `first`: `slot` is the
    /// remote list's first slot.
    Local { first: bool },
    /// A peer list whose first slot is the request's: the prepared entries carry them.
    Recorded,
    /// A peer list prepared for another first slot: looked up in the peer's view.
    Lookup(PeerId),
}

impl World {
    /// Build a request from two prepared lists and index lists (empty = all, in order).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn make_xfer(
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
            .row(local)
            .ok_or_else(|| Error::not_found(Subject::Prep(local)))?;
        let rrow = self
            .preps
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
        let (lview, rview) = (self.preps.view(lrow), self.preps.view(rrow));
        let local_len = lview.len();
        let remote_len = rview.len();
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
        if self.xfers.len() >= self.bounds.xfers_max {
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

        let mut ranges = self.pools.ranges.pop().unwrap_or_default();
        ranges.clear();
        ranges.reserve(n);
        let mut pins = self.pools.pins.pop().unwrap_or_default();
        pins.clear();
        // Plain lists as slices; the four index-list cases each get their own
        // monomorphic loop (no per-descriptor "all or indexed" branch, and no bounds
        // check at all when both sides take every entry in order). A list kept as runs
        // gives its entries from the runs (`EntriesView`).
        let plan = Plan {
            slot,
            lkind,
            rkind,
            local_first: Some(slot) == lfirst,
            remote: match endpoint {
                Endpoint::Local => RemoteTokens::Local {
                    first: Some(slot) == rfirst,
                },
                Endpoint::Peer(_) if Some(slot) == rfirst => RemoteTokens::Recorded,
                Endpoint::Peer(peer) => RemoteTokens::Lookup(peer),
            },
        };
        // Both lists in one region each, whose tokens the request's slot takes as
        // recorded: tokens and devices are the same for every pair, resolved once.
        let single = self.preps.single_region[lrow]
            && self.preps.single_region[rrow]
            && plan.local_first
            && matches!(
                plan.remote,
                RemoteTokens::Recorded | RemoteTokens::Local { first: true }
            );
        let out = (&mut ranges, &mut pins);
        macro_rules! fill {
            ($pairs:expr) => {
                if single {
                    self.fill_ranges_single(&plan, $pairs, out)
                } else {
                    self.fill_ranges(&plan, $pairs, out)
                }
            };
        }
        let all = (local_idx.is_empty(), remote_idx.is_empty());
        let built = match (lview, rview) {
            (EntriesView::Plain(lentries), EntriesView::Plain(rentries)) => match all {
                (true, true) => fill!(lentries.iter().copied().zip(rentries.iter().copied())),
                (true, false) => fill!(lentries
                    .iter()
                    .copied()
                    .zip(remote_idx.iter().map(|&i| rentries[i as usize]))),
                (false, true) => fill!(local_idx
                    .iter()
                    .map(|&i| lentries[i as usize])
                    .zip(rentries.iter().copied())),
                (false, false) => fill!(local_idx
                    .iter()
                    .map(|&i| lentries[i as usize])
                    .zip(remote_idx.iter().map(|&i| rentries[i as usize]))),
            },
            _ => match all {
                (true, true) => fill!(lview.iter().zip(rview.iter())),
                (true, false) => fill!(lview
                    .iter()
                    .zip(remote_idx.iter().map(|&i| rview.get(i as usize)))),
                (false, true) => fill!(local_idx
                    .iter()
                    .map(|&i| lview.get(i as usize))
                    .zip(rview.iter())),
                (false, false) => fill!(local_idx
                    .iter()
                    .map(|&i| lview.get(i as usize))
                    .zip(remote_idx.iter().map(|&i| rview.get(i as usize)))),
            },
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
            built,
            ranges,
            pins,
            notif,
        )
    }

    /// The end of [`World::make_xfer`] (and of a fused `create`): the backend's
    /// validation of the filled ranges, then the request row, its telemetry and its
    /// regions' pins. On an error the vectors go back to their pools.
    pub(crate) fn finish_xfer(
        &mut self,
        parts: XferParts,
        built: Result<u64, Error>,
        ranges: Vec<Range>,
        pins: Vec<RegionId>,
        notif: Option<&[u8]>,
    ) -> Result<XferId, Error> {
        let XferParts {
            op,
            slot,
            endpoint,
            generation,
            kinds: (lkind, rkind),
            descs: n,
        } = parts;
        let built = built.and_then(|bytes| {
            let backend = self.backends.backends[slot]
                .as_ref()
                .expect("chosen slot is filled");
            backend
                .validate(
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
                .map(|()| bytes)
        });
        let bytes = match built {
            Ok(bytes) => bytes,
            Err(e) => {
                self.pools.ranges.push(ranges);
                self.pools.pins.push(pins);
                return Err(e);
            }
        };
        let mut payload = self.pools.notifs.pop().unwrap_or_default();
        payload.clear();
        if let Some(p) = notif {
            payload.extend_from_slice(p);
        }
        // Merging keeps every byte: the descriptors' bytes (summed by the fill) are the
        // merged ranges' bytes.
        debug_assert_eq!(bytes, ranges.iter().map(|r| r.len).sum::<u64>());
        let telemetry = crate::world::Telemetry {
            total_bytes: bytes,
            desc_count: ranges.len() as u64,
            desc_count_unmerged: n as u64,
            ..Default::default()
        };
        for &region in &pins {
            let row = self
                .regions
                .row(region)
                .expect("pinned regions were just resolved");
            self.regions.pins[row] += 1;
        }
        let id = self.xfers.insert(XferRow {
            ops: op,
            slots: slot as u8,
            endpoints: endpoint,
            generations: generation,
            kinds: (lkind, rkind),
            ranges,
            notifs: payload,
            has_notif: notif.is_some(),
            states: XferState::NotPosted,
            telemetry,
            pins,
        });
        Ok(id)
    }

    /// Append the merged ranges of the descriptor pairs `pairs` to `ranges` (empty on
    /// entry, with room for every pair), and the local regions they name to `pins` (one
    /// entry per run of descriptors in one region).
    ///
    /// The range being built stays in locals until a pair does not continue it (see
    /// [`merge_into`]), so a run of adjacent descriptors writes one range, and a region
    /// is resolved once per run of descriptors that name it. Not inlined: each of the
    /// four instances is a small function of its own, its loop state in registers.
    ///
    /// Returns the bytes of all pairs.
    #[inline(never)]
    fn fill_ranges(
        &self,
        plan: &Plan,
        pairs: impl Iterator<Item = (PrepEntry, PrepEntry)>,
        (ranges, pins): (&mut Vec<Range>, &mut Vec<RegionId>),
    ) -> Result<u64, Error> {
        // The last region looked up on each side: (prepared target, token).
        let (mut last_local, mut last_remote) = ((u64::MAX, 0u64), (u64::MAX, 0u64));
        let mut cur: Option<Range> = None;
        let mut bytes = 0u64;
        for (k, (le, re)) in pairs.enumerate() {
            let len = le.desc.len;
            if len != re.desc.len {
                return Err(length_mismatch(k, len, re.desc));
            }
            bytes = bytes.wrapping_add(len);
            if le.target != last_local.0 {
                let (t, region) =
                    self.region_token(le, plan.slot, plan.lkind, plan.local_first, k)?;
                pins.push(region);
                last_local = (le.target, t);
            }
            let remote_token = match plan.remote {
                RemoteTokens::Recorded => re.target,
                RemoteTokens::Local { .. } if re.target == last_remote.0 => last_remote.1,
                RemoteTokens::Local { first } => {
                    let (t, region) = self.region_token(re, plan.slot, plan.rkind, first, k)?;
                    pins.push(region);
                    last_remote = (re.target, t);
                    t
                }
                RemoteTokens::Lookup(peer) => {
                    self.peer_token(peer, plan.slot, plan.rkind, re.desc, k)?
                }
            };
            let next = Range {
                local_addr: le.desc.addr,
                remote_addr: re.desc.addr,
                len,
                local_dev: le.desc.dev,
                remote_dev: re.desc.dev,
                local_token: last_local.1,
                remote_token,
            };
            match &mut cur {
                Some(c) => merge_into(ranges, c, next),
                None => cur = Some(next),
            }
        }
        ranges.extend(cur);
        Ok(bytes)
    }

    /// [`World::fill_ranges`] for two lists that each lie in one region, whose tokens
    /// the request's slot takes as the prep recorded them (`plan.local_first`, remote
    /// tokens recorded or local with `first`): the first pair resolves both tokens and
    /// pins, and every pair has the same tokens and devices, so the loop is the length
    /// check, the two adjacency tests and one range written per unmerged pair.
    ///
    /// Merges exactly as [`crate::merge::mergeable`]: devices and tokens are equal by
    /// construction, and a range extended on both sides ends where its last
    /// descriptor ends, which prep checked does not wrap.
    #[inline(never)]
    fn fill_ranges_single(
        &self,
        plan: &Plan,
        mut pairs: impl Iterator<Item = (PrepEntry, PrepEntry)>,
        (ranges, pins): (&mut Vec<Range>, &mut Vec<RegionId>),
    ) -> Result<u64, Error> {
        if let RemoteTokens::Lookup(_) = plan.remote {
            // Tokens of another slot: looked up per pair.
            return self.fill_ranges(plan, pairs, (ranges, pins));
        }
        let Some((le, re)) = pairs.next() else {
            return Ok(0);
        };
        let mut len = le.desc.len;
        if len != re.desc.len {
            return Err(length_mismatch(0, len, re.desc));
        }
        let (local_token, region) =
            self.region_token(le, plan.slot, plan.lkind, plan.local_first, 0)?;
        pins.push(region);
        let remote_token = match plan.remote {
            RemoteTokens::Local { first } => {
                let (t, region) = self.region_token(re, plan.slot, plan.rkind, first, 0)?;
                pins.push(region);
                t
            }
            RemoteTokens::Recorded | RemoteTokens::Lookup(_) => re.target,
        };
        let mut cur = Range {
            local_addr: le.desc.addr,
            remote_addr: re.desc.addr,
            len,
            local_dev: le.desc.dev,
            remote_dev: re.desc.dev,
            local_token,
            remote_token,
        };
        let mut bytes = len;
        for (k, (le, re)) in pairs.enumerate() {
            len = le.desc.len;
            if len != re.desc.len {
                return Err(length_mismatch(k + 1, len, re.desc));
            }
            bytes = bytes.wrapping_add(len);
            let local_next = cur.local_addr.wrapping_add(cur.len) == le.desc.addr;
            let remote_next = cur.remote_addr.wrapping_add(cur.len) == re.desc.addr;
            if local_next & remote_next {
                cur.len += len;
            } else {
                ranges.push(cur);
                cur.local_addr = le.desc.addr;
                cur.remote_addr = re.desc.addr;
                cur.len = len;
            }
        }
        ranges.push(cur);
        Ok(bytes)
    }

    /// The token for `slot` of the local region a prepared entry names, with the region
    /// (to pin). A region deregistered since the prep is refused as stale.
    #[inline]
    fn region_token(
        &self,
        entry: PrepEntry,
        slot: usize,
        kind: MemKind,
        first_slot: bool,
        k: usize,
    ) -> Result<(u64, RegionId), Error> {
        let region: RegionId = handle_from_tag(entry.target);
        let (row, id) = match self.regions.row(region) {
            Some(row) if self.regions.backends[row].contains(slot) => (row, region),
            Some(_) if !first_slot => {
                // Another region covers the descriptor for this backend.
                let other = self.sections[slot][kind as usize]
                    .covering(entry.desc)
                    .ok_or(Error::NotFound {
                        subject: desc_subject(k, entry.desc),
                    })?;
                let row = self.regions.row(other).ok_or(Error::StaleRegion {
                    region: other,
                    descriptor: k as u32,
                })?;
                (row, other)
            }
            Some(_) => {
                return Err(Error::NotFound {
                    subject: desc_subject(k, entry.desc),
                })
            }
            None => {
                return Err(Error::StaleRegion {
                    region,
                    descriptor: k as u32,
                })
            }
        };
        Ok((self.regions.tokens[row][slot], id))
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

    #[inline]
    pub(crate) fn check_peer_generation(&self, peer: PeerId, generation: u32) -> Result<(), Error> {
        let row = self
            .peers
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

impl World {
    /// Drive every backend once and route completions to their requests. Returns how
    /// many completions were routed. Never blocks.
    pub(crate) fn progress(&mut self) -> u32 {
        // What the posts of this flush completed at once is stamped with the time the
        // last post returned; what the backends complete now, with one clock read, taken
        // only if they complete something (a polling `check` reads no clock).
        let queued = self.completions.as_slice().len();
        let dispatched_at = self.dispatched_at.take();
        for slot in 0..MAX_BACKENDS {
            if let Some(backend) = self.backends.backends[slot].as_mut() {
                backend.progress(&mut self.completions);
            }
        }
        let mut routed = 0;
        let telemetry = self.bounds.telemetry;
        let mut now = None;
        let mut completions = std::mem::take(&mut self.completions);
        for (i, c) in completions.as_slice().iter().enumerate() {
            let at = telemetry.then(|| match dispatched_at {
                Some(t) if i < queued => t,
                _ => *now.get_or_insert_with(Instant::now),
            });
            routed += u32::from(self.route(*c, at));
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
        let Some(row) = self.xfers.row(id) else {
            return false;
        };
        match self.xfers.states[row] {
            XferState::InProgress => {}
            XferState::Draining(_) => {
                // The backend confirmed the end: the caller already saw the error; the
                // request may now be released and its regions deregistered.
                let state = &mut self.xfers.states[row];
                if let XferState::Draining(error) = std::mem::replace(state, XferState::NotPosted) {
                    *state = XferState::Failed(error);
                }
                if let XferState::Failed(error) = &self.xfers.states[row] {
                    self.metrics
                        .completed(usize::from(self.xfers.slots[row]), None, Some(error));
                }
                return true;
            }
            _ => return false,
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
                    FailureKind::NotFound => Error::NotFound {
                        subject: Subject::Named(
                            self.failure_target(row, f.range)
                                .unwrap_or_else(|| "the transfer's target".into())
                                .into(),
                        ),
                    },
                    FailureKind::Denied => Error::NotAllowed {
                        subject: Subject::Named(
                            self.failure_target(row, f.range)
                                .unwrap_or_else(|| "the transfer's target".into())
                                .into(),
                        ),
                        reason: format!("access denied (backend {backend})").into(),
                    },
                    FailureKind::Throttled => Error::Backend {
                        backend: backend.into(),
                        errno: f.errno,
                        desc: f.range,
                        detail: format!(
                            "throttled until the retries ran out on {}",
                            self.failure_target(row, f.range)
                                .unwrap_or_else(|| "the target".into())
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
        let mut latency = None;
        if let (Some(now), Some(start)) = (now, self.xfers.telemetry[row].start) {
            let d = now.saturating_duration_since(start);
            self.xfers.telemetry[row].xfer_duration = d;
            latency = Some(d);
        }
        let error = match &self.xfers.states[row] {
            XferState::Failed(e) => Some(e),
            _ => None,
        };
        if let (None, Some(d)) = (error, latency) {
            let slot = usize::from(self.xfers.slots[row]);
            let bytes = self.xfers.telemetry[row].total_bytes;
            self.costs[slot].record(bytes, d);
            self.size_costs[slot].record(self.xfers.ops[row], bytes, d);
        }
        self.metrics
            .completed(usize::from(self.xfers.slots[row]), latency, error);
        true
    }
}

impl World {
    /// Release a request. An in-flight request is canceled if its backend can; otherwise
    /// the release is refused and the request stays. A draining request is refused until
    /// its backend confirmed its end. Releasing unpins its regions.
    pub(crate) fn release_xfer(&mut self, id: XferId) -> Result<(), Error> {
        let row = self
            .xfers
            .row(id)
            .ok_or_else(|| Error::not_found(Subject::Xfer(id)))?;
        match self.xfers.states[row] {
            XferState::InProgress => {
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
            XferState::Draining(_) => {
                return Err(Error::NotAllowed {
                    subject: Subject::Xfer(id),
                    reason: "draining: its peer went away while it was in flight and its backend has not confirmed the end yet; progress or check, then release".into(),
                });
            }
            _ => {}
        }
        let removed = self.xfers.remove(id).expect("row checked above");
        for &region in &removed.pins {
            let row = self
                .regions
                .row(region)
                .expect("a pinned region stays registered");
            self.regions.pins[row] -= 1;
        }
        self.pools.ranges.push(removed.ranges);
        self.pools.notifs.push(removed.notifs);
        self.pools.pins.push(removed.pins);
        Ok(())
    }

    /// Whether request `row` may be posted now; marks it in progress if so.
    #[inline]
    pub(crate) fn accept_post(&mut self, id: XferId) -> Result<usize, Error> {
        let row = self
            .xfers
            .row(id)
            .ok_or_else(|| Error::not_found(Subject::Xfer(id)))?;
        match &self.xfers.states[row] {
            // A request posted earlier in this buffer is already marked in progress, so a
            // second post of it is refused like any repost of an active request.
            XferState::InProgress => return Err(Error::RepostActive { xfer: id }),
            XferState::Draining(_) => {
                return Err(Error::NotAllowed {
                    subject: Subject::Xfer(id),
                    reason: "draining: its peer went away while it was in flight; release it once its backend confirmed the end".into(),
                })
            }
            _ => {}
        }
        if let Endpoint::Peer(peer) = self.xfers.endpoints[row] {
            self.check_peer_generation(peer, self.xfers.generations[row])?;
        }
        self.xfers.states[row] = XferState::InProgress;
        Ok(row)
    }

    /// Telemetry of a request.
    pub fn telemetry(&self, xfer: XferId) -> Result<Telemetry, Error> {
        let row = self
            .xfers
            .row(xfer)
            .ok_or_else(|| Error::not_found(Subject::Xfer(xfer)))?;
        let t = self.xfers.telemetry[row];
        if !self.bounds.telemetry || t.start.is_none() {
            return Err(Error::NoTelemetry { xfer });
        }
        Ok(t)
    }

    /// State of a request.
    pub fn xfer_state(&self, xfer: XferId) -> Result<&XferState, Error> {
        let row = self
            .xfers
            .row(xfer)
            .ok_or_else(|| Error::not_found(Subject::Xfer(xfer)))?;
        Ok(&self.xfers.states[row])
    }

    /// How long request `xfer` is expected to take: what this agent measured for
    /// requests of its backend, operation and size class once there are a few
    /// (`cost::SizeClasses`), else the backend's own estimate where it has one (UCX's
    /// model), else the line fitted to all of the backend's completed requests
    /// ([`Error::NoTelemetry`] before any, or with telemetry off).
    pub fn estimate(&mut self, xfer: XferId) -> Result<ferry_backend_api::CostEstimate, Error> {
        let row = self
            .xfers
            .row(xfer)
            .ok_or_else(|| Error::not_found(Subject::Xfer(xfer)))?;
        let slot = usize::from(self.xfers.slots[row]);
        let (endpoint, op) = (self.xfers.endpoints[row], self.xfers.ops[row]);
        let bytes = self.xfers.telemetry[row].total_bytes;
        if let Some((p, _)) = self.size_costs[slot].predict(op, bytes) {
            return Ok(ferry_backend_api::CostEstimate {
                duration: p.duration,
                margin: p.margin,
                method: ferry_backend_api::CostMethod::Measured,
            });
        }
        let backend = self.backends.backends[slot]
            .as_mut()
            .expect("request slot is filled");
        if let Some(estimate) = backend.estimate(endpoint, op, &self.xfers.ranges[row]) {
            return Ok(estimate);
        }
        let p = self.costs[slot]
            .predict(bytes)
            .ok_or(Error::NoTelemetry { xfer })?;
        Ok(ferry_backend_api::CostEstimate {
            duration: p.duration,
            margin: p.margin,
            method: ferry_backend_api::CostMethod::Measured,
        })
    }

    /// Number of merged ranges of a request.
    pub fn xfer_range_count(&self, xfer: XferId) -> Result<usize, Error> {
        let row = self
            .xfers
            .row(xfer)
            .ok_or_else(|| Error::not_found(Subject::Xfer(xfer)))?;
        Ok(self.xfers.ranges[row].len())
    }

    /// The type name of the backend request `xfer` goes through (chosen at `make`).
    pub fn xfer_backend(&self, xfer: XferId) -> Result<&'static str, Error> {
        let row = self
            .xfers
            .row(xfer)
            .ok_or_else(|| Error::not_found(Subject::Xfer(xfer)))?;
        let slot = usize::from(self.xfers.slots[row]);
        self.backends.backends[slot]
            .as_ref()
            .map(|b| b.name())
            .ok_or_else(|| Error::not_found(Subject::Xfer(xfer)))
    }
}
