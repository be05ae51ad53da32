//! The in-process store: managers of one process that name the same store share one
//! table of keys. The smallest store that follows the contract (`contract.rs`), and the
//! model for a new one (README, "Adding a store"): one worker thread with a bounded std
//! queue, no direct path.
//!
//! - **Publish** puts `<namespace>/<agent>/<label>` in the table and answers every
//!   fetch waiting for that key (`Load` into the waiter's own event queue).
//! - **Fetch** answers at once when the key is there, else waits (the worker fails it
//!   when the fetch timeout passes). A fetch of full metadata makes the fetcher a
//!   watcher of that agent.
//! - **Withdraw** removes the agent's keys and sends `Invalidate` to its watchers.
//! - **Liveness:** an owner that goes away (its manager is dropped: the in-process form
//!   of a crash) withdraws on its way out, so its watchers are told at once; a new
//!   manager of that name publishes and is fetched again like any other.
//!
//! Bounds: at most [`KEYS_MAX`] keys and [`WAITERS_MAX`] waiting fetches per store,
//! [`WATCHERS_MAX`] watchers; past them a `Capacity` error for that command.

pub(crate) mod config;

use std::collections::HashMap;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use ferry_storage::Error;

use config::InProcessConfig;

use crate::contract::{Shared, StoreCmd, StoreWorker};
use crate::events::{Event, Route, FULL_LABEL};
use crate::util::{deadline_after, io_error, lock, timeout_error};

const BACKEND: &str = "in-process store";
/// Most keys in one store.
pub(crate) const KEYS_MAX: usize = 1 << 20;
/// Most fetches waiting for a key, in one store.
pub(crate) const WAITERS_MAX: usize = 1 << 16;
/// Most (watcher, watched agent) pairs in one store.
pub(crate) const WATCHERS_MAX: usize = 1 << 16;
/// How often an idle worker looks at the stop flag.
const IDLE_TICK: Duration = Duration::from_millis(500);

/// A fetch waiting for its key.
struct Waiter {
    key: String,
    agent: String,
    label: String,
    fetcher: Weak<Shared>,
    deadline: Instant,
}

#[derive(Default)]
struct Table {
    /// Key → (owner agent, value).
    entries: HashMap<String, (String, Arc<[u8]>)>,
    waiters: Vec<Waiter>,
    /// (watched agent, watcher).
    watchers: Vec<(String, Weak<Shared>)>,
}

/// One named store.
#[derive(Default)]
struct Space {
    table: Mutex<Table>,
}

/// The stores of this process, by name; a store lives while a manager uses it.
fn space(name: &str) -> Arc<Space> {
    static SPACES: OnceLock<Mutex<HashMap<String, Weak<Space>>>> = OnceLock::new();
    let mut spaces = lock(SPACES.get_or_init(Mutex::default));
    spaces.retain(|_, s| s.strong_count() > 0);
    if let Some(s) = spaces.get(name).and_then(Weak::upgrade) {
        return s;
    }
    let s = Arc::new(Space::default());
    spaces.insert(name.to_owned(), Arc::downgrade(&s));
    s
}

/// Start the worker (contract: `contract.rs`).
pub(crate) fn start(shared: Arc<Shared>, config: &InProcessConfig) -> Result<StoreWorker, Error> {
    let (tx, rx) = sync_channel(shared.config.command_capacity);
    let worker = Worker {
        space: space(&config.name),
        shared: shared.clone(),
    };
    let thread = std::thread::Builder::new()
        .name(format!("ferry-inproc-{}", shared.agent))
        .spawn(move || worker.run(&rx))
        .map_err(|e| io_error(BACKEND, "spawning the worker", &e))?;
    Ok(StoreWorker {
        route: Route::InProcess,
        endpoint: format!("'{}'", config.name),
        ops: Box::new(tx),
        fetches: None,
        direct: None,
        threads: vec![thread],
    })
}

struct Worker {
    space: Arc<Space>,
    shared: Arc<Shared>,
}

impl Worker {
    fn run(self, commands: &Receiver<StoreCmd>) {
        loop {
            let wait = self.next_deadline().map_or(IDLE_TICK, |d| {
                d.saturating_duration_since(Instant::now()).min(IDLE_TICK)
            });
            match commands.recv_timeout(wait) {
                Ok(cmd) if !self.shared.stopping() => self.command(cmd),
                Ok(_) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) if self.shared.stopping() => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
            self.expire();
        }
        // Going away (the manager was dropped): withdraw, so watchers learn at once.
        self.withdraw();
    }

    fn command(&self, cmd: StoreCmd) {
        match cmd {
            StoreCmd::Publish { label, blob } => self.publish(&label, blob),
            StoreCmd::Fetch { agent, label } | StoreCmd::WaitFor { agent, label, .. } => {
                self.fetch(agent, label)
            }
            StoreCmd::Withdraw => self.withdraw(),
        }
    }

    fn publish(&self, label: &str, blob: Arc<[u8]>) {
        let key = self.shared.key(&self.shared.agent, label);
        let mut answered = Vec::new();
        {
            let mut table = lock(&self.space.table);
            if !table.entries.contains_key(&key) && table.entries.len() >= KEYS_MAX {
                drop(table);
                self.shared.emit(Event::SendFailed {
                    target: BACKEND.into(),
                    what: label.to_owned(),
                    error: Error::Capacity {
                        what: "keys of the in-process store",
                        limit: KEYS_MAX,
                    },
                });
                return;
            }
            table
                .entries
                .insert(key.clone(), (self.shared.agent.clone(), blob.clone()));
            let mut i = 0;
            while i < table.waiters.len() {
                if table.waiters[i].key == key {
                    answered.push(table.waiters.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            for w in &answered {
                if w.label == FULL_LABEL {
                    watch(&mut table, &w.agent, &w.fetcher);
                }
            }
        }
        for w in answered {
            if let Some(fetcher) = w.fetcher.upgrade() {
                fetcher.emit(Event::Load {
                    agent: w.agent,
                    label: w.label,
                    blob: blob.to_vec(),
                    route: Route::InProcess,
                });
            }
        }
    }

    fn fetch(&self, agent: String, label: String) {
        let key = self.shared.key(&agent, &label);
        let found = {
            let mut table = lock(&self.space.table);
            match table.entries.get(&key).map(|(_, v)| v.clone()) {
                Some(blob) => {
                    if label == FULL_LABEL {
                        watch(&mut table, &agent, &Arc::downgrade(&self.shared));
                    }
                    Ok(Some(blob))
                }
                None if table.waiters.len() >= WAITERS_MAX => Err(Error::Capacity {
                    what: "fetches waiting in the in-process store",
                    limit: WAITERS_MAX,
                }),
                None => {
                    table.waiters.push(Waiter {
                        key,
                        agent: agent.clone(),
                        label: label.clone(),
                        fetcher: Arc::downgrade(&self.shared),
                        deadline: deadline_after(Instant::now(), self.shared.config.fetch_timeout),
                    });
                    Ok(None)
                }
            }
        };
        let event = match found {
            Ok(None) => return,
            Ok(Some(blob)) => Event::Load {
                agent,
                label,
                blob: blob.to_vec(),
                route: Route::InProcess,
            },
            Err(error) => Event::FetchFailed {
                agent,
                label,
                error,
            },
        };
        self.shared.emit(event);
    }

    fn withdraw(&self) {
        let me = &self.shared.agent;
        let watchers: Vec<Arc<Shared>> = {
            let mut table = lock(&self.space.table);
            table.entries.retain(|_, (owner, _)| owner != me);
            let mut told = Vec::new();
            table.watchers.retain(|(agent, watcher)| {
                if agent == me {
                    told.extend(watcher.upgrade());
                    false
                } else {
                    watcher.strong_count() > 0
                }
            });
            // Our own waiting fetches and watches end with us when we stop.
            if self.shared.stopping() {
                let mine = Arc::downgrade(&self.shared);
                table.waiters.retain(|w| !w.fetcher.ptr_eq(&mine));
                table.watchers.retain(|(_, w)| !w.ptr_eq(&mine));
            }
            told
        };
        for watcher in watchers {
            watcher.emit(Event::Invalidate {
                agent: me.clone(),
                route: Route::InProcess,
            });
        }
    }

    /// The earliest deadline of this worker's waiting fetches.
    fn next_deadline(&self) -> Option<Instant> {
        let mine = Arc::downgrade(&self.shared);
        let table = lock(&self.space.table);
        table
            .waiters
            .iter()
            .filter(|w| w.fetcher.ptr_eq(&mine))
            .map(|w| w.deadline)
            .min()
    }

    /// Fail this worker's fetches whose deadline passed.
    fn expire(&self) {
        let now = Instant::now();
        let mine = Arc::downgrade(&self.shared);
        let mut expired = Vec::new();
        {
            let mut table = lock(&self.space.table);
            let mut i = 0;
            while i < table.waiters.len() {
                let w = &table.waiters[i];
                if w.fetcher.ptr_eq(&mine) && w.deadline <= now {
                    expired.push(table.waiters.swap_remove(i));
                } else {
                    i += 1;
                }
            }
        }
        for w in expired {
            let detail = format!(
                "fetch of agent '{}' label '{}' (key '{}'): not published within {} ms",
                w.agent,
                w.label,
                w.key,
                self.shared.config.fetch_timeout.as_millis()
            );
            self.shared.emit(Event::FetchFailed {
                agent: w.agent,
                label: w.label,
                error: timeout_error(BACKEND, detail),
            });
        }
    }
}

/// Make `watcher` a watcher of `agent` (once; bounded, dead watchers pruned first).
fn watch(table: &mut Table, agent: &str, watcher: &Weak<Shared>) {
    let known = table
        .watchers
        .iter()
        .any(|(a, w)| a == agent && w.ptr_eq(watcher));
    if known {
        return;
    }
    if table.watchers.len() >= WATCHERS_MAX {
        table.watchers.retain(|(_, w)| w.strong_count() > 0);
    }
    if table.watchers.len() < WATCHERS_MAX {
        table.watchers.push((agent.to_owned(), watcher.clone()));
    } else {
        log::warn!("in-process store: {WATCHERS_MAX} watchers; '{agent}' is not watched");
    }
}
