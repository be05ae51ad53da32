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
pub(crate) mod config;
pub mod frame;

pub use config::P2pConfig;

pub(crate) use client::Client;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ferry_storage::Error;

use crate::conn_server::{ConnCtx, ConnLimits, ConnServer, ConnStats};
use crate::contract::Shared;
use crate::events::{Event, Route, FULL_LABEL};
use crate::stream::Stream;
use frame::{FrameSettings, FramedConn, Kind, RecvError, Role};

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
    /// Loads and invalidations refused because the agent's event queue was full (the
    /// sender got an error frame; the agent gets an overflow event).
    pub frames_dropped: AtomicU64,
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
            max_connections_per_source: p2p.max_connections_per_source,
            idle_timeout: p2p.idle_timeout,
            request_timeout: shared.config.io_timeout,
            park_timeout: p2p.idle_timeout,
            write_timeout: shared.config.io_timeout,
        };
        let stats = Arc::new(ListenerStats::default());
        let tls = crate::stream::load(p2p.tls.as_ref())?;
        let (handler_shared, handler_stats) = (shared.clone(), stats.clone());
        let server = ConnServer::start(
            BACKEND,
            listen,
            limits,
            Arc::new(move |stream, ctx: &Arc<ConnCtx>| {
                handler_stats
                    .connections_accepted
                    .fetch_add(1, Ordering::Relaxed);
                let stream = match &tls {
                    None => Stream::Plain(stream),
                    // The handshake deadline of the core covers the TLS handshake.
                    Some(tls) => match tls.accept(stream) {
                        Ok(s) => s,
                        Err(e) => {
                            if !handler_shared.stopping() {
                                log::warn!("p2p listener: TLS from {}: {e}", ctx.peer());
                                handler_stats
                                    .connections_refused
                                    .fetch_add(1, Ordering::Relaxed);
                            }
                            return;
                        }
                    },
                };
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
    pub(crate) fn conn_stats(&self) -> &ConnStats {
        self.server.stats()
    }

    /// Stop accepting, close every connection, join every thread. The caller has
    /// raised the stop flag.
    pub(crate) fn stop(&mut self) {
        self.server.stop();
    }
}

/// Serve one inbound connection until it closes, idles out or breaks the protocol:
/// the hello (as the accepting side), then frames. The peer's identity is the name of
/// its hello, proven by the challenge–response when a secret is set and only claimed
/// otherwise; every frame carries that name (the reader refuses any other), so a
/// `Load` or `Invalidate` is only ever about the connection's own agent. `ctx` carries
/// the connection-server core's deadlines.
pub(crate) fn serve_connection(
    stream: Stream,
    ctx: &ConnCtx,
    shared: &Shared,
    stats: &ListenerStats,
) {
    let peer = ctx.peer();
    let p2p = &shared.config.p2p;
    let _unused = stream.socket().set_nodelay(true);
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
        ctx.served();
        if let Err(e) = reply {
            if !shared.stopping() {
                log::warn!("p2p listener: answering {peer}: {e}");
            }
            return;
        }
    }
}
