//! Sort and merge: pure functions, property-tested against a byte-by-byte model.

use ferry_backend_api::Range;

/// Append `next` to `out`, extending the last range instead when both sides continue
/// it exactly: local end == next local start, remote end == next remote start, same
/// devices and same regions (tokens). Returns whether it merged.
#[inline]
pub fn push_merged(out: &mut Vec<Range>, next: Range) -> bool {
    if let Some(last) = out.last_mut() {
        if mergeable(last, &next) {
            last.len += next.len;
            return true;
        }
    }
    out.push(next);
    false
}

/// The request builder's merge step: extend the open range `cur` by `next` when `next`
/// continues it ([`mergeable`]), else close `cur` into `out` and open `next`. Merges
/// exactly like [`push_merged`], with the open range kept in the caller's locals.
#[inline(always)]
pub fn merge_into(out: &mut Vec<Range>, cur: &mut Range, next: Range) {
    if mergeable(cur, &next) {
        cur.len += next.len;
    } else {
        out.push(std::mem::replace(cur, next));
    }
}

/// Whether `next` continues `last` on both sides.
#[inline(always)]
pub fn mergeable(last: &Range, next: &Range) -> bool {
    last.local_addr.wrapping_add(last.len) == next.local_addr
        && last.remote_addr.wrapping_add(last.len) == next.remote_addr
        && last.local_dev == next.local_dev
        && last.remote_dev == next.remote_dev
        && last.local_token == next.local_token
        && last.remote_token == next.remote_token
        && last.local_addr.checked_add(last.len + next.len).is_some()
        && last.remote_addr.checked_add(last.len + next.len).is_some()
}

/// Sort key of a posted request: backend slot, then endpoint, then op, so one batch per
/// backend × endpoint can be cut from the sorted run.
#[inline]
pub fn dispatch_key(slot: u8, endpoint_rank: u64, op: u8) -> u128 {
    (u128::from(slot) << 72) | (u128::from(endpoint_rank) << 8) | u128::from(op)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A copy of `len` bytes between two arrays, in terms of array offsets.
    fn apply(ranges: &[Range], src: &[u8], dst: &mut [u8]) {
        for r in ranges {
            for i in 0..r.len {
                dst[(r.remote_addr + i) as usize] = src[(r.local_addr + i) as usize];
            }
        }
    }

    proptest! {
        /// Merging never changes which bytes land where, and merges every run of
        /// adjacent pairs.
        #[test]
        fn merge_preserves_the_copy(
            pieces in proptest::collection::vec((0u64..64, 1u64..16, any::<bool>(), any::<bool>(), 0u64..2), 1..64),
        ) {
            // Build descriptor pairs that are sometimes adjacent on both sides.
            let mut ranges = Vec::new();
            let (mut l, mut r) = (0u64, 512u64);
            for (jump, len, step_local, step_remote, token) in pieces {
                if !step_local { l += jump; }
                if !step_remote { r = (r + jump * 7) % 400; }
                ranges.push(Range { local_addr: l, remote_addr: r, len, local_token: token, ..Range::default() });
                l += len;
                r += len;
            }
            let mut merged = Vec::new();
            for r in &ranges { push_merged(&mut merged, *r); }
            // The builder's open-range form merges the same way.
            let mut open_form = Vec::new();
            let mut cur = ranges[0];
            for r in &ranges[1..] { merge_into(&mut open_form, &mut cur, *r); }
            open_form.push(cur);
            prop_assert_eq!(&open_form, &merged);

            // Arrays as long as the furthest end either side reaches (64 pieces can
            // walk the local side past 4 KiB).
            let span = ranges
                .iter()
                .map(|r| (r.local_addr + r.len).max(r.remote_addr + r.len))
                .max()
                .unwrap_or(0) as usize;
            let src: Vec<u8> = (0..span as u32).map(|i| (i * 31 % 251) as u8).collect();
            let mut want = vec![0u8; span];
            let mut got = vec![0u8; span];
            apply(&ranges, &src, &mut want);
            apply(&merged, &src, &mut got);
            prop_assert_eq!(want, got);
            prop_assert!(merged.len() <= ranges.len());
            prop_assert_eq!(merged.iter().map(|r| r.len).sum::<u64>(), ranges.iter().map(|r| r.len).sum::<u64>());
            // Maximal: no two neighbours in the output could still merge.
            for w in merged.windows(2) {
                prop_assert!(!mergeable(&w[0], &w[1]));
            }
        }
    }

    #[test]
    fn different_tokens_or_devices_never_merge() {
        let a = Range {
            local_addr: 0,
            remote_addr: 0,
            len: 8,
            ..Range::default()
        };
        let mut b = Range {
            local_addr: 8,
            remote_addr: 8,
            len: 8,
            ..Range::default()
        };
        assert!(mergeable(&a, &b));
        b.remote_token = 1;
        assert!(!mergeable(&a, &b));
        b.remote_token = 0;
        b.local_dev = 3;
        assert!(!mergeable(&a, &b));
    }
}
