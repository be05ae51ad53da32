//! End-to-end scenarios on the loopback backend: two agents in one process.

use ferry::{Agent, CommandBuffer, Desc, Error, MemKind, Op, Outcome, Side, Subject, XferStatus};
use ferry_tests::{loopback_agent, pair, register, try_register, unique, Buffer, Rng};

const KIB: usize = 1024;

/// Random (offset, len) pieces that tile `[0, total)` of both buffers in a random order.
fn random_pieces(rng: &mut Rng, total: usize, count: usize) -> Vec<(usize, usize, usize)> {
    let mut cuts: Vec<usize> = (0..count - 1)
        .map(|_| 1 + rng.below(total as u64 - 1) as usize)
        .collect();
    cuts.push(0);
    cuts.push(total);
    cuts.sort_unstable();
    cuts.dedup();
    let mut remote_starts: Vec<usize> = cuts.windows(2).map(|w| w[0]).collect();
    let lens: Vec<usize> = cuts.windows(2).map(|w| w[1] - w[0]).collect();
    // Remote layout: the same pieces packed in a shuffled order.
    let mut order: Vec<usize> = (0..lens.len()).collect();
    rng.shuffle(&mut order);
    let mut at = 0;
    for &i in &order {
        remote_starts[i] = at;
        at += lens[i];
    }
    cuts.windows(2)
        .enumerate()
        .map(|(i, w)| (w[0], remote_starts[i], w[1] - w[0]))
        .collect()
}

#[test]
fn write_and_read_random_sizes_and_offsets_verified_byte_for_byte() {
    let mut rng = Rng::new(7);
    for round in 0..6 {
        let total = 64 * KIB + rng.below(64 * KIB as u64) as usize;
        let src = Buffer::random(total, &mut rng);
        let dst = Buffer::zeroed(total);
        let p = pair(&src, &dst);
        let count = 1 + rng.below(300) as usize;
        let pieces = random_pieces(&mut rng, total, count);
        let local: Vec<Desc> = pieces.iter().map(|&(l, _, n)| src.desc(l, n)).collect();
        let remote: Vec<Desc> = pieces.iter().map(|&(_, r, n)| dst.desc(r, n)).collect();

        // WRITE: A's bytes land in B's buffer at the shuffled places.
        let x = p.create(Op::Write, &local, &remote, None);
        assert_eq!(p.a.post(x).unwrap(), XferStatus::Done, "round {round}");
        for &(l, r, n) in &pieces {
            assert_eq!(
                &dst.bytes()[r..r + n],
                &src.bytes()[l..l + n],
                "round {round} write piece at {l}"
            );
        }

        // READ back from B into a fresh buffer of A's.
        let back = Buffer::zeroed(total);
        register(&p.a, &back);
        let local_back: Vec<Desc> = pieces.iter().map(|&(l, _, n)| back.desc(l, n)).collect();
        let y = p.create(Op::Read, &local_back, &remote, None);
        assert_eq!(p.a.post(y).unwrap(), XferStatus::Done);
        assert_eq!(
            back.bytes(),
            src.bytes(),
            "round {round}: read-back differs"
        );
        p.a.release(x).unwrap();
        p.a.release(y).unwrap();
    }
}

#[test]
fn prep_make_with_index_lists_and_merged_count() {
    let mut rng = Rng::new(11);
    let block = 64;
    let blocks = 256;
    let src = Buffer::random(block * blocks, &mut rng);
    let dst = Buffer::zeroed(block * blocks);
    let p = pair(&src, &dst);
    let local_descs: Vec<Desc> = (0..blocks).map(|i| src.desc(i * block, block)).collect();
    let remote_descs: Vec<Desc> = (0..blocks).map(|i| dst.desc(i * block, block)).collect();

    let mut cmds = CommandBuffer::with_capacity(16);
    let local = cmds.prep(Side::Local, MemKind::Dram, &local_descs);
    let remote = cmds.prep(p.b_at_a, MemKind::Dram, &remote_descs);
    // Blocks 10..20 contiguous on both sides (merge to 1), then 5 scattered ones.
    let mut li: Vec<u32> = (10..20).collect();
    let mut ri: Vec<u32> = (100..110).collect();
    li.extend([3, 200, 50, 51, 7]);
    ri.extend([1, 2, 60, 90, 8]);
    let x = cmds.make(Op::Write, local, &li, remote, &ri).ticket();
    let post = cmds.post(x);
    p.a.flush(&mut cmds);
    assert!(
        cmds.errors().next().is_none(),
        "{:?}",
        cmds.errors().collect::<Vec<_>>()
    );
    assert_eq!(cmds.status(post).unwrap(), XferStatus::Done);
    let x = cmds.created(x).unwrap();
    let local = cmds.created(local).unwrap();
    let remote = cmds.created(remote).unwrap();
    for (l, r) in li.iter().zip(&ri) {
        let (l, r) = (*l as usize * block, *r as usize * block);
        assert_eq!(&dst.bytes()[r..r + block], &src.bytes()[l..l + block]);
    }
    let t = p.a.telemetry(x).unwrap();
    assert_eq!(t.desc_count_unmerged, 15);
    assert_eq!(
        t.desc_count,
        1 + 5,
        "10 adjacent pairs merge into one range"
    );
    assert_eq!(p.a.xfer_ranges(x).unwrap(), 6);
    assert_eq!(t.total_bytes, 15 * block as u64);
    assert!(t.start.is_some());

    // Out-of-range index and mismatched lengths are typed errors naming the problem.
    let e =
        p.a.make(Op::Write, local, &[0, 999], remote, &[0, 1], None)
            .unwrap_err();
    assert!(matches!(e, Error::InvalidParam { .. }), "{e}");
    assert!(e.to_string().contains("999"), "{e}");
    let e =
        p.a.make(Op::Write, local, &[0, 1], remote, &[0], None)
            .unwrap_err();
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
}

#[test]
fn notifications_with_transfer_standalone_to_self_and_empty() {
    let src = Buffer::random(4 * KIB, &mut Rng::new(3));
    let dst = Buffer::zeroed(4 * KIB);
    let p = pair(&src, &dst);

    // With a transfer: when B sees it, the data is there.
    let x = p.create(
        Op::Write,
        &[src.whole()],
        &[dst.whole()],
        Some(b"blocks-ready"),
    );
    p.a.post(x).unwrap();
    let got = p.b.drain_notifications();
    assert_eq!(
        got,
        vec![(p.a.name().to_string(), b"blocks-ready".to_vec())]
    );
    assert_eq!(dst.bytes(), src.bytes());

    // Standalone, empty payload, and to self; drained through a command buffer.
    p.a.notify(p.b_at_a, b"").unwrap();
    p.a.notify(p.b_at_a, b"standalone").unwrap();
    p.b.notify(Side::Local, b"to-myself").unwrap();
    let mut cmds = CommandBuffer::with_capacity(4);
    let drained = cmds.drain_notifications();
    p.b.flush(&mut cmds);
    assert_eq!(cmds.outcome(drained), &Outcome::Drained(3));
    let got: Vec<(String, Vec<u8>)> = cmds
        .notifications()
        .map(|(f, p)| (f.to_string(), p.to_vec()))
        .collect();
    assert_eq!(
        got,
        vec![
            (p.a.name().to_string(), Vec::new()),
            (p.a.name().to_string(), b"standalone".to_vec()),
            (p.b.name().to_string(), b"to-myself".to_vec()),
        ]
    );
    // Nothing is lost or repeated.
    assert!(p.b.drain_notifications().is_empty());
    // A notification to self needs no metadata at all.
    let lonely = loopback_agent("lonely");
    lonely.notify(Side::Local, b"x").unwrap();
    assert_eq!(lonely.drain_notifications().len(), 1);
}

#[test]
fn repost_of_active_request_is_refused_and_of_finished_is_fine() {
    let src = Buffer::random(KIB, &mut Rng::new(5));
    let dst = Buffer::zeroed(KIB);
    let p = pair(&src, &dst);
    let faults = ferry::loopback::faults(p.a.name()).unwrap();
    let x = p.create(Op::Write, &[src.whole()], &[dst.whole()], None);
    assert_eq!(p.a.check(x).unwrap(), XferStatus::NotPosted);
    faults.complete_late(3);
    assert_eq!(p.a.post(x).unwrap(), XferStatus::InProgress);
    assert_eq!(p.a.post(x).unwrap_err(), Error::RepostActive { xfer: x });
    // Posting it twice in one buffer is refused for the second post too.
    faults.complete_late(0);
    let mut status = p.a.check(x).unwrap();
    for _ in 0..10 {
        if status == XferStatus::Done {
            break;
        }
        status = p.a.check(x).unwrap();
    }
    assert_eq!(status, XferStatus::Done);
    assert_eq!(
        p.a.post(x).unwrap(),
        XferStatus::Done,
        "repost of a finished request"
    );
    let mut cmds = CommandBuffer::with_capacity(4);
    let first = cmds.post(x);
    let second = cmds.post(x);
    p.a.flush(&mut cmds);
    assert_eq!(cmds.status(first).unwrap(), XferStatus::Done);
    assert_eq!(
        cmds.status(second).unwrap_err(),
        Error::RepostActive { xfer: x }
    );
}

#[test]
fn stale_and_released_handles_are_refused() {
    let src = Buffer::random(KIB, &mut Rng::new(9));
    let dst = Buffer::zeroed(KIB);
    let p = pair(&src, &dst);
    let local =
        p.a.prep(Side::Local, MemKind::Dram, &[src.whole()])
            .unwrap();
    let remote = p.a.prep(p.b_at_a, MemKind::Dram, &[dst.whole()]).unwrap();
    let x = p.a.make(Op::Write, local, &[], remote, &[], None).unwrap();
    p.a.post(x).unwrap();
    p.a.release(x).unwrap();
    assert!(matches!(p.a.post(x), Err(Error::NotFound { .. })));
    assert!(matches!(p.a.check(x), Err(Error::NotFound { .. })));
    assert!(matches!(p.a.release(x), Err(Error::NotFound { .. })));
    // A new request may reuse the slot; the old handle still does not reach it.
    let y = p.a.make(Op::Write, local, &[], remote, &[], None).unwrap();
    assert_ne!(x, y);
    assert!(matches!(p.a.check(x), Err(Error::NotFound { .. })));
    assert_eq!(p.a.check(y).unwrap(), XferStatus::NotPosted);
    p.a.release_prep(local).unwrap();
    assert!(matches!(
        p.a.make(Op::Write, local, &[], remote, &[], None),
        Err(Error::NotFound { .. })
    ));
    // Deregistered regions: later preps fail with not-found naming the descriptor.
    let region = register(&p.a, &Buffer::zeroed(64));
    p.a.deregister(region).unwrap();
    assert!(matches!(
        p.a.deregister(region),
        Err(Error::NotFound { .. })
    ));
    let e =
        p.a.prep(Side::Local, MemKind::Dram, &[Desc::new(1, 8, 0)])
            .unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
    assert!(e.to_string().contains("descriptor #0"), "{e}");
}

#[test]
fn overlapping_and_bad_registrations_are_refused() {
    let buf = Buffer::zeroed(4 * KIB);
    let a = loopback_agent("overlap");
    let r = register(&a, &buf);
    let e = try_register(&a, MemKind::Dram, buf.desc(100, 10)).unwrap_err();
    assert!(matches!(e, Error::NotAllowed { .. }), "{e}");
    assert!(e.to_string().contains("overlaps"), "{e}");
    let e = try_register(&a, MemKind::Dram, buf.desc(0, 0)).unwrap_err();
    assert!(matches!(e, Error::InvalidParam { .. }), "{e}");
    let e = try_register(&a, MemKind::Vram, Desc::new(4096, 10, 0)).unwrap_err();
    assert!(matches!(e, Error::NotSupported { .. }), "{e}");
    // The first registration is intact.
    let before = a.counts();
    assert_eq!(before.2, 1);
    a.deregister(r).unwrap();
    assert_eq!(a.counts().2, 0);
    // Duplicate agent names are refused.
    let name = a.name().to_string();
    assert!(matches!(
        Agent::new(ferry::AgentConfig::named(name)),
        Err(Error::NotAllowed { .. })
    ));
}

#[test]
fn invalidation_and_reload_give_not_found_for_old_requests() {
    let src = Buffer::random(KIB, &mut Rng::new(13));
    let dst = Buffer::zeroed(KIB);
    let p = pair(&src, &dst);
    let remote = p.a.prep(p.b_at_a, MemKind::Dram, &[dst.whole()]).unwrap();
    let local =
        p.a.prep(Side::Local, MemKind::Dram, &[src.whole()])
            .unwrap();
    let x = p.a.make(Op::Write, local, &[], remote, &[], None).unwrap();
    p.a.invalidate_remote_md(p.b_at_a).unwrap();
    // The peer's row is freed: its handle is stale.
    assert_eq!(p.a.peer(p.b.name()), None);
    let e = p.a.post(x).unwrap_err();
    assert_eq!(
        e,
        Error::NotFound {
            subject: Subject::Peer(p.b_at_a)
        }
    );
    assert!(matches!(
        p.a.notify(p.b_at_a, b"x"),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        p.a.invalidate_remote_md(p.b_at_a),
        Err(Error::NotFound { .. })
    ));
    // Reload: a new peer handle; requests and lists built on the old one stay dead.
    let again = p.a.load_remote_md(&p.b.local_md().unwrap()).unwrap();
    assert_ne!(again, p.b_at_a);
    assert!(matches!(p.a.post(x), Err(Error::NotFound { .. })));
    assert!(matches!(
        p.a.make(Op::Write, local, &[], remote, &[], None),
        Err(Error::NotFound { .. })
    ));
    let remote2 = p.a.prep(again, MemKind::Dram, &[dst.whole()]).unwrap();
    let y = p.a.make(Op::Write, local, &[], remote2, &[], None).unwrap();
    assert_eq!(p.a.post(y).unwrap(), XferStatus::Done);
    assert_eq!(dst.bytes(), src.bytes());

    // Identical reload is idempotent: old requests keep working.
    p.a.load_remote_md(&p.b.local_md().unwrap()).unwrap();
    assert_eq!(p.a.post(y).unwrap(), XferStatus::Done);

    // B deregisters something: its new metadata has a new generation, and loading it
    // replaces the old (requests built before fail with not-found).
    let extra = Buffer::zeroed(64);
    let r = register(&p.b, &extra);
    p.b.deregister(r).unwrap();
    p.a.load_remote_md(&p.b.local_md().unwrap()).unwrap();
    assert!(matches!(p.a.post(y), Err(Error::NotFound { .. })));
}

#[test]
fn partial_metadata_accumulates_and_conflicts_are_refused() {
    let one = Buffer::random(KIB, &mut Rng::new(17));
    let two = Buffer::random(KIB, &mut Rng::new(19));
    let mine = Buffer::zeroed(2 * KIB);
    let a = loopback_agent("pa");
    let b = loopback_agent("pb");
    register(&a, &mine);
    let r1 = register(&b, &one);
    let r2 = register(&b, &two);
    // First partial blob: region one with connection info; second: region two without.
    let peer = a
        .load_remote_md(&b.local_partial_md(&[r1], true).unwrap())
        .unwrap();
    assert!(matches!(
        a.prep(peer, MemKind::Dram, &[two.whole()]),
        Err(Error::NotFound { .. })
    ));
    let peer2 = a
        .load_remote_md(&b.local_partial_md(&[r2], false).unwrap())
        .unwrap();
    assert_eq!(peer, peer2);
    let remote = a
        .prep(peer, MemKind::Dram, &[one.whole(), two.whole()])
        .unwrap();
    let local = a
        .prep(
            Side::Local,
            MemKind::Dram,
            &[mine.desc(0, KIB), mine.desc(KIB, KIB)],
        )
        .unwrap();
    let x = a.make(Op::Read, local, &[], remote, &[], None).unwrap();
    assert_eq!(a.post(x).unwrap(), XferStatus::Done);
    assert_eq!(&mine.bytes()[..KIB], one.bytes());
    assert_eq!(&mine.bytes()[KIB..], two.bytes());

    // A blob of the same generation that contradicts a known region is refused, and
    // what was loaded stays usable.
    let mut forged = ferry::metadata::MdWriter::new(
        b.name(),
        ferry::metadata::PeerMd::from_bytes(&b.local_md().unwrap())
            .unwrap()
            .generation(),
    );
    let idx = forged.backend("LOOPBACK", None);
    forged.region(
        idx,
        MemKind::Dram,
        Desc::new(one.whole().addr + 16, 8, 0),
        b"",
    );
    let e = a.load_remote_md(&forged.finish().unwrap()).unwrap_err();
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    assert_eq!(a.post(x).unwrap(), XferStatus::Done);
}

#[test]
fn sixteen_thousand_descriptor_request() {
    let n = 16 * 1024;
    let block = 64;
    let mut rng = Rng::new(23);
    let src = Buffer::random(n * block, &mut rng);
    let dst = Buffer::zeroed(n * block);
    let p = pair(&src, &dst);
    let (local, remote, order) = ferry_tests::shuffled_blocks(&src, &dst, n, block, &mut rng);
    let x = p.create(Op::Write, &local, &remote, Some(b"16k"));
    assert_eq!(p.a.post(x).unwrap(), XferStatus::Done);
    ferry_tests::assert_shuffled_copy(&src, &dst, &order, block, "16k request");
    let t = p.a.telemetry(x).unwrap();
    assert_eq!(t.desc_count_unmerged, n as u64);
    assert!(t.desc_count > (n / 2) as u64, "shuffled pairs rarely merge");
    assert_eq!(p.b.drain_notifications().len(), 1);
}

#[test]
fn one_bad_command_fails_alone() {
    let src = Buffer::random(KIB, &mut Rng::new(29));
    let dst = Buffer::zeroed(KIB);
    let p = pair(&src, &dst);
    let mut cmds = CommandBuffer::with_capacity(16);
    let good_local = cmds.prep(Side::Local, MemKind::Dram, &[src.whole()]);
    let bad_local = cmds.prep(Side::Local, MemKind::Dram, &[Desc::new(8, 8, 0)]);
    let remote = cmds.prep(p.b_at_a, MemKind::Dram, &[dst.whole()]);
    let good = cmds.make(Op::Write, good_local, &[], remote, &[]).ticket();
    let bad = cmds.make(Op::Write, bad_local, &[], remote, &[]).ticket();
    let good_post = cmds.post(good);
    let bad_post = cmds.post(bad);
    let summary = p.a.flush(&mut cmds);
    assert!(matches!(
        cmds.outcome(bad_local).error(),
        Some(Error::NotFound { .. })
    ));
    assert_eq!(
        cmds.outcome(bad).error(),
        Some(&Error::DependencyFailed {
            command: bad_local.index()
        })
    );
    assert_eq!(
        cmds.status(bad_post).unwrap_err(),
        Error::DependencyFailed {
            command: bad.index()
        }
    );
    assert_eq!(cmds.status(good_post).unwrap(), XferStatus::Done);
    assert_eq!(summary.failed, 3);
    assert_eq!(dst.bytes(), src.bytes());
}

#[test]
fn fault_injection_failed_transfer_and_dropped_peer_leave_agent_usable() {
    let src = Buffer::random(KIB, &mut Rng::new(31));
    let dst = Buffer::zeroed(KIB);
    let p = pair(&src, &dst);
    let faults = ferry::loopback::faults(p.a.name()).unwrap();
    let x = p.create(Op::Write, &[src.whole()], &[dst.whole()], None);
    faults.fail_next(1);
    let e = p.a.post(x).unwrap_err();
    assert!(matches!(e, Error::Backend { errno: 5, .. }), "{e}");
    // The failed request can be posted again and succeeds.
    assert_eq!(p.a.post(x).unwrap(), XferStatus::Done);

    faults.drop_peer(p.b.name());
    let e = p.a.post(x).unwrap_err();
    assert!(matches!(e, Error::RemoteDisconnect { .. }), "{e}");
    assert!(e.to_string().contains(p.b.name()), "{e}");
    faults.restore_peer(p.b.name());
    assert_eq!(p.a.post(x).unwrap(), XferStatus::Done);

    // The peer really goes away: posts fail with remote-disconnect, not a crash.
    let ferry_tests::Pair { a, b, b_at_a, .. } = p;
    drop(b);
    let e = a.post(x).unwrap_err();
    assert!(matches!(e, Error::RemoteDisconnect { .. }), "{e}");
    a.invalidate_remote_md(b_at_a).unwrap();
    assert!(matches!(a.post(x), Err(Error::NotFound { .. })));
    // Local work still runs.
    let c = loopback_agent("c");
    let c_buf = Buffer::zeroed(KIB);
    register(&c, &c_buf);
    let peer_c = a.load_remote_md(&c.local_md().unwrap()).unwrap();
    let y = a
        .create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            peer_c,
            MemKind::Dram,
            &[c_buf.whole()],
            None,
        )
        .unwrap();
    assert_eq!(a.post(y).unwrap(), XferStatus::Done);
    assert_eq!(c_buf.bytes(), src.bytes());
}

#[test]
fn command_buffers_recorded_and_submitted_from_many_threads() {
    let threads = 4;
    let per_thread = 64;
    let block = 256;
    let mut rng = Rng::new(37);
    let src = Buffer::random(threads * per_thread * block, &mut rng);
    let dst = Buffer::zeroed(threads * per_thread * block);
    let p = pair(&src, &dst);
    let local =
        p.a.prep(
            Side::Local,
            MemKind::Dram,
            &(0..threads * per_thread)
                .map(|i| src.desc(i * block, block))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let remote =
        p.a.prep(
            p.b_at_a,
            MemKind::Dram,
            &(0..threads * per_thread)
                .map(|i| dst.desc(i * block, block))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    std::thread::scope(|s| {
        for t in 0..threads {
            let agent = &p.a;
            s.spawn(move || {
                let mut cmds = CommandBuffer::with_capacity(per_thread * 3);
                for k in 0..per_thread {
                    let i = (t * per_thread + k) as u32;
                    let x = cmds.make(Op::Write, local, &[i], remote, &[i]).ticket();
                    cmds.post(x);
                    cmds.release(x);
                }
                agent.flush(&mut cmds);
                assert!(
                    cmds.errors().next().is_none(),
                    "thread {t}: {:?}",
                    cmds.errors().collect::<Vec<_>>()
                );
            });
        }
    });
    assert_eq!(dst.bytes(), src.bytes());
    assert_eq!(p.a.counts().0, 0, "every request was released");
    let _ = unique("x");
}

/// Every combination of "all entries" and an index list on each side builds the same
/// request as the equivalent explicit index lists: the same bytes land in the same
/// places, and adjacent pairs merge the same way. A length mismatch part-way through
/// names the descriptor.
#[test]
fn make_with_one_sided_index_lists_matches_explicit_ones() {
    let mut rng = Rng::new(23);
    let block = 64;
    let blocks = 64;
    let src = Buffer::random(block * blocks, &mut rng);
    let local_descs: Vec<Desc> = (0..blocks).map(|i| src.desc(i * block, block)).collect();
    let all: Vec<u32> = (0..blocks as u32).collect();
    // Runs of 1..8 blocks kept in order, the runs shuffled: some pairs stay adjacent.
    let mut runs: Vec<Vec<u32>> = Vec::new();
    let mut at = 0u32;
    while at < blocks as u32 {
        let len = (1 + rng.below(8) as u32).min(blocks as u32 - at);
        runs.push((at..at + len).collect());
        at += len;
    }
    rng.shuffle(&mut runs);
    let perm: Vec<u32> = runs.concat();
    let adjacent = |l: &[u32], r: &[u32]| {
        1 + (1..l.len())
            .filter(|&k| !(l[k] == l[k - 1] + 1 && r[k] == r[k - 1] + 1))
            .count()
    };
    for (local_idx, remote_idx) in [
        (&[][..], &perm[..]),
        (&perm[..], &[][..]),
        (&[][..], &[][..]),
        (&perm[..], &perm[..]),
    ] {
        let dst = Buffer::zeroed(block * blocks);
        let p2 = pair(&src, &dst);
        let remote_descs: Vec<Desc> = (0..blocks).map(|i| dst.desc(i * block, block)).collect();
        let local = p2.a.prep(Side::Local, MemKind::Dram, &local_descs).unwrap();
        let remote = p2.a.prep(p2.b_at_a, MemKind::Dram, &remote_descs).unwrap();
        let x =
            p2.a.make(Op::Write, local, local_idx, remote, remote_idx, None)
                .unwrap();
        assert_eq!(p2.a.post(x).unwrap(), XferStatus::Done);
        let l = if local_idx.is_empty() {
            &all[..]
        } else {
            local_idx
        };
        let r = if remote_idx.is_empty() {
            &all[..]
        } else {
            remote_idx
        };
        for (&l, &r) in l.iter().zip(r) {
            let (l, r) = (l as usize * block, r as usize * block);
            assert_eq!(&dst.bytes()[r..r + block], &src.bytes()[l..l + block]);
        }
        assert_eq!(p2.a.xfer_ranges(x).unwrap(), adjacent(l, r));
        p2.a.release(x).unwrap();
    }

    // A pair whose lengths differ, at position 5 of the request.
    let dst = Buffer::zeroed(block * blocks);
    let p2 = pair(&src, &dst);
    let mut remote_descs: Vec<Desc> = (0..blocks).map(|i| dst.desc(i * block, block)).collect();
    remote_descs[5] = dst.desc(5 * block, block / 2);
    let local = p2.a.prep(Side::Local, MemKind::Dram, &local_descs).unwrap();
    let remote = p2.a.prep(p2.b_at_a, MemKind::Dram, &remote_descs).unwrap();
    let e =
        p2.a.make(Op::Write, local, &[], remote, &[], None)
            .unwrap_err();
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    assert!(e.to_string().contains("differs"), "{e}");
}

/// `make` merges exactly like a model (a new range wherever either side does not
/// continue the previous pair, or the region changes), and copies the right bytes,
/// whether each list lies in one region (make's single-region loop) or in two (the
/// general loop), taken whole or through index lists.
#[test]
fn make_merges_like_the_model_in_one_region_or_two() {
    let block = 16;
    let blocks = 64;
    let mut rng = Rng::new(41);
    let src = Buffer::random(block * blocks, &mut rng);
    let mut dst = Buffer::zeroed(block * blocks);
    let extra_src = Buffer::random(block * 4, &mut rng);
    let extra_dst = Buffer::zeroed(block * 4);
    let a = loopback_agent("merge-model-a");
    let b = loopback_agent("merge-model-b");
    register(&a, &src);
    register(&a, &extra_src);
    register(&b, &dst);
    register(&b, &extra_dst);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    for round in 0..60 {
        // Pairs of (buffer, block): buffer 1 is the extra one (the second region).
        let two_regions = round % 2 == 1;
        let n = 1 + rng.below(blocks as u64 - 1) as usize;
        let mut free: Vec<usize> = (0..blocks).collect();
        rng.shuffle(&mut free);
        let mut used = vec![false; blocks];
        let mut pairs: Vec<((usize, usize), (usize, usize))> = Vec::new();
        for i in 0..n {
            let prev = pairs.last().copied();
            let l = match prev {
                Some(((0, l), _)) if l + 1 < blocks && rng.below(4) != 0 => l + 1,
                _ => rng.below(blocks as u64) as usize,
            };
            let r = match prev {
                Some((_, (0, r))) if r + 1 < blocks && !used[r + 1] && rng.below(2) == 0 => r + 1,
                _ => *free.iter().find(|&&f| !used[f]).unwrap(),
            };
            used[r] = true;
            pairs.push(((0, l), (0, r)));
            if two_regions && i == n / 2 {
                // One pair through the second region, on one side or both.
                let which = rng.below(3);
                let pair = pairs.last_mut().unwrap();
                if which != 1 {
                    pair.0 = (1, rng.below(4) as usize);
                }
                if which != 0 {
                    used[r] = false;
                    pair.1 = (1, i % 4);
                }
            }
        }
        let desc = |buffers: [&Buffer; 2], (buf, blk): (usize, usize)| {
            buffers[buf].desc(blk * block, block)
        };
        let local: Vec<Desc> = pairs
            .iter()
            .map(|p| desc([&src, &extra_src], p.0))
            .collect();
        let remote: Vec<Desc> = pairs
            .iter()
            .map(|p| desc([&dst, &extra_dst], p.1))
            .collect();
        let continues =
            |x: Desc, y: Desc, bx: usize, by: usize| bx == by && x.addr + x.len == y.addr;
        let want_ranges = 1
            + (1..n)
                .filter(|&i| {
                    !(continues(local[i - 1], local[i], pairs[i - 1].0 .0, pairs[i].0 .0)
                        && continues(remote[i - 1], remote[i], pairs[i - 1].1 .0, pairs[i].1 .0))
                })
                .count();

        // Whole lists, then index lists into every block of both buffers.
        let whole = (
            a.prep(Side::Local, MemKind::Dram, &local).unwrap(),
            a.prep(b_at_a, MemKind::Dram, &remote).unwrap(),
            Vec::new(),
            Vec::new(),
        );
        let all = |first: &Buffer, second: &Buffer| -> Vec<Desc> {
            (0..blocks)
                .map(|i| first.desc(i * block, block))
                .chain(
                    (0..4)
                        .map(|i| second.desc(i * block, block))
                        .filter(|_| two_regions),
                )
                .collect()
        };
        let index = |(buf, blk): (usize, usize)| (buf * blocks + blk) as u32;
        let indexed = (
            a.prep(Side::Local, MemKind::Dram, &all(&src, &extra_src))
                .unwrap(),
            a.prep(b_at_a, MemKind::Dram, &all(&dst, &extra_dst))
                .unwrap(),
            pairs.iter().map(|p| index(p.0)).collect::<Vec<u32>>(),
            pairs.iter().map(|p| index(p.1)).collect::<Vec<u32>>(),
        );
        for (form, (l, r, li, ri)) in [("whole", whole), ("indexed", indexed)] {
            dst.bytes_mut().fill(0);
            let x = a.make(Op::Write, l, &li, r, &ri, None).unwrap();
            assert_eq!(a.post(x).unwrap(), XferStatus::Done);
            let what = format!("round {round} ({form}, {n} pairs, two regions: {two_regions})");
            assert_eq!(a.xfer_ranges(x).unwrap(), want_ranges, "{what}");
            let t = a.telemetry(x).unwrap();
            assert_eq!(t.total_bytes, (n * block) as u64, "{what}");
            assert_eq!(t.desc_count_unmerged, n as u64, "{what}");
            for (i, p) in pairs.iter().enumerate() {
                let (from, to) = ([&src, &extra_src][p.0 .0], [&dst, &extra_dst][p.1 .0]);
                let at = |buf: &Buffer, d: Desc| (d.addr - buf.whole().addr) as usize;
                let got = &to.bytes()[at(to, remote[i])..][..block];
                let want = &from.bytes()[at(from, local[i])..][..block];
                assert_eq!(got, want, "{what}: pair {i}");
            }
            a.release(x).unwrap();
            a.release_prep(l).unwrap();
            a.release_prep(r).unwrap();
        }
    }
}

/// A remote descriptor whose length differs from its local one fails `make` with a
/// mismatch naming that descriptor, in one region and in two.
#[test]
fn make_names_the_pair_whose_lengths_differ() {
    let block = 64;
    let src = Buffer::random(block * 16, &mut Rng::new(43));
    let dst = Buffer::zeroed(block * 16);
    let extra = Buffer::zeroed(block);
    let a = loopback_agent("mismatch-a");
    let b = loopback_agent("mismatch-b");
    register(&a, &src);
    register(&b, &dst);
    register(&b, &extra);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    for two_regions in [false, true] {
        let local: Vec<Desc> = (0..8).map(|i| src.desc(i * block, block)).collect();
        let mut remote: Vec<Desc> = (0..8).map(|i| dst.desc(i * block, block)).collect();
        remote[5] = dst.desc(5 * block, block / 2);
        if two_regions {
            remote[2] = extra.whole();
        }
        let l = a.prep(Side::Local, MemKind::Dram, &local).unwrap();
        let r = a.prep(b_at_a, MemKind::Dram, &remote).unwrap();
        let e = a.make(Op::Write, l, &[], r, &[], None).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Mismatch {
                    subject: Subject::Descriptor { index: 5, .. },
                    ..
                }
            ),
            "two regions: {two_regions}: {e}"
        );
        a.release_prep(l).unwrap();
        a.release_prep(r).unwrap();
    }
}

/// Prep names the first bad descriptor wherever it sits: inside a run its region covers,
/// right after a switch to another region, or past the region's end.
#[test]
fn prep_names_the_first_bad_descriptor_of_a_run() {
    let block = 64;
    let src = Buffer::random(block * 8, &mut Rng::new(47));
    let extra = Buffer::random(block * 2, &mut Rng::new(48));
    let a = loopback_agent("prep-runs");
    register(&a, &src);
    register(&a, &extra);
    let good = [
        src.desc(0, block),
        src.desc(block, block),
        extra.desc(0, block),
        src.desc(2 * block, block),
    ];
    let id = a.prep(Side::Local, MemKind::Dram, &good).unwrap();
    a.release_prep(id).unwrap();
    let in_src =
        |offset: usize, len: usize| Desc::new(src.whole().addr + offset as u64, len as u64, 0);
    let empty = in_src(3 * block, 0);
    let past_end = in_src(7 * block, 2 * block);
    let wrapping = Desc::new(u64::MAX - 8, 16, 0);
    for (bad, invalid) in [(empty, true), (past_end, false), (wrapping, true)] {
        for at in [1, 3, 4] {
            let mut list = good.to_vec();
            list.insert(at, bad);
            let e = a.prep(Side::Local, MemKind::Dram, &list).unwrap_err();
            let named =
                |s: &Subject| matches!(s, Subject::Descriptor { index, .. } if *index == at as u32);
            match &e {
                Error::InvalidParam { subject, .. } if invalid => assert!(named(subject), "{e}"),
                Error::NotFound { subject } if !invalid => assert!(named(subject), "{e}"),
                _ => panic!("{bad:?} at {at}: unexpected {e}"),
            }
        }
    }
}
