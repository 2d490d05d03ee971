/* Internal to runtime/cuda/ (the CUDA backend, kvz_cuda_backend.h): the state its
 * files share and the helpers one file defines for the others. Not installed; no
 * other module includes it. */
#pragma once

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_cuda_common.cuh" /* kernels/: the op library */

extern "C" {
#include "kvz_model_impl.h"
#include "kvz_cuda_backend.h"
#include "kvz_cuda_loader.h"
#include "kvz_rope_shift_cuda.h"
#include "kvz_cuda_verify.h"
}

/* eviction modes of ingest/kvz_kvzip.h (KVZ_EVICT_GLOBAL / KVZ_EVICT_UNIFORM) */
enum { EVICT_GLOBAL = 0, EVICT_UNIFORM = 1 };

/* host bf16 <-> fp32, round to nearest even (same as kvz_quant.c) */
static inline uint16_t h_f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float h_bf2f(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define KVZ_GPU_MAX_BATCH 8192   /* tokens per internal pass (bounds activation memory) */
#define KVZ_GPU_LOGIT_ROWS 512   /* logits rows per GEMM when every row is wanted */

#define TRY(x)                                                                   \
    do {                                                                         \
        int rc_ = (x);                                                           \
        if (rc_) return rc_;                                                     \
    } while (0)


/* device memory with accounting (kvz_cuda_mem.cu) */
int dmalloc(void **p, size_t bytes, const char *what);
void dfree(void *p);
int dmalloc_tmp(void **p, size_t bytes, cudaStream_t s, const char *what);
void dfree_tmp(void *p, cudaStream_t s);

/* ====================================================================== */
/* model (kvz_cuda_weights.cu)                                              */

typedef struct cuda_layer {
    float *attn_norm, *ffn_norm; /* (d) */
    float *bqkv;                 /* (nqkv) or NULL */
    float *q_norm, *k_norm;      /* (hd) or NULL */
    bf16 *wqkv;                  /* (nqkv, d) */
    bf16 *wo;                    /* (d, qd) */
    bf16 *wgu;                   /* (2 ff, d) */
    bf16 *wdown;                 /* (d, ff) */
} cuda_layer;

struct kvz_cuda_model {
    cudaStream_t s;
    kvz_cuda_blas *blas;
    bf16 *tok_embd;   /* (n_vocab, d) */
    bf16 *output;     /* (n_vocab, d); == tok_embd when tied */
    float *out_norm;  /* (d) */
    cuda_layer *L;    /* (n_layer) */
    float *staging;   /* upload staging (fp32) */
    size_t staging_n;
    /* pipelined loader (kvz_cuda_load_*): pinned host slots, one device staging
     * buffer per slot, an event per slot marking its upload done */
    void *ld_h[KVZ_CUDA_LOAD_MAX_SLOTS];
    void *ld_d[KVZ_CUDA_LOAD_MAX_SLOTS];
    cudaEvent_t ld_ev[KVZ_CUDA_LOAD_MAX_SLOTS];
    size_t ld_bytes;  /* bytes of each slot */
    void *ld_base;    /* NULL, or the one registered mapping the slots' host sides lie in */
    size_t ld_total;  /* its bytes */
    int ld_n;         /* slots allocated */
    /* the direct route's records verified on the device (kvz_cuda_load_verify_*):
     * block sums of each record's hash, its job, and results (digests, then first bad rows) */
    uint64_t *lv_sums, *lv_off;  /* device (lv_sums_n u64); host (lv_cap): each record's sums */
    size_t lv_sums_n;
    uint64_t *lv_res_h, *lv_res_d;  /* pinned host, device (2 lv_cap) */
    int lv_cap, lv_n;
#define KVZ_CUDA_LV_STREAMS 32
    cudaStream_t lv_s[KVZ_CUDA_LV_STREAMS]; /* the records' hash chains, beside the uploads on s (record r on
                                             * stream r % 32: a chain is one 8-thread block, so they run side by side) */
    cudaEvent_t lv_go, lv_done;     /* s -> lv_s (a record's sums queued), lv_s -> s (chains done) */
    /* continuous batching (kvz_cuda_multi.cu), grown on demand: activations for mb_n
     * rows, per-(layer, sequence) descriptors (device + pinned staging, with the
     * step's tokens and positions after them), attention workspace, logits */
    void *mb_act;
    int32_t mb_n;
    kvz_cuda_seq *mb_seq_d, *mb_seq_h;
    int32_t mb_seq_n;   /* sequences the descriptor arrays hold per layer */
    void *mb_ws;
    size_t mb_ws_bytes;
    float *mb_logits;   /* (mb_logits_n, n_vocab), then (mb_logits_n) int32 argmax ids */
    int32_t mb_logits_n;
    /* the batched step as CUDA graphs, one per coarse shape (kvz_cuda_multi.cu: n, the
     * largest buffer, the longest head's bucket, the per-layer row sums within ±25%),
     * kept LRU; emptied when a buffer above is reallocated */
    struct mb_graph *mb_g; /* (KVZ_MB_GRAPHS) */
    int32_t mb_ng;
    uint64_t mb_clock;
    int mb_gdisabled;
};
#define KVZ_MB_GRAPHS 64
/* kvz_cuda_multi.cu: the batched step's graphs and buffers' bookkeeping (model free) */
void kvz_cuda_multi_free(kvz_cuda_model *g);

/* free the loader's device-verification buffers (kvz_cuda_load.cu; model free) */
void kvz_cuda_load_verify_free(kvz_cuda_model *g);
/* the load staging's slots (host and device sides, events) */
void kvz_cuda_load_free(kvz_cuda_model *g);

/* ====================================================================== */
/* cache (kvz_cuda_cache.cu)                                                */

struct kvz_cuda_cache {
    kvz_cuda_kv *L;       /* (n_layer) per-layer views for the kernels */
    kvz_cuda_outbuf *O;   /* (n_layer) or NULL */
    bf16 *k, *v;          /* (n_layer, n_kv, cap, hd) */
    int32_t *pos;         /* (n_layer, n_kv, cap) */
    int32_t *len;         /* (n_layer, n_kv) device */
    bf16 *ok, *ov;        /* (n_layer, n_kv, B, hd) */
    int32_t *opos;        /* (n_layer, B) */
    int32_t *evict;       /* (n_layer) LongFlow victim chosen by the last attention */
    int32_t *len_h;       /* (n_layer, n_kv) host staging for len pushes */
    /* work memory, grown on demand */
    void *act;            /* activations for act_T tokens */
    int32_t act_T;
    void *dec_ws;         /* decode attention workspace */
    size_t dec_ws_bytes;
    void *score_ws;       /* kvzip score workspace */
    size_t score_ws_bytes;
    float *logits;        /* (KVZ_GPU_LOGIT_ROWS, n_vocab) */
    float *scores;        /* (n_layer, n_kv, n_ctx) KVzip scores */
    int64_t scores_n;
    /* export of kept rows (kvz_cuda_kv_export_layer): device staging + pinned host copy */
    void *exp_d, *exp_h;
    size_t exp_d_bytes, exp_h_bytes;
    /* CUDA-graph decode step (batch 1): inputs {token, position, fill slot} in device
     * memory, fed from a pinned ring (an event guards each entry's reuse) */
    int32_t *step_d;      /* (4) device */
    int32_t *step_h;      /* (GRAPH_RING, 4) pinned */
    cudaEvent_t step_ev[16];
    int step_i;
    cudaGraphExec_t gexec;
    struct graph_key { const void *k, *ok, *act, *logits; int act_T, doc, want, n_sink, policy; } gkey;
    int gseen;            /* eager runs with the current key (capture on the second) */
    int gdisabled;        /* capture failed once: eager from then on */
};
#define GRAPH_RING 16

static inline size_t al256(size_t x) { return (x + 255) & ~(size_t)255; }

/* activation layout for T tokens */
typedef struct act_view {
    float *x;      /* (T, d) fp32 residual */
    bf16 *xn;      /* (T, d) */
    bf16 *qkv;     /* (T, nqkv) */
    bf16 *att;     /* (T, qd) */
    bf16 *gu;      /* (T, 2 ff) */
    bf16 *hb;      /* (T, ff) */
    bf16 *att1;    /* (1, qd) scratch for the eviction-only decode call */
    int32_t *tok;  /* (T) */
    int32_t *pos;  /* (T) */
} act_view;

/* The activations of T rows laid out from @p base into @p v (NULL: only the size);
 * returns their bytes. The single-cache forward and the batched step (T = n
 * sequences) share it (kvz_cuda_forward.cu). */
size_t kvz_cuda_act_layout(const kvz_config *c, int32_t T, act_view *v, char *base);

/* ====================================================================== */
/* forward (kvz_cuda_forward.cu)                                            */

/* A batch of KVzip repeat inputs (kvz_cuda_kvzip_repeat): chunk i owns batch rows
 * [r0[i], r0[i] + ch[i].n) and cache rows ctx_end + r0[i]..; pos: host positions of
 * every batch row. */
typedef struct score_args {
    int32_t n_prefix, n_ctx, n_ch;
    const kvz_repeat_chunk *ch;
    const int32_t *r0, *pos;
} score_args;

/* kvz_cuda_forward's body; @p sa: a batch of KVzip repeat inputs to score (kvz_cuda_kvzip.cu);
 * @p hook: the caller's layer hook or NULL (kvz_model.h) */
int forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
            float *logits, int flags, const score_args *sa, const kvz_layer_hook *hook);
