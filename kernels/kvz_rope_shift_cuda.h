/**
 * @file kvz_rope_shift_cuda.h
 * @brief Re-rotation of cached keys on the device (multi-document composition,
 *        docs/MULTIDOC.md): the CUDA side of runtime/kvz_rope_shift.h.
 *
 * A composed cache places document i's kept rows after the earlier documents' and
 * moves their positions by Δ_i; the keys were rotated at ingest for their old
 * positions, so each is rotated once more by Δ_i·θ_j per frequency pair j. The host
 * computes the angles once per document (kvz_rope_shift_table, double precision,
 * rounded to float: the same numbers kvz_rope_shift_rows applies on the CPU); the
 * kernel applies them to the bf16 rows in HBM, after the upload (one launch for the
 * whole composition), in fp32, with one bf16 rounding.
 *
 * Two levels:
 *   - kvz_cuda_rope_shift_rows(): the kernel over segments of a head-major bf16
 *     array (device pointers; what tests/gpu/test_compose_cuda.c checks against the
 *     CPU on random rows);
 *   - kvz_cuda_load_rows() / kvz_cuda_kv_shift() (runtime/cuda/kvz_cuda_load.cu): the
 *     same on a model's KV cache, used by ingest/kvz_compose.c. They belong to the
 *     runtime's CUDA backend, not to this op library, and are declared here only until
 *     kvz_compose.c reaches them through the backend table (runtime/kvz_backend.h);
 *     the kvz_kv they take stays opaque here (kernels/ includes nothing of runtime/).
 * Every function returns 0 or a negative KVZ_ERR_*; nothing prints.
 */
#ifndef KVZ_ROPE_SHIFT_CUDA_H
#define KVZ_ROPE_SHIFT_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/** One run of rows to re-rotate: rows [row0, row0 + n) of head segment @p lh. */
typedef struct kvz_cuda_shift_seg {
    int32_t lh;   /**< segment index: layer * n_kv_head + head (rows of segment lh start at lh * cap) */
    int32_t row0; /**< first row */
    int32_t n;    /**< rows */
    int32_t doc;  /**< row of the angle tables */
} kvz_cuda_shift_seg;

/**
 * Rotate keys in place: for every segment s, rows [row0, row0 + n) of
 * @p k + s.lh * cap * hd, each pair j by the angle whose cosine / sine are
 * cs[s.doc * hd/2 + j] / sn[...], then multiplied by @p key_scale (1 = none).
 * @param k        (n_lh, cap, hd) bf16, device
 * @param hd       head dim, even, <= 512
 * @param adjacent 1: pairs (x[2j], x[2j+1]) (llama); 0: (x[j], x[j + hd/2]) (qwen2/qwen3)
 * @param segs     (n_seg) device
 * @param max_rows the largest n over the segments (sizes the grid)
 * @param cs, sn   (n_doc, hd/2) fp32 device
 * Asynchronous on @p s. KVZ_ERR_ARG (bad sizes), KVZ_ERR_CUDA (launch).
 */
int kvz_cuda_rope_shift_rows(cudaStream_t s, void *k, int64_t cap, int hd, int adjacent,
                             const kvz_cuda_shift_seg *segs, int n_seg, int32_t max_rows, const float *cs,
                             const float *sn, float key_scale);

typedef struct kvz_kv kvz_kv; /* runtime/kvz_model.h: opaque here */

/**
 * Pipelined-load variant of kvz_cuda_load_layer (kvz_cuda_loader.h) for composition:
 * upload the first @p bytes of pinned slot @p slot (0: none), then for each head h
 * with rows[h] > 0 convert stored rows src_row[h] .. src_row[h] + rows[h] of the slot
 * (K at k_off, V at v_off, u32 positions at pos_off; flat, head-major, as the blob
 * decoder writes them) into cache rows dst_row[h] .. of that head (kvz_cuda_kv_load,
 * one launch per head). Sets the host length of each head to dst_row[h] + rows[h]
 * (the device lengths follow at kvz_cuda_kv_shift or kvz_cuda_kv_sync). Records the
 * slot's event: kvz_cuda_load_wait(m, slot) before refilling the slot. Asynchronous.
 * KVZ_ERR_ARG, KVZ_ERR_CONTEXT (rows past the capacity), KVZ_ERR_CUDA.
 */
int kvz_cuda_load_rows(kvz_kv *kv, int32_t layer, int slot, int dtype, const uint32_t *src_row,
                       const uint32_t *rows, const uint32_t *dst_row, size_t k_off, size_t v_off,
                       size_t pos_off, size_t bytes);

/**
 * Finish a composition on the device: re-rotate the @p n_seg segments of @p kv's
 * keys (host array; see kvz_cuda_rope_shift_rows) with the host angle tables
 * @p cs, @p sn (n_doc, head_dim/2) and @p key_scale, in one launch, then push the
 * host lengths to the device and wait for the stream (the cache is then ready).
 * n_seg == 0 only pushes the lengths and waits. KVZ_ERR_ARG, KVZ_ERR_NOMEM, KVZ_ERR_CUDA.
 */
int kvz_cuda_kv_shift(kvz_kv *kv, const kvz_cuda_shift_seg *segs, int n_seg, const float *cs, const float *sn,
                      int n_doc, float key_scale);

#ifdef __cplusplus
}
#endif
#endif
