//! Memory allocated through the UCX backend (`Backend::alloc`, `ucp_mem_map` with
//! `UCP_MEM_MAP_ALLOCATE`): bad requests get typed errors, a registration inside an
//! allocation reuses its mapping (and keeps it from being freed), and 100 alloc /
//! register / deregister / free cycles leave nothing mapped (checked against UCX's count
//! and the process's own `/proc/self/maps`). The two-process data tests on such memory
//! are in `two_process.rs`.

// Reason: the tests call the backend's unsafe methods (through `common::TestCalls`).
#![allow(unsafe_code)]

mod common;

use common::*;
use ferry_backend_api::{Backend, Completions, Desc, Endpoint, Error, MemKind, Op, Post, Range};
use ferry_ucx::{UcxBackend, ALLOC_LEN_MAX};

/// The line of `/proc/self/maps` of the mapping that starts at `addr`: (inode, path).
fn mapping_at(addr: u64) -> Option<(u64, String)> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let start = u64::from_str_radix(fields.next()?.split('-').next()?, 16).ok()?;
        if start != addr {
            return None;
        }
        let inode: u64 = fields.nth(3)?.parse().ok()?;
        Some((inode, fields.collect::<Vec<_>>().join(" ")))
    })
}

/// Whether any mapping of this process is of file `inode` with `path`.
fn mapped(inode: u64, path: &str) -> bool {
    mappings_of(inode, path) > 0
}

/// How many mappings of this process are of file `inode` with `path`.
fn mappings_of(inode: u64, path: &str) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    maps.lines()
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() >= 6 && fields[4] == inode.to_string() && fields[5..].join(" ") == path
        })
        .count()
}

fn register_at(ucx: &mut UcxBackend, addr: u64, len: u64) -> Result<u64, Error> {
    ucx.register_t(&ferry_backend_api::RegionSpec {
        kind: MemKind::Dram,
        desc: Desc::new(addr, len, 0),
        path: None,
    })
    .map(|r| r.token)
}

/// `Backend::free` of the allocation at `addr`.
fn free(ucx: &mut UcxBackend, addr: u64) -> Result<(), Error> {
    // SAFETY: every call site frees an allocation only after its registrations are gone
    // (or expects the refusal), and no test touches the bytes after a free.
    unsafe { ucx.free(MemKind::Dram, addr) }
}

#[test]
fn bad_allocations_get_typed_errors() {
    if !setup() {
        return;
    }
    let mut ucx = backend("alloc-errors", "", &[("error_handling", "none")]);
    for len in [0, ALLOC_LEN_MAX + 1, u64::MAX] {
        match ucx.alloc(MemKind::Dram, len) {
            Err(Error::InvalidParam { reason, .. }) => {
                assert!(reason.contains("length must be"), "{reason}")
            }
            other => panic!("alloc of {len} bytes: {other:?}"),
        }
    }
    for kind in [MemKind::Vram, MemKind::File] {
        assert!(
            matches!(ucx.alloc(kind, 4096), Err(Error::NotSupported { .. })),
            "alloc of {kind}"
        );
    }
    // Freeing what was never allocated.
    let heap = Buffer::new(4096);
    assert!(matches!(
        free(&mut ucx, heap.addr()),
        Err(Error::NotFound { .. })
    ));
    // Freeing while a registration reuses the mapping is refused; after deregistering
    // it goes, and a second free finds nothing.
    let a = ucx.alloc(MemKind::Dram, 1 << 20).expect("alloc");
    let whole = register_at(&mut ucx, a.addr, a.len).expect("register whole");
    let part = register_at(&mut ucx, a.addr + 4096, 8192).expect("register part");
    match free(&mut ucx, a.addr) {
        Err(Error::NotAllowed { reason, .. }) => {
            assert!(reason.contains("2 UCX registration(s)"), "{reason}")
        }
        other => panic!("free while registered: {other:?}"),
    }
    assert_eq!(ucx.allocations(), 1);
    ucx.deregister_t(MemKind::Dram, whole).unwrap();
    assert!(matches!(
        free(&mut ucx, a.addr),
        Err(Error::NotAllowed { .. })
    ));
    ucx.deregister_t(MemKind::Dram, part).unwrap();
    free(&mut ucx, a.addr).expect("free");
    assert_eq!(ucx.allocations(), 0);
    assert!(matches!(
        free(&mut ucx, a.addr),
        Err(Error::NotFound { .. })
    ));
    // A backend dropped with allocations (registered or not) releases them itself.
    let b = ucx.alloc(MemKind::Dram, 1 << 20).expect("alloc");
    register_at(&mut ucx, b.addr, b.len).expect("register");
    ucx.alloc(MemKind::Dram, 4096).expect("alloc");
    assert_eq!(ucx.allocations(), 2);
    let seen = mapping_at(b.addr);
    drop(ucx);
    if let Some((inode, path)) = seen.filter(|(inode, _)| *inode != 0) {
        assert!(!mapped(inode, &path), "{path} still mapped after drop");
    }
}

#[test]
fn hundred_alloc_free_cycles_leave_nothing_mapped() {
    if !setup() {
        return;
    }
    let mut ucx = backend("alloc-cycles", "", &[("error_handling", "none")]);
    let mut shared = 0;
    for cycle in 0..100u64 {
        let len = (1 << 20) + cycle * 4096;
        let a = ucx.alloc(MemKind::Dram, len).expect("alloc");
        assert_eq!(a.len, len);
        let token = register_at(&mut ucx, a.addr, a.len).expect("register");
        // A local write into the allocation and back, through the reused mapping.
        let mut src = Buffer::new(4096);
        Rng::new(cycle).fill(&mut src.0);
        let mut dst = Buffer::new(4096);
        let src_token = register(&mut ucx, &src).0;
        let dst_token = register(&mut ucx, &dst).0;
        let range = |local_addr, remote_addr, local_token, remote_token| Range {
            local_addr,
            remote_addr,
            len: 4096,
            local_dev: 0,
            remote_dev: 0,
            local_token,
            remote_token,
        };
        let at = a.addr + len - 4096;
        for (tag, op, r) in [
            (1, Op::Write, range(src.addr(), at, src_token, token)),
            (2, Op::Read, range(dst.addr(), at, dst_token, token)),
        ] {
            let ranges = [r];
            let posts = [Post {
                tag,
                op,
                local_kind: MemKind::Dram,
                remote_kind: MemKind::Dram,
                ranges: &ranges,
                notif: None,
            }];
            let mut done = Completions::with_capacity(4);
            ucx.post_t(Endpoint::Local, &posts, &mut done)
                .expect("post");
            if done.is_empty() {
                let got = wait_for(&mut [&mut ucx], &[tag], std::time::Duration::from_secs(10));
                assert_eq!(got[0].result, Ok(()));
            } else {
                assert_eq!(done.as_slice()[0].result, Ok(()));
            }
        }
        assert_eq!(dst.0, src.0, "cycle {cycle}: bytes differ");
        dst.0.fill(0);
        let seen = mapping_at(a.addr).filter(|(inode, _)| *inode != 0);
        for t in [token, src_token, dst_token] {
            ucx.deregister_t(MemKind::Dram, t).unwrap();
        }
        free(&mut ucx, a.addr).expect("free");
        assert_eq!(ucx.allocations(), 0, "cycle {cycle}");
        if let Some((inode, path)) = seen {
            shared += 1;
            assert!(
                !mapped(inode, &path),
                "cycle {cycle}: {path} (inode {inode}) still mapped after free"
            );
        }
    }
    eprintln!("100 cycles: {shared} of them in a shared-memory segment (SysV or POSIX)");
}

/// A load unpacks the rkeys of the regions the peer lists (`connect_on_load`,
/// `unpack_on_load`). With `auto` (the default) an rkey UCX maps into this process — a
/// peer's allocation in a shared-memory segment — is released at once, so the load
/// leaves no extra mapping of the segment behind; with `true` it is kept, mapped. Either
/// way a WRITE into the allocation then lands byte for byte (`auto` unpacks it then).
#[test]
fn a_load_keeps_no_peer_segment_mapped_unless_told_to() {
    if !setup() {
        return;
    }
    let none = ("error_handling", "none");
    let mut b = backend("segment-b", "", &[none]);
    // An allocation in a shared-memory segment (UCX picks how it allocates: try a few).
    let mut found = None;
    for _ in 0..8 {
        let a = b.alloc(MemKind::Dram, 1 << 20).expect("alloc");
        match mapping_at(a.addr).filter(|(inode, _)| *inode != 0) {
            Some(file) => {
                found = Some((a, file));
                break;
            }
            None => free(&mut b, a.addr).expect("free"),
        }
    }
    let Some((alloc, (inode, path))) = found else {
        panic!("UCX placed none of 8 allocations in a shared-memory segment");
    };
    let r = b
        .register_t(&ferry_backend_api::RegionSpec {
            kind: MemKind::Dram,
            desc: Desc::new(alloc.addr, alloc.len, 0),
            path: None,
        })
        .expect("register");
    let regions = common::HandRegions {
        name: "segment-b".into(),
        md: [(r.token, r.public_md.clone())].into(),
        descs: [(r.token, Desc::new(alloc.addr, alloc.len, 0))].into(),
    };
    let conn = b.conn_info().expect("conn info");
    let peer = peer_id(1);
    for (n, mode) in ["true", "auto"].into_iter().enumerate() {
        let mut a = backend(
            &format!("segment-a-{mode}"),
            "",
            &[none, ("unpack_on_load", mode)],
        );
        let before = mappings_of(inode, &path);
        a.load_remote(
            peer,
            ferry_backend_api::RemoteAgent {
                name: "segment-b",
                conn_info: &conn,
                regions: std::sync::Arc::new(regions.clone()),
                standby: false,
                ready_ranges: 0,
            },
        )
        .expect("load");
        let (connected, kept) = a.peer_connection(peer).expect("loaded");
        assert!(connected, "{mode}");
        let extra = mappings_of(inode, &path) - before;
        if mode == "true" {
            assert_eq!(kept, 1, "true keeps the rkey");
            assert!(
                extra >= 1,
                "UCX did not map the peer's segment at unpack: {path}"
            );
        } else {
            assert_eq!((kept, extra), (0, 0), "auto keeps no mapped rkey");
        }
        // A WRITE into the allocation, then it is mapped (and cached) either way.
        let mut src = Buffer::new(4096);
        Rng::new(n as u64).fill(&mut src.0);
        let (src_token, _) = register(&mut a, &src);
        let at = alloc.addr + 8192;
        let ranges = [Range {
            local_addr: src.addr(),
            remote_addr: at,
            len: 4096,
            local_dev: 0,
            remote_dev: 0,
            local_token: src_token,
            remote_token: r.token,
        }];
        let posts = [Post {
            tag: 7,
            op: Op::Write,
            local_kind: MemKind::Dram,
            remote_kind: MemKind::Dram,
            ranges: &ranges,
            notif: None,
        }];
        let mut done = Completions::with_capacity(4);
        a.post_t(Endpoint::Peer(peer), &posts, &mut done)
            .expect("post");
        let result = match done.as_slice().first() {
            Some(c) => c.result,
            None => {
                wait_for(
                    &mut [&mut a, &mut b],
                    &[7],
                    std::time::Duration::from_secs(10),
                )[0]
                .result
            }
        };
        assert_eq!(result, Ok(()), "{mode}");
        // SAFETY: b's live allocation; the WRITE completed, nothing writes it now.
        let landed = unsafe { std::slice::from_raw_parts(at as *const u8, 4096) };
        assert!(landed == &src.0[..], "{mode}: bytes differ");
        assert_eq!(a.peer_connection(peer), Some((true, 1)), "{mode}");
        drop(a);
        assert_eq!(
            mappings_of(inode, &path),
            before,
            "{mode}: still mapped after unload"
        );
    }
    b.deregister_t(MemKind::Dram, r.token).unwrap();
    free(&mut b, alloc.addr).expect("free");
}
