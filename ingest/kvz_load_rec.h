/**
 * @file kvz_load_rec.h
 * @brief Internal to ingest/: one stored LAYER record read, verified and laid out in
 *        the caller's memory, and the worker-pool plumbing around it. Shared by the
 *        single-document loader (kvz_load.c) and the composition (kvz_compose.c), so
 *        both read a record the same way and report a damaged one the same way.
 *
 * The routes kvz_load_record() takes for a record (kvz_load.h describes the loader):
 *   - copy: a codec-none record (q8/q4, and any record zstd does not shrink) is copied
 *     with pread() from data.mdb straight to @p dst (kvz_store_copy_layer) and hashed
 *     once, piece by piece while the piece is in the CPU cache (the record checksum
 *     covers header and payload); q8/q4 rows are checked as they arrive; the header
 *     and positions are then checked in place (kvz_blob_layer_placed);
 *   - zstd: a compressed record is copied + hashed the same way into the reader's
 *     scratch buffer and decompressed into @p dst (kvz_blob_decode_layer_hashed);
 *   - map: anything else (map_only, a record whose length is neither, a record
 *     that changed between the two reads) is read through the LMDB map and checked
 *     and decoded by kvz_blob_decode_layer (three hashes: the route before the copy).
 * Every route leaves the record in the codec-none layout of kvz_load_place(), so the
 * result is the same bytes whichever route ran; every route refuses a damaged record
 * with the error kvz_blob_decode_layer gives (KVZ_ERR_CHECKSUM, KVZ_ERR_FORMAT).
 *
 * Threading: a kvz_load_reader belongs to one thread (its own read transaction);
 * kvz_load_sync is shared by a pool's threads.
 */
#ifndef KVZ_LOAD_REC_H
#define KVZ_LOAD_REC_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "kvz_blob.h"
#include "kvz_load.h"
#include "kvz_store.h"

/** Where one record lies in memory, as a codec-none record lies: header
 *  (KVZ_BLOB_HEADER_SIZE bytes) at x, then u32 positions at pos, K rows at k, V rows
 *  at v. x is chosen so that k is on a 16-byte boundary (the CUDA load kernel reads
 *  f16/bf16/f32 rows 16 bytes at a time) when the buffer is. Offsets are bytes from
 *  the buffer start. */
typedef struct kvz_load_at {
    size_t x;    /**< record start */
    size_t pos;  /**< (kept) u32 positions, flat head-major */
    size_t k, v; /**< (kept, row bytes) stored K rows, then V rows */
    size_t len;  /**< codec-none record bytes */
    size_t end;  /**< x + len: the bytes a buffer needs */
} kvz_load_at;

/** The layout of a record of @p kept rows of @p rb stored bytes each, placed at or
 *  after byte @p at. */
kvz_load_at kvz_load_place(size_t at, uint64_t kept, size_t rb);

/** One worker's reader: its read transaction, a scratch buffer for zstd records and
 *  where its time went. */
typedef struct kvz_load_reader {
    kvz_store_read *r;
    int map_only;          /**< 1: every record through the map (comparisons, benchmarks) */
    uint8_t *scratch;      /**< a zstd record as stored */
    size_t scratch_n;
    uint8_t *head;         /**< a record's header and positions (kvz_load_record_head) */
    size_t head_n;
    kvz_load_profile pf;   /**< this worker's times and record counts (the *_s worker fields) */
} kvz_load_reader;

/** Open @p w's read transaction on @p st. @return 0 or kvz_store_read_begin's error. */
int kvz_load_reader_begin(kvz_load_reader *w, kvz_store *st, int map_only);

/** End the transaction and give the scratch buffer back (kept, bounded, for the next
 *  load in this process, or freed); w->pf stays. NULL-safe fields. */
void kvz_load_reader_end(kvz_load_reader *w);

/**
 * LAYER record @p l of blob @p hash (@p prefix: a shared system prefix blob, read
 * with kvz_store_copy_prefix / kvz_store_read_prefix) described by @p m, read and
 * verified into @p dst laid out as @p at = kvz_load_place(.., kvz_blob_layer_kept(m, l),
 * kvz_blob_kv_row_bytes(m)) says. The bytes in @p dst are valid until the caller
 * overwrites them (nothing points into the map). q8/q4 rows are checked on every
 * route (a NaN/Inf/negative scale or a q8 value -128 is KVZ_ERR_FORMAT naming the
 * layer, K or V, and the row).
 * @return 0; KVZ_ERR_NOTFOUND (no such document record); KVZ_ERR_FORMAT (a prefix
 *   blob without layer @p l, or what kvz_blob_decode_layer refuses);
 *   KVZ_ERR_CHECKSUM; KVZ_ERR_NOMEM (scratch); KVZ_ERR_LMDB. The detail (this thread)
 *   says what is wrong with the record; the caller adds the document.
 */
int kvz_load_record(kvz_load_reader *w, const kvz_blob_meta *m, const uint8_t hash[16], int prefix, uint32_t l,
                    uint8_t *dst, kvz_load_at at);

/**
 * The first step of the direct route: where LAYER record @p l of blob @p hash lies in
 * the map (kvz_store_map_peek), when it has the length @p at.len and its header says
 * codec none; nothing else is read or verified. The caller may start an upload from
 * @p *rec and must then verify it with kvz_load_record_mapped() (same record) before
 * the load counts: an upload of a record that fails there is thrown away with the load.
 * @return 0; KVZ_ERR_UNSUPPORTED (another length or codec, map_only, or the map is not
 *   the data file: take kvz_load_record); the store's errors.
 */
int kvz_load_record_peek(kvz_load_reader *w, uint32_t l, const uint8_t hash[16], kvz_load_at at, const uint8_t **rec);

/**
 * The direct route of the CUDA loader: LAYER record @p l of blob @p hash, when it is
 * codec none, verified where it lies in the LMDB map (record checksum, q8/q4 rows,
 * header and positions, as the copy route checks them) and returned in @p *rec for
 * an upload straight from the map. Its layout is kvz_load_place(0, ..) shifted so
 * that @p at.x is the record start (offsets at.pos - at.x, at.k - at.x, ...).
 * @p *rec is valid while a read transaction of this environment as old as @p w's
 * stays open (kvz_store_map_layer).
 * @return 0; KVZ_ERR_UNSUPPORTED (not codec none, map_only, or the map is not the data
 *   file: take kvz_load_record); the errors of kvz_load_record.
 */
int kvz_load_record_mapped(kvz_load_reader *w, const kvz_blob_meta *m, const uint8_t hash[16], uint32_t l,
                           kvz_load_at at, const uint8_t **rec);

/**
 * The direct route when the device verifies the record (the CUDA loader): where LAYER
 * record @p l of blob @p hash lies in the map (as kvz_load_record_peek), and every
 * check of kvz_load_record_mapped() that does not read the payload: its header and
 * positions, copied under the store's fault guard (kvz_blob_layer_head). The record
 * checksum and the q8/q4 rows are NOT checked: the caller has the device compute the
 * XXH3-64 of the payload with @p *seed (kvz_blob_record_seed) and compares it with
 * kvz_blob_record_checksum() (@p *want: the header's rec_xxh3), and has the rows
 * checked (kvz_load_bad_rows() says a bad one), before the load counts. A record that
 * fails a check here is verified as kvz_load_record_mapped() verifies it, so the error
 * is the one the host route gives. The caller counts the record (records_direct,
 * records_dev_verified, bytes) once it takes this route.
 * @return 0; KVZ_ERR_UNSUPPORTED (another length or codec, map_only, or the map is not
 *   the data file: take kvz_load_record); the errors of kvz_load_record_mapped().
 */
int kvz_load_record_head(kvz_load_reader *w, const kvz_blob_meta *m, const uint8_t hash[16], uint32_t l,
                         kvz_load_at at, const uint8_t **rec, uint64_t *seed, uint64_t *want);

/** The error for q8/q4 row @p bad (K rows 0..kept-1, then V rows) of layer @p l of
 *  blob @p m: KVZ_ERR_FORMAT, "layer L K|V row R: bad q8 scale block (...)", as
 *  kvz_blob_decode_layer says it. */
int kvz_load_bad_rows(const kvz_blob_meta *m, uint32_t l, uint64_t kept, uint64_t bad);

/** Add the worker fields and counts of @p p into @p sum (the caller holds any lock). */
void kvz_load_profile_add(kvz_load_profile *sum, const kvz_load_profile *p);

/** What a pool of workers shares: one lock, one condition, the first error. */
typedef struct kvz_load_sync {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int err;           /**< the first error (0: none); set under mu */
    char detail[512];  /**< its message, naming the document (and record) */
} kvz_load_sync;

void kvz_load_sync_init(kvz_load_sync *s);
void kvz_load_sync_destroy(kvz_load_sync *s);

/** Record error @p rc of this thread (its kvz_error_detail(), or kvz_strerror when
 *  empty) unless an earlier one is there: "document 'DOC' layer record L: ..." or,
 *  with @p layer == UINT32_MAX, "document 'DOC': ...". Wakes every waiter. */
void kvz_load_sync_fail(kvz_load_sync *s, int rc, const char *doc, uint32_t layer);

/** Start up to @p n threads running @p fn(@p arg) into @p th; returns how many started. */
int kvz_load_spawn(pthread_t *th, int n, void *(*fn)(void *), void *arg);

/** Join the @p n threads of @p th. */
void kvz_load_join(pthread_t *th, int n);

/** Pinned staging slots for a pipelined GPU load of @p ntask records with @p *want
 *  workers: want + 2 slots (a slot in flight to the device and one ready to send while
 *  every worker fills one), at most @p max_slots and @p ntask; *want is cut to the
 *  slots. Returns the slot count. */
int kvz_load_plan_slots(int *want, uint32_t ntask, int max_slots);

#endif
