//! CPU tests (no GPU) of the host-side checks: every validation error fires on its bad input
//! and names the right argument; plus the config presets, fault codes and status mapping.

use mla_decode::validate::{
    self, AppendCall, Buf, CacheDesc, DenseCall, GatherCall, IndicesDesc, PlanDesc, QueryDesc,
    Rows, SparseCall, TableDesc,
};
use mla_decode::{
    DType, DenseShape, Error, KvFormat, PlanKind, SparseShape, HEAD_DIM, LATENT_DIM,
    MAX_GATHER_TOKENS, ROPE_DIM,
};

mod cache_ops;
mod library;

const BASE: u64 = 0x7f00_0000_0000;
const HEADS: usize = 8;

/// A buffer on device 0 with a fresh, 256-aligned address.
fn buf(n: u64, bytes: usize) -> Buf {
    Buf {
        addr: BASE + n * 0x1000_0000,
        bytes,
        device: 0,
    }
}

/// Contiguous `[tokens, HEADS, width]` of 2-byte elements.
fn rows(n: u64, tokens: usize, width: usize, elem: usize) -> Rows {
    Rows {
        buf: buf(n, tokens * HEADS * width * elem),
        token_stride: HEADS * width,
        head_stride: width,
        num_heads: Some(HEADS),
    }
}

fn cache() -> CacheDesc {
    CacheDesc {
        buf: buf(2, 10 * 64 * 1152),
        format: KvFormat::Bf16,
        num_blocks: 10,
        block_size: 64,
        block_stride_bytes: 64 * 1152,
        scale: None,
        elem: None,
    }
}

fn dense_shape() -> DenseShape {
    DenseShape {
        batch: 2,
        q_len: 2,
        num_heads: HEADS,
        block_size: 64,
        max_blocks_per_seq: 4,
        kv_format: KvFormat::Bf16,
    }
}

fn sparse_shape() -> SparseShape {
    SparseShape {
        num_tokens: 3,
        num_heads: HEADS,
        topk: 2048,
        kv_format: KvFormat::F16,
    }
}

/// A valid dense call: batch 2, q_len 2 (4 tokens), 8 heads, 10 blocks of 64.
fn dense() -> DenseCall {
    DenseCall {
        device: 0,
        dtype: DType::Bf16,
        plan: PlanDesc {
            kind: PlanKind::Dense(dense_shape()),
            device: 0,
        },
        q: QueryDesc::Packed(rows(1, 4, HEAD_DIM, 2)),
        kv_cache: cache(),
        block_table: TableDesc {
            buf: buf(3, 2 * 4 * 4),
            batch: 2,
            max_blocks_per_seq: 4,
            stride: 4,
        },
        seq_lens: buf(8, 2 * 4),
        out: rows(4, 4, LATENT_DIM, 2),
        lse: Some(rows(5, 4, 1, 4)),
        softmax_scale: 0.0625,
        error_flag: Some(buf(6, 16)),
    }
}

/// A valid sparse call: 3 tokens, 8 heads, topk 2048.
fn sparse() -> SparseCall {
    SparseCall {
        device: 0,
        dtype: DType::F16,
        plan: PlanDesc {
            kind: PlanKind::Sparse(sparse_shape()),
            device: 0,
        },
        q: QueryDesc::Split {
            nope: rows(1, 3, LATENT_DIM, 2),
            rope: rows(7, 3, ROPE_DIM, 2),
        },
        kv_cache: CacheDesc {
            format: KvFormat::F16,
            ..cache()
        },
        indices: IndicesDesc {
            buf: buf(3, 3 * 2048 * 4),
            topk: 2048,
            stride: 2048,
        },
        topk_len: Some(buf(8, 3 * 4)),
        out: rows(4, 3, LATENT_DIM, 2),
        lse: None,
        softmax_scale: 0.1352,
        error_flag: None,
    }
}

/// A valid append of 5 rows.
fn append() -> AppendCall {
    AppendCall {
        device: 0,
        dtype: DType::Bf16,
        kv: buf(1, 5 * HEAD_DIM * 2),
        kv_token_stride: HEAD_DIM,
        slot_mapping: buf(3, 5 * 8),
        num_tokens: 5,
        scale_rule: None,
        kv_cache: cache(),
        error_flag: Some(buf(6, 16)),
    }
}

/// A valid gather of 3 tokens × topk 2048 over a batch of 2.
fn gather() -> GatherCall {
    GatherCall {
        device: 0,
        positions: buf(1, 3 * 2048 * 4),
        positions_stride: 2048,
        topk: 2048,
        req_id: buf(2, 3 * 4),
        block_table: TableDesc {
            buf: buf(3, 2 * 32 * 4),
            batch: 2,
            max_blocks_per_seq: 32,
            stride: 32,
        },
        seq_lens: buf(4, 2 * 4),
        kv_cache: CacheDesc {
            num_blocks: 64,
            buf: buf(6, 64 * 64 * 1152),
            ..cache()
        },
        num_tokens: 3,
        out: buf(5, 3 * 2048 * 4),
        out_stride: 2048,
        error_flag: None,
    }
}

/// Asserts `r` is `InvalidArgument` for `arg` with a reason containing `needle`.
#[track_caller]
fn expect(r: mla_decode::Result<()>, arg: &str, needle: &str) {
    match r {
        Err(Error::InvalidArgument { arg: a, reason }) => {
            assert_eq!(a, arg, "wrong argument named (reason: {reason})");
            assert!(
                reason.contains(needle),
                "reason {reason:?} lacks {needle:?}"
            );
        }
        other => panic!("expected InvalidArgument({arg}), got {other:?}"),
    }
}

fn packed(c: &mut DenseCall) -> &mut Rows {
    match &mut c.q {
        QueryDesc::Packed(r) => r,
        QueryDesc::Split { .. } => unreachable!(),
    }
}

#[test]
fn valid_calls_pass() {
    assert_eq!(validate::dense(&dense()), Ok(()));
    assert_eq!(validate::sparse(&sparse()), Ok(()));
    assert_eq!(validate::append(&append()), Ok(()));
    assert_eq!(validate::gather(&gather()), Ok(()));
    assert_eq!(validate::dense_shape(&dense_shape()), Ok(()));
    assert_eq!(validate::sparse_shape(&sparse_shape()), Ok(()));
    // Strided views that are not contiguous but fine: FlashMLA-style lse [heads, tokens],
    // q as a slice of a wider buffer, padded cache blocks.
    let mut c = dense();
    c.lse = Some(Rows {
        buf: buf(5, 4 * HEADS * 4),
        token_stride: 1,
        head_stride: 4,
        num_heads: None,
    });
    let q = packed(&mut c);
    q.token_stride = HEADS * 640;
    q.head_stride = 640;
    q.num_heads = None;
    q.buf.bytes = 4 * HEADS * 640 * 2;
    c.kv_cache.block_stride_bytes = 64 * 1152 + 256;
    c.kv_cache.buf.bytes = 10 * (64 * 1152 + 256);
    assert_eq!(validate::dense(&c), Ok(()));
}

#[test]
fn dense_shape_limits() {
    let s = dense_shape();
    for (shape, arg) in [
        (DenseShape { num_heads: 0, ..s }, "num_heads"),
        (
            DenseShape {
                num_heads: 129,
                ..s
            },
            "num_heads",
        ),
        (DenseShape { q_len: 0, ..s }, "q_len"),
        (DenseShape { q_len: 9, ..s }, "q_len"),
        (
            DenseShape {
                block_size: 48,
                ..s
            },
            "block_size",
        ),
        (
            DenseShape {
                block_size: 256,
                ..s
            },
            "block_size",
        ),
        (DenseShape { batch: 0, ..s }, "batch"),
        (
            DenseShape {
                max_blocks_per_seq: 0,
                ..s
            },
            "max_blocks_per_seq",
        ),
        (
            DenseShape {
                max_blocks_per_seq: (1 << 31) / 64,
                ..s
            },
            "max_blocks_per_seq",
        ),
    ] {
        expect(validate::dense_shape(&shape), arg, "");
    }
    for bs in [16, 32, 64, 128] {
        let ok = DenseShape {
            block_size: bs,
            ..s
        };
        assert_eq!(validate::dense_shape(&ok), Ok(()));
    }
}

#[test]
fn sparse_shape_limits() {
    let s = sparse_shape();
    expect(
        validate::sparse_shape(&SparseShape { topk: 0, ..s }),
        "topk",
        "0 outside 1..=4096",
    );
    expect(
        validate::sparse_shape(&SparseShape { topk: 4097, ..s }),
        "topk",
        "4097",
    );
    expect(
        validate::sparse_shape(&SparseShape { num_tokens: 0, ..s }),
        "num_tokens",
        "",
    );
    expect(
        validate::sparse_shape(&SparseShape {
            num_heads: 200,
            ..s
        }),
        "num_heads",
        "200",
    );
    let max = SparseShape {
        topk: 4096,
        num_heads: 128,
        ..s
    };
    assert_eq!(validate::sparse_shape(&max), Ok(()));
}

#[test]
fn query_errors() {
    let mut c = dense();
    packed(&mut c).buf.bytes -= 2;
    expect(validate::dense(&c), "q", "needs");

    let mut c = dense();
    packed(&mut c).buf.addr += 8;
    expect(validate::dense(&c), "q", "16-byte aligned");

    let mut c = dense();
    let q = packed(&mut c);
    q.num_heads = None;
    q.head_stride = 580; // 1160 bytes: not a multiple of 16
    q.token_stride = HEADS * 580;
    q.buf.bytes = 4 * HEADS * 580 * 2;
    expect(validate::dense(&c), "q", "head stride 580");

    let mut c = dense();
    let q = packed(&mut c);
    q.num_heads = None;
    q.token_stride = HEADS * HEAD_DIM + 4; // 8 bytes off
    q.buf.bytes *= 2;
    expect(validate::dense(&c), "q", "token stride");

    let mut c = dense();
    packed(&mut c).num_heads = Some(16);
    expect(validate::dense(&c), "q", "made for 16 heads");

    let mut c = dense();
    packed(&mut c).buf.device = 1;
    expect(validate::dense(&c), "q", "device 1");

    let mut c = dense();
    packed(&mut c).token_stride = usize::MAX / 2;
    expect(validate::dense(&c), "q", "too large");

    // Split q: each part is checked on its own, with its own width.
    let mut c = sparse();
    if let QueryDesc::Split { rope, .. } = &mut c.q {
        rope.buf.bytes = 3 * HEADS * ROPE_DIM * 2 - 2;
    }
    expect(validate::sparse(&c), "q", "q_rope: ");
    let mut c = sparse();
    if let QueryDesc::Split { nope, .. } = &mut c.q {
        nope.buf.addr += 2;
    }
    expect(validate::sparse(&c), "q", "q_nope: ");
}

#[test]
fn output_and_lse_errors() {
    let mut c = dense();
    c.out.buf.bytes -= 2;
    expect(validate::dense(&c), "out", "needs");

    let mut c = dense();
    c.out.buf.addr += 4;
    expect(validate::dense(&c), "out", "aligned");

    let mut c = dense();
    c.out.num_heads = None;
    c.out.head_stride = 256; // heads overlap
    expect(validate::dense(&c), "out", "overlap");

    let mut c = dense();
    c.out.num_heads = None;
    c.out.token_stride = 0; // tokens overlap
    expect(validate::dense(&c), "out", "overlap");

    let mut c = dense();
    c.out.buf.device = 3;
    expect(validate::dense(&c), "out", "device 3");

    let mut c = dense();
    c.lse.as_mut().unwrap().buf.bytes -= 4;
    expect(validate::dense(&c), "lse", "needs");

    let mut c = dense();
    c.lse.as_mut().unwrap().num_heads = Some(4);
    expect(validate::dense(&c), "lse", "made for 4 heads");

    let mut c = dense();
    let l = c.lse.as_mut().unwrap();
    l.num_heads = None;
    l.head_stride = 0;
    expect(validate::dense(&c), "lse", "overlap");

    let mut c = sparse();
    c.out.buf.bytes = 2 * HEADS * LATENT_DIM * 2; // 2 tokens, plan has 3
    expect(validate::sparse(&c), "out", "needs");
}

#[test]
fn cache_errors() {
    let mut c = dense();
    c.kv_cache.block_size = 24;
    expect(validate::dense(&c), "kv_cache", "block_size 24");

    let mut c = dense();
    c.kv_cache.block_stride_bytes = 64 * 1152 - 16;
    expect(validate::dense(&c), "kv_cache", "block stride");

    let mut c = dense();
    c.kv_cache.block_stride_bytes = 64 * 1152 + 8;
    c.kv_cache.buf.bytes *= 2;
    expect(validate::dense(&c), "kv_cache", "multiple of 16");

    let mut c = dense();
    c.kv_cache.buf.bytes -= 16;
    expect(validate::dense(&c), "kv_cache", "need");

    let mut c = dense();
    c.kv_cache.buf.addr += 8;
    expect(validate::dense(&c), "kv_cache", "aligned");

    let mut c = dense();
    c.kv_cache.num_blocks = 0;
    expect(validate::dense(&c), "kv_cache", "no whole block");

    let mut c = dense();
    c.kv_cache.buf.device = 1;
    expect(validate::dense(&c), "kv_cache", "device");

    // Sparse slot ids are int32: num_blocks * block_size must stay <= 2^31.
    let mut c = sparse();
    c.kv_cache.num_blocks = (1 << 31) / 64 + 1;
    c.kv_cache.buf.bytes = usize::MAX;
    expect(validate::sparse(&c), "kv_cache", "int32");
    // ... which dense decode does not need.
    let mut c = dense();
    c.kv_cache.num_blocks = (1 << 31) / 64 + 1;
    c.kv_cache.buf.bytes = usize::MAX;
    assert_eq!(validate::dense(&c), Ok(()));
}

#[test]
fn block_table_errors() {
    let mut c = dense();
    c.block_table.stride = 3;
    expect(validate::dense(&c), "block_table", "stride");

    let mut c = dense();
    c.block_table.buf.bytes -= 4;
    expect(validate::dense(&c), "block_table", "needs");

    let mut c = dense();
    c.block_table.buf.device = 2;
    expect(validate::dense(&c), "block_table", "device 2");

    let mut c = dense();
    c.block_table.max_blocks_per_seq = 0;
    expect(validate::dense(&c), "block_table", "max_blocks_per_seq");

    // A strided table (engines' padded rows) is fine.
    let mut c = dense();
    c.block_table.stride = 8;
    c.block_table.buf.bytes = (8 + 4) * 4;
    assert_eq!(validate::dense(&c), Ok(()));
}

#[test]
fn plan_errors() {
    let mut c = dense();
    c.plan.device = 1;
    expect(validate::dense(&c), "plan", "device 1");

    let mut c = dense();
    c.plan.kind = PlanKind::Sparse(sparse_shape());
    expect(validate::dense(&c), "plan", "sparse plan");

    let mut c = dense();
    c.block_table.batch = 1;
    expect(
        validate::dense(&c),
        "block_table",
        "has batch 1, the plan was made for 2",
    );

    let mut c = dense();
    c.block_table.max_blocks_per_seq = 3;
    expect(
        validate::dense(&c),
        "block_table",
        "max_blocks_per_seq 3, the plan was made for 4",
    );

    let mut c = dense();
    c.kv_cache.block_size = 32;
    c.kv_cache.block_stride_bytes = 32 * 1152;
    expect(
        validate::dense(&c),
        "kv_cache",
        "block_size 32, the plan was made for 64",
    );

    // The cache's format must be the plan's, and an f16/bf16 cache the query's dtype.
    let mut c = dense();
    c.kv_cache.format = KvFormat::F16;
    expect(validate::dense(&c), "kv_cache", "");
    let mut c = dense();
    c.dtype = DType::F16;
    c.plan.kind = PlanKind::Dense(DenseShape {
        kv_format: KvFormat::F16,
        ..dense_shape()
    });
    expect(validate::dense(&c), "kv_cache", "");

    let mut c = sparse();
    c.plan.kind = PlanKind::Dense(dense_shape());
    expect(validate::sparse(&c), "plan", "dense plan");

    let mut c = sparse();
    c.indices.topk = 1024;
    expect(
        validate::sparse(&c),
        "indices",
        "topk 1024, the plan was made for 2048",
    );
}

#[test]
fn softmax_scale_must_be_finite_and_positive() {
    for s in [0.0, -0.1, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut c = dense();
        c.softmax_scale = s;
        expect(validate::dense(&c), "softmax_scale", "finite");
        let mut c = sparse();
        c.softmax_scale = s;
        expect(validate::sparse(&c), "softmax_scale", "");
    }
    assert_eq!(validate::softmax_scale(1e-3), Ok(()));
}

#[test]
fn lengths_errors() {
    // seq_lens must hold the plan's batch values, on the stream's device.
    let mut c = dense();
    c.seq_lens = buf(8, 4);
    expect(validate::dense(&c), "seq_lens", "needs 2");
    let mut c = dense();
    c.seq_lens.device = 1;
    expect(validate::dense(&c), "seq_lens", "device 1");
    // Longer is fine (an engine's max-batch buffer).
    let mut c = dense();
    c.seq_lens.bytes = 64 * 4;
    assert_eq!(validate::dense(&c), Ok(()));

    // topk_len is optional; if given it must hold num_tokens values, on the stream's device.
    let mut c = sparse();
    c.topk_len = None;
    assert_eq!(validate::sparse(&c), Ok(()));
    let mut c = sparse();
    c.topk_len = Some(buf(8, 2 * 4));
    expect(validate::sparse(&c), "topk_len", "needs 3");
    let mut c = sparse();
    c.topk_len = Some(Buf {
        device: 1,
        ..buf(8, 3 * 4)
    });
    expect(validate::sparse(&c), "topk_len", "device 1");
}

#[test]
fn indices_errors() {
    let mut c = sparse();
    c.indices.stride = 2000;
    expect(validate::sparse(&c), "indices", "stride 2000");

    let mut c = sparse();
    c.indices.buf.bytes -= 4;
    expect(validate::sparse(&c), "indices", "needs");

    let mut c = sparse();
    c.indices.buf.device = 1;
    expect(validate::sparse(&c), "indices", "device");

    let mut c = sparse();
    c.indices.stride = 4096;
    c.indices.buf.bytes = (2 * 4096 + 2048) * 4;
    assert_eq!(validate::sparse(&c), Ok(()));
}

#[test]
fn error_flag_errors() {
    let mut c = dense();
    c.error_flag = Some(buf(6, 8));
    expect(validate::dense(&c), "error_flag", "needs 4");
    let mut c = dense();
    c.error_flag = Some(Buf {
        device: 1,
        ..buf(6, 16)
    });
    expect(validate::dense(&c), "error_flag", "device 1");
    let mut c = append();
    c.error_flag = Some(buf(6, 4));
    expect(validate::append(&c), "error_flag", "");
    let mut c = dense();
    c.error_flag = Some(buf(6, 0));
    expect(validate::dense(&c), "error_flag", "");
}

/// The plan counts 32-row tiles in int32, and the gather puts tokens on a 65,535-row grid
/// axis: shapes beyond either are refused on the host, naming the argument.
#[test]
fn int32_tile_and_grid_limits() {
    let s = dense_shape();
    // one request may not exceed i32::MAX - 31 positions
    expect(
        validate::dense_shape(&DenseShape {
            block_size: 16,
            max_blocks_per_seq: (i32::MAX as usize) / 16,
            ..s
        }),
        "max_blocks_per_seq",
        "",
    );
    // the whole batch's tiles must fit an int32
    expect(
        validate::dense_shape(&DenseShape {
            batch: 1 << 20,
            block_size: 128,
            max_blocks_per_seq: 1 << 10, // 2^20 requests x 4096 tiles = 2^32
            ..s
        }),
        "batch",
        "tiles",
    );
    assert_eq!(
        validate::dense_shape(&DenseShape {
            batch: 1024,
            block_size: 128,
            max_blocks_per_seq: 2048,
            ..s
        }),
        Ok(())
    );
    let t = sparse_shape();
    expect(
        validate::sparse_shape(&SparseShape {
            num_tokens: 1 << 25,
            topk: 4096,
            ..t
        }),
        "num_tokens",
        "tiles",
    );

    let mut c = gather();
    c.num_tokens = MAX_GATHER_TOKENS + 1;
    c.req_id.bytes = 4 * (MAX_GATHER_TOKENS + 1);
    expect(validate::gather(&c), "num_tokens", "65535");
}
