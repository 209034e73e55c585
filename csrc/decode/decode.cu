// C entry points of dense and sparse decode: check arguments, fill DecodeArgs, launch
// decode_kernel then combine_kernel on the caller's stream. This is the translation unit
// that instantiates and launches the decode kernels, so kernel attributes and occupancy
// are asked for here too (decode/launch.cuh, for the schedule).
#include "common/status.cuh"
#include "decode/combine.cuh"
#include "decode/config.cuh"
#include "decode/kernel.cuh"
#include "decode/launch.cuh"
#include "decode/split.cuh"

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

template <typename T, bool kSparse>
mla_status_t launch_typed(const mla_schedule_t* s, const DecodeArgs& a, cudaStream_t st) {
    const dim3 grid(s->num_m_tiles, s->num_parts);
    const int z = s->internal.combine_slices;
    const dim3 cgrid(max_splits(s->batch, s->num_parts), (a.m_rows + a.combine_rows - 1) / a.combine_rows, z);
    auto* combine = z == 4 ? combine_kernel<T, kSparse, 1> : combine_kernel<T, kSparse, 4>;
    const mla_schedule_internal_t& in = s->internal;
    MLA_CUDA_TRY(with_config(in.warps, in.block_m, [&](auto c) {
        using C = decltype(c);
        return launch_pdl(decode_kernel<RowF16<T>, kSparse, C>, grid, C::kThreads, s->smem_bytes, st, in.pdl, a);
    }));
    MLA_CUDA_TRY((launch_pdl(combine, cgrid, kCombineWarps * 32, 0, st, in.pdl, a)));
    return MLA_STATUS_OK;
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
    const int need_smem =
        with_config(in.warps, in.block_m, [](auto c) { return KernelConfig16<decltype(c)>::kSmemBytes; });
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
    a.ws_lse = p->workspace + ws_rows(s->num_parts, a.m_rows) * kLatentDim;
    a.flag = p->error_flag;
    a.pdl = s->internal.pdl;
    return true;
}

template <typename T, bool kSparse>
cudaError_t set_smem_attr(int bytes) {
    cudaError_t e = cudaSuccess;
    for_each_config([&](auto c) {
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(decode_kernel<RowF16<T>, kSparse, decltype(c)>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     bytes);
    });
    return e;
}

}  // namespace

cudaError_t mla::decode_allow_smem(int bytes) {
    cudaError_t e = set_smem_attr<__nv_bfloat16, false>(bytes);
    if (e == cudaSuccess) e = set_smem_attr<__nv_bfloat16, true>(bytes);
    if (e == cudaSuccess) e = set_smem_attr<__half, false>(bytes);
    if (e == cudaSuccess) e = set_smem_attr<__half, true>(bytes);
    return e;
}

cudaError_t mla::decode_ctas_per_sm(int warps, int block_m, int smem, int* ctas) {
    return with_config(warps, block_m, [&](auto c) {
        using C = decltype(c);
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, decode_kernel<RowF16<__nv_bfloat16>, false, C>,
                                                             C::kThreads, smem);
    });
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
