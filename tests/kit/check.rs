//! The comparisons: device outputs against the reference (relative L2 per (row, head), lse,
//! empty rows exact), two device results against each other, the gaps of strided outputs,
//! the error flag, the gather's slots. The bench's `--check` uses the same numbers
//! ([`out_tolerance`], [`LSE_TOL`], [`rel_l2`], [`lse_diff`]).

use mla_decode::reference::{Attention, Fault};
use mla_decode::{DType, LATENT_DIM};

use super::host::{Half, Outputs, POISON};
use super::problem::{GatherSetup, GATHER_POISON};

/// Absolute tolerance of lse.
pub const LSE_TOL: f64 = 1e-3;

/// Relative L2 tolerance of one (row, head) output against the f64 reference: f16 lands
/// near 1e-3, bf16 between 1e-3 and 1e-2 (its output rounding alone is 2^-9 per element).
pub const fn out_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2e-3,
        DType::Bf16 => 1e-2,
    }
}

/// `‖got − want‖ / ‖want‖`; where `want` is all zeros, 0 if `got` is too and infinite
/// otherwise. NaN in `got` gives NaN (which fails every `<=` check).
pub fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (g, w) in got.iter().zip(want) {
        num += (g - w) * (g - w);
        den += w * w;
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else if num.is_nan() {
            f64::NAN
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

/// `|got − want|`, 0 when both are the same (also both -inf: nothing visible).
pub fn lse_diff(got: f64, want: f64) -> f64 {
    if got == want {
        0.0
    } else {
        (got - want).abs()
    }
}

/// The larger of two errors, NaN counting as the largest.
pub fn worst(a: f64, b: f64) -> f64 {
    if b.is_nan() || b > a {
        b
    } else {
        a
    }
}

/// Checks device outputs against the reference for device heads `heads` (reference head `i` is
/// device head `heads[i]`): per (row, head) relative L2 of the 512 outputs within
/// [`out_tolerance`], lse within [`LSE_TOL`], empty rows exactly 0 and -inf, never NaN; and
/// that every element outside the views still holds the poison.
pub fn check_outputs<T: Half>(label: &str, got: &Outputs<T>, want: &Attention, heads: &[usize]) {
    let tol = out_tolerance(T::DTYPE);
    assert_eq!(want.num_heads, heads.len(), "{label}: reference head count");
    check_gaps(label, got);
    let l = &got.out_layout;
    assert_eq!(want.rows(), l.tokens, "{label}: reference rows");
    let mut errors = Vec::new();
    let mut worst_out = (0.0f64, 0usize, 0usize);
    let mut worst_lse = 0.0f64;
    let mut vals = vec![0.0f64; LATENT_DIM];
    for r in 0..l.tokens {
        for (i, &h) in heads.iter().enumerate() {
            let s = l.at(r, h);
            for (v, x) in vals.iter_mut().zip(&got.out[s..s + LATENT_DIM]) {
                *v = x.to_f64();
            }
            let want_lse = want.lse_at(r, i);
            let got_lse = got.lse.as_ref().map(|(b, ll)| b[ll.at(r, h)] as f64);
            if want_lse == f64::NEG_INFINITY {
                if let Some(d) = vals.iter().position(|&v| v != 0.0) {
                    errors.push(format!(
                        "row {r} head {h}: empty attention, out[{d}] = {} (want exactly 0)",
                        vals[d]
                    ));
                }
                if let Some(g) = got_lse {
                    if g != f64::NEG_INFINITY {
                        errors.push(format!(
                            "row {r} head {h}: empty attention, lse = {g} (want -inf)"
                        ));
                    }
                }
                continue;
            }
            if let Some(d) = vals.iter().position(|v| !v.is_finite()) {
                errors.push(format!("row {r} head {h}: out[{d}] = {}", vals[d]));
                continue;
            }
            let e = rel_l2(&vals, want.out_row(r, i));
            if e > worst_out.0 {
                worst_out = (e, r, h);
            }
            if e.is_nan() || e > tol {
                errors.push(format!(
                    "row {r} head {h}: relative L2 error {e:.3e} > {tol:.0e} (out[0] {} want {})",
                    vals[0],
                    want.out_row(r, i)[0]
                ));
            }
            if let Some(g) = got_lse {
                let d = (g - want_lse).abs();
                worst_lse = worst_lse.max(d);
                if d.is_nan() || d > LSE_TOL {
                    errors.push(format!(
                        "row {r} head {h}: lse {g} want {want_lse} (diff {d:.3e})"
                    ));
                }
            }
        }
    }
    if !errors.is_empty() {
        let n = errors.len();
        errors.truncate(12);
        panic!(
            "{label} ({}): {n} (row, head) mismatches; worst rel L2 {:.3e} at row {} head {}, \
             worst lse diff {worst_lse:.3e}:\n  {}",
            T::DTYPE,
            worst_out.0,
            worst_out.1,
            worst_out.2,
            errors.join("\n  ")
        );
    }
}

/// Every element outside the out/lse views holds the poison: the gaps of strided layouts
/// and whatever the buffers hold past the views (preallocated buffers longer than a call).
pub fn check_gaps<T: Half>(label: &str, got: &Outputs<T>) {
    let covered = got.out_layout.covered();
    if let Some(i) = (0..got.out.len()).find(|&i| !covered[i] && got.out[i].bits() != POISON) {
        panic!(
            "{label}: out element {i} outside the view was overwritten ({:?})",
            got.out_layout
        );
    }
    if let Some((buf, l)) = &got.lse {
        let covered = l.covered();
        if let Some(i) = (0..buf.len()).find(|&i| !covered[i] && !buf[i].is_nan()) {
            panic!("{label}: lse element {i} outside the view was overwritten ({l:?})");
        }
    }
}

/// Compares two device results of the same problem to each other (per (row, head) relative
/// L2 within [`out_tolerance`], lse within [`LSE_TOL`], empty rows identical).
pub fn check_close_runs<T: Half>(label: &str, a: &Outputs<T>, b: &Outputs<T>) {
    let tol = out_tolerance(T::DTYPE);
    let (la, lb) = (&a.out_layout, &b.out_layout);
    assert_eq!((la.tokens, la.heads), (lb.tokens, lb.heads), "{label}");
    let mut errors = Vec::new();
    for r in 0..la.tokens {
        for h in 0..la.heads {
            let va: Vec<f64> = a.out[la.at(r, h)..][..LATENT_DIM]
                .iter()
                .map(|v| v.to_f64())
                .collect();
            let vb: Vec<f64> = b.out[lb.at(r, h)..][..LATENT_DIM]
                .iter()
                .map(|v| v.to_f64())
                .collect();
            let e = rel_l2(&vb, &va);
            if e.is_nan() || e > tol {
                errors.push(format!("row {r} head {h}: relative L2 {e:.3e}"));
            }
            if let (Some((ba, lla)), Some((bb, llb))) = (&a.lse, &b.lse) {
                let (x, y) = (ba[lla.at(r, h)], bb[llb.at(r, h)]);
                let same_inf = x == f32::NEG_INFINITY && y == f32::NEG_INFINITY;
                if !same_inf && ((x - y).abs() as f64 > LSE_TOL || x.is_nan() || y.is_nan()) {
                    errors.push(format!("row {r} head {h}: lse {x} vs {y}"));
                }
            }
        }
    }
    if !errors.is_empty() {
        let n = errors.len();
        errors.truncate(12);
        panic!(
            "{label}: {n} mismatches between the two device results:\n  {}",
            errors.join("\n  ")
        );
    }
}

/// The flag holds one of `faults` (the first fault a kernel found), or is clear when there
/// are none.
#[track_caller]
pub fn check_flag(label: &str, words: [u32; 4], faults: &[Fault]) {
    if faults.is_empty() {
        assert_eq!(
            words, [0; 4],
            "{label}: the error flag records a fault, the reference none"
        );
        return;
    }
    let value = (words[3] as u64) << 32 | words[2] as u64;
    let hit = faults
        .iter()
        .any(|f| words[0] == f.code && words[1] == f.row && value as i64 == f.value);
    assert!(
        hit,
        "{label}: error flag {words:?} is none of the reference's faults {:?}",
        &faults[..faults.len().min(8)]
    );
}

/// The flag holds exactly `(code, row, value)`.
#[track_caller]
pub fn check_flag_is(label: &str, words: [u32; 4], code: u32, row: usize, value: i64) {
    assert_eq!(
        words,
        [code, row as u32, value as u32, (value >> 32) as u32],
        "{label}: error flag (want code {code}, row {row}, value {value})"
    );
}

/// The device slots of a gather equal the reference's exactly, the padding and everything
/// past the last row keep their poison, and the flag holds one of the reference's faults (or
/// none); returns the faults.
pub fn check_gather(label: &str, g: &GatherSetup, got: &[i32], flag: [u32; 4]) -> Vec<Fault> {
    let (want, faults) = g.reference();
    for t in 0..g.tokens {
        for k in 0..g.out_stride {
            let i = t * g.out_stride + k;
            if i >= got.len() {
                break;
            }
            if k < g.topk {
                assert_eq!(
                    got[i],
                    want[t * g.topk + k],
                    "{label}: slot [{t}, {k}] (position {}, request {})",
                    g.positions[t * g.pos_stride + k],
                    g.req_id[t]
                );
            } else {
                assert_eq!(
                    got[i], GATHER_POISON,
                    "{label}: out padding [{t}, {k}] written"
                );
            }
        }
    }
    let end = (g.tokens - 1) * g.out_stride + g.topk;
    if let Some(i) = (end..got.len()).find(|&i| got[i] != GATHER_POISON) {
        panic!(
            "{label}: out element {i}, past the last row ({} tokens), written",
            g.tokens
        );
    }
    check_flag(label, flag, &faults);
    faults
}
