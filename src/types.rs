//! Element types, cache formats and the fixed dimensions of weight-absorbed MLA.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

use crate::ffi;

// The dims and limits are the C header's (`csrc/mla_decode.h`, through bindgen): defined once.

/// Width of a query row and of a cache row: 512 latent dims then 64 RoPE dims (576).
pub const HEAD_DIM: usize = ffi::MLA_HEAD_DIM as usize;
/// `kv_lora_rank`: the latent part of a row, also the output (V) width (512).
pub const LATENT_DIM: usize = ffi::MLA_LATENT_DIM as usize;
/// The RoPE part of a row (`qk_rope_head_dim`, 64).
pub const ROPE_DIM: usize = ffi::MLA_ROPE_DIM as usize;
/// Most query heads one call handles (heads per GPU, 128).
pub const MAX_HEADS: usize = ffi::MLA_MAX_HEADS as usize;
/// Most query rows per request in dense decode (MTP / speculative decoding, 8).
pub const MAX_Q_LEN: usize = ffi::MLA_MAX_Q_LEN as usize;
/// Most sparse indices per query token (4096).
pub const MAX_TOPK: usize = ffi::MLA_MAX_TOPK as usize;
/// Block sizes (cache rows per block) the kernels accept.
pub const BLOCK_SIZES: [usize; 4] = [16, 32, 64, 128];
/// Most query tokens one [`gather_slots`](crate::gather_slots) call takes (the kernel puts
/// tokens on the grid's y axis).
pub const MAX_GATHER_TOKENS: usize = ffi::MLA_MAX_GATHER_TOKENS as usize;

/// Element type of q, out and an f16/bf16 cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl DType {
    /// Bytes per element (2 for both).
    pub const fn size_bytes(self) -> usize {
        2
    }

    /// Lower-case name: `"f16"` or `"bf16"`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }

    /// The C ABI's value.
    pub const fn to_ffi(self) -> ffi::mla_dtype_t {
        match self {
            DType::F16 => ffi::mla_dtype_t::MLA_DTYPE_F16,
            DType::Bf16 => ffi::mla_dtype_t::MLA_DTYPE_BF16,
        }
    }

    /// The cache format that stores rows of this element type.
    pub const fn kv_format(self) -> KvFormat {
        match self {
            DType::F16 => KvFormat::F16,
            DType::Bf16 => KvFormat::Bf16,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type the kernels take: [`half::f16`] or [`half::bf16`] (sealed).
pub trait Element:
    sealed::Sealed
    + DeviceRepr
    + ValidAsZeroBits
    + crate::buffer::AnyBitPattern
    + Copy
    + Default
    + PartialEq
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Widens to f64 (exact).
    fn to_f64(self) -> f64;
    /// Rounds an f64 to this type (round to nearest even).
    fn from_f64(v: f64) -> Self;
}

impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        half::f16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        half::f16::from_f64(v)
    }
}

impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
    fn to_f64(self) -> f64 {
        half::bf16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        half::bf16::from_f64(v)
    }
}

/// How one cache row of 576 values is stored.
///
/// A [`KvCache`](crate::KvCache) carries its format; a [`DecodePlan`](crate::DecodePlan) is
/// made for one (`DenseShape::kv_format`, `SparseShape::kv_format`). f16 and bf16 caches are
/// read with queries of the same dtype; the fp8 formats with f16 or bf16 queries (the output
/// has the query's dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// 576 f16 values: 1152 bytes per row.
    F16,
    /// 576 bf16 values: 1152 bytes per row.
    Bf16,
    /// The FlashMLA / vLLM sparse format, 656 bytes per row, a scale per 128 latent values.
    ///
    /// Layout of one row, in order:
    /// - bytes `0..512`: the 512 latent values as float8 e4m3;
    /// - bytes `512..528`: 4 fp32 scales, one per 128 latent values (dequant = fp8 · scale);
    /// - bytes `528..656`: the 64 RoPE values as bf16 (not quantized).
    ///
    /// [`append_kv`](crate::append_kv) picks the scales by a [`ScaleRule`].
    Fp8DsMla,
    /// 576 float8 e4m3 values, 576 bytes per row, dequantized with one fp32 scale for the
    /// whole cache (vLLM's `fp8` kv-cache dtype with a per-tensor `k_scale`). The scale lives
    /// in device memory and is part of the cache descriptor
    /// ([`KvCache::with_scale`](crate::KvCache::with_scale)).
    Fp8PerTensor,
}

impl KvFormat {
    /// Every format, in the order of their C ABI values.
    pub const ALL: [KvFormat; 4] = [
        KvFormat::F16,
        KvFormat::Bf16,
        KvFormat::Fp8DsMla,
        KvFormat::Fp8PerTensor,
    ];

    /// Bytes of one cache row: 1152, 1152, 656 or 576.
    pub const fn row_bytes(self) -> usize {
        match self {
            KvFormat::F16 | KvFormat::Bf16 => ffi::MLA_ROW_BYTES_16 as usize,
            KvFormat::Fp8DsMla => ffi::MLA_ROW_BYTES_FP8_DS_MLA as usize,
            KvFormat::Fp8PerTensor => ffi::MLA_ROW_BYTES_FP8 as usize,
        }
    }

    /// Name as the bench's `kv_format` field and the C ABI's `mla_kv_format_t` spell it:
    /// `"f16"`, `"bf16"`, `"fp8_ds_mla"`, `"fp8"` (per-tensor fp8, what engines call
    /// `kv_cache_dtype=fp8`).
    pub const fn name(self) -> &'static str {
        match self {
            KvFormat::F16 => "f16",
            KvFormat::Bf16 => "bf16",
            KvFormat::Fp8DsMla => "fp8_ds_mla",
            KvFormat::Fp8PerTensor => "fp8",
        }
    }

    /// Parses a [`KvFormat::name`]; `"fp8_per_tensor"` is also taken for
    /// [`KvFormat::Fp8PerTensor`].
    pub fn from_name(name: &str) -> Option<KvFormat> {
        if name == "fp8_per_tensor" {
            return Some(KvFormat::Fp8PerTensor);
        }
        KvFormat::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The element type of an f16/bf16 cache; `None` for the fp8 formats.
    pub const fn dtype(self) -> Option<DType> {
        match self {
            KvFormat::F16 => Some(DType::F16),
            KvFormat::Bf16 => Some(DType::Bf16),
            KvFormat::Fp8DsMla | KvFormat::Fp8PerTensor => None,
        }
    }

    /// Whether the cache holds a per-tensor scale ([`KvFormat::Fp8PerTensor`]).
    pub const fn needs_tensor_scale(self) -> bool {
        matches!(self, KvFormat::Fp8PerTensor)
    }

    /// The C ABI's value.
    pub const fn to_ffi(self) -> ffi::mla_kv_format_t {
        match self {
            KvFormat::F16 => ffi::mla_kv_format_t::MLA_KV_F16,
            KvFormat::Bf16 => ffi::mla_kv_format_t::MLA_KV_BF16,
            KvFormat::Fp8DsMla => ffi::mla_kv_format_t::MLA_KV_FP8_DS_MLA,
            KvFormat::Fp8PerTensor => ffi::mla_kv_format_t::MLA_KV_FP8,
        }
    }
}

/// How a writer of an fp8 cache with per-tile scales ([`KvFormat::Fp8DsMla`]) picks each
/// tile's scale from the tile's largest magnitude `amax` (448 is e4m3's largest value).
///
/// The same names are used by the f64 reference
/// ([`reference::fp8`](crate::reference::fp8)), which also computes the scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleRule {
    /// `amax / 448` unrounded (in f32), at least `f32::MIN_POSITIVE`: vLLM's
    /// `concat_and_cache_ds_mla`.
    Raw,
    /// The smallest power of two `>= max(amax / 448, 1e-4)`: FlashMLA's rule (a
    /// power-of-two scale makes dequantization exact in any precision).
    Pow2,
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_are_consistent() {
        assert_eq!((HEAD_DIM, LATENT_DIM, ROPE_DIM), (576, 512, 64));
        assert_eq!(LATENT_DIM + ROPE_DIM, HEAD_DIM);
        assert_eq!((MAX_HEADS, MAX_Q_LEN, MAX_TOPK), (128, 8, 4096));
        // the row layouts the header's byte counts stand for
        assert_eq!(KvFormat::Bf16.row_bytes(), 2 * HEAD_DIM);
        assert_eq!(
            KvFormat::Fp8DsMla.row_bytes(),
            LATENT_DIM + 4 * 4 + 2 * ROPE_DIM
        );
        for f in KvFormat::ALL {
            assert_eq!(KvFormat::ALL[f.to_ffi() as usize], f);
        }
    }

    #[test]
    fn formats() {
        assert_eq!(KvFormat::F16.row_bytes(), 1152);
        assert_eq!(KvFormat::Fp8DsMla.row_bytes(), 656);
        assert_eq!(KvFormat::Fp8PerTensor.row_bytes(), 576);
        for f in KvFormat::ALL {
            assert_eq!(KvFormat::from_name(f.name()), Some(f));
            assert_eq!(f.row_bytes() % 16, 0, "{f}: rows stay 16-byte aligned");
            assert_eq!(f.dtype().map(DType::kv_format), f.dtype().map(|_| f));
        }
        assert_eq!(KvFormat::from_name("fp8"), Some(KvFormat::Fp8PerTensor));
        assert_eq!(
            KvFormat::from_name("fp8_per_tensor"),
            Some(KvFormat::Fp8PerTensor)
        );
        assert_eq!(KvFormat::from_name("e4m3"), None);
        assert_eq!(DType::Bf16.kv_format(), KvFormat::Bf16);
    }

    #[test]
    fn element_round_trip() {
        assert_eq!(<half::bf16 as Element>::DTYPE, DType::Bf16);
        assert_eq!(<half::f16 as Element>::DTYPE, DType::F16);
        assert_eq!(half::f16::from_f64(0.5).to_f64(), 0.5);
        assert_eq!(<half::bf16 as Element>::from_f64(-2.0).to_f64(), -2.0);
    }
}
