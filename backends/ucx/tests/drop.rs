//! Dropping one of two UCX backends of one process, one after the other from one thread,
//! while their wireup is still going: the first drop's flush is answered, because the
//! drop progresses the other backend while it waits (`state/neighbours.rs`). Its own
//! test binary: `ferry_ucx::drop_flush_timeouts` counts for the whole process, so no
//! other test may drop backends meanwhile.

// Reason: the tests call the backend's unsafe methods (through `common::TestCalls`).
#![allow(unsafe_code)]

mod common;

use common::*;
use ferry_backend_api::{Completions, Endpoint, Op};

#[test]
fn dropping_one_of_two_same_process_backends_does_not_wait_out_its_flush() {
    if !setup() {
        return;
    }
    for &transports in TRANSPORTS {
        for used in [false, true] {
            // Both load each other (each starts its wireup to the other at load).
            let mut p = pair_with(transports, 1 << 20, &[], &[]);
            if used {
                // The same with requests between them first.
                let first = [range(&p, 0, 0, 64 << 10)];
                run_ok(&mut p, &[post(1, Op::Write, &first, None)]);
                let second = [range(&p, 0, 0, 512 << 10)];
                let mut done = Completions::with_capacity(4);
                p.a.post_t(
                    Endpoint::Peer(p.peer_b),
                    &[post(2, Op::Write, &second, None)],
                    &mut done,
                )
                .expect("post");
            }
            let before = ferry_ucx::drop_flush_timeouts();
            // `b` is not progressed by anyone but `a`'s drop: no progress thread, and
            // this thread is inside that drop.
            let common::Pair { a, b, .. } = p;
            drop(a);
            assert_eq!(
                ferry_ucx::drop_flush_timeouts(),
                before,
                "[{transports}] used {used}: the first drop's flush ran out its time"
            );
            // Nor does the second's, with its peer gone.
            drop(b);
            assert_eq!(
                ferry_ucx::drop_flush_timeouts(),
                before,
                "[{transports}] used {used}: the second drop's flush ran out its time"
            );
        }
    }
}
