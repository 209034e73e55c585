//! The case grammar and the default grid.
//!
//! ```text
//! dense:b=64,q=1,h=8,l=4096,bs=64,dtype=bf16    h and l (or lens) required; q=1, bs=64, dtype=bf16
//! dense:h=8,lens=uniform:1-8192,b=64[,seed=0]   lengths uniform in 1..=8192 (b required)
//! dense:h=8,lens=512*15+8192*1                  15 requests of 512 tokens, then 1 of 8192
//! sparse:t=128,h=8,k=2048,dtype=bf16,pool=65536,bs=64
//!                                               t, h required; k=2048, dtype=bf16,
//!                                               pool=65536 (cache slots), bs=64
//! sparse:t=64,h=8,klen=uniform:1-2048[,seed=0]  per-row topk_len uniform in 1..=2048 (k=HI)
//! dense/sparse ...,kv=fp8_ds_mla                the cache format: kv=fp8_ds_mla (vLLM's raw
//!                                               scales), kv=fp8_ds_mla_pow2 (FlashMLA's pow2
//!                                               scales), kv=fp8 (per-tensor); default: the
//!                                               query's dtype (kv=bf16 / kv=f16)
//! gather:t=128,k=2048,l=65536,bs=64             t required; k=2048, l=65536, bs=64
//! append:t=128,dtype=bf16,kv=fp8_ds_mla,bs=64,pool=65536
//!                                               t required (rows per call); dtype=bf16
//!                                               (the new rows'), kv= as above (default:
//!                                               the dtype's own), bs=64, pool=max(65536, t)
//!                                               (cache slots, at least t)
//! ```
//! Lengths ([`Lens`]): `uniform:LO-HI` draws each one uniformly in `LO..=HI` (inclusive) from
//! the case's `seed` (default 0); `A*N+B*M+...` is N of A, then M of B, and so on. With
//! `lens`, dense `b` is optional (it must equal the count when given; `uniform` needs it)
//! and so is `l` (the longest length sizes the block table; a given `l` must be at least
//! that and sizes it instead); every length must be at least `q`. With `klen`, sparse `t` is
//! optional in the same way, `k` defaults to the longest `klen` and must not be shorter.
//! `long=N` (older spelling) is `lens=N*1+L*(b-1)`.
//!
//! A case's name is its canonical spelling ([`CaseSpec::name`]; it parses back to the same
//! case): every dense key but `lens`/`seed` when not used, and the sparse, gather and append
//! keys that differ from their defaults (sparse and append always name `dtype`).

use std::fmt;

use mla_decode::{DType, KvFormat, ScaleRule, BLOCK_SIZES, MAX_HEADS, MAX_Q_LEN, MAX_TOPK};

use super::rng::Rng;

/// Cache slots the sparse indices are drawn from unless a case names `pool`.
pub const DEFAULT_POOL: usize = 65_536;
/// Rows per cache block unless a case names `bs`.
pub const DEFAULT_BLOCK_SIZE: usize = 64;
/// Indices per token unless a case names `k` (or `klen`).
pub const DEFAULT_TOPK: usize = 2048;
/// Sequence length of each request of a gather case unless it names `l`.
pub const DEFAULT_GATHER_LEN: usize = 65_536;

/// The cache format of a dense, sparse or append case (`kv=`): the query's dtype (the
/// append's: its rows' dtype; the default), or an fp8 format (written by the reference
/// quantizer, or by the append under test).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CacheKind {
    /// f16/bf16 rows of the query's dtype.
    #[default]
    Query,
    /// `kv=fp8_ds_mla` (raw scales, vLLM) or `kv=fp8_ds_mla_pow2` (pow2 scales, FlashMLA).
    Fp8DsMla(ScaleRule),
    /// `kv=fp8`: per-tensor fp8, one fp32 scale.
    Fp8,
}

impl CacheKind {
    /// The library's format for queries of `dtype`.
    pub fn format(self, dtype: DType) -> KvFormat {
        match self {
            CacheKind::Query => dtype.kv_format(),
            CacheKind::Fp8DsMla(_) => KvFormat::Fp8DsMla,
            CacheKind::Fp8 => KvFormat::Fp8PerTensor,
        }
    }

    /// The JSON's `kv_format`: `bf16`, `f16`, `fp8_ds_mla` or `fp8`.
    pub fn json_format(self, dtype: DType) -> &'static str {
        match self {
            CacheKind::Query => dtype.kv_format().name(),
            CacheKind::Fp8DsMla(_) => "fp8_ds_mla",
            CacheKind::Fp8 => "fp8",
        }
    }

    /// The JSON's `scale_rule`: `raw`, `pow2`, `tensor` (per-tensor fp8), None for f16/bf16.
    pub fn scale_rule(self) -> Option<&'static str> {
        match self {
            CacheKind::Query => None,
            CacheKind::Fp8DsMla(ScaleRule::Raw) => Some("raw"),
            CacheKind::Fp8DsMla(ScaleRule::Pow2) => Some("pow2"),
            CacheKind::Fp8 => Some("tensor"),
        }
    }

    /// The `kv=` value (None for the default).
    pub fn key(self) -> Option<&'static str> {
        match self {
            CacheKind::Query => None,
            CacheKind::Fp8DsMla(ScaleRule::Raw) => Some("fp8_ds_mla"),
            CacheKind::Fp8DsMla(ScaleRule::Pow2) => Some("fp8_ds_mla_pow2"),
            CacheKind::Fp8 => Some("fp8"),
        }
    }
}

/// Per-request lengths (dense `lens`) or per-row topk_len (sparse `klen`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lens {
    /// `uniform:LO-HI`: each drawn uniformly in `lo..=hi` from the case's seed.
    Uniform { lo: usize, hi: usize },
    /// `A*N+B*M+...`: `(length, count)` runs, in order.
    Runs(Vec<(usize, usize)>),
}

impl Lens {
    /// Parses `uniform:LO-HI` or `A*N+B*M+...`.
    pub fn parse(text: &str) -> Result<Lens, String> {
        let count = |v: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{v}` is not a count"))
        };
        if let Some(range) = text.strip_prefix("uniform:") {
            let (lo, hi) = range
                .split_once('-')
                .ok_or_else(|| format!("`{text}`: expected uniform:LO-HI"))?;
            let (lo, hi) = (count(lo)?, count(hi)?);
            if lo > hi {
                return Err(format!("`{text}`: LO > HI"));
            }
            return Ok(Lens::Uniform { lo, hi });
        }
        let mut runs = Vec::new();
        for term in text.split('+') {
            let (len, n) = term
                .split_once('*')
                .ok_or_else(|| format!("`{term}` in `{text}`: expected LEN*COUNT"))?;
            let (len, n) = (count(len)?, count(n)?);
            if n == 0 {
                return Err(format!("`{term}` in `{text}`: a count of 0"));
            }
            runs.push((len, n));
        }
        Ok(Lens::Runs(runs))
    }

    /// How many lengths the runs give (None for `uniform`, whose count is the case's).
    pub fn count(&self) -> Option<usize> {
        match self {
            Lens::Uniform { .. } => None,
            Lens::Runs(runs) => Some(runs.iter().map(|r| r.1).sum()),
        }
    }

    /// The shortest and the longest length it can give.
    pub fn bounds(&self) -> (usize, usize) {
        match self {
            Lens::Uniform { lo, hi } => (*lo, *hi),
            Lens::Runs(runs) => (
                runs.iter().map(|r| r.0).min().unwrap_or(0),
                runs.iter().map(|r| r.0).max().unwrap_or(0),
            ),
        }
    }

    /// The `n` lengths (`uniform` draws them from `seed`).
    pub fn values(&self, n: usize, seed: u64) -> Vec<usize> {
        match self {
            Lens::Uniform { lo, hi } => {
                let mut rng = Rng::new(seed);
                (0..n).map(|_| rng.range(*lo, *hi)).collect()
            }
            Lens::Runs(runs) => runs
                .iter()
                .flat_map(|&(len, k)| std::iter::repeat_n(len, k))
                .collect(),
        }
    }
}

impl fmt::Display for Lens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Lens::Uniform { lo, hi } => write!(f, "uniform:{lo}-{hi}"),
            Lens::Runs(runs) => {
                for (i, (len, n)) in runs.iter().enumerate() {
                    write!(f, "{}{len}*{n}", if i > 0 { "+" } else { "" })?;
                }
                Ok(())
            }
        }
    }
}

/// Dense paged decode: `batch` requests of `seq_len` cached tokens each (or of the lengths
/// `lens` gives), `q_len` query rows each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DenseSpec {
    pub batch: usize,
    pub q_len: usize,
    pub heads: usize,
    /// `l`: every request's length, or with `lens` the length the block table holds.
    pub seq_len: Option<usize>,
    pub lens: Option<Lens>,
    /// Seed of `lens=uniform:...`.
    pub seed: u64,
    pub block_size: usize,
    pub dtype: DType,
    /// The cache format (`kv=`).
    pub kv: CacheKind,
}

impl DenseSpec {
    /// Cached tokens of each request.
    pub fn seq_lens(&self) -> Vec<usize> {
        match (&self.lens, self.seq_len) {
            (Some(lens), _) => lens.values(self.batch, self.seed),
            (None, Some(l)) => vec![l; self.batch],
            (None, None) => Vec::new(), // not parsed: `check` refuses it
        }
    }

    /// The length the block table holds: `l`, else the longest request.
    pub fn table_len(&self) -> usize {
        self.seq_len
            .unwrap_or_else(|| self.seq_lens().into_iter().max().unwrap_or(0))
    }

    /// The lengths as the JSON's `lens` spells them: `L*B`, or the `lens` key.
    pub fn lens_label(&self) -> String {
        match (&self.lens, self.seq_len) {
            (Some(lens), _) => lens.to_string(),
            (None, l) => format!("{}*{}", l.unwrap_or(0), self.batch),
        }
    }
}

/// Sparse decode: `tokens` query rows, each attending `topk` distinct slots of a `pool`
/// (the first `klen` of them where `klen` is given, through topk_len).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SparseSpec {
    pub tokens: usize,
    pub heads: usize,
    pub topk: usize,
    /// Per-row topk_len.
    pub klen: Option<Lens>,
    /// Seed of `klen=uniform:...`.
    pub seed: u64,
    pub pool: usize,
    pub block_size: usize,
    pub dtype: DType,
    /// The cache format (`kv=`).
    pub kv: CacheKind,
}

impl SparseSpec {
    /// topk_len of each row (None: every row reads `topk`).
    pub fn topk_lens(&self) -> Option<Vec<usize>> {
        self.klen.as_ref().map(|k| k.values(self.tokens, self.seed))
    }

    /// The per-row lengths as the JSON's `lens` spells them: `K*T`, or the `klen` key.
    pub fn lens_label(&self) -> String {
        match &self.klen {
            Some(k) => k.to_string(),
            None => format!("{}*{}", self.topk, self.tokens),
        }
    }
}

/// The index gather alone: `tokens` rows of `topk` logical positions in requests of
/// `seq_len` tokens (one request per token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherSpec {
    pub tokens: usize,
    pub topk: usize,
    pub seq_len: usize,
    pub block_size: usize,
}

/// The cache append alone: `tokens` new rows of `dtype` per call, quantized into a `kv`
/// cache of `pool` slots at distinct random slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendSpec {
    pub tokens: usize,
    /// The new rows' dtype (a 16-bit cache's too).
    pub dtype: DType,
    /// The cache format (`kv=`).
    pub kv: CacheKind,
    pub block_size: usize,
    /// Cache slots (at least `tokens`).
    pub pool: usize,
}

impl AppendSpec {
    /// Cache slots unless the case names `pool`: [`DEFAULT_POOL`], or `tokens` if more.
    pub fn default_pool(tokens: usize) -> usize {
        DEFAULT_POOL.max(tokens)
    }
}

/// One benchmark case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaseSpec {
    Dense(DenseSpec),
    Sparse(SparseSpec),
    Gather(GatherSpec),
    Append(AppendSpec),
}

/// The cases run when no `--case` is given.
pub const DEFAULT_GRID: &[&str] = &[
    "dense:b=64,h=8,l=4096",
    "dense:b=128,h=8,l=8192",
    "dense:b=32,h=16,l=16384",
    "dense:b=16,h=8,l=4096",
    "dense:b=1,h=8,l=4096",
    "dense:b=1,h=8,l=1", // the one-token call
    "dense:b=4,h=8,l=65536",
    "dense:h=8,lens=uniform:1-8192,b=64",
    "dense:h=8,lens=512*15+8192*1",
    "dense:h=16,lens=1024*127+65536*1",
    "dense:b=64,h=64,l=4096",
    "dense:b=128,h=128,l=4096",
    "dense:b=32,q=4,h=16,l=4096", // 64 query rows per cache row: MTP x heads (issue #15)
    "dense:b=32,q=2,h=8,l=8192",  // GLM-5 at TP8 with one MTP token
    "dense:b=16,q=3,h=8,l=4096",  // two MTP tokens: 24 query rows, one 32-row CTA (log #84 (b))
    "dense:b=4,h=16,l=4096",      // a medium step: one 4-warp CTA per SM (log #84 (c))
    "dense:b=1024,h=16,l=64",     // short requests: one 16-row CTA per SM (log #85 (b))
    "dense:b=1024,h=64,l=256",    // 16-row CTAs, the 1-slice combine (log #85 (a), (e))
    "dense:b=64,h=8,l=4096,dtype=f16",
    "dense:b=64,h=8,l=4096,kv=fp8_ds_mla",
    "dense:b=128,h=8,l=8192,kv=fp8_ds_mla",
    "dense:b=1,h=8,l=4096,kv=fp8_ds_mla",
    "dense:b=64,h=64,l=4096,kv=fp8_ds_mla",
    "dense:b=64,h=8,l=4096,kv=fp8",
    "sparse:t=1,h=8",
    "sparse:t=1,h=8,k=1",
    "sparse:t=2,h=128,k=32", // the row kernel over two waves (log #85 (d))
    "sparse:t=32,h=8",
    "sparse:t=128,h=8",
    "sparse:t=64,h=8,klen=uniform:1-2048",
    "sparse:t=128,h=16",
    "sparse:t=64,h=64",
    "sparse:t=128,h=128",
    "sparse:t=128,h=32", // issue #15's compute-bound rows
    "sparse:t=128,h=8,dtype=f16",
    // fp8_ds_mla and their bf16 twins over a pool larger than the H200's L2 (86 MB in fp8)
    "sparse:t=1,h=8,pool=131072,kv=fp8_ds_mla",
    "sparse:t=1,h=8,pool=131072",
    "sparse:t=32,h=8,pool=131072,kv=fp8_ds_mla",
    "sparse:t=32,h=8,pool=131072",
    "sparse:t=128,h=8,pool=131072,kv=fp8_ds_mla",
    "sparse:t=128,h=8,pool=131072",
    "sparse:t=128,h=16,pool=131072,kv=fp8_ds_mla",
    "sparse:t=128,h=16,pool=131072",
    "sparse:t=64,h=64,pool=131072,kv=fp8_ds_mla",
    "sparse:t=64,h=64,pool=131072",
    "sparse:t=128,h=128,pool=131072,kv=fp8_ds_mla",
    "sparse:t=128,h=128,pool=131072",
    "gather:t=128,k=2048",
    "append:t=128,kv=fp8_ds_mla",
    "append:t=4096,kv=fp8_ds_mla",
];

/// The default grid, parsed.
pub fn default_cases() -> Vec<CaseSpec> {
    DEFAULT_GRID
        .iter()
        .map(|s| CaseSpec::parse(s).expect("the default grid parses"))
        .collect()
}

impl CaseSpec {
    /// Parses `kind:key=value,...` (see the module docs).
    pub fn parse(text: &str) -> Result<CaseSpec, String> {
        let (kind, rest) = text
            .split_once(':')
            .ok_or_else(|| format!("case `{text}`: expected KIND:key=value,..."))?;
        let mut f = Fields::parse(text, rest)?;
        let spec = match kind {
            "dense" => CaseSpec::Dense(f.dense()?),
            "sparse" => CaseSpec::Sparse(f.sparse()?),
            "gather" => CaseSpec::Gather(GatherSpec {
                tokens: f.count("t", None)?,
                topk: f.ranged("k", Some(DEFAULT_TOPK), 1..=MAX_TOPK)?,
                seq_len: f.count("l", Some(DEFAULT_GATHER_LEN))?,
                block_size: f.block_size()?,
            }),
            "append" => CaseSpec::Append(f.append()?),
            _ => {
                return Err(format!(
                    "case `{text}`: kind must be dense, sparse, gather or append"
                ))
            }
        };
        f.finish()?;
        spec.check().map_err(|e| format!("case `{text}`: {e}"))?;
        Ok(spec)
    }

    /// Limits the grammar alone cannot express.
    fn check(&self) -> Result<(), String> {
        let fits_i32 = |what: &str, v: usize| {
            if v > i32::MAX as usize {
                Err(format!("{what}={v} does not fit int32"))
            } else {
                Ok(())
            }
        };
        match self {
            CaseSpec::Sparse(s) if s.pool < s.topk => Err(format!(
                "pool={} has fewer slots than k={} (slots are drawn without repeats)",
                s.pool, s.topk
            )),
            CaseSpec::Sparse(s) => fits_i32("pool", s.pool),
            CaseSpec::Gather(g) if g.seq_len < g.topk => Err(format!(
                "l={} is shorter than k={} (positions are drawn without repeats)",
                g.seq_len, g.topk
            )),
            CaseSpec::Append(a) if a.pool < a.tokens => Err(format!(
                "pool={} has fewer slots than t={} (slots are drawn without repeats)",
                a.pool, a.tokens
            )),
            CaseSpec::Append(a) => fits_i32("pool", a.pool),
            CaseSpec::Dense(d) => {
                let (shortest, longest) = match (&d.lens, d.seq_len) {
                    (Some(lens), _) => lens.bounds(),
                    (None, Some(l)) => (l, l),
                    (None, None) => return Err("`l` (or `lens`) is required".into()),
                };
                if shortest < d.q_len {
                    let what = if d.lens.is_some() { "a length" } else { "l" };
                    return Err(format!(
                        "{what} of {shortest} is shorter than q={}",
                        d.q_len
                    ));
                }
                if let (Some(_), Some(l)) = (&d.lens, d.seq_len) {
                    if l < longest {
                        return Err(format!(
                            "l={l} is shorter than the longest length {longest}"
                        ));
                    }
                }
                fits_i32("l", longest.max(d.seq_len.unwrap_or(0)))
            }
            _ => Ok(()),
        }
    }

    /// The canonical spelling, which is also the row name.
    pub fn name(&self) -> String {
        self.to_string()
    }

    /// `"dense"`, `"sparse"`, `"gather"` or `"append"` (the JSON `kind`).
    pub fn kind(&self) -> &'static str {
        match self {
            CaseSpec::Dense(_) => "dense",
            CaseSpec::Sparse(_) => "sparse",
            CaseSpec::Gather(_) => "gather",
            CaseSpec::Append(_) => "append",
        }
    }

    /// Whether the case runs a decode plan (the gather and the append do not, so the sm_120
    /// occupancy switch does not apply to them).
    pub fn uses_plan(&self) -> bool {
        !matches!(self, CaseSpec::Gather(_) | CaseSpec::Append(_))
    }
}

impl fmt::Display for CaseSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaseSpec::Dense(d) => {
                write!(f, "dense:b={},q={},h={}", d.batch, d.q_len, d.heads)?;
                if let Some(l) = d.seq_len {
                    write!(f, ",l={l}")?;
                }
                if let Some(lens) = &d.lens {
                    write!(f, ",lens={lens}")?;
                }
                write!(f, ",bs={},dtype={}", d.block_size, d.dtype)?;
                if d.seed != 0 {
                    write!(f, ",seed={}", d.seed)?;
                }
                if let Some(kv) = d.kv.key() {
                    write!(f, ",kv={kv}")?;
                }
                Ok(())
            }
            CaseSpec::Sparse(s) => {
                write!(
                    f,
                    "sparse:t={},h={},k={},dtype={}",
                    s.tokens, s.heads, s.topk, s.dtype
                )?;
                if let Some(klen) = &s.klen {
                    write!(f, ",klen={klen}")?;
                }
                if s.pool != DEFAULT_POOL {
                    write!(f, ",pool={}", s.pool)?;
                }
                if s.block_size != DEFAULT_BLOCK_SIZE {
                    write!(f, ",bs={}", s.block_size)?;
                }
                if s.seed != 0 {
                    write!(f, ",seed={}", s.seed)?;
                }
                if let Some(kv) = s.kv.key() {
                    write!(f, ",kv={kv}")?;
                }
                Ok(())
            }
            CaseSpec::Gather(g) => {
                write!(f, "gather:t={},k={}", g.tokens, g.topk)?;
                if g.seq_len != DEFAULT_GATHER_LEN {
                    write!(f, ",l={}", g.seq_len)?;
                }
                if g.block_size != DEFAULT_BLOCK_SIZE {
                    write!(f, ",bs={}", g.block_size)?;
                }
                Ok(())
            }
            CaseSpec::Append(a) => {
                write!(f, "append:t={},dtype={}", a.tokens, a.dtype)?;
                if a.pool != AppendSpec::default_pool(a.tokens) {
                    write!(f, ",pool={}", a.pool)?;
                }
                if a.block_size != DEFAULT_BLOCK_SIZE {
                    write!(f, ",bs={}", a.block_size)?;
                }
                if let Some(kv) = a.kv.key() {
                    write!(f, ",kv={kv}")?;
                }
                Ok(())
            }
        }
    }
}

/// The `key=value` pairs of one case; each getter consumes its key.
struct Fields<'a> {
    text: &'a str,
    pairs: Vec<(&'a str, &'a str)>,
}

impl<'a> Fields<'a> {
    fn parse(text: &'a str, rest: &'a str) -> Result<Self, String> {
        let mut pairs: Vec<(&str, &str)> = Vec::new();
        for item in rest.split(',').filter(|s| !s.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| format!("case `{text}`: `{item}` is not key=value"))?;
            let (k, v) = (k.trim(), v.trim());
            if pairs.iter().any(|(seen, _)| *seen == k) {
                return Err(format!("case `{text}`: `{k}` given twice"));
            }
            pairs.push((k, v));
        }
        Ok(Fields { text, pairs })
    }

    fn err(&self, what: impl fmt::Display) -> String {
        format!("case `{}`: {what}", self.text)
    }

    fn take(&mut self, key: &str) -> Option<&'a str> {
        let i = self.pairs.iter().position(|(k, _)| *k == key)?;
        Some(self.pairs.remove(i).1)
    }

    fn count(&mut self, key: &str, default: Option<usize>) -> Result<usize, String> {
        self.ranged(key, default, 1..=usize::MAX)
    }

    /// An optional count (None when absent).
    fn maybe(
        &mut self,
        key: &str,
        range: std::ops::RangeInclusive<usize>,
    ) -> Result<Option<usize>, String> {
        if self.pairs.iter().any(|(k, _)| *k == key) {
            self.ranged(key, None, range).map(Some)
        } else {
            Ok(None)
        }
    }

    fn ranged(
        &mut self,
        key: &str,
        default: Option<usize>,
        range: std::ops::RangeInclusive<usize>,
    ) -> Result<usize, String> {
        let v = match (self.take(key), default) {
            (Some(v), _) => v
                .parse::<usize>()
                .map_err(|_| self.err(format!("{key}=`{v}` is not a count")))?,
            (None, Some(d)) => d,
            (None, None) => return Err(self.err(format!("`{key}` is required"))),
        };
        if !range.contains(&v) {
            let allowed = match *range.end() {
                usize::MAX => format!("must be at least {}", range.start()),
                end => format!("outside {}..={end}", range.start()),
            };
            return Err(self.err(format!("{key}={v} {allowed}")));
        }
        Ok(v)
    }

    fn lens(&mut self, key: &str) -> Result<Option<Lens>, String> {
        match self.take(key) {
            None => Ok(None),
            Some(v) => Lens::parse(v)
                .map(Some)
                .map_err(|e| self.err(format!("{key}: {e}"))),
        }
    }

    /// `seed` (0 by default), which only `uniform` lengths use.
    fn seed(&mut self, lens: Option<&Lens>) -> Result<u64, String> {
        match self.take("seed") {
            None => Ok(0),
            Some(_) if !matches!(lens, Some(Lens::Uniform { .. })) => {
                Err(self.err("seed= is only used by uniform:LO-HI lengths"))
            }
            Some(v) => v
                .parse::<u64>()
                .map_err(|_| self.err(format!("seed=`{v}` is not a u64"))),
        }
    }

    /// The request count: `key` (`b` / `t`), which must equal the count of runs when both
    /// are given.
    fn batch(&mut self, key: &str, lens: Option<&Lens>) -> Result<usize, String> {
        let given = self.maybe(key, 1..=usize::MAX)?;
        match (given, lens.and_then(Lens::count)) {
            (Some(b), Some(n)) if b != n => Err(self.err(format!(
                "{key}={b} but the lengths give {n} (leave {key} out or make them agree)"
            ))),
            (Some(b), _) | (None, Some(b)) => Ok(b),
            (None, None) => Err(self.err(format!("`{key}` is required"))),
        }
    }

    fn dense(&mut self) -> Result<DenseSpec, String> {
        let mut lens = self.lens("lens")?;
        let long = self.maybe("long", 1..=usize::MAX)?;
        let q_len = self.ranged("q", Some(1), 1..=MAX_Q_LEN)?;
        let heads = self.ranged("h", None, 1..=MAX_HEADS)?;
        let mut seq_len = self.maybe("l", 1..=usize::MAX)?;
        let seed = self.seed(lens.as_ref())?;
        let batch = if let Some(long) = long {
            // The older spelling of one long request: lens=LONG*1+L*(b-1).
            let (Some(l), None) = (seq_len, &lens) else {
                return Err(self.err("long=N needs l= and no lens="));
            };
            let b = self.count("b", None)?;
            let mut runs = vec![(long, 1)];
            if b > 1 {
                runs.push((l, b - 1));
            }
            lens = Some(Lens::Runs(runs));
            seq_len = None;
            b
        } else {
            self.batch("b", lens.as_ref())?
        };
        let dtype = self.dtype()?;
        Ok(DenseSpec {
            batch,
            q_len,
            heads,
            seq_len,
            lens,
            seed,
            block_size: self.block_size()?,
            dtype,
            kv: self.kv(dtype)?,
        })
    }

    fn sparse(&mut self) -> Result<SparseSpec, String> {
        let klen = self.lens("klen")?;
        let tokens = self.batch("t", klen.as_ref())?;
        let heads = self.ranged("h", None, 1..=MAX_HEADS)?;
        let longest = klen.as_ref().map(|k| k.bounds().1);
        if let Some(hi) = longest.filter(|&hi| hi > MAX_TOPK) {
            return Err(self.err(format!("klen reaches {hi}, more than {MAX_TOPK}")));
        }
        let topk = self.ranged(
            "k",
            Some(longest.unwrap_or(DEFAULT_TOPK).max(1)),
            1..=MAX_TOPK,
        )?;
        if let Some(hi) = longest.filter(|&hi| hi > topk) {
            return Err(self.err(format!("klen reaches {hi}, more than k={topk}")));
        }
        let seed = self.seed(klen.as_ref())?;
        let dtype = self.dtype()?;
        Ok(SparseSpec {
            tokens,
            heads,
            topk,
            klen,
            seed,
            pool: self.count("pool", Some(DEFAULT_POOL))?,
            block_size: self.block_size()?,
            dtype,
            kv: self.kv(dtype)?,
        })
    }

    fn append(&mut self) -> Result<AppendSpec, String> {
        let tokens = self.count("t", None)?;
        let dtype = self.dtype()?;
        Ok(AppendSpec {
            tokens,
            dtype,
            kv: self.kv(dtype)?,
            block_size: self.block_size()?,
            pool: self.count("pool", Some(AppendSpec::default_pool(tokens)))?,
        })
    }

    fn block_size(&mut self) -> Result<usize, String> {
        let bs = self.count("bs", Some(DEFAULT_BLOCK_SIZE))?;
        if BLOCK_SIZES.contains(&bs) {
            Ok(bs)
        } else {
            Err(self.err(format!("bs={bs} is not one of {BLOCK_SIZES:?}")))
        }
    }

    fn dtype(&mut self) -> Result<DType, String> {
        match self.take("dtype") {
            None | Some("bf16") => Ok(DType::Bf16),
            Some("f16") => Ok(DType::F16),
            Some(other) => Err(self.err(format!("dtype=`{other}` (expected bf16 or f16)"))),
        }
    }

    /// `kv=`: the query's (append: the rows') dtype by default (and when named), or an fp8
    /// format.
    fn kv(&mut self, dtype: DType) -> Result<CacheKind, String> {
        match self.take("kv") {
            None => Ok(CacheKind::Query),
            Some(v) if v == dtype.name() => Ok(CacheKind::Query),
            Some("fp8_ds_mla") => Ok(CacheKind::Fp8DsMla(ScaleRule::Raw)),
            Some("fp8_ds_mla_pow2") => Ok(CacheKind::Fp8DsMla(ScaleRule::Pow2)),
            Some("fp8") => Ok(CacheKind::Fp8),
            Some(other) => Err(self.err(format!(
                "kv=`{other}` (expected {}, fp8_ds_mla, fp8_ds_mla_pow2 or fp8)",
                dtype.name()
            ))),
        }
    }

    fn finish(self) -> Result<(), String> {
        match self.pairs.first() {
            None => Ok(()),
            Some((k, _)) => Err(self.err(format!("unknown key `{k}`"))),
        }
    }
}
