//! Agent-level counters and histograms, recorded by the executor as it posts and routes
//! completions, readable from any thread at any time ([`Metrics::snapshot`]).
//!
//! # Recording costs (nearly) nothing
//!
//! Every recording call runs under the agent's world lock, so each counter has exactly
//! one writer at a time: a record is a relaxed load plus a relaxed store of an
//! [`AtomicU64`] (plain `mov`s on x86-64 and AArch64, no locked instruction), and
//! readers on other threads (a Prometheus scrape) see whole values. Nothing allocates;
//! the latency histogram has fixed power-of-two buckets, so recording one completion is
//! a `leading_zeros` and three stores. Counters written outside the lock (the exchange's)
//! use `fetch_add`; they are not on the transfer path.
//!
//! Per backend (indexed by the backend's slot): requests posted, bytes and descriptors
//! (after merging) posted, requests completed and failed, post→complete latency. Per
//! agent: request errors by kind (the status names of [`Error::status_name`]: refused
//! posts and failed completions), exchange fetches, loads, failures and invalidations,
//! and the peers known.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use ferry_storage::{Error, MAX_BACKENDS};

/// Latency buckets: bucket `i` counts latencies below `2^i` µs (1 µs … ~36 min); the
/// last one counts everything longer.
pub const LATENCY_BUCKETS: usize = 32;

/// The kinds request errors are counted by (the reference system's status names).
pub const ERROR_KINDS: [&str; 11] = [
    "INVALID_PARAM",
    "NOT_FOUND",
    "MISMATCH",
    "NOT_ALLOWED",
    "REPOST_ACTIVE",
    "NOT_SUPPORTED",
    "BACKEND",
    "REMOTE_DISCONNECT",
    "CANCELED",
    "NO_TELEM",
    "POISONED",
];

/// Add `n` to a counter that only the world-lock holder writes.
#[inline(always)]
fn bump(counter: &AtomicU64, n: u64) {
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(n),
        Ordering::Relaxed,
    );
}

#[derive(Debug, Default)]
struct BackendCounters {
    posted: AtomicU64,
    bytes: AtomicU64,
    descriptors: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    refused: AtomicU64,
    latency_sum_ns: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS],
}

/// The agent's metrics (shared: the agent, its exporter, anyone holding the `Arc`).
#[derive(Debug, Default)]
pub struct Metrics {
    backends: [BackendCounters; MAX_BACKENDS],
    /// Backend type name per slot (set when a backend is added).
    names: Mutex<[Option<&'static str>; MAX_BACKENDS]>,
    errors: [AtomicU64; ERROR_KINDS.len()],
    flushes: AtomicU64,
    peers: AtomicU64,
    fetches: AtomicU64,
    fetch_failures: AtomicU64,
    loads: AtomicU64,
    load_failures: AtomicU64,
    invalidations: AtomicU64,
    send_failures: AtomicU64,
}

/// What happened in the exchange (counted with [`Metrics::exchange`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExchangeEvent {
    /// A fetch of a peer's metadata was started.
    Fetch,
    /// A fetch failed (timeout, store error).
    FetchFailed,
    /// Fetched or pushed metadata was loaded.
    Loaded,
    /// Fetched or pushed metadata was refused at load.
    LoadFailed,
    /// A peer was invalidated (withdrawal, lease expiry, deletion).
    Invalidated,
    /// A send, publish or withdrawal failed.
    SendFailed,
}

/// One backend's figures in a [`MetricsSnapshot`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendMetrics {
    /// Backend type name.
    pub name: &'static str,
    /// Requests posted (accepted by the backend).
    pub posted: u64,
    /// Bytes of the posted requests.
    pub bytes: u64,
    /// Descriptors of the posted requests, after merging.
    pub descriptors: u64,
    /// Requests that completed successfully.
    pub completed: u64,
    /// Requests that failed after being posted (also those whose peer went away while
    /// they were in flight, counted when their backend confirmed the end).
    pub failed: u64,
    /// Posts the backend refused (the request never went out).
    pub refused: u64,
    /// Sum of post→complete latencies (completions with telemetry).
    pub latency_sum: Duration,
    /// Post→complete latency histogram: `latency[i]` = completions under `2^i` µs and
    /// at least `2^(i-1)` µs (the last bucket: everything longer).
    pub latency: [u64; LATENCY_BUCKETS],
}

impl BackendMetrics {
    /// Completions in the histogram.
    pub fn latency_count(&self) -> u64 {
        self.latency.iter().sum()
    }

    /// The upper bound of the bucket holding quantile `q` (0..=1) of the latencies,
    /// `None` without completions.
    pub fn latency_quantile(&self, q: f64) -> Option<Duration> {
        let count = self.latency_count();
        if count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, n) in self.latency.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(bucket_upper(i));
            }
        }
        Some(bucket_upper(LATENCY_BUCKETS - 1))
    }
}

/// Upper bound of latency bucket `i` (the last one is open: its bound is reported as
/// `2^i` µs).
pub fn bucket_upper(i: usize) -> Duration {
    Duration::from_micros(1u64 << i.min(63))
}

/// A copy of an agent's metrics at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Per backend, in slot order (only slots that hold a backend).
    pub backends: Vec<BackendMetrics>,
    /// Request errors by kind: (status name, count), in [`ERROR_KINDS`] order.
    pub errors: Vec<(&'static str, u64)>,
    /// Flushes run.
    pub flushes: u64,
    /// Peers whose metadata is loaded.
    pub peers: u64,
    /// Exchange fetches started.
    pub fetches: u64,
    /// Exchange fetches that failed.
    pub fetch_failures: u64,
    /// Exchange metadata loaded (fetched or pushed).
    pub loads: u64,
    /// Exchange metadata refused at load.
    pub load_failures: u64,
    /// Peers invalidated through the exchange.
    pub invalidations: u64,
    /// Failed exchange sends, publishes and withdrawals.
    pub send_failures: u64,
}

impl MetricsSnapshot {
    /// The figures of the backend named `name`.
    pub fn backend(&self, name: &str) -> Option<&BackendMetrics> {
        self.backends.iter().find(|b| b.name == name)
    }

    /// Errors of kind `kind` (a status name).
    pub fn errors_of(&self, kind: &str) -> u64 {
        self.errors
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| *n)
    }
}

impl Metrics {
    /// Name backend slot `slot` (when a backend is added).
    pub fn set_backend(&self, slot: usize, name: &'static str) {
        if slot < MAX_BACKENDS {
            self.names.lock().unwrap_or_else(|e| e.into_inner())[slot] = Some(name);
        }
    }

    /// A request of `bytes` in `descriptors` merged ranges was posted to `slot`
    /// (world lock held).
    #[inline]
    pub fn posted(&self, slot: usize, bytes: u64, descriptors: u64) {
        let b = &self.backends[slot];
        bump(&b.posted, 1);
        bump(&b.bytes, bytes);
        bump(&b.descriptors, descriptors);
    }

    /// A request of `slot` completed (world lock held); `latency` when telemetry is on.
    #[inline]
    pub fn completed(&self, slot: usize, latency: Option<Duration>, error: Option<&Error>) {
        let b = &self.backends[slot];
        match error {
            None => bump(&b.completed, 1),
            Some(e) => {
                bump(&b.failed, 1);
                self.error(e);
            }
        }
        if let Some(latency) = latency {
            // u64 arithmetic only (Duration's u128 conversions cost a division).
            let nanos = latency
                .as_secs()
                .saturating_mul(1_000_000_000)
                .saturating_add(u64::from(latency.subsec_nanos()));
            let micros = nanos / 1000;
            let bucket = ((u64::BITS - micros.leading_zeros()) as usize).min(LATENCY_BUCKETS - 1);
            bump(&b.latency[bucket], 1);
            bump(&b.latency_sum_ns, nanos);
        }
    }

    /// A post to `slot` was refused by the backend (world lock held).
    pub fn post_refused(&self, slot: usize, error: &Error) {
        bump(&self.backends[slot].refused, 1);
        self.error(error);
    }

    /// A request error of any kind (world lock held).
    pub fn error(&self, error: &Error) {
        let name = error.status_name();
        if let Some(i) = ERROR_KINDS.iter().position(|k| *k == name) {
            bump(&self.errors[i], 1);
        }
    }

    /// A flush ran; `peers` are known (world lock held).
    #[inline]
    pub fn flushed(&self, peers: usize) {
        bump(&self.flushes, 1);
        self.peers.store(peers as u64, Ordering::Relaxed);
    }

    /// Count an exchange event (any thread).
    pub fn exchange(&self, event: ExchangeEvent) {
        let counter = match event {
            ExchangeEvent::Fetch => &self.fetches,
            ExchangeEvent::FetchFailed => &self.fetch_failures,
            ExchangeEvent::Loaded => &self.loads,
            ExchangeEvent::LoadFailed => &self.load_failures,
            ExchangeEvent::Invalidated => &self.invalidations,
            ExchangeEvent::SendFailed => &self.send_failures,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests posted and not ended yet, all backends together (any thread).
    pub fn in_flight(&self) -> u64 {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        self.backends
            .iter()
            .map(|b| {
                load(&b.posted).saturating_sub(load(&b.completed).saturating_add(load(&b.failed)))
            })
            .sum()
    }

    /// Copy every figure (any thread; allocates the snapshot's vectors).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let names = *self.names.lock().unwrap_or_else(|e| e.into_inner());
        let backends = names
            .iter()
            .enumerate()
            .filter_map(|(slot, name)| {
                let b = &self.backends[slot];
                Some(BackendMetrics {
                    name: (*name)?,
                    posted: load(&b.posted),
                    bytes: load(&b.bytes),
                    descriptors: load(&b.descriptors),
                    completed: load(&b.completed),
                    failed: load(&b.failed),
                    refused: load(&b.refused),
                    latency_sum: Duration::from_nanos(load(&b.latency_sum_ns)),
                    latency: std::array::from_fn(|i| load(&b.latency[i])),
                })
            })
            .collect();
        MetricsSnapshot {
            backends,
            errors: ERROR_KINDS
                .iter()
                .zip(&self.errors)
                .map(|(k, n)| (*k, load(n)))
                .collect(),
            flushes: load(&self.flushes),
            peers: load(&self.peers),
            fetches: load(&self.fetches),
            fetch_failures: load(&self.fetch_failures),
            loads: load(&self.loads),
            load_failures: load(&self.load_failures),
            invalidations: load(&self.invalidations),
            send_failures: load(&self.send_failures),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_storage::Subject;

    #[test]
    fn latencies_land_in_power_of_two_buckets_and_quantiles_read_them() {
        let m = Metrics::default();
        m.set_backend(1, "X");
        for micros in [0u64, 1, 3, 900, 1500, 70_000_000_000] {
            m.completed(1, Some(Duration::from_micros(micros)), None);
        }
        let s = m.snapshot();
        let b = s.backend("X").unwrap();
        assert_eq!(b.completed, 6);
        assert_eq!(b.latency[0], 1, "0 µs");
        assert_eq!(b.latency[1], 1, "1 µs is under 2");
        assert_eq!(b.latency[2], 1, "3 µs is under 4");
        assert_eq!(b.latency[10], 1, "900 µs is under 1024");
        assert_eq!(b.latency[11], 1, "1500 µs is under 2048");
        assert_eq!(b.latency[LATENCY_BUCKETS - 1], 1, "overflow bucket");
        assert_eq!(b.latency_count(), 6);
        assert_eq!(b.latency_quantile(0.5), Some(Duration::from_micros(4)));
        assert_eq!(s.backends.len(), 1, "unnamed slots are left out");
    }

    #[test]
    fn errors_are_counted_by_kind() {
        let m = Metrics::default();
        m.set_backend(0, "Y");
        let gone = Error::RemoteDisconnect {
            subject: Subject::Named("p".into()),
        };
        m.completed(0, None, Some(&gone));
        m.post_refused(0, &Error::invalid(Subject::Named("d".into()), "bad"));
        let s = m.snapshot();
        assert_eq!(s.errors_of("REMOTE_DISCONNECT"), 1);
        assert_eq!(s.errors_of("INVALID_PARAM"), 1);
        assert_eq!(s.backend("Y").unwrap().failed, 1);
        assert_eq!(s.backend("Y").unwrap().refused, 1);
        assert_eq!(s.backend("Y").unwrap().latency_count(), 0);
    }
}
