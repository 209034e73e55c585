// C entry points of dense and sparse decode: check arguments, fill DecodeArgs, launch
// decode_kernel then combine_kernel on the caller's stream.
#include "decode.cuh"

using namespace mla;

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
bool stride16(int64_t elems) { return (elems * 2) % 16 == 0; }

// Launch with programmatic dependent launch when the schedule allows it (sm_90+): the
// kernel may start while the previous one drains and waits in grid_dependency_wait().
cudaError_t launch_pdl(void (*kernel)(DecodeArgs), dim3 grid, int threads, int smem, cudaStream_t st, int pdl,
                       const DecodeArgs& a) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = (pdl & MLA_PDL_ATTRIBUTE) ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, a);
}

// Query rows per combine CTA. With at most ~16 parts per request a split request has few
// pieces, and a warp per row merges them in a few round trips; more parts per request
// (a few long sequences) keep 8 warps per row.
int combine_rows(const mla_schedule_t* s) { return s->num_parts <= 16 * s->batch ? kCombineWarps : 1; }

// Dim slices per merged row (the combine's grid z): 4 when the split rows give at most
// one combine CTA per two SMs (b=1, t=1: 8 rows; b=4, t=32), so that their piece reads
// spread over 4x the SMs; else 1: more CTAs then only add CTA waves, each searching the
// lengths again (docs/PERFORMANCE.md log #22).
int combine_slices(const mla_schedule_t* s) {
    const int rows = combine_rows(s), m_rows = s->q_len * s->num_heads;
    const int64_t ctas = static_cast<int64_t>(max_splits(s->batch, s->num_parts)) * ((m_rows + rows - 1) / rows);
    return 2 * ctas <= s->sm_count ? 4 : 1;
}

// Calls f(C{}) with the tile configuration C that (warps, block_m) name: 32 rows -> CfgWide
// (always 8 warps), else 8 warps -> Cfg8, else Cfg. The schedule, the launch and its
// argument check all pick the configuration through this one mapping.
template <typename F>
auto with_config(int warps, int block_m, F&& f) {
    if (block_m == 32) return f(CfgWide{});
    if (warps == 8) return f(Cfg8{});
    return f(Cfg{});
}

template <typename T, bool kSparse>
mla_status_t launch_typed(const mla_schedule_t* s, const DecodeArgs& a, cudaStream_t st) {
    const dim3 grid(s->num_m_tiles, s->num_parts);
    const int z = s->internal.combine_slices;
    const dim3 cgrid(max_splits(s->batch, s->num_parts), (a.m_rows + a.combine_rows - 1) / a.combine_rows, z);
    auto* combine = z == 4 ? combine_kernel<T, kSparse, 1> : combine_kernel<T, kSparse, 4>;
    const mla_schedule_internal_t& in = s->internal;
    MLA_CUDA_TRY(with_config(in.warps, in.block_m, [&](auto c) {
        using C = decltype(c);
        return launch_pdl(decode_kernel<T, kSparse, C>, grid, C::kThreads, s->smem_bytes, st, in.pdl, a);
    }));
    MLA_CUDA_TRY((launch_pdl(combine, cgrid, kCombineWarps * 32, 0, st, in.pdl, a)));
    return MLA_STATUS_OK;
}

// The kernels' divisors, on the host (DecodeArgs::parts_div, heads_div, closed_*).
void prepare_split(DecodeArgs& a) {
    a.parts_div = FastDiv::make(a.num_parts);
    a.heads_div = FastDiv::make(a.num_heads);
    a.closed_tiles = FastDiv::make(Lens::tiles_of(a.max_len));
    // batch * tiles <= INT32_MAX (mla_schedule_init checks it)
    a.closed_total = static_cast<int32_t>(static_cast<int64_t>(a.batch) * a.closed_tiles.d);
    a.closed_chunk = FastDiv::make(split_chunk(a.closed_total, a.parts_div, a.min_chunk));
}

template <bool kSparse>
mla_status_t launch(const mla_schedule_t* s, const DecodeArgs& a, mla_dtype_t dtype, void* stream) {
    int dev = -1;
    MLA_CUDA_TRY(cudaGetDevice(&dev));
    if (dev != s->device) return MLA_STATUS_INVALID_ARGUMENT;
    const mla_schedule_internal_t& in = s->internal;
    if (in.combine_slices != 1 && in.combine_slices != 4) return MLA_STATUS_INVALID_ARGUMENT;
    if ((in.warps != 4 && in.warps != 8) || (in.block_m != 16 && !(in.block_m == 32 && in.warps == 8)))
        return MLA_STATUS_INVALID_ARGUMENT;
    if ((in.pdl & ~MLA_PDL_ALL) != 0) return MLA_STATUS_INVALID_ARGUMENT;
    // A schedule edited by hand must still match the configuration it launches.
    const int need_smem = with_config(in.warps, in.block_m, [](auto c) { return decltype(c)::kSmemBytes; });
    if (s->smem_bytes < need_smem || s->num_m_tiles != (a.m_rows + in.block_m - 1) / in.block_m || s->num_parts < 1)
        return MLA_STATUS_INVALID_ARGUMENT;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (dtype == MLA_DTYPE_BF16) return launch_typed<__nv_bfloat16, kSparse>(s, a, st);
    if (dtype == MLA_DTYPE_F16) return launch_typed<__half, kSparse>(s, a, st);
    return MLA_STATUS_INVALID_ARGUMENT;
}

// Checks and fills the fields mla_dense_params_t and mla_sparse_params_t share (same names
// in both); returns false when an argument is invalid.
template <typename P>
bool common_args(const mla_schedule_t* s, const P* p, DecodeArgs& a) {
    if (s == nullptr || p == nullptr || p->q_nope == nullptr || p->q_rope == nullptr || p->kv_cache == nullptr ||
        p->out == nullptr || p->workspace == nullptr)
        return false;
    const int32_t bs = p->block_size;
    if (!(bs == 16 || bs == 32 || bs == 64 || bs == 128)) return false;
    if (p->num_blocks < 1 || p->block_stride_bytes < static_cast<int64_t>(bs) * kRowBytes ||
        p->block_stride_bytes % 16 != 0)
        return false;
    if (!aligned16(p->q_nope) || !aligned16(p->q_rope) || !aligned16(p->kv_cache) || !aligned16(p->out)) return false;
    // Rows are read and written 16 bytes at a time: strides must keep them aligned, except
    // along a dimension of size 1, whose stride is never used.
    const bool one_token = static_cast<int64_t>(s->batch) * s->q_len == 1, one_head = s->num_heads == 1;
    auto ok = [](int64_t stride, bool unused) { return unused || stride16(stride); };
    if (!ok(p->q_nope_token_stride, one_token) || !ok(p->q_nope_head_stride, one_head) ||
        !ok(p->q_rope_token_stride, one_token) || !ok(p->q_rope_head_stride, one_head) ||
        !ok(p->out_token_stride, one_token) || !ok(p->out_head_stride, one_head))
        return false;
    if (!(p->softmax_scale > 0.f) || !isfinite(p->softmax_scale)) return false;
    if (!aligned16(p->workspace)) return false;  // read as float4
    a = DecodeArgs{};
    a.q_nope = static_cast<const uint8_t*>(p->q_nope);
    a.q_rope = static_cast<const uint8_t*>(p->q_rope);
    a.qn_ts = p->q_nope_token_stride;
    a.qn_hs = p->q_nope_head_stride;
    a.qr_ts = p->q_rope_token_stride;
    a.qr_hs = p->q_rope_head_stride;
    a.cache = static_cast<const uint8_t*>(p->kv_cache);
    a.block_stride = p->block_stride_bytes;
    a.num_blocks = p->num_blocks;
    a.block_size = bs;
    a.block_shift = __builtin_ctz(static_cast<unsigned>(bs));
    a.batch = s->batch;
    a.num_parts = s->num_parts;
    const int32_t mc = s->internal.min_chunk;
    a.min_chunk = mc < 1 ? 1 : (mc > (1 << 20) ? (1 << 20) : mc);
    a.q_len = s->q_len;
    a.num_heads = s->num_heads;
    a.m_rows = s->q_len * s->num_heads;
    a.out = static_cast<uint8_t*>(p->out);
    a.out_ts = p->out_token_stride;
    a.out_hs = p->out_head_stride;
    a.lse = p->lse;
    a.lse_ts = p->lse_token_stride;
    a.lse_hs = p->lse_head_stride;
    a.scale_log2 = p->softmax_scale * kLog2e;
    a.max_len = s->max_len;
    a.ws_o = p->workspace;
    a.ws_lse = p->workspace + 2 * static_cast<size_t>(s->num_parts) * a.m_rows * kLatentDim;
    a.flag = p->error_flag;
    a.pdl = s->internal.pdl;
    return true;
}

template <typename T, bool kSparse>
static cudaError_t set_smem_attr(int bytes) {
    cudaError_t e = cudaFuncSetAttribute(decode_kernel<T, kSparse, Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
    e = cudaFuncSetAttribute(decode_kernel<T, kSparse, Cfg8>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
    return cudaFuncSetAttribute(decode_kernel<T, kSparse, CfgWide>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// Dynamic shared memory a configuration requests (padded in sm120-occupancy mode so that
// an SM holds as many CTAs as an sm_120 SM) and the CTAs per SM that then fit.
template <typename C>
static mla_status_t config_fit(bool sm120_occupancy, int smem_per_sm, int optin, int* smem_out, int* ctas_out) {
    int smem = C::kSmemBytes;
    if (smem > optin) return MLA_STATUS_UNSUPPORTED;
    if (sm120_occupancy) {
        // As many CTAs per SM as sm_120 holds (100 KB per SM, 1 KB reserved per CTA).
        const int sm120_ctas = kSm120SmemPerSm / (C::kSmemBytes + 1024);
        int padded = smem_per_sm / (sm120_ctas + 1) - 1024 + 16;
        padded = (padded + 15) & ~15;
        smem = padded > smem ? padded : smem;
        if (smem > optin) smem = optin;
    }
    int ctas = 0;
    MLA_CUDA_TRY((cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, decode_kernel<__nv_bfloat16, false, C>,
                                                                C::kThreads, smem)));
    if (ctas < 1) return MLA_STATUS_UNSUPPORTED;
    *smem_out = smem;
    *ctas_out = ctas;
    return MLA_STATUS_OK;
}

}  // namespace

// The schedule lives in this translation unit because kernel attributes belong to the
// instantiation that is launched here.
extern "C" mla_status_t mla_schedule_init(mla_schedule_t* s, int32_t batch, int32_t q_len, int32_t num_heads,
                                          int32_t max_len, const mla_tuning_t* tuning) {
    MLA_REQUIRE(s != nullptr);
    MLA_REQUIRE(batch >= 1 && q_len >= 1 && q_len <= MLA_MAX_Q_LEN && num_heads >= 1 && num_heads <= MLA_MAX_HEADS);
    MLA_REQUIRE(max_len >= 1 && max_len <= 0x7fffffff - 31);
    const mla_tuning_t tune = tuning != nullptr ? *tuning : mla_tuning_t{};
    MLA_REQUIRE(tune.warps == 0 || tune.warps == 4 || tune.warps == 8);
    MLA_REQUIRE(tune.block_m == 0 || tune.block_m == 16 || (tune.block_m == 32 && tune.warps != 4));
    MLA_REQUIRE(tune.pdl == MLA_PDL_OFF || (tune.pdl >= 0 && (tune.pdl & ~MLA_PDL_ALL) == 0));
    MLA_REQUIRE(tune.combine_slices == 0 || tune.combine_slices == 1 || tune.combine_slices == 4);
    MLA_REQUIRE(tune.min_chunk >= 0);
    const bool sm120_occupancy = tune.sm120_occupancy != 0;
    // the split counts 32-row tiles of all requests (at max_len) in int32
    const int64_t all_tiles = static_cast<int64_t>(batch) * ((static_cast<int64_t>(max_len) + Cfg::kBlockN - 1) / Cfg::kBlockN);
    MLA_REQUIRE(all_tiles <= 0x7fffffffLL);
    int dev = 0;
    MLA_CUDA_TRY(cudaGetDevice(&dev));
    int sm_count = 0, smem_per_sm = 0, optin = 0, major = 0;
    MLA_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    MLA_CUDA_TRY(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev));
    MLA_CUDA_TRY(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    MLA_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    // Allow the device maximum once: schedules with and without the sm120 padding then
    // coexist (each launch requests its own smem_bytes).
    MLA_CUDA_TRY((set_smem_attr<__nv_bfloat16, false>(optin)));
    MLA_CUDA_TRY((set_smem_attr<__nv_bfloat16, true>(optin)));
    MLA_CUDA_TRY((set_smem_attr<__half, false>(optin)));
    MLA_CUDA_TRY((set_smem_attr<__half, true>(optin)));
    // The configuration (log #26, #28): with at least 32 query rows and room for only one
    // 4-warp CTA per SM (sm_120; the H200 in sm120-occupancy mode), 32 rows per 8-warp CTA
    // (each K and V fragment serves two m-tiles); else 8 warps per CTA when the step has at
    // most two tiles per SM (b=1, t=1: every CTA has an SM to itself either way, and 8 warps
    // finish its tiles sooner); else 4 warps, two CTAs per H200 SM.
    const int64_t max_tiles = all_tiles * ((static_cast<int64_t>(q_len) * num_heads + Cfg::kBlockM - 1) / Cfg::kBlockM);
    int smem = 0, ctas = 0;
    mla_status_t fit = config_fit<Cfg>(sm120_occupancy, smem_per_sm, optin, &smem, &ctas);
    if (fit != MLA_STATUS_OK) return fit;
    int block_m = q_len * num_heads >= 32 && ctas == 1 && tune.warps != 4 ? 32 : 16;
    if (tune.block_m != 0) block_m = tune.block_m;
    int warps = block_m == 32 || max_tiles <= 2LL * sm_count ? 8 : 4;
    if (tune.warps != 0) warps = tune.warps;
    fit = with_config(warps, block_m, [&](auto c) {
        return config_fit<decltype(c)>(sm120_occupancy, smem_per_sm, optin, &smem, &ctas);
    });
    if (fit != MLA_STATUS_OK) return fit;
    const int m_rows = q_len * num_heads;
    const int m_tiles = (m_rows + block_m - 1) / block_m;
    const int target = sm_count * ctas;
    int parts = (target + m_tiles - 1) / m_tiles;
    if (parts < 1) parts = 1;
    *s = mla_schedule_t{};
    s->batch = batch;
    s->q_len = q_len;
    s->num_heads = num_heads;
    s->max_len = max_len;
    s->num_m_tiles = m_tiles;
    s->num_parts = parts;
    s->smem_bytes = smem;
    s->ctas_per_sm = ctas;
    s->sm_count = sm_count;
    s->sm120_occupancy = sm120_occupancy ? 1 : 0;
    s->device = dev;
    mla_schedule_internal_t& in = s->internal;
    in.warps = warps;
    in.block_m = block_m;
    // Programmatic dependent launch (sm_90+), MLA_PDL_DEFAULT = the launch attribute (the
    // combine's launch overlaps decode) + each decode CTA lets the combine be scheduled when
    // it starts its last tile (docs/PERFORMANCE.md log #20: that hides part of the combine's
    // launch; the trigger at the start lets combine CTAs sit resident and slows long single
    // sequences, logs #9, #16).
    const int pdl = tune.pdl == 0 ? MLA_PDL_DEFAULT : (tune.pdl == MLA_PDL_OFF ? 0 : tune.pdl);
    in.pdl = major >= 9 ? pdl : 0;
    // Parts of one tile when every tile can have a CTA of its own (t=1, b=1: the second
    // tile's compute leaves the critical path; log #27), else at least kMinChunkTiles.
    in.min_chunk = tune.min_chunk != 0 ? tune.min_chunk : (max_tiles <= sm_count ? 1 : kMinChunkTiles);
    in.combine_slices = tune.combine_slices != 0 ? tune.combine_slices : combine_slices(s);
    return MLA_STATUS_OK;
}

extern "C" mla_status_t mla_dense_decode(const mla_schedule_t* s, const mla_dense_params_t* p, void* stream) {
    DecodeArgs a;
    MLA_REQUIRE(common_args(s, p, a));
    MLA_REQUIRE(p->block_table != nullptr && p->max_blocks_per_seq >= 1 &&
                p->block_table_stride >= p->max_blocks_per_seq);
    MLA_REQUIRE(static_cast<int64_t>(s->max_len) == static_cast<int64_t>(p->max_blocks_per_seq) * p->block_size);
    MLA_REQUIRE(p->seq_lens != nullptr);
    a.lens = p->seq_lens;
    a.check_lens = 1;
    a.table = p->block_table;
    a.table_stride = p->block_table_stride;
    a.table_cols = p->max_blocks_per_seq;
    a.combine_rows = combine_rows(s);
    prepare_split(a);
    return launch<false>(s, a, p->dtype, stream);
}

extern "C" mla_status_t mla_sparse_decode(const mla_schedule_t* s, const mla_sparse_params_t* p, void* stream) {
    DecodeArgs a;
    MLA_REQUIRE(common_args(s, p, a));
    MLA_REQUIRE(p->indices != nullptr && p->topk >= 1 && p->topk <= MLA_MAX_TOPK && p->indices_stride >= p->topk);
    MLA_REQUIRE(s->q_len == 1 && s->max_len == p->topk);
    a.lens = p->topk_len;
    a.check_lens = 0;
    a.table = p->indices;
    a.table_stride = p->indices_stride;
    a.table_cols = p->topk;
    a.combine_rows = combine_rows(s);
    prepare_split(a);
    return launch<true>(s, a, p->dtype, stream);
}

extern "C" size_t mla_workspace_bytes(const mla_schedule_t* s) {
    if (s == nullptr) return 0;
    const size_t rows = 2 * static_cast<size_t>(s->num_parts) * s->q_len * s->num_heads;
    return rows * (kLatentDim + 1) * sizeof(float);
}

#ifdef MLA_TRACE
// scripts/smoke.cu's trace mode: reset / copy out the phase timestamps (g_mla_trace).
extern "C" int mla_trace_reset(void* stream) {
    void* p = nullptr;
    if (cudaGetSymbolAddress(&p, ::g_mla_trace) != cudaSuccess) return 1;
    return cudaMemsetAsync(p, 0, sizeof(::g_mla_trace), static_cast<cudaStream_t>(stream)) != cudaSuccess;
}
extern "C" int mla_trace_read(unsigned long long* host, size_t bytes) {
    return cudaMemcpyFromSymbol(host, ::g_mla_trace, bytes < sizeof(::g_mla_trace) ? bytes : sizeof(::g_mla_trace)) !=
           cudaSuccess;
}
#endif
