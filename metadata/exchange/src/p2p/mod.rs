//! P2P exchange: a listener that peers connect to directly, and the client that
//! connects to theirs (see `client.rs`: a reader thread per outbound connection, fetches
//! on idle connections written by the caller's thread). Wire format in [`frame`].
//!
//! Listener threads: one accept thread and one thread per connection (at most
//! [`crate::P2pConfig::max_connections`]); every read has a timeout (idle timeout
//! between frames, I/O timeout inside one). A malformed, oversized or unauthenticated
//! frame closes only its own connection, with a log line, and counts in
//! [`ListenerStats::connections_refused`].

mod client;
pub mod frame;

pub(crate) use client::Client;

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use ferry_storage::Error;

use crate::events::{Event, Route, FULL_LABEL};
use crate::manager::Shared;
use crate::util::io_error;
use frame::{FrameSettings, FramedConn, Kind, RecvError, Role};

pub(crate) const BACKEND: &str = "p2p";

/// Counters of the listener, for tests and monitoring.
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Connections accepted and served.
    pub connections_accepted: AtomicU64,
    /// Connections closed because of a bad hello or frame (malformed, oversized,
    /// unauthenticated, out of sequence) or over the connection limit.
    pub connections_refused: AtomicU64,
    /// Frames handled (load, send-me, invalidate).
    pub frames_served: AtomicU64,
    /// Loads and invalidations refused because the agent's event queue was full (the
    /// sender got an error frame; the agent gets an overflow event).
    pub frames_dropped: AtomicU64,
}

/// The running listener.
pub(crate) struct Listener {
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
    pub(crate) stats: Arc<ListenerStats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Listener {
    pub(crate) fn start(shared: Arc<Shared>, listen: SocketAddr) -> Result<Listener, Error> {
        let listener = TcpListener::bind(listen).map_err(|e| {
            io_error(
                BACKEND,
                format_args!("binding the listener to {listen}"),
                &e,
            )
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| io_error(BACKEND, "reading the listener address", &e))?;
        if addr.ip().is_unspecified() {
            log::warn!(
                "p2p listener of '{}' listens on all interfaces ({addr})",
                shared.agent
            );
        }
        let conns = Arc::new(Mutex::new(HashMap::new()));
        let threads = Arc::new(Mutex::new(Vec::new()));
        let stats = Arc::new(ListenerStats::default());
        let accept = {
            let (conns, threads, stats) = (conns.clone(), threads.clone(), stats.clone());
            std::thread::Builder::new()
                .name(format!("ferry-p2p-accept-{}", addr.port()))
                .spawn(move || accept_loop(listener, shared, conns, threads, stats))
                .map_err(|e| io_error(BACKEND, "spawning the accept thread", &e))?
        };
        Ok(Listener {
            addr,
            accept: Some(accept),
            conns,
            threads,
            stats,
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop accepting, close every connection, join every thread. The caller has
    /// raised the stop flag.
    pub(crate) fn stop(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        let _unused =
            TcpStream::connect_timeout(&crate::util::wake_addr(self.addr), Duration::from_secs(1));
        let _unused = accept.join();
        for s in lock(&self.conns).values() {
            let _unused = s.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *lock(&self.threads));
        for t in threads {
            let _unused = t.join();
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
    stats: Arc<ListenerStats>,
) {
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        if shared.stopping() {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log::warn!("p2p listener: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        lock(&threads).retain(|t| !t.is_finished());
        if lock(&conns).len() >= shared.config.p2p.max_connections {
            log::warn!(
                "p2p listener: refusing {peer}: {} connections already (max_connections)",
                shared.config.p2p.max_connections
            );
            stats.connections_refused.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        next_id += 1;
        let id = next_id;
        lock(&conns).insert(id, clone);
        stats.connections_accepted.fetch_add(1, Ordering::Relaxed);
        let (shared2, conns2, stats2) = (shared.clone(), conns.clone(), stats.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("ferry-p2p-conn-{id}"))
            .spawn(move || {
                serve_connection(stream, &peer, &shared2, &stats2);
                lock(&conns2).remove(&id);
            });
        match spawned {
            Ok(t) => lock(&threads).push(t),
            Err(e) => {
                log::warn!("p2p listener: cannot spawn a connection thread: {e}");
                if let Some(s) = lock(&conns).remove(&id) {
                    let _unused = s.shutdown(Shutdown::Both);
                }
            }
        }
    }
}

/// Serve one inbound connection until it closes, idles out or breaks the protocol:
/// the hello (as the accepting side), then frames. The peer's identity is the name of
/// its hello, proven by the challenge–response when a secret is set and only claimed
/// otherwise; every frame carries that name (the reader refuses any other), so a
/// `Load` or `Invalidate` is only ever about the connection's own agent.
pub(crate) fn serve_connection(
    stream: TcpStream,
    peer: &str,
    shared: &Shared,
    stats: &ListenerStats,
) {
    let p2p = &shared.config.p2p;
    let _unused = stream.set_nodelay(true);
    let settings = FrameSettings {
        secret: p2p.secret.clone(),
        max_frame_bytes: p2p.max_frame_bytes,
        io_timeout: shared.config.io_timeout,
    };
    let mut conn = match FramedConn::handshake(stream, Role::Accepting, &shared.agent, &settings) {
        Ok(c) => c,
        Err(e) => {
            if !shared.stopping() {
                log::warn!("p2p listener: dropping connection from {peer}: hello: {e}");
                stats.connections_refused.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
    };
    loop {
        let frame = match conn.recv(p2p.idle_timeout) {
            Ok(f) => f,
            Err(RecvError::Closed | RecvError::Idle) => return,
            Err(RecvError::Io(e)) => {
                if !shared.stopping() && !crate::util::is_timeout(&e) {
                    log::warn!("p2p listener: connection from {peer}: {e}");
                }
                return;
            }
            Err(RecvError::Refused(why)) => {
                log::warn!(
                    "p2p listener: dropping connection from {peer} ('{}'): {why}",
                    conn.peer_name().escape_debug()
                );
                stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        let kind = frame.kind;
        // Always the hello's name (checked by the reader).
        let name = frame.name;
        let label = frame.label;
        let checked = if label == FULL_LABEL || kind == Kind::Invalidate {
            Ok(())
        } else {
            crate::check_label(&label)
        };
        if let Err(e) = checked {
            log::warn!("p2p listener: dropping connection from {peer} ('{name}'): {e}");
            stats.connections_refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let event = match kind {
            Kind::Load => Some(Event::Load {
                agent: name,
                label: label.clone(),
                blob: frame.payload,
                route: Route::P2p,
            }),
            Kind::Invalidate => Some(Event::Invalidate {
                agent: name,
                route: Route::P2p,
            }),
            Kind::SendMe => None,
            Kind::Ack | Kind::Error => {
                log::warn!(
                    "p2p listener: dropping connection from {peer} ('{name}'): unsolicited {kind:?} frame"
                );
                stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        let reply = match event {
            Some(event) => {
                if shared.emit(event) {
                    conn.send(Kind::Ack, &shared.agent, "", &[])
                } else if shared.stopping() {
                    return;
                } else {
                    // The agent has not drained its events: the push is dropped (and
                    // reported to our agent as an overflow); the sender is told too.
                    stats.frames_dropped.fetch_add(1, Ordering::Relaxed);
                    let why = format!(
                        "agent '{}' did not take the {kind:?}: its exchange event queue is full",
                        shared.agent
                    );
                    conn.send(Kind::Error, &shared.agent, &label, why.as_bytes())
                }
            }
            None => match shared.local.get(&label) {
                Some(blob) => conn.send(Kind::Load, &shared.agent, &label, &blob),
                None => {
                    let why = format!(
                        "agent '{}' has no metadata under label '{label}'",
                        shared.agent
                    );
                    conn.send(Kind::Error, &shared.agent, &label, why.as_bytes())
                }
            },
        };
        stats.frames_served.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = reply {
            if !shared.stopping() {
                log::warn!("p2p listener: answering {peer}: {e}");
            }
            return;
        }
    }
}
