// The split: the one definition of how a decode call's work is cut into parts (used by the
// host, by every decode CTA and by every combine CTA), and of where split pieces go.
//
// Work decomposition (flash-decoding, FlashMLA-style flattened schedule):
//   - A "request" is a dense sequence b (q_len query tokens) or a sparse token t.
//   - Its cache rows are cut into tiles of kBlockN rows; a request with no rows still
//     gets one (fully masked) tile, so that decode_kernel writes its zeros and -inf. All
//     requests' tiles are laid end to end and each of num_parts parts gets `chunk`
//     consecutive tiles, so one part may cover the end of one request and the start of the
//     next. There is no plan buffer: every CTA derives its part from the lengths (find_part).
//     Within requests (MLA_SPLIT_WITHIN_REQUESTS; the default for 16-bit caches at 16 or 32
//     query rows per CTA, config.cuh kWithinKernel): each request gets its own near-equal
//     parts instead, when that takes no part longer than the chunk plus a little slack and
//     no more parts than the grid has (many-head steps whose requests then do not split at
//     all gain 2-6 %: docs/PERFORMANCE.md log #75).
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

#include <stddef.h>

#include "common/constants.cuh"
#include "common/fastdiv.cuh"
#include "common/fault.cuh"
#include "decode/args.cuh"
#include "decode/config.cuh"

namespace mla {

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
// ---- within requests (MLA_SPLIT_WITHIN_REQUESTS) ----------------------------------------
// Request b's tiles(b) = t tiles in n = ceil(t / c) parts, part i its tiles
// [within_lo(i), within_lo(i + 1)) (the first t % n parts one tile more), for the first c of {chunk,
// within_chunk(chunk)} with sum_b ceil(tiles(b) / c) <= num_parts; if neither fits, the flat
// split. Parts are numbered in request order (request b's first is the sum of n over the
// requests before it); the parts after the last one have no tiles. The host allows it for at
// most kWithinMaxBatch requests (one scan in every CTA of either kernel) and parts + batch
// < 2^15 (the two candidates' counts share one 32-bit scan).
constexpr int kWithinMaxBatch = 128;
constexpr int kWithinMaxParts = 1 << 15;
// The longest part the split within requests accepts: the flat chunk plus one tile when parts
// are long enough that a tile is <= ~6 % of them (2.5 % from 80 tiles).
__host__ __device__ __forceinline__ int within_chunk(int chunk) {
    return chunk + (chunk >= 16 ? (chunk >= 80 ? chunk / 40 : 1) : 0);
}
__host__ __device__ __forceinline__ int ceil_div_pos(int x, int d) {  // x, d >= 1
    return static_cast<int>(static_cast<uint32_t>(x - 1) / static_cast<uint32_t>(d)) + 1;
}
// First tile, within its request of t = q n + r tiles in n parts, of part i (0 <= i <= n):
// parts 0..r-1 have q + 1 tiles, the others q.
__host__ __device__ __forceinline__ int within_lo(int i, int q, int r) { return i * q + (i < r ? i : r); }
// The pick from both candidates' counts (packed: c0 in the low 16 bits, c1 in the high; incl:
// the inclusive prefix of this request's pair, sum: the total pair): false where neither fits
// num_parts (flat), else this request's parts (*n) and first part (*first) and the parts used.
__device__ __forceinline__ bool within_pick(int pair, int incl, int sum, int parts, int* n, int* first, int* used) {
    const int s0 = sum & 0xffff, s1 = static_cast<int>(static_cast<uint32_t>(sum) >> 16);
    const int c = s0 <= parts ? 0 : (s1 <= parts ? 16 : -1);
    if (c < 0) return false;
    *n = (pair >> c) & 0xffff;
    *first = ((incl >> c) & 0xffff) - *n;
    *used = c == 0 ? s0 : s1;
    return true;
}
// The pair of counts of a request of t tiles (valid) for within_pick.
__device__ __forceinline__ int within_pair(bool valid, int t, int chunk) {
    return valid ? ceil_div_pos(t, chunk) | (ceil_div_pos(t, within_chunk(chunk)) << 16) : 0;
}

// ---- equal lengths: the aligned chunk -------------------------------------------------
// Where every request has the same t tiles (total = batch * t), the flat chunk becomes
// c = t / n for n = parts / batch >= 1 dividing t (n parts inside every request: log #77), or
// k * t for k = ceil(batch / parts) when parts < batch (parts of k whole requests: log #94),
// when c is at least min_chunk and at most `hi`: no request is then cut off-grid (fewer
// pieces, often none). Written as c = mul * (total / div) with div = batch * n, mul = 1 (the
// division exact only when n divides t), or div = batch, mul = k. One rule for the host's
// closed form (no lengths: prepare_split, hi = the within rule's candidate) and for the
// kernels' flat split with lengths that turn out equal (flat_chunk, hi = one tile more at
// most; sparse topk_len of long contexts, dense batches of one length), on which every
// decode and combine CTA must agree.
struct AlignedForm {
    int div, mul;
};
inline AlignedForm aligned_form(int batch, int parts) {
    const int n = parts / batch;
    return n >= 1 ? AlignedForm{batch * n, 1} : AlignedForm{batch, ceil_div_pos(batch, parts)};
}
// The chunk for the aligned form's quotient q = total / div (chunk: split_chunk's).
__host__ __device__ __forceinline__ int aligned_chunk(int chunk, int total, int q, int div, int mul, int min_chunk,
                                                      int hi) {
    if (q * div != total) return chunk;
    const int64_t c = static_cast<int64_t>(q) * mul;
    return c >= min_chunk && c <= hi ? static_cast<int>(c) : chunk;
}
// The kernels' bound: one tile more than the flat chunk where the within rule allows that
// much (chunk >= 16; not its chunk / 40 from 80 tiles: fp8_ds_mla dense b=128 l=8192 at two
// CTAs per SM (125 -> 128) and sparse t=1024 top-512 at 132 parts (125 -> 128) measured 1.5-2 %
// slower aligned, log #95).
__host__ __device__ __forceinline__ int aligned_hi(int chunk) {
    const int w = within_chunk(chunk);
    return w < chunk + 1 ? w : chunk + 1;
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
    // tiles(b) (p != NULL), recording a length outside [0, max_len] in flag when record:
    // dense seq_len (kLensDense) as MLA_FAULT_NEGATIVE_SEQ_LEN / _SEQ_LEN_TOO_LARGE, sparse
    // topk_len (kLensSparse) as MLA_FAULT_BAD_TOPK_LEN.
    __device__ int tiles_checked(int b, bool record, int kind, uint32_t* flag) const {
        const int r = p[b];
        if (record) record_bad(b, r, max_len, kind, flag);
        return tiles_of(clamp(r, max_len));
    }
    // Records request b's raw length r in flag when it is outside [0, max_len] (kind as above).
    __device__ static void record_bad(int b, int r, int max_len, int kind, uint32_t* flag) {
        if (r < 0 || r > max_len) {
            const uint32_t code = kind == kLensSparse ? MLA_FAULT_BAD_TOPK_LEN
                                                      : (r < 0 ? MLA_FAULT_NEGATIVE_SEQ_LEN : MLA_FAULT_SEQ_LEN_TOO_LARGE);
            record_fault(flag, code, b, r);
        }
    }
};

// Inclusive sum over the warp's lanes (the whole warp calls it).
__device__ __forceinline__ int warp_inclusive_sum(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += u;
    }
    return v;
}

// Inclusive sum over the CTA's kThreads threads (every thread calls it); scratch holds
// kThreads / 32 ints (2 * kThreads / 32 with max). Returns the inclusive prefix; *total gets
// the CTA's sum, and *max (where given) the CTA's largest m (>= 0), from the same barrier.
template <int kThreads>
__device__ __forceinline__ int block_inclusive_sum(int v, int* scratch, int* total, int m = 0, int* max = nullptr) {
    constexpr int kW = kThreads / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_inclusive_sum(v);
    if (max) m = __reduce_max_sync(0xffffffffu, m);
    if (lane == 31) {
        scratch[warp] = v;
        if (max) scratch[kW + warp] = m;
    }
    __syncthreads();
    int before = 0, sum = 0, mx = 0;
#pragma unroll
    for (int w = 0; w < kW; ++w) {
        const int t = scratch[w];
        before += w < warp ? t : 0;
        sum += t;
        if (max) mx = ::max(mx, scratch[kW + w]);
    }
    __syncthreads();  // scratch is reused by the next call
    *total = sum;
    if (max) *max = mx;
    return v + before;
}

// The flat split's chunk with lengths (total: the step's tiles; equal: every request has
// total / batch tiles): split_chunk, or the aligned chunk where the lengths are equal and the
// host allowed it (a.aligned_div.d > 0: the flat split, not within requests).
__device__ __forceinline__ int flat_chunk(const DecodeArgs& a, int total, bool equal) {
    const int chunk = split_chunk(total, a.parts_div, a.min_chunk);
    if (!equal || a.aligned_div.d == 0) return chunk;
    return aligned_chunk(chunk, total, a.aligned_div.div(total), a.aligned_div.d, a.aligned_mul, a.min_chunk,
                         aligned_hi(chunk));
}
// Whether every request has the same tiles, from the most tiles of any request (tmax) and the
// total: then batch * tmax == total (batch * tmax <= INT32_MAX: mla_schedule_init checks
// batch * tiles_of(max_len)). (From values every thread has after the same barrier, so that
// the compiler keeps the part's bounds, and the loops over them, warp-uniform.)
__device__ __forceinline__ bool all_equal(int tmax, int batch, int total) { return tmax * batch == total; }

// Total tiles of all requests (every thread calls it; coalesced loads of the lengths).
// With record, a negative or too-large length records a fault; *equal gets whether every
// request has the same tiles (kEqual; else false).
template <int kThreads, bool kEqual = true>
__device__ __forceinline__ int total_tiles(const DecodeArgs& a, const Lens& lens, bool record, int* scratch,
                                           bool* equal) {
    *equal = kEqual;
    if (lens.p == nullptr) return a.batch * Lens::tiles_of(lens.max_len);
    int sum = 0, tmax = 0;
    for (int b = threadIdx.x; b < a.batch; b += kThreads) {
        const int t = lens.tiles_checked(b, record, a.check_lens, a.flag);
        sum += t;
        tmax = max(tmax, t);
    }
    int total;
    block_inclusive_sum<kThreads>(sum, scratch, &total, tmax, kEqual ? &tmax : nullptr);
    *equal = kEqual && all_equal(tmax, a.batch, total);
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

// Many requests (kThreads < batch <= kRowsRequests): with R = ceil(batch / kThreads) rows per
// warp, warp w takes the requests [32 R w, 32 R (w + 1)) in rows of 32 (row j: request
// 32 R w + 32 j + lane), all loaded at once, coalesced (one round trip, where the walk above
// takes a dependent round trip and two barriers per kThreads requests: 16 passes for sparse
// t=2048 in a 128-thread CTA), so that one barrier gives every warp its first tile; the warp
// that holds a given tile then walks its rows from L1 (a warp reduction per row, a warp scan in
// the row that holds it). Past kRowsRequests the walk stays. The decode kernels run it in their
// kAligned form only (flat_lens_kernel: inline, log #95 (c)'s similar search moved the
// streaming kernels' code); the combine where it has a CTA per part boundary (find_split;
// log #96). (Measured slower: a run of consecutive requests per thread, whose loads touched 32
// lines each, and a fixed 32 R = 1,024 requests per warp, which left one warp to do all of
// t=512.)
constexpr int kRowsRequests = 4096;
template <int kThreads>
struct WarpRows {
    static constexpr int kW = kThreads / 32;
    static constexpr int kRows = kRowsRequests / kThreads;  // 32 rows per warp at 128 threads, 16 at 256
    int rows;   // rows per warp: ceil(batch / kThreads) <= kRows (the same in every warp)
    int first;  // the warp's first request
    int start;  // its first tile in the step
    int sum;    // its tiles
    static constexpr int kG = 8;  // rows whose loads are in flight at once
    __device__ __forceinline__ int req(int j) const { return first + 32 * j + (threadIdx.x & 31); }
    // Tiles of this lane's requests in rows [j0, j0 + kG) (0 past the batch or the warp's
    // rows): every load is issued before any is used (predicated, no branch between them), so
    // a group costs one round trip (a load per row with its use behind it took one each: eight
    // on t=2048 in a 256-thread combine CTA, log #97).
    __device__ __forceinline__ void group(const DecodeArgs& a, const Lens& lens, int j0, int (&t)[kG]) const {
        bool valid[kG];
#pragma unroll
        for (int u = 0; u < kG; ++u) valid[u] = j0 + u < rows && req(j0 + u) < a.batch;
        if (lens.p == nullptr) {  // (uniform)
#pragma unroll
            for (int u = 0; u < kG; ++u) t[u] = valid[u] ? Lens::tiles_of(lens.max_len) : 0;
            return;
        }
        int raw[kG];
#pragma unroll
        for (int u = 0; u < kG; ++u) raw[u] = valid[u] ? lens.p[req(j0 + u)] : 0;
#pragma unroll
        for (int u = 0; u < kG; ++u) t[u] = valid[u] ? Lens::tiles_of(Lens::clamp(raw[u], lens.max_len)) : 0;
    }
    // Loads every row, then (one barrier pair over scratch[0, 2 kW)) the warp's first tile;
    // *total gets the step's tiles and *max the most tiles of one request. Every thread calls it.
    __device__ __forceinline__ void scan(const DecodeArgs& a, const Lens& lens, int* scratch, int* total, int* max) {
        const int warp = threadIdx.x >> 5;
        rows = static_cast<int>((static_cast<uint32_t>(a.batch) + kThreads - 1) / kThreads);
        first = warp * rows * 32;
        int s = 0, m = 0;
#pragma unroll 1
        for (int j0 = 0; j0 < rows; j0 += kG) {  // (uniform)
            int t[kG];
            group(a, lens, j0, t);
#pragma unroll
            for (int u = 0; u < kG; ++u) {
                s += t[u];
                m = ::max(m, t[u]);
            }
        }
        sum = __reduce_add_sync(0xffffffffu, s);
        m = __reduce_max_sync(0xffffffffu, m);
        if ((threadIdx.x & 31) == 0) {
            scratch[warp] = sum;
            scratch[kW + warp] = m;
        }
        __syncthreads();
        int before = 0, all = 0, mx = 0;
#pragma unroll
        for (int w = 0; w < kW; ++w) {
            const int v = scratch[w];
            before += w < warp ? v : 0;
            all += v;
            mx = ::max(mx, scratch[kW + w]);
        }
        __syncthreads();  // scratch is reused by the caller
        start = before;
        *total = all;
        *max = mx;
    }
    // Tile lo (start <= lo < the step's total): the warp that holds it walks its rows (L1, a
    // group of kG at a time) and the lane of its request writes out[0] = the request, out[1] =
    // lo's tile in it, out[2] = the request's tiles. Every thread calls it (after scan); out is
    // read after a barrier.
    __device__ __forceinline__ void find(const DecodeArgs& a, const Lens& lens, int lo, int* out) const {
        if (start <= lo && lo < start + sum) {  // uniform
            int s = start;  // the first tile of the group's next row
#pragma unroll 1
            for (int j0 = 0; j0 < rows; j0 += kG) {  // (uniform; lo is in one of the rows)
                int t[kG], row[kG];
                group(a, lens, j0, t);
#pragma unroll
                for (int u = 0; u < kG; ++u) row[u] = __reduce_add_sync(0xffffffffu, t[u]);
                int hit = -1, base = 0, mine = 0;  // the row that holds lo, its first tile, this lane's tiles there
#pragma unroll
                for (int u = 0; u < kG; ++u) {
                    if (hit < 0 && lo < s + row[u]) {
                        hit = u;
                        base = s;
                        mine = t[u];
                    }
                    s += row[u];
                }
                if (hit >= 0) {  // (uniform)
                    const int st = base + warp_inclusive_sum(mine) - mine;
                    if (st <= lo && lo < st + mine) {
                        out[0] = req(j0 + hit);
                        out[1] = lo - st;
                        out[2] = mine;
                    }
                    break;
                }
            }
        }
    }
};
// With record, a negative or too-large length records a fault (coalesced; one CTA does it).
__device__ __forceinline__ void record_lens(const DecodeArgs& a, const Lens& lens, int threads) {
    for (int b = threadIdx.x; b < a.batch; b += threads) Lens::record_bad(b, lens.p[b], lens.max_len, a.check_lens, a.flag);
}

// Where this CTA's part starts: its tiles [lo, hi) of the split, and the request and tile
// of lo (every thread calls it; valid only when lo < total). One request per thread and a
// single block scan when batch <= kThreads (the common case), else a pass for the total and
// a walk over the requests; a closed form when lens is NULL.
struct PartPos {
    int total, lo, hi, first_req, first_j;
};

// find_part's shared scratch (ints): the scans' warp sums in [0, 32) (a CTA has at most 32
// warps), then where the part starts, written by the thread that finds it.
struct PartScratch {
    static constexpr int kFirstReq = 32;   // the part's first request
    static constexpr int kFirstTile = 33;  // its first tile within that request
    static constexpr int kEndTile = 34;    // within requests: the tile after its last one, there
    static constexpr int kReqStart = 35;   // within requests: that request's first tile in the step
    static constexpr int kInts = 36;
};

// kWithin: the kernel of a schedule whose parts lie within requests where they fit
// (a.split_within; the other kernels do not carry that code).
// kAligned: the flat split's kernel for lengths: it takes the aligned chunk for equal lengths
// (a.aligned_div.d > 0; flat_chunk), and past kThreads requests it finds its part from rows
// of 32 requests per warp (WarpRows) instead of the walk (flat_lens_kernel).
template <int kThreads, bool kWithin = false, bool kAligned = false>
__device__ __forceinline__ PartPos find_part(const DecodeArgs& a, const Lens& lens, int part, bool record,
                                             int* scratch) {
    PartPos p;
    int chunk;
    if (lens.p == nullptr) {  // everything but the part's position was computed on the host
        p.total = a.closed_total;
        if (kWithin && a.closed_n.d > 0) {  // within requests: closed_n parts per request
            const int n = a.closed_n.d, t = a.closed_tiles.d;
            const int q = a.closed_n.div(t), r = t - q * n;
            p.first_req = a.closed_n.div(part);
            const int i = part - p.first_req * n;
            p.first_j = within_lo(i, q, r);
            const int start = p.first_req * t;  // <= total when first_req <= batch
            p.lo = p.first_req < a.batch ? start + p.first_j : p.total;
            p.hi = p.first_req < a.batch ? p.lo + q + (i < r ? 1 : 0) : p.total;
            return p;
        }
        p.lo = part_lo(part, a.closed_chunk.d, p.total);
        p.first_req = a.closed_tiles.div(p.lo);
        p.first_j = p.lo - p.first_req * a.closed_tiles.d;
        p.hi = p.lo + min(a.closed_chunk.d, p.total - p.lo);
        return p;
    } else if (a.batch <= kThreads) {
        const int b = threadIdx.x;
        const int t = b < a.batch ? lens.tiles_checked(b, record, a.check_lens, a.flag) : 0;
        int tmax = 0;
        const int incl = block_inclusive_sum<kThreads>(t, scratch, &p.total, t, kAligned ? &tmax : nullptr);
        chunk = split_chunk(p.total, a.parts_div, a.min_chunk);
        if (kWithin) {
            const int pair = within_pair(b < a.batch, t, chunk);
            int psum, n = 0, f = 0, used = 0;
            const int pincl = block_inclusive_sum<kThreads>(pair, scratch, &psum);
            if (within_pick(pair, pincl, psum, a.num_parts, &n, &f, &used)) {  // uniform
                if (part >= used) {  // no tiles
                    p.lo = p.hi = p.total;
                    p.first_req = p.first_j = 0;
                    return p;
                }
                if (b < a.batch && f <= part && part < f + n) {
                    const int q = static_cast<int>(static_cast<uint32_t>(t) / static_cast<uint32_t>(n));
                    const int r = t - q * n, i = part - f, j = within_lo(i, q, r);
                    scratch[PartScratch::kFirstReq] = b;
                    scratch[PartScratch::kFirstTile] = j;
                    scratch[PartScratch::kEndTile] = j + q + (i < r ? 1 : 0);
                    scratch[PartScratch::kReqStart] = incl - t;
                }
                __syncthreads();
                p.first_req = scratch[PartScratch::kFirstReq];
                p.first_j = scratch[PartScratch::kFirstTile];
                p.lo = scratch[PartScratch::kReqStart] + p.first_j;
                p.hi = p.lo + scratch[PartScratch::kEndTile] - p.first_j;
                __syncthreads();  // the caller reuses scratch
                return p;
            }
        }
        if (kAligned) chunk = flat_chunk(a, p.total, all_equal(tmax, a.batch, p.total));
        p.lo = part_lo(part, chunk, p.total);
        if (b < a.batch && incl - t <= p.lo && p.lo < incl) {
            scratch[PartScratch::kFirstReq] = b;
            scratch[PartScratch::kFirstTile] = p.lo - (incl - t);
        }
        __syncthreads();
        p.first_req = scratch[PartScratch::kFirstReq];
        p.first_j = scratch[PartScratch::kFirstTile];
        __syncthreads();  // the caller reuses scratch
    } else if (kAligned && a.batch <= kRowsRequests) {  // (the flat kernels keep the walk: log #96)
        if (record) record_lens(a, lens, kThreads);
        WarpRows<kThreads> w;
        int tmax;
        w.scan(a, lens, scratch, &p.total, &tmax);
        chunk = flat_chunk(a, p.total, all_equal(tmax, a.batch, p.total));
        p.lo = part_lo(part, chunk, p.total);
        if (p.lo < p.total) w.find(a, lens, p.lo, scratch + PartScratch::kFirstReq);
        __syncthreads();
        p.first_req = p.lo < p.total ? scratch[PartScratch::kFirstReq] : 0;
        p.first_j = p.lo < p.total ? scratch[PartScratch::kFirstTile] : 0;
        __syncthreads();  // the caller reuses scratch
    } else {
        bool equal;
        p.total = total_tiles<kThreads, kAligned>(a, lens, record, scratch, &equal);
        chunk = kAligned ? flat_chunk(a, p.total, equal) : split_chunk(p.total, a.parts_div, a.min_chunk);
        p.lo = part_lo(part, chunk, p.total);
        p.first_req = p.first_j = 0;
        if (p.lo < p.total) {
            const int lo = p.lo;
            scan_requests<kThreads>(a, lens, scratch, [&](bool valid, int b, int start, int t) {
                const bool mine = valid && start <= lo && lo < start + t;
                if (mine) {
                    scratch[PartScratch::kFirstReq] = b;
                    scratch[PartScratch::kFirstTile] = lo - start;
                }
                return mine;
            });
            p.first_req = scratch[PartScratch::kFirstReq];
            p.first_j = scratch[PartScratch::kFirstTile];
            __syncthreads();
        }
    }
    p.hi = p.lo + min(chunk, p.total - p.lo);
    return p;
}

// What find_split reports about a split request (indices into its `found`).
enum SplitFound : int {
    kFoundReq = 0,    // the request
    kFoundFirst = 1,  // its first part
    kFoundLast = 2,   // its last part
    kFoundTail = 3,   // bit 0: it is not its first part's first request (its piece there is in
                      // slot 2q + 1); bit 1 (kFoundListed): it is in the long list (kLong)
    kFoundInts = 4,
};
constexpr int kFoundListed = 2;
// find_split's shared scratch: two scans' warp sums.
template <int kThreads>
__host__ __device__ constexpr int split_scratch_ints() {
    return 2 * (kThreads / 32);
}

// A long split request (find_split with a LongRule): one request of many pieces among short
// ones (1,024 x 127 + 65,536 rows) would keep its few CTAs folding in series while the others
// are done; the combine instead spreads its (row, 32-dim slice) items over every CTA of its
// grid (decode/combine.cuh). Where a warp merges each row (combine_rows 8) a request is long
// with more than kLongPieces pieces; where 8 warps merge each row, with at least
// kLongPiecesByWarps pieces and more than 4x the mean over split requests. The first kMaxLong
// in request order are listed; more merge by themselves.
enum LongRule : int { kNoLong = 0, kLongByWarp = 1, kLongByWarps = 2 };
constexpr int kLongPieces = 16;
constexpr int kLongPiecesByWarps = 32;
constexpr int kMaxLong = 16;
struct LongSplit {
    int req, first, last, tail;  // as SplitFound
};

// The part holding `tile` of the flat split (find_split, BoundarySplits): a FastDiv when the
// chunk is known on the host (closed form, lens NULL), else an unsigned division.
__device__ __forceinline__ int part_of_tile(const DecodeArgs& a, const Lens& lens, int tile, int chunk) {
    return lens.p == nullptr ? a.closed_chunk.div(tile)
                             : static_cast<int>(static_cast<uint32_t>(tile) / static_cast<uint32_t>(chunk));
}

// The split requests of a step with at least as many requests as parts (at most kRowsRequests;
// the flat split: not the closed form within requests or with lengths; its callers take it past
// kThreads requests), by
// their part boundaries: boundary k + 1 (tile (k + 1) * chunk) is "split boundary k" when it
// lies strictly inside a request and is the first one inside it; that request is then
// merged by whoever takes k, so each split request by exactly one taker, in part order. The
// lengths are loaded once (WarpRows: one round trip, one barrier) and each boundary is found
// by one warp's walk over L1, so a combine CTA can take several (combine_kernel's kLoop form).
template <int kThreads>
struct BoundarySplits {
    WarpRows<kThreads> w;
    int total, chunk;
    bool none;  // equal lengths and parts of whole requests (the aligned chunk k * t): nothing split
    // (host and device: combine_loop_ctas launches the kLoop form only where it holds)
    __host__ __device__ static bool applies(const DecodeArgs& a) {
        return a.batch >= a.num_parts && a.batch <= kRowsRequests && !a.closed_lens &&
               !(a.lens == nullptr && a.closed_n.d > 0);
    }
    // Every thread calls it (WarpRows::scan's barriers).
    __device__ __forceinline__ void init(const DecodeArgs& a, const Lens& lens, int* scratch) {
        int tmax;
        w.scan(a, lens, scratch, &total, &tmax);
        const bool equal = all_equal(tmax, a.batch, total);
        chunk = lens.p == nullptr ? a.closed_chunk.d : flat_chunk(a, total, equal);
        none = equal && chunk % tmax == 0;
    }
    // Whether boundary k + 1 lies inside the step and may split a request (uniform).
    __device__ __forceinline__ bool in_step(int k) const {
        return !none && static_cast<int64_t>(k + 1) * chunk < total;
    }
    // Boundary k's split request into found[SplitFound] (thread 0), false if boundary k + 1 is
    // past the step or not the first one inside a request. Every thread calls it (two
    // barriers: scratch and found are reusable once it returns).
    __device__ __forceinline__ bool find(const DecodeArgs& a, const Lens& lens, int k, int* scratch, int* found) const {
        if (!in_step(k)) return false;
        const int lo = (k + 1) * chunk;
        w.find(a, lens, lo, scratch);
        __syncthreads();
        const int b = scratch[0], j = scratch[1], t = scratch[2];
        const int start = lo - j;
        auto part_of = [&](int tile) { return part_of_tile(a, lens, tile, chunk); };
        const int first = part_of(start);
        const bool mine = j > 0 && first == k;  // inside b, and b starts in part k (its first boundary)
        if (mine && threadIdx.x == 0) {
            found[kFoundReq] = b;
            found[kFoundFirst] = first;
            found[kFoundLast] = part_of(start + t - 1);
            found[kFoundTail] = start != first * chunk ? 1 : 0;
        }
        __syncthreads();  // found (and scratch) read by the caller
        return mine;
    }
};

// The k-th split request in request order (as decode splits them): into found[SplitFound];
// false if there are at most k. With a kRule also the long split requests, in request order,
// into long_list (at most kMaxLong; *n_long gets how many were listed; kLongByWarps only when
// batch <= kThreads, which 8 warps per row imply: parts > 16 x batch). Every thread calls it;
// scratch holds split_scratch_ints<kThreads>() ints.
template <int kThreads, int kRule = kNoLong>
__device__ __forceinline__ bool find_split(const DecodeArgs& a, const Lens& lens, int k, int* scratch, int* found,
                                           LongSplit* long_list = nullptr, int* n_long = nullptr) {
    constexpr int kW = kThreads / 32;
    constexpr bool kLong = kRule != kNoLong;
    auto part_of = [&](int tile, int chunk) { return part_of_tile(a, lens, tile, chunk); };
    // The fewest pieces of a long request, given how many requests are split (kLongByWarps).
    auto long_min = [&](int n_split) {
        return kRule == kLongByWarps ? max(kLongPiecesByWarps, 4 * a.num_parts / max(n_split, 1) + 1)
                                     : kLongPieces + 1;
    };
    auto record = [&](int b, int first, int last, int tail) {
        found[kFoundReq] = b;
        found[kFoundFirst] = first;
        found[kFoundLast] = last;
        found[kFoundTail] = tail;
    };
    // A long request lidx-th in request order: listed while the list has room (kFoundListed).
    auto list_long = [&](bool is_long, int lidx, int b, int first, int last, int tail) {
        const int listed = is_long && lidx < kMaxLong ? kFoundListed : 0;
        if (listed) long_list[lidx] = LongSplit{b, first, last, tail};
        return listed;
    };
    auto set_n_long = [&](int n) { *n_long = n < kMaxLong ? n : kMaxLong; };
    // Request b's first and last part and its tail bit (tiles [start, start + t)): the flat
    // split, or closed_n parts per request in the closed form within requests.
    auto bounds = [&](int b, int start, int t, int chunk, int& first, int& last, int& tail) {
        if (a.closed_lens) {  // closed_n parts per request, ceil(t / min_chunk) of them with tiles
            first = b * a.closed_n.d;
            last = first + (t > 0 ? a.closed_chunk.div(t - 1) : 0);
            tail = 0;
            return;
        }
        if (lens.p == nullptr && a.closed_n.d > 0) {
            first = b * a.closed_n.d;
            last = first + a.closed_n.d - 1;
            tail = 0;
            return;
        }
        first = part_of(start, chunk);
        last = part_of(start + t - 1, chunk);
        tail = start != first * chunk ? 1 : 0;
    };
    // Within requests with lengths (batch <= kWithinMaxBatch): the request's own parts from
    // the scanned pair of counts (pair, its inclusive prefix, the total), unless neither fits.
    auto within = [&](int pair, int pincl, int psum, int& first, int& last, int& tail) {
        int n, f, used;
        if (within_pick(pair, pincl, psum, a.num_parts, &n, &f, &used)) {
            first = f;
            last = f + n - 1;
            tail = 0;
        }
    };
    // count: split requests before this pass; with kLong in its low 16 bits (at most kThreads
    // per pass), the long ones in its high bits, both from one scan
    auto check = [&](bool valid, int b, int first, int last, int tail, int& count) {
        const int split = valid && first != last ? 1 : 0;
        int n, idx, listed = 0;
        if constexpr (kLong) {
            int min_pieces = long_min(0);
            if constexpr (kRule == kLongByWarps) {  // a single pass (batch <= kThreads)
                min_pieces = long_min(__syncthreads_count(split));
                if (a.batch > kThreads) min_pieces = 0x7fffffff;
            }
            const int is_long = split && last - first + 1 >= min_pieces ? 1 : 0;
            const int v = split | (is_long << 16);
            const int before = block_inclusive_sum<kThreads>(v, scratch + kW, &n) - v;
            idx = (count & 0xffff) + (before & 0xffff);
            listed = list_long(is_long, (count >> 16) + (before >> 16), b, first, last, tail);
        } else {
            idx = count + block_inclusive_sum<kThreads>(split, scratch + kW, &n) - split;
        }
        count += n;
        const bool mine = split && idx == k;
        if (mine) record(b, first, last, tail | listed);
        return mine;
    };
    int count = 0;
    auto done = [&](bool hit) {
        if constexpr (kLong) set_n_long(count >> 16);  // every thread's count is the same
        return hit;
    };
    if (a.batch <= 32) {  // one warp: shuffles and ballots, then a single barrier
        bool mine = false;
        if (threadIdx.x < 32) {
            const int b = threadIdx.x;
            const bool valid = b < a.batch;
            const int t = valid ? lens.tiles(b) : 0;
            const int incl = warp_inclusive_sum(t);
            const int total = __shfl_sync(0xffffffffu, incl, 31);
            // (the aligned chunk only on the flat split: within_pair takes split_chunk)
            const int tmax = __reduce_max_sync(0xffffffffu, t);
            const int chunk = lens.p == nullptr ? a.closed_chunk.d : flat_chunk(a, total, all_equal(tmax, a.batch, total));
            const int start = incl - t;
            int first, last, tail;
            bounds(b, start, t, chunk, first, last, tail);
            if (a.split_within && lens.p != nullptr) {
                const int pair = within_pair(valid, t, chunk);
                const int pincl = warp_inclusive_sum(pair);
                within(pair, pincl, __shfl_sync(0xffffffffu, pincl, 31), first, last, tail);
            }
            const bool split = valid && first != last;
            const uint32_t before = (1u << b) - 1u;
            const int idx = __popc(__ballot_sync(0xffffffffu, split) & before);
            int listed = 0;
            if constexpr (kLong) {
                int min_pieces = long_min(0);
                if constexpr (kRule == kLongByWarps) min_pieces = long_min(__popc(__ballot_sync(0xffffffffu, split)));
                const bool is_long = split && last - first + 1 >= min_pieces;
                const uint32_t longs = __ballot_sync(0xffffffffu, is_long);
                listed = list_long(is_long, __popc(longs & before), b, first, last, tail);
                if (b == 0) scratch[0] = __popc(longs);
            }
            mine = split && idx == k;
            if (mine) record(b, first, last, tail | listed);
        }
        const bool hit = __syncthreads_or(mine);
        if constexpr (kLong) set_n_long(scratch[0]);
        return hit;
    }
    if (a.batch <= kThreads) {  // one request per thread: a scan for the tiles, one for the splits
        const int b = threadIdx.x;
        const bool valid = b < a.batch;
        const int t = valid ? lens.tiles(b) : 0;
        int total, tmax;
        const int incl = block_inclusive_sum<kThreads>(t, scratch, &total, t, &tmax);
        const int chunk = lens.p == nullptr ? a.closed_chunk.d : flat_chunk(a, total, all_equal(tmax, a.batch, total));
        int first, last, tail;
        bounds(b, incl - t, t, chunk, first, last, tail);
        if (a.split_within && lens.p != nullptr) {  // scratch is free again after the scan
            const int pair = within_pair(valid, t, chunk);
            int psum;
            const int pincl = block_inclusive_sum<kThreads>(pair, scratch, &psum);
            within(pair, pincl, psum, first, last, tail);
        }
        return done(__syncthreads_or(check(valid, b, first, last, tail, count)));
    }
    // Many requests, at least as many as parts (the grid then has a CTA per part boundary,
    // max_splits), without a long list: CTA k takes split boundary k (BoundarySplits), where
    // counting the split requests before the k-th in every CTA (the walk below, or its WarpRows
    // form, measured 2.5x slower) cost the 1-slice combine (one 177-register CTA per SM, four
    // waves on t=2048) up to 27 us when nothing at all was split (log #96).
    if (!kLong && BoundarySplits<kThreads>::applies(a)) {
        BoundarySplits<kThreads> bs;
        bs.init(a, lens, scratch);
        return bs.find(a, lens, k, scratch, found);
    }
    bool equal;
    const int total = total_tiles<kThreads>(a, lens, false, scratch, &equal);
    const int chunk = lens.p == nullptr ? a.closed_chunk.d : flat_chunk(a, total, equal);
    if constexpr (kLong) {  // every request: the long ones may come after the k-th split
        bool any = false;
        scan_requests<kThreads>(a, lens, scratch, [&](bool valid, int b, int start, int t) {
            int first, last, tail;
            bounds(b, start, t, chunk, first, last, tail);
            any |= check(valid, b, first, last, tail, count);
            return false;
        });
        return done(__syncthreads_or(any));
    }
    // (more than kThreads requests: never split within requests with lengths, kWithinMaxBatch)
    return scan_requests<kThreads>(a, lens, scratch, [&](bool valid, int b, int start, int t) {
        int first, last, tail;
        bounds(b, start, t, chunk, first, last, tail);
        return check(valid, b, first, last, tail, count);
    });
}

// ---- the workspace: where the pieces of split requests go -------------------------------
// Part p writes its piece of the first request it touches to slot 2p and its piece of the
// last one to slot 2p + 1 (only pieces of split requests; a request that lies wholly inside
// one part is written straight to `out`). A slot has a row per query row m:
//   ws_o   [2 * parts][m_rows][512] fp32: the piece's output, normalized by its own sum;
//   ws_lse [2 * parts][m_rows]      fp32: the piece's lse, log2 domain (-inf: no rows);
// ws_lse follows ws_o in the one workspace buffer. combine_kernel reads piece q of a request
// from slot 2q, or 2q + 1 when q is the request's first part and that part began with another
// request (find_split's found[3], `first_tail`).
constexpr int kSlotsPerPart = 2;
// Slot of part `part`'s piece: tail 0 for the part's first request, 1 for its last.
__host__ __device__ __forceinline__ int ws_slot(int part, int tail) { return kSlotsPerPart * part + tail; }
// Rows of ws_o (and entries of ws_lse).
__host__ __device__ __forceinline__ size_t ws_rows(int parts, int m_rows) {
    return kSlotsPerPart * static_cast<size_t>(parts) * m_rows;
}
// Bytes of the whole workspace (mla_workspace_bytes).
inline size_t ws_bytes(int parts, int m_rows) { return ws_rows(parts, m_rows) * (kLatentDim + 1) * sizeof(float); }

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

// ---- host side ------------------------------------------------------------------------
// Query rows per combine CTA. With at most ~16 parts per request a split request has few
// pieces, and a warp per row merges them in a few round trips; more parts per request
// (a few long sequences) keep 8 warps per row.
inline int combine_rows(const mla_schedule_t* s) { return s->num_parts <= 16 * s->batch ? kCombineWarps : 1; }

// Combine CTAs per dim slice: split requests x row groups.
inline int64_t combine_row_ctas(const mla_schedule_t* s) {
    const int rows = combine_rows(s), m_rows = s->q_len * s->num_heads;
    return static_cast<int64_t>(max_splits(s->batch, s->num_parts)) * ((m_rows + rows - 1) / rows);
}

// Dim slices per merged row (the combine's grid z; docs/PERFORMANCE.md log #61): 16 (32 dims
// per CTA) when 16x the row CTAs still give at most one per SM (b=1, t=1 at 8 rows: 128 CTAs
// fold ~128 pieces each in one round trip, one beside each decode CTA), else 4. With the
// combine at 48 registers, 4 slices are faster than one CTA per row wherever they were measured
// (the 512-dim CTA needs 177 registers, so an SM held one and no decode CTA beside it): a
// long request among short ones gets 4x the CTAs for its hundreds of pieces (512 x 15 + 8,192:
// 19.3 -> 15.8 us) and the others' CTAs start beside decode's tail. Slices 1 stays for tuning.
// With a warp per row, 2 slices where 4 would need a second wave of combine CTAs (five per SM
// at 48 registers) and 2 (four per SM at 64) fit one: b=128 or t=128 at 16 heads, whose 1,024
// CTAs of 4 slices left the last ~350 waiting for a free SM (log #63). With a warp per row and
// no request long enough to be dealt (at most kLongPieces tiles of min_chunk at max_len, so at
// most kLongPieces + 1 pieces), 1 slice where 2 would not fit one wave either, and where the
// batch is larger than a combine CTA's threads (every combine CTA walks the lengths in several
// passes to find its split request, so fewer CTAs repeat less of it): log #85 (e), b=512-2048
// of 64-1024 positions at 16-64 heads and sparse t=512-2048 top-256 at 16 heads 3-12 % faster,
// b=512-2048 at 8 heads with one CTA per SM (sm_120) 1-9 %; where 2 slices fit a wave they stay
// (1 lost up to 3 % there). The 1-slice combine deals nothing: a request of hundreds of pieces
// would merge alone, so longer max_len keep 4 slices and their dealing kernel.
inline int combine_slices(const mla_schedule_t* s) {
    const int64_t row_ctas = combine_row_ctas(s);
    if (16 * row_ctas <= s->sm_count) return 16;
    const bool warp_rows = combine_rows(s) > 1;
    const bool none_long = Lens::tiles_of(s->max_len) <= static_cast<int64_t>(kLongPieces) * s->internal.min_chunk;
    if (warp_rows && 4 * row_ctas > 5 * s->sm_count) {
        if (2 * row_ctas <= 4 * s->sm_count) return 2;
        if (none_long) return 1;
    }
    if (warp_rows && none_long && s->batch > kCombineWarps * 32) return 1;
    return 4;
}

// The 1-slice combine's CTAs per row group where it takes several split boundaries each
// (combine_kernel's kLoop form, BoundarySplits), else 0: one wave of its 177-register CTAs
// (one per SM) instead of a CTA per part boundary: four waves of them on sparse t=2048 h=16
// top-256 with topk_len (ncu 18.9 us with the merges; 3.8 us in one wave where nothing is split,
// log #97).
inline int combine_loop_ctas(const mla_schedule_t* s, const DecodeArgs& a) {
    // (past a combine CTA's threads, where find_split took the boundary rule before: measured there)
    // (a warp per row only, combine_rows > 1: the kLoop form has no barrier between two merges'
    // uses of red_*, which 8 warps per row need; batch >= parts implies it today)
    if (s->internal.combine_slices != 1 || a.combine_rows == 1 || a.batch <= kCombineWarps * 32 ||
        !BoundarySplits<kCombineWarps * 32>::applies(a))
        return 0;
    const int groups = (a.m_rows + a.combine_rows - 1) / a.combine_rows;
    const int ctas = s->sm_count / groups > 1 ? s->sm_count / groups : 1;
    return ctas < max_splits(s->batch, s->num_parts) ? ctas : 0;
}

// Whether the 4-slice combine keeps 16 pieces per lane in flight (111 registers) instead of 4
// (48): when every decode CTA streams at most two tiles with 8 warps (they all end together,
// so the fold is the critical path) and a split request has more than 32 pieces (b=2, b=1 at
// 16 rows: 4 round trips of 4 cost 2.4 us more than one of 16). The small 16-bit steps that
// run 4 warps one CTA per SM (log #69) were measured with the 48-register batch: its CTAs fit
// beside decode's. decode/decode.cu picks the kernel: 16 slices fold 4 pieces per lane, 1
// slice (tuning only) 8.
inline bool combine_deep_batch(const mla_schedule_t* s) {
    const int splits = max_splits(s->batch, s->num_parts);
    const int pieces = (s->num_parts + splits - 1) / splits;  // per split request, equal lengths
    return s->internal.warps == 8 && pieces > 32;
}

// Whether the 4-slice combine deals the rows of long requests over its grid
// (combine_dealing_kernel, decode/combine.cuh): with per-request lengths always (the host
// does not see them); in the closed form (every request max_len rows, e.g. sparse without
// topk_len) no request is longer than another, so only where a warp merges each row and a
// request of tiles_of(max_len) tiles can span more than kLongPieces part boundaries.
inline bool combine_deals(const DecodeArgs& a) {
    if (a.lens != nullptr) return true;
    if (a.combine_rows == 1) return false;
    if (a.closed_n.d > 0) return a.closed_n.d > kLongPieces;  // within requests: closed_n pieces each
    const int64_t t = a.closed_tiles.d, chunk = a.closed_chunk.d;
    return (chunk + t - 2) / chunk >= kLongPieces;  // most part boundaries inside one request
}

// Whether a schedule may cut its parts within requests (MLA_SPLIT_WITHIN_REQUESTS): a decode
// kernel with that code exists for its configuration (config.cuh, kWithinKernel: 16-bit
// caches, 16 or 32 query rows per CTA), every request can have a part (batch <= parts: else
// the kernels would always fall back to the flat split), and the kernels' limits hold.
inline bool within_allowed(const mla_schedule_t* s) {
    const bool kernel = with_row_format(s->kv_format, [&](auto f) {
        return with_config(s->internal.warps, s->internal.block_m, s->internal.form,
                           [](auto c) { return kWithinKernel<decltype(f), decltype(c)>; });
    });
    return kernel && s->batch <= kWithinMaxBatch && s->batch <= s->num_parts && s->num_parts + s->batch < kWithinMaxParts;
}

// Whether the kernels test for equal lengths (the host's filter, from prepare_split's closed
// form before its own aligned chunk: closed_total, closed_chunk): where requests of the call's
// max_len each (dense seq_lens = the table's capacity, sparse topk_len = topk: the common equal
// case) would move the flat chunk by the aligned rule, and the configuration has a kAligned
// kernel. Measured (log #95): one part per request (n = 1) and parts of k = 2-4 whole requests
// gain 1.4-9.7 %; n = 2 (dense b=64 h=8 at 132 parts, 63 -> 64) lost 1.3 %, and the aligned
// kernel where the chunk did not move 0-0.7 % (its code differs from the flat kernel's), so the
// filter takes n = 1 (f.div == batch) and any k at max_len only. (k = 8, sparse t=2048 top-256 at
// 264 parts, also lost 1.3 % in log #95, when a combine CTA per part boundary searched the
// lengths whether or not anything was split; with the combine's search in one wave and its exit
// where nothing is, log #97, k = 8 takes 11 % off that step.)
inline bool aligned_may_move(const mla_schedule_t* s, const DecodeArgs& a, const AlignedForm& f) {
    if (f.div > a.batch) return false;  // n >= 2
    const bool kernel = with_row_format(s->kv_format, [&](auto fmt) {
        return with_config(s->internal.warps, s->internal.block_m, s->internal.form,
                           [](auto c) { return kAlignedKernel<decltype(fmt), decltype(c)>; });
    });
    const int total = a.closed_total, chunk = a.closed_chunk.d;
    return kernel &&
           aligned_chunk(chunk, total, total / f.div, f.div, f.mul, a.min_chunk, aligned_hi(chunk)) != chunk;
}

// Whether a flat split with lengths takes the decode kernel's kAligned form (configuration C
// has one): the aligned chunk may move (a.aligned_div, aligned_may_move), or more requests than
// the CTA has threads, whose part that form finds in one round trip (WarpRows; log #96).
template <typename C>
inline bool flat_lens_kernel(const DecodeArgs& a) {
    return a.aligned_div.d > 0 || (a.lens != nullptr && !a.split_within && a.batch > C::kThreads);
}

// ---- the closed form with lengths (small steps; the decode kernel's kSpec form) ------------
// A call with lengths (dense seq_lens, sparse topk_len) on the flat split whose every request,
// at the call's max_len, fits n = ceil(tiles_of(max_len) / min_chunk) parts, with batch * n <=
// num_parts: request b gets parts b*n .. b*n + n - 1, its part i the tiles [i * min_chunk,
// + min_chunk) cut at the request's own tiles(b); the parts past them have none, and request b
// has ceil(tiles(b) / min_chunk) pieces. The parts are as long as the flat split's (which is
// then min_chunk tiles whatever the lengths) but never span two requests. Every part's request
// and tiles are known before the lengths, so its CTA issues its first tiles with the length's
// load (decode_kernel kSpec). Returns n, or 0 where the form does not apply.
inline int closed_lens_parts(const DecodeArgs& a) {
    if (a.lens == nullptr || a.split_within || a.batch > a.num_parts || a.min_chunk < 1) return 0;
    const int n = ceil_div_pos(a.closed_tiles.d, a.min_chunk);  // (prepare_split: tiles_of(max_len))
    return n <= a.num_parts / a.batch ? n : 0;
}

// Whether the host knows, without the lengths, that no request of the call is split (so that
// there is nothing to merge and the combine need not run; log #92): the closed form with
// lengths at one part per request; the closed form within requests at one part per request;
// the flat closed form when the chunk is a whole number of requests (every request t tiles,
// every part boundary a multiple of t). Otherwise the lengths decide, on the device.
// (closed_n.d > 0 only in the first two: prepare_split and the kSpec launch set it.)
inline bool nothing_to_merge(const DecodeArgs& a) {
    if (a.lens != nullptr && !a.closed_lens) return false;
    if (a.closed_n.d > 0) return a.closed_n.d == 1;
    return a.closed_chunk.d % a.closed_tiles.d == 0;
}

// The split's arguments from the schedule (combine_rows, split_within) and the kernels'
// divisors, on the host (DecodeArgs::parts_div, heads_div, closed_*).
inline void prepare_split(const mla_schedule_t* s, DecodeArgs& a) {
    a.combine_rows = combine_rows(s);
    a.split_within = s->internal.split == MLA_SPLIT_WITHIN_REQUESTS ? 1 : 0;
    a.parts_div = FastDiv::make(a.num_parts);
    a.heads_div = FastDiv::make(a.num_heads);
    a.closed_tiles = FastDiv::make(Lens::tiles_of(a.max_len));
    // batch * tiles <= INT32_MAX (mla_schedule_init checks it)
    a.closed_total = static_cast<int32_t>(static_cast<int64_t>(a.batch) * a.closed_tiles.d);
    a.closed_chunk = FastDiv::make(split_chunk(a.closed_total, a.parts_div, a.min_chunk));
    // Within requests in the closed form: n parts per request for the first candidate chunk
    // whose batch * n parts fit (the kernels' rule with equal lengths), else flat (d = 0).
    a.closed_n = FastDiv{0, 0, 0};
    a.closed_lens = 0;  // (the launch sets it, with closed_n and closed_chunk, where it takes the kSpec kernel)
    // The aligned chunk (flat split): for the closed form below, and with lengths for the kernels
    // where equal lengths may move the chunk (aligned_div.d = 0: they do not test for them).
    const AlignedForm form = aligned_form(a.batch, a.num_parts);
    a.aligned_div = FastDiv{0, 0, 0};
    a.aligned_mul = 0;
    if (!a.split_within && a.lens != nullptr && aligned_may_move(s, a, form)) {
        a.aligned_div = FastDiv::make(form.div);
        a.aligned_mul = form.mul;
    }
    if (a.split_within) {
        const int t = a.closed_tiles.d, chunk = a.closed_chunk.d;
        for (const int c : {chunk, within_chunk(chunk)}) {
            const int n = ceil_div_pos(t, c);
            if (static_cast<int64_t>(a.batch) * n <= a.num_parts) {
                a.closed_n = FastDiv::make(n);
                break;
            }
        }
    } else if (a.lens == nullptr) {
        // Flat in the closed form (every request t tiles, e.g. sparse without topk_len): where
        // n = parts / batch equal parts of c = t / n tiles divide every request and c is no
        // longer than the within rule's candidate, c is the flat chunk. The flat split then
        // lays every part inside one request (nothing to merge; log #77), with the flat kernels
        // as they are: their closed form takes the chunk from here.
        // With fewer parts than requests (log #94), parts of k = ceil(batch / parts) whole
        // requests each under the same bound: sparse t=256 h=32 top-1024 (132 parts of 63
        // tiles, nearly every token split) 9 % faster in 128 parts of two tokens.
        // (aligned_chunk, as the kernels apply it to equal lengths)
        const int total = a.closed_total, chunk = a.closed_chunk.d;
        const int c = aligned_chunk(chunk, total, total / form.div, form.div, form.mul, a.min_chunk, within_chunk(chunk));
        if (c != chunk) a.closed_chunk = FastDiv::make(c);
    }
}

}  // namespace mla
