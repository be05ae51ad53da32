//! The agent's metrics: counters and histograms recorded by the executor (requests,
//! bytes, descriptors, errors by kind, post→complete latency per backend) and by the
//! exchange wiring (fetches, loads, failures, invalidations), plus the peers known.
//!
//! Read them from Rust with [`Agent::metrics`] (a snapshot, from any thread, also while
//! another thread flushes) or export them for Prometheus with the `prometheus` feature
//! ([`crate::prometheus`], `FERRY_METRICS_LISTEN`). Recording allocates nothing and
//! costs a few plain stores per request (see `ferry_schedules::metrics`; measured by
//! `benches/benches/metrics.rs`).

use std::sync::Arc;

pub use ferry_schedules::metrics::{
    bucket_upper, BackendMetrics, ExchangeEvent, Metrics, MetricsSnapshot, ERROR_KINDS,
    LATENCY_BUCKETS,
};

use crate::Agent;

impl Agent {
    /// A snapshot of this agent's metrics (allocates the snapshot; never blocks on a
    /// flush, works on a poisoned agent too).
    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics_handle().snapshot()
    }

    /// How long request `xfer` is expected to take (NIXL's `estimateXferCost`): the
    /// backend's own model where it has one (UCX: `ucp_ep_evaluate_perf`,
    /// [`CostMethod::Analytical`](crate::CostMethod)), else a fit of the durations this
    /// agent measured for that backend's completed requests against their bytes
    /// ([`CostMethod::Measured`](crate::CostMethod), with the fit's spread as margin).
    /// [`Error::NoTelemetry`](crate::Error) until the backend completed a request (or
    /// with telemetry off).
    pub fn estimate(&self, xfer: crate::XferId) -> crate::Result<crate::CostEstimate> {
        self.lock()?.world.estimate(xfer)
    }

    /// The live metrics of this agent, shared (for an exporter of one's own).
    pub fn metrics_handle(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// Tracy, after each flush: a secondary frame mark `ferry::flush` and the plot of
/// requests in flight (all agents of the process plot into it).
#[cfg(feature = "tracy")]
pub(crate) fn trace_flush(metrics: &Metrics) {
    use std::sync::OnceLock;
    static FRAME: OnceLock<tracy_client::FrameName> = OnceLock::new();
    static IN_FLIGHT: OnceLock<tracy_client::PlotName> = OnceLock::new();
    if let Some(client) = tracy_client::Client::running() {
        let frame = *FRAME.get_or_init(|| tracy_client::FrameName::new_leak("ferry::flush".into()));
        client.secondary_frame_mark(frame);
        let plot = *IN_FLIGHT
            .get_or_init(|| tracy_client::PlotName::new_leak("ferry in-flight requests".into()));
        client.plot(plot, metrics.in_flight() as f64);
    }
}
