// The decode kernel's dynamic shared memory as a typed plan: where each buffer of
// configuration C (a KernelConfig: a tile configuration and a row format) lies (offsets are
// compile-time constants, only the base is a pointer). The layout, in bytes from the base
// (128-byte aligned):
//
//   [kv stage 0 | kv stage 1 | Q tile (kQInSmem only) | S partials | valid flags, per stage |
//    P tile, rescale factors, row stats (kSharedSoftmax only)]
//
//   - kv stage s: the kBlockN cache rows of the tile in stage s, as the row format stages
//     them (kSmemRowBytes each; f16/bf16: 1,152-byte rows of swizzled 16-byte chunks);
//   - Q tile: the CTA's kBlockM query rows (kQkDim wide), at segment starts;
//   - S partials: each warp's S fragments (float4 per lane), summed across the warps that
//     split the QK width; before the first tile's S they are find_part's scratch;
//   - valid flags: one int per tile row and stage, 0 where the row is masked (past the
//     length, a bad block id or slot id) and was zero-filled; fp8 rows with one softmax per
//     warp and sparse 16-bit rows with one per tile (kMaskBits, decode/kernel.cuh) store an
//     additive mask instead: the bits of 0.f, or of -inf where masked.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "decode/config.cuh"
#include "decode/split.cuh"

namespace mla {

// The staged query tile: kBlockM rows of kQkDim values of the query's element type (16-byte
// chunks; whatever the cache-row format, the query is f16/bf16). Swizzled position (in
// 16-byte chunks) of chunk c of row r: the low 3 bits of the chunk index are XORed with the
// row, so that the 8 rows an ldmatrix reads land in 8 different bank groups (a 576-wide row is
// 9 x 128 bytes).
template <typename C>
__device__ __forceinline__ int q_chunk(int r, int c) {
    return r * (C::kQRowBytes / 16) + (c ^ (r & 7));
}

// The S partials: fragment slot i (fragment * 32 + lane) holds a float4 (the accumulator's
// rows g: x, y and g + 8: z, w), or with a half m-tile only a float2 (x, y), packed.
// Slot of fragment f's lane l (a fragment's slots, then C::kPartialPad slots of pad, and
// C::kPartialPairPad more after every pair of fragments).
template <typename C>
__host__ __device__ __forceinline__ constexpr int part_slot(int f, int lane) {
    return f * (32 + C::kPartialPad) + (f >> 1) * C::kPartialPairPad + lane;
}

template <typename C>
__device__ __forceinline__ void store_partial(float4* part_s, int i, const float4& v) {
    if constexpr (C::kHalfM) {
        reinterpret_cast<float2*>(part_s)[i] = make_float2(v.x, v.y);
    } else {
        part_s[i] = v;
    }
}
// The transposed kernels' S (Sᵀ's accumulator of a half m-tile: v[i] is tile row g + 8 (i >> 1),
// query row 2tq + (i & 1) of the warp's 16 rows) stored to the partials in S's own layout
// (store_partial: fragment (warp, n8 tile n) holds float2 (S[q][8n + 2c], S[q][8n + 2c + 1]) at
// lane 4q + c), so that the softmax reads them unchanged (g, tq: the lane's fragment row and column pair).
template <typename C>
__device__ __forceinline__ void store_partials_t(float4* part_s, const float (&v)[4], int warp, int g, int tq) {
    static_assert(C::kHalfM, "Sᵀ has 8 query rows");
    float* p = reinterpret_cast<float*>(part_s);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int n = i >> 1, q = 2 * tq + (i & 1);
        p[2 * part_slot<C>(warp * 2 + n, 4 * q + (g >> 1)) + (g & 1)] = v[i];
    }
}
template <typename C>
__device__ __forceinline__ float4 load_partial(const float4* part_s, int i) {
    if constexpr (C::kHalfM) {
        const float2 v = reinterpret_cast<const float2*>(part_s)[i];
        return make_float4(v.x, v.y, 0.f, 0.f);
    } else {
        return part_s[i];
    }
}

template <typename C>
struct SmemPlan {
    static constexpr int kKvOffset = 0;
    static constexpr int kQOffset = kKvOffset + C::kStages * C::kKvStageBytes;
    static constexpr int kPartialOffset = kQOffset + C::kQBytes;
    static constexpr int kValidOffset = kPartialOffset + C::kPartialBytes;
    static constexpr int kPOffset = kValidOffset + C::kValidBytes;
    static constexpr int kAlphaOffset = kPOffset + C::kBlockM * C::kPRowBytes;
    static constexpr int kStatsOffset = kAlphaOffset + C::kBlockM * 4;
    static constexpr int kBarOffset = kValidOffset + C::kValidBytes + C::kSoftBytes;
    static constexpr int kBytes = kBarOffset + C::kBarBytes;
    static_assert(kBytes == C::kSmemBytes, "the plan covers every buffer KernelConfig counts");
    static_assert(kPartialOffset % 16 == 0 && kValidOffset % 16 == 0, "float4 partials, aligned flags");
    static_assert(kPOffset % 16 == 0 && C::kPRowBytes % 16 == 0 && kStatsOffset % 8 == 0, "aligned P rows and stats");
    static_assert(C::kPartialBytes >= PartScratch::kInts * 4, "find_part's scratch fits in the S partials");
    static_assert(kBarOffset % 8 == 0, "aligned mbarriers");

    // The buffers' addresses (the offsets above from the base).
    uint8_t* kv_;
    uint8_t* q_;
    float4* part_;
    int32_t* valid_;

    __device__ __forceinline__ explicit SmemPlan(uint8_t* base)
        : kv_(base + kKvOffset),
          q_(base + kQOffset),
          part_(reinterpret_cast<float4*>(base + kPartialOffset)),
          valid_(reinterpret_cast<int32_t*>(base + kValidOffset)) {}

    // The tile rows of stage s.
    __device__ __forceinline__ uint8_t* kv(int stage) const { return kv_ + stage * C::kKvStageBytes; }
    // The Q tile (configurations with kQInSmem).
    __device__ __forceinline__ uint8_t* q() const { return q_; }
    // The S partials: fragment f of lane l at partials()[f * 32 + l].
    __device__ __forceinline__ float4* partials() const { return part_; }
    // find_part's scratch (free until the first tile's S).
    __device__ __forceinline__ int* scratch() const { return reinterpret_cast<int*>(part_); }
    // One softmax per tile (kSharedSoftmax): P's rows (kPRowBytes apart), each row's rescale
    // factor for o, and at a segment's end each row's (sum, max).
    __device__ __forceinline__ uint8_t* p_tile() const { return reinterpret_cast<uint8_t*>(valid_) + (kPOffset - kValidOffset); }
    __device__ __forceinline__ float* alpha() const { return reinterpret_cast<float*>(valid_) + (kAlphaOffset - kValidOffset) / 4; }
    __device__ __forceinline__ float2* stats() const { return reinterpret_cast<float2*>(valid_) + (kStatsOffset - kValidOffset) / 8; }
    // The mbarrier of stage s (C::kBarBytes: fp8_ds_mla), as a shared-memory address.
    __device__ __forceinline__ uint32_t bar(int stage) const {
        return smem_u32(reinterpret_cast<uint8_t*>(valid_) + (kBarOffset - kValidOffset) + 8 * stage);
    }
    // The valid flags of stage s's kBlockN rows (kMaskBits in decode/kernel.cuh: 0.f or -inf as float bits).
    __device__ __forceinline__ int32_t* valid(int stage) const { return valid_ + stage * C::kBlockN; }
};

}  // namespace mla
