/* Stand-ins for the C ABI when the crate is built without nvcc (docs.rs, CPU-only
 * CI of a downstream crate): every entry point returns MLA_STATUS_NOT_BUILT. */
#include "mla_decode.h"

mla_status_t mla_schedule_init(mla_schedule_t* s, int32_t batch, int32_t q_len, int32_t num_heads,
                               int32_t max_len, const mla_tuning_t* tuning) {
    (void)s; (void)batch; (void)q_len; (void)num_heads; (void)max_len; (void)tuning;
    return MLA_STATUS_NOT_BUILT;
}
size_t mla_workspace_bytes(const mla_schedule_t* s) { (void)s; return 0; }
mla_status_t mla_dense_decode(const mla_schedule_t* s, const mla_dense_params_t* p, void* stream) {
    (void)s; (void)p; (void)stream;
    return MLA_STATUS_NOT_BUILT;
}
mla_status_t mla_sparse_decode(const mla_schedule_t* s, const mla_sparse_params_t* p, void* stream) {
    (void)s; (void)p; (void)stream;
    return MLA_STATUS_NOT_BUILT;
}
mla_status_t mla_append_kv(const void* kv, int64_t kv_token_stride, int32_t num_tokens,
                           const int64_t* slot_mapping, void* kv_cache, int64_t block_stride_bytes,
                           int32_t num_blocks, int32_t block_size, mla_dtype_t dtype, uint32_t* error_flag,
                           void* stream) {
    (void)kv; (void)kv_token_stride; (void)num_tokens; (void)slot_mapping; (void)kv_cache;
    (void)block_stride_bytes; (void)num_blocks; (void)block_size; (void)dtype; (void)error_flag; (void)stream;
    return MLA_STATUS_NOT_BUILT;
}
mla_status_t mla_gather_slots(const int32_t* positions, int32_t positions_stride, int32_t num_tokens,
                              int32_t topk, const int32_t* req_id, const int32_t* block_table,
                              int32_t block_table_stride, int32_t max_blocks_per_seq, const int32_t* seq_lens,
                              int32_t batch, int32_t block_size, int32_t num_blocks, int32_t* out_slots,
                              int32_t out_stride, uint32_t* error_flag, void* stream) {
    (void)positions; (void)positions_stride; (void)num_tokens; (void)topk; (void)req_id; (void)block_table;
    (void)block_table_stride; (void)max_blocks_per_seq; (void)seq_lens; (void)batch; (void)block_size;
    (void)num_blocks; (void)out_slots; (void)out_stride; (void)error_flag; (void)stream;
    return MLA_STATUS_NOT_BUILT;
}
