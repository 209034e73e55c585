//! The fp8_ds_mla quantization of the reference (`mla_decode::reference::fp8`): e4m3 codes,
//! rounding and saturation, row round trips under both scale rules, bf16 rounding.

use mla_decode::reference::fp8::{self, ScaleRule};
use mla_decode::reference::{fault_code, HEAD_DIM, LATENT_DIM};
use proptest::prelude::*;

use crate::kit::Rng;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// fp8_ds_mla with FlashMLA's power-of-two scales: error within e4m3's bound, scales as ruled.
    #[test]
    fn fp8_round_trip_power_of_two(seed in any::<u64>(), exps in prop::array::uniform4(-24i32..12)) {
        check_fp8_round_trip(seed, exps, ScaleRule::Pow2);
    }

    /// fp8_ds_mla with vLLM's exact amax/448 scales: error within e4m3's bound.
    #[test]
    fn fp8_round_trip_exact(seed in any::<u64>(), exps in prop::array::uniform4(-24i32..12)) {
        check_fp8_round_trip(seed, exps, ScaleRule::Raw);
    }

    /// bf16 rounding equals half's (correct for f32 inputs) and never double-rounds f64 inputs.
    #[test]
    fn bf16_rounding(x in any::<f32>().prop_filter("finite", |x| x.is_finite())) {
        let want = half::bf16::from_f32(x);
        prop_assert_eq!(fp8::bf16_encode(x as f64), want.to_bits());
        prop_assert_eq!(fp8::bf16_decode(want.to_bits()), want.to_f64());
        // Just above a tie between two bf16 values (only bits below f32's reach): rounds up.
        let (lo, hi) = (want.to_f64(), f32::from_bits((want.to_bits() as u32 + 1) << 16) as f64);
        if want.to_f64() > 0.0 && hi.is_finite() {
            let above_tie = (lo + hi) / 2.0 + (hi - lo) * 2f64.powi(-40);
            prop_assert_eq!(fp8::bf16_decode(fp8::bf16_encode(above_tie)), hi);
        }
    }
}

/// Rows whose four tiles have magnitudes around 2^exps[i] (some elements 0 or tiny).
fn check_fp8_round_trip(seed: u64, exps: [i32; 4], rule: ScaleRule) {
    let mut rng = Rng::new(seed);
    for _ in 0..8 {
        let mut row = rng.units(HEAD_DIM);
        for x in row[LATENT_DIM..].iter_mut() {
            *x = *x as f32 as f64; // so that half's f32 -> bf16 is an exact reference
        }
        for (tile, &e) in row[..LATENT_DIM].chunks_exact_mut(fp8::TILE).zip(&exps) {
            for x in tile.iter_mut() {
                *x *= 2f64.powi(e);
                match rng.below(16) {
                    0 => *x = 0.0,
                    1 => *x *= 2f64.powi(-12),
                    _ => {}
                }
            }
        }
        let bytes = fp8::quantize_row(&row, rule);
        assert_eq!(bytes.len(), fp8::ROW_BYTES);
        assert!(
            bytes[..LATENT_DIM].iter().all(|&b| b & 0x7f != 0x7f),
            "NaN code written"
        );
        let back = fp8::dequantize_row(&bytes);
        let scales = fp8::row_scales(&bytes);
        for (i, tile) in row[..LATENT_DIM].chunks_exact(fp8::TILE).enumerate() {
            let amax = tile.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let scale = scales[i] as f64;
            match rule {
                ScaleRule::Pow2 => {
                    assert!(scale >= 1e-4 && scale == 2f64.powi(scale.log2().round() as i32));
                    let r = amax / scale; // in (224, 448] up to f32 rounding, unless floored
                    assert!(r <= 448.0 * (1.0 + 1e-6), "tile {i}: amax/scale {r}");
                    assert!(
                        amax / 448.0 <= 1e-4 || r >= 224.0 * (1.0 - 1e-6),
                        "tile {i}: {r}"
                    );
                }
                ScaleRule::Raw => {
                    assert_eq!(scales[i], (amax as f32 / 448.0).max(f32::MIN_POSITIVE))
                }
            }
            for (j, &x) in tile.iter().enumerate() {
                let d = back[i * fp8::TILE + j];
                let bound = 0.0625 * x.abs() + scale * 2f64.powi(-9) + x.abs() * 1e-7;
                assert!(
                    (d - x).abs() <= bound,
                    "tile {i} [{j}]: {x} -> {d} (scale {scale})"
                );
            }
        }
        for (&x, &d) in row[LATENT_DIM..].iter().zip(&back[LATENT_DIM..]) {
            assert_eq!(d, half::bf16::from_f32(x as f32).to_f64(), "rope {x}");
        }
        assert_eq!(
            fp8::dequantize_cache(&fp8::quantize_cache(&row, rule)),
            back.to_vec()
        );
    }
}

/// Every e4m3 code decodes to its value and (but for NaN) encodes back to itself.
#[test]
fn e4m3_all_codes() {
    let mut values = Vec::new();
    for code in 0..=255u8 {
        let v = fp8::e4m3_decode(code);
        if code & 0x7f == 0x7f {
            assert!(v.is_nan());
            continue;
        }
        assert!(v.abs() <= 448.0);
        assert_eq!(fp8::e4m3_encode(v), code, "code {code:#x} value {v}");
        values.push(v);
    }
    assert_eq!(fp8::e4m3_decode(0x7e), 448.0);
    assert_eq!(fp8::e4m3_decode(0x01), 2f64.powi(-9));
    assert_eq!(fp8::e4m3_decode(0x08), 2f64.powi(-6));
    assert_eq!(fp8::e4m3_decode(0x38), 1.0);
    assert_eq!(fp8::e4m3_decode(0xb8), -1.0);
    values.sort_by(f64::total_cmp);
    values.dedup(); // +0 and -0
    assert_eq!(values.len(), 253);
}

/// Round to nearest even, saturation to ±448, NaN never produced.
#[test]
fn e4m3_rounding_and_saturation() {
    let cases = [
        (1.0625, 0x38), // tie between 1 and 1.125: even mantissa
        (1.0625 + 1e-12, 0x39),
        (1.1875, 0x3a), // tie between 1.125 and 1.25: even mantissa
        (448.0, 0x7e),
        (464.0, 0x7e), // tie between 448 and (the NaN code's) 480
        (470.0, 0x7e), // saturates
        (1e30, 0x7e),
        (f64::INFINITY, 0x7e),
        (-1e30, 0xfe),
        (f64::NEG_INFINITY, 0xfe),
        (2f64.powi(-10), 0x00), // tie between 0 and the smallest subnormal
        (1.5 * 2f64.powi(-10), 0x01),
        (2.5 * 2f64.powi(-9), 0x02),
        (7.5 * 2f64.powi(-9), 0x08), // rounds up into the smallest normal
        (1e-30, 0x00),
        (f64::NAN, 0x7f),
    ];
    for (x, code) in cases {
        assert_eq!(fp8::e4m3_encode(x), code, "{x}");
    }
    // Every value within the range rounds to a nearest code.
    let mut rng = Rng::new(7);
    for _ in 0..10_000 {
        let x = rng.unit() * 2f64.powi(rng.below(20) as i32 - 10);
        let d = fp8::e4m3_decode(fp8::e4m3_encode(x));
        let err = (d - x).abs();
        for code in 0..=255u8 {
            let v = fp8::e4m3_decode(code);
            assert!(
                v.is_nan() || (v - x).abs() >= err,
                "{x} -> {d}, but {v} is nearer"
            );
        }
    }
}

/// A per-tensor scale is a fault unless it is a finite number > 0; the value is its bits,
/// zero-extended (as the kernels record it).
#[test]
fn tensor_scale_faults() {
    for s in [0.5f32, 1e-30, 3.0e38, f32::MIN_POSITIVE, 1e-45] {
        assert_eq!(fp8::tensor_scale_fault(s), None, "{s}");
    }
    for s in [
        0.0f32,
        -0.0,
        -1.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ] {
        let f = fp8::tensor_scale_fault(s).expect("a fault");
        assert_eq!(
            (f.code, f.row, f.value),
            (fault_code::BAD_KV_SCALE, 0, i64::from(s.to_bits())),
            "{s}"
        );
        assert!(f.value >= 0, "zero-extended: {s}");
    }
}
