//! What the exchange workers hand back to the agent: a bounded queue of [`Event`]s that
//! the agent drains without blocking (see [`crate::Manager::poll`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
}

impl Route {
    /// The backend's name as it appears in errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            Route::P2p => "p2p",
            Route::Etcd => "etcd",
            Route::TcpStore => "tcpstore",
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

/// A bounded multi-producer queue of events. Producers (exchange workers) wait for space
/// when it is full, which holds back the network instead of growing memory or dropping
/// metadata; the consumer (the agent) never waits.
pub(crate) struct EventQueue {
    queue: ArrayQueue<Event>,
    waiting_producers: AtomicUsize,
    space_lock: Mutex<()>,
    space: Condvar,
    /// Consumers blocked in [`EventQueue::wait`].
    waiting_consumers: AtomicUsize,
    ready_lock: Mutex<()>,
    ready: Condvar,
}

/// How long a producer sleeps at most before looking at the queue again, in case a
/// wake-up raced with its going to sleep.
const SPACE_RECHECK: Duration = Duration::from_millis(20);
/// How long [`EventQueue::wait`] keeps looking at the queue before it sleeps: about
/// two loopback round trips of a small fetch. Bounded, and spent only by a caller that
/// asked to wait, so an idle agent spins nothing.
const WAIT_SPIN: Duration = Duration::from_micros(50);
/// Queue checks between two clock reads (and yields) while spinning.
const SPIN_CHECKS_PER_CLOCK_READ: u32 = 64;

impl EventQueue {
    pub(crate) fn new(capacity: usize) -> EventQueue {
        EventQueue {
            queue: ArrayQueue::new(capacity.max(1)),
            waiting_producers: AtomicUsize::new(0),
            space_lock: Mutex::new(()),
            space: Condvar::new(),
            waiting_consumers: AtomicUsize::new(0),
            ready_lock: Mutex::new(()),
            ready: Condvar::new(),
        }
    }

    fn pushed(&self) {
        if self.waiting_consumers.load(Ordering::SeqCst) > 0 {
            // Taking the lock orders this wake-up after the waiter's emptiness check.
            drop(self.ready_lock.lock().unwrap_or_else(|e| e.into_inner()));
            self.ready.notify_all();
        }
    }

    /// Block until an event is queued or `timeout` passes; returns whether one is.
    /// Looks at the queue for up to [`WAIT_SPIN`] before sleeping, so an answer that
    /// is already on its way (a fetch on loopback) costs the waiter no wake-up.
    pub(crate) fn wait(&self, timeout: Duration) -> bool {
        let start = std::time::Instant::now();
        let spin = WAIT_SPIN.min(timeout);
        loop {
            for _ in 0..SPIN_CHECKS_PER_CLOCK_READ {
                if !self.queue.is_empty() {
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
        let deadline = start + timeout;
        self.waiting_consumers.fetch_add(1, Ordering::SeqCst);
        let mut guard = self.ready_lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.queue.is_empty() {
            let now = std::time::Instant::now();
            if now >= deadline {
                break;
            }
            guard = self
                .ready
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(guard);
        self.waiting_consumers.fetch_sub(1, Ordering::SeqCst);
        !self.queue.is_empty()
    }

    /// Push `event`, waiting for space while the queue is full. Returns `false` (and
    /// drops the event) only when `stop` is raised while waiting.
    pub(crate) fn push(&self, event: Event, stop: &AtomicBool) -> bool {
        let mut event = match self.queue.push(event) {
            Ok(()) => {
                self.pushed();
                return true;
            }
            Err(event) => event,
        };
        self.waiting_producers.fetch_add(1, Ordering::SeqCst);
        let pushed = loop {
            if stop.load(Ordering::Acquire) {
                break false;
            }
            let guard = self.space_lock.lock().unwrap_or_else(|e| e.into_inner());
            match self.queue.push(event) {
                Ok(()) => break true,
                Err(back) => event = back,
            }
            let _unused = self
                .space
                .wait_timeout(guard, SPACE_RECHECK)
                .unwrap_or_else(|e| e.into_inner());
        };
        self.waiting_producers.fetch_sub(1, Ordering::SeqCst);
        if pushed {
            self.pushed();
        }
        pushed
    }

    /// Hand every queued event to `each`, without blocking. Returns how many there were.
    pub(crate) fn drain(&self, each: &mut impl FnMut(Event)) -> usize {
        let mut count = 0;
        while let Some(event) = self.queue.pop() {
            each(event);
            count += 1;
        }
        if count > 0 && self.waiting_producers.load(Ordering::SeqCst) > 0 {
            self.space.notify_all();
        }
        count
    }

    /// Wake producers that wait for space (used at shutdown).
    pub(crate) fn wake_all(&self) {
        self.space.notify_all();
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

    #[test]
    fn full_queue_holds_producer_until_drained() {
        let queue = Arc::new(EventQueue::new(2));
        let stop = Arc::new(AtomicBool::new(false));
        let producer = {
            let (queue, stop) = (queue.clone(), stop.clone());
            std::thread::spawn(move || (0..5).all(|i| queue.push(invalidate(i), &stop)))
        };
        let mut names = Vec::new();
        while names.len() < 5 {
            queue.drain(&mut |e| {
                if let Event::Invalidate { agent, .. } = e {
                    names.push(agent)
                }
            });
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(producer.join().unwrap());
        assert_eq!(names, ["a0", "a1", "a2", "a3", "a4"]);
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
    }

    #[test]
    fn stop_releases_a_waiting_producer() {
        let queue = Arc::new(EventQueue::new(1));
        let stop = Arc::new(AtomicBool::new(false));
        assert!(queue.push(invalidate(0), &stop));
        let producer = {
            let (queue, stop) = (queue.clone(), stop.clone());
            std::thread::spawn(move || queue.push(invalidate(1), &stop))
        };
        std::thread::sleep(Duration::from_millis(30));
        stop.store(true, Ordering::Release);
        queue.wake_all();
        assert!(!producer.join().unwrap());
    }
}
