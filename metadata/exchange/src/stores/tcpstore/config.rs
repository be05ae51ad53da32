//! Settings of the TCPStore store (`FERRY_TCPSTORE_ENDPOINT`, `FERRY_TCPSTORE_PING`,
//! `FERRY_STORE_WATCH_INTERVAL_MS`; table in `config.rs`).

use std::time::Duration;

use ferry_storage::{Error, Subject};

use crate::parse::{check_duration, clamp, parse_ms, parse_switch};
use crate::stream::TlsConfig;

/// Longest TCPStore watch interval; longer ones are clamped with a warning.
pub const WATCH_INTERVAL_MAX: Duration = Duration::from_secs(3600);

/// TCPStore settings.
#[derive(Clone, Debug)]
pub struct TcpStoreConfig {
    /// `HOST:PORT` of the server.
    pub endpoint: String,
    /// Send PING after VALIDATE (servers of torch 2.2-2.4 close the connection on it).
    pub ping: bool,
    /// How often owners refresh their heartbeat (and check their keys) and watchers
    /// check fetched peers: see the liveness bound in `stores/tcpstore/mod.rs`.
    pub watch_interval: Duration,
    /// Mutual TLS to the server (cargo feature `tls`).
    pub tls: Option<TlsConfig>,
}

impl TcpStoreConfig {
    /// Settings for the server at `endpoint`, with defaults for the rest.
    pub fn new(endpoint: impl Into<String>) -> TcpStoreConfig {
        TcpStoreConfig {
            endpoint: endpoint.into(),
            ping: true,
            watch_interval: Duration::from_secs(1),
            tls: None,
        }
    }

    /// The longest time from an owner's last heartbeat to its invalidation at a
    /// watcher with this configuration: 4 × `watch_interval` + `io_timeout` (9 s with
    /// the defaults; see `stores/tcpstore/mod.rs`, "Liveness").
    pub fn liveness_bound(&self, io_timeout: Duration) -> Duration {
        self.watch_interval
            .saturating_mul(4)
            .saturating_add(io_timeout)
    }

    /// The variable that selects this store.
    pub(crate) const SELECT_VAR: &'static str = "FERRY_TCPSTORE_ENDPOINT";

    /// This store's settings, if its selecting variable is set (with its value).
    pub(crate) fn selected(
        get: &impl Fn(&str) -> Option<String>,
    ) -> Option<(String, TcpStoreConfig)> {
        let v = get(Self::SELECT_VAR)?;
        let config = TcpStoreConfig::new(v.trim());
        Some((v, config))
    }

    /// The store's own variables.
    pub(crate) fn apply_overrides(
        &mut self,
        get: &impl Fn(&str) -> Option<String>,
    ) -> Result<(), Error> {
        if let Some(v) = get("FERRY_TCPSTORE_PING") {
            self.ping = parse_switch("FERRY_TCPSTORE_PING", &v)?;
        }
        if let Some(v) = get("FERRY_STORE_WATCH_INTERVAL_MS") {
            self.watch_interval = parse_ms("FERRY_STORE_WATCH_INTERVAL_MS", &v)?;
        }
        Ok(())
    }

    pub(crate) fn clamp(&mut self) {
        clamp(
            &mut self.watch_interval,
            WATCH_INTERVAL_MAX,
            "tcpstore watch_interval",
        );
    }

    pub(crate) fn check(&self) -> Result<(), Error> {
        check_duration(
            "tcpstore watch_interval",
            self.watch_interval,
            WATCH_INTERVAL_MAX,
        )?;
        check_endpoint(&self.endpoint)
    }
}

/// `HOST:PORT` with a port that fits in 16 bits.
fn check_endpoint(endpoint: &str) -> Result<(), Error> {
    let ok = endpoint
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if ok {
        return Ok(());
    }
    Err(Error::invalid(
        Subject::Named(format!("tcpstore endpoint '{}'", endpoint.escape_debug()).into()),
        "expected HOST:PORT",
    ))
}
