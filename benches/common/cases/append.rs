//! The cache append alone: new rows written into the cache at their slots, in its format.

use std::sync::Arc;

use mla_decode::cudarc::driver::{CudaSlice, CudaStream};
use mla_decode::half::{bf16, f16};
use mla_decode::reference::fp8;
use mla_decode::{
    append_kv, AppendArgs, DType, Element, ErrorFlag, KvCacheMut, KvFormat, ScaleRule, HEAD_DIM,
};

use super::super::check::Accuracy;
use super::super::rng::Rng;
use super::super::spec::{AppendSpec, CacheKind, CaseSpec};
use super::super::Res;
use super::{Meta, Workload};

/// The cache append alone: `t` random rows `[t, 576]` of `T` written by one `append_kv` into
/// a contiguous cache of `pool` slots (rounded up to whole blocks), at `t` distinct random
/// slots.
///
/// It rotates nothing: its runs keep the memset flush in either `--flush` mode. Every run
/// writes the same bytes to the same slots, so the cache after any run is the one the check
/// expects. The cache starts zeroed; a per-tensor fp8 cache's scale is the rows' largest
/// magnitude / 448, as the decode cases pick theirs.
pub struct AppendCase<T> {
    meta: Meta,
    spec: AppendSpec,
    /// `[t, 576]`, as uploaded.
    rows: Vec<T>,
    /// `[t]`, distinct, in `0..pool`.
    slots: Vec<i64>,
    rows_dev: CudaSlice<T>,
    slots_dev: CudaSlice<i64>,
    cache: CudaSlice<u8>,
    /// A per-tensor fp8 cache's scale (None for the other formats), and its value.
    scale: Option<CudaSlice<f32>>,
    tensor_scale: f32,
    flag: ErrorFlag,
}

impl<T: Element> AppendCase<T> {
    /// Random rows (the bench's value grid) to distinct random slots of a zeroed cache.
    pub fn from_spec(stream: &Arc<CudaStream>, spec: &AppendSpec, rng: &mut Rng) -> Res<Self> {
        let t = spec.tokens;
        let rows = rng.values::<T>(t * HEAD_DIM);
        let slots: Vec<i64> = (rng.sample(spec.pool, t).into_iter())
            .map(|s| s as i64)
            .collect();
        let format = spec.kv.format(T::DTYPE);
        let num_blocks = spec.pool.div_ceil(spec.block_size);
        let amax = rows.iter().fold(0.0f64, |m, v| m.max(v.to_f64().abs()));
        let tensor_scale = (amax / 448.0).max(1e-6) as f32;
        let scale = match spec.kv {
            CacheKind::Fp8 => Some(stream.clone_htod(&[tensor_scale])?),
            _ => None,
        };
        let elem = T::DTYPE.size_bytes() as f64;
        let meta = Meta {
            name: CaseSpec::Append(*spec).name(),
            kind: "append",
            dtype: Some(T::DTYPE),
            kv_format: Some(spec.kv.json_format(T::DTYPE)),
            scale_rule: spec.kv.scale_rule(),
            batch: t,
            q_len: 1,
            heads: 0,
            seq_len: 0,
            topk: 0,
            lens: None,
            block_size: spec.block_size,
            // rows read, slot ids read, cache rows written
            bytes: t as f64 * (HEAD_DIM as f64 * elem + 8.0 + format.row_bytes() as f64),
            flop: 0.0,
            copies: None,
        };
        Ok(AppendCase {
            meta,
            spec: *spec,
            rows_dev: stream.clone_htod(&rows)?,
            slots_dev: stream.clone_htod(&slots)?,
            cache: stream.alloc_zeros::<u8>(num_blocks * spec.block_size * format.row_bytes())?,
            rows,
            slots,
            scale,
            tensor_scale,
            flag: ErrorFlag::new(stream)?,
        })
    }

    /// The cache's format.
    fn format(&self) -> KvFormat {
        self.spec.kv.format(T::DTYPE)
    }

    /// The bytes the append must write for `row`: its own bits (f16/bf16 caches), or the
    /// reference quantizer's row (fp8; from the exact input values, so f16 RoPE values are
    /// rounded to bf16 there as the kernel rounds them).
    fn expected(&self, row: &[T]) -> Vec<u8> {
        let x: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
        match self.spec.kv {
            CacheKind::Query => x.iter().flat_map(|&v| bits16(T::DTYPE, v)).collect(),
            CacheKind::Fp8DsMla(rule) => fp8::quantize_row(&x, rule).to_vec(),
            CacheKind::Fp8 => fp8::quantize_row_per_tensor(&x, self.tensor_scale).to_vec(),
        }
    }
}

/// The little-endian bytes of `v` (exactly representable) as `dtype`.
fn bits16(dtype: DType, v: f64) -> [u8; 2] {
    match dtype {
        DType::Bf16 => bf16::from_f64(v).to_bits().to_le_bytes(),
        DType::F16 => f16::from_f64(v).to_bits().to_le_bytes(),
    }
}

impl<T: Element> Workload for AppendCase<T> {
    fn meta(&self) -> &Meta {
        &self.meta
    }

    fn step(&mut self, stream: &Arc<CudaStream>) -> mla_decode::Result<()> {
        let format = self.format();
        let mut kc = KvCacheMut::contiguous(&mut self.cache, format, self.spec.block_size)?;
        if let Some(scale) = &self.scale {
            kc = kc.with_scale(scale);
        }
        let scale_rule: Option<ScaleRule> = match self.spec.kv {
            CacheKind::Fp8DsMla(rule) => Some(rule),
            _ => None,
        };
        let args = AppendArgs {
            kv: &self.rows_dev,
            kv_token_stride: HEAD_DIM,
            slot_mapping: &self.slots_dev,
            num_tokens: self.spec.tokens,
            scale_rule,
        };
        append_kv(stream, &args, &mut kc, Some(&mut self.flag))
    }

    fn check_flag(&self, stream: &Arc<CudaStream>) -> Res<()> {
        Ok(self.flag.check(stream)?)
    }

    /// Exact: `relerr` is the fraction of appended rows whose cache bytes differ from the
    /// expected ones.
    fn check(&mut self, stream: &Arc<CudaStream>) -> Res<Accuracy> {
        let got = stream.clone_dtoh(&self.cache)?;
        let rb = self.format().row_bytes();
        let rows = self.rows.chunks_exact(HEAD_DIM).zip(&self.slots);
        // unpadded blocks: slot s is row s of the buffer
        let wrong = rows
            .filter(|&(row, &s)| got[s as usize * rb..][..rb] != self.expected(row)[..])
            .count();
        Ok(Accuracy {
            relerr: wrong as f64 / self.slots.len().max(1) as f64,
            lse_err: None,
            tolerance: 0.0, // exact
        })
    }
}
