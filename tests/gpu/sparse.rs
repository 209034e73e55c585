//! Sparse (DSA top-k) decode against the f64 reference: random shapes across the scope, top-k
//! at the tile edges and limits, ids spread over a large cache, and the inputs the host
//! cannot check (bad ids, holes, duplicates, empty rows).

use std::sync::Arc;

use mla_decode::cudarc::driver::CudaStream;
use mla_decode::half::{bf16, f16};
use mla_decode::reference::{fault_code, Fault};
use mla_decode::DType;
use proptest::prelude::{any, prop, Just, Strategy};
use proptest::prop_oneof;

use crate::kit::*;

#[derive(Clone, Debug)]
struct SparseCase {
    dtype: DType,
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
        prop::sample::select(vec![DType::F16, DType::Bf16]),
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
            |(dtype, heads, topk, tokens, block_size, cache_size, sm120_occupancy, seed)| {
                SparseCase {
                    dtype,
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
        let options = plan_options(c.sm120_occupancy);
        let label = format!("sparse_random_shapes {c:?} (tokens used {tokens})");
        with_dtype!(c.dtype, T => {
            let mut s = random_sparse::<T>(
                &mut rng, tokens, c.heads, c.topk, num_blocks, bs, style, with_len,
            );
            let nan = nan_past_topk_len(&mut rng, &mut s);
            check_problem(&format!("{label} nan {nan}"), &mut rng, &stream, &s, options);
        });
    });
}

/// The 16-bit 8-row 4-warp tile kernel in each form (`Tuning::form`: direct, transposed; log
/// #116), forced with 4 warps and the tile path on random sparse shapes of 1..=8 heads.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_8_rows_both_forms() {
    let (_ctx, stream) = gpu();
    run_cases("sparse_8_rows_both_forms", 8, sparse_cases(), |c| {
        let c = SparseCase {
            heads: 1 + (c.heads - 1) % 8,
            ..c.clone()
        };
        for form in FORMS {
            let mut rng = Rng::new(c.seed);
            let (tokens, num_blocks, style, with_len) = sparse_case_params(&c, &mut rng);
            let options = form_options(c.sm120_occupancy, form);
            let label =
                format!("sparse_8_rows_both_forms form {form} {c:?} (tokens used {tokens})");
            with_dtype!(c.dtype, T => {
                let mut s = random_sparse::<T>(
                    &mut rng, tokens, c.heads, c.topk, num_blocks, c.block_size, style, with_len,
                );
                let nan = nan_past_topk_len(&mut rng, &mut s);
                check_problem(&format!("{label} nan {nan}"), &mut rng, &stream, &s, options);
            });
        }
    });
}

/// topk at and around the tile sizes and the limits: 1, 2, 63, 64, 65, 100, 127, 1000, 2047,
/// 2048, 2049, 4095, 4096.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_topk_edges() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sparse_topk_edges");
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
        let dtype = [DType::Bf16, DType::F16][i % 2];
        with_dtype!(dtype, T => {
            let s = random_sparse::<T>(
                &mut rng, tokens, heads, topk, num_blocks, bs, style, with_len,
            );
            check_problem(&label, &mut rng, &stream, &s, plan_options(false));
        });
    }
}

/// More tokens than a decode CTA has threads, with topk_len: up to 4,096 the decode CTAs find
/// their part, and the combine CTAs their split token, from rows of 32 lengths per warp
/// (decode/split.cuh WarpRows), past that by the walk; random lengths (empty rows too) and
/// equal ones (the aligned chunk), both dtypes, both occupancy modes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_many_tokens_with_topk_len() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sparse_many_tokens_with_topk_len");
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    for (i, (tokens, topk, equal)) in [
        (129usize, 300usize, false),
        (700, 130, false),
        (2048, 256, true),
        (2100, 64, false),
        (4200, 64, false),
    ]
    .into_iter()
    .enumerate()
    {
        let heads = rng.range(1, 9);
        let bs = rng.pick(&[16usize, 32, 64, 128]);
        let num_blocks = rng.range(50, 300);
        let label = format!("sparse many tokens {tokens} topk {topk} heads {heads} equal {equal}");
        let dtype = [DType::Bf16, DType::F16][i % 2];
        with_dtype!(dtype, T => {
            let mut s = random_sparse::<T>(
                &mut rng, tokens, heads, topk, num_blocks, bs, style, true,
            );
            if equal {
                s.topk_len = Some(vec![topk as i32; tokens]);
            }
            check_problem(&label, &mut rng, &stream, &s, plan_options(i % 2 == 1));
        });
    }
}

/// More tokens than parts and than a combine CTA's threads, without topk_len (the closed form)
/// and with a chunk that cuts tokens (300 tokens of 2 tiles: chunk 3 at 264 parts, 5 at 132;
/// 1,100 of 3 tiles: 13 and 25):
/// the combine's CTA k takes part boundary k + 1 and finds its token as decode finds its part
/// (decode/split.cuh find_split, WarpRows, from the closed form's chunk); both occupancy modes.
/// (Added in session 28 after its device time was spent: first run in session 29.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_many_tokens_closed_form() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sparse_many_tokens_closed_form");
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    for (i, (tokens, topk)) in [(300usize, 100usize), (1100, 150)].into_iter().enumerate() {
        let heads = rng.range(1, 9);
        let bs = rng.pick(&[16usize, 32, 64, 128]);
        let label = format!("sparse closed form: tokens {tokens} topk {topk} heads {heads}");
        for sm120 in [false, true] {
            let dtype = [DType::Bf16, DType::F16][i % 2];
            with_dtype!(dtype, T => {
                let s = random_sparse::<T>(&mut rng, tokens, heads, topk, 200, bs, style, false);
                check_problem(&label, &mut rng, &stream, &s, plan_options(sm120));
            });
        }
    }
}

/// `tokens` index rows of `topk` distinct slots each, drawn from `slots`.
fn distinct_rows(rng: &mut Rng, tokens: usize, topk: usize, slots: usize) -> Vec<Vec<i32>> {
    (0..tokens)
        .map(|_| {
            rng.sample(slots, topk)
                .into_iter()
                .map(|s| s as i32)
                .collect()
        })
        .collect()
}

/// 48 tokens × 2048 distinct slots drawn from a cache of >= 65,536 slots with padded blocks
/// (ids split by the kernel into block and offset), 16 heads.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_spread_over_65536_slots() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sparse_spread_over_65536_slots");
    for bs in [16usize, 128] {
        let cache = HostCache::<bf16>::random(&mut rng, 65_536 / bs + 7, bs, 8);
        let slots = cache.num_slots();
        let (tokens, topk) = (48, 2048);
        let rows = distinct_rows(&mut rng, tokens, topk, slots);
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
        check_problem(
            &format!("sparse spread bs {bs}"),
            &mut rng,
            &stream,
            &s,
            plan_options(false),
        );
    }
}

/// One or two tokens reading thousands of rows among many reading a few (per-row topk_len),
/// so that a warp merges each row (parts <= 16 x tokens) and the long tokens have more than
/// 16 pieces: their rows are merged as (row, 32-dim slice) items dealt over the combine grid
/// (decode/combine.cuh, combine_dealing_kernel); both occupancy modes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_one_long_token_among_short_ones() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sparse_one_long_token_among_short_ones");
    // (tokens, heads, topk, long tokens)
    for (i, (tokens, heads, topk, n_long)) in [
        (40usize, 8usize, 4096usize, 1usize),
        (64, 16, 3000, 2),
        (33, 5, 4096, 1),
    ]
    .into_iter()
    .enumerate()
    {
        let bs = rng.pick(&mla_decode::BLOCK_SIZES);
        let (blocks, pad) = (8192 / bs + rng.below(8), 8 * rng.below(2));
        let cache = HostCache::<bf16>::random(&mut rng, blocks, bs, pad);
        let slots = cache.num_slots();
        let mut lens: Vec<i32> = (0..tokens).map(|_| rng.range(1, 96) as i32).collect();
        for _ in 0..n_long {
            lens[rng.below(tokens)] = (topk - rng.below(40)) as i32;
        }
        let rows = distinct_rows(&mut rng, tokens, topk, slots);
        let stride = topk + 8 * rng.below(2);
        let label =
            format!("sparse one long token: tokens {tokens} heads {heads} bs {bs} lens {lens:?}");
        let s = SparseSetup {
            tokens,
            heads,
            topk,
            indices: pack_rows(&mut rng, &rows, stride, slots),
            stride,
            cache,
            topk_len: Some(lens),
            scale: rng.softmax_scale(),
        };
        check_problem(&label, &mut rng, &stream, &s, plan_options(i == 1));
    }
}

/// Both split rules on sparse steps (docs/DESIGN.md §5.3): with and without topk_len (the
/// closed form), token counts and top-k whose parts fit within tokens and ones that do not,
/// each with the rule forced flat, forced within requests and by default.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_split_within_requests_and_flat() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sparse_split_within_requests_and_flat");
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    // (tokens, heads, topk, with topk_len)
    // (the rule applies to 16 and 32 query rows per CTA: more than 8 heads)
    for (i, (tokens, heads, topk, with_len)) in [
        (128usize, 16usize, 2048usize, false),
        (64, 32, 2048, true),
        (64, 64, 1024, false),
        (96, 16, 1500, true),
        (40, 12, 4096, true),
        (130, 16, 1000, false),
    ]
    .into_iter()
    .enumerate()
    {
        let bs = rng.pick(&mla_decode::BLOCK_SIZES);
        let blocks = 8192 / bs + rng.below(8);
        let dtype = [DType::Bf16, DType::F16][i % 2];
        for (split, options) in split_rule_options(i % 3 == 1) {
            let label = format!("split {split}: tokens {tokens} heads {heads} topk {topk} bs {bs} topk_len {with_len}");
            with_dtype!(dtype, T => {
                let s = random_sparse::<T>(&mut rng, tokens, heads, topk, blocks, bs, style, with_len);
                check_problem(&label, &mut rng, &stream, &s, options);
            });
        }
    }
}

/// Log #85's sparse rules on the default plan, both occupancies: top-64 steps of 16 heads (one
/// 4-warp CTA per SM, the 1-slice combine past 256 tokens), top-768 at 64 heads (16-row CTAs:
/// the 32-row CTA needs 32 tiles per token with two CTAs per SM), and the row kernel over two
/// waves (t=2 h=128 top-32), with and without topk_len.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_short_rows() {
    check_short_rows(
        "sparse_short_rows",
        &[
            (600, 16, 64, false),
            (300, 16, 64, true),
            (100, 64, 768, true),
            (2, 128, 32, false),
            (2, 100, 20, true),
            // 8 query rows, a batch near the SM count (log #119: whole tokens per part)
            (132, 8, 128, false),
            (100, 8, 250, true),
            (190, 4, 96, true),
        ],
    );
}

/// Default plans of (tokens, heads, topk, with topk_len) in both occupancies, bf16, random block
/// sizes, 5 % holes.
fn check_short_rows(name: &str, shapes: &[(usize, usize, usize, bool)]) {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for(name);
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    for sm120 in [false, true] {
        for &(tokens, heads, topk, with_len) in shapes {
            let bs = rng.pick(&mla_decode::BLOCK_SIZES);
            let blocks = 4096 / bs + rng.below(8);
            let label = format!(
                "{name} tokens {tokens} heads {heads} topk {topk} len {with_len} sm120 {sm120}"
            );
            let s =
                random_sparse::<bf16>(&mut rng, tokens, heads, topk, blocks, bs, style, with_len);
            check_problem(&label, &mut rng, &stream, &s, plan_options(sm120));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Inputs the host cannot check

/// The 8-row short-request rule (log #119: whole tokens per part, one transposed CTA per SM;
/// with and without `topk_len`) under the sanitizers.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_sparse_short_rows_8_rows() {
    check_short_rows(
        "sanitize_sparse_short_rows_8_rows",
        &[(132, 8, 128, false), (132, 8, 128, true)],
    );
}

/// A small random problem (split q, strided outputs, padded blocks, holes, topk_len), both
/// dtypes: the memcheck/racecheck case of sparse decode.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_sparse_small_random() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sanitize_sparse_small_random");
    let style = RowStyle {
        hole: 0.1,
        bad: 0.0,
    };
    let s = random_sparse::<bf16>(&mut rng, 5, 3, 100, 8, 16, style, true);
    check_problem(
        "sanitize sparse bf16",
        &mut rng,
        &stream,
        &s,
        plan_options(false),
    );
    let s = random_sparse::<f16>(&mut rng, 7, 9, 70, 5, 32, style, false);
    check_problem(
        "sanitize sparse f16",
        &mut rng,
        &stream,
        &s,
        plan_options(false),
    );
}

/// Ids >= num_slots and < -1 are skipped and recorded as BadSlotId with the token and id;
/// a bad id past a row's topk_len is neither used nor recorded.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_sparse_bad_slot_ids() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sanitize_sparse_bad_slot_ids");
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
        let got = run_once(
            &mut rng,
            &stream,
            &s,
            &q,
            Some(RowsKind::Padded),
            plan_options(false),
        );
        let all = all_heads(heads);
        let want = s.reference(&q, &all);
        assert_eq!(
            want.faults,
            [Fault {
                code: fault_code::BAD_SLOT_ID,
                row: token as u32,
                value: id as i64
            }],
            "{label}"
        );
        check_flag_is(&label, got.flag, fault_code::BAD_SLOT_ID, token, id as i64);
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
    let got = run_once(&mut rng, &stream, &s, &q, None, plan_options(false));
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
    let mut rng = rng_for("sanitize_sparse_holes_duplicates_and_empty_rows");
    for dtype in [DType::Bf16, DType::F16] {
        with_dtype!(dtype, T => check_holes_and_duplicates::<T>(&mut rng, &stream));
    }
}

/// One problem of [`sanitize_sparse_holes_duplicates_and_empty_rows`] in `T`.
fn check_holes_and_duplicates<T: Half>(rng: &mut Rng, stream: &Arc<CudaStream>) {
    let topk = 300;
    let cache = HostCache::<T>::random(rng, 6, 32, 16);
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
        (random_row(rng), 0),
        (random_row(rng), -4),
        (random_row(rng), topk as i32 + 77),
        (random_row(rng), 1),
    ];
    let mut holes = random_row(rng);
    holes.iter_mut().step_by(2).for_each(|x| *x = -1);
    rows.push((holes, topk as i32));
    rng.shuffle(&mut rows);
    let ids: Vec<Vec<i32>> = rows.iter().map(|r| r.0.clone()).collect();
    let stride = topk + 4;
    let s = SparseSetup {
        tokens: rows.len(),
        heads: 4,
        topk,
        cache,
        indices: pack_rows(rng, &ids, stride, n),
        stride,
        topk_len: Some(rows.iter().map(|r| r.1).collect()),
        scale: rng.softmax_scale(),
    };
    let label = format!("holes/duplicates {}", T::DTYPE);
    check_problem(&label, rng, stream, &s, plan_options(false));
}

/// Sets `s`'s topk_len to `lens` and rewrites its index rows so that the entries below each
/// token's topk_len name slots of the cache's lower half and those past it slots of the upper
/// half (or, one in five, bad ids, which are not faults there); returns the first upper slot.
/// The caller fills the upper half with NaN rows, which must then never reach the output.
pub(crate) fn past_topk_len_in_upper_half<T: Half>(
    rng: &mut Rng,
    s: &mut SparseSetup<T>,
    lens: &[i32],
) -> usize {
    let slots = s.cache.num_slots();
    let half = slots / 2;
    let topk = s.topk;
    s.topk_len = Some(lens.to_vec());
    for (t, &len) in lens.iter().enumerate() {
        for e in 0..topk {
            let id = &mut s.indices[t * s.stride + e];
            if (e as i32) < len {
                if *id >= half as i32 {
                    *id = rng.below(half) as i32;
                }
            } else {
                *id = if rng.chance(0.2) {
                    bad_slot(rng, slots)
                } else {
                    (half + rng.below(slots - half)) as i32
                };
            }
        }
    }
    half
}

/// One run in two where `s` has topk_len: the entries past each token's topk_len name the
/// cache's upper half, whose rows are NaN ([`past_topk_len_in_upper_half`]): rows a part may
/// load with its last tile and must mask out, on every configuration. Returns the first NaN
/// slot (the cache's slot count when none is).
pub(crate) fn maybe_nan_past_topk_len<T: Half>(rng: &mut Rng, s: &mut SparseSetup<T>) -> usize {
    let slots = s.cache.num_slots();
    let Some(lens) = s.topk_len.clone() else {
        return slots;
    };
    if !rng.chance(0.5) {
        return slots;
    }
    past_topk_len_in_upper_half(rng, s, &lens)
}

/// [`maybe_nan_past_topk_len`] with the NaN rows written into the 16-bit cache.
fn nan_past_topk_len<T: Half>(rng: &mut Rng, s: &mut SparseSetup<T>) -> bool {
    let half = maybe_nan_past_topk_len(rng, s);
    for slot in half..s.cache.num_slots() {
        s.cache.row_mut(slot).fill(T::nan());
    }
    half < s.cache.num_slots()
}

/// One-part sparse steps with topk_len: the slots the index rows name past topk_len hold NaN
/// rows (or bad ids, which are not faults there) and must not reach the output (the guard
/// of the dense test of the same name).
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_sparse_one_part_nan_past_len() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sanitize_sparse_one_part_nan_past_len");
    let style = RowStyle {
        hole: 0.1,
        bad: 0.0,
    };
    for (tokens, heads, topk, lens) in [
        (1usize, 8usize, 32usize, vec![1i32]),
        (1, 8, 64, vec![0]),
        (1, 8, 40, vec![31]),
        (2, 8, 32, vec![7, 32]),
        (1, 16, 20, vec![19]),
    ] {
        let mut s = random_sparse::<bf16>(&mut rng, tokens, heads, topk, 8, 16, style, true);
        let half = past_topk_len_in_upper_half(&mut rng, &mut s, &lens);
        for slot in half..s.cache.num_slots() {
            s.cache.row_mut(slot).fill(<bf16 as Half>::nan());
        }
        let label = format!("one part tokens {tokens} topk {topk} lens {lens:?}");
        let kind = QKind::random(&mut rng);
        let q = HostQuery::<bf16>::random(&mut rng, kind, tokens, heads);
        let got = run_once(&mut rng, &stream, &s, &q, None, plan_options(false));
        let all = all_heads(heads);
        let want = s.reference(&q, &all);
        assert!(want.faults.is_empty(), "{label}");
        check_flag(&label, got.flag, &want.faults);
        check_outputs(&label, &got, &want, &all);
    }
}

/// Small sparse steps with topk_len in the closed form with lengths (decode/split.cuh
/// `closed_lens_parts`: every token's parts of at most `min_chunk` tiles, known before its
/// topk_len, so the decode kernel's kSpec form reads each part's first index entries with
/// topk_len): the slots the index rows name past topk_len hold NaN rows (or bad ids, which are
/// not faults there) and must not reach the output; a bad id inside topk_len and a bad topk_len
/// are faults. One to four tokens, top-k 256 to 2,048, 16-bit and fp8 caches.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_closed_form_first_tiles_early() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sparse_closed_form_first_tiles_early");
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    let cases: Vec<(usize, usize, Vec<i32>, bool)> = vec![
        (8, 2048, vec![2048], false),
        (8, 2048, vec![1000], true),
        (8, 2048, vec![0], false),
        (8, 2048, vec![2048, 37], true),
        (8, 1024, vec![1024, 0, 500, 33], false),
        (16, 512, vec![300], true),
        (8, 256, vec![256, 255, 1], false),
        (8, 1024, vec![-1, 2000], false),
        (3, 2048, vec![64, 2047], true),
    ];
    for (i, (heads, topk, lens, bad_inside)) in cases.into_iter().enumerate() {
        let tokens = lens.len();
        let mut s = random_sparse::<bf16>(&mut rng, tokens, heads, topk, 64, 64, style, true);
        let half = past_topk_len_in_upper_half(&mut rng, &mut s, &lens);
        let slots = s.cache.num_slots();
        if bad_inside && lens[0] > 40 {
            s.indices[40] = bad_slot(&mut rng, slots);
        }
        let label = format!("tokens {tokens} heads {heads} topk {topk} lens {lens:?}");
        if i % 3 == 2 {
            // fp8: the slots past topk_len all 0xff bytes (e4m3 NaN, NaN scales and RoPE)
            let kind = FP8_KINDS[(i / 3) % FP8_KINDS.len()];
            let mut p = Fp8::sparse(&mut rng, s, kind, 1.0);
            p.fp8.nan_rows(half..slots);
            check_problem(
                &format!("fp8 {kind:?} {label}"),
                &mut rng,
                &stream,
                &p,
                plan_options(false),
            );
            continue;
        }
        for slot in half..slots {
            s.cache.row_mut(slot).fill(<bf16 as Half>::nan());
        }
        let kind = QKind::random(&mut rng);
        let q = HostQuery::<bf16>::random(&mut rng, kind, tokens, heads);
        let got = run_once(&mut rng, &stream, &s, &q, None, plan_options(false));
        let all = all_heads(heads);
        let want = s.reference(&q, &all);
        let lens_ok = lens.iter().all(|l| (0..=topk as i32).contains(l));
        assert_eq!(
            want.faults.is_empty(),
            lens_ok && !(bad_inside && lens[0] > 40),
            "{label}"
        );
        check_flag(&label, got.flag, &want.faults);
        check_outputs(&label, &got, &want, &all);
    }
}

/// A small sparse step with parts forced within tokens (16 heads: the 16-row kernels that
/// carry the rule), with and without topk_len: the memcheck/racecheck case of that split.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_sparse_small_split_within() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sanitize_sparse_small_split_within");
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    for with_len in [true, false] {
        let s = random_sparse::<bf16>(&mut rng, 6, 16, 200, 8, 16, style, with_len);
        let mut options = plan_options(false);
        options.tuning.split = Some(mla_decode::ffi::MLA_SPLIT_WITHIN_REQUESTS);
        check_problem(
            "sanitize sparse small within",
            &mut rng,
            &stream,
            &s,
            options,
        );
    }
}

/// The closed form's aligned flat chunk (docs/DESIGN.md §5.3, log #77): without topk_len, where
/// parts / batch equal parts divide every token and are at most a tile longer than the flat
/// chunk, the flat split lays every part inside one token. On a 132-SM H200: 62 tokens of 17
/// tiles at 64 heads (66 parts: chunk 16 -> 17) and 248 tokens at 16 heads (264 parts: 16 ->
/// 17); with fewer parts than tokens, parts of whole tokens (log #94): 256 tokens of 32 tiles at
/// 32 heads (132 parts: 63 -> 64, two tokens each); elsewhere whatever partition the device
/// gives. bf16 with the flat split forced, fp8_ds_mla (always flat), against the reference.
/// The same with topk_len whose every row has the same tiles (the kernels find the aligned
/// chunk on the device: `flat_chunk`): all `topk`, or each anywhere in the last tile (the
/// masks still follow each row's own length); 31 tokens of 17 tiles at 128 heads (31 of 33
/// parts: 16 -> 17) takes the combine's one-warp search.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_closed_form_aligned_flat_chunk() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sparse_closed_form_aligned_flat_chunk");
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    // (256 tokens of 32 tiles at 32 heads: fewer parts than tokens, two whole tokens per part
    // on a 132-SM part, log #94)
    let cases = [
        (62usize, 64usize, 17usize),
        (248, 16, 17),
        (256, 32, 32),
        (31, 128, 17),
    ];
    // (topk_len: None; all topk; each in the last tile)
    for (j, ((tokens, heads, tiles), lens)) in cases
        .into_iter()
        .flat_map(|c| [(c, 0), (c, 1), (c, 2)])
        .enumerate()
    {
        if lens == 0 && tokens == 31 {
            continue;
        }
        let mut s =
            random_sparse::<bf16>(&mut rng, tokens, heads, tiles * 32, 12, 64, style, false);
        if lens > 0 {
            let last = (tiles - 1) * 32;
            s.topk_len = Some(
                (0..tokens)
                    .map(|_| if lens == 1 { s.topk } else { last + rng.range(1, 32) } as i32)
                    .collect(),
            );
        }
        let mut flat = plan_options(false);
        flat.tuning.split = Some(mla_decode::ffi::MLA_SPLIT_FLAT);
        let label = format!("aligned flat chunk t={tokens} h={heads} lens {lens}");
        check_problem(&label, &mut rng, &stream, &s, flat);
        // every fp8 kind in turn, in both occupancies: more than 16 query rows take the 32-row
        // configuration for per-tensor fp8 always and for fp8_ds_mla with one CTA per SM
        // (sm_120), over hundreds of tokens (the block scan and the large-batch searches)
        let (kind, sm120) = (FP8_KINDS[j % 3], (j / 3) % 2 == 1);
        let f = Fp8::sparse(&mut rng, s, kind, 1.0);
        check_problem(
            &format!("{label} fp8 {kind:?} sm120 {sm120}"),
            &mut rng,
            &stream,
            &f,
            plan_options(sm120),
        );
    }
}
