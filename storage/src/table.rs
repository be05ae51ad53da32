//! Struct-of-arrays tables keyed by generational handles.
//!
//! A table is a [`Rows`] (handle ↔ dense row) plus one [`Column`] per field, all indexed
//! by row. The [`table!`](crate::table) macro writes the table once: `insert` pushes one
//! value onto every column, `remove` swap-removes every column and re-points the moved
//! row's handle, and the equal-length invariant is checked in one place. A column can
//! change length only with a proof ([`RowPush`], [`RowRemove`]) that [`Rows`] hands
//! out, so code outside the macro can read and overwrite cells but never push or remove
//! one column alone. Removal swaps the last row into the hole, so columns stay dense and
//! iteration touches only live rows.

use std::ops::{Deref, DerefMut};

use slotmap::{Key, KeyData, SlotMap};

use crate::types::{BackendMask, Desc, MemKind, MAX_BACKENDS};
use crate::{AgentTag, RegionId};

/// Handle ↔ row bookkeeping shared by every table.
///
/// The handles it hands out carry the owning agent's [`AgentTag`]: the slot map holds
/// untagged keys, `keys` the tagged (public) ones.
#[derive(Debug)]
pub struct Rows<K: Key> {
    /// Row of each live handle (untagged keys).
    slots: SlotMap<K, u32>,
    /// Handle of each row (indexed by row), as handed out.
    keys: Vec<K>,
    /// The owning agent's tag.
    tag: AgentTag,
}

/// Proof that [`Rows::push_row`] just appended row `row`: what lets a [`Column`] grow.
#[derive(Debug)]
pub struct RowPush {
    row: usize,
}

/// Proof that [`Rows::remove_row`] just removed row `row` (the last row moved into
/// it): what lets a [`Column`] shrink.
#[derive(Debug)]
pub struct RowRemove {
    row: usize,
}

impl<K: Key + From<KeyData>> Default for Rows<K> {
    fn default() -> Self {
        Rows::with_capacity(0)
    }
}

impl<K: Key + From<KeyData>> Rows<K> {
    /// Bookkeeping for up to `capacity` rows before growing; untagged handles.
    pub fn with_capacity(capacity: usize) -> Self {
        Rows::tagged(capacity, AgentTag::NONE)
    }

    /// Bookkeeping whose handles carry `tag` (see [`AgentTag`]).
    pub fn tagged(capacity: usize, tag: AgentTag) -> Self {
        Rows {
            slots: SlotMap::with_capacity_and_key(capacity),
            keys: Vec::with_capacity(capacity),
            tag,
        }
    }

    /// The tag this table's handles carry.
    pub fn tag(&self) -> AgentTag {
        self.tag
    }

    /// Number of live rows.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Slots the handle map holds (live and free); it stays flat when rows come and go.
    pub fn slot_capacity(&self) -> usize {
        self.slots.capacity()
    }

    /// Append a row; the caller pushes one value onto every column with the proof.
    #[inline]
    pub fn push_row(&mut self) -> (K, RowPush) {
        let row = self.keys.len();
        debug_assert!(row < crate::SLOTS_MAX, "table beyond SLOTS_MAX rows");
        let key = self.tag.stamp(self.slots.insert(row as u32));
        self.keys.push(key);
        (key, RowPush { row })
    }

    /// Row of `key`, or `None` for a stale or foreign handle.
    #[inline]
    pub fn row(&self, key: K) -> Option<usize> {
        self.slots.get(self.tag.stamp(key)).map(|&r| r as usize)
    }

    /// Handle of `row`.
    #[inline]
    pub fn key(&self, row: usize) -> K {
        self.keys[row]
    }

    /// Handles of all rows, in row order.
    pub fn keys(&self) -> &[K] {
        &self.keys
    }

    /// Remove `key`; the caller swap-removes every column with the proof.
    #[inline]
    pub fn remove_row(&mut self, key: K) -> Option<RowRemove> {
        let row = self.slots.remove(self.tag.stamp(key))? as usize;
        self.keys.swap_remove(row);
        if let Some(&moved) = self.keys.get(row) {
            self.slots[self.tag.stamp(moved)] = row as u32;
        }
        Some(RowRemove { row })
    }
}

/// One field of a table, indexed by row. Reads and in-place writes go through the
/// slice it dereferences to; its length changes only with a [`Rows`] proof.
#[derive(Debug, Clone)]
pub struct Column<T>(Vec<T>);

impl<T> Default for Column<T> {
    fn default() -> Self {
        Column(Vec::new())
    }
}

impl<T> Column<T> {
    /// A column with room for `capacity` rows.
    pub fn with_capacity(capacity: usize) -> Self {
        Column(Vec::with_capacity(capacity))
    }

    /// Append the value of the row `proof` names (it must be the next row).
    #[inline]
    pub fn push(&mut self, proof: &RowPush, value: T) {
        debug_assert_eq!(self.0.len(), proof.row, "column pushed out of step");
        self.0.push(value);
    }

    /// Take the value of the row `proof` names; the last row moves into its place.
    #[inline]
    pub fn swap_remove(&mut self, proof: &RowRemove) -> T {
        self.0.swap_remove(proof.row)
    }

    /// Rows this column holds without growing.
    pub fn capacity(&self) -> usize {
        self.0.capacity()
    }
}

impl<T> Deref for Column<T> {
    type Target = [T];
    #[inline]
    fn deref(&self) -> &[T] {
        &self.0
    }
}

impl<T> DerefMut for Column<T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.0
    }
}

/// Declare a struct-of-arrays table keyed by a handle type, and a plain struct for one
/// of its rows:
///
/// ```
/// ferry_storage::table! {
///     /// Widgets.
///     pub struct Widgets[ferry_storage::RegionId] / Widget {
///         /// Size of each widget, indexed by row.
///         pub(crate) size: u64,
///     }
/// }
/// let mut t = Widgets::with_capacity(4);
/// let id = t.insert(Widget { size: 3 });
/// assert_eq!(t.size[t.row(id).unwrap()], 3);
/// assert_eq!(t.remove(id).map(|w| w.size), Some(3));
/// assert!(t.row(id).is_none());
/// ```
///
/// Columns are [`Column`]s (read and overwrite in place; no push or remove of one
/// column alone). `insert`, `remove`, `row`, `key`, `keys`, `len` are written here once.
#[macro_export]
macro_rules! table {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident [$key:ty] / $row:ident {
            $( $(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            rows: $crate::Rows<$key>,
            $( $(#[$fmeta])* $fvis $field: $crate::Column<$ty>, )*
        }

        #[doc = concat!("One row of [`", stringify!($name), "`], by value: what `insert` takes and `remove` gives back.")]
        $vis struct $row {
            $( $(#[$fmeta])* pub $field: $ty, )*
        }

        impl Default for $name {
            fn default() -> Self {
                Self::with_capacity(0)
            }
        }

        #[allow(dead_code)]
        impl $name {
            /// An empty table with room for `capacity` rows.
            pub fn with_capacity(capacity: usize) -> Self {
                Self::tagged(capacity, $crate::AgentTag::NONE)
            }

            /// An empty table whose handles carry `tag` (see [`AgentTag`]).
            ///
            /// [`AgentTag`]: $crate::AgentTag
            pub fn tagged(capacity: usize, tag: $crate::AgentTag) -> Self {
                $name {
                    rows: $crate::Rows::tagged(capacity, tag),
                    $( $field: $crate::Column::with_capacity(capacity), )*
                }
            }

            /// Number of live rows.
            #[inline]
            pub fn len(&self) -> usize {
                self.check_columns();
                self.rows.len()
            }

            /// Whether no row is live.
            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }

            /// Add a row; returns its handle.
            #[inline(always)]
            pub fn insert(&mut self, row: $row) -> $key {
                let (key, proof) = self.rows.push_row();
                $( self.$field.push(&proof, row.$field); )*
                self.check_columns();
                key
            }

            /// Remove the row of `key`, giving its values back; `None` if stale.
            #[inline(always)]
            pub fn remove(&mut self, key: $key) -> Option<$row> {
                let proof = self.rows.remove_row(key)?;
                let out = $row { $( $field: self.$field.swap_remove(&proof), )* };
                self.check_columns();
                Some(out)
            }

            /// Row of `key`, or `None` for a stale or foreign handle.
            #[inline]
            pub fn row(&self, key: $key) -> Option<usize> {
                self.rows.row(key)
            }

            /// The tag this table's handles carry.
            pub fn tag(&self) -> $crate::AgentTag {
                self.rows.tag()
            }

            /// Handle of `row`.
            #[inline]
            pub fn key(&self, row: usize) -> $key {
                self.rows.key(row)
            }

            /// Handles of all rows, in row order.
            pub fn keys(&self) -> &[$key] {
                self.rows.keys()
            }

            /// Slots the handle map holds (live and free).
            pub fn slot_capacity(&self) -> usize {
                self.rows.slot_capacity()
            }

            #[inline]
            fn check_columns(&self) {
                let n = self.rows.len();
                $( debug_assert_eq!(
                    self.$field.len(),
                    n,
                    concat!(stringify!($name), " column `", stringify!($field), "` out of step")
                ); )*
                let _ = n;
            }
        }
    };
}

table! {
    /// The local agent's registered regions, one row per region.
    #[derive(Debug)]
    pub struct RegionTable[RegionId] / RegionRow {
        /// Memory kind, indexed by row.
        pub kinds: MemKind,
        /// The registered range, indexed by row.
        pub descs: Desc,
        /// Backends that accepted the region, indexed by row.
        pub backends: BackendMask,
        /// Per-backend private token returned by registration, indexed by row then slot.
        pub tokens: [u64; MAX_BACKENDS],
        /// Where the per-backend public metadata (what peers need: slot and bytes) of
        /// the region lies in its world's [`MdArena`](crate::MdArena), indexed by row.
        pub public_md: crate::MdSpan,
        /// Live transfer requests that use the region (counted once per run of
        /// descriptors in it), indexed by row. Deregistration is refused while > 0.
        pub pins: u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone)]
    enum TableOp {
        Insert(u64),
        Remove(usize),
        RemoveStale(usize),
        Lookup(usize),
    }

    fn op() -> impl Strategy<Value = TableOp> {
        prop_oneof![
            3 => any::<u64>().prop_map(TableOp::Insert),
            2 => any::<usize>().prop_map(TableOp::Remove),
            1 => any::<usize>().prop_map(TableOp::RemoveStale),
            2 => any::<usize>().prop_map(TableOp::Lookup),
        ]
    }

    proptest! {
        /// The table behaves like a HashMap from handle to value; removed handles stay dead.
        #[test]
        fn region_table_matches_hashmap_model(ops in proptest::collection::vec(op(), 1..200)) {
            let mut table = RegionTable::default();
            let mut model: HashMap<RegionId, u64> = HashMap::new();
            let mut live: Vec<RegionId> = Vec::new();
            let mut dead: Vec<RegionId> = Vec::new();
            for op in ops {
                match op {
                    TableOp::Insert(addr) => {
                        let id = table.insert(RegionRow { kinds: MemKind::Dram, descs: Desc::new(addr, 1, 0), backends: BackendMask::single(0), tokens: [addr; MAX_BACKENDS], public_md: crate::MdSpan::default(), pins: 0 });
                        prop_assert!(model.insert(id, addr).is_none());
                        live.push(id);
                    }
                    TableOp::Remove(i) if !live.is_empty() => {
                        let id = live.swap_remove(i % live.len());
                        let row = table.remove(id).expect("live handle");
                        let want = model.remove(&id).unwrap();
                        prop_assert_eq!(row.descs.addr, want);
                        prop_assert_eq!(row.tokens[0], want);
                        dead.push(id);
                    }
                    TableOp::RemoveStale(i) if !dead.is_empty() => {
                        let id = dead[i % dead.len()];
                        prop_assert!(table.remove(id).is_none());
                        prop_assert!(table.row(id).is_none());
                    }
                    TableOp::Lookup(i) if !live.is_empty() => {
                        let id = live[i % live.len()];
                        let row = table.row(id).expect("live handle has a row");
                        prop_assert_eq!(table.key(row), id);
                        prop_assert_eq!(table.descs[row].addr, model[&id]);
                    }
                    _ => {}
                }
                prop_assert_eq!(table.len(), model.len());
            }
            for id in dead {
                prop_assert!(table.row(id).is_none());
            }
        }
    }
}
