//! fp8 caches (issue #12) and 64-bit fault values:
//! - the quantize-and-append kernel writes fp8_ds_mla rows (raw and pow2 scales) and
//!   per-tensor fp8 rows byte for byte as the f64 reference quantizer does, from f16 and bf16
//!   rows, every block size, padded blocks, -1 and bad slots;
//! - decoding an fp8 cache is refused as `Unsupported` until its kernels land;
//! - fault values through `check` are the values the kernels met, 64 bits wide.

use std::sync::Arc;

use mla_decode::cudarc::driver::CudaStream;
use mla_decode::half::bf16;
use mla_decode::reference::{fault_code, fp8, Fault};
use mla_decode::*;

use crate::kit::*;
use crate::plumbing::{cache_rows, stream};

/// The expected bytes of one row written into `format` from `row` (the values exactly as
/// uploaded).
fn quantized(format: KvFormat, rule: Option<ScaleRule>, scale: f32, row: &[f64]) -> Vec<u8> {
    match format {
        KvFormat::Fp8DsMla => fp8::quantize_row(row, rule.unwrap()).to_vec(),
        KvFormat::Fp8PerTensor => fp8::quantize_row_per_tensor(row, scale).to_vec(),
        _ => unreachable!("fp8 formats only"),
    }
}

/// `n` random rows of `T` into an fp8 cache of random bytes (padded blocks), through a slot
/// mapping with -1 padding and then bad slots; the whole cache buffer must equal the
/// reference's bytes and the flag must hold one of the bad slots.
fn check_append_fp8<T: Half>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    format: KvFormat,
    rule: Option<ScaleRule>,
    block_size: usize,
) {
    let num_blocks = rng.range(3, 40);
    let row_bytes = format.row_bytes();
    let stride_bytes = block_size * row_bytes + 16 * rng.below(3);
    let slots_total = num_blocks * block_size;
    let mut want: Vec<u8> = (0..num_blocks * stride_bytes)
        .map(|_| rng.below(256) as u8)
        .collect();
    let mut cache = stream.clone_htod(&want).unwrap();
    let tensor_scale = [0.25f32, 1.0 / 448.0, 3.0e-3, 7.5][rng.below(4)];
    let scale = stream.clone_htod(&[tensor_scale]).unwrap();
    let layout = CacheLayout {
        format,
        block_size,
        num_blocks,
        block_stride_bytes: stride_bytes,
    };
    let mut flag = ErrorFlag::new(stream).unwrap();

    // Rows whose 128-value tiles span many magnitudes (scales from 2^-20 to 2^12), with a
    // few NaNs, zeros and values at tile maxima.
    let n = rng.range(1, slots_total.min(300));
    let stride = HEAD_DIM + 8 * rng.below(3);
    let mut kv = vec![T::nan(); (n - 1) * stride + HEAD_DIM];
    for i in 0..n {
        for tile in 0..HEAD_DIM.div_ceil(128) {
            let mag = 2f64.powi(rng.range(0, 32) as i32 - 20);
            for j in tile * 128..((tile + 1) * 128).min(HEAD_DIM) {
                let v = match rng.below(200) {
                    0 => f64::NAN,
                    1 => 0.0,
                    _ => rng.unit() * mag,
                };
                kv[i * stride + j] = T::from_f64(v);
            }
        }
    }
    let mut slots: Vec<i64> = rng
        .sample(slots_total, n)
        .into_iter()
        .map(|s| if rng.below(6) == 0 { -1 } else { s as i64 })
        .collect();
    // bad slots: past the end, negative, past 2^32
    let bad = [slots_total as i64, -9, (1i64 << 35) + 3];
    let mut faults = Vec::new();
    for (k, &b) in bad.iter().enumerate() {
        if n > k + 1 && rng.below(2) == 0 {
            let i = rng.below(n);
            if slots[i] >= 0 {
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
        if slot < 0 || slot as usize >= slots_total {
            continue;
        }
        let row: Vec<f64> = kv[i * stride..][..HEAD_DIM]
            .iter()
            .map(|v| v.to_f64())
            .collect();
        let (blk, off) = (slot as usize / block_size, slot as usize % block_size);
        let at = blk * stride_bytes + off * row_bytes;
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
    let got = stream.clone_dtoh(&cache).unwrap();
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
                with_dtype!(dtype, T => check_append_fp8::<T>(&label, &mut rng, &stream, format, rule, bs));
            }
        }
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
        check_append_fp8::<bf16>(&label, &mut rng, &stream, format, rule, 16);
    }
}

/// fp8 caches are described and validated, and refused as unsupported until the kernels
/// exist (issue #12); a per-tensor cache needs its scale.
#[test]
#[ignore = "needs a GPU"]
fn gpu_fp8_caches_are_unsupported() {
    let stream = stream();
    let (heads, block_size) = (8, 64);
    let cache = stream
        .alloc_zeros::<u8>(4 * block_size * KvFormat::Fp8DsMla.row_bytes())
        .unwrap();
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
        kv_format: KvFormat::Fp8DsMla,
    };
    let mut plan = DecodePlan::dense(&stream, shape, PlanOptions::default()).unwrap();
    let args = DenseArgs {
        q: Query::contiguous(&q, heads),
        kv_cache: KvCache::contiguous(&cache, KvFormat::Fp8DsMla, block_size).unwrap(),
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
    assert!(matches!(err, Err(Error::Unsupported(_))), "{err:?}");

    let per_tensor = stream
        .alloc_zeros::<u8>(4 * block_size * KvFormat::Fp8PerTensor.row_bytes())
        .unwrap();
    let scale = stream.clone_htod(&[0.5f32]).unwrap();
    let mut plan = DecodePlan::dense(
        &stream,
        DenseShape {
            kv_format: KvFormat::Fp8PerTensor,
            ..shape
        },
        PlanOptions::default(),
    )
    .unwrap();
    let kv = KvCache::contiguous(&per_tensor, KvFormat::Fp8PerTensor, block_size).unwrap();
    for (kv_cache, unsupported) in [(kv.clone(), false), (kv.with_scale(&scale), true)] {
        let err = dense_decode(
            &stream,
            &mut plan,
            &DenseArgs {
                kv_cache,
                ..args.clone()
            },
            &mut Output::contiguous(&mut out, heads),
            None,
            None,
        );
        if unsupported {
            assert!(matches!(err, Err(Error::Unsupported(_))), "{err:?}");
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
