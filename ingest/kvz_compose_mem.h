/**
 * @file kvz_compose_mem.h
 * @brief Compose in-memory document caches (the evaluation's entry point to kvz_compose).
 *
 * kvz_docs_load() composes stored documents; kvz_docs_compose_mem() does the same
 * with documents held in memory as fp32 rows (an evaluation scores each document
 * once and selects at several ratios without a store). The rules are kvz_compose.h's:
 * the system prefix rows once, from the first document; then every document's kept
 * context rows per (layer, KV head) in the order given; placement sequential (keys
 * re-rotated by Δ_i with kvz_rope_shift, Δ_i = the earlier documents' context tokens)
 * or parallel (ingest positions kept); auto = sequential when the span plus
 * opts->reserve fits the model context; key_scale and shift_bias as there.
 */
#ifndef KVZ_COMPOSE_MEM_H
#define KVZ_COMPOSE_MEM_H

#include <stdint.h>

#include "kvz_compose.h"

#ifdef __cplusplus
extern "C" {
#endif

/** One document in memory: the prefilled cache of [prefix][context]. */
typedef struct kvz_compose_src {
    const float *k, *v;   /**< (n_layer, n_kv_head, n_prefix + n_ctx, head_dim) fp32; row j is
                               position j (post-RoPE keys, as the cache holds them) */
    const uint8_t *keep;  /**< (n_layer, n_kv_head, n_ctx) 0/1: context rows kept; NULL = all */
    int32_t n_prefix, n_ctx;
} kvz_compose_src;

/**
 * Compose @p src[0..n) into a new kvz_kv with @p extra_rows free rows per head and
 * @p out_slots LongFlow output slots, checkpointed (kvz_kv_rollback returns to the
 * composed documents). meta as kvz_docs_load (ratio_min/max: the
 * kept fraction of the documents' context rows; load_s: the composition time).
 * @return 0; KVZ_ERR_ARG (n < 1 or > KVZ_COMPOSE_MAX_DOCS, a NULL source, documents
 *   with different prefix lengths, bad placement); KVZ_ERR_CONTEXT (positions past
 *   2^30); KVZ_ERR_NOMEM; kvz_kv_create / kvz_kv_set_layer errors.
 */
int kvz_docs_compose_mem(kvz_model *m, const kvz_compose_src *src, int32_t n,
                         const kvz_compose_opts *o, int64_t extra_rows, int32_t out_slots,
                         kvz_kv **out, kvz_compose_meta *meta);

#ifdef __cplusplus
}
#endif
#endif
