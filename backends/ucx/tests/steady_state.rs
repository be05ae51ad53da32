//! Steady state of batched small transfers (`state/batch.rs`): after warm-up, posting
//! batched writes and reads to a peer (and over tcp a WRITE piece by rendezvous) and
//! progressing both backends allocate nothing (the batch message buffers, the ack and
//! reply buffers, the rendezvous receive records and queues are pooled), and
//! the loop leaves no
//! request slot or batch message behind. One test only in this binary, so the global
//! allocation counter sees nothing but the backends and this loop. (UCX's own
//! allocations go through libc, not the counted Rust allocator.)

// Reason: the tests call the backend's unsafe methods (through `common::TestCalls`).
#![allow(unsafe_code)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use ferry_backend_api::{Backend, Completions, Endpoint, Op, Range};
use ferry_testkit::alloc::{self as counting, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn batched_writes_allocate_nothing_once_warm() {
    if !setup() {
        return;
    }
    for &transports in TRANSPORTS {
        const LEN: usize = 1 << 20;
        let p = pair_with(transports, LEN, &[], &[]);
        let mut order: Vec<usize> = (0..512).collect();
        Rng::new(4).shuffle(&mut order);
        let small: Vec<Range> = order
            .iter()
            .enumerate()
            .map(|(i, &j)| range(&p, i * 64, j * 64, 64))
            .collect();
        let large: Vec<Range> = (0..4)
            .map(|i| range(&p, (64 << 10) + i * 8192, (64 << 10) + i * 8192, 8192))
            .collect();
        // Over tcp (`am_tcp`): one piece that goes by rendezvous (`am_tcp_rndv`).
        let big = [range(&p, 256 << 10, 256 << 10, 512 << 10)];
        let reads: Vec<Range> = (0..256)
            .map(|i| {
                range(
                    &p,
                    (128 << 10) + i * 64,
                    (128 << 10) + ((i * 31) % 256) * 64,
                    64,
                )
            })
            .collect();
        let Pair {
            mut a,
            mut b,
            a_buf,
            b_buf,
            peer_b: peer,
            ..
        } = p;
        a.connect(peer).unwrap();
        assert_eq!(a.batches_to(peer), Some(true));
        let mut done = Completions::with_capacity(4);
        let notif = b"n";
        let mut cycle = |a: &mut ferry_ucx::UcxBackend, b: &mut ferry_ucx::UcxBackend, i: u64| {
            done.clear();
            let posts = [
                post(i * 3, Op::Write, &small, Some(notif)),
                post(i * 3 + 1, Op::Write, &large, None),
                post(i * 3 + 2, Op::Write, &big, None),
            ];
            let read = [post(u64::MAX - i, Op::Read, &reads, None)];
            a.post_t(Endpoint::Peer(peer), &posts, &mut done).unwrap();
            let deadline = Instant::now() + Duration::from_secs(30);
            a.post_t(Endpoint::Peer(peer), &read, &mut done).unwrap();
            while done.len() < 4 {
                a.progress(&mut done);
                b.progress(&mut done);
                assert!(Instant::now() < deadline, "cycle {i} timed out");
            }
            for c in done.as_slice() {
                assert_eq!(c.result, Ok(()));
            }
            // Drain the target's notification (its inbox storage is reused).
            let mut sink = CountSink(0);
            while sink.0 == 0 {
                b.progress(&mut done);
                b.drain_notifications(&mut sink);
                assert!(Instant::now() < deadline, "cycle {i}: no notification");
            }
        };
        for i in 0..200 {
            cycle(&mut a, &mut b, i);
        }
        counting::start();
        let iterations = 1_000;
        let started = Instant::now();
        for i in 200..200 + iterations {
            cycle(&mut a, &mut b, i);
        }
        let allocations = counting::stop();
        assert_eq!(
            allocations, 0,
            "[{transports}] {allocations} allocations over {iterations} batched post/progress cycles"
        );
        assert_eq!(a.in_flight(), 0, "leaked request slots");
        assert_eq!(a.batch_counts().in_flight, 0, "leaked batch messages");
        assert_eq!(b.batch_counts().allocated_acks, 0, "ack pool ran dry");
        assert!(
            b.batch_counts().allocated_replies <= 64,
            "reply pool kept growing"
        );
        for (i, &j) in order.iter().enumerate() {
            assert!(b_buf.0[j * 64..(j + 1) * 64] == a_buf.0[i * 64..(i + 1) * 64]);
        }
        eprintln!(
            "[{transports}] {iterations} cycles of 512 × 64 B + 4 × 8 KiB WRITE, 256 × 64 B READ in {:?}, 0 allocations",
            started.elapsed()
        );
    }
}

/// Counts delivered notifications without storing them.
struct CountSink(usize);

impl ferry_backend_api::NotifSink for CountSink {
    fn deliver(&mut self, _from: &str, _payload: &[u8]) {
        self.0 += 1;
    }
}
