//! GPU tests of sparse (DSA top-k) decode and the index gather against the f64 reference.
//!
//! Every test is `#[ignore]`d (CPU runs list it as ignored); the device runs them with
//! `cargo test --release --test gpu_sparse -- --include-ignored --test-threads=1`. Tests whose
//! name contains `sanitize_` are small and are the ones compute-sanitizer runs.
//!
//! Data are fresh random values each run: proptest cases print their value (which holds the
//! data seed) on failure, the other tests print their seed (`MLA_TEST_SEED` replays one).

mod common;

use std::sync::Arc;

use common::*;
use mla_decode::cudarc::driver::CudaStream;
use mla_decode::half::{bf16, f16};
use mla_decode::reference::{self, fault_code, Fault, GatherProblem};
use mla_decode::{
    gather_slots, sparse_decode, BlockTable, DecodePlan, ErrorFlag, PlanOptions, SparseIndices,
    SparseShape,
};
use proptest::prelude::{any, prop, Just, Strategy};
use proptest::prop_oneof;

fn default_plan() -> PlanOptions {
    PlanOptions::default()
}

/// A bad sparse id: not -1 and outside `[0, num_slots)`.
fn bad_slot(rng: &mut Rng, num_slots: usize) -> i32 {
    rng.pick(&[
        num_slots as i32,
        num_slots as i32 + 12_345,
        i32::MAX,
        -2,
        -1000,
        i32::MIN,
    ])
}

/// How the entries of one index row are drawn.
#[derive(Clone, Copy, Debug)]
struct RowStyle {
    /// Probability that an entry is a -1 hole.
    hole: f64,
    /// Probability that the row gets one bad id.
    bad: f64,
}

/// One row of `topk` ids over `num_slots` slots: all -1, a few slots duplicated many times, a
/// run of consecutive slots, distinct slots, or uniform with repeats; then holes and maybe
/// one bad id.
fn index_row(rng: &mut Rng, num_slots: usize, topk: usize, style: RowStyle) -> Vec<i32> {
    let mut row: Vec<i32> = match rng.below(10) {
        0 => vec![-1; topk],
        1 => {
            let pool: Vec<i32> = (0..rng.range(1, 4))
                .map(|_| rng.below(num_slots) as i32)
                .collect();
            (0..topk).map(|_| rng.pick(&pool)).collect()
        }
        2 => {
            let start = rng.below(num_slots);
            (0..topk)
                .map(|k| ((start + k) % num_slots) as i32)
                .collect()
        }
        3 if topk <= num_slots => rng
            .distinct(num_slots, topk)
            .into_iter()
            .map(|s| s as i32)
            .collect(),
        _ => (0..topk).map(|_| rng.below(num_slots) as i32).collect(),
    };
    for id in row.iter_mut() {
        if rng.chance(style.hole) {
            *id = -1;
        }
    }
    if rng.chance(style.bad) {
        let k = rng.below(topk);
        row[k] = bad_slot(rng, num_slots);
    }
    row
}

/// A topk_len value: 0, topk, above topk, negative, or in between.
fn topk_len_value(rng: &mut Rng, topk: usize) -> i32 {
    match rng.below(7) {
        0 => 0,
        1 => topk as i32,
        2 => topk as i32 + rng.range(1, 1000) as i32,
        3 => -(rng.range(1, 5) as i32),
        4 => i32::MAX,
        _ => rng.range(0, topk) as i32,
    }
}

/// Indices `[tokens, stride]` (junk in the row padding) from `rows`.
fn pack_rows(rng: &mut Rng, rows: &[Vec<i32>], stride: usize, num_slots: usize) -> Vec<i32> {
    let mut v = Vec::with_capacity(rows.len() * stride);
    for r in rows {
        v.extend_from_slice(r);
        for _ in r.len()..stride {
            v.push(bad_slot(rng, num_slots));
        }
    }
    v
}

/// Runs `s` with a random query layout and compares with the reference.
fn check_sparse<T: Half>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    s: &SparseSetup<T>,
    options: PlanOptions,
) {
    let kind = QKind::random(rng);
    let q = HostQuery::<T>::random(rng, kind, s.tokens, s.heads);
    let lse_kind = random_lse_kind(rng);
    let got = run_sparse(rng, stream, s, &q, lse_kind, options);
    let heads = all_heads(s.heads);
    let want = s.reference(&q, &heads);
    let label = format!(
        "{label} [{}; q {kind:?}, out {:?}, lse {lse_kind:?}, {} slots, topk_len {}]",
        T::DTYPE,
        got.out_layout.kind,
        s.cache.num_slots(),
        s.topk_len.is_some()
    );
    check_flag(&label, got.flag, &want.faults);
    check_outputs(&label, &got, &want, &heads);
}

/// A random sparse problem.
#[allow(clippy::too_many_arguments)]
fn random_sparse<T: Half>(
    rng: &mut Rng,
    tokens: usize,
    heads: usize,
    topk: usize,
    num_blocks: usize,
    block_size: usize,
    style: RowStyle,
    with_topk_len: bool,
) -> SparseSetup<T> {
    let pad = 8 * rng.below(4);
    let cache = HostCache::<T>::random(rng, num_blocks, block_size, pad);
    let slots = cache.num_slots();
    let rows: Vec<Vec<i32>> = (0..tokens)
        .map(|_| index_row(rng, slots, topk, style))
        .collect();
    let stride = if rng.chance(0.5) {
        topk
    } else {
        topk + rng.range(1, 9)
    };
    let indices = pack_rows(rng, &rows, stride, slots);
    let topk_len = with_topk_len.then(|| (0..tokens).map(|_| topk_len_value(rng, topk)).collect());
    SparseSetup {
        tokens,
        heads,
        topk,
        cache,
        indices,
        stride,
        topk_len,
        scale: rng.softmax_scale(),
    }
}

#[derive(Clone, Debug)]
struct SparseCase {
    bf16: bool,
    heads: usize,
    topk: usize,
    tokens: usize,
    block_size: usize,
    /// 0: a few blocks (many repeats), 1: hundreds of blocks, 2: >= 65,536 slots.
    cache_size: u8,
    sm120_occupancy: bool,
    seed: u64,
}

fn sparse_cases() -> impl Strategy<Value = SparseCase> {
    (
        any::<bool>(),
        prop_oneof![1 => Just(1usize), 1 => Just(8usize), 1 => Just(128usize), 3 => 1..=128usize],
        prop_oneof![
            1 => Just(2048usize),
            1 => Just(100usize),
            1 => Just(1000usize),
            1 => Just(1usize),
            1 => Just(4096usize),
            4 => 1..=4096usize
        ],
        prop_oneof![1 => Just(300usize), 3 => 1..=300usize],
        prop::sample::select(vec![16usize, 32, 64, 128]),
        0..3u8,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(bf16, heads, topk, tokens, block_size, cache_size, sm120_occupancy, seed)| {
                SparseCase {
                    bf16,
                    heads,
                    topk,
                    tokens,
                    block_size,
                    cache_size,
                    sm120_occupancy,
                    seed,
                }
            },
        )
}

/// Tokens (scaled down to the work budget), cache blocks, row style and whether topk_len is
/// given, for a random case.
fn sparse_case_params(c: &SparseCase, rng: &mut Rng) -> (usize, usize, RowStyle, bool) {
    // `+ 4`: repacking a token's rows for the reference costs about four heads.
    let tokens = c
        .tokens
        .min((WORK_BUDGET / ((c.heads + 4) * c.topk)).max(1));
    let num_blocks = match c.cache_size {
        0 => rng.range(1, 8),
        1 => rng.range(8, 400),
        _ => 65_536 / c.block_size + rng.below(16),
    };
    let style = RowStyle {
        hole: rng.pick(&[0.0, 0.05, 0.5]),
        bad: if rng.chance(0.15) { 0.3 } else { 0.0 },
    };
    (tokens, num_blocks, style, rng.chance(0.4))
}

/// Random shapes across the scope: dtype, 1..=128 heads, topk 1..=4096 (2048, 100, 1000
/// often), 1..=300 tokens (scaled down to a work budget for the reference), caches from a few
/// blocks to >= 65,536 slots with padded strides, duplicates, holes, whole -1 rows, optional
/// topk_len (0, > topk, negative), occasional bad ids, junk in the index row padding, every
/// query/out/lse layout, both occupancy modes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_random_shapes() {
    let (_ctx, stream) = gpu();
    run_cases("sparse_random_shapes", 16, sparse_cases(), |c| {
        let mut rng = Rng::new(c.seed);
        let (tokens, num_blocks, style, with_len) = sparse_case_params(c, &mut rng);
        let bs = c.block_size;
        let options = PlanOptions {
            sm120_occupancy: c.sm120_occupancy,
            ..PlanOptions::default()
        };
        let label = format!("sparse_random_shapes {c:?} (tokens used {tokens})");
        if c.bf16 {
            let s = random_sparse::<bf16>(
                &mut rng, tokens, c.heads, c.topk, num_blocks, bs, style, with_len,
            );
            check_sparse(&label, &mut rng, &stream, &s, options);
        } else {
            let s = random_sparse::<f16>(
                &mut rng, tokens, c.heads, c.topk, num_blocks, bs, style, with_len,
            );
            check_sparse(&label, &mut rng, &stream, &s, options);
        }
    });
}

/// topk at and around the tile sizes and the limits: 1, 2, 63, 64, 65, 100, 127, 1000, 2047,
/// 2048, 2049, 4095, 4096.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_topk_edges() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sparse_topk_edges"));
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    for (i, topk) in [
        1usize, 2, 63, 64, 65, 100, 127, 1000, 2047, 2048, 2049, 4095, 4096,
    ]
    .into_iter()
    .enumerate()
    {
        let tokens = rng.range(1, (20_000 / topk).clamp(1, 24));
        let heads = rng.range(1, 16);
        let bs = rng.pick(&[16usize, 32, 64, 128]);
        let num_blocks = rng.range(4, 300);
        let with_len = i % 3 == 0;
        let label = format!("sparse topk {topk} tokens {tokens} heads {heads}");
        if i % 2 == 0 {
            let s = random_sparse::<bf16>(
                &mut rng, tokens, heads, topk, num_blocks, bs, style, with_len,
            );
            check_sparse(&label, &mut rng, &stream, &s, default_plan());
        } else {
            let s = random_sparse::<f16>(
                &mut rng, tokens, heads, topk, num_blocks, bs, style, with_len,
            );
            check_sparse(&label, &mut rng, &stream, &s, default_plan());
        }
    }
}

/// 48 tokens × 2048 distinct slots drawn from a cache of >= 65,536 slots with padded blocks
/// (ids split by the kernel into block and offset), 16 heads.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_spread_over_65536_slots() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sparse_spread_over_65536_slots"));
    for bs in [16usize, 128] {
        let cache = HostCache::<bf16>::random(&mut rng, 65_536 / bs + 7, bs, 8);
        let slots = cache.num_slots();
        let (tokens, topk) = (48, 2048);
        let rows: Vec<Vec<i32>> = (0..tokens)
            .map(|_| {
                rng.distinct(slots, topk)
                    .into_iter()
                    .map(|s| s as i32)
                    .collect()
            })
            .collect();
        let s = SparseSetup {
            tokens,
            heads: 16,
            topk,
            indices: pack_rows(&mut rng, &rows, topk, slots),
            stride: topk,
            cache,
            topk_len: None,
            scale: 1.0 / 16.0,
        };
        check_sparse(
            &format!("sparse spread bs {bs}"),
            &mut rng,
            &stream,
            &s,
            default_plan(),
        );
    }
}

/// Same inputs and plan twice, and a second plan made the same way: bitwise the same output.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_deterministic_bitwise() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sparse_deterministic_bitwise"));
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    let s = random_sparse::<bf16>(&mut rng, 64, 16, 2048, 1100, 64, style, true);
    let q = HostQuery::<bf16>::random(&mut rng, QKind::Contiguous, s.tokens, s.heads);
    let dev = SparseDev::upload(&stream, &s);
    let qd = q.upload(&stream);
    let flag = ErrorFlag::new(&stream).unwrap();
    let mut out = DevOut::random(&mut rng, &stream, s.tokens, s.heads);
    let mut lse = DevLse::random(&mut rng, &stream, s.tokens, s.heads);
    let mut plan = dev.plan(&stream, &s, default_plan());
    let mut runs = Vec::new();
    for fresh_plan in [false, false, true] {
        if fresh_plan {
            plan = dev.plan(&stream, &s, default_plan());
        }
        out.poison(&stream);
        lse.poison(&stream);
        dev.decode(
            &stream,
            &s,
            &plan,
            &qd,
            &mut out,
            Some(&mut lse),
            Some(&flag),
        )
        .unwrap();
        runs.push(Outputs::read(&stream, &out, Some(&lse), &flag));
    }
    let heads = all_heads(s.heads);
    let want = s.reference(&q, &heads);
    check_flag("sparse determinism", runs[0].flag, &want.faults);
    check_outputs("sparse determinism", &runs[0], &want, &heads);
    let bits0 = runs[0].logical_bits();
    assert!(
        runs[1].logical_bits() == bits0,
        "same inputs and plan: out/lse differ bitwise"
    );
    assert!(
        runs[2].logical_bits() == bits0,
        "same inputs, a second plan of the same shape: out/lse differ bitwise"
    );
}

// ---------------------------------------------------------------------------------------------
// Sparse over every slot equals dense

/// Dense decode of random requests (q_len 1..=3, causal) and sparse decode whose row (b, i)
/// lists the slots of positions `0..visible(b, i)` in position order (padded with -1, or cut by
/// topk_len with valid junk after it), run on the same device cache and query: the two device
/// outputs agree, and each matches the reference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_equals_dense_on_every_slot() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sparse_equals_dense_on_every_slot"));
    for (round, bf) in [(0, true), (1, false), (2, true)] {
        let label = format!("sparse == dense round {round}");
        if bf {
            sparse_vs_dense::<bf16>(&label, &mut rng, &stream);
        } else {
            sparse_vs_dense::<f16>(&label, &mut rng, &stream);
        }
    }
}

fn sparse_vs_dense<T: Half>(label: &str, rng: &mut Rng, stream: &Arc<CudaStream>) {
    let bs = rng.pick(&[16usize, 32, 64, 128]);
    let q_len = rng.range(1, 3);
    let heads = rng.range(1, 16);
    let batch = 6;
    let max_len = 2500;
    let lens: Vec<i32> = (0..batch)
        .map(|_| match rng.below(5) {
            0 => rng.range(0, 2) as i32,
            1 => max_len as i32,
            _ => rng.range(0, max_len) as i32,
        })
        .collect();
    let spec = DenseSpec {
        q_len,
        heads,
        block_size: bs,
        max_blocks_per_seq: max_len.div_ceil(bs) + 1,
        table_pad: rng.below(3),
        block_pad: 8 * rng.below(3),
        spare_blocks: rng.below(5),
        junk_unused: true,
        seq_lens: lens.clone(),
        scale: rng.softmax_scale(),
    };
    let d = DenseSetup::<T>::build(rng, &spec);
    let tokens = d.tokens();
    let slots = d.cache.num_slots();

    // Row (b, i): the slots of positions 0..visible in position order.
    let mut rows = Vec::with_capacity(tokens);
    for (b, &len) in lens.iter().enumerate() {
        let len = len.max(0) as usize;
        for i in 0..q_len {
            let visible = (len + i + 1).saturating_sub(q_len);
            let row: Vec<i32> = (0..visible)
                .map(|p| d.table[b * d.table_stride + p / bs] * bs as i32 + (p % bs) as i32)
                .collect();
            rows.push(row);
        }
    }
    let topk = rows.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let use_len: Vec<bool> = (0..tokens).map(|_| rng.chance(0.5)).collect();
    let mut topk_len = Vec::with_capacity(tokens);
    for (row, &cut) in rows.iter_mut().zip(&use_len) {
        topk_len.push(if cut { row.len() as i32 } else { topk as i32 });
        while row.len() < topk {
            // Past topk_len: valid slots that must not count; else -1.
            row.push(if cut { rng.below(slots) as i32 } else { -1 });
        }
    }
    let stride = topk + rng.below(3);
    let s = SparseSetup {
        tokens,
        heads,
        topk,
        cache: d.cache.clone(),
        indices: pack_rows(rng, &rows, stride, slots),
        stride,
        topk_len: Some(topk_len),
        scale: d.scale,
    };

    let kind = QKind::random(rng);
    let q = HostQuery::<T>::random(rng, kind, tokens, heads);
    let dev = DenseDev::upload(stream, &d);
    let qd = q.upload(stream);
    let indices = stream.clone_htod(&s.indices).unwrap();
    let topk_len_dev = stream.clone_htod(s.topk_len.as_ref().unwrap()).unwrap();
    let flag = ErrorFlag::new(stream).unwrap();

    let dense_plan = DecodePlan::dense(stream, d.shape(), default_plan()).unwrap();
    let mut out_d = DevOut::random(rng, stream, tokens, heads);
    let mut lse_d = DevLse::random(rng, stream, tokens, heads);
    dev.decode(
        stream,
        &d,
        &dense_plan,
        &qd,
        &mut out_d,
        Some(&mut lse_d),
        Some(&flag),
    )
    .unwrap();
    let dense_got = Outputs::read(stream, &out_d, Some(&lse_d), &flag);

    let sparse_plan = DecodePlan::sparse(stream, s.shape(), default_plan()).unwrap();
    let mut out_s = DevOut::random(rng, stream, tokens, heads);
    let mut lse_s = DevLse::random(rng, stream, tokens, heads);
    {
        let mut lse_view = lse_s.view();
        sparse_decode(
            stream,
            &sparse_plan,
            &qd.view(),
            &d.cache.view(&dev.cache), // the dense call's cache buffer
            &s.indices_view(&indices),
            Some(&topk_len_dev.as_view()),
            &mut out_s.view(),
            Some(&mut lse_view),
            s.scale,
            Some(&flag),
        )
        .unwrap();
    }
    let sparse_got = Outputs::read(stream, &out_s, Some(&lse_s), &flag);

    let all = all_heads(heads);
    let want_dense = d.reference(&q, &all);
    let want_sparse = s.reference(&q, &all);
    let label = format!(
        "{label} [{}] seq_lens {lens:?} q_len {q_len} heads {heads}",
        T::DTYPE
    );
    assert!(want_dense.faults.is_empty() && want_sparse.faults.is_empty());
    check_flag(&label, sparse_got.flag, &[]);
    check_outputs(&format!("{label}: dense"), &dense_got, &want_dense, &all);
    check_outputs(&format!("{label}: sparse"), &sparse_got, &want_sparse, &all);
    check_close_runs(
        &format!("{label}: dense vs sparse"),
        &dense_got,
        &sparse_got,
    );
}

// ---------------------------------------------------------------------------------------------
// Inputs the host cannot check

/// A small random problem (split q, strided outputs, padded blocks, holes, topk_len), both
/// dtypes: the memcheck/racecheck case of sparse decode.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_sparse_small_random() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sanitize_sparse_small_random"));
    let style = RowStyle {
        hole: 0.1,
        bad: 0.0,
    };
    let s = random_sparse::<bf16>(&mut rng, 5, 3, 100, 8, 16, style, true);
    check_sparse(
        "sanitize sparse bf16",
        &mut rng,
        &stream,
        &s,
        default_plan(),
    );
    let s = random_sparse::<f16>(&mut rng, 7, 9, 70, 5, 32, style, false);
    check_sparse("sanitize sparse f16", &mut rng, &stream, &s, default_plan());
}

/// Ids >= num_slots and < -1 are skipped and recorded as BadSlotId with the token and id;
/// a bad id past a row's topk_len is neither used nor recorded.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_sparse_bad_slot_ids() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sanitize_sparse_bad_slot_ids"));
    let style = RowStyle {
        hole: 0.1,
        bad: 0.0,
    };
    let (tokens, heads, topk) = (4, 4, 70);
    let mut base = random_sparse::<bf16>(&mut rng, tokens, heads, topk, 8, 16, style, false);
    let slots = base.cache.num_slots() as i32;
    let st = base.stride;
    // Row 3 stops at 10 entries; entry 50 of it is bad but never used.
    base.topk_len = Some(vec![topk as i32, topk as i32, topk as i32, 10]);
    base.indices[3 * st + 50] = slots + 5;

    for (token, entry, id) in [(2usize, 5usize, slots), (1, 0, -2), (0, topk - 1, i32::MIN)] {
        let mut s = base.clone();
        s.indices[token * st + entry] = id;
        let label = format!("bad id {id} at token {token} entry {entry}");
        let kind = QKind::random(&mut rng);
        let q = HostQuery::<bf16>::random(&mut rng, kind, tokens, heads);
        let got = run_sparse(
            &mut rng,
            &stream,
            &s,
            &q,
            Some(RowsKind::Padded),
            default_plan(),
        );
        let all = all_heads(heads);
        let want = s.reference(&q, &all);
        assert_eq!(
            want.faults,
            [Fault {
                code: fault_code::BAD_SLOT_ID,
                row: token as u32,
                value: id
            }],
            "{label}"
        );
        check_flag_is(&label, got.flag, fault_code::BAD_SLOT_ID, token, id);
        check_outputs(&label, &got, &want, &all);
    }

    // Several bad ids at once: the flag holds one of them.
    let mut s = base.clone();
    for (t, e, id) in [
        (0, 3, slots + 1),
        (1, 69, i32::MAX),
        (2, 0, -3),
        (3, 9, -77),
    ] {
        s.indices[t * st + e] = id;
    }
    let q = HostQuery::<bf16>::random(&mut rng, QKind::SplitSeparate, tokens, heads);
    let got = run_sparse(&mut rng, &stream, &s, &q, None, default_plan());
    let all = all_heads(heads);
    let want = s.reference(&q, &all);
    assert_eq!(want.faults.len(), 4);
    check_flag("four bad ids", got.flag, &want.faults);
    check_outputs("four bad ids", &got, &want, &all);
}

/// Rows of one slot repeated, two slots alternating, a single id at either end of -1s, all
/// -1 (out 0, lse -inf), topk_len 0 and negative (empty), topk_len > topk, holes in every
/// other entry.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_sparse_holes_duplicates_and_empty_rows() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sanitize_sparse_holes_duplicates_and_empty_rows"));
    for bf in [true, false] {
        let topk = 300;
        let cache = HostCache::<f16>::random(&mut rng, 6, 32, 16);
        let n = cache.num_slots();
        let (a, b) = (rng.below(n) as i32, rng.below(n) as i32);
        let random_row =
            |rng: &mut Rng| -> Vec<i32> { (0..topk).map(|_| rng.below(n) as i32).collect() };
        let mut rows: Vec<(Vec<i32>, i32)> = vec![
            (vec![a; topk], topk as i32),
            (
                (0..topk).map(|k| if k % 2 == 0 { a } else { b }).collect(),
                topk as i32,
            ),
            (
                (0..topk)
                    .map(|k| if k == topk - 1 { b } else { -1 })
                    .collect(),
                topk as i32,
            ),
            (
                (0..topk).map(|k| if k == 0 { a } else { -1 }).collect(),
                topk as i32,
            ),
            (vec![-1; topk], topk as i32),
            (random_row(&mut rng), 0),
            (random_row(&mut rng), -4),
            (random_row(&mut rng), topk as i32 + 77),
            (random_row(&mut rng), 1),
        ];
        let mut holes = random_row(&mut rng);
        holes.iter_mut().step_by(2).for_each(|x| *x = -1);
        rows.push((holes, topk as i32));
        rng.shuffle(&mut rows);
        let tokens = rows.len();
        let ids: Vec<Vec<i32>> = rows.iter().map(|r| r.0.clone()).collect();
        let stride = topk + 4;
        let indices = pack_rows(&mut rng, &ids, stride, n);
        let topk_len = Some(rows.iter().map(|r| r.1).collect());
        let heads = 4;
        let scale = rng.softmax_scale();
        if bf {
            let cache = HostCache::<bf16> {
                data: cache
                    .data
                    .iter()
                    .map(|v| bf16::from_f64(v.to_f64()))
                    .collect(),
                num_blocks: cache.num_blocks,
                block_size: cache.block_size,
                stride: cache.stride,
            };
            let s = SparseSetup {
                tokens,
                heads,
                topk,
                cache,
                indices,
                stride,
                topk_len,
                scale,
            };
            check_sparse(
                "holes/duplicates bf16",
                &mut rng,
                &stream,
                &s,
                default_plan(),
            );
        } else {
            let s = SparseSetup {
                tokens,
                heads,
                topk,
                cache,
                indices,
                stride,
                topk_len,
                scale,
            };
            check_sparse(
                "holes/duplicates f16",
                &mut rng,
                &stream,
                &s,
                default_plan(),
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Gather

/// An index gather problem.
#[derive(Clone, Debug)]
struct GatherSetup {
    batch: usize,
    mbps: usize,
    table_stride: usize,
    block_size: usize,
    num_blocks: usize,
    /// `[batch, table_stride]`.
    table: Vec<i32>,
    seq_lens: Vec<i32>,
    tokens: usize,
    topk: usize,
    /// `[tokens, pos_stride]`.
    positions: Vec<i32>,
    pos_stride: usize,
    req_id: Vec<i32>,
    out_stride: usize,
}

const GATHER_POISON: i32 = -777_777;

impl GatherSetup {
    /// `reference::gather_slots` on the repacked inputs: `[tokens, topk]` slots and faults.
    fn reference(&self) -> (Vec<i32>, Vec<Fault>) {
        let positions = repack(&self.positions, self.tokens, self.pos_stride, self.topk);
        let table = repack(&self.table, self.batch, self.table_stride, self.mbps);
        reference::gather_slots(&GatherProblem {
            positions: &positions,
            num_tokens: self.tokens,
            topk: self.topk,
            req_id: &self.req_id,
            block_table: &table,
            max_blocks_per_seq: self.mbps,
            seq_lens: &self.seq_lens,
            batch: self.batch,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
        })
    }

    fn out_len(&self) -> usize {
        (self.tokens - 1) * self.out_stride + self.topk + 5
    }
}

/// Runs the gather on the device into a poisoned `[tokens, out_stride]` buffer; returns the
/// whole buffer and the flag.
fn run_gather(stream: &Arc<CudaStream>, g: &GatherSetup) -> (Vec<i32>, [u32; 4]) {
    let positions = stream.clone_htod(&g.positions).unwrap();
    let req = stream.clone_htod(&g.req_id).unwrap();
    let table = stream.clone_htod(&g.table).unwrap();
    let lens = stream.clone_htod(&g.seq_lens).unwrap();
    let mut out = stream
        .clone_htod(&vec![GATHER_POISON; g.out_len()])
        .unwrap();
    let flag = ErrorFlag::new(stream).unwrap();
    gather_slots(
        stream,
        &positions.as_view(),
        g.pos_stride,
        g.topk,
        &req.as_view(),
        &BlockTable::strided(table.as_view(), g.batch, g.mbps, g.table_stride),
        &lens.as_view(),
        g.num_blocks,
        g.block_size,
        &mut out.as_view_mut(),
        g.out_stride,
        Some(&flag),
    )
    .unwrap();
    (stream.clone_dtoh(&out).unwrap(), flag.read(stream).unwrap())
}

/// The device slots equal the reference's exactly, the padding keeps its poison, and the
/// flag holds one of the reference's faults (or none).
fn check_gather(label: &str, g: &GatherSetup, got: &[i32], flag: [u32; 4]) -> Vec<Fault> {
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
    check_flag(label, flag, &faults);
    faults
}

/// A random gather: `tokens` rows of `topk` positions over `batch` requests, positions valid,
/// negative, at or past seq_len; seq_lens including 0, negative and above the table
/// capacity (clamped silently); with `faults`, bad req ids and bad block ids in used columns.
fn random_gather(
    rng: &mut Rng,
    batch: usize,
    tokens: usize,
    topk: usize,
    block_size: usize,
    faults: bool,
) -> GatherSetup {
    let mbps = rng.range(1, 64);
    let cap = (mbps * block_size) as i32;
    let seq_lens: Vec<i32> = (0..batch)
        .map(|_| match rng.below(8) {
            0 => 0,
            1 => -(rng.range(1, 9) as i32),
            2 => cap + rng.range(1, 100) as i32,
            3 => cap,
            _ => rng.range(1, cap as usize) as i32,
        })
        .collect();
    let num_blocks = batch * mbps + rng.below(10);
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    rng.shuffle(&mut ids);
    let table_stride = mbps + rng.below(4);
    let mut table = vec![0i32; batch * table_stride];
    for b in 0..batch {
        for j in 0..table_stride {
            table[b * table_stride + j] = if j < mbps {
                ids[b * mbps + j]
            } else {
                junk_block(rng, num_blocks)
            };
        }
        if faults && rng.chance(0.3) {
            let j = rng.below(mbps);
            table[b * table_stride + j] = junk_block(rng, num_blocks);
        }
    }
    let req_id: Vec<i32> = (0..tokens)
        .map(|_| {
            if faults && rng.chance(0.1) {
                rng.pick(&[-1, batch as i32, i32::MAX, i32::MIN])
            } else {
                rng.below(batch) as i32
            }
        })
        .collect();
    let pos_stride = topk + rng.below(5);
    let mut positions = Vec::with_capacity(tokens * pos_stride);
    for &r in &req_id {
        let len = if (0..batch as i32).contains(&r) {
            seq_lens[r as usize].clamp(0, cap)
        } else {
            cap
        };
        for k in 0..pos_stride {
            positions.push(if k >= topk {
                i32::MIN // padding: never read
            } else {
                match rng.below(10) {
                    0 => -1,
                    1 => rng.pick(&[-2, i32::MIN, i32::MAX]),
                    2 => len + rng.below(50) as i32,
                    3 => len - 1,
                    _ => rng.below(len.max(1) as usize) as i32,
                }
            });
        }
    }
    GatherSetup {
        batch,
        mbps,
        table_stride,
        block_size,
        num_blocks,
        table,
        seq_lens,
        tokens,
        topk,
        positions,
        pos_stride,
        req_id,
        out_stride: topk + rng.below(4),
    }
}

/// Gathers of up to 4096 positions per token, every block size, compared exactly with the
/// reference (clean inputs: flag clear; then bad req ids and block ids: flag set).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gather_slots_matches_reference() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("gather_slots_matches_reference"));
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
    let mut rng = Rng::new(seed("sanitize_gather_slots"));
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
        .all(|f| f.code == fault_code::BAD_BLOCK_ID && f.value == bad));
    assert!(found.iter().any(|f| f.row == 1));
}

// ---------------------------------------------------------------------------------------------
// Gather feeding sparse decode: a GLM-5 step

/// A GLM-5 shaped step (TP8): 8 heads, topk 2048, softmax scale 1/16, blocks of 64 over a
/// cache of >= 65,536 slots; 32 requests of up to 8192 tokens, 1 or 2 query tokens each (MTP);
/// the indexer's positions (all of a short request, 2048 distinct of a long one, some -1 and
/// future positions) go through the gather into sparse decode, both on the device. The slots
/// match `reference::gather_slots` exactly and the output the reference over them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_glm5_gather_end_to_end() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sparse_glm5_gather_end_to_end"));
    glm5_step::<bf16>(&mut rng, &stream);
    glm5_step::<f16>(&mut rng, &stream);
}

fn glm5_step<T: Half>(rng: &mut Rng, stream: &Arc<CudaStream>) {
    let (bs, heads, topk, scale) = (64usize, 8usize, 2048usize, 1.0f32 / 16.0);
    let (batch, mbps) = (32usize, 8192 / 64);
    let lens: Vec<i32> = (0..batch)
        .map(|_| match rng.below(6) {
            0 => rng.range(1, topk) as i32,
            1 => topk as i32,
            2 => (mbps * bs) as i32,
            _ => rng.range(topk, mbps * bs) as i32,
        })
        .collect();
    let needed: usize = lens.iter().map(|&l| (l as usize).div_ceil(bs)).sum();
    let spec = DenseSpec {
        q_len: 1,
        heads,
        block_size: bs,
        max_blocks_per_seq: mbps,
        table_pad: 4,
        block_pad: 8,
        spare_blocks: (65_536 / bs + 16).saturating_sub(needed),
        junk_unused: true,
        seq_lens: lens.clone(),
        scale,
    };
    let d = DenseSetup::<T>::build(rng, &spec);
    assert!(d.cache.num_slots() >= 65_536);

    // The indexer's output: request-logical positions.
    let mut req_id = Vec::new();
    for b in 0..batch {
        for _ in 0..rng.range(1, 2) {
            req_id.push(b as i32);
        }
    }
    let tokens = req_id.len();
    let pos_stride = topk + 8;
    let mut positions = Vec::with_capacity(tokens * pos_stride);
    for &r in &req_id {
        let len = lens[r as usize] as usize;
        let mut row: Vec<i32> = if len <= topk {
            let mut all: Vec<i32> = (0..len as i32).collect();
            rng.shuffle(&mut all);
            all
        } else {
            rng.distinct(len, topk)
                .into_iter()
                .map(|p| p as i32)
                .collect()
        };
        while row.len() < topk {
            row.push(if rng.chance(0.5) {
                -1
            } else {
                (len + rng.below(64)) as i32
            });
        }
        for _ in 0..rng.below(4) {
            let k = rng.below(topk);
            row[k] = if rng.chance(0.5) { -1 } else { len as i32 };
        }
        positions.extend_from_slice(&row);
        positions.extend(std::iter::repeat_n(i32::MIN, pos_stride - topk));
    }
    let g = GatherSetup {
        batch,
        mbps,
        table_stride: d.table_stride,
        block_size: bs,
        num_blocks: d.cache.num_blocks,
        table: d.table.clone(),
        seq_lens: lens.clone(),
        tokens,
        topk,
        positions,
        pos_stride,
        req_id,
        out_stride: topk + 16,
    };
    let (want_slots, gather_faults) = g.reference();
    assert!(gather_faults.is_empty());

    let dev = DenseDev::upload(stream, &d);
    let positions_dev = stream.clone_htod(&g.positions).unwrap();
    let req_dev = stream.clone_htod(&g.req_id).unwrap();
    let mut slots_dev = stream
        .clone_htod(&vec![GATHER_POISON; g.out_len()])
        .unwrap();
    let flag = ErrorFlag::new(stream).unwrap();
    gather_slots(
        stream,
        &positions_dev.as_view(),
        g.pos_stride,
        topk,
        &req_dev.as_view(),
        &d.table_view(&dev.table),
        &dev.seq_lens.as_view(),
        d.cache.num_blocks,
        bs,
        &mut slots_dev.as_view_mut(),
        g.out_stride,
        Some(&flag),
    )
    .unwrap();

    let kind = QKind::random(rng);
    let q = HostQuery::<T>::random(rng, kind, tokens, heads);
    let qd = q.upload(stream);
    let plan = DecodePlan::sparse(
        stream,
        SparseShape {
            num_tokens: tokens,
            num_heads: heads,
            topk,
        },
        default_plan(),
    )
    .unwrap();
    let mut out = DevOut::random(rng, stream, tokens, heads);
    let mut lse = DevLse::random(rng, stream, tokens, heads);
    {
        let mut lse_view = lse.view();
        sparse_decode(
            stream,
            &plan,
            &qd.view(),
            &d.cache.view(&dev.cache),
            &SparseIndices::strided(slots_dev.as_view(), topk, g.out_stride),
            None,
            &mut out.view(),
            Some(&mut lse_view),
            scale,
            Some(&flag),
        )
        .unwrap();
    }
    let got = Outputs::read(stream, &out, Some(&lse), &flag);
    let label = format!("GLM-5 step [{}; q {kind:?}] seq_lens {lens:?}", T::DTYPE);
    let got_slots = stream.clone_dtoh(&slots_dev).unwrap();
    check_gather(&format!("{label}: gather"), &g, &got_slots, got.flag);

    let all = all_heads(heads);
    let want = sparse_reference(
        &SparseInputs {
            q: &q.values,
            num_tokens: tokens,
            num_heads: heads,
            cache: &d.cache,
            indices: &want_slots,
            indices_stride: topk,
            topk,
            topk_len: None,
            softmax_scale: scale as f64,
        },
        &all,
    );
    check_flag(&label, got.flag, &want.faults);
    check_outputs(&label, &got, &want, &all);
}

// ---------------------------------------------------------------------------------------------
// CPU checks of the test machinery (not ignored: they need no GPU)

/// `sparse_reference` (one token at a time over a compact cache, any head subset) equals
/// `reference::sparse_decode` over the whole cache with the indices repacked to stride topk:
/// padded blocks, holes, duplicates, bad ids, topk_len and row padding included.
#[test]
fn host_sparse_reference_repack_matches_full_reference() {
    let mut rng = Rng::new(seed("host_sparse_reference_repack_matches_full_reference"));
    for _ in 0..24 {
        let style = RowStyle {
            hole: rng.pick(&[0.0, 0.3]),
            bad: 0.3,
        };
        let (tokens, heads, topk) = (rng.range(1, 6), rng.range(1, 3), rng.range(1, 300));
        let bs = rng.pick(&[16usize, 32, 64, 128]);
        let with_len = rng.chance(0.5);
        let num_blocks = rng.range(1, 6);
        let s = random_sparse::<f16>(
            &mut rng, tokens, heads, topk, num_blocks, bs, style, with_len,
        );
        let q = HostQuery::<f16>::random(&mut rng, QKind::Contiguous, tokens, heads);
        let full_cache: Vec<f64> = (0..s.cache.num_slots())
            .flat_map(|slot| s.cache.row(slot).iter().map(|v| v.to_f64()))
            .collect();
        let indices = repack(&s.indices, tokens, s.stride, topk);
        let full = reference::sparse_decode(&reference::SparseProblem {
            q: &q.values,
            num_tokens: tokens,
            num_heads: heads,
            cache: reference::PagedCache {
                data: &full_cache,
                num_blocks: s.cache.num_blocks,
                block_size: bs,
            },
            indices: &indices,
            topk,
            topk_len: s.topk_len.as_deref(),
            softmax_scale: s.scale as f64,
        });
        assert_eq!(s.reference(&q, &all_heads(heads)), full);
        let h = heads - 1;
        let sub = s.reference(&q, &[h]);
        assert_eq!(sub.faults, full.faults);
        for t in 0..tokens {
            assert_eq!(sub.out_row(t, 0), full.out_row(t, h));
            assert_eq!(sub.lse_at(t, 0), full.lse_at(t, h));
        }
    }
}
