//! The etcd store's worker (cargo feature `etcd`).
//!
//! One worker thread runs a single-threaded tokio runtime: the command loop publishes
//! and withdraws, keeps the lease alive, and spawns one task per fetch and per watched
//! peer, so no fetch waits behind another. Every unary call is bounded by the I/O
//! timeout and every fetch by the fetch timeout.
//!
//! Keys: `<namespace>/<agent>/<label>`. Published keys are attached to a lease that the
//! worker keeps alive (every third of its TTL); the keys of an agent that crashed or
//! was dropped without `invalidate_local_md` expire with the lease. When the lease is
//! lost (etcd outage longer than the TTL), the worker grants a new one and publishes
//! again. A fetch is get-then-watch: a missing key is watched from the revision of the
//! get, so a key put in between is not missed. A fetched peer's full-metadata key stays
//! watched; its deletion (or expiry) becomes an [`Event::Invalidate`].

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetResponse, PutOptions, WatchOptions};
use ferry_storage::Error;
use tokio::sync::mpsc;
use tokio::time::timeout;

use super::config::{EtcdConfig, EtcdTls};
use crate::contract::{CommandQueue, QueueError, Shared, StoreCmd, StoreWorker};
use crate::events::{Event, Route, FULL_LABEL};
use crate::util::lock;
use crate::util::{io_error, timeout_error};

const BACKEND: &str = "etcd";
/// Pause before a broken watch is set up again.
const REWATCH_DELAY: Duration = Duration::from_millis(500);

pub(crate) fn start(shared: Arc<Shared>, config: &EtcdConfig) -> Result<StoreWorker, Error> {
    let (tx, rx) = mpsc::channel(shared.config.command_capacity);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| io_error(BACKEND, "building the worker's runtime", &e))?;
    let options = connect_options(config, shared.config.io_timeout)?;
    let worker = Worker {
        shared: shared.clone(),
        options,
        endpoints: config.endpoints.clone(),
        lease_ttl: config.lease_ttl,
        client: None,
        lease: None,
        published: BTreeSet::new(),
        dirty: false,
        watching: Arc::new(Mutex::new(HashSet::new())),
    };
    let thread = std::thread::Builder::new()
        .name(format!("ferry-etcd-{}", shared.agent))
        .spawn(move || runtime.block_on(worker.run(rx)))
        .map_err(|e| io_error(BACKEND, "spawning the worker", &e))?;
    Ok(StoreWorker {
        route: Route::Etcd,
        endpoint: config.endpoints.join(","),
        ops: Box::new(tx),
        fetches: None,
        direct: None,
        threads: vec![thread],
    })
}

/// The worker's queue is a tokio channel (the worker is an async task).
impl CommandQueue for mpsc::Sender<StoreCmd> {
    fn try_send(&self, cmd: StoreCmd) -> Result<(), QueueError> {
        match mpsc::Sender::try_send(self, cmd) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => Err(QueueError::Full),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(QueueError::Closed),
        }
    }
}

/// The options of every connection: timeouts, and the user and TLS settings of
/// `config` (TLS files are read here, so a missing file fails at start).
fn connect_options(config: &EtcdConfig, io_timeout: Duration) -> Result<ConnectOptions, Error> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(io_timeout)
        .with_keep_alive(io_timeout, io_timeout);
    if let Some(user) = &config.user {
        options = options.with_user(user.name.clone(), user.password.clone());
    }
    if let Some(tls) = &config.tls {
        options = with_tls(options, tls)?;
    }
    Ok(options)
}

#[cfg(feature = "etcd-tls")]
fn with_tls(options: ConnectOptions, tls: &EtcdTls) -> Result<ConnectOptions, Error> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    use ferry_storage::Subject;
    let read = |what: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| {
            Error::invalid(
                Subject::Named(format!("etcd {what} '{}'", path.display()).into()),
                format!("cannot be read: {e}"),
            )
        })
    };
    let mut tls_options = TlsOptions::new();
    if let Some(ca) = &tls.ca_cert {
        tls_options =
            tls_options.ca_certificate(Certificate::from_pem(read("CA certificate", ca)?));
    }
    if let (Some(cert), Some(key)) = (&tls.client_cert, &tls.client_key) {
        tls_options = tls_options.identity(Identity::from_pem(
            read("client certificate", cert)?,
            read("client key", key)?,
        ));
    }
    if let Some(domain) = &tls.domain {
        tls_options = tls_options.domain_name(domain.clone());
    }
    Ok(options.with_tls(tls_options))
}

#[cfg(not(feature = "etcd-tls"))]
fn with_tls(_options: ConnectOptions, _tls: &EtcdTls) -> Result<ConnectOptions, Error> {
    Err(Error::NotSupported {
        backend: BACKEND.into(),
        what: "TLS to etcd: this build of ferry-exchange lacks its `etcd-tls` cargo feature".into(),
    })
}

fn etcd_error(what: impl std::fmt::Display, e: etcd_client::Error) -> Error {
    Error::backend(BACKEND, format!("{what}: {e}"))
}

/// Run `f` with the I/O timeout; a timeout becomes an `ETIMEDOUT` error naming `what`.
async fn bounded<T>(
    io_timeout: Duration,
    what: impl std::fmt::Display,
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, Error> {
    match timeout(io_timeout, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(etcd_error(what, e)),
        Err(_) => Err(timeout_error(
            BACKEND,
            format!("{what}: no answer within {} ms", io_timeout.as_millis()),
        )),
    }
}

struct Lease {
    id: i64,
    keeper: etcd_client::LeaseKeeper,
    stream: etcd_client::LeaseKeepAliveStream,
}

struct Worker {
    shared: Arc<Shared>,
    /// Timeouts, user and TLS settings of every connection.
    options: ConnectOptions,
    endpoints: Vec<String>,
    lease_ttl: Duration,
    client: Option<Client>,
    lease: Option<Lease>,
    /// Labels published and not withdrawn.
    published: BTreeSet<String>,
    /// A publish failed since the last complete publication: publish everything again.
    dirty: bool,
    /// Agents whose full-metadata key a task watches.
    watching: Arc<Mutex<HashSet<String>>>,
}

impl Worker {
    async fn run(mut self, mut commands: mpsc::Receiver<StoreCmd>) {
        let keepalive_every = self.lease_ttl / 3;
        let mut keepalive = tokio::time::interval(keepalive_every);
        keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                cmd = commands.recv() => {
                    let Some(cmd) = cmd else { return };
                    if self.shared.stopping() {
                        return;
                    }
                    self.command(cmd).await;
                }
                _ = keepalive.tick() => {
                    if self.shared.stopping() {
                        return;
                    }
                    self.keep_alive().await;
                }
            }
        }
    }

    async fn client(&mut self) -> Result<Client, Error> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let io_timeout = self.shared.config.io_timeout;
        let options = self.options.clone();
        let what = format!("connecting to etcd at {}", self.endpoints.join(","));
        let client = bounded(
            io_timeout,
            what,
            Client::connect(&self.endpoints, Some(options)),
        )
        .await?;
        self.client = Some(client.clone());
        Ok(client)
    }

    async fn command(&mut self, cmd: StoreCmd) {
        match cmd {
            StoreCmd::Publish { label, blob } => {
                self.published.insert(label.clone());
                if let Err(error) = self.publish(&label, &blob).await {
                    self.dirty = true;
                    self.failed(&label, error);
                }
            }
            StoreCmd::Withdraw => {
                if let Err(error) = self.withdraw().await {
                    self.failed("invalidate", error);
                }
            }
            // `WaitFor` comes only from the TCPStore direct path; a fetch all the same.
            StoreCmd::Fetch { agent, label } | StoreCmd::WaitFor { agent, label, .. } => {
                match self.client().await {
                    Ok(client) => {
                        let fetch = Fetch {
                            shared: self.shared.clone(),
                            client,
                            watching: self.watching.clone(),
                            agent,
                            label,
                        };
                        tokio::spawn(fetch.run());
                    }
                    Err(error) => {
                        self.shared.emit(Event::FetchFailed {
                            agent,
                            label,
                            error,
                        });
                    }
                }
            }
        }
    }

    fn failed(&self, what: &str, error: Error) {
        log::warn!("etcd: {what}: {error}");
        self.shared.emit(Event::SendFailed {
            target: format!("etcd {}", self.endpoints.join(",")),
            what: what.to_owned(),
            error,
        });
    }

    /// The lease id, granting a lease (and starting its keep-alive) if there is none.
    async fn lease_id(&mut self) -> Result<i64, Error> {
        if let Some(lease) = &self.lease {
            return Ok(lease.id);
        }
        let io_timeout = self.shared.config.io_timeout;
        let mut client = self.client().await?;
        let ttl = i64::try_from(self.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let granted = bounded(
            io_timeout,
            "granting a lease",
            client.lease_grant(ttl, None),
        )
        .await?;
        let (keeper, stream) = bounded(
            io_timeout,
            "starting the lease keep-alive",
            client.lease_keep_alive(granted.id()),
        )
        .await?;
        self.lease = Some(Lease {
            id: granted.id(),
            keeper,
            stream,
        });
        Ok(granted.id())
    }

    async fn publish(&mut self, label: &str, blob: &[u8]) -> Result<(), Error> {
        let io_timeout = self.shared.config.io_timeout;
        let lease = self.lease_id().await?;
        let mut client = self.client().await?;
        let key = self.shared.key(&self.shared.agent, label);
        let options = PutOptions::new().with_lease(lease);
        bounded(
            io_timeout,
            format!("putting '{key}'"),
            client.put(key.clone(), blob, Some(options)),
        )
        .await?;
        Ok(())
    }

    async fn withdraw(&mut self) -> Result<(), Error> {
        let io_timeout = self.shared.config.io_timeout;
        let labels = std::mem::take(&mut self.published);
        self.dirty = false;
        let mut client = self.client().await?;
        let agent = self.shared.agent.clone();
        for label in labels.iter().map(String::as_str).chain([FULL_LABEL]) {
            let key = self.shared.key(&agent, label);
            bounded(
                io_timeout,
                format!("deleting '{key}'"),
                client.delete(key.clone(), None),
            )
            .await?;
        }
        if let Some(lease) = self.lease.take() {
            bounded(
                io_timeout,
                "revoking the lease",
                client.lease_revoke(lease.id),
            )
            .await?;
        }
        Ok(())
    }

    /// Renew the lease; when it was lost, publish everything again under a new one.
    async fn keep_alive(&mut self) {
        let io_timeout = self.shared.config.io_timeout;
        let renewed = match &mut self.lease {
            None if self.published.is_empty() => return,
            None => false,
            Some(lease) => {
                let sent = bounded(io_timeout, "lease keep-alive", lease.keeper.keep_alive()).await;
                let answer = match sent {
                    Ok(()) => {
                        bounded(
                            io_timeout,
                            "lease keep-alive answer",
                            lease.stream.message(),
                        )
                        .await
                    }
                    Err(e) => Err(e),
                };
                match answer {
                    Ok(Some(resp)) if resp.ttl() > 0 => true,
                    Ok(_) => {
                        log::warn!("etcd: lease {:x} expired", lease.id);
                        false
                    }
                    Err(e) => {
                        log::warn!("etcd: {e}");
                        false
                    }
                }
            }
        };
        if renewed && !self.dirty {
            return;
        }
        if !renewed {
            self.lease = None;
        }
        let labels: Vec<String> = self.published.iter().cloned().collect();
        for label in labels {
            let Some(blob) = self.shared.local.get(&label) else {
                continue;
            };
            if let Err(e) = self.publish(&label, &blob).await {
                // Still out; the next tick tries again.
                log::warn!("etcd: publishing '{label}' again: {e}");
                self.lease = None;
                return;
            }
        }
        if !self.published.is_empty() {
            log::info!(
                "etcd: published {} label(s) again under a new lease",
                self.published.len()
            );
        }
    }
}

/// One fetch, then (for full metadata) the watch of that peer's key.
struct Fetch {
    shared: Arc<Shared>,
    client: Client,
    watching: Arc<Mutex<HashSet<String>>>,
    agent: String,
    label: String,
}

impl Fetch {
    async fn run(mut self) {
        let key = self.shared.key(&self.agent, &self.label);
        let fetch_timeout = self.shared.config.fetch_timeout;
        let fetched = match timeout(fetch_timeout, self.get_then_watch(&key)).await {
            Ok(r) => r,
            Err(_) => Err(timeout_error(
                BACKEND,
                format!(
                    "fetch of agent '{}' label '{}' (key '{key}'): not published within {} ms",
                    self.agent,
                    self.label,
                    fetch_timeout.as_millis()
                ),
            )),
        };
        let revision = match fetched {
            Ok((blob, revision)) => {
                self.shared.emit(Event::Load {
                    agent: self.agent.clone(),
                    label: self.label.clone(),
                    blob,
                    route: Route::Etcd,
                });
                revision
            }
            Err(error) => {
                self.shared.emit(Event::FetchFailed {
                    agent: self.agent,
                    label: self.label,
                    error,
                });
                return;
            }
        };
        if self.label != FULL_LABEL {
            return;
        }
        let first = lock(&self.watching).insert(self.agent.clone());
        if first {
            self.watch_deletion(&key, revision).await;
            lock(&self.watching).remove(&self.agent);
        }
    }

    /// The value and its mod revision: a get, and if the key is missing, a watch from
    /// the get's revision until it is put.
    async fn get_then_watch(&mut self, key: &str) -> Result<(Vec<u8>, i64), Error> {
        let io_timeout = self.shared.config.io_timeout;
        let got: GetResponse = bounded(
            io_timeout,
            format!("getting '{key}'"),
            self.client.get(key, None),
        )
        .await?;
        if let Some(kv) = got.kvs().first() {
            return Ok((kv.value().to_vec(), kv.mod_revision()));
        }
        let revision = got.header().map_or(0, |h| h.revision());
        let options = WatchOptions::new().with_start_revision(revision + 1);
        let mut stream = bounded(
            io_timeout,
            format!("watching '{key}'"),
            self.client.watch(key, Some(options)),
        )
        .await?;
        loop {
            let message = stream
                .message()
                .await
                .map_err(|e| etcd_error(format!("watching '{key}'"), e))?;
            let Some(message) = message else {
                return Err(Error::backend(BACKEND, format!("watch of '{key}' ended")));
            };
            for event in message.events() {
                if let (EventType::Put, Some(kv)) = (event.event_type(), event.kv()) {
                    return Ok((kv.value().to_vec(), kv.mod_revision()));
                }
            }
        }
    }

    /// Watch `key` after `revision` until it is deleted (or expires); then invalidate
    /// the peer. A broken watch is set up again; if the key vanished meanwhile, that
    /// counts as a deletion.
    async fn watch_deletion(&mut self, key: &str, mut revision: i64) {
        let io_timeout = self.shared.config.io_timeout;
        loop {
            if self.shared.stopping() {
                return;
            }
            let options = WatchOptions::new().with_start_revision(revision + 1);
            let watched = bounded(
                io_timeout,
                format!("watching '{key}'"),
                self.client.watch(key, Some(options)),
            )
            .await;
            if let Ok(mut stream) = watched {
                loop {
                    let message = match stream.message().await {
                        Ok(Some(m)) => m,
                        Ok(None) | Err(_) => break,
                    };
                    if message.canceled() {
                        // For example compacted past `revision`: look at the key instead.
                        break;
                    }
                    for event in message.events() {
                        match event.event_type() {
                            EventType::Delete => return self.invalidate(),
                            EventType::Put => {
                                if let Some(kv) = event.kv() {
                                    revision = kv.mod_revision();
                                }
                            }
                        }
                    }
                }
            }
            tokio::time::sleep(REWATCH_DELAY).await;
            let got = bounded(
                io_timeout,
                format!("getting '{key}'"),
                self.client.get(key, None),
            )
            .await;
            match got {
                Ok(resp) => match resp.kvs().first() {
                    None => return self.invalidate(),
                    Some(kv) => revision = revision.max(kv.mod_revision()),
                },
                Err(e) => log::debug!("etcd: {e}"),
            }
        }
    }

    fn invalidate(&self) {
        self.shared.emit(Event::Invalidate {
            agent: self.agent.clone(),
            route: Route::Etcd,
        });
    }
}
