//! CUDA graphs through `capture_graph`: its refusals (event tracking on, allocating inside a
//! capture), a dense step replayed with new lengths and the flag snapshotted on the device
//! (`ErrorFlag::copy_to`), and a sparse step replayed with new indices, topk_len and queries
//! written into the captured buffers. (`repeat` replays a dense step with new tables too.)

use mla_decode::half::bf16;
use mla_decode::*;

use crate::kit::*;
use crate::plumbing::{cache_rows, close, expected};

/// A dense step captured in a graph and replayed with new lengths written into the captured
/// buffer; the flag's words copied out on the device after each replay.
#[test]
#[ignore = "needs a GPU"]
fn gpu_capture_graph() {
    // A context of its own: event tracking is turned off on it (context-wide, unsafe).
    let (ctx, tracked) = gpu();
    // SAFETY: nothing is captured (refused).
    let refused = unsafe { capture_graph(&tracked, || Ok(())) };
    assert!(
        matches!(refused, Err(Error::Capture(_))),
        "{:?}",
        refused.err()
    );
    // SAFETY: this test orders its work on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();

    let (heads, num_blocks) = (2, 4);
    let value = |slot: usize| (slot + 1) as f64 / 64.0;
    let cache = stream
        .clone_htod(&cache_rows::<bf16>(num_blocks, value))
        .unwrap();
    let table = stream.clone_htod(&[0i32, 1, 2, 3]).unwrap();
    let mut seq_lens = stream.clone_htod(&[1i32]).unwrap();
    let q = stream
        .clone_htod(&vec![bf16::from_f64(1.0 / 64.0); heads * HEAD_DIM])
        .unwrap();
    let mut out = stream.alloc_zeros::<bf16>(heads * LATENT_DIM).unwrap();
    let mut snapshot = stream.alloc_zeros::<u32>(4).unwrap();
    let shape = DenseShape {
        batch: 1,
        q_len: 1,
        num_heads: heads,
        block_size: 16,
        max_blocks_per_seq: 4,
        kv_format: KvFormat::Bf16,
    };
    let mut plan = DecodePlan::dense(&stream, shape, PlanOptions::default()).unwrap();
    let mut flag = ErrorFlag::new(&stream).unwrap();
    let scale = 0.5f32;

    let graph = {
        let args = DenseArgs {
            q: Query::contiguous(&q, heads),
            kv_cache: KvCache::contiguous(&cache, KvFormat::Bf16, 16).unwrap(),
            block_table: BlockTable::new(
                &table,
                TableShape {
                    batch: 1,
                    max_blocks_per_seq: 4,
                },
            ),
            seq_lens: &seq_lens,
            softmax_scale: scale,
        };
        // Warm-up outside the capture: every kernel launched once.
        dense_decode(
            &stream,
            &mut plan,
            &args,
            &mut Output::contiguous(&mut out, heads),
            None,
            Some(&mut flag),
        )
        .unwrap();
        flag.copy_to(&stream, &mut snapshot).unwrap();
        stream.synchronize().unwrap();
        // SAFETY: every buffer of the step outlives the graph.
        unsafe {
            capture_graph(&stream, || {
                // Allocating inside the capture is refused.
                let inner = DecodePlan::dense(&stream, shape, PlanOptions::default());
                assert!(matches!(inner, Err(Error::Capture(_))), "{inner:?}");
                assert!(matches!(ErrorFlag::new(&stream), Err(Error::Capture(_))));
                flag.reset(&stream)?;
                dense_decode(
                    &stream,
                    &mut plan,
                    &args,
                    &mut Output::contiguous(&mut out, heads),
                    None,
                    Some(&mut flag),
                )?;
                flag.copy_to(&stream, &mut snapshot)
            })
        }
        .unwrap()
    };
    for len in [1i32, 17, 64, 65] {
        stream.memcpy_htod(&[len], &mut seq_lens).unwrap();
        graph.launch().unwrap();
        let got = stream.clone_dtoh(&out).unwrap();
        let words = stream.clone_dtoh(&snapshot).unwrap();
        let visible = len.min(64) as usize;
        let cs: Vec<f64> = (0..visible).map(value).collect();
        for h in 0..heads {
            let (o, _) = expected(&cs, 9.0, scale as f64);
            close(
                got[h * LATENT_DIM].to_f64(),
                o,
                1e-2,
                &format!("len {len} out[{h}]"),
            );
        }
        if len > 64 {
            assert_eq!(words[..2], [3, 0], "len {len}: SeqLenTooLarge on request 0");
            assert_eq!(words[2], len as u32);
        } else {
            assert_eq!(words, [0; 4], "len {len}");
        }
    }
}

/// A sparse step (flag reset + decode, topk_len given) captured with `capture_graph`, then
/// replayed with new index rows (holes, duplicates, bad ids), topk_len values and queries
/// written into the captured buffers: every replay matches the reference, and its flag holds
/// one of the reference's faults (the captured reset clears the previous replay's).
#[test]
#[ignore = "needs a CUDA GPU"]
fn sparse_capture_graph_replay() {
    let (_ctx, stream) = gpu_for_graphs();
    let mut rng = rng_for("sparse_capture_graph_replay");
    let (tokens, heads, topk) = (24, 16, 300);
    let style = RowStyle {
        hole: 0.1,
        bad: 0.2,
    };
    let mut s = random_sparse::<bf16>(&mut rng, tokens, heads, topk, 40, 32, style, true);
    let heads_all = all_heads(heads);
    let mut q = HostQuery::<bf16>::random(&mut rng, QKind::Strided, tokens, heads);
    let mut dev = s.upload(&stream);
    let mut qd = q.upload(&stream);
    let mut out = DevOut::random(&mut rng, &stream, tokens, heads);
    let mut lse = DevLse::random(&mut rng, &stream, tokens, heads);
    let mut flag = ErrorFlag::new(&stream).unwrap();
    let mut plan = s.plan(&stream, PlanOptions::default());

    let graph = {
        let mut step = || -> Result<()> {
            flag.reset(&stream)?;
            s.decode(
                &stream,
                &dev,
                &mut plan,
                &qd,
                &mut out,
                Some(&mut lse),
                Some(&mut flag),
            )
        };
        step().unwrap(); // warm-up: every kernel launched once outside the capture
                         // SAFETY: every buffer of the step outlives the graph.
        unsafe { capture_graph(&stream, step) }.unwrap()
    };
    let got = Outputs::read(&stream, &out, Some(&lse), &flag);
    let want = s.reference(&q, &heads_all);
    check_flag("sparse graph warm-up", got.flag, &want.faults);
    check_outputs("sparse graph warm-up", &got, &want, &heads_all);

    let slots = s.cache.num_slots();
    for round in 1..=4 {
        let rows: Vec<Vec<i32>> = (0..tokens)
            .map(|_| index_row(&mut rng, slots, topk, style))
            .collect();
        s.indices = pack_rows(&mut rng, &rows, s.stride, slots);
        s.topk_len = Some(
            (0..tokens)
                .map(|_| topk_len_value(&mut rng, topk))
                .collect(),
        );
        q.refill(&mut rng);
        stream.memcpy_htod(&s.indices, &mut dev.indices).unwrap();
        let topk_len = dev.topk_len.as_mut().expect("topk_len buffer");
        stream
            .memcpy_htod(s.topk_len.as_ref().unwrap(), topk_len)
            .unwrap();
        qd.rewrite(&stream, &q);
        out.poison(&stream);
        lse.poison(&stream);
        graph.launch().unwrap();
        let got = Outputs::read(&stream, &out, Some(&lse), &flag);
        let want = s.reference(&q, &heads_all);
        let label = format!("sparse graph replay {round}");
        check_flag(&label, got.flag, &want.faults);
        check_outputs(&label, &got, &want, &heads_all);
    }
}

/// A per-tensor fp8 sparse step captured once, then replayed with its fp32 scale rewritten in
/// the captured device buffer (the reason the scale is a device pointer: engines update it
/// without re-capturing), new index rows, topk_len values and queries: every replay matches the
/// reference of the rescaled cache, and a replay with nothing rewritten repeats the previous
/// one bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_graph_replay_new_scale() {
    let (_ctx, stream) = gpu_for_graphs();
    let mut rng = rng_for("fp8_graph_replay_new_scale");
    let (tokens, heads, topk) = (20, 16, 700);
    let style = RowStyle {
        hole: 0.1,
        bad: 0.0,
    };
    let s = random_sparse::<bf16>(&mut rng, tokens, heads, topk, 40, 64, style, true);
    let mut p = Fp8::sparse(&mut rng, s, FP8_KINDS[2], 1.0);
    assert_eq!(p.fp8.layout.format, KvFormat::Fp8PerTensor);
    let heads_all = all_heads(heads);
    let mut q = HostQuery::<bf16>::random(&mut rng, QKind::Contiguous, tokens, heads);
    let mut dev = p.upload(&stream);
    let mut qd = q.upload(&stream);
    let mut out = DevOut::random(&mut rng, &stream, tokens, heads);
    let mut lse = DevLse::random(&mut rng, &stream, tokens, heads);
    let mut flag = ErrorFlag::new(&stream).unwrap();
    let mut plan = p.plan(&stream, PlanOptions::default());
    let graph = {
        let mut step = || -> Result<()> {
            flag.reset(&stream)?;
            p.decode(
                &stream,
                &dev,
                &mut plan,
                &qd,
                &mut out,
                Some(&mut lse),
                Some(&mut flag),
            )
        };
        step().unwrap(); // warm-up: every kernel launched once outside the capture
                         // SAFETY: every buffer of the step outlives the graph.
        unsafe { capture_graph(&stream, step) }.unwrap()
    };
    let slots = p.inner.cache.num_slots();
    let mut previous: Option<(Vec<u16>, Vec<u32>)> = None;
    // (the scale's factor: powers of two, so that the dequantized rows scale exactly; 1 with
    // nothing else rewritten: a bitwise repeat)
    for (round, factor) in [4.0f32, 0.125, 1.0, 32.0].into_iter().enumerate() {
        let repeat = factor == 1.0;
        if !repeat {
            p.fp8.tensor_scale *= factor;
            let values = p.inner.cache.values.as_mut().expect("dequantized rows");
            values.iter_mut().for_each(|v| *v *= factor as f64);
            stream
                .memcpy_htod(&[p.fp8.tensor_scale], &mut dev.cache.scale)
                .unwrap();
            let rows: Vec<Vec<i32>> = (0..tokens)
                .map(|_| index_row(&mut rng, slots, topk, style))
                .collect();
            p.inner.indices = pack_rows(&mut rng, &rows, p.inner.stride, slots);
            p.inner.topk_len = Some(
                (0..tokens)
                    .map(|_| topk_len_value(&mut rng, topk))
                    .collect(),
            );
            stream
                .memcpy_htod(&p.inner.indices, &mut dev.table)
                .unwrap();
            let topk_len = dev.lens.as_mut().expect("topk_len buffer");
            stream
                .memcpy_htod(p.inner.topk_len.as_ref().unwrap(), topk_len)
                .unwrap();
            q.refill(&mut rng);
            qd.rewrite(&stream, &q);
        }
        out.poison(&stream);
        lse.poison(&stream);
        graph.launch().unwrap();
        let got = Outputs::read(&stream, &out, Some(&lse), &flag);
        let label = format!("fp8 graph replay {round} (scale x{factor})");
        if repeat {
            let bits = got.logical_bits();
            assert!(
                previous.as_ref() == Some(&bits),
                "{label}: not bitwise equal to the previous replay"
            );
        }
        let want = p.reference_of(&q, &heads_all);
        check_flag(&label, got.flag, &want.faults);
        check_outputs(&label, &got, &want, &heads_all);
        previous = Some(got.logical_bits());
    }
}
