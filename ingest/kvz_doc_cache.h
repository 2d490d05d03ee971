/**
 * @file kvz_doc_cache.h
 * @brief A per-process cache of loaded documents: a second question on the same
 *        document pays no load.
 *
 * Entries are KV caches as kvz_load_doc() returns them (device memory on the CUDA
 * backend, host memory on the CPU), kept under a byte budget with least-recently-used
 * eviction. A caller borrows an entry with kvz_doc_cache_get(), asks its question(s)
 * (kvz_generate etc.; the cache is checkpointed at the document, so generation only
 * adds question/answer rows), and gives it back with kvz_doc_cache_put(), which rolls
 * it back to the document. A borrowed entry is never evicted or lent twice: a second
 * borrower of the same document gets its own copy (loaded from the store).
 *
 * Freshness: every get looks the id up in the store (one read transaction); an entry
 * whose content hash is no longer the id's (re-ingested, deleted) is not used.
 * Entries are keyed by (doc id, content hash, extra_rows, out_slots).
 *
 * Thread safety: all functions may be called from several threads; loads are
 * serialised (one load per model at a time, see kvz_load.h), and each borrowed
 * kvz_kv is used by one thread at a time, as every kvz_kv. Nothing prints.
 */
#ifndef KVZ_DOC_CACHE_H
#define KVZ_DOC_CACHE_H

#include <stdint.h>

#include "kvz_load.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvz_doc_cache kvz_doc_cache;

typedef struct kvz_doc_cache_stats {
    uint64_t hits, misses, evictions;
    uint64_t bytes;   /**< bytes held by entries (kvz_kv_stats.bytes_alloc) */
    uint32_t entries; /**< entries held (borrowed ones included) */
} kvz_doc_cache_stats;

/** A cache for model @p m holding up to @p budget_bytes of entries (0: nothing is
 *  kept after put, i.e. every get loads). @p lo: loader options (NULL: defaults).
 *  KVZ_ERR_NOMEM. */
int kvz_doc_cache_create(kvz_model *m, uint64_t budget_bytes, const kvz_load_opts *lo, kvz_doc_cache **out);

/** Free the cache and its entries; every borrowed entry must have been put back.
 *  NULL-safe. */
void kvz_doc_cache_free(kvz_doc_cache *c);

/**
 * Borrow document @p doc_id of store @p st, loaded with @p extra_rows / @p out_slots as
 * kvz_load_doc() takes them. @p meta is the load's metadata (load_s is the time of the
 * original load). @p hit (may be NULL) is set to 1 when no load was needed.
 * @return 0 or kvz_load_doc()'s errors (KVZ_ERR_NOTFOUND for an unknown id).
 */
int kvz_doc_cache_get(kvz_doc_cache *c, kvz_store *st, const char *doc_id, int64_t extra_rows,
                      int32_t out_slots, kvz_kv **kv, kvz_doc_meta *meta, int *hit);

/** Give back a cache that kvz_doc_cache_get() lent: rolled back to the document and
 *  kept, or freed when the budget cannot hold it. A kv this cache did not lend is
 *  left alone (KVZ_ERR_ARG). */
int kvz_doc_cache_put(kvz_doc_cache *c, kvz_kv *kv);

/** Drop every entry that is not borrowed. */
void kvz_doc_cache_clear(kvz_doc_cache *c);

void kvz_doc_cache_get_stats(kvz_doc_cache *c, kvz_doc_cache_stats *st);

#ifdef __cplusplus
}
#endif
#endif
