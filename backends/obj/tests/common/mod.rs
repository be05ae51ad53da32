//! What the OBJ tests share: a moto S3 server of their own, a fault-injecting HTTP
//! proxy, DRAM buffers, and a completion wait with a deadline.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_backend_api::{
    effective_params, Backend, Completion, Completions, Endpoint, MemKind, Op, Params, Post, Range,
    RegionSpec,
};
use ferry_obj::{ObjBackend, PARAMS};

/// A moto S3 server on a free 127.0.0.1 port, killed (by pid) on drop.
// Reason: not every test binary that includes this module starts one.
#[allow(unused_imports)]
pub use ferry_testkit::moto::Moto;

/// Effective OBJ parameters for `endpoint` and `bucket`, with `extra` over them.
pub fn params(endpoint: &str, bucket: &str, extra: &[(&str, &str)]) -> Params {
    let mut given = Params::new();
    given.insert("endpoint_override".into(), endpoint.into());
    given.insert("bucket".into(), bucket.into());
    given.insert("access_key".into(), "testing".into());
    given.insert("secret_key".into(), "testing".into());
    given.insert("retries".into(), "2".into());
    given.insert("backoff_initial_ms".into(), "10".into());
    given.insert("request_timeout_ms".into(), "10000".into());
    for (k, v) in extra {
        given.insert((*k).into(), (*v).into());
    }
    effective_params(ferry_obj::NAME, PARAMS, &given).expect("params")
}

pub fn backend(endpoint: &str, bucket: &str, extra: &[(&str, &str)]) -> ObjBackend {
    ObjBackend::new(params(endpoint, bucket, extra)).expect("OBJ backend")
}

/// Register an OBJECT region named `name` (offset `addr`, `len` bytes, 0 = unbounded).
pub fn object(b: &mut ObjBackend, name: &str, addr: u64, len: u64) -> u64 {
    let path = std::path::Path::new(name);
    // SAFETY: an OBJECT region names no memory.
    unsafe {
        b.register(&RegionSpec {
            kind: MemKind::Object,
            desc: ferry_backend_api::Desc::new(addr, len, 0),
            path: Some((path, Default::default())),
        })
    }
    .expect("register object")
    .token
}

/// Post one request of `ranges` ((local slice address, object offset, len, token)) and
/// wait for its completion (panics after `limit`: a hang).
pub fn transfer(
    b: &mut ObjBackend,
    op: Op,
    ranges: &[(u64, u64, u64, u64)],
    limit: Duration,
) -> Completion {
    let ranges: Vec<Range> = ranges
        .iter()
        .map(|&(local, remote, len, token)| Range {
            local_addr: local,
            remote_addr: remote,
            len,
            remote_token: token,
            ..Range::default()
        })
        .collect();
    let post = Post {
        tag: 7,
        op,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::Object,
        ranges: &ranges,
        notif: None,
    };
    let mut done = Completions::with_capacity(4);
    // SAFETY: the ranges' local addresses lie in buffers the caller keeps alive until
    // this function returns, which is after the completion arrived.
    unsafe { b.post(Endpoint::Local, &[post], &mut done) }.expect("post");
    let deadline = Instant::now() + limit;
    while done.is_empty() {
        assert!(
            Instant::now() < deadline,
            "no completion within {limit:?}: the transfer hangs"
        );
        b.progress(&mut done);
        std::thread::sleep(Duration::from_millis(1));
    }
    done.as_slice()[0]
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = ferry_testkit::Rng::new(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

pub fn addr(v: &[u8]) -> u64 {
    v.as_ptr() as u64
}

/// What the fault proxy does with each request.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// Answer every request with this status and S3 error code.
    Always(u16, &'static str),
    /// Answer the first `n` requests with the status and code, forward the rest.
    First(usize, u16, &'static str),
    /// Forward requests, but cut the connection after `n` bytes of a reply body
    /// longer than that (a server that dies mid-transfer), and refuse every later
    /// request the same way.
    CutAfter(usize),
}

/// A tiny HTTP/1.1 proxy in front of `upstream` that injects faults.
pub struct FaultProxy {
    pub addr: SocketAddr,
    pub requests: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl FaultProxy {
    pub fn start(fault: Fault, upstream: Option<u16>) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let requests = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (requests.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let r = r.clone();
                std::thread::spawn(move || serve(conn, fault, upstream, &r));
            }
        });
        FaultProxy {
            addr,
            requests,
            stop,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr);
    }
}

/// Read one HTTP message head (through the blank line).
fn read_head(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
        if head.len() > 64 * 1024 {
            return None;
        }
    }
    Some(head)
}

fn content_length(head: &[u8]) -> usize {
    let text = String::from_utf8_lossy(head);
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())
                .flatten()
        })
        .unwrap_or(0)
}

fn serve(mut client: TcpStream, fault: Fault, upstream: Option<u16>, requests: &AtomicUsize) {
    loop {
        let Some(head) = read_head(&mut client) else {
            return;
        };
        let mut body = vec![0u8; content_length(&head)];
        if client.read_exact(&mut body).is_err() {
            return;
        }
        let n = requests.fetch_add(1, Ordering::SeqCst);
        let inject = match fault {
            Fault::Always(status, code) => Some((status, code)),
            Fault::First(count, status, code) if n < count => Some((status, code)),
            _ => None,
        };
        if let Some((status, code)) = inject {
            let xml = format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>injected</Message></Error>"
            );
            let reason = match status {
                403 => "Forbidden",
                404 => "Not Found",
                429 => "Too Many Requests",
                500 => "Internal Server Error",
                503 => "Service Unavailable",
                _ => "Error",
            };
            let reply = format!(
                "HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\r\n{xml}",
                xml.len()
            );
            if client.write_all(reply.as_bytes()).is_err() {
                return;
            }
            continue;
        }
        let cut = match fault {
            Fault::CutAfter(bytes) => Some(bytes),
            _ => None,
        };
        let Some(port) = upstream else { return };
        let Ok(mut up) = TcpStream::connect(("127.0.0.1", port)) else {
            return;
        };
        if up
            .write_all(&head)
            .and_then(|_| up.write_all(&body))
            .is_err()
        {
            return;
        }
        let Some(reply_head) = read_head(&mut up) else {
            return;
        };
        let is_head = head.starts_with(b"HEAD ");
        let len = if is_head {
            0
        } else {
            content_length(&reply_head)
        };
        if client.write_all(&reply_head).is_err() {
            return;
        }
        let mut left = len;
        let mut sent = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        while left > 0 {
            let want = buf.len().min(left);
            let Ok(got) = up.read(&mut buf[..want]) else {
                return;
            };
            if got == 0 {
                return;
            }
            let mut chunk = &buf[..got];
            if let Some(limit) = cut {
                if sent + got > limit {
                    chunk = &buf[..limit - sent];
                    let _ = client.write_all(chunk);
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    return;
                }
            }
            if client.write_all(chunk).is_err() {
                return;
            }
            sent += got;
            left -= got;
        }
    }
}
