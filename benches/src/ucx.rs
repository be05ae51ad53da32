//! DRAM → DRAM (or, with the `cuda` feature, VRAM on either side: [`Placement`])
//! between two processes over the UCX backend, through `ferry::Agent`.
//!
//! The initiator (this process) spawns a target process (the same binary, told its
//! role by [`TARGET_ENV`]), which registers a buffer, sends its metadata blob over a
//! TCP socket on 127.0.0.1 and then only progresses its agent until told to stop. The
//! initiator prepares both descriptor lists once, makes one request per case and then
//! times post → done repeatedly. Reported per case: median time per request,
//! bandwidth (bytes / median) and descriptors per second (descriptors / median).
//!
//! Cases: block 4 KiB / 64 KiB / 1 MiB / 16 MiB × batch 1 / 32 / 1024, WRITE and READ,
//! remote order contiguous and shuffled, plus the control-path case 64 B × 1024
//! shuffled. A request larger than the buffers wraps around them (contents are not
//! checked here; the tests do that). Then the idle CPU of a progress thread.
//!
//! Entry points for a command-line tool: [`run`] (initiator) and [`target_main`].

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Child;
use std::time::{Duration, Instant};

use ferry::{Agent, AgentConfig, BackendId, Desc, MemKind, Op, Params, XferStatus};
use ferry_testkit::cpu::{clock_ticks_per_second, thread_cpu_ticks};

/// Environment variable that tells a spawned process to act as the target; its value is
/// the initiator's control address (`127.0.0.1:port`), followed by `,` and the
/// target's memory (`dram` or `vram:DEV`), then `,` and the UCX backend parameters as
/// `key=value;key=value`.
pub const TARGET_ENV: &str = "FERRY_BENCH_UCX_TARGET";

/// Buffer size on each side.
const BUFFER_LEN: usize = 256 << 20;

/// Environment variable: `0` allocates the buffers with plain 4 KiB pages; anything
/// else (or unset) asks for transparent huge pages (`madvise(MADV_HUGEPAGE)`), which is
/// what numpy does for large arrays and so what NIXL's Python benchmark gets.
pub const HUGEPAGES_ENV: &str = "FERRY_BENCH_UCX_HUGEPAGES";

/// What every byte of a host buffer holds before the first transfer.
const FILL_BYTE: u8 = 0x5a;

/// Alignment of the buffers: one transparent huge page.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// An anonymous mapping of [`BUFFER_LEN`] bytes, 2 MiB aligned, optionally backed by
/// transparent huge pages, every page written once ([`FILL_BYTE`]). Unmapped on drop.
///
/// The write matters for honest numbers: an untouched anonymous page reads as the
/// kernel's shared zero page, so a transfer *from* untouched memory reads one cache-hot
/// page instead of DRAM. NIXL's script fills its buffers the same way.
struct Buffer {
    map: *mut libc::c_void,
    map_len: usize,
    base: *mut u8,
}

impl Buffer {
    fn new() -> Result<Buffer, String> {
        let huge = std::env::var(HUGEPAGES_ENV).map_or(true, |v| v != "0");
        let map_len = BUFFER_LEN + HUGE_PAGE_BYTES;
        // SAFETY: anonymous private mapping, no address hint; the result is checked.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(format!(
                "mmap of {map_len} bytes: {}",
                std::io::Error::last_os_error()
            ));
        }
        let offset = (map as usize).next_multiple_of(HUGE_PAGE_BYTES) - map as usize;
        // SAFETY: offset < HUGE_PAGE_BYTES, so base..base+BUFFER_LEN lies in the mapping.
        let base = unsafe { map.cast::<u8>().add(offset) };
        let advice = if huge {
            libc::MADV_HUGEPAGE
        } else {
            libc::MADV_NOHUGEPAGE
        };
        // SAFETY: the range lies inside our mapping; madvise only changes paging policy.
        // A kernel without THP refuses it, which leaves ordinary pages: fine for a bench.
        let _ = unsafe { libc::madvise(base.cast(), BUFFER_LEN, advice) };
        // SAFETY: base..base+BUFFER_LEN is our writable mapping (see above).
        unsafe { std::ptr::write_bytes(base, FILL_BYTE, BUFFER_LEN) };
        Ok(Buffer { map, map_len, base })
    }

    fn addr(&self) -> u64 {
        self.base as u64
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: base..base+BUFFER_LEN is mapped, readable and initialised (filled in
        // new()), and lives as long as self.
        unsafe { std::slice::from_raw_parts(self.base, BUFFER_LEN) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in new(); nothing refers to it
        // any more (the agents that registered it are dropped first).
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// Environment variable: the memory of the two sides, `dram` (default), `vram` (both
/// sides), or `INITIATOR,TARGET` (e.g. `vram,dram`). VRAM needs the `cuda` feature.
pub const MEM_ENV: &str = "FERRY_BENCH_UCX_MEM";

/// Environment variable: the CUDA device of VRAM buffers (default 0), both sides.
pub const DEV_ENV: &str = "FERRY_BENCH_UCX_DEV";

/// The message for VRAM in a build without the `cuda` feature.
pub const NO_CUDA_FEATURE: &str = "VRAM needs the `cuda` feature of ferry-benches \
    (cargo bench -p ferry-benches --features cuda --bench ucx)";

/// Where one side's buffer lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Host memory (an anonymous mapping, optionally with huge pages).
    #[default]
    Dram,
    /// Device memory of CUDA device `dev` (feature `cuda`).
    Vram {
        /// The CUDA device ordinal (`desc.dev` of the descriptors).
        dev: u64,
    },
}

impl Placement {
    /// The two sides' placements from [`MEM_ENV`] and [`DEV_ENV`]: (initiator, target).
    pub fn from_env() -> Result<(Placement, Placement), String> {
        Placement::parse(
            std::env::var(MEM_ENV).ok().as_deref(),
            std::env::var(DEV_ENV).ok().as_deref(),
        )
    }

    /// The two sides' placements from the values of [`MEM_ENV`] and [`DEV_ENV`].
    pub fn parse(mem: Option<&str>, dev: Option<&str>) -> Result<(Placement, Placement), String> {
        let dev = match dev {
            Some(text) => text
                .trim()
                .parse::<u64>()
                .map_err(|_| format!("{DEV_ENV}={text}: expected a CUDA device ordinal"))?,
            None => 0,
        };
        let text = mem.unwrap_or_default();
        let one = |word: &str| {
            match word.trim().to_ascii_lowercase().as_str() {
            "" | "dram" => Ok(Placement::Dram),
            "vram" => Ok(Placement::Vram { dev }),
            other => Err(format!(
                "{MEM_ENV}={text}: '{other}' is not a memory kind (dram or vram; INITIATOR,TARGET for two)"
            )),
        }
        };
        match text.split_once(',') {
            Some((initiator, target)) => Ok((one(initiator)?, one(target)?)),
            None => {
                let both = one(text)?;
                Ok((both, both))
            }
        }
    }

    /// The memory kind.
    pub fn kind(self) -> MemKind {
        match self {
            Placement::Dram => MemKind::Dram,
            Placement::Vram { .. } => MemKind::Vram,
        }
    }

    /// The device id of its descriptors.
    pub fn dev(self) -> u64 {
        match self {
            Placement::Dram => 0,
            Placement::Vram { dev } => dev,
        }
    }

    /// Whether this process can allocate it: for VRAM, the `cuda` feature, a CUDA
    /// driver and the device (the driver's typed reason otherwise).
    pub fn check(self) -> Result<(), String> {
        match self {
            Placement::Dram => Ok(()),
            #[cfg(feature = "cuda")]
            Placement::Vram { dev } => ferry_cuda::Device::open(dev)
                .map(drop)
                .map_err(|e| e.to_string()),
            #[cfg(not(feature = "cuda"))]
            Placement::Vram { .. } => Err(NO_CUDA_FEATURE.into()),
        }
    }

    fn encode(self) -> String {
        match self {
            Placement::Dram => "dram".into(),
            Placement::Vram { dev } => format!("vram:{dev}"),
        }
    }

    fn decode(text: &str) -> Result<Placement, String> {
        match text.split_once(':') {
            None if text == "dram" => Ok(Placement::Dram),
            Some(("vram", dev)) => dev
                .parse()
                .map(|dev| Placement::Vram { dev })
                .map_err(|_| format!("bad device in '{text}'")),
            _ => Err(format!("bad memory '{text}' in {TARGET_ENV}")),
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Dram => write!(f, "DRAM"),
            Placement::Vram { dev } => write!(f, "VRAM (device {dev})"),
        }
    }
}

/// Environment variable: who allocates the DRAM buffers of both sides. `ucx`: the UCX
/// backend (`Agent::alloc`, a UCX shared-memory segment as `ucx_perftest` uses);
/// unset, empty or `caller`: the bench itself (an anonymous mapping, see
/// [`HUGEPAGES_ENV`]).
pub const ALLOC_ENV: &str = "FERRY_BENCH_UCX_ALLOC";

/// Who allocates the buffers of both sides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Alloc {
    /// The bench (ordinary memory the caller owns), registered with `Agent::register`.
    #[default]
    Caller,
    /// The UCX backend, through `Agent::alloc` (DRAM only).
    Ucx,
}

impl Alloc {
    /// The setting from [`ALLOC_ENV`].
    pub fn from_env() -> Result<Alloc, String> {
        Alloc::parse(std::env::var(ALLOC_ENV).ok().as_deref())
    }

    /// The setting from a value of [`ALLOC_ENV`].
    pub fn parse(text: Option<&str>) -> Result<Alloc, String> {
        match text.map(str::trim).unwrap_or_default() {
            "" | "caller" => Ok(Alloc::Caller),
            "ucx" => Ok(Alloc::Ucx),
            other => Err(format!("{ALLOC_ENV}={other}: expected 'ucx' or 'caller'")),
        }
    }

    fn encode(self) -> &'static str {
        match self {
            Alloc::Caller => "caller",
            Alloc::Ucx => "ucx",
        }
    }
}

impl std::fmt::Display for Alloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Alloc::Caller => "caller-allocated",
            Alloc::Ucx => "UCX-allocated",
        })
    }
}

/// One side's registered buffer of [`BUFFER_LEN`] bytes: host memory or device memory.
enum Memory {
    Host(Buffer),
    /// Allocated and registered by the UCX backend (freed with the agent).
    Ucx(Desc),
    #[cfg(feature = "cuda")]
    Device(ferry_cuda::DeviceBuffer),
}

impl Memory {
    /// Allocate `place` through the UCX backend `ucx` of `agent` (registered already).
    fn alloc_through(agent: &Agent, ucx: BackendId, place: Placement) -> Result<Memory, String> {
        if place != Placement::Dram {
            return Err(format!("{ALLOC_ENV}=ucx allocates DRAM only, not {place}"));
        }
        agent
            .alloc(ucx, MemKind::Dram, BUFFER_LEN as u64)
            .map(|(_, desc)| Memory::Ucx(desc))
            .map_err(|e| format!("allocating {BUFFER_LEN} bytes through UCX: {e}"))
    }

    fn alloc(place: Placement) -> Result<Memory, String> {
        match place {
            Placement::Dram => Buffer::new().map(Memory::Host),
            #[cfg(feature = "cuda")]
            Placement::Vram { dev } => {
                let device = ferry_cuda::Device::open(dev).map_err(|e| e.to_string())?;
                ferry_cuda::DeviceBuffer::alloc(&device, BUFFER_LEN)
                    .map(Memory::Device)
                    .map_err(|e| format!("allocating {BUFFER_LEN} bytes on CUDA device {dev}: {e}"))
            }
            #[cfg(not(feature = "cuda"))]
            Placement::Vram { .. } => Err(NO_CUDA_FEATURE.into()),
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Memory::Host(b) => b.addr(),
            Memory::Ucx(desc) => desc.addr,
            #[cfg(feature = "cuda")]
            Memory::Device(b) => b.addr(),
        }
    }

    /// Register the whole buffer with `agent` as `place` says.
    ///
    /// # Safety
    /// The buffer outlives the agent.
    unsafe fn register(&self, agent: &Agent, place: Placement) -> Result<(), String> {
        let desc = match self {
            Memory::Host(b) => Desc::of_slice(b.as_slice()),
            // Registered by `Agent::alloc` already.
            Memory::Ucx(_) => return Ok(()),
            #[cfg(feature = "cuda")]
            Memory::Device(b) => Desc::new(b.addr(), b.len() as u64, place.dev()),
        };
        // SAFETY: the caller's promise; nothing reads or writes the buffer from Rust
        // while transfers run.
        unsafe { agent.register(place.kind(), desc) }
            .map(drop)
            .map_err(|e| format!("registering {BUFFER_LEN} bytes of {place}: {e}"))
    }
}

/// One benchmark run's settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// UCX backend parameters for both sides (e.g. `transports=tcp`,
    /// `error_handling=none`).
    pub params: Vec<(String, String)>,
    /// Block sizes in bytes.
    pub blocks: Vec<usize>,
    /// Descriptors per request.
    pub batches: Vec<usize>,
    /// Time budget per case (at least `min_iters` iterations run).
    pub case_time: Duration,
    /// Minimum timed iterations per case.
    pub min_iters: usize,
    /// Timed iterations after which a case stops even inside `case_time` (`None`: only
    /// the time budget ends it). `nixl_write.py --max-iters` is the same cap on NIXL's
    /// side, so a comparison gives both sides the same one.
    pub max_iters: Option<usize>,
    /// Operations measured per case, in order.
    pub ops: Vec<Op>,
    /// Remote orders measured per block × batch: `false` contiguous, `true` shuffled.
    pub orders: Vec<bool>,
    /// Also run the 64 B × 1024 control-path case.
    pub control_path: bool,
    /// Also measure the idle CPU of a progress thread.
    pub idle_cpu: bool,
    /// The initiator's buffer.
    pub initiator_mem: Placement,
    /// The target's buffer.
    pub target_mem: Placement,
    /// Who allocates both sides' buffers.
    pub alloc: Alloc,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            params: Vec::new(),
            blocks: vec![4 << 10, 64 << 10, 1 << 20, 16 << 20],
            batches: vec![1, 32, 1024],
            case_time: Duration::from_millis(700),
            min_iters: 3,
            max_iters: None,
            ops: vec![Op::Write, Op::Read],
            orders: vec![false, true],
            control_path: true,
            idle_cpu: true,
            initiator_mem: Placement::Dram,
            target_mem: Placement::Dram,
            alloc: Alloc::Caller,
        }
    }
}

/// One measured case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// READ or WRITE.
    pub op: Op,
    /// Block size in bytes.
    pub block_bytes: usize,
    /// Descriptors per request.
    pub batch: usize,
    /// Remote order shuffled (else contiguous).
    pub shuffled: bool,
    /// Ranges after merging.
    pub merged_ranges: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Median time per request (post until done).
    pub median: Duration,
    /// Median time `post` itself took (it must return without waiting for the data).
    pub post_median: Duration,
    /// Longest time `post` took.
    pub post_max: Duration,
}

impl CaseResult {
    /// Bytes per second at the median.
    pub fn bandwidth_bytes_per_s(&self) -> f64 {
        (self.block_bytes * self.batch) as f64 / self.median.as_secs_f64()
    }
    /// Descriptors per second at the median.
    pub fn descriptors_per_s(&self) -> f64 {
        self.batch as f64 / self.median.as_secs_f64()
    }
}

impl std::fmt::Display for CaseResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:5} block {:>8} × {:>4} {:10} merged {:>4}  median {:>10.1} µs  {:>7.2} GB/s  {:>6.2} M desc/s  post {:>7.1} µs (max {:.1})  ({} iters)",
            self.op.to_string(),
            human(self.block_bytes),
            self.batch,
            if self.shuffled { "shuffled" } else { "contiguous" },
            self.merged_ranges,
            self.median.as_secs_f64() * 1e6,
            self.bandwidth_bytes_per_s() / 1e9,
            self.descriptors_per_s() / 1e6,
            self.post_median.as_secs_f64() * 1e6,
            self.post_max.as_secs_f64() * 1e6,
            self.iters
        )
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

/// Everything measured.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// UCX version and the initiator→target transports.
    pub transports: String,
    /// Per-case results.
    pub cases: Vec<CaseResult>,
    /// Idle progress-thread CPU, percent of one core.
    pub idle_thread_cpu_percent: Option<f64>,
}

fn params_of(pairs: &[(String, String)]) -> Params {
    pairs.iter().cloned().collect()
}

fn encode_params(pairs: &[(String, String)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(";")
}

pub(crate) fn decode_params(text: &str) -> Vec<(String, String)> {
    text.split(';')
        .filter(|s| !s.is_empty())
        .filter_map(|kv| kv.split_once('='))
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

fn ucx_agent(name: &str, params: &[(String, String)]) -> Result<(Agent, BackendId), String> {
    let agent = Agent::new(AgentConfig::named(name)).map_err(|e| e.to_string())?;
    let ucx = agent
        .create_backend("UCX", &params_of(params))
        .map_err(|e| e.to_string())?;
    Ok((agent, ucx))
}

/// Register `ordinary` (the caller's buffer) with `agent`, or, without one, allocate
/// the side's buffer through the agent's UCX backend `ucx`; returns the latter.
///
/// # Safety
/// `ordinary` outlives the agent.
unsafe fn side_memory(
    agent: &Agent,
    ucx: BackendId,
    place: Placement,
    ordinary: Option<&Memory>,
) -> Result<Option<Memory>, String> {
    match ordinary {
        // SAFETY: the caller's promise.
        Some(memory) => unsafe { memory.register(agent, place) }.map(|()| None),
        None => Memory::alloc_through(agent, ucx, place).map(Some),
    }
}

/// The target role: `spec` is the value of [`TARGET_ENV`].
pub fn target_main(spec: &str) -> Result<(), String> {
    let (addr, rest) = spec.split_once(',').unwrap_or((spec, "dram,"));
    let (mem, params) = rest.split_once(',').unwrap_or((rest, ""));
    let (mem, alloc) = mem.split_once('@').unwrap_or((mem, "caller"));
    let place = Placement::decode(mem)?;
    let alloc = Alloc::parse(Some(alloc))?;
    let params = decode_params(params);
    // Declared before the agent so that it is dropped after it on every path.
    let ordinary = match alloc {
        Alloc::Caller => Some(Memory::alloc(place)?),
        Alloc::Ucx => None,
    };
    let (agent, ucx) = ucx_agent(&format!("bench-target-{}", std::process::id()), &params)?;
    // SAFETY: `ordinary` lives until this function returns, after the agent is dropped.
    let allocated = unsafe { side_memory(&agent, ucx, place, ordinary.as_ref()) }?;
    let buffer = allocated
        .as_ref()
        .or(ordinary.as_ref())
        .ok_or("no buffer")?;
    let mut stream = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    send_frame(&mut stream, &agent.local_md().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    send_frame(&mut stream, &buffer.addr().to_le_bytes()).map_err(|e| e.to_string())?;
    stream.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut byte = [0u8; 1];
    loop {
        for _ in 0..256 {
            agent.progress();
        }
        match stream.read(&mut byte) {
            Ok(0) => break,
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break,
        }
    }
    drop(agent);
    drop(ordinary);
    Ok(())
}

/// Run the benchmark; `spawn_target(env_value)` must start a process that calls
/// [`target_main`] with that value (e.g. this binary with [`TARGET_ENV`] set).
pub fn run(
    config: &Config,
    spawn_target: impl FnOnce(&str) -> std::io::Result<Child>,
    mut on_case: impl FnMut(&CaseResult),
) -> Result<Report, String> {
    // Before anything starts: a VRAM side needs the feature, the driver and the device.
    config
        .initiator_mem
        .check()
        .map_err(|e| format!("initiator memory: {e}"))?;
    config
        .target_mem
        .check()
        .map_err(|e| format!("target memory: {e}"))?;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let spec = format!(
        "{},{}@{},{}",
        listener.local_addr().map_err(|e| e.to_string())?,
        config.target_mem.encode(),
        config.alloc.encode(),
        encode_params(&config.params)
    );
    let mut child = spawn_target(&spec).map_err(|e| format!("spawning the target: {e}"))?;
    let result = accept_target(&listener, &mut child)
        .and_then(|stream| run_with_target(config, stream, &mut on_case));
    let _ = child.wait();
    result
}

/// How long the initiator waits for the target to connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

/// The target's control connection; an error if the target ends (or stays silent for
/// [`CONNECT_TIMEOUT`]) before connecting.
fn accept_target(listener: &TcpListener, child: &mut Child) -> Result<TcpStream, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let started = Instant::now();
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).map_err(|e| e.to_string())?;
                return Ok(stream);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("waiting for the target: {e}")),
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "the target process ended ({status}) before connecting; its messages are above"
            ));
        }
        if started.elapsed() > CONNECT_TIMEOUT {
            let _ = child.kill();
            return Err(format!(
                "the target process did not connect within {} s",
                CONNECT_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn run_with_target(
    config: &Config,
    mut stream: TcpStream,
    on_case: &mut impl FnMut(&CaseResult),
) -> Result<Report, String> {
    let md = recv_frame(&mut stream).map_err(|e| e.to_string())?;
    let remote_base = u64::from_le_bytes(
        recv_frame(&mut stream)
            .map_err(|e| e.to_string())?
            .try_into()
            .map_err(|_| "bad address frame".to_string())?,
    );
    // Declared before the agent so that it is dropped after it on every path.
    let ordinary = match config.alloc {
        Alloc::Caller => Some(Memory::alloc(config.initiator_mem)?),
        Alloc::Ucx => None,
    };
    let (agent, ucx) = ucx_agent(
        &format!("bench-initiator-{}", std::process::id()),
        &config.params,
    )?;
    // SAFETY: `ordinary` outlives the agent (declared before it, so dropped after it).
    let allocated = unsafe { side_memory(&agent, ucx, config.initiator_mem, ordinary.as_ref()) }?;
    let local = allocated
        .as_ref()
        .or(ordinary.as_ref())
        .ok_or("no buffer")?;
    let (local_kind, local_dev) = (config.initiator_mem.kind(), config.initiator_mem.dev());
    let (remote_kind, remote_dev) = (config.target_mem.kind(), config.target_mem.dev());
    let peer = agent.load_remote_md(&md).map_err(|e| e.to_string())?;

    let mut report = Report::default();
    let mut cases: Vec<(usize, usize, bool)> = Vec::new();
    for &block in &config.blocks {
        for &batch in &config.batches {
            for &shuffled in &config.orders {
                cases.push((block, batch, shuffled));
            }
        }
    }
    if config.control_path {
        cases.push((64, 1024, true));
    }
    let mut rng = ferry_testkit::Rng::new(0x2545_f491_4f6c_dd1d);
    for (block, batch, shuffled) in cases {
        let slots = (BUFFER_LEN / block).max(1);
        let mut remote_slots: Vec<usize> = (0..batch).map(|i| i % slots).collect();
        if shuffled {
            rng.shuffle(&mut remote_slots);
        }
        let local_descs: Vec<Desc> = (0..batch)
            .map(|i| {
                Desc::new(
                    local.addr() + ((i % slots) * block) as u64,
                    block as u64,
                    local_dev,
                )
            })
            .collect();
        let remote_descs: Vec<Desc> = remote_slots
            .iter()
            .map(|&s| Desc::new(remote_base + (s * block) as u64, block as u64, remote_dev))
            .collect();
        let local_prep = agent
            .prep(ferry::Side::Local, local_kind, &local_descs)
            .map_err(|e| e.to_string())?;
        let remote_prep = agent
            .prep(peer, remote_kind, &remote_descs)
            .map_err(|e| e.to_string())?;
        for &op in &config.ops {
            let x = agent
                .make(op, local_prep, &[], remote_prep, &[], None)
                .map_err(|e| e.to_string())?;
            let merged_ranges = agent.xfer_ranges(x).map_err(|e| e.to_string())?;
            let mut times = Vec::new();
            let mut post_times = Vec::new();
            let started = Instant::now();
            let mut warm = true;
            while warm || times.len() < config.min_iters || started.elapsed() < config.case_time {
                let t0 = Instant::now();
                let mut status = agent.post(x).map_err(|e| e.to_string())?;
                let posted = t0.elapsed();
                while status != XferStatus::Done {
                    status = agent.check(x).map_err(|e| e.to_string())?;
                }
                if !warm {
                    times.push(t0.elapsed());
                    post_times.push(posted);
                }
                warm = false;
                if config.max_iters.is_some_and(|max| times.len() >= max) {
                    break;
                }
            }
            times.sort_unstable();
            post_times.sort_unstable();
            let case = CaseResult {
                op,
                block_bytes: block,
                batch,
                shuffled,
                merged_ranges,
                iters: times.len(),
                median: times[times.len() / 2],
                post_median: post_times[post_times.len() / 2],
                post_max: post_times[post_times.len() - 1],
            };
            on_case(&case);
            report.cases.push(case);
            agent.release(x).map_err(|e| e.to_string())?;
        }
        agent.release_prep(local_prep).map_err(|e| e.to_string())?;
        agent.release_prep(remote_prep).map_err(|e| e.to_string())?;
    }
    report.transports = agent
        .backends()
        .first()
        .map(|b| format!("{:?}", b.params))
        .unwrap_or_default();
    // Tell the target to stop.
    let _ = stream.write_all(b"q");
    drop(agent);
    drop(ordinary);

    if config.idle_cpu {
        report.idle_thread_cpu_percent = Some(idle_thread_cpu(&config.params)?);
    }
    Ok(report)
}

/// CPU used by an idle UCX progress thread over 2 s, percent of one core.
fn idle_thread_cpu(params: &[(String, String)]) -> Result<f64, String> {
    let mut params = params.to_vec();
    params.retain(|(k, _)| k != "progress_thread");
    params.push(("progress_thread".into(), "true".into()));
    let (agent, _) = ucx_agent(&format!("bench-idle-{}", std::process::id()), &params)?;
    std::thread::sleep(Duration::from_millis(200));
    let before = thread_cpu_ticks("ferry-ucx-progr");
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let ticks = thread_cpu_ticks("ferry-ucx-progr") - before;
    let elapsed = t0.elapsed().as_secs_f64();
    drop(agent);
    let hz = clock_ticks_per_second() as f64;
    Ok(ticks as f64 / hz / elapsed * 100.0)
}

/// The single-copy limit of one case: `memcpy` of the same ranges (the same block size,
/// count and remote slot order as [`run`] gives a config with that one case) between two
/// buffers like the benchmark's, in this process; every timed iteration copies the
/// whole request once. Median per request over `case_time` (at least 10 iterations,
/// at most `max_iters` when given).
pub fn memcpy_limit(
    block: usize,
    batch: usize,
    shuffled: bool,
    case_time: Duration,
    max_iters: Option<usize>,
) -> Result<Duration, String> {
    let (src, dst) = (Buffer::new()?, Buffer::new()?);
    let slots = (BUFFER_LEN / block).max(1);
    let mut remote_slots: Vec<usize> = (0..batch).map(|i| i % slots).collect();
    if shuffled {
        // The same generator and seed as `run`, so its first case's order.
        ferry_testkit::Rng::new(0x2545_f491_4f6c_dd1d).shuffle(&mut remote_slots);
    }
    let block = block.min(BUFFER_LEN);
    let mut times = Vec::new();
    let started = Instant::now();
    let mut warm = true;
    while warm || times.len() < 10 || started.elapsed() < case_time {
        let t0 = Instant::now();
        for (i, &slot) in remote_slots.iter().enumerate() {
            let (from, to) = ((i % slots) * block, slot * block);
            // SAFETY: both ranges lie inside their own buffer (slot < slots and
            // slots * block <= BUFFER_LEN), and the two buffers are distinct mappings.
            unsafe { std::ptr::copy_nonoverlapping(src.base.add(from), dst.base.add(to), block) };
        }
        std::hint::black_box(dst.base);
        if !warm {
            times.push(t0.elapsed());
        }
        warm = false;
        if max_iters.is_some_and(|max| times.len() >= max) {
            break;
        }
    }
    times.sort_unstable();
    Ok(times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_settings_parse_and_bad_ones_are_named() {
        let vram = |dev| Placement::Vram { dev };
        assert_eq!(
            Placement::parse(None, None),
            Ok((Placement::Dram, Placement::Dram))
        );
        assert_eq!(
            Placement::parse(Some("VRAM"), Some("2")),
            Ok((vram(2), vram(2)))
        );
        assert_eq!(
            Placement::parse(Some("vram,dram"), None),
            Ok((vram(0), Placement::Dram))
        );
        let err = Placement::parse(Some("dram,hbm"), None).unwrap_err();
        assert!(err.contains("'hbm' is not a memory kind"), "{err}");
        let err = Placement::parse(Some("vram"), Some("-1")).unwrap_err();
        assert!(err.contains("FERRY_BENCH_UCX_DEV=-1"), "{err}");
        for place in [Placement::Dram, vram(7)] {
            assert_eq!(Placement::decode(&place.encode()), Ok(place));
        }
        assert!(Placement::decode("vram:x").is_err());
        assert_eq!(vram(1).to_string(), "VRAM (device 1)");
    }

    #[test]
    fn alloc_settings_parse_and_bad_ones_are_named() {
        assert_eq!(Alloc::parse(None), Ok(Alloc::Caller));
        assert_eq!(Alloc::parse(Some("caller")), Ok(Alloc::Caller));
        assert_eq!(Alloc::parse(Some(" ucx ")), Ok(Alloc::Ucx));
        let err = Alloc::parse(Some("cuda")).unwrap_err();
        assert!(err.contains("FERRY_BENCH_UCX_ALLOC=cuda"), "{err}");
        for alloc in [Alloc::Caller, Alloc::Ucx] {
            assert_eq!(Alloc::parse(Some(alloc.encode())), Ok(alloc));
        }
    }

    /// VRAM on a machine (or build) without it: the reason, before a target starts.
    #[test]
    fn vram_without_a_gpu_fails_before_the_target_starts() {
        // Device 1023 exists nowhere: no GPU work, whatever the machine has.
        let config = Config {
            target_mem: Placement::Vram { dev: 1023 },
            ..Config::default()
        };
        let err = run(
            &config,
            |_| Err(std::io::Error::other("the target must not be spawned")),
            |_| {},
        )
        .unwrap_err();
        assert!(err.starts_with("target memory: "), "{err}");
        if cfg!(feature = "cuda") {
            assert!(
                err.contains("VRAM needs a CUDA driver: libcuda.so.1 not found")
                    || err.contains("no CUDA device 1023: the driver reports"),
                "{err}"
            );
        } else {
            assert!(err.ends_with(NO_CUDA_FEATURE), "{err}");
        }
    }
}
