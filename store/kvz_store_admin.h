/**
 * @file kvz_store_admin.h
 * @brief Store-level operations the tools share: one document's full description,
 *        store totals, gc with optional compaction, the parts of a split id, and
 *        the names and formats their reports use (kvzip-store, kvz_store_report.h).
 *
 * Nothing prints or exits: every call returns 0 or a negative KVZ_ERR_* with the
 * detail in kvz_error_detail(), as the rest of the store module. Thread safety as
 * kvz_store.h (a handle may be shared; each call uses its own read transaction).
 */
#ifndef KVZ_STORE_ADMIN_H
#define KVZ_STORE_ADMIN_H

#include <stdint.h>

#include "kvz_blob.h"
#include "kvz_store.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Which step of kvz_store_doc_detail_get() failed (its d->failed). */
enum {
    KVZ_DETAIL_READ = 1, /**< beginning the read transaction */
    KVZ_DETAIL_DOC,      /**< the document's entry (KVZ_ERR_NOTFOUND: no such id) */
    KVZ_DETAIL_META,     /**< its blob's META record (read or decode) */
    KVZ_DETAIL_LAYER,    /**< LAYER record d->failed_layer */
};

/** Everything about one stored document, read in one snapshot. */
typedef struct kvz_store_doc_detail {
    kvz_store_doc_info info;  /**< the doc entry */
    kvz_blob_meta meta;       /**< its blob's decoded META (counts owned: kvz_store_doc_detail_free) */
    uint64_t meta_bytes;      /**< bytes of the META record */
    uint64_t *rec_bytes;      /**< n_layer: stored (compressed) bytes of each LAYER record */
    uint64_t *raw_bytes;      /**< n_layer: uncompressed payload bytes of each layer */
    uint64_t pairs_kept;      /**< kept (token, head) pairs over all layers, prefix included */
    uint64_t context_pairs;   /**< n_layer * n_kv_head * n_context */
    uint64_t context_pairs_kept; /**< pairs_kept without the prefix rows (policy KEEP) */
    uint32_t kept_min, kept_max; /**< fewest / most pairs one (layer, head) kept */
    uint64_t bytes_raw;       /**< sum of raw_bytes */
    uint64_t bytes_records;   /**< META + every LAYER record */
    int failed;               /**< on error: KVZ_DETAIL_* step that failed; 0 on success */
    uint32_t failed_layer;    /**< with KVZ_DETAIL_LAYER */
} kvz_store_doc_detail;

/**
 * Read document @p id's entry, META and every LAYER record (checksums verified by
 * the store reads; each record's size taken) inside one read transaction, and
 * derive the kept-pair figures. @p d is zeroed first; release with
 * kvz_store_doc_detail_free(), also after an error.
 * @return 0; KVZ_ERR_NOTFOUND (no such id: d->failed == KVZ_DETAIL_DOC); the
 *         store's read errors (KVZ_ERR_CHECKSUM, KVZ_ERR_FORMAT, KVZ_ERR_LMDB, ...)
 *         with d->failed naming the step; KVZ_ERR_NOMEM.
 */
int kvz_store_doc_detail_get(kvz_store *s, const char *id, kvz_store_doc_detail *d);

/** Free what kvz_store_doc_detail_get() allocated. NULL-safe, idempotent. */
void kvz_store_doc_detail_free(kvz_store_doc_detail *d);

/** Store totals: kvz_store_stats plus sums over every doc entry. */
typedef struct kvz_store_summary {
    kvz_store_stats st;        /**< kvz_store_stats_get() */
    uint64_t tokens;           /**< sum of n_tokens */
    uint64_t bytes_kv_full;    /**< sum of bytes_kv_full (per document, before sharing) */
    uint64_t bytes_kv_kept;    /**< sum of bytes_kv_kept */
    uint64_t bytes_stored_docs; /**< sum of bytes_stored */
    uint64_t file_bytes;       /**< size of DIR/data.mdb (0 when it cannot be stat'ed) */
} kvz_store_summary;

/** Fill @p out for store @p s opened from folder @p dir (two read transactions: the
 *  counts, then the doc walk). @return 0; KVZ_ERR_LMDB / KVZ_ERR_FORMAT / ... */
int kvz_store_summary_get(kvz_store *s, const char *dir, kvz_store_summary *out);

/** kvz_store_gc_compact() output. */
typedef struct kvz_store_gc_compact_result {
    kvz_store_gc_result gc;    /**< kvz_store_gc() */
    int gc_done;               /**< 1 once the gc committed (an error after it is the compaction's) */
    int compacted;             /**< 1 when the store was compacted (the handle is then retired) */
    uint64_t file_bytes_before, file_bytes_after; /**< data.mdb sizes around the compaction */
} kvz_store_gc_compact_result;

/**
 * kvz_store_gc(), then with @p compact kvz_store_compact(). After a compaction @p s
 * is retired (writes fail with KVZ_ERR_BUSY): close it and reopen.
 * @return 0, or the failing step's code (r->gc_done says which step failed; a
 *         failed compaction leaves the store as the gc left it).
 */
int kvz_store_gc_compact(kvz_store *s, int compact, kvz_store_gc_compact_result *r);

/**
 * How many parts of a split document are stored under @p id: N when ID#1..ID#N all
 * exist (kvz_ingest_document's part ids), 0 when ID#1 does not. Read errors end the
 * count. Used to say "stored in parts" when @p id itself is not found.
 */
uint32_t kvz_store_count_parts(kvz_store *s, const char *id);

/** Size in bytes of @p dir/data.mdb, 0 when it cannot be stat'ed. */
uint64_t kvz_store_file_bytes(const char *dir);

/** Lower-case hex of a 16-byte hash or fingerprint. */
void kvz_store_hex16(const uint8_t b[16], char out[33]);

/** "YYYY-MM-DD HH:MM:SS" (UTC) of unix time @p t; "?" when out of range. */
void kvz_store_fmt_date(int64_t t, char out[32]);

/** "global" / "uniform" / "?" for a kvz_blob_mode. */
const char *kvz_store_mode_name(uint8_t mode);

/** "keep" / "shared" / "none" for a kvz_blob_prefix policy. */
const char *kvz_store_prefix_name(uint8_t policy);

/** Name of a stored KV dtype (f32, f16, bf16, q8, q4), "?" when unknown. */
const char *kvz_store_dtype_name(uint8_t dtype);

/** a / b, 0 when b is 0 (compression figures of an empty store). */
static inline double kvz_store_ratio(uint64_t a, uint64_t b) { return b ? (double)a / (double)b : 0.0; }

#ifdef __cplusplus
}
#endif
#endif /* KVZ_STORE_ADMIN_H */
