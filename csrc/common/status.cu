// The per-thread error state behind mla_last_error() / mla_last_cuda_error(), and the
// ABI's version and struct sizes.
#include <stdarg.h>
#include <stdio.h>

#include "common/status.cuh"

namespace {
thread_local char g_message[512];
thread_local const char* g_function = "mla";
thread_local int32_t g_cuda_error = 0;
}  // namespace

void mla::enter(const char* function) {
    g_function = function;
    g_message[0] = '\0';
    g_cuda_error = 0;
}

mla_status_t mla::fail(mla_status_t status, const char* fmt, ...) {
    int n = snprintf(g_message, sizeof g_message, "%s: ", g_function);
    if (n < 0 || n >= static_cast<int>(sizeof g_message)) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_message + n, sizeof g_message - n, fmt, ap);
    va_end(ap);
    return status;
}

mla_status_t mla::cuda_fail(cudaError_t e, const char* what) {
    g_cuda_error = static_cast<int32_t>(e);
    const bool no_device = e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
                           e == cudaErrorInitializationError || e == cudaErrorStubLibrary ||
                           e == cudaErrorDevicesUnavailable;
    return fail(no_device ? MLA_STATUS_NO_DEVICE : MLA_STATUS_CUDA_ERROR, "%s failed: %s (cudaError_t %d)", what,
                cudaGetErrorString(e), static_cast<int>(e));
}

extern "C" const char* mla_last_error(void) { return g_message; }
extern "C" int32_t mla_last_cuda_error(void) { return g_cuda_error; }
extern "C" uint32_t mla_abi_version(void) { return MLA_ABI_VERSION; }
extern "C" size_t mla_struct_size(mla_struct_t which) {
    switch (which) {
        case MLA_STRUCT_TUNING: return sizeof(mla_tuning_t);
        case MLA_STRUCT_SHAPE: return sizeof(mla_shape_t);
        case MLA_STRUCT_SCHEDULE: return sizeof(mla_schedule_t);
        case MLA_STRUCT_DENSE_PARAMS: return sizeof(mla_dense_params_t);
        case MLA_STRUCT_SPARSE_PARAMS: return sizeof(mla_sparse_params_t);
        case MLA_STRUCT_APPEND_PARAMS: return sizeof(mla_append_params_t);
        case MLA_STRUCT_GATHER_PARAMS: return sizeof(mla_gather_params_t);
    }
    return 0;
}
