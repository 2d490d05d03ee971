/* Internal: model and cache structures shared by the loader and the backends.
 * Not a public header: only runtime/ and kernels/ glue include it. */
#ifndef KVZ_MODEL_IMPL_H
#define KVZ_MODEL_IMPL_H

#include "kvz_gguf.h"
#include "kvz_model.h"

/* Host fp32 weights of one layer. Matrices are [out][in] row-major (GGUF ne[0] = in). */
typedef struct kvz_layer_w {
    float *attn_norm;  /* (n_embd) */
    float *wqkv;       /* (q_dim + 2*kv_dim, n_embd): Q rows, then K rows, then V rows */
    float *bqkv;       /* (q_dim + 2*kv_dim) or NULL (qwen2 bias) */
    float *q_norm;     /* (head_dim) or NULL (qwen3) */
    float *k_norm;     /* (head_dim) or NULL (qwen3) */
    float *wo;         /* (n_embd, q_dim) */
    float *ffn_norm;   /* (n_embd) */
    float *wgu;        /* (2*n_ff, n_embd): gate rows, then up rows */
    float *wdown;      /* (n_embd, n_ff) */
} kvz_layer_w;

typedef struct kvz_cuda_model kvz_cuda_model; /* CUDA backend state (kernels/ glue) */
typedef struct kvz_cuda_kv kvz_cuda_kv;

struct kvz_model {
    kvz_config cfg;
    int32_t device;          /* KVZ_DEVICE_CPU / CUDA */
    int32_t n_threads;
    kvz_gguf *gguf;          /* NULL for synthetic */
    kvz_tokenizer *tok;      /* NULL for synthetic */
    uint8_t fingerprint[16];
    /* host weights (CPU backend; freed after upload on CUDA) */
    float *tok_embd;         /* (n_vocab, n_embd) */
    float *out_norm;         /* (n_embd) */
    float *output;           /* (n_vocab, n_embd); aliases tok_embd when tied */
    float *rope_inv_freq;    /* (head_dim/2) */
    kvz_layer_w *layers;     /* (n_layer) */
    uint64_t weight_bytes;
    kvz_cuda_model *cuda;    /* non-NULL on the CUDA backend */
};

struct kvz_kv {
    const kvz_model *m;
    int32_t n_layer, n_kv_head, head_dim;
    int64_t cap;             /* document rows per (layer, head) */
    int64_t *len;            /* (n_layer, n_kv_head) */
    int64_t *mark;           /* (n_layer, n_kv_head) lengths at kvz_kv_checkpoint, or NULL */
    float *k, *v;            /* (n_layer, n_kv_head, cap, head_dim) fp32 (CPU) */
    int32_t *pos;            /* (n_layer, n_kv_head, cap) */
    /* LongFlow output buffer: B slots per layer shared by all KV heads */
    int32_t out_slots;       /* B (0: none) */
    int32_t n_sink;          /* protected leading slots */
    int32_t out_policy;      /* KVZ_OUT_LONGFLOW / KVZ_OUT_WINDOW */
    float *ok, *ov;          /* (n_layer, B, n_kv_head, head_dim) fp32 */
    int32_t *opos;           /* (n_layer, B) position, -1 = empty */
    int32_t *out_used;       /* (n_layer) slots filled so far */
    int32_t *victim;         /* (n_layer) slot the next token overwrites when full */
    int32_t *newest;         /* (n_layer) slot written last */
    int64_t evictions;       /* overwrites, summed over layers */
    float *scratch;          /* CPU work memory, grown on demand, reused across steps */
    size_t scratch_cap;      /* floats */
    kvz_cuda_kv *cuda;       /* device cache on the CUDA backend */
};

/* CPU backend entry points (kvz_cpu.c) */
int kvz_cpu_forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                    float *logits, int flags, const kvz_layer_hook *hook);

#ifdef KVZ_HAVE_CUDA
/* CUDA backend entry points (kernels/kvz_cuda_backend.cu) */
int kvz_cuda_available(void);
int kvz_cuda_model_init(kvz_model *m);
void kvz_cuda_model_free(kvz_model *m);
int kvz_cuda_kv_init(kvz_kv *kv);
void kvz_cuda_kv_free(kvz_kv *kv);
int kvz_cuda_forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                     float *logits, int flags, const kvz_layer_hook *hook);
#endif

#endif
