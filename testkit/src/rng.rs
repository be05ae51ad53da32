//! A small deterministic generator: tests and benches need reproducible data, not
//! secure randomness.

/// xorshift64 seeded through a multiply, so that nearby seeds give unrelated streams.
/// The same seed gives the same sequence on every machine and run.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (seed 0 is remapped; every seed gives a nonzero state).
    pub fn new(seed: u64) -> Rng {
        // The multiplier is odd, so a nonzero seed never maps to the all-zero state
        // xorshift cannot leave.
        Rng(seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A number in `[0, n)` (0 when `n` is 0). The modulo bias is irrelevant for tests.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A number in `[0, n)` as a `usize` (0 when `n` is 0).
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// True with probability `1 / n` (always when `n` is 0 or 1).
    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    /// Shuffle a slice in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }

    /// Fill `bytes` with random bytes, eight per step.
    pub fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let word = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_zero_seed_is_usable() {
        let a: Vec<u64> = (0..8)
            .scan(Rng::new(42), |r, _| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..8)
            .scan(Rng::new(42), |r, _| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        let mut zero = Rng::new(0);
        assert_ne!(zero.next_u64(), 0);
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
    }

    #[test]
    fn below_stays_in_range_and_fill_covers_odd_lengths() {
        let mut rng = Rng::new(7);
        assert!((0..1000).all(|_| rng.below(10) < 10));
        assert_eq!(rng.below(0), 0);
        let mut bytes = [0u8; 13];
        rng.fill(&mut bytes);
        assert!(bytes.iter().any(|&b| b != 0));
        let mut items: Vec<u32> = (0..50).collect();
        rng.shuffle(&mut items);
        let mut sorted = items.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_ne!(items, sorted);
    }
}
