//! The one random generator of the tests and the bench (SplitMix64), the per-test seeds
//! and the proptest driver of the random-shape tests.
//!
//! The bench draws its inputs from a fixed seed, so they are the same on every run; the
//! tests draw a fresh seed per run ([`seed`], printed, `MLA_TEST_SEED` replays it) or take
//! it from a proptest case ([`run_cases`]).

use std::fmt::Debug;

use mla_decode::Element;
use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestRunner};

/// SplitMix64's finalizer: 64 well-mixed bits of `z` (also a stateless hash, e.g. for values
/// that must be made again from a key).
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in [0, 1).
    pub fn f01(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f64 {
        2.0 * self.f01() - 1.0
    }

    /// `n` values uniform in [-1, 1).
    pub fn units(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.unit()).collect()
    }

    /// Uniform in `0..n` (`n > 0`; the high half of a 64 x 64-bit product).
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "below(0)");
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        assert!(lo <= hi, "range({lo}, {hi})");
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.f01() < p
    }

    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// Log-uniform in `[lo, hi)`.
    pub fn log_uniform(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + self.f01() * (hi.ln() - lo.ln())).exp()
    }

    /// Fisher-Yates.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }

    /// `k` distinct values of `0..n` in random order (`k <= n`).
    pub fn sample(&mut self, n: usize, k: usize) -> Vec<usize> {
        assert!(k <= n, "sample({n}, {k})");
        if k * 4 >= n {
            let mut all: Vec<usize> = (0..n).collect();
            self.shuffle(&mut all);
            all.truncate(k);
            return all;
        }
        let mut seen = std::collections::HashSet::with_capacity(k * 2);
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            let v = self.below(n);
            if seen.insert(v) {
                out.push(v);
            }
        }
        out
    }

    /// `k` distinct entries of `pool`, uniformly (a partial Fisher-Yates that leaves `pool`
    /// permuted, which keeps every later draw from it uniform too).
    pub fn distinct<'p>(&mut self, pool: &'p mut [i32], k: usize) -> &'p [i32] {
        let n = pool.len();
        assert!(k <= n, "cannot draw {k} distinct values from {n}");
        for i in 0..k {
            let j = i + self.below(n - i);
            pool.swap(i, j);
        }
        &pool[..k]
    }

    /// `n` random values in [-1, 1), rounded to `T` (53 random bits each).
    pub fn halves<T: Element>(&mut self, n: usize) -> Vec<T> {
        (0..n).map(|_| T::from_f64(self.unit())).collect()
    }

    /// `n` values uniform in [-1, 1) on a grid of 2^-15, rounded to `T`: 16 random bits
    /// each, four values per draw (the bench fills its 16.8 MB chunks with it).
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

    /// A softmax scale: log-uniform over [0.01, 0.3), or one of the models' values.
    pub fn softmax_scale(&mut self) -> f32 {
        match self.below(6) {
            0 => 1.0 / 16.0,           // GLM-5
            1 => (1.0 / 24.0) * 1.874, // DeepSeek-V3 with YaRN mscale²
            _ => self.log_uniform(0.01, 0.3) as f32,
        }
    }
}

/// A fresh seed for a non-proptest test (from the clock, or `MLA_TEST_SEED` to replay),
/// printed so that a failure names it (cargo shows a failing test's output).
pub fn seed(test: &str) -> u64 {
    let seed = match std::env::var("MLA_TEST_SEED") {
        Ok(s) => {
            let s = s.trim();
            let parsed = match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("MLA_TEST_SEED={s:?}: not a u64"))
        }
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            let mut h = 0xcbf2_9ce4_8422_2325u64;
            for b in test.bytes() {
                h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
            Rng::new(nanos ^ h).next_u64()
        }
    };
    eprintln!("{test}: seed {seed:#x} (replay with MLA_TEST_SEED={seed:#x})");
    seed
}

/// A generator for test `test`, seeded by [`seed`].
pub fn rng_for(test: &str) -> Rng {
    Rng::new(seed(test))
}

/// Rounds of the GPU tests that walk a fixed grid of random problems (the fp8 random tests):
/// `MLA_GPU_ROUNDS`, default 1. A deeper run (`MLA_GPU_ROUNDS=4 MLA_GPU_CASES=64`) draws that
/// many fresh problems per grid point.
pub fn rounds() -> usize {
    std::env::var("MLA_GPU_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(1)
}

/// Runs `test` on `cases` random values of `strategy` (fresh each run; `MLA_GPU_CASES`
/// overrides the count). A failing case is shrunk a little and reported with its value (which
/// holds the seed of its data).
pub fn run_cases<S>(name: &str, cases: u32, strategy: S, test: impl Fn(&S::Value))
where
    S: Strategy,
    S::Value: Debug,
{
    let cases = std::env::var("MLA_GPU_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 24,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&strategy, |value| {
        eprintln!("{name}: case {value:?}");
        test(&value);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}
