// Issue rates of the fp8 tile's conversion and integer instructions on this GPU (issue #12's
// compute per byte): how many warp-instructions per SM and clock the e4m3 -> f16 conversion
// (`cvt.rn.f16x2.e4m3x2`, SASS F2FP.F16.E4M3.UNPACK_B) sustains, against the integer
// instructions an integer-only conversion would use (LOP3, SHF, PRMT, IADD3, IMAD), and with
// HMMA mixed in at the fp8 tile's ratio.
// Self-contained; on the device: nvcc -O3 -arch=sm_90 scripts/cvt-rate.cu -o /tmp/cr && /tmp/cr
//
// One CTA of 1,024 threads per SM; each thread runs kChains independent dependency chains of
// the instruction, so the pipe, not a chain's latency, bounds it. Rates are warp-instructions
// per SM per clock (4.0 = one per scheduler per clock, the issue limit).
// Measured on an H100 (session 34, docs/PERFORMANCE.md log #106): F2FP ~1.4, LOP3/SHF/PRMT ~1.9,
// IADD3/FMUL ~3.7. The HMMA-mixed variant's figure is not a rate: its chains share registers.
// MOVM (movmatrix, an in-register 8x8 b16 transpose) and SHFL were added in session 47: a
// fragment converted once for S could be transposed for P V instead of converted again. H100
// (log #121): MOVM 1.00, SHFL 1.00 warp-instr/SM/clk: no cheaper than F2FP + half a PRMT.
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

enum Op { F2FP_LO, F2FP_HI, LOP3, SHF, PRMT, IADD, IMAD, FMUL, HFMA2, TRICK, TRICK_NAN, MOVM, SHFL, HMMA, HMMA_F2FP2, HMMA_TRICK2, kOps };
static const char* kNames[kOps] = {
    "F2FP e4m3x2->f16x2 (lo half)", "F2FP e4m3x2->f16x2 (hi half)", "LOP3", "SHF (funnel)", "PRMT",
    "IADD3", "IMAD", "FMUL", "HFMA2", "int e4m3x2->f16x2 (no NaN)", "int e4m3x2->f16x2 (NaN kept)",
    "MOVM (movmatrix m8n8 .trans b16)", "SHFL (bfly)",
    "HMMA m16n8k16 f16", "HMMA + 2 F2FP", "HMMA + 2 int conversions"};
// SASS instructions per step, as counted from the listing (filled in from cuobjdump by hand;
// the rate printed is steps per SM per clock times this)
static const int kInstr[kOps] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

// Integer e4m3 x2 -> f16 x2 (bytes 1 and 3 of x, in the high bytes of its halves), value / 2^8:
// sign stays at bit 15, exponent and mantissa shift right by one (e4m3's bias 7, f16's 15).
__device__ __forceinline__ uint32_t int_cvt(uint32_t x) {
    return (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
}
// The same with NaN codes (x & 0x7f == 0x7f) kept as f16 NaN: bit 14 set where the byte's
// exponent and mantissa are all ones.
__device__ __forceinline__ uint32_t int_cvt_nan(uint32_t x) {
    const uint32_t m = x & 0x7f007f00u;
    const uint32_t t = (m + 0x01000100u) & 0x80008000u;
    return (x & 0x80008000u) | ((m | t) >> 1);
}

template <int kOp>
__global__ void __launch_bounds__(1024, 1) rate(uint32_t* out, int iters, long long* cyc) {
    uint32_t v[kChains];
    float f[kChains];
    float acc[2][4];
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
        v[c] = threadIdx.x * 0x9e3779b9u + c * 0x7f4a7c15u;
        f[c] = 1.0f + threadIdx.x * 1e-6f + c;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
    const uint32_t k1 = v[0] ^ 0x55u, k2 = v[1] | 1u;
    __syncthreads();
    const long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
            uint32_t& x = v[c];
            if constexpr (kOp == F2FP_LO) {
                asm volatile("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %0;\ncvt.rn.f16x2.e4m3x2 %0, l;\n}\n" : "+r"(x));
            } else if constexpr (kOp == F2FP_HI) {
                asm volatile("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %0;\ncvt.rn.f16x2.e4m3x2 %0, h;\n}\n" : "+r"(x));
            } else if constexpr (kOp == LOP3) {
                asm volatile("lop3.b32 %0, %0, %1, %2, 0x96;" : "+r"(x) : "r"(k1), "r"(k2));
            } else if constexpr (kOp == SHF) {
                asm volatile("shf.l.wrap.b32 %0, %0, %1, 3;" : "+r"(x) : "r"(k1));
            } else if constexpr (kOp == PRMT) {
                asm volatile("prmt.b32 %0, %0, %1, 0x3120;" : "+r"(x) : "r"(k1));
            } else if constexpr (kOp == IADD) {
                asm volatile("add.u32 %0, %0, %1;" : "+r"(x) : "r"(k1));
            } else if constexpr (kOp == IMAD) {
                asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(x) : "r"(k1), "r"(k2));
            } else if constexpr (kOp == FMUL) {
                asm volatile("mul.f32 %0, %0, %1;" : "+f"(f[c]) : "f"(1.0000001f));
            } else if constexpr (kOp == HFMA2) {
                asm volatile("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(x) : "r"(k1), "r"(k2));
            } else if constexpr (kOp == TRICK) {
                x = int_cvt(x) ^ k1;  // the xor keeps the chain's values moving (one LOP3 more)
            } else if constexpr (kOp == TRICK_NAN) {
                x = int_cvt_nan(x) ^ k1;
            } else if constexpr (kOp == MOVM) {
                asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %0;" : "+r"(x));
            } else if constexpr (kOp == SHFL) {
                asm volatile("shfl.sync.bfly.b32 %0, %0, 1, 0x1f, 0xffffffff;" : "+r"(x));
            }
        }
        if constexpr (kOp == HMMA || kOp == HMMA_F2FP2 || kOp == HMMA_TRICK2) {
#pragma unroll
            for (int c = 0; c < kChains; ++c) {
                float(&d)[4] = acc[c & 1];
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                    "{%0,%1,%2,%3};\n"
                    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                    : "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]), "r"(v[(c + 4) & 7]), "r"(v[(c + 5) & 7]));
                if constexpr (kOp == HMMA_F2FP2) {
                    uint32_t& x = v[c];
                    asm volatile(
                        "{\n.reg .b16 l, h;\nmov.b32 {l, h}, %0;\ncvt.rn.f16x2.e4m3x2 %0, l;\n}\n" : "+r"(x));
                    asm volatile(
                        "{\n.reg .b16 l, h;\nmov.b32 {l, h}, %0;\ncvt.rn.f16x2.e4m3x2 %0, h;\n}\n" : "+r"(x));
                } else if constexpr (kOp == HMMA_TRICK2) {
                    v[c] = int_cvt(int_cvt(v[c]) ^ k1) ^ k2;
                }
            }
        }
    }
    __syncthreads();
    const long long t1 = clock64();
    if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
    uint32_t s = 0;
#pragma unroll
    for (int c = 0; c < kChains; ++c) s ^= v[c] ^ __float_as_uint(f[c]);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) s ^= __float_as_uint(acc[j][i]);
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int kOp>
static int run(int sms, uint32_t* out, long long* cyc, long long* hcyc) {
    const int iters = 4096;
    rate<kOp><<<sms, 1024>>>(out, iters / 16, cyc);  // warm-up
    rate<kOp><<<sms, 1024>>>(out, iters, cyc);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(hcyc, cyc, sms * sizeof(long long), cudaMemcpyDeviceToHost));
    double mean = 0;
    for (int i = 0; i < sms; ++i) mean += static_cast<double>(hcyc[i]);
    mean /= sms;
    const double steps = 32.0 * iters * kChains;  // warp-steps per SM
    printf("%-34s %7.3f steps/SM/clk (x%d SASS = %.3f warp-instr/SM/clk), %.0f cycles\n", kNames[kOp],
           steps / mean, kInstr[kOp], steps / mean * kInstr[kOp], mean);
    return 0;
}

int main() {
    int dev = 0, sms = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, dev));
    printf("%s, %d SMs; 4.0 warp-instr/SM/clk = one per scheduler per clock\n", p.name, sms);
    uint32_t* out;
    long long* cyc;
    CK(cudaMalloc(&out, sms * 1024 * sizeof(uint32_t)));
    CK(cudaMalloc(&cyc, sms * sizeof(long long)));
    long long* hcyc = new long long[sms];
    int rc = 0;
    rc |= run<F2FP_LO>(sms, out, cyc, hcyc);
    rc |= run<F2FP_HI>(sms, out, cyc, hcyc);
    rc |= run<LOP3>(sms, out, cyc, hcyc);
    rc |= run<SHF>(sms, out, cyc, hcyc);
    rc |= run<PRMT>(sms, out, cyc, hcyc);
    rc |= run<IADD>(sms, out, cyc, hcyc);
    rc |= run<IMAD>(sms, out, cyc, hcyc);
    rc |= run<FMUL>(sms, out, cyc, hcyc);
    rc |= run<HFMA2>(sms, out, cyc, hcyc);
    rc |= run<TRICK>(sms, out, cyc, hcyc);
    rc |= run<TRICK_NAN>(sms, out, cyc, hcyc);
    rc |= run<MOVM>(sms, out, cyc, hcyc);
    rc |= run<SHFL>(sms, out, cyc, hcyc);
    rc |= run<HMMA>(sms, out, cyc, hcyc);
    rc |= run<HMMA_F2FP2>(sms, out, cyc, hcyc);
    rc |= run<HMMA_TRICK2>(sms, out, cyc, hcyc);
    return rc;
}
