//! `--metrics-listen ADDR` of the commands that create agents (demo, bench *, md
//! fetch): serve Ferry's Prometheus endpoint (`ferry::prometheus::serve`, `GET
//! /metrics`) while the command runs; and the compact JSON form of an agent's metrics
//! that `bench xfer --json` embeds.

use std::net::SocketAddr;

use clap::Args;
use ferry::metrics::MetricsSnapshot;
use ferry::prometheus::MetricsServer;
use serde_json::json;

/// The `--metrics-listen` flag.
#[derive(Args, Debug, Clone, Default)]
pub struct MetricsArgs {
    /// Serve the agents' metrics for Prometheus (`GET /metrics`) on PORT (127.0.0.1)
    /// or HOST:PORT while the command runs; port 0 picks a free one (the address is
    /// printed on stderr). FERRY_METRICS_LISTEN does the same for any program.
    #[arg(long, value_name = "[HOST:]PORT", value_parser = listen)]
    pub metrics_listen: Option<SocketAddr>,
}

impl MetricsArgs {
    /// Start the endpoint if asked for; it serves until the returned value drops.
    pub fn start(&self) -> Result<Option<MetricsServer>, String> {
        let Some(addr) = self.metrics_listen else {
            return Ok(None);
        };
        let server =
            ferry::prometheus::serve(addr).map_err(|e| format!("--metrics-listen {addr}: {e}"))?;
        eprintln!("ferry: metrics on http://{}/metrics", server.local_addr());
        Ok(Some(server))
    }
}

/// `PORT` (on 127.0.0.1) or `HOST:PORT`.
fn listen(text: &str) -> Result<SocketAddr, String> {
    match ferry::prometheus::parse_listen(text) {
        Ok(Some(addr)) => Ok(addr),
        Ok(None) => Err("expected PORT or HOST:PORT (leave the flag out for no endpoint)".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// An agent's metrics as a small JSON object: counters per backend (with the latency
/// count, sum and the p50/p99 bucket bounds instead of the histogram), errors by kind
/// (non-zero only), flushes, peers and the exchange counters.
pub fn compact(m: &MetricsSnapshot) -> serde_json::Value {
    let backends: Vec<_> = m
        .backends
        .iter()
        .map(|b| {
            let q = |q: f64| b.latency_quantile(q).map(|d| d.as_micros() as u64);
            json!({
                "name": b.name,
                "posted": b.posted,
                "bytes": b.bytes,
                "descriptors": b.descriptors,
                "completed": b.completed,
                "failed": b.failed,
                "refused": b.refused,
                "latency_count": b.latency_count(),
                "latency_sum_us": b.latency_sum.as_secs_f64() * 1e6,
                "latency_p50_le_us": q(0.5),
                "latency_p99_le_us": q(0.99),
            })
        })
        .collect();
    let errors: serde_json::Map<String, serde_json::Value> = m
        .errors
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| ((*k).to_string(), json!(n)))
        .collect();
    json!({
        "backends": backends,
        "errors": errors,
        "flushes": m.flushes,
        "peers": m.peers,
        "exchange": {
            "fetches": m.fetches,
            "fetch_failures": m.fetch_failures,
            "loads": m.loads,
            "load_failures": m.load_failures,
            "invalidations": m.invalidations,
            "send_failures": m.send_failures,
        },
    })
}
