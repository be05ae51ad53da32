//! The other UCX backends of this process, progressed by a backend's drop while it
//! waits for its own workers.
//!
//! Two agents of one process (tests, the `scaling` bench's UCX cases, a prefill and a
//! decode agent in one server) are often dropped one after the other from one thread. The first one's drop
//! flushes its workers (`Core::flush_workers`), and that flush waits for the other
//! agent's answers to its wireup — which nobody produces while the other agent's owner
//! is blocked in this drop and it has no progress thread. The flush then ran out its
//! [`super::DROP_FLUSH_WAIT`], and where a wireup reply was still pending UCX 1.13
//! aborted the process when the worker was destroyed ("got REP message"). While it
//! waits, a drop now also progresses the other live backends of the process that are
//! its peers (one of the two loaded a worker address of the other) and that no thread
//! is using at that moment (their lock is free): what the other agent's owner or
//! progress thread would have done. Backends unrelated to the one dropped are left
//! alone: nothing else in the process sees progress it did not ask for.

use std::sync::{Arc, Mutex, Weak};

use super::Core;

/// Every backend core made in this process and not yet released (weak: a registry
/// entry never keeps a backend alive).
static LIVE: Mutex<Vec<Weak<Mutex<Core>>>> = Mutex::new(Vec::new());

/// Enlist a new backend's core (and forget released ones).
pub(crate) fn enlist(core: &Arc<Mutex<Core>>) {
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(core));
}

/// Who a backend being dropped is: its own worker addresses and the worker addresses
/// of the peers it loaded (taken before its peers are torn down).
pub(super) struct Kin {
    own: Vec<Vec<u8>>,
    loaded: Vec<Vec<u8>>,
}

impl Core {
    /// This backend's [`Kin`].
    pub(super) fn kin(&self) -> Kin {
        Kin {
            own: self.workers.iter().map(|w| w.address.clone()).collect(),
            loaded: self
                .peers
                .values()
                .map(|p| p.remote_address.clone())
                .collect(),
        }
    }

    /// Whether this backend and the one `kin` describes are peers: one of the two
    /// loaded a worker address of the other.
    fn related(&self, kin: &Kin) -> bool {
        self.workers.iter().any(|w| kin.loaded.contains(&w.address))
            || self
                .peers
                .values()
                .any(|p| kin.own.contains(&p.remote_address))
    }
}

/// Pump every other live backend that is a peer of `kin`'s and whose lock is free now;
/// returns whether any of them progressed. The backend being dropped is not among
/// them (its last strong reference is gone, so its entry no longer upgrades), and none
/// is waited for: one in use by another thread is progressed by that thread.
pub(super) fn pump_peers(kin: &Kin) -> bool {
    let cores: Vec<Arc<Mutex<Core>>> = {
        let live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.iter().filter_map(Weak::upgrade).collect()
    };
    let mut any = false;
    for core in &cores {
        if let Ok(mut core) = core.try_lock() {
            if core.related(kin) {
                any |= core.pump();
            }
        }
    }
    // Should an owner have released its backend meanwhile, the last reference is
    // dropped here, and that backend's own drop runs on this thread (it is `Send`).
    drop(cores);
    any
}
