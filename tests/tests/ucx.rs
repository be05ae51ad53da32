//! End-to-end through `ferry::Agent` on the UCX backend: two agents in one process,
//! metadata exchanged as blobs. READ/WRITE of random shuffled pieces verified byte for
//! byte, a 1024-descriptor shuffled batch, notifications (attached, standalone, to self,
//! empty), invalidation and reload. Each runs with the default transports and
//! `transports=tcp`. Without UCX the tests skip (and fail under `CI=true`).

use std::sync::Once;
use std::time::{Duration, Instant};

use ferry::{Agent, AgentConfig, Desc, Error, MemKind, Op, Params, XferId, XferStatus};
use ferry_tests::{register, unique, Buffer, Pair, Rng};

const TIMEOUT: Duration = Duration::from_secs(30);

fn ucx_ready() -> bool {
    static ENV: Once = Once::new();
    ENV.call_once(|| {
        std::env::set_var("UCX_NET_DEVICES", "lo");
        std::env::set_var("UCX_WARN_UNUSED_ENV_VARS", "n");
    });
    let info = Agent::available_backends();
    let ucx = info
        .iter()
        .find(|f| f.name == "UCX")
        .expect("UCX is compiled in");
    match &ucx.available {
        Ok(()) => true,
        Err(reason) => {
            ferry_testkit::ci::skip(
                "UCX",
                format!("unavailable ({reason}); apt-get install libucx0"),
            );
            false
        }
    }
}

fn ucx_agent(prefix: &str, transports: &str) -> Agent {
    let agent = Agent::new(AgentConfig::named(unique(prefix))).unwrap();
    let mut params = Params::new();
    if !transports.is_empty() {
        params.insert("transports".into(), transports.into());
    }
    agent
        .create_backend("UCX", &params)
        .expect("create UCX backend");
    agent
}

fn pair(transports: &str, a_buf: &Buffer, b_buf: &Buffer) -> Pair {
    let a = ucx_agent("ucx-a", transports);
    let b = ucx_agent("ucx-b", transports);
    register(&a, a_buf);
    register(&b, b_buf);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let a_at_b = b.load_remote_md(&a.local_md().unwrap()).unwrap();
    Pair {
        a,
        b,
        b_at_a,
        a_at_b,
    }
}

/// Create a DRAM request from `a` to `b` (`Pair::create`), post it and drive it to done.
fn transfer(p: &Pair, op: Op, local: &[Desc], remote: &[Desc], notif: Option<&[u8]>) -> XferId {
    let x = p.create(op, local, remote, notif);
    let first = p.a.post(x).unwrap();
    finish(p, x, first);
    x
}

/// Drive both agents until `x` is done.
fn finish(p: &Pair, x: XferId, first: XferStatus) {
    let deadline = Instant::now() + TIMEOUT;
    let mut status = first;
    while status != XferStatus::Done {
        assert_eq!(status, XferStatus::InProgress);
        assert!(
            Instant::now() < deadline,
            "request not done within {TIMEOUT:?}"
        );
        p.b.progress();
        status = p.a.check(x).expect("check");
    }
}

fn wait_notifs(p: &Pair, count: usize) -> Vec<(String, Vec<u8>)> {
    let deadline = Instant::now() + TIMEOUT;
    let mut got = Vec::new();
    while got.len() < count {
        assert!(Instant::now() < deadline, "notifications missing");
        p.a.progress();
        p.b.progress();
        got.extend(p.b.drain_notifications());
    }
    got
}

#[test]
fn write_and_read_shuffled_pieces_with_notification() {
    if !ucx_ready() {
        return;
    }
    for transports in ["", "tcp"] {
        let mut rng = Rng::new(31);
        let total = 3 << 20;
        let src = Buffer::random(total, &mut rng);
        let dst = Buffer::zeroed(total);
        let back = Buffer::zeroed(total);
        let p = pair(transports, &src, &dst);
        register(&p.a, &back);
        // Random piece sizes; remote places shuffled.
        let mut lens = Vec::new();
        let mut at = 0;
        while at < total {
            let n = (1 + rng.below(200_000) as usize).min(total - at);
            lens.push((at, n));
            at += n;
        }
        let mut order: Vec<usize> = (0..lens.len()).collect();
        rng.shuffle(&mut order);
        let mut remote_at = vec![0usize; lens.len()];
        let mut r = 0;
        for &i in &order {
            remote_at[i] = r;
            r += lens[i].1;
        }
        let local: Vec<Desc> = lens.iter().map(|&(l, n)| src.desc(l, n)).collect();
        let remote: Vec<Desc> = lens
            .iter()
            .zip(&remote_at)
            .map(|(&(_, n), &r)| dst.desc(r, n))
            .collect();

        let x = transfer(&p, Op::Write, &local, &remote, Some(b"written"));
        let notifs = wait_notifs(&p, 1);
        assert_eq!(notifs[0].0, p.a.name());
        assert_eq!(notifs[0].1, b"written");
        for (&(l, n), &r) in lens.iter().zip(&remote_at) {
            assert_eq!(
                &dst.bytes()[r..r + n],
                &src.bytes()[l..l + n],
                "[{transports}] piece at {l}"
            );
        }

        let local_back: Vec<Desc> = lens.iter().map(|&(l, n)| back.desc(l, n)).collect();
        let y = transfer(&p, Op::Read, &local_back, &remote, None);
        assert_eq!(
            back.bytes(),
            src.bytes(),
            "[{transports}] read-back differs"
        );
        // Reposting a finished request is allowed.
        let again = p.a.post(y).unwrap();
        finish(&p, y, again);
        p.a.release(x).unwrap();
        p.a.release(y).unwrap();
    }
}

#[test]
fn shuffled_batch_of_1024_descriptors() {
    if !ucx_ready() {
        return;
    }
    for transports in ["", "tcp"] {
        let mut rng = Rng::new(5);
        const BLOCK: usize = 4096;
        let src = Buffer::random(BLOCK * 1024, &mut rng);
        let dst = Buffer::zeroed(BLOCK * 1024);
        let p = pair(transports, &src, &dst);
        let (local, remote, order) =
            ferry_tests::shuffled_blocks(&src, &dst, 1024, BLOCK, &mut rng);
        transfer(&p, Op::Write, &local, &remote, None);
        ferry_tests::assert_shuffled_copy(&src, &dst, &order, BLOCK, &format!("[{transports}]"));
    }
}

#[test]
fn standalone_self_and_empty_notifications() {
    if !ucx_ready() {
        return;
    }
    let a_buf = Buffer::zeroed(4096);
    let b_buf = Buffer::zeroed(4096);
    let p = pair("", &a_buf, &b_buf);
    p.a.notify(p.b_at_a, b"standalone").unwrap();
    p.a.notify(p.b_at_a, b"").unwrap();
    let got = wait_notifs(&p, 2);
    assert_eq!(got[0], (p.a.name().to_string(), b"standalone".to_vec()));
    assert_eq!(got[1], (p.a.name().to_string(), Vec::new()));
    p.a.notify(ferry::Side::Local, b"me").unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let mut own = Vec::new();
    while own.is_empty() {
        assert!(Instant::now() < deadline);
        p.a.progress();
        own = p.a.drain_notifications();
    }
    assert_eq!(own, vec![(p.a.name().to_string(), b"me".to_vec())]);
}

#[test]
fn invalidated_peer_is_refused_then_reload_works() {
    if !ucx_ready() {
        return;
    }
    let mut rng = Rng::new(9);
    let src = Buffer::random(1 << 16, &mut rng);
    let dst = Buffer::zeroed(1 << 16);
    let p = pair("", &src, &dst);
    let x = transfer(&p, Op::Write, &[src.whole()], &[dst.whole()], None);
    p.a.invalidate_remote_md(p.b_at_a).unwrap();
    let refused = p.a.post(x);
    assert!(
        matches!(refused, Err(Error::NotFound { .. })),
        "{refused:?}"
    );
    let peer = p.a.load_remote_md(&p.b.local_md().unwrap()).unwrap();
    let y =
        p.a.create(
            Op::Read,
            MemKind::Dram,
            &[src.whole()],
            peer,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    let first = p.a.post(y).unwrap();
    let p2 = Pair { b_at_a: peer, ..p };
    finish(&p2, y, first);
    assert_eq!(dst.bytes(), src.bytes());
}

#[test]
fn invalidate_mid_flight_ends_the_request_with_a_typed_outcome_then_regions_go() {
    if !ucx_ready() {
        return;
    }
    let mut rng = Rng::new(10);
    let src = Buffer::random(32 << 20, &mut rng);
    let dst = Buffer::zeroed(32 << 20);
    let a = ucx_agent("ucx-inv-a", "tcp");
    let b = ucx_agent("ucx-inv-b", "tcp");
    let src_region = register(&a, &src);
    register(&b, &dst);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let x = a
        .create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            b_at_a,
            MemKind::Dram,
            &[dst.whole()],
            Some(b"never mind"),
        )
        .unwrap();
    // 32 MiB over tcp cannot finish without the target progressing: still in flight.
    assert_eq!(a.post(x).unwrap(), XferStatus::InProgress);
    a.invalidate_remote_md(b_at_a).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let outcome = loop {
        match a.check(x) {
            Ok(XferStatus::InProgress) => {
                assert!(Instant::now() < deadline, "request never ended");
                b.progress();
            }
            other => break other,
        }
    };
    match outcome {
        Ok(XferStatus::Done) => {}
        Err(Error::NotFound { .. } | Error::RemoteDisconnect { .. } | Error::Canceled { .. }) => {}
        other => panic!("unexpected outcome after invalidation: {other:?}"),
    }
    // Once the request has ended, its region can be released and deregistered.
    a.release(x).unwrap();
    a.deregister(src_region).unwrap();
}

/// Memory allocated through the UCX backend (`Agent::alloc`) on both agents: a WRITE
/// into the peer's allocation and a READ of it into ours, checked byte for byte by a
/// third agent that reaches our allocation only through LOOPBACK (it is registered with
/// every backend as ordinary DRAM); typed errors; freed at deregistration (its
/// shared-memory segment no longer mapped).
#[test]
fn memory_allocated_through_ucx_moves_byte_for_byte_and_other_backends_see_dram() {
    if !ucx_ready() {
        return;
    }
    let none: Params = [("error_handling".to_string(), "none".to_string())].into();
    let a = Agent::new(AgentConfig::named(unique("ucx-alloc-a"))).unwrap();
    let ucx_a = a.create_backend("UCX", &none).unwrap();
    let loopback_a = a.create_backend("LOOPBACK", &Params::new()).unwrap();
    let b = Agent::new(AgentConfig::named(unique("ucx-alloc-b"))).unwrap();
    let ucx_b = b.create_backend("UCX", &none).unwrap();
    let c = Agent::new(AgentConfig::named(unique("ucx-alloc-c"))).unwrap();
    c.create_backend("LOOPBACK", &Params::new()).unwrap();

    // Typed errors before anything is allocated.
    let regions_before = a.counts().2;
    assert!(matches!(
        a.alloc(loopback_a, MemKind::Dram, 4096),
        Err(Error::NotSupported { .. })
    ));
    assert!(matches!(
        a.alloc(ucx_a, MemKind::Vram, 4096),
        Err(Error::NotSupported { .. })
    ));
    for len in [0, u64::MAX] {
        assert!(
            matches!(
                a.alloc(ucx_a, MemKind::Dram, len),
                Err(Error::InvalidParam { .. })
            ),
            "alloc of {len} bytes"
        );
    }
    assert_eq!(a.counts().2, regions_before, "a failed alloc left a region");

    let len = 3 << 20;
    let (region_a, mem_a) = a.alloc(ucx_a, MemKind::Dram, len).unwrap();
    let (region_b, mem_b) = b.alloc(ucx_b, MemKind::Dram, len).unwrap();
    assert_eq!((mem_a.len, mem_b.len), (len, len));
    let mut rng = Rng::new(77);
    let src = Buffer::random(len as usize, &mut rng);
    register(&a, &src);
    let check = Buffer::zeroed(len as usize);
    register(&c, &check);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let a_at_b = b.load_remote_md(&a.local_md().unwrap()).unwrap();
    let a_at_c = c.load_remote_md(&a.local_md().unwrap()).unwrap();
    let p = Pair {
        a,
        b,
        b_at_a,
        a_at_b,
    };

    // Shuffled 64 KiB pieces: src → b's allocation, then b's allocation → a's.
    let piece = 64 << 10;
    let pieces = (len / piece) as usize;
    let mut order: Vec<usize> = (0..pieces).collect();
    rng.shuffle(&mut order);
    let at = |d: Desc, i: usize| Desc::new(d.addr + (i as u64) * piece, piece, 0);
    let local: Vec<Desc> = (0..pieces)
        .map(|i| src.desc(i * piece as usize, piece as usize))
        .collect();
    let remote: Vec<Desc> = order.iter().map(|&j| at(mem_b, j)).collect();
    let x = transfer(&p, Op::Write, &local, &remote, None);
    let back: Vec<Desc> = (0..pieces).map(|i| at(mem_a, i)).collect();
    let y = transfer(&p, Op::Read, &back, &remote, None);

    // c reads a's allocation over LOOPBACK: the only backend they share.
    let z = c
        .create(
            Op::Read,
            MemKind::Dram,
            &[check.whole()],
            a_at_c,
            MemKind::Dram,
            &[mem_a],
            None,
        )
        .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let mut status = c.post(z).unwrap();
    while status != XferStatus::Done {
        assert!(Instant::now() < deadline, "LOOPBACK read not done");
        p.a.progress();
        status = c.check(z).unwrap();
    }
    assert_eq!(
        check.bytes(),
        src.bytes(),
        "a's allocation differs from src"
    );

    // In use (a live request names it): refused, and still there.
    match p.a.deregister(region_a) {
        Err(Error::NotAllowed { reason, .. }) => assert!(reason.contains("in use"), "{reason}"),
        other => panic!("deregister in use: {other:?}"),
    }
    p.a.release(x).unwrap();
    p.a.release(y).unwrap();
    let segment = shared_mapping_at(mem_a.addr);
    p.a.deregister(region_a).unwrap();
    if let Some((inode, path)) = segment {
        assert!(
            !shared_mapping_exists(&inode, &path),
            "{path} (inode {inode}) still mapped after deregistration"
        );
    }
    assert!(matches!(
        p.a.deregister(region_a),
        Err(Error::NotFound { .. })
    ));
    p.b.deregister(region_b).unwrap();
    c.release(z).unwrap();
}

/// `/proc/self/maps`: the file mapping (inode, path) that starts at `addr`, if any.
fn shared_mapping_at(addr: u64) -> Option<(String, String)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let start = u64::from_str_radix(fields.first()?.split('-').next()?, 16).ok()?;
        (start == addr && fields.len() >= 6 && fields[4] != "0")
            .then(|| (fields[4].to_string(), fields[5..].join(" ")))
    })
}

/// Whether any mapping of this process is of file `inode` at `path`.
fn shared_mapping_exists(inode: &str, path: &str) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() >= 6 && fields[4] == inode && fields[5..].join(" ") == path
        })
}

/// Issue 21, item 3 on UCX: a request to this agent itself whose attached notification
/// finds the inbox full is refused at post (`Capacity`), before its data moves; once
/// drained, the same kind of request goes through and notifies.
#[test]
fn a_full_inbox_refuses_a_self_write_with_notification_before_its_data_moves() {
    if !ucx_ready() {
        return;
    }
    let a = Agent::new(AgentConfig::named(unique("ucx-nfull"))).unwrap();
    let mut params = Params::new();
    params.insert("notif_queue".into(), "2".into());
    a.create_backend("UCX", &params).expect("UCX backend");
    let mut src = Buffer::zeroed(4096);
    let dst = Buffer::zeroed(4096);
    register(&a, &src);
    register(&a, &dst);
    let write = |byte: u8, src: &mut Buffer| {
        src.bytes_mut().fill(byte);
        let x = a
            .create(
                Op::Write,
                MemKind::Dram,
                &[src.whole()],
                ferry::Side::Local,
                MemKind::Dram,
                &[dst.whole()],
                Some(b"n"),
            )
            .unwrap();
        let deadline = Instant::now() + TIMEOUT;
        let mut r = a.post(x);
        while r == Ok(XferStatus::InProgress) {
            assert!(Instant::now() < deadline, "self write not done");
            r = a.check(x);
        }
        a.release(x).unwrap();
        r
    };
    // The two the inbox holds.
    assert_eq!(write(1, &mut src), Ok(XferStatus::Done));
    assert_eq!(write(2, &mut src), Ok(XferStatus::Done));
    // The third is refused before anything moves.
    let e = write(3, &mut src).unwrap_err();
    assert!(matches!(e, Error::Capacity { .. }), "{e}");
    assert!(
        dst.bytes().iter().all(|&b| b == 2),
        "refused, but its data moved"
    );
    assert_eq!(a.drain_notifications().len(), 2);
    assert_eq!(write(4, &mut src), Ok(XferStatus::Done));
    assert!(dst.bytes().iter().all(|&b| b == 4));
    assert_eq!(
        a.drain_notifications(),
        vec![(a.name().to_string(), b"n".to_vec())]
    );
}

/// Issue 21, item 4 on UCX: after the target's deregistration, a peer holding its stale
/// metadata cannot change a byte of that memory. Over tcp (`am_tcp`, on by default where
/// puts go over tcp, as everywhere with UCX 1.13) every range travels in Ferry's
/// messages and the target's handler checks it against its registrations: the WRITE
/// fails (`EFAULT`) and the memory keeps what the target left there.
#[test]
fn a_peer_with_stale_metadata_cannot_write_into_memory_the_target_deregistered() {
    if !ucx_ready() {
        return;
    }
    let src = Buffer::random(1 << 20, &mut Rng::new(21));
    let dst = Buffer::zeroed(1 << 20);
    let a = ucx_agent("ucx-dereg-a", "");
    let b = ucx_agent("ucx-dereg-b", "");
    register(&a, &src);
    let region = register(&b, &dst);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let p = Pair {
        a,
        b,
        b_at_a,
        a_at_b: Default::default(),
    };
    // Small and large ranges: one of 4 KiB, one of the rest.
    let local = [src.desc(0, 4096), src.desc(4096, (1 << 20) - 4096)];
    let remote = [dst.desc(0, 4096), dst.desc(4096, (1 << 20) - 4096)];
    let x = transfer(&p, Op::Write, &local, &remote, None);
    p.a.release(x).unwrap();
    assert_eq!(dst.bytes(), src.bytes());
    p.b.deregister(region).unwrap();
    let left = dst.bytes().to_vec();
    // A has not heard of it: its metadata still names the region.
    let x = p.create(Op::Write, &local, &remote, None);
    let deadline = Instant::now() + TIMEOUT;
    let mut status = p.a.post(x);
    while status == Ok(XferStatus::InProgress) {
        assert!(Instant::now() < deadline, "not ended within {TIMEOUT:?}");
        p.b.progress();
        status = p.a.check(x);
    }
    match status {
        Err(Error::Backend { errno, .. }) => assert_eq!(errno, 14, "EFAULT"),
        other => panic!("a write into deregistered memory: {other:?}"),
    }
    p.a.release(x).unwrap();
    assert_eq!(
        dst.bytes(),
        &left[..],
        "a byte changed after the deregistration"
    );
}
