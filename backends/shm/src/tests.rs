//! Unit tests: the notification ring and shareable memory, within one process.

use super::ring::{inbox_len, Inbox};
use super::segment::{live_segment, PeerMapping};
use super::{HugePages, SharedMemory, ShmOptions};

fn inbox(lanes: usize, lane_bytes: usize) -> (SharedMemory, Inbox) {
    let mem = SharedMemory::alloc(inbox_len(lanes, lane_bytes), &ShmOptions::default()).unwrap();
    // SAFETY: fresh zeroed mapping, long enough, outlives the view (returned together
    // and the tests drop the view first by scope).
    let ib = unsafe {
        Inbox::init(
            mem.as_ptr(),
            mem.len(),
            &mem.live().nonce,
            lanes,
            lane_bytes,
        )
    };
    (mem, ib)
}

#[test]
fn ring_delivers_in_order_across_wraps_and_refuses_when_full() {
    let (_mem, ib) = inbox(2, 256);
    let mut lane = ib.claim((1 << 32) | 1, "sender-a").unwrap();
    let mut names = vec![(0, String::new()); 2];
    let mut got: Vec<(String, Vec<u8>)> = Vec::new();
    let mut next = 0u32;
    let mut expected = 0u32;
    for round in 0..200 {
        // Push until full, with varying lengths (including empty payloads).
        let mut pushed = 0;
        loop {
            let len = (next as usize * 7 + round) % 60;
            let payload: Vec<u8> = (0..len).map(|i| (next as usize + i) as u8).collect();
            if !lane.push(&payload) {
                break;
            }
            next += 1;
            pushed += 1;
        }
        assert!(pushed > 0, "an empty ring takes at least one record");
        got.clear();
        let (n, corrupt) = ib.drain(&mut names, |from, p| got.push((from.into(), p.to_vec())));
        assert_eq!((n, corrupt), (pushed, 0));
        for (from, p) in &got {
            assert_eq!(from, "sender-a");
            let len = (expected as usize * 7 + round) % 60;
            let want: Vec<u8> = (0..len).map(|i| (expected as usize + i) as u8).collect();
            assert_eq!(p, &want, "record {expected}");
            expected += 1;
        }
    }
    assert!(!lane.push(&[0u8; 200]), "longer than half a ring");
}

#[test]
fn lanes_are_claimed_once_and_freed() {
    let (_mem, ib) = inbox(2, 256);
    let a = ib.claim((1 << 32) | 1, "a").unwrap();
    let _b = ib.claim((1 << 32) | 2, "b").unwrap();
    assert!(ib.claim((1 << 32) | 3, "c").is_err());
    a.release();
    let mut c = ib.claim((1 << 32) | 3, "c").unwrap();
    assert!(c.push(b"hello"));
    let mut names = vec![(0, String::new()); 2];
    let mut from = String::new();
    ib.drain(&mut names, |f, p| {
        assert_eq!(p, b"hello");
        from = f.to_string();
    });
    assert_eq!(from, "c");
}

#[test]
fn a_corrupt_lane_is_skipped_not_trusted() {
    let (mem, ib) = inbox(1, 256);
    let mut lane = ib.claim((1 << 32) | 1, "a").unwrap();
    assert!(lane.push(b"x"));
    // Overwrite the record's length with a huge value, as a hostile peer could.
    let ring_start = 4096 + 4096;
    mem.write(ring_start, &1000u32.to_le_bytes()).unwrap();
    let mut names = vec![(0, String::new()); 1];
    let (n, corrupt) = ib.drain(&mut names, |_, _| panic!("delivered a corrupt record"));
    assert_eq!((n, corrupt), (0, 1));
    assert!(lane.push(b"y"));
    let (n, corrupt) = ib.drain(&mut names, |_, p| assert_eq!(p, b"y"));
    assert_eq!((n, corrupt), (1, 0));
}

#[test]
fn shared_memory_is_sealed_and_mappable_by_nonce_only() {
    let mem = SharedMemory::alloc(10_000, &ShmOptions::default()).unwrap();
    assert_eq!(mem.len(), 12_288);
    let live = live_segment(mem.addr() + 100, 200).expect("inside the segment");
    assert!(
        live_segment(mem.addr() + 12_000, 1000).is_none(),
        "crosses the end"
    );
    mem.write(5, b"abc").unwrap();
    assert!(mem.write(12_287, b"ab").is_err());
    let pid = std::process::id();
    let m = PeerMapping::open(pid, live.fd, &live.nonce, live.len).unwrap();
    // SAFETY: our mapping of the same pages, 12 KiB long.
    let seen = unsafe { std::slice::from_raw_parts(m.base().add(5), 3) };
    assert_eq!(seen, b"abc");
    let mut wrong = live.nonce;
    wrong[0] ^= 1;
    let e = PeerMapping::open(pid, live.fd, &wrong, live.len).unwrap_err();
    assert!(e.contains("not the segment"), "{e}");
    let e = PeerMapping::open(pid, live.fd, &live.nonce, live.len + 4096).unwrap_err();
    assert!(e.contains("bytes"), "{e}");
    // The size is sealed: growing or shrinking fails.
    // SAFETY: ftruncate on our own fd; it must fail.
    assert_ne!(unsafe { libc::ftruncate(live.fd, 4096) }, 0);
    drop(mem);
    assert!(live_segment(live.base, 1).is_none());
}

#[test]
fn huge_pages_fall_back_with_a_reason_or_are_used() {
    let options = ShmOptions {
        huge_pages: HugePages::Prefer,
        populate: false,
    };
    let free = std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let mem = SharedMemory::alloc(1 << 20, &options).unwrap();
    if free >= 1 {
        assert!(
            mem.huge_pages(),
            "{free} free huge pages, yet: {:?}",
            mem.huge_pages_fallback()
        );
    }
    if mem.huge_pages() {
        assert_eq!(mem.len(), 2 << 20);
        assert!(mem.huge_pages_fallback().is_none());
        // A peer maps it the same way (sealed, whole huge pages).
        let live = live_segment(mem.addr(), 1).unwrap();
        mem.write(4095, b"hp").unwrap();
        let m = PeerMapping::open(std::process::id(), live.fd, &live.nonce, live.len).unwrap();
        // SAFETY: our 2 MiB mapping of the same pages.
        let seen = unsafe { std::slice::from_raw_parts(m.base().add(4095), 2) };
        assert_eq!(seen, b"hp");
    } else {
        let why = mem.huge_pages_fallback().expect("a reason");
        assert!(why.contains("nr_hugepages"), "{why}");
        let required = ShmOptions {
            huge_pages: HugePages::Require,
            populate: false,
        };
        let e = SharedMemory::alloc(1 << 20, &required).unwrap_err();
        assert!(e.to_string().contains("huge pages"), "{e}");
    }
}

#[test]
fn a_hostile_head_reads_as_full_not_as_a_panic() {
    let (mem, ib) = inbox(1, 256);
    let mut lane = ib.claim((1 << 32) | 1, "a").unwrap();
    assert!(lane.push(b"one"));
    // The consumer's head at offset 4096 + 128: set it past our tail, then near overflow.
    for head in [1_000u64, u64::MAX - 3] {
        mem.write(4096 + 128, &head.to_le_bytes()).unwrap();
        for _ in 0..40 {
            let _ = lane.push(b"more bytes");
        }
    }
    let mut names = vec![(0, String::new()); 1];
    let _ = ib.drain(&mut names, |_, _| {});
}

#[test]
fn a_withdrawal_waits_for_a_sender_mid_copy_and_the_sender_then_refuses_the_range() {
    use super::ring::Withdrawn;
    let (_mem, ib) = inbox(4, 256);
    let own = ib
        .claim((u64::from(std::process::id()) << 32) | 1, "owner")
        .unwrap();
    assert!(!ib.has_senders(own.index()), "only the owner's own lane");
    let sender = ib
        .claim((u64::from(std::process::id()) << 32) | 2, "sender")
        .unwrap();
    assert!(ib.has_senders(own.index()));
    let mut table = Withdrawn::default();
    // The sender is copying, checked against the empty table.
    assert!(sender.begin_copies(&mut table));
    assert!(table.is_empty());
    // The owner withdraws a range: not complete while that copy runs.
    let seq = ib.set_withdrawn(&[(0x1000, 0x2000)]);
    assert!(!ib.senders_past(seq, own.index()));
    sender.end_copies();
    assert!(ib.senders_past(seq, own.index()));
    // The next batch sees the range and refuses what overlaps it.
    assert!(sender.begin_copies(&mut table));
    assert!(table.hits(0x1fff, 1) && table.hits(0x0800, 0x1000));
    assert!(!table.hits(0x2000, 0x100) && !table.hits(0x0, 0x1000));
    // While it copies (checked against the new table) the withdrawal stays complete.
    assert!(ib.senders_past(seq, own.index()));
    sender.end_copies();
    // Re-registered: the table empties and the sender's copy follows.
    let seq = ib.set_withdrawn(&[]);
    assert!(sender.begin_copies(&mut table));
    assert!(table.is_empty() && ib.senders_past(seq, own.index()));
    sender.end_copies();
}
