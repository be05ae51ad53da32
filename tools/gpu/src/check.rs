//! The measurements of `tools/gpu-check.sh`. Each one moves blocks to shuffled places
//! (so the engine cannot merge them into one range) at the two shapes of [`SHAPES`],
//! verifies every byte, and times the same movement with a plain CUDA copy between the
//! same buffers. Times are medians of `iters` passes after one warm-up pass.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferry::{Agent, AgentConfig, CommandBuffer, Desc, FileMode, MemKind, Op, Params, Side, XferId};
use ferry_cuda::{Device, DeviceBuffer, IpcBuffer, VmmBuffer};

use crate::{gbps, median, pattern, run_once, shuffled, GpuSetup};

/// Blocks of one measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Bytes per block.
    pub block: usize,
    /// Blocks.
    pub count: usize,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.block >= 1 << 20 {
            write!(f, "{} MiB x {}", self.block >> 20, self.count)
        } else {
            write!(f, "{} KiB x {}", self.block >> 10, self.count)
        }
    }
}

/// The shapes every measurement runs: 1 MiB × 32 and 64 KiB × 1024.
pub const SHAPES: [Shape; 2] = [
    Shape {
        block: 1 << 20,
        count: 32,
    },
    Shape {
        block: 64 << 10,
        count: 1024,
    },
];

/// Bytes of every buffer (the larger shape: 64 MiB).
pub const BUFFER_BYTES: usize = 64 << 20;

/// One line of the summary.
#[derive(Clone, Debug)]
pub struct Row {
    /// What moved, and how.
    pub what: String,
    /// The blocks.
    pub shape: Shape,
    /// Ferry's median GB/s.
    pub ferry_gbps: f64,
    /// The plain copy's median GB/s and what it was, if there is one.
    pub plain: Option<(&'static str, f64)>,
    /// Every byte checked and right.
    pub verified: bool,
    /// A note (mode, engine).
    pub note: String,
}

fn cuda(e: ferry_cuda::CudaError) -> String {
    e.to_string()
}

fn ferry_err(e: ferry::Error) -> String {
    e.to_string()
}

fn time_median(
    iters: usize,
    mut once: impl FnMut() -> Result<Duration, String>,
) -> Result<Duration, String> {
    once()?;
    let mut samples = Vec::with_capacity(iters.max(1));
    for _ in 0..iters.max(1) {
        samples.push(once()?);
    }
    Ok(median(&mut samples))
}

/// Wait for `path`; a `target.err` next to it (the target's failure) ends the wait.
fn wait_for_file(path: &Path, timeout: Duration) -> Result<Vec<u8>, String> {
    let deadline = Instant::now() + timeout;
    let err = path.with_file_name("target.err");
    loop {
        if let Ok(bytes) = std::fs::read(path) {
            return Ok(bytes);
        }
        if let Ok(why) = std::fs::read_to_string(&err) {
            return Err(format!("the target process failed: {why}"));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} did not appear within {timeout:?}",
                path.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn publish(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The target process of the two-process measurement: a VRAM buffer registered with
/// UCX, its metadata, address and CUDA IPC handle published in `dir`; it progresses
/// until `dir/done` appears (or 7 minutes pass). Asked with `dir/dump-N.req`, it copies
/// its buffer to the host and publishes it as `dir/dump-N` (how the initiator checks
/// where its WRITE landed without mapping the buffer itself).
pub fn ipc_target(setup: &GpuSetup, dir: &Path) -> Result<(), String> {
    let result = ipc_target_inner(setup, dir);
    if let Err(why) = &result {
        let _ = publish(&dir.join("target.err"), why.as_bytes());
    }
    result
}

fn ipc_target_inner(setup: &GpuSetup, dir: &Path) -> Result<(), String> {
    let dev = Device::open(setup.dev).map_err(cuda)?;
    let buf = DeviceBuffer::alloc(&dev, BUFFER_BYTES).map_err(cuda)?;
    buf.write(&vec![0u8; BUFFER_BYTES]).map_err(cuda)?;
    let agent = setup.ucx_agent("gpu-check-target")?;
    // SAFETY: `buf` is declared before the agent and outlives it.
    unsafe {
        agent.register(
            MemKind::Vram,
            Desc::new(buf.addr(), BUFFER_BYTES as u64, setup.dev),
        )
    }
    .map_err(ferry_err)?;
    publish(&dir.join("target.addr"), &buf.addr().to_le_bytes())?;
    publish(&dir.join("target.ipc"), &buf.ipc_handle().map_err(cuda)?)?;
    publish(
        &dir.join("target.md"),
        &agent.local_md().map_err(ferry_err)?,
    )?;
    let deadline = Instant::now() + Duration::from_secs(420);
    let mut host = vec![0u8; BUFFER_BYTES];
    let mut served = 0u32;
    while !dir.join("done").exists() {
        if Instant::now() > deadline {
            return Err("the initiator did not finish within 7 minutes".into());
        }
        if dir.join(format!("dump-{served}.req")).exists() {
            buf.read(&mut host).map_err(cuda)?;
            publish(&dir.join(format!("dump-{served}")), &host)?;
            served += 1;
        }
        agent.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(agent);
    drop(buf);
    Ok(())
}

/// The target's buffer as it is now (request `n` of [`ipc_target`]'s dumps).
fn target_dump(dir: &Path, n: u32) -> Result<Vec<u8>, String> {
    publish(&dir.join(format!("dump-{n}.req")), b"")?;
    let bytes = wait_for_file(&dir.join(format!("dump-{n}")), Duration::from_secs(30))?;
    let _ = std::fs::remove_file(dir.join(format!("dump-{n}")));
    Ok(bytes)
}

/// The plain-copy reference of the two-process measurement, in a process of its own:
/// it opens the target's buffer through its CUDA IPC handle — the one mapping of that
/// allocation in this process's context; the initiator never opens it, so UCX's
/// `cuda_ipc` there is the only mapping in the initiator's context (CUDA refuses a second
/// mapping of one allocation per context, openucx/ucx#3192) — and times
/// `cuMemcpyDtoDAsync` of the same blocks in the same order between buffers of its own
/// and the target's. Writes `dir/reference`: one line per shape, `index write_s read_s`.
pub fn ipc_reference(setup: &GpuSetup, dir: &Path, iters: usize) -> Result<(), String> {
    let handle: [u8; 64] = wait_for_file(&dir.join("target.ipc"), Duration::from_secs(60))?
        .try_into()
        .map_err(|_| "target.ipc is not 64 bytes".to_string())?;
    let dev = Device::open(setup.dev).map_err(cuda)?;
    let src = DeviceBuffer::alloc(&dev, BUFFER_BYTES).map_err(cuda)?;
    let back = DeviceBuffer::alloc(&dev, BUFFER_BYTES).map_err(cuda)?;
    let target = IpcBuffer::open(&dev, &handle, BUFFER_BYTES).map_err(cuda)?;
    let mut out = String::new();
    for (k, shape) in SHAPES.into_iter().enumerate() {
        let order = shuffled(shape.count, 7 + k as u64);
        let to_target = block_moves(&order, shape, src.addr(), target.addr());
        let from_target: Vec<(u64, u64, usize)> =
            block_moves(&order, shape, back.addr(), target.addr())
                .into_iter()
                .map(|(t, s, n)| (s, t, n))
                .collect();
        let w = time_dtod(&dev, &to_target, iters)?;
        let r = time_dtod(&dev, &from_target, iters)?;
        out.push_str(&format!("{k} {} {}\n", w.as_secs_f64(), r.as_secs_f64()));
    }
    drop(target);
    publish(&dir.join("reference"), out.as_bytes())
}

/// Median time of `cuMemcpyDtoDAsync` of every `(dst, src, len)` of `ranges` (the
/// plain copy Ferry's rows are compared with). Every range must lie in live device
/// memory of this process (its buffers or an IPC mapping), source and destination apart.
fn time_dtod(dev: &Device, ranges: &[(u64, u64, usize)], iters: usize) -> Result<Duration, String> {
    time_median(iters, || {
        let start = Instant::now();
        // SAFETY: the callers pass ranges in their live buffers or IPC mappings, with
        // source and destination in different buffers (above).
        unsafe { ferry_cuda::copy_dtod_ranges(dev, ranges) }.map_err(cuda)?;
        Ok(start.elapsed())
    })
}

/// `(target block, local block, bytes)` of local block i ↔ target block order[i].
fn block_moves(
    order: &[usize],
    shape: Shape,
    local_base: u64,
    target_base: u64,
) -> Vec<(u64, u64, usize)> {
    order
        .iter()
        .enumerate()
        .map(|(i, &j)| {
            (
                target_base + (j * shape.block) as u64,
                local_base + (i * shape.block) as u64,
                shape.block,
            )
        })
        .collect()
}

/// Read `dir/reference` ([`ipc_reference`]) into `rows` (the rows of [`ipc_initiator`]).
pub fn apply_reference(dir: &Path, rows: &mut [Row]) -> Result<(), String> {
    let text = std::fs::read_to_string(dir.join("reference"))
        .map_err(|e| format!("the reference process left no figures: {e}"))?;
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        let (Some(k), Some(w), Some(r)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!("reference: cannot read '{line}'"));
        };
        let k: usize = k.parse().map_err(|_| format!("reference: '{line}'"))?;
        let shape = *SHAPES
            .get(k)
            .ok_or_else(|| format!("reference: shape {k}?"))?;
        let secs = |v: &str| -> Result<Duration, String> {
            v.parse::<f64>()
                .map(Duration::from_secs_f64)
                .map_err(|_| format!("reference: '{line}'"))
        };
        let total = shape.block * shape.count;
        for row in rows.iter_mut().filter(|row| row.shape == shape) {
            let t = if row.what.contains("write") {
                secs(w)?
            } else {
                secs(r)?
            };
            row.plain = Some(("cuMemcpyDtoDAsync (other process)", gbps(total, t)));
        }
    }
    Ok(())
}

/// Local and remote descriptor lists of `shape`: local block i ↔ remote block order[i].
fn lists(
    local_base: u64,
    remote_base: u64,
    shape: Shape,
    order: &[usize],
    dev: u64,
) -> (Vec<Desc>, Vec<Desc>) {
    let b = shape.block as u64;
    let local = (0..shape.count)
        .map(|i| Desc::new(local_base + i as u64 * b, b, dev))
        .collect();
    let remote = order
        .iter()
        .map(|&j| Desc::new(remote_base + j as u64 * b, b, dev))
        .collect();
    (local, remote)
}

/// Two requests (write from `src`, read into `back`) of `shape` to `remote` descriptors.
fn make_pair(
    agent: &Agent,
    kind: MemKind,
    src: &[Desc],
    back: &[Desc],
    remote_side: Side,
    remote_kind: MemKind,
    remote: &[Desc],
) -> Result<(XferId, XferId), String> {
    let mut cmds = CommandBuffer::with_capacity(8);
    let l = cmds.prep(Side::Local, kind, src);
    let lb = cmds.prep(Side::Local, kind, back);
    let r = cmds.prep(remote_side, remote_kind, remote);
    let write = cmds.make(Op::Write, l, &[], r, &[]).ticket();
    let read = cmds.make(Op::Read, lb, &[], r, &[]).ticket();
    agent.flush(&mut cmds);
    if let Some((i, e)) = cmds.errors().next() {
        return Err(format!("set-up command #{i}: {e}"));
    }
    Ok((
        cmds.created(write).map_err(ferry_err)?,
        cmds.created(read).map_err(ferry_err)?,
    ))
}

/// Whether block i of `src` sits at block order[i] of `dst`, for every i < count.
fn placed(src: &[u8], dst: &[u8], shape: Shape, order: &[usize]) -> bool {
    order.iter().enumerate().all(|(i, &j)| {
        dst[j * shape.block..][..shape.block] == src[i * shape.block..][..shape.block]
    })
}

fn prefix_equal(a: &[u8], b: &[u8], shape: Shape) -> bool {
    let n = shape.block * shape.count;
    a[..n] == b[..n]
}

/// The initiator of the two-process measurement: VRAM → VRAM (write) and VRAM ← VRAM
/// (read) to the target started with [`ipc_target`] on the same GPU, every byte checked
/// (the WRITE through the target's own copy of its buffer: this process never maps the
/// target's allocation except through UCX). The plain-copy reference is measured by
/// [`ipc_reference`] in a third process; the rows' `plain` is filled from it with
/// [`apply_reference`]. The caller touches `dir/done` when both are finished.
pub fn ipc_initiator(setup: &GpuSetup, dir: &Path, iters: usize) -> Result<Vec<Row>, String> {
    let md = wait_for_file(&dir.join("target.md"), Duration::from_secs(60))?;
    let remote_base = u64::from_le_bytes(
        wait_for_file(&dir.join("target.addr"), Duration::from_secs(5))?
            .try_into()
            .map_err(|_| "target.addr is not 8 bytes".to_string())?,
    );
    let dev = Device::open(setup.dev).map_err(cuda)?;
    let src = DeviceBuffer::alloc(&dev, BUFFER_BYTES).map_err(cuda)?;
    let back = DeviceBuffer::alloc(&dev, BUFFER_BYTES).map_err(cuda)?;
    let agent = setup.ucx_agent("gpu-check-initiator")?;
    let vram = |b: &DeviceBuffer| Desc::new(b.addr(), BUFFER_BYTES as u64, setup.dev);
    // SAFETY: the buffers are declared before the agent and outlive it; they are read
    // only after the transfers that touch them completed.
    unsafe {
        agent
            .register(MemKind::Vram, vram(&src))
            .map_err(ferry_err)?;
        agent
            .register(MemKind::Vram, vram(&back))
            .map_err(ferry_err)?;
    }
    let peer = agent.load_remote_md(&md).map_err(ferry_err)?;
    let mut rows = Vec::new();
    let mut host = vec![0u8; BUFFER_BYTES];
    // What the target's buffer holds: zeros, then each WRITE's blocks.
    let mut expected = vec![0u8; BUFFER_BYTES];
    for (k, shape) in SHAPES.into_iter().enumerate() {
        let bytes = pattern(BUFFER_BYTES, 100 + k as u64);
        src.write(&bytes).map_err(cuda)?;
        back.write(&vec![0u8; BUFFER_BYTES]).map_err(cuda)?;
        let order = shuffled(shape.count, 7 + k as u64);
        let (local, remote) = lists(src.addr(), remote_base, shape, &order, setup.dev);
        let (local_back, _) = lists(back.addr(), remote_base, shape, &order, setup.dev);
        let (write, read) = make_pair(
            &agent,
            MemKind::Vram,
            &local,
            &local_back,
            peer.into(),
            MemKind::Vram,
            &remote,
        )?;
        let total = shape.block * shape.count;
        let t_write = time_median(iters, || run_once(&agent, write))?;
        for (i, &j) in order.iter().enumerate() {
            expected[j * shape.block..][..shape.block]
                .copy_from_slice(&bytes[i * shape.block..][..shape.block]);
        }
        let landed = target_dump(dir, k as u32)?;
        let write_ok = landed == expected;
        let t_read = time_median(iters, || run_once(&agent, read))?;
        back.read(&mut host).map_err(cuda)?;
        let read_ok = prefix_equal(&bytes, &host, shape);
        rows.push(Row {
            what: "VRAM->VRAM write, 2 processes, UCX".into(),
            shape,
            ferry_gbps: gbps(total, t_write),
            plain: None,
            verified: write_ok,
            note: String::new(),
        });
        rows.push(Row {
            what: "VRAM<-VRAM read, 2 processes, UCX".into(),
            shape,
            ferry_gbps: gbps(total, t_read),
            plain: None,
            verified: read_ok,
            note: String::new(),
        });
        agent.release(write).map_err(ferry_err)?;
        agent.release(read).map_err(ferry_err)?;
    }
    drop(agent);
    Ok(rows)
}

/// VMM memory (`cuMemCreate` + `cuMemMap`, what PyTorch's expandable segments use):
/// VRAM → VRAM write and read between two agents of this process, one physical
/// allocation per buffer, beside `cuMemcpyDtoDAsync` of the same blocks; and a buffer
/// of three allocations mapped back to back, which UCX must refuse by default
/// (`vmm_spanning=refuse`, its `cuda_ipc` exports the first allocation only) with a
/// reason naming it (the last row: verified = refused as it should be).
pub fn vmm(setup: &GpuSetup, iters: usize) -> Result<Vec<Row>, String> {
    let dev = Device::open(setup.dev).map_err(cuda)?;
    let a_buf = VmmBuffer::alloc(&dev, BUFFER_BYTES, 1).map_err(cuda)?;
    let b_buf = VmmBuffer::alloc(&dev, BUFFER_BYTES, 1).map_err(cuda)?;
    let spanning = VmmBuffer::alloc(&dev, 2 << 20, 3).map_err(cuda)?;
    let a = setup.ucx_agent("gpu-check-vmm-a")?;
    let b = setup.ucx_agent("gpu-check-vmm-b")?;
    let vram = |addr: u64, len: usize| Desc::new(addr, len as u64, setup.dev);
    // SAFETY: the buffers are declared before the agents and outlive them; they are
    // read only after the transfers that touch them completed.
    unsafe {
        a.register(MemKind::Vram, vram(a_buf.addr(), BUFFER_BYTES))
            .map_err(ferry_err)?;
        b.register(MemKind::Vram, vram(b_buf.addr(), BUFFER_BYTES))
            .map_err(ferry_err)?;
    }
    // SAFETY: as above; a refusal registers nothing.
    let refused = unsafe { b.register(MemKind::Vram, vram(spanning.addr(), spanning.len())) };
    let refusal_ok = matches!(&refused, Err(e) if e.to_string().contains("VMM allocations"));
    let peer = a
        .load_remote_md(&b.local_md().map_err(ferry_err)?)
        .map_err(ferry_err)?;
    let mut rows = Vec::new();
    let mut host = vec![0u8; BUFFER_BYTES];
    let shape = SHAPES[0];
    let bytes = pattern(BUFFER_BYTES, 400);
    a_buf.write(&bytes).map_err(cuda)?;
    b_buf.write(&vec![0u8; BUFFER_BYTES]).map_err(cuda)?;
    let order = shuffled(shape.count, 41);
    let (local, remote) = lists(a_buf.addr(), b_buf.addr(), shape, &order, setup.dev);
    let mut cmds = CommandBuffer::with_capacity(8);
    let l = cmds.prep(Side::Local, MemKind::Vram, &local);
    let r = cmds.prep(peer, MemKind::Vram, &remote);
    let write = cmds.make(Op::Write, l, &[], r, &[]).ticket();
    let read = cmds.make(Op::Read, l, &[], r, &[]).ticket();
    a.flush(&mut cmds);
    if let Some((i, e)) = cmds.errors().next() {
        return Err(format!("set-up command #{i}: {e}"));
    }
    let write = cmds.created(write).map_err(ferry_err)?;
    let read = cmds.created(read).map_err(ferry_err)?;
    let total = shape.block * shape.count;
    let t_write = time_median(iters, || run_once(&a, write))?;
    b_buf.read(&mut host).map_err(cuda)?;
    let write_ok = placed(&bytes, &host, shape, &order);
    a_buf.write(&vec![0u8; BUFFER_BYTES]).map_err(cuda)?;
    let t_read = time_median(iters, || run_once(&a, read))?;
    a_buf.read(&mut host).map_err(cuda)?;
    let read_ok = prefix_equal(&bytes, &host, shape);
    let moves = block_moves(&order, shape, a_buf.addr(), b_buf.addr());
    let plain = time_dtod(&dev, &moves, iters)?;
    for (what, t, ok) in [
        ("VMM->VMM write, 2 agents, UCX", t_write, write_ok),
        ("VMM<-VMM read, 2 agents, UCX", t_read, read_ok),
    ] {
        rows.push(Row {
            what: what.into(),
            shape,
            ferry_gbps: gbps(total, t),
            plain: Some(("cuMemcpyDtoDAsync", gbps(total, plain))),
            verified: ok,
            note: "one cuMemCreate allocation per buffer".into(),
        });
    }
    rows.push(Row {
        what: "VMM region of 3 allocations refused".into(),
        shape,
        ferry_gbps: 0.0,
        plain: None,
        verified: refusal_ok,
        note: match &refused {
            Ok(_) => "registered: UCX would move only the first allocation".into(),
            Err(e) => e.to_string(),
        },
    });
    a.release(write).map_err(ferry_err)?;
    a.release(read).map_err(ferry_err)?;
    drop(a);
    drop(b);
    Ok(rows)
}

/// VRAM ↔ DRAM between two agents of this process (UCX): DRAM → VRAM (write) and
/// VRAM → DRAM (read), beside `cuMemcpyHtoD` / `cuMemcpyDtoH` per block.
pub fn vram_dram(setup: &GpuSetup, iters: usize) -> Result<Vec<Row>, String> {
    let dev = Device::open(setup.dev).map_err(cuda)?;
    let vram = DeviceBuffer::alloc(&dev, BUFFER_BYTES).map_err(cuda)?;
    let mut dram = vec![0u8; BUFFER_BYTES];
    let mut dram_back = vec![0u8; BUFFER_BYTES];
    let a = setup.ucx_agent("gpu-check-dram")?;
    let b = setup.ucx_agent("gpu-check-vram")?;
    let host = |v: &[u8]| Desc::new(v.as_ptr() as u64, v.len() as u64, 0);
    // SAFETY: the buffers are declared before the agents and outlive them; they are
    // read or written only while no transfer touches them.
    unsafe {
        a.register(MemKind::Dram, host(&dram)).map_err(ferry_err)?;
        a.register(MemKind::Dram, host(&dram_back))
            .map_err(ferry_err)?;
        b.register(
            MemKind::Vram,
            Desc::new(vram.addr(), BUFFER_BYTES as u64, setup.dev),
        )
        .map_err(ferry_err)?;
    }
    let peer = a
        .load_remote_md(&b.local_md().map_err(ferry_err)?)
        .map_err(ferry_err)?;
    let mut rows = Vec::new();
    let mut landed = vec![0u8; BUFFER_BYTES];
    for (k, shape) in SHAPES.into_iter().enumerate() {
        let bytes = pattern(BUFFER_BYTES, 200 + k as u64);
        dram.copy_from_slice(&bytes);
        dram_back.fill(0);
        let order = shuffled(shape.count, 17 + k as u64);
        let (local, remote) = lists(dram.as_ptr() as u64, vram.addr(), shape, &order, setup.dev);
        let local: Vec<Desc> = local.iter().map(|d| Desc::new(d.addr, d.len, 0)).collect();
        let local_back: Vec<Desc> = (0..shape.count)
            .map(|i| {
                Desc::new(
                    dram_back.as_ptr() as u64 + (i * shape.block) as u64,
                    shape.block as u64,
                    0,
                )
            })
            .collect();
        let mut cmds = CommandBuffer::with_capacity(8);
        let l = cmds.prep(Side::Local, MemKind::Dram, &local);
        let lb = cmds.prep(Side::Local, MemKind::Dram, &local_back);
        let r = cmds.prep(peer, MemKind::Vram, &remote);
        let write = cmds.make(Op::Write, l, &[], r, &[]).ticket();
        let read = cmds.make(Op::Read, lb, &[], r, &[]).ticket();
        a.flush(&mut cmds);
        if let Some((i, e)) = cmds.errors().next() {
            return Err(format!("set-up command #{i}: {e}"));
        }
        let write = cmds.created(write).map_err(ferry_err)?;
        let read = cmds.created(read).map_err(ferry_err)?;
        let total = shape.block * shape.count;
        let t_write = time_median(iters, || run_once(&a, write))?;
        vram.read(&mut landed).map_err(cuda)?;
        let write_ok = placed(&bytes, &landed, shape, &order);
        let t_read = time_median(iters, || run_once(&a, read))?;
        let read_ok = prefix_equal(&bytes, &dram_back, shape);
        let p_write = time_median(iters, || {
            let start = Instant::now();
            for (i, &j) in order.iter().enumerate() {
                // SAFETY: block j of our live device buffer.
                unsafe {
                    ferry_cuda::copy_htod(
                        &dev,
                        vram.addr() + (j * shape.block) as u64,
                        &dram[i * shape.block..][..shape.block],
                    )
                }
                .map_err(cuda)?;
            }
            Ok(start.elapsed())
        })?;
        let mut scratch = vec![0u8; BUFFER_BYTES];
        let p_read = time_median(iters, || {
            let start = Instant::now();
            for (i, &j) in order.iter().enumerate() {
                // SAFETY: block j of our live device buffer.
                unsafe {
                    ferry_cuda::copy_dtoh(
                        &dev,
                        &mut scratch[i * shape.block..][..shape.block],
                        vram.addr() + (j * shape.block) as u64,
                    )
                }
                .map_err(cuda)?;
            }
            Ok(start.elapsed())
        })?;
        rows.push(Row {
            what: "DRAM->VRAM write, 2 agents, UCX".into(),
            shape,
            ferry_gbps: gbps(total, t_write),
            plain: Some(("cuMemcpyHtoD per block", gbps(total, p_write))),
            verified: write_ok,
            note: String::new(),
        });
        rows.push(Row {
            what: "VRAM->DRAM read, 2 agents, UCX".into(),
            shape,
            ferry_gbps: gbps(total, t_read),
            plain: Some(("cuMemcpyDtoH per block", gbps(total, p_read))),
            verified: read_ok,
            note: String::new(),
        });
        a.release(write).map_err(ferry_err)?;
        a.release(read).map_err(ferry_err)?;
    }
    drop(a);
    drop(b);
    Ok(rows)
}

/// Where and how GDS runs.
#[derive(Clone, Debug, Default)]
pub struct GdsSetup {
    /// The cuFile library (`None` = `libcufile.so.0`).
    pub cufile_library: Option<PathBuf>,
    /// Directory of the test file (a local file system; GDS proper needs one that
    /// nvidia-fs supports, otherwise cuFile runs in compatibility mode).
    pub dir: PathBuf,
}

/// FILE ↔ VRAM through GDS with `engine` (`threads` or `batch`): VRAM → FILE (write)
/// and FILE → VRAM (read), verified against the source through host copies. No plain
/// reference: the row's note says cuFile's mode.
pub fn gds(
    setup: &GpuSetup,
    gds: &GdsSetup,
    engine: &str,
    iters: usize,
) -> Result<Vec<Row>, String> {
    let dev = Device::open(setup.dev).map_err(cuda)?;
    let src = DeviceBuffer::alloc(&dev, BUFFER_BYTES).map_err(cuda)?;
    let back = DeviceBuffer::alloc(&dev, BUFFER_BYTES).map_err(cuda)?;
    let mut params = Params::new();
    if let Some(library) = &gds.cufile_library {
        params.insert("cufile_library".into(), library.display().to_string());
    }
    params.insert("engine".into(), engine.into());
    // What cuFile does here (GDS or compatibility mode), from a backend of our own.
    let mode = ferry_gds::probe_mode(gds.cufile_library.as_deref())?.to_string();
    let agent =
        Agent::new(AgentConfig::named(format!("gpu-check-gds-{engine}"))).map_err(ferry_err)?;
    agent
        .create_backend("GDS", &params)
        .map_err(|e| format!("GDS backend: {e}"))?;
    let path = gds.dir.join(format!("gds-check-{engine}.bin"));
    let _ = std::fs::remove_file(&path);
    // O_DIRECT where the file system takes it (GDS proper needs it).
    let direct = FileMode {
        write: true,
        create: true,
        direct: true,
        sync: false,
    };
    let (file_mode, direct_note) = match std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
    {
        Ok(_) => (direct, "O_DIRECT"),
        Err(_) => (
            FileMode {
                direct: false,
                ..direct
            },
            "buffered (no O_DIRECT here)",
        ),
    };
    agent
        .register_file(&path, file_mode, Desc::new(0, 0, 1))
        .map_err(ferry_err)?;
    let vram = |b: &DeviceBuffer| Desc::new(b.addr(), BUFFER_BYTES as u64, setup.dev);
    // SAFETY: the buffers are declared before the agent and outlive it.
    unsafe {
        agent
            .register(MemKind::Vram, vram(&src))
            .map_err(ferry_err)?;
        agent
            .register(MemKind::Vram, vram(&back))
            .map_err(ferry_err)?;
    }
    let mut rows = Vec::new();
    let mut host = vec![0u8; BUFFER_BYTES];
    for (k, shape) in SHAPES.into_iter().enumerate() {
        let bytes = pattern(BUFFER_BYTES, 300 + k as u64);
        src.write(&bytes).map_err(cuda)?;
        back.write(&vec![0u8; BUFFER_BYTES]).map_err(cuda)?;
        let order = shuffled(shape.count, 27 + k as u64);
        let (local, _) = lists(src.addr(), 0, shape, &order, setup.dev);
        let (local_back, _) = lists(back.addr(), 0, shape, &order, setup.dev);
        let remote: Vec<Desc> = order
            .iter()
            .map(|&j| Desc::new((j * shape.block) as u64, shape.block as u64, 1))
            .collect();
        let (write, read) = make_pair(
            &agent,
            MemKind::Vram,
            &local,
            &local_back,
            Side::Local,
            MemKind::File,
            &remote,
        )?;
        let total = shape.block * shape.count;
        let t_write = time_median(iters, || run_once(&agent, write))?;
        let on_disk = std::fs::read(&path).map_err(|e| e.to_string())?;
        let write_ok = on_disk.len() >= total && placed(&bytes, &on_disk, shape, &order);
        let t_read = time_median(iters, || run_once(&agent, read))?;
        back.read(&mut host).map_err(cuda)?;
        let read_ok = prefix_equal(&bytes, &host, shape);
        let note = format!("{mode}; {direct_note}");
        rows.push(Row {
            what: format!("VRAM->FILE write, GDS {engine}"),
            shape,
            ferry_gbps: gbps(total, t_write),
            plain: None,
            verified: write_ok,
            note: note.clone(),
        });
        rows.push(Row {
            what: format!("FILE->VRAM read, GDS {engine}"),
            shape,
            ferry_gbps: gbps(total, t_read),
            plain: None,
            verified: read_ok,
            note,
        });
        agent.release(write).map_err(ferry_err)?;
        agent.release(read).map_err(ferry_err)?;
    }
    drop(agent);
    let _ = std::fs::remove_file(&path);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_process_figures_fill_the_initiators_rows() {
        let dir = tempfile::tempdir().unwrap();
        let row = |what: &str, shape| Row {
            what: what.into(),
            shape,
            ferry_gbps: 1.0,
            plain: None,
            verified: true,
            note: String::new(),
        };
        let mut rows = vec![
            row("VRAM->VRAM write, 2 processes, UCX", SHAPES[0]),
            row("VRAM<-VRAM read, 2 processes, UCX", SHAPES[0]),
            row("VRAM->VRAM write, 2 processes, UCX", SHAPES[1]),
        ];
        // 32 MiB in 1 ms = 33.55 GB/s; 2 ms = 16.78; 64 MiB in 4 ms = 16.78.
        publish(
            &dir.path().join("reference"),
            b"0 0.001 0.002\n1 0.004 0.008\n",
        )
        .unwrap();
        apply_reference(dir.path(), &mut rows).unwrap();
        let gbps: Vec<f64> = rows.iter().map(|r| r.plain.unwrap().1).collect();
        assert!((gbps[0] - 33.554).abs() < 0.01, "{gbps:?}");
        assert!((gbps[1] - 16.777).abs() < 0.01, "{gbps:?}");
        assert!((gbps[2] - 16.777).abs() < 0.01, "{gbps:?}");
        assert!(rows[0].plain.unwrap().0.contains("other process"));
        publish(&dir.path().join("reference"), b"0 x\n").unwrap();
        assert!(apply_reference(dir.path(), &mut rows).is_err());
        // Local block i goes to target block order[i].
        let moves = block_moves(&[2, 0, 1], SHAPES[0], 0x1000_0000, 0x2000_0000);
        assert_eq!(
            moves[0],
            (0x2000_0000 + 2 * (1 << 20), 0x1000_0000, 1 << 20)
        );
    }
}
