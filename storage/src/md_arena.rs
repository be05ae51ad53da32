//! The public metadata of registered regions, packed in one byte arena.
//!
//! A region's public metadata (one entry per backend that accepted it: the slot and the
//! bytes peers need, e.g. a UCX rkey) is read in one place that matters for speed:
//! encoding the agent's metadata, which visits every region in row order. Kept as a
//! `Vec` of boxed slices per row, that visit chases two pointers per region into
//! wherever the allocator put them; past the cache size (about 50,000 regions here)
//! each is a miss, and encoding 100,000 regions took 26x the time of 15,000. Here the
//! entries of one region sit back to back in one arena, regions in registration order,
//! so the visit streams through memory.
//!
//! Format of one region's record: for each entry, `slot: u8`, `len: u32` (little
//! endian), then `len` bytes. A released record leaves a hole; when the holes outweigh
//! the live bytes (and pass [`MdArena::COMPACT_MIN_BYTES`]), [`MdArena::compact`]
//! rewrites the arena in row order and re-points every row's span.

/// Where one region's record lies in an [`MdArena`]; the empty span (the default)
/// means no entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MdSpan {
    start: u64,
    len_bytes: u32,
}

impl MdSpan {
    /// Bytes of the record (entry headers included).
    pub fn len_bytes(self) -> usize {
        self.len_bytes as usize
    }
}

/// Bytes of an entry's header: slot (1) and length (4).
const ENTRY_HEADER_BYTES: usize = 5;

/// The arena (see the module docs).
#[derive(Debug, Default)]
pub struct MdArena {
    bytes: Vec<u8>,
    /// Bytes of released records still in `bytes`.
    dead_bytes: usize,
}

impl MdArena {
    /// Holes smaller than this are never compacted away (a few deregistrations do not
    /// rewrite a small arena).
    pub const COMPACT_MIN_BYTES: usize = 64 * 1024;

    /// An empty arena (allocates nothing until the first record).
    pub fn new() -> MdArena {
        MdArena::default()
    }

    /// Append one region's record: `entries` as (slot, bytes). `None` when the record
    /// would not fit a span (an entry over 4 GiB, or a record over 4 GiB in all): the
    /// caller refuses the registration.
    pub fn push<'a>(
        &mut self,
        entries: impl IntoIterator<Item = (u8, &'a [u8])> + Clone,
    ) -> Option<MdSpan> {
        let mut len_bytes = 0usize;
        for (_, bytes) in entries.clone() {
            u32::try_from(bytes.len()).ok()?;
            len_bytes = len_bytes.checked_add(ENTRY_HEADER_BYTES + bytes.len())?;
        }
        let len_bytes = u32::try_from(len_bytes).ok()?;
        let start = self.bytes.len() as u64;
        self.bytes.reserve(len_bytes as usize);
        for (slot, bytes) in entries {
            self.bytes.push(slot);
            self.bytes
                .extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            self.bytes.extend_from_slice(bytes);
        }
        Some(MdSpan { start, len_bytes })
    }

    /// The entries of the record at `span`: (slot, bytes).
    pub fn entries(&self, span: MdSpan) -> MdEntries<'_> {
        let start = span.start as usize;
        MdEntries {
            rest: self
                .bytes
                .get(start..start + span.len_bytes as usize)
                .unwrap_or(&[]),
        }
    }

    /// Forget the record at `span` (its bytes become a hole). Returns whether the arena
    /// should now be compacted ([`MdArena::compact`]).
    pub fn release(&mut self, span: MdSpan) -> bool {
        self.dead_bytes += span.len_bytes as usize;
        self.dead_bytes >= Self::COMPACT_MIN_BYTES && self.dead_bytes > self.live_bytes()
    }

    /// Bytes of live records.
    pub fn live_bytes(&self) -> usize {
        self.bytes.len() - self.dead_bytes
    }

    /// Bytes of holes left by released records.
    pub fn dead_bytes(&self) -> usize {
        self.dead_bytes
    }

    /// Rewrite the arena with only the records of `spans` (every live row's span, in
    /// row order), re-pointing each span. The new arena holds exactly the live bytes.
    pub fn compact(&mut self, spans: &mut [MdSpan]) {
        let mut bytes = Vec::with_capacity(self.live_bytes());
        for span in spans.iter_mut() {
            let start = span.start as usize;
            let new_start = bytes.len() as u64;
            bytes.extend_from_slice(&self.bytes[start..start + span.len_bytes as usize]);
            span.start = new_start;
        }
        self.bytes = bytes;
        self.dead_bytes = 0;
    }
}

/// The entries of one region's record (see [`MdArena::entries`]).
#[derive(Clone, Debug)]
pub struct MdEntries<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for MdEntries<'a> {
    type Item = (u8, &'a [u8]);

    #[inline]
    fn next(&mut self) -> Option<(u8, &'a [u8])> {
        let (header, rest) = self.rest.split_first_chunk::<ENTRY_HEADER_BYTES>()?;
        let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
        // Records are written by `push` only, so the length is always in bounds; a
        // short record ends the iteration rather than panicking.
        let (bytes, rest) = rest.split_at_checked(len)?;
        self.rest = rest;
        Some((header[0], bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn collect(arena: &MdArena, span: MdSpan) -> Vec<(u8, Vec<u8>)> {
        arena
            .entries(span)
            .map(|(slot, bytes)| (slot, bytes.to_vec()))
            .collect()
    }

    #[test]
    fn records_round_trip() {
        let mut arena = MdArena::new();
        let a = arena
            .push([(0u8, &b"rkey"[..]), (3, &b""[..]), (7, &[1, 2, 3][..])])
            .unwrap();
        let empty = arena.push(std::iter::empty()).unwrap();
        let b = arena.push([(1u8, &b"x"[..])]).unwrap();
        assert_eq!(
            collect(&arena, a),
            vec![(0, b"rkey".to_vec()), (3, vec![]), (7, vec![1, 2, 3])]
        );
        assert_eq!(collect(&arena, empty), vec![]);
        assert_eq!(collect(&arena, MdSpan::default()), vec![]);
        assert_eq!(collect(&arena, b), vec![(1, b"x".to_vec())]);
    }

    proptest! {
        /// Against a model (a Vec of records per row): push, release with swap-remove
        /// (as the region table removes rows), compact when told to.
        #[test]
        fn matches_model(ops in proptest::collection::vec(
            (any::<bool>(), proptest::collection::vec((0u8..8, proptest::collection::vec(any::<u8>(), 0..40)), 0..3), any::<usize>()),
            1..200,
        )) {
            let mut arena = MdArena::new();
            let mut spans: Vec<MdSpan> = Vec::new();
            let mut model: Vec<Vec<(u8, Vec<u8>)>> = Vec::new();
            for (push, record, pick) in ops {
                if push || spans.is_empty() {
                    let span = arena
                        .push(record.iter().map(|(s, b)| (*s, b.as_slice())))
                        .unwrap();
                    spans.push(span);
                    model.push(record);
                } else {
                    let i = pick % spans.len();
                    let span = spans.swap_remove(i);
                    model.swap_remove(i);
                    if arena.release(span) {
                        arena.compact(&mut spans);
                        prop_assert_eq!(arena.dead_bytes(), 0);
                    }
                }
                for (span, record) in spans.iter().zip(&model) {
                    prop_assert_eq!(&collect(&arena, *span), record);
                }
                let live: usize = spans.iter().map(|s| s.len_bytes()).sum();
                prop_assert_eq!(arena.live_bytes(), live);
            }
            arena.compact(&mut spans);
            for (span, record) in spans.iter().zip(&model) {
                prop_assert_eq!(&collect(&arena, *span), record);
            }
        }
    }
}
