//! A blocking client of the TCPStore protocol with a timeout on every operation.
//!
//! Keys are sent as given: torch's `TCPStore` prepends `/` to user keys, so to share a
//! key `k` with torch code use [`user_key`]. After any error the client is broken
//! (the stream may be out of step) and must be replaced by a new connection.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use ferry_storage::Error;

use super::proto::{self, op};
use crate::stream::{Stream, TlsContext};
use crate::util::{connect, io_error, nonzero};

const BACKEND: &str = "tcpstore";

/// The wire key torch's `TCPStore` uses for user key `key` (`/` prepended).
pub fn user_key(key: &str) -> String {
    format!("/{key}")
}

/// Connection options.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Bound on connect and on every read and write (WAIT has its own deadline).
    pub io_timeout: Duration,
    /// Send PING after VALIDATE (torch >= 2.5; servers of 2.2-2.4 close on it).
    pub ping: bool,
    /// Largest value accepted in a reply.
    pub max_value_bytes: usize,
    /// Mutual TLS to the server (cargo feature `tls`; the server must use it too).
    pub tls: Option<TlsContext>,
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            io_timeout: Duration::from_secs(5),
            ping: true,
            max_value_bytes: 256 << 20,
            tls: None,
        }
    }
}

/// One connection to a TCPStore server. One request in flight at a time.
pub struct TcpStoreClient {
    stream: Stream,
    endpoint: String,
    options: ClientOptions,
    request: Vec<u8>,
    broken: bool,
}

impl TcpStoreClient {
    /// Connect to `endpoint` (`HOST:PORT`) and do the handshake (VALIDATE, then PING
    /// if enabled).
    pub fn connect(endpoint: &str, options: ClientOptions) -> Result<TcpStoreClient, Error> {
        let sock = connect(BACKEND, endpoint, options.io_timeout)?;
        let stream = match &options.tls {
            None => Stream::Plain(sock),
            Some(tls) => {
                let host = endpoint.rsplit_once(':').map_or(endpoint, |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                tls.connect(sock, host)
                    .map_err(|e| io_error(BACKEND, format_args!("TLS to {endpoint}"), &e))?
            }
        };
        Self::handshake(stream, endpoint.to_owned(), options)
    }

    /// Do the handshake on a stream connected by the caller (bound to a source address,
    /// say); it gets `TCP_NODELAY` and the I/O timeout.
    pub fn from_stream(stream: TcpStream, options: ClientOptions) -> Result<TcpStoreClient, Error> {
        let stream = Stream::Plain(stream);
        let endpoint = stream
            .peer_addr()
            .map_or_else(|_| "?".to_owned(), |a| a.to_string());
        crate::util::configure(stream.socket(), options.io_timeout)
            .map_err(|e| io_error(BACKEND, format_args!("configuring {endpoint}"), &e))?;
        Self::handshake(stream, endpoint, options)
    }

    fn handshake(
        stream: Stream,
        endpoint: String,
        options: ClientOptions,
    ) -> Result<TcpStoreClient, Error> {
        let mut client = TcpStoreClient {
            stream,
            endpoint,
            options,
            request: Vec::with_capacity(256),
            broken: false,
        };
        client.begin(op::VALIDATE);
        client
            .request
            .extend_from_slice(&proto::VALIDATE_MAGIC.to_le_bytes());
        client.send("VALIDATE")?;
        if client.options.ping {
            let nonce = std::process::id();
            client.begin(op::PING);
            client.request.extend_from_slice(&nonce.to_le_bytes());
            client.send("PING")?;
            let echo = client.read("PING", proto::read_u32)?;
            if echo != nonce {
                client.broken = true;
                return Err(Error::backend(
                    BACKEND,
                    format!(
                        "PING to {}: echo {echo:#x} differs from nonce {nonce:#x}",
                        client.endpoint
                    ),
                ));
            }
        }
        Ok(client)
    }

    /// The server's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.stream.peer_addr().ok()
    }

    /// The connection itself, after the handshake, for a caller that speaks the
    /// protocol on its own (it has `TCP_NODELAY` and the I/O timeout on reads and
    /// writes).
    pub fn into_stream(self) -> Stream {
        self.stream
    }

    /// Whether an earlier error left this connection unusable.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// SET `key` to `value` (wakes waiters).
    pub fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), Error> {
        self.begin(op::SET);
        proto::put_bytes(&mut self.request, key);
        proto::put_bytes(&mut self.request, value);
        self.send("SET")
    }

    /// GET `key` without waiting: an empty vector for a missing key on libuv servers and
    /// Ferry's; a closed connection on torch's legacy server. Prefer [`Self::wait`] first.
    pub fn get(&mut self, key: &[u8]) -> Result<Vec<u8>, Error> {
        self.begin(op::GET);
        proto::put_bytes(&mut self.request, key);
        self.send("GET")?;
        let max = self.options.max_value_bytes;
        self.read("GET", |r| proto::read_bytes(r, max))
    }

    /// ADD `delta` to the number stored at `key`; returns the new value.
    pub fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, Error> {
        self.begin(op::ADD);
        proto::put_bytes(&mut self.request, key);
        proto::put_i64(&mut self.request, delta);
        self.send("ADD")?;
        self.read("ADD", proto::read_i64)
    }

    /// CHECK: whether every key exists now.
    pub fn check(&mut self, keys: &[&[u8]]) -> Result<bool, Error> {
        self.begin(op::CHECK);
        self.put_keys(keys);
        self.send("CHECK")?;
        match self.read("CHECK", proto::read_u8)? {
            proto::READY => Ok(true),
            proto::NOT_READY => Ok(false),
            other => Err(self.protocol("CHECK", format!("reply byte {other}"))),
        }
    }

    /// WAIT until every key exists or `timeout` passes; `Ok(false)` on timeout (the
    /// wait is canceled on the server and the connection stays usable).
    pub fn wait(&mut self, keys: &[&[u8]], timeout: Duration) -> Result<bool, Error> {
        self.begin(op::WAIT);
        self.put_keys(keys);
        self.send("WAIT")?;
        self.await_parked("WAIT", timeout)
    }

    /// The reply of a parked request (WAIT, BARRIER): `STOP_WAITING` within `timeout`,
    /// else the cancel sequence; returns whether it came.
    fn await_parked(&mut self, what: &'static str, timeout: Duration) -> Result<bool, Error> {
        let deadline = crate::util::deadline_after(Instant::now(), timeout);
        // The kernel's receive timeout counts in scheduler ticks and can fire a tick
        // before the deadline: read again for what is left, so a wait never returns
        // before its timeout.
        let reply = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            self.read_timeout(what, left, "setting the deadline")?;
            let reply = proto::read_u8(&mut self.stream);
            let early =
                matches!(&reply, Err(e) if crate::util::is_timeout(e)) && Instant::now() < deadline;
            if !early {
                break reply;
            }
        };
        self.read_timeout(what, self.options.io_timeout, "restoring the timeout")?;
        match reply {
            Ok(proto::STOP_WAITING) => Ok(true),
            Ok(other) => Err(self.protocol(what, format!("reply byte {other}"))),
            Err(e) if crate::util::is_timeout(&e) => self.cancel_wait(),
            Err(e) => {
                self.broken = true;
                Err(io_error(
                    BACKEND,
                    format_args!("{what} on {}", self.endpoint),
                    &e,
                ))
            }
        }
    }

    /// Set the socket's receive timeout; a failure breaks the connection.
    fn read_timeout(
        &mut self,
        what: &'static str,
        timeout: Duration,
        doing: &str,
    ) -> Result<(), Error> {
        self.stream
            .set_read_timeout(Some(nonzero(timeout)))
            .map_err(|e| {
                self.broken = true;
                io_error(BACKEND, format_args!("{what}: {doing}"), &e)
            })
    }

    /// MULTI_GET without waiting: the values of `keys`, in order (a missing key gives an
    /// empty vector on libuv servers and Ferry's; torch's legacy server closes the
    /// connection). torch's `multi_get` is [`Self::wait`] then this:
    /// [`Self::multi_get_wait`].
    pub fn multi_get(&mut self, keys: &[&[u8]]) -> Result<Vec<Vec<u8>>, Error> {
        self.begin(op::MULTI_GET);
        self.put_keys(keys);
        self.send("MULTI_GET")?;
        let max = self.options.max_value_bytes;
        let n = keys.len();
        self.read("MULTI_GET", |r| {
            (0..n).map(|_| proto::read_bytes(r, max)).collect()
        })
    }

    /// torch's `multi_get`: WAIT for every key (up to `timeout`), then MULTI_GET;
    /// `Ok(None)` when they did not all appear in time.
    pub fn multi_get_wait(
        &mut self,
        keys: &[&[u8]],
        timeout: Duration,
    ) -> Result<Option<Vec<Vec<u8>>>, Error> {
        if !self.wait(keys, timeout)? {
            return Ok(None);
        }
        self.multi_get(keys).map(Some)
    }

    /// MULTI_SET: set every `(key, value)` (one request, no reply; wakes waiters).
    pub fn multi_set(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), Error> {
        self.begin(op::MULTI_SET);
        proto::put_u64(&mut self.request, pairs.len() as u64);
        for (key, value) in pairs {
            proto::put_bytes(&mut self.request, key);
            proto::put_bytes(&mut self.request, value);
        }
        self.send("MULTI_SET")
    }

    /// APPEND `value` to the value at `key` (created if missing; no reply).
    pub fn append(&mut self, key: &[u8], value: &[u8]) -> Result<(), Error> {
        self.begin(op::APPEND);
        proto::put_bytes(&mut self.request, key);
        proto::put_bytes(&mut self.request, value);
        self.send("APPEND")
    }

    /// QUEUE_PUSH `value` onto the queue at `key` (no reply; wakes one waiter). libuv
    /// servers (torch >= 2.8) and Ferry's; the legacy server closes the connection.
    pub fn queue_push(&mut self, key: &[u8], value: &[u8]) -> Result<(), Error> {
        self.begin(op::QUEUE_PUSH);
        proto::put_bytes(&mut self.request, key);
        proto::put_bytes(&mut self.request, value);
        self.send("QUEUE_PUSH")
    }

    /// QUEUE_POP without waiting: the front value, or `None` when the queue is empty.
    pub fn queue_pop(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        self.begin(op::QUEUE_POP);
        proto::put_bytes(&mut self.request, key);
        self.send("QUEUE_POP")?;
        let max = self.options.max_value_bytes;
        self.read("QUEUE_POP", |r| {
            let len = proto::read_i64(r)?;
            if len > 0 {
                proto::read_bytes(r, max).map(Some)
            } else {
                Ok(None)
            }
        })
    }

    /// torch's `queue_pop(block=True)`: WAIT for the queue (up to `timeout`), then
    /// QUEUE_POP; `Ok(None)` when nothing came in time (or another client took it).
    pub fn queue_pop_wait(
        &mut self,
        key: &[u8],
        timeout: Duration,
    ) -> Result<Option<Vec<u8>>, Error> {
        if !self.wait(&[key], timeout)? {
            return Ok(None);
        }
        self.queue_pop(key)
    }

    /// QUEUE_LEN: how many values the queue at `key` holds.
    pub fn queue_len(&mut self, key: &[u8]) -> Result<i64, Error> {
        self.begin(op::QUEUE_LEN);
        proto::put_bytes(&mut self.request, key);
        self.send("QUEUE_LEN")?;
        self.read("QUEUE_LEN", proto::read_i64)
    }

    /// BARRIER (torch >= 2.12 servers and Ferry's): count this client in at `key` and
    /// wait until `world` clients have (up to `timeout`); `Ok(false)` on timeout (the
    /// wait is canceled; the count stays).
    pub fn barrier(&mut self, key: &[u8], world: i64, timeout: Duration) -> Result<bool, Error> {
        self.begin(op::BARRIER);
        proto::put_bytes(&mut self.request, key);
        proto::put_i64(&mut self.request, world);
        self.send("BARRIER")?;
        self.await_parked("BARRIER", timeout)
    }

    /// The barrier of torch's servers without a BARRIER op (torch's
    /// `store_based_barrier`): ADD 1 to `key`, then WAIT for `<key>/done`, which the
    /// client that brings the count to `world` sets. Returns whether all arrived
    /// within `timeout`.
    pub fn add_barrier(
        &mut self,
        key: &[u8],
        world: i64,
        timeout: Duration,
    ) -> Result<bool, Error> {
        let mut done = key.to_vec();
        done.extend_from_slice(b"/done");
        if self.add(key, 1)? >= world {
            self.set(&done, b"1")?;
        }
        self.wait(&[&done], timeout)
    }

    /// The timeout sequence: CANCEL_WAIT, then 1 (canceled) or 0 then 1 (the keys came
    /// just before the cancel). Returns whether the keys came.
    fn cancel_wait(&mut self) -> Result<bool, Error> {
        self.begin(op::CANCEL_WAIT);
        self.send("CANCEL_WAIT")?;
        match self.read("CANCEL_WAIT", proto::read_u8)? {
            proto::WAIT_CANCELED => Ok(false),
            proto::STOP_WAITING => match self.read("CANCEL_WAIT", proto::read_u8)? {
                proto::WAIT_CANCELED => Ok(true),
                other => Err(self.protocol("CANCEL_WAIT", format!("second reply byte {other}"))),
            },
            other => Err(self.protocol("CANCEL_WAIT", format!("reply byte {other}"))),
        }
    }

    /// DELETE_KEY: whether the key existed.
    pub fn delete_key(&mut self, key: &[u8]) -> Result<bool, Error> {
        self.begin(op::DELETE_KEY);
        proto::put_bytes(&mut self.request, key);
        self.send("DELETE_KEY")?;
        Ok(self.read("DELETE_KEY", proto::read_i64)? == 1)
    }

    /// GETNUMKEYS: how many keys the server holds.
    pub fn num_keys(&mut self) -> Result<i64, Error> {
        self.begin(op::GETNUMKEYS);
        self.send("GETNUMKEYS")?;
        self.read("GETNUMKEYS", proto::read_i64)
    }

    /// COMPARE_SET: replace the value at `key` with `desired` if it equals `expected`;
    /// returns the value now stored (see the protocol notes for a missing key).
    pub fn compare_set(
        &mut self,
        key: &[u8],
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, Error> {
        self.begin(op::COMPARE_SET);
        proto::put_bytes(&mut self.request, key);
        proto::put_bytes(&mut self.request, expected);
        proto::put_bytes(&mut self.request, desired);
        self.send("COMPARE_SET")?;
        let max = self.options.max_value_bytes;
        self.read("COMPARE_SET", |r| proto::read_bytes(r, max))
    }

    /// LIST_KEYS (torch >= 2.10 servers and Ferry's): every key the server holds, raw
    /// (torch's `/` prefix included), at most `max_keys` of them and each at most the
    /// value limit long; a longer reply is an error.
    pub fn list_keys(&mut self, max_keys: usize) -> Result<Vec<Vec<u8>>, Error> {
        self.begin(op::LIST_KEYS);
        self.send("LIST_KEYS")?;
        let max = self.options.max_value_bytes;
        self.read("LIST_KEYS", |r| {
            let n = proto::read_i64(r)?;
            if n < 0 || n as u64 > max_keys as u64 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("key count {n} is outside 0..={max_keys}"),
                ));
            }
            (0..n).map(|_| proto::read_bytes(r, max)).collect()
        })
    }

    fn begin(&mut self, opcode: u8) {
        self.request.clear();
        self.request.push(opcode);
    }

    fn put_keys(&mut self, keys: &[&[u8]]) {
        proto::put_u64(&mut self.request, keys.len() as u64);
        for key in keys {
            proto::put_bytes(&mut self.request, key);
        }
    }

    /// Write the request being built, whole.
    fn send(&mut self, what: &'static str) -> Result<(), Error> {
        if self.broken {
            return Err(Error::backend(
                BACKEND,
                format!(
                    "{what} to {}: connection is broken by an earlier error",
                    self.endpoint
                ),
            ));
        }
        if let Err(e) = self.stream.write_all(&self.request) {
            self.broken = true;
            return Err(io_error(
                BACKEND,
                format_args!("{what} to {}", self.endpoint),
                &e,
            ));
        }
        Ok(())
    }

    fn read<T>(
        &mut self,
        what: &'static str,
        f: impl FnOnce(&mut Stream) -> std::io::Result<T>,
    ) -> Result<T, Error> {
        f(&mut self.stream).map_err(|e| {
            self.broken = true;
            io_error(
                BACKEND,
                format_args!("{what} reply from {}", self.endpoint),
                &e,
            )
        })
    }

    fn protocol(&mut self, what: &'static str, detail: String) -> Error {
        self.broken = true;
        Error::backend(
            BACKEND,
            format!("{what} to {}: protocol error: {detail}", self.endpoint),
        )
    }
}
