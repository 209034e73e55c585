// FP8 (float8_e4m3fn) primitives for the fp8 cache formats (docs/wip/fp8-notes.md has the rules
// bit for bit and where vLLM and FlashMLA differ):
//   - fp8_ds_mla, 656 B per row: [0,512) e4m3 in 4 tiles of 128, [512,528) 4 little-endian fp32
//     scales (value = e4m3 * scale[tile]), [528,656) 64 bf16 RoPE values;
//   - per-tensor fp8, 576 B per row: 576 e4m3 (latent and RoPE), value = e4m3 * one fp32 scale.
//
// Only instructions that sm_89, sm_90 and sm_120 all have: cvt.rn.satfinite.e4m3x2.f32 and
// cvt.rn.f16x2.e4m3x2 (PTX ISA 7.8, sm_89+; SASS F2FP.SATFINITE.E4M3.F32.PACK_AB and
// F2FP.F16.E4M3.UNPACK_B on both sm_90 and sm_120), cvt.rn.bf16x2.f32 (sm_80+), div.rn.f32 and
// integer ops. Nothing here depends on -ftz or --use_fast_math: the divisions are explicit
// div.rn.f32 (IEEE, subnormals kept), maxima are taken on the bit patterns.
//
// Everything that has a __host__ form computes the same bits on the host (software paths),
// so host code (tests, a C reference) can call the same functions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

namespace mla {

// ---- formats --------------------------------------------------------------------------
constexpr int kFp8DsMlaRowBytes = 656;     // fp8_ds_mla
constexpr int kFp8DsMlaTile = 128;         // values per scale
constexpr int kFp8DsMlaTiles = 4;          // scales per row
constexpr int kFp8DsMlaScalesOffset = 512; // 4 x fp32, little-endian
constexpr int kFp8DsMlaRopeOffset = 528;   // 64 x bf16
constexpr int kFp8TensorRowBytes = 576;    // per-tensor fp8
constexpr float kE4m3Max = 448.0f;
constexpr uint32_t kFltMinBits = 0x00800000u;   // FLT_MIN = 2^-126, the raw scale's floor
constexpr uint32_t kPow2FloorBits = 0x38d1b717u; // 1e-4f (9.99999974738e-05), the pow2 floor
constexpr uint8_t kE4m3NaN = 0x7f;              // the NaN code every encoder here writes
constexpr uint16_t kBf16NaN = 0x7fc0;           // the NaN every f16 -> bf16 rounding here writes

static_assert(kFp8DsMlaScalesOffset + 4 * kFp8DsMlaTiles == kFp8DsMlaRopeOffset, "656-byte row layout");
static_assert(kFp8DsMlaRopeOffset + 2 * 64 == kFp8DsMlaRowBytes, "656-byte row layout");

// How a writer picks a tile's scale from the tile's largest magnitude amax (fp8_ds_mla).
// raw:  vLLM's concat_and_cache_ds_mla: max(amax / 448, FLT_MIN), IEEE fp32 division.
// pow2: FlashMLA's tests/quant.py: the smallest power of two >= max(amax / 448, 1e-4f), from
//       the exact fp32 bits of amax / 448 (FlashMLA computes 2^ceil(log2f(.)); for bf16 and f16
//       inputs that is the same power for every amax: docs/wip/fp8-notes.md).
enum class Fp8ScaleRule : int { Raw = 0, Pow2 = 1 };

// ---- bit casts --------------------------------------------------------------------------
__host__ __device__ __forceinline__ uint32_t f32_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
#endif
}
__host__ __device__ __forceinline__ float f32_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, 4);
    return x;
#endif
}

// x / y, IEEE round-to-nearest-even, subnormal inputs and results kept whatever -ftz says
// (div.rn.f32 without .ftz; the host divides in IEEE fp32).
__host__ __device__ __forceinline__ float div_rn(float x, float y) {
#ifdef __CUDA_ARCH__
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
    return r;
#else
    volatile float r = x / y;  // no x87 excess precision, no contraction
    return r;
#endif
}

// |x| as fp32 bits for a max: NaN counts as 0 (as fmaxf drops a NaN operand), so the largest
// value of these bits over a tile, read as a float, is the tile's amax ignoring NaNs (an
// all-NaN tile: 0). Non-negative floats order as their bits.
__host__ __device__ __forceinline__ uint32_t abs_bits_for_max(float x) {
    const uint32_t a = f32_bits(x) & 0x7fffffffu;
    return a > 0x7f800000u ? 0u : a;
}

// ---- scales -------------------------------------------------------------------------------
// amax >= 0, not NaN (amax = +inf gives scale +inf, as in vLLM and FlashMLA).
__host__ __device__ __forceinline__ float e4m3_scale_raw(float amax) {
    const uint32_t s = f32_bits(div_rn(amax, kE4m3Max));
    return f32_from_bits(s > kFltMinBits ? s : kFltMinBits);
}

// The smallest power of two >= s, for s a positive NORMAL float or +inf (+inf stays +inf; above
// 2^127: +inf). The pow2 rule only calls it on values >= 1e-4.
__host__ __device__ __forceinline__ float pow2_ceil(float s) {
    const uint32_t b = f32_bits(s);
    return f32_from_bits((b & 0x007fffffu) ? (b & 0x7f800000u) + 0x00800000u : b);
}

__host__ __device__ __forceinline__ float e4m3_scale_pow2(float amax) {
    const uint32_t s = f32_bits(div_rn(amax, kE4m3Max));
    return pow2_ceil(f32_from_bits(s > kPow2FloorBits ? s : kPow2FloorBits));
}

__host__ __device__ __forceinline__ float e4m3_scale(Fp8ScaleRule rule, float amax) {
    return rule == Fp8ScaleRule::Pow2 ? e4m3_scale_pow2(amax) : e4m3_scale_raw(amax);
}

// ---- encode: fp32 -> e4m3, round to nearest even, saturate to +-448 ---------------------
// The software form of cvt.rn.satfinite.e4m3: NaN -> 0x7f (canonical, whatever its sign),
// |x| > 448 (infinities too) -> sign | 0x7e (448), |x| <= 2^-10 -> sign | 0 (the tie at 2^-10
// goes to the even 0), subnormals m * 2^-9 below 2^-6. Matches CUDA's host emulation
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) except that that keeps a NaN's sign.
__host__ __device__ __forceinline__ uint8_t e4m3_encode_sw(float x) {
    const uint32_t u = f32_bits(x);
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return kE4m3NaN;
    if (a >= 0x43e00000u) return sign | 0x7e;  // >= 448: 448 itself, the rest saturates
    if (a < 0x3c800000u) {                     // < 2^-6: e4m3 subnormal m * 2^-9, m in 0..8
        // a = M * 2^(E - 150) with M the 24-bit significand; m = a / 2^-9 = M * 2^(E - 141)
        const uint32_t e = a >> 23;
        const uint32_t m24 = e ? ((a & 0x7fffffu) | 0x800000u) : (a & 0x7fffffu);
        const uint32_t sh = (e ? 141u - e : 140u);  // >= 21
        if (sh > 31u) return sign;                  // < 2^-11: below half of 2^-9
        const uint32_t q = m24 >> sh, rem = m24 & ((1u << sh) - 1u), half = 1u << (sh - 1u);
        const uint32_t r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
        return sign | static_cast<uint8_t>(r);      // r == 8 is 2^-6, the smallest normal
    }
    // normal: rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits;
    // a carry out of the mantissa increments the exponent, as it should (a < 448: no overflow)
    const uint32_t rb = a - (120u << 23);
    const uint32_t q = rb >> 20, rem = rb & 0xfffffu;
    const uint32_t r = q + ((rem > 0x80000u || (rem == 0x80000u && (q & 1u))) ? 1u : 0u);
    return sign | static_cast<uint8_t>(r);
}

// Two values -> e4m3x2 (lo in bits 0..7, hi in bits 8..15). PTX ISA, cvt: conversions to
// .e4m3x2 from .f32 require .satfinite, which turns a NaN input into NaN and clamps finite
// values and infinities beyond MAX_NORM (448) to the sign-preserved MAX_NORM. Which NaN code
// comes out is not specified, so a NaN is canonicalized to 0x7f here.
// The e4m3 conversions are sm_89+ instructions: sm_80 / sm_86 builds (MLA_CUDA_ARCHS=80,86)
// take the software forms above, which give the same bytes and values (the fp8 paths run
// there, slower; the 16-bit paths are untouched).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define MLA_FP8_CVT 0
#else
#define MLA_FP8_CVT 1
#endif
__device__ __forceinline__ uint16_t f32x2_to_e4m3x2(float lo, float hi) {
#if !MLA_FP8_CVT
    return static_cast<uint16_t>(e4m3_encode_sw(lo) | (static_cast<uint16_t>(e4m3_encode_sw(hi)) << 8));
#else
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    if (lo != lo) r = static_cast<uint16_t>((r & 0xff00u) | kE4m3NaN);
    if (hi != hi) r = static_cast<uint16_t>((r & 0x00ffu) | (kE4m3NaN << 8));
    return r;
#endif
}
// Four values -> e4m3x4 (v0 in bits 0..7 .. v3 in bits 24..31: little-endian byte order).
__device__ __forceinline__ uint32_t f32x4_to_e4m3x4(float v0, float v1, float v2, float v3) {
    return static_cast<uint32_t>(f32x2_to_e4m3x2(v0, v1)) | (static_cast<uint32_t>(f32x2_to_e4m3x2(v2, v3)) << 16);
}

// ---- decode: e4m3 -> f16 / bf16 / f32 (exact: every e4m3 value is an f16 and a bf16) -----
// The software form, as f32 (NaN codes 0x7f / 0xff -> NaN).
__host__ __device__ __forceinline__ float e4m3_decode_sw(uint8_t b) {
    const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
    const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
    if (e == 15u && m == 7u) return f32_from_bits(0x7fc00000u | sign);
    if (e == 0u) {  // m * 2^-9: exact in fp32
        const float v = static_cast<float>(m) * 0.001953125f;
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

// e4m3x2 -> f16x2 (lo byte -> low half): exact, one F2FP instruction on sm_89+ (e4m3
// subnormals 2^-9.. are f16 normals; NaN -> f16 NaN).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t v) {
#if !MLA_FP8_CVT
    const __half2 h = __floats2half2_rn(e4m3_decode_sw(static_cast<uint8_t>(v & 0xffu)),
                                        e4m3_decode_sw(static_cast<uint8_t>(v >> 8)));
    return *reinterpret_cast<const uint32_t*>(&h);
#else
    uint32_t r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
    return r;
#endif
}
// e4m3x4 -> two f16x2: lo = bytes 0,1; hi = bytes 2,3, the high half shifted out first (an
// extra instruction per register against e4m3x4_to_f16x2x2 below, but ptxas allocates
// registers differently: the fp8 32-row kernel, at sm_120's register cap, spills without it;
// decode/fp8_phases.cuh, fp8_pv_step).
__device__ __forceinline__ void e4m3x4_to_f16x2x2_shifted(uint32_t v, uint32_t& lo, uint32_t& hi) {
    lo = e4m3x2_to_f16x2(static_cast<uint16_t>(v & 0xffffu));
    hi = e4m3x2_to_f16x2(static_cast<uint16_t>(v >> 16));
}
// The same with the halves split inside the asm (mov.b32 {l, h}) so that ptxas reads the high
// one as an operand half (F2FP ... R.H1) instead of shifting it out first (one instruction per
// register saved); below sm_89 the software form above.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(uint32_t v, uint32_t& lo, uint32_t& hi) {
#if !MLA_FP8_CVT
    e4m3x4_to_f16x2x2_shifted(v, lo, hi);
#else
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(v));
#endif
}

// ---- 16-bit inputs -> fp32 (exact), and f16 -> bf16 rounding ---------------------------
__host__ __device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) {
    return f32_from_bits(static_cast<uint32_t>(b) << 16);
}
__host__ __device__ __forceinline__ float f16_bits_to_f32(uint16_t h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 31u) return f32_from_bits(sign | 0x7f800000u | (m << 13));
    if (e == 0u) {
        if (m == 0u) return f32_from_bits(sign);
        e = 113u;  // normalize m * 2^-24
        while (!(m & 0x400u)) {
            m <<= 1;
            --e;
        }
        return f32_from_bits(sign | (e << 23) | ((m & 0x3ffu) << 13));
    }
    return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

// fp32 -> bf16 bits, round to nearest even; NaN -> kBf16NaN (0x7fc0, whatever the input NaN).
__host__ __device__ __forceinline__ uint16_t f32_to_bf16_rn_bits(float x) {
    const uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return kBf16NaN;
#ifdef __CUDA_ARCH__
    uint16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
#else
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // no overflow past inf
#endif
}
// Two f16 (bits, lo in the low half) -> two bf16, round to nearest even, NaN -> 0x7fc0.
// (Every f16 value is an fp32 value, so this is one rounding.)
__host__ __device__ __forceinline__ uint32_t f16x2_to_bf16x2_rn(uint32_t h2) {
    return static_cast<uint32_t>(f32_to_bf16_rn_bits(f16_bits_to_f32(static_cast<uint16_t>(h2 & 0xffffu)))) |
           (static_cast<uint32_t>(f32_to_bf16_rn_bits(f16_bits_to_f32(static_cast<uint16_t>(h2 >> 16)))) << 16);
}

// Load traits of the append kernel's input dtype: 16-bit bits -> fp32.
template <typename T> struct Fp8In;
template <> struct Fp8In<__half> {
    static constexpr bool kIsBf16 = false;
    __host__ __device__ static float to_f32(uint16_t b) { return f16_bits_to_f32(b); }
};
template <> struct Fp8In<__nv_bfloat16> {
    static constexpr bool kIsBf16 = true;
    __host__ __device__ static float to_f32(uint16_t b) { return bf16_bits_to_f32(b); }
};

}  // namespace mla
