//! End-to-end through `ferry::Agent` on the POSIX backend: DRAM ↔ FILE requests built
//! from descriptor lists, resolved, merged and dispatched by the executor, against both
//! engines (io_uring and the thread pool).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferry::{
    Agent, AgentConfig, BackendId, Desc, Error, FileMode, MemKind, Op, Params, Side, XferId,
    XferStatus,
};
use ferry_testkit::ci::under_ci as ci;
use ferry_tests::{register, unique, Buffer, Rng};

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let dir =
            std::env::temp_dir().join(unique(&format!("ferry-posix-e2e-{}", std::process::id())));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An agent with a POSIX backend on `engine`.
fn agent(engine: &str) -> Option<(Agent, BackendId)> {
    let agent = Agent::new(AgentConfig::named(unique("posix"))).expect("agent");
    let mut params = Params::new();
    params.insert("engine".into(), engine.into());
    params.insert("queue_depth".into(), "16".into());
    match agent.create_backend("POSIX", &params) {
        Ok(id) => Some((agent, id)),
        Err(e) if engine == "uring" && !ci() => {
            eprintln!("skipping the io_uring engine: {e}");
            None
        }
        Err(e) => panic!("POSIX backend with engine {engine}: {e}"),
    }
}

fn engines() -> [&'static str; 2] {
    ["threads", "uring"]
}

fn rw_create() -> FileMode {
    FileMode {
        write: true,
        create: true,
        ..FileMode::default()
    }
}

/// Post and wait (sleeping between checks, bounded) for a final status.
fn run(agent: &Agent, x: XferId) -> ferry::Result<XferStatus> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut status = agent.post(x)?;
    while status == XferStatus::InProgress {
        assert!(Instant::now() < deadline, "request did not finish");
        std::thread::sleep(Duration::from_micros(200));
        status = agent.check(x)?;
    }
    Ok(status)
}

#[test]
fn random_pieces_across_files_write_and_read_back_byte_for_byte() {
    for engine in engines() {
        let Some((agent, _)) = agent(engine) else {
            continue;
        };
        let scratch = Scratch::new();
        let mut rng = Rng::new(21);
        let total = 256 * 1024;
        let src = Buffer::random(total, &mut rng);
        register(&agent, &src);
        let files = 3u64;
        let mut paths = Vec::new();
        for dev in 1..=files {
            let path = scratch.path(&format!("kv{dev}.bin"));
            agent
                .register_file(&path, rw_create(), Desc::new(0, 0, dev))
                .expect("register file");
            paths.push(path);
        }
        // Random pieces of src to random, non-overlapping places in the three files.
        let mut local = Vec::new();
        let mut remote = Vec::new();
        let mut model = vec![Vec::<u8>::new(); files as usize];
        let mut at = 0usize;
        let mut file_cursor = vec![0u64; files as usize];
        while at < total {
            let len = (1 + rng.below(8192) as usize).min(total - at);
            let f = rng.below(files) as usize;
            let gap = rng.below(3000);
            let off = file_cursor[f] + gap;
            local.push(src.desc(at, len));
            remote.push(Desc::new(off, len as u64, f as u64 + 1));
            let m = &mut model[f];
            m.resize((off as usize + len).max(m.len()), 0);
            m[off as usize..off as usize + len].copy_from_slice(&src.bytes()[at..at + len]);
            file_cursor[f] = off + len as u64;
            at += len;
        }
        let x = agent
            .create(
                Op::Write,
                MemKind::Dram,
                &local,
                Side::Local,
                MemKind::File,
                &remote,
                None,
            )
            .unwrap();
        assert_eq!(run(&agent, x).unwrap(), XferStatus::Done, "{engine}");
        for (f, path) in paths.iter().enumerate() {
            assert_eq!(std::fs::read(path).unwrap(), model[f], "{engine}: file {f}");
        }
        // Read everything back into a fresh buffer at the same places.
        let back = Buffer::zeroed(total);
        register(&agent, &back);
        let local_back: Vec<Desc> = local
            .iter()
            .map(|d| Desc::new(d.addr - src.whole().addr + back.whole().addr, d.len, 0))
            .collect();
        let y = agent
            .create(
                Op::Read,
                MemKind::Dram,
                &local_back,
                Side::Local,
                MemKind::File,
                &remote,
                None,
            )
            .unwrap();
        assert_eq!(run(&agent, y).unwrap(), XferStatus::Done);
        assert_eq!(back.bytes(), src.bytes(), "{engine}: read-back differs");
        // Finished requests can be reposted.
        assert_eq!(run(&agent, y).unwrap(), XferStatus::Done);
        agent.release(x).unwrap();
        agent.release(y).unwrap();
    }
}

#[test]
fn adjacent_blocks_merge_into_one_range() {
    for engine in engines() {
        let Some((agent, _)) = agent(engine) else {
            continue;
        };
        let scratch = Scratch::new();
        let mut rng = Rng::new(5);
        let block = 4096;
        let src = Buffer::random(block * 64, &mut rng);
        register(&agent, &src);
        let path = scratch.path("merge.bin");
        agent
            .register_file(&path, rw_create(), Desc::new(0, 0, 9))
            .unwrap();
        let local: Vec<Desc> = (0..64).map(|i| src.desc(i * block, block)).collect();
        let remote: Vec<Desc> = (0..64)
            .map(|i| Desc::new((i * block) as u64, block as u64, 9))
            .collect();
        let x = agent
            .create(
                Op::Write,
                MemKind::Dram,
                &local,
                Side::Local,
                MemKind::File,
                &remote,
                None,
            )
            .unwrap();
        assert_eq!(agent.xfer_ranges(x).unwrap(), 1);
        assert_eq!(run(&agent, x).unwrap(), XferStatus::Done);
        assert_eq!(std::fs::read(&path).unwrap(), src.bytes());
    }
}

#[test]
fn direct_io_aligned_works_and_misaligned_is_refused_naming_the_descriptor() {
    for engine in engines() {
        let Some((agent, _)) = agent(engine) else {
            continue;
        };
        let scratch = Scratch::new();
        let path = scratch.path("direct.bin");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let mode = FileMode {
            write: true,
            direct: true,
            ..FileMode::default()
        };
        if let Err(e) = agent.register_file(&path, mode, Desc::new(0, 0, 4)) {
            assert!(!ci(), "O_DIRECT refused under CI: {e}");
            eprintln!("skipping O_DIRECT: {e}");
            continue;
        }
        let mut rng = Rng::new(9);
        let raw = Buffer::random(64 * 1024 + 4096, &mut rng);
        register(&agent, &raw);
        let skew = (raw.whole().addr as usize).next_multiple_of(4096) - raw.whole().addr as usize;
        let aligned = raw.desc(skew, 64 * 1024);
        let x = agent
            .create(
                Op::Write,
                MemKind::Dram,
                &[aligned],
                Side::Local,
                MemKind::File,
                &[Desc::new(8192, 64 * 1024, 4)],
                None,
            )
            .unwrap();
        assert_eq!(run(&agent, x).unwrap(), XferStatus::Done);
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(
            &on_disk[8192..8192 + 64 * 1024],
            &raw.bytes()[skew..skew + 64 * 1024]
        );

        // Misaligned memory address on descriptor #1.
        let bad_local = [raw.desc(skew, 4096), raw.desc(skew + 4096 * 2 + 1, 4096)];
        let remote = [Desc::new(0, 4096, 4), Desc::new(65536, 4096, 4)];
        // Refused when the request is built (not at post, where it would fail a batch).
        let err = agent
            .create(
                Op::Write,
                MemKind::Dram,
                &bad_local,
                Side::Local,
                MemKind::File,
                &remote,
                None,
            )
            .unwrap_err();
        match &err {
            Error::InvalidParam { reason, .. } => {
                assert!(
                    reason.contains("O_DIRECT") && reason.contains("direct.bin"),
                    "{err}"
                );
            }
            other => panic!("{engine}: unexpected {other}"),
        }
        // The agent stays usable.
        assert_eq!(run(&agent, x).unwrap(), XferStatus::Done);
    }
}

#[test]
fn short_read_and_read_only_write_fail_with_range_and_errno() {
    for engine in engines() {
        let Some((agent, _)) = agent(engine) else {
            continue;
        };
        let scratch = Scratch::new();
        let path = scratch.path("small.bin");
        std::fs::write(&path, vec![8u8; 5000]).unwrap();
        agent
            .register_file(&path, FileMode::default(), Desc::new(0, 0, 2))
            .unwrap();
        let dst = Buffer::zeroed(16384);
        register(&agent, &dst);
        let x = agent
            .create(
                Op::Read,
                MemKind::Dram,
                &[dst.desc(0, 1000), dst.desc(2000, 8000)],
                Side::Local,
                MemKind::File,
                &[Desc::new(0, 1000, 2), Desc::new(1000, 8000, 2)],
                None,
            )
            .unwrap();
        let err = run(&agent, x).unwrap_err();
        assert!(
            matches!(err, Error::Backend { desc: Some(1), .. }),
            "{engine}: {err}"
        );
        assert!(err.to_string().contains("short read"), "{err}");
        assert!(
            err.to_string().contains("small.bin"),
            "the error names the file: {err}"
        );
        // WRITE to a file opened read-only: EBADF on range 0.
        let y = agent
            .create(
                Op::Write,
                MemKind::Dram,
                &[dst.desc(0, 100)],
                Side::Local,
                MemKind::File,
                &[Desc::new(0, 100, 2)],
                None,
            )
            .unwrap();
        let err = run(&agent, y).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Backend {
                    errno: libc_ebadf::EBADF,
                    desc: Some(0),
                    ..
                }
            ),
            "{engine}: {err}"
        );
        assert!(
            err.to_string().contains("small.bin"),
            "the error names the file: {err}"
        );
        // A good request afterwards.
        let z = agent
            .create(
                Op::Read,
                MemKind::Dram,
                &[dst.desc(0, 5000)],
                Side::Local,
                MemKind::File,
                &[Desc::new(0, 5000, 2)],
                None,
            )
            .unwrap();
        assert_eq!(run(&agent, z).unwrap(), XferStatus::Done);
        assert_eq!(&dst.bytes()[..5000], &[8u8; 5000][..]);
    }
}

/// EBADF without a libc dependency in this crate.
mod libc_ebadf {
    pub const EBADF: i32 = 9;
}

#[test]
fn missing_file_registration_fails_and_query_reports_absent() {
    for engine in engines() {
        let Some((agent, backend)) = agent(engine) else {
            continue;
        };
        let scratch = Scratch::new();
        let missing = scratch.path("missing.bin");
        let err = agent
            .register_file(&missing, FileMode::default(), Desc::new(0, 0, 1))
            .unwrap_err();
        assert!(err.to_string().contains("missing.bin"), "{err}");
        let present = scratch.path("present.bin");
        std::fs::write(&present, vec![1u8; 321]).unwrap();
        let paths: [Option<&Path>; 2] = [Some(present.as_path()), Some(missing.as_path())];
        let got = agent
            .query(
                backend,
                MemKind::File,
                &[Desc::default(), Desc::default()],
                &paths,
            )
            .unwrap();
        assert!(got[0].exists);
        assert_eq!(got[0].size, 321);
        assert!(!got[1].exists);
    }
}

/// Issue 8 §1 on POSIX: DRAM and FILE regions are local regions, so a request pins both
/// (deregistration refused while it lives), and a prepared list whose region was
/// deregistered fails `make` as stale: no byte reaches the file.
#[test]
fn requests_pin_dram_and_file_regions_and_stale_lists_move_nothing() {
    for engine in engines() {
        let Some((agent, _)) = agent(engine) else {
            continue;
        };
        let scratch = Scratch::new();
        let src = Buffer::random(8192, &mut Rng::new(81));
        let dram = register(&agent, &src);
        let path = scratch.path("pinned.bin");
        let file = agent
            .register_file(&path, rw_create(), Desc::new(0, 0, 1))
            .expect("register file");
        let x = agent
            .create(
                Op::Write,
                MemKind::Dram,
                &[src.whole()],
                Side::Local,
                MemKind::File,
                &[Desc::new(0, 8192, 1)],
                None,
            )
            .unwrap();
        for region in [dram, file] {
            let e = agent.deregister(region).unwrap_err();
            assert!(
                matches!(&e, Error::NotAllowed { reason, .. } if reason.contains("in use")),
                "{engine}: {e}"
            );
        }
        assert_eq!(run(&agent, x).unwrap(), XferStatus::Done, "{engine}");
        assert_eq!(std::fs::read(&path).unwrap(), src.bytes(), "{engine}");
        agent.release(x).unwrap();

        // A list prepared before its DRAM region went away is stale at make.
        let other = Buffer::random(4096, &mut Rng::new(82));
        let other_region = register(&agent, &other);
        let local = agent
            .prep(Side::Local, MemKind::Dram, &[other.whole()])
            .unwrap();
        let remote = agent
            .prep(Side::Local, MemKind::File, &[Desc::new(8192, 4096, 1)])
            .unwrap();
        agent.deregister(other_region).unwrap();
        let e = agent
            .make(Op::Write, local, &[], remote, &[], None)
            .unwrap_err();
        assert_eq!(
            e,
            Error::StaleRegion {
                region: other_region,
                descriptor: 0
            },
            "{engine}"
        );
        // Same for the FILE side.
        agent.deregister(file).unwrap();
        let local = agent
            .prep(Side::Local, MemKind::Dram, &[src.desc(0, 4096)])
            .unwrap();
        let e = agent
            .make(Op::Write, local, &[], remote, &[], None)
            .unwrap_err();
        assert!(
            matches!(e, Error::StaleRegion { region, .. } if region == file),
            "{engine}: {e}"
        );
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            8192,
            "{engine}: nothing written past the first request"
        );
    }
}
