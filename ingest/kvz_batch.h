/**
 * @file kvz_batch.h
 * @brief Many documents into one store: the ID#N part policy (kvz_parts.h)
 *        over the ingest pipeline (kvz_pipeline.h), with every part's outcome
 *        reported and the run's figures counted.
 *
 * Per document: kvz_ingest_parts_check before its first part is submitted
 * (nothing is computed when one of its ids belongs to another document), each
 * part's number recorded in its entry, kvz_ingest_parts_prune once every part
 * is committed (what an older, longer version left behind). A failed part stops
 * its document: earlier parts stay, nothing is pruned. On the CUDA backend the
 * GPU scores the next part while the last ones are encoded and committed; on
 * the CPU submits are queued and computed several short documents per pass.
 *
 * Library code: nothing prints; outcomes reach the caller through
 * kvz_batch_fn, in submission order. One thread drives a batch, and every
 * callback runs on it, inside kvz_batch_add / kvz_batch_drain / kvz_batch_close
 * (the pipeline's done callbacks run on the submitting thread).
 */
#ifndef KVZ_BATCH_H
#define KVZ_BATCH_H

#include <stdint.h>

#include "kvz_corpus.h"
#include "kvz_ingest.h"
#include "kvz_store.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The figures of a batch. Only computed caches (written) have KV figures: a
 *  linked or unchanged document shares records stored earlier. */
typedef struct kvz_batch_stats {
    int32_t parts;            /**< parts stored, linked or unchanged */
    int32_t written, linked, unchanged;
    int32_t failed;           /**< documents that failed: before submitting, in the pipeline,
                               *   in their prune, or because the pipeline did not start */
    int64_t tokens;           /**< context tokens of every part submitted */
    int64_t tokens_written;   /**< context tokens of the written parts */
    int64_t pairs_total, pairs_kept;
    uint64_t bytes_full, bytes_kept, bytes_stored;
    double seconds;           /**< from kvz_batch_open to the end of kvz_batch_close */
} kvz_batch_stats;

typedef enum kvz_batch_what {
    KVZ_BATCH_PART = 1,       /**< one part's outcome: id, rc (0: res and status set) */
    KVZ_BATCH_NOT_TRIED,      /**< a part not attempted: the store had stopped taking
                               *   documents (the reason was reported once) */
    KVZ_BATCH_DOC_FAILED,     /**< a document failed before its parts were submitted, or in
                               *   its prune: id, rc */
    KVZ_BATCH_NOT_STARTED,    /**< the pipeline did not start: rc (nothing is ingested) */
} kvz_batch_what;

/** One report; pointers valid during the call. With rc != 0, kvz_error_detail()
 *  holds its one-line detail during the call. */
typedef struct kvz_batch_event {
    kvz_batch_what what;
    const char *id;           /**< the part's id ("ID" or "ID#N"), or the document's */
    int rc;
    const kvz_ingest_result *res;  /**< PART with rc 0 */
    const char *status;       /**< PART with rc 0: "ingested" (computed), "linked" or "unchanged" */
} kvz_batch_event;

typedef void (*kvz_batch_fn)(void *user, const kvz_batch_event *ev);
/** Progress: @p done of @p total tokens (both passes, the whole batch) after @p seconds
 *  (since the pipeline started), working on part @p id. */
typedef void (*kvz_batch_progress_fn)(void *user, const char *id, int64_t done, int64_t total, double seconds);

typedef struct kvz_batch_opts {
    kvz_ingest_opts ingest;     /**< kvz_ingest_defaults, then the caller's settings; its
                                 *   progress hook is the batch's own */
    const char *store_path;     /**< store folder, created when missing */
    uint64_t max_map;           /**< cap on the store's map (0: the store's default) */
    int32_t part_tokens;        /**< split longer documents (0 or above the model's limit: that) */
    int64_t total_tokens;       /**< for progress (kvz_corpus_tokenize's total); 0: unknown */
    kvz_batch_fn report;        /**< may be NULL */
    kvz_batch_progress_fn progress;  /**< may be NULL */
    void *user;
} kvz_batch_opts;

typedef struct kvz_batch kvz_batch;

/** Tokens per part for model @p m: its limit, or @p part_tokens when lower (and > 0). */
int32_t kvz_batch_max_part(const kvz_model *m, int32_t part_tokens);

/** 1 when after error @p rc the store cannot take more documents (full, LMDB
 *  error, another model's store, busy): the caller stops the run. */
int kvz_batch_store_stops(int rc);

/**
 * Open (create) the store @p o->store_path for model @p m and start the
 * pipeline. A pipeline that does not start is reported (NOT_STARTED, counted
 * as failed) and leaves a batch that ingests nothing.
 * @return 0 and *out; the kvz_store_open error (store missing and not
 *         creatable, corrupt, another model's, ...; *out NULL); KVZ_ERR_NOMEM.
 */
int kvz_batch_open(kvz_model *m, const kvz_batch_opts *o, kvz_batch **out);

/**
 * Ingest one document (tokens @p t, copied) with the part policy: its parts are
 * submitted; their outcomes come later through the report callback.
 * @return 0; the error found before anything was submitted (reported as
 *         DOC_FAILED and counted): KVZ_ERR_EMPTY, a kvz_ingest_parts_check error.
 *         After kvz_batch_stopped nothing is submitted (returns 0).
 */
int kvz_batch_add(kvz_batch *b, const char *id, const char *path, const kvz_tokens *t);

/** Every usable document of @p c, document i with tokens toks[i]; stops at an error
 *  after which the store cannot take more (kvz_batch_store_stops). Returns 0 or it. */
int kvz_batch_add_corpus(kvz_batch *b, const kvz_corpus *c, const kvz_tokens *toks);

/** Compute what is queued now (see kvz_pipeline_drain). */
int kvz_batch_drain(kvz_batch *b);

/** 1 when the pipeline has stopped taking documents (a store-wide error). */
int kvz_batch_stopped(const kvz_batch *b);

/** The store the batch writes (owned by the batch). */
kvz_store *kvz_batch_store(kvz_batch *b);

/**
 * A read corpus into one store, in this process: tokenize every usable
 * document of @p c with @p m (kvz_corpus_tokenize: its reports go to c's
 * callback, o->total_tokens is set from it), then, when no id collides and some
 * document is left, open the store (kvz_batch_open), add them all
 * (kvz_batch_add_corpus) and close it.
 * @param ran    out: 1 when the store was opened and the documents submitted
 *               (*stats then holds the run's figures), else 0 (*stats zero).
 * @return 0; the kvz_store_open error (*ran 0); KVZ_ERR_NOMEM.
 */
int kvz_batch_run(kvz_model *m, kvz_corpus *c, const kvz_batch_opts *o, kvz_batch_stats *stats, int *ran);

/** Wait for the last commits (and their prunes), close the store, fill *stats
 *  (may be NULL) and free the batch. NULL is a no-op that zeroes *stats. */
void kvz_batch_close(kvz_batch *b, kvz_batch_stats *stats);

#ifdef __cplusplus
}
#endif
#endif
