//! Cache append and the sparse index gather.

use std::ffi::c_void;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut};

use crate::device::{bind_flag, ErrorFlag};
use crate::error::{check, Result};
use crate::ffi;
use crate::plan::ordinal;
use crate::tensor::{bind, bind_mut, BlockTable, KvCacheMut};
use crate::types::Element;
use crate::validate;

/// Writes `n = slot_mapping.len()` new 576-wide rows `kv[i]` (rows `kv_token_stride`
/// elements apart) into the paged cache at `slot_mapping[i] = block_id·block_size + offset`;
/// `-1` is skipped, a slot outside the cache is skipped and recorded in `error_flag`.
pub fn append_kv<T: Element>(
    stream: &CudaStream,
    kv: &CudaView<T>,
    kv_token_stride: usize,
    slot_mapping: &CudaView<i64>,
    kv_cache: &mut KvCacheMut<T>,
    error_flag: Option<&ErrorFlag>,
) -> Result<()> {
    let (kv_ptr, kv_buf, _g_kv) = bind(kv, stream);
    let (slots, slots_buf, _g_slots) = bind(slot_mapping, stream);
    let (cache_ptr, cache, _g_cache) = kv_cache.bind(stream);
    let (flag, flag_buf, _g_flag) = bind_flag(error_flag, stream);
    validate::append(&validate::AppendCall {
        device: ordinal(stream),
        dtype: T::DTYPE,
        kv: kv_buf,
        kv_token_stride,
        slot_mapping: slots_buf,
        kv_cache: cache,
        error_flag: flag_buf,
    })?;
    let num_tokens = slot_mapping.len();
    if num_tokens == 0 {
        return Ok(());
    }
    stream.context().bind_to_thread()?;
    // SAFETY: the buffers were checked to lie on this device and to hold `num_tokens` rows
    // and the cache's blocks; the guards keep them borrowed until after the launch.
    let status = unsafe {
        ffi::mla_append_kv(
            kv_ptr as *const c_void,
            kv_token_stride as i64,
            num_tokens as i32,
            slots as *const i64,
            cache_ptr as *mut c_void,
            cache.block_stride_bytes as i64,
            cache.num_blocks as i32,
            cache.block_size as i32,
            T::DTYPE.to_ffi(),
            flag as *mut u32,
            stream.cu_stream() as *mut c_void,
        )
    };
    check("mla_append_kv", status)
}

/// Turns request-logical `positions[t, ..topk]` (rows `positions_stride` apart) of request
/// `req_id[t]` into global slot ids in `out[t, ..topk]` (rows `out_stride` apart), for
/// `t < req_id.len()`.
///
/// `out = block_table[req][pos / block_size] · block_size + pos % block_size`, or `-1` where
/// `pos < 0`, `pos >= seq_lens[req]` (clamped), the block id is outside `[0, num_blocks)` or
/// `req_id` is outside `[0, batch)` (the last two are recorded in `error_flag`).
#[allow(clippy::too_many_arguments)]
pub fn gather_slots(
    stream: &CudaStream,
    positions: &CudaView<i32>,
    positions_stride: usize,
    topk: usize,
    req_id: &CudaView<i32>,
    block_table: &BlockTable,
    seq_lens: &CudaView<i32>,
    num_blocks: usize,
    block_size: usize,
    out: &mut CudaViewMut<i32>,
    out_stride: usize,
    error_flag: Option<&ErrorFlag>,
) -> Result<()> {
    let (pos, pos_buf, _g_pos) = bind(positions, stream);
    let (req, req_buf, _g_req) = bind(req_id, stream);
    let (bt, table, _g_bt) = block_table.bind(stream);
    let (lens, lens_buf, _g_lens) = bind(seq_lens, stream);
    let (o, o_buf, _g_o) = bind_mut(out, stream);
    let (flag, flag_buf, _g_flag) = bind_flag(error_flag, stream);
    validate::gather(&validate::GatherCall {
        device: ordinal(stream),
        positions: pos_buf,
        positions_stride,
        topk,
        req_id: req_buf,
        block_table: table,
        seq_lens: lens_buf,
        num_blocks,
        block_size,
        out: o_buf,
        out_stride,
        error_flag: flag_buf,
    })?;
    stream.context().bind_to_thread()?;
    // SAFETY: as in append_kv.
    let status = unsafe {
        ffi::mla_gather_slots(
            pos as *const i32,
            positions_stride as i32,
            req_id.len() as i32,
            topk as i32,
            req as *const i32,
            bt as *const i32,
            table.stride as i32,
            table.max_blocks_per_seq as i32,
            lens as *const i32,
            table.batch as i32,
            block_size as i32,
            num_blocks as i32,
            o as *mut i32,
            out_stride as i32,
            flag as *mut u32,
            stream.cu_stream() as *mut c_void,
        )
    };
    check("mla_gather_slots", status)
}
