// C entry points of dense and sparse decode: check arguments, fill DecodeArgs, launch
// decode_kernel then combine_kernel on the caller's stream. This is the translation unit
// that instantiates and launches the decode kernels, so kernel attributes and occupancy
// are asked for here too (decode/launch.cuh, for the schedule).
#include <atomic>

#include "common/status.cuh"
#include "decode/combine.cuh"
#include "decode/config.cuh"
#include "decode/format_fp8.cuh"
#include "decode/kernel.cuh"
#include "decode/launch.cuh"
#include "decode/rows.cuh"
#include "decode/split.cuh"

using namespace mla;

// Returns a failed mla_status_t from a check helper.
#define MLA_TRY(expr)                                 \
    do {                                              \
        const mla_status_t mla_st_ = (expr);          \
        if (mla_st_ != MLA_STATUS_OK) return mla_st_; \
    } while (0)

namespace {

// Per row-format class (smem_class: 16-bit rows, fp8_ds_mla, per-tensor fp8), the devices (bit
// per ordinal, the first 64) whose decode kernels of that class have had their shared-memory
// limit raised in this process (decode_allow_smem).
std::atomic<uint64_t> g_smem_allowed[3] = {};
int smem_class(mla_kv_format_t fmt) { return fmt == MLA_KV_FP8_DS_MLA ? 1 : fmt == MLA_KV_FP8 ? 2 : 0; }

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

// A failed first launch of a decode call (nothing enqueued): a stream of another device than
// the schedule's fails it, and is named as such; else the CUDA error, as the launch `what`. The
// stream's device is asked for only here: cudaStreamGetDevice is not a call a capturing stream
// allows (it invalidates the capture).
mla_status_t first_launch_failed(cudaError_t e, const mla_schedule_t* s, cudaStream_t st, const char* what) {
    int stream_dev = s->device;  // capture: failure path
    if (cudaStreamGetDevice(st, &stream_dev) == cudaSuccess && stream_dev != s->device) {  // capture: failure path
        (void)cudaGetLastError();  // (the launch's own error, not the caller's)
        return fail(MLA_STATUS_WRONG_DEVICE, "stream: belongs to device %d, the schedule and the current device are %d",
                    stream_dev, s->device);
    }
    return cuda_fail(e, what);
}

template <typename Fmt, bool kSparse>
mla_status_t launch_typed(const mla_schedule_t* s, const DecodeArgs& args, cudaStream_t st) {
    DecodeArgs a = args;  // (the kSpec launch below sets the closed form with lengths, which the combine reads too)
    using T = typename Fmt::Elem;
    const mla_schedule_internal_t& in = s->internal;
    if (in.path == MLA_PATH_ROWS) {  // a CTA per (query row, request); nothing to merge
        const dim3 rgrid(a.m_rows, s->batch);
        const cudaError_t e = launch_pdl(rows_kernel<Fmt, kSparse>, rgrid, kRowsWarps * 32, 0, st, in.pdl, a);
        return e == cudaSuccess ? MLA_STATUS_OK : first_launch_failed(e, s, st, "the row kernel's launch");
    }
    const dim3 grid(s->num_m_tiles, s->num_parts);
    const int z = s->internal.combine_slices;
    dim3 cgrid(max_splits(s->batch, s->num_parts), (a.m_rows + a.combine_rows - 1) / a.combine_rows, z);
    // (slices, pieces per lane per round trip): decode/split.cuh, combine_slices and
    // combine_deep_batch (8 warps per row only); the long requests' rows are dealt over the
    // grid (combine_dealing_kernel) when there may be any (combine_deals; 2 slices are a warp
    // per row only)
    const bool by_warps = a.combine_rows == 1;
    auto* combine = z == 16                 ? combine_kernel<T, kSparse, 16, 4>
                    : z == 1                ? combine_kernel<T, kSparse, 1, 8>
                    : z == 2                ? combine_dealing_kernel<T, kSparse, 2, false>
                    : combine_deep_batch(s) ? combine_kernel<T, kSparse, 4, 16>
                    : !combine_deals(a)     ? combine_kernel<T, kSparse, 4, 4>
                    : by_warps              ? combine_dealing_kernel<T, kSparse, 4, true>
                                            : combine_dealing_kernel<T, kSparse, 4, false>;
    const cudaError_t launched = with_config(in.warps, in.block_m, in.form, [&](auto c) -> cudaError_t {
        using C = decltype(c);
        if constexpr (!kConfigFor<Fmt, C>) {
            return cudaErrorInvalidConfiguration;  // (launch checks the form against the format)
        } else {
            if constexpr (kWithinKernel<Fmt, C>) {
                if (a.split_within)
                    return launch_pdl(decode_kernel<Fmt, kSparse, C, true>, grid, C::kThreads, s->smem_bytes, st, in.pdl, a);
            }
            if constexpr (kSpecKernel<Fmt, C>) {
                if (const int n = closed_lens_parts(a)) {
                    a.closed_lens = 1;
                    a.closed_n = FastDiv::make(n);
                    a.closed_chunk = FastDiv::make(a.min_chunk);
                    a.aligned_div = FastDiv{0, 0, 0};  // (every part inside one request already)
                    return launch_pdl(decode_kernel<Fmt, kSparse, C, false, true>, grid, C::kThreads, s->smem_bytes, st,
                                      in.pdl, a);
                }
            }
            // The flat split with lengths' own instantiation: the aligned chunk for equal lengths
            // (prepare_split sets a.aligned_div only where the configuration has one,
            // aligned_may_move) and the one-round-trip search of large batches (flat_lens_kernel)
            if constexpr (kAlignedKernel<Fmt, C>) {
                if (flat_lens_kernel<C>(a))
                    return launch_pdl(decode_kernel<Fmt, kSparse, C, false, false, true>, grid, C::kThreads, s->smem_bytes,
                                      st, in.pdl, a);
            }
            return launch_pdl(decode_kernel<Fmt, kSparse, C>, grid, C::kThreads, s->smem_bytes, st, in.pdl, a);
        }
    });
    if (launched != cudaSuccess) return first_launch_failed(launched, s, st, "the decode launch");
    // One part, or a split that the host knows lays every request inside one part
    // (nothing_to_merge): no request is split, nothing to merge.
    if (s->num_parts > 1 && !nothing_to_merge(a)) {
        // (after the decode launch: it may set the closed form with lengths, which decides this)
        if (const int loop_ctas = combine_loop_ctas(s, a)) {
            combine = combine_kernel<T, kSparse, 1, 8, true>;
            cgrid.x = loop_ctas;
        }
        MLA_CUDA_TRY_AS(launch_pdl(combine, cgrid, kCombineWarps * 32, 0, st, in.pdl, a), "the combine launch");
    }
    return MLA_STATUS_OK;
}

template <bool kSparse>
mla_status_t launch(const mla_schedule_t* s, const DecodeArgs& a, mla_dtype_t dtype, mla_kv_format_t fmt,
                    void* stream) {
    int dev = -1;
    MLA_CUDA_TRY(cudaGetDevice(&dev));
    if (dev != s->device)
        return fail(MLA_STATUS_WRONG_DEVICE, "s: the schedule was made for device %d, the current device is %d",
                    s->device, dev);
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    // The kernels' shared-memory limit, if no mla_schedule_init raised it on this device in this
    // process (a schedule is plain data: it may come from elsewhere)
    if (!decode_smem_allowed(dev, fmt)) {
        int optin = 0;
        MLA_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
        MLA_CUDA_TRY(decode_allow_smem(dev, fmt, optin));
    }
    // A schedule edited by hand must still match the configuration it launches.
    const mla_schedule_internal_t& in = s->internal;
    MLA_CHECK(in.combine_slices == 1 || in.combine_slices == 4 || in.combine_slices == 16 ||
                  (in.combine_slices == 2 && combine_rows(s) > 1),
              "s.internal.combine_slices: %d", in.combine_slices);
    MLA_CHECK((in.warps == 4 || in.warps == 8) &&
                  (in.block_m == 8 || in.block_m == 16 || (in.block_m == 32 && in.warps == 8)),
              "s.internal: warps %d, block_m %d is not a configuration", in.warps, in.block_m);
    MLA_CHECK((in.pdl & ~(MLA_PDL_ALL | kPdlTriggerShortParts)) == 0, "s.internal.pdl: %d", in.pdl);
    MLA_CHECK(in.split == MLA_SPLIT_FLAT || (in.split == MLA_SPLIT_WITHIN_REQUESTS && within_allowed(s)),
              "s.internal.split: %d", in.split);
    MLA_CHECK(in.path == MLA_PATH_TILES || (in.path == MLA_PATH_ROWS && s->batch <= kRowsMaxBatch), "s.internal.path: %d",
              in.path);
    MLA_CHECK(in.form == MLA_FORM_DIRECT || (in.form == MLA_FORM_TRANSPOSED && form_allowed(fmt, in.warps, in.block_m)),
              "s.internal.form: %d", in.form);
    const int need_smem = with_row_format(fmt, [&](auto f) {
        return with_config(in.warps, in.block_m, in.form,
                           [](auto c) { return KernelConfig<decltype(f), decltype(c)>::kSmemBytes; });
    });
    MLA_CHECK(s->smem_bytes >= need_smem && s->num_m_tiles == (a.m_rows + in.block_m - 1) / in.block_m &&
                  s->num_parts >= 1,
              "s: smem_bytes, num_m_tiles or num_parts do not match the configuration (edited by hand?)");
    // The one list of (query dtype, cache format) -> row format policy (decode/format.cuh,
    // decode/format_fp8.cuh); common_args accepted only these pairs.
    if (dtype == MLA_DTYPE_BF16) {
        if (fmt == MLA_KV_FP8_DS_MLA) return launch_typed<RowFp8DsMla<__nv_bfloat16>, kSparse>(s, a, st);
        if (fmt == MLA_KV_FP8) return launch_typed<RowFp8Tensor<__nv_bfloat16>, kSparse>(s, a, st);
        return launch_typed<RowF16<__nv_bfloat16>, kSparse>(s, a, st);
    }
    if (fmt == MLA_KV_FP8_DS_MLA) return launch_typed<RowFp8DsMla<__half>, kSparse>(s, a, st);
    if (fmt == MLA_KV_FP8) return launch_typed<RowFp8Tensor<__half>, kSparse>(s, a, st);
    return launch_typed<RowF16<__half>, kSparse>(s, a, st);
}

// What is wrong with the strides (elements) of a [tokens, heads, width] view, or NULL. Only
// the dimensions of size > 1 count (their strides are the only ones used). Strides are
// non-negative. The rows of a view the call writes do not overlap (sufficient: sorted by stride,
// each dimension steps past all the inner ones); a view it reads steps each used dimension by
// 0 (every index reads the same row) or by at least the row's width: a shorter step reads the
// next row's elements as this row's (a 512-wide q_nope passed as packed 576-wide rows).
const char* layout_error(int64_t token_stride, int64_t tokens, int64_t head_stride, int64_t heads, int64_t width,
                         bool written) {
    struct Dim {
        int64_t stride, n;
    } d[2] = {{token_stride, tokens}, {head_stride, heads}};
    for (const Dim& x : d) {
        if (x.n <= 1) continue;
        if (x.stride < 0) return "a negative stride";
        if (!written && x.stride != 0 && x.stride < width) return "a stride shorter than the row";
    }
    if (!written) return nullptr;
    if (d[1].stride < d[0].stride) {
        const Dim t = d[0];
        d[0] = d[1];
        d[1] = t;
    }
    __int128 inner = width;
    for (const Dim& x : d) {
        if (x.n <= 1) continue;
        if (x.stride < inner) return "rows that overlap";
        inner += static_cast<__int128>(x.stride) * (x.n - 1);
    }
    return nullptr;
}

// Rejects view `name` ([tokens, heads, width] with those strides) where layout_error finds
// something wrong; `hint` ends the message.
mla_status_t check_layout(const char* name, int64_t token_stride, int64_t tokens, int64_t head_stride, int64_t heads,
                          int64_t width, bool written, const char* hint = "") {
    const char* why = layout_error(token_stride, tokens, head_stride, heads, width, written);
    MLA_CHECK(why == nullptr, "%s_token_stride, %s_head_stride: (%lld, %lld) give %s for [%lld, %lld, %lld] rows%s", name,
              name, static_cast<long long>(token_stride), static_cast<long long>(head_stride), why,
              static_cast<long long>(tokens), static_cast<long long>(heads), static_cast<long long>(width), hint);
    return MLA_STATUS_OK;
}

// Checks and fills the fields mla_dense_params_t and mla_sparse_params_t share (same names
// in both); `tokens` is the number of query tokens (batch * q_len or T). Returns
// MLA_STATUS_OK, or the status of the first argument found wrong (mla_last_error names it).
template <typename P>
mla_status_t common_args(const mla_schedule_t* s, const P* p, int64_t tokens, DecodeArgs& a) {
    MLA_CHECK(p->num_heads == s->num_heads, "num_heads: %d, the schedule was made for %d", p->num_heads,
              s->num_heads);
    MLA_CHECK(p->dtype == MLA_DTYPE_F16 || p->dtype == MLA_DTYPE_BF16, "dtype: %d is not an mla_dtype_t",
              static_cast<int>(p->dtype));
    MLA_CHECK(p->q_nope != nullptr, "q_nope: NULL");
    MLA_CHECK(p->q_rope != p->q_nope,
              "q_rope: equals q_nope (packed 576-wide rows: pass q_rope = NULL, or q_nope + 512 elements)");
    MLA_CHECK(p->kv_cache != nullptr, "kv_cache: NULL");
    MLA_CHECK(p->out != nullptr, "out: NULL");
    MLA_CHECK(p->workspace != nullptr, "workspace: NULL");
    const int64_t rb = row_bytes_of(p->kv_format);
    MLA_CHECK(rb != 0, "kv_format: %d is not an mla_kv_format_t", static_cast<int>(p->kv_format));
    MLA_CHECK(p->kv_format == s->kv_format, "kv_format: %d, the schedule was made for %d",
              static_cast<int>(p->kv_format), static_cast<int>(s->kv_format));
    if (p->kv_format == MLA_KV_F16 || p->kv_format == MLA_KV_BF16) {
        MLA_CHECK((p->kv_format == MLA_KV_F16) == (p->dtype == MLA_DTYPE_F16),
                  "kv_format: an f16/bf16 cache must have the query's dtype");
        MLA_CHECK(p->kv_scale == nullptr, "kv_scale: only MLA_KV_FP8 takes a scale");
    } else if (p->kv_format == MLA_KV_FP8) {
        MLA_CHECK(p->kv_scale != nullptr, "kv_scale: NULL (MLA_KV_FP8 reads its fp32 scale on the device)");
        MLA_CHECK((reinterpret_cast<uintptr_t>(p->kv_scale) & 3) == 0, "kv_scale: not 4-byte aligned");
    } else {
        MLA_CHECK(p->kv_scale == nullptr, "kv_scale: only MLA_KV_FP8 takes a scale");
    }
    const int32_t bs = p->block_size;
    MLA_CHECK(bs == 16 || bs == 32 || bs == 64 || bs == 128, "block_size: %d, must be 16, 32, 64 or 128", bs);
    MLA_CHECK(p->num_blocks >= 1, "num_blocks: %d, must be >= 1", p->num_blocks);
    MLA_CHECK(p->block_stride_bytes >= bs * rb && p->block_stride_bytes % 16 == 0,
              "block_stride_bytes: %lld, must be a multiple of 16 and >= block_size * %lld",
              static_cast<long long>(p->block_stride_bytes), static_cast<long long>(rb));
    // q_rope = NULL: packed rows, the rope dims 512 elements after the nope dims.
    const bool packed = p->q_rope == nullptr;
    const void* q_rope = packed ? static_cast<const void*>(static_cast<const uint8_t*>(p->q_nope) + kLatentDim * 2)
                                : p->q_rope;
    const int64_t qr_ts = packed ? p->q_nope_token_stride : p->q_rope_token_stride;
    const int64_t qr_hs = packed ? p->q_nope_head_stride : p->q_rope_head_stride;
    MLA_CHECK(aligned16(p->q_nope), "q_nope: not 16-byte aligned");
    MLA_CHECK(aligned16(q_rope), "q_rope: not 16-byte aligned");
    MLA_CHECK(aligned16(p->kv_cache), "kv_cache: not 16-byte aligned");
    MLA_CHECK(aligned16(p->out), "out: not 16-byte aligned");
    MLA_CHECK(aligned16(p->workspace), "workspace: not 16-byte aligned");
    MLA_CHECK((reinterpret_cast<uintptr_t>(p->lse) & 3) == 0, "lse: not 4-byte aligned");
    // Rows are read and written 16 bytes at a time: strides must keep them aligned, except
    // along a dimension of size 1, whose stride is never used.
    const bool one_token = tokens == 1, one_head = s->num_heads == 1;
    auto ok = [](int64_t stride, bool unused) { return unused || stride16(stride); };
    MLA_CHECK(ok(p->q_nope_token_stride, one_token), "q_nope_token_stride: %lld elements is not 16-byte aligned",
              static_cast<long long>(p->q_nope_token_stride));
    MLA_CHECK(ok(p->q_nope_head_stride, one_head), "q_nope_head_stride: %lld elements is not 16-byte aligned",
              static_cast<long long>(p->q_nope_head_stride));
    MLA_CHECK(ok(qr_ts, one_token), "q_rope_token_stride: %lld elements is not 16-byte aligned",
              static_cast<long long>(qr_ts));
    MLA_CHECK(ok(qr_hs, one_head), "q_rope_head_stride: %lld elements is not 16-byte aligned",
              static_cast<long long>(qr_hs));
    MLA_CHECK(ok(p->out_token_stride, one_token), "out_token_stride: %lld elements is not 16-byte aligned",
              static_cast<long long>(p->out_token_stride));
    MLA_CHECK(ok(p->out_head_stride, one_head), "out_head_stride: %lld elements is not 16-byte aligned",
              static_cast<long long>(p->out_head_stride));
    // Row layouts: no negative strides, no row read across the next, no two written rows overlapping.
    const int64_t heads = s->num_heads;
    MLA_TRY(check_layout("q_nope", p->q_nope_token_stride, tokens, p->q_nope_head_stride, heads,
                         packed ? kHeadDim : kLatentDim, false,
                         packed ? " (q_rope = NULL: packed 576-wide rows; a 512-wide q_nope needs its q_rope)" : ""));
    if (!packed) MLA_TRY(check_layout("q_rope", qr_ts, tokens, qr_hs, heads, MLA_ROPE_DIM, false));
    MLA_TRY(check_layout("out", p->out_token_stride, tokens, p->out_head_stride, heads, kLatentDim, true));
    if (p->lse != nullptr) MLA_TRY(check_layout("lse", p->lse_token_stride, tokens, p->lse_head_stride, heads, 1, true));
    MLA_CHECK(aligned_to(p->error_flag, 4), "error_flag: not 4-byte aligned");
    MLA_CHECK(p->softmax_scale > 0.f && isfinite(p->softmax_scale), "softmax_scale: %g, must be finite and > 0",
              static_cast<double>(p->softmax_scale));
    a = DecodeArgs{};
    a.q_nope = static_cast<const uint8_t*>(p->q_nope);
    a.q_rope = static_cast<const uint8_t*>(q_rope);
    a.qn_ts = p->q_nope_token_stride;
    a.qn_hs = p->q_nope_head_stride;
    a.qr_ts = qr_ts;
    a.qr_hs = qr_hs;
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
    a.ws_o = p->workspace;
    a.ws_lse = p->workspace + ws_rows(s->num_parts, a.m_rows) * kLatentDim;
    a.flag = p->error_flag;
    {
        const int pdl = s->internal.pdl;
        const int start = (pdl & MLA_PDL_TRIGGER_AT_START) ? kPdlStartAlways
                          : (pdl & kPdlTriggerShortParts)  ? kPdlShortPartTiles
                                                           : 0;
        a.pdl = (pdl & MLA_PDL_ALL) | (start << kPdlStartShift);
    }
    a.kv_scale = p->kv_scale;
    return MLA_STATUS_OK;
}

// The longest length the kernels clamp to (the table's width or topk): the split counts
// 32-row tiles of every request at that length in int32.
mla_status_t set_max_len(const mla_schedule_t* s, int64_t max_len, const char* what, DecodeArgs& a) {
    const int64_t tiles = (max_len + 31) / 32;
    MLA_CHECK(max_len <= 0x7fffffffLL - 31 && static_cast<int64_t>(s->batch) * tiles <= 0x7fffffffLL,
              "%s: batch * ceil(%lld / 32) tiles exceeds INT32_MAX", what, static_cast<long long>(max_len));
    a.max_len = static_cast<int32_t>(max_len);
    return MLA_STATUS_OK;
}

template <typename Fmt, bool kSparse>
cudaError_t set_smem_attr(int bytes) {
    cudaError_t e = cudaSuccess;
    for_each_config([&](auto c) {
        using C = decltype(c);
        if constexpr (kConfigFor<Fmt, C>) {
            if (e == cudaSuccess)
                e = cudaFuncSetAttribute(decode_kernel<Fmt, kSparse, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
            if constexpr (kWithinKernel<Fmt, C>) {
                if (e == cudaSuccess)
                    e = cudaFuncSetAttribute(decode_kernel<Fmt, kSparse, C, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             bytes);
            }
            if constexpr (kSpecKernel<Fmt, C>) {
                if (e == cudaSuccess)
                    e = cudaFuncSetAttribute(decode_kernel<Fmt, kSparse, C, false, true>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
            }
            if constexpr (kAlignedKernel<Fmt, C>) {
                if (e == cudaSuccess)
                    e = cudaFuncSetAttribute(decode_kernel<Fmt, kSparse, C, false, false, true>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
            }
        }
    });
    return e;
}

}  // namespace

// The kernels of row format Row<T> for both query dtypes, dense and sparse.
template <template <typename> class Row>
cudaError_t allow_smem_rows(int bytes) {
    cudaError_t e = set_smem_attr<Row<__nv_bfloat16>, false>(bytes);
    if (e == cudaSuccess) e = set_smem_attr<Row<__nv_bfloat16>, true>(bytes);
    if (e == cudaSuccess) e = set_smem_attr<Row<__half>, false>(bytes);
    if (e == cudaSuccess) e = set_smem_attr<Row<__half>, true>(bytes);
    return e;
}

cudaError_t mla::decode_allow_smem(int dev, mla_kv_format_t fmt, int bytes) {
    const int c = smem_class(fmt);
    const cudaError_t e = c == 1   ? allow_smem_rows<RowFp8DsMla>(bytes)
                          : c == 2 ? allow_smem_rows<RowFp8Tensor>(bytes)
                                   : allow_smem_rows<RowF16>(bytes);
    if (e == cudaSuccess && dev >= 0 && dev < 64) g_smem_allowed[c].fetch_or(1ull << dev, std::memory_order_acq_rel);
    return e;
}

bool mla::decode_smem_allowed(int dev, mla_kv_format_t fmt) {
    return dev < 0 || dev >= 64 || (g_smem_allowed[smem_class(fmt)].load(std::memory_order_acquire) >> dev & 1);
}

cudaError_t mla::decode_ctas_per_sm(mla_kv_format_t fmt, int warps, int block_m, int smem, int* ctas) {
    return with_row_format(fmt, [&](auto f) {
        // (the direct form: the transposed one holds fewer registers, and the form is picked
        // by the CTAs per SM this finds)
        return with_config(warps, block_m, [&](auto c) {
            using C = decltype(c);
            return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, decode_kernel<decltype(f), false, C>, C::kThreads,
                                                                 smem);
        });
    });
}



extern "C" mla_status_t mla_dense_decode(const mla_schedule_t* s, const mla_dense_params_t* p, void* stream) {
    enter("mla_dense_decode");
    MLA_CHECK(s != nullptr, "s: NULL");
    MLA_CHECK(p != nullptr, "p: NULL");
    MLA_CHECK(s->kind == MLA_KIND_DENSE, "s: made for sparse decode (shape.kind MLA_KIND_SPARSE); dense decode takes "
              "a schedule made with MLA_KIND_DENSE");
    MLA_CHECK(p->batch == s->batch && p->q_len == s->q_len,
              "batch, q_len: (%d, %d), the schedule was made for (%d, %d)", p->batch, p->q_len, s->batch, s->q_len);
    DecodeArgs a;
    MLA_TRY(common_args(s, p, static_cast<int64_t>(p->batch) * p->q_len, a));
    MLA_CHECK(p->block_table != nullptr, "block_table: NULL");
    MLA_CHECK(p->max_blocks_per_seq >= 1, "max_blocks_per_seq: %d, must be >= 1", p->max_blocks_per_seq);
    MLA_CHECK(p->batch == 1 || p->block_table_stride >= p->max_blocks_per_seq,
              "block_table_stride: %lld, must be >= max_blocks_per_seq (%d)",
              static_cast<long long>(p->block_table_stride), p->max_blocks_per_seq);
    MLA_CHECK(p->batch == 1 || p->block_table_stride <= 0x7fffffffLL, "block_table_stride: %lld exceeds INT32_MAX",
              static_cast<long long>(p->block_table_stride));
    MLA_CHECK(p->seq_lens != nullptr, "seq_lens: NULL");
    MLA_CHECK(aligned_to(p->block_table, 4), "block_table: not 4-byte aligned");
    MLA_CHECK(aligned_to(p->seq_lens, 4), "seq_lens: not 4-byte aligned");
    MLA_TRY(set_max_len(s, static_cast<int64_t>(p->max_blocks_per_seq) * p->block_size, "max_blocks_per_seq * block_size",
                        a));
    a.lens = p->seq_lens;
    a.check_lens = kLensDense;
    a.table = p->block_table;
    a.table_stride = static_cast<int32_t>(p->batch == 1 ? 0 : p->block_table_stride);
    a.table_cols = p->max_blocks_per_seq;
    prepare_split(s, a);
    return launch<false>(s, a, p->dtype, p->kv_format, stream);
}

extern "C" mla_status_t mla_sparse_decode(const mla_schedule_t* s, const mla_sparse_params_t* p, void* stream) {
    enter("mla_sparse_decode");
    MLA_CHECK(s != nullptr, "s: NULL");
    MLA_CHECK(p != nullptr, "p: NULL");
    MLA_CHECK(s->kind == MLA_KIND_SPARSE, "s: made for dense decode (shape.kind MLA_KIND_DENSE); sparse decode takes "
              "a schedule made with MLA_KIND_SPARSE");
    MLA_CHECK(p->num_tokens == s->batch, "num_tokens: %d, the schedule was made for %d", p->num_tokens, s->batch);
    DecodeArgs a;
    MLA_TRY(common_args(s, p, p->num_tokens, a));
    MLA_CHECK(p->indices != nullptr, "indices: NULL");
    MLA_CHECK(aligned_to(p->indices, 4), "indices: not 4-byte aligned");
    MLA_CHECK(aligned_to(p->topk_len, 4), "topk_len: not 4-byte aligned");
    MLA_CHECK(p->topk >= 1 && p->topk <= MLA_MAX_TOPK, "topk: %d, must be in 1..=%d", p->topk, MLA_MAX_TOPK);
    MLA_CHECK(p->num_tokens == 1 || p->indices_stride >= p->topk, "indices_stride: %lld, must be >= topk (%d)",
              static_cast<long long>(p->indices_stride), p->topk);
    MLA_CHECK(p->num_tokens == 1 || p->indices_stride <= 0x7fffffffLL, "indices_stride: %lld exceeds INT32_MAX",
              static_cast<long long>(p->indices_stride));
    MLA_CHECK(static_cast<int64_t>(p->num_blocks) * p->block_size <= 0x7fffffffLL,
              "num_blocks: num_blocks * block_size exceeds INT32_MAX (slot ids are int32)");
    MLA_TRY(set_max_len(s, p->topk, "topk", a));
    a.lens = p->topk_len;
    a.check_lens = kLensSparse;
    a.table = p->indices;
    a.table_stride = static_cast<int32_t>(p->num_tokens == 1 ? 0 : p->indices_stride);
    a.table_cols = p->topk;
    prepare_split(s, a);
    return launch<true>(s, a, p->dtype, p->kv_format, stream);
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
