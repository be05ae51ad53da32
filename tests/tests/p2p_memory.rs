//! What hostile P2P clients can make a listener allocate: 16 connections announcing
//! 64 MiB frames cost the listener about what they really sent, not what they
//! announced — with a secret they do not get past the hello's proof, without one the
//! payload buffer grows only with the bytes that arrived. Measured with the counting
//! allocator (the largest single allocation: a reservation at the announced length
//! would be 64 MiB, even where the kernel does not make it resident) and on the
//! resident set (/proc/self/statm). (Its own test binary, with one test: both
//! measures are per process.)

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::exchange::p2p::frame::Hello;
use ferry::exchange::{ExchangeConfig, Manager, P2pConfig};
use ferry_tests::counting::{largest, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const LONG: Duration = Duration::from_secs(10);

fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

const CONNECTIONS: usize = 16;
const ANNOUNCED: u32 = (64 << 20) - 1;

#[test]
fn announced_frame_lengths_reserve_nothing() {
    let Some(before_all) = rss_bytes() else {
        eprintln!("skipping: no /proc/self/statm on this system");
        return;
    };
    for secret in [Some(&b"team"[..]), None] {
        let mut cfg = ExchangeConfig::default();
        cfg.p2p.listen = Some(P2pConfig::LOOPBACK_EPHEMERAL);
        cfg.p2p.secret = secret.map(Arc::from);
        cfg.p2p.max_connections = 2 * CONNECTIONS;
        let a = Manager::new("a", cfg).unwrap();
        let before = rss_bytes().unwrap();
        let (held, peak) = largest(|| attack(&a, secret.is_some()));
        let grown = rss_bytes().unwrap().saturating_sub(before);
        // Per connection: a 16 KiB read-ahead buffer, the first 64 KiB payload chunk,
        // a thread stack's touched pages. 768 MiB would be announced; allow 16 MiB.
        eprintln!(
            "secret {}: RSS grew by {} KiB for {CONNECTIONS} connections announcing {} MiB each",
            secret.is_some(),
            grown >> 10,
            ANNOUNCED >> 20
        );
        assert!(
            grown < 16 << 20,
            "RSS grew by {grown} bytes (secret {})",
            secret.is_some()
        );
        eprintln!("largest single allocation meanwhile: {peak} bytes");
        assert!(
            peak <= 1 << 20,
            "an allocation of {peak} bytes (secret {})",
            secret.is_some()
        );
        drop(held);
    }
    eprintln!(
        "RSS {} MiB before, {} MiB after",
        before_all >> 20,
        rss_bytes().unwrap() >> 20
    );
}

/// Open the hostile connections and wait until the listener has dealt with them.
fn attack(a: &Manager, secret: bool) -> Vec<TcpStream> {
    let to = a.p2p_listen_addr().unwrap();
    let mut held = Vec::new();
    for i in 0..CONNECTIONS {
        let mut s = TcpStream::connect(to).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut theirs = [0u8; 24];
        s.read_exact(&mut theirs).unwrap(); // their hello ("a")
        let hello = Hello {
            auth: secret,
            nonce: [i as u8 + 1; 16],
            name: format!("m{i}"),
        };
        s.write_all(&hello.encode()).unwrap();
        // A frame head announcing 64 MiB (where a secret wants the proof), then
        // 1 KiB of payload, and nothing more.
        s.write_all(&ANNOUNCED.to_le_bytes()).unwrap();
        let mut head = vec![1u8, 0, 0, 0, 0, 0, 0, 0, 0];
        head.push(hello.name.len() as u8);
        head.extend_from_slice(hello.name.as_bytes());
        head.push(8);
        head.extend_from_slice(b"metadata");
        s.write_all(&head).unwrap();
        s.write_all(&[0x55; 1024]).unwrap();
        held.push(s);
    }
    let stats = a.p2p_stats().unwrap();
    let deadline = Instant::now() + LONG;
    if secret {
        // Refused at the proof: nothing of the frame was even parsed.
        while stats.connections_refused.load(Ordering::Relaxed) < CONNECTIONS as u64 {
            assert!(Instant::now() < deadline, "not all refused");
            std::thread::sleep(Duration::from_millis(5));
        }
    } else {
        // Accepted and reading the payload: give the listener time to read what came.
        while stats.connections_accepted.load(Ordering::Relaxed) < CONNECTIONS as u64 {
            assert!(Instant::now() < deadline, "not all accepted");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    held
}
