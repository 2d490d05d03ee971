/**
 * @file kvz_cuda_verify.h
 * @brief Verification of stored records on the device (kernels/xxh3.cu, and the row
 *        check of kernels/kvload.cu): the record checksum (XXH3-64 with a seed,
 *        docs/FORMAT.md §2) of a record already uploaded, and the q8/q4 scale check of
 *        the rows the load kernel dequantises. Used by the CUDA loader's direct route
 *        (runtime/cuda/kvz_cuda_load.cu) so that the host does not read each record
 *        a second time to hash it.
 *
 * The hash is computed in the parallel form of kernels/kvz_xxh3_lanes.h:
 *   kvz_cuda_xxh3_sums()   every full 1024-byte block's 8 lane sums at once, and the
 *                          tail's (one pass over the input, thousands of blocks);
 *   kvz_cuda_xxh3_chain()  per record, 8 threads run the lanes' chain of scrambles
 *                          over those sums, then one merges: the digest.
 * The sums of many records may wait in device memory and be chained in one launch.
 * Same conventions as kvz_cuda.h: device pointers, work on the caller's stream,
 * 0 or KVZ_ERR_ARG / KVZ_ERR_CUDA.
 */
#ifndef KVZ_CUDA_VERIFY_H
#define KVZ_CUDA_VERIFY_H

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>

#include "kvz_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/** u64 entries kvz_cuda_xxh3_sums() writes for an @p n-byte input:
 *  8 * ((n - 1) / 1024 + 1). */
static inline uint64_t kvz_cuda_xxh3_sums_len(uint64_t n) { return 8 * ((n - 1) / 1024 + 1); }

/** Lane sums of the @p n bytes at @p in (device, 4-byte aligned; n > 240) under @p seed
 *  into @p sums (kvz_cuda_xxh3_sums_len(n) u64, device): S[b][lane] of every full block
 *  b, then the tail's 8. */
int kvz_cuda_xxh3_sums(cudaStream_t s, const void *in, uint64_t n, uint64_t seed, uint64_t *sums);

/** One record's hash job for kvz_cuda_xxh3_chain(); n == 0: none (digest not written). */
typedef struct kvz_cuda_xxh3_job {
    uint64_t n;        /**< input bytes (> 240) */
    uint64_t seed;
    uint64_t sums_off; /**< where its sums start, in u64 from the sums base */
} kvz_cuda_xxh3_job;

/** The digests of @p n_job jobs (@p jobs device) from their sums at @p sums + sums_off
 *  into @p digest[j] (device u64): XXH3_64bits_withSeed of each input. */
int kvz_cuda_xxh3_chain(cudaStream_t s, const kvz_cuda_xxh3_job *jobs, int n_job, const uint64_t *sums,
                        uint64_t *digest);

/** kvz_cuda_xxh3_chain() of one job given by value (its sums at @p sums + job.sums_off)
 *  into *@p digest: the loader launches it on a side stream as soon as a record's sums
 *  are queued, so the chains run while later records upload. */
int kvz_cuda_xxh3_chain1(cudaStream_t s, kvz_cuda_xxh3_job job, const uint64_t *sums, uint64_t *digest);

/** kvz_cuda_kv_load() that also checks q8/q4 rows exactly as kvz_kvrow_check (format/
 *  kvz_kvrow.h): a scale that is NaN, Inf or negative (sign bit set, -0 too), a q4 m
 *  that is NaN or Inf, or a q8 value -128 makes *@p bad_row (device u64) the minimum
 *  of itself and the row's index in the record (K rows 0..Σrows-1, then V rows
 *  Σrows..2Σrows-1). Other types: no check. @p bad_row NULL: kvz_cuda_kv_load. */
int kvz_cuda_kv_load_checked(cudaStream_t s, const kvz_cuda_kv *kv, int dtype, const int32_t *rows, int32_t row0,
                             const void *k_src, const void *v_src, const uint32_t *pos_src,
                             unsigned long long *bad_row);

#ifdef __cplusplus
}
#endif
#endif
