//! The workloads: random inputs on the device, one timed step, and the check.
//!
//! - dense: one `dense_decode` (decode + combine; the split is derived from seq_lens inside
//!   the call) per step;
//! - sparse: one `sparse_decode` (no topk_len: every row has topk entries) per step;
//! - gather: `gather_slots` alone.
//!
//! Inputs are random, never zeros. A cache is filled by uploading one random chunk of
//! [`CHUNK_ROWS`] rows and replicating it on the device, so that even the 1.2 GB caches are
//! ready in milliseconds: global slot `s` holds chunk row `s % CHUNK_ROWS`, which is also
//! how the reference sees the cache (without a copy of it). Dense block tables are a random
//! permutation of the blocks; sparse slot ids are drawn uniformly without repeats per token.
//!
//! For `--flush rotate` a dense or sparse case holds identical copies of its cache
//! ([`Workload::set_copies`]) and each run reads the one [`Workload::select_copy`] picked;
//! q, tables and indices are not copied (they are small next to the cache rows read).

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::half::{bf16, f16};
use mla_decode::reference::{self, DenseProblem, GatherProblem, PagedCache, SparseProblem};
use mla_decode::{
    dense_decode, ffi, gather_slots, sparse_decode, BlockTable, DType, DecodePlan, DenseShape,
    Element, ErrorFlag, KvCache, Lse, MlaConfig, Output, PlanOptions, Query, SparseIndices,
    SparseShape, HEAD_DIM, LATENT_DIM,
};

use super::check::{self, Accuracy, RefRow};
use super::rng::Rng;
use super::spec::{CaseSpec, DenseSpec, GatherSpec, SparseSpec};
use super::Res;

/// Bytes of one f16/bf16 cache row.
pub const ROW_BYTES: f64 = 1152.0;
/// FLOP per (query row, head, cache row): 2·576 for q·k plus 2·512 for p·v.
pub const FLOP_PER_ROW: f64 = 2.0 * (576.0 + 512.0);
/// Rows of the random chunk a cache is tiled with: 114 blocks of 128 rows (16.8 MB), a
/// multiple of every block size.
pub const CHUNK_ROWS: usize = 14_592;
/// Seed of the bench's inputs (the profile runner uses it too, to see the same inputs).
pub const BENCH_SEED: u64 = 0x6d6c_615f_6465_636f;
/// Element bytes of q and out.
const ELEM_BYTES: f64 = 2.0;

/// The softmax scale of the bench cases: GLM-5's 1/16.
pub fn bench_softmax_scale() -> f32 {
    MlaConfig::glm5().softmax_scale()
}

/// What a result row says about its case.
#[derive(Clone, Debug)]
pub struct Meta {
    pub name: String,
    /// `"dense"`, `"sparse"` or `"gather"`.
    pub kind: &'static str,
    /// None for the gather.
    pub dtype: Option<DType>,
    /// Requests (dense) or query tokens (sparse, gather).
    pub batch: usize,
    pub q_len: usize,
    pub heads: usize,
    /// Longest sequence (dense, gather); 0 for sparse.
    pub seq_len: usize,
    /// Indices per token (sparse, gather); 0 for dense.
    pub topk: usize,
    pub block_size: usize,
    /// Bytes the step must move: cache rows read × 1152 + q + out (+ indices).
    pub bytes: f64,
    /// FLOP of the step: 2·1088 per (query row, head, cache row).
    pub flop: f64,
    /// KV cache copies the timed runs rotated over (`--flush rotate`; 1: the cache alone,
    /// no flush); None: L2 flushed by a memset before each run instead.
    pub copies: Option<usize>,
}

/// Bytes of a case's KV cache.
#[derive(Clone, Copy, Debug)]
pub struct CacheBytes {
    /// One copy of the cache.
    pub size: usize,
    /// The distinct cache rows one step reads.
    pub read: usize,
}

/// One benchmark case with its device buffers.
pub trait Workload {
    fn meta(&self) -> &Meta;
    /// (Re)makes the decode plan for `options` (the gather has none).
    fn set_options(&mut self, stream: &Arc<CudaStream>, options: PlanOptions) -> Res<()>;
    /// The current plan's launch decisions.
    fn schedule(&self) -> Option<ffi::mla_schedule_t>;
    /// One timed step; allocates nothing and does not synchronize (graph-capturable).
    fn step(&mut self, stream: &CudaStream) -> mla_decode::Result<()>;
    /// The KV cache's bytes; None for the gather, which has none.
    fn cache_bytes(&self) -> Option<CacheBytes> {
        None
    }
    /// Holds `Some(n)` identical copies of the KV cache (the cache itself and `n - 1` more)
    /// for [`Workload::select_copy`] to pick from, or (None) the cache alone, for runs
    /// flushed by the memset. Recorded in [`Meta::copies`]; the gather has no cache and
    /// stays at None.
    fn set_copies(&mut self, _stream: &Arc<CudaStream>, _copies: Option<usize>) -> Res<()> {
        Ok(())
    }
    /// The next steps read copy `i % copies` of the cache.
    fn select_copy(&mut self, _i: usize) {}
    /// Synchronizes; fails if a kernel recorded a fault in the case's error flag.
    fn check_flag(&self, stream: &CudaStream) -> Res<()>;
    /// Compares the last step's output with the reference (computed on first use).
    fn check(&mut self, stream: &Arc<CudaStream>) -> Res<Accuracy>;
}

/// The workload of a case, with inputs drawn from `seed`.
pub fn build(stream: &Arc<CudaStream>, spec: &CaseSpec, seed: u64) -> Res<Box<dyn Workload>> {
    let rng = &mut Rng::new(seed);
    Ok(match spec {
        CaseSpec::Dense(d) => match d.dtype {
            DType::Bf16 => Box::new(DenseCase::<bf16>::from_spec(stream, d, rng)?),
            DType::F16 => Box::new(DenseCase::<f16>::from_spec(stream, d, rng)?),
        },
        CaseSpec::Sparse(s) => match s.dtype {
            DType::Bf16 => Box::new(SparseCase::<bf16>::from_spec(stream, s, rng)?),
            DType::F16 => Box::new(SparseCase::<f16>::from_spec(stream, s, rng)?),
        },
        CaseSpec::Gather(g) => Box::new(GatherCase::from_spec(stream, g, rng)?),
    })
}

fn no_plan() -> mla_decode::Error {
    mla_decode::Error::invalid("plan", "set_options was not called")
}

// ---- the cache ---------------------------------------------------------------------------

/// A contiguous paged cache tiled with one random chunk.
pub struct Cache<T> {
    pub data: CudaSlice<T>,
    pub block_size: usize,
    pub num_blocks: usize,
    chunk: Vec<T>,
}

impl<T: Element> Cache<T> {
    /// `num_blocks` blocks of `block_size` random rows.
    pub fn random(
        stream: &Arc<CudaStream>,
        num_blocks: usize,
        block_size: usize,
        rng: &mut Rng,
    ) -> Res<Self> {
        let chunk = rng.values::<T>(CHUNK_ROWS * HEAD_DIM);
        let chunk_dev = stream.clone_htod(&chunk)?;
        let mut data = stream.alloc_zeros::<T>(num_blocks * block_size * HEAD_DIM)?;
        replicate(stream, &chunk_dev, &mut data)?;
        Ok(Cache {
            data,
            block_size,
            num_blocks,
            chunk,
        })
    }

    pub fn view(&self) -> KvCache<'_, T> {
        KvCache::contiguous(self.data.as_view(), self.block_size)
    }

    /// The chunk in f64: the reference's cache, in which device slot `s` is row
    /// `s % CHUNK_ROWS` and device block `b` is block `b % reference_blocks()`.
    pub fn reference_rows(&self) -> Vec<f64> {
        self.chunk.iter().map(|v| v.to_f64()).collect()
    }

    pub fn reference_blocks(&self) -> usize {
        CHUNK_ROWS / self.block_size
    }

    fn reference_cache<'a>(&self, rows: &'a [f64]) -> PagedCache<'a> {
        PagedCache {
            data: rows,
            num_blocks: self.reference_blocks(),
            block_size: self.block_size,
        }
    }
}

/// Tiles `dst` with copies of `chunk` (device-to-device, doubling).
fn replicate<T>(stream: &Arc<CudaStream>, chunk: &CudaSlice<T>, dst: &mut CudaSlice<T>) -> Res<()> {
    let total = dst.len();
    let mut filled = chunk.len().min(total);
    stream.memcpy_dtod(&chunk.slice(..filled), &mut dst.slice_mut(..filled))?;
    while filled < total {
        let n = filled.min(total - filled);
        let (done, mut rest) = dst.split_at_mut(filled);
        stream.memcpy_dtod(&done.slice(..n), &mut rest.slice_mut(..n))?;
        filled += n;
    }
    Ok(())
}

/// A cache and the identical copies of it that the runs rotate over.
struct Rotated<T> {
    cache: Arc<Cache<T>>,
    /// The copies beyond `cache` itself.
    extra: Vec<CudaSlice<T>>,
    /// The copy steps read: 0 is `cache`, `c` is `extra[c - 1]`.
    current: usize,
    /// Bytes of the distinct cache rows one step reads.
    read_bytes: usize,
}

impl<T: Element> Rotated<T> {
    fn new(cache: Arc<Cache<T>>, rows_read: usize) -> Self {
        Rotated {
            cache,
            extra: Vec::new(),
            current: 0,
            read_bytes: rows_read * HEAD_DIM * std::mem::size_of::<T>(),
        }
    }

    fn bytes(&self) -> CacheBytes {
        CacheBytes {
            size: self.cache.data.len() * std::mem::size_of::<T>(),
            read: self.read_bytes,
        }
    }

    /// Makes the copies (device-to-device), or frees them; returns what [`Meta::copies`]
    /// records.
    fn set_copies(
        &mut self,
        stream: &Arc<CudaStream>,
        copies: Option<usize>,
    ) -> Res<Option<usize>> {
        let n = copies.unwrap_or(1).max(1);
        self.extra.truncate(n - 1);
        while self.extra.len() < n - 1 {
            self.extra.push(stream.clone_dtod(&self.cache.data)?);
        }
        self.current = 0;
        Ok(copies.map(|_| n))
    }

    fn select(&mut self, i: usize) {
        self.current = i % (self.extra.len() + 1);
    }

    fn view(&self) -> KvCache<'_, T> {
        match self.current {
            0 => self.cache.view(),
            c => KvCache::contiguous(self.extra[c - 1].as_view(), self.cache.block_size),
        }
    }
}

// ---- queries, outputs, plan: what dense and sparse share ----------------------------------

/// q, out, lse, error flag and plan of `rows` query rows of `heads` heads.
struct Io<T> {
    heads: usize,
    q_host: Vec<T>,
    q: CudaSlice<T>,
    out: CudaSlice<T>,
    lse: CudaSlice<f32>,
    flag: ErrorFlag,
    plan: Option<DecodePlan>,
}

impl<T: Element> Io<T> {
    fn new(stream: &Arc<CudaStream>, rows: usize, heads: usize, rng: &mut Rng) -> Res<Self> {
        let q_host = rng.values::<T>(rows * heads * HEAD_DIM);
        Ok(Io {
            heads,
            q: stream.clone_htod(&q_host)?,
            q_host,
            out: stream.alloc_zeros::<T>(rows * heads * LATENT_DIM)?,
            lse: stream.alloc_zeros::<f32>(rows * heads)?,
            flag: ErrorFlag::new(stream)?,
            plan: None,
        })
    }

    /// Bytes of q and out.
    fn bytes(&self) -> f64 {
        (self.q.len() + self.out.len()) as f64 * ELEM_BYTES
    }

    /// `q[t, h, :]` in f64 for `t` in `tokens`, `h` in `heads`: `[tokens, heads, 576]`.
    fn q_f64(&self, tokens: &[usize], heads: &[usize]) -> Vec<f64> {
        let mut q = Vec::with_capacity(tokens.len() * heads.len() * HEAD_DIM);
        for &t in tokens {
            for &h in heads {
                let row = &self.q_host[(t * self.heads + h) * HEAD_DIM..][..HEAD_DIM];
                q.extend(row.iter().map(|v| v.to_f64()));
            }
        }
        q
    }

    /// Remakes the plan (one plan at a time: a schedule sets the kernels' shared-memory
    /// attribute, which another schedule's launches depend on).
    fn replan(
        &mut self,
        make: impl FnOnce() -> mla_decode::Result<DecodePlan>,
    ) -> mla_decode::Result<()> {
        self.plan = None;
        self.plan = Some(make()?);
        Ok(())
    }

    fn compare(&self, stream: &Arc<CudaStream>, refs: &[RefRow]) -> Res<Accuracy> {
        let out = stream.clone_dtoh(&self.out)?;
        let lse = stream.clone_dtoh(&self.lse)?;
        Ok(check::compare(&out, &lse, self.heads, refs))
    }
}

// ---- dense -------------------------------------------------------------------------------

/// A dense problem: requests with their own lengths.
#[derive(Clone, Debug)]
pub struct DenseSetup {
    pub batch: usize,
    pub q_len: usize,
    pub heads: usize,
    pub block_size: usize,
    /// `[batch]` cached tokens per request.
    pub seq_lens: Vec<i32>,
    pub softmax_scale: f32,
}

/// Dense paged decode over a randomly permuted block table.
pub struct DenseCase<T> {
    meta: Meta,
    setup: DenseSetup,
    max_blocks: usize,
    kv: Rotated<T>,
    table_host: Vec<i32>,
    table: CudaSlice<i32>,
    seq_lens: CudaSlice<i32>,
    io: Io<T>,
    reference: Option<Vec<RefRow>>,
}

impl<T: Element> DenseCase<T> {
    pub fn from_spec(stream: &Arc<CudaStream>, spec: &DenseSpec, rng: &mut Rng) -> Res<Self> {
        let setup = DenseSetup {
            batch: spec.batch,
            q_len: spec.q_len,
            heads: spec.heads,
            block_size: spec.block_size,
            seq_lens: (0..spec.batch)
                .map(|b| {
                    i32::try_from(if b == 0 && spec.long > 0 {
                        spec.long
                    } else {
                        spec.seq_len
                    })
                })
                .collect::<Result<_, _>>()?,
            softmax_scale: bench_softmax_scale(),
        };
        Self::new(stream, CaseSpec::Dense(*spec).name(), setup, rng)
    }

    /// Random cache blocks (as many as the lengths need), table and queries for `setup`.
    pub fn new(
        stream: &Arc<CudaStream>,
        name: String,
        setup: DenseSetup,
        rng: &mut Rng,
    ) -> Res<Self> {
        let bs = setup.block_size;
        let blocks: Vec<usize> = setup
            .seq_lens
            .iter()
            .map(|&l| (l.max(0) as usize).div_ceil(bs))
            .collect();
        let max_blocks = blocks.iter().copied().max().unwrap_or(0).max(1);
        let num_blocks = blocks.iter().sum::<usize>().max(1);
        let mut ids: Vec<i32> = (0..i32::try_from(num_blocks)?).collect();
        rng.shuffle(&mut ids);
        let mut table_host = vec![0i32; setup.batch * max_blocks];
        let mut next = 0;
        for (row, &n) in table_host.chunks_exact_mut(max_blocks).zip(&blocks) {
            row[..n].copy_from_slice(&ids[next..next + n]);
            next += n;
        }
        let cache = Arc::new(Cache::random(stream, num_blocks, bs, rng)?);
        let io = Io::new(stream, setup.batch * setup.q_len, setup.heads, rng)?;
        let rows_read: f64 = setup.seq_lens.iter().map(|&l| l.max(0) as f64).sum();
        let meta = Meta {
            name,
            kind: "dense",
            dtype: Some(T::DTYPE),
            batch: setup.batch,
            q_len: setup.q_len,
            heads: setup.heads,
            seq_len: setup.seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize,
            topk: 0,
            block_size: bs,
            bytes: rows_read * ROW_BYTES + io.bytes(),
            flop: FLOP_PER_ROW * (setup.q_len * setup.heads) as f64 * rows_read,
            copies: None,
        };
        Ok(DenseCase {
            meta,
            max_blocks,
            // the table's blocks are distinct, so are the rows read
            kv: Rotated::new(cache, rows_read as usize),
            table: stream.clone_htod(&table_host)?,
            table_host,
            seq_lens: stream.clone_htod(&setup.seq_lens)?,
            setup,
            io,
            reference: None,
        })
    }

    /// The cache, to share with a sparse case over the same requests.
    pub fn cache(&self) -> Arc<Cache<T>> {
        self.kv.cache.clone()
    }

    pub fn setup(&self) -> &DenseSetup {
        &self.setup
    }

    /// `[batch, max_blocks_per_seq]` as uploaded.
    pub fn block_table(&self) -> (&[i32], usize) {
        (&self.table_host, self.max_blocks)
    }

    /// The reference rows of request `b` (its q_len rows, the sampled heads).
    fn reference_of(&self, b: usize, rows: &[f64], heads: &[usize]) -> Vec<RefRow> {
        let (s, mb) = (&self.setup, self.max_blocks);
        let ref_blocks = self.kv.cache.reference_blocks() as i32;
        let table: Vec<i32> = self.table_host[b * mb..][..mb]
            .iter()
            .map(|&e| e % ref_blocks)
            .collect();
        let tokens: Vec<usize> = (b * s.q_len..(b + 1) * s.q_len).collect();
        let q = self.io.q_f64(&tokens, heads);
        let att = reference::dense_decode(&DenseProblem {
            q: &q,
            batch: 1,
            q_len: s.q_len,
            num_heads: heads.len(),
            cache: self.kv.cache.reference_cache(rows),
            block_table: &table,
            max_blocks_per_seq: mb,
            seq_lens: &s.seq_lens[b..=b],
            softmax_scale: f64::from(s.softmax_scale),
        });
        check::rows_of(&att, &tokens, heads)
    }

    fn compute_reference(&self) -> Vec<RefRow> {
        let rows = self.kv.cache.reference_rows();
        let heads = check::spread(self.setup.heads, check::MAX_HEADS);
        let requests = check::spread(self.setup.batch, check::MAX_ROWS);
        check::parallel(&requests, |b| self.reference_of(b, &rows, &heads))
    }
}

impl<T: Element> Workload for DenseCase<T> {
    fn meta(&self) -> &Meta {
        &self.meta
    }

    fn set_options(&mut self, stream: &Arc<CudaStream>, options: PlanOptions) -> Res<()> {
        let shape = DenseShape {
            batch: self.setup.batch,
            q_len: self.setup.q_len,
            num_heads: self.setup.heads,
            block_size: self.setup.block_size,
            max_blocks_per_seq: self.max_blocks,
        };
        Ok(self
            .io
            .replan(|| DecodePlan::dense(stream, shape, options))?)
    }

    fn schedule(&self) -> Option<ffi::mla_schedule_t> {
        self.io.plan.as_ref().map(|p| *p.schedule())
    }

    fn cache_bytes(&self) -> Option<CacheBytes> {
        Some(self.kv.bytes())
    }

    fn set_copies(&mut self, stream: &Arc<CudaStream>, copies: Option<usize>) -> Res<()> {
        self.meta.copies = self.kv.set_copies(stream, copies)?;
        Ok(())
    }

    fn select_copy(&mut self, i: usize) {
        self.kv.select(i);
    }

    fn step(&mut self, stream: &CudaStream) -> mla_decode::Result<()> {
        let s = &self.setup;
        let io = &mut self.io;
        let plan = io.plan.as_ref().ok_or_else(no_plan)?;
        dense_decode(
            stream,
            plan,
            &Query::contiguous(io.q.as_view(), s.heads),
            &self.kv.view(),
            &BlockTable::new(self.table.as_view(), s.batch, self.max_blocks),
            &self.seq_lens.as_view(),
            &mut Output::contiguous(io.out.as_view_mut(), s.heads),
            Some(&mut Lse::contiguous(io.lse.as_view_mut(), s.heads)),
            s.softmax_scale,
            Some(&io.flag),
        )
    }

    fn check_flag(&self, stream: &CudaStream) -> Res<()> {
        Ok(self.io.flag.check(stream)?)
    }

    fn check(&mut self, stream: &Arc<CudaStream>) -> Res<Accuracy> {
        if self.reference.is_none() {
            self.reference = Some(self.compute_reference());
        }
        self.io
            .compare(stream, self.reference.as_deref().unwrap_or_default())
    }
}

// ---- sparse ------------------------------------------------------------------------------

/// A sparse problem: `tokens` query rows of `topk` slot ids each.
#[derive(Clone, Debug)]
pub struct SparseSetup {
    pub tokens: usize,
    pub heads: usize,
    pub topk: usize,
    pub softmax_scale: f32,
}

/// Sparse (DSA top-k) decode.
pub struct SparseCase<T> {
    meta: Meta,
    setup: SparseSetup,
    kv: Rotated<T>,
    indices_host: Vec<i32>,
    indices: CudaSlice<i32>,
    io: Io<T>,
    reference: Option<Vec<RefRow>>,
}

impl<T: Element> SparseCase<T> {
    /// A cache of `pool` slots and ids drawn from it uniformly, without repeats per token.
    pub fn from_spec(stream: &Arc<CudaStream>, spec: &SparseSpec, rng: &mut Rng) -> Res<Self> {
        let num_blocks = spec.pool.div_ceil(spec.block_size);
        let cache = Arc::new(Cache::random(stream, num_blocks, spec.block_size, rng)?);
        let mut pool: Vec<i32> = (0..i32::try_from(spec.pool)?).collect();
        let mut ids = Vec::with_capacity(spec.tokens * spec.topk);
        for _ in 0..spec.tokens {
            ids.extend_from_slice(rng.distinct(&mut pool, spec.topk));
        }
        let setup = SparseSetup {
            tokens: spec.tokens,
            heads: spec.heads,
            topk: spec.topk,
            softmax_scale: bench_softmax_scale(),
        };
        let indices = stream.clone_htod(&ids)?;
        let name = CaseSpec::Sparse(*spec).name();
        Self::new(stream, name, setup, cache, indices, ids, rng)
    }

    /// A sparse case over `cache` with the given slot ids (`indices_host` is their copy on
    /// the host, for the reference) and random queries.
    pub fn new(
        stream: &Arc<CudaStream>,
        name: String,
        setup: SparseSetup,
        cache: Arc<Cache<T>>,
        indices: CudaSlice<i32>,
        indices_host: Vec<i32>,
        rng: &mut Rng,
    ) -> Res<Self> {
        let io = Io::new(stream, setup.tokens, setup.heads, rng)?;
        let rows_read = indices_host.iter().filter(|&&id| id >= 0).count() as f64;
        let index_bytes = (setup.tokens * setup.topk * 4) as f64;
        let meta = Meta {
            name,
            kind: "sparse",
            dtype: Some(T::DTYPE),
            batch: setup.tokens,
            q_len: 1,
            heads: setup.heads,
            seq_len: 0,
            topk: setup.topk,
            block_size: cache.block_size,
            bytes: rows_read * ROW_BYTES + io.bytes() + index_bytes,
            flop: FLOP_PER_ROW * setup.heads as f64 * rows_read,
            copies: None,
        };
        let distinct_rows = distinct_slots(&indices_host, cache.num_blocks * cache.block_size);
        Ok(SparseCase {
            meta,
            setup,
            kv: Rotated::new(cache, distinct_rows),
            indices_host,
            indices,
            io,
            reference: None,
        })
    }

    fn reference_of(&self, t: usize, rows: &[f64], heads: &[usize]) -> Vec<RefRow> {
        let s = &self.setup;
        let ids: Vec<i32> = self.indices_host[t * s.topk..][..s.topk]
            .iter()
            .map(|&id| if id < 0 { id } else { id % CHUNK_ROWS as i32 })
            .collect();
        let q = self.io.q_f64(&[t], heads);
        let att = reference::sparse_decode(&SparseProblem {
            q: &q,
            num_tokens: 1,
            num_heads: heads.len(),
            cache: self.kv.cache.reference_cache(rows),
            indices: &ids,
            topk: s.topk,
            topk_len: None,
            softmax_scale: f64::from(s.softmax_scale),
        });
        check::rows_of(&att, &[t], heads)
    }

    fn compute_reference(&self) -> Vec<RefRow> {
        let rows = self.kv.cache.reference_rows();
        let heads = check::spread(self.setup.heads, check::MAX_HEADS);
        let tokens = check::spread(self.setup.tokens, check::MAX_ROWS);
        check::parallel(&tokens, |t| self.reference_of(t, &rows, &heads))
    }
}

impl<T: Element> Workload for SparseCase<T> {
    fn meta(&self) -> &Meta {
        &self.meta
    }

    fn set_options(&mut self, stream: &Arc<CudaStream>, options: PlanOptions) -> Res<()> {
        let shape = SparseShape {
            num_tokens: self.setup.tokens,
            num_heads: self.setup.heads,
            topk: self.setup.topk,
        };
        Ok(self
            .io
            .replan(|| DecodePlan::sparse(stream, shape, options))?)
    }

    fn schedule(&self) -> Option<ffi::mla_schedule_t> {
        self.io.plan.as_ref().map(|p| *p.schedule())
    }

    fn cache_bytes(&self) -> Option<CacheBytes> {
        Some(self.kv.bytes())
    }

    fn set_copies(&mut self, stream: &Arc<CudaStream>, copies: Option<usize>) -> Res<()> {
        self.meta.copies = self.kv.set_copies(stream, copies)?;
        Ok(())
    }

    fn select_copy(&mut self, i: usize) {
        self.kv.select(i);
    }

    fn step(&mut self, stream: &CudaStream) -> mla_decode::Result<()> {
        let s = &self.setup;
        let io = &mut self.io;
        let plan = io.plan.as_ref().ok_or_else(no_plan)?;
        sparse_decode(
            stream,
            plan,
            &Query::contiguous(io.q.as_view(), s.heads),
            &self.kv.view(),
            &SparseIndices::contiguous(self.indices.as_view(), s.topk),
            None,
            &mut Output::contiguous(io.out.as_view_mut(), s.heads),
            Some(&mut Lse::contiguous(io.lse.as_view_mut(), s.heads)),
            s.softmax_scale,
            Some(&io.flag),
        )
    }

    fn check_flag(&self, stream: &CudaStream) -> Res<()> {
        Ok(self.io.flag.check(stream)?)
    }

    fn check(&mut self, stream: &Arc<CudaStream>) -> Res<Accuracy> {
        if self.reference.is_none() {
            self.reference = Some(self.compute_reference());
        }
        self.io
            .compare(stream, self.reference.as_deref().unwrap_or_default())
    }
}

/// How many distinct slots in `0..slots` the ids name (-1 and other ids out of range
/// count for none).
fn distinct_slots(ids: &[i32], slots: usize) -> usize {
    let mut seen = vec![false; slots];
    let mut n = 0;
    for &id in ids {
        if let Some(s) = usize::try_from(id).ok().and_then(|i| seen.get_mut(i)) {
            n += usize::from(!*s);
            *s = true;
        }
    }
    n
}

// ---- gather ------------------------------------------------------------------------------

/// The host side of a gather: positions `[tokens, topk]` of requests `req_id[tokens]`.
#[derive(Clone, Debug)]
pub struct GatherInputs {
    pub positions: Vec<i32>,
    pub topk: usize,
    pub req_id: Vec<i32>,
    /// `[batch, max_blocks]`.
    pub block_table: Vec<i32>,
    pub max_blocks: usize,
    /// `[batch]`.
    pub seq_lens: Vec<i32>,
    pub num_blocks: usize,
    pub block_size: usize,
}

/// The index gather alone: request-logical positions to global slot ids.
///
/// It has no KV cache and rotates nothing: its runs keep the memset flush in either
/// `--flush` mode (its inputs, a few MB of positions and tables, would need some hundred
/// copies to span 4× L2).
pub struct GatherCase {
    meta: Meta,
    host: GatherInputs,
    positions: CudaSlice<i32>,
    req_id: CudaSlice<i32>,
    table: CudaSlice<i32>,
    seq_lens: CudaSlice<i32>,
    out: CudaSlice<i32>,
    flag: ErrorFlag,
}

impl GatherCase {
    /// One request of `seq_len` tokens per query token, distinct random positions.
    pub fn from_spec(stream: &Arc<CudaStream>, spec: &GatherSpec, rng: &mut Rng) -> Res<Self> {
        let max_blocks = spec.seq_len.div_ceil(spec.block_size);
        let num_blocks = spec.tokens * max_blocks;
        let mut block_table: Vec<i32> = (0..i32::try_from(num_blocks)?).collect();
        rng.shuffle(&mut block_table);
        let mut logical: Vec<i32> = (0..i32::try_from(spec.seq_len)?).collect();
        let mut positions = Vec::with_capacity(spec.tokens * spec.topk);
        for _ in 0..spec.tokens {
            positions.extend_from_slice(rng.distinct(&mut logical, spec.topk));
        }
        let inputs = GatherInputs {
            positions,
            topk: spec.topk,
            req_id: (0..i32::try_from(spec.tokens)?).collect(),
            block_table,
            max_blocks,
            seq_lens: vec![i32::try_from(spec.seq_len)?; spec.tokens],
            num_blocks,
            block_size: spec.block_size,
        };
        Self::new(stream, CaseSpec::Gather(*spec).name(), inputs)
    }

    pub fn new(stream: &Arc<CudaStream>, name: String, host: GatherInputs) -> Res<Self> {
        let tokens = host.req_id.len();
        let entries = (tokens * host.topk) as f64;
        let meta = Meta {
            name,
            kind: "gather",
            dtype: None,
            batch: tokens,
            q_len: 1,
            heads: 0,
            seq_len: host.seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize,
            topk: host.topk,
            block_size: host.block_size,
            // positions read, slot ids written, req_id read
            bytes: entries * 8.0 + tokens as f64 * 4.0,
            flop: 0.0,
            copies: None,
        };
        Ok(GatherCase {
            meta,
            positions: stream.clone_htod(&host.positions)?,
            req_id: stream.clone_htod(&host.req_id)?,
            table: stream.clone_htod(&host.block_table)?,
            seq_lens: stream.clone_htod(&host.seq_lens)?,
            out: stream.alloc_zeros::<i32>(tokens * host.topk)?,
            flag: ErrorFlag::new(stream)?,
            host,
        })
    }

    /// The slot ids the last step wrote, `[tokens, topk]`.
    pub fn into_output(self) -> CudaSlice<i32> {
        self.out
    }
}

impl Workload for GatherCase {
    fn meta(&self) -> &Meta {
        &self.meta
    }

    fn set_options(&mut self, _stream: &Arc<CudaStream>, _options: PlanOptions) -> Res<()> {
        Ok(())
    }

    fn schedule(&self) -> Option<ffi::mla_schedule_t> {
        None
    }

    fn step(&mut self, stream: &CudaStream) -> mla_decode::Result<()> {
        let h = &self.host;
        gather_slots(
            stream,
            &self.positions.as_view(),
            h.topk,
            h.topk,
            &self.req_id.as_view(),
            &BlockTable::new(self.table.as_view(), h.seq_lens.len(), h.max_blocks),
            &self.seq_lens.as_view(),
            h.num_blocks,
            h.block_size,
            &mut self.out.as_view_mut(),
            h.topk,
            Some(&self.flag),
        )
    }

    fn check_flag(&self, stream: &CudaStream) -> Res<()> {
        Ok(self.flag.check(stream)?)
    }

    /// Exact: `relerr` is the fraction of ids that differ from the reference's.
    fn check(&mut self, stream: &Arc<CudaStream>) -> Res<Accuracy> {
        let h = &self.host;
        let (want, _faults) = reference::gather_slots(&GatherProblem {
            positions: &h.positions,
            num_tokens: h.req_id.len(),
            topk: h.topk,
            req_id: &h.req_id,
            block_table: &h.block_table,
            max_blocks_per_seq: h.max_blocks,
            seq_lens: &h.seq_lens,
            batch: h.seq_lens.len(),
            block_size: h.block_size,
            num_blocks: h.num_blocks,
        });
        let got = stream.clone_dtoh(&self.out)?;
        let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        Ok(Accuracy {
            relerr: wrong as f64 / want.len().max(1) as f64,
            lse_err: None,
            tolerance: check::out_tolerance(None),
        })
    }
}
