//! The `fp8_ds_mla` cache row format (FlashMLA / vLLM sparse), 656 bytes per row.
//!
//! Bytes `[0, 512)`: 512 float8_e4m3fn values; `[512, 528)`: 4 little-endian f32 scales, one
//! per 128 values (dequant = e4m3 · scale); `[528, 656)`: 64 bf16 RoPE values, little-endian.
//!
//! The writer computes `amax / 448` in f32 (as the f32 kernels do), then `x / scale` in f32,
//! then rounds that to e4m3 to nearest even, saturating to ±448. Dequantization is the exact
//! product in f64.

use super::{HEAD_DIM, LATENT_DIM, ROPE_DIM};

/// Bytes of one cache row.
pub const ROW_BYTES: usize = 656;
/// Values sharing one scale.
pub const TILE: usize = 128;
/// Largest finite e4m3fn magnitude.
pub const E4M3_MAX: f64 = 448.0;
/// Byte offset of the four f32 scales.
pub const SCALES_OFFSET: usize = LATENT_DIM;
/// Byte offset of the 64 bf16 RoPE values.
pub const ROPE_OFFSET: usize = LATENT_DIM + 4 * (LATENT_DIM / TILE);

const _: () = assert!(ROPE_OFFSET + 2 * ROPE_DIM == ROW_BYTES);

/// How the writer picks each tile's scale from its largest magnitude `amax`: the crate's
/// [`ScaleRule`](crate::ScaleRule) (`Raw`: vLLM, `Pow2`: FlashMLA), the one
/// [`AppendArgs::scale_rule`](crate::AppendArgs::scale_rule) takes.
pub use crate::types::ScaleRule;

impl ScaleRule {
    /// The f32 scale of a tile whose largest magnitude is `amax`.
    pub fn scale(self, amax: f64) -> f32 {
        let s = amax as f32 / 448.0f32;
        match self {
            ScaleRule::Pow2 => {
                let s = s.max(1e-4);
                let p = pow2_floor(s as f64) as f32;
                if p == s {
                    p
                } else {
                    2.0 * p
                }
            }
            ScaleRule::Raw => s.max(f32::MIN_POSITIVE),
        }
    }
}

/// `2^k` for the largest k with `2^k <= x` (x positive and finite, k within f64's normal range).
fn pow2_floor(x: f64) -> f64 {
    f64::from_bits(x.to_bits() & (0x7ff << 52))
}

/// `2^k` as an f64 (k within f64's normal exponent range).
fn pow2(k: i32) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// `x` rounded to nearest even on the grid of a binary float with `mant_bits` stored mantissa
/// bits and smallest normal exponent `min_exp` (no upper limit).
fn round_to_grid(x: f64, mant_bits: i32, min_exp: i32) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let exp = ((x.abs().to_bits() >> 52) as i32 - 1023).max(min_exp);
    let quantum = pow2(exp - mant_bits);
    (x / quantum).round_ties_even() * quantum
}

/// Encode to e4m3fn: round to nearest even, saturate to ±448 (infinities too); NaN gives
/// 0x7f, the NaN code (as the CUDA `cvt.rn.satfinite.e4m3x2.f32` conversion does).
pub fn e4m3_encode(x: f64) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let r = round_to_grid(x.abs(), 3, -6).min(E4M3_MAX);
    let code = if r < pow2(-6) {
        (r / pow2(-9)) as u8 // subnormal: m · 2^-9, m in 0..8
    } else {
        let exp = (r.to_bits() >> 52) as i32 - 1023;
        let mant = (r / pow2(exp - 3)) as u8 - 8;
        (((exp + 7) as u8) << 3) | mant
    };
    sign | code
}

/// Decode an e4m3fn byte (0x7f and 0xff are NaN).
pub fn e4m3_decode(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, mant) = (((b >> 3) & 0xf) as i32, (b & 7) as f64);
    sign * match (exp, b & 7) {
        (15, 7) => f64::NAN,
        (0, _) => mant * pow2(-9),
        _ => (8.0 + mant) * pow2(exp - 10),
    }
}

/// Round to bf16, nearest even (exact, no double rounding); returns the bf16 bits.
pub fn bf16_encode(x: f64) -> u16 {
    if x.is_nan() {
        return 0x7fc0;
    }
    let r = round_to_grid(x, 7, -126);
    let r = if r.abs() >= pow2(128) {
        r.signum() * f64::INFINITY
    } else {
        r
    };
    ((r as f32).to_bits() >> 16) as u16
}

/// Decode bf16 bits.
pub fn bf16_decode(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

/// Quantize one 576-wide row into the 656-byte `fp8_ds_mla` layout.
pub fn quantize_row(row: &[f64], rule: ScaleRule) -> [u8; ROW_BYTES] {
    assert_eq!(row.len(), HEAD_DIM, "quantize_row: row length");
    let mut bytes = [0u8; ROW_BYTES];
    for (i, tile) in row[..LATENT_DIM].chunks_exact(TILE).enumerate() {
        let amax = tile.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let scale = rule.scale(amax);
        for (b, &x) in bytes[i * TILE..][..TILE].iter_mut().zip(tile) {
            *b = e4m3_encode((x as f32 / scale) as f64);
        }
        bytes[SCALES_OFFSET + 4 * i..][..4].copy_from_slice(&scale.to_le_bytes());
    }
    for (b, &x) in bytes[ROPE_OFFSET..]
        .chunks_exact_mut(2)
        .zip(&row[LATENT_DIM..])
    {
        b.copy_from_slice(&bf16_encode(x).to_le_bytes());
    }
    bytes
}

/// The four f32 scales of a quantized row.
pub fn row_scales(bytes: &[u8; ROW_BYTES]) -> [f32; LATENT_DIM / TILE] {
    std::array::from_fn(|i| {
        f32::from_le_bytes(bytes[SCALES_OFFSET + 4 * i..][..4].try_into().unwrap())
    })
}

/// Dequantize a 656-byte row back to 576 values (e4m3 · scale exactly, bf16 RoPE).
pub fn dequantize_row(bytes: &[u8; ROW_BYTES]) -> [f64; HEAD_DIM] {
    let scales = row_scales(bytes);
    let mut row = [0.0; HEAD_DIM];
    for (j, x) in row[..LATENT_DIM].iter_mut().enumerate() {
        *x = e4m3_decode(bytes[j]) * scales[j / TILE] as f64;
    }
    for (x, b) in row[LATENT_DIM..]
        .iter_mut()
        .zip(bytes[ROPE_OFFSET..].chunks_exact(2))
    {
        *x = bf16_decode(u16::from_le_bytes([b[0], b[1]]));
    }
    row
}

/// Bytes of one per-tensor fp8 row: 576 e4m3 values.
pub const TENSOR_ROW_BYTES: usize = HEAD_DIM;

/// Quantize one 576-wide row into a per-tensor fp8 row: every value (RoPE too) is
/// `x / scale` in f32 (IEEE division), then [`e4m3_encode`].
pub fn quantize_row_per_tensor(row: &[f64], scale: f32) -> [u8; TENSOR_ROW_BYTES] {
    assert_eq!(row.len(), HEAD_DIM, "quantize_row_per_tensor: row length");
    std::array::from_fn(|j| e4m3_encode((row[j] as f32 / scale) as f64))
}

/// The fault the kernels record for a per-tensor fp8 scale (the append and both decodes, once
/// per call): [`BAD_KV_SCALE`](super::fault_code::BAD_KV_SCALE) when it is not a finite
/// number > 0, row 0, value = its bits zero-extended. The scale is used as it is either way
/// (the functions here take it with IEEE arithmetic too).
pub fn tensor_scale_fault(scale: f32) -> Option<super::Fault> {
    (!(scale > 0.0 && scale.is_finite())).then(|| super::Fault {
        code: super::fault_code::BAD_KV_SCALE,
        row: 0,
        value: i64::from(scale.to_bits()),
    })
}

/// Dequantize a per-tensor fp8 row: e4m3 · scale exactly.
pub fn dequantize_row_per_tensor(bytes: &[u8], scale: f32) -> [f64; HEAD_DIM] {
    assert_eq!(
        bytes.len(),
        TENSOR_ROW_BYTES,
        "dequantize_row_per_tensor: row length"
    );
    std::array::from_fn(|j| e4m3_decode(bytes[j]) * scale as f64)
}

/// Quantize a whole cache (`rows · 576` values) into `rows · 656` bytes.
pub fn quantize_cache(data: &[f64], rule: ScaleRule) -> Vec<u8> {
    assert_eq!(data.len() % HEAD_DIM, 0, "quantize_cache: length");
    data.chunks_exact(HEAD_DIM)
        .flat_map(|row| quantize_row(row, rule))
        .collect()
}

/// Dequantize a whole cache (`rows · 656` bytes) into `rows · 576` values.
pub fn dequantize_cache(bytes: &[u8]) -> Vec<f64> {
    assert_eq!(bytes.len() % ROW_BYTES, 0, "dequantize_cache: length");
    let rows = bytes.chunks_exact(ROW_BYTES);
    rows.flat_map(|b| dequantize_row(b.try_into().unwrap()))
        .collect()
}
