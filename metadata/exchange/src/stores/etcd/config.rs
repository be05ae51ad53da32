//! Settings of the etcd store (`FERRY_ETCD_*`; table in `config.rs`). They exist in
//! every build, so a configuration naming etcd is checked (and refused with
//! `NotSupported` at start) without the `etcd` feature.

use std::path::PathBuf;
use std::time::Duration;

use ferry_storage::{Error, Subject};

use crate::parse::{bad_var, check_duration, clamp};

/// Longest etcd lease TTL; longer ones are clamped with a warning (a crashed agent's
/// keys live that long).
pub const LEASE_TTL_MAX: Duration = Duration::from_secs(24 * 3600);

/// etcd settings.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Endpoints such as `http://127.0.0.1:2379` (`https://` with [`Self::tls`]).
    pub endpoints: Vec<String>,
    /// TTL of the lease that published keys are attached to.
    pub lease_ttl: Duration,
    /// User and password, for an etcd with authentication enabled.
    pub user: Option<EtcdUser>,
    /// TLS to etcd (cargo feature `etcd-tls`).
    pub tls: Option<EtcdTls>,
}

/// An etcd user (etcd's `user add` + `auth enable`). Its `Debug` hides the password.
#[derive(Clone)]
pub struct EtcdUser {
    /// The user name.
    pub name: String,
    /// The password.
    pub password: String,
}

impl std::fmt::Debug for EtcdUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUser")
            .field("name", &self.name)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// TLS settings for etcd: PEM files, read when the worker connects.
#[derive(Clone, Debug, Default)]
pub struct EtcdTls {
    /// The CA certificate(s) that signed etcd's server certificate.
    pub ca_cert: Option<PathBuf>,
    /// Client certificate, for etcd's client-certificate authentication (with `client_key`).
    pub client_cert: Option<PathBuf>,
    /// Client key (with `client_cert`).
    pub client_key: Option<PathBuf>,
    /// The name etcd's certificate must carry, when not the endpoint's host.
    pub domain: Option<String>,
}

impl EtcdConfig {
    /// Settings for the given endpoints, with defaults for the rest.
    pub fn new(endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            lease_ttl: Duration::from_secs(10),
            user: None,
            tls: None,
        }
    }

    /// The variable that selects this store.
    pub(crate) const SELECT_VAR: &'static str = "FERRY_ETCD_ENDPOINTS";

    /// This store's settings, if its selecting variable is set (with its value).
    pub(crate) fn selected(get: &impl Fn(&str) -> Option<String>) -> Option<(String, EtcdConfig)> {
        let v = get(Self::SELECT_VAR)?;
        let endpoints: Vec<String> = v
            .split(',')
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect();
        Some((v, EtcdConfig::new(endpoints)))
    }

    /// The store's own variables: lease, user, TLS.
    pub(crate) fn apply_overrides(
        &mut self,
        get: &impl Fn(&str) -> Option<String>,
    ) -> Result<(), Error> {
        if let Some(v) = get("FERRY_ETCD_LEASE_TTL_S") {
            let secs: u64 = v
                .trim()
                .parse()
                .map_err(|_| bad_var("FERRY_ETCD_LEASE_TTL_S", &v, "expected whole seconds"))?;
            self.lease_ttl = Duration::from_secs(secs);
        }
        etcd_overrides(self, get)
    }

    pub(crate) fn clamp(&mut self) {
        clamp(&mut self.lease_ttl, LEASE_TTL_MAX, "etcd lease_ttl");
    }

    pub(crate) fn check(&self) -> Result<(), Error> {
        check_etcd(self)
    }
}

fn check_etcd(etcd: &EtcdConfig) -> Result<(), Error> {
    let named = |what: &str, reason: &'static str| {
        Err(Error::invalid(
            Subject::Named(what.to_owned().into()),
            reason,
        ))
    };
    if etcd.endpoints.is_empty() {
        return named("etcd endpoints", "empty list");
    }
    if etcd.lease_ttl < Duration::from_secs(1) {
        return named("etcd lease_ttl", "must be at least 1 s");
    }
    check_duration("etcd lease_ttl", etcd.lease_ttl, LEASE_TTL_MAX)?;
    if let Some(user) = &etcd.user {
        if user.name.is_empty() || user.password.is_empty() {
            return named("etcd user", "needs both a name and a password");
        }
    }
    let https = etcd
        .endpoints
        .iter()
        .filter(|e| e.starts_with("https://"))
        .count();
    match &etcd.tls {
        Some(tls) => {
            if https != etcd.endpoints.len() {
                return named(
                    "etcd endpoints",
                    "with TLS settings every endpoint must be https://",
                );
            }
            if tls.client_cert.is_some() != tls.client_key.is_some() {
                return named(
                    "etcd client certificate",
                    "needs both a certificate and a key (FERRY_ETCD_CERT and FERRY_ETCD_KEY)",
                );
            }
        }
        None if https > 0 => {
            return named(
                "etcd endpoints",
                "https:// endpoints need TLS settings (FERRY_ETCD_CA_CERT)",
            );
        }
        None => {}
    }
    Ok(())
}

/// The etcd user and TLS variables (module docs).
fn etcd_overrides(
    etcd: &mut EtcdConfig,
    get: &impl Fn(&str) -> Option<String>,
) -> Result<(), Error> {
    let password = match (get("FERRY_ETCD_PASSWORD"), get("FERRY_ETCD_PASSWORD_FILE")) {
        (Some(_), Some(_)) => {
            return Err(Error::invalid(
                Subject::Named("FERRY_ETCD_PASSWORD and FERRY_ETCD_PASSWORD_FILE".into()),
                "both are set; choose one",
            ))
        }
        (Some(p), None) => Some(p),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path.trim()).map_err(|e| {
                Error::invalid(
                    Subject::Named(format!("FERRY_ETCD_PASSWORD_FILE='{path}'").into()),
                    format!("cannot be read: {e}"),
                )
            })?;
            Some(text.trim_end_matches(['\r', '\n']).to_owned())
        }
        (None, None) => None,
    };
    match (get("FERRY_ETCD_USER"), password) {
        (Some(name), Some(password)) => {
            etcd.user = Some(EtcdUser {
                name: name.trim().to_owned(),
                password,
            })
        }
        (None, None) => {}
        (Some(_), None) => {
            return Err(Error::invalid(
                Subject::Named("FERRY_ETCD_USER".into()),
                "needs FERRY_ETCD_PASSWORD or FERRY_ETCD_PASSWORD_FILE",
            ))
        }
        (None, Some(_)) => {
            return Err(Error::invalid(
                Subject::Named("FERRY_ETCD_PASSWORD".into()),
                "needs FERRY_ETCD_USER",
            ))
        }
    }
    let path = |name: &str| get(name).map(|v| PathBuf::from(v.trim()));
    let ca_cert = path("FERRY_ETCD_CA_CERT");
    let client_cert = path("FERRY_ETCD_CERT");
    let client_key = path("FERRY_ETCD_KEY");
    let domain = get("FERRY_ETCD_TLS_DOMAIN").map(|d| d.trim().to_owned());
    if ca_cert.is_some() || client_cert.is_some() || client_key.is_some() || domain.is_some() {
        etcd.tls = Some(EtcdTls {
            ca_cert,
            client_cert,
            client_key,
            domain,
        });
    }
    Ok(())
}
