// Cache maintenance kernels: append new rows through a slot mapping, and gather
// request-logical top-k positions into global slot ids.
#include "common/constants.cuh"
#include "common/fault.cuh"
#include "common/status.cuh"

using namespace mla;

namespace {

// One warp per new token: 72 chunks of 16 bytes.
__global__ void __launch_bounds__(256) append_kernel(const uint8_t* kv, int64_t kv_ts_bytes, int32_t num_tokens,
                                                     const int64_t* slot_mapping, uint8_t* cache, int64_t block_stride,
                                                     int32_t num_blocks, int32_t block_size, uint32_t* flag) {
    const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= num_tokens) return;
    const int64_t slot = slot_mapping[t];
    if (slot == -1) return;
    if (slot < 0 || slot >= static_cast<int64_t>(num_blocks) * block_size) {
        if (lane == 0) record_fault(flag, MLA_FAULT_BAD_APPEND_SLOT, t, static_cast<int32_t>(slot));
        return;
    }
    const int64_t blk = slot / block_size;
    const uint4* src = reinterpret_cast<const uint4*>(kv + t * kv_ts_bytes);
    uint4* dst = reinterpret_cast<uint4*>(cache + blk * block_stride + (slot - blk * block_size) * kRowBytes);
    for (int c = lane; c < kRowChunks; c += 32) dst[c] = src[c];
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
    const int req = req_id[t];
    int slot = -1;
    if (req < 0 || req >= batch) {
        if (k == 0) record_fault(flag, MLA_FAULT_BAD_REQ_ID, t, req);
    } else {
        const int max_len = max_blocks_per_seq * block_size;
        const int L = min(max(seq_lens[req], 0), max_len);
        const int pos = positions[static_cast<int64_t>(t) * positions_stride + k];
        if (pos >= 0 && pos < L) {
            const int bi = pos / block_size;
            const int e = block_table[static_cast<int64_t>(req) * block_table_stride + bi];
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

extern "C" mla_status_t mla_append_kv(const void* kv, int64_t kv_token_stride, int32_t num_tokens,
                                      const int64_t* slot_mapping, void* kv_cache, int64_t block_stride_bytes,
                                      int32_t num_blocks, int32_t block_size, mla_dtype_t dtype, uint32_t* error_flag,
                                      void* stream) {
    MLA_REQUIRE(num_tokens >= 0 && valid_block_size(block_size) && num_blocks >= 1);
    MLA_REQUIRE(dtype == MLA_DTYPE_F16 || dtype == MLA_DTYPE_BF16);
    if (num_tokens == 0) return MLA_STATUS_OK;
    MLA_REQUIRE(kv != nullptr && slot_mapping != nullptr && kv_cache != nullptr);
    MLA_REQUIRE(kv_token_stride >= kHeadDim && (kv_token_stride * 2) % 16 == 0);
    MLA_REQUIRE(block_stride_bytes >= static_cast<int64_t>(block_size) * kRowBytes && block_stride_bytes % 16 == 0);
    MLA_REQUIRE((reinterpret_cast<uintptr_t>(kv) & 15) == 0 && (reinterpret_cast<uintptr_t>(kv_cache) & 15) == 0);
    append_kernel<<<(num_tokens + 7) / 8, 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const uint8_t*>(kv), kv_token_stride * 2, num_tokens, slot_mapping,
        static_cast<uint8_t*>(kv_cache), block_stride_bytes, num_blocks, block_size, error_flag);
    return mla_cuda_status(cudaGetLastError());
}

extern "C" mla_status_t mla_gather_slots(const int32_t* positions, int32_t positions_stride, int32_t num_tokens,
                                         int32_t topk, const int32_t* req_id, const int32_t* block_table,
                                         int32_t block_table_stride, int32_t max_blocks_per_seq,
                                         const int32_t* seq_lens, int32_t batch, int32_t block_size,
                                         int32_t num_blocks, int32_t* out_slots, int32_t out_stride,
                                         uint32_t* error_flag, void* stream) {
    MLA_REQUIRE(num_tokens >= 0 && topk >= 1 && topk <= MLA_MAX_TOPK && batch >= 1 && num_blocks >= 1);
    MLA_REQUIRE(valid_block_size(block_size) && max_blocks_per_seq >= 1);
    MLA_REQUIRE(positions_stride >= topk && out_stride >= topk && block_table_stride >= max_blocks_per_seq);
    if (num_tokens == 0) return MLA_STATUS_OK;
    MLA_REQUIRE(positions && req_id && block_table && seq_lens && out_slots);
    MLA_REQUIRE(static_cast<int64_t>(num_blocks) * block_size <= 0x7fffffffLL);
    MLA_REQUIRE(static_cast<int64_t>(max_blocks_per_seq) * block_size <= 0x7fffffffLL);
    MLA_REQUIRE(num_tokens <= 65535);  // one grid row per token
    const dim3 grid((topk + 255) / 256, num_tokens);
    gather_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(
        positions, positions_stride, topk, req_id, block_table, block_table_stride, max_blocks_per_seq, seq_lens,
        batch, block_size, num_blocks, out_slots, out_stride, error_flag);
    return mla_cuda_status(cudaGetLastError());
}
