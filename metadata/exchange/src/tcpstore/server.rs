//! Ferry's own TCPStore server: the server side of the c10d TCPStore protocol, so a
//! deployment needs neither torch nor etcd for name-based discovery. It interoperates
//! with torch's `TCPStore` clients (torch >= 2.2).
//!
//! Threads: one accept thread and one thread per connection (bounded by
//! [`ServerConfig::max_connections`]). A WAIT whose keys are missing registers a waiter
//! and the connection thread goes on reading (the next request may be CANCEL_WAIT); the
//! thread whose write satisfies the waiter sends its `STOP_WAITING` byte. Every write to
//! a connection happens under that connection's writer lock, taken while the store lock
//! is held, so a wake-up and a CANCEL_WAIT reply always leave in the order of events.
//!
//! Deliberately absent: persistence, authentication (like torch's server; bind it to
//! loopback or a private network), the pre-2.2 opcode numbering.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use ferry_storage::Error;

use super::proto::{self, op};
use crate::util::{io_error, nonzero};

const BACKEND: &str = "tcpstore-server";
/// Values up to this size are copied into the reply; larger ones are written from the
/// store's shared buffer.
const INLINE_VALUE_MAX_BYTES: usize = 16 << 10;

/// Limits of the server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Most connections served at once; more are closed at accept.
    pub max_connections: usize,
    /// Longest key, in bytes.
    pub max_key_bytes: usize,
    /// Longest value, in bytes.
    pub max_value_bytes: usize,
    /// Most keys in one CHECK, WAIT or MULTI_* request.
    pub max_keys_per_request: usize,
    /// Once a request's first byte arrived, the rest must arrive within this time.
    pub request_timeout: Duration,
    /// Bound on every write to a client.
    pub write_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            max_connections: 1024,
            max_key_bytes: 64 << 10,
            max_value_bytes: 256 << 20,
            max_keys_per_request: 131_072,
            request_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(10),
        }
    }
}

/// A running server; dropping it (or [`ServerHandle::stop`]) closes every connection and
/// joins every thread.
pub struct ServerHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

type Writer = Arc<Mutex<TcpStream>>;

enum Until {
    Keys(Vec<Vec<u8>>),
    Counter { key: Vec<u8>, world: i64 },
}

struct Waiter {
    conn: u64,
    writer: Writer,
    until: Until,
}

#[derive(Default)]
struct State {
    /// Values are shared, so a GET copies nothing while it holds the store lock.
    kv: HashMap<Vec<u8>, Arc<[u8]>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    waiters: Vec<Waiter>,
}

struct Shared {
    config: ServerConfig,
    state: Mutex<State>,
    /// A clone of every open connection, to shut them down at stop.
    conns: Mutex<HashMap<u64, TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    stop: AtomicBool,
    next_conn: AtomicU64,
}

/// Start a server listening on `listen` (port 0: ephemeral). Bind loopback unless the
/// store must be reachable from other hosts.
pub fn serve(listen: SocketAddr, config: ServerConfig) -> Result<ServerHandle, Error> {
    let listener = TcpListener::bind(listen)
        .map_err(|e| io_error(BACKEND, format_args!("binding {listen}"), &e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| io_error(BACKEND, "reading the bound address", &e))?;
    let shared = Arc::new(Shared {
        config,
        state: Mutex::new(State::default()),
        conns: Mutex::new(HashMap::new()),
        threads: Mutex::new(Vec::new()),
        stop: AtomicBool::new(false),
        next_conn: AtomicU64::new(1),
    });
    let accept = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name(format!("ferry-tcpstore-accept-{}", addr.port()))
            .spawn(move || accept_loop(listener, shared))
            .map_err(|e| io_error(BACKEND, "spawning the accept thread", &e))?
    };
    log::info!("tcpstore server listening on {addr}");
    Ok(ServerHandle {
        addr,
        shared,
        accept: Some(accept),
    })
}

impl ServerHandle {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many keys the store holds (queues excluded).
    pub fn num_keys(&self) -> usize {
        lock(&self.shared.state).kv.len()
    }

    /// Stop serving: close the listener and every connection, join the threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stop.store(true, Ordering::Release);
        // Wake the accept thread with a connection of our own.
        let _unused =
            TcpStream::connect_timeout(&crate::util::wake_addr(self.addr), Duration::from_secs(1));
        let _unused = accept.join();
        for stream in lock(&self.shared.conns).values() {
            let _unused = stream.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *lock(&self.shared.threads));
        for t in threads {
            let _unused = t.join();
        }
        log::info!("tcpstore server on {} stopped", self.addr);
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log::warn!("tcpstore server: accept failed: {e}");
                // Out of descriptors and the like: do not spin on it.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        lock(&shared.threads).retain(|t| !t.is_finished());
        if lock(&shared.conns).len() >= shared.config.max_connections {
            log::warn!(
                "tcpstore server: refusing {peer}: {} connections already (max_connections)",
                shared.config.max_connections
            );
            continue;
        }
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let clone = match stream.try_clone() {
            Ok(c) => c,
            Err(e) => {
                log::warn!("tcpstore server: dropping {peer}: {e}");
                continue;
            }
        };
        lock(&shared.conns).insert(id, clone);
        let conn_shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("ferry-tcpstore-conn-{id}"))
            .spawn(move || {
                let result = serve_connection(id, stream, &conn_shared);
                if let Err(e) = result {
                    if !conn_shared.stop.load(Ordering::Acquire) {
                        log::warn!("tcpstore server: closing connection of {peer}: {e}");
                    }
                }
                lock(&conn_shared.conns).remove(&id);
                lock(&conn_shared.state).waiters.retain(|w| w.conn != id);
            });
        match spawned {
            Ok(t) => lock(&shared.threads).push(t),
            Err(e) => {
                log::warn!("tcpstore server: cannot spawn a connection thread: {e}");
                if let Some(s) = lock(&shared.conns).remove(&id) {
                    let _unused = s.shutdown(Shutdown::Both);
                }
            }
        }
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl State {
    fn present(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    fn satisfied(&self, until: &Until) -> bool {
        match until {
            Until::Keys(keys) => keys.iter().all(|k| self.present(k)),
            Until::Counter { key, world } => self
                .kv
                .get(key)
                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                .is_some_and(|n| n >= *world),
        }
    }

    /// Remove and return the writers of every waiter whose condition now holds.
    fn take_satisfied(&mut self) -> Vec<Writer> {
        let mut woken = Vec::new();
        let mut i = 0;
        while i < self.waiters.len() {
            if self.satisfied(&self.waiters[i].until) {
                woken.push(self.waiters.swap_remove(i).writer);
            } else {
                i += 1;
            }
        }
        woken
    }

    fn add(&mut self, key: &[u8], delta: i64) -> io::Result<i64> {
        let current = match self.kv.get(key) {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| bad("ADD on a value that is not a decimal number"))?,
        };
        let next = current.wrapping_add(delta);
        self.kv
            .insert(key.to_vec(), Arc::from(next.to_string().into_bytes()));
        Ok(next)
    }
}

/// Reads of one connection, with the limits of the server.
struct Conn<'a> {
    id: u64,
    /// Buffered, so a whole small request costs one read system call.
    stream: BufReader<TcpStream>,
    writer: Writer,
    shared: &'a Shared,
    reply: Vec<u8>,
    /// A value written after `reply`, outside the store lock.
    reply_tail: Option<Arc<[u8]>>,
}

impl Conn<'_> {
    fn key(&mut self) -> io::Result<Vec<u8>> {
        proto::read_bytes(&mut self.stream, self.shared.config.max_key_bytes)
    }
    fn value(&mut self) -> io::Result<Vec<u8>> {
        proto::read_bytes(&mut self.stream, self.shared.config.max_value_bytes)
    }
    fn keys(&mut self) -> io::Result<Vec<Vec<u8>>> {
        let n = proto::read_count(&mut self.stream, self.shared.config.max_keys_per_request)?;
        (0..n).map(|_| self.key()).collect()
    }

    /// Send `self.reply` (may be empty) to this connection and a `STOP_WAITING` byte to
    /// each of `woken`, taking every writer lock before the store lock is released.
    fn answer(&mut self, state: MutexGuard<'_, State>, woken: Vec<Writer>) -> io::Result<()> {
        let mut others: Vec<MutexGuard<'_, TcpStream>> = woken.iter().map(|w| lock(w)).collect();
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
            own.write_all(&self.reply)?;
            if let Some(tail) = self.reply_tail.take() {
                own.write_all(&tail)?;
            }
        }
        Ok(())
    }
}

fn serve_connection(id: u64, stream: TcpStream, shared: &Shared) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(nonzero(shared.config.write_timeout)))?;
    // One read timeout for everything: inside a request it bounds a half-sent request;
    // between requests it only makes the thread look at the stop flag now and then.
    stream.set_read_timeout(Some(nonzero(shared.config.request_timeout)))?;
    let writer = Arc::new(Mutex::new(stream.try_clone()?));
    let mut conn = Conn {
        id,
        stream: BufReader::with_capacity(64 << 10, stream),
        writer,
        shared,
        reply: Vec::with_capacity(64),
        reply_tail: None,
    };
    let mut validated = false;
    loop {
        let opcode = match proto::read_u8(&mut conn.stream) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            // Idle between requests: torch's servers never close idle connections.
            Err(e) if crate::util::is_timeout(&e) => {
                if shared.stop.load(Ordering::Acquire) {
                    return Ok(());
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        if shared.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        if !validated {
            if opcode != op::VALIDATE {
                return Err(bad(format!(
                    "first request is opcode {opcode}, not VALIDATE"
                )));
            }
            let magic = proto::read_u32(&mut conn.stream)?;
            if magic != proto::VALIDATE_MAGIC {
                return Err(bad(format!("VALIDATE with wrong magic {magic:#x}")));
            }
            validated = true;
            continue;
        }
        request(&mut conn, opcode)?;
    }
}

/// Handle one request whose opcode was read.
fn request(conn: &mut Conn<'_>, opcode: u8) -> io::Result<()> {
    conn.reply.clear();
    conn.reply_tail = None;
    // Read the whole request before taking the store lock.
    match opcode {
        op::SET | op::APPEND | op::QUEUE_PUSH => {
            let key = conn.key()?;
            let value = conn.value()?;
            let mut state = lock_checked(conn, opcode)?;
            match opcode {
                op::SET => {
                    state.kv.insert(key, Arc::from(value));
                }
                op::APPEND => {
                    let joined = match state.kv.get(&key) {
                        Some(old) => [&old[..], &value[..]].concat(),
                        None => value,
                    };
                    state.kv.insert(key, Arc::from(joined));
                }
                _ => state.queues.entry(key).or_default().push_back(value),
            }
            let woken = state.take_satisfied();
            conn.answer(state, woken)
        }
        op::COMPARE_SET => {
            let key = conn.key()?;
            let expected = conn.value()?;
            let desired = conn.value()?;
            let mut state = lock_checked(conn, opcode)?;
            let current: Arc<[u8]> = match state.kv.get_mut(&key) {
                None if expected.is_empty() => {
                    let desired: Arc<[u8]> = Arc::from(desired);
                    state.kv.insert(key, desired.clone());
                    desired
                }
                None => Arc::from(expected),
                Some(v) => {
                    if **v == *expected {
                        *v = Arc::from(desired);
                    }
                    v.clone()
                }
            };
            proto::put_bytes(&mut conn.reply, &current);
            let woken = state.take_satisfied();
            conn.answer(state, woken)
        }
        op::GET => {
            let key = conn.key()?;
            let state = lock_checked(conn, opcode)?;
            match state.kv.get(&key) {
                // Large values are written from the shared buffer after the lock is
                // released; small ones go in the same write as their length.
                Some(v) if v.len() > INLINE_VALUE_MAX_BYTES => {
                    proto::put_u64(&mut conn.reply, v.len() as u64);
                    conn.reply_tail = Some(v.clone());
                }
                v => proto::put_bytes(&mut conn.reply, v.map(|v| &v[..]).unwrap_or_default()),
            }
            conn.answer(state, Vec::new())
        }
        op::ADD => {
            let key = conn.key()?;
            let delta = proto::read_i64(&mut conn.stream)?;
            let mut state = lock_checked(conn, opcode)?;
            let next = state.add(&key, delta)?;
            proto::put_i64(&mut conn.reply, next);
            let woken = state.take_satisfied();
            conn.answer(state, woken)
        }
        op::CHECK => {
            let keys = conn.keys()?;
            let state = lock_checked(conn, opcode)?;
            let ready = keys.iter().all(|k| state.present(k));
            conn.reply.push(if ready {
                proto::READY
            } else {
                proto::NOT_READY
            });
            conn.answer(state, Vec::new())
        }
        op::WAIT => {
            let keys = conn.keys()?;
            let mut state = lock_checked(conn, opcode)?;
            let until = Until::Keys(keys);
            if state.satisfied(&until) {
                conn.reply.push(proto::STOP_WAITING);
            } else {
                state.waiters.push(Waiter {
                    conn: conn.id,
                    writer: conn.writer.clone(),
                    until,
                });
            }
            conn.answer(state, Vec::new())
        }
        op::BARRIER => {
            let key = conn.key()?;
            let world = proto::read_i64(&mut conn.stream)?;
            let mut state = lock_checked(conn, opcode)?;
            state.add(&key, 1)?;
            let until = Until::Counter { key, world };
            let ready = state.satisfied(&until);
            if ready {
                conn.reply.push(proto::STOP_WAITING);
            } else {
                state.waiters.push(Waiter {
                    conn: conn.id,
                    writer: conn.writer.clone(),
                    until,
                });
            }
            let woken = state.take_satisfied();
            conn.answer(state, woken)
        }
        op::CANCEL_WAIT => {
            let mut state = lock(&conn.shared.state);
            state.waiters.retain(|w| w.conn != conn.id);
            conn.reply.push(proto::WAIT_CANCELED);
            conn.answer(state, Vec::new())
        }
        op::GETNUMKEYS => {
            let state = lock_checked(conn, opcode)?;
            proto::put_i64(&mut conn.reply, state.kv.len() as i64);
            conn.answer(state, Vec::new())
        }
        op::DELETE_KEY => {
            let key = conn.key()?;
            let mut state = lock_checked(conn, opcode)?;
            let removed = state.kv.remove(&key).is_some();
            proto::put_i64(&mut conn.reply, i64::from(removed));
            conn.answer(state, Vec::new())
        }
        op::MULTI_GET => {
            let keys = conn.keys()?;
            let state = lock_checked(conn, opcode)?;
            for key in &keys {
                let value = state.kv.get(key).map(|v| &v[..]).unwrap_or_default();
                proto::put_bytes(&mut conn.reply, value);
            }
            conn.answer(state, Vec::new())
        }
        op::MULTI_SET => {
            let n = proto::read_count(&mut conn.stream, conn.shared.config.max_keys_per_request)?;
            let mut pairs = Vec::with_capacity(n);
            for _ in 0..n {
                let key = conn.key()?;
                let value = conn.value()?;
                pairs.push((key, value));
            }
            let mut state = lock_checked(conn, opcode)?;
            state
                .kv
                .extend(pairs.into_iter().map(|(k, v)| (k, Arc::from(v))));
            let woken = state.take_satisfied();
            conn.answer(state, woken)
        }
        op::PING => {
            let nonce = proto::read_u32(&mut conn.stream)?;
            conn.reply.extend_from_slice(&nonce.to_le_bytes());
            let state = lock_checked(conn, opcode)?;
            conn.answer(state, Vec::new())
        }
        op::QUEUE_POP => {
            let key = conn.key()?;
            let mut state = lock_checked(conn, opcode)?;
            let queue = state.queues.get_mut(&key);
            let len = queue.as_ref().map_or(0, |q| q.len());
            proto::put_i64(&mut conn.reply, len as i64);
            if let Some(value) = queue.and_then(VecDeque::pop_front) {
                proto::put_bytes(&mut conn.reply, &value);
            }
            conn.answer(state, Vec::new())
        }
        op::QUEUE_LEN => {
            let key = conn.key()?;
            let state = lock_checked(conn, opcode)?;
            let len = state.queues.get(&key).map_or(0, VecDeque::len);
            proto::put_i64(&mut conn.reply, len as i64);
            conn.answer(state, Vec::new())
        }
        op::LIST_KEYS => {
            let state = lock_checked(conn, opcode)?;
            proto::put_i64(&mut conn.reply, state.kv.len() as i64);
            for key in state.kv.keys() {
                proto::put_bytes(&mut conn.reply, key);
            }
            conn.answer(state, Vec::new())
        }
        op::VALIDATE => Err(bad("second VALIDATE on one connection")),
        other => Err(bad(format!("unknown opcode {other}"))),
    }
}

/// Lock the store, refusing any request other than CANCEL_WAIT while this connection
/// has a pending WAIT or BARRIER (its late reply byte would be taken for another reply).
fn lock_checked<'a>(conn: &Conn<'a>, opcode: u8) -> io::Result<MutexGuard<'a, State>> {
    let state = lock(&conn.shared.state);
    if state.waiters.iter().any(|w| w.conn == conn.id) {
        return Err(bad(format!(
            "opcode {opcode} sent while a WAIT or BARRIER of the same connection is pending"
        )));
    }
    Ok(state)
}
