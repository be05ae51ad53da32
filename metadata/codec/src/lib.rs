//! Ferry's rkyv metadata wire format: encode, validate once, read in place.
//!
//! Two formats, each an 8-byte header (4-byte magic, `u16` version, `u16` flags, both
//! little-endian) followed by an rkyv archive:
//!
//! - **agent metadata** ([`MAGIC`]): agent name, generation, per-backend connection
//!   info, and one section per (backend, memory kind) holding that section's regions
//!   sorted by (device, address) as struct-of-arrays columns. [`MdWriter`] builds it;
//!   [`PeerMd::from_bytes`] validates a peer's blob once (structure with bytecheck, then
//!   every semantic invariant) and afterwards answers lookups by binary search inside
//!   the archived bytes.
//! - **descriptor lists** ([`DESCS_MAGIC`]): a memory kind plus address, length and
//!   device columns ([`encode_descs`], [`decode_descs`]).
//!
//! Invariants of this crate:
//! - no `unsafe` (forbidden): the validated archive lives next to its aligned buffer in
//!   a `self_cell`;
//! - no input bytes make it panic; every refusal is an
//!   [`Error::InvalidMetadata`](ferry_storage::Error::InvalidMetadata) naming the check
//!   that failed;
//! - a blob that passes validation satisfies every invariant documented on the wire
//!   types, so lookups never index out of bounds.
#![forbid(unsafe_code)]

mod descs;
mod header;
mod peer;
mod wire;
mod writer;

pub use descs::{decode_descs, encode_descs};
pub use header::{DESCS_MAGIC, FLAG_PARTIAL, HEADER_LEN_BYTES, MAGIC, VERSION};
pub use peer::{PeerMd, RegionView};
pub use writer::{MdScratch, MdWriter};

/// The most backends one blob can name (backend indices are a `u8`).
pub const BACKENDS_MAX: usize = 256;

/// The largest blob or descriptor list this crate encodes (1 GiB): the archive's
/// 32-bit relative offsets must reach across it.
pub const ARCHIVE_LEN_MAX_BYTES: usize = 1 << 30;

#[cfg(test)]
mod tests;
