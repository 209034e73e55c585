//! # mla-decode
//!
//! Hand-written CUDA kernels for dense and DSA-sparse **Multi-head Latent Attention (MLA)
//! decode**, built first for sm_120 (RTX PRO 6000 / RTX 50xx Blackwell) and also for sm_90
//! (H100/H200), behind a bindgen C ABI ([`ffi`]) and this thin, cudarc-style safe layer.
//!
//! It exists for a gap: DeepSeek-V3.2 and GLM-5 use MLA with the DSA indexer (top-2048
//! sparse attention), and on sm_120 no engine backend ran that combination (FlashMLA builds
//! only for sm_90/sm_100, FlashInfer MLA wants `qk_nope_head_dim == 128`, vLLM's Triton MLA
//! has no sparse mode). These kernels fill it, for f16 and bf16 caches and the FP8 ones
//! (fp8_ds_mla, per-tensor fp8).
//!
//! The model is weight-absorbed MLA ("MQA mode"): queries and cache rows are 576 wide
//! ([`HEAD_DIM`] = 512 latent + 64 RoPE), one cache row is shared by all heads, and the
//! value is the first 512 dims of the same row. Outputs are `[tokens, heads, 512]` plus an
//! optional natural-log `lse` (`-inf` where no slot is visible).
//!
//! ## Shape of the API
//! cudarc's shape: buffers owned by the caller, the stream explicit, no allocation and no
//! host synchronization in a decode call.
//! - **Buffers**: calls and views take `&buf` for what they read and `&mut buf` for what they
//!   write, where `buf` is a cudarc [`CudaSlice`](cudarc::driver::CudaSlice),
//!   [`CudaView`](cudarc::driver::CudaView) or [`CudaViewMut`](cudarc::driver::CudaViewMut)
//!   ([`DeviceRead`], [`DeviceWrite`]); no `.as_view()` needed. View constructors also take
//!   a cudarc view by value ([`IntoDeviceRead`], [`IntoDeviceWrite`]), so a helper can
//!   return a view over a sub-range it sliced (`Query::strided(buf.slice(off..), ..)`).
//! - **Views** add layouts: [`Query`], [`Output`], [`Lse`] (token and head [`Strides`], in
//!   elements), [`KvCache`] / [`KvCacheMut`] (bytes of any element type in a
//!   [`CacheLayout`]: [`KvFormat`], block size, blocks, block stride), [`BlockTable`],
//!   [`SparseIndices`].
//! - **Argument structs** hold what a call reads ([`DenseArgs`], [`SparseArgs`],
//!   [`AppendArgs`], [`GatherArgs`]): every field has a name, so nothing swaps silently;
//!   outputs, the plan and the flag are separate `&mut` parameters.
//! - **One stream type**: every call and constructor takes `&Arc<CudaStream>`.
//! - A [`DecodePlan`] (the launch schedule and its split workspace) is made once per shape
//!   and cache format, and gives the token count of every decode call made with it
//!   ([`DecodePlan::num_tokens`]); buffers may be longer (preallocated maximum sizes work).
//!   Append and gather take `num_tokens` explicitly, the same way. Each decode call derives
//!   the split of its work from the `seq_lens` / `topk_len` it is given, on the device.
//! - **Written state is `&mut`**: decode calls take `&mut DecodePlan` (they write its
//!   workspace) and `Option<&mut ErrorFlag>`, so one plan or flag cannot serve two calls at
//!   once: use one plan (and one flag) per stream.
//! - **Errors**: every argument is checked on the host first ([`validate`]), and an
//!   [`Error::InvalidArgument`] names a parameter of the call, or a field of its argument
//!   struct. Values only the device sees (block ids, slot ids, lengths) are skipped or
//!   clamped by the kernels and recorded in an optional [`ErrorFlag`], read synchronously
//!   ([`ErrorFlag::check`]), behind an event ([`ErrorFlag::read_async`]) or into a device
//!   buffer ([`ErrorFlag::copy_to`]).
//! - **CUDA graphs**: [`capture_graph`] captures a step (its docs say what to do first:
//!   event tracking off, plans and flags made before).
//! - Built without nvcc, everything compiles and every call returns
//!   [`Error::KernelsNotBuilt`]; [`cuda_available`] says whether CUDA is usable here.
//!
//! ## Example: dense decode of one step (GLM-5, TP8)
//! ```no_run
//! use half::bf16;
//! use mla_decode::cudarc::driver::CudaContext;
//! use mla_decode::*;
//!
//! fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
//!     if !cuda_available() {
//!         return Ok(());
//!     }
//!     let stream = CudaContext::new(0)?.new_stream()?;
//!     let cfg = MlaConfig::glm5().tensor_parallel(8)?; // 8 heads per GPU, scale 1/16
//!     let (batch, block_size, max_blocks) = (4, 64, 32);
//!     let heads = cfg.num_heads;
//!
//!     // Once per shape and cache format.
//!     let shape = DenseShape {
//!         batch,
//!         q_len: 1,
//!         num_heads: heads,
//!         block_size,
//!         max_blocks_per_seq: max_blocks,
//!         kv_format: KvFormat::Bf16,
//!     };
//!     let mut plan = DecodePlan::dense(&stream, shape, PlanOptions::default())?;
//!     let mut flag = ErrorFlag::new(&stream)?;
//!
//!     let num_blocks = batch * max_blocks;
//!     let cache = stream.alloc_zeros::<bf16>(num_blocks * block_size * HEAD_DIM)?;
//!     let table: Vec<i32> = (0..num_blocks as i32).collect();
//!     let table = stream.clone_htod(&table)?;
//!     let seq_lens = stream.clone_htod(&[100i32, 2048, 1, 0])?;
//!     let tokens = plan.num_tokens(); // batch * q_len
//!     let q = stream.alloc_zeros::<bf16>(tokens * heads * HEAD_DIM)?;
//!     let mut out = stream.alloc_zeros::<bf16>(tokens * heads * LATENT_DIM)?;
//!     let mut lse = stream.alloc_zeros::<f32>(tokens * heads)?;
//!
//!     // Once per layer (the split of the work is derived from seq_lens inside the call).
//!     let args = DenseArgs {
//!         q: Query::contiguous(&q, heads),
//!         kv_cache: KvCache::contiguous(&cache, KvFormat::Bf16, block_size)?,
//!         block_table: BlockTable::new(&table, TableShape { batch, max_blocks_per_seq: max_blocks }),
//!         seq_lens: &seq_lens,
//!         softmax_scale: cfg.softmax_scale(),
//!     };
//!     dense_decode(
//!         &stream,
//!         &mut plan,
//!         &args,
//!         &mut Output::contiguous(&mut out, heads),
//!         Some(&mut Lse::contiguous(&mut lse, heads)),
//!         Some(&mut flag),
//!     )?;
//!     flag.check(&stream)?; // synchronizes; Err(DeviceFault) on a bad block id etc.
//!     Ok(())
//! }
//! ```
//! [`sparse_decode`], [`append_kv`], [`append_kv_split`], [`gather_slots`] and
//! [`capture_graph`] have examples of their own.
//!
//! ## Modules
//! - [`ffi`]: the raw C ABI (`csrc/mla_decode.h`), for use from anything that has device
//!   pointers and a `cudaStream_t`;
//! - [`validate`]: the host checks as pure functions, and the argument names each call's
//!   errors may carry;
//! - [`reference`](mod@reference): f64 reference implementations the tests compare against;
//! - everything else is re-exported here: errors, types and constants, [`MlaConfig`],
//!   device helpers, buffers and views, [`DecodePlan`], [`dense_decode`], [`sparse_decode`],
//!   [`append_kv`], [`append_kv_split`], [`gather_slots`], [`capture_graph`].
#![warn(missing_docs)]

pub mod ffi;
pub mod reference;
pub mod validate;

mod buffer;
mod cache_ops;
mod config;
mod decode;
mod device;
mod error;
mod flag;
mod graph;
mod plan;
mod tensor;
mod types;

pub use cudarc;
pub use half;

pub use buffer::{AnyBitPattern, DeviceRead, DeviceWrite, IntoDeviceRead, IntoDeviceWrite};
pub use cache_ops::{
    append_kv, append_kv_split, gather_slots, AppendArgs, AppendSplitArgs, GatherArgs,
};
pub use config::{MlaConfig, Yarn};
pub use decode::{dense_decode, sparse_decode, DenseArgs, SparseArgs};
pub use device::{cuda_available, DeviceInfo, KERNELS_BUILT};
pub use error::{last_c_error, status_to_result, Error, Result};
pub use flag::{ErrorFlag, FaultCode, FlagReading};
pub use graph::capture_graph;
pub use plan::{DecodePlan, DenseShape, PlanKind, PlanOptions, SparseShape, Tuning};
pub use tensor::{
    BlockTable, CacheLayout, KvCache, KvCacheMut, Lse, Output, Query, SparseIndices, Strides,
    TableShape,
};
pub use types::{
    DType, Element, KvFormat, ScaleRule, BLOCK_SIZES, HEAD_DIM, LATENT_DIM, MAX_GATHER_TOKENS,
    MAX_HEADS, MAX_Q_LEN, MAX_TOPK, ROPE_DIM,
};
