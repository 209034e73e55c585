// The split-KV decode kernel: CTA (m_tile, part) runs its query rows over the tiles of its
// part of the split (decode/split.cuh), streaming them through a cp.async double buffer, and
// writes each request it finishes to `out`, or its piece of a split request to the
// workspace for combine_kernel (decode/combine.cuh).
#pragma once

#include "common/constants.cuh"
#include "common/fault.cuh"
#include "common/ptx.cuh"
#include "common/trace.cuh"
#include "decode/args.cuh"
#include "decode/config.cuh"
#include "decode/format.cuh"
#include "decode/fp8_phases.cuh"
#include "decode/smem.cuh"
#include "decode/split.cuh"

namespace mla {

// Whether decode CTAs of row format Fmt and configuration C test the start trigger as a
// threshold on their part's tiles (DecodeArgs::pdl above kPdlStartShift; log #86): the 16-bit
// 8-row 4-warp kernels, which run the steps of 8 heads whose parts can all be short.
template <typename Fmt, typename C>
constexpr bool kStartThreshold = C::kHalfM && C::kWarps == 4 && !Fmt::kFp8;

// The 16-bit 8-row kernels computed transposed (Sᵀ = K Qᵀ, Oᵀ += Vᵀ Pᵀ; the fp8 kernels' kSwapPV
// form, decode/fp8_phases.cuh): the query's 8 rows as the MMAs' N instead of an m16 A operand
// whose rows 8-15 are zero, so half the MMAs, 32 accumulators fewer, and no zero halves of the
// query's A fragments rebuilt before each MMA. The configurations with TileConfig::kTransposed
// (CfgHalfT; the schedule picks it by MLA_FORM_TRANSPOSED, logs #115, #116).
template <typename C>
constexpr bool kT16 = !C::Format::kFp8 && C::kTransposed;
// Whether o holds Oᵀ: this lane's query rows 2tq (elements 0, 2) and 2tq + 1 (1, 3) of each
// 16-dim chunk (fp8: dims 2g, 2g + 1; 16-bit: dims g, g + 8).
template <typename C>
constexpr bool kOT = kSwapPV<C> || kT16<C>;

// ---- loading a tile and the Q rows -----------------------------------------------------------
// Whether load_tile writes the valid flags as additive masks (the bits of 0.f, or of -inf where
// the row is masked and zero-filled) for the softmax to add: the fp8 kernels with one softmax
// per warp (KernelConfig::kMaskAdd), and the sparse 16-bit kernels with one per tile
// (softmax_rows: one FFMA per score, v * scale + mask, instead of a flag compare, a multiply
// and a select; log #84 (a): -1...-2.5 % on the sparse many-head rows; the dense ones, which
// keep the causal compare per score, measured 0.4-2.6 % slower with it).
template <typename C, bool kSparse>
constexpr bool kMaskBits = C::kMaskAdd || (kSparse && C::kSharedSoftmax && !C::Format::kFp8);

// Whether the tile's rows are staged by bulk copies (one per row, by the row's lane, completing
// on the stage's mbarrier: RowFp8::copy_row_bulk) instead of 16-byte cp.async chunks:
// fp8_ds_mla rows, staged byte for byte as stored (656 bytes, a multiple of 16 at 16-byte
// aligned addresses). For sparse rows the chunked copy costs ~150-200 warp-instructions per
// warp-tile (a row's 64-bit address shuffled to the warp, two copies of which the second has
// 9 of 32 lanes busy, the zero-fill selects: ncu, session 30); dense rows are copied as one
// span per warp where all are valid (~30). MLA_BULK_ROWS (config.cuh; bit 0: sparse, bit 1:
// dense) is 1 by default: the sparse rows 2-7 % faster, the dense ones (whose span copies are
// already cheap) 2-11 % slower (docs/PERFORMANCE.md logs #102, #103).
// Not for the small steps' configurations (8 warps with 8 or 16 query rows: parts of one or
// two tiles), where the copy engine's longer latency is not hidden: the sparse t=1 step took
// 0.3-0.4 us more in log #102.
template <typename C, bool kSparse>
constexpr bool kBulkRows = MLA_BULK_ARCH && C::Format::kFp8 && C::Format::kDsMla &&
                           (C::kWarps == 4 || C::kBlockM == 32) && ((MLA_BULK_ROWS >> (kSparse ? 0 : 1)) & 1);

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
// entry into the row's address (its block's base and its index in the block; the row format
// makes a RowAddr of them; kNoRow: masked, zero-filled and never read) and record a fault;
// then the warp streams its rows through the format's copy_row (one shuffle per row, no
// division).
template <typename C, bool kSparse>
__device__ __forceinline__ void load_tile(const DecodeArgs& a, const Cursor& c, const RowRaw& rr, uint8_t* kv_stage,
                                          int32_t* valid_stage, uint32_t bar) {
    using Fmt = typename C::Format;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    typename Fmt::RowAddr off = Fmt::kNoRow;
    if (lane < C::kRowsPerWarp) {
        const int r = warp * C::kRowsPerWarp + lane;
        const int pos = (c.j << kTileShift) + r;
        if (pos < c.len) off = entry_row<Fmt, kSparse>(a, rr.entry, pos, c.b, true);
        if constexpr (kMaskBits<C, kSparse>) {
            valid_stage[r] = Fmt::has_row(off) ? 0 : static_cast<int32_t>(0xff800000u);  // 0.f, -inf
        } else {
            valid_stage[r] = Fmt::has_row(off);
        }
    }
    const uint32_t kv_base = smem_u32(kv_stage);
    if constexpr (kBulkRows<C, kSparse>) {
        // every row (a masked one copies zeros) is kRowBytes on the stage's barrier
        if (lane == 0) mbar_arrive_expect_tx(bar, C::kRowsPerWarp * Fmt::kRowBytes);
        if (lane < C::kRowsPerWarp) Fmt::copy_row_bulk(kv_base, warp * C::kRowsPerWarp + lane, a, off, bar);
        return;
    }
    if constexpr (!kSparse && Fmt::kStagedAsStored && C::kMTiles == 1) {
        // (Not with two m-tiles: that configuration is compute-bound and at the register cap.)
        // Dense, rows staged byte for byte as stored: the warp's kRowsPerWarp rows are
        // consecutive positions inside one block (they start at a multiple of kRowsPerWarp <= 8,
        // block sizes are powers of two >= 16), so when all are valid they are one contiguous span,
        // copied as such: lane l copies 16-byte chunks l, l + 32, ... (no per-row shuffles).
        if (__all_sync(0xffffffffu, lane >= C::kRowsPerWarp || Fmt::has_row(off))) {
            constexpr int kSpanChunks = C::kRowsPerWarp * Fmt::kRowBytes / 16;
            const uint8_t* src = a.cache + Fmt::shfl_row(off, 0) + lane * 16;
            const uint32_t dst = kv_base + warp * C::kRowsPerWarp * Fmt::kSmemRowBytes + lane * 16;
#pragma unroll
            for (int i = 0; i < (kSpanChunks + 31) / 32; ++i) {
                if (i * 32 + 32 <= kSpanChunks || lane + i * 32 < kSpanChunks) cp_async_16(dst + i * 512, src + i * 512, 16);
            }
            return;
        }
    }
    if constexpr (!kBulkRows<C, kSparse>) {
#pragma unroll
        for (int i = 0; i < C::kRowsPerWarp; ++i) {
            const typename Fmt::RowAddr roff = Fmt::shfl_row(off, i);
            const int row = warp * C::kRowsPerWarp + i;
            Fmt::copy_row(kv_base, row, a, roff, lane);
        }
    }
}

// At a segment start: the query rows of the tile's request into q_s (zero past m_rows),
// in the same cp.async group as the tile: kQkDim values per row, the first kQkDim - kRopeDim
// from q_nope, the rest from q_rope, laid out as q_chunk says.
template <typename C, bool kSparse>
__device__ __forceinline__ void load_q_smem(const DecodeArgs& a, int b, int m_tile, uint8_t* q_s) {
    using Fmt = typename C::Format;
    constexpr int kNopeChunks = (Fmt::kQkDim - Fmt::kRopeDim) * 2 / 16, kRopeChunks = Fmt::kRopeDim * 2 / 16;
    static_assert(kNopeChunks == 64 && kRopeChunks <= 32, "lane l copies nope chunks l and l + 32, rope chunk l");
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
    static_assert(kRows * C::kWarps == C::kBlockM, "rows split evenly over warps");
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
        // the layout of q_chunk(r, c)
        const uint32_t dst = q_base + r * C::kQRowBytes;
        const int x = r & 7;
        cp_async_16(dst + ((lane ^ x) << 4), qn + lane * 16, bytes);
        cp_async_16(dst + (((lane + 32) ^ x) << 4), qn + (lane + 32) * 16, bytes);
        if (lane < kRopeChunks) cp_async_16(dst + (((lane + 64) ^ x) << 4), qr + lane * 16, bytes);
    }
}

// At a segment start without a Q tile in shared memory: this thread's A fragments of
// m-tile mt (rows g, g+8; k16 steps kh*kSKSteps..) straight from global memory, the layout
// ldmatrix would give (zero past m_rows).
template <typename C, bool kSparse>
__device__ __forceinline__ void load_q_frags(const DecodeArgs& a, int b, int m_tile, int kh,
                                             uint32_t (&qf)[C::kMTiles][C::kQFrags][4]) {
    constexpr int kNopeDim = C::Format::kQkDim - C::Format::kRopeDim;  // dims from q_nope
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
                        v = col < kNopeDim ? *reinterpret_cast<const uint32_t*>(qn + col * 2)
                                           : *reinterpret_cast<const uint32_t*>(qr + (col - kNopeDim) * 2);
                    }
                    qf[mt][ks][hf + 2 * c] = v;
                }
            }
        }
    }
}

// ---- the tile pipeline ------------------------------------------------------------------------
// The two-tiles-ahead cp.async double buffer: tile x (relative index x - lo) sits in stage
// (x - lo) & 1; while the CTA computes tile x, tile x+1 is in flight into the other stage, and
// tile x+2 is issued into tile x's stage as soon as tile x is computed, so at the wait for x+1,
// x+2 is already loading. A tile that starts a segment (the first tile of a request in this
// part) also loads the request's Q rows into the one Q tile (kQInSmem); when x+1 and x+2 both
// start segments, x+2's Q rows would overwrite the Q tile before x+1 read them, so x+2 is then
// issued at the top of iteration x+1 instead (after the Q read), as is the first tile of a
// part's second segment. Each tile's table entries are read one iteration before it is
// issued (resolve_row), so that issuing never waits on a dependent load.
template <typename C, bool kSparse>
struct TilePipeline {
    Cursor cur;         // tile x, being computed
    Cursor next;        // tile x+1
    RowRaw next_raw;    // its table entries
    Cursor after;       // tile x+2 (once issue_next ran)
    RowRaw after_raw;   // its table entries

    // The stage tile x sits in (the part's first tile, lo, in stage 0).
    static __device__ __forceinline__ int stage_of(int x, int lo) { return (x - lo) & 1; }

    // Issues the part's first tile (and its Q rows), and the second when it continues the
    // same request (unless C::kFirstAlone holds it back: then issue_next issues it once the
    // first is in); returns whether it did (tile lo+1 is then "ahead": its copies committed).
    __device__ __forceinline__ bool start(const DecodeArgs& a, const Lens& lens, const SmemPlan<C>& sm, int m_tile,
                                          int first_req, int first_j, int lo, int hi) {
        cur = Cursor{first_req, first_j, lens.len(first_req)};
        load_tile<C, kSparse>(a, cur, resolve_row<C, kSparse>(a, cur), sm.kv(0), sm.valid(0), sm.bar(0));
        if constexpr (C::kQInSmem) load_q_smem<C, kSparse>(a, cur.b, m_tile, sm.q());
        cp_async_commit();
        next = cur;
        next_raw = RowRaw{0};
        bool ahead = false;
        if (lo + 1 < hi) {
            next.advance(lens);
            next_raw = resolve_row<C, kSparse>(a, next);
            // same segment (no Q to load), and not a long part that issues its first tile alone
            if (next.j != 0 && (C::kFirstAlone == 0 || hi - lo < C::kFirstAlone)) {
                load_tile<C, kSparse>(a, next, next_raw, sm.kv(1), sm.valid(1), sm.bar(1));
                cp_async_commit();
                ahead = true;
            }
        }
        return ahead;
    }

    // kSpec (the closed form with lengths, decode/split.cuh closed_lens_parts: every part's
    // request b and first tile j known before the lengths): the entries of tiles j and (parts
    // of two or more tiles: two) j + 1, read with the length's load.
    RowRaw spec_raw[2];
    __device__ __forceinline__ void spec_entries(const DecodeArgs& a, int b, int j, bool two) {
        spec_raw[0] = resolve_row<C, kSparse>(a, Cursor{b, j, a.max_len});
        spec_raw[1] = two ? resolve_row<C, kSparse>(a, Cursor{b, j + 1, a.max_len}) : RowRaw{0};
    }
    // Once the length is known (the part's tiles [lo, hi), lo < hi, from tile j of request b):
    // issues tile j with the Q rows, and tile j + 1 when it is in the part, from spec_entries'
    // entries, as start does (but never holding the second tile back: C::kFirstAlone, which
    // only parts of min_chunk >= 4 tiles forced by tuning would meet here); returns whether
    // tile lo + 1 is ahead.
    __device__ __forceinline__ bool start_known(const DecodeArgs& a, const SmemPlan<C>& sm, int m_tile, int b, int j,
                                                int len, int lo, int hi) {
        cur = Cursor{b, j, len};
        load_tile<C, kSparse>(a, cur, spec_raw[0], sm.kv(0), sm.valid(0), sm.bar(0));
        if constexpr (C::kQInSmem) load_q_smem<C, kSparse>(a, b, m_tile, sm.q());
        cp_async_commit();
        next = Cursor{b, j + 1, len};
        next_raw = spec_raw[1];
        if (lo + 1 < hi) {
            load_tile<C, kSparse>(a, next, next_raw, sm.kv(1), sm.valid(1), sm.bar(1));
            cp_async_commit();
            return true;
        }
        return false;
    }

    // Waits until tile x is in shared memory and every thread is past the previous tile.
    // kBulkRows: the rows on the stage's barrier (phase parity: the stage's uses so far), the
    // cp.async groups then hold only the Q rows (none without a Q tile).
    __device__ __forceinline__ void wait(bool ahead, const SmemPlan<C>& sm, int stage, int parity) const {
        if (!kBulkRows<C, kSparse> || C::kQInSmem) {
            if (ahead) {
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
        }
        if constexpr (kBulkRows<C, kSparse>) mbar_wait(sm.bar(stage), parity);
        __syncthreads();
    }

    // After tile x's Q rows were read (seg_start: tile x started a segment): tile x+1, unless
    // already issued (ahead), into the other stage (freed by the barrier of wait()); then the
    // table entries of tile x+2. Returns whether tile x+1 starts a segment.
    __device__ __forceinline__ bool issue_next(const DecodeArgs& a, const Lens& lens, const SmemPlan<C>& sm, int m_tile,
                                               int stage, int x, int hi, bool ahead, bool seg_start) {
        after = next;
        after_raw = RowRaw{0};
        const bool next_seg = x + 1 < hi && next.j == 0;
        if (x + 1 < hi && !ahead) {
            if (C::kQInSmem && seg_start && next_seg) __syncthreads();  // the Q tile was just read: let every warp finish
            load_tile<C, kSparse>(a, next, next_raw, sm.kv(stage ^ 1), sm.valid(stage ^ 1), sm.bar(stage ^ 1));
            if (C::kQInSmem && next_seg) load_q_smem<C, kSparse>(a, next.b, m_tile, sm.q());
            cp_async_commit();
        }
        if (x + 2 < hi) {
            after.advance(lens);
            after_raw = resolve_row<C, kSparse>(a, after);
        }
        return next_seg;
    }

    // After tile x is computed: whether tile x+2 goes into tile x's stage now, or must wait
    // for the next iteration (when tile x+1 starts a segment, next_seg, and so does x+2: its
    // Q rows would overwrite x+1's; and always without C::kIssueAfter: then tile x+2 is issued
    // by issue_next at the top of iteration x+1, after its wait's barrier, and no barrier
    // of its own is needed).
    __device__ __forceinline__ bool can_issue_after(int x, int hi, bool next_seg) const {
        return C::kIssueAfter && x + 2 < hi && !(C::kQInSmem && next_seg && after.j == 0);
    }

    // Tile x+2 into tile x's stage (kv_cur), once every warp is done with it (and with the Q
    // tile).
    __device__ __forceinline__ void issue_after(const DecodeArgs& a, const SmemPlan<C>& sm, int m_tile, uint8_t* kv_cur,
                                                int stage) const {
        __syncthreads();
        load_tile<C, kSparse>(a, after, after_raw, kv_cur, sm.valid(stage), sm.bar(stage));
        if (C::kQInSmem && after.j == 0) load_q_smem<C, kSparse>(a, after.b, m_tile, sm.q());
        cp_async_commit();
    }

    // Tile x+1 becomes the current tile.
    __device__ __forceinline__ void advance() {
        cur = next;
        next = after;
        next_raw = after_raw;
    }
};

// ---- the phases ---------------------------------------------------------------------------
// The kernel's loop body is a sequence of phases, each a __forceinline__ function: wait for
// tile x (TilePipeline::wait), start a segment (start_segment), issue the next tile
// (TilePipeline::issue_next), scores (score_partials, sum_partials, read_scores), softmax
// (softmax_tile; with kSharedSoftmax one per tile: softmax_rows), P V (pv_tile; or
// pv_prefetch + pv_shared), write a finished segment (write_segment), issue the tile after
// next (TilePipeline::issue_after). The kernel prepares their lane-dependent operands
// (which row and 8-column half of a staged tile a lane addresses, its fragment row g and
// column pair tq) once, so that the compiler sees the same expressions as when the phases
// were written inline: arithmetic on lane ids inside a phase is simplified before inlining,
// differently, and moved registers at the 255 cap.

// ---- fp8 without a Q tile: a segment's Q fragments from global memory ------------------------
// Every lane loads its A fragments of the request's rows (decode/fp8_phases.cuh: latent steps
// k-permuted) at the segment's start. (Loaded before the tile's wait, or the part's first
// before the loop, the streaming rows lost 3-9 %: the loop's code moved; docs/PERFORMANCE.md
// log #46.) (load_q_frags' row addressing, written out again: through a shared helper the
// two-m-tile kernels' SASS moved on sm_90 and sm_120.)
template <typename C, bool kSparse>
__device__ __forceinline__ void fp8_load_q(const DecodeArgs& a, int b, int m_tile, int kh,
                                           uint32_t (&qf)[C::kMTiles][C::kQFrags][4]) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int m = hf < C::kFragRows ? m_tile * C::kBlockM + mt * 16 + g + 8 * hf : a.m_rows;
            const uint8_t* qn = nullptr;
            const uint8_t* qr = nullptr;
            if (m < a.m_rows) {
                int token, head;
                row_token_head<kSparse>(a, b, m, token, head);
                qn = a.q_nope + (token * a.qn_ts + head * a.qn_hs) * 2;
                qr = a.q_rope + (token * a.qr_ts + head * a.qr_hs) * 2;
            }
            fp8_q_from_global<C>(qn, qr, hf, kh, qf[mt]);
        }
}

// ---- phase: start a segment -----------------------------------------------------------------
// At the first tile of a request in this part: this warp's Q fragments (A operands of its k16
// steps kh * kSKSteps ..) from the staged Q tile (ldmatrix row qrow, 8-column half col_half;
// the load was issued with the tile) or, without a Q tile, from global memory; and empty
// accumulators (running max -inf, sum 0, o 0).
template <typename C, bool kSparse>
__device__ __forceinline__ void start_segment(const DecodeArgs& a, const uint8_t* q_s, int b, int m_tile, int qrow,
                                              int kh, int col_half, uint32_t (&qf)[C::kMTiles][C::kQFrags][4],
                                              float (&rowf)[C::kMTiles][2], float (&m_run)[C::kMTiles][2],
                                              float (&l_run)[C::kMTiles][2], float (&o)[C::kMTiles][C::kONTiles][4]) {
    constexpr int kMT = C::kMTiles;
    if constexpr (C::Format::kFp8) {
        // the fp8 path's fragments (decode/fp8_phases.cuh): latent steps k-permuted
        if constexpr (C::kQInSmem) {
            fp8_q_from_smem<C>(smem_u32(q_s), kh, qrow, col_half, qf[0]);
        } else {
            fp8_load_q<C, kSparse>(a, b, m_tile, kh, qf);
        }
        constexpr bool kBf16 = std::is_same<typename C::Format::Elem, __nv_bfloat16>::value;
        if constexpr (kBf16) {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) fp8_q_bf16_to_f16<C>(qf[mt], rowf[mt]);
        } else if constexpr (C::kRopeLoSteps > 0) {  // f16 queries' RoPE steps as bf16 hi + lo
            fp8_q_f16_rope_split<C>(qf[0]);
        }
        if constexpr (C::kMaskAdd) {  // S's partials come scaled to the log2 domain
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) rowf[mt][hf] = (kBf16 ? rowf[mt][hf] : 1.f) * a.scale_log2;
        }
    } else if constexpr (C::kQInSmem) {
        const uint32_t q_base = smem_u32(q_s);
#pragma unroll
        for (int ks = 0; ks < C::kSKSteps; ++ks) {
            const int kk = kh * C::kSKSteps + ks;
            ldmatrix_a<C::kHalfM>(qf[0][ks], q_base + q_chunk<C>(qrow, kk * 2 + col_half) * 16);
        }
    } else {
        load_q_frags<C, kSparse>(a, b, m_tile, kh, qf);
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
}

// ---- phase: scores --------------------------------------------------------------------
// S = Q K^T for this warp's share: its 16 of the tile's 32 rows (ldmatrix row krow of the
// staged tile) x the CTA's query rows (qf: A fragments of every m-tile), over its k16 steps
// kk0 .. kk0 + kSKSteps - 1 of the QK width; col_half (0 or 1) picks the lane's 8-column half
// of each k16 step. The result, one float4 per lane and (m-tile, n8 tile), goes to this
// warp's S partials, slot part_slot((warp * kMTiles + mt) * 2 + n, lane), for sum_partials,
// read_scores or softmax_rows.
template <typename T, typename C>
__device__ __forceinline__ void score_partials(uint32_t kv_base, const uint32_t (&qf)[C::kMTiles][C::kQFrags][4],
                                               int krow, int kk0, int col_half, float4* part_s, int warp, int lane) {
    constexpr int kMT = C::kMTiles;
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
#pragma unroll
    for (int ks = 0; ks < C::kSKSteps; ++ks) {
        const int kk = kk0 + ks;
        uint32_t bfr[4];
        C::Format::k_frag(bfr, kv_base, krow, kk, col_half);
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
            store_partial<C>(part_s, part_slot<C>((warp * kMT + mt) * 2 + n, lane), v);
        }
}

// The transposed form (kT16): Sᵀ = K Qᵀ for this warp's 16 tile rows, K as the A operand
// (krow, col_half: the lane's ldmatrix row and k half in A order, rows 8-15 in the second
// matrix) and the query's fragments a0 / a2 of rows g as Qᵀ's b0 / b1: one MMA per k16 step.
// Stored to the S partials at S's own positions (store_partials_t).
template <typename T, typename C>
__device__ __forceinline__ void score_partials_t(uint32_t kv_base, const uint32_t (&qf)[C::kQFrags][4], int krow,
                                                 int kk0, int col_half, float4* part_s, int warp, int lane) {
    float acc[2][4];
#pragma unroll
    for (int par = 0; par < 2; ++par) acc[par][0] = acc[par][1] = acc[par][2] = acc[par][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < C::kSKSteps; ++ks) {
        uint32_t af[4];
        C::Format::k_frag(af, kv_base, krow, kk0 + ks, col_half);
        mma16816<T>(acc[ks & 1], af, qf[ks][0], qf[ks][2]);
    }
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = acc[0][i] + acc[1][i];
    store_partials_t<C>(part_s, v, warp, lane >> 2, lane & 3);
}

// ---- phase: sum the partials (configurations whose warps split the QK width in four) ----
// Sums the four k-quarter partials in place: a unit is one half (rows g or g+8; with a half
// m-tile only rows g) of one (n-half, m-tile, n8 tile) fragment, a float2; warp w adds up
// units w, w+8, ..., quarters in order, into quarter 0's slot. Between two barriers.
template <typename C>
__device__ __forceinline__ void sum_partials(float4* part_s, int warp, int lane) {
    constexpr int kMT = C::kMTiles, kH = C::kFragRows;  // float2 units per fragment slot
    __builtin_assume(warp >= 0 && warp < C::kWarps);
#pragma unroll
    for (int u = warp; u < kH * 2 * kMT * 2; u += C::kWarps) {
        const int h = u % kH, n = (u / kH) & 1, mt = (u / kH / 2) % kMT, nhu = (u / kH / 2) / kMT;
        const int slot = part_slot<C>((nhu * kMT + mt) * 2 + n, lane);
        float2* p = C::kHalfM ? reinterpret_cast<float2*>(part_s) + slot : reinterpret_cast<float2*>(part_s + slot) + h;
        float2 acc = *p;
#pragma unroll
        for (int q = 1; q < 4; ++q) {
            // warp nhu + q*kSplitN, same m-tile and n8 tile
            const float2 u2 = *(p + q * part_slot<C>(C::kSplitN * kMT * 2, 0) * kH);
            acc.x += u2.x;
            acc.y += u2.y;
        }
        *p = acc;
    }
}

// ---- phase: read the scores ------------------------------------------------------------
// The whole tile's S for the lane's fragment rows, from the summed partials: s[mt][jn] is n8
// tile jn (tile rows 8 jn ..) of m-tile mt, in mma accumulator layout. Every warp reads the
// same values in the same order, so all warps agree on the softmax.
template <typename C>
__device__ __forceinline__ void read_scores(const float4* part_s, int lane, float (&s)[C::kMTiles][4][4]) {
    constexpr int kMT = C::kMTiles;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int jn = 0; jn < 4; ++jn) {
            const int nhj = jn >> 1, ntl = jn & 1;
            const float4 p0 = load_partial<C>(part_s, part_slot<C>((nhj * kMT + mt) * 2 + ntl, lane));
            if constexpr (C::kSplitK == 2) {
                const float4 p1 = load_partial<C>(part_s, part_slot<C>(((nhj + C::kSplitN) * kMT + mt) * 2 + ntl, lane));
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
}

// The max a tile's probabilities are taken against (online softmax): the running one while
// the tile's max exceeds it by at most kMaxSlack (log2 units), else the tile's max. P then
// lies in [0, 2^8] (fp8_ds_mla's P'': 2^9), as exact in f16/bf16 as below 1, and o needs no
// rescale for most tiles: the max of a row rarely jumps by 8 after its first tiles (1-1.6 %
// faster on the many-head rows, log #58). lse = m + log2(l) holds for any such m. Not in the
// 8-warp one-m-tile configurations (small steps: 0.1-0.25 µs slower with it; TileConfig::
// kLazyMax).
constexpr float kMaxSlack = 8.f;
__device__ __forceinline__ float lazy_max(float m_run, float mx) { return mx > m_run + kMaxSlack ? mx : m_run; }

// ---- phase: softmax ---------------------------------------------------------------------
// Masks the tile's scores (rows whose valid flag is 0; dense: rows past the causal limit of
// each query row), scales them to the log2 domain and turns them into probabilities against
// the running max (online softmax): updates m_run and l_run (the running max and sum per
// fragment row), and rescales o when the max moved. pos0: the tile's first position in its
// request; len: the request's clamped length; g, tq: the lane's fragment row and column pair.
//
// fp8 rows (kMaskAdd, log #83): S comes scaled to the log2 domain and the valid flags are
// additive masks (a masked row was zero-filled, so its score is 0 and 0 + -inf = -inf; NaN only
// for a query that is not finite, whose output is not finite either way): one add per score
// instead of a flag compare, a select and a multiply (dense steps keep the compare against the
// causal limit: a branch around it, taken only in the tiles that reach it, measured 1.5-3.6 %
// slower on the dense fp8_ds_mla 16-row rows).
template <typename C, bool kSparse>
__device__ __forceinline__ void softmax_tile(const DecodeArgs& a, float (&s)[C::kMTiles][4][4], const int32_t* valid_lane,
                                             int pos0, int len, int m_tile, int g, int tq, uint32_t kv_base, int warp,
                                             float (&m_run)[C::kMTiles][2], float (&l_run)[C::kMTiles][2],
                                             float (&o)[C::kMTiles][C::kONTiles][4]) {
    constexpr int kMT = C::kMTiles;
    // fp8_ds_mla: the V scales of the lane's columns go into the max and into P
    // (decode/fp8_phases.cuh: the scale-aware running max)
    constexpr bool kVScaled = C::Format::kFp8 && C::Format::kDsMla;
    float vsc[4][2], vlg[4][2];
    if constexpr (kVScaled) fp8_v_scales<C>(kv_base, warp, tq, vsc, vlg);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
        float alpha[2] = {1.f, 1.f};
#pragma unroll
        for (int hf = 0; hf < C::kFragRows; ++hf) {
            // Causal limit of query row qm (dense MTP): position i = qm / num_heads of q_len sees
            // cache rows < len - q_len + i + 1 (recomputed per tile: no registers held across the
            // loop). The fp8 one-m-tile kernels divide with the host's multiplier (heads_div: 3
            // instructions instead of ~30, log #74); the 16-bit kernels keep the division (with
            // heads_div their code moved: dense b=64 1.2 % slower) and so does the fp8 32-row one.
            const int qm = m_tile * C::kBlockM + mt * 16 + g + 8 * hf;
            float mx = -INFINITY;
            if constexpr (C::kMaskAdd) {
                const int row_lim = kSparse ? 0 : len - a.q_len + 1 + (kMT == 1 ? a.heads_div.div(qm) : qm / a.num_heads);
#pragma unroll
                for (int jn = 0; jn < 4; ++jn)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float v = s[mt][jn][hf * 2 + e] + __int_as_float(valid_lane[jn * 8 + e]);
                        s[mt][jn][hf * 2 + e] = kSparse || pos0 + jn * 8 + 2 * tq + e < row_lim ? v : -INFINITY;
                    }
#pragma unroll
                for (int jn = 0; jn < 4; ++jn)
#pragma unroll
                    for (int e = 0; e < 2; ++e) mx = fmaxf(mx, kVScaled ? s[mt][jn][hf * 2 + e] + vlg[jn][e] : s[mt][jn][hf * 2 + e]);
            } else {
                const int row_lim = kSparse ? 0x7fffffff : len - a.q_len + 1 + qm / a.num_heads;
#pragma unroll
                for (int jn = 0; jn < 4; ++jn)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = jn * 8 + 2 * tq + e;
                        const bool ok = valid_lane[jn * 8 + e] != 0 && pos0 + col < row_lim;
                        const float v = ok ? s[mt][jn][hf * 2 + e] * a.scale_log2 : -INFINITY;
                        s[mt][jn][hf * 2 + e] = v;
                        mx = fmaxf(mx, v);
                    }
            }
            mx = warp_max4(mx);
            const float m_new = C::kLazyMax ? lazy_max(m_run[mt][hf], mx) : fmaxf(m_run[mt][hf], mx);
            const float base = (m_new == -INFINITY) ? 0.f : m_new;
            alpha[hf] = fast_exp2(m_run[mt][hf] - base);  // m_run = -inf -> 0
            float sum = 0.f;
#pragma unroll
            for (int jn = 0; jn < 4; ++jn)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pe = fast_exp2(s[mt][jn][hf * 2 + e] - base);
                    s[mt][jn][hf * 2 + e] = kVScaled ? pe * vsc[jn][e] : pe;
                    sum += pe;
                }
            l_run[mt][hf] = l_run[mt][hf] * alpha[hf] + sum;
            m_run[mt][hf] = m_new;
        }
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // the running max moved
            if constexpr (kOT<C>) {  // o is Oᵀ: this lane's query rows are 2tq and 2tq + 1
                const float a0 = __shfl_sync(0xffffffffu, alpha[0], 8 * tq), a1 = __shfl_sync(0xffffffffu, alpha[0], 8 * tq + 4);
#pragma unroll
                for (int c = 0; c < C::kONTiles / 2; ++c) {
                    o[mt][c][0] *= a0;
                    o[mt][c][1] *= a1;
                    o[mt][c][2] *= a0;
                    o[mt][c][3] *= a1;
                }
            } else {
#pragma unroll
                for (int n = 0; n < C::kONTiles; ++n) {
                    o[mt][n][0] *= alpha[0];
                    o[mt][n][1] *= alpha[0];
                    if constexpr (!C::kHalfM) {
                        o[mt][n][2] *= alpha[1];
                        o[mt][n][3] *= alpha[1];
                    }
                }
            }
        }
    }
}

// ---- phase: P V ----------------------------------------------------------------------------
// O += P V for k16 step kk of the tile (pa: P's A fragments for every m-tile, packed to the
// element type) over this warp's kODims output dims, the tile's rows read transposed
// (ldmatrix .trans, row vrow0 of the step); every V fragment serves every m-tile. vf: the
// step's V fragments when already loaded (pv_prefetch), else nullptr.
template <typename T, typename C>
__device__ __forceinline__ void pv_step(uint32_t kv_base, const uint32_t (&pa)[C::kMTiles][4], int kk, int vrow0,
                                        int warp, int col_half, const uint32_t (*vf)[4],
                                        float (&o)[C::kMTiles][C::kONTiles][4]) {
    const int vrow = kk * 16 + vrow0;
#pragma unroll
    for (int pr = 0; pr < C::kONTiles / 2; ++pr) {
        uint32_t bfr[4];
        if (vf != nullptr) {
            bfr[0] = vf[pr][0], bfr[1] = vf[pr][1], bfr[2] = vf[pr][2], bfr[3] = vf[pr][3];
        } else {
            C::Format::v_frag(bfr, kv_base, vrow, (warp * C::kODims + pr * 16) / 8 + col_half);
        }
#pragma unroll
        for (int mt = 0; mt < C::kMTiles; ++mt) {
            mma16816<T>(o[mt][2 * pr], pa[mt], bfr[0], bfr[1]);
            mma16816<T>(o[mt][2 * pr + 1], pa[mt], bfr[2], bfr[3]);
        }
    }
}

// The tile's P V with P from the softmax's registers (s, accumulator layout).
template <typename T, typename C>
__device__ __forceinline__ void pv_tile(uint32_t kv_base, const float (&s)[C::kMTiles][4][4], int vrow0, int warp, int col_half,
                                        float (&o)[C::kMTiles][C::kONTiles][4]) {
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
        uint32_t pa[C::kMTiles][4];
        p_frags<T, C>(s, kk, pa);
        pv_step<T, C>(kv_base, pa, kk, vrow0, warp, col_half, nullptr, o);
    }
}

// The transposed form (kT16): Oᵀ += Vᵀ Pᵀ, a 16-dim chunk of the warp's as M (Vᵀ's A fragment
// from ldmatrix .trans: vrow0 / col_half the lane's row and 8-dim half in A order, rows 8-15 in
// the third matrix), the 8 query rows as N (P's fragments of rows g as the B operand).
template <typename T, typename C>
__device__ __forceinline__ void pv_tile_t(uint32_t kv_base, const float (&s)[1][4][4], int vrow0, int warp,
                                          int col_half, float (&o)[1][C::kONTiles][4]) {
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
        uint32_t pa[1][4];
        p_frags<T, C>(s, kk, pa);
#pragma unroll
        for (int c = 0; c < C::kODims / 16; ++c) {
            uint32_t va[4];
            C::Format::v_frag(va, kv_base, kk * 16 + vrow0, (warp * C::kODims + c * 16) / 8 + col_half);
            mma16816<T>(o[0][c], va, pa[0][0], pa[0][2]);
        }
    }
}

// The CTA query row whose softmax this lane computes (softmax_rows): rows g0, g0 + 8, g0 + 1,
// g0 + 9 of an m-tile per warp, in that order by 8-lane group, so that each half-warp takes one
// fragment row g of both halves: with the partials' pads (part_slot) its 64-bit partial loads
// are conflict-free (2 wavefronts each; logs #81, #82).
template <typename C>
__host__ __device__ __forceinline__ constexpr int soft_row(int warp, int lane) {
    const int rl = lane >> 3;
    return (warp >> 2) * 16 + 2 * (warp & 3) + (rl >> 1) + 8 * (rl & 1);
}

// Float offset in the S partials of the pair of scores (columns c, c + 1 of CTA query row `row`,
// c even) that softmax_rows reads from k-split part 0 (part q: + q * kPartialQStride<C>).
template <typename C>
constexpr int kPartialQStride = part_slot<C>(C::kSplitN * C::kMTiles * 2, 0) * 4;  // floats between k parts
template <typename C>
__host__ __device__ __forceinline__ constexpr int softmax_partial_at(int row, int c) {
    const int mt = row >> 4, g = row & 7, hf = (row >> 3) & 1;
    // columns c, c + 1 lie in n8 tile jn, from fragment lane wl
    const int jn = c >> 3, wl = g * 4 + ((c & 7) >> 1);
    return part_slot<C>(((jn >> 1) * C::kMTiles + mt) * 2 + (jn & 1), wl) * 4 + hf * 2;
}

// Whether softmax_rows' 64-bit S-partial loads in configuration C are free of bank conflicts:
// for every warp, k-split part and column pair, each half-warp's sixteen 8-byte words fall on
// 32 distinct banks (one wavefront). The layout invariant of logs #81 and #82 (soft_row's
// order, part_slot's pads), checked at compile time by softmax_rows.
template <typename C>
constexpr bool partial_loads_conflict_free() {
    for (int warp = 0; warp < C::kWarps; ++warp)
        for (int q = 0; q < C::kSplitK; ++q)
            for (int i = 0; i < 4; i += 2)
                for (int half = 0; half < 2; ++half) {
                    bool used[32] = {};
                    for (int lane = 16 * half; lane < 16 * half + 16; ++lane) {
                        const int at = softmax_partial_at<C>(soft_row<C>(warp, lane), (lane & 7) * 4 + i) +
                                       q * kPartialQStride<C>;
                        for (int w = 0; w < 2; ++w) {
                            if (used[(at + w) % 32]) return false;
                            used[(at + w) % 32] = true;
                        }
                    }
                }
    return true;
}

// ---- phase: one softmax per tile (kSharedSoftmax) -------------------------------------------
// Instead of every warp redoing the whole tile's softmax: this warp's kSoftRows = 4 query rows
// (lane = 8 rl + cb: row rl of the warp's, tile columns 4 cb .. 4 cb + 3): their
// S summed from the k-split partials (quarters in order), masked (valid flags; dense: the
// causal limit), scaled to the log2 domain, and the online softmax against the row's running
// max m_own (l_own: this lane's share of the running sum; row_qi: the row's query position,
// for the causal limit). Writes P (the element type) to the P tile, the row's rescale factor
// for o to alpha, and at a segment's end the row's (sum, max) to stats; every warp reads them
// after the next barrier (pv_shared, write_segment). Returns whether the row's running max
// moved (its o needs the rescale; an unmoved max leaves alpha = 1, or 0 on a row with no
// score yet, whose o is still zero): the barrier after it ORs that over the CTA.
template <typename C, bool kSparse>
__device__ __forceinline__ bool softmax_rows(const DecodeArgs& a, const float4* part_s, const int32_t* valid, int pos0,
                                             int len, int row_qi, bool seg_end, int warp, int lane, const SmemPlan<C>& sm,
                                             float& m_own, float& l_own) {
    // P's element type: the query's, or f16 for the fp8 P V (fp8_pv_step)
    using T = std::conditional_t<C::Format::kFp8, __half, typename C::Format::Elem>;
    static_assert(C::kSoftRows == 4 && !C::kHalfM, "4 rows per warp, 8 lanes per row, 4 columns per lane");
    static_assert(partial_loads_conflict_free<C>(), "softmax_rows' partial loads conflict (soft_row, part_slot)");
    const int c0 = (lane & 7) * 4;
    const int row = soft_row<C>(warp, lane);
    // S: columns c0 .. c0 + 3 lie in one n8 tile, pairs from fragment lanes wl, wl + 1
    const float* fp = reinterpret_cast<const float*>(part_s);
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
        const int at = softmax_partial_at<C>(row, c0 + i);
        float2 acc = *reinterpret_cast<const float2*>(fp + at);
#pragma unroll
        for (int q = 1; q < C::kSplitK; ++q) {
            const float2 u = *reinterpret_cast<const float2*>(fp + at + q * kPartialQStride<C>);
            acc.x += u.x;
            acc.y += u.y;
        }
        v[i] = acc.x;
        v[i + 1] = acc.y;
    }
    const int4 ok = *reinterpret_cast<const int4*>(valid + c0);
    // causal limit of this query row (dense MTP; row_qi: its query position), as softmax_tile
    const int row_lim = kSparse ? 0x7fffffff : len - a.q_len + 1 + row_qi;
    if constexpr (kMaskBits<C, kSparse>) {  // sparse 16-bit rows: the flags are additive masks
        static_assert(kSparse, "dense rows keep the flags (and the causal compare)");
        v[0] = fmaf(v[0], a.scale_log2, __int_as_float(ok.x));
        v[1] = fmaf(v[1], a.scale_log2, __int_as_float(ok.y));
        v[2] = fmaf(v[2], a.scale_log2, __int_as_float(ok.z));
        v[3] = fmaf(v[3], a.scale_log2, __int_as_float(ok.w));
    } else {
        v[0] = (ok.x != 0 && pos0 + c0 < row_lim) ? v[0] * a.scale_log2 : -INFINITY;
        v[1] = (ok.y != 0 && pos0 + c0 + 1 < row_lim) ? v[1] * a.scale_log2 : -INFINITY;
        v[2] = (ok.z != 0 && pos0 + c0 + 2 < row_lim) ? v[2] * a.scale_log2 : -INFINITY;
        v[3] = (ok.w != 0 && pos0 + c0 + 3 < row_lim) ? v[3] * a.scale_log2 : -INFINITY;
    }
    float mx = fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3]));
#pragma unroll
    for (int d = 1; d < 8; d <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
    const float m_new = C::kLazyMax ? lazy_max(m_own, mx) : fmaxf(m_own, mx);
    const float base = (m_new == -INFINITY) ? 0.f : m_new;
    const float alpha = fast_exp2(m_own - base);  // m_own = -inf -> 0
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = fast_exp2(v[i] - base);
        sum += v[i];
    }
    l_own = l_own * alpha + sum;
    const bool moved = m_new != m_own;
    m_own = m_new;
    *reinterpret_cast<uint2*>(sm.p_tile() + row * C::kPRowBytes + c0 * 2) =
        make_uint2(Elem<T>::pack(v[0], v[1]), Elem<T>::pack(v[2], v[3]));
    const bool first = (lane & 7) == 0;
    if (first) sm.alpha()[row] = alpha;
    if (seg_end) {
        float l = l_own;
#pragma unroll
        for (int d = 1; d < 8; d <<= 1) l += __shfl_xor_sync(0xffffffffu, l, d);
        if (first) sm.stats()[row] = make_float2(l, m_own);
    }
    return moved;
}

// ---- phase: P V from the shared P tile (kSharedSoftmax) ---------------------------------------
// o rescaled by the rows' factors (rescale_shared), then O += P V over this warp's kODims
// output dims with P's A fragments read from the P tile (ldmatrix, p_frags_shared) and V as
// pv_tile reads it (pv_shared, fp8_pv_shared).
// The V fragments of P V's first k16 step (they do not depend on P): loaded before the
// barrier that publishes P, so that their latency overlaps the wait.
template <typename C>
__device__ __forceinline__ void pv_prefetch(uint32_t kv_base, int vrow0, int warp, int col_half,
                                            uint32_t (&vf)[C::kONTiles / 2][4]) {
#pragma unroll
    for (int pr = 0; pr < C::kONTiles / 2; ++pr)
        C::Format::v_frag(vf[pr], kv_base, vrow0, (warp * C::kODims + pr * 16) / 8 + col_half);
}

// o rescaled by its rows' factors from the shared softmax.
// kFlag (16-bit rows): only where a row's running max moved (`moved`: softmax_rows' flags ORed
// by the barrier before P V), so the common tile, whose lazy max did not move, neither loads
// the factors nor waits for them (log #80: −2…−5 % on the sparse many-head rows and the
// 16-row CTAs' rows).
// Else (per-tensor fp8, where the flag measured 0.8 % slower with 32 rows, log #80): with two
// m-tiles always (skipping it by a warp vote measured 1-3 % slower there, log #54); with one,
// only when a max moved (by a warp vote: unconditional, the sm_120 build of the 4-warp kernel
// spills).
template <typename C, bool kFlag>
__device__ __forceinline__ void rescale_shared(const SmemPlan<C>& sm, int g, bool moved,
                                               float (&o)[C::kMTiles][C::kONTiles][4]) {
    constexpr int kMT = C::kMTiles;
    static_assert(!C::kHalfM, "full m-tiles (softmax_rows)");
    if (kFlag && !moved) return;
    const float* alpha_s = sm.alpha();
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
        const float a0 = alpha_s[mt * 16 + g], a1 = alpha_s[mt * 16 + g + 8];
        if (!kFlag && kMT == 1 && !__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) continue;
#pragma unroll
        for (int n = 0; n < C::kONTiles; ++n) {
            o[mt][n][0] *= a0;
            o[mt][n][1] *= a0;
            o[mt][n][2] *= a1;
            o[mt][n][3] *= a1;
        }
    }
}

// The lane's ldmatrix address of P's A fragments (m-tile 0, k16 step 0) in the P tile.
template <typename C>
__device__ __forceinline__ uint32_t p_tile_addr(const SmemPlan<C>& sm, int lane) {
    // the lane's ldmatrix row and 8-column half of P (ldmatrix_a)
    return smem_u32(sm.p_tile()) + (lane & 15) * C::kPRowBytes + (lane >> 4) * 16;
}

// P's A fragments for k16 step kk from the shared P tile (p_base: p_tile_addr).
template <typename C>
__device__ __forceinline__ void p_frags_shared(uint32_t p_base, int kk, uint32_t (&pa)[C::kMTiles][4]) {
#pragma unroll
    for (int mt = 0; mt < C::kMTiles; ++mt) ldmatrix_x4(pa[mt], p_base + mt * 16 * C::kPRowBytes + kk * 32);
}

// The tile's P V from the shared P tile, o first rescaled (16-bit rows; vf: the first step's
// V fragments, pv_prefetch).
template <typename T, typename C>
__device__ __forceinline__ void pv_shared(uint32_t kv_base, const SmemPlan<C>& sm, int g, int lane, int vrow0, int warp,
                                          int col_half, const uint32_t (&vf)[C::kONTiles / 2][4], bool moved,
                                          float (&o)[C::kMTiles][C::kONTiles][4]) {
    rescale_shared<C, true>(sm, g, moved, o);
    const uint32_t p_base = p_tile_addr<C>(sm, lane);
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
        uint32_t pa[C::kMTiles][4];
        p_frags_shared<C>(p_base, kk, pa);
        pv_step<T, C>(kv_base, pa, kk, vrow0, warp, col_half, kk == 0 ? vf : nullptr, o);
    }
}

// The fp8 P V from the shared P tile (per-tensor fp8: P in f16).
template <typename C>
__device__ __forceinline__ void fp8_pv_shared(uint32_t kv_base, const SmemPlan<C>& sm, int g, int lane, int vrow0,
                                              int warp, int col_half, float (&o)[C::kMTiles][C::kONTiles][4]) {
    rescale_shared<C, false>(sm, g, true, o);
    const uint32_t p_base = p_tile_addr<C>(sm, lane);
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
        uint32_t pa[C::kMTiles][4];
        p_frags_shared<C>(p_base, kk, pa);
        fp8_pv_step<C>(kv_base, pa, kk, vrow0, warp, col_half, o);
    }
}

// ---- phase: write a finished segment ----------------------------------------------------
// The pieces of split requests are stored with L2 priority evict_last (st_l2_last): decode
// writes them while it streams the rest of the cache through L2, and the combine reads them
// after it; stored plainly, the early pieces were evicted and read back from DRAM (log #99:
// 1024 x 127 + 65,536 h=16 -4.6 %, b=16 l=4096 -4 %, fp8_ds_mla b=64 -5 %). Not in the 32-row
// configuration, whose many-head steps split few requests and whose loop, at sm_120's register
// cap, ran 3 % slower with the hinted stores (dense b=64 h=64, where nothing is split).
template <typename C>
constexpr bool kPiecesL2Last = C::kMTiles == 1;

// The end of a request's rows in this part: normalizes o by the running sum and writes this
// lane's dims of each fragment row (dims col0 + 8 n) with the lse: straight to out and lse
// when the whole request lay in this part (whole), else as this part's piece of a split
// request to workspace slot `slot` (decode/split.cuh) for the combine. (kLTotal: l_run holds
// each row's whole sum, from the shared softmax's stats, not the quad's shares.)
template <typename T, bool kSparse, typename C, bool kLTotal = false>
__device__ __forceinline__ void write_segment(const DecodeArgs& a, const Cursor& cc, int seg_j0, int part, int first_req,
                                              int m_tile, int g, int warp, int tq,
                                              const float (&o)[C::kMTiles][C::kONTiles][4],
                                              const float (&m_run)[C::kMTiles][2], const float (&l_run)[C::kMTiles][2]) {
    constexpr int kMT = C::kMTiles;
    const int b = cc.b;
    const bool whole = (seg_j0 == 0) && (cc.j + 1 == cc.ntiles());
    const int slot = ws_slot(part, cc.b == first_req ? 0 : 1);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < C::kFragRows; ++hf) {
            const float l = kLTotal ? l_run[mt][hf] : warp_sum4(l_run[mt][hf]);  // kLTotal: the row's whole sum
            float inv = l > 0.f ? fast_rcp(l) : 0.f;
            if constexpr (C::Format::kFp8 && !C::Format::kDsMla) inv *= *a.kv_scale;  // per-tensor: V's scale
            const float lse2 = l > 0.f ? m_run[mt][hf] + fast_log2(l) : -INFINITY;
            if constexpr (kT16<C>) {
                // o is Oᵀ with dims g, g + 8 of each chunk (pv_tile_t): lanes g and g ^ 1 swap
                // halves, so that an even g writes query row 2tq's dims (g, g + 1) and (g + 8,
                // g + 9), an odd g row 2tq + 1's dims (g - 1, g) and (g + 7, g + 8)
                const float inv0 = __shfl_sync(0xffffffffu, inv, 8 * tq), inv1 = __shfl_sync(0xffffffffu, inv, 8 * tq + 4);
                const int e = g & 1;
                const int me = m_tile * C::kBlockM + 2 * tq + e;
                float lo[C::kODims / 16][2], hi[C::kODims / 16][2];
#pragma unroll
                for (int c = 0; c < C::kODims / 16; ++c) {
                    const float x0 = o[mt][c][0] * inv0, x1 = o[mt][c][1] * inv1;
                    const float x2 = o[mt][c][2] * inv0, x3 = o[mt][c][3] * inv1;
                    const float r0 = __shfl_xor_sync(0xffffffffu, e ? x0 : x1, 4);
                    const float r1 = __shfl_xor_sync(0xffffffffu, e ? x2 : x3, 4);
                    lo[c][0] = e ? r0 : x0;
                    lo[c][1] = e ? x1 : r0;
                    hi[c][0] = e ? r1 : x2;
                    hi[c][1] = e ? x3 : r1;
                }
                if (me < a.m_rows) {
                    const int d0 = warp * C::kODims + (g & ~1);  // + 16c: the chunk's dims (d0, d0 + 1), (d0 + 8, d0 + 9)
                    if (whole) {
                        int token, head;
                        row_token_head<kSparse>(a, b, me, token, head);
                        T* dst = reinterpret_cast<T*>(a.out) + token * a.out_ts + head * a.out_hs + d0;
#pragma unroll
                        for (int c = 0; c < C::kODims / 16; ++c) {
                            *reinterpret_cast<uint32_t*>(dst + 16 * c) = Elem<T>::pack(lo[c][0], lo[c][1]);
                            *reinterpret_cast<uint32_t*>(dst + 16 * c + 8) = Elem<T>::pack(hi[c][0], hi[c][1]);
                        }
                    } else {
                        const size_t row = static_cast<size_t>(slot) * a.m_rows + me;
                        float* dst = a.ws_o + row * kLatentDim + d0;
#pragma unroll
                        for (int c = 0; c < C::kODims / 16; ++c) {
                            st_l2_last<kPiecesL2Last<C>>(dst + 16 * c, make_float2(lo[c][0], lo[c][1]));
                            st_l2_last<kPiecesL2Last<C>>(dst + 16 * c + 8, make_float2(hi[c][0], hi[c][1]));
                        }
                    }
                }
            } else if constexpr (kSwapPV<C>) {
                // o is Oᵀ: this lane writes query rows 2tq + e, dims 2g and 2g + 1 of each of
                // the warp's 16-dim chunks, with those rows' factors (lanes 8tq, 8tq + 4)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float inv_e = __shfl_sync(0xffffffffu, inv, 8 * tq + 4 * e);
                    const int me = m_tile * C::kBlockM + 2 * tq + e;
                    if (me >= a.m_rows) continue;
                    if (whole) {
                        int token, head;
                        row_token_head<kSparse>(a, b, me, token, head);
                        T* dst = reinterpret_cast<T*>(a.out) + token * a.out_ts + head * a.out_hs + warp * C::kODims + 2 * g;
#pragma unroll
                        for (int c = 0; c < C::kONTiles / 2; ++c)
                            *reinterpret_cast<uint32_t*>(dst + 16 * c) =
                                Elem<T>::pack(o[mt][c][e] * inv_e, o[mt][c][2 + e] * inv_e);
                    } else {
                        const size_t row = static_cast<size_t>(slot) * a.m_rows + me;
                        float* dst = a.ws_o + row * kLatentDim + warp * C::kODims + 2 * g;
#pragma unroll
                        for (int c = 0; c < C::kONTiles / 2; ++c)
                            st_l2_last<kPiecesL2Last<C>>(dst + 16 * c, make_float2(o[mt][c][e] * inv_e, o[mt][c][2 + e] * inv_e));
                    }
                }
            }
            const int m = m_tile * C::kBlockM + mt * 16 + g + 8 * hf;
            if (m < a.m_rows) {
                if constexpr (kOT<C>) {
                    // (the rows' o is written above; the lse of row g here)
                    if (warp == 0 && tq == 0) {
                        if (whole) {
                            if (a.lse != nullptr) {
                                int token, head;
                                row_token_head<kSparse>(a, b, m, token, head);
                                a.lse[token * a.lse_ts + head * a.lse_hs] = lse2 * kLn2;
                            }
                        } else {
                            st_l2_last<kPiecesL2Last<C>>(&a.ws_lse[static_cast<size_t>(slot) * a.m_rows + m], lse2);
                        }
                    }
                } else if (whole) {
                    int token, head;
                    row_token_head<kSparse>(a, b, m, token, head);
                    T* dst = reinterpret_cast<T*>(a.out) + token * a.out_ts + head * a.out_hs + warp * C::kODims + 2 * tq;
                    if constexpr (C::Format::kFp8) {
                        // chunk c's even and odd tiles: dims 16c + 4tq .. + 3 (decode/fp8_phases.cuh)
                        T* d4 = dst + 2 * tq;
#pragma unroll
                        for (int c = 0; c < C::kONTiles / 2; ++c) {
                            *reinterpret_cast<uint2*>(d4 + c * 16) =
                                make_uint2(Elem<T>::pack(o[mt][2 * c][2 * hf] * inv, o[mt][2 * c + 1][2 * hf] * inv),
                                           Elem<T>::pack(o[mt][2 * c][2 * hf + 1] * inv,
                                                         o[mt][2 * c + 1][2 * hf + 1] * inv));
                        }
                    } else {
#pragma unroll
                        for (int n = 0; n < C::kONTiles; ++n) {
                            *reinterpret_cast<uint32_t*>(dst + n * 8) =
                                Elem<T>::pack(o[mt][n][2 * hf] * inv, o[mt][n][2 * hf + 1] * inv);
                        }
                    }
                    if (a.lse != nullptr && warp == 0 && tq == 0) {
                        a.lse[token * a.lse_ts + head * a.lse_hs] = lse2 * kLn2;
                    }
                } else {
                    const size_t row = static_cast<size_t>(slot) * a.m_rows + m;
                    float* dst = a.ws_o + row * kLatentDim + warp * C::kODims + 2 * tq;
                    if constexpr (C::Format::kFp8) {
                        float* d4 = dst + 2 * tq;
#pragma unroll
                        for (int c = 0; c < C::kONTiles / 2; ++c) {
                            st_l2_last<kPiecesL2Last<C>>(
                                d4 + c * 16, make_float4(o[mt][2 * c][2 * hf] * inv, o[mt][2 * c + 1][2 * hf] * inv,
                                                         o[mt][2 * c][2 * hf + 1] * inv, o[mt][2 * c + 1][2 * hf + 1] * inv));
                        }
                    } else {
#pragma unroll
                        for (int n = 0; n < C::kONTiles; ++n) {
                            st_l2_last<kPiecesL2Last<C>>(dst + n * 8, make_float2(o[mt][n][2 * hf] * inv, o[mt][n][2 * hf + 1] * inv));
                        }
                    }
                    if (warp == 0 && tq == 0) st_l2_last<kPiecesL2Last<C>>(&a.ws_lse[row], lse2);
                }
            }
        }
}

// The CTAs per SM the kernel's registers must allow (__launch_bounds__' second argument):
// KernelConfig::kMinCtasSm90 on sm_90 (the fp8 8-row streaming configuration: three per
// H200 SM, log #72), one elsewhere (sm_120 holds two fp8 CTAs by shared memory, and a cap
// would only cost registers).
template <typename C>
constexpr int decode_min_ctas() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1000
    return C::kMinCtasSm90;
#else
    return 1;
#endif
}

// Fmt: the cache-row format (decode/format.cuh); Tile: the tile configuration (config.cuh);
// kWithin: parts within requests (MLA_SPLIT_WITHIN_REQUESTS, decode/split.cuh), a separate
// instantiation so that the flat kernels' code stays as it was (log #75).
// kSpec: the closed form with lengths (decode/split.cuh closed_lens_parts: every part's request and
// tiles known before the lengths), the part's first tiles issued with its length's load; a
// separate instantiation, as kWithin. kAligned: the flat split with lengths takes the aligned
// chunk where they are all equal (decode/split.cuh flat_chunk) and, past kThreads requests,
// finds its part in one round trip (WarpRows); a separate instantiation too.
template <typename Fmt, bool kSparse, typename Tile, bool kWithin = false, bool kSpec = false, bool kAligned = false>
__global__ void __launch_bounds__(Tile::kThreads, decode_min_ctas<KernelConfig<Fmt, Tile>>())
    decode_kernel(const DecodeArgs a) {
    using C = KernelConfig<Fmt, Tile>;
    using T = typename Fmt::Elem;
    MLA_TRACE_AT(kTraceDecode, kTraceDecodeEntry);
    grid_dependency_wait();
    MLA_TRACE_AT(kTraceDecode, kTraceDecodeWaitDone);
    extern __shared__ __align__(128) uint8_t smem[];
    const SmemPlan<C> sm(smem);
    float4* part_s = sm.partials();

    const Lens lens{a.lens, a.max_len};
    const int m_tile = blockIdx.x;
    const int part = blockIdx.y;
    TilePipeline<C, kSparse> pipe;
    // kSpec: the request's length is loaded first, then its first tiles' entries, so that the
    // two round trips overlap (a warp issues in order: log #78 (d)'s first form loaded the
    // length after the entries and kept three round trips); the tiles' copies wait for both
    // (issuing them before the length, as if the request had max_len rows, gained nothing more
    // and read rows past the length: log #79)
    PartPos pp;
    int spec_len = 0;  // kSpec: the request's clamped length
    if constexpr (kSpec) {  // the closed form with lengths: request first_req's part i
        const int n = a.closed_n.d, t = a.closed_tiles.d;
        pp.first_req = a.closed_n.div(part);
        const int i = part - pp.first_req * n;
        if (pp.first_req >= a.batch) return;  // (a grid wider than batch * n parts)
        pp.first_j = i * a.min_chunk;
        const int size = min(a.min_chunk, t - pp.first_j);  // (>= 1: i < n = ceil(t / min_chunk))
        const int len_raw = a.lens[pp.first_req];
        pipe.spec_entries(a, pp.first_req, pp.first_j, size >= 2);
        // (the lengths' faults: each request's by its first part, m-tile 0)
        if (a.check_lens && i == 0 && m_tile == 0) Lens::record_bad(pp.first_req, len_raw, a.max_len, a.check_lens, a.flag);
        spec_len = Lens::clamp(len_raw, a.max_len);
        const int tb = Lens::tiles_of(spec_len);
        pp.total = a.closed_total;  // (batch * t: tiles as numbered in the closed form)
        pp.lo = pp.first_j < tb ? pp.first_req * t + pp.first_j : pp.total;
        pp.hi = pp.lo + min(size, tb - pp.first_j);
    } else {
        // This part's tiles [lo, hi) and its first request and tile, from the lengths.
        pp = find_part<C::kThreads, kWithin, kAligned>(a, lens, part, a.check_lens && blockIdx.x == 0 && blockIdx.y == 0,
                                             sm.scratch());
    }
    MLA_TRACE_AT(kTraceDecode, kTracePartFound);
    if (pp.lo >= pp.total) return;
    const int lo = pp.lo, hi = pp.hi, first_req = pp.first_req, first_j = pp.first_j;
    if constexpr (kBulkRows<C, kSparse>) {  // the stages' barriers: one arrival per warp and tile
        if (threadIdx.x == 0) {
            mbar_init(sm.bar(0), C::kWarps);
            mbar_init(sm.bar(1), C::kWarps);
            mbar_init_fence();
        }
        __syncthreads();
    }
    // The start trigger. The 16-bit 8-row 4-warp kernels (kStartThreshold) compare the part's
    // tiles with a threshold that decode.cu puts above kPdlStartShift in a.pdl: every part with
    // MLA_PDL_TRIGGER_AT_START, parts of at most kPdlShortPartTiles tiles on steps that are not
    // small (their last tile is at most one tile away), else none; where every part is that
    // short (a flat split of mostly short requests at 8 heads: 512x15+8192) the combine's CTAs
    // start a tile earlier (log #86). The compare costs what the bit test did: those kernels'
    // SASS changes only there. The other kernels keep the bit test (their code moved with the
    // compare, and no step of theirs measured faster with it). (The last-tile trigger below
    // then repeats it: a CTA's later triggers are no-ops.)
    if constexpr (kStartThreshold<Fmt, C>) {
        if (hi - lo <= (a.pdl >> kPdlStartShift)) grid_dependents_launch();
    } else {
        if (a.pdl & MLA_PDL_TRIGGER_AT_START) grid_dependents_launch();
    }

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int mat = lane >> 3, mrow = lane & 7;
    const int nh = warp % C::kSplitN, kh = warp / C::kSplitN;

    // The tiles in flight (cursors), whether tile x+1's copies are committed (ahead), whether
    // tile x starts a segment; the first tile (and the second) issued.
    bool ahead;
    if constexpr (kSpec) {
        ahead = pipe.start_known(a, sm, m_tile, first_req, first_j, spec_len, lo, hi);
    } else {
        ahead = pipe.start(a, lens, sm, m_tile, first_req, first_j, lo, hi);
    }
    bool seg_start = true;
    const Cursor& cc = pipe.cur;  // tile x

    constexpr int kMT = C::kMTiles;
    float o[kMT][C::kONTiles][4];
    float m_run[kMT][2], l_run[kMT][2];
    uint32_t qf[kMT][C::kQFrags][4];
    float rowf[kMT][2];  // fp8 path: bf16 queries' 2^-a per fragment row (decode/fp8_phases.cuh), kMaskAdd: x scale_log2
    float m_own = -INFINITY, l_own = 0.f;  // one softmax per tile: this lane's query row (softmax_rows)
    int row_qi = 0;                        // and its query position (dense: the causal limit)
    if constexpr (C::kSharedSoftmax && !kSparse) row_qi = a.heads_div.div(m_tile * C::kBlockM + soft_row<C>(warp, lane));
    int seg_j0 = cc.j;  // the first tile of the current segment

    for (int x = lo; x < hi; ++x) {
        const int stage = pipe.stage_of(x, lo);
        uint8_t* kv_cur = sm.kv(stage);
        // = sm.valid(stage), written out: through the accessor the compiler orders the loop's
        // invariants differently (other registers on sm_120)
        const int32_t* valid_cur = sm.valid_ + stage * C::kBlockN;
        // ---- wait for tile x ----
        pipe.wait(ahead, sm, stage, ((x - lo) >> 1) & 1);
        if (x == lo) MLA_TRACE_AT(kTraceDecode, kTraceFirstTileIn);
        if (x + 1 == hi) MLA_TRACE_AT(kTraceDecode, kTraceLastTileIn);
        // Every trigger must come after this CTA's grid_dependency_wait(): combine_kernel
        // reads the lengths before its own wait, relying on that.
        if ((a.pdl & MLA_PDL_TRIGGER_AT_LAST_TILE) && x + 1 == hi) grid_dependents_launch();

        // ---- start a segment: Q fragments, empty accumulators ----
        if (seg_start) {
            // the lane's ldmatrix row and k half of the A fragments (ldmatrix_a)
            const int qrow = C::kHalfM ? mrow : (mat & 1) * 8 + mrow;
            const int qhalf = C::kHalfM ? (mat & 1) : mat >> 1;
            start_segment<C, kSparse>(a, sm.q(), cc.b, m_tile, qrow, kh, qhalf, qf, rowf, m_run, l_run, o);
            m_own = -INFINITY;
            l_own = 0.f;
            seg_j0 = cc.j;
        }

        // ---- issue tile x+1 (unless ahead); resolve tile x+2's rows ----
        const bool next_seg = pipe.issue_next(a, lens, sm, m_tile, stage, x, hi, ahead, seg_start);

        // ---- scores: S = Q K^T, this warp's 16 tile rows over its share of the QK width ----
        const uint32_t kv_base = smem_u32(kv_cur);
        if constexpr (Fmt::kFp8) {
            fp8_score_partials<T, C>(kv_base, qf, rowf, nh * 16 + (mat >> 1) * 8 + mrow, kh, mat & 1, part_s, warp,
                                     lane);
        } else if constexpr (kT16<C>) {  // K as the A operand: rows 8-15 in the second matrix
            score_partials_t<T, C>(kv_base, qf[0], nh * 16 + (mat & 1) * 8 + mrow, kh * C::kSKSteps, mat >> 1, part_s,
                                   warp, lane);
        } else {
            score_partials<T, C>(kv_base, qf, nh * 16 + (mat >> 1) * 8 + mrow, kh * C::kSKSteps, mat & 1, part_s,
                                 warp, lane);
        }
        __syncthreads();
        if constexpr (C::kSharedSoftmax) {
            if (x == lo) MLA_TRACE_AT(kTraceDecode, kTraceFirstSDone);
            const bool seg_end = (x + 1 == hi) || (cc.j + 1 == cc.ntiles());
            // ---- softmax: this warp's rows of S into P (shared memory), then P V over its dims ----
            const bool moved = softmax_rows<C, kSparse>(a, part_s, valid_cur, cc.j << kTileShift, cc.len, row_qi,
                                                        seg_end, warp, lane, sm, m_own, l_own);
            if constexpr (Fmt::kFp8) {
                __syncthreads();
                fp8_pv_shared<C>(kv_base, sm, g, lane, (mat & 1) * 8 + mrow, warp, mat >> 1, o);
            } else {
                uint32_t vf[C::kONTiles / 2][4];
                pv_prefetch<C>(kv_base, (mat & 1) * 8 + mrow, warp, mat >> 1, vf);
                const bool any_moved = __syncthreads_or(moved);
                pv_shared<T, C>(kv_base, sm, g, lane, (mat & 1) * 8 + mrow, warp, mat >> 1, vf, any_moved, o);
            }
            if (x == lo) MLA_TRACE_AT(kTraceDecode, kTraceFirstPvDone);
            if (seg_end) {
                float l_tot[kMT][2], m_tot[kMT][2];
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int hf = 0; hf < C::kFragRows; ++hf) {
                        const float2 st = sm.stats()[mt * 16 + g + 8 * hf];
                        l_tot[mt][hf] = st.x;
                        m_tot[mt][hf] = st.y;
                    }
                write_segment<T, kSparse, C, true>(a, cc, seg_j0, part, first_req, m_tile, g, warp, tq, o, m_tot, l_tot);
            }
        } else {
            if constexpr (C::kSplitK == 4) {
                sum_partials<C>(part_s, warp, lane);
                __syncthreads();
            }
            if (x == lo) MLA_TRACE_AT(kTraceDecode, kTraceFirstSDone);

            // ---- softmax: the full S (every warp reads it in the same order), mask, online softmax ----
            float s[kMT][4][4];
            read_scores<C>(part_s, lane, s);
            softmax_tile<C, kSparse>(a, s, valid_cur + 2 * tq, cc.j << kTileShift, cc.len, m_tile, g, tq, kv_base, warp,
                                     m_run, l_run, o);

            // ---- P V: O += P V over this warp's output dims ----
            if constexpr (Fmt::kFp8) {
                fp8_pv_tile<C>(kv_base, s, (mat & 1) * 8 + mrow, warp, mat >> 1, o);
            } else if constexpr (kT16<C>) {  // Vᵀ as the A operand: rows 8-15 in the third matrix
                pv_tile_t<T, C>(kv_base, s, (mat >> 1) * 8 + mrow, warp, mat & 1, o);
            } else {
                pv_tile<T, C>(kv_base, s, (mat & 1) * 8 + mrow, warp, mat >> 1, o);
            }

            if (x == lo) MLA_TRACE_AT(kTraceDecode, kTraceFirstPvDone);
            // ---- write: at the end of a segment, normalize and write ----
            const bool seg_end = (x + 1 == hi) || (cc.j + 1 == cc.ntiles());
            if (seg_end) {
                write_segment<T, kSparse, C>(a, cc, seg_j0, part, first_req, m_tile, g, warp, tq, o, m_run, l_run);
            }
        }
        // ---- issue tile x+2 into this stage (or at the top of the next iteration); advance ----
        bool ahead_next = false;
        if (pipe.can_issue_after(x, hi, next_seg)) {
            pipe.issue_after(a, sm, m_tile, kv_cur, stage);
            ahead_next = true;
        }
        pipe.advance();
        seg_start = next_seg;
        ahead = ahead_next;
    }
    cp_async_wait<0>();
    if constexpr (Fmt::kFp8 && !Fmt::kDsMla) {  // per-tensor fp8: a bad scale is recorded, once
        if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) check_tensor_scale(a.flag, *a.kv_scale);
    }
    MLA_TRACE_AT(kTraceDecode, kTraceDecodeEnd);
}

}  // namespace mla
