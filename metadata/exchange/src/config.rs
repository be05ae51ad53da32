//! Configuration of the metadata exchange, from the agent config with environment
//! variables as overrides.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `FERRY_P2P_LISTEN` | `HOST:PORT` to run the P2P listener on (port 0: ephemeral), or `off` | off (agent config decides) |
//! | `FERRY_P2P_SECRET` | shared secret: P2P hellos are a mutual challenge–response and frames carry HMAC-SHA256 tags | none: no authentication, the listener trusts anyone who can connect |
//! | `FERRY_P2P_MAX_FRAME_BYTES` | largest P2P frame accepted or sent (1 KiB to 4 GiB - 1) | 64 MiB |
//! | `FERRY_EXCHANGE_IO_TIMEOUT_MS` | bound on every connect, read and write | 5000 (1 ms to 24 h) |
//! | `FERRY_EXCHANGE_FETCH_TIMEOUT_MS` | how long a fetch waits for the peer to publish | 10000 (1 ms to 24 h) |
//! | `FERRY_STORE_NAMESPACE` | key prefix in etcd and TCPStore: keys are `<namespace>/<agent>/<label>` | `ferry/agents` |
//! | `FERRY_ETCD_ENDPOINTS` | comma-separated etcd endpoints (`http://127.0.0.1:2379`); selects etcd | none |
//! | `FERRY_ETCD_LEASE_TTL_S` | lease of published keys; a crashed agent's keys expire after it (1 s to 24 h) | 10 |
//! | `FERRY_ETCD_USER` | etcd user name (etcd's `auth enable`); needs a password | none |
//! | `FERRY_ETCD_PASSWORD` | that user's password | none |
//! | `FERRY_ETCD_PASSWORD_FILE` | a file whose content (trailing newline removed) is the password; keeps it out of the environment | none |
//! | `FERRY_ETCD_CA_CERT` | PEM file of the CA that signed etcd's server certificate; turns TLS on (`https://` endpoints; cargo feature `etcd-tls`) | none |
//! | `FERRY_ETCD_CERT`, `FERRY_ETCD_KEY` | PEM client certificate and key for etcd's client-certificate authentication (both or neither; with TLS) | none |
//! | `FERRY_ETCD_TLS_DOMAIN` | the name to check etcd's certificate against, when not the endpoint's host | endpoint host |
//! | `FERRY_TCPSTORE_ENDPOINT` | `HOST:PORT` of one TCPStore server; selects TCPStore | none |
//! | `FERRY_TCPSTORE_PING` | `1`/`0`: send PING after VALIDATE (torch >= 2.5 servers need not; 2.2-2.4 die on it) | 1 |
//! | `FERRY_TCPSTORE_SERVE` | `HOST:PORT` on which the agent runs Ferry's own TCPStore server (and uses it when no store is set), or `off` | off |
//! | `FERRY_TCPSTORE_MAX_*`, `FERRY_TCPSTORE_*_TIMEOUT_MS` | limits of the embedded (and `ferry store serve`) TCPStore server: the table in the crate README | see there |
//! | `FERRY_STORE_WATCH_INTERVAL_MS` | TCPStore: how often owners beat and check their keys and watchers read fetched peers in one batched round (1 ms to 1 h); liveness bound 4 × this + the I/O timeout | 1000 |
//! | `FERRY_INPROCESS_STORE` | a name; selects the in-process store shared by the agents of this process that give the same name | none |
//!
//! Setting more than one of `FERRY_ETCD_ENDPOINTS`, `FERRY_TCPSTORE_ENDPOINT` and
//! `FERRY_INPROCESS_STORE` is an error. The settings of each part live in its folder
//! (`p2p/config.rs`, `stores/<store>/config.rs`); this table is their index.
//!
//! # Odd values
//! Every value is checked when the manager starts ([`ExchangeConfig::validated`]): what
//! cannot work is a typed [`Error::InvalidParam`] naming the field or
//! variable (a zero I/O timeout, fetch timeout, watch interval or capacity; a frame
//! limit under 1 KiB or over 4 GiB; an empty secret; a capacity over
//! [`CAPACITY_MAX`]; a user without a password; TLS settings without `https://`
//! endpoints); durations longer than their maximum mean "practically forever" and are
//! clamped to it with a logged warning ([`TIMEOUT_MAX`] for timeouts,
//! [`WATCH_INTERVAL_MAX`], [`LEASE_TTL_MAX`]). Deadlines are computed with saturating
//! arithmetic, so no value overflows an `Instant`.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::time::Duration;

use ferry_storage::{Error, Subject};

pub use crate::p2p::config::P2pConfig;
pub use crate::parse::TIMEOUT_MAX;
use crate::parse::{check_duration, clamp, parse_addr_or_off, parse_ms};
pub use crate::stores::etcd::config::{EtcdConfig, EtcdTls, EtcdUser, LEASE_TTL_MAX};
pub use crate::stores::in_process::config::InProcessConfig;
pub use crate::stores::tcpstore::config::{TcpStoreConfig, WATCH_INTERVAL_MAX};

/// Default prefix of store keys.
pub const DEFAULT_NAMESPACE: &str = "ferry/agents";
/// Largest event or command queue capacity (each is allocated up front).
pub const CAPACITY_MAX: usize = 1 << 20;
/// Longest store namespace, in bytes.
pub const NAMESPACE_MAX_BYTES: usize = 1024;

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
    /// The in-process store: agents of one process that name the same store share it
    /// (tests, single-process pipelines; the model store of the contract).
    InProcess(InProcessConfig),
}

impl StoreConfig {
    /// The store the selecting variables name (`FERRY_ETCD_ENDPOINTS`,
    /// `FERRY_TCPSTORE_ENDPOINT`, `FERRY_INPROCESS_STORE`), else `current`; more than
    /// one is an error.
    fn selected(
        current: StoreConfig,
        get: &impl Fn(&str) -> Option<String>,
    ) -> Result<StoreConfig, Error> {
        let chosen: Vec<(&str, String, StoreConfig)> = [
            EtcdConfig::selected(get)
                .map(|(v, c)| (EtcdConfig::SELECT_VAR, v, StoreConfig::Etcd(c))),
            TcpStoreConfig::selected(get)
                .map(|(v, c)| (TcpStoreConfig::SELECT_VAR, v, StoreConfig::TcpStore(c))),
            InProcessConfig::selected(get)
                .map(|(v, c)| (InProcessConfig::SELECT_VAR, v, StoreConfig::InProcess(c))),
        ]
        .into_iter()
        .flatten()
        .collect();
        let mut chosen = chosen;
        match chosen.len() {
            0 => Ok(current),
            1 => Ok(chosen.remove(0).2),
            _ => {
                let names: Vec<String> = chosen
                    .iter()
                    .map(|(var, v, _)| format!("{var}='{v}'"))
                    .collect();
                Err(Error::invalid(
                    Subject::Named(names.join(" and ").into()),
                    "both are set; choose one metadata store",
                ))
            }
        }
    }

    /// The selected store's own variables.
    fn apply_overrides(&mut self, get: &impl Fn(&str) -> Option<String>) -> Result<(), Error> {
        match self {
            StoreConfig::None => Ok(()),
            StoreConfig::Etcd(c) => c.apply_overrides(get),
            StoreConfig::TcpStore(c) => c.apply_overrides(get),
            StoreConfig::InProcess(_) => Ok(()),
        }
    }

    fn clamp(&mut self) {
        match self {
            StoreConfig::None | StoreConfig::InProcess(_) => {}
            StoreConfig::Etcd(c) => c.clamp(),
            StoreConfig::TcpStore(c) => c.clamp(),
        }
    }

    fn check(&self) -> Result<(), Error> {
        match self {
            StoreConfig::None => Ok(()),
            StoreConfig::Etcd(c) => c.check(),
            StoreConfig::TcpStore(c) => c.check(),
            StoreConfig::InProcess(c) => c.check(),
        }
    }
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
        self.p2p.apply_overrides(&get)?;
        self.store = StoreConfig::selected(std::mem::take(&mut self.store), &get)?;
        self.store.apply_overrides(&get)?;
        self.validated()
    }

    /// This config with durations above their maximum clamped (each with a logged
    /// warning), then [checked](Self::check). What [`crate::Manager::new`] uses.
    pub fn validated(mut self) -> Result<ExchangeConfig, Error> {
        clamp(&mut self.io_timeout, TIMEOUT_MAX, "io_timeout");
        clamp(&mut self.fetch_timeout, TIMEOUT_MAX, "fetch_timeout");
        self.p2p.clamp();
        self.store.clamp();
        self.check()?;
        Ok(self)
    }

    /// Check the values for what would fail later (module docs, "Odd values");
    /// durations above their maximum are errors here ([`Self::validated`] clamps them).
    pub fn check(&self) -> Result<(), Error> {
        let named = |what: String, reason: Cow<'static, str>| {
            Err(Error::invalid(Subject::Named(Cow::Owned(what)), reason))
        };
        let durations = [
            ("io_timeout", self.io_timeout, TIMEOUT_MAX),
            ("fetch_timeout", self.fetch_timeout, TIMEOUT_MAX),
        ];
        for (what, value, max) in durations {
            check_duration(what, value, max)?;
        }
        self.p2p.check()?;
        for (what, value) in [
            ("event_capacity", self.event_capacity),
            ("command_capacity", self.command_capacity),
        ] {
            if value == 0 || value > CAPACITY_MAX {
                return named(
                    format!("{what} = {value}"),
                    format!("must be 1 to {CAPACITY_MAX}").into(),
                );
            }
        }
        self.store.check()?;
        if self.namespace.len() > NAMESPACE_MAX_BYTES
            || self.namespace.chars().any(char::is_control)
        {
            return named(
                format!("store namespace '{}'", self.namespace.escape_debug()),
                format!("must be at most {NAMESPACE_MAX_BYTES} bytes without control characters")
                    .into(),
            );
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
    use std::sync::Arc;

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
    fn each_store_is_selected_by_its_variable_and_only_one_at_a_time() {
        match with(&[("FERRY_INPROCESS_STORE", "pipeline")])
            .unwrap()
            .store
        {
            StoreConfig::InProcess(c) => assert_eq!(c.name, "pipeline"),
            other => panic!("expected the in-process store, got {other:?}"),
        }
        let e = with(&[
            ("FERRY_INPROCESS_STORE", "p"),
            ("FERRY_TCPSTORE_ENDPOINT", "127.0.0.1:1"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("choose one"), "{e}");
        assert!(e.to_string().contains("FERRY_INPROCESS_STORE"), "{e}");
        // A store's own variables apply only to it.
        let c = with(&[
            ("FERRY_INPROCESS_STORE", "p"),
            ("FERRY_STORE_WATCH_INTERVAL_MS", "5"),
        ])
        .unwrap();
        assert!(matches!(c.store, StoreConfig::InProcess(_)));
        let bad = ExchangeConfig {
            store: StoreConfig::InProcess(InProcessConfig::new("")),
            ..ExchangeConfig::default()
        };
        assert!(bad.validated().is_err());
    }

    #[test]
    fn keys_have_no_double_slash() {
        let c = with(&[("FERRY_STORE_NAMESPACE", "ferry/agents/")]).unwrap();
        let ns = c.normalized_namespace().unwrap();
        assert_eq!(store_key(&ns, "a", "metadata"), "ferry/agents/a/metadata");
        assert_eq!(store_key("", "a", "p"), "a/p");
    }

    fn invalid(vars: &[(&str, &str)], needle: &str) {
        match with(vars) {
            Err(e @ Error::InvalidParam { .. }) => {
                assert!(e.to_string().contains(needle), "{vars:?}: {e}")
            }
            other => panic!("{vars:?}: expected an invalid-argument error, got {other:?}"),
        }
    }

    #[test]
    fn every_variable_refuses_garbage_and_out_of_range_numbers() {
        let big = "18446744073709551616"; // u64::MAX + 1
        for var in [
            "FERRY_EXCHANGE_IO_TIMEOUT_MS",
            "FERRY_EXCHANGE_FETCH_TIMEOUT_MS",
            "FERRY_P2P_MAX_FRAME_BYTES",
        ] {
            invalid(&[(var, "soon")], var);
            invalid(&[(var, "-1")], var);
            invalid(&[(var, big)], var);
        }
        invalid(
            &[(var_ts(), "1:2"), ("FERRY_STORE_WATCH_INTERVAL_MS", "x")],
            "WATCH",
        );
        invalid(
            &[(var_ts(), "h:1"), ("FERRY_TCPSTORE_PING", "maybe")],
            "PING",
        );
        invalid(
            &[
                (var_etcd(), "http://e:1"),
                ("FERRY_ETCD_LEASE_TTL_S", "1.5"),
            ],
            "LEASE",
        );
        invalid(&[("FERRY_P2P_LISTEN", "everywhere")], "FERRY_P2P_LISTEN");
        invalid(&[("FERRY_P2P_LISTEN", "1.2.3.4:70000")], "FERRY_P2P_LISTEN");
        invalid(&[("FERRY_TCPSTORE_SERVE", "::1")], "FERRY_TCPSTORE_SERVE");
    }

    fn var_ts() -> &'static str {
        "FERRY_TCPSTORE_ENDPOINT"
    }

    fn var_etcd() -> &'static str {
        "FERRY_ETCD_ENDPOINTS"
    }

    #[test]
    fn zero_and_tiny_values_are_typed_errors() {
        invalid(&[("FERRY_EXCHANGE_IO_TIMEOUT_MS", "0")], "io_timeout");
        invalid(&[("FERRY_EXCHANGE_FETCH_TIMEOUT_MS", "0")], "fetch_timeout");
        invalid(&[("FERRY_P2P_MAX_FRAME_BYTES", "0")], "max_frame_bytes");
        invalid(&[("FERRY_P2P_MAX_FRAME_BYTES", "4294967296")], "32 bits");
        invalid(
            &[(var_ts(), "h:1"), ("FERRY_STORE_WATCH_INTERVAL_MS", "0")],
            "watch_interval",
        );
        invalid(
            &[(var_etcd(), "http://e:1"), ("FERRY_ETCD_LEASE_TTL_S", "0")],
            "lease_ttl",
        );
        // Empty values change nothing (the default stays).
        assert_eq!(
            with(&[("FERRY_EXCHANGE_IO_TIMEOUT_MS", " ")])
                .unwrap()
                .io_timeout,
            Duration::from_secs(5)
        );
    }

    #[test]
    fn huge_durations_are_clamped_not_overflowed() {
        let max = "18446744073709551615";
        let c = with(&[
            ("FERRY_EXCHANGE_FETCH_TIMEOUT_MS", max),
            ("FERRY_EXCHANGE_IO_TIMEOUT_MS", max),
            (var_ts(), "127.0.0.1:1"),
            ("FERRY_STORE_WATCH_INTERVAL_MS", max),
        ])
        .unwrap();
        assert_eq!((c.fetch_timeout, c.io_timeout), (TIMEOUT_MAX, TIMEOUT_MAX));
        match &c.store {
            StoreConfig::TcpStore(ts) => assert_eq!(ts.watch_interval, WATCH_INTERVAL_MAX),
            other => panic!("{other:?}"),
        }
        let c = with(&[(var_etcd(), "http://e:1"), ("FERRY_ETCD_LEASE_TTL_S", max)]).unwrap();
        match &c.store {
            StoreConfig::Etcd(e) => assert_eq!(e.lease_ttl, LEASE_TTL_MAX),
            other => panic!("{other:?}"),
        }
        // The clamped values work in deadline arithmetic.
        let now = std::time::Instant::now();
        assert!(crate::util::deadline_after(now, c.fetch_timeout) > now);
        // Set directly (not through the environment): check refuses, validated clamps.
        let mut direct = ExchangeConfig::default();
        direct.p2p.idle_timeout = Duration::MAX;
        assert!(direct.check().is_err());
        assert_eq!(direct.validated().unwrap().p2p.idle_timeout, TIMEOUT_MAX);
    }

    #[test]
    fn fields_without_variables_are_checked_too() {
        let base = ExchangeConfig::default;
        let cases: Vec<(ExchangeConfig, &str)> = vec![
            (
                ExchangeConfig {
                    event_capacity: 0,
                    ..base()
                },
                "event_capacity",
            ),
            (
                ExchangeConfig {
                    command_capacity: usize::MAX,
                    ..base()
                },
                "command_capacity",
            ),
            (
                ExchangeConfig {
                    p2p: P2pConfig {
                        max_connections: 0,
                        ..P2pConfig::default()
                    },
                    ..base()
                },
                "max_connections",
            ),
            (
                ExchangeConfig {
                    p2p: P2pConfig {
                        secret: Some(Arc::from(&b""[..])),
                        ..P2pConfig::default()
                    },
                    ..base()
                },
                "secret",
            ),
            (
                ExchangeConfig {
                    namespace: "x".repeat(NAMESPACE_MAX_BYTES + 1),
                    ..base()
                },
                "namespace",
            ),
            (
                ExchangeConfig {
                    namespace: "a\nb".into(),
                    ..base()
                },
                "namespace",
            ),
            (
                ExchangeConfig {
                    store: StoreConfig::TcpStore(TcpStoreConfig::new("no-port")),
                    ..base()
                },
                "no-port",
            ),
            (
                ExchangeConfig {
                    store: StoreConfig::Etcd(EtcdConfig::new(Vec::new())),
                    ..base()
                },
                "etcd endpoints",
            ),
        ];
        for (config, needle) in cases {
            let e = config.validated().unwrap_err();
            assert!(matches!(e, Error::InvalidParam { .. }), "{e}");
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
    }

    #[test]
    fn etcd_user_and_tls_settings() {
        let etcd = |c: ExchangeConfig| match c.store {
            StoreConfig::Etcd(e) => e,
            other => panic!("{other:?}"),
        };
        let e = etcd(
            with(&[
                (var_etcd(), "https://etcd-0:2379,https://etcd-1:2379"),
                ("FERRY_ETCD_USER", "ferry"),
                ("FERRY_ETCD_PASSWORD", "pw"),
                ("FERRY_ETCD_CA_CERT", "/etc/ca.pem"),
                ("FERRY_ETCD_CERT", "/etc/c.pem"),
                ("FERRY_ETCD_KEY", "/etc/k.pem"),
                ("FERRY_ETCD_TLS_DOMAIN", "etcd.local"),
            ])
            .unwrap(),
        );
        let user = e.user.clone().unwrap();
        assert_eq!(
            (user.name.as_str(), user.password.as_str()),
            ("ferry", "pw")
        );
        assert!(
            !format!("{e:?}").contains("pw\""),
            "Debug shows the password: {e:?}"
        );
        let tls = e.tls.unwrap();
        assert_eq!(
            tls.ca_cert.as_deref(),
            Some(std::path::Path::new("/etc/ca.pem"))
        );
        assert_eq!(tls.domain.as_deref(), Some("etcd.local"));
        assert!(tls.client_cert.is_some() && tls.client_key.is_some());

        // The password from a file (trailing newline dropped).
        let dir = std::env::temp_dir().join(format!("ferry-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "from-file\n").unwrap();
        let e = etcd(
            with(&[
                (var_etcd(), "http://e:1"),
                ("FERRY_ETCD_USER", "u"),
                ("FERRY_ETCD_PASSWORD_FILE", file.to_str().unwrap()),
            ])
            .unwrap(),
        );
        assert_eq!(e.user.unwrap().password, "from-file");
        std::fs::remove_dir_all(&dir).unwrap();

        let http = (var_etcd(), "http://e:1");
        invalid(&[http, ("FERRY_ETCD_USER", "u")], "FERRY_ETCD_PASSWORD");
        invalid(&[http, ("FERRY_ETCD_PASSWORD", "p")], "FERRY_ETCD_USER");
        invalid(
            &[
                http,
                ("FERRY_ETCD_USER", "u"),
                ("FERRY_ETCD_PASSWORD_FILE", "/nonexistent/pw"),
            ],
            "cannot be read",
        );
        invalid(&[http, ("FERRY_ETCD_CA_CERT", "/ca.pem")], "https://");
        invalid(&[(var_etcd(), "https://e:1")], "TLS");
        invalid(
            &[(var_etcd(), "https://e:1"), ("FERRY_ETCD_CERT", "/c.pem")],
            "FERRY_ETCD_KEY",
        );
    }

    #[test]
    fn the_p2p_secret_is_not_in_debug_output() {
        let c = with(&[("FERRY_P2P_SECRET", "hunter2")]).unwrap();
        assert!(!format!("{c:?}").contains("hunter2"));
        assert!(!format!("{c:?}").contains("104, 117")); // its bytes
    }
}
