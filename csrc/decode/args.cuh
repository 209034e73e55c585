// The arguments every kernel of the decode family receives (filled on the host by
// decode/decode.cu), and the mapping of a query row to its token and head.
#pragma once

#include <stdint.h>

#include "common/fastdiv.cuh"

namespace mla {

// DecodeArgs::check_lens: whose lengths a decode records when they are out of range.
constexpr int kLensDense = 1;   // seq_lens: MLA_FAULT_NEGATIVE_SEQ_LEN / MLA_FAULT_SEQ_LEN_TOO_LARGE
constexpr int kLensSparse = 2;  // topk_len: MLA_FAULT_BAD_TOPK_LEN

// ---- arguments of the decode family ------------------------------------------------------
struct DecodeArgs {
    const uint8_t* q_nope;
    const uint8_t* q_rope;
    int64_t qn_ts, qn_hs, qr_ts, qr_hs;  // element strides
    const uint8_t* cache;
    int64_t block_stride;  // bytes
    int32_t num_blocks;
    int32_t block_size;    // a power of two
    int32_t block_shift;   // log2(block_size)
    const int32_t* table;  // dense: block table; sparse: indices
    int32_t table_stride;  // elements between rows (0 with one row: its stride is never used)
    int32_t table_cols;    // dense: max_blocks_per_seq; sparse: topk
    int32_t batch;
    int32_t num_parts;
    int32_t min_chunk;     // fewest tiles per part (mla_schedule_internal_t::min_chunk)
    int32_t q_len;         // dense q_len; sparse 1
    int32_t num_heads;
    int32_t m_rows;        // q_len * num_heads
    uint8_t* out;
    int64_t out_ts, out_hs;
    float* lse;
    int64_t lse_ts, lse_hs;
    float scale_log2;      // softmax_scale * log2(e)
    const int32_t* lens;   // dense: seq_lens; sparse: topk_len (may be NULL)
    int32_t max_len;       // dense: max_blocks_per_seq * block_size; sparse: topk
    int32_t check_lens;    // which lengths record faults: kLensDense (seq_lens) or kLensSparse (topk_len)
    float* ws_o;           // [2*parts, m_rows, 512] (decode/split.cuh, "the workspace")
    float* ws_lse;         // [2*parts, m_rows], log2 domain
    uint32_t* flag;
    int32_t pdl;           // MLA_PDL_* bits, and above kPdlStartShift the start trigger's threshold (decode.cu)
    int32_t combine_rows;  // query rows per combine CTA: 1 (8 warps per row) or 8 (a warp per row)
    // Divisions prepared on the host: by num_parts and num_heads; and without lengths (every
    // request has max_len rows: the closed form) the tiles per request, the total and the chunk.
    FastDiv parts_div;
    FastDiv heads_div;     // num_heads (dense query row m -> query position m / num_heads)
    FastDiv closed_tiles;  // tiles_of(max_len)
    FastDiv closed_chunk;  // split_chunk(batch * tiles_of(max_len), ...); min_chunk in the closed form with lengths
    int32_t closed_total;
    const float* kv_scale;  // MLA_KV_FP8: the tensor scale (device pointer); else NULL
    // Parts within requests (MLA_SPLIT_WITHIN_REQUESTS, decode/split.cuh): whether, and in the
    // closed form the parts per request (d = 0: flat after all; in the closed form with
    // lengths, closed_lens, its parts per request). Last, so that the kernels without the
    // rule keep their parameter offsets.
    int32_t split_within;
    FastDiv closed_n;
    // The closed form with lengths (decode/split.cuh, closed_lens_parts: the decode kernel's
    // kSpec form): request b's parts are b * closed_n.d .. b * closed_n.d + closed_n.d - 1,
    // part i its tiles [i * min_chunk, + min_chunk) (closed_chunk.d = min_chunk then), whatever
    // the lengths. Set by the launch.
    int32_t closed_lens;
    // The flat split with lengths whose every request has the same tiles t (found on the
    // device; decode/split.cuh, flat_chunk): the chunk becomes aligned_mul * (total /
    // aligned_div.d) where total divides evenly (t / n for n = parts / batch = 1 part per
    // request, or ceil(batch / parts) whole requests per part), at most a tile above the flat
    // chunk. aligned_div.d = 0: no such chunk (prepare_split's filter aligned_may_move; within
    // requests; the kSpec form).
    FastDiv aligned_div;
    int32_t aligned_mul;
};

// Query row m of request b: the token index and head.
template <bool kSparse>
__device__ __forceinline__ void row_token_head(const DecodeArgs& a, int b, int m, int& token, int& head) {
    if (kSparse) {
        token = b;
        head = m;
    } else {
        const int i = a.heads_div.div(m);
        token = b * a.q_len + i;
        head = m - i * a.num_heads;
    }
}

}  // namespace mla
