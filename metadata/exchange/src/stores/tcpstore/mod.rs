//! The TCPStore store: two worker threads, each with its own connection,
//! and the direct GET path.
//!
//! - The **ops** thread publishes (SET) and withdraws (DELETE_KEY). It remembers what it
//!   published and, when the server comes back after an outage, publishes it again.
//! - The **direct** path (`direct.rs`): once the fetch thread has fetched something, it
//!   opens one more connection with a reader thread; a fetch that finds it idle writes
//!   its GET there from the caller's thread, and the reader loads the reply (or hands
//!   a missing key back to the fetch thread). One round trip, no worker wake-up.
//! - The **fetch** thread answers fetches and watches fetched peers. A fetch first tries
//!   a GET (Ferry never publishes an empty value, so an empty reply means "missing");
//!   when the key is missing it WAITs in short slices with a client-side deadline,
//!   taking turns with other pending fetches, then GETs. So a key that appears just
//!   after a check is never reported missing, and no fetch waits behind another one's
//!   whole timeout. Fetched peers' keys are checked every watch interval (see
//!   "Deletions" below).
//!
//! # Deletions, store restarts and the grace period
//! A TCPStore server keeps its keys in memory: after a restart they are all gone, while
//! their owners are alive. So a missing key is not taken for a withdrawal at once:
//! - **Owners republish.** The ops thread, while idle, checks every watch interval that
//!   what it published is still there, and sets it again if not (and after any outage).
//! - **Withdrawals leave a mark.** `invalidate_local_md` first sets the *withdrawal
//!   mark* `<namespace>/<agent>/` (no label: never a metadata key), then deletes the
//!   keys; publishing deletes the mark again. A watcher that finds a key missing and
//!   the mark present invalidates the peer at once.
//! - **Watchers wait out a grace period** for a key that is missing without a mark:
//!   [`deletion_grace`] = 2 × the watch interval + the I/O timeout (one missed check of
//!   the owner, one more, and the owner's reconnect and SET), 2 × 1 s + 5 s = 7 s with
//!   the defaults. Only a key still missing after it invalidates the peer (a crashed
//!   owner of a restarted store). This assumes owners and watchers use the same watch
//!   interval (a cluster-wide setting).
//!
//! # Liveness: heartbeats
//! A crashed owner of a live store would otherwise keep its keys forever. So every
//! owner with something published **beats**: each watch interval its ops thread ADDs 1
//! to its heartbeat key `<namespace>/<agent>/alive/` (a label cannot contain `/`, so
//! this is never a metadata key), in the same round in which it checks its keys. A
//! watcher reads the heartbeats of every peer it watches in **one batched round per
//! interval** (one CHECK of every watched key and heartbeat, then one MULTI_GET of the
//! heartbeats; per-peer requests only while some key is missing), and invalidates a
//! peer whose heartbeat has not changed for [`deletion_grace`]. So a crashed or
//! partitioned owner is invalidated at its watchers at most
//! **`TcpStoreConfig::liveness_bound` = 4 × watch interval + I/O timeout** after its
//! last beat (9 s with the defaults): the watcher sees the last beat up to one interval
//! late, waits out the grace period, and rounds come once an interval. A peer invalidated this way stays on a bounded list of *lost*
//! peers, read in the same round: when its heartbeat moves again (a restarted owner,
//! which publishes before it beats), the watcher GETs its metadata and loads it again
//! without a new fetch. Owners and watchers must use the same watch interval.
//!
//! Keys go on the wire as torch's `TCPStore` sends user keys (`/` prepended), so torch
//! code can read them with `store.get("<namespace>/<agent>/<label>")`.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_storage::Error;

use crate::contract::{Shared, StoreCmd, StoreWorker};
use crate::events::{Event, Route, FULL_LABEL};
use crate::tcpstore::{user_key, ClientOptions, TcpStoreClient};
use crate::util::{deadline_after, io_error, lock, timeout_error};
use direct::{watch_peer, Direct, Watched};

pub(crate) mod config;
mod direct;

use config::TcpStoreConfig;

const BACKEND: &str = "tcpstore";
/// Value of a withdrawal mark.
const WITHDRAWN: &[u8] = b"withdrawn";

/// How long a watcher waits for a missing key without a withdrawal mark to come back,
/// or for a heartbeat that does not move, before it invalidates the peer (module
/// docs): 2 × `watch_interval` + `io_timeout`.
pub(crate) fn deletion_grace(watch_interval: Duration, io_timeout: Duration) -> Duration {
    watch_interval.saturating_mul(2).saturating_add(io_timeout)
}

/// The wire key of `agent`'s heartbeat (module docs).
fn heartbeat_key(shared: &Shared, agent: &str) -> Vec<u8> {
    let mut key = withdrawn_key(shared, agent);
    key.extend_from_slice(b"alive/");
    key
}

/// Most peers kept on the lost list (invalidated by liveness, watched for a return).
const LOST_MAX: usize = 1024;

/// The wire key of `agent`'s withdrawal mark (module docs).
fn withdrawn_key(shared: &Shared, agent: &str) -> Vec<u8> {
    user_key(&shared.key(agent, "")).into_bytes()
}

/// Longest single WAIT while other fetches may be pending.
const WAIT_SLICE: Duration = Duration::from_millis(50);
/// How often idle threads look at the stop flag.
const IDLE_TICK: Duration = Duration::from_millis(500);

pub(crate) fn start(shared: Arc<Shared>, config: &TcpStoreConfig) -> Result<StoreWorker, Error> {
    let capacity = shared.config.command_capacity;
    let (ops_tx, ops_rx) = sync_channel(capacity);
    let (fetch_tx, fetch_rx) = sync_channel(capacity);
    let options = ClientOptions {
        io_timeout: shared.config.io_timeout,
        ping: config.ping,
        tls: crate::stream::load(config.tls.as_ref())?,
        ..ClientOptions::default()
    };
    let mut threads = Vec::with_capacity(2);
    let ops = Ops {
        shared: shared.clone(),
        endpoint: config.endpoint.clone(),
        options: options.clone(),
        client: None,
        published: BTreeSet::new(),
        outage: false,
        retry_interval: config.watch_interval,
        marked: true,
    };
    threads.push(
        std::thread::Builder::new()
            .name(format!("ferry-tcpstore-ops-{}", shared.agent))
            .spawn(move || ops.run(ops_rx))
            .map_err(|e| io_error(BACKEND, "spawning the ops worker", &e))?,
    );
    let watched: Watched = Arc::default();
    let direct = Arc::new(Direct::new(
        shared.clone(),
        config.endpoint.clone(),
        fetch_tx.clone(),
        watched.clone(),
    ));
    let fetcher = Fetcher {
        shared: shared.clone(),
        endpoint: config.endpoint.clone(),
        options,
        client: None,
        pending: VecDeque::new(),
        watched,
        direct: direct.clone(),
        watch_interval: config.watch_interval,
        grace: deletion_grace(config.watch_interval, shared.config.io_timeout),
        missing_since: HashMap::new(),
        beats: HashMap::new(),
        lost: VecDeque::new(),
        watch_outage: false,
        get_first: true,
    };
    let spawned = std::thread::Builder::new()
        .name(format!("ferry-tcpstore-fetch-{}", shared.agent))
        .spawn(move || fetcher.run(fetch_rx));
    match spawned {
        Ok(t) => threads.push(t),
        Err(e) => {
            drop(ops_tx);
            direct.stop();
            for t in threads {
                let _unused = t.join();
            }
            return Err(io_error(BACKEND, "spawning the fetch worker", &e));
        }
    }
    Ok(StoreWorker {
        route: Route::TcpStore,
        endpoint: config.endpoint.clone(),
        ops: Box::new(ops_tx),
        fetches: Some(Box::new(fetch_tx)),
        direct: Some(direct as Arc<dyn crate::contract::DirectFetch>),
        threads,
    })
}

fn connect(endpoint: &str, options: &ClientOptions) -> Result<TcpStoreClient, Error> {
    TcpStoreClient::connect(endpoint, options.clone())
        .map_err(|e| Error::backend(BACKEND, format!("store at {endpoint} is unreachable: {e}")))
}

struct Ops {
    shared: Arc<Shared>,
    endpoint: String,
    options: ClientOptions,
    client: Option<TcpStoreClient>,
    /// Labels published and not withdrawn.
    published: BTreeSet<String>,
    /// The last attempt failed; the next connection publishes everything again.
    outage: bool,
    retry_interval: Duration,
    /// A withdrawal mark of ours may be in the store (one from an earlier run, or our
    /// own withdrawal): the next publish deletes it.
    marked: bool,
}

impl Ops {
    fn run(mut self, commands: Receiver<StoreCmd>) {
        // The heartbeat keeps its schedule however busy the queue is.
        let mut next_beat = deadline_after(Instant::now(), self.retry_interval);
        loop {
            let wait = if self.published.is_empty() {
                IDLE_TICK
            } else {
                next_beat.saturating_duration_since(Instant::now())
            };
            let received = commands.recv_timeout(wait);
            if self.shared.stopping() {
                return;
            }
            if !self.published.is_empty() && Instant::now() >= next_beat {
                self.refresh();
                next_beat = deadline_after(Instant::now(), self.retry_interval);
            }
            let cmd = match received {
                Ok(cmd) => cmd,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            match cmd {
                StoreCmd::Publish { label, blob } => {
                    self.published.insert(label.clone());
                    if let Err(error) = self.publish(&label, &blob) {
                        self.failed(&label, error);
                    }
                }
                StoreCmd::Withdraw => {
                    let labels = std::mem::take(&mut self.published);
                    if let Err(error) = self.withdraw(&labels) {
                        self.failed("invalidate", error);
                    }
                }
                StoreCmd::Fetch { agent, label } | StoreCmd::WaitFor { agent, label, .. } => {
                    // Fetches have their own thread; this is only reached by mistake.
                    self.shared.emit(Event::FetchFailed {
                        agent,
                        label,
                        error: Error::backend(BACKEND, "fetch sent to the ops worker"),
                    });
                }
            }
        }
    }

    fn failed(&mut self, what: &str, error: Error) {
        self.client = None;
        self.outage = true;
        log::warn!("tcpstore: {what}: {error}");
        self.shared.emit(Event::SendFailed {
            target: format!("tcpstore {}", self.endpoint),
            what: what.to_owned(),
            error,
        });
    }

    /// The connection, made anew if needed; after an outage, everything published is
    /// published again on the new connection.
    fn client(&mut self) -> Result<&mut TcpStoreClient, Error> {
        if self.client.as_ref().is_some_and(TcpStoreClient::is_broken) {
            self.client = None;
            self.outage = true;
        }
        if self.client.is_none() {
            let mut client = connect(&self.endpoint, &self.options)?;
            if self.outage {
                for label in &self.published {
                    if let Some(blob) = self.shared.local.get(label) {
                        let key = user_key(&self.shared.key(&self.shared.agent, label));
                        client.set(key.as_bytes(), &blob)?;
                    }
                }
                if !self.published.is_empty() {
                    log::info!(
                        "tcpstore: {} is back; published {} label(s) again",
                        self.endpoint,
                        self.published.len()
                    );
                }
                self.outage = false;
            }
            self.client = Some(client);
        }
        self.client
            .as_mut()
            .ok_or_else(|| Error::backend(BACKEND, "no connection"))
    }

    /// SET, confirmed by a CHECK (SET has no reply, so a dead server would otherwise
    /// go unnoticed). Retried once on a fresh connection if a reused one failed.
    fn publish(&mut self, label: &str, blob: &[u8]) -> Result<(), Error> {
        let key = user_key(&self.shared.key(&self.shared.agent, label));
        let mut retried = false;
        loop {
            let reused = self.client.is_some();
            let marked = self.marked;
            let mark = withdrawn_key(&self.shared, &self.shared.agent);
            let beat = heartbeat_key(&self.shared, &self.shared.agent);
            let result = self.client().and_then(|c| {
                c.set(key.as_bytes(), blob)?;
                if marked {
                    c.delete_key(&mark)?;
                }
                if c.check(&[key.as_bytes()])? {
                    // Published first, then the beat: a watcher that sees the beat
                    // move finds the new metadata.
                    c.add(&beat, 1)?;
                    Ok(())
                } else {
                    Err(Error::backend(
                        BACKEND,
                        format!("'{key}' missing right after SET"),
                    ))
                }
            });
            match result {
                Err(_) if reused && !retried => {
                    self.client = None;
                    retried = true;
                }
                Ok(()) => {
                    self.marked = false;
                    return Ok(());
                }
                other => return other,
            }
        }
    }

    /// While idle with something published: make sure it is still there (the server
    /// may have restarted and lost it), publishing again what is missing.
    fn refresh(&mut self) {
        // A reused connection may be to a server that restarted (and lost our keys):
        // then once more at once on a fresh connection, which publishes everything.
        for attempt in 0..2 {
            let reused = self.client.is_some();
            match self.refresh_once() {
                Ok(0) => return,
                Ok(n) => {
                    log::info!(
                        "tcpstore: published {n} missing label(s) again at {}",
                        self.endpoint
                    );
                    return;
                }
                Err(e) => {
                    self.client = None;
                    let first_failure = !self.outage;
                    self.outage = true;
                    if reused && attempt == 0 {
                        continue;
                    }
                    if first_failure {
                        log::warn!("tcpstore: {e}");
                    }
                    return;
                }
            }
        }
    }

    /// Check every published label (one CHECK of all; one per label only when some is
    /// missing), setting again what is missing, then beat; returns how many were set.
    fn refresh_once(&mut self) -> Result<usize, Error> {
        let agent = self.shared.agent.clone();
        let labels: Vec<String> = self.published.iter().cloned().collect();
        let keys: Vec<String> = labels
            .iter()
            .map(|label| user_key(&self.shared.key(&agent, label)))
            .collect();
        let beat = heartbeat_key(&self.shared, &agent);
        let mut republished = 0;
        let all: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        if !self.client()?.check(&all)? {
            for (label, key) in labels.iter().zip(&keys) {
                let present = self.client()?.check(&[key.as_bytes()])?;
                if !present {
                    if let Some(blob) = self.shared.local.get(label) {
                        self.client()?.set(key.as_bytes(), &blob)?;
                        republished += 1;
                    }
                }
            }
        }
        self.client()?.add(&beat, 1)?;
        Ok(republished)
    }

    fn withdraw(&mut self, labels: &BTreeSet<String>) -> Result<(), Error> {
        let agent = self.shared.agent.clone();
        let mut keys: Vec<String> = labels
            .iter()
            .map(|l| user_key(&self.shared.key(&agent, l)))
            .collect();
        if !labels.contains(FULL_LABEL) {
            keys.push(user_key(&self.shared.key(&agent, FULL_LABEL)));
        }
        let mark = withdrawn_key(&self.shared, &agent);
        let beat = heartbeat_key(&self.shared, &agent);
        self.marked = true;
        let client = self.client()?;
        // The mark first: a watcher that sees a key gone sees the mark too.
        client.set(&mark, WITHDRAWN)?;
        for key in keys {
            client.delete_key(key.as_bytes())?;
        }
        client.delete_key(&beat)?;
        Ok(())
    }
}

struct PendingFetch {
    agent: String,
    label: String,
    key: Vec<u8>,
    deadline: Instant,
    /// Already tried the plain GET.
    tried_get: bool,
    /// Already retried once on a fresh connection.
    retried: bool,
}

/// A peer invalidated because its heartbeat stopped (or its key vanished without a
/// mark): read every round, loaded again when its heartbeat moves.
#[derive(Clone)]
struct LostPeer {
    agent: String,
    /// The wire key it was watched under.
    key: Vec<u8>,
    /// Its heartbeat when it was lost (empty: none).
    beat: Vec<u8>,
}

/// The label of a metadata wire key (`/<namespace>/<agent>/<label>`).
fn label_of(key: &[u8]) -> String {
    let label = key.rsplit(|b| *b == b'/').next().unwrap_or_default();
    String::from_utf8_lossy(label).into_owned()
}

struct Fetcher {
    shared: Arc<Shared>,
    endpoint: String,
    options: ClientOptions,
    client: Option<TcpStoreClient>,
    pending: VecDeque<PendingFetch>,
    /// (agent, key) of fetched peers, checked for deletion (shared with the direct
    /// path, which adds to it).
    watched: Watched,
    /// The direct GET path: this worker makes its connection.
    direct: Arc<Direct>,
    watch_interval: Duration,
    /// [`deletion_grace`] of this configuration.
    grace: Duration,
    /// Watched keys found missing without a withdrawal mark, and since when.
    missing_since: HashMap<Vec<u8>, Instant>,
    /// Watched peers' last heartbeat value and when it was first seen (module docs).
    beats: HashMap<String, (Vec<u8>, Instant)>,
    /// Peers invalidated for silence, watched for a return (at most [`LOST_MAX`]).
    lost: VecDeque<LostPeer>,
    watch_outage: bool,
    /// Try a plain GET before waiting. Turned off for good when the server closes the
    /// connection on a GET of a missing key (torch's legacy server does).
    get_first: bool,
}

impl Fetcher {
    fn run(mut self, commands: Receiver<StoreCmd>) {
        let mut next_watch = deadline_after(Instant::now(), self.watch_interval);
        loop {
            if self.shared.stopping() {
                return;
            }
            if self.pending.is_empty() {
                let until_watch = if lock(&self.watched).is_empty() && self.lost.is_empty() {
                    IDLE_TICK
                } else {
                    next_watch.saturating_duration_since(Instant::now())
                };
                match commands.recv_timeout(until_watch) {
                    Ok(cmd) => self.take(cmd),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            loop {
                match commands.try_recv() {
                    Ok(cmd) => self.take(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            if let Some(fetch) = self.pending.pop_front() {
                self.step(fetch);
            }
            let watching = !lock(&self.watched).is_empty() || !self.lost.is_empty();
            if Instant::now() >= next_watch && watching {
                self.watch();
                next_watch = deadline_after(Instant::now(), self.watch_interval);
            }
        }
    }

    fn take(&mut self, cmd: StoreCmd) {
        match cmd {
            StoreCmd::Fetch { agent, label } => {
                let key = user_key(&self.shared.key(&agent, &label)).into_bytes();
                self.pending.push_back(PendingFetch {
                    agent,
                    label,
                    key,
                    deadline: deadline_after(Instant::now(), self.shared.config.fetch_timeout),
                    tried_get: false,
                    retried: false,
                });
            }
            StoreCmd::WaitFor {
                agent,
                label,
                since,
            } => {
                // The direct path's GET found the key missing: wait for it.
                let key = user_key(&self.shared.key(&agent, &label)).into_bytes();
                self.pending.push_back(PendingFetch {
                    agent,
                    label,
                    key,
                    deadline: deadline_after(since, self.shared.config.fetch_timeout),
                    tried_get: true,
                    retried: false,
                });
            }
            StoreCmd::Publish { label, .. } => {
                self.shared.emit(Event::SendFailed {
                    target: format!("tcpstore {}", self.endpoint),
                    what: label,
                    error: Error::backend(BACKEND, "publish sent to the fetch worker"),
                });
            }
            StoreCmd::Withdraw => {}
        }
    }

    fn client(&mut self) -> Result<&mut TcpStoreClient, Error> {
        if self.client.as_ref().is_some_and(TcpStoreClient::is_broken) {
            self.client = None;
        }
        if self.client.is_none() {
            self.client = Some(connect(&self.endpoint, &self.options)?);
        }
        self.client
            .as_mut()
            .ok_or_else(|| Error::backend(BACKEND, "no connection"))
    }

    fn fail(&self, fetch: PendingFetch, error: Error) {
        self.shared.emit(Event::FetchFailed {
            agent: fetch.agent,
            label: fetch.label,
            error,
        });
    }

    /// One step of one fetch: a GET the first time, else one WAIT slice (then GET).
    fn step(&mut self, mut fetch: PendingFetch) {
        let others_pending = !self.pending.is_empty();
        let reused = self.client.is_some();
        let get_first = self.get_first;
        let client = match self.client() {
            Ok(c) => c,
            Err(e) => return self.fail(fetch, e),
        };
        let found = if !fetch.tried_get && get_first {
            fetch.tried_get = true;
            match client.get(&fetch.key) {
                Ok(v) => Ok(v),
                Err(e) => {
                    // Legacy torch servers close the connection on a GET of a missing
                    // key: from now on wait first, then GET.
                    log::info!(
                        "tcpstore: {} closed on GET ({e}); waiting before every GET from now on",
                        self.endpoint
                    );
                    self.get_first = false;
                    self.direct.disable();
                    self.client = None;
                    self.pending.push_front(fetch);
                    return;
                }
            }
        } else {
            let remaining = fetch.deadline.saturating_duration_since(Instant::now());
            let slice = if others_pending {
                remaining.min(WAIT_SLICE)
            } else {
                remaining.min(IDLE_TICK)
            };
            match client.wait(&[&fetch.key], slice) {
                Ok(true) => client.get(&fetch.key),
                Ok(false) => Ok(Vec::new()),
                Err(e) => Err(e),
            }
        };
        match found {
            Ok(blob) if !blob.is_empty() => {
                watch_peer(&self.watched, &fetch.agent, &fetch.key);
                self.shared.emit(Event::Load {
                    agent: fetch.agent,
                    label: fetch.label,
                    blob,
                    route: Route::TcpStore,
                });
                // This agent fetches from the store: later fetches go direct.
                if self.get_first && self.direct.wants_connection() && !self.shared.stopping() {
                    if let Err(e) = self.direct.connect(&self.options) {
                        log::info!(
                            "tcpstore: no direct GET connection to {}: {e}",
                            self.endpoint
                        );
                    }
                }
            }
            // Missing (or deleted between WAIT and GET): wait on, within the deadline.
            Ok(_) if Instant::now() < fetch.deadline => self.pending.push_back(fetch),
            Ok(_) => {
                let detail = format!(
                    "fetch of agent '{}' label '{}' (key '{}') from {}: not published within {} ms",
                    fetch.agent,
                    fetch.label,
                    String::from_utf8_lossy(&fetch.key),
                    self.endpoint,
                    self.shared.config.fetch_timeout.as_millis()
                );
                self.fail(fetch, timeout_error(BACKEND, detail));
            }
            Err(_) if reused && !fetch.retried => {
                // The connection may have died while idle (server restarted): once more
                // on a fresh one.
                self.client = None;
                fetch.retried = true;
                self.pending.push_front(fetch);
            }
            Err(e) => {
                self.client = None;
                self.fail(fetch, e);
            }
        }
    }

    /// One watch round (module docs, "Liveness"): one CHECK of every watched key and
    /// heartbeat, one MULTI_GET of the heartbeats, per-peer requests only for what is
    /// missing. A key deleted by its owner (withdrawal mark), missing for longer than
    /// the grace period, or a heartbeat that did not move for that long, invalidates
    /// the peer; a lost peer whose heartbeat moves is loaded again.
    fn watch(&mut self) {
        // Checked on a snapshot: the direct path may add peers meanwhile.
        let snapshot = lock(&self.watched).clone();
        // A lost peer fetched again is watched again: no longer lost.
        self.lost
            .retain(|l| !snapshot.iter().any(|(agent, _)| *agent == l.agent));
        let lost: Vec<LostPeer> = self.lost.iter().cloned().collect();
        let now = Instant::now();
        let grace = self.grace;
        let shared = self.shared.clone();
        let mut missing_since = std::mem::take(&mut self.missing_since);
        let mut beats = std::mem::take(&mut self.beats);
        // (agent, key, lost for silence rather than withdrawn)
        let mut gone: Vec<(String, Vec<u8>, Option<Vec<u8>>)> = Vec::new();
        // (agent, key, blob) of lost peers that came back.
        let mut back: Vec<(String, Vec<u8>, Vec<u8>)> = Vec::new();
        let result = (|| -> Result<(), Error> {
            let client = self.client()?;
            let watched_beats: Vec<Vec<u8>> = snapshot
                .iter()
                .map(|(agent, _)| heartbeat_key(&shared, agent))
                .collect();
            let lost_beats: Vec<Vec<u8>> = lost
                .iter()
                .map(|l| heartbeat_key(&shared, &l.agent))
                .collect();
            // Every key of the round, in order: watched keys, their beats, lost keys,
            // their beats.
            let keys: Vec<&[u8]> = snapshot
                .iter()
                .map(|(_, key)| key.as_slice())
                .chain(watched_beats.iter().map(Vec::as_slice))
                .chain(lost.iter().map(|l| l.key.as_slice()))
                .chain(lost_beats.iter().map(Vec::as_slice))
                .collect();
            let present: Vec<bool> = if keys.is_empty() || client.check(&keys)? {
                vec![true; keys.len()]
            } else {
                // Something is missing (rare): find out what, one key at a time.
                let mut present = Vec::with_capacity(keys.len());
                for key in &keys {
                    present.push(client.check(&[key])?);
                }
                present
            };
            let (n, m) = (snapshot.len(), lost.len());
            let beat_slots: Vec<usize> = (n..2 * n).chain(2 * n + m..2 * n + 2 * m).collect();
            let to_read: Vec<&[u8]> = beat_slots
                .iter()
                .filter(|&&i| present[i])
                .map(|&i| keys[i])
                .collect();
            let mut values = if to_read.is_empty() {
                Vec::new()
            } else {
                client.multi_get(&to_read)?
            }
            .into_iter();
            let mut beat_value = vec![Vec::new(); keys.len()];
            for &i in &beat_slots {
                if present[i] {
                    beat_value[i] = values.next().unwrap_or_default();
                }
            }
            for (i, (agent, key)) in snapshot.iter().enumerate() {
                let beat = std::mem::take(&mut beat_value[n + i]);
                if !present[i] {
                    let withdrawn = client.check(&[&withdrawn_key(&shared, agent)])?;
                    let since = *missing_since.entry(key.clone()).or_insert(now);
                    if withdrawn {
                        gone.push((agent.clone(), key.clone(), None));
                    } else if now.saturating_duration_since(since) >= grace {
                        gone.push((agent.clone(), key.clone(), Some(beat)));
                    }
                    continue;
                }
                missing_since.remove(key);
                match beats.get_mut(agent) {
                    Some(seen) if seen.0 == beat => {
                        if now.saturating_duration_since(seen.1) >= grace {
                            gone.push((agent.clone(), key.clone(), Some(beat)));
                        }
                    }
                    Some(seen) => *seen = (beat, now),
                    None => {
                        beats.insert(agent.clone(), (beat, now));
                    }
                }
            }
            for (j, l) in lost.iter().enumerate() {
                let (key_slot, beat_slot) = (2 * n + j, 2 * n + m + j);
                let beat = &beat_value[beat_slot];
                if present[key_slot] && present[beat_slot] && *beat != l.beat {
                    let blob = client.get(&l.key)?;
                    if !blob.is_empty() {
                        back.push((l.agent.clone(), l.key.clone(), blob));
                    }
                }
            }
            Ok(())
        })();
        for (agent, _, _) in &gone {
            beats.remove(agent);
            missing_since.retain(|k, _| !snapshot.iter().any(|(a, key)| a == agent && key == k));
        }
        // Forget what is no longer watched (bounded by the watched set).
        missing_since.retain(|k, _| snapshot.iter().any(|(_, key)| key == k));
        beats.retain(|a, _| snapshot.iter().any(|(agent, _)| agent == a));
        for (agent, _, _) in &back {
            beats.insert(agent.clone(), (Vec::new(), now));
        }
        self.missing_since = missing_since;
        self.beats = beats;
        lock(&self.watched).retain(|(a, k)| !gone.iter().any(|(ga, gk, _)| ga == a && gk == k));
        for (agent, key, _) in &back {
            watch_peer(&self.watched, agent, key);
        }
        self.lost
            .retain(|l| !back.iter().any(|(agent, _, _)| *agent == l.agent));
        for (agent, key, beat) in &gone {
            if let Some(beat) = beat {
                self.lost.retain(|l| l.agent != *agent);
                if self.lost.len() >= LOST_MAX {
                    self.lost.pop_front();
                }
                self.lost.push_back(LostPeer {
                    agent: agent.clone(),
                    key: key.clone(),
                    beat: beat.clone(),
                });
            }
        }
        match result {
            Ok(()) => {
                if self.watch_outage {
                    log::info!("tcpstore: {} reachable again", self.endpoint);
                }
                self.watch_outage = false;
            }
            Err(e) => {
                self.client = None;
                if !self.watch_outage {
                    log::warn!("tcpstore: watching fetched peers: {e}");
                }
                self.watch_outage = true;
            }
        }
        for (agent, _, silent) in gone {
            if silent.is_some() {
                log::info!(
                    "tcpstore: '{agent}' gave no sign of life for {} ms; invalidated",
                    grace.as_millis()
                );
            }
            self.shared.emit(Event::Invalidate {
                agent,
                route: Route::TcpStore,
            });
        }
        for (agent, key, blob) in back {
            log::info!("tcpstore: '{agent}' is back; loading its metadata again");
            self.shared.emit(Event::Load {
                agent,
                label: label_of(&key),
                blob,
                route: Route::TcpStore,
            });
        }
    }
}
