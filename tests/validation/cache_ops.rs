//! The host checks of `append_kv` and `gather_slots`.

use mla_decode::validate::{AppendCall, AppendSplitCall, Buf};
use mla_decode::{validate, ScaleRule, HEAD_DIM, LATENT_DIM, MAX_GATHER_TOKENS, ROPE_DIM};

use super::{append, expect, gather};

#[test]
fn append_errors() {
    let mut c = append();
    c.kv.bytes -= 2;
    expect(validate::append(&c), "kv", "needs");

    let mut c = append();
    c.kv.addr += 2;
    expect(validate::append(&c), "kv", "aligned");

    let mut c = append();
    c.kv_token_stride = HEAD_DIM + 4;
    c.kv.bytes *= 2;
    expect(validate::append(&c), "kv_token_stride", "16 bytes");

    let mut c = append();
    c.kv_token_stride = 512;
    expect(validate::append(&c), "kv_token_stride", "512");

    // kv and slot_mapping must hold num_tokens rows; longer is fine (preallocated).
    let mut c = append();
    c.slot_mapping.bytes = 4 * 8;
    expect(validate::append(&c), "slot_mapping", "needs");
    let mut c = append();
    c.num_tokens = 3;
    assert_eq!(validate::append(&c), Ok(()));
    let mut c = append();
    c.num_tokens = 1 << 31;
    c.kv.bytes = usize::MAX;
    c.slot_mapping.bytes = usize::MAX;
    expect(validate::append(&c), "num_tokens", "");

    // An f16/bf16 cache has no scales to pick.
    let mut c = append();
    c.scale_rule = Some(ScaleRule::Pow2);
    expect(validate::append(&c), "scale_rule", "");

    let mut c = append();
    c.slot_mapping.device = 1;
    expect(validate::append(&c), "slot_mapping", "device");

    let mut c = append();
    c.kv_cache.block_size = 8;
    expect(validate::append(&c), "kv_cache", "block_size 8");

    let mut c = append();
    c.kv_cache.buf.bytes = 100;
    expect(validate::append(&c), "kv_cache", "");

    // Nothing to append is fine, whatever kv holds.
    let mut c = append();
    c.num_tokens = 0;
    c.slot_mapping.bytes = 0;
    c.kv.bytes = 0;
    assert_eq!(validate::append(&c), Ok(()));
}

/// A split append of 5 rows: the latent part in `kv` (`[5, 512]`), the RoPE part apart.
fn split() -> AppendSplitCall {
    let base = append();
    AppendSplitCall {
        rows: AppendCall {
            kv: Buf {
                bytes: 5 * LATENT_DIM * 2,
                ..base.kv
            },
            kv_token_stride: LATENT_DIM,
            ..base
        },
        kv_rope: Buf {
            addr: base.kv.addr + 0x0100_0000,
            bytes: 5 * ROPE_DIM * 2,
            device: 0,
        },
        kv_rope_token_stride: ROPE_DIM,
    }
}

#[test]
fn append_split_errors() {
    assert_eq!(validate::append_split(&split()), Ok(()));
    // the errors name AppendSplitArgs' fields
    let mut c = split();
    c.rows.kv.bytes -= 2;
    expect(validate::append_split(&c), "kv_nope", "needs");
    let mut c = split();
    c.rows.kv_token_stride = 500;
    expect(validate::append_split(&c), "kv_nope_token_stride", "512");
    let mut c = split();
    c.kv_rope.addr += 4;
    expect(validate::append_split(&c), "kv_rope", "aligned");
    let mut c = split();
    c.kv_rope.bytes -= 2;
    expect(validate::append_split(&c), "kv_rope", "needs");
    let mut c = split();
    c.kv_rope_token_stride = 68;
    c.kv_rope.bytes *= 2;
    expect(
        validate::append_split(&c),
        "kv_rope_token_stride",
        "16 bytes",
    );
    let mut c = split();
    c.kv_rope.device = 1;
    expect(validate::append_split(&c), "kv_rope", "device");
    // both parts as views into one [5, 576] tensor
    let mut c = split();
    c.rows.kv_token_stride = HEAD_DIM;
    c.rows.kv.bytes = 5 * HEAD_DIM * 2;
    c.kv_rope = Buf {
        addr: c.rows.kv.addr + LATENT_DIM as u64 * 2,
        bytes: 5 * HEAD_DIM * 2 - LATENT_DIM * 2,
        device: 0,
    };
    c.kv_rope_token_stride = HEAD_DIM;
    assert_eq!(validate::append_split(&c), Ok(()));
}

#[test]
fn gather_errors() {
    let mut c = gather();
    c.topk = 0;
    expect(validate::gather(&c), "topk", "");

    let mut c = gather();
    c.topk = 5000;
    c.positions_stride = 5000;
    c.out_stride = 5000;
    expect(validate::gather(&c), "topk", "5000");

    // req_id must hold num_tokens ids; no tokens is a valid no-op; too many are refused.
    let mut c = gather();
    c.req_id.bytes = 2 * 4;
    expect(validate::gather(&c), "req_id", "needs");
    let mut c = gather();
    c.num_tokens = 0;
    c.req_id.bytes = 0;
    assert_eq!(validate::gather(&c), Ok(()));
    let mut c = gather();
    c.num_tokens = MAX_GATHER_TOKENS + 1;
    expect(validate::gather(&c), "num_tokens", "65535");

    let mut c = gather();
    c.positions_stride = 1000;
    expect(validate::gather(&c), "positions_stride", "1000");

    let mut c = gather();
    c.positions.bytes -= 4;
    expect(validate::gather(&c), "positions", "needs");

    let mut c = gather();
    c.out.bytes -= 4;
    expect(validate::gather(&c), "out", "needs");

    let mut c = gather();
    c.out_stride = 10;
    expect(validate::gather(&c), "out_stride", "10");

    let mut c = gather();
    c.seq_lens.bytes = 4;
    expect(validate::gather(&c), "seq_lens", "needs 2");

    let mut c = gather();
    c.block_table.stride = 16;
    expect(validate::gather(&c), "block_table", "stride");

    let mut c = gather();
    c.kv_cache.block_size = 100;
    expect(validate::gather(&c), "kv_cache", "100");

    let mut c = gather();
    c.kv_cache.num_blocks = (1 << 31) / 64 + 1;
    c.kv_cache.buf.bytes = usize::MAX;
    expect(validate::gather(&c), "kv_cache", "");

    let mut c = gather();
    c.kv_cache.num_blocks = 0;
    expect(validate::gather(&c), "kv_cache", "");

    // Only the cache's device and geometry are checked: the gather never touches its bytes,
    // so a descriptor over a short (or empty) buffer is fine.
    let mut c = gather();
    c.kv_cache.buf.bytes = 0;
    assert_eq!(validate::gather(&c), Ok(()));
    let mut c = gather();
    c.kv_cache.buf.device = 1;
    expect(validate::gather(&c), "kv_cache", "device 1");

    let mut c = gather();
    c.req_id.device = 1;
    expect(validate::gather(&c), "req_id", "device 1");
}
