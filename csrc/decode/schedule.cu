// The schedule: mla_schedule_init picks the tile configuration, the grid and the split's
// parameters from the shape (and the caller's tuning overrides), and mla_workspace_bytes sizes
// the split workspace. Host code only: the kernels' attributes and occupancy are asked of
// decode/decode.cu, which launches them (decode/launch.cuh).
#include "common/constants.cuh"
#include "common/status.cuh"
#include "decode/config.cuh"
#include "decode/launch.cuh"
#include "decode/split.cuh"

using namespace mla;

namespace {

// Tiles per request (at the shape's max_len), dense / sparse: from which the 32-row configuration
// may run with two CTAs per SM, and up to which a one-m-tile 16-bit step runs one CTA per SM
// (log #85, rules A and B).
constexpr int64_t kWideReqTiles[2] = {128, 32};
constexpr int64_t kShortReqTiles[2] = {5, 2};
// Tiles per request (at max_len) up to which an 8-row step of a batch near the SM count keeps
// every request in one part, 16-bit / fp8 rows (logs #119, #120).
constexpr int64_t kShort8Tiles[2] = {8, 4};

// Dynamic shared memory a configuration requests for cache format fmt (padded in
// sm120-occupancy mode so that an SM holds as many CTAs as an sm_120 SM, and with one_per_sm
// so that it holds one) and the CTAs per SM that then fit.
template <typename C>
mla_status_t config_fit(mla_kv_format_t fmt, bool sm120_occupancy, bool one_per_sm, int smem_per_sm, int optin,
                        int* smem_out, int* ctas_out) {
    const int need = with_row_format(fmt, [](auto f) { return KernelConfig<decltype(f), C>::kSmemBytes; });
    int smem = need;
    if (smem > optin)
        return fail(MLA_STATUS_UNSUPPORTED, "the device allows %d bytes of shared memory per block, the configuration needs %d",
                    optin, smem);
    if (sm120_occupancy || one_per_sm) {
        // As many CTAs per SM as sm_120 holds (100 KB per SM, 1 KB reserved per CTA), or one.
        const int sm120_ctas = one_per_sm ? 1 : kSm120SmemPerSm / (need + 1024);
        int padded = smem_per_sm / (sm120_ctas + 1) - 1024 + 16;
        padded = (padded + 15) & ~15;
        smem = padded > smem ? padded : smem;
        if (smem > optin) smem = optin;
    }
    int ctas = 0;
    MLA_CUDA_TRY(decode_ctas_per_sm(fmt, C::kWarps, C::kBlockM, smem, &ctas));
    if (ctas < 1) return fail(MLA_STATUS_UNSUPPORTED, "no decode CTA fits an SM of this device");
    *smem_out = smem;
    *ctas_out = ctas;
    return MLA_STATUS_OK;
}

}  // namespace

extern "C" mla_status_t mla_schedule_init(mla_schedule_t* s, const mla_shape_t* shape, const mla_tuning_t* tuning) {
    enter("mla_schedule_init");
    MLA_CHECK(s != nullptr, "s: NULL");
    MLA_CHECK(shape != nullptr, "shape: NULL");
    const int32_t batch = shape->batch, q_len = shape->q_len, num_heads = shape->num_heads, max_len = shape->max_len;
    MLA_CHECK(batch >= 1, "shape.batch: %d, must be >= 1", batch);
    MLA_CHECK(q_len >= 1 && q_len <= MLA_MAX_Q_LEN, "shape.q_len: %d, must be in 1..=%d", q_len, MLA_MAX_Q_LEN);
    MLA_CHECK(num_heads >= 1 && num_heads <= MLA_MAX_HEADS, "shape.num_heads: %d, must be in 1..=%d", num_heads,
              MLA_MAX_HEADS);
    MLA_CHECK(max_len >= 1 && max_len <= 0x7fffffff - 31, "shape.max_len: %d, must be in 1..=INT32_MAX-31", max_len);
    MLA_CHECK(shape->kind == MLA_KIND_DENSE || shape->kind == MLA_KIND_SPARSE,
              "shape.kind: %d, must be MLA_KIND_DENSE (0) or MLA_KIND_SPARSE (1)", static_cast<int>(shape->kind));
    const bool sparse = shape->kind == MLA_KIND_SPARSE;
    MLA_CHECK(!sparse || q_len == 1, "shape.q_len: %d, must be 1 for sparse decode (MTP tokens are more rows)", q_len);
    const mla_kv_format_t fmt = shape->kv_format;
    MLA_CHECK(fmt == MLA_KV_F16 || fmt == MLA_KV_BF16 || fmt == MLA_KV_FP8_DS_MLA || fmt == MLA_KV_FP8,
              "shape.kv_format: %d is not an mla_kv_format_t", static_cast<int>(fmt));
    const mla_tuning_t tune = tuning != nullptr ? *tuning : mla_tuning_t{};
    MLA_CHECK(tune.warps == 0 || tune.warps == 4 || tune.warps == 8, "tuning.warps: %d, must be 0, 4 or 8", tune.warps);
    MLA_CHECK(tune.block_m == 0 || tune.block_m == 8 || tune.block_m == 16 || (tune.block_m == 32 && tune.warps != 4),
              "tuning.block_m: %d, must be 0, 8, 16 or 32 (32 with 8 warps)", tune.block_m);
    MLA_CHECK(tune.pdl == MLA_PDL_OFF || (tune.pdl >= 0 && (tune.pdl & ~MLA_PDL_ALL) == 0),
              "tuning.pdl: %d, must be MLA_PDL_OFF or an OR of MLA_PDL_* bits", tune.pdl);
    MLA_CHECK(tune.combine_slices == 0 || tune.combine_slices == 1 || tune.combine_slices == 4 ||
                  tune.combine_slices == 16,
              "tuning.combine_slices: %d, must be 0, 1, 4 or 16", tune.combine_slices);
    MLA_CHECK(tune.min_chunk >= 0 && tune.min_chunk <= (1 << 20), "tuning.min_chunk: %d, must be in 0..=%d",
              tune.min_chunk, 1 << 20);
    MLA_CHECK(tune.split == 0 || tune.split == MLA_SPLIT_FLAT || tune.split == MLA_SPLIT_WITHIN_REQUESTS,
              "tuning.split: %d, must be 0, MLA_SPLIT_FLAT (%d) or MLA_SPLIT_WITHIN_REQUESTS (%d)", tune.split,
              MLA_SPLIT_FLAT, MLA_SPLIT_WITHIN_REQUESTS);
    MLA_CHECK(tune.path == 0 || tune.path == MLA_PATH_TILES || tune.path == MLA_PATH_ROWS,
              "tuning.path: %d, must be 0, MLA_PATH_TILES (%d) or MLA_PATH_ROWS (%d)", tune.path, MLA_PATH_TILES,
              MLA_PATH_ROWS);
    MLA_CHECK(tune.form == 0 || tune.form == MLA_FORM_DIRECT || tune.form == MLA_FORM_TRANSPOSED,
              "tuning.form: %d, must be 0, MLA_FORM_DIRECT (%d) or MLA_FORM_TRANSPOSED (%d)", tune.form, MLA_FORM_DIRECT,
              MLA_FORM_TRANSPOSED);
    MLA_CHECK(tune.path != MLA_PATH_ROWS || batch <= kRowsMaxBatch,
              "tuning.path: MLA_PATH_ROWS takes at most %d requests, the shape has %d", kRowsMaxBatch, batch);
    // the split counts 32-row tiles of all requests (at max_len) in int32
    const int64_t req_tiles = Lens::tiles_of(max_len);  // per request, at max_len
    const int64_t all_tiles = static_cast<int64_t>(batch) * req_tiles;
    MLA_CHECK(all_tiles <= 0x7fffffffLL, "shape: batch * ceil(max_len / 32) = %lld exceeds INT32_MAX",
              static_cast<long long>(all_tiles));
    const bool sm120_occupancy = tune.sm120_occupancy != 0;
    int dev = 0;
    MLA_CUDA_TRY(cudaGetDevice(&dev));
    int sm_count = 0, smem_per_sm = 0, optin = 0, major = 0;
    MLA_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    MLA_CUDA_TRY(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev));
    MLA_CUDA_TRY(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    MLA_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    // Allow the device maximum once: schedules with and without the sm120 padding then
    // coexist (each launch requests its own smem_bytes).
    MLA_CUDA_TRY(decode_allow_smem(dev, fmt, optin));
    // The configuration (log #26, #28): with at least 32 query rows and room for only one
    // 4-warp CTA per SM (sm_120; the H200 in sm120-occupancy mode), 32 rows per 8-warp CTA
    // (each K and V fragment serves two m-tiles); on small steps (at most two tiles per SM:
    // b=1, t=1) 8 warps or 4 with one CTA per SM (below); else 4 warps, two CTAs per H200 SM.
    const int64_t max_tiles = all_tiles * ((static_cast<int64_t>(q_len) * num_heads + Cfg::kBlockM - 1) / Cfg::kBlockM);
    int smem = 0, ctas = 0;
    mla_status_t fit = config_fit<Cfg>(fmt, sm120_occupancy, false, smem_per_sm, optin, &smem, &ctas);
    if (fit != MLA_STATUS_OK) return fit;
    // At most 8 query rows per request (8 heads or fewer, q_len 1): the half m-tile
    // configurations (8 rows per CTA: the per-row phases skip the MMA's unused rows 8-15).
    // With more than 16 query rows (two or more 16-row m-tiles; 17-31 rows since log #84 (b):
    // one 32-row CTA, partly empty, reads the cache once where two 16-row ones read it twice, so
    // sm120-occupancy h=20, q=3 h=8, q=2 h=12, h=28 and sparse h=24 steps take 19-25 % less time
    // and per-tensor fp8 h=20 4 %): per-tensor fp8 takes the 32-row configuration even where two 4-warp
    // CTAs fit an SM (6-9 % faster on the H200, log #57: its one softmax per tile serves 32 rows
    // and every converted K/V fragment two m-tiles); fp8_ds_mla's exact per-warp softmax makes
    // the 32-row CTA slower than two 4-warp ones (10-39 %), so it takes it only where one 4-warp
    // CTA fits. 16-bit rows take it on long steps (log #82): where each CTA slot of the 16-row
    // configuration would stream >= 12 tiles with one 4-warp CTA per SM (sm_120), >= 32 with two
    // (the H200): with one per SM the 32-row CTA won 10-35 % at 15.5-124 tiles per slot and lost
    // 8-56 % at 1-8 (t=1 h=32, b=1 h=32, b=2 q=2 h=16, b=1 h=128, t=4 h=64); with two per SM it
    // won 1-6 % at 62-248, tied at 31 and lost 9-14 % at 3.9-15.5 (t=4 h=64, b=8 h=64,
    // b=4 h=32 l=16384), 37-51 % on the small steps.
    // With two 4-warp CTAs per SM (the H200) the 32-row CTA also needs long requests (log #85
    // (a)): it takes its Q fragments from global memory at every segment start (no Q tile), so
    // requests of a few tiles pay that chain per request, where the 16-row CTA prefetches its
    // staged Q with the pipeline. At 32-128 heads requests of 2-24 tiles ran 2-29 % faster in
    // 16-row CTAs; at 32 tiles dense ones 1.5-2 % (sparse: even), at 64 dense ones even (sparse:
    // the 32-row CTA 4 % faster), and dense lengths drawn from 1-2048 (64 tiles at most) 4-9 %;
    // at 128 tiles the 32-row CTA wins 1-6 % (log #82). With one CTA per SM (sm_120) the 32-row
    // CTA kept winning from 4 tiles per request on.
    const int m_rows = q_len * num_heads;
    const int64_t slots = static_cast<int64_t>(sm_count) * ctas;
    const bool long_step =
        max_tiles >= (ctas == 1 ? 12 : 32) * slots && (ctas == 1 || req_tiles >= kWideReqTiles[sparse]);
    const bool wide = m_rows > 16 && tune.warps != 4 &&
                      (fmt == MLA_KV_FP8 || (fmt == MLA_KV_FP8_DS_MLA ? ctas == 1 : long_step));
    int block_m = m_rows <= 8 ? 8 : (wide ? 32 : 16);
    if (tune.block_m != 0) block_m = tune.block_m;
    // Small steps (at most two tiles per SM): parts of one tile where every tile can have a CTA
    // of its own (log #27; for 16-bit rows up to half an SM per tile, log #69: at 128 tiles, 64
    // CTAs of two tiles and half the pieces to merge beat 128 CTAs of one by 0.1-1.1 us), 8
    // warps per CTA there (the lone tile finishes sooner), in one-part steps (no combine) and
    // for fp8 rows (their 4-warp small steps measured 0.5-1 us slower); 16-bit steps whose CTAs
    // stream two tiles take 4 warps, one CTA per SM (log #69: 0.4-1.1 us less in graph replay
    // on b=1..8; the 4-warp CTAs leave registers for the combine's CTAs beside them, and two of
    // them on one SM while others idle lost). 16-bit parts of one tile take 4 warps too where
    // the tiles have 16 query rows and a request at most 64 (log #105: t=1 h=10-64 top-256..2048,
    // b=1-2 h=16 l=1024-2048, b=1 q=2 h=8 and q=4 h=4: 3-8 % less in graph replay on the H200
    // and the H100, both occupancies); at 128 query rows it measured mixed (sparse t=1 top-256
    // +2.5 %, dense b=1 l=256 -3.4 %), the 8-row ones (h <= 8, q_len 1) even (-1.4...+2.8 %):
    // both keep 8, as do fp8 rows (4 warps: 8-28 % slower).
    const bool small = max_tiles <= 2LL * sm_count;
    const bool fp8 = fmt == MLA_KV_FP8_DS_MLA || fmt == MLA_KV_FP8;
    const bool one_tile_parts = max_tiles <= (fp8 ? sm_count : sm_count / 2);
    const bool rows16_4warps = block_m == 16 && m_rows <= 64;
    const bool small_4warps = small && !fp8 && (!one_tile_parts || rows16_4warps) && all_tiles > 2;
    int warps = block_m == 32 || (small && !small_4warps) ? 8 : 4;
    if (tune.warps != 0) warps = tune.warps;
    // Medium steps (at most four tiles per SM, i.e. two per CTA slot at two CTAs per SM): one
    // 4-warp CTA per SM as well, streaming ~4 tiles, instead of two streaming two each: half the
    // parts to start and the pieces to write and merge (log #84 (c): 2-12 % faster with 16 query
    // rows per CTA and with fp8 rows, whose pieces weigh 0.8-1.5 tiles; the 16-bit 8-row steps,
    // whose pieces weigh 0.4, lost up to 5 % and keep two CTAs per SM). Dense 16-bit steps gain up
    // to six tiles per SM (b=5-6 h=16 l=4096 4-10 % faster), sparse and fp8 ones lost 4-9 % there.
    const int64_t medium_tiles = !sparse && !fp8 && block_m != 8 ? 6 : 4;
    const bool medium = !small && max_tiles <= medium_tiles * sm_count && (fp8 || block_m != 8);
    // Short requests at 9-16 query rows (one 16-row m-tile, 16-bit rows; log #85 (b)): one 4-warp
    // CTA per SM as well where every request is at most kShortReqTiles tiles long: dense h=16,
    // h=12 and q=2 h=8 at b=512-2048 ran 11-16 % faster so at 2-3 tiles per request, 3-9 % at 4,
    // 2 % at 5, and lost up to 5 % from 6 on; sparse h=16 top-64 3.5 % faster, top-128 10 % slower.
    const bool short_reqs = req_tiles <= kShortReqTiles[sparse] && block_m == 16 && m_rows <= 16 && !fp8;
    // Short requests at 8 query rows (the 16-bit 8-row 4-warp steps; log #119): where every request
    // is at most kShort8Tiles tiles long and the batch alone nearly fills the SMs (at least 2/3 of
    // a request per SM, at most two), no request is split: parts of whole requests (min_chunk =
    // the tiles per request; with lengths the closed form then gives each request its own part),
    // so no piece is written and, where the host can tell, no combine runs; and where the batch
    // fits one CTA per SM, one transposed 4-warp CTA per SM. The default split cut each request
    // of these steps into 2-3 parts and merged them: H100 dense b=128 l=128 -20 %, b=160 l=128
    // -25 %, b=128 l=256 -18 %, sparse t=96 / t=128 top-128 -17 / -18 %, t=128 top-256 -9 %,
    // lengths uniform in 1-128 -15 %.
    // fp8_ds_mla rows the same up to 4 tiles per request (log #120, H100: sparse t=96 / t=160
    // top-128 -20 / -23 %, klen uniform 1-128 -35 %, dense b=128 / b=160 l=128 -18 / -31 %, t=128
    // top-128 even; 8-tile requests lost 7-10 % as one part each), with one CTA per SM up to 4
    // tiles per SM (the medium-step rule above) and past it the CTAs per SM of their streaming
    // steps.
    const bool short8 = block_m == 8 && m_rows <= 8 && warps == 4 && !small && req_tiles <= kShort8Tiles[fp8] &&
                        3LL * batch >= 2LL * sm_count && batch <= 2LL * sm_count;
    const bool one_per_sm = (small || medium || short_reqs || (short8 && !fp8 && batch <= sm_count)) && warps == 4;
    fit = with_config(warps, block_m, [&](auto c) {
        return config_fit<decltype(c)>(fmt, sm120_occupancy, one_per_sm, smem_per_sm, optin, &smem, &ctas);
    });
    if (fit != MLA_STATUS_OK) return fit;
    // A third CTA per SM where the registers allow it (the fp8_ds_mla 8-row 4-warp kernel on
    // sm_90, KernelConfig::kMinCtasSm90) only on long steps, whose parts still stream at least
    // kLongPartTiles tiles each with three: log #72 measured it 5-10 % faster at 15.5 tiles per
    // part and more (dense b=48, b=64, b=128 l=8192; sparse t=96, t=128), 1-5 % slower at 10.3
    // (b=32 l=4096, t=64, b=16 l=8192) and 8-11 % slower at 5.2 (t=32, b=16 l=4096).
    constexpr int64_t kLongPartTiles = 12;
    if (ctas > 2 && max_tiles < kLongPartTiles * ctas * sm_count) ctas = 2;
    const int m_tiles = (m_rows + block_m - 1) / block_m;
    const int target = sm_count * ctas;
    int parts = (target + m_tiles - 1) / m_tiles;
    if (parts < 1) parts = 1;
    // At most two 32-row tiles per request row block at the longest length (the one-token
    // call, top-1/top-32 sparse rows, a short single request): one part, so nothing is ever
    // split and the combine kernel is not launched; a second tile in the same CTA costs less
    // than the combine's launch (docs/PERFORMANCE.md log #36).
    if (all_tiles <= 2) parts = 1;
    *s = mla_schedule_t{};
    s->batch = batch;
    s->q_len = q_len;
    s->num_heads = num_heads;
    s->max_len = max_len;
    s->kv_format = fmt;
    s->kind = shape->kind;
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
    // The 16-bit 8-row 4-warp kernel transposed (log #116) where a CTA has its SM to itself (one
    // per SM: sm_120 always, the H200 in sm120-occupancy mode or on small steps): 1-7 % faster on
    // the H100's sm120-occupancy rows, 4-8 % on the H200's (log #118). With two per SM (the H200's
    // streaming steps) dense steps keep the direct form (the transposed one up to 4 % slower:
    // b=2 l=16384, 512x15+8192) and sparse ones take the transposed form too (log #118: H200
    // t=128 h=8 6 % faster, klen 2 %, t=32 even; the H100 even to +1 %). Set before anything
    // below reads the configuration.
    const bool transposed = tune.form == 0 ? (ctas == 1 || sparse) : tune.form == MLA_FORM_TRANSPOSED;
    in.form = form_allowed(fmt, warps, block_m) && transposed ? MLA_FORM_TRANSPOSED : MLA_FORM_DIRECT;
    // Programmatic dependent launch (sm_90+), MLA_PDL_DEFAULT = the launch attribute (the
    // combine's launch overlaps decode) + each decode CTA lets the combine be scheduled when
    // it starts its last tile (docs/PERFORMANCE.md log #20: that hides part of the combine's
    // launch; the trigger at the start lets combine CTAs sit resident and slows long single
    // sequences, logs #9, #16).
    const int pdl = tune.pdl == 0 ? MLA_PDL_DEFAULT : (tune.pdl == MLA_PDL_OFF ? 0 : tune.pdl);
    in.pdl = major >= 9 ? pdl : 0;
    // Steps that are not small (more than two tiles per SM at max_len) but whose lengths may leave
    // every part short (a flat split of mostly short requests: 512x15+8192), with two or more
    // decode CTAs per SM: a part of at most two tiles triggers at its start (the 16-bit 8-row
    // kernels, decode/kernel.cuh kStartThreshold; log #86: 512x15+8192 graph 15.71 -> 14.80 us).
    // Not on small steps (b=1-8, t=4: the early trigger cost direct launches 0.3-0.6 us) nor
    // with one CTA per SM (sm_120, sm120 occupancy: 256x15+4096 13.25 -> 13.86 us there).
    if (!small && ctas >= 2 && (in.pdl & MLA_PDL_TRIGGER_AT_LAST_TILE)) in.pdl |= kPdlTriggerShortParts;
    // 32 query rows per CTA (many heads; one decode CTA per SM, whose registers leave no room for
    // a combine CTA beside it): every decode CTA triggers at its start, so that the combine is
    // launched before the slowest CTA reaches its last tile and its CTAs take the SMs the
    // decode tail frees, their length search done before the wait (log #90: dense b=64 h=64,
    // sparse t=64 h=64, t=128 h=32, t=128 h=64 top-512, b=64 h=64 l=1024 and per-tensor fp8
    // sparse t=64 h=64 1.7-2.2 % faster; the other 32-row rows within -0.3...+0.75 %). Not on
    // small steps (per-tensor fp8 takes 32 rows on any step): there the early trigger cost the
    // 8-row kernels 0.3-0.6 us (log #86), and no small 32-row step was measured with it.
    // The same for fp8_ds_mla's long sparse steps of more than 16 query rows in 16-row CTAs (254
    // registers on sm_90: two per SM leave no room for a combine CTA either; log #91: sparse t=64
    // h=64 and t=128 h=32 2.2-2.6 % faster in both occupancies, t=128 h=128 and t=32 h=64 within
    // +-0.3 %). Not its shorter sparse steps (t=16 h=24, t=8 h=64: 1-2.6 % slower), its dense
    // steps (b=64 h=64, b=128 h=128, b=32 q=4 h=16: +0.1-0.3 %) nor its steps of 16 query rows
    // (sparse t=128 h=16 +0.9 %, dense b=32 h=16 l=16384 +1.3 %).
    const bool start_fp8 = fmt == MLA_KV_FP8_DS_MLA && sparse && block_m == 16 && m_rows > 16 && long_step;
    if ((block_m == 32 || start_fp8) && !small && tune.pdl == 0 && (in.pdl & MLA_PDL_TRIGGER_AT_LAST_TILE))
        in.pdl |= MLA_PDL_TRIGGER_AT_START;
    // Parts of one tile on small steps where every tile can have a CTA (above), else at least
    // kMinChunkTiles.
    in.min_chunk = tune.min_chunk != 0 ? tune.min_chunk
                   : short8           ? static_cast<int>(req_tiles)
                                      : (one_tile_parts ? 1 : kMinChunkTiles);
    in.combine_slices = tune.combine_slices != 0 ? tune.combine_slices : combine_slices(s);
    // Parts within requests (decode/split.cuh) where the kernels allow it (within_allowed: 16-bit
    // caches, 16 or 32 query rows per CTA, batch <= parts), by default on all but small steps
    // (whose parts are of one or two tiles: a request boundary costs them nothing extra); on
    // small steps too when asked (tests). The kernels still fall back to the flat split per
    // call when the lengths need more parts than the grid has.
    const bool within_ok = within_allowed(s);
    const bool within = tune.split == MLA_SPLIT_WITHIN_REQUESTS ? within_ok : (tune.split == 0 && within_ok && !small);
    in.split = within ? MLA_SPLIT_WITHIN_REQUESTS : MLA_SPLIT_FLAT;
    // The row kernel (decode/rows.cuh) where a step is one part (at most two 32-row tiles in
    // all) and its CTAs, one per query row, fit the SMs: two round trips and a short fp32
    // chain, against the tile kernel's three round trips and a tile's MMA chain. Sparse steps
    // take it for up to two waves of CTAs (log #76: t=2 h=128 top-1 10.58 -> 8.11 us, top-32
    // 10.94 -> 9.79), where dense ones lost 0.5-0.7 us.
    const int64_t row_ctas = static_cast<int64_t>(sm_count) * (sparse ? 2 : 1);
    const bool rows = parts == 1 && static_cast<int64_t>(m_rows) * batch <= row_ctas && batch <= kRowsMaxBatch;
    in.path = tune.path != 0 ? tune.path : (rows ? MLA_PATH_ROWS : MLA_PATH_TILES);
    if (in.path == MLA_PATH_ROWS) in.form = MLA_FORM_DIRECT;  // (no tile kernel runs)
    return MLA_STATUS_OK;
}

extern "C" size_t mla_workspace_bytes(const mla_schedule_t* s) {
    enter("mla_workspace_bytes");
    if (s == nullptr) return 0;
    return ws_bytes(s->num_parts, s->q_len * s->num_heads);
}
