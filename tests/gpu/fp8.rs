//! fp8 caches (issue #12) and 64-bit fault values:
//! - the quantize-and-append kernel writes fp8_ds_mla rows (raw and pow2 scales) and
//!   per-tensor fp8 rows byte for byte as the f64 reference quantizer does, from f16 and bf16
//!   rows, every block size, padded blocks, -1 and bad slots;
//! - dense and sparse decode of fp8 caches (both formats, both scale rules, f16/bf16 queries,
//!   heads 1..=128, q_len 1..=8, every block size and tile configuration, bad ids), written by
//!   the reference quantizer or by the GPU append, against the f64 reference of the
//!   dequantized rows; a per-tensor cache needs its scale;
//! - fault values through `check` are the values the kernels met, 64 bits wide.

use std::sync::Arc;

use mla_decode::cudarc::driver::CudaStream;
use mla_decode::half::{bf16, f16};
use mla_decode::reference::{fault_code, fp8, Fault};
use mla_decode::*;

use crate::dense::nan_past_lens_fp8;
use crate::kit::*;
use crate::plumbing::{cache_rows, stream};
use crate::sparse::maybe_nan_past_topk_len;

/// The expected bytes of one row written into `format` from `row` (the values exactly as
/// uploaded; a 16-bit format's rows are of its own type, and copied).
fn quantized(format: KvFormat, rule: Option<ScaleRule>, scale: f32, row: &[f64]) -> Vec<u8> {
    match format {
        KvFormat::Fp8DsMla => fp8::quantize_row(row, rule.unwrap()).to_vec(),
        KvFormat::Fp8PerTensor => fp8::quantize_row_per_tensor(row, scale).to_vec(),
        KvFormat::Bf16 => (row.iter())
            .flat_map(|&v| bf16::from_f64(v).to_bits().to_le_bytes())
            .collect(),
        KvFormat::F16 => (row.iter())
            .flat_map(|&v| f16::from_f64(v).to_bits().to_le_bytes())
            .collect(),
    }
}

/// `n` random rows of `T` into an fp8 cache of random bytes (padded blocks), through a slot
/// mapping with -1 padding and then bad slots; the whole cache buffer must equal the
/// reference's bytes and the flag must hold one of the bad slots. `far`: the cache's
/// blocks start past 4 GiB into the buffer (after blocks of 0xff that must stay so). Also
/// `T`'s own 16-bit format (`rule` None).
fn check_append_fp8<T: Half>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    (format, rule): (KvFormat, Option<ScaleRule>),
    block_size: usize,
    far: bool,
) {
    let num_blocks = rng.range(3, 40);
    let row_bytes = format.row_bytes();
    let stride_bytes = block_size * row_bytes + 16 * rng.below(3);
    let slots_total = num_blocks * block_size;
    let mut want: Vec<u8> = (0..num_blocks * stride_bytes)
        .map(|_| rng.below(256) as u8)
        .collect();
    // blocks before the cache's own, and the slots they hold
    let shift = if far { far_shift(stride_bytes) } else { 0 };
    let (first_slot, first_byte) = (shift * block_size, shift * stride_bytes);
    let mut cache = upload_far(stream, &want, stride_bytes, shift);
    let tensor_scale = [0.25f32, 1.0 / 448.0, 3.0e-3, 7.5][rng.below(4)];
    let scale = stream.clone_htod(&[tensor_scale]).unwrap();
    let layout = CacheLayout {
        format,
        block_size,
        num_blocks: shift + num_blocks,
        block_stride_bytes: stride_bytes,
    };
    let mut flag = ErrorFlag::new(stream).unwrap();

    // Rows whose 128-value tiles span many magnitudes (scales from 2^-20 to 2^12), with a
    // few NaNs, zeros, infinities (an fp8_ds_mla tile's scale is then +inf, as in vLLM) and
    // values at tile maxima; one tile in 16 all zeros (amax 0: the rules' floors).
    let n = rng.range(1, slots_total.min(300));
    let stride = HEAD_DIM + 8 * rng.below(3);
    let mut kv = vec![T::nan(); (n - 1) * stride + HEAD_DIM];
    for i in 0..n {
        for tile in 0..HEAD_DIM.div_ceil(128) {
            let mag = 2f64.powi(rng.range(0, 32) as i32 - 20);
            let zeros = rng.below(16) == 0;
            for j in tile * 128..((tile + 1) * 128).min(HEAD_DIM) {
                let v = match if zeros { 2 } else { rng.below(400) } {
                    0 | 1 => f64::NAN,
                    2 | 3 => 0.0,
                    4 => f64::INFINITY,
                    5 => f64::NEG_INFINITY,
                    _ => rng.unit() * mag,
                };
                kv[i * stride + j] = T::from_f64(v);
            }
        }
    }
    // (a far append keeps row 0's slot, so that it always writes past 4 GiB)
    let kept = |i: usize| far && i == 0;
    let mut slots: Vec<i64> = rng
        .sample(slots_total, n)
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            if rng.below(6) == 0 && !kept(i) {
                -1
            } else {
                (first_slot + s) as i64
            }
        })
        .collect();
    // bad slots: past the end, negative, past 2^32
    let bad = [(first_slot + slots_total) as i64, -9, (1i64 << 35) + 3];
    let mut faults = Vec::new();
    for (k, &b) in bad.iter().enumerate() {
        if n > k + 1 && rng.below(2) == 0 {
            let i = rng.below(n);
            if slots[i] >= 0 && !kept(i) {
                slots[i] = b;
                faults.push(Fault {
                    code: fault_code::BAD_APPEND_SLOT,
                    row: i as u32,
                    value: b,
                });
            }
        }
    }
    for (i, &slot) in slots.iter().enumerate() {
        if slot < first_slot as i64 || slot as usize >= first_slot + slots_total {
            continue;
        }
        let row: Vec<f64> = kv[i * stride..][..HEAD_DIM]
            .iter()
            .map(|v| v.to_f64())
            .collect();
        let at = slot_offset(&layout, slot as usize) - first_byte;
        want[at..at + row_bytes].copy_from_slice(&quantized(format, rule, tensor_scale, &row));
    }
    let kv_dev = stream.clone_htod(&kv).unwrap();
    let slots_dev = stream.clone_htod(&slots).unwrap();
    let mut kc = KvCacheMut::new(&mut cache, layout);
    if format == KvFormat::Fp8PerTensor {
        kc = kc.with_scale(&scale);
    }
    let args = AppendArgs {
        kv: &kv_dev,
        kv_token_stride: stride,
        slot_mapping: &slots_dev,
        num_tokens: n,
        scale_rule: rule,
    };
    append_kv(stream, &args, &mut kc, Some(&mut flag)).unwrap();
    let words = flag.read(stream).unwrap();
    check_flag(label, words, &faults);
    // (far: the 16 bytes before the cache's blocks too, and where an offset wrapped at 2^32
    // would have written, which must still be 0xff)
    if far {
        let wrapped = first_byte - FAR_BYTES;
        let got = stream
            .clone_dtoh(&cache.slice(wrapped..wrapped + want.len()))
            .unwrap();
        assert!(
            got.iter().all(|&b| b == 0xff),
            "{label}: bytes written 2^32 before the cache's blocks"
        );
    }
    let before = first_byte.min(16);
    let got = stream
        .clone_dtoh(&cache.slice(first_byte - before..))
        .unwrap();
    assert!(
        got[..before].iter().all(|&b| b == 0xff),
        "{label}: the bytes before the cache's blocks were written"
    );
    let got = &got[before..];
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let (blk, within) = (i / stride_bytes, i % stride_bytes);
        panic!(
            "{label}: cache byte {i} (block {blk}, row {}, byte {}) is {:#04x}, want {:#04x}",
            within / row_bytes,
            within % row_bytes,
            got[i],
            want[i]
        );
    }
}

const FORMATS: [(KvFormat, Option<ScaleRule>); 3] = [
    (KvFormat::Fp8DsMla, Some(ScaleRule::Raw)),
    (KvFormat::Fp8DsMla, Some(ScaleRule::Pow2)),
    (KvFormat::Fp8PerTensor, None),
];

/// Every fp8 format and scale rule x f16/bf16 rows x every block size: the cache bytes equal
/// the reference quantizer's.
#[test]
#[ignore = "needs a GPU"]
fn append_fp8_matches_reference_bytes() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("append_fp8_matches_reference_bytes");
    for (format, rule) in FORMATS {
        for dtype in [DType::Bf16, DType::F16] {
            for bs in BLOCK_SIZES {
                let label = format!("append {format} {rule:?} {dtype} bs {bs}");
                with_dtype!(dtype, T => check_append_fp8::<T>(&label, &mut rng, &stream, (format, rule), bs, false));
            }
        }
    }
}

/// The append into caches whose blocks lie past 4 GiB (slot ids whose byte offsets need 64
/// bits), every format (fp8: both rules and both row types).
#[test]
#[ignore = "needs a GPU (and 5 GB of its memory)"]
fn append_past_4_gib() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("append_past_4_gib");
    let sixteen = [(KvFormat::Bf16, None), (KvFormat::F16, None)];
    for kind in FORMATS.into_iter().chain(sixteen) {
        // (a 16-bit format's rows are of its own type)
        let dtype = (kind.0.dtype()).unwrap_or_else(|| rng.pick(&[DType::Bf16, DType::F16]));
        let bs = rng.pick(&BLOCK_SIZES);
        let label = format!("append past 4 GiB {kind:?} {dtype} bs {bs}");
        with_dtype!(dtype, T => check_append_fp8::<T>(&label, &mut rng, &stream, kind, bs, true));
    }
}

/// The fp8 append on small caches: the memcheck/racecheck case.
#[test]
#[ignore = "needs a GPU"]
fn sanitize_append_fp8() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sanitize_append_fp8");
    for (format, rule) in FORMATS {
        let label = format!("sanitize append {format} {rule:?}");
        check_append_fp8::<bf16>(&label, &mut rng, &stream, (format, rule), 16, false);
    }
}

// ---------------------------------------------------------------------------------------------
// Decode of fp8 caches

/// The tile configurations a case runs (cycled): the schedule's choice, then each forced
/// (4 warps x 16 rows, 8 x 16, 8 x 32, 4 x 8, 8 x 8); the environment's MLA_* overrides
/// apply otherwise.
fn config_options(i: usize, sm120_occupancy: bool) -> PlanOptions {
    let mut o = plan_options(sm120_occupancy);
    let (warps, block_m) = [
        (None, None),
        (Some(4), Some(16)),
        (Some(8), Some(16)),
        (Some(8), Some(32)),
        (Some(4), Some(8)),
        (Some(8), Some(8)),
    ][i % 6];
    if o.tuning.warps.is_none() && o.tuning.block_m.is_none() {
        o.tuning.warps = warps;
        o.tuning.block_m = block_m;
    }
    o
}

/// Head counts the fp8 tests cycle through (1, odd, 8, 16, 64, 128, and odd many).
const HEADS: [usize; 8] = [1, 3, 8, 16, 64, 128, 7, 33];

/// A random dense problem of `heads` heads in `T` over an fp8 cache of `kind` ([`random_dense`]:
/// q_len 1..=8, every block size, lengths at edges scaled to a work budget, padded tables and
/// blocks, sometimes a bad block id inside a request's length).
fn random_dense_fp8<T: Half>(
    rng: &mut Rng,
    heads: usize,
    kind: Fp8Kind,
    small: bool,
    mag: f64,
) -> Fp8<DenseSetup<T>> {
    let max_len = if small {
        rng.range(0, 300)
    } else {
        rng.range(0, 3000)
    };
    let max_batch = if small { 4 } else { 17 };
    let s = random_dense::<T>(rng, heads, max_batch, max_len, WORK_BUDGET / 4);
    Fp8::dense(rng, s, kind, mag)
}

/// A random sparse problem of `heads` heads in `T` over an fp8 cache of `kind`
/// ([`random_sparse_case`]: topk from 1 to 2048, holes, duplicates, bad slot ids, optional
/// topk_len, every block size).
fn random_sparse_fp8<T: Half>(
    rng: &mut Rng,
    heads: usize,
    kind: Fp8Kind,
    small: bool,
    mag: f64,
) -> Fp8<SparseSetup<T>> {
    let s = random_sparse_case::<T>(rng, heads, small);
    Fp8::sparse(rng, s, kind, mag)
}

/// Dense decode of fp8 caches written by the reference quantizer (fp8_ds_mla raw and pow2,
/// per-tensor) x f16/bf16 queries x head counts 1..=128 x q_len 1..=8 x block sizes x every
/// tile configuration, against the f64 reference of the dequantized rows; bad block ids.
#[test]
#[ignore = "needs a GPU"]
fn fp8_dense_random() {
    fp8_random("fp8_dense_random", false);
}

/// Sparse decode of fp8 caches (as [`fp8_dense_random`]): topk 1..=2048, holes, duplicates,
/// bad slot ids, topk_len.
#[test]
#[ignore = "needs a GPU"]
fn fp8_sparse_random() {
    fp8_random("fp8_sparse_random", true);
}

/// The cases of [`fp8_dense_random`] / [`fp8_sparse_random`] (test `name`).
fn fp8_random(name: &str, sparse: bool) {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for(name);
    let mut i = 0;
    for kind in (0..rounds()).flat_map(|_| FP8_KINDS) {
        for dtype in [DType::Bf16, DType::F16] {
            for heads in HEADS {
                let options = config_options(i, i % 3 == usize::from(sparse));
                i += 1;
                let label = format!("{name} {kind:?} heads {heads} (case {i})");
                // one run in two, the rows no request reads (dense) or that only entries past
                // topk_len name (sparse) are all 0xff bytes: e4m3 NaN, NaN scales and RoPE
                with_dtype!(dtype, T => {
                    if sparse {
                        let mut s = random_sparse_case::<T>(&mut rng, heads, false);
                        let half = maybe_nan_past_topk_len(&mut rng, &mut s);
                        let slots = s.cache.num_slots();
                        let mut p = Fp8::sparse(&mut rng, s, kind, 1.0);
                        p.fp8.nan_rows(half..slots);
                        let label = format!("{label} nan {}", half < slots);
                        check_problem(&label, &mut rng, &stream, &p, options);
                    } else {
                        let mut p = random_dense_fp8::<T>(&mut rng, heads, kind, false, 1.0);
                        let nan = rng.chance(0.5);
                        if nan {
                            nan_past_lens_fp8(&mut p);
                        }
                        check_problem(&format!("{label} nan {nan}"), &mut rng, &stream, &p, options);
                    }
                });
            }
        }
    }
}

/// Peaked softmaxes: queries times 4 and 16, so that a row's scores spread over tens of log2
/// units and its running max moves by more than the lazy max's slack of 8 as well as by less
/// (decode/kernel.cuh, lazy_max: P then reaches 2^8), for a 16-bit cache and every fp8 kind,
/// dense and sparse, f16/bf16 queries, cycling the tile configurations and occupancy modes.
#[test]
#[ignore = "needs a GPU"]
fn peaked_scores_every_format() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("peaked_scores_every_format");
    let mut i = 0;
    for q_mag in [4.0, 16.0] {
        for dtype in [DType::Bf16, DType::F16] {
            for heads in [8, 16, 64, 3] {
                let options = config_options(i, i % 3 == 0);
                i += 1;
                with_dtype!(dtype, T => {
                    let lens = [rng.range(200, 1500), rng.range(1, 300)];
                    let q_len = rng.range(1, 3);
                    let spec = DenseSpec::random_layout(&mut rng, q_len, heads, &lens);
                    let p = DenseSetup::<T>::build(&mut rng, &spec);
                    let label = format!("peaked x{q_mag} dense 16-bit heads {heads} (case {i})");
                    check_problem_scaled(&label, &mut rng, &stream, &p, options, q_mag);
                    for kind in FP8_KINDS {
                        let p = random_dense_fp8::<T>(&mut rng, heads, kind, false, 1.0);
                        let label = format!("peaked x{q_mag} dense {kind:?} heads {heads} (case {i})");
                        check_problem_scaled(&label, &mut rng, &stream, &p, options, q_mag);
                        let p = random_sparse_fp8::<T>(&mut rng, heads, kind, false, 1.0);
                        let label = format!("peaked x{q_mag} sparse {kind:?} heads {heads} (case {i})");
                        check_problem_scaled(&label, &mut rng, &stream, &p, options, q_mag);
                    }
                });
            }
        }
    }
}

/// A cache written by the GPU's `append_kv` (every kind, f16 and bf16 rows), read back, then
/// decoded dense and sparse: the reference reads the dequantized bytes the append wrote.
#[test]
#[ignore = "needs a GPU"]
fn fp8_decode_after_gpu_append() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("fp8_decode_after_gpu_append");
    let mut i = 0;
    for kind in FP8_KINDS {
        for dtype in [DType::Bf16, DType::F16] {
            for sparse in [false, true] {
                let heads = HEADS[i % HEADS.len()];
                let options = config_options(i, false);
                i += 1;
                let label =
                    format!("fp8_decode_after_gpu_append {kind:?} heads {heads} sparse {sparse}");
                with_dtype!(dtype, T => {
                    if sparse {
                        let mut p = random_sparse_fp8::<T>(&mut rng, heads, kind, false, 1.0);
                        rewrite_by_append(&stream, &mut p.inner.cache, &mut p.fp8, kind);
                        check_problem(&label, &mut rng, &stream, &p, options);
                    } else {
                        let mut p = random_dense_fp8::<T>(&mut rng, heads, kind, false, 1.0);
                        rewrite_by_append(&stream, &mut p.inner.cache, &mut p.fp8, kind);
                        check_problem(&label, &mut rng, &stream, &p, options);
                    }
                });
            }
        }
    }
}

/// Replaces `fp8`'s bytes by what the GPU append writes from `cache`'s 16-bit rows (every
/// slot, into a cache of `fp8`'s layout whose padding holds NaN codes), and `cache.values` by
/// the dequantized rows of those bytes.
fn rewrite_by_append<T: Half>(
    stream: &Arc<CudaStream>,
    cache: &mut HostCache<T>,
    fp8c: &mut Fp8Cache,
    kind: Fp8Kind,
) {
    let n = cache.num_slots();
    let mut rows = Vec::with_capacity(n * HEAD_DIM);
    for slot in 0..n {
        rows.extend_from_slice(cache.row(slot));
    }
    let kv = stream.clone_htod(&rows).unwrap();
    let slots: Vec<i64> = (0..n as i64).collect();
    let slots = stream.clone_htod(&slots).unwrap();
    let mut bytes = stream.clone_htod(&vec![0x7fu8; fp8c.bytes.len()]).unwrap();
    let scale = stream.clone_htod(&[fp8c.tensor_scale]).unwrap();
    let mut kc = KvCacheMut::new(&mut bytes, fp8c.layout);
    if kind.format == KvFormat::Fp8PerTensor {
        kc = kc.with_scale(&scale);
    }
    let args = AppendArgs {
        kv: &kv,
        kv_token_stride: HEAD_DIM,
        slot_mapping: &slots,
        num_tokens: n,
        scale_rule: kind.rule,
    };
    append_kv(stream, &args, &mut kc, None).unwrap();
    fp8c.bytes = stream.clone_dtoh(&bytes).unwrap();
    let (bs, rb, stride) = (
        fp8c.layout.block_size,
        kind.format.row_bytes(),
        fp8c.layout.block_stride_bytes,
    );
    let mut values = Vec::with_capacity(n * HEAD_DIM);
    for slot in 0..n {
        let at = (slot / bs) * stride + (slot % bs) * rb;
        let b = &fp8c.bytes[at..at + rb];
        match kind.format {
            KvFormat::Fp8DsMla => {
                values.extend_from_slice(&fp8::dequantize_row(b.try_into().unwrap()))
            }
            _ => values.extend_from_slice(&fp8::dequantize_row_per_tensor(b, fp8c.tensor_scale)),
        }
    }
    cache.values = Some(values);
}

/// Small fp8 dense and sparse problems of every kind, f16 and bf16, every tile
/// configuration: the memcheck/racecheck/synccheck case.
#[test]
#[ignore = "needs a GPU"]
fn sanitize_fp8_decode_small() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sanitize_fp8_decode_small");
    let mut i = 0;
    for kind in FP8_KINDS {
        for dtype in [DType::Bf16, DType::F16] {
            let heads = [1, 3, 16, 40][i % 4];
            let options = config_options(i, false);
            i += 1;
            with_dtype!(dtype, T => {
                let p = random_dense_fp8::<T>(&mut rng, heads, kind, true, 1.0);
                check_problem(&format!("sanitize fp8 dense {kind:?} heads {heads}"), &mut rng, &stream, &p, options);
                let p = random_sparse_fp8::<T>(&mut rng, heads, kind, true, 1.0);
                check_problem(&format!("sanitize fp8 sparse {kind:?} heads {heads}"), &mut rng, &stream, &p, options);
            });
        }
    }
}

/// Default plans of fp8 steps of 8 query rows and short requests, both occupancies, every fp8
/// kind, f16/bf16 queries: (dense, batch or tokens, heads, longest or topk, with lengths).
/// Dense lengths are drawn from 1 to the longest, or all the longest; sparse rows have 5 %
/// holes and, with lengths, topk_len drawn from 0 to topk.
fn check_fp8_short_rows(name: &str, shapes: &[(bool, usize, usize, usize, bool)]) {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for(name);
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    let mut i = 0;
    for sm120 in [false, true] {
        for &(dense, batch, heads, longest, with_len) in shapes {
            let kind = FP8_KINDS[i % FP8_KINDS.len()];
            let dtype = [DType::Bf16, DType::F16][(i / FP8_KINDS.len()) % 2];
            i += 1;
            let bs = rng.pick(&mla_decode::BLOCK_SIZES);
            let label = format!(
                "{name} dense {dense} batch {batch} heads {heads} longest {longest} len {with_len} \
                 {kind:?} {dtype:?} sm120 {sm120}"
            );
            with_dtype!(dtype, T => {
                if dense {
                    let lens: Vec<i32> = (0..batch)
                        .map(|_| if with_len { rng.range(1, longest) } else { longest } as i32)
                        .collect();
                    let spec = DenseSpec {
                        q_len: 1,
                        heads,
                        block_size: bs,
                        max_blocks_per_seq: longest.div_ceil(bs),
                        table_pad: rng.below(3),
                        block_pad: 8 * rng.below(3),
                        spare_blocks: rng.below(4),
                        junk_unused: true,
                        seq_lens: lens,
                        scale: rng.softmax_scale(),
                    };
                    let s = DenseSetup::<T>::build(&mut rng, &spec);
                    let p = Fp8::dense(&mut rng, s, kind, 1.0);
                    check_problem(&label, &mut rng, &stream, &p, plan_options(sm120));
                } else {
                    let blocks = 4096 / bs + rng.below(8);
                    let s = random_sparse::<T>(&mut rng, batch, heads, longest, blocks, bs, style, with_len);
                    let p = Fp8::sparse(&mut rng, s, kind, 1.0);
                    check_problem(&label, &mut rng, &stream, &p, plan_options(sm120));
                }
            });
        }
    }
}

/// fp8 steps of 8 query rows, a batch near the SM count of H100/H200 and short requests (log
/// #120: whole requests per part; with lengths the closed form, one part per request, no
/// combine), and ones beside the rule (9-tile requests, three times the SM count).
#[test]
#[ignore = "needs a GPU"]
fn fp8_short_requests_8_rows() {
    check_fp8_short_rows(
        "fp8_short_requests_8_rows",
        &[
            (true, 132, 8, 128, false),
            (true, 160, 8, 128, true),
            (true, 100, 8, 96, true),
            (true, 132, 8, 288, true),
            (true, 400, 8, 128, true),
            (false, 132, 8, 128, false),
            (false, 96, 8, 128, true),
            (false, 190, 4, 100, true),
            (false, 132, 8, 256, true),
        ],
    );
}

/// The fp8 8-row short-request rule (log #120) under the sanitizers, with and without lengths.
#[test]
#[ignore = "needs a GPU"]
fn sanitize_fp8_short_requests_8_rows() {
    check_fp8_short_rows(
        "sanitize_fp8_short_requests_8_rows",
        &[(true, 132, 8, 128, true), (false, 132, 8, 128, true)],
    );
}

/// A per-tensor fp8 cache needs its scale (an invalid argument naming kv_cache); with it, the
/// dense decode runs.
#[test]
#[ignore = "needs a GPU"]
fn gpu_fp8_per_tensor_needs_its_scale() {
    let stream = stream();
    let (heads, block_size) = (8, 64);
    let table = stream.clone_htod(&[0i32, 1]).unwrap();
    let seq_lens = stream.clone_htod(&[100i32]).unwrap();
    let q = stream.alloc_zeros::<bf16>(heads * HEAD_DIM).unwrap();
    let mut out = stream.alloc_zeros::<bf16>(heads * LATENT_DIM).unwrap();
    let shape = DenseShape {
        batch: 1,
        q_len: 1,
        num_heads: heads,
        block_size,
        max_blocks_per_seq: 2,
        kv_format: KvFormat::Fp8PerTensor,
    };
    let per_tensor = stream
        .alloc_zeros::<u8>(4 * block_size * KvFormat::Fp8PerTensor.row_bytes())
        .unwrap();
    let scale = stream.clone_htod(&[0.5f32]).unwrap();
    let mut plan = DecodePlan::dense(&stream, shape, PlanOptions::default()).unwrap();
    let kv = KvCache::contiguous(&per_tensor, KvFormat::Fp8PerTensor, block_size).unwrap();
    for (kv_cache, ok) in [(kv.clone(), false), (kv.with_scale(&scale), true)] {
        let args = DenseArgs {
            q: Query::contiguous(&q, heads),
            kv_cache,
            block_table: BlockTable::new(
                &table,
                TableShape {
                    batch: 1,
                    max_blocks_per_seq: 2,
                },
            ),
            seq_lens: &seq_lens,
            softmax_scale: 0.1,
        };
        let err = dense_decode(
            &stream,
            &mut plan,
            &args,
            &mut Output::contiguous(&mut out, heads),
            None,
            None,
        );
        if ok {
            assert_eq!(err, Ok(()));
        } else {
            assert!(
                matches!(
                    err,
                    Err(Error::InvalidArgument {
                        arg: "kv_cache",
                        ..
                    })
                ),
                "{err:?}"
            );
        }
    }
}

/// Fault values through `check` are the values the kernels met, 64 bits wide: a negative
/// seq_len, a negative block id, an append slot past 2^32 and a negative append slot (the
/// kernels store the sign-extended value's high 32 bits in word 3).
#[test]
#[ignore = "needs a GPU"]
fn gpu_fault_values_are_64_bit() {
    let stream = stream();
    let heads = 2;
    let mut cache = stream
        .clone_htod(&cache_rows::<bf16>(4, |slot| slot as f64 / 64.0))
        .unwrap();
    let q = stream
        .clone_htod(&vec![bf16::from_f64(1.0 / 64.0); heads * HEAD_DIM])
        .unwrap();
    let mut out = stream.alloc_zeros::<bf16>(heads * LATENT_DIM).unwrap();
    let mut flag = ErrorFlag::new(&stream).unwrap();
    let shape = DenseShape {
        batch: 1,
        q_len: 1,
        num_heads: heads,
        block_size: 16,
        max_blocks_per_seq: 2,
        kv_format: KvFormat::Bf16,
    };
    let mut plan = DecodePlan::dense(&stream, shape, PlanOptions::default()).unwrap();
    let fault = |code: FaultCode, value: i64| {
        Err(Error::DeviceFault {
            code,
            row: 0,
            value,
        })
    };

    for (table, len, want) in [
        ([0i32, 1], -3, fault(FaultCode::NegativeSeqLen, -3)),
        ([0, -5], 20, fault(FaultCode::BadBlockId, -5)),
    ] {
        let table = stream.clone_htod(&table).unwrap();
        let seq_lens = stream.clone_htod(&[len]).unwrap();
        let args = DenseArgs {
            q: Query::contiguous(&q, heads),
            kv_cache: KvCache::contiguous(&cache, KvFormat::Bf16, 16).unwrap(),
            block_table: BlockTable::new(
                &table,
                TableShape {
                    batch: 1,
                    max_blocks_per_seq: 2,
                },
            ),
            seq_lens: &seq_lens,
            softmax_scale: 0.1,
        };
        flag.reset(&stream).unwrap();
        let mut o = Output::contiguous(&mut out, heads);
        dense_decode(&stream, &mut plan, &args, &mut o, None, Some(&mut flag)).unwrap();
        assert_eq!(flag.check(&stream), want, "seq_len {len}");
    }

    let kv = stream.alloc_zeros::<bf16>(HEAD_DIM).unwrap();
    for slot in [(1i64 << 33) + 5, -7] {
        let slots = stream.clone_htod(&[slot]).unwrap();
        let args = AppendArgs {
            kv: &kv,
            kv_token_stride: HEAD_DIM,
            slot_mapping: &slots,
            num_tokens: 1,
            scale_rule: None,
        };
        flag.reset(&stream).unwrap();
        let mut kc = KvCacheMut::contiguous(&mut cache, KvFormat::Bf16, 16).unwrap();
        append_kv(&stream, &args, &mut kc, Some(&mut flag)).unwrap();
        assert_eq!(
            flag.check(&stream),
            fault(FaultCode::BadAppendSlot, slot),
            "append slot {slot}"
        );
    }
}

/// Caches far from 1: every value times 2^e before quantizing (the fp8 scales then lie near
/// 2^e: the fp8 read path's scale-aware running max clamps log2|scale| to [-100, 100]) and
/// the query times 2^-e (the same scores), so the output is 2^e times an ordinary one. bf16
/// queries with e = ±40 and ±90; f16 queries, whose range is smaller, with e = -12 (the query
/// times 2^12). Each checked against the reference like any problem (relative errors).
#[test]
#[ignore = "needs a GPU"]
fn fp8_extreme_magnitudes() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("fp8_extreme_magnitudes");
    let mut i = 0;
    for kind in FP8_KINDS {
        for (dtype, exps) in [
            (DType::Bf16, &[-90, -40, 40, 90][..]),
            (DType::F16, &[-12][..]),
        ] {
            for &e in exps {
                let heads = [1, 8, 16, 64][i % 4];
                let options = config_options(i, false);
                i += 1;
                let mag = 2f64.powi(e);
                with_dtype!(dtype, T => {
                    let p = random_dense_fp8::<T>(&mut rng, heads, kind, true, mag);
                    let label = format!("fp8 dense x 2^{e} {kind:?} heads {heads}");
                    check_problem_scaled(&label, &mut rng, &stream, &p, options, 1.0 / mag);
                    let p = random_sparse_fp8::<T>(&mut rng, heads, kind, true, mag);
                    let label = format!("fp8 sparse x 2^{e} {kind:?} heads {heads}");
                    check_problem_scaled(&label, &mut rng, &stream, &p, options, 1.0 / mag);
                });
            }
        }
    }
}

/// f16 queries on fp8_ds_mla caches whose bf16 RoPE values lie far outside f16's normal range
/// (up to 2^19, where an f16 input of 65,504 is already stored as bf16 65,536, and down to
/// 2^-30), with the query's RoPE values small (f16 subnormals, exactly as uploaded) so that the
/// scores stay ordinary: the RoPE products must use the stored values as they are (before
/// session 37 the kernels rounded them to f16, and every value >= 65,520 became inf). Dense and
/// sparse, both scale rules, every tile configuration, odd head counts.
#[test]
#[ignore = "needs a GPU"]
fn fp8_ds_mla_f16_queries_wide_rope() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("fp8_ds_mla_f16_queries_wide_rope");
    let exps = [-30, -20, -8, 0, 8, 16, 17, 19];
    for i in 0..24 {
        let heads = HEADS[i % HEADS.len()];
        let kind = FP8_KINDS[i % 2];
        let options = config_options(i / 2, i % 4 >= 2);
        let edit = |rng: &mut Rng, q: &mut HostQuery<f16>| q.refill_rope(rng, 2f64.powi(-18));
        if i % 3 == 0 {
            let mut p = random_sparse_fp8::<f16>(&mut rng, heads, kind, true, 1.0);
            let values = p.inner.cache.values.as_mut().expect("dequantized rows");
            p.fp8.refill_rope(&mut rng, values, &exps);
            let label = format!("f16 sparse wide RoPE {kind:?} heads {heads} (case {i})");
            check_problem_with(&label, &mut rng, &stream, &p, options, edit);
        } else {
            let mut p = random_dense_fp8::<f16>(&mut rng, heads, kind, i % 3 == 1, 1.0);
            let values = p.inner.cache.values.as_mut().expect("dequantized rows");
            p.fp8.refill_rope(&mut rng, values, &exps);
            let label = format!("f16 dense wide RoPE {kind:?} heads {heads} (case {i})");
            check_problem_with(&label, &mut rng, &stream, &p, options, edit);
        }
    }
}

/// A per-tensor fp8 scale that is not a finite number > 0 (0, as from a scale buffer never
/// written; negative; NaN; inf) is recorded as the reference's `fp8::tensor_scale_fault` says
/// (`BAD_KV_SCALE`, row 0, value = its bits) by the append, by dense decode on both paths (the
/// tile kernels and the row kernel) and by sparse decode; a good scale leaves the flag clear.
#[test]
#[ignore = "needs a GPU"]
fn gpu_fp8_bad_tensor_scale_is_recorded() {
    let stream = stream();
    let (heads, block_size, blocks) = (8, 64, 4);
    let mut cache = stream
        .alloc_zeros::<u8>(blocks * block_size * KvFormat::Fp8PerTensor.row_bytes())
        .unwrap();
    let kv = stream
        .clone_htod(&vec![bf16::from_f64(0.25); 3 * HEAD_DIM])
        .unwrap();
    let slots = stream.clone_htod(&[0i64, 5, 130]).unwrap();
    let table = stream.clone_htod(&[0i32, 1, 2, 3]).unwrap();
    let seq_lens = stream.clone_htod(&[200i32]).unwrap();
    let indices = stream.clone_htod(&(0..64).collect::<Vec<i32>>()).unwrap();
    let q = stream
        .clone_htod(&vec![bf16::from_f64(0.5); heads * HEAD_DIM])
        .unwrap();
    let mut out = stream.alloc_zeros::<bf16>(heads * LATENT_DIM).unwrap();
    let mut flag = ErrorFlag::new(&stream).unwrap();
    let dense_shape = DenseShape {
        batch: 1,
        q_len: 1,
        num_heads: heads,
        block_size,
        max_blocks_per_seq: blocks,
        kv_format: KvFormat::Fp8PerTensor,
    };
    let sparse_shape = SparseShape {
        num_tokens: 1,
        num_heads: heads,
        topk: 64,
        kv_format: KvFormat::Fp8PerTensor,
    };
    let with_path = |path: u32| {
        let mut o = PlanOptions::default();
        o.tuning.path = Some(path);
        o
    };
    let mut plans = [
        DecodePlan::dense(&stream, dense_shape, with_path(ffi::MLA_PATH_TILES)).unwrap(),
        DecodePlan::dense(&stream, dense_shape, with_path(ffi::MLA_PATH_ROWS)).unwrap(),
    ];
    let mut sparse_plan =
        DecodePlan::sparse(&stream, sparse_shape, PlanOptions::default()).unwrap();
    for s in [0.0f32, -1.0, f32::NAN, f32::INFINITY, 0.5] {
        let scale = stream.clone_htod(&[s]).unwrap();
        let want: Vec<Fault> = fp8::tensor_scale_fault(s).into_iter().collect();
        let args = AppendArgs {
            kv: &kv,
            kv_token_stride: HEAD_DIM,
            slot_mapping: &slots,
            num_tokens: 3,
            scale_rule: None,
        };
        flag.reset(&stream).unwrap();
        let mut kc = KvCacheMut::contiguous(&mut cache, KvFormat::Fp8PerTensor, block_size)
            .unwrap()
            .with_scale(&scale);
        append_kv(&stream, &args, &mut kc, Some(&mut flag)).unwrap();
        let words = flag.read(&stream).unwrap();
        check_flag(&format!("append, scale {s}"), words, &want);

        let kv_cache = KvCache::contiguous(&cache, KvFormat::Fp8PerTensor, block_size)
            .unwrap()
            .with_scale(&scale);
        for (i, plan) in plans.iter_mut().enumerate() {
            let args = DenseArgs {
                q: Query::contiguous(&q, heads),
                kv_cache: kv_cache.clone(),
                block_table: BlockTable::new(
                    &table,
                    TableShape {
                        batch: 1,
                        max_blocks_per_seq: blocks,
                    },
                ),
                seq_lens: &seq_lens,
                softmax_scale: 0.1,
            };
            flag.reset(&stream).unwrap();
            let mut o = Output::contiguous(&mut out, heads);
            dense_decode(&stream, plan, &args, &mut o, None, Some(&mut flag)).unwrap();
            let words = flag.read(&stream).unwrap();
            check_flag(&format!("dense decode path {i}, scale {s}"), words, &want);
        }
        let args = SparseArgs {
            q: Query::contiguous(&q, heads),
            kv_cache,
            indices: SparseIndices::contiguous(&indices, 64),
            topk_len: None,
            softmax_scale: 0.1,
        };
        flag.reset(&stream).unwrap();
        let mut o = Output::contiguous(&mut out, heads);
        sparse_decode(
            &stream,
            &mut sparse_plan,
            &args,
            &mut o,
            None,
            Some(&mut flag),
        )
        .unwrap();
        let words = flag.read(&stream).unwrap();
        check_flag(&format!("sparse decode, scale {s}"), words, &want);
    }
}
