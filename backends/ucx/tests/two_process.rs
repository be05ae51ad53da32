//! Two processes: this test binary re-executes itself as the target agent (marked by
//! the `FERRY_UCX_CHILD` variable) and the two exchange metadata over a TCP socket on
//! 127.0.0.1. Covered: READ and WRITE of random sizes verified byte for byte, a
//! notification that the target checks against its memory the moment it arrives, a
//! shuffled 1024-range batch, scattered small WRITEs and READs batched into active
//! messages (and mixed with large ranges), and a target killed mid-transfer, batched writes with
//! acks pending included (its requests fail with
//! remote-disconnect within a bounded time; after a restart and reload, transfers work
//! again). Runs under the default transports and `transports=tcp`, on heap memory and
//! on memory both sides allocated through the backend (`Backend::alloc`, UCX's
//! `ucp_mem_map(ALLOCATE)`), which is freed at the end of each side.
//!
//! `harness = false`: `main` runs the scenarios (or the child role) itself.

// Reason: the tests call the backend's unsafe methods (through `common::TestCalls`).
#![allow(unsafe_code)]

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ferry_backend_api::{
    Backend, Completions, Endpoint, Error, FailureKind, MemKind, Op, PeerId, Post, Range,
};
use ferry_ucx::UcxBackend;

const CHILD_VAR: &str = "FERRY_UCX_CHILD";
/// Set (to anything) in the child when its buffer is to be allocated through UCX.
const ALLOC_VAR: &str = "FERRY_UCX_CHILD_ALLOC";
const TIMEOUT: Duration = Duration::from_secs(30);
/// The target's buffer: 64 MiB, filled with `pattern(READ_SEED)` at start.
const TARGET_LEN: usize = 64 << 20;
const READ_SEED: u64 = 42;

fn pattern(seed: u64, bytes: &mut [u8]) {
    Rng::new(seed).fill(bytes);
}

// ---- memory: a heap buffer or one allocated through the backend ---------------------

enum Mem {
    Heap(Buffer),
    Ucx { addr: u64, len: usize },
}

impl Mem {
    fn new(ucx: &mut UcxBackend, len: usize, through_ucx: bool) -> Mem {
        if !through_ucx {
            return Mem::Heap(Buffer::new(len));
        }
        let allocation = ucx
            .alloc(MemKind::Dram, len as u64)
            .expect("UCX allocation");
        assert_eq!(allocation.len, len as u64);
        Mem::Ucx {
            addr: allocation.addr,
            len,
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Mem::Heap(b) => b.addr(),
            Mem::Ucx { addr, .. } => *addr,
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Mem::Heap(b) => &mut b.0,
            // SAFETY: `len` bytes the backend allocated and keeps mapped until `free`
            // (called only by `release`, which consumes the Mem); read and written only
            // while no transfer into them is in flight.
            Mem::Ucx { addr, len } => unsafe {
                std::slice::from_raw_parts_mut(*addr as *mut u8, *len)
            },
        }
    }

    fn register(&self, ucx: &mut UcxBackend) -> (u64, Vec<u8>) {
        let len = match self {
            Mem::Heap(b) => b.len(),
            Mem::Ucx { len, .. } => *len,
        };
        let r = ucx
            .register_t(&ferry_backend_api::RegionSpec {
                kind: MemKind::Dram,
                desc: ferry_backend_api::Desc::new(self.addr(), len as u64, 0),
                path: None,
            })
            .expect("register");
        (r.token, r.public_md)
    }

    /// Free an allocation (after its registration is gone): nothing is left allocated.
    fn release(self, ucx: &mut UcxBackend) {
        if let Mem::Ucx { addr, .. } = self {
            // SAFETY: deregistered, and nothing touches the bytes after this.
            unsafe { ucx.free(MemKind::Dram, addr) }.expect("free");
        }
        assert_eq!(ucx.allocations(), 0, "an allocation outlived its free");
    }
}

// ---- framing over the socket --------------------------------------------------------

fn send_frame(stream: &mut TcpStream, bytes: &[u8]) {
    stream
        .write_all(&(bytes.len() as u32).to_le_bytes())
        .and_then(|_| stream.write_all(bytes))
        .expect("socket write");
}

fn recv_frame(stream: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).expect("socket read");
    let mut bytes = vec![0u8; u32::from_le_bytes(len) as usize];
    stream.read_exact(&mut bytes).expect("socket read");
    bytes
}

// ---- child (target) ---------------------------------------------------------------

fn child_main(addr: &str) {
    let transports = std::env::var("FERRY_UCX_TRANSPORTS").unwrap_or_default();
    let error_handling = std::env::var("FERRY_UCX_ERROR_HANDLING").unwrap_or("peer".into());
    let through_ucx = std::env::var_os(ALLOC_VAR).is_some();
    // The heap variant is declared before the backend so it is dropped after it: the
    // backend unmaps the registration when dropped, and the memory must still be there.
    let mut heap = (!through_ucx).then(|| Buffer::new(TARGET_LEN));
    let mut ucx = backend(
        "target",
        &transports,
        &[("error_handling", error_handling.as_str())],
    );
    let mut mem = match heap.take() {
        Some(buffer) => Mem::Heap(buffer),
        None => Mem::new(&mut ucx, TARGET_LEN, true),
    };
    pattern(READ_SEED, mem.bytes());
    let (token, md) = mem.register(&mut ucx);
    let mut stream = TcpStream::connect(addr).expect("child connects to parent");
    send_frame(&mut stream, &ucx.conn_info().expect("conn info"));
    send_frame(&mut stream, &token.to_le_bytes());
    send_frame(&mut stream, &md);
    send_frame(&mut stream, &mem.addr().to_le_bytes());

    // Serve: progress, and check each notification's claim against memory at once.
    let mut done = Completions::with_capacity(16);
    let mut inbox = Inbox::default();
    let mut expected = Vec::new();
    let mut looked = Instant::now();
    loop {
        // A parent that died (a killed test run) closes the socket: stop serving rather
        // than spin on as an orphan.
        if looked.elapsed() > Duration::from_millis(100) {
            looked = Instant::now();
            if parent_gone(&stream) {
                eprintln!("target: the initiator's socket closed; exiting");
                std::process::exit(3);
            }
        }
        ucx.progress(&mut done);
        done.clear();
        ucx.drain_notifications(&mut inbox);
        for (from, payload) in inbox.0.drain(..) {
            let text = String::from_utf8(payload).expect("utf-8 command");
            let words: Vec<&str> = text.split_whitespace().collect();
            match words.as_slice() {
                ["W", off, len, seed] => {
                    let (off, len): (usize, usize) = (off.parse().unwrap(), len.parse().unwrap());
                    expected.resize(len, 0);
                    pattern(seed.parse().unwrap(), &mut expected);
                    let ok = mem.bytes()[off..off + len] == expected[..];
                    send_frame(&mut stream, if ok { b"ok" } else { b"bad" });
                }
                ["Q"] => {
                    ucx.deregister_t(MemKind::Dram, token).expect("deregister");
                    mem.release(&mut ucx);
                    send_frame(&mut stream, format!("bye {from}").as_bytes());
                    return;
                }
                other => panic!("child: unknown command {other:?}"),
            }
        }
        std::thread::yield_now();
    }
}

/// Whether the initiator closed its end (it never sends on the socket, so any read
/// other than "would block" means it is gone).
fn parent_gone(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut byte = [0u8; 1];
    let gone =
        !matches!(stream.peek(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    stream.set_nonblocking(false).is_err() || gone
}

// ---- parent (initiator) -------------------------------------------------------------

struct Target {
    child: Child,
    stream: TcpStream,
    token: u64,
    addr: u64,
    conn_info: Vec<u8>,
    md: Vec<u8>,
}

/// How one scenario runs: transports, endpoint error handling, where the memory is.
#[derive(Clone, Copy)]
struct Variant {
    transports: &'static str,
    error_handling: &'static str,
    /// Both sides' buffers allocated through UCX (`Backend::alloc`).
    alloc: bool,
}

fn spawn_target(v: Variant, ucx: &mut UcxBackend, peer: PeerId) -> Target {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .env(CHILD_VAR, listener.local_addr().unwrap().to_string())
        .env("FERRY_UCX_TRANSPORTS", v.transports)
        .env("FERRY_UCX_ERROR_HANDLING", v.error_handling)
        .stdin(Stdio::null());
    if v.alloc {
        command.env(ALLOC_VAR, "1");
    }
    let child = command.spawn().expect("spawn target process");
    let (mut stream, _) = listener.accept().expect("child connects");
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    let conn_info = recv_frame(&mut stream);
    let token = u64::from_le_bytes(recv_frame(&mut stream).try_into().unwrap());
    let md = recv_frame(&mut stream);
    let addr = u64::from_le_bytes(recv_frame(&mut stream).try_into().unwrap());
    load(ucx, peer, "target", &conn_info, &[(token, md.clone())]);
    Target {
        child,
        stream,
        token,
        addr,
        conn_info,
        md,
    }
}

fn transfer(ucx: &mut UcxBackend, peer: PeerId, posts: &[Post<'_>]) {
    let mut done = Completions::with_capacity(posts.len());
    ucx.post_t(Endpoint::Peer(peer), posts, &mut done)
        .expect("post");
    let tags: Vec<u64> = posts
        .iter()
        .map(|p| p.tag)
        .filter(|t| !done.as_slice().iter().any(|c| c.tag == *t))
        .collect();
    let mut all = done.as_slice().to_vec();
    all.extend(wait_for(&mut [ucx], &tags, TIMEOUT));
    for c in all {
        assert_eq!(c.result, Ok(()), "request {} failed", c.tag);
    }
}

fn label(v: Variant) -> String {
    format!(
        "{}, error_handling={}{}",
        if v.transports.is_empty() {
            "default"
        } else {
            v.transports
        },
        v.error_handling,
        if v.alloc { ", UCX-allocated" } else { "" }
    )
}

fn scenario(v: Variant) {
    let (transports, error_handling) = (v.transports, v.error_handling);
    let label = label(v);
    let mut ucx = backend(
        "initiator",
        transports,
        &[("error_handling", error_handling)],
    );
    let mut local = Mem::new(&mut ucx, TARGET_LEN, v.alloc);
    let (ltok, _) = local.register(&mut ucx);
    let peer = peer_id(1);
    let mut t = spawn_target(v, &mut ucx, peer);
    ucx.connect(peer).expect("connect");
    let (summary, _) = ucx.endpoint_transports(Endpoint::Peer(peer)).unwrap();
    eprintln!(
        "[{label}] UCX {}: initiator → target uses {summary}",
        ucx.ucx_version()
    );
    if std::env::var_os("FERRY_UCX_PRINT_EP").is_some() {
        eprintln!(
            "{}",
            ucx.endpoint_transports(Endpoint::Peer(peer)).unwrap().1
        );
    }

    let mut whole = vec![0u8; TARGET_LEN];
    pattern(READ_SEED, &mut whole);
    let mut rng = Rng::new(0xfeed ^ transports.len() as u64);
    let local_addr = local.addr();
    let range = move |lo: usize, ro: usize, len: usize, rtok: u64, raddr: u64| Range {
        local_addr: local_addr + lo as u64,
        remote_addr: raddr + ro as u64,
        len: len as u64,
        local_dev: 0,
        remote_dev: 0,
        local_token: ltok,
        remote_token: rtok,
    };

    // READ random sizes from the target's known pattern.
    for round in 0..16u64 {
        let len = 1 + rng.below(if round % 4 == 0 {
            TARGET_LEN as u64
        } else {
            100_000
        }) as usize;
        let ro = rng.below((TARGET_LEN - len + 1) as u64) as usize;
        let ranges = [range(0, ro, len, t.token, t.addr)];
        transfer(&mut ucx, peer, &[post(round, Op::Read, &ranges, None)]);
        assert!(
            local.bytes()[..len] == whole[ro..ro + len],
            "[{label}] READ of {len} bytes at {ro} differs"
        );
    }

    // WRITE random sizes, each with a notification the target checks on arrival.
    for round in 0..16u64 {
        let len = 1 + rng.below(if round % 4 == 0 {
            TARGET_LEN as u64
        } else {
            100_000
        }) as usize;
        let ro = rng.below((TARGET_LEN - len + 1) as u64) as usize;
        let seed = 1000 + round;
        pattern(seed, &mut local.bytes()[..len]);
        let ranges = [range(0, ro, len, t.token, t.addr)];
        let notif = format!("W {ro} {len} {seed}");
        transfer(
            &mut ucx,
            peer,
            &[post(
                100 + round,
                Op::Write,
                &ranges,
                Some(notif.as_bytes()),
            )],
        );
        assert_eq!(
            recv_frame(&mut t.stream),
            b"ok",
            "[{label}] target saw incomplete data at notification"
        );
    }

    // A shuffled batch of 1024 × 4 KiB ranges, checked by the target too.
    let mut order: Vec<usize> = (0..1024).collect();
    rng.shuffle(&mut order);
    let mut expected = vec![0u8; 1024 * 4096];
    pattern(7, &mut expected);
    for (i, &j) in order.iter().enumerate() {
        local.bytes()[j * 4096..(j + 1) * 4096]
            .copy_from_slice(&expected[i * 4096..(i + 1) * 4096]);
    }
    let ranges: Vec<Range> = order
        .iter()
        .enumerate()
        .map(|(i, &j)| range(j * 4096, i * 4096, 4096, t.token, t.addr))
        .collect();
    let notif = format!("W 0 {} 7", 1024 * 4096);
    transfer(
        &mut ucx,
        peer,
        &[post(500, Op::Write, &ranges, Some(notif.as_bytes()))],
    );
    assert_eq!(
        recv_frame(&mut t.stream),
        b"ok",
        "[{label}] shuffled batch differs at the target"
    );

    // Scattered small ranges (1..=2000 bytes, shuffled) tiling 512 KiB, mixed with four
    // 64 KiB ranges: the small ones travel batched in active messages.
    assert_eq!(
        ucx.batches_to(peer),
        Some(true),
        "[{label}] small writes are batched on shared memory and tcp"
    );
    let base = 8 << 20;
    let total = 768 << 10;
    pattern(11, &mut local.bytes()[..total]);
    let mut ranges: Vec<Range> = Vec::new();
    let mut at = 0;
    while at < 512 << 10 {
        let len = (1 + rng.below(2000) as usize).min((512 << 10) - at);
        ranges.push(range(at, base + at, len, t.token, t.addr));
        at += len;
    }
    for i in 0..4 {
        let off = (512 << 10) + i * (64 << 10);
        ranges.push(range(off, base + off, 64 << 10, t.token, t.addr));
    }
    rng.shuffle(&mut ranges);
    let notif = format!("W {base} {total} 11");
    transfer(
        &mut ucx,
        peer,
        &[post(600, Op::Write, &ranges, Some(notif.as_bytes()))],
    );
    assert_eq!(
        recv_frame(&mut t.stream),
        b"ok",
        "[{label}] batched small writes differ at the target"
    );
    assert_eq!(ucx.batch_counts().in_flight, 0);
    // The same ranges READ back (the target checked them above).
    let mut written = vec![0u8; total];
    pattern(11, &mut written);
    local.bytes()[..total].fill(0);
    transfer(&mut ucx, peer, &[post(601, Op::Read, &ranges, None)]);
    assert!(
        local.bytes()[..total] == written[..],
        "[{label}] batched small reads differ"
    );

    if error_handling == "none" {
        // Without peer error handling a dead peer is not detected: stop here.
        ucx.notify(Endpoint::Peer(peer), b"Q").unwrap();
        let mut done = Completions::with_capacity(4);
        while ucx.in_flight() > 0 {
            ucx.progress(&mut done);
        }
        assert!(recv_frame(&mut t.stream).starts_with(b"bye"));
        assert!(t.child.wait().unwrap().success());
        ucx.deregister_t(MemKind::Dram, ltok).unwrap();
        local.release(&mut ucx);
        return;
    }

    // Kill the target in the middle of a stream of 64 MiB writes.
    let big = [range(0, 0, TARGET_LEN, t.token, t.addr)];
    let small: Vec<Range> = (0..1024)
        .map(|i| range(i * 64, ((i * 7919) % 1024) * 64, 64, t.token, t.addr))
        .collect();
    let mut done = Completions::with_capacity(64);
    let mut outstanding: Vec<u64> = Vec::new();
    // Batched small writes first: their acks are pending when the target dies.
    for tag in 1100..1104u64 {
        ucx.post_t(
            Endpoint::Peer(peer),
            &[post(tag, Op::Write, &small, None)],
            &mut done,
        )
        .expect("post before kill");
        outstanding.push(tag);
    }
    for tag in 1000..1008u64 {
        ucx.post_t(
            Endpoint::Peer(peer),
            &[post(tag, Op::Write, &big, None)],
            &mut done,
        )
        .expect("post before kill");
        outstanding.push(tag);
    }
    t.child.kill().expect("kill target");
    let killed_at = Instant::now();
    let _ = t.child.wait();
    let mut failures = 0;
    let mut finished = done.as_slice().to_vec();
    done.clear();
    // Keep posting until the backend notices; every request must complete.
    let mut tag = 2000u64;
    while killed_at.elapsed() < TIMEOUT {
        ucx.progress(&mut done);
        finished.extend_from_slice(done.as_slice());
        done.clear();
        if ucx.peer_down(peer) == Some(true)
            && outstanding
                .iter()
                .all(|t| finished.iter().any(|c| c.tag == *t))
        {
            break;
        }
        if outstanding.len() < 64 {
            let ranges = if tag.is_multiple_of(2) {
                &big[..]
            } else {
                &small[..]
            };
            match ucx.post_t(
                Endpoint::Peer(peer),
                &[post(tag, Op::Write, ranges, None)],
                &mut done,
            ) {
                Ok(()) => outstanding.push(tag),
                Err(Error::RemoteDisconnect { .. }) => {}
                Err(e) => panic!("[{label}] unexpected post error after kill: {e}"),
            }
            tag += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let detected_after = killed_at.elapsed();
    assert_eq!(
        ucx.peer_down(peer),
        Some(true),
        "[{label}] peer death not detected within {TIMEOUT:?}"
    );
    for t in &outstanding {
        let c = finished
            .iter()
            .find(|c| c.tag == *t)
            .unwrap_or_else(|| panic!("[{label}] request {t} never completed after the kill"));
        if let Err(f) = c.result {
            assert_eq!(
                f.kind,
                FailureKind::RemoteDisconnect,
                "[{label}] request {t}: {f:?}"
            );
            failures += 1;
        }
    }
    assert!(
        failures > 0,
        "[{label}] no request failed although the target died"
    );
    eprintln!(
        "[{label}] target killed: detected after {detected_after:?}, {failures} of {} requests failed with remote-disconnect",
        outstanding.len()
    );
    // Every batch message is accounted for once its send is reported.
    let deadline = Instant::now() + TIMEOUT;
    while ucx.batch_counts().in_flight > 0 && Instant::now() < deadline {
        ucx.progress(&mut done);
    }
    assert_eq!(
        ucx.batch_counts().in_flight,
        0,
        "[{label}] batch messages left after the kill"
    );
    let e = ucx.post_t(
        Endpoint::Peer(peer),
        &[post(9999, Op::Write, &big, None)],
        &mut done,
    );
    assert!(
        matches!(e, Err(Error::RemoteDisconnect { .. })),
        "[{label}] post to a dead peer: {e:?}"
    );

    // The engine invalidates the peer's metadata; the target restarts; reload; works.
    ucx.unload_remote(peer);
    let mut t = spawn_target(v, &mut ucx, peer);
    pattern(77, &mut local.bytes()[..1 << 20]);
    let ranges = [range(0, 4096, 1 << 20, t.token, t.addr)];
    let notif = format!("W 4096 {} 77", 1 << 20);
    transfer(
        &mut ucx,
        peer,
        &[post(3000, Op::Write, &ranges, Some(notif.as_bytes()))],
    );
    assert_eq!(
        recv_frame(&mut t.stream),
        b"ok",
        "[{label}] write after restart differs"
    );
    transfer(&mut ucx, peer, &[post(3001, Op::Read, &ranges, None)]);

    // The engine invalidates the (live) peer while a 64 MiB write and a read to it are
    // in flight: each request is reported exactly once, only through UCX's callbacks,
    // and the endpoint's close is confirmed; then a reload works again.
    let whole_range = [range(0, 0, TARGET_LEN, t.token, t.addr)];
    let mut done = Completions::with_capacity(4);
    ucx.post_t(
        Endpoint::Peer(peer),
        &[
            post(4000, Op::Write, &whole_range, None),
            post(4001, Op::Read, &ranges, None),
        ],
        &mut done,
    )
    .expect("post before invalidation");
    ucx.unload_remote(peer);
    let deadline = Instant::now() + TIMEOUT;
    let mut reported: Vec<ferry_backend_api::Completion> = Vec::new();
    while (reported.len() < 2 || ucx.closing_endpoints() > 0) && Instant::now() < deadline {
        reported.extend_from_slice(done.as_slice());
        done.clear();
        ucx.progress(&mut done);
    }
    reported.extend_from_slice(done.as_slice());
    done.clear();
    for tag in [4000, 4001] {
        let mine: Vec<_> = reported.iter().filter(|c| c.tag == tag).collect();
        assert_eq!(
            mine.len(),
            1,
            "[{label}] request {tag} reported {} times",
            mine.len()
        );
        if let Err(f) = mine[0].result {
            assert!(
                matches!(
                    f.kind,
                    FailureKind::RemoteDisconnect | FailureKind::Canceled
                ),
                "[{label}] request {tag}: {f:?}"
            );
        }
    }
    assert_eq!(
        ucx.in_flight(),
        0,
        "[{label}] slots left after invalidation"
    );
    assert_eq!(
        ucx.closing_endpoints(),
        0,
        "[{label}] endpoint close never confirmed"
    );
    eprintln!(
        "[{label}] invalidated mid-flight: {:?}",
        reported
            .iter()
            .map(|c| c.result.map_err(|f| f.kind))
            .collect::<Vec<_>>()
    );
    load(
        &mut ucx,
        peer,
        "target",
        &t.conn_info,
        &[(t.token, t.md.clone())],
    );
    transfer(&mut ucx, peer, &[post(4002, Op::Read, &ranges, None)]);
    ucx.notify(Endpoint::Peer(peer), b"Q").unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let mut done = Completions::with_capacity(4);
    t.stream.set_nonblocking(false).unwrap();
    // The child answers "bye" and exits; progress until our notification left.
    while ucx.in_flight() > 0 && Instant::now() < deadline {
        ucx.progress(&mut done);
    }
    assert!(recv_frame(&mut t.stream).starts_with(b"bye"));
    let status = t.child.wait().unwrap();
    assert!(status.success(), "[{label}] target exited with {status}");
    ucx.deregister_t(MemKind::Dram, ltok).unwrap();
    local.release(&mut ucx);
}

fn main() {
    if let Ok(addr) = std::env::var(CHILD_VAR) {
        setup();
        child_main(&addr);
        return;
    }
    if !setup() {
        println!("0 passed, 0 failed, 1 skipped");
        return;
    }
    let mut passed = 0;
    let mut failed = 0;
    let variant = |transports, error_handling, alloc| Variant {
        transports,
        error_handling,
        alloc,
    };
    let variants = [
        variant("", "peer", false),
        variant("tcp", "peer", false),
        variant("", "none", false),
        variant("", "none", true),
        variant("tcp", "peer", true),
    ];
    for v in variants {
        let label = label(v);
        let result = std::panic::catch_unwind(|| scenario(v));
        match result {
            Ok(()) => {
                println!("test two_processes[{label}] ... ok");
                passed += 1;
            }
            Err(_) => {
                println!("test two_processes[{label}] ... FAILED");
                failed += 1;
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}
