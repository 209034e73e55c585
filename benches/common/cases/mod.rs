//! The workloads: random inputs on the device, one timed step, and the check.
//!
//! - dense ([`dense`]): one `dense_decode` (decode + combine; the split is derived from
//!   seq_lens inside the call) per step;
//! - sparse ([`sparse`]): one `sparse_decode` per step (with topk_len when the case gives
//!   `klen`);
//! - gather ([`gather`]): `gather_slots` alone;
//! - append ([`append`]): `append_kv` alone (t new rows into a cache of `pool` slots, in its
//!   format; no rotated cache, no plan, checked byte for byte).
//!
//! Dense and sparse are one [`DecodeCase`] each, which owns what they share (the rotated
//! cache, q/out/lse, the flag, the plan, the sampled reference) and implements [`Workload`]
//! once; a [`DecodeKind`] adds what differs (tables or indices, the call, the reference).
//!
//! Inputs are random, never zeros. A cache is filled by uploading one random chunk of
//! [`CHUNK_ROWS`] rows and replicating it on the device, so that even the 1.2 GB caches are
//! ready in milliseconds: global slot `s` holds chunk row `s % CHUNK_ROWS`, which is also
//! how the reference sees the cache (without a copy of it). Dense block tables are a random
//! permutation of the blocks; sparse slot ids are drawn uniformly without repeats per token.
//!
//! An fp8 case (`kv=`) quantizes the chunk with the reference quantizer (per-tensor: one
//! scale, the chunk's largest magnitude / 448) and tiles the cache with its bytes; the
//! reference reads the dequantized chunk.
//!
//! For `--flush rotate` a dense or sparse case holds identical copies of its cache
//! ([`Workload::set_copies`]) and each run reads the one [`Workload::select_copy`] picked;
//! q, tables and indices are not copied (they are small next to the cache rows read).

pub mod append;
pub mod dense;
pub mod gather;
pub mod sparse;

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::reference::{fp8, PagedCache};
use mla_decode::{
    ffi, CacheLayout, DType, DecodePlan, Element, ErrorFlag, KvCache, KvFormat, Lse, MlaConfig,
    Output, PlanOptions, Query, HEAD_DIM, LATENT_DIM,
};

use super::check::{self, Accuracy, RefRow};
use super::kit::with_dtype;
use super::rng::Rng;
use super::spec::{CacheKind, CaseSpec};
use super::Res;

pub use append::AppendCase;
pub use dense::{DenseCase, DenseKind, DenseSetup};
pub use gather::{GatherCase, GatherInputs};
pub use sparse::{SparseCase, SparseKind, SparseSetup};

/// Bytes of one f16/bf16 cache row (fp8 rows: [`Cache::row_bytes`]).
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
    /// `"dense"`, `"sparse"`, `"gather"` or `"append"`.
    pub kind: &'static str,
    /// None for the gather; the new rows' dtype for the append.
    pub dtype: Option<DType>,
    /// The JSON's `kv_format` (`bf16`, `f16`, `fp8_ds_mla`, `fp8`); None for the gather.
    pub kv_format: Option<&'static str>,
    /// The JSON's `scale_rule` (`raw`, `pow2`, `tensor`); None for f16/bf16 and the gather.
    pub scale_rule: Option<&'static str>,
    /// Requests (dense), query tokens (sparse, gather) or rows appended (append).
    pub batch: usize,
    pub q_len: usize,
    /// 0 for the gather and the append.
    pub heads: usize,
    /// Longest sequence (dense, gather); 0 for sparse and the append.
    pub seq_len: usize,
    /// Indices per token (sparse, gather); 0 for dense and the append.
    pub topk: usize,
    /// The lengths (dense) or topk_len (sparse), as the case spells them: `4096*64`,
    /// `uniform:1-8192`, `512*15+8192*1`; None for the gather and the append.
    pub lens: Option<String>,
    pub block_size: usize,
    /// Bytes the step must move: cache rows read × the format's row bytes (1152, 656, 576)
    /// + q + out (+ indices); the append: rows read + slot ids + cache rows written.
    pub bytes: f64,
    /// FLOP of the step: 2·1088 per (query row, head, cache row it sees).
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
    /// (Re)makes the decode plan for `options`; by default nothing (the gather and the append
    /// have no plan).
    fn set_options(&mut self, _stream: &Arc<CudaStream>, _options: PlanOptions) -> Res<()> {
        Ok(())
    }
    /// The current plan's launch decisions; None without a plan.
    fn schedule(&self) -> Option<ffi::mla_schedule_t> {
        None
    }
    /// One timed step; allocates nothing and does not synchronize (graph-capturable).
    fn step(&mut self, stream: &Arc<CudaStream>) -> mla_decode::Result<()>;
    /// The KV cache's bytes to rotate; None for the gather, which has none, and the append,
    /// which writes its cache (both keep the memset flush).
    fn cache_bytes(&self) -> Option<CacheBytes> {
        None
    }
    /// Holds `Some(n)` identical copies of the KV cache (the cache itself and `n - 1` more)
    /// for [`Workload::select_copy`] to pick from, or (None) the cache alone, for runs
    /// flushed by the memset. Recorded in [`Meta::copies`]; the gather and the append stay
    /// at None.
    fn set_copies(&mut self, _stream: &Arc<CudaStream>, _copies: Option<usize>) -> Res<()> {
        Ok(())
    }
    /// The next steps read copy `i % copies` of the cache.
    fn select_copy(&mut self, _i: usize) {}
    /// Synchronizes; fails if a kernel recorded a fault in the case's error flag.
    fn check_flag(&self, stream: &Arc<CudaStream>) -> Res<()>;
    /// Compares the last step's output with the reference (computed on first use).
    fn check(&mut self, stream: &Arc<CudaStream>) -> Res<Accuracy>;
}

/// The workload of a case, with inputs drawn from `seed`.
pub fn build(stream: &Arc<CudaStream>, spec: &CaseSpec, seed: u64) -> Res<Box<dyn Workload>> {
    let rng = &mut Rng::new(seed);
    Ok(match spec {
        CaseSpec::Dense(d) => {
            with_dtype!(d.dtype, T => Box::new(DenseCase::<T>::from_spec(stream, d, rng)?))
        }
        CaseSpec::Sparse(s) => {
            with_dtype!(s.dtype, T => Box::new(SparseCase::<T>::from_spec(stream, s, rng)?))
        }
        CaseSpec::Gather(g) => Box::new(GatherCase::from_spec(stream, g, rng)?),
        CaseSpec::Append(a) => {
            with_dtype!(a.dtype, T => Box::new(AppendCase::<T>::from_spec(stream, a, rng)?))
        }
    })
}

fn no_plan() -> mla_decode::Error {
    mla_decode::Error::invalid("plan", "set_options was not called")
}

// ---- the cache ---------------------------------------------------------------------------

/// A contiguous paged cache tiled with one random chunk: f16/bf16 rows in `data`, or (an
/// fp8 `kind`) the chunk quantized, in `bytes` (`data` then holds one row, unused).
pub struct Cache<T> {
    pub data: CudaSlice<T>,
    pub block_size: usize,
    pub num_blocks: usize,
    /// The cache format.
    pub kind: CacheKind,
    chunk: Vec<T>,
    /// fp8: the cache's bytes, the tensor scale, the dequantized chunk.
    bytes: Option<CudaSlice<u8>>,
    scale: Option<CudaSlice<f32>>,
    dequantized: Vec<f64>,
}

impl<T: Element> Cache<T> {
    /// `num_blocks` blocks of `block_size` random rows of the query's dtype.
    pub fn random(
        stream: &Arc<CudaStream>,
        num_blocks: usize,
        block_size: usize,
        rng: &mut Rng,
    ) -> Res<Self> {
        Self::random_in(stream, num_blocks, block_size, CacheKind::Query, rng)
    }

    /// `num_blocks` blocks of `block_size` random rows in format `kind`.
    pub fn random_in(
        stream: &Arc<CudaStream>,
        num_blocks: usize,
        block_size: usize,
        kind: CacheKind,
        rng: &mut Rng,
    ) -> Res<Self> {
        let chunk = rng.values::<T>(CHUNK_ROWS * HEAD_DIM);
        let mut cache = Cache {
            data: stream.alloc_zeros::<T>(HEAD_DIM)?,
            block_size,
            num_blocks,
            kind,
            chunk,
            bytes: None,
            scale: None,
            dequantized: Vec::new(),
        };
        if kind == CacheKind::Query {
            let chunk_dev = stream.clone_htod(&cache.chunk)?;
            cache.data = stream.alloc_zeros::<T>(num_blocks * block_size * HEAD_DIM)?;
            replicate(stream, &chunk_dev, &mut cache.data)?;
            return Ok(cache);
        }
        let rows: Vec<f64> = cache.chunk.iter().map(|v| v.to_f64()).collect();
        let amax = rows.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let tensor_scale = (amax / 448.0).max(1e-6) as f32;
        let rb = cache.row_bytes();
        let mut q = Vec::with_capacity(CHUNK_ROWS * rb);
        for row in rows.chunks_exact(HEAD_DIM) {
            match kind {
                CacheKind::Fp8DsMla(rule) => {
                    let b = fp8::quantize_row(row, rule);
                    cache
                        .dequantized
                        .extend_from_slice(&fp8::dequantize_row(&b));
                    q.extend_from_slice(&b);
                }
                _ => {
                    let b = fp8::quantize_row_per_tensor(row, tensor_scale);
                    cache
                        .dequantized
                        .extend_from_slice(&fp8::dequantize_row_per_tensor(&b, tensor_scale));
                    q.extend_from_slice(&b);
                }
            }
        }
        let chunk_dev = stream.clone_htod(&q)?;
        let mut bytes = stream.alloc_zeros::<u8>(num_blocks * block_size * rb)?;
        replicate(stream, &chunk_dev, &mut bytes)?;
        cache.bytes = Some(bytes);
        cache.scale = Some(stream.clone_htod(&[tensor_scale])?);
        Ok(cache)
    }

    /// The library's format.
    pub fn format(&self) -> KvFormat {
        self.kind.format(T::DTYPE)
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.format().row_bytes()
    }

    /// Bytes of the whole cache (one copy).
    pub fn size_bytes(&self) -> usize {
        self.num_blocks * self.block_size * self.row_bytes()
    }

    pub fn view(&self) -> mla_decode::Result<KvCache<'_>> {
        match &self.bytes {
            None => KvCache::contiguous(&self.data, T::DTYPE.kv_format(), self.block_size),
            Some(b) => Ok(self.bytes_view(b)),
        }
    }

    /// The view of `b`, a copy of this fp8 cache's bytes.
    fn bytes_view<'a>(&'a self, b: &'a CudaSlice<u8>) -> KvCache<'a> {
        let layout = CacheLayout {
            format: self.format(),
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            block_stride_bytes: self.block_size * self.row_bytes(),
        };
        let kv = KvCache::new(b, layout);
        match (&self.scale, self.format()) {
            (Some(s), KvFormat::Fp8PerTensor) => kv.with_scale(s),
            _ => kv,
        }
    }

    /// The chunk in f64 (fp8: dequantized): the reference's cache, in which device slot `s`
    /// is row `s % CHUNK_ROWS` and device block `b` is block `b % reference_blocks()`.
    pub fn reference_rows(&self) -> Vec<f64> {
        if self.bytes.is_some() {
            return self.dequantized.clone();
        }
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
    /// The copies beyond `cache` itself (f16/bf16 caches).
    extra: Vec<CudaSlice<T>>,
    /// The copies beyond `cache` itself (fp8 caches).
    extra_bytes: Vec<CudaSlice<u8>>,
    /// The copy steps read: 0 is `cache`, `c` is `extra[c - 1]`.
    current: usize,
    /// Bytes of the distinct cache rows one step reads.
    read_bytes: usize,
}

impl<T: Element> Rotated<T> {
    fn new(cache: Arc<Cache<T>>, rows_read: usize) -> Self {
        let read_bytes = rows_read * cache.row_bytes();
        Rotated {
            cache,
            extra: Vec::new(),
            extra_bytes: Vec::new(),
            current: 0,
            read_bytes,
        }
    }

    fn bytes(&self) -> CacheBytes {
        CacheBytes {
            size: self.cache.size_bytes(),
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
        self.extra_bytes.truncate(n - 1);
        match &self.cache.bytes {
            None => {
                while self.extra.len() < n - 1 {
                    self.extra.push(stream.clone_dtod(&self.cache.data)?);
                }
            }
            Some(b) => {
                while self.extra_bytes.len() < n - 1 {
                    self.extra_bytes.push(stream.clone_dtod(b)?);
                }
            }
        }
        self.current = 0;
        Ok(copies.map(|_| n))
    }

    fn select(&mut self, i: usize) {
        self.current = i % (self.extra.len().max(self.extra_bytes.len()) + 1);
    }

    fn view(&self) -> mla_decode::Result<KvCache<'_>> {
        match self.current {
            0 => self.cache.view(),
            c if self.cache.bytes.is_some() => Ok(self.cache.bytes_view(&self.extra_bytes[c - 1])),
            c => KvCache::contiguous(
                &self.extra[c - 1],
                T::DTYPE.kv_format(),
                self.cache.block_size,
            ),
        }
    }
}

// ---- what dense and sparse share --------------------------------------------------------

/// q, out, lse and error flag of `rows` query rows of `heads` heads.
pub struct Io<T> {
    heads: usize,
    q_host: Vec<T>,
    q: CudaSlice<T>,
    out: CudaSlice<T>,
    lse: CudaSlice<f32>,
    flag: ErrorFlag,
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

    /// The views a decode call takes: q, out, lse (all contiguous), the flag.
    fn views(&mut self) -> (Query<'_, T>, Output<'_, T>, Lse<'_>, &mut ErrorFlag) {
        (
            Query::contiguous(&self.q, self.heads),
            Output::contiguous(&mut self.out, self.heads),
            Lse::contiguous(&mut self.lse, self.heads),
            &mut self.flag,
        )
    }

    fn compare(&self, stream: &Arc<CudaStream>, refs: &[RefRow]) -> Res<Accuracy> {
        let out = stream.clone_dtoh(&self.out)?;
        let lse = stream.clone_dtoh(&self.lse)?;
        Ok(check::compare(&out, &lse, self.heads, refs))
    }
}

/// What differs between a dense and a sparse case.
pub trait DecodeKind<T: Element> {
    /// A plan for the case's shape.
    fn plan(
        &self,
        stream: &Arc<CudaStream>,
        options: PlanOptions,
    ) -> mla_decode::Result<DecodePlan>;
    /// One decode call over `kv`.
    fn launch(
        &self,
        stream: &Arc<CudaStream>,
        plan: &mut DecodePlan,
        kv: KvCache<'_>,
        io: &mut Io<T>,
    ) -> mla_decode::Result<()>;
    /// The sampled reference rows (the chunk `rows` in f64 is the reference's cache).
    fn reference(&self, cache: &Cache<T>, rows: &[f64], io: &Io<T>) -> Vec<RefRow>;
}

/// A dense or sparse case: the cache rotated over copies, q/out/lse/flag, the plan, the
/// reference (computed on the first check), and the kind's own inputs.
pub struct DecodeCase<T, K> {
    meta: Meta,
    kind: K,
    kv: Rotated<T>,
    io: Io<T>,
    plan: Option<DecodePlan>,
    reference: Option<Vec<RefRow>>,
}

impl<T: Element, K: DecodeKind<T>> DecodeCase<T, K> {
    /// The cache, to share with another case over the same requests.
    pub fn cache(&self) -> Arc<Cache<T>> {
        self.kv.cache.clone()
    }

    /// The kind's own inputs.
    pub fn kind(&self) -> &K {
        &self.kind
    }
}

impl<T: Element, K: DecodeKind<T>> Workload for DecodeCase<T, K> {
    fn meta(&self) -> &Meta {
        &self.meta
    }

    /// Remakes the plan (one plan at a time: a schedule sets the kernels' shared-memory
    /// attribute, which another schedule's launches depend on).
    fn set_options(&mut self, stream: &Arc<CudaStream>, options: PlanOptions) -> Res<()> {
        self.plan = None;
        self.plan = Some(self.kind.plan(stream, options)?);
        Ok(())
    }

    fn schedule(&self) -> Option<ffi::mla_schedule_t> {
        self.plan.as_ref().map(|p| *p.schedule())
    }

    fn step(&mut self, stream: &Arc<CudaStream>) -> mla_decode::Result<()> {
        let plan = self.plan.as_mut().ok_or_else(no_plan)?;
        self.kind
            .launch(stream, plan, self.kv.view()?, &mut self.io)
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

    fn check_flag(&self, stream: &Arc<CudaStream>) -> Res<()> {
        Ok(self.io.flag.check(stream)?)
    }

    fn check(&mut self, stream: &Arc<CudaStream>) -> Res<Accuracy> {
        if self.reference.is_none() {
            let cache = &self.kv.cache;
            let rows = cache.reference_rows();
            self.reference = Some(self.kind.reference(cache, &rows, &self.io));
        }
        self.io
            .compare(stream, self.reference.as_deref().unwrap_or_default())
    }
}

/// Lengths as the JSON's `lens` spells them: runs `A*N+B*M` when there are at most four,
/// else `N lengths LO-HI`.
pub fn lens_label(lens: &[i32]) -> String {
    let mut runs: Vec<(i32, usize)> = Vec::new();
    for &l in lens {
        match runs.last_mut() {
            Some((v, n)) if *v == l => *n += 1,
            _ => runs.push((l, 1)),
        }
    }
    if runs.len() <= 4 {
        let terms: Vec<String> = runs.iter().map(|(v, n)| format!("{v}*{n}")).collect();
        terms.join("+")
    } else {
        let (lo, hi) = (lens.iter().min(), lens.iter().max());
        format!(
            "{} lengths {}-{}",
            lens.len(),
            lo.unwrap_or(&0),
            hi.unwrap_or(&0)
        )
    }
}
