// Schedule (host) and split plan (device) shared by dense and sparse decode.
#include "decode.cuh"

namespace mla {

// One CTA of 1024 threads: clamp lengths, scan tile counts, cut the flattened tiles
// into parts of `chunk` tiles and find each part's first request.
__global__ void __launch_bounds__(1024) plan_kernel(const int32_t* lens_in, int32_t check, int32_t batch,
                                                    int32_t max_len, int32_t parts, int32_t* plan, uint32_t* flag) {
    constexpr int kSmemPrefix = 4096;  // batches up to this size search in shared memory
    __shared__ int prefix_s[kSmemPrefix + 1];
    __shared__ int warp_tot[32];
    __shared__ int carry_s;
    __shared__ int chunk_s;
    grid_dependency_wait();  // lens may come from the previous kernel
    grid_dependents_launch();
    int32_t* part_info = plan + kPlanHeader;
    int32_t* prefix = part_info + 2 * parts;
    int32_t* lens = prefix + batch + 1;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) carry_s = 0;
    __syncthreads();
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
            lens[b] = L;
            tiles = max(1, (L + Cfg::kBlockN - 1) >> kTileShift);  // empty: one masked tile
        }
        int v = tiles;  // inclusive scan within the warp
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
        v += (warp > 0 ? warp_tot[warp - 1] : 0) + carry_s;
        if (b < batch) {
            prefix[b + 1] = v;
            if (b < kSmemPrefix) prefix_s[b + 1] = v;
        }
        __syncthreads();
        if (tid == 1023) carry_s = v;
        __syncthreads();
    }
    if (tid == 0) {
        const int total = carry_s;
        int chunk = (total + parts - 1) / parts;
        chunk = max(chunk, kMinChunkTiles);
        prefix[0] = 0;
        prefix_s[0] = 0;
        plan[0] = total;
        plan[1] = chunk;
        plan[2] = batch;
        plan[3] = parts;
        for (int i = 4; i < kPlanHeader; ++i) plan[i] = 0;
        chunk_s = chunk;
    }
    __syncthreads();
    const int total = carry_s, chunk = chunk_s;
    const int32_t* pf = batch <= kSmemPrefix ? prefix_s : prefix;
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
        part_info[2 * p] = r;
        part_info[2 * p + 1] = j;
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
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(1);
    cfg.blockDim = dim3(1024);
    cfg.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = s->pdl ? 1 : 0;
    return mla_cuda_status(cudaLaunchKernelEx(&cfg, plan_kernel, lens, check_lens, s->batch, s->max_len, s->num_parts,
                                              plan, error_flag));
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
