//! Helpers shared by the UCX backend tests: UCX detection, an "agent" made of one
//! backend plus its buffers, a `PeerRegions` built by hand, and bounded waiting.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use ferry_backend_api::{
    Backend, BackendFactory, BackendInit, Completion, Completions, Desc, Endpoint, MemKind,
    NotifSink, Params, PeerId, PeerRegions, RegionSpec, RemoteAgent,
};
use ferry_ucx::{UcxBackend, UcxFactory};

/// Environment every UCX test runs under (set once, before any backend exists).
pub fn setup() -> bool {
    static ENV: Once = Once::new();
    ENV.call_once(|| {
        // Loopback only; detect dead peers quickly.
        std::env::set_var("UCX_NET_DEVICES", "lo");
        std::env::set_var("UCX_KEEPALIVE_INTERVAL", "500ms");
        std::env::set_var("UCX_WARN_UNUSED_ENV_VARS", "n");
    });
    match UcxFactory.available() {
        Ok(()) => true,
        Err(reason) => {
            ferry_testkit::ci::skip(
                "UCX",
                format!("libucp.so.0 not usable ({reason}); apt-get install libucx0"),
            );
            false
        }
    }
}

/// Transport variants every data test runs under.
pub const TRANSPORTS: &[&str] = &["", "tcp"];

// Not every test binary uses it (`drop.rs` does not).
#[allow(unused_imports)]
pub use ferry_testkit::Rng;

mod pair;
// Not every test binary uses the pair.
#[allow(unused_imports)]
pub use pair::*;

/// A peer's regions as the engine would hand them over.
#[derive(Default, Clone)]
pub struct HandRegions {
    pub name: String,
    pub md: HashMap<u64, Vec<u8>>,
    /// Where each region lies, for the regions listed to a backend at load (those
    /// without an entry are not listed: the backend meets them on first use).
    pub descs: HashMap<u64, Desc>,
}

impl PeerRegions for HandRegions {
    fn agent_name(&self) -> &str {
        &self.name
    }
    fn public_md(&self, token: u64) -> Option<&[u8]> {
        self.md.get(&token).map(Vec::as_slice)
    }
    fn for_each_region(&self, backend: &str, visit: &mut dyn FnMut(u64, Desc, &[u8])) {
        if backend != "UCX" {
            return;
        }
        for (token, desc) in &self.descs {
            if let Some(md) = self.md.get(token) {
                visit(*token, *desc, md);
            }
        }
    }
}

/// Collected notifications.
#[derive(Default)]
pub struct Inbox(pub Vec<(String, Vec<u8>)>);

impl NotifSink for Inbox {
    fn deliver(&mut self, from: &str, payload: &[u8]) {
        self.0.push((from.to_string(), payload.to_vec()));
    }
}

/// A heap buffer to register (its address is stable: it is never resized).
pub struct Buffer(pub Vec<u8>);

impl Buffer {
    pub fn new(len: usize) -> Buffer {
        Buffer(vec![0u8; len])
    }
    pub fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

pub fn params(pairs: &[(&str, &str)]) -> Params {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn backend(name: &str, transports: &str, extra: &[(&str, &str)]) -> UcxBackend {
    let mut p = params(extra);
    // Another UCX build for every backend of the tests (e.g. the one in NIXL's wheel).
    if let Ok(library) = std::env::var("FERRY_UCX_LIBRARY") {
        p.entry("ucx_library".into()).or_insert(library);
    }
    if !transports.is_empty() {
        p.insert("transports".into(), transports.into());
    }
    UcxBackend::new(&BackendInit {
        agent_name: name,
        params: &p,
    })
    .unwrap_or_else(|e| panic!("creating UCX backend '{name}' ({transports}): {e}"))
}

/// Register `buffer` with `backend`: (token, packed rkey).
pub fn register(backend: &mut UcxBackend, buffer: &Buffer) -> (u64, Vec<u8>) {
    let r = backend
        .register_t(&RegionSpec {
            kind: MemKind::Dram,
            desc: Desc::new(buffer.addr(), buffer.len() as u64, 0),
            path: None,
        })
        .expect("register");
    (r.token, r.public_md)
}

/// Make `peer` (named `name`, with `conn_info` and one region) known to `backend`.
pub fn load(
    backend: &mut UcxBackend,
    peer: PeerId,
    name: &str,
    conn_info: &[u8],
    regions: &[(u64, Vec<u8>)],
) {
    let regions = HandRegions {
        name: name.to_string(),
        md: regions.iter().cloned().collect(),
        ..HandRegions::default()
    };
    backend
        .load_remote(
            peer,
            RemoteAgent {
                name,
                conn_info,
                regions: Arc::new(regions),
                standby: false,
                ready_ranges: 0,
            },
        )
        .expect("load_remote");
}

/// The `n`-th peer id (as the engine's slotmap would hand out).
pub fn peer_id(n: u32) -> PeerId {
    // Version 1 (occupied) in the high half, slot index in the low half.
    ferry_storage::handle_from_tag((1u64 << 32) | u64::from(n + 1))
}

/// Progress every backend until all `tags` completed or `timeout` passed.
pub fn wait_for(
    backends: &mut [&mut UcxBackend],
    tags: &[u64],
    timeout: Duration,
) -> Vec<Completion> {
    let deadline = Instant::now() + timeout;
    let mut done = Completions::with_capacity(tags.len().max(16));
    let mut got: Vec<Completion> = Vec::new();
    while got.len() < tags.len() {
        for b in backends.iter_mut() {
            b.progress(&mut done);
        }
        got.extend(done.as_slice().iter().filter(|c| tags.contains(&c.tag)));
        done.clear();
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: {} of {} requests completed",
            got.len(),
            tags.len()
        );
        std::thread::yield_now();
    }
    got
}

/// Progress backends until `backends[receiver]` delivered `count` notifications into
/// `inbox` (or time out). Returns the completions seen meanwhile.
pub fn wait_notifs(
    backends: &mut [&mut UcxBackend],
    receiver: usize,
    inbox: &mut Inbox,
    count: usize,
    timeout: Duration,
) -> Vec<Completion> {
    let deadline = Instant::now() + timeout;
    let mut done = Completions::with_capacity(64);
    let mut seen = Vec::new();
    while inbox.0.len() < count {
        for b in backends.iter_mut() {
            b.progress(&mut done);
        }
        seen.extend_from_slice(done.as_slice());
        done.clear();
        backends[receiver].drain_notifications(inbox);
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {count} notifications (have {})",
            inbox.0.len()
        );
        std::thread::yield_now();
    }
    seen
}

pub fn local() -> Endpoint {
    Endpoint::Local
}

/// The backend's unsafe calls for tests, under the test kit's promise.
pub use ferry_testkit::backend::TestCalls;
