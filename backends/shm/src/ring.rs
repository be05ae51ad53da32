//! The notification inbox: one shared segment per backend, holding one bounded
//! single-producer/single-consumer byte ring ("lane") per sending peer.
//!
//! ```text
//! page 0     header: magic u64 | nonce [16] | lanes u32 | lane bytes u32
//!            | closed u32 (at 64) | claimed-lanes bitmap u64 (at 128)
//!            | withdrawn-table sequence u64 (at 256: odd while the owner writes it)
//!            | withdrawn count u64 (at 264) | withdrawn ranges (at 512: start u64,
//!            end u64 each, WITHDRAWN_MAX of them)
//! lane i     control page at 4096 + i × (4096 + lane bytes):
//!              owner u64 (0 free, BUSY while claiming, else pid << 32 | backend id)
//!              | copying u64 (at 64: 0 idle, else 1 + the withdrawn-table sequence the
//!              sender checked its ranges against)
//!              head u64 (at 128: consumer position, bytes) | tail u64 (at 256:
//!              producer position) | name len u32 (at 384) | name (at 512, ≤ 3,584 B)
//!            ring of `lane bytes` right after it
//! record     len u32 | 0 u32 | payload | padding to 8 bytes; len = WRAP: skip to the
//!            ring's start
//! ```
//!
//! A sender claims a free, drained lane of the target's inbox when it loads the target
//! (compare-and-swap of `owner`), writes its agent name, then publishes its owner id and
//! sets the lane's bit. Sending is plain stores into shared memory and one release store
//! of `tail`: no system call. The target, in its progress phase, walks the set bits and
//! reads each lane from `head` to `tail`. A sender frees its lane when it unloads the
//! target; a lane whose owner process is gone may be taken over once it is drained.
//!
//! **Withdrawn ranges** fence deregistration (issue 21): before the owner deregisters a
//! region that peers may still name, it adds the region's range to the table and bumps
//! the sequence; a sender, before each batch of copies, announces in its lane's
//! `copying` word which sequence it checked its ranges against (announce, then re-read
//! the sequence: a seqlock handshake) and refuses ranges that overlap a withdrawn one.
//! The owner's deregistration completes once every live sender is idle or has checked
//! against the new sequence — from then on no copy into the range can start or be
//! running. Nothing is checked while the table is empty.
//!
//! The consumer never trusts the producer's bytes: a record that is too long or a tail
//! that moved impossibly far is counted as corruption and the lane is skipped to its
//! tail. All positions grow monotonically (u64, never wrap in practice).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Header magic.
pub const MAGIC: u64 = u64::from_le_bytes(*b"FRYSHMIB");
/// Control bytes in front of each lane's ring.
const LANE_CONTROL: usize = 4096;
/// Header bytes.
const HEADER: usize = 4096;
/// Longest sender name a lane holds.
pub const NAME_MAX: usize = LANE_CONTROL - 512;
/// Owner value while a sender fills in its name.
const BUSY: u64 = u64::MAX;
/// Record length meaning "skip to the ring's start".
const WRAP: u32 = u32::MAX;
/// Most lanes an inbox has (one bit each in the bitmap).
pub const LANES_MAX: usize = 64;
/// Withdrawn ranges the header holds (the oldest is forgotten beyond).
pub const WITHDRAWN_MAX: usize = (HEADER - 512) / 16;
/// How many times a sender re-reads a table the owner is writing before giving up on
/// the batch (the owner's writes take nanoseconds).
const SEQ_TRIES: usize = 1 << 16;

/// Bytes an inbox of `lanes` lanes of `lane_bytes` takes.
pub fn inbox_len(lanes: usize, lane_bytes: usize) -> usize {
    HEADER + lanes * (LANE_CONTROL + lane_bytes)
}

/// A view of an inbox segment (ours or a peer's mapping of it).
#[derive(Clone, Copy, Debug)]
pub struct Inbox {
    base: *mut u8,
    len: usize,
    lanes: usize,
    lane_bytes: usize,
}

// SAFETY: a view of shared memory accessed through atomics and raw copies only.
unsafe impl Send for Inbox {}

impl Inbox {
    /// Lay out a fresh (zeroed) inbox.
    ///
    /// # Safety
    ///
    /// `base..base + len` is a zeroed writable mapping that outlives every use of the
    /// returned view, and `len >= inbox_len(lanes, lane_bytes)`.
    pub unsafe fn init(
        base: *mut u8,
        len: usize,
        nonce: &[u8; 16],
        lanes: usize,
        lane_bytes: usize,
    ) -> Inbox {
        debug_assert!(len >= inbox_len(lanes, lane_bytes));
        // SAFETY: inside the mapping (header page), per the contract.
        unsafe {
            std::ptr::copy_nonoverlapping(nonce.as_ptr(), base.add(8), 16);
            (base.add(24) as *mut u32).write(lanes as u32);
            (base.add(28) as *mut u32).write(lane_bytes as u32);
            (*(base as *const AtomicU64)).store(MAGIC, Ordering::Release);
        }
        Inbox {
            base,
            len,
            lanes,
            lane_bytes,
        }
    }

    /// View a peer's inbox mapped at `base..base + len`, checking its header.
    ///
    /// # Safety
    ///
    /// `base..base + len` is a readable and writable mapping that outlives every use of
    /// the returned view.
    pub unsafe fn attach(base: *mut u8, len: usize, nonce: &[u8; 16]) -> Result<Inbox, String> {
        if len < HEADER {
            return Err("inbox shorter than its header".into());
        }
        // SAFETY: the header page is inside the mapping (checked above).
        let (magic, seen, lanes, lane_bytes) = unsafe {
            let mut seen = [0u8; 16];
            std::ptr::copy_nonoverlapping(base.add(8), seen.as_mut_ptr(), 16);
            (
                (*(base as *const AtomicU64)).load(Ordering::Acquire),
                seen,
                (base.add(24) as *const u32).read() as usize,
                (base.add(28) as *const u32).read() as usize,
            )
        };
        if magic != MAGIC || seen != *nonce {
            return Err("inbox header does not match (magic or nonce)".into());
        }
        if lanes == 0
            || lanes > LANES_MAX
            || lane_bytes < 64
            || !lane_bytes.is_multiple_of(8)
            || inbox_len(lanes, lane_bytes) > len
        {
            return Err(format!(
                "inbox geometry is impossible ({lanes} lanes of {lane_bytes} bytes in {len})"
            ));
        }
        Ok(Inbox {
            base,
            len,
            lanes,
            lane_bytes,
        })
    }

    fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset + 8 <= self.len && offset.is_multiple_of(8));
        // SAFETY: offset lies inside the mapping and is 8-aligned (the mapping is
        // page-aligned); the memory is only ever accessed atomically at these offsets.
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }
    }

    fn closed_flag(&self) -> &AtomicU32 {
        // SAFETY: offset 64 of the header page, 4-aligned.
        unsafe { &*(self.base.add(64) as *const AtomicU32) }
    }

    fn claimed(&self) -> &AtomicU64 {
        self.atomic_u64(128)
    }

    fn withdrawn_seq(&self) -> &AtomicU64 {
        self.atomic_u64(256)
    }

    fn withdrawn_count(&self) -> &AtomicU64 {
        self.atomic_u64(264)
    }

    fn withdrawn_at(&self, i: usize) -> (&AtomicU64, &AtomicU64) {
        (self.atomic_u64(512 + i * 16), self.atomic_u64(520 + i * 16))
    }

    fn copying(&self, lane: usize) -> &AtomicU64 {
        self.atomic_u64(self.lane_offset(lane) + 64)
    }

    /// Owner: rewrite the withdrawn table as `ranges` (at most [`WITHDRAWN_MAX`]: the
    /// oldest are dropped beyond). Returns the new sequence.
    pub fn set_withdrawn(&self, ranges: &[(u64, u64)]) -> u64 {
        let keep = &ranges[ranges.len().saturating_sub(WITHDRAWN_MAX)..];
        let seq = self.withdrawn_seq();
        let start = seq.load(Ordering::Relaxed);
        seq.store(start | 1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        for (i, &(lo, hi)) in keep.iter().enumerate() {
            let (a, b) = self.withdrawn_at(i);
            a.store(lo, Ordering::Relaxed);
            b.store(hi, Ordering::Relaxed);
        }
        self.withdrawn_count()
            .store(keep.len() as u64, Ordering::Relaxed);
        let next = (start | 1) + 1;
        seq.store(next, Ordering::SeqCst);
        next
    }

    /// Owner: whether every live sender (other than `own`, this backend's lane to
    /// itself) is idle or checked its ranges against sequence `seq` or later.
    pub fn senders_past(&self, seq: u64, own: usize) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        let mut bits = self.claimed().load(Ordering::Acquire);
        while bits != 0 {
            let lane = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if lane == own || lane >= self.lanes {
                continue;
            }
            let copying = self.copying(lane).load(Ordering::SeqCst);
            if copying == 0 || copying > seq {
                continue;
            }
            let owner = self.owner(lane).load(Ordering::Acquire);
            if owner == 0 || owner == BUSY || !crate::host::pid_exists((owner >> 32) as i32) {
                // Gone (a dead process copies nothing) or not a sender yet.
                continue;
            }
            return false;
        }
        true
    }

    /// Whether any sender other than lane `own` holds a lane.
    pub fn has_senders(&self, own: usize) -> bool {
        self.claimed().load(Ordering::Acquire) & !(1u64 << own) != 0
    }

    fn lane_offset(&self, lane: usize) -> usize {
        HEADER + lane * (LANE_CONTROL + self.lane_bytes)
    }

    fn owner(&self, lane: usize) -> &AtomicU64 {
        self.atomic_u64(self.lane_offset(lane))
    }

    fn head(&self, lane: usize) -> &AtomicU64 {
        self.atomic_u64(self.lane_offset(lane) + 128)
    }

    fn tail(&self, lane: usize) -> &AtomicU64 {
        self.atomic_u64(self.lane_offset(lane) + 256)
    }

    fn ring(&self, lane: usize) -> *mut u8 {
        // SAFETY: the ring lies inside the mapping (geometry checked at attach/init).
        unsafe { self.base.add(self.lane_offset(lane) + LANE_CONTROL) }
    }

    /// Mark the inbox closed (its owner is going away).
    pub fn close(&self) {
        self.closed_flag().store(1, Ordering::Release);
    }

    /// Whether the owner closed it.
    pub fn is_closed(&self) -> bool {
        self.closed_flag().load(Ordering::Acquire) != 0
    }

    /// Claim a lane for sender `owner` named `name`; the lane, or why none.
    pub fn claim(&self, owner: u64, name: &str) -> Result<Lane, String> {
        if name.len() > NAME_MAX {
            return Err(format!(
                "agent name of {} bytes is longer than a lane holds ({NAME_MAX})",
                name.len()
            ));
        }
        debug_assert!(owner != 0 && owner != BUSY);
        for pass in 0..2 {
            for lane in 0..self.lanes {
                let current = self.owner(lane).load(Ordering::Acquire);
                let takeable = match current {
                    0 => true,
                    BUSY => false,
                    // Second pass: a lane whose sender process is gone.
                    id => pass == 1 && !crate::host::pid_exists((id >> 32) as i32),
                };
                let drained = self.head(lane).load(Ordering::Acquire)
                    == self.tail(lane).load(Ordering::Acquire);
                if !takeable || !drained {
                    continue;
                }
                if self
                    .owner(lane)
                    .compare_exchange(current, BUSY, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    continue;
                }
                let control = self.lane_offset(lane);
                // SAFETY: the name area (512..512 + NAME_MAX of the control page) lies
                // inside the mapping; we hold the lane (BUSY), so no other sender writes.
                unsafe {
                    (self.base.add(control + 384) as *mut u32).write_volatile(name.len() as u32);
                    std::ptr::copy_nonoverlapping(
                        name.as_ptr(),
                        self.base.add(control + 512),
                        name.len(),
                    );
                }
                let tail = self.tail(lane).load(Ordering::Acquire);
                // An earlier sender that died mid-copy may have left its word set.
                self.copying(lane).store(0, Ordering::SeqCst);
                self.owner(lane).store(owner, Ordering::Release);
                self.claimed().fetch_or(1 << lane, Ordering::AcqRel);
                return Ok(Lane {
                    inbox: *self,
                    lane,
                    owner,
                    tail,
                    head_seen: tail,
                });
            }
        }
        Err(format!("all {} notification lanes are taken", self.lanes))
    }

    /// Hand every pending notification to `deliver(lane, owner, name, payload)`;
    /// returns (delivered, corrupt lanes skipped). `names` caches each lane's sender
    /// name by owner id.
    pub fn drain(
        &self,
        names: &mut [(u64, String)],
        mut deliver: impl FnMut(&str, &[u8]),
    ) -> (usize, usize) {
        let mut bits = self.claimed().load(Ordering::Acquire);
        let (mut delivered, mut corrupt) = (0, 0);
        while bits != 0 {
            let lane = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if lane >= self.lanes {
                corrupt += 1;
                continue;
            }
            let tail = self.tail(lane).load(Ordering::Acquire);
            let mut head = self.head(lane).load(Ordering::Relaxed);
            if head == tail {
                continue;
            }
            if tail < head || tail - head > self.lane_bytes as u64 {
                corrupt += 1;
                self.head(lane).store(tail, Ordering::Release);
                continue;
            }
            let owner = self.owner(lane).load(Ordering::Acquire);
            let cached = &mut names[lane];
            if cached.0 != owner || cached.1.is_empty() {
                cached.0 = owner;
                cached.1 = self.read_name(lane);
            }
            let ring = self.ring(lane);
            let size = self.lane_bytes as u64;
            while head < tail {
                let at = (head % size) as usize;
                // SAFETY: `at` + 8 ≤ lane bytes (records are 8-aligned, the ring's
                // length is a multiple of 8); the producer wrote these bytes before its
                // release store of `tail`, which we acquired.
                let len = unsafe { (ring.add(at) as *const u32).read() };
                if len == WRAP {
                    head = head.saturating_add(size - at as u64);
                    continue;
                }
                let len = len as usize;
                let record = 8 + len.next_multiple_of(8);
                if at + record > self.lane_bytes
                    || head.checked_add(record as u64).is_none_or(|end| end > tail)
                {
                    corrupt += 1;
                    head = tail;
                    break;
                }
                // SAFETY: at + 8 + len lies inside the ring (checked above); the bytes
                // stay put until we advance `head` past them.
                let payload = unsafe { std::slice::from_raw_parts(ring.add(at + 8), len) };
                deliver(&cached.1, payload);
                delivered += 1;
                head += record as u64;
            }
            self.head(lane).store(head, Ordering::Release);
        }
        (delivered, corrupt)
    }

    fn read_name(&self, lane: usize) -> String {
        let control = self.lane_offset(lane);
        // SAFETY: the name area lies inside the control page; a sender wrote it before
        // publishing its owner id (acquired by the caller).
        unsafe {
            let len = ((self.base.add(control + 384) as *const u32).read_volatile() as usize)
                .min(NAME_MAX);
            let bytes = std::slice::from_raw_parts(self.base.add(control + 512), len);
            String::from_utf8_lossy(bytes).into_owned()
        }
    }

    /// Largest payload a lane can take.
    pub fn payload_max(&self) -> usize {
        self.lane_bytes / 2 - 8
    }
}

/// A claimed lane: the sending side of one ring of a target's inbox.
#[derive(Debug)]
pub struct Lane {
    inbox: Inbox,
    lane: usize,
    owner: u64,
    /// Producer position (only we move it).
    tail: u64,
    /// The consumer position last read (refreshed when the ring looks full).
    head_seen: u64,
}

/// A sender's copy of a target's withdrawn table (`Lane::begin_copies`).
#[derive(Debug, Default)]
pub struct Withdrawn {
    /// The sequence `ranges` was read at (0: never read; the table starts empty).
    seq: u64,
    /// (start, end) of each withdrawn range.
    ranges: Vec<(u64, u64)>,
}

impl Withdrawn {
    /// Whether `[addr, addr + len)` overlaps a withdrawn range.
    pub fn hits(&self, addr: u64, len: u64) -> bool {
        let end = addr.saturating_add(len);
        self.ranges.iter().any(|&(lo, hi)| addr < hi && lo < end)
    }

    /// Whether the table is empty (nothing to check).
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

impl Lane {
    /// Before a batch of copies to the lane's target: bring `table` up to date with the
    /// target's withdrawn table and announce (in the lane's `copying` word) the sequence
    /// it was checked against. Every range of the batch must then be checked against
    /// `table`, and [`Lane::end_copies`] called after the last copy. `false` if the
    /// target kept writing its table (the batch must not run).
    pub fn begin_copies(&self, table: &mut Withdrawn) -> bool {
        let seq = self.inbox.withdrawn_seq();
        for _ in 0..SEQ_TRIES {
            let now = seq.load(Ordering::Acquire);
            if now & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            if now != table.seq {
                table.ranges.clear();
                let count = (self.inbox.withdrawn_count().load(Ordering::Relaxed) as usize)
                    .min(WITHDRAWN_MAX);
                for i in 0..count {
                    let (a, b) = self.inbox.withdrawn_at(i);
                    table
                        .ranges
                        .push((a.load(Ordering::Relaxed), b.load(Ordering::Relaxed)));
                }
                std::sync::atomic::fence(Ordering::Acquire);
                if seq.load(Ordering::Relaxed) != now {
                    continue;
                }
                table.seq = now;
            }
            self.inbox
                .copying(self.lane)
                .store(now + 1, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            if seq.load(Ordering::SeqCst) == now {
                return true;
            }
        }
        self.end_copies();
        false
    }

    /// After the last copy of a batch (see [`Lane::begin_copies`]).
    pub fn end_copies(&self) {
        self.inbox.copying(self.lane).store(0, Ordering::Release);
    }

    /// The lane's index in its inbox.
    pub fn index(&self) -> usize {
        self.lane
    }

    /// Whether a record of `len` payload bytes fits now. This lane's producer is the
    /// only one that uses up room, so a record that fits still fits at the next
    /// `push` of it (an attached notification is checked before its data moves).
    pub fn fits(&self, len: usize) -> bool {
        self.room(len).is_some()
    }

    /// Where a record of `len` bytes goes: (ring offset, bytes skipped to wrap, bytes
    /// used in all, the consumer head it was checked against), or `None` if it does not
    /// fit.
    fn room(&self, len: usize) -> Option<(u64, u64, u64, u64)> {
        let size = self.inbox.lane_bytes as u64;
        if len > self.inbox.payload_max() {
            return None;
        }
        let record = (8 + len.next_multiple_of(8)) as u64;
        let at = self.tail % size;
        let skip = if at + record > size { size - at } else { 0 };
        let need = skip + record;
        // The consumer's head lives in the target's memory: never trust it to be sane
        // (a head past our tail, or positions near overflow, read as "full").
        let tail = self.tail;
        let fits = |head: u64| {
            tail.checked_add(need)
                .and_then(|end| end.checked_sub(head))
                .is_some_and(|used| used <= size)
        };
        let mut head = self.head_seen;
        if !fits(head) {
            head = self.inbox.head(self.lane).load(Ordering::Acquire);
            if !fits(head) {
                return None;
            }
        }
        Some((at, skip, need, head))
    }

    /// Append one notification; false if the ring has no room (the target has not
    /// drained) or the payload is longer than a lane takes.
    pub fn push(&mut self, payload: &[u8]) -> bool {
        let Some((at, skip, need, head)) = self.room(payload.len()) else {
            return false;
        };
        self.head_seen = head;
        let ring = self.inbox.ring(self.lane);
        let mut at = at as usize;
        if skip > 0 {
            // SAFETY: `at` + 8 ≤ the ring's length (8-aligned positions); the consumer
            // does not read past `tail`, which we have not moved yet.
            unsafe { (ring.add(at) as *mut u32).write(WRAP) };
            at = 0;
        }
        // SAFETY: at + record ≤ the ring's length (the skip above guarantees it), and
        // the space is free (checked against the consumer's head).
        unsafe {
            (ring.add(at) as *mut u32).write(payload.len() as u32);
            (ring.add(at + 4) as *mut u32).write(0);
            std::ptr::copy_nonoverlapping(payload.as_ptr(), ring.add(at + 8), payload.len());
        }
        self.tail += need;
        self.inbox
            .tail(self.lane)
            .store(self.tail, Ordering::Release);
        true
    }

    /// Give the lane back (the target drains what is left under our name).
    pub fn release(&self) {
        let _ = self.inbox.owner(self.lane).compare_exchange(
            self.owner,
            0,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}
