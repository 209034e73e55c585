// Quantize-and-append: f16/bf16 576-wide rows (512 latent + 64 RoPE) into an fp8 cache through
// an int64 slot mapping, in either fp8 format (csrc/common/fp8.cuh; the rules bit for bit and
// the peers' differences: docs/wip/fp8-notes.md):
//   - Fp8CacheFormat::DsMla: 656-byte fp8_ds_mla rows. Per tile of 128 latent values:
//     amax = max |x| over the tile (fp32, NaNs ignored, as fmaxf), scale = raw or pow2 rule
//     (Fp8ScaleRule), e4m3 = RNE-satfinite(x / scale) with IEEE division (NaN -> 0x7f); the
//     4 scales as little-endian fp32 at [512,528); the 64 RoPE values as bf16 at [528,656):
//     bf16 input copied bit for bit, f16 input rounded to bf16 (nearest even, NaN -> 0x7fc0).
//   - Fp8CacheFormat::PerTensor: 576-byte rows, every value (RoPE too) RNE-satfinite(x / s)
//     with s = *tensor_scale read on the device (graph-safe: the caller may update it).
// A slot of -1 is skipped; any other slot outside [0, num_blocks * block_size) is skipped and
// records MLA_FAULT_BAD_APPEND_SLOT (row = token, value = the slot) in the optional flag.
//
// One warp per token: lane l owns values 4l..4l+3 of each 128-value tile (8-byte loads, the
// tile's 128 output bytes written by the warp as 32 coalesced words; the tile's amax is one
// redux.sync.max over the bits) and RoPE values 2l, 2l+1.
#pragma once

#include "common/constants.cuh"
#include "common/fault.cuh"
#include "common/ptx.cuh"
#include "common/fp8.cuh"
#include "common/status.cuh"

namespace mla {

enum class Fp8CacheFormat : int { DsMla = 0, PerTensor = 1 };

struct Fp8AppendParams {
    const void* kv_nope;          // [num_tokens] rows of 512 values (f16 or bf16)
    const void* kv_rope;          // [num_tokens] rows of 64 values; may be kv_nope + 512
    int64_t nope_token_stride;    // elements; multiple of 4 (8-byte loads)
    int64_t rope_token_stride;    // elements; multiple of 2
    int32_t num_tokens;
    const int64_t* slot_mapping;  // [num_tokens]
    void* cache;                  // num_blocks blocks of block_size rows
    int64_t block_stride_bytes;   // >= block_size * row bytes, multiple of 16
    int32_t num_blocks;
    int32_t block_size;           // a power of two
    mla_dtype_t dtype;            // of kv_nope and kv_rope
    Fp8CacheFormat format;
    Fp8ScaleRule rule;            // DsMla only
    const float* tensor_scale;    // PerTensor only: device pointer to the fp32 scale
    uint32_t* error_flag;         // optional
};

namespace detail {

struct AppendFp8Args {
    const uint8_t* nope;
    const uint8_t* rope;
    int64_t nope_ts_bytes, rope_ts_bytes;
    int32_t num_tokens;
    const int64_t* slot_mapping;
    uint8_t* cache;
    int64_t block_stride;
    int64_t num_slots;  // num_blocks * block_size
    int32_t block_shift;
    const float* tensor_scale;
    uint32_t* flag;
};

constexpr int kAppendWarps = 8;

// The 4 inputs of w (loaded from an 8-byte aligned address) as fp32.
template <typename T>
__device__ __forceinline__ void to4_f32(const uint2 w, float (&v)[4]) {
    v[0] = Fp8In<T>::to_f32(static_cast<uint16_t>(w.x & 0xffffu));
    v[1] = Fp8In<T>::to_f32(static_cast<uint16_t>(w.x >> 16));
    v[2] = Fp8In<T>::to_f32(static_cast<uint16_t>(w.y & 0xffffu));
    v[3] = Fp8In<T>::to_f32(static_cast<uint16_t>(w.y >> 16));
}

template <typename T, Fp8CacheFormat kFormat, Fp8ScaleRule kRule>
__global__ void __launch_bounds__(kAppendWarps * 32) append_fp8_kernel(const AppendFp8Args a) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * kAppendWarps + (threadIdx.x >> 5);
    if (t >= a.num_tokens) return;
    // the row (and the per-tensor scale) read before the slot is known: one round trip, not two
    const uint8_t* nope = a.nope + t * a.nope_ts_bytes + lane * 8;  // values 4*lane.. of tile 0
    const uint8_t* rope = a.rope + t * a.rope_ts_bytes + lane * 4;  // values 2*lane, 2*lane+1
    uint2 w[kFp8DsMlaTiles];
#pragma unroll
    for (int tile = 0; tile < kFp8DsMlaTiles; ++tile) w[tile] = ld_issue_v2(nope + tile * kFp8DsMlaTile * 2);
    const uint32_t r_in = ld_issue_b32(rope);
    const float s_tensor = kFormat == Fp8CacheFormat::PerTensor ? __uint_as_float(ld_issue_b32(a.tensor_scale)) : 0.f;
    const int64_t slot = a.slot_mapping[t];
    // (after the slot's load: tested before it, the scale's compare made every warp wait for
    // the scale before issuing the slot's load, two round trips)
    if (kFormat == Fp8CacheFormat::PerTensor && t == 0 && lane == 0) check_tensor_scale(a.flag, s_tensor);
    if (slot == -1) return;
    if (slot < 0 || slot >= a.num_slots) {
        if (lane == 0) record_fault(a.flag, MLA_FAULT_BAD_APPEND_SLOT, t, slot);
        return;
    }
    constexpr int kRowBytes = kFormat == Fp8CacheFormat::DsMla ? kFp8DsMlaRowBytes : kFp8TensorRowBytes;
    const int64_t blk = slot >> a.block_shift;
    uint8_t* row = a.cache + blk * a.block_stride + (slot - (blk << a.block_shift)) * kRowBytes;

    if constexpr (kFormat == Fp8CacheFormat::DsMla) {
        float scales[kFp8DsMlaTiles];
#pragma unroll
        for (int tile = 0; tile < kFp8DsMlaTiles; ++tile) {
            float v[4];
            to4_f32<T>(w[tile], v);
            uint32_t m = abs_bits_for_max(v[0]);
            m = max(m, abs_bits_for_max(v[1]));
            m = max(m, abs_bits_for_max(v[2]));
            m = max(m, abs_bits_for_max(v[3]));
            const float amax = f32_from_bits(__reduce_max_sync(0xffffffffu, m));
            const float s = kRule == Fp8ScaleRule::Pow2 ? e4m3_scale_pow2(amax) : e4m3_scale_raw(amax);
            scales[tile] = s;
            const uint32_t q = f32x4_to_e4m3x4(div_rn(v[0], s), div_rn(v[1], s), div_rn(v[2], s), div_rn(v[3], s));
            *reinterpret_cast<uint32_t*>(row + tile * kFp8DsMlaTile + lane * 4) = q;
        }
        if (lane == 0) {  // row is 16-byte aligned (cache and block stride are; 656 = 41 * 16)
            *reinterpret_cast<float4*>(row + kFp8DsMlaScalesOffset) = make_float4(scales[0], scales[1], scales[2], scales[3]);
        }
        uint32_t r = r_in;
        if constexpr (!Fp8In<T>::kIsBf16) r = f16x2_to_bf16x2_rn(r);
        *reinterpret_cast<uint32_t*>(row + kFp8DsMlaRopeOffset + lane * 4) = r;
    } else {
        const float s = s_tensor;
#pragma unroll
        for (int tile = 0; tile < kFp8DsMlaTiles; ++tile) {
            float v[4];
            to4_f32<T>(w[tile], v);
            const uint32_t q = f32x4_to_e4m3x4(div_rn(v[0], s), div_rn(v[1], s), div_rn(v[2], s), div_rn(v[3], s));
            *reinterpret_cast<uint32_t*>(row + tile * kFp8DsMlaTile + lane * 4) = q;
        }
        const uint32_t r = r_in;
        const float r0 = Fp8In<T>::to_f32(static_cast<uint16_t>(r & 0xffffu));
        const float r1 = Fp8In<T>::to_f32(static_cast<uint16_t>(r >> 16));
        *reinterpret_cast<uint16_t*>(row + 512 + lane * 2) = f32x2_to_e4m3x2(div_rn(r0, s), div_rn(r1, s));
    }
}

template <typename T, Fp8CacheFormat kFormat, Fp8ScaleRule kRule>
cudaError_t launch_typed(const AppendFp8Args& a, cudaStream_t stream) {
    const unsigned grid = static_cast<unsigned>((static_cast<int64_t>(a.num_tokens) + kAppendWarps - 1) / kAppendWarps);
    return launch_ex(append_fp8_kernel<T, kFormat, kRule>, dim3(grid), dim3(kAppendWarps * 32), 0, stream, a);
}

template <typename T>
cudaError_t launch_dtype(const Fp8AppendParams& p, const AppendFp8Args& a, cudaStream_t stream) {
    if (p.format == Fp8CacheFormat::PerTensor) return launch_typed<T, Fp8CacheFormat::PerTensor, Fp8ScaleRule::Raw>(a, stream);
    if (p.rule == Fp8ScaleRule::Pow2) return launch_typed<T, Fp8CacheFormat::DsMla, Fp8ScaleRule::Pow2>(a, stream);
    return launch_typed<T, Fp8CacheFormat::DsMla, Fp8ScaleRule::Raw>(a, stream);
}

}  // namespace detail

// Enqueue the append on `stream`. Checks only what the kernel relies on (cudaErrorInvalidValue
// otherwise); argument errors that name the argument belong to the C ABI / Rust layers.
inline cudaError_t launch_append_fp8(const Fp8AppendParams& p, cudaStream_t stream) {
    if (p.num_tokens < 0) return cudaErrorInvalidValue;
    if (p.num_tokens == 0) return cudaSuccess;
    const bool ds = p.format == Fp8CacheFormat::DsMla;
    if (!ds && p.format != Fp8CacheFormat::PerTensor) return cudaErrorInvalidValue;
    if (ds && p.rule != Fp8ScaleRule::Raw && p.rule != Fp8ScaleRule::Pow2) return cudaErrorInvalidValue;
    if (p.dtype != MLA_DTYPE_F16 && p.dtype != MLA_DTYPE_BF16) return cudaErrorInvalidValue;
    if (!p.kv_nope || !p.kv_rope || !p.slot_mapping || !p.cache || (!ds && !p.tensor_scale)) return cudaErrorInvalidValue;
    if (p.num_blocks < 1 || p.block_size < 1 || (p.block_size & (p.block_size - 1))) return cudaErrorInvalidValue;
    const int64_t row_bytes = ds ? kFp8DsMlaRowBytes : kFp8TensorRowBytes;
    if (p.block_stride_bytes < p.block_size * row_bytes || p.block_stride_bytes % 16) return cudaErrorInvalidValue;
    if ((reinterpret_cast<uintptr_t>(p.cache) & 15) || (reinterpret_cast<uintptr_t>(p.kv_nope) & 7) ||
        (reinterpret_cast<uintptr_t>(p.kv_rope) & 3) || (ds ? false : (reinterpret_cast<uintptr_t>(p.tensor_scale) & 3)))
        return cudaErrorInvalidValue;
    if (p.nope_token_stride < 512 || p.nope_token_stride % 4 || p.rope_token_stride < 64 || p.rope_token_stride % 2)
        return cudaErrorInvalidValue;
    detail::AppendFp8Args a;
    a.nope = static_cast<const uint8_t*>(p.kv_nope);
    a.rope = static_cast<const uint8_t*>(p.kv_rope);
    a.nope_ts_bytes = p.nope_token_stride * 2;
    a.rope_ts_bytes = p.rope_token_stride * 2;
    a.num_tokens = p.num_tokens;
    a.slot_mapping = p.slot_mapping;
    a.cache = static_cast<uint8_t*>(p.cache);
    a.block_stride = p.block_stride_bytes;
    a.num_slots = static_cast<int64_t>(p.num_blocks) * p.block_size;
    a.block_shift = 0;
    while ((1 << a.block_shift) < p.block_size) ++a.block_shift;
    a.tensor_scale = p.tensor_scale;
    a.flag = p.error_flag;
    return p.dtype == MLA_DTYPE_BF16 ? detail::launch_dtype<__nv_bfloat16>(p, a, stream)
                                     : detail::launch_dtype<__half>(p, a, stream);
}

}  // namespace mla
