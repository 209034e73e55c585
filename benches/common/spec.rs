//! The case grammar and the default grid.
//!
//! ```text
//! dense:b=64,q=1,h=8,l=4096,bs=64,dtype=bf16    b, h, l required; q=1, bs=64, dtype=bf16
//! sparse:t=128,h=8,k=2048,dtype=bf16,pool=65536,bs=64
//!                                               t, h required; k=2048, dtype=bf16,
//!                                               pool=65536 (cache slots), bs=64
//! gather:t=128,k=2048,l=65536,bs=64             t required; k=2048, l=65536, bs=64
//! ```
//! A case's name is its canonical spelling ([`CaseSpec::name`]): every dense key, and the
//! sparse and gather keys that differ from their defaults.

use std::fmt;

use mla_decode::{DType, BLOCK_SIZES, MAX_HEADS, MAX_Q_LEN, MAX_TOPK};

/// Cache slots the sparse indices are drawn from unless a case names `pool`.
pub const DEFAULT_POOL: usize = 65_536;
/// Rows per cache block unless a case names `bs`.
pub const DEFAULT_BLOCK_SIZE: usize = 64;
/// Indices per token unless a case names `k`.
pub const DEFAULT_TOPK: usize = 2048;
/// Sequence length of each request of a gather case unless it names `l`.
pub const DEFAULT_GATHER_LEN: usize = 65_536;

/// Dense paged decode: `batch` requests of `seq_len` cached tokens, `q_len` query rows each;
/// with `long` > 0, request 0 has `long` tokens instead (a mixed-length batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenseSpec {
    pub batch: usize,
    pub q_len: usize,
    pub heads: usize,
    pub seq_len: usize,
    pub long: usize,
    pub block_size: usize,
    pub dtype: DType,
}

/// Sparse decode: `tokens` query rows, each attending `topk` distinct slots of a `pool`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseSpec {
    pub tokens: usize,
    pub heads: usize,
    pub topk: usize,
    pub pool: usize,
    pub block_size: usize,
    pub dtype: DType,
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

/// One benchmark case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaseSpec {
    Dense(DenseSpec),
    Sparse(SparseSpec),
    Gather(GatherSpec),
}

/// The cases run when no `--case` is given.
pub const DEFAULT_GRID: &[&str] = &[
    "dense:b=64,h=8,l=4096",
    "dense:b=128,h=8,l=8192",
    "dense:b=32,h=16,l=16384",
    "dense:b=1,h=8,l=4096",
    "dense:b=4,h=8,l=65536",
    "dense:b=64,h=64,l=4096",
    "dense:b=128,h=128,l=4096",
    "dense:b=32,q=2,h=8,l=8192", // GLM-5 at TP8 with one MTP token
    "dense:b=64,h=8,l=4096,dtype=f16",
    "sparse:t=1,h=8",
    "sparse:t=32,h=8",
    "sparse:t=128,h=8",
    "sparse:t=128,h=16",
    "sparse:t=64,h=64",
    "sparse:t=128,h=128",
    "sparse:t=128,h=8,dtype=f16",
    "gather:t=128,k=2048",
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
            "dense" => CaseSpec::Dense(DenseSpec {
                batch: f.count("b", None)?,
                q_len: f.ranged("q", Some(1), 1..=MAX_Q_LEN)?,
                heads: f.ranged("h", None, 1..=MAX_HEADS)?,
                seq_len: f.count("l", None)?,
                long: f.ranged("long", Some(0), 0..=usize::MAX)?,
                block_size: f.block_size()?,
                dtype: f.dtype()?,
            }),
            "sparse" => CaseSpec::Sparse(SparseSpec {
                tokens: f.count("t", None)?,
                heads: f.ranged("h", None, 1..=MAX_HEADS)?,
                topk: f.ranged("k", Some(DEFAULT_TOPK), 1..=MAX_TOPK)?,
                pool: f.count("pool", Some(DEFAULT_POOL))?,
                block_size: f.block_size()?,
                dtype: f.dtype()?,
            }),
            "gather" => CaseSpec::Gather(GatherSpec {
                tokens: f.count("t", None)?,
                topk: f.ranged("k", Some(DEFAULT_TOPK), 1..=MAX_TOPK)?,
                seq_len: f.count("l", Some(DEFAULT_GATHER_LEN))?,
                block_size: f.block_size()?,
            }),
            _ => {
                return Err(format!(
                    "case `{text}`: kind must be dense, sparse or gather"
                ))
            }
        };
        f.finish()?;
        spec.check().map_err(|e| format!("case `{text}`: {e}"))?;
        Ok(spec)
    }

    /// Limits the grammar alone cannot express.
    fn check(&self) -> Result<(), String> {
        match self {
            CaseSpec::Sparse(s) if s.pool < s.topk => Err(format!(
                "pool={} has fewer slots than k={} (slots are drawn without repeats)",
                s.pool, s.topk
            )),
            CaseSpec::Sparse(s) if s.pool > i32::MAX as usize => {
                Err(format!("pool={} does not fit int32 slot ids", s.pool))
            }
            CaseSpec::Gather(g) if g.seq_len < g.topk => Err(format!(
                "l={} is shorter than k={} (positions are drawn without repeats)",
                g.seq_len, g.topk
            )),
            CaseSpec::Dense(d) if d.seq_len < d.q_len => {
                Err(format!("l={} is shorter than q={}", d.seq_len, d.q_len))
            }
            CaseSpec::Dense(d) if d.long > 0 && d.long < d.q_len => {
                Err(format!("long={} is shorter than q={}", d.long, d.q_len))
            }
            _ => Ok(()),
        }
    }

    /// The canonical spelling, which is also the row name.
    pub fn name(&self) -> String {
        self.to_string()
    }

    /// `"dense"`, `"sparse"` or `"gather"` (the JSON `kind`).
    pub fn kind(&self) -> &'static str {
        match self {
            CaseSpec::Dense(_) => "dense",
            CaseSpec::Sparse(_) => "sparse",
            CaseSpec::Gather(_) => "gather",
        }
    }

    /// Whether the case runs a decode plan (the gather does not, so the sm_120
    /// occupancy switch does not apply to it).
    pub fn uses_plan(&self) -> bool {
        !matches!(self, CaseSpec::Gather(_))
    }
}

impl fmt::Display for CaseSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaseSpec::Dense(d) => {
                write!(
                    f,
                    "dense:b={},q={},h={},l={},bs={},dtype={}",
                    d.batch, d.q_len, d.heads, d.seq_len, d.block_size, d.dtype
                )?;
                if d.long > 0 {
                    write!(f, ",long={}", d.long)?;
                }
                Ok(())
            }
            CaseSpec::Sparse(s) => {
                write!(
                    f,
                    "sparse:t={},h={},k={},dtype={}",
                    s.tokens, s.heads, s.topk, s.dtype
                )?;
                if s.pool != DEFAULT_POOL {
                    write!(f, ",pool={}", s.pool)?;
                }
                if s.block_size != DEFAULT_BLOCK_SIZE {
                    write!(f, ",bs={}", s.block_size)?;
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

    fn take(&mut self, key: &str) -> Option<&'a str> {
        let i = self.pairs.iter().position(|(k, _)| *k == key)?;
        Some(self.pairs.remove(i).1)
    }

    fn count(&mut self, key: &str, default: Option<usize>) -> Result<usize, String> {
        self.ranged(key, default, 1..=usize::MAX)
    }

    fn ranged(
        &mut self,
        key: &str,
        default: Option<usize>,
        range: std::ops::RangeInclusive<usize>,
    ) -> Result<usize, String> {
        let text = self.text;
        let v = match (self.take(key), default) {
            (Some(v), _) => v
                .parse::<usize>()
                .map_err(|_| format!("case `{text}`: {key}=`{v}` is not a count"))?,
            (None, Some(d)) => d,
            (None, None) => return Err(format!("case `{text}`: `{key}` is required")),
        };
        if !range.contains(&v) {
            let allowed = match *range.end() {
                usize::MAX => format!("must be at least {}", range.start()),
                end => format!("outside {}..={end}", range.start()),
            };
            return Err(format!("case `{text}`: {key}={v} {allowed}"));
        }
        Ok(v)
    }

    fn block_size(&mut self) -> Result<usize, String> {
        let bs = self.count("bs", Some(DEFAULT_BLOCK_SIZE))?;
        if BLOCK_SIZES.contains(&bs) {
            Ok(bs)
        } else {
            Err(format!(
                "case `{}`: bs={bs} is not one of {BLOCK_SIZES:?}",
                self.text
            ))
        }
    }

    fn dtype(&mut self) -> Result<DType, String> {
        match self.take("dtype") {
            None | Some("bf16") => Ok(DType::Bf16),
            Some("f16") => Ok(DType::F16),
            Some(other) => Err(format!(
                "case `{}`: dtype=`{other}` (expected bf16 or f16)",
                self.text
            )),
        }
    }

    fn finish(self) -> Result<(), String> {
        match self.pairs.first() {
            None => Ok(()),
            Some((k, _)) => Err(format!("case `{}`: unknown key `{k}`", self.text)),
        }
    }
}
