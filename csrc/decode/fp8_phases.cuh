// The fp8 read path's phases (issue #12; docs/wip/fp8-notes.md §2.4 has the derivation): the
// decode kernel (decode/kernel.cuh) calls these instead of its 16-bit phases when the row
// format has kFp8 (decode/format_fp8.cuh). The rows stay fp8 in shared memory and every MMA
// operand comes from ldmatrix on the fp8 bytes, converted in registers (cvt.rn.f16x2.e4m3x2:
// exact, sm_89+, so sm_90 and sm_120):
//
//   - S = Q K^T, latent dims: a non-transposed ldmatrix.x4 on fp8 rows gives lane (g, tq) the
//     bytes 4tq..4tq+3 of row g of each 8 x 16-byte matrix: two f16 pairs, dims (4tq, 4tq+1)
//     and (4tq+2, 4tq+3) of one k16 step. They are used as the B fragment's b0 and b1, whose
//     k indices are 2tq.. and 2tq+8.. in m16n8k16: the k order is permuted, and the query's A
//     fragment is loaded with the same permutation (a0/a2 = Q[g][16k + 4tq ..+1 / +2 ..+3],
//     a1/a3 the same for row g + 8), so the sum over k is unchanged. One x4 = two n8 tiles x
//     two k16 steps. The MMA is f16 for both query dtypes: f16 queries as they are; bf16
//     queries are scaled per row by a power of two 2^a (the row's largest |q| in the warp's
//     dims lands in [2^14, 2^15)) and rounded to f16, exact for every element down to 2^-28
//     of that maximum (2^-a is applied to the warp's S partial in fp32; in the kernels with one
//     softmax per warp, KernelConfig::kMaskAdd, together with the log2-domain softmax scale).
//   - fp8_ds_mla's scales: the warps' k ranges are aligned to the 128-dim scale tiles (4 warps:
//     two tiles + 32 RoPE dims each; 8 warps: one tile + 16 RoPE dims), each tile accumulates
//     separately and is multiplied by its rows' fp32 scales once per tile (exact: the products
//     are those of the stored values). The 64 RoPE dims are bf16: ldmatrix as 16-bit rows,
//     accumulated onto the scaled latent sum with a bf16 MMA (bf16 queries, Q's RoPE scaled by
//     the same 2^a, exact) or two (f16 queries, split exactly into bf16 hi + lo:
//     f16x2_split_bf16). Per-tensor fp8: all 576 dims are e4m3, one scale for S.
//   - O += P V: ldmatrix.x4.trans on the fp8 rows read as b16 gives lane (g, tq) the bytes
//     [r2tq.d2g, r2tq.d2g+1, r2tq+1.d2g, r2tq+1.d2g+1] of a 16-byte chunk; prmt 0x3120 regroups
//     them and two conversions give the B fragments (k = rows 2tq, 2tq+1) of two n8 tiles: the
//     chunk's even dims and its odd dims. The accumulators of a chunk's two tiles then hold
//     dims 16c + 4tq + {0, 2} and {1, 3}: four contiguous dims per row (write_fp8_row).
//   - The V scale goes into P: each warp's output dims lie in one scale tile t, and
//     P''[m][n] = 2^(s[m][n] - C[m]) * scale[n][t] in f16, where C is a scale-aware running max,
//     C[m] = max over the rows seen of s[m][n] + log2|scale[n][t]| (clamped to [-100, 100]; kept
//     while a tile's exceeds it by at most 8, lazy_max in decode/kernel.cuh): the largest P''
//     is in [1, 2^9) and every P'' is rounded relative to it, as an f16 P is. The sum
//     l = sum 2^(s - C) and the rescaling by 2^(C_old - C_new) follow C, so O = o / l and
//     lse = C + log2 l exactly as with a 16-bit cache (each warp has its own C: its own t).
//     Per-tensor fp8: P'' = P and the scale multiplies the output.
//   - kSwapPV (the 4-warp 8-row configuration, whose query rows 8-15 are zero): S is computed
//     transposed, Sᵀ = K Qᵀ (the warp's 16 tile rows as M, the 8 query rows as N: one MMA per
//     k16 step instead of two; fp8_score_partials_t stores it to the partials in S's layout,
//     so the softmax is unchanged), and so is P V: Oᵀ += Vᵀ Pᵀ, with a 16-dim chunk as M (fragment row g: the chunk's dim 2g,
//     row g + 8: dim 2g + 1; the same converted V registers, as A) and the 8 query rows as N
//     (P's A fragments of rows g are Pᵀ's B fragments): half the MMAs, and o holds 32
//     accumulators per lane instead of 64 (o[0][c] for the warp's 16-dim chunk c: query rows
//     2tq (elements 0, 2) and 2tq + 1 (1, 3), dims 2g (0, 1) and 2g + 1 (2, 3)); the softmax's
//     rescale and the write take rows 2tq, 2tq + 1's factors from lanes 8tq, 8tq + 4.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "common/constants.cuh"
#include "common/fp8.cuh"
#include "common/ptx.cuh"
#include "decode/args.cuh"
#include "decode/format_fp8.cuh"
#include "decode/smem.cuh"

namespace mla {

// How configuration C (a KernelConfig of an fp8 row format) splits the QK width: each warp's
// kLatSteps fp8 k16 steps (global step kh * kLatSteps + ks, bytes 16 * step of the row), then
// its kRopeSteps 16-bit RoPE steps (fp8_ds_mla); its scale tiles and S accumulators.
template <typename C>
struct Fp8Split {
    using Fmt = typename C::Format;
    static constexpr bool kDsMla = Fmt::kDsMla;
    static constexpr int kLatSteps = (kDsMla ? MLA_LATENT_DIM : MLA_HEAD_DIM) / 16 / C::kSplitK;  // 16/8 or 18/9
    static constexpr int kRopeSteps = kDsMla ? MLA_ROPE_DIM / 16 / C::kSplitK : 0;                 // 2/1 or 0
    static constexpr int kTiles = kDsMla ? kFp8DsMlaTiles / C::kSplitK : 1;  // scale tiles per warp
    static constexpr int kStepsPerTile = kLatSteps / kTiles;
    // S accumulators: one per scale tile (fp8_ds_mla), two parities (per-tensor, one m-tile,
    // long chains) or one (per-tensor in the 4-warp 8-row configuration: the 8 registers it
    // saves let it fit three CTAs per H200 SM without spills, log #72)
    static constexpr int kAccs = kDsMla ? kTiles : (C::kMTiles == 1 && kLatSteps > 9 && !C::kHalfM ? 2 : 1);
    static_assert(kLatSteps + kRopeSteps == C::kSKSteps, "the warp's k16 steps");
    static_assert(!kDsMla || (kStepsPerTile % 2 == 0 && kStepsPerTile * 16 == kFp8DsMlaTile),
                  "step pairs stay in one scale tile");
    // The scale tile of the warp's output dims (every warp's kODims lie in one tile).
    static_assert(kFp8DsMlaTile % C::kODims == 0, "a warp's output dims lie in one scale tile");
    static __device__ __forceinline__ int out_tile(int warp) { return warp * C::kODims / kFp8DsMlaTile; }
};

// prmt.b32 d, a, 0, sel
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(a), "r"(sel));
    return d;
}

// fp8 rows in the 4-warp 8-row configuration compute both products transposed (kSwapPV in
// the header): o holds Oᵀ, and S is computed as Sᵀ and stored to the partials in S's layout. (Log #72: 1-4 % faster on the fp8_ds_mla streaming rows, per-tensor fp8 within 0.5 %,
// and 32-40 registers fewer, which lets three CTAs share an H200 SM; the 8-warp 8-row
// configuration, which serves the small steps, measured 0.9 µs slower with it.)
template <typename C>
constexpr bool kSwapPV = C::Format::kFp8 && C::kHalfM && C::kWarps == 4;

// f16 queries go to the MMAs as loaded: where they are the A operand (not kSwapPV) their
// latent steps' words are loaded one by one (kQWords). A 64-bit load puts a fragment row's pair
// (a0, a2) or (a1, a3) into one aligned register pair, while the MMA wants a0..a3 in one
// aligned quad, so ptxas copied the quad together again before every MMA (4 moves per MMA: 128
// per warp-tile in the 16-row kernel). bf16 queries are rewritten at the segment start
// (fp8_q_bf16_to_f16) and keep the one load; kSwapPV's B operand is the loaded pair itself.
template <typename C>
constexpr bool kQWords = std::is_same<typename C::Format::Elem, __half>::value && !kSwapPV<C>;
__device__ __forceinline__ uint2 q_words(const uint8_t* src) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(src);
    return make_uint2(w[0], w[1]);
}
// (shared memory: volatile loads, which ptxas would otherwise merge into one 64-bit load again)
__device__ __forceinline__ uint2 q_words(uint32_t src) {
    uint2 v;
    asm volatile("ld.volatile.shared.b32 %0, [%2];\nld.volatile.shared.b32 %1, [%2+4];\n" : "=r"(v.x), "=r"(v.y) : "r"(src) : "memory");
    return v;
}

// ---- phase: start a segment (the query's A fragments) ------------------------------------
// This lane's A fragments of m-tile mt: latent steps permuted (a0/a2 = Q[g][16k + 4tq ..],
// a1/a3 row g + 8), RoPE steps as ldmatrix gives them; from the staged Q tile (q_base; rows
// g, g + 8; RoPE via ldmatrix at row qrow, half col_half) or from global memory (qrow_ptr:
// the row's q_nope and q_rope, or NULL past m_rows). Then, for bf16 queries, the per-row
// power of two (rowf = 2^-a, to apply to S) and the conversion of the latent steps to f16.
template <typename C>
__device__ __forceinline__ void fp8_q_from_smem(uint32_t q_base, int kh, int qrow, int col_half,
                                                uint32_t (&qf)[C::kQFrags][4]) {
    using S = Fp8Split<C>;
    const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int ks = 0; ks < S::kLatSteps; ++ks) {
        const int kk = kh * S::kLatSteps + ks;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            uint2 v = make_uint2(0u, 0u);  // rows 8-15 of a half m-tile: zero
            if (hf < C::kFragRows) {
                const uint32_t src = q_base + q_chunk<C>(g + 8 * hf, 2 * kk + (tq >> 1)) * 16 + 8 * (tq & 1);
                v = kQWords<C> ? q_words(src) : lds<uint2>(src);
            }
            qf[ks][hf] = v.x;
            qf[ks][2 + hf] = v.y;
        }
    }
#pragma unroll
    for (int rs = 0; rs < S::kRopeSteps; ++rs) {
        const int kk = MLA_LATENT_DIM / 16 + kh * S::kRopeSteps + rs;
        ldmatrix_a<C::kHalfM>(qf[S::kLatSteps + rs], q_base + q_chunk<C>(qrow, 2 * kk + col_half) * 16);
    }
}

template <typename C>
__device__ __forceinline__ void fp8_q_from_global(const uint8_t* qn, const uint8_t* qr, int hf, int kh,
                                                  uint32_t (&qf)[C::kQFrags][4]) {
    using S = Fp8Split<C>;
    const int tq = threadIdx.x & 3;
#pragma unroll
    for (int ks = 0; ks < S::kLatSteps; ++ks) {
        const int col = (kh * S::kLatSteps + ks) * 16 + 4 * tq;
        uint2 v = make_uint2(0u, 0u);
        if (qn != nullptr) {
            if constexpr (kQWords<C>) {
                v = q_words(col < MLA_LATENT_DIM ? qn + col * 2 : qr + (col - MLA_LATENT_DIM) * 2);
            } else {
                v = col < MLA_LATENT_DIM ? *reinterpret_cast<const uint2*>(qn + col * 2)
                                         : *reinterpret_cast<const uint2*>(qr + (col - MLA_LATENT_DIM) * 2);
            }
        }
        qf[ks][hf] = v.x;
        qf[ks][2 + hf] = v.y;
    }
#pragma unroll
    for (int rs = 0; rs < S::kRopeSteps; ++rs) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int col = (kh * S::kRopeSteps + rs) * 16 + 8 * c + 2 * tq;
            qf[S::kLatSteps + rs][hf + 2 * c] = qn != nullptr ? *reinterpret_cast<const uint32_t*>(qr + col * 2) : 0u;
        }
    }
}

// bf16 queries: per fragment row (g: hf = 0, g + 8: hf = 1) the power of two 2^a that puts the
// largest |q| of the warp's dims in [2^14, 2^15) (a in [-110, 110]: queries up to 2^124; zero
// rows: 2^110), rowf = 2^-a;
// the latent steps become f16 (q * 2^a rounded: exact down to 2^-28 of the maximum), the RoPE
// steps stay bf16 (q * 2^a, exact).
template <typename C>
__device__ __forceinline__ void fp8_q_bf16_to_f16(uint32_t (&qf)[C::kQFrags][4], float (&rowf)[2]) {
    using S = Fp8Split<C>;
    rowf[1] = 1.f;  // (a half m-tile's rows 8-15: zero, unused)
#pragma unroll
    for (int hf = 0; hf < C::kFragRows; ++hf) {
        uint32_t mx = 0;
#pragma unroll
        for (int ks = 0; ks < C::kSKSteps; ++ks) {
            mx = __vmaxu2(mx, qf[ks][hf] & 0x7fff7fffu);
            mx = __vmaxu2(mx, qf[ks][2 + hf] & 0x7fff7fffu);
        }
        mx = max(mx & 0xffffu, mx >> 16);
        mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const int e = static_cast<int>(mx >> 7) & 0xff;  // the bf16 exponent field (0: zero)
        const int a = min(max(141 - e, -110), 110);     // 14 - (e - 127)
        const float f = __uint_as_float(static_cast<uint32_t>(a + 127) << 23);
        rowf[hf] = __uint_as_float(static_cast<uint32_t>(127 - a) << 23);
#pragma unroll
        for (int ks = 0; ks < C::kSKSteps; ++ks)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const uint32_t v = qf[ks][hf + 2 * c];
                const float lo = __uint_as_float(v << 16) * f, hi = __uint_as_float(v & 0xffff0000u) * f;
                qf[ks][hf + 2 * c] = ks < S::kLatSteps ? Elem<__half>::pack(lo, hi) : Elem<__nv_bfloat16>::pack(lo, hi);
            }
    }
}

// f16 queries on fp8_ds_mla: the RoPE dims' query as two bf16 terms, hi = bf16(q) (round to
// nearest even) and lo = q - hi, exactly: q has 11 significant bits and hi the top 8, so lo has
// at most 4 and every f16 (subnormals too) lies in bf16's normal range. The RoPE products are
// then bf16 MMAs against the cache's bf16 values as stored (K hi + K lo, accumulated in fp32),
// where rounding those values to f16 would turn any of magnitude >= 65,520 into inf (an f16
// input of 65,504 is stored as bf16 65,536) and cut the precision of those below 2^-14. A
// non-finite q keeps hi (inf or NaN) and gets lo = 0.
__device__ __forceinline__ void f16x2_split_bf16(uint32_t q, uint32_t& hi, uint32_t& lo) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&q));
    hi = Elem<__nv_bfloat16>::pack(f.x, f.y);
    const float h0 = __uint_as_float(hi << 16), h1 = __uint_as_float(hi & 0xffff0000u);
    lo = Elem<__nv_bfloat16>::pack(isfinite(h0) ? f.x - h0 : 0.f, isfinite(h1) ? f.y - h1 : 0.f);
}

// At a segment start with one m-tile (C::kRopeLoSteps > 0): the RoPE steps' f16 fragments
// become their bf16 hi terms in place and the lo terms go to qf[kSKSteps ..].
template <typename C>
__device__ __forceinline__ void fp8_q_f16_rope_split(uint32_t (&qf)[C::kQFrags][4]) {
    using S = Fp8Split<C>;
    static_assert(C::kRopeLoSteps == S::kRopeSteps, "one lo entry per RoPE step");
#pragma unroll
    for (int rs = 0; rs < S::kRopeSteps; ++rs)
#pragma unroll
        for (int i = 0; i < 4; ++i) f16x2_split_bf16(qf[S::kLatSteps + rs][i], qf[S::kLatSteps + rs][i], qf[C::kSKSteps + rs][i]);
}

// Whether the RoPE products of queries of type T take a lo term (f16: bf16 hi + lo).
template <typename T>
constexpr bool kRopeLo = std::is_same<T, __half>::value;

// The RoPE step rs's query fragment as bf16 hi and lo terms: f16 queries (split at the segment
// start with one m-tile, here with two), or bf16 queries (hi as loaded; lo not set).
template <typename T, typename C>
__device__ __forceinline__ void fp8_rope_q(const uint32_t (&qf)[C::kQFrags][4], int rs, uint32_t (&hi)[4],
                                           uint32_t (&lo)[4]) {
    using S = Fp8Split<C>;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (!kRopeLo<T>) {
            hi[i] = qf[S::kLatSteps + rs][i];
        } else if constexpr (C::kRopeLoSteps > 0) {
            hi[i] = qf[S::kLatSteps + rs][i];
            lo[i] = qf[C::kSKSteps + rs][i];
        } else {
            f16x2_split_bf16(qf[S::kLatSteps + rs][i], hi[i], lo[i]);
        }
    }
}

// ---- phase: scores -----------------------------------------------------------------------
// A pair of latent k16 steps (ks, ks + 1) of the warp's 16 tile rows (the lane's ldmatrix
// row at shared address row, 8-column half col_half), converted to f16: bf[i] from matrix i,
// r[0] = (rows 0-7, step ks), r[1] = (rows 0-7, ks + 1), r[2] = (rows 8-15, ks),
// r[3] = (rows 8-15, ks + 1); bf[i][0] / [1] hold dims 4tq .. + 1 / 4tq + 2 .. + 3 of the
// lane's row g. Returns the S accumulator the pair adds into (fp8_ds_mla: its scale tile).
template <typename C>
__device__ __forceinline__ int fp8_k_pair(uint32_t row, int kh, int ks, int col_half, uint32_t (&bf)[4][2]) {
    using S = Fp8Split<C>;
    uint32_t r[4];
    ldmatrix_x4(r, row + 16 * (kh * S::kLatSteps + ks + col_half));
#pragma unroll
    for (int i = 0; i < 4; ++i) e4m3x4_to_f16x2x2(r[i], bf[i][0], bf[i][1]);
    return S::kDsMla ? ks / S::kStepsPerTile : (ks / 2) % S::kAccs;
}

// The 8-row 4-warp configuration (kSwapPV): Sᵀ = K Qᵀ, the warp's 16 tile rows as M (A
// fragments from the same ldmatrix and conversions: rows g and g + 8, the k order permuted as
// for the query) and the 8 query rows as N (the query's fragments a0 / a2 are Qᵀ's b0 / b1):
// one MMA per k16 step instead of two. The lane's accumulators are (tile row g, query rows
// 2tq and 2tq + 1) and (row g + 8, the same), scaled per tile row, then stored to the S
// partials at S's own positions (read_scores reads them unchanged).
template <typename T, typename C>
__device__ __forceinline__ void fp8_score_partials_t(uint32_t kv_base, const uint32_t (&qf)[C::kQFrags][4],
                                                     const float (&rowf)[2], int krow, int kh, int col_half,
                                                     float4* part_s, int warp, int lane) {
    using S = Fp8Split<C>;
    using Fmt = typename C::Format;
    constexpr int RB = Fmt::kSmemRowBytes;
    const uint32_t row = kv_base + krow * RB;
    float acc[S::kAccs][4];
#pragma unroll
    for (int i = 0; i < S::kAccs; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < S::kLatSteps; ks += 2) {
        uint32_t bf[4][2];
        const int ai = fp8_k_pair<C>(row, kh, ks, col_half, bf);
        const uint32_t a0[4] = {bf[0][0], bf[2][0], bf[0][1], bf[2][1]};
        const uint32_t a1[4] = {bf[1][0], bf[3][0], bf[1][1], bf[3][1]};
        mma16816<__half>(acc[ai], a0, qf[ks][0], qf[ks][2]);
        mma16816<__half>(acc[ai], a1, qf[ks + 1][0], qf[ks + 1][2]);
    }
    const int g = lane >> 2, tq = lane & 3;
    const int wrow0 = krow & ~15;  // the warp's first tile row
    float v[4];
    if constexpr (S::kDsMla) {
        // the scales of tile rows g and g + 8
        float sc[S::kTiles][2];
#pragma unroll
        for (int t = 0; t < S::kTiles; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                sc[t][h] = lds_f32(kv_base + (wrow0 + g + 8 * h) * RB + kFp8DsMlaScalesOffset + 4 * (kh * S::kTiles + t));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float x = acc[0][i] * sc[0][i >> 1];
#pragma unroll
            for (int t = 1; t < S::kTiles; ++t) x = fmaf(acc[t][i], sc[t][i >> 1], x);
            v[i] = x;
        }
        // RoPE: bf16 values, 16-bit ldmatrix: b[0] rows 0-7 k 0-7, b[1] rows 0-7 k 8-15,
        // b[2] rows 8-15 k 0-7, b[3] rows 8-15 k 8-15: A = {b[0], b[2], b[1], b[3]}
#pragma unroll
        for (int rs = 0; rs < S::kRopeSteps; ++rs) {
            uint32_t b[4];
            ldmatrix_x4(b, row + kFp8DsMlaRopeOffset + 16 * (2 * (kh * S::kRopeSteps + rs) + col_half));
            uint32_t qh[4], ql[4];
            fp8_rope_q<T, C>(qf, rs, qh, ql);
            const uint32_t ar[4] = {b[0], b[2], b[1], b[3]};
            mma16816<__nv_bfloat16>(v, ar, qh[0], qh[2]);
            if constexpr (kRopeLo<T>) mma16816<__nv_bfloat16>(v, ar, ql[0], ql[2]);
        }
    } else {
        const float ts = lds_f32(kv_base + kFp8TensorRowBytes);  // staged row 0's copy of the tensor scale
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float x = acc[0][i];
#pragma unroll
            for (int t = 1; t < S::kAccs; ++t) x += acc[t][i];
            v[i] = x * ts;
        }
    }
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {  // undo the query's 2^a: rows 2tq, 2tq + 1
        const float f0 = __shfl_sync(0xffffffffu, rowf[0], 8 * tq), f1 = __shfl_sync(0xffffffffu, rowf[0], 8 * tq + 4);
        v[0] *= f0;
        v[1] *= f1;
        v[2] *= f0;
        v[3] *= f1;
    } else if constexpr (C::kMaskAdd) {  // the log2-domain softmax scale (the same in every row)
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] *= rowf[0];
    }
    store_partials_t<C>(part_s, v, warp, g, tq);
}

// S = Q K^T for this warp's 16 tile rows (krow: the lane's ldmatrix row, krow & ~15 the warp's
// first) over its k range (kh), written to its S partials as score_partials does.
template <typename T, typename C>
__device__ __forceinline__ void fp8_score_partials_m(uint32_t kv_base, const uint32_t (&qf)[C::kMTiles][C::kQFrags][4],
                                                     const float (&rowf)[C::kMTiles][2], int krow, int kh, int col_half,
                                                     float4* part_s, int warp, int lane) {
    using S = Fp8Split<C>;
    using Fmt = typename C::Format;
    constexpr int kMT = C::kMTiles;
    constexpr int RB = Fmt::kSmemRowBytes;
    const uint32_t row = kv_base + krow * RB;
    float acc[kMT][2][S::kAccs][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < S::kAccs; ++i) acc[mt][n][i][0] = acc[mt][n][i][1] = acc[mt][n][i][2] = acc[mt][n][i][3] = 0.f;
    // latent steps in pairs (fp8_k_pair: rows 0-7 are n8 tile 0, rows 8-15 tile 1); an odd
    // last pair (per-tensor, 8 warps) reads the staged row's pad and drops it
#pragma unroll
    for (int ks = 0; ks < S::kLatSteps; ks += 2) {
        uint32_t bf[4][2];
        const int ai = fp8_k_pair<C>(row, kh, ks, col_half, bf);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                mma16816<__half>(acc[mt][n][ai], qf[mt][ks], bf[2 * n][0], bf[2 * n][1]);
                if (ks + 1 < S::kLatSteps) mma16816<__half>(acc[mt][n][ai], qf[mt][ks + 1], bf[2 * n + 1][0], bf[2 * n + 1][1]);
            }
    }
    // the scales: the lane's accumulator columns are the warp's rows 8n + 2tq + e
    float s[kMT][2][4];
    const int tq = lane & 3;
    const uint32_t wrow = kv_base + ((krow & ~15) + 2 * tq) * RB;
    if constexpr (S::kDsMla) {
        float sc[S::kTiles][2][2];
#pragma unroll
        for (int t = 0; t < S::kTiles; ++t)
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    sc[t][n][e] = lds_f32(wrow + (8 * n + e) * RB + kFp8DsMlaScalesOffset + 4 * (kh * S::kTiles + t));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float v = acc[mt][n][0][i] * sc[0][n][i & 1];
#pragma unroll
                    for (int t = 1; t < S::kTiles; ++t) v = fmaf(acc[mt][n][t][i], sc[t][n][i & 1], v);
                    s[mt][n][i] = v;
                }
        // RoPE: bf16 values at byte kFp8DsMlaRopeOffset, 16-bit ldmatrix (two n8 tiles, one step)
#pragma unroll
        for (int rs = 0; rs < S::kRopeSteps; ++rs) {
            uint32_t b[4];
            ldmatrix_x4(b, row + kFp8DsMlaRopeOffset + 16 * (2 * (kh * S::kRopeSteps + rs) + col_half));
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                uint32_t qh[4], ql[4];
                fp8_rope_q<T, C>(qf[mt], rs, qh, ql);
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    mma16816<__nv_bfloat16>(s[mt][n], qh, b[2 * n], b[2 * n + 1]);
                    if constexpr (kRopeLo<T>) mma16816<__nv_bfloat16>(s[mt][n], ql, b[2 * n], b[2 * n + 1]);
                }
            }
        }
    } else {
        const float ts = lds_f32(kv_base + kFp8TensorRowBytes);  // staged row 0's copy of the tensor scale
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float v = acc[mt][n][0][i];
#pragma unroll
                    for (int t = 1; t < S::kAccs; ++t) v += acc[mt][n][t][i];
                    s[mt][n][i] = v * ts;
                }
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            float4 v = make_float4(s[mt][n][0], s[mt][n][1], s[mt][n][2], s[mt][n][3]);
            if constexpr (std::is_same<T, __nv_bfloat16>::value || C::kMaskAdd) {  // undo the query's 2^a (kMaskAdd: and scale)
                v.x *= rowf[mt][0];
                v.y *= rowf[mt][0];
                v.z *= rowf[mt][1];
                v.w *= rowf[mt][1];
            }
            store_partial<C>(part_s, part_slot<C>((warp * kMT + mt) * 2 + n, lane), v);
        }
}

// S's partials by the configuration's form: transposed (kSwapPV) or with the query rows as M.
template <typename T, typename C>
__device__ __forceinline__ void fp8_score_partials(uint32_t kv_base, const uint32_t (&qf)[C::kMTiles][C::kQFrags][4],
                                                   const float (&rowf)[C::kMTiles][2], int krow, int kh, int col_half,
                                                   float4* part_s, int warp, int lane) {
    if constexpr (kSwapPV<C>) {
        fp8_score_partials_t<T, C>(kv_base, qf[0], rowf[0], krow, kh, col_half, part_s, warp, lane);
    } else {
        fp8_score_partials_m<T, C>(kv_base, qf, rowf, krow, kh, col_half, part_s, warp, lane);
    }
}

// ---- phase: the V scales of the softmax (fp8_ds_mla) -------------------------------------
// The lane's 8 tile columns (rows 8 jn + 2tq + e): the scale of the warp's output tile and
// log2 of its magnitude clamped to [-100, 100], which the scale-aware running max adds. For
// scales in 2^-100 .. 2^100 the largest P'' of a row is in [1, 2^9) (in [1, 2) against the
// exact running max; lazy_max lets it lag by up to 2^8) and the others are rounded relative
// to it, as an f16 P is; a smaller scale (e.g. vLLM's raw scale of an all-zero tile,
// 2^-126) gives its rows' P'' smaller still, down to zero in f16 (values below ~2^-91). The
// weights 2^(s - C) stay below 2^100 per row, so l stays finite in fp32.
template <typename C>
__device__ __forceinline__ void fp8_v_scales(uint32_t kv_base, int warp, int tq, float (&sc)[4][2], float (&lg)[4][2]) {
    using Fmt = typename C::Format;
    const uint32_t base = kv_base + 2 * tq * Fmt::kSmemRowBytes + kFp8DsMlaScalesOffset + 4 * Fp8Split<C>::out_tile(warp);
#pragma unroll
    for (int jn = 0; jn < 4; ++jn)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            sc[jn][e] = lds_f32(base + (8 * jn + e) * Fmt::kSmemRowBytes);
            lg[jn][e] = fminf(fmaxf(fast_log2(fabsf(sc[jn][e])), -100.f), 100.f);
        }
}

// The A fragments of P for k16 step kk of the tile (tile columns 16 kk ..) from the softmax's
// probabilities in accumulator layout, packed to E (the P V phases of every format use it).
template <typename E, typename C>
__device__ __forceinline__ void p_frags(const float (&s)[C::kMTiles][4][4], int kk, uint32_t (&pa)[C::kMTiles][4]) {
#pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt) {
        // (rows 8-15 of a half m-tile: none, zero)
        pa[mt][0] = Elem<E>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = C::kHalfM ? 0u : Elem<E>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = Elem<E>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = C::kHalfM ? 0u : Elem<E>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
}

// ---- phase: P V ------------------------------------------------------------------------------
// O += P'' V for k16 step kk of the tile (pa: the A fragments of P'' for every m-tile) over
// this warp's kODims output dims (the chunk pairs 2c, 2c + 1 of o: the even and odd dims of
// 16-dim chunk c), f16 MMA; vrow0 / col_half: the lane's ldmatrix row and chunk.
template <typename C>
__device__ __forceinline__ void fp8_pv_step(uint32_t kv_base, const uint32_t (&pa)[C::kMTiles][4], int kk, int vrow0,
                                            int warp, int col_half, float (&o)[C::kMTiles][C::kONTiles][4]) {
    using Fmt = typename C::Format;
    constexpr int kMT = C::kMTiles;
    const uint32_t row = kv_base + (kk * 16 + vrow0) * Fmt::kSmemRowBytes;
#pragma unroll
    for (int pr = 0; pr < C::kODims / 32; ++pr) {
        // chunks c0 = 2pr, c1 = 2pr + 1 of the warp's dims: r[2j] rows 0-7, r[2j+1] rows 8-15
        uint32_t r[4];
        ldmatrix_x4_trans(r, row + (warp * C::kODims / 16 + 2 * pr + col_half) * 16);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            // (the one-m-tile kernels convert each half in place, one instruction per f16x2:
            // 30 fewer per warp and tile, 2.5-3.7 % on the 16-row fp8 rows, log #74; the 32-row
            // kernel, at sm_120's register cap, keeps the shifted form, without which it spills)
            uint32_t even[2], odd[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if constexpr (kMT == 1) {
                    e4m3x4_to_f16x2x2(prmt(r[2 * j + h], 0x3120u), even[h], odd[h]);
                } else {
                    e4m3x4_to_f16x2x2_shifted(prmt(r[2 * j + h], 0x3120u), even[h], odd[h]);
                }
            }
            if constexpr (kSwapPV<C>) {
                // Oᵀ += Vᵀ Pᵀ (kSwapPV): the chunk's 16 dims as M (row g: dim 2g, row g + 8: dim
                // 2g + 1), the 8 query rows as N, P's fragments of rows g as the B operand
                const uint32_t va[4] = {even[0], odd[0], even[1], odd[1]};
                mma16816<__half>(o[0][2 * pr + j], va, pa[0][0], pa[0][2]);
            } else {
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    mma16816<__half>(o[mt][4 * pr + 2 * j], pa[mt], even[0], even[1]);
                    mma16816<__half>(o[mt][4 * pr + 2 * j + 1], pa[mt], odd[0], odd[1]);
                }
            }
        }
    }
}

// The tile's P V with P'' from the softmax's registers (s, accumulator layout).
template <typename C>
__device__ __forceinline__ void fp8_pv_tile(uint32_t kv_base, const float (&s)[C::kMTiles][4][4], int vrow0, int warp,
                                            int col_half, float (&o)[C::kMTiles][C::kONTiles][4]) {
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
        uint32_t pa[C::kMTiles][4];
        p_frags<__half, C>(s, kk, pa);
        fp8_pv_step<C>(kv_base, pa, kk, vrow0, warp, col_half, o);
    }
}

}  // namespace mla
