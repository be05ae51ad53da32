//! PyTorch's c10d TCPStore protocol: Ferry's client ([`TcpStoreClient`]), Ferry's own
//! server ([`serve`]), and the metadata backend built on the client.

pub(crate) mod backend;
mod client;
pub(crate) mod direct;
pub mod proto;
mod server;

pub use client::{user_key, ClientOptions, TcpStoreClient};
pub use server::{serve, ServerConfig, ServerHandle};
