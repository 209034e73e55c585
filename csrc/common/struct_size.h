/* sizeof the C ABI's structs by mla_struct_t: the one table behind mla_struct_size(), for the
 * library (common/status.cu) and its no-nvcc stand-in (no_kernels.c) alike. C and C++. */
#ifndef MLA_STRUCT_SIZE_H
#define MLA_STRUCT_SIZE_H

#include "mla_decode.h"

static inline size_t mla_struct_size_of(mla_struct_t which) {
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

#endif /* MLA_STRUCT_SIZE_H */
