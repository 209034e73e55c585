// FP8 cache-row formats for the decode kernel (issue #12's read path): fp8_ds_mla (656-byte
// rows: 512 e4m3 latent values in 4 tiles of 128, 4 fp32 scales at [512, 528), 64 bf16 RoPE
// values at [528, 656)) and per-tensor fp8 (576 e4m3 values, one fp32 scale for the cache,
// read on the device from DecodeArgs::kv_scale). The policies have RowF16's members
// (decode/format.cuh, "Adding a format").
//
// DESIGN CHOSEN (first step, correctness first; docs/wip/fp8-notes.md "2.9"): a simple
// variant of the notes' option (b). The rows stay fp8 in shared memory, as they are in global
// memory (656 / 576 + 16 bytes per staged row: a stage is 20,992 / 18,944 bytes instead of
// 36,864, so every tile configuration fits sm_120's 99 KB with room to spare, and the
// schedule's f16/bf16 shared-memory size serves unchanged). The B fragments are built per lane
// with plain shared-memory loads (no ldmatrix: a lane loads exactly the elements the 16-bit
// ldmatrix would have given it) and cvt.rn.f16x2.e4m3x2 (exact; sm_89+, so sm_90 and sm_120):
//   - S = Q K^T (k_frag, kScaledK): the e4m3 values unscaled, exact in the query's type; each
//     k16 step's mma product is multiplied in fp32 by its cache rows' scales (k_scales) and
//     accumulated (kernel.cuh's score_partials, the one kernel change, under `if constexpr`).
//     S is as exact as with a 16-bit cache.
//   - O += P V (v_frag): e4m3 x the row's scale in fp32, rounded to the query's type (bf16:
//     2^-9 relative per element, like a bf16 cache's own rounding; f16: 2^-12, and values
//     beyond f16's range (|v| > 65504) would overflow: f16 queries need a cache whose values
//     fit f16, as any cache written from f16 rows does).
//   The query side, the softmax and the output are untouched.
// Why not the notes' full (b) (ldmatrix on fp8 bytes with Q k-permuted, scales folded per
// scale tile, P scaled with a scale-aware running max): it changes score_partials,
// softmax_tile and pv_tile much more, too much to make correct in the time of this step; it is
// the performance step that follows. Why not (a) (a dequantizing pass into a 16-bit staging
// tile): the staging tile does not fit beside the stages in the 8-warp configurations, and it
// costs a pass and a barrier per tile.
// Cost: per K fragment 4 shared loads + 4 conversions + 4 scale loads + 8 FFMA per m-tile; per
// V fragment 8 byte loads + 4 scale loads + 4 conversions + 8 FMUL (vs one ldmatrix each).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "common/constants.cuh"
#include "common/fp8.cuh"
#include "common/ptx.cuh"
#include "decode/args.cuh"
#include "decode/format.cuh"

namespace mla {

// Plain shared-memory loads at a 32-bit shared address (ordinary C++ loads, so that the
// compiler schedules them freely and merges repeated scale loads; __syncthreads orders them
// against the cp.async fills, as for ldmatrix).
template <typename V>
__device__ __forceinline__ V lds(uint32_t addr) {
    return *reinterpret_cast<const V*>(__cvta_shared_to_generic(addr));
}
__device__ __forceinline__ uint32_t lds_u8(uint32_t addr) { return lds<uint8_t>(addr); }
__device__ __forceinline__ uint32_t lds_u16(uint32_t addr) { return lds<uint16_t>(addr); }
__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) { return lds<uint32_t>(addr); }
__device__ __forceinline__ float lds_f32(uint32_t addr) { return lds<float>(addr); }

// 4-byte async copy global -> shared (src_bytes = 0 zero-fills).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// Two e4m3 codes (lo: bits 0..7, hi: bits 8..15) times two fp32 scales -> an Elem<T> pair
// (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t e4m3x2_scaled(uint32_t codes, float s_lo, float s_hi) {
    const uint32_t h = e4m3x2_to_f16x2(static_cast<uint16_t>(codes));
    const __half2 h2 = *reinterpret_cast<const __half2*>(&h);
    return Elem<T>::pack(__low2float(h2) * s_lo, __high2float(h2) * s_hi);
}

// bf16x2 bits -> an Elem<T> pair (bf16: as they are; f16: rounded).
template <typename T>
__device__ __forceinline__ uint32_t bf16x2_to_elem(uint32_t v) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        return v;
    } else {
        return Elem<T>::pack(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
    }
}

// kDsMla: fp8_ds_mla (656-byte rows, per-tile scales, bf16 RoPE); else per-tensor fp8 (576
// e4m3 values; the staged row appends the tensor scale at byte 576, 592 bytes per staged row:
// every staged row carries it, masked rows too, and the fragments read staged row 0's).
template <typename T, bool kDsMla>
struct RowFp8 : RowInBlock<kDsMla ? MLA_ROW_BYTES_FP8_DS_MLA : MLA_ROW_BYTES_FP8> {
    using Base = RowInBlock<kDsMla ? MLA_ROW_BYTES_FP8_DS_MLA : MLA_ROW_BYTES_FP8>;
    using typename Base::RowAddr;
    using Base::kNoRow;
    using Elem = T;
    static constexpr int kRowBytes = kDsMla ? MLA_ROW_BYTES_FP8_DS_MLA : MLA_ROW_BYTES_FP8;  // 656 / 576
    static constexpr int kSmemRowBytes = kDsMla ? kRowBytes : kRowBytes + 16;                 // 656 / 592
    static constexpr int kChunks = kRowBytes / 16;                                             // 41 / 36
    static constexpr int kQkDim = MLA_HEAD_DIM;    // 576
    static constexpr int kVDim = MLA_LATENT_DIM;   // 512
    static constexpr int kRopeDim = MLA_ROPE_DIM;  // 64
    // staged byte offset of the scale of latent dim d (per-tensor: the one at 576)
    static constexpr int kScaleOffset = kDsMla ? kFp8DsMlaScalesOffset : kFp8TensorRowBytes;
    static_assert(kRowBytes == (kDsMla ? kFp8DsMlaRowBytes : kFp8TensorRowBytes), "row bytes");
    static_assert(kChunks * 16 == kRowBytes && kChunks > 32 && kChunks <= 64, "lane l copies chunks l and l + 32");


    // Lane l copies chunks l and l + 32 (< kChunks) of the row, packed (no swizzle); per-tensor:
    // the last lane copies the tensor scale (4 bytes) behind the row.
    static __device__ __forceinline__ void copy_row(uint32_t stage, int row, const DecodeArgs& a, RowAddr r, int lane) {
        const int bytes = r >= 0 ? 16 : 0;
        const uint8_t* src = a.cache + (r >= 0 ? r : 0) + lane * 16;
        const uint32_t dst = stage + row * kSmemRowBytes + lane * 16;
        cp_async_16(dst, src, bytes);
        if (lane + 32 < kChunks) cp_async_16(dst + 512, src + 512, bytes);
        if constexpr (!kDsMla) {
            // every staged row gets the scale, masked ones too (their values are zero-filled):
            // any row's copy serves the whole tile
            if (lane == 31) cp_async_4(stage + row * kSmemRowBytes + kFp8TensorRowBytes, a.kv_scale, 4);
        }
    }

    // S = Q K^T, with kScaledK: the B fragments ldmatrix_x4 would give for k16 step kk and the
    // warp's 16 rows (krow & ~15 ..), UNSCALED (e4m3 values are exact in f16 and bf16; the
    // fp8_ds_mla RoPE is bf16, rounded for f16 queries): b[0], b[1] = rows +g, dims
    // kk*16 + 2tq (+1) and + 8; b[2], b[3] = the same for rows +8+g. The scales come from
    // k_scales and are applied to each step's product in fp32 (kernel.cuh, score_partials).
    static constexpr bool kScaledK = true;
    static __device__ __forceinline__ void k_frag(uint32_t (&b)[4], uint32_t stage, int krow, int kk, int col_half) {
        const int lane = threadIdx.x & 31;
        const int g = lane >> 2, tq = lane & 3;
        const int col = kk * 16 + 2 * tq;
        const uint32_t row0 = stage + ((krow & ~15) + g) * kSmemRowBytes;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t rb = row0 + (i >> 1) * 8 * kSmemRowBytes;
            const int c = col + 8 * (i & 1);
            if (!kDsMla || kk * 16 < kFp8DsMlaScalesOffset) {
                const uint16_t codes = static_cast<uint16_t>(lds_u16(rb + c));
                if constexpr (std::is_same<T, __nv_bfloat16>::value) {
                    b[i] = e4m3x2_to_bf16x2(codes);
                } else {
                    b[i] = e4m3x2_to_f16x2(codes);
                }
            } else {
                b[i] = bf16x2_to_elem<T>(lds_u32(rb + kFp8DsMlaRopeOffset + 2 * (c - kFp8DsMlaScalesOffset)));
            }
        }
    }
    // The scales of step kk for the lane's accumulator columns (cache rows 8n + 2tq + e of the
    // warp's 16): the row's scale of the step's tile (fp8_ds_mla RoPE: 1), the staged tensor
    // scale (per-tensor); masked rows are zero-filled: scale 0.
    static __device__ __forceinline__ void k_scales(float (&sc)[2][2], uint32_t stage, int krow, int kk) {
        if constexpr (kDsMla) {
            const int tq = threadIdx.x & 3;
            const uint32_t base = stage + ((krow & ~15) + 2 * tq) * kSmemRowBytes + kScaleOffset + 4 * (kk >> 3);
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    sc[n][e] = kk * 16 >= kFp8DsMlaScalesOffset ? 1.f : lds_f32(base + (8 * n + e) * kSmemRowBytes);
                }
        } else {
            const float t = lds_f32(stage + kScaleOffset);  // staged row 0's copy of the tensor scale
            sc[0][0] = sc[0][1] = sc[1][0] = sc[1][1] = t;
        }
    }

    // O += P V: the B fragments ldmatrix_x4_trans would give for the 16 rows vrow & ~15 .. and
    // the 16 dims (dchunk & ~1) * 8 ..: b[0] = rows 2tq, 2tq+1 at dim +g; b[1] = rows +8;
    // b[2], b[3] = the same at dim +8+g. The 16 dims lie in one scale tile.
    static __device__ __forceinline__ void v_frag(uint32_t (&b)[4], uint32_t stage, int vrow, int dchunk) {
        const int lane = threadIdx.x & 31;
        const int g = lane >> 2, tq = lane & 3;
        const int d = (dchunk & ~1) * 8 + g;
        const int so = kScaleOffset + (kDsMla ? 4 * (d >> 7) : 0);
        const uint32_t r0 = stage + ((vrow & ~15) + 2 * tq) * kSmemRowBytes;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows 2tq, 2tq+1 (h = 0) and +8 (h = 1)
            const uint32_t ra = r0 + h * 8 * kSmemRowBytes, rb = ra + kSmemRowBytes;
            const float sa = lds_f32(kDsMla ? ra + so : stage + so), sb = lds_f32(kDsMla ? rb + so : stage + so);
            b[h] = e4m3x2_scaled<T>(lds_u8(ra + d) | (lds_u8(rb + d) << 8), sa, sb);
            b[2 + h] = e4m3x2_scaled<T>(lds_u8(ra + d + 8) | (lds_u8(rb + d + 8) << 8), sa, sb);
        }
    }
};

template <typename T>
using RowFp8DsMla = RowFp8<T, true>;
template <typename T>
using RowFp8Tensor = RowFp8<T, false>;

}  // namespace mla
