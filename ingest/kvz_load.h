/**
 * @file kvz_load.h
 * @brief The pipelined loader: a stored document's compressed cache -> a KV cache
 *        ready for questions, at memory speed.
 *
 * Same result as kvz_doc_load() (ingest/kvz_ingest.h), other route:
 *   - a small thread pool, one layer per task, each worker in its own read
 *     transaction; a codec-none record (q8/q4, and any record zstd does not shrink)
 *     is copied with pread() from data.mdb straight to where it is used (the pinned
 *     staging slot on the GPU; no page fault on the map) and hashed once, piece by
 *     piece while the piece is in the CPU cache (the record checksum covers header
 *     and payload); a zstd record is copied the same way into a scratch buffer
 *     and decompressed into the same place;
 *   - CPU backend: each worker converts its layer to fp32 and places it in the cache
 *     (layers are independent);
 *   - CUDA backend: a worker takes any free pinned staging slot and fills it with
 *     its layer; the calling thread uploads whichever layer is ready
 *     (cudaMemcpyAsync on the model's stream; each layer has its own part of the
 *     cache, so the order does not matter) while the workers go on, gives the slot
 *     back once the device has copied it, and one kernel per layer converts the
 *     stored rows (f32/f16/bf16/q8/q4, common/kvz_kvdtype.h) into the bf16 cache.
 *     The host never converts a value. With kvz_load_opts.direct, a codec-none
 *     record of the document (≥ direct_min) skips the host copy: a worker finds it
 *     where it lies in the LMDB map (its header says codec none), has the store pin
 *     its region of the map with the driver (kvz_store_pin: cudaHostRegister,
 *     read-only, 64 MiB pieces kept until the store closes or its map moves), hands
 *     it to the calling thread, which uploads it from there, and verifies it in the
 *     map meanwhile (record checksum, rows, header, positions: the checks of the copy
 *     route). The load returns only after every record is verified, and one that
 *     fails fails the load, so rows uploaded from a damaged record are never used
 *     (the direct route; the calling thread's read transaction, older than the
 *     workers', keeps writers off those pages until the upload is done).
 *     Where the backend can (CUDA: load_verify_begin), the direct route's records
 *     are verified on the device instead: the worker checks the header and the
 *     positions only (kvz_blob_layer_head), the record checksum (XXH3-64 with its
 *     seed) is computed by kernels over the uploaded bytes and the q8/q4 rows are
 *     checked by the load kernel, and the results come back in one small copy when
 *     the upload is done and are compared then (same errors as the host check), so
 *     the host reads each such record once (the DMA) and its CPUs are left to the
 *     zstd records, which are claimed first. kvz_load_opts.host_verify (or the
 *     environment variable KVZ_LOAD_GPU_VERIFY=0) keeps the host check.
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

/** Where a load's time went (kvz_load_opts.profile): seconds summed over the
 *  workers (the *_s fields of workers) or on the calling thread, for benchmarks. */
typedef struct kvz_load_profile {
    double copy_s;       /**< workers: pread of records into staging (LMDB lookup included) */
    double hash_s;       /**< workers: record checksum + q8/q4 row checks, piece by piece */
    double check_s;      /**< workers: header and position checks of copied records */
    double zstd_s;       /**< workers: zstd records copied to scratch: header checks + decompression */
    double map_s;        /**< workers: records read through the map (map_only, fallback): check + decode */
    double convert_s;    /**< workers, CPU backend: stored rows -> fp32 -> the cache */
    double slot_wait_s;  /**< workers: waiting for a free staging slot (GPU) */
    double ready_wait_s; /**< calling thread (GPU): waiting for decoded layers */
    double upload_s;     /**< calling thread (GPU): H2D + kernel enqueue, waiting for the previous layer */
    double alloc_s;      /**< calling thread: KV cache allocation */
    double total_s;      /**< the whole kvz_load_doc() */
    uint64_t records_copied; /**< codec-none records read with pread() into place (one hash pass) */
    uint64_t records_zstd;   /**< zstd records read with pread() into scratch (one hash pass) */
    uint64_t records_mapped; /**< records read through the map */
    uint64_t records_direct; /**< GPU: codec-none records uploaded straight from the registered map */
    double register_s;       /**< workers: pinning map regions with the CUDA driver (direct route; first use) */
    uint64_t bytes;          /**< stored bytes of the records */
    uint64_t records_dev_verified; /**< of records_direct: checksum and rows verified on the device */
    double dev_verify_s;     /**< calling thread: the device verification's end (wait, chain, results) */
    double slots_s;          /**< calling thread: the pinned staging slots (grown, a registered mapping,
                                  when a document needs longer ones than the model has) */
} kvz_load_profile;

/** One layer's timeline (kvz_load_opts.trace): seconds from the start of the load. */
typedef struct kvz_load_layer_time {
    double claim_s;    /**< a worker took the layer (and a staging slot) */
    double ready_s;    /**< its records were read, verified and decoded; direct route: the
                            record was found in the pinned map (its upload may start) */
    double checked_s;  /**< its records were verified (= ready_s except on the direct route,
                            which verifies while the upload runs; route 'g': its header and
                            positions were, the device's results are compared at the end) */
    double take_s;     /**< the calling thread took it for upload (GPU) */
    double upload_s;   /**< the calling thread had queued its upload (GPU) */
    double zstd_s;     /**< of claim -> ready, the time its worker spent in zstd decoding (the
                            rest: reading, copying and hashing) */
    uint64_t bytes;    /**< stored bytes of its records */
    uint64_t raw;      /**< their codec-none bytes (bytes < raw: zstd saved the difference) */
    int route;         /**< 'c' copied, 'z' zstd, 'd' direct, 'g' direct verified on the device,
                            'm' through the map (the document's record) */
} kvz_load_layer_time;

typedef struct kvz_load_opts {
    int threads; /**< decode workers; 0 = the online cores, at most 16 */
    kvz_load_profile *profile; /**< NULL, or filled (zeroed first) with where the time went */
    int map_only; /**< 1: read every record through the LMDB map, checked by the store
                       and decoded (the route before copy reads; for comparisons) */
    int direct; /**< 1 (CUDA): the direct route below for codec-none records of at least
                     direct_min bytes, for a process that loads many documents from one open
                     store (the server): pinning the map's pages costs about what copying
                     them does, so it pays from the second load of a region on */
    size_t direct_min; /**< with direct: records shorter than this are copied (0: 64 KiB;
                            small records share LMDB pages and gain nothing; tests set 1) */
    uint64_t direct_budget; /**< with direct: most bytes of the store's map pinned at once
                                 (0: a quarter of the physical memory); past it, copied */
    kvz_load_layer_time *trace; /**< NULL, or one entry per layer, filled (benchmarks) */
    int host_verify; /**< with direct: 1 verifies every record on the host even where the
                          backend could verify it on the device (A/B; also
                          KVZ_LOAD_GPU_VERIFY=0 in the environment) */
    int staging_only; /**< 1: read the document's META and size the model's staging (pinned
                           host slots + device buffers, and the direct route's verification
                           buffers) as its load would, then return 0 with *out NULL: a
                           long-lived process's warm-up, so that a first load of a document up
                           to this size allocates no pinned memory (~0.03 s per 8K-token
                           llama3-8b document on the H200) */
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
