/* Stand-ins for the C ABI when the crate is built without nvcc (docs.rs, CPU-only
 * CI of a downstream crate): every entry point returns MLA_STATUS_NOT_BUILT, and
 * mla_last_error() says why. The version and struct-size queries answer as the real
 * library does, so that a binding's load-time check passes. */
#include "mla_decode.h"
#include "common/struct_size.h"

static const char k_not_built[] =
    "mla-decode was built without nvcc: it has no CUDA kernels (set NVCC or CUDA_HOME, unset MLA_NO_KERNELS, rebuild)";

const char* mla_last_error(void) { return k_not_built; }
int32_t mla_last_cuda_error(void) { return 0; }
uint32_t mla_abi_version(void) { return MLA_ABI_VERSION; }
size_t mla_struct_size(mla_struct_t which) { return mla_struct_size_of(which); }
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
