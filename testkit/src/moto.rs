//! A moto S3 server (`moto_server` from `moto[server]`, which `tools/test.sh` installs
//! and names in `FERRY_TEST_MOTO_SERVER`) on a free loopback port, for the tests of the
//! OBJ backend and of `ferry bench xfer --backend obj`. Killed (by its pid) on drop.
//!
//! Ready means it answered an HTTP request, not only that the port accepts
//! connections: between picking a free port and moto binding it, another listener can
//! take the port (moto then exits), and a connect can succeed before moto serves.
//! A moto that exits before it is ready is started again on another port.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long one moto may take to answer before the start fails.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// Ports tried when moto exits before it is ready (its port was taken).
const PORT_TRIES: usize = 3;

/// A running moto server.
pub struct Moto {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

impl Moto {
    /// Start one from `FERRY_TEST_MOTO_SERVER`; `None` (after [`crate::ci::skip`]:
    /// a failure under `CI=true`) when it is not set.
    pub fn start() -> Option<Moto> {
        let Ok(bin) = std::env::var("FERRY_TEST_MOTO_SERVER") else {
            crate::ci::skip(
                "moto S3 server",
                "FERRY_TEST_MOTO_SERVER is not set (tools/test.sh installs moto[server] and sets it)",
            );
            return None;
        };
        for _ in 0..PORT_TRIES {
            let port = free_port();
            let child = Command::new(&bin)
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
            let mut moto = Moto { child, port };
            if moto.wait_ready() {
                return Some(moto);
            }
        }
        panic!("moto ({bin}) exited before it served, on {PORT_TRIES} free ports");
    }

    /// Wait until moto answers a request: true, or false if it exited first (its
    /// port was taken). Panics if it does neither within [`READY_WITHIN`].
    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return false;
            }
            if self.request("GET", "/").starts_with("HTTP/1.") {
                return true;
            }
            assert!(
                Instant::now() < deadline,
                "moto did not answer on 127.0.0.1:{} within {READY_WITHIN:?}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Create `bucket` (moto takes unsigned requests).
    pub fn create_bucket(&self, bucket: &str) {
        let status = self.request("PUT", &format!("/{bucket}"));
        assert!(
            status.starts_with("HTTP/1.1 200") || status.starts_with("HTTP/1.0 200"),
            "creating bucket '{bucket}': {status:?}"
        );
    }

    /// One request without a body; the status line of the reply ("" if there was none
    /// or the connection failed).
    pub fn request(&self, method: &str, path: &str) -> String {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return String::new();
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
        let sent = write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        );
        if sent.is_err() {
            return String::new();
        }
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        reply.lines().next().unwrap_or("").to_string()
    }

    /// Kill the server now.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.kill();
    }
}
