//! Helpers of the exchange tests: a fake agent that applies events the way the engine
//! does (load by name and label, drop on invalidation), and waiting with a deadline.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_exchange::{Event, ExchangeConfig, Manager, FULL_LABEL};
use ferry_storage::Error;

/// What a fake agent has learned from its events.
pub struct FakeAgent {
    pub manager: Manager,
    /// agent → label → blob.
    pub peers: HashMap<String, HashMap<String, Vec<u8>>>,
    pub invalidated: Vec<String>,
    pub fetch_failures: Vec<(String, String, Error)>,
    pub send_failures: Vec<(String, String, Error)>,
    /// Overflow events: (agent, lost).
    pub overflows: Vec<(Option<String>, ferry_exchange::Lost)>,
}

impl FakeAgent {
    pub fn new(name: &str, config: ExchangeConfig) -> FakeAgent {
        FakeAgent {
            manager: Manager::new(name, config).expect("manager starts"),
            peers: HashMap::new(),
            invalidated: Vec::new(),
            fetch_failures: Vec::new(),
            send_failures: Vec::new(),
            overflows: Vec::new(),
        }
    }

    /// Apply queued events, as the agent's flush would.
    pub fn pump(&mut self) {
        let mut events = Vec::new();
        self.manager.poll(|e| events.push(e));
        for event in events {
            match event {
                Event::Load {
                    agent, label, blob, ..
                } => {
                    self.peers.entry(agent).or_default().insert(label, blob);
                }
                Event::Invalidate { agent, .. } => {
                    self.peers.remove(&agent);
                    self.invalidated.push(agent);
                }
                Event::FetchFailed {
                    agent,
                    label,
                    error,
                } => self.fetch_failures.push((agent, label, error)),
                Event::SendFailed {
                    target,
                    what,
                    error,
                } => self.send_failures.push((target, what, error)),
                Event::Overflow { agent, lost, .. } => {
                    if lost.invalidation {
                        if let Some(a) = &agent {
                            self.peers.remove(a);
                        }
                    }
                    self.overflows.push((agent, lost));
                }
            }
        }
    }

    /// The blob loaded for `agent` under `label`.
    pub fn md(&self, agent: &str, label: &str) -> Option<&[u8]> {
        self.peers.get(agent)?.get(label).map(Vec::as_slice)
    }

    /// Pump until `done` holds or `timeout` passes; returns whether it held.
    pub fn pump_until(
        &mut self,
        timeout: Duration,
        mut done: impl FnMut(&FakeAgent) -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            self.pump();
            if done(self) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Pump until the full metadata of `agent` equals `blob`.
    pub fn wait_md(&mut self, agent: &str, label: &str, blob: &[u8], timeout: Duration) {
        let ok = self.pump_until(timeout, |a| a.md(agent, label) == Some(blob));
        assert!(
            ok,
            "{}: no metadata '{label}' of '{agent}' within {timeout:?}; fetch failures {:?}, send failures {:?}",
            self.manager.agent_name(),
            self.fetch_failures,
            self.send_failures
        );
    }

    /// Pump until a fetch of `agent` failed; returns its error.
    pub fn wait_fetch_failure(&mut self, agent: &str, timeout: Duration) -> Error {
        let ok = self.pump_until(timeout, |a| {
            a.fetch_failures.iter().any(|(n, _, _)| n == agent)
        });
        assert!(ok, "no fetch failure for '{agent}' within {timeout:?}");
        let i = self
            .fetch_failures
            .iter()
            .position(|(n, _, _)| n == agent)
            .unwrap();
        self.fetch_failures.remove(i).2
    }

    /// Pump until `agent` was invalidated.
    pub fn wait_invalidated(&mut self, agent: &str, timeout: Duration) {
        let ok = self.pump_until(timeout, |a| a.invalidated.iter().any(|n| n == agent));
        assert!(
            ok,
            "{}: '{agent}' not invalidated within {timeout:?}",
            self.manager.agent_name()
        );
    }
}

/// Fake metadata: `len_bytes` bytes that name the agent.
pub fn blob(agent: &str, len_bytes: usize) -> Arc<[u8]> {
    let mut v: Vec<u8> = format!("md-of-{agent}:").into_bytes();
    v.extend((0..len_bytes.saturating_sub(v.len())).map(|i| (i % 251) as u8));
    Arc::from(v)
}

pub const LONG: Duration = Duration::from_secs(10);

pub fn label_full() -> &'static str {
    FULL_LABEL
}
