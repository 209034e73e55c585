// Division by a divisor fixed on the host (FastDiv::make there, div on either side).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace mla {

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

}  // namespace mla
