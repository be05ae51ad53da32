//! The P2P client: outbound connections to peers' listeners.
//!
//! Every connection has a **reader thread** blocked on its socket, so a reply is read
//! by a thread that already waits for it, as in a bare round trip. Requests are
//! written under the connection's writer lock, each after its entry is queued in the
//! connection's FIFO of pending requests (a listener answers in request order).
//!
//! A fetch on an established, idle connection (nothing pending) is written by the
//! caller's own thread: a small frame into an empty send buffer, so it never waits on
//! the network, and no worker has to wake up to send it. Everything else — connecting
//! and the hello, pushing metadata (large frames), invalidations, fetches to peers
//! without an idle connection, and retries — is queued (bounded by the command
//! capacity) in the **lane** of its peer address and done by a small pool of **lane
//! threads** (at most [`LANES_MAX`]): one lane is served by one thread at a time, so
//! requests to a peer keep their order, while lanes run in parallel, so a peer that
//! is slow or unreachable (a connect or hello that takes up to the I/O timeout) holds
//! up only its own lane, never another peer's.
//!
//! A connection that fails (peer closed it, reset, refused a frame) is closed by its
//! reader; its pending requests are retried once on a fresh connection when the
//! connection had been reused (the peer may have closed it while idle), else they fail
//! as events. A reply overdue by the I/O timeout fails the connection.

use std::collections::{HashMap, VecDeque};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use ferry_storage::{Error, Subject};

use super::frame::{FrameReader, FrameSettings, FrameWriter, FramedConn, Kind, RecvError, Role};
use super::BACKEND;
use crate::contract::Shared;
use crate::events::{Event, Route};
use crate::stream::{Stream, TlsContext};
use crate::util::{io_error, is_timeout, lock, nonzero};

/// Most outbound connections kept open for reuse.
const CONN_CACHE_MAX: usize = 64;
/// Most lane threads: peers connected to (or written to) at the same time.
pub(crate) const LANES_MAX: usize = 16;
/// Stack of a lane thread (the hello and frame code keep their buffers on the heap, as
/// the listener's connection threads, which run the same code on 256 KiB).
const LANE_STACK_BYTES: usize = 256 << 10;

/// What a request asks of a peer's listener.
pub(crate) enum Request {
    /// Send me `agent`'s metadata under `label`.
    Fetch { agent: String, label: String },
    /// Load our metadata under `label`.
    Send { label: String, blob: Arc<[u8]> },
    /// Drop our metadata.
    Invalidate,
}

impl Request {
    /// The frame that carries it: kind, label, payload.
    fn frame(&self) -> (Kind, &str, &[u8]) {
        match self {
            Request::Fetch { label, .. } => (Kind::SendMe, label, &[]),
            Request::Send { label, blob } => (Kind::Load, label, blob),
            Request::Invalidate => (Kind::Invalidate, "", &[]),
        }
    }
}

/// Work for a lane.
struct Cmd {
    to: SocketAddr,
    request: Request,
    /// No further retry on a fresh connection.
    retried: bool,
}

/// A request written and not yet answered.
struct Pending {
    request: Request,
    sent_at: Instant,
    /// No retry on a fresh connection if this connection fails.
    retried: bool,
}

/// The pending requests of a connection, in wire order.
#[derive(Default)]
struct PendingQueue {
    requests: VecDeque<Pending>,
    /// The reader has closed the connection: nothing may be added.
    closed: bool,
}

/// One outbound connection.
struct OutConn {
    to: SocketAddr,
    writer: Mutex<FrameWriter>,
    pending: Mutex<PendingQueue>,
    /// A clone of the socket, to shut it down without the writer lock.
    socket: TcpStream,
}

impl OutConn {
    /// Queue `request` as pending and write it, under the writer lock `w`. Returns the
    /// request back if the connection is closed. A write error shuts the socket down:
    /// the reader then settles every pending request, this one included.
    fn write(
        &self,
        w: &mut FrameWriter,
        agent: &str,
        request: Request,
        retried: bool,
    ) -> Result<(), WriteError> {
        let (kind, label, payload) = request.frame();
        if let Err(e) = w.start(kind, agent, label, payload) {
            return Err(WriteError::Invalid(request, e));
        }
        // Keep the payload alive for the write after the request moved into the queue.
        let blob = match &request {
            Request::Send { blob, .. } => Some(blob.clone()),
            _ => None,
        };
        {
            let mut pending = lock(&self.pending);
            if pending.closed {
                // The frame was encoded but is not sent (the writer is out of step), on
                // a connection that is gone anyway.
                return Err(WriteError::Closed(request));
            }
            pending.requests.push_back(Pending {
                request,
                sent_at: Instant::now(),
                retried,
            });
        }
        if w.finish(blob.as_deref().unwrap_or(&[])).is_err() {
            let _unused = self.socket.shutdown(Shutdown::Both);
        }
        Ok(())
    }
}

enum WriteError {
    /// The connection is closed; the request was not written.
    Closed(Request),
    /// The frame is over the size limit; nothing was written.
    Invalid(Request, std::io::Error),
}

/// The lanes: queued commands per peer address, and the pool that serves them.
#[derive(Default)]
struct Lanes {
    /// Commands per peer, in order.
    queued: HashMap<SocketAddr, VecDeque<Cmd>>,
    /// Commands in `queued`, all peers together (bounded by the command capacity).
    queued_len: usize,
    /// Peers with queued commands and no thread serving them, in arrival order.
    ready: VecDeque<SocketAddr>,
    /// Peers a lane thread is serving now.
    busy: Vec<SocketAddr>,
    /// Lane threads waiting for a ready lane.
    idle_threads: usize,
    threads: Vec<JoinHandle<()>>,
    stop: bool,
}

/// State shared by the client handle, its lane threads and the reader threads.
struct Inner {
    shared: Arc<Shared>,
    /// TLS to every peer, when configured.
    tls: Option<TlsContext>,
    lanes: Mutex<Lanes>,
    lanes_cv: Condvar,
    conns: Mutex<HashMap<SocketAddr, Arc<OutConn>>>,
    readers: Mutex<Vec<JoinHandle<()>>>,
}

impl Inner {
    /// Queue `cmd` in its peer's lane, starting a lane thread if none is free (at
    /// most [`LANES_MAX`]). Never waits on the network.
    fn queue(self: &Arc<Self>, cmd: Cmd) -> Result<(), Error> {
        self.queue_or_return(cmd).map_err(|b| b.1)
    }

    /// [`Self::queue`], giving the command back with the error.
    fn queue_or_return(self: &Arc<Self>, cmd: Cmd) -> Result<(), Box<(Cmd, Error)>> {
        let limit = self.shared.config.command_capacity;
        let mut lanes = lock(&self.lanes);
        if lanes.stop {
            return Err(Box::new((
                cmd,
                Error::backend(BACKEND, "the client is stopping"),
            )));
        }
        if lanes.queued_len >= limit {
            let what = "p2p command queue";
            return Err(Box::new((cmd, Error::Capacity { what, limit })));
        }
        let to = cmd.to;
        lanes.queued.entry(to).or_default().push_back(cmd);
        lanes.queued_len += 1;
        if !lanes.busy.contains(&to) && !lanes.ready.contains(&to) {
            lanes.ready.push_back(to);
        }
        let want_thread = lanes.idle_threads == 0 && lanes.threads.len() < LANES_MAX;
        if want_thread {
            lanes.threads.retain(|t| !t.is_finished());
            let inner = self.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("ferry-p2p-lane-{}", self.shared.agent))
                .stack_size(LANE_STACK_BYTES)
                .spawn(move || lane_loop(&inner));
            match spawned {
                Ok(t) => lanes.threads.push(t),
                // The running lane threads get to it.
                Err(e) if !lanes.threads.is_empty() => {
                    log::warn!("p2p: cannot start another lane thread: {e}")
                }
                Err(e) => {
                    let error = io_error(BACKEND, "spawning a lane thread", &e);
                    let lane = lanes.queued.get_mut(&to);
                    if let Some(cmd) = lane.and_then(VecDeque::pop_back) {
                        lanes.queued_len -= 1;
                        return Err(Box::new((cmd, error)));
                    }
                    // Unreachable: the command was just queued.
                    return Ok(());
                }
            }
        }
        drop(lanes);
        self.lanes_cv.notify_one();
        Ok(())
    }

    fn conn(&self, to: SocketAddr) -> Option<Arc<OutConn>> {
        lock(&self.conns).get(&to).cloned()
    }

    /// Forget `conn` (if it is still the connection to its peer).
    fn forget(&self, conn: &Arc<OutConn>) {
        let mut conns = lock(&self.conns);
        if conns.get(&conn.to).is_some_and(|c| Arc::ptr_eq(c, conn)) {
            conns.remove(&conn.to);
        }
    }

    /// Emit the failure of `request` to `to`.
    fn fail(&self, to: SocketAddr, request: Request, error: Error) {
        let event = match request {
            Request::Fetch { agent, label } => Event::FetchFailed {
                agent,
                label,
                error,
            },
            Request::Send { label, .. } => Event::SendFailed {
                target: to.to_string(),
                what: label,
                error,
            },
            Request::Invalidate => Event::SendFailed {
                target: to.to_string(),
                what: "invalidate".into(),
                error,
            },
        };
        self.shared.emit(event);
    }
}

/// The running client: the lanes and the connections with their readers.
pub(crate) struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// The client (lane threads, connections and their readers start on demand).
    pub(crate) fn start(shared: Arc<Shared>) -> Result<Client, Error> {
        let tls = crate::stream::load(shared.config.p2p.tls.as_ref())?;
        let inner = Arc::new(Inner {
            shared,
            tls,
            lanes: Mutex::new(Lanes::default()),
            lanes_cv: Condvar::new(),
            conns: Mutex::new(HashMap::new()),
            readers: Mutex::new(Vec::new()),
        });
        Ok(Client { inner })
    }

    /// Ask the listener at `to` for `agent`'s metadata under `label`. Written on this
    /// thread when an idle connection to `to` exists, else queued in its lane.
    pub(crate) fn fetch(&self, to: SocketAddr, agent: &str, label: &str) -> Result<(), Error> {
        let request = Request::Fetch {
            agent: agent.to_owned(),
            label: label.to_owned(),
        };
        let request = match self.try_direct(to, request) {
            Ok(()) => return Ok(()),
            Err(request) => request,
        };
        self.inner.queue(Cmd {
            to,
            request,
            retried: false,
        })
    }

    /// Write a SendMe on an established connection with nothing pending, without
    /// waiting for anything: the writer lock is only tried, and the send buffer of an
    /// idle request-reply connection is empty, so the frame fits at once.
    fn try_direct(&self, to: SocketAddr, request: Request) -> Result<(), Request> {
        let Some(conn) = self.inner.conn(to) else {
            return Err(request);
        };
        let Ok(mut w) = conn.writer.try_lock() else {
            return Err(request);
        };
        {
            let pending = lock(&conn.pending);
            if pending.closed || !pending.requests.is_empty() {
                return Err(request);
            }
        }
        // Only this thread (holding the writer lock) adds to the queue, so it is still
        // empty unless the reader closed the connection meanwhile (then the frame goes
        // unsent, on a connection that is gone anyway).
        match conn.write(&mut w, &self.inner.shared.agent, request, false) {
            Ok(()) => {
                let counter = &self.inner.shared.direct_fetches;
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            Err(WriteError::Closed(request) | WriteError::Invalid(request, _)) => Err(request),
        }
    }

    /// Push our metadata under `label` to the listener at `to` (through its lane).
    pub(crate) fn send(&self, to: SocketAddr, label: &str, blob: Arc<[u8]>) -> Result<(), Error> {
        self.inner.queue(Cmd {
            to,
            request: Request::Send {
                label: label.to_owned(),
                blob,
            },
            retried: false,
        })
    }

    /// Wait until every queued command has been written (or failed), or `until`
    /// passes; returns how many were left. The manager's drop calls it before the
    /// stop flag goes up, so that what a caller queued last (typically an invalidation
    /// right before the agent goes away) still reaches its peer.
    pub(crate) fn drain(&self, until: Instant) -> usize {
        loop {
            {
                let lanes = lock(&self.inner.lanes);
                let left = lanes.queued_len + lanes.busy.len();
                if left == 0 || Instant::now() >= until {
                    return left;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Tell the listener at `to` to drop our metadata (through its lane).
    pub(crate) fn invalidate(&self, to: SocketAddr) -> Result<(), Error> {
        self.inner.queue(Cmd {
            to,
            request: Request::Invalidate,
            retried: false,
        })
    }
}

impl Drop for Client {
    /// Stop the lane threads, close every connection, join every thread. The manager
    /// has raised the stop flag.
    fn drop(&mut self) {
        let threads = {
            let mut lanes = lock(&self.inner.lanes);
            lanes.stop = true;
            std::mem::take(&mut lanes.threads)
        };
        self.inner.lanes_cv.notify_all();
        for t in threads {
            let _unused = t.join();
        }
        // The lane threads are gone: no connection starts any more.
        for conn in lock(&self.inner.conns).values() {
            let _unused = conn.socket.shutdown(Shutdown::Both);
        }
        let readers = std::mem::take(&mut *lock(&self.inner.readers));
        for r in readers {
            let _unused = r.join();
        }
    }
}

/// A lane thread: serve ready lanes (one at a time, every command of it in order)
/// until the client stops.
fn lane_loop(inner: &Arc<Inner>) {
    let mut lanes = lock(&inner.lanes);
    loop {
        if lanes.stop {
            return;
        }
        let Some(to) = lanes.ready.pop_front() else {
            lanes.idle_threads += 1;
            lanes = crate::util::wait(&inner.lanes_cv, lanes);
            lanes.idle_threads -= 1;
            continue;
        };
        lanes.busy.push(to);
        while let Some(cmd) = lanes.queued.get_mut(&to).and_then(VecDeque::pop_front) {
            lanes.queued_len -= 1;
            drop(lanes);
            if inner.shared.stopping() {
                lanes = lock(&inner.lanes);
                break;
            }
            run_cmd(inner, cmd);
            lanes = lock(&inner.lanes);
        }
        lanes.queued.remove(&to);
        lanes.busy.retain(|a| *a != to);
    }
}

/// One command of a lane: on the connection to its peer, made first if there is none.
fn run_cmd(inner: &Arc<Inner>, cmd: Cmd) {
    let Cmd {
        to,
        request,
        retried,
    } = cmd;
    let (conn, fresh) = match inner.conn(to) {
        Some(conn) => (conn, false),
        None => match connect(inner, to) {
            Ok(conn) => (conn, true),
            Err(error) => {
                inner.fail(to, request, error);
                return;
            }
        },
    };
    let mut w = lock(&conn.writer);
    // A request written on a connection made for it is not retried: the peer refused
    // it, not an idle timeout.
    match conn.write(&mut w, &inner.shared.agent, request, retried || fresh) {
        Ok(()) => {}
        Err(WriteError::Invalid(request, e)) => inner.fail(
            to,
            request,
            Error::invalid(
                Subject::Named(format!("p2p frame to {to}").into()),
                e.to_string(),
            ),
        ),
        Err(WriteError::Closed(request)) => {
            // The reader closed it just now: once more on a fresh connection.
            drop(w);
            inner.forget(&conn);
            if retried {
                inner.fail(to, request, closed_error(to));
            } else {
                let _unused = retry(
                    inner,
                    Cmd {
                        to,
                        request,
                        retried: true,
                    },
                );
            }
        }
    }
}

fn closed_error(to: SocketAddr) -> Error {
    Error::RemoteDisconnect {
        subject: Subject::Named(format!("p2p listener at {to} (closed the connection)").into()),
    }
}

/// Connect to `to`, exchange hellos, start the connection's reader.
fn connect(inner: &Arc<Inner>, to: SocketAddr) -> Result<Arc<OutConn>, Error> {
    let config = &inner.shared.config;
    let stream = TcpStream::connect_timeout(&to, config.io_timeout)
        .map_err(|e| io_error(BACKEND, format_args!("connecting to {to}"), &e))?;
    let _unused = stream.set_nodelay(true);
    let _unused = stream.set_write_timeout(Some(nonzero(config.io_timeout)));
    let socket = stream
        .try_clone()
        .map_err(|e| io_error(BACKEND, format_args!("connection to {to}"), &e))?;
    let stream = match &inner.tls {
        None => Stream::Plain(stream),
        Some(tls) => {
            let _unused = stream.set_read_timeout(Some(nonzero(config.io_timeout)));
            tls.connect(stream, &to.ip().to_string())
                .map_err(|e| io_error(BACKEND, format_args!("TLS to {to}"), &e))?
        }
    };
    let settings = FrameSettings {
        secret: config.p2p.secret.clone(),
        max_frame_bytes: config.p2p.max_frame_bytes,
        io_timeout: config.io_timeout,
    };
    let conn = FramedConn::handshake(stream, Role::Connecting, &inner.shared.agent, &settings)
        .map_err(|e| recv_error(&e, to, "hello"))?;
    let (writer, reader) = conn.into_split();
    let conn = Arc::new(OutConn {
        to,
        writer: Mutex::new(writer),
        pending: Mutex::new(PendingQueue::default()),
        socket,
    });
    {
        let mut conns = lock(&inner.conns);
        if conns.len() >= CONN_CACHE_MAX {
            if let Some(victim) = conns.keys().next().copied() {
                if let Some(old) = conns.remove(&victim) {
                    // Its reader settles what it had pending.
                    let _unused = old.socket.shutdown(Shutdown::Both);
                }
            }
        }
        conns.insert(to, conn.clone());
    }
    let spawned = {
        let (inner2, conn2) = (inner.clone(), conn.clone());
        std::thread::Builder::new()
            .name(format!("ferry-p2p-reader-{}", to.port()))
            .spawn(move || read_loop(&inner2, &conn2, reader))
    };
    match spawned {
        Ok(t) => {
            let mut readers = lock(&inner.readers);
            readers.retain(|t| !t.is_finished());
            readers.push(t);
            Ok(conn)
        }
        Err(e) => {
            inner.forget(&conn);
            Err(io_error(BACKEND, "spawning a connection reader", &e))
        }
    }
}

/// Read replies of one connection until it fails or the client stops; then close it
/// and settle what is pending.
fn read_loop(inner: &Arc<Inner>, conn: &Arc<OutConn>, mut reader: FrameReader) {
    let shared = &inner.shared;
    let io_timeout = shared.config.io_timeout;
    let failure = loop {
        match reader.recv(io_timeout) {
            Ok(frame) => {
                let Some(p) = lock(&conn.pending).requests.pop_front() else {
                    break Some(RecvError::Refused(format!(
                        "unsolicited {:?} frame",
                        frame.kind
                    )));
                };
                deliver(inner, conn.to, p.request, frame);
            }
            Err(RecvError::Idle) => {
                if shared.stopping() {
                    break None;
                }
                let overdue = lock(&conn.pending)
                    .requests
                    .front()
                    .is_some_and(|p| p.sent_at.elapsed() >= io_timeout);
                if overdue {
                    break Some(RecvError::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no reply within the I/O timeout",
                    )));
                }
            }
            Err(e) => break Some(e),
        }
    };
    inner.forget(conn);
    let _unused = conn.socket.shutdown(Shutdown::Both);
    let pending = {
        let mut pending = lock(&conn.pending);
        pending.closed = true;
        std::mem::take(&mut pending.requests)
    };
    let Some(failure) = failure else {
        return;
    };
    if shared.stopping() {
        return;
    }
    let stale = matches!(failure, RecvError::Closed)
        || matches!(&failure, RecvError::Io(io) if !is_timeout(io));
    for p in pending {
        if stale && !p.retried {
            let cmd = Cmd {
                to: conn.to,
                request: p.request,
                retried: true,
            };
            // `retry` reports the request failed if it cannot be queued.
            if let Err(error) = retry(inner, cmd) {
                log::warn!("p2p: cannot retry a request to {}: {error}", conn.to);
            }
        } else {
            inner.fail(conn.to, p.request, recv_error(&failure, conn.to, "reply"));
        }
    }
}

/// Queue `cmd` again; if that fails, report the request failed.
fn retry(inner: &Arc<Inner>, cmd: Cmd) -> Result<(), Error> {
    if lock(&inner.lanes).stop {
        return Ok(());
    }
    match inner.queue_or_return(cmd) {
        Ok(()) => Ok(()),
        Err(failed) => {
            let (cmd, error) = *failed;
            let error = match error {
                Error::Capacity { limit, .. } => Error::Capacity {
                    what: "p2p command queue (retrying a request)",
                    limit,
                },
                other => other,
            };
            inner.fail(cmd.to, cmd.request, error.clone());
            Err(error)
        }
    }
}

/// Turn the reply to `request` into its event (none for a successful push).
fn deliver(inner: &Inner, to: SocketAddr, request: Request, reply: super::frame::Frame) {
    let shared = &inner.shared;
    match request {
        Request::Fetch { agent, label } => {
            let event = match reply.kind {
                Kind::Load if reply.name != agent || reply.label != label => Event::FetchFailed {
                    error: Error::Mismatch {
                        subject: Subject::PeerName(agent.clone()),
                        reason: format!(
                            "the listener at {to} answered with agent '{}' label '{}'",
                            reply.name, reply.label
                        )
                        .into(),
                    },
                    agent,
                    label,
                },
                Kind::Load => Event::Load {
                    agent,
                    label,
                    blob: reply.payload,
                    route: Route::P2p,
                },
                Kind::Error => Event::FetchFailed {
                    error: Error::not_found(Subject::Named(
                        format!(
                            "metadata '{label}' at {to}: {}",
                            String::from_utf8_lossy(&reply.payload)
                        )
                        .into(),
                    )),
                    agent,
                    label,
                },
                other => Event::FetchFailed {
                    error: Error::backend(
                        BACKEND,
                        format!("{to} answered a send-me with a {other:?} frame"),
                    ),
                    agent,
                    label,
                },
            };
            shared.emit(event);
        }
        request @ (Request::Send { .. } | Request::Invalidate) => {
            let refused = match reply.kind {
                Kind::Ack => return,
                Kind::Error => format!("{to} refused: {}", String::from_utf8_lossy(&reply.payload)),
                other => format!("{to} answered with a {other:?} frame"),
            };
            inner.fail(to, request, Error::backend(BACKEND, refused));
        }
    }
}

fn recv_error(e: &RecvError, to: SocketAddr, what: &str) -> Error {
    match e {
        RecvError::Io(io) => io_error(BACKEND, format_args!("{what} from {to}"), io),
        RecvError::Closed => closed_error(to),
        RecvError::Idle => io_error(
            BACKEND,
            format_args!("{what} from {to}"),
            &std::io::Error::from(std::io::ErrorKind::TimedOut),
        ),
        RecvError::Refused(why) => Error::backend(BACKEND, format!("{what} from {to}: {why}")),
    }
}
