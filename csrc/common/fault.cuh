// The caller's error flag (mla_decode.h, "device error flag"): the fault codes are the
// header's MLA_FAULT_* values.
#pragma once

#include <stdint.h>

#include "mla_decode.h"

namespace mla {

// First fault wins: word 0 by atomicCAS, then row and value.
__device__ __forceinline__ void record_fault(uint32_t* flag, uint32_t code, uint32_t row, int32_t value) {
    if (flag == nullptr) return;
    if (atomicCAS(flag, 0u, code) == 0u) {
        flag[1] = row;
        flag[2] = static_cast<uint32_t>(value);
    }
}

}  // namespace mla
