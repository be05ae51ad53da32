//! `ferry bench`: rerunnable benchmarks that print medians.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand, ValueEnum};
use ferry::{Agent, AgentConfig, CommandBuffer, Desc, MemKind, Op, Params, Side, XferStatus};

use crate::buffers::HostBuffer;

/// `ferry bench` targets.
#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Transfer sweep (as nixlbench): block sizes × batch sizes over LOOPBACK, UCX (two
    /// processes) or POSIX; table, CSV, JSON and a plot.
    Xfer(Box<crate::xfer::XferArgs>),
    /// KV-cache workload: layers × blocks per request, paged, requests in flight, new
    /// requests per tick, from one scheduler loop; tick latency p50/p99, GB/s,
    /// descriptors/s.
    Kv(Box<crate::xfer::kv::KvArgs>),
    /// Control-path cost: ns per descriptor of make + post + check on LOOPBACK with
    /// 64-byte blocks (median of rounds).
    Control(ControlArgs),
    /// DRAM <-> FILE throughput of the POSIX backend on one pattern (median of reps).
    Posix(PosixArgs),
}

/// `ferry bench control` arguments.
#[derive(Args, Debug)]
pub struct ControlArgs {
    /// Descriptors per request.
    #[arg(allow_negative_numbers = true, long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    batch: u32,
    /// Place the remote blocks in shuffled order (nothing merges).
    #[arg(long)]
    shuffled: bool,
    /// prepared: reuse prepared lists; full: prep, make, post, check and release each turn.
    #[arg(long, value_enum, default_value_t = ControlPath::Prepared)]
    path: ControlPath,
    /// How long to measure, in seconds (at least 5 rounds run).
    #[arg(allow_negative_numbers = true, long, default_value = "2", value_parser = crate::args::seconds)]
    seconds: Duration,
    #[command(flatten)]
    pub metrics: crate::metrics::MetricsArgs,
}

/// Which control path `ferry bench control` times.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ControlPath {
    /// Prepared lists reused every turn.
    Prepared,
    /// Everything from the descriptor lists every turn.
    Full,
}

/// `ferry bench posix` arguments.
#[derive(Args, Debug)]
pub struct PosixArgs {
    /// READ (file → memory) or WRITE (memory → file).
    #[arg(long, value_enum, default_value_t = OpArg::Read)]
    op: OpArg,
    /// Open the file with O_DIRECT (bypass the page cache).
    #[arg(long)]
    direct: bool,
    /// Block size in KiB.
    #[arg(allow_negative_numbers = true, long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    block_kib: u64,
    /// Blocks per request (also the io_uring queue depth).
    #[arg(allow_negative_numbers = true, long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    batch: u32,
    /// Bytes moved per repetition, in MiB (a multiple of the block size).
    #[arg(allow_negative_numbers = true, long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    size_mib: u64,
    /// The file (created and laid out to full size when shorter).
    #[arg(long, value_name = "PATH")]
    file: Option<PathBuf>,
    /// The POSIX engine.
    #[arg(long, value_enum, default_value_t = PosixEngine::Uring)]
    engine: PosixEngine,
    /// Don't register buffers and files with io_uring (no fixed buffers or files).
    #[arg(long)]
    no_register: bool,
    /// Repetitions (the median is printed).
    #[arg(allow_negative_numbers = true, long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    reps: u32,
    /// Use plain 4 KiB pages for the memory buffer instead of transparent huge pages.
    #[arg(long)]
    no_huge_pages: bool,
    #[command(flatten)]
    pub metrics: crate::metrics::MetricsArgs,
}

/// An operation, as a flag value.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpArg {
    /// The initiator reads from the target.
    Read,
    /// The initiator writes to the target.
    Write,
}

impl OpArg {
    /// The engine's op.
    pub fn op(self) -> Op {
        match self {
            OpArg::Read => Op::Read,
            OpArg::Write => Op::Write,
        }
    }
}

/// The POSIX engine, as a flag value.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum PosixEngine {
    /// io_uring.
    Uring,
    /// A pread/pwrite worker pool.
    Threads,
}

/// Run one benchmark.
pub fn run(cmd: BenchCmd) -> Result<(), String> {
    match cmd {
        BenchCmd::Xfer(a) => crate::xfer::run(&a),
        BenchCmd::Kv(a) => crate::xfer::kv::run(&a),
        BenchCmd::Control(a) => control(&a),
        BenchCmd::Posix(a) => posix(&a),
    }
}

/// Median of the per-round nanoseconds per descriptor.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn control(args: &ControlArgs) -> Result<(), String> {
    let _metrics = args.metrics.start()?;
    let batch = args.batch as usize;
    let shuffled = args.shuffled;
    let path = match args.path {
        ControlPath::Prepared => "prepared",
        ControlPath::Full => "full",
    };
    let block = 64;
    let err = |e: ferry::Error| e.to_string();

    let src = HostBuffer::pattern(batch * block, 7);
    let dst = HostBuffer::zeroed(batch * block);
    let a = Agent::new(AgentConfig::named("bench-a")).map_err(err)?;
    let b = Agent::new(AgentConfig::named("bench-b")).map_err(err)?;
    a.create_backend("LOOPBACK", &Params::new()).map_err(err)?;
    b.create_backend("LOOPBACK", &Params::new()).map_err(err)?;
    src.register(&a).map_err(err)?;
    dst.register(&b).map_err(err)?;
    let peer = a.load_remote_md(&b.local_md().map_err(err)?).map_err(err)?;
    let local: Vec<Desc> = (0..batch).map(|i| src.desc(i * block, block)).collect();
    let mut order: Vec<usize> = (0..batch).collect();
    if shuffled {
        let mut x = 12345u64;
        for i in (1..batch).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    let remote: Vec<Desc> = order.iter().map(|&j| dst.desc(j * block, block)).collect();
    let lp = a.prep(Side::Local, MemKind::Dram, &local).map_err(err)?;
    let rp = a.prep(peer, MemKind::Dram, &remote).map_err(err)?;
    let mut cmds = CommandBuffer::with_capacity(16);
    let full = args.path == ControlPath::Full;
    // One timed turn, which must succeed: no command failed and the request is done
    // (a scan of a few outcomes; a failure ends the benchmark with an error).
    let turn = |cmds: &mut CommandBuffer| -> Result<(), String> {
        cmds.clear();
        let done = if full {
            let l = cmds.prep(Side::Local, MemKind::Dram, &local);
            let r = cmds.prep(peer, MemKind::Dram, &remote);
            let x = cmds.make(Op::Write, l, &[], r, &[]).ticket();
            cmds.post(x);
            let done = cmds.check(x);
            cmds.release(x);
            cmds.release_prep(l);
            cmds.release_prep(r);
            done
        } else {
            let x = cmds.make(Op::Write, lp, &[], rp, &[]).ticket();
            cmds.post(x);
            let done = cmds.check(x);
            cmds.release(x);
            done
        };
        a.flush(cmds);
        if let Some((i, e)) = cmds.errors().next() {
            return Err(format!("command #{i}: {e}"));
        }
        match cmds.status(done) {
            Ok(XferStatus::Done) => Ok(()),
            other => Err(format!("the timed transfer is not done: {other:?}")),
        }
    };
    for _ in 0..16 {
        turn(&mut cmds)?;
    }
    let turns_per_round = (200_000 / batch).max(1);
    let mut rounds = Vec::new();
    let deadline = Instant::now() + args.seconds;
    while Instant::now() < deadline || rounds.len() < 5 {
        let t = Instant::now();
        for _ in 0..turns_per_round {
            turn(&mut cmds)?;
        }
        rounds.push(t.elapsed().as_nanos() as f64 / (turns_per_round * batch) as f64);
    }
    // The bytes arrived where the descriptors said.
    for (i, &j) in order.iter().enumerate() {
        if src.bytes()[i * block..(i + 1) * block] != dst.bytes()[j * block..(j + 1) * block] {
            return Err(format!(
                "block {i} did not arrive at block {j} of the target"
            ));
        }
    }
    let ns = median(rounds.clone());
    println!(
        "control path, loopback, {batch} x 64 B {} descriptors, {path} path: median {ns:.1} ns/descriptor ({:.2} M descriptors/s) over {} rounds",
        if shuffled { "shuffled" } else { "contiguous" },
        1e3 / ns,
        rounds.len()
    );
    Ok(())
}

/// `ferry bench posix`: DRAM ↔ FILE throughput of the POSIX backend on one pattern
/// (`backends/posix/bench/fio-compare.sh` runs fio side by side).
fn posix(args: &PosixArgs) -> Result<(), String> {
    let _metrics = args.metrics.start()?;
    use ferry_posix::bench::{run, BenchConfig};
    let op = args.op.op();
    let block_bytes = args.block_kib << 10;
    let total_bytes = args.size_mib << 20;
    if !total_bytes.is_multiple_of(block_bytes) {
        return Err(format!(
            "--size-mib {} must be a multiple of --block-kib {} (in bytes)",
            args.size_mib, args.block_kib
        ));
    }
    let cfg = BenchConfig {
        path: args
            .file
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("ferry-posix-bench.bin")),
        total_bytes,
        block_bytes,
        batch: args.batch,
        op,
        direct: args.direct,
        engine: match args.engine {
            PosixEngine::Uring => "uring",
            PosixEngine::Threads => "threads",
        }
        .to_string(),
        register: !args.no_register,
        reps: args.reps,
        huge_pages: !args.no_huge_pages,
    };
    let r = run(&cfg).map_err(|e| e.to_string())?;
    println!(
        "posix {op} {} {} KiB blocks, batch {}, engine {}: median {:.2} GB/s over {} reps (fixed buffer: {})",
        if cfg.direct { "O_DIRECT" } else { "buffered" },
        cfg.block_bytes >> 10,
        cfg.batch,
        cfg.engine,
        r.median_gbps,
        r.gbps.len(),
        r.fixed_buffer
    );
    Ok(())
}
