//! The regions' public metadata lives in one arena per agent, compacted once
//! deregistrations leave more holes than live bytes. Through two loopback agents: after
//! many deregistrations (enough to compact) and new registrations in the gaps, the
//! published metadata names exactly the live regions, with their own public metadata
//! (the loopback target finds a region by it), so a WRITE into every live region lands
//! byte for byte and a descriptor in a deregistered one is refused.

use ferry::{Error, MemKind, Op, XferStatus};
use ferry_tests::{loopback_agent, try_register, Buffer, Rng};

const REGION: usize = 64;
const REGIONS: usize = 12_000;

#[test]
fn metadata_after_compaction_names_exactly_the_live_regions() {
    let mut rng = Rng::new(25);
    let src = Buffer::random(REGIONS * REGION, &mut rng);
    let dst = Buffer::zeroed(REGIONS * REGION);
    let a = loopback_agent("arena-a");
    let b = loopback_agent("arena-b");
    ferry_tests::register(&a, &src);
    let mut ids: Vec<_> = (0..REGIONS)
        .map(|i| try_register(&b, MemKind::Dram, dst.desc(i * REGION, REGION)).unwrap())
        .collect();
    // Deregister three of every four (13 arena bytes each: past the compaction
    // threshold and more than the live bytes), then register half of the gaps again.
    for (i, id) in ids.iter().enumerate() {
        if !i.is_multiple_of(4) {
            assert_eq!(b.deregister(*id).unwrap(), ferry::DeregStatus::Done);
        }
    }
    let live = |i: usize| i.is_multiple_of(2);
    for (i, id) in ids.iter_mut().enumerate() {
        if i % 4 == 2 {
            *id = try_register(&b, MemKind::Dram, dst.desc(i * REGION, REGION)).unwrap();
        }
    }
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let (local, remote): (Vec<_>, Vec<_>) = (0..REGIONS)
        .filter(|&i| live(i))
        .map(|i| (src.desc(i * REGION, REGION), dst.desc(i * REGION, REGION)))
        .unzip();
    let x = a
        .create(
            Op::Write,
            MemKind::Dram,
            &local,
            b_at_a,
            MemKind::Dram,
            &remote,
            None,
        )
        .unwrap();
    let mut status = a.post(x).unwrap();
    while status != XferStatus::Done {
        b.progress();
        status = a.check(x).unwrap();
    }
    a.release(x).unwrap();
    for i in 0..REGIONS {
        let range = i * REGION..(i + 1) * REGION;
        if live(i) {
            assert_eq!(
                &dst.bytes()[range.clone()],
                &src.bytes()[range],
                "region {i}"
            );
        } else {
            assert!(dst.bytes()[range].iter().all(|&b| b == 0), "region {i}");
        }
    }
    // A descriptor in a deregistered region is not in the published metadata.
    let gone = dst.desc(REGION, REGION);
    match a.prep(b_at_a, MemKind::Dram, &[gone]) {
        Err(Error::NotFound { .. }) => {}
        other => panic!("prep into a deregistered region: {other:?}"),
    }
}

/// A peer may name up to 256 backends in its metadata, more than an agent holds
/// (`MAX_BACKENDS`), and the one an agent shares with it may come after the first
/// eight. Here the peer's blob names nine other backends before LOOPBACK, and a WRITE
/// into its region lands byte for byte, both through a one-shot create and through
/// prepared lists.
#[test]
fn regions_of_a_peer_backend_named_after_the_first_eight_are_found() {
    use ferry::metadata::{MdWriter, PeerMd};
    use ferry::Side;
    let mut rng = Rng::new(26);
    let src = Buffer::random(4 * REGION, &mut rng);
    let dst = Buffer::zeroed(4 * REGION);
    let a = loopback_agent("many-backends-a");
    let b = loopback_agent("many-backends-b");
    ferry_tests::register(&a, &src);
    ferry_tests::register(&b, &dst);
    let genuine = PeerMd::from_bytes(&b.local_md().unwrap()).unwrap();
    let mut w = MdWriter::new(genuine.agent(), genuine.generation());
    for i in 0..9 {
        w.backend(&format!("ABSENT{i}"), None);
    }
    let mut loopback = None;
    for i in 0..genuine.backend_count() as u8 {
        let (name, conn) = genuine.backend(i).unwrap();
        loopback = Some(w.backend(name, conn));
    }
    for region in genuine.regions() {
        w.region(
            loopback.unwrap(),
            region.kind,
            region.desc,
            region.public_md,
        );
    }
    let blob = w.finish().unwrap();
    let b_at_a = a.load_remote_md(&blob).unwrap();
    let x = a
        .create(
            Op::Write,
            MemKind::Dram,
            &[src.desc(0, 2 * REGION)],
            b_at_a,
            MemKind::Dram,
            &[dst.desc(0, 2 * REGION)],
            None,
        )
        .unwrap();
    assert_eq!(a.post(x).unwrap(), XferStatus::Done);
    a.release(x).unwrap();
    let local = a
        .prep(
            Side::Local,
            MemKind::Dram,
            &[src.desc(2 * REGION, 2 * REGION)],
        )
        .unwrap();
    let remote = a
        .prep(b_at_a, MemKind::Dram, &[dst.desc(2 * REGION, 2 * REGION)])
        .unwrap();
    let x = a.make(Op::Write, local, &[], remote, &[], None).unwrap();
    assert_eq!(a.post(x).unwrap(), XferStatus::Done);
    a.release(x).unwrap();
    assert_eq!(dst.bytes(), src.bytes());
}
