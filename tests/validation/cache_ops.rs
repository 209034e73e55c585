//! The host checks of `append_kv` and `gather_slots`.

use mla_decode::{validate, HEAD_DIM};

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
    expect(validate::append(&c), "kv", "aligned");

    let mut c = append();
    c.kv_token_stride = 512;
    expect(validate::append(&c), "kv", "token stride 512");

    let mut c = append();
    c.slot_mapping.device = 1;
    expect(validate::append(&c), "slot_mapping", "device");

    let mut c = append();
    c.kv_cache.block_size = 8;
    expect(validate::append(&c), "block_size", "");

    let mut c = append();
    c.kv_cache.buf.bytes = 100;
    expect(validate::append(&c), "kv_cache", "");

    // Nothing to append is fine, whatever kv holds.
    let mut c = append();
    c.slot_mapping.bytes = 0;
    c.kv.bytes = 0;
    assert_eq!(validate::append(&c), Ok(()));
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

    let mut c = gather();
    c.req_id.bytes = 0;
    expect(validate::gather(&c), "req_id", "0 tokens");

    let mut c = gather();
    c.positions_stride = 1000;
    expect(validate::gather(&c), "positions", "stride 1000");

    let mut c = gather();
    c.positions.bytes -= 4;
    expect(validate::gather(&c), "positions", "needs");

    let mut c = gather();
    c.out.bytes -= 4;
    expect(validate::gather(&c), "out", "needs");

    let mut c = gather();
    c.out_stride = 10;
    expect(validate::gather(&c), "out", "stride 10");

    let mut c = gather();
    c.seq_lens.bytes = 4;
    expect(validate::gather(&c), "seq_lens", "needs 2");

    let mut c = gather();
    c.block_table.stride = 16;
    expect(validate::gather(&c), "block_table", "stride");

    let mut c = gather();
    c.block_size = 100;
    expect(validate::gather(&c), "block_size", "100");

    let mut c = gather();
    c.num_blocks = (1 << 31) / 64 + 1;
    expect(validate::gather(&c), "num_blocks", "");

    let mut c = gather();
    c.num_blocks = 0;
    expect(validate::gather(&c), "num_blocks", "");

    let mut c = gather();
    c.req_id.device = 1;
    expect(validate::gather(&c), "req_id", "device 1");
}
