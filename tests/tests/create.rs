//! `create` (one call; where one backend serves both lists, they are resolved and merged
//! in one pass) against `prep` of both lists + `make` + release, the path it short-cuts:
//! the same merged ranges, the same bytes in the destination, the same error for the same
//! bad input. The target registers its buffer as several regions, so descriptors change
//! regions inside a list and merging must stop at region edges.

use ferry::{Agent, Desc, MemKind, Op, PeerId, Side, XferId, XferStatus};
use ferry_tests::{loopback_agent, register, try_register, Buffer, Rng};

/// Bytes of each side's buffer.
const LEN: usize = 1 << 20;
/// Target regions the destination buffer is cut into.
const PIECES: usize = 4;
/// Bytes of each target region.
const PIECE: usize = LEN / PIECES;

/// A with its buffer as one region; B with its buffer as `PIECES` regions; A knows B.
fn agents(src: &Buffer, dst: &Buffer) -> (Agent, Agent, PeerId) {
    let a = loopback_agent("create-a");
    let b = loopback_agent("create-b");
    register(&a, src);
    for i in 0..PIECES {
        try_register(&b, MemKind::Dram, dst.desc(i * PIECE, PIECE)).expect("register piece");
    }
    let peer = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    (a, b, peer)
}

/// `n` pairs (local offset, remote offset, length) of 64..=4096 bytes: runs of
/// neighbours on both sides (which merge, until a region edge) broken up by jumps.
fn pairs(rng: &mut Rng, n: usize) -> Vec<(usize, usize, usize)> {
    let (mut lo, mut ro) = (0usize, 0usize);
    (0..n)
        .map(|_| {
            let mut len = 64 * (1 + rng.below(64) as usize);
            if rng.below(4) == 0 || lo + len > LEN || ro + len > LEN {
                lo = 64 * rng.below(((LEN - 4096) / 64) as u64) as usize;
                ro = 64 * rng.below(((LEN - 4096) / 64) as u64) as usize;
            }
            // A remote descriptor ends at a region edge rather than cross it, so the
            // next one starts a new region right after it (and must not merge with it).
            let edge = (ro / PIECE + 1) * PIECE;
            len = len.min(edge - ro);
            let pair = (lo, ro, len);
            lo += len;
            ro += len;
            pair
        })
        .collect()
}

fn descs(buf: &Buffer, pairs: &[(usize, usize, usize)], remote: bool) -> Vec<Desc> {
    pairs
        .iter()
        .map(|&(l, r, len)| buf.desc(if remote { r } else { l }, len))
        .collect()
}

/// WRITE `local` → `remote` at `side`, by `create` (`fused`) or by prep + make.
fn request(
    a: &Agent,
    side: Side,
    local: &[Desc],
    remote: &[Desc],
    fused: bool,
) -> ferry::Result<XferId> {
    if fused {
        return a.create(
            Op::Write,
            MemKind::Dram,
            local,
            side,
            MemKind::Dram,
            remote,
            None,
        );
    }
    let l = a.prep(Side::Local, MemKind::Dram, local)?;
    let r = match a.prep(side, MemKind::Dram, remote) {
        Ok(r) => r,
        Err(e) => {
            a.release_prep(l).unwrap();
            return Err(e);
        }
    };
    let li: Vec<u32> = (0..local.len() as u32).collect();
    let ri: Vec<u32> = (0..remote.len() as u32).collect();
    let x = a.make(Op::Write, l, &li, r, &ri, None);
    a.release_prep(l).unwrap();
    a.release_prep(r).unwrap();
    x
}

/// Post `x` and wait; (merged ranges, destination bytes afterwards).
fn run(a: &Agent, b: &Agent, x: XferId, dst: &Buffer) -> (usize, Vec<u8>) {
    let ranges = a.xfer_ranges(x).unwrap();
    let mut status = a.post(x).unwrap();
    while status != XferStatus::Done {
        b.progress();
        status = a.check(x).unwrap();
    }
    a.release(x).unwrap();
    (ranges, dst.bytes().to_vec())
}

#[test]
fn create_merges_and_moves_as_prep_and_make_do() {
    for (seed, n) in [(1u64, 1usize), (2, 7), (3, 300), (4, 5000)] {
        let mut rng = Rng::new(seed);
        let src = Buffer::random(LEN, &mut rng);
        let pairs = pairs(&mut rng, n);
        let local = descs(&src, &pairs, false);
        let mut results = Vec::new();
        for fused in [true, false] {
            let dst = Buffer::zeroed(LEN);
            let (a, b, peer) = agents(&src, &dst);
            let x = request(&a, peer.into(), &local, &descs(&dst, &pairs, true), fused).unwrap();
            results.push(run(&a, &b, x, &dst));
        }
        assert_eq!(results[0].0, results[1].0, "merged ranges, n = {n}");
        assert!(results[0].1 == results[1].1, "destination bytes, n = {n}");
        assert!(
            results[0].1.iter().any(|&b| b != 0),
            "something was written"
        );
    }
}

#[test]
fn create_to_oneself_moves_as_prep_and_make_do() {
    let mut rng = Rng::new(9);
    let pairs = pairs(&mut rng, 500);
    let mut results = Vec::new();
    for fused in [true, false] {
        let src = Buffer::random(LEN, &mut Rng::new(10));
        let dst = Buffer::zeroed(LEN);
        let a = loopback_agent("create-self");
        register(&a, &src);
        register(&a, &dst);
        let x = request(
            &a,
            Side::Local,
            &descs(&src, &pairs, false),
            &descs(&dst, &pairs, true),
            fused,
        )
        .unwrap();
        results.push(run(&a, &a, x, &dst));
    }
    assert_eq!(results[0].0, results[1].0, "merged ranges");
    assert!(results[0].1 == results[1].1, "destination bytes");
}

/// `text` with every handle (`PrepId(8388610v1)` …) written as `PrepId(_)`: a handle
/// carries its agent's tag, which depends on how many agents the process made before.
fn without_handles(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("Id(") {
        out.push_str(&rest[..at + 3]);
        rest = &rest[at + 3..];
        let end = rest.find(')').unwrap_or(0);
        if rest[..end].chars().all(|c| c.is_ascii_alphanumeric()) {
            out.push('_');
            rest = &rest[end..];
        }
    }
    out.push_str(rest);
    out
}

#[test]
fn create_refuses_what_prep_and_make_refuse_with_the_same_error() {
    let src = Buffer::random(LEN, &mut Rng::new(5));
    let outside = Buffer::zeroed(4096);
    // (what, local list, remote list) as offsets into src / dst; `None` = the outside buffer.
    type Case = (
        &'static str,
        Vec<(usize, usize)>,
        Vec<(Option<usize>, usize)>,
    );
    let cases: Vec<Case> = vec![
        (
            "lengths differ",
            vec![(0, 64), (64, 64)],
            vec![(Some(0), 64), (Some(64), 128)],
        ),
        (
            "lists differ in length",
            vec![(0, 64), (64, 64)],
            vec![(Some(0), 64)],
        ),
        (
            "an empty descriptor",
            vec![(0, 64), (64, 0)],
            vec![(Some(0), 64), (Some(64), 0)],
        ),
        (
            "a remote descriptor in no region",
            vec![(0, 64), (64, 64)],
            vec![(Some(0), 64), (None, 64)],
        ),
        (
            "a remote descriptor across two regions",
            vec![(0, 64), (64, 128)],
            vec![(Some(0), 64), (Some(PIECE - 64), 128)],
        ),
        (
            "a local descriptor past the region",
            vec![(LEN - 64, 128)],
            vec![(Some(0), 128)],
        ),
    ];
    for (what, l, r) in cases {
        let dst = Buffer::zeroed(LEN);
        let mut errors = Vec::new();
        for fused in [true, false] {
            let (a, _b, peer) = agents(&src, &dst);
            let local: Vec<Desc> = l
                .iter()
                .map(|&(o, n)| Desc::new(src.whole().addr + o as u64, n as u64, 0))
                .collect();
            let remote: Vec<Desc> = r
                .iter()
                .map(|&(o, n)| match o {
                    Some(o) => dst.desc(o, n),
                    None => outside.desc(0, n),
                })
                .collect();
            let e = request(&a, peer.into(), &local, &remote, fused).expect_err(what);
            errors.push(without_handles(&e.to_string()));
        }
        assert_eq!(errors[0], errors[1], "{what}");
    }
}
