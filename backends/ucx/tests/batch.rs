//! Batched small transfers (`state/batch.rs`: small ranges packed into active messages)
//! between two backends in one process: byte-for-byte results of many random small
//! WRITE and READ ranges alone and mixed with large ones (with one batch message at a
//! time, a small window, small messages), notifications only after the batched data, a
//! message into memory the target no longer has registered refused whole without
//! writing (or reading), and an unload with acks and replies pending. Each under the
//! default transports and `transports=tcp`.

// Reason: the tests call the backend's unsafe methods (through `common::TestCalls`).
#![allow(unsafe_code)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use ferry_backend_api::{
    Backend, Completion, Completions, Endpoint, FailureKind, MemKind, Op, Post, Range,
};

const TIMEOUT: Duration = Duration::from_secs(30);
const LEN: usize = 1 << 20;

fn pair(transports: &str, extra_a: &[(&str, &str)]) -> Pair {
    pair_with(transports, LEN, extra_a, &[])
}

/// A WRITE request.
fn write<'a>(tag: u64, ranges: &'a [Range], notif: Option<&'a [u8]>) -> Post<'a> {
    post(tag, Op::Write, ranges, notif)
}

/// Disjoint ranges tiling `[0, total)`, each 1..=`max` bytes, in shuffled order.
fn tiles(rng: &mut Rng, total: usize, max: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < total {
        let len = (1 + rng.below(max as u64) as usize).min(total - at);
        out.push((at, len));
        at += len;
    }
    rng.shuffle(&mut out);
    out
}

fn label(transports: &str) -> &str {
    if transports.is_empty() {
        "default"
    } else {
        transports
    }
}

#[test]
fn random_small_and_mixed_writes_land_byte_for_byte() {
    if !setup() {
        return;
    }
    for &transports in TRANSPORTS {
        let variants: [&[(&str, &str)]; 4] = [
            &[],
            &[("am_batch_messages", "1")],
            &[("post_window_bytes", "4096")],
            &[("am_batch_bytes", "1024"), ("am_batch_range_bytes", "700")],
        ];
        for extra in variants {
            let mut p = pair(transports, extra);
            p.a.connect(p.peer_b).unwrap();
            assert_eq!(
                p.a.batches_to(p.peer_b),
                Some(true),
                "[{}] {extra:?}: batching is on for shared memory and tcp",
                label(transports)
            );
            let mut rng = Rng::new(0xba7c ^ transports.len() as u64);
            for round in 0..4u64 {
                rng.fill(&mut p.a_buf.0);
                // Small ranges (some above am_batch_range_bytes) from [0, 256 KiB) to
                // [512 KiB, 768 KiB), and large ones between.
                let mut ranges: Vec<Range> = tiles(&mut rng, 256 << 10, 1500)
                    .into_iter()
                    .map(|(off, len)| range(&p, off, (512 << 10) + off, len))
                    .collect();
                for i in 0..3 {
                    let off = (256 << 10) + i * (80 << 10);
                    let at = rng.below(ranges.len() as u64) as usize;
                    ranges.insert(at, range(&p, off, (512 << 10) + off, 80 << 10));
                }
                let third = ranges.len() / 3;
                let notif = b"done";
                let posts = [
                    write(round * 10, &ranges[..third], None),
                    write(round * 10 + 1, &ranges[third..2 * third], None),
                    write(round * 10 + 2, &ranges[2 * third..], Some(notif)),
                ];
                run_ok(&mut p, &posts);
                let written = 256 << 10 | 240 << 10;
                assert!(
                    p.a_buf.0[..written] == p.b_buf.0[512 << 10..(512 << 10) + written],
                    "[{}] {extra:?} round {round}: target bytes differ",
                    label(transports)
                );
                let mut inbox = Inbox::default();
                wait_notifs(&mut [&mut p.b, &mut p.a], 0, &mut inbox, 1, TIMEOUT);
                assert_eq!(inbox.0, vec![("agent-a".to_string(), notif.to_vec())]);

                // The same ranges read back from fresh target bytes.
                rng.fill(&mut p.b_buf.0[512 << 10..]);
                let posts = [
                    post(round * 10 + 5, Op::Read, &ranges[..third], None),
                    post(round * 10 + 6, Op::Read, &ranges[third..], None),
                ];
                run_ok(&mut p, &posts);
                assert!(
                    p.a_buf.0[..written] == p.b_buf.0[512 << 10..(512 << 10) + written],
                    "[{}] {extra:?} round {round}: read bytes differ",
                    label(transports)
                );
            }
            let counts = p.a.batch_counts();
            assert_eq!(counts.in_flight, 0, "{counts:?}");
            assert_eq!(p.b.batch_counts().refused, 0);
            assert_eq!(p.a.in_flight(), 0);
        }
        // Forced off: same results through puts.
        let mut p = pair(transports, &[("am_batch", "off")]);
        p.a.connect(p.peer_b).unwrap();
        assert_eq!(p.a.batches_to(p.peer_b), Some(false));
        let mut rng = Rng::new(5);
        rng.fill(&mut p.a_buf.0);
        let ranges: Vec<Range> = tiles(&mut rng, 64 << 10, 300)
            .into_iter()
            .map(|(off, len)| range(&p, off, off, len))
            .collect();
        run_ok(&mut p, &[write(1, &ranges, None)]);
        assert!(p.a_buf.0[..64 << 10] == p.b_buf.0[..64 << 10]);
    }
}

/// A load pings the peer (so the way back is set up before the first request): the
/// answer arrives as an ack that names no batch message, counted apart and never taken
/// for a stale ack; the peer refuses nothing.
#[test]
fn a_load_pings_the_peer_and_the_answer_is_not_a_stale_ack() {
    if !setup() {
        return;
    }
    for &transports in TRANSPORTS {
        let mut p = pair_with(transports, LEN, &[], &[("progress_thread", "true")]);
        let deadline = Instant::now() + TIMEOUT;
        // B's progress thread answers A's ping, usually while A's load waits for it.
        while p.a.batch_counts().pongs == 0 && Instant::now() < deadline {
            let mut done = Completions::with_capacity(4);
            p.a.progress(&mut done);
        }
        let (a, b) = (p.a.batch_counts(), p.b.batch_counts());
        if a.sent == 0 && a.pongs == 0 && transports.is_empty() {
            // UCX's own transports here need no messages (RDMA): no ping is sent.
            continue;
        }
        assert_eq!(a.pongs, 1, "{}: {a:?}", label(transports));
        assert_eq!(a.stale_acks, 0, "{}: {a:?}", label(transports));
        assert_eq!(b.refused, 0, "{}: {b:?}", label(transports));
    }
}

#[test]
fn notification_comes_only_after_the_batched_data() {
    if !setup() {
        return;
    }
    for &transports in TRANSPORTS {
        let mut p = pair(transports, &[]);
        let mut rng = Rng::new(17);
        for round in 0..8u8 {
            rng.fill(&mut p.a_buf.0[..128 << 10]);
            let ranges: Vec<Range> = tiles(&mut rng, 128 << 10, 256)
                .into_iter()
                .map(|(off, len)| range(&p, off, off, len))
                .collect();
            let tag = [b'n', round];
            let mut done = Completions::with_capacity(4);
            p.a.post_t(
                Endpoint::Peer(p.peer_b),
                &[write(u64::from(round), &ranges, Some(&tag))],
                &mut done,
            )
            .unwrap();
            let mut inbox = Inbox::default();
            let seen = wait_notifs(&mut [&mut p.b, &mut p.a], 0, &mut inbox, 1, TIMEOUT);
            assert_eq!(inbox.0, vec![("agent-a".to_string(), tag.to_vec())]);
            assert!(
                p.a_buf.0[..128 << 10] == p.b_buf.0[..128 << 10],
                "[{}] data incomplete at notification",
                label(transports)
            );
            if done.is_empty() && seen.is_empty() {
                wait_for(&mut [&mut p.a, &mut p.b], &[u64::from(round)], TIMEOUT);
            }
        }
    }
}

#[test]
fn a_message_into_memory_no_longer_registered_is_refused_whole_without_writing() {
    if !setup() {
        return;
    }
    for &transports in TRANSPORTS {
        let mut p = pair(transports, &[]);
        let gone = Buffer::new(64 << 10);
        let (gone_token, gone_md) = register(&mut p.b, &gone);
        let b_info = p.b.conn_info().expect("conn info");
        load(
            &mut p.a,
            p.peer_b,
            "agent-b",
            &b_info,
            &[(p.b_token, p.b_md.clone()), (gone_token, gone_md)],
        );
        // The initiator still holds the rkey; the target deregisters the region.
        p.b.deregister_t(MemKind::Dram, gone_token).unwrap();
        p.a_buf.0[..4096].fill(0xab);
        let inside = range(&p, 0, 4096, 64);
        let outside = Range {
            remote_addr: gone.addr() + 100,
            remote_token: gone_token,
            ..range(&p, 64, 0, 64)
        };
        let ranges = [inside, outside];
        let got = run(&mut p, &[write(7, &ranges, None)]);
        let failure = got[0].result.expect_err("the target must refuse");
        assert_eq!(
            (failure.kind, failure.errno),
            (FailureKind::Backend, libc::EFAULT),
            "[{}] {failure:?}",
            label(transports)
        );
        assert!(
            gone.0.iter().all(|&b| b == 0),
            "unregistered memory written"
        );
        assert!(
            p.b_buf.0[4096..4096 + 64].iter().all(|&b| b == 0),
            "a refused message must write nothing"
        );
        assert_eq!(p.b.batch_counts().refused, 1);
        // Reading it is refused as well, and writes nothing locally.
        p.a_buf.0[..4096].fill(0);
        let got = run(&mut p, &[post(9, Op::Read, &ranges, None)]);
        let failure = got[0].result.expect_err("the target must refuse the read");
        assert_eq!(
            (failure.kind, failure.errno),
            (FailureKind::Backend, libc::EFAULT)
        );
        assert!(
            p.a_buf.0[..4096].iter().all(|&b| b == 0),
            "refused read wrote"
        );
        assert_eq!(p.b.batch_counts().refused, 2);
        p.a_buf.0[..4096].fill(0xab);
        // The same backend pair still works.
        for c in run(&mut p, &[write(8, &ranges[..1], None)]) {
            assert_eq!(c.result, Ok(()));
        }
        assert!(p.b_buf.0[4096..4096 + 64].iter().all(|&b| b == 0xab));
    }
}

#[test]
fn unloading_the_target_with_acks_pending_fails_each_request_once() {
    if !setup() {
        return;
    }
    for &transports in TRANSPORTS {
        let mut p = pair(transports, &[]);
        p.a.connect(p.peer_b).unwrap();
        let ranges: Vec<Range> = (0..256)
            .map(|i| range(&p, i * 64, (i * 997 % 256) * 64, 64))
            .collect();
        let mut done = Completions::with_capacity(8);
        let posts: Vec<Post<'_>> = (0..4)
            .map(|t| {
                let op = if t < 2 { Op::Write } else { Op::Read };
                post(t, op, &ranges, None)
            })
            .collect();
        p.a.post_t(Endpoint::Peer(p.peer_b), &posts, &mut done)
            .unwrap();
        // The target never progressed: no ack can have come.
        assert!(p.a.batch_counts().in_flight > 0);
        p.a.unload_remote(p.peer_b);
        let deadline = Instant::now() + TIMEOUT;
        let mut reported: Vec<Completion> = Vec::new();
        loop {
            reported.extend_from_slice(done.as_slice());
            done.clear();
            if (reported.len() >= 4
                && p.a.in_flight() == 0
                && p.a.batch_counts().in_flight == 0
                && p.a.closing_endpoints() == 0)
                || Instant::now() > deadline
            {
                break;
            }
            p.a.progress(&mut done);
            p.b.progress(&mut done);
        }
        for tag in 0..4 {
            let mine: Vec<_> = reported.iter().filter(|c| c.tag == tag).collect();
            assert_eq!(mine.len(), 1, "request {tag} reported {} times", mine.len());
            let failure = mine[0].result.expect_err("no ack came");
            assert!(
                matches!(
                    failure.kind,
                    FailureKind::RemoteDisconnect | FailureKind::Canceled
                ),
                "{failure:?}"
            );
        }
        assert_eq!(p.a.in_flight(), 0, "slots left");
        assert_eq!(p.a.batch_counts().in_flight, 0, "batch messages left");
        // Reloaded, the peer works again.
        let b_info = p.b.conn_info().expect("conn info");
        load(
            &mut p.a,
            p.peer_b,
            "agent-b",
            &b_info,
            &[(p.b_token, p.b_md.clone())],
        );
        p.a_buf.0[..256 * 64].fill(3);
        for c in run(&mut p, &[write(9, &ranges, None)]) {
            assert_eq!(c.result, Ok(()));
        }
        assert!(p.b_buf.0[..256 * 64].iter().all(|&b| b == 3));
    }
}

/// `b`'s connection info as a build from before batching wrote it (format 1: no
/// features byte), or in format 2 without the batch-message feature.
fn without_batch_feature(info: &[u8], format_1: bool) -> Vec<u8> {
    let decoded = ferry_ucx::wire::decode(info).expect("own connection info");
    let mut bytes = ferry_ucx::wire::encode(&decoded.addresses, 0);
    if format_1 {
        bytes.remove(5);
        bytes[4] = ferry_ucx::wire::FORMAT_V1;
    }
    bytes
}

#[test]
fn a_peer_without_the_batch_feature_gets_puts_and_gets() {
    if !setup() {
        return;
    }
    // A peer that does not say it handles batch messages (an older build: UCX would
    // drop messages of an id it has no handler for, and the acks would never come)
    // gets plain puts and gets; a reload that changes what it says takes effect.
    for &transports in TRANSPORTS {
        for format_1 in [true, false] {
            let what = format!("[{}] format_1={format_1}", label(transports));
            let mut p = pair(transports, &[]);
            p.a.connect(p.peer_b).unwrap();
            assert_eq!(p.a.batches_to(p.peer_b), Some(true), "{what}");
            let old = without_batch_feature(&p.b.conn_info().expect("conn info"), format_1);
            let regions = [(p.b_token, p.b_md.clone())];
            load(&mut p.a, p.peer_b, "agent-b", &old, &regions);
            p.a.connect(p.peer_b).unwrap();
            assert_eq!(p.a.batches_to(p.peer_b), Some(false), "{what}");

            let mut rng = Rng::new(0x01d ^ transports.len() as u64);
            rng.fill(&mut p.a_buf.0);
            let ranges: Vec<Range> = (0..200)
                .map(|i| range(&p, i * 64, (512 << 10) + i * 128, 64))
                .collect();
            // Both ways, each checked range by range.
            for op in [Op::Write, Op::Read] {
                if op == Op::Read {
                    rng.fill(&mut p.b_buf.0[512 << 10..]);
                }
                run_ok(&mut p, &[post(1, op, &ranges, None)]);
                for (i, r) in ranges.iter().enumerate() {
                    let ro = (r.remote_addr - p.b_buf.addr()) as usize;
                    assert_eq!(
                        p.a_buf.0[i * 64..i * 64 + 64],
                        p.b_buf.0[ro..ro + 64],
                        "{what}: {op:?} range {i} differs"
                    );
                }
            }
            assert_eq!(p.a.batch_counts().in_flight, 0, "{what}");

            // It says it again: batching again.
            let now = p.b.conn_info().expect("conn info");
            load(&mut p.a, p.peer_b, "agent-b", &now, &regions);
            p.a.connect(p.peer_b).unwrap();
            assert_eq!(p.a.batches_to(p.peer_b), Some(true), "{what}");
        }
    }
}

/// Whether `addr` starts a mapping of a file (a SysV or POSIX shared-memory segment).
fn shared_segment_at(addr: u64) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    maps.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() >= 5
            && u64::from_str_radix(fields[0].split('-').next().unwrap_or(""), 16) == Ok(addr)
            && fields[4] != "0"
    })
}

#[test]
fn small_ranges_into_a_region_ucx_maps_here_go_as_puts() {
    if !setup() {
        return;
    }
    // A UCX-allocated target region over shared memory: UCX stores into it one-sided
    // (measured 4x the bandwidth of batching at 4 KiB), so nothing is batched into it;
    // ranges into the ordinary region beside it still are.
    let mut p = pair("", &[]);
    let shared = p.b.alloc(MemKind::Dram, LEN as u64).expect("alloc");
    let shared_token =
        p.b.register_t(&ferry_backend_api::RegionSpec {
            kind: MemKind::Dram,
            desc: ferry_backend_api::Desc::new(shared.addr, shared.len, 0),
            path: None,
        })
        .expect("register the allocation");
    let regions = [
        (p.b_token, p.b_md.clone()),
        (shared_token.token, shared_token.public_md.clone()),
    ];
    let info = p.b.conn_info().expect("conn info");
    load(&mut p.a, p.peer_b, "agent-b", &info, &regions);
    Rng::new(0x5a9).fill(&mut p.a_buf.0);
    let small = |remote: u64, token: u64| -> Vec<Range> {
        (0..200)
            .map(|i| Range {
                local_addr: p.a_buf.addr() + i * 64,
                remote_addr: remote + i * 128,
                len: 64,
                local_dev: 0,
                remote_dev: 0,
                local_token: p.a_token,
                remote_token: token,
            })
            .collect()
    };
    let into_shared = small(shared.addr, shared_token.token);
    let into_ordinary = small(p.b_buf.addr(), p.b_token);
    let sent = p.a.batch_counts().sent;
    run_ok(&mut p, &[write(1, &into_shared, None)]);
    let mapped_sent = p.a.batch_counts().sent - sent;
    for (i, r) in into_shared.iter().enumerate() {
        // SAFETY: the allocation is live and nothing writes it now.
        let got = unsafe { std::slice::from_raw_parts(r.remote_addr as *const u8, 64) };
        assert_eq!(got, &p.a_buf.0[i * 64..i * 64 + 64], "range {i} differs");
    }
    run_ok(&mut p, &[write(2, &into_ordinary, None)]);
    let ordinary_sent = p.a.batch_counts().sent - sent - mapped_sent;
    assert!(ordinary_sent > 0, "ranges into ordinary memory are batched");
    if shared_segment_at(shared.addr) {
        assert_eq!(mapped_sent, 0, "nothing is batched into a mapped region");
    } else {
        eprintln!(
            "skipped the mapped case: this UCX allocated no shared-memory segment \
             ({mapped_sent} messages went to the allocation)"
        );
    }
    p.b.deregister_t(MemKind::Dram, shared_token.token)
        .expect("deregister");
    // SAFETY: deregistered; nothing touches the allocation any more.
    unsafe { p.b.free(MemKind::Dram, shared.addr) }.expect("free");
}

/// Over tcp every DRAM range travels in Ferry's messages (`am_tcp`), and a WRITE piece
/// that fills a message goes by rendezvous (`am_tcp_rndv`, on by default): the target
/// checks its range, then UCX receives the data straight into the region. Byte for byte
/// the same as the eager pieces (`am_tcp_rndv=off`), for ranges at odd offsets and
/// lengths whose short tails are packed as before, with the notification after all data; the
/// target counts exactly the pieces that came by rendezvous, none failed or left.
#[test]
fn large_writes_over_tcp_land_byte_for_byte_by_rendezvous_and_eager() {
    if !setup() {
        return;
    }
    // With pieces of 256 KiB, 700,001 bytes are two whole pieces and a tail of 175,713
    // (by rendezvous too: at least 64 KiB); 300,000 are one and a tail of 37,856, packed.
    let lens = [700_001usize, 300_000];
    for (rndv, pieces) in [("on", 4), ("off", 0)] {
        let mut p = pair_with(
            "tcp",
            LEN,
            &[("am_tcp_rndv", rndv), ("am_tcp_rndv_piece_bytes", "262144")],
            &[],
        );
        let mut rng = Rng::new(0x7e57 ^ pieces);
        for round in 0..3u64 {
            rng.fill(&mut p.a_buf.0);
            let ranges = [
                range(&p, 1, 5, lens[0]),
                range(&p, 700_100, 700_107, lens[1]),
            ];
            run_ok(&mut p, &[write(round, &ranges, Some(b"landed"))]);
            assert!(
                p.a_buf.0[1..1 + lens[0]] == p.b_buf.0[5..5 + lens[0]]
                    && p.a_buf.0[700_100..700_100 + lens[1]]
                        == p.b_buf.0[700_107..700_107 + lens[1]],
                "am_tcp_rndv={rndv} round {round}: target bytes differ"
            );
            let mut inbox = Inbox::default();
            wait_notifs(&mut [&mut p.b, &mut p.a], 0, &mut inbox, 1, TIMEOUT);
            assert_eq!(inbox.0, vec![("agent-a".to_string(), b"landed".to_vec())]);
        }
        let b = p.b.batch_counts();
        assert_eq!(b.rndv_received, 3 * pieces, "am_tcp_rndv={rndv}: {b:?}");
        assert_eq!(
            (b.rndv_failed, b.rndv_in_flight, b.refused),
            (0, 0, 0),
            "{b:?}"
        );
        assert_eq!(p.a.batch_counts().in_flight, 0);
    }
}

/// Post one WRITE of `ranges` (request 1) from `a` and progress both sides until `b`
/// has accepted a rendezvous piece and asked for its data; then `a` is left alone, so
/// the receive stays in flight until `a` is progressed again.
fn hold_one_rndv_receive(p: &mut Pair, ranges: &[Range], done: &mut Completions) {
    p.a.post_t(Endpoint::Peer(p.peer_b), &[write(1, ranges, None)], done)
        .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    while p.b.batch_counts().rndv_in_flight == 0 {
        assert!(
            Instant::now() < deadline,
            "the piece never reached the target"
        );
        p.b.progress(done);
        if p.b.batch_counts().rndv_in_flight == 0 {
            p.a.progress(done);
        }
    }
}

/// A region withdrawn while a rendezvous piece into it is being received (accepted
/// before the withdrawal, its data still at the initiator) stays registered until that
/// receive ends: `withdraw` answers "not yet" meanwhile, the piece lands whole, and a
/// WRITE that comes after the withdrawal is refused (`EFAULT`) without a byte changing.
#[test]
fn a_withdrawal_waits_for_a_rendezvous_piece_in_flight() {
    if !setup() {
        return;
    }
    let mut p = pair_with("tcp", LEN, &[], &[]);
    p.a.connect(p.peer_b).unwrap();
    let mut rng = Rng::new(0xd1ce);
    rng.fill(&mut p.a_buf.0);
    let piece = 252 << 10;
    let ranges = [range(&p, 0, 0, piece)];
    let mut done = Completions::with_capacity(4);
    hold_one_rndv_receive(&mut p, &ranges, &mut done);
    let deadline = Instant::now() + TIMEOUT;
    assert!(
        !p.b.withdraw(MemKind::Dram, p.b_token).unwrap(),
        "withdrawn with a receive into it in flight"
    );
    // Once the initiator answers, the piece lands and the withdrawal completes.
    let mut withdrawn = false;
    let mut reported: Vec<Completion> = Vec::new();
    while !withdrawn || reported.is_empty() {
        assert!(Instant::now() < deadline, "not ended within {TIMEOUT:?}");
        p.a.progress(&mut done);
        p.b.progress(&mut done);
        reported.extend_from_slice(done.as_slice());
        done.clear();
        withdrawn = withdrawn || p.b.withdraw(MemKind::Dram, p.b_token).unwrap();
    }
    assert_eq!(reported.len(), 1);
    assert_eq!(reported[0].result, Ok(()), "accepted before the withdrawal");
    assert!(
        p.a_buf.0[..piece] == p.b_buf.0[..piece],
        "the piece landed whole"
    );
    let b = p.b.batch_counts();
    assert_eq!((b.rndv_received, b.rndv_in_flight), (1, 0), "{b:?}");
    // After the withdrawal nothing lands.
    let left = p.b_buf.0.clone();
    p.a_buf.0.fill(0x5a);
    let got = run(&mut p, &[write(2, &ranges, None)]);
    let failure = got[0].result.expect_err("a withdrawn region must refuse");
    assert_eq!(
        (failure.kind, failure.errno),
        (FailureKind::Backend, libc::EFAULT)
    );
    assert!(p.b_buf.0 == left, "a byte changed after the withdrawal");
    assert_eq!(p.b.batch_counts().rndv_received, 1);
}

/// A target takes at most `am_tcp_rndv_receives_max` rendezvous pieces at once: with
/// one receive in flight (its initiator not progressed, so its data stays there), a
/// second initiator's pieces are refused without a byte written, and its request fails
/// with `ENOBUFS`; the first piece lands once its initiator answers.
#[test]
fn rendezvous_pieces_beyond_the_targets_bound_are_refused() {
    if !setup() {
        return;
    }
    let piece = 64 << 10;
    let mut p = pair_with(
        "tcp",
        LEN,
        &[("am_tcp_rndv_piece_bytes", "65536")],
        &[("am_tcp_rndv_receives_max", "1")],
    );
    p.a.connect(p.peer_b).unwrap();
    let mut rng = Rng::new(0xb0b);
    rng.fill(&mut p.a_buf.0);
    let mut done = Completions::with_capacity(4);
    let first = [range(&p, 0, 0, piece)];
    hold_one_rndv_receive(&mut p, &first, &mut done);
    let deadline = Instant::now() + TIMEOUT;
    // A second initiator, writing two pieces into the rest of the target's buffer.
    let mut c = backend("agent-c", "tcp", &[("am_tcp_rndv_piece_bytes", "65536")]);
    let c_buf = Buffer::new(LEN);
    let (c_token, _) = register(&mut c, &c_buf);
    load(
        &mut c,
        p.peer_b,
        "agent-b",
        &p.b.conn_info().expect("conn info"),
        &[(p.b_token, p.b_md.clone())],
    );
    c.connect(p.peer_b).unwrap();
    let second = [Range {
        local_addr: c_buf.addr(),
        remote_addr: p.b_buf.addr() + piece as u64,
        len: 2 * piece as u64,
        local_dev: 0,
        remote_dev: 0,
        local_token: c_token,
        remote_token: p.b_token,
    }];
    let mut c_done = Completions::with_capacity(4);
    c.post_t(
        Endpoint::Peer(p.peer_b),
        &[write(2, &second, None)],
        &mut c_done,
    )
    .unwrap();
    while c_done.is_empty() {
        assert!(Instant::now() < deadline, "the second request never ended");
        c.progress(&mut c_done);
        p.b.progress(&mut done);
    }
    let failure = c_done.as_slice()[0]
        .result
        .expect_err("the target was at its bound");
    assert_eq!(
        (failure.kind, failure.errno),
        (FailureKind::Backend, libc::ENOBUFS)
    );
    let b = p.b.batch_counts();
    assert_eq!((b.rndv_refused, b.rndv_in_flight), (2, 1), "{b:?}");
    assert!(
        p.b_buf.0[piece..3 * piece].iter().all(|&x| x == 0),
        "a refused piece was written"
    );
    // The first initiator answers: its piece lands.
    let mut reported: Vec<Completion> = Vec::new();
    while reported.is_empty() {
        assert!(Instant::now() < deadline, "not ended within {TIMEOUT:?}");
        p.a.progress(&mut done);
        p.b.progress(&mut done);
        reported.extend_from_slice(done.as_slice());
        done.clear();
    }
    assert_eq!(reported[0].result, Ok(()));
    assert!(p.a_buf.0[..piece] == p.b_buf.0[..piece]);
    assert_eq!(p.b.batch_counts().rndv_received, 1);
}
