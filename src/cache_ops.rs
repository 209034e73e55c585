//! Cache append and the sparse index gather.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::buffer::{self, DeviceRead, DeviceWrite};
use crate::error::{check, Result};
use crate::ffi;
use crate::flag::{bind_flag, ErrorFlag};
use crate::plan::ordinal;
use crate::tensor::{BlockTable, KvCache, KvCacheMut};
use crate::types::{Element, ScaleRule};
use crate::validate;

/// What [`append_kv`] writes into the cache: `num_tokens` new rows and where they go.
#[derive(Clone, Copy, Debug)]
pub struct AppendArgs<'a, T> {
    /// New 576-wide rows `[num_tokens, 576]` in the query dtype, rows `kv_token_stride`
    /// elements apart.
    pub kv: &'a dyn DeviceRead<T>,
    /// Elements between rows of `kv` (`>= 576`, a multiple of 16 bytes).
    pub kv_token_stride: usize,
    /// Where row `i` goes, `[num_tokens]` int64: `block_id · block_size + offset`; `-1` is
    /// skipped, a slot outside the cache is skipped and recorded in the flag.
    pub slot_mapping: &'a dyn DeviceRead<i64>,
    /// Rows to append; `kv` and `slot_mapping` may be longer (preallocated buffers). 0 is a
    /// no-op.
    pub num_tokens: usize,
    /// How an [`Fp8DsMla`](crate::KvFormat::Fp8DsMla) cache's per-tile scales are picked:
    /// required for that format, `None` for the others (f16/bf16 have no scales, an
    /// [`Fp8PerTensor`](crate::KvFormat::Fp8PerTensor) cache quantizes with its own scale).
    pub scale_rule: Option<ScaleRule>,
}

/// Writes `args.num_tokens` new rows into the paged cache, converting them to the cache's
/// format: an f16/bf16 cache takes rows of its own dtype; an fp8 cache quantizes f16 or bf16
/// rows (fp8_ds_mla: per-128-value tile scales by `scale_rule`; per-tensor fp8: the cache's
/// scale), byte for byte as [`reference::fp8`](crate::reference::fp8) does (docs/DESIGN.md §8).
///
/// Checks every argument first (an error names a parameter or a field of [`AppendArgs`]);
/// allocates nothing and does not synchronize (graph-capturable).
///
/// ```no_run
/// # use half::bf16;
/// # use mla_decode::cudarc::driver::CudaContext;
/// # use mla_decode::*;
/// # fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
/// # let stream = CudaContext::new(0)?.new_stream()?;
/// # let (max_tokens, block_size) = (256, 64);
/// let mut cache = stream.alloc_zeros::<bf16>(1024 * block_size * HEAD_DIM)?;
/// let kv = stream.alloc_zeros::<bf16>(max_tokens * HEAD_DIM)?; // this step's new rows
/// let slots = stream.alloc_zeros::<i64>(max_tokens)?; // preallocated for the largest step
/// let mut flag = ErrorFlag::new(&stream)?;
/// let mut kc = KvCacheMut::contiguous(&mut cache, KvFormat::Bf16, block_size)?;
/// let args = AppendArgs {
///     kv: &kv,
///     kv_token_stride: HEAD_DIM,
///     slot_mapping: &slots,
///     num_tokens: 3, // this step: the first 3 rows of each buffer
///     scale_rule: None,
/// };
/// append_kv(&stream, &args, &mut kc, Some(&mut flag))?;
/// # Ok(())
/// # }
/// ```
pub fn append_kv<T: Element>(
    stream: &Arc<CudaStream>,
    args: &AppendArgs<T>,
    kv_cache: &mut KvCacheMut,
    error_flag: Option<&mut ErrorFlag>,
) -> Result<()> {
    let rows = Rows {
        kv: args.kv,
        kv_token_stride: args.kv_token_stride,
        rope: None,
        slot_mapping: args.slot_mapping,
        num_tokens: args.num_tokens,
        scale_rule: args.scale_rule,
    };
    append(stream, &rows, kv_cache, error_flag)
}

/// What [`append_kv_split`] writes into the cache: like [`AppendArgs`], with each new row's
/// 512 latent values and its 64 RoPE values in separate tensors, as engines keep them (vLLM's
/// `kv_c` and `k_pe`), so that no concatenated copy is needed.
#[derive(Clone, Copy, Debug)]
pub struct AppendSplitArgs<'a, T> {
    /// The latent part of the new rows, `[num_tokens, 512]` in the query dtype, rows
    /// `kv_nope_token_stride` elements apart.
    pub kv_nope: &'a dyn DeviceRead<T>,
    /// Elements between rows of `kv_nope` (`>= 512`, a multiple of 16 bytes).
    pub kv_nope_token_stride: usize,
    /// The RoPE part, `[num_tokens, 64]` in the same dtype (16-byte aligned), rows
    /// `kv_rope_token_stride` elements apart.
    pub kv_rope: &'a dyn DeviceRead<T>,
    /// Elements between rows of `kv_rope` (`>= 64`, a multiple of 16 bytes: e.g. 576 where
    /// `k_pe` is a view into the projection's `[num_tokens, 576]` output).
    pub kv_rope_token_stride: usize,
    /// Where row `i` goes, as in [`AppendArgs::slot_mapping`].
    pub slot_mapping: &'a dyn DeviceRead<i64>,
    /// Rows to append; the buffers may be longer. 0 is a no-op.
    pub num_tokens: usize,
    /// As in [`AppendArgs::scale_rule`].
    pub scale_rule: Option<ScaleRule>,
}

/// [`append_kv`] for rows whose latent and RoPE parts lie in separate tensors: row `i` is
/// `kv_nope[i][..512]` followed by `kv_rope[i][..64]`, written exactly as `append_kv` writes
/// the concatenated row (the same bytes in every cache format).
///
/// Checks every argument first (an error names a parameter or a field of
/// [`AppendSplitArgs`]); allocates nothing and does not synchronize (graph-capturable).
///
/// ```no_run
/// # use half::bf16;
/// # use mla_decode::cudarc::driver::CudaContext;
/// # use mla_decode::*;
/// # fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
/// # let stream = CudaContext::new(0)?.new_stream()?;
/// # let (max_tokens, block_size) = (256, 64);
/// let mut cache = stream.alloc_zeros::<u8>(1024 * block_size * KvFormat::Fp8DsMla.row_bytes())?;
/// let kv_c = stream.alloc_zeros::<bf16>(max_tokens * LATENT_DIM)?; // normed latent rows
/// let k_pe = stream.alloc_zeros::<bf16>(max_tokens * ROPE_DIM)?; // rotated RoPE rows
/// let slots = stream.alloc_zeros::<i64>(max_tokens)?;
/// let mut kc = KvCacheMut::contiguous(&mut cache, KvFormat::Fp8DsMla, block_size)?;
/// let args = AppendSplitArgs {
///     kv_nope: &kv_c,
///     kv_nope_token_stride: LATENT_DIM,
///     kv_rope: &k_pe,
///     kv_rope_token_stride: ROPE_DIM,
///     slot_mapping: &slots,
///     num_tokens: 3,
///     scale_rule: Some(ScaleRule::Raw),
/// };
/// append_kv_split(&stream, &args, &mut kc, None)?;
/// # Ok(())
/// # }
/// ```
pub fn append_kv_split<T: Element>(
    stream: &Arc<CudaStream>,
    args: &AppendSplitArgs<T>,
    kv_cache: &mut KvCacheMut,
    error_flag: Option<&mut ErrorFlag>,
) -> Result<()> {
    let rows = Rows {
        kv: args.kv_nope,
        kv_token_stride: args.kv_nope_token_stride,
        rope: Some((args.kv_rope, args.kv_rope_token_stride)),
        slot_mapping: args.slot_mapping,
        num_tokens: args.num_tokens,
        scale_rule: args.scale_rule,
    };
    append(stream, &rows, kv_cache, error_flag)
}

/// Both appends' arguments: `kv` whole rows, or their latent part when `rope` is given.
struct Rows<'a, T> {
    kv: &'a dyn DeviceRead<T>,
    kv_token_stride: usize,
    rope: Option<(&'a dyn DeviceRead<T>, usize)>,
    slot_mapping: &'a dyn DeviceRead<i64>,
    num_tokens: usize,
    scale_rule: Option<ScaleRule>,
}

fn append<T: Element>(
    stream: &Arc<CudaStream>,
    args: &Rows<T>,
    kv_cache: &mut KvCacheMut,
    error_flag: Option<&mut ErrorFlag>,
) -> Result<()> {
    let (kv_view, slots_view) = (buffer::view_of(args.kv), buffer::view_of(args.slot_mapping));
    let rope_view = args.rope.map(|(r, stride)| (buffer::view_of(r), stride));
    let kv = buffer::read(&kv_view, stream);
    let rope = (rope_view.as_ref()).map(|(v, stride)| (buffer::read(v, stream), *stride));
    let slots = buffer::read(&slots_view, stream);
    let cache = kv_cache.bind(stream);
    let (flag, flag_buf, _g_flag) = bind_flag(error_flag, stream);
    let call = validate::AppendCall {
        device: ordinal(stream),
        dtype: T::DTYPE,
        kv: kv.buf,
        kv_token_stride: args.kv_token_stride,
        slot_mapping: slots.buf,
        num_tokens: args.num_tokens,
        scale_rule: args.scale_rule,
        kv_cache: cache.desc,
        error_flag: flag_buf,
    };
    match &rope {
        None => validate::append(&call)?,
        Some((r, stride)) => validate::append_split(&validate::AppendSplitCall {
            rows: call,
            kv_rope: r.buf,
            kv_rope_token_stride: *stride,
        })?,
    }
    if args.num_tokens == 0 {
        return Ok(());
    }
    stream.context().bind_to_thread()?;
    // SAFETY: the buffers were checked to lie on this device and to hold `num_tokens` rows
    // (or row parts) and the cache's blocks; the guards keep them borrowed until after the
    // launch.
    let status = unsafe {
        ffi::mla_append_kv(
            &ffi::mla_append_params_t {
                kv: kv.addr as *const c_void,
                kv_token_stride: args.kv_token_stride as i64,
                dtype: T::DTYPE.to_ffi(),
                num_tokens: args.num_tokens as i32,
                slot_mapping: slots.addr as *const i64,
                kv_cache: cache.addr as *mut c_void,
                kv_format: cache.desc.format.to_ffi(),
                kv_scale: cache.scale_addr as *const f32,
                scale_rule: match args.scale_rule {
                    Some(ScaleRule::Pow2) => ffi::mla_scale_rule_t::MLA_SCALE_POW2,
                    _ => ffi::mla_scale_rule_t::MLA_SCALE_RAW,
                },
                block_stride_bytes: cache.desc.block_stride_bytes as i64,
                num_blocks: cache.desc.num_blocks as i32,
                block_size: cache.desc.block_size as i32,
                error_flag: flag as *mut u32,
                kv_rope: (rope.as_ref()).map_or(std::ptr::null(), |(r, _)| r.addr as *const c_void),
                kv_rope_token_stride: rope.as_ref().map_or(0, |(_, stride)| *stride as i64),
            },
            stream.cu_stream() as *mut c_void,
        )
    };
    check("mla_append_kv", status)
}

/// What [`gather_slots`] reads: the indexer's request-logical positions and how to map them
/// to the global slot ids of `kv_cache`.
#[derive(Clone, Debug)]
pub struct GatherArgs<'a> {
    /// Positions within each token's request, `[num_tokens, topk]` int32, rows
    /// `positions_stride` elements apart.
    pub positions: &'a dyn DeviceRead<i32>,
    /// Elements between rows of `positions` (`>= topk`).
    pub positions_stride: usize,
    /// The request of each token, `[num_tokens]` int32.
    pub req_id: &'a dyn DeviceRead<i32>,
    /// Block table `[batch, max_blocks_per_seq]`: `batch` is the number of requests.
    pub block_table: BlockTable<'a>,
    /// Cache rows per request, `[batch]` int32, clamped to `0..=max_blocks_per_seq ·
    /// block_size`; a bad one is recorded in the flag.
    pub seq_lens: &'a dyn DeviceRead<i32>,
    /// The cache the slot ids are for, the one the sparse decode then reads: its
    /// `block_size` splits positions, its `num_blocks` bounds block ids (its data is not
    /// read, so any format works).
    pub kv_cache: KvCache<'a>,
    /// Entries per row, 1..=4096.
    pub topk: usize,
    /// Query tokens, `0..=MAX_GATHER_TOKENS` ([`MAX_GATHER_TOKENS`](crate::MAX_GATHER_TOKENS));
    /// the buffers may be longer. 0 is a no-op.
    pub num_tokens: usize,
    /// Elements between rows of the `out` buffer (`>= topk`).
    pub out_stride: usize,
}

/// Turns request-logical `positions[t, ..topk]` of request `req_id[t]` into global slot ids
/// `out[t, ..topk]` (rows `args.out_stride` elements apart), for
/// `t < num_tokens`: the [`SparseIndices`](crate::SparseIndices) a sparse decode of the same
/// `kv_cache` reads.
///
/// `out = block_table[req][pos / block_size] · block_size + pos % block_size`, or `-1` where
/// `pos < 0`, `pos >= seq_lens[req]` (clamped), the block id is outside `[0, num_blocks)` or
/// `req_id` is outside `[0, batch)` (the last two, and a bad `seq_len`, are recorded in
/// `error_flag`).
///
/// Checks every argument first (an error names a parameter or a field of [`GatherArgs`]);
/// allocates nothing and does not synchronize (graph-capturable).
///
/// ```no_run
/// # use half::bf16;
/// # use mla_decode::cudarc::driver::CudaContext;
/// # use mla_decode::*;
/// # fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
/// # let stream = CudaContext::new(0)?.new_stream()?;
/// # let (batch, max_blocks, block_size, t, topk, heads) = (2, 32, 64, 4, 2048, 8);
/// let mut cache = stream.alloc_zeros::<bf16>(batch * max_blocks * block_size * HEAD_DIM)?;
/// let table = stream.clone_htod(&(0..(batch * max_blocks) as i32).collect::<Vec<_>>())?;
/// let seq_lens = stream.clone_htod(&[100i32, 2048])?;
/// let req_id = stream.clone_htod(&[0i32, 0, 1, 1])?;
/// let positions = stream.alloc_zeros::<i32>(t * topk)?; // the indexer's top-k
/// let mut slots = stream.alloc_zeros::<i32>(t * topk)?;
/// let (kv, new_slots) = (stream.alloc_zeros::<bf16>(2 * HEAD_DIM)?, stream.clone_htod(&[100i64, 2048])?);
/// let mut flag = ErrorFlag::new(&stream)?;
///
/// // Append this step's rows, then map positions to slots of the same cache.
/// let mut kc = KvCacheMut::contiguous(&mut cache, KvFormat::Bf16, block_size)?;
/// let append = AppendArgs {
///     kv: &kv, kv_token_stride: HEAD_DIM, slot_mapping: &new_slots, num_tokens: 2, scale_rule: None,
/// };
/// append_kv(&stream, &append, &mut kc, Some(&mut flag))?;
/// let gather = GatherArgs {
///     positions: &positions,
///     positions_stride: topk,
///     req_id: &req_id,
///     block_table: BlockTable::new(&table, TableShape { batch, max_blocks_per_seq: max_blocks }),
///     seq_lens: &seq_lens,
///     kv_cache: kc.as_cache(),
///     topk,
///     num_tokens: t,
///     out_stride: topk,
/// };
/// gather_slots(&stream, &gather, &mut slots, Some(&mut flag))?;
/// // `SparseIndices::contiguous(&slots, topk)` with `kc.as_cache()` feed sparse_decode.
/// # let _ = heads;
/// # Ok(())
/// # }
/// ```
pub fn gather_slots(
    stream: &Arc<CudaStream>,
    args: &GatherArgs,
    out: &mut impl DeviceWrite<i32>,
    error_flag: Option<&mut ErrorFlag>,
) -> Result<()> {
    let views = [args.positions, args.req_id, args.seq_lens].map(buffer::view_of);
    let [pos, req, lens] = views.each_ref().map(|v| buffer::read(v, stream));
    let (table, bt) = args.block_table.bind(stream);
    let cache = args.kv_cache.bind(stream);
    let mut out_view = buffer::view_mut_of(out);
    let o = buffer::write(&mut out_view, stream);
    let (flag, flag_buf, _g_flag) = bind_flag(error_flag, stream);
    validate::gather(&validate::GatherCall {
        device: ordinal(stream),
        positions: pos.buf,
        positions_stride: args.positions_stride,
        req_id: req.buf,
        block_table: table,
        seq_lens: lens.buf,
        kv_cache: cache.desc,
        topk: args.topk,
        num_tokens: args.num_tokens,
        out: o.buf,
        out_stride: args.out_stride,
        error_flag: flag_buf,
    })?;
    if args.num_tokens == 0 {
        return Ok(());
    }
    stream.context().bind_to_thread()?;
    // SAFETY: as in append_kv.
    let status = unsafe {
        ffi::mla_gather_slots(
            &ffi::mla_gather_params_t {
                num_tokens: args.num_tokens as i32,
                topk: args.topk as i32,
                positions: pos.addr as *const i32,
                positions_stride: args.positions_stride as i64,
                req_id: req.addr as *const i32,
                batch: table.batch as i32,
                block_table: bt.addr as *const i32,
                max_blocks_per_seq: table.max_blocks_per_seq as i32,
                block_table_stride: table.stride as i64,
                seq_lens: lens.addr as *const i32,
                num_blocks: cache.desc.num_blocks as i32,
                block_size: cache.desc.block_size as i32,
                out_slots: o.addr as *mut i32,
                out_stride: args.out_stride as i64,
                error_flag: flag as *mut u32,
            },
            stream.cu_stream() as *mut c_void,
        )
    };
    check("mla_gather_slots", status)
}
