// The per-thread error state behind mla_last_error() / mla_last_cuda_error(), and the
// ABI's version and struct sizes.
#include <stdarg.h>
#include <stdio.h>

#include "common/status.cuh"
#include "common/struct_size.h"

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
    // cudaErrorInsufficientDriver is also what the runtime answers where no driver is installed
    // at all (then cudaDriverGetVersion reports 0: no device); with a driver present, it is older
    // than the CUDA runtime this library links statically: the device is there, this build
    // cannot use it (README "Requirements": a 13.0 build needs an R580+ driver)
    int driver = 0;
    if (e == cudaErrorInsufficientDriver && cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0) {
        return fail(MLA_STATUS_UNSUPPORTED,
                    "%s failed: %s (cudaError_t %d): the NVIDIA driver (CUDA %d.%d) is older than the CUDA "
                    "%d.%d runtime this library was built with; update the driver or build with an older toolkit",
                    what, cudaGetErrorString(e), static_cast<int>(e), driver / 1000, driver % 1000 / 10,
                    CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
    }
    const bool no_device = e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
                           e == cudaErrorInitializationError || e == cudaErrorStubLibrary ||
                           e == cudaErrorDevicesUnavailable;
    // a GPU whose architecture this build has no code for (e.g. an sm_89 card and the default
    // MLA_CUDA_ARCHS=120,90): valid, but not implemented by this build
    const bool no_image = e == cudaErrorNoKernelImageForDevice || e == cudaErrorUnsupportedPtxVersion ||
                          e == cudaErrorInvalidKernelImage;
    if (no_image) {
        return fail(MLA_STATUS_UNSUPPORTED,
                    "%s failed: %s (cudaError_t %d): this build has no kernels for this GPU's architecture "
                    "(rebuild with it in MLA_CUDA_ARCHS, e.g. MLA_CUDA_ARCHS=89,90,120)",
                    what, cudaGetErrorString(e), static_cast<int>(e));
    }
    return fail(no_device ? MLA_STATUS_NO_DEVICE : MLA_STATUS_CUDA_ERROR, "%s failed: %s (cudaError_t %d)", what,
                cudaGetErrorString(e), static_cast<int>(e));
}

extern "C" const char* mla_last_error(void) { return g_message; }
extern "C" int32_t mla_last_cuda_error(void) { return g_cuda_error; }
extern "C" uint32_t mla_abi_version(void) { return MLA_ABI_VERSION; }
extern "C" size_t mla_struct_size(mla_struct_t which) { return mla_struct_size_of(which); }
