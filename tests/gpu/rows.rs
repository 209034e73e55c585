//! The row kernel (`MLA_PATH_ROWS`, docs/DESIGN.md §5.5): a CTA per query row on the CUDA
//! cores, the default on one-part steps of few query rows and correct, when forced, on any
//! shape and any lengths:
//! - forced on random small dense and sparse problems (16-bit caches and every fp8 kind,
//!   f16/bf16 queries, heads 1..=128, q_len 1..=8, every block size, lengths 0..300 and
//!   topk up to 100, bad block ids and slot ids, topk_len) against the f64 reference;
//! - the schedule's default picks it exactly where docs/DESIGN.md says;
//! - its faults (bad lengths, bad entries) for the sanitizers.

use mla_decode::ffi::{MLA_PATH_ROWS, MLA_PATH_TILES};
use mla_decode::*;

use crate::kit::*;

/// Head counts cycled through (1, odd, 8, 16 and the many-head counts).
const HEADS: [usize; 8] = [1, 3, 8, 16, 64, 128, 7, 33];

fn rows_options(sm120_occupancy: bool) -> PlanOptions {
    let mut o = plan_options(sm120_occupancy);
    o.tuning.path = Some(MLA_PATH_ROWS);
    o
}

/// The row kernel forced on random dense and sparse problems of every cache kind (16-bit,
/// fp8_ds_mla raw and pow2, per-tensor fp8) x f16/bf16 x heads 1..=128, most of them longer
/// than a one-part step (lengths up to 300: the kernel must walk any length).
#[test]
#[ignore = "needs a GPU"]
fn rows_kernel_random() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("rows_kernel_random");
    let kinds: Vec<Option<Fp8Kind>> = std::iter::once(None).chain(FP8_KINDS.map(Some)).collect();
    let mut i = 0;
    for kind in kinds {
        for dtype in [DType::Bf16, DType::F16] {
            for heads in HEADS {
                for sparse in [false, true] {
                    i += 1;
                    let options = rows_options(i % 2 == 0);
                    let label = format!("rows {kind:?} heads {heads} sparse {sparse} (case {i})");
                    let max_len = if rng.chance(0.5) { 64 } else { 300 };
                    with_dtype!(dtype, T => match (kind, sparse) {
                        (None, false) => {
                            let p = random_dense::<T>(&mut rng, heads, 3, max_len, WORK_BUDGET / 4);
                            check_problem(&label, &mut rng, &stream, &p, options);
                        }
                        (None, true) => {
                            let p = random_sparse_case::<T>(&mut rng, heads, true);
                            check_problem(&label, &mut rng, &stream, &p, options);
                        }
                        (Some(k), false) => {
                            let s = random_dense::<T>(&mut rng, heads, 3, max_len, WORK_BUDGET / 4);
                            let p = Fp8::dense(&mut rng, s, k, 1.0);
                            check_problem(&label, &mut rng, &stream, &p, options);
                        }
                        (Some(k), true) => {
                            let s = random_sparse_case::<T>(&mut rng, heads, true);
                            let p = Fp8::sparse(&mut rng, s, k, 1.0);
                            check_problem(&label, &mut rng, &stream, &p, options);
                        }
                    });
                }
            }
        }
    }
}

/// The schedule's default (block size 16: max_len = 16 * ceil(l / 16)): the row kernel on
/// one-part steps (batch * ceil(max_len / 32) <= 2) of at most one query row per SM, the tile
/// kernels elsewhere; a forced path is kept.
#[test]
#[ignore = "needs a GPU"]
fn rows_kernel_default_choice() {
    let (_ctx, stream) = gpu();
    let schedule = |plan: DecodePlan| {
        let s = plan.schedule();
        (s.internal.path as u32, s.sm_count as usize)
    };
    let dense = |batch, q_len, heads, max_len, options: PlanOptions| {
        let shape = DenseShape {
            batch,
            q_len,
            num_heads: heads,
            block_size: 16,
            max_blocks_per_seq: usize::div_ceil(max_len, 16),
            kv_format: KvFormat::Bf16,
        };
        schedule(DecodePlan::dense(&stream, shape, options).expect("dense plan"))
    };
    let sparse = |tokens, heads, topk, kv_format| {
        let shape = SparseShape {
            num_tokens: tokens,
            num_heads: heads,
            topk,
            kv_format,
        };
        schedule(DecodePlan::sparse(&stream, shape, PlanOptions::default()).expect("sparse plan"))
    };
    let d = PlanOptions::default();
    let sms = dense(1, 1, 8, 1, d).1;
    assert!(sms >= 16, "{sms} SMs");
    let rows = |q: usize, h: usize, b: usize| {
        if b * q * h <= sms {
            MLA_PATH_ROWS
        } else {
            MLA_PATH_TILES
        }
    };
    assert_eq!(dense(1, 1, 8, 1, d).0, MLA_PATH_ROWS, "the one-token call");
    assert_eq!(dense(1, 1, 8, 64, d).0, MLA_PATH_ROWS, "b=1 l=64");
    assert_eq!(dense(2, 1, 8, 32, d).0, MLA_PATH_ROWS, "b=2 l=32");
    assert_eq!(dense(1, 2, 4, 16, d).0, MLA_PATH_ROWS, "q_len 2");
    assert_eq!(dense(1, 1, 128, 16, d).0, rows(1, 128, 1), "128 heads");
    assert_eq!(
        dense(2, 8, 16, 16, d).0,
        rows(8, 16, 2),
        "q_len 8, 16 heads, 2 requests"
    );
    assert_eq!(
        dense(1, 8, 128, 16, d).0,
        MLA_PATH_TILES,
        "more query rows than SMs"
    );
    assert_eq!(dense(1, 1, 8, 80, d).0, MLA_PATH_TILES, "three tiles");
    assert_eq!(dense(3, 1, 8, 1, d).0, MLA_PATH_TILES, "three requests");
    assert_eq!(dense(1, 1, 8, 4096, d).0, MLA_PATH_TILES, "b=1 l=4096");
    assert_eq!(sparse(1, 8, 1, KvFormat::Bf16).0, MLA_PATH_ROWS, "top-1");
    assert_eq!(
        sparse(1, 8, 64, KvFormat::Fp8DsMla).0,
        MLA_PATH_ROWS,
        "top-64 fp8"
    );
    assert_eq!(
        sparse(2, 64, 32, KvFormat::Fp8PerTensor).0,
        rows(1, 64, 2),
        "two tokens"
    );
    assert_eq!(
        sparse(1, 8, 2048, KvFormat::Bf16).0,
        MLA_PATH_TILES,
        "top-2048"
    );
    let mut forced = PlanOptions::default();
    forced.tuning.path = Some(MLA_PATH_TILES);
    assert_eq!(dense(1, 1, 8, 1, forced).0, MLA_PATH_TILES, "forced tiles");
    forced.tuning.path = Some(MLA_PATH_ROWS);
    assert_eq!(
        dense(64, 1, 64, 4096, forced).0,
        MLA_PATH_ROWS,
        "forced rows"
    );
}

/// Small dense and sparse steps on the row kernel with every fault it records (negative and
/// too large seq_len, bad block ids, bad topk_len, bad slot ids), both dtypes and a 16-bit
/// and an fp8 cache: the memcheck/racecheck case of the row kernel.
#[test]
#[ignore = "needs a GPU"]
fn sanitize_rows_small() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sanitize_rows_small");
    let kind = FP8_KINDS[0];
    for (i, dtype) in [DType::F16, DType::Bf16].into_iter().enumerate() {
        with_dtype!(dtype, T => {
            let spec = DenseSpec {
                q_len: 2,
                heads: 5,
                block_size: 16,
                max_blocks_per_seq: 3,
                table_pad: 1,
                block_pad: 8,
                spare_blocks: 1,
                junk_unused: true,
                seq_lens: vec![[-3, 1, 70][i], 40, 2],
                scale: rng.softmax_scale(),
            };
            let mut s = DenseSetup::<T>::build(&mut rng, &spec);
            s.table[s.table_stride + 1] = junk_block(&mut rng, s.cache.num_blocks);
            check_problem("rows dense", &mut rng, &stream, &s, rows_options(false));
            let f = Fp8::dense(&mut rng, s, kind, 1.0);
            check_problem("rows dense fp8", &mut rng, &stream, &f, rows_options(true));
            let style = RowStyle { hole: 0.2, bad: 0.3 };
            let p = random_sparse::<T>(&mut rng, 2, 3, 40, 3, 16, style, true);
            check_problem("rows sparse", &mut rng, &stream, &p, rows_options(false));
            let f = Fp8::sparse(&mut rng, p, kind, 1.0);
            check_problem("rows sparse fp8", &mut rng, &stream, &f, rows_options(true));
        });
    }
}
