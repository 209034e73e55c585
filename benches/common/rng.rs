//! A small deterministic generator (SplitMix64): inputs are the same on every run.

use mla_decode::Element;

/// SplitMix64.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// `n` values uniform in [-1, 1), 16 random bits each, rounded to `T`.
    pub fn values<T: Element>(&mut self, n: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let bits = self.next_u64();
            for i in 0..4.min(n - out.len()) {
                let u = ((bits >> (16 * i)) & 0xffff) as f64;
                out.push(T::from_f64(u / 32768.0 - 1.0));
            }
        }
        out
    }

    /// Fisher-Yates.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }

    /// `k` distinct entries of `pool`, uniformly (a partial Fisher-Yates that leaves `pool`
    /// permuted, which keeps every later draw uniform too).
    pub fn distinct<'p>(&mut self, pool: &'p mut [i32], k: usize) -> &'p [i32] {
        let n = pool.len();
        assert!(k <= n, "cannot draw {k} distinct values from {n}");
        for i in 0..k {
            let j = i + self.below(n - i);
            pool.swap(i, j);
        }
        &pool[..k]
    }
}
