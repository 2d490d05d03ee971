/* Internal: model and cache structures shared by the loader and the backends.
 * Not a public header: only runtime/ and its backends (runtime/kvz_backend_cpu.c,
 * runtime/cuda/) include it. */
#ifndef KVZ_MODEL_IMPL_H
#define KVZ_MODEL_IMPL_H

#include "kvz_backend.h"
#include "kvz_gguf.h"
#include "kvz_model.h"

/* A weight matrix as the CPU backend reads it: @c rows rows of @c cols elements of
 * ggml type @c type (KVZ_TYPE_*), row r at data + r * row_bytes. Quantized types
 * point into the mmap'd GGUF (no copy); F32 points at host fp32 arrays. */
typedef struct kvz_wmat {
    const void *data;
    uint32_t type;
    int32_t rows, cols;
    size_t row_bytes;
} kvz_wmat;

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
    /* What the CPU backend multiplies with (kvz_cpu.c): either views of the fp32
     * arrays above (one fused wqkv / wgu matrix) or the GGUF's quantized tensors
     * (q, k, v and gate, up as separate matrices, each of its own type). The
     * outputs of the matrices of a group are concatenated in order. */
    kvz_wmat mqkv[3];
    int32_t n_mqkv;
    kvz_wmat mo, mgu[2], mdown;
    int32_t n_mgu;
} kvz_layer_w;

typedef struct kvz_cuda_model kvz_cuda_model; /* CUDA backend state (runtime/cuda/) */
typedef struct kvz_cuda_cache kvz_cuda_cache; /* device KV cache state (runtime/cuda/) */

struct kvz_model {
    kvz_config cfg;
    int32_t device;          /* KVZ_DEVICE_CPU / CUDA: be->device */
    const kvz_backend *be;   /* the backend it runs on (kvz_backend_pick) */
    int32_t n_threads;
    kvz_gguf *gguf;          /* NULL for synthetic */
    kvz_tokenizer *tok;      /* GGUF BPE, or the byte-level fallback for synthetic models */
    int32_t synthetic;       /* 1: weights from synth_fill (kvz_model.c) */
    uint64_t synth_seed;     /* seed of the synthetic weights */
    uint8_t fingerprint[16];
    /* host weights (CPU backend; freed after upload on CUDA) */
    float *tok_embd;         /* (n_vocab, n_embd) */
    float *out_norm;         /* (n_embd) */
    float *output;           /* (n_vocab, n_embd); aliases tok_embd when tied */
    float *rope_inv_freq;    /* (head_dim/2) */
    kvz_layer_w *layers;     /* (n_layer) */
    kvz_wmat m_tok, m_out;   /* CPU backend: token embedding rows, output projection */
    int32_t quant_cpu;       /* 1: CPU backend on the GGUF's quantized tensors (no fp32 copy) */
    void **owned;            /* fp32 copies of tensors of a type kvz_qdot cannot read */
    int32_t n_owned;
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
    kvz_kv_probe probe;      /* KVzip probe, active when probe.scores != NULL */
    float *probe_part;       /* (threads, n_kv_head, c1-c0) per-thread maxima */
    size_t probe_part_cap;
    const kvz_kv_seg *segs;  /* segmented pass (kvz_kv_set_segments), borrowed; NULL: none */
    int32_t n_segs;
    int64_t seg_prefix;      /* probe subset rows [0, seg_prefix) of a segmented pass */
    float *scratch;          /* CPU work memory, grown on demand, reused across steps */
    size_t scratch_cap;      /* floats */
    kvz_cuda_cache *cuda;    /* device cache on the CUDA backend */
};

/* Free the host fp32 weights (the layer array stays, zeroed). The CUDA backend
 * calls it after upload; kvz_model_free calls it for every model. */
void kvz_model_free_host_weights(kvz_model *m);

/* CPU forward pass (kvz_cpu.c; the CPU table's forward, runtime/kvz_backend_cpu.c) */
int kvz_cpu_forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                    float *logits, int flags, const kvz_layer_hook *hook);


#endif
