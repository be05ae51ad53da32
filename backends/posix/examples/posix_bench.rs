//! Throughput of the POSIX backend on one pattern, as a command:
//!
//! ```text
//! cargo run --release -p ferry-posix --example posix_bench -- \
//!     --file /tmp/ferry-bench.bin --size-mib 1024 --block-kib 1024 --batch 32 \
//!     --op read --direct --engine uring --reps 5
//! ```
//!
//! Prints one line: `ferry-posix <op> <buffered|direct> bs=<KiB>KiB batch=<n>
//! engine=<e> fixed_buffer=<bool> huge_pages=<bool> median_gbps=<x> reps=<a,b,c>`.

use std::process::ExitCode;

use ferry_backend_api::Op;
use ferry_posix::bench::{run, BenchConfig};

fn usage() -> ExitCode {
    eprintln!(
        "usage: posix_bench --file PATH [--size-mib N] [--block-kib N] [--batch N] \
         [--op read|write] [--direct] [--engine uring|threads|auto] [--no-register] [--no-huge-pages] [--reps N]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut cfg = BenchConfig {
        path: std::env::temp_dir().join("ferry-posix-bench.bin"),
        total_bytes: 1 << 30,
        block_bytes: 1 << 20,
        batch: 32,
        op: Op::Read,
        direct: false,
        engine: "uring".into(),
        register: true,
        reps: 5,
        huge_pages: true,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next();
        let number = |v: Option<String>| v.and_then(|s| s.parse::<u64>().ok());
        match arg.as_str() {
            "--file" => match value() {
                Some(p) => cfg.path = p.into(),
                None => return usage(),
            },
            "--size-mib" => match number(value()) {
                Some(n) => cfg.total_bytes = n << 20,
                None => return usage(),
            },
            "--block-kib" => match number(value()) {
                Some(n) => cfg.block_bytes = n << 10,
                None => return usage(),
            },
            "--batch" => match number(value()) {
                Some(n) => cfg.batch = n as u32,
                None => return usage(),
            },
            "--reps" => match number(value()) {
                Some(n) => cfg.reps = n as u32,
                None => return usage(),
            },
            "--op" => match value().as_deref() {
                Some("read") => cfg.op = Op::Read,
                Some("write") => cfg.op = Op::Write,
                _ => return usage(),
            },
            "--engine" => match value() {
                Some(e) => cfg.engine = e,
                None => return usage(),
            },
            "--direct" => cfg.direct = true,
            "--no-register" => cfg.register = false,
            "--no-huge-pages" => cfg.huge_pages = false,
            _ => return usage(),
        }
    }
    match run(&cfg) {
        Ok(r) => {
            let reps: Vec<String> = r.gbps.iter().map(|g| format!("{g:.3}")).collect();
            println!(
                "ferry-posix {} {} bs={}KiB batch={} engine={} fixed_buffer={} huge_pages={} median_gbps={:.3} reps={}",
                cfg.op,
                if cfg.direct { "direct" } else { "buffered" },
                cfg.block_bytes >> 10,
                cfg.batch,
                cfg.engine,
                r.fixed_buffer,
                cfg.huge_pages,
                r.median_gbps,
                reps.join(",")
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("posix_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
