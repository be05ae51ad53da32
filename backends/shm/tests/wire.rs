//! The SHM backend's wire parsers (`ferry_shm::wire`: connection info and region
//! metadata) on a seed corpus of valid encodings — the fuzzer's committed seeds in
//! `metadata/fuzz/seeds/shm_wire` included — and thousands of mutations of it: nothing
//! panics, every refusal is a typed `InvalidMetadata`, everything accepted re-encodes to
//! the same bytes.

use std::path::{Path, PathBuf};

use ferry_backend_api::Error;
use ferry_shm::wire::{fnv1a, ConnInfo, RegionMd, SegmentRef};
use ferry_testkit::mutate;

fn valid_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let conn = ConnInfo {
        pid: 4242,
        backend_id: 3,
        inbox_fd: 17,
        inbox_nonce: *b"0123456789abcdef",
        inbox_base: 0x7f00_1234_0000,
        inbox_len: 4096 + 64 * (4096 + 65536),
        host_id: "255943f9-27dd-4d47-93c3-37954aad3fec/host-1/pid:[4026531836]".into(),
    };
    let hash = fnv1a(conn.host_id.as_bytes());
    vec![
        ("conn", conn.encode()),
        (
            "region-ordinary",
            RegionMd {
                pid: 4242,
                host_hash: hash,
                segment: None,
            }
            .encode(),
        ),
        (
            "region-shared",
            RegionMd {
                pid: 4242,
                host_hash: hash,
                segment: Some(SegmentRef {
                    fd: 21,
                    nonce: *b"fedcba9876543210",
                    base: 0x7f00_8000_0000,
                    len: 1 << 30,
                }),
            }
            .encode(),
        ),
    ]
}

fn seed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../metadata/fuzz/seeds/shm_wire")
}

fn parse_both(bytes: &[u8]) -> bool {
    let conn = match ConnInfo::parse(bytes) {
        Ok(c) => {
            assert_eq!(c.encode(), bytes, "connection info round trip");
            true
        }
        Err(Error::InvalidMetadata { reason }) => {
            assert!(reason.starts_with("SHM connection info: "), "{reason}");
            false
        }
        Err(other) => panic!("untyped refusal: {other:?}"),
    };
    let region = match RegionMd::parse(bytes) {
        Ok(r) => {
            assert_eq!(r.encode(), bytes, "region metadata round trip");
            true
        }
        Err(Error::InvalidMetadata { reason }) => {
            assert!(reason.starts_with("SHM region metadata: "), "{reason}");
            false
        }
        Err(other) => panic!("untyped refusal: {other:?}"),
    };
    conn || region
}

/// The committed seeds exist and still parse. `FERRY_BLESS_SEEDS=1` rewrites them.
#[test]
fn committed_fuzz_seeds_are_valid_encodings() {
    mutate::check_committed_seeds(&seed_dir(), &valid_seeds(), |_, bytes| parse_both(bytes));
}

#[test]
fn mutated_seed_corpus_gets_typed_errors() {
    mutate::check_seed_corpus(
        "shm_wire",
        &seed_dir(),
        &valid_seeds(),
        4000,
        0x5eed_0513,
        parse_both,
    );
}
