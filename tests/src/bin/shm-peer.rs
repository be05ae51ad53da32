//! The far side of the SHM two-process tests (`tests/tests/shm.rs`): an agent with an
//! SHM backend that registers one shareable and one ordinary buffer, hands its metadata
//! to the test over a 127.0.0.1 socket, and then serves until told to quit:
//!
//! - every notification it drains goes back as `N` + FNV-1a hashes of both buffers,
//!   computed the moment it learned of the notification (so the test can check that
//!   the data arrived first), then the payload (payloads starting `burst:` skip the
//!   hashes: zeros);
//! - `D` answers with both buffers' bytes; `Q` ends it.
//!
//! Usage: `shm-peer ADDR SEED LEN [key=value ...] [--ucx]` (SHM backend parameters;
//! `--ucx` adds a UCX backend after SHM).
// Reason: the ordinary buffer is registered (the caller-side promise of
// `Agent::register`) and read with a raw copy while the peer may write it.
#![allow(unsafe_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::Duration;

use ferry::shm::{SharedMemory, ShmOptions};
use ferry::{Agent, AgentConfig, Desc, MemKind, Params};
use ferry_tests::Rng;

fn frame(out: &mut TcpStream, tag: u8, parts: &[&[u8]]) -> std::io::Result<()> {
    let len: usize = 1 + parts.iter().map(|p| p.len()).sum::<usize>();
    let mut bytes = Vec::with_capacity(4 + len);
    bytes.extend_from_slice(&(len as u32).to_le_bytes());
    bytes.push(tag);
    for p in parts {
        bytes.extend_from_slice(p);
    }
    out.write_all(&bytes)
}

fn fnv(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: shm-peer ADDR SEED LEN [key=value ...]");
        std::process::exit(2);
    }
    let seed: u64 = args[2].parse().expect("seed");
    let len: usize = args[3].parse().expect("len");
    let mut params = Params::new();
    let mut with_ucx = false;
    for kv in &args[4..] {
        if kv == "--ucx" {
            with_ucx = true;
            continue;
        }
        let (k, v) = kv.split_once('=').expect("key=value");
        params.insert(k.into(), v.into());
    }
    let agent = Agent::new(AgentConfig::named(format!(
        "shm-peer-{}",
        std::process::id()
    )))
    .expect("agent");
    agent.create_backend("SHM", &params).expect("SHM backend");
    if with_ucx {
        agent
            .create_backend("UCX", &Params::new())
            .expect("UCX backend");
    }
    let mut rng = Rng::new(seed);
    let shared = SharedMemory::alloc(len, &ShmOptions::default()).expect("shared memory");
    let mut init = vec![0u8; len];
    rng.fill(&mut init);
    shared.write(0, &init).expect("fill");
    let mut ordinary = vec![0u8; len].into_boxed_slice();
    rng.fill(&mut ordinary);
    let ordinary_desc = Desc::new(ordinary.as_ptr() as u64, len as u64, 0);
    // SAFETY: both buffers live until the process exits; we read them only with copies
    // and only to report them.
    unsafe {
        agent
            .register(MemKind::Dram, shared.desc_at(0, len).expect("in range"))
            .expect("register shared");
        agent
            .register(MemKind::Dram, ordinary_desc)
            .expect("register ordinary");
    }
    let mut out = TcpStream::connect(&args[1]).expect("connect to the test");
    let md = agent.local_md().expect("md");
    let addrs = [
        shared.addr().to_le_bytes(),
        (ordinary.as_ptr() as u64).to_le_bytes(),
    ]
    .concat();
    frame(&mut out, b'M', &[&addrs, &md]).expect("send md");

    let mut input = out.try_clone().expect("clone");
    let (tx, rx) = mpsc::channel::<u8>();
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        while input.read_exact(&mut b).is_ok() {
            if tx.send(b[0]).is_err() {
                break;
            }
        }
        let _ = tx.send(b'Q');
    });
    let snapshot = |shared: &SharedMemory| {
        let mut s = vec![0u8; len];
        shared.read(0, &mut s).expect("read shared");
        let mut o = vec![0u8; len];
        // SAFETY: `ordinary` is ours and `len` long; a peer's CMA write may race (the
        // test only asks when none is in flight).
        unsafe { std::ptr::copy_nonoverlapping(ordinary.as_ptr(), o.as_mut_ptr(), len) };
        (s, o)
    };
    loop {
        for (_, payload) in agent.drain_notifications() {
            if payload.starts_with(b"burst:") {
                // Bursts test ordering and loss, not data: no hashing (it is slow).
                frame(&mut out, b'N', &[&[0u8; 16], &payload]).expect("send notification");
                continue;
            }
            let (s, o) = snapshot(&shared);
            frame(
                &mut out,
                b'N',
                &[&fnv(&s).to_le_bytes(), &fnv(&o).to_le_bytes(), &payload],
            )
            .expect("send notification");
        }
        match rx.try_recv() {
            Ok(b'D') => {
                let (s, o) = snapshot(&shared);
                frame(&mut out, b'D', &[&s, &o]).expect("send dump");
            }
            Ok(b'Q') | Err(mpsc::TryRecvError::Disconnected) => break,
            Ok(_) | Err(mpsc::TryRecvError::Empty) => std::thread::sleep(Duration::from_micros(50)),
        }
    }
}
