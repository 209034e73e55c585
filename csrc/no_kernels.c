/* Stand-ins for the C ABI when the crate is built without nvcc (docs.rs, CPU-only
 * CI of a downstream crate): every entry point returns MLA_STATUS_NOT_BUILT, and
 * mla_last_error() says why. The version and struct-size queries answer as the real
 * library does, so that a binding's load-time check passes. */
#include "mla_decode.h"

static const char k_not_built[] =
    "mla-decode was built without nvcc: it has no CUDA kernels (set NVCC or CUDA_HOME, unset MLA_NO_KERNELS, rebuild)";

const char* mla_last_error(void) { return k_not_built; }
int32_t mla_last_cuda_error(void) { return 0; }
uint32_t mla_abi_version(void) { return MLA_ABI_VERSION; }
size_t mla_struct_size(mla_struct_t which) {
    switch (which) {
        case MLA_STRUCT_TUNING: return sizeof(mla_tuning_t);
        case MLA_STRUCT_SHAPE: return sizeof(mla_shape_t);
        case MLA_STRUCT_SCHEDULE: return sizeof(mla_schedule_t);
        case MLA_STRUCT_DENSE_PARAMS: return sizeof(mla_dense_params_t);
        case MLA_STRUCT_SPARSE_PARAMS: return sizeof(mla_sparse_params_t);
        case MLA_STRUCT_APPEND_PARAMS: return sizeof(mla_append_params_t);
        case MLA_STRUCT_GATHER_PARAMS: return sizeof(mla_gather_params_t);
    }
    return 0;
}
mla_status_t mla_schedule_init(mla_schedule_t* s, const mla_shape_t* shape, const mla_tuning_t* tuning) {
    (void)s; (void)shape; (void)tuning;
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
mla_status_t mla_append_kv(const mla_append_params_t* p, void* stream) {
    (void)p; (void)stream;
    return MLA_STATUS_NOT_BUILT;
}
mla_status_t mla_gather_slots(const mla_gather_params_t* p, void* stream) {
    (void)p; (void)stream;
    return MLA_STATUS_NOT_BUILT;
}
