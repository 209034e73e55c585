// The caller's error flag (mla_decode.h, "device error flag"): the fault codes are the
// header's MLA_FAULT_* values.
#pragma once

#include <stdint.h>

#include "mla_decode.h"

namespace mla {

// First fault wins: word 0 by atomicCAS, then the row and the value as an int64 in two's
// complement (words 2 and 3: low and high 32 bits; a 32-bit value arrives sign-extended).
__device__ __forceinline__ void record_fault(uint32_t* flag, uint32_t code, uint32_t row, int64_t value) {
    if (flag == nullptr) return;
    if (atomicCAS(flag, 0u, code) == 0u) {
        flag[1] = row;
        flag[2] = static_cast<uint32_t>(static_cast<uint64_t>(value));
        flag[3] = static_cast<uint32_t>(static_cast<uint64_t>(value) >> 32);
    }
}

// Per-tensor fp8: the cache's scale must be a finite number > 0; any other is used as it is
// (IEEE arithmetic: e.g. 0 stores +-448 and NaN, and reads zeros) and recorded here, once per
// call by one thread (row 0, value = the scale's fp32 bits).
__device__ __forceinline__ void check_tensor_scale(uint32_t* flag, float s) {
    if (!(s > 0.f && s <= 3.40282347e38f)) record_fault(flag, MLA_FAULT_BAD_KV_SCALE, 0, __float_as_uint(s));
}

}  // namespace mla
