// The fixed dims and hardware limits every kernel shares. The model's dims come from the C
// header (csrc/mla_decode.h), the one place they are written down.
#pragma once

#include <stdint.h>

#include "mla_decode.h"

namespace mla {

constexpr int kHeadDim = MLA_HEAD_DIM;           // 576
constexpr int kLatentDim = MLA_LATENT_DIM;       // 512
constexpr int kRowBytes = MLA_ROW_BYTES_16;      // 1152
constexpr int kRowChunks = kRowBytes / 16;       // 72 chunks of 16 bytes
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kSm120SmemPerBlock = 101376;       // 99 KB opt-in limit of sm_120
constexpr int kSm120SmemPerSm = 102400;          // 100 KB per SM on sm_120
// mla_schedule_internal_t::pdl's one bit beyond the public MLA_PDL_* ones, set by the schedule
// (never taken from tuning): parts of at most two tiles trigger the combine at their start
// (log #86). The kernels see the start trigger as a threshold instead: DecodeArgs::pdl carries
// the MLA_PDL_* bits below kPdlStartShift and, above, the most tiles a part may have to
// trigger at its start (decode.cu; decode/kernel.cuh).
constexpr int kPdlTriggerShortParts = 8;
static_assert((kPdlTriggerShortParts & MLA_PDL_ALL) == 0, "an internal bit, outside MLA_PDL_ALL");
constexpr int kPdlStartShift = 8;
constexpr int kPdlShortPartTiles = 2;
constexpr int kPdlStartAlways = (1 << 22) - 1;  // any part (a part of more tiles cannot fit a GPU's memory)

// Bytes of one cache row in format f (0 for a value that is not an mla_kv_format_t).
__host__ __device__ constexpr int64_t row_bytes_of(mla_kv_format_t f) {
    return f == MLA_KV_F16 || f == MLA_KV_BF16 ? MLA_ROW_BYTES_16
           : f == MLA_KV_FP8_DS_MLA           ? MLA_ROW_BYTES_FP8_DS_MLA
           : f == MLA_KV_FP8                  ? MLA_ROW_BYTES_FP8
                                              : 0;
}

}  // namespace mla
