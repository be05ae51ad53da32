//! Hostile clients of the TCPStore server and the P2P listener, a well-behaved client
//! that records its latency, and resident-memory sampling from /proc. Shared by
//! `tests/hostile_server.rs` and `examples/hostile_latency.rs`.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_exchange::tcpstore::{proto, ClientOptions, TcpStoreClient};

/// An attacker's connection: from the source address in `FERRY_ATTACK_SOURCE` (say
/// `127.0.0.2`, so the per-source limit of the target tells attackers from the good
/// client on 127.0.0.1), else from wherever the kernel picks.
pub fn attacker_connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let Some(source) = std::env::var("FERRY_ATTACK_SOURCE")
        .ok()
        .and_then(|v| v.parse::<std::net::IpAddr>().ok())
    else {
        return TcpStream::connect(addr);
    };
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&SocketAddr::new(source, 0).into())?;
    socket.connect(&addr.into())?;
    Ok(socket.into())
}

/// VALIDATE, as every torch client sends it first.
pub fn validate_bytes() -> Vec<u8> {
    let mut v = vec![proto::op::VALIDATE];
    v.extend_from_slice(&proto::VALIDATE_MAGIC.to_le_bytes());
    v
}

/// A raw connection that sent VALIDATE.
pub fn raw(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let mut s = attacker_connect(addr)?;
    s.set_nodelay(true)?;
    s.write_all(&validate_bytes())?;
    Ok(s)
}

/// Whether the server closed `s` within `timeout` (EOF or reset on read).
pub fn closed_within(s: &mut TcpStream, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let _unused = s.set_read_timeout(Some(left.min(Duration::from_millis(200))));
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return true,
        }
    }
}

/// A small deterministic generator (xorshift), so attacks repeat exactly.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next() as u8;
        }
    }
}

/// Latencies and failures of a well-behaved client.
#[derive(Debug, Default)]
pub struct GoodReport {
    pub ops: u64,
    pub failures: Vec<String>,
    /// Latency of each operation, in microseconds.
    pub lat_us: Vec<u64>,
}

impl GoodReport {
    pub fn percentile_us(&self, p: f64) -> u64 {
        if self.lat_us.is_empty() {
            return 0;
        }
        let mut v = self.lat_us.clone();
        v.sort_unstable();
        v[((v.len() - 1) as f64 * p).round() as usize]
    }
    pub fn summary(&self) -> String {
        format!(
            "{} ops, {} failures, p50 {} us, p99 {} us, max {} us",
            self.ops,
            self.failures.len(),
            self.percentile_us(0.5),
            self.percentile_us(0.99),
            self.percentile_us(1.0)
        )
    }
}

/// A well-behaved TCPStore client on its own thread: SET, GET (checked), CHECK, WAIT
/// on a present key, ADD, in a loop, on one connection it reopens every
/// `reconnect_every` operations (so it also needs a free slot now and then).
pub struct GoodClient {
    stop: Arc<AtomicBool>,
    pub ops: Arc<AtomicU64>,
    thread: Option<JoinHandle<GoodReport>>,
}

impl GoodClient {
    pub fn start(addr: SocketAddr, name: &str, reconnect_every: u64) -> GoodClient {
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let (s, o) = (stop.clone(), ops.clone());
        let name = name.to_owned();
        let thread = std::thread::spawn(move || good_loop(addr, &name, reconnect_every, &s, &o));
        GoodClient {
            stop,
            ops,
            thread: Some(thread),
        }
    }

    /// Wait until it did `n` more operations (or `timeout` passed).
    pub fn wait_ops(&self, n: u64, timeout: Duration) {
        let target = self.ops.load(Ordering::Relaxed) + n;
        let deadline = Instant::now() + timeout;
        while self.ops.load(Ordering::Relaxed) < target && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn finish(mut self) -> GoodReport {
        self.stop.store(true, Ordering::Release);
        self.thread
            .take()
            .map(|t| t.join().expect("good client thread"))
            .unwrap_or_default()
    }
}

fn connect(addr: SocketAddr) -> Result<TcpStoreClient, String> {
    let options = ClientOptions {
        io_timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    };
    TcpStoreClient::connect(&addr.to_string(), options).map_err(|e| format!("connect: {e}"))
}

fn good_loop(
    addr: SocketAddr,
    name: &str,
    reconnect_every: u64,
    stop: &AtomicBool,
    ops: &AtomicU64,
) -> GoodReport {
    let mut report = GoodReport::default();
    let mut client: Option<TcpStoreClient> = None;
    let mut i = 0u64;
    while !stop.load(Ordering::Acquire) {
        let t = Instant::now();
        let key = format!("/good/{name}/{}", i % 64);
        let value = format!("value-{i}").into_bytes();
        let fresh = client.is_none() || i.is_multiple_of(reconnect_every);
        let result = (|| -> Result<(), String> {
            if fresh {
                client = Some(connect(addr)?);
            }
            let c = client.as_mut().ok_or("no client")?;
            let e = |what: &str, e: ferry_storage::Error| format!("{what}: {e}");
            match i % 5 {
                0 => c.set(key.as_bytes(), &value).map_err(|x| e("SET", x)),
                1 => {
                    c.set(key.as_bytes(), &value).map_err(|x| e("SET", x))?;
                    let got = c.get(key.as_bytes()).map_err(|x| e("GET", x))?;
                    (got == value)
                        .then_some(())
                        .ok_or_else(|| "GET returned another value".to_string())
                }
                2 => c
                    .check(&[key.as_bytes()])
                    .map(|_| ())
                    .map_err(|x| e("CHECK", x)),
                3 => {
                    c.set(key.as_bytes(), &value).map_err(|x| e("SET", x))?;
                    match c.wait(&[key.as_bytes()], Duration::from_secs(5)) {
                        Ok(true) => Ok(()),
                        Ok(false) => Err("WAIT on a present key timed out".into()),
                        Err(x) => Err(e("WAIT", x)),
                    }
                }
                _ => c
                    .add(format!("/good/{name}/n").as_bytes(), 1)
                    .map(|_| ())
                    .map_err(|x| e("ADD", x)),
            }
        })();
        // The first operation on a fresh connection includes the connect.
        report.lat_us.push(t.elapsed().as_micros() as u64);
        if let Err(e) = result {
            report.failures.push(format!("op {i}: {e}"));
            client = None;
        }
        report.ops += 1;
        ops.fetch_add(1, Ordering::Relaxed);
        i += 1;
    }
    report
}

/// A field of /proc/<pid>/status in KiB (VmRSS, VmHWM).
pub fn proc_status_kib(pid: Option<u32>, field: &str) -> Option<u64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/status"),
        None => "/proc/self/status".to_string(),
    };
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Samples VmRSS every few milliseconds on a thread and keeps the peak.
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    peak_kib: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl RssSampler {
    pub fn start(pid: Option<u32>) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak_kib = Arc::new(AtomicU64::new(proc_status_kib(pid, "VmRSS:").unwrap_or(0)));
        let (s, p) = (stop.clone(), peak_kib.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Acquire) {
                if let Some(kib) = proc_status_kib(pid, "VmRSS:") {
                    p.fetch_max(kib, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(3));
            }
        });
        RssSampler {
            stop,
            peak_kib,
            thread: Some(thread),
        }
    }

    pub fn peak_kib(&self) -> u64 {
        self.peak_kib.load(Ordering::Relaxed)
    }

    pub fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _unused = t.join();
        }
        self.peak_kib()
    }
}

// ---- attacks on the TCPStore server -------------------------------------------------

/// `conns` connections each sending `bytes` random bytes (half after a VALIDATE).
pub fn random_bytes(addr: SocketAddr, conns: usize, bytes: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    for i in 0..conns {
        let Ok(mut s) = (if i % 2 == 0 {
            raw(addr)
        } else {
            attacker_connect(addr)
        }) else {
            continue;
        };
        let mut buf = vec![0u8; bytes];
        rng.fill(&mut buf);
        let _unused = s.write_all(&buf);
        let _unused = closed_within(&mut s, Duration::from_millis(500));
    }
}

/// Requests announcing huge lengths and counts, with nothing after them; returns the
/// connections (the server must close them: over a limit at once, or under the limit
/// at the request deadline).
pub fn huge_length_prefixes(addr: SocketAddr, under_limit_len: u64) -> Vec<TcpStream> {
    let mut held = Vec::new();
    let mut requests: Vec<Vec<u8>> = Vec::new();
    for len in [1u64 << 60, u64::MAX, under_limit_len] {
        let mut set = vec![proto::op::SET];
        proto::put_bytes(&mut set, b"/huge");
        proto::put_u64(&mut set, len);
        requests.push(set);
        let mut key = vec![proto::op::GET];
        proto::put_u64(&mut key, len);
        requests.push(key);
        let mut wait = vec![proto::op::WAIT];
        proto::put_u64(&mut wait, len);
        requests.push(wait);
        let mut mset = vec![proto::op::MULTI_SET];
        proto::put_u64(&mut mset, len);
        requests.push(mset);
    }
    for r in requests {
        if let Ok(mut s) = raw(addr) {
            let _unused = s.write_all(&r);
            held.push(s);
        }
    }
    held
}

/// `n` connections that connect (and, with `validate`, send VALIDATE) and then send
/// nothing.
pub fn idle_connections(addr: SocketAddr, n: usize, validate: bool) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|_| {
            if validate {
                raw(addr).ok()
            } else {
                attacker_connect(addr).ok()
            }
        })
        .collect()
}

/// A SET of a `len`-byte value sent one byte per `interval`; returns how many bytes
/// went out before the server closed the connection (`len` + header if it never did).
pub fn slow_sender(addr: SocketAddr, len: usize, interval: Duration) -> usize {
    let Ok(mut s) = raw(addr) else {
        return 0;
    };
    let mut req = vec![proto::op::SET];
    proto::put_bytes(&mut req, b"/slow");
    proto::put_bytes(&mut req, &vec![b's'; len]);
    let _unused = s.set_nonblocking(true);
    for (i, b) in req.iter().enumerate() {
        if s.write_all(std::slice::from_ref(b)).is_err() {
            return i;
        }
        std::thread::sleep(interval);
        let mut probe = [0u8; 1];
        match s.read(&mut probe) {
            Ok(0) => return i + 1,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            _ => return i + 1,
        }
    }
    req.len()
}

/// APPEND `chunk` bytes to one key `rounds` times, reconnecting whenever the server
/// closes the connection (over the value or store limit); returns the closes.
pub fn append_loop(addr: SocketAddr, chunk: usize, rounds: usize) -> usize {
    let mut closes = 0;
    let mut s = raw(addr).ok();
    let mut req = vec![proto::op::APPEND];
    proto::put_bytes(&mut req, b"/append");
    proto::put_bytes(&mut req, &vec![b'a'; chunk]);
    for _ in 0..rounds {
        let ok = s.as_mut().is_some_and(|c| c.write_all(&req).is_ok());
        if !ok {
            closes += 1;
            s = raw(addr).ok();
        }
        // APPEND has no reply: a PING now and then keeps us in step with the server.
        if let Some(c) = s.as_mut() {
            let mut ping = vec![proto::op::PING];
            ping.extend_from_slice(&7u32.to_le_bytes());
            let mut echo = [0u8; 4];
            if c.write_all(&ping).is_err() || c.read_exact(&mut echo).is_err() {
                closes += 1;
                s = raw(addr).ok();
            }
        }
    }
    closes
}

/// A WAIT on `n` distinct missing keys; returns the connection, parked.
pub fn wait_many_keys(addr: SocketAddr, n: usize, tag: &str) -> Option<TcpStream> {
    let mut s = raw(addr).ok()?;
    let mut req = vec![proto::op::WAIT];
    proto::put_u64(&mut req, n as u64);
    for i in 0..n {
        proto::put_bytes(&mut req, format!("/never/{tag}/{i}").as_bytes());
    }
    s.write_all(&req).ok()?;
    Some(s)
}

/// SET `key` to `value_len` bytes, then MULTI_GET naming it `times` times; returns
/// whether the server answered (with the whole reply) rather than closing.
pub fn multi_get_same(addr: SocketAddr, key: &[u8], value_len: usize, times: usize) -> bool {
    let Ok(mut s) = raw(addr) else {
        return false;
    };
    let mut set = vec![proto::op::SET];
    proto::put_bytes(&mut set, key);
    proto::put_bytes(&mut set, &vec![b'm'; value_len]);
    let mut req = vec![proto::op::MULTI_GET];
    proto::put_u64(&mut req, times as u64);
    for _ in 0..times {
        proto::put_bytes(&mut req, key);
    }
    if s.write_all(&set).is_err() || s.write_all(&req).is_err() {
        return false;
    }
    let _unused = s.set_read_timeout(Some(Duration::from_secs(10)));
    let want = (8 + value_len) as u64 * times as u64;
    let mut got = 0u64;
    let mut buf = vec![0u8; 1 << 16];
    while got < want {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return false,
            Ok(n) => got += n as u64,
        }
    }
    true
}

/// Close every connection in `held` (both directions).
pub fn drop_all(held: Vec<TcpStream>) {
    for s in held {
        let _unused = s.shutdown(Shutdown::Both);
    }
}

// ---- attacks on the P2P listener ------------------------------------------------------

/// A P2P hello without authentication (magic, version 1, auth 0, nonce).
pub fn p2p_hello() -> Vec<u8> {
    let mut h = b"FRYX".to_vec();
    h.push(1);
    h.push(0);
    h.extend_from_slice(&[9u8; 16]);
    h
}

/// `n` connections trickling their hello one byte per `interval`, on threads; returns
/// the threads (each yields the bytes it got out before the listener closed it).
pub fn p2p_trickle(addr: SocketAddr, n: usize, interval: Duration) -> Vec<JoinHandle<usize>> {
    (0..n)
        .map(|_| {
            std::thread::spawn(move || {
                let Ok(mut s) = attacker_connect(addr) else {
                    return 0;
                };
                let hello = p2p_hello();
                for (i, b) in hello.iter().enumerate() {
                    if s.write_all(std::slice::from_ref(b)).is_err() {
                        return i;
                    }
                    std::thread::sleep(interval);
                }
                hello.len()
            })
        })
        .collect()
}

/// `n` connections that send a hello and a frame header announcing `len` bytes, then
/// `send` bytes of payload; returns the connections.
pub fn p2p_big_frames(addr: SocketAddr, n: usize, len: u32, send: usize) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|_| {
            let mut s = attacker_connect(addr).ok()?;
            s.set_write_timeout(Some(Duration::from_secs(10))).ok()?;
            s.write_all(&p2p_hello()).ok()?;
            let mut f = len.to_le_bytes().to_vec();
            // kind Load, seq 0, name "x", label "y".
            f.push(1);
            f.extend_from_slice(&0u64.to_le_bytes());
            f.extend_from_slice(&[1, b'x', 1, b'y']);
            s.write_all(&f).ok()?;
            let chunk = vec![0u8; 1 << 16];
            let mut left = send;
            while left > 0 {
                let k = left.min(chunk.len());
                if s.write_all(&chunk[..k]).is_err() {
                    break;
                }
                left -= k;
            }
            Some(s)
        })
        .collect()
}
