//! Plain data shared by every Ferry crate.

use std::fmt;

use crate::PeerId;

/// The most backends one agent can hold. Bounds per-region columns and backend masks.
pub const MAX_BACKENDS: usize = 8;

/// The kind of memory or storage a descriptor names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum MemKind {
    /// Host memory.
    Dram = 0,
    /// GPU memory; the device id is the GPU ordinal. Planned: no backend supports it
    /// yet, so registering it fails with not-supported.
    Vram = 1,
    /// A file; the device id is a file descriptor or a file registered by path, the
    /// address is the offset in the file.
    File = 2,
    /// A block device. Planned: no backend supports it yet.
    Block = 3,
    /// An object in an object store. Planned: no backend supports it yet.
    Object = 4,
}

impl MemKind {
    /// Every memory kind, in wire order.
    pub const ALL: [MemKind; 5] = [
        MemKind::Dram,
        MemKind::Vram,
        MemKind::File,
        MemKind::Block,
        MemKind::Object,
    ];

    /// The kind for a wire byte, if it names one.
    pub fn from_u8(value: u8) -> Option<MemKind> {
        MemKind::ALL.get(usize::from(value)).copied()
    }

    /// Short upper-case name (`DRAM`, `VRAM`, `FILE`, `BLOCK`, `OBJECT`).
    pub fn name(self) -> &'static str {
        match self {
            MemKind::Dram => "DRAM",
            MemKind::Vram => "VRAM",
            MemKind::File => "FILE",
            MemKind::Block => "BLOCK",
            MemKind::Object => "OBJECT",
        }
    }
}

impl fmt::Display for MemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Direction of a transfer, seen from the local agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Op {
    /// Remote (or file) → local memory.
    Read = 0,
    /// Local memory → remote (or file).
    Write = 1,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "READ",
            Op::Write => "WRITE",
        })
    }
}

/// One contiguous range: `len` bytes at `addr` on device `dev`.
///
/// For DRAM `addr` is a virtual address and `dev` is 0 (or a NUMA hint); for VRAM `dev`
/// is the GPU; for FILE `addr` is the offset in the file and `dev` the file's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Desc {
    /// Start address (or file offset).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device id (GPU ordinal, file id, 0 for host memory).
    pub dev: u64,
}

impl Desc {
    /// A descriptor of `len` bytes at `addr` on device `dev`.
    pub const fn new(addr: u64, len: u64, dev: u64) -> Desc {
        Desc { addr, len, dev }
    }

    /// A host-memory descriptor covering `bytes`.
    pub fn of_slice(bytes: &[u8]) -> Desc {
        Desc::new(bytes.as_ptr() as u64, bytes.len() as u64, 0)
    }

    /// One past the last byte, or `None` if the range wraps the address space.
    pub fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }
}

/// A strided descriptor list in one value: `count` descriptors of `len` bytes on device
/// `dev`, the `i`-th at `base + i * stride` (one KV-cache layer's blocks, say). Lists of
/// these ([`StridedDesc::descs`] in order, run after run) prepare exactly as the plain
/// list of the same descriptors would, without the caller building that list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct StridedDesc {
    /// Address (or file offset) of the first descriptor.
    pub base: u64,
    /// Number of descriptors.
    pub count: u64,
    /// Distance in bytes from one descriptor's start to the next one's.
    pub stride: u64,
    /// Length in bytes of every descriptor.
    pub len: u64,
    /// Device id of every descriptor.
    pub dev: u64,
}

impl StridedDesc {
    /// `count` descriptors of `len` bytes, `stride` bytes apart from `base`, on `dev`.
    pub const fn new(base: u64, count: u64, stride: u64, len: u64, dev: u64) -> StridedDesc {
        StridedDesc {
            base,
            count,
            stride,
            len,
            dev,
        }
    }

    /// The `i`-th descriptor (`i < count`; wrapping arithmetic, see
    /// [`StridedDesc::end`] for the check that nothing wraps).
    #[inline]
    pub fn desc(&self, i: u64) -> Desc {
        Desc::new(
            self.base.wrapping_add(i.wrapping_mul(self.stride)),
            self.len,
            self.dev,
        )
    }

    /// Its descriptors, in order.
    pub fn descs(&self) -> impl ExactSizeIterator<Item = Desc> + '_ {
        (0..self.count as usize).map(move |i| self.desc(i as u64))
    }

    /// One past the last byte of the last descriptor, or `None` when the run is empty
    /// or some descriptor wraps the address space.
    pub fn end(&self) -> Option<u64> {
        let last = self.count.checked_sub(1)?;
        self.base
            .checked_add(last.checked_mul(self.stride)?)?
            .checked_add(self.len)
    }
}

/// Where a transfer goes: the local agent itself (e.g. memory ↔ file), or a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoint {
    /// Both sides belong to the local agent.
    Local,
    /// The remote side belongs to a loaded peer.
    Peer(PeerId),
}

/// A set of backend slots (bit `i` = the agent's `i`-th backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct BackendMask(pub u8);

impl BackendMask {
    /// No backend.
    pub const EMPTY: BackendMask = BackendMask(0);
    /// Every backend slot.
    pub const ALL: BackendMask = BackendMask(u8::MAX);

    /// The mask with only slot `slot`.
    pub fn single(slot: usize) -> BackendMask {
        debug_assert!(slot < MAX_BACKENDS);
        BackendMask(1 << slot)
    }
    /// Whether slot `slot` is in the set.
    pub fn contains(self, slot: usize) -> bool {
        slot < MAX_BACKENDS && self.0 & (1 << slot) != 0
    }
    /// Add slot `slot`.
    pub fn insert(&mut self, slot: usize) {
        debug_assert!(slot < MAX_BACKENDS);
        self.0 |= 1 << slot;
    }
    /// Remove slot `slot`.
    pub fn remove(&mut self, slot: usize) {
        self.0 &= !(1 << slot);
    }
    /// Intersection.
    pub fn and(self, other: BackendMask) -> BackendMask {
        BackendMask(self.0 & other.0)
    }
    /// Whether no slot is set.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// The lowest slot in the set.
    pub fn first(self) -> Option<usize> {
        (self.0 != 0).then(|| self.0.trailing_zeros() as usize)
    }
    /// Slots in ascending order (one step per slot in the set, not per possible slot).
    pub fn iter(self) -> impl Iterator<Item = usize> {
        let mut bits = self.0;
        std::iter::from_fn(move || {
            let slot = bits.trailing_zeros() as usize;
            bits &= bits.wrapping_sub(1);
            (slot < MAX_BACKENDS).then_some(slot)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_mask_iter_lists_every_set_slot_in_order() {
        for bits in 0..=u8::MAX {
            let mask = BackendMask(bits);
            let want: Vec<usize> = (0..MAX_BACKENDS).filter(|&s| mask.contains(s)).collect();
            assert_eq!(mask.iter().collect::<Vec<_>>(), want, "{bits:#010b}");
        }
    }
}
