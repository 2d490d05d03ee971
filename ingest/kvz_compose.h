/**
 * @file kvz_compose.h
 * @brief Several stored caches composed into one KV cache (multi-document questions).
 *
 * The documents are named by id; an id stored in parts (`ID#1`..`ID#n`, see
 * kvz_parts.h) means all of its parts in order, and `ID#N` names one part. The
 * system prefix rows are taken once, from the first document; every document's
 * context rows follow it, per (layer, KV head), in the order given.
 *
 * Placements (docs/MULTIDOC.md):
 *   - sequential: document i's context positions are moved behind document i-1's
 *     span: position p -> p + Δ_i, Δ_i = sum of the earlier documents' context
 *     tokens; keys are re-rotated by Δ_i (kvz_rope_shift), values unchanged.
 *     Questions start at n_prefix + sum n_ctx.
 *   - parallel: every document keeps its ingest positions (all start right after
 *     the prefix); questions start at n_prefix + max n_ctx.
 *   - auto: sequential when n_prefix + sum n_ctx + reserve fits the model's
 *     trained context (n_ctx from the GGUF), else parallel.
 *
 * Every record is read as the pipelined loader (kvz_load.h) reads it, by the same
 * routine (ingest/kvz_load_rec.h): a codec-none record copied with pread() from
 * data.mdb into place and hashed once, a zstd record copied + hashed into scratch and
 * decompressed into place, the LMDB map only as the fallback (or with map_only).
 * CPU backend: a pool of workers, one layer each; a worker decodes every source's
 * record of its layer once, straight into one staging buffer at its composed place,
 * and hands it to kvz_kv_set_layer: the same copies as loading one document (no
 * per-document cache that is then copied again).
 * CUDA backend: as the pipelined loader: host workers read each (layer, document)
 * record into a pinned slot, the slot is uploaded and converted on the device straight
 * into the composed rows of each head, and one kernel re-rotates the moved keys in HBM
 * at the end (kernels/kvz_rope_shift_cuda.h). Thread safety: one load per model at a
 * time (the pinned slots belong to the model).
 */
#ifndef KVZ_COMPOSE_H
#define KVZ_COMPOSE_H

#include <stdint.h>

#include "kvz_ingest.h"
#include "kvz_load.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { KVZ_PLACE_AUTO = 0, KVZ_PLACE_SEQUENTIAL = 1, KVZ_PLACE_PARALLEL = 2 };

/** Most documents (after expanding split ones) one composition takes. */
#define KVZ_COMPOSE_MAX_DOCS 256

typedef struct kvz_compose_opts {
    int32_t placement;   /**< KVZ_PLACE_* (default AUTO) */
    int32_t reserve;     /**< positions needed after the documents (question + answer); auto
                              compares n_prefix + sum n_ctx + reserve with the model context */
    float key_scale;     /**< multiplies every document (non-prefix) key: an APE-style
                              attention temperature 1/key_scale on document tokens; 0 = 1 = off */
    int32_t shift_bias;  /**< tests only: added to Δ_i of every document i >= 1 (0 normally) */
    int32_t host_path;   /**< tests/bench: on the CUDA backend, compose on the host as on the CPU
                              (fp32 re-rotation, kvz_kv_set_layer; one thread) instead of the device path */
    int32_t threads;     /**< record workers; 0 = kvz_load_threads()'s default (the online cores, at most 16) */
    int32_t map_only;    /**< 1: read every record through the LMDB map, checked and decoded by the
                              store's reader (kvz_load_opts.map_only: the route before copy reads;
                              for comparisons) */
    kvz_load_profile *profile; /**< NULL, or filled with where the time went (kvz_load_profile: worker
                              fields summed over the workers; convert_s = fp32 decode + re-rotation +
                              kvz_kv_set_layer on the host route; ready_wait_s / upload_s = the
                              calling thread on the device route, upload_s includes the re-rotation
                              launch and the final wait) */
} kvz_compose_opts;

void kvz_compose_defaults(kvz_compose_opts *o);

/** What kvz_docs_load() composed. */
typedef struct kvz_compose_meta {
    int32_t n_docs;       /**< documents after expanding split ids */
    int32_t placement;    /**< KVZ_PLACE_SEQUENTIAL or KVZ_PLACE_PARALLEL (auto resolved) */
    int32_t n_prefix;     /**< system prefix tokens (once) */
    int32_t q_pos;        /**< questions start at this position */
    int64_t span_seq;     /**< n_prefix + sum n_ctx (the sequential span) */
    int32_t max_ctx;      /**< the longest document's context tokens */
    float ratio_min, ratio_max;
    uint64_t rows;        /**< composed rows over all layers and heads */
    uint64_t rows_full;   /**< rows of the uncompressed composition */
    double load_s;        /**< read + verify + decompress + re-rotate + place */
} kvz_compose_meta;

/**
 * Compose the documents @p ids[0..n) into a new kvz_kv with @p extra_rows free rows
 * per head and @p out_slots LongFlow output slots (as kvz_doc_load).
 * @param names  out (may be NULL): the expanded ids, malloc'd array of malloc'd
 *               strings, free with kvz_compose_names_free(names, meta->n_docs).
 * @return 0; KVZ_ERR_ARG (n < 1, an empty id, a document named twice — also when
 *   once as ID and once as one of its parts — or more than KVZ_COMPOSE_MAX_DOCS);
 *   KVZ_ERR_NOTFOUND (an unknown id); KVZ_ERR_FORMAT (documents ingested with
 *   different system prefixes, or dims differ from the model); KVZ_ERR_CONTEXT
 *   (positions past 2^30); KVZ_ERR_NOMEM (the composed rows do not fit in memory, host or device);
 *   KVZ_ERR_CUDA (a device copy or launch failed);
 *   kvz_doc_load's errors. Every error's detail names the document.
 */
int kvz_docs_load(kvz_model *m, kvz_store *st, const char *const *ids, int32_t n,
                  const kvz_compose_opts *o, int64_t extra_rows, int32_t out_slots, kvz_kv **out,
                  kvz_compose_meta *meta, char ***names);

void kvz_compose_names_free(char **names, int32_t n);

#ifdef __cplusplus
}
#endif
#endif
