//! End-to-end through `ferry::Agent` on the UCX backend: two agents in one process,
//! metadata exchanged as blobs. READ/WRITE of random shuffled pieces verified byte for
//! byte, a 1024-descriptor shuffled batch, notifications (attached, standalone, to self,
//! empty), invalidation and reload. Each runs with the default transports and
//! `transports=tcp`. Without UCX the tests skip (and fail under `CI=true`).

use std::sync::Once;
use std::time::{Duration, Instant};

use ferry::{Agent, AgentConfig, Desc, Error, MemKind, Op, Params, PeerId, XferId, XferStatus};
use ferry_tests::{register, unique, Buffer, Rng};

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

struct Pair {
    a: Agent,
    b: Agent,
    b_at_a: PeerId,
}

fn pair(transports: &str, a_buf: &Buffer, b_buf: &Buffer) -> Pair {
    let a = ucx_agent("ucx-a", transports);
    let b = ucx_agent("ucx-b", transports);
    register(&a, a_buf);
    register(&b, b_buf);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    b.load_remote_md(&a.local_md().unwrap()).unwrap();
    Pair { a, b, b_at_a }
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

        let x =
            p.a.create(
                Op::Write,
                MemKind::Dram,
                &local,
                p.b_at_a,
                MemKind::Dram,
                &remote,
                Some(b"written"),
            )
            .unwrap();
        let first = p.a.post(x).unwrap();
        finish(&p, x, first);
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
        let y =
            p.a.create(
                Op::Read,
                MemKind::Dram,
                &local_back,
                p.b_at_a,
                MemKind::Dram,
                &remote,
                None,
            )
            .unwrap();
        let first = p.a.post(y).unwrap();
        finish(&p, y, first);
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
        let x =
            p.a.create(
                Op::Write,
                MemKind::Dram,
                &local,
                p.b_at_a,
                MemKind::Dram,
                &remote,
                None,
            )
            .unwrap();
        let first = p.a.post(x).unwrap();
        finish(&p, x, first);
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
    let x =
        p.a.create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            p.b_at_a,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    let first = p.a.post(x).unwrap();
    finish(&p, x, first);
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
    let p2 = Pair {
        a: p.a,
        b: p.b,
        b_at_a: peer,
    };
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
