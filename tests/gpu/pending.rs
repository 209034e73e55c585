//! What the API describes but the kernels do not do yet, checked where the calls meet the
//! kernels: fp8 caches (described and validated, then refused as `Unsupported` until their
//! kernels land, issue #12) and fault values wider than 32 bits (`Error::DeviceFault`'s
//! value is read from words 2 and 3 of the flag; the kernels do not write word 3 yet).

use mla_decode::half::bf16;
use mla_decode::*;

use crate::plumbing::{cache_rows, stream};

/// fp8 caches are described and validated, and refused as unsupported until the kernels
/// exist (issue #12); a per-tensor cache needs its scale.
#[test]
#[ignore = "needs a GPU"]
fn gpu_fp8_caches_are_unsupported() {
    let stream = stream();
    let (heads, block_size) = (8, 64);
    let cache = stream
        .alloc_zeros::<u8>(4 * block_size * KvFormat::Fp8DsMla.row_bytes())
        .unwrap();
    let table = stream.clone_htod(&[0i32, 1]).unwrap();
    let seq_lens = stream.clone_htod(&[100i32]).unwrap();
    let q = stream.alloc_zeros::<bf16>(heads * HEAD_DIM).unwrap();
    let mut out = stream.alloc_zeros::<bf16>(heads * LATENT_DIM).unwrap();
    let shape = DenseShape {
        batch: 1,
        q_len: 1,
        num_heads: heads,
        block_size,
        max_blocks_per_seq: 2,
        kv_format: KvFormat::Fp8DsMla,
    };
    let mut plan = DecodePlan::dense(&stream, shape, PlanOptions::default()).unwrap();
    let args = DenseArgs {
        q: Query::contiguous(&q, heads),
        kv_cache: KvCache::contiguous(&cache, KvFormat::Fp8DsMla, block_size).unwrap(),
        block_table: BlockTable::new(
            &table,
            TableShape {
                batch: 1,
                max_blocks_per_seq: 2,
            },
        ),
        seq_lens: &seq_lens,
        softmax_scale: 0.1,
    };
    let err = dense_decode(
        &stream,
        &mut plan,
        &args,
        &mut Output::contiguous(&mut out, heads),
        None,
        None,
    );
    assert!(matches!(err, Err(Error::Unsupported(_))), "{err:?}");

    let per_tensor = stream
        .alloc_zeros::<u8>(4 * block_size * KvFormat::Fp8PerTensor.row_bytes())
        .unwrap();
    let scale = stream.clone_htod(&[0.5f32]).unwrap();
    let mut plan = DecodePlan::dense(
        &stream,
        DenseShape {
            kv_format: KvFormat::Fp8PerTensor,
            ..shape
        },
        PlanOptions::default(),
    )
    .unwrap();
    let kv = KvCache::contiguous(&per_tensor, KvFormat::Fp8PerTensor, block_size).unwrap();
    for (kv_cache, unsupported) in [(kv.clone(), false), (kv.with_scale(&scale), true)] {
        let err = dense_decode(
            &stream,
            &mut plan,
            &DenseArgs {
                kv_cache,
                ..args.clone()
            },
            &mut Output::contiguous(&mut out, heads),
            None,
            None,
        );
        if unsupported {
            assert!(matches!(err, Err(Error::Unsupported(_))), "{err:?}");
        } else {
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
        }
    }
}

/// Fault values through `check` are the values the kernels met, 64 bits wide: a negative
/// seq_len, a negative block id, an append slot past 2^32 and a negative append slot.
///
/// Expected to fail until the kernels write the value's high 32 bits into word 3 (issue #11,
/// C ABI item 9 and Safe API item 10): today they store the low 32 bits in word 2 and leave
/// word 3 at 0, so `ErrorFlag::check` reads -3 as 4294967293 and 2^33 + 5 as 5. The other
/// tests compare the words themselves, as the kernels write them today.
#[test]
#[ignore = "needs a GPU"]
fn gpu_fault_values_are_64_bit() {
    let stream = stream();
    let heads = 2;
    let mut cache = stream
        .clone_htod(&cache_rows::<bf16>(4, |slot| slot as f64 / 64.0))
        .unwrap();
    let q = stream
        .clone_htod(&vec![bf16::from_f64(1.0 / 64.0); heads * HEAD_DIM])
        .unwrap();
    let mut out = stream.alloc_zeros::<bf16>(heads * LATENT_DIM).unwrap();
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
    let fault = |code: FaultCode, value: i64| {
        Err(Error::DeviceFault {
            code,
            row: 0,
            value,
        })
    };

    for (table, len, want) in [
        ([0i32, 1], -3, fault(FaultCode::NegativeSeqLen, -3)),
        ([0, -5], 20, fault(FaultCode::BadBlockId, -5)),
    ] {
        let table = stream.clone_htod(&table).unwrap();
        let seq_lens = stream.clone_htod(&[len]).unwrap();
        let args = DenseArgs {
            q: Query::contiguous(&q, heads),
            kv_cache: KvCache::contiguous(&cache, KvFormat::Bf16, 16).unwrap(),
            block_table: BlockTable::new(
                &table,
                TableShape {
                    batch: 1,
                    max_blocks_per_seq: 2,
                },
            ),
            seq_lens: &seq_lens,
            softmax_scale: 0.1,
        };
        flag.reset(&stream).unwrap();
        let mut o = Output::contiguous(&mut out, heads);
        dense_decode(&stream, &mut plan, &args, &mut o, None, Some(&mut flag)).unwrap();
        assert_eq!(flag.check(&stream), want, "seq_len {len}");
    }

    let kv = stream.alloc_zeros::<bf16>(HEAD_DIM).unwrap();
    for slot in [(1i64 << 33) + 5, -7] {
        let slots = stream.clone_htod(&[slot]).unwrap();
        let args = AppendArgs {
            kv: &kv,
            kv_token_stride: HEAD_DIM,
            slot_mapping: &slots,
            num_tokens: 1,
            scale_rule: None,
        };
        flag.reset(&stream).unwrap();
        let mut kc = KvCacheMut::contiguous(&mut cache, KvFormat::Bf16, 16).unwrap();
        append_kv(&stream, &args, &mut kc, Some(&mut flag)).unwrap();
        assert_eq!(
            flag.check(&stream),
            fault(FaultCode::BadAppendSlot, slot),
            "append slot {slot}"
        );
    }
}
