// The row kernel (MLA_PATH_ROWS, docs/DESIGN.md §5.5): for one-part steps (at most 64 cache
// rows per request by the schedule's hint: the one-token call, top-1..64 sparse rows), a CTA
// per query row whose 8 warps take the request's positions w, w + 8, ... four at a time on
// the CUDA cores (no MMA fragments, no split, no combine), then merge their (max, sum, o)
// through shared memory. The first rows' table entries (or indices) and the rows behind them
// are read together with the length, before it is known, so a step of up to 32 rows is two
// dependent round trips (entries, rows) and a short fp32 chain. Correct for any lengths (a
// call may bring longer ones than the schedule's hint; each further 32 positions cost a
// round trip).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/constants.cuh"
#include "common/fault.cuh"
#include "common/fp8.cuh"
#include "common/ptx.cuh"
#include "decode/args.cuh"
#include "decode/format.cuh"
#include "decode/split.cuh"

namespace mla {

constexpr int kRowsWarps = 8;   // warps per CTA (a CTA per query row; warp w takes positions w mod 8)
constexpr int kRowsUnroll = 4;  // cache rows per step of a warp (loaded together, one step ahead)
constexpr int kRowsStep = kRowsWarps * kRowsUnroll;  // positions per step of the CTA

// Which dims of a 576-wide row lane l holds (the query, the cache row and the output alike):
// two groups of 8 latent dims (lat_dim(l, 0), lat_dim(l, 1)) and, on lanes < kRopeLanes,
// kRopePerLane RoPE dims from 512 + kRopePerLane * l. 16-bit rows: dims 8l and 256 + 8l (each
// group one 16-byte chunk of the row); fp8 rows: the 16 dims of latent chunk l (one tile scale
// per lane for fp8_ds_mla, tile l / 8); per-tensor fp8 stores the RoPE dims as e4m3 too, 16 per
// chunk.
template <typename Fmt>
struct RowLanes {
    static constexpr bool k16 = !Fmt::kFp8;
    static constexpr bool kTensor = Fmt::kFp8 && !Fmt::kDsMla;
    static constexpr int kRopePerLane = kTensor ? 16 : 8;
    static constexpr int kRopeLanes = MLA_ROPE_DIM / kRopePerLane;
    static __device__ __forceinline__ int lat_dim(int lane, int grp) { return k16 ? grp * 256 + 8 * lane : 16 * lane + 8 * grp; }
};

// One cache row's bits as lane l loads them (RowLanes): latent chunks, RoPE chunk, tile scale.
struct LaneRow {
    uint4 lat0, lat1, rope;
    float scale;
};

template <typename Fmt>
__device__ __forceinline__ void load_lane_row(const uint8_t* row, int lane, LaneRow& r) {
    using L = RowLanes<Fmt>;
    const uint4* c = reinterpret_cast<const uint4*>(row);
    r.lat0 = c[lane];
    if constexpr (L::k16) {
        r.lat1 = c[lane + 32];
        if (lane < L::kRopeLanes) r.rope = c[64 + lane];
    } else if constexpr (Fmt::kDsMla) {
        r.scale = reinterpret_cast<const float*>(row + kFp8DsMlaScalesOffset)[lane >> 3];
        if (lane < L::kRopeLanes) r.rope = reinterpret_cast<const uint4*>(row + kFp8DsMlaScalesOffset + 16)[lane];
    } else {
        if (lane < L::kRopeLanes) r.rope = c[32 + lane];
    }
}

// 2 x 16-bit of type T (low half first) -> fp32, exact (common/fp8.cuh's conversions).
template <typename T>
__device__ __forceinline__ float2 f2_of(uint32_t u) {
    return make_float2(Fp8In<T>::to_f32(static_cast<uint16_t>(u & 0xffffu)), Fp8In<T>::to_f32(static_cast<uint16_t>(u >> 16)));
}
// 4 x e4m3 -> fp32, exact (through f16).
__device__ __forceinline__ void f4_of_e4m3(uint32_t u, float* f) {
    uint32_t lo, hi;
    e4m3x4_to_f16x2x2(u, lo, hi);
    const float2 a = f2_of<__half>(lo), b = f2_of<__half>(hi);
    f[0] = a.x;
    f[1] = a.y;
    f[2] = b.x;
    f[3] = b.y;
}
// 8 values of a 16-byte chunk of 16-bit type T (a query chunk, a 16-bit row's chunk, bf16 RoPE)
template <typename T>
__device__ __forceinline__ void f8_of(const uint4& c, float* f) {
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 v = f2_of<T>(w[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}
__device__ __forceinline__ void f16_of_e4m3(const uint4& c, float* f) {
    f4_of_e4m3(c.x, f);
    f4_of_e4m3(c.y, f + 4);
    f4_of_e4m3(c.z, f + 8);
    f4_of_e4m3(c.w, f + 12);
}

// The lane's latent values (16) and RoPE values (kRopePerLane, lanes < kRopeLanes) of a row,
// as stored (fp8: e4m3 before any scale).
template <typename Fmt>
__device__ __forceinline__ void lane_values(const LaneRow& r, int lane, float (&lat)[16], float (&rope)[16]) {
    using T = typename Fmt::Elem;
    using L = RowLanes<Fmt>;
    if constexpr (L::k16) {
        f8_of<T>(r.lat0, lat);
        f8_of<T>(r.lat1, lat + 8);
        f8_of<T>(r.rope, rope);
    } else {
        f16_of_e4m3(r.lat0, lat);
        if constexpr (Fmt::kDsMla) {
            f8_of<__nv_bfloat16>(r.rope, rope);
        } else {
            f16_of_e4m3(r.rope, rope);
        }
    }
    if (lane >= L::kRopeLanes) {
#pragma unroll
        for (int i = 0; i < 16; ++i) rope[i] = 0.f;
    }
}

// Positions base + 8u (u < kRowsUnroll) of a warp's request, as loaded: lane u holds position
// base + 8u's raw entry (dense: block-table entry; sparse: slot id); every lane each row's
// byte offset in the cache (-1: out of range, nothing loaded) and its share.
struct RowStep {
    int entry;
    int64_t off[kRowsUnroll];
    LaneRow row[kRowsUnroll];
};

template <typename Fmt, bool kSparse>
__device__ __forceinline__ void fetch_rows(const DecodeArgs& a, int64_t table_row, int base, int lane, RowStep& st) {
    int64_t off = Fmt::kNoRow;
    st.entry = 0;
    if (lane < kRowsUnroll) {
        // (the column clamped into the table row: entries past the length are read, never used;
        // their faults are recorded once the length is known, rows_kernel)
        const int pos = base + kRowsWarps * lane;
        const int col = min(kSparse ? pos : pos >> a.block_shift, a.table_cols - 1);
        st.entry = a.table[table_row + col];
        off = entry_row<Fmt, kSparse>(a, st.entry, pos, 0, false);
    }
#pragma unroll
    for (int u = 0; u < kRowsUnroll; ++u) {
        st.off[u] = __shfl_sync(0xffffffffu, off, u);
        st.row[u].lat0 = st.row[u].lat1 = st.row[u].rope = make_uint4(0, 0, 0, 0);
        st.row[u].scale = 0.f;
        if (st.off[u] >= 0) load_lane_row<Fmt>(a.cache + st.off[u], lane, st.row[u]);
    }
}

// The CTA's output row: 8 values of T from o * inv at dims d0 .. d0 + 7.
template <typename T>
__device__ __forceinline__ void store8(T* dst, const float* o, float inv) {
    uint4 w;
    w.x = Elem<T>::pack(o[0] * inv, o[1] * inv);
    w.y = Elem<T>::pack(o[2] * inv, o[3] * inv);
    w.z = Elem<T>::pack(o[4] * inv, o[5] * inv);
    w.w = Elem<T>::pack(o[6] * inv, o[7] * inv);
    *reinterpret_cast<uint4*>(dst) = w;
}

template <typename Fmt, bool kSparse>
__global__ void __launch_bounds__(kRowsWarps * 32) rows_kernel(const DecodeArgs a) {
    using T = typename Fmt::Elem;
    using L = RowLanes<Fmt>;
    __shared__ __align__(16) float o_s[kRowsWarps][kLatentDim];
    __shared__ float m_s[kRowsWarps], l_s[kRowsWarps];
    grid_dependency_wait();
    if (a.pdl & (MLA_PDL_TRIGGER_AT_START | MLA_PDL_TRIGGER_AT_LAST_TILE)) grid_dependents_launch();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int b = blockIdx.y;
    const int m = blockIdx.x;  // the query row
    int token, head;
    row_token_head<kSparse>(a, b, m, token, head);
    const int64_t table_row = static_cast<int64_t>(b) * a.table_stride;

    // issued together: the length, the query, the first rows' entries (and then the rows
    // behind them: fetch_rows waits for the entries)
    const int raw = a.lens != nullptr ? a.lens[b] : a.max_len;
    const float tensor_scale = L::kTensor ? *a.kv_scale : 1.f;
    uint4 q0, q1, r0 = make_uint4(0, 0, 0, 0), r1 = r0;
    {
        const T* qn = reinterpret_cast<const T*>(a.q_nope) + token * a.qn_ts + head * a.qn_hs;
        const T* qp = reinterpret_cast<const T*>(a.q_rope) + token * a.qr_ts + head * a.qr_hs;
        q0 = *reinterpret_cast<const uint4*>(qn + L::lat_dim(lane, 0));
        q1 = *reinterpret_cast<const uint4*>(qn + L::lat_dim(lane, 1));
        if (lane < L::kRopeLanes) {
            r0 = *reinterpret_cast<const uint4*>(qp + L::kRopePerLane * lane);
            if (L::kRopePerLane == 16) r1 = *reinterpret_cast<const uint4*>(qp + L::kRopePerLane * lane + 8);
        }
    }
    RowStep cur;
    fetch_rows<Fmt, kSparse>(a, table_row, warp, lane, cur);
    float q[16], qr[16];
    f8_of<T>(q0, q);
    f8_of<T>(q1, q + 8);
    f8_of<T>(r0, qr);
    f8_of<T>(r1, qr + 8);
    // scores in the log2 domain
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        q[i] *= a.scale_log2;
        qr[i] *= a.scale_log2;
    }

    const int len = Lens::clamp(raw, a.max_len);
    if (a.lens != nullptr && blockIdx.x == 0 && threadIdx.x == 0) Lens::record_bad(b, raw, a.max_len, a.check_lens, a.flag);
    // dense: query position i sees positions < len - q_len + i + 1 (causal)
    const int lim = kSparse ? len : len - a.q_len + 1 + (token - b * a.q_len);

    float o[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) o[i] = 0.f;
    float m_run = -INFINITY, l_run = 0.f;
    for (int base = warp; base < len; base += kRowsStep) {
        const bool more = base + kRowsStep < len;
        RowStep nxt;
        if (more) fetch_rows<Fmt, kSparse>(a, table_row, base + kRowsStep, lane, nxt);
        // an entry out of range for a position < len: recorded (its row skipped); only by the
        // CTA of query row 0, as the length
        if (blockIdx.x == 0 && lane < kRowsUnroll && base + kRowsWarps * lane < len)
            entry_row<Fmt, kSparse>(a, cur.entry, base + kRowsWarps * lane, b, true);
        float s[kRowsUnroll], vs[kRowsUnroll];
#pragma unroll
        for (int u = 0; u < kRowsUnroll; ++u) {
            float k[16], rope[16];
            lane_values<Fmt>(cur.row[u], lane, k, rope);
            float sl = 0.f, sr = 0.f;
#pragma unroll
            for (int i = 0; i < 16; ++i) sl = fmaf(q[i], k[i], sl);
#pragma unroll
            for (int i = 0; i < L::kRopePerLane; ++i) sr = fmaf(qr[i], rope[i], sr);
            const float tile_scale = Fmt::kDsMla ? cur.row[u].scale : 1.f;
            s[u] = fmaf(sl, tile_scale, sr);
            vs[u] = Fmt::kDsMla ? tile_scale : tensor_scale;
        }
#pragma unroll
        for (int d = 16; d >= 1; d >>= 1)
#pragma unroll
            for (int u = 0; u < kRowsUnroll; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], d);
        float mx = m_run;
#pragma unroll
        for (int u = 0; u < kRowsUnroll; ++u) {
            const bool vis = cur.off[u] >= 0 && base + kRowsWarps * u < lim;
            s[u] = vis ? s[u] * tensor_scale : -INFINITY;
            mx = fmaxf(mx, s[u]);
        }
        if (mx != -INFINITY) {  // (uniform: every lane holds the same scores)
            const float alpha = fast_exp2(m_run - mx);
            l_run *= alpha;
#pragma unroll
            for (int i = 0; i < 16; ++i) o[i] *= alpha;
#pragma unroll
            for (int u = 0; u < kRowsUnroll; ++u) {
                // (rows not visible are skipped, not weighted 0: the rows loaded past the
                // length hold whatever the cache holds there, NaN patterns included)
                if (s[u] != -INFINITY) {
                    const float p = fast_exp2(s[u] - mx);
                    l_run += p;
                    const float pv = p * vs[u];
                    float v[16], rope[16];  // (converted again: fewer registers than keeping them)
                    lane_values<Fmt>(cur.row[u], lane, v, rope);
#pragma unroll
                    for (int i = 0; i < 16; ++i) o[i] = fmaf(pv, v[i], o[i]);
                }
            }
            m_run = mx;
        }
        if (more) cur = nxt;
    }

    if (L::kTensor && m == 0 && b == 0 && threadIdx.x == 0) check_tensor_scale(a.flag, tensor_scale);
    T* dst = reinterpret_cast<T*>(a.out) + token * a.out_ts + head * a.out_hs;
    float* lse = a.lse != nullptr ? a.lse + token * a.lse_ts + head * a.lse_hs : nullptr;
    if (len <= 1) {  // (uniform) only warp 0 holds a position: it writes the row
        if (warp != 0) return;
        const float inv = l_run > 0.f ? fast_rcp(l_run) : 0.f;
        store8(dst + L::lat_dim(lane, 0), o, inv);
        store8(dst + L::lat_dim(lane, 1), o + 8, inv);
        if (lse != nullptr && lane == 0) *lse = l_run > 0.f ? (m_run + fast_log2(l_run)) * kLn2 : -INFINITY;
        return;
    }
    // merge the warps' (max, sum, o): thread t finishes dims 2t, 2t + 1
#pragma unroll
    for (int grp = 0; grp < 2; ++grp) {
        float4* d = reinterpret_cast<float4*>(&o_s[warp][L::lat_dim(lane, grp)]);
        d[0] = make_float4(o[8 * grp + 0], o[8 * grp + 1], o[8 * grp + 2], o[8 * grp + 3]);
        d[1] = make_float4(o[8 * grp + 4], o[8 * grp + 5], o[8 * grp + 6], o[8 * grp + 7]);
    }
    if (lane == 0) {
        m_s[warp] = m_run;
        l_s[warp] = l_run;
    }
    __syncthreads();
    float mw[kRowsWarps], mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kRowsWarps; ++w) {
        mw[w] = m_s[w];
        mx = fmaxf(mx, mw[w]);
    }
    float l = 0.f, o0 = 0.f, o1 = 0.f;
    const int d = 2 * threadIdx.x;
    if (mx != -INFINITY) {
#pragma unroll
        for (int w = 0; w < kRowsWarps; ++w) {
            const float f = fast_exp2(mw[w] - mx);  // (0 for a warp without rows)
            l = fmaf(l_s[w], f, l);
            const float2 ow = *reinterpret_cast<const float2*>(&o_s[w][d]);
            o0 = fmaf(ow.x, f, o0);
            o1 = fmaf(ow.y, f, o1);
        }
    }
    const float inv = l > 0.f ? fast_rcp(l) : 0.f;
    *reinterpret_cast<uint32_t*>(dst + d) = Elem<T>::pack(o0 * inv, o1 * inv);
    if (lse != nullptr && threadIdx.x == 0) *lse = l > 0.f ? (mx + fast_log2(l)) * kLn2 : -INFINITY;
}

}  // namespace mla
