//! The soak's decode calls: dense and sparse, good, device-bad and host-bad.

use mla_decode::cudarc::driver::CudaSlice;
use mla_decode::reference::Attention;
use mla_decode::validate::{DENSE_ARGS, SPARSE_ARGS};
use mla_decode::*;

use super::{
    check_refused, checked_heads, fp8_format, random_heads, Kind, Limits, Refusal, Soak, SoakElem,
    SHARED_SLOTS,
};
use crate::kit::*;

/// A random dense plan shape of `format`: rows × capacity within the work budget.
fn dense_shape(rng: &mut Rng, lim: &Limits, format: KvFormat) -> PlanKind {
    let q_len = rng.pick(&[1, 1, 1, 2, 3, 4, 8]);
    let batch = rng.range(1, (lim.rows / q_len).max(1));
    let rows = batch * q_len;
    let block_size = rng.pick(&BLOCK_SIZES);
    let cap = (lim.work / rows).clamp(block_size, lim.len);
    PlanKind::Dense(DenseShape {
        batch,
        q_len,
        num_heads: random_heads(rng, lim, rows),
        block_size,
        max_blocks_per_seq: rng.range(1, cap / block_size),
        kv_format: format,
    })
}

/// A random sparse plan shape of `format`: tokens × topk within the work budget.
fn sparse_shape(rng: &mut Rng, lim: &Limits, format: KvFormat) -> PlanKind {
    let num_tokens = rng.range(1, lim.rows);
    let small = rng.range(1, 64);
    let topk = rng
        .pick(&[small, 128, 300, 512, 1024, 2048, 4096])
        .min(lim.topk)
        .min((lim.work / num_tokens).max(1));
    PlanKind::Sparse(SparseShape {
        num_tokens,
        num_heads: random_heads(rng, lim, num_tokens),
        topk,
        kv_format: format,
    })
}

/// What the device must leave after a refused call: outputs still poisoned, flag clear.
fn check_untouched<T: Half>(label: &str, s: &Soak, out: &DevOut<T>, lse: Option<&DevLse>) {
    let got = Outputs::read(&s.stream, out, lse, &s.flag);
    assert!(
        got.out.iter().all(|v| v.bits() == POISON),
        "{label}: refused, but out was written"
    );
    if let Some((l, _)) = &got.lse {
        assert!(
            l.iter().all(|v| v.is_nan()),
            "{label}: refused, but lse was written"
        );
    }
    assert_eq!(
        got.flag, [0; 4],
        "{label}: refused, but a kernel recorded a fault"
    );
}

/// Compares a decode's outputs and flag with the reference.
fn check_result<T: Half>(
    label: &str,
    s: &Soak,
    with_flag: bool,
    out: &DevOut<T>,
    lse: Option<&DevLse>,
    want: &Attention,
    heads: &[usize],
) {
    let got = Outputs::read(&s.stream, out, lse, &s.flag);
    if with_flag {
        check_flag(label, got.flag, &want.faults);
    }
    check_outputs(label, &got, want, heads);
}

/// An fp8 plan of `kind`'s shape and an fp8 cache for it (the soak passes the cache with the
/// f16/bf16 plan: a cache of the wrong format).
fn fp8_case(
    s: &mut Soak,
    kind: PlanKind,
    block_size: usize,
) -> (DecodePlan, CudaSlice<u8>, CacheLayout, CudaSlice<f32>) {
    let format = fp8_format(&mut s.rng);
    let plan = match kind {
        PlanKind::Dense(d) => DecodePlan::dense(
            &s.stream,
            DenseShape {
                kv_format: format,
                ..d
            },
            plan_options(false),
        ),
        PlanKind::Sparse(sp) => DecodePlan::sparse(
            &s.stream,
            SparseShape {
                kv_format: format,
                ..sp
            },
            plan_options(false),
        ),
    }
    .unwrap();
    let layout = CacheLayout {
        format,
        block_size,
        num_blocks: 4,
        block_stride_bytes: block_size * format.row_bytes(),
    };
    let bytes = s
        .stream
        .alloc_zeros::<u8>(4 * layout.block_stride_bytes)
        .unwrap();
    let scale = s.stream.clone_htod(&[1.0f32 / 64.0]).unwrap();
    (plan, bytes, layout, scale)
}

fn fp8_view<'a>(
    bytes: &'a CudaSlice<u8>,
    layout: CacheLayout,
    scale: &'a CudaSlice<f32>,
) -> KvCache<'a> {
    let c = KvCache::new(bytes, layout);
    if layout.format.needs_tensor_scale() {
        c.with_scale(scale)
    } else {
        c
    }
}

/// The other 16-bit format (a cache of the wrong format for the plan).
fn other_format(dtype: DType) -> KvFormat {
    match dtype {
        DType::F16 => KvFormat::Bf16,
        DType::Bf16 => KvFormat::F16,
    }
}

/// One dense decode call of `kind`.
pub(crate) fn dense<T: SoakElem>(s: &mut Soak, label: &str, kind: Kind) {
    let format = T::DTYPE.kv_format();
    let mut plan = s.take_plan(
        |k| matches!(k, PlanKind::Dense(d) if d.kv_format == format),
        |rng, lim| dense_shape(rng, lim, format),
    );
    let PlanKind::Dense(shape) = plan.kind() else {
        unreachable!()
    };
    let (batch, q_len, heads, bs, mbps) = (
        shape.batch,
        shape.q_len,
        shape.num_heads,
        shape.block_size,
        shape.max_blocks_per_seq,
    );
    let (cap, rows, nb) = (mbps * bs, batch * q_len, SHARED_SLOTS / bs);
    let shared = s.shared::<T>(bs);
    let rng = &mut s.rng;

    // (edge_len may give block_size + 1 > a one-block capacity: clamped, that is a fault.)
    let mut seq_lens: Vec<i32> = (0..batch)
        .map(|_| edge_len(rng, cap, bs).min(cap) as i32)
        .collect();
    // Device-visible faults: 0 a bad block id in a used column, 1 a negative seq_len, 2 one
    // past the table's capacity. Host-bad calls carry a bad block id too: launched, they
    // would record it.
    let fault = match kind {
        Kind::Good => None,
        Kind::DeviceBad => Some(rng.below(3)),
        Kind::HostBad => Some(0),
    };
    let b = rng.below(batch);
    match fault {
        Some(1) => {
            let v = -(rng.range(2, 5000) as i32);
            seq_lens[b] = rng.pick(&[-1, v, i32::MIN]);
        }
        Some(2) => {
            let v = cap as i32 + rng.range(2, 5000) as i32;
            seq_lens[b] = rng.pick(&[cap as i32 + 1, v, i32::MAX]);
        }
        Some(_) => seq_lens[b] = seq_lens[b].max(1),
        None => {}
    }
    let stride = mbps + rng.below(3);
    let mut table = vec![0i32; batch * stride];
    for r in 0..batch {
        let needed = (seq_lens[r].clamp(0, cap as i32) as usize).div_ceil(bs);
        for j in 0..stride {
            table[r * stride + j] = if j < needed {
                rng.below(nb) as i32
            } else {
                junk_block(rng, nb)
            };
        }
    }
    if fault == Some(0) {
        let needed = (seq_lens[b].clamp(0, cap as i32) as usize).div_ceil(bs);
        table[b * stride + rng.below(needed)] = junk_block(rng, nb);
    }
    let qkind = QKind::random(rng);
    let q = HostQuery::<T>::random(rng, qkind, rows, heads);
    let scale = rng.softmax_scale();
    let checked = checked_heads(rng, heads);
    let lse_kind = random_lse_kind(rng);

    let stream = s.stream.clone();
    let dq = q.upload(&stream);
    let mut out = DevOut::<T>::random(&mut s.rng, &stream, rows, heads);
    let mut lse =
        lse_kind.map(|k| DevLse::new(&stream, Strided::new(&mut s.rng, k, rows, heads, 1, 1)));
    let table_dev = stream.clone_htod(&table).unwrap();
    let lens_dev = stream.clone_htod(&seq_lens).unwrap();
    let with_flag = s.flag_for(kind);
    let tshape = TableShape {
        batch,
        max_blocks_per_seq: mbps,
    };
    let base = || DenseArgs {
        q: dq.view(),
        kv_cache: shared.host.view(&shared.dev),
        block_table: BlockTable::new(&table_dev, tshape).with_row_stride(stride),
        seq_lens: &lens_dev,
        softmax_scale: scale,
    };

    if kind == Kind::HostBad {
        // Buffers the bad variants use, then the one bad variant: a single argument made bad.
        let choice = s.rng.below(12);
        let mut other = if choice == 0 {
            s.other_plan(true)
        } else {
            None
        };
        let mut fp8 = (choice >= 10).then(|| fp8_case(s, plan.kind(), bs));
        let plain_q = stream
            .alloc_zeros::<T>(rows * heads * HEAD_DIM + 8)
            .unwrap();
        let contiguous =
            |rng: &mut Rng, width| Strided::new(rng, RowsKind::Contiguous, rows, heads, width, 8);
        let mut plain_out = DevOut::<T>::new(&stream, contiguous(&mut s.rng, LATENT_DIM));
        let mut plain_lse = DevLse::new(&stream, contiguous(&mut s.rng, 1));
        let short_table = table_dev.slice(..(batch - 1) * stride + mbps - 1);
        let short_lens = lens_dev.slice(..batch - 1);
        let wrong_format = CacheLayout {
            format: other_format(T::DTYPE),
            ..shared.host.layout()
        };
        let bad_scale = s.rng.pick(&[f32::NAN, 0.0, -0.0625, f32::INFINITY]);

        let mut use_plan = &mut plan;
        let mut args = base();
        let mut out_view = out.view();
        let mut lse_view = lse.as_mut().map(|l| l.view());
        let want = match choice {
            0 if other.is_some() => {
                use_plan = other.as_mut().unwrap();
                Refusal::Arg("plan")
            }
            0 | 1 => {
                args.softmax_scale = bad_scale;
                Refusal::Arg("softmax_scale")
            }
            2 => {
                args.kv_cache = KvCache::new(&shared.dev, wrong_format);
                Refusal::Arg("kv_cache")
            }
            3 => {
                args.block_table = BlockTable::new(&short_table, tshape).with_row_stride(stride);
                Refusal::Arg("block_table")
            }
            4 => {
                let t = TableShape {
                    batch: batch + 1,
                    ..tshape
                };
                args.block_table = BlockTable::new(&table_dev, t).with_row_stride(stride);
                Refusal::Arg("block_table")
            }
            5 if batch > 1 => {
                args.seq_lens = &short_lens;
                Refusal::Arg("seq_lens")
            }
            5 | 6 => {
                args.q = Query::contiguous(&plain_q, heads + 1);
                Refusal::Arg("q")
            }
            7 => {
                args.q = Query::contiguous(plain_q.slice(1..), heads);
                Refusal::Arg("q")
            }
            8 => {
                out_view = Output::contiguous(plain_out.raw_mut(), heads + 1);
                Refusal::Arg("out")
            }
            9 => {
                let n = plain_lse.layout.len;
                lse_view = Some(Lse::contiguous(
                    plain_lse.raw_mut().slice_mut(..n - 1),
                    heads,
                ));
                Refusal::Arg("lse")
            }
            _ => {
                // an fp8 cache with the f16/bf16 plan (fp8 decode itself is supported)
                let (_, bytes, layout, scale) = fp8.as_mut().unwrap();
                args.kv_cache = fp8_view(bytes, *layout, scale);
                Refusal::Arg("kv_cache")
            }
        };
        let res = dense_decode(
            &stream,
            use_plan,
            &args,
            &mut out_view,
            lse_view.as_mut(),
            Some(&mut s.flag),
        );
        check_refused(label, res, want, DENSE_ARGS);
        check_untouched(label, s, &out, lse.as_ref());
        check_untouched(label, s, &plain_out, Some(&plain_lse));
        if let Some(p) = other {
            s.put_plan(p);
        }
        s.put_plan(plan);
        return;
    }

    let flag = if with_flag { Some(&mut s.flag) } else { None };
    let mut lse_view = lse.as_mut().map(|l| l.view());
    dense_decode(
        &stream,
        &mut plan,
        &base(),
        &mut out.view(),
        lse_view.as_mut(),
        flag,
    )
    .unwrap_or_else(|e| panic!("{label}: {e}"));
    let want = dense_reference(
        &DenseInputs {
            q: &q.values,
            batch,
            q_len,
            num_heads: heads,
            cache: &shared.host,
            table: &table,
            table_stride: stride,
            max_blocks_per_seq: mbps,
            seq_lens: &seq_lens,
            softmax_scale: scale as f64,
        },
        &checked,
    );
    if kind == Kind::DeviceBad {
        assert!(!want.faults.is_empty(), "{label}: no fault was injected");
    }
    check_result(label, s, with_flag, &out, lse.as_ref(), &want, &checked);
    s.put_plan(plan);
}

/// One sparse decode call of `kind`.
pub(crate) fn sparse<T: SoakElem>(s: &mut Soak, label: &str, kind: Kind) {
    let format = T::DTYPE.kv_format();
    let mut plan = s.take_plan(
        |k| matches!(k, PlanKind::Sparse(sp) if sp.kv_format == format),
        |rng, lim| sparse_shape(rng, lim, format),
    );
    let PlanKind::Sparse(shape) = plan.kind() else {
        unreachable!()
    };
    let (tokens, heads, topk) = (shape.num_tokens, shape.num_heads, shape.topk);
    let bs = s.rng.pick(&BLOCK_SIZES);
    let shared = s.shared::<T>(bs);
    let rng = &mut s.rng;
    let slots = SHARED_SLOTS;

    let style = RowStyle {
        hole: rng.pick(&[0.0, 0.05, 0.5]),
        bad: 0.0,
    };
    let mut rows: Vec<Vec<i32>> = (0..tokens)
        .map(|_| index_row(rng, slots, topk, style))
        .collect();
    let mut topk_len: Option<Vec<i32>> = rng
        .chance(0.5)
        .then(|| (0..tokens).map(|_| rng.range(0, topk) as i32).collect());
    // Device-visible faults: 0 bad slot ids (read: within topk_len), 1 a topk_len outside
    // 0..=topk. Host-bad calls carry a bad id too: launched, they would record it.
    let t = rng.below(tokens);
    let fault = match kind {
        Kind::Good => None,
        Kind::DeviceBad => Some(rng.below(2)),
        Kind::HostBad => Some(0),
    };
    match fault {
        Some(1) => {
            let mut l = topk_len.unwrap_or_else(|| vec![topk as i32; tokens]);
            let (neg, over) = (
                -(rng.range(2, 100) as i32),
                topk as i32 + rng.range(1, 1000) as i32,
            );
            l[t] = rng.pick(&[-1, neg, over, i32::MAX, i32::MIN]);
            topk_len = Some(l);
        }
        Some(_) => {
            let n = topk_len.as_ref().map_or(topk, |l| l[t] as usize).max(1);
            if let Some(l) = topk_len.as_mut() {
                l[t] = n as i32;
            }
            rows[t][rng.below(n)] = bad_slot(rng, slots);
        }
        None => {}
    }
    let stride = if rng.chance(0.5) {
        topk
    } else {
        topk + rng.range(1, 9)
    };
    let indices = pack_rows(rng, &rows, stride, slots);
    let qkind = QKind::random(rng);
    let q = HostQuery::<T>::random(rng, qkind, tokens, heads);
    let scale = rng.softmax_scale();
    let checked = checked_heads(rng, heads);
    let lse_kind = random_lse_kind(rng);

    let stream = s.stream.clone();
    let dq = q.upload(&stream);
    let mut out = DevOut::<T>::random(&mut s.rng, &stream, tokens, heads);
    let mut lse =
        lse_kind.map(|k| DevLse::new(&stream, Strided::new(&mut s.rng, k, tokens, heads, 1, 1)));
    let indices_dev = stream.clone_htod(&indices).unwrap();
    let topk_len_dev = topk_len.as_ref().map(|l| stream.clone_htod(l).unwrap());
    let with_flag = s.flag_for(kind);
    let base = || SparseArgs {
        q: dq.view(),
        kv_cache: shared.host.view(&shared.dev),
        indices: SparseIndices::contiguous(&indices_dev, topk).with_row_stride(stride),
        topk_len: topk_len_dev.as_ref().map(|l| l as _),
        softmax_scale: scale,
    };

    if kind == Kind::HostBad {
        let choice = s.rng.below(12);
        let mut other = if choice == 0 {
            s.other_plan(false)
        } else {
            None
        };
        let mut fp8 = (choice >= 10).then(|| fp8_case(s, plan.kind(), bs));
        let plain_q = stream
            .alloc_zeros::<T>(tokens * heads * HEAD_DIM + 8)
            .unwrap();
        let contiguous =
            |rng: &mut Rng, width| Strided::new(rng, RowsKind::Contiguous, tokens, heads, width, 8);
        let mut plain_out = DevOut::<T>::new(&stream, contiguous(&mut s.rng, LATENT_DIM));
        let mut plain_lse = DevLse::new(&stream, contiguous(&mut s.rng, 1));
        let short_topk_len = stream.alloc_zeros::<i32>(tokens.max(2) - 1).unwrap();
        let short_indices = indices_dev.slice(..(tokens - 1) * stride + topk - 1);
        let wrong_format = CacheLayout {
            format: other_format(T::DTYPE),
            ..shared.host.layout()
        };
        let bad_scale = s.rng.pick(&[f32::NAN, 0.0, -0.0625, f32::NEG_INFINITY]);

        let mut use_plan = &mut plan;
        let mut args = base();
        let mut out_view = out.view();
        let mut lse_view = lse.as_mut().map(|l| l.view());
        let want = match choice {
            0 if other.is_some() => {
                use_plan = other.as_mut().unwrap();
                Refusal::Arg("plan")
            }
            0 | 1 => {
                args.softmax_scale = bad_scale;
                Refusal::Arg("softmax_scale")
            }
            2 => {
                args.kv_cache = KvCache::new(&shared.dev, wrong_format);
                Refusal::Arg("kv_cache")
            }
            3 if tokens > 1 => {
                args.topk_len = Some(&short_topk_len);
                Refusal::Arg("topk_len")
            }
            3 | 4 if topk < MAX_TOPK => {
                args.indices = SparseIndices::contiguous(&indices_dev, topk + 1);
                Refusal::Arg("indices")
            }
            3 | 4 => {
                args.indices =
                    SparseIndices::contiguous(&short_indices, topk).with_row_stride(stride);
                Refusal::Arg("indices")
            }
            5 | 6 => {
                args.q = Query::contiguous(&plain_q, heads + 1);
                Refusal::Arg("q")
            }
            7 => {
                args.q = Query::contiguous(plain_q.slice(1..), heads);
                Refusal::Arg("q")
            }
            8 => {
                let n = plain_out.layout.len;
                out_view = Output::contiguous(plain_out.raw_mut().slice_mut(..n - 8), heads);
                Refusal::Arg("out")
            }
            9 => {
                let n = plain_lse.layout.len;
                lse_view = Some(Lse::contiguous(
                    plain_lse.raw_mut().slice_mut(..n - 1),
                    heads,
                ));
                Refusal::Arg("lse")
            }
            _ => {
                // an fp8 cache with the f16/bf16 plan (fp8 decode itself is supported)
                let (_, bytes, layout, scale) = fp8.as_mut().unwrap();
                args.kv_cache = fp8_view(bytes, *layout, scale);
                Refusal::Arg("kv_cache")
            }
        };
        let res = sparse_decode(
            &stream,
            use_plan,
            &args,
            &mut out_view,
            lse_view.as_mut(),
            Some(&mut s.flag),
        );
        check_refused(label, res, want, SPARSE_ARGS);
        check_untouched(label, s, &out, lse.as_ref());
        check_untouched(label, s, &plain_out, Some(&plain_lse));
        if let Some(p) = other {
            s.put_plan(p);
        }
        s.put_plan(plan);
        return;
    }

    let flag = if with_flag { Some(&mut s.flag) } else { None };
    let mut lse_view = lse.as_mut().map(|l| l.view());
    sparse_decode(
        &stream,
        &mut plan,
        &base(),
        &mut out.view(),
        lse_view.as_mut(),
        flag,
    )
    .unwrap_or_else(|e| panic!("{label}: {e}"));
    let want = sparse_reference(
        &SparseInputs {
            q: &q.values,
            num_tokens: tokens,
            num_heads: heads,
            cache: &shared.host,
            indices: &indices,
            indices_stride: stride,
            topk,
            topk_len: topk_len.as_deref(),
            softmax_scale: scale as f64,
        },
        &checked,
    );
    if kind == Kind::DeviceBad {
        assert!(!want.faults.is_empty(), "{label}: no fault was injected");
    }
    check_result(label, s, with_flag, &out, lse.as_ref(), &want, &checked);
    s.put_plan(plan);
}
