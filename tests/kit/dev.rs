//! The device side: one CUDA context per test, uploads of the host mirrors, poisoned
//! outputs, one decode of a dense or sparse problem ([`Problem`], generic over f16/bf16),
//! reading everything back; and [`with_dtype!`] to run one generic body for a dtype chosen at
//! run time.

use std::sync::Arc;

use mla_decode::cudarc::driver::{
    result, CudaContext, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr,
};
use mla_decode::reference::Attention;
use mla_decode::{
    dense_decode, gather_slots, sparse_decode, BlockTable, CacheLayout, DecodePlan, DenseArgs,
    Element, ErrorFlag, GatherArgs, KvCache, KvFormat, Lse, Output, PlanOptions, Query, SparseArgs,
    SparseIndices, Strides, TableShape, HEAD_DIM,
};

use super::check::{check_flag, check_outputs};
use super::host::{
    all_heads, random_lse_kind, short, Half, HostCache, HostQuery, Outputs, QKind, RowsKind,
    Strided,
};
use super::problem::{DenseSetup, GatherSetup, SparseSetup, GATHER_POISON};
use super::rng::Rng;

/// Runs `$body` with the type alias `$t` set to `f16` or `bf16` as the [`DType`] `$dtype`
/// says: one generic body instead of a branch per element type.
///
/// [`DType`]: mla_decode::DType
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            ::mla_decode::DType::F16 => {
                type $t = ::mla_decode::half::f16;
                $body
            }
            ::mla_decode::DType::Bf16 => {
                type $t = ::mla_decode::half::bf16;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;

/// The schedule overrides of an experiment, from the environment (the library reads none;
/// `scripts/gpu-ab.sh` sets these per setting): `MLA_WARPS` (4 or 8), `MLA_BLOCK_M` (8, 16
/// or 32), `MLA_PDL` (0 off, else an OR of 1 = launch attribute, 2 = trigger at the decode
/// CTA's start, 4 = at its last tile; default 5), `MLA_COMBINE_SLICES` (1, 4 or 16),
/// `MLA_MIN_CHUNK` (>= 1), `MLA_SPLIT` (1 flat, 2 within requests), `MLA_PATH` (1 tiles, 2
/// the row kernel), `MLA_FORM` (1 direct, 2 transposed: the 16-bit 8-row 4-warp kernel). Unset or empty: the
/// schedule's choice. A value that is not a number is an error here; one the schedule does
/// not take fails the plan.
pub fn tuning_from_env() -> Result<mla_decode::Tuning, String> {
    let var = |name: &str| -> Result<Option<u32>, String> {
        match std::env::var(name) {
            Ok(v) if !v.trim().is_empty() => v
                .trim()
                .parse::<u32>()
                .map(Some)
                .map_err(|_| format!("{name}: expected a non-negative integer, got `{v}`")),
            _ => Ok(None),
        }
    };
    Ok(mla_decode::Tuning {
        warps: var("MLA_WARPS")?,
        block_m: var("MLA_BLOCK_M")?,
        pdl: var("MLA_PDL")?,
        combine_slices: var("MLA_COMBINE_SLICES")?,
        min_chunk: var("MLA_MIN_CHUNK")?,
        split: var("MLA_SPLIT")?,
        path: var("MLA_PATH")?,
        form: var("MLA_FORM")?,
    })
}

/// Plan options of a test: `sm120_occupancy` and the environment's overrides
/// ([`tuning_from_env`]: run the GPU tests with `MLA_BLOCK_M=32` or `MLA_WARPS=8` so that
/// every tile configuration sees every shape).
pub fn plan_options(sm120_occupancy: bool) -> PlanOptions {
    PlanOptions {
        sm120_occupancy,
        tuning: tuning_from_env().expect("MLA_* tuning variables"),
    }
}

/// Both forms of the 16-bit 8-row 4-warp tile kernel (`Tuning::form`).
pub const FORMS: [u32; 2] = [
    mla_decode::ffi::MLA_FORM_DIRECT,
    mla_decode::ffi::MLA_FORM_TRANSPOSED,
];

/// [`plan_options`] with the 16-bit 8-row 4-warp tile kernel forced in `form` (4 warps, the
/// tile path; 8-row steps then run it whatever their size).
pub fn form_options(sm120_occupancy: bool, form: u32) -> PlanOptions {
    let mut options = plan_options(sm120_occupancy);
    options.tuning.warps = Some(4);
    options.tuning.path = Some(mla_decode::ffi::MLA_PATH_TILES);
    options.tuning.form = Some(form);
    options
}

/// [`plan_options`] with each split rule (docs/DESIGN.md §5.3), named: forced flat, forced
/// within requests (where the schedule allows it), and the schedule's choice.
pub fn split_rule_options(sm120_occupancy: bool) -> [(&'static str, PlanOptions); 3] {
    [
        ("flat", Some(mla_decode::ffi::MLA_SPLIT_FLAT)),
        ("within", Some(mla_decode::ffi::MLA_SPLIT_WITHIN_REQUESTS)),
        ("default", None),
    ]
    .map(|(name, split)| {
        let mut options = plan_options(sm120_occupancy);
        options.tuning.split = split;
        (name, options)
    })
}

// ---------------------------------------------------------------------------------------------
// The device

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
// Queries, outputs

/// Device side of a query.
#[derive(Debug)]
pub struct DevQuery<T> {
    kind: QKind,
    bufs: Vec<CudaSlice<T>>,
    nope: Strided,
    rope: Strided,
    heads: usize,
}

impl<T: Half> HostQuery<T> {
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
}

impl<T: Half> DevQuery<T> {
    /// The view the decode calls take.
    pub fn view(&self) -> Query<'_, T> {
        let (n, r) = (&self.nope, &self.rope);
        match self.kind {
            QKind::Contiguous => Query::contiguous(&self.bufs[0], self.heads),
            QKind::Strided => Query::strided(self.bufs[0].slice(n.offset..), n.strides()),
            QKind::SplitShared | QKind::SplitSeparate => {
                let rope_buf = &self.bufs[self.bufs.len() - 1];
                Query::split(
                    self.bufs[0].slice(n.offset..),
                    n.strides(),
                    rope_buf.slice(r.offset..),
                    r.strides(),
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
            Strided::new(rng, kind, tokens, heads, mla_decode::LATENT_DIM, 8),
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
            RowsKind::Contiguous => Output::contiguous(&mut self.buf, l.heads),
            _ => Output::strided(self.buf.slice_mut(l.offset..), l.strides()),
        }
    }

    /// The whole buffer (synchronizes).
    pub fn read(&self, stream: &Arc<CudaStream>) -> Vec<T> {
        stream.clone_dtoh(&self.buf).expect("read out")
    }

    /// The whole buffer, to build other views over it (e.g. a bad one).
    pub fn raw_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.buf
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
            RowsKind::Contiguous => Lse::contiguous(&mut self.buf, l.heads),
            _ => Lse::strided(self.buf.slice_mut(l.offset..), l.strides()),
        }
    }

    /// The whole buffer (synchronizes).
    pub fn read(&self, stream: &Arc<CudaStream>) -> Vec<f32> {
        stream.clone_dtoh(&self.buf).expect("read lse")
    }

    /// The whole buffer, to build other views over it (e.g. a bad one).
    pub fn raw_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.buf
    }
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
}

impl<T: Half> HostCache<T> {
    /// Uploads the whole buffer.
    pub fn upload(&self, stream: &Arc<CudaStream>) -> CudaSlice<T> {
        stream.clone_htod(&self.data).expect("upload cache")
    }

    /// The device view of `dev` (an upload of this cache).
    pub fn view<'a>(&self, dev: &'a CudaSlice<T>) -> KvCache<'a> {
        if self.stride == self.block_size * HEAD_DIM {
            // `KvCache::contiguous` derives num_blocks from the length.
            KvCache::contiguous(dev, T::DTYPE.kv_format(), self.block_size)
                .expect("contiguous cache view")
        } else {
            KvCache::new(dev, self.layout())
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Problems on the device

/// Device buffers of a dense problem.
pub struct DenseDev<T> {
    /// The cache.
    pub cache: CudaSlice<T>,
    /// The block table.
    pub table: CudaSlice<i32>,
    /// seq_lens.
    pub seq_lens: CudaSlice<i32>,
}

impl<T: Half> DenseSetup<T> {
    /// The block-table view of `dev` (an upload of `self.table`).
    pub fn table_view<'a>(&self, dev: &'a CudaSlice<i32>) -> BlockTable<'a> {
        let shape = TableShape {
            batch: self.batch,
            max_blocks_per_seq: self.mbps,
        };
        if self.table_stride == self.mbps {
            BlockTable::new(dev, shape)
        } else {
            BlockTable::new(dev, shape).with_row_stride(self.table_stride)
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

impl<T: Half> SparseSetup<T> {
    /// The indices view of `dev` (an upload of `self.indices`).
    pub fn indices_view<'a>(&self, dev: &'a CudaSlice<i32>) -> SparseIndices<'a> {
        if self.stride == self.topk {
            SparseIndices::contiguous(dev, self.topk)
        } else {
            SparseIndices::contiguous(dev, self.topk).with_row_stride(self.stride)
        }
    }
}

/// A dense or sparse problem on the host, with what it takes to run it on the device: the
/// tests that do the same for both ([`check_problem`], determinism) are written once over it.
pub trait Problem {
    /// f16 or bf16.
    type Elem: Half;
    /// Its device buffers.
    type Dev;
    /// Query rows (`[rows, heads, 576]` query, `[rows, heads, 512]` output).
    fn rows(&self) -> usize;
    /// Heads.
    fn heads(&self) -> usize;
    /// What a label says about it.
    fn describe(&self) -> String;
    /// Uploads the cache, tables or indices, lengths.
    fn upload(&self, stream: &Arc<CudaStream>) -> Self::Dev;
    /// A plan for its shape.
    fn plan(&self, stream: &Arc<CudaStream>, options: PlanOptions) -> DecodePlan;
    /// One decode call of `q` into `out` / `lse`.
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &self,
        stream: &Arc<CudaStream>,
        dev: &Self::Dev,
        plan: &mut DecodePlan,
        q: &DevQuery<Self::Elem>,
        out: &mut DevOut<Self::Elem>,
        lse: Option<&mut DevLse>,
        flag: Option<&mut ErrorFlag>,
    ) -> mla_decode::Result<()>;
    /// The reference of heads `heads` for `q`.
    fn reference_of(&self, q: &HostQuery<Self::Elem>, heads: &[usize]) -> Attention;
}

impl<T: Half> Problem for DenseSetup<T> {
    type Elem = T;
    type Dev = DenseDev<T>;

    fn rows(&self) -> usize {
        self.tokens()
    }

    fn heads(&self) -> usize {
        self.heads
    }

    fn describe(&self) -> String {
        format!("seq_lens {}", short(&self.seq_lens))
    }

    fn upload(&self, stream: &Arc<CudaStream>) -> DenseDev<T> {
        DenseDev {
            cache: self.cache.upload(stream),
            table: stream.clone_htod(&self.table).expect("upload table"),
            seq_lens: stream.clone_htod(&self.seq_lens).expect("upload seq_lens"),
        }
    }

    fn plan(&self, stream: &Arc<CudaStream>, options: PlanOptions) -> DecodePlan {
        DecodePlan::dense(stream, self.shape(), options).expect("dense plan")
    }

    fn decode(
        &self,
        stream: &Arc<CudaStream>,
        dev: &DenseDev<T>,
        plan: &mut DecodePlan,
        q: &DevQuery<T>,
        out: &mut DevOut<T>,
        lse: Option<&mut DevLse>,
        flag: Option<&mut ErrorFlag>,
    ) -> mla_decode::Result<()> {
        let kv_cache = self.cache.view(&dev.cache);
        self.decode_over(
            stream,
            kv_cache,
            &dev.table,
            &dev.seq_lens,
            plan,
            q,
            (out, lse, flag),
        )
    }

    fn reference_of(&self, q: &HostQuery<T>, heads: &[usize]) -> Attention {
        self.reference(q, heads)
    }
}

impl<T: Half> Problem for SparseSetup<T> {
    type Elem = T;
    type Dev = SparseDev<T>;

    fn rows(&self) -> usize {
        self.tokens
    }

    fn heads(&self) -> usize {
        self.heads
    }

    fn describe(&self) -> String {
        format!(
            "{} slots, topk_len {}",
            self.cache.num_slots(),
            self.topk_len.is_some()
        )
    }

    fn upload(&self, stream: &Arc<CudaStream>) -> SparseDev<T> {
        SparseDev {
            cache: self.cache.upload(stream),
            indices: stream.clone_htod(&self.indices).expect("upload indices"),
            topk_len: self
                .topk_len
                .as_ref()
                .map(|l| stream.clone_htod(l).expect("upload topk_len")),
        }
    }

    fn plan(&self, stream: &Arc<CudaStream>, options: PlanOptions) -> DecodePlan {
        DecodePlan::sparse(stream, self.shape(), options).expect("sparse plan")
    }

    fn decode(
        &self,
        stream: &Arc<CudaStream>,
        dev: &SparseDev<T>,
        plan: &mut DecodePlan,
        q: &DevQuery<T>,
        out: &mut DevOut<T>,
        lse: Option<&mut DevLse>,
        flag: Option<&mut ErrorFlag>,
    ) -> mla_decode::Result<()> {
        let kv_cache = self.cache.view(&dev.cache);
        let lens = dev.topk_len.as_ref();
        self.decode_over(
            stream,
            kv_cache,
            &dev.indices,
            lens,
            plan,
            q,
            (out, lse, flag),
        )
    }

    fn reference_of(&self, q: &HostQuery<T>, heads: &[usize]) -> Attention {
        self.reference(q, heads)
    }
}

/// What a decode writes: the output, the optional lse and the optional flag.
pub type Written<'o, T> = (
    &'o mut DevOut<T>,
    Option<&'o mut DevLse>,
    Option<&'o mut ErrorFlag>,
);

impl<T: Half> DenseSetup<T> {
    /// `dense_decode` of this problem over the cache `kv_cache` (f16/bf16 or fp8: the kit's
    /// problems differ only in it), with the uploaded table and lengths.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_over(
        &self,
        stream: &Arc<CudaStream>,
        kv_cache: KvCache<'_>,
        table: &CudaSlice<i32>,
        seq_lens: &CudaSlice<i32>,
        plan: &mut DecodePlan,
        q: &DevQuery<T>,
        (out, lse, flag): Written<'_, T>,
    ) -> mla_decode::Result<()> {
        let mut lse_view = lse.map(|l| l.view());
        let args = DenseArgs {
            q: q.view(),
            kv_cache,
            block_table: self.table_view(table),
            seq_lens,
            softmax_scale: self.scale,
        };
        dense_decode(
            stream,
            plan,
            &args,
            &mut out.view(),
            lse_view.as_mut(),
            flag,
        )
    }
}

impl<T: Half> SparseSetup<T> {
    /// `sparse_decode` of this problem over the cache `kv_cache`, with the uploaded indices
    /// and optional per-row lengths.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_over(
        &self,
        stream: &Arc<CudaStream>,
        kv_cache: KvCache<'_>,
        indices: &CudaSlice<i32>,
        topk_len: Option<&CudaSlice<i32>>,
        plan: &mut DecodePlan,
        q: &DevQuery<T>,
        (out, lse, flag): Written<'_, T>,
    ) -> mla_decode::Result<()> {
        let mut lse_view = lse.map(|l| l.view());
        let args = SparseArgs {
            q: q.view(),
            kv_cache,
            indices: self.indices_view(indices),
            topk_len: topk_len.map(|l| l as _),
            softmax_scale: self.scale,
        };
        sparse_decode(
            stream,
            plan,
            &args,
            &mut out.view(),
            lse_view.as_mut(),
            flag,
        )
    }
}

/// Uploads `p` and `q`, plans and decodes once with a fresh flag (random out layout; lse of
/// `lse_kind`, none when `None`), and reads everything back.
pub fn run_once<P: Problem>(
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    p: &P,
    q: &HostQuery<P::Elem>,
    lse_kind: Option<RowsKind>,
    options: PlanOptions,
) -> Outputs<P::Elem> {
    let dev = p.upload(stream);
    let qd = q.upload(stream);
    let mut out = DevOut::random(rng, stream, p.rows(), p.heads());
    let mut lse =
        lse_kind.map(|k| DevLse::new(stream, Strided::new(rng, k, p.rows(), p.heads(), 1, 1)));
    let mut flag = ErrorFlag::new(stream).expect("error flag");
    let mut plan = p.plan(stream, options);
    p.decode(
        stream,
        &dev,
        &mut plan,
        &qd,
        &mut out,
        lse.as_mut(),
        Some(&mut flag),
    )
    .expect("decode");
    Outputs::read(stream, &out, lse.as_ref(), &flag)
}

/// Runs `p` with a random query layout, out layout and lse layout (or none), and compares
/// the flag and every (row, head) with the reference.
pub fn check_problem<P: Problem>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    p: &P,
    options: PlanOptions,
) {
    check_problem_scaled(label, rng, stream, p, options, 1.0);
}

/// [`check_problem`] with the random query multiplied by `q_mag`, a power of two that keeps
/// every query value a normal number of its type (so the uploaded values stay exactly the
/// reference's): queries far from 1.
pub fn check_problem_scaled<P: Problem>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    p: &P,
    options: PlanOptions,
    q_mag: f64,
) {
    check_problem_with(label, rng, stream, p, options, |_, q| {
        if q_mag != 1.0 {
            q.scale_by(q_mag);
        }
    });
}

/// [`check_problem`] with the random query changed by `edit` before the run (which must keep
/// `values` equal to the buffers' values).
pub fn check_problem_with<P: Problem>(
    label: &str,
    rng: &mut Rng,
    stream: &Arc<CudaStream>,
    p: &P,
    options: PlanOptions,
    edit: impl FnOnce(&mut Rng, &mut HostQuery<P::Elem>),
) {
    let kind = QKind::random(rng);
    let mut q = HostQuery::<P::Elem>::random(rng, kind, p.rows(), p.heads());
    edit(rng, &mut q);
    let lse_kind = random_lse_kind(rng);
    let got = run_once(rng, stream, p, &q, lse_kind, options);
    let heads = all_heads(p.heads());
    let want = p.reference_of(&q, &heads);
    let label = format!(
        "{label} [{}; q {kind:?}, out {:?}, lse {lse_kind:?}, {}]",
        <P::Elem as mla_decode::Element>::DTYPE,
        got.out_layout.kind,
        p.describe()
    );
    check_flag(&label, got.flag, &want.faults);
    check_outputs(&label, &got, &want, &heads);
}

/// A cache buffer for calls that need a cache descriptor but read no cache rows (the gather
/// bounds block ids by the layout it is given, and checks only its device and geometry).
pub fn cache_bytes(stream: &Arc<CudaStream>, _layout: &CacheLayout) -> CudaSlice<u8> {
    // The gather checks only the descriptor's device and geometry (it never touches the
    // cache's bytes), so a 16-byte buffer describes any cache.
    stream.alloc_zeros::<u8>(16).expect("alloc cache bytes")
}

/// Runs the gather of `g` on the device into a poisoned `[tokens, out_stride]` buffer;
/// returns the whole buffer and the flag.
pub fn run_gather(stream: &Arc<CudaStream>, g: &GatherSetup) -> (Vec<i32>, [u32; 4]) {
    run_gather_with_tail(stream, g, 0)
}

/// [`run_gather`] from buffers preallocated `tail` tokens longer than `g.tokens` (the call's
/// `num_tokens`): positions and req_id hold copies of token 0 there (gathering them would
/// write the output's tail), the output `tail` more rows of poison.
pub fn run_gather_with_tail(
    stream: &Arc<CudaStream>,
    g: &GatherSetup,
    tail: usize,
) -> (Vec<i32>, [u32; 4]) {
    let mut positions = g.positions.clone();
    let mut req_id = g.req_id.clone();
    for _ in 0..tail {
        positions.extend_from_within(..g.pos_stride);
        req_id.push(g.req_id[0]);
    }
    let positions = stream.clone_htod(&positions).unwrap();
    let req = stream.clone_htod(&req_id).unwrap();
    let table = stream.clone_htod(&g.table).unwrap();
    let lens = stream.clone_htod(&g.seq_lens).unwrap();
    let cache = cache_bytes(stream, &g.cache_layout());
    let mut out = stream
        .clone_htod(&vec![GATHER_POISON; g.out_len() + tail * g.out_stride])
        .unwrap();
    let mut flag = ErrorFlag::new(stream).unwrap();
    let args = GatherArgs {
        positions: &positions,
        positions_stride: g.pos_stride,
        req_id: &req,
        block_table: g.table_view(&table),
        seq_lens: &lens,
        kv_cache: KvCache::new(&cache, g.cache_layout()),
        topk: g.topk,
        num_tokens: g.tokens,
        out_stride: g.out_stride,
    };
    gather_slots(stream, &args, &mut out, Some(&mut flag)).unwrap();
    (stream.clone_dtoh(&out).unwrap(), flag.read(stream).unwrap())
}

impl GatherSetup {
    /// The block-table view of `dev` (an upload of `self.table`).
    pub fn table_view<'a>(&self, dev: &'a CudaSlice<i32>) -> BlockTable<'a> {
        let shape = TableShape {
            batch: self.batch,
            max_blocks_per_seq: self.mbps,
        };
        BlockTable::new(dev, shape).with_row_stride(self.table_stride)
    }
}

// ---------------------------------------------------------------------------------------------
// Caches past 4 GiB

/// A far cache's blocks start past this many bytes, so that every row's byte offset (and in
/// a 16-bit cache its element offset, past 2^31) needs 64 bits.
pub const FAR_BYTES: usize = 1 << 32;

/// Blocks to put before a cache of `stride_bytes`-byte blocks so that its first block starts
/// past [`FAR_BYTES`].
pub fn far_shift(stride_bytes: usize) -> usize {
    FAR_BYTES / stride_bytes + 1
}

/// `host` (blocks `stride` elements apart) uploaded after `shift` blocks of 0xff bytes (NaN
/// in every format): block b of `host` is block `shift + b` of the buffer.
pub fn upload_far<E: DeviceRepr>(
    stream: &Arc<CudaStream>,
    host: &[E],
    stride: usize,
    shift: usize,
) -> CudaSlice<E> {
    let len = shift * stride + host.len();
    // SAFETY: every byte is written below before any use.
    let mut dev = unsafe { stream.alloc::<E>(len) }.expect("allocate a cache past 4 GiB");
    {
        let (ptr, _sync) = dev.device_ptr_mut(stream);
        // SAFETY: `ptr` addresses `len` elements of `dev`, on `stream`.
        unsafe { result::memset_d8_async(ptr, 0xff, len * size_of::<E>(), stream.cu_stream()) }
            .expect("fill the cache");
    }
    stream
        .memcpy_htod(host, &mut dev.slice_mut(shift * stride..))
        .expect("upload the cache's blocks");
    dev
}
