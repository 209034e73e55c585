//! Host-side checks of every call, as pure functions over numbers (lengths, strides,
//! addresses, device ordinals), so that they run, and are tested, without a GPU.
//!
//! The safe calls describe their arguments with the structs below and run these checks
//! before any kernel launch. Every failure is [`Error::InvalidArgument`] naming the argument.

use crate::error::{Error, Result};
use crate::plan::{DenseShape, PlanKind, SparseShape};
use crate::types::{
    DType, BLOCK_SIZES, HEAD_DIM, LATENT_DIM, MAX_HEADS, MAX_Q_LEN, MAX_TOPK, ROPE_DIM,
};

const I32_MAX: usize = i32::MAX as usize;
const I64_MAX: usize = i64::MAX as usize;

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

/// A paged f16/bf16 cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheDesc {
    /// The buffer.
    pub buf: Buf,
    /// Blocks.
    pub num_blocks: usize,
    /// Rows per block.
    pub block_size: usize,
    /// Bytes between blocks.
    pub block_stride_bytes: usize,
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
    /// Dense or sparse, and the shape it was made for.
    pub kind: PlanKind,
    /// Device ordinal of its schedule.
    pub device: usize,
}

/// Every argument of a dense decode.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DenseCall {
    /// Ordinal of the stream's device.
    pub device: usize,
    /// Element type of q, cache and out.
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

/// Every argument of a sparse decode.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SparseCall {
    /// Ordinal of the stream's device.
    pub device: usize,
    /// Element type of q, cache and out.
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

/// Every argument of a cache append (`num_tokens = slot_mapping.bytes / 8`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendCall {
    /// Ordinal of the stream's device.
    pub device: usize,
    /// Element type of kv and the cache.
    pub dtype: DType,
    /// `kv`: new 576-wide rows.
    pub kv: Buf,
    /// Elements between rows of `kv`.
    pub kv_token_stride: usize,
    /// `slot_mapping` (int64).
    pub slot_mapping: Buf,
    /// `kv_cache`.
    pub kv_cache: CacheDesc,
    /// The error flag, if any.
    pub error_flag: Option<Buf>,
}

/// Every argument of an index gather (`num_tokens = req_id.bytes / 4`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherCall {
    /// Ordinal of the stream's device.
    pub device: usize,
    /// `positions` `[tokens, positions_stride]` int32.
    pub positions: Buf,
    /// Elements between rows of `positions`.
    pub positions_stride: usize,
    /// Entries per row.
    pub topk: usize,
    /// `req_id[tokens]` int32.
    pub req_id: Buf,
    /// `block_table`.
    pub block_table: TableDesc,
    /// `seq_lens[batch]` int32.
    pub seq_lens: Buf,
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// Rows per block.
    pub block_size: usize,
    /// `out` `[tokens, out_stride]` int32.
    pub out: Buf,
    /// Elements between rows of `out`.
    pub out_stride: usize,
    /// The error flag, if any.
    pub error_flag: Option<Buf>,
}

fn bad(arg: &'static str, reason: impl Into<String>) -> Error {
    Error::invalid(arg, reason)
}

fn in_range(arg: &'static str, v: usize, lo: usize, hi: usize) -> Result<()> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(bad(arg, format!("{v} outside {lo}..={hi}")))
    }
}

fn block_size(v: usize) -> Result<()> {
    if BLOCK_SIZES.contains(&v) {
        Ok(())
    } else {
        Err(bad(
            "block_size",
            format!("{v} (want one of {BLOCK_SIZES:?})"),
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
    in_range("batch", s.batch, 1, I32_MAX)?;
    in_range("q_len", s.q_len, 1, MAX_Q_LEN)?;
    in_range("num_heads", s.num_heads, 1, MAX_HEADS)?;
    block_size(s.block_size)?;
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
        width,
        elem,
        align16,
        output,
    } = need;
    on_device(arg, &r.buf, device)?;
    if let Some(h) = r.num_heads {
        if h != heads {
            return Err(bad(
                arg,
                format!("made for {h} heads, the plan has {heads}"),
            ));
        }
    }
    for (name, s) in [("token", r.token_stride), ("head", r.head_stride)] {
        if s > I64_MAX / elem {
            return Err(bad(arg, format!("{name} stride {s} too large")));
        }
    }
    if align16 {
        if r.buf.addr % 16 != 0 {
            return Err(bad(
                arg,
                format!("address {:#x} is not 16-byte aligned", r.buf.addr),
            ));
        }
        for (name, s, n) in [
            ("token", r.token_stride, tokens),
            ("head", r.head_stride, heads),
        ] {
            if n > 1 && (s * elem) % 16 != 0 {
                return Err(bad(
                    arg,
                    format!(
                        "{name} stride {s} elements = {} bytes, not a multiple of 16",
                        s * elem
                    ),
                ));
            }
        }
    }
    let what = format!(
        "[{tokens}, {heads}, {width}] with strides ({}, {})",
        r.token_stride, r.head_stride
    );
    match span(r, tokens, heads, width) {
        Some(n) => holds(arg, &r.buf, n, elem, &what)?,
        None => return Err(bad(arg, format!("{what} overflows"))),
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
                    return Err(bad(arg, format!("{what}: rows overlap")));
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
            let nope_need = Need::input("q_nope", LATENT_DIM, elem);
            rows(nope, nope_need, tokens, heads, device)?;
            rows(
                rope,
                Need::input("q_rope", ROPE_DIM, elem),
                tokens,
                heads,
                device,
            )
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
            arg: "lse",
            width: 1,
            elem: 4,
            align16: false,
            output: true,
        };
        rows(l, lse_need, tokens, heads, device)?;
    }
    Ok(())
}

/// `slot_ids`: global slot ids must fit int32.
fn cache(c: &CacheDesc, elem: usize, device: usize, slot_ids: bool) -> Result<()> {
    const ARG: &str = "kv_cache";
    on_device(ARG, &c.buf, device)?;
    block_size(c.block_size)?;
    if c.num_blocks == 0 {
        return Err(bad(
            ARG,
            format!(
                "no whole block of {} rows in {} bytes",
                c.block_size, c.buf.bytes
            ),
        ));
    }
    in_range("num_blocks", c.num_blocks, 1, I32_MAX)?;
    if slot_ids && c.num_blocks > (I32_MAX + 1) / c.block_size {
        return Err(bad(
            ARG,
            format!(
                "{} blocks of {} rows: slot ids do not fit int32",
                c.num_blocks, c.block_size
            ),
        ));
    }
    let block_bytes = c.block_size * HEAD_DIM * elem;
    if c.block_stride_bytes < block_bytes || c.block_stride_bytes % 16 != 0 {
        return Err(bad(
            ARG,
            format!(
                "block stride {} bytes: want a multiple of 16 >= block_size*row_bytes = {block_bytes}",
                c.block_stride_bytes
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
        Some(n) if n <= c.buf.bytes => Ok(()),
        _ => Err(bad(
            ARG,
            format!(
                "holds {} bytes, {} blocks {} bytes apart need {}",
                c.buf.bytes,
                c.num_blocks,
                c.block_stride_bytes,
                need.map_or("more".to_string(), |n| n.to_string())
            ),
        )),
    }
}

fn table(t: &TableDesc, device: usize) -> Result<()> {
    const ARG: &str = "block_table";
    on_device(ARG, &t.buf, device)?;
    if t.batch == 0 || t.batch > I32_MAX {
        return Err(bad(ARG, format!("batch {} outside 1..={I32_MAX}", t.batch)));
    }
    if t.max_blocks_per_seq == 0 || t.max_blocks_per_seq > t.stride || t.stride > I32_MAX {
        return Err(bad(
            ARG,
            format!(
                "max_blocks_per_seq {} and stride {}: want 1 <= max_blocks_per_seq <= stride <= {I32_MAX}",
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
            "[{}, {}] with stride {}",
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

fn mismatch(what: &str, plan: usize, call: usize, source: &str) -> Error {
    bad(
        "plan",
        format!("made for {what} {plan}, but {source} has {call}"),
    )
}

/// Checks a dense decode.
pub fn dense(c: &DenseCall) -> Result<()> {
    let s = dense_plan(&c.plan, c.device)?;
    softmax_scale(c.softmax_scale)?;
    let elem = c.dtype.size_bytes();
    cache(&c.kv_cache, elem, c.device, false)?;
    table(&c.block_table, c.device)?;
    on_device("seq_lens", &c.seq_lens, c.device)?;
    holds("seq_lens", &c.seq_lens, s.batch, 4, "the plan's batch")?;
    if c.block_table.batch != s.batch {
        return Err(mismatch(
            "batch",
            s.batch,
            c.block_table.batch,
            "block_table",
        ));
    }
    if c.block_table.max_blocks_per_seq != s.max_blocks_per_seq {
        return Err(mismatch(
            "max_blocks_per_seq",
            s.max_blocks_per_seq,
            c.block_table.max_blocks_per_seq,
            "block_table",
        ));
    }
    if c.kv_cache.block_size != s.block_size {
        return Err(mismatch(
            "block_size",
            s.block_size,
            c.kv_cache.block_size,
            "kv_cache",
        ));
    }
    let tokens = s.batch * s.q_len;
    query(&c.q, tokens, s.num_heads, elem, c.device)?;
    outputs(&c.out, c.lse.as_ref(), tokens, s.num_heads, elem, c.device)?;
    flag(c.error_flag.as_ref(), c.device)
}

/// Checks a sparse decode.
pub fn sparse(c: &SparseCall) -> Result<()> {
    let s = sparse_plan(&c.plan, c.device)?;
    softmax_scale(c.softmax_scale)?;
    let elem = c.dtype.size_bytes();
    cache(&c.kv_cache, elem, c.device, true)?;
    if let Some(b) = &c.topk_len {
        on_device("topk_len", b, c.device)?;
        holds("topk_len", b, s.num_tokens, 4, "the plan's num_tokens")?;
    }
    let ix = &c.indices;
    if ix.topk != s.topk {
        return Err(mismatch("topk", s.topk, ix.topk, "indices"));
    }
    on_device("indices", &ix.buf, c.device)?;
    if ix.stride < ix.topk || ix.stride > I32_MAX {
        return Err(bad(
            "indices",
            format!(
                "stride {}: want topk {} <= stride <= {I32_MAX}",
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
        &format!("[{}, {}] with stride {}", s.num_tokens, ix.topk, ix.stride),
    )?;
    query(&c.q, s.num_tokens, s.num_heads, elem, c.device)?;
    outputs(
        &c.out,
        c.lse.as_ref(),
        s.num_tokens,
        s.num_heads,
        elem,
        c.device,
    )?;
    flag(c.error_flag.as_ref(), c.device)
}

/// Checks a cache append.
pub fn append(c: &AppendCall) -> Result<()> {
    let elem = c.dtype.size_bytes();
    cache(&c.kv_cache, elem, c.device, false)?;
    on_device("slot_mapping", &c.slot_mapping, c.device)?;
    let n = c.slot_mapping.bytes / 8;
    in_range("slot_mapping", n, 0, I32_MAX)?;
    on_device("kv", &c.kv, c.device)?;
    if c.kv.addr % 16 != 0 || (n > 1 && (c.kv_token_stride * elem) % 16 != 0) {
        return Err(bad(
            "kv",
            format!(
                "address {:#x} or token stride {} elements not 16-byte aligned",
                c.kv.addr, c.kv_token_stride
            ),
        ));
    }
    if c.kv_token_stride > I64_MAX / elem || (n > 1 && c.kv_token_stride < HEAD_DIM) {
        return Err(bad(
            "kv",
            format!("token stride {}: want {HEAD_DIM}..", c.kv_token_stride),
        ));
    }
    if n > 0 {
        let elems = (n - 1)
            .checked_mul(c.kv_token_stride)
            .and_then(|e| e.checked_add(HEAD_DIM))
            .unwrap_or(usize::MAX);
        holds(
            "kv",
            &c.kv,
            elems,
            elem,
            &format!("[{n}, {HEAD_DIM}] with stride {}", c.kv_token_stride),
        )?;
    }
    flag(c.error_flag.as_ref(), c.device)
}

/// Most query tokens one gather call takes (the kernel puts tokens on the grid's y axis).
pub const MAX_GATHER_TOKENS: usize = 65_535;

/// Checks an index gather.
pub fn gather(c: &GatherCall) -> Result<()> {
    in_range("topk", c.topk, 1, MAX_TOPK)?;
    on_device("req_id", &c.req_id, c.device)?;
    let n = c.req_id.bytes / 4;
    if n == 0 || n > MAX_GATHER_TOKENS {
        return Err(bad(
            "req_id",
            format!("{n} tokens, want 1..={MAX_GATHER_TOKENS} (one grid row per token)"),
        ));
    }
    table(&c.block_table, c.device)?;
    if c.block_table
        .max_blocks_per_seq
        .saturating_mul(c.block_size)
        > I32_MAX
    {
        return Err(bad(
            "block_table",
            format!(
                "max_blocks_per_seq {} x block_size {} exceeds {I32_MAX} positions",
                c.block_table.max_blocks_per_seq, c.block_size
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
    block_size(c.block_size)?;
    in_range("num_blocks", c.num_blocks, 1, (I32_MAX + 1) / c.block_size)?;
    for (arg, buf, stride) in [
        ("positions", &c.positions, c.positions_stride),
        ("out", &c.out, c.out_stride),
    ] {
        on_device(arg, buf, c.device)?;
        if stride < c.topk || stride > I32_MAX {
            return Err(bad(
                arg,
                format!(
                    "stride {stride}: want topk {} <= stride <= {I32_MAX}",
                    c.topk
                ),
            ));
        }
        let elems = (n - 1)
            .checked_mul(stride)
            .and_then(|e| e.checked_add(c.topk))
            .unwrap_or(usize::MAX);
        holds(
            arg,
            buf,
            elems,
            4,
            &format!("[{n}, {}] with stride {stride}", c.topk),
        )?;
    }
    flag(c.error_flag.as_ref(), c.device)
}
