//! The connection-server core shared by the TCPStore server and the P2P listener: one
//! accept thread, one thread per connection (a bounded number), and one watchdog thread
//! that enforces every connection's deadline.
//!
//! Why threads and not an event loop: both protocols are request/reply over blocking
//! sockets, the P2P handler is blocking code shared with the client, and the number of
//! connections is bounded (a thread with a small stack costs tens of KiB of resident
//! memory). Deadlines do not rely on per-`read()` timeouts, which a client defeats by
//! sending one byte per timeout: each connection publishes a deadline for the state it
//! is in ([`ConnCtx`]) and the watchdog shuts the socket down once it passes, which
//! wakes the blocked handler with end-of-file.
//!
//! - **Handshake** (from accept): deadline `request_timeout`.
//! - **Idle** (between requests): deadline `idle_timeout`.
//! - **Busy** (a request started): deadline `request_timeout` for the *whole* request.
//! - **Parked** (waiting for an event of the server, e.g. a TCPStore WAIT): deadline
//!   `park_timeout`.
//!
//! At the connection limit, a new connection takes the slot of the connection that has
//! been handshaking, idle or parked the longest, preferring connections that were never
//! served a request (so a flood of idle connections cannot push out a working client;
//! the victim is shut down at once); when every
//! connection is busy, the new one is closed at once. A connection from an address that
//! already has `max_connections_per_source` open is closed at once, evicting nobody. Neither blocks the accept thread:
//! a shutdown is one system call, and the evicted connection's thread cleans up after
//! itself.

use std::collections::HashMap;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_storage::Error;

use crate::util::{io_error, lock, nonzero};

/// Stack of a connection thread: handlers keep their buffers on the heap.
const CONN_STACK_BYTES: usize = 256 << 10;

/// Limits of a connection server.
#[derive(Clone, Debug)]
pub struct ConnLimits {
    /// Most connections served at once.
    pub max_connections: usize,
    /// Most connections from one source IP address; a new one past it is refused at
    /// once (it evicts nobody), so one address cannot take the server over.
    pub max_connections_per_source: usize,
    /// A connection with no request in progress is closed after this long.
    pub idle_timeout: Duration,
    /// A request (and the hello) must arrive whole within this time of its first byte.
    pub request_timeout: Duration,
    /// A connection parked on an event of the server is closed after this long.
    pub park_timeout: Duration,
    /// Bound on each write to a client.
    pub write_timeout: Duration,
}

/// Counters of a connection server.
#[derive(Debug, Default)]
pub struct ConnStats {
    /// Connections accepted and handed to the handler.
    pub accepted: AtomicU64,
    /// Connections closed at accept: the server was full of busy connections.
    pub refused_full: AtomicU64,
    /// Connections shut down to make room for a new one (longest idle first).
    pub evicted: AtomicU64,
    /// Connections closed at accept: their source address had
    /// `max_connections_per_source` open.
    pub refused_source: AtomicU64,
    /// Connections shut down because their deadline passed.
    pub timed_out: AtomicU64,
    /// Connections open now.
    pub open: AtomicUsize,
}

const HANDSHAKE: u8 = 0;
const IDLE: u8 = 1;
const BUSY: u8 = 2;
const PARKED: u8 = 3;
const CLOSED: u8 = 4;

/// No deadline.
const NEVER: u64 = u64::MAX;

/// What a handler knows of its connection, and how it tells the watchdog which
/// deadline applies.
pub struct ConnCtx {
    id: u64,
    peer: String,
    clock: Arc<Clock>,
    limits: Arc<ConnLimits>,
    state: AtomicU8,
    /// When the current state began (ms on `clock`): the oldest is evicted first.
    since_ms: AtomicU64,
    /// Whether the connection was ever served a request (beyond its handshake): such
    /// connections are evicted only once none that never did is left.
    served: AtomicBool,
    deadline_ms: AtomicU64,
    stop: Arc<AtomicBool>,
}

/// Milliseconds since the server started.
struct Clock(Instant);

impl Clock {
    fn now_ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(NEVER)
}

impl ConnCtx {
    /// The connection's number, unique within its server.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The client's address, for log lines.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Whether the server is stopping.
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Whether the core closed the connection (deadline passed, evicted, stopping):
    /// the handler's read error is then expected, not worth a warning.
    pub fn closed_by_server(&self) -> bool {
        self.state.load(Ordering::Acquire) == CLOSED || self.stopping()
    }

    fn enter(&self, state: u8, timeout: Option<Duration>) {
        let now = self.clock.now_ms();
        self.since_ms.store(now, Ordering::Relaxed);
        let deadline = timeout.map_or(NEVER, |t| now.saturating_add(ms(t)));
        self.deadline_ms.store(deadline, Ordering::Relaxed);
        // The state last: the watchdog reads it first.
        let _unused = self
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                (s != CLOSED).then_some(state)
            });
    }

    /// A request started: it must be complete within the request timeout.
    pub fn busy(&self) {
        self.enter(BUSY, Some(self.limits.request_timeout));
    }

    /// Between requests: closed after the idle timeout.
    pub fn idle(&self) {
        self.enter(IDLE, Some(self.limits.idle_timeout));
    }

    /// Waiting for a request whose first byte the handler cannot observe (its reader
    /// buffers): the next request must be complete within the idle timeout plus the
    /// request timeout.
    pub fn idle_then_busy(&self) {
        self.enter(
            IDLE,
            Some(self.limits.idle_timeout + self.limits.request_timeout),
        );
    }

    /// Parked on an event of the server (the TCPStore server calls it under its store
    /// lock, with [`Self::unpark`] from the thread that delivers the event).
    pub fn park(&self) {
        self.enter(PARKED, Some(self.limits.park_timeout));
    }

    /// The event a parked connection waited for happened: it is idle again.
    pub fn unpark(&self) {
        if self.state.load(Ordering::Acquire) == PARKED {
            self.idle();
        }
    }

    /// The request in progress (or the hello) is answered: idle again (a parked
    /// connection stays parked).
    pub fn done(&self) {
        if matches!(self.state.load(Ordering::Acquire), BUSY | HANDSHAKE) {
            self.idle();
        }
    }

    /// A request (not the handshake) was answered: at the connection limit, this
    /// connection is evicted only after every connection that never got that far. A
    /// flood of idle connections then cannot push out a client that is working, however
    /// long its pause between requests.
    pub fn served(&self) {
        self.served.store(true, Ordering::Relaxed);
    }

    /// Whether the connection is parked.
    pub fn is_parked(&self) -> bool {
        self.state.load(Ordering::Acquire) == PARKED
    }
}

/// The function that serves one connection, on that connection's thread. It returns
/// when the connection is done; the core closes the socket afterwards.
pub type Handler = Arc<dyn Fn(TcpStream, &Arc<ConnCtx>) + Send + Sync>;

struct Entry {
    /// A clone of the socket, to shut it down from the accept or watchdog thread.
    stream: TcpStream,
    /// The client's IP address (for the per-source limit).
    source: Option<IpAddr>,
    ctx: Arc<ConnCtx>,
}

struct Core {
    what: &'static str,
    limits: Arc<ConnLimits>,
    clock: Arc<Clock>,
    stop: Arc<AtomicBool>,
    conns: Mutex<HashMap<u64, Entry>>,
    /// Connection threads alive (an evicted connection's thread may outlive its entry).
    live: Mutex<usize>,
    live_cv: Condvar,
    /// Wakes the watchdog at stop.
    watchdog_cv: Condvar,
    watchdog_lock: Mutex<()>,
    stats: Arc<ConnStats>,
    handler: Handler,
}

/// A running connection server. Dropping it (or [`ConnServer::stop`]) stops accepting,
/// shuts every connection down and waits for every thread.
pub struct ConnServer {
    addr: SocketAddr,
    core: Arc<Core>,
    accept: Option<JoinHandle<()>>,
    watchdog: Option<JoinHandle<()>>,
}

impl ConnServer {
    /// Listen on `listen` and serve each connection with `handler`. `what` names the
    /// server in log lines and thread names (`backend` in errors).
    pub fn start(
        what: &'static str,
        listen: SocketAddr,
        limits: ConnLimits,
        handler: Handler,
    ) -> Result<ConnServer, Error> {
        let listener = TcpListener::bind(listen)
            .map_err(|e| io_error(what, format_args!("binding {listen}"), &e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| io_error(what, "reading the bound address", &e))?;
        let core = Arc::new(Core {
            what,
            limits: Arc::new(limits),
            clock: Arc::new(Clock(Instant::now())),
            stop: Arc::new(AtomicBool::new(false)),
            conns: Mutex::new(HashMap::new()),
            live: Mutex::new(0),
            live_cv: Condvar::new(),
            watchdog_cv: Condvar::new(),
            watchdog_lock: Mutex::new(()),
            stats: Arc::new(ConnStats::default()),
            handler,
        });
        let mut server = ConnServer {
            addr,
            core: core.clone(),
            accept: None,
            watchdog: None,
        };
        let c = core.clone();
        server.watchdog = Some(
            std::thread::Builder::new()
                .name(format!("ferry-{what}-watchdog"))
                .spawn(move || watchdog(&c))
                .map_err(|e| io_error(what, "spawning the watchdog thread", &e))?,
        );
        let c = core;
        server.accept = Some(
            std::thread::Builder::new()
                .name(format!("ferry-{what}-accept-{}", addr.port()))
                .spawn(move || accept_loop(listener, &c))
                .map_err(|e| io_error(what, "spawning the accept thread", &e))?,
        );
        Ok(server)
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<ConnStats> {
        &self.core.stats
    }

    /// Stop: close the listener and every connection, wait for every thread.
    pub fn stop(&mut self) {
        self.core.stop.store(true, Ordering::Release);
        if let Some(accept) = self.accept.take() {
            // Wake the accept thread with a connection of our own.
            let _unused = TcpStream::connect_timeout(
                &crate::util::wake_addr(self.addr),
                Duration::from_secs(1),
            );
            let _unused = accept.join();
        }
        if let Some(watchdog) = self.watchdog.take() {
            {
                let _guard = lock(&self.core.watchdog_lock);
                self.core.watchdog_cv.notify_all();
            }
            let _unused = watchdog.join();
        }
        for entry in lock(&self.core.conns).values() {
            entry.ctx.state.store(CLOSED, Ordering::Release);
            let _unused = entry.stream.shutdown(Shutdown::Both);
        }
        let mut live = lock(&self.core.live);
        while *live > 0 {
            live = crate::util::wait(&self.core.live_cv, live);
        }
    }
}

impl Drop for ConnServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: TcpListener, core: &Arc<Core>) {
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        if core.stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log::warn!("{} server: accept failed: {e}", core.what);
                // Out of descriptors and the like: do not spin on it.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        next_id += 1;
        admit(core, stream, next_id);
    }
}

/// Find room for a new connection (evicting the longest-waiting non-busy one if the
/// server is full) and start its thread; or close it at once.
fn admit(core: &Arc<Core>, stream: TcpStream, id: u64) {
    let source = stream.peer_addr().ok().map(|a| a.ip());
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let max = core.limits.max_connections;
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let ctx = Arc::new(ConnCtx {
        id,
        peer,
        clock: core.clock.clone(),
        limits: core.limits.clone(),
        state: AtomicU8::new(HANDSHAKE),
        since_ms: AtomicU64::new(0),
        served: AtomicBool::new(false),
        deadline_ms: AtomicU64::new(NEVER),
        stop: core.stop.clone(),
    });
    ctx.enter(HANDSHAKE, Some(core.limits.request_timeout));
    {
        // Threads of evicted connections still winding down count too, up to twice the
        // limit, so a flood of connections cannot pile up threads.
        let live = *lock(&core.live);
        let mut conns = lock(&core.conns);
        let per_source = core.limits.max_connections_per_source;
        let from_source = conns.values().filter(|e| e.source == source).count();
        if from_source >= per_source {
            log::warn!(
                "{} server: refusing {}: {per_source} connections from that address (max_connections_per_source)",
                core.what,
                ctx.peer
            );
            core.stats.refused_source.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if conns.len() >= max || live >= max.saturating_mul(2) {
            let victim = conns
                .iter()
                .filter(|(_, e)| e.ctx.state.load(Ordering::Acquire) != BUSY)
                .min_by_key(|(_, e)| {
                    (
                        e.ctx.served.load(Ordering::Relaxed),
                        e.ctx.since_ms.load(Ordering::Relaxed),
                    )
                })
                .map(|(&id, _)| id);
            match victim {
                Some(v) if live < max.saturating_mul(2) => {
                    core.stats.evicted.fetch_add(1, Ordering::Relaxed);
                    if let Some(e) = conns.remove(&v) {
                        e.ctx.state.store(CLOSED, Ordering::Release);
                        let _unused = e.stream.shutdown(Shutdown::Both);
                        log::info!(
                            "{} server: {max} connections (max_connections): closing the one of {} (waiting the longest) for {}",
                            core.what,
                            e.ctx.peer,
                            ctx.peer
                        );
                    }
                }
                _ => {
                    log::warn!(
                        "{} server: refusing {}: {max} connections, all busy (max_connections)",
                        core.what,
                        ctx.peer
                    );
                    core.stats.refused_full.fetch_add(1, Ordering::Relaxed);
                    // Dropping `stream` and `clone` closes the connection.
                    return;
                }
            }
        }
        conns.insert(
            id,
            Entry {
                stream: clone,
                source,
                ctx: ctx.clone(),
            },
        );
        core.stats.open.store(conns.len(), Ordering::Relaxed);
    }
    *lock(&core.live) += 1;
    core.stats.accepted.fetch_add(1, Ordering::Relaxed);
    let c = core.clone();
    let thread_ctx = ctx.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("ferry-{}-conn-{id}", core.what))
        .stack_size(CONN_STACK_BYTES)
        .spawn(move || {
            let _unused = stream.set_nodelay(true);
            let _unused = stream.set_write_timeout(Some(nonzero(c.limits.write_timeout)));
            (c.handler)(stream, &thread_ctx);
            c.finish(id);
        });
    if let Err(e) = spawned {
        log::warn!(
            "{} server: cannot spawn a connection thread for {}: {e}",
            core.what,
            ctx.peer
        );
        core.finish(id);
    }
}

impl Core {
    /// A connection thread ends (or never started): forget the connection.
    fn finish(&self, id: u64) {
        {
            let mut conns = lock(&self.conns);
            if let Some(e) = conns.remove(&id) {
                let _unused = e.stream.shutdown(Shutdown::Both);
            }
            self.stats.open.store(conns.len(), Ordering::Relaxed);
        }
        let mut live = lock(&self.live);
        *live -= 1;
        if *live == 0 {
            self.live_cv.notify_all();
        }
    }
}

/// Shut down every connection whose deadline passed, a few times per shortest timeout.
fn watchdog(core: &Core) {
    let l = &core.limits;
    let shortest = l.idle_timeout.min(l.request_timeout).min(l.park_timeout);
    let tick = (shortest / 8).clamp(Duration::from_millis(5), Duration::from_millis(250));
    let mut guard = lock(&core.watchdog_lock);
    while !core.stop.load(Ordering::Acquire) {
        guard = crate::util::wait_timeout(&core.watchdog_cv, guard, tick);
        let now = core.clock.now_ms();
        let conns = lock(&core.conns);
        for e in conns.values() {
            let state = e.ctx.state.load(Ordering::Acquire);
            if state == CLOSED || now <= e.ctx.deadline_ms.load(Ordering::Relaxed) {
                continue;
            }
            let what = match state {
                HANDSHAKE => "hello not complete within request_timeout",
                IDLE => "idle past idle_timeout",
                BUSY => "request not complete within request_timeout",
                _ => "parked past park_timeout",
            };
            log::info!(
                "{} server: closing the connection of {}: {what}",
                core.what,
                e.ctx.peer
            );
            // Counted before the shutdown, so whoever sees the close sees the count.
            core.stats.timed_out.fetch_add(1, Ordering::Relaxed);
            e.ctx.state.store(CLOSED, Ordering::Release);
            let _unused = e.stream.shutdown(Shutdown::Both);
        }
    }
}

/// A budget of bytes shared by all connections of a server (request buffers): taking
/// more than is left fails instead of growing.
#[derive(Debug)]
pub struct ByteBudget {
    used: AtomicUsize,
    max: usize,
}

impl ByteBudget {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> ByteBudget {
        ByteBudget {
            used: AtomicUsize::new(0),
            max,
        }
    }

    /// Take `n` bytes; false (and nothing taken) when fewer are left.
    pub fn take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|&t| t <= self.max)
            })
            .is_ok()
    }

    /// Give back `n` bytes taken before.
    pub fn give(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }

    /// Bytes taken now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}
