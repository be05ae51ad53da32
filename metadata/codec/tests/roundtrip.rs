//! Writer → bytes → `PeerMd` round trips, checked against a linear-scan model.

use ferry_metadata::{MdWriter, PeerMd, RegionView};
use ferry_storage::{Desc, Error, MemKind};
use proptest::prelude::*;

const NAMES: [&str; 4] = ["LOOPBACK", "UCX", "POSIX", "GDS"];

/// A random region: (backend, kind byte, dev, addr, len, public md).
type RawRegion = (u8, u8, u64, u64, u64, Vec<u8>);

/// One region the model accepted: (backend, kind, desc, public md).
type ModelRegion = (u8, MemKind, Desc, Vec<u8>);

/// Build a writer from random inputs, keeping only regions that do not overlap an
/// accepted one of the same section (the model).
fn build(backends: &[Option<Vec<u8>>], raw: &[RawRegion]) -> (MdWriter, Vec<ModelRegion>) {
    build_with(MdWriter::new("agent-under-test", 42), backends, raw)
}

/// [`build`] on a given (new) writer.
fn build_with(
    mut writer: MdWriter,
    backends: &[Option<Vec<u8>>],
    raw: &[RawRegion],
) -> (MdWriter, Vec<ModelRegion>) {
    for (i, conn) in backends.iter().enumerate() {
        assert_eq!(writer.backend(NAMES[i], conn.as_deref()), i as u8);
    }
    let mut accepted: Vec<ModelRegion> = Vec::new();
    for (backend, kind, dev, addr, len, md) in raw {
        let backend = backend % backends.len() as u8;
        let kind = MemKind::from_u8(kind % 5).unwrap();
        let desc = Desc::new(*addr, *len, *dev);
        let overlaps = accepted.iter().any(|(b, k, d, _)| {
            *b == backend
                && *k == kind
                && d.dev == *dev
                && d.addr < addr + len
                && *addr < d.addr + d.len
        });
        if !overlaps {
            writer.region(backend, kind, desc, md);
            accepted.push((backend, kind, desc, md.clone()));
        }
    }
    (writer, accepted)
}

fn covers(region: &RegionView<'_>, backend: u8, kind: MemKind, q: Desc) -> bool {
    region.backend == backend
        && region.kind == kind
        && region.desc.dev == q.dev
        && q.len > 0
        && region.desc.addr <= q.addr
        && q.addr
            .checked_add(q.len)
            .is_some_and(|end| end <= region.desc.addr + region.desc.len)
}

fn raw_regions() -> impl Strategy<Value = Vec<RawRegion>> {
    proptest::collection::vec(
        (
            0u8..4,
            0u8..3,
            // Biased towards one device, one length and one shared md, so sections
            // with a single length, a single device and shared md entries occur.
            prop_oneof![Just(0u64), 0u64..3],
            0u64..20_000,
            prop_oneof![Just(64u64), 1u64..600],
            prop_oneof![
                Just(vec![7u8; 5]),
                proptest::collection::vec(any::<u8>(), 0..12)
            ],
        ),
        0..80,
    )
}

proptest! {
    #[test]
    fn round_trip_find_and_exact_agree_with_linear_scan(
        backends in proptest::collection::vec(proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)), 1..=4),
        raw in raw_regions(),
        queries in proptest::collection::vec((0u8..5, 0u8..5, 0u64..4, 0u64..21_000, 0u64..700), 0..100),
        partial in any::<bool>(),
    ) {
        let (mut writer, accepted) = build(&backends, &raw);
        if partial {
            writer.partial();
        }
        let bytes = writer.finish().expect("non-overlapping regions encode");
        let md = PeerMd::from_bytes(&bytes).expect("writer output validates");

        prop_assert_eq!(md.agent(), "agent-under-test");
        prop_assert_eq!(md.generation(), 42);
        prop_assert_eq!(md.is_partial(), partial);
        prop_assert_eq!(md.as_bytes(), &bytes[..]);
        prop_assert_eq!(md.backend_count(), backends.len());
        for (i, conn) in backends.iter().enumerate() {
            prop_assert_eq!(md.backend(i as u8), Some((NAMES[i], conn.as_deref())));
            prop_assert_eq!(md.backend_index(NAMES[i]), Some(i as u8));
        }
        prop_assert_eq!(md.backend(backends.len() as u8), None);
        prop_assert_eq!(md.backend_index("NOPE"), None);
        prop_assert_eq!(md.region_count(), accepted.len());

        // Global indices: `regions()` and `region(i)` agree, sections ascend by
        // (backend, kind), regions within a section by (dev, addr).
        let all: Vec<RegionView<'_>> = md.regions().collect();
        prop_assert_eq!(all.len(), accepted.len());
        for (i, view) in all.iter().enumerate() {
            prop_assert_eq!(md.region(i as u32), Some(*view));
        }
        prop_assert_eq!(md.region(all.len() as u32), None);
        prop_assert_eq!(md.region(u32::MAX), None);
        for pair in all.windows(2) {
            let key = |v: &RegionView<'_>| (v.backend, v.kind, v.desc.dev, v.desc.addr);
            prop_assert!(key(&pair[0]) < key(&pair[1]));
        }

        // Every accepted region is found by `find` and `exact`, with its metadata.
        for (backend, kind, desc, public_md) in &accepted {
            let index = md.exact(*backend, *kind, *desc);
            prop_assert!(index.is_some());
            prop_assert_eq!(md.find(*backend, *kind, *desc), index);
            let view = md.region(index.unwrap()).unwrap();
            prop_assert_eq!(view, RegionView { backend: *backend, kind: *kind, desc: *desc, public_md });
            // Ranges straddling the region's ends are not covered by it (neighbours
            // cannot cover them either: they would overlap).
            for q in [
                Desc::new(desc.addr + desc.len - 1, 2, desc.dev),
                Desc::new(desc.addr.wrapping_sub(1), 2, desc.dev),
                Desc::new(desc.addr, desc.len + 1, desc.dev),
            ] {
                let want = all.iter().position(|r| covers(r, *backend, *kind, q)).map(|i| i as u32);
                prop_assert_eq!(md.find(*backend, *kind, q), want);
            }
            // A sub-range is found; a wrong device or kind finds the model's answer.
            prop_assert_eq!(md.find(*backend, *kind, Desc::new(desc.addr + desc.len / 2, 1, desc.dev)), index);
            let wrong_dev = Desc::new(desc.addr, desc.len, desc.dev + 7);
            prop_assert_eq!(md.find(*backend, *kind, wrong_dev), None);
            prop_assert_eq!(md.exact(*backend, *kind, wrong_dev), None);
            let other_kind = MemKind::from_u8((*kind as u8 + 3) % 5).unwrap();
            let want = all.iter().position(|r| covers(r, *backend, other_kind, *desc)).map(|i| i as u32);
            prop_assert_eq!(md.find(*backend, other_kind, *desc), want);
            prop_assert_eq!(md.find(*backend, *kind, Desc::new(desc.addr, 0, desc.dev)), None);
            if desc.len > 1 {
                prop_assert_eq!(md.exact(*backend, *kind, Desc::new(desc.addr, desc.len - 1, desc.dev)), None);
            }
        }

        // Random queries agree with a linear scan.
        for (backend, kind, dev, addr, len) in queries {
            let kind = MemKind::from_u8(kind).unwrap();
            let q = Desc::new(addr, len, dev);
            let want = all.iter().position(|r| covers(r, backend, kind, q)).map(|i| i as u32);
            prop_assert_eq!(md.find(backend, kind, q), want);
            let want_exact = all.iter().position(|r| r.backend == backend && r.kind == kind && r.desc == q).map(|i| i as u32);
            prop_assert_eq!(md.exact(backend, kind, q), want_exact);
            // The hinted lookup gives the same region (and its range) whatever the
            // hint: the region before the answer, a wrong one, none.
            let bounds = want.map(|i| (i, all[i as usize].desc));
            let hints = [want.map_or(0, |i| i.wrapping_sub(1)), u32::MAX, addr as u32, 0];
            for last in hints {
                prop_assert_eq!(md.find_bounds_after(backend, kind, q, last), bounds);
            }
        }
        // A walk over every region in order, each hinted by the one before.
        let mut last = u32::MAX;
        for (i, view) in all.iter().enumerate() {
            let found = md.find_bounds_after(view.backend, view.kind, view.desc, last);
            prop_assert_eq!(found, Some((i as u32, view.desc)));
            last = i as u32;
        }
    }

    /// The encoding is canonical: the same content in any call order gives the same bytes.
    #[test]
    fn encoding_does_not_depend_on_call_order(raw in raw_regions(), seed in any::<u64>()) {
        let backends = vec![Some(vec![1, 2, 3]), None];
        let (writer, accepted) = build(&backends, &raw);
        let bytes = writer.finish().unwrap();
        let mut shuffled = accepted.clone();
        // A cheap deterministic shuffle.
        let mut state = seed | 1;
        for i in (1..shuffled.len()).rev() {
            state ^= state << 13; state ^= state >> 7; state ^= state << 17;
            shuffled.swap(i, (state % (i as u64 + 1)) as usize);
        }
        let mut again = MdWriter::new("agent-under-test", 42);
        again.backend(NAMES[0], Some(&[1, 2, 3]));
        again.backend(NAMES[1], None);
        for (backend, kind, desc, md) in &shuffled {
            again.region(*backend, *kind, *desc, md);
        }
        prop_assert_eq!(again.finish().unwrap(), bytes);
    }

    /// A writer built on an earlier writer's buffers (`with_scratch`) encodes exactly
    /// what a fresh one does, whatever the earlier one held (other sections, more or
    /// fewer regions, other metadata).
    #[test]
    fn recycled_writer_encodes_like_a_fresh_one(
        first in raw_regions(),
        second in raw_regions(),
        third in raw_regions(),
    ) {
        let backends = vec![Some(vec![1, 2, 3]), None];
        let mut scratch = ferry_metadata::MdScratch::default();
        for raw in [&first, &second, &third] {
            let (fresh, _) = build(&backends, raw);
            let want = fresh.finish().unwrap();
            let reused = MdWriter::with_scratch("agent-under-test", 42, scratch);
            let (reused, _) = build_with(reused, &backends, raw);
            let (got, next) = reused.finish_recycling();
            prop_assert_eq!(got.unwrap(), want);
            scratch = next;
        }
    }
}

#[test]
fn peer_md_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<PeerMd>();
}

#[test]
fn empty_metadata_round_trips() {
    let bytes = MdWriter::new("lonely", 0).finish().unwrap();
    let md = PeerMd::from_bytes(&bytes).unwrap();
    assert_eq!(md.agent(), "lonely");
    assert_eq!(md.region_count(), 0);
    assert_eq!(md.backend_count(), 0);
    assert_eq!(md.regions().count(), 0);
    assert_eq!(md.find(0, MemKind::Dram, Desc::new(0, 1, 0)), None);
    assert_eq!(md.region(0), None);
}

#[track_caller]
fn invalid_param(result: Result<Vec<u8>, Error>, words: &[&str]) {
    match result {
        Err(Error::InvalidParam { subject, reason }) => {
            let text = format!("{subject}: {reason}");
            for word in words {
                assert!(text.contains(word), "{text:?} does not mention {word:?}");
            }
        }
        other => panic!("expected InvalidParam mentioning {words:?}, got {other:?}"),
    }
}

#[test]
fn writer_refuses_bad_input() {
    invalid_param(MdWriter::new("", 1).finish(), &["agent name is empty"]);

    let mut w = MdWriter::new("a", 1);
    let ucx = w.backend("UCX", None);
    w.region(ucx, MemKind::Dram, Desc::new(0x1000, 0x100, 0), b"x");
    w.region(ucx, MemKind::Vram, Desc::new(0x1000, 0x100, 0), b"x"); // other section: fine
    w.region(ucx, MemKind::Dram, Desc::new(0x1000, 0x100, 1), b"x"); // other device: fine
    w.region(ucx, MemKind::Dram, Desc::new(0x10ff, 0x10, 0), b"y");
    invalid_param(w.finish(), &["descriptor #3", "overlaps region #0", "DRAM"]);

    let mut w = MdWriter::new("a", 1);
    let ucx = w.backend("UCX", None);
    w.region(ucx, MemKind::Dram, Desc::new(0x1000, 0x100, 0), b"x");
    w.region(ucx, MemKind::Dram, Desc::new(0x1000, 0x100, 0), b"x");
    invalid_param(w.finish(), &["overlaps region #0"]);

    let mut w = MdWriter::new("a", 1);
    w.backend("", None);
    invalid_param(w.finish(), &["empty name"]);

    // One length, one device and one md for all (the writer's one-pass check): an
    // overlap or a repeat is still found and named by call order.
    let mut w = MdWriter::new("a", 1);
    let ucx = w.backend("UCX", None);
    w.region(ucx, MemKind::Dram, Desc::new(0x1000, 0x100, 0), b"rk");
    w.region(ucx, MemKind::Dram, Desc::new(0x1100, 0x100, 0), b"rk");
    w.region(ucx, MemKind::Dram, Desc::new(0x11ff, 0x100, 0), b"rk");
    invalid_param(w.finish(), &["descriptor #2", "overlaps region #1"]);
    let mut w = MdWriter::new("a", 1);
    let ucx = w.backend("UCX", None);
    w.region(ucx, MemKind::Dram, Desc::new(0x2000, 0x100, 0), b"rk");
    w.region(ucx, MemKind::Dram, Desc::new(0x1000, 0x100, 0), b"rk");
    w.region(ucx, MemKind::Dram, Desc::new(0x2000, 0x100, 0), b"rk");
    invalid_param(w.finish(), &["descriptor #2", "overlaps region #0"]);

    let mut w = MdWriter::new("a", 1);
    w.backend("UCX", Some(b"one"));
    assert_eq!(w.backend("UCX", Some(b"one")), 0);
    assert_eq!(w.backend("POSIX", None), 1);
    assert_eq!(w.backend("UCX", Some(b"two")), 0);
    invalid_param(w.finish(), &["UCX", "different connection info"]);

    let mut w = MdWriter::new("a", 1);
    w.backend("UCX", None);
    w.region(3, MemKind::Dram, Desc::new(1, 1, 0), b"");
    invalid_param(
        w.finish(),
        &["descriptor #0", "backend #3", "only 1 backends"],
    );

    let mut w = MdWriter::new("a", 1);
    w.backend("UCX", None);
    w.region(0, MemKind::Dram, Desc::new(1, 1, 0), b"");
    w.region(0, MemKind::Dram, Desc::new(8, 0, 0), b"");
    invalid_param(w.finish(), &["descriptor #1", "empty"]);

    let mut w = MdWriter::new("a", 1);
    w.backend("UCX", None);
    w.region(0, MemKind::Dram, Desc::new(u64::MAX, 2, 0), b"");
    invalid_param(w.finish(), &["wraps"]);

    let mut w = MdWriter::new("a", 1);
    for i in 0..256 {
        assert_eq!(w.backend(&format!("B{i}"), None), i as u8);
    }
    w.backend("one too many", None);
    invalid_param(w.finish(), &["more than 256 backends"]);
}

#[test]
fn region_at_top_of_address_space_is_found() {
    let mut w = MdWriter::new("a", 1);
    w.backend("UCX", None);
    let top = Desc::new(u64::MAX - 16, 16, u64::MAX);
    w.region(0, MemKind::Object, top, b"top");
    let md = PeerMd::from_bytes(&w.finish().unwrap()).unwrap();
    assert_eq!(md.find(0, MemKind::Object, top), Some(0));
    assert_eq!(
        md.find(0, MemKind::Object, Desc::new(u64::MAX - 1, 1, u64::MAX)),
        Some(0)
    );
    assert_eq!(
        md.find(0, MemKind::Object, Desc::new(u64::MAX - 1, 2, u64::MAX)),
        None
    );
    assert_eq!(md.exact(0, MemKind::Object, top), Some(0));
    assert_eq!(md.region(0).unwrap().public_md, b"top");
}

#[test]
fn sorted_and_reversed_input_encode_identically() {
    let regions: Vec<(Desc, Vec<u8>)> = (0..1000u64)
        .map(|i| {
            (
                Desc::new(0x10_0000 + (i / 2) * 0x2000, 0x1000, i % 2),
                vec![i as u8; (i % 7) as usize],
            )
        })
        .collect();
    let mut sorted = regions.clone();
    sorted.sort_by_key(|(d, _)| (d.dev, d.addr));
    let encode = |input: &[(Desc, Vec<u8>)]| {
        let mut w = MdWriter::new("a", 9);
        let b = w.backend("UCX", Some(b"addr"));
        for (desc, md) in input {
            w.region(b, MemKind::Dram, *desc, md);
        }
        w.finish().unwrap()
    };
    let from_sorted = encode(&sorted);
    let reversed: Vec<_> = sorted.iter().rev().cloned().collect();
    assert_eq!(encode(&reversed), from_sorted);
    assert_eq!(encode(&regions), from_sorted);
    let md = PeerMd::from_bytes(&from_sorted).unwrap();
    for (i, (desc, public_md)) in sorted.iter().enumerate() {
        let view = md.region(i as u32).unwrap();
        assert_eq!((view.desc, view.public_md), (*desc, &public_md[..]));
    }
}

#[test]
fn reserve_is_only_a_hint() {
    let mut w = MdWriter::new("a", 1);
    let ucx = w.backend("UCX", None);
    w.reserve(ucx, MemKind::Vram, 100, 1000); // never filled
    w.reserve(7, MemKind::Dram, 100, 1000); // unknown backend: ignored
    w.reserve(ucx, MemKind::Dram, 2, 3);
    w.region(ucx, MemKind::Dram, Desc::new(0x2000, 16, 0), b"b");
    w.region(ucx, MemKind::Dram, Desc::new(0x1000, 16, 0), b"a");
    w.region(
        ucx,
        MemKind::Dram,
        Desc::new(0x3000, 16, 0),
        b"more than reserved",
    );
    let md = PeerMd::from_bytes(&w.finish().unwrap()).unwrap();
    assert_eq!(md.region_count(), 3);
    assert_eq!(md.find(ucx, MemKind::Vram, Desc::new(0x1000, 1, 0)), None);
    let mds: Vec<&[u8]> = md.regions().map(|r| r.public_md).collect();
    assert_eq!(mds, [&b"a"[..], b"b", b"more than reserved"]);
}

#[test]
fn shared_rkeys_and_equal_lengths_are_stored_once_and_read_back() {
    let rkey = [0x46u8, 0x52, 0x4b, 0x31, 3, 0, 0, 0, 1, 2, 3];
    let encode = |distinct: bool| {
        let mut writer = MdWriter::new("kv", 1);
        let ucx = writer.backend("UCX", Some(b"addr"));
        for i in 0..1000u64 {
            let mut md = rkey.to_vec();
            if distinct {
                md.extend_from_slice(&i.to_le_bytes());
            }
            writer.region(
                ucx,
                MemKind::Dram,
                Desc::new(0x1000_0000 + i * 8192, 4096, 0),
                &md,
            );
        }
        writer.finish().unwrap()
    };
    let (shared, distinct) = (encode(false), encode(true));
    // Addresses alone are 8 bytes a region; lengths, devices and the rkey add nothing.
    assert!(shared.len() < 1000 * 8 + 200, "{} bytes", shared.len());
    assert!(
        distinct.len() > 1000 * (8 + 4 + 19),
        "{} bytes",
        distinct.len()
    );
    let md = PeerMd::from_bytes(&shared).unwrap();
    assert_eq!(md.region_count(), 1000);
    for (i, region) in md.regions().enumerate() {
        let i = i as u64;
        assert_eq!(region.desc, Desc::new(0x1000_0000 + i * 8192, 4096, 0));
        assert_eq!(region.public_md, &rkey);
    }
    let hit = md.find(
        0,
        MemKind::Dram,
        Desc::new(0x1000_0000 + 7 * 8192 + 100, 64, 0),
    );
    assert_eq!(hit, Some(7));
    assert_eq!(
        md.find(
            0,
            MemKind::Dram,
            Desc::new(0x1000_0000 + 7 * 8192 + 4000, 200, 0)
        ),
        None
    );
    assert_eq!(
        md.find(0, MemKind::Dram, Desc::new(0x1000_0000 + 100, 64, 1)),
        None
    );
    assert_eq!(
        md.exact(0, MemKind::Dram, Desc::new(0x1000_0000 + 8192, 4096, 0)),
        Some(1)
    );
}
