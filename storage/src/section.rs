//! The section index: all regions of one memory kind known for one agent and backend,
//! kept sorted by (device, start address) so "which region covers [addr, addr+len) on
//! device d" is one binary search. Regions within a section never overlap.

use crate::types::Desc;
use crate::RegionId;

/// Why a region could not be added to a section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SectionInsertError {
    /// The region has zero length or wraps the address space.
    Empty,
    /// The region overlaps an existing one on the same device.
    Overlaps(RegionId),
}

/// Sorted, non-overlapping regions of one (agent, backend, memory kind).
///
/// Columns are indexed by position in sort order.
#[derive(Debug, Default, Clone)]
pub struct SectionIndex {
    /// (device, start) of each region, ascending.
    starts: Vec<(u64, u64)>,
    /// One past the last byte of each region.
    ends: Vec<u64>,
    /// The region at each position.
    regions: Vec<RegionId>,
}

impl SectionIndex {
    /// Number of regions in the section.
    pub fn len(&self) -> usize {
        self.starts.len()
    }

    /// Whether the section is empty.
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// Add `region` covering `desc`. Fails if it is empty or overlaps another region.
    pub fn insert(&mut self, desc: Desc, region: RegionId) -> Result<(), SectionInsertError> {
        let end = match desc.end() {
            Some(end) if desc.len > 0 => end,
            _ => return Err(SectionInsertError::Empty),
        };
        if let Some(other) = self.overlapping(desc) {
            return Err(SectionInsertError::Overlaps(other));
        }
        let pos = self.starts.partition_point(|&s| s < (desc.dev, desc.addr));
        self.starts.insert(pos, (desc.dev, desc.addr));
        self.ends.insert(pos, end);
        self.regions.insert(pos, region);
        Ok(())
    }

    /// A region that shares at least one byte with `desc` on its device, if any: one
    /// binary search (regions never overlap, so only the neighbours can).
    pub fn overlapping(&self, desc: Desc) -> Option<RegionId> {
        let end = desc.end()?;
        let pos = self.starts.partition_point(|&s| s < (desc.dev, desc.addr));
        if pos > 0 && self.starts[pos - 1].0 == desc.dev && self.ends[pos - 1] > desc.addr {
            return Some(self.regions[pos - 1]);
        }
        if pos < self.starts.len() && self.starts[pos].0 == desc.dev && self.starts[pos].1 < end {
            return Some(self.regions[pos]);
        }
        None
    }

    /// Remove the region registered with exactly `desc`; returns whether it was there.
    pub fn remove(&mut self, desc: Desc, region: RegionId) -> bool {
        let pos = self.starts.partition_point(|&s| s < (desc.dev, desc.addr));
        if pos < self.starts.len()
            && self.starts[pos] == (desc.dev, desc.addr)
            && self.regions[pos] == region
        {
            self.starts.remove(pos);
            self.ends.remove(pos);
            self.regions.remove(pos);
            true
        } else {
            false
        }
    }

    /// The region that covers all of `desc`, if any.
    #[inline]
    pub fn covering(&self, desc: Desc) -> Option<RegionId> {
        let end = desc.end()?;
        let pos = self.starts.partition_point(|&s| s <= (desc.dev, desc.addr));
        if pos == 0 {
            return None;
        }
        let i = pos - 1;
        (self.starts[i].0 == desc.dev && end <= self.ends[i]).then(|| self.regions[i])
    }

    /// The region that covers all of `desc`, with its (device, start, end), so callers
    /// can test the next descriptor against it before searching again.
    #[inline]
    pub fn covering_bounds(&self, desc: Desc) -> Option<(RegionId, u64, u64, u64)> {
        let end = desc.end()?;
        let pos = self.starts.partition_point(|&s| s <= (desc.dev, desc.addr));
        if pos == 0 {
            return None;
        }
        let i = pos - 1;
        (self.starts[i].0 == desc.dev && end <= self.ends[i]).then(|| {
            (
                self.regions[i],
                self.starts[i].0,
                self.starts[i].1,
                self.ends[i],
            )
        })
    }

    /// The region registered with exactly `desc` (same start, length and device).
    pub fn exact(&self, desc: Desc) -> Option<RegionId> {
        let pos = self.starts.partition_point(|&s| s < (desc.dev, desc.addr));
        (pos < self.starts.len()
            && self.starts[pos] == (desc.dev, desc.addr)
            && Some(self.ends[pos]) == desc.end())
        .then(|| self.regions[pos])
    }

    /// Regions in sort order with their (device, start, end).
    pub fn iter(&self) -> impl Iterator<Item = (RegionId, u64, u64, u64)> + '_ {
        (0..self.len()).map(|i| {
            (
                self.regions[i],
                self.starts[i].0,
                self.starts[i].1,
                self.ends[i],
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use slotmap::SlotMap;

    proptest! {
        /// `covering` agrees with a linear scan over the accepted regions.
        #[test]
        fn covering_matches_linear_scan(
            regions in proptest::collection::vec((0u64..4, 0u64..10_000, 1u64..500), 0..60),
            queries in proptest::collection::vec((0u64..4, 0u64..11_000, 0u64..600), 1..100),
        ) {
            let mut keys: SlotMap<RegionId, ()> = SlotMap::with_key();
            let mut index = SectionIndex::default();
            let mut accepted: Vec<(Desc, RegionId)> = Vec::new();
            for (dev, addr, len) in regions {
                let desc = Desc::new(addr, len, dev);
                let id = keys.insert(());
                let overlaps = accepted.iter().find(|(d, _)| d.dev == dev && d.addr < addr + len && addr < d.addr + d.len);
                match index.insert(desc, id) {
                    Ok(()) => { prop_assert!(overlaps.is_none()); accepted.push((desc, id)); }
                    Err(SectionInsertError::Overlaps(other)) => {
                        prop_assert!(overlaps.is_some());
                        prop_assert!(accepted.iter().any(|(_, k)| *k == other));
                    }
                    Err(SectionInsertError::Empty) => prop_assert!(false, "non-empty region refused"),
                }
            }
            for (dev, addr, len) in queries.iter().copied() {
                let q = Desc::new(addr, len.max(1), dev);
                let any = accepted.iter().any(|(d, _)| d.dev == dev && d.addr < q.addr + q.len && q.addr < d.addr + d.len);
                prop_assert_eq!(index.overlapping(q).is_some(), any);
            }
            for (dev, addr, len) in queries {
                let q = Desc::new(addr, len, dev);
                let want = accepted.iter().find(|(d, _)| d.dev == dev && d.addr <= addr && addr + len <= d.addr + d.len).map(|(_, k)| *k);
                prop_assert_eq!(index.covering(q), want);
            }
            // Removing everything leaves an empty index.
            for (desc, id) in &accepted {
                prop_assert_eq!(index.exact(*desc), Some(*id));
                prop_assert!(index.remove(*desc, *id));
            }
            prop_assert!(index.is_empty());
        }
    }

    #[test]
    fn empty_and_wrapping_regions_are_refused() {
        let mut keys: SlotMap<RegionId, ()> = SlotMap::with_key();
        let mut index = SectionIndex::default();
        let id = keys.insert(());
        assert_eq!(
            index.insert(Desc::new(5, 0, 0), id),
            Err(SectionInsertError::Empty)
        );
        assert_eq!(
            index.insert(Desc::new(u64::MAX, 2, 0), id),
            Err(SectionInsertError::Empty)
        );
        assert_eq!(index.covering(Desc::new(u64::MAX, 2, 0)), None);
    }
}
