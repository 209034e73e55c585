/*
 * mla_decode.h: the whole C ABI of mla-decode.
 *
 * Weight-absorbed Multi-head Latent Attention decode ("MQA mode"): every query row
 * has 576 dims (512 latent + 64 RoPE), every cache row has 576 dims shared by all
 * heads, V is the first 512 dims of the same cache row. See docs/DESIGN.md.
 *
 * Conventions:
 *   - Every pointer is a raw device pointer, every stream a raw cudaStream_t/CUstream
 *     (NULL = the legacy default stream: code built with per-thread default streams
 *     passes cudaStreamPerThread). Calls run on the given stream in the context current on
 *     the calling thread; a decode call's stream must belong to its schedule's device
 *     (MLA_STATUS_WRONG_DEVICE otherwise). Nothing is global but the decode kernels'
 *     shared-memory limit, raised per device and cache format (only the kernels of formats
 *     in use are loaded).
 *   - Strides are in ELEMENTS of the tensor they step through, as int64, unless the name
 *     ends in _bytes. The last dimension of every tensor is contiguous. The stride of a
 *     dimension of size 1 is never used, so it is never checked (torch gives such strides
 *     arbitrary values). The others are checked: never negative; a view the call reads
 *     (q_nope, q_rope) steps each dimension by 0 (every index reads the same row) or by at
 *     least its row's width (576 packed, 512 q_nope, 64 q_rope), so that a 512-wide q_nope
 *     passed without its q_rope is rejected, not read as packed rows; the rows of out and
 *     of lse do not overlap.
 *   - Alignment: q_nope, q_rope, out, kv_cache, workspace and the append's sources (kv,
 *     kv_rope) must be 16-byte aligned, and so must every q/out token and head stride and
 *     the append's kv_token_stride and kv_rope_token_stride times the element size (rows are moved 16 bytes at a time);
 *     block_stride_bytes is a multiple of 16. lse, error_flag and the int32 arrays (block
 *     tables, seq_lens, indices, topk_len, the gather's arrays) need 4-byte alignment, the
 *     append's int64 slot_mapping 8-byte. Every alignment is checked (INVALID_ARGUMENT).
 *   - No call allocates device memory or synchronizes the host: every call can be captured
 *     in a CUDA graph. Buffers the kernels write (out, lse, workspace, error_flag) need no
 *     initialisation, except that a caller resets the error flag when it wants to know
 *     about new faults (the kernels never clear it). What a call writes must not overlap
 *     what it reads or anything else it writes (out, lse, workspace, error_flag): the host
 *     checks the rows within out and within lse (above), not one buffer against another
 *     (the safe Rust layer's borrows rule that out).
 *   - A decode call enqueues up to two kernels (decode, then the combine that merges split
 *     requests); if the second launch fails (MLA_STATUS_CUDA_ERROR) the first has run, and
 *     out may be partly written.
 *   - Every function returns an mla_status_t (a closed set of values). After a call that
 *     did not return MLA_STATUS_OK, mla_last_error() (per thread) says which argument or
 *     field was wrong and why, and mla_last_cuda_error() gives the cudaError_t behind
 *     MLA_STATUS_CUDA_ERROR.
 *   - int32 vs int64: sparse indices and block tables are int32 and the append's
 *     slot_mapping is int64, because that is what the engines' own tensors hold (vLLM's
 *     indexer writes int32 top-k ids, its slot_mapping is torch.long).
 *   - Binding check: a binding compares MLA_ABI_VERSION and mla_struct_size() of every
 *     struct it mirrors with what the library reports at load time.
 */
#ifndef MLA_DECODE_H
#define MLA_DECODE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- version ------------------------------------------------------------------- */
/* Bumped on every incompatible change of this header (a field, a function, a value). */
#define MLA_ABI_VERSION 5

/* ---- constants of the model family ---------------------------------------------- */
#define MLA_HEAD_DIM 576     /* q and cache row width: 512 latent + 64 rope */
#define MLA_LATENT_DIM 512   /* kv_lora_rank, also the output (V) width */
#define MLA_ROPE_DIM 64
#define MLA_MAX_HEADS 128
#define MLA_MAX_Q_LEN 8
#define MLA_MAX_TOPK 4096
#define MLA_ROW_BYTES_16 1152 /* one f16/bf16 cache row */
#define MLA_ROW_BYTES_FP8_DS_MLA 656
#define MLA_ROW_BYTES_FP8 576 /* per-tensor fp8: 576 e4m3 values */
#define MLA_MAX_GATHER_TOKENS 65535 /* tokens of one mla_gather_slots call */

/* ---- status --------------------------------------------------------------------- */
typedef enum {
    MLA_STATUS_OK = 0,
    MLA_STATUS_INVALID_ARGUMENT = 1, /* a host-side check failed: mla_last_error() names the field */
    MLA_STATUS_UNSUPPORTED = 2,      /* valid but not implemented by this build or version (also: a GPU
                                        whose architecture the build has no kernels for, or a
                                        driver older than the CUDA runtime the build links) */
    MLA_STATUS_NO_DEVICE = 3,        /* no CUDA driver or device (calls run on the thread's
                                        current device, as the CUDA runtime does: device 0
                                        and its primary context when none is current) */
    MLA_STATUS_NOT_BUILT = 4,        /* the library was built without nvcc: no kernels */
    MLA_STATUS_WRONG_DEVICE = 5,     /* the schedule was made for another device than the current one */
    MLA_STATUS_CUDA_ERROR = 6        /* a CUDA runtime call failed: mla_last_cuda_error() */
} mla_status_t;

/* The message of the last call on this thread that did not return MLA_STATUS_OK
 * ("function: field: why"), or "" after a call that succeeded. Valid until the next call
 * on this thread; never NULL. */
const char* mla_last_error(void);
/* The cudaError_t behind the last MLA_STATUS_CUDA_ERROR on this thread (0 if none). */
int32_t mla_last_cuda_error(void);

/* MLA_ABI_VERSION of the library actually linked or loaded. */
uint32_t mla_abi_version(void);

typedef enum {
    MLA_STRUCT_TUNING = 0,
    MLA_STRUCT_SHAPE = 1,
    MLA_STRUCT_SCHEDULE = 2,
    MLA_STRUCT_DENSE_PARAMS = 3,
    MLA_STRUCT_SPARSE_PARAMS = 4,
    MLA_STRUCT_APPEND_PARAMS = 5,
    MLA_STRUCT_GATHER_PARAMS = 6
} mla_struct_t;
/* sizeof the library's struct `which` (0 for a value it does not know). */
size_t mla_struct_size(mla_struct_t which);
/* Nonzero when the library linked or loaded has this header's ABI: its version and the size
 * of every struct. The calls cannot tell a struct of another version from their own (an
 * older caller's shorter struct is read past its end), so check this once at start-up. */
#define MLA_ABI_MATCHES()                                                         \
    (mla_abi_version() == MLA_ABI_VERSION &&                                      \
     mla_struct_size(MLA_STRUCT_TUNING) == sizeof(mla_tuning_t) &&                \
     mla_struct_size(MLA_STRUCT_SHAPE) == sizeof(mla_shape_t) &&                  \
     mla_struct_size(MLA_STRUCT_SCHEDULE) == sizeof(mla_schedule_t) &&            \
     mla_struct_size(MLA_STRUCT_DENSE_PARAMS) == sizeof(mla_dense_params_t) &&    \
     mla_struct_size(MLA_STRUCT_SPARSE_PARAMS) == sizeof(mla_sparse_params_t) &&  \
     mla_struct_size(MLA_STRUCT_APPEND_PARAMS) == sizeof(mla_append_params_t) &&  \
     mla_struct_size(MLA_STRUCT_GATHER_PARAMS) == sizeof(mla_gather_params_t))

typedef enum { MLA_DTYPE_F16 = 0, MLA_DTYPE_BF16 = 1 } mla_dtype_t;

/* How one cache row is stored (docs/DESIGN.md, "Cache formats"). */
typedef enum {
    MLA_KV_F16 = 0,        /* 576 f16 values: 1152 B/row; the query dtype must be f16 */
    MLA_KV_BF16 = 1,       /* 576 bf16 values: 1152 B/row; the query dtype must be bf16 */
    MLA_KV_FP8_DS_MLA = 2, /* 512 e4m3 + 4 fp32 scales (one per 128 values) + 64 bf16 rope = 656 B/row */
    MLA_KV_FP8 = 3         /* per-tensor fp8: 576 e4m3 values = 576 B/row, one fp32 scale (kv_scale) */
} mla_kv_format_t;

/* How the append kernel picks an fp8_ds_mla tile's scale from its largest magnitude amax
 * (readers use whatever scale is stored). */
typedef enum {
    MLA_SCALE_RAW = 0, /* vLLM's concat_and_cache_ds_mla: max(amax / 448, FLT_MIN) */
    MLA_SCALE_POW2 = 1 /* FlashMLA's quantizer: the power of two >= max(amax / 448, 1e-4) */
} mla_scale_rule_t;

/* ---- device error flag ---------------------------------------------------------- */
/* A caller-owned buffer of 4 device uint32 words {code, row, value low 32 bits, value high
 * 32 bits}: the offending value is an int64 in two's complement (a 32-bit value is sign
 * extended: seq_len -3 is {0xFFFFFFFD, 0xFFFFFFFF}). The first fault wins by atomicCAS on
 * word 0; which of several simultaneous faults wins is unspecified. The kernels never clear
 * it: the caller resets it (a 16-byte memset to zero, which a CUDA graph may capture). Every
 * bad value below is also handled (skipped or clamped) whether or not a flag is given. */
typedef enum {
    MLA_FAULT_NONE = 0,
    MLA_FAULT_BAD_BLOCK_ID = 1,     /* block-table entry outside [0, num_blocks): row = request (decode) or
                                       token (gather), value = entry */
    MLA_FAULT_NEGATIVE_SEQ_LEN = 2, /* seq_len < 0, treated as 0: row = request (decode and gather),
                                       value = seq_len */
    MLA_FAULT_SEQ_LEN_TOO_LARGE = 3,/* seq_len > max_blocks_per_seq*block_size, clamped: row = request
                                       (decode and gather), value = seq_len */
    MLA_FAULT_BAD_SLOT_ID = 4,      /* sparse id (not -1) outside [0, num_blocks*block_size), skipped:
                                       row = token, value = id */
    MLA_FAULT_BAD_REQ_ID = 5,       /* gather: req_id outside [0, batch), the row's slots are -1:
                                       row = token, value = req_id */
    MLA_FAULT_BAD_APPEND_SLOT = 6,  /* append: slot (not -1) outside the cache, skipped: row = token,
                                       value = the int64 slot */
    MLA_FAULT_BAD_TOPK_LEN = 7,     /* sparse: topk_len outside [0, topk], clamped: row = token,
                                       value = topk_len */
    MLA_FAULT_BAD_KV_SCALE = 8      /* per-tensor fp8 (append and decode): *kv_scale is not a finite
                                       number > 0 (e.g. a scale buffer never written: 0); used as it
                                       is, with IEEE arithmetic: row = 0, value = the fp32 bits
                                       (zero-extended, not sign-extended) */
} mla_fault_code_t;

/* ---- tuning: experiment overrides of the schedule's choices --------------------- */
/* Programmatic dependent launch (sm_90+), as bits: mla_tuning_t::pdl, the schedule's
 * choice (mla_schedule_internal_t::pdl) and what the kernels test are the same numbers. */
#define MLA_PDL_ATTRIBUTE 1            /* launch with the PDL attribute: the combine kernel's
                                          launch overlaps the decode kernel */
#define MLA_PDL_TRIGGER_AT_START 2     /* each decode CTA lets the combine be scheduled when it
                                          starts (lost: docs/PERFORMANCE.md logs #9, #16) */
#define MLA_PDL_TRIGGER_AT_LAST_TILE 4 /* ... when it starts its last tile (log #20) */
#define MLA_PDL_ALL 7                  /* every bit above */
#define MLA_PDL_DEFAULT 5              /* MLA_PDL_ATTRIBUTE | MLA_PDL_TRIGGER_AT_LAST_TILE */
#define MLA_PDL_OFF (-1)               /* mla_tuning_t::pdl only: no PDL */

/* How a decode call cuts its 32-row tiles into split-KV parts (docs/DESIGN.md section 5.3).
 * FLAT: every part the same number of tiles, laid over all requests end to end (a part may
 * end inside one request and go on into the next). WITHIN_REQUESTS: no part spans two
 * requests, each request cut into near-equal parts, when that needs no part longer than the
 * flat chunk plus a small slack and no more parts than the grid has; else flat. Only 16-bit
 * caches at 16 or 32 query rows per CTA, with at most 128 requests and no more requests than
 * parts, cut within requests; by default not on small steps. */
#define MLA_SPLIT_FLAT 1
#define MLA_SPLIT_WITHIN_REQUESTS 2

/* Which decode kernel a schedule runs (docs/DESIGN.md section 5.5). TILES: the split-KV tile kernels
 * (32 cache rows per tile through tensor-core MMAs, pieces merged by the combine kernel).
 * ROWS: the row kernel, a CTA per query row whose warps walk the request's cache rows on the
 * CUDA cores, no split and no combine: the default for one-part steps (batch *
 * ceil(max_len / 32) <= 2: the one-token call, top-1..64 sparse rows) of at most one query row
 * (batch * q_len * heads) per SM, two for sparse schedules; correct for any shape and lengths
 * when forced, but each 32 positions of a request cost it a dependent round trip. */
#define MLA_PATH_TILES 1
#define MLA_PATH_ROWS 2

/* How the tile kernel of 16-bit caches at 8 query rows per 4-warp CTA (at most 8 query rows,
 * heads x q_len, per request: the common memory-bound step) runs its products
 * (docs/PERFORMANCE.md log #116). DIRECT: S = Q K^T and O += P V with the query's 8 rows as a
 * 16-row MMA operand, rows 8-15 zero. TRANSPOSED: S^T = K Q^T and O^T += V^T P^T with the 8 rows as
 * the MMAs' N: half the MMAs, fewer registers; faster where one CTA has an SM to itself (sm_120
 * always; 4-8 % on the H200's sm120-occupancy rows) and on sparse steps, up to 4 % slower on dense
 * steps where two CTAs share an SM (logs #116, #118).
 * The fp8 8-row kernels always run their own transposed form; other configurations have one. */
#define MLA_FORM_DIRECT 1
#define MLA_FORM_TRANSPOSED 2

/* Overrides of what mla_schedule_init chooses from the shape, for experiments and tests
 * (docs/DEVELOPING.md, "Launch knobs for experiments"). 0 in a field keeps the default;
 * a NULL mla_tuning_t* is all defaults. A value outside the listed ones makes
 * mla_schedule_init return MLA_STATUS_INVALID_ARGUMENT. */
typedef struct {
    int32_t sm120_occupancy; /* nonzero: pad the decode kernel's shared-memory request so that an
                                sm_90 SM holds as few CTAs as an sm_120 SM (measure on an H200 what
                                ships for sm_120); default 0 */
    int32_t warps;           /* 4 or 8 warps per decode CTA (8: each warp half the S and PV work).
                                Default: 8 when block_m is 32, or when the step has at most 2 x SMs
                                tiles (except 16-bit caches whose parts are not all one tile or
                                whose 16-row tiles serve at most 64 query rows per request: 4
                                there), else 4; an explicit 4 keeps block_m at 8 or 16 */
    int32_t block_m;         /* 8, 16 or 32 query rows per decode CTA (8: the MMA's rows 8-15 unused,
                                skipped by the softmax; 32: 8 warps, Q fragments from global
                                memory). Default: 8 with at most 8 query rows per request; 32
                                with more than 16 for per-tensor fp8, for fp8_ds_mla where only one
                                4-warp CTA fits an SM (sm_120, sm120_occupancy), for 16-bit
                                caches on long steps of long requests (docs/DESIGN.md); else 16 */
    int32_t pdl;             /* MLA_PDL_OFF, or an OR of the MLA_PDL_* bits. Default
                                MLA_PDL_DEFAULT, plus MLA_PDL_TRIGGER_AT_START where the
                                schedule picks 32 query rows per CTA, or 16 for more than 16
                                query rows of a long sparse fp8_ds_mla step, on a step that is
                                not small; no PDL before sm_90 whatever is asked */
    int32_t combine_slices;  /* 1, 4 or 16 combine CTAs per merged row's 512 dims. Default 16
                                when 16 per split row still give at most one per SM (b=1, t=1
                                at 8 rows); 2 or 1 on large batches of short requests
                                (docs/DESIGN.md section 5.4); else 4 */
    int32_t min_chunk;       /* 1..=2^20: the fewest 32-row tiles a split-KV part streams. Default 1
                                when the step has at most SMs tiles (fp8 caches) or SMs / 2 tiles
                                (16-bit caches), else 2 */
    int32_t split;           /* how the tiles are cut into parts: MLA_SPLIT_FLAT or
                                MLA_SPLIT_WITHIN_REQUESTS. Default MLA_SPLIT_WITHIN_REQUESTS
                                where the schedule allows it (below), else flat */
    int32_t path;            /* which kernel runs: MLA_PATH_TILES or MLA_PATH_ROWS. Default
                                MLA_PATH_ROWS on one-part steps of at most one query row per SM
                                (sparse: two; above), else MLA_PATH_TILES. ROWS takes at most
                                65,535 requests (sparse: tokens) */
    int32_t form;            /* MLA_FORM_DIRECT or MLA_FORM_TRANSPOSED, for the 16-bit 8-row 4-warp
                                configuration (ignored where the schedule picks another). Default
                                TRANSPOSED on sparse steps and where one such CTA per SM fits
                                or is picked (sm_120, sm120_occupancy, small steps), else DIRECT */
} mla_tuning_t;

/* ---- schedule: host-side launch decisions, made once per shape ------------------ */
/* Which decode call a schedule serves (the schedule's rules for short requests differ). */
typedef enum {
    MLA_KIND_DENSE = 0,  /* mla_dense_decode */
    MLA_KIND_SPARSE = 1  /* mla_sparse_decode */
} mla_kind_t;

/* The problem a schedule is made for. */
typedef struct {
    int32_t batch;             /* dense: requests; sparse: query tokens T (MTP tokens are more rows) */
    int32_t q_len;             /* dense: query rows per request, 1..=8 (causal); sparse: 1 */
    int32_t num_heads;         /* 1..=128 */
    int32_t max_len;           /* dense: the longest sequence expected; sparse: the top-k expected.
                                  A hint for the configuration: a decode call works with any table
                                  width (dense) or topk (sparse); lengths are clamped to what its
                                  own block table or indices hold. Give the widest the calls will
                                  pass: a schedule made for much shorter rows runs a configuration
                                  chosen for short rows (at most 64 positions: the row kernel,
                                  10x slower or worse on long requests) */
    mla_kv_format_t kv_format; /* the cache format the decode calls will read */
    mla_kind_t kind;           /* MLA_KIND_DENSE (0, what a zeroed struct says) or MLA_KIND_SPARSE:
                                  the decode call the schedule serves; the other call rejects it */
} mla_shape_t;

/* The configuration a schedule chose: filled by mla_schedule_init, read by the launches;
 * do not edit (a launch rejects a configuration that does not match its shape). */
typedef struct {
    int32_t warps;          /* warps per decode CTA: 4 or 8 */
    int32_t block_m;        /* query rows per decode CTA: 8, 16 or 32 */
    int32_t pdl;            /* MLA_PDL_* bits in effect (0: no PDL), plus an internal bit (8)
                               that the schedule adds to the last-tile trigger: parts of at
                               most two tiles also trigger at their start (log #86) */
    int32_t min_chunk;      /* fewest 32-row tiles a split-KV part streams */
    int32_t combine_slices; /* combine CTAs per merged row's 512 dims: 1, 2, 4 or 16 (2 and,
                               by default, 1 only where the schedule merges a row per warp) */
    int32_t split;          /* MLA_SPLIT_FLAT or MLA_SPLIT_WITHIN_REQUESTS */
    int32_t path;           /* MLA_PATH_TILES or MLA_PATH_ROWS */
    int32_t form;           /* MLA_FORM_DIRECT, or MLA_FORM_TRANSPOSED (16-bit caches, 8 query
                               rows, 4 warps only) */
} mla_schedule_internal_t;

/* A schedule fixes the grid of the decode kernels for one problem shape on one
 * device. It is plain data: keep it with the workspace it sized. Callers may read every
 * field; none is meant to be written. */
typedef struct {
    int32_t batch;          /* mla_shape_t's */
    int32_t q_len;
    int32_t num_heads;
    int32_t max_len;
    mla_kv_format_t kv_format;
    mla_kind_t kind;
    int32_t num_m_tiles;    /* ceil(q_len*num_heads / block_m) */
    int32_t num_parts;      /* split-KV parts per m-tile (grid = num_m_tiles x num_parts) */
    int32_t smem_bytes;     /* dynamic shared memory per CTA actually requested */
    int32_t ctas_per_sm;    /* resident CTAs per SM the schedule assumed */
    int32_t sm_count;
    int32_t sm120_occupancy;/* 1: smem request padded so that an sm_90 SM holds as few CTAs as an sm_120 SM */
    int32_t device;         /* CUDA device ordinal the schedule was made for */
    mla_schedule_internal_t internal; /* filled by init, read by the launches; do not edit */
} mla_schedule_t;

/* Fill *s for a problem shape on the current device; tuning may be NULL (the defaults).
 * batch * ceil(max_len / 32) <= INT32_MAX (the split counts 32-row tiles in int32). */
mla_status_t mla_schedule_init(mla_schedule_t* s, const mla_shape_t* shape, const mla_tuning_t* tuning);

/* Device bytes of the split workspace (fp32) a schedule needs; its address must be 16-byte
 * aligned (any cudaMalloc is). It needs no initialisation. Calls that share a workspace must run in
 * stream order: a workspace serves one call at a time. */
size_t mla_workspace_bytes(const mla_schedule_t* s);

/* There is no planning call: every decode call derives the split-KV schedule in each of
 * its CTAs from the lengths it is given (a scan of batch int32 values), so a decode step
 * is one decode call per layer, and a CUDA graph replays it with whatever the length and
 * table buffers hold at replay time. */

/* ---- dense paged decode --------------------------------------------------------- */
/* out[t, h] = sum over the visible slots s of softmax_s(softmax_scale * q[t, h] . kv[s]) * kv[s, :512]
 * and lse[t, h] = ln sum_s exp(softmax_scale * q[t, h] . kv[s]) (natural log; -inf and out = 0
 * where no slot is visible). Causal: query i (0-based) of request b, whose length is L,
 * sees the slots of positions 0 .. L - q_len + i of its block table (none when that is < 0). */
typedef struct {
    /* shape: must equal the schedule's (batch, q_len, num_heads) */
    int32_t batch;
    int32_t q_len;
    int32_t num_heads;
    /* queries [batch*q_len, num_heads, 576] (token index = b*q_len + i) in `dtype`: the 512
     * latent dims at q_nope, the 64 rope dims at q_rope, each with its own strides. Packed
     * 576-wide rows: q_rope = NULL (then q_rope = q_nope + 512 elements with q_nope's
     * strides). q_rope == q_nope is rejected (it is never what a caller means). */
    const void* q_nope;
    const void* q_rope;
    int64_t q_nope_token_stride, q_nope_head_stride;
    int64_t q_rope_token_stride, q_rope_head_stride;
    mla_dtype_t dtype;          /* of q and out */
    /* paged cache: num_blocks blocks of block_size rows in kv_format, blocks block_stride_bytes apart */
    const void* kv_cache;
    mla_kv_format_t kv_format;  /* must be the schedule's */
    const float* kv_scale;      /* MLA_KV_FP8: device pointer to the one fp32 scale; else NULL */
    int64_t block_stride_bytes; /* >= block_size * row bytes of kv_format, multiple of 16 */
    int32_t num_blocks;
    int32_t block_size;         /* 16, 32, 64 or 128 */
    /* block table [batch, block_table_stride] int32: request b's position p is in block
     * block_table[b * block_table_stride + p / block_size] */
    const int32_t* block_table;
    int32_t max_blocks_per_seq;  /* columns used; max_blocks_per_seq * block_size <= INT32_MAX - 31 */
    int64_t block_table_stride;  /* max_blocks_per_seq..=INT32_MAX (unused when batch == 1) */
    /* seq_lens [batch] int32: cache rows of each request, clamped to
     * [0, max_blocks_per_seq * block_size]; a negative or too-large value records a fault (codes 2, 3) */
    const int32_t* seq_lens;
    /* outputs: out [batch*q_len, num_heads, 512] in dtype, lse [batch*q_len, num_heads] fp32 */
    void* out;
    int64_t out_token_stride, out_head_stride;
    float* lse; /* may be NULL */
    int64_t lse_token_stride, lse_head_stride;
    float softmax_scale;  /* finite, > 0 */
    float* workspace;     /* mla_workspace_bytes(s), 16-byte aligned */
    uint32_t* error_flag; /* may be NULL */
} mla_dense_params_t;

mla_status_t mla_dense_decode(const mla_schedule_t* s, const mla_dense_params_t* p, void* stream);

/* ---- sparse (DSA top-k) decode -------------------------------------------------- */
/* out[t, h] attends over the cache slots indices[t, 0 .. topk_len[t]) (global slot ids
 * block_id * block_size + offset; -1 = none; a duplicated id counts once per entry). */
typedef struct {
    int32_t num_tokens;  /* T: must equal the schedule's batch */
    int32_t num_heads;   /* must equal the schedule's */
    const void* q_nope;  /* [T, num_heads, 512 (+64)]: as in mla_dense_params_t */
    const void* q_rope;
    int64_t q_nope_token_stride, q_nope_head_stride;
    int64_t q_rope_token_stride, q_rope_head_stride;
    mla_dtype_t dtype;
    const void* kv_cache;
    mla_kv_format_t kv_format;
    const float* kv_scale;
    int64_t block_stride_bytes;
    int32_t num_blocks;      /* num_blocks * block_size <= INT32_MAX */
    int32_t block_size;
    const int32_t* indices;  /* [T, indices_stride] int32 */
    int32_t topk;            /* 1..=4096 */
    int64_t indices_stride;  /* topk..=INT32_MAX (unused when num_tokens == 1) */
    /* [T] int32 entries used per row, clamped to [0, topk] (a value outside records code 7);
     * NULL: topk each */
    const int32_t* topk_len;
    void* out;               /* [T, num_heads, 512] */
    int64_t out_token_stride, out_head_stride;
    float* lse;              /* [T, num_heads], may be NULL */
    int64_t lse_token_stride, lse_head_stride;
    float softmax_scale;
    float* workspace;
    uint32_t* error_flag;
} mla_sparse_params_t;

mla_status_t mla_sparse_decode(const mla_schedule_t* s, const mla_sparse_params_t* p, void* stream);

/* ---- cache append --------------------------------------------------------------- */
/* Writes num_tokens new 576-wide rows (f16 or bf16) into the paged cache at
 * slot_mapping[i] = block_id*block_size + offset, converting them to the cache's format.
 * Row i is kv[i][0..576) (packed, kv_rope NULL), or kv[i][0..512) followed by
 * kv_rope[i][0..64) (the latent and RoPE parts in separate tensors, as engines keep them:
 * vLLM's kv_c and k_pe). A slot of -1 is skipped; a slot outside [0, num_blocks*block_size) is skipped and records code 6.
 * fp8_ds_mla: each 128-value tile of the latent gets a scale by scale_rule, values are
 * x / scale (IEEE division) rounded to nearest even e4m3 with saturation to +-448 (NaN stays
 * NaN), the 64 rope values are stored as bf16 (f16 input rounded to nearest even).
 * Per-tensor fp8: every value is x / *kv_scale, converted the same way. */
typedef struct {
    const void* kv;              /* [num_tokens, kv_token_stride] in dtype: whole rows, or
                                    their 512 latent values when kv_rope is set */
    int64_t kv_token_stride;     /* >= 576 (>= 512 with kv_rope), times the element size a
                                    multiple of 16 (unused when num_tokens == 1) */
    mla_dtype_t dtype;
    int32_t num_tokens;          /* >= 0 (0: nothing to do) */
    const int64_t* slot_mapping; /* [num_tokens] */
    void* kv_cache;
    mla_kv_format_t kv_format;   /* f16/bf16 caches must match dtype */
    const float* kv_scale;       /* MLA_KV_FP8 only */
    mla_scale_rule_t scale_rule; /* MLA_KV_FP8_DS_MLA only */
    int64_t block_stride_bytes;
    int32_t num_blocks;
    int32_t block_size;
    uint32_t* error_flag;        /* may be NULL */
    /* Since ABI 4 (a caller built against an older header passes a shorter struct and
     * must be rebuilt: compare mla_abi_version() / mla_struct_size() at load time).
     * NULL keeps the packed rows. */
    const void* kv_rope;         /* NULL, or [num_tokens, kv_rope_token_stride] in dtype, 16-byte aligned;
                                    kv_rope == kv is rejected (it is never what a caller means) */
    int64_t kv_rope_token_stride; /* with kv_rope: >= 64, times the element size a multiple of 16
                                     (unused when num_tokens == 1) */
} mla_append_params_t;

mla_status_t mla_append_kv(const mla_append_params_t* p, void* stream);

/* ---- index gather --------------------------------------------------------------- */
/* out_slots[t, k] = global slot id of request-logical position positions[t, k] of
 * request req_id[t]: block_table[req][pos / block_size]*block_size + pos % block_size,
 * or -1 where pos < 0, pos >= clamp(seq_lens[req]), the block id is out of range (code 1)
 * or req_id is out of [0, batch) (code 5); a seq_len outside [0, max_blocks_per_seq *
 * block_size] is clamped and records code 2 or 3 (row = request). At most
 * MLA_MAX_GATHER_TOKENS tokens per call; max_blocks_per_seq*block_size and
 * num_blocks*block_size must fit int32. */
typedef struct {
    int32_t num_tokens;          /* 0..=MLA_MAX_GATHER_TOKENS */
    int32_t topk;                /* 1..=4096 entries per row */
    const int32_t* positions;    /* [num_tokens, positions_stride] */
    int64_t positions_stride;    /* topk..=INT32_MAX (unused when num_tokens == 1) */
    const int32_t* req_id;       /* [num_tokens] */
    int32_t batch;               /* requests: rows of the block table and of seq_lens */
    const int32_t* block_table;  /* [batch, block_table_stride] */
    int32_t max_blocks_per_seq;
    int64_t block_table_stride;  /* max_blocks_per_seq..=INT32_MAX (unused when batch == 1) */
    const int32_t* seq_lens;     /* [batch] */
    int32_t num_blocks;          /* of the cache the slots index */
    int32_t block_size;
    int32_t* out_slots;          /* [num_tokens, out_stride] */
    int64_t out_stride;          /* topk..=INT32_MAX (unused when num_tokens == 1) */
    uint32_t* error_flag;        /* may be NULL */
} mla_gather_params_t;

mla_status_t mla_gather_slots(const mla_gather_params_t* p, void* stream);

#ifdef __cplusplus
}
#endif
#endif /* MLA_DECODE_H */
