//! The remote side of a loopback transfer: the target agent may deregister the region a
//! request writes into (or reads from) at any time; the initiator's post must then fail
//! with a typed error naming the region and move no byte. Two backends (two agents) in
//! one process, driven through the `Backend` trait.

// Reason: the tests call the backend's unsafe methods; each call says why it holds.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ferry_backend_api::{
    Backend, BackendInit, Completions, Desc, Endpoint, Error, MemKind, Op, Params, PeerId,
    PeerRegions, Post, Range, RegionSpec, RemoteAgent,
};
use ferry_loopback::Loopback;

/// A peer's regions as the engine would hand them over: metadata token → public md.
struct HandRegions {
    name: String,
    md: HashMap<u64, Vec<u8>>,
}

impl PeerRegions for HandRegions {
    fn agent_name(&self) -> &str {
        &self.name
    }
    fn public_md(&self, token: u64) -> Option<&[u8]> {
        self.md.get(&token).map(Vec::as_slice)
    }
}

fn backend(name: &str) -> Loopback {
    Loopback::new(&BackendInit {
        agent_name: name,
        params: &Params::new(),
    })
    .unwrap()
}

fn peer(n: u32) -> PeerId {
    ferry_storage::handle_from_tag((1u64 << 32) | u64::from(n + 1))
}

/// Register `bytes` with `b`: (token, public metadata).
fn register(b: &mut Loopback, bytes: &[u8]) -> (u64, Vec<u8>) {
    // SAFETY: every buffer in these tests outlives the backends (declared first) and is
    // only read by the test after the posts that write it returned (loopback completes
    // inside `post`).
    let r = unsafe {
        b.register(&RegionSpec {
            kind: MemKind::Dram,
            desc: Desc::of_slice(bytes),
            path: None,
        })
    }
    .unwrap();
    (r.token, r.public_md)
}

/// Make `target` known to `initiator` as `peer(0)`, with its regions published under
/// metadata tokens 100, 101, …
fn load(initiator: &mut Loopback, target: &Loopback, name: &str, regions: &[Vec<u8>]) {
    let md = regions
        .iter()
        .enumerate()
        .map(|(i, md)| (100 + i as u64, md.clone()))
        .collect();
    initiator
        .load_remote(
            peer(0),
            RemoteAgent {
                name,
                conn_info: &target.conn_info().expect("conn info"),
                regions: Arc::new(HandRegions {
                    name: name.into(),
                    md,
                }),
                standby: false,
                ready_ranges: 0,
            },
        )
        .unwrap();
}

fn range(local: &[u8], local_token: u64, remote: &[u8], remote_token: u64) -> Range {
    Range {
        local_addr: local.as_ptr() as u64,
        remote_addr: remote.as_ptr() as u64,
        len: local.len().min(remote.len()) as u64,
        local_dev: 0,
        remote_dev: 0,
        local_token,
        remote_token,
    }
}

fn post(op: Op, ranges: &[Range]) -> Post<'_> {
    Post {
        tag: 7,
        op,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::Dram,
        ranges,
        notif: Some(b"must not arrive"),
    }
}

#[test]
fn target_deregistration_fails_the_initiators_post_and_moves_no_byte() {
    let src = vec![0xAAu8; 4096];
    let dst = vec![0x11u8; 4096];
    let mut a = backend("lb-remote-a");
    let mut b = backend("lb-remote-b");
    let (src_token, _) = register(&mut a, &src);
    let (dst_token, dst_md) = register(&mut b, &dst);
    load(&mut a, &b, "lb-remote-b", &[dst_md]);

    // SAFETY: no request uses the target region (nothing was posted yet).
    unsafe { b.deregister(MemKind::Dram, dst_token) }.unwrap();
    for op in [Op::Write, Op::Read] {
        let ranges = [range(&src, src_token, &dst, 100)];
        let mut done = Completions::with_capacity(1);
        // SAFETY: the local range lies in `src`, registered and alive.
        let err = unsafe { a.post(Endpoint::Peer(peer(0)), &[post(op, &ranges)], &mut done) }
            .unwrap_err();
        match &err {
            Error::NotFound { subject } => {
                let text = subject.to_string();
                assert!(text.contains("lb-remote-b"), "{text}");
                assert!(
                    text.contains(&format!("{:#x}", dst.as_ptr() as u64)),
                    "{text}"
                );
                assert!(text.contains("stale region"), "{text}");
            }
            other => panic!("expected a stale-region NotFound, got {other}"),
        }
        assert!(done.is_empty(), "no completion after a refused post");
    }
    assert!(dst.iter().all(|&x| x == 0x11), "target bytes untouched");
    assert!(src.iter().all(|&x| x == 0xAA), "initiator bytes untouched");
    let mut got = Vec::new();
    struct Sink<'a>(&'a mut Vec<Vec<u8>>);
    impl ferry_backend_api::NotifSink for Sink<'_> {
        fn deliver(&mut self, _from: &str, payload: &[u8]) {
            self.0.push(payload.to_vec());
        }
    }
    assert_eq!(
        b.drain_notifications(&mut Sink(&mut got)),
        0,
        "no notification"
    );

    // Registered again, the region has a new generation: the old metadata stays stale
    // and the new metadata works.
    let (_, new_md) = register(&mut b, &dst);
    assert_ne!(new_md, b"".to_vec());
    let ranges = [range(&src, src_token, &dst, 100)];
    let mut done = Completions::with_capacity(1);
    // SAFETY: as above.
    let stale = unsafe {
        a.post(
            Endpoint::Peer(peer(0)),
            &[post(Op::Write, &ranges)],
            &mut done,
        )
    };
    assert!(matches!(stale, Err(Error::NotFound { .. })), "{stale:?}");
    load(&mut a, &b, "lb-remote-b", &[Vec::new(), new_md]);
    let ranges = [range(&src, src_token, &dst, 101)];
    // SAFETY: as above; `dst` is registered again at `b`.
    unsafe {
        a.post(
            Endpoint::Peer(peer(0)),
            &[post(Op::Write, &ranges)],
            &mut done,
        )
    }
    .unwrap();
    assert_eq!(done.as_slice().len(), 1);
    assert_eq!(done.as_slice()[0].result, Ok(()));
    assert_eq!(dst, src);
}

#[test]
fn a_stale_range_anywhere_in_the_batch_fails_it_before_any_copy() {
    let src = vec![0x5Au8; 8192];
    let live = vec![0u8; 4096];
    let gone = vec![0u8; 4096];
    let mut a = backend("lb-batch-a");
    let mut b = backend("lb-batch-b");
    let (src_token, _) = register(&mut a, &src);
    let (live_token, live_md) = register(&mut b, &live);
    let (gone_token, gone_md) = register(&mut b, &gone);
    load(&mut a, &b, "lb-batch-b", &[live_md, gone_md]);
    // SAFETY: nothing in flight.
    unsafe { b.deregister(MemKind::Dram, gone_token) }.unwrap();
    let first = [range(&src[..4096], src_token, &live, 100)];
    let second = [
        range(&src[..4096], src_token, &live, 100),
        range(&src[4096..], src_token, &gone, 101),
    ];
    let mut done = Completions::with_capacity(2);
    // SAFETY: local ranges inside `src`, registered and alive.
    let err = unsafe {
        a.post(
            Endpoint::Peer(peer(0)),
            &[post(Op::Write, &first), post(Op::Write, &second)],
            &mut done,
        )
    }
    .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    assert!(live.iter().all(|&x| x == 0), "no byte of the batch moved");
    assert!(gone.iter().all(|&x| x == 0));
    // The pins taken before the stale range were released: `live` deregisters (a
    // leaked pin would make this wait forever).
    // SAFETY: nothing in flight.
    unsafe { b.deregister(MemKind::Dram, live_token) }.unwrap();
}

#[test]
fn local_deregistration_fails_the_post() {
    let src = vec![1u8; 256];
    let dst = vec![2u8; 256];
    let mut a = backend("lb-local-a");
    let (src_token, _) = register(&mut a, &src);
    let (dst_token, _) = register(&mut a, &dst);
    // SAFETY: nothing in flight.
    unsafe { a.deregister(MemKind::Dram, src_token) }.unwrap();
    let ranges = [range(&src, src_token, &dst, dst_token)];
    let mut done = Completions::with_capacity(1);
    // SAFETY: deliberately naming a deregistered local region: the backend must refuse
    // it (the executor would not hand it over; this checks the backend's own guard).
    let err =
        unsafe { a.post(Endpoint::Local, &[post(Op::Write, &ranges)], &mut done) }.unwrap_err();
    assert!(err.to_string().contains("local region"), "{err}");
    assert!(dst.iter().all(|&x| x == 2));
    // A second deregistration of the same token is a typed error.
    // SAFETY: nothing in flight.
    let again = unsafe { a.deregister(MemKind::Dram, src_token) };
    assert!(matches!(again, Err(Error::NotFound { .. })), "{again:?}");
}

#[test]
fn deregistration_waits_for_a_copy_in_progress_and_later_posts_fail() {
    // One thread posts into the target's region in a loop while the target deregisters
    // it: every post either copied completely before the deregistration or failed with
    // the stale-region error; none after.
    let src = vec![0xC3u8; 1 << 20];
    let dst = vec![0u8; 1 << 20];
    let mut a = backend("lb-race-a");
    let mut b = backend("lb-race-b");
    let (src_token, _) = register(&mut a, &src);
    let (dst_token, dst_md) = register(&mut b, &dst);
    load(&mut a, &b, "lb-race-b", &[dst_md]);
    let deregistered = Arc::new(AtomicBool::new(false));
    let ranges = [range(&src, src_token, &dst, 100)];
    std::thread::scope(|scope| {
        let flag = deregistered.clone();
        let poster = scope.spawn(move || {
            let mut ok_after = 0u32;
            let mut refused = 0u32;
            for _ in 0..10_000 {
                let was = flag.load(Ordering::Acquire);
                let mut done = Completions::with_capacity(1);
                let no_notif = Post {
                    notif: None,
                    ..post(Op::Write, &ranges)
                };
                // SAFETY: the local range is `src`, registered and alive.
                match unsafe { a.post(Endpoint::Peer(peer(0)), &[no_notif], &mut done) } {
                    Ok(()) => ok_after += u32::from(was),
                    Err(Error::NotFound { .. }) => refused += 1,
                    Err(e) => panic!("unexpected {e}"),
                }
                if refused > 100 {
                    break;
                }
            }
            (ok_after, refused)
        });
        std::thread::yield_now();
        // SAFETY: the caller-side promise concerns this backend's own requests (none);
        // a peer's copy in progress is waited for by the backend.
        unsafe { b.deregister(MemKind::Dram, dst_token) }.unwrap();
        deregistered.store(true, Ordering::Release);
        let (ok_after, refused) = poster.join().unwrap();
        assert_eq!(ok_after, 0, "a post started after deregistration copied");
        assert!(refused > 0, "posts after deregistration are refused");
    });
}

#[test]
fn a_range_outside_the_region_the_target_registered_is_refused() {
    // The target registered only the first half of its buffer; metadata that claims
    // more (forged, or from a buggy peer) cannot make the initiator write past it.
    let src = vec![0x77u8; 8192];
    let dst = vec![0u8; 8192];
    let mut a = backend("lb-bounds-a");
    let mut b = backend("lb-bounds-b");
    let (src_token, _) = register(&mut a, &src);
    let (_, half_md) = register(&mut b, &dst[..4096]);
    load(&mut a, &b, "lb-bounds-b", &[half_md]);
    let past_the_end = [range(&src[..4096], src_token, &dst[2048..6144], 100)];
    let mut done = Completions::with_capacity(1);
    // SAFETY: the local range is inside `src`, registered and alive.
    let err = unsafe {
        a.post(
            Endpoint::Peer(peer(0)),
            &[post(Op::Write, &past_the_end)],
            &mut done,
        )
    }
    .unwrap_err();
    assert!(err.to_string().contains("outside the region"), "{err}");
    assert!(dst.iter().all(|&x| x == 0), "no byte moved");
    // Inside the registered half it works, so the pin was released.
    let inside = [range(&src[..4096], src_token, &dst[..4096], 100)];
    // SAFETY: as above.
    unsafe {
        a.post(
            Endpoint::Peer(peer(0)),
            &[post(Op::Write, &inside)],
            &mut done,
        )
    }
    .unwrap();
    assert_eq!(done.as_slice()[0].result, Ok(()));
    assert!(dst[..4096].iter().all(|&x| x == 0x77));
    assert!(dst[4096..].iter().all(|&x| x == 0));
}
