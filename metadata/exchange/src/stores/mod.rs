//! The metadata stores, one folder each, and their registration: [`start`] is the one
//! place that maps a [`StoreConfig`] to a store. Each store follows the contract in
//! `contract.rs`; README, "Adding a store", lists the steps.
//!
//! | store | folder | liveness bound (crashed owner → `Invalidate` at watchers) |
//! |---|---|---|
//! | etcd (feature `etcd`) | `etcd/` | the lease TTL after the owner's last keep-alive (10 s) |
//! | TCPStore | `tcpstore/` | 4 × watch interval + I/O timeout after its last heartbeat (9 s) |
//! | in-process | `in_process/` | none: the owner's manager withdraws when it is dropped |

pub(crate) mod etcd;
pub(crate) mod in_process;
pub(crate) mod tcpstore;

use std::sync::Arc;

use ferry_storage::Error;

use crate::config::{ExchangeConfig, StoreConfig};
use crate::contract::{Shared, StoreWorker};
use crate::tcpstore::ServerHandle;

/// Start the store that the configuration names, if any.
pub(crate) fn start(shared: &Arc<Shared>) -> Result<Option<StoreWorker>, Error> {
    let worker = match &shared.config.store {
        StoreConfig::None => return Ok(None),
        StoreConfig::TcpStore(config) => tcpstore::start(shared.clone(), config)?,
        StoreConfig::Etcd(config) => etcd::start(shared.clone(), config)?,
        StoreConfig::InProcess(config) => in_process::start(shared.clone(), config)?,
    };
    Ok(Some(worker))
}

/// Start the embedded TCPStore server, if the configuration asks for one; with no
/// store configured, the agent then uses it as its TCPStore.
pub(crate) fn start_embedded(config: &mut ExchangeConfig) -> Result<Option<ServerHandle>, Error> {
    let Some(addr) = config.embedded_store else {
        return Ok(None);
    };
    let server = crate::tcpstore::serve(addr, config.embedded_store_limits.clone())?;
    if matches!(config.store, StoreConfig::None) {
        let mut own = crate::config::TcpStoreConfig::new(server.local_addr().to_string());
        own.tls = config.embedded_store_limits.tls.clone();
        config.store = StoreConfig::TcpStore(own);
    }
    Ok(Some(server))
}
