//! Ferry's metadata exchange: how agents find each other's metadata.
//!
//! The agent owns a [`Manager`]. Each call is routed by its [`Via`]: a peer address
//! selects P2P (a direct socket to the peer's listener); [`Via::Store`] selects the
//! configured store (etcd or TCPStore); neither gives a clear error.
//!
//! # The narrow interface to the agent
//! Workers never touch agent state. The agent gives the manager snapshots of its
//! serialized metadata ([`Manager::set_local_md`], [`Manager::send_local_partial_md`]),
//! which the workers use to publish and to answer "send me yours". Everything that
//! comes back (metadata to load, invalidations of a peer, failures) lands in a bounded
//! queue of [`Event`]s that the agent drains with [`Manager::poll`] on its own thread,
//! calling its normal load path. Metadata bytes are opaque to this crate.
//!
//! # Threads
//! Each backend owns its own worker threads (no backend waits behind another); every
//! blocking network operation has a timeout; no caller-facing method waits on the
//! network (commands go through bounded queues; a full queue is an error).
//! [`Manager::workers_running`] is the one answer to "does any worker thread exist".
//!
//! # Components
//! - [`p2p`]: the listener and the framed protocol: a hello naming each side (a mutual
//!   challenge–response with a shared secret), frames bound to that name, heads
//!   authenticated before payloads are read. Trust model: `README.md`.
//! - [`tcpstore`]: a client of PyTorch's c10d TCPStore protocol and Ferry's own server.
//! - The stores (`stores/`, one folder each: etcd behind the cargo feature `etcd`,
//!   TCPStore, in-process), all following one contract (`contract.rs`: what a store
//!   receives, emits and guarantees); `stores/mod.rs` is their one registration.
//!
//! Configuration and its environment variables: [`config`] (each part's settings live
//! in its folder: `p2p/config.rs`, `stores/*/config.rs`).

pub mod config;
mod conn_server;
mod contract;
mod events;
mod local;
mod manager;
pub mod p2p;
mod parse;
mod stores;
mod stream;
pub mod tcpstore;
#[cfg(feature = "tls")]
mod tls;
mod util;

pub use config::{
    EtcdConfig, EtcdTls, EtcdUser, ExchangeConfig, InProcessConfig, P2pConfig, StoreConfig,
    TcpStoreConfig,
};
pub use conn_server::ConnStats;
pub use events::{Event, Lost, Route, FULL_LABEL};
pub use local::{check_agent_name, check_label, NAME_LEN_MAX_BYTES};
pub use manager::{Manager, Via};
pub use stream::{Stream, TlsConfig, TlsContext};
