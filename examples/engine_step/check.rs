//! The check of a step against the f64 reference (`mla_decode::reference`), on a sample of
//! layers, requests and heads: the appended row (bytes), the gathered slot ids (exact), the
//! sparse and dense outputs and lse (relative L2 / absolute tolerances).
//!
//! The reference does not trust the device for anything: it makes each request's cache rows
//! again from their keys (position by position, as the request wrote them), maps positions
//! to slots through the host's own block lists, and attends in f64.

use mla_decode::half::bf16;
use mla_decode::reference::{self, fp8};
use mla_decode::{KvFormat, Result, HEAD_DIM, LATENT_DIM};

use crate::batch::{fill_values, q_key, row_key, Batch, Rng, TOPK};
use crate::engine::{query_set, Engine, FP8_SCALE_RULE, FP8_TENSOR_SCALE};

/// Relative L2 tolerance of one (token, head) output row (bf16 outputs: their rounding alone
/// is 2^-9 per element).
pub const OUT_TOL: f64 = 1e-2;
/// Absolute tolerance of lse (fp32, natural log).
pub const LSE_TOL: f64 = 1e-3;
/// Heads checked per sampled (layer, request).
const HEADS_CHECKED: usize = 4;

/// What one check found.
#[derive(Debug, Default)]
pub struct Report {
    /// (layer, request, head) triples compared.
    pub samples: usize,
    /// Worst relative L2 error of a sparse output row.
    pub worst_sparse: f64,
    /// Worst relative L2 error of a dense output row (`--dense`).
    pub worst_dense: f64,
    /// Worst |lse − reference|.
    pub worst_lse: f64,
    /// What did not match (empty: the step is right).
    pub failures: Vec<String>,
}

impl Report {
    /// Merges another check's findings into this one.
    pub fn absorb(&mut self, other: Report) {
        self.samples += other.samples;
        self.worst_sparse = worst(self.worst_sparse, other.worst_sparse);
        self.worst_dense = worst(self.worst_dense, other.worst_dense);
        self.worst_lse = worst(self.worst_lse, other.worst_lse);
        self.failures.extend(other.failures);
    }
}

/// The larger error, NaN counting as the largest.
fn worst(a: f64, b: f64) -> f64 {
    if b.is_nan() || b > a {
        b
    } else {
        a
    }
}

/// Checks the step just run (the stream must be idle: call after a synchronize) on up to 3
/// layers (first, last, one between), 4 requests (the longest, the shortest, one just
/// admitted if any, one at random) and [`HEADS_CHECKED`] heads of each.
pub fn check_step(engine: &Engine, batch: &Batch, step: usize, rng: &mut Rng) -> Result<Report> {
    let s = engine.shape;
    let mut layers = vec![0, s.layers - 1, rng.below(s.layers)];
    dedup(&mut layers);
    let lens: Vec<usize> = batch.requests.iter().map(|r| r.len).collect();
    let longest = (0..lens.len()).max_by_key(|&r| lens[r]).unwrap_or(0);
    let shortest = (0..lens.len()).min_by_key(|&r| lens[r]).unwrap_or(0);
    let mut rows = vec![longest, shortest];
    rows.extend(batch.admitted.first());
    rows.push(rng.below(batch.len()));
    dedup(&mut rows);
    let mut heads: Vec<usize> = (0..s.heads).collect();
    for i in (1..heads.len()).rev() {
        heads.swap(i, rng.below(i + 1));
    }
    heads.truncate(HEADS_CHECKED);

    let mut report = Report::default();
    for &layer in &layers {
        report.absorb(check_layer(engine, batch, step, layer, &rows, &heads)?);
    }
    Ok(report)
}

fn dedup(v: &mut Vec<usize>) {
    let mut seen = Vec::new();
    v.retain(|x| {
        let new = !seen.contains(x);
        seen.push(*x);
        new
    });
}

/// One layer's outputs, read back once, against the reference of `rows` × `heads`.
fn check_layer(
    engine: &Engine,
    batch: &Batch,
    step: usize,
    layer: usize,
    rows: &[usize],
    heads: &[usize],
) -> Result<Report> {
    let s = engine.shape;
    let (n, h) = (s.requests, s.heads);
    let st = &engine.stream;
    let outs = layer * n * h * LATENT_DIM..(layer + 1) * n * h * LATENT_DIM;
    let lses = layer * n * h..(layer + 1) * n * h;
    let sparse_out = st.clone_dtoh(&engine.out_sparse.slice(outs.clone()))?;
    let sparse_lse = st.clone_dtoh(&engine.lse_sparse.slice(lses.clone()))?;
    let dense = match (&engine.out_dense, &engine.lse_dense) {
        (Some(o), Some(l)) => Some((
            st.clone_dtoh(&o.slice(outs))?,
            st.clone_dtoh(&l.slice(lses))?,
        )),
        _ => None,
    };
    let indices = st.clone_dtoh(
        &engine
            .indices
            .slice(layer * n * TOPK..(layer + 1) * n * TOPK),
    )?;

    let mut report = Report::default();
    let mut fail = |what: String| {
        report
            .failures
            .push(format!("step {step} layer {layer}: {what}"))
    };
    let mut worst_sparse = 0.0f64;
    let mut worst_dense = 0.0f64;
    let mut worst_lse = 0.0f64;
    let mut samples = 0;
    for &row in rows {
        let req = &batch.requests[row];
        let len = req.len;

        // 1. The appended row: the bytes the cache format stores for the new token's row.
        let slot = batch.slot_mapping[row] as usize;
        let mut new_row = vec![bf16::ZERO; HEAD_DIM];
        fill_values(row_key(s.seed, layer, req.uid, len - 1), &mut new_row);
        let got = engine.read_row(layer, slot)?;
        if got != stored_bytes(s.format, &new_row) {
            fail(format!(
                "request {row}: the appended row at slot {slot} differs"
            ));
        }

        // 2. The gathered slot ids, exactly.
        let positions = batch.positions_of(layer, row);
        let got = &indices[row * TOPK..][..TOPK];
        for (k, (&g, &p)) in got.iter().zip(positions).enumerate() {
            let want = if p < 0 {
                -1
            } else {
                batch.slot(row, p as usize) as i32
            };
            if g != want {
                fail(format!(
                    "request {row}: slot id [{k}] = {g}, want {want} (position {p})"
                ));
                break;
            }
        }

        // 3-4. Sparse and dense attention of the sampled heads.
        let keys = cache_rows(s.format, s.seed, layer, req.uid, len);
        let key = |p: usize| &keys[p * HEAD_DIM..][..HEAD_DIM];
        let k = batch.topk_len[row] as usize;
        let chosen: Vec<&[f64]> = positions[..k].iter().map(|&p| key(p as usize)).collect();
        let all: Vec<&[f64]> = (0..len).map(key).collect();
        for &head in heads {
            let mut q = vec![bf16::ZERO; HEAD_DIM];
            fill_values(q_key(s.seed, query_set(step), layer, row, head), &mut q);
            let q: Vec<f64> = q.iter().map(|v| v.to_f64()).collect();
            let at = row * h + head;
            let scale = s.scale as f64;
            let mut compare = |label: &str, out: &[bf16], lse: &[f32], keys: &[&[f64]]| -> f64 {
                let (want, want_lse) = reference::attend(&q, keys.iter().copied(), scale);
                let got: Vec<f64> = out[at * LATENT_DIM..][..LATENT_DIM]
                    .iter()
                    .map(|v| v.to_f64())
                    .collect();
                let err = rel_l2(&got, &want);
                let lse_err = (lse[at] as f64 - want_lse).abs();
                worst_lse = worst(worst_lse, lse_err);
                if err.is_nan() || err > OUT_TOL || lse_err.is_nan() || lse_err > LSE_TOL {
                    fail(format!(
                        "request {row} (length {len}) head {head}: {label} relative error {err:.2e}, \
                         lse {} want {want_lse} (tolerances {OUT_TOL:.0e}, {LSE_TOL:.0e})",
                        lse[at]
                    ));
                }
                err
            };
            worst_sparse = worst(
                worst_sparse,
                compare("sparse", &sparse_out, &sparse_lse, &chosen),
            );
            if let Some((out, lse)) = &dense {
                worst_dense = worst(worst_dense, compare("dense", out, lse, &all));
            }
            samples += 1;
        }
    }
    report.samples = samples;
    report.worst_sparse = worst_sparse;
    report.worst_dense = worst_dense;
    report.worst_lse = worst_lse;
    Ok(report)
}

/// `‖got − want‖ / ‖want‖` (NaN in `got` gives NaN, which fails every check).
fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (g, w) in got.iter().zip(want) {
        num += (g - w) * (g - w);
        den += w * w;
    }
    (num / den).sqrt()
}

/// The bytes a cache of `format` holds for `row` (what `append_kv` must have written).
fn stored_bytes(format: KvFormat, row: &[bf16]) -> Vec<u8> {
    let values: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
    match format {
        KvFormat::Fp8DsMla => fp8::quantize_row(&values, FP8_SCALE_RULE).to_vec(),
        KvFormat::Fp8PerTensor => fp8::quantize_row_per_tensor(&values, FP8_TENSOR_SCALE).to_vec(),
        KvFormat::Bf16 | KvFormat::F16 => row.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Positions `0..len` of request `uid` in `layer` as the decode kernels see them: the rows
/// as made, through the cache format (fp8: quantized, then dequantized), `[len, 576]` f64.
fn cache_rows(format: KvFormat, seed: u64, layer: usize, uid: u64, len: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(len * HEAD_DIM);
    let mut row = vec![bf16::ZERO; HEAD_DIM];
    for pos in 0..len {
        fill_values(row_key(seed, layer, uid, pos), &mut row);
        let values: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
        match format {
            KvFormat::Fp8DsMla => out.extend(fp8::dequantize_row(&fp8::quantize_row(
                &values,
                FP8_SCALE_RULE,
            ))),
            KvFormat::Fp8PerTensor => {
                let bytes = fp8::quantize_row_per_tensor(&values, FP8_TENSOR_SCALE);
                out.extend(fp8::dequantize_row_per_tensor(&bytes, FP8_TENSOR_SCALE))
            }
            KvFormat::Bf16 | KvFormat::F16 => out.extend(values),
        }
    }
    out
}
