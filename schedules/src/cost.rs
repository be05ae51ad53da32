//! The measured cost model of one backend: a least-squares fit of request duration
//! against request bytes, `duration ≈ fixed + bytes × per_byte`, over the requests that
//! completed successfully with telemetry, older ones weighted down (each new sample
//! multiplies the old sums by [`DECAY`], so the model follows a changing machine: ~200
//! requests carry most of the weight). Pure arithmetic on six numbers: recording is a
//! dozen floating-point operations, no allocation.

use std::time::Duration;

/// Weight each earlier sample keeps when a new one arrives.
pub const DECAY: f64 = 0.995;

/// Weighted sums of (bytes, seconds) samples.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostModel {
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    syy: f64,
    samples: u64,
}

/// What the model predicts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// Expected duration.
    pub duration: Duration,
    /// One standard deviation of the residuals.
    pub margin: Duration,
}

impl CostModel {
    /// Add a completed request of `bytes` that took `duration`.
    #[inline]
    pub fn record(&mut self, bytes: u64, duration: Duration) {
        let (x, y) = (bytes as f64, duration.as_secs_f64());
        self.n = self.n * DECAY + 1.0;
        self.sx = self.sx * DECAY + x;
        self.sy = self.sy * DECAY + y;
        self.sxx = self.sxx * DECAY + x * x;
        self.sxy = self.sxy * DECAY + x * y;
        self.syy = self.syy * DECAY + y * y;
        self.samples += 1;
    }

    /// Requests recorded so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// (fixed seconds, seconds per byte). With a single request size seen, the fixed part
    /// is zero and the duration scales with the bytes (the best a single size tells).
    fn fit(&self) -> Option<(f64, f64)> {
        if self.samples == 0 || self.n <= 0.0 {
            return None;
        }
        let var_x = self.n * self.sxx - self.sx * self.sx;
        if var_x <= 1e-9 * self.n * self.sxx.max(1.0) {
            let per_byte = if self.sx > 0.0 {
                self.sy / self.sx
            } else {
                0.0
            };
            let fixed = if self.sx > 0.0 { 0.0 } else { self.sy / self.n };
            return Some((fixed, per_byte));
        }
        let per_byte = ((self.n * self.sxy - self.sx * self.sy) / var_x).max(0.0);
        let fixed = ((self.sy - per_byte * self.sx) / self.n).max(0.0);
        Some((fixed, per_byte))
    }

    /// The predicted duration of a request of `bytes`, `None` before any sample.
    pub fn predict(&self, bytes: u64) -> Option<Prediction> {
        let (fixed, per_byte) = self.fit()?;
        let y = fixed + per_byte * bytes as f64;
        // Residual variance: Σ(y - a - b x)² / n, expanded over the sums.
        let (a, b) = (fixed, per_byte);
        let sse = self.syy - 2.0 * a * self.sy - 2.0 * b * self.sxy
            + a * a * self.n
            + 2.0 * a * b * self.sx
            + b * b * self.sxx;
        let sd = (sse.max(0.0) / self.n).sqrt();
        Some(Prediction {
            duration: secs(y),
            margin: secs(sd),
        })
    }
}

fn secs(s: f64) -> Duration {
    if s.is_finite() && s > 0.0 {
        Duration::from_secs_f64(s.min(1e9))
    } else {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_linear_cost_is_recovered() {
        let mut m = CostModel::default();
        assert_eq!(m.predict(10), None);
        // 5 µs + 1 ns per byte.
        for bytes in [1_000u64, 10_000, 100_000, 1_000_000]
            .iter()
            .cycle()
            .take(40)
        {
            m.record(*bytes, Duration::from_nanos(5_000 + bytes));
        }
        let p = m.predict(500_000).unwrap();
        let want = 5_000.0 + 500_000.0;
        let got = p.duration.as_nanos() as f64;
        assert!((got - want).abs() < want * 1e-6, "{p:?}");
        assert!(p.margin < Duration::from_nanos(10), "{p:?}");
    }

    #[test]
    fn one_size_scales_with_bytes_and_noise_shows_in_the_margin() {
        let mut m = CostModel::default();
        for i in 0..100u64 {
            m.record(4096, Duration::from_micros(10 + (i % 2) * 2));
        }
        let p = m.predict(8192).unwrap();
        assert!((p.duration.as_secs_f64() - 22e-6).abs() < 1e-6, "{p:?}");
        assert!(p.margin > Duration::ZERO, "{p:?}");
        // Zero-byte requests only: a fixed cost.
        let mut z = CostModel::default();
        z.record(0, Duration::from_micros(3));
        assert_eq!(z.predict(0).unwrap().duration, Duration::from_micros(3));
    }
}
