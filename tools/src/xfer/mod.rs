//! `ferry bench xfer`: the transfer sweep (what nixlbench measures, and more).
//!
//! Cases: every scheme × op × request mode × layout × block size × batch size asked
//! for. Each case runs `warmup` untimed and `iters` timed iterations on every active
//! initiator worker (one thread and one agent each), started together; an iteration
//! posts one request per target the worker talks to and waits until all are done.
//!
//! Where the two sides live:
//! - LOOPBACK: initiators and targets are agents of this process (the backend moves
//!   bytes inside one process only).
//! - POSIX: each initiator moves bytes between its memory and its own file (local only).
//! - OBJ: each initiator moves bytes between its memory and objects of its own in the
//!   bucket (`--endpoint`, `--bucket`): every block is one object (a WRITE replaces a
//!   whole object), so READ cases need the objects an earlier WRITE case of the same
//!   run made (`--op write,read`).
//! - UCX: the targets are agents of another process. By default this command spawns
//!   it (the same binary with `--role target`) and both find each other through a
//!   TCPStore server it starts on 127.0.0.1; with `--role initiator|target` and a store
//!   (`--tcpstore HOST:PORT`, or `--etcd URL` in a build with the `etcd` feature) they
//!   run on different hosts. Targets publish their metadata through the agent's
//!   exchange; initiators fetch it through a metadata-exchange manager.
//!
//! Schemes with `--threads N`: `pairwise` (worker i ↔ target i), `many-to-one` (N
//! workers → target 0, each in its own slice of it), `one-to-many` (worker 0 → N
//! targets, one request to each per iteration).

mod buffer;
pub mod kv;
mod plot;
mod report;
mod sweep;
mod target;
mod vram;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use ferry::MemKind;

use crate::args::{human_bytes, size};
use crate::bench::OpArg;
use crate::md::ExchangeArgs;

/// `ferry bench xfer` arguments.
#[derive(Args, Debug, Clone)]
#[command(
    after_help = "Sizes take K, M, G suffixes (binary). Lists are comma-separated: \
    --op read,write --layout contiguous,shuffled. Columns: GB/s = 1e9 bytes per second \
    over all workers; lat = wall time per iteration; prep/post/xfer = the time to prepare \
    a request (prep + make; once per case when prepared), the post call, and post to \
    completion (Ferry's per-request telemetry), each as average and p99 in µs; ranges = \
    ranges per request after merging; est = Agent::estimate of post to completion, made     after the warm-up, to compare with xfer µs, and its method (analytical: the     transport's model, measured: a fit of this agent's completed requests)."
)]
pub struct XferArgs {
    /// The backend: `default` (what an agent gets when nobody names one: LOOPBACK, SHM,
    /// UCX, POSIX, each peer taking the first that reaches it; two processes), UCX or SHM
    /// (two processes), LOOPBACK (in-process), POSIX or GDS (memory <-> file), OBJ
    /// (memory <-> objects; a build with the `obj` feature).
    #[arg(long, value_enum, default_value_t = BackendArg::Default, ignore_case = true)]
    pub backend: BackendArg,
    /// Operations to measure, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "write",
        ignore_case = true
    )]
    pub op: Vec<OpArg>,
    /// Memory kind on the initiator side (vram: UCX, in a build with the cuda feature).
    #[arg(long, value_enum, default_value_t = InitiatorMem::Dram, ignore_case = true)]
    pub initiator_mem: InitiatorMem,
    /// Memory kind on the target side (file: POSIX and GDS; object: OBJ, its default;
    /// vram as --initiator-mem).
    #[arg(long, value_enum, default_value_t = MemArg::Dram, ignore_case = true)]
    pub target_mem: MemArg,
    /// Smallest block size.
    #[arg(allow_negative_numbers = true, long, default_value = "4K", value_parser = size)]
    pub start_block: u64,
    /// Largest block size.
    #[arg(allow_negative_numbers = true, long, default_value = "64M", value_parser = size)]
    pub max_block: u64,
    /// Block size multiplier between steps.
    #[arg(allow_negative_numbers = true, long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(2..=1024))]
    pub block_factor: u64,
    /// Smallest batch (descriptors per request).
    #[arg(allow_negative_numbers = true, long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub start_batch: u32,
    /// Largest batch.
    #[arg(allow_negative_numbers = true, long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub max_batch: u32,
    /// Batch multiplier between steps.
    #[arg(allow_negative_numbers = true, long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(2..=1024))]
    pub batch_factor: u32,
    /// Descriptor layout on the target: contiguous blocks (they merge) or shuffled.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "contiguous")]
    pub layout: Vec<Layout>,
    /// Prepared (lists and request made once, reposted) or one-shot (prep, make, post,
    /// release every iteration).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "prepared")]
    pub request: Vec<RequestMode>,
    /// Initiator workers (one thread and agent each) and target agents.
    #[arg(allow_negative_numbers = true, long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub threads: u32,
    /// How workers map to targets (matters with --threads > 1).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "pairwise")]
    pub scheme: Vec<Scheme>,
    /// Timed iterations per case.
    #[arg(allow_negative_numbers = true, long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub iters: u32,
    /// Untimed iterations before them.
    #[arg(allow_negative_numbers = true, long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub warmup: u32,
    /// Check the bytes after each case (WRITE: read back; READ: against what was put
    /// there first). Needs the requests to fit the buffer without wrapping.
    #[arg(long)]
    pub check: bool,
    /// Buffer per worker and target (default: the largest request, at most 256 MiB);
    /// larger requests wrap around it.
    #[arg(allow_negative_numbers = true, long, value_parser = size)]
    pub buffer: Option<u64>,
    /// Backend parameter for every agent, KEY=VALUE (repeatable; `ferry backends` lists
    /// them), e.g. --param transports=tcp.
    #[arg(long = "param", value_name = "KEY=VALUE", value_parser = crate::args::key_value)]
    pub params: Vec<(String, String)>,
    /// UCX: declare a target unreachable when its requests make no progress for this
    /// many ms (the backend's `peer_timeout_ms`, 0..=86400000, 0 = never; default
    /// 10000). Raise it above the longest batch (bytes / link rate). The spawned
    /// target gets it too.
    #[arg(allow_negative_numbers = true, long, value_name = "MS", value_parser = clap::value_parser!(u64).range(0..=86_400_000))]
    pub peer_timeout_ms: Option<u64>,
    /// UCX: auto spawns the target process here; initiator and target run the two
    /// sides on different hosts, meeting through --tcpstore or --etcd.
    #[arg(long, value_enum, default_value_t = Role::Auto)]
    pub role: Role,
    #[command(flatten)]
    pub exchange: ExchangeArgs,
    #[command(flatten)]
    pub gpu: vram::GpuArgs,
    /// Names the run in the store (both sides must agree): agents are
    /// `<run-id>-target-<k>` and `<run-id>-initiator-<i>`.
    #[arg(long, default_value = "ferry-bench")]
    pub run_id: String,
    /// How long to wait for the other side, in seconds.
    #[arg(allow_negative_numbers = true, long, default_value = "30", value_parser = crate::args::seconds)]
    pub connect_timeout: Duration,
    /// OBJ: the S3 endpoint, e.g. http://127.0.0.1:9000 (the backend's
    /// `endpoint_override`; default: its own default, from the environment).
    #[arg(long, value_name = "URL")]
    pub endpoint: Option<String>,
    /// OBJ: the bucket of the objects (the backend's `bucket`).
    #[arg(long)]
    pub bucket: Option<String>,
    /// POSIX: directory of the target files (default: the temp dir).
    #[arg(long, value_name = "DIR")]
    pub file_dir: Option<PathBuf>,
    /// Also write the rows as CSV. Rows go to the table, CSV and JSON lines as each
    /// case finishes; after SIGINT/SIGTERM (or a failed case) the JSON and the plot
    /// hold the rows finished before it.
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    /// Also write the rows as JSON lines (one object per row, CSV's keys).
    #[arg(long, value_name = "FILE")]
    pub jsonl: Option<PathBuf>,
    /// Also write the configuration and rows as one JSON document (at the end).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also draw GB/s and latency against block size (PNG).
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub metrics: crate::metrics::MetricsArgs,
    /// (internal) the target exits when its stdin closes: set by the initiator that
    /// spawned it.
    #[arg(long, hide = true)]
    pub watch_stdin: bool,
}

/// A backend, as a flag value.
///
/// Adding one: a variant here, its `name`, `flag` and [`Shape`] below (the shape
/// decides how `sweep::setup` builds its targets and which checks of [`plan`] apply);
/// a new shape also needs its arm in `sweep::setup`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendArg {
    /// The agent's default set (`ferry::DEFAULT_BACKENDS`), target in a second process.
    Default,
    /// In-process DRAM <-> DRAM.
    Loopback,
    /// DRAM <-> DRAM between processes.
    Ucx,
    /// Same-host DRAM <-> DRAM between processes (mapped segments or CMA).
    Shm,
    /// DRAM <-> FILE.
    Posix,
    /// DRAM or VRAM <-> FILE through cuFile (GPUDirect Storage).
    Gds,
    /// DRAM <-> OBJECT (S3 through object_store; a build with the `obj` feature).
    Obj,
}

/// Where a backend's targets live, which is what the sweep's set-up depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Target agents of this process.
    InProcess,
    /// Each worker moves bytes between its memory and a file of its own.
    OwnFile,
    /// Target agents of another process, found through a store.
    TwoProcesses,
    /// Each worker moves bytes between its memory and objects of its own.
    OwnObjects,
}

impl BackendArg {
    /// The backend's registered name (`default` for the default set).
    pub fn name(self) -> &'static str {
        match self {
            BackendArg::Default => "default",
            BackendArg::Loopback => "LOOPBACK",
            BackendArg::Ucx => "UCX",
            BackendArg::Shm => "SHM",
            BackendArg::Posix => "POSIX",
            BackendArg::Gds => "GDS",
            BackendArg::Obj => "OBJ",
        }
    }

    /// The flag value that selects it.
    pub fn flag(self) -> &'static str {
        match self {
            BackendArg::Default => "default",
            BackendArg::Loopback => "loopback",
            BackendArg::Ucx => "ucx",
            BackendArg::Shm => "shm",
            BackendArg::Posix => "posix",
            BackendArg::Gds => "gds",
            BackendArg::Obj => "obj",
        }
    }

    /// Where its targets live.
    pub fn shape(self) -> Shape {
        match self {
            BackendArg::Loopback => Shape::InProcess,
            BackendArg::Posix | BackendArg::Gds => Shape::OwnFile,
            BackendArg::Obj => Shape::OwnObjects,
            BackendArg::Default | BackendArg::Ucx | BackendArg::Shm => Shape::TwoProcesses,
        }
    }

    /// Whether the target runs in a second process (found through a store).
    pub fn two_processes(self) -> bool {
        self.shape() == Shape::TwoProcesses
    }

    /// Whether UCX is among the backends (what `--param` and the UCX flags go to).
    pub fn has_ucx(self) -> bool {
        matches!(self, BackendArg::Default | BackendArg::Ucx)
    }

    /// Whether its workers' memory may be VRAM.
    pub fn moves_vram(self) -> bool {
        self.has_ucx() || self == BackendArg::Gds
    }
}

/// A memory kind, as a flag value.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemArg {
    /// Host memory.
    Dram,
    /// GPU memory.
    Vram,
    /// A file (POSIX).
    File,
    /// Objects (OBJ).
    Object,
}

impl MemArg {
    fn kind(self) -> MemKind {
        match self {
            MemArg::Dram => MemKind::Dram,
            MemArg::Vram => MemKind::Vram,
            MemArg::File => MemKind::File,
            MemArg::Object => MemKind::Object,
        }
    }
}

/// The initiator's memory kind, as a flag value.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitiatorMem {
    /// Host memory.
    Dram,
    /// GPU memory.
    Vram,
}

/// Target-side descriptor order.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Block i goes to slot i: adjacent blocks merge into one range.
    Contiguous,
    /// Blocks go to shuffled slots: nothing merges.
    Shuffled,
}

/// How requests are made.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestMode {
    /// Lists prepared and the request made once per case, then reposted.
    Prepared,
    /// Prep, make, post and release every iteration.
    Oneshot,
}

/// Worker ↔ target mapping.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// Worker i ↔ target i.
    Pairwise,
    /// Every worker → target 0.
    ManyToOne,
    /// Worker 0 → every target.
    OneToMany,
}

/// Which side of a two-process UCX run this process is.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Spawn the target process here and be the initiator.
    Auto,
    /// Run the initiators; find the targets in the store.
    Initiator,
    /// Run the targets; publish them in the store and serve until the initiator is done.
    Target,
}

/// The validated sweep.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The arguments.
    pub args: XferArgs,
    /// Block sizes, ascending.
    pub blocks: Vec<u64>,
    /// Batch sizes, ascending.
    pub batches: Vec<u32>,
    /// Bytes of one worker's (and one target's) area.
    pub area_bytes: u64,
    /// Target memory kind.
    pub target_kind: MemKind,
}

impl Plan {
    /// Workers and targets.
    pub fn threads(&self) -> usize {
        self.args.threads as usize
    }
    /// Buffer of worker (or target) `i`: N areas for the first (it serves the
    /// many-to-one / one-to-many schemes), one for the others.
    pub fn buffer_bytes(&self, i: usize) -> u64 {
        if i == 0 {
            self.area_bytes * self.threads() as u64
        } else {
            self.area_bytes
        }
    }
}

fn steps<T>(start: T, max: T, factor: T) -> Vec<T>
where
    T: Copy + PartialOrd + std::ops::Mul<Output = T>,
{
    let mut v = vec![start];
    let mut x = start;
    while x * factor <= max && x * factor > x {
        x = x * factor;
        v.push(x);
    }
    v
}

fn dedup<T: PartialEq + Copy>(v: &[T]) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for &x in v {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

/// Check `args` and expand the sweep.
pub fn plan(args: &XferArgs) -> Result<Plan, String> {
    let mut args = args.clone();
    vram::check(&mut args)?;
    if args.backend.shape() == Shape::OwnObjects && args.target_mem == MemArg::Dram {
        // OBJ moves memory to and from objects: the default target is objects.
        args.target_mem = MemArg::Object;
    }
    if args.backend.shape() != Shape::OwnObjects
        && (args.endpoint.is_some() || args.bucket.is_some())
    {
        return Err(format!(
            "--endpoint and --bucket are OBJ's: {} has no object store",
            args.backend.name()
        ));
    }
    for (flag, key, value) in [
        ("--endpoint", "endpoint_override", &args.endpoint),
        ("--bucket", "bucket", &args.bucket),
    ] {
        if let Some(v) = value.clone() {
            if args.params.iter().any(|(k, _)| k == key) {
                return Err(format!("{flag} and --param {key}=… both given: use one"));
            }
            args.params.push((key.into(), v));
        }
    }
    match (args.backend.shape(), args.target_mem) {
        (Shape::OwnObjects, MemArg::Object) => {}
        (Shape::OwnObjects, _) => {
            return Err("OBJ moves data between memory and objects: use --target-mem object".into())
        }
        (_, MemArg::Object) => {
            return Err(format!(
                "--target-mem object needs --backend obj ({} moves no objects)",
                args.backend.name()
            ))
        }
        (Shape::OwnFile, MemArg::File) => {}
        (Shape::OwnFile, _) => {
            return Err(format!(
                "{} moves data between memory and files: use --target-mem file",
                args.backend.name()
            ))
        }
        (_, MemArg::File) => {
            return Err(format!(
                "--target-mem file needs --backend posix or gds ({} moves memory)",
                args.backend.name()
            ))
        }
        _ => {}
    }
    if args.role != Role::Auto && !args.backend.two_processes() {
        return Err(format!(
            "--role {:?} needs --backend default, ucx or shm: {} runs both sides in one process",
            args.role,
            args.backend.name()
        )
        .to_lowercase());
    }
    if args.role != Role::Auto && args.exchange.tcpstore.is_none() && args.exchange.etcd.is_none() {
        let from_env = ["FERRY_TCPSTORE_ENDPOINT", "FERRY_ETCD_ENDPOINTS"]
            .iter()
            .any(|v| std::env::var(v).is_ok_and(|s| !s.is_empty()));
        if !from_env {
            return Err("--role initiator|target needs a store where the two sides meet: --tcpstore HOST:PORT or --etcd URL".into());
        }
    }
    if let Some(ms) = args.peer_timeout_ms {
        if !args.backend.has_ucx() {
            return Err(format!(
                "--peer-timeout-ms is a UCX parameter: {} has no peer deadline",
                args.backend.name()
            ));
        }
        if args.params.iter().any(|(k, _)| k == "peer_timeout_ms") {
            return Err(
                "--peer-timeout-ms and --param peer_timeout_ms=… both given: use one".into(),
            );
        }
        args.params.push(("peer_timeout_ms".into(), ms.to_string()));
    }
    if args.start_block > args.max_block {
        return Err(format!(
            "--start-block ({}) is larger than --max-block ({})",
            human_bytes(args.start_block),
            human_bytes(args.max_block)
        ));
    }
    if args.start_batch > args.max_batch {
        return Err(format!(
            "--start-batch ({}) is larger than --max-batch ({})",
            args.start_batch, args.max_batch
        ));
    }
    args.op = dedup(&args.op);
    args.layout = dedup(&args.layout);
    args.request = dedup(&args.request);
    args.scheme = dedup(&args.scheme);
    if args.threads == 1 {
        // One worker and one target: every scheme is the same case.
        args.scheme.truncate(1);
    }
    if matches!(args.backend.shape(), Shape::OwnFile | Shape::OwnObjects)
        && args.scheme.iter().any(|&s| s != Scheme::Pairwise)
    {
        return Err(format!(
            "{} has no remote agents: each worker has its own file or objects; use --scheme pairwise",
            args.backend.name()
        ));
    }
    let blocks = steps(args.start_block, args.max_block, args.block_factor);
    let batches = steps(args.start_batch, args.max_batch, args.batch_factor);
    let largest = args
        .max_block
        .min(*blocks.last().unwrap_or(&args.start_block))
        * u64::from(*batches.last().unwrap_or(&1));
    let area_bytes = match args.buffer {
        Some(b) => b,
        None => largest.clamp(4096, 256 << 20),
    };
    if area_bytes < *blocks.last().unwrap_or(&0) {
        return Err(format!(
            "--buffer {} is smaller than the largest block ({})",
            human_bytes(area_bytes),
            human_bytes(*blocks.last().unwrap_or(&0))
        ));
    }
    let total = area_bytes
        .checked_mul(2 * u64::from(args.threads) - 1)
        .filter(|&t| t <= 64 << 30)
        .ok_or_else(|| {
            format!(
                "{} threads × --buffer {} needs more than 64 GiB per side",
                args.threads,
                human_bytes(area_bytes)
            )
        })?;
    tracing::debug!("buffers: {} per side", human_bytes(total));
    if args.check && largest > area_bytes {
        return Err(format!(
            "--check needs every request to fit the buffer without wrapping: the largest is {} but the buffer is {} (raise --buffer)",
            human_bytes(largest),
            human_bytes(area_bytes)
        ));
    }
    let target_kind = args.target_mem.kind();
    Ok(Plan {
        args,
        blocks,
        batches,
        area_bytes,
        target_kind,
    })
}

/// Run `ferry bench xfer`.
pub fn run(args: &XferArgs) -> Result<(), String> {
    let plan = plan(args)?;
    let _metrics = plan.args.metrics.start()?;
    if plan.args.role == Role::Target {
        return target::serve(&plan);
    }
    // Output paths first: a bad one is refused before the target starts.
    let mut out = report::Outputs::open(&plan)?;
    interrupt_stops_the_sweep();
    let run = match sweep::run(&plan, &mut out) {
        Ok(run) => run,
        Err(e) => {
            out.abandon();
            return Err(e);
        }
    };
    out.finish(&plan, &run)?;
    if let Some(why) = &run.stopped {
        let kept = [
            plan.args.csv.as_ref().map(|p| p.display().to_string()),
            plan.args.jsonl.as_ref().map(|p| p.display().to_string()),
            plan.args.json.as_ref().map(|p| p.display().to_string()),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>();
        return Err(format!(
            "{why}: {} of {} cases measured{}",
            run.rows.len(),
            run.cases,
            if kept.is_empty() {
                " (printed above)".to_string()
            } else {
                format!(", kept in {}", kept.join(", "))
            }
        ));
    }
    if let Some(failed) = run.rows.iter().find(|r| r.check == Some(false)) {
        return Err(format!(
            "byte check failed: {} {} block {} batch {}",
            failed.op, failed.scheme, failed.block_bytes, failed.batch
        ));
    }
    Ok(())
}

/// SIGINT or SIGTERM to the initiator ends the sweep after the rows measured so far
/// (the case in progress is abandoned); a second one exits at once, removing the run's
/// target files first.
fn interrupt_stops_the_sweep() {
    use std::sync::atomic::Ordering;
    // `ctrlc` runs this on a thread of its own, not in the signal handler: it may lock
    // and remove files.
    let installed = ctrlc::set_handler(|| {
        if sweep::STOP.swap(true, Ordering::Relaxed) {
            sweep::remove_target_files();
            std::process::exit(130);
        }
    });
    if let Err(e) = installed {
        tracing::warn!("no SIGINT/SIGTERM handler: an interrupt loses the case in progress and the outputs not yet written ({e})");
    }
}
