//! A peer's metadata blob, validated once and then read in place.

use ferry_storage::{Desc, Error, MemKind};
use rkyv::rancor::Error as RkyvError;
use rkyv::util::AlignedVec;

use crate::header::{self, invalid, Format, FLAG_PARTIAL, HEADER_LEN_BYTES};
use crate::wire::{ArchivedWireMd, ArchivedWireSection};
use crate::BACKENDS_MAX;

type ArchiveRef<'a> = &'a ArchivedWireMd;

self_cell::self_cell!(
    /// The aligned copy of the wire bytes and the validated archive inside it.
    struct Validated {
        owner: AlignedVec,
        #[covariant]
        dependent: ArchiveRef,
    }
);

/// A validated peer metadata blob, read in place.
///
/// Regions have a global index, stable for this blob: sections in archive order
/// (ascending by backend index, then memory kind), regions within a section in
/// (device, address) order.
pub struct PeerMd {
    archive: Validated,
    /// Header flags.
    flags: u16,
    /// Global index of each section's first region, plus the region count at the end;
    /// indexed by section position in the archive.
    section_firsts: Box<[u32]>,
}

/// One region of a peer, borrowed from its blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionView<'a> {
    /// Index of the backend in the blob (see [`PeerMd::backend`]).
    pub backend: u8,
    /// Memory kind of the region's section.
    pub kind: MemKind,
    /// The registered range.
    pub desc: Desc,
    /// The backend's public metadata for the region.
    pub public_md: &'a [u8],
}

impl std::fmt::Debug for PeerMd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerMd")
            .field("agent", &self.agent())
            .field("generation", &self.generation())
            .field("partial", &self.is_partial())
            .field("backends", &self.backend_count())
            .field("regions", &self.region_count())
            .field("len_bytes", &self.as_bytes().len())
            .finish()
    }
}

impl PeerMd {
    /// Validate `bytes` (a blob from [`MdWriter::finish`](crate::MdWriter::finish))
    /// and keep an aligned copy to read in place.
    ///
    /// Checks the header (magic, version, known flags), the archive structure (once,
    /// with bytecheck), then every semantic invariant: non-empty agent and backend
    /// names, unique backend names, at most [`BACKENDS_MAX`] backends, sections
    /// strictly ascending by (backend, kind) with valid backend indices and kinds,
    /// column lengths that fit (one per region, or one shared value for lengths and
    /// devices), non-empty sections, regions non-empty, non-wrapping, sorted by
    /// (device, address) and non-overlapping, metadata offsets starting at 0,
    /// non-decreasing and ending at the metadata length, metadata references naming
    /// existing entries. Any failure is an
    /// [`Error::InvalidMetadata`] naming it.
    pub fn from_bytes(bytes: &[u8]) -> Result<PeerMd, Error> {
        let flags = header::check(Format::Metadata, bytes)?;
        let mut buffer = AlignedVec::<16>::with_capacity(bytes.len());
        buffer.extend_from_slice(bytes);
        let archive = Validated::try_new(buffer, |buffer| {
            rkyv::access::<ArchivedWireMd, RkyvError>(&buffer[HEADER_LEN_BYTES..])
                .map_err(|e| invalid(format!("archive structure check failed: {e}")))
        })?;
        let section_firsts = check_semantics(archive.borrow_dependent())?;
        Ok(PeerMd {
            archive,
            flags,
            section_firsts,
        })
    }

    #[inline]
    fn md(&self) -> &ArchivedWireMd {
        self.archive.borrow_dependent()
    }

    /// The peer agent's name.
    pub fn agent(&self) -> &str {
        self.md().agent.as_str()
    }

    /// The generation of the peer's metadata.
    pub fn generation(&self) -> u64 {
        self.md().generation.to_native()
    }

    /// Whether the blob is partial metadata.
    pub fn is_partial(&self) -> bool {
        self.flags & FLAG_PARTIAL != 0
    }

    /// The original wire bytes, header included.
    pub fn as_bytes(&self) -> &[u8] {
        self.archive.borrow_owner().as_slice()
    }

    /// Number of backends named in the blob.
    pub fn backend_count(&self) -> usize {
        self.md().backends.len()
    }

    /// Backend `index`: its type name and connection info (`None` if not included).
    pub fn backend(&self, index: u8) -> Option<(&str, Option<&[u8]>)> {
        let backend = self.md().backends.get(usize::from(index))?;
        Some((
            backend.name.as_str(),
            backend.conn_info.as_ref().map(|info| info.as_slice()),
        ))
    }

    /// The index of backend `name`, if the blob names it.
    pub fn backend_index(&self, name: &str) -> Option<u8> {
        let index = self.md().backends.iter().position(|b| b.name == name)?;
        u8::try_from(index).ok()
    }

    /// Number of regions in all sections.
    pub fn region_count(&self) -> usize {
        self.section_firsts.last().map_or(0, |&n| n as usize)
    }

    /// Position of the section (`backend`, `kind`) in the archive.
    #[inline]
    fn section_position(&self, backend: u8, kind: MemKind) -> Option<usize> {
        self.md()
            .sections
            .binary_search_by(|s| (s.backend, s.kind).cmp(&(backend, kind as u8)))
            .ok()
    }

    /// Like [`PeerMd::find`], with the region's own range, trying first the region
    /// after global index `last` (descriptors that walk a peer's regions in address
    /// order, as one KV layer's blocks do, then cost no search).
    #[inline]
    pub fn find_bounds_after(
        &self,
        backend: u8,
        kind: MemKind,
        desc: Desc,
        last: u32,
    ) -> Option<(u32, Desc)> {
        let end = desc.end().filter(|_| desc.len > 0)?;
        let position = self.section_position(backend, kind)?;
        let section = &self.md().sections[position];
        let first = self.section_firsts[position];
        let covering = |i: usize| {
            let start = section.addrs[i].to_native();
            // Validated: addrs[i] + lens[i] does not wrap.
            let region_end = start + len_at(section, i);
            (dev_at(section, i) == desc.dev && start <= desc.addr && end <= region_end)
                .then(|| Desc::new(start, region_end - start, desc.dev))
        };
        let next = last.wrapping_add(1).wrapping_sub(first) as usize;
        let hit = (next < section.addrs.len())
            .then(|| covering(next).map(|d| (next, d)))
            .flatten();
        let (i, region) = match hit {
            Some(hit) => hit,
            None => {
                let i = partition_point(section, |dev, addr| (dev, addr) <= (desc.dev, desc.addr))
                    .checked_sub(1)?;
                (i, covering(i)?)
            }
        };
        Some((first + i as u32, region))
    }

    /// The region of section (`backend`, `kind`) that covers all of `desc`, by binary
    /// search inside the archive; returns its global index. An empty or wrapping
    /// `desc` is covered by nothing.
    pub fn find(&self, backend: u8, kind: MemKind, desc: Desc) -> Option<u32> {
        if desc.len == 0 {
            return None;
        }
        let end = desc.end()?;
        let position = self.section_position(backend, kind)?;
        let section = &self.md().sections[position];
        let at_or_before =
            partition_point(section, |dev, addr| (dev, addr) <= (desc.dev, desc.addr));
        let i = at_or_before.checked_sub(1)?;
        if dev_at(section, i) != desc.dev {
            return None;
        }
        // Validated: addrs[i] + lens[i] does not wrap.
        let region_end = section.addrs[i].to_native() + len_at(section, i);
        (end <= region_end).then(|| self.section_firsts[position] + i as u32)
    }

    /// The region registered with exactly `desc` in section (`backend`, `kind`).
    pub fn exact(&self, backend: u8, kind: MemKind, desc: Desc) -> Option<u32> {
        let position = self.section_position(backend, kind)?;
        let section = &self.md().sections[position];
        let i = partition_point(section, |dev, addr| (dev, addr) < (desc.dev, desc.addr));
        let hit = i < section.addrs.len()
            && dev_at(section, i) == desc.dev
            && section.addrs[i].to_native() == desc.addr
            && len_at(section, i) == desc.len;
        hit.then(|| self.section_firsts[position] + i as u32)
    }

    /// Region `index` (global index, see [`PeerMd::find`]).
    pub fn region(&self, index: u32) -> Option<RegionView<'_>> {
        if index as usize >= self.region_count() {
            return None;
        }
        let position = self.section_firsts.partition_point(|&f| f <= index) - 1;
        let section = &self.md().sections[position];
        Some(view(
            section,
            (index - self.section_firsts[position]) as usize,
        ))
    }

    /// Every region, in global-index order.
    pub fn regions(&self) -> impl Iterator<Item = RegionView<'_>> + '_ {
        self.md()
            .sections
            .iter()
            .flat_map(|section| (0..section.addrs.len()).map(move |i| view(section, i)))
    }
}

/// The number of leading regions of the sorted `section` whose (dev, addr) satisfies
/// `before` (which must hold for a prefix): a binary search in the archived columns.
fn partition_point(section: &ArchivedWireSection, before: impl Fn(u64, u64) -> bool) -> usize {
    let addrs = section.addrs.as_slice();
    if let [dev] = section.devs.as_slice() {
        // One device for the whole section: search the addresses alone.
        let dev = dev.to_native();
        return addrs.partition_point(|addr| before(dev, addr.to_native()));
    }
    let devs = section.devs.as_slice();
    // Validated: both columns have the same length.
    let (mut low, mut high) = (0, addrs.len().min(devs.len()));
    while low < high {
        let mid = low + (high - low) / 2;
        if before(devs[mid].to_native(), addrs[mid].to_native()) {
            low = mid + 1;
        } else {
            high = mid;
        }
    }
    low
}

/// The length of region `i` of a validated `section` (one per region, or one for all).
#[inline]
fn len_at(section: &ArchivedWireSection, i: usize) -> u64 {
    let lens = section.lens.as_slice();
    lens[if lens.len() == 1 { 0 } else { i }].to_native()
}

/// The device of region `i` of a validated `section` (one per region, or one for all).
#[inline]
fn dev_at(section: &ArchivedWireSection, i: usize) -> u64 {
    let devs = section.devs.as_slice();
    devs[if devs.len() == 1 { 0 } else { i }].to_native()
}

/// Region `i` of a validated `section`.
fn view(section: &ArchivedWireSection, i: usize) -> RegionView<'_> {
    let entry = if section.md_refs.is_empty() {
        // One entry per region, or one for all.
        if section.md_offsets.len() == 2 {
            0
        } else {
            i
        }
    } else {
        section.md_refs[i].to_native() as usize
    };
    let md_start = section.md_offsets[entry].to_native() as usize;
    let md_end = section.md_offsets[entry + 1].to_native() as usize;
    RegionView {
        backend: section.backend,
        // Validated; DRAM is never returned for a valid blob.
        kind: MemKind::from_u8(section.kind).unwrap_or(MemKind::Dram),
        desc: Desc::new(
            section.addrs[i].to_native(),
            len_at(section, i),
            dev_at(section, i),
        ),
        public_md: &section.md_bytes[md_start..md_end],
    }
}

/// Check every invariant bytecheck cannot; returns the global index of each section's
/// first region plus the total region count.
fn check_semantics(md: &ArchivedWireMd) -> Result<Box<[u32]>, Error> {
    if md.agent.is_empty() {
        return Err(invalid("agent name is empty"));
    }
    let backends = md.backends.as_slice();
    if backends.len() > BACKENDS_MAX {
        return Err(invalid(format!(
            "blob names {} backends, more than {BACKENDS_MAX}",
            backends.len()
        )));
    }
    for (i, backend) in backends.iter().enumerate() {
        if backend.name.is_empty() {
            return Err(invalid(format!("backend #{i} has an empty name")));
        }
        if let Some(j) = backends[..i].iter().position(|b| b.name == backend.name) {
            return Err(invalid(format!(
                "backends #{j} and #{i} are both named '{}'",
                backend.name.as_str()
            )));
        }
    }

    let mut section_firsts = Vec::with_capacity(md.sections.len() + 1);
    let mut region_total: u64 = 0;
    let mut previous_key: Option<(u8, u8)> = None;
    for (s, section) in md.sections.iter().enumerate() {
        let backend = section.backend;
        let Some((backend_name, _)) = backends
            .get(usize::from(backend))
            .map(|b| (b.name.as_str(), ()))
        else {
            return Err(invalid(format!(
                "section #{s} names backend #{backend}, but the blob has only {} backends",
                backends.len()
            )));
        };
        let Some(kind) = MemKind::from_u8(section.kind) else {
            return Err(invalid(format!(
                "section #{s} has unknown memory kind byte {}",
                section.kind
            )));
        };
        let key = (backend, section.kind);
        match previous_key {
            Some(previous) if previous == key => {
                return Err(invalid(format!(
                    "duplicate section ({backend_name}, {kind}) at #{s}"
                )));
            }
            Some(previous) if previous > key => {
                return Err(invalid(format!(
                    "section #{s} ({backend_name}, {kind}) is out of order (sections must \
                     ascend by backend index, then kind)"
                )));
            }
            _ => {}
        }
        previous_key = Some(key);
        let count = check_section(section, s, backend_name, kind)?;
        section_firsts.push(region_total as u32);
        region_total += count as u64;
        if region_total >= u64::from(u32::MAX) {
            return Err(invalid(format!(
                "more than {} regions in one blob",
                u32::MAX - 1
            )));
        }
    }
    section_firsts.push(region_total as u32);
    Ok(section_firsts.into_boxed_slice())
}

/// Check section `s` (of `backend_name`, `kind`); returns its region count.
fn check_section(
    section: &ArchivedWireSection,
    s: usize,
    backend_name: &str,
    kind: MemKind,
) -> Result<usize, Error> {
    let name = || format!("section #{s} ({backend_name}, {kind})");
    let count = section.addrs.len();
    if count == 0 {
        return Err(invalid(format!("{} has no regions", name())));
    }
    let per_region_or_one = |len: usize| len == count || len == 1;
    let entries = section.md_offsets.len().saturating_sub(1);
    let refs = section.md_refs.len();
    if !per_region_or_one(section.lens.len())
        || !per_region_or_one(section.devs.len())
        || section.md_offsets.is_empty()
        || (refs == 0 && entries != count && entries != 1)
        || (refs != 0 && (refs != count || entries > count))
    {
        return Err(invalid(format!(
            "{}: column lengths differ (addrs {count}, lens {}, devs {}, md offsets {}, md \
             refs {refs}; lens and devs need one entry per region or a single one, md \
             offsets one more than the md entries, which are one per region or a single \
             one without md refs, and at most one per region with one md ref per region)",
            name(),
            section.lens.len(),
            section.devs.len(),
            section.md_offsets.len()
        )));
    }
    if let Some(i) = section
        .md_refs
        .iter()
        .position(|r| r.to_native() as usize >= entries)
    {
        return Err(invalid(format!(
            "{}: region #{i} names md entry {}, but there are {entries}",
            name(),
            section.md_refs[i].to_native()
        )));
    }
    let offsets = section.md_offsets.as_slice();
    let md_len_bytes = section.md_bytes.len();
    if offsets[0].to_native() != 0 {
        return Err(invalid(format!(
            "{}: first md offset is {}, not 0",
            name(),
            offsets[0].to_native()
        )));
    }
    if offsets[entries].to_native() as usize != md_len_bytes {
        return Err(invalid(format!(
            "{}: last md offset is {}, but the metadata is {md_len_bytes} bytes",
            name(),
            offsets[entries].to_native()
        )));
    }
    if let Some(i) = offsets
        .windows(2)
        .position(|w| w[0].to_native() > w[1].to_native())
    {
        return Err(invalid(format!(
            "{}: md offsets decrease at region #{i} ({} > {})",
            name(),
            offsets[i].to_native(),
            offsets[i + 1].to_native()
        )));
    }

    let addrs = section.addrs.as_slice();
    if let ([len], [_]) = (section.lens.as_slice(), section.devs.as_slice()) {
        // One length and one device for all (the usual case): the regions are sorted,
        // apart and in range when the addresses ascend by at least the length and the
        // last one does not wrap; one pass over the addresses. Anything else falls
        // through to the region-by-region check below, which names the culprit.
        let len = len.to_native();
        let fits = len > 0
            && addrs.windows(2).all(|w| {
                w[0].to_native() < w[1].to_native() && w[1].to_native() - w[0].to_native() >= len
            })
            && addrs
                .last()
                .is_some_and(|last| last.to_native().checked_add(len).is_some());
        if fits {
            return Ok(count);
        }
    }
    let mut previous: Option<(u64, u64, u64)> = None; // (dev, addr, end)
    for (i, addr) in addrs.iter().enumerate() {
        let (addr, len, dev) = (addr.to_native(), len_at(section, i), dev_at(section, i));
        let end = match addr.checked_add(len) {
            Some(end) if len > 0 => end,
            _ => {
                return Err(invalid(format!(
                    "{}: region #{i} (addr {addr:#x}, len {len}, dev {dev}) is empty or wraps",
                    name()
                )));
            }
        };
        if let Some((prev_dev, prev_addr, prev_end)) = previous {
            if (prev_dev, prev_addr) >= (dev, addr) {
                return Err(invalid(format!(
                    "{}: region #{i} (addr {addr:#x}, dev {dev}) is not sorted after region \
                     #{} (addr {prev_addr:#x}, dev {prev_dev})",
                    name(),
                    i - 1
                )));
            }
            if prev_dev == dev && prev_end > addr {
                return Err(invalid(format!(
                    "{}: region #{i} (addr {addr:#x}, dev {dev}) overlaps region #{} (ends at \
                     {prev_end:#x})",
                    name(),
                    i - 1
                )));
            }
        }
        previous = Some((dev, addr, end));
    }
    Ok(count)
}
