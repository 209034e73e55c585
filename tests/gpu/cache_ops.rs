//! The cache operations against the reference: `append_kv` (rows through a slot mapping
//! with -1 padding and bad slots, compared bitwise over the whole padded cache) and
//! `gather_slots` (positions to slot ids, exact, with bad req ids and block ids).

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::half::{bf16, f16};
use mla_decode::reference::{fault_code, Fault};
use mla_decode::{
    append_kv, append_kv_split, AppendArgs, AppendSplitArgs, CacheLayout, DType, ErrorFlag,
    KvCacheMut, KvFormat, ScaleRule, BLOCK_SIZES, HEAD_DIM, LATENT_DIM, ROPE_DIM,
};

use crate::kit::*;

// ---------------------------------------------------------------------------------------------
// Append

/// Appends `n` random rows (token stride > 576, about a fifth of the slots -1) into a padded
/// cache and compares the whole cache buffer bitwise with the expected one; then a mapping
/// with bad slots: only the good rows are written, and the flag records a BadAppendSlot.
///
/// With `tail > 0` the kv and slot_mapping buffers are preallocated `tail` rows longer than
/// each call's `num_tokens`, the extra rows holding valid slots of random rows: appending
/// any of them would change the cache.
pub(crate) fn check_append<T: Half>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    num_blocks: usize,
    block_size: usize,
    n: usize,
    tail: usize,
) {
    let pad = 8 * rng.below(3);
    let mut host = HostCache::<T>::random(rng, num_blocks, block_size, pad);
    let mut dev = host.upload(stream);
    let slots_total = host.num_slots();
    let mut flag = ErrorFlag::new(stream).unwrap();

    let layout = host.layout();
    let random_rows = |rng: &mut Rng, n: usize, stride: usize| {
        let mut kv = vec![T::nan(); (n - 1) * stride + HEAD_DIM];
        for i in 0..n {
            for v in &mut kv[i * stride..i * stride + HEAD_DIM] {
                *v = T::from_f64(rng.unit());
            }
        }
        kv
    };
    // Appends the rows of `kv` through `slots` (`num_tokens` = `slots.len()`), from buffers
    // `tail` rows longer.
    let append = |rng: &mut Rng,
                  (kv, stride): (&[T], usize),
                  slots: &[i64],
                  dev: &mut CudaSlice<T>,
                  flag: &mut ErrorFlag| {
        let mut kv_buf = kv.to_vec();
        let mut slots_buf = slots.to_vec();
        if tail > 0 {
            kv_buf.resize((slots.len() + tail) * stride, T::nan());
            let junk = random_rows(rng, tail, stride);
            kv_buf[slots.len() * stride..][..junk.len()].copy_from_slice(&junk);
            slots_buf.extend(rng.sample(slots_total, tail).into_iter().map(|s| s as i64));
        }
        let kv_dev = stream.clone_htod(&kv_buf).unwrap();
        let slots_dev = stream.clone_htod(&slots_buf).unwrap();
        let mut cache = if pad == 0 {
            KvCacheMut::contiguous(dev, T::DTYPE.kv_format(), block_size).unwrap()
        } else {
            KvCacheMut::new(dev, layout)
        };
        let args = AppendArgs {
            kv: &kv_dev,
            kv_token_stride: stride,
            slot_mapping: &slots_dev,
            num_tokens: slots.len(),
            scale_rule: None,
        };
        append_kv(stream, &args, &mut cache, Some(flag)).unwrap();
    };

    let stride = HEAD_DIM + 8 * rng.below(4);
    let kv = random_rows(rng, n, stride);
    let slots: Vec<i64> = rng
        .sample(slots_total, n)
        .into_iter()
        .map(|s| if rng.below(5) == 0 { -1 } else { s as i64 })
        .collect();
    append(rng, (&kv, stride), &slots, &mut dev, &mut flag);
    let mut expected = host.clone();
    for (i, &slot) in slots.iter().enumerate() {
        if slot >= 0 {
            expected
                .row_mut(slot as usize)
                .copy_from_slice(&kv[i * stride..i * stride + HEAD_DIM]);
        }
    }
    let words = flag.read(stream).unwrap();
    check_flag(label, words, &[]);
    compare_cache(label, &stream.clone_dtoh(&dev).unwrap(), &expected);
    host = expected;

    // Bad slots: past the end, negative (not -1), and one whose low 32 bits are 0.
    let good = rng.sample(slots_total, 2);
    let slots = [
        good[0] as i64,
        slots_total as i64,
        -7,
        1i64 << 40,
        -1,
        good[1] as i64,
    ];
    let kv = random_rows(rng, slots.len(), HEAD_DIM);
    append(rng, (&kv, HEAD_DIM), &slots, &mut dev, &mut flag);
    for (i, &slot) in slots.iter().enumerate() {
        if slot == good[0] as i64 || slot == good[1] as i64 {
            host.row_mut(slot as usize)
                .copy_from_slice(&kv[i * HEAD_DIM..(i + 1) * HEAD_DIM]);
        }
    }
    let faults: Vec<Fault> = [(1, slots_total as i64), (2, -7), (3, 1i64 << 40)]
        .iter()
        .map(|&(row, value)| Fault {
            code: fault_code::BAD_APPEND_SLOT,
            row,
            value,
        })
        .collect();
    let words = flag.read(stream).unwrap();
    check_flag(&format!("{label}, bad slots"), words, &faults);
    compare_cache(
        &format!("{label}, bad slots"),
        &stream.clone_dtoh(&dev).unwrap(),
        &host,
    );
}

fn compare_cache<T: Half>(label: &str, got: &[T], want: &HostCache<T>) {
    assert_eq!(got.len(), want.data.len(), "{label}: cache length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].bits() != want.data[i].bits()) {
        let (block, within) = (i / want.stride, i % want.stride);
        panic!(
            "{label}: cache element {i} (block {block}, row {}, dim {}) is {:#06x}, want {:#06x}",
            within / HEAD_DIM,
            within % HEAD_DIM,
            got[i].bits(),
            want.data[i].bits()
        );
    }
}

/// Thousands of rows through a slot mapping with -1 padding, every block size, both dtypes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn append_kv_random_rows() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("append_kv_random_rows");
    for (i, bs) in [16usize, 32, 64, 128].into_iter().enumerate() {
        let num_blocks = rng.range(40, 80);
        let n = rng.range(1, num_blocks * bs / 2);
        let label = format!("append bs {bs} blocks {num_blocks} rows {n}");
        let dtype = [DType::Bf16, DType::F16][i % 2];
        with_dtype!(dtype, T => check_append::<T>(&label, &mut rng, &stream, num_blocks, bs, n, 0));
    }
}

/// A few rows into a small cache, with bad slots: the memcheck/racecheck case of append.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_append_kv() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sanitize_append_kv");
    check_append::<bf16>("sanitize append bf16", &mut rng, &stream, 4, 16, 20, 0);
    check_append::<f16>("sanitize append f16", &mut rng, &stream, 3, 32, 9, 0);
}

/// `append_kv_split` writes the same bytes as `append_kv` of the concatenated rows in every
/// cache format (16-bit caches of the rows' dtype, fp8_ds_mla with both scale rules,
/// per-tensor fp8), from separate tensors with their own strides and from views into one
/// `[n, 576]` tensor (vLLM's `kv_c` / `k_pe` slices), for one row and for many.
#[test]
#[ignore = "needs a CUDA GPU"]
fn append_kv_split_matches_packed() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("append_kv_split_matches_packed");
    let kinds = [
        (KvFormat::Bf16, None, DType::Bf16),
        (KvFormat::F16, None, DType::F16),
        (KvFormat::Fp8DsMla, Some(ScaleRule::Raw), DType::Bf16),
        (KvFormat::Fp8DsMla, Some(ScaleRule::Pow2), DType::F16),
        (KvFormat::Fp8DsMla, Some(ScaleRule::Raw), DType::F16),
        (KvFormat::Fp8PerTensor, None, DType::Bf16),
        (KvFormat::Fp8PerTensor, None, DType::F16),
    ];
    for (format, rule, dtype) in kinds {
        for n in [1, rng.range(2, 300)] {
            for views in [false, true] {
                let label = format!("split append {format} {rule:?} {dtype} n {n} views {views}");
                with_dtype!(dtype, T => check_split::<T>(&label, &mut rng, &stream, format, rule, n, views));
            }
        }
    }
}

fn check_split<T: Half>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    format: KvFormat,
    rule: Option<ScaleRule>,
    n: usize,
    views: bool,
) {
    let block_size = rng.pick(&BLOCK_SIZES);
    let num_blocks = rng.range(2, 12).max(n.div_ceil(block_size) + 1);
    let layout = CacheLayout {
        format,
        block_size,
        num_blocks,
        block_stride_bytes: block_size * format.row_bytes() + 16 * rng.below(2),
    };
    let init: Vec<u8> = (0..num_blocks * layout.block_stride_bytes)
        .map(|_| rng.below(256) as u8)
        .collect();
    let (mut packed_cache, mut split_cache) = (
        stream.clone_htod(&init).unwrap(),
        stream.clone_htod(&init).unwrap(),
    );
    let scale = stream.clone_htod(&[0.0123f32]).unwrap();
    let stride = HEAD_DIM + 8 * rng.below(3);
    let mut kv = vec![T::nan(); (n - 1) * stride + HEAD_DIM];
    for i in 0..n {
        let mag = 2f64.powi(rng.range(0, 12) as i32 - 6);
        for v in &mut kv[i * stride..][..HEAD_DIM] {
            *v = T::from_f64((2.0 * rng.unit() - 1.0) * mag);
        }
    }
    let slots: Vec<i64> = rng
        .sample(num_blocks * block_size, n)
        .into_iter()
        .map(|s| {
            if n > 1 && rng.below(7) == 0 {
                -1
            } else {
                s as i64
            }
        })
        .collect();
    let slots_dev = stream.clone_htod(&slots).unwrap();
    let kv_dev = stream.clone_htod(&kv).unwrap();
    let mut flag = ErrorFlag::new(stream).unwrap();
    let cache_of = |c| {
        let kc = KvCacheMut::new(c, layout);
        if format == KvFormat::Fp8PerTensor {
            kc.with_scale(&scale)
        } else {
            kc
        }
    };
    let packed = AppendArgs {
        kv: &kv_dev,
        kv_token_stride: stride,
        slot_mapping: &slots_dev,
        num_tokens: n,
        scale_rule: rule,
    };
    append_kv(
        stream,
        &packed,
        &mut cache_of(&mut packed_cache),
        Some(&mut flag),
    )
    .unwrap();

    // the two parts: views into the packed rows, or copies with strides of their own
    let (ns, rs) = (LATENT_DIM + 8 * rng.below(3), ROPE_DIM + 8 * rng.below(3));
    let mut nope = vec![T::nan(); (n - 1) * ns + LATENT_DIM];
    let mut rope = vec![T::nan(); (n - 1) * rs + ROPE_DIM];
    for i in 0..n {
        nope[i * ns..][..LATENT_DIM].copy_from_slice(&kv[i * stride..][..LATENT_DIM]);
        rope[i * rs..][..ROPE_DIM].copy_from_slice(&kv[i * stride + LATENT_DIM..][..ROPE_DIM]);
    }
    let (nope_dev, rope_dev) = (
        stream.clone_htod(&nope).unwrap(),
        stream.clone_htod(&rope).unwrap(),
    );
    let rope_view = kv_dev.slice(LATENT_DIM..);
    let split = if views {
        AppendSplitArgs {
            kv_nope: &kv_dev,
            kv_nope_token_stride: stride,
            kv_rope: &rope_view,
            kv_rope_token_stride: stride,
            slot_mapping: &slots_dev,
            num_tokens: n,
            scale_rule: rule,
        }
    } else {
        AppendSplitArgs {
            kv_nope: &nope_dev,
            kv_nope_token_stride: ns,
            kv_rope: &rope_dev,
            kv_rope_token_stride: rs,
            slot_mapping: &slots_dev,
            num_tokens: n,
            scale_rule: rule,
        }
    };
    append_kv_split(
        stream,
        &split,
        &mut cache_of(&mut split_cache),
        Some(&mut flag),
    )
    .unwrap();
    check_flag(label, flag.read(stream).unwrap(), &[]);
    let (want, got) = (
        stream.clone_dtoh(&packed_cache).unwrap(),
        stream.clone_dtoh(&split_cache).unwrap(),
    );
    assert_ne!(want, init, "{label}: the packed append wrote nothing");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let (blk, within) = (i / layout.block_stride_bytes, i % layout.block_stride_bytes);
        panic!(
            "{label}: cache byte {i} (block {blk}, row {}, byte {}) is {:#04x}, the packed append's {:#04x}",
            within / format.row_bytes(),
            within % format.row_bytes(),
            got[i],
            want[i]
        );
    }
}

/// The split append on a small cache: the memcheck/racecheck case.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_append_kv_split() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sanitize_append_kv_split");
    check_split::<bf16>(
        "sanitize split bf16",
        &mut rng,
        &stream,
        KvFormat::Bf16,
        None,
        9,
        false,
    );
    let ds = (KvFormat::Fp8DsMla, Some(ScaleRule::Raw));
    check_split::<f16>(
        "sanitize split ds_mla",
        &mut rng,
        &stream,
        ds.0,
        ds.1,
        5,
        true,
    );
}

// ---------------------------------------------------------------------------------------------
// Gather

/// Gathers of up to 4096 positions per token, every block size, compared exactly with the
/// reference (clean inputs: flag clear; then bad req ids and block ids: flag set).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gather_slots_matches_reference() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("gather_slots_matches_reference");
    for (topk, bs) in [(2048, 64), (1000, 16), (4096, 128), (37, 32), (1, 16)] {
        for faults in [false, true] {
            let batch = rng.range(1, 12);
            let tokens = rng.range(1, 96);
            let g = random_gather(&mut rng, batch, tokens, topk, bs, faults);
            let label = format!("gather topk {topk} bs {bs} tokens {tokens} faults {faults}");
            let (got, flag) = run_gather(&stream, &g);
            let found = check_gather(&label, &g, &got, flag);
            if !faults {
                assert!(
                    found.is_empty(),
                    "{label}: clean inputs gave faults {found:?}"
                );
            }
        }
    }
}

/// A small gather with a bad req id (whole row -1, BadReqId with the token and id) and a bad
/// block id (BadBlockId with the token and entry): the memcheck/racecheck case of the gather.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_gather_slots() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sanitize_gather_slots");
    let mut g = random_gather(&mut rng, 3, 6, 37, 16, false);
    let (got, flag) = run_gather(&stream, &g);
    let found = check_gather("sanitize gather clean", &g, &got, flag);
    assert!(found.is_empty(), "{found:?}");

    // Token 4 names request 9 of 3.
    g.req_id[4] = 9;
    let (got, flag) = run_gather(&stream, &g);
    let found = check_gather("sanitize gather bad req id", &g, &got, flag);
    assert_eq!(
        found,
        [Fault {
            code: fault_code::BAD_REQ_ID,
            row: 4,
            value: 9
        }]
    );
    check_flag_is(
        "sanitize gather bad req id",
        flag,
        fault_code::BAD_REQ_ID,
        4,
        9,
    );
    assert!(
        got[4 * g.out_stride..4 * g.out_stride + g.topk]
            .iter()
            .all(|&s| s == -1),
        "bad req id: row not all -1"
    );

    // Make token 1 use position 0 of its request, whose block-0 entry becomes bad.
    g.req_id[4] = 0;
    let r = g.req_id[1] as usize;
    g.seq_lens[r] = g.seq_lens[r].max(1);
    g.positions[g.pos_stride] = 0;
    let bad = g.num_blocks as i32 + 3;
    g.table[r * g.table_stride] = bad;
    let (got, flag) = run_gather(&stream, &g);
    let found = check_gather("sanitize gather bad block", &g, &got, flag);
    assert!(found
        .iter()
        .all(|f| f.code == fault_code::BAD_BLOCK_ID && f.value == bad as i64));
    assert!(found.iter().any(|f| f.row == 1));
}
