//! Ferry's storage layer: typed generational handles, plain data types shared by every
//! crate (memory kinds, descriptors), struct-of-arrays tables and the section index.
//!
//! Invariants of this crate:
//! - no I/O, no threads, no `unsafe` (the crate forbids it);
//! - a handle that outlived its row is refused by generation, never mapped to another row;
//! - every column of a table has the same length (checked in debug builds).
#![forbid(unsafe_code)]

mod error;
mod handles;
mod md_arena;
mod section;
mod table;
mod types;

pub use error::{Error, Result, Subject};
pub use handles::{
    AgentTag, BackendId, PeerId, PrepId, RegionId, XferId, SLOTS_MAX, TAG_MAX, TAG_SHIFT,
};
pub use md_arena::{MdArena, MdEntries, MdSpan};
pub use section::{SectionIndex, SectionInsertError};
pub use table::{Column, RegionRow, RegionTable, RowPush, RowRemove, Rows};
pub use types::{BackendMask, Desc, Endpoint, MemKind, Op, StridedDesc, MAX_BACKENDS};

/// Re-export of the key trait so users can convert handles to and from `u64` tags.
pub use slotmap::{Key, KeyData};

/// Turn any handle into the `u64` tag that travels through C or the kernel.
pub fn handle_to_tag<K: Key>(key: K) -> u64 {
    key.data().as_ffi()
}

/// Turn a `u64` tag back into a handle. The result must still be checked against its
/// table: a forged or stale tag simply fails the lookup.
pub fn handle_from_tag<K: Key + From<KeyData>>(tag: u64) -> K {
    K::from(KeyData::from_ffi(tag))
}
