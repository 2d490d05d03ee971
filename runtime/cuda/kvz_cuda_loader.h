/**
 * @file kvz_cuda_loader.h
 * @brief Internal C entry points of the CUDA backend for moving stored KV rows
 *        between the store and the device cache (runtime/cuda/kvz_cuda_load.cu; the
 *        register helpers in kernels/kvload.cu).
 *        Used by ingest/kvz_load.c (pipelined loader) and ingest/kvz_pipeline.c.
 *
 * Load protocol (one loader per model at a time; the model's stream orders it with
 * every later kvz_forward on the same model):
 *   kvz_cuda_load_slots()   pinned host staging slots (owned by the model, reused)
 *   ...fill slot i with one layer's stored rows (k, v, pos at chosen offsets)...
 *   kvz_cuda_load_layer()   async H2D copy of the slot + one dequant kernel into the
 *                           cache layer; an event marks the slot's copy done
 *   kvz_cuda_load_wait()    before refilling slot i
 *   kvz_cuda_load_finish()  wait for the whole load (the cache is then ready)
 * Stored row types: kvz_kv_dtype (common/kvz_kvdtype.h).
 * Every function returns 0 or a negative KVZ_ERR_*; nothing prints.
 */
#ifndef KVZ_CUDA_LOADER_H
#define KVZ_CUDA_LOADER_H

#include <stddef.h>
#include <stdint.h>

#include "kvz_kvdtype.h"
#include "kvz_model.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVZ_CUDA_LOAD_MAX_SLOTS 16

/** @p nslot (1..KVZ_CUDA_LOAD_MAX_SLOTS) pinned host slots of at least @p slot_bytes
 *  each into @p slots, valid until the next call or the model's free. Synchronises
 *  the model's stream when it has to grow them. KVZ_ERR_NOMEM, KVZ_ERR_CUDA. */
int kvz_cuda_load_slots(kvz_model *m, size_t slot_bytes, int nslot, void **slots);

/** Upload the first @p bytes of slot @p slot (0: nothing, the slot is already on the
 *  device from an earlier call for this layer) and convert the rows it holds for
 *  layer @p layer (K at k_off, V at v_off (both 16-byte aligned), u32 positions at
 *  pos_off, flat head-major, counts[h] rows per head) into cache rows row0.. of each
 *  head (one kernel, kvz_cuda_kv_load); sets the host and device lengths of the layer
 *  to row0 + counts[h]. Asynchronous. KVZ_ERR_CONTEXT when rows exceed the capacity. */
int kvz_cuda_load_layer(kvz_kv *kv, int32_t layer, int slot, int dtype, const uint32_t *counts, int32_t row0,
                        size_t k_off, size_t v_off, size_t pos_off, size_t bytes);

/** kvz_cuda_load_layer() for a record that is not at the start of a slot: @p bytes
 *  from @p src (page-locked host memory: a slot, or a range registered with
 *  kvz_cuda_host_register) are copied into slot @p slot's device buffer (shifted so
 *  that K lands on a 16-byte boundary; the slot must hold bytes + 15; offsets are
 *  from @p src; copied in pieces at the ascending offsets @p cuts, where @p src
 *  crosses from one registration into the next) and converted into cache rows row0.. of each head. Two calls on one
 *  slot are ordered by the model's stream. @p src must stay unchanged until
 *  kvz_cuda_load_wait(slot) or kvz_cuda_load_finish(). */
int kvz_cuda_load_layer_src(kvz_kv *kv, int32_t layer, int slot, const void *src, size_t bytes, int dtype,
                            const uint32_t *counts, int32_t row0, size_t k_off, size_t v_off, size_t pos_off,
                            const size_t *cuts, int n_cuts);

/**
 * Records verified on the device (the direct route, where the host would otherwise
 * read each record a second time to hash it): kvz_cuda_load_verify_begin() for a load
 * of @p n_rec records of which record r hashes @p hashed[r] bytes (< 241: never
 * verified here; room for its block sums is kept), then kvz_cuda_load_layer_verified()
 * per record so verified, then kvz_cuda_load_verify_end() after the last upload: it
 * waits for the whole load (as kvz_cuda_load_finish) and gives, per record, the XXH3-64
 * with its seed of bytes [hash_off, bytes) as uploaded (0 for a record not so loaded)
 * and the first q8/q4 row that kvz_kvrow_check refuses (index over K rows then V rows;
 * UINT64_MAX: none). The caller compares them; the cache counts only when all match.
 */
int kvz_cuda_load_verify_begin(kvz_model *m, int n_rec, const uint64_t *hashed);

/** kvz_cuda_load_layer_src() of record @p rec of the load begun by
 *  kvz_cuda_load_verify_begin(), plus its verification on the device (above). */
int kvz_cuda_load_layer_verified(kvz_kv *kv, int32_t layer, int slot, const void *src, size_t bytes, int dtype,
                                 const uint32_t *counts, int32_t row0, size_t k_off, size_t v_off, size_t pos_off,
                                 const size_t *cuts, int n_cuts, int rec, size_t hash_off, uint64_t seed);

/** The results of the load's device verification into @p digest and @p bad_row (n_rec
 *  each, NULL: not wanted), after waiting for everything on the model's stream. */
int kvz_cuda_load_verify_end(kvz_model *m, uint64_t *digest, uint64_t *bad_row);

/** Register [@p p, @p p + @p n), rounded out to whole pages, with the CUDA driver as
 *  read-only page-locked memory (cudaHostRegister: Portable | ReadOnly) so that H2D
 *  copies read it directly (no staging copy). *@p base: what to give
 *  kvz_cuda_host_unregister(). The pages must stay mapped until then.
 *  KVZ_ERR_CUDA (e.g. already registered, or the driver cannot pin the pages; the
 *  CUDA error is cleared: the caller may take another route). */
int kvz_cuda_host_register(const void *p, size_t n, void **base);

/** Undo kvz_cuda_host_register() (NULL-safe). Nothing may still read the range. */
void kvz_cuda_host_unregister(void *base);

/** Wait until slot @p slot's last upload has been read by the device. */
int kvz_cuda_load_wait(kvz_model *m, int slot);

/** Wait for everything queued on the model's stream (the loaded cache is ready). */
int kvz_cuda_load_finish(kvz_model *m);

/** Free the pinned slots (they are otherwise kept for the next load). */
void kvz_cuda_load_release(kvz_model *m);

/** Like kvz_cuda_kv_export_layer for the quantized types: rows [0, len) of every head
 *  of @p layer quantized on the device to @p dtype (KVZ_KV_Q8 / KVZ_KV_Q4) and copied
 *  once through pinned memory; the pointers stay valid until the next export call on
 *  this cache or its free. */
int kvz_cuda_kv_export_layer_q(const kvz_kv *kv, int32_t layer, int dtype, const uint32_t **pos,
                               const void **k, const void **v);

/** One layer's rows [0, len) of every head, back to back in head order, converted on
 *  the device to stored type @p dtype (any kvz_kv_dtype; f16 = kvz_cuda_kv_export's
 *  bits, q8/q4 = kvz_cuda_kv_export_q's) and copied into the caller's host arrays
 *  (pinned for full speed: kvz_cuda_host_alloc): @p k_dst, @p v_dst (Σ len) rows of
 *  kvz_kv_row_bytes(dtype, head_dim), @p pos_dst (Σ len) u32. Returns when the copy
 *  is done. */
int kvz_cuda_kv_export_layer_to(const kvz_kv *kv, int32_t layer, int dtype, void *k_dst, void *v_dst,
                                uint32_t *pos_dst);

/** Pinned host memory (cudaHostAlloc) and its free (NULL-safe). */
int kvz_cuda_host_alloc(void **p, size_t bytes);
void kvz_cuda_host_free(void *p);

#ifdef __cplusplus
}
#endif
#endif
