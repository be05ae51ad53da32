//! The UCX backend's wire parsers (`ferry_ucx::wire`: connection info, framed rkeys,
//! batched-WRITE messages and acks)
//! on a seed corpus of valid encodings — the fuzzer's committed seeds in
//! `metadata/fuzz/seeds/ucx_wire` included — and thousands of mutations of it: nothing
//! panics, every refusal is typed, everything accepted re-encodes to the same bytes.
//! Plain byte handling: no libucp is loaded.

use std::path::{Path, PathBuf};

use ferry_storage::Error;
use ferry_testkit::{mutate, Rng};
use ferry_ucx::wire::{self, RkeyFrameError, ADDRESS_LEN_MAX};

/// The valid encodings the mutation test and the fuzzer start from, by seed file name.
fn valid_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut rng = Rng::new(0x0cc5);
    let mut bytes = |len: usize| {
        let mut b = vec![0u8; len];
        rng.fill(&mut b);
        b
    };
    // UCP worker addresses are a few hundred bytes; rkeys a few dozen to a few hundred.
    let one = vec![bytes(187)];
    let three = vec![bytes(187), bytes(1), bytes(530)];
    let many: Vec<Vec<u8>> = (1..=255).map(|i| bytes(i % 7 + 1)).collect();
    vec![
        (
            "conn-one-worker",
            wire::encode(&one, wire::FEATURE_BATCH_AM),
        ),
        ("conn-three-workers", wire::encode(&three, 0)),
        ("conn-255-workers", wire::encode(&many, 0xff)),
        ("conn-format-1", conn_v1(&three)),
        ("rkey-small", wire::frame_rkey(&bytes(1))),
        ("rkey-typical", wire::frame_rkey(&bytes(58))),
        ("rkey-large", wire::frame_rkey(&bytes(300))),
        (
            "batch-write-one",
            wire::encode_batch_write(7, &[(0x7f00_0000_1000, &bytes(64))]),
        ),
        (
            "batch-write-mixed",
            wire::encode_batch_write(
                (3 << 32) | 9,
                &[
                    (0x7f00_0000_2000, &bytes(1)),
                    (0x7f00_0000_0040, &bytes(200)),
                    (0x10, &bytes(13)),
                ],
            ),
        ),
        (
            "batch-read",
            wire::encode_batch_read(11, &[(0x7f00_0000_1000, 64), (0x40, 4096)]),
        ),
        (
            "batch-read-reply",
            [
                &wire::encode_ack(11, wire::BatchStatus::Written)[..],
                &bytes(80)[..],
            ]
            .concat(),
        ),
        (
            "batch-ack",
            wire::encode_ack(42, wire::BatchStatus::OutsideRegistered).to_vec(),
        ),
    ]
}

/// Connection info in the first format (no features byte), as builds before batching
/// wrote it.
fn conn_v1(addresses: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes = wire::encode(addresses, 0);
    bytes.remove(5);
    bytes[4] = wire::FORMAT_V1;
    bytes
}

fn seed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../metadata/fuzz/seeds/ucx_wire")
}

/// Parse `bytes` both ways; whether either parser accepted it. Asserts that every
/// refusal is typed and every acceptance round trips.
fn parse_both(bytes: &[u8]) -> bool {
    let conn = match wire::decode(bytes) {
        Ok(info) => {
            let addresses = &info.addresses;
            assert!((1..=255).contains(&addresses.len()));
            assert!(addresses
                .iter()
                .all(|a| !a.is_empty() && a.len() <= ADDRESS_LEN_MAX));
            let again = if info.format == wire::FORMAT_V1 {
                assert_eq!(info.features, 0, "format 1 has no features");
                conn_v1(addresses)
            } else {
                wire::encode(addresses, info.features)
            };
            assert_eq!(again, bytes, "connection info round trip");
            true
        }
        Err(Error::InvalidMetadata { reason }) => {
            assert!(reason.starts_with("UCX connection info: "), "{reason}");
            false
        }
        Err(other) => panic!("connection info refused with an untyped error: {other:?}"),
    };
    let rkey = match wire::unframe_rkey(bytes) {
        Ok(rkey) => {
            assert_eq!(wire::frame_rkey(rkey), bytes, "rkey frame round trip");
            true
        }
        Err(why) => {
            assert!(!why.to_string().is_empty());
            false
        }
    };
    let batch = match wire::parse_batch_write(bytes) {
        Ok(batch) => {
            let ranges: Vec<(u64, &[u8])> = batch.ranges().collect();
            assert_eq!(ranges.len(), batch.count as usize);
            assert!(ranges.iter().all(|(_, d)| !d.is_empty()));
            assert_eq!(
                wire::encode_batch_write(batch.cookie, &ranges),
                bytes,
                "batch message round trip"
            );
            true
        }
        Err(why) => {
            assert!(!why.to_string().is_empty());
            false
        }
    };
    let ack = match wire::parse_ack(bytes) {
        Ok((cookie, status)) => {
            if let Some(status) = wire::BatchStatus::from_wire(status) {
                assert_eq!(wire::encode_ack(cookie, status), bytes, "ack round trip");
            }
            true
        }
        Err(why) => {
            assert!(!why.to_string().is_empty());
            false
        }
    };
    let read = match wire::parse_batch_read(bytes) {
        Ok(read) => {
            let ranges: Vec<(u64, u32)> = read.ranges().collect();
            assert!(ranges.iter().all(|&(_, len)| len > 0));
            assert!(read.data_bytes <= wire::BATCH_READ_DATA_MAX);
            assert_eq!(
                read.data_bytes,
                ranges.iter().map(|&(_, l)| l as usize).sum::<usize>()
            );
            assert_eq!(
                wire::encode_batch_read(read.cookie, &ranges),
                bytes,
                "read request round trip"
            );
            true
        }
        Err(why) => {
            assert!(!why.to_string().is_empty());
            false
        }
    };
    let reply = wire::parse_read_reply(bytes).is_ok();
    conn || rkey || batch || ack || read || reply
}

/// The committed seeds exist and still parse: a format change that makes them invalid
/// fails here. `FERRY_BLESS_SEEDS=1` rewrites them from the encoder.
#[test]
fn committed_fuzz_seeds_are_valid_encodings() {
    mutate::check_committed_seeds(&seed_dir(), &valid_seeds(), |_, bytes| parse_both(bytes));
}

#[test]
fn mutated_seed_corpus_gets_typed_errors() {
    mutate::check_seed_corpus(
        "ucx_wire",
        &seed_dir(),
        &valid_seeds(),
        4000,
        0x5eed_0002,
        parse_both,
    );
}

#[test]
fn each_refusal_names_its_cause() {
    let rkey = wire::frame_rkey(&[7; 24]);
    assert_eq!(
        wire::unframe_rkey(&rkey[..15]),
        Err(RkeyFrameError::MissingHeader)
    );
    let mut bad = rkey.clone();
    bad[0] = b'X';
    assert_eq!(wire::unframe_rkey(&bad), Err(RkeyFrameError::MissingHeader));
    let mut bad = rkey.clone();
    bad[4] = 25;
    assert_eq!(
        wire::unframe_rkey(&bad),
        Err(RkeyFrameError::LengthMismatch)
    );
    assert_eq!(
        wire::unframe_rkey(&rkey[..16]),
        Err(RkeyFrameError::LengthMismatch)
    );
    let mut bad = rkey.clone();
    bad[20] ^= 1;
    assert_eq!(
        wire::unframe_rkey(&bad),
        Err(RkeyFrameError::ChecksumMismatch)
    );

    let reason = |bytes: &[u8]| match wire::decode(bytes) {
        Err(Error::InvalidMetadata { reason }) => reason.into_owned(),
        other => panic!("expected InvalidMetadata, got {other:?}"),
    };
    let conn = wire::encode(&[vec![1; 10], vec![2; 10]], wire::FEATURE_BATCH_AM);
    assert!(reason(b"FUCX").contains("missing FUCX header"));
    assert!(reason(b"FUCX\x09\x01").contains("unknown format 9"));
    assert!(reason(b"FUCX\x01\x00").contains("no worker address"));
    assert!(reason(b"FUCX\x02\x01").contains("missing worker count"));
    assert!(reason(b"FUCX\x02\x01\x00").contains("no worker address"));
    assert!(reason(&conn[..conn.len() - 12]).contains("worker address #1 truncated"));
    assert!(
        reason(&conn[..conn.len() - 1]).contains("worker address #1 has length 10 (9 bytes left)")
    );
    let mut inflated = conn.clone();
    inflated[7..11].copy_from_slice(&(ADDRESS_LEN_MAX as u32 + 1).to_le_bytes());
    assert!(reason(&inflated).contains("worker address #0 has length 65537"));
    let mut trailing = conn;
    trailing.push(0);
    assert!(reason(&trailing).contains("1 trailing bytes"));
}
