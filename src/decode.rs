//! Dense paged and sparse (DSA top-k) decode.

use std::ffi::c_void;

use cudarc::driver::{CudaStream, CudaView, SyncOnDrop};

use crate::device::{bind_flag, ErrorFlag};
use crate::error::{check, Result};
use crate::ffi;
use crate::plan::{ordinal, DecodePlan};
use crate::tensor::{bind, BlockTable, BoundQuery, KvCache, Lse, Output, Query, SparseIndices};
use crate::types::Element;
use crate::validate::{self, Buf, CacheDesc, Rows};

/// The arguments dense and sparse decode share, bound to a stream: device addresses,
/// descriptions for validation and the cudarc guards that must outlive the launch.
struct Common<'s> {
    q: BoundQuery<'s>,
    kv: (u64, CacheDesc, SyncOnDrop<'s>),
    out: (u64, Rows, SyncOnDrop<'s>),
    lse: Option<(u64, Rows, SyncOnDrop<'s>)>,
    flag: (u64, Option<Buf>, Option<SyncOnDrop<'s>>),
    workspace: (u64, SyncOnDrop<'s>),
}

impl<'s> Common<'s> {
    fn bind<T>(
        stream: &'s CudaStream,
        plan: &'s DecodePlan,
        q: &'s Query<T>,
        kv_cache: &'s KvCache<T>,
        out: &'s mut Output<T>,
        lse: Option<&'s mut Lse>,
        error_flag: Option<&'s ErrorFlag>,
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

    fn lse(&self) -> (u64, i64, i64) {
        self.lse.as_ref().map_or((0, 0, 0), |(p, r, _)| {
            (*p, r.token_stride as i64, r.head_stride as i64)
        })
    }
}

/// A `mla_dense_params_t` / `mla_sparse_params_t`: the fields both share (same names),
/// filled from the bound [`Common`] arguments, then the call's own fields.
macro_rules! decode_params {
    ($ty:ident, $c:ident, $t:ident, $scale:expr, { $($field:ident: $value:expr),* $(,)? }) => {{
        let (lse_ptr, lse_ts, lse_hs) = $c.lse();
        ffi::$ty {
            q_nope: $c.q.nope.0 as *const c_void,
            q_rope: $c.q.rope.0 as *const c_void,
            q_nope_token_stride: $c.q.nope.1 as i64,
            q_nope_head_stride: $c.q.nope.2 as i64,
            q_rope_token_stride: $c.q.rope.1 as i64,
            q_rope_head_stride: $c.q.rope.2 as i64,
            kv_cache: $c.kv.0 as *const c_void,
            block_stride_bytes: $c.kv.1.block_stride_bytes as i64,
            num_blocks: $c.kv.1.num_blocks as i32,
            block_size: $c.kv.1.block_size as i32,
            out: $c.out.0 as *mut c_void,
            out_token_stride: $c.out.1.token_stride as i64,
            out_head_stride: $c.out.1.head_stride as i64,
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
/// `seq_lens[batch]` are this step's cache rows per request, clamped to
/// `0..=max_blocks_per_seq · block_size`; a negative or too-large length is recorded in
/// `error_flag`. The split of the work is derived from them inside the call. `plan` must be
/// a dense plan; tokens are `batch · q_len` of its shape. Checks every argument before launching; allocates
/// nothing and does not synchronize (graph-capturable).
#[allow(clippy::too_many_arguments)]
pub fn dense_decode<T: Element>(
    stream: &CudaStream,
    plan: &DecodePlan,
    q: &Query<T>,
    kv_cache: &KvCache<T>,
    block_table: &BlockTable,
    seq_lens: &CudaView<i32>,
    out: &mut Output<T>,
    lse: Option<&mut Lse>,
    softmax_scale: f32,
    error_flag: Option<&ErrorFlag>,
) -> Result<()> {
    let c = Common::bind(stream, plan, q, kv_cache, out, lse, error_flag);
    let (bt, table, _g_bt) = block_table.bind(stream);
    let (lens, lens_buf, _g_lens) = bind(seq_lens, stream);
    validate::dense(&validate::DenseCall {
        device: ordinal(stream),
        dtype: T::DTYPE,
        plan: plan.desc(),
        q: c.q.desc,
        kv_cache: c.kv.1,
        block_table: table,
        seq_lens: lens_buf,
        out: c.out.1,
        lse: c.lse.as_ref().map(|l| l.1),
        softmax_scale,
        error_flag: c.flag.1,
    })?;
    let params = decode_params!(mla_dense_params_t, c, T, softmax_scale, {
        block_table: bt as *const i32,
        max_blocks_per_seq: table.max_blocks_per_seq as i32,
        block_table_stride: table.stride as i32,
        seq_lens: lens as *const i32,
    });
    stream.context().bind_to_thread()?;
    // SAFETY: every pointer was checked above to lie on this device with room for the
    // shapes passed (values fit their C types); the guards in `c` keep the buffers borrowed
    // until after the launch.
    let status = unsafe {
        ffi::mla_dense_decode(plan.schedule(), &params, stream.cu_stream() as *mut c_void)
    };
    check("mla_dense_decode", status)
}

/// Sparse (DSA top-k) decode: `out[t, h]` attends over the cache slots listed in
/// `indices[t, ..topk]` (global slot ids, `-1` = none; only the first `topk_len[t]` when
/// `topk_len` is given, clamped to `0..=topk`). A duplicated id counts once per entry.
///
/// `plan` must be a sparse plan; tokens are its `num_tokens`. Checks every argument before
/// launching; allocates nothing and does not synchronize (graph-capturable).
#[allow(clippy::too_many_arguments)]
pub fn sparse_decode<T: Element>(
    stream: &CudaStream,
    plan: &DecodePlan,
    q: &Query<T>,
    kv_cache: &KvCache<T>,
    indices: &SparseIndices,
    topk_len: Option<&CudaView<i32>>,
    out: &mut Output<T>,
    lse: Option<&mut Lse>,
    softmax_scale: f32,
    error_flag: Option<&ErrorFlag>,
) -> Result<()> {
    let c = Common::bind(stream, plan, q, kv_cache, out, lse, error_flag);
    let (ix, ix_desc, _g_ix) = indices.bind(stream);
    let bound_len = topk_len.map(|v| bind(v, stream));
    let topk_lens = bound_len.as_ref().map_or(0, |b| b.0);
    validate::sparse(&validate::SparseCall {
        device: ordinal(stream),
        dtype: T::DTYPE,
        plan: plan.desc(),
        q: c.q.desc,
        kv_cache: c.kv.1,
        indices: ix_desc,
        topk_len: bound_len.as_ref().map(|b| b.1),
        out: c.out.1,
        lse: c.lse.as_ref().map(|l| l.1),
        softmax_scale,
        error_flag: c.flag.1,
    })?;
    let params = decode_params!(mla_sparse_params_t, c, T, softmax_scale, {
        indices: ix as *const i32,
        topk: ix_desc.topk as i32,
        indices_stride: ix_desc.stride as i32,
        topk_len: topk_lens as *const i32,
    });
    stream.context().bind_to_thread()?;
    // SAFETY: as in dense_decode.
    let status = unsafe {
        ffi::mla_sparse_decode(plan.schedule(), &params, stream.cu_stream() as *mut c_void)
    };
    check("mla_sparse_decode", status)
}
