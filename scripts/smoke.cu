// C-ABI smoke test and quick timer: drives csrc/ through raw device pointers and a raw
// stream, exactly as a user of another CUDA library would, against a small double
// reference. Built on the GPU machine:
//   nvcc -O3 -std=c++17 -Icsrc -arch=sm_90 scripts/smoke.cu csrc/cache_ops.cu csrc/decode/*.cu -o smoke && ./smoke
// Phase trace of the small cases (timestamps from inside the kernels):
//   nvcc -O3 -std=c++17 -DMLA_TRACE -Icsrc -arch=sm_90 scripts/smoke.cu csrc/cache_ops.cu csrc/decode/*.cu \
//     csrc/common/status.cu -o trace && ./trace t   (m: the mixed-length steps)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "mla_decode.h"

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e = (x);                                                               \
        if (e != cudaSuccess) {                                                            \
            printf("CUDA %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__);       \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)
#define MK(x)                                                                              \
    do {                                                                                   \
        int st_ = (x);                                                                      \
        if (st_ != 0) {                                                                    \
            printf("mla status %d at %s:%d: %s\n", st_, __FILE__, __LINE__, mla_last_error()); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static std::mt19937_64 rng(1234);

// The schedule's tuning: sm120_occupancy, and the bench's experiment overrides from the
// environment (MLA_WARPS, MLA_BLOCK_M, MLA_PDL with 0 = off, MLA_COMBINE_SLICES,
// MLA_MIN_CHUNK; the library reads no environment variable).
static mla_tuning_t tuning(int occ) {
    auto var = [](const char* name) {
        const char* v = getenv(name);
        return v && *v ? atoi(v) : 0;
    };
    mla_tuning_t t{};
    t.sm120_occupancy = occ;
    t.warps = var("MLA_WARPS");
    t.block_m = var("MLA_BLOCK_M");
    const char* pdl = getenv("MLA_PDL");
    t.pdl = pdl && *pdl ? (atoi(pdl) == 0 ? MLA_PDL_OFF : atoi(pdl)) : 0;
    t.combine_slices = var("MLA_COMBINE_SLICES");
    t.min_chunk = var("MLA_MIN_CHUNK");
    return t;
}
static float frand() { return std::uniform_real_distribution<float>(-1.f, 1.f)(rng); }

struct Dense {
    int batch, q_len, heads, bs, max_blocks, num_blocks;
    std::vector<int> seq_lens;
};

static cudaStream_t g_st;
[[maybe_unused]] static bool g_trace = false;  // argument t (trace builds): phase breakdown of the small cases
// Per-request lengths for the next run_dense (batch = its size, L = its longest); empty: L or random.
static std::vector<int> g_lens;

template <typename F>
static float time_ms(F f, int iters) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> ts;
    for (int i = 0; i < iters + 3; ++i) {
        CK(cudaEventRecord(a, g_st));
        f();
        CK(cudaEventRecord(b, g_st));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        ts.push_back(ms);
    }
    ts.erase(ts.begin(), ts.begin() + 3);
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
}

#ifdef MLA_TRACE
// Trace mode (built with -DMLA_TRACE, run with argument t): phase timestamps written by the
// kernels' thread 0 (csrc/common/trace.cuh, MLA_TRACE_AT), 30 runs each after a 256 MiB
// memset flush.
// Prints, per phase, the median over runs of (first, median, last CTA) in µs after the
// first decode CTA started, and per-CTA phase lengths from clock64.
extern "C" int mla_trace_reset(void* stream);
extern "C" int mla_trace_read(unsigned long long* host, size_t bytes);

template <typename D>
static void trace(D dec) {
    constexpr int kC = 2048, kP = 8, kRuns = 30;
    static void* flush = nullptr;
    if (!flush) CK(cudaMalloc(&flush, 256 << 20));
    std::vector<unsigned long long> buf((size_t)2 * kC * kP * 2);
    // w = 0: %globaltimer (ns); w = 1: clock64 (the SM's id is above bit 52: sm_of)
    auto at = [&](int k, int c, int i, int w) {
        const unsigned long long v = buf[(((size_t)k * kC + c) * kP + i) * 2 + w];
        return w ? v & ((1ull << 52) - 1) : v;
    };
    auto sm_of = [&](int k, int c) { return (int)(buf[(((size_t)k * kC + c) * kP) * 2 + 1] >> 52); };
    // MLA_TRACE_DUMP=1: every decode CTA of the last run (linear index, SM, µs of its points)
    const bool dump = getenv("MLA_TRACE_DUMP") != nullptr;
    // The points of csrc/common/trace.cuh (DecodeTracePoint, CombineTracePoint), in order;
    // the phase of point i is measured from point prev[k][i] (the last tile from the first).
    const char* names[2][kP] = {{"entry", "wait done", "part found", "1st tile in", "1st S done", "1st PV done",
                                 "last tile in", "end"},
                                {"entry", "split found", "wait done", "1st batch", "folds done", "end"}};
    const int prev[2][kP] = {{-1, 0, 1, 2, 3, 4, 3, 6}, {-1, 0, 1, 2, 3, 4}};
    const int npts[2] = {8, 6};
    const int kEnd = 7;  // decode's last point
    // [k][i][0..2] = per-run (first, median, last) µs; cyc[k][j] = per-run median cycles of phase j
    std::vector<double> pts[2][kP][3], cyc[2][kP], ev, ns_per_cyc;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    // MLA_TRACE_PREWARM=1: each traced run follows an untraced one and a second memset (the
    // SMs' instruction caches warm, L2 cold); =2: follows an untraced one directly (code and
    // data warm in L2). Tells instruction-fetch latency from memory latency.
    const char* pw = getenv("MLA_TRACE_PREWARM");
    const int prewarm = pw ? atoi(pw) : 0;
    for (int run = 0; run < kRuns + 3; ++run) {
        CK(cudaMemsetAsync(flush, run & 0xff, 256 << 20, g_st));
        if (prewarm) {
            dec();
            if (prewarm == 1) CK(cudaMemsetAsync(flush, (run + 1) & 0xff, 256 << 20, g_st));
        }
        if (mla_trace_reset(g_st)) exit(1);
        CK(cudaEventRecord(a, g_st));
        dec();
        CK(cudaEventRecord(b, g_st));
        CK(cudaEventSynchronize(b));
        if (run < 3) continue;
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        ev.push_back(ms * 1e3);
        if (mla_trace_read(buf.data(), buf.size() * 8)) exit(1);
        unsigned long long t0 = ~0ull;
        for (int c = 0; c < kC; ++c)
            if (at(0, c, 0, 0)) t0 = std::min(t0, at(0, c, 0, 0));
        std::vector<double> ratio;
        for (int k = 0; k < 2; ++k) {
            for (int i = 0; i < npts[k]; ++i) {
                std::vector<double> v, d;
                for (int c = 0; c < kC; ++c) {
                    if (!at(k, c, i, 0)) continue;
                    v.push_back((double)(at(k, c, i, 0) - t0) * 1e-3);
                    const int p = prev[k][i];
                    if (p >= 0 && at(k, c, p, 1)) d.push_back((double)(at(k, c, i, 1) - at(k, c, p, 1)));
                }
                if (v.empty()) continue;
                std::sort(v.begin(), v.end());
                pts[k][i][0].push_back(v.front());
                pts[k][i][1].push_back(v[v.size() / 2]);
                pts[k][i][2].push_back(v.back());
                if (!d.empty()) {
                    std::sort(d.begin(), d.end());
                    cyc[k][i].push_back(d[d.size() / 2]);
                }
            }
        }
        for (int c = 0; c < kC; ++c)
            if (at(0, c, kEnd, 0) && at(0, c, 0, 0) && at(0, c, kEnd, 1) > at(0, c, 0, 1))
                ratio.push_back((double)(at(0, c, kEnd, 0) - at(0, c, 0, 0)) /
                                (double)(at(0, c, kEnd, 1) - at(0, c, 0, 1)));
        if (dump && run == kRuns + 2) {
            printf("\n    dump: cta sm | entry wait part first-in firstS firstPV last-in end (µs) | combine: cta sm entry split wait batch folds end\n");
            for (int k = 0; k < 2; ++k)
                for (int c = 0; c < kC; ++c) {
                    if (!at(k, c, 0, 0)) continue;
                    printf("    dump%d %4d %3d", k, c, sm_of(k, c));
                    for (int i = 0; i < npts[k]; ++i)
                        printf(" %7.2f", at(k, c, i, 0) ? (double)(at(k, c, i, 0) - t0) * 1e-3 : -1.0);
                    printf("\n");
                }
        }
        if (!ratio.empty()) {
            std::sort(ratio.begin(), ratio.end());
            ns_per_cyc.push_back(ratio[ratio.size() / 2]);
        }
    }
    auto med = [](std::vector<double> v) {
        if (v.empty()) return -1.0;
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
    };
    const double npc = med(ns_per_cyc);
    printf("\n    trace: event %.2f us; µs after the first decode CTA's entry: first / median / last CTA; "
           "median phase length per CTA (clock64, %.3f ns/cycle)\n",
           med(ev), npc);
    for (int k = 0; k < 2; ++k)
        for (int i = 0; i < npts[k]; ++i) {
            if (pts[k][i][0].empty()) continue;
            printf("    %-7s %-12s %7.2f %7.2f %7.2f", k ? "combine" : "decode", names[k][i], med(pts[k][i][0]),
                   med(pts[k][i][1]), med(pts[k][i][2]));
            if (i > 0 && !cyc[k][i].empty()) printf("   phase %7.0f cyc = %5.2f us", med(cyc[k][i]), med(cyc[k][i]) * npc * 1e-3);
            printf("\n");
        }
}
#endif

// Median time of: the decode call (decode + combine) as launched, and its CUDA-graph replay.
template <typename D>
static void breakdown(D dec, double bytes, double flops) {
#ifdef MLA_TRACE
    if (g_trace) {
        trace(dec);
        return;
    }
#endif
    float ms = time_ms([&] { dec(); }, 50);
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(g_st, cudaStreamCaptureModeGlobal));
    dec();
    CK(cudaStreamEndCapture(g_st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    float ms_g = time_ms([&] { CK(cudaGraphLaunch(ge, g_st)); }, 50);
    printf("  %.1f us (graph %.1f)  %.0f GB/s  %.1f TFLOP/s", ms * 1e3, ms_g * 1e3, bytes / ms / 1e6,
           flops / ms / 1e9);
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
}

// Runs one dense case; returns max relative row error vs the double reference (sampled rows).
static int g_spare_blocks = 1;  // table entries past the longest request (0: the bench's exact table)
static double run_dense(int batch, int q_len, int heads, int bs, int L, bool vary, int occ, bool timeit) {
    const int max_blocks = (L + bs - 1) / bs + g_spare_blocks;
    std::vector<int> seq(batch);
    for (int b = 0; b < batch; ++b) seq[b] = !g_lens.empty() ? g_lens[b] : vary ? (int)(rng() % (L + 1)) : L;
    if (vary && batch > 1) seq[0] = 0;
    // blocks for the rows each request has (+1), shuffled; the table's unused entries point at block 0
    int used = 0;
    for (int b = 0; b < batch; ++b) used += (seq[b] + bs - 1) / bs + 1;
    const int num_blocks = used + 3;
    std::vector<int> table(batch * max_blocks, 0);
    std::vector<int> perm(num_blocks);
    for (int i = 0; i < num_blocks; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int b = 0, n = 0; b < batch; ++b)
        for (int i = 0; i < (seq[b] + bs - 1) / bs + 1; ++i, ++n)
            if (i < max_blocks) table[b * max_blocks + i] = perm[n];
    const size_t cache_elems = (size_t)num_blocks * bs * 576;
    std::vector<__nv_bfloat16> cache(cache_elems), q((size_t)batch * q_len * heads * 576);
    for (auto& x : cache) x = __float2bfloat16(frand());
    for (auto& x : q) x = __float2bfloat16(frand());
    const float scale = 1.f / 16.f;

    mla_schedule_t s;
    const mla_tuning_t tune = tuning(occ);
    const mla_shape_t shape{batch, q_len, heads, max_blocks * bs, MLA_KV_BF16};
    MK(mla_schedule_init(&s, &shape, &tune));
    void *d_cache, *d_q, *d_out, *d_ws;
    int *d_table, *d_seq;
    float* d_lse;
    uint32_t* d_flag;
    const size_t out_elems = (size_t)batch * q_len * heads * 512;
    CK(cudaMalloc(&d_cache, cache_elems * 2));
    CK(cudaMalloc(&d_q, q.size() * 2));
    CK(cudaMalloc(&d_out, out_elems * 2));
    CK(cudaMalloc(&d_lse, (size_t)batch * q_len * heads * 4));
    CK(cudaMalloc(&d_table, table.size() * 4));
    CK(cudaMalloc(&d_seq, batch * 4));
    CK(cudaMalloc(&d_ws, mla_workspace_bytes(&s)));
    CK(cudaMalloc(&d_flag, 16));
    CK(cudaMemset(d_flag, 0, 16));
    CK(cudaMemcpy(d_cache, cache.data(), cache_elems * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_seq, seq.data(), batch * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(d_out, 0xff, out_elems * 2));  // poison (NaN)
    CK(cudaMemset(d_lse, 0xff, (size_t)batch * q_len * heads * 4));

    mla_dense_params_t p{};
    p.batch = batch;
    p.q_len = q_len;
    p.num_heads = heads;
    p.kv_format = MLA_KV_BF16;
    p.q_nope = d_q;
    p.q_rope = (char*)d_q + 1024;
    p.q_nope_token_stride = p.q_rope_token_stride = (int64_t)heads * 576;
    p.q_nope_head_stride = p.q_rope_head_stride = 576;
    p.kv_cache = d_cache;
    p.block_stride_bytes = (int64_t)bs * 1152;
    p.num_blocks = num_blocks;
    p.block_size = bs;
    p.block_table = d_table;
    p.max_blocks_per_seq = max_blocks;
    p.block_table_stride = max_blocks;
    p.out = d_out;
    p.out_token_stride = (int64_t)heads * 512;
    p.out_head_stride = 512;
    p.lse = d_lse;
    p.lse_token_stride = heads;
    p.lse_head_stride = 1;
    p.softmax_scale = scale;
    p.dtype = MLA_DTYPE_BF16;
    p.seq_lens = d_seq;
    p.workspace = (float*)d_ws;
    p.error_flag = d_flag;
    CK(cudaDeviceSynchronize());
    MK(mla_dense_decode(&s, &p, g_st));
    CK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> out(out_elems);
    std::vector<float> lse((size_t)batch * q_len * heads);
    CK(cudaMemcpy(out.data(), d_out, out_elems * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost));
    uint32_t flag[4];
    CK(cudaMemcpy(flag, d_flag, 16, cudaMemcpyDeviceToHost));

    double worst = 0, worst_lse = 0;
    int checked = 0;
    for (int b = 0; b < batch; ++b) {
        if (batch > 8 && b % (batch / 8) != 0 && b != batch - 1) continue;
        for (int i = 0; i < q_len; ++i)
            for (int h = 0; h < heads; ++h) {
                if (heads > 16 && h % 7 != 0 && h != heads - 1) continue;
                const int vis = seq[b] - q_len + i + 1;
                const __nv_bfloat16* qr = &q[(((size_t)b * q_len + i) * heads + h) * 576];
                std::vector<double> sc;
                std::vector<const __nv_bfloat16*> rows;
                for (int t = 0; t < vis; ++t) {
                    const __nv_bfloat16* kr = &cache[((size_t)table[b * max_blocks + t / bs] * bs + t % bs) * 576];
                    double d = 0;
                    for (int k = 0; k < 576; ++k) d += (double)__bfloat162float(qr[k]) * __bfloat162float(kr[k]);
                    sc.push_back(d * scale);
                    rows.push_back(kr);
                }
                std::vector<double> o(512, 0.0);
                double ref_lse = -INFINITY;
                if (!sc.empty()) {
                    double mx = *std::max_element(sc.begin(), sc.end()), sum = 0;
                    for (size_t t = 0; t < sc.size(); ++t) {
                        double w = std::exp(sc[t] - mx);
                        sum += w;
                        for (int k = 0; k < 512; ++k) o[k] += w * __bfloat162float(rows[t][k]);
                    }
                    for (auto& x : o) x /= sum;
                    ref_lse = mx + std::log(sum);
                }
                const size_t row = ((size_t)b * q_len + i) * heads + h;
                double num = 0, den = 0;
                for (int k = 0; k < 512; ++k) {
                    double g = __bfloat162float(out[row * 512 + k]);
                    num += (g - o[k]) * (g - o[k]);
                    den += o[k] * o[k];
                }
                double rel = sc.empty() ? std::sqrt(num) : std::sqrt(num / den);
                if (std::isnan(rel)) rel = 1e9;
                worst = std::max(worst, rel);
                double le = sc.empty() ? (std::isinf(lse[row]) && lse[row] < 0 ? 0 : 1e9) : std::fabs(lse[row] - ref_lse);
                if (std::isnan(le)) le = 1e9;
                worst_lse = std::max(worst_lse, le);
                ++checked;
            }
    }
    printf("dense b=%d q=%d h=%d bs=%d L=%d vary=%d occ=%d parts=%d: rows %d relerr %.2e lse_err %.2e flag %u",
           batch, q_len, heads, bs, L, vary, occ, s.num_parts, checked, worst, worst_lse, flag[0]);
    if (timeit) {
        const double bytes = (double)batch * L * 1152 + q.size() * 2 + out_elems * 2;
        const double flops = 2.0 * batch * q_len * heads * (double)L * 1088;
        breakdown([&] { MK(mla_dense_decode(&s, &p, g_st)); }, bytes, flops);
    }
    printf("\n");
    cudaFree(d_cache); cudaFree(d_q); cudaFree(d_out); cudaFree(d_lse); cudaFree(d_table); cudaFree(d_seq);
    cudaFree(d_ws); cudaFree(d_flag);
    return std::max(worst, worst_lse);
}

static double run_sparse(int T, int heads, int topk, int pool, bool holes, int occ, bool timeit) {
    const int bs = 64;
    const int num_blocks = (pool + bs - 1) / bs;
    const size_t cache_elems = (size_t)num_blocks * bs * 576;
    std::vector<__nv_bfloat16> cache(cache_elems), q((size_t)T * heads * 576);
    for (auto& x : cache) x = __float2bfloat16(frand());
    for (auto& x : q) x = __float2bfloat16(frand());
    std::vector<int> idx((size_t)T * topk);
    std::vector<int> all(pool);
    for (int i = 0; i < pool; ++i) all[i] = i;
    for (int t = 0; t < T; ++t) {
        for (int k = 0; k < topk; ++k) {  // partial shuffle: distinct slots
            int j = k + (int)(rng() % (pool - k));
            std::swap(all[k], all[j]);
            idx[(size_t)t * topk + k] = all[k];
            if (holes && rng() % 7 == 0) idx[(size_t)t * topk + k] = -1;
        }
    }
    const float scale = 1.f / 16.f;
    mla_schedule_t s;
    const mla_tuning_t tune = tuning(occ);
    const mla_shape_t shape{T, 1, heads, topk, MLA_KV_BF16, MLA_KIND_SPARSE};
    MK(mla_schedule_init(&s, &shape, &tune));
    void *d_cache, *d_q, *d_out, *d_ws;
    int* d_idx;
    float* d_lse;
    const size_t out_elems = (size_t)T * heads * 512;
    CK(cudaMalloc(&d_cache, cache_elems * 2));
    CK(cudaMalloc(&d_q, q.size() * 2));
    CK(cudaMalloc(&d_out, out_elems * 2));
    CK(cudaMalloc(&d_lse, (size_t)T * heads * 4));
    CK(cudaMalloc(&d_idx, idx.size() * 4));
    CK(cudaMalloc(&d_ws, mla_workspace_bytes(&s)));
    CK(cudaMemcpy(d_cache, cache.data(), cache_elems * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_idx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(d_out, 0xff, out_elems * 2));
    mla_sparse_params_t p{};
    p.num_tokens = T;
    p.num_heads = heads;
    p.kv_format = MLA_KV_BF16;
    p.q_nope = d_q;
    p.q_rope = (char*)d_q + 1024;
    p.q_nope_token_stride = p.q_rope_token_stride = (int64_t)heads * 576;
    p.q_nope_head_stride = p.q_rope_head_stride = 576;
    p.kv_cache = d_cache;
    p.block_stride_bytes = (int64_t)bs * 1152;
    p.num_blocks = num_blocks;
    p.block_size = bs;
    p.indices = d_idx;
    p.topk = topk;
    p.indices_stride = topk;
    p.out = d_out;
    p.out_token_stride = (int64_t)heads * 512;
    p.out_head_stride = 512;
    p.lse = d_lse;
    p.lse_token_stride = heads;
    p.lse_head_stride = 1;
    p.softmax_scale = scale;
    p.dtype = MLA_DTYPE_BF16;
    p.topk_len = nullptr;
    p.workspace = (float*)d_ws;
    CK(cudaDeviceSynchronize());
    MK(mla_sparse_decode(&s, &p, g_st));
    CK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> out(out_elems);
    std::vector<float> lse((size_t)T * heads);
    CK(cudaMemcpy(out.data(), d_out, out_elems * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost));
    double worst = 0, worst_lse = 0;
    for (int t = 0; t < T; ++t) {
        if (T > 8 && t % (T / 8) != 0) continue;
        for (int h = 0; h < heads; ++h) {
            if (heads > 16 && h % 7 != 0) continue;
            const __nv_bfloat16* qr = &q[((size_t)t * heads + h) * 576];
            std::vector<double> sc;
            std::vector<const __nv_bfloat16*> rows;
            for (int k = 0; k < topk; ++k) {
                int id = idx[(size_t)t * topk + k];
                if (id < 0) continue;
                const __nv_bfloat16* kr = &cache[(size_t)id * 576];
                double d = 0;
                for (int c = 0; c < 576; ++c) d += (double)__bfloat162float(qr[c]) * __bfloat162float(kr[c]);
                sc.push_back(d * scale);
                rows.push_back(kr);
            }
            std::vector<double> o(512, 0.0);
            double mx = *std::max_element(sc.begin(), sc.end()), sum = 0;
            for (size_t i = 0; i < sc.size(); ++i) {
                double w = std::exp(sc[i] - mx);
                sum += w;
                for (int c = 0; c < 512; ++c) o[c] += w * __bfloat162float(rows[i][c]);
            }
            double num = 0, den = 0;
            const size_t row = (size_t)t * heads + h;
            for (int c = 0; c < 512; ++c) {
                double g = __bfloat162float(out[row * 512 + c]);
                num += (g - o[c] / sum) * (g - o[c] / sum);
                den += (o[c] / sum) * (o[c] / sum);
            }
            double rel = std::sqrt(num / den);
            if (std::isnan(rel)) rel = 1e9;
            worst = std::max(worst, rel);
            double le = std::fabs(lse[row] - (mx + std::log(sum)));
            if (std::isnan(le)) le = 1e9;
            worst_lse = std::max(worst_lse, le);
        }
    }
    printf("sparse t=%d h=%d k=%d pool=%d holes=%d occ=%d parts=%d: relerr %.2e lse_err %.2e", T, heads, topk, pool,
           holes, occ, s.num_parts, worst, worst_lse);
    if (timeit) {
        const double bytes = (double)T * topk * 1152 + q.size() * 2 + out_elems * 2 + idx.size() * 4;
        const double flops = 2.0 * T * heads * (double)topk * 1088;
        breakdown([&] { MK(mla_sparse_decode(&s, &p, g_st)); }, bytes, flops);
    }
    printf("\n");
    cudaFree(d_cache); cudaFree(d_q); cudaFree(d_out); cudaFree(d_lse); cudaFree(d_idx);
    cudaFree(d_ws);
    return std::max(worst, worst_lse);
}

int main(int argc, char** argv) {
    const bool quick = argc > 1 && argv[1][0] == 'q';
    if (argc > 1 && argv[1][0] == 'p') {  // one case, for ncu
        run_dense(64, 1, 8, 64, 4096, false, 0, false);
        return 0;
    }
    CK(cudaStreamCreateWithFlags(&g_st, cudaStreamNonBlocking));
    if (argc > 1 && argv[1][0] == 't') {  // trace builds (-DMLA_TRACE): where a small step's time goes
        g_trace = true;
        run_dense(1, 1, 8, 64, 4096, false, 0, true);
        run_sparse(1, 8, 2048, 65536, false, 0, true);
        run_sparse(32, 8, 2048, 65536, false, 0, true);
        run_dense(64, 1, 8, 64, 4096, false, 0, true);
        g_spare_blocks = 0;  // the one-token call and top-1 as the bench runs them (one part, no combine)
        printf("dense one-token");
        run_dense(1, 1, 8, 64, 1, false, 0, true);
        printf("sparse top-1");
        run_sparse(1, 8, 1, 65536, false, 0, true);
        return 0;
    }
    if (argc > 1 && argv[1][0] == 'm') {  // trace builds: mixed-length and mid-size steps (issue #13)
        g_trace = true;
        auto mixed = [](int heads, int n, int a, int m, int b) {
            g_lens.assign(n, a);
            g_lens.insert(g_lens.end(), m, b);
            printf("dense h=%d lens=%d*%d+%d*%d", heads, a, n, b, m);
            run_dense(n + m, 1, heads, 64, std::max(a, b), false, 0, true);
            g_lens.clear();
        };
        printf("dense b=1 l=4096");
        run_dense(1, 1, 8, 64, 4096, false, 0, true);
        mixed(8, 15, 512, 1, 8192);
        mixed(8, 16, 4096, 0, 0);
        mixed(16, 127, 1024, 1, 65536);
        printf("dense b=64 l=4096");
        run_dense(64, 1, 8, 64, 4096, false, 0, true);
        return 0;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
    double worst = 0;
    worst = std::max(worst, run_dense(1, 1, 8, 64, 1, false, 0, false));
    worst = std::max(worst, run_dense(1, 1, 8, 64, 17, false, 0, false));
    worst = std::max(worst, run_dense(3, 1, 1, 16, 100, true, 0, false));
    worst = std::max(worst, run_dense(4, 2, 8, 32, 300, true, 0, false));
    worst = std::max(worst, run_dense(5, 8, 16, 128, 1000, true, 0, false));
    worst = std::max(worst, run_dense(2, 4, 128, 64, 700, true, 0, false));
    worst = std::max(worst, run_dense(37, 1, 8, 16, 3000, true, 1, false));
    worst = std::max(worst, run_dense(6, 3, 8, 16, 5, true, 0, false));
    worst = std::max(worst, run_sparse(3, 8, 100, 5000, true, 0, false));
    worst = std::max(worst, run_sparse(2, 128, 2048, 65536, false, 0, false));
    printf("WORST %.3e\n", worst);
    if (quick) return worst < 2e-2 ? 0 : 1;
    // timing (no L2 flush: quick signal only; the Rust bench is the reference)
    run_dense(64, 1, 8, 64, 4096, false, 0, true);
    run_dense(64, 1, 8, 64, 4096, false, 1, true);
    run_dense(128, 1, 8, 64, 8192, false, 0, true);
    run_dense(32, 1, 16, 64, 16384, false, 0, true);
    run_dense(1, 1, 8, 64, 4096, false, 0, true);
    run_dense(4, 1, 8, 64, 65536, false, 0, true);
    run_dense(64, 1, 64, 64, 4096, false, 0, true);
    run_dense(128, 1, 128, 64, 4096, false, 0, true);
    run_sparse(1, 8, 2048, 65536, false, 0, true);
    run_sparse(32, 8, 2048, 65536, false, 0, true);
    run_sparse(128, 8, 2048, 65536, false, 0, true);
    run_sparse(128, 16, 2048, 65536, false, 0, true);
    run_sparse(64, 64, 2048, 65536, false, 0, true);
    run_sparse(128, 128, 2048, 65536, false, 0, true);
    return worst < 2e-2 ? 0 : 1;
}
