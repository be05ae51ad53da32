//! The rkyv wire types. Sections are stored struct-of-arrays so the archive is compact
//! and a section can be binary-searched in place.

use rkyv::{Archive, Serialize};

/// One agent's metadata, as archived after the header.
#[derive(Archive, Serialize, Debug)]
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
/// Columns `addrs`, `lens`, `devs` are indexed by position in sort order;
/// `md_offsets` has one more entry: region `i`'s public metadata is
/// `md_bytes[md_offsets[i]..md_offsets[i + 1]]`.
#[derive(Archive, Serialize, Debug)]
pub(crate) struct WireSection {
    /// Index into `WireMd::backends`.
    pub(crate) backend: u8,
    /// `MemKind` wire byte.
    pub(crate) kind: u8,
    /// Start address of each region.
    pub(crate) addrs: Vec<u64>,
    /// Length in bytes of each region (non-zero).
    pub(crate) lens: Vec<u64>,
    /// Device id of each region.
    pub(crate) devs: Vec<u64>,
    /// Offsets into `md_bytes`, starting at 0, non-decreasing, ending at its length.
    pub(crate) md_offsets: Vec<u32>,
    /// Public metadata of all regions, concatenated.
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
