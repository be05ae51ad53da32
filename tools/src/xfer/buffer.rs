//! Registered host memory of the transfer benchmark, written and checked by the tool
//! only while no transfer touches it.

/// A zeroed heap buffer whose bytes backends read and write through its address.
///
/// The tool reads or writes it ([`Buffer::fill`], [`Buffer::zero`],
/// [`Buffer::verify`]) only between transfers, never while one that names it is in
/// flight; that is the promise behind every `unsafe` block here.
pub struct Buffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain bytes owned by this value; concurrent access is ruled
// out by the usage rule above (one worker thread uses a buffer at a time, and only
// between its transfers).
unsafe impl Send for Buffer {}
// SAFETY: as above: `&Buffer` is shared only to read its address.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// `len` bytes, every page touched (so transfers don't measure page faults).
    pub fn zeroed(len: usize) -> Buffer {
        let mut bytes = vec![0u8; len.max(1)].into_boxed_slice();
        for page in bytes.chunks_mut(4096) {
            // A volatile write: calloc'd pages are known to be zero, and a plain
            // store of zero could be dropped, leaving the page unmapped.
            // SAFETY: `page` is a valid, non-empty, exclusively borrowed chunk.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
        }
        let len = bytes.len();
        let ptr = Box::into_raw(bytes).cast::<u8>();
        Buffer { ptr, len }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    // Reason: the buffer is shared memory by design (backends write it through its
    // address); the usage rule above is what makes this exclusive.
    #[allow(clippy::mut_from_ref)]
    fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset <= self.len && len <= self.len - offset);
        // SAFETY: inside the allocation (checked above); no transfer touches the
        // buffer while the tool holds this slice (the type's usage rule), and callers
        // hold it only for the duration of one call.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), len) }
    }

    /// Write `pattern(seed)` into `len` bytes at `offset`.
    pub fn fill(&self, offset: usize, len: usize, seed: u64) {
        for (i, b) in self.slice_mut(offset, len).iter_mut().enumerate() {
            *b = pattern(i as u64, seed);
        }
    }

    /// Zero `len` bytes at `offset`.
    pub fn zero(&self, offset: usize, len: usize) {
        self.slice_mut(offset, len).fill(0);
    }

    /// The first offset (relative to `offset`) whose byte differs from
    /// `pattern(seed)`, if any.
    pub fn verify(&self, offset: usize, len: usize, seed: u64) -> Option<usize> {
        self.slice_mut(offset, len)
            .iter()
            .enumerate()
            .position(|(i, &b)| b != pattern(i as u64, seed))
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of this
        // length; the agents that registered the buffer are dropped before it (they
        // are declared after it wherever both live).
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// The check pattern: byte `i` of an area written with `seed`.
pub fn pattern(i: u64, seed: u64) -> u8 {
    let x = (i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8 ^ (i as u8)
}
