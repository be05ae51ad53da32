//! The backend's own cost estimate: UCX's performance model (`ucp_ep_evaluate_perf`,
//! looked up when the library is loaded; Debian's 1.13 has it). Each merged range is issued as
//! puts/gets of at most `chunk_bytes`; the estimate adds UCX's estimate of every piece,
//! as if they went one after another (pipelining on the wire makes the real request
//! shorter, never longer, for the model UCX has of its lanes). Without the function the
//! backend has no estimate and the engine falls back to what it measured.

use std::time::Duration;

use ferry_backend_api::{CostEstimate, CostMethod, Range};

use super::*;

impl Core {
    pub(crate) fn estimate(
        &mut self,
        endpoint: Endpoint,
        ranges: &[Range],
    ) -> Option<CostEstimate> {
        let evaluate = self.ucp.evaluate_perf()?;
        let ep = match endpoint {
            Endpoint::Local => self.local_ep().ok()?,
            Endpoint::Peer(peer) => self.peer_ep(peer).ok()?.0,
        };
        let time_of = |bytes: u64| -> Option<f64> {
            let param = ucp_ep_evaluate_perf_param_t {
                field_mask: UCP_EP_PERF_PARAM_FIELD_MESSAGE_SIZE,
                message_size: bytes as usize,
            };
            let mut attr = ucp_ep_evaluate_perf_attr_t {
                field_mask: UCP_EP_PERF_ATTR_FIELD_ESTIMATED_TIME,
                estimated_time: 0.0,
            };
            // SAFETY: ep is live; both structs are valid for the call, with only the
            // fields their masks name.
            let status = unsafe { evaluate(ep, &param, &mut attr) };
            (status.is_ok() && attr.estimated_time.is_finite()).then_some(attr.estimated_time)
        };
        let chunk = self.chunk_bytes.max(1);
        let full = time_of(chunk)?;
        let mut seconds = 0.0;
        for range in ranges {
            let (pieces, rest) = (range.len / chunk, range.len % chunk);
            seconds += pieces as f64 * full;
            if rest > 0 {
                seconds += time_of(rest)?;
            }
        }
        Some(CostEstimate {
            duration: Duration::from_secs_f64(seconds.clamp(0.0, 1e9)),
            margin: Duration::ZERO,
            method: CostMethod::Analytical,
        })
    }

    /// Whether the loaded UCX has a performance model to ask.
    pub(crate) fn has_perf_model(&self) -> bool {
        self.ucp.evaluate_perf().is_some()
    }
}
