//! Issue 21, item 2: a handle belongs to the agent that made it. Every handle of one
//! agent (request, prepared list, region, peer, backend) used on another agent is
//! refused with `NotFound` naming it, even where the other agent has a live object in
//! the same slot; the other agent's own objects are untouched.

use ferry::{Error, MemKind, Op, Side, Subject, XferStatus};
use ferry_tests::{pair, Buffer, Rng};

const KIB: usize = 1024;

#[test]
fn every_kind_of_handle_of_one_agent_is_refused_by_another() {
    // Two pairs made the same way, so their handles have the same slots and generations.
    let (a_src, a_dst) = (Buffer::random(KIB, &mut Rng::new(1)), Buffer::zeroed(KIB));
    let (c_src, c_dst) = (Buffer::random(KIB, &mut Rng::new(2)), Buffer::zeroed(KIB));
    let one = pair(&a_src, &a_dst);
    let two = pair(&c_src, &c_dst);
    let (a, c) = (&one.a, &two.a);
    let make = |p: &ferry_tests::Pair, src: &Buffer, dst: &Buffer| {
        let local =
            p.a.prep(Side::Local, MemKind::Dram, &[src.whole()])
                .unwrap();
        let remote = p.a.prep(p.b_at_a, MemKind::Dram, &[dst.whole()]).unwrap();
        let x = p.a.make(Op::Write, local, &[], remote, &[], None).unwrap();
        (local, remote, x)
    };
    let (a_local, _, a_x) = make(&one, &a_src, &a_dst);
    let (_, _, c_x) = make(&two, &c_src, &c_dst);
    // The same slot, but not the same handle.
    assert_ne!(a_x, c_x);

    let foreign_xfer =
        |e: Error| matches!(e, Error::NotFound { subject: Subject::Xfer(x) } if x == a_x);
    assert!(foreign_xfer(c.post(a_x).unwrap_err()));
    assert!(foreign_xfer(c.check(a_x).unwrap_err()));
    assert!(foreign_xfer(c.telemetry(a_x).unwrap_err()));
    assert!(foreign_xfer(c.xfer_backend(a_x).unwrap_err()));
    assert!(foreign_xfer(c.release(a_x).unwrap_err()));
    // C's own request in that slot never ran and is still there.
    assert!(c_dst.bytes().iter().all(|&b| b == 0));
    assert_eq!(c.post(c_x).unwrap(), XferStatus::Done);
    assert_eq!(c_dst.bytes(), c_src.bytes());

    let e = c.release_prep(a_local).unwrap_err();
    assert!(
        matches!(e, Error::NotFound { subject: Subject::Prep(p) } if p == a_local),
        "{e}"
    );
    let e = c
        .make(Op::Write, a_local, &[], a_local, &[], None)
        .unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");

    let a_region = a.counts();
    let e = c.make_connection(one.b_at_a).unwrap_err();
    assert!(
        matches!(e, Error::NotFound { subject: Subject::Peer(p) } if p == one.b_at_a),
        "{e}"
    );
    let a_backend = a.backends()[0].id;
    assert_ne!(a_backend, c.backends()[0].id);
    let e = c.alloc(a_backend, MemKind::Dram, 64).unwrap_err();
    assert!(
        matches!(e, Error::NotFound { subject: Subject::Backend(b) } if b == a_backend),
        "{e}"
    );
    assert_eq!(a.counts(), a_region);

    // A's own handles still work on A.
    assert_eq!(a.post(a_x).unwrap(), XferStatus::Done);
    assert_eq!(a_dst.bytes(), a_src.bytes());
    a.release(a_x).unwrap();
    c.release(c_x).unwrap();
}

#[test]
fn a_region_handle_of_one_agent_cannot_deregister_another_agents_region() {
    let (a_buf, c_buf) = (Buffer::zeroed(KIB), Buffer::zeroed(KIB));
    let a = ferry_tests::loopback_agent("hreg-a");
    let c = ferry_tests::loopback_agent("hreg-c");
    let a_region = ferry_tests::register(&a, &a_buf);
    let c_region = ferry_tests::register(&c, &c_buf);
    assert_ne!(a_region, c_region);
    let e = c.deregister(a_region).unwrap_err();
    assert!(
        matches!(e, Error::NotFound { subject: Subject::Region(r) } if r == a_region),
        "{e}"
    );
    assert_eq!(c.counts().2, 1, "C's region is still registered");
    c.deregister(c_region).unwrap();
    a.deregister(a_region).unwrap();
}
