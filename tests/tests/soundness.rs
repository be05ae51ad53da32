//! Issue 8 on the engine side, on the loopback backend: no safe call makes a backend
//! touch memory that is no longer registered (pins, stale regions, draining requests),
//! peers come and go with flat tables, strict small semantics (tickets, double flush,
//! own metadata), one path for direct calls, dispatch order, and the panic policy.

use std::panic::{catch_unwind, AssertUnwindSafe};

use ferry::loopback::faults;
use ferry::metadata::MdWriter;
use ferry::{
    Agent, CommandBuffer, Desc, Error, MemKind, Op, Outcome, Ref, Side, Subject, XferStatus,
};
use ferry_tests::{loopback_agent, register, Buffer, Rng};

const KIB: usize = 1024;

/// Two loopback agents with one buffer each, registered, each knowing the other.
struct Two {
    a: Agent,
    b: Agent,
    src_region: ferry::RegionId,
    dst_region: ferry::RegionId,
    b_at_a: ferry::PeerId,
}

fn two(src: &Buffer, dst: &Buffer) -> Two {
    let a = loopback_agent("sound-a");
    let b = loopback_agent("sound-b");
    let src_region = register(&a, src);
    let dst_region = register(&b, dst);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    b.load_remote_md(&a.local_md().unwrap()).unwrap();
    Two {
        a,
        b,
        src_region,
        dst_region,
        b_at_a,
    }
}

fn in_use(e: &Error, region: ferry::RegionId) -> bool {
    matches!(e, Error::NotAllowed { subject: Subject::Region(r), reason } if *r == region && reason.contains("in use"))
}

#[test]
fn a_made_request_pins_its_local_region_and_moves_bytes_only_while_registered() {
    let src = Buffer::random(KIB, &mut Rng::new(1));
    let dst = Buffer::zeroed(KIB);
    let t = two(&src, &dst);
    let x =
        t.a.create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            t.b_at_a,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    // The reproduction: make, deregister, post. Deregister is refused (the
    // region is pinned by the request), naming the region; nothing moved.
    let e = t.a.deregister(t.src_region).unwrap_err();
    assert!(in_use(&e, t.src_region), "{e}");
    assert!(e.to_string().contains("in use"), "{e}");
    assert!(dst.bytes().iter().all(|&b| b == 0));
    // The region is still registered, so posting is sound and moves the bytes.
    assert_eq!(t.a.post(x).unwrap(), XferStatus::Done);
    assert_eq!(dst.bytes(), src.bytes());
    // Done but not released: still pinned (it may be reposted).
    assert!(in_use(
        &t.a.deregister(t.src_region).unwrap_err(),
        t.src_region
    ));
    t.a.release(x).unwrap();
    t.a.deregister(t.src_region).unwrap();
    assert_eq!(t.a.counts(), (0, 0, 0, 1));
}

#[test]
fn a_local_request_pins_its_target_region_too() {
    let a = loopback_agent("sound-local");
    let mut rng = Rng::new(2);
    let src = Buffer::random(KIB, &mut rng);
    let dst = Buffer::zeroed(KIB);
    let rs = register(&a, &src);
    let rd = register(&a, &dst);
    let x = a
        .create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            Side::Local,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    assert!(in_use(&a.deregister(rd).unwrap_err(), rd));
    assert!(in_use(&a.deregister(rs).unwrap_err(), rs));
    assert_eq!(a.post(x).unwrap(), XferStatus::Done);
    assert_eq!(dst.bytes(), src.bytes());
    // Two requests over the same regions: both pin; releasing one is not enough.
    let y = a
        .create(
            Op::Read,
            MemKind::Dram,
            &[src.desc(0, 64), src.desc(128, 64)],
            Side::Local,
            MemKind::Dram,
            &[dst.desc(0, 64), dst.desc(256, 64)],
            None,
        )
        .unwrap();
    a.release(x).unwrap();
    assert!(in_use(&a.deregister(rd).unwrap_err(), rd));
    a.release(y).unwrap();
    a.deregister(rd).unwrap();
    a.deregister(rs).unwrap();
}

#[test]
fn a_prepared_list_naming_a_deregistered_region_fails_make_as_stale_and_moves_nothing() {
    let src = Buffer::random(KIB, &mut Rng::new(3));
    let dst = Buffer::zeroed(KIB);
    let t = two(&src, &dst);
    let local = t.a.prep(
        Side::Local,
        MemKind::Dram,
        &[src.desc(0, 512), src.desc(512, 512)],
    );
    let local = local.unwrap();
    let remote = t.a.prep(
        t.b_at_a,
        MemKind::Dram,
        &[dst.desc(0, 512), dst.desc(512, 512)],
    );
    let remote = remote.unwrap();
    // Lists pin nothing: deregistration goes through.
    t.a.deregister(t.src_region).unwrap();
    let e =
        t.a.make(Op::Write, local, &[], remote, &[], None)
            .unwrap_err();
    assert_eq!(
        e,
        Error::StaleRegion {
            region: t.src_region,
            descriptor: 0
        }
    );
    assert!(e.to_string().contains("deregistered"), "{e}");
    // Re-registering the same memory gives a new region; the old list stays stale.
    let again = register(&t.a, &src);
    assert_ne!(again, t.src_region);
    assert!(matches!(
        t.a.make(Op::Write, local, &[], remote, &[], None),
        Err(Error::StaleRegion { .. })
    ));
    // In one buffer too: deregister runs last, so a make recorded after it in the same
    // buffer still sees the region; the next buffer does not.
    let mut cmds = CommandBuffer::with_capacity(4);
    let l = cmds.prep(Side::Local, MemKind::Dram, &[src.whole()]);
    cmds.deregister(again);
    t.a.flush(&mut cmds);
    let l = cmds.created(l).unwrap();
    let r = t.a.prep(t.b_at_a, MemKind::Dram, &[dst.whole()]).unwrap();
    assert!(matches!(
        t.a.make(Op::Write, l, &[], r, &[], None),
        Err(Error::StaleRegion { region, .. }) if region == again
    ));
    assert!(dst.bytes().iter().all(|&b| b == 0), "no byte moved");
    // The target's region was never touched and is still registered there.
    t.b.deregister(t.dst_region).unwrap();
}

#[test]
fn a_request_whose_peer_went_away_drains_until_its_backend_confirms_the_end() {
    let src = Buffer::random(KIB, &mut Rng::new(4));
    let dst = Buffer::zeroed(KIB);
    let t = two(&src, &dst);
    let f = faults(t.a.name()).unwrap();
    let x =
        t.a.create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            t.b_at_a,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    // The completion is held back for 8 progress calls (every flush makes one) and the
    // backend cannot cancel: like a UCX request already on the wire.
    f.complete_late(8);
    f.refuse_cancel(true);
    assert_eq!(t.a.post(x).unwrap(), XferStatus::InProgress);
    t.a.invalidate_remote_md(t.b_at_a).unwrap();
    // The caller sees not-found at once…
    let e = t.a.check(x).unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
    assert!(e.to_string().contains(t.b.name()), "{e}");
    // …but the request drains: no repost, no release, its region stays registered.
    assert!(
        matches!(t.a.post(x), Err(Error::NotAllowed { ref reason, .. }) if reason.contains("draining"))
    );
    let e = t.a.release(x).unwrap_err();
    assert!(e.to_string().contains("draining"), "{e}");
    assert!(in_use(
        &t.a.deregister(t.src_region).unwrap_err(),
        t.src_region
    ));
    // The backend's completion arrives (check drove progress above): releasable now.
    let mut rounds = 0;
    while t.a.release(x).is_err() {
        rounds += 1;
        assert!(rounds < 20, "the held completion never arrived");
        t.a.progress();
    }
    t.a.deregister(t.src_region).unwrap();
    assert_eq!(t.a.counts().0, 0);
    f.clear();
}

#[test]
fn a_cancel_the_backend_confirms_ends_the_request_at_once() {
    let src = Buffer::random(KIB, &mut Rng::new(5));
    let dst = Buffer::zeroed(KIB);
    let t = two(&src, &dst);
    let f = faults(t.a.name()).unwrap();
    let x =
        t.a.create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            t.b_at_a,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    f.complete_late(50);
    assert_eq!(t.a.post(x).unwrap(), XferStatus::InProgress);
    // Through the command path this time: same behaviour as the direct method.
    let mut cmds = CommandBuffer::with_capacity(4);
    cmds.invalidate_md(t.b_at_a);
    let status = cmds.check(x);
    t.a.flush(&mut cmds);
    assert!(matches!(cmds.status(status), Err(Error::NotFound { .. })));
    t.a.release(x).unwrap();
    t.a.deregister(t.src_region).unwrap();
    f.clear();
}

#[test]
fn one_hundred_thousand_peers_come_and_go_with_flat_tables() {
    let a = loopback_agent("sound-churn");
    let b = loopback_agent("sound-churn-b");
    // B's loopback connection info, published under many agent names (loopback peers
    // are found by instance id; the name is only a name).
    let b_md = ferry::metadata::PeerMd::from_bytes(&b.local_md().unwrap()).unwrap();
    let conn = b_md.backend(0).and_then(|(_, c)| c).unwrap().to_vec();
    let blob = |i: u32| {
        let mut w = MdWriter::new(&format!("churn-peer-{i}"), 1);
        w.backend("LOOPBACK", Some(&conn));
        w.finish().unwrap()
    };
    let mut slots_after_warmup = 0;
    for i in 0..100_000u32 {
        let peer = a.load_remote_md(&blob(i)).unwrap();
        assert_eq!(a.counts().3, 1);
        a.invalidate_remote_md(peer).unwrap();
        assert_eq!(a.counts().3, 0);
        if i == 10 {
            slots_after_warmup = a.peer_slots();
        }
    }
    assert_eq!(a.peer_slots(), slots_after_warmup, "the peer table grew");
    assert!(a.peer(&format!("churn-peer-{}", 99_999)).is_none());
}

#[test]
fn a_ticket_naming_a_later_command_is_refused() {
    let a = loopback_agent("sound-ticket");
    let src = Buffer::random(KIB, &mut Rng::new(6));
    let dst = Buffer::zeroed(KIB);
    register(&a, &src);
    register(&a, &dst);
    let mut cmds = CommandBuffer::with_capacity(8);
    // Command #0 posts the request command #3 will make: the phases would allow it
    // (make runs before dispatch), but a ticket must name an earlier command.
    cmds.post(Ref::Ticket(3));
    let l = cmds.prep(Side::Local, MemKind::Dram, &[src.whole()]);
    let r = cmds.prep(Side::Local, MemKind::Dram, &[dst.whole()]);
    let x = cmds.make(Op::Write, l, &[], r, &[]).ticket();
    assert_eq!(x.index(), 3);
    a.flush(&mut cmds);
    match &cmds.outcomes()[0] {
        Outcome::Failed(Error::InvalidParam { subject, reason }) => {
            assert_eq!(*subject, Subject::Command(3));
            assert!(reason.contains("earlier"), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(cmds.created(x).is_ok());
    assert!(dst.bytes().iter().all(|&b| b == 0), "no byte moved");
    // A ticket naming the command itself is refused too.
    cmds.clear();
    cmds.release(Ref::Ticket(0));
    a.flush(&mut cmds);
    assert!(matches!(
        cmds.outcomes()[0],
        Outcome::Failed(Error::InvalidParam { .. })
    ));
}

#[test]
fn flushing_a_buffer_twice_without_clear_is_refused() {
    let src = Buffer::random(KIB, &mut Rng::new(7));
    let dst = Buffer::zeroed(KIB);
    let t = two(&src, &dst);
    let x =
        t.a.create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            t.b_at_a,
            MemKind::Dram,
            &[dst.whole()],
            Some(b"once"),
        )
        .unwrap();
    let mut cmds = CommandBuffer::with_capacity(4);
    cmds.post(x);
    let summary = t.a.flush(&mut cmds);
    assert_eq!(summary.posted, 1);
    assert!(cmds.is_flushed());
    let again = t.a.flush(&mut cmds);
    assert_eq!(again.posted, 0);
    assert_eq!(again.failed, 1);
    assert!(
        matches!(&cmds.outcomes()[0], Outcome::Failed(Error::NotAllowed { reason, .. }) if reason.contains("already flushed"))
    );
    // The notification went once.
    let got = t.b.drain_notifications();
    assert_eq!(got.len(), 1);
    // clear() makes it recordable and flushable again.
    cmds.clear();
    cmds.post(x);
    t.a.flush(&mut cmds);
    assert_eq!(cmds.outcomes()[0], Outcome::Status(XferStatus::Done));
}

#[test]
fn loading_our_own_metadata_as_a_peer_is_refused() {
    let a = loopback_agent("sound-self");
    let e = a.load_remote_md(&a.local_md().unwrap()).unwrap_err();
    assert!(
        matches!(&e, Error::NotAllowed { subject: Subject::PeerName(n), .. } if n == a.name()),
        "{e}"
    );
    assert_eq!(a.counts().3, 0);
}

#[test]
fn make_connection_reaches_the_backend_and_refuses_stale_peers() {
    let src = Buffer::random(KIB, &mut Rng::new(8));
    let dst = Buffer::zeroed(KIB);
    let t = two(&src, &dst);
    t.a.make_connection(t.b_at_a).unwrap();
    // The loopback's connect checks the target is reachable.
    faults(t.a.name()).unwrap().drop_peer(t.b.name());
    assert!(matches!(
        t.a.make_connection(t.b_at_a),
        Err(Error::RemoteDisconnect { .. })
    ));
    faults(t.a.name()).unwrap().clear();
    t.a.invalidate_remote_md(t.b_at_a).unwrap();
    assert!(matches!(
        t.a.make_connection(t.b_at_a),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn direct_progress_and_drain_notifications_drive_the_same_progress_phase() {
    let src = Buffer::random(KIB, &mut Rng::new(9));
    let dst = Buffer::zeroed(KIB);
    let t = two(&src, &dst);
    let f = faults(t.a.name()).unwrap();
    let x =
        t.a.create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            t.b_at_a,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    // Held for 2 progress calls: the post's own flush is the first.
    f.complete_late(2);
    assert_eq!(t.a.post(x).unwrap(), XferStatus::InProgress);
    assert_eq!(t.a.progress(), 1, "progress routed the completion");
    assert_eq!(t.a.check(x).unwrap(), XferStatus::Done);
    // drain_notifications drives progress first (as NIXL's getNotifs).
    assert_eq!(t.a.post(x).unwrap(), XferStatus::InProgress);
    assert!(t.a.drain_notifications().is_empty());
    assert_eq!(t.a.progress(), 0, "drain_notifications already routed it");
    assert_eq!(t.a.check(x).unwrap(), XferStatus::Done);
    f.clear();
}

#[test]
fn posts_to_one_endpoint_reach_the_backend_in_record_order() {
    // 64 one-byte requests write distinct values into the same target byte: the byte
    // ends as the last one recorded, whatever order the posts' handles sort in.
    let a = loopback_agent("sound-order");
    let mut src = Buffer::zeroed(64);
    for (i, b) in src.bytes_mut().iter_mut().enumerate() {
        *b = i as u8 + 1;
    }
    let dst = Buffer::zeroed(64);
    register(&a, &src);
    register(&a, &dst);
    let mut xs = Vec::new();
    for i in 0..64 {
        let x = a
            .create(
                Op::Write,
                MemKind::Dram,
                &[src.desc(i, 1)],
                Side::Local,
                MemKind::Dram,
                &[dst.desc(0, 1)],
                None,
            )
            .unwrap();
        xs.push((x, i as u8 + 1));
    }
    let mut rng = Rng::new(11);
    let mut cmds = CommandBuffer::with_capacity(64);
    for _ in 0..16 {
        rng.shuffle(&mut xs);
        cmds.clear();
        for &(x, _) in &xs {
            cmds.post(x);
        }
        let summary = a.flush(&mut cmds);
        assert_eq!(summary.failed, 0);
        assert_eq!(summary.posted, 64);
        assert_eq!(
            dst.bytes()[0],
            xs.last().unwrap().1,
            "the last recorded post wrote last"
        );
    }
}

#[test]
fn a_panic_inside_a_flush_poisons_the_agent_which_then_refuses_work() {
    let src = Buffer::random(KIB, &mut Rng::new(12));
    let dst = Buffer::zeroed(KIB);
    let t = two(&src, &dst);
    let x =
        t.a.create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            t.b_at_a,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    faults(t.a.name()).unwrap().panic_next_post();
    let panicked = catch_unwind(AssertUnwindSafe(|| t.a.post(x)));
    assert!(panicked.is_err(), "the fault panics inside post");
    assert!(t.a.is_poisoned());
    let poisoned = Error::Poisoned {
        agent: t.a.name().to_string(),
    };
    assert_eq!(t.a.post(x), Err(poisoned.clone()));
    // Its own status: callers switching on status tell it from a refusal.
    assert_eq!(poisoned.status_name(), "POISONED");
    assert_eq!(t.a.release(x), Err(poisoned.clone()));
    assert_eq!(t.a.local_md(), Err(poisoned.clone()));
    let mut cmds = CommandBuffer::with_capacity(4);
    cmds.check(x);
    cmds.drain_notifications();
    let summary = t.a.flush(&mut cmds);
    assert_eq!(summary.failed, 2);
    assert!(cmds
        .outcomes()
        .iter()
        .all(|o| o == &Outcome::Failed(poisoned.clone())));
    assert_eq!(t.a.progress(), 0);
    assert!(t.a.drain_notifications().is_empty());
    // The other agent is untouched.
    assert!(!t.b.is_poisoned());
    assert!(t.b.local_md().is_ok());
}

#[test]
fn a_peer_with_many_partial_blobs_resolves_every_region() {
    // 300 partial blobs of one region each (the merged index answers every lookup with
    // one binary search; this checks it answers right, including the first and last).
    let a = loopback_agent("sound-partial-a");
    let b = loopback_agent("sound-partial-b");
    let src = Buffer::random(300 * 64, &mut Rng::new(13));
    register(&a, &src);
    let pieces: Vec<Buffer> = (0..300).map(|_| Buffer::zeroed(64)).collect();
    let mut peer = None;
    for (i, piece) in pieces.iter().enumerate() {
        let region = register(&b, piece);
        let blob = b.local_partial_md(&[region], i == 0).unwrap();
        let p = a.load_remote_md(&blob).unwrap();
        assert_eq!(
            *peer.get_or_insert(p),
            p,
            "partial blobs accumulate on one peer"
        );
    }
    let peer = peer.unwrap();
    // Reloading a blob already known is a no-op.
    assert_eq!(a.load_remote_md(&b.local_md().unwrap()).unwrap(), peer);
    let local: Vec<Desc> = (0..300).map(|i| src.desc(i * 64, 64)).collect();
    // Reverse order, so neighbouring descriptors live in different blobs.
    let remote: Vec<Desc> = pieces.iter().rev().map(Buffer::whole).collect();
    let x = a
        .create(
            Op::Write,
            MemKind::Dram,
            &local,
            peer,
            MemKind::Dram,
            &remote,
            None,
        )
        .unwrap();
    assert_eq!(a.post(x).unwrap(), XferStatus::Done);
    for (i, piece) in pieces.iter().rev().enumerate() {
        assert_eq!(
            piece.bytes(),
            &src.bytes()[i * 64..(i + 1) * 64],
            "piece {i}"
        );
    }
}

#[test]
fn invalidating_and_reloading_a_peer_a_thousand_times_during_transfers_accounts_for_every_request()
{
    let src = Buffer::random(16 * KIB, &mut Rng::new(14));
    let dst = Buffer::zeroed(16 * KIB);
    let t = two(&src, &dst);
    let f = faults(t.a.name()).unwrap();
    let md_b = t.b.local_md().unwrap();
    let mut rng = Rng::new(15);
    let mut peer = t.b_at_a;
    let mut live = Vec::new();
    for round in 0..1000 {
        // A few requests in flight, some held back, some not cancelable.
        f.complete_late(rng.below(4) as u32);
        f.refuse_cancel(rng.below(2) == 0);
        for _ in 0..3 {
            let at = rng.below(16) as usize * KIB;
            let x =
                t.a.create(
                    Op::Write,
                    MemKind::Dram,
                    &[src.desc(at, KIB)],
                    peer,
                    MemKind::Dram,
                    &[dst.desc(at, KIB)],
                    None,
                )
                .unwrap();
            let status = t.a.post(x);
            assert!(
                matches!(status, Ok(XferStatus::InProgress | XferStatus::Done)),
                "round {round}: {status:?}"
            );
            live.push(x);
        }
        t.a.invalidate_remote_md(peer).unwrap();
        peer = t.a.load_remote_md(&md_b).unwrap();
        // Release what may be released; the rest (draining) waits for its completion.
        live.retain(|&x| t.a.release(x).is_err());
        assert!(
            live.len() <= 12,
            "round {round}: {} requests stuck",
            live.len()
        );
    }
    f.clear();
    let mut rounds = 0;
    while !live.is_empty() {
        rounds += 1;
        assert!(rounds < 20, "{} requests never drained", live.len());
        t.a.progress();
        live.retain(|&x| t.a.release(x).is_err());
    }
    assert_eq!(t.a.counts(), (0, 0, 1, 1), "every request accounted for");
    t.a.deregister(t.src_region).unwrap();
    // Every block that moved holds exactly the source's bytes.
    for (i, block) in dst.bytes().chunks(KIB).enumerate() {
        let want = &src.bytes()[i * KIB..(i + 1) * KIB];
        assert!(block == want || block.iter().all(|&b| b == 0), "block {i}");
    }
}
