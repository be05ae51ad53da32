//! PyTorch's c10d TCPStore protocol: Ferry's client ([`TcpStoreClient`]) and Ferry's own
//! server ([`serve`]). The metadata store built on the client is `stores/tcpstore/`.

mod client;
pub mod proto;
mod server;

pub use client::{user_key, ClientOptions, TcpStoreClient};
pub use server::{serve, ServerConfig, ServerHandle};
