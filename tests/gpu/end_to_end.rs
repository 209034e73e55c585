//! Calls combined as an engine combines them: sparse decode over every slot of a request
//! equals dense decode of it, and a GLM-5 step whose indexer positions go through the gather
//! into sparse decode, all on the device.

use std::sync::Arc;

use mla_decode::cudarc::driver::CudaStream;
use mla_decode::half::{bf16, f16};
use mla_decode::{
    gather_slots, sparse_decode, DType, DecodePlan, ErrorFlag, GatherArgs, PlanOptions, SparseArgs,
    SparseIndices, SparseShape,
};

use crate::kit::*;

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
    let mut rng = rng_for("sparse_equals_dense_on_every_slot");
    for (round, dtype) in [(0, DType::Bf16), (1, DType::F16), (2, DType::Bf16)] {
        let label = format!("sparse == dense round {round}");
        with_dtype!(dtype, T => sparse_vs_dense::<T>(&label, &mut rng, &stream));
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
    let dev = d.upload(stream);
    let qd = q.upload(stream);
    let indices = stream.clone_htod(&s.indices).unwrap();
    let topk_len_dev = stream.clone_htod(s.topk_len.as_ref().unwrap()).unwrap();
    let mut flag = ErrorFlag::new(stream).unwrap();

    let mut dense_plan = DecodePlan::dense(stream, d.shape(), PlanOptions::default()).unwrap();
    let mut out_d = DevOut::random(rng, stream, tokens, heads);
    let mut lse_d = DevLse::random(rng, stream, tokens, heads);
    d.decode(
        stream,
        &dev,
        &mut dense_plan,
        &qd,
        &mut out_d,
        Some(&mut lse_d),
        Some(&mut flag),
    )
    .unwrap();
    let dense_got = Outputs::read(stream, &out_d, Some(&lse_d), &flag);

    let mut sparse_plan = DecodePlan::sparse(stream, s.shape(), PlanOptions::default()).unwrap();
    let mut out_s = DevOut::random(rng, stream, tokens, heads);
    let mut lse_s = DevLse::random(rng, stream, tokens, heads);
    {
        let args = SparseArgs {
            q: qd.view(),
            kv_cache: d.cache.view(&dev.cache), // the dense call's cache buffer
            indices: s.indices_view(&indices),
            topk_len: Some(&topk_len_dev),
            softmax_scale: s.scale,
        };
        sparse_decode(
            stream,
            &mut sparse_plan,
            &args,
            &mut out_s.view(),
            Some(&mut lse_s.view()),
            Some(&mut flag),
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
    let mut rng = rng_for("sparse_glm5_gather_end_to_end");
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
            rng.sample(len, topk)
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

    let dev = d.upload(stream);
    let positions_dev = stream.clone_htod(&g.positions).unwrap();
    let req_dev = stream.clone_htod(&g.req_id).unwrap();
    let mut slots_dev = stream
        .clone_htod(&vec![GATHER_POISON; g.out_len()])
        .unwrap();
    let mut flag = ErrorFlag::new(stream).unwrap();
    let gather = GatherArgs {
        positions: &positions_dev,
        positions_stride: g.pos_stride,
        req_id: &req_dev,
        block_table: d.table_view(&dev.table),
        seq_lens: &dev.seq_lens,
        kv_cache: d.cache.view(&dev.cache), // the cache the sparse decode reads
        topk,
        num_tokens: tokens,
        out_stride: g.out_stride,
    };
    gather_slots(stream, &gather, &mut slots_dev, Some(&mut flag)).unwrap();

    let kind = QKind::random(rng);
    let q = HostQuery::<T>::random(rng, kind, tokens, heads);
    let qd = q.upload(stream);
    let mut plan = DecodePlan::sparse(
        stream,
        SparseShape {
            num_tokens: tokens,
            num_heads: heads,
            topk,
            kv_format: T::DTYPE.kv_format(),
        },
        PlanOptions::default(),
    )
    .unwrap();
    let mut out = DevOut::random(rng, stream, tokens, heads);
    let mut lse = DevLse::random(rng, stream, tokens, heads);
    {
        let args = SparseArgs {
            q: qd.view(),
            kv_cache: d.cache.view(&dev.cache),
            indices: SparseIndices::contiguous(&slots_dev, topk).with_row_stride(g.out_stride),
            topk_len: None,
            softmax_scale: scale,
        };
        sparse_decode(
            stream,
            &mut plan,
            &args,
            &mut out.view(),
            Some(&mut lse.view()),
            Some(&mut flag),
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
