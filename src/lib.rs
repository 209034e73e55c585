//! # mla-decode
//!
//! Hand-written CUDA kernels for dense and DSA-sparse **Multi-head Latent Attention (MLA)
//! decode**, built first for sm_120 (RTX PRO 6000 / RTX 50xx Blackwell) and also for sm_90
//! (H100/H200), behind a bindgen C ABI ([`ffi`]) and this thin, cudarc-style safe layer.
//!
//! It exists for a gap: DeepSeek-V3.2 and GLM-5 use MLA with the DSA indexer (top-2048
//! sparse attention), and on sm_120 no engine backend ran that combination (FlashMLA builds
//! only for sm_90/sm_100, FlashInfer MLA wants `qk_nope_head_dim == 128`, vLLM's Triton MLA
//! has no sparse mode). These kernels fill it, for f16 and bf16 caches.
//!
//! The model is weight-absorbed MLA ("MQA mode"): queries and cache rows are 576 wide
//! ([`HEAD_DIM`] = 512 latent + 64 RoPE), one cache row is shared by all heads, and the
//! value is the first 512 dims of the same row. Outputs are `[tokens, heads, 512]` plus an
//! optional natural-log `lse` (`-inf` where no slot is visible).
//!
//! ## Shape of the API
//! - buffers are cudarc [`CudaSlice`](cudarc::driver::CudaSlice)s owned by the caller;
//!   calls take views of them ([`Query`], [`KvCache`], [`BlockTable`], [`SparseIndices`],
//!   [`Output`], [`Lse`]) with strides in elements, and the stream explicitly;
//! - a [`DecodePlan`] (the launch schedule and the split workspace) is made once per shape
//!   and used by every call; each decode call derives the split of its work from the
//!   seq_lens / topk_len it is given, on the device; decodes allocate nothing and never
//!   synchronize the host, so a step can be captured in a CUDA graph;
//! - every argument is checked on the host first ([`validate`]), and errors name it
//!   ([`Error::InvalidArgument`]); values only the device sees (bad block ids, slot ids,
//!   lengths) are skipped or clamped by the kernels and recorded in an optional
//!   [`ErrorFlag`];
//! - built without nvcc, everything compiles and every call returns
//!   [`Error::KernelsNotBuilt`]; [`cuda_available`] says whether libcuda can be loaded.
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
//!     let num_blocks = batch * max_blocks;
//!     let cache = stream.alloc_zeros::<bf16>(num_blocks * block_size * HEAD_DIM)?;
//!     let table: Vec<i32> = (0..num_blocks as i32).collect();
//!     let table = stream.clone_htod(&table)?;
//!     let seq_lens = stream.clone_htod(&[100i32, 2048, 1, 0])?;
//!     let q = stream.alloc_zeros::<bf16>(batch * heads * HEAD_DIM)?;
//!     let mut out = stream.alloc_zeros::<bf16>(batch * heads * LATENT_DIM)?;
//!     let mut lse = stream.alloc_zeros::<f32>(batch * heads)?;
//!     let flag = ErrorFlag::new(&stream)?;
//!
//!     // Once per shape.
//!     let shape = DenseShape { batch, q_len: 1, num_heads: heads, block_size, max_blocks_per_seq: max_blocks };
//!     let plan = DecodePlan::dense(&stream, shape, PlanOptions::default())?;
//!     // Once per layer (the split of the work is derived from seq_lens inside the call).
//!     dense_decode(
//!         &stream,
//!         &plan,
//!         &Query::contiguous(q.as_view(), heads),
//!         &KvCache::contiguous(cache.as_view(), block_size),
//!         &BlockTable::new(table.as_view(), batch, max_blocks),
//!         &seq_lens.as_view(),
//!         &mut Output::contiguous(out.as_view_mut(), heads),
//!         Some(&mut Lse::contiguous(lse.as_view_mut(), heads)),
//!         cfg.softmax_scale(),
//!         Some(&flag),
//!     )?;
//!     flag.check(&stream)?; // synchronizes; Err(DeviceFault) on a bad block id etc.
//!     Ok(())
//! }
//! ```
//!
//! ## Modules
//! - [`ffi`]: the raw C ABI (`csrc/mla_decode.h`), for use from anything that has device
//!   pointers and a `cudaStream_t`;
//! - [`validate`]: the host checks as pure functions;
//! - [`reference`](mod@reference): f64 reference implementations the tests compare against;
//! - everything else is re-exported here: errors, types and constants, [`MlaConfig`],
//!   device helpers, views, [`DecodePlan`], [`dense_decode`], [`sparse_decode`],
//!   [`append_kv`], [`gather_slots`].
#![warn(missing_docs)]

pub mod ffi;
pub mod reference;
pub mod validate;

mod cache_ops;
mod config;
mod decode;
mod device;
mod error;
mod plan;
mod tensor;
mod types;

pub use cudarc;
pub use half;

pub use cache_ops::{append_kv, gather_slots};
pub use config::{MlaConfig, Yarn};
pub use decode::{dense_decode, sparse_decode};
pub use device::{cuda_available, DeviceInfo, ErrorFlag, FaultCode};
pub use error::{status_to_result, Error, Result};
pub use plan::{DecodePlan, DenseShape, PlanKind, PlanOptions, SparseShape, Tuning};
pub use tensor::{BlockTable, KvCache, KvCacheMut, Lse, Output, Query, SparseIndices};
pub use types::{
    DType, Element, KvFormat, BLOCK_SIZES, HEAD_DIM, LATENT_DIM, MAX_HEADS, MAX_Q_LEN, MAX_TOPK,
    ROPE_DIM,
};
