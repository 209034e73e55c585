// Schedule (host) and split plan (device) shared by dense and sparse decode.
#include "decode.cuh"

namespace mla {

// Inclusive sum of v over the CTA's 1024 threads (all threads must call it).
__device__ __forceinline__ int block_inclusive_sum(int v, int* warp_tot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += u;
    }
    if (lane == 31) warp_tot[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int w = warp_tot[lane];
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int u = __shfl_up_sync(0xffffffffu, w, d);
            if (lane >= d) w += u;
        }
        warp_tot[lane] = w;
    }
    __syncthreads();
    v += warp > 0 ? warp_tot[warp - 1] : 0;
    __syncthreads();  // warp_tot is reused by the next call
    return v;
}

// One CTA of 1024 threads: clamp lengths, scan tile counts, cut the flattened tiles
// into parts of `chunk` tiles, find each part's first request and list the requests
// that more than one part covers (the combine kernel's work).
__global__ void __launch_bounds__(1024) plan_kernel(const int32_t* lens_in, int32_t check, int32_t batch,
                                                    int32_t max_len, int32_t parts, int32_t* plan, uint32_t* flag,
                                                    int32_t pdl) {
    constexpr int kSmemPrefix = 4096;  // batches up to this size search in shared memory
    __shared__ int prefix_s[kSmemPrefix + 1];
    __shared__ int warp_tot[32];
    __shared__ int carry_s;
    grid_dependency_wait();  // lens may come from the previous kernel
    if (pdl & 1) grid_dependents_launch();
    PlanLayout lay(plan, batch, parts);
    const int tid = threadIdx.x;
    if (tid == 0) {
        carry_s = 0;
        prefix_s[0] = 0;
        lay.prefix[0] = 0;
    }
    __syncthreads();
    auto pref = [&](int i) { return i <= kSmemPrefix ? prefix_s[i] : lay.prefix[i]; };
    // pass 1: lengths, tiles, prefix
    for (int base = 0; base < batch; base += 1024) {
        const int b = base + tid;
        int tiles = 0;
        if (b < batch) {
            const int raw = lens_in ? lens_in[b] : max_len;
            int L = raw;
            if (L < 0) {
                if (check) record_fault(flag, MLA_FAULT_NEGATIVE_SEQ_LEN, b, raw);
                L = 0;
            } else if (L > max_len) {
                if (check) record_fault(flag, MLA_FAULT_SEQ_LEN_TOO_LARGE, b, raw);
                L = max_len;
            }
            lay.lens[b] = L;
            tiles = max(1, (L + Cfg::kBlockN - 1) >> kTileShift);  // empty: one masked tile
        }
        const int v = block_inclusive_sum(tiles, warp_tot) + carry_s;
        if (b < batch) {
            lay.prefix[b + 1] = v;
            if (b < kSmemPrefix) prefix_s[b + 1] = v;
        }
        __syncthreads();
        if (tid == 1023) carry_s = v;
        __syncthreads();
    }
    const int total = carry_s;
    const int chunk = max((total + parts - 1) / parts, kMinChunkTiles);
    __syncthreads();
    const int32_t* pf = batch <= kSmemPrefix ? prefix_s : lay.prefix;
    // part starts
    for (int p = tid; p < parts; p += 1024) {
        const int x = p * chunk;
        int r = -1, j = 0;
        if (x < total) {  // the request holding tile x: largest b with prefix[b] <= x
            int lo = 0, hi = batch - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (pf[mid] <= x) lo = mid; else hi = mid - 1;
            }
            r = lo;
            j = x - pf[lo];
        }
        lay.part_info[2 * p] = r;
        lay.part_info[2 * p + 1] = j;
    }
    // pass 2: the split requests, in request order
    if (tid == 0) carry_s = 0;
    __syncthreads();
    for (int base = 0; base < batch; base += 1024) {
        const int b = base + tid;
        int first = 0, last = 0, start = 0;
        if (b < batch) {
            start = pref(b);
            first = start / chunk;
            last = (pref(b + 1) - 1) / chunk;
        }
        const int is_split = (b < batch && first != last) ? 1 : 0;
        const int idx = block_inclusive_sum(is_split, warp_tot) - is_split + carry_s;
        if (is_split) {
            int32_t* e = lay.splits + 4 * idx;
            e[0] = b;
            e[1] = first;
            e[2] = last;
            e[3] = start != first * chunk ? 1 : 0;  // b is not part `first`'s first request
        }
        __syncthreads();
        if (tid == 1023) carry_s = idx + is_split;
        __syncthreads();
    }
    if (tid == 0) {
        plan[0] = total;
        plan[1] = chunk;
        plan[2] = batch;
        plan[3] = parts;
        plan[4] = carry_s;  // number of split requests
        for (int i = 5; i < kPlanHeader; ++i) plan[i] = 0;
    }
}

}  // namespace mla

using namespace mla;

extern "C" size_t mla_plan_bytes(const mla_schedule_t* s) {
    if (s == nullptr) return 0;
    return (plan_ints(s->batch, s->num_parts) * 4 + 255) & ~static_cast<size_t>(255);
}

extern "C" size_t mla_workspace_bytes(const mla_schedule_t* s) {
    if (s == nullptr) return 0;
    const size_t rows = 2 * static_cast<size_t>(s->num_parts) * s->q_len * s->num_heads;
    return rows * (kLatentDim + 1) * sizeof(float);
}

extern "C" mla_status_t mla_plan(const mla_schedule_t* s, const int32_t* lens, int32_t check_lens, int32_t* plan,
                                 uint32_t* error_flag, void* stream) {
    MLA_REQUIRE(s != nullptr && plan != nullptr && s->batch >= 1 && s->num_parts >= 1);
    MLA_REQUIRE((reinterpret_cast<uintptr_t>(plan) & 15) == 0);
    int dev = -1;
    MLA_CUDA_TRY(cudaGetDevice(&dev));
    MLA_REQUIRE(dev == s->device);
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(1);
    cfg.blockDim = dim3(1024);
    cfg.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = s->pdl > 0 ? 1 : 0;
    return mla_cuda_status(cudaLaunchKernelEx(&cfg, plan_kernel, lens, check_lens, s->batch, s->max_len, s->num_parts,
                                              plan, error_flag, s->pdl >> 1));
}

extern "C" mla_tile_info_t mla_tile_info(void) {
    mla_tile_info_t t;
    t.block_m = Cfg::kBlockM;
    t.block_n = Cfg::kBlockN;
    t.stages = Cfg::kStages;
    t.threads = Cfg::kThreads;
    t.smem_bytes = Cfg::kSmemBytes;
    return t;
}
