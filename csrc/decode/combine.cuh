// The combine kernel: merges the pieces of every split request (decode/split.cuh says which
// requests are split and where their pieces are), in part order, into `out` and `lse`.
#pragma once

#include "common/constants.cuh"
#include "common/ptx.cuh"
#include "common/trace.cuh"
#include "decode/args.cuh"
#include "decode/config.cuh"
#include "decode/split.cuh"

namespace mla {

// The combine splits the 512 output dims of a row into kSlices slices (grid z), so that the
// piece reads of a step with few split rows (b=1, t=1: 8 rows) spread over more SMs. A slice
// of 512 / kSlices dims is covered by kLanes lanes of a warp holding kF4 float4 each; with
// 32-dim slices a warp reads 4 pieces per load instruction (lane group lane / 8 takes every
// 4th of the warp's pieces) and merges its lane groups at the end. A lane keeps kBatch pieces'
// loads in flight (one round trip per batch); the batch sets the kernel's registers, and so
// how many combine CTAs an SM holds beside decode's (decode/split.cuh, combine_deep_batch).
template <int kSlices>  // 1, 2, 4 or 16
struct SliceShape {
    static_assert(kSlices == 1 || kSlices == 2 || kSlices == 4 || kSlices == 16, "1, 2, 4 or 16 slices");
    static constexpr int kDims = kLatentDim / kSlices;      // dims of a slice
    static constexpr int kF4 = kSlices <= 2 ? 4 / kSlices : 1;  // float4 per lane
    static constexpr int kLanes = kDims / (4 * kF4);        // lanes per piece row: 32 or 8
    static constexpr int kGroups = 32 / kLanes;             // pieces per load instruction
};

// Writes merged row m of request r: lane's dims [dim0 + (lane % kLanes)*4*kF4, +4*kF4) of
// acc / wsum (lanes of group 0), and lse (lane 0 of the slice at dim 0).
template <typename T, bool kSparse, int kSlices>
__device__ __forceinline__ void store_merged_row(const DecodeArgs& a, int r, int m, int dim0,
                                                 const float (&acc)[4 * SliceShape<kSlices>::kF4], float mx,
                                                 float wsum) {
    using S = SliceShape<kSlices>;
    constexpr int kF4 = S::kF4;
    const int lane = threadIdx.x & 31;
    if (lane >= S::kLanes) return;
    const float inv = wsum > 0.f ? fast_rcp(wsum) : 0.f;
    int token, head;
    row_token_head<kSparse>(a, r, m, token, head);
    T* dst = reinterpret_cast<T*>(a.out) + token * a.out_ts + head * a.out_hs + dim0 + lane * 4 * kF4;
    uint32_t pw[2 * kF4];
#pragma unroll
    for (int i = 0; i < 2 * kF4; ++i) pw[i] = Elem<T>::pack(acc[2 * i] * inv, acc[2 * i + 1] * inv);
    if constexpr (kF4 == 1) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(pw[0], pw[1]);
    } else {
#pragma unroll
        for (int i = 0; i < kF4 / 2; ++i)
            reinterpret_cast<uint4*>(dst)[i] = make_uint4(pw[4 * i], pw[4 * i + 1], pw[4 * i + 2], pw[4 * i + 3]);
    }
    if (lane == 0 && dim0 == 0 && a.lse != nullptr) {
        a.lse[token * a.lse_ts + head * a.lse_hs] = wsum > 0.f ? (mx + fast_log2(wsum)) * kLn2 : -INFINITY;
    }
}

// A running (max, weight sum, lane's 4 * kF4 dims) over pieces.
template <int kSlices>
struct RowFold {
    float mx = -INFINITY;
    float wsum = 0.f;
    float acc[4 * SliceShape<kSlices>::kF4] = {};

    // Merges another fold into this one (both in the log2 domain).
    __device__ __forceinline__ void merge(float omx, float ow, const float* oacc) {
        const float nm = fmaxf(mx, omx);
        if (nm == -INFINITY) return;  // both empty
        const float s0 = fast_exp2(mx - nm), s1 = fast_exp2(omx - nm);  // an empty side: 0
        wsum = wsum * s0 + ow * s1;
#pragma unroll
        for (int i = 0; i < 4 * SliceShape<kSlices>::kF4; ++i) acc[i] = acc[i] * s0 + oacc[i] * s1;
        mx = nm;
    }
};

// One warp folds pieces first, first+step, ... <= last of query row m (its slice at dim0)
// into f: kBatch pieces per lane at a time with all their loads in flight (one round trip
// per batch), in piece order within each lane group, then the lane groups merge (xor
// shuffles, a fixed order), so the result depends only on the data and every lane holds
// it. first_tail: the first piece of the request (piece `req_first`) is in slot 2q+1.
template <int kSlices, int kBatch>
__device__ __forceinline__ void fold_pieces(const DecodeArgs& a, int req_first, int first_tail, int first, int last,
                                            int step, int m, int dim0, RowFold<kSlices>& f) {
    using S = SliceShape<kSlices>;
    constexpr int kF4 = S::kF4;
    const int lane = threadIdx.x & 31;
    const int group = lane / S::kLanes;
    // lane group g takes pieces first + g*step, + kGroups*step, ...
    first += group * step;
    step *= S::kGroups;
    // Piece q's row is in slot ws_slot(q, 0) = 2q (2q + 1 for the request's first piece when
    // first_tail; decode/split.cuh): consecutive pieces of this lane are 2 * step * m_rows
    // rows apart, so a batch's loads are one base address plus constant multiples of that
    // stride.
    const int64_t stride = static_cast<int64_t>(ws_slot(step, 0)) * a.m_rows;
    const int lane_dim = dim0 + (lane % S::kLanes) * 4 * kF4;
#pragma unroll 1
    for (int q0 = first; q0 <= last; q0 += kBatch * step) {
        const int64_t row0 = static_cast<int64_t>(ws_slot(q0, q0 == req_first ? first_tail : 0)) * a.m_rows + m;
        const int64_t fix = q0 == req_first ? -static_cast<int64_t>(first_tail) * a.m_rows : 0;  // pieces after the first
        const float* lse0 = a.ws_lse + row0;
        const float4* o0 = reinterpret_cast<const float4*>(a.ws_o + row0 * kLatentDim + lane_dim);
        float l[kBatch];
        float4 v[kBatch][kF4];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
            const int64_t off = b == 0 ? 0 : b * stride + fix;
            if (q0 + b * step <= last) {
                l[b] = lse0[off];
#pragma unroll
                for (int k = 0; k < kF4; ++k) v[b][k] = o0[off * (kLatentDim / 4) + k];
            } else {
                l[b] = -INFINITY;
#pragma unroll
                for (int k = 0; k < kF4; ++k) v[b][k] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
        float bm = f.mx;
#pragma unroll
        for (int b = 0; b < kBatch; ++b) bm = fmaxf(bm, l[b]);
#ifdef MLA_TRACE
        // the condition reads the batch's last load, so the point is stored once it has arrived
        if (q0 == first && v[kBatch - 1][kF4 - 1].w != 12345.f) MLA_TRACE_AT(kTraceCombine, kTraceFirstBatchIn);
#endif
        if (bm == -INFINITY) continue;  // only empty pieces so far
        const float sc = fast_exp2(f.mx - bm);  // f.mx = -inf: 0
        f.wsum *= sc;
#pragma unroll
        for (int i = 0; i < 4 * kF4; ++i) f.acc[i] *= sc;
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
            const float w = fast_exp2(l[b] - bm);  // empty piece: 0
            f.wsum += w;
#pragma unroll
            for (int k = 0; k < kF4; ++k) {
                f.acc[4 * k + 0] += w * v[b][k].x;
                f.acc[4 * k + 1] += w * v[b][k].y;
                f.acc[4 * k + 2] += w * v[b][k].z;
                f.acc[4 * k + 3] += w * v[b][k].w;
            }
        }
        f.mx = bm;
    }
    // Merge the lane groups: lanes l and l ^ d (d = kLanes, 2 kLanes, ...) hold the same dims
    // of disjoint pieces; fmax and + are commutative, so both get the same result.
#pragma unroll
    for (int d = S::kLanes; d < 32; d <<= 1) {
        const float omx = __shfl_xor_sync(0xffffffffu, f.mx, d);
        const float ow = __shfl_xor_sync(0xffffffffu, f.wsum, d);
        float oacc[4 * kF4];
#pragma unroll
        for (int i = 0; i < 4 * kF4; ++i) oacc[i] = __shfl_xor_sync(0xffffffffu, f.acc[i], d);
        f.merge(omx, ow, oacc);
    }
}

// A combine CTA's shared memory: the 8-warp merge's per-warp folds (kRed float4 per warp, their
// maxima and weights) and find_split's scratch followed by its result (SplitFound).
template <int kRed>
struct CombineShared {
    static constexpr int kScratch = split_scratch_ints<kCombineWarps * 32>();
    float red_max[kCombineWarps];
    float red_w[kCombineWarps];
    float4 red_o[kCombineWarps * kRed];
    int scratch[kScratch + kFoundInts];
    __device__ int* found() { return scratch + kScratch; }
};

// Warp w merges row 8m + w (combine_rows = 8) of request r alone, over all its pieces
// (first..last; first_tail as SplitFound's bit 0).
template <typename T, bool kSparse, int kSlices, int kBatch>
__device__ __forceinline__ void merge_rows_by_warp(const DecodeArgs& a, int r, int first, int first_tail, int last,
                                                   int m, int dim0) {
    const int mw = m * a.combine_rows + (threadIdx.x >> 5);
    if ((threadIdx.x >> 5) < a.combine_rows && mw < a.m_rows) {
        RowFold<kSlices> f;
        fold_pieces<kSlices, kBatch>(a, first, first_tail, first, last, 1, mw, dim0, f);
        MLA_TRACE_AT(kTraceCombine, kTraceFoldsDone);
        store_merged_row<T, kSparse, kSlices>(a, r, mw, dim0, f.acc, f.mx, f.wsum);
    }
}

// All 8 warps merge query row m's slice at dim0 (kSl slices) of request r (pieces
// first..last): warp w folds pieces first+w, first+w+8, ..., then warp 0 merges the eight
// folds in warp order (through sh's red_*) and writes the row. Every thread calls it (a
// barrier over red_*).
template <typename T, bool kSparse, int kSl, int kBatch, int kRedStride>
__device__ __forceinline__ void merge_row_by_warps(const DecodeArgs& a, int r, int first, int first_tail, int last,
                                                   int m, int dim0, CombineShared<kRedStride>& sh) {
    using S = SliceShape<kSl>;
    constexpr int kF4 = S::kF4;
    static_assert(kRedStride >= S::kLanes * kF4, "red_o rows too short");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    {
        RowFold<kSl> f;
        fold_pieces<kSl, kBatch>(a, first, first_tail, first + warp, last, kCombineWarps, m, dim0, f);
        if (lane < S::kLanes) {
#pragma unroll
            for (int i = 0; i < kF4; ++i)
                sh.red_o[warp * kRedStride + lane * kF4 + i] =
                    make_float4(f.acc[4 * i], f.acc[4 * i + 1], f.acc[4 * i + 2], f.acc[4 * i + 3]);
        }
        if (lane == 0) {
            sh.red_max[warp] = f.mx;
            sh.red_w[warp] = f.wsum;
        }
    }
    __syncthreads();
    MLA_TRACE_AT(kTraceCombine, kTraceFoldsDone);
    if (warp != 0 || lane >= S::kLanes) return;
    float mx = sh.red_max[0];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) mx = fmaxf(mx, sh.red_max[w]);
    float wt = 0.f;
    float sum[4 * kF4] = {};
    if (mx != -INFINITY) {
#pragma unroll
        for (int w = 0; w < kCombineWarps; ++w) {
            const float sc = fast_exp2(sh.red_max[w] - mx);  // an empty warp: 0
            wt += sh.red_w[w] * sc;
#pragma unroll
            for (int i = 0; i < kF4; ++i) {
                const float4 u = sh.red_o[w * kRedStride + lane * kF4 + i];
                sum[4 * i + 0] += sc * u.x;
                sum[4 * i + 1] += sc * u.y;
                sum[4 * i + 2] += sc * u.z;
                sum[4 * i + 3] += sc * u.w;
            }
        }
    }
    store_merged_row<T, kSparse, kSl>(a, r, m, dim0, sum, mx, wt);
}

// Merges the rows of split request r (pieces first..last) that CTA (., m, z) owns.
template <typename T, bool kSparse, int kSlices, int kBatch, int kRed>
__device__ __forceinline__ void merge_split(const DecodeArgs& a, const int* found_s, int m, int dim0,
                                            CombineShared<kRed>& sh) {
    const int r = found_s[kFoundReq], first = found_s[kFoundFirst], last = found_s[kFoundLast];
    const int first_tail = found_s[kFoundTail];
    if (a.combine_rows > 1) {  // few pieces per request: warp w merges row m + w alone
        merge_rows_by_warp<T, kSparse, kSlices, kBatch>(a, r, first, first_tail, last, m, dim0);
    } else {  // many pieces: 8 warps per row
        merge_row_by_warps<T, kSparse, kSlices, kBatch, kRed>(a, r, first, first_tail, last, m, dim0, sh);
    }
}

// Merge the pieces of split requests. CTA (k, m, z): the k-th split request (in request
// order; found from the lengths like decode's split), query row m, dims slice z of
// 512 / kSlices, kBatch pieces per lane per round trip. Its warps fold every
// kCombineWarps-th piece, then warp 0 merges the folds in warp order (merge_row_by_warps):
// the result does not depend on timing. When the schedule expects few pieces per request
// (combine_rows = 8), CTA (k, g, z) instead merges rows 8g..8g+7, a warp per row over all
// pieces (merge_rows_by_warp; 8x fewer CTAs: ncu showed the kernel's cost growing with its
// CTA count). kLoop (the host launches it only where BoundarySplits applies, with fewer CTAs
// than split boundaries: decode/split.cuh, combine_loop_ctas): CTA (x, m, z) loads the lengths
// once and takes split boundaries x, x + gridDim.x, ... in turn, so that a step of thousands
// of requests where few or none are split does not pay a CTA (launch, lengths, search) per
// part boundary.
template <typename T, bool kSparse, int kSlices, int kBatch, bool kLoop = false>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const DecodeArgs a) {
    using S = SliceShape<kSlices>;
    constexpr int kRed = S::kLanes * S::kF4;  // red_o per warp
    MLA_TRACE_AT(kTraceCombine, kTraceCombineEntry);
    __shared__ CombineShared<kRed> sh;
    int* found_s = sh.found();
    const Lens lens{a.lens, a.max_len};
    const int m = blockIdx.y;  // row (combine_rows == 1) or group of combine_rows rows
    const int dim0 = blockIdx.z * S::kDims;
    if constexpr (kLoop) {
        // Its first kLoopOwn split requests are found before the wait (while decode finishes,
        // as a CTA per boundary did), the rest after its merges.
        constexpr int kLoopOwn = 8;
        __shared__ int own[kLoopOwn][kFoundInts];
        BoundarySplits<kCombineWarps * 32> bs;
        bs.init(a, lens, sh.scratch);
        int n = 0, k = blockIdx.x;
#pragma unroll 1
        for (; n < kLoopOwn && bs.in_step(k); k += gridDim.x) n += bs.find(a, lens, k, sh.scratch, own[n]) ? 1 : 0;
        if (n == 0 && !bs.in_step(k)) return;  // (uniform)
        grid_dependency_wait();
#pragma unroll 1
        for (int i = 0; i < n; ++i) merge_split<T, kSparse, kSlices, kBatch>(a, own[i], m, dim0, sh);
#pragma unroll 1
        for (; bs.in_step(k); k += gridDim.x) {
            if (!bs.find(a, lens, k, sh.scratch, found_s)) continue;  // (uniform)
            merge_split<T, kSparse, kSlices, kBatch>(a, found_s, m, dim0, sh);
        }
        return;
    }
    // The k-th split request, in request order, from the lengths (as decode split them).
    // The lengths are inputs, not decode's output: this runs while decode finishes (with
    // PDL every decode CTA has passed its own wait, so whatever wrote them is complete);
    // only the pieces need the wait.
    const bool found = find_split<kCombineWarps * 32>(a, lens, blockIdx.x, sh.scratch, found_s);
    if (!found) return;
    MLA_TRACE_AT(kTraceCombine, kTraceSplitFound);
    grid_dependency_wait();
    MLA_TRACE_AT(kTraceCombine, kTraceCombineWaitDone);
    merge_split<T, kSparse, kSlices, kBatch>(a, found_s, m, dim0, sh);
    MLA_TRACE_AT(kTraceCombine, kTraceCombineEnd);
}

// The combine that takes out the rows of long requests (decode/split.cuh, LongRule: one
// request of hundreds of pieces among short ones would keep its few CTAs folding in series
// while the others are done) and deals their (row, 32-dim slice) items to every CTA of the grid
// in turn (item i to CTA i mod the grid's size; no counter, nothing to reset between calls),
// each merged by all 8 warps of its CTA after the CTA's own request (logs #63, #67). kByWarps: 8
// warps merge each row of the CTA's own request (combine_rows = 1), else a warp each
// (combine_rows = 8). Each row slice is still merged by one CTA in a fixed order: the result
// does not depend on timing. 4 slices at 48 registers, as the 4-slice combine_kernel: five
// CTAs per SM; 2 slices (a warp per row where 4 would need a second wave of CTAs:
// decode/split.cuh, combine_slices) at 64: four per SM.
template <typename T, bool kSparse, int kSlices, bool kByWarps>
__global__ void __launch_bounds__(kCombineWarps * 32, kSlices == 4 ? 5 : 4) combine_dealing_kernel(const DecodeArgs a) {
    static_assert(kSlices == 4 || (kSlices == 2 && !kByWarps), "4 slices, or 2 with a warp per row");
    constexpr int kItemSlices = 16;
    using S = SliceShape<kSlices>;
    using SI = SliceShape<kItemSlices>;
    // red_o rows: a 32-dim item's, or with kByWarps a 4-slice row's
    constexpr int kRed = kByWarps ? S::kLanes * S::kF4 : SI::kLanes * SI::kF4;
    MLA_TRACE_AT(kTraceCombine, kTraceCombineEntry);
    __shared__ CombineShared<kRed> sh;
    __shared__ LongSplit long_s[kMaxLong];
    int* found_s = sh.found();
    const Lens lens{a.lens, a.max_len};
    // The k-th split request and the long ones, from the lengths, before the wait (as
    // combine_kernel).
    int n_long;
    const bool found = find_split<kCombineWarps * 32, kByWarps ? kLongByWarps : kLongByWarp>(
        a, lens, blockIdx.x, sh.scratch, found_s, long_s, &n_long);
    if (!found && n_long == 0) return;
    MLA_TRACE_AT(kTraceCombine, kTraceSplitFound);
    grid_dependency_wait();
    MLA_TRACE_AT(kTraceCombine, kTraceCombineWaitDone);
    if (found && (found_s[kFoundTail] & kFoundListed) == 0) {
        const int r = found_s[kFoundReq], first = found_s[kFoundFirst], last = found_s[kFoundLast];
        const int first_tail = found_s[kFoundTail] & 1;
        if constexpr (kByWarps) {
            merge_row_by_warps<T, kSparse, kSlices, 4, kRed>(a, r, first, first_tail, last, blockIdx.y,
                                                             blockIdx.z * S::kDims, sh);
        } else {
            merge_rows_by_warp<T, kSparse, kSlices, 4>(a, r, first, first_tail, last, blockIdx.y,
                                                       blockIdx.z * S::kDims);
        }
    }
    // item i: row (i / 16) % m_rows, slice i % 16 of long request i / (16 m_rows)
    const int per_req = a.m_rows * kItemSlices;
    const int total = n_long * per_req;
    const int ctas = gridDim.x * gridDim.y * gridDim.z;
    for (int item = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); item < total; item += ctas) {
        const int li = item / per_req, rem = item - li * per_req;
        const LongSplit L = long_s[li];
        __syncthreads();  // red_* free again
        merge_row_by_warps<T, kSparse, kItemSlices, 4, kRed>(a, L.req, L.first, L.tail, L.last, rem / kItemSlices,
                                                             (rem % kItemSlices) * SI::kDims, sh);
    }
    MLA_TRACE_AT(kTraceCombine, kTraceCombineEnd);
}

}  // namespace mla
