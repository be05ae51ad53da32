//! Tracy, for real (feature `tracy`: `cargo test -p ferry-tests --features tracy --test
//! tracy`): the agent starts the in-process Tracy client; this test connects to it as a
//! viewer or `tracy-capture` would (127.0.0.1:8086), does the handshake of the protocol
//! the client speaks, checks the welcome (our pid), and checks that the event stream
//! flows while agents flush (spans, frame marks and plots of every flush; the stream is
//! LZ4-compressed and is not decoded here).
#![cfg(feature = "tracy")]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ferry::{Op, XferStatus};
use ferry_tests::{pair, Buffer, Rng};

/// The protocol version of the Tracy client that `tracy-client-sys` 0.30 bundles
/// (`ProtocolVersion` in `common/TracyProtocol.hpp`).
const PROTOCOL_VERSION: u32 = 82;
/// `WelcomeMessage` (packed): 8 × 8 bytes, 2 × 1, 12, 4, 64 (program), 1024 (host).
const WELCOME_BYTES: usize = 64 + 2 + 12 + 4 + 64 + 1024;
const PID_OFFSET: usize = 48;

#[test]
fn a_viewer_connects_and_events_flow_while_agents_flush() {
    let mut rng = Rng::new(9);
    let src = Buffer::random(64 << 10, &mut rng);
    let dst = Buffer::zeroed(64 << 10);
    let p = pair(&src, &dst); // the first agent starts the Tracy client
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut conn = loop {
        match TcpStream::connect("127.0.0.1:8086") {
            Ok(c) => break c,
            Err(e) => {
                assert!(Instant::now() < deadline, "no Tracy listener: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn.write_all(b"TracyPrf").unwrap();
    conn.write_all(&PROTOCOL_VERSION.to_le_bytes()).unwrap();
    let mut status = [0u8; 1];
    conn.read_exact(&mut status).unwrap();
    assert_eq!(
        status[0], 1,
        "handshake status (1 = welcome, 2 = protocol mismatch)"
    );
    let mut welcome = vec![0u8; WELCOME_BYTES];
    conn.read_exact(&mut welcome).unwrap();
    let pid = u64::from_le_bytes(welcome[PID_OFFSET..PID_OFFSET + 8].try_into().unwrap());
    assert_eq!(
        pid,
        u64::from(std::process::id()),
        "the welcome names this process"
    );

    // Idle first (what the client sends by itself), then flushing: the flushes' spans,
    // frame marks and plots must dominate the stream.
    conn.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut chunk = vec![0u8; 64 << 10];
    let mut idle = 0usize;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        if let Ok(n) = conn.read(&mut chunk) {
            idle += n;
        }
    }
    let mut received = 0usize;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        for _ in 0..50 {
            let x = p.create(Op::Write, &[src.whole()], &[dst.whole()], None);
            assert_eq!(p.a.post(x).unwrap(), XferStatus::Done);
            p.a.release(x).unwrap();
        }
        if let Ok(n) = conn.read(&mut chunk) {
            received += n;
        }
    }
    eprintln!(
        "tracy: welcome from pid {pid}; event stream: {idle} bytes in 1 s idle, \
         {received} bytes in 1 s of flushing"
    );
    assert!(
        received > 1024 && received > 10 * idle,
        "flushing sent {received} bytes, idle {idle}"
    );
    assert_eq!(dst.bytes(), src.bytes());
}
