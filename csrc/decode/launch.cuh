// What decode/decode.cu, the translation unit that instantiates and launches the decode
// kernels, provides to the schedule (decode/schedule.cu): kernel attributes and occupancy
// belong to the instantiations that are launched, so they are asked for there.
#pragma once

#include <cuda_runtime.h>

#include "mla_decode.h"

namespace mla {

// Lets the decode kernels of cache format fmt's row format (both query dtypes, dense and
// sparse; f16 and bf16 caches share theirs) request up to `bytes` of dynamic shared memory on
// device `dev` (the current one), and records that it did (decode_smem_allowed). Only those:
// setting an attribute loads the kernel, and the other formats' kernels stay unloaded until
// a schedule or a launch needs them (CUDA's lazy loading).
cudaError_t decode_allow_smem(int dev, mla_kv_format_t fmt, int bytes);
// Whether decode_allow_smem has run for fmt's row format on device `dev` in this process
// (true past the first 64 devices, which are not tracked).
bool decode_smem_allowed(int dev, mla_kv_format_t fmt);

// Resident CTAs per SM of the decode kernel for cache format fmt in configuration (warps,
// block_m) (config.cuh's with_row_format, with_config) when it requests `smem` bytes of
// dynamic shared memory.
cudaError_t decode_ctas_per_sm(mla_kv_format_t fmt, int warps, int block_m, int smem, int* ctas);

}  // namespace mla
