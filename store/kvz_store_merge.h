/**
 * @file kvz_store_merge.h
 * @brief Merge kvzip stores (e.g. the per-shard stores of a sharded ingest) into one.
 *
 * kvz_store_merge(SRC..., DST):
 *   1. Opens every source read-only. Refuses (nothing written): a source that is
 *      DST itself or listed twice (KVZ_ERR_ARG); sources of different model
 *      fingerprints, or DST of another model (KVZ_ERR_MODEL).
 *   2. Plans: every document id of every source. An id in two sources with
 *      different content hashes is a conflict. Without prefer_newest any
 *      conflict stops the merge before anything is written (res->refused); with
 *      it the entry with the newest ingest_time wins (on a tie, the source named
 *      last). Sources recording different corpus listings (kvzip-ingest --shard
 *      writes meta "corpus") are reported and also stop the merge unless
 *      allow_mixed_corpus.
 *   3. Copies, one LMDB write transaction per document (kvz_store_put_doc):
 *      a content hash already in DST is linked, not copied; otherwise the
 *      source blob is read and fully decoded first (record checksums, zstd,
 *      payload checksums, the model fingerprint), and copied only when that
 *      succeeds (a blob that does not verify is reported and skipped). The
 *      doc info (ingest time, source path, sizes) is copied as it is; a blob
 *      with a shared system prefix (blob v2, policy SHARED) brings the prefix
 *      blob's records in the same transaction when DST lacks them. An id
 *      already in DST with other content is replaced by the source's (DST is
 *      taken as older state).
 * Kill -9 at any moment leaves DST with every document either fully merged or
 * not at all (one transaction per document); running the merge again completes
 * it. A second identical merge writes nothing (every document UNCHANGED).
 *
 * Nothing prints: problems and conflicts go through the callback.
 */
#ifndef KVZ_STORE_MERGE_H
#define KVZ_STORE_MERGE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Metadata key kvzip-ingest --shard writes: "<16 hex corpus hash> <n ids>". */
#define KVZ_META_CORPUS "corpus"
/** Metadata key kvzip-ingest --shard writes: "I/N". */
#define KVZ_META_SHARD "shard"

typedef struct kvz_merge_opts {
    int prefer_newest;       /**< resolve conflicts by newest ingest_time */
    int allow_mixed_corpus;  /**< merge sources made from different corpus listings */
} kvz_merge_opts;

/** What happened; res of kvz_store_merge(). */
typedef struct kvz_merge_result {
    uint64_t n_docs;       /**< distinct document ids over all sources */
    uint64_t copied;       /**< documents whose blob was copied into DST */
    uint64_t linked;       /**< documents linked to a blob DST already had */
    uint64_t unchanged;    /**< already in DST with that content and info: nothing written */
    uint64_t replaced;     /**< DST had the id with other content: replaced */
    uint64_t bad;          /**< source blobs that did not verify: skipped */
    uint64_t conflicts;    /**< ids with different content in two sources */
    uint64_t bytes_copied; /**< record bytes copied */
    int mixed_corpus;      /**< sources recorded different corpus listings */
    int refused;           /**< conflicts or mixed corpus stopped the merge: DST untouched */
} kvz_merge_result;

/** Report kinds for the callback. */
enum {
    KVZ_MERGE_CONFLICT = 1, /**< same id, different content in two sources */
    KVZ_MERGE_RESOLVED,     /**< a conflict resolved by prefer_newest */
    KVZ_MERGE_BAD_BLOB,     /**< a source blob failed verification: document skipped */
    KVZ_MERGE_CORPUS,       /**< sources made from different corpus listings */
    KVZ_MERGE_DOC,          /**< one document merged (msg: "copied|linked|unchanged|replaced ID") */
};

/** @p msg is one line without newline, valid during the call. Return nonzero to stop. */
typedef int (*kvz_merge_report_fn)(void *user, int kind, const char *msg);

/**
 * Merge @p n_src stores into @p dst (created when missing).
 * @return 0 (also when refused: see res->refused, or when blobs were skipped:
 *         res->bad); KVZ_ERR_ARG (no sources, DST among the sources, a source
 *         twice); KVZ_ERR_NOTFOUND (a source store missing); KVZ_ERR_MODEL;
 *         store errors (KVZ_ERR_FULL, KVZ_ERR_LMDB, ...) — documents merged
 *         before the error stay merged; KVZ_ERR_NOMEM.
 */
int kvz_store_merge(const char *const *src, size_t n_src, const char *dst,
                    const kvz_merge_opts *opts, kvz_merge_report_fn cb, void *user,
                    kvz_merge_result *res);

#ifdef __cplusplus
}
#endif
#endif
