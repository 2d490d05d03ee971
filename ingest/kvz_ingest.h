/**
 * @file kvz_ingest.h
 * @brief The document pipeline: tokens -> KVzip scores -> eviction -> blob
 *        records -> one LMDB transaction; and the reverse, a stored blob -> a KV
 *        cache ready for questions. Composes runtime/, format/ and store/.
 */
#ifndef KVZ_INGEST_H
#define KVZ_INGEST_H

#include <stdint.h>

#include "kvz_blob.h"
#include "kvz_kvzip.h"
#include "kvz_model.h"
#include "kvz_store.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvz_ingest_opts {
    kvz_kvzip_params kp;   /**< ratio, mode, chunk, overlap */
    uint8_t dtype;         /**< stored KV dtype (common/kvz_kvdtype.h): KVZ_DTYPE_Q8 (default:
                                costs <= 0.01 nats vs f16, docs/EVAL.md), F16, BF16, F32, Q4 */
    int zstd_level;        /**< 0 = KVZ_BLOB_DEFAULT_LEVEL */
    kvz_progress_fn progress; /**< tokens through the model for this document */
    void *progress_ctx;
    uint32_t part;         /**< recorded in the doc entry (kvz_store_doc_info.part): N when
                                storing part N of a split document (kvz_ingest_document sets
                                it), 0 for a whole document (default) */
} kvz_ingest_opts;

void kvz_ingest_defaults(kvz_ingest_opts *o);

typedef struct kvz_ingest_result {
    int status;             /**< KVZ_STORE_WRITTEN / LINKED / UNCHANGED / INFO_UPDATED */
    int32_t n_prefix, n_ctx;
    int64_t pairs_total;    /**< context pairs: n_layer * n_kv_head * n_ctx */
    int64_t pairs_kept;     /**< kept context pairs */
    uint64_t bytes_full;    /**< uncompressed KV of the full cache (prefix + context), stored dtype */
    uint64_t bytes_kept;    /**< uncompressed KV of the kept pairs (prefix included) */
    uint64_t bytes_stored;  /**< compressed record bytes in the store */
    double seconds;         /**< scoring + eviction + encoding + commit */
    uint8_t hash[16];
} kvz_ingest_result;

/** Context tokens one stored document (or part) may hold with model @p m: room is
 *  left for the repeat pass and for questions and answers within the model context. */
int32_t kvz_ingest_max_part_tokens(const kvz_model *m);

/**
 * Ingest one document (or part) whose context tokens are @p ctx.
 * Unchanged content under the same @p doc_id is a no-op (status UNCHANGED, no
 * model work); content already stored under another id is linked, not recomputed.
 * Everything the store sees is written in one transaction.
 * @return 0; KVZ_ERR_CONTEXT (n_ctx > kvz_ingest_max_part_tokens); KVZ_ERR_EMPTY;
 *   kvz_forward / kvz_kvzip / kvz_blob / kvz_store errors; the progress callback's value.
 */
int kvz_ingest_doc(kvz_model *m, kvz_store *st, const char *doc_id, const char *source_path,
                   const int32_t *ctx, int32_t n_ctx, const kvz_ingest_opts *o,
                   kvz_ingest_result *res);

/** One document (or part) of a kvz_ingest_docs() call. */
typedef struct kvz_ingest_item {
    const char *doc_id;        /**< as kvz_ingest_doc */
    const char *source_path;   /**< as kvz_ingest_doc (may be NULL) */
    const int32_t *ctx;        /**< (n_ctx) context tokens, borrowed for the call */
    int32_t n_ctx;
    uint32_t part;             /**< as kvz_ingest_opts.part (0: a whole document) */
} kvz_ingest_item;

/** Outcome of item @p i (in item order): @p rc 0 or its KVZ_ERR_* (kvz_error_detail()
 *  holds its text during the call), @p res as kvz_ingest_doc fills it. Nonzero stops the
 *  call: the later items are left untouched (not reported). */
typedef int (*kvz_ingest_item_fn)(void *ctx, int32_t i, int rc, const kvz_ingest_result *res);

/**
 * kvz_ingest_doc() for @p n documents, in order, with the same results, but short ones
 * computed several per forward pass on the CPU backend: consecutive documents that
 * qualify (the shared system prefix already stored, a one-chunk document whose
 * [context ; repeat input] fits kvz_kvzip_params.one_pass) are packed into passes of at
 * most o->kp.batch_tokens tokens (kvz_kvzip_score_batch: each document sees the prefix
 * and itself only, at the positions it has alone), then each is selected, encoded and
 * committed in ONE store transaction of its own, exactly as kvz_ingest_doc() stores it
 * (a kill leaves every committed document whole and no partial one). A document that
 * does not qualify (the first of a new store, which stores the prefix; a long one; the
 * CUDA backend; batch_tokens 0) goes alone through kvz_ingest_doc's path. A failure is
 * the document's own: if a batched pass fails, each of its documents is computed alone.
 * A content repeated within the call is linked to its first copy, as one call per
 * document would. o->progress is called once per batched document (done = total).
 * @return the number of items reported through @p done (n unless it stopped the call).
 */
int32_t kvz_ingest_docs(kvz_model *m, kvz_store *st, const kvz_ingest_item *items, int32_t n,
                        const kvz_ingest_opts *o, kvz_ingest_item_fn done, void *done_ctx);

/**
 * The META of a document blob made with @p o (canonical parameters, policy KEEP;
 * the caller switches to SHARED and sets prefix_ref). One home for both ingest
 * paths (kvz_ingest_doc and the GPU pipeline): these fields feed the content hash,
 * so a second copy that drifted would silently defeat "unchanged" detection.
 * @param counts  (n_layer * n_kv_head) kept rows per head, borrowed by @p bm.
 */
void kvz_ingest_blob_meta(const kvz_model *m, const kvz_ingest_opts *o, int32_t n_prefix,
                          int32_t n_ctx, uint32_t *counts, kvz_blob_meta *bm);

/** The shared prefix blob's META for document META @p doc (docs/FORMAT.md §3.1):
 *  n_context 0, policy KEEP, ratio 1, every head holding n_prefix rows (written to
 *  @p counts, (n_layer * n_kv_head), borrowed by @p pm). */
void kvz_ingest_prefix_meta(const kvz_blob_meta *doc, uint32_t *counts, kvz_blob_meta *pm);

/** What kvz_doc_load() read. */
typedef struct kvz_doc_meta {
    kvz_store_doc_info info;
    int32_t n_prefix, n_ctx;   /**< queries continue at position n_prefix + n_ctx */
    float ratio;
    uint8_t dtype, mode;
    uint64_t rows;             /**< kept rows over all layers and heads (prefix included) */
    double load_s;             /**< read + verify + decompress + place */
} kvz_doc_meta;

/**
 * Load @p doc_id's compressed cache into a new kvz_kv with @p extra_rows free rows
 * per head (for question and answer tokens when @p out_slots is 0) and a LongFlow
 * output buffer of @p out_slots slots (0 = none). Verifies the checksums and that
 * the blob was made by model @p m.
 * @return 0; KVZ_ERR_NOTFOUND (unknown doc id); KVZ_ERR_MODEL; KVZ_ERR_CHECKSUM /
 *   KVZ_ERR_FORMAT / KVZ_ERR_TRUNCATED / KVZ_ERR_VERSION (corrupt blob);
 *   KVZ_ERR_FORMAT (dims differ from the model); KVZ_ERR_NOMEM; KVZ_ERR_LMDB.
 */
int kvz_doc_load(kvz_model *m, kvz_store *st, const char *doc_id, int64_t extra_rows,
                 int32_t out_slots, kvz_kv **out, kvz_doc_meta *meta);

#ifdef __cplusplus
}
#endif
#endif
