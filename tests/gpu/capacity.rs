//! Preallocated maximum-size buffers, as engines and CUDA graphs keep them: every call with
//! buffers longer than its token count (the plan's for decode, `num_tokens` for append and
//! gather), without slicing. The rows past the count hold values that would show if a call
//! used them (lengths and ids the flag would record, valid slots whose rows the call would
//! write), and the outputs' rows past it hold poison that must survive. And large caches:
//! decode of rows past 4 GiB into the cache buffer.

use std::sync::Arc;

use mla_decode::cudarc::driver::CudaStream;
use mla_decode::half::{bf16, f16};
use mla_decode::{CacheLayout, DType, Element, ErrorFlag, PlanOptions, HEAD_DIM, LATENT_DIM};

use crate::cache_ops::check_append;
use crate::kit::*;

/// Rows every buffer holds past the call's count.
const TAIL: usize = 5;

/// Decodes `p` (its device buffers `dev`, which may be longer than it needs) with q, out and
/// lse preallocated for `TAIL` more query rows (q's extra rows NaN, out's and lse's poison),
/// then checks the flag and the outputs against the reference of `want_of` (`p` itself, or
/// the same problem laid out otherwise), and that out and lse past the plan's rows still
/// hold the poison.
fn check_preallocated<P: Problem>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    p: &P,
    dev: &P::Dev,
    want_of: &P,
) {
    let (rows, heads) = (p.rows(), p.heads());
    let kind = QKind::random(rng);
    let mut q = HostQuery::<P::Elem>::random(rng, kind, rows, heads);
    for buf in &mut q.bufs {
        buf.extend(vec![<P::Elem as Half>::nan(); TAIL * heads * HEAD_DIM]);
    }
    let qd = q.upload(stream);
    let max_rows = rows + TAIL;
    let out_layout = Strided::new(rng, RowsKind::Contiguous, rows, heads, LATENT_DIM, 8);
    let mut out = DevOut::new(
        stream,
        Strided {
            len: max_rows * heads * LATENT_DIM,
            ..out_layout
        },
    );
    let lse_layout = Strided::new(rng, RowsKind::Contiguous, rows, heads, 1, 1);
    let mut lse = DevLse::new(
        stream,
        Strided {
            len: max_rows * heads,
            ..lse_layout
        },
    );
    let mut flag = ErrorFlag::new(stream).unwrap();
    let mut plan = p.plan(stream, PlanOptions::default());
    assert_eq!(
        (plan.num_tokens(), plan.num_heads()),
        (rows, heads),
        "{label}: the plan's counts"
    );
    p.decode(
        stream,
        dev,
        &mut plan,
        &qd,
        &mut out,
        Some(&mut lse),
        Some(&mut flag),
    )
    .unwrap();
    let got = Outputs::read(stream, &out, Some(&lse), &flag);
    let all = all_heads(heads);
    let want = want_of.reference_of(&q, &all);
    let label = format!("{label} [{}; q {kind:?}]", <P::Elem as Element>::DTYPE);
    check_flag(&label, got.flag, &want.faults);
    check_outputs(&label, &got, &want, &all); // the rows past the plan's: still poison
}

/// Dense decode with every buffer preallocated for `TAIL` more requests: seq_lens past the
/// batch out of range (the flag would record them), block-table rows of bad block ids,
/// and q, out and lse rows for the extra requests' tokens.
fn check_dense_preallocated<T: Half>(label: &str, rng: &mut Rng, stream: &Arc<CudaStream>) {
    let (bs, mbps) = (32, 12);
    let spec = DenseSpec {
        q_len: rng.range(1, 4),
        heads: rng.pick(&[1, 8, 16]),
        block_size: bs,
        max_blocks_per_seq: mbps,
        table_pad: rng.below(3),
        block_pad: 8 * rng.below(2),
        spare_blocks: 2,
        junk_unused: true,
        seq_lens: (0..rng.range(1, 5))
            .map(|_| edge_len(rng, mbps * bs, bs) as i32)
            .collect(),
        scale: rng.softmax_scale(),
    };
    let s = DenseSetup::<T>::build(rng, &spec);
    let mut dev = s.upload(stream);
    let mut lens = s.seq_lens.clone();
    lens.extend([i32::MAX, -3, (mbps * bs) as i32 + 1, 100, 1]);
    assert_eq!(lens.len(), s.batch + TAIL);
    dev.seq_lens = stream.clone_htod(&lens).unwrap();
    let mut table = s.table.clone();
    for _ in 0..TAIL * s.table_stride {
        table.push(junk_block(rng, s.cache.num_blocks));
    }
    dev.table = stream.clone_htod(&table).unwrap();
    check_preallocated(label, rng, stream, &s, &dev, &s);
}

/// Sparse decode with every buffer preallocated for `TAIL` more tokens: index rows of bad
/// slot ids, topk_len values out of range, q, out and lse rows.
fn check_sparse_preallocated<T: Half>(label: &str, rng: &mut Rng, stream: &Arc<CudaStream>) {
    let style = RowStyle {
        hole: 0.1,
        bad: 0.0,
    };
    let tokens = rng.range(1, 40);
    let mut s = random_sparse::<T>(rng, tokens, 8, 300, 20, 64, style, true);
    // In-range topk_len for the plan's tokens: nothing to clamp there.
    s.topk_len = Some((0..tokens).map(|_| rng.below(301) as i32).collect());
    let mut dev = s.upload(stream);
    let slots = s.cache.num_slots();
    let mut indices = s.indices.clone();
    for _ in 0..TAIL * s.stride {
        indices.push(bad_slot(rng, slots));
    }
    dev.indices = stream.clone_htod(&indices).unwrap();
    let mut topk_len = s.topk_len.clone().unwrap();
    topk_len.extend([i32::MAX, -3, 301, 300, 0]);
    dev.topk_len = Some(stream.clone_htod(&topk_len).unwrap());
    check_preallocated(label, rng, stream, &s, &dev, &s);
}

/// Dense decode, both dtypes, random shapes, from buffers longer than the plan's counts.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_decode_with_preallocated_buffers() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("dense_decode_with_preallocated_buffers");
    for (i, dtype) in [DType::Bf16, DType::F16, DType::Bf16, DType::F16]
        .into_iter()
        .enumerate()
    {
        let label = format!("dense, preallocated {i}");
        with_dtype!(dtype, T => check_dense_preallocated::<T>(&label, &mut rng, &stream));
    }
}

/// Sparse decode, both dtypes, from buffers longer than the plan's counts.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_decode_with_preallocated_buffers() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sparse_decode_with_preallocated_buffers");
    for (i, dtype) in [DType::Bf16, DType::F16, DType::Bf16, DType::F16]
        .into_iter()
        .enumerate()
    {
        let label = format!("sparse, preallocated {i}");
        with_dtype!(dtype, T => check_sparse_preallocated::<T>(&label, &mut rng, &stream));
    }
}

/// Append with kv and slot_mapping `TAIL` rows longer than `num_tokens` (the extra slots
/// valid: appending them would change the cache, compared bitwise), and the gather with
/// positions, req_id and out `TAIL` tokens longer (the extra tokens valid: gathering them
/// would write the output's poisoned tail).
#[test]
#[ignore = "needs a CUDA GPU"]
fn append_and_gather_with_preallocated_buffers() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("append_and_gather_with_preallocated_buffers");
    check_append::<bf16>(
        "append bf16, preallocated",
        &mut rng,
        &stream,
        20,
        16,
        30,
        TAIL,
    );
    check_append::<f16>(
        "append f16, preallocated",
        &mut rng,
        &stream,
        6,
        64,
        1,
        TAIL,
    );
    for (topk, bs, tokens) in [(300, 32, 20), (1, 16, 1), (2048, 64, 7)] {
        let g = random_gather(&mut rng, 4, tokens, topk, bs, false);
        let label = format!("gather topk {topk} bs {bs} tokens {tokens}, preallocated");
        let (got, flag) = run_gather_with_tail(&stream, &g, TAIL);
        assert_eq!(got.len(), g.out_len() + TAIL * g.out_stride, "{label}");
        let found = check_gather(&label, &g, &got, flag);
        assert!(found.is_empty(), "{label}: clean inputs gave {found:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Caches past 4 GiB

/// `ids` with every id >= 0 moved up by `by` (saturating: an id past the cache stays past it;
/// -1 and the other negative ids stay).
fn shifted(ids: &[i32], by: usize) -> Vec<i32> {
    let by = i32::try_from(by).expect("a shift that fits an id");
    ids.iter()
        .map(|&e| if e >= 0 { e.saturating_add(by) } else { e })
        .collect()
}

/// The far twin of fp8 problem `near`: `inner` (near's problem with its ids moved `shift`
/// blocks on) over near's cache `shift` blocks further into the buffer, and its device buffers
/// (the cache's blocks past [`FAR_BYTES`], after [`upload_far`]'s NaN blocks).
fn far_fp8<P>(
    stream: &Arc<CudaStream>,
    near: &Fp8<P>,
    inner: P,
    shift: usize,
) -> (Fp8<P>, Fp8ProblemDev)
where
    Fp8<P>: Problem<Dev = Fp8ProblemDev>,
{
    let layout = near.fp8.layout;
    let far = Fp8 {
        inner,
        fp8: Fp8Cache {
            layout: CacheLayout {
                num_blocks: layout.num_blocks + shift,
                ..layout
            },
            ..near.fp8.clone()
        },
    };
    let mut dev = far.upload(stream); // (its cache bytes replaced:)
    dev.cache.bytes = upload_far(stream, &near.fp8.bytes, layout.block_stride_bytes, shift);
    (far, dev)
}

/// A dense problem whose blocks lie past 4 GiB into the cache (`kind`: quantized to it,
/// else 16-bit), against the reference of the same problem near the start; one run in two
/// of more than one request has a length out of range (which the fp8 tests elsewhere never
/// draw).
fn check_dense_far<T: Half>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    kind: Option<Fp8Kind>,
) {
    let (bs, mbps) = (rng.pick(&[16, 64]), 6);
    let mut spec = DenseSpec {
        q_len: rng.range(1, 3),
        heads: rng.pick(&[1, 8, 16]),
        block_size: bs,
        max_blocks_per_seq: mbps,
        table_pad: rng.below(3),
        block_pad: 8 * rng.below(2),
        spare_blocks: 2,
        junk_unused: true,
        seq_lens: (0..rng.range(1, 5))
            .map(|_| edge_len(rng, mbps * bs, bs) as i32)
            .collect(),
        scale: rng.softmax_scale(),
    };
    // Request 0 reads rows (else the case could read nothing past 4 GiB); one of the others,
    // if any, may have a length out of range: recorded, and clamped to 0 or to the table.
    let cap = (mbps * bs) as i32;
    spec.seq_lens[0] = rng.range(1, cap as usize) as i32;
    let n = spec.seq_lens.len();
    if n > 1 && rng.chance(0.5) {
        spec.seq_lens[rng.range(1, n - 1)] = rng.pick(&[-3, cap + 9, i32::MIN, i32::MAX]);
    }
    let near = DenseSetup::<T>::build(rng, &spec);
    let Some(kind) = kind else {
        let shift = far_shift(near.cache.stride_bytes());
        let mut far = near.clone();
        far.cache.num_blocks += shift;
        far.table = shifted(&near.table, shift);
        let mut dev = far.upload(stream); // (its cache replaced:)
        dev.cache = upload_far(stream, &near.cache.data, near.cache.stride, shift);
        return check_preallocated(label, rng, stream, &far, &dev, &near);
    };
    let near = Fp8::dense(rng, near, kind, 1.0);
    let shift = far_shift(near.fp8.layout.block_stride_bytes);
    let mut inner = near.inner.clone();
    inner.table = shifted(&inner.table, shift);
    let (far, dev) = far_fp8(stream, &near, inner, shift);
    check_preallocated(label, rng, stream, &far, &dev, &near);
}

/// [`check_dense_far`] for sparse decode: slot ids past 4 GiB into the cache.
fn check_sparse_far<T: Half>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    kind: Option<Fp8Kind>,
) {
    let style = RowStyle {
        hole: 0.1,
        bad: 0.0,
    };
    let (tokens, topk) = (rng.range(1, 20), rng.pick(&[1, 37, 300]));
    let (bs, heads) = (rng.pick(&[16, 64]), rng.pick(&[1, 8, 16]));
    let with_lens = rng.chance(0.5);
    let mut near = random_sparse::<T>(rng, tokens, heads, topk, 20, bs, style, with_lens);
    // Token 0 reads a row (else the case could read nothing past 4 GiB): its first entry valid
    // and inside its topk_len.
    near.indices[0] = rng.below(near.cache.num_slots()) as i32;
    if let Some(lens) = near.topk_len.as_mut() {
        lens[0] = lens[0].max(1);
    }
    let Some(kind) = kind else {
        let shift = far_shift(near.cache.stride_bytes());
        let mut far = near.clone();
        far.cache.num_blocks += shift;
        far.indices = shifted(&near.indices, shift * bs);
        let mut dev = far.upload(stream); // (its cache replaced:)
        dev.cache = upload_far(stream, &near.cache.data, near.cache.stride, shift);
        return check_preallocated(label, rng, stream, &far, &dev, &near);
    };
    let near = Fp8::sparse(rng, near, kind, 1.0);
    let shift = far_shift(near.fp8.layout.block_stride_bytes);
    let mut inner = near.inner.clone();
    inner.indices = shifted(&inner.indices, shift * bs);
    let (far, dev) = far_fp8(stream, &near, inner, shift);
    check_preallocated(label, rng, stream, &far, &dev, &near);
}

/// Dense and sparse decode over caches whose rows lie past 4 GiB (block ids and slot ids
/// whose byte offsets need 64 bits; the bytes before them NaN), in every format, against
/// the same problems near the start of the cache.
#[test]
#[ignore = "needs a CUDA GPU (and 5 GB of its memory)"]
fn decode_cache_rows_past_4_gib() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("decode_cache_rows_past_4_gib");
    let kinds = std::iter::once(None).chain(FP8_KINDS.map(Some));
    for (i, kind) in kinds.enumerate() {
        let dtype = rng.pick(&[DType::Bf16, DType::F16]);
        let what = kind.map_or("16-bit".to_string(), |k| format!("{k:?}"));
        let label = format!("dense past 4 GiB {i}, {what}");
        with_dtype!(dtype, T => check_dense_far::<T>(&label, &mut rng, &stream, kind));
        let label = format!("sparse past 4 GiB {i}, {what}");
        with_dtype!(dtype, T => check_sparse_far::<T>(&label, &mut rng, &stream, kind));
    }
}
