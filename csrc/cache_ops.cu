// Cache maintenance kernels: append new rows through a slot mapping (f16/bf16 copies here,
// fp8 quantization in cache_ops/append_fp8.cuh), and gather request-logical top-k positions
// into global slot ids.
#include "common/constants.cuh"
#include "common/fault.cuh"
#include "common/ptx.cuh"
#include "cache_ops/append_fp8.cuh"
#include "common/status.cuh"

using namespace mla;

namespace {

// One warp per new token: 72 chunks of 16 bytes, the first 64 from the latent row, the last 8
// from the RoPE row (packed rows: rope = nope + 1,024 bytes, the same stride). The row is read
// before its slot is known (it is there whatever the slot), so the two loads are one round trip.
__global__ void __launch_bounds__(256) append_kernel(const uint8_t* nope, int64_t nope_ts_bytes, const uint8_t* rope,
                                                     int64_t rope_ts_bytes, int32_t num_tokens,
                                                     const int64_t* slot_mapping, uint8_t* cache, int64_t block_stride,
                                                     int32_t num_blocks, int32_t block_size, uint32_t* flag) {
    const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= num_tokens) return;
    constexpr int kNopeChunks = kLatentDim * 2 / 16;
    constexpr int kPerLane = (kRowChunks + 31) / 32;
    const uint4* src_nope = reinterpret_cast<const uint4*>(nope + t * nope_ts_bytes);
    const uint4* src_rope = reinterpret_cast<const uint4*>(rope + t * rope_ts_bytes);
    uint4 v[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < kRowChunks) v[i] = ld_issue_v4(c < kNopeChunks ? src_nope + c : src_rope + c - kNopeChunks);
    }
    const int64_t slot = slot_mapping[t];
    if (slot == -1) return;
    if (slot < 0 || slot >= static_cast<int64_t>(num_blocks) * block_size) {
        if (lane == 0) record_fault(flag, MLA_FAULT_BAD_APPEND_SLOT, t, slot);
        return;
    }
    const int64_t blk = slot / block_size;
    uint4* dst = reinterpret_cast<uint4*>(cache + blk * block_stride + (slot - blk * block_size) * kRowBytes);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < kRowChunks) dst[c] = v[i];
    }
}

__global__ void __launch_bounds__(256) gather_kernel(const int32_t* positions, int32_t positions_stride, int32_t topk,
                                                     const int32_t* req_id, const int32_t* block_table,
                                                     int32_t block_table_stride, int32_t max_blocks_per_seq,
                                                     const int32_t* seq_lens, int32_t batch, int32_t block_size,
                                                     int32_t num_blocks, int32_t* out, int32_t out_stride,
                                                     uint32_t* flag) {
    const int t = blockIdx.y;
    const int k = blockIdx.x * 256 + threadIdx.x;
    if (k >= topk) return;
    // Two dependent round trips, not three: the position is read with the request id, and the
    // table entry (any position inside the table row; used only below the length) with the length.
    const int pos = static_cast<int>(ld_issue_b32(positions + static_cast<int64_t>(t) * positions_stride + k));
    const int req = req_id[t];
    int slot = -1;
    if (req < 0 || req >= batch) {
        if (k == 0) record_fault(flag, MLA_FAULT_BAD_REQ_ID, t, req);
    } else {
        const int max_len = max_blocks_per_seq * block_size;
        const int bi = pos / block_size;
        int e = -1;
        if (pos >= 0 && pos < max_len)
            e = __ldg(block_table + static_cast<int64_t>(req) * block_table_stride + bi);
        const int raw = seq_lens[req];
        if (k == 0 && (raw < 0 || raw > max_len))  // one thread per token; the first fault wins
            record_fault(flag, raw < 0 ? MLA_FAULT_NEGATIVE_SEQ_LEN : MLA_FAULT_SEQ_LEN_TOO_LARGE, req, raw);
        const int L = min(max(raw, 0), max_len);
        if (pos >= 0 && pos < L) {
            if (e >= 0 && e < num_blocks) {
                slot = e * block_size + (pos - bi * block_size);
            } else {
                record_fault(flag, MLA_FAULT_BAD_BLOCK_ID, t, e);
            }
        }
    }
    out[static_cast<int64_t>(t) * out_stride + k] = slot;
}

bool valid_block_size(int32_t bs) { return bs == 16 || bs == 32 || bs == 64 || bs == 128; }

}  // namespace

extern "C" mla_status_t mla_append_kv(const mla_append_params_t* p, void* stream) {
    enter("mla_append_kv");
    MLA_CHECK(p != nullptr, "p: NULL");
    MLA_CHECK(p->num_tokens >= 0, "num_tokens: %d, must be >= 0", p->num_tokens);
    MLA_CHECK(p->dtype == MLA_DTYPE_F16 || p->dtype == MLA_DTYPE_BF16, "dtype: %d is not an mla_dtype_t",
              static_cast<int>(p->dtype));
    const mla_kv_format_t f = p->kv_format;
    const int64_t rb = row_bytes_of(f);
    MLA_CHECK(rb != 0, "kv_format: %d is not an mla_kv_format_t", static_cast<int>(f));
    MLA_CHECK(!(f == MLA_KV_F16 || f == MLA_KV_BF16) || (f == MLA_KV_F16) == (p->dtype == MLA_DTYPE_F16),
              "kv_format: an f16/bf16 cache must have the rows' dtype");
    MLA_CHECK((f == MLA_KV_FP8) == (p->kv_scale != nullptr), "kv_scale: required with MLA_KV_FP8, else NULL");
    MLA_CHECK(f != MLA_KV_FP8_DS_MLA || p->scale_rule == MLA_SCALE_RAW || p->scale_rule == MLA_SCALE_POW2,
              "scale_rule: %d is not an mla_scale_rule_t", static_cast<int>(p->scale_rule));
    MLA_CHECK(valid_block_size(p->block_size), "block_size: %d, must be 16, 32, 64 or 128", p->block_size);
    MLA_CHECK(p->num_blocks >= 1, "num_blocks: %d, must be >= 1", p->num_blocks);
    MLA_CHECK(p->block_stride_bytes >= p->block_size * rb && p->block_stride_bytes % 16 == 0,
              "block_stride_bytes: %lld, must be a multiple of 16 and >= block_size * %lld",
              static_cast<long long>(p->block_stride_bytes), static_cast<long long>(rb));
    if (p->num_tokens == 0) return MLA_STATUS_OK;
    MLA_CHECK(p->kv != nullptr, "kv: NULL");
    MLA_CHECK(p->slot_mapping != nullptr, "slot_mapping: NULL");
    MLA_CHECK(aligned_to(p->slot_mapping, 8), "slot_mapping: not 8-byte aligned");
    MLA_CHECK(aligned_to(p->error_flag, 4), "error_flag: not 4-byte aligned");
    MLA_CHECK(p->kv_cache != nullptr, "kv_cache: NULL");
    const bool split = p->kv_rope != nullptr;
    const int64_t nope_min = split ? kLatentDim : kHeadDim;
    // a source's token stride: unused for one row, else >= its width, rows 16-byte aligned
    auto rows_ok = [&](int64_t stride, int64_t width) {
        return p->num_tokens == 1 || (stride >= width && stride <= INT64_MAX / 2 && stride16(stride));
    };
    MLA_CHECK(rows_ok(p->kv_token_stride, nope_min),
              "kv_token_stride: %lld, must be in %lld..=INT64_MAX/2 and keep rows 16-byte aligned",
              static_cast<long long>(p->kv_token_stride), static_cast<long long>(nope_min));
    MLA_CHECK(aligned16(p->kv), "kv: not 16-byte aligned");
    MLA_CHECK(!split || aligned16(p->kv_rope), "kv_rope: not 16-byte aligned");
    MLA_CHECK(p->kv_rope != p->kv,
              "kv_rope: equals kv (packed 576-wide rows: pass kv_rope = NULL, or kv + 512 elements)");
    MLA_CHECK(!split || rows_ok(p->kv_rope_token_stride, MLA_ROPE_DIM),
              "kv_rope_token_stride: %lld, must be in 64..=INT64_MAX/2 and keep rows 16-byte aligned",
              static_cast<long long>(p->kv_rope_token_stride));
    // element strides of the two parts (a single row's strides are never used)
    const int64_t nope_ts = p->num_tokens == 1 ? kHeadDim : p->kv_token_stride;
    const int64_t rope_ts = !split ? nope_ts : p->num_tokens == 1 ? MLA_ROPE_DIM : p->kv_rope_token_stride;
    const uint8_t* rope = split ? static_cast<const uint8_t*>(p->kv_rope)
                                : static_cast<const uint8_t*>(p->kv) + kLatentDim * 2;
    MLA_CHECK(aligned16(p->kv_cache), "kv_cache: not 16-byte aligned");
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (f == MLA_KV_F16 || f == MLA_KV_BF16) {
        const dim3 grid(static_cast<unsigned>((static_cast<int64_t>(p->num_tokens) + 7) / 8));
        MLA_CUDA_TRY_AS(launch_ex(append_kernel, grid, dim3(256), 0, st, static_cast<const uint8_t*>(p->kv), nope_ts * 2,
                                  rope, rope_ts * 2, p->num_tokens, p->slot_mapping,
                                  static_cast<uint8_t*>(p->kv_cache), p->block_stride_bytes, p->num_blocks,
                                  p->block_size, p->error_flag),
                        "the append launch");
    } else {
        MLA_CHECK((reinterpret_cast<uintptr_t>(p->kv_scale) & 3) == 0, "kv_scale: not 4-byte aligned");
        Fp8AppendParams q{};
        q.kv_nope = p->kv;
        q.kv_rope = rope;
        q.nope_token_stride = nope_ts;
        q.rope_token_stride = rope_ts;
        q.num_tokens = p->num_tokens;
        q.slot_mapping = p->slot_mapping;
        q.cache = p->kv_cache;
        q.block_stride_bytes = p->block_stride_bytes;
        q.num_blocks = p->num_blocks;
        q.block_size = p->block_size;
        q.dtype = p->dtype;
        q.format = f == MLA_KV_FP8_DS_MLA ? Fp8CacheFormat::DsMla : Fp8CacheFormat::PerTensor;
        q.rule = p->scale_rule == MLA_SCALE_POW2 ? Fp8ScaleRule::Pow2 : Fp8ScaleRule::Raw;
        q.tensor_scale = p->kv_scale;
        q.error_flag = p->error_flag;
        MLA_CUDA_TRY(launch_append_fp8(q, st));
    }
    return MLA_STATUS_OK;
}

extern "C" mla_status_t mla_gather_slots(const mla_gather_params_t* p, void* stream) {
    enter("mla_gather_slots");
    MLA_CHECK(p != nullptr, "p: NULL");
    MLA_CHECK(p->num_tokens >= 0 && p->num_tokens <= MLA_MAX_GATHER_TOKENS, "num_tokens: %d, must be in 0..=%d",
              p->num_tokens, MLA_MAX_GATHER_TOKENS);
    MLA_CHECK(p->topk >= 1 && p->topk <= MLA_MAX_TOPK, "topk: %d, must be in 1..=%d", p->topk, MLA_MAX_TOPK);
    MLA_CHECK(p->batch >= 1, "batch: %d, must be >= 1", p->batch);
    MLA_CHECK(p->num_blocks >= 1, "num_blocks: %d, must be >= 1", p->num_blocks);
    MLA_CHECK(valid_block_size(p->block_size), "block_size: %d, must be 16, 32, 64 or 128", p->block_size);
    MLA_CHECK(p->max_blocks_per_seq >= 1, "max_blocks_per_seq: %d, must be >= 1", p->max_blocks_per_seq);
    MLA_CHECK(static_cast<int64_t>(p->num_blocks) * p->block_size <= 0x7fffffffLL,
              "num_blocks: num_blocks * block_size exceeds INT32_MAX (slot ids are int32)");
    MLA_CHECK(static_cast<int64_t>(p->max_blocks_per_seq) * p->block_size <= 0x7fffffffLL,
              "max_blocks_per_seq: max_blocks_per_seq * block_size exceeds INT32_MAX");
    const bool one = p->num_tokens <= 1;
    MLA_CHECK(one || (p->positions_stride >= p->topk && p->positions_stride <= 0x7fffffffLL),
              "positions_stride: %lld, must be in topk..=INT32_MAX", static_cast<long long>(p->positions_stride));
    MLA_CHECK(one || (p->out_stride >= p->topk && p->out_stride <= 0x7fffffffLL),
              "out_stride: %lld, must be in topk..=INT32_MAX", static_cast<long long>(p->out_stride));
    MLA_CHECK(p->batch == 1 || (p->block_table_stride >= p->max_blocks_per_seq && p->block_table_stride <= 0x7fffffffLL),
              "block_table_stride: %lld, must be in max_blocks_per_seq..=INT32_MAX",
              static_cast<long long>(p->block_table_stride));
    if (p->num_tokens == 0) return MLA_STATUS_OK;
    MLA_CHECK(p->positions != nullptr, "positions: NULL");
    MLA_CHECK(p->req_id != nullptr, "req_id: NULL");
    MLA_CHECK(p->block_table != nullptr, "block_table: NULL");
    MLA_CHECK(p->seq_lens != nullptr, "seq_lens: NULL");
    MLA_CHECK(p->out_slots != nullptr, "out_slots: NULL");
    MLA_CHECK(aligned_to(p->positions, 4), "positions: not 4-byte aligned");
    MLA_CHECK(aligned_to(p->req_id, 4), "req_id: not 4-byte aligned");
    MLA_CHECK(aligned_to(p->block_table, 4), "block_table: not 4-byte aligned");
    MLA_CHECK(aligned_to(p->seq_lens, 4), "seq_lens: not 4-byte aligned");
    MLA_CHECK(aligned_to(p->out_slots, 4), "out_slots: not 4-byte aligned");
    MLA_CHECK(aligned_to(p->error_flag, 4), "error_flag: not 4-byte aligned");
    const dim3 grid((p->topk + 255) / 256, p->num_tokens);
    MLA_CUDA_TRY_AS(launch_ex(gather_kernel, grid, dim3(256), 0, static_cast<cudaStream_t>(stream), p->positions,
                              one ? 0 : static_cast<int32_t>(p->positions_stride), p->topk, p->req_id, p->block_table,
                              p->batch == 1 ? 0 : static_cast<int32_t>(p->block_table_stride), p->max_blocks_per_seq,
                              p->seq_lens, p->batch, p->block_size, p->num_blocks, p->out_slots,
                              one ? 0 : static_cast<int32_t>(p->out_stride), p->error_flag),
                    "the gather launch");
    return MLA_STATUS_OK;
}
