//! Host-side checks of every call, as pure functions over numbers (lengths, strides,
//! addresses, device ordinals), so that they run, and are tested, without a GPU.
//!
//! The safe calls describe their arguments with the structs below and run these checks
//! before any kernel launch. Every failure is [`Error::InvalidArgument`] whose `arg` is a
//! parameter of the call that was made, or a field of its argument struct: the lists
//! [`DENSE_ARGS`], [`SPARSE_ARGS`], [`APPEND_ARGS`], [`GATHER_ARGS`], [`DENSE_SHAPE_ARGS`]
//! and [`SPARSE_SHAPE_ARGS`] name them all.

use crate::error::{Error, Result};
use crate::plan::{DenseShape, PlanKind, SparseShape};
use crate::types::{
    DType, KvFormat, ScaleRule, BLOCK_SIZES, HEAD_DIM, LATENT_DIM, MAX_GATHER_TOKENS, MAX_HEADS,
    MAX_Q_LEN, MAX_TOPK, ROPE_DIM,
};

const I32_MAX: usize = i32::MAX as usize;
const I64_MAX: usize = i64::MAX as usize;

/// What an [`Error::InvalidArgument`] from [`dense`] may name: the parameters of
/// [`dense_decode`](crate::dense_decode) and the fields of [`DenseArgs`](crate::DenseArgs).
pub const DENSE_ARGS: &[&str] = &[
    "plan",
    "q",
    "kv_cache",
    "block_table",
    "seq_lens",
    "softmax_scale",
    "out",
    "lse",
    "error_flag",
];
/// What an [`Error::InvalidArgument`] from [`sparse`] may name: the parameters of
/// [`sparse_decode`](crate::sparse_decode) and the fields of [`SparseArgs`](crate::SparseArgs).
pub const SPARSE_ARGS: &[&str] = &[
    "plan",
    "q",
    "kv_cache",
    "indices",
    "topk_len",
    "softmax_scale",
    "out",
    "lse",
    "error_flag",
];
/// What an [`Error::InvalidArgument`] from [`append`] may name: the parameters of
/// [`append_kv`](crate::append_kv) and the fields of [`AppendArgs`](crate::AppendArgs).
pub const APPEND_ARGS: &[&str] = &[
    "kv",
    "kv_token_stride",
    "slot_mapping",
    "num_tokens",
    "scale_rule",
    "kv_cache",
    "error_flag",
];
/// What an [`Error::InvalidArgument`] from [`append_split`] may name: the parameters of
/// [`append_kv_split`](crate::append_kv_split) and the fields of
/// [`AppendSplitArgs`](crate::AppendSplitArgs).
pub const APPEND_SPLIT_ARGS: &[&str] = &[
    "kv_nope",
    "kv_nope_token_stride",
    "kv_rope",
    "kv_rope_token_stride",
    "slot_mapping",
    "num_tokens",
    "scale_rule",
    "kv_cache",
    "error_flag",
];
/// What an [`Error::InvalidArgument`] from [`gather`] may name: the parameters of
/// [`gather_slots`](crate::gather_slots) and the fields of [`GatherArgs`](crate::GatherArgs).
pub const GATHER_ARGS: &[&str] = &[
    "positions",
    "positions_stride",
    "req_id",
    "block_table",
    "seq_lens",
    "kv_cache",
    "topk",
    "num_tokens",
    "out",
    "out_stride",
    "error_flag",
];
/// What an [`Error::InvalidArgument`] from [`dense_shape`] may name: the fields of
/// [`DenseShape`].
pub const DENSE_SHAPE_ARGS: &[&str] = &[
    "batch",
    "q_len",
    "num_heads",
    "block_size",
    "max_blocks_per_seq",
    "kv_format",
];
/// What an [`Error::InvalidArgument`] from [`sparse_shape`] may name: the fields of
/// [`SparseShape`].
pub const SPARSE_SHAPE_ARGS: &[&str] = &["num_tokens", "num_heads", "topk", "kv_format"];

/// A device buffer as the checks see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buf {
    /// Device address of element 0.
    pub addr: u64,
    /// Size in bytes.
    pub bytes: usize,
    /// Ordinal of the device holding it.
    pub device: usize,
}

/// A strided `[tokens, heads, width]` view (strides in elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    /// The buffer.
    pub buf: Buf,
    /// Elements from one token to the next.
    pub token_stride: usize,
    /// Elements from one head to the next.
    pub head_stride: usize,
    /// Head count the view was built for (`contiguous` constructors), if any.
    pub num_heads: Option<usize>,
}

/// A query, packed (576 wide) or split (512 + 64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryDesc {
    /// One tensor of 576-wide rows.
    Packed(Rows),
    /// Nope (512-wide) and rope (64-wide) tensors.
    Split {
        /// The 512-wide part.
        nope: Rows,
        /// The 64-wide part.
        rope: Rows,
    },
}

/// A paged cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheDesc {
    /// The buffer.
    pub buf: Buf,
    /// How rows are stored.
    pub format: KvFormat,
    /// Blocks.
    pub num_blocks: usize,
    /// Rows per block.
    pub block_size: usize,
    /// Bytes between blocks.
    pub block_stride_bytes: usize,
    /// The per-tensor fp32 scale ([`KvFormat::Fp8PerTensor`] only).
    pub scale: Option<Buf>,
    /// The element type of the buffer the cache view was made from, where that is f16 or
    /// bf16 (`None`: bytes or another type): an f16/bf16 format must name the same one.
    pub elem: Option<DType>,
}

/// A block table `[batch, stride]` int32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableDesc {
    /// The buffer.
    pub buf: Buf,
    /// Requests.
    pub batch: usize,
    /// Block ids used per request.
    pub max_blocks_per_seq: usize,
    /// Elements between rows.
    pub stride: usize,
}

/// Sparse indices `[tokens, stride]` int32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndicesDesc {
    /// The indices buffer.
    pub buf: Buf,
    /// Entries per row.
    pub topk: usize,
    /// Elements between rows.
    pub stride: usize,
}

/// What a call needs to know about a [`DecodePlan`](crate::DecodePlan).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanDesc {
    /// Dense or sparse, and the shape (with the cache format) it was made for.
    pub kind: PlanKind,
    /// Device ordinal it was made on.
    pub device: usize,
}

/// Every argument of a dense decode.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DenseCall {
    /// Ordinal of the stream's device.
    pub device: usize,
    /// Element type of q and out.
    pub dtype: DType,
    /// The plan.
    pub plan: PlanDesc,
    /// `q`.
    pub q: QueryDesc,
    /// `kv_cache`.
    pub kv_cache: CacheDesc,
    /// `block_table`.
    pub block_table: TableDesc,
    /// `seq_lens` (i32, `batch` values).
    pub seq_lens: Buf,
    /// `out` (512 wide).
    pub out: Rows,
    /// `lse` (f32), if requested.
    pub lse: Option<Rows>,
    /// `softmax_scale`.
    pub softmax_scale: f32,
    /// The error flag, if any.
    pub error_flag: Option<Buf>,
}

/// A cache append whose new rows come in two tensors
/// ([`append_kv_split`](crate::append_kv_split)): `rows.kv` holds each row's 512 latent values
/// (`rows.kv_token_stride` elements apart; errors name them `kv_nope` and
/// `kv_nope_token_stride`), `kv_rope` its 64 RoPE values.
#[derive(Clone, Debug)]
pub struct AppendSplitCall {
    /// The append, with `kv` the latent part.
    pub rows: AppendCall,
    /// `kv_rope`: the RoPE part.
    pub kv_rope: Buf,
    /// Elements between rows of `kv_rope`.
    pub kv_rope_token_stride: usize,
}

/// Every argument of a sparse decode.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SparseCall {
    /// Ordinal of the stream's device.
    pub device: usize,
    /// Element type of q and out.
    pub dtype: DType,
    /// The plan.
    pub plan: PlanDesc,
    /// `q`.
    pub q: QueryDesc,
    /// `kv_cache`.
    pub kv_cache: CacheDesc,
    /// `indices`.
    pub indices: IndicesDesc,
    /// `topk_len` (i32, `num_tokens` values), if given.
    pub topk_len: Option<Buf>,
    /// `out` (512 wide).
    pub out: Rows,
    /// `lse` (f32), if requested.
    pub lse: Option<Rows>,
    /// `softmax_scale`.
    pub softmax_scale: f32,
    /// The error flag, if any.
    pub error_flag: Option<Buf>,
}

/// Every argument of a cache append.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendCall {
    /// Ordinal of the stream's device.
    pub device: usize,
    /// Element type of kv.
    pub dtype: DType,
    /// `kv`: new 576-wide rows.
    pub kv: Buf,
    /// Elements between rows of `kv`.
    pub kv_token_stride: usize,
    /// `slot_mapping` (int64).
    pub slot_mapping: Buf,
    /// Rows to append.
    pub num_tokens: usize,
    /// How an fp8 cache with per-tile scales picks them.
    pub scale_rule: Option<ScaleRule>,
    /// `kv_cache`.
    pub kv_cache: CacheDesc,
    /// The error flag, if any.
    pub error_flag: Option<Buf>,
}

/// Every argument of an index gather.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherCall {
    /// Ordinal of the stream's device.
    pub device: usize,
    /// `positions` `[num_tokens, positions_stride]` int32.
    pub positions: Buf,
    /// Elements between rows of `positions`.
    pub positions_stride: usize,
    /// `req_id[num_tokens]` int32.
    pub req_id: Buf,
    /// `block_table`.
    pub block_table: TableDesc,
    /// `seq_lens[batch]` int32.
    pub seq_lens: Buf,
    /// The cache the slot ids are for (its blocks and block size).
    pub kv_cache: CacheDesc,
    /// Entries per row.
    pub topk: usize,
    /// Query tokens.
    pub num_tokens: usize,
    /// `out` `[num_tokens, out_stride]` int32.
    pub out: Buf,
    /// Elements between rows of `out`.
    pub out_stride: usize,
    /// The error flag, if any.
    pub error_flag: Option<Buf>,
}

fn bad(arg: &'static str, reason: impl Into<String>) -> Error {
    Error::invalid(arg, reason)
}

/// In test builds, asserts that an `InvalidArgument` names one of `names`: every test that
/// reaches a rejection checks it, and `rejections_name_the_call_arguments` reaches them all.
fn named(names: &[&str], r: Result<()>) -> Result<()> {
    if cfg!(test) {
        if let Err(Error::InvalidArgument { arg, reason }) = &r {
            assert!(
                names.contains(arg),
                "`{arg}` ({reason}) is not one of {names:?}"
            );
        }
    }
    r
}

fn in_range(arg: &'static str, v: usize, lo: usize, hi: usize) -> Result<()> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(bad(arg, format!("{v} outside {lo}..={hi}")))
    }
}

fn block_size(arg: &'static str, v: usize) -> Result<()> {
    if BLOCK_SIZES.contains(&v) {
        Ok(())
    } else {
        Err(bad(
            arg,
            format!("block_size {v}: want one of {BLOCK_SIZES:?}"),
        ))
    }
}

/// `softmax_scale` must be finite and > 0.
pub fn softmax_scale(scale: f32) -> Result<()> {
    if scale.is_finite() && scale > 0.0 {
        Ok(())
    } else {
        Err(bad(
            "softmax_scale",
            format!("{scale} (want finite and > 0)"),
        ))
    }
}

/// Checks the shape a dense plan is made for.
pub fn dense_shape(s: &DenseShape) -> Result<()> {
    named(DENSE_SHAPE_ARGS, dense_shape_inner(s))
}

fn dense_shape_inner(s: &DenseShape) -> Result<()> {
    in_range("batch", s.batch, 1, I32_MAX)?;
    in_range("q_len", s.q_len, 1, MAX_Q_LEN)?;
    in_range("num_heads", s.num_heads, 1, MAX_HEADS)?;
    block_size("block_size", s.block_size)?;
    // the plan counts 32-row tiles in int32: max_len + 31 and the batch's tiles must fit
    in_range(
        "max_blocks_per_seq",
        s.max_blocks_per_seq,
        1,
        (I32_MAX - 31) / s.block_size,
    )?;
    in_range("batch", s.batch * s.q_len, 1, I32_MAX)?;
    tiles_fit("batch", s.batch, s.max_blocks_per_seq * s.block_size)
}

/// The plan's total of 32-row tiles, `rows · ceil(len / 32)`, must fit an int32.
fn tiles_fit(arg: &'static str, rows: usize, len: usize) -> Result<()> {
    let tiles = rows.saturating_mul(len.div_ceil(32));
    if tiles > I32_MAX {
        return Err(bad(
            arg,
            format!("{rows} rows of up to {len} cache rows: {tiles} tiles of 32 rows, want <= {I32_MAX}"),
        ));
    }
    Ok(())
}

/// Checks the shape a sparse plan is made for.
pub fn sparse_shape(s: &SparseShape) -> Result<()> {
    named(SPARSE_SHAPE_ARGS, sparse_shape_inner(s))
}

fn sparse_shape_inner(s: &SparseShape) -> Result<()> {
    in_range("num_tokens", s.num_tokens, 1, I32_MAX)?;
    in_range("num_heads", s.num_heads, 1, MAX_HEADS)?;
    in_range("topk", s.topk, 1, MAX_TOPK)?;
    tiles_fit("num_tokens", s.num_tokens, s.topk)
}

fn on_device(arg: &'static str, buf: &Buf, device: usize) -> Result<()> {
    if buf.device == device {
        Ok(())
    } else {
        Err(bad(
            arg,
            format!(
                "lives on device {}, the stream is on device {device}",
                buf.device
            ),
        ))
    }
}

fn holds(arg: &'static str, buf: &Buf, elems: usize, elem_bytes: usize, what: &str) -> Result<()> {
    let need = elems.checked_mul(elem_bytes);
    match need {
        Some(n) if n <= buf.bytes => Ok(()),
        _ => Err(bad(
            arg,
            format!(
                "holds {} elements, {what} needs {elems}",
                buf.bytes / elem_bytes
            ),
        )),
    }
}

fn flag(f: Option<&Buf>, device: usize) -> Result<()> {
    match f {
        Some(b) => {
            on_device("error_flag", b, device)?;
            holds("error_flag", b, 4, 4, "the flag")
        }
        None => Ok(()),
    }
}

/// Span in elements of a `[tokens, heads, width]` view, or `None` on overflow.
fn span(r: &Rows, tokens: usize, heads: usize, width: usize) -> Option<usize> {
    let t = (tokens - 1).checked_mul(r.token_stride)?;
    let h = (heads - 1).checked_mul(r.head_stride)?;
    t.checked_add(h)?.checked_add(width)
}

/// What a `[tokens, heads, width]` view must satisfy besides its length.
#[derive(Clone, Copy)]
struct Need {
    arg: &'static str,
    /// Prefix of the reason: which part of the argument (a split query's `"q_nope: "`).
    part: &'static str,
    width: usize,
    elem: usize,
    /// Base and used strides are 16-byte multiples.
    align16: bool,
    /// No two rows overlap (written views).
    output: bool,
}

impl Need {
    fn input(arg: &'static str, width: usize, elem: usize) -> Need {
        Need {
            arg,
            part: "",
            width,
            elem,
            align16: true,
            output: false,
        }
    }
}

/// Checks view `r` of shape `[tokens, heads, need.width]`.
fn rows(r: &Rows, need: Need, tokens: usize, heads: usize, device: usize) -> Result<()> {
    let Need {
        arg,
        part,
        width,
        elem,
        align16,
        output,
    } = need;
    let err = |reason: String| bad(arg, format!("{part}{reason}"));
    on_device(arg, &r.buf, device).map_err(|e| match e {
        Error::InvalidArgument { reason, .. } => err(reason),
        e => e,
    })?;
    if let Some(h) = r.num_heads {
        if h != heads {
            return Err(err(format!("made for {h} heads, the plan has {heads}")));
        }
    }
    // A dimension of size 1 never uses its stride (C ignores it too, and the call passes it
    // on as it is); the others must fit an i64 in bytes.
    for (name, s, n) in [
        ("token", r.token_stride, tokens),
        ("head", r.head_stride, heads),
    ] {
        if n > 1 && s > I64_MAX / elem {
            return Err(err(format!("{name} stride {s} too large")));
        }
    }
    if align16 {
        if r.buf.addr % 16 != 0 {
            return Err(err(format!(
                "address {:#x} is not 16-byte aligned",
                r.buf.addr
            )));
        }
        for (name, s, n) in [
            ("token", r.token_stride, tokens),
            ("head", r.head_stride, heads),
        ] {
            if n > 1 && (s * elem) % 16 != 0 {
                return Err(err(format!(
                    "{name} stride {s} elements = {} bytes, not a multiple of 16",
                    s * elem
                )));
            }
        }
    }
    let what = format!(
        "[{tokens}, {heads}, {width}] with strides ({}, {})",
        r.token_stride, r.head_stride
    );
    match span(r, tokens, heads, width) {
        Some(n) if n.checked_mul(elem).is_some_and(|b| b <= r.buf.bytes) => {}
        Some(n) => {
            return Err(err(format!(
                "holds {} elements, {what} needs {n}",
                r.buf.bytes / elem
            )))
        }
        None => return Err(err(format!("{what} overflows"))),
    }
    if !output {
        // A read view steps each used dimension by 0 (every index reads the same row) or by at
        // least the row's width: a shorter step would read the next row's elements as this
        // row's (a 512-wide q_nope passed as packed 576-wide rows). As in C.
        for (name, s, n) in [
            ("token", r.token_stride, tokens),
            ("head", r.head_stride, heads),
        ] {
            if n > 1 && s != 0 && s < width {
                return Err(err(format!(
                    "{what}: the {name} stride is shorter than a row of {width}"
                )));
            }
        }
    }
    if output {
        // Sufficient for no overlap: sorted by stride, each dimension steps past all the
        // inner ones.
        let mut dims = [(r.head_stride, heads), (r.token_stride, tokens)];
        dims.sort_unstable();
        let mut inner = width;
        for (stride, n) in dims {
            if n > 1 {
                if stride < inner {
                    return Err(err(format!("{what}: rows overlap")));
                }
                inner += stride * (n - 1);
            }
        }
    }
    Ok(())
}

fn query(q: &QueryDesc, tokens: usize, heads: usize, elem: usize, device: usize) -> Result<()> {
    match q {
        QueryDesc::Packed(r) => rows(r, Need::input("q", HEAD_DIM, elem), tokens, heads, device),
        QueryDesc::Split { nope, rope } => {
            let nope_need = Need {
                part: "q_nope: ",
                ..Need::input("q", LATENT_DIM, elem)
            };
            rows(nope, nope_need, tokens, heads, device)?;
            if rope.buf.addr == nope.buf.addr {
                return Err(bad(
                    "q",
                    "q_rope starts where q_nope does (packed 576-wide rows: use the packed query, \
                     or a q_rope view 512 elements in)"
                        .to_string(),
                ));
            }
            let rope_need = Need {
                part: "q_rope: ",
                ..Need::input("q", ROPE_DIM, elem)
            };
            rows(rope, rope_need, tokens, heads, device)
        }
    }
}

fn outputs(
    out: &Rows,
    lse: Option<&Rows>,
    tokens: usize,
    heads: usize,
    elem: usize,
    device: usize,
) -> Result<()> {
    let out_need = Need {
        output: true,
        ..Need::input("out", LATENT_DIM, elem)
    };
    rows(out, out_need, tokens, heads, device)?;
    if let Some(l) = lse {
        let lse_need = Need {
            align16: false,
            output: true,
            ..Need::input("lse", 1, 4)
        };
        rows(l, lse_need, tokens, heads, device)?;
    }
    Ok(())
}

/// Checks a cache descriptor; every error names `kv_cache`. `slot_ids`: global slot ids
/// (`num_blocks · block_size`) must fit int32.
fn cache(c: &CacheDesc, device: usize, slot_ids: bool) -> Result<()> {
    const ARG: &str = "kv_cache";
    on_device(ARG, &c.buf, device)?;
    if let (Some(e), Some(d)) = (c.elem, c.format.dtype()) {
        if e != d {
            return Err(bad(
                ARG,
                format!(
                    "declared {}, but its buffer holds {e} elements: declare the format of the rows it holds",
                    c.format
                ),
            ));
        }
    }
    cache_geometry(c, slot_ids)?;
    cache_storage(c, device)
}

/// The cache's block count and size (what the gather reads of it).
fn cache_geometry(c: &CacheDesc, slot_ids: bool) -> Result<()> {
    const ARG: &str = "kv_cache";
    block_size(ARG, c.block_size)?;
    if c.num_blocks == 0 {
        return Err(bad(
            ARG,
            format!(
                "no whole block of {} {} rows in {} bytes",
                c.block_size, c.format, c.buf.bytes
            ),
        ));
    }
    if c.num_blocks > I32_MAX {
        return Err(bad(
            ARG,
            format!("{} blocks: want <= {I32_MAX}", c.num_blocks),
        ));
    }
    if slot_ids && c.num_blocks > I32_MAX / c.block_size {
        return Err(bad(
            ARG,
            format!(
                "{} blocks of {} rows: want num_blocks * block_size <= {I32_MAX} (slot ids are int32)",
                c.num_blocks, c.block_size
            ),
        ));
    }
    Ok(())
}

/// The cache's bytes: stride, alignment, size and scale (what decode and append touch).
fn cache_storage(c: &CacheDesc, device: usize) -> Result<()> {
    const ARG: &str = "kv_cache";
    let block_bytes = c.block_size * c.format.row_bytes();
    if c.block_stride_bytes < block_bytes
        || c.block_stride_bytes % 16 != 0
        || c.block_stride_bytes > I64_MAX
    {
        return Err(bad(
            ARG,
            format!(
                "block stride {} bytes: want a multiple of 16 in block_size*row_bytes = {block_bytes} ({})..=i64::MAX",
                c.block_stride_bytes, c.format
            ),
        ));
    }
    if c.buf.addr % 16 != 0 {
        return Err(bad(
            ARG,
            format!("address {:#x} is not 16-byte aligned", c.buf.addr),
        ));
    }
    let need = (c.num_blocks - 1)
        .checked_mul(c.block_stride_bytes)
        .and_then(|n| n.checked_add(block_bytes));
    match need {
        Some(n) if n <= c.buf.bytes => {}
        _ => {
            return Err(bad(
                ARG,
                format!(
                    "holds {} bytes, {} blocks {} bytes apart need {}",
                    c.buf.bytes,
                    c.num_blocks,
                    c.block_stride_bytes,
                    need.map_or("more".to_string(), |n| n.to_string())
                ),
            ))
        }
    }
    match (c.format.needs_tensor_scale(), &c.scale) {
        (true, None) => Err(bad(
            ARG,
            format!("a {} cache needs its scale (KvCache::with_scale)", c.format),
        )),
        (false, Some(_)) => Err(bad(
            ARG,
            format!(
                "has a per-tensor scale, which a {} cache does not use",
                c.format
            ),
        )),
        (true, Some(s)) => {
            on_device(ARG, s, device).map_err(|_| {
                bad(
                    ARG,
                    format!(
                        "its scale lives on device {}, the stream is on device {device}",
                        s.device
                    ),
                )
            })?;
            if s.bytes < 4 || s.addr % 4 != 0 {
                return Err(bad(
                    ARG,
                    format!(
                        "its scale: {} bytes at {:#x}, want one 4-byte-aligned f32",
                        s.bytes, s.addr
                    ),
                ));
            }
            Ok(())
        }
        (false, None) => Ok(()),
    }
}

/// Which (cache format, query dtype) pairs the decode kernels read: an f16/bf16 cache with
/// queries of its dtype, an fp8 cache (fp8_ds_mla, per-tensor fp8) with f16 or bf16 queries.
/// The one place that grows with the formats.
fn decode_kernel(format: KvFormat, dtype: DType) -> Result<()> {
    match (format, dtype) {
        (KvFormat::F16, DType::F16) | (KvFormat::Bf16, DType::Bf16) => Ok(()),
        (KvFormat::F16 | KvFormat::Bf16, _) => Err(bad(
            "kv_cache",
            format!("a {format} cache read with {dtype} queries: an f16/bf16 cache must have the query dtype"),
        )),
        (KvFormat::Fp8DsMla | KvFormat::Fp8PerTensor, DType::F16 | DType::Bf16) => Ok(()),
    }
}

/// Which (cache format, row dtype, scale rule) triples the append kernel writes: f16/bf16
/// rows into a cache of their own dtype, or into either fp8 format (quantized).
fn append_kernel(format: KvFormat, dtype: DType, rule: Option<ScaleRule>) -> Result<()> {
    match (format, rule) {
        (KvFormat::F16 | KvFormat::Bf16, Some(r)) => Err(bad(
            "scale_rule",
            format!("{r:?} given for a {format} cache, which has no scales: pass None"),
        )),
        (KvFormat::Fp8PerTensor, Some(r)) => Err(bad(
            "scale_rule",
            format!("{r:?} given for a {format} cache, which uses its own per-tensor scale: pass None"),
        )),
        (KvFormat::Fp8DsMla, None) => Err(bad(
            "scale_rule",
            format!("a {format} cache needs a ScaleRule (Raw: vLLM, Pow2: FlashMLA)"),
        )),
        (KvFormat::F16, None) if dtype == DType::F16 => Ok(()),
        (KvFormat::Bf16, None) if dtype == DType::Bf16 => Ok(()),
        (KvFormat::F16 | KvFormat::Bf16, None) => Err(bad(
            "kv_cache",
            format!("{dtype} rows appended to a {format} cache: an f16/bf16 cache takes rows of its own dtype"),
        )),
        (KvFormat::Fp8DsMla, Some(_)) | (KvFormat::Fp8PerTensor, None) => Ok(()),
    }
}

fn table(t: &TableDesc, device: usize) -> Result<()> {
    const ARG: &str = "block_table";
    on_device(ARG, &t.buf, device)?;
    if t.batch == 0 || t.batch > I32_MAX {
        return Err(bad(ARG, format!("batch {} outside 1..={I32_MAX}", t.batch)));
    }
    // the row stride of a one-row table is never used (torch gives it any value)
    if t.max_blocks_per_seq == 0
        || (t.batch > 1 && (t.max_blocks_per_seq > t.stride || t.stride > I32_MAX))
    {
        return Err(bad(
            ARG,
            format!(
                "max_blocks_per_seq {} and row stride {}: want 1 <= max_blocks_per_seq <= row stride <= {I32_MAX}",
                t.max_blocks_per_seq, t.stride
            ),
        ));
    }
    let elems = (t.batch - 1)
        .checked_mul(t.stride)
        .and_then(|n| n.checked_add(t.max_blocks_per_seq))
        .unwrap_or(usize::MAX);
    holds(
        ARG,
        &t.buf,
        elems,
        4,
        &format!(
            "[{}, {}] with row stride {}",
            t.batch, t.max_blocks_per_seq, t.stride
        ),
    )
}

fn plan_device(p: &PlanDesc, device: usize) -> Result<()> {
    if p.device != device {
        return Err(bad(
            "plan",
            format!(
                "made for device {}, the stream is on device {device}",
                p.device
            ),
        ));
    }
    Ok(())
}

fn dense_plan(p: &PlanDesc, device: usize) -> Result<DenseShape> {
    plan_device(p, device)?;
    match p.kind {
        PlanKind::Dense(s) => Ok(s),
        PlanKind::Sparse(_) => Err(bad("plan", "a sparse plan, used for a dense call")),
    }
}

fn sparse_plan(p: &PlanDesc, device: usize) -> Result<SparseShape> {
    plan_device(p, device)?;
    match p.kind {
        PlanKind::Sparse(s) => Ok(s),
        PlanKind::Dense(_) => Err(bad("plan", "a dense plan, used for a sparse call")),
    }
}

/// `arg` has `call` of `what` where the plan was made for `plan`.
fn same_as_plan<V: PartialEq + std::fmt::Display>(
    arg: &'static str,
    what: &str,
    call: V,
    plan: V,
) -> Result<()> {
    if call == plan {
        return Ok(());
    }
    Err(bad(
        arg,
        format!("has {what} {call}, the plan was made for {plan}"),
    ))
}

/// Checks a dense decode.
pub fn dense(c: &DenseCall) -> Result<()> {
    named(DENSE_ARGS, dense_inner(c))
}

fn dense_inner(c: &DenseCall) -> Result<()> {
    let s = dense_plan(&c.plan, c.device)?;
    softmax_scale(c.softmax_scale)?;
    cache(&c.kv_cache, c.device, false)?;
    same_as_plan("kv_cache", "format", c.kv_cache.format, s.kv_format)?;
    same_as_plan(
        "kv_cache",
        "block_size",
        c.kv_cache.block_size,
        s.block_size,
    )?;
    table(&c.block_table, c.device)?;
    same_as_plan("block_table", "batch", c.block_table.batch, s.batch)?;
    same_as_plan(
        "block_table",
        "max_blocks_per_seq",
        c.block_table.max_blocks_per_seq,
        s.max_blocks_per_seq,
    )?;
    on_device("seq_lens", &c.seq_lens, c.device)?;
    holds("seq_lens", &c.seq_lens, s.batch, 4, "the plan's batch")?;
    let (tokens, elem) = (s.batch * s.q_len, c.dtype.size_bytes());
    query(&c.q, tokens, s.num_heads, elem, c.device)?;
    outputs(&c.out, c.lse.as_ref(), tokens, s.num_heads, elem, c.device)?;
    flag(c.error_flag.as_ref(), c.device)?;
    decode_kernel(c.kv_cache.format, c.dtype)
}

/// Checks a sparse decode.
pub fn sparse(c: &SparseCall) -> Result<()> {
    named(SPARSE_ARGS, sparse_inner(c))
}

fn sparse_inner(c: &SparseCall) -> Result<()> {
    let s = sparse_plan(&c.plan, c.device)?;
    softmax_scale(c.softmax_scale)?;
    cache(&c.kv_cache, c.device, true)?;
    same_as_plan("kv_cache", "format", c.kv_cache.format, s.kv_format)?;
    if let Some(b) = &c.topk_len {
        on_device("topk_len", b, c.device)?;
        holds("topk_len", b, s.num_tokens, 4, "the plan's num_tokens")?;
    }
    let ix = &c.indices;
    same_as_plan("indices", "topk", ix.topk, s.topk)?;
    on_device("indices", &ix.buf, c.device)?;
    if s.num_tokens > 1 && (ix.stride < ix.topk || ix.stride > I32_MAX) {
        return Err(bad(
            "indices",
            format!(
                "row stride {}: want topk {} <= row stride <= {I32_MAX}",
                ix.stride, ix.topk
            ),
        ));
    }
    let elems = (s.num_tokens - 1)
        .checked_mul(ix.stride)
        .and_then(|n| n.checked_add(ix.topk))
        .unwrap_or(usize::MAX);
    holds(
        "indices",
        &ix.buf,
        elems,
        4,
        &format!(
            "[{}, {}] with row stride {}",
            s.num_tokens, ix.topk, ix.stride
        ),
    )?;
    let elem = c.dtype.size_bytes();
    query(&c.q, s.num_tokens, s.num_heads, elem, c.device)?;
    outputs(
        &c.out,
        c.lse.as_ref(),
        s.num_tokens,
        s.num_heads,
        elem,
        c.device,
    )?;
    flag(c.error_flag.as_ref(), c.device)?;
    decode_kernel(c.kv_cache.format, c.dtype)
}

/// Checks a cache append.
pub fn append(c: &AppendCall) -> Result<()> {
    named(APPEND_ARGS, append_inner(c, None))
}

/// Checks an append whose new rows are split into a latent and a RoPE tensor.
pub fn append_split(c: &AppendSplitCall) -> Result<()> {
    named(
        APPEND_SPLIT_ARGS,
        append_inner(&c.rows, Some((&c.kv_rope, c.kv_rope_token_stride))),
    )
}

fn append_inner(c: &AppendCall, rope: Option<(&Buf, usize)>) -> Result<()> {
    let n = c.num_tokens;
    cache(&c.kv_cache, c.device, false)?;
    in_range("num_tokens", n, 0, I32_MAX)?;
    on_device("slot_mapping", &c.slot_mapping, c.device)?;
    holds("slot_mapping", &c.slot_mapping, n, 8, "num_tokens")?;
    match rope {
        None => token_rows(
            c,
            ("kv", "kv_token_stride"),
            &c.kv,
            c.kv_token_stride,
            HEAD_DIM,
        )?,
        Some((rb, rs)) => {
            let nope = ("kv_nope", "kv_nope_token_stride");
            token_rows(c, nope, &c.kv, c.kv_token_stride, LATENT_DIM)?;
            if rb.addr == c.kv.addr {
                return Err(bad(
                    "kv_rope",
                    "kv_rope starts where kv_nope does (packed 576-wide rows: use the packed \
                     append, or a kv_rope view 512 elements in)"
                        .to_string(),
                ));
            }
            token_rows(c, ("kv_rope", "kv_rope_token_stride"), rb, rs, ROPE_DIM)?;
        }
    }
    flag(c.error_flag.as_ref(), c.device)?;
    append_kernel(c.kv_cache.format, c.dtype, c.scale_rule)
}

/// One source tensor of an append, named `arg` (its stride `stride_arg`): `num_tokens` rows
/// of `width` elements, `stride` apart, 16-byte aligned.
fn token_rows(
    c: &AppendCall,
    (arg, stride_arg): (&'static str, &'static str),
    b: &Buf,
    stride: usize,
    width: usize,
) -> Result<()> {
    let (elem, n) = (c.dtype.size_bytes(), c.num_tokens);
    on_device(arg, b, c.device)?;
    if b.addr % 16 != 0 {
        return Err(bad(
            arg,
            format!("address {:#x} is not 16-byte aligned", b.addr),
        ));
    }
    // one row's stride is never used, so never checked (torch gives it arbitrary values)
    if n > 1 && (stride > I64_MAX / elem || stride < width || (stride * elem) % 16 != 0) {
        return Err(bad(
            stride_arg,
            format!("{stride} elements: want >= {width} and a multiple of 16 bytes"),
        ));
    }
    if n > 0 {
        let elems = (n - 1)
            .checked_mul(stride)
            .and_then(|e| e.checked_add(width))
            .unwrap_or(usize::MAX);
        holds(
            arg,
            b,
            elems,
            elem,
            &format!("[{n}, {width}] with token stride {stride}"),
        )?;
    }
    Ok(())
}

/// Checks an index gather.
pub fn gather(c: &GatherCall) -> Result<()> {
    named(GATHER_ARGS, gather_inner(c))
}

fn gather_inner(c: &GatherCall) -> Result<()> {
    let n = c.num_tokens;
    in_range("topk", c.topk, 1, MAX_TOPK)?;
    if n > MAX_GATHER_TOKENS {
        return Err(bad(
            "num_tokens",
            format!("{n}, want 0..={MAX_GATHER_TOKENS} (one grid row per token)"),
        ));
    }
    on_device("req_id", &c.req_id, c.device)?;
    holds("req_id", &c.req_id, n, 4, "num_tokens")?;
    // the device and the geometry only: the gather computes slot ids and never touches the
    // cache's bytes, so a descriptor over a buffer the size of its blocks is not needed
    on_device("kv_cache", &c.kv_cache.buf, c.device)?;
    cache_geometry(&c.kv_cache, true)?;
    table(&c.block_table, c.device)?;
    let positions = c
        .block_table
        .max_blocks_per_seq
        .saturating_mul(c.kv_cache.block_size);
    if positions > I32_MAX {
        return Err(bad(
            "block_table",
            format!(
                "max_blocks_per_seq {} x the cache's block_size {} exceeds {I32_MAX} positions",
                c.block_table.max_blocks_per_seq, c.kv_cache.block_size
            ),
        ));
    }
    on_device("seq_lens", &c.seq_lens, c.device)?;
    holds(
        "seq_lens",
        &c.seq_lens,
        c.block_table.batch,
        4,
        "block_table's batch",
    )?;
    for (arg, stride_arg, buf, stride) in [
        (
            "positions",
            "positions_stride",
            &c.positions,
            c.positions_stride,
        ),
        ("out", "out_stride", &c.out, c.out_stride),
    ] {
        on_device(arg, buf, c.device)?;
        if n > 1 && (stride < c.topk || stride > I32_MAX) {
            return Err(bad(
                stride_arg,
                format!("{stride}: want topk {} <= it <= {I32_MAX}", c.topk),
            ));
        }
        if n > 0 {
            let elems = (n - 1)
                .checked_mul(stride)
                .and_then(|e| e.checked_add(c.topk))
                .unwrap_or(usize::MAX);
            holds(
                arg,
                buf,
                elems,
                4,
                &format!("[{n}, {}] with row stride {stride}", c.topk),
            )?;
        }
    }
    flag(c.error_flag.as_ref(), c.device)
}

#[cfg(test)]
mod tests {
    //! Every rejection path of every call, each checked to name an argument of that call
    //! (`named` asserts the membership; these tests assert the exact argument too).

    use super::*;

    const HEADS: usize = 8;
    const BASE: u64 = 0x7f00_0000_0000;

    fn buf(n: u64, bytes: usize) -> Buf {
        Buf {
            addr: BASE + n * 0x1000_0000,
            bytes,
            device: 0,
        }
    }

    fn rows(n: u64, tokens: usize, width: usize, elem: usize) -> Rows {
        Rows {
            buf: buf(n, tokens * HEADS * width * elem),
            token_stride: HEADS * width,
            head_stride: width,
            num_heads: Some(HEADS),
        }
    }

    fn cache_of(format: KvFormat) -> CacheDesc {
        let bs = 64 * format.row_bytes();
        CacheDesc {
            buf: buf(2, 10 * bs),
            format,
            num_blocks: 10,
            block_size: 64,
            block_stride_bytes: bs,
            scale: format.needs_tensor_scale().then(|| buf(9, 4)),
            elem: format.dtype(),
        }
    }

    fn dense_shape() -> DenseShape {
        DenseShape {
            batch: 2,
            q_len: 2,
            num_heads: HEADS,
            block_size: 64,
            max_blocks_per_seq: 4,
            kv_format: KvFormat::Bf16,
        }
    }

    fn sparse_shape() -> SparseShape {
        SparseShape {
            num_tokens: 3,
            num_heads: HEADS,
            topk: 2048,
            kv_format: KvFormat::F16,
        }
    }

    fn dense_call() -> DenseCall {
        DenseCall {
            device: 0,
            dtype: DType::Bf16,
            plan: PlanDesc {
                kind: PlanKind::Dense(dense_shape()),
                device: 0,
            },
            q: QueryDesc::Packed(rows(1, 4, HEAD_DIM, 2)),
            kv_cache: cache_of(KvFormat::Bf16),
            block_table: TableDesc {
                buf: buf(3, 2 * 4 * 4),
                batch: 2,
                max_blocks_per_seq: 4,
                stride: 4,
            },
            seq_lens: buf(8, 2 * 4),
            out: rows(4, 4, LATENT_DIM, 2),
            lse: Some(rows(5, 4, 1, 4)),
            softmax_scale: 0.0625,
            error_flag: Some(buf(6, 16)),
        }
    }

    fn sparse_call() -> SparseCall {
        SparseCall {
            device: 0,
            dtype: DType::F16,
            plan: PlanDesc {
                kind: PlanKind::Sparse(sparse_shape()),
                device: 0,
            },
            q: QueryDesc::Split {
                nope: rows(1, 3, LATENT_DIM, 2),
                rope: rows(7, 3, ROPE_DIM, 2),
            },
            kv_cache: cache_of(KvFormat::F16),
            indices: IndicesDesc {
                buf: buf(3, 3 * 2048 * 4),
                topk: 2048,
                stride: 2048,
            },
            topk_len: Some(buf(8, 3 * 4)),
            out: rows(4, 3, LATENT_DIM, 2),
            lse: Some(rows(5, 3, 1, 4)),
            softmax_scale: 0.1352,
            error_flag: Some(buf(6, 16)),
        }
    }

    fn append_call() -> AppendCall {
        AppendCall {
            device: 0,
            dtype: DType::Bf16,
            kv: buf(1, 5 * HEAD_DIM * 2),
            kv_token_stride: HEAD_DIM,
            slot_mapping: buf(3, 5 * 8),
            num_tokens: 5,
            scale_rule: None,
            kv_cache: cache_of(KvFormat::Bf16),
            error_flag: Some(buf(6, 16)),
        }
    }

    fn gather_call() -> GatherCall {
        GatherCall {
            device: 0,
            positions: buf(1, 3 * 2048 * 4),
            positions_stride: 2048,
            req_id: buf(2, 3 * 4),
            block_table: TableDesc {
                buf: buf(3, 2 * 32 * 4),
                batch: 2,
                max_blocks_per_seq: 32,
                stride: 32,
            },
            seq_lens: buf(4, 2 * 4),
            kv_cache: cache_of(KvFormat::Bf16),
            topk: 2048,
            num_tokens: 3,
            out: buf(5, 3 * 2048 * 4),
            out_stride: 2048,
            error_flag: Some(buf(6, 16)),
        }
    }

    /// `r` must be `InvalidArgument` naming `arg`, which must be in `names`.
    #[track_caller]
    fn rejects(names: &[&str], r: Result<()>, arg: &str, label: &str) {
        match r {
            Err(Error::InvalidArgument { arg: a, reason }) => {
                assert_eq!(a, arg, "{label}: wrong argument named ({reason})");
                assert!(names.contains(&a), "{label}: `{a}` is not in {names:?}");
                assert!(!reason.is_empty(), "{label}");
            }
            other => panic!("{label}: expected InvalidArgument({arg}), got {other:?}"),
        }
    }

    /// Mutations of the shared pieces, applied to any call: `(label, expected arg, change)`.
    type Mutation<C> = (&'static str, &'static str, fn(&mut C));

    /// Rejections of the cache descriptor, shared by every call.
    const CACHE_MUTATIONS: &[Mutation<CacheDesc>] = &[
        ("cache device", "kv_cache", |c| c.buf.device = 1),
        ("cache block size", "kv_cache", |c| c.block_size = 24),
        ("cache no blocks", "kv_cache", |c| c.num_blocks = 0),
        ("cache too many blocks", "kv_cache", |c| {
            c.num_blocks = I32_MAX + 1;
            c.buf.bytes = usize::MAX;
        }),
        ("cache block stride short", "kv_cache", |c| {
            c.block_stride_bytes -= 16
        }),
        ("cache block stride unaligned", "kv_cache", |c| {
            c.block_stride_bytes += 8;
            c.buf.bytes *= 2;
        }),
        ("cache address", "kv_cache", |c| c.buf.addr += 8),
        ("cache too short", "kv_cache", |c| c.buf.bytes -= 16),
        ("cache stride past i64 (one block)", "kv_cache", |c| {
            c.num_blocks = 1;
            c.block_stride_bytes = 1 << 63
        }),
        ("cache overflow", "kv_cache", |c| {
            c.block_stride_bytes = usize::MAX & !15
        }),
        ("cache stray scale", "kv_cache", |c| {
            c.scale = Some(buf(9, 4))
        }),
    ];

    /// The first mutations of [`CACHE_MUTATIONS`]: the device and the geometry, all that the
    /// gather checks of its cache.
    const CACHE_GEOMETRY: usize = 4;

    /// Applies each mutation to a copy of `base` and checks the rejection; returns how many.
    fn run<C: Clone>(
        names: &[&str],
        base: C,
        check: fn(&C) -> Result<()>,
        own: &[Mutation<C>],
        cache: fn(&mut C) -> &mut CacheDesc,
    ) -> usize {
        run_with(names, base, check, own, cache, CACHE_MUTATIONS)
    }

    fn run_with<C: Clone>(
        names: &[&str],
        base: C,
        check: fn(&C) -> Result<()>,
        own: &[Mutation<C>],
        cache: fn(&mut C) -> &mut CacheDesc,
        cache_mutations: &[Mutation<CacheDesc>],
    ) -> usize {
        assert_eq!(check(&base), Ok(()), "the base call must pass");
        for (label, arg, f) in own {
            let mut c = base.clone();
            f(&mut c);
            rejects(names, check(&c), arg, label);
        }
        for (label, arg, f) in cache_mutations {
            let mut c = base.clone();
            f(cache(&mut c));
            rejects(names, check(&c), arg, label);
        }
        own.len() + cache_mutations.len()
    }

    fn packed(c: &mut DenseCall) -> &mut Rows {
        match &mut c.q {
            QueryDesc::Packed(r) => r,
            QueryDesc::Split { .. } => unreachable!(),
        }
    }

    fn nope(c: &mut SparseCall) -> &mut Rows {
        match &mut c.q {
            QueryDesc::Split { nope, .. } => nope,
            QueryDesc::Packed(_) => unreachable!(),
        }
    }

    fn rope(c: &mut SparseCall) -> &mut Rows {
        match &mut c.q {
            QueryDesc::Split { rope, .. } => rope,
            QueryDesc::Packed(_) => unreachable!(),
        }
    }

    #[test]
    fn rejections_name_the_call_arguments() {
        let dense_mutations: &[Mutation<DenseCall>] = &[
            ("plan device", "plan", |c| c.plan.device = 1),
            ("plan kind", "plan", |c| {
                c.plan.kind = PlanKind::Sparse(sparse_shape())
            }),
            ("scale zero", "softmax_scale", |c| c.softmax_scale = 0.0),
            ("scale nan", "softmax_scale", |c| c.softmax_scale = f32::NAN),
            ("cache format vs plan", "kv_cache", |c| {
                c.kv_cache = cache_of(KvFormat::F16)
            }),
            ("cache buffer of the other 16-bit type", "kv_cache", |c| {
                c.kv_cache.elem = Some(DType::F16)
            }),
            ("cache block size vs plan", "kv_cache", |c| {
                c.kv_cache.block_size = 32;
                c.kv_cache.block_stride_bytes = 32 * 1152;
            }),
            ("cache dtype vs q", "kv_cache", |c| {
                c.dtype = DType::F16;
            }),
            ("table device", "block_table", |c| {
                c.block_table.buf.device = 2
            }),
            ("table batch zero", "block_table", |c| {
                c.block_table.batch = 0
            }),
            ("table stride", "block_table", |c| c.block_table.stride = 3),
            ("table no columns", "block_table", |c| {
                c.block_table.max_blocks_per_seq = 0
            }),
            ("table short", "block_table", |c| {
                c.block_table.buf.bytes -= 4
            }),
            ("table batch vs plan", "block_table", |c| {
                c.block_table.batch = 1
            }),
            ("table columns vs plan", "block_table", |c| {
                c.block_table.max_blocks_per_seq = 3
            }),
            ("seq_lens device", "seq_lens", |c| c.seq_lens.device = 1),
            ("seq_lens short", "seq_lens", |c| c.seq_lens.bytes = 4),
            ("q device", "q", |c| packed(c).buf.device = 1),
            ("q heads", "q", |c| packed(c).num_heads = Some(16)),
            ("q stride huge", "q", |c| {
                packed(c).token_stride = usize::MAX / 2
            }),
            ("q address", "q", |c| packed(c).buf.addr += 8),
            ("q head stride", "q", |c| {
                let q = packed(c);
                q.num_heads = None;
                q.head_stride = 580;
                q.token_stride = HEADS * 580;
                q.buf.bytes = 4 * HEADS * 580 * 2;
            }),
            ("q short", "q", |c| packed(c).buf.bytes -= 2),
            ("q overflow", "q", |c| {
                let q = packed(c);
                q.num_heads = None;
                q.token_stride = (I64_MAX / 2) & !7;
                q.head_stride = (I64_MAX / 2) & !7;
            }),
            ("out short", "out", |c| c.out.buf.bytes -= 2),
            ("out overlap", "out", |c| {
                c.out.num_heads = None;
                c.out.head_stride = 256;
            }),
            ("lse short", "lse", |c| {
                c.lse.as_mut().unwrap().buf.bytes -= 4
            }),
            ("lse overlap", "lse", |c| {
                let l = c.lse.as_mut().unwrap();
                l.num_heads = None;
                l.head_stride = 0;
            }),
            ("flag short", "error_flag", |c| {
                c.error_flag = Some(buf(6, 8))
            }),
            ("flag device", "error_flag", |c| {
                c.error_flag = Some(Buf {
                    device: 1,
                    ..buf(6, 16)
                })
            }),
        ];
        let n = run(DENSE_ARGS, dense_call(), dense, dense_mutations, |c| {
            &mut c.kv_cache
        });
        assert!(n >= 35, "{n}");

        let sparse_mutations: &[Mutation<SparseCall>] = &[
            ("plan device", "plan", |c| c.plan.device = 1),
            ("plan kind", "plan", |c| {
                c.plan.kind = PlanKind::Dense(dense_shape())
            }),
            ("scale inf", "softmax_scale", |c| {
                c.softmax_scale = f32::INFINITY
            }),
            ("slot ids overflow", "kv_cache", |c| {
                c.kv_cache.num_blocks = (1 << 31) / 64; // exactly 2^31 slots
                c.kv_cache.buf.bytes = usize::MAX;
            }),
            ("cache format vs plan", "kv_cache", |c| {
                c.kv_cache = cache_of(KvFormat::Bf16)
            }),
            ("topk_len device", "topk_len", |c| {
                c.topk_len = Some(Buf {
                    device: 1,
                    ..buf(8, 12)
                })
            }),
            ("topk_len short", "topk_len", |c| {
                c.topk_len = Some(buf(8, 8))
            }),
            ("indices topk vs plan", "indices", |c| c.indices.topk = 1024),
            ("indices device", "indices", |c| c.indices.buf.device = 1),
            ("indices stride", "indices", |c| c.indices.stride = 2000),
            ("indices short", "indices", |c| c.indices.buf.bytes -= 4),
            ("q_nope short", "q", |c| nope(c).buf.bytes -= 2),
            ("q_nope address", "q", |c| nope(c).buf.addr += 2),
            ("q_rope short", "q", |c| rope(c).buf.bytes -= 2),
            ("q_rope device", "q", |c| rope(c).buf.device = 3),
            ("q_rope aliases q_nope", "q", |c| {
                let n = nope(c).buf;
                rope(c).buf = n
            }),
            ("out device", "out", |c| c.out.buf.device = 3),
            ("out address", "out", |c| c.out.buf.addr += 4),
            ("out tokens overlap", "out", |c| {
                c.out.num_heads = None;
                c.out.token_stride = 0;
            }),
            ("lse heads", "lse", |c| {
                c.lse.as_mut().unwrap().num_heads = Some(4)
            }),
            ("cache dtype vs q", "kv_cache", |c| c.dtype = DType::Bf16),
            ("flag empty", "error_flag", |c| {
                c.error_flag = Some(buf(6, 0))
            }),
        ];
        let n = run(SPARSE_ARGS, sparse_call(), sparse, sparse_mutations, |c| {
            &mut c.kv_cache
        });
        assert!(n >= 28, "{n}");

        let append_mutations: &[Mutation<AppendCall>] = &[
            ("num_tokens", "num_tokens", |c| {
                c.num_tokens = I32_MAX + 1;
                c.slot_mapping.bytes = usize::MAX;
                c.kv.bytes = usize::MAX;
            }),
            ("slots device", "slot_mapping", |c| {
                c.slot_mapping.device = 1
            }),
            ("slots short", "slot_mapping", |c| c.slot_mapping.bytes -= 8),
            ("kv device", "kv", |c| c.kv.device = 1),
            ("kv address", "kv", |c| c.kv.addr += 2),
            ("kv stride unaligned", "kv_token_stride", |c| {
                c.kv_token_stride = HEAD_DIM + 4;
                c.kv.bytes *= 2;
            }),
            ("kv stride short", "kv_token_stride", |c| {
                c.kv_token_stride = 512
            }),
            ("kv stride huge", "kv_token_stride", |c| {
                c.kv_token_stride = usize::MAX / 2
            }),
            ("kv short", "kv", |c| c.kv.bytes -= 2),
            ("flag short", "error_flag", |c| {
                c.error_flag = Some(buf(6, 4))
            }),
            ("rule for bf16", "scale_rule", |c| {
                c.scale_rule = Some(ScaleRule::Raw)
            }),
            ("rule for per-tensor", "scale_rule", |c| {
                c.kv_cache = cache_of(KvFormat::Fp8PerTensor);
                c.scale_rule = Some(ScaleRule::Pow2);
            }),
            ("no rule for ds_mla", "scale_rule", |c| {
                c.kv_cache = cache_of(KvFormat::Fp8DsMla)
            }),
            ("cache dtype vs kv", "kv_cache", |c| c.dtype = DType::F16),
            ("cache buffer of the other 16-bit type", "kv_cache", |c| {
                c.kv_cache.elem = Some(DType::F16)
            }),
            ("per-tensor without scale", "kv_cache", |c| {
                c.kv_cache = CacheDesc {
                    scale: None,
                    ..cache_of(KvFormat::Fp8PerTensor)
                }
            }),
            ("per-tensor scale device", "kv_cache", |c| {
                c.kv_cache = CacheDesc {
                    scale: Some(Buf {
                        device: 1,
                        ..buf(9, 4)
                    }),
                    ..cache_of(KvFormat::Fp8PerTensor)
                }
            }),
            ("per-tensor scale short", "kv_cache", |c| {
                c.kv_cache = CacheDesc {
                    scale: Some(buf(9, 2)),
                    ..cache_of(KvFormat::Fp8PerTensor)
                }
            }),
        ];
        let n = run(APPEND_ARGS, append_call(), append, append_mutations, |c| {
            &mut c.kv_cache
        });
        assert!(n >= 27, "{n}");

        // the split append: the latent part named kv_nope, the RoPE part kv_rope
        let split = AppendSplitCall {
            rows: AppendCall {
                kv: buf(1, 5 * LATENT_DIM * 2),
                kv_token_stride: LATENT_DIM,
                ..append_call()
            },
            kv_rope: buf(2, 5 * ROPE_DIM * 2),
            kv_rope_token_stride: ROPE_DIM,
        };
        let split_mutations: &[Mutation<AppendSplitCall>] = &[
            ("nope device", "kv_nope", |c| c.rows.kv.device = 1),
            ("nope address", "kv_nope", |c| c.rows.kv.addr += 4),
            ("nope short", "kv_nope", |c| c.rows.kv.bytes -= 2),
            ("nope stride short", "kv_nope_token_stride", |c| {
                c.rows.kv_token_stride = 504
            }),
            ("nope stride unaligned", "kv_nope_token_stride", |c| {
                c.rows.kv_token_stride = LATENT_DIM + 4;
                c.rows.kv.bytes *= 2;
            }),
            ("rope device", "kv_rope", |c| c.kv_rope.device = 1),
            ("rope address", "kv_rope", |c| c.kv_rope.addr += 8),
            ("rope short", "kv_rope", |c| c.kv_rope.bytes -= 2),
            ("rope aliases nope", "kv_rope", |c| c.kv_rope = c.rows.kv),
            ("rope stride short", "kv_rope_token_stride", |c| {
                c.kv_rope_token_stride = 56
            }),
            ("rope stride unaligned", "kv_rope_token_stride", |c| {
                c.kv_rope_token_stride = ROPE_DIM + 4;
                c.kv_rope.bytes *= 2;
            }),
            ("rope stride huge", "kv_rope_token_stride", |c| {
                c.kv_rope_token_stride = usize::MAX / 2
            }),
            ("slots short", "slot_mapping", |c| {
                c.rows.slot_mapping.bytes -= 8
            }),
            ("rule for bf16", "scale_rule", |c| {
                c.rows.scale_rule = Some(ScaleRule::Raw)
            }),
        ];
        let n = run(
            APPEND_SPLIT_ARGS,
            split.clone(),
            append_split,
            split_mutations,
            |c| &mut c.rows.kv_cache,
        );
        assert!(n >= 20, "{n}");
        // a 576-wide stride for either part (views into one [n, 576] tensor) is fine,
        // and one row's strides are never used
        let mut views = split.clone();
        views.rows.kv_token_stride = HEAD_DIM;
        views.rows.kv.bytes = 5 * HEAD_DIM * 2;
        views.kv_rope_token_stride = HEAD_DIM;
        views.kv_rope.bytes = 4 * HEAD_DIM * 2 + ROPE_DIM * 2;
        assert_eq!(append_split(&views), Ok(()));
        let mut one = split;
        one.rows.num_tokens = 1;
        one.rows.kv_token_stride = 3;
        one.kv_rope_token_stride = usize::MAX;
        assert_eq!(append_split(&one), Ok(()));

        let gather_mutations: &[Mutation<GatherCall>] = &[
            ("topk zero", "topk", |c| c.topk = 0),
            ("topk large", "topk", |c| {
                c.topk = 5000;
                c.positions_stride = 5000;
                c.out_stride = 5000;
            }),
            ("num_tokens", "num_tokens", |c| {
                c.num_tokens = MAX_GATHER_TOKENS + 1
            }),
            ("req_id device", "req_id", |c| c.req_id.device = 1),
            ("req_id short", "req_id", |c| c.req_id.bytes = 8),
            ("slot ids overflow", "kv_cache", |c| {
                c.kv_cache.num_blocks = (1 << 31) / 64; // exactly 2^31 slots
                c.kv_cache.buf.bytes = usize::MAX;
            }),
            ("table stride", "block_table", |c| c.block_table.stride = 16),
            ("table positions", "block_table", |c| {
                c.block_table.max_blocks_per_seq = (1 << 31) / 64;
                c.block_table.stride = (1 << 31) / 64;
                c.block_table.buf.bytes = usize::MAX;
            }),
            ("seq_lens device", "seq_lens", |c| c.seq_lens.device = 1),
            ("seq_lens short", "seq_lens", |c| c.seq_lens.bytes = 4),
            ("positions device", "positions", |c| c.positions.device = 1),
            ("positions stride", "positions_stride", |c| {
                c.positions_stride = 1000
            }),
            ("positions short", "positions", |c| c.positions.bytes -= 4),
            ("out device", "out", |c| c.out.device = 1),
            ("out stride", "out_stride", |c| c.out_stride = 10),
            ("out short", "out", |c| c.out.bytes -= 4),
            ("flag device", "error_flag", |c| {
                c.error_flag = Some(Buf {
                    device: 2,
                    ..buf(6, 16)
                })
            }),
        ];
        let n = run_with(
            GATHER_ARGS,
            gather_call(),
            gather,
            gather_mutations,
            |c| &mut c.kv_cache,
            &CACHE_MUTATIONS[..CACHE_GEOMETRY],
        );
        assert!(n >= 20, "{n}");

        let dense_shapes: &[Mutation<DenseShape>] = &[
            ("batch 0", "batch", |s| s.batch = 0),
            ("q_len 0", "q_len", |s| s.q_len = 0),
            ("q_len 9", "q_len", |s| s.q_len = 9),
            ("heads 0", "num_heads", |s| s.num_heads = 0),
            ("heads 129", "num_heads", |s| s.num_heads = 129),
            ("block 48", "block_size", |s| s.block_size = 48),
            ("blocks 0", "max_blocks_per_seq", |s| {
                s.max_blocks_per_seq = 0
            }),
            ("blocks past int32", "max_blocks_per_seq", |s| {
                s.block_size = 16;
                s.max_blocks_per_seq = I32_MAX / 16;
            }),
            ("tokens past int32", "batch", |s| {
                (s.batch, s.q_len) = (I32_MAX, 2)
            }),
            ("tiles past int32", "batch", |s| {
                s.batch = 1 << 20;
                s.block_size = 128;
                s.max_blocks_per_seq = 1 << 10; // 2^20 requests x 4096 tiles = 2^32
            }),
        ];
        assert_eq!(super::dense_shape(&dense_shape()), Ok(()));
        for (label, arg, f) in dense_shapes {
            let mut s = dense_shape();
            f(&mut s);
            rejects(DENSE_SHAPE_ARGS, super::dense_shape(&s), arg, label);
        }
        let sparse_shapes: &[Mutation<SparseShape>] = &[
            ("tokens 0", "num_tokens", |s| s.num_tokens = 0),
            ("heads 200", "num_heads", |s| s.num_heads = 200),
            ("topk 0", "topk", |s| s.topk = 0),
            ("topk 4097", "topk", |s| s.topk = 4097),
            ("tiles past int32", "num_tokens", |s| {
                (s.num_tokens, s.topk) = (1 << 25, 4096)
            }),
        ];
        assert_eq!(super::sparse_shape(&sparse_shape()), Ok(()));
        for (label, arg, f) in sparse_shapes {
            let mut s = sparse_shape();
            f(&mut s);
            rejects(SPARSE_SHAPE_ARGS, super::sparse_shape(&s), arg, label);
        }
    }

    #[test]
    fn valid_variants_pass() {
        // FlashMLA-style lse [heads, tokens], q as a slice of a wider buffer, padded blocks.
        let mut c = dense_call();
        c.lse = Some(Rows {
            buf: buf(5, 4 * HEADS * 4),
            token_stride: 1,
            head_stride: 4,
            num_heads: None,
        });
        let q = packed(&mut c);
        q.token_stride = HEADS * 640;
        q.head_stride = 640;
        q.num_heads = None;
        q.buf.bytes = 4 * HEADS * 640 * 2;
        c.kv_cache.block_stride_bytes = 64 * 1152 + 256;
        c.kv_cache.buf.bytes = 10 * (64 * 1152 + 256);
        assert_eq!(dense(&c), Ok(()));
        // Longer buffers than needed (preallocated maximum sizes), no lse, no flag.
        let mut c = sparse_call();
        c.topk_len = None;
        c.lse = None;
        c.error_flag = None;
        c.indices.buf.bytes *= 4;
        c.out.buf.bytes *= 4;
        assert_eq!(sparse(&c), Ok(()));
        // Nothing to append or gather is fine, whatever the buffers hold.
        let mut c = append_call();
        c.num_tokens = 0;
        c.slot_mapping.bytes = 0;
        c.kv.bytes = 0;
        assert_eq!(append(&c), Ok(()));
        let mut c = gather_call();
        c.num_tokens = 0;
        c.req_id.bytes = 0;
        assert_eq!(gather(&c), Ok(()));
        // A gather over an fp8 cache: the gather reads only its block counts.
        let mut c = gather_call();
        c.kv_cache = cache_of(KvFormat::Fp8DsMla);
        assert_eq!(gather(&c), Ok(()));
    }

    #[test]
    fn fp8_decode_and_append_are_supported() {
        for format in [KvFormat::Fp8DsMla, KvFormat::Fp8PerTensor] {
            for dtype in [DType::F16, DType::Bf16] {
                let mut c = dense_call();
                c.dtype = dtype;
                c.kv_cache = cache_of(format);
                c.plan.kind = PlanKind::Dense(DenseShape {
                    kv_format: format,
                    ..dense_shape()
                });
                assert_eq!(dense(&c), Ok(()), "{format} {dtype}: dense decode reads it");
                let mut c = sparse_call();
                c.dtype = dtype;
                c.kv_cache = cache_of(format);
                c.plan.kind = PlanKind::Sparse(SparseShape {
                    kv_format: format,
                    ..sparse_shape()
                });
                assert_eq!(
                    sparse(&c),
                    Ok(()),
                    "{format} {dtype}: sparse decode reads it"
                );
                let mut c = append_call();
                c.dtype = dtype;
                c.kv_cache = cache_of(format);
                c.scale_rule = (format == KvFormat::Fp8DsMla).then_some(ScaleRule::Pow2);
                assert_eq!(append(&c), Ok(()), "{format}: the append quantizes");
            }
        }
        // An invalid fp8 call is invalid first.
        let mut c = dense_call();
        c.kv_cache = cache_of(KvFormat::Fp8DsMla);
        rejects(DENSE_ARGS, dense(&c), "kv_cache", "fp8 cache, bf16 plan");
    }

    #[test]
    fn size_one_dimensions_ignore_their_strides() {
        // One token and one head: neither stride is used, whatever its value (as in C).
        let r = Rows {
            buf: buf(1, HEAD_DIM * 2),
            token_stride: usize::MAX,
            head_stride: usize::MAX - 7,
            num_heads: None,
        };
        let need = Need::input("q", HEAD_DIM, 2);
        assert_eq!(super::rows(&r, need, 1, 1, 0), Ok(()));
        let out = Need {
            output: true,
            ..need
        };
        assert_eq!(super::rows(&r, out, 1, 1, 0), Ok(()));
        // Two heads use the head stride: too large for an i64 in bytes.
        rejects(&["q"], super::rows(&r, need, 1, 2, 0), "q", "two heads");
        rejects(&["q"], super::rows(&r, need, 2, 1, 0), "q", "two tokens");
    }

    #[test]
    fn read_rows_step_by_zero_or_a_whole_row() {
        let r = |token_stride, head_stride| Rows {
            buf: buf(1, 1 << 20),
            token_stride,
            head_stride,
            num_heads: None,
        };
        let need = Need::input("q", HEAD_DIM, 2);
        assert_eq!(
            super::rows(&r(2 * HEAD_DIM, HEAD_DIM), need, 2, 2, 0),
            Ok(())
        );
        // a broadcast (stride 0) reads one row for every index
        assert_eq!(super::rows(&r(0, HEAD_DIM), need, 2, 2, 0), Ok(()));
        // a 512-wide tensor passed as packed rows
        rejects(
            &["q"],
            super::rows(&r(2 * LATENT_DIM, LATENT_DIM), need, 2, 2, 0),
            "q",
            "512 heads",
        );
        rejects(
            &["q"],
            super::rows(&r(LATENT_DIM, 2 * HEAD_DIM), need, 2, 1, 0),
            "q",
            "512 tokens",
        );
        // an unused dimension's stride is never looked at
        assert_eq!(super::rows(&r(8, HEAD_DIM), need, 1, 2, 0), Ok(()));
    }

    #[test]
    fn reasons_say_what_is_wrong() {
        let mut c = dense_call();
        c.kv_cache.block_size = 32;
        c.kv_cache.block_stride_bytes = 32 * 1152;
        let e = dense(&c).unwrap_err().to_string();
        assert!(
            e.contains("block_size 32") && e.contains("plan was made for 64"),
            "{e}"
        );
        let mut c = sparse_call();
        rope(&mut c).buf.bytes -= 2;
        let e = sparse(&c).unwrap_err().to_string();
        assert!(e.starts_with("invalid argument `q`: q_rope: holds"), "{e}");
        let mut c = dense_call();
        c.dtype = DType::F16;
        let e = dense(&c).unwrap_err().to_string();
        assert!(e.contains("bf16 cache read with f16 queries"), "{e}");
    }
}
