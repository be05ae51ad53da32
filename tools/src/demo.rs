//! `ferry demo`: two agents in this process move a few hundred MiB both ways through the
//! embedded loopback backend, verify every byte and print throughput.

use std::time::Instant;

use ferry::{Agent, AgentConfig, CommandBuffer, Desc, MemKind, Op, Params, Side, XferStatus};

use crate::buffers::HostBuffer;
use crate::opt;

pub fn run(args: &[String]) -> Result<(), String> {
    let mib: usize = opt(args, "--mib")?.unwrap_or(256);
    let block_kib: usize = opt(args, "--block-kib")?.unwrap_or(1024);
    let total = mib << 20;
    let block = block_kib << 10;
    if total == 0 || block == 0 || !total.is_multiple_of(block) {
        return Err("--mib must be a positive multiple of --block-kib".into());
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
