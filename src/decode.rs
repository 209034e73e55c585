//! Dense paged and sparse (DSA top-k) decode.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaStream, SyncOnDrop};

use crate::buffer::{self, Bound, DeviceRead};
use crate::error::{check, Result};
use crate::ffi;
use crate::flag::{bind_flag, ErrorFlag};
use crate::plan::{ordinal, DecodePlan};
use crate::tensor::{
    BlockTable, BoundCache, BoundQuery, KvCache, Lse, Output, Query, SparseIndices,
};
use crate::types::Element;
use crate::validate::{self, Buf, Rows};

/// What a dense decode reads (besides the plan): the inputs of [`dense_decode`]. Cheap to
/// clone: build it once per step and change the cache per layer
/// (`DenseArgs { kv_cache: caches[layer].clone(), ..args.clone() }`).
#[derive(Clone, Debug)]
pub struct DenseArgs<'a, T> {
    /// Queries `[batch · q_len, heads, 576]`; token `b · q_len + i` is query row `i` of
    /// request `b`.
    pub q: Query<'a, T>,
    /// The paged cache, in the plan's `kv_format` and `block_size`.
    pub kv_cache: KvCache<'a>,
    /// Block table `[batch, max_blocks_per_seq]` of the plan's shape.
    pub block_table: BlockTable<'a>,
    /// This step's cache rows per request, `[batch]` int32 (a longer buffer is fine),
    /// clamped to `0..=max_blocks_per_seq · block_size`; a bad one is recorded in the flag.
    pub seq_lens: &'a dyn DeviceRead<i32>,
    /// Factor applied to every `q · k` (finite, > 0; [`MlaConfig::softmax_scale`](crate::MlaConfig::softmax_scale)).
    pub softmax_scale: f32,
}

/// What a sparse decode reads (besides the plan): the inputs of [`sparse_decode`].
#[derive(Clone, Debug)]
pub struct SparseArgs<'a, T> {
    /// Queries `[num_tokens, heads, 576]`.
    pub q: Query<'a, T>,
    /// The paged cache the slot ids point into, in the plan's `kv_format`.
    pub kv_cache: KvCache<'a>,
    /// Global slot ids `[num_tokens, topk]` (`-1` = none), `topk` of the plan's shape.
    pub indices: SparseIndices<'a>,
    /// Leading entries of each indices row to use, `[num_tokens]` int32 (a longer buffer is
    /// fine), clamped to `0..=topk` (a clamped one is recorded in the flag as
    /// [`FaultCode::BadTopkLen`](crate::FaultCode::BadTopkLen)); `None`: `topk` each.
    pub topk_len: Option<&'a dyn DeviceRead<i32>>,
    /// Factor applied to every `q · k` (finite, > 0).
    pub softmax_scale: f32,
}

/// The arguments dense and sparse decode share, bound to a stream: device addresses,
/// descriptions for validation and the cudarc guards that must outlive the launch.
struct Common<'s> {
    q: BoundQuery<'s>,
    kv: BoundCache<'s>,
    out: (Rows, Bound<'s>),
    lse: Option<(Rows, Bound<'s>)>,
    flag: (u64, Option<Buf>, Option<SyncOnDrop<'s>>),
    workspace: (u64, SyncOnDrop<'s>),
}

impl<'s> Common<'s> {
    fn bind<T>(
        stream: &'s CudaStream,
        plan: &'s mut DecodePlan,
        q: &'s Query<T>,
        kv_cache: &'s KvCache,
        out: &'s mut Output<'_, T>,
        lse: Option<&'s mut Lse<'_>>,
        error_flag: Option<&'s mut ErrorFlag>,
    ) -> Self {
        Common {
            q: q.bind(stream),
            kv: kv_cache.bind(stream),
            out: out.bind(stream),
            lse: lse.map(|l| l.bind(stream)),
            flag: bind_flag(error_flag, stream),
            workspace: plan.bind(stream),
        }
    }

    fn lse_rows(&self) -> Option<Rows> {
        self.lse.as_ref().map(|l| l.0)
    }

    fn lse(&self) -> (u64, i64, i64) {
        self.lse.as_ref().map_or((0, 0, 0), |(r, b)| {
            (b.addr, r.token_stride as i64, r.head_stride as i64)
        })
    }
}

/// A `mla_dense_params_t` / `mla_sparse_params_t`: the fields both share (same names),
/// filled from the bound [`Common`] arguments, then the call's own fields.
macro_rules! decode_params {
    ($ty:ident, $c:ident, $t:ident, $scale:expr, $heads:expr, { $($field:ident: $value:expr),* $(,)? }) => {{
        let (lse_ptr, lse_ts, lse_hs) = $c.lse();
        ffi::$ty {
            num_heads: $heads as i32,
            q_nope: $c.q.nope.0 as *const c_void,
            q_rope: $c.q.rope.0 as *const c_void,
            q_nope_token_stride: $c.q.nope.1.token as i64,
            q_nope_head_stride: $c.q.nope.1.head as i64,
            q_rope_token_stride: $c.q.rope.1.token as i64,
            q_rope_head_stride: $c.q.rope.1.head as i64,
            kv_cache: $c.kv.addr as *const c_void,
            kv_format: $c.kv.desc.format.to_ffi(),
            kv_scale: $c.kv.scale_addr as *const f32,
            block_stride_bytes: $c.kv.desc.block_stride_bytes as i64,
            num_blocks: $c.kv.desc.num_blocks as i32,
            block_size: $c.kv.desc.block_size as i32,
            out: $c.out.1.addr as *mut c_void,
            out_token_stride: $c.out.0.token_stride as i64,
            out_head_stride: $c.out.0.head_stride as i64,
            lse: lse_ptr as *mut f32,
            lse_token_stride: lse_ts,
            lse_head_stride: lse_hs,
            softmax_scale: $scale,
            dtype: $t::DTYPE.to_ffi(),
            workspace: $c.workspace.0 as *mut f32,
            error_flag: $c.flag.0 as *mut u32,
            $($field: $value,)*
        }
    }};
}

/// Dense paged decode: `out[t, h] = softmax(scale · q[t, h] · kv[s]) · kv[s, ..512]` over the
/// slots of request `t / q_len` visible to query `t % q_len` (causal), optionally `lse[t, h]`.
///
/// The token count is the plan's (`batch · q_len`, [`DecodePlan::num_tokens`]); every
/// buffer only has to be long enough for it, so preallocated maximum-size buffers work.
/// `plan` must be a dense plan made for this cache format; it is taken as `&mut` because the
/// call writes its workspace (one plan per stream). The split of the work is derived from
/// `seq_lens` inside the call.
///
/// Checks every argument before launching (an error names a parameter or a field of
/// [`DenseArgs`]); allocates nothing and does not synchronize (graph-capturable).
///
/// ```no_run
/// # use half::bf16;
/// # use mla_decode::cudarc::driver::CudaContext;
/// # use mla_decode::*;
/// # fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
/// # let stream = CudaContext::new(0)?.new_stream()?;
/// # let (batch, heads, block_size, max_blocks) = (4, 8, 64, 32);
/// let shape = DenseShape {
///     batch, q_len: 1, num_heads: heads, block_size, max_blocks_per_seq: max_blocks,
///     kv_format: KvFormat::Bf16,
/// };
/// let mut plan = DecodePlan::dense(&stream, shape, PlanOptions::default())?;
/// let cache = stream.alloc_zeros::<bf16>(batch * max_blocks * block_size * HEAD_DIM)?;
/// let table = stream.clone_htod(&(0..(batch * max_blocks) as i32).collect::<Vec<_>>())?;
/// let seq_lens = stream.clone_htod(&[100i32, 2048, 1, 0])?;
/// let q = stream.alloc_zeros::<bf16>(plan.num_tokens() * heads * HEAD_DIM)?;
/// let mut out = stream.alloc_zeros::<bf16>(plan.num_tokens() * heads * LATENT_DIM)?;
/// let mut lse = stream.alloc_zeros::<f32>(plan.num_tokens() * heads)?;
/// let mut flag = ErrorFlag::new(&stream)?;
///
/// let args = DenseArgs {
///     q: Query::contiguous(&q, heads),
///     kv_cache: KvCache::contiguous(&cache, KvFormat::Bf16, block_size)?,
///     block_table: BlockTable::new(&table, TableShape { batch, max_blocks_per_seq: max_blocks }),
///     seq_lens: &seq_lens,
///     softmax_scale: 1.0 / 16.0,
/// };
/// dense_decode(
///     &stream,
///     &mut plan,
///     &args,
///     &mut Output::contiguous(&mut out, heads),
///     Some(&mut Lse::contiguous(&mut lse, heads)),
///     Some(&mut flag),
/// )?;
/// flag.check(&stream)?;
/// # Ok(())
/// # }
/// ```
pub fn dense_decode<T: Element>(
    stream: &Arc<CudaStream>,
    plan: &mut DecodePlan,
    args: &DenseArgs<T>,
    out: &mut Output<T>,
    lse: Option<&mut Lse>,
    error_flag: Option<&mut ErrorFlag>,
) -> Result<()> {
    let (plan_desc, schedule) = (plan.desc(), *plan.schedule());
    let c = Common::bind(stream, plan, &args.q, &args.kv_cache, out, lse, error_flag);
    let (table, bt) = args.block_table.bind(stream);
    let lens_view = buffer::view_of(args.seq_lens);
    let lens = buffer::read(&lens_view, stream);
    validate::dense(&validate::DenseCall {
        device: ordinal(stream),
        dtype: T::DTYPE,
        plan: plan_desc,
        q: c.q.desc,
        kv_cache: c.kv.desc,
        block_table: table,
        seq_lens: lens.buf,
        out: c.out.0,
        lse: c.lse_rows(),
        softmax_scale: args.softmax_scale,
        error_flag: c.flag.1,
    })?;
    let params = decode_params!(mla_dense_params_t, c, T, args.softmax_scale, plan_desc.kind.num_heads(), {
        batch: table.batch as i32,
        q_len: plan_desc.kind.q_len() as i32,
        block_table: bt.addr as *const i32,
        max_blocks_per_seq: table.max_blocks_per_seq as i32,
        block_table_stride: table.stride as i64,
        seq_lens: lens.addr as *const i32,
    });
    stream.context().bind_to_thread()?;
    // SAFETY: every pointer was checked above to lie on this device with room for the
    // shapes passed (values fit their C types); the guards in `c`, `bt` and `lens` keep the
    // buffers borrowed until after the launch.
    let status =
        unsafe { ffi::mla_dense_decode(&schedule, &params, stream.cu_stream() as *mut c_void) };
    check("mla_dense_decode", status)
}

/// Sparse (DSA top-k) decode: `out[t, h]` attends over the cache slots listed in
/// `indices[t, ..topk]` (global slot ids, `-1` = none; only the first `topk_len[t]` when
/// `topk_len` is given, clamped to `0..=topk`). A duplicated id counts once per entry.
///
/// The token count is the plan's `num_tokens` ([`DecodePlan::num_tokens`]); buffers may be
/// longer. `plan` must be a sparse plan made for this cache format (`&mut`: the call writes
/// its workspace). Checks every argument before launching (an error names a parameter or a
/// field of [`SparseArgs`]); allocates nothing and does not synchronize (graph-capturable).
///
/// ```no_run
/// # use half::bf16;
/// # use mla_decode::cudarc::driver::CudaContext;
/// # use mla_decode::*;
/// # fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
/// # let stream = CudaContext::new(0)?.new_stream()?;
/// let cfg = MlaConfig::glm5().tensor_parallel(8)?; // 8 heads per GPU, scale 1/16
/// let (t, heads, topk, block_size) = (4, cfg.num_heads, 2048, 64);
/// let shape = SparseShape { num_tokens: t, num_heads: heads, topk, kv_format: KvFormat::Bf16 };
/// let mut plan = DecodePlan::sparse(&stream, shape, PlanOptions::default())?;
/// let cache = stream.alloc_zeros::<bf16>(1024 * block_size * HEAD_DIM)?; // 1024 blocks
/// let indices = stream.alloc_zeros::<i32>(t * topk)?; // written by the indexer
/// let topk_len = stream.clone_htod(&[2048i32, 2048, 17, 0])?;
/// let q = stream.alloc_zeros::<bf16>(t * heads * HEAD_DIM)?;
/// let mut out = stream.alloc_zeros::<bf16>(t * heads * LATENT_DIM)?;
/// let mut flag = ErrorFlag::new(&stream)?;
///
/// let args = SparseArgs {
///     q: Query::contiguous(&q, heads),
///     kv_cache: KvCache::contiguous(&cache, KvFormat::Bf16, block_size)?,
///     indices: SparseIndices::contiguous(&indices, topk),
///     topk_len: Some(&topk_len),
///     softmax_scale: cfg.softmax_scale(),
/// };
/// sparse_decode(&stream, &mut plan, &args, &mut Output::contiguous(&mut out, heads), None, Some(&mut flag))?;
/// flag.check(&stream)?;
/// # Ok(())
/// # }
/// ```
pub fn sparse_decode<T: Element>(
    stream: &Arc<CudaStream>,
    plan: &mut DecodePlan,
    args: &SparseArgs<T>,
    out: &mut Output<T>,
    lse: Option<&mut Lse>,
    error_flag: Option<&mut ErrorFlag>,
) -> Result<()> {
    let (plan_desc, schedule) = (plan.desc(), *plan.schedule());
    let c = Common::bind(stream, plan, &args.q, &args.kv_cache, out, lse, error_flag);
    let (ix_desc, ix) = args.indices.bind(stream);
    let topk_len_view = buffer::view_of_opt(args.topk_len);
    let topk_len = buffer::read_opt(&topk_len_view, stream);
    validate::sparse(&validate::SparseCall {
        device: ordinal(stream),
        dtype: T::DTYPE,
        plan: plan_desc,
        q: c.q.desc,
        kv_cache: c.kv.desc,
        indices: ix_desc,
        topk_len: topk_len.as_ref().map(|b| b.buf),
        out: c.out.0,
        lse: c.lse_rows(),
        softmax_scale: args.softmax_scale,
        error_flag: c.flag.1,
    })?;
    let params = decode_params!(mla_sparse_params_t, c, T, args.softmax_scale, plan_desc.kind.num_heads(), {
        num_tokens: plan_desc.kind.num_tokens() as i32,
        indices: ix.addr as *const i32,
        topk: ix_desc.topk as i32,
        indices_stride: ix_desc.stride as i64,
        topk_len: buffer::addr_of(&topk_len) as *const i32,
    });
    stream.context().bind_to_thread()?;
    // SAFETY: as in dense_decode.
    let status =
        unsafe { ffi::mla_sparse_decode(&schedule, &params, stream.cu_stream() as *mut c_void) };
    check("mla_sparse_decode", status)
}
