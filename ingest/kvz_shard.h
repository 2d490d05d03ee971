/**
 * @file kvz_shard.h
 * @brief Deterministic sharding of a corpus by document id, the corpus listing
 *        hash recorded in each shard's store, and the device spec "cuda:K".
 *
 * Shard rule (docs/SCALE.md): document id D belongs to shard
 *     XXH64(D, strlen(D), seed 0) mod N
 * over the document id as kvzip-ingest names it (path relative to the folder
 * argument), before any "#k" part suffix, so every part of a document is in the
 * same shard. The rule depends on the id only: not on file order, not on the
 * content (a changed document stays in its shard), not on N's other shards.
 * Every id is in exactly one of the N shards.
 *
 * Nothing here prints or exits; errors are KVZ_ERR_* with a detail line.
 */
#ifndef KVZ_SHARD_H
#define KVZ_SHARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVZ_SHARD_MAX 1000000u  /**< largest shard count accepted */

/** Which shard a process ingests. n == 0: no sharding (everything). */
typedef struct kvz_shard {
    uint32_t index;      /**< 0 .. n-1 */
    uint32_t n;          /**< shard count; 0 = not sharded */
    const char *source;  /**< where it came from: "--shard", "SLURM_ARRAY_TASK_ID", ... (static) */
} kvz_shard;

/** The shard (0 .. n-1) of document id @p id among @p n (n >= 1). */
uint32_t kvz_shard_of(const char *id, uint32_t n);

/**
 * Parse "I/N" (decimal, 0 <= I < N <= KVZ_SHARD_MAX).
 * @return 0; KVZ_ERR_ARG with a detail line naming what is wrong.
 */
int kvz_shard_parse(const char *spec, kvz_shard *out);

/**
 * Decide the shard from a --shard spec, a --shards count and the environment.
 * @param spec      --shard value or NULL.
 * @param shards    --shards value, 0 when not given.
 * @param getenv_fn environment lookup (getenv; tests pass their own).
 * Rules, first that applies:
 *   1. --shard I/N: that (with --shards too, N must agree).
 *   2. SLURM_ARRAY_TASK_ID set: I = it; N = --shards, else SLURM_ARRAY_TASK_COUNT.
 *   3. JOB_COMPLETION_INDEX set (Kubernetes Indexed Job): I = it; N = --shards
 *      (required: Kubernetes does not export the completion count).
 *   4. SLURM_ARRAY_TASK_COUNT set without SLURM_ARRAY_TASK_ID, or --shards
 *      without any index: an error (half-set).
 *   5. otherwise not sharded (out->n = 0).
 * @return 0; KVZ_ERR_ARG with a one-line detail.
 */
int kvz_shard_resolve(const char *spec, long shards, char *(*getenv_fn)(const char *),
                      kvz_shard *out);

/**
 * Corpus listing hash: XXH64 (seed 0) over the ids sorted bytewise, each
 * followed by one NUL byte. Independent of the order of @p ids.
 * @return 0; KVZ_ERR_NOMEM.
 */
int kvz_corpus_hash(const char *const *ids, size_t n, uint64_t *out);

/**
 * Parse a device spec: "cpu", "auto", "cuda" (= cuda:0), "cuda:K" (0 <= K < 1024).
 * @param device  out: KVZ_DEVICE_CPU / KVZ_DEVICE_CUDA / KVZ_DEVICE_AUTO.
 * @param ordinal out: K for cuda:K, 0 for "cuda", -1 otherwise.
 * @return 0; KVZ_ERR_ARG.
 */
int kvz_device_parse(const char *spec, int32_t *device, int32_t *ordinal);

/**
 * Select GPU @p ordinal for this process before the CUDA runtime starts, by
 * narrowing CUDA_VISIBLE_DEVICES to that one device (the K-th entry of an
 * existing CUDA_VISIBLE_DEVICES list, else K). The backend then sees it as
 * its device 0. Must run before anything touches CUDA.
 * @return 0; KVZ_ERR_NODEV (K beyond an existing CUDA_VISIBLE_DEVICES list); KVZ_ERR_NOMEM.
 */
int kvz_device_select(int32_t ordinal);

/**
 * Record in the store's metadata which shard it holds and the corpus listing it
 * was cut from: "shard" = "I/N", "corpus" = "<16 hex digits> <n ids>"
 * (kvz_store_merge reports sources of different listings). One transaction each.
 * @return 0 or a kvz_store_meta_set error.
 */
struct kvz_store;
int kvz_shard_record(struct kvz_store *st, const kvz_shard *sh, uint64_t corpus_hash, size_t n_ids);

#ifdef __cplusplus
}
#endif
#endif
