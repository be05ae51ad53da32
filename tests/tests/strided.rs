//! Strided descriptor lists (`Agent::prep_strided`, `CommandBuffer::prep_strided`)
//! against the plain lists of the same descriptors, through two loopback agents: the
//! same prepared length, the same merged ranges, the same bytes in the destination
//! (byte for byte), with and without index lists; refusals name the run.

use ferry::{CommandBuffer, Desc, Error, MemKind, Op, PrepId, StridedDesc, XferStatus};
use ferry_tests::{pair, Buffer, Pair, Rng};

/// A KV-cache-like layout: `layers` layers of `blocks` blocks of `block` bytes, layer
/// `l` at `l * layer_stride`, block `b` of it at `b * block_stride` from there.
#[derive(Clone, Copy)]
struct Layout {
    layers: u64,
    blocks: u64,
    block: u64,
    block_stride: u64,
    layer_stride: u64,
}

impl Layout {
    fn bytes(&self) -> usize {
        (self.layers * self.layer_stride) as usize
    }
    fn runs(&self, buffer: &Buffer) -> Vec<StridedDesc> {
        let base = buffer.whole().addr;
        (0..self.layers)
            .map(|l| {
                StridedDesc::new(
                    base + l * self.layer_stride,
                    self.blocks,
                    self.block_stride,
                    self.block,
                    0,
                )
            })
            .collect()
    }
    fn plain(&self, buffer: &Buffer) -> Vec<Desc> {
        self.runs(buffer).iter().flat_map(|r| r.descs()).collect()
    }
}

/// Run one WRITE of `local` → `remote` (optional index lists) and wait for it.
fn write(p: &Pair, local: PrepId, remote: PrepId, idx: (&[u32], &[u32])) -> usize {
    let x =
        p.a.make(Op::Write, local, idx.0, remote, idx.1, None)
            .unwrap();
    let ranges = p.a.xfer_ranges(x).unwrap();
    let mut status = p.a.post(x).unwrap();
    while status != XferStatus::Done {
        p.b.progress();
        status = p.a.check(x).unwrap();
    }
    p.a.release(x).unwrap();
    ranges
}

/// The destination after writing `src`'s layout into `dst`'s, once with strided lists
/// and once with plain ones (into two fresh destinations), compared byte for byte.
fn check(local: Layout, remote: Layout, seed: u64, indexed: bool) {
    let mut rng = Rng::new(seed);
    let src = Buffer::random(local.bytes(), &mut rng);
    let dst_strided = Buffer::zeroed(remote.bytes());
    let dst_plain = Buffer::zeroed(remote.bytes());
    let n = (local.layers * local.blocks) as u32;
    let mut idx_local: Vec<u32> = Vec::new();
    let mut idx_remote: Vec<u32> = Vec::new();
    if indexed {
        // Every other descriptor, the remote side reversed.
        idx_local = (0..n).step_by(2).collect();
        idx_remote = idx_local.iter().rev().copied().collect();
    }
    let mut results = Vec::new();
    for (dst, strided) in [(&dst_strided, true), (&dst_plain, false)] {
        let p = pair(&src, dst);
        let (l, r) = if strided {
            (
                p.a.prep_strided(ferry::Side::Local, MemKind::Dram, &local.runs(&src))
                    .unwrap(),
                p.a.prep_strided(p.b_at_a, MemKind::Dram, &remote.runs(dst))
                    .unwrap(),
            )
        } else {
            (
                p.a.prep(ferry::Side::Local, MemKind::Dram, &local.plain(&src))
                    .unwrap(),
                p.a.prep(p.b_at_a, MemKind::Dram, &remote.plain(dst))
                    .unwrap(),
            )
        };
        let ranges = write(&p, l, r, (&idx_local, &idx_remote));
        results.push(ranges);
    }
    assert_eq!(results[0], results[1], "merged ranges, strided vs plain");
    assert!(
        dst_strided.bytes() == dst_plain.bytes(),
        "destination bytes differ between strided and plain lists"
    );
    assert!(
        dst_plain.bytes().iter().any(|&b| b != 0),
        "something was written"
    );
}

#[test]
fn strided_lists_move_the_same_bytes_as_plain_lists() {
    // Packed blocks on both sides (every layer merges into one range).
    let packed = Layout {
        layers: 8,
        blocks: 64,
        block: 256,
        block_stride: 256,
        layer_stride: 64 * 256,
    };
    check(packed, packed, 1, false);
    check(packed, packed, 2, true);
    // Gaps between blocks and between layers, different strides on the two sides.
    let gapped = Layout {
        layers: 8,
        blocks: 64,
        block: 256,
        block_stride: 384,
        layer_stride: 64 * 384 + 4096,
    };
    check(packed, gapped, 3, false);
    check(gapped, packed, 4, true);
    // One block per run, and a single run.
    let single = Layout {
        layers: 512,
        blocks: 1,
        block: 256,
        block_stride: 0,
        layer_stride: 256,
    };
    check(single, packed, 5, false);
    let one_run = Layout {
        layers: 1,
        blocks: 512,
        block: 256,
        block_stride: 256,
        layer_stride: 512 * 256,
    };
    check(one_run, gapped, 6, true);
}

#[test]
fn a_strided_list_prepares_like_its_plain_list() {
    let layout = Layout {
        layers: 4,
        blocks: 100,
        block: 64,
        block_stride: 128,
        layer_stride: 100 * 128,
    };
    let mut rng = Rng::new(9);
    let src = Buffer::random(layout.bytes(), &mut rng);
    let dst = Buffer::zeroed(layout.bytes());
    let p = pair(&src, &dst);
    // Through a command buffer, both in one flush.
    let mut cmds = CommandBuffer::with_capacity(4);
    let s = cmds.prep_strided(p.b_at_a, MemKind::Dram, &layout.runs(&dst));
    let l = cmds.prep(p.b_at_a, MemKind::Dram, &layout.plain(&dst));
    p.a.flush(&mut cmds);
    let (s, l) = (cmds.created(s).unwrap(), cmds.created(l).unwrap());
    let local =
        p.a.prep(ferry::Side::Local, MemKind::Dram, &layout.plain(&src))
            .unwrap();
    // The same length: the last index is taken by both, one past it refused by both.
    let n = (layout.layers * layout.blocks) as u32;
    for remote in [s, l] {
        let x =
            p.a.make(Op::Write, local, &[n - 1], remote, &[n - 1], None)
                .unwrap();
        p.a.release(x).unwrap();
        assert!(p
            .a
            .make(Op::Write, local, &[n], remote, &[n], None)
            .is_err());
        // The whole list in order: one merged range per layer-sized run or fewer, the
        // same count for both.
        let x = p.a.make(Op::Write, local, &[], remote, &[], None).unwrap();
        let ranges = p.a.xfer_ranges(x).unwrap();
        p.a.release(x).unwrap();
        assert_eq!(ranges, (layout.layers * layout.blocks) as usize);
    }
}

#[test]
fn bad_strided_runs_are_refused_naming_the_run() {
    let src = Buffer::zeroed(1 << 16);
    let dst = Buffer::zeroed(1 << 16);
    let p = pair(&src, &dst);
    let base = src.whole().addr;
    let refused = |runs: &[StridedDesc], words: &[&str]| {
        let e =
            p.a.prep_strided(ferry::Side::Local, MemKind::Dram, runs)
                .unwrap_err();
        let text = e.to_string();
        for w in words {
            assert!(text.contains(w), "{text:?} should say {w:?}");
        }
        e
    };
    let ok = StridedDesc::new(base, 4, 64, 64, 0);
    refused(
        &[ok, StridedDesc::new(base, 0, 64, 64, 0)],
        &["run #1", "count"],
    );
    refused(&[StridedDesc::new(base, 4, 64, 0, 0)], &["run #0", "len"]);
    refused(
        &[StridedDesc::new(base, 3, u64::MAX / 2, 64, 0)],
        &["run #0", "wraps"],
    );
    // Past the registered buffer: not found, as the plain list would be.
    match p.a.prep_strided(
        ferry::Side::Local,
        MemKind::Dram,
        &[StridedDesc::new(base, 2, 1 << 16, 64, 0)],
    ) {
        Err(Error::NotFound { .. }) => {}
        other => panic!("a run leaving the region: {other:?}"),
    }
    assert!(p
        .a
        .prep_strided(ferry::Side::Local, MemKind::Dram, &[ok])
        .is_ok());
}
