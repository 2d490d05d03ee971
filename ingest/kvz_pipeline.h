/**
 * @file kvz_pipeline.h
 * @brief Overlapped corpus ingest: the GPU scores document k+1 while document k's
 *        kept rows are compressed on a thread pool and committed by a writer thread.
 *
 * Per document (kvz_pipeline_submit, on the calling thread): content hash and the
 * "already stored" check as kvz_ingest_doc(); then, on the CUDA backend, prefill +
 * KVzip scoring + device top-k + compaction, and the kept rows converted on the GPU to
 * the stored dtype and copied into a pinned buffer of the pipeline (at most
 * KVZ_PIPELINE_DEPTH documents in flight; submit waits for a free one). The record
 * encoding (one task per record, zstd or none, checksums) runs on the worker threads,
 * and a writer thread commits each document in ONE store transaction, in submission
 * order: a kill -9 leaves every committed document intact and no partial one, exactly
 * as kvz_ingest_doc() does. The blobs are the ones kvz_ingest_doc() writes (same
 * content hash): with a system prefix, the document blob holds the context rows
 * (policy SHARED) and the prefix blob's records go into the same transaction
 * (kvz_store_put_doc_shared) when the store does not hold them yet; the model still
 * prefills the prefix itself.
 * On the CPU backend (the model already uses every core) a submit queues the document;
 * once the queue holds about two passes' worth of short documents (2 x
 * kvz_kvzip_params.batch_tokens), and at drain / free, it is computed by
 * kvz_ingest_docs() (several short documents per forward pass, each committed in its
 * own transaction as kvz_ingest_doc() commits it) and reported through the same
 * callback, in order. A kill loses the queued documents, never part of one.
 *
 * Results: every submitted document gets exactly one call of the done callback, on
 * the thread calling kvz_pipeline_submit/kvz_pipeline_drain, in submission order.
 * After a store error that stops everything (KVZ_ERR_FULL, KVZ_ERR_MODEL,
 * KVZ_ERR_LMDB, KVZ_ERR_BUSY) no further document is committed: the ones still
 * queued or submitted later are reported with that error and res == NULL (not
 * attempted), and kvz_pipeline_failed() returns it.
 * Library code: nothing prints; the callback decides.
 */
#ifndef KVZ_PIPELINE_H
#define KVZ_PIPELINE_H

#include <stdint.h>

#include "kvz_ingest.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVZ_PIPELINE_DEPTH 3 /**< documents between the GPU and the store */

typedef struct kvz_pipeline kvz_pipeline;

/** One document done. @p rc 0 or KVZ_ERR_*; @p detail the error text ("" when ok);
 *  @p res as kvz_ingest_doc() fills it (seconds: submit to commit), NULL when the
 *  document was not attempted (the pipeline had stopped); @p user as submitted. */
typedef void (*kvz_pipeline_done_fn)(void *ctx, const char *doc_id, int rc, const char *detail,
                                     const kvz_ingest_result *res, void *user);

/**
 * A pipeline writing into @p st with model @p m and options @p o (copied; progress
 * callbacks run on the submitting thread). @p threads encode workers (0 = the online
 * cores less one, at least 1).
 * @return 0, KVZ_ERR_NOMEM.
 */
int kvz_pipeline_create(kvz_model *m, kvz_store *st, const kvz_ingest_opts *o, int threads,
                        kvz_pipeline_done_fn done, void *ctx, kvz_pipeline **out);

/**
 * Ingest one document (or part) whose context tokens are @p ctx (copied), as
 * kvz_ingest_doc() would, asynchronously. Delivers the completions that are ready.
 * @return 0 (the document's own outcome comes through the callback), or the error
 *   that stopped the pipeline (the document is then reported with it, not ingested).
 */
int kvz_pipeline_submit(kvz_pipeline *p, const char *doc_id, const char *source_path, const int32_t *ctx,
                        int32_t n_ctx, void *user);

/**
 * kvz_pipeline_submit() for part @p part of a split document (ingest/kvz_parts.h): the
 * doc entry records @p part as kvz_ingest_doc() records kvz_ingest_opts.part (0 = a
 * whole document). kvz_pipeline_submit() uses the part of the options given at create.
 * The part policy's checks and pruning stay the caller's (kvz_ingest_parts_check
 * before the first part, kvz_ingest_parts_prune once every part is committed).
 */
int kvz_pipeline_submit_part(kvz_pipeline *p, const char *doc_id, const char *source_path, const int32_t *ctx,
                             int32_t n_ctx, uint32_t part, void *user);

/** Wait until every submitted document is committed or failed, delivering completions.
 *  @return kvz_pipeline_failed(). */
int kvz_pipeline_drain(kvz_pipeline *p);

/** The store error that stopped the pipeline, or 0. */
int kvz_pipeline_failed(const kvz_pipeline *p);

/** Drain, stop the threads, free. NULL-safe. */
void kvz_pipeline_free(kvz_pipeline *p);

#ifdef __cplusplus
}
#endif
#endif
