//! The P2P frame and hello parsers on a seed corpus plus thousands of mutated inputs
//! (the stable counterpart of the `p2p_frame` fuzz target, same harness): no panic, no
//! broken property, and no allocation larger than what the input can justify — a
//! length prefix that announces up to the 1 MiB limit reserves at most the first
//! 64 KiB payload chunk (or twice the bytes that really arrived).
//! (Its own test binary, with one test: the allocation tracker is process-wide.)

use std::sync::Arc;
use std::time::Duration;

use ferry::exchange::p2p::frame::fuzzing::{exercise, MAX_FRAME_BYTES};
use ferry::exchange::p2p::frame::{
    FrameSettings, FrameWriter, Hello, Kind, PAYLOAD_FIRST_CHUNK_BYTES,
};
use ferry_tests::counting::{largest, CountingAlloc};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Frames as the writer sends them (secret or not), behind a mode byte.
fn written(secret: bool, frames: &[(Kind, &str, &[u8])]) -> Vec<u8> {
    let settings = FrameSettings {
        secret: secret.then(|| Arc::from(&b"fuzz secret"[..])),
        max_frame_bytes: MAX_FRAME_BYTES,
        io_timeout: Duration::from_secs(1),
    };
    let mut w = FrameWriter::new(vec![u8::from(secret)], &settings, [9; 16]);
    for (kind, label, payload) in frames {
        w.send(*kind, "peer", label, payload).unwrap();
    }
    w.stream().clone()
}

/// The seed corpus: real frame streams (raw mode, with and without a secret), frame
/// specs for the structured mode, hellos, a huge length prefix.
fn seeds() -> Vec<Vec<u8>> {
    let big = vec![0xA5; 20_000];
    let mut seeds = Vec::new();
    for secret in [false, true] {
        seeds.push(written(
            secret,
            &[
                (Kind::SendMe, "metadata", b""),
                (Kind::Load, "metadata", b"some metadata"),
                (Kind::Invalidate, "", b""),
                (Kind::Ack, "", b""),
                (Kind::Error, "l", b"no such label"),
            ],
        ));
        seeds.push(written(secret, &[(Kind::Load, "layer-3", &big)]));
        // Structured mode: no flip, then a flip in the second frame.
        let spec = [
            1u8, 8, b'm', b'e', b't', b'a', b'd', b'a', b't', b'a', 3, 0, 1, 2, 3, 2, 0, 0, 0,
        ];
        for flip in [[0xFF, 0xFF, 0xFF, 0xFF, 0], [40, 0, 0, 0, 0x10]] {
            let mut s = vec![2 | u8::from(secret)];
            s.extend_from_slice(&flip);
            s.extend_from_slice(&spec);
            seeds.push(s);
        }
    }
    let hello = Hello {
        auth: true,
        nonce: [1; 16],
        name: "prefill-0".into(),
    };
    let mut h = vec![0];
    h.extend(hello.encode());
    seeds.push(h);
    let mut huge = vec![0];
    huge.extend_from_slice(&(MAX_FRAME_BYTES as u32 - 1).to_le_bytes());
    huge.extend_from_slice(&[
        1, 0, 0, 0, 0, 0, 0, 0, 0, 4, b'p', b'e', b'e', b'r', 0, 7, 7, 7,
    ]);
    seeds.push(huge);
    seeds
}

/// Apply `edits` (position, operation, value) to `input`.
fn mutate(mut input: Vec<u8>, edits: &[(u32, u8, u8)]) -> Vec<u8> {
    for &(pos, op, value) in edits {
        let len = input.len();
        let at = if len == 0 { 0 } else { pos as usize % len };
        match op % 5 {
            0 if len > 0 => input[at] ^= value | 1,
            1 => input.insert(at.min(len), value),
            2 if len > 0 => {
                input.remove(at);
            }
            3 if len >= 4 => {
                // A new length prefix somewhere: the biggest lie is the interesting one.
                let v = u32::from(value) << 24 | pos >> 8;
                let at = at.min(len - 4);
                input[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => input.truncate(at),
        }
    }
    input
}

/// Run the harness on `input` and check the largest allocation it made.
fn check(input: &[u8]) {
    let ((), peak) = largest(|| exercise(input));
    // The reader's own buffers are made before reading; what reading may allocate is
    // bounded by the first payload chunk, twice the input, or the structured mode's
    // re-encoding of the input (its frames are at most the input plus headers).
    let bound = PAYLOAD_FIRST_CHUNK_BYTES
        .max(4 * input.len() + 4096)
        .max(16 << 10);
    assert!(
        peak <= bound,
        "an input of {} bytes made an allocation of {peak} bytes (bound {bound})",
        input.len()
    );
}

#[test]
fn p2p_frame_parsers_hold_on_seeds_and_mutations() {
    let seeds = seeds();
    for seed in &seeds {
        check(seed);
    }
    // `FERRY_FUZZ_SEEDS_DIR=metadata/fuzz/seeds/p2p_frame` writes the corpus for the
    // fuzz target (committed there).
    if let Ok(dir) = std::env::var("FERRY_FUZZ_SEEDS_DIR") {
        std::fs::create_dir_all(&dir).unwrap();
        for (i, seed) in seeds.iter().enumerate() {
            std::fs::write(format!("{dir}/seed-{i:02}"), seed).unwrap();
        }
    }
    let mut runner = TestRunner::new(Config {
        cases: 4000,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (
        0..seeds.len(),
        prop::collection::vec(any::<(u32, u8, u8)>(), 1..8),
    );
    runner
        .run(&strategy, |(i, edits)| {
            check(&mutate(seeds[i].clone(), &edits));
            Ok(())
        })
        .unwrap();
}
