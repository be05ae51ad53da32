//! `cargo bench -p ferry-benches --bench shm`: same-host WRITE and READ, side by side in one run
//! (see `ferry_benches::shm`): SHM into a peer's shareable memory, SHM into a peer's
//! ordinary memory (CMA), Ferry's UCX backend (default transports,
//! `error_handling=none`) between the same two processes, and a plain copy of the same
//! ranges between the initiator's buffer and a shared mapping. Cases: 64 B × 1024, 4 KiB × 1024, 1 MiB × 1 and 1 MiB × 32,
//! WRITE and READ, remote order shuffled. Criterion times each pair; then the contenders run interleaved (bursts
//! of about 20 ms each in turn, `FERRY_BENCH_SHM_INTERLEAVE_S` seconds per case, default 4)
//! and the table of those medians is printed. `FERRY_BENCH_SHM_TARGET_CPU=N` starts the
//! target under `taskset -c N`.

use std::cell::RefCell;
use std::process::{Command, Stdio};
use std::time::Duration;

use criterion::{Criterion, Throughput};
use ferry_benches::shm::{Bench, Contender, TARGET_ENV};

fn main() {
    std::env::set_var(
        "UCX_NET_DEVICES",
        std::env::var("UCX_NET_DEVICES").unwrap_or("lo".into()),
    );
    std::env::set_var("UCX_WARN_UNUSED_ENV_VARS", "n");
    if let Ok(addr) = std::env::var(TARGET_ENV) {
        if let Err(e) = ferry_benches::shm::target_main(&addr) {
            eprintln!("bench target: {e}");
            std::process::exit(1);
        }
        return;
    }
    if let Some(reason) = ferry::Agent::available_backends()
        .iter()
        .find(|f| f.name == "UCX")
        .and_then(|f| f.available.clone().err())
    {
        eprintln!("skipping the SHM benchmark (it compares with UCX): {reason}");
        return;
    }
    let bench = Bench::start(|addr| {
        let exe = std::env::current_exe()?;
        let mut command = match std::env::var("FERRY_BENCH_SHM_TARGET_CPU") {
            Ok(cpu) => {
                let mut c = Command::new("taskset");
                c.arg("-c").arg(cpu).arg(exe);
                c
            }
            Err(_) => Command::new(exe),
        };
        command.env(TARGET_ENV, addr).stdin(Stdio::null()).spawn()
    })
    .unwrap_or_else(|e| {
        eprintln!("SHM benchmark set-up failed: {e}");
        std::process::exit(1);
    });
    let bench = RefCell::new(bench);
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .configure_from_args();
    let cases = bench.borrow().cases();
    for (ci, &(op, block, batch)) in cases.iter().enumerate() {
        let op = match op {
            ferry::Op::Write => "write",
            ferry::Op::Read => "read",
        };
        let mut group = c.benchmark_group(format!("shm/{op} {block} B x {batch}"));
        group.throughput(Throughput::Elements(batch as u64));
        for who in Contender::ALL {
            group.bench_function(who.name(), |b| {
                b.iter_custom(|iters| bench.borrow_mut().iterate(ci, who, iters))
            });
        }
        group.finish();
    }
    c.final_summary();
    let mut bench = bench.into_inner();
    let budget = std::env::var("FERRY_BENCH_SHM_INTERLEAVE_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4.0);
    bench.interleave(Duration::from_secs_f64(budget));
    println!(
        "\nMedians, contenders interleaved (bursts of about 20 ms each in turn, {budget} s per case):\n"
    );
    println!("{}", bench.table());
    bench.finish();
}
