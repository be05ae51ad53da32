//! Building an agent-metadata blob.

use ferry_storage::{Desc, Error, MemKind, Subject};
use rkyv::rancor::Error as RkyvError;

use crate::header::{self, Format, FLAG_PARTIAL, HEADER_LEN_BYTES};
use crate::wire::{
    Gathered, GatheredBytes, GatheredOffsets, U32s, WireBackend, WireMdOut, WireSection,
    WireSectionOut,
};
use crate::{ARCHIVE_LEN_MAX_BYTES, BACKENDS_MAX};

/// Builds one agent's metadata blob: backends, then regions in any order.
///
/// Mistakes in `backend` and `region` calls are remembered and reported by
/// [`MdWriter::finish`], which also sorts every section and refuses overlaps, so a
/// blob it returns always passes [`PeerMd::from_bytes`](crate::PeerMd::from_bytes).
/// The encoding is canonical: the same content gives the same bytes whatever the
/// order of `region` calls.
#[derive(Debug, Clone)]
pub struct MdWriter {
    agent: String,
    generation: u64,
    flags: u16,
    /// Backends, indexed by the index `backend` returned.
    backends: Vec<WireBackend>,
    /// Sections in order of first use, columns in call order. Here the metadata
    /// columns are the writer's own table: `md_refs` holds every region's entry (call
    /// order) and a region whose metadata equals its section's last entry shares it,
    /// so a run of identical metadata is copied once; `finish` rewrites the table for
    /// sorted order.
    sections: Vec<WireSection>,
    /// Runs of `region` calls into one section: (position in `sections`, call
    /// count). Maps a section's region back to its call index for error messages.
    section_runs: Vec<(usize, u32)>,
    /// Position in `sections` of the section used last (regions come in runs).
    last_section: usize,
    /// Number of `region` calls so far.
    region_calls: usize,
    /// The first mistake seen in a `backend` or `region` call.
    first_error: Option<Error>,
    /// Sections of an earlier writer ([`MdWriter::with_scratch`]), taken (cleared) by
    /// `switch_section` before it allocates a new one.
    spare: Vec<WireSection>,
}

/// The column buffers of a finished writer ([`MdWriter::finish_recycling`]), for the
/// next one ([`MdWriter::with_scratch`]). Holds no metadata that outlives its use:
/// every buffer is cleared before it is written again.
#[derive(Debug, Default)]
pub struct MdScratch {
    sections: Vec<WireSection>,
}

impl MdWriter {
    /// A writer for agent `agent` at metadata generation `generation`.
    pub fn new(agent: &str, generation: u64) -> MdWriter {
        MdWriter {
            agent: agent.to_owned(),
            generation,
            flags: 0,
            backends: Vec::new(),
            sections: Vec::new(),
            section_runs: Vec::new(),
            last_section: 0,
            region_calls: 0,
            first_error: None,
            spare: Vec::new(),
        }
    }

    /// Mark the blob as partial metadata (selected regions; a loader accumulates it
    /// into what it already knows of this agent instead of replacing that).
    pub fn partial(&mut self) -> &mut MdWriter {
        self.flags |= FLAG_PARTIAL;
        self
    }

    /// Add backend `name` (its type name, e.g. "UCX"); returns its index in this blob.
    ///
    /// `conn_info` `None` means the connection info is not included (partial
    /// metadata). Naming the same backend again returns the same index; doing so with
    /// different connection info, an empty name or more than [`BACKENDS_MAX`]
    /// backends makes [`MdWriter::finish`] fail.
    pub fn backend(&mut self, name: &str, conn_info: Option<&[u8]>) -> u8 {
        if let Some(index) = self.backends.iter().position(|b| b.name == name) {
            if self.backends[index].conn_info.as_deref() != conn_info {
                self.remember(Error::invalid(
                    Subject::BackendName(name.to_owned()),
                    "backend added twice with different connection info",
                ));
            }
            return u8::try_from(index).unwrap_or(u8::MAX);
        }
        if name.is_empty() {
            self.remember(Error::invalid(
                Subject::Named("backend name".into()),
                format!("backend #{} has an empty name", self.backends.len()),
            ));
        }
        let Ok(index) = u8::try_from(self.backends.len()) else {
            self.remember(Error::invalid(
                Subject::BackendName(name.to_owned()),
                format!("more than {BACKENDS_MAX} backends in one metadata blob"),
            ));
            return u8::MAX;
        };
        self.backends.push(WireBackend {
            name: name.to_owned(),
            conn_info: conn_info.map(<[u8]>::to_vec),
        });
        index
    }

    /// Make room for `regions` more regions with `public_md_len_bytes` more bytes of
    /// public metadata in section (`backend`, `kind`), so adding them does not regrow
    /// the section's columns. Only a hint: an unknown backend index is ignored here
    /// (and reported by `region`).
    pub fn reserve(
        &mut self,
        backend: u8,
        kind: MemKind,
        regions: usize,
        public_md_len_bytes: usize,
    ) {
        if usize::from(backend) >= self.backends.len() {
            return;
        }
        let position = self.section_position(backend, kind);
        let section = &mut self.sections[position];
        section.addrs.reserve(regions);
        section.lens.reserve(regions);
        section.devs.reserve(regions);
        section.md_refs.reserve(regions);
        section.md_bytes.reserve(public_md_len_bytes);
    }

    /// Add one region to the section (`backend`, `kind`), with its public metadata.
    /// Any order: [`MdWriter::finish`] sorts.
    ///
    /// An unknown backend index, an empty or wrapping range, more than 4 GiB of
    /// public metadata in one section, or a range that overlaps another region of
    /// the same section makes `finish` fail.
    pub fn region(&mut self, backend: u8, kind: MemKind, desc: Desc, public_md: &[u8]) {
        let call_index = self.region_calls;
        self.region_calls += 1;
        if usize::from(backend) >= self.backends.len() {
            return self.remember(Error::invalid(
                region_subject(call_index, desc),
                format!(
                    "names backend #{backend}, but only {} backends were added",
                    self.backends.len()
                ),
            ));
        }
        if desc.len == 0 || desc.end().is_none() {
            return self.remember(Error::invalid(
                region_subject(call_index, desc),
                "region is empty or wraps the address space",
            ));
        }
        if u32::try_from(call_index).is_err() {
            return self.remember(Error::invalid(
                region_subject(call_index, desc),
                "too many regions for one metadata blob",
            ));
        }
        let position = self.section_position(backend, kind);
        let section = &mut self.sections[position];
        // The section's last entry (there is one once a region was added).
        let entries = section.md_offsets.len() - 1;
        if entries > 0 {
            let last_start = section.md_offsets[entries - 1] as usize;
            if same_md(&section.md_bytes[last_start..], public_md) {
                section.addrs.push(desc.addr);
                section.lens.push(desc.len);
                section.devs.push(desc.dev);
                section.md_refs.push(entries as u32 - 1);
                return self.count_run(position);
            }
        }
        let md_end = section.md_bytes.len() + public_md.len();
        let Ok(md_end) = u32::try_from(md_end) else {
            return self.remember(Error::invalid(
                region_subject(call_index, desc),
                format!(
                    "section (backend #{backend}, {kind}) would hold more than the 4 GiB of \
                     public metadata a section can hold"
                ),
            ));
        };
        section.addrs.push(desc.addr);
        section.lens.push(desc.len);
        section.devs.push(desc.dev);
        section.md_bytes.extend_from_slice(public_md);
        section.md_offsets.push(md_end);
        // At most one entry per region, and regions are fewer than u32::MAX.
        section.md_refs.push(entries as u32);
        self.count_run(position);
    }

    /// Count a `region` call into section `position` in `section_runs`.
    #[inline]
    fn count_run(&mut self, position: usize) {
        match self.section_runs.last_mut() {
            Some((run_position, count)) if *run_position == position => *count += 1,
            _ => self.section_runs.push((position, 1)),
        }
    }

    /// The position in `sections` of section (`backend`, `kind`), created on first use.
    #[inline]
    fn section_position(&mut self, backend: u8, kind: MemKind) -> usize {
        let last = self.sections.get(self.last_section);
        if last.map(|s| (s.backend, s.kind)) != Some((backend, kind as u8)) {
            self.switch_section(backend, kind);
        }
        self.last_section
    }

    /// Make section (`backend`, `kind`) the last used, created if new.
    #[cold]
    fn switch_section(&mut self, backend: u8, kind: MemKind) {
        let wanted = (backend, kind as u8);
        let found = self
            .sections
            .iter()
            .position(|s| (s.backend, s.kind) == wanted);
        self.last_section = found.unwrap_or_else(|| {
            let section = match self.spare.pop() {
                Some(mut spare) => {
                    spare.backend = backend;
                    spare.kind = kind as u8;
                    spare.addrs.clear();
                    spare.lens.clear();
                    spare.devs.clear();
                    spare.md_offsets.clear();
                    spare.md_offsets.push(0);
                    spare.md_refs.clear();
                    spare.md_bytes.clear();
                    spare
                }
                None => WireSection {
                    backend,
                    kind: kind as u8,
                    addrs: Vec::new(),
                    lens: Vec::new(),
                    devs: Vec::new(),
                    md_offsets: vec![0],
                    md_refs: Vec::new(),
                    md_bytes: Vec::new(),
                },
            };
            self.sections.push(section);
            self.sections.len() - 1
        });
    }

    /// The `region` call index of region `local` (call order) of section `position`.
    fn call_index(&self, position: usize, local: usize) -> usize {
        let mut remaining = local;
        let mut calls_before = 0;
        for &(run_position, count) in &self.section_runs {
            let count = count as usize;
            if run_position == position {
                if remaining < count {
                    return calls_before + remaining;
                }
                remaining -= count;
            }
            calls_before += count;
        }
        calls_before
    }

    /// Encode the blob: header, then the rkyv archive.
    ///
    /// Fails with [`Error::InvalidParam`] on an empty agent name, on any mistake
    /// remembered from `backend`/`region`, or on overlapping regions within a section
    /// (naming both by their `region` call order).
    pub fn finish(self) -> Result<Vec<u8>, Error> {
        self.encode()
    }

    /// [`MdWriter::finish`], also giving back the writer's column buffers, cleared, for
    /// the next writer ([`MdWriter::with_scratch`]). An agent that publishes its
    /// metadata again and again reuses them instead of allocating (and, past the
    /// allocator's mmap threshold, faulting in) megabytes per call: at 100,000 regions
    /// that was most of the encode time.
    pub fn finish_recycling(self) -> (Result<Vec<u8>, Error>, MdScratch) {
        let result = self.encode();
        let mut spare = self.spare;
        spare.extend(self.sections);
        (result, MdScratch { sections: spare })
    }

    /// A writer like [`MdWriter::new`] whose sections reuse the buffers of `scratch`.
    pub fn with_scratch(agent: &str, generation: u64, scratch: MdScratch) -> MdWriter {
        let mut writer = MdWriter::new(agent, generation);
        writer.spare = scratch.sections;
        writer
    }

    fn encode(&self) -> Result<Vec<u8>, Error> {
        if let Some(error) = &self.first_error {
            return Err(error.clone());
        }
        if self.agent.is_empty() {
            return Err(Error::invalid(
                Subject::Named("agent name".into()),
                "agent name is empty",
            ));
        }
        // Per section: whether lengths and devices are each one value, and whether the
        // regions are then already sorted and apart (the usual case: one pass).
        let shapes = self
            .sections
            .iter()
            .map(|section| {
                let (lens, devs) = (is_uniform(&section.lens), is_uniform(&section.devs));
                let sorted_apart = lens && devs && ascending_apart(&section.addrs, &section.lens);
                (lens, devs, sorted_apart)
            })
            .collect::<Vec<(bool, bool, bool)>>();
        let orders = self
            .sections
            .iter()
            .zip(&shapes)
            .map(|(section, &(_, _, sorted_apart))| {
                if sorted_apart {
                    return None;
                }
                let in_order = section
                    .devs
                    .iter()
                    .zip(&section.addrs)
                    .zip(section.devs.iter().zip(&section.addrs).skip(1))
                    .all(|(a, b)| a <= b);
                (!in_order).then(|| sorted_order(&section.devs, &section.addrs))
            })
            .collect::<Vec<Option<Vec<u32>>>>();
        for (position, ((section, order), shape)) in
            self.sections.iter().zip(&orders).zip(&shapes).enumerate()
        {
            if !shape.2 {
                self.check_no_overlap(position, section, order.as_deref())?;
            }
        }
        // Per section: which call-order region starts each run of identical metadata
        // (in sorted order), and each region's entry, when that saves anything.
        let entries = self
            .sections
            .iter()
            .zip(&orders)
            .map(|(section, order)| metadata_entries(section, order.as_deref()))
            .collect::<Vec<(Option<Vec<u32>>, Vec<u32>, usize)>>();
        let mut sections: Vec<WireSectionOut<'_>> = self
            .sections
            .iter()
            .zip(&orders)
            .zip(&entries)
            .zip(&shapes)
            // A section only reserved, never filled, is left out (none is empty).
            .filter(|(((section, _), _), _)| !section.addrs.is_empty())
            .map(
                |(
                    ((section, order), (unique, refs, md_len_bytes)),
                    &(uniform_lens, uniform_devs, _),
                )| {
                    let order = order.as_deref();
                    let entry_order = unique.as_deref();
                    WireSectionOut {
                        backend: section.backend,
                        kind: section.kind,
                        addrs: Gathered {
                            values: &section.addrs,
                            order,
                            uniform: false,
                        },
                        lens: Gathered {
                            values: &section.lens,
                            order,
                            uniform: uniform_lens,
                        },
                        devs: Gathered {
                            values: &section.devs,
                            order,
                            uniform: uniform_devs,
                        },
                        md_offsets: GatheredOffsets {
                            offsets: &section.md_offsets,
                            order: entry_order,
                        },
                        md_refs: U32s(refs),
                        md_bytes: GatheredBytes {
                            bytes: &section.md_bytes,
                            offsets: &section.md_offsets,
                            order: entry_order,
                            len_bytes: *md_len_bytes,
                        },
                    }
                },
            )
            .collect();
        sections.sort_unstable_by_key(|s| (s.backend, s.kind));

        let len_bytes = HEADER_LEN_BYTES
            + 256
            + self.agent.len()
            + self
                .backends
                .iter()
                .map(|b| 32 + b.name.len() + b.conn_info.as_ref().map_or(0, Vec::len))
                .sum::<usize>()
            + sections
                .iter()
                .map(|s| {
                    64 + 8 * (s.addrs.len() + s.lens.len() + s.devs.len())
                        + 4 * (s.md_offsets.len() + s.md_refs.0.len())
                        + s.md_bytes.len_bytes
                })
                .sum::<usize>();
        if len_bytes > ARCHIVE_LEN_MAX_BYTES {
            return Err(Error::invalid(
                Subject::PeerName(self.agent.clone()),
                format!(
                    "metadata would take about {len_bytes} bytes, more than the \
                     {ARCHIVE_LEN_MAX_BYTES}-byte limit"
                ),
            ));
        }
        let wire = WireMdOut {
            agent: &self.agent,
            generation: self.generation,
            backends: &self.backends,
            sections,
        };
        let mut out = Vec::with_capacity(len_bytes);
        out.extend_from_slice(&header::encode(Format::Metadata, self.flags));
        rkyv::api::high::to_bytes_in::<_, RkyvError>(&wire, out).map_err(|e| {
            Error::invalid(
                Subject::PeerName(self.agent.clone()),
                format!("metadata does not fit the wire format: {e}"),
            )
        })
    }

    /// Refuse the first region of `section` (at `position`) that overlaps its
    /// predecessor in sorted order.
    fn check_no_overlap(
        &self,
        position: usize,
        section: &WireSection,
        order: Option<&[u32]>,
    ) -> Result<(), Error> {
        let mut previous: Option<usize> = None;
        for k in 0..section.addrs.len() {
            let i = order.map_or(k, |order| order[k] as usize);
            if let Some(p) = previous {
                // Regions were checked not to wrap in `region`.
                let previous_end = section.addrs[p].saturating_add(section.lens[p]);
                if section.devs[p] == section.devs[i] && previous_end > section.addrs[i] {
                    let desc = Desc::new(section.addrs[i], section.lens[i], section.devs[i]);
                    let kind = MemKind::from_u8(section.kind).map_or("?", MemKind::name);
                    return Err(Error::invalid(
                        region_subject(self.call_index(position, i), desc),
                        format!(
                            "overlaps region #{} (addr {:#x}, len {}, dev {}) in section \
                             (backend #{}, {kind})",
                            self.call_index(position, p),
                            section.addrs[p],
                            section.lens[p],
                            section.devs[p],
                            section.backend
                        ),
                    ));
                }
            }
            previous = Some(i);
        }
        Ok(())
    }

    fn remember(&mut self, error: Error) {
        self.first_error.get_or_insert(error);
    }
}

/// Positions of the regions in ascending (dev, addr) order; equal keys keep call
/// order. An LSD radix sort over the bytes that differ between keys: registered
/// ranges share most of their bytes, so this is a few linear passes.
fn sorted_order(devs: &[u64], addrs: &[u64]) -> Vec<u32> {
    let count = devs.len();
    let varying = |column: &[u64]| {
        let first = column.first().copied().unwrap_or(0);
        column.iter().fold(0u64, |acc, &v| acc | (v ^ first))
    };
    let (addr_varying, dev_varying) = (varying(addrs), varying(devs));
    // Digits from least to most significant: addr bytes 0..8, then dev bytes 0..8.
    let digits: Vec<u32> = (0..16u32)
        .filter(|&d| {
            let mask = if d < 8 { addr_varying } else { dev_varying };
            (mask >> (8 * (d % 8))) & 0xff != 0
        })
        .collect();
    let digit_of = |i: usize, d: u32| -> usize {
        let value = if d < 8 { addrs[i] } else { devs[i] };
        ((value >> (8 * (d % 8))) & 0xff) as usize
    };
    // Every digit's histogram in one sequential pass (they do not depend on order).
    let mut starts = vec![[0u32; 256]; digits.len()];
    for i in 0..count {
        for (histogram, &d) in starts.iter_mut().zip(&digits) {
            histogram[digit_of(i, d)] += 1;
        }
    }
    let mut order: Vec<u32> = (0..count as u32).collect();
    let mut scratch = vec![0u32; if digits.is_empty() { 0 } else { count }];
    for (histogram, &d) in starts.iter_mut().zip(&digits) {
        let mut running = 0;
        for slot in histogram.iter_mut() {
            let n = *slot;
            *slot = running;
            running += n;
        }
        for &i in &order {
            let bucket = digit_of(i as usize, d);
            scratch[histogram[bucket] as usize] = i;
            histogram[bucket] += 1;
        }
        std::mem::swap(&mut order, &mut scratch);
    }
    order
}

/// Whether `addrs`, each the start of a region `lens[0]` long (one length for all),
/// ascend by at least that length: sorted and non-overlapping on one device. Regions
/// were checked not to wrap in `region`.
fn ascending_apart(addrs: &[u64], lens: &[u64]) -> bool {
    let Some(&len) = lens.first() else {
        return true;
    };
    addrs.windows(2).all(|w| w[0] < w[1] && w[1] - w[0] >= len)
}

/// `a == b` for public metadata, inline: entries are a few dozen bytes, where a call
/// to `memcmp` costs more than the comparison.
#[inline]
fn same_md(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let Some(last) = a.len().checked_sub(8) else {
        return a.iter().zip(b).all(|(x, y)| x == y);
    };
    // 8-byte words from the start, then the last 8 bytes (overlapping the one before).
    let word = |bytes: &[u8], at: usize| {
        bytes
            .get(at..)
            .and_then(<[u8]>::first_chunk::<8>)
            .map(|w| u64::from_ne_bytes(*w))
    };
    let mut at = 0;
    while at < last {
        if word(a, at) != word(b, at) {
            return false;
        }
        at += 8;
    }
    word(a, last) == word(b, last)
}

/// Whether every value of `column` is the same (then it is stored once).
fn is_uniform(column: &[u64]) -> bool {
    column.windows(2).all(|w| w[0] == w[1])
}

/// The metadata entries of `section` in sorted order (`order`, `None` = call order):
/// runs of identical public metadata share one entry. Returns the writer entry of each
/// output entry (`None` when they are the writer's entries as they are), each region's
/// output entry (empty when every region has its own entry, or there is only one) and
/// the bytes the entries take.
fn metadata_entries(
    section: &WireSection,
    order: Option<&[u32]>,
) -> (Option<Vec<u32>>, Vec<u32>, usize) {
    let count = section.addrs.len();
    let writer_entries = section.md_offsets.len() - 1;
    if writer_entries <= 1 {
        // One entry for every region (the usual case: rkeys that do not vary).
        return (None, Vec::new(), section.md_bytes.len());
    }
    if order.is_none() {
        // Added in sorted order: `region` already merged every run (a region shares
        // the previous region's entry when their metadata is the same), so the
        // writer's entries are the output's.
        let refs = if writer_entries == count {
            Vec::new()
        } else {
            section.md_refs.clone()
        };
        return (None, refs, section.md_bytes.len());
    }
    let offsets = &section.md_offsets;
    let md =
        |e: u32| &section.md_bytes[offsets[e as usize] as usize..offsets[e as usize + 1] as usize];
    let entry_of = |k: usize| section.md_refs[order.map_or(k, |order| order[k] as usize)];
    let mut unique: Vec<u32> = Vec::new();
    let mut refs: Vec<u32> = Vec::with_capacity(count);
    let mut len_bytes = 0;
    for k in 0..count {
        let e = entry_of(k);
        // Writer entries that differ can still hold the same bytes (runs that sorting
        // brings together).
        let same = unique
            .last()
            .is_some_and(|&u| u == e || same_md(md(u), md(e)));
        if !same {
            unique.push(e);
            len_bytes += md(e).len();
        }
        refs.push(unique.len() as u32 - 1);
    }
    if unique.len() == 1 || unique.len() == count {
        // One entry for all, or one per region: no references needed.
        refs.clear();
    }
    let as_written =
        unique.len() == writer_entries && unique.iter().enumerate().all(|(j, &e)| e as usize == j);
    ((!as_written).then_some(unique), refs, len_bytes)
}

/// The subject naming region `call_index` (in `region` call order).
fn region_subject(call_index: usize, desc: Desc) -> Subject {
    Subject::Descriptor {
        index: u32::try_from(call_index).unwrap_or(u32::MAX),
        addr: desc.addr,
        len: desc.len,
        dev: desc.dev,
    }
}

#[cfg(test)]
mod tests {
    use super::sorted_order;
    use proptest::prelude::*;

    proptest! {
        /// The radix sort agrees with a stable comparison sort.
        #[test]
        fn radix_order_matches_stable_sort(keys in proptest::collection::vec(
            (prop_oneof![Just(0u64), Just(3), any::<u64>()], prop_oneof![0u64..64, any::<u64>()]),
            0..300,
        )) {
            let devs: Vec<u64> = keys.iter().map(|k| k.0).collect();
            let addrs: Vec<u64> = keys.iter().map(|k| k.1).collect();
            let mut want: Vec<u32> = (0..keys.len() as u32).collect();
            want.sort_by_key(|&i| keys[i as usize]);
            prop_assert_eq!(sorted_order(&devs, &addrs), want);
        }
    }
}
