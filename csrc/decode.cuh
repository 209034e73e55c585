// The split-KV decode kernel family shared by dense (paged, causal) and sparse (top-k
// slot list) MLA decode, the combine kernel that merges splits, and the split itself.
//
// Work decomposition (flash-decoding, FlashMLA-style flattened schedule):
//   - A "request" is a dense sequence b (q_len query tokens) or a sparse token t.
//   - Its cache rows are cut into tiles of kBlockN rows; a request with no rows still
//     gets one (fully masked) tile, so that decode_kernel writes its zeros and -inf. All
//     requests' tiles are laid end to end and each of num_parts parts gets `chunk`
//     consecutive tiles, so one part may cover the end of one request and the start of the
//     next. There is no plan buffer: every CTA derives its part from the lengths (find_part).
//   - CTA (m_tile, part) runs the query rows [kBlockM*m_tile, +kBlockM) of every request
//     its part touches (kBlockM = 16, or 32 in the many-head configuration), streaming the
//     tiles through a cp.async double buffer with two tiles in flight. A request
//     that lies wholly inside one part is written straight to `out`; the pieces of a
//     split request go to the workspace (slot 2*part for the part's first request,
//     2*part+1 for its last) and combine_kernel merges them in part order (deterministic).
//   - Three tile configurations (TileConfig<warps, m-tiles>), picked per shape by
//     mla_schedule_init: 4 warps x 16 rows (streaming; two CTAs per H200 SM), 8 warps x 16
//     rows (steps of a few tiles per SM), 8 warps x 32 rows (many heads where one CTA fills
//     an SM, i.e. sm_120).
#pragma once

#include "common.cuh"

// Phase timestamps for scripts/smoke.cu's trace mode (built with -DMLA_TRACE only):
// thread 0 of each CTA stores (%globaltimer, clock64) at point i of kernel k (0 decode,
// 1 combine); decode.cu's mla_trace_read copies them out.
#ifdef MLA_TRACE
constexpr int kTraceCtas = 2048, kTracePoints = 8;
__device__ unsigned long long g_mla_trace[2][kTraceCtas][kTracePoints][2];
#define MLA_TRACE_AT(k, i)                                                                       \
    do {                                                                                         \
        const unsigned cta_ = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;    \
        if (threadIdx.x == 0 && cta_ < kTraceCtas) {                                             \
            unsigned long long t_;                                                               \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                               \
            g_mla_trace[k][cta_][i][0] = t_;                                                     \
            g_mla_trace[k][cta_][i][1] = clock64();                                              \
        }                                                                                        \
    } while (0)
#else
#define MLA_TRACE_AT(k, i) \
    do {                   \
    } while (0)
#endif

namespace mla {

// ---- tile configuration ---------------------------------------------------------------
// One configuration serves sm_120 and sm_90 (the H200 runs exactly what sm_120 runs). Two
// warp counts: 4 (the streaming configuration: two CTAs per H200 SM, registers at the cap)
// and 8 (one CTA per SM, each warp with half the S and PV work: a tile computes in about
// half the time, for steps whose CTAs each have an SM to themselves).
template <int kWarps_, int kMTiles_ = 1>
struct TileConfig {
    static constexpr int kMTiles = kMTiles_;          // m16 MMA tiles of query rows per CTA
    static constexpr int kBlockM = 16 * kMTiles;      // query rows (heads x q_len) per CTA
    // Q: staged in shared memory (ldmatrix) with one m-tile; with two, the Q tile does not
    // fit 99 KB beside the stages, and each thread loads its fragments from global memory.
    static constexpr bool kQInSmem = kMTiles == 1;
    static constexpr int kBlockN = 32;   // cache rows per pipeline stage
    static constexpr int kStages = 2;
    static constexpr int kWarps = kWarps_;
    static constexpr int kThreads = kWarps * 32;
    // S = Q K^T: warps split the tile's rows (kSplitN) and the 576 dims (kSplitK)
    static constexpr int kSplitN = 2;
    static constexpr int kSplitK = kWarps / kSplitN;
    static constexpr int kSNTiles = kBlockN / 8 / kSplitN;       // n8 tiles of S per warp
    static constexpr int kSKSteps = kHeadDim / 16 / kSplitK;     // k16 steps per warp
    // O += P V: warps split the 512 output dims
    static constexpr int kODims = kLatentDim / kWarps;           // 128 or 64
    static constexpr int kONTiles = kODims / 8;                  // 16 or 8
    static constexpr int kRowsPerWarp = kBlockN / kWarps;        // tile rows each warp loads
    // shared memory
    static constexpr int kKvStageBytes = kBlockN * kRowBytes;    // 36,864
    static constexpr int kQBytes = kQInSmem ? kBlockM * kRowBytes : 0;  // 18,432
    static constexpr int kPartialBytes = kWarps * kMTiles * kSNTiles * 32 * 16;
    static constexpr int kValidBytes = kStages * kBlockN * 4;
    static constexpr int kSmemBytes = kStages * kKvStageBytes + kQBytes + kPartialBytes + kValidBytes;

    static_assert(kWarps == 4 || kWarps == 8, "warp counts the S reduction handles");
    static_assert(kMTiles == 1 || (kMTiles == 2 && kWarps == 8), "two m-tiles only with 8 warps");
    static_assert(kSplitN * kSplitK == kWarps, "warp split");
    static_assert(kSKSteps * 16 * kSplitK == kHeadDim, "k split");
    static_assert(kSNTiles == 2, "S code handles two n8 tiles per warp (one ldmatrix.x4)");
    static_assert(kBlockN % 16 == 0 && kBlockN / 8 == 4, "softmax/PV code assumes 32-row tiles");
    static_assert(kONTiles % 2 == 0, "PV loads two n8 tiles per ldmatrix");
    static_assert(kSmemBytes <= kSm120SmemPerBlock, "tile configuration exceeds sm_120's 99 KB per block");
    static_assert(kSmemBytes + 1024 <= kSm120SmemPerSm, "one CTA must fit an sm_120 SM");
};
using Cfg = TileConfig<4>;   // the shared constants (block sizes) and the streaming configuration
using Cfg8 = TileConfig<8>;
using CfgWide = TileConfig<8, 2>;  // 32 query rows per CTA: many heads
constexpr int kTileShift = 5;  // log2(kBlockN)
static_assert((1 << kTileShift) == Cfg::kBlockN, "tile shift");
constexpr int kMinChunkTiles = 2;  // a part streams at least this many tiles

// ---- the split, derived in every CTA from the lengths ---------------------------------
// Request b has len(b) = clamp(lens[b], 0, max_len) cache rows (max_len when lens is NULL)
// and tiles(b) = max(1, ceil(len(b) / 32)) tiles. The T tiles of all requests are cut into
// parts of chunk = max(ceil(T / num_parts), min_chunk) tiles. A request covered by
// more than one part is "split": its pieces go to the workspace and combine_kernel merges
// them; a split request contains a part boundary, so there are at most
// min(parts - 1, batch) of them.
__host__ __device__ inline int max_splits(int batch, int parts) {
    const int m = parts - 1 < batch ? parts - 1 : batch;
    return m > 1 ? m : 1;
}
// parts: a FastDiv of num_parts (the division is on every CTA's critical path).
__host__ __device__ __forceinline__ int split_chunk(int total, const FastDiv& parts, int min_chunk) {
    const int q = parts.div(total);
    const int chunk = q + (total != q * parts.d ? 1 : 0);  // no total + parts overflow
    return chunk > min_chunk ? chunk : min_chunk;
}
// First tile of `part` (int64: part * chunk may pass INT_MAX), or total if it has none.
__device__ __forceinline__ int part_lo(int part, int chunk, int total) {
    const int64_t lo = static_cast<int64_t>(part) * chunk;
    return lo < total ? static_cast<int>(lo) : total;
}

struct Lens {
    const int32_t* p;  // NULL: every request has max_len rows
    int max_len;
    __device__ int raw(int b) const { return p ? p[b] : max_len; }
    __device__ static int clamp(int raw, int max_len) { return min(max(raw, 0), max_len); }
    __host__ __device__ static int tiles_of(int len) {
        const int t = (len + Cfg::kBlockN - 1) >> kTileShift;
        return t > 1 ? t : 1;
    }
    __device__ int len(int b) const { return clamp(raw(b), max_len); }
    __device__ int tiles(int b) const { return tiles_of(len(b)); }
    // tiles(b) (p != NULL), recording a negative or too-large length in flag when record.
    __device__ int tiles_checked(int b, bool record, uint32_t* flag) const {
        const int r = p[b];
        if (record && r < 0) record_fault(flag, MLA_FAULT_NEGATIVE_SEQ_LEN, b, r);
        if (record && r > max_len) record_fault(flag, MLA_FAULT_SEQ_LEN_TOO_LARGE, b, r);
        return tiles_of(clamp(r, max_len));
    }
};

// ---- arguments of the decode family ------------------------------------------------------
struct DecodeArgs {
    const uint8_t* q_nope;
    const uint8_t* q_rope;
    int64_t qn_ts, qn_hs, qr_ts, qr_hs;  // element strides
    const uint8_t* cache;
    int64_t block_stride;  // bytes
    int32_t num_blocks;
    int32_t block_size;    // a power of two
    int32_t block_shift;   // log2(block_size)
    const int32_t* table;  // dense: block table; sparse: indices
    int32_t table_stride;
    int32_t table_cols;    // dense: max_blocks_per_seq; sparse: topk
    int32_t batch;
    int32_t num_parts;
    int32_t min_chunk;     // fewest tiles per part (mla_schedule_internal_t::min_chunk)
    int32_t q_len;         // dense q_len; sparse 1
    int32_t num_heads;
    int32_t m_rows;        // q_len * num_heads
    uint8_t* out;
    int64_t out_ts, out_hs;
    float* lse;
    int64_t lse_ts, lse_hs;
    float scale_log2;      // softmax_scale * log2(e)
    const int32_t* lens;   // dense: seq_lens; sparse: topk_len (may be NULL)
    int32_t max_len;       // dense: max_blocks_per_seq * block_size; sparse: topk
    int32_t check_lens;    // record negative / too-large lengths (dense)
    float* ws_o;           // [2*parts, m_rows, 512]
    float* ws_lse;         // [2*parts, m_rows], log2 domain
    uint32_t* flag;
    int32_t pdl;           // MLA_PDL_* bits (mla_schedule_internal_t::pdl)
    int32_t combine_rows;  // query rows per combine CTA: 1 (8 warps per row) or 8 (a warp per row)
    // Divisions prepared on the host: by num_parts and num_heads; and without lengths (every
    // request has max_len rows: the closed form) the tiles per request, the total and the chunk.
    FastDiv parts_div;
    FastDiv heads_div;     // num_heads (dense query row m -> query position m / num_heads)
    FastDiv closed_tiles;  // tiles_of(max_len)
    FastDiv closed_chunk;  // split_chunk(batch * tiles_of(max_len), ...)
    int32_t closed_total;
};

// Inclusive sum over the CTA's kThreads threads (every thread calls it); scratch holds
// kThreads / 32 ints. Returns the inclusive prefix; *total gets the CTA's sum.
template <int kThreads>
__device__ __forceinline__ int block_inclusive_sum(int v, int* scratch, int* total) {
    constexpr int kW = kThreads / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += u;
    }
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    int before = 0, sum = 0;
#pragma unroll
    for (int w = 0; w < kW; ++w) {
        const int t = scratch[w];
        before += w < warp ? t : 0;
        sum += t;
    }
    __syncthreads();  // scratch is reused by the next call
    *total = sum;
    return v + before;
}

// Total tiles of all requests (every thread calls it; coalesced loads of the lengths).
// With record, a negative or too-large length records a fault.
template <int kThreads>
__device__ __forceinline__ int total_tiles(const DecodeArgs& a, const Lens& lens, bool record, int* scratch) {
    if (lens.p == nullptr) return a.batch * Lens::tiles_of(lens.max_len);
    int sum = 0;
    for (int b = threadIdx.x; b < a.batch; b += kThreads) sum += lens.tiles_checked(b, record, a.flag);
    int total;
    block_inclusive_sum<kThreads>(sum, scratch, &total);
    return total;
}

// Walks the requests kThreads at a time (a block scan each, in request order): every
// thread calls f(valid, b, first tile of b, tiles of b) for request b = base + thread
// (valid: b < batch; f may itself call block-wide functions) until some thread's f
// returns true; returns whether one did. Every thread calls it.
template <int kThreads, typename F>
__device__ __forceinline__ bool scan_requests(const DecodeArgs& a, const Lens& lens, int* scratch, F f) {
    int carry = 0;
    for (int base = 0; base < a.batch; base += kThreads) {
        const int b = base + threadIdx.x;
        const bool valid = b < a.batch;
        const int t = valid ? lens.tiles(b) : 0;
        int sum;
        const int incl = block_inclusive_sum<kThreads>(t, scratch, &sum);
        const bool hit = f(valid, b, carry + incl - t, t);
        if (__syncthreads_or(hit)) return true;
        carry += sum;
    }
    return false;
}

// Where this CTA's part starts: its tiles [lo, hi) of the split, and the request and tile
// of lo (every thread calls it; valid only when lo < total). One request per thread and a
// single block scan when batch <= kThreads (the common case), else a pass for the total and
// a walk over the requests; a closed form when lens is NULL.
struct PartPos {
    int total, lo, hi, first_req, first_j;
};

template <int kThreads>
__device__ __forceinline__ PartPos find_part(const DecodeArgs& a, const Lens& lens, int part, bool record,
                                             int* scratch) {
    PartPos p;
    int chunk;
    if (lens.p == nullptr) {  // everything but the part's position was computed on the host
        p.total = a.closed_total;
        p.lo = part_lo(part, a.closed_chunk.d, p.total);
        p.first_req = a.closed_tiles.div(p.lo);
        p.first_j = p.lo - p.first_req * a.closed_tiles.d;
        p.hi = p.lo + min(a.closed_chunk.d, p.total - p.lo);
        return p;
    } else if (a.batch <= kThreads) {
        const int b = threadIdx.x;
        const int t = b < a.batch ? lens.tiles_checked(b, record, a.flag) : 0;
        const int incl = block_inclusive_sum<kThreads>(t, scratch, &p.total);
        chunk = split_chunk(p.total, a.parts_div, a.min_chunk);
        p.lo = part_lo(part, chunk, p.total);
        if (b < a.batch && incl - t <= p.lo && p.lo < incl) {
            scratch[32] = b;
            scratch[33] = p.lo - (incl - t);
        }
        __syncthreads();
        p.first_req = scratch[32];
        p.first_j = scratch[33];
        __syncthreads();  // the caller reuses scratch
    } else {
        p.total = total_tiles<kThreads>(a, lens, record, scratch);
        chunk = split_chunk(p.total, a.parts_div, a.min_chunk);
        p.lo = part_lo(part, chunk, p.total);
        p.first_req = p.first_j = 0;
        if (p.lo < p.total) {
            const int lo = p.lo;
            scan_requests<kThreads>(a, lens, scratch, [&](bool valid, int b, int start, int t) {
                const bool mine = valid && start <= lo && lo < start + t;
                if (mine) {
                    scratch[32] = b;
                    scratch[33] = lo - start;
                }
                return mine;
            });
            p.first_req = scratch[32];
            p.first_j = scratch[33];
            __syncthreads();
        }
    }
    p.hi = p.lo + min(chunk, p.total - p.lo);
    return p;
}

// The k-th split request in request order (as decode splits them): into found[0..4)
// {request, first part, last part, 1 if it is not its first part's first request};
// false if there are at most k. Every thread calls it; scratch holds 2 * kThreads / 32 ints.
template <int kThreads>
__device__ __forceinline__ bool find_split(const DecodeArgs& a, const Lens& lens, int k, int* scratch, int* found) {
    constexpr int kW = kThreads / 32;
    // first and last part of request b (tiles [start, start + t)): a FastDiv when the chunk
    // is known on the host (closed form), else an unsigned division
    auto part_of = [&](int tile, int chunk) {
        return lens.p == nullptr ? a.closed_chunk.div(tile)
                                 : static_cast<int>(static_cast<uint32_t>(tile) / static_cast<uint32_t>(chunk));
    };
    auto check = [&](bool valid, int b, int start, int t, int chunk, int& count) {
        const int first = part_of(start, chunk), last = part_of(start + t - 1, chunk);
        const int split = valid && first != last ? 1 : 0;
        int n;
        const int idx = count + block_inclusive_sum<kThreads>(split, scratch + kW, &n) - split;
        count += n;
        const bool mine = split && idx == k;
        if (mine) {
            found[0] = b;
            found[1] = first;
            found[2] = last;
            found[3] = start != first * chunk ? 1 : 0;
        }
        return mine;
    };
    int count = 0;
    if (a.batch <= kThreads) {  // one request per thread: a scan for the tiles, one for the splits
        const int b = threadIdx.x;
        const bool valid = b < a.batch;
        const int t = valid ? lens.tiles(b) : 0;
        int total;
        const int incl = block_inclusive_sum<kThreads>(t, scratch, &total);
        const int chunk = lens.p == nullptr ? a.closed_chunk.d : split_chunk(total, a.parts_div, a.min_chunk);
        return __syncthreads_or(check(valid, b, incl - t, t, chunk, count));
    }
    const int chunk = lens.p == nullptr ? a.closed_chunk.d
                                        : split_chunk(total_tiles<kThreads>(a, lens, false, scratch), a.parts_div, a.min_chunk);
    return scan_requests<kThreads>(a, lens, scratch, [&](bool valid, int b, int start, int t) {
        return check(valid, b, start, t, chunk, count);
    });
}

// Position of a tile in the flattened schedule.
struct Cursor {
    int b;    // request
    int j;    // tile within the request
    int len;  // clamped length of request b
    __device__ int ntiles() const { return Lens::tiles_of(len); }
    __device__ void advance(const Lens& lens) {
        if (++j == ntiles()) {  // every request has >= 1 tile
            ++b;
            j = 0;
            len = lens.len(b);
        }
    }
};

// Query row m of request b: the token index and head.
template <bool kSparse>
__device__ __forceinline__ void row_token_head(const DecodeArgs& a, int b, int m, int& token, int& head) {
    if (kSparse) {
        token = b;
        head = m;
    } else {
        const int i = a.heads_div.div(m);
        token = b * a.q_len + i;
        head = m - i * a.num_heads;
    }
}

// The raw table entry behind one tile row, read one iteration before the tile is issued
// so that issuing never waits on a dependent load. Lanes 0..kRowsPerWarp-1 of each warp
// own row warp*kRowsPerWarp+lane. The column is clamped into the table row; the length
// check is done at issue time (against the cursor's length).
struct RowRaw {
    int entry;  // block-table entry (dense) or slot id (sparse)
};

template <typename C, bool kSparse>
__device__ __forceinline__ RowRaw resolve_row(const DecodeArgs& a, const Cursor& c) {
    RowRaw rr{0};
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane < C::kRowsPerWarp) {
        const int pos = (c.j << kTileShift) + warp * C::kRowsPerWarp + lane;
        const int col = min(kSparse ? pos : pos >> a.block_shift, a.table_cols - 1);
        rr.entry = a.table[static_cast<int64_t>(c.b) * a.table_stride + col];
    }
    return rr;
}

// Issue the cp.async loads of one tile. Lanes 0..kRowsPerWarp-1 turn their row's raw
// entry into a byte offset (-1: invalid row, zero-filled and never read) and record a
// fault; then the warp streams its rows, lane l copying chunks l, l+32 and l+64 of
// each row (one shuffle per row, no division).
template <typename C, bool kSparse>
__device__ __forceinline__ void load_tile(const DecodeArgs& a, const Cursor& c, const RowRaw& rr, uint8_t* kv_stage,
                                          int32_t* valid_stage) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int64_t off = -1;
    if (lane < C::kRowsPerWarp) {
        const int r = warp * C::kRowsPerWarp + lane;
        const int pos = (c.j << kTileShift) + r;
        if (pos < c.len) {
            const int bmask = a.block_size - 1;
            if (kSparse) {
                const int id = rr.entry;
                if (id >= 0 && (id >> a.block_shift) < a.num_blocks) {
                    off = (id >> a.block_shift) * a.block_stride + static_cast<int64_t>(id & bmask) * kRowBytes;
                } else if (id != -1) {
                    record_fault(a.flag, MLA_FAULT_BAD_SLOT_ID, c.b, id);
                }
            } else {
                const int e = rr.entry;
                if (e >= 0 && e < a.num_blocks) {
                    off = e * a.block_stride + static_cast<int64_t>(pos & bmask) * kRowBytes;
                } else {
                    record_fault(a.flag, MLA_FAULT_BAD_BLOCK_ID, c.b, e);
                }
            }
        }
        valid_stage[r] = off >= 0;
    }
    const uint32_t kv_base = smem_u32(kv_stage);
#pragma unroll
    for (int i = 0; i < C::kRowsPerWarp; ++i) {
        const int64_t roff = __shfl_sync(0xffffffffu, off, i);
        const int row = warp * C::kRowsPerWarp + i;
        const int bytes = roff >= 0 ? 16 : 0;
        const uint8_t* src = a.cache + (roff >= 0 ? roff : 0) + lane * 16;
        const uint32_t dst = kv_base + row * kRowBytes;
        const int x = row & 7;
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            const int ch = lane + 32 * k;
            if (k < 2 || ch < kRowChunks) cp_async_16(dst + ((ch ^ x) << 4), src + k * 512, bytes);
        }
    }
}

// At a segment start: the query rows of the tile's request into q_s (zero past m_rows),
// in the same cp.async group as the tile.
template <typename C, bool kSparse>
__device__ __forceinline__ void load_q_smem(const DecodeArgs& a, int b, int m_tile, uint8_t* q_s) {
    const uint32_t q_base = smem_u32(q_s);
    // Warp w copies rows w*kRows.., one row at a time as load_tile does: the row's source
    // addresses once per warp, then lane l copies chunks l and l+32 of the 64 nope chunks
    // and lanes 0..7 the 8 rope chunks. The thread index is read opaquely: the compiler
    // recomputes these addresses here instead of keeping them live through the main loop
    // (which runs at the register limit).
    int tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    const int lane = tid & 31, warp = tid >> 5;
    constexpr int kRows = C::kBlockM / C::kWarps;
    static_assert(kRows * C::kWarps == C::kBlockM && kRowChunks == 72, "rows split evenly over warps, 64 + 8 chunks");
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const int r = warp * kRows + i;
        const int m = m_tile * C::kBlockM + r;
        const uint8_t* qn = a.q_nope;
        const uint8_t* qr = a.q_rope;
        int bytes = 0;
        if (m < a.m_rows) {
            int token, head;
            row_token_head<kSparse>(a, b, m, token, head);
            qn += (token * a.qn_ts + head * a.qn_hs) * 2;
            qr += (token * a.qr_ts + head * a.qr_hs) * 2;
            bytes = 16;
        }
        const uint32_t dst = q_base + r * kRowBytes;
        const int x = r & 7;
        cp_async_16(dst + ((lane ^ x) << 4), qn + lane * 16, bytes);
        cp_async_16(dst + (((lane + 32) ^ x) << 4), qn + (lane + 32) * 16, bytes);
        if (lane < 8) cp_async_16(dst + (((lane + 64) ^ x) << 4), qr + lane * 16, bytes);
    }
}

// At a segment start without a Q tile in shared memory: this thread's A fragments of
// m-tile mt (rows g, g+8; k16 steps kh*kSKSteps..) straight from global memory, the layout
// ldmatrix would give (zero past m_rows).
template <typename C, bool kSparse>
__device__ __forceinline__ void load_q_frags(const DecodeArgs& a, int b, int m_tile, int kh,
                                             uint32_t (&qf)[C::kMTiles][C::kSKSteps][4]) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int m = m_tile * C::kBlockM + mt * 16 + g + 8 * hf;
            const uint8_t* qn = nullptr;
            const uint8_t* qr = nullptr;
            if (m < a.m_rows) {
                int token, head;
                row_token_head<kSparse>(a, b, m, token, head);
                qn = a.q_nope + (token * a.qn_ts + head * a.qn_hs) * 2;
                qr = a.q_rope + (token * a.qr_ts + head * a.qr_hs) * 2;
            }
#pragma unroll
            for (int ks = 0; ks < C::kSKSteps; ++ks) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {  // cols (kk*16 + 8c + 2tq, +1)
                    const int col = (kh * C::kSKSteps + ks) * 16 + 8 * c + 2 * tq;
                    uint32_t v = 0;
                    if (qn != nullptr) {
                        v = col < kLatentDim ? *reinterpret_cast<const uint32_t*>(qn + col * 2)
                                             : *reinterpret_cast<const uint32_t*>(qr + (col - kLatentDim) * 2);
                    }
                    qf[mt][ks][hf + 2 * c] = v;
                }
            }
        }
    }
}

template <typename T, bool kSparse, typename C>
__global__ void __launch_bounds__(C::kThreads, 1) decode_kernel(const DecodeArgs a) {
    MLA_TRACE_AT(0, 0);
    grid_dependency_wait();
    MLA_TRACE_AT(0, 1);
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t* kv_s = smem;
    uint8_t* q_s = smem + C::kStages * C::kKvStageBytes;
    float4* part_s = reinterpret_cast<float4*>(q_s + C::kQBytes);
    int32_t* valid_s = reinterpret_cast<int32_t*>(reinterpret_cast<uint8_t*>(part_s) + C::kPartialBytes);

    const Lens lens{a.lens, a.max_len};
    const int m_tile = blockIdx.x;
    const int part = blockIdx.y;
    // This part's tiles [lo, hi) and its first request and tile, from the lengths.
    int* scratch = reinterpret_cast<int*>(part_s);  // free until the first tile is computed
    const PartPos pp =
        find_part<C::kThreads>(a, lens, part, a.check_lens && blockIdx.x == 0 && blockIdx.y == 0, scratch);
    MLA_TRACE_AT(0, 2);
    if (pp.lo >= pp.total) return;
    const int lo = pp.lo, hi = pp.hi, first_req = pp.first_req, first_j = pp.first_j;
    if (a.pdl & MLA_PDL_TRIGGER_AT_START) grid_dependents_launch();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int mat = lane >> 3, mrow = lane & 7;
    const int nh = warp % C::kSplitN, kh = warp / C::kSplitN;

    // Two tiles in flight while the CTA waits: tile x+2 is issued into tile x's stage as
    // soon as tile x is computed, so at the wait for x+1, x+2 is already loading. Its Q
    // rows would overwrite q_s before x+1 read them when x+1 and x+2 both start segments;
    // then x+2 is issued at the top of iteration x+1 instead (after the Q read), as is the
    // first tile of a part's second segment. `ahead`: tile x+1's group is already committed.
    Cursor cc{first_req, first_j, lens.len(first_req)};
    load_tile<C, kSparse>(a, cc, resolve_row<C, kSparse>(a, cc), kv_s, valid_s);
    if constexpr (C::kQInSmem) load_q_smem<C, kSparse>(a, cc.b, m_tile, q_s);
    cp_async_commit();
    Cursor nc = cc;  // the next tile, its rows resolved one iteration ahead
    RowRaw nraw{0};
    bool ahead = false;
    if (lo + 1 < hi) {
        nc.advance(lens);
        nraw = resolve_row<C, kSparse>(a, nc);
        if (nc.j != 0) {  // same segment: no Q to load
            load_tile<C, kSparse>(a, nc, nraw, kv_s + C::kKvStageBytes, valid_s + C::kBlockN);
            cp_async_commit();
            ahead = true;
        }
    }

    constexpr int kMT = C::kMTiles;
    float o[kMT][C::kONTiles][4];
    float m_run[kMT][2], l_run[kMT][2];
    uint32_t qf[kMT][C::kSKSteps][4];
    int seg_j0 = cc.j;
    bool seg_start = true;

    for (int x = lo; x < hi; ++x) {
        const int stage = (x - lo) & 1;
        uint8_t* kv_cur = kv_s + stage * C::kKvStageBytes;
        const int32_t* valid_cur = valid_s + stage * C::kBlockN;
        if (ahead) {
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (x == lo) MLA_TRACE_AT(0, 3);
        if (x + 1 == hi) MLA_TRACE_AT(0, 4);
        // Every trigger must come after this CTA's grid_dependency_wait(): combine_kernel
        // reads the lengths before its own wait, relying on that.
        if ((a.pdl & MLA_PDL_TRIGGER_AT_LAST_TILE) && x + 1 == hi) grid_dependents_launch();

        if (seg_start) {
            if constexpr (C::kQInSmem) {
                const uint32_t q_base = smem_u32(q_s);
#pragma unroll
                for (int ks = 0; ks < C::kSKSteps; ++ks) {
                    const int kk = kh * C::kSKSteps + ks;
                    ldmatrix_x4(qf[0][ks], q_base + swz((mat & 1) * 8 + mrow, kk * 2 + (mat >> 1)) * 16);
                }
            } else {
                load_q_frags<C, kSparse>(a, cc.b, m_tile, kh, qf);
            }
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    m_run[mt][hf] = -INFINITY;
                    l_run[mt][hf] = 0.f;
                }
#pragma unroll
                for (int n = 0; n < C::kONTiles; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
            }
            seg_j0 = cc.j;
        }

        // Tile x+1, unless already issued, into the other stage (freed by the barrier
        // above); the table entries of tile x+2, issued at the end of this iteration.
        Cursor n2 = nc;
        RowRaw n2raw{0};
        const bool next_seg = x + 1 < hi && nc.j == 0;
        if (x + 1 < hi && !ahead) {
            if (C::kQInSmem && seg_start && next_seg) __syncthreads();  // q_s was just read: let every warp finish
            load_tile<C, kSparse>(a, nc, nraw, kv_s + (stage ^ 1) * C::kKvStageBytes, valid_s + (stage ^ 1) * C::kBlockN);
            if (C::kQInSmem && next_seg) load_q_smem<C, kSparse>(a, nc.b, m_tile, q_s);
            cp_async_commit();
        }
        if (x + 2 < hi) {
            n2.advance(lens);
            n2raw = resolve_row<C, kSparse>(a, n2);
        }

        // ---- S = Q K^T: this warp's 16 rows x 16 cache rows over its 288 dims ----
        const uint32_t kv_base = smem_u32(kv_cur);
        {
            // two accumulator parities per (m-tile, n8 tile) with one m-tile (shorter chains),
            // one with two (the two m-tiles already interleave)
            constexpr int kPar = kMT == 1 ? 2 : 1;
            float sacc[kMT][2][kPar][4];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int par = 0; par < kPar; ++par)
                        sacc[mt][n][par][0] = sacc[mt][n][par][1] = sacc[mt][n][par][2] = sacc[mt][n][par][3] = 0.f;
            const int krow = nh * 16 + (mat >> 1) * 8 + mrow;
#pragma unroll
            for (int ks = 0; ks < C::kSKSteps; ++ks) {
                const int kk = kh * C::kSKSteps + ks;
                uint32_t bfr[4];
                ldmatrix_x4(bfr, kv_base + swz(krow, kk * 2 + (mat & 1)) * 16);
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    mma16816<T>(sacc[mt][0][ks % kPar], qf[mt][ks], bfr[0], bfr[1]);
                    mma16816<T>(sacc[mt][1][ks % kPar], qf[mt][ks], bfr[2], bfr[3]);
                }
            }
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    float4 v = make_float4(sacc[mt][n][0][0], sacc[mt][n][0][1], sacc[mt][n][0][2], sacc[mt][n][0][3]);
                    if constexpr (kPar == 2) {
                        v.x += sacc[mt][n][1][0];
                        v.y += sacc[mt][n][1][1];
                        v.z += sacc[mt][n][1][2];
                        v.w += sacc[mt][n][1][3];
                    }
                    part_s[((warp * kMT + mt) * 2 + n) * 32 + lane] = v;
                }
        }
        __syncthreads();
        if constexpr (C::kSplitK == 4) {
            // Sum the four k-quarter partials in place: a unit is one half (rows g or g+8) of
            // one (n-half, m-tile, n8 tile) fragment; warp w adds up units w, w+8, ...,
            // quarters in order, into quarter 0's slot.
#pragma unroll
            for (int u = warp; u < 2 * 2 * kMT * 2; u += C::kWarps) {
                const int h = u & 1, n = (u >> 1) & 1, mt = (u >> 2) % kMT, nhu = (u >> 2) / kMT;
                float2* p = reinterpret_cast<float2*>(part_s + ((nhu * kMT + mt) * 2 + n) * 32 + lane) + h;
                float2 acc = *p;
#pragma unroll
                for (int q = 1; q < 4; ++q) {
                    // warp nhu + q*kSplitN, same m-tile and n8 tile
                    const float2 u2 = *(p + q * C::kSplitN * kMT * 2 * 32 * 2);
                    acc.x += u2.x;
                    acc.y += u2.y;
                }
                *p = acc;
            }
            __syncthreads();
        }
        if (x == lo) MLA_TRACE_AT(0, 6);

        // ---- full S (every warp, same order: identical in all warps), mask, online softmax ----
        float s[kMT][4][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int jn = 0; jn < 4; ++jn) {
                const int nhj = jn >> 1, ntl = jn & 1;
                const float4 p0 = part_s[((nhj * kMT + mt) * 2 + ntl) * 32 + lane];
                if constexpr (C::kSplitK == 2) {
                    const float4 p1 = part_s[(((nhj + C::kSplitN) * kMT + mt) * 2 + ntl) * 32 + lane];
                    s[mt][jn][0] = p0.x + p1.x;
                    s[mt][jn][1] = p0.y + p1.y;
                    s[mt][jn][2] = p0.z + p1.z;
                    s[mt][jn][3] = p0.w + p1.w;
                } else {
                    s[mt][jn][0] = p0.x;
                    s[mt][jn][1] = p0.y;
                    s[mt][jn][2] = p0.z;
                    s[mt][jn][3] = p0.w;
                }
            }
        const int pos0 = cc.j << kTileShift;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            float alpha[2];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                // Causal limit of query row m (dense MTP): position i of q_len sees cache rows
                // < len - q_len + i + 1 (recomputed per tile: no registers held across the loop).
                const int row_lim =
                    kSparse ? 0x7fffffff
                            : cc.len - a.q_len + 1 + (m_tile * C::kBlockM + mt * 16 + g + 8 * hf) / a.num_heads;
                float mx = -INFINITY;
#pragma unroll
                for (int jn = 0; jn < 4; ++jn)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = jn * 8 + 2 * tq + e;
                        const bool ok = valid_cur[col] != 0 && pos0 + col < row_lim;
                        const float v = ok ? s[mt][jn][hf * 2 + e] * a.scale_log2 : -INFINITY;
                        s[mt][jn][hf * 2 + e] = v;
                        mx = fmaxf(mx, v);
                    }
                mx = warp_max4(mx);
                const float m_new = fmaxf(m_run[mt][hf], mx);
                const float base = (m_new == -INFINITY) ? 0.f : m_new;
                alpha[hf] = fast_exp2(m_run[mt][hf] - base);  // m_run = -inf -> 0
                float sum = 0.f;
#pragma unroll
                for (int jn = 0; jn < 4; ++jn)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float pe = fast_exp2(s[mt][jn][hf * 2 + e] - base);
                        s[mt][jn][hf * 2 + e] = pe;
                        sum += pe;
                    }
                l_run[mt][hf] = l_run[mt][hf] * alpha[hf] + sum;
                m_run[mt][hf] = m_new;
            }
            if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // the running max moved
#pragma unroll
                for (int n = 0; n < C::kONTiles; ++n) {
                    o[mt][n][0] *= alpha[0];
                    o[mt][n][1] *= alpha[0];
                    o[mt][n][2] *= alpha[1];
                    o[mt][n][3] *= alpha[1];
                }
            }
        }

        // ---- O += P V over this warp's output dims (each V fragment serves every m-tile) ----
#pragma unroll
        for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
            uint32_t pa[kMT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                pa[mt][0] = Elem<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = Elem<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = Elem<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = Elem<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
            const int vrow = kk * 16 + (mat & 1) * 8 + mrow;
#pragma unroll
            for (int pr = 0; pr < C::kONTiles / 2; ++pr) {
                uint32_t bfr[4];
                ldmatrix_x4_trans(bfr, kv_base + swz(vrow, (warp * C::kODims + pr * 16) / 8 + (mat >> 1)) * 16);
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    mma16816<T>(o[mt][2 * pr], pa[mt], bfr[0], bfr[1]);
                    mma16816<T>(o[mt][2 * pr + 1], pa[mt], bfr[2], bfr[3]);
                }
            }
        }

        if (x == lo) MLA_TRACE_AT(0, 7);
        // ---- end of a segment: normalize and write ----
        const bool seg_end = (x + 1 == hi) || (cc.j + 1 == cc.ntiles());
        if (seg_end) {
            const bool whole = (seg_j0 == 0) && (cc.j + 1 == cc.ntiles());
            const int slot = 2 * part + (cc.b == first_req ? 0 : 1);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const float l = warp_sum4(l_run[mt][hf]);
                    const float inv = l > 0.f ? fast_rcp(l) : 0.f;
                    const float lse2 = l > 0.f ? m_run[mt][hf] + fast_log2(l) : -INFINITY;
                    const int m = m_tile * C::kBlockM + mt * 16 + g + 8 * hf;
                    if (m < a.m_rows) {
                        if (whole) {
                            int token, head;
                            row_token_head<kSparse>(a, cc.b, m, token, head);
                            T* dst = reinterpret_cast<T*>(a.out) + token * a.out_ts + head * a.out_hs + warp * C::kODims + 2 * tq;
#pragma unroll
                            for (int n = 0; n < C::kONTiles; ++n) {
                                *reinterpret_cast<uint32_t*>(dst + n * 8) =
                                    Elem<T>::pack(o[mt][n][2 * hf] * inv, o[mt][n][2 * hf + 1] * inv);
                            }
                            if (warp == 0 && tq == 0 && a.lse != nullptr) {
                                a.lse[token * a.lse_ts + head * a.lse_hs] = lse2 * kLn2;
                            }
                        } else {
                            const size_t row = static_cast<size_t>(slot) * a.m_rows + m;
                            float* dst = a.ws_o + row * kLatentDim + warp * C::kODims + 2 * tq;
#pragma unroll
                            for (int n = 0; n < C::kONTiles; ++n) {
                                *reinterpret_cast<float2*>(dst + n * 8) =
                                    make_float2(o[mt][n][2 * hf] * inv, o[mt][n][2 * hf + 1] * inv);
                            }
                            if (warp == 0 && tq == 0) a.ws_lse[row] = lse2;
                        }
                    }
                }
        }
        // Tile x+2 into this stage once every warp is done with it (and with q_s).
        bool ahead_next = false;
        if (x + 2 < hi && !(C::kQInSmem && next_seg && n2.j == 0)) {
            __syncthreads();
            load_tile<C, kSparse>(a, n2, n2raw, kv_cur, valid_s + stage * C::kBlockN);
            if (C::kQInSmem && n2.j == 0) load_q_smem<C, kSparse>(a, n2.b, m_tile, q_s);
            cp_async_commit();
            ahead_next = true;
        }
        cc = nc;
        nc = n2;
        nraw = n2raw;
        seg_start = next_seg;
        ahead = ahead_next;
    }
    cp_async_wait<0>();
    MLA_TRACE_AT(0, 5);
}

// The combine splits the 512 output dims of a row into slices (grid z), so that the piece
// reads of a step with few split rows (b=1, t=1: 8 rows) spread over more SMs: a lane
// holds kF4 float4 (4 * kF4 dims) of its warp's slice of 128 * kF4 dims.

// Writes merged row m of request r: lane's dims [dim0 + lane*4*kF4, +4*kF4) of acc / wsum,
// and lse (lane 0 of the slice at dim 0).
template <typename T, bool kSparse, int kF4>
__device__ __forceinline__ void store_merged_row(const DecodeArgs& a, int r, int m, int dim0,
                                                 const float (&acc)[4 * kF4], float mx, float wsum) {
    const int lane = threadIdx.x & 31;
    const float inv = wsum > 0.f ? fast_rcp(wsum) : 0.f;
    int token, head;
    row_token_head<kSparse>(a, r, m, token, head);
    T* dst = reinterpret_cast<T*>(a.out) + token * a.out_ts + head * a.out_hs + dim0 + lane * 4 * kF4;
    uint32_t pw[2 * kF4];
#pragma unroll
    for (int i = 0; i < 2 * kF4; ++i) pw[i] = Elem<T>::pack(acc[2 * i] * inv, acc[2 * i + 1] * inv);
    if constexpr (kF4 == 1) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(pw[0], pw[1]);
    } else {
#pragma unroll
        for (int i = 0; i < kF4 / 2; ++i)
            reinterpret_cast<uint4*>(dst)[i] = make_uint4(pw[4 * i], pw[4 * i + 1], pw[4 * i + 2], pw[4 * i + 3]);
    }
    if (lane == 0 && dim0 == 0 && a.lse != nullptr) {
        a.lse[token * a.lse_ts + head * a.lse_hs] = wsum > 0.f ? (mx + fast_log2(wsum)) * kLn2 : -INFINITY;
    }
}

// One warp folds pieces first, first+step, ... <= last of query row m (its slice at dim0)
// into a running (max, weight sum, lane's 4 * kF4 dims): kBatch pieces at a time with all
// their loads in flight (one round trip per batch), in piece order, so the result depends
// only on the data. first_tail: the first piece of the request (piece `req_first`) is in
// slot 2q+1.
template <int kF4>  // 4 (a warp covers 512 dims) or 1 (128 dims)
struct RowFold {
    static constexpr int kBatch = kF4 == 4 ? 8 : 16;
    float mx = -INFINITY;
    float wsum = 0.f;
    float acc[4 * kF4] = {};
};

template <int kF4>
__device__ __forceinline__ void fold_pieces(const DecodeArgs& a, int req_first, int first_tail, int first, int last,
                                            int step, int m, int dim0, RowFold<kF4>& f) {
    constexpr int kBatch = RowFold<kF4>::kBatch;
    const int lane = threadIdx.x & 31;
    // Piece q's row is slot 2q (2q + 1 for the request's first piece when first_tail):
    // consecutive pieces of this warp are 2 * step * m_rows rows apart, so a batch's loads
    // are one base address plus constant multiples of that stride.
    const int64_t stride = static_cast<int64_t>(2 * step) * a.m_rows;
#pragma unroll 1
    for (int q0 = first; q0 <= last; q0 += kBatch * step) {
        const int64_t row0 = static_cast<int64_t>(2 * q0 + (q0 == req_first ? first_tail : 0)) * a.m_rows + m;
        const int64_t fix = q0 == req_first ? -static_cast<int64_t>(first_tail) * a.m_rows : 0;  // pieces after the first
        const float* lse0 = a.ws_lse + row0;
        const float4* o0 = reinterpret_cast<const float4*>(a.ws_o + row0 * kLatentDim + dim0 + lane * 4 * kF4);
        float l[kBatch];
        float4 v[kBatch][kF4];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
            const int64_t off = b == 0 ? 0 : b * stride + fix;
            if (q0 + b * step <= last) {
                l[b] = lse0[off];
#pragma unroll
                for (int k = 0; k < kF4; ++k) v[b][k] = o0[off * (kLatentDim / 4) + k];
            } else {
                l[b] = -INFINITY;
#pragma unroll
                for (int k = 0; k < kF4; ++k) v[b][k] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
        float bm = f.mx;
#pragma unroll
        for (int b = 0; b < kBatch; ++b) bm = fmaxf(bm, l[b]);
        if (bm == -INFINITY) continue;  // only empty pieces so far
        const float sc = fast_exp2(f.mx - bm);  // f.mx = -inf: 0
        f.wsum *= sc;
#pragma unroll
        for (int i = 0; i < 4 * kF4; ++i) f.acc[i] *= sc;
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
            const float w = fast_exp2(l[b] - bm);  // empty piece: 0
            f.wsum += w;
#pragma unroll
            for (int k = 0; k < kF4; ++k) {
                f.acc[4 * k + 0] += w * v[b][k].x;
                f.acc[4 * k + 1] += w * v[b][k].y;
                f.acc[4 * k + 2] += w * v[b][k].z;
                f.acc[4 * k + 3] += w * v[b][k].w;
            }
        }
        f.mx = bm;
    }
}

// Merge the pieces of split requests. CTA (k, m, z): the k-th split request (in request
// order; found from the lengths like decode's split), query row m, dims slice z of
// 128 * kF4. Its warps fold every kCombineWarps-th piece, then warp 0 merges the folds in
// warp order: the result does not depend on timing. When the schedule expects few pieces
// per request (combine_rows = 8), CTA (k, g, z) instead merges rows 8g..8g+7, a warp per row
// over all pieces (8x fewer CTAs; ncu showed the kernel's cost growing with its CTA count).
constexpr int kCombineWarps = 8;

template <typename T, bool kSparse, int kF4>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const DecodeArgs a) {
    MLA_TRACE_AT(1, 0);
    __shared__ float red_max[kCombineWarps];
    __shared__ float red_w[kCombineWarps];
    __shared__ float4 red_o[kCombineWarps][32 * kF4];
    __shared__ int scratch[2 * kCombineWarps + 4];  // two scans' warp sums, then the result
    int* found_s = scratch + 2 * kCombineWarps;
    const Lens lens{a.lens, a.max_len};
    const int k = blockIdx.x;
    const int m = blockIdx.y;  // row (combine_rows == 1) or group of combine_rows rows
    const int dim0 = blockIdx.z * 128 * kF4;
    // The k-th split request, in request order, from the lengths (as decode split them).
    // The lengths are inputs, not decode's output: this runs while decode finishes (with
    // PDL every decode CTA has passed its own wait, so whatever wrote them is complete);
    // only the pieces need the wait.
    const bool found = find_split<kCombineWarps * 32>(a, lens, k, scratch, found_s);
    if (!found) return;
    MLA_TRACE_AT(1, 1);
    grid_dependency_wait();
    MLA_TRACE_AT(1, 2);
    const int r = found_s[0], first = found_s[1], last = found_s[2], first_tail = found_s[3];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (a.combine_rows > 1) {  // few pieces per request: warp w merges row m + w alone
        const int mw = m * a.combine_rows + warp;
        if (warp < a.combine_rows && mw < a.m_rows) {
            RowFold<kF4> f;
            fold_pieces<kF4>(a, first, first_tail, first, last, 1, mw, dim0, f);
            store_merged_row<T, kSparse, kF4>(a, r, mw, dim0, f.acc, f.mx, f.wsum);
        }
        MLA_TRACE_AT(1, 3);
        return;
    }
    // Many pieces: warp w folds pieces first+w, first+w+8, ...; then warp 0 merges the
    // warps' folds in warp order.
    {
        RowFold<kF4> f;
        fold_pieces<kF4>(a, first, first_tail, first + warp, last, kCombineWarps, m, dim0, f);
#pragma unroll
        for (int i = 0; i < kF4; ++i)
            red_o[warp][lane * kF4 + i] = make_float4(f.acc[4 * i], f.acc[4 * i + 1], f.acc[4 * i + 2], f.acc[4 * i + 3]);
        if (lane == 0) {
            red_max[warp] = f.mx;
            red_w[warp] = f.wsum;
        }
    }
    __syncthreads();
    if (warp != 0) return;
    float mx = red_max[0];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) mx = fmaxf(mx, red_max[w]);
    float wt = 0.f;
    float sum[4 * kF4] = {};
    if (mx != -INFINITY) {
#pragma unroll
        for (int w = 0; w < kCombineWarps; ++w) {
            const float sc = fast_exp2(red_max[w] - mx);  // an empty warp: 0
            wt += red_w[w] * sc;
#pragma unroll
            for (int i = 0; i < kF4; ++i) {
                const float4 u = red_o[w][lane * kF4 + i];
                sum[4 * i + 0] += sc * u.x;
                sum[4 * i + 1] += sc * u.y;
                sum[4 * i + 2] += sc * u.z;
                sum[4 * i + 3] += sc * u.w;
            }
        }
    }
    store_merged_row<T, kSparse, kF4>(a, r, m, dim0, sum, mx, wt);
    MLA_TRACE_AT(1, 3);
}

}  // namespace mla
