//! Copying a range's bytes within this process: what LOOPBACK does for every range and
//! SHM for a peer's mapped segment.

/// Copy `len` bytes from `src` to `dst`, overlap allowed (`memmove`'s semantics).
///
/// A range of 16 to 64 bytes (the usual unmerged descriptor: a token, a small KV entry)
/// is copied inline instead of through a `memmove` call: two or four 16-byte chunks
/// (the ends overlap when the length is not a multiple of 16), all read before the
/// first is written. On a loop of 1,024 shuffled 64 B ranges that takes about a quarter
/// off the copies (`benches/src/shm.rs`, the limit's loop: 3.17–3.70 → 2.31–2.58 µs).
///
/// # Safety
///
/// `src..src + len` is readable and `dst..dst + len` writable for the whole call, and
/// no Rust reference aliases the bytes written.
#[inline(always)]
pub unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    if (16..=64).contains(&len) {
        // SAFETY: 16 ≤ len ≤ 64 and the caller's promise for both ranges.
        unsafe { copy_small(src, dst, len) };
    } else {
        // SAFETY: the caller's promise; `copy` tolerates overlap.
        unsafe { std::ptr::copy(src, dst, len) };
    }
}

/// Copy `16 ≤ len ≤ 64` bytes from `src` to `dst`, overlap allowed.
///
/// # Safety
///
/// `src..src + len` is readable and `dst..dst + len` writable for the call.
#[inline(always)]
unsafe fn copy_small(src: *const u8, dst: *mut u8, len: usize) {
    debug_assert!((16..=64).contains(&len));
    // SAFETY: 16 ≤ len ≤ 64, so every 16-byte chunk read or written (at 0 and
    // `len - 16`, and at 16 and `len - 32` when len ≥ 32) lies inside both ranges (the
    // caller's promise); the accesses are unaligned, and every read happens before the
    // first write.
    unsafe {
        let head = load16(src);
        let tail = load16(src.add(len - 16));
        if len >= 32 {
            let head2 = load16(src.add(16));
            let tail2 = load16(src.add(len - 32));
            store16(dst.add(16), head2);
            store16(dst.add(len - 32), tail2);
        }
        store16(dst, head);
        store16(dst.add(len - 16), tail);
    }
}

/// Sixteen bytes in one vector register. SSE2 is part of x86-64, so this needs no
/// feature check. (Two `[u8; 32]` values were spilled to the stack between the reads
/// and the writes; `u128`s became pairs of 64-bit moves.)
#[cfg(target_arch = "x86_64")]
type Chunk = std::arch::x86_64::__m128i;
#[cfg(not(target_arch = "x86_64"))]
type Chunk = u128;

/// Read 16 bytes at `at`, unaligned.
///
/// # Safety
///
/// `at..at + 16` is readable.
#[inline(always)]
unsafe fn load16(at: *const u8) -> Chunk {
    // SAFETY: the caller's promise; both reads accept any alignment.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_loadu_si128(at.cast())
    }
    #[cfg(not(target_arch = "x86_64"))]
    unsafe {
        std::ptr::read_unaligned(at.cast())
    }
}

/// Write 16 bytes at `at`, unaligned.
///
/// # Safety
///
/// `at..at + 16` is writable and no Rust reference aliases it.
#[inline(always)]
unsafe fn store16(at: *mut u8, chunk: Chunk) {
    // SAFETY: the caller's promise; both writes accept any alignment.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_storeu_si128(at.cast(), chunk)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unsafe {
        std::ptr::write_unaligned(at.cast(), chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::copy_bytes;

    /// `copy_bytes` moves exactly what `copy_within` moves, for every length around the
    /// inline sizes and every overlap (source before, after, or equal to the
    /// destination).
    #[test]
    fn copy_bytes_matches_copy_within_with_any_overlap() {
        let pattern: Vec<u8> = (0..256u32).map(|i| (i * 37 % 251) as u8).collect();
        for len in 0..=80usize {
            for src_at in [0usize, 3, 40, 100] {
                for dst_at in [0usize, 1, 7, 16, 33, 64, 99, 130] {
                    let mut want = pattern.clone();
                    want.copy_within(src_at..src_at + len, dst_at);
                    let mut got = pattern.clone();
                    let base = got.as_mut_ptr();
                    // SAFETY: both sides lie inside `got` (at most 130 + 80 < 256 bytes
                    // in), which nothing else references during the call.
                    unsafe { copy_bytes(base.add(src_at), base.add(dst_at), len) };
                    assert_eq!(got, want, "len {len}, from {src_at} to {dst_at}");
                }
            }
        }
    }
}
