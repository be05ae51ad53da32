//! A warmed-up flush allocates nothing: proven with a counting global allocator.
//! (Its own test binary, because the allocator is global to the binary.)

use ferry::{CommandBuffer, Desc, MemKind, Op, Side, XferStatus};
use ferry_tests::counting::{counted, CountingAlloc};
use ferry_tests::{pair, Buffer, Rng};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

// Only one test in this binary: the counter is process-wide.
#[test]
fn steady_state_flushes_do_not_allocate() {
    let block = 64;
    let n = 1024;
    let mut rng = Rng::new(41);
    let src = Buffer::random(n * block, &mut rng);
    let dst = Buffer::zeroed(n * block);
    let p = pair(&src, &dst);
    let local_descs: Vec<Desc> = (0..n).map(|i| src.desc(i * block, block)).collect();
    let mut order: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut order);
    let remote_descs: Vec<Desc> = order.iter().map(|&j| dst.desc(j * block, block)).collect();
    let local = p.a.prep(Side::Local, MemKind::Dram, &local_descs).unwrap();
    let remote = p.a.prep(p.b_at_a, MemKind::Dram, &remote_descs).unwrap();
    let half: Vec<u32> = (0..n as u32 / 2).collect();

    let mut cmds = CommandBuffer::with_capacity(64);
    let mut peer_cmds = CommandBuffer::with_capacity(8);
    // Prepared path: make + post + check + release, with a notification, and the
    // full path: prep + make + post + check + release every turn.
    let turn = |cmds: &mut CommandBuffer, peer_cmds: &mut CommandBuffer| {
        cmds.clear();
        let x = cmds.make(Op::Write, local, &half, remote, &half).notify(b"turn").ticket();
        let posted = cmds.post(x);
        let checked = cmds.check(x);
        cmds.release(x);
        let l = cmds.prep(Side::Local, MemKind::Dram, &local_descs[..256]);
        let r = cmds.prep(p.b_at_a, MemKind::Dram, &remote_descs[..256]);
        let y = cmds.make(Op::Read, l, &[], r, &[]).ticket();
        cmds.post(y);
        let checked_y = cmds.check(y);
        cmds.release(y);
        cmds.release_prep(l);
        cmds.release_prep(r);
        cmds.notify(p.b_at_a, b"standalone");
        p.a.flush(cmds);
        assert_eq!(cmds.status(posted), Ok(XferStatus::Done));
        assert_eq!(cmds.status(checked), Ok(XferStatus::Done));
        assert_eq!(cmds.status(checked_y), Ok(XferStatus::Done));
        assert!(cmds.errors().next().is_none());
        peer_cmds.clear();
        let drained = peer_cmds.drain_notifications();
        p.b.flush(peer_cmds);
        assert_eq!(peer_cmds.outcome(drained), &ferry::Outcome::Drained(2));
    };
    for _ in 0..8 {
        turn(&mut cmds, &mut peer_cmds);
    }
    let ((), allocations) = counted(|| {
        for _ in 0..64 {
            turn(&mut cmds, &mut peer_cmds);
        }
    });
    assert_eq!(allocations, 0, "a warmed-up flush must not allocate");
    // The counter works: an allocation inside the window is seen.
    let (v, allocations) = counted(|| vec![1u8; 3]);
    assert_eq!(allocations, 1);
    drop(v);
}
