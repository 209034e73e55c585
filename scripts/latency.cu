// Latency floors on the GPU machine (what a tiny decode step cannot go below):
//   nvcc -O3 -arch=sm_90 scripts/latency.cu -o .gpu/latency && .gpu/latency
// Event-timed medians (L2 flushed before each run) of: an empty event pair, one empty
// kernel, chains of empty kernels with and without programmatic dependent launch, and
// kernels whose CTAs do k dependent DRAM round trips.
#include <cooperative_groups.h>
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

// Handoff from a producer grid to a PDL-launched consumer grid (decode -> combine): each
// producer CTA writes a 16 KB piece after `delay` cycles; consumer CTA c reads a 512-byte
// slice of every piece. mode 0: the consumer waits with griddepcontrol.wait; mode 1: each
// producer CTA publishes an arrival (fence, barrier, release add) and the consumer polls the
// count with acquire loads instead of waiting for the producer grid to complete.
__global__ void producer_kernel(float* pieces, unsigned* counter, int mode, long long delay) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    const long long t0 = clock64();
    while (clock64() - t0 < delay) {
    }
    float4* p = reinterpret_cast<float4*>(pieces) + blockIdx.x * 1024;
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) p[i] = make_float4(i, blockIdx.x, 0.f, 1.f);
    if (mode == 1) {
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    }
}

__global__ void consumer_kernel(const float* pieces, const unsigned* counter, unsigned target, int nprod, int mode,
                                float* out) {
    if (mode == 0) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    } else {
        if (threadIdx.x == 0) {
            unsigned v;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
            } while (v < target);
        }
        __syncthreads();
    }
    const float4* p = reinterpret_cast<const float4*>(pieces);
    float s = 0.f;
    for (int q = threadIdx.x / 32; q < nprod; q += blockDim.x / 32) {
        const float4 v = p[q * 1024 + blockIdx.x * 32 + (threadIdx.x & 31)];
        s += v.x + v.y + v.z + v.w;
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// The same handoff without a second kernel (a lead for issue #13's small split steps): the
// producers run in clusters of 8; each CTA keeps its 16 KB piece in shared memory, the
// cluster sums its 8 pieces through distributed shared memory (CTA r takes 2 KB slice r of
// every peer), then CTA r of each cluster writes its slice, fences and bumps slice r's
// counter; the last cluster to arrive (the counter mod the cluster count, never reset) sums
// the clusters' slices and writes the output. clusters = gridDim.x / 8. Without global_phase
// the cluster pieces are left for a PDL-launched consumer_kernel (fewer pieces to fold).
// H100, session 47 (docs/PERFORMANCE.md log #121): 64 CTAs 7.26 us against the PDL handoff's
// 6.94, 128 CTAs 8.22 against 8.67.
__device__ __forceinline__ void add4(float4& a, const float4& v) {
    a.x += v.x;
    a.y += v.y;
    a.z += v.z;
    a.w += v.w;
}

__global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(256)
    cluster_merge_kernel(float4* slices, unsigned* counters, float4* out, long long delay, int global_phase) {
    namespace cg = cooperative_groups;
    __shared__ float4 piece[1024];
    __shared__ float4 upper[128];
    __shared__ unsigned last;
    cg::cluster_group cl = cg::this_cluster();
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const long long t0 = clock64();
    while (clock64() - t0 < delay) {
    }
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) piece[i] = make_float4(i, blockIdx.x, 0.f, 1.f);
    cl.sync();
    const unsigned r = cl.block_rank();
    const int t = threadIdx.x & 127, idx = r * 128 + t;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q = threadIdx.x >> 7; q < 8; q += 2) add4(acc, cl.map_shared_rank(piece, q)[idx]);
    if (threadIdx.x >= 128) upper[t] = acc;
    cl.sync();  // (every peer's reads done before any CTA leaves; upper[] visible)
    const int clusters = gridDim.x / 8, c = blockIdx.x / 8;
    if (threadIdx.x < 128) {
        add4(acc, upper[t]);
        slices[(c * 8 + r) * 128 + t] = acc;  // (cluster c's merged piece: float4s c * 1024 ..)
    }
    if (!global_phase) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[r], 1u) % clusters == clusters - 1;
    __syncthreads();
    if (!last || threadIdx.x >= 128) return;
    __threadfence();
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k = 0; k < clusters; ++k) add4(s, __ldcg(&slices[(k * 8 + r) * 128 + t]));
    out[idx] = s;
}

// Instruction fetch: a warp runs N straight-line independent adds (16 bytes of code each)
// twice in one launch; cycles of each pass (pass 0: code as the launch found it).
template <int N>
__global__ void icache_kernel(int* out, long long* cyc, int m, int k) {
    int a[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = threadIdx.x + j;
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
        const long long t0 = clock64();
#pragma unroll
        for (int i = 0; i < N / 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) a[j] = a[j] * m + (k ^ i);  // IMADs ptxas cannot fold
        const long long t1 = clock64();
        if (threadIdx.x == 0) cyc[blockIdx.x * 2 + pass] = t1 - t0;
    }
    int s = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += a[j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

static cudaStream_t st;
static void* flushbuf;

// flush: the 256 MiB memset before each run (else back to back: the GPU idle at each launch)
template <typename F>
float median_us(F f, int iters = 200, bool flush = true) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> ts;
    for (int i = 0; i < iters + 5; ++i) {
        if (flush) cudaMemsetAsync(flushbuf, i & 0xff, 256 << 20, st);
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

static size_t g_smem = 0;  // dynamic shared memory of the next launches

template <typename... Args>
cudaError_t launch(void (*k)(Args...), int grid, int threads, bool pdl, Args... args) {
    cudaLaunchConfig_t cfg{};
    cfg.dynamicSmemBytes = g_smem;
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
    {
        float* pieces;
        unsigned* cnt;
        CK(cudaMalloc(&pieces, 128 * 16384));
        CK(cudaMalloc(&cnt, 4));
        // the cluster merge's counters (one per slice), slices (2 KB per CTA) and output
        unsigned* cnts;
        float4 *slices, *cout;
        CK(cudaMalloc(&cnts, 8 * 4));
        CK(cudaMalloc(&slices, 128 * 2048));
        CK(cudaMalloc(&cout, 16384));
        for (long long delay : {0LL, 4000LL}) {
            for (int mode = 0; mode < 2; ++mode) {
                CK(cudaMemset(cnt, 0, 4));
                unsigned gen = 0;
                const float t = median_us([&] {
                    gen += 64;
                    launch(producer_kernel, 64, 256, true, pieces, cnt, mode, delay);
                    launch(consumer_kernel, 32, 256, true, (const float*)pieces, (const unsigned*)cnt, gen, 64, mode,
                           data);
                });
                printf("handoff %s, delay %4lld cyc %6.2f us\n", mode ? "flag poll  " : "pdl wait   ", delay, t);
            }
            for (int ctas : {8, 64, 128}) {
                CK(cudaMemset(cnts, 0, 8 * 4));
                const float t = median_us([&] {
                    launch(cluster_merge_kernel, ctas, 256, true, slices, cnts, cout, delay, ctas > 8 ? 1 : 0);
                });
                CK(cudaGetLastError());
                printf("cluster merge, %3d CTAs, delay %4lld cyc %6.2f us\n", ctas, delay, t);
                const float th = median_us([&] {
                    launch(cluster_merge_kernel, ctas, 256, true, slices, cnts, cout, delay, 0);
                    launch(consumer_kernel, 32, 256, true, (const float*)slices, (const unsigned*)cnts, 0u, ctas / 8,
                           0, data);
                });
                printf("  cluster merge + pdl consumer of %2d pieces %6.2f us\n", ctas / 8, th);
                const float t2 = median_us([&] {
                    launch(producer_kernel, ctas, 256, true, pieces, cnt, 0, delay);
                    launch(consumer_kernel, 32, 256, true, (const float*)pieces, (const unsigned*)cnt, 0u, ctas, 0,
                           data);
                });
                printf("  pdl handoff, %3d CTAs, same delay %6.2f us\n", ctas, t2);
            }
        }
    }
    {
        long long* cyc;
        int* iout;
        CK(cudaMalloc(&cyc, 264 * 2 * 8));
        CK(cudaMalloc(&iout, 264 * 128 * 4));
        auto icache = [&](auto kern, int n, const char* what, bool flush) {
            std::vector<long long> h(264 * 2);
            for (int l = 0; l < 2; ++l) {
                if (flush) CK(cudaMemsetAsync(flushbuf, l, 256 << 20, st));
                CK(launch(kern, 132, 128, false, iout, cyc, 3, 5));
                CK(cudaStreamSynchronize(st));
                CK(cudaMemcpy(h.data(), cyc, 132 * 2 * 8, cudaMemcpyDeviceToHost));
                std::vector<long long> p0, p1;
                for (int b = 0; b < 132; ++b) {
                    p0.push_back(h[2 * b]);
                    p1.push_back(h[2 * b + 1]);
                }
                std::sort(p0.begin(), p0.end());
                std::sort(p1.begin(), p1.end());
                printf("icache %5d instr (%3d KB) %s launch %d: pass0 %6lld cyc, pass1 %6lld cyc (median CTA)\n", n,
                       n * 16 / 1024, what, l, p0[66], p1[66]);
            }
            return 0;
        };
        icache(icache_kernel<512>, 512, "memset+", true);
        icache(icache_kernel<2048>, 2048, "memset+", true);
        icache(icache_kernel<2048>, 2048, "back2bk", false);
        icache(icache_kernel<8192>, 8192, "memset+", true);
    }
    // The decode kernel asks for ~100 KB of dynamic shared memory; the memset flush before
    // each run leaves the SMs configured for none. Does the carveout change cost launch time?
    CK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100608));
    for (size_t sm : {size_t(0), size_t(49152), size_t(100608)}) {
        g_smem = sm;
        printf("1 empty kernel, %6zu B smem, 1x256       %6.2f us\n", sm,
               median_us([] { launch(empty_kernel, 1, 256, false, 0); }));
        printf("1 empty kernel, %6zu B smem, 132x256     %6.2f us\n", sm,
               median_us([] { launch(empty_kernel, 132, 256, false, 0); }));
        cudaGraph_t g1;
        cudaGraphExec_t ge1;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        launch(empty_kernel, 132, 256, true, 0);
        CK(cudaStreamEndCapture(st, &g1));
        CK(cudaGraphInstantiate(&ge1, g1, 0));
        printf("graph of 1 empty, %6zu B smem, 132x256   %6.2f us\n", sm,
               median_us([&] { cudaGraphLaunch(ge1, st); }));
        // the same without the flush: back to back, the carveout stays
        printf("  same, no flush between runs              %6.2f us\n",
               median_us([&] { cudaGraphLaunch(ge1, st); }, 200, false));
    }
    g_smem = 0;
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
