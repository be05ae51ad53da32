//! Settings of the P2P listener and client (`FERRY_P2P_*`, see `config.rs`).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ferry_storage::{Error, Subject};

use crate::parse::{bad_var, check_duration, clamp, parse_addr_or_off, TIMEOUT_MAX};
use crate::stream::TlsConfig;

/// The P2P listener and frame settings.
#[derive(Clone)]
pub struct P2pConfig {
    /// Where to listen; `None`: no listener. Listening on all interfaces (`0.0.0.0`)
    /// must be asked for explicitly.
    pub listen: Option<SocketAddr>,
    /// Shared secret; when set, both sides of a connection prove they know it in the
    /// hello (a mutual challenge–response that also proves the agent names) and every
    /// frame carries HMAC-SHA256 tags; anything else is refused. Without it the
    /// listener trusts anyone who can connect, under any name they claim.
    pub secret: Option<Arc<[u8]>>,
    /// Largest frame accepted or sent, in bytes.
    pub max_frame_bytes: usize,
    /// An inbound connection idle this long is closed.
    pub idle_timeout: Duration,
    /// Most inbound connections served at once; more are closed at accept.
    pub max_connections: usize,
    /// Most inbound connections from one source IP address; more are refused at accept
    /// (so one address cannot take the listener over through the eviction at
    /// `max_connections`).
    pub max_connections_per_source: usize,
    /// Mutual TLS on the listener and the client (cargo feature `tls`): every peer of
    /// the group must use it.
    pub tls: Option<TlsConfig>,
}

impl std::fmt::Debug for P2pConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2pConfig")
            .field("listen", &self.listen)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("max_frame_bytes", &self.max_frame_bytes)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_connections", &self.max_connections)
            .field(
                "max_connections_per_source",
                &self.max_connections_per_source,
            )
            .field("tls", &self.tls)
            .finish()
    }
}

impl Default for P2pConfig {
    fn default() -> P2pConfig {
        P2pConfig {
            listen: None,
            secret: None,
            max_frame_bytes: 64 << 20,
            idle_timeout: Duration::from_secs(60),
            max_connections: 64,
            max_connections_per_source: 32,
            tls: None,
        }
    }
}

impl P2pConfig {
    /// Loopback, ephemeral port: the default when listening is wanted.
    pub const LOOPBACK_EPHEMERAL: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);

    /// The `FERRY_P2P_*` variables (`config.rs` module docs).
    pub(crate) fn apply_overrides(
        &mut self,
        get: &impl Fn(&str) -> Option<String>,
    ) -> Result<(), Error> {
        if let Some(v) = get("FERRY_P2P_LISTEN") {
            self.listen = parse_addr_or_off("FERRY_P2P_LISTEN", &v)?;
        }
        if let Some(v) = get("FERRY_P2P_SECRET") {
            self.secret = Some(Arc::from(v.as_bytes()));
        }
        if let Some(v) = get("FERRY_P2P_MAX_FRAME_BYTES") {
            self.max_frame_bytes = v.trim().parse().map_err(|_| {
                bad_var(
                    "FERRY_P2P_MAX_FRAME_BYTES",
                    &v,
                    "expected a number of bytes",
                )
            })?;
        }
        Ok(())
    }

    pub(crate) fn clamp(&mut self) {
        clamp(&mut self.idle_timeout, TIMEOUT_MAX, "p2p.idle_timeout");
    }

    pub(crate) fn check(&self) -> Result<(), Error> {
        let named = |what: String, reason: &'static str| {
            Err(Error::invalid(Subject::Named(what.into()), reason))
        };
        check_duration("p2p.idle_timeout", self.idle_timeout, TIMEOUT_MAX)?;
        if self.max_frame_bytes < 1024 {
            return named(
                format!("p2p.max_frame_bytes = {}", self.max_frame_bytes),
                "must be at least 1024",
            );
        }
        if self.max_frame_bytes > u32::MAX as usize {
            return named(
                format!("p2p.max_frame_bytes = {}", self.max_frame_bytes),
                "must fit in 32 bits",
            );
        }
        if self.max_connections == 0 {
            return named("p2p.max_connections = 0".into(), "must be above zero");
        }
        if self.max_connections_per_source == 0 {
            return named(
                "p2p.max_connections_per_source = 0".into(),
                "must be above zero",
            );
        }
        if matches!(&self.secret, Some(s) if s.is_empty()) {
            return named("p2p.secret".into(), "must not be empty");
        }
        Ok(())
    }
}
