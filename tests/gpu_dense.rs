//! GPU tests of dense paged decode and the cache append against the f64 reference.
//!
//! Every test is `#[ignore]`d (CPU runs list it as ignored); the device runs them with
//! `cargo test --release --test gpu_dense -- --include-ignored --test-threads=1`. Tests whose
//! name contains `sanitize_` are small and are the ones compute-sanitizer runs.
//!
//! Data are fresh random values each run: proptest cases print their value (which holds the
//! data seed) on failure, the other tests print their seed (`MLA_TEST_SEED` replays one).

mod common;

use std::sync::Arc;

use common::*;
use mla_decode::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::half::{bf16, f16};
use mla_decode::reference::{fault_code, Fault};
use mla_decode::{
    append_kv, DecodePlan, Error, ErrorFlag, FaultCode, KvCacheMut, PlanOptions, HEAD_DIM,
};
use proptest::prelude::{any, prop, Just, Strategy};
use proptest::prop_oneof;

/// Most cache rows one random case uses (keeps host memory and data generation modest).
const ROW_CAP: usize = 120_000;

fn default_plan() -> PlanOptions {
    PlanOptions::default()
}

/// A random length in `0..=max_len`, often an edge (0, 1, around a block, max_len, a multiple
/// of the block size).
fn edge_len(rng: &mut Rng, max_len: usize, bs: usize) -> usize {
    match rng.below(10) {
        0 => 0,
        1 => 1,
        2 => bs - 1,
        3 => bs,
        4 => bs + 1,
        5 => max_len,
        6 => rng.below(max_len / bs + 1) * bs,
        _ => rng.below(max_len + 1),
    }
}

/// check_random_dense with the default plan, in bf16 (`bf`) or f16.
fn check_random_dense_in(
    bf: bool,
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    spec: &DenseSpec,
) {
    if bf {
        check_random_dense::<bf16>(label, rng, stream, spec, default_plan());
    } else {
        check_random_dense::<f16>(label, rng, stream, spec, default_plan());
    }
}

/// Generates the problem, runs it, and compares every (row, head) with the reference.
fn check_random_dense<T: Half>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    spec: &DenseSpec,
    options: PlanOptions,
) {
    let s = DenseSetup::<T>::build(rng, spec);
    let kind = QKind::random(rng);
    let q = HostQuery::<T>::random(rng, kind, s.tokens(), s.heads);
    let lse_kind = random_lse_kind(rng);
    let got = run_dense(rng, stream, &s, &q, lse_kind, options);
    let heads = all_heads(s.heads);
    let want = s.reference(&q, &heads);
    let label = format!(
        "{label} [{}; q {kind:?}, out {:?}, lse {lse_kind:?}, seq_lens {:?}]",
        T::DTYPE,
        got.out_layout.kind,
        short(&s.seq_lens)
    );
    check_flag(&label, got.flag, &want.faults);
    check_outputs(&label, &got, &want, &heads);
}

/// The first few values of a list, for labels.
fn short(v: &[i32]) -> String {
    if v.len() <= 12 {
        format!("{v:?}")
    } else {
        format!("{:?}.. ({} values)", &v[..12], v.len())
    }
}

#[derive(Clone, Debug)]
struct DenseCase {
    bf16: bool,
    heads: usize,
    q_len: usize,
    block_size: usize,
    batch: usize,
    max_len: usize,
    sm120_occupancy: bool,
    seed: u64,
}

fn dense_cases() -> impl Strategy<Value = DenseCase> {
    (
        any::<bool>(),
        prop_oneof![1 => Just(1usize), 1 => Just(128usize), 4 => 1..=128usize],
        1..=8usize,
        prop::sample::select(vec![16usize, 32, 64, 128]),
        prop_oneof![1 => Just(64usize), 4 => 1..=64usize],
        0..=5000usize,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(bf16, heads, q_len, block_size, batch, max_len, sm120_occupancy, seed)| DenseCase {
                bf16,
                heads,
                q_len,
                block_size,
                batch,
                max_len,
                sm120_occupancy,
                seed,
            },
        )
}

/// The problem of a random case: lengths mostly at edges, scaled down to the work budget.
fn dense_case_spec(c: &DenseCase, rng: &mut Rng) -> DenseSpec {
    let bs = c.block_size;
    let mut lens: Vec<usize> = (0..c.batch).map(|_| edge_len(rng, c.max_len, bs)).collect();
    let total: usize = lens.iter().sum();
    let cap = (WORK_BUDGET / (c.heads * c.q_len)).min(ROW_CAP);
    if total > cap {
        lens.iter_mut().for_each(|l| *l = *l * cap / total);
    }
    let longest = lens.iter().copied().max().unwrap_or(0).max(c.max_len);
    DenseSpec {
        q_len: c.q_len,
        heads: c.heads,
        block_size: bs,
        max_blocks_per_seq: longest.div_ceil(bs).max(1) + rng.below(3),
        table_pad: if rng.chance(0.5) { 0 } else { rng.range(1, 5) },
        block_pad: 8 * rng.below(4),
        spare_blocks: rng.below(8),
        junk_unused: rng.chance(0.5),
        seq_lens: lens.iter().map(|&l| l as i32).collect(),
        scale: rng.softmax_scale(),
    }
}

/// Random shapes across the whole scope: dtype, 1..=128 heads, q_len 1..=8, every block size
/// with padded block strides, batch 1..=64 with different lengths 0..=5000 (scaled down to a
/// work budget for the reference), random scale, every query/out/lse layout, shuffled tables
/// with junk past each request's blocks, both occupancy modes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_random_shapes() {
    let (_ctx, stream) = gpu();
    run_cases("dense_random_shapes", 16, dense_cases(), |c| {
        let mut rng = Rng::new(c.seed);
        let spec = dense_case_spec(c, &mut rng);
        let options = PlanOptions {
            sm120_occupancy: c.sm120_occupancy,
            ..PlanOptions::default()
        };
        let label = format!("dense_random_shapes {c:?}");
        if c.bf16 {
            check_random_dense::<bf16>(&label, &mut rng, &stream, &spec, options);
        } else {
            check_random_dense::<f16>(&label, &mut rng, &stream, &spec, options);
        }
    });
}

/// Lengths 0, 1, 15, 16, 17, around every block size, not multiples of it, and the full
/// table, with q_len 1 and 8 (so that some causal rows see nothing), both dtypes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_edge_seq_lens() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("dense_edge_seq_lens"));
    for bs in [16usize, 32, 64, 128] {
        for q_len in [1usize, 8] {
            for bf in [false, true] {
                let mbps = 3000usize.div_ceil(bs) + 1;
                let mut lens = vec![
                    0,
                    1,
                    7,
                    8,
                    9,
                    15,
                    16,
                    17,
                    bs - 1,
                    bs,
                    bs + 1,
                    2 * bs,
                    3 * bs + 5,
                    mbps * bs,
                    rng.range(100, 3000),
                ];
                rng.shuffle(&mut lens);
                let spec = DenseSpec {
                    q_len,
                    heads: rng.range(1, 8),
                    block_size: bs,
                    max_blocks_per_seq: mbps,
                    table_pad: rng.below(3),
                    block_pad: 8 * rng.below(3),
                    spare_blocks: rng.below(4),
                    junk_unused: true,
                    seq_lens: lens.iter().map(|&l| l as i32).collect(),
                    scale: rng.softmax_scale(),
                };
                let label = format!("dense_edge_seq_lens bs {bs} q_len {q_len}");
                check_random_dense_in(bf, &label, &mut rng, &stream, &spec);
            }
        }
    }
}

/// Batches past one CTA's worth of requests (129..=700: the split is then found by a pass
/// for the total and a walk over the requests, in decode and in the combine), short
/// lengths with edges and empty requests, both dtypes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_large_batches() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("dense_large_batches"));
    for (batch, bf) in [(129usize, true), (257, false), (700, true)] {
        let bs = 16;
        let mbps = 12usize;
        let seq_lens: Vec<i32> = (0..batch)
            .map(|_| edge_len(&mut rng, mbps * bs, bs) as i32)
            .collect();
        let spec = DenseSpec {
            q_len: 1 + rng.below(2),
            heads: rng.range(1, 16),
            block_size: bs,
            max_blocks_per_seq: mbps,
            table_pad: rng.below(3),
            block_pad: 0,
            spare_blocks: rng.below(4),
            junk_unused: true,
            seq_lens,
            scale: rng.softmax_scale(),
        };
        let label = format!("dense_large_batches batch {batch}");
        check_random_dense_in(bf, &label, &mut rng, &stream, &spec);
    }
}

/// One head and 128 heads, with q_len 1 and 8 (128 heads × 8 rows = 1024 query rows per
/// request).
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_one_head_and_128_heads() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("dense_one_head_and_128_heads"));
    for (heads, q_len, bf) in [(1, 1, true), (1, 8, false), (128, 1, false), (128, 8, true)] {
        let bs = rng.pick(&[16usize, 32, 64, 128]);
        let lens = [rng.range(300, 700), rng.range(0, 40), rng.range(1, 700)];
        let spec = DenseSpec {
            q_len,
            heads,
            block_size: bs,
            max_blocks_per_seq: 700usize.div_ceil(bs) + 1,
            table_pad: rng.below(3),
            block_pad: 8 * rng.below(3),
            spare_blocks: 2,
            junk_unused: true,
            seq_lens: lens.iter().map(|&l| l as i32).collect(),
            scale: rng.softmax_scale(),
        };
        let label = format!("dense heads {heads} q_len {q_len}");
        check_random_dense_in(bf, &label, &mut rng, &stream, &spec);
    }
}

/// One sequence of 131,077 rows (plus a short one), 8 heads, q_len 2: the reference covers all
/// of the sequence for 3 sampled heads.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_long_sequence_131077_rows() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("dense_long_sequence_131077_rows"));
    let bs = rng.pick(&[16usize, 32, 64, 128]);
    let long = 131_077usize;
    let spec = DenseSpec {
        q_len: 2,
        heads: 8,
        block_size: bs,
        max_blocks_per_seq: long.div_ceil(bs) + 1,
        table_pad: 3,
        block_pad: 8,
        spare_blocks: 5,
        junk_unused: true,
        seq_lens: vec![long as i32, 777],
        scale: 1.0 / 16.0,
    };
    let s = DenseSetup::<bf16>::build(&mut rng, &spec);
    let q = HostQuery::<bf16>::random(&mut rng, QKind::SplitSeparate, s.tokens(), s.heads);
    let got = run_dense(
        &mut rng,
        &stream,
        &s,
        &q,
        Some(RowsKind::Padded),
        default_plan(),
    );
    let mut heads: Vec<usize> = rng.distinct(8, 3);
    heads.sort_unstable();
    let want = s.reference(&q, &heads);
    let label = format!("dense_long_sequence bs {bs} heads {heads:?}");
    check_flag(&label, got.flag, &want.faults);
    check_outputs(&label, &got, &want, &heads);
}

/// One plan and one seq_lens buffer used by the decode of two layers (different q and caches,
/// same table), then layer 1 again: both layers match the reference and the repeat is bitwise
/// identical.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_plan_reused_by_two_layers() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("dense_plan_reused_by_two_layers"));
    let bs = 64;
    let lens: Vec<i32> = (0..8).map(|_| rng.range(0, 3000) as i32).collect();
    let spec = DenseSpec {
        q_len: 2,
        heads: 16,
        block_size: bs,
        max_blocks_per_seq: 3000 / bs + 1,
        table_pad: 1,
        block_pad: 16,
        spare_blocks: 3,
        junk_unused: true,
        seq_lens: lens,
        scale: rng.softmax_scale(),
    };
    let s1 = DenseSetup::<f16>::build(&mut rng, &spec);
    let mut s2 = s1.clone();
    s2.cache = HostCache::random(&mut rng, s1.cache.num_blocks, bs, 16);
    let q1 = HostQuery::<f16>::random(&mut rng, QKind::Strided, s1.tokens(), s1.heads);
    let q2 = HostQuery::<f16>::random(&mut rng, QKind::SplitShared, s1.tokens(), s1.heads);
    let (dev1, dev2) = (
        DenseDev::upload(&stream, &s1),
        DenseDev::upload(&stream, &s2),
    );
    let (qd1, qd2) = (q1.upload(&stream), q2.upload(&stream));
    let flag = ErrorFlag::new(&stream).unwrap();
    let plan = DecodePlan::dense(&stream, s1.shape(), default_plan()).unwrap();

    let mut outs = Vec::new();
    for (s, dev, qd) in [(&s1, &dev1, &qd1), (&s2, &dev2, &qd2), (&s1, &dev1, &qd1)] {
        let mut out = DevOut::random(&mut rng, &stream, s.tokens(), s.heads);
        let mut lse = DevLse::random(&mut rng, &stream, s.tokens(), s.heads);
        dev.decode(&stream, s, &plan, qd, &mut out, Some(&mut lse), Some(&flag))
            .unwrap();
        outs.push(Outputs::read(&stream, &out, Some(&lse), &flag));
    }
    let heads = all_heads(s1.heads);
    for (i, (s, q)) in [(&s1, &q1), (&s2, &q2)].into_iter().enumerate() {
        let want = s.reference(q, &heads);
        let label = format!("plan reuse, layer {}", i + 1);
        check_flag(&label, outs[i].flag, &want.faults);
        check_outputs(&label, &outs[i], &want, &heads);
    }
    assert!(
        outs[0].logical_bits() == outs[2].logical_bits(),
        "plan reuse: layer 1 decoded twice with the same plan differs"
    );
}

/// Captures flag reset + decode in a CUDA graph, then changes seq_lens, the block table and q
/// in place (the same buffers: the graph reads them at replay) and replays: every replay matches the reference for the new values; a
/// bad block id in a replay is recorded, and the next replay's captured reset clears it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_cuda_graph_capture_and_replay() {
    let (_ctx, stream) = gpu_for_graphs();
    let mut rng = Rng::new(seed("dense_cuda_graph_capture_and_replay"));
    let (batch, bs, mbps) = (6usize, 32usize, 64usize);
    let cap = mbps * bs;
    let random_lens = |rng: &mut Rng| -> Vec<i32> {
        (0..batch)
            .map(|_| match rng.below(6) {
                0 => 0,
                1 => 1,
                2 => cap as i32,
                _ => rng.range(2, cap) as i32,
            })
            .collect()
    };
    let lens = random_lens(&mut rng);
    let spec = DenseSpec {
        q_len: 2,
        heads: 8,
        block_size: bs,
        max_blocks_per_seq: mbps,
        table_pad: 2,
        block_pad: 8,
        spare_blocks: 0,
        junk_unused: true,
        seq_lens: lens,
        scale: 1.0 / 16.0,
    };
    let mut s = DenseSetup::<bf16>::build(&mut rng, &spec);
    // A cache of batch*mbps blocks, so that any new lengths fit.
    s.cache = HostCache::random(&mut rng, batch * mbps, bs, 8);
    reassign_table(&mut rng, &mut s);
    let heads = all_heads(s.heads);
    let mut q = HostQuery::<bf16>::random(&mut rng, QKind::SplitSeparate, s.tokens(), s.heads);
    let mut dev = DenseDev::upload(&stream, &s);
    let mut qd = q.upload(&stream);
    let mut out = DevOut::random(&mut rng, &stream, s.tokens(), s.heads);
    let mut lse = DevLse::random(&mut rng, &stream, s.tokens(), s.heads);
    let flag = ErrorFlag::new(&stream).unwrap();
    let plan = DecodePlan::dense(&stream, s.shape(), default_plan()).unwrap();

    // Warm-up outside the capture (first launches may set kernel attributes).
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
    let got = Outputs::read(&stream, &out, Some(&lse), &flag);
    let want = s.reference(&q, &heads);
    check_flag("graph warm-up", got.flag, &want.faults);
    check_outputs("graph warm-up", &got, &want, &heads);

    stream.synchronize().unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    flag.reset(&stream).unwrap();
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
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a captured graph");

    for round in 1..=4 {
        s.seq_lens = random_lens(&mut rng);
        reassign_table(&mut rng, &mut s);
        let bad = round == 3;
        if bad {
            // A bad entry in a column the request uses.
            let b = (0..batch).find(|&b| s.seq_lens[b] > 0).unwrap_or(0);
            s.seq_lens[b] = s.seq_lens[b].max(1);
            s.table[b * s.table_stride] = -5;
        }
        q.refill(&mut rng);
        stream.memcpy_htod(&s.seq_lens, &mut dev.seq_lens).unwrap();
        stream.memcpy_htod(&s.table, &mut dev.table).unwrap();
        qd.rewrite(&stream, &q);
        out.poison(&stream);
        lse.poison(&stream);
        graph.launch().unwrap();
        let got = Outputs::read(&stream, &out, Some(&lse), &flag);
        let want = s.reference(&q, &heads);
        let label = format!("graph replay {round} seq_lens {:?}", s.seq_lens);
        if bad {
            assert!(!want.faults.is_empty(), "{label}: no fault injected");
        }
        check_flag(&label, got.flag, &want.faults);
        check_outputs(&label, &got, &want, &heads);
    }
}

/// A fresh shuffled assignment of the cache's blocks to the requests of `s` for its current
/// seq_lens (junk past each request's blocks and in the row padding).
fn reassign_table<T: Half>(rng: &mut Rng, s: &mut DenseSetup<T>) {
    let bs = s.cache.block_size;
    let cap = (s.mbps * bs) as i64;
    let mut ids: Vec<i32> = (0..s.cache.num_blocks as i32).collect();
    rng.shuffle(&mut ids);
    let mut next = ids.into_iter();
    for b in 0..s.batch {
        let need = ((s.seq_lens[b] as i64).clamp(0, cap) as usize).div_ceil(bs);
        for j in 0..s.table_stride {
            s.table[b * s.table_stride + j] = if j < need {
                next.next().expect("cache too small")
            } else {
                junk_block(rng, s.cache.num_blocks)
            };
        }
    }
}

/// The same inputs and plan twice give bitwise the same out and lse, and so does a second
/// plan made the same way (long sequences: many split parts and a combine).
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_deterministic_bitwise() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("dense_deterministic_bitwise"));
    let bs = 64;
    let spec = DenseSpec {
        q_len: 2,
        heads: 16,
        block_size: bs,
        max_blocks_per_seq: 20_000 / bs + 1,
        table_pad: 0,
        block_pad: 0,
        spare_blocks: 0,
        junk_unused: false,
        seq_lens: vec![20_000, 7001, 1, 12_345],
        scale: rng.softmax_scale(),
    };
    let s = DenseSetup::<bf16>::build(&mut rng, &spec);
    let q = HostQuery::<bf16>::random(&mut rng, QKind::Contiguous, s.tokens(), s.heads);
    let dev = DenseDev::upload(&stream, &s);
    let qd = q.upload(&stream);
    let flag = ErrorFlag::new(&stream).unwrap();
    let mut out = DevOut::random(&mut rng, &stream, s.tokens(), s.heads);
    let mut lse = DevLse::random(&mut rng, &stream, s.tokens(), s.heads);
    let mut runs = Vec::new();
    let mut plan = DecodePlan::dense(&stream, s.shape(), default_plan()).unwrap();
    for fresh_plan in [false, false, true] {
        if fresh_plan {
            plan = DecodePlan::dense(&stream, s.shape(), default_plan()).unwrap();
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
    check_flag("determinism", runs[0].flag, &want.faults);
    check_outputs("determinism", &runs[0], &want, &heads);
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
// Inputs the host cannot check: bad block ids, bad seq_lens, the error flag

fn small_spec(seq_lens: Vec<i32>, rng: &mut Rng) -> DenseSpec {
    DenseSpec {
        q_len: 2,
        heads: 4,
        block_size: 16,
        max_blocks_per_seq: 5,
        table_pad: 2,
        block_pad: 8,
        spare_blocks: 2,
        junk_unused: true,
        seq_lens,
        scale: rng.softmax_scale(),
    }
}

/// Runs `s` (random layouts), checks the outputs against the reference, and returns the flag
/// and the reference's faults.
fn run_small<T: Half>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    s: &DenseSetup<T>,
) -> ([u32; 4], Vec<Fault>) {
    let kind = QKind::random(rng);
    let q = HostQuery::<T>::random(rng, kind, s.tokens(), s.heads);
    let lse_kind = Strided::random_kind(rng);
    let got = run_dense(rng, stream, s, &q, Some(lse_kind), default_plan());
    let heads = all_heads(s.heads);
    let want = s.reference(&q, &heads);
    check_outputs(label, &got, &want, &heads);
    (got.flag, want.faults)
}

/// A small random problem on the main path (split q, strided outputs, padded blocks, q_len
/// 2), both dtypes: the memcheck/racecheck case of dense decode.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_dense_small_random() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sanitize_dense_small_random"));
    for bf in [false, true] {
        let lens = (0..3).map(|_| rng.range(0, 80) as i32).collect();
        let spec = small_spec(lens, &mut rng);
        check_random_dense_in(bf, "sanitize small", &mut rng, &stream, &spec);
    }
}

/// Block-table entries -5 and >= num_blocks in columns a request uses: their rows are skipped
/// (as the reference skips them) and the flag records BadBlockId with the request and entry.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_dense_bad_block_ids() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sanitize_dense_bad_block_ids"));
    let spec = small_spec(vec![40, 50, 33], &mut rng);
    let s = DenseSetup::<bf16>::build(&mut rng, &spec);
    let ts = s.table_stride;
    let nb = s.cache.num_blocks as i32;

    let mut a = s.clone();
    a.table[ts + 1] = -5;
    let (flag, faults) = run_small("bad block -5", &mut rng, &stream, &a);
    assert_eq!(
        faults,
        [Fault {
            code: fault_code::BAD_BLOCK_ID,
            row: 1,
            value: -5
        }]
    );
    check_flag_is("bad block -5", flag, fault_code::BAD_BLOCK_ID, 1, -5);

    let mut b = s.clone();
    b.table[2 * ts + 2] = nb + 7;
    let (flag, faults) = run_small("bad block >= num_blocks", &mut rng, &stream, &b);
    assert_eq!(faults.len(), 1);
    check_flag_is(
        "bad block >= num_blocks",
        flag,
        fault_code::BAD_BLOCK_ID,
        2,
        nb + 7,
    );

    let mut c = s.clone();
    c.table[1] = i32::MAX;
    c.table[ts + 1] = -5;
    c.table[2 * ts] = nb;
    let (flag, faults) = run_small("three bad blocks", &mut rng, &stream, &c);
    assert_eq!(faults.len(), 3);
    check_flag("three bad blocks", flag, &faults);
}

/// A negative seq_len is treated as 0 (out 0, lse -inf) and one above max_blocks·block_size
/// is clamped, each recorded (NegativeSeqLen / SeqLenTooLarge with the request and value).
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_dense_bad_seq_lens() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sanitize_dense_bad_seq_lens"));
    let cap = 5 * 16;
    for (lens, want) in [
        (
            vec![-3, 20, 10],
            Some((fault_code::NEGATIVE_SEQ_LEN, 0, -3)),
        ),
        (
            vec![5, 10, cap + 9],
            Some((fault_code::SEQ_LEN_TOO_LARGE, 2, cap + 9)),
        ),
        (vec![i32::MIN, i32::MAX, cap], None),
    ] {
        let label = format!("seq_lens {lens:?}");
        let spec = small_spec(lens, &mut rng);
        let s = DenseSetup::<f16>::build(&mut rng, &spec);
        let (flag, faults) = run_small(&label, &mut rng, &stream, &s);
        match want {
            Some((code, row, value)) => {
                assert_eq!(faults, [Fault { code, row, value }], "{label}");
                check_flag_is(&label, flag, code, row as usize, value);
            }
            None => {
                assert_eq!(faults.len(), 2, "{label}");
                check_flag(&label, flag, &faults);
            }
        }
    }
}

/// The flag through `check`: clean run Ok; a bad block id gives `DeviceFault`; a second,
/// different fault does not replace the first; reset clears it; a clean run stays Ok; the
/// fault comes back when the bad entry does.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_dense_error_flag_reset_round_trip() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sanitize_dense_error_flag_reset_round_trip"));
    let spec = small_spec(vec![40, 50, 33], &mut rng);
    let s = DenseSetup::<bf16>::build(&mut rng, &spec);
    let q = HostQuery::<bf16>::random(&mut rng, QKind::Contiguous, s.tokens(), s.heads);
    let mut dev = DenseDev::upload(&stream, &s);
    let qd = q.upload(&stream);
    let mut out = DevOut::random(&mut rng, &stream, s.tokens(), s.heads);
    let flag = ErrorFlag::new(&stream).unwrap();
    let plan = DecodePlan::dense(&stream, s.shape(), default_plan()).unwrap();
    let ts = s.table_stride;
    let heads = all_heads(s.heads);

    let run = |table: &[i32], dev: &mut DenseDev<bf16>, out: &mut DevOut<bf16>| {
        stream.memcpy_htod(table, &mut dev.table).unwrap();
        out.poison(&stream);
        dev.decode(&stream, &s, &plan, &qd, out, None, Some(&flag))
            .unwrap();
    };
    let fault = |row: u32, value: i32| {
        Err(Error::DeviceFault {
            code: FaultCode::BadBlockId,
            row,
            value,
        })
    };

    run(&s.table, &mut dev, &mut out);
    assert_eq!(flag.check(&stream), Ok(()), "clean run");
    let got = Outputs::read(&stream, &out, None, &flag);
    check_outputs("clean run", &got, &s.reference(&q, &heads), &heads);

    let mut bad = s.table.clone();
    bad[ts] = -5;
    run(&bad, &mut dev, &mut out);
    assert_eq!(flag.check(&stream), fault(1, -5), "first fault");
    let mut bad2 = s.table.clone();
    bad2[2 * ts + 1] = 1_000_000;
    run(&bad2, &mut dev, &mut out);
    assert_eq!(flag.check(&stream), fault(1, -5), "first fault wins");

    flag.reset(&stream).unwrap();
    assert_eq!(flag.read(&stream).unwrap(), [0; 4], "after reset");
    assert_eq!(flag.check(&stream), Ok(()), "after reset");

    run(&s.table, &mut dev, &mut out);
    assert_eq!(flag.check(&stream), Ok(()), "clean run after reset");
    let got = Outputs::read(&stream, &out, None, &flag);
    check_outputs(
        "clean run after reset",
        &got,
        &s.reference(&q, &heads),
        &heads,
    );

    run(&bad2, &mut dev, &mut out);
    assert_eq!(flag.check(&stream), fault(2, 1_000_000), "fault again");
}

// ---------------------------------------------------------------------------------------------
// Append

/// Appends `n` random rows (token stride > 576, about a fifth of the slots -1) into a padded
/// cache and compares the whole cache buffer bitwise with the expected one; then a mapping
/// with bad slots: only the good rows are written, and the flag records a BadAppendSlot.
fn check_append<T: Half>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    num_blocks: usize,
    block_size: usize,
    n: usize,
) {
    let pad = 8 * rng.below(3);
    let mut host = HostCache::<T>::random(rng, num_blocks, block_size, pad);
    let mut dev = host.upload(stream);
    let slots_total = host.num_slots();
    let flag = ErrorFlag::new(stream).unwrap();

    let stride_bytes = host.stride_bytes();
    let append = |kv: &[T], stride: usize, slots: &[i64], dev: &mut CudaSlice<T>| {
        let kv_dev = stream.clone_htod(kv).unwrap();
        let slots_dev = stream.clone_htod(slots).unwrap();
        let mut cache = if pad == 0 {
            KvCacheMut::contiguous(dev.as_view_mut(), block_size)
        } else {
            KvCacheMut::strided(dev.as_view_mut(), block_size, num_blocks, stride_bytes)
        };
        append_kv(
            stream,
            &kv_dev.as_view(),
            stride,
            &slots_dev.as_view(),
            &mut cache,
            Some(&flag),
        )
        .unwrap();
    };
    let random_rows = |rng: &mut Rng, n: usize, stride: usize| {
        let mut kv = vec![T::nan(); (n - 1) * stride + HEAD_DIM];
        for i in 0..n {
            for v in &mut kv[i * stride..i * stride + HEAD_DIM] {
                *v = T::from_f64(rng.unit());
            }
        }
        kv
    };

    let stride = HEAD_DIM + 8 * rng.below(4);
    let kv = random_rows(rng, n, stride);
    let slots: Vec<i64> = rng
        .distinct(slots_total, n)
        .into_iter()
        .map(|s| if rng.below(5) == 0 { -1 } else { s as i64 })
        .collect();
    append(&kv, stride, &slots, &mut dev);
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
    let good = rng.distinct(slots_total, 2);
    let slots = [
        good[0] as i64,
        slots_total as i64,
        -7,
        1i64 << 40,
        -1,
        good[1] as i64,
    ];
    let kv = random_rows(rng, slots.len(), HEAD_DIM);
    append(&kv, HEAD_DIM, &slots, &mut dev);
    for (i, &slot) in slots.iter().enumerate() {
        if slot == good[0] as i64 || slot == good[1] as i64 {
            host.row_mut(slot as usize)
                .copy_from_slice(&kv[i * HEAD_DIM..(i + 1) * HEAD_DIM]);
        }
    }
    let faults: Vec<Fault> = [(1, slots_total as i32), (2, -7), (3, 0)]
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
    let mut rng = Rng::new(seed("append_kv_random_rows"));
    for (i, bs) in [16usize, 32, 64, 128].into_iter().enumerate() {
        let num_blocks = rng.range(40, 80);
        let n = rng.range(1, num_blocks * bs / 2);
        let label = format!("append bs {bs} blocks {num_blocks} rows {n}");
        if i % 2 == 0 {
            check_append::<bf16>(&label, &mut rng, &stream, num_blocks, bs, n);
        } else {
            check_append::<f16>(&label, &mut rng, &stream, num_blocks, bs, n);
        }
    }
}

/// A few rows into a small cache, with bad slots: the memcheck/racecheck case of append.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitize_append_kv() {
    let (_ctx, stream) = gpu();
    let mut rng = Rng::new(seed("sanitize_append_kv"));
    check_append::<bf16>("sanitize append bf16", &mut rng, &stream, 4, 16, 20);
    check_append::<f16>("sanitize append f16", &mut rng, &stream, 3, 32, 9);
}

// ---------------------------------------------------------------------------------------------
// CPU checks of the test machinery (not ignored: they need no GPU)

/// `dense_reference` (one request at a time over a compact repack, any head subset) equals
/// `reference::dense_decode` over the whole cache with the table repacked to stride
/// max_blocks_per_seq: padded blocks, strided tables, bad entries and bad seq_lens included.
#[test]
fn host_dense_reference_repack_matches_full_reference() {
    let mut rng = Rng::new(seed("host_dense_reference_repack_matches_full_reference"));
    for _ in 0..24 {
        let bs = rng.pick(&[16usize, 32, 64, 128]);
        let mbps = rng.range(1, 5);
        let cap = (mbps * bs) as i32;
        let batch = rng.range(1, 5);
        let lens: Vec<i32> = (0..batch)
            .map(|_| match rng.below(6) {
                0 => -(rng.range(1, 3) as i32),
                1 => cap + rng.range(1, 9) as i32,
                _ => rng.range(0, cap as usize) as i32,
            })
            .collect();
        let spec = DenseSpec {
            q_len: rng.range(1, 4),
            heads: rng.range(1, 3),
            block_size: bs,
            max_blocks_per_seq: mbps,
            table_pad: rng.below(3),
            block_pad: 8 * rng.below(3),
            spare_blocks: rng.below(3),
            junk_unused: rng.chance(0.5),
            seq_lens: lens,
            scale: rng.softmax_scale(),
        };
        let mut s = DenseSetup::<bf16>::build(&mut rng, &spec);
        for b in 0..batch {
            if rng.chance(0.3) {
                let j = rng.below(mbps);
                s.table[b * s.table_stride + j] = junk_block(&mut rng, s.cache.num_blocks);
            }
        }
        let q = HostQuery::<bf16>::random(&mut rng, QKind::Contiguous, s.tokens(), s.heads);
        let full_cache: Vec<f64> = (0..s.cache.num_slots())
            .flat_map(|slot| s.cache.row(slot).iter().map(|v| v.to_f64()))
            .collect();
        let table = repack(&s.table, batch, s.table_stride, mbps);
        let full = mla_decode::reference::dense_decode(&mla_decode::reference::DenseProblem {
            q: &q.values,
            batch,
            q_len: s.q_len,
            num_heads: s.heads,
            cache: mla_decode::reference::PagedCache {
                data: &full_cache,
                num_blocks: s.cache.num_blocks,
                block_size: bs,
            },
            block_table: &table,
            max_blocks_per_seq: mbps,
            seq_lens: &s.seq_lens,
            softmax_scale: s.scale as f64,
        });
        assert_eq!(s.reference(&q, &all_heads(s.heads)), full, "{spec:?}");
        let h = s.heads - 1;
        let sub = s.reference(&q, &[h]);
        assert_eq!(sub.faults, full.faults);
        for r in 0..s.tokens() {
            assert_eq!(sub.out_row(r, 0), full.out_row(r, h));
            assert_eq!(sub.lse_at(r, 0), full.lse_at(r, h));
        }
    }
}

/// Random layouts cover `tokens·heads·width` distinct elements inside the buffer, aligned as
/// asked; a random query's buffers hold its values where the layout says and NaN elsewhere.
#[test]
fn host_layouts_and_query_buffers() {
    let mut rng = Rng::new(seed("host_layouts_and_query_buffers"));
    for _ in 0..200 {
        let (tokens, heads) = (rng.range(1, 9), rng.range(1, 9));
        let width = rng.pick(&[1usize, 64, 512, 576]);
        let align = if width == 1 { 1 } else { 8 };
        let kind = Strided::random_kind(&mut rng);
        let l = Strided::new(&mut rng, kind, tokens, heads, width, align);
        let covered = l.covered();
        assert_eq!(covered.len(), l.len);
        let n = covered.iter().filter(|&&c| c).count();
        assert_eq!(n, tokens * heads * width, "{l:?}: rows overlap");
        assert_eq!(l.offset % align, 0);
        assert_eq!(l.token_stride % align, 0);
        assert_eq!(l.head_stride % align, 0);

        let qkind = QKind::random(&mut rng);
        let q = HostQuery::<f16>::random(&mut rng, qkind, tokens, heads);
        let mut seen = vec![vec![false; q.bufs[0].len()]];
        if q.bufs.len() == 2 {
            seen.push(vec![false; q.bufs[1].len()]);
        }
        let rb = q.bufs.len() - 1;
        for t in 0..tokens {
            for h in 0..heads {
                for d in 0..HEAD_DIM {
                    let (b, i) = if d < 512 {
                        (0, q.nope.at(t, h) + d)
                    } else {
                        (rb, q.rope.at(t, h) + d - 512)
                    };
                    assert_eq!(
                        q.bufs[b][i].to_f64(),
                        q.values[(t * heads + h) * HEAD_DIM + d]
                    );
                    seen[b][i] = true;
                }
            }
        }
        for (buf, seen) in q.bufs.iter().zip(&seen) {
            for (v, s) in buf.iter().zip(seen) {
                assert!(*s || v.to_f64().is_nan(), "{qkind:?}: a gap holds a number");
            }
        }
    }
}
