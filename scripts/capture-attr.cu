// Does a stream capture allow cudaFuncSetAttribute (MaxDynamicSharedMemorySize) on a kernel that
// was never launched or touched before (under CUDA's lazy loading, its first touch loads it)?
// The decode call raises that attribute at a device's first launch of a format class when the
// schedule was not made by mla_schedule_init in this process (decode.cu, decode_allow_smem), and
// that first launch may be inside an engine's graph capture. One kernel per capture mode, each
// touched first inside its capture; the graph is then replayed and its output checked.
//
//   nvcc -O3 -arch=sm_90 -L<cu13>/lib scripts/capture-attr.cu -o .gpu/capture-attr
//   .gpu/capture-attr          (also with CUDA_MODULE_LOADING=EAGER / LAZY)
#include <cstdio>
#include <cuda_runtime.h>

template <int kTag>
__global__ void fill(int* out, int v) {
    extern __shared__ int s[];
    s[threadIdx.x * 200] = v + kTag;  // touches the far end of ~100 KB of dynamic shared memory
    __syncthreads();
    if (threadIdx.x == 0) out[kTag] = s[(blockDim.x - 1) * 200];
}

template <int kTag>
static bool run(cudaStreamCaptureMode mode, const char* name, cudaStream_t st, int* d) {
    const int smem = 100 * 1024;
    cudaGraph_t g = nullptr;
    cudaGraphExec_t ge = nullptr;
    cudaError_t e = cudaStreamBeginCapture(st, mode);
    cudaError_t attr = cudaFuncSetAttribute(fill<kTag>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    fill<kTag><<<1, 128, smem, st>>>(d, 7);
    cudaError_t launch = cudaGetLastError();
    cudaError_t end = cudaStreamEndCapture(st, &g);
    cudaError_t inst = g ? cudaGraphInstantiate(&ge, g, 0) : cudaErrorUnknown;
    cudaError_t rep = ge ? cudaGraphLaunch(ge, st) : cudaErrorUnknown;
    cudaError_t sync = cudaStreamSynchronize(st);
    int h = -1;
    cudaMemcpy(&h, d + kTag, sizeof(int), cudaMemcpyDeviceToHost);
    const bool ok = e == cudaSuccess && attr == cudaSuccess && launch == cudaSuccess && end == cudaSuccess &&
                    inst == cudaSuccess && rep == cudaSuccess && sync == cudaSuccess && h == 7 + kTag;
    printf("%-12s begin=%d attr=%d(%s) launch=%d end=%d inst=%d replay=%d sync=%d out=%d: %s\n", name, e, attr,
           cudaGetErrorName(attr), launch, end, inst, rep, sync, h, ok ? "ok" : "FAILED");
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    return ok;
}

int main() {
    int* d = nullptr;
    if (cudaMalloc(&d, 64 * sizeof(int)) != cudaSuccess) {
        printf("capture-attr: no device\n");
        return 2;
    }
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    bool ok = run<1>(cudaStreamCaptureModeGlobal, "global", st, d);
    ok &= run<2>(cudaStreamCaptureModeThreadLocal, "thread-local", st, d);
    ok &= run<3>(cudaStreamCaptureModeRelaxed, "relaxed", st, d);
    printf("capture-attr: %s\n", ok ? "all ok" : "some FAILED");
    return ok ? 0 : 1;
}
