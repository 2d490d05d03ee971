/**
 * @file kvz_cuda_backend.h
 * @brief The runtime's CUDA backend (the .cu files of runtime/cuda/, over the op library of
 *        kernels/kvz_cuda.h): its kvz_backend table and the entry points behind it.
 *
 * Private to runtime/: runtime/kvz_backend.c picks the table; the GPU tests and the
 * GPU bench call the test/bench hooks (weights_diff, kv_out_pos, mem_peak,
 * graph_launches) directly. Everything else reaches the device through the table
 * (runtime/kvz_backend.h), whose documentation the entries below follow.
 *
 * Files, by concern:
 *   kvz_cuda_mem.cu      device memory with accounting, pinned host memory
 *   kvz_cuda_weights.cu  model init/free: weight upload or on-device synthesis
 *   kvz_cuda_cache.cu    KV cache: init/free/sync/set/get/export
 *   kvz_cuda_forward.cu  forward pass and the CUDA-graph decode step
 *   kvz_cuda_multi.cu    continuous batching: one decode step over n caches
 *   kvz_cuda_kvzip.cu    KVzip repeat pass, selection + compaction
 *   kvz_cuda_load.cu     stored rows into the cache (kvz_cuda_loader.h), composition
 *   kvz_cuda_table.cu    the table
 *   kvz_cuda_impl.cuh    the state they share (internal)
 */
#ifndef KVZ_CUDA_BACKEND_H
#define KVZ_CUDA_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kvz_backend.h"
#include "kvz_model.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The CUDA table. */
const kvz_backend *kvz_backend_cuda(void);

/** 1 when a usable CUDA device is present (cached after the first call). */
int kvz_cuda_available(void);
/** CUDA devices visible (kernels/misc.cu). */
int kvz_cuda_device_count(int *n);

int kvz_cuda_model_init(kvz_model *m);
void kvz_cuda_model_free(kvz_model *m);
int kvz_cuda_kv_init(kvz_kv *kv);
void kvz_cuda_kv_free(kvz_kv *kv);
int kvz_cuda_forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                     float *logits, int flags, const kvz_layer_hook *hook);
/* Continuous batching (the table's forward_multi): n >= 2 LongFlow output-buffer caches
 * (out_slots > n_sink + 1; head_dim 64/128) take one batched pass (kvz_cuda_multi.cu),
 * with the argmax ids on the device and only the wanted logits rows copied back (@p io,
 * kvz_forward_multi_top); anything else runs kvz_cuda_forward per cache. Errors as
 * kvz_forward_multi, plus KVZ_ERR_ARG for a cache of another model. */
int kvz_cuda_forward_multi(kvz_model *m, kvz_kv *const *kv, const int32_t *tokens, const int32_t *pos,
                           int32_t n, float *logits, kvz_step_io *io);
int kvz_cuda_kv_sync(kvz_kv *kv, int reset_out);
int kvz_cuda_kv_set_layer(kvz_kv *kv, int32_t layer, const uint32_t *counts, const int32_t *pos,
                          const float *k, const float *v);
int kvz_cuda_kv_get_head(const kvz_kv *kv, int32_t layer, int32_t head, float *k, float *v,
                         int32_t *pos);
/* KVzip on the device: each chunk's repeat input attends to the document and to itself
 * only; the linear layers run once over the batch, a fused kernel scores each chunk per
 * layer (no attention matrix in HBM); the repeat KV is discarded; scores stay in a device
 * array (n_layer, n_kv, n_ctx) kept with the cache (@p scores NULL: not copied, and the
 * call returns without waiting for the GPU). Selection is radix top-k (global) or
 * per-head top-k (uniform), then the cache is compacted in place. */
int kvz_cuda_kvzip_repeat(kvz_model *m, kvz_kv *kv, const int32_t *tokens, const kvz_repeat_chunk *ch,
                          int32_t n_ch, int32_t pos0, int32_t n_prefix, float *scores, int32_t n_ctx);
int64_t kvz_cuda_kvzip_select(kvz_kv *kv, int32_t n_prefix, int32_t n_ctx, float ratio,
                              int32_t mode, uint8_t *keep, uint32_t *counts);
/* Rows [0, len) of every head of @p layer converted on the device to blob dtype @p dtype
 * (KVZ_DTYPE_F32 / F16 / BF16 of format/kvz_blob.h, same bits as the host conversion),
 * copied once through pinned memory. Errors: KVZ_ERR_ARG, KVZ_ERR_NOMEM, KVZ_ERR_CUDA. */
int kvz_cuda_kv_export_layer(const kvz_kv *kv, int32_t layer, uint8_t dtype, const uint32_t **pos,
                             const void **k, const void **v);
/* The loader's entry points (kvz_cuda_load_*, kvz_cuda_kv_export_layer_q/_to,
 * kvz_cuda_host_alloc/free) are declared in kernels/kvz_cuda_loader.h, the composition's
 * (kvz_cuda_load_rows, kvz_cuda_kv_shift) in kernels/kvz_rope_shift_cuda.h, until
 * ingest/kvz_load.c and kvz_compose.c reach them through the table. */

/* ---- tests and bench -------------------------------------------------------- */
/** Compare every device weight with a CPU model's host fp32 weights (the device
 *  synthetic generator must be bit-exact). @return mismatching elements, or < 0. */
int64_t kvz_cuda_weights_diff(const kvz_model *gpu, const kvz_model *cpu);
/** Output-buffer slot positions of @p layer (B int32, -1 = empty) copied to the host. */
int kvz_cuda_kv_out_pos(const kvz_kv *kv, int32_t layer, int32_t *pos);
/** Output-buffer K and V of @p layer, raw bf16 bits (n_kv, B, hd) each, copied to the host. */
int kvz_cuda_kv_out_rows(const kvz_kv *kv, int32_t layer, uint16_t *k, uint16_t *v);
/** Peak device bytes this process allocated through the backend. */
uint64_t kvz_cuda_mem_peak(void);
/** Batch-1 decode steps replayed from a CUDA graph so far (KVZ_CUDA_GRAPH=0: graphs off). */
uint64_t kvz_cuda_graph_launches(void);
/** Batched steps (forward_multi, n >= 2) launched from a CUDA graph so far (captures +
 *  replays; kvz_step_io.path tells them apart per step). */
uint64_t kvz_cuda_multi_graph_launches(void);

#ifdef __cplusplus
}
#endif
#endif
