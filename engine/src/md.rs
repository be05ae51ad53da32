//! Metadata on the engine side: what we publish (local / partial blobs) and how a
//! peer's blobs are loaded — validated once by the codec, then read in place. A peer's
//! view is the set of blobs loaded for its current generation (partial metadata
//! accumulates); remote sections are binary-searched inside the archived bytes.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_backend_api::PeerRegions;
use ferry_metadata::{MdScratch, MdWriter, PeerMd};
use ferry_schedules::{LoadKind, MetadataLoader, PeerView, World};
use ferry_storage::{Desc, Error, MemKind, PeerId, RegionId, Subject, MAX_BACKENDS};

/// Most blobs kept for one peer's generation (full plus partial ones that add
/// something); a peer that sends more gets [`Error::Capacity`] (it can publish a new
/// generation, or full metadata, instead). Bounds what a peer can make us keep.
pub(crate) const PEER_BLOBS_MAX: usize = 1024;

/// A peer with at most this many regions (over every backend and kind, counted in its
/// blobs) is looked up in a table inside its set ([`PeerMdSet::small`]): a lookup reads
/// the set's first few cache lines instead of walking the archived sections (about ten
/// lines, each a miss when a process sends to many peers in turn). A peer that
/// registers a few large regions (a KV cache per device) is the common case.
const SMALL_REGIONS: usize = 4;

/// One region of a small peer: its range, token, view backend index and kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct SmallRegion {
    dev: u64,
    start: u64,
    end: u64,
    token: u64,
    backend: u8,
    kind: u8,
}

/// Every blob loaded for one peer's current metadata generation.
///
/// Backend indices of the view are positions in `names` (the union of the blobs'
/// backend types); a region token is `blob << 32 | region index in that blob`.
///
/// A peer of at most [`SMALL_REGIONS`] regions is searched in `small`. Otherwise one
/// blob is searched in place. With several (partial metadata accumulating), every
/// region of every blob is merged once, at load, into one sorted [`Merged`] index per
/// view backend and memory kind, so a lookup stays one binary search however many
/// blobs the peer sent. (`repr(C)`: the small table first, next to the `Arc`'s counts.)
#[repr(C)]
pub(crate) struct PeerMdSet {
    /// Whether `small` holds every region of the peer (then no lookup reads a blob).
    small_all: bool,
    small_len: u8,
    small: [SmallRegion; SMALL_REGIONS],
    agent: String,
    generation: u64,
    blobs: Vec<Arc<PeerMd>>,
    names: Vec<String>,
    /// For each view backend index, that backend's index in each blob.
    per_blob: Vec<Vec<Option<u8>>>,
    /// With more than one blob: the merged index, by view backend index then kind.
    merged: Vec<[Merged; 5]>,
}

/// (device, start, end, token) of each region, per memory kind.
type Rows = [Vec<(u64, u64, u64, u64)>; 5];

/// The regions of one (view backend, memory kind) over all blobs, sorted by (device,
/// start). Regions of one generation never overlap (`PeerMdSet::compare` refuses it);
/// a region published in two blobs appears once. Columns indexed by position.
#[derive(Default)]
struct Merged {
    starts: Vec<(u64, u64)>,
    ends: Vec<u64>,
    tokens: Vec<u64>,
}

impl Merged {
    fn find(&self, desc: Desc) -> Option<usize> {
        if desc.len == 0 {
            return None;
        }
        let end = desc.end()?;
        let i = self
            .starts
            .partition_point(|&s| s <= (desc.dev, desc.addr))
            .checked_sub(1)?;
        (self.starts[i].0 == desc.dev && end <= self.ends[i]).then_some(i)
    }

    fn exact(&self, desc: Desc) -> Option<usize> {
        let i = self.starts.partition_point(|&s| s < (desc.dev, desc.addr));
        (i < self.starts.len()
            && self.starts[i] == (desc.dev, desc.addr)
            && Some(self.ends[i]) == desc.end())
        .then_some(i)
    }
}

impl PeerMdSet {
    fn new(blobs: Vec<Arc<PeerMd>>) -> PeerMdSet {
        Self::build(blobs, SMALL_REGIONS)
    }

    /// The set, with the small table used up to `small_max` regions.
    fn build(blobs: Vec<Arc<PeerMd>>, small_max: usize) -> PeerMdSet {
        let first = &blobs[0];
        let mut names: Vec<String> = Vec::new();
        for blob in &blobs {
            for i in 0..blob.backend_count() {
                if let Some((name, _)) = blob.backend(i as u8) {
                    if !names.iter().any(|n| n == name) {
                        names.push(name.to_string());
                    }
                }
            }
        }
        let per_blob: Vec<Vec<Option<u8>>> = names
            .iter()
            .map(|n| blobs.iter().map(|b| b.backend_index(n)).collect())
            .collect();
        let listed: usize = blobs.iter().map(|b| b.region_count()).sum();
        let small_all = listed <= small_max.min(SMALL_REGIONS);
        // The sorted rows feed the small table and, with several blobs, the merged index.
        let rows = (small_all || blobs.len() > 1).then(|| Self::sorted_rows(&blobs, &names));
        let mut small = [SmallRegion::default(); SMALL_REGIONS];
        let mut small_len = 0;
        if let Some(rows) = rows.as_ref().filter(|_| small_all) {
            for (v, kinds) in rows.iter().enumerate() {
                for (kind, regions) in kinds.iter().enumerate() {
                    for &(dev, start, end, token) in regions {
                        small[small_len] = SmallRegion {
                            dev,
                            start,
                            end,
                            token,
                            backend: v as u8,
                            kind: kind as u8,
                        };
                        small_len += 1;
                    }
                }
            }
        }
        let merged = match rows {
            Some(rows) if blobs.len() > 1 => Self::merge(rows),
            _ => Vec::new(),
        };
        PeerMdSet {
            small_all,
            small_len: small_len as u8,
            small,
            agent: first.agent().to_string(),
            generation: first.generation(),
            blobs,
            names,
            per_blob,
            merged,
        }
    }

    /// Every region of every blob as (device, start, end, token), per view backend and
    /// kind, sorted by range; a range published in several blobs once, with the token
    /// of its first publication.
    fn sorted_rows(blobs: &[Arc<PeerMd>], names: &[String]) -> Vec<Rows> {
        let mut rows: Vec<Rows> = (0..names.len()).map(|_| Default::default()).collect();
        for (b, blob) in blobs.iter().enumerate() {
            for index in 0..blob.region_count() as u32 {
                let Some(region) = blob.region(index) else {
                    continue;
                };
                let Some((name, _)) = blob.backend(region.backend) else {
                    continue;
                };
                let Some(v) = names.iter().position(|n| n == name) else {
                    continue;
                };
                let d = region.desc;
                rows[v][region.kind as usize].push((
                    d.dev,
                    d.addr,
                    d.addr.saturating_add(d.len),
                    Self::token(b, index),
                ));
            }
        }
        for kinds in &mut rows {
            for regions in kinds.iter_mut() {
                // Earlier blobs first among equal ranges, so the first publication of a
                // region keeps its token.
                regions.sort_by_key(|&(dev, start, end, token)| (dev, start, end, token));
                regions.dedup_by_key(|r| (r.0, r.1, r.2));
            }
        }
        rows
    }

    /// One sorted index per (view backend, kind), from [`PeerMdSet::sorted_rows`].
    fn merge(rows: Vec<Rows>) -> Vec<[Merged; 5]> {
        rows.into_iter()
            .map(|kinds| {
                kinds.map(|regions| {
                    let mut m = Merged::default();
                    for (dev, start, end, token) in regions {
                        m.starts.push((dev, start));
                        m.ends.push(end);
                        m.tokens.push(token);
                    }
                    m
                })
            })
            .collect()
    }

    /// The region of (`backend`, `kind`) in the small table that covers all of `desc`.
    #[inline]
    fn find_small(&self, backend: u8, kind: MemKind, desc: Desc) -> Option<(u64, Desc)> {
        let end = desc.end().filter(|_| desc.len > 0)?;
        self.small[..usize::from(self.small_len)]
            .iter()
            .find(|r| {
                r.backend == backend
                    && r.kind == kind as u8
                    && r.dev == desc.dev
                    && r.start <= desc.addr
                    && end <= r.end
            })
            .map(|r| (r.token, Desc::new(r.start, r.end - r.start, r.dev)))
    }

    fn token(blob: usize, region: u32) -> u64 {
        ((blob as u64) << 32) | u64::from(region)
    }

    fn split(token: u64) -> (usize, u32) {
        ((token >> 32) as usize, token as u32)
    }

    /// Compare a new blob of the same generation with what is known. Returns whether it
    /// adds anything; refuses content that contradicts a known region or connection.
    fn compare(&self, new: &PeerMd) -> Result<bool, Error> {
        let mut adds = false;
        for i in 0..new.backend_count() {
            let Some((name, conn)) = new.backend(i as u8) else {
                continue;
            };
            let known = self.names.iter().position(|n| n == name);
            match (known, conn) {
                (None, _) => adds = true,
                (Some(v), Some(conn)) => match self.conn_info(v as u8) {
                    Some(old) if old != conn => {
                        return Err(Error::Mismatch {
                            subject: Subject::PeerName(self.agent.clone()),
                            reason: format!(
                                "connection info for backend {name} differs from the loaded one"
                            )
                            .into(),
                        })
                    }
                    Some(_) => {}
                    None => adds = true,
                },
                (Some(_), None) => {}
            }
        }
        for region in new.regions() {
            let Some((name, _)) = new.backend(region.backend) else {
                continue;
            };
            let Some(v) = self.names.iter().position(|n| n == name) else {
                adds = true;
                continue;
            };
            let v = v as u8;
            if let Some(token) = self.exact(v, region.kind, region.desc) {
                if self.public_md(token) != Some(region.public_md) {
                    return Err(Error::Mismatch {
                        subject: Subject::Descriptor {
                            index: 0,
                            addr: region.desc.addr,
                            len: region.desc.len,
                            dev: region.desc.dev,
                        },
                        reason: format!(
                            "peer '{}' already published this region with different metadata",
                            self.agent
                        )
                        .into(),
                    });
                }
                continue;
            }
            let d = region.desc;
            let first = Desc::new(d.addr, 1, d.dev);
            let last = Desc::new(d.addr + d.len - 1, 1, d.dev);
            if self.find(v, region.kind, first).is_some()
                || self.find(v, region.kind, last).is_some()
            {
                return Err(Error::Mismatch {
                    subject: Subject::Descriptor {
                        index: 0,
                        addr: d.addr,
                        len: d.len,
                        dev: d.dev,
                    },
                    reason: format!(
                        "overlaps a region peer '{}' published differently",
                        self.agent
                    )
                    .into(),
                });
            }
            adds = true;
        }
        Ok(adds)
    }

    fn exact(&self, backend: u8, kind: MemKind, desc: Desc) -> Option<u64> {
        if let Some(m) = self.merged.get(usize::from(backend)) {
            let m = &m[kind as usize];
            return m.exact(desc).map(|i| m.tokens[i]);
        }
        let per = self.per_blob.get(usize::from(backend))?;
        per.iter().enumerate().find_map(|(b, idx)| {
            idx.and_then(|i| self.blobs[b].exact(i, kind, desc))
                .map(|r| Self::token(b, r))
        })
    }
}

impl PeerRegions for PeerMdSet {
    fn agent_name(&self) -> &str {
        &self.agent
    }
    fn public_md(&self, token: u64) -> Option<&[u8]> {
        let (blob, region) = Self::split(token);
        self.blobs.get(blob)?.region(region).map(|r| r.public_md)
    }
    fn for_each_region(&self, backend: &str, visit: &mut dyn FnMut(u64, Desc, &[u8])) {
        let Some(index) = self.names.iter().position(|n| n == backend) else {
            return;
        };
        for (b, blob) in self.blobs.iter().enumerate() {
            let Some(in_blob) = self.per_blob[index].get(b).copied().flatten() else {
                continue;
            };
            // A region published in two blobs is listed twice (same token content).
            for (r, region) in blob.regions().enumerate() {
                if region.backend == in_blob {
                    visit(Self::token(b, r as u32), region.desc, region.public_md);
                }
            }
        }
    }
}

impl PeerView for PeerMdSet {
    fn md_generation(&self) -> u64 {
        self.generation
    }
    fn backend_index(&self, name: &str) -> Option<u8> {
        self.names.iter().position(|n| n == name).map(|i| i as u8)
    }
    fn conn_info(&self, index: u8) -> Option<&[u8]> {
        let per = self.per_blob.get(usize::from(index))?;
        // The latest blob that carries connection info wins (they agree; see `compare`).
        per.iter().enumerate().rev().find_map(|(b, idx)| {
            idx.and_then(|i| self.blobs[b].backend(i))
                .and_then(|(_, c)| c)
        })
    }
    fn find_bounds(&self, backend: u8, kind: MemKind, desc: Desc) -> Option<(u64, Desc)> {
        if self.small_all {
            return self.find_small(backend, kind, desc);
        }
        let token = self.find(backend, kind, desc)?;
        let (blob, region) = Self::split(token);
        Some((token, self.blobs[blob].region(region)?.desc))
    }

    fn find_bounds_after(
        &self,
        backend: u8,
        kind: MemKind,
        desc: Desc,
        last: u64,
    ) -> Option<(u64, Desc)> {
        if self.small_all {
            return self.find_small(backend, kind, desc);
        }
        if !self.merged.is_empty() {
            return self.find_bounds(backend, kind, desc);
        }
        // One blob: its tokens are its global region indices.
        let per = self.per_blob.get(usize::from(backend))?;
        let i = (*per.first()?)?;
        let (_, last_region) = Self::split(last);
        self.blobs[0]
            .find_bounds_after(i, kind, desc, last_region)
            .map(|(r, region)| (Self::token(0, r), region))
    }

    #[inline]
    fn find(&self, backend: u8, kind: MemKind, desc: Desc) -> Option<u64> {
        if self.small_all {
            return self.find_small(backend, kind, desc).map(|(token, _)| token);
        }
        if let Some(m) = self.merged.get(usize::from(backend)) {
            let m = &m[kind as usize];
            return m.find(desc).map(|i| m.tokens[i]);
        }
        let per = self.per_blob.get(usize::from(backend))?;
        let i = (*per.first()?)?;
        self.blobs[0].find(i, kind, desc).map(|r| Self::token(0, r))
    }

    fn region_count(&self) -> usize {
        if self.merged.is_empty() {
            return self.blobs.first().map_or(0, |b| b.region_count());
        }
        self.merged
            .iter()
            .flat_map(|kinds| kinds.iter())
            .map(|m| m.tokens.len())
            .sum()
    }
}

/// Engine-side metadata state: every peer's current blob set, and our generation.
pub(crate) struct MdState {
    pub(crate) peers: HashMap<PeerId, Arc<PeerMdSet>>,
    /// Per-instance epoch: the high half of our published generation. The low half is
    /// the number of deregistrations (registering only adds, so it keeps the
    /// generation and partial metadata accumulates at peers).
    epoch: u64,
    /// The metadata writer's buffers from the last encode, reused by the next one.
    scratch: MdScratch,
}

impl MdState {
    pub(crate) fn new() -> MdState {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let epoch = (nanos ^ (u64::from(std::process::id()) << 17)) as u32 | 1;
        MdState {
            peers: HashMap::new(),
            epoch: u64::from(epoch) << 32,
            scratch: MdScratch::default(),
        }
    }

    /// The generation our metadata carries now.
    pub(crate) fn generation(&self, world: &World) -> u64 {
        self.epoch | (world.deregistrations() & 0xffff_ffff)
    }

    /// Serialize our metadata: every region of every remote-capable backend (or only
    /// `regions`, as partial metadata, with or without connection info).
    pub(crate) fn encode_local(
        &mut self,
        world: &World,
        regions: Option<&[RegionId]>,
        include_conn_info: bool,
    ) -> Result<Vec<u8>, Error> {
        let mut writer = MdWriter::with_scratch(
            &world.name,
            self.generation(world),
            std::mem::take(&mut self.scratch),
        );
        if regions.is_some() {
            writer.partial();
        }
        let mut index = [None; MAX_BACKENDS];
        for (slot, entry) in index.iter_mut().enumerate() {
            let Some(name) = world.slot_name(slot) else {
                continue;
            };
            if !world.slot_capabilities(slot).is_some_and(|c| c.remote) {
                continue;
            }
            let conn = include_conn_info
                .then(|| world.slot_conn_info(slot))
                .flatten()
                .transpose()?;
            *entry = Some(writer.backend(name, conn.as_deref()));
        }
        let table = world.regions();
        // Size every section up front (regions and metadata bytes per backend and
        // kind), so the writer's columns are allocated once, not regrown.
        let mut sizes = [[(0usize, 0usize); MemKind::ALL.len()]; MAX_BACKENDS];
        let mut count_row = |row: usize| {
            for (slot, public) in world.region_public_md(row) {
                if let Some(size) = sizes
                    .get_mut(usize::from(slot))
                    .and_then(|kinds| kinds.get_mut(table.kinds[row] as usize))
                {
                    size.0 += 1;
                    size.1 += public.len();
                }
            }
        };
        match regions {
            None => (0..table.len()).for_each(&mut count_row),
            Some(ids) => ids
                .iter()
                .filter_map(|&id| table.row(id))
                .for_each(&mut count_row),
        }
        for (slot, kinds) in sizes.iter().enumerate() {
            let Some(b) = index[slot] else {
                continue;
            };
            for (kind, &(count, md_len_bytes)) in MemKind::ALL.iter().zip(kinds) {
                if count > 0 {
                    writer.reserve(b, *kind, count, md_len_bytes);
                }
            }
        }
        let add_row = |row: usize, writer: &mut MdWriter| {
            for (slot, public) in world.region_public_md(row) {
                if let Some(b) = index[usize::from(slot)] {
                    writer.region(b, table.kinds[row], table.descs[row], public);
                }
            }
        };
        match regions {
            None => (0..table.len()).for_each(|row| add_row(row, &mut writer)),
            Some(ids) => {
                for &id in ids {
                    let row = table
                        .row(id)
                        .ok_or_else(|| Error::not_found(Subject::Region(id)))?;
                    add_row(row, &mut writer);
                }
            }
        }
        let (blob, scratch) = writer.finish_recycling();
        self.scratch = scratch;
        blob
    }
}

impl MetadataLoader for MdState {
    fn load(&mut self, world: &mut World, blob: &[u8]) -> Result<PeerId, Error> {
        let result = self.load_blob(world, blob);
        if let Err(e) = &result {
            log::debug!(
                "agent '{}': peer metadata ({} bytes) not loaded: {e}",
                world.name,
                blob.len()
            );
        }
        result
    }

    fn forget(&mut self, peer: PeerId) {
        self.peers.remove(&peer);
    }
}

impl MdState {
    /// [`MetadataLoader::load`] without its log line for failures.
    fn load_blob(&mut self, world: &mut World, blob: &[u8]) -> Result<PeerId, Error> {
        let md = Arc::new(PeerMd::from_bytes(blob)?);
        let name = md.agent().to_string();
        let known = world
            .peer_by_name(&name)
            .and_then(|p| self.peers.get(&p).map(|s| (p, s.clone())));
        let (set, kind) = match known {
            Some((peer, set))
                if set.generation == md.generation() && world.peer_view(peer)?.0.is_some() =>
            {
                if !set.compare(&md)? {
                    log::debug!(
                        "agent '{}': metadata of peer '{name}' loaded again: identical \
                         content, nothing changed (generation {:#x})",
                        world.name,
                        md.generation()
                    );
                    return Ok(peer); // identical content: idempotent
                }
                if set.blobs.len() >= PEER_BLOBS_MAX {
                    // Logged (rate-limited) by the executor, as every capacity error.
                    return Err(Error::Capacity {
                        what: "metadata blobs kept per peer generation",
                        limit: PEER_BLOBS_MAX,
                    });
                }
                let mut blobs = set.blobs.clone();
                blobs.push(md);
                (PeerMdSet::new(blobs), LoadKind::Extend)
            }
            Some(_) => (PeerMdSet::new(vec![md]), LoadKind::Replace),
            None => (PeerMdSet::new(vec![md]), LoadKind::Replace),
        };
        let set = Arc::new(set);
        #[allow(unsafe_code)]
        // SAFETY: `load_peer` asks for a view of regions agent `name` really registered:
        // `set` holds only blobs the codec validated, published under that name.
        let peer = unsafe { world.load_peer(&name, set.clone(), kind)? };
        self.peers.insert(peer, set);
        Ok(peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A blob of agent "peer" with `regions` as (backend name, kind, desc).
    fn blob(regions: &[(&str, MemKind, Desc)], partial: bool) -> Arc<PeerMd> {
        let mut writer = MdWriter::new("peer", 7);
        if partial {
            writer.partial();
        }
        let mut names: Vec<(&str, u8)> = Vec::new();
        for &(name, _, _) in regions {
            if !names.iter().any(|&(n, _)| n == name) {
                names.push((name, writer.backend(name, Some(b"conn"))));
            }
        }
        for &(name, kind, desc) in regions {
            let index = names.iter().find(|&&(n, _)| n == name).expect("added").1;
            writer.region(index, kind, desc, b"md");
        }
        Arc::new(PeerMd::from_bytes(&writer.finish().expect("valid blob")).expect("loads"))
    }

    /// Every lookup of `small` (the table) and `searched` (the blobs) agrees, for
    /// descriptors at, inside, across and beyond each region's edges, on other devices,
    /// empty or wrapping, for every backend index and kind, with and without a hint.
    fn agree(small: &PeerMdSet, searched: &PeerMdSet, regions: &[(&str, MemKind, Desc)]) {
        assert!(small.small_all && !searched.small_all);
        let mut probes = vec![Desc::new(0, 0, 0), Desc::new(u64::MAX - 4, 16, 0)];
        for &(_, _, d) in regions {
            for dev in [d.dev, d.dev + 1] {
                for addr in [
                    d.addr - 1,
                    d.addr,
                    d.addr + 1,
                    d.addr + d.len - 1,
                    d.addr + d.len,
                ] {
                    for len in [0, 1, 2, d.len - 1, d.len, d.len + 1] {
                        probes.push(Desc::new(addr, len, dev));
                    }
                }
            }
        }
        let mut hits = 0;
        for backend in 0..=small.names.len() as u8 {
            for kind in MemKind::ALL {
                for &probe in &probes {
                    let want = searched.find_bounds(backend, kind, probe);
                    hits += usize::from(want.is_some());
                    assert_eq!(small.find_bounds(backend, kind, probe), want, "{probe:?}");
                    assert_eq!(
                        small.find(backend, kind, probe),
                        searched.find(backend, kind, probe)
                    );
                    for last in [u64::MAX, 0, 1, 2] {
                        assert_eq!(
                            small.find_bounds_after(backend, kind, probe, last),
                            searched.find_bounds_after(backend, kind, probe, last),
                            "{probe:?} after {last}"
                        );
                    }
                }
            }
        }
        assert!(hits > 0, "the probes found regions");
        assert_eq!(small.region_count(), searched.region_count());
    }

    #[test]
    fn small_table_answers_as_the_blobs() {
        let regions = [
            ("UCX", MemKind::Dram, Desc::new(0x1000, 0x1000, 0)),
            ("UCX", MemKind::Dram, Desc::new(0x2000, 0x800, 0)),
            ("UCX", MemKind::Vram, Desc::new(0x1000, 0x1000, 3)),
            ("SHM", MemKind::Dram, Desc::new(0x1800, 0x100, 0)),
        ];
        let one = vec![blob(&regions, false)];
        agree(
            &PeerMdSet::build(one.clone(), SMALL_REGIONS),
            &PeerMdSet::build(one, 0),
            &regions,
        );
        // Two blobs (partial metadata), one region published in both: merged index.
        let (a, b) = (&regions[..2], &regions[1..3]);
        let two = vec![blob(a, true), blob(b, true)];
        let small = PeerMdSet::build(two.clone(), SMALL_REGIONS);
        agree(&small, &PeerMdSet::build(two, 0), &regions[..3]);
        assert_eq!(
            small.small_len, 3,
            "the region in both blobs is listed once"
        );
        // One region more than the table holds: the blobs are searched.
        let mut five = regions.to_vec();
        five.push(("SHM", MemKind::Dram, Desc::new(0x4000, 0x100, 0)));
        assert!(!PeerMdSet::new(vec![blob(&five, false)]).small_all);
    }
}
