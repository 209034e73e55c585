/*
 * mla_decode.h: the whole C ABI of mla-decode.
 *
 * Weight-absorbed Multi-head Latent Attention decode ("MQA mode"): every query row
 * has 576 dims (512 latent + 64 RoPE), every cache row has 576 dims shared by all
 * heads, V is the first 512 dims of the same cache row. See docs/DESIGN.md.
 *
 * Conventions:
 *   - Every pointer is a raw device pointer, every stream a raw cudaStream_t/CUstream
 *     (NULL = legacy default stream). Calls run on the given stream in the context
 *     current on the calling thread; nothing is global.
 *   - Strides are in ELEMENTS unless the name ends in _bytes. The last dimension of
 *     every tensor is contiguous.
 *   - No call allocates device memory or synchronizes the host: decode
 *     calls can be captured in a CUDA graph.
 *   - Every function returns an mla_status_t. Values >= MLA_STATUS_CUDA_BASE are
 *     MLA_STATUS_CUDA_BASE + the cudaError_t that a CUDA runtime call returned.
 */
#ifndef MLA_DECODE_H
#define MLA_DECODE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- constants of the model family ---------------------------------------------- */
#define MLA_HEAD_DIM 576     /* q and cache row width: 512 latent + 64 rope */
#define MLA_LATENT_DIM 512   /* kv_lora_rank, also the output (V) width */
#define MLA_ROPE_DIM 64
#define MLA_MAX_HEADS 128
#define MLA_MAX_Q_LEN 8
#define MLA_MAX_TOPK 4096
#define MLA_ROW_BYTES_16 1152 /* one f16/bf16 cache row */
#define MLA_ROW_BYTES_FP8_DS_MLA 656

/* ---- status --------------------------------------------------------------------- */
typedef enum {
    MLA_STATUS_OK = 0,
    MLA_STATUS_INVALID_ARGUMENT = 1, /* a host-side check of the C layer failed */
    MLA_STATUS_UNSUPPORTED = 2,      /* valid but not implemented (e.g. fp8 decode) */
    MLA_STATUS_NO_DEVICE = 3,        /* no current CUDA device / context */
    MLA_STATUS_NOT_BUILT = 4,        /* the crate was built without nvcc: no kernels */
    MLA_STATUS_CUDA_BASE = 1000      /* + cudaError_t */
} mla_status_t;

typedef enum { MLA_DTYPE_F16 = 0, MLA_DTYPE_BF16 = 1 } mla_dtype_t;

typedef enum {
    MLA_KV_F16 = 0,
    MLA_KV_BF16 = 1,
    MLA_KV_FP8_DS_MLA = 2 /* 512 e4m3 + 4 fp32 scales + 64 bf16 rope = 656 B/row */
} mla_kv_format_t;

/* ---- device error flag ---------------------------------------------------------- */
/* A caller-owned buffer of 4 device uint32 words {code, row, value, 0}; the first
 * fault wins by atomicCAS on word 0. Reset it with a 16-byte memset to zero. */
typedef enum {
    MLA_FAULT_NONE = 0,
    MLA_FAULT_BAD_BLOCK_ID = 1,     /* block-table entry outside [0, num_blocks): row = request (decode) or
                                       token (gather), value = entry */
    MLA_FAULT_NEGATIVE_SEQ_LEN = 2, /* seq_len < 0, treated as 0: row = request, value = seq_len */
    MLA_FAULT_SEQ_LEN_TOO_LARGE = 3,/* seq_len > max_blocks_per_seq*block_size, clamped: row = request */
    MLA_FAULT_BAD_SLOT_ID = 4,      /* sparse id (not -1) outside [0, num_blocks*block_size): row = token */
    MLA_FAULT_BAD_REQ_ID = 5,       /* gather: req_id outside [0, batch): row = token */
    MLA_FAULT_BAD_APPEND_SLOT = 6   /* append: slot (not -1) outside the cache: row = token, value = low 32 bits */
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

/* Overrides of what mla_schedule_init chooses from the shape, for experiments and tests
 * (docs/DEVELOPING.md, "Launch knobs for experiments"). 0 in a field keeps the default;
 * a NULL mla_tuning_t* is all defaults. A value outside the listed ones makes
 * mla_schedule_init return MLA_STATUS_INVALID_ARGUMENT. */
typedef struct {
    int32_t sm120_occupancy; /* nonzero: pad the decode kernel's shared-memory request so that an
                                sm_90 SM holds as few CTAs as an sm_120 SM (measure on an H200 what
                                ships for sm_120); default 0 */
    int32_t warps;           /* 4 or 8 warps per decode CTA (8: each warp half the S and PV work).
                                Default: 8 when the step has at most 2 x SMs tiles or block_m is 32,
                                else 4; an explicit 4 keeps block_m at 16 */
    int32_t block_m;         /* 16 or 32 query rows per decode CTA (32: 8 warps, Q fragments from
                                global memory). Default: 32 with >= 32 query rows when only one
                                4-warp CTA fits an SM (sm_120, sm120_occupancy), else 16 */
    int32_t pdl;             /* MLA_PDL_OFF, or an OR of the MLA_PDL_* bits. Default
                                MLA_PDL_DEFAULT; no PDL before sm_90 whatever is asked */
    int32_t combine_slices;  /* 1 or 4 combine CTAs per merged row's 512 dims. Default 4 when the
                                split rows give at most one combine CTA per two SMs, else 1 */
    int32_t min_chunk;       /* >= 1: the fewest 32-row tiles a split-KV part streams. Default 1
                                when the step has at most SMs tiles, else 2 */
} mla_tuning_t;

/* ---- schedule: host-side launch decisions, made once per shape ------------------ */
/* The configuration a schedule chose: filled by mla_schedule_init, read by the launches;
 * do not edit (a launch rejects a configuration that does not match its shape). */
typedef struct {
    int32_t warps;          /* warps per decode CTA: 4 or 8 */
    int32_t block_m;        /* query rows per decode CTA: 16 or 32 */
    int32_t pdl;            /* MLA_PDL_* bits in effect (0: no PDL) */
    int32_t min_chunk;      /* fewest 32-row tiles a split-KV part streams */
    int32_t combine_slices; /* combine CTAs per merged row's 512 dims: 1 or 4 */
} mla_schedule_internal_t;

/* A schedule fixes the grid of the decode kernels for one problem shape on one
 * device. It is plain data: keep it with the workspace it sized. Callers may read every
 * field; none is meant to be written. */
typedef struct {
    int32_t batch;          /* dense: requests; sparse: query tokens T */
    int32_t q_len;          /* dense: 1..=8; sparse: 1 */
    int32_t num_heads;      /* 1..=128 */
    int32_t max_len;        /* dense: max_blocks_per_seq*block_size; sparse: topk */
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
 * max_len <= INT32_MAX - 31 and batch * ceil(max_len / 32) <= INT32_MAX (the split
 * counts 32-row tiles in int32). */
mla_status_t mla_schedule_init(mla_schedule_t* s, int32_t batch, int32_t q_len, int32_t num_heads,
                               int32_t max_len, const mla_tuning_t* tuning);

/* Device bytes of the split workspace (fp32) a schedule needs; 256-byte aligned (any
 * cudaMalloc is). Calls that share a workspace must run in stream order. */
size_t mla_workspace_bytes(const mla_schedule_t* s);

/* There is no planning call: every decode call derives the split-KV schedule in each of
 * its CTAs from the lengths it is given (a scan of batch int32 values), so a decode step
 * is one decode call per layer, and a CUDA graph replays it with whatever the length and
 * table buffers hold at replay time. */

/* ---- dense paged decode --------------------------------------------------------- */
typedef struct {
    /* queries: token index = b*q_len + i; q_rope may point 512 elements into q_nope */
    const void* q_nope;
    const void* q_rope;
    int64_t q_nope_token_stride, q_nope_head_stride;
    int64_t q_rope_token_stride, q_rope_head_stride;
    /* paged cache: num_blocks blocks of block_size rows of 576 values (1152 bytes) */
    const void* kv_cache;
    int64_t block_stride_bytes; /* >= block_size*1152, multiple of 16 */
    int32_t num_blocks;
    int32_t block_size;         /* 16, 32, 64 or 128 */
    const int32_t* block_table; /* [batch, block_table_stride] */
    int32_t max_blocks_per_seq;
    int32_t block_table_stride; /* elements between rows of the block table, >= max_blocks_per_seq */
    /* outputs: out [batch*q_len, heads, 512] in the query dtype, lse [batch*q_len, heads] fp32 */
    void* out;
    int64_t out_token_stride, out_head_stride;
    float* lse; /* may be NULL */
    int64_t lse_token_stride, lse_head_stride;
    float softmax_scale;
    mla_dtype_t dtype;
    /* seq_lens [batch] int32: cache rows of each request, clamped to [0, max_len]; a negative
     * or too-large value records a fault (codes 2, 3) */
    const int32_t* seq_lens;
    float* workspace;     /* mla_workspace_bytes(s) */
    uint32_t* error_flag; /* may be NULL */
} mla_dense_params_t;

mla_status_t mla_dense_decode(const mla_schedule_t* s, const mla_dense_params_t* p, void* stream);

/* ---- sparse (DSA top-k) decode -------------------------------------------------- */
typedef struct {
    const void* q_nope; /* [T, heads, 512 (+64)] */
    const void* q_rope;
    int64_t q_nope_token_stride, q_nope_head_stride;
    int64_t q_rope_token_stride, q_rope_head_stride;
    const void* kv_cache;
    int64_t block_stride_bytes;
    int32_t num_blocks;
    int32_t block_size;
    const int32_t* indices; /* [T, indices_stride], global slot ids block_id*block_size+offset, -1 = none */
    int32_t topk;
    int32_t indices_stride;  /* >= topk */
    void* out;               /* [T, heads, 512] */
    int64_t out_token_stride, out_head_stride;
    float* lse;              /* [T, heads], may be NULL */
    int64_t lse_token_stride, lse_head_stride;
    float softmax_scale;
    mla_dtype_t dtype;
    const int32_t* topk_len; /* [T] valid entries of each indices row, clamped to [0, topk] silently; NULL: topk */
    float* workspace;        /* mla_workspace_bytes(s) */
    uint32_t* error_flag;
} mla_sparse_params_t;

mla_status_t mla_sparse_decode(const mla_schedule_t* s, const mla_sparse_params_t* p, void* stream);

/* ---- cache append --------------------------------------------------------------- */
/* Write num_tokens new 576-wide rows kv[i] (row stride kv_token_stride elements) into
 * the paged cache at slot_mapping[i] = block_id*block_size + offset; -1 is skipped. */
mla_status_t mla_append_kv(const void* kv, int64_t kv_token_stride, int32_t num_tokens,
                           const int64_t* slot_mapping, void* kv_cache, int64_t block_stride_bytes,
                           int32_t num_blocks, int32_t block_size, mla_dtype_t dtype, uint32_t* error_flag,
                           void* stream);

/* ---- index gather --------------------------------------------------------------- */
/* out_slots[t, k] = global slot id of request-logical position positions[t, k] of
 * request req_id[t]: block_table[req][pos / block_size]*block_size + pos % block_size,
 * or -1 where pos < 0, pos >= clamp(seq_lens[req]), the block id is out of range or
 * req_id is out of [0, batch). Strides in elements, rows of topk entries. At most 65,535
 * tokens per call; max_blocks_per_seq*block_size and num_blocks*block_size must fit int32. */
mla_status_t mla_gather_slots(const int32_t* positions, int32_t positions_stride, int32_t num_tokens,
                              int32_t topk, const int32_t* req_id, const int32_t* block_table,
                              int32_t block_table_stride, int32_t max_blocks_per_seq, const int32_t* seq_lens,
                              int32_t batch, int32_t block_size, int32_t num_blocks, int32_t* out_slots,
                              int32_t out_stride, uint32_t* error_flag, void* stream);

#ifdef __cplusplus
}
#endif
#endif /* MLA_DECODE_H */
