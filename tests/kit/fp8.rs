//! fp8 caches for the decode tests: a 16-bit problem's cache ([`DenseSetup`], [`SparseSetup`])
//! quantized by the reference quantizer into `fp8_ds_mla` (raw or pow2 scales) or per-tensor
//! fp8 bytes with the same blocks ([`Fp8Cache`]), and the problem wrapped ([`Fp8`]) so that
//! [`check_problem`](super::dev::check_problem) runs it: the device decodes the bytes, the
//! reference reads the DEQUANTIZED rows (the host cache's `values` override).

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::half::bf16;
use mla_decode::reference::{fp8, Attention};
use mla_decode::*;

use super::dev::{DevLse, DevOut, DevQuery, Problem};
use super::host::{Half, HostCache, HostQuery};
use super::problem::{DenseSetup, SparseSetup};
use super::rng::Rng;

/// Which fp8 format and how its scales are picked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Kind {
    /// `Fp8DsMla` or `Fp8PerTensor`.
    pub format: KvFormat,
    /// The per-tile rule (`Fp8DsMla` only).
    pub rule: Option<ScaleRule>,
}

/// The three kinds: fp8_ds_mla raw (vLLM), fp8_ds_mla pow2 (FlashMLA), per-tensor.
pub const FP8_KINDS: [Fp8Kind; 3] = [
    Fp8Kind {
        format: KvFormat::Fp8DsMla,
        rule: Some(ScaleRule::Raw),
    },
    Fp8Kind {
        format: KvFormat::Fp8DsMla,
        rule: Some(ScaleRule::Pow2),
    },
    Fp8Kind {
        format: KvFormat::Fp8PerTensor,
        rule: None,
    },
];

/// An fp8 cache on the host: the bytes as uploaded (blocks `layout.block_stride_bytes`
/// apart, the padding filled with e4m3 NaN codes) and the per-tensor scale.
#[derive(Clone, Debug)]
pub struct Fp8Cache {
    /// The whole buffer.
    pub bytes: Vec<u8>,
    /// Its geometry and format.
    pub layout: CacheLayout,
    /// The tensor scale (per-tensor fp8; unused by fp8_ds_mla).
    pub tensor_scale: f32,
}

impl Fp8Cache {
    /// Quantizes every row of `cache` into `kind`, each 128-value tile of each row first
    /// multiplied by a random power of two in 2^-4..2^3 (so that rows and tiles have different
    /// scales), and sets `cache.values` to the dequantized rows: the reference then reads
    /// exactly what the bytes hold. Per-tensor: one scale for the cache, from 1/448 of the
    /// largest magnitude (times 0.5..2: the largest values may saturate).
    pub fn quantize<T: Half>(rng: &mut Rng, cache: &mut HostCache<T>, kind: Fp8Kind) -> Fp8Cache {
        Self::quantize_scaled(rng, cache, kind, 1.0)
    }

    /// [`Fp8Cache::quantize`] of every value times `mag` (a power of two; the tensor scale
    /// too): caches whose fp8 scales lie far from 1.
    pub fn quantize_scaled<T: Half>(
        rng: &mut Rng,
        cache: &mut HostCache<T>,
        kind: Fp8Kind,
        mag: f64,
    ) -> Fp8Cache {
        let rb = kind.format.row_bytes();
        let bs = cache.block_size;
        let stride = bs * rb + 16 * rng.below(3);
        let mut bytes = vec![0x7fu8; cache.num_blocks * stride];
        let tensor_scale = (8.0 / 448.0 * rng.pick(&[0.5f64, 1.0, 2.0, 1.37]) * mag) as f32;
        let layout = CacheLayout {
            format: kind.format,
            block_size: bs,
            num_blocks: cache.num_blocks,
            block_stride_bytes: stride,
        };
        let mut values = Vec::with_capacity(cache.num_slots() * HEAD_DIM);
        let mut row = vec![0.0f64; HEAD_DIM];
        for slot in 0..cache.num_slots() {
            for (j, x) in row.iter_mut().enumerate() {
                *x = cache.row(slot)[j].to_f64();
            }
            for tile in row.chunks_mut(128) {
                let m = 2f64.powi(rng.range(0, 8) as i32 - 4) * mag;
                tile.iter_mut().for_each(|x| *x *= m);
            }
            let at = slot_offset(&layout, slot);
            let dst = &mut bytes[at..at + rb];
            match kind.format {
                KvFormat::Fp8DsMla => {
                    let q = fp8::quantize_row(&row, kind.rule.expect("fp8_ds_mla needs a rule"));
                    dst.copy_from_slice(&q);
                    values.extend_from_slice(&fp8::dequantize_row(&q));
                }
                KvFormat::Fp8PerTensor => {
                    let q = fp8::quantize_row_per_tensor(&row, tensor_scale);
                    dst.copy_from_slice(&q);
                    values.extend_from_slice(&fp8::dequantize_row_per_tensor(&q, tensor_scale));
                }
                f => panic!("{f} is not an fp8 format"),
            }
        }
        cache.values = Some(values);
        Fp8Cache {
            bytes,
            layout,
            tensor_scale,
        }
    }

    /// fp8_ds_mla only: new bf16 RoPE values in every row (bytes and `values`, the rows'
    /// dequantized values), `unit * 2^e` rounded to bf16 with e drawn from `exps`.
    pub fn refill_rope(&mut self, rng: &mut Rng, values: &mut [f64], exps: &[i32]) {
        assert_eq!(
            self.layout.format,
            KvFormat::Fp8DsMla,
            "the bf16 RoPE of fp8_ds_mla"
        );
        for slot in 0..values.len() / HEAD_DIM {
            let at = slot_offset(&self.layout, slot) + fp8::ROPE_OFFSET;
            for j in 0..ROPE_DIM {
                let v = bf16::from_f64(rng.unit() * 2f64.powi(rng.pick(exps)));
                self.bytes[at + 2 * j..at + 2 * j + 2].copy_from_slice(&v.to_bits().to_le_bytes());
                values[slot * HEAD_DIM + LATENT_DIM + j] = v.to_f64();
            }
        }
    }

    /// Every byte of the rows of `slots` 0xff: e4m3 NaN, and NaN as an fp32 scale and a bf16
    /// RoPE value (rows a call must never read into its output).
    pub fn nan_rows(&mut self, slots: impl IntoIterator<Item = usize>) {
        let rb = self.layout.format.row_bytes();
        for slot in slots {
            let at = slot_offset(&self.layout, slot);
            self.bytes[at..at + rb].fill(0xff);
        }
    }

    /// Uploads the bytes and the tensor scale.
    pub fn upload(&self, stream: &Arc<CudaStream>) -> Fp8Dev {
        Fp8Dev {
            bytes: stream.clone_htod(&self.bytes).expect("upload fp8 cache"),
            scale: stream
                .clone_htod(&[self.tensor_scale])
                .expect("upload scale"),
        }
    }

    /// The device view of `dev` (an upload of this cache), with its scale if per-tensor.
    pub fn view<'a>(&self, dev: &'a Fp8Dev) -> KvCache<'a> {
        let kv = KvCache::new(&dev.bytes, self.layout);
        if self.layout.format == KvFormat::Fp8PerTensor {
            kv.with_scale(&dev.scale)
        } else {
            kv
        }
    }
}

/// Byte offset of global slot `slot`'s row in a cache laid out as `layout`.
pub fn slot_offset(layout: &CacheLayout, slot: usize) -> usize {
    (slot / layout.block_size) * layout.block_stride_bytes
        + (slot % layout.block_size) * layout.format.row_bytes()
}

/// An uploaded fp8 cache.
pub struct Fp8Dev {
    /// The bytes.
    pub bytes: CudaSlice<u8>,
    /// The tensor scale (one f32).
    pub scale: CudaSlice<f32>,
}

/// A 16-bit problem whose cache is read as fp8: `inner`'s tables, lengths and queries, the
/// cache `fp8` (quantized from `inner.cache`, whose `values` hold the dequantized rows).
pub struct Fp8<P> {
    /// The problem (its 16-bit cache is not used by the device).
    pub inner: P,
    /// The cache the device reads.
    pub fp8: Fp8Cache,
}

impl<T: Half> Fp8<DenseSetup<T>> {
    /// Quantizes `inner`'s cache as [`Fp8Cache::quantize_scaled`] does (`mag` 1: as
    /// [`Fp8Cache::quantize`]).
    pub fn dense(rng: &mut Rng, mut inner: DenseSetup<T>, kind: Fp8Kind, mag: f64) -> Self {
        let fp8 = Fp8Cache::quantize_scaled(rng, &mut inner.cache, kind, mag);
        Fp8 { inner, fp8 }
    }
}

impl<T: Half> Fp8<SparseSetup<T>> {
    /// Quantizes `inner`'s cache as [`Fp8Cache::quantize_scaled`] does.
    pub fn sparse(rng: &mut Rng, mut inner: SparseSetup<T>, kind: Fp8Kind, mag: f64) -> Self {
        let fp8 = Fp8Cache::quantize_scaled(rng, &mut inner.cache, kind, mag);
        Fp8 { inner, fp8 }
    }
}

/// Device buffers of an fp8 problem: the cache bytes and scale, tables/indices and lengths.
pub struct Fp8ProblemDev {
    /// The cache.
    pub cache: Fp8Dev,
    /// Block table or indices.
    pub table: CudaSlice<i32>,
    /// seq_lens or topk_len.
    pub lens: Option<CudaSlice<i32>>,
}

impl<T: Half> Problem for Fp8<DenseSetup<T>> {
    type Elem = T;
    type Dev = Fp8ProblemDev;

    fn rows(&self) -> usize {
        self.inner.rows()
    }

    fn heads(&self) -> usize {
        self.inner.heads
    }

    fn describe(&self) -> String {
        format!("{} {}", self.fp8.layout.format, self.inner.describe())
    }

    fn upload(&self, stream: &Arc<CudaStream>) -> Fp8ProblemDev {
        Fp8ProblemDev {
            cache: self.fp8.upload(stream),
            table: stream.clone_htod(&self.inner.table).expect("upload table"),
            lens: Some(
                stream
                    .clone_htod(&self.inner.seq_lens)
                    .expect("upload seq_lens"),
            ),
        }
    }

    fn plan(&self, stream: &Arc<CudaStream>, options: PlanOptions) -> DecodePlan {
        let shape = DenseShape {
            kv_format: self.fp8.layout.format,
            ..self.inner.shape()
        };
        DecodePlan::dense(stream, shape, options).expect("dense fp8 plan")
    }

    fn decode(
        &self,
        stream: &Arc<CudaStream>,
        dev: &Fp8ProblemDev,
        plan: &mut DecodePlan,
        q: &DevQuery<T>,
        out: &mut DevOut<T>,
        lse: Option<&mut DevLse>,
        flag: Option<&mut ErrorFlag>,
    ) -> mla_decode::Result<()> {
        let kv_cache = self.fp8.view(&dev.cache);
        let lens = dev.lens.as_ref().expect("seq_lens");
        let written = (out, lse, flag);
        (self.inner).decode_over(stream, kv_cache, &dev.table, lens, plan, q, written)
    }

    fn reference_of(&self, q: &HostQuery<T>, heads: &[usize]) -> Attention {
        self.inner.reference(q, heads)
    }
}

impl<T: Half> Problem for Fp8<SparseSetup<T>> {
    type Elem = T;
    type Dev = Fp8ProblemDev;

    fn rows(&self) -> usize {
        self.inner.rows()
    }

    fn heads(&self) -> usize {
        self.inner.heads
    }

    fn describe(&self) -> String {
        format!("{} {}", self.fp8.layout.format, self.inner.describe())
    }

    fn upload(&self, stream: &Arc<CudaStream>) -> Fp8ProblemDev {
        Fp8ProblemDev {
            cache: self.fp8.upload(stream),
            table: stream
                .clone_htod(&self.inner.indices)
                .expect("upload indices"),
            lens: self
                .inner
                .topk_len
                .as_ref()
                .map(|l| stream.clone_htod(l).expect("upload topk_len")),
        }
    }

    fn plan(&self, stream: &Arc<CudaStream>, options: PlanOptions) -> DecodePlan {
        let shape = SparseShape {
            kv_format: self.fp8.layout.format,
            ..self.inner.shape()
        };
        DecodePlan::sparse(stream, shape, options).expect("sparse fp8 plan")
    }

    fn decode(
        &self,
        stream: &Arc<CudaStream>,
        dev: &Fp8ProblemDev,
        plan: &mut DecodePlan,
        q: &DevQuery<T>,
        out: &mut DevOut<T>,
        lse: Option<&mut DevLse>,
        flag: Option<&mut ErrorFlag>,
    ) -> mla_decode::Result<()> {
        let kv_cache = self.fp8.view(&dev.cache);
        let written = (out, lse, flag);
        (self.inner).decode_over(
            stream,
            kv_cache,
            &dev.table,
            dev.lens.as_ref(),
            plan,
            q,
            written,
        )
    }

    fn reference_of(&self, q: &HostQuery<T>, heads: &[usize]) -> Attention {
        self.inner.reference(q, heads)
    }
}
