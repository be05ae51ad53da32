//! Configuration of the metadata exchange, from the agent config with environment
//! variables as overrides.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `FERRY_P2P_LISTEN` | `HOST:PORT` to run the P2P listener on (port 0: ephemeral), or `off` | off (agent config decides) |
//! | `FERRY_P2P_SECRET` | shared secret: P2P frames are authenticated with HMAC-SHA256 | none (no authentication) |
//! | `FERRY_P2P_MAX_FRAME_BYTES` | largest P2P frame accepted or sent | 64 MiB |
//! | `FERRY_EXCHANGE_IO_TIMEOUT_MS` | bound on every connect, read and write | 5000 |
//! | `FERRY_EXCHANGE_FETCH_TIMEOUT_MS` | how long a fetch waits for the peer to publish | 10000 |
//! | `FERRY_STORE_NAMESPACE` | key prefix in etcd and TCPStore: keys are `<namespace>/<agent>/<label>` | `ferry/agents` |
//! | `FERRY_ETCD_ENDPOINTS` | comma-separated etcd endpoints (`http://127.0.0.1:2379`); selects etcd | none |
//! | `FERRY_ETCD_LEASE_TTL_S` | lease of published keys; a crashed agent's keys expire after it | 10 |
//! | `FERRY_TCPSTORE_ENDPOINT` | `HOST:PORT` of one TCPStore server; selects TCPStore | none |
//! | `FERRY_TCPSTORE_PING` | `1`/`0`: send PING after VALIDATE (torch >= 2.5 servers need not; 2.2-2.4 die on it) | 1 |
//! | `FERRY_TCPSTORE_SERVE` | `HOST:PORT` on which the agent runs Ferry's own TCPStore server (and uses it when no store is set), or `off` | off |
//! | `FERRY_TCPSTORE_MAX_*`, `FERRY_TCPSTORE_*_TIMEOUT_MS` | limits of the embedded (and `ferry store serve`) TCPStore server: the table in the crate README | see there |
//! | `FERRY_STORE_WATCH_INTERVAL_MS` | how often TCPStore looks for deleted keys of fetched peers | 1000 |
//!
//! Setting both `FERRY_ETCD_ENDPOINTS` and `FERRY_TCPSTORE_ENDPOINT` is an error.

use std::borrow::Cow;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ferry_storage::{Error, Subject};

/// Default prefix of store keys.
pub const DEFAULT_NAMESPACE: &str = "ferry/agents";

/// Everything the exchange needs to know.
#[derive(Clone, Debug)]
pub struct ExchangeConfig {
    /// The P2P listener and frames.
    pub p2p: P2pConfig,
    /// The name-addressed store, if any.
    pub store: StoreConfig,
    /// Key prefix in the store, without a trailing `/` (normalized by [`Self::namespace`]).
    pub namespace: String,
    /// Run Ferry's own TCPStore server on this address; when `store` is
    /// [`StoreConfig::None`] the agent then uses it as its TCPStore.
    pub embedded_store: Option<SocketAddr>,
    /// Limits of the embedded TCPStore server (`FERRY_TCPSTORE_MAX_*` and
    /// `FERRY_TCPSTORE_*_TIMEOUT_MS`; see the crate README).
    pub embedded_store_limits: crate::tcpstore::ServerConfig,
    /// Bound on every connect, read and write of a worker.
    pub io_timeout: Duration,
    /// How long a fetch waits for the peer's metadata to be published.
    pub fetch_timeout: Duration,
    /// Capacity of the event queue the agent drains.
    pub event_capacity: usize,
    /// Capacity of each worker's command queue; a full queue is an error for the caller.
    pub command_capacity: usize,
}

/// The P2P listener and frame settings.
#[derive(Clone, Debug)]
pub struct P2pConfig {
    /// Where to listen; `None`: no listener. Listening on all interfaces (`0.0.0.0`)
    /// must be asked for explicitly.
    pub listen: Option<SocketAddr>,
    /// Shared secret; when set, every frame carries an HMAC-SHA256 tag and frames
    /// without a valid one are refused (both directions).
    pub secret: Option<Arc<[u8]>>,
    /// Largest frame accepted or sent, in bytes.
    pub max_frame_bytes: usize,
    /// An inbound connection idle this long is closed.
    pub idle_timeout: Duration,
    /// Most inbound connections served at once; more are closed at accept.
    pub max_connections: usize,
}

/// Which name-addressed store the agent uses.
#[derive(Clone, Debug, Default)]
pub enum StoreConfig {
    /// No store: name-based calls fail unless an embedded store is configured.
    #[default]
    None,
    /// etcd (needs the crate's `etcd` feature).
    Etcd(EtcdConfig),
    /// A TCPStore server (torch's or Ferry's own).
    TcpStore(TcpStoreConfig),
}

/// etcd settings.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Endpoints such as `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// TTL of the lease that published keys are attached to.
    pub lease_ttl: Duration,
}

/// TCPStore settings.
#[derive(Clone, Debug)]
pub struct TcpStoreConfig {
    /// `HOST:PORT` of the server.
    pub endpoint: String,
    /// Send PING after VALIDATE (servers of torch 2.2-2.4 close the connection on it).
    pub ping: bool,
    /// How often fetched peers' keys are checked for deletion.
    pub watch_interval: Duration,
}

impl TcpStoreConfig {
    /// Settings for the server at `endpoint`, with defaults for the rest.
    pub fn new(endpoint: impl Into<String>) -> TcpStoreConfig {
        TcpStoreConfig {
            endpoint: endpoint.into(),
            ping: true,
            watch_interval: Duration::from_secs(1),
        }
    }
}

impl EtcdConfig {
    /// Settings for the given endpoints, with defaults for the rest.
    pub fn new(endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            lease_ttl: Duration::from_secs(10),
        }
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
        }
    }
}

impl P2pConfig {
    /// Loopback, ephemeral port: the default when listening is wanted.
    pub const LOOPBACK_EPHEMERAL: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
}

impl Default for ExchangeConfig {
    fn default() -> ExchangeConfig {
        ExchangeConfig {
            p2p: P2pConfig::default(),
            store: StoreConfig::None,
            namespace: DEFAULT_NAMESPACE.to_owned(),
            embedded_store: None,
            embedded_store_limits: crate::tcpstore::ServerConfig::default(),
            io_timeout: Duration::from_secs(5),
            fetch_timeout: Duration::from_secs(10),
            event_capacity: 1024,
            command_capacity: 1024,
        }
    }
}

fn bad_var(name: &'static str, value: &str, reason: &'static str) -> Error {
    Error::invalid(
        Subject::Named(format!("environment variable {name}='{value}'").into()),
        reason,
    )
}

fn parse_ms(name: &'static str, v: &str) -> Result<Duration, Error> {
    v.trim()
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| bad_var(name, v, "expected a whole number of milliseconds"))
}

fn parse_addr_or_off(name: &'static str, v: &str) -> Result<Option<SocketAddr>, Error> {
    let v = v.trim();
    if v.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    v.parse()
        .map(Some)
        .map_err(|_| bad_var(name, v, "expected IP:PORT (e.g. 127.0.0.1:0) or 'off'"))
}

impl ExchangeConfig {
    /// This config with the `FERRY_*` environment variables (module docs) applied.
    pub fn with_env_overrides(self) -> Result<ExchangeConfig, Error> {
        self.with_overrides(|name| std::env::var(name).ok())
    }

    /// This config with overrides looked up through `var` (the environment, or a map
    /// in tests). Unset or empty variables change nothing.
    pub fn with_overrides(
        mut self,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<ExchangeConfig, Error> {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if let Some(v) = get("FERRY_P2P_LISTEN") {
            self.p2p.listen = parse_addr_or_off("FERRY_P2P_LISTEN", &v)?;
        }
        if let Some(v) = get("FERRY_P2P_SECRET") {
            self.p2p.secret = Some(Arc::from(v.as_bytes()));
        }
        if let Some(v) = get("FERRY_P2P_MAX_FRAME_BYTES") {
            self.p2p.max_frame_bytes = v.trim().parse().map_err(|_| {
                bad_var(
                    "FERRY_P2P_MAX_FRAME_BYTES",
                    &v,
                    "expected a number of bytes",
                )
            })?;
        }
        if let Some(v) = get("FERRY_EXCHANGE_IO_TIMEOUT_MS") {
            self.io_timeout = parse_ms("FERRY_EXCHANGE_IO_TIMEOUT_MS", &v)?;
        }
        if let Some(v) = get("FERRY_EXCHANGE_FETCH_TIMEOUT_MS") {
            self.fetch_timeout = parse_ms("FERRY_EXCHANGE_FETCH_TIMEOUT_MS", &v)?;
        }
        if let Some(v) = get("FERRY_STORE_NAMESPACE") {
            self.namespace = v;
        }
        if let Some(v) = get("FERRY_TCPSTORE_SERVE") {
            self.embedded_store = parse_addr_or_off("FERRY_TCPSTORE_SERVE", &v)?;
        }
        self.embedded_store_limits = self.embedded_store_limits.with_overrides(get)?;
        let etcd = get("FERRY_ETCD_ENDPOINTS");
        let tcpstore = get("FERRY_TCPSTORE_ENDPOINT");
        match (etcd, tcpstore) {
            (Some(e), Some(t)) => {
                return Err(Error::invalid(
                    Subject::Named(
                        format!("FERRY_ETCD_ENDPOINTS='{e}' and FERRY_TCPSTORE_ENDPOINT='{t}'")
                            .into(),
                    ),
                    "both are set; choose one metadata store",
                ))
            }
            (Some(e), None) => {
                let endpoints: Vec<String> = e
                    .split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
                    .collect();
                self.store = StoreConfig::Etcd(EtcdConfig::new(endpoints));
            }
            (None, Some(t)) => {
                self.store = StoreConfig::TcpStore(TcpStoreConfig::new(t.trim()));
            }
            (None, None) => {}
        }
        match &mut self.store {
            StoreConfig::Etcd(etcd) => {
                if let Some(v) = get("FERRY_ETCD_LEASE_TTL_S") {
                    let secs: u64 = v.trim().parse().map_err(|_| {
                        bad_var("FERRY_ETCD_LEASE_TTL_S", &v, "expected whole seconds")
                    })?;
                    etcd.lease_ttl = Duration::from_secs(secs);
                }
            }
            StoreConfig::TcpStore(ts) => {
                if let Some(v) = get("FERRY_TCPSTORE_PING") {
                    ts.ping = match v.trim() {
                        "1" | "true" | "on" => true,
                        "0" | "false" | "off" => false,
                        _ => return Err(bad_var("FERRY_TCPSTORE_PING", &v, "expected 1 or 0")),
                    };
                }
                if let Some(v) = get("FERRY_STORE_WATCH_INTERVAL_MS") {
                    ts.watch_interval = parse_ms("FERRY_STORE_WATCH_INTERVAL_MS", &v)?;
                }
            }
            StoreConfig::None => {}
        }
        self.check()?;
        Ok(self)
    }

    /// Check the values for what would fail later.
    pub fn check(&self) -> Result<(), Error> {
        let named = |what: String, reason: &'static str| {
            Err(Error::invalid(Subject::Named(Cow::Owned(what)), reason))
        };
        if self.io_timeout.is_zero() {
            return named("io_timeout".into(), "must be above zero");
        }
        if self.p2p.max_frame_bytes < 1024 {
            return named(
                format!("p2p.max_frame_bytes = {}", self.p2p.max_frame_bytes),
                "must be at least 1024",
            );
        }
        if self.p2p.max_frame_bytes > u32::MAX as usize {
            return named(
                format!("p2p.max_frame_bytes = {}", self.p2p.max_frame_bytes),
                "must fit in 32 bits",
            );
        }
        if matches!(&self.p2p.secret, Some(s) if s.is_empty()) {
            return named("p2p.secret".into(), "must not be empty");
        }
        if self.event_capacity == 0 || self.command_capacity == 0 {
            return named(
                "event_capacity/command_capacity".into(),
                "must be above zero",
            );
        }
        if let StoreConfig::Etcd(etcd) = &self.store {
            if etcd.endpoints.is_empty() {
                return named("etcd endpoints".into(), "empty list");
            }
            if etcd.lease_ttl < Duration::from_secs(1) {
                return named("etcd lease_ttl".into(), "must be at least 1 s");
            }
        }
        if let StoreConfig::TcpStore(ts) = &self.store {
            if ts.watch_interval.is_zero() {
                return named("tcpstore watch_interval".into(), "must be above zero");
            }
        }
        self.normalized_namespace().map(|_| ())
    }

    /// The namespace without trailing `/`; empty segments (`a//b`) are refused.
    pub fn normalized_namespace(&self) -> Result<String, Error> {
        let ns = self.namespace.trim_end_matches('/');
        let body = ns.strip_prefix('/').unwrap_or(ns);
        if !body.is_empty() && body.split('/').any(str::is_empty) {
            return Err(Error::invalid(
                Subject::Named(format!("store namespace '{}'", self.namespace).into()),
                "contains an empty path segment ('//')",
            ));
        }
        Ok(ns.to_owned())
    }
}

/// The store key of `agent`'s metadata under `label`: `<namespace>/<agent>/<label>`.
pub(crate) fn store_key(namespace: &str, agent: &str, label: &str) -> String {
    if namespace.is_empty() {
        format!("{agent}/{label}")
    } else {
        format!("{namespace}/{agent}/{label}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> Result<ExchangeConfig, Error> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ExchangeConfig::default().with_overrides(|k| map.get(k).cloned())
    }

    #[test]
    fn env_overrides_apply() {
        let c = with(&[
            ("FERRY_P2P_LISTEN", "127.0.0.1:4567"),
            ("FERRY_TCPSTORE_ENDPOINT", "127.0.0.1:29500"),
            ("FERRY_TCPSTORE_PING", "0"),
            ("FERRY_STORE_NAMESPACE", "/x/y/"),
            ("FERRY_EXCHANGE_FETCH_TIMEOUT_MS", "250"),
        ])
        .unwrap();
        assert_eq!(c.p2p.listen, Some("127.0.0.1:4567".parse().unwrap()));
        assert_eq!(c.fetch_timeout, Duration::from_millis(250));
        assert_eq!(c.normalized_namespace().unwrap(), "/x/y");
        match c.store {
            StoreConfig::TcpStore(ts) => {
                assert_eq!(ts.endpoint, "127.0.0.1:29500");
                assert!(!ts.ping);
            }
            other => panic!("expected tcpstore, got {other:?}"),
        }
    }

    #[test]
    fn bad_values_name_the_variable() {
        let e = with(&[("FERRY_EXCHANGE_IO_TIMEOUT_MS", "soon")]).unwrap_err();
        assert!(
            e.to_string().contains("FERRY_EXCHANGE_IO_TIMEOUT_MS"),
            "{e}"
        );
        let e = with(&[
            ("FERRY_ETCD_ENDPOINTS", "http://127.0.0.1:2379"),
            ("FERRY_TCPSTORE_ENDPOINT", "127.0.0.1:1"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("choose one"), "{e}");
        assert!(with(&[("FERRY_STORE_NAMESPACE", "a//b")]).is_err());
        assert!(with(&[("FERRY_P2P_LISTEN", "everywhere")]).is_err());
    }

    #[test]
    fn keys_have_no_double_slash() {
        let c = with(&[("FERRY_STORE_NAMESPACE", "ferry/agents/")]).unwrap();
        let ns = c.normalized_namespace().unwrap();
        assert_eq!(store_key(&ns, "a", "metadata"), "ferry/agents/a/metadata");
        assert_eq!(store_key("", "a", "p"), "a/p");
    }
}
