//! Hostile bytes: garbage, truncations and corruptions never panic; headers give
//! named errors; descriptor lists round trip; a seed corpus of valid encodings (the
//! fuzzer's committed seeds in `metadata/fuzz/seeds/peer_md` included) and thousands of
//! mutations of it get typed errors.

use ferry_metadata::{
    decode_descs, encode_descs, MdWriter, PeerMd, DESCS_MAGIC, FLAG_PARTIAL, MAGIC, VERSION,
};
use ferry_storage::{Desc, Error, MemKind};
use ferry_testkit::mutate;
use proptest::prelude::*;
use std::path::{Path, PathBuf};

fn sample_blob() -> Vec<u8> {
    let mut w = MdWriter::new("prefill-7", 3);
    let ucx = w.backend("UCX", Some(&[9; 20]));
    let posix = w.backend("POSIX", None);
    for i in 0..6u64 {
        w.region(
            ucx,
            MemKind::Dram,
            Desc::new(0x1000 * i, 0x800, i % 2),
            &[i as u8; 5],
        );
    }
    w.region(ucx, MemKind::Vram, Desc::new(0, 1 << 20, 1), b"rkey");
    w.region(posix, MemKind::File, Desc::new(0, 4096, 17), b"");
    w.finish().unwrap()
}

/// Use every accessor of a blob that validated, to prove lookups stay in bounds.
fn exercise(md: &PeerMd) {
    let _ = (
        md.agent(),
        md.generation(),
        md.is_partial(),
        md.as_bytes().len(),
    );
    for b in 0..=u8::MAX {
        if let Some((name, _)) = md.backend(b) {
            assert_eq!(md.backend_index(name), Some(b));
        }
    }
    let views: Vec<_> = md.regions().collect();
    assert_eq!(views.len(), md.region_count());
    for (i, view) in views.iter().enumerate() {
        assert_eq!(md.region(i as u32), Some(*view));
        let found = md
            .find(view.backend, view.kind, view.desc)
            .expect("own region");
        assert_eq!(found as usize, i);
        assert_eq!(md.exact(view.backend, view.kind, view.desc), Some(found));
    }
}

#[track_caller]
fn invalid_metadata(result: Result<impl std::fmt::Debug, Error>, words: &[&str]) {
    match result {
        Err(Error::InvalidMetadata { reason }) => {
            for word in words {
                assert!(
                    reason.contains(word),
                    "{reason:?} does not mention {word:?}"
                );
            }
        }
        other => panic!("expected InvalidMetadata mentioning {words:?}, got {other:?}"),
    }
}

#[test]
fn sample_blob_loads() {
    let md = PeerMd::from_bytes(&sample_blob()).unwrap();
    assert_eq!(md.region_count(), 8);
    exercise(&md);
}

#[test]
fn every_truncation_is_refused() {
    let blob = sample_blob();
    for len in 0..blob.len() {
        assert!(
            matches!(
                PeerMd::from_bytes(&blob[..len]),
                Err(Error::InvalidMetadata { .. })
            ),
            "prefix of {len} bytes accepted"
        );
    }
    invalid_metadata(
        PeerMd::from_bytes(&blob[..5]),
        &["5 bytes", "8-byte header"],
    );
}

#[test]
fn single_byte_corruptions_never_panic() {
    let blob = sample_blob();
    let mut accepted = 0;
    for pos in 0..blob.len() {
        for flip in [0x01u8, 0x02, 0x04, 0x10, 0x80, 0xff] {
            let mut bad = blob.clone();
            bad[pos] ^= flip;
            if let Ok(md) = PeerMd::from_bytes(&bad) {
                accepted += 1;
                exercise(&md);
            }
        }
        for value in [0u8, 0x7f, 0xff] {
            let mut bad = blob.clone();
            bad[pos] = value;
            if let Ok(md) = PeerMd::from_bytes(&bad) {
                exercise(&md);
            }
        }
    }
    // Some flips land in addresses or metadata bytes and stay valid; most do not.
    assert!(
        accepted > 0 && accepted < blob.len() * 6,
        "accepted {accepted}"
    );
}

#[test]
fn header_errors_are_named() {
    let blob = sample_blob();
    let mut bad = blob.clone();
    bad[0] = b'X';
    invalid_metadata(PeerMd::from_bytes(&bad), &["bad magic", "agent metadata"]);

    let descs = encode_descs(MemKind::Dram, &[Desc::new(1, 2, 3)]).unwrap();
    invalid_metadata(
        PeerMd::from_bytes(&descs),
        &["bad magic", "magic of a descriptor list"],
    );
    invalid_metadata(
        decode_descs(&blob),
        &["bad magic", "magic of agent metadata"],
    );

    let mut bad = blob.clone();
    bad[4..6].copy_from_slice(&(VERSION + 1).to_le_bytes());
    invalid_metadata(PeerMd::from_bytes(&bad), &["unsupported", "version 2"]);

    let mut bad = blob.clone();
    bad[6..8].copy_from_slice(&(FLAG_PARTIAL | 0x40).to_le_bytes());
    invalid_metadata(PeerMd::from_bytes(&bad), &["unknown header flags 0x0040"]);

    let mut bad = descs.clone();
    bad[6..8].copy_from_slice(&FLAG_PARTIAL.to_le_bytes());
    invalid_metadata(decode_descs(&bad), &["unknown header flags 0x0001"]);

    let mut partial = blob.clone();
    partial[6..8].copy_from_slice(&FLAG_PARTIAL.to_le_bytes());
    assert!(PeerMd::from_bytes(&partial).unwrap().is_partial());
    assert!(!PeerMd::from_bytes(&blob).unwrap().is_partial());

    assert_eq!(&blob[..4], &MAGIC);
    assert_eq!(&descs[..4], &DESCS_MAGIC);
    invalid_metadata(PeerMd::from_bytes(&blob[..8]), &["structure check failed"]);
}

#[test]
fn descriptor_list_truncations_and_corruptions_never_panic() {
    let descs: Vec<Desc> = (0..20).map(|i| Desc::new(i * 4096, 4096, i % 3)).collect();
    let bytes = encode_descs(MemKind::Vram, &descs).unwrap();
    for len in 0..bytes.len() {
        assert!(
            decode_descs(&bytes[..len]).is_err(),
            "prefix of {len} bytes accepted"
        );
    }
    for pos in 0..bytes.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut bad = bytes.clone();
            bad[pos] ^= flip;
            if let Ok((_, decoded)) = decode_descs(&bad) {
                assert!(decoded.iter().all(|d| d.end().is_some()));
            }
        }
    }
}

#[test]
fn wrapping_descriptor_is_refused() {
    let bytes = encode_descs(
        MemKind::Dram,
        &[Desc::new(1, 1, 0), Desc::new(u64::MAX, 1, 0)],
    )
    .unwrap();
    invalid_metadata(decode_descs(&bytes), &["descriptor #1", "wraps"]);
}

/// The valid encodings the mutation test and the fuzzer start from, by seed file name.
fn valid_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut partial = MdWriter::new("decode-3", 0xdead_beef);
    partial.partial();
    let ucx = partial.backend("UCX", Some(&[0x5a; 64]));
    partial.region(
        ucx,
        MemKind::Dram,
        Desc::new(0x7f00_0000_0000, 1 << 21, 0),
        &[1; 40],
    );
    let mut empty = MdWriter::new("idle", 1);
    empty.backend("LOOPBACK", Some(b"pid:1:7"));
    let mut wide = MdWriter::new("wide", 9);
    let backends: Vec<u8> = ["LOOPBACK", "UCX", "POSIX", "GDS"]
        .iter()
        .map(|name| wide.backend(name, Some(name.as_bytes())))
        .collect();
    for i in 0..32u64 {
        let backend = backends[i as usize % backends.len()];
        let kind = MemKind::from_u8((i % 5) as u8).unwrap();
        wide.region(
            backend,
            kind,
            Desc::new(i << 16, 0x1000 + i, i % 3),
            &[i as u8; 3],
        );
    }
    // Equal-sized blocks on one device sharing one rkey, with a run of other rkeys in
    // the middle: one length, one device and three md entries on the wire.
    let mut shared = MdWriter::new("kv-cache", 4);
    let ucx = shared.backend("UCX", Some(&[0x33; 16]));
    for i in 0..24u64 {
        let md: &[u8] = if (8..12).contains(&i) {
            &[7; 20]
        } else {
            &[9; 27]
        };
        shared.region(
            ucx,
            MemKind::Dram,
            Desc::new(0x10_0000 + i * 0x2000, 0x1000, 0),
            md,
        );
    }
    let descs: Vec<Desc> = (0..8).map(|i| Desc::new(i * 4096, 4096, i % 2)).collect();
    vec![
        ("valid-shared-md", shared.finish().unwrap()),
        ("valid-full", sample_blob()),
        ("valid-partial", partial.finish().unwrap()),
        ("valid-no-regions", empty.finish().unwrap()),
        ("valid-wide", wide.finish().unwrap()),
        (
            "valid-descs-dram",
            encode_descs(MemKind::Dram, &descs).unwrap(),
        ),
        (
            "valid-descs-empty",
            encode_descs(MemKind::File, &[]).unwrap(),
        ),
    ]
}

fn seed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/peer_md")
}

/// The committed seeds exist and still parse: a change of the wire format that makes
/// them invalid fails here. `FERRY_BLESS_SEEDS=1` rewrites them from the encoder.
#[test]
fn committed_fuzz_seeds_are_valid_encodings() {
    mutate::check_committed_seeds(&seed_dir(), &valid_seeds(), |name, committed| {
        let parsed = if name.starts_with("valid-descs") {
            decode_descs(committed).map(drop)
        } else {
            PeerMd::from_bytes(committed).map(|md| exercise(&md))
        };
        parsed.is_ok()
    });
}

/// Every seed (generated and committed, fuzzer regressions included) and thousands of
/// mutations of them — bit flips, truncations, inflated length fields, splices — never
/// panic, and every refusal is `InvalidMetadata` with a reason.
#[test]
fn mutated_seed_corpus_gets_typed_errors() {
    let mut seeds: Vec<Vec<u8>> = valid_seeds().into_iter().map(|(_, b)| b).collect();
    seeds.extend(mutate::seed_files(&seed_dir()));
    let mutants = mutate::mutants(&seeds, 4000, 0x5eed_0001);
    let typed = |result: Result<(), Error>| match result {
        Ok(()) => true,
        Err(Error::InvalidMetadata { reason }) => {
            assert!(!reason.is_empty(), "empty reason");
            false
        }
        Err(other) => panic!("refused with an untyped error: {other:?}"),
    };
    let tally = mutate::check("peer_md", &mutants, |bytes| {
        let md = typed(PeerMd::from_bytes(bytes).map(|md| {
            assert_eq!(md.as_bytes(), bytes);
            exercise(&md);
        }));
        let descs = typed(decode_descs(bytes).map(|(_, descs)| {
            assert!(
                descs.iter().all(|d| d.end().is_some()),
                "wrapping descriptor"
            );
        }));
        md || descs
    });
    eprintln!("{tally:?}");
    // Most mutations are refused; some (in addresses, names, public bytes) stay valid.
    assert!(
        tally.total > 4000 && tally.accepted > seeds.len(),
        "{tally:?}"
    );
    assert!(tally.refused > tally.total / 2, "{tally:?}");
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = PeerMd::from_bytes(&bytes);
        let _ = decode_descs(&bytes);
    }

    /// Random bytes behind a valid header reach the archive checks.
    #[test]
    fn random_payload_behind_valid_header_never_panics(tail in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.extend_from_slice(&0u16.to_le_bytes());
        bytes.extend_from_slice(&tail);
        if let Ok(md) = PeerMd::from_bytes(&bytes) {
            exercise(&md);
        }
        bytes[..4].copy_from_slice(&DESCS_MAGIC);
        let _ = decode_descs(&bytes);
    }

    #[test]
    fn descriptor_lists_round_trip(
        kind in 0u8..5,
        raw in proptest::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 0..200),
        misalign in 0usize..8,
    ) {
        let kind = MemKind::from_u8(kind).unwrap();
        let descs: Vec<Desc> = raw
            .into_iter()
            .map(|(addr, len, dev)| Desc::new(addr, len.min(u64::MAX - addr), dev))
            .collect();
        let bytes = encode_descs(kind, &descs).unwrap();
        prop_assert_eq!(decode_descs(&bytes).unwrap(), (kind, descs.clone()));
        // Bytes at any alignment decode the same.
        let mut shifted = vec![0u8; misalign];
        shifted.extend_from_slice(&bytes);
        prop_assert_eq!(decode_descs(&shifted[misalign..]).unwrap(), (kind, descs));
    }
}
