/**
 * @file kvz_backend.h
 * @brief The runtime's device backends behind one table. A module header of runtime/
 *        (like kvz_model.h: ingest uses it), not part of the public API (include/kvzip.h).
 *
 * A model runs on one backend, chosen once when it is created (kvz_backend_pick,
 * runtime/kvz_backend.c: the one place that knows which backends this build has).
 * Everything device-specific the runtime and ingest do goes through the model's
 * table: the model and cache lifecycle, the forward pass, and, where the device
 * has them, the KVzip repeat pass, selection + compaction and the export of kept
 * rows. Two implementations:
 *   - CPU  (runtime/kvz_backend_cpu.c over runtime/kvz_cpu.c): host fp32 cache;
 *     KVzip scoring happens inside the forward pass (kvz_kv_probe) and selection on
 *     the host (ingest/kvz_kvzip.c), so the device KVzip entries are NULL;
 *   - CUDA (runtime/cuda/, over the op library in kernels/): bf16 cache in HBM;
 *     every entry is set.
 * A NULL entry means "this backend does not do that; use the host path" and is the
 * only way callers tell backends apart (never by #ifdef).
 *
 * Every int function returns 0 or a negative KVZ_ERR_* (kvz_error.h) with the detail
 * set; nothing prints.
 */
#ifndef KVZ_BACKEND_H
#define KVZ_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kvz_model.h"

#ifdef __cplusplus
extern "C" {
#endif

/** One chunk of a batched KVzip repeat pass: @p n repeat-input tokens scoring
 *  context tokens [c0, c1). */
typedef struct kvz_repeat_chunk {
    int32_t n, c0, c1;
} kvz_repeat_chunk;

/** Upper bound of any backend's load_max_slots (arrays of slots can be sized by it). */
#define KVZ_BACKEND_MAX_LOAD_SLOTS 16

/** One run of cached keys to re-rotate (kv_shift): rows [row0, row0 + n) of head
 *  segment @p lh (layer * n_kv_head + head), by the angles of row @p doc of the tables. */
typedef struct kvz_kv_shift_seg {
    int32_t lh, row0, n, doc;
} kvz_kv_shift_seg;

typedef struct kvz_backend {
    const char *name;     /**< "cpu", "cuda" */
    int32_t device;       /**< KVZ_DEVICE_CPU / KVZ_DEVICE_CUDA */
    uint32_t kv_elt_bytes; /**< bytes per cached K or V element (stats) */

    /* ---- model: called once the host weights are loaded (or, for a synthetic
     * model on a device that generates its own, not loaded) ------------------- */
    int (*model_init)(kvz_model *m);
    void (*model_free)(kvz_model *m); /**< device state only; NULL-safe on a half-made model */

    /* ---- KV cache: kvz_kv_create has filled the shape fields and the host length
     * arrays; kv_init allocates the storage --------------------------------- */
    int (*kv_init)(kvz_kv *kv);
    void (*kv_free)(kvz_kv *kv);
    /** Push the host lengths (kv->len, out_used) after the host changed them; @p reset_out
     *  also empties the output buffer. NULL: the host arrays are the cache. */
    int (*kv_sync)(kvz_kv *kv, int reset_out);
    int (*kv_set_layer)(kvz_kv *kv, int32_t layer, const uint32_t *counts, const int32_t *pos,
                        const float *k, const float *v);
    int (*kv_get_head)(const kvz_kv *kv, int32_t layer, int32_t head, float *k, float *v, int32_t *pos);

    /** kvz_forward after its argument checks. */
    int (*forward)(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                   float *logits, int flags, const kvz_layer_hook *hook);

    /** Continuous batching (kvz_forward_multi_top after its checks; @p io may be NULL):
     *  one decode token for each of @p n different caches of this model (own documents,
     *  lengths and output buffers) in one pass. NULL: one kvz_forward per cache. */
    int (*forward_multi)(kvz_model *m, kvz_kv *const *kv, const int32_t *tokens, const int32_t *pos,
                         int32_t n, float *logits, kvz_step_io *io);

    /* ---- KVzip on the device (NULL on the CPU backend) --------------------- */
    /** Repeat passes of @p n_ch chunks in one batch (DESIGN §3 steps 2-3): @p tokens holds
     *  the chunks' repeat inputs back to back, each at positions pos0.. attending to the
     *  document and to itself only. Scores stay on the device for kvzip_select and are
     *  copied to @p scores (n_layer, n_kv, n_ctx) when not NULL. The cache must hold
     *  exactly n_prefix + n_ctx rows per head, with room for the batch after them. */
    int (*kvzip_repeat)(kvz_model *m, kvz_kv *kv, const int32_t *tokens, const kvz_repeat_chunk *ch,
                        int32_t n_ch, int32_t pos0, int32_t n_prefix, float *scores, int32_t n_ctx);
    /** Selection (KVZ_EVICT_GLOBAL / UNIFORM of round(N·ratio) pairs) from the scores
     *  kvzip_repeat left, then compaction of the cache in place (prefix + kept rows).
     *  @p keep (n_layer, n_kv, n_ctx) and @p counts (n_layer, n_kv) are filled when not
     *  NULL. @return kept pairs, or a negative KVZ_ERR_*. */
    int64_t (*kvzip_select)(kvz_kv *kv, int32_t n_prefix, int32_t n_ctx, float ratio, int32_t mode,
                            uint8_t *keep, uint32_t *counts);
    /** Rows [0, len) of every head of @p layer, back to back in head order, as blob dtype
     *  @p dtype (KVZ_DTYPE_F32 / F16 / BF16): pointers valid until the next call on this
     *  cache or its free. */
    int (*kv_export_layer)(const kvz_kv *kv, int32_t layer, uint8_t dtype, const uint32_t **pos,
                           const void **k, const void **v);
    /** Same rows as stored type @p dtype (any kvz_kv_dtype) into the caller's arrays
     *  (pinned: host_alloc, for full speed). */
    int (*kv_export_layer_to)(const kvz_kv *kv, int32_t layer, int dtype, void *k_dst, void *v_dst,
                              uint32_t *pos_dst);
    /** Page-locked host memory for transfers, and its free (NULL-safe). */
    int (*host_alloc)(void **p, size_t bytes);
    void (*host_free)(void *p);

    /* ---- stored caches into the device cache (the protocol of kernels/kvz_cuda_loader.h:
     * slots, layer uploads, waits, finish; NULL on the CPU backend, whose loader writes
     * the host arrays) ------------------------------------------------------- */
    int32_t load_max_slots; /**< most pinned slots load_slots gives, <= KVZ_BACKEND_MAX_LOAD_SLOTS (0 on the CPU) */
    int (*load_slots)(kvz_model *m, size_t slot_bytes, int nslot, void **slots);
    int (*load_layer)(kvz_kv *kv, int32_t layer, int slot, int dtype, const uint32_t *counts, int32_t row0,
                      size_t k_off, size_t v_off, size_t pos_off, size_t bytes);
    /** load_layer for a record that is not at the start of a slot: from @p src
     *  (page-locked: a slot, or memory host_register pinned), copied in pieces at
     *  @p cuts, into cache rows row0.. (kernels/kvz_cuda_loader.h). */
    int (*load_layer_src)(kvz_kv *kv, int32_t layer, int slot, const void *src, size_t bytes, int dtype,
                          const uint32_t *counts, int32_t row0, size_t k_off, size_t v_off, size_t pos_off,
                          const size_t *cuts, int n_cuts);
    /** Pin existing host memory (read-only) for uploads, and undo it (the store's
     *  pinner of the direct route, kvz_store_pin). */
    int (*host_register)(const void *p, size_t n, void **handle);
    void (*host_unregister)(void *handle);
    int (*load_wait)(kvz_model *m, int slot);
    int (*load_finish)(kvz_model *m);
    void (*load_release)(kvz_model *m);
    /** Composition (docs/MULTIDOC.md): stored rows src_row[h] .. + rows[h] of slot @p slot
     *  into cache rows dst_row[h] .. of each head (kernels/kvz_rope_shift_cuda.h). */
    int (*load_rows)(kvz_kv *kv, int32_t layer, int slot, int dtype, const uint32_t *src_row,
                     const uint32_t *rows, const uint32_t *dst_row, size_t k_off, size_t v_off,
                     size_t pos_off, size_t bytes);
    /** Re-rotate @p n_seg runs of keys by the host angle tables @p cs, @p sn (n_doc,
     *  head_dim/2) times @p key_scale, push the lengths and wait (the cache is ready). */
    int (*kv_shift)(kvz_kv *kv, const kvz_kv_shift_seg *segs, int n_seg, const float *cs,
                    const float *sn, int n_doc, float key_scale);
    /** The direct route's records verified on the device (record checksum, q8/q4 rows:
     *  kernels/kvz_cuda_loader.h kvz_cuda_load_verify_*); NULL on the CPU. */
    int (*load_verify_begin)(kvz_model *m, int n_rec, const uint64_t *hashed);
    int (*load_layer_verified)(kvz_kv *kv, int32_t layer, int slot, const void *src, size_t bytes, int dtype,
                               const uint32_t *counts, int32_t row0, size_t k_off, size_t v_off, size_t pos_off,
                               const size_t *cuts, int n_cuts, int rec, size_t hash_off, uint64_t seed);
    int (*load_verify_end)(kvz_model *m, uint64_t *digest, uint64_t *bad_row);
} kvz_backend;

/** The backend for @p device (KVZ_DEVICE_CPU, KVZ_DEVICE_CUDA, or KVZ_DEVICE_AUTO: CUDA
 *  when this build has it and a usable GPU is present, else CPU) into @p out.
 *  KVZ_ERR_NODEV: CUDA asked for and this build has no CUDA backend, or no usable GPU;
 *  KVZ_ERR_ARG: unknown device. */
int kvz_backend_pick(int32_t device, const kvz_backend **out);

/** Number of CUDA devices visible (0 without CUDA devices). KVZ_ERR_NODEV when this
 *  build has no CUDA backend. */
int kvz_backend_gpu_count(int *n);

/** The backend a model runs on (never NULL for a created model). */
const kvz_backend *kvz_model_backend(const kvz_model *m);

/** The CPU table (runtime/kvz_backend_cpu.c). */
const kvz_backend *kvz_backend_cpu(void);

#ifdef __cplusplus
}
#endif
#endif
