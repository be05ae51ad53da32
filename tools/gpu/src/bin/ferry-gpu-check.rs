//! `ferry-gpu-check`: the GPU checks `tools/gpu-check.sh run` drives on a GPU machine.
//!
//! ```text
//! ferry-gpu-check all [--dev N] [--ucx-library PATH] [--cufile-library PATH]
//!                     [--dir DIR] [--iters N] [--only ipc,dram,vmm,gds,demo]
//!                                                  every measurement + PASS/FAIL summary
//! ferry-gpu-check demo [--dev N] [--ucx-library PATH] [--mib N]
//! ferry-gpu-check driver                           the CUDA driver's version (13000 =
//!                                                  CUDA 13.0) and device count, or why none
//! ferry-gpu-check ipc-target --dir DIR [--dev N] [--ucx-library PATH]   (child role)
//! ferry-gpu-check ipc-reference --dir DIR [--dev N] [--iters N]         (child role)
//! ```
//! Exit status 0 only when every check passed.

use std::path::PathBuf;
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use ferry_gpu::check::{self, GdsSetup, Row};
use ferry_gpu::GpuSetup;

fn opt(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn setup(args: &[String]) -> Result<GpuSetup, String> {
    let dev = match opt(args, "--dev") {
        Some(v) => v
            .parse()
            .map_err(|_| format!("--dev: cannot parse '{v}'"))?,
        None => 0,
    };
    Ok(GpuSetup {
        dev,
        ucx_library: opt(args, "--ucx-library").map(PathBuf::from),
    })
}

/// The acceptance bar: Ferry's VRAM → VRAM write between processes at 1 MiB × 32
/// reaches this share of a plain device-to-device copy of the same buffers.
const RATIO_MIN: f64 = 0.8;

fn print_rows(rows: &[Row], failures: &mut Vec<String>) {
    for row in rows {
        let plain = match row.plain {
            Some((what, g)) => format!(
                "{what} {g:7.2} GB/s ({:3.0}%)",
                100.0 * row.ferry_gbps / g.max(1e-9)
            ),
            None => "no plain reference".into(),
        };
        let verdict = if row.verified { "PASS" } else { "FAIL" };
        println!(
            "{verdict}  {:<38} {:<14} ferry {:7.2} GB/s   {plain}{}",
            row.what,
            row.shape.to_string(),
            row.ferry_gbps,
            if row.note.is_empty() {
                String::new()
            } else {
                format!("   [{}]", row.note)
            }
        );
        if !row.verified {
            failures.push(format!("{} {}: bytes differ", row.what, row.shape));
        }
    }
}

fn all(args: &[String]) -> Result<bool, String> {
    let setup = setup(args)?;
    let iters: usize = opt(args, "--iters")
        .map(|v| {
            v.parse()
                .map_err(|_| format!("--iters: cannot parse '{v}'"))
        })
        .transpose()?
        .unwrap_or(10);
    let base = opt(args, "--dir")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("ferry-gpu-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let gds = GdsSetup {
        cufile_library: opt(args, "--cufile-library").map(PathBuf::from),
        dir: dir.clone(),
    };
    let mut failures = Vec::new();
    let started = Instant::now();

    let only = opt(args, "--only");
    let wanted = |part: &str| {
        only.as_deref()
            .is_none_or(|list| list.split(',').any(|p| p.trim() == part))
    };

    if wanted("ipc") {
        println!("== VRAM -> VRAM between two processes (UCX, cuda_ipc expected)");
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let child = |role: &str| {
            let mut cmd = Command::new(&exe);
            cmd.arg(role)
                .arg("--dir")
                .arg(&dir)
                .arg("--dev")
                .arg(setup.dev.to_string())
                .arg("--iters")
                .arg(iters.to_string());
            if let Some(lib) = &setup.ucx_library {
                cmd.arg("--ucx-library").arg(lib);
            }
            cmd.spawn()
                .map_err(|e| format!("cannot start the {role} process: {e}"))
        };
        let mut target = child("ipc-target")?;
        let mut ipc = check::ipc_initiator(&setup, &dir, iters);
        // The plain copy in a third process: the only other mapping of the target's
        // buffer, in a context of its own (never beside UCX's in this process).
        if let Ok(rows) = &mut ipc {
            match child("ipc-reference")
                .and_then(|c| wait_child(c, Duration::from_secs(90), "reference"))
            {
                Ok(()) => {
                    if let Err(e) = check::apply_reference(&dir, rows) {
                        failures.push(e);
                    }
                }
                Err(e) => failures.push(e),
            }
        }
        let _ = std::fs::write(dir.join("done"), b"");
        if let Err(e) = wait_child_ref(&mut target, Duration::from_secs(30), "target") {
            failures.push(e);
        }
        match ipc {
            Ok(rows) => {
                print_rows(&rows, &mut failures);
                if let Some(row) = rows
                    .iter()
                    .find(|r| r.what.starts_with("VRAM->VRAM write") && r.shape == check::SHAPES[0])
                {
                    let plain = row.plain.map(|p| p.1).unwrap_or(0.0);
                    let ratio = row.ferry_gbps / plain.max(1e-9);
                    let verdict = if ratio >= RATIO_MIN { "PASS" } else { "FAIL" };
                    println!(
                        "{verdict}  VRAM->VRAM 1 MiB x 32 between processes: ferry {:.2} GB/s = {:.0}% of cuMemcpyDtoDAsync {:.2} GB/s (bar {:.0}%)",
                        row.ferry_gbps,
                        100.0 * ratio,
                        plain,
                        100.0 * RATIO_MIN
                    );
                    if ratio < RATIO_MIN {
                        failures.push(format!(
                            "VRAM->VRAM 1 MiB x 32 at {:.0}% of a plain copy",
                            100.0 * ratio
                        ));
                    }
                }
            }
            Err(e) => {
                println!("FAIL  VRAM->VRAM between processes: {e}");
                failures.push(format!("VRAM->VRAM between processes: {e}"));
            }
        }
    }

    if wanted("dram") {
        println!("== VRAM <-> DRAM (UCX, two agents in one process)");
        match check::vram_dram(&setup, iters) {
            Ok(rows) => print_rows(&rows, &mut failures),
            Err(e) => {
                println!("FAIL  VRAM<->DRAM: {e}");
                failures.push(format!("VRAM<->DRAM: {e}"));
            }
        }
    }

    if wanted("vmm") {
        println!("== VMM memory (cuMemCreate + cuMemMap, as PyTorch's expandable segments)");
        match check::vmm(&setup, iters) {
            Ok(rows) => print_rows(&rows, &mut failures),
            Err(e) => {
                println!("FAIL  VMM: {e}");
                failures.push(format!("VMM: {e}"));
            }
        }
    }

    for engine in ["threads", "batch"].into_iter().filter(|_| wanted("gds")) {
        println!("== FILE <-> VRAM (GDS, engine {engine})");
        match check::gds(&setup, &gds, engine, iters) {
            Ok(rows) => print_rows(&rows, &mut failures),
            Err(e) => {
                println!("FAIL  GDS {engine}: {e}");
                failures.push(format!("GDS {engine}: {e}"));
            }
        }
    }

    if wanted("demo") {
        println!("== VRAM demo (ferry_gpu::demo::run, 256 MiB)");
        if let Err(e) = ferry_gpu::demo::run(&setup, 256) {
            println!("FAIL  VRAM demo: {e}");
            failures.push(format!("VRAM demo: {e}"));
        }
    }

    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "== summary: {} ({:.0} s; medians of {iters} passes after one warm-up; device {}, UCX {})",
        if failures.is_empty() { "PASS" } else { "FAIL" },
        started.elapsed().as_secs_f64(),
        setup.dev,
        setup
            .ucx_library
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "libucp.so.0".into())
    );
    for f in &failures {
        println!("   FAIL: {f}");
    }
    Ok(failures.is_empty())
}

/// Wait (bounded) for a child role to end; killed past `limit`.
fn wait_child(mut child: Child, limit: Duration, role: &str) -> Result<(), String> {
    wait_child_ref(&mut child, limit, role)
}

fn wait_child_ref(child: &mut Child, limit: Duration, role: &str) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("the {role} process failed ({status})")),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("the {role} process did not end within {limit:?}"));
            }
        }
    }
}

/// `driver`: the CUDA version the driver supports and its devices, or why none.
fn driver() -> Result<bool, String> {
    let version = ferry_cuda::driver_version().map_err(|e| e.to_string())?;
    let count = ferry_cuda::device_count().map_err(|e| e.to_string())?;
    println!(
        "{version} (CUDA {}.{}), {count} device(s)",
        version / 1000,
        (version % 1000) / 10
    );
    Ok(count > 0)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("all") => all(&args[1..]),
        Some("demo") => setup(&args[1..]).and_then(|s| {
            let mib = opt(&args[1..], "--mib")
                .map(|v| v.parse().map_err(|_| format!("--mib: cannot parse '{v}'")))
                .transpose()?
                .unwrap_or(256);
            ferry_gpu::demo::run(&s, mib).map(|_| true)
        }),
        Some("driver") => driver(),
        Some("ipc-reference") => setup(&args[1..]).and_then(|s| {
            let dir = opt(&args[1..], "--dir").ok_or("ipc-reference needs --dir")?;
            let iters = opt(&args[1..], "--iters")
                .map(|v| {
                    v.parse()
                        .map_err(|_| format!("--iters: cannot parse '{v}'"))
                })
                .transpose()?
                .unwrap_or(10);
            check::ipc_reference(&s, std::path::Path::new(&dir), iters).map(|()| true)
        }),
        Some("ipc-target") => setup(&args[1..]).and_then(|s| {
            let dir = opt(&args[1..], "--dir").ok_or("ipc-target needs --dir")?;
            check::ipc_target(&s, std::path::Path::new(&dir)).map(|()| true)
        }),
        _ => {
            eprintln!("usage: ferry-gpu-check all|demo|driver|ipc-target|ipc-reference [--dev N] [--ucx-library PATH] [--cufile-library PATH] [--dir DIR] [--iters N] [--mib N] [--only ipc,dram,vmm,gds,demo]");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("ferry-gpu-check: {e}");
            ExitCode::FAILURE
        }
    }
}
