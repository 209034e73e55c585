/*
 * examples/c/dense_decode.c: the C ABI (csrc/mla_decode.h) driven from plain C, no Rust.
 *
 * One dense bf16 decode step (4 requests of mixed lengths, 8 heads, paged cache of 64-row
 * blocks) checked against a double-precision reference computed here, then a deliberately
 * wrong call to show mla_last_error(). Without a GPU it says so and exits 0.
 *
 * Build (CI does, .ci/run step c-example), with the static library cargo built:
 *   cc -std=c99 -O2 -Icsrc -I$CUDA/include examples/c/dense_decode.c \
 *      -L$OUT_DIR -lmla_decode_kernels -L$CUDA/lib -lcudart_static -lstdc++ -lpthread -ldl -lrt -lm
 * where $OUT_DIR is the folder of libmla_decode_kernels.a (under target/release/build/).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "mla_decode.h"

#define BATCH 4
#define HEADS 8
#define BLOCK 64
#define MAX_BLOCKS 8 /* longest sequence: 512 rows */
#define NUM_BLOCKS (BATCH * MAX_BLOCKS)

#define CUDA_OK(x)                                                                            \
    do {                                                                                      \
        cudaError_t e_ = (x);                                                                 \
        if (e_ != cudaSuccess) {                                                              \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            return 1;                                                                         \
        }                                                                                     \
    } while (0)
#define MLA_OK(x)                                                                                   \
    do {                                                                                            \
        mla_status_t st_ = (x);                                                                     \
        if (st_ != MLA_STATUS_OK) {                                                                 \
            fprintf(stderr, "%s:%d: status %d: %s\n", __FILE__, __LINE__, (int)st_, mla_last_error()); \
            return 1;                                                                               \
        }                                                                                           \
    } while (0)

/* bf16 <-> float on the host (round to nearest even; the inputs are finite) */
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
static double from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static float frand(uint64_t* s) { /* uniform in [-1, 1) */
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xffffff) / (float)(1 << 23) - 1.f;
}

/* Checks that the library this program runs with is the one its header describes. */
static int check_abi(void) {
    if (mla_abi_version() != MLA_ABI_VERSION) {
        fprintf(stderr, "library ABI %u, header %d\n", mla_abi_version(), MLA_ABI_VERSION);
        return 1;
    }
    if (!MLA_ABI_MATCHES()) {
        fprintf(stderr, "struct sizes differ between the library and this header\n");
        return 1;
    }
    return 0;
}

int main(void) {
    if (check_abi()) return 1;
    printf("mla-decode C ABI %u\n", mla_abi_version());
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        mla_schedule_t s;
        const mla_shape_t shape = {BATCH, 1, HEADS, MAX_BLOCKS * BLOCK, MLA_KV_BF16, MLA_KIND_DENSE};
        const mla_status_t st = mla_schedule_init(&s, &shape, NULL);
        printf("no CUDA device: mla_schedule_init -> status %d (%s)\n", (int)st, mla_last_error());
        return st == MLA_STATUS_NO_DEVICE || st == MLA_STATUS_NOT_BUILT ? 0 : 1;
    }

    const int32_t seq_lens[BATCH] = {1, 100, 511, 512};
    const size_t row = MLA_HEAD_DIM, cache_elems = (size_t)NUM_BLOCKS * BLOCK * row;
    const size_t q_elems = (size_t)BATCH * HEADS * row, out_elems = (size_t)BATCH * HEADS * MLA_LATENT_DIM;
    uint16_t* cache = malloc(cache_elems * 2);
    uint16_t* q = malloc(q_elems * 2);
    uint16_t* out = malloc(out_elems * 2);
    float* lse = malloc(BATCH * HEADS * sizeof(float));
    int32_t table[BATCH * MAX_BLOCKS];
    uint64_t seed = 1;
    for (size_t i = 0; i < cache_elems; ++i) cache[i] = to_bf16(frand(&seed));
    for (size_t i = 0; i < q_elems; ++i) q[i] = to_bf16(frand(&seed));
    for (int i = 0; i < BATCH * MAX_BLOCKS; ++i) table[i] = (i * 7) % NUM_BLOCKS; /* a permutation */
    const float scale = 1.f / 24.f;

    /* once per shape: the schedule and its workspace */
    mla_schedule_t s;
    const mla_shape_t shape = {BATCH, 1, HEADS, MAX_BLOCKS * BLOCK, MLA_KV_BF16, MLA_KIND_DENSE};
    MLA_OK(mla_schedule_init(&s, &shape, NULL));
    void *d_cache, *d_q, *d_out, *d_ws;
    int32_t *d_table, *d_lens;
    float* d_lse;
    uint32_t* d_flag;
    CUDA_OK(cudaMalloc(&d_cache, cache_elems * 2));
    CUDA_OK(cudaMalloc(&d_q, q_elems * 2));
    CUDA_OK(cudaMalloc(&d_out, out_elems * 2));
    CUDA_OK(cudaMalloc((void**)&d_lse, BATCH * HEADS * sizeof(float)));
    CUDA_OK(cudaMalloc((void**)&d_table, sizeof table));
    CUDA_OK(cudaMalloc((void**)&d_lens, sizeof seq_lens));
    CUDA_OK(cudaMalloc(&d_ws, mla_workspace_bytes(&s) ? mla_workspace_bytes(&s) : 16));
    CUDA_OK(cudaMalloc((void**)&d_flag, 16));
    CUDA_OK(cudaMemcpy(d_cache, cache, cache_elems * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_q, q, q_elems * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_table, table, sizeof table, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_lens, seq_lens, sizeof seq_lens, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_flag, 0, 16));
    CUDA_OK(cudaMemset(d_out, 0xff, out_elems * 2)); /* poison: NaN */

    /* every step: one call per layer */
    mla_dense_params_t p;
    memset(&p, 0, sizeof p);
    p.batch = BATCH;
    p.q_len = 1;
    p.num_heads = HEADS;
    p.q_nope = d_q;
    p.q_rope = NULL; /* packed 576-wide rows */
    p.q_nope_token_stride = HEADS * row;
    p.q_nope_head_stride = row;
    p.dtype = MLA_DTYPE_BF16;
    p.kv_cache = d_cache;
    p.kv_format = MLA_KV_BF16;
    p.block_stride_bytes = (int64_t)BLOCK * MLA_ROW_BYTES_16;
    p.num_blocks = NUM_BLOCKS;
    p.block_size = BLOCK;
    p.block_table = d_table;
    p.max_blocks_per_seq = MAX_BLOCKS;
    p.block_table_stride = MAX_BLOCKS;
    p.seq_lens = d_lens;
    p.out = d_out;
    p.out_token_stride = HEADS * MLA_LATENT_DIM;
    p.out_head_stride = MLA_LATENT_DIM;
    p.lse = d_lse;
    p.lse_token_stride = HEADS;
    p.lse_head_stride = 1;
    p.softmax_scale = scale;
    p.workspace = d_ws;
    p.error_flag = d_flag;
    MLA_OK(mla_dense_decode(&s, &p, NULL));
    uint32_t flag[4];
    CUDA_OK(cudaMemcpy(out, d_out, out_elems * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lse, d_lse, BATCH * HEADS * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(flag, d_flag, 16, cudaMemcpyDeviceToHost));

    /* reference in double: row `pos` of request b lives in block table[b][pos / BLOCK] */
    double err2 = 0, ref2 = 0, lse_err = 0;
    double* w = malloc(MAX_BLOCKS * BLOCK * sizeof(double));
    for (int b = 0; b < BATCH; ++b)
        for (int h = 0; h < HEADS; ++h) {
            const uint16_t* qr = q + ((size_t)b * HEADS + h) * row;
            double mx = -INFINITY, sum = 0;
            for (int pos = 0; pos < seq_lens[b]; ++pos) {
                const uint16_t* kv = cache + ((size_t)table[b * MAX_BLOCKS + pos / BLOCK] * BLOCK + pos % BLOCK) * row;
                double d = 0;
                for (size_t k = 0; k < row; ++k) d += from_bf16(qr[k]) * from_bf16(kv[k]);
                w[pos] = d * scale;
                if (w[pos] > mx) mx = w[pos];
            }
            for (int pos = 0; pos < seq_lens[b]; ++pos) sum += (w[pos] = exp(w[pos] - mx));
            for (int d = 0; d < MLA_LATENT_DIM; ++d) {
                double o = 0;
                for (int pos = 0; pos < seq_lens[b]; ++pos)
                    o += w[pos] *
                         from_bf16(cache[((size_t)table[b * MAX_BLOCKS + pos / BLOCK] * BLOCK + pos % BLOCK) * row + d]);
                o /= sum;
                const double got = from_bf16(out[((size_t)b * HEADS + h) * MLA_LATENT_DIM + d]);
                err2 += (got - o) * (got - o);
                ref2 += o * o;
            }
            const double e = fabs(lse[b * HEADS + h] - (mx + log(sum)));
            if (!(e <= lse_err)) lse_err = e; /* NaN propagates */
        }
    const double rel = sqrt(err2 / ref2);
    printf("dense decode: %d requests x %d heads, relative L2 error %.2e, max |lse error| %.2e, flag code %u\n", BATCH,
           HEADS, rel, lse_err, flag[0]);

    /* a wrong call: the message names the field */
    p.block_size = 48;
    const mla_status_t st = mla_dense_decode(&s, &p, NULL);
    printf("block_size 48 -> status %d: %s\n", (int)st, mla_last_error());

    free(cache), free(q), free(out), free(lse), free(w);
    cudaFree(d_cache), cudaFree(d_q), cudaFree(d_out), cudaFree(d_lse), cudaFree(d_table), cudaFree(d_lens);
    cudaFree(d_ws), cudaFree(d_flag);
    const int ok = rel <= 1e-2 && lse_err <= 1e-3 && flag[0] == 0 && st == MLA_STATUS_INVALID_ARGUMENT;
    printf("%s\n", ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}
