//! The target side of a LOOPBACK transfer, through two `Agent`s in one process: when the
//! target deregisters the region a request writes into (or reads from), the initiator's
//! post fails with a typed error naming the region, and no byte moves.

use ferry::{Error, MemKind, Op, XferStatus};
use ferry_tests::{loopback_agent, register, Buffer, Rng};

#[test]
fn target_deregistration_fails_the_post_and_moves_no_byte() {
    let mut rng = Rng::new(71);
    let src = Buffer::random(64 << 10, &mut rng);
    let dst = Buffer::zeroed(64 << 10);
    let a = loopback_agent("stale-a");
    let b = loopback_agent("stale-b");
    register(&a, &src);
    let dst_region = register(&b, &dst);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let write = a
        .create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            b_at_a,
            MemKind::Dram,
            &[dst.whole()],
            Some(&[1u8; 100]),
        )
        .unwrap();
    let read = a
        .create(
            Op::Read,
            MemKind::Dram,
            &[src.whole()],
            b_at_a,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    // A first round works.
    assert_eq!(a.post(write).unwrap(), XferStatus::Done);
    assert_eq!(dst.bytes(), src.bytes());
    assert_eq!(b.drain_notifications().len(), 1);
    let expected_src = src.bytes().to_vec();

    // The target lets its region go; A has not heard of it (no metadata reload).
    b.deregister(dst_region).unwrap();
    // The target's memory changes meanwhile (it is B's again); it must stay as B left it.
    let dst_after: Vec<u8> = dst.bytes().to_vec();
    for x in [write, read] {
        match a.post(x) {
            Err(Error::NotFound { subject }) => {
                let text = subject.to_string();
                assert!(text.contains(b.name()), "{text}");
                assert!(text.contains("stale region"), "{text}");
                assert!(
                    text.contains(&format!("{:#x}", dst.whole().addr)),
                    "names the region's address: {text}"
                );
            }
            other => panic!("post into a deregistered target region: {other:?}"),
        }
    }
    assert_eq!(
        dst.bytes(),
        &dst_after[..],
        "no byte written into the target"
    );
    assert_eq!(
        src.bytes(),
        &expected_src[..],
        "no byte read from the target"
    );
    assert!(
        b.drain_notifications().is_empty(),
        "no notification delivered"
    );

    // After the target registers it again and A reloads B's metadata, transfers work.
    register(&b, &dst);
    let b_again = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let again = a
        .create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            b_again,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    assert_eq!(a.post(again).unwrap(), XferStatus::Done);
}

/// Issue 21, item 4 in the engine: a deregistration a backend cannot confirm yet (a
/// peer may still be moving bytes: here the loopback fault `withdraw_pending`) goes in
/// two steps. The first call withdraws the region — out of the tables and the published
/// metadata, so nothing new names it — and answers `Pending`; calling again with the same
/// handle answers `Pending` until the backend confirms, then `Done`; after that the
/// handle is unknown.
#[test]
fn a_deregistration_a_backend_cannot_confirm_yet_is_pending_until_it_can() {
    use ferry::{DeregStatus, Side};
    let dst = Buffer::zeroed(4096);
    let a = loopback_agent("pending-a");
    let b = loopback_agent("pending-b");
    let region = register(&b, &dst);
    a.load_remote_md(&b.local_md().unwrap()).unwrap();
    ferry::loopback::faults(b.name())
        .unwrap()
        .withdraw_pending(2);
    assert_eq!(b.deregister(region), Ok(DeregStatus::Pending));
    // Withdrawn: not in B's tables, its lists or its metadata any more.
    assert_eq!(b.counts().2, 0);
    assert!(b.prep(Side::Local, MemKind::Dram, &[dst.whole()]).is_err());
    let peer = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    assert!(a.prep(peer, MemKind::Dram, &[dst.whole()]).is_err());
    // Polled: pending until the backend confirms.
    assert_eq!(b.deregister(region), Ok(DeregStatus::Pending));
    assert_eq!(b.deregister(region), Ok(DeregStatus::Done));
    assert!(matches!(b.deregister(region), Err(Error::NotFound { .. })));
    // The memory can be registered again.
    let again = register(&b, &dst);
    assert_eq!(b.deregister(again), Ok(DeregStatus::Done));
}
