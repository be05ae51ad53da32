//! The etcd store: keys under a lease kept alive by the worker, get-then-watch fetches,
//! a watched key per fetched peer. The worker (`worker.rs`) needs the `etcd` cargo
//! feature; without it a configuration naming etcd is refused at start.
//!
//! Liveness bound: a crashed or partitioned owner's keys expire with its lease, at most
//! the lease TTL (`FERRY_ETCD_LEASE_TTL_S`, 10 s) after its last keep-alive; the watch
//! of each fetched peer turns the expiry into an `Invalidate` at once. A restarted owner
//! publishes under a new lease and is fetched again.

pub(crate) mod config;
#[cfg(feature = "etcd")]
mod worker;

use std::sync::Arc;

use ferry_storage::Error;

use config::EtcdConfig;

use crate::contract::{Shared, StoreWorker};

/// Start the etcd worker (contract: `contract.rs`).
#[cfg(feature = "etcd")]
pub(crate) fn start(shared: Arc<Shared>, config: &EtcdConfig) -> Result<StoreWorker, Error> {
    worker::start(shared, config)
}

/// Without the `etcd` feature: `NotSupported`.
#[cfg(not(feature = "etcd"))]
pub(crate) fn start(_shared: Arc<Shared>, _config: &EtcdConfig) -> Result<StoreWorker, Error> {
    Err(Error::NotSupported {
        backend: "exchange".into(),
        what:
            "the etcd metadata store: this build of ferry-exchange lacks its `etcd` cargo feature"
                .into(),
    })
}
