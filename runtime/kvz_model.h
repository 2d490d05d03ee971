/**
 * @file kvz_model.h
 * @brief Decoder-only transformer (llama / qwen2 / qwen3) with a KV cache whose
 *        per-(layer, KV head) segments may have different lengths.
 *
 * A model is loaded from a GGUF file (weights dequantized at load: fp32 on the
 * CPU backend, bf16 on the CUDA backend) or built from a synthetic spec with
 * deterministic random weights. A kvz_kv holds the keys (post-RoPE) and values
 * of one sequence:
 *
 *   - the document region: per (layer, KV head) a segment of up to @c cap rows,
 *     each with its original position. A full cache has equal lengths; a KVzip
 *     compressed cache has different lengths per head.
 *   - an optional output buffer of B slots per layer (LongFlow, DESIGN §5): new
 *     tokens go there instead of the document region; when full, each step
 *     overwrites the slot chosen during the previous step's attention.
 *
 * Attention is causal by position: a key is visible to a query iff key_pos <= query_pos.
 *
 * Thread-safety: a kvz_model is read-only after load and may be shared; a
 * kvz_kv must be used by one thread at a time. kvz_forward() uses the model's
 * thread count internally.
 */
#ifndef KVZ_MODEL_H
#define KVZ_MODEL_H

#include <stdint.h>
#include <stddef.h>

#include "kvz_tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { KVZ_ARCH_LLAMA = 0, KVZ_ARCH_QWEN2 = 1, KVZ_ARCH_QWEN3 = 2 };
enum { KVZ_DEVICE_CPU = 0, KVZ_DEVICE_CUDA = 1, KVZ_DEVICE_AUTO = 2 };

/** Hyperparameters, all read from GGUF metadata (or the synthetic spec). */
typedef struct kvz_config {
    uint32_t arch;        /**< KVZ_ARCH_* */
    int32_t n_layer;
    int32_t n_embd;       /**< hidden size */
    int32_t n_head;       /**< query heads */
    int32_t n_kv_head;    /**< key/value heads (GQA) */
    int32_t head_dim;
    int32_t n_ff;         /**< FFN inner size */
    int32_t n_vocab;
    int32_t n_ctx;        /**< trained context length */
    float rope_theta;
    float norm_eps;       /**< RMSNorm epsilon */
    int32_t rope_adjacent;/**< 1: rotate (x[2j], x[2j+1]) (llama GGUF); 0: (x[j], x[j+d/2]) */
    int32_t tied_embd;    /**< output projection is token_embd */
    int32_t qkv_bias;     /**< qwen2 */
    int32_t qk_norm;      /**< qwen3 per-head q/k RMSNorm */
    char name[64];        /**< general.name or the synthetic spec */
} kvz_config;

typedef struct kvz_model_opts {
    int32_t device;       /**< KVZ_DEVICE_* (AUTO: CUDA when a GPU is usable) */
    int32_t n_threads;    /**< CPU threads; 0 = all cores */
    uint64_t seed;        /**< synthetic weights seed (0 = default) */
    int32_t f32_weights;  /**< CPU backend: 1 = dequantize every GGUF weight to fp32 at load
                               (the reference path, ~4x the file in memory); 0 = compute on
                               the quantized blocks in the mmap'd file (default) */
} kvz_model_opts;

typedef struct kvz_model kvz_model;

/**
 * Load a GGUF model. @p opts may be NULL (defaults).
 * @return 0; any kvz_gguf_open error; KVZ_ERR_UNSUPPORTED (architecture or a
 *   tensor type); KVZ_ERR_NOTFOUND (a required tensor or key is missing, named in
 *   the detail); KVZ_ERR_FORMAT (tensor shapes disagree with the config);
 *   KVZ_ERR_NODEV (device CUDA requested, none usable); KVZ_ERR_NOMEM.
 */
int kvz_model_load(const char *path, const kvz_model_opts *opts, kvz_model **out);

/**
 * Build a random-weight model of a named shape: "smollm2-135m", "llama3-8b",
 * "qwen2.5-7b", and small test shapes "tiny-llama", "tiny-qwen2", "tiny-qwen3".
 * Weights are drawn by a counter-based generator and rounded to bf16, so every
 * backend sees identical values (on the CUDA backend they are generated on the
 * device, bit-identical). The tokenizer is the byte-level fallback
 * (kvz_tokenizer_bytes): one token per byte, ChatML control tokens 256/257.
 * @return 0, KVZ_ERR_NOTFOUND (unknown name), KVZ_ERR_NOMEM, KVZ_ERR_NODEV.
 */
int kvz_model_synthetic(const char *name, const kvz_model_opts *opts, kvz_model **out);

void kvz_model_free(kvz_model *m);

const kvz_config *kvz_model_config(const kvz_model *m);
/** The model's tokenizer (owned by the model); the byte-level one for synthetic models. */
const kvz_tokenizer *kvz_model_tokenizer(const kvz_model *m);
/** 16-byte fingerprint: XXH3-128 of the GGUF (see kvz_gguf_fingerprint) or of the synthetic spec+seed. */
void kvz_model_fingerprint(const kvz_model *m, uint8_t out[16]);
/** KVZ_DEVICE_CPU or KVZ_DEVICE_CUDA. */
int32_t kvz_model_device(const kvz_model *m);
/** Bytes of weights as held by the backend. */
uint64_t kvz_model_weight_bytes(const kvz_model *m);
/** Bytes of the token embedding table held on the host (CPU backend) when it is
 *  its own matrix, untied from the output projection: part of
 *  kvz_model_weight_bytes, of which a decoded token reads one row (of
 *  bytes / n_vocab). 0 when the embedding is tied (the output projection reads
 *  all of it) or not held on the host (CUDA backend). */
uint64_t kvz_model_tok_embd_bytes(const kvz_model *m);

/* ------------------------------------------------------------------------ */
/* KV cache                                                                  */

typedef struct kvz_kv kvz_kv;

/**
 * Create a cache for @p m with room for @p cap document rows per (layer, KV head)
 * and @p out_slots LongFlow output slots per layer (0: no output buffer, new
 * tokens go to the document region).
 * @return 0, KVZ_ERR_NOMEM, KVZ_ERR_ARG.
 */
int kvz_kv_create(const kvz_model *m, int64_t cap, int32_t out_slots, kvz_kv **out);
void kvz_kv_free(kvz_kv *kv);

/** Drop every row (document and output); capacity is kept. */
void kvz_kv_clear(kvz_kv *kv);
/**
 * Remember the current document lengths (e.g. right after loading a document);
 * kvz_kv_rollback() returns to them and empties the output buffer, so several
 * questions can be answered against one loaded cache.
 */
void kvz_kv_checkpoint(kvz_kv *kv);
void kvz_kv_rollback(kvz_kv *kv);
/** Rows in the document segment of (layer, head). */
int64_t kvz_kv_len(const kvz_kv *kv, int32_t layer, int32_t head);
/** Document capacity per head. */
int64_t kvz_kv_cap(const kvz_kv *kv);
/** Truncate every document segment to its first @p n rows (rows with index >= n dropped). */
void kvz_kv_truncate(kvz_kv *kv, int64_t n);

/**
 * Host view of the document segment of (layer, head). CPU backend only: the
 * pointers alias the cache and stay valid until it is modified or freed.
 * k, v: (len, head_dim) fp32; pos: (len) int32.
 * @return 0, KVZ_ERR_UNSUPPORTED on a device cache.
 */
int kvz_kv_view(const kvz_kv *kv, int32_t layer, int32_t head, const float **k,
                const float **v, const int32_t **pos, int64_t *len);

/**
 * Replace the document region with compressed segments (after kvz_kv_clear).
 * For layer @p layer: counts (n_kv_head), pos (sum counts) int32, k/v
 * (sum counts, head_dim) fp32, head-major (head 0's rows first).
 * @return 0, KVZ_ERR_CONTEXT (a count exceeds the capacity), KVZ_ERR_CUDA.
 */
int kvz_kv_set_layer(kvz_kv *kv, int32_t layer, const uint32_t *counts, const int32_t *pos,
                     const float *k, const float *v);

/** Copy the document segment of (layer, head) to host fp32 (any backend). */
int kvz_kv_get_head(const kvz_kv *kv, int32_t layer, int32_t head, float *k, float *v,
                    int32_t *pos);

/**
 * KVzip probe (CPU backend). While set, attention also scores the rows [c0, c1) of
 * every document segment: for each new query i (at a position >= q_pos0) and query
 * head g of KV head h, the
 * softmax restricted to the key subset rows [0, n_prefix) ∪ [c0, c1) ∪ [rep_row0, ...)
 * (causal), computed from the full softmax as p_j / Σ_subset p; the maximum over
 * queries and the GQA group is max-accumulated into
 * scores[(layer * n_kv_head + h) * stride + off + (j - c0)].
 * The caller zeroes those scores before the pass. This fuses DESIGN §3's scoring into
 * the repeat pass's own attention: no second QK product.
 */
typedef struct kvz_kv_probe {
    int64_t n_prefix;   /**< subset rows [0, n_prefix) */
    int64_t c0, c1;     /**< scored rows [c0, c1) */
    int64_t rep_row0;   /**< subset rows from here on (the repeat input), causal */
    float *scores;      /**< output, see above */
    int64_t stride, off;
    int64_t q_pos0;     /**< only queries at positions >= q_pos0 score (0: every query of the
                             pass; lets one pass prefill the context and run the repeat input) */
} kvz_kv_probe;
/** Set (or clear with NULL) the probe. @return 0, KVZ_ERR_NOMEM, KVZ_ERR_UNSUPPORTED (device cache). */
int kvz_kv_set_probe(kvz_kv *kv, const kvz_kv_probe *p);

/**
 * Segmented passes (CPU backend): several independent sequences in ONE forward pass,
 * all after the rows already in the cache (e.g. a shared system prefix). While set,
 * the next kvz_forward() of exactly Σ segs[s].n tokens at @c pos0 treats its tokens as
 * the segments one after another: token u of segment s sits at position pos0 + u
 * (positions restart for every segment), and attends to every row the cache held
 * before the pass plus, causally, its own segment's rows only (a block-diagonal mask:
 * never another segment's). The new rows are appended in pass order as usual (rows of
 * segment s after those of segment s-1, each segment's positions ascending from pos0).
 * Each segment may carry its own KVzip probe: when @c scores is set, its queries at
 * u >= n_score score its first n_score rows as kvz_kv_probe does, over the key subset
 * rows [0, @p n_prefix) ∪ the segment's own visible rows, max-accumulated into
 * scores[(layer * n_kv_head + h) * n_score + j] (the caller zeroes them first).
 * @p segs is borrowed (not copied) until kvz_kv_set_segments(kv, NULL, 0, 0).
 * The pass must fit one internal batch (1,024 tokens), the cache must have no output
 * buffer, and no kvz_kv_probe may be set at the same time; otherwise kvz_forward
 * returns KVZ_ERR_ARG.
 */
typedef struct kvz_kv_seg {
    int32_t n;          /**< tokens of this segment in the pass (> 0) */
    int32_t n_score;    /**< rows [0, n_score) of the segment are scored (0: no probe) */
    float *scores;      /**< (n_layer, n_kv_head, n_score) fp32, or NULL: no probe */
} kvz_kv_seg;
/** Set (or clear with NULL) the segments of the next passes.
 *  @return 0, KVZ_ERR_ARG (a segment of <= 0 tokens, n_score > n, n_prefix < 0),
 *  KVZ_ERR_UNSUPPORTED (device cache). */
int kvz_kv_set_segments(kvz_kv *kv, const kvz_kv_seg *segs, int32_t n_seg, int64_t n_prefix);

/** LongFlow statistics of the output buffer. */
typedef struct kvz_kv_stats {
    int64_t out_slots;      /**< B */
    int64_t out_used;       /**< slots holding a token (max over layers) */
    int64_t evictions;      /**< overwrites so far (per layer, summed over layers / n_layer) */
    int64_t doc_rows;       /**< rows in the document region, summed over layers and heads */
    uint64_t bytes_held;    /**< bytes of K/V in live rows (doc + out) */
    uint64_t bytes_alloc;   /**< bytes of K/V allocated */
} kvz_kv_stats;
void kvz_kv_get_stats(const kvz_kv *kv, kvz_kv_stats *st);
/** Number of protected leading output slots (sinks), default 4. */
void kvz_kv_set_sinks(kvz_kv *kv, int32_t n_sink);

/** Output-buffer eviction policy once full. */
enum {
    KVZ_OUT_LONGFLOW = 0, /**< argmin of S_j = sum_h p_{h,j} |v_j|_1 (default) */
    KVZ_OUT_WINDOW = 1,   /**< baseline: sinks + most recent tokens (evict the oldest) */
};
void kvz_kv_set_out_policy(kvz_kv *kv, int32_t policy);

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

/**
 * Per-layer observer, called after RoPE and after the new keys were appended,
 * before attention, once per layer and internal batch (a long pass comes in several
 * calls, each with its own n and row0). row0: the document rows of head 0 of the
 * layer before this batch was appended.
 * q: (n, n_head, head_dim); k_new: (n, n_kv_head, head_dim) (the new tokens' keys,
 * also present in the cache at indices [row0, row0+n) of each head when appended).
 * Both are host fp32 on every backend, valid during the call only:
 *   - CPU: the forward pass's own arrays;
 *   - CUDA: copies of the device's bf16 q and k (widened to fp32, so they equal the
 *     values the device attends with); the stream is synchronised before the call.
 *     The cache is a device cache: kvz_kv_view fails (KVZ_ERR_UNSUPPORTED), read
 *     rows with kvz_kv_get_head (bf16 values widened to fp32). A pass with a hook
 *     costs one device-to-host copy and one synchronisation per layer; without a
 *     hook nothing is copied. The decode CUDA graph is not used while a hook is set.
 * A nonzero return stops the pass and is kvz_forward's result.
 */
typedef struct kvz_layer_hook {
    int (*fn)(void *ctx, int32_t layer, const float *q, const float *k_new, int32_t n,
              int64_t row0, const kvz_kv *kv);
    void *ctx;
} kvz_layer_hook;

enum {
    KVZ_FWD_LOGITS_LAST = 0,  /**< logits of the last token only: (1, n_vocab) */
    KVZ_FWD_LOGITS_ALL = 1,   /**< logits of every token: (n, n_vocab) */
    KVZ_FWD_NO_LOGITS = 2,    /**< no logits (prefill) */
    KVZ_FWD_DISCARD = 4,      /**< drop the new tokens' KV after the pass (doc region only) */
    KVZ_FWD_TO_DOC = 8,       /**< append to the document region even if an output buffer exists */
};

/**
 * Run @p n tokens at positions pos0..pos0+n-1 through the model, appending their
 * K/V to the cache (document region, or the output buffer if it has slots), and
 * write logits. @p hook may be NULL.
 * @return 0, KVZ_ERR_CONTEXT (cache full), KVZ_ERR_ARG (bad token id), KVZ_ERR_NOMEM,
 *   KVZ_ERR_CUDA, or the hook's nonzero return.
 */
int kvz_forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                float *logits, int flags, const kvz_layer_hook *hook);

/**
 * Continuous batching: one decode step for each of @p n caches of model @p m at once.
 * Token @p tokens[i] at position @p pos[i] goes into cache @p kv[i] exactly as
 * kvz_forward(m, kv[i], &tokens[i], 1, pos[i], row_i, KVZ_FWD_LOGITS_LAST, NULL) would
 * put it (output buffer with its eviction policy, or the document region when the
 * cache has no output buffer), and row i of @p logits (n, n_vocab) gets its logits.
 * The caches must be distinct; each is used by this call alone meanwhile. On the CUDA
 * backend one batched pass serves all (one GEMM per weight for the n rows, one
 * attention launch over the n ragged caches); elsewhere it is n single-token passes.
 * @return 0, KVZ_ERR_ARG (n < 1, a repeated cache, a bad token or position: checked
 *   before anything runs), KVZ_ERR_CONTEXT, KVZ_ERR_NOMEM, KVZ_ERR_CUDA. After an error
 *   past the checks the output buffers of the caches may hold part of the step: roll
 *   them back to their documents (kvz_kv_rollback), as kvzip_batch does for every
 *   answer of a failed step.
 */
int kvz_forward_multi(kvz_model *m, kvz_kv *const *kv, const int32_t *tokens, const int32_t *pos,
                      int32_t n, float *logits);

/** How a kvz_forward_multi_top step ran (kvz_step_io.path). */
enum {
    KVZ_STEP_PASSES = 0, /**< one single-cache pass per cache (CPU, n = 1, unbatchable caches) */
    KVZ_STEP_EAGER = 1,  /**< the batched pass, launched kernel by kernel */
    KVZ_STEP_CAPTURE = 2, /**< the batched pass, captured into a CUDA graph and launched */
    KVZ_STEP_REPLAY = 3, /**< the batched pass, replayed from a CUDA graph kept from earlier steps */
};

/** What a kvz_forward_multi_top caller wants back besides the cache updates. */
typedef struct kvz_step_io {
    const uint8_t *want_logits; /**< (n): 1 = row i's logits into logits row i; 0 = that row is
                                     not written. NULL: every row. */
    int32_t *top;               /**< (n) or NULL: row i's argmax id (kvz_argmax: the lowest id
                                     of the largest logit), for every row */
    int32_t path;               /**< out: KVZ_STEP_* */
    float *scratch;             /**< NULL, or n_vocab floats the per-cache route (CPU, n = 1)
                                     may compute an unwanted row's logits into, for its id
                                     (NULL: a row is allocated per call) */
} kvz_step_io;

/**
 * kvz_forward_multi with a choice of what comes back: the rows of @p logits named by
 * io->want_logits (@p logits may be NULL when no row is wanted) and the argmax id of
 * every row in io->top (computed on the device on CUDA: only n ids cross the bus for
 * the rows whose logits are not wanted). @p io NULL: kvz_forward_multi. The cache
 * updates and the logits written are exactly kvz_forward_multi's.
 * @return as kvz_forward_multi.
 */
int kvz_forward_multi_top(kvz_model *m, kvz_kv *const *kv, const int32_t *tokens, const int32_t *pos,
                          int32_t n, float *logits, kvz_step_io *io);

/** kvz_forward_multi_top after its checks as n single-cache passes (m's backend's
 *  forward, one token each): the CPU route, and the CUDA one for caches the batched
 *  pass does not take. */
int kvz_forward_each(kvz_model *m, kvz_kv *const *kv, const int32_t *tokens, const int32_t *pos, int32_t n,
                     float *logits, kvz_step_io *io);

/** The lowest index of the largest of @p x[0..n) by the scan `x[i] > x[best]` from
 *  best = 0 (NaNs never win; x[0] = NaN gives 0): greedy decoding's rule, shared by
 *  kvz_sample and the multi step's top ids. */
int32_t kvz_argmax(const float *x, int32_t n);

#ifdef __cplusplus
}
#endif
#endif
