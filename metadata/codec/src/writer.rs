//! Building an agent-metadata blob.

use ferry_storage::{Desc, Error, MemKind, Subject};
use rkyv::rancor::Error as RkyvError;

use crate::header::{self, Format, FLAG_PARTIAL, HEADER_LEN_BYTES};
use crate::wire::{WireBackend, WireMd, WireSection};
use crate::BACKENDS_MAX;

/// Builds one agent's metadata blob: backends, then regions in any order.
///
/// Mistakes in `backend` and `region` calls are remembered and reported by
/// [`MdWriter::finish`], which also sorts every section and refuses overlaps, so a
/// blob it returns always passes [`PeerMd::from_bytes`](crate::PeerMd::from_bytes).
#[derive(Debug, Clone)]
pub struct MdWriter {
    agent: String,
    generation: u64,
    flags: u16,
    /// Backends, indexed by the index `backend` returned.
    backends: Vec<WireBackend>,
    /// Regions, indexed by call order.
    regions: Vec<PendingRegion>,
    /// Public metadata of all regions, concatenated in call order.
    md_bytes: Vec<u8>,
    /// The first mistake seen in a `backend` or `region` call.
    first_error: Option<Error>,
}

#[derive(Debug, Clone, Copy)]
struct PendingRegion {
    backend: u8,
    kind: MemKind,
    desc: Desc,
    md_start: usize,
    md_end: usize,
}

impl MdWriter {
    /// A writer for agent `agent` at metadata generation `generation`.
    pub fn new(agent: &str, generation: u64) -> MdWriter {
        MdWriter {
            agent: agent.to_owned(),
            generation,
            flags: 0,
            backends: Vec::new(),
            regions: Vec::new(),
            md_bytes: Vec::new(),
            first_error: None,
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

    /// Add one region to the section (`backend`, `kind`), with its public metadata.
    /// Any order: [`MdWriter::finish`] sorts.
    ///
    /// An unknown backend index, an empty or wrapping range, or a range that
    /// overlaps another region of the same section makes `finish` fail.
    pub fn region(&mut self, backend: u8, kind: MemKind, desc: Desc, public_md: &[u8]) {
        let call_index = self.regions.len();
        if usize::from(backend) >= self.backends.len() {
            self.remember(Error::invalid(
                region_subject(call_index, desc),
                format!(
                    "names backend #{backend}, but only {} backends were added",
                    self.backends.len()
                ),
            ));
        }
        if desc.len == 0 || desc.end().is_none() {
            self.remember(Error::invalid(
                region_subject(call_index, desc),
                "region is empty or wraps the address space",
            ));
        }
        let md_start = self.md_bytes.len();
        self.md_bytes.extend_from_slice(public_md);
        self.regions.push(PendingRegion {
            backend,
            kind,
            desc,
            md_start,
            md_end: self.md_bytes.len(),
        });
    }

    /// Encode the blob: header, then the rkyv archive.
    ///
    /// Fails with [`Error::InvalidParam`] on an empty agent name, on any mistake
    /// remembered from `backend`/`region`, on overlapping regions within a section
    /// (naming both, by call order), or when a section's public metadata exceeds
    /// 4 GiB or the blob has more than `u32::MAX - 1` regions.
    pub fn finish(self) -> Result<Vec<u8>, Error> {
        if let Some(error) = self.first_error {
            return Err(error);
        }
        if self.agent.is_empty() {
            return Err(Error::invalid(
                Subject::Named("agent name".into()),
                "agent name is empty",
            ));
        }
        if self.regions.len() >= u32::MAX as usize {
            return Err(Error::invalid(
                Subject::PeerName(self.agent),
                "too many regions for one metadata blob",
            ));
        }
        // Sort keys with the call index last, so equal starts stay detectable.
        let mut order: Vec<(u8, MemKind, u64, u64, u32)> = self
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| (r.backend, r.kind, r.desc.dev, r.desc.addr, i as u32))
            .collect();
        order.sort_unstable();

        let mut sections: Vec<WireSection> = Vec::new();
        let mut run_start = 0;
        while run_start < order.len() {
            let (backend, kind, ..) = order[run_start];
            let run_len = order[run_start..]
                .iter()
                .take_while(|o| o.0 == backend && o.1 == kind)
                .count();
            let run = &order[run_start..run_start + run_len];
            sections.push(self.section(backend, kind, run)?);
            run_start += run_len;
        }

        let wire = WireMd {
            agent: self.agent,
            generation: self.generation,
            backends: self.backends,
            sections,
        };
        let estimate_bytes = 256
            + HEADER_LEN_BYTES
            + wire.agent.len()
            + wire
                .backends
                .iter()
                .map(|b| 32 + b.name.len() + b.conn_info.as_ref().map_or(0, Vec::len))
                .sum::<usize>()
            + wire
                .sections
                .iter()
                .map(|s| 64 + s.addrs.len() * 28 + s.md_bytes.len())
                .sum::<usize>();
        let mut out = Vec::with_capacity(estimate_bytes);
        out.extend_from_slice(&header::encode(Format::Metadata, self.flags));
        rkyv::api::high::to_bytes_in::<_, RkyvError>(&wire, out).map_err(|e| {
            Error::invalid(
                Subject::PeerName(wire.agent.clone()),
                format!("metadata does not fit the wire format: {e}"),
            )
        })
    }

    /// Build the section for one sorted run of regions of (`backend`, `kind`).
    fn section(
        &self,
        backend: u8,
        kind: MemKind,
        run: &[(u8, MemKind, u64, u64, u32)],
    ) -> Result<WireSection, Error> {
        let mut section = WireSection {
            backend,
            kind: kind as u8,
            addrs: Vec::with_capacity(run.len()),
            lens: Vec::with_capacity(run.len()),
            devs: Vec::with_capacity(run.len()),
            md_offsets: Vec::with_capacity(run.len() + 1),
            md_bytes: Vec::new(),
        };
        section.md_offsets.push(0);
        let md_len_bytes: usize = run
            .iter()
            .map(|o| {
                let r = &self.regions[o.4 as usize];
                r.md_end - r.md_start
            })
            .sum();
        if u32::try_from(md_len_bytes).is_err() {
            return Err(Error::invalid(
                Subject::Kind(kind),
                format!(
                    "section (backend #{backend}, {kind}) has {md_len_bytes} bytes of public \
                     metadata, more than the 4 GiB a section can hold"
                ),
            ));
        }
        section.md_bytes.reserve_exact(md_len_bytes);
        let mut previous: Option<(usize, Desc)> = None;
        for o in run {
            let call_index = o.4 as usize;
            let region = &self.regions[call_index];
            let desc = region.desc;
            if let Some((previous_index, prev)) = previous {
                // Validated non-wrapping in `region`.
                let prev_end = prev.addr.saturating_add(prev.len);
                if prev.dev == desc.dev && prev_end > desc.addr {
                    return Err(Error::invalid(
                        region_subject(call_index, desc),
                        format!(
                            "overlaps region #{previous_index} (addr {:#x}, len {}, dev {}) in \
                             section (backend #{backend}, {kind})",
                            prev.addr, prev.len, prev.dev
                        ),
                    ));
                }
            }
            previous = Some((call_index, desc));
            section.addrs.push(desc.addr);
            section.lens.push(desc.len);
            section.devs.push(desc.dev);
            section
                .md_bytes
                .extend_from_slice(&self.md_bytes[region.md_start..region.md_end]);
            // Fits: the section total was checked above.
            section.md_offsets.push(section.md_bytes.len() as u32);
        }
        Ok(section)
    }

    fn remember(&mut self, error: Error) {
        self.first_error.get_or_insert(error);
    }
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
