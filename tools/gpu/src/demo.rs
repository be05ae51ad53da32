//! The demo in GPU memory: two agents in this process, each with a UCX backend, move
//! `mib` MiB of VRAM both ways in 1 MiB blocks to shuffled places, verify every byte
//! (through host copies) and print throughput. What `ferry demo --vram` runs.

use ferry::{CommandBuffer, Desc, MemKind, Op, Side};
use ferry_cuda::{Device, DeviceBuffer};

use crate::{gbps, pattern, run_once, shuffled, GpuSetup};

/// What the demo measured.
#[derive(Clone, Copy, Debug)]
pub struct DemoReport {
    /// VRAM → VRAM write, GB/s (second pass).
    pub write_gbps: f64,
    /// VRAM ← VRAM read, GB/s (second pass).
    pub read_gbps: f64,
}

const BLOCK: usize = 1 << 20;

/// Run the demo on `setup.dev` with `mib` MiB. Errors name what is missing (no driver,
/// no device, a UCX without CUDA …).
pub fn run(setup: &GpuSetup, mib: usize) -> Result<DemoReport, String> {
    if mib == 0 {
        return Err("--mib must be positive".into());
    }
    let dev = Device::open(setup.dev).map_err(|e| e.to_string())?;
    let total = mib * BLOCK;
    let blocks = mib;
    let err = |e: ferry::Error| e.to_string();
    let cuda = |e: ferry_cuda::CudaError| e.to_string();

    // Buffers first: they outlive the agents (dropped after them).
    let source = DeviceBuffer::alloc(&dev, total).map_err(cuda)?;
    let target = DeviceBuffer::alloc(&dev, total).map_err(cuda)?;
    let back = DeviceBuffer::alloc(&dev, total).map_err(cuda)?;
    let bytes = pattern(total, 0x5eed);
    source.write(&bytes).map_err(cuda)?;
    target.write(&vec![0u8; total]).map_err(cuda)?;

    let prefill = setup.ucx_agent("vram-demo-prefill")?;
    let decode = setup.ucx_agent("vram-demo-decode")?;
    let vram = |b: &DeviceBuffer| Desc::new(b.addr(), b.len() as u64, setup.dev);
    // SAFETY: the buffers are declared before the agents, so they outlive them; the
    // demo reads them only after the transfers touching them completed.
    unsafe {
        prefill
            .register(MemKind::Vram, vram(&source))
            .map_err(err)?;
        prefill.register(MemKind::Vram, vram(&back)).map_err(err)?;
        decode.register(MemKind::Vram, vram(&target)).map_err(err)?;
    }
    let peer = prefill
        .load_remote_md(&decode.local_md().map_err(err)?)
        .map_err(err)?;

    let order = shuffled(blocks, 0x9e37_79b9);
    let at = |b: &DeviceBuffer, i: usize| {
        Desc::new(b.addr() + (i * BLOCK) as u64, BLOCK as u64, setup.dev)
    };
    let local: Vec<Desc> = (0..blocks).map(|i| at(&source, i)).collect();
    let local_back: Vec<Desc> = (0..blocks).map(|i| at(&back, i)).collect();
    let remote: Vec<Desc> = order.iter().map(|&j| at(&target, j)).collect();

    let mut cmds = CommandBuffer::with_capacity(8);
    let l = cmds.prep(Side::Local, MemKind::Vram, &local);
    let lb = cmds.prep(Side::Local, MemKind::Vram, &local_back);
    let r = cmds.prep(peer, MemKind::Vram, &remote);
    let write = cmds.make(Op::Write, l, &[], r, &[]).ticket();
    let read = cmds.make(Op::Read, lb, &[], r, &[]).ticket();
    prefill.flush(&mut cmds);
    if let Some((i, e)) = cmds.errors().next() {
        return Err(format!("set-up command #{i}: {e}"));
    }
    let write = cmds.created(write).map_err(err)?;
    let read = cmds.created(read).map_err(err)?;

    run_once(&prefill, write)?;
    let write_gbps = gbps(total, run_once(&prefill, write)?);
    let mut landed = vec![0u8; total];
    target.read(&mut landed).map_err(cuda)?;
    for (i, &j) in order.iter().enumerate() {
        if landed[j * BLOCK..][..BLOCK] != bytes[i * BLOCK..][..BLOCK] {
            return Err(format!("VRAM WRITE verification failed at block {i}"));
        }
    }
    run_once(&prefill, read)?;
    let read_gbps = gbps(total, run_once(&prefill, read)?);
    let mut returned = vec![0u8; total];
    back.read(&mut returned).map_err(cuda)?;
    if returned != bytes {
        return Err("VRAM READ verification failed".into());
    }
    println!(
        "VRAM demo on device {} ({}): {mib} MiB in {blocks} blocks of 1 MiB, WRITE {write_gbps:.2} GB/s, \
         READ {read_gbps:.2} GB/s; verified both ways byte for byte",
        setup.dev,
        dev.name()
    );
    Ok(DemoReport {
        write_gbps,
        read_gbps,
    })
}
