// Compile and host check of the fp8 primitives (csrc/common/fp8.cuh) and the quantize-and-
// append kernel (csrc/cache_ops/append_fp8.cuh). Not part of the crate's build.
//
// Resource check (no GPU needed): every append instantiation, both archs:
//   $NVCC -std=c++17 -O3 -arch=sm_120 -cubin -Xptxas -v -Icsrc -o /tmp/fp8.cubin scripts/fp8-check.cu
//   $NVCC -std=c++17 -O3 -arch=sm_90  -cubin -Xptxas -v -Icsrc -o /tmp/fp8.cubin scripts/fp8-check.cu
// Host check (no GPU needed; the __host__ forms of the primitives against CUDA's own host
// emulation and exact definitions, exhaustively):
//   g++ -std=c++17 -O2 -x c++ -I"$(dirname "$NVCC")/../include" -Icsrc -DMLA_FP8_HOST_CHECK -o /tmp/fp8-check scripts/fp8-check.cu
//   /tmp/fp8-check            # add "quick" to sample 1 in 97 floats instead of all 2^32
#include <cuda_fp8.h>

#ifndef MLA_FP8_HOST_CHECK
#include "cache_ops/append_fp8.cuh"

// Instantiates every kernel of the append (2 dtypes x {ds_mla raw, ds_mla pow2, per-tensor}).
cudaError_t mla_fp8_check_launch(const mla::Fp8AppendParams& p, cudaStream_t s) { return mla::launch_append_fp8(p, s); }
#else
#include "common/fp8.cuh"
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>

using namespace mla;

static int failures = 0;
#define CHECK(cond, ...)                                        \
    do {                                                        \
        if (!(cond)) {                                          \
            if (failures++ < 20) {                              \
                std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
                std::printf(__VA_ARGS__);                       \
                std::printf("\n");                              \
            }                                                   \
        }                                                       \
    } while (0)

// The exact smallest power of two >= s (s > 0 finite): frexp in double.
static float pow2_ceil_exact(float s) {
    int e;
    const double m = std::frexp(static_cast<double>(s), &e);  // s = m * 2^e, m in [0.5, 1)
    return static_cast<float>(m == 0.5 ? std::ldexp(1.0, e - 1) : std::ldexp(1.0, e));
}

int main(int argc, char** argv) {
    const bool quick = argc > 1 && std::strcmp(argv[1], "quick") == 0;
    const uint64_t step = quick ? 97 : 1;

    // 1. the software e4m3 encoder against CUDA's host emulation of cvt.rn.satfinite.e4m3
    uint64_t n = 0;
    for (uint64_t u = 0; u <= 0xffffffffull; u += step) {
        const float x = f32_from_bits(static_cast<uint32_t>(u));
        const uint8_t got = e4m3_encode_sw(x);
        if (x != x) {
            CHECK(got == kE4m3NaN, "NaN %08llx -> %02x", (unsigned long long)u, got);
        } else {
            const uint8_t want = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
            CHECK(got == want, "encode %08llx (%g): %02x, CUDA %02x", (unsigned long long)u, x, got, want);
        }
        ++n;
    }
    std::printf("encode: %llu floats checked\n", (unsigned long long)n);

    // 2. decode of every code against CUDA's e4m3 -> f16 host emulation; round trip
    for (int b = 0; b < 256; ++b) {
        const float got = e4m3_decode_sw(static_cast<uint8_t>(b));
        const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
        const float want = f16_bits_to_f32(h.x);
        if ((b & 0x7f) == 0x7f) {
            CHECK(got != got && want != want, "NaN code %02x", b);
            continue;
        }
        CHECK(f32_bits(got) == f32_bits(want), "decode %02x: %g vs %g", b, got, want);
        CHECK(e4m3_encode_sw(got) == b, "round trip %02x", b);
    }
    std::printf("decode: 256 codes checked\n");

    // 3. f16 -> f32 and f16 -> bf16 (RNE) against CUDA's host emulation, every f16
    for (uint32_t h = 0; h < 65536; ++h) {
        __half_raw r;
        r.x = static_cast<unsigned short>(h);
        const float want = __half2float(__half(r));
        const float got = f16_bits_to_f32(static_cast<uint16_t>(h));
        if (want != want) {
            CHECK(got != got, "f16 NaN %04x", h);
            CHECK((f16x2_to_bf16x2_rn(h) & 0xffff) == kBf16NaN, "f16 NaN -> bf16 %04x", h);
            continue;
        }
        CHECK(f32_bits(got) == f32_bits(want), "f16 %04x: %g vs %g", h, got, want);
        const __nv_bfloat16 wb = __float2bfloat16_rn(want);
        uint16_t wbits;
        std::memcpy(&wbits, &wb, 2);
        const uint32_t gb = f16x2_to_bf16x2_rn(h | (h << 16));
        CHECK((gb & 0xffff) == wbits && (gb >> 16) == wbits, "f16 %04x -> bf16 %04x vs %04x", h, gb & 0xffff, wbits);
    }
    std::printf("f16: 65536 values checked\n");

    // 4. pow2_ceil against frexp for every positive normal float
    for (uint64_t u = 0x00800000ull; u < 0x7f800000ull; u += step) {
        const float s = f32_from_bits(static_cast<uint32_t>(u));
        const float want = u > 0x7f000000ull ? INFINITY : pow2_ceil_exact(s);
        CHECK(f32_bits(pow2_ceil(s)) == f32_bits(want), "pow2_ceil %08llx", (unsigned long long)u);
    }
    CHECK(pow2_ceil(INFINITY) == INFINITY, "pow2_ceil(inf)");
    std::printf("pow2_ceil: checked\n");

    // 5. the scale rules for every bf16 and f16 amax (and 0, inf): raw = vLLM's expression,
    //    pow2 = the exact definition and FlashMLA's expression (torch on CUDA: amax * fl(1/448),
    //    clamp_min(1e-4), 2^ceil(log2)); count where FlashMLA's would differ
    int fm_diff = 0, checked = 0;
    const float inv448 = static_cast<float>(1.0 / 448.0);
    for (int kind = 0; kind < 2; ++kind) {
        for (uint32_t b = 0; b < 0x8000; ++b) {
            const float amax = kind == 0 ? bf16_bits_to_f32(static_cast<uint16_t>(b)) : f16_bits_to_f32(static_cast<uint16_t>(b));
            if (amax != amax) continue;
            ++checked;
            const float raw_want = std::fmax(amax / 448.f, FLT_MIN);
            CHECK(f32_bits(e4m3_scale_raw(amax)) == f32_bits(raw_want), "raw scale %g", amax);
            const float s = std::fmax(amax / 448.f, 1e-4f);
            const float pow2_want = std::isinf(s) ? s : pow2_ceil_exact(s);
            CHECK(f32_bits(e4m3_scale_pow2(amax)) == f32_bits(pow2_want), "pow2 scale %g", amax);
            const float fm_in = std::fmax(amax * inv448, 1e-4f);
            const float fm = std::isinf(fm_in) ? fm_in : std::exp2(std::ceil(std::log2(fm_in)));
            if (f32_bits(fm) != f32_bits(pow2_want)) ++fm_diff;
        }
    }
    std::printf("scales: %d amax values checked; FlashMLA's pow2 expression differs for %d\n", checked, fm_diff);

    std::printf(failures ? "FAILED: %d\n" : "all passed\n", failures);
    return failures ? 1 : 0;
}
#endif
