// The decode kernel's tile configurations: TileConfig (rows, warps, how the warps split the
// two products), the three in use, the one mapping from a schedule's (warps, block_m) to a
// configuration, and KernelConfig: a configuration applied to a cache-row format
// (decode/format.cuh), with the shared-memory arithmetic checked against sm_120.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/constants.cuh"
#include "decode/format.cuh"
#include "decode/format_fp8.cuh"

namespace mla {

// ---- tile configuration ---------------------------------------------------------------
// One configuration serves sm_120 and sm_90 (the H200 runs exactly what sm_120 runs). Two
// warp counts: 4 (the streaming configuration: two CTAs per H200 SM, registers at the cap)
// and 8 (one CTA per SM, each warp with half the S and PV work: a tile computes in about
// half the time, for steps whose CTAs each have an SM to themselves).
template <int kWarps_, int kMTiles_ = 1, bool kHalfM_ = false, bool kTransposed_ = false>
struct TileConfig {
    static constexpr int kMTiles = kMTiles_;          // m16 MMA tiles of query rows per CTA
    // Half m-tile: 8 query rows per CTA (steps of at most 8 query rows, heads x q_len, per
    // request). The MMAs still run 16 rows, rows 8-15 of Q zero; every per-row phase
    // (S exchange, softmax, P packing, the write) handles only the fragment rows g, not g + 8.
    static constexpr bool kHalfM = kHalfM_;
    // The transposed form of a half m-tile with 16-bit rows (decode/kernel.cuh kT16): Sᵀ = K Qᵀ
    // and Oᵀ += Vᵀ Pᵀ, the query's 8 rows as the MMAs' N, as the fp8 8-row kernels always run
    // (their kSwapPV): half the MMAs and no zero rows. Faster where a CTA has its SM to itself
    // (sm_120, one CTA per SM) and on the H200's sparse steps, slower by up to 4 % on dense steps
    // where two 4-warp CTAs share an SM (logs #116, #118).
    static constexpr bool kTransposed = kTransposed_;
    static constexpr int kFragRows = kHalfM ? 1 : 2;  // fragment rows per lane and m-tile (g, g + 8)
    static constexpr int kBlockM = kHalfM ? 8 : 16 * kMTiles;  // query rows (heads x q_len) per CTA
    // Q: staged in shared memory (ldmatrix) with one m-tile; with two, the Q tile does not
    // fit 99 KB beside the stages, and each thread loads its fragments from global memory
    // (KernelConfig: fp8 rows too).
    static constexpr bool kQInSmem = kMTiles == 1;
    static constexpr int kBlockN = 32;   // cache rows per pipeline stage
    static constexpr int kStages = 2;
    static constexpr int kWarps = kWarps_;
    static constexpr int kThreads = kWarps * 32;
    // S = Q K^T: warps split the tile's rows (kSplitN) and the QK width (kSplitK)
    static constexpr int kSplitN = 2;
    static constexpr int kSplitK = kWarps / kSplitN;
    static constexpr int kSNTiles = kBlockN / 8 / kSplitN;       // n8 tiles of S per warp
    static constexpr int kRowsPerWarp = kBlockN / kWarps;        // tile rows each warp loads
    // shared memory that does not depend on the row format
    // (S partials: a float4 per lane and fragment, a float2 with a half m-tile)
    static constexpr int kPartialBytes = kWarps * kMTiles * kSNTiles * 32 * 8 * kFragRows;
    static constexpr int kValidBytes = kStages * kBlockN * 4;

    // One softmax per tile (16-bit rows; decode/kernel.cuh, softmax_rows): each warp owns
    // kBlockM / kWarps query rows of the tile's S, turns them into P in shared memory and every
    // warp reads P back as A fragments, instead of every warp redoing the whole tile's softmax.
    // Used where a warp owns 4 query rows: the 32-row configuration (many heads; 11-17 %
    // faster, logs #49, #50) and the 4-warp 16-row one (2-4 %). The 8-row configurations and
    // 8 warps x 16 rows measured slower (1-2 rows per warp: a row's reductions span 16-32
    // lanes), and the latter is at sm_120's shared-memory limit: they keep one softmax per
    // warp (softmax_tile).
    static constexpr bool kSharedSoftmax = kMTiles == 2 || (kWarps == 4 && !kHalfM);
    static constexpr int kSoftRows = kBlockM / kWarps;  // query rows each warp's softmax owns
    // Whether tile x+2 is issued as soon as tile x is computed (a barrier per tile, two tiles
    // in flight at each wait: what the streaming configurations need), or at the top of
    // iteration x+1 (one tile in flight, one barrier fewer): the 32-row configuration, whose
    // tiles compute long enough to hide a tile's load (3-5 % faster there, log #51), and the
    // 4-warp 16-row one, which the H200 runs for many heads (2-3 % faster there, the 16-row
    // streaming rows even, log #54).
    static constexpr bool kIssueAfter = kMTiles == 1 && !(kWarps == 4 && !kHalfM);

    // The online softmax's running max lags by up to 2^8 (decode/kernel.cuh, lazy_max): where
    // tiles are many per CTA (1-1.6 % faster on the many-head rows, log #58); not in the 8-warp
    // one-m-tile configurations, which serve small steps of one or two tiles per CTA (there
    // 0.1-0.25 µs slower with it).
    static constexpr bool kLazyMax = !(kWarps == 8 && kMTiles == 1);

    static_assert(kWarps == 4 || kWarps == 8, "warp counts the S reduction handles");
    static_assert(!kSharedSoftmax || kSoftRows == 4, "softmax_rows' row mapping: 4 rows per warp");
    static_assert(kMTiles == 1 || (kMTiles == 2 && kWarps == 8), "two m-tiles only with 8 warps");
    static_assert(!kHalfM || kMTiles == 1, "a half m-tile is the only m-tile");
    static_assert(!kTransposed || kHalfM, "the transposed form is a half m-tile's");
    static_assert(kSplitN * kSplitK == kWarps, "warp split");
    static_assert(kSNTiles == 2, "S code handles two n8 tiles per warp (one ldmatrix.x4)");
    static_assert(kBlockN % 16 == 0 && kBlockN / 8 == 4, "softmax/PV code assumes 32-row tiles");
};

// fp8_ds_mla rows staged by bulk copies on a per-stage mbarrier (decode/kernel.cuh kBulkRows;
// bit 0: the sparse kernels, bit 1: the dense ones): a compile-time option, default 1 (the
// sparse kernels only: 2-7 % faster; the dense ones lost 2-11 %, docs/PERFORMANCE.md log #103).
#ifndef MLA_BULK_ROWS
#define MLA_BULK_ROWS 1
#endif
// cp.async.bulk and mbarrier transaction counts are sm_90+: older targets (MLA_CUDA_ARCHS=89)
// keep the chunked copies whatever MLA_BULK_ROWS says.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define MLA_BULK_ARCH 0
#else
#define MLA_BULK_ARCH 1
#endif

// A tile configuration applied to cache-row format Fmt (decode/format.cuh): the QK width each
// warp covers, the output dims each warp owns, and the dynamic shared memory (SmemPlan,
// decode/smem.cuh), checked here against sm_120: a format and configuration that do not fit
// do not compile.
template <typename Fmt, typename Tile>
struct KernelConfig : Tile {
    using Format = Fmt;
    // Q staged in shared memory: with one m-tile, except fp8 rows with 4 warps (the streaming
    // configuration), which take their Q fragments from global memory at each segment start:
    // without the Q tile (9,216 or 18,432 B) a 4-warp fp8 CTA needs at most 46,336 B, and an
    // sm_120 SM (100 KB) holds two. (The 8-warp configurations serve small steps, where
    // the staged Q's load with the first tile is off the critical path: log #46.)
    static constexpr bool kQInSmem = Tile::kQInSmem && !(Fmt::kFp8 && Tile::kWarps == 4);
    // A part of at least kFirstAlone tiles issues its first tile alone and the second once the
    // first is in (0: both at once). fp8 rows: 0.6-3 % faster on the streaming rows (the first
    // wave of copies half as deep); 16-bit rows lost up to 2 % (log #68).
    static constexpr int kFirstAlone = Fmt::kFp8 ? 4 : 0;
    // CTAs per SM the registers must allow on sm_90 (decode_min_ctas, decode/kernel.cuh): the
    // fp8 8-row 4-warp configuration fits 168 registers without spills (since its P V is
    // computed transposed, decode/fp8_phases.cuh kSwapPV; per-tensor fp8 also with one S
    // accumulator, Fp8Split::kAccs), so three CTAs share an H200 SM; the schedule uses the
    // third only on long steps (log #72).
    static constexpr int kMinCtasSm90 = (Fmt::kFp8 && Tile::kHalfM && Tile::kWarps == 4) ? 3 : 1;
    // S = Q K^T: k16 steps of the QK width per warp
    static constexpr int kSKSteps = Fmt::kQkDim / 16 / Tile::kSplitK;
    // fp8_ds_mla with f16 queries: the RoPE dims' products are bf16 MMAs (the cache's RoPE is
    // bf16, which f16 cannot hold exactly) with the query split exactly into bf16 hi + lo
    // (decode/fp8_phases.cuh fp8_q_f16_rope_split); with one m-tile the lo fragments are kept
    // beside qf (kQFrags), with two (at the register cap) both halves are split per tile
    static constexpr int kRopeLoSteps =
        (Fmt::kFp8 && Fmt::kDsMla && std::is_same<typename Fmt::Elem, __half>::value && Tile::kMTiles == 1)
            ? Fmt::kRopeDim / 16 / Tile::kSplitK
            : 0;
    static constexpr int kQFrags = kSKSteps + kRopeLoSteps;  // qf's k16 entries per m-tile
    // O += P V: warps split the kVDim output dims
    static constexpr int kODims = Fmt::kVDim / Tile::kWarps;        // 128 or 64
    static constexpr int kONTiles = kODims / 8;                     // 16 or 8
    // shared memory
    static constexpr int kKvStageBytes = Tile::kBlockN * Fmt::kSmemRowBytes;     // 36,864 (f16)
    static constexpr int kQRowBytes = Fmt::kQkDim * 2;                           // a staged query row
    static constexpr int kQBytes = kQInSmem ? Tile::kBlockM * kQRowBytes : 0;  // 18,432 (576 wide)
    // one softmax per tile: P (kBlockM rows of kBlockN values, rows padded to 80 bytes:
    // ldmatrix conflict-free), the rows' rescale factors and end-of-segment stats; for 16-bit
    // rows and per-tensor fp8, whose P carries no V scale (P in f16 for the fp8 P V, log #55).
    // fp8_ds_mla keeps one softmax per warp: its P'' carries each warp's V scale, and with 4
    // warps each warp's is the only one of its scale tile (sharing E = 2^(s - m) in fp32 and
    // scaling per warp measured 2-3 % slower, log #56, branch wip/fp8-shared-e; in the 32-row
    // configuration one P'' per scale tile, each with its own running max, measured 22-35 %
    // slower than the 16-row CTAs, log #83 (a), branch wip/fp8-dsmla-shared-32)
    static constexpr bool kSharedSoftmax = Tile::kSharedSoftmax && !(Fmt::kFp8 && Fmt::kDsMla);
    static constexpr int kPRowBytes = Tile::kBlockN * 2 + 16;
    static constexpr int kSoftBytes = kSharedSoftmax ? Tile::kBlockM * (kPRowBytes + 4 + 8) : 0;
    // fp8 rows with one softmax per warp (softmax_tile; log #83): the valid flags are additive
    // masks (0 or -inf as float bits) and the S partials come scaled by the log2-domain softmax
    // scale (folded into the query's row factor)
    static constexpr bool kMaskAdd = Fmt::kFp8 && !kSharedSoftmax;
    // S partials: a fragment's 32 lane slots, then (kSharedSoftmax) one slot of pad, and with
    // one m-tile two more after every pair of fragments, so that the fragments of one
    // softmax_rows load start in different bank groups (conflict-free with soft_row's order:
    // decode/smem.cuh part_slot)
    static constexpr int kPartialPad = kSharedSoftmax ? 1 : 0;
    static constexpr int kPartialPairPad = kSharedSoftmax && Tile::kMTiles == 1 ? 2 : 0;
    static constexpr int kPartialFrags = Tile::kWarps * Tile::kMTiles * Tile::kSNTiles;  // (warp, m-tile, n8 tile)
    static constexpr int kPartialBytes =
        (kPartialFrags * (32 + kPartialPad) + kPartialFrags / 2 * kPartialPairPad) * 8 * Tile::kFragRows;
    // fp8_ds_mla with MLA_BULK_ROWS: one mbarrier per stage, on which the sparse rows' bulk
    // copies complete (decode/kernel.cuh kBulkRows)
    static constexpr int kBarBytes = (MLA_BULK_ROWS && Fmt::kFp8 && Fmt::kDsMla) ? Tile::kStages * 8 : 0;
    static constexpr int kSmemBytes =
        Tile::kStages * kKvStageBytes + kQBytes + kPartialBytes + Tile::kValidBytes + kSoftBytes + kBarBytes;

    static_assert(kSKSteps * 16 * Tile::kSplitK == Fmt::kQkDim, "k split");
    static_assert(kODims * Tile::kWarps == Fmt::kVDim && kONTiles % 2 == 0, "PV loads two n8 tiles per ldmatrix");
    static_assert(kKvStageBytes % 128 == 0 && kQBytes % 128 == 0, "buffers stay 128-byte aligned");
    static_assert(kSmemBytes <= kSm120SmemPerBlock, "tile configuration exceeds sm_120's 99 KB per block");
    static_assert(kSmemBytes + 1024 <= kSm120SmemPerSm, "one CTA must fit an sm_120 SM");
};

// Calls f(Fmt{}) with the row format (bf16 queries) that sizes shared memory and occupancy
// for cache format fmt: the schedule, the launch's check and decode_ctas_per_sm use it (the
// query dtype changes neither the shared memory nor, materially, the registers).
template <typename F>
auto with_row_format(mla_kv_format_t fmt, F&& f) {
    if (fmt == MLA_KV_FP8_DS_MLA) return f(RowFp8DsMla<__nv_bfloat16>{});
    if (fmt == MLA_KV_FP8) return f(RowFp8Tensor<__nv_bfloat16>{});
    return f(RowF16<__nv_bfloat16>{});
}
using Cfg = TileConfig<4>;   // the shared constants (block sizes) and the streaming configuration
using Cfg8 = TileConfig<8>;
using CfgWide = TileConfig<8, 2>;  // 32 query rows per CTA: many heads
using CfgHalf = TileConfig<4, 1, true>;   // 8 query rows per CTA: the streaming configuration
using CfgHalfT = TileConfig<4, 1, true, true>;  // and its transposed form (16-bit rows, one CTA per SM)
using Cfg8Half = TileConfig<8, 1, true>;  // and the 8-warp one, for steps of <= 8 rows per request
constexpr int kTileShift = 5;  // log2(kBlockN)
static_assert((1 << kTileShift) == Cfg::kBlockN, "tile shift");
constexpr int kMinChunkTiles = 2;  // a part streams at least this many tiles
constexpr int kCombineWarps = 8;   // warps per combine CTA (decode/combine.cuh)
constexpr int kRowsMaxBatch = 65535;  // the row kernel's grid: one CTA row per request (decode/rows.cuh)

// Calls f(C{}) with the direct-form tile configuration C that (warps, block_m) name: 32 rows ->
// CfgWide (always 8 warps); 8 rows -> Cfg8Half or CfgHalf; else 8 warps -> Cfg8, else Cfg.
// What the schedule sizes (shared memory, CTAs per SM) before it picks the form.
template <typename F>
auto with_config(int warps, int block_m, F&& f) {
    if (block_m == 32) return f(CfgWide{});
    if (block_m == 8) return warps == 8 ? f(Cfg8Half{}) : f(CfgHalf{});
    if (warps == 8) return f(Cfg8{});
    return f(Cfg{});
}
// The same with the schedule's form: MLA_FORM_TRANSPOSED names CfgHalfT where the direct
// mapping names CfgHalf. The launch and its argument check pick the configuration through
// this one mapping; the form is transposed only where form_allowed says (the launch checks it).
template <typename F>
auto with_config(int warps, int block_m, int form, F&& f) {
    if (block_m == 8 && warps == 4 && form == MLA_FORM_TRANSPOSED) return f(CfgHalfT{});
    return with_config(warps, block_m, static_cast<F&&>(f));
}

// Whether the decode kernel of row format Fmt and configuration C is also instantiated with
// parts within requests (MLA_SPLIT_WITHIN_REQUESTS, decode/split.cuh): 16-bit caches at 16
// and 32 query rows per CTA (log #75: their many-head steps gain 2-6 %; the fp8_ds_mla
// kernels with that code measured 1-5 % slower, and the 8-row streaming steps nothing).
template <typename Fmt, typename C>
constexpr bool kWithinKernel = !C::kHalfM && !Fmt::kFp8;

// Whether the decode kernel of row format Fmt and configuration C is also instantiated with
// its first tiles issued before the lengths are read (kSpec: the closed form with lengths,
// decode/split.cuh closed_lens_parts), dense and sparse: the one-m-tile configurations that the small-step
// schedule picks: 8 warps (parts of one tile: up to SMs / 2 tiles for 16-bit rows, SMs for
// fp8), for 16-bit rows 4 warps (parts of two tiles, up to 2 x SMs), and the fp8 8-row 4-warp
// one (the short-request steps of one part per request, schedule.cu short8; log #120).
template <typename Fmt, typename C>
constexpr bool kSpecKernel = C::kMTiles == 1 && (C::kWarps == 8 || !Fmt::kFp8 || C::kHalfM);

// Whether the decode kernel of row format Fmt and configuration C is also instantiated for the
// flat split with lengths (kAligned: the aligned chunk for equal lengths, decode/split.cuh
// flat_chunk, and the one-round-trip part search past kThreads requests, WarpRows; the host
// picks it where flat_lens_kernel): the 4-warp and the 32-row configurations, which run the
// steps of many requests or many tiles. A separate instantiation, as kWithin: the test
// moved the other kernels' code, and the streaming rows lost 0.5-2.5 % with it inline (log #95).
template <typename Fmt, typename C>
constexpr bool kAlignedKernel = C::kWarps == 4 || C::kMTiles == 2;

// Calls f(C{}) for every configuration with_config can pick: the list of instantiations (the
// decode kernel is instantiated for each, per element type and dense/sparse).
template <typename F>
void for_each_config(F&& f) {
    f(Cfg{});
    f(Cfg8{});
    f(CfgWide{});
    f(CfgHalf{});
    f(CfgHalfT{});
    f(Cfg8Half{});
}

// Whether a schedule may run (warps, block_m) with cache format fmt in the transposed form: the
// 16-bit 8-row 4-warp configuration (the fp8 8-row kernels have their own, always on).
inline bool form_allowed(mla_kv_format_t fmt, int warps, int block_m) {
    return block_m == 8 && warps == 4 && fmt != MLA_KV_FP8_DS_MLA && fmt != MLA_KV_FP8;
}
// Whether the decode kernel of row format Fmt exists in configuration C: the transposed form
// only for 16-bit rows (every launch of an fp8 format names the direct one).
template <typename Fmt, typename C>
constexpr bool kConfigFor = !(C::kTransposed && Fmt::kFp8);

}  // namespace mla
