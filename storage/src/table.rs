//! Struct-of-arrays tables keyed by generational handles.
//!
//! A table is a [`Rows`] (handle ↔ dense row) plus one `Vec` per field ("column"), all
//! indexed by row. Removal swaps the last row into the hole, so columns stay dense and
//! iteration touches only live rows; the handle of the moved row is re-pointed.

use slotmap::{Key, SlotMap};

use crate::types::{BackendMask, Desc, MemKind, MAX_BACKENDS};
use crate::RegionId;

/// Handle ↔ row bookkeeping shared by every table.
#[derive(Debug)]
pub struct Rows<K: Key> {
    /// Row of each live handle.
    slots: SlotMap<K, u32>,
    /// Handle of each row (indexed by row).
    keys: Vec<K>,
}

impl<K: Key> Default for Rows<K> {
    fn default() -> Self {
        Rows::with_capacity(0)
    }
}

impl<K: Key> Rows<K> {
    /// Bookkeeping for up to `capacity` rows before growing.
    pub fn with_capacity(capacity: usize) -> Self {
        Rows {
            slots: SlotMap::with_capacity_and_key(capacity),
            keys: Vec::with_capacity(capacity),
        }
    }

    /// Number of live rows.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Append a row; the caller pushes one value onto every column.
    pub fn push(&mut self) -> (K, usize) {
        let row = self.keys.len();
        let key = self.slots.insert(row as u32);
        self.keys.push(key);
        (key, row)
    }

    /// Row of `key`, or `None` for a stale or foreign handle.
    pub fn row(&self, key: K) -> Option<usize> {
        self.slots.get(key).map(|&r| r as usize)
    }

    /// Handle of `row`.
    pub fn key(&self, row: usize) -> K {
        self.keys[row]
    }

    /// Handles of all rows, in row order.
    pub fn keys(&self) -> &[K] {
        &self.keys
    }

    /// Remove `key`; returns its row. The caller must `swap_remove(row)` every column.
    pub fn remove(&mut self, key: K) -> Option<usize> {
        let row = self.slots.remove(key)? as usize;
        self.keys.swap_remove(row);
        if let Some(&moved) = self.keys.get(row) {
            self.slots[moved] = row as u32;
        }
        Some(row)
    }
}

/// The local agent's registered regions, one row per region.
#[derive(Debug, Default)]
pub struct RegionTable {
    rows: Rows<RegionId>,
    /// Memory kind, indexed by row.
    pub kinds: Vec<MemKind>,
    /// The registered range, indexed by row.
    pub descs: Vec<Desc>,
    /// Backends that accepted the region, indexed by row.
    pub backends: Vec<BackendMask>,
    /// Per-backend private token returned by registration, indexed by row then slot.
    pub tokens: Vec<[u64; MAX_BACKENDS]>,
    /// Per-backend public metadata (what peers need), indexed by row: (slot, bytes).
    pub public_md: Vec<Vec<(u8, Box<[u8]>)>>,
}

impl RegionTable {
    /// A table sized for `capacity` regions.
    pub fn with_capacity(capacity: usize) -> Self {
        RegionTable {
            rows: Rows::with_capacity(capacity),
            kinds: Vec::with_capacity(capacity),
            descs: Vec::with_capacity(capacity),
            backends: Vec::with_capacity(capacity),
            tokens: Vec::with_capacity(capacity),
            public_md: Vec::with_capacity(capacity),
        }
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.check_columns();
        self.rows.len()
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Add a region; returns its handle and row.
    pub fn insert(
        &mut self,
        kind: MemKind,
        desc: Desc,
        backends: BackendMask,
        tokens: [u64; MAX_BACKENDS],
        public_md: Vec<(u8, Box<[u8]>)>,
    ) -> RegionId {
        let (key, _) = self.rows.push();
        self.kinds.push(kind);
        self.descs.push(desc);
        self.backends.push(backends);
        self.tokens.push(tokens);
        self.public_md.push(public_md);
        self.check_columns();
        key
    }

    /// Row of `id`, or `None` if it is stale.
    pub fn row(&self, id: RegionId) -> Option<usize> {
        self.rows.row(id)
    }

    /// Handle of `row`.
    pub fn key(&self, row: usize) -> RegionId {
        self.rows.key(row)
    }

    /// All live handles in row order.
    pub fn keys(&self) -> &[RegionId] {
        self.rows.keys()
    }

    /// Remove `id`, returning its columns, or `None` if it is stale.
    #[allow(clippy::type_complexity)]
    pub fn remove(
        &mut self,
        id: RegionId,
    ) -> Option<(
        MemKind,
        Desc,
        BackendMask,
        [u64; MAX_BACKENDS],
        Vec<(u8, Box<[u8]>)>,
    )> {
        let row = self.rows.remove(id)?;
        let out = (
            self.kinds.swap_remove(row),
            self.descs.swap_remove(row),
            self.backends.swap_remove(row),
            self.tokens.swap_remove(row),
            self.public_md.swap_remove(row),
        );
        self.check_columns();
        Some(out)
    }

    fn check_columns(&self) {
        let n = self.rows.len();
        debug_assert!(
            self.kinds.len() == n
                && self.descs.len() == n
                && self.backends.len() == n
                && self.tokens.len() == n
                && self.public_md.len() == n,
            "region table columns out of step"
        );
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
                        let id = table.insert(MemKind::Dram, Desc::new(addr, 1, 0), BackendMask::single(0), [addr; MAX_BACKENDS], Vec::new());
                        prop_assert!(model.insert(id, addr).is_none());
                        live.push(id);
                    }
                    TableOp::Remove(i) if !live.is_empty() => {
                        let id = live.swap_remove(i % live.len());
                        let (_, desc, _, tokens, _) = table.remove(id).expect("live handle");
                        let want = model.remove(&id).unwrap();
                        prop_assert_eq!(desc.addr, want);
                        prop_assert_eq!(tokens[0], want);
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
