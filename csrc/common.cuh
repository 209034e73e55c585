// Device helpers shared by every kernel: element traits, cp.async, ldmatrix, mma.sync,
// the error flag. Everything here runs on sm_80 and newer (sm_90, sm_120).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mla_decode.h"

namespace mla {

constexpr int kHeadDim = MLA_HEAD_DIM;           // 576
constexpr int kLatentDim = MLA_LATENT_DIM;       // 512
constexpr int kRowBytes = MLA_ROW_BYTES_16;      // 1152
constexpr int kRowChunks = kRowBytes / 16;       // 72 chunks of 16 bytes
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kSm120SmemPerBlock = 101376;       // 99 KB opt-in limit of sm_120
constexpr int kSm120SmemPerSm = 102400;          // 100 KB per SM on sm_120

// ---- element types -------------------------------------------------------------------
template <typename T> struct Elem;
template <> struct Elem<__half> {
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        __half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<uint32_t*>(&h);
    }
};
template <> struct Elem<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<uint32_t*>(&h);
    }
};

// D = A*B + D, m16n8k16, fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16-byte async copy global -> shared; src_bytes = 0 zero-fills the destination.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Swizzled position (in 16-byte chunks) of chunk c of row r in a tile of 72-chunk rows:
// the low 3 bits of the chunk index are XORed with the row, so that the 8 rows an
// ldmatrix reads land in 8 different bank groups (a row is 1152 = 9*128 bytes).
__device__ __forceinline__ int swz(int r, int c) { return r * kRowChunks + (c ^ (r & 7)); }

// First fault wins: word 0 by atomicCAS, then row and value.
__device__ __forceinline__ void record_fault(uint32_t* flag, uint32_t code, uint32_t row, int32_t value) {
    if (flag == nullptr) return;
    if (atomicCAS(flag, 0u, code) == 0u) {
        flag[1] = row;
        flag[2] = static_cast<uint32_t>(value);
    }
}

// Programmatic dependent launch: wait until the previous kernel in the stream has
// finished (a no-op when the kernel was launched without the PDL attribute).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Let the next kernel in the stream be scheduled (it still waits for this one to finish).
__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The special-function unit's approximations (one MUFU instruction each; the libm forms
// add range handling that is dozens of dependent instructions on a small step's critical
// path). Relative error ~2^-22, far below bf16/f16 rounding. ex2(-inf) = 0; the arguments
// of lg2 and rcp here are sums of weights >= 1 (normal numbers).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float fast_rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// n / d for 0 <= n < 2^31 and a divisor 1 <= d < 2^31 fixed on the host: a multiply-high,
// an add and a shift instead of the ~25-instruction integer division (Granlund and
// Montgomery's round-up multiplier: s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1;
// exact for n < 2^31, where the add cannot overflow).
struct FastDiv {
    uint32_t mul, shift;
    int32_t d;
    static FastDiv make(int32_t d) {
        FastDiv f;
        f.d = d;
        f.shift = 0;
        while ((1ull << f.shift) < static_cast<uint64_t>(d)) ++f.shift;
        f.mul = static_cast<uint32_t>(((1ull << 32) * ((1ull << f.shift) - static_cast<uint64_t>(d))) /
                                          static_cast<uint64_t>(d) + 1);
        return f;
    }
    __host__ __device__ __forceinline__ int div(int n) const {
#ifdef __CUDA_ARCH__
        const uint32_t hi = __umulhi(static_cast<uint32_t>(n), mul);
#else
        const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * mul) >> 32);
#endif
        return static_cast<int>((hi + static_cast<uint32_t>(n)) >> shift);
    }
};

__device__ __forceinline__ float warp_max4(float v) {  // over the 4 lanes of a quad
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
    return v;
}
__device__ __forceinline__ float warp_sum4(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}

}  // namespace mla

// Host-side: turn a cudaError_t into an mla_status_t.
static inline mla_status_t mla_cuda_status(cudaError_t e) {
    return e == cudaSuccess ? MLA_STATUS_OK : static_cast<mla_status_t>(MLA_STATUS_CUDA_BASE + static_cast<int>(e));
}
#define MLA_CUDA_TRY(expr)                                   \
    do {                                                     \
        cudaError_t mla_e_ = (expr);                         \
        if (mla_e_ != cudaSuccess) return mla_cuda_status(mla_e_); \
    } while (0)
#define MLA_REQUIRE(cond)                                         \
    do {                                                          \
        if (!(cond)) return MLA_STATUS_INVALID_ARGUMENT;          \
    } while (0)
