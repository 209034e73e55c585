//! GPU tests of the safe layer's plumbing: small cases whose answers follow from the inputs
//! by hand: cache rows that are constant across their 576 dims, so that a score is
//! `scale · c · Σq`. They check that pointers, strides, lengths, plans, the error flag and
//! validation reach the kernels as meant; numerical accuracy is the other modules' business.

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::half::{bf16, f16};
use mla_decode::*;

use crate::dense::split_spec;
use crate::kit::*;

pub(crate) fn stream() -> Arc<CudaStream> {
    gpu().1
}

/// Cache of `num_blocks` blocks of 16 rows: row `slot` = `value(slot)` in all 576 dims.
pub(crate) fn cache_rows<T: Element>(num_blocks: usize, value: impl Fn(usize) -> f64) -> Vec<T> {
    (0..num_blocks * 16 * HEAD_DIM)
        .map(|i| T::from_f64(value(i / HEAD_DIM)))
        .collect()
}

/// `(out, lse)` of attention over rows of constant values `cs` with `Σq = qsum`.
pub(crate) fn expected(cs: &[f64], qsum: f64, scale: f64) -> (f64, f64) {
    let w: Vec<f64> = cs.iter().map(|c| (scale * c * qsum).exp()).collect();
    let total: f64 = w.iter().sum();
    let out = w.iter().zip(cs).map(|(w, c)| w * c).sum::<f64>() / total;
    (out, total.ln())
}

#[track_caller]
pub(crate) fn close(got: f64, want: f64, tol: f64, what: &str) {
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

    let mut flag = ErrorFlag::new(&stream).unwrap();
    assert_eq!(flag.check(&stream), Ok(()));
    stream
        .memcpy_htod(&[3u32, 7, (-2i32) as u32, u32::MAX], &mut flag.raw_mut())
        .unwrap();
    let fault = Err(Error::DeviceFault {
        code: FaultCode::SeqLenTooLarge,
        row: 7,
        value: -2,
    });
    assert_eq!(flag.check(&stream), fault);

    // Non-blocking reads: behind an event, and device to device.
    let reading = flag.read_async(&stream).unwrap();
    assert_eq!(reading.wait(), fault);
    assert_eq!(reading.try_get(), Some(fault.clone()));
    let mut copy = stream.alloc_zeros::<u32>(6).unwrap();
    flag.copy_to(&stream, &mut copy.slice_mut(2..)).unwrap();
    assert_eq!(
        stream.clone_dtoh(&copy).unwrap(),
        [0, 0, 3, 7, (-2i32) as u32, u32::MAX]
    );
    let err = flag.copy_to(&stream, &mut copy.slice_mut(..3));
    assert!(
        matches!(err, Err(Error::InvalidArgument { arg: "dst", .. })),
        "{err:?}"
    );

    flag.reset(&stream).unwrap();
    assert_eq!(flag.read(&stream).unwrap(), [0; 4]);
    let mut reading = FlagReading::new(&stream).unwrap();
    assert_eq!(
        reading.try_get(),
        Some(Ok(())),
        "a fresh reading reads clear"
    );
    flag.read_async_into(&stream, &mut reading).unwrap();
    assert_eq!(reading.wait(), Ok(()));
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
    let mut flag = ErrorFlag::new(&stream).unwrap();

    let shape = DenseShape {
        batch: 1,
        q_len: 1,
        num_heads: heads,
        block_size: 16,
        max_blocks_per_seq: 2,
        kv_format: KvFormat::Bf16,
    };
    let mut plan = DecodePlan::dense(&stream, shape, PlanOptions::default()).unwrap();
    assert_eq!((plan.num_tokens(), plan.num_heads()), (1, heads));
    assert_eq!(plan.kv_format(), KvFormat::Bf16);
    assert!(plan.workspace_bytes() > 0);
    let scale = 1.0 / 16.0;
    let kv = KvCache::contiguous(&cache, KvFormat::Bf16, 16).unwrap();
    assert_eq!(kv.num_blocks(), num_blocks);
    let out_strides = Strides {
        token: heads * 640,
        head: 640,
    };
    let args = DenseArgs {
        q: Query::contiguous(&q, heads),
        kv_cache: kv,
        block_table: BlockTable::new(
            &table,
            TableShape {
                batch: 1,
                max_blocks_per_seq: 2,
            },
        ),
        seq_lens: &seq_lens,
        softmax_scale: scale,
    };

    // Validation with real views: seq_lens shorter than the batch, a misaligned q, a cache
    // with a trailing partial block, an f16 plan for a bf16 cache.
    let empty = seq_lens.slice(0..0);
    let err = dense_decode(
        &stream,
        &mut plan,
        &DenseArgs {
            seq_lens: &empty,
            ..args.clone()
        },
        &mut Output::strided(&mut out, out_strides),
        None,
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
        &mut plan,
        &DenseArgs {
            q: Query::strided(
                q.slice(1..),
                Strides {
                    token: HEAD_DIM,
                    head: HEAD_DIM,
                },
            ),
            ..args.clone()
        },
        &mut Output::strided(&mut out, out_strides),
        None,
        None,
    );
    assert!(
        matches!(err, Err(Error::InvalidArgument { arg: "q", .. })),
        "{err:?}"
    );
    let partial = cache.slice(..cache.len() - HEAD_DIM);
    let err = KvCache::contiguous(&partial, KvFormat::Bf16, 16);
    assert!(
        matches!(
            err,
            Err(Error::InvalidArgument {
                arg: "kv_cache",
                ..
            })
        ),
        "{err:?}"
    );
    let f16_shape = DenseShape {
        kv_format: KvFormat::F16,
        ..shape
    };
    let mut f16_plan = DecodePlan::dense(&stream, f16_shape, PlanOptions::default()).unwrap();
    let err = dense_decode(
        &stream,
        &mut f16_plan,
        &args,
        &mut Output::strided(&mut out, out_strides),
        None,
        None,
    );
    assert!(
        matches!(
            err,
            Err(Error::InvalidArgument {
                arg: "kv_cache",
                ..
            })
        ),
        "{err:?}"
    );

    dense_decode(
        &stream,
        &mut plan,
        &args,
        &mut Output::strided(&mut out, out_strides),
        Some(&mut Lse::contiguous(&mut lse, heads)),
        Some(&mut flag),
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
    let bad_args = DenseArgs {
        block_table: BlockTable::new(
            &bad_table,
            TableShape {
                batch: 1,
                max_blocks_per_seq: 2,
            },
        ),
        seq_lens: &lens,
        ..args.clone()
    };
    dense_decode(
        &stream,
        &mut plan,
        &bad_args,
        &mut Output::contiguous(&mut out2, heads),
        None,
        Some(&mut flag),
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
    let mut flag = ErrorFlag::new(&stream).unwrap();

    let shape = SparseShape {
        num_tokens: tokens,
        num_heads: heads,
        topk,
        kv_format: KvFormat::F16,
    };
    let mut plan = DecodePlan::sparse(&stream, shape, PlanOptions::default()).unwrap();
    let args = SparseArgs {
        q: Query::split(
            &nope,
            Strides {
                token: heads * LATENT_DIM,
                head: LATENT_DIM,
            },
            &rope,
            Strides {
                token: heads * ROPE_DIM,
                head: ROPE_DIM,
            },
        ),
        kv_cache: KvCache::contiguous(&cache, KvFormat::F16, 16).unwrap(),
        indices: SparseIndices::contiguous(&ids, topk),
        topk_len: Some(&topk_len),
        softmax_scale: 0.1f32,
    };
    let scale = args.softmax_scale;

    // Validation with real views: topk_len shorter than the tokens.
    let short = topk_len.slice(0..1);
    let err = sparse_decode(
        &stream,
        &mut plan,
        &SparseArgs {
            topk_len: Some(&short),
            ..args.clone()
        },
        &mut Output::contiguous(&mut out, heads),
        None,
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
        &mut plan,
        &args,
        &mut Output::contiguous(&mut out, heads),
        Some(&mut Lse::strided(
            &mut lse,
            Strides {
                token: 1,
                head: tokens,
            },
        )),
        Some(&mut flag),
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

/// Append three rows (one padded out by -1) from buffers longer than the step, then
/// gather positions through a block table into the slots of the same cache.
#[test]
#[ignore = "needs a GPU"]
fn gpu_append_and_gather() {
    let stream = stream();
    let num_blocks = 4;
    let mut cache = stream
        .alloc_zeros::<bf16>(num_blocks * 16 * HEAD_DIM)
        .unwrap();
    // kv rows 640 apart: row i = i+1 in all dims; a fourth row that must not be appended.
    let kv: Vec<bf16> = (0..4 * 640)
        .map(|i| bf16::from_f64((i / 640 + 1) as f64))
        .collect();
    let kv = stream.clone_htod(&kv).unwrap();
    let slots = stream.clone_htod(&[5i64, -1, 40, 41]).unwrap();
    let mut flag = ErrorFlag::new(&stream).unwrap();
    let append = AppendArgs {
        kv: &kv,
        kv_token_stride: 640,
        slot_mapping: &slots,
        num_tokens: 3,
        scale_rule: None,
    };
    {
        let mut kc = KvCacheMut::contiguous(&mut cache, KvFormat::Bf16, 16).unwrap();
        append_kv(&stream, &append, &mut kc, Some(&mut flag)).unwrap();
        // A scale rule for a bf16 cache is refused, naming the field.
        let err = append_kv(
            &stream,
            &AppendArgs {
                scale_rule: Some(ScaleRule::Pow2),
                ..append
            },
            &mut kc,
            None,
        );
        assert!(
            matches!(
                err,
                Err(Error::InvalidArgument {
                    arg: "scale_rule",
                    ..
                })
            ),
            "{err:?}"
        );
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
    // A slot outside the cache: skipped and recorded (`gpu_fault_values_are_64_bit` checks
    // the high bits of a value).
    let bad = stream.clone_htod(&[64i64]).unwrap();
    {
        let mut kc = KvCacheMut::contiguous(&mut cache, KvFormat::Bf16, 16).unwrap();
        let args = AppendArgs {
            kv_token_stride: HEAD_DIM,
            slot_mapping: &bad,
            num_tokens: 1,
            ..append
        };
        append_kv(&stream, &args, &mut kc, Some(&mut flag)).unwrap();
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

    // Gather: 2 requests, tables [[2, 0], [1, 3]], seq_lens [20, 5]; out rows 6 apart; the
    // buffers hold a third token that must not be gathered.
    let table = stream.clone_htod(&[2i32, 0, 1, 3]).unwrap();
    let lens = stream.clone_htod(&[20i32, 5]).unwrap();
    let positions = stream
        .clone_htod(&[0i32, 17, 20, -1, 4, 5, 0, 3, 0, 0, 0, 0])
        .unwrap();
    let req = stream.clone_htod(&[0i32, 1, 0]).unwrap();
    let mut out = stream.clone_htod(&[777i32; 18]).unwrap();
    let gather = GatherArgs {
        positions: &positions,
        positions_stride: 4,
        req_id: &req,
        block_table: BlockTable::new(
            &table,
            TableShape {
                batch: 2,
                max_blocks_per_seq: 2,
            },
        ),
        seq_lens: &lens,
        kv_cache: KvCache::contiguous(&cache, KvFormat::Bf16, 16).unwrap(),
        topk: 4,
        num_tokens: 2,
        out_stride: 6,
    };
    gather_slots(&stream, &gather, &mut out, Some(&mut flag)).unwrap();
    flag.check(&stream).unwrap();
    let mut want = vec![32, 1, -1, -1, 777, 777, 20, -1, 16, 19, 777, 777];
    want.extend([777; 6]);
    assert_eq!(stream.clone_dtoh(&out).unwrap(), want);
}

/// The C ABI's schedule carries the decode call it serves (`mla_shape_t::kind`): a schedule made
/// for one call is rejected by the other, naming the field; a sparse shape must have q_len 1.
#[test]
#[ignore = "needs a GPU"]
fn gpu_schedule_kind_is_checked() {
    use mla_decode::ffi::{self, mla_kind_t::*};
    let stream = stream();
    stream.context().bind_to_thread().unwrap();
    let shape = |kind, q_len| ffi::mla_shape_t {
        batch: 2,
        q_len,
        num_heads: 8,
        max_len: 256,
        kv_format: ffi::mla_kv_format_t::MLA_KV_BF16,
        kind,
    };
    let init = |sh: &ffi::mla_shape_t| {
        let mut s = ffi::mla_schedule_t::default();
        // SAFETY: valid pointers to local structs; tuning may be NULL.
        let st = unsafe { ffi::mla_schedule_init(&mut s, sh, std::ptr::null()) };
        (status_to_result("mla_schedule_init", st.0), s)
    };
    let (ok, dense) = init(&shape(MLA_KIND_DENSE, 1));
    assert_eq!(ok, Ok(()));
    assert_eq!(dense.kind, MLA_KIND_DENSE);
    let (ok, sparse) = init(&shape(MLA_KIND_SPARSE, 1));
    assert_eq!(ok, Ok(()));
    assert_eq!(sparse.kind, MLA_KIND_SPARSE);
    let (err, _) = init(&shape(MLA_KIND_SPARSE, 2));
    assert!(
        matches!(&err, Err(Error::Rejected { reason, .. }) if reason.contains("shape.q_len")),
        "{err:?}"
    );
    // The kind is checked before any parameter, so zeroed parameters reach it.
    let sp = ffi::mla_sparse_params_t::default();
    let dp = ffi::mla_dense_params_t::default();
    // SAFETY: valid pointers; the calls reject the schedule before reading any device pointer.
    let st = unsafe { ffi::mla_sparse_decode(&dense, &sp, std::ptr::null_mut()) };
    let err = status_to_result("mla_sparse_decode", st.0);
    assert!(
        matches!(&err, Err(Error::Rejected { reason, .. }) if reason.contains("MLA_KIND_SPARSE")),
        "{err:?}"
    );
    // SAFETY: as above.
    let st = unsafe { ffi::mla_dense_decode(&sparse, &dp, std::ptr::null_mut()) };
    let err = status_to_result("mla_dense_decode", st.0);
    assert!(
        matches!(&err, Err(Error::Rejected { reason, .. }) if reason.contains("MLA_KIND_DENSE")),
        "{err:?}"
    );
}

/// The C append's checks of the split sources, called raw (the safe layer rejects all of
/// these first, so only a raw-FFI caller meets the C messages): each names its field, and
/// nothing is launched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_append_split_checks() {
    let stream = stream();
    stream.context().bind_to_thread().unwrap();
    // fake, aligned device addresses: every case fails a host check before any launch
    let base = ffi::mla_append_params_t {
        kv: 0x1000_0000 as *const _,
        kv_token_stride: LATENT_DIM as i64,
        dtype: ffi::mla_dtype_t::MLA_DTYPE_BF16,
        num_tokens: 2,
        slot_mapping: 0x2000_0000 as *const i64,
        kv_cache: 0x3000_0000 as *mut _,
        kv_format: ffi::mla_kv_format_t::MLA_KV_BF16,
        kv_scale: std::ptr::null(),
        scale_rule: ffi::mla_scale_rule_t::MLA_SCALE_RAW,
        block_stride_bytes: 16 * 1152,
        num_blocks: 4,
        block_size: 16,
        error_flag: std::ptr::null_mut(),
        kv_rope: 0x4000_0000 as *const _,
        kv_rope_token_stride: ROPE_DIM as i64,
    };
    type Case = (&'static str, fn(&mut ffi::mla_append_params_t));
    let cases: [Case; 6] = [
        ("kv_rope: not 16-byte aligned", |p| {
            p.kv_rope = 0x4000_0004 as *const _
        }),
        ("kv_rope_token_stride", |p| p.kv_rope_token_stride = 60),
        ("kv_rope_token_stride", |p| p.kv_rope_token_stride = 68),
        ("kv_rope_token_stride", |p| {
            p.kv_rope_token_stride = i64::MAX - 7
        }),
        ("kv_token_stride", |p| p.kv_token_stride = 504),
        // without kv_rope the rows are whole: 512 is too short
        ("kv_token_stride", |p| p.kv_rope = std::ptr::null()),
    ];
    for (want, f) in cases {
        let mut p = base;
        f(&mut p);
        // SAFETY: a valid pointer to a local struct; the call rejects it on the host.
        let st = unsafe { ffi::mla_append_kv(&p, stream.cu_stream() as *mut _) };
        let err = status_to_result("mla_append_kv", st.0);
        assert!(
            matches!(&err, Err(Error::Rejected { reason, .. }) if reason.contains(want)),
            "{want}: {err:?}"
        );
    }
}

/// The C decode's checks of the row layouts and the integer arguments' alignment, called raw
/// (the safe layer rejects these first): a 512-wide q_nope passed as packed rows, negative
/// strides, overlapping out or lse rows, misaligned int32 arrays and error flag. Each names its
/// field, and nothing is launched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_decode_layout_checks() {
    use mla_decode::ffi::mla_kind_t::*;
    let stream = stream();
    stream.context().bind_to_thread().unwrap();
    let (batch, heads) = (2, 8);
    let shape = |kind| ffi::mla_shape_t {
        batch,
        q_len: 1,
        num_heads: heads,
        max_len: 256,
        kv_format: ffi::mla_kv_format_t::MLA_KV_BF16,
        kind,
    };
    let init = |kind| {
        let mut s = ffi::mla_schedule_t::default();
        // SAFETY: valid pointers to local structs; tuning may be NULL.
        let st = unsafe { ffi::mla_schedule_init(&mut s, &shape(kind), std::ptr::null()) };
        assert_eq!(status_to_result("mla_schedule_init", st.0), Ok(()));
        s
    };
    let (dense_s, sparse_s) = (init(MLA_KIND_DENSE), init(MLA_KIND_SPARSE));
    let h = heads as i64;
    // fake, aligned device addresses: every case fails a host check before any launch
    let dense = ffi::mla_dense_params_t {
        batch,
        q_len: 1,
        num_heads: heads,
        q_nope: 0x1000_0000 as *const _,
        q_rope: std::ptr::null(),
        q_nope_token_stride: h * HEAD_DIM as i64,
        q_nope_head_stride: HEAD_DIM as i64,
        dtype: ffi::mla_dtype_t::MLA_DTYPE_BF16,
        kv_cache: 0x2000_0000 as *const _,
        kv_format: ffi::mla_kv_format_t::MLA_KV_BF16,
        block_stride_bytes: 64 * 1152,
        num_blocks: 8,
        block_size: 64,
        block_table: 0x3000_0000 as *const i32,
        max_blocks_per_seq: 4,
        block_table_stride: 4,
        seq_lens: 0x4000_0000 as *const i32,
        out: 0x5000_0000 as *mut _,
        out_token_stride: h * LATENT_DIM as i64,
        out_head_stride: LATENT_DIM as i64,
        lse: 0x6000_0000 as *mut f32,
        lse_token_stride: h,
        lse_head_stride: 1,
        softmax_scale: 0.0625,
        workspace: 0x7000_0000 as *mut f32,
        ..Default::default()
    };
    type Case = (&'static str, fn(&mut ffi::mla_dense_params_t));
    let cases: [Case; 12] = [
        // q_nope of [tokens, heads, 512] without its q_rope: read as packed 576-wide rows before
        ("q_nope_head_stride", |p| {
            p.q_nope_head_stride = LATENT_DIM as i64;
            p.q_nope_token_stride = 8 * LATENT_DIM as i64;
        }),
        ("shorter than the row", |p| p.q_nope_token_stride = 512),
        ("negative", |p| p.q_nope_head_stride = -(HEAD_DIM as i64)),
        ("q_rope_head_stride", |p| {
            p.q_rope = 0x1800_0000 as *const _;
            p.q_nope_head_stride = LATENT_DIM as i64;
            p.q_nope_token_stride = 8 * LATENT_DIM as i64;
            p.q_rope_head_stride = 32;
            p.q_rope_token_stride = 8 * 64;
        }),
        ("out_head_stride", |p| p.out_head_stride = 256),
        ("overlap", |p| p.out_token_stride = LATENT_DIM as i64),
        ("out_token_stride", |p| {
            p.out_token_stride = -8 * LATENT_DIM as i64
        }),
        ("lse_token_stride", |p| p.lse_token_stride = 4),
        ("lse: not 4-byte aligned", |p| {
            p.lse = 0x6000_0002 as *mut f32
        }),
        ("seq_lens: not 4-byte aligned", |p| {
            p.seq_lens = 0x4000_0002 as *const i32
        }),
        ("block_table: not 4-byte aligned", |p| {
            p.block_table = 0x3000_0001 as *const i32
        }),
        ("error_flag: not 4-byte aligned", |p| {
            p.error_flag = 0x8000_0002 as *mut u32
        }),
    ];
    for (want, f) in cases {
        let mut p = dense;
        f(&mut p);
        // SAFETY: valid pointers to local structs; the call rejects the parameters on the host.
        let st = unsafe { ffi::mla_dense_decode(&dense_s, &p, stream.cu_stream() as *mut _) };
        let err = status_to_result("mla_dense_decode", st.0);
        assert!(
            matches!(&err, Err(Error::Rejected { reason, .. }) if reason.contains(want)),
            "{want}: {err:?}"
        );
    }
    // the sparse call shares these checks; its own int32 arrays
    let sparse = ffi::mla_sparse_params_t {
        num_tokens: batch,
        num_heads: heads,
        q_nope: dense.q_nope,
        q_nope_token_stride: dense.q_nope_token_stride,
        q_nope_head_stride: dense.q_nope_head_stride,
        dtype: dense.dtype,
        kv_cache: dense.kv_cache,
        kv_format: dense.kv_format,
        block_stride_bytes: dense.block_stride_bytes,
        num_blocks: dense.num_blocks,
        block_size: dense.block_size,
        indices: 0x3000_0000 as *const i32,
        topk: 256,
        indices_stride: 256,
        out: dense.out,
        out_token_stride: dense.out_token_stride,
        out_head_stride: dense.out_head_stride,
        softmax_scale: dense.softmax_scale,
        workspace: dense.workspace,
        ..Default::default()
    };
    type SCase = (&'static str, fn(&mut ffi::mla_sparse_params_t));
    let cases: [SCase; 3] = [
        ("indices: not 4-byte aligned", |p| {
            p.indices = 0x3000_0002 as *const i32
        }),
        ("topk_len: not 4-byte aligned", |p| {
            p.topk_len = 0x3800_0001 as *const i32
        }),
        ("shorter than the row", |p| p.q_nope_head_stride = 8),
    ];
    for (want, f) in cases {
        let mut p = sparse;
        f(&mut p);
        // SAFETY: as above.
        let st = unsafe { ffi::mla_sparse_decode(&sparse_s, &p, stream.cu_stream() as *mut _) };
        let err = status_to_result("mla_sparse_decode", st.0);
        assert!(
            matches!(&err, Err(Error::Rejected { reason, .. }) if reason.contains(want)),
            "{want}: {err:?}"
        );
    }
}

/// Device buffers of one raw-FFI decode call (q packed and contiguous, out and lse contiguous,
/// out poisoned), read back as [`crate::kit::Outputs`].
struct RawCall {
    q: CudaSlice<bf16>,
    cache: CudaSlice<bf16>,
    table: CudaSlice<i32>,
    lens: Option<CudaSlice<i32>>,
    out: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    ws: CudaSlice<f32>,
    flag: CudaSlice<u32>,
    tokens: usize,
    heads: usize,
}

impl RawCall {
    fn new(
        stream: &Arc<CudaStream>,
        s: &ffi::mla_schedule_t,
        q: &HostQuery<bf16>,
        cache: &HostCache<bf16>,
        table: &[i32],
        lens: Option<&[i32]>,
    ) -> RawCall {
        let (tokens, heads) = (q.tokens, q.heads);
        // SAFETY: a valid pointer to a schedule mla_schedule_init filled.
        let ws_bytes = unsafe { ffi::mla_workspace_bytes(s) };
        RawCall {
            q: stream.clone_htod(&q.bufs[0]).unwrap(),
            cache: stream.clone_htod(&cache.data).unwrap(),
            table: stream.clone_htod(table).unwrap(),
            lens: lens.map(|l| stream.clone_htod(l).unwrap()),
            out: stream
                .clone_htod(&vec![bf16::from_bits(POISON); tokens * heads * LATENT_DIM])
                .unwrap(),
            lse: stream.alloc_zeros(tokens * heads).unwrap(),
            ws: stream.alloc_zeros(ws_bytes.div_ceil(4)).unwrap(),
            flag: stream.alloc_zeros(4).unwrap(),
            tokens,
            heads,
        }
    }

    fn read(&self, rng: &mut Rng, stream: &Arc<CudaStream>) -> Outputs<bf16> {
        let mut layout =
            |width| Strided::new(rng, RowsKind::Contiguous, self.tokens, self.heads, width, 8);
        let (out_layout, lse_layout) = (layout(LATENT_DIM), layout(1));
        let flag = stream.clone_dtoh(&self.flag).unwrap();
        Outputs {
            out: stream.clone_dtoh(&self.out).unwrap(),
            out_layout,
            lse: Some((stream.clone_dtoh(&self.lse).unwrap(), lse_layout)),
            flag: [flag[0], flag[1], flag[2], flag[3]],
        }
    }
}

/// A C schedule is made once per shape with `max_len` as a hint, and a call may bring any
/// table width or topk (docs/DESIGN.md section 1): schedules made for short rows (the row
/// kernel's one-part steps, the short-request rule's whole-request parts) called with tables
/// 16-64x wider and lengths that use them, and a schedule made for long rows called with short
/// ones, dense and sparse, against the reference. Raw FFI: the safe layer ties a call to its
/// plan's width.
#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_decode_wider_than_schedule() {
    use mla_decode::cudarc::driver::{DevicePtr, DevicePtrMut};
    use mla_decode::ffi::mla_kind_t::*;
    let stream = stream();
    stream.context().bind_to_thread().unwrap();
    let mut rng = rng_for("raw_decode_wider_than_schedule");
    let schedule = |kind, batch: usize, heads: usize, max_len: usize| {
        let shape = ffi::mla_shape_t {
            batch: batch as i32,
            q_len: 1,
            num_heads: heads as i32,
            max_len: max_len as i32,
            kv_format: ffi::mla_kv_format_t::MLA_KV_BF16,
            kind,
        };
        let mut s = ffi::mla_schedule_t::default();
        // SAFETY: valid pointers to local structs; tuning may be NULL.
        let st = unsafe { ffi::mla_schedule_init(&mut s, &shape, std::ptr::null()) };
        assert_eq!(status_to_result("mla_schedule_init", st.0), Ok(()));
        s
    };
    // dense: (batch, heads, the schedule's max_len, the call's longest length)
    for (batch, heads, hint, longest) in [
        (1usize, 8usize, 64usize, 3000usize),
        (1, 16, 32, 1500),
        (132, 8, 128, 1024),
        (16, 8, 256, 4000),
        (4, 64, 8192, 300),
    ] {
        let bs = rng.pick(&[16usize, 32, 64, 128]);
        let lens: Vec<i32> = (0..batch)
            .map(|_| rng.range(longest / 2, longest) as i32)
            .collect();
        let spec = split_spec(&mut rng, 1, heads, bs, longest, lens);
        let p = DenseSetup::<bf16>::build(&mut rng, &spec);
        let sch = schedule(MLA_KIND_DENSE, batch, heads, hint);
        let q = HostQuery::<bf16>::random(&mut rng, QKind::Contiguous, batch, heads);
        let mut c = RawCall::new(&stream, &sch, &q, &p.cache, &p.table, Some(&p.seq_lens));
        let h = heads as i64;
        {
            let (qp, _g0) = c.q.device_ptr(&stream);
            let (kp, _g1) = c.cache.device_ptr(&stream);
            let (tp, _g2) = c.table.device_ptr(&stream);
            let (lp, _g3) = c.lens.as_ref().unwrap().device_ptr(&stream);
            let (op, _g4) = c.out.device_ptr_mut(&stream);
            let (ep, _g5) = c.lse.device_ptr_mut(&stream);
            let (wp, _g6) = c.ws.device_ptr_mut(&stream);
            let (fp, _g7) = c.flag.device_ptr_mut(&stream);
            let params = ffi::mla_dense_params_t {
                batch: batch as i32,
                q_len: 1,
                num_heads: heads as i32,
                q_nope: qp as *const _,
                q_rope: std::ptr::null(),
                q_nope_token_stride: h * HEAD_DIM as i64,
                q_nope_head_stride: HEAD_DIM as i64,
                dtype: ffi::mla_dtype_t::MLA_DTYPE_BF16,
                kv_cache: kp as *const _,
                kv_format: ffi::mla_kv_format_t::MLA_KV_BF16,
                block_stride_bytes: (p.cache.stride * 2) as i64,
                num_blocks: p.cache.num_blocks as i32,
                block_size: bs as i32,
                block_table: tp as *const i32,
                max_blocks_per_seq: p.mbps as i32,
                block_table_stride: p.table_stride as i64,
                seq_lens: lp as *const i32,
                out: op as *mut _,
                out_token_stride: h * LATENT_DIM as i64,
                out_head_stride: LATENT_DIM as i64,
                lse: ep as *mut f32,
                lse_token_stride: h,
                lse_head_stride: 1,
                softmax_scale: p.scale,
                workspace: wp as *mut f32,
                error_flag: fp as *mut u32,
                ..Default::default()
            };
            // the first case on the legacy default stream (NULL), the others on the test's
            let raw_stream = if batch == 1 && heads == 8 {
                std::ptr::null_mut()
            } else {
                stream.cu_stream() as *mut _
            };
            // SAFETY: every pointer is a live device buffer of the sizes the params state.
            let st = unsafe { ffi::mla_dense_decode(&sch, &params, raw_stream) };
            assert_eq!(status_to_result("mla_dense_decode", st.0), Ok(()));
        }
        stream.context().synchronize().unwrap(); // (the NULL stream's work too)
        let label = format!(
            "dense batch {batch} heads {heads}: schedule max_len {hint}, table {} rows (path {}, parts {})",
            p.mbps * bs,
            sch.internal.path,
            sch.num_parts
        );
        let got = c.read(&mut rng, &stream);
        let all = all_heads(heads);
        let want = p.reference(&q, &all);
        check_flag(&label, got.flag, &want.faults);
        check_outputs(&label, &got, &want, &all);
    }
    // sparse: (tokens, heads, the schedule's topk, the call's topk, topk_len)
    let style = RowStyle {
        hole: 0.05,
        bad: 0.0,
    };
    for (tokens, heads, hint, topk, with_len) in [
        (1usize, 8usize, 32usize, 2048usize, false),
        (2, 16, 64, 1024, true),
        (132, 8, 128, 1024, true),
        (64, 8, 2048, 100, false),
    ] {
        let p = random_sparse::<bf16>(&mut rng, tokens, heads, topk, 40, 64, style, with_len);
        let sch = schedule(MLA_KIND_SPARSE, tokens, heads, hint);
        let q = HostQuery::<bf16>::random(&mut rng, QKind::Contiguous, tokens, heads);
        let mut c = RawCall::new(
            &stream,
            &sch,
            &q,
            &p.cache,
            &p.indices,
            p.topk_len.as_deref(),
        );
        let h = heads as i64;
        {
            let (qp, _g0) = c.q.device_ptr(&stream);
            let (kp, _g1) = c.cache.device_ptr(&stream);
            let (ip, _g2) = c.table.device_ptr(&stream);
            let lp = c.lens.as_ref().map(|l| l.device_ptr(&stream));
            let (op, _g4) = c.out.device_ptr_mut(&stream);
            let (ep, _g5) = c.lse.device_ptr_mut(&stream);
            let (wp, _g6) = c.ws.device_ptr_mut(&stream);
            let (fp, _g7) = c.flag.device_ptr_mut(&stream);
            let params = ffi::mla_sparse_params_t {
                num_tokens: tokens as i32,
                num_heads: heads as i32,
                q_nope: qp as *const _,
                q_rope: std::ptr::null(),
                q_nope_token_stride: h * HEAD_DIM as i64,
                q_nope_head_stride: HEAD_DIM as i64,
                dtype: ffi::mla_dtype_t::MLA_DTYPE_BF16,
                kv_cache: kp as *const _,
                kv_format: ffi::mla_kv_format_t::MLA_KV_BF16,
                block_stride_bytes: (p.cache.stride * 2) as i64,
                num_blocks: p.cache.num_blocks as i32,
                block_size: p.cache.block_size as i32,
                indices: ip as *const i32,
                topk: topk as i32,
                indices_stride: p.stride as i64,
                topk_len: lp
                    .as_ref()
                    .map_or(std::ptr::null(), |(l, _)| *l as *const i32),
                out: op as *mut _,
                out_token_stride: h * LATENT_DIM as i64,
                out_head_stride: LATENT_DIM as i64,
                lse: ep as *mut f32,
                lse_token_stride: h,
                lse_head_stride: 1,
                softmax_scale: p.scale,
                workspace: wp as *mut f32,
                error_flag: fp as *mut u32,
                ..Default::default()
            };
            // SAFETY: as above.
            let st = unsafe { ffi::mla_sparse_decode(&sch, &params, stream.cu_stream() as *mut _) };
            assert_eq!(status_to_result("mla_sparse_decode", st.0), Ok(()));
        }
        let label = format!(
            "sparse tokens {tokens} heads {heads}: schedule topk {hint}, call topk {topk} len {with_len} (path {}, parts {})",
            sch.internal.path, sch.num_parts
        );
        let got = c.read(&mut rng, &stream);
        let all = all_heads(heads);
        let want = p.reference(&q, &all);
        check_flag(&label, got.flag, &want.faults);
        check_outputs(&label, &got, &want, &all);
    }
}

/// The plan of a sparse step (`count` tokens, top-`len`) or a dense one (`count` requests of q_len
/// 1 and `len` positions in blocks of 64), `heads` heads.
fn default_shape_plan(
    stream: &Arc<CudaStream>,
    sparse: bool,
    count: usize,
    heads: usize,
    len: usize,
    kv_format: KvFormat,
    options: PlanOptions,
) -> DecodePlan {
    if sparse {
        let shape = SparseShape {
            num_tokens: count,
            num_heads: heads,
            topk: len,
            kv_format,
        };
        DecodePlan::sparse(stream, shape, options)
    } else {
        let shape = DenseShape {
            batch: count,
            q_len: 1,
            num_heads: heads,
            block_size: 64,
            max_blocks_per_seq: len.div_ceil(64),
            kv_format,
        };
        DecodePlan::dense(stream, shape, options)
    }
    .unwrap()
}

/// The schedule's form of the 16-bit 8-row 4-warp kernel (`mla_schedule_internal_t::form`, logs
/// #116, #118): for dense steps transposed exactly where one such CTA has an SM to itself
/// (sm120-occupancy, sm_120), for sparse ones always, as `Tuning::form` forces it, and never
/// for another configuration or an fp8 cache.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_schedule_form() {
    let stream = stream();
    // (form, warps, block_m, CTAs per SM) of a dense b=64 l=4096 or a sparse t=128 top-2048 plan
    let schedule_of = |sparse: bool,
                       heads: usize,
                       kv_format: KvFormat,
                       sm120_occupancy: bool,
                       forced: Option<u32>,
                       warps: Option<u32>| {
        let options = PlanOptions {
            sm120_occupancy,
            tuning: Tuning {
                form: forced,
                warps,
                ..Tuning::default()
            },
        };
        // sparse t=128 top-2048, dense b=64 l=4096
        let (count, len) = if sparse { (128, 2048) } else { (64, 4096) };
        let plan = default_shape_plan(&stream, sparse, count, heads, len, kv_format, options);
        let s = plan.schedule();
        (
            s.internal.form as u32,
            s.internal.warps,
            s.internal.block_m,
            s.ctas_per_sm,
        )
    };
    let form_with = |heads, kv_format, sm120_occupancy, forced, warps| {
        schedule_of(false, heads, kv_format, sm120_occupancy, forced, warps)
    };
    let form = |heads, kv_format, sm120_occupancy, forced| {
        form_with(heads, kv_format, sm120_occupancy, forced, None)
    };
    use mla_decode::ffi::{MLA_FORM_DIRECT as DIRECT, MLA_FORM_TRANSPOSED as TRANSPOSED};
    for kv in [KvFormat::Bf16, KvFormat::F16] {
        for occ in [false, true] {
            let (f, warps, block_m, ctas) = form(8, kv, occ, None);
            assert_eq!(
                (warps, block_m),
                (4, 8),
                "b=64 h=8 l=4096 streams in 8-row 4-warp CTAs"
            );
            assert_eq!(
                f,
                if ctas == 1 { TRANSPOSED } else { DIRECT },
                "{kv:?} occupancy {occ}: {ctas} CTAs/SM"
            );
            if occ {
                assert_eq!(ctas, 1);
            }
            assert_eq!(form(8, kv, occ, Some(DIRECT)).0, DIRECT);
            assert_eq!(form(8, kv, occ, Some(TRANSPOSED)).0, TRANSPOSED);
            // other configurations have one form: a forced one is ignored
            assert_eq!(form(16, kv, occ, Some(TRANSPOSED)).0, DIRECT);
            let (f, warps, block_m, _) = form_with(8, kv, occ, Some(TRANSPOSED), Some(8));
            assert_eq!(
                (f, warps, block_m),
                (DIRECT, 8, 8),
                "8 warps x 8 rows: one form"
            );
            // sparse steps take the transposed form at any occupancy (log #118)
            let (f, warps, block_m, _) = schedule_of(true, 8, kv, occ, None, None);
            assert_eq!(
                (f, warps, block_m),
                (TRANSPOSED, 4, 8),
                "sparse {kv:?} occupancy {occ}"
            );
            assert_eq!(schedule_of(true, 8, kv, occ, Some(DIRECT), None).0, DIRECT);
        }
    }
    for kv in [KvFormat::Fp8DsMla, KvFormat::Fp8PerTensor] {
        for occ in [false, true] {
            assert_eq!(
                form(8, kv, occ, None).0,
                DIRECT,
                "{kv:?}: its own transposed kernels"
            );
            assert_eq!(form(8, kv, occ, Some(TRANSPOSED)).0, DIRECT, "{kv:?}");
        }
    }
    let err = DecodePlan::dense(
        &stream,
        DenseShape {
            batch: 1,
            q_len: 1,
            num_heads: 8,
            block_size: 64,
            max_blocks_per_seq: 4,
            kv_format: KvFormat::Bf16,
        },
        PlanOptions {
            sm120_occupancy: false,
            tuning: Tuning {
                form: Some(3),
                ..Tuning::default()
            },
        },
    );
    assert!(
        matches!(&err, Err(Error::InvalidArgument { .. })),
        "{err:?}"
    );
}

/// The short-request rule of the 16-bit 8-row steps (log #119): a batch near the SM count whose
/// requests are at most 8 tiles (256 positions) keeps every request in one part (min_chunk =
/// the tiles per request), with one transposed CTA per SM where the batch fits the SMs; and
/// fp8_ds_mla rows up to 4 tiles (log #120, direct form); outside the rule (a batch far below or
/// above the SM count, longer requests) the default split of at least two tiles per part.
#[test]
#[ignore = "needs a GPU"]
fn gpu_schedule_short_requests_8_rows() {
    let stream = stream();
    let sms = DeviceInfo::query(stream.context()).unwrap().sm_count as usize;
    use mla_decode::ffi::MLA_FORM_TRANSPOSED as TRANSPOSED;
    // (min_chunk, CTAs per SM, form) of a default plan
    let plan_of = |sparse: bool, batch: usize, len: usize, kv_format: KvFormat, occ: bool| {
        let options = PlanOptions {
            sm120_occupancy: occ,
            tuning: Tuning::default(),
        };
        let plan = default_shape_plan(&stream, sparse, batch, 8, len, kv_format, options);
        let s = plan.schedule();
        (s.internal.min_chunk, s.ctas_per_sm, s.internal.form as u32)
    };
    for sparse in [false, true] {
        for occ in [false, true] {
            for kv in [KvFormat::Bf16, KvFormat::F16] {
                let what = format!("sparse {sparse} occupancy {occ} {kv:?}");
                // a batch of the SM count, requests of 4 and 8 tiles: one part each, one
                // transposed CTA per SM
                for (len, tiles) in [(128usize, 4), (256, 8)] {
                    assert_eq!(
                        plan_of(sparse, sms, len, kv, occ),
                        (tiles, 1, TRANSPOSED),
                        "{what}: b={sms} l={len}"
                    );
                }
                // 3/4 of the SM count: the same
                assert_eq!(plan_of(sparse, sms * 3 / 4, 192, kv, occ).0, 6, "{what}");
                // up to twice the SM count: whole requests at the CTAs per SM of a streaming
                // step (two on the H200, one on sm_120 and at sm120 occupancy)
                let streaming_ctas = plan_of(false, 64, 4096, kv, occ).1;
                let (chunk, ctas, _) = plan_of(sparse, sms * 3 / 2, 128, kv, occ);
                assert_eq!((chunk, ctas), (4, streaming_ctas), "{what}");
                // outside the rule: the default split
                assert_eq!(
                    plan_of(sparse, sms / 2, 256, kv, occ).0,
                    2,
                    "{what}: b=sms/2"
                );
                assert_eq!(
                    plan_of(sparse, sms * 3, 128, kv, occ).0,
                    2,
                    "{what}: b=3 sms"
                );
                assert_eq!(plan_of(sparse, sms, 288, kv, occ).0, 2, "{what}: 9 tiles");
            }
            // fp8_ds_mla (log #120): whole requests up to 4 tiles, the direct form, one CTA per
            // SM up to 4 tiles per SM (the medium-step rule, log #84 (c)), past it the CTAs per
            // SM of a streaming step (at most two: not long); 8-tile requests keep the default
            // split
            let fp8 = KvFormat::Fp8DsMla;
            let fp8_streaming_ctas = plan_of(false, 64, 4096, fp8, occ).1.min(2);
            let what = format!("sparse {sparse} occupancy {occ} fp8_ds_mla");
            for batch in [sms * 3 / 4, sms, sms * 3 / 2] {
                let (chunk, ctas, form) = plan_of(sparse, batch, 128, fp8, occ);
                let want_ctas = if batch <= sms { 1 } else { fp8_streaming_ctas };
                assert_eq!(chunk, 4, "{what}: b={batch} l=128");
                assert_eq!(ctas, want_ctas, "{what}: b={batch} l=128");
                assert_ne!(form, TRANSPOSED, "{what}");
            }
            // (a dense plan's longest request is its table: l=96 in blocks of 64 is 128)
            let tiles_96 = if sparse { 3 } else { 4 };
            assert_eq!(
                plan_of(sparse, sms, 96, fp8, occ).0,
                tiles_96,
                "{what}: l=96"
            );
            assert_eq!(plan_of(sparse, sms, 256, fp8, occ).0, 2, "{what}: 8 tiles");
            assert_eq!(
                plan_of(sparse, sms * 3, 128, fp8, occ).0,
                2,
                "{what}: b=3 sms"
            );
        }
    }
}
