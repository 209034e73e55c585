//! GPU tests of the safe layer's plumbing: small cases whose answers follow from the inputs
//! by hand: cache rows that are constant across their 576 dims, so that a score is
//! `scale · c · Σq`. They check that pointers, strides, lengths, plans, the error flag and
//! validation reach the kernels as meant; numerical accuracy is the other modules' business.

use std::sync::Arc;

use mla_decode::cudarc::driver::{result, CudaStream, DevicePtr};
use mla_decode::half::{bf16, f16};
use mla_decode::*;

use crate::kit::gpu;

fn stream() -> Arc<CudaStream> {
    gpu().1
}

/// Writes `words` into the flag's 4 device words, as a kernel that found a fault would.
fn write_flag(stream: &Arc<CudaStream>, flag: &ErrorFlag, words: [u32; 4]) {
    stream.context().bind_to_thread().unwrap();
    let (ptr, _guard) = flag.raw().device_ptr(stream);
    // SAFETY: the flag owns 16 bytes at `ptr`; the copy is ordered on `stream`, which is
    // synchronized before `words` goes out of scope.
    unsafe { result::memcpy_htod_async(ptr, &words[..], stream.cu_stream()) }.unwrap();
    stream.synchronize().unwrap();
}

/// Cache of `num_blocks` blocks of 16 rows: row `slot` = `value(slot)` in all 576 dims.
fn cache_rows<T: Element>(num_blocks: usize, value: impl Fn(usize) -> f64) -> Vec<T> {
    (0..num_blocks * 16 * HEAD_DIM)
        .map(|i| T::from_f64(value(i / HEAD_DIM)))
        .collect()
}

/// `(out, lse)` of attention over rows of constant values `cs` with `Σq = qsum`.
fn expected(cs: &[f64], qsum: f64, scale: f64) -> (f64, f64) {
    let w: Vec<f64> = cs.iter().map(|c| (scale * c * qsum).exp()).collect();
    let total: f64 = w.iter().sum();
    let out = w.iter().zip(cs).map(|(w, c)| w * c).sum::<f64>() / total;
    (out, total.ln())
}

#[track_caller]
fn close(got: f64, want: f64, tol: f64, what: &str) {
    assert!(
        (got - want).abs() <= tol * want.abs().max(1.0),
        "{what}: got {got}, want {want}"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_device_info_and_error_flag() {
    let stream = stream();
    let info = DeviceInfo::query(stream.context()).unwrap();
    assert!(info.sm_count > 0 && !info.name.is_empty(), "{info:?}");
    assert!(info.compute_capability >= (8, 0), "{info:?}");
    assert!(
        info.max_shared_memory_per_block_optin >= 99 * 1024,
        "{info:?}"
    );
    assert!(info.l2_cache_bytes > 0, "{info:?}");

    let flag = ErrorFlag::new(&stream).unwrap();
    assert_eq!(flag.check(&stream), Ok(()));
    write_flag(&stream, &flag, [3u32, 7, (-2i32) as u32, 0]);
    assert_eq!(
        flag.check(&stream),
        Err(Error::DeviceFault {
            code: FaultCode::SeqLenTooLarge,
            row: 7,
            value: -2
        })
    );
    flag.reset(&stream).unwrap();
    assert_eq!(flag.read(&stream).unwrap(), [0; 4]);
}

/// Dense bf16, 1 request, 2 heads, blocks of 16; logical blocks [2, 0]; seq_len 3, so the
/// visible slots are 32, 33, 34 (values 1, 2, 3); every other row holds 100.
#[test]
#[ignore = "needs a GPU"]
fn gpu_dense_plumbing() {
    let stream = stream();
    let heads = 2;
    let num_blocks = 4;
    let value = |slot: usize| match slot {
        32..=34 => (slot - 31) as f64,
        _ => 100.0,
    };
    let cache = stream
        .clone_htod(&cache_rows::<bf16>(num_blocks, value))
        .unwrap();
    let table = stream.clone_htod(&[2i32, 0]).unwrap();
    let seq_lens = stream.clone_htod(&[3i32]).unwrap();
    // q[h] = (h+1)/64 in all dims: Σq = 9(h+1).
    let q: Vec<bf16> = (0..heads * HEAD_DIM)
        .map(|i| bf16::from_f64((i / HEAD_DIM + 1) as f64 / 64.0))
        .collect();
    let q = stream.clone_htod(&q).unwrap();
    // out rows 640 apart (head stride), poisoned: the gap must stay untouched.
    let poison = bf16::from_f64(12345.0);
    let mut out = stream.clone_htod(&vec![poison; heads * 640]).unwrap();
    let mut lse = stream.clone_htod(&vec![f32::NAN; heads]).unwrap();
    let flag = ErrorFlag::new(&stream).unwrap();

    let shape = DenseShape {
        batch: 1,
        q_len: 1,
        num_heads: heads,
        block_size: 16,
        max_blocks_per_seq: 2,
    };
    let plan = DecodePlan::dense(&stream, shape, PlanOptions::default()).unwrap();
    let scale = 1.0 / 16.0;
    let kv = KvCache::contiguous(cache.as_view(), 16);
    assert_eq!(kv.num_blocks(), num_blocks);
    let bt = BlockTable::new(table.as_view(), 1, 2);

    // Validation with real views: seq_lens shorter than the batch, a misaligned q.
    let err = dense_decode(
        &stream,
        &plan,
        &Query::contiguous(q.as_view(), heads),
        &kv,
        &bt,
        &seq_lens.slice(0..0),
        &mut Output::strided(out.as_view_mut(), heads * 640, 640),
        None,
        scale,
        None,
    );
    assert!(
        matches!(
            err,
            Err(Error::InvalidArgument {
                arg: "seq_lens",
                ..
            })
        ),
        "{err:?}"
    );
    let err = dense_decode(
        &stream,
        &plan,
        &Query::strided(q.slice(1..), HEAD_DIM, HEAD_DIM),
        &kv,
        &bt,
        &seq_lens.as_view(),
        &mut Output::strided(out.as_view_mut(), heads * 640, 640),
        None,
        scale,
        None,
    );
    assert!(
        matches!(err, Err(Error::InvalidArgument { arg: "q", .. })),
        "{err:?}"
    );

    dense_decode(
        &stream,
        &plan,
        &Query::contiguous(q.as_view(), heads),
        &kv,
        &bt,
        &seq_lens.as_view(),
        &mut Output::strided(out.as_view_mut(), heads * 640, 640),
        Some(&mut Lse::contiguous(lse.as_view_mut(), heads)),
        scale,
        Some(&flag),
    )
    .unwrap();
    flag.check(&stream).unwrap();
    let out = stream.clone_dtoh(&out).unwrap();
    let lse = stream.clone_dtoh(&lse).unwrap();
    for h in 0..heads {
        let (o, l) = expected(&[1.0, 2.0, 3.0], 9.0 * (h + 1) as f64, scale as f64);
        for d in 0..512 {
            close(
                out[h * 640 + d].to_f64(),
                o,
                1e-2,
                &format!("out[{h}][{d}]"),
            );
        }
        for d in 512..640 {
            assert_eq!(out[h * 640 + d], poison, "out gap [{h}][{d}] overwritten");
        }
        close(lse[h] as f64, l, 1e-3, &format!("lse[{h}]"));
    }

    // A block id outside the cache: skipped, and recorded in the flag.
    let bad_table = stream.clone_htod(&[2i32, 99]).unwrap();
    let lens = stream.clone_htod(&[20i32]).unwrap();
    let mut out2 = stream.alloc_zeros::<bf16>(heads * LATENT_DIM).unwrap();
    dense_decode(
        &stream,
        &plan,
        &Query::contiguous(q.as_view(), heads),
        &kv,
        &BlockTable::new(bad_table.as_view(), 1, 2),
        &lens.as_view(),
        &mut Output::contiguous(out2.as_view_mut(), heads),
        None,
        scale,
        Some(&flag),
    )
    .unwrap();
    match flag.check(&stream) {
        Err(Error::DeviceFault {
            code: FaultCode::BadBlockId,
            row: 0,
            value: 99,
        }) => {}
        other => panic!("expected a BadBlockId fault, got {other:?}"),
    }
}

/// Sparse f16, 2 tokens, 3 heads, topk 8, split q (nope and rope apart). Token 0 lists
/// slots 32, 33, 34 but topk_len 2 keeps 32, 33; token 1 lists 34 twice and one bad id.
#[test]
#[ignore = "needs a GPU"]
fn gpu_sparse_plumbing() {
    let stream = stream();
    let (tokens, heads, topk) = (2, 3, 8);
    let value = |slot: usize| match slot {
        32..=34 => (slot - 31) as f64,
        _ => 100.0,
    };
    let cache = stream.clone_htod(&cache_rows::<f16>(4, value)).unwrap();
    let ids = [
        [32, 33, 34, -1, -1, -1, -1, -1],
        [34, -1, 5000, 34, -1, -1, -1, -1],
    ];
    let ids: Vec<i32> = ids.iter().flatten().copied().collect();
    let ids = stream.clone_htod(&ids).unwrap();
    let topk_len = stream.clone_htod(&[2i32, 8]).unwrap();
    // nope[t][h] = 1/64, rope[t][h] = (h+1)/64: Σq = 8 + (h+1).
    let nope = vec![f16::from_f64(1.0 / 64.0); tokens * heads * LATENT_DIM];
    let rope: Vec<f16> = (0..tokens * heads * ROPE_DIM)
        .map(|i| f16::from_f64(((i / ROPE_DIM) % heads + 1) as f64 / 64.0))
        .collect();
    let (nope, rope) = (
        stream.clone_htod(&nope).unwrap(),
        stream.clone_htod(&rope).unwrap(),
    );
    let mut out = stream
        .clone_htod(&vec![f16::from_f64(-7.0); tokens * heads * LATENT_DIM])
        .unwrap();
    // lse as FlashMLA lays it out: [heads, tokens].
    let mut lse = stream.clone_htod(&vec![f32::NAN; heads * tokens]).unwrap();
    let flag = ErrorFlag::new(&stream).unwrap();

    let shape = SparseShape {
        num_tokens: tokens,
        num_heads: heads,
        topk,
    };
    let plan = DecodePlan::sparse(&stream, shape, PlanOptions::default()).unwrap();
    let scale = 0.1f32;
    let q = Query::split(
        nope.as_view(),
        heads * LATENT_DIM,
        LATENT_DIM,
        rope.as_view(),
        heads * ROPE_DIM,
        ROPE_DIM,
    );
    let kv = KvCache::contiguous(cache.as_view(), 16);
    let indices = SparseIndices::contiguous(ids.as_view(), topk);

    // Validation with real views: topk_len shorter than the tokens.
    let err = sparse_decode(
        &stream,
        &plan,
        &q,
        &kv,
        &indices,
        Some(&topk_len.slice(0..1)),
        &mut Output::contiguous(out.as_view_mut(), heads),
        None,
        scale,
        None,
    );
    assert!(
        matches!(
            err,
            Err(Error::InvalidArgument {
                arg: "topk_len",
                ..
            })
        ),
        "{err:?}"
    );

    sparse_decode(
        &stream,
        &plan,
        &q,
        &kv,
        &indices,
        Some(&topk_len.as_view()),
        &mut Output::contiguous(out.as_view_mut(), heads),
        Some(&mut Lse::strided(lse.as_view_mut(), 1, tokens)),
        scale,
        Some(&flag),
    )
    .unwrap();
    match flag.check(&stream) {
        Err(Error::DeviceFault {
            code: FaultCode::BadSlotId,
            row: 1,
            value: 5000,
        }) => {}
        other => panic!("expected a BadSlotId fault, got {other:?}"),
    }
    let out = stream.clone_dtoh(&out).unwrap();
    let lse = stream.clone_dtoh(&lse).unwrap();
    for t in 0..tokens {
        let cs: &[f64] = if t == 0 { &[1.0, 2.0] } else { &[3.0, 3.0] };
        for h in 0..heads {
            let (o, l) = expected(cs, 8.0 + (h + 1) as f64, scale as f64);
            let row = (t * heads + h) * LATENT_DIM;
            for d in 0..LATENT_DIM {
                close(
                    out[row + d].to_f64(),
                    o,
                    5e-3,
                    &format!("out[{t}][{h}][{d}]"),
                );
            }
            close(
                lse[h * tokens + t] as f64,
                l,
                1e-3,
                &format!("lse[{t}][{h}]"),
            );
        }
    }
}

/// Append three rows (one padded out by -1), then gather positions through a block table.
#[test]
#[ignore = "needs a GPU"]
fn gpu_append_and_gather() {
    let stream = stream();
    let num_blocks = 4;
    let mut cache = stream
        .alloc_zeros::<bf16>(num_blocks * 16 * HEAD_DIM)
        .unwrap();
    // kv rows 640 apart: row i = i+1 in all dims.
    let kv: Vec<bf16> = (0..3 * 640)
        .map(|i| bf16::from_f64((i / 640 + 1) as f64))
        .collect();
    let kv = stream.clone_htod(&kv).unwrap();
    let slots = stream.clone_htod(&[5i64, -1, 40]).unwrap();
    let flag = ErrorFlag::new(&stream).unwrap();
    {
        let mut kc = KvCacheMut::contiguous(cache.as_view_mut(), 16);
        append_kv(
            &stream,
            &kv.as_view(),
            640,
            &slots.as_view(),
            &mut kc,
            Some(&flag),
        )
        .unwrap();
    }
    flag.check(&stream).unwrap();
    let host = stream.clone_dtoh(&cache).unwrap();
    for slot in 0..num_blocks * 16 {
        let want = match slot {
            5 => 1.0,
            40 => 3.0,
            _ => 0.0,
        };
        let row = &host[slot * HEAD_DIM..(slot + 1) * HEAD_DIM];
        assert!(
            row.iter().all(|v| v.to_f64() == want),
            "cache row {slot}: want {want}"
        );
    }
    // A slot outside the cache: skipped and recorded.
    let bad = stream.clone_htod(&[64i64]).unwrap();
    {
        let mut kc = KvCacheMut::contiguous(cache.as_view_mut(), 16);
        append_kv(
            &stream,
            &kv.slice(..HEAD_DIM),
            HEAD_DIM,
            &bad.as_view(),
            &mut kc,
            Some(&flag),
        )
        .unwrap();
    }
    match flag.check(&stream) {
        Err(Error::DeviceFault {
            code: FaultCode::BadAppendSlot,
            row: 0,
            value: 64,
        }) => {}
        other => panic!("expected a BadAppendSlot fault, got {other:?}"),
    }
    flag.reset(&stream).unwrap();

    // Gather: 2 requests, tables [[2, 0], [1, 3]], seq_lens [20, 5]; out rows 6 apart.
    let table = stream.clone_htod(&[2i32, 0, 1, 3]).unwrap();
    let lens = stream.clone_htod(&[20i32, 5]).unwrap();
    let positions = stream.clone_htod(&[0i32, 17, 20, -1, 4, 5, 0, 3]).unwrap();
    let req = stream.clone_htod(&[0i32, 1]).unwrap();
    let mut out = stream.clone_htod(&[777i32; 12]).unwrap();
    gather_slots(
        &stream,
        &positions.as_view(),
        4,
        4,
        &req.as_view(),
        &BlockTable::new(table.as_view(), 2, 2),
        &lens.as_view(),
        num_blocks,
        16,
        &mut out.as_view_mut(),
        6,
        Some(&flag),
    )
    .unwrap();
    flag.check(&stream).unwrap();
    assert_eq!(
        stream.clone_dtoh(&out).unwrap(),
        [32, 1, -1, -1, 777, 777, 20, -1, 16, 19, 777, 777]
    );
}
