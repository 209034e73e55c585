// FP8 cache-row formats for the decode kernel (issue #12's read path): fp8_ds_mla (656-byte
// rows: 512 e4m3 latent values in 4 tiles of 128, 4 fp32 scales at [512, 528), 64 bf16 RoPE
// values at [528, 656)) and per-tensor fp8 (576 e4m3 values, one fp32 scale for the cache,
// read on the device from DecodeArgs::kv_scale). The policies have RowF16's members
// (decode/format.cuh, "Adding a format").
//
// The rows stay fp8 in shared memory, as they are in global memory (656 / 576 + 16 bytes per
// staged row: a stage is 20,992 / 18,944 bytes instead of 36,864, and 41 / 37 16-byte chunks
// per row, odd, so 8 rows at one chunk offset are in 8 bank groups: ldmatrix is conflict-free
// without a swizzle). The kernel reads them through its fp8 phases (kFp8;
// decode/fp8_phases.cuh): ldmatrix on the fp8 bytes, conversion in registers, the scales
// applied in fp32 to S and folded into P. This file holds what is a property of the row: its
// bytes, where it lives and how it is staged.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/constants.cuh"
#include "common/fp8.cuh"
#include "common/ptx.cuh"
#include "decode/args.cuh"
#include "decode/format.cuh"

namespace mla {

// Plain shared-memory loads at a 32-bit shared address (ordinary C++ loads, so that the
// compiler schedules them freely and merges repeated scale loads; __syncthreads orders them
// against the cp.async fills, as for ldmatrix).
template <typename V>
__device__ __forceinline__ V lds(uint32_t addr) {
    return *reinterpret_cast<const V*>(__cvta_shared_to_generic(addr));
}
__device__ __forceinline__ float lds_f32(uint32_t addr) { return lds<float>(addr); }

// 4-byte async copy global -> shared (src_bytes = 0 zero-fills).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// kDsMla: fp8_ds_mla (656-byte rows, per-tile scales, bf16 RoPE); else per-tensor fp8 (576
// e4m3 values; the staged row appends the tensor scale at byte 576, 592 bytes per staged row:
// every staged row carries it, masked rows too, and the fragments read staged row 0's).
template <typename T, bool kDsMla_>
struct RowFp8 : RowInBlock<kDsMla_ ? MLA_ROW_BYTES_FP8_DS_MLA : MLA_ROW_BYTES_FP8> {
    using Base = RowInBlock<kDsMla_ ? MLA_ROW_BYTES_FP8_DS_MLA : MLA_ROW_BYTES_FP8>;
    using typename Base::RowAddr;
    using Base::kNoRow;
    using Elem = T;
    static constexpr bool kFp8 = true;  // the kernel's fp8 phases (decode/fp8_phases.cuh)
    static constexpr bool kDsMla = kDsMla_;
    // fp8_ds_mla rows are staged byte for byte as stored (packed, no swizzle): consecutive
    // rows of a block are one contiguous copy (load_tile); per-tensor rows carry the scale
    static constexpr bool kStagedAsStored = kDsMla;
    static constexpr int kRowBytes = kDsMla ? MLA_ROW_BYTES_FP8_DS_MLA : MLA_ROW_BYTES_FP8;  // 656 / 576
    static constexpr int kSmemRowBytes = kDsMla ? kRowBytes : kRowBytes + 16;                 // 656 / 592
    static constexpr int kChunks = kRowBytes / 16;                                             // 41 / 36
    static constexpr int kQkDim = MLA_HEAD_DIM;    // 576
    static constexpr int kVDim = MLA_LATENT_DIM;   // 512
    static constexpr int kRopeDim = MLA_ROPE_DIM;  // 64
    // staged byte offset of the scale of latent dim d (per-tensor: the one at 576)
    static constexpr int kScaleOffset = kDsMla ? kFp8DsMlaScalesOffset : kFp8TensorRowBytes;
    static_assert(kRowBytes == (kDsMla ? kFp8DsMlaRowBytes : kFp8TensorRowBytes), "row bytes");
    static_assert(kChunks * 16 == kRowBytes && kChunks > 32 && kChunks <= 64, "lane l copies chunks l and l + 32");


    // Lane l copies chunks l and l + 32 (< kChunks) of the row, packed (no swizzle); per-tensor:
    // the last lane copies the tensor scale (4 bytes) behind the row.
    static __device__ __forceinline__ void copy_row(uint32_t stage, int row, const DecodeArgs& a, RowAddr r, int lane) {
        const int bytes = r >= 0 ? 16 : 0;
        const uint8_t* src = a.cache + (r >= 0 ? r : 0) + lane * 16;
        const uint32_t dst = stage + row * kSmemRowBytes + lane * 16;
        cp_async_16(dst, src, bytes);
        if (lane + 32 < kChunks) cp_async_16(dst + 512, src + 512, bytes);
        if constexpr (!kDsMla) {
            // every staged row gets the scale, masked ones too (their values are zero-filled):
            // any row's copy serves the whole tile
            if (lane == 31) cp_async_4(stage + row * kSmemRowBytes + kFp8TensorRowBytes, a.kv_scale, 4);
        }
    }

    // fp8_ds_mla with MLA_BULK_ROWS (decode/kernel.cuh kBulkRows): the row's lane copies the whole row with
    // one bulk copy completing on the stage's mbarrier (a masked row copies zeros, so every
    // staged byte comes through the copy engine and NaN never lingers in a masked row).
    static __device__ __forceinline__ void copy_row_bulk(uint32_t stage, int row, const DecodeArgs& a, RowAddr r,
                                                         uint32_t bar);
};

// The source of a masked fp8_ds_mla row's bulk copy (RowFp8::copy_row_bulk): zeros.
static __device__ __align__(128) uint8_t g_zero_row_fp8[MLA_ROW_BYTES_FP8_DS_MLA] = {};

template <typename T, bool kDsMla_>
__device__ __forceinline__ void RowFp8<T, kDsMla_>::copy_row_bulk(uint32_t stage, int row, const DecodeArgs& a,
                                                                  RowAddr r, uint32_t bar) {
    const uint8_t* src = r >= 0 ? a.cache + r : g_zero_row_fp8;
    cp_async_bulk(stage + row * kSmemRowBytes, src, kRowBytes, bar);
}

template <typename T>
using RowFp8DsMla = RowFp8<T, true>;
template <typename T>
using RowFp8Tensor = RowFp8<T, false>;

}  // namespace mla
