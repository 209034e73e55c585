//! Sampled comparison with the f64 reference.
//!
//! The reference costs `heads · seq_len · 2·1088` flops per query row, so large cases are
//! sampled: up to [`MAX_ROWS`] requests (dense) or tokens (sparse) and up to [`MAX_HEADS`]
//! heads, spread evenly (first and last included), computed on one thread per request. The
//! tolerances and the error measures are the tests' ([`super::kit::check`]).

use mla_decode::reference::Attention;
use mla_decode::{Element, LATENT_DIM};

use super::kit::check::{lse_diff, out_tolerance, rel_l2, worst, LSE_TOL};

/// Requests (dense) or tokens (sparse) checked per case.
pub const MAX_ROWS: usize = 8;
/// Heads checked per query row.
pub const MAX_HEADS: usize = 16;

/// The reference output of one (query row, head).
#[derive(Clone, Debug)]
pub struct RefRow {
    pub token: usize,
    pub head: usize,
    pub out: Vec<f64>,
    pub lse: f64,
}

/// How far a case's output is from the reference.
#[derive(Clone, Copy, Debug)]
pub struct Accuracy {
    /// Largest relative L2 error of a sampled output row (gather: fraction of wrong ids).
    pub relerr: f64,
    /// Largest |lse - reference| over the sampled rows (none for the gather).
    pub lse_err: Option<f64>,
    /// The `relerr` limit for this case's dtype.
    pub tolerance: f64,
}

impl Accuracy {
    /// Within both tolerances (NaN fails).
    pub fn passed(&self) -> bool {
        self.relerr <= self.tolerance && self.lse_err.is_none_or(|e| e <= LSE_TOL)
    }
}

/// `n` indices out of `0..len`, evenly spread, first and last included.
pub fn spread(len: usize, n: usize) -> Vec<usize> {
    match n {
        _ if len <= n => (0..len).collect(),
        0 | 1 => (0..n).collect(),
        _ => (0..n).map(|i| i * (len - 1) / (n - 1)).collect(),
    }
}

/// `f(item)` for every item, one thread each, concatenated in order.
pub fn parallel<F>(items: &[usize], f: F) -> Vec<RefRow>
where
    F: Fn(usize) -> Vec<RefRow> + Sync,
{
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = items.iter().map(|&i| s.spawn(move || f(i))).collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a reference thread panicked"))
            .collect()
    })
}

/// The rows of a reference result: row `i` is query row `tokens[i]`, head `j` is
/// `heads[j]`.
pub fn rows_of(att: &Attention, tokens: &[usize], heads: &[usize]) -> Vec<RefRow> {
    let mut rows = Vec::with_capacity(tokens.len() * heads.len());
    for (i, &token) in tokens.iter().enumerate() {
        for (j, &head) in heads.iter().enumerate() {
            rows.push(RefRow {
                token,
                head,
                out: att.out_row(i, j).to_vec(),
                lse: att.lse_at(i, j),
            });
        }
    }
    rows
}

/// Compares a device result (`out [tokens, heads, 512]`, `lse [tokens, heads]`) with the
/// sampled reference rows.
pub fn compare<T: Element>(out: &[T], lse: &[f32], heads: usize, refs: &[RefRow]) -> Accuracy {
    let mut relerr = 0.0;
    let mut lse_err = 0.0;
    let mut got = vec![0.0; LATENT_DIM];
    for r in refs {
        let at = r.token * heads + r.head;
        for (g, v) in got.iter_mut().zip(&out[at * LATENT_DIM..][..LATENT_DIM]) {
            *g = v.to_f64();
        }
        relerr = worst(relerr, rel_l2(&got, &r.out));
        lse_err = worst(lse_err, lse_diff(f64::from(lse[at]), r.lse));
    }
    Accuracy {
        relerr,
        lse_err: Some(lse_err),
        tolerance: out_tolerance(T::DTYPE),
    }
}
