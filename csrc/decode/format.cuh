// Cache-row formats: how a tile of cache rows is staged into shared memory and turned into MMA
// operands. The decode kernel is a template of one such policy type (its `Fmt` parameter);
// everything it knows about a row's bytes goes through it.
//
// Adding a format (fp8_ds_mla, per-tensor fp8, 512-wide rows without RoPE, DeepSeek-V4's rows
// with a per-block scale footer):
//   1. Write a struct next to RowF16 with the same members:
//      - `Elem`: the MMA element type (f16/bf16) of the query, P and the operands the policy
//        produces (fp8 formats dequantize into it);
//      - `kRowBytes` (a row in global memory) and `kSmemRowBytes` (a staged row; it may keep
//        the scales next to the values, or pad for the bank swizzle);
//      - `kQkDim` (the q.k width: 576 with RoPE, 512 without; the query is staged kQkDim wide
//        and S has kQkDim / 16 k16 steps), `kVDim` (512: V is the first kVDim dims) and
//        `kRopeDim` (the query dims that come from q_rope: 64, or 0);
//      - `RowAddr`, `kNoRow`, `row_addr`, `has_row`, `shfl_row`: where a row lives. The lane
//        that resolved a tile row gets the row's block base (block id * block stride) and its
//        index in the block, and makes a RowAddr of them (RowF16: the byte offset of the row;
//        a footer format would keep the block base too, for its scales); the warp then
//        broadcasts it row by row;
//      - `copy_row`: the warp's cp.async copies of one row (from a.cache; a format may stage
//        more, e.g. the tensor scale a.kv_scale) into its staged row (16-byte chunks,
//        zero-filled when the row is masked: its flags read 0 and its values are never used,
//        but they must not be NaN garbage either, as P is 0 there);
//      - `k_frag`, `v_frag` (16-bit formats): the B fragments of S = Q K^T (k16 step kk, two
//        n8 tiles) and of O += P V (16 rows, two n8 tiles of dims), from the staged rows
//        (ldmatrix);
//      - `kFp8`, `kDsMla`: false here. An fp8 format sets kFp8 and the kernel runs its fp8
//        phases instead of k_frag / v_frag (decode/fp8_phases.cuh: ldmatrix on the fp8 bytes,
//        the query k-permuted, scales applied per 128-wide tile to S and folded into P); a new
//        fp8 layout extends those phases (where its scales and RoPE live) rather than this
//        struct.
//      The query side follows from kQkDim and kRopeDim alone (decode/kernel.cuh: the query is
//      `Elem`, staged kQkDim wide, whatever the cache holds).
//   2. Instantiate the kernels for it: decode/decode.cu maps (dtype, cache format) to a policy
//      (launch, allow_smem_dtype), and config.cuh's with_row_format maps the cache format to
//      the policy whose KernelConfig<Fmt, Tile> sizes shared memory and occupancy (the
//      schedule, the launch's check, decode_ctas_per_sm).
//   3. KernelConfig<Fmt, Tile>::kSmemBytes (config.cuh) static_asserts the stages of
//      kSmemRowBytes rows, the query tile, the S partials and the flags against sm_120's
//      101,376 bytes per block: a format whose rows do not fit a configuration fails to compile
//      (scripts/resource-gate.sh). Then the gate's register and spill check, and the GPU tests.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/constants.cuh"
#include "common/fault.cuh"
#include "common/ptx.cuh"
#include "decode/args.cuh"

namespace mla {

// f16 / bf16 rows of 576 values (512 latent + 64 RoPE), 1,152 bytes, staged as they are in
// 16-byte chunks whose low 3 index bits are XORed with the row (the 8 rows an ldmatrix reads
// land in 8 different bank groups: a row is 9 x 128 bytes).
// Where a row of kRowBytes_ bytes lives when rows are packed in their block with everything
// they need (the values and any per-row scales): its byte offset from the cache base
// (kNoRow: masked). The formats below inherit it; a format with a per-block footer would keep
// the block base too.
template <int kRowBytes_>
struct RowInBlock {
    using RowAddr = int64_t;
    static constexpr RowAddr kNoRow = -1;
    static __device__ __forceinline__ RowAddr row_addr(int64_t block_base, int in_block) {
        return block_base + static_cast<int64_t>(in_block) * kRowBytes_;
    }
    static __device__ __forceinline__ bool has_row(RowAddr r) { return r >= 0; }
    static __device__ __forceinline__ RowAddr shfl_row(RowAddr r, int src_lane) {
        return __shfl_sync(0xffffffffu, r, src_lane);
    }
};

// The cache row behind a raw entry: dense, block-table entry e at position pos; sparse, slot id
// e. Fmt::kNoRow where the entry is out of range (dense: outside [0, num_blocks); sparse:
// negative or past the cache), recorded in the flag against request `row` when `record`
// (a sparse -1 is no fault). The decode kernels' loaders: load_tile, rows.cuh fetch_rows.
template <typename Fmt, bool kSparse>
__device__ __forceinline__ typename Fmt::RowAddr entry_row(const DecodeArgs& a, int e, int pos, int row, bool record) {
    const int bmask = a.block_size - 1;
    if (kSparse) {
        if (e >= 0 && (e >> a.block_shift) < a.num_blocks) return Fmt::row_addr((e >> a.block_shift) * a.block_stride, e & bmask);
        if (record && e != -1) record_fault(a.flag, MLA_FAULT_BAD_SLOT_ID, row, e);
    } else {
        if (e >= 0 && e < a.num_blocks) return Fmt::row_addr(e * a.block_stride, pos & bmask);
        if (record) record_fault(a.flag, MLA_FAULT_BAD_BLOCK_ID, row, e);
    }
    return Fmt::kNoRow;
}

template <typename T>
struct RowF16 : RowInBlock<MLA_ROW_BYTES_16> {
    using Elem = T;
    static constexpr int kRowBytes = MLA_ROW_BYTES_16;  // 1152
    static constexpr int kSmemRowBytes = kRowBytes;
    static constexpr int kChunks = kRowBytes / 16;      // 72 chunks of 16 bytes
    static constexpr int kQkDim = MLA_HEAD_DIM;         // 576
    static constexpr int kVDim = MLA_LATENT_DIM;        // 512
    static constexpr int kRopeDim = MLA_ROPE_DIM;       // 64
    static_assert(kRowBytes == kQkDim * 2, "a row is kQkDim 16-bit values");
    // the kernel's 16-bit phases (k_frag, v_frag below); fp8 formats have their own
    // (decode/fp8_phases.cuh)
    static constexpr bool kFp8 = false;
    static constexpr bool kDsMla = false;
    // staged rows are not the stored bytes in order (the chunks are swizzled)
    static constexpr bool kStagedAsStored = false;

    // Swizzled position (in 16-byte chunks) of chunk c of staged row r.
    static __device__ __forceinline__ int chunk(int r, int c) { return r * kChunks + (c ^ (r & 7)); }


    // The warp's copies of the row at `r` into staged row `row` of the stage at shared address
    // `stage`: lane l copies chunks l, l + 32 and l + 64 (< 72).
    static __device__ __forceinline__ void copy_row(uint32_t stage, int row, const DecodeArgs& a, RowAddr r, int lane) {
        const uint8_t* src = a.cache + (r >= 0 ? r : 0) + lane * 16;
        const uint32_t dst = stage + row * kSmemRowBytes;
        const int x = row & 7;
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            const int ch = lane + 32 * k;
            if (k < 2 || ch < kChunks) cp_async_16_or_zero(dst + ((ch ^ x) << 4), src + k * 512, r < 0);
        }
    }

    // S = Q K^T: B fragments of k16 step kk for two n8 tiles of rows (this lane addresses staged
    // row krow; col_half picks the 8-column half of the step).
    static __device__ __forceinline__ void k_frag(uint32_t (&b)[4], uint32_t stage, int krow, int kk, int col_half) {
        ldmatrix_x4(b, stage + chunk(krow, kk * 2 + col_half) * 16);
    }

    // O += P V: B fragments of 16 rows (this lane addresses staged row vrow) and two n8 tiles
    // of dims starting at 16-byte chunk `dchunk` of the row (the lane's 8-dim half included).
    static __device__ __forceinline__ void v_frag(uint32_t (&b)[4], uint32_t stage, int vrow, int dchunk) {
        ldmatrix_x4_trans(b, stage + chunk(vrow, dchunk) * 16);
    }
};

}  // namespace mla
