//! P2P exchange: a listener that peers connect to directly, and the client that
//! connects to theirs (see `client.rs`: a reader thread per outbound connection, fetches
//! on idle connections written by the caller's thread). Wire format in [`frame`].
//!
//! Listener threads: the connection-server core (`conn_server.rs`): one accept
//! thread, one thread per connection (at most [`crate::P2pConfig::max_connections`];
//! at the limit the connection idle the longest makes room), a watchdog that closes a
//! connection whose hello is not done within the I/O timeout, or whose next frame is
//! not whole within the idle plus the I/O timeout. A malformed, oversized or unauthenticated
//! frame closes only its own connection, with a log line, and counts in
//! [`ListenerStats::connections_refused`].

mod client;
pub mod frame;

pub(crate) use client::Client;

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ferry_storage::Error;

use crate::conn_server::{ConnCtx, ConnLimits, ConnServer, ConnStats};
use crate::events::{Event, Route, FULL_LABEL};
use crate::manager::Shared;
use frame::{FramedConn, Kind, RecvError};

pub(crate) const BACKEND: &str = "p2p";

/// Counters of the listener, for tests and monitoring.
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Connections accepted and served.
    pub connections_accepted: AtomicU64,
    /// Connections closed because of a bad hello or frame (malformed, oversized,
    /// unauthenticated, out of sequence). Connections refused or evicted at the
    /// connection limit, or closed at a deadline, are counted by the server core.
    pub connections_refused: AtomicU64,
    /// Frames handled (load, send-me, invalidate).
    pub frames_served: AtomicU64,
}

/// The running listener: the shared connection-server core ([`crate::conn_server`])
/// with [`serve_connection`] as the handler of each connection.
pub(crate) struct Listener {
    server: ConnServer,
    pub(crate) stats: Arc<ListenerStats>,
}

impl Listener {
    pub(crate) fn start(shared: Arc<Shared>, listen: SocketAddr) -> Result<Listener, Error> {
        let p2p = &shared.config.p2p;
        // The hello and each frame must arrive whole within the I/O timeout of their
        // first byte; a connection between frames is closed after the idle timeout.
        let limits = ConnLimits {
            max_connections: p2p.max_connections,
            idle_timeout: p2p.idle_timeout,
            request_timeout: shared.config.io_timeout,
            park_timeout: p2p.idle_timeout,
            write_timeout: shared.config.io_timeout,
        };
        let stats = Arc::new(ListenerStats::default());
        let (handler_shared, handler_stats) = (shared.clone(), stats.clone());
        let server = ConnServer::start(
            BACKEND,
            listen,
            limits,
            Arc::new(move |stream, ctx: &Arc<ConnCtx>| {
                handler_stats
                    .connections_accepted
                    .fetch_add(1, Ordering::Relaxed);
                serve_connection(stream, ctx, &handler_shared, &handler_stats);
            }),
        )?;
        let addr = server.local_addr();
        if addr.ip().is_unspecified() {
            log::warn!(
                "p2p listener of '{}' listens on all interfaces ({addr})",
                shared.agent
            );
        }
        Ok(Listener { server, stats })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// Counters of the connection-server core (refused at the limit, evicted, timed
    /// out).
    #[allow(dead_code)]
    pub(crate) fn conn_stats(&self) -> &ConnStats {
        self.server.stats()
    }

    /// Stop accepting, close every connection, join every thread. The caller has
    /// raised the stop flag.
    pub(crate) fn stop(&mut self) {
        self.server.stop();
    }
}

/// Serve one inbound connection: the hello, then frames until the peer closes, goes
/// idle or breaks the protocol. `ctx` carries the core's deadlines.
fn serve_connection(stream: TcpStream, ctx: &ConnCtx, shared: &Shared, stats: &ListenerStats) {
    let peer = ctx.peer();
    let p2p = &shared.config.p2p;
    let _unused = stream.set_nodelay(true);
    let mut conn = match FramedConn::handshake(
        stream,
        p2p.secret.clone(),
        p2p.max_frame_bytes,
        shared.config.io_timeout,
    ) {
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
        // The frame reader buffers ahead, so the first byte of a frame is not seen
        // here: the next frame must be whole within idle + I/O timeout.
        ctx.idle_then_busy();
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
                log::warn!("p2p listener: dropping connection from {peer}: {why}");
                stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        let kind = frame.kind;
        let name = frame.name;
        let label = frame.label;
        let checked = crate::check_agent_name(&name).and_then(|()| {
            if label == FULL_LABEL || kind == Kind::Invalidate {
                Ok(())
            } else {
                crate::check_label(&label)
            }
        });
        if let Err(e) = checked {
            log::warn!("p2p listener: dropping connection from {peer}: {e}");
            stats.connections_refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let reply = match kind {
            Kind::Load => {
                let event = Event::Load {
                    agent: name,
                    label,
                    blob: frame.payload,
                    route: Route::P2p,
                };
                if !shared.emit(event) {
                    return;
                }
                conn.send(Kind::Ack, &shared.agent, "", &[])
            }
            Kind::Invalidate => {
                if !shared.emit(Event::Invalidate {
                    agent: name,
                    route: Route::P2p,
                }) {
                    return;
                }
                conn.send(Kind::Ack, &shared.agent, "", &[])
            }
            Kind::SendMe => match shared.local.get(&label) {
                Some(blob) => conn.send(Kind::Load, &shared.agent, &label, &blob),
                None => {
                    let why = format!(
                        "agent '{}' has no metadata under label '{label}'",
                        shared.agent
                    );
                    conn.send(Kind::Error, &shared.agent, &label, why.as_bytes())
                }
            },
            Kind::Ack | Kind::Error => {
                log::warn!(
                    "p2p listener: dropping connection from {peer}: unsolicited {kind:?} frame"
                );
                stats.connections_refused.fetch_add(1, Ordering::Relaxed);
                return;
            }
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
