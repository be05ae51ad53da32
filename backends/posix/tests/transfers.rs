//! DRAM ↔ FILE transfers through the `Backend` trait, against both engines.

// Reason: the tests call the backend's unsafe methods (through `common::TestCalls`).
#![allow(unsafe_code)]

mod common;

use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;

use common::*;
use ferry_backend_api::{
    Backend, Completions, Desc, Endpoint, Error, FailureKind, FileMode, MemKind, Op, RegionSpec,
    Subject,
};
use ferry_posix::EngineKind;

fn assert_all_ok(done: &[ferry_backend_api::Completion]) {
    for c in done {
        assert_eq!(c.result, Ok(()), "request {} failed", c.tag);
    }
}

/// Random ranges of a file written from one buffer and read back into another; checks
/// the file and the read-back byte for byte against a model of the file.
fn random_roundtrip(engine: &str, extra: &[(&str, &str)], direct: bool, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.bin");
    let file_len: u64 = 4 << 20;
    let align: u64 = if direct { 4096 } else { 1 };
    // Pre-size the file so reads anywhere in it are full.
    fs::File::create(&path).unwrap().set_len(file_len).unwrap();

    let mut params = vec![("queue_depth", "16")];
    params.extend_from_slice(extra);
    let mut b = backend(engine, &params);
    let mode = FileMode {
        write: true,
        direct,
        ..FileMode::default()
    };
    let file = match register_path(&mut b, &path, mode) {
        Ok(t) => t,
        Err(Error::Backend { errno, .. }) if direct && errno == libc::EINVAL => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!(
                    "O_DIRECT refused by the file system of {}",
                    dir.path().display()
                );
            }
            eprintln!("skipping O_DIRECT: the file system of the temp dir refuses it");
            return;
        }
        Err(e) => panic!("register: {e}"),
    };
    let mut rng = Rng::new(seed);
    let mut src = AlignedBuf::new(1 << 20);
    rng.fill(src.as_mut_slice());
    let mut dst = AlignedBuf::new(1 << 20);
    let src_token = register_dram(&mut b, src.as_slice());
    let dst_token = register_dram(&mut b, dst.as_slice());
    let mut model = vec![0u8; file_len as usize];

    for round in 0..8 {
        // Up to 40 non-overlapping ranges in the file, each from a random spot of src.
        let n = 1 + rng.below(40) as usize;
        let mut ranges = Vec::new();
        let slot_len = file_len / n as u64;
        for i in 0..n as u64 {
            let max_len = (slot_len / align).min((64 << 10) / align).max(1);
            let len = (1 + rng.below(max_len)) * align;
            let room = (slot_len - len) / align;
            let off = i * slot_len / align * align + rng.below(room + 1) * align;
            let mem_off = rng.below(((1 << 20) - len) / align + 1) * align;
            ranges.push(range(src.addr() + mem_off, off, len, src_token, file));
            model[off as usize..(off + len) as usize]
                .copy_from_slice(&src.as_slice()[mem_off as usize..(mem_off + len) as usize]);
        }
        let done = run(&mut b, &[post(round, Op::Write, &ranges)]).unwrap();
        assert_all_ok(&done);
        assert_eq!(
            fs::read(&path).unwrap(),
            model,
            "file after write round {round}"
        );

        // Read back random ranges (anywhere in the file) into dst.
        dst.as_mut_slice().fill(0);
        let mut reads = Vec::new();
        let mut expect = Vec::new();
        let mut mem_cursor = 0u64;
        while reads.len() < n && mem_cursor < (1 << 20) - (64 << 10) {
            let len = (1 + rng.below((64 << 10) / align)) * align;
            let off = rng.below((file_len - len) / align + 1) * align;
            reads.push(range(dst.addr() + mem_cursor, off, len, dst_token, file));
            expect.push((mem_cursor, off, len));
            mem_cursor += len.div_ceil(align) * align;
        }
        let done = run(&mut b, &[post(100 + round, Op::Read, &reads)]).unwrap();
        assert_all_ok(&done);
        for (mem, off, len) in expect {
            assert_eq!(
                &dst.as_slice()[mem as usize..(mem + len) as usize],
                &model[off as usize..(off + len) as usize],
                "read-back of file offset {off}, len {len}"
            );
        }
    }
    assert_eq!(b.stats().requests_in_use, 0);
    assert_eq!(b.stats().ops_in_use, 0);
}

#[test]
fn random_ranges_buffered_both_directions() {
    for engine in engines() {
        random_roundtrip(engine, &[], false, 0x5eed_0001);
    }
}

#[test]
fn random_ranges_without_fixed_buffers_or_files() {
    let plain = [("register_buffers", "false"), ("register_files", "false")];
    for engine in engines() {
        random_roundtrip(engine, &plain, false, 0x5eed_0003);
        random_roundtrip(engine, &plain, true, 0x5eed_0004);
    }
}

#[test]
fn random_ranges_direct_both_directions() {
    for engine in engines() {
        random_roundtrip(engine, &[], true, 0x5eed_0002);
    }
}

#[test]
fn engine_selection_is_reported() {
    assert_eq!(backend("threads", &[]).engine(), EngineKind::Threads);
    if engines().contains(&"uring") {
        assert_eq!(backend("uring", &[]).engine(), EngineKind::Uring);
        assert_eq!(backend("auto", &[]).engine(), EngineKind::Uring);
    }
}

#[test]
fn batch_larger_than_the_ring_is_queued_not_dropped() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.bin");
        let mut b = backend(engine, &[("queue_depth", "4")]);
        let file = register_path(&mut b, &path, rw_create()).unwrap();
        let block = 512u64;
        let blocks = 700u64;
        let mut src = vec![0u8; (block * blocks) as usize];
        Rng::new(7).fill(&mut src);
        let token = register_dram(&mut b, &src);
        // One request with 500 ranges, then 200 one-range requests, in one batch.
        let big: Vec<_> = (0..500)
            .map(|i| {
                range(
                    src.as_ptr() as u64 + i * block,
                    i * block,
                    block,
                    token,
                    file,
                )
            })
            .collect();
        let singles: Vec<_> = (500..blocks)
            .map(|i| {
                [range(
                    src.as_ptr() as u64 + i * block,
                    i * block,
                    block,
                    token,
                    file,
                )]
            })
            .collect();
        let mut batch = vec![post(0, Op::Write, &big)];
        for (i, r) in singles.iter().enumerate() {
            batch.push(post(1 + i as u64, Op::Write, r));
        }
        let done = run(&mut b, &batch).unwrap();
        assert_eq!(done.len(), batch.len());
        assert_all_ok(&done);
        assert_eq!(fs::read(&path).unwrap(), src, "engine {engine}");

        // And read it all back in one request of 700 ranges.
        let mut dst = vec![0u8; src.len()];
        let dtoken = register_dram(&mut b, &dst);
        let reads: Vec<_> = (0..blocks)
            .map(|i| {
                range(
                    dst.as_mut_ptr() as u64 + i * block,
                    i * block,
                    block,
                    dtoken,
                    file,
                )
            })
            .collect();
        let done = run(&mut b, &[post(9, Op::Read, &reads)]).unwrap();
        assert_all_ok(&done);
        assert_eq!(dst, src);
        let stats = b.stats();
        assert_eq!(
            (stats.requests_in_use, stats.ops_in_use, stats.ops_queued),
            (0, 0, 0)
        );
    }
}

#[test]
fn many_files_in_one_request() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = backend(engine, &[("queue_depth", "8")]);
        let files = 64usize;
        let each = 3000usize;
        let mut src = vec![0u8; files * each];
        Rng::new(11).fill(&mut src);
        let token = register_dram(&mut b, &src);
        let mut tokens = Vec::new();
        for i in 0..files {
            let path = dir.path().join(format!("f{i}.bin"));
            tokens.push(register_path(&mut b, &path, rw_create()).unwrap());
        }
        let writes: Vec<_> = (0..files)
            .map(|i| {
                range(
                    src.as_ptr() as u64 + (i * each) as u64,
                    0,
                    each as u64,
                    token,
                    tokens[i],
                )
            })
            .collect();
        assert_all_ok(&run(&mut b, &[post(1, Op::Write, &writes)]).unwrap());
        for i in 0..files {
            let got = fs::read(dir.path().join(format!("f{i}.bin"))).unwrap();
            assert_eq!(got, &src[i * each..(i + 1) * each], "file {i}");
        }
        let mut dst = vec![0u8; src.len()];
        let dtoken = register_dram(&mut b, &dst);
        let reads: Vec<_> = (0..files)
            .map(|i| {
                range(
                    dst.as_mut_ptr() as u64 + (i * each) as u64,
                    0,
                    each as u64,
                    dtoken,
                    tokens[i],
                )
            })
            .collect();
        assert_all_ok(&run(&mut b, &[post(2, Op::Read, &reads)]).unwrap());
        assert_eq!(dst, src);
        for t in tokens {
            b.deregister_t(MemKind::File, t).unwrap();
        }
        assert_eq!(b.stats().files_registered, 0);
    }
}

#[test]
fn file_registered_by_descriptor_stays_open_after_deregistration() {
    for engine in engines() {
        let mut tmp = tempfile::tempfile().unwrap();
        tmp.write_all(&[1u8; 8192]).unwrap();
        let mut b = backend(engine, &[]);
        let file = b
            .register_t(&RegionSpec {
                kind: MemKind::File,
                desc: Desc::new(4096, 4096, tmp.as_raw_fd() as u64),
                path: None,
            })
            .unwrap()
            .token;
        let src = vec![9u8; 4096];
        let token = register_dram(&mut b, &src);
        let r = [range(src.as_ptr() as u64, 4096, 4096, token, file)];
        assert_all_ok(&run(&mut b, &[post(1, Op::Write, &r)]).unwrap());
        // A range outside the registered window [4096, 8192) is refused up front.
        let outside = [range(src.as_ptr() as u64, 0, 4096, token, file)];
        let err = run(&mut b, &[post(2, Op::Write, &outside)]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidParam {
                    subject: Subject::Descriptor { index: 0, .. },
                    ..
                }
            ),
            "{err}"
        );
        b.deregister_t(MemKind::File, file).unwrap();
        // The caller's fd is still open and holds what was written.
        let meta = tmp.metadata().unwrap();
        assert_eq!(meta.len(), 8192);
        let mut all = Vec::new();
        use std::io::{Read, Seek};
        tmp.rewind().unwrap();
        tmp.read_to_end(&mut all).unwrap();
        assert_eq!(&all[..4096], &[1u8; 4096][..]);
        assert_eq!(&all[4096..], &[9u8; 4096][..]);
        // A bogus descriptor is refused at registration.
        let err = b
            .register_t(&RegionSpec {
                kind: MemKind::File,
                desc: Desc::new(0, 0, 1_000_000),
                path: None,
            })
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::Backend {
                    errno: libc::EBADF,
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn short_read_at_end_of_file_fails_that_request_only() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short.bin");
        fs::write(&path, vec![3u8; 10_000]).unwrap();
        let mut b = backend(engine, &[]);
        let file = register_path(&mut b, &path, FileMode::default()).unwrap();
        let mut dst = vec![0u8; 20_000];
        let token = register_dram(&mut b, &dst);
        let base = dst.as_mut_ptr() as u64;
        let good = [range(base, 0, 4000, token, file)];
        // Range 1 runs past the end of the file (10 000 bytes).
        let bad = [
            range(base + 4000, 0, 100, token, file),
            range(base + 5000, 9000, 4000, token, file),
        ];
        let done = run(&mut b, &[post(1, Op::Read, &good), post(2, Op::Read, &bad)]).unwrap();
        assert_eq!(done[0].result, Ok(()));
        let failure = done[1].result.unwrap_err();
        assert_eq!(failure.kind, FailureKind::ShortRead, "{engine}");
        assert_eq!(failure.range, Some(1));
        // The part that existed arrived; the backend is still usable.
        assert_eq!(&dst[5000..6000], &[3u8; 1000][..]);
        assert_all_ok(&run(&mut b, &[post(3, Op::Read, &good)]).unwrap());
        assert_eq!(b.stats().ops_in_use, 0);
    }
}

#[test]
fn missing_file_and_bad_modes_are_reported_with_the_path() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.bin");
        let mut b = backend(engine, &[]);
        let err = register_path(&mut b, &missing, FileMode::default()).unwrap_err();
        match &err {
            Error::Backend { errno, detail, .. } => {
                assert_eq!(*errno, libc::ENOENT);
                assert!(detail.contains("nope.bin"), "{err}");
            }
            other => panic!("unexpected {other}"),
        }
        // create without write is refused.
        let err = register_path(
            &mut b,
            &missing,
            FileMode {
                create: true,
                ..FileMode::default()
            },
        )
        .unwrap_err();
        assert!(matches!(err, Error::InvalidParam { .. }), "{err}");
        // A directory cannot be opened for writing.
        let err = register_path(&mut b, dir.path(), rw_create()).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Backend {
                    errno: libc::EISDIR,
                    ..
                }
            ),
            "{err}"
        );
        // Unreadable file: permission bits only bind a non-root user.
        let locked = dir.path().join("locked.bin");
        fs::write(&locked, b"secret").unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&locked, fs::Permissions::from_mode(0o000)).unwrap();
        use std::os::unix::fs::MetadataExt;
        let root = fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
        let result = register_path(&mut b, &locked, FileMode::default());
        if root {
            eprintln!("running as root: mode 000 does not deny access (EBADF on a read-only file is checked separately)");
            assert!(result.is_ok());
        } else {
            let err = result.unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::Backend {
                        errno: libc::EACCES,
                        ..
                    }
                ),
                "{err}"
            );
        }
    }
}

#[test]
fn writing_a_read_only_file_fails_per_request_with_ebadf() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ro.bin");
        fs::write(&path, vec![0u8; 4096]).unwrap();
        let mut b = backend(engine, &[]);
        let file = register_path(&mut b, &path, FileMode::default()).unwrap();
        let src = vec![1u8; 4096];
        let token = register_dram(&mut b, &src);
        let r = [range(src.as_ptr() as u64, 0, 4096, token, file)];
        let done = run(&mut b, &[post(1, Op::Write, &r), post(2, Op::Read, &r)]).unwrap();
        let f = done[0].result.unwrap_err();
        assert_eq!(
            (f.kind, f.errno, f.range),
            (FailureKind::Backend, libc::EBADF, Some(0))
        );
        assert_eq!(done[1].result, Ok(()));
        assert_eq!(fs::read(&path).unwrap(), vec![0u8; 4096]);
    }
}

#[test]
fn enospc_is_reported_per_request() {
    // /dev/full fails every write with ENOSPC.
    let full = std::path::Path::new("/dev/full");
    if !full.exists() {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "/dev/full missing under CI"
        );
        eprintln!("skipping: /dev/full not present");
        return;
    }
    for engine in engines() {
        let mut b = backend(engine, &[]);
        let file = register_path(
            &mut b,
            full,
            FileMode {
                write: true,
                ..FileMode::default()
            },
        )
        .unwrap();
        let src = vec![1u8; 4096];
        let token = register_dram(&mut b, &src);
        let r = [range(src.as_ptr() as u64, 0, 4096, token, file)];
        let done = run(&mut b, &[post(1, Op::Write, &r)]).unwrap();
        let f = done[0].result.unwrap_err();
        assert_eq!(
            (f.kind, f.errno, f.range),
            (FailureKind::Backend, libc::ENOSPC, Some(0))
        );
    }
}

#[test]
fn a_request_mixing_valid_and_invalid_descriptors_fails_cleanly() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mix.bin");
        fs::write(&path, vec![5u8; 8192]).unwrap();
        let mut b = backend(engine, &[]);
        let file = register_path(&mut b, &path, FileMode::default()).unwrap();
        let stale = register_path(&mut b, &path, FileMode::default()).unwrap();
        b.deregister_t(MemKind::File, stale).unwrap();
        let mut dst = vec![0u8; 8192];
        let token = register_dram(&mut b, &dst);
        let base = dst.as_mut_ptr() as u64;
        let mixed = [
            range(base, 0, 4096, token, file),
            range(base + 4096, 0, 4096, token, stale),
        ];
        let good = [range(base, 4096, 4096, token, file)];
        let mut done = Completions::with_capacity(4);
        // The whole batch is refused before anything starts; the error names range #1.
        let err = b
            .post_t(
                Endpoint::Local,
                &[post(1, Op::Read, &good), post(2, Op::Read, &mixed)],
                &mut done,
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::NotFound {
                    subject: Subject::Descriptor { index: 1, .. }
                }
            ),
            "{err}"
        );
        assert!(done.is_empty());
        assert_eq!(b.stats().ops_in_use, 0);
        assert_eq!(dst, vec![0u8; 8192], "nothing was read");
        // Unknown DRAM token, wrong kinds, peers.
        let bad_mem = [range(base, 0, 16, 0xdead_0001, file)];
        assert!(matches!(
            run(&mut b, &[post(3, Op::Read, &bad_mem)]).unwrap_err(),
            Error::NotFound { .. }
        ));
        let mut wrong_kind = post(4, Op::Read, &good);
        wrong_kind.remote_kind = MemKind::Dram;
        assert!(matches!(
            run(&mut b, &[wrong_kind]).unwrap_err(),
            Error::NotSupported { .. }
        ));
        // Still usable.
        assert_all_ok(&run(&mut b, &[post(5, Op::Read, &good)]).unwrap());
        assert_eq!(&dst[..4096], &[5u8; 4096][..]);
    }
}

#[test]
fn misaligned_direct_ranges_are_refused_naming_descriptor_and_alignment() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("direct.bin");
        fs::File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let mut b = backend(engine, &[]);
        let mode = FileMode {
            write: true,
            direct: true,
            ..FileMode::default()
        };
        let Ok(file) = register_path(&mut b, &path, mode) else {
            assert!(
                std::env::var("CI").map_or(true, |v| v != "true"),
                "O_DIRECT refused under CI"
            );
            eprintln!("skipping: O_DIRECT not supported in the temp dir");
            return;
        };
        let buf = AlignedBuf::new(3 * 4096);
        let token = register_dram(&mut b, buf.as_slice());
        let a = buf.addr();
        for (bad, what) in [
            (range(a + 1, 0, 4096, token, file), "memory address"),
            (range(a, 0, 100, token, file), "length"),
            (
                range(a, 512 + 4096 * 3 + 1, 4096, token, file),
                "file offset",
            ),
        ] {
            let ranges = [range(a, 0, 4096, token, file), bad];
            let err = b
                .check_post(Endpoint::Local, &post(1, Op::Write, &ranges))
                .unwrap_err();
            let text = err.to_string();
            match &err {
                Error::InvalidParam {
                    subject: Subject::Descriptor { index: 1, .. },
                    reason,
                } => {
                    assert!(reason.contains(what), "{text}");
                    assert!(reason.contains("-byte alignment"), "{text}");
                    assert!(reason.contains("direct.bin"), "{text}");
                }
                other => panic!("unexpected {other}"),
            }
            let mut done = Completions::with_capacity(1);
            assert_eq!(
                b.post_t(Endpoint::Local, &[post(1, Op::Write, &ranges)], &mut done),
                Err(err)
            );
            assert!(done.is_empty());
        }
    }
}

#[test]
fn queued_requests_can_be_canceled_in_flight_ones_cannot() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.bin");
        let mut b = backend(engine, &[("queue_depth", "1")]);
        let file = register_path(&mut b, &path, rw_create()).unwrap();
        let src = vec![4u8; 4096];
        let token = register_dram(&mut b, &src);
        let r1 = [range(src.as_ptr() as u64, 0, 4096, token, file)];
        let r2 = [range(src.as_ptr() as u64, 4096, 4096, token, file)];
        let mut done = Completions::with_capacity(2);
        b.post_t(
            Endpoint::Local,
            &[post(1, Op::Write, &r1), post(2, Op::Write, &r2)],
            &mut done,
        )
        .unwrap();
        // Request 2 waits behind request 1 (queue depth 1): it can be canceled; request
        // 1 is in flight and cannot.
        assert_eq!(b.stats().ops_queued, 1);
        assert_eq!(b.cancel(1), Ok(false));
        assert_eq!(b.cancel(2), Ok(true));
        assert!(matches!(b.cancel(2), Err(Error::NotFound { .. })));
        wait_for(&mut b, &mut done, 1);
        assert_eq!(done.as_slice()[0].tag, 1);
        assert_eq!(
            fs::metadata(&path).unwrap().len(),
            4096,
            "canceled write never ran"
        );
        assert_eq!(b.stats().ops_in_use, 0);
        assert_eq!(b.stats().requests_in_use, 0);
    }
}

#[test]
fn deregistering_a_region_in_use_is_refused() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.bin");
        let mut b = backend(engine, &[("queue_depth", "1")]);
        let file = register_path(&mut b, &path, rw_create()).unwrap();
        let src = vec![4u8; 1 << 16];
        let token = register_dram(&mut b, &src);
        let rs: Vec<_> = (0..16)
            .map(|i| range(src.as_ptr() as u64 + i * 4096, i * 4096, 4096, token, file))
            .collect();
        let mut done = Completions::with_capacity(1);
        b.post_t(Endpoint::Local, &[post(1, Op::Write, &rs)], &mut done)
            .unwrap();
        assert!(matches!(
            b.deregister_t(MemKind::File, file),
            Err(Error::NotAllowed { .. })
        ));
        wait_for(&mut b, &mut done, 1);
        b.deregister_t(MemKind::File, file).unwrap();
        b.deregister_t(MemKind::Dram, token).unwrap();
        assert!(matches!(
            b.deregister_t(MemKind::File, file),
            Err(Error::NotFound { .. })
        ));
    }
}

#[test]
fn empty_requests_complete_at_once() {
    for engine in engines() {
        let mut b = backend(engine, &[]);
        let mut done = Completions::with_capacity(1);
        b.post_t(Endpoint::Local, &[post(42, Op::Read, &[])], &mut done)
            .unwrap();
        assert_eq!(done.as_slice().len(), 1);
        assert_eq!(done.as_slice()[0].tag, 42);
    }
}

#[test]
fn query_reports_files_and_absent_ones() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let present = dir.path().join("here.bin");
        fs::write(&present, vec![0u8; 1234]).unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&present, fs::Permissions::from_mode(0o640)).unwrap();
        let missing = dir.path().join("gone.bin");
        let open = tempfile::tempfile().unwrap();
        open.set_len(77).unwrap();
        let mut b = backend(engine, &[]);
        let descs = [
            Desc::new(0, 0, 0),
            Desc::new(0, 0, 0),
            Desc::new(0, 0, open.as_raw_fd() as u64),
            Desc::new(0, 0, 1_000_000),
        ];
        let paths = [Some(present.as_path()), Some(missing.as_path()), None, None];
        let got = b.query(MemKind::File, &descs, &paths).unwrap();
        assert_eq!(got.len(), 4);
        assert!(got[0].exists);
        assert_eq!(got[0].size, 1234);
        assert_eq!(got[0].mode & 0o777, 0o640);
        assert_eq!(got[0].mode & libc::S_IFMT, libc::S_IFREG);
        let mtime = fs::metadata(&present).unwrap().modified().unwrap();
        let mtime_ns = mtime
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64;
        assert_eq!(got[0].mtime_ns, mtime_ns);
        assert!(!got[1].exists, "missing file is absent, not an error");
        assert!(got[2].exists);
        assert_eq!(got[2].size, 77);
        assert!(!got[3].exists, "closed descriptor is absent");
        assert!(matches!(
            b.query(MemKind::Dram, &descs[..1], &[None]),
            Err(Error::NotSupported { .. })
        ));
    }
}

#[test]
fn bad_parameters_are_refused() {
    let specs = ferry_posix::PARAMS;
    let mut given = ferry_backend_api::Params::new();
    given.insert("bogus".into(), "1".into());
    assert!(ferry_backend_api::effective_params("POSIX", specs, &given).is_err());
    for (key, value) in [
        ("engine", "libaio"),
        ("queue_depth", "0"),
        ("queue_depth", "many"),
        ("register_buffers", "maybe"),
        ("access_hint", "willneed"),
    ] {
        let mut given = ferry_backend_api::Params::new();
        given.insert(key.into(), value.into());
        let params = ferry_backend_api::effective_params("POSIX", specs, &given).unwrap();
        let err = ferry_posix::PosixBackend::new(params)
            .err()
            .expect("refused");
        assert!(err.to_string().contains(key), "{err}");
    }
    // Through the factory too.
    use ferry_backend_api::{BackendFactory, BackendInit};
    let factory = ferry_posix::PosixFactory;
    assert_eq!(factory.name(), "POSIX");
    let params = ferry_backend_api::Params::new();
    let backend = factory
        .create(&BackendInit {
            agent_name: "t",
            params: &params,
        })
        .unwrap();
    assert_eq!(
        backend.params().get("engine").map(String::as_str),
        Some("auto")
    );
    assert!(backend.capabilities().supports(MemKind::File));
    assert!(!backend.capabilities().remote);
}

#[test]
fn a_deregistered_memory_region_is_refused_at_post_and_moves_no_byte() {
    for engine in engines() {
        // Plain memory and (with io_uring) a fixed buffer: both are tracked.
        for fixed in ["false", "true"] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("stale.bin");
            fs::write(&path, vec![0x11u8; 8192]).unwrap();
            let mut b = backend(engine, &[("register_buffers", fixed)]);
            let file = register_path(&mut b, &path, rw_create()).unwrap();
            let src = vec![0xEEu8; 8192];
            let token = register_dram(&mut b, &src);
            let ranges = [range(src.as_ptr() as u64, 0, 8192, token, file)];
            // In use: refused; completed: allowed.
            let mut done = Completions::with_capacity(2);
            b.post_t(Endpoint::Local, &[post(1, Op::Write, &ranges)], &mut done)
                .unwrap();
            let busy = b.deregister_t(MemKind::Dram, token);
            if done.is_empty() {
                assert!(
                    matches!(busy, Err(Error::NotAllowed { .. })),
                    "{engine} fixed={fixed}: {busy:?}"
                );
                wait_for(&mut b, &mut done, 1);
                b.deregister_t(MemKind::Dram, token).unwrap();
            } else {
                // Finished inside post (possible with the thread pool): deregistered.
                busy.unwrap();
            }
            assert_all_ok(done.as_slice());
            fs::write(&path, vec![0x11u8; 8192]).unwrap();
            // Posting with the stale token: refused whole, nothing written.
            let mut done = Completions::with_capacity(1);
            let err = b
                .post_t(Endpoint::Local, &[post(2, Op::Write, &ranges)], &mut done)
                .unwrap_err();
            assert!(
                matches!(err, Error::NotFound { .. }),
                "{engine} fixed={fixed}: {err}"
            );
            assert!(done.is_empty());
            assert_eq!(
                fs::read(&path).unwrap(),
                vec![0x11u8; 8192],
                "file untouched"
            );
            // A second deregistration names the problem too.
            let again = b.deregister_t(MemKind::Dram, token);
            assert!(matches!(again, Err(Error::NotFound { .. })), "{again:?}");
        }
    }
}
