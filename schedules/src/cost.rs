//! The measured cost model of one backend: a least-squares fit of request duration
//! against request bytes, `duration ≈ fixed + bytes × per_byte`, over the requests that
//! completed successfully with telemetry, older ones weighted down (each new sample
//! multiplies the old sums by [`DECAY`], so the model follows a changing machine: ~200
//! requests carry most of the weight). Pure arithmetic on six numbers: recording is a
//! dozen floating-point operations, no allocation.
//!
//! One line cannot follow a transport whose rate changes with the size (a copy that
//! leaves the cache, a protocol switch at a threshold), so [`SizeClasses`] also keeps,
//! per operation and power-of-two size class, the last [`CLASS_SAMPLES`] durations; a
//! class with at least [`CLASS_SAMPLES_MIN`] of them predicts their median (robust to a
//! preempted request), scaled to the request's bytes within the class, with the spread
//! of the samples as the margin. `World::estimate` asks the classes first, then the
//! backend's own model (UCX's), then the line: a transport's model is calibrated by
//! what this agent measured as soon as it measured that kind of request.

use std::time::Duration;

use ferry_storage::Op;

/// Durations kept per size class.
pub const CLASS_SAMPLES: usize = 8;
/// Samples a size class needs before it predicts.
pub const CLASS_SAMPLES_MIN: u32 = 3;
/// Power-of-two size classes: requests of 2^k ..= 2^(k+1) - 1 bytes (the last one
/// takes everything larger; class 0 also takes empty requests).
const CLASSES: usize = 41;

/// Recent durations of one operation and size class.
#[derive(Clone, Copy, Debug, Default)]
struct Class {
    /// Seconds, a ring of the last [`CLASS_SAMPLES`].
    seconds: [f32; CLASS_SAMPLES],
    /// Bytes of the same requests.
    bytes: [f32; CLASS_SAMPLES],
    /// Samples recorded (the ring's next slot is `count % CLASS_SAMPLES`).
    count: u32,
}

/// Per-(operation, size class) recent durations of one backend (see the module docs).
/// [`SizeClasses::new`] allocates its table (~2.6 KiB) once, when the backend is added;
/// the empty `Default` (a slot without a backend) records nothing.
#[derive(Clone, Debug, Default)]
pub struct SizeClasses {
    classes: Option<Box<[[Class; CLASSES]; 2]>>,
}

fn class_of(bytes: u64) -> usize {
    (63 - bytes.max(1).leading_zeros() as usize).min(CLASSES - 1)
}

fn op_index(op: Op) -> usize {
    match op {
        Op::Read => 0,
        Op::Write => 1,
    }
}

impl SizeClasses {
    /// An empty table, allocated.
    pub fn new() -> SizeClasses {
        SizeClasses {
            classes: Some(Box::new([[Class::default(); CLASSES]; 2])),
        }
    }

    /// Add a completed request (nothing on an unallocated `Default`). Never allocates.
    #[inline]
    pub fn record(&mut self, op: Op, bytes: u64, duration: Duration) {
        let Some(classes) = self.classes.as_mut() else {
            return;
        };
        let c = &mut classes[op_index(op)][class_of(bytes)];
        let at = c.count as usize % CLASS_SAMPLES;
        c.seconds[at] = duration.as_secs_f32();
        c.bytes[at] = bytes as f32;
        c.count = c.count.saturating_add(1);
    }

    /// The prediction for a request of `op` and `bytes`, and how many samples it rests
    /// on; `None` while its class has fewer than [`CLASS_SAMPLES_MIN`].
    pub fn predict(&self, op: Op, bytes: u64) -> Option<(Prediction, u32)> {
        let c = &self.classes.as_ref()?[op_index(op)][class_of(bytes)];
        if c.count < CLASS_SAMPLES_MIN {
            return None;
        }
        let n = (c.count as usize).min(CLASS_SAMPLES);
        // Seconds per byte of each sample (bytes ≥ 1 for the ratio), sorted: the
        // median, and the spread between the quartiles as the margin.
        let mut rate = [0f64; CLASS_SAMPLES];
        let mut plain = [0f64; CLASS_SAMPLES];
        for i in 0..n {
            rate[i] = f64::from(c.seconds[i]) / f64::from(c.bytes[i]).max(1.0);
            plain[i] = f64::from(c.seconds[i]);
        }
        let median = |v: &mut [f64]| {
            v.sort_unstable_by(f64::total_cmp);
            (v[v.len() / 2], v[v.len() * 3 / 4] - v[v.len() / 4])
        };
        // Small requests cost about the same whatever their exact size; large ones
        // scale with it. Within a class the two differ by at most 2x: take the rate
        // above 64 KiB, the plain duration below.
        let (y, spread) = if bytes >= 64 << 10 {
            let (r, s) = median(&mut rate[..n]);
            (r * bytes as f64, s * bytes as f64)
        } else {
            median(&mut plain[..n])
        };
        Some((
            Prediction {
                duration: secs(y),
                margin: secs(spread),
            },
            n as u32,
        ))
    }
}

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
    fn size_classes_follow_a_rate_that_changes_with_the_size_and_ignore_an_outlier() {
        let mut c = SizeClasses::new();
        assert_eq!(c.predict(Op::Read, 4096), None);
        // 1 MiB at 10 GB/s, 16 MiB at 2.5 GB/s (out of the cache): no line fits both.
        for i in 0..8u64 {
            c.record(Op::Read, 1 << 20, Duration::from_nanos(104_858));
            c.record(Op::Read, 16 << 20, Duration::from_nanos(6_710_886));
            // One preempted 4 KiB request among fast ones.
            let slow = if i == 3 { 5_000_000 } else { 3_000 };
            c.record(Op::Read, 4096, Duration::from_nanos(slow));
        }
        let (p, n) = c.predict(Op::Read, 1 << 20).unwrap();
        assert_eq!(n, CLASS_SAMPLES as u32);
        assert!(
            (p.duration.as_secs_f64() - 104.858e-6).abs() < 1e-6,
            "{p:?}"
        );
        let (p, _) = c.predict(Op::Read, 16 << 20).unwrap();
        assert!((p.duration.as_secs_f64() - 6.71e-3).abs() < 1e-4, "{p:?}");
        let (p, _) = c.predict(Op::Read, 4096).unwrap();
        assert!((p.duration.as_secs_f64() - 3e-6).abs() < 1e-7, "{p:?}");
        // Another op, or a class never seen: nothing to say.
        assert_eq!(c.predict(Op::Write, 1 << 20), None);
        assert_eq!(c.predict(Op::Read, 64 << 20), None);
        // Two samples are not enough.
        c.record(Op::Write, 100, Duration::from_micros(2));
        c.record(Op::Write, 100, Duration::from_micros(2));
        assert_eq!(c.predict(Op::Write, 100), None);
        c.record(Op::Write, 100, Duration::from_micros(2));
        assert!(c.predict(Op::Write, 100).is_some());
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
