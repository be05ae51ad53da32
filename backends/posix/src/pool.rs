//! Fixed-capacity pools of per-request and per-operation state, and the tables of
//! registered FILE and DRAM regions. Everything is sized at creation; nothing here
//! allocates afterwards.

use std::os::fd::{OwnedFd, RawFd};
use std::path::PathBuf;

use ferry_backend_api::{Failure, Op};

/// Sentinel for "no fixed buffer".
pub(crate) const NO_FIXED_BUF: u16 = u16::MAX;

/// "No plain DRAM region" in [`IoOp::plain`].
pub(crate) const NO_PLAIN: u32 = u32::MAX;

/// Marks a DRAM token of the plain (not fixed-buffer) region table. Table tokens keep
/// their slot (+1) in the low 31 bits, so the bit never collides.
pub(crate) const PLAIN_DRAM: u64 = 1 << 31;

/// Most plain DRAM regions at once.
pub(crate) const PLAIN_DRAM_MAX: usize = 1 << 20;

/// One posted request, alive from `post` until its completion is pushed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    /// The caller's tag.
    pub tag: u64,
    /// Operations not yet finished.
    pub ops_left: u32,
    /// Operations handed to the engine and not yet returned.
    pub ops_in_flight: u32,
    /// Failure with the lowest range index seen so far.
    pub failure: Option<Failure>,
}

/// Where an operation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpState {
    /// Slot unused.
    Free,
    /// In the pending queue.
    Pending,
    /// Handed to the engine.
    InFlight,
}

/// One non-empty range of a request: a file region slice ↔ a memory slice.
#[derive(Clone, Copy, Debug)]
pub(crate) struct IoOp {
    /// Bumped each time the slot is freed; part of `user_data`.
    pub generation: u32,
    /// Where the operation is.
    pub state: OpState,
    /// Owning request slot.
    pub request: u32,
    /// Index of the range within its post.
    pub range_index: u32,
    /// Direction.
    pub op: Op,
    /// File table slot.
    pub file: u32,
    /// Memory address of the range's first byte.
    pub mem_addr: u64,
    /// File offset of the range's first byte.
    pub file_offset: u64,
    /// Bytes of the range.
    pub len_bytes: u64,
    /// Bytes already moved (short transfers are resubmitted for the rest).
    pub done_bytes: u64,
    /// Fixed buffer index, or [`NO_FIXED_BUF`].
    pub fixed_buf: u16,
    /// Plain DRAM table slot of the memory side, or [`NO_PLAIN`].
    pub plain: u32,
}

impl IoOp {
    const FREE: IoOp = IoOp {
        generation: 0,
        state: OpState::Free,
        request: 0,
        range_index: 0,
        op: Op::Read,
        file: 0,
        mem_addr: 0,
        file_offset: 0,
        len_bytes: 0,
        done_bytes: 0,
        fixed_buf: NO_FIXED_BUF,
        plain: NO_PLAIN,
    };
}

/// A bounded slab with a free list. Slots are made as they are first needed (up to
/// `capacity`), so an idle backend holds none: made up front at the default bounds,
/// the request and operation slabs cost every agent with a POSIX backend about 4 MB.
/// A slot once made stays (freed slots are reused), so steady state allocates nothing.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    items: Vec<T>,
    free: Vec<u32>,
    capacity: u32,
    blank: T,
}

impl<T: Copy> Slab<T> {
    pub fn new(capacity: u32, blank: T) -> Self {
        Slab {
            items: Vec::new(),
            free: Vec::new(),
            capacity,
            blank,
        }
    }
    /// The most slots in use at once.
    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }
    /// Slots made so far (every slot handed out is below this).
    pub fn made(&self) -> usize {
        self.items.len()
    }
    pub fn available(&self) -> usize {
        self.capacity() - self.in_use()
    }
    pub fn in_use(&self) -> usize {
        self.items.len() - self.free.len()
    }
    /// Take a slot (a freed one first, low slots first); `None` when full (callers
    /// check `available` first).
    pub fn take(&mut self) -> Option<u32> {
        if let Some(slot) = self.free.pop() {
            return Some(slot);
        }
        if self.items.len() >= self.capacity() {
            return None;
        }
        self.items.push(self.blank);
        Some(self.items.len() as u32 - 1)
    }
    /// Return a slot. The free list holds at most the slots made, and it grows only
    /// when more slots were made than ever returned at once before.
    pub fn give_back(&mut self, slot: u32) {
        debug_assert!(self.free.len() < self.items.len());
        debug_assert!(!self.free.contains(&slot));
        self.free.push(slot);
    }
    pub fn get(&self, slot: u32) -> &T {
        &self.items[slot as usize]
    }
    pub fn get_mut(&mut self, slot: u32) -> &mut T {
        &mut self.items[slot as usize]
    }
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.items.iter().enumerate().map(|(i, t)| (i as u32, t))
    }
}

/// Request pool.
pub(crate) type Requests = Slab<Option<Request>>;

/// Operation pool.
#[derive(Debug)]
pub(crate) struct Ops {
    pub slab: Slab<IoOp>,
}

impl Ops {
    pub fn new(capacity: u32) -> Self {
        Ops {
            slab: Slab::new(capacity, IoOp::FREE),
        }
    }

    /// The `user_data` naming operation `slot` in its current generation.
    pub fn user_data(&self, slot: u32) -> u64 {
        (u64::from(self.slab.get(slot).generation) << 32) | u64::from(slot)
    }

    /// The live, in-flight operation `user_data` names, or `None` if the tag is stale or
    /// out of range (a kernel or bookkeeping bug; never dereferenced).
    pub fn resolve(&self, user_data: u64) -> Option<u32> {
        let slot = (user_data & u64::from(u32::MAX)) as u32;
        let generation = (user_data >> 32) as u32;
        if slot as usize >= self.slab.made() {
            return None;
        }
        let op = self.slab.get(slot);
        (op.generation == generation && op.state == OpState::InFlight).then_some(slot)
    }

    /// Free `slot`, bumping its generation so late tags for it are refused.
    pub fn release(&mut self, slot: u32) {
        let op = self.slab.get_mut(slot);
        op.generation = op.generation.wrapping_add(1);
        op.state = OpState::Free;
        self.slab.give_back(slot);
    }
}

/// O_DIRECT alignment requirements of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DirectAlign {
    /// Alignment of memory addresses, bytes.
    pub mem_bytes: u64,
    /// Alignment of file offsets and lengths, bytes.
    pub offset_bytes: u64,
}

/// A registered FILE region.
#[derive(Debug)]
pub(crate) struct FileEntry {
    /// The descriptor I/O uses.
    pub fd: RawFd,
    /// Set when the backend opened the file; held only so dropping the entry (at
    /// deregistration) closes it.
    pub _owned: Option<OwnedFd>,
    /// The path, when registered by path.
    pub path: Option<PathBuf>,
    /// First file offset of the region.
    pub start: u64,
    /// Length of the region; 0 = unbounded.
    pub len_bytes: u64,
    /// `Some` when the file is open with O_DIRECT.
    pub direct: Option<DirectAlign>,
    /// Whether the fd is in the io_uring fixed-file table at this entry's slot.
    pub fixed: bool,
}

impl FileEntry {
    /// Whether `[offset, offset+len)` lies in the region.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else {
            return false;
        };
        if offset < self.start {
            return false;
        }
        self.len_bytes == 0 || end <= self.start.saturating_add(self.len_bytes)
    }

    /// How to name this file in messages.
    pub fn describe(&self) -> String {
        match &self.path {
            Some(p) => format!("file '{}'", p.display()),
            None => format!("file descriptor {}", self.fd),
        }
    }
}

/// A table of slots with generations; tokens are `(generation << 32) | (slot + 1)`, so 0
/// never names an entry.
#[derive(Debug)]
pub(crate) struct Table<T> {
    entries: Vec<(u32, Option<T>)>,
    /// Operations (queued or in flight) that use each slot, indexed by slot: what
    /// deregistration checks instead of scanning the operation slab.
    uses: Vec<u32>,
    /// Empty slots (the next one handed out last): finding a vacant slot is O(1).
    free: Vec<u32>,
}

impl<T> Table<T> {
    pub fn new(capacity: u32) -> Self {
        Table {
            entries: (0..capacity).map(|_| (0, None)).collect(),
            uses: vec![0; capacity as usize],
            free: (0..capacity).rev().collect(),
        }
    }
    /// One more operation uses `slot`.
    pub fn acquire(&mut self, slot: u32) {
        self.uses[slot as usize] += 1;
    }
    /// An operation that used `slot` is done.
    pub fn release(&mut self, slot: u32) {
        debug_assert!(self.uses[slot as usize] > 0);
        self.uses[slot as usize] -= 1;
    }
    /// Whether an operation uses `slot`.
    pub fn in_use(&self, slot: u32) -> bool {
        self.uses[slot as usize] > 0
    }
    pub fn capacity(&self) -> usize {
        self.entries.len()
    }
    /// A free slot, growing the table by one (up to `max` slots) when none is free.
    pub fn vacant_or_grow(&mut self, max: usize) -> Option<u32> {
        if let Some(slot) = self.vacant() {
            return Some(slot);
        }
        if self.entries.len() >= max {
            return None;
        }
        self.entries.push((0, None));
        self.uses.push(0);
        let slot = self.entries.len() as u32 - 1;
        self.free.push(slot);
        Some(slot)
    }
    /// A free slot, if any.
    pub fn vacant(&self) -> Option<u32> {
        self.free.last().copied()
    }
    /// Fill `slot`; returns its token.
    pub fn fill(&mut self, slot: u32, value: T) -> u64 {
        if self.free.last() == Some(&slot) {
            self.free.pop();
        } else if let Some(i) = self.free.iter().position(|&s| s == slot) {
            // Only when a caller fills a slot other than `vacant()`'s.
            self.free.swap_remove(i);
        }
        let entry = &mut self.entries[slot as usize];
        debug_assert!(entry.1.is_none());
        entry.1 = Some(value);
        (u64::from(entry.0) << 32) | (u64::from(slot) + 1)
    }
    /// The slot a live token names.
    pub fn slot(&self, token: u64) -> Option<u32> {
        let slot = (token & u64::from(u32::MAX)).checked_sub(1)?;
        let generation = (token >> 32) as u32;
        let entry = self.entries.get(slot as usize)?;
        (entry.0 == generation && entry.1.is_some()).then_some(slot as u32)
    }
    pub fn get(&self, slot: u32) -> Option<&T> {
        self.entries.get(slot as usize)?.1.as_ref()
    }
    /// Empty `slot`, bumping its generation.
    pub fn take(&mut self, slot: u32) -> Option<T> {
        let entry = &mut self.entries[slot as usize];
        let value = entry.1.take();
        if value.is_some() {
            entry.0 = entry.0.wrapping_add(1);
            self.free.push(slot);
        }
        value
    }
    pub fn len(&self) -> usize {
        self.entries.len() - self.free.len()
    }
    /// Empty every slot (bumping generations), handing the values out.
    pub fn drain(&mut self) -> impl Iterator<Item = (u32, T)> + '_ {
        let free = &mut self.free;
        self.entries
            .iter_mut()
            .enumerate()
            .filter_map(move |(i, (generation, e))| {
                let value = e.take()?;
                *generation = generation.wrapping_add(1);
                free.push(i as u32);
                Some((i as u32, value))
            })
    }
}

/// A DRAM region registered as an io_uring fixed buffer (index = table slot).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BufEntry {
    /// First address.
    pub addr: u64,
    /// Length.
    pub len_bytes: u64,
}

impl BufEntry {
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        match (addr.checked_add(len), self.addr.checked_add(self.len_bytes)) {
            (Some(end), Some(own_end)) => addr >= self.addr && end <= own_end,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_tokens_are_generational() {
        let mut t: Table<u8> = Table::new(2);
        let s = t.vacant().unwrap();
        let tok = t.fill(s, 7);
        assert_ne!(tok, 0);
        assert_eq!(t.slot(tok), Some(s));
        assert_eq!(t.take(s), Some(7));
        assert_eq!(t.slot(tok), None, "stale token refused");
        let tok2 = t.fill(s, 8);
        assert_ne!(tok, tok2);
        assert_eq!(t.slot(tok), None);
        assert_eq!(t.slot(tok2), Some(s));
        assert_eq!(t.slot(0), None);
        assert_eq!(t.slot(99), None);
    }

    #[test]
    fn op_user_data_is_checked() {
        let mut ops = Ops::new(4);
        let s = ops.slab.take().unwrap();
        ops.slab.get_mut(s).state = OpState::InFlight;
        let ud = ops.user_data(s);
        assert_eq!(ops.resolve(ud), Some(s));
        ops.release(s);
        assert_eq!(ops.resolve(ud), None, "released op refused");
        assert_eq!(
            ops.resolve(u64::from(u32::MAX)),
            None,
            "out of range refused"
        );
    }

    #[test]
    fn file_region_bounds() {
        let f = FileEntry {
            fd: -1,
            _owned: None,
            path: None,
            start: 100,
            len_bytes: 50,
            direct: None,
            fixed: false,
        };
        assert!(f.covers(100, 50));
        assert!(!f.covers(99, 1));
        assert!(!f.covers(140, 11));
        let unbounded = FileEntry { len_bytes: 0, ..f };
        assert!(unbounded.covers(1 << 40, 1 << 20));
        assert!(!unbounded.covers(u64::MAX, 2));
    }
}
