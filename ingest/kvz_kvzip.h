/**
 * @file kvz_kvzip.h
 * @brief KVzip query-agnostic KV importance scoring and eviction (DESIGN §3).
 *
 * Scoring: after the prefix + context are prefilled, each context chunk t of m
 * tokens is reconstructed teacher-forced from a "repeat" prompt placed after the
 * whole context; for every layer l and KV head h, a context key j of chunk t gets
 * score(l,h,j) = max over the repeat queries i and the query heads g of h's GQA
 * group of softmax_{K̄}(q_{i,g}·k/√d)[j], where the softmax runs over the key subset
 * K̄ = prefix keys ∪ chunk-t keys ∪ repeat keys up to i. The repeat pass's own KV
 * is discarded.
 *
 * Eviction keeps exactly round(N·r) of the N = n_layer·n_kv_head·n_context
 * context pairs (global mode) or round(n_context·r) per head (uniform mode);
 * ties go to the lower flat index (layer, head, token). The prefix is always kept.
 */
#ifndef KVZ_KVZIP_H
#define KVZ_KVZIP_H

#include <stdint.h>

#include "kvz_model.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { KVZ_EVICT_GLOBAL = 0, KVZ_EVICT_UNIFORM = 1 };

#define KVZ_KVZIP_CHUNK 2000
#define KVZ_KVZIP_OVERLAP 8
#define KVZ_KVZIP_ONE_PASS_MAX 256 /* default kvz_kvzip_params.one_pass (tokens) */
#define KVZ_KVZIP_BATCH_TOKENS 512 /* default kvz_kvzip_params.batch_tokens */
#define KVZ_REPEAT_FIRST "\n\nRepeat the previous context exactly."
#define KVZ_REPEAT_NEXT "\n\nRepeat the part of the previous context exactly, starting with "

typedef struct kvz_kvzip_params {
    float ratio;        /**< fraction of context pairs kept, (0, 1] (default 0.3) */
    int32_t mode;       /**< KVZ_EVICT_GLOBAL (default) or KVZ_EVICT_UNIFORM */
    int32_t chunk;      /**< scoring chunk m (default 2000) */
    int32_t overlap;    /**< tokens of chunk t-1 quoted in chunk t's prompt (default 8) */
    int32_t prefill_chunk; /**< tokens per prefill pass (default 4096) */
    int32_t repeat_rows;   /**< GPU: repeat inputs of consecutive chunks share one pass of at
                                most this many tokens (default 8192; <= 0: one chunk per pass).
                                The passes are independent (each chunk's repeat input attends to
                                the document and to itself only), so this changes speed, not
                                scores. The CPU backend always runs one chunk per pass. */
    int32_t one_pass;      /**< CPU: a document of one chunk whose pass [prefix rows not cached ;
                                context ; repeat input] has at most this many tokens (and at most
                                prefill_chunk) is prefilled and scored in ONE forward pass
                                (default KVZ_KVZIP_ONE_PASS_MAX; 0: never, always a prefill pass
                                and then the repeat pass, the reference). Same queries, keys and
                                positions either way: the scores differ by rounding only (see
                                kvz_kvzip_prefill_score). Short documents save one pass's fixed
                                cost (every weight tile dequantized once more); longer ones gain
                                nothing and the CPU pass grows costlier per token past ~256. */
    int32_t batch_tokens;  /**< CPU, kvz_ingest_docs with the shared prefix stored: short
                                documents (each passing the one_pass test) are scored several in
                                ONE forward pass of at most this many tokens (kvz_kvzip_score_batch;
                                default KVZ_KVZIP_BATCH_TOKENS; values above 1024 count as 1024;
                                0: one document per pass). Changes speed, not scores (up to
                                rounding). Not part of the blob's parameters. */
} kvz_kvzip_params;

void kvz_kvzip_defaults(kvz_kvzip_params *p);

/** Progress callback: @p done of @p total work units (tokens through the model). Nonzero aborts. */
typedef int (*kvz_progress_fn)(void *ctx, int64_t done, int64_t total);

/**
 * Tokens of the repeat input for chunk @p t (0-based) of @p ctx, appended to @p out:
 * the repeat instruction (+ the last @p overlap tokens of chunk t-1 when t > 0), the
 * assistant postfix, then the chunk's tokens.
 */
int kvz_kvzip_repeat_input(const kvz_tokenizer *tok, const int32_t *ctx, int32_t n_ctx,
                           int32_t t, const kvz_kvzip_params *p, kvz_tokens *out);

/**
 * Repeat passes of @p m's backend: pass i scores chunks [first[i], first[i+1]).
 * @p first: room for n_chunks + 1 entries (n_chunks = ceil(n_ctx / chunk)).
 * @p max_tokens (may be NULL): tokens of the longest pass.
 * @return the number of passes, or KVZ_ERR_ARG / a tokenizer error.
 */
int32_t kvz_kvzip_passes(const kvz_model *m, int32_t n_ctx, const kvz_kvzip_params *p, int32_t *first,
                         int64_t *max_tokens);

/** Rows the cache needs to prefill and score: n_prefix + n_ctx + the longest repeat pass
 *  (or a negative KVZ_ERR_*). */
int64_t kvz_kvzip_cache_rows(const kvz_model *m, int32_t n_prefix, int32_t n_ctx,
                             const kvz_kvzip_params *p);

/**
 * Prefill prefix+context into @p kv (which must be empty, without output buffer,
 * with at least kvz_kvzip_cache_rows() capacity) and score every context pair.
 * @p scores: (n_layer, n_kv_head, n_ctx) fp32, written completely; on a CUDA model it
 * may be NULL: the scores then stay on the device, where kvz_cuda_kvzip_select reads them.
 * On return the cache holds exactly the prefix + context (repeat KV discarded).
 * @return 0, kvz_forward errors, KVZ_ERR_ARG, KVZ_ERR_NOMEM, or the callback's nonzero value.
 */
int kvz_kvzip_score(kvz_model *m, kvz_kv *kv, const int32_t *prefix, int32_t n_prefix,
                    const int32_t *ctx, int32_t n_ctx, const kvz_kvzip_params *p, float *scores,
                    kvz_progress_fn progress, void *progress_ctx);

/**
 * kvz_kvzip_score when rows [0, @p n_cached) of the prefix are already in @p kv (a
 * stored prefix loaded into the cache; 0 <= n_cached <= n_prefix, and the cache holds
 * exactly those rows at positions 0..n_cached-1): prefills the rest of the prefix and
 * the context, and scores. On the CPU backend, a document of one chunk whose pass fits
 * p->one_pass tokens runs as one causal pass [prefix rows not cached ; context ; repeat input]
 * whose probe takes only the repeat queries (kvz_kv_probe.q_pos0); the repeat rows are
 * then dropped. Those queries attend to the same keys at the same positions as in the
 * separate repeat pass, so the scores are the same up to rounding: the context rows
 * come out of a larger batch (and a context of fewer than 16 tokens is computed with
 * fp32 activations instead of the int8 decode path, runtime/kvz_cpu.c).
 * Progress total: (n_prefix - n_cached) + n_ctx + Σ (chunk tokens + 32).
 * @return as kvz_kvzip_score (on error the cache content is unspecified).
 */
int kvz_kvzip_prefill_score(kvz_model *m, kvz_kv *kv, const int32_t *prefix, int32_t n_prefix,
                            int32_t n_cached, const int32_t *ctx, int32_t n_ctx,
                            const kvz_kvzip_params *p, float *scores, kvz_progress_fn progress,
                            void *progress_ctx);

/**
 * The scoring half of kvz_kvzip_score: @p kv already holds exactly the prefilled
 * prefix + context; runs the repeat passes (kvz_kvzip_passes) and fills @p scores.
 * Progress counts each chunk as its tokens + 32, starting at @p done0 of @p total.
 */
int kvz_kvzip_score_chunks(kvz_model *m, kvz_kv *kv, int32_t n_prefix, const int32_t *ctx, int32_t n_ctx,
                           const kvz_kvzip_params *p, float *scores, kvz_progress_fn progress,
                           void *progress_ctx, int64_t done0, int64_t total);

/**
 * Tokens document @p n_ctx's segment takes in a batched pass (kvz_kvzip_score_batch):
 * n_ctx + its repeat input; 0 when the document does not qualify (the CPU backend
 * only, one chunk, p->one_pass > 0 and the segment within p->one_pass and
 * p->prefill_chunk), or a negative KVZ_ERR_*.
 */
int32_t kvz_kvzip_batch_len(const kvz_model *m, int32_t n_ctx, const kvz_kvzip_params *p);

/**
 * Prefill and score @p n_doc short documents in ONE forward pass (CPU backend): the
 * segments [ctx_i ; repeat input of ctx_i] one after another, each at positions
 * n_prefix.. (kvz_kv_set_segments: each attends to the prefix rows and causally to its
 * own rows only), each scoring its own context from its repeat queries. The scores
 * are those of kvz_kvzip_prefill_score with a cached prefix, up to rounding.
 * @p kv must hold exactly the @p n_prefix prefix rows (positions 0..n_prefix-1, every
 * head), no output buffer, room for Σ kvz_kvzip_batch_len rows more; every document
 * must qualify (kvz_kvzip_batch_len > 0) and Σ kvz_kvzip_batch_len <= 1024.
 * @p scores[i]: (n_layer, n_kv_head, n_ctx[i]) fp32, written completely.
 * On return the cache holds the prefix rows, then the segments' rows: document i's
 * context rows at [n_prefix + row0[i], + n_ctx[i]) of every head, at positions
 * n_prefix..n_prefix+n_ctx[i]-1 (@p row0: (n_doc), filled); its repeat rows follow
 * them. On error the cache content is unspecified.
 * @return 0, KVZ_ERR_ARG, KVZ_ERR_NOMEM, kvz_forward errors.
 */
int kvz_kvzip_score_batch(kvz_model *m, kvz_kv *kv, int32_t n_prefix, const int32_t *const *ctx,
                          const int32_t *n_ctx, int32_t n_doc, const kvz_kvzip_params *p,
                          float *const *scores, int64_t *row0);

/**
 * Select the pairs to keep. @p keep: (n_layer, n_kv_head, n_ctx) bytes set to 0/1;
 * @p counts: (n_layer, n_kv_head) kept context tokens per head (may be NULL).
 * @return number of kept pairs (round(N·r) exactly), or KVZ_ERR_ARG / KVZ_ERR_NOMEM.
 */
int64_t kvz_kvzip_select(const float *scores, int32_t n_layer, int32_t n_kv_head, int32_t n_ctx,
                         float ratio, int32_t mode, uint8_t *keep, uint32_t *counts);

#ifdef __cplusplus
}
#endif
#endif
