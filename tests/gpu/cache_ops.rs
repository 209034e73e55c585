//! The cache operations against the reference: `append_kv` (rows through a slot mapping
//! with -1 padding and bad slots, compared bitwise over the whole padded cache) and
//! `gather_slots` (positions to slot ids, exact, with bad req ids and block ids).

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::half::{bf16, f16};
use mla_decode::reference::{fault_code, Fault};
use mla_decode::{append_kv, AppendArgs, DType, ErrorFlag, KvCacheMut, HEAD_DIM};

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
