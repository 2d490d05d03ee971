/**
 * @file kvz_load.h
 * @brief The pipelined loader: a stored document's compressed cache -> a KV cache
 *        ready for questions, at memory speed.
 *
 * Same result as kvz_doc_load() (ingest/kvz_ingest.h), other route:
 *   - records are read in place from the LMDB map (no copy into a heap buffer) and
 *     verified + decompressed by a small thread pool, one layer per task, each
 *     worker in its own read transaction;
 *   - CPU backend: each worker converts its layer to fp32 and places it in the cache
 *     (layers are independent);
 *   - CUDA backend: workers decompress straight into pinned staging slots; the
 *     calling thread uploads layer l (cudaMemcpyAsync on the model's stream) while
 *     the workers decompress l+1, l+2, ..., and one kernel per layer converts the
 *     stored rows (f32/f16/bf16/q8/q4, common/kvz_kvdtype.h) into the bf16 cache.
 *     The host never converts a value.
 * Errors are those of kvz_doc_load(); the first failing layer's error wins and
 * nothing is returned (no partial cache).
 * Thread safety: the model is used by the calling thread only (as kvz_forward);
 * one load per model at a time (the pinned slots belong to the model).
 */
#ifndef KVZ_LOAD_H
#define KVZ_LOAD_H

#include <stdint.h>

#include "kvz_ingest.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvz_load_opts {
    int threads; /**< decode workers; 0 = the online cores, at most 16 */
} kvz_load_opts;

/** Workers used by @p o (resolves 0). */
int kvz_load_threads(const kvz_load_opts *o);

/**
 * Load @p doc_id as kvz_doc_load() does (same arguments, results and errors),
 * pipelined as described above. @p o may be NULL (defaults).
 */
int kvz_load_doc(kvz_model *m, kvz_store *st, const char *doc_id, int64_t extra_rows, int32_t out_slots,
                 const kvz_load_opts *o, kvz_kv **out, kvz_doc_meta *meta);

#ifdef __cplusplus
}
#endif
#endif
