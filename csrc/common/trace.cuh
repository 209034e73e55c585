// Phase timestamps for scripts/smoke.cu's trace mode (built with -DMLA_TRACE only): thread 0
// of each CTA stores (%globaltimer, clock64 | %smid << 52) at the named points below, into
// g_mla_trace[kernel][cta][point]; decode/decode.cu's mla_trace_read copies them out.
// Without MLA_TRACE the points compile to nothing. Include this only from the translation
// unit that launches the kernels (it defines g_mla_trace).
#pragma once

namespace mla {

// The kernels traced (the first index of g_mla_trace).
enum TraceKernel : int { kTraceDecode = 0, kTraceCombine = 1 };

// Points of decode_kernel, in the order a CTA passes them (scripts/smoke.cu names them in
// this order).
enum DecodeTracePoint : int {
    kTraceDecodeEntry = 0,    // kernel entry
    kTraceDecodeWaitDone,     // grid_dependency_wait() returned
    kTracePartFound,          // the CTA's part of the split is known
    kTraceFirstTileIn,        // the first tile is in shared memory
    kTraceFirstSDone,         // the first tile's scores are summed
    kTraceFirstPvDone,        // the first tile's P V is done
    kTraceLastTileIn,         // the last tile is in shared memory
    kTraceDecodeEnd,          // every copy waited for
};

// Points of combine_kernel.
enum CombineTracePoint : int {
    kTraceCombineEntry = 0,   // kernel entry
    kTraceSplitFound,         // the CTA's split request is known
    kTraceCombineWaitDone,    // grid_dependency_wait() returned
    kTraceFirstBatchIn,       // warp 0's first batch of pieces is loaded
    kTraceFoldsDone,          // the folds are done (8 warps per row: staged and synchronized)
    kTraceCombineEnd,         // the merged rows are written
};

constexpr int kTraceCtas = 2048, kTracePoints = 8;

}  // namespace mla

#ifdef MLA_TRACE
__device__ unsigned long long g_mla_trace[2][mla::kTraceCtas][mla::kTracePoints][2];
#define MLA_TRACE_AT(k, i)                                                                       \
    do {                                                                                         \
        const unsigned cta_ = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;    \
        if (threadIdx.x == 0 && cta_ < mla::kTraceCtas) {                                        \
            unsigned long long t_;                                                               \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                               \
            g_mla_trace[k][cta_][i][0] = t_;                                                     \
            unsigned smid_;                                                                      \
            asm volatile("mov.u32 %0, %%smid;" : "=r"(smid_));                                   \
            /* clock64 in the low 52 bits, the SM's id above (scripts/smoke.cu masks it) */      \
            g_mla_trace[k][cta_][i][1] = (clock64() & ((1ull << 52) - 1)) | ((unsigned long long)smid_ << 52); \
        }                                                                                        \
    } while (0)
#else
#define MLA_TRACE_AT(k, i) \
    do {                   \
    } while (0)
#endif
