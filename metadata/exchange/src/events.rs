//! What the exchange workers hand back to the agent: a bounded queue of [`Event`]s that
//! the agent drains without blocking (see [`crate::Manager::poll`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use ferry_storage::Error;

/// Label under which an agent's full metadata travels and is stored.
pub const FULL_LABEL: &str = "metadata";

/// Which exchange path produced an event or carried a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// Direct socket to a peer's P2P listener.
    P2p,
    /// The etcd store.
    Etcd,
    /// The TCPStore store.
    TcpStore,
    /// The in-process store.
    InProcess,
}

impl Route {
    /// The backend's name as it appears in errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            Route::P2p => "p2p",
            Route::Etcd => "etcd",
            Route::TcpStore => "tcpstore",
            Route::InProcess => "in-process",
        }
    }
}

/// One result of exchange work, for the agent to apply on its own thread.
#[derive(Debug)]
pub enum Event {
    /// Metadata of `agent` arrived (a fetch answered, or a peer pushed it to us). The
    /// agent loads `blob` through its normal load path, which validates it and checks
    /// that it really describes `agent`.
    Load {
        /// The agent the metadata claims to describe (from the request context: the
        /// store key, or the sender's name in the P2P frame).
        agent: String,
        /// [`FULL_LABEL`] for full metadata, otherwise the partial metadata's label.
        label: String,
        /// The serialized metadata, opaque to this crate.
        blob: Vec<u8>,
        /// How it arrived.
        route: Route,
    },
    /// `agent` withdrew its metadata (P2P message, store key deleted, lease expired):
    /// the agent drops that peer.
    Invalidate {
        /// The peer whose metadata is no longer valid.
        agent: String,
        /// How we learned it.
        route: Route,
    },
    /// A `fetch_remote_md` failed for good (timed out, store unreachable, refused).
    FetchFailed {
        /// The agent that was asked for.
        agent: String,
        /// The label that was asked for.
        label: String,
        /// Why.
        error: Error,
    },
    /// Events were dropped because the queue was full (the agent did not poll for a
    /// while; policy: the crate's README, "Event policy"). For `Some(agent)`, every
    /// event about that agent from the first one dropped until this one was coalesced
    /// here, so the
    /// agent's state is unknown: when `lost.invalidation`, drop the peer (the last word
    /// may have been a withdrawal); in any case fetch it again if it is still wanted.
    /// `None`: events about agents beyond the loss ledger's bound, or failed sends.
    Overflow {
        /// The agent the lost events were about, if known.
        agent: Option<String>,
        /// What was lost.
        lost: Lost,
        /// The typed error to report: [`Error::Capacity`] of the event queue.
        error: Error,
    },
    /// A `send_local_md`, `send_local_partial_md` or `invalidate_local_md` failed.
    SendFailed {
        /// Where it was going (peer address, or the store's name).
        target: String,
        /// What was being sent: a label, or "invalidate".
        what: String,
        /// Why.
        error: Error,
    },
}

/// One line about an event for the log: what, about whom, by which route, a blob's
/// size (never its bytes).
pub(crate) struct EventText<'a>(pub(crate) &'a Event);

impl std::fmt::Display for EventText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Event::Load {
                agent,
                label,
                blob,
                route,
            } => write!(
                f,
                "metadata '{label}' of '{agent}' arrived over {} ({} bytes)",
                route.name(),
                blob.len()
            ),
            Event::Invalidate { agent, route } => write!(
                f,
                "'{agent}' withdrew its metadata (learned over {}: message, key deleted or \
                 lease expired)",
                route.name()
            ),
            Event::FetchFailed {
                agent,
                label,
                error,
            } => write!(f, "fetching '{label}' of '{agent}' failed: {error}"),
            Event::Overflow { agent, lost, .. } => write!(
                f,
                "{} event(s) about {} lost to a full queue",
                lost.events,
                agent.as_deref().unwrap_or("unnamed agents")
            ),
            Event::SendFailed {
                target,
                what,
                error,
            } => write!(f, "sending '{what}' to {target} failed: {error}"),
        }
    }
}

/// What was lost for one agent (or for unknown agents) when the event queue was full.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lost {
    /// Events dropped.
    pub events: u64,
    /// Whether one of them was an invalidation.
    pub invalidation: bool,
    /// Whether one of them was metadata to load.
    pub loads: bool,
}

/// A bounded multi-producer queue of events. Neither side ever waits for the other:
///
/// - The consumer (the agent) drains it without blocking ([`Self::drain`]).
/// - A producer (an exchange worker, a connection of the P2P listener) that finds it
///   full does not wait: the event is dropped, counted, and recorded in the **loss
///   ledger**, coalesced per agent ([`Lost`]). From then on, until the agent drains
///   the ledger, every further event about that agent is coalesced there too (so the
///   queued events about an agent are always older than its lost ones). After the
///   queue, [`Self::drain`] hands out one [`Event::Overflow`] per agent of the ledger
///   with a typed [`Error::Capacity`]; nothing is lost silently. The ledger holds at
///   most the queue's capacity of agents; beyond that, losses are counted without a
///   name (one `Overflow` with `agent: None`), as are lost send failures.
/// - [`Self::push`] returns whether the event was queued, so a producer that can tell
///   its peer (the P2P listener answers a refused push with an error frame) does.
pub(crate) struct EventQueue {
    queue: ArrayQueue<Event>,
    /// Agents with dropped events, by name, and what was dropped.
    ledger: Mutex<Ledger>,
    /// Whether the ledger holds anything (read without its lock on the fast path).
    lossy: AtomicBool,
    /// Events dropped since the queue was made.
    dropped: AtomicU64,
    /// Consumers blocked in [`EventQueue::wait`].
    waiting_consumers: AtomicUsize,
    ready_lock: Mutex<()>,
    ready: Condvar,
}

#[derive(Default)]
struct Ledger {
    by_agent: BTreeMap<String, Lost>,
    /// Losses not attributed to an agent (ledger full, or failed sends).
    unnamed: Lost,
}

/// How long [`EventQueue::wait`] keeps looking at the queue before it sleeps: about
/// two loopback round trips of a small fetch. Bounded, and spent only by a caller that
/// asked to wait, so an idle agent spins nothing.
const WAIT_SPIN: Duration = Duration::from_micros(50);
/// Queue checks between two clock reads (and yields) while spinning.
const SPIN_CHECKS_PER_CLOCK_READ: u32 = 64;

/// The agent an event is about, and whether it is an invalidation / a load.
fn subject(event: &Event) -> (Option<&str>, bool, bool) {
    match event {
        Event::Load { agent, .. } => (Some(agent), false, true),
        Event::Invalidate { agent, .. } => (Some(agent), true, false),
        Event::FetchFailed { agent, .. } => (Some(agent), false, false),
        Event::Overflow { agent, .. } => (agent.as_deref(), false, false),
        Event::SendFailed { .. } => (None, false, false),
    }
}

impl Lost {
    fn add(&mut self, invalidation: bool, load: bool) {
        self.events = self.events.saturating_add(1);
        self.invalidation |= invalidation;
        self.loads |= load;
    }
}

impl EventQueue {
    pub(crate) fn new(capacity: usize) -> EventQueue {
        EventQueue {
            queue: ArrayQueue::new(capacity.max(1)),
            ledger: Mutex::new(Ledger::default()),
            lossy: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
            waiting_consumers: AtomicUsize::new(0),
            ready_lock: Mutex::new(()),
            ready: Condvar::new(),
        }
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        crate::util::lock(&self.ledger)
    }

    fn pushed(&self) {
        if self.waiting_consumers.load(Ordering::SeqCst) > 0 {
            // Taking the lock orders this wake-up after the waiter's emptiness check.
            drop(crate::util::lock(&self.ready_lock));
            self.ready.notify_all();
        }
    }

    /// Events dropped because the queue was full, since it was made.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Block until an event is queued or `timeout` passes; returns whether one is.
    /// Looks at the queue for up to [`WAIT_SPIN`] before sleeping, so an answer that
    /// is already on its way (a fetch on loopback) costs the waiter no wake-up.
    pub(crate) fn wait(&self, timeout: Duration) -> bool {
        let start = std::time::Instant::now();
        let spin = WAIT_SPIN.min(timeout);
        loop {
            for _ in 0..SPIN_CHECKS_PER_CLOCK_READ {
                if self.ready_now() {
                    return true;
                }
                std::hint::spin_loop();
            }
            if start.elapsed() >= spin {
                break;
            }
            // Let a thread that shares this core (the one bringing the answer) run.
            std::thread::yield_now();
        }
        let deadline = crate::util::deadline_after(start, timeout);
        self.waiting_consumers.fetch_add(1, Ordering::SeqCst);
        let mut guard = crate::util::lock(&self.ready_lock);
        while !self.ready_now() {
            let now = std::time::Instant::now();
            if now >= deadline {
                break;
            }
            guard = crate::util::wait_timeout(&self.ready, guard, deadline - now);
        }
        drop(guard);
        self.waiting_consumers.fetch_sub(1, Ordering::SeqCst);
        self.ready_now()
    }

    fn ready_now(&self) -> bool {
        !self.queue.is_empty() || self.lossy.load(Ordering::Acquire)
    }

    /// Queue `event` without waiting. Returns `false` when it was not queued: the
    /// queue is full (the event went to the loss ledger, see the type's docs) or
    /// `stop` is raised (shutting down: dropped).
    pub(crate) fn push(&self, event: Event, stop: &AtomicBool) -> bool {
        if stop.load(Ordering::Acquire) {
            return false;
        }
        if !self.lossy.load(Ordering::Acquire) {
            match self.queue.push(event) {
                Ok(()) => {
                    self.pushed();
                    return true;
                }
                Err(event) => {
                    self.lose(event);
                    return false;
                }
            }
        }
        // Losses are pending: an agent in the ledger keeps collecting there, so its
        // queued events stay older than its lost ones.
        let mut ledger = self.ledger();
        let (agent, invalidation, load) = subject(&event);
        if let Some(lost) = agent.and_then(|a| ledger.by_agent.get_mut(a)) {
            lost.add(invalidation, load);
            drop(ledger);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            self.pushed();
            return false;
        }
        match self.queue.push(event) {
            Ok(()) => {
                drop(ledger);
                self.pushed();
                true
            }
            Err(event) => {
                Self::record(&mut ledger, &event, self.queue.capacity());
                self.lossy.store(true, Ordering::Release);
                drop(ledger);
                self.dropped.fetch_add(1, Ordering::Relaxed);
                self.pushed();
                false
            }
        }
    }

    fn lose(&self, event: Event) {
        let mut ledger = self.ledger();
        Self::record(&mut ledger, &event, self.queue.capacity());
        self.lossy.store(true, Ordering::Release);
        drop(ledger);
        // Logged at the 1st, 2nd, 4th, 8th … drop: a queue nobody polls must not flood
        // the log with a line per event.
        let dropped = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
        if dropped.is_power_of_two() {
            log::warn!(
                "exchange: event queue full ({} events): {dropped} event(s) dropped so far, \
                 reported as overflows (logged at the 1st, 2nd, 4th, 8th … drop)",
                self.queue.capacity()
            );
        }
        self.pushed();
    }

    fn record(ledger: &mut Ledger, event: &Event, capacity: usize) {
        let (agent, invalidation, load) = subject(event);
        match agent {
            Some(a) if ledger.by_agent.contains_key(a) || ledger.by_agent.len() < capacity => {
                ledger
                    .by_agent
                    .entry(a.to_owned())
                    .or_default()
                    .add(invalidation, load);
            }
            _ => ledger.unnamed.add(invalidation, load),
        }
    }

    /// Hand every queued event to `each`, then one [`Event::Overflow`] per entry of
    /// the loss ledger, without blocking. Returns how many events there were.
    pub(crate) fn drain(&self, each: &mut impl FnMut(Event)) -> usize {
        let mut count = 0;
        while let Some(event) = self.queue.pop() {
            each(event);
            count += 1;
        }
        if self.lossy.load(Ordering::Acquire) {
            let ledger = {
                let mut ledger = self.ledger();
                self.lossy.store(false, Ordering::Release);
                std::mem::take(&mut *ledger)
            };
            let limit = self.queue.capacity();
            let error = || {
                Error::Capacity {
                what: "exchange event queue (events dropped: poll the exchange more often or raise event_capacity)",
                limit,
            }
            };
            for (agent, lost) in ledger.by_agent {
                each(Event::Overflow {
                    agent: Some(agent),
                    lost,
                    error: error(),
                });
                count += 1;
            }
            if ledger.unnamed.events > 0 {
                each(Event::Overflow {
                    agent: None,
                    lost: ledger.unnamed,
                    error: error(),
                });
                count += 1;
            }
        }
        count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn invalidate(i: usize) -> Event {
        Event::Invalidate {
            agent: format!("a{i}"),
            route: Route::P2p,
        }
    }

    fn load(agent: &str) -> Event {
        Event::Load {
            agent: agent.into(),
            label: FULL_LABEL.into(),
            blob: vec![1],
            route: Route::P2p,
        }
    }

    fn drained(queue: &EventQueue) -> Vec<Event> {
        let mut out = Vec::new();
        queue.drain(&mut |e| out.push(e));
        out
    }

    #[test]
    fn a_full_queue_never_blocks_and_reports_what_it_dropped() {
        let queue = EventQueue::new(2);
        let stop = AtomicBool::new(false);
        assert!(queue.push(load("x"), &stop));
        assert!(queue.push(invalidate(0), &stop));
        // Full: dropped at once, into the ledger.
        assert!(!queue.push(invalidate(1), &stop));
        assert!(!queue.push(load("x"), &stop));
        assert!(!queue.push(load("a1"), &stop));
        assert_eq!(queue.dropped(), 3);
        let events = drained(&queue);
        assert_eq!(events.len(), 4, "{events:?}");
        assert!(matches!(&events[0], Event::Load { agent, .. } if agent == "x"));
        let overflows: Vec<_> = events[2..]
            .iter()
            .map(|e| match e {
                Event::Overflow {
                    agent: Some(a),
                    lost,
                    error: Error::Capacity { .. },
                } => (a.as_str(), *lost),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            overflows,
            [
                (
                    "a1",
                    Lost {
                        events: 2,
                        invalidation: true,
                        loads: true
                    }
                ),
                (
                    "x",
                    Lost {
                        events: 1,
                        invalidation: false,
                        loads: true
                    }
                ),
            ]
        );
        // Drained: the queue takes events again.
        assert!(queue.push(invalidate(3), &stop));
        assert_eq!(drained(&queue).len(), 1);
    }

    #[test]
    fn an_agent_with_losses_keeps_collecting_in_the_ledger_until_drained() {
        let queue = EventQueue::new(1);
        let stop = AtomicBool::new(false);
        assert!(queue.push(load("y"), &stop));
        assert!(!queue.push(invalidate(7), &stop));
        // Room again (as while the agent drains), but a7's later event must not
        // overtake its lost invalidation: it joins the ledger. Another agent's event
        // is queued.
        assert!(queue.queue.pop().is_some());
        assert!(!queue.push(load("a7"), &stop));
        assert!(queue.push(load("z"), &stop));
        let events = drained(&queue);
        assert_eq!(events.len(), 2, "{events:?}");
        assert!(matches!(&events[0], Event::Load { agent, .. } if agent == "z"));
        assert!(matches!(
            &events[1],
            Event::Overflow {
                agent: Some(a),
                lost: Lost {
                    events: 2,
                    invalidation: true,
                    loads: true
                },
                ..
            } if a == "a7"
        ));
    }

    #[test]
    fn the_ledger_is_bounded_and_counts_the_rest_without_names() {
        let queue = EventQueue::new(2);
        let stop = AtomicBool::new(false);
        for i in 0..10 {
            queue.push(invalidate(i), &stop);
        }
        let events = drained(&queue);
        // 2 queued, 2 named overflows, one unnamed with the other 6.
        assert_eq!(events.len(), 5);
        assert!(matches!(
            &events[4],
            Event::Overflow {
                agent: None,
                lost: Lost {
                    events: 6,
                    invalidation: true,
                    ..
                },
                ..
            }
        ));
    }

    #[test]
    fn wait_returns_when_an_event_arrives_or_the_time_is_up() {
        let queue = Arc::new(EventQueue::new(4));
        let stop = AtomicBool::new(false);
        let t = std::time::Instant::now();
        assert!(!queue.wait(Duration::from_millis(30)));
        assert!(t.elapsed() >= Duration::from_millis(30));
        let producer = {
            let queue = queue.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                queue.push(invalidate(0), &AtomicBool::new(false))
            })
        };
        assert!(queue.wait(Duration::from_secs(10)));
        assert!(producer.join().unwrap());
        assert!(queue.push(invalidate(1), &stop));
        assert!(queue.wait(Duration::ZERO), "already queued");
        assert!(
            queue.wait(Duration::MAX),
            "a huge timeout does not overflow"
        );
    }

    #[test]
    fn nothing_is_queued_after_stop() {
        let queue = EventQueue::new(4);
        let stop = AtomicBool::new(true);
        assert!(!queue.push(invalidate(0), &stop));
        assert_eq!(drained(&queue).len(), 0);
    }
}
