//! Hand-built archives that break one semantic invariant each: bytecheck accepts them,
//! `PeerMd::from_bytes` must refuse them with a reason naming the broken invariant.

use ferry_storage::Error;

use crate::header::{self, Format};
use crate::wire::{WireBackend, WireDescs, WireMd, WireSection};
use crate::{decode_descs, PeerMd};

fn section(backend: u8, kind: u8, regions: &[(u64, u64, u64)]) -> WireSection {
    let mut md_offsets = vec![0];
    let mut md_bytes = Vec::new();
    for (i, _) in regions.iter().enumerate() {
        md_bytes.extend_from_slice(&[i as u8; 3]);
        md_offsets.push(md_bytes.len() as u32);
    }
    WireSection {
        backend,
        kind,
        addrs: regions.iter().map(|r| r.0).collect(),
        lens: regions.iter().map(|r| r.1).collect(),
        devs: regions.iter().map(|r| r.2).collect(),
        md_offsets,
        md_refs: Vec::new(),
        md_bytes,
    }
}

fn valid() -> WireMd {
    WireMd {
        agent: "prefill-0".into(),
        generation: 7,
        backends: vec![
            WireBackend {
                name: "UCX".into(),
                conn_info: Some(vec![1, 2, 3]),
            },
            WireBackend {
                name: "POSIX".into(),
                conn_info: None,
            },
        ],
        sections: vec![
            section(0, 0, &[(0x1000, 0x100, 0), (0x1100, 0x10, 0), (0x0, 8, 1)]),
            section(0, 1, &[(0x2000, 0x100, 0)]),
            section(1, 2, &[(0, 4096, 3)]),
        ],
    }
}

fn blob(md: &WireMd, flags: u16) -> Vec<u8> {
    let out = header::encode(Format::Metadata, flags).to_vec();
    rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(md, out).expect("serialize")
}

#[track_caller]
fn refused(md: WireMd, words: &[&str]) {
    match PeerMd::from_bytes(&blob(&md, 0)) {
        Err(Error::InvalidMetadata { reason }) => {
            for word in words {
                assert!(
                    reason.contains(word),
                    "reason {reason:?} does not mention {word:?}"
                );
            }
        }
        other => panic!("expected InvalidMetadata mentioning {words:?}, got {other:?}"),
    }
}

#[test]
fn hand_built_valid_archive_loads() {
    let md = PeerMd::from_bytes(&blob(&valid(), 0)).expect("valid");
    assert_eq!(md.agent(), "prefill-0");
    assert_eq!(md.region_count(), 5);
    assert_eq!(md.backend(1), Some(("POSIX", None)));
    let regions: Vec<_> = md.regions().collect();
    assert_eq!(regions.len(), 5);
    assert_eq!(regions[4].public_md, &[0, 0, 0]);
}

#[test]
fn empty_agent_is_refused() {
    let mut md = valid();
    md.agent.clear();
    refused(md, &["agent name is empty"]);
}

#[test]
fn empty_and_duplicate_backend_names_are_refused() {
    let mut md = valid();
    md.backends[1].name.clear();
    refused(md, &["backend #1", "empty name"]);
    let mut md = valid();
    md.backends[1].name = "UCX".into();
    refused(md, &["#0 and #1", "UCX"]);
}

#[test]
fn too_many_backends_are_refused() {
    let mut md = valid();
    md.backends = (0..257)
        .map(|i| WireBackend {
            name: format!("B{i}"),
            conn_info: None,
        })
        .collect();
    refused(md, &["257 backends"]);
}

#[test]
fn bad_backend_index_and_kind_are_refused() {
    let mut md = valid();
    md.sections[2].backend = 2;
    refused(md, &["section #2", "backend #2", "only 2 backends"]);
    let mut md = valid();
    md.sections[2].kind = 5;
    refused(md, &["section #2", "memory kind byte 5"]);
}

#[test]
fn duplicate_and_unordered_sections_are_refused() {
    let mut md = valid();
    md.sections[1].kind = 0;
    refused(md, &["duplicate section", "UCX", "DRAM"]);
    let mut md = valid();
    md.sections.swap(0, 1);
    refused(md, &["section #1", "out of order"]);
}

#[test]
fn empty_section_is_refused() {
    let mut md = valid();
    md.sections[1] = section(0, 1, &[]);
    refused(md, &["section #1", "no regions"]);
}

#[test]
fn unequal_columns_are_refused() {
    let mut md = valid();
    md.sections[0].lens.push(1);
    refused(md, &["section #0", "column lengths differ"]);
    let mut md = valid();
    md.sections[0].devs.push(0);
    refused(md, &["column lengths differ"]);
    let mut md = valid();
    md.sections[0].md_offsets.pop();
    refused(md, &["column lengths differ"]);
}

#[test]
fn bad_md_offsets_are_refused() {
    let mut md = valid();
    md.sections[0].md_offsets[0] = 1;
    refused(md, &["first md offset is 1"]);
    let mut md = valid();
    md.sections[0].md_offsets[1] = 7;
    refused(md, &["md offsets decrease at region #1"]);
    let mut md = valid();
    md.sections[0].md_bytes.push(0);
    refused(md, &["last md offset is 9", "10 bytes"]);
    let mut md = valid();
    *md.sections[0].md_offsets.last_mut().unwrap() = 1000;
    refused(md, &["last md offset is 1000"]);
}

#[test]
fn unsorted_overlapping_empty_and_wrapping_regions_are_refused() {
    let mut md = valid();
    md.sections[0] = section(0, 0, &[(0x1100, 0x10, 0), (0x1000, 0x100, 0)]);
    refused(md, &["region #1", "not sorted"]);
    let mut md = valid();
    md.sections[0] = section(0, 0, &[(0, 8, 1), (0x1000, 0x100, 0)]);
    refused(md, &["region #1", "not sorted"]);
    let mut md = valid();
    md.sections[0] = section(0, 0, &[(0x1000, 0x101, 0), (0x1100, 0x10, 0)]);
    refused(md, &["region #1", "overlaps region #0"]);
    let mut md = valid();
    md.sections[0] = section(0, 0, &[(0x1000, 0x10, 0), (0x1000, 0x10, 0)]);
    refused(md, &["region #1", "not sorted"]);
    let mut md = valid();
    md.sections[0] = section(0, 0, &[(0x1000, 0, 0)]);
    refused(md, &["region #0", "empty or wraps"]);
    let mut md = valid();
    md.sections[0] = section(0, 0, &[(u64::MAX, 2, 0)]);
    refused(md, &["region #0", "empty or wraps"]);
}

/// Section `section(..)` builds with one shared length and one shared device (the
/// columns the validator checks in one pass over the addresses).
fn uniform_section(len: u64, dev: u64, addrs: &[u64]) -> WireSection {
    let regions: Vec<(u64, u64, u64)> = addrs.iter().map(|&a| (a, len, dev)).collect();
    let mut section = section(0, 0, &regions);
    section.lens = vec![len];
    section.devs = vec![dev];
    section
}

#[test]
fn uniform_sections_name_the_bad_region() {
    let mut md = valid();
    md.sections[0] = uniform_section(0x100, 0, &[0x1000, 0x1100, 0x1200]);
    PeerMd::from_bytes(&blob(&md, 0)).expect("apart and sorted: valid");
    let mut md = valid();
    md.sections[0] = uniform_section(0x100, 0, &[0x1000, 0x1100, 0x1000]);
    refused(md, &["region #2", "not sorted"]);
    let mut md = valid();
    md.sections[0] = uniform_section(0x100, 3, &[0x1000, 0x1100, 0x1100]);
    refused(md, &["region #2", "not sorted"]);
    let mut md = valid();
    md.sections[0] = uniform_section(0x100, 0, &[0x1000, 0x1100, 0x11ff]);
    refused(md, &["region #2", "overlaps region #1"]);
    let mut md = valid();
    md.sections[0] = uniform_section(0, 0, &[0x1000, 0x2000]);
    refused(md, &["region #0", "empty or wraps"]);
    let mut md = valid();
    md.sections[0] = uniform_section(0x100, 0, &[0x1000, u64::MAX - 0xfe]);
    refused(md, &["region #1", "empty or wraps"]);
}

#[test]
fn descriptor_list_columns_must_agree() {
    let wire = WireDescs {
        kind: 0,
        addrs: vec![1, 2],
        lens: vec![1],
        devs: vec![0, 0],
    };
    let out = header::encode(Format::Descs, 0).to_vec();
    let bytes = rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(&wire, out).unwrap();
    let err = decode_descs(&bytes).unwrap_err();
    assert!(err.to_string().contains("column lengths differ"), "{err}");

    let wire = WireDescs {
        kind: 9,
        addrs: vec![],
        lens: vec![],
        devs: vec![],
    };
    let out = header::encode(Format::Descs, 0).to_vec();
    let bytes = rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(&wire, out).unwrap();
    let err = decode_descs(&bytes).unwrap_err();
    assert!(err.to_string().contains("memory kind byte 9"), "{err}");
}
