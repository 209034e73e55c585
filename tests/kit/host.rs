//! Host mirrors of what the device sees: the element types, strided `[tokens, heads, width]`
//! layouts, queries in every layout the API takes, and paged caches with padded blocks.
//!
//! Every input value is drawn in f64, rounded to the device dtype, and the reference is fed
//! the rounded value (`to_f64` of exactly what was uploaded). Gaps of strided inputs hold NaN
//! (a kernel that reads them poisons its result); outputs are poisoned (0xFFFF / f32 NaN)
//! before each run, and their gaps must still hold the poison afterwards.

use mla_decode::half::{bf16, f16};
use mla_decode::{CacheLayout, Element, Strides, HEAD_DIM, LATENT_DIM, ROPE_DIM};

use super::rng::Rng;

/// The poison bit pattern of half outputs (a NaN in f16 and in bf16).
pub const POISON: u16 = 0xFFFF;

/// f16 or bf16, with what the tests need beyond [`Element`].
pub trait Half: Element {
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
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(bits: u16) -> Self {
        f16::from_bits(bits)
    }
}

impl Half for bf16 {
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(bits: u16) -> Self {
        bf16::from_bits(bits)
    }
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

    /// Its token and head strides.
    pub fn strides(&self) -> Strides {
        Strides {
            token: self.token_stride,
            head: self.head_stride,
        }
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

/// A random lse layout kind, or none (lse not requested) one time in five.
pub fn random_lse_kind(rng: &mut Rng) -> Option<RowsKind> {
    if rng.below(5) == 0 {
        None
    } else {
        Some(Strided::random_kind(rng))
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
    /// Every value times `m` (a power of two that keeps them normal numbers of `T`, so the
    /// uploaded buffers and `values` stay equal).
    pub fn scale_by(&mut self, m: f64) {
        for buf in &mut self.bufs {
            for x in buf.iter_mut() {
                *x = T::from_f64(x.to_f64() * m);
            }
        }
        self.values.iter_mut().for_each(|v| *v *= m);
    }

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
        self.refill_dims(rng, 0..HEAD_DIM, 1.0);
    }

    /// New RoPE values (dims 512..576) `T::from_f64(unit * m)`, `values` from the rounded
    /// ones (so they may be subnormal numbers of `T`).
    pub fn refill_rope(&mut self, rng: &mut Rng, m: f64) {
        self.refill_dims(rng, LATENT_DIM..HEAD_DIM, m);
    }

    /// New values `T::from_f64(unit * m)` in dims `dims` of every (token, head) row.
    fn refill_dims(&mut self, rng: &mut Rng, dims: std::ops::Range<usize>, m: f64) {
        let rope_buf = self.bufs.len() - 1;
        for t in 0..self.tokens {
            for h in 0..self.heads {
                let row = (t * self.heads + h) * HEAD_DIM;
                for d in dims.clone() {
                    let v = T::from_f64(rng.unit() * m);
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
    /// The rows' values as the reference reads them, `[num_slots, 576]`, when they are not
    /// `data` (an fp8 cache quantized from this one: the dequantized rows, super::fp8).
    pub values: Option<Vec<f64>>,
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
            values: None,
        }
    }

    /// Bytes between blocks.
    pub fn stride_bytes(&self) -> usize {
        self.stride * 2
    }

    /// Its layout, as the cache views describe it.
    pub fn layout(&self) -> CacheLayout {
        CacheLayout {
            format: T::DTYPE.kv_format(),
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            block_stride_bytes: self.stride_bytes(),
        }
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

    /// Slot `slot` converted to f64, appended to `dst`.
    pub fn push_row_f64(&self, slot: usize, dst: &mut Vec<f64>) {
        if let Some(v) = &self.values {
            dst.extend_from_slice(&v[slot * HEAD_DIM..][..HEAD_DIM]);
            return;
        }
        dst.extend(self.row(slot).iter().map(|v| v.to_f64()));
    }

    /// Every slot in f64, `[num_slots, 576]` (the padding left out).
    pub fn all_rows_f64(&self) -> Vec<f64> {
        let mut v = Vec::with_capacity(self.num_slots() * HEAD_DIM);
        for slot in 0..self.num_slots() {
            self.push_row_f64(slot, &mut v);
        }
        v
    }
}

/// Rows `[rows, stride]` repacked to `[rows, width]`.
pub fn repack<V: Copy>(v: &[V], rows: usize, stride: usize, width: usize) -> Vec<V> {
    (0..rows)
        .flat_map(|r| v[r * stride..r * stride + width].iter().copied())
        .collect()
}

/// All heads `0..n`.
pub fn all_heads(n: usize) -> Vec<usize> {
    (0..n).collect()
}

/// The first few values of a list, for labels.
pub fn short(v: &[i32]) -> String {
    if v.len() <= 12 {
        format!("{v:?}")
    } else {
        format!("{:?}.. ({} values)", &v[..12], v.len())
    }
}

// ---------------------------------------------------------------------------------------------
// Outputs read back

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
