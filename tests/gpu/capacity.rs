//! Preallocated maximum-size buffers, as engines and CUDA graphs keep them: every call with
//! buffers longer than its token count (the plan's for decode, `num_tokens` for append and
//! gather), without slicing. The rows past the count hold values that would show if a call
//! used them (lengths and ids the flag would record, valid slots whose rows the call would
//! write), and the outputs' rows past it hold poison that must survive.

use std::sync::Arc;

use mla_decode::cudarc::driver::CudaStream;
use mla_decode::half::{bf16, f16};
use mla_decode::{DType, Element, ErrorFlag, PlanOptions, HEAD_DIM, LATENT_DIM};

use crate::cache_ops::check_append;
use crate::kit::*;

/// Rows every buffer holds past the call's count.
const TAIL: usize = 5;

/// Decodes `p` (its device buffers `dev`, which may be longer than it needs) with q, out and
/// lse preallocated for `TAIL` more query rows (q's extra rows NaN, out's and lse's poison),
/// then checks the flag and the outputs against the reference, and that out and lse past
/// the plan's rows still hold the poison.
fn check_preallocated<P: Problem>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    p: &P,
    dev: &P::Dev,
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
    let want = p.reference_of(&q, &all);
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
    check_preallocated(label, rng, stream, &s, &dev);
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
    check_preallocated(label, rng, stream, &s, &dev);
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
