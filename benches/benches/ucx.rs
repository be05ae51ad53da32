//! `cargo bench -p ferry-benches --bench ucx`: DRAM → DRAM between two processes over
//! the UCX backend (see `ferry_benches::ucx`). Variants run one after another:
//! default transports with `error_handling=none` (shared memory / CMA where UCX picks
//! them), and `transports=tcp` with `error_handling=peer`. `FERRY_BENCH_UCX_VARIANT`
//! (`shm` or `tcp`) runs one; `FERRY_BENCH_UCX_QUICK=1` trims the matrix, and
//! `FERRY_BENCH_UCX_BLOCKS` / `FERRY_BENCH_UCX_BATCHES` (comma lists) replace it;
//! `FERRY_BENCH_UCX_PARAMS` (`key=value;key=value`) adds or replaces backend parameters
//! of every variant (e.g. `shm_fifo_size=ucx;chunk_bytes=262144`);
//! `FERRY_BENCH_UCX_TARGET_CPU=1` starts the target under `taskset -c 1` (run the
//! initiator under `taskset -c 0`); `FERRY_BENCH_UCX_IDLE=0` skips the idle-CPU
//! measurement, `FERRY_BENCH_UCX_CONTROL=0` the 64 B × 1024 control-path case.
//! For a focused run (a profile): `FERRY_BENCH_UCX_OPS=write` (or `read`, or both,
//! comma separated), `FERRY_BENCH_UCX_ORDER=shuffled` (or `contiguous`) and
//! `FERRY_BENCH_UCX_CASE_MS=5000` (time per case, default 700);
//! `FERRY_BENCH_UCX_MAX_ITERS=N` also stops a case after N timed requests (default: no
//! cap; `nixl_write.py --max-iters` is the same cap on NIXL's side).
//! `FERRY_BENCH_UCX_ALLOC=ucx` allocates both sides' buffers through the UCX backend
//! (`Agent::alloc`: UCX shared-memory segments, as `ucx_perftest` allocates its
//! buffers). `FERRY_UCX_LIBRARY` names the libucp both processes load (and the only
//! one: the availability check loads it too).
//!
//! GPU memory (build with `--features cuda`): `FERRY_BENCH_UCX_MEM=vram` (both sides)
//! or `INITIATOR,TARGET` (`vram,dram`, `dram,vram`), `FERRY_BENCH_UCX_DEV=N` (device,
//! default 0); a CUDA-capable UCX through `FERRY_BENCH_UCX_PARAMS=ucx_library=PATH`.
//! Without the feature, the driver or the device it exits with the reason (status 1).
//!
//! `FERRY_BENCH_UCX_MEMCPY=1` instead times `memcpy` of each case's ranges in this
//! process (the single-copy limit the shared-memory rows are held to), no UCX.
//!
//! `FERRY_BENCH_UCX_METADATA=15000` instead measures the metadata of that many
//! UCX-registered regions (blob bytes, `local_md` and `load_remote_md` medians), with
//! `error_handling=none` and any `FERRY_BENCH_UCX_PARAMS` (e.g. `unpack_on_load=false`).

use std::process::{Command, Stdio};

use ferry_benches::ucx::{run, target_main, Alloc, Config, Placement, TARGET_ENV};

/// `FERRY_BENCH_UCX_METADATA=N`: the metadata of N UCX-registered regions of 1 MiB,
/// 2 MiB apart (`ferry_benches::ucx_md`), then exit.
fn metadata(count: &str) {
    let Ok(count) = count.parse::<usize>() else {
        eprintln!("FERRY_BENCH_UCX_METADATA: expected a region count, got {count:?}");
        std::process::exit(1);
    };
    let mut params = vec![("error_handling".to_string(), "none".to_string())];
    if let Ok(extra) = std::env::var("FERRY_BENCH_UCX_PARAMS") {
        for (k, v) in extra.split(';').filter_map(|kv| kv.split_once('=')) {
            params.push((k.to_string(), v.to_string()));
        }
    }
    match ferry_benches::ucx_md::run(
        count,
        1 << 20,
        2 << 20,
        &params,
        std::time::Duration::from_secs(2),
    ) {
        Ok(report) => println!("{report}"),
        Err(e) => {
            eprintln!("metadata benchmark: {e}");
            std::process::exit(1);
        }
    }
}

/// `FERRY_BENCH_UCX_MEMCPY=1`: instead of transfers, the single-copy limit of every case
/// of `config` (`ferry_benches::ucx::memcpy_limit`), one `MEMCPY` line each.
fn memcpy_limits(config: &Config) {
    for &block in &config.blocks {
        for &batch in &config.batches {
            for &shuffled in &config.orders {
                let order = if shuffled { "shuffled" } else { "contiguous" };
                match ferry_benches::ucx::memcpy_limit(
                    block,
                    batch,
                    shuffled,
                    config.case_time,
                    config.max_iters,
                ) {
                    Ok(median) => println!(
                        "MEMCPY block {block} B × {batch} {order} median {:.1} µs {:.2} GB/s",
                        median.as_secs_f64() * 1e6,
                        (block * batch) as f64 / median.as_secs_f64() / 1e9
                    ),
                    Err(e) => {
                        eprintln!("memcpy limit: {e}");
                        std::process::exit(1);
                    }
                }
            }
        }
    }
}

fn main() {
    std::env::set_var(
        "UCX_NET_DEVICES",
        std::env::var("UCX_NET_DEVICES").unwrap_or("lo".into()),
    );
    std::env::set_var("UCX_WARN_UNUSED_ENV_VARS", "n");
    if let Ok(spec) = std::env::var(TARGET_ENV) {
        if let Err(e) = target_main(&spec) {
            eprintln!("bench target: {e}");
            std::process::exit(1);
        }
        return;
    }
    // VRAM asked for on a machine (or build) that cannot give it: say why, up front.
    let (initiator_mem, target_mem) =
        match Placement::from_env().and_then(|(i, t)| i.check().and(t.check()).map(|()| (i, t))) {
            Ok(mem) => mem,
            Err(e) => {
                eprintln!("UCX benchmark: {e}");
                std::process::exit(1);
            }
        };
    let alloc = Alloc::from_env().unwrap_or_else(|e| {
        eprintln!("UCX benchmark: {e}");
        std::process::exit(1);
    });
    if let Some(reason) = ferry::Agent::available_backends()
        .iter()
        .find(|f| f.name == "UCX")
        .and_then(|f| f.available.clone().err())
    {
        eprintln!("skipping UCX benchmark: {reason}");
        return;
    }
    if let Ok(count) = std::env::var("FERRY_BENCH_UCX_METADATA") {
        metadata(&count);
        return;
    }
    let only = std::env::var("FERRY_BENCH_UCX_VARIANT").ok();
    let variants: [(&str, &[(&str, &str)]); 2] = [
        ("shm", &[("error_handling", "none")]),
        ("tcp", &[("transports", "tcp"), ("error_handling", "peer")]),
    ];
    for (name, params) in variants {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let mut config = Config {
            params: params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            initiator_mem,
            target_mem,
            alloc,
            ..Config::default()
        };
        if let Ok(extra) = std::env::var("FERRY_BENCH_UCX_PARAMS") {
            for (key, value) in extra
                .split(';')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            {
                config.params.retain(|(k, _)| *k != key);
                config.params.push((key, value));
            }
        }
        if std::env::var("FERRY_BENCH_UCX_IDLE").is_ok_and(|v| v == "0") {
            config.idle_cpu = false;
        }
        if std::env::var("FERRY_BENCH_UCX_CONTROL").is_ok_and(|v| v == "0") {
            config.control_path = false;
        }
        if std::env::var_os("FERRY_BENCH_UCX_QUICK").is_some() {
            config.blocks = vec![4 << 10, 1 << 20];
            config.batches = vec![32, 1024];
        }
        if let Ok(ops) = std::env::var("FERRY_BENCH_UCX_OPS") {
            config.ops = ops
                .split(',')
                .filter_map(|op| match op.trim() {
                    "write" | "WRITE" => Some(ferry::Op::Write),
                    "read" | "READ" => Some(ferry::Op::Read),
                    _ => None,
                })
                .collect();
        }
        if let Ok(order) = std::env::var("FERRY_BENCH_UCX_ORDER") {
            config.orders = order
                .split(',')
                .filter_map(|o| match o.trim() {
                    "contiguous" => Some(false),
                    "shuffled" => Some(true),
                    _ => None,
                })
                .collect();
        }
        if let Some(ms) = std::env::var("FERRY_BENCH_UCX_CASE_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
        {
            config.case_time = std::time::Duration::from_millis(ms);
        }
        // `FERRY_BENCH_UCX_MAX_ITERS=N`: stop a case after N timed requests (default: the
        // time budget alone, as NIXL's script without --max-iters).
        if let Some(max) = std::env::var("FERRY_BENCH_UCX_MAX_ITERS")
            .ok()
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n > 0)
        {
            config.max_iters = Some(max);
        }
        let list = |name: &str| -> Option<Vec<usize>> {
            let text = std::env::var(name).ok()?;
            Some(
                text.split(',')
                    .filter_map(|s| s.trim().parse().ok())
                    .collect(),
            )
        };
        if let Some(blocks) = list("FERRY_BENCH_UCX_BLOCKS") {
            config.blocks = blocks;
        }
        if let Some(batches) = list("FERRY_BENCH_UCX_BATCHES") {
            config.batches = batches;
        }
        if std::env::var("FERRY_BENCH_UCX_MEMCPY").is_ok_and(|v| v == "1") {
            memcpy_limits(&config);
            return;
        }
        println!(
            "== UCX benchmark, variant {name}: {params:?}, {initiator_mem} -> {target_mem}, {alloc}"
        );
        let report = run(
            &config,
            |spec| {
                let exe = std::env::current_exe()?;
                // Pinning the target (`taskset -c CPU`, with the initiator pinned by the
                // caller) keeps the two spinning processes off one core on a busy machine.
                let mut command = match std::env::var("FERRY_BENCH_UCX_TARGET_CPU") {
                    Ok(cpu) => {
                        let mut c = Command::new("taskset");
                        c.arg("-c").arg(cpu).arg(exe);
                        c
                    }
                    Err(_) => Command::new(exe),
                };
                command.env(TARGET_ENV, spec).stdin(Stdio::null()).spawn()
            },
            |case| println!("{case}"),
        );
        match report {
            Ok(report) => {
                if let Some(cpu) = report.idle_thread_cpu_percent {
                    println!("idle progress thread CPU: {cpu:.2}% of one core");
                }
            }
            Err(e) => {
                eprintln!("UCX benchmark variant {name} failed: {e}");
                std::process::exit(1);
            }
        }
    }
}
