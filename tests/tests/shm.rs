//! The SHM backend between two processes (the far side is the `shm-peer` binary of
//! this crate) and between agents of one process: both kinds of remote memory
//! (Ferry shareable memory, reached through a mapping; ordinary memory, reached
//! through process_vm_readv/writev), random sizes and offsets checked byte for byte,
//! notifications after their data, a peer killed mid-batch, a peer on "another host",
//! and the engine falling back to the next common backend where SHM cannot go.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use ferry::shm::{SharedMemory, ShmOptions};
use ferry::{Agent, AgentConfig, Desc, Error, MemKind, Op, Params, PeerId, Side, XferStatus};
use ferry_tests::{post_and_wait, register, try_register, unique, write_once, Buffer, Rng};

fn fnv(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn params(kv: &[(&str, &str)]) -> Params {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn shm_agent(prefix: &str, kv: &[(&str, &str)]) -> Agent {
    let agent = Agent::new(AgentConfig::named(unique(prefix))).expect("agent");
    agent
        .create_backend("SHM", &params(kv))
        .expect("SHM backend");
    agent
}

/// Which of the peer's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Shared,
    Ordinary,
}

/// A running `shm-peer` process and a model of its two buffers.
struct PeerProc {
    child: Option<Child>,
    stream: TcpStream,
    md: Vec<u8>,
    shared_addr: u64,
    ordinary_addr: u64,
    model_shared: Vec<u8>,
    model_ordinary: Vec<u8>,
    /// Notifications read while waiting for something else.
    pending: Vec<(u64, u64, Vec<u8>)>,
}

fn read_frame(stream: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .expect("frame length from the peer");
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    stream.read_exact(&mut body).expect("frame from the peer");
    let tag = body[0];
    body.remove(0);
    (tag, body)
}

impl PeerProc {
    /// The peer's process id.
    fn pid(&self) -> u32 {
        self.child.as_ref().expect("the peer process runs").id()
    }

    fn spawn(seed: u64, len: usize, kv: &[&str]) -> PeerProc {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let addr = listener.local_addr().unwrap().to_string();
        let child = Command::new(env!("CARGO_BIN_EXE_shm-peer"))
            .arg(&addr)
            .arg(seed.to_string())
            .arg(len.to_string())
            .args(kv)
            .spawn()
            .expect("spawn shm-peer");
        listener.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "shm-peer did not connect");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        stream.set_nonblocking(false).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let (tag, body) = read_frame(&mut stream);
        assert_eq!(tag, b'M');
        let mut rng = Rng::new(seed);
        let mut model_shared = vec![0u8; len];
        rng.fill(&mut model_shared);
        let mut model_ordinary = vec![0u8; len];
        rng.fill(&mut model_ordinary);
        PeerProc {
            child: Some(child),
            stream,
            shared_addr: u64::from_le_bytes(body[..8].try_into().unwrap()),
            ordinary_addr: u64::from_le_bytes(body[8..16].try_into().unwrap()),
            md: body[16..].to_vec(),
            model_shared,
            model_ordinary,
            pending: Vec::new(),
        }
    }

    fn base(&self, kind: Kind) -> u64 {
        match kind {
            Kind::Shared => self.shared_addr,
            Kind::Ordinary => self.ordinary_addr,
        }
    }

    fn model(&mut self, kind: Kind) -> &mut Vec<u8> {
        match kind {
            Kind::Shared => &mut self.model_shared,
            Kind::Ordinary => &mut self.model_ordinary,
        }
    }

    /// The peer's two buffers now.
    fn dump(&mut self) -> (Vec<u8>, Vec<u8>) {
        self.stream.write_all(b"D").unwrap();
        loop {
            let (tag, body) = read_frame(&mut self.stream);
            match tag {
                b'D' => {
                    let half = body.len() / 2;
                    return (body[..half].to_vec(), body[half..].to_vec());
                }
                b'N' => self.pending.push(parse_notif(&body)),
                other => panic!("unexpected frame {other}"),
            }
        }
    }

    fn assert_matches_model(&mut self, what: &str) {
        let (shared, ordinary) = self.dump();
        for (name, got, want) in [
            ("shared", &shared, &self.model_shared),
            ("ordinary", &ordinary, &self.model_ordinary),
        ] {
            if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
                panic!("{what}: the peer's {name} buffer differs first at byte {i}");
            }
        }
    }

    /// The next notification: (hash of shared, hash of ordinary at drain time, payload).
    fn next_notif(&mut self) -> (u64, u64, Vec<u8>) {
        if !self.pending.is_empty() {
            return self.pending.remove(0);
        }
        let (tag, body) = read_frame(&mut self.stream);
        assert_eq!(tag, b'N', "expected a notification frame");
        parse_notif(&body)
    }

    fn kill(&mut self) -> Child {
        self.child.take().expect("still running")
    }
}

fn parse_notif(body: &[u8]) -> (u64, u64, Vec<u8>) {
    (
        u64::from_le_bytes(body[..8].try_into().unwrap()),
        u64::from_le_bytes(body[8..16].try_into().unwrap()),
        body[16..].to_vec(),
    )
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        let _ = self.stream.write_all(b"Q");
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `n` random, non-overlapping (offset, len) ranges inside `len` bytes, in random order.
fn random_ranges(len: usize, n: usize, rng: &mut Rng) -> Vec<(usize, usize)> {
    let slot = len / n;
    let mut out: Vec<(usize, usize)> = (0..n)
        .map(|k| {
            let size = 1 + rng.index(slot);
            let offset = k * slot + rng.index(slot - size + 1);
            (offset, size)
        })
        .collect();
    rng.shuffle(&mut out);
    out
}

const LEN: usize = 1 << 20;

#[allow(clippy::too_many_arguments)]
/// Write random ranges of `src` into the peer's `kind` buffer; updates the model.
fn write_random(
    a: &Agent,
    peer: &mut PeerProc,
    at: PeerId,
    kind: Kind,
    src: &Buffer,
    n: usize,
    rng: &mut Rng,
    notif: Option<&[u8]>,
) {
    let remote = random_ranges(LEN, n, rng);
    let local: Vec<(usize, usize)> = remote
        .iter()
        .map(|&(_, size)| (rng.index(LEN - size + 1), size))
        .collect();
    let base = peer.base(kind);
    let ldescs: Vec<Desc> = local.iter().map(|&(o, s)| src.desc(o, s)).collect();
    let rdescs: Vec<Desc> = remote
        .iter()
        .map(|&(o, s)| Desc::new(base + o as u64, s as u64, 0))
        .collect();
    let x = a
        .create(
            Op::Write,
            MemKind::Dram,
            &ldescs,
            at,
            MemKind::Dram,
            &rdescs,
            notif,
        )
        .expect("create write");
    post_and_wait(a, x);
    a.release(x).unwrap();
    let model = peer.model(kind);
    for (&(lo, s), &(ro, _)) in local.iter().zip(&remote) {
        model[ro..ro + s].copy_from_slice(&src.bytes()[lo..lo + s]);
    }
}

#[test]
fn two_processes_random_ranges_both_kinds_byte_for_byte() {
    let mut rng = Rng::new(0x5151);
    let mut peer = PeerProc::spawn(7, LEN, &[]);
    let a = shm_agent("shm-rand", &[]);
    let src = Buffer::random(LEN, &mut rng);
    let mut dst = Buffer::zeroed(LEN);
    register(&a, &src);
    register(&a, &dst);
    let at = a.load_remote_md(&peer.md).expect("load the peer");
    for round in 0..8 {
        for kind in [Kind::Shared, Kind::Ordinary] {
            // Up to 3,000 ranges: past one CMA call's 1,024 iovecs.
            let n = if round == 0 { 3000 } else { 1 + rng.index(400) };
            write_random(&a, &mut peer, at, kind, &src, n, &mut rng, None);
            peer.assert_matches_model(&format!("round {round}, WRITE to {kind:?}, {n} ranges"));

            // READ random ranges back into shuffled places of `dst`.
            dst.bytes_mut().fill(0);
            let remote = random_ranges(LEN, n, &mut rng);
            let mut slots = random_ranges(LEN, n, &mut rng);
            for (slot, &(_, size)) in slots.iter_mut().zip(&remote) {
                slot.1 = slot.1.min(size);
            }
            let base = peer.base(kind);
            let ldescs: Vec<Desc> = slots.iter().map(|&(o, s)| dst.desc(o, s)).collect();
            let rdescs: Vec<Desc> = remote
                .iter()
                .zip(&slots)
                .map(|(&(o, _), &(_, s))| Desc::new(base + o as u64, s as u64, 0))
                .collect();
            let x = a
                .create(
                    Op::Read,
                    MemKind::Dram,
                    &ldescs,
                    at,
                    MemKind::Dram,
                    &rdescs,
                    None,
                )
                .expect("create read");
            assert_eq!(a.post(x).expect("post read"), XferStatus::Done);
            a.release(x).unwrap();
            let model = peer.model(kind).clone();
            for (&(lo, s), &(ro, _)) in slots.iter().zip(&remote) {
                assert_eq!(
                    &dst.bytes()[lo..lo + s],
                    &model[ro..ro + s],
                    "round {round}, READ from {kind:?}: {s} bytes at {ro}"
                );
            }
        }
    }
    // Shuffled blocks into one contiguous remote area (CMA merges the remote side into
    // one iovec), past 1,024 blocks, both ways.
    let (block, n) = (100, 3000);
    let mut order: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut order);
    for kind in [Kind::Shared, Kind::Ordinary] {
        let base = peer.base(kind) + 12_345;
        let l: Vec<Desc> = order.iter().map(|&j| src.desc(j * block, block)).collect();
        let r: Vec<Desc> = (0..n)
            .map(|i| Desc::new(base + (i * block) as u64, block as u64, 0))
            .collect();
        let x = a
            .create(Op::Write, MemKind::Dram, &l, at, MemKind::Dram, &r, None)
            .unwrap();
        assert_eq!(a.post(x).unwrap(), XferStatus::Done);
        let model = peer.model(kind);
        for (i, &j) in order.iter().enumerate() {
            let at = 12_345 + i * block;
            model[at..at + block].copy_from_slice(&src.bytes()[j * block..(j + 1) * block]);
        }
        dst.bytes_mut().fill(0);
        let back: Vec<Desc> = order.iter().map(|&j| dst.desc(j * block, block)).collect();
        let y = a
            .create(Op::Read, MemKind::Dram, &back, at, MemKind::Dram, &r, None)
            .unwrap();
        assert_eq!(a.post(y).unwrap(), XferStatus::Done);
        assert_eq!(
            &dst.bytes()[..n * block],
            &src.bytes()[..n * block],
            "{kind:?}"
        );
    }
    peer.assert_matches_model("shuffled blocks into a contiguous area");

    // A local side in Ferry shareable memory works the same.
    let local_shared = SharedMemory::alloc(LEN, &ShmOptions::default()).unwrap();
    let mut bytes = vec![0u8; 4096];
    rng.fill(&mut bytes);
    local_shared.write(100, &bytes).unwrap();
    try_register(&a, MemKind::Dram, local_shared.desc()).unwrap();
    for kind in [Kind::Shared, Kind::Ordinary] {
        let dest = peer.base(kind) + 5000;
        let x = a
            .create(
                Op::Write,
                MemKind::Dram,
                &[local_shared.desc_at(100, 4096).unwrap()],
                at,
                MemKind::Dram,
                &[Desc::new(dest, 4096, 0)],
                None,
            )
            .unwrap();
        assert_eq!(a.post(x).unwrap(), XferStatus::Done);
        peer.model(kind)[5000..5000 + 4096].copy_from_slice(&bytes);
    }
    peer.assert_matches_model("from a shareable local side");
    a.invalidate_remote_md(at).unwrap();
}

#[test]
fn notifications_arrive_after_their_data() {
    let mut rng = Rng::new(0x707);
    let mut peer = PeerProc::spawn(11, LEN, &[]);
    let a = shm_agent("shm-notif", &[]);
    let src = Buffer::random(LEN, &mut rng);
    register(&a, &src);
    let at = a.load_remote_md(&peer.md).expect("load the peer");
    for k in 0u32..40 {
        let kind = if k % 2 == 0 {
            Kind::Shared
        } else {
            Kind::Ordinary
        };
        let payload: Vec<u8> = if k == 3 {
            Vec::new()
        } else {
            (0..(k as usize * 37) % 3000)
                .map(|i| i as u8 ^ k as u8)
                .collect()
        };
        let n = 1 + rng.index(200);
        write_random(&a, &mut peer, at, kind, &src, n, &mut rng, Some(&payload));
        let (hs, ho, got) = peer.next_notif();
        assert_eq!(got, payload, "notification {k}");
        assert_eq!(
            hs,
            fnv(&peer.model_shared),
            "notification {k} came before its data (shared)"
        );
        assert_eq!(
            ho,
            fnv(&peer.model_ordinary),
            "notification {k} came before its data (ordinary)"
        );
    }
    a.notify(at, b"standalone").unwrap();
    let (hs, _, got) = peer.next_notif();
    assert_eq!(got, b"standalone");
    assert_eq!(hs, fnv(&peer.model_shared));
    // Many notifications without the target draining in between: the ring is bounded,
    // so a sender either gets them in or a capacity error, never a silent loss.
    let mut sent = 0;
    for k in 0..20_000u32 {
        let payload = [b"burst:".as_slice(), &k.to_le_bytes()].concat();
        match a.notify(at, &payload) {
            Ok(()) => sent += 1,
            Err(Error::Capacity { .. }) => {}
            Err(e) => panic!("notify: {e}"),
        }
    }
    let mut seen = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = None;
    while seen < sent {
        assert!(Instant::now() < deadline);
        let (_, _, got) = peer.next_notif();
        let k = u32::from_le_bytes(got[6..10].try_into().unwrap());
        assert!(last.is_none_or(|l| k > l), "in order");
        last = Some(k);
        seen += 1;
    }
    assert!(sent > 0);
}

/// The memfd names of process `pid`'s Ferry segments.
fn segment_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|t| t.to_string_lossy().into_owned())
        .filter(|t| t.starts_with("/memfd:ferry-shm-"))
        .map(|t| t.trim_end_matches(" (deleted)").to_string())
        .collect()
}

/// How many of our mappings are of the segments named `names`.
fn count_mappings(names: &[String]) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| names.iter().any(|n| l.contains(n.as_str())))
        .count()
}

#[test]
fn a_peer_killed_mid_batch_gives_remote_disconnect() {
    let mut rng = Rng::new(0xdead);
    let mut peer = PeerProc::spawn(13, LEN, &[]);
    let a = shm_agent("shm-kill", &[]);
    let src = Buffer::random(LEN, &mut rng);
    register(&a, &src);
    let at = a.load_remote_md(&peer.md).expect("load the peer");
    let mut xfers = Vec::new();
    for kind in [Kind::Shared, Kind::Ordinary] {
        let base = peer.base(kind);
        let remote = random_ranges(LEN, 1024, &mut rng);
        let l: Vec<Desc> = remote.iter().map(|&(o, s)| src.desc(o, s)).collect();
        let r: Vec<Desc> = remote
            .iter()
            .map(|&(o, s)| Desc::new(base + o as u64, s as u64, 0))
            .collect();
        xfers.push(
            a.create(
                Op::Write,
                MemKind::Dram,
                &l,
                at,
                MemKind::Dram,
                &r,
                Some(b"n"),
            )
            .unwrap(),
        );
    }
    for &x in &xfers {
        assert_eq!(a.post(x).unwrap(), XferStatus::Done);
    }
    let mut child = peer.kill();
    let names = segment_names(child.id());
    assert_eq!(
        names.len(),
        2,
        "the peer's inbox and shareable buffer: {names:?}"
    );
    assert_eq!(count_mappings(&names), 2, "both mapped here");
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        child.kill().expect("kill the peer");
        child.wait().expect("reap the peer");
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut done, mut disconnected) = (0u32, 0u32);
    let mut reaped = false;
    loop {
        assert!(Instant::now() < deadline, "posts never saw the peer die");
        for &x in &xfers {
            match a.post(x) {
                Ok(XferStatus::Done) => done += 1,
                Err(Error::RemoteDisconnect { subject }) => {
                    assert!(subject.to_string().contains("shm-peer"), "{subject}");
                    disconnected += 1;
                }
                other => panic!("post while the peer dies: {other:?}"),
            }
        }
        if reaped {
            break;
        }
        reaped = killer.is_finished();
    }
    killer.join().unwrap();
    assert!(done >= 1, "some posts ran while it lived");
    assert!(disconnected >= 2, "every post after its death fails");
    // Once dead, every post fails the same way, notifications too.
    for &x in &xfers {
        assert!(matches!(a.post(x), Err(Error::RemoteDisconnect { .. })));
    }
    assert!(matches!(
        a.notify(at, b"x"),
        Err(Error::RemoteDisconnect { .. })
    ));
    // Its segments (inbox and shareable buffer) are unmapped at invalidation.
    for x in xfers {
        a.release(x).unwrap();
    }
    a.invalidate_remote_md(at).unwrap();
    assert_eq!(count_mappings(&names), 0);
}

#[test]
fn a_peer_with_another_host_identity_is_refused() {
    let peer = PeerProc::spawn(17, 1 << 16, &["host_identity=some-other-host"]);
    let a = shm_agent("shm-forged", &[]);
    match a.load_remote_md(&peer.md) {
        Err(Error::NotSupported { backend, what }) => {
            assert_eq!(backend, "SHM");
            assert!(what.contains("another host"), "{what}");
            assert!(what.contains("some-other-host"), "{what}");
        }
        other => panic!("a foreign host was accepted: {other:?}"),
    }
}

/// Two agents of this process, each with SHM (created first) and LOOPBACK; `b`'s SHM
/// takes `b_params`, `a`'s `a_params`.
fn mixed_pair(a_params: &[(&str, &str)], b_params: &[(&str, &str)]) -> (Agent, Agent) {
    let a = shm_agent("mixed-a", a_params);
    let b = shm_agent("mixed-b", b_params);
    for agent in [&a, &b] {
        agent.create_backend("LOOPBACK", &Params::new()).unwrap();
    }
    (a, b)
}

/// Post `x`, with the initiator's LOOPBACK set to fail its next request: Done means SHM
/// carried it, an EIO failure means LOOPBACK did.
fn carried_by_loopback(a: &Agent, x: ferry::XferId) -> bool {
    let faults = ferry::loopback::faults(a.name()).expect("a has LOOPBACK");
    faults.fail_next(1);
    let result = a.post(x);
    faults.clear();
    match result {
        Ok(XferStatus::Done) => false,
        Err(Error::Backend { errno: 5, .. }) => true,
        other => panic!("unexpected: {other:?}"),
    }
}

#[test]
fn a_foreign_host_falls_back_to_the_next_common_backend() {
    let (a, b) = mixed_pair(&[], &[("host_identity", "elsewhere")]);
    let mut rng = Rng::new(3);
    let src = Buffer::random(8192, &mut rng);
    let dst = Buffer::zeroed(8192);
    register(&a, &src);
    register(&b, &dst);
    let at = a
        .load_remote_md(&b.local_md().unwrap())
        .expect("LOOPBACK takes it");
    let x = a
        .create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            at,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    assert!(
        carried_by_loopback(&a, x),
        "SHM must not serve a foreign host"
    );
    assert_eq!(a.post(x).unwrap(), XferStatus::Done);
    assert_eq!(dst.bytes(), src.bytes());
    // The same set-up on one host: SHM, created first, carries it.
    let (a, b) = mixed_pair(&[], &[]);
    register(&a, &src);
    register(&b, &dst);
    let at = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let x = a
        .create(
            Op::Read,
            MemKind::Dram,
            &[src.whole()],
            at,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    assert!(!carried_by_loopback(&a, x), "SHM is first and common");
}

#[test]
fn without_cma_ordinary_memory_goes_to_the_next_common_backend() {
    let (a, b) = mixed_pair(&[("cma", "off")], &[]);
    let mut rng = Rng::new(5);
    let src = Buffer::random(1 << 16, &mut rng);
    let ordinary = Buffer::zeroed(1 << 16);
    let shared = SharedMemory::alloc(1 << 16, &ShmOptions::default()).unwrap();
    register(&a, &src);
    register(&b, &ordinary);
    try_register(&b, MemKind::Dram, shared.desc()).unwrap();
    let at = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let local = a.prep(Side::Local, MemKind::Dram, &[src.whole()]).unwrap();
    let to_shared = a.prep(at, MemKind::Dram, &[shared.desc()]).unwrap();
    let to_ordinary = a.prep(at, MemKind::Dram, &[ordinary.whole()]).unwrap();
    let xs = a.make(Op::Write, local, &[], to_shared, &[], None).unwrap();
    let xo = a
        .make(Op::Write, local, &[], to_ordinary, &[], None)
        .unwrap();
    assert!(
        !carried_by_loopback(&a, xs),
        "shareable memory needs no CMA"
    );
    assert!(
        carried_by_loopback(&a, xo),
        "ordinary memory without CMA is not SHM's"
    );
    assert_eq!(a.post(xo).unwrap(), XferStatus::Done);
    let mut seen = vec![0u8; 1 << 16];
    shared.read(0, &mut seen).unwrap();
    assert_eq!(seen, src.bytes());
    assert_eq!(ordinary.bytes(), src.bytes());
    // Asking for SHM alone for ordinary memory says why it cannot.
    let solo = shm_agent("solo", &[("cma", "off")]);
    register(&solo, &src);
    let at = solo.load_remote_md(&b.local_md().unwrap()).unwrap();
    let e = solo
        .create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            at,
            MemKind::Dram,
            &[ordinary.whole()],
            None,
        )
        .unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
}

#[test]
fn local_transfers_and_self_notifications() {
    let a = shm_agent("shm-local", &[]);
    let mut rng = Rng::new(9);
    let src = Buffer::random(1 << 16, &mut rng);
    let dst = Buffer::zeroed(1 << 16);
    register(&a, &src);
    register(&a, &dst);
    let x = a
        .create(
            Op::Write,
            MemKind::Dram,
            &[src.desc(0, 1000), src.desc(5000, 3000)],
            Side::Local,
            MemKind::Dram,
            &[dst.desc(7000, 1000), dst.desc(100, 3000)],
            Some(b"to me"),
        )
        .unwrap();
    assert_eq!(a.post(x).unwrap(), XferStatus::Done);
    assert_eq!(&dst.bytes()[7000..8000], &src.bytes()[..1000]);
    assert_eq!(&dst.bytes()[100..3100], &src.bytes()[5000..8000]);
    let got = a.drain_notifications();
    assert_eq!(got, vec![(a.name().to_string(), b"to me".to_vec())]);
}

fn ucx_ready() -> bool {
    std::env::set_var("UCX_NET_DEVICES", "lo");
    std::env::set_var("UCX_WARN_UNUSED_ENV_VARS", "n");
    let info = Agent::available_backends();
    match &info
        .iter()
        .find(|f| f.name == "UCX")
        .expect("compiled in")
        .available
    {
        Ok(()) => true,
        Err(reason) => {
            ferry_testkit::ci::skip(
                "UCX",
                format!("unavailable ({reason}); apt-get install libucx0"),
            );
            false
        }
    }
}

/// An agent with SHM first, then UCX (default parameters).
fn shm_then_ucx_agent(prefix: &str) -> Agent {
    let a = Agent::new(AgentConfig::named(unique(prefix))).unwrap();
    a.create_backend("SHM", &Params::new()).unwrap();
    a.create_backend("UCX", &Params::new()).unwrap();
    a
}

/// The set-up: SHM created first, then UCX. A peer of this host is served by
/// SHM (its segments get mapped here), a peer of "another host" by UCX (nothing of it
/// is mapped), and both get their bytes.
#[test]
fn shm_first_serves_local_peers_and_ucx_the_others() {
    if !ucx_ready() {
        return;
    }
    let mut rng = Rng::new(0x0ca1);
    let a = shm_then_ucx_agent("shm-then-ucx");
    let src = Buffer::random(LEN, &mut rng);
    register(&a, &src);
    let mut local = PeerProc::spawn(19, LEN, &["--ucx"]);
    let mut foreign = PeerProc::spawn(23, LEN, &["host_identity=far-away", "--ucx"]);
    for (peer, by_shm) in [(&mut local, true), (&mut foreign, false)] {
        let pid = peer.child.as_ref().unwrap().id();
        let names = segment_names(pid);
        let at = a.load_remote_md(&peer.md).expect("load");
        for kind in [Kind::Shared, Kind::Ordinary] {
            let n = 1 + rng.index(300);
            write_random(&a, peer, at, kind, &src, n, &mut rng, None);
        }
        peer.assert_matches_model(if by_shm { "local peer" } else { "foreign peer" });
        let mapped = count_mappings(&names);
        if by_shm {
            assert_eq!(
                mapped, 2,
                "SHM carried the local peer's requests (inbox + segment mapped)"
            );
        } else {
            assert_eq!(
                mapped, 0,
                "nothing of a foreign peer is mapped: UCX carried it"
            );
        }
        a.invalidate_remote_md(at).unwrap();
    }
}

/// Established TCP connections of process `pid`: its sockets (`/proc/PID/fd`) that
/// `/proc/net/tcp` and `tcp6` list in state 01. Counted in the peer's process, which
/// serves only its own test: this process's count also moves with the connections the
/// tests running beside it open and close.
fn established_tcp(pid: u32) -> usize {
    let ours: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("/proc/PID/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| t.lines().skip(1).map(str::to_string).collect::<Vec<_>>())
        .filter(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            cols.len() > 9 && cols[3] == "01" && ours.contains(cols[9])
        })
        .count()
}

/// SHM first, UCX second: a peer of this host that SHM serves gets no UCX connection at
/// load (UCX is on standby for it), a peer of "another host" does (the control: the
/// count sees UCX's connections); a request that names UCX to the local peer connects
/// then and moves its bytes.
#[test]
fn ucx_connects_to_a_peer_shm_serves_only_when_a_request_goes_through_it() {
    if !ucx_ready() {
        return;
    }
    let mut rng = Rng::new(0x57b7);
    let a = shm_then_ucx_agent("standby");
    let ucx_slot = a.backends().iter().position(|b| b.name == "UCX").unwrap();
    let src = Buffer::random(LEN, &mut rng);
    register(&a, &src);
    let foreign = PeerProc::spawn(29, LEN, &["host_identity=far-away", "--ucx"]);
    let before = established_tcp(foreign.pid());
    let far = a
        .load_remote_md(&foreign.md)
        .expect("load the foreign peer");
    let after_far = established_tcp(foreign.pid());
    assert!(
        after_far > before,
        "UCX made no connection at the load of a peer only it serves ({before} -> {after_far})"
    );
    let mut local = PeerProc::spawn(31, LEN, &["--ucx"]);
    let before = established_tcp(local.pid());
    let at = a.load_remote_md(&local.md).expect("load the local peer");
    for kind in [Kind::Shared, Kind::Ordinary] {
        write_random(&a, &mut local, at, kind, &src, 40, &mut rng, None);
    }
    let after_shm = established_tcp(local.pid());
    assert_eq!(
        after_shm, before,
        "a peer SHM serves got TCP connections (UCX connected at load or SHM's requests)"
    );
    // A WRITE that names UCX: its endpoint is made now.
    let base = local.base(Kind::Ordinary);
    let (lo, ro, n) = (
        rng.index(LEN / 2),
        rng.index(LEN / 2),
        1 + rng.index(LEN / 2),
    );
    let mut cmds = ferry::CommandBuffer::with_capacity(4);
    let l = a
        .prep(Side::Local, MemKind::Dram, &[src.desc(lo, n)])
        .unwrap();
    let r = a
        .prep(
            at,
            MemKind::Dram,
            &[Desc::new(base + ro as u64, n as u64, 0)],
        )
        .unwrap();
    let made = cmds
        .make(Op::Write, l, &[], r, &[])
        .prefer(ferry::BackendMask::single(ucx_slot))
        .ticket();
    a.flush(&mut cmds);
    let x = match cmds.outcome(made) {
        ferry::Outcome::Created(ferry::Created::Xfer(x)) => *x,
        other => panic!("make: {other:?}"),
    };
    assert_eq!(a.xfer_backend(x).unwrap(), "UCX");
    post_and_wait(&a, x);
    a.release(x).unwrap();
    local.model(Kind::Ordinary)[ro..ro + n].copy_from_slice(&src.bytes()[lo..lo + n]);
    local.assert_matches_model("local peer, SHM then UCX");
    assert!(
        established_tcp(local.pid()) > after_shm,
        "the request through UCX made no connection"
    );
    a.invalidate_remote_md(far).unwrap();
}

/// The default set (`Agent::create_default_backends`): LOOPBACK first, then SHM, UCX
/// (where libucp is here) and POSIX; a second call creates nothing; a peer in this
/// process goes through LOOPBACK, a peer that says it is on another host skips SHM.
#[test]
fn the_default_set_gives_each_peer_the_first_backend_that_reaches_it() {
    let a = Agent::new(AgentConfig::named(unique("default-a"))).unwrap();
    let created = a.create_default_backends(|_| Params::new()).unwrap();
    assert_eq!(&created[..2], ["LOOPBACK", "SHM"], "{created:?}");
    assert!(created.contains(&"POSIX"), "{created:?}");
    let ucx_here = Agent::available_backends()
        .iter()
        .any(|f| f.name == "UCX" && f.available.is_ok());
    assert_eq!(created.contains(&"UCX"), ucx_here, "{created:?}");
    assert!(a
        .create_default_backends(|_| Params::new())
        .unwrap()
        .is_empty());
    let b = Agent::new(AgentConfig::named(unique("default-b"))).unwrap();
    b.create_default_backends(|name| match name {
        "SHM" => params(&[("host_identity", "elsewhere")]),
        _ => Params::new(),
    })
    .unwrap();
    let mut rng = Rng::new(11);
    let src = Buffer::random(1 << 16, &mut rng);
    let dst = Buffer::zeroed(1 << 16);
    register(&a, &src);
    register(&b, &dst);
    let at = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let x = a
        .create(
            Op::Write,
            MemKind::Dram,
            &[src.whole()],
            at,
            MemKind::Dram,
            &[dst.whole()],
            None,
        )
        .unwrap();
    assert_eq!(a.xfer_backend(x).unwrap(), "LOOPBACK");
    assert_eq!(a.post(x).unwrap(), XferStatus::Done);
    assert_eq!(dst.bytes(), src.bytes());
    // A bad parameter for one type is that type's typed error, naming it.
    let c = Agent::new(AgentConfig::named(unique("default-c"))).unwrap();
    let e = c
        .create_default_backends(|name| match name {
            "SHM" => params(&[("no_such_parameter", "1")]),
            _ => Params::new(),
        })
        .unwrap_err();
    assert!(e.to_string().contains("no_such_parameter"), "{e}");
}

/// Issue 21, item 3: a WRITE whose attached notification does not fit in the target's
/// ring is refused before its data moves (`Capacity`, destination untouched), never
/// failed after the bytes landed; once the target drains, the same post goes through
/// and its notification arrives.
#[test]
fn a_full_notification_ring_refuses_the_write_before_its_data_moves() {
    let a = shm_agent("shm-nfull-a", &[]);
    // A small ring at the target: a few 40-byte records fill it.
    let b = shm_agent("shm-nfull-b", &[("notif_lane_bytes", "256")]);
    let mut src = Buffer::zeroed(4096);
    let dst = Buffer::zeroed(4096);
    register(&a, &src);
    register(&b, &dst);
    let b_at_a = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let payload = [7u8; 32];
    let mut sent = 0usize;
    let mut refused = None;
    for round in 1..=64u8 {
        // Each round writes its own byte: a refused round must leave the last one.
        src.bytes_mut().fill(round);
        // Refused at create (the backend is chosen then) or at post: either way before
        // anything moved.
        match write_once(&a, src.whole(), b_at_a, dst.whole(), Some(&payload)) {
            Ok(XferStatus::Done) => sent += 1,
            Ok(other) => panic!("round {round}: {other:?}"),
            Err(e) => {
                assert!(matches!(e, Error::Capacity { .. }), "round {round}: {e}");
                assert!(
                    dst.bytes().iter().all(|&x| x == round - 1),
                    "round {round}: refused, but its data moved"
                );
                refused = Some(round);
                break;
            }
        }
    }
    let refused = refused.expect("the ring never filled");
    assert!(sent >= 2, "only {sent} notifications fit");
    // The target drains: every accepted notification is there, then the post works.
    let got = b.drain_notifications();
    assert_eq!(got.len(), sent);
    assert_eq!(
        write_once(&a, src.whole(), b_at_a, dst.whole(), Some(&payload)),
        Ok(XferStatus::Done)
    );
    assert!(dst.bytes().iter().all(|&x| x == refused));
    assert_eq!(b.drain_notifications().len(), 1);
}

/// Issue 21, item 5: forged SHM region metadata (the segment's nonce, fd, length, base,
/// or the owner's pid patched) is refused when the peer's metadata is loaded, naming the
/// region — not at the first transfer. The genuine metadata loads and moves bytes.
#[test]
fn forged_shm_region_metadata_is_refused_at_load() {
    use ferry::metadata::{MdWriter, PeerMd};
    let a = shm_agent("shm-forge-a", &[]);
    let b = shm_agent("shm-forge-b", &[]);
    let shared = SharedMemory::alloc(1 << 16, &ShmOptions::default()).unwrap();
    try_register(&b, MemKind::Dram, shared.desc()).unwrap();
    let genuine = PeerMd::from_bytes(&b.local_md().unwrap()).unwrap();
    let shm = genuine.backend_index("SHM").expect("SHM in the metadata");
    let (_, conn) = genuine.backend(shm).unwrap();
    let conn = conn.expect("connection info").to_vec();
    let region = genuine
        .regions()
        .find(|r| r.backend == shm)
        .expect("the shared region");
    let (desc, md) = (region.desc, region.public_md.to_vec());
    // Layout (backends/shm/src/wire.rs): tag u8 | pid u32 | host hash u64 | fd i32 |
    // nonce [16] | base u64 | len u64.
    assert_eq!(md.len(), 49);
    let patch = |at: usize, bytes: &[u8]| {
        let mut m = md.clone();
        m[at..at + bytes.len()].copy_from_slice(bytes);
        m
    };
    let fd = i32::from_le_bytes(md[13..17].try_into().unwrap());
    let base = u64::from_le_bytes(md[33..41].try_into().unwrap());
    let len = u64::from_le_bytes(md[41..49].try_into().unwrap());
    let mut nonce = md[17..33].to_vec();
    nonce[0] ^= 0xff;
    let forgeries = [
        ("nonce", patch(17, &nonce)),
        ("fd", patch(13, &(fd + 1000).to_le_bytes())),
        ("length", patch(41, &(len * 2).to_le_bytes())),
        ("base", patch(33, &(base + 4096).to_le_bytes())),
        ("pid", patch(1, &(std::process::id() + 1).to_le_bytes())),
    ];
    for (generation, (what, forged)) in forgeries.iter().enumerate() {
        let mut w = MdWriter::new(genuine.agent(), 100 + generation as u64);
        let backend = w.backend("SHM", Some(&conn));
        w.region(backend, MemKind::Dram, desc, forged);
        let e = a.load_remote_md(&w.finish().unwrap()).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("SHM region") && text.contains(&format!("{:#x}", desc.addr)),
            "forged {what}: {text}"
        );
        assert!(
            a.peer(genuine.agent()).is_none(),
            "forged {what}: loaded anyway"
        );
    }
    // The genuine metadata loads and works.
    let at = a.load_remote_md(genuine.as_bytes()).unwrap();
    let src = Buffer::random(1 << 16, &mut Rng::new(3));
    register(&a, &src);
    assert_eq!(
        write_once(&a, src.whole(), at, shared.desc(), None),
        Ok(XferStatus::Done)
    );
}

/// Issue 21, item 4 on SHM: once the target's deregistration completes, a peer that
/// still holds its metadata cannot change a byte of that memory — shareable (mapped by
/// the peer) or ordinary (CMA). The deregistration withdraws the range in the target's
/// inbox; the peer checks it before every batch and fails the request (`EFAULT`).
#[test]
fn a_peer_with_stale_metadata_cannot_write_into_memory_the_target_deregistered() {
    let a = shm_agent("shm-dereg-a", &[]);
    let b = shm_agent("shm-dereg-b", &[]);
    let mut src = Buffer::random(1 << 16, &mut Rng::new(31));
    register(&a, &src);
    let from = src.whole();
    let shared = SharedMemory::alloc(1 << 16, &ShmOptions::default()).unwrap();
    let ordinary = Buffer::zeroed(1 << 16);
    let shared_region = try_register(&b, MemKind::Dram, shared.desc()).unwrap();
    let ordinary_region = register(&b, &ordinary);
    let at = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let write = |to: Desc| write_once(&a, from, at, to, None);
    assert_eq!(write(shared.desc()), Ok(XferStatus::Done));
    assert_eq!(write(ordinary.whole()), Ok(XferStatus::Done));
    // The peer is idle: both deregistrations complete at once.
    assert_eq!(b.deregister(shared_region), Ok(ferry::DeregStatus::Done));
    assert_eq!(b.deregister(ordinary_region), Ok(ferry::DeregStatus::Done));
    // The memory is B's again; A still holds the old metadata.
    let view = |m: &SharedMemory| {
        let mut out = vec![0u8; m.len()];
        m.read(0, &mut out).unwrap();
        out
    };
    let before = (view(&shared), ordinary.bytes().to_vec());
    src.bytes_mut().fill(0xee);
    for to in [shared.desc(), ordinary.whole()] {
        match write(to) {
            Err(Error::Backend { errno, .. }) => assert_eq!(errno, libc_efault(), "{to:?}"),
            other => panic!("a write into deregistered memory at {to:?}: {other:?}"),
        }
    }
    assert_eq!(view(&shared), before.0, "shareable memory changed");
    assert_eq!(ordinary.bytes(), &before.1[..], "ordinary memory changed");
    // Registered again, it is reachable again (after the peer reloads).
    let again = register(&b, &ordinary);
    let at = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    assert_eq!(
        write_once(&a, from, at, ordinary.whole(), None),
        Ok(XferStatus::Done)
    );
    assert!(ordinary.bytes().iter().all(|&v| v == 0xee));
    b.deregister(again).unwrap();
}

fn libc_efault() -> i32 {
    14
}

/// One request whose ranges alternate between three of the peer's regions (two
/// shareable segments, reached through mappings, and ordinary memory, reached through
/// CMA) in runs of one to four ranges, with sizes below, inside and above the inline
/// copy's 16–64 bytes: the backend resolves each run's region and copies it as one run,
/// so every run boundary, direction and kind must land byte for byte, WRITE and READ.
#[test]
fn one_request_alternating_between_regions_lands_byte_for_byte() {
    const SIZE: usize = 1 << 16;
    const SLOT: usize = 320;
    let mut rng = Rng::new(0x7a11);
    let a = shm_agent("shm-runs-a", &[]);
    let b = shm_agent("shm-runs-b", &[]);
    let src = Buffer::random(SIZE, &mut rng);
    let dst = Buffer::zeroed(SIZE);
    register(&a, &src);
    register(&a, &dst);
    let shared: Vec<SharedMemory> = (0..2)
        .map(|_| SharedMemory::alloc(SIZE, &ShmOptions::default()).expect("shareable memory"))
        .collect();
    for s in &shared {
        try_register(&b, MemKind::Dram, s.desc()).expect("register shareable memory");
    }
    let ordinary = Buffer::zeroed(SIZE);
    register(&b, &ordinary);
    let at = a.load_remote_md(&b.local_md().unwrap()).unwrap();
    let bases = [
        shared[0].desc().addr,
        shared[1].desc().addr,
        ordinary.whole().addr,
    ];

    // Ranges in runs of one region; each range has a slot of its own in its region (no
    // overlap at the target) and in `dst`.
    let mut next_slot = [0usize; 3];
    let mut ranges = Vec::new(); // (region, remote offset, local offset, len)
    let mut region = 0;
    while ranges.len() < 150 {
        region = (region + 1 + rng.index(2)) % 3;
        for _ in 0..1 + rng.index(4) {
            let len = match rng.index(3) {
                0 => 1 + rng.index(15),
                1 => 16 + rng.index(49),
                _ => 65 + rng.index(SLOT - 65),
            };
            let remote = next_slot[region] * SLOT + rng.index(SLOT - len + 1);
            next_slot[region] += 1;
            let local = ranges.len() * SLOT + rng.index(SLOT - len + 1);
            ranges.push((region, remote, local, len));
        }
    }
    let remote: Vec<Desc> = ranges
        .iter()
        .map(|&(r, o, _, len)| Desc::new(bases[r] + o as u64, len as u64, 0))
        .collect();
    let transfer = |op: Op, local: &Buffer| {
        let ldescs: Vec<Desc> = ranges
            .iter()
            .map(|&(_, _, o, len)| local.desc(o, len))
            .collect();
        let x = a
            .create(op, MemKind::Dram, &ldescs, at, MemKind::Dram, &remote, None)
            .expect("create");
        post_and_wait(&a, x);
        a.release(x).unwrap();
    };

    transfer(Op::Write, &src);
    let mut want = vec![vec![0u8; SIZE]; 3];
    for &(r, ro, lo, len) in &ranges {
        want[r][ro..ro + len].copy_from_slice(&src.bytes()[lo..lo + len]);
    }
    for (i, s) in shared.iter().enumerate() {
        let mut got = vec![0u8; SIZE];
        s.read(0, &mut got).unwrap();
        assert!(got == want[i], "shareable segment {i} after the WRITE");
    }
    assert!(
        ordinary.bytes() == &want[2][..],
        "ordinary memory after the WRITE"
    );

    // READ the same ranges back into `dst`, at the WRITE's local offsets.
    transfer(Op::Read, &dst);
    let mut want_dst = vec![0u8; SIZE];
    for &(_, _, lo, len) in &ranges {
        want_dst[lo..lo + len].copy_from_slice(&src.bytes()[lo..lo + len]);
    }
    assert!(dst.bytes() == &want_dst[..], "local memory after the READ");
}
