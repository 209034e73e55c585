//! The device side: every buffer the step touches, allocated once at its largest, the
//! prefill, the per-step uploads, and the step itself (what the CUDA graph captures).

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::half::bf16;
use mla_decode::*;

use crate::batch::{fill_values, q_key, row_key, Batch, BLOCK_SIZE, TOPK};

/// Query sets rotated through by the steps (the model would compute a new query every step;
/// copying one of a few sets from device memory keeps the host out of the way).
pub const Q_SETS: usize = 4;
/// The per-tensor scale of an [`KvFormat::Fp8PerTensor`] cache: values in [-1, 1) land
/// within e4m3's ±448.
pub const FP8_TENSOR_SCALE: f32 = 1.0 / 256.0;
/// How an [`KvFormat::Fp8DsMla`] cache picks its per-tile scales (vLLM's rule).
pub const FP8_SCALE_RULE: ScaleRule = ScaleRule::Raw;

/// The model slice and batch the engine is built for.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Layers (each with its own cache).
    pub layers: usize,
    /// Batch rows: one decode token each.
    pub requests: usize,
    /// Query heads on this GPU.
    pub heads: usize,
    /// Block-table columns.
    pub max_blocks: usize,
    /// Blocks per layer cache.
    pub num_blocks: usize,
    /// Longest prompt (sizes the prefill staging buffers).
    pub max_prompt: usize,
    /// The cache format.
    pub format: KvFormat,
    /// Also a dense decode per layer.
    pub dense: bool,
    /// The softmax scale.
    pub scale: f32,
    /// Seed of the made-up activations.
    pub seed: u64,
}

/// Every device buffer of the step; views of one layer are slices of these.
pub struct Engine {
    /// The one stream everything runs on.
    pub stream: Arc<CudaStream>,
    /// What it was built for.
    pub shape: Shape,
    /// The layout every layer's cache has.
    pub layout: CacheLayout,
    /// One paged cache per layer (bytes: the format decides what a row is).
    pub caches: Vec<CudaSlice<u8>>,
    /// The per-tensor fp8 scale (that format only).
    pub kv_scale: Option<CudaSlice<f32>>,
    /// `[requests, max_blocks]`, shared by every layer.
    pub table: CudaSlice<i32>,
    /// `[requests]`.
    pub seq_lens: CudaSlice<i32>,
    /// `[requests]` int64.
    pub slot_mapping: CudaSlice<i64>,
    /// `[requests]`.
    pub topk_len: CudaSlice<i32>,
    /// `[requests]`: token t belongs to batch row t (one decode token per request).
    pub req_id: CudaSlice<i32>,
    /// `[layers, requests, TOPK]`: the indexer's positions.
    pub positions: CudaSlice<i32>,
    /// `[layers, requests, TOPK]`: the gathered slot ids the sparse decode reads.
    pub indices: CudaSlice<i32>,
    /// `[layers, requests, 576]`: the new token's row of every layer.
    pub kv_new: CudaSlice<bf16>,
    /// `[layers, requests, heads, 576]`: this step's queries.
    pub q: CudaSlice<bf16>,
    /// [`Q_SETS`] query sets, each laid out as `q`.
    pub q_pool: CudaSlice<bf16>,
    /// `[layers, requests, heads, 512]` and `[layers, requests, heads]`: sparse results.
    pub out_sparse: CudaSlice<bf16>,
    /// See `out_sparse`.
    pub lse_sparse: CudaSlice<f32>,
    /// Dense results, as the sparse ones (`--dense` only).
    pub out_dense: Option<CudaSlice<bf16>>,
    /// See `out_dense`.
    pub lse_dense: Option<CudaSlice<f32>>,
    /// The sparse decode's plan, used by every layer in turn.
    pub sparse_plan: DecodePlan,
    /// The dense decode's plan (`--dense` only).
    pub dense_plan: Option<DecodePlan>,
    /// Reset at the start of every step; any bad value a kernel meets lands here.
    pub flag: ErrorFlag,
    /// The prefills' flag (the step's own is reset by every replay), never reset.
    pub prefill_flag: ErrorFlag,
    /// Prefill staging: a prompt's rows and their slots.
    stage_kv: CudaSlice<bf16>,
    stage_slots: CudaSlice<i64>,
    /// Host scratch of the uploads.
    host_rows: Vec<bf16>,
    host_slots: Vec<i64>,
}

impl Engine {
    /// Allocates everything (once: nothing is allocated per step) and makes the plans. The
    /// context's event tracking must already be off (see `main`).
    pub fn new(stream: &Arc<CudaStream>, shape: Shape) -> Result<Engine> {
        let s = shape;
        let (l, n, h) = (s.layers, s.requests, s.heads);
        let layout = CacheLayout {
            format: s.format,
            block_size: BLOCK_SIZE,
            num_blocks: s.num_blocks,
            block_stride_bytes: BLOCK_SIZE * s.format.row_bytes(),
        };
        let cache_bytes = s.num_blocks * layout.block_stride_bytes;
        let caches = (0..l)
            .map(|_| stream.alloc_zeros::<u8>(cache_bytes))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let kv_scale = match s.format {
            KvFormat::Fp8PerTensor => Some(stream.clone_htod(&[FP8_TENSOR_SCALE])?),
            _ => None,
        };
        let sparse_plan = DecodePlan::sparse(
            stream,
            SparseShape {
                num_tokens: n,
                num_heads: h,
                topk: TOPK,
                kv_format: s.format,
            },
            PlanOptions::default(),
        )?;
        let dense_plan = s
            .dense
            .then(|| {
                let shape = DenseShape {
                    batch: n,
                    q_len: 1,
                    num_heads: h,
                    block_size: BLOCK_SIZE,
                    max_blocks_per_seq: s.max_blocks,
                    kv_format: s.format,
                };
                DecodePlan::dense(stream, shape, PlanOptions::default())
            })
            .transpose()?;
        let req_id: Vec<i32> = (0..n as i32).collect();
        let q_len = l * n * h * HEAD_DIM;
        let mut engine = Engine {
            stream: stream.clone(),
            shape,
            layout,
            caches,
            kv_scale,
            table: stream.alloc_zeros(n * s.max_blocks)?,
            seq_lens: stream.alloc_zeros(n)?,
            slot_mapping: stream.alloc_zeros(n)?,
            topk_len: stream.alloc_zeros(n)?,
            req_id: stream.clone_htod(&req_id)?,
            positions: stream.alloc_zeros(l * n * TOPK)?,
            indices: stream.alloc_zeros(l * n * TOPK)?,
            kv_new: stream.alloc_zeros(l * n * HEAD_DIM)?,
            q: stream.alloc_zeros(q_len)?,
            q_pool: stream.alloc_zeros(Q_SETS * q_len)?,
            out_sparse: stream.alloc_zeros(l * n * h * LATENT_DIM)?,
            lse_sparse: stream.alloc_zeros(l * n * h)?,
            out_dense: s
                .dense
                .then(|| stream.alloc_zeros(l * n * h * LATENT_DIM))
                .transpose()?,
            lse_dense: s.dense.then(|| stream.alloc_zeros(l * n * h)).transpose()?,
            sparse_plan,
            dense_plan,
            flag: ErrorFlag::new(stream)?,
            prefill_flag: ErrorFlag::new(stream)?,
            stage_kv: stream.alloc_zeros(s.max_prompt * HEAD_DIM)?,
            stage_slots: stream.alloc_zeros(s.max_prompt)?,
            host_rows: Vec::new(),
            host_slots: Vec::new(),
        };
        engine.fill_q_pool()?;
        Ok(engine)
    }

    /// Makes the [`Q_SETS`] query sets (values from [`q_key`]) and uploads them.
    fn fill_q_pool(&mut self) -> Result<()> {
        let s = self.shape;
        let mut host = vec![bf16::ZERO; Q_SETS * s.layers * s.requests * s.heads * HEAD_DIM];
        for (i, row) in host.chunks_exact_mut(HEAD_DIM).enumerate() {
            let head = i % s.heads;
            let token = (i / s.heads) % s.requests;
            let layer = (i / (s.heads * s.requests)) % s.layers;
            let set = i / (s.heads * s.requests * s.layers);
            fill_values(q_key(s.seed, set, layer, token, head), row);
        }
        self.stream.memcpy_htod(&host, &mut self.q_pool)?;
        Ok(())
    }

    /// Prefills the prompt of the request in batch row `row`: its rows (positions
    /// `0..prompt`) written into every layer's cache by `append_kv` through its slots, as the
    /// prefill's attention layers would. Runs on the stream, outside the graph.
    pub fn prefill(&mut self, batch: &Batch, row: usize) -> Result<()> {
        let req = &batch.requests[row];
        let (len, uid, seed) = (req.prompt, req.uid, self.shape.seed);
        self.host_slots.clear();
        self.host_slots.extend((0..len).map(|p| batch.slot(row, p)));
        self.stream
            .memcpy_htod(&self.host_slots, &mut self.stage_slots)?;
        self.host_rows.resize(len * HEAD_DIM, bf16::ZERO);
        for layer in 0..self.shape.layers {
            for (pos, r) in self.host_rows.chunks_exact_mut(HEAD_DIM).enumerate() {
                fill_values(row_key(seed, layer, uid, pos), r);
            }
            // Stream-ordered: the previous layer's append has read the staging buffer.
            self.stream
                .memcpy_htod(&self.host_rows, &mut self.stage_kv)?;
            let args = AppendArgs {
                kv: &self.stage_kv,
                kv_token_stride: HEAD_DIM,
                slot_mapping: &self.stage_slots,
                num_tokens: len,
                scale_rule: self.scale_rule(),
            };
            let mut cache = cache_mut(&mut self.caches[layer], self.layout, self.kv_scale.as_ref());
            append_kv(
                &self.stream,
                &args,
                &mut cache,
                Some(&mut self.prefill_flag),
            )?;
        }
        Ok(())
    }

    /// The scale rule append needs for this cache format.
    fn scale_rule(&self) -> Option<ScaleRule> {
        (self.shape.format == KvFormat::Fp8DsMla).then_some(FP8_SCALE_RULE)
    }

    /// Writes step `step`'s inputs into the captured buffers, in stream order (after the
    /// previous replay, before the next): block table, lengths, slot mapping, topk_len,
    /// the indexer's positions, the new tokens' rows and the queries.
    ///
    /// The copies are from pageable host memory, which keeps this short; an engine stages
    /// them through pinned buffers (double-buffered) so that they do not wait for the
    /// previous step.
    pub fn upload_step(&mut self, batch: &Batch, step: usize) -> Result<()> {
        let st = &self.stream;
        st.memcpy_htod(&batch.table, &mut self.table)?;
        st.memcpy_htod(&batch.seq_lens, &mut self.seq_lens)?;
        st.memcpy_htod(&batch.slot_mapping, &mut self.slot_mapping)?;
        st.memcpy_htod(&batch.topk_len, &mut self.topk_len)?;
        st.memcpy_htod(&batch.positions, &mut self.positions)?;
        let (l, n) = (self.shape.layers, batch.len());
        self.host_rows.resize(l * n * HEAD_DIM, bf16::ZERO);
        for (i, r) in self.host_rows.chunks_exact_mut(HEAD_DIM).enumerate() {
            let (layer, row) = (i / n, i % n);
            let req = &batch.requests[row];
            fill_values(row_key(self.shape.seed, layer, req.uid, req.len - 1), r);
        }
        st.memcpy_htod(&self.host_rows, &mut self.kv_new)?;
        let set = self.q.len();
        let src = self
            .q_pool
            .slice(query_set(step) * set..(query_set(step) + 1) * set);
        st.memcpy_dtod(&src, &mut self.q)?;
        Ok(())
    }

    /// Enqueues one decode step on the stream: the flag reset, then for every layer append,
    /// gather, sparse decode (and dense decode). Called once directly (the warm-up: every
    /// kernel's first launch outside a capture) and once inside `capture_graph`.
    pub fn enqueue_step(&mut self) -> Result<()> {
        let Shape {
            layers,
            requests: n,
            heads: h,
            max_blocks,
            scale,
            ..
        } = self.shape;
        let stream = &self.stream;
        let scale_rule = self.scale_rule();
        self.flag.reset(stream)?;
        for l in 0..layers {
            // 1. The new token's row into this layer's cache, from its latent and RoPE parts
            // as an engine holds them (here views into one [n, 576] projection output, as
            // vLLM's kv_c and k_pe are): no concatenated copy.
            let kv_new = self.kv_new.slice(l * n * HEAD_DIM..(l + 1) * n * HEAD_DIM);
            let k_pe = kv_new.slice(LATENT_DIM..);
            let append = AppendSplitArgs {
                kv_nope: &kv_new,
                kv_nope_token_stride: HEAD_DIM,
                kv_rope: &k_pe,
                kv_rope_token_stride: HEAD_DIM,
                slot_mapping: &self.slot_mapping,
                num_tokens: n,
                scale_rule,
            };
            let mut cache = cache_mut(&mut self.caches[l], self.layout, self.kv_scale.as_ref());
            append_kv_split(stream, &append, &mut cache, Some(&mut self.flag))?;

            // 2. The indexer's positions -> slot ids of this layer's cache.
            let cache = cache_view(&self.caches[l], self.layout, self.kv_scale.as_ref());
            let table = BlockTable::new(
                &self.table,
                TableShape {
                    batch: n,
                    max_blocks_per_seq: max_blocks,
                },
            );
            let rows = l * n * TOPK..(l + 1) * n * TOPK;
            let positions = self.positions.slice(rows.clone());
            let gather = GatherArgs {
                positions: &positions,
                positions_stride: TOPK,
                req_id: &self.req_id,
                block_table: table.clone(),
                seq_lens: &self.seq_lens,
                kv_cache: cache.clone(),
                topk: TOPK,
                num_tokens: n,
                out_stride: TOPK,
            };
            let mut indices = self.indices.slice_mut(rows.clone());
            gather_slots(stream, &gather, &mut indices, Some(&mut self.flag))?;

            // 3. Sparse decode over the gathered slots.
            let q = self
                .q
                .slice(l * n * h * HEAD_DIM..(l + 1) * n * h * HEAD_DIM);
            let (outs, lses) = (
                l * n * h * LATENT_DIM..(l + 1) * n * h * LATENT_DIM,
                l * n * h..(l + 1) * n * h,
            );
            let sparse = SparseArgs {
                q: Query::contiguous(&q, h),
                kv_cache: cache.clone(),
                indices: SparseIndices::contiguous(self.indices.slice(rows), TOPK),
                topk_len: Some(&self.topk_len),
                softmax_scale: scale,
            };
            sparse_decode(
                stream,
                &mut self.sparse_plan,
                &sparse,
                &mut Output::contiguous(self.out_sparse.slice_mut(outs.clone()), h),
                Some(&mut Lse::contiguous(
                    self.lse_sparse.slice_mut(lses.clone()),
                    h,
                )),
                Some(&mut self.flag),
            )?;

            // 4. Dense decode over every cached position (--dense).
            if let (Some(plan), Some(out), Some(lse)) = (
                &mut self.dense_plan,
                &mut self.out_dense,
                &mut self.lse_dense,
            ) {
                let dense = DenseArgs {
                    q: Query::contiguous(&q, h),
                    kv_cache: cache,
                    block_table: table,
                    seq_lens: &self.seq_lens,
                    softmax_scale: scale,
                };
                dense_decode(
                    stream,
                    plan,
                    &dense,
                    &mut Output::contiguous(out.slice_mut(outs), h),
                    Some(&mut Lse::contiguous(lse.slice_mut(lses), h)),
                    Some(&mut self.flag),
                )?;
            }
        }
        Ok(())
    }

    /// The bytes of global slot `slot` of layer `layer`'s cache (synchronizes).
    pub fn read_row(&self, layer: usize, slot: usize) -> Result<Vec<u8>> {
        let rb = self.shape.format.row_bytes();
        let at = (slot / BLOCK_SIZE) * self.layout.block_stride_bytes + (slot % BLOCK_SIZE) * rb;
        Ok(self
            .stream
            .clone_dtoh(&self.caches[layer].slice(at..at + rb))?)
    }
}

/// Which query set step `step` uses.
pub fn query_set(step: usize) -> usize {
    step % Q_SETS
}

/// A cache view over `bytes` in `layout`, with the per-tensor scale when there is one.
fn cache_view<'a>(
    bytes: &'a CudaSlice<u8>,
    layout: CacheLayout,
    scale: Option<&'a CudaSlice<f32>>,
) -> KvCache<'a> {
    let cache = KvCache::new(bytes, layout);
    match scale {
        Some(s) => cache.with_scale(s),
        None => cache,
    }
}

/// The writable view `append_kv` takes.
fn cache_mut<'a>(
    bytes: &'a mut CudaSlice<u8>,
    layout: CacheLayout,
    scale: Option<&'a CudaSlice<f32>>,
) -> KvCacheMut<'a> {
    let cache = KvCacheMut::new(bytes, layout);
    match scale {
        Some(s) => cache.with_scale(s),
        None => cache,
    }
}
