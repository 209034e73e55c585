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

// The combine splits the 512 output dims of a row into slices (grid z), so that the piece
// reads of a step with few split rows (b=1, t=1: 8 rows) spread over more SMs: a lane
// holds kF4 float4 (4 * kF4 dims) of its warp's slice of 128 * kF4 dims.

// Writes merged row m of request r: lane's dims [dim0 + lane*4*kF4, +4*kF4) of acc / wsum,
// and lse (lane 0 of the slice at dim 0).
template <typename T, bool kSparse, int kF4>
__device__ __forceinline__ void store_merged_row(const DecodeArgs& a, int r, int m, int dim0,
                                                 const float (&acc)[4 * kF4], float mx, float wsum) {
    const int lane = threadIdx.x & 31;
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

// One warp folds pieces first, first+step, ... <= last of query row m (its slice at dim0)
// into a running (max, weight sum, lane's 4 * kF4 dims): kBatch pieces at a time with all
// their loads in flight (one round trip per batch), in piece order, so the result depends
// only on the data. first_tail: the first piece of the request (piece `req_first`) is in
// slot 2q+1.
template <int kF4>  // 4 (a warp covers 512 dims) or 1 (128 dims)
struct RowFold {
    static constexpr int kBatch = kF4 == 4 ? 8 : 16;
    float mx = -INFINITY;
    float wsum = 0.f;
    float acc[4 * kF4] = {};
};

template <int kF4>
__device__ __forceinline__ void fold_pieces(const DecodeArgs& a, int req_first, int first_tail, int first, int last,
                                            int step, int m, int dim0, RowFold<kF4>& f) {
    constexpr int kBatch = RowFold<kF4>::kBatch;
    const int lane = threadIdx.x & 31;
    // Piece q's row is in slot ws_slot(q, 0) = 2q (2q + 1 for the request's first piece when
    // first_tail; decode/split.cuh): consecutive pieces of this warp are 2 * step * m_rows
    // rows apart, so a batch's loads are one base address plus constant multiples of that
    // stride.
    const int64_t stride = static_cast<int64_t>(ws_slot(step, 0)) * a.m_rows;
#pragma unroll 1
    for (int q0 = first; q0 <= last; q0 += kBatch * step) {
        const int64_t row0 = static_cast<int64_t>(ws_slot(q0, q0 == req_first ? first_tail : 0)) * a.m_rows + m;
        const int64_t fix = q0 == req_first ? -static_cast<int64_t>(first_tail) * a.m_rows : 0;  // pieces after the first
        const float* lse0 = a.ws_lse + row0;
        const float4* o0 = reinterpret_cast<const float4*>(a.ws_o + row0 * kLatentDim + dim0 + lane * 4 * kF4);
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
}

// Merge the pieces of split requests. CTA (k, m, z): the k-th split request (in request
// order; found from the lengths like decode's split), query row m, dims slice z of
// 128 * kF4. Its warps fold every kCombineWarps-th piece, then warp 0 merges the folds in
// warp order: the result does not depend on timing. When the schedule expects few pieces
// per request (combine_rows = 8), CTA (k, g, z) instead merges rows 8g..8g+7, a warp per row
// over all pieces (8x fewer CTAs; ncu showed the kernel's cost growing with its CTA count).
template <typename T, bool kSparse, int kF4>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const DecodeArgs a) {
    MLA_TRACE_AT(kTraceCombine, kTraceCombineEntry);
    __shared__ float red_max[kCombineWarps];
    __shared__ float red_w[kCombineWarps];
    __shared__ float4 red_o[kCombineWarps][32 * kF4];
    constexpr int kScratch = split_scratch_ints<kCombineWarps * 32>();
    __shared__ int scratch[kScratch + kFoundInts];  // find_split's scratch, then its result
    int* found_s = scratch + kScratch;
    const Lens lens{a.lens, a.max_len};
    const int k = blockIdx.x;
    const int m = blockIdx.y;  // row (combine_rows == 1) or group of combine_rows rows
    const int dim0 = blockIdx.z * 128 * kF4;
    // The k-th split request, in request order, from the lengths (as decode split them).
    // The lengths are inputs, not decode's output: this runs while decode finishes (with
    // PDL every decode CTA has passed its own wait, so whatever wrote them is complete);
    // only the pieces need the wait.
    const bool found = find_split<kCombineWarps * 32>(a, lens, k, scratch, found_s);
    if (!found) return;
    MLA_TRACE_AT(kTraceCombine, kTraceSplitFound);
    grid_dependency_wait();
    MLA_TRACE_AT(kTraceCombine, kTraceCombineWaitDone);
    const int r = found_s[kFoundReq], first = found_s[kFoundFirst], last = found_s[kFoundLast];
    const int first_tail = found_s[kFoundTail];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (a.combine_rows > 1) {  // few pieces per request: warp w merges row m + w alone
        const int mw = m * a.combine_rows + warp;
        if (warp < a.combine_rows && mw < a.m_rows) {
            RowFold<kF4> f;
            fold_pieces<kF4>(a, first, first_tail, first, last, 1, mw, dim0, f);
            store_merged_row<T, kSparse, kF4>(a, r, mw, dim0, f.acc, f.mx, f.wsum);
        }
        MLA_TRACE_AT(kTraceCombine, kTraceCombineEnd);
        return;
    }
    // Many pieces: warp w folds pieces first+w, first+w+8, ...; then warp 0 merges the
    // warps' folds in warp order.
    {
        RowFold<kF4> f;
        fold_pieces<kF4>(a, first, first_tail, first + warp, last, kCombineWarps, m, dim0, f);
#pragma unroll
        for (int i = 0; i < kF4; ++i)
            red_o[warp][lane * kF4 + i] = make_float4(f.acc[4 * i], f.acc[4 * i + 1], f.acc[4 * i + 2], f.acc[4 * i + 3]);
        if (lane == 0) {
            red_max[warp] = f.mx;
            red_w[warp] = f.wsum;
        }
    }
    __syncthreads();
    if (warp != 0) return;
    float mx = red_max[0];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) mx = fmaxf(mx, red_max[w]);
    float wt = 0.f;
    float sum[4 * kF4] = {};
    if (mx != -INFINITY) {
#pragma unroll
        for (int w = 0; w < kCombineWarps; ++w) {
            const float sc = fast_exp2(red_max[w] - mx);  // an empty warp: 0
            wt += red_w[w] * sc;
#pragma unroll
            for (int i = 0; i < kF4; ++i) {
                const float4 u = red_o[w][lane * kF4 + i];
                sum[4 * i + 0] += sc * u.x;
                sum[4 * i + 1] += sc * u.y;
                sum[4 * i + 2] += sc * u.z;
                sum[4 * i + 3] += sc * u.w;
            }
        }
    }
    store_merged_row<T, kSparse, kF4>(a, r, m, dim0, sum, mx, wt);
    MLA_TRACE_AT(kTraceCombine, kTraceCombineEnd);
}

}  // namespace mla
