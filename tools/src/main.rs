//! `ferry`: the command-line tool (`ferry --help`; every command and flag is listed in
//! `tools/README.md`).
//!
//! Arguments are parsed by clap (derive): every subcommand has `--help`, unknown or
//! malformed flags are refused with a message and exit status 2, numbers are checked
//! against their ranges before anything runs. Failures of the work itself print
//! `ferry: error: …` and exit with status 1.
//!
//! Logging: the libraries log through the `log` facade and print nothing; this binary
//! installs a `tracing` subscriber (which also receives `log` records) writing to
//! stderr. `RUST_LOG` selects what is shown (e.g. `RUST_LOG=debug` for every
//! control-plane event, `RUST_LOG=ferry_ucx=debug`, `RUST_LOG=ferry::flush=trace` for a
//! summary line per flush); without it, `-v` shows info, `-vv` debug and `-vvv` trace,
//! and warnings are always shown.
// Reason: the tool registers its own buffers, which is the caller-side promise
// `Agent::register` asks for; each block says why it holds.
#![allow(unsafe_code)]

mod args;
mod bench;
mod buffers;
mod demo;
mod md;
mod metrics;
mod progress;
mod store;
mod xfer;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Ferry: move KV-cache blocks and other bytes between memories, files and agents.
#[derive(Parser, Debug)]
#[command(name = "ferry", version, about, long_about = None, propagate_version = true)]
struct Cli {
    /// More log output on stderr: -v info, -vv debug, -vvv trace (RUST_LOG, when set,
    /// wins).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Two agents move data both ways through a backend, verify every byte, print GB/s.
    Demo(demo::DemoArgs),
    /// Benchmarks: transfer sweeps (xfer), control path, POSIX files.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// List the backend types, their parameters with defaults, and availability here.
    Backends,
    /// Summarize a metadata blob (as written by `ferry md fetch`); names what is wrong
    /// with a damaged one.
    Inspect(md::InspectArgs),
    /// Ferry's TCPStore server (c10d wire protocol) and a client for any TCPStore.
    #[command(subcommand)]
    Store(store::StoreCmd),
    /// Agent metadata through the metadata exchange.
    #[command(subcommand)]
    Md(md::MdCmd),
}

/// Install the subscriber: `RUST_LOG` when set (a directive it cannot parse is reported
/// and the `-v` level used instead), else warn / `-v` info / `-vv` debug / `-vvv`
/// trace. Colours only when stderr is a terminal (piped logs stay greppable).
fn init_logging(verbose: u8) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let level = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let mut refused = None;
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            refused = Some(format!(
                "RUST_LOG={spec:?} not understood ({e}); using {level}"
            ));
            EnvFilter::new(level)
        }),
        _ => EnvFilter::new(level),
    };
    // `try_init` also routes `log` records (the libraries' facade) into tracing, and
    // sets `log`'s max level to the filter's most verbose level, so a disabled library
    // log statement costs one relaxed atomic load.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(true)
        .try_init();
    if let Some(why) = refused {
        tracing::warn!("{why}");
    }
}

fn backends() -> Result<(), String> {
    for info in ferry::Agent::available_backends() {
        let status = match &info.available {
            Ok(()) => "available".to_string(),
            Err(why) => format!("unavailable: {why}"),
        };
        let kinds: Vec<&str> = info.mem_kinds.iter().map(|k| k.name()).collect();
        println!("{} ({}) memory: {}", info.name, status, kinds.join(", "));
        if info.available.is_ok() && info.name == "GDS" {
            // Listing only loads libcufile and looks its symbols up.
            println!(
                "  cuFile library found; its driver is opened when a GDS backend is created \
                 (bounded by driver_open_timeout_ms), never by this listing"
            );
        }
        if info.available.is_ok() {
            for (kind, why) in info
                .kinds
                .iter()
                .filter_map(|(k, r)| Some((k, r.as_ref().err()?)))
            {
                println!("  {kind} unavailable: {why}");
            }
        }
        for p in info.params {
            println!("    {} = {:<10} {}", p.name, p.default, p.doc);
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Demo(a) => demo::run(&a),
        Command::Bench(b) => bench::run(b),
        Command::Backends => backends(),
        Command::Inspect(a) => md::inspect(&a),
        Command::Store(s) => store::run(s),
        Command::Md(m) => md::run(m),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry: error: {e}");
            ExitCode::FAILURE
        }
    }
}
