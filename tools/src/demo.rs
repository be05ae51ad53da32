//! `ferry demo`: two agents in this process move a few hundred MiB both ways through the
//! embedded loopback backend, verify every byte and print throughput.

use std::time::Instant;

use ferry::{Agent, AgentConfig, CommandBuffer, Desc, MemKind, Op, Params, Side, XferStatus};

use clap::Args;

use crate::buffers::HostBuffer;

/// `ferry demo` arguments.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// MiB moved each way.
    #[arg(allow_negative_numbers = true, long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub mib: u32,
    /// Block size in KiB (the data moves as blocks placed in shuffled order).
    #[arg(allow_negative_numbers = true, long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=1048576))]
    pub block_kib: u32,
    /// Move GPU memory (VRAM) instead of host memory, through UCX.
    #[arg(long)]
    pub vram: bool,
    /// CUDA device of the VRAM buffers (with --vram).
    #[arg(allow_negative_numbers = true, long, requires = "vram", value_parser = clap::value_parser!(u32).range(0..=1023))]
    pub dev: Option<u32>,
    /// The libucp to load for the VRAM demo (a CUDA-capable UCX; with --vram).
    #[arg(long, requires = "vram", value_name = "PATH")]
    pub ucx_library: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub metrics: crate::metrics::MetricsArgs,
}

/// Run the demo `args` ask for.
pub fn run(args: &DemoArgs) -> Result<(), String> {
    let _metrics = args.metrics.start()?;
    if args.vram {
        return vram(args);
    }
    dram(args.mib as usize, args.block_kib as usize)
}

/// The demo in GPU memory: VRAM → VRAM both ways through UCX (`ferry_gpu::demo`).
#[cfg(feature = "cuda")]
fn vram(args: &DemoArgs) -> Result<(), String> {
    let setup = ferry_gpu::GpuSetup {
        dev: u64::from(args.dev.unwrap_or(0)),
        ucx_library: args.ucx_library.clone(),
    };
    let report = ferry_gpu::demo::run(&setup, args.mib as usize)?;
    println!(
        "VRAM demo on device {}: {} MiB each way, write {:.2} GB/s, read {:.2} GB/s, every byte checked",
        setup.dev, args.mib, report.write_gbps, report.read_gbps
    );
    Ok(())
}

/// Without the `cuda` feature there is no GPU code in this binary.
#[cfg(not(feature = "cuda"))]
fn vram(_args: &DemoArgs) -> Result<(), String> {
    Err(
        "VRAM demo needs a GPU backend: this ferry was built without the `cuda` feature \
         (cargo build -p ferry-tools --features cuda)"
            .into(),
    )
}

/// The host-memory demo: `mib` MiB each way in blocks of `block_kib` KiB.
fn dram(mib: usize, block_kib: usize) -> Result<(), String> {
    let total = mib << 20;
    let block = block_kib << 10;
    if !total.is_multiple_of(block) {
        return Err(format!(
            "--mib {mib} must be a multiple of --block-kib {block_kib} (in bytes)"
        ));
    }
    let blocks = total / block;
    let err = |e: ferry::Error| e.to_string();

    let source = HostBuffer::pattern(total, 0x5eed);
    let target = HostBuffer::zeroed(total);
    let back = HostBuffer::zeroed(total);
    let prefill = Agent::new(AgentConfig::named("demo-prefill")).map_err(err)?;
    let decode = Agent::new(AgentConfig::named("demo-decode")).map_err(err)?;
    prefill
        .create_backend("LOOPBACK", &Params::new())
        .map_err(err)?;
    decode
        .create_backend("LOOPBACK", &Params::new())
        .map_err(err)?;
    source.register(&prefill).map_err(err)?;
    back.register(&prefill).map_err(err)?;
    target.register(&decode).map_err(err)?;

    // Side-channel metadata exchange.
    let decode_md = decode.local_md().map_err(err)?;
    tracing::debug!(
        "demo: '{}' hands its metadata ({} bytes) to '{}' through a side channel",
        decode.name(),
        decode_md.len(),
        prefill.name()
    );
    let peer = prefill.load_remote_md(&decode_md).map_err(err)?;
    println!(
        "metadata: {} bytes from '{}' loaded by '{}'",
        decode_md.len(),
        decode.name(),
        prefill.name()
    );

    // Blocks go to a shuffled place on the other side (like KV blocks in a pool).
    let mut order: Vec<usize> = (0..blocks).collect();
    let mut x = 0x9e37_79b9_u64;
    for i in (1..blocks).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let local: Vec<Desc> = (0..blocks).map(|i| source.desc(i * block, block)).collect();
    let back_descs: Vec<Desc> = (0..blocks).map(|i| back.desc(i * block, block)).collect();
    let remote: Vec<Desc> = order
        .iter()
        .map(|&j| target.desc(j * block, block))
        .collect();

    let mut cmds = CommandBuffer::with_capacity(16);
    let l = cmds.prep(Side::Local, MemKind::Dram, &local);
    let lb = cmds.prep(Side::Local, MemKind::Dram, &back_descs);
    let r = cmds.prep(peer, MemKind::Dram, &remote);
    let write = cmds
        .make(Op::Write, l, &[], r, &[])
        .notify(b"kv blocks written")
        .ticket();
    let read = cmds.make(Op::Read, lb, &[], r, &[]).ticket();
    prefill.flush(&mut cmds);
    if let Some((i, e)) = cmds.errors().next() {
        return Err(format!("set-up command #{i}: {e}"));
    }
    let write = cmds.created(write).map_err(err)?;
    let read = cmds.created(read).map_err(err)?;

    let run = |xfer, what: &str| -> Result<f64, String> {
        // One warm-up pass, then the measured one.
        let mut status = prefill.post(xfer).map_err(err)?;
        while status == XferStatus::InProgress {
            status = prefill.check(xfer).map_err(err)?;
        }
        let start = Instant::now();
        let mut status = prefill.post(xfer).map_err(err)?;
        while status == XferStatus::InProgress {
            status = prefill.check(xfer).map_err(err)?;
        }
        let secs = start.elapsed().as_secs_f64();
        let t = prefill.telemetry(xfer).map_err(err)?;
        let gbps = total as f64 / secs / 1e9;
        println!(
            "{what:5} {mib} MiB in {blocks} blocks of {block_kib} KiB ({} ranges after merging): {:.3} s, {gbps:.2} GB/s",
            t.desc_count, secs
        );
        Ok(gbps)
    };
    run(write, "WRITE")?;
    let notes = decode.drain_notifications();
    if notes.len() != 2 || notes[0].1 != b"kv blocks written" {
        return Err(format!(
            "expected two notifications (one per pass) at '{}', got {notes:?}",
            decode.name()
        ));
    }
    for (i, &j) in order.iter().enumerate() {
        if target.bytes()[j * block..(j + 1) * block] != source.bytes()[i * block..(i + 1) * block]
        {
            return Err(format!("WRITE verification failed at block {i}"));
        }
    }
    run(read, "READ")?;
    if back.bytes() != source.bytes() {
        return Err("READ verification failed".into());
    }
    println!(
        "verified {} MiB both ways byte for byte; notification delivered after the data",
        mib
    );
    Ok(())
}
