//! Shared helpers of the GPU integration tests (`tests/gpu_dense.rs`, `tests/gpu_sparse.rs`):
//! a seeded RNG, one CUDA context per test, host mirrors of strided device views, the f64
//! reference run on repacked inputs, and the comparisons.
//!
//! Every input value is drawn in f64, rounded to the device dtype, and the reference is fed the
//! rounded value (`to_f64` of exactly what was uploaded). Gaps of strided inputs hold NaN (a
//! kernel that reads them poisons its result); outputs are poisoned (0xFFFF / f32 NaN) before
//! each run, and their gaps must still hold the poison afterwards.
#![allow(dead_code)]

use std::fmt::Debug;
use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use mla_decode::half::{bf16, f16};
use mla_decode::reference::{
    self, fault_code, Attention, DenseProblem, Fault, PagedCache, SparseProblem,
};
use mla_decode::{
    dense_decode, sparse_decode, BlockTable, DecodePlan, DenseShape, Element, ErrorFlag, KvCache,
    Lse, Output, PlanOptions, Query, SparseIndices, SparseShape, HEAD_DIM, LATENT_DIM, ROPE_DIM,
};
use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestRunner};

/// Absolute tolerance of lse.
pub const LSE_TOL: f64 = 1e-3;
/// The poison bit pattern of half outputs (a NaN in f16 and in bf16).
pub const POISON: u16 = 0xFFFF;
/// Work budget of a random case: (query row, head, cache row) triples the reference computes.
pub const WORK_BUDGET: usize = 2_000_000;

// ---------------------------------------------------------------------------------------------
// Element types

/// f16 or bf16, with what the tests need beyond [`Element`].
pub trait Half: Element {
    /// Relative L2 tolerance of one (row, head) output against the f64 reference.
    const TOL: f64;
    /// The raw bits.
    fn bits(self) -> u16;
    /// From raw bits.
    fn from_bits(bits: u16) -> Self;
    /// A NaN (the gap filler of inputs).
    fn nan() -> Self {
        Self::from_f64(f64::NAN)
    }
    /// The output poison.
    fn poison() -> Self {
        Self::from_bits(POISON)
    }
}

impl Half for f16 {
    const TOL: f64 = 2e-3;
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(bits: u16) -> Self {
        f16::from_bits(bits)
    }
}

impl Half for bf16 {
    const TOL: f64 = 1e-2;
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(bits: u16) -> Self {
        bf16::from_bits(bits)
    }
}

// ---------------------------------------------------------------------------------------------
// Randomness

/// SplitMix64.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn f01(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f64 {
        2.0 * self.f01() - 1.0
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "below(0)");
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        assert!(lo <= hi, "range({lo}, {hi})");
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.f01() < p
    }

    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// Log-uniform in `[lo, hi)`.
    pub fn log_uniform(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + self.f01() * (hi.ln() - lo.ln())).exp()
    }

    /// Fisher-Yates.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }

    /// `k` distinct values of `0..n` in random order (`k <= n`).
    pub fn distinct(&mut self, n: usize, k: usize) -> Vec<usize> {
        assert!(k <= n, "distinct({n}, {k})");
        if k * 4 >= n {
            let mut all: Vec<usize> = (0..n).collect();
            self.shuffle(&mut all);
            all.truncate(k);
            return all;
        }
        let mut seen = std::collections::HashSet::with_capacity(k * 2);
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            let v = self.below(n);
            if seen.insert(v) {
                out.push(v);
            }
        }
        out
    }

    /// `n` random values in [-1, 1), rounded to `T`.
    pub fn halves<T: Half>(&mut self, n: usize) -> Vec<T> {
        (0..n).map(|_| T::from_f64(self.unit())).collect()
    }

    /// A softmax scale: log-uniform over [0.01, 0.3), or one of the models' values.
    pub fn softmax_scale(&mut self) -> f32 {
        match self.below(6) {
            0 => 1.0 / 16.0,           // GLM-5
            1 => (1.0 / 24.0) * 1.874, // DeepSeek-V3 with YaRN mscale²
            _ => self.log_uniform(0.01, 0.3) as f32,
        }
    }
}

/// A fresh seed for a non-proptest test (from the clock, or `MLA_TEST_SEED` to replay),
/// printed so that a failure names it (cargo shows a failing test's output).
pub fn seed(test: &str) -> u64 {
    let seed = match std::env::var("MLA_TEST_SEED") {
        Ok(s) => {
            let s = s.trim();
            let parsed = match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("MLA_TEST_SEED={s:?}: not a u64"))
        }
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            let mut h = 0xcbf2_9ce4_8422_2325u64;
            for b in test.bytes() {
                h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
            Rng::new(nanos ^ h).next_u64()
        }
    };
    eprintln!("{test}: seed {seed:#x} (replay with MLA_TEST_SEED={seed:#x})");
    seed
}

/// Runs `test` on `cases` random values of `strategy` (fresh each run; `MLA_GPU_CASES`
/// overrides the count). A failing case is shrunk a little and reported with its value (which
/// holds the seed of its data).
pub fn run_cases<S>(name: &str, cases: u32, strategy: S, test: impl Fn(&S::Value))
where
    S: Strategy,
    S::Value: Debug,
{
    let cases = std::env::var("MLA_GPU_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 24,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&strategy, |value| {
        eprintln!("{name}: case {value:?}");
        test(&value);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Device

/// A context on device 0 and a new stream on it. Panics (never passes) without a GPU.
pub fn gpu() -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = context();
    let stream = ctx.new_stream().expect("new stream");
    (ctx, stream)
}

/// As [`gpu`], with cudarc's event tracking disabled before anything is allocated, so that
/// work on the stream can be captured in a CUDA graph.
pub fn gpu_for_graphs() -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = context();
    // SAFETY: every buffer of the test lives on the one stream created below.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().expect("new stream");
    (ctx, stream)
}

fn context() -> Arc<CudaContext> {
    assert!(
        mla_decode::cuda_available(),
        "this test needs a CUDA GPU: libcuda could not be loaded (CPU runs should skip it as ignored)"
    );
    CudaContext::new(0).unwrap_or_else(|e| panic!("CUDA context on device 0: {e:?}"))
}

// ---------------------------------------------------------------------------------------------
// Strided [tokens, heads, width] layouts

/// How a `[tokens, heads, width]` view is laid out in its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowsKind {
    /// Dense `[tokens, heads, width]` from element 0 (the `contiguous` constructors).
    Contiguous,
    /// Token-major with padding between heads and tokens and an offset into the buffer.
    Padded,
    /// Head-major (`[heads, tokens, width]`) with padding and an offset.
    HeadMajor,
}

/// A strided view of `[tokens, heads, width]` inside a buffer of `len` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    /// The layout family.
    pub kind: RowsKind,
    /// Element where the view starts.
    pub offset: usize,
    /// Elements between tokens.
    pub token_stride: usize,
    /// Elements between heads.
    pub head_stride: usize,
    /// Elements of the whole buffer.
    pub len: usize,
    /// Tokens.
    pub tokens: usize,
    /// Heads.
    pub heads: usize,
    /// Contiguous elements per (token, head).
    pub width: usize,
}

impl Strided {
    /// A random layout of `kind`; strides, offset and padding are multiples of `align` elements.
    pub fn new(
        rng: &mut Rng,
        kind: RowsKind,
        tokens: usize,
        heads: usize,
        width: usize,
        align: usize,
    ) -> Strided {
        let (offset, token_stride, head_stride) = match kind {
            RowsKind::Contiguous => (0, heads * width, width),
            RowsKind::Padded => {
                let hs = width + align * rng.below(3);
                let ts = heads * hs + align * rng.below(4);
                (align * rng.below(4), ts, hs)
            }
            RowsKind::HeadMajor => {
                let ts = width + align * rng.below(3);
                let hs = tokens * ts + align * rng.below(4);
                (align * rng.below(4), ts, hs)
            }
        };
        let span = (tokens - 1) * token_stride + (heads - 1) * head_stride + width;
        let tail = if kind == RowsKind::Contiguous {
            0
        } else {
            align * rng.below(3)
        };
        Strided {
            kind,
            offset,
            token_stride,
            head_stride,
            len: offset + span + tail,
            tokens,
            heads,
            width,
        }
    }

    /// A random kind (all three equally likely).
    pub fn random_kind(rng: &mut Rng) -> RowsKind {
        rng.pick(&[RowsKind::Contiguous, RowsKind::Padded, RowsKind::HeadMajor])
    }

    /// Element index of `(token, head, 0)`.
    pub fn at(&self, token: usize, head: usize) -> usize {
        self.offset + token * self.token_stride + head * self.head_stride
    }

    /// Which elements of the buffer the view covers.
    pub fn covered(&self) -> Vec<bool> {
        let mut c = vec![false; self.len];
        for t in 0..self.tokens {
            for h in 0..self.heads {
                let i = self.at(t, h);
                c[i..i + self.width].iter_mut().for_each(|x| *x = true);
            }
        }
        c
    }

    /// The same layout moved `by` elements further into the buffer (for a view of the same
    /// rows starting at another column).
    fn shifted(&self, by: usize, width: usize) -> Strided {
        Strided {
            offset: self.offset + by,
            width,
            ..*self
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Queries

/// How the query is passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QKind {
    /// `Query::contiguous`.
    Contiguous,
    /// `Query::strided` over a padded (or head-major) buffer.
    Strided,
    /// `Query::split` over two buffers (nope, rope) with their own strides.
    SplitSeparate,
    /// `Query::split` with rope pointing 512 elements into the nope rows of one buffer.
    SplitShared,
}

impl QKind {
    /// A random kind.
    pub fn random(rng: &mut Rng) -> QKind {
        rng.pick(&[
            QKind::Contiguous,
            QKind::Strided,
            QKind::SplitSeparate,
            QKind::SplitShared,
        ])
    }
}

/// Host side of a query: the buffers as uploaded (gaps NaN) and the logical values in f64.
#[derive(Clone, Debug)]
pub struct HostQuery<T> {
    /// How it is passed.
    pub kind: QKind,
    /// One buffer, or (nope, rope) for `SplitSeparate`.
    pub bufs: Vec<Vec<T>>,
    /// Layout of the 512 nope values (width 576 for the one-buffer kinds).
    pub nope: Strided,
    /// Layout of the 64 rope values.
    pub rope: Strided,
    /// Query tokens (rows).
    pub tokens: usize,
    /// Heads.
    pub heads: usize,
    /// `[tokens, heads, 576]`, exactly the uploaded values.
    pub values: Vec<f64>,
}

impl<T: Half> HostQuery<T> {
    /// Random values in a random layout of `kind`.
    pub fn random(rng: &mut Rng, kind: QKind, tokens: usize, heads: usize) -> HostQuery<T> {
        let (nope, rope, lens) = match kind {
            QKind::Contiguous => {
                let l = Strided::new(rng, RowsKind::Contiguous, tokens, heads, HEAD_DIM, 8);
                (l, l.shifted(LATENT_DIM, ROPE_DIM), vec![l.len])
            }
            QKind::Strided | QKind::SplitShared => {
                let k = rng.pick(&[RowsKind::Padded, RowsKind::HeadMajor]);
                let l = Strided::new(rng, k, tokens, heads, HEAD_DIM, 8);
                (l, l.shifted(LATENT_DIM, ROPE_DIM), vec![l.len])
            }
            QKind::SplitSeparate => {
                let kn = Strided::random_kind(rng);
                let kr = Strided::random_kind(rng);
                let n = Strided::new(rng, kn, tokens, heads, LATENT_DIM, 8);
                let r = Strided::new(rng, kr, tokens, heads, ROPE_DIM, 8);
                (n, r, vec![n.len, r.len])
            }
        };
        let mut q = HostQuery {
            kind,
            bufs: lens.iter().map(|&n| vec![T::nan(); n]).collect(),
            nope,
            rope,
            tokens,
            heads,
            values: vec![0.0; tokens * heads * HEAD_DIM],
        };
        q.refill(rng);
        q
    }

    /// New random values in the same layout.
    pub fn refill(&mut self, rng: &mut Rng) {
        let rope_buf = self.bufs.len() - 1;
        for t in 0..self.tokens {
            for h in 0..self.heads {
                let row = (t * self.heads + h) * HEAD_DIM;
                for d in 0..HEAD_DIM {
                    let v = T::from_f64(rng.unit());
                    self.values[row + d] = v.to_f64();
                    if d < LATENT_DIM {
                        self.bufs[0][self.nope.at(t, h) + d] = v;
                    } else {
                        self.bufs[rope_buf][self.rope.at(t, h) + d - LATENT_DIM] = v;
                    }
                }
            }
        }
    }

    /// Uploads the buffers.
    pub fn upload(&self, stream: &Arc<CudaStream>) -> DevQuery<T> {
        DevQuery {
            kind: self.kind,
            bufs: self
                .bufs
                .iter()
                .map(|b| stream.clone_htod(b).expect("upload q"))
                .collect(),
            nope: self.nope,
            rope: self.rope,
            heads: self.heads,
        }
    }

    /// The values of heads `heads` only: `[tokens, heads.len(), 576]`.
    pub fn values_of_heads(&self, heads: &[usize]) -> Vec<f64> {
        let mut v = Vec::with_capacity(self.tokens * heads.len() * HEAD_DIM);
        for t in 0..self.tokens {
            for &h in heads {
                let row = (t * self.heads + h) * HEAD_DIM;
                v.extend_from_slice(&self.values[row..row + HEAD_DIM]);
            }
        }
        v
    }
}

/// Device side of a query.
#[derive(Debug)]
pub struct DevQuery<T> {
    kind: QKind,
    bufs: Vec<CudaSlice<T>>,
    nope: Strided,
    rope: Strided,
    heads: usize,
}

impl<T: Half> DevQuery<T> {
    /// The view the decode calls take.
    pub fn view(&self) -> Query<'_, T> {
        let (n, r) = (&self.nope, &self.rope);
        match self.kind {
            QKind::Contiguous => Query::contiguous(self.bufs[0].as_view(), self.heads),
            QKind::Strided => Query::strided(
                self.bufs[0].slice(n.offset..),
                n.token_stride,
                n.head_stride,
            ),
            QKind::SplitShared | QKind::SplitSeparate => {
                let rope_buf = &self.bufs[self.bufs.len() - 1];
                Query::split(
                    self.bufs[0].slice(n.offset..),
                    n.token_stride,
                    n.head_stride,
                    rope_buf.slice(r.offset..),
                    r.token_stride,
                    r.head_stride,
                )
            }
        }
    }

    /// Overwrites the device buffers with `host`'s (same layout), in place.
    pub fn rewrite(&mut self, stream: &Arc<CudaStream>, host: &HostQuery<T>) {
        for (d, h) in self.bufs.iter_mut().zip(&host.bufs) {
            stream.memcpy_htod(h, d).expect("rewrite q");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Outputs

/// A poisoned device output `[tokens, heads, 512]`.
#[derive(Debug)]
pub struct DevOut<T> {
    buf: CudaSlice<T>,
    /// Its layout.
    pub layout: Strided,
}

impl<T: Half> DevOut<T> {
    /// Allocates and poisons a buffer for `layout`.
    pub fn new(stream: &Arc<CudaStream>, layout: Strided) -> DevOut<T> {
        let buf = stream
            .clone_htod(&vec![T::poison(); layout.len])
            .expect("alloc out");
        DevOut { buf, layout }
    }

    /// A random layout of `[tokens, heads, 512]`.
    pub fn random(rng: &mut Rng, stream: &Arc<CudaStream>, tokens: usize, heads: usize) -> Self {
        let kind = Strided::random_kind(rng);
        DevOut::new(
            stream,
            Strided::new(rng, kind, tokens, heads, LATENT_DIM, 8),
        )
    }

    /// Poisons the whole buffer again.
    pub fn poison(&mut self, stream: &Arc<CudaStream>) {
        stream
            .memcpy_htod(&vec![T::poison(); self.layout.len], &mut self.buf)
            .expect("poison out");
    }

    /// The view the decode calls take.
    pub fn view(&mut self) -> Output<'_, T> {
        let l = self.layout;
        match l.kind {
            RowsKind::Contiguous => Output::contiguous(self.buf.as_view_mut(), l.heads),
            _ => Output::strided(
                self.buf.slice_mut(l.offset..),
                l.token_stride,
                l.head_stride,
            ),
        }
    }

    /// The whole buffer (synchronizes).
    pub fn read(&self, stream: &Arc<CudaStream>) -> Vec<T> {
        stream.clone_dtoh(&self.buf).expect("read out")
    }
}

/// A poisoned device lse `[tokens, heads]`.
#[derive(Debug)]
pub struct DevLse {
    buf: CudaSlice<f32>,
    /// Its layout (width 1).
    pub layout: Strided,
}

impl DevLse {
    /// Allocates and poisons (NaN) a buffer for `layout`.
    pub fn new(stream: &Arc<CudaStream>, layout: Strided) -> DevLse {
        let buf = stream
            .clone_htod(&vec![f32::NAN; layout.len])
            .expect("alloc lse");
        DevLse { buf, layout }
    }

    /// A random layout of `[tokens, heads]`.
    pub fn random(rng: &mut Rng, stream: &Arc<CudaStream>, tokens: usize, heads: usize) -> Self {
        let kind = Strided::random_kind(rng);
        DevLse::new(stream, Strided::new(rng, kind, tokens, heads, 1, 1))
    }

    /// Poisons the whole buffer again.
    pub fn poison(&mut self, stream: &Arc<CudaStream>) {
        stream
            .memcpy_htod(&vec![f32::NAN; self.layout.len], &mut self.buf)
            .expect("poison lse");
    }

    /// The view the decode calls take.
    pub fn view(&mut self) -> Lse<'_> {
        let l = self.layout;
        match l.kind {
            RowsKind::Contiguous => Lse::contiguous(self.buf.as_view_mut(), l.heads),
            _ => Lse::strided(
                self.buf.slice_mut(l.offset..),
                l.token_stride,
                l.head_stride,
            ),
        }
    }

    /// The whole buffer (synchronizes).
    pub fn read(&self, stream: &Arc<CudaStream>) -> Vec<f32> {
        stream.clone_dtoh(&self.buf).expect("read lse")
    }
}

/// What one decode produced, read back to the host.
#[derive(Clone, Debug)]
pub struct Outputs<T> {
    /// The whole out buffer.
    pub out: Vec<T>,
    /// Its layout.
    pub out_layout: Strided,
    /// The whole lse buffer and its layout, if lse was requested.
    pub lse: Option<(Vec<f32>, Strided)>,
    /// The 4 words of the error flag after the run.
    pub flag: [u32; 4],
}

impl<T: Half> Outputs<T> {
    /// Reads back `out`, `lse` and `flag` (synchronizes).
    pub fn read(
        stream: &Arc<CudaStream>,
        out: &DevOut<T>,
        lse: Option<&DevLse>,
        flag: &ErrorFlag,
    ) -> Outputs<T> {
        Outputs {
            out: out.read(stream),
            out_layout: out.layout,
            lse: lse.map(|l| (l.read(stream), l.layout)),
            flag: flag.read(stream).expect("read error flag"),
        }
    }

    /// Bits of the logical `[tokens, heads, 512]` out and `[tokens, heads]` lse, for bitwise
    /// comparisons across layouts.
    pub fn logical_bits(&self) -> (Vec<u16>, Vec<u32>) {
        let l = &self.out_layout;
        let mut out = Vec::with_capacity(l.tokens * l.heads * LATENT_DIM);
        let mut lse = Vec::new();
        for t in 0..l.tokens {
            for h in 0..l.heads {
                let i = l.at(t, h);
                out.extend(self.out[i..i + LATENT_DIM].iter().map(|v| v.bits()));
                if let Some((buf, ll)) = &self.lse {
                    lse.push(buf[ll.at(t, h)].to_bits());
                }
            }
        }
        (out, lse)
    }
}

// ---------------------------------------------------------------------------------------------
// The paged cache

/// Host mirror of a paged cache: `num_blocks` blocks of `block_size` rows, blocks `stride`
/// elements apart (the padding between blocks holds NaN).
#[derive(Clone, Debug)]
pub struct HostCache<T> {
    /// The whole buffer as uploaded.
    pub data: Vec<T>,
    /// Blocks.
    pub num_blocks: usize,
    /// Rows per block.
    pub block_size: usize,
    /// Elements between blocks (a multiple of 8, >= block_size*576).
    pub stride: usize,
}

impl<T: Half> HostCache<T> {
    /// Random rows; `pad_elems` (a multiple of 8) of NaN after every block.
    pub fn random(rng: &mut Rng, num_blocks: usize, block_size: usize, pad_elems: usize) -> Self {
        assert_eq!(
            pad_elems % 8,
            0,
            "block padding must keep 16-byte alignment"
        );
        let row_elems = block_size * HEAD_DIM;
        let stride = row_elems + pad_elems;
        let mut data = Vec::with_capacity(num_blocks * stride);
        for _ in 0..num_blocks {
            data.extend((0..row_elems).map(|_| T::from_f64(rng.unit())));
            data.extend(std::iter::repeat_n(T::nan(), pad_elems));
        }
        HostCache {
            data,
            num_blocks,
            block_size,
            stride,
        }
    }

    /// Bytes between blocks.
    pub fn stride_bytes(&self) -> usize {
        self.stride * 2
    }

    /// Global slots.
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    fn row_start(&self, slot: usize) -> usize {
        (slot / self.block_size) * self.stride + (slot % self.block_size) * HEAD_DIM
    }

    /// The 576 values of global slot `slot`.
    pub fn row(&self, slot: usize) -> &[T] {
        let s = self.row_start(slot);
        &self.data[s..s + HEAD_DIM]
    }

    /// The 576 values of global slot `slot`, to write.
    pub fn row_mut(&mut self, slot: usize) -> &mut [T] {
        let s = self.row_start(slot);
        &mut self.data[s..s + HEAD_DIM]
    }

    /// Uploads the whole buffer.
    pub fn upload(&self, stream: &Arc<CudaStream>) -> CudaSlice<T> {
        stream.clone_htod(&self.data).expect("upload cache")
    }

    /// The device view of `dev` (an upload of this cache).
    pub fn view<'a>(&self, dev: &'a CudaSlice<T>) -> KvCache<'a, T> {
        if self.stride == self.block_size * HEAD_DIM {
            // `KvCache::contiguous` derives num_blocks from the length.
            KvCache::contiguous(dev.as_view(), self.block_size)
        } else {
            KvCache::strided(
                dev.as_view(),
                self.block_size,
                self.num_blocks,
                self.stride_bytes(),
            )
        }
    }

    /// Slot `slot` converted to f64, appended to `dst`.
    fn push_row_f64(&self, slot: usize, dst: &mut Vec<f64>) {
        dst.extend(self.row(slot).iter().map(|v| v.to_f64()));
    }
}

// ---------------------------------------------------------------------------------------------
// The reference on repacked inputs

/// Checks that `faults` (from a one-request/one-token reference run) hold BAD_* faults whose
/// values were replaced by `-1`/`-2` markers and restores the original values and row.
fn restore_faults(
    faults: &[Fault],
    row: usize,
    bad_code: u32,
    originals: &[i32],
    dst: &mut Vec<Fault>,
) {
    let mut bad = originals.iter();
    for f in faults {
        let value = if f.code == bad_code {
            *bad.next()
                .expect("reference reported more bad entries than injected")
        } else {
            f.value
        };
        dst.push(Fault {
            code: f.code,
            row: row as u32,
            value,
        });
    }
    assert!(
        bad.next().is_none(),
        "reference skipped a bad entry silently"
    );
}

/// A dense problem over a host cache with padded blocks and a strided block table.
#[derive(Clone, Copy, Debug)]
pub struct DenseInputs<'a, T> {
    /// `[batch*q_len, num_heads, 576]`.
    pub q: &'a [f64],
    /// Requests.
    pub batch: usize,
    /// Query rows per request.
    pub q_len: usize,
    /// Heads of `q`.
    pub num_heads: usize,
    /// The cache.
    pub cache: &'a HostCache<T>,
    /// `[batch, table_stride]`.
    pub table: &'a [i32],
    /// Elements between table rows.
    pub table_stride: usize,
    /// Columns used.
    pub max_blocks_per_seq: usize,
    /// `[batch]`.
    pub seq_lens: &'a [i32],
    /// The scale the device got (as f64).
    pub softmax_scale: f64,
}

/// `reference::dense_decode` of heads `heads` (indices into the device's heads), one request
/// at a time over a compact repack of the blocks it uses (contiguous blocks, table stride =
/// max_blocks_per_seq, bad entries kept bad), so that large caches cost no f64 copy.
pub fn dense_reference<T: Half>(p: &DenseInputs<T>, heads: &[usize]) -> Attention {
    let (bs, mbps, q_len, nh) = (
        p.cache.block_size,
        p.max_blocks_per_seq,
        p.q_len,
        heads.len(),
    );
    let cap = (mbps * bs) as i64;
    let mut res = Attention::empty(p.batch * q_len, nh);
    for b in 0..p.batch {
        let len = (p.seq_lens[b] as i64).clamp(0, cap) as usize;
        let needed = len.div_ceil(bs);
        let nb = needed.max(1);
        let mut data = Vec::with_capacity(nb * bs * HEAD_DIM);
        let mut table = vec![0i32; mbps];
        let mut bad = Vec::new();
        for (j, entry) in table.iter_mut().enumerate().take(needed) {
            let e = p.table[b * p.table_stride + j];
            if e >= 0 && (e as usize) < p.cache.num_blocks {
                *entry = j as i32;
                for r in 0..bs {
                    p.cache.push_row_f64(e as usize * bs + r, &mut data);
                }
            } else {
                *entry = -1;
                bad.push(e);
                data.resize(data.len() + bs * HEAD_DIM, 0.0);
            }
        }
        data.resize(nb * bs * HEAD_DIM, 0.0);
        let mut q = Vec::with_capacity(q_len * nh * HEAD_DIM);
        for i in 0..q_len {
            let r = b * q_len + i;
            for &h in heads {
                let s = (r * p.num_heads + h) * HEAD_DIM;
                q.extend_from_slice(&p.q[s..s + HEAD_DIM]);
            }
        }
        let one = reference::dense_decode(&DenseProblem {
            q: &q,
            batch: 1,
            q_len,
            num_heads: nh,
            cache: PagedCache {
                data: &data,
                num_blocks: nb,
                block_size: bs,
            },
            block_table: &table,
            max_blocks_per_seq: mbps,
            seq_lens: &p.seq_lens[b..b + 1],
            softmax_scale: p.softmax_scale,
        });
        let o = b * q_len * nh;
        res.out[o * LATENT_DIM..(o + q_len * nh) * LATENT_DIM].copy_from_slice(&one.out);
        res.lse[o..o + q_len * nh].copy_from_slice(&one.lse);
        restore_faults(
            &one.faults,
            b,
            fault_code::BAD_BLOCK_ID,
            &bad,
            &mut res.faults,
        );
    }
    res
}

/// A sparse problem over a host cache with padded blocks and strided indices.
#[derive(Clone, Copy, Debug)]
pub struct SparseInputs<'a, T> {
    /// `[num_tokens, num_heads, 576]`.
    pub q: &'a [f64],
    /// Query tokens.
    pub num_tokens: usize,
    /// Heads of `q`.
    pub num_heads: usize,
    /// The cache.
    pub cache: &'a HostCache<T>,
    /// `[num_tokens, indices_stride]` global slot ids.
    pub indices: &'a [i32],
    /// Elements between rows of `indices`.
    pub indices_stride: usize,
    /// Entries per row.
    pub topk: usize,
    /// Optional `[num_tokens]`.
    pub topk_len: Option<&'a [i32]>,
    /// The scale the device got (as f64).
    pub softmax_scale: f64,
}

/// `reference::sparse_decode` of heads `heads`, one token at a time over a compact cache of
/// the rows it lists (one row per entry, in entry order; -1 kept, bad ids kept bad).
pub fn sparse_reference<T: Half>(p: &SparseInputs<T>, heads: &[usize]) -> Attention {
    let nh = heads.len();
    let slots = p.cache.num_slots() as i64;
    let mut res = Attention::empty(p.num_tokens, nh);
    let mut data = Vec::new();
    for t in 0..p.num_tokens {
        let n = p
            .topk_len
            .map_or(p.topk, |l| l[t].clamp(0, p.topk as i32) as usize);
        if n == 0 {
            continue;
        }
        data.clear();
        let mut ids = Vec::with_capacity(n);
        let mut bad = Vec::new();
        for &id in &p.indices[t * p.indices_stride..][..n] {
            if id == -1 {
                ids.push(-1);
            } else if id < 0 || id as i64 >= slots {
                ids.push(-2);
                bad.push(id);
            } else {
                ids.push((data.len() / HEAD_DIM) as i32);
                p.cache.push_row_f64(id as usize, &mut data);
            }
        }
        if data.is_empty() {
            data.resize(HEAD_DIM, 0.0);
        }
        let mut q = Vec::with_capacity(nh * HEAD_DIM);
        for &h in heads {
            let s = (t * p.num_heads + h) * HEAD_DIM;
            q.extend_from_slice(&p.q[s..s + HEAD_DIM]);
        }
        let one = reference::sparse_decode(&SparseProblem {
            q: &q,
            num_tokens: 1,
            num_heads: nh,
            cache: PagedCache {
                data: &data,
                num_blocks: data.len() / HEAD_DIM,
                block_size: 1,
            },
            indices: &ids,
            topk: n,
            topk_len: None,
            softmax_scale: p.softmax_scale,
        });
        res.out[t * nh * LATENT_DIM..(t + 1) * nh * LATENT_DIM].copy_from_slice(&one.out);
        res.lse[t * nh..(t + 1) * nh].copy_from_slice(&one.lse);
        restore_faults(
            &one.faults,
            t,
            fault_code::BAD_SLOT_ID,
            &bad,
            &mut res.faults,
        );
    }
    res
}

/// Rows `[rows, stride]` repacked to `[rows, width]`.
pub fn repack<V: Copy>(v: &[V], rows: usize, stride: usize, width: usize) -> Vec<V> {
    (0..rows)
        .flat_map(|r| v[r * stride..r * stride + width].iter().copied())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Comparisons

fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (g, w) in got.iter().zip(want) {
        num += (g - w) * (g - w);
        den += w * w;
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

/// Checks device outputs against the reference for device heads `heads` (reference head `i` is
/// device head `heads[i]`): per (row, head) relative L2 of the 512 outputs within `T::TOL`,
/// lse within [`LSE_TOL`], empty rows exactly 0 and -inf, never NaN; and that every element
/// outside the views still holds the poison.
pub fn check_outputs<T: Half>(label: &str, got: &Outputs<T>, want: &Attention, heads: &[usize]) {
    assert_eq!(want.num_heads, heads.len(), "{label}: reference head count");
    check_gaps(label, got);
    let l = &got.out_layout;
    assert_eq!(want.rows(), l.tokens, "{label}: reference rows");
    let mut errors = Vec::new();
    let mut worst = (0.0f64, 0usize, 0usize);
    let mut worst_lse = 0.0f64;
    let mut vals = vec![0.0f64; LATENT_DIM];
    for r in 0..l.tokens {
        for (i, &h) in heads.iter().enumerate() {
            let s = l.at(r, h);
            for (v, x) in vals.iter_mut().zip(&got.out[s..s + LATENT_DIM]) {
                *v = x.to_f64();
            }
            let want_lse = want.lse_at(r, i);
            let got_lse = got.lse.as_ref().map(|(b, ll)| b[ll.at(r, h)] as f64);
            if want_lse == f64::NEG_INFINITY {
                if let Some(d) = vals.iter().position(|&v| v != 0.0) {
                    errors.push(format!(
                        "row {r} head {h}: empty attention, out[{d}] = {} (want exactly 0)",
                        vals[d]
                    ));
                }
                if let Some(g) = got_lse {
                    if g != f64::NEG_INFINITY {
                        errors.push(format!(
                            "row {r} head {h}: empty attention, lse = {g} (want -inf)"
                        ));
                    }
                }
                continue;
            }
            if let Some(d) = vals.iter().position(|v| !v.is_finite()) {
                errors.push(format!("row {r} head {h}: out[{d}] = {}", vals[d]));
                continue;
            }
            let e = rel_l2(&vals, want.out_row(r, i));
            if e > worst.0 {
                worst = (e, r, h);
            }
            if e > T::TOL {
                errors.push(format!(
                    "row {r} head {h}: relative L2 error {e:.3e} > {:.0e} (out[0] {} want {})",
                    T::TOL,
                    vals[0],
                    want.out_row(r, i)[0]
                ));
            }
            if let Some(g) = got_lse {
                let d = (g - want_lse).abs();
                worst_lse = worst_lse.max(d);
                if d.is_nan() || d > LSE_TOL {
                    errors.push(format!(
                        "row {r} head {h}: lse {g} want {want_lse} (diff {d:.3e})"
                    ));
                }
            }
        }
    }
    if !errors.is_empty() {
        let n = errors.len();
        errors.truncate(12);
        panic!(
            "{label} ({}): {n} (row, head) mismatches; worst rel L2 {:.3e} at row {} head {}, \
             worst lse diff {worst_lse:.3e}:\n  {}",
            T::DTYPE,
            worst.0,
            worst.1,
            worst.2,
            errors.join("\n  ")
        );
    }
}

/// Every element outside the out/lse views holds the poison.
pub fn check_gaps<T: Half>(label: &str, got: &Outputs<T>) {
    if got.out_layout.kind != RowsKind::Contiguous {
        let covered = got.out_layout.covered();
        if let Some(i) = (0..got.out.len()).find(|&i| !covered[i] && got.out[i].bits() != POISON) {
            panic!(
                "{label}: out element {i} outside the view was overwritten ({:?})",
                got.out_layout
            );
        }
    }
    if let Some((buf, l)) = &got.lse {
        let covered = l.covered();
        if let Some(i) = (0..buf.len()).find(|&i| !covered[i] && !buf[i].is_nan()) {
            panic!("{label}: lse element {i} outside the view was overwritten ({l:?})");
        }
    }
}

/// Compares two device results of the same problem to each other (per (row, head) relative
/// L2 within `T::TOL`, lse within [`LSE_TOL`], empty rows identical).
pub fn check_close_runs<T: Half>(label: &str, a: &Outputs<T>, b: &Outputs<T>) {
    let (la, lb) = (&a.out_layout, &b.out_layout);
    assert_eq!((la.tokens, la.heads), (lb.tokens, lb.heads), "{label}");
    let mut errors = Vec::new();
    for r in 0..la.tokens {
        for h in 0..la.heads {
            let va: Vec<f64> = a.out[la.at(r, h)..][..LATENT_DIM]
                .iter()
                .map(|v| v.to_f64())
                .collect();
            let vb: Vec<f64> = b.out[lb.at(r, h)..][..LATENT_DIM]
                .iter()
                .map(|v| v.to_f64())
                .collect();
            let e = rel_l2(&vb, &va);
            if e.is_nan() || e > T::TOL {
                errors.push(format!("row {r} head {h}: relative L2 {e:.3e}"));
            }
            if let (Some((ba, lla)), Some((bb, llb))) = (&a.lse, &b.lse) {
                let (x, y) = (ba[lla.at(r, h)], bb[llb.at(r, h)]);
                let same_inf = x == f32::NEG_INFINITY && y == f32::NEG_INFINITY;
                if !same_inf && ((x - y).abs() as f64 > LSE_TOL || x.is_nan() || y.is_nan()) {
                    errors.push(format!("row {r} head {h}: lse {x} vs {y}"));
                }
            }
        }
    }
    if !errors.is_empty() {
        let n = errors.len();
        errors.truncate(12);
        panic!(
            "{label}: {n} mismatches between the two device results:\n  {}",
            errors.join("\n  ")
        );
    }
}

/// The flag holds one of `faults` (the first fault a kernel found), or is clear when there
/// are none.
#[track_caller]
pub fn check_flag(label: &str, words: [u32; 4], faults: &[Fault]) {
    if faults.is_empty() {
        assert_eq!(
            words, [0; 4],
            "{label}: the error flag records a fault, the reference none"
        );
        return;
    }
    let hit = faults
        .iter()
        .any(|f| words[0] == f.code && words[1] == f.row && words[2] as i32 == f.value);
    assert!(
        hit && words[3] == 0,
        "{label}: error flag {words:?} is none of the reference's faults {:?}",
        &faults[..faults.len().min(8)]
    );
}

/// The flag holds exactly `(code, row, value)`.
#[track_caller]
pub fn check_flag_is(label: &str, words: [u32; 4], code: u32, row: usize, value: i32) {
    assert_eq!(
        words,
        [code, row as u32, value as u32, 0],
        "{label}: error flag (want code {code}, row {row}, value {value})"
    );
}

// ---------------------------------------------------------------------------------------------
// Dense problems

/// What a dense problem is made of (lengths are used as given, even out of range).
#[derive(Clone, Debug)]
pub struct DenseSpec {
    /// Query rows per request.
    pub q_len: usize,
    /// Heads.
    pub heads: usize,
    /// Rows per block.
    pub block_size: usize,
    /// Block-table columns.
    pub max_blocks_per_seq: usize,
    /// Extra columns between table rows (filled with junk).
    pub table_pad: usize,
    /// Padding after every cache block, in elements (multiple of 8).
    pub block_pad: usize,
    /// Cache blocks no request uses.
    pub spare_blocks: usize,
    /// Junk (bad ids) in the columns past a request's length (else random valid ids).
    pub junk_unused: bool,
    /// seq_lens (batch = its length).
    pub seq_lens: Vec<i32>,
    /// The scale.
    pub scale: f32,
}

/// A dense problem on the host.
#[derive(Clone, Debug)]
pub struct DenseSetup<T> {
    /// Requests.
    pub batch: usize,
    /// Query rows per request.
    pub q_len: usize,
    /// Heads.
    pub heads: usize,
    /// Block-table columns.
    pub mbps: usize,
    /// Elements between table rows.
    pub table_stride: usize,
    /// The cache.
    pub cache: HostCache<T>,
    /// `[batch, table_stride]`.
    pub table: Vec<i32>,
    /// `[batch]`.
    pub seq_lens: Vec<i32>,
    /// The scale.
    pub scale: f32,
}

/// A junk block-table entry: outside `[0, num_blocks)`.
pub fn junk_block(rng: &mut Rng, num_blocks: usize) -> i32 {
    rng.pick(&[
        -1,
        -5,
        i32::MIN,
        i32::MAX,
        num_blocks as i32,
        num_blocks as i32 + 1000,
    ])
}

impl<T: Half> DenseSetup<T> {
    /// Random cache and a shuffled block table for `spec`: every block belongs to at most one
    /// request.
    pub fn build(rng: &mut Rng, spec: &DenseSpec) -> DenseSetup<T> {
        let (bs, mbps) = (spec.block_size, spec.max_blocks_per_seq);
        let cap = (mbps * bs) as i64;
        let needed: Vec<usize> = spec
            .seq_lens
            .iter()
            .map(|&l| ((l as i64).clamp(0, cap) as usize).div_ceil(bs))
            .collect();
        let num_blocks = (needed.iter().sum::<usize>() + spec.spare_blocks).max(1);
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        rng.shuffle(&mut ids);
        let mut next = ids.into_iter();
        let batch = spec.seq_lens.len();
        let stride = mbps + spec.table_pad;
        let mut table = vec![0i32; batch * stride];
        for (b, &need) in needed.iter().enumerate() {
            for j in 0..stride {
                table[b * stride + j] = if j < need {
                    next.next().expect("enough blocks")
                } else if j >= mbps || spec.junk_unused {
                    junk_block(rng, num_blocks)
                } else {
                    rng.below(num_blocks) as i32
                };
            }
        }
        DenseSetup {
            batch,
            q_len: spec.q_len,
            heads: spec.heads,
            mbps,
            table_stride: stride,
            cache: HostCache::random(rng, num_blocks, bs, spec.block_pad),
            table,
            seq_lens: spec.seq_lens.clone(),
            scale: spec.scale,
        }
    }

    /// Query rows.
    pub fn tokens(&self) -> usize {
        self.batch * self.q_len
    }

    /// The plan's shape.
    pub fn shape(&self) -> DenseShape {
        DenseShape {
            batch: self.batch,
            q_len: self.q_len,
            num_heads: self.heads,
            block_size: self.cache.block_size,
            max_blocks_per_seq: self.mbps,
        }
    }

    /// The reference for `q`, heads `heads`.
    pub fn reference(&self, q: &HostQuery<T>, heads: &[usize]) -> Attention {
        dense_reference(
            &DenseInputs {
                q: &q.values,
                batch: self.batch,
                q_len: self.q_len,
                num_heads: self.heads,
                cache: &self.cache,
                table: &self.table,
                table_stride: self.table_stride,
                max_blocks_per_seq: self.mbps,
                seq_lens: &self.seq_lens,
                softmax_scale: self.scale as f64,
            },
            heads,
        )
    }

    /// The block-table view of `dev` (an upload of `self.table`).
    pub fn table_view<'a>(&self, dev: &'a CudaSlice<i32>) -> BlockTable<'a> {
        if self.table_stride == self.mbps {
            BlockTable::new(dev.as_view(), self.batch, self.mbps)
        } else {
            BlockTable::strided(dev.as_view(), self.batch, self.mbps, self.table_stride)
        }
    }
}

/// All heads `0..n`.
pub fn all_heads(n: usize) -> Vec<usize> {
    (0..n).collect()
}

/// Device buffers of a dense problem.
pub struct DenseDev<T> {
    /// The cache.
    pub cache: CudaSlice<T>,
    /// The block table.
    pub table: CudaSlice<i32>,
    /// seq_lens.
    pub seq_lens: CudaSlice<i32>,
}

impl<T: Half> DenseDev<T> {
    /// Uploads `s`.
    pub fn upload(stream: &Arc<CudaStream>, s: &DenseSetup<T>) -> DenseDev<T> {
        DenseDev {
            cache: s.cache.upload(stream),
            table: stream.clone_htod(&s.table).expect("upload table"),
            seq_lens: stream.clone_htod(&s.seq_lens).expect("upload seq_lens"),
        }
    }

    /// One `dense_decode` of `q` into `out` / `lse` with `plan`, over `self.seq_lens`.
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        stream: &Arc<CudaStream>,
        s: &DenseSetup<T>,
        plan: &DecodePlan,
        q: &DevQuery<T>,
        out: &mut DevOut<T>,
        lse: Option<&mut DevLse>,
        flag: Option<&ErrorFlag>,
    ) -> mla_decode::Result<()> {
        let mut lse_view = lse.map(|l| l.view());
        dense_decode(
            stream,
            plan,
            &q.view(),
            &s.cache.view(&self.cache),
            &s.table_view(&self.table),
            &self.seq_lens.as_view(),
            &mut out.view(),
            lse_view.as_mut(),
            s.scale,
            flag,
        )
    }
}

/// Uploads `s` and `q`, plans and decodes once with a fresh flag, and reads everything back.
/// `lse_kind`: `None` runs without lse.
pub fn run_dense<T: Half>(
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    s: &DenseSetup<T>,
    q: &HostQuery<T>,
    lse_kind: Option<RowsKind>,
    options: PlanOptions,
) -> Outputs<T> {
    let dev = DenseDev::upload(stream, s);
    let qd = q.upload(stream);
    let mut out = DevOut::random(rng, stream, s.tokens(), s.heads);
    let mut lse =
        lse_kind.map(|k| DevLse::new(stream, Strided::new(rng, k, s.tokens(), s.heads, 1, 1)));
    let flag = ErrorFlag::new(stream).expect("error flag");
    let plan = DecodePlan::dense(stream, s.shape(), options).expect("dense plan");
    dev.decode(stream, s, &plan, &qd, &mut out, lse.as_mut(), Some(&flag))
        .expect("dense_decode");
    Outputs::read(stream, &out, lse.as_ref(), &flag)
}

// ---------------------------------------------------------------------------------------------
// Sparse problems

/// A sparse problem on the host.
#[derive(Clone, Debug)]
pub struct SparseSetup<T> {
    /// Query tokens.
    pub tokens: usize,
    /// Heads.
    pub heads: usize,
    /// Entries per row.
    pub topk: usize,
    /// The cache.
    pub cache: HostCache<T>,
    /// `[tokens, stride]` (the padding holds junk).
    pub indices: Vec<i32>,
    /// Elements between index rows.
    pub stride: usize,
    /// Optional `[tokens]`.
    pub topk_len: Option<Vec<i32>>,
    /// The scale.
    pub scale: f32,
}

impl<T: Half> SparseSetup<T> {
    /// The plan's shape.
    pub fn shape(&self) -> SparseShape {
        SparseShape {
            num_tokens: self.tokens,
            num_heads: self.heads,
            topk: self.topk,
        }
    }

    /// The reference for `q`, heads `heads`.
    pub fn reference(&self, q: &HostQuery<T>, heads: &[usize]) -> Attention {
        sparse_reference(
            &SparseInputs {
                q: &q.values,
                num_tokens: self.tokens,
                num_heads: self.heads,
                cache: &self.cache,
                indices: &self.indices,
                indices_stride: self.stride,
                topk: self.topk,
                topk_len: self.topk_len.as_deref(),
                softmax_scale: self.scale as f64,
            },
            heads,
        )
    }

    /// The indices view of `dev` (an upload of `self.indices`).
    pub fn indices_view<'a>(&self, dev: &'a CudaSlice<i32>) -> SparseIndices<'a> {
        if self.stride == self.topk {
            SparseIndices::contiguous(dev.as_view(), self.topk)
        } else {
            SparseIndices::strided(dev.as_view(), self.topk, self.stride)
        }
    }
}

/// Device buffers of a sparse problem.
pub struct SparseDev<T> {
    /// The cache.
    pub cache: CudaSlice<T>,
    /// The indices.
    pub indices: CudaSlice<i32>,
    /// topk_len, if any.
    pub topk_len: Option<CudaSlice<i32>>,
}

impl<T: Half> SparseDev<T> {
    /// Uploads `s`.
    pub fn upload(stream: &Arc<CudaStream>, s: &SparseSetup<T>) -> SparseDev<T> {
        SparseDev {
            cache: s.cache.upload(stream),
            indices: stream.clone_htod(&s.indices).expect("upload indices"),
            topk_len: s
                .topk_len
                .as_ref()
                .map(|l| stream.clone_htod(l).expect("upload topk_len")),
        }
    }

    /// A sparse plan for `s`.
    pub fn plan(
        &self,
        stream: &Arc<CudaStream>,
        s: &SparseSetup<T>,
        options: PlanOptions,
    ) -> DecodePlan {
        DecodePlan::sparse(stream, s.shape(), options).expect("sparse plan")
    }

    /// One `sparse_decode`, with `self.topk_len` if any.
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        stream: &Arc<CudaStream>,
        s: &SparseSetup<T>,
        plan: &DecodePlan,
        q: &DevQuery<T>,
        out: &mut DevOut<T>,
        lse: Option<&mut DevLse>,
        flag: Option<&ErrorFlag>,
    ) -> mla_decode::Result<()> {
        let mut lse_view = lse.map(|l| l.view());
        let topk_len = self.topk_len.as_ref().map(|l| l.as_view());
        sparse_decode(
            stream,
            plan,
            &q.view(),
            &s.cache.view(&self.cache),
            &s.indices_view(&self.indices),
            topk_len.as_ref(),
            &mut out.view(),
            lse_view.as_mut(),
            s.scale,
            flag,
        )
    }
}

/// Uploads `s` and `q`, plans and decodes once with a fresh flag, and reads everything back.
pub fn run_sparse<T: Half>(
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    s: &SparseSetup<T>,
    q: &HostQuery<T>,
    lse_kind: Option<RowsKind>,
    options: PlanOptions,
) -> Outputs<T> {
    let dev = SparseDev::upload(stream, s);
    let qd = q.upload(stream);
    let mut out = DevOut::random(rng, stream, s.tokens, s.heads);
    let mut lse =
        lse_kind.map(|k| DevLse::new(stream, Strided::new(rng, k, s.tokens, s.heads, 1, 1)));
    let flag = ErrorFlag::new(stream).expect("error flag");
    let plan = dev.plan(stream, s, options);
    dev.decode(stream, s, &plan, &qd, &mut out, lse.as_mut(), Some(&flag))
        .expect("sparse_decode");
    Outputs::read(stream, &out, lse.as_ref(), &flag)
}

/// A random lse layout kind, or none (lse not requested) one time in five.
pub fn random_lse_kind(rng: &mut Rng) -> Option<RowsKind> {
    if rng.below(5) == 0 {
        None
    } else {
        Some(Strided::random_kind(rng))
    }
}
