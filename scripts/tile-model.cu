// A model of the 32-query-row decode tile (issue #15's compute path): the real tile's phases
// with its data layouts and instruction mix, without the split, the masks and the segments, so
// that structures can be compared before one is built into csrc/decode. Per 32-row tile of
// 32 cache rows (576 dims, bf16, XOR-swizzled 1,152-byte rows in two cp.async stages):
//   S  = Q K^T   : warps split kSplitN (cache-row halves) x kSplitK (k parts of the 36 k16
//                  steps), Q fragments in registers, K by ldmatrix.x4; partials through
//                  shared memory (kSplitK slots)
//   softmax      : one per tile, each thread sums the partials of its fragment elements,
//                  row max / sum by shuffles, lazy running max, P (bf16) to shared memory,
//                  rescale flag ORed through the barrier
//   O += P V     : each warp owns 512 / warps output dims, P by ldmatrix.x4, V by
//                  ldmatrix.x4.trans, o in registers
// One CTA per SM (dynamic shared memory padded), every CTA streaming its own tiles from a
// buffer larger than L2. Variants: 8 warps (today's 32-row CTA: 2 x 4 split, 64 dims per warp)
// and 16 warps (2 x 8 split, 32 dims per warp: four warps per scheduler, docs/wip/compute-path.md
// "Session 18").
// One file, with the kernel's instruction wrappers (csrc/common/ptx.cuh, fp8.cuh) included; from the
// repository root on the device: nvcc -O3 -arch=sm_90 -Xptxas -v scripts/tile-model.cu -o /tmp/tm && /tmp/tm
// Registers for sm_120: nvcc -O3 -arch=sm_120 -Xptxas -v -c scripts/tile-model.cu -o /dev/null
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "../csrc/common/fp8.cuh"
#include "../csrc/common/ptx.cuh"

#define CK(x)                                                                         \
    do {                                                                              \
        cudaError_t e_ = (x);                                                         \
        if (e_ != cudaSuccess) {                                                      \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            return 1;                                                                 \
        }                                                                             \
    } while (0)

constexpr int kRows = 32;          // cache rows per tile
constexpr int kRowBytes = 1152;    // 576 bf16
constexpr int kChunks = 72;        // 16-byte chunks per row
constexpr int kStageBytes = kRows * kRowBytes;
constexpr int kKSteps = 36;        // k16 steps over 576 dims
constexpr int kPRowBytes = 80;     // P rows (32 bf16 = 64 B) padded: conflict-free ldmatrix

// mma.sync, ldmatrix, cp.async, the MUFU exp2 and the e4m3 conversions: the kernel's own wrappers
using mla::cp_async_commit;
using mla::cp_async_wait;
using mla::e4m3x4_to_f16x2x2;
using mla::fast_exp2;
using mla::ldmatrix_x2;
using mla::ldmatrix_x4;
using mla::ldmatrix_x4_trans;
using mla::smem_u32;
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mla::mma16816<__nv_bfloat16>(d, a, b0, b1);
}
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mla::mma16816<__half>(d, a, b0, b1);
}
__device__ __forceinline__ void mbar_init(uint32_t bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar));
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
// byte offset of chunk c of row r in a stage (the decode kernel's XOR swizzle)
__device__ __forceinline__ uint32_t swz(int r, int c) {
    return r * kRowBytes + (((c & ~7) | ((c ^ r) & 7)) << 4);
}
// the same for a stage written by the tensor copy (kTma): nine 4 KB slices of 64 dims x 32
// rows, each 1,024-byte aligned and swizzled by the copy (SWIZZLE_128B: chunk ^ row % 8)
__device__ __forceinline__ uint32_t tswz(int r, int c) {
    return ((c >> 3) << 12) + (r << 7) + (((c ^ r) & 7) << 4);
}

template <int kWarps, bool kTwoRound = false, bool kPipe = false, int kSB = kStageBytes>
struct Cfg {
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kSplitN = 2;                   // cache-row halves (16 rows: 2 n8)
    static constexpr int kSplitK = kWarps / kSplitN;    // 4 or 8 k parts
    static constexpr int kMaxSteps = (kKSteps + kSplitK - 1) / kSplitK;  // 9 or 5
    static constexpr int kDims = 512 / kWarps;          // output dims per warp: 64 or 32
    static constexpr int kONT = kDims / 8;              // n8 tiles of o per m-tile
    static constexpr int kElems = 1024 / kThreads;      // S elements per thread in the softmax: 4 or 2
    // shared memory: stages, partials (kSplitK slots of 32 x 32 fp32), P, factors, flag
    // kTwoRound (16 warps within sm_120's 99 KB): k parts 4-7 store, k parts 0-3 add theirs
    // after a barrier, the softmax sums 4 slots
    static constexpr int kSlots = kTwoRound ? kSplitK / 2 : kSplitK;
    static constexpr int kPartBytes = kSlots * 272 * 16;
    static constexpr int kSmem = (kPipe ? 3 : 2) * kSB + (kPipe ? 2 : 1) * kPartBytes + 32 * kPRowBytes + 32 * 4 + 32 + 1024;
};

template <int kWarps, bool kTwoRound, bool kPipe, int kSkip, bool kTma>
__global__ void __launch_bounds__(kWarps * 32, 1) tile_model(const uint8_t* __restrict__ kv, int tiles, int ring,
                                                              float* out, const __grid_constant__ CUtensorMap tmap) {
    // kSkip & 32: per-tensor fp8 rows (576 bytes, staged unswizzled in 592-byte rows, the lean
    // loader), S and P V in f16 from ldmatrix'd e4m3 bytes converted in registers, as the
    // kernel's fp8 path does
    constexpr bool kFp8 = (kSkip & 32) != 0;
    constexpr int kSB = kFp8 ? 32 * 592 : kStageBytes;
    using C = Cfg<kWarps, kTwoRound, kPipe, kSB>;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    // (1,024-byte aligned stages for the tensor copy's swizzle; the request has 1 KB spare)
    uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    uint8_t* stage_p = smem;
    constexpr int kStages = kPipe ? 3 : 2;
    float* part = reinterpret_cast<float*>(smem + kStages * kSB);
    uint8_t* p_s = smem + kStages * kSB + (kPipe ? 2 : 1) * C::kPartBytes;
    float* alpha_s = reinterpret_cast<float*>(p_s + 32 * kPRowBytes);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2;
    const int nh = warp % C::kSplitN, kp = warp / C::kSplitN;
    const int k0 = kp * kKSteps / C::kSplitK, k1 = (kp + 1) * kKSteps / C::kSplitK;

    // this CTA's tile x in the ring buffer (tiles of contiguous rows: 36 KB, fp8 18 KB)
    auto ring_tile = [&](int x) { return (blockIdx.x * 977 + x) % ring; };
    uint64_t* bars = reinterpret_cast<uint64_t*>(alpha_s + 32);  // one mbarrier per stage (kTma)
    if (kTma && tid == 0) {
        for (int i = 0; i < 3; ++i) mbar_init(smem_u32(bars + i));
    }
    __syncthreads();
    constexpr int kRowChunks = kFp8 ? 36 : kChunks;
    constexpr int kLean = (kRows * kRowChunks + C::kThreads - 1) / C::kThreads;
    constexpr bool kLeanAll = kRows * kRowChunks % C::kThreads == 0;
    uint32_t lean_dst[kLean];
#pragma unroll
    for (int k = 0; k < kLean; ++k) {
        const int i = tid + k * C::kThreads, r = i / kRowChunks;
        lean_dst[k] = kFp8 ? r * 592 + (i - r * kRowChunks) * 16 : swz(r, i - r * kChunks);
    }
    auto issue = [&](int x, int st) {
        if constexpr (kTma) {
            if (tid == 0) {
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                const uint32_t bar = smem_u32(bars + st), dst = smem_u32(stage_p + st * kStageBytes);
                mbar_expect(bar, kStageBytes);
                const int row0 = ring_tile(x) * kRows;
#pragma unroll
                for (int sl = 0; sl < 9; ++sl) tma_2d(dst + sl * 4096, &tmap, sl * 64, row0, bar);
            }
        } else {
            const uint8_t* src = kv + static_cast<size_t>(ring_tile(x)) * (kRows * kRowChunks * 16);
            const uint32_t dst = smem_u32(stage_p + st * kSB);
            if constexpr (kFp8 || (kSkip & 16)) {  // lean: the tile is contiguous, the swizzled offsets precomputed
#pragma unroll
                for (int k = 0; k < kLean; ++k)
                    if (kLeanAll || tid + k * C::kThreads < kRows * kRowChunks)
                        mla::cp_async_16(dst + lean_dst[k], src + (tid + k * C::kThreads) * 16, 16);
            } else {
                for (int i = tid; i < kRows * kChunks; i += C::kThreads) {
                    const int r = i / kChunks, c = i - r * kChunks;
                    mla::cp_async_16(dst + swz(r, c), src + r * kRowBytes + c * 16, 16);
                }
            }
            cp_async_commit();
        }
    };

    // Q fragments (synthetic, bf16 ~ +-0.1): two m-tiles, this warp's k steps
    uint32_t qf[2][C::kMaxSteps][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int s = 0; s < C::kMaxSteps; ++s)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float v = 0.01f * ((lane * 7 + s * 3 + i + m * 5) % 19 - 9);
                const __nv_bfloat162 h = __floats2bfloat162_rn(v, -v);
                qf[m][s][i] = *reinterpret_cast<const uint32_t*>(&h);
            }
    float o[2][C::kONT][4] = {};
    constexpr int kRowsPer = C::kElems / 2;  // softmax rows per thread: 2 (8 warps) or 1
    float m_run[kRowsPer], l_run[kRowsPer];
#pragma unroll
    for (int r = 0; r < kRowsPer; ++r) m_run[r] = -INFINITY, l_run[r] = 0.f;

    // Softmax ownership, chosen so that the partials' loads are conflict-free and the 16 lanes
    // of a row are one xor-shuffle group. 8 warps: lane = psel<<4 | blk<<2 | tq, float4 (rows
    // g and g + 8 of pair (m, g) = warp * 2 + psel); 16 warps: lane = blk<<3 | tq<<1 | rsel,
    // float2 (row g + 8 rsel of pair warp). blk = (cache-row half, n8).
    const int blk = kWarps == 8 ? (lane >> 2) & 3 : lane >> 3;
    const int stq = kWarps == 8 ? lane & 3 : (lane >> 1) & 3;
    const int rsel = kWarps == 8 ? 0 : lane & 1;
    const int pair = kWarps == 8 ? warp * 2 + (lane >> 4) : warp;  // (m, g): 16 pairs
    const int sm_ = pair >> 3, sg = pair & 7;
    // slot layout: float4 index ((blk * 2 + m) * 32 + fragment lane) + 4 * blk (the pad makes
    // the readers' loads conflict-free)
    const int poff = (((blk * 2 + sm_) * 32 + sg * 4 + stq) + 4 * blk) * 4 + 2 * rsel;
    constexpr int kSlot = 272 * 4;  // floats per partial slot
    constexpr int kShuf0 = kWarps == 8 ? 1 : 2;

    // ---- the phases ----
    auto s_mma = [&](uint32_t kvb, float (&s)[2][2][4]) {  // S partial: 2 m-tiles x this warp's 16 cache rows
        if constexpr (kFp8) {
            // as the kernel's fp8_k_pair: k16 steps in pairs, one ldmatrix.x4 of 16 rows x 32 e4m3
            // bytes (an odd last pair reads the row's pad), two conversions per register, two
            // accumulator parities
            const int r = nh * 16 + (lane >> 4) * 8 + (lane & 7);
            const int ch = (lane >> 3) & 1;
            float acc[2][2][2][4] = {};
#pragma unroll
            for (int i = 0; i < C::kMaxSteps; i += 2) {
                const int ks = k0 + i;
                if (i < kKSteps / C::kSplitK || ks < k1) {
                    uint32_t b[4], f[4][2];
                    ldmatrix_x4(b, kvb + r * 592 + (ks + ch) * 16);
#pragma unroll
                    for (int j = 0; j < 4; ++j) e4m3x4_to_f16x2x2(b[j], f[j][0], f[j][1]);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if (i + h < C::kMaxSteps && (i + h < kKSteps / C::kSplitK || ks + h < k1)) {
#pragma unroll
                            for (int m = 0; m < 2; ++m) {
                                mma_f16(acc[m][0][h], qf[m][i + h < C::kMaxSteps ? i + h : 0], f[h][0], f[h][1]);
                                mma_f16(acc[m][1][h], qf[m][i + h < C::kMaxSteps ? i + h : 0], f[2 + h][0], f[2 + h][1]);
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[m][n][e] = acc[m][n][0][e] + acc[m][n][1][e];
        } else {
            const int r = nh * 16 + (lane >> 4) * 8 + (lane & 7);  // ldmatrix row (n)
            const int ch = (lane >> 3) & 1;                       // k half
#pragma unroll
            for (int i = 0; i < C::kMaxSteps; ++i) {
                const int ks = k0 + i;
                if (i < kKSteps / C::kSplitK || ks < k1) {  // (the first steps unconditional: loads hoisted)
                    uint32_t b[4];
                    ldmatrix_x4(b, kvb + (kTma ? tswz(r, ks * 2 + ch) : swz(r, ks * 2 + ch)));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        mma(s[m][0], qf[m][i], b[0], b[1]);
                        mma(s[m][1], qf[m][i], b[2], b[3]);
                    }
                }
            }
        }
    };
    auto s_store = [&](float* pbuf, const float (&s)[2][2][4]) {
        float4* slot = reinterpret_cast<float4*>(pbuf + (kp % C::kSlots) * kSlot);
        if (kTwoRound && kp >= C::kSlots) {
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    const int b = nh * 2 + n;
                    slot[(b * 2 + m) * 32 + lane + 4 * b] = make_float4(s[m][n][0], s[m][n][1], s[m][n][2], s[m][n][3]);
                }
        }
        if constexpr (kTwoRound) __syncthreads();
        if (!kTwoRound || kp < C::kSlots) {
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    const int b = nh * 2 + n;
                    float4 t = make_float4(s[m][n][0], s[m][n][1], s[m][n][2], s[m][n][3]);
                    if constexpr (kTwoRound) {
                        const float4 u = slot[(b * 2 + m) * 32 + lane + 4 * b];
                        t.x += u.x, t.y += u.y, t.z += u.z, t.w += u.w;
                    }
                    slot[(b * 2 + m) * 32 + lane + 4 * b] = t;
                }
        }
    };
    auto softmax = [&](const float* pbuf) {  // the thread's elements: partials summed, row max, P
        bool moved = false;
        float v[C::kElems] = {};
#pragma unroll
        for (int k = 0; k < C::kSlots; ++k) {
            if constexpr (C::kElems == 4) {
                const float4 t = *reinterpret_cast<const float4*>(pbuf + k * kSlot + poff);
                v[0] += t.x, v[1] += t.y, v[2] += t.z, v[3] += t.w;
            } else {
                const float2 t = *reinterpret_cast<const float2*>(pbuf + k * kSlot + poff);
                v[0] += t.x, v[1] += t.y;
            }
        }
#pragma unroll
        for (int rr = 0; rr < kRowsPer; ++rr) {
            const float x0 = v[2 * rr] * 0.0601f, x1 = v[2 * rr + 1] * 0.0601f;  // scale * log2(e)
            float mx = fmaxf(x0, x1);
#pragma unroll
            for (int off = kShuf0; off < kShuf0 * 16; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float mo = m_run[rr];
            const float mn = mx > mo + 8.f ? mx : mo;  // lazy max
            const bool mv = mn != mo;
            const float al = mv ? fast_exp2(mo - mn) : 1.f;
            const float p0 = fast_exp2(x0 - mn), p1 = fast_exp2(x1 - mn);
            l_run[rr] = l_run[rr] * al + p0 + p1;
            m_run[rr] = mn;
            moved |= mv;
            const int row = sm_ * 16 + sg + 8 * (kWarps == 8 ? rr : rsel);
            const int col = blk * 8 + 2 * stq;
            if constexpr (kFp8) {
                const __half2 h = __floats2half2_rn(p0, p1);
                *reinterpret_cast<__half2*>(p_s + row * kPRowBytes + col * 2) = h;
            } else {
                const __nv_bfloat162 h = __floats2bfloat162_rn(p0, p1);
                *reinterpret_cast<__nv_bfloat162*>(p_s + row * kPRowBytes + col * 2) = h;
            }
            if (blk == 0 && stq == 0) alpha_s[row] = al;
        }
        return moved;
    };
    auto pv = [&](uint32_t kvb, bool any_moved) {  // O += P V over this warp's dims
        if (any_moved) {
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const float a0 = alpha_s[m * 16 + g], a1 = alpha_s[m * 16 + g + 8];
#pragma unroll
                for (int n = 0; n < C::kONT; ++n) o[m][n][0] *= a0, o[m][n][1] *= a0, o[m][n][2] *= a1, o[m][n][3] *= a1;
            }
        }
        const uint32_t pb = smem_u32(p_s);
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            uint32_t pa[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) ldmatrix_x4(pa[m], pb + (m * 16 + (lane & 15)) * kPRowBytes + (kk * 2 + (lane >> 4)) * 16);
            const int vr = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
            if constexpr (kFp8) {
                // per 32 dims: one ldmatrix.x4.trans of 16 rows x 32 e4m3 bytes (as b16), a byte
                // permute and two conversions per register
#pragma unroll
                for (int n = 0; n < C::kONT; n += 4) {
                    uint32_t vb[4], f[8];
                    ldmatrix_x4_trans(vb, kvb + vr * 592 + (warp * C::kDims + n * 8) + (lane >> 4) * 16);
#pragma unroll
                    for (int j = 0; j < 4; ++j) e4m3x4_to_f16x2x2(__byte_perm(vb[j], 0, 0x3120), f[2 * j], f[2 * j + 1]);
#pragma unroll
                    for (int m = 0; m < 2; ++m)
#pragma unroll
                        for (int j = 0; j < 4; ++j) mma_f16(o[m][n + j], pa[m], f[2 * j], f[2 * j + 1]);
                }
            } else {
#pragma unroll
                for (int n = 0; n < C::kONT; n += 2) {
                    uint32_t vb[4];
                    const int vc = warp * (C::kDims / 8) + n + (lane >> 4);
                    ldmatrix_x4_trans(vb, kvb + (kTma ? tswz(vr, vc) : swz(vr, vc)));
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        mma(o[m][n], pa[m], vb[0], vb[1]);
                        mma(o[m][n + 1], pa[m], vb[2], vb[3]);
                    }
                }
            }
        }
    };
    auto kv_of = [&](int st) { return smem_u32(stage_p + st * kSB); };

    float acc = 0.f;
    if constexpr (!kPipe) {
        // today's order: S(x), barrier, softmax(x), barrier, P V(x); tile x+1 issued at the top
        // (kSkip, ablations: 1 no loads, 2 no S, 4 no softmax, 8 no P V)
        if (!(kSkip & 1)) issue(0, 0);
        for (int x = 0; x < tiles; ++x) {
            const int st = x & 1;
            if constexpr (kTma) {
                mbar_wait(smem_u32(bars + st), (x >> 1) & 1);
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            if (!(kSkip & 1) && x + 1 < tiles) issue(x + 1, st ^ 1);
            if (!(kSkip & 2)) {
                float s[2][2][4] = {};
                s_mma(kv_of(st), s);
                s_store(part, s);
            }
            __syncthreads();
            const bool moved = (kSkip & 4) ? false : softmax(part);
            const bool any = __syncthreads_or(moved);
            if (!(kSkip & 8)) pv(kv_of(st), any);
#pragma unroll
            for (int rr = 0; rr < kRowsPer; ++rr) acc += l_run[rr];
        }
    } else {
        // software pipelined, three stages and two partial buffers: S(x+1) is issued before the
        // softmax of x and stored after it, so that the MMAs' latency and the softmax's chain
        // overlap; two barriers per tile
        issue(0, 0);
        issue(1, 1);
        if constexpr (kTma) {
            mbar_wait(smem_u32(bars), 0);
        } else {
            cp_async_wait<1>();
        }
        __syncthreads();
        {
            float s[2][2][4] = {};
            s_mma(kv_of(0), s);
            s_store(part, s);
        }
        for (int x = 0; x < tiles; ++x) {
            if constexpr (kTma) {
                if (x + 1 < tiles) mbar_wait(smem_u32(bars + (x + 1) % 3), ((x + 1) / 3) & 1);
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            if (x + 2 < tiles) issue(x + 2, (x + 2) % 3);
            float s[2][2][4] = {};
            if (x + 1 < tiles) s_mma(kv_of((x + 1) % 3), s);
            const bool moved = softmax(part + (x & 1) * C::kSlots * kSlot);
            if (x + 1 < tiles) s_store(part + ((x + 1) & 1) * C::kSlots * kSlot, s);
            pv(kv_of(x % 3), __syncthreads_or(moved));
#pragma unroll
            for (int rr = 0; rr < kRowsPer; ++rr) acc += l_run[rr];
        }
    }
    float t = acc;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < C::kONT; ++n) t += o[m][n][0] + o[m][n][1] + o[m][n][2] + o[m][n][3];
    if (t == 1.2345f) out[blockIdx.x] = t;  // keeps the work
}

template <int kWarps, bool kTwoRound = false, bool kPipe = false, int kSkip = 0, bool kTma = false>
int run(int sms, const uint8_t* kv, int ring, int tiles, float* out, const CUtensorMap& tmap) {
    using C = Cfg<kWarps, kTwoRound, kPipe, (kSkip & 32) ? 32 * 592 : kStageBytes>;
    auto k = tile_model<kWarps, kTwoRound, kPipe, kSkip, kTma>;
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, k));
    // one CTA per SM: pad the request past half an SM's shared memory
    int per_sm = 0;
    CK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    const int smem = C::kSmem > per_sm / 2 + 1024 ? C::kSmem : per_sm / 2 + 1024;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float ms_all[7];
    for (int r = 0; r < 7; ++r) {
        CK(cudaEventRecord(e0));
        k<<<sms, C::kThreads, smem>>>(kv, tiles, ring, out, tmap);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        CK(cudaEventElapsedTime(&ms_all[r], e0, e1));
    }
    // median of the last 6
    for (int i = 1; i < 7; ++i)
        for (int j = i + 1; j < 7; ++j)
            if (ms_all[j] < ms_all[i]) {
                const float t = ms_all[i];
                ms_all[i] = ms_all[j];
                ms_all[j] = t;
            }
    const float ms = 0.5f * (ms_all[3] + ms_all[4]);
    // FLOP per tile: 32 query rows x 32 cache rows x (576 + 512) x 2
    const double flop = 2.0 * 32 * 32 * (576 + 512) * double(tiles) * sms;
    const double bytes = double((kSkip & 32) ? 32 * 576 : kStageBytes) * tiles * sms;
    printf("%2d warps%s%s%s%s (%d regs, smem %d of %d B): %7.1f TFLOP/s, %6.0f GB/s (%.3f ms)\n", kWarps, kTwoRound ? ", 2-round sum" : "", kPipe ? ", pipelined (3 stages)" : "", kSkip == 1 ? ", no loads" : kSkip == 2 ? ", no S" : kSkip == 4 ? ", no softmax" : kSkip == 8 ? ", no P V" : kSkip == 5 ? ", no loads, no softmax" : kSkip == 16 ? ", lean cp.async" : kSkip == 32 ? ", per-tensor fp8 rows" : "", kTma ? ", tensor copies" : "", fa.numRegs, C::kSmem,
           smem, flop / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e9, ms);
    return 0;
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("%s, %d SMs; one CTA per SM, 32 query rows per CTA\n", p.name, sms);
    const int big = 4096;  // 4,096 tiles of 36 KB: 151 MB, more than L2
    uint8_t* kv;
    float* out;
    CK(cudaMalloc(&kv, static_cast<size_t>(big) * kStageBytes));
    CK(cudaMemset(kv, 0x3c, static_cast<size_t>(big) * kStageBytes));  // bf16 ~0.0115
    CK(cudaMalloc(&out, sms * 4));
    // the tensor map: the ring as a 2D tensor of rows x 576 bf16, boxes of 64 dims x 32 rows
    PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                        cudaEnableDefault, &q));
    CUtensorMap tmap;
    {
        const cuuint64_t dims[2] = {576, static_cast<cuuint64_t>(big) * kRows};
        const cuuint64_t strides[1] = {kRowBytes};
        const cuuint32_t box[2] = {64, kRows}, estr[2] = {1, 1};
        const CUresult r = encode(&tmap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, kv, dims, strides, box, estr,
                                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS) {
            printf("cuTensorMapEncodeTiled: %d\n", static_cast<int>(r));
            return 1;
        }
    }
    for (int ring : {big, 256}) {  // streamed from DRAM / L2-resident (9.4 MB)
        const int tiles = 1024;
        printf("-- %d tiles per CTA from a ring of %d tiles (%s)\n", tiles, ring, ring == big ? "DRAM" : "L2");
        if (run<8>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<16>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<16, true>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, true>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<16, true, true>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, false, 1>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, false, 2>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, false, 4>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, false, 8>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, false, 5>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<16, true, false, 1>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<16, true, false, 4>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, false, 0, true>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, true, 0, true>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<16, true, false, 0, true>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, false, 4, true>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, false, 16>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, true, 16>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, false, 32>(sms, kv, ring, tiles, out, tmap)) return 1;
        if (run<8, false, true, 32>(sms, kv, ring, tiles, out, tmap)) return 1;
    }
    return 0;
}
