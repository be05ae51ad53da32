//! Two UCX backends of one process acting as two agents: `a` (initiator) and `b`
//! (target), each with one registered buffer and knowing the other, plus the ranges,
//! posts and the post-and-wait the in-process tests share.

use std::time::Duration;

use ferry_backend_api::{Backend, Completion, Completions, Endpoint, MemKind, Op, Post, Range};
use ferry_ucx::UcxBackend;

use super::*;

/// How long a test waits for its completions.
pub const PAIR_TIMEOUT: Duration = Duration::from_secs(30);

/// Agent `a` (initiator) and `b` (target), each with one buffer.
pub struct Pair {
    pub a: UcxBackend,
    pub b: UcxBackend,
    pub a_buf: Buffer,
    pub b_buf: Buffer,
    pub a_token: u64,
    pub b_token: u64,
    /// The public metadata (packed rkey) of `b_buf`.
    pub b_md: Vec<u8>,
    pub peer_b: PeerId,
}

/// A pair over `transports` with buffers of `len` bytes and extra parameters per side.
pub fn pair_with(
    transports: &str,
    len: usize,
    extra_a: &[(&str, &str)],
    extra_b: &[(&str, &str)],
) -> Pair {
    let mut a = backend("agent-a", transports, extra_a);
    let mut b = backend("agent-b", transports, extra_b);
    let a_buf = Buffer::new(len);
    let b_buf = Buffer::new(len);
    let (a_token, a_md) = register(&mut a, &a_buf);
    let (b_token, b_md) = register(&mut b, &b_buf);
    let peer_b = peer_id(1);
    load(
        &mut a,
        peer_b,
        "agent-b",
        &b.conn_info().expect("conn info"),
        &[(b_token, b_md.clone())],
    );
    load(
        &mut b,
        peer_id(1),
        "agent-a",
        &a.conn_info().expect("conn info"),
        &[(a_token, a_md)],
    );
    Pair {
        a,
        b,
        a_buf,
        b_buf,
        a_token,
        b_token,
        b_md,
        peer_b,
    }
}

/// `len` bytes from offset `local_off` of `a_buf` to offset `remote_off` of `b_buf`.
pub fn range(p: &Pair, local_off: usize, remote_off: usize, len: usize) -> Range {
    Range {
        local_addr: p.a_buf.addr() + local_off as u64,
        remote_addr: p.b_buf.addr() + remote_off as u64,
        len: len as u64,
        local_dev: 0,
        remote_dev: 0,
        local_token: p.a_token,
        remote_token: p.b_token,
    }
}

/// A DRAM → DRAM request.
pub fn post<'a>(tag: u64, op: Op, ranges: &'a [Range], notif: Option<&'a [u8]>) -> Post<'a> {
    Post {
        tag,
        op,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::Dram,
        ranges,
        notif,
    }
}

/// Post to `b` and wait: exactly one completion per request, returned.
pub fn run(p: &mut Pair, posts: &[Post<'_>]) -> Vec<Completion> {
    let mut done = Completions::with_capacity(posts.len());
    p.a.post_t(Endpoint::Peer(p.peer_b), posts, &mut done)
        .expect("post");
    let mut got: Vec<Completion> = done.as_slice().to_vec();
    let pending: Vec<u64> = posts
        .iter()
        .map(|x| x.tag)
        .filter(|t| !got.iter().any(|c| c.tag == *t))
        .collect();
    if !pending.is_empty() {
        got.extend(wait_for(&mut [&mut p.a, &mut p.b], &pending, PAIR_TIMEOUT));
    }
    assert_eq!(got.len(), posts.len(), "one completion per request");
    got
}

/// [`run`], every request succeeding.
pub fn run_ok(p: &mut Pair, posts: &[Post<'_>]) {
    for c in run(p, posts) {
        assert_eq!(c.result, Ok(()), "request {} failed", c.tag);
    }
}
