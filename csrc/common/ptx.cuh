// The instructions the kernels use, wrapped: mma.sync, ldmatrix, cp.async, griddepcontrol
// (programmatic dependent launch), the MUFU approximations, quad shuffles, and the element
// types' packing. Everything here runs on sm_80 and newer (sm_90, sm_120).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace mla {

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
__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
// An m16n8k16 A fragment (a0..a3: rows g / g + 8, k halves 0 / 1) with ldmatrix; kHalfM: rows
// 0-7 only (lanes 0-15 address rows 0-7 of k half lane / 8), rows 8-15 zero.
template <bool kHalfM>
__device__ __forceinline__ void ldmatrix_a(uint32_t (&a)[4], uint32_t addr) {
    if constexpr (kHalfM) {
        ldmatrix_x2(a[0], a[2], addr);
        a[1] = a[3] = 0u;
    } else {
        ldmatrix_x4(a, addr);
    }
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
// The same with the zero fill as a predicate (ignore-src): one predicated copy, no byte-count
// arithmetic.
__device__ __forceinline__ void cp_async_16_or_zero(uint32_t dst, const void* src, bool zero) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %2, 0;\n"
        "cp.async.cg.shared.global [%0], [%1], 16, p;\n"
        "}\n" ::"r"(dst),
        "l"(src), "r"(static_cast<int>(zero)));
}
// Global loads issued where they are written: ld.volatile, which neither the compiler nor ptxas
// sinks into the branch that uses the value (the append reads its row before the slot check, the
// gather its positions before the request check: a dependent DRAM round trip fewer each; ptxas
// sank plain and .nc loads past those branches, even from volatile asm). They bypass L1: only for
// values read once (the gather's block-table entries, shared by many threads, lost 4-6 % so).
__device__ __forceinline__ uint4 ld_issue_v4(const void* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ld_issue_v2(const void* p) {
    uint2 v;
    asm volatile("ld.volatile.global.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint32_t ld_issue_b32(const void* p) {
    uint32_t v;
    asm volatile("ld.volatile.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p));
    return v;
}
// Global stores with an L2 eviction priority of evict_last (kLast; else plain stores): the split
// pieces, which decode writes while it streams the cache through L2 and the combine reads after
// it (docs/PERFORMANCE.md log #99). The policy is a constant (createpolicy.fractional 1.0), which
// ptxas folds into the store's memory descriptor.
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
template <bool kLast>
__device__ __forceinline__ void st_l2_last(float* p, float x) {
    if constexpr (kLast) {
        asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(p), "f"(x), "l"(l2_evict_last_policy()) : "memory");
    } else {
        *p = x;
    }
}
template <bool kLast>
__device__ __forceinline__ void st_l2_last(float* p, float2 v) {
    if constexpr (kLast) {
        asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;" ::"l"(p), "f"(v.x), "f"(v.y),
                     "l"(l2_evict_last_policy())
                     : "memory");
    } else {
        *reinterpret_cast<float2*>(p) = v;
    }
}
template <bool kLast>
__device__ __forceinline__ void st_l2_last(float* p, float4 v) {
    if constexpr (kLast) {
        asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z),
                     "f"(v.w), "l"(l2_evict_last_policy())
                     : "memory");
    } else {
        *reinterpret_cast<float4*>(p) = v;
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- bulk copies completing on an mbarrier (sm_90 and sm_120) ------------------------------
// One thread copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to
// shared memory with the copy engine; the copy's completion counts its bytes off the
// mbarrier's transaction count (the sparse fp8_ds_mla rows, decode/format_fp8.cuh).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// After the barriers' init, before any thread or the copy engine uses them (then a __syncthreads).
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Arrive on the barrier, expecting `tx` more bytes in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, int tx) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(tx) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_bulk(uint32_t dst, const void* src, int bytes, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
#endif
}
// Waits until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#endif
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
