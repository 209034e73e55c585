// The roofline's compute ceiling for the mma.sync path (issue #15): what `mma.sync` m16n8k16
// (bf16 in, fp32 accumulate) reaches on this GPU with one CTA per SM (what sm_120 runs), by
// warps per CTA, alone and with the ldmatrix traffic of the decode tile mixed in.
// Self-contained; on the device: nvcc -O3 -arch=sm_90 scripts/mma-peak.cu -o /tmp/mp && /tmp/mp
//
// Each warp runs kChains independent accumulator chains of m16n8k16 MMAs (A and B fixed in
// registers), so the tensor pipe, not a dependency, bounds it. With kLdsm > 0 each group of
// kChains MMAs is accompanied by kLdsm ldmatrix.x4 loads from shared memory whose results feed
// the next group's B operands (the decode tile's 32-row CTA: 68 MMAs and ~21 ldmatrix.x4 per
// warp and tile, i.e. about one x4 per 3 MMAs).
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#define CK(x)                                                                        \
    do {                                                                             \
        cudaError_t e_ = (x);                                                        \
        if (e_ != cudaSuccess) {                                                     \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            return 1;                                                                \
        }                                                                            \
    } while (0)

constexpr int kChains = 8;

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <int kLdsm>
__global__ void peak(int iters, float* out) {
    __shared__ __align__(128) uint8_t smem[32768];
    for (int i = threadIdx.x; i < 32768 / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = i * 2654435761u;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    uint32_t a[4] = {lane * 3u, lane * 5u, lane * 7u, lane * 11u};
    uint32_t b[kChains][2];
#pragma unroll
    for (int c = 0; c < kChains; ++c) b[c][0] = b[c][1] = lane + c;
    float d[kChains][4] = {};
    // conflict-free ldmatrix rows: lane l addresses row l of 32 rows of 128 bytes, chunk l / 8 ^ l % 8
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + (threadIdx.x >> 5) % 4 * 4096;
    const uint32_t addr = base + lane * 128 + (((lane >> 3) ^ (lane & 7)) << 4);
    // the loads of iteration it feed the MMAs of iteration it + 1 (software pipelined, as the
    // decode tile's next k-step fragments are): the ldmatrix latency is hidden, its issue and
    // shared-memory bandwidth are not
    uint32_t r[kLdsm > 0 ? kLdsm : 1][4] = {};
    for (int it = 0; it < iters; ++it) {
        if constexpr (kLdsm > 0) {
#pragma unroll
            for (int l = 0; l < kLdsm; ++l) {
                b[(2 * l) % kChains][0] ^= r[l][0];
                b[(2 * l) % kChains][1] ^= r[l][1];
                b[(2 * l + 1) % kChains][0] ^= r[l][2];
                b[(2 * l + 1) % kChains][1] ^= r[l][3];
            }
#pragma unroll
            for (int l = 0; l < kLdsm; ++l) ldsm4(r[l], addr + (l & 1) * 64 + (it & 1) * 2048);
        }
#pragma unroll
        for (int c = 0; c < kChains; ++c) mma(d[c], a, b[c][0], b[c][1]);
    }
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < kChains; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
    if (s == 1.2345f) out[0] = s;  // keeps the work
}

template <int kLdsm>
int run(int sms, int warps, const char* what) {
    const int iters = 4096;
    float* out;
    CK(cudaMalloc(&out, 4));
    // ~99 KB of dynamic shared memory: one CTA per SM, as on sm_120
    auto k = peak<kLdsm>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 99 * 1024 - 32768));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float best = 1e30f;
    for (int r = 0; r < 6; ++r) {
        CK(cudaEventRecord(e0));
        k<<<sms, warps * 32, 99 * 1024 - 32768>>>(iters, out);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r > 0 && ms < best) best = ms;
    }
    const double flop = 2.0 * 16 * 8 * 16 * kChains * double(iters) * warps * sms;
    printf("%-34s warps/SM %2d: %7.1f TFLOP/s (%.3f ms)\n", what, warps, flop / (best * 1e-3) / 1e12, best);
    CK(cudaFree(out));
    return 0;
}

int main() {
    int dev = 0, sms = 0, clk = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, dev));
    CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, dev));
    printf("%s, %d SMs, max clock %.0f MHz; one CTA per SM\n", p.name, sms, clk / 1e3);
    for (int w : {4, 8, 12, 16})
        if (run<0>(sms, w, "mma m16n8k16 bf16 alone")) return 1;
    for (int w : {4, 8, 16})
        if (run<3>(sms, w, "+ 3 ldmatrix.x4 per 8 mma")) return 1;
    for (int w : {4, 8, 16})
        if (run<6>(sms, w, "+ 6 ldmatrix.x4 per 8 mma")) return 1;
    return 0;
}
