//! The same work again: one plan decoding two layers, a step captured in a CUDA graph and
//! replayed with new lengths, tables and queries written in place, and bitwise determinism
//! (the same inputs and plan, or a second plan of the same shape, give the same bits; dense
//! and sparse through one generic body).

use std::sync::Arc;

use mla_decode::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use mla_decode::cudarc::driver::CudaStream;
use mla_decode::half::{bf16, f16};
use mla_decode::{DecodePlan, ErrorFlag, PlanOptions};

use crate::kit::*;

/// One plan and one seq_lens buffer used by the decode of two layers (different q and caches,
/// same table), then layer 1 again: both layers match the reference and the repeat is bitwise
/// identical.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_plan_reused_by_two_layers() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("dense_plan_reused_by_two_layers");
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
    let (dev1, dev2) = (s1.upload(&stream), s2.upload(&stream));
    let (qd1, qd2) = (q1.upload(&stream), q2.upload(&stream));
    let mut flag = ErrorFlag::new(&stream).unwrap();
    let mut plan = DecodePlan::dense(&stream, s1.shape(), PlanOptions::default()).unwrap();

    let mut outs = Vec::new();
    for (s, dev, qd) in [(&s1, &dev1, &qd1), (&s2, &dev2, &qd2), (&s1, &dev1, &qd1)] {
        let mut out = DevOut::random(&mut rng, &stream, s.tokens(), s.heads);
        let mut lse = DevLse::random(&mut rng, &stream, s.tokens(), s.heads);
        s.decode(
            &stream,
            dev,
            &mut plan,
            qd,
            &mut out,
            Some(&mut lse),
            Some(&mut flag),
        )
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
    let mut rng = rng_for("dense_cuda_graph_capture_and_replay");
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
    s.reassign_table(&mut rng);
    let heads = all_heads(s.heads);
    let mut q = HostQuery::<bf16>::random(&mut rng, QKind::SplitSeparate, s.tokens(), s.heads);
    let mut dev = s.upload(&stream);
    let mut qd = q.upload(&stream);
    let mut out = DevOut::random(&mut rng, &stream, s.tokens(), s.heads);
    let mut lse = DevLse::random(&mut rng, &stream, s.tokens(), s.heads);
    let mut flag = ErrorFlag::new(&stream).unwrap();
    let mut plan = DecodePlan::dense(&stream, s.shape(), PlanOptions::default()).unwrap();

    // Warm-up outside the capture (first launches may set kernel attributes).
    s.decode(
        &stream,
        &dev,
        &mut plan,
        &qd,
        &mut out,
        Some(&mut lse),
        Some(&mut flag),
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
    s.decode(
        &stream,
        &dev,
        &mut plan,
        &qd,
        &mut out,
        Some(&mut lse),
        Some(&mut flag),
    )
    .unwrap();
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a captured graph");

    for round in 1..=4 {
        s.seq_lens = random_lens(&mut rng);
        s.reassign_table(&mut rng);
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

/// Decodes `p` three times (the same plan twice, then a fresh plan made the same way) into
/// the same poisoned buffers: the first run matches the reference and the other two are
/// bitwise identical to it.
fn check_deterministic<P: Problem>(label: &str, rng: &mut Rng, stream: &Arc<CudaStream>, p: &P) {
    let q = HostQuery::<P::Elem>::random(rng, QKind::Contiguous, p.rows(), p.heads());
    let dev = p.upload(stream);
    let qd = q.upload(stream);
    let mut flag = ErrorFlag::new(stream).unwrap();
    let mut out = DevOut::random(rng, stream, p.rows(), p.heads());
    let mut lse = DevLse::random(rng, stream, p.rows(), p.heads());
    let mut plan = p.plan(stream, PlanOptions::default());
    let mut runs = Vec::new();
    for fresh_plan in [false, false, true] {
        if fresh_plan {
            plan = p.plan(stream, PlanOptions::default());
        }
        out.poison(stream);
        lse.poison(stream);
        p.decode(
            stream,
            &dev,
            &mut plan,
            &qd,
            &mut out,
            Some(&mut lse),
            Some(&mut flag),
        )
        .unwrap();
        runs.push(Outputs::read(stream, &out, Some(&lse), &flag));
    }
    let heads = all_heads(p.heads());
    let want = p.reference_of(&q, &heads);
    check_flag(label, runs[0].flag, &want.faults);
    check_outputs(label, &runs[0], &want, &heads);
    let bits0 = runs[0].logical_bits();
    assert!(
        runs[1].logical_bits() == bits0,
        "{label}: same inputs and plan: out/lse differ bitwise"
    );
    assert!(
        runs[2].logical_bits() == bits0,
        "{label}: same inputs, a second plan of the same shape: out/lse differ bitwise"
    );
}

/// The same inputs and plan twice give bitwise the same out and lse, and so does a second
/// plan made the same way (long sequences: many split parts and a combine).
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_deterministic_bitwise() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("dense_deterministic_bitwise");
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
    check_deterministic("determinism", &mut rng, &stream, &s);
}

/// Same inputs and plan twice, and a second plan made the same way: bitwise the same output.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_deterministic_bitwise() {
    let (_ctx, stream) = gpu();
    let mut rng = rng_for("sparse_deterministic_bitwise");
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    let s = random_sparse::<bf16>(&mut rng, 64, 16, 2048, 1100, 64, style, true);
    check_deterministic("sparse determinism", &mut rng, &stream, &s);
}
