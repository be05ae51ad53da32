//! Helpers shared by the POSIX backend tests: engine selection (with the io_uring
//! probe), aligned buffers, the test kit's PRNG, and a post-and-wait driver.

#![allow(dead_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use ferry_backend_api::{
    effective_params, Backend, Completion, Completions, Desc, Endpoint, FileMode, MemKind, Op,
    Params, Post, Range, RegionSpec, Result,
};
use ferry_posix::{PosixBackend, PARAMS};

/// The engines to run a test against. io_uring is included when the kernel allows it;
/// when it does not, the test fails under `CI=true` and says why it skips otherwise.
pub fn engines() -> Vec<&'static str> {
    let mut list = vec!["threads"];
    match ferry_posix::uring_supported() {
        Ok(()) => list.push("uring"),
        Err(why) => ferry_testkit::ci::skip("the io_uring engine", why),
    }
    list
}

/// A backend with `engine` and extra parameters over the defaults.
pub fn backend(engine: &str, extra: &[(&str, &str)]) -> PosixBackend {
    let mut given = Params::new();
    given.insert("engine".into(), engine.into());
    for (k, v) in extra {
        given.insert((*k).into(), (*v).into());
    }
    let params = effective_params("POSIX", PARAMS, &given).expect("params");
    PosixBackend::new(params).expect("backend")
}

/// `len` bytes whose start is aligned to 4096, inside an owned Vec.
pub struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    pub fn new(len: usize) -> AlignedBuf {
        let storage = vec![0u8; len + 4096];
        let start = storage.as_ptr().align_offset(4096);
        AlignedBuf {
            storage,
            start,
            len,
        }
    }
    pub fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
    pub fn addr(&self) -> u64 {
        self.as_slice().as_ptr() as u64
    }
}

pub use ferry_testkit::Rng;

/// Register a DRAM region covering `buf`.
pub fn register_dram(b: &mut PosixBackend, buf: &[u8]) -> u64 {
    b.register_t(&RegionSpec {
        kind: MemKind::Dram,
        desc: Desc::of_slice(buf),
        path: None,
    })
    .expect("register DRAM")
    .token
}

/// Register a whole file by path.
pub fn register_path(b: &mut PosixBackend, path: &Path, mode: FileMode) -> Result<u64> {
    b.register_t(&RegionSpec {
        kind: MemKind::File,
        desc: Desc::new(0, 0, 0),
        path: Some((path, mode)),
    })
    .map(|r| r.token)
}

/// Read-write, create.
pub fn rw_create() -> FileMode {
    FileMode {
        write: true,
        create: true,
        ..FileMode::default()
    }
}

/// A range: `len` bytes at memory `mem` ↔ file offset `off`.
pub fn range(mem: u64, off: u64, len: u64, mem_token: u64, file_token: u64) -> Range {
    Range {
        local_addr: mem,
        remote_addr: off,
        len,
        local_dev: 0,
        remote_dev: 0,
        local_token: mem_token,
        remote_token: file_token,
    }
}

/// A DRAM ↔ FILE post.
pub fn post(tag: u64, op: Op, ranges: &[Range]) -> Post<'_> {
    Post {
        tag,
        op,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::File,
        ranges,
        notif: None,
    }
}

/// Post `batch` and wait (sleeping, bounded) until every request completed; the
/// completions sorted by tag.
pub fn run(b: &mut PosixBackend, batch: &[Post<'_>]) -> Result<Vec<Completion>> {
    let mut done = Completions::with_capacity(batch.len());
    b.post_t(Endpoint::Local, batch, &mut done)?;
    wait_for(b, &mut done, batch.len());
    let mut out = done.as_slice().to_vec();
    out.sort_by_key(|c| c.tag);
    Ok(out)
}

/// Wait until `done` holds `want` completions (panics after 60 s).
pub fn wait_for(b: &mut PosixBackend, done: &mut Completions, want: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while done.len() < want {
        assert!(
            Instant::now() < deadline,
            "timed out: {} of {want} completions",
            done.len()
        );
        b.wait(done, Duration::from_millis(100)).expect("wait");
    }
    // Exactly one completion per request: nothing more may trickle in.
    b.progress(done);
    assert_eq!(done.len(), want, "extra completions");
}

/// The backend's unsafe calls for tests, under the test kit's promise.
pub use ferry_testkit::backend::TestCalls;
