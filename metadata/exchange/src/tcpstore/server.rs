//! Ferry's own TCPStore server: the server side of the c10d TCPStore protocol, so a
//! deployment needs neither torch nor etcd for name-based discovery. It interoperates
//! with torch's `TCPStore` clients (torch >= 2.2).
//!
//! Connections are served by the shared connection-server core
//! ([`crate::conn_server`]): at most `max_connections`, each request whole within
//! `request_timeout` of its first byte, idle connections closed after `idle_timeout`,
//! parked WAITs after `park_timeout`. Requests are read into a per-connection buffer
//! that grows only as bytes arrive (a length prefix reserves nothing) and parsed by the
//! pure [`super::proto::parse_request`]; every buffer counts against one budget of the
//! whole server (`max_buffered_bytes`).
//!
//! The store enforces its own limits (keys, bytes, value size, reply size, parked
//! waiters); a request over any limit closes its connection, as torch's libuv server
//! does, and every other client goes on. Work under the store lock is bounded by the
//! request's size: replies are checked for size before they are built, values and keys
//! are shared (`Arc`) so a reply copies no value under the lock, and waiters are
//! indexed by key, so a write wakes only the waiters of the key it changed.
//!
//! A WAIT whose keys are missing registers a waiter and the connection goes on reading
//! (the next request may be CANCEL_WAIT); the thread whose write satisfies the waiter
//! sends its `STOP_WAITING` byte. Every write to a connection happens under that
//! connection's writer lock, taken while the store lock is held, so a wake-up and a
//! CANCEL_WAIT reply always leave in the order of events.
//!
//! Deliberately absent: persistence, authentication (like torch's server; bind it to
//! loopback or a private network), the pre-2.2 opcode numbering.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ferry_storage::{Error, Subject};

use super::proto::{self, parse_request, ParseError, Parsed, Request, RequestLimits};
use crate::conn_server::{ByteBudget, ConnCtx, ConnLimits, ConnServer, ConnStats};
use crate::stream::{Stream, TlsConfig, TlsContext};
use crate::util::lock;

const BACKEND: &str = "tcpstore-server";
/// Values up to this size are copied into the reply; larger ones are written from the
/// store's shared buffer.
const INLINE_VALUE_MAX_BYTES: usize = 16 << 10;
/// Bytes a connection's request buffer grows by at least, and reads at most at once.
const READ_CHUNK_BYTES: usize = 16 << 10;
/// A request buffer larger than this is given back once its request is served.
const KEEP_BUFFER_BYTES: usize = 64 << 10;
/// Keys of a WAIT indexed (or un-indexed) per store-lock hold.
const WAIT_CHUNK_KEYS: usize = 1024;
/// Bookkeeping bytes counted per stored key or queued value on top of its bytes.
const ENTRY_OVERHEAD_BYTES: usize = 64;

/// Limits of the server. Every one can also be set from the environment
/// ([`ServerConfig::with_overrides`]); the crate README has the table.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Most connections served at once; at the limit a new connection takes the slot of
    /// the one idle the longest, or is closed at once when all are busy.
    pub max_connections: usize,
    /// Most connections from one source IP address; past it a new one is closed at
    /// once (it evicts nobody).
    pub max_connections_per_source: usize,
    /// Mutual TLS (cargo feature `tls`): every client must use it too.
    pub tls: Option<TlsConfig>,
    /// A connection with no request in progress is closed after this long.
    pub idle_timeout: Duration,
    /// Once a request's first byte arrived, the whole request must arrive within this.
    pub request_timeout: Duration,
    /// A connection parked on a WAIT or BARRIER is closed after this long.
    pub park_timeout: Duration,
    /// Bound on every write to a client.
    pub write_timeout: Duration,
    /// Longest key, in bytes.
    pub max_key_bytes: usize,
    /// Longest value (after APPEND too), in bytes.
    pub max_value_bytes: usize,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET request.
    pub max_keys_per_request: usize,
    /// Longest request, in bytes.
    pub max_request_bytes: usize,
    /// All connections' request buffers together, in bytes.
    pub max_buffered_bytes: usize,
    /// Most keys in the store (queues count as keys).
    pub max_keys: usize,
    /// Most bytes in the store: keys, values and queued values, plus 64 bytes each.
    pub max_total_bytes: usize,
    /// Largest MULTI_GET or LIST_KEYS reply, in bytes.
    pub max_reply_bytes: usize,
    /// Most parked WAITs and BARRIERs.
    pub max_waiters: usize,
    /// Most missing keys all parked WAITs wait for together.
    pub max_waiting_keys: usize,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            max_connections: 1024,
            max_connections_per_source: 256,
            tls: None,
            idle_timeout: Duration::from_secs(600),
            request_timeout: Duration::from_secs(30),
            park_timeout: Duration::from_secs(3600),
            write_timeout: Duration::from_secs(10),
            max_key_bytes: 64 << 10,
            max_value_bytes: 64 << 20,
            max_keys_per_request: 131_072,
            max_request_bytes: 128 << 20,
            max_buffered_bytes: 512 << 20,
            max_keys: 1 << 20,
            max_total_bytes: 1 << 30,
            max_reply_bytes: 64 << 20,
            max_waiters: 1024,
            max_waiting_keys: 1 << 20,
        }
    }
}

/// The environment variables of [`ServerConfig`]: name, field, whether it is in ms.
const ENV_VARS: &[(&str, &str, bool)] = &[
    ("FERRY_TCPSTORE_MAX_CONNECTIONS", "max_connections", false),
    (
        "FERRY_TCPSTORE_MAX_CONNECTIONS_PER_SOURCE",
        "max_connections_per_source",
        false,
    ),
    ("FERRY_TCPSTORE_IDLE_TIMEOUT_MS", "idle_timeout", true),
    ("FERRY_TCPSTORE_REQUEST_TIMEOUT_MS", "request_timeout", true),
    ("FERRY_TCPSTORE_PARK_TIMEOUT_MS", "park_timeout", true),
    ("FERRY_TCPSTORE_WRITE_TIMEOUT_MS", "write_timeout", true),
    ("FERRY_TCPSTORE_MAX_KEY_BYTES", "max_key_bytes", false),
    ("FERRY_TCPSTORE_MAX_VALUE_BYTES", "max_value_bytes", false),
    (
        "FERRY_TCPSTORE_MAX_KEYS_PER_REQUEST",
        "max_keys_per_request",
        false,
    ),
    (
        "FERRY_TCPSTORE_MAX_REQUEST_BYTES",
        "max_request_bytes",
        false,
    ),
    (
        "FERRY_TCPSTORE_MAX_BUFFERED_BYTES",
        "max_buffered_bytes",
        false,
    ),
    ("FERRY_TCPSTORE_MAX_KEYS", "max_keys", false),
    ("FERRY_TCPSTORE_MAX_TOTAL_BYTES", "max_total_bytes", false),
    ("FERRY_TCPSTORE_MAX_REPLY_BYTES", "max_reply_bytes", false),
    ("FERRY_TCPSTORE_MAX_WAITERS", "max_waiters", false),
    ("FERRY_TCPSTORE_MAX_WAITING_KEYS", "max_waiting_keys", false),
];

/// Longest timeout accepted (so deadlines never overflow): one year.
const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

impl ServerConfig {
    /// This config with the `FERRY_TCPSTORE_*` limit variables of the environment
    /// applied (see [`Self::with_overrides`]).
    pub fn with_env_overrides(self) -> Result<ServerConfig, Error> {
        self.with_overrides(|name| std::env::var(name).ok())
    }

    /// This config with overrides looked up through `var`: `FERRY_TCPSTORE_<FIELD>` for
    /// each field (`_MS` for timeouts, in milliseconds). Unset or empty variables change
    /// nothing; a value that is not a whole number, or a config that [`Self::check`]
    /// refuses, is a typed error naming the variable.
    pub fn with_overrides(
        mut self,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<ServerConfig, Error> {
        for &(name, field, is_ms) in ENV_VARS {
            let Some(v) = var(name).filter(|v| !v.trim().is_empty()) else {
                continue;
            };
            let n: u64 = v.trim().parse().map_err(|_| {
                Error::invalid(
                    Subject::Named(format!("environment variable {name}='{v}'").into()),
                    if is_ms {
                        "expected a whole number of milliseconds"
                    } else {
                        "expected a whole number"
                    },
                )
            })?;
            let d = Duration::from_millis(n);
            let u = usize::try_from(n).unwrap_or(usize::MAX);
            match field {
                "max_connections" => self.max_connections = u,
                "max_connections_per_source" => self.max_connections_per_source = u,
                "idle_timeout" => self.idle_timeout = d,
                "request_timeout" => self.request_timeout = d,
                "park_timeout" => self.park_timeout = d,
                "write_timeout" => self.write_timeout = d,
                "max_key_bytes" => self.max_key_bytes = u,
                "max_value_bytes" => self.max_value_bytes = u,
                "max_keys_per_request" => self.max_keys_per_request = u,
                "max_request_bytes" => self.max_request_bytes = u,
                "max_buffered_bytes" => self.max_buffered_bytes = u,
                "max_keys" => self.max_keys = u,
                "max_total_bytes" => self.max_total_bytes = u,
                "max_reply_bytes" => self.max_reply_bytes = u,
                "max_waiters" => self.max_waiters = u,
                _ => self.max_waiting_keys = u,
            }
            self.check().map_err(|e| {
                Error::invalid(
                    Subject::Named(format!("environment variable {name}='{v}'").into()),
                    match e {
                        Error::InvalidParam { reason, .. } => reason,
                        _ => "out of range".into(),
                    },
                )
            })?;
        }
        Ok(self)
    }

    /// Check the values: every limit above zero, timeouts at most a year, a request
    /// able to hold one key and one value, the buffer budget able to hold a request.
    pub fn check(&self) -> Result<(), Error> {
        let bad = |what: &str, reason: &'static str| {
            Err(Error::invalid(
                Subject::Named(format!("tcpstore server {what}").into()),
                reason,
            ))
        };
        for (what, d) in [
            ("idle_timeout", self.idle_timeout),
            ("request_timeout", self.request_timeout),
            ("park_timeout", self.park_timeout),
            ("write_timeout", self.write_timeout),
        ] {
            if d.is_zero() || d > MAX_TIMEOUT {
                return bad(what, "must be above zero and at most one year");
            }
        }
        for (what, n) in [
            ("max_connections", self.max_connections),
            (
                "max_connections_per_source",
                self.max_connections_per_source,
            ),
            ("max_key_bytes", self.max_key_bytes),
            ("max_keys_per_request", self.max_keys_per_request),
            ("max_keys", self.max_keys),
            ("max_waiters", self.max_waiters),
            ("max_waiting_keys", self.max_waiting_keys),
            ("max_reply_bytes", self.max_reply_bytes),
            ("max_total_bytes", self.max_total_bytes),
        ] {
            if n == 0 {
                return bad(what, "must be above zero");
            }
        }
        if self.max_connections > 1 << 20 {
            return bad("max_connections", "must be at most 1048576");
        }
        let one_set = 1 + 16usize
            .saturating_add(self.max_key_bytes)
            .saturating_add(self.max_value_bytes);
        if self.max_request_bytes < one_set {
            return bad(
                "max_request_bytes",
                "must hold a SET of the longest key and value (17 + max_key_bytes + max_value_bytes)",
            );
        }
        if self.max_buffered_bytes < self.max_request_bytes {
            return bad("max_buffered_bytes", "must be at least max_request_bytes");
        }
        Ok(())
    }

    fn request_limits(&self) -> RequestLimits {
        RequestLimits {
            max_key_bytes: self.max_key_bytes,
            max_value_bytes: self.max_value_bytes,
            max_keys_per_request: self.max_keys_per_request,
            max_request_bytes: self.max_request_bytes,
        }
    }
}

/// A running server; dropping it (or [`ServerHandle::stop`]) closes every connection and
/// joins every thread.
pub struct ServerHandle {
    server: ConnServer,
    shared: Arc<Shared>,
}

type Writer = Arc<Mutex<Stream>>;
type Value = Arc<Vec<u8>>;
type Key = Arc<[u8]>;

enum Until {
    /// `missing` of the waiter's keys are still to be set; while `registering`, more
    /// keys are being added (a chunk per store-lock hold) and the waiter cannot wake.
    Keys {
        keys: Vec<Key>,
        missing: usize,
        registering: bool,
    },
    Counter {
        key: Key,
        world: i64,
    },
}

struct Waiter {
    writer: Writer,
    ctx: Arc<ConnCtx>,
    until: Until,
}

#[derive(Default)]
struct State {
    /// Values are shared, so a GET copies nothing while it holds the store lock.
    kv: HashMap<Key, Value>,
    queues: HashMap<Key, VecDeque<Vec<u8>>>,
    /// Bytes of `kv` and `queues`, [`ENTRY_OVERHEAD_BYTES`] per key and queued value
    /// included.
    bytes: usize,
    /// Bytes of `kv`'s keys (the size of a LIST_KEYS reply, less its headers).
    kv_key_bytes: usize,
    /// Parked WAITs and BARRIERs, by connection (at most one each).
    waiters: HashMap<u64, Waiter>,
    /// Connections waiting for each key.
    by_key: HashMap<Key, Vec<u64>>,
    /// Keys the parked waiters still wait for, together.
    waiting_keys: usize,
}

struct Shared {
    config: ServerConfig,
    /// TLS on every connection, when configured.
    tls: Option<TlsContext>,
    limits: RequestLimits,
    state: Mutex<State>,
    budget: ByteBudget,
}

/// Start a server listening on `listen` (port 0: ephemeral). Bind loopback unless the
/// store must be reachable from other hosts.
pub fn serve(listen: SocketAddr, config: ServerConfig) -> Result<ServerHandle, Error> {
    config.check()?;
    let tls = crate::stream::load(config.tls.as_ref())?;
    let shared = Arc::new(Shared {
        tls,
        limits: config.request_limits(),
        budget: ByteBudget::new(config.max_buffered_bytes),
        state: Mutex::new(State::default()),
        config,
    });
    let limits = ConnLimits {
        max_connections: shared.config.max_connections,
        max_connections_per_source: shared.config.max_connections_per_source,
        idle_timeout: shared.config.idle_timeout,
        request_timeout: shared.config.request_timeout,
        park_timeout: shared.config.park_timeout,
        write_timeout: shared.config.write_timeout,
    };
    let handler_shared = shared.clone();
    let server = ConnServer::start(
        BACKEND,
        listen,
        limits,
        Arc::new(move |stream, ctx: &Arc<ConnCtx>| serve_connection(stream, ctx, &handler_shared)),
    )?;
    log::info!("tcpstore server listening on {}", server.local_addr());
    Ok(ServerHandle { server, shared })
}

impl ServerHandle {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// How many keys the store holds (queues excluded).
    pub fn num_keys(&self) -> usize {
        lock(&self.shared.state).kv.len()
    }

    /// Bytes the store holds (keys, values, queued values, 64 bytes of bookkeeping per
    /// entry), as counted against `max_total_bytes`.
    pub fn stored_bytes(&self) -> usize {
        lock(&self.shared.state).bytes
    }

    /// Parked WAITs and BARRIERs now.
    pub fn parked_waiters(&self) -> usize {
        lock(&self.shared.state).waiters.len()
    }

    /// Missing keys the parked WAITs wait for now, together (counted against
    /// `max_waiting_keys`; a WAIT registers its keys in chunks, so this grows while it
    /// registers).
    pub fn waiting_keys(&self) -> usize {
        lock(&self.shared.state).waiting_keys
    }

    /// Bytes all connections' request buffers hold now.
    pub fn buffered_bytes(&self) -> usize {
        self.shared.budget.used()
    }

    /// The connection counters.
    pub fn conn_stats(&self) -> &ConnStats {
        self.server.stats()
    }

    /// Stop serving: close the listener and every connection, join the threads.
    pub fn stop(mut self) {
        self.server.stop();
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.server.stop();
        log::info!("tcpstore server on {} stopped", self.local_addr());
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn over(what: &str, len: usize, max: usize) -> io::Error {
    bad(format!("{what} of {len} would be over the limit of {max}"))
}

fn parse_counter(v: &[u8]) -> Option<i64> {
    std::str::from_utf8(v).ok()?.parse::<i64>().ok()
}

impl State {
    fn present(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    fn num_keys(&self) -> usize {
        self.kv.len() + self.queues.len()
    }

    /// Check that storing `new_len` value bytes under `key` (replacing what is there)
    /// stays within the limits.
    fn check_store(&self, config: &ServerConfig, key: &[u8], new_len: usize) -> io::Result<()> {
        if new_len > config.max_value_bytes {
            return Err(over("value", new_len, config.max_value_bytes));
        }
        let (old, new_key) = match self.kv.get(key) {
            Some(v) => (v.len(), false),
            None => (0, true),
        };
        if new_key && self.num_keys() >= config.max_keys {
            return Err(over("key count", self.num_keys() + 1, config.max_keys));
        }
        let added = if new_key {
            key.len() + ENTRY_OVERHEAD_BYTES
        } else {
            0
        };
        let total = self.bytes - old + added + new_len;
        if total > config.max_total_bytes {
            return Err(over("stored bytes", total, config.max_total_bytes));
        }
        Ok(())
    }

    /// Store `value` under `key` (after [`Self::check_store`]).
    fn store(&mut self, key: &[u8], value: Value) {
        let new_len = value.len();
        match self.kv.get_mut(key) {
            Some(v) => {
                self.bytes = self.bytes - v.len() + new_len;
                *v = value;
            }
            None => {
                self.bytes += key.len() + ENTRY_OVERHEAD_BYTES + new_len;
                self.kv_key_bytes += key.len();
                self.kv.insert(Arc::from(key), value);
            }
        }
    }

    fn delete(&mut self, key: &[u8]) -> bool {
        match self.kv.remove(key) {
            Some(v) => {
                self.bytes -= key.len() + ENTRY_OVERHEAD_BYTES + v.len();
                self.kv_key_bytes -= key.len();
                true
            }
            None => false,
        }
    }

    fn add(&mut self, config: &ServerConfig, key: &[u8], delta: i64) -> io::Result<i64> {
        let current = match self.kv.get(key) {
            None => 0,
            Some(v) => parse_counter(v)
                .ok_or_else(|| bad("ADD on a value that is not a decimal number"))?,
        };
        let next = current.wrapping_add(delta);
        let text = next.to_string().into_bytes();
        self.check_store(config, key, text.len())?;
        self.store(key, Arc::new(text));
        Ok(next)
    }

    /// `key` was written: wake the waiters it satisfies (work proportional to the
    /// waiters of `key`), returning what to wake.
    fn written(&mut self, key: &[u8], woken: &mut Vec<(Writer, Arc<ConnCtx>)>) {
        let Some(conns) = self.by_key.get_mut(key) else {
            return;
        };
        let present =
            self.kv.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty());
        let counter = self.kv.get(key).and_then(|v| parse_counter(v));
        let mut i = 0;
        while i < conns.len() {
            let conn = conns[i];
            let Some(w) = self.waiters.get_mut(&conn) else {
                // A waiter being canceled, chunk by chunk.
                conns.swap_remove(i);
                self.waiting_keys -= 1;
                continue;
            };
            let (done, drop_entry) = match &mut w.until {
                Until::Keys {
                    missing,
                    registering,
                    ..
                } => {
                    if present {
                        *missing -= 1;
                        self.waiting_keys -= 1;
                        (*missing == 0 && !*registering, true)
                    } else {
                        (false, false)
                    }
                }
                Until::Counter { world, .. } => {
                    let done = counter.is_some_and(|n| n >= *world);
                    if done {
                        self.waiting_keys -= 1;
                    }
                    (done, done)
                }
            };
            if drop_entry {
                conns.swap_remove(i);
            } else {
                i += 1;
            }
            if done {
                if let Some(w) = self.waiters.remove(&conn) {
                    // Under the store lock, so a CANCEL_WAIT cannot slip in between.
                    w.ctx.unpark();
                    woken.push((w.writer, w.ctx));
                }
            }
        }
        if conns.is_empty() {
            self.by_key.remove(key);
        }
    }

    /// Forget the parked waiter of `conn`, if any (CANCEL_WAIT, closed connection):
    /// it can no longer wake. Returns its keys, whose index entries
    /// [`Self::unindex`] removes (a chunk per store-lock hold).
    fn cancel(&mut self, conn: u64) -> Vec<Key> {
        match self.waiters.remove(&conn).map(|w| {
            w.ctx.unpark();
            w.until
        }) {
            Some(Until::Keys { keys, .. }) => keys,
            Some(Until::Counter { key, .. }) => vec![key],
            None => Vec::new(),
        }
    }

    /// Remove `conn`'s index entries of `keys` (those not removed yet).
    fn unindex(&mut self, conn: u64, keys: &[Key]) {
        for key in keys {
            if let Entry::Occupied(mut e) = self.by_key.entry(key.clone()) {
                if let Some(i) = e.get().iter().position(|&c| c == conn) {
                    e.get_mut().swap_remove(i);
                    self.waiting_keys -= 1;
                }
                if e.get().is_empty() {
                    e.remove();
                }
            }
        }
    }

    /// Park `conn` on `until` (a counter, or keys with nothing registered yet),
    /// reserving `reserve` waited keys (given back as keys turn out present).
    fn park(
        &mut self,
        conn: u64,
        writer: &Writer,
        ctx: &Arc<ConnCtx>,
        until: Until,
        reserve: usize,
    ) {
        if let Until::Counter { key, .. } = &until {
            self.by_key.entry(key.clone()).or_default().push(conn);
        }
        self.waiting_keys += reserve;
        ctx.park();
        self.waiters.insert(
            conn,
            Waiter {
                writer: writer.clone(),
                ctx: ctx.clone(),
                until,
            },
        );
    }

    /// Index the missing keys of `chunk` for `conn`'s registering waiter, within
    /// `max_waiting_keys`.
    fn register(&mut self, config: &ServerConfig, conn: u64, chunk: &[Key]) -> io::Result<()> {
        let missing: Vec<&Key> = chunk.iter().filter(|k| !self.present(k)).collect();
        self.check_park(config, missing.len())?;
        self.waiting_keys += missing.len();
        for key in &missing {
            self.by_key.entry((*key).clone()).or_default().push(conn);
        }
        if let Some(Waiter {
            until: Until::Keys {
                keys, missing: m, ..
            },
            ..
        }) = self.waiters.get_mut(&conn)
        {
            *m += missing.len();
            keys.extend(missing.into_iter().cloned());
        }
        Ok(())
    }

    /// Registration of `conn`'s waiter is complete: true (and the waiter gone) when
    /// every key is there already.
    fn registered(&mut self, conn: u64) -> bool {
        let done = match self.waiters.get_mut(&conn) {
            Some(Waiter {
                until:
                    Until::Keys {
                        missing,
                        registering,
                        ..
                    },
                ..
            }) => {
                *registering = false;
                *missing == 0
            }
            _ => false,
        };
        if done {
            if let Some(w) = self.waiters.remove(&conn) {
                w.ctx.unpark();
            }
        }
        done
    }

    /// Room for one more parked waiter (`keys` = 0), or for `keys` more waited keys.
    fn check_park(&self, config: &ServerConfig, keys: usize) -> io::Result<()> {
        if keys == 0 && self.waiters.len() >= config.max_waiters {
            return Err(over(
                "parked waiters",
                self.waiters.len() + 1,
                config.max_waiters,
            ));
        }
        if self.waiting_keys + keys > config.max_waiting_keys {
            return Err(over(
                "keys waited for",
                self.waiting_keys + keys,
                config.max_waiting_keys,
            ));
        }
        Ok(())
    }
}

/// A reply: bytes, and large values written from the store's shared buffers.
#[derive(Default)]
struct Reply {
    head: Vec<u8>,
    /// Values to write after `head[..at]`, in order: (offset in `head`, value).
    shared: Vec<(usize, Value)>,
}

impl Reply {
    fn clear(&mut self) {
        self.head.clear();
        self.shared.clear();
    }
    fn is_empty(&self) -> bool {
        self.head.is_empty() && self.shared.is_empty()
    }
    fn bytes(&mut self, v: &[u8]) {
        proto::put_bytes(&mut self.head, v);
    }
    fn value(&mut self, v: Option<&Value>) {
        match v {
            Some(v) if v.len() > INLINE_VALUE_MAX_BYTES => {
                proto::put_u64(&mut self.head, v.len() as u64);
                self.shared.push((self.head.len(), v.clone()));
            }
            v => self.bytes(v.map(|v| &v[..]).unwrap_or_default()),
        }
    }
    fn write_to(&self, w: &mut Stream) -> io::Result<()> {
        let mut from = 0;
        for (at, v) in &self.shared {
            w.write_all(&self.head[from..*at])?;
            w.write_all(v)?;
            from = *at;
        }
        w.write_all(&self.head[from..])
    }
}

/// One connection's state.
struct Conn<'a> {
    id: u64,
    ctx: Arc<ConnCtx>,
    writer: Writer,
    shared: &'a Shared,
    reply: Reply,
}

impl Conn<'_> {
    /// Send `self.reply` (may be empty) to this connection and a `STOP_WAITING` byte to
    /// each of `woken`, taking every writer lock before the store lock is released.
    fn answer(
        &mut self,
        state: MutexGuard<'_, State>,
        woken: Vec<(Writer, Arc<ConnCtx>)>,
    ) -> io::Result<()> {
        let mut others: Vec<MutexGuard<'_, Stream>> = woken.iter().map(|(w, _)| lock(w)).collect();
        let mut own = (!self.reply.is_empty()).then(|| lock(&self.writer));
        drop(state);
        for w in others.iter_mut() {
            if let Err(e) = w.write_all(&[proto::STOP_WAITING]) {
                log::warn!("tcpstore server: waking a waiter failed: {e}");
                let _unused = w.shutdown(Shutdown::Both);
            }
        }
        drop(others);
        if let Some(own) = own.as_mut() {
            self.reply.write_to(own)?;
        }
        Ok(())
    }

    /// Send `self.reply` after the store lock was released: only for a connection
    /// without a parked waiter (no wake-up byte can race with the reply).
    fn answer_unlocked(&mut self) -> io::Result<()> {
        self.reply.write_to(&mut lock(&self.writer))
    }
}

/// A connection's request buffer: grows only as bytes arrive, in chunks, up to the
/// request limit, each byte of capacity taken from the server's budget.
pub(crate) struct RequestBuf {
    /// Zeroed once as it grows; `buf[start..end]` are the bytes not yet parsed.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Capacity taken from the budget.
    charged: usize,
}

impl RequestBuf {
    pub(crate) fn new() -> RequestBuf {
        RequestBuf {
            buf: Vec::new(),
            start: 0,
            end: 0,
            charged: 0,
        }
    }

    /// The bytes not yet parsed.
    pub(crate) fn pending(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// The capacity held now.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// A request of `len` bytes was served.
    pub(crate) fn consume(&mut self, len: usize, budget: &ByteBudget) {
        self.start += len;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buf.capacity() > KEEP_BUFFER_BYTES {
                self.release(budget);
            }
        }
    }

    /// Read more bytes, towards `need` pending bytes in all. The buffer grows by at
    /// least one chunk, at most doubles, and never past `need` plus one chunk, so its
    /// capacity stays within twice the bytes that arrived (or one chunk). Ok(0) at end
    /// of stream.
    pub(crate) fn read_more(
        &mut self,
        r: &mut impl Read,
        need: usize,
        budget: &ByteBudget,
    ) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.buf.len() == self.end {
            let want = need
                .saturating_sub(self.end)
                .clamp(READ_CHUNK_BYTES, self.end.max(READ_CHUNK_BYTES));
            if !budget.take(want) {
                return Err(bad(format!(
                    "the server's request buffers are full (max_buffered_bytes); this request needs {need} bytes"
                )));
            }
            self.charged += want;
            self.buf.reserve_exact(want);
            self.buf.resize(self.end + want, 0);
        }
        let got = loop {
            match r.read(&mut self.buf[self.end..]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                other => break other?,
            }
        };
        self.end += got;
        Ok(got)
    }

    /// Give the buffer and its budget back.
    pub(crate) fn release(&mut self, budget: &ByteBudget) {
        budget.give(self.charged);
        self.charged = 0;
        self.buf = Vec::new();
        self.start = 0;
        self.end = 0;
    }
}

fn serve_connection(stream: TcpStream, ctx: &Arc<ConnCtx>, shared: &Shared) {
    // The handshake deadline of the core covers the TLS handshake.
    let stream = match &shared.tls {
        None => Stream::Plain(stream),
        Some(tls) => match tls.accept(stream) {
            Ok(s) => s,
            Err(e) => {
                if !ctx.closed_by_server() {
                    log::warn!("tcpstore server: TLS from {}: {e}", ctx.peer());
                }
                return;
            }
        },
    };
    let mut rb = RequestBuf::new();
    let result = serve_requests(stream, ctx, shared, &mut rb);
    rb.release(&shared.budget);
    let keys = lock(&shared.state).cancel(ctx.id());
    unindex(shared, ctx.id(), &keys);
    if let Err(e) = result {
        if !ctx.closed_by_server() {
            log::warn!("tcpstore server: closing connection of {}: {e}", ctx.peer());
        }
    }
}

fn serve_requests(
    mut stream: Stream,
    ctx: &Arc<ConnCtx>,
    shared: &Shared,
    rb: &mut RequestBuf,
) -> io::Result<()> {
    let mut conn = Conn {
        id: ctx.id(),
        ctx: ctx.clone(),
        writer: Arc::new(Mutex::new(stream.try_clone()?)),
        shared,
        reply: Reply::default(),
    };
    let mut validated = false;
    loop {
        match parse_request(rb.pending(), &shared.limits) {
            Ok(Parsed::Complete { request, len }) => {
                match request {
                    Request::Validate { magic } if !validated => {
                        if magic != proto::VALIDATE_MAGIC {
                            return Err(bad(format!("VALIDATE with wrong magic {magic:#x}")));
                        }
                        validated = true;
                    }
                    Request::Validate { .. } => {
                        return Err(bad("second VALIDATE on one connection"))
                    }
                    _ if !validated => {
                        return Err(bad(format!(
                            "first request is opcode {}, not VALIDATE",
                            rb.pending()[0]
                        )))
                    }
                    request => {
                        handle(&mut conn, request)?;
                        ctx.served();
                    }
                }
                rb.consume(len, &shared.budget);
                if rb.pending().is_empty() {
                    ctx.done();
                }
            }
            Ok(Parsed::Incomplete { need }) => {
                // Parse again only once `need` bytes are there.
                while rb.pending().len() < need {
                    let was_empty = rb.pending().is_empty();
                    if rb.read_more(&mut stream, need, &shared.budget)? == 0 {
                        if was_empty {
                            return Ok(());
                        }
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "connection closed inside a request",
                        ));
                    }
                    if was_empty && ctx.is_parked() {
                        // While a WAIT is parked only CANCEL_WAIT may come (one byte);
                        // anything else is refused at its first byte, so the park
                        // deadline never covers a slow request.
                        if rb.pending()[0] != proto::op::CANCEL_WAIT {
                            return Err(bad(
                                "request sent while a WAIT or BARRIER of the same connection is pending",
                            ));
                        }
                    } else if was_empty {
                        ctx.busy();
                    }
                }
            }
            Err(e @ ParseError::UnknownOpcode(_)) | Err(e @ ParseError::OverLimit { .. }) => {
                return Err(bad(e.to_string()))
            }
        }
    }
}

/// Handle one parsed request (VALIDATE is handled by the caller).
fn handle(conn: &mut Conn<'_>, request: Request<'_>) -> io::Result<()> {
    conn.reply.clear();
    let config = &conn.shared.config;
    let mut woken = Vec::new();
    match request {
        Request::Set { key, value } => {
            // Copies made before the store lock is taken.
            let value = Arc::new(value.to_vec());
            let mut state = lock_checked(conn)?;
            state.check_store(config, key, value.len())?;
            state.store(key, value);
            state.written(key, &mut woken);
            conn.answer(state, woken)
        }
        Request::Append { key, value } => {
            let mut state = lock_checked(conn)?;
            let old = state.kv.get(key).map_or(0, |v| v.len());
            state.check_store(config, key, old + value.len())?;
            match state.kv.get_mut(key) {
                Some(v) => {
                    // In place when no reply holds the value: an APPEND loop costs
                    // the appended bytes, not the whole value each time.
                    Arc::make_mut(v).extend_from_slice(value);
                    state.bytes += value.len();
                }
                None => state.store(key, Arc::new(value.to_vec())),
            }
            state.written(key, &mut woken);
            conn.answer(state, woken)
        }
        Request::QueuePush { key, value } => {
            let value = value.to_vec();
            let mut state = lock_checked(conn)?;
            let new_queue = !state.queues.contains_key(key);
            if new_queue && state.num_keys() >= config.max_keys {
                return Err(over("key count", state.num_keys() + 1, config.max_keys));
            }
            let added = value.len()
                + ENTRY_OVERHEAD_BYTES
                + if new_queue {
                    key.len() + ENTRY_OVERHEAD_BYTES
                } else {
                    0
                };
            if state.bytes + added > config.max_total_bytes {
                return Err(over(
                    "stored bytes",
                    state.bytes + added,
                    config.max_total_bytes,
                ));
            }
            state.bytes += added;
            match state.queues.get_mut(key) {
                Some(q) => q.push_back(value),
                None => {
                    state.queues.insert(Arc::from(key), VecDeque::from([value]));
                }
            }
            state.written(key, &mut woken);
            conn.answer(state, woken)
        }
        Request::CompareSet {
            key,
            expected,
            desired,
        } => {
            let mut state = lock_checked(conn)?;
            let current: Value = match state.kv.get(key) {
                None if expected.is_empty() => {
                    state.check_store(config, key, desired.len())?;
                    let desired = Arc::new(desired.to_vec());
                    state.store(key, desired.clone());
                    state.written(key, &mut woken);
                    desired
                }
                None => Arc::new(expected.to_vec()),
                Some(v) if v[..] == *expected => {
                    state.check_store(config, key, desired.len())?;
                    let desired = Arc::new(desired.to_vec());
                    state.store(key, desired.clone());
                    state.written(key, &mut woken);
                    desired
                }
                Some(v) => v.clone(),
            };
            conn.reply.value(Some(&current));
            conn.answer(state, woken)
        }
        Request::Get { key } => {
            let state = lock_checked(conn)?;
            conn.reply.value(state.kv.get(key));
            conn.answer(state, woken)
        }
        Request::Add { key, delta } => {
            let mut state = lock_checked(conn)?;
            let next = state.add(config, key, delta)?;
            proto::put_i64(&mut conn.reply.head, next);
            state.written(key, &mut woken);
            conn.answer(state, woken)
        }
        Request::Check { keys } => {
            let state = lock_checked(conn)?;
            let ready = keys.iter().all(|k| state.present(k));
            conn.reply.head.push(if ready {
                proto::READY
            } else {
                proto::NOT_READY
            });
            conn.answer(state, woken)
        }
        Request::Wait { mut keys } => {
            // Duplicates out and the keys' copies made before the store lock.
            keys.sort_unstable();
            keys.dedup();
            let keys: Vec<Key> = keys.into_iter().map(Arc::from).collect();
            let (id, writer, ctx) = (conn.id, conn.writer.clone(), conn.ctx.clone());
            {
                let mut state = lock_checked(conn)?;
                // A small WAIT whose keys are all there needs no waiter (and no room
                // among the parked ones).
                if keys.len() <= WAIT_CHUNK_KEYS && keys.iter().all(|k| state.present(k)) {
                    conn.reply.head.push(proto::STOP_WAITING);
                    return conn.answer(state, woken);
                }
                state.check_park(config, 0)?;
                let until = Until::Keys {
                    keys: Vec::new(),
                    missing: 0,
                    registering: true,
                };
                state.park(id, &writer, &ctx, until, 0);
            }
            // A chunk of keys per lock hold: a WAIT of 100,000 keys does not stall
            // other clients. The waiter cannot wake before the last chunk. Past a
            // limit the connection closes, which un-indexes what was registered.
            for chunk in keys.chunks(WAIT_CHUNK_KEYS) {
                lock(&conn.shared.state).register(config, id, chunk)?;
            }
            let mut state = lock(&conn.shared.state);
            if state.registered(id) {
                conn.reply.head.push(proto::STOP_WAITING);
            }
            conn.answer(state, woken)
        }
        Request::Barrier { key, world } => {
            let mut state = lock_checked(conn)?;
            let n = state.add(config, key, 1)?;
            if n >= world {
                conn.reply.head.push(proto::STOP_WAITING);
            } else {
                state.check_park(config, 0)?;
                state.check_park(config, 1)?;
                let (id, writer, ctx) = (conn.id, conn.writer.clone(), conn.ctx.clone());
                let until = Until::Counter {
                    key: Arc::from(key),
                    world,
                };
                state.park(id, &writer, &ctx, until, 1);
            }
            state.written(key, &mut woken);
            conn.answer(state, woken)
        }
        Request::CancelWait => {
            let mut state = lock(&conn.shared.state);
            let keys = state.cancel(conn.id);
            conn.reply.head.push(proto::WAIT_CANCELED);
            conn.answer(state, woken)?;
            unindex(conn.shared, conn.id, &keys);
            Ok(())
        }
        Request::GetNumKeys => {
            let state = lock_checked(conn)?;
            proto::put_i64(&mut conn.reply.head, state.kv.len() as i64);
            conn.answer(state, woken)
        }
        Request::DeleteKey { key } => {
            let mut state = lock_checked(conn)?;
            let removed = state.delete(key);
            proto::put_i64(&mut conn.reply.head, i64::from(removed));
            conn.answer(state, woken)
        }
        Request::MultiGet { keys } => {
            let state = lock_checked(conn)?;
            // The reply's size first: nothing is built for a reply over the limit.
            let mut size = 0usize;
            for key in &keys {
                size += 8 + state.kv.get(*key).map_or(0, |v| v.len());
                if size > config.max_reply_bytes {
                    return Err(over("MULTI_GET reply bytes", size, config.max_reply_bytes));
                }
            }
            // Shared handles only under the lock; the reply is built after it.
            let values: Vec<Option<Value>> =
                keys.iter().map(|k| state.kv.get(*k).cloned()).collect();
            drop(state);
            for v in &values {
                conn.reply.value(v.as_ref());
            }
            conn.answer_unlocked()
        }
        Request::MultiSet { pairs } => {
            // The last value of a key wins; copies made before the store lock.
            let mut last: HashMap<&[u8], usize> = HashMap::with_capacity(pairs.len());
            for (i, (k, _)) in pairs.iter().enumerate() {
                last.insert(k, i);
            }
            let pairs: Vec<(&[u8], Value)> = pairs
                .iter()
                .enumerate()
                .filter(|(i, (k, _))| last.get(k) == Some(i))
                .map(|(_, (k, v))| (*k, Arc::new(v.to_vec())))
                .collect();
            let mut state = lock_checked(conn)?;
            // All of it fits, or none of it is stored.
            let (mut keys, mut bytes) = (state.num_keys(), state.bytes);
            for (k, v) in &pairs {
                match state.kv.get(*k) {
                    Some(old) => bytes = bytes - old.len() + v.len(),
                    None => {
                        keys += 1;
                        bytes += k.len() + ENTRY_OVERHEAD_BYTES + v.len();
                    }
                }
            }
            if keys > config.max_keys {
                return Err(over("key count", keys, config.max_keys));
            }
            if bytes > config.max_total_bytes {
                return Err(over("stored bytes", bytes, config.max_total_bytes));
            }
            for (k, v) in pairs {
                state.store(k, v);
                state.written(k, &mut woken);
            }
            conn.answer(state, woken)
        }
        Request::Ping { nonce } => {
            conn.reply.head.extend_from_slice(&nonce.to_le_bytes());
            let state = lock_checked(conn)?;
            conn.answer(state, woken)
        }
        Request::QueuePop { key } => {
            let mut state = lock_checked(conn)?;
            let queue = state.queues.get_mut(key);
            let len = queue.as_ref().map_or(0, |q| q.len());
            let popped = queue.and_then(VecDeque::pop_front);
            proto::put_i64(&mut conn.reply.head, len as i64);
            if let Some(value) = popped {
                state.bytes -= value.len() + ENTRY_OVERHEAD_BYTES;
                conn.reply.bytes(&value);
            }
            if len == 1 {
                // Emptied: the queue stops counting as a key.
                state.queues.remove(key);
                state.bytes -= key.len() + ENTRY_OVERHEAD_BYTES;
            }
            conn.answer(state, woken)
        }
        Request::QueueLen { key } => {
            let state = lock_checked(conn)?;
            let len = state.queues.get(key).map_or(0, VecDeque::len);
            proto::put_i64(&mut conn.reply.head, len as i64);
            conn.answer(state, woken)
        }
        Request::ListKeys => {
            let state = lock_checked(conn)?;
            let size = 8 + 8 * state.kv.len() + state.kv_key_bytes;
            if size > config.max_reply_bytes {
                return Err(over("LIST_KEYS reply bytes", size, config.max_reply_bytes));
            }
            let keys: Vec<Key> = state.kv.keys().cloned().collect();
            drop(state);
            proto::put_i64(&mut conn.reply.head, keys.len() as i64);
            for key in &keys {
                conn.reply.bytes(key);
            }
            conn.answer_unlocked()
        }
        Request::Validate { .. } => Err(bad("VALIDATE handled by the caller")),
    }
}

/// Remove a canceled waiter's index entries, a chunk per store-lock hold.
fn unindex(shared: &Shared, conn: u64, keys: &[Key]) {
    for chunk in keys.chunks(WAIT_CHUNK_KEYS) {
        lock(&shared.state).unindex(conn, chunk);
    }
}

/// Lock the store, refusing any request other than CANCEL_WAIT while this connection
/// has a pending WAIT or BARRIER (its late reply byte would be taken for another reply).
fn lock_checked<'a>(conn: &Conn<'a>) -> io::Result<MutexGuard<'a, State>> {
    let state = lock(&conn.shared.state);
    if state.waiters.contains_key(&conn.id) {
        return Err(bad(
            "request sent while a WAIT or BARRIER of the same connection is pending",
        ));
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out `data` in pieces of at most `piece` bytes.
    struct Trickle<'a> {
        data: &'a [u8],
        piece: usize,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let n = self.piece.min(out.len()).min(self.data.len());
            out[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    /// Read one request the way a connection does; the largest capacity seen.
    fn read_one(
        data: &[u8],
        piece: usize,
        limits: &RequestLimits,
    ) -> (Result<usize, String>, usize) {
        let budget = ByteBudget::new(1 << 30);
        let mut rb = RequestBuf::new();
        let mut r = Trickle { data, piece };
        let mut peak = 0;
        let result = loop {
            match parse_request(rb.pending(), limits) {
                Ok(Parsed::Complete { len, .. }) => break Ok(len),
                Ok(Parsed::Incomplete { need }) => match rb.read_more(&mut r, need, &budget) {
                    Ok(0) => break Err("eof".to_string()),
                    Ok(_) => peak = peak.max(rb.capacity()),
                    Err(e) => break Err(e.to_string()),
                },
                Err(e) => break Err(e.to_string()),
            }
        };
        assert_eq!(budget.used(), rb.charged);
        rb.release(&budget);
        assert_eq!(budget.used(), 0);
        (result, peak)
    }

    fn limits() -> RequestLimits {
        ServerConfig::default().request_limits()
    }

    #[test]
    fn a_length_prefix_reserves_nothing_before_the_bytes_arrive() {
        // SET, a 10-byte key, then a value announced at 60 MiB (under the limit) of
        // which 100 bytes arrive: the buffer stays one chunk.
        let mut req = vec![proto::op::SET];
        proto::put_bytes(&mut req, b"0123456789");
        proto::put_u64(&mut req, 60 << 20);
        req.extend_from_slice(&[7; 100]);
        let (result, peak) = read_one(&req, 1 << 20, &limits());
        assert_eq!(result.unwrap_err(), "eof");
        assert!(peak <= 2 * READ_CHUNK_BYTES, "capacity {peak}");
        // 2^60 bytes: refused before anything is reserved.
        let mut req = vec![proto::op::SET];
        proto::put_bytes(&mut req, b"k");
        proto::put_u64(&mut req, 1 << 60);
        let (result, peak) = read_one(&req, 3, &limits());
        assert!(result.unwrap_err().contains("over the limit"));
        assert!(peak <= READ_CHUNK_BYTES, "capacity {peak}");
        // A WAIT announcing 2^60 keys, and one announcing the limit with few bytes.
        let mut req = vec![proto::op::WAIT];
        proto::put_u64(&mut req, 1 << 60);
        assert!(read_one(&req, 64, &limits())
            .0
            .unwrap_err()
            .contains("key count"));
        let mut req = vec![proto::op::WAIT];
        proto::put_u64(&mut req, 131_072);
        proto::put_bytes(&mut req, b"k");
        let (result, peak) = read_one(&req, 64, &limits());
        assert_eq!(result.unwrap_err(), "eof");
        assert!(peak <= READ_CHUNK_BYTES, "capacity {peak}");
    }

    #[test]
    fn a_large_request_grows_with_its_bytes_and_no_further() {
        let value = vec![3u8; 5 << 20];
        let mut req = vec![proto::op::SET];
        proto::put_bytes(&mut req, b"key");
        proto::put_bytes(&mut req, &value);
        for piece in [1000, 64 << 10, 8 << 20] {
            let (result, peak) = read_one(&req, piece, &limits());
            assert_eq!(result.unwrap(), req.len());
            assert!(
                peak <= req.len() + READ_CHUNK_BYTES,
                "piece {piece}: capacity {peak}"
            );
        }
        // Over max_request_bytes: refused from the announced length.
        let small = RequestLimits {
            max_request_bytes: 1 << 20,
            ..limits()
        };
        assert!(read_one(&req, 64 << 10, &small)
            .0
            .unwrap_err()
            .contains("request"));
    }

    #[test]
    fn the_budget_bounds_all_buffers_together() {
        let budget = ByteBudget::new(3 * READ_CHUNK_BYTES);
        let mut data: &[u8] = &[1u8; 1 << 20];
        let mut bufs: Vec<RequestBuf> = (0..4).map(|_| RequestBuf::new()).collect();
        let mut refused = 0;
        for rb in &mut bufs {
            if rb.read_more(&mut data, 1 << 20, &budget).is_err() {
                refused += 1;
            }
        }
        assert_eq!(refused, 1);
        for rb in &mut bufs {
            rb.release(&budget);
        }
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn limits_come_from_the_environment_with_typed_errors() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let c = ServerConfig::default()
            .with_overrides(vars(&[
                ("FERRY_TCPSTORE_MAX_CONNECTIONS", "7"),
                ("FERRY_TCPSTORE_IDLE_TIMEOUT_MS", "1500"),
                ("FERRY_TCPSTORE_MAX_WAITERS", "3"),
            ]))
            .unwrap();
        assert_eq!(
            (c.max_connections, c.idle_timeout, c.max_waiters),
            (7, Duration::from_millis(1500), 3)
        );
        for bad in [
            &[("FERRY_TCPSTORE_MAX_KEYS", "many")][..],
            &[("FERRY_TCPSTORE_REQUEST_TIMEOUT_MS", "0")][..],
            &[("FERRY_TCPSTORE_IDLE_TIMEOUT_MS", "18446744073709551615")][..],
            &[("FERRY_TCPSTORE_MAX_REQUEST_BYTES", "10")][..],
        ] {
            let e = ServerConfig::default()
                .with_overrides(vars(bad))
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad[0].0), "{e}");
        }
    }
}
