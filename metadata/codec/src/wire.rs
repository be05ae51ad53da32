//! The rkyv wire types. Sections are stored struct-of-arrays so the archive is compact
//! and a section can be binary-searched in place.

use rkyv::munge::munge;
use rkyv::rancor::{Fallible, Source};
use rkyv::ser::{Allocator, Writer, WriterExt};
use rkyv::string::{ArchivedString, StringResolver};
use rkyv::vec::{ArchivedVec, VecResolver};
use rkyv::{Archive, Archived, Place, Serialize};

/// One agent's metadata, as archived after the header. The writer serializes its twin
/// [`WireMdOut`]; this owned form defines the archived layout (and builds test blobs).
#[derive(Archive, Serialize, Debug)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct WireMd {
    /// The agent's unique name (non-empty).
    pub(crate) agent: String,
    /// Generation of this agent's metadata; a change means old addresses are stale.
    pub(crate) generation: u64,
    /// Backends, indexed by the backend index that sections refer to.
    pub(crate) backends: Vec<WireBackend>,
    /// Sections, strictly ascending by (backend, kind).
    pub(crate) sections: Vec<WireSection>,
}

/// One backend of the agent.
#[derive(Archive, Serialize, Debug, Clone)]
pub(crate) struct WireBackend {
    /// Backend type name ("UCX", "POSIX", ...), non-empty, unique in the blob.
    pub(crate) name: String,
    /// Connection info; `None` when not included (partial metadata).
    pub(crate) conn_info: Option<Vec<u8>>,
}

/// All regions of one (backend, memory kind), sorted by (dev, addr), non-overlapping.
///
/// Columns `addrs`, `lens`, `devs` are indexed by position in sort order, except that
/// `lens` and `devs` hold a single value when every region has the same one (the
/// usual case: equal-sized blocks on one device). Public metadata is a table of
/// entries: entry `e` is `md_bytes[md_offsets[e]..md_offsets[e + 1]]`. Region `i` uses
/// entry `md_refs[i]`; when `md_refs` is empty, entry `i`, or the only entry if there is
/// one. The writer stores a run of identical metadata (a memory domain whose rkeys are
/// the same for every region) once.
#[derive(Archive, Serialize, Debug, Clone)]
pub(crate) struct WireSection {
    /// Index into `WireMd::backends`.
    pub(crate) backend: u8,
    /// `MemKind` wire byte.
    pub(crate) kind: u8,
    /// Start address of each region.
    pub(crate) addrs: Vec<u64>,
    /// Length in bytes of each region (non-zero), or one length shared by all.
    pub(crate) lens: Vec<u64>,
    /// Device id of each region, or one device shared by all.
    pub(crate) devs: Vec<u64>,
    /// Offsets into `md_bytes`, one per metadata entry plus one: starting at 0,
    /// non-decreasing, ending at its length; at most one entry per region.
    pub(crate) md_offsets: Vec<u32>,
    /// The metadata entry of each region (each below the entry count), or empty:
    /// region `i` uses entry `i`, or the single entry.
    pub(crate) md_refs: Vec<u32>,
    /// Public metadata entries, concatenated.
    pub(crate) md_bytes: Vec<u8>,
}

/// A descriptor list, as archived after the header.
#[derive(Archive, Serialize, Debug)]
pub(crate) struct WireDescs {
    /// `MemKind` wire byte.
    pub(crate) kind: u8,
    /// Start address of each descriptor.
    pub(crate) addrs: Vec<u64>,
    /// Length in bytes of each descriptor.
    pub(crate) lens: Vec<u64>,
    /// Device id of each descriptor.
    pub(crate) devs: Vec<u64>,
}

/// Serialize-side twin of [`WireMd`]: borrows the writer's columns and writes each
/// section in sorted order straight into the output, with no sorted copy in between.
/// Archives as [`ArchivedWireMd`] (implemented by hand: the derive cannot see through
/// the borrowed fields).
pub(crate) struct WireMdOut<'a> {
    pub(crate) agent: &'a str,
    pub(crate) generation: u64,
    pub(crate) backends: &'a Vec<WireBackend>,
    pub(crate) sections: Vec<WireSectionOut<'a>>,
}

/// Resolver of [`WireMdOut`].
pub(crate) struct WireMdOutResolver {
    agent: StringResolver,
    backends: VecResolver,
    sections: VecResolver,
}

impl Archive for WireMdOut<'_> {
    type Archived = ArchivedWireMd;
    type Resolver = WireMdOutResolver;

    fn resolve(&self, resolver: WireMdOutResolver, out: Place<ArchivedWireMd>) {
        munge!(let ArchivedWireMd { agent, generation, backends, sections } = out);
        ArchivedString::resolve_from_str(self.agent, resolver.agent, agent);
        self.generation.resolve((), generation);
        self.backends.resolve(resolver.backends, backends);
        self.sections.resolve(resolver.sections, sections);
    }
}

impl<S> Serialize<S> for WireMdOut<'_>
where
    S: Fallible + Allocator + Writer + ?Sized,
    S::Error: Source,
{
    fn serialize(&self, serializer: &mut S) -> Result<WireMdOutResolver, S::Error> {
        Ok(WireMdOutResolver {
            agent: ArchivedString::serialize_from_str(self.agent, serializer)?,
            backends: self.backends.serialize(serializer)?,
            sections: self.sections.serialize(serializer)?,
        })
    }
}

/// Serialize-side twin of [`WireSection`]: columns in call order plus the order that
/// sorts them (`None`: already sorted). Archives as [`ArchivedWireSection`].
pub(crate) struct WireSectionOut<'a> {
    pub(crate) backend: u8,
    pub(crate) kind: u8,
    pub(crate) addrs: Gathered<'a>,
    pub(crate) lens: Gathered<'a>,
    pub(crate) devs: Gathered<'a>,
    pub(crate) md_offsets: GatheredOffsets<'a>,
    pub(crate) md_refs: U32s<'a>,
    pub(crate) md_bytes: GatheredBytes<'a>,
}

/// Resolver of [`WireSectionOut`].
pub(crate) struct WireSectionOutResolver {
    addrs: VecResolver,
    lens: VecResolver,
    devs: VecResolver,
    md_offsets: VecResolver,
    md_refs: VecResolver,
    md_bytes: VecResolver,
}

impl Archive for WireSectionOut<'_> {
    type Archived = ArchivedWireSection;
    type Resolver = WireSectionOutResolver;

    fn resolve(&self, resolver: WireSectionOutResolver, out: Place<ArchivedWireSection>) {
        munge!(let ArchivedWireSection { backend, kind, addrs, lens, devs, md_offsets, md_refs, md_bytes } = out);
        self.backend.resolve((), backend);
        self.kind.resolve((), kind);
        self.addrs.resolve(resolver.addrs, addrs);
        self.lens.resolve(resolver.lens, lens);
        self.devs.resolve(resolver.devs, devs);
        self.md_offsets.resolve(resolver.md_offsets, md_offsets);
        self.md_refs.resolve(resolver.md_refs, md_refs);
        self.md_bytes.resolve(resolver.md_bytes, md_bytes);
    }
}

impl<S: Fallible + Writer + ?Sized> Serialize<S> for WireSectionOut<'_> {
    fn serialize(&self, serializer: &mut S) -> Result<WireSectionOutResolver, S::Error> {
        Ok(WireSectionOutResolver {
            addrs: self.addrs.serialize(serializer)?,
            lens: self.lens.serialize(serializer)?,
            devs: self.devs.serialize(serializer)?,
            md_offsets: self.md_offsets.serialize(serializer)?,
            md_refs: self.md_refs.serialize(serializer)?,
            md_bytes: self.md_bytes.serialize(serializer)?,
        })
    }
}

/// Bytes staged per `write` call when gathering a column.
const CHUNK_LEN_BYTES: usize = 4096;

/// A `u64` column written in `order` (position `k` of the output is
/// `values[order[k]]`; `order` is a permutation of the column's positions), or, when
/// `uniform` (every value is the same), as that one value.
pub(crate) struct Gathered<'a> {
    pub(crate) values: &'a [u64],
    pub(crate) order: Option<&'a [u32]>,
    pub(crate) uniform: bool,
}

impl Gathered<'_> {
    /// Values written.
    pub(crate) fn len(&self) -> usize {
        if self.uniform {
            self.values.len().min(1)
        } else {
            self.values.len()
        }
    }
}

impl Archive for Gathered<'_> {
    type Archived = ArchivedVec<Archived<u64>>;
    type Resolver = VecResolver;

    fn resolve(&self, resolver: VecResolver, out: Place<Self::Archived>) {
        ArchivedVec::resolve_from_len(self.len(), resolver, out);
    }
}

impl<S: Fallible + Writer + ?Sized> Serialize<S> for Gathered<'_> {
    fn serialize(&self, serializer: &mut S) -> Result<VecResolver, S::Error> {
        let pos = serializer.align_for::<Archived<u64>>()?;
        let mut chunk = [0u8; CHUNK_LEN_BYTES];
        let mut filled = 0;
        for k in 0..self.len() {
            let i = self.order.map_or(k, |order| order[k] as usize);
            chunk[filled..filled + 8].copy_from_slice(&self.values[i].to_le_bytes());
            filled += 8;
            if filled == CHUNK_LEN_BYTES {
                serializer.write(&chunk)?;
                filled = 0;
            }
        }
        serializer.write(&chunk[..filled])?;
        Ok(VecResolver::from_pos(pos))
    }
}

/// A `u32` column written as it is.
pub(crate) struct U32s<'a>(pub(crate) &'a [u32]);

impl Archive for U32s<'_> {
    type Archived = ArchivedVec<Archived<u32>>;
    type Resolver = VecResolver;

    fn resolve(&self, resolver: VecResolver, out: Place<Self::Archived>) {
        ArchivedVec::resolve_from_len(self.0.len(), resolver, out);
    }
}

impl<S: Fallible + Writer + ?Sized> Serialize<S> for U32s<'_> {
    fn serialize(&self, serializer: &mut S) -> Result<VecResolver, S::Error> {
        let pos = serializer.align_for::<Archived<u32>>()?;
        let mut chunk = [0u8; CHUNK_LEN_BYTES];
        for values in self.0.chunks(CHUNK_LEN_BYTES / 4) {
            for (bytes, value) in chunk.chunks_exact_mut(4).zip(values) {
                bytes.copy_from_slice(&value.to_le_bytes());
            }
            serializer.write(&chunk[..values.len() * 4])?;
        }
        Ok(VecResolver::from_pos(pos))
    }
}

/// Metadata offsets (`n + 1` of them, one per writer entry plus one) rewritten for
/// the entries `order` selects (writer entry indices; `None`: all, as written).
pub(crate) struct GatheredOffsets<'a> {
    pub(crate) offsets: &'a [u32],
    pub(crate) order: Option<&'a [u32]>,
}

impl GatheredOffsets<'_> {
    /// Offsets written.
    pub(crate) fn len(&self) -> usize {
        self.order
            .map_or(self.offsets.len(), |order| order.len() + 1)
    }
}

impl Archive for GatheredOffsets<'_> {
    type Archived = ArchivedVec<Archived<u32>>;
    type Resolver = VecResolver;

    fn resolve(&self, resolver: VecResolver, out: Place<Self::Archived>) {
        ArchivedVec::resolve_from_len(self.len(), resolver, out);
    }
}

impl<S: Fallible + Writer + ?Sized> Serialize<S> for GatheredOffsets<'_> {
    fn serialize(&self, serializer: &mut S) -> Result<VecResolver, S::Error> {
        let pos = serializer.align_for::<Archived<u32>>()?;
        let mut chunk = [0u8; CHUNK_LEN_BYTES];
        let mut filled = 4; // the leading 0
        let mut running = 0u32;
        for k in 0..self.len().saturating_sub(1) {
            let i = self.order.map_or(k, |order| order[k] as usize);
            // The writer keeps offsets non-decreasing and the total within u32.
            running += self.offsets[i + 1] - self.offsets[i];
            chunk[filled..filled + 4].copy_from_slice(&running.to_le_bytes());
            filled += 4;
            if filled == CHUNK_LEN_BYTES {
                serializer.write(&chunk)?;
                filled = 0;
            }
        }
        serializer.write(&chunk[..filled])?;
        Ok(VecResolver::from_pos(pos))
    }
}

/// Concatenated metadata (writer entry `e` is `bytes[offsets[e]..offsets[e + 1]]`)
/// written for the entries `order` selects (`None`: all, as written);
/// `len_bytes` is the length of what that writes.
pub(crate) struct GatheredBytes<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) offsets: &'a [u32],
    pub(crate) order: Option<&'a [u32]>,
    pub(crate) len_bytes: usize,
}

impl Archive for GatheredBytes<'_> {
    type Archived = ArchivedVec<u8>;
    type Resolver = VecResolver;

    fn resolve(&self, resolver: VecResolver, out: Place<Self::Archived>) {
        ArchivedVec::resolve_from_len(self.len_bytes, resolver, out);
    }
}

impl<S: Fallible + Writer + ?Sized> Serialize<S> for GatheredBytes<'_> {
    fn serialize(&self, serializer: &mut S) -> Result<VecResolver, S::Error> {
        let pos = serializer.pos();
        match self.order {
            None => serializer.write(self.bytes)?,
            Some(order) => {
                for &i in order {
                    let (start, end) = (
                        self.offsets[i as usize] as usize,
                        self.offsets[i as usize + 1] as usize,
                    );
                    serializer.write(&self.bytes[start..end])?;
                }
            }
        }
        Ok(VecResolver::from_pos(pos))
    }
}
