// Host side of the C entry points: cudaError_t -> mla_status_t, and the argument checks.
#pragma once

#include <cuda_runtime.h>

#include "mla_decode.h"

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
