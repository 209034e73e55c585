// Latency floors on the GPU machine (what a tiny decode step cannot go below):
//   nvcc -O3 -arch=sm_90 scripts/latency.cu -o .gpu/latency && .gpu/latency
// Event-timed medians (L2 flushed before each run) of: an empty event pair, one empty
// kernel, chains of empty kernels with and without programmatic dependent launch, and
// kernels whose CTAs do k dependent DRAM round trips.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#define CK(x)                                                                        \
    do {                                                                             \
        cudaError_t e = (x);                                                         \
        if (e != cudaSuccess) {                                                      \
            printf("CUDA %s at line %d\n", cudaGetErrorString(e), __LINE__);         \
            return 1;                                                                \
        }                                                                            \
    } while (0)

__global__ void empty_kernel(int trigger) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (trigger) asm volatile("griddepcontrol.launch_dependents;" :::);
}

// Each CTA: thread 0 follows a pointer chain of k hops (each hop a fresh DRAM line).
__global__ void chase_kernel(const int* next, int k, int* sink) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (threadIdx.x == 0) {
        int p = blockIdx.x * 4096;
        for (int i = 0; i < k; ++i) p = next[p];
        if (p == -12345) sink[0] = p;
    }
}

// Last-CTA pattern: every CTA writes, fences, bumps a counter; the last one reads all.
__global__ void lastcta_kernel(float* data, unsigned* counter, float* out) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    data[blockIdx.x * blockDim.x + threadIdx.x] = threadIdx.x;
    __threadfence();
    __shared__ unsigned last;
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (last) {
        float s = 0;
        for (int b = 0; b < gridDim.x; ++b) s += data[b * blockDim.x + threadIdx.x];
        out[threadIdx.x] = s;
        if (threadIdx.x == 0) *counter = 0;
    }
}

static cudaStream_t st;
static void* flushbuf;

template <typename F>
float median_us(F f, int iters = 200) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> ts;
    for (int i = 0; i < iters + 5; ++i) {
        cudaMemsetAsync(flushbuf, i & 0xff, 256 << 20, st);
        cudaEventRecord(a, st);
        f();
        cudaEventRecord(b, st);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        if (i >= 5) ts.push_back(ms * 1000.f);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
}

template <typename... Args>
cudaError_t launch(void (*k)(Args...), int grid, int threads, bool pdl, Args... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, k, args...);
}

int main() {
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CK(cudaMalloc(&flushbuf, 256 << 20));
    const int n = 64 << 20;  // 256 MB of ints
    int* next;
    CK(cudaMalloc(&next, n * sizeof(int)));
    std::vector<int> h(n / 4096 * 0 + 1);
    // chain: p -> (p + 4096*137 + 64) mod n, distinct lines far apart
    {
        std::vector<int> hn(n);
        for (long i = 0; i < n; ++i) hn[i] = static_cast<int>((i + 4096L * 137 + 64) % n);
        CK(cudaMemcpy(next, hn.data(), n * sizeof(int), cudaMemcpyHostToDevice));
    }
    int* sink;
    float *data, *out;
    unsigned* counter;
    CK(cudaMalloc(&sink, 4));
    CK(cudaMalloc(&data, 1024 * 256 * 4));
    CK(cudaMalloc(&out, 1024 * 4));
    CK(cudaMalloc(&counter, 4));
    CK(cudaMemset(counter, 0, 4));
    printf("event pair alone            %6.2f us\n", median_us([] {}));
    printf("1 empty kernel              %6.2f us\n", median_us([] { launch(empty_kernel, 1, 32, false, 0); }));
    printf("1 empty kernel, 264x128     %6.2f us\n", median_us([] { launch(empty_kernel, 264, 128, false, 0); }));
    for (int pdl = 0; pdl < 3; ++pdl) {
        for (int nk = 2; nk <= 3; ++nk) {
            const float t = median_us([&] {
                for (int i = 0; i < nk; ++i) launch(empty_kernel, 132, 128, pdl > 0, pdl == 2 ? 1 : 0);
            });
            printf("%d empty kernels, pdl=%d       %6.2f us\n", nk, pdl, t);
        }
    }
    for (int k = 0; k <= 8; k += 2) {
        const float t = median_us([&] { launch(chase_kernel, 64, 128, false, (const int*)next, k, sink); });
        printf("64 CTAs, %d DRAM round trips %6.2f us\n", k, t);
    }
    for (int k = 0; k <= 8; k += 2) {
        const float t = median_us([&] { launch(chase_kernel, 64, 128, false, (const int*)next, k, sink); }, 200);
        (void)t;
    }
    printf("last-CTA merge, 64 CTAs     %6.2f us\n",
           median_us([&] { launch(lastcta_kernel, 64, 128, false, data, counter, out); }));
    printf("last-CTA merge, 256 CTAs    %6.2f us\n",
           median_us([&] { launch(lastcta_kernel, 256, 128, false, data, counter, out); }));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 3; ++i) launch(empty_kernel, 132, 128, true, 1);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    printf("graph of 3 empty, pdl       %6.2f us\n", median_us([&] { cudaGraphLaunch(ge, st); }));
    CK(cudaDeviceSynchronize());
    return 0;
}
