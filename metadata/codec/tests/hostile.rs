//! Hostile bytes: garbage, truncations and corruptions never panic; headers give
//! named errors; descriptor lists round trip.

use ferry_metadata::{
    decode_descs, encode_descs, MdWriter, PeerMd, DESCS_MAGIC, FLAG_PARTIAL, MAGIC, VERSION,
};
use ferry_storage::{Desc, Error, MemKind};
use proptest::prelude::*;

fn sample_blob() -> Vec<u8> {
    let mut w = MdWriter::new("prefill-7", 3);
    let ucx = w.backend("UCX", Some(&[9; 20]));
    let posix = w.backend("POSIX", None);
    for i in 0..6u64 {
        w.region(ucx, MemKind::Dram, Desc::new(0x1000 * i, 0x800, i % 2), &[i as u8; 5]);
    }
    w.region(ucx, MemKind::Vram, Desc::new(0, 1 << 20, 1), b"rkey");
    w.region(posix, MemKind::File, Desc::new(0, 4096, 17), b"");
    w.finish().unwrap()
}

/// Use every accessor of a blob that validated, to prove lookups stay in bounds.
fn exercise(md: &PeerMd) {
    let _ = (md.agent(), md.generation(), md.is_partial(), md.as_bytes().len());
    for b in 0..=u8::MAX {
        if let Some((name, _)) = md.backend(b) {
            assert_eq!(md.backend_index(name).is_some(), true);
        }
    }
    let views: Vec<_> = md.regions().collect();
    assert_eq!(views.len(), md.region_count());
    for (i, view) in views.iter().enumerate() {
        assert_eq!(md.region(i as u32), Some(*view));
        let found = md.find(view.backend, view.kind, view.desc).expect("own region");
        assert_eq!(found as usize, i);
        assert_eq!(md.exact(view.backend, view.kind, view.desc), Some(found));
    }
}

#[track_caller]
fn invalid_metadata(result: Result<impl std::fmt::Debug, Error>, words: &[&str]) {
    match result {
        Err(Error::InvalidMetadata { reason }) => {
            for word in words {
                assert!(reason.contains(word), "{reason:?} does not mention {word:?}");
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
            matches!(PeerMd::from_bytes(&blob[..len]), Err(Error::InvalidMetadata { .. })),
            "prefix of {len} bytes accepted"
        );
    }
    invalid_metadata(PeerMd::from_bytes(&blob[..5]), &["5 bytes", "8-byte header"]);
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
    assert!(accepted > 0 && accepted < blob.len() * 6, "accepted {accepted}");
}

#[test]
fn header_errors_are_named() {
    let blob = sample_blob();
    let mut bad = blob.clone();
    bad[0] = b'X';
    invalid_metadata(PeerMd::from_bytes(&bad), &["bad magic", "agent metadata"]);

    let descs = encode_descs(MemKind::Dram, &[Desc::new(1, 2, 3)]).unwrap();
    invalid_metadata(PeerMd::from_bytes(&descs), &["bad magic", "magic of a descriptor list"]);
    invalid_metadata(decode_descs(&blob), &["bad magic", "magic of agent metadata"]);

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
        assert!(decode_descs(&bytes[..len]).is_err(), "prefix of {len} bytes accepted");
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
    let bytes = encode_descs(MemKind::Dram, &[Desc::new(1, 1, 0), Desc::new(u64::MAX, 1, 0)]).unwrap();
    invalid_metadata(decode_descs(&bytes), &["descriptor #1", "wraps"]);
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
