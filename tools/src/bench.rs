//! `ferry bench`: rerunnable benchmarks that print medians.

use std::time::Instant;

use ferry::{Agent, AgentConfig, CommandBuffer, Desc, MemKind, Op, Params, Side, XferStatus};

use crate::buffers::HostBuffer;
use crate::opt;

pub fn run(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("control") => control(&args[1..]),
        Some("posix") => posix(&args[1..]),
        _ => Err("bench needs a target: control | posix".into()),
    }
}

/// Median of the per-round nanoseconds per descriptor.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn control(args: &[String]) -> Result<(), String> {
    let batch: usize = opt(args, "--batch")?.unwrap_or(1024);
    let seconds: f64 = opt(args, "--seconds")?.unwrap_or(2.0);
    let path: String = opt(args, "--path")?.unwrap_or_else(|| "prepared".to_string());
    let shuffled = args.iter().any(|a| a == "--shuffled");
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
    let full = match path.as_str() {
        "prepared" => false,
        "full" => true,
        other => return Err(format!("--path must be prepared or full, not {other}")),
    };
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
    let deadline = Instant::now() + std::time::Duration::from_secs_f64(seconds);
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
fn posix(args: &[String]) -> Result<(), String> {
    use ferry_posix::bench::{run, BenchConfig};
    let op = match opt::<String>(args, "--op")?.as_deref() {
        None | Some("read") => Op::Read,
        Some("write") => Op::Write,
        Some(other) => return Err(format!("--op must be read or write, not {other}")),
    };
    let cfg = BenchConfig {
        path: opt::<String>(args, "--file")?
            .map(Into::into)
            .unwrap_or_else(|| std::env::temp_dir().join("ferry-posix-bench.bin")),
        total_bytes: opt::<u64>(args, "--size-mib")?.unwrap_or(1024) << 20,
        block_bytes: opt::<u64>(args, "--block-kib")?.unwrap_or(1024) << 10,
        batch: opt(args, "--batch")?.unwrap_or(32),
        op,
        direct: args.iter().any(|a| a == "--direct"),
        engine: opt(args, "--engine")?.unwrap_or_else(|| "uring".to_string()),
        register: !args.iter().any(|a| a == "--no-register"),
        reps: opt(args, "--reps")?.unwrap_or(5),
        huge_pages: !args.iter().any(|a| a == "--no-huge-pages"),
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
