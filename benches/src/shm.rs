//! Same-host transfers side by side in one run: the SHM backend into a peer's Ferry
//! shareable memory (mapped segment, one copy per range), the SHM backend into a
//! peer's ordinary memory (batched `process_vm_writev`), Ferry's UCX backend (default
//! transports: shared memory / CMA, `error_handling=none`) between the same two
//! processes, and the raw limit: a copy of the same ranges between the initiator's
//! buffer and a shared mapping (a memfd), in one process, with the backends' own copy
//! routine (`ferry_backend_api::copy_bytes`: inline at 16 to 64 bytes, `memmove`
//! otherwise).
//!
//! The initiator (this process) spawns a target (the same binary, told its role by
//! [`TARGET_ENV`]) that owns two agents — one with SHM, one with UCX — and registers a
//! shareable buffer and an ordinary one with both. The target spins on UCX progress only
//! while UCX cases run (SHM needs nothing of the target). Each case's request is made
//! once; every timed iteration is post → done of that one request, through
//! `Agent::post` (one flush). The criterion bench (`benches/shm.rs`) drives
//! [`Bench::iterate`] per contender, then [`Bench::interleave`] (short bursts of each
//! contender in turn, so all see the same machine) and prints [`Bench::table`]: the
//! medians of the interleaved iterations.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Child;
use std::time::{Duration, Instant};

use ferry::shm::{SharedMemory, ShmOptions};
use ferry::{
    Agent, AgentConfig, Desc, MemKind, Op, Params, PeerId, PrepId, Side, XferId, XferStatus,
};

/// Environment variable that makes a spawned process the target; its value is the
/// initiator's control address.
pub const TARGET_ENV: &str = "FERRY_BENCH_SHM_TARGET";

/// Bytes of each buffer.
pub const BUFFER_LEN: usize = 64 << 20;

/// The cases: (operation, block bytes, descriptors per request). Remote order is
/// shuffled.
pub const CASES: &[(Op, usize, usize)] = &[
    (Op::Write, 64, 1024),
    (Op::Write, 4 << 10, 1024),
    (Op::Write, 1 << 20, 1),
    (Op::Write, 1 << 20, 32),
    (Op::Read, 64, 1024),
    (Op::Read, 4 << 10, 1024),
    (Op::Read, 1 << 20, 1),
    (Op::Read, 1 << 20, 32),
];

/// Who moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Contender {
    /// SHM backend, target in Ferry shareable memory (mapped; one copy per range).
    ShmMapped,
    /// SHM backend, target in ordinary memory (process_vm_writev, ≤ 1,024 per call).
    ShmCma,
    /// Ferry's UCX backend, default transports, `error_handling=none`.
    Ucx,
    /// The same ranges copied (`copy_bytes`, as the backends) between the initiator's buffer
    /// and a shared mapping, in this process.
    Memcpy,
}

impl Contender {
    /// Every contender, in table order.
    pub const ALL: [Contender; 4] = [
        Contender::ShmMapped,
        Contender::ShmCma,
        Contender::Ucx,
        Contender::Memcpy,
    ];

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Contender::ShmMapped => "SHM mapped",
            Contender::ShmCma => "SHM CMA",
            Contender::Ucx => "UCX",
            Contender::Memcpy => "memcpy",
        }
    }
}

/// UCX parameters of both sides.
const UCX_PARAMS: &[(&str, &str)] = &[("error_handling", "none")];

fn ucx_params() -> Params {
    UCX_PARAMS
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn send_frame(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    stream.write_all(&(bytes.len() as u32).to_le_bytes())?;
    stream.write_all(bytes)
}

fn recv_frame(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let mut bytes = vec![0u8; u32::from_le_bytes(len) as usize];
    stream.read_exact(&mut bytes)?;
    Ok(bytes)
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The target role: `addr` is the value of [`TARGET_ENV`].
pub fn target_main(addr: &str) -> Result<(), String> {
    // Declared before the agents so that they are dropped after them.
    let shared = SharedMemory::alloc(BUFFER_LEN, &ShmOptions::default()).map_err(err)?;
    let ordinary = vec![0u8; BUFFER_LEN].into_boxed_slice();
    let pid = std::process::id();
    let shm = Agent::new(AgentConfig::named(format!("bench-shm-target-{pid}"))).map_err(err)?;
    shm.create_backend("SHM", &Params::new()).map_err(err)?;
    let ucx = Agent::new(AgentConfig::named(format!("bench-ucx-target-{pid}"))).map_err(err)?;
    ucx.create_backend("UCX", &ucx_params()).map_err(err)?;
    for agent in [&shm, &ucx] {
        // SAFETY: both buffers outlive the agents (declared first); nothing in this
        // process reads or writes them while the benchmark runs.
        unsafe {
            agent.register(MemKind::Dram, shared.desc()).map_err(err)?;
            agent
                .register(MemKind::Dram, Desc::of_slice(&ordinary))
                .map_err(err)?;
        }
    }
    let mut stream = TcpStream::connect(addr).map_err(err)?;
    send_frame(&mut stream, &shm.local_md().map_err(err)?).map_err(err)?;
    send_frame(&mut stream, &ucx.local_md().map_err(err)?).map_err(err)?;
    let addrs = [
        shared.addr().to_le_bytes(),
        (ordinary.as_ptr() as u64).to_le_bytes(),
    ]
    .concat();
    send_frame(&mut stream, &addrs).map_err(err)?;
    stream.set_nonblocking(true).map_err(err)?;
    let mut spin = false;
    let mut byte = [0u8; 1];
    loop {
        if spin {
            for _ in 0..256 {
                ucx.progress();
            }
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
        match stream.read(&mut byte) {
            Ok(1) if byte[0] == b's' => spin = true,
            Ok(1) if byte[0] == b'i' => spin = false,
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break,
        }
    }
    drop(shm);
    drop(ucx);
    drop(ordinary);
    drop(shared);
    Ok(())
}

/// Two mappings of one memfd (the raw limit's source and destination).
struct DoubleMap {
    first: *mut u8,
    second: *mut u8,
    len: usize,
}

impl DoubleMap {
    fn new(len: usize) -> Result<DoubleMap, String> {
        // SAFETY: a NUL-terminated name; returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(c"ferry-bench-memcpy".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: our fd.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(format!("ftruncate: {}", std::io::Error::last_os_error()));
        }
        let map = || {
            // SAFETY: a new shared mapping of our memfd; checked by the caller.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_POPULATE,
                    fd,
                    0,
                )
            }
        };
        let (first, second) = (map(), map());
        // SAFETY: the mappings keep the memfd alive.
        unsafe { libc::close(fd) };
        if first == libc::MAP_FAILED || second == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        Ok(DoubleMap {
            first: first.cast(),
            second: second.cast(),
            len,
        })
    }
}

impl Drop for DoubleMap {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly our two mappings.
        unsafe {
            libc::munmap(self.first.cast(), self.len);
            libc::munmap(self.second.cast(), self.len);
        }
    }
}

/// One case's requests and ranges.
struct Case {
    op: Op,
    block: usize,
    batch: usize,
    /// (source offset, destination offset) per range, for memcpy.
    offsets: Vec<(usize, usize)>,
    shm_mapped: XferId,
    shm_cma: XferId,
    ucx: XferId,
    shm_preps: Vec<PrepId>,
    ucx_preps: Vec<PrepId>,
}

/// The benchmark's state: agents, buffers, requests, and every iteration's time.
pub struct Bench {
    child: Child,
    stream: TcpStream,
    shm: Agent,
    ucx: Agent,
    _local: Box<[u8]>,
    /// `_local`'s bytes (the memcpy contender's local side).
    local_ptr: *mut u8,
    double: DoubleMap,
    cases: Vec<Case>,
    spinning: bool,
    /// Per (case, contender): every timed iteration.
    times: Vec<Vec<Vec<Duration>>>,
}

/// One request of `op` from `local_base` to `peer`'s `remote_base`, ranges `offsets`
/// of `block` bytes; its two prepared lists are pushed to `preps`.
fn make_lists(
    agent: &Agent,
    (op, peer): (Op, PeerId),
    (local_base, remote_base): (u64, u64),
    block: usize,
    offsets: &[(usize, usize)],
    preps: &mut Vec<PrepId>,
) -> Result<XferId, String> {
    let local: Vec<Desc> = offsets
        .iter()
        .map(|&(s, _)| Desc::new(local_base + s as u64, block as u64, 0))
        .collect();
    let remote: Vec<Desc> = offsets
        .iter()
        .map(|&(_, d)| Desc::new(remote_base + d as u64, block as u64, 0))
        .collect();
    let l = agent
        .prep(Side::Local, MemKind::Dram, &local)
        .map_err(err)?;
    let r = agent.prep(peer, MemKind::Dram, &remote).map_err(err)?;
    preps.push(l);
    preps.push(r);
    agent.make(op, l, &[], r, &[], None).map_err(err)
}

impl Bench {
    /// Spawn the target with `spawn(control address)` and build every case.
    pub fn start(spawn: impl FnOnce(&str) -> std::io::Result<Child>) -> Result<Bench, String> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(err)?;
        let addr = listener.local_addr().map_err(err)?.to_string();
        let child = spawn(&addr).map_err(|e| format!("spawning the target: {e}"))?;
        let (mut stream, _) = listener.accept().map_err(err)?;
        let shm_md = recv_frame(&mut stream).map_err(err)?;
        let ucx_md = recv_frame(&mut stream).map_err(err)?;
        let addrs = recv_frame(&mut stream).map_err(err)?;
        let shared_base = u64::from_le_bytes(addrs[..8].try_into().map_err(err)?);
        let ordinary_base = u64::from_le_bytes(addrs[8..16].try_into().map_err(err)?);
        let pid = std::process::id();
        let mut local = vec![7u8; BUFFER_LEN].into_boxed_slice();
        let local_ptr = local.as_mut_ptr();
        let shm = Agent::new(AgentConfig::named(format!("bench-shm-init-{pid}"))).map_err(err)?;
        shm.create_backend("SHM", &Params::new()).map_err(err)?;
        let ucx = Agent::new(AgentConfig::named(format!("bench-ucx-init-{pid}"))).map_err(err)?;
        ucx.create_backend("UCX", &ucx_params()).map_err(err)?;
        for agent in [&shm, &ucx] {
            // SAFETY: `local` lives in the returned `Bench`, dropped after the agents
            // (field order); nothing reads or writes it while transfers run.
            unsafe { agent.register(MemKind::Dram, Desc::of_slice(&local)) }.map_err(err)?;
        }
        let shm_peer = shm.load_remote_md(&shm_md).map_err(err)?;
        let ucx_peer = ucx.load_remote_md(&ucx_md).map_err(err)?;
        let mut rng = ferry_testkit::Rng::new(0x5eed_5111);
        let mut cases = Vec::new();
        for &(op, block, batch) in CASES {
            let mut slots: Vec<usize> = (0..batch).collect();
            rng.shuffle(&mut slots);
            let offsets: Vec<(usize, usize)> = slots
                .iter()
                .enumerate()
                .map(|(i, &s)| (i * block, s * block))
                .collect();
            let (mut shm_preps, mut ucx_preps) = (Vec::new(), Vec::new());
            let base = local.as_ptr() as u64;
            let shm_mapped = make_lists(
                &shm,
                (op, shm_peer),
                (base, shared_base),
                block,
                &offsets,
                &mut shm_preps,
            )?;
            let shm_cma = make_lists(
                &shm,
                (op, shm_peer),
                (base, ordinary_base),
                block,
                &offsets,
                &mut shm_preps,
            )?;
            let ucx_x = make_lists(
                &ucx,
                (op, ucx_peer),
                (base, ordinary_base),
                block,
                &offsets,
                &mut ucx_preps,
            )?;
            cases.push(Case {
                op,
                block,
                batch,
                offsets,
                shm_mapped,
                shm_cma,
                ucx: ucx_x,
                shm_preps,
                ucx_preps,
            });
        }
        Ok(Bench {
            child,
            stream,
            shm,
            ucx,
            local_ptr,
            _local: local,
            double: DoubleMap::new(2 * BUFFER_LEN)?,
            times: vec![vec![Vec::new(); Contender::ALL.len()]; CASES.len()],
            cases,
            spinning: false,
        })
    }

    fn spin_target(&mut self, spin: bool) {
        if self.spinning != spin {
            let _ = self.stream.write_all(if spin { b"s" } else { b"i" });
            self.spinning = spin;
        }
    }

    /// Run `iters` timed iterations of `case` × `who`; their total time.
    pub fn iterate(&mut self, case: usize, who: Contender, iters: u64) -> Duration {
        self.spin_target(who == Contender::Ucx);
        let mut total = Duration::ZERO;
        let index = Contender::ALL
            .iter()
            .position(|&c| c == who)
            .expect("listed");
        for _ in 0..iters {
            let t0 = Instant::now();
            let c = &self.cases[case];
            match who {
                Contender::Memcpy => {
                    for &(s, d) in &c.offsets {
                        // The local side is the buffer the agents move from and into,
                        // the remote one the second mapping of the memfd (shared memory,
                        // as the target's segment); a READ copies the other way.
                        let (local, remote) = (self.local_ptr, self.double.second);
                        // SAFETY: both ranges lie inside their buffers (offsets are below
                        // BUFFER_LEN, the remote side is shifted by it in a mapping of
                        // 2 × BUFFER_LEN); no transfer runs meanwhile (same thread).
                        unsafe {
                            let (l, r) = (local.add(s), remote.add(BUFFER_LEN + d));
                            let (from, to) = match c.op {
                                Op::Write => (l.cast_const(), r),
                                Op::Read => (r.cast_const(), l),
                            };
                            // The backends' own copy (inline at 16 to 64 bytes, `memmove`
                            // otherwise), so the limit is the copy Ferry has to make.
                            ferry_backend_api::copy_bytes(from, to, c.block)
                        };
                    }
                }
                _ => {
                    let (agent, x) = match who {
                        Contender::ShmMapped => (&self.shm, c.shm_mapped),
                        Contender::ShmCma => (&self.shm, c.shm_cma),
                        _ => (&self.ucx, c.ucx),
                    };
                    let mut status = agent.post(x).expect("post");
                    while status != XferStatus::Done {
                        status = agent.check(x).expect("check");
                    }
                }
            }
            let dt = t0.elapsed();
            self.times[case][index].push(dt);
            total += dt;
        }
        total
    }

    /// Forget the times recorded so far, then run every case for `budget` in rounds of
    /// one short burst per contender in turn (an untimed iteration first, then about
    /// 20 ms of timed ones), so that all four see the same machine — load, frequency,
    /// memory traffic — while each keeps its caches within a burst. These are the times
    /// [`Bench::table`] reports.
    pub fn interleave(&mut self, budget: Duration) {
        for per_case in &mut self.times {
            for t in per_case.iter_mut() {
                t.clear();
            }
        }
        let burst = Duration::from_millis(20);
        for case in 0..self.cases.len() {
            let started = Instant::now();
            let mut rounds = 0;
            while rounds < 3 || started.elapsed() < budget {
                for who in Contender::ALL {
                    self.iterate(case, who, 1);
                    let index = Contender::ALL
                        .iter()
                        .position(|&c| c == who)
                        .expect("listed");
                    self.times[case][index].pop();
                    let t0 = Instant::now();
                    let mut n = 0;
                    while n < 3 || t0.elapsed() < burst {
                        self.iterate(case, who, 1);
                        n += 1;
                    }
                }
                rounds += 1;
            }
        }
        self.spin_target(false);
    }

    /// The cases: (operation, block bytes, descriptors).
    pub fn cases(&self) -> Vec<(Op, usize, usize)> {
        self.cases
            .iter()
            .map(|c| (c.op, c.block, c.batch))
            .collect()
    }

    /// Markdown table of medians per case and contender, with the ratios the goals
    /// name.
    pub fn table(&self) -> String {
        let mut out = String::from(
            "| case | contender | iterations | median per request | descriptors/s | GB/s |\n|---|---|---:|---:|---:|---:|\n",
        );
        let mut notes = String::new();
        for (ci, c) in self.cases.iter().enumerate() {
            let mut medians = [0f64; 4];
            for (k, who) in Contender::ALL.iter().enumerate() {
                let mut t = self.times[ci][k].clone();
                if t.is_empty() {
                    continue;
                }
                t.sort_unstable();
                let m = t[t.len() / 2].as_secs_f64();
                medians[k] = m;
                out.push_str(&format!(
                    "| {} {} × {} | {} | {} | {:.2} µs | {:.2} M | {:.2} |\n",
                    op_name(c.op),
                    human(c.block),
                    c.batch,
                    who.name(),
                    t.len(),
                    m * 1e6,
                    c.batch as f64 / m / 1e6,
                    (c.block * c.batch) as f64 / m / 1e9
                ));
            }
            if medians.iter().all(|&m| m > 0.0) {
                notes.push_str(&format!(
                    "- {} {} × {}: SHM mapped / UCX = {:.1}× descriptors/s; SHM CMA / UCX = {:.1}×; \
                     of memcpy's bandwidth: SHM mapped {:.0}%, SHM CMA {:.0}%, UCX {:.0}%\n",
                    op_name(c.op),
                    human(c.block),
                    c.batch,
                    medians[2] / medians[0],
                    medians[2] / medians[1],
                    medians[3] / medians[0] * 100.0,
                    medians[3] / medians[1] * 100.0,
                    medians[3] / medians[2] * 100.0
                ));
            }
        }
        out.push('\n');
        out.push_str(&notes);
        out
    }

    /// Release everything and stop the target.
    pub fn finish(mut self) {
        for c in std::mem::take(&mut self.cases) {
            for x in [c.shm_mapped, c.shm_cma] {
                let _ = self.shm.release(x);
            }
            let _ = self.ucx.release(c.ucx);
            for p in c.shm_preps {
                let _ = self.shm.release_prep(p);
            }
            for p in c.ucx_preps {
                let _ = self.ucx.release_prep(p);
            }
        }
        // Our agents go first, while the target is alive and progressing UCX, so their
        // endpoint closes are answered (a close to a process that already left is never
        // confirmed with `error_handling=none`, and UCX then reports its pending request
        // when the worker is destroyed).
        self.spin_target(true);
        let Bench {
            mut child,
            mut stream,
            shm,
            ucx,
            ..
        } = self;
        drop(ucx);
        drop(shm);
        let _ = stream.write_all(b"q");
        let _ = child.wait();
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Write => "WRITE",
        Op::Read => "READ",
    }
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}
