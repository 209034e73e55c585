// Host side of the C entry points: the status they return and the per-thread message that
// says why (mla_last_error, mla_last_cuda_error; defined in common/status.cu).
#pragma once

#include <cuda_runtime.h>

#include "mla_decode.h"

namespace mla {

// Starts a C entry point: clears the thread's last error and names the function in the
// messages that follow.
void enter(const char* function);
// Records "function: message" as the thread's last error and returns status.
mla_status_t fail(mla_status_t status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// A failed CUDA runtime call: MLA_STATUS_NO_DEVICE when it says there is no driver or
// device, MLA_STATUS_UNSUPPORTED when this build has no kernel image for the GPU, else
// MLA_STATUS_CUDA_ERROR; mla_last_cuda_error() = e in every case.
mla_status_t cuda_fail(cudaError_t e, const char* what);

// The host checks' alignment tests: a 16-byte aligned address, and an element stride of
// 16-bit values that keeps rows 16-byte aligned (no multiplication: no overflow).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
inline bool stride16(int64_t elems) { return elems % 8 == 0; }
// An address aligned to `bytes` (a power of two): the int32 / int64 arguments the kernels load.
inline bool aligned_to(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

// Launches `kernel` through cudaLaunchKernelEx, whose return value is this launch's own error
// (a `<<<>>>` launch followed by cudaGetLastError() would also report, and clear, an earlier
// error of the caller's on this thread).
template <typename... Params, typename... Args>
cudaError_t launch_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args&&... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
}

}  // namespace mla

#define MLA_CUDA_TRY(expr) MLA_CUDA_TRY_AS(expr, #expr)
// The same, the message naming the call `what` (for an expression too long to quote: the
// message holds 512 bytes, and the CUDA error's text comes after the name).
#define MLA_CUDA_TRY_AS(expr, what)                                        \
    do {                                                                   \
        cudaError_t mla_e_ = (expr);                                       \
        if (mla_e_ != cudaSuccess) return ::mla::cuda_fail(mla_e_, what); \
    } while (0)
// Rejects an argument: MLA_CHECK(cond, "field: why %d", value).
#define MLA_CHECK(cond, ...)                                                           \
    do {                                                                               \
        if (!(cond)) return ::mla::fail(MLA_STATUS_INVALID_ARGUMENT, __VA_ARGS__);     \
    } while (0)
