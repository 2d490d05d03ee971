/**
 * @file kvz_store.h
 * @brief LMDB store of compressed KV blobs, keyed by content hash, named by doc id.
 *
 * A store is a directory holding one LMDB environment (data.mdb, lock.mdb) with
 * four named databases (byte layout: docs/FORMAT.md §6):
 *   - "blobs": hash[16] || u32 BE record index -> one KVZB record (format/kvz_blob.h).
 *              Index = the record's layer, 0xFFFFFFFF for the META record.
 *   - "refs":  hash[16] -> refcount, record count, stored bytes (how many doc ids
 *              point at the blob; the blob is deleted when it drops to 0).
 *   - "docs":  doc id (1..511 bytes, no NUL) -> doc info (kvz_store_doc_info).
 *   - "meta":  "format_version" (u32 LE), "created_by" (text), "model_fp" (16 bytes,
 *              set by the first put_doc); "retired" only in the old files of a
 *              compacted store (kvz_store_compact): writes then fail with KVZ_ERR_BUSY.
 * A store holds blobs of exactly one model: opening it with another fingerprint,
 * or putting a blob made by another model, fails with KVZ_ERR_MODEL.
 *
 * Transactions and concurrency
 *   - Every write (put_doc, delete_doc) is exactly one LMDB write transaction:
 *     a process killed at any moment leaves the store as it was before or after
 *     that call, never in between (LMDB's copy-on-write + fsync at commit).
 *   - LMDB serialises writers, within a process and across processes: a second
 *     writer blocks in its write call until the first commits or aborts. Readers
 *     never block and are never blocked by the writer.
 *   - The environment is opened with MDB_NOTLS: a read transaction
 *     (kvz_store_read) is not bound to the thread that began it, but must be
 *     used by one thread at a time.
 *   - A kvz_store handle may be shared by any number of threads.
 *   - Map growth: on MDB_MAP_FULL the write transaction is aborted, the map
 *     doubled (at least; capped by the max map size, default 1 TiB) and the
 *     whole transaction retried. Growing needs every transaction of *this
 *     process* on the store to be finished, so it waits for open read
 *     transactions of this process (up to 60 s, then KVZ_ERR_BUSY). Do not hold
 *     a kvz_store_read on the calling thread while writing, and avoid nesting
 *     read transactions on one thread: a pending growth (writers are preferred)
 *     makes the inner begin wait until that growth gives up (60 s).
 *   - Stale reader slots of killed processes are cleared at open.
 *
 * Damaged files
 *   - LMDB trusts its file. kvz_store_open refuses (KVZ_ERR_FORMAT, detail
 *     "store damaged: ...") an empty data.mdb, one shorter than its meta pages,
 *     and one shorter than the pages its B-tree uses (pages past the end that are
 *     all on LMDB's free list are fine).
 *   - Every call that walks LMDB pages runs under a SIGBUS/SIGSEGV guard (handlers
 *     installed once per process, on first use; a fault outside a guarded call
 *     goes to the handler that was there before): a damaged page ends the call
 *     with KVZ_ERR_FORMAT "store damaged: ... hit an unreadable page" naming what
 *     was being read, never a crash. Walks are bounded by the number of pages.
 *   - kvz_store_salvage copies every document that still reads back intact into
 *     a new store.
 *
 * Errors: 0 or a negative KVZ_ERR_*; LMDB/errno codes are kept in
 * kvz_error_detail(). Nothing prints or exits.
 */
#ifndef KVZ_STORE_H
#define KVZ_STORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVZ_STORE_VERSION 1u              /**< value of meta "format_version" */
#define KVZ_STORE_SOURCE_MAX 4096         /**< source_path buffer, incl. NUL */
#define KVZ_STORE_DOC_ID_MAX 511          /**< max doc id bytes (LMDB key limit) */
#define KVZ_STORE_DEFAULT_MAP (64ull << 20)
#define KVZ_STORE_DEFAULT_MAX_MAP (1ull << 40)

/** Open flags. */
enum {
    KVZ_STORE_CREATE = 1u,   /**< create the directory / databases if missing */
    KVZ_STORE_READONLY = 2u, /**< read-only environment: writes return KVZ_ERR_ARG */
    KVZ_STORE_SALVAGE = 4u,  /**< with READONLY: open a store whose data.mdb is cut short
                                  (refused otherwise) to copy out what is intact */
};

/** What kvz_store_put_doc() did (its *status). */
enum {
    KVZ_STORE_WRITTEN = 1,   /**< new records written, name points at them */
    KVZ_STORE_LINKED = 2,    /**< records of that hash already stored: only the name changed */
    KVZ_STORE_UNCHANGED = 3, /**< name already pointed at that hash with the same source path
                                  and part number:
                                  nothing written (no transaction committed) */
    KVZ_STORE_INFO_UPDATED = 4, /**< same hash, other source path or part number: only the doc
                                     info rewritten */
};

typedef struct kvz_store kvz_store;           /**< opaque store handle */
typedef struct kvz_store_read kvz_store_read; /**< opaque read transaction */

/** One document's entry in "docs". */
typedef struct kvz_store_doc_info {
    uint8_t hash[16];                       /**< content hash (kvz_blob_content_hash) */
    char source_path[KVZ_STORE_SOURCE_MAX]; /**< NUL-terminated, may be "" */
    uint64_t n_tokens;                      /**< tokens of the document (prefix + context) */
    float ratio;                            /**< kept ratio it was ingested with */
    uint8_t mode;                           /**< kvz_blob_mode */
    uint32_t n_records;     /**< set by put_doc: 1 + n_layer */
    uint64_t bytes_stored;  /**< set by put_doc: sum of record bytes (compressed) */
    uint64_t bytes_kv_full; /**< uncompressed bytes of the full cache (caller's figure) */
    uint64_t bytes_kv_kept; /**< uncompressed bytes of the kept pairs (caller's figure) */
    int64_t ingest_time;    /**< unix seconds; 0 on input = now */
    uint32_t part;          /**< N (1..KVZ_STORE_PART_MAX) when this entry is part N of a split
                                 document: its id is the parent's id + "#N" (kvz_ingest_document);
                                 0 for a whole document, and in entries written before parts
                                 were recorded */
} kvz_store_doc_info;

#define KVZ_STORE_PART_MAX 0xFFFFFFu      /**< largest part number a doc entry can record */

/** One record to store: bytes from kvz_blob_encode_*(). Read only; not retained. */
typedef struct kvz_store_rec {
    const uint8_t *data;
    size_t len;
} kvz_store_rec;

/** kvz_store_stats() output. */
typedef struct kvz_store_stats {
    uint64_t n_docs;        /**< entries in "docs" */
    uint64_t n_blobs;       /**< distinct content hashes stored */
    uint64_t n_records;     /**< entries in "blobs" */
    uint64_t bytes_records; /**< sum of stored record bytes */
    uint64_t map_size;      /**< current LMDB map size, bytes */
    uint64_t map_used;      /**< pages in use x page size */
    uint32_t page_size;
    uint64_t last_txnid;    /**< id of the last committed write transaction */
    int has_model;          /**< 1 when model_fp is recorded */
    uint8_t model_fp[16];   /**< valid when has_model */
} kvz_store_stats;

/* ------------------------------------------------------------------------- */
/* Open / close                                                                */

/**
 * Open (or with KVZ_STORE_CREATE create) the store in directory @p dir.
 * @param flags     KVZ_STORE_CREATE and/or KVZ_STORE_READONLY.
 * @param map_size  initial LMDB map size in bytes (0: KVZ_STORE_DEFAULT_MAP); an
 *                  existing store larger than this keeps its size. Grows on demand.
 * @param fp        model fingerprint of the caller (16 bytes) or NULL (no check;
 *                  e.g. listing tools). Checked against the recorded model.
 * @param out       out: handle, release with kvz_store_close().
 * @return 0; KVZ_ERR_ARG (NULL/flags); KVZ_ERR_NOTFOUND (no store there and no
 *         CREATE, or READONLY on a missing store); KVZ_ERR_IO (mkdir/permissions,
 *         errno in detail); KVZ_ERR_FORMAT (an LMDB file that is not a kvzip
 *         store, or not LMDB at all); KVZ_ERR_VERSION (other store/LMDB format
 *         version); KVZ_ERR_MODEL (store holds another model's blobs: both
 *         fingerprints in detail); KVZ_ERR_FULL; KVZ_ERR_LMDB; KVZ_ERR_NOMEM.
 */
int kvz_store_open(const char *dir, unsigned flags, uint64_t map_size, const uint8_t *fp,
                   kvz_store **out);

/** Close the handle. Every kvz_store_read must have ended. NULL-safe. */
void kvz_store_close(kvz_store *s);

/** Cap for map growth (default KVZ_STORE_DEFAULT_MAX_MAP). Not thread-safe against writers. */
void kvz_store_set_max_map(kvz_store *s, uint64_t max_bytes);

/* ------------------------------------------------------------------------- */
/* Writes (each one LMDB write transaction; blocks while another writer runs)  */

/**
 * Store a document: in ONE write transaction, write the blob's records unless
 * its hash is already stored, point @p doc_id at @p hash, and if @p doc_id
 * pointed at another hash, drop that reference (deleting the old records when
 * no doc id references them any more).
 *
 * Records are verified before anything is written: the META record decodes, its
 * model is the store's (KVZ_ERR_MODEL), there is one LAYER record per layer, in
 * order, each intact and belonging to that META.
 *
 * @param doc_id  1..KVZ_STORE_DOC_ID_MAX bytes, NUL-terminated.
 * @param hash    content hash of the blob.
 * @param info    doc info; hash, n_records and bytes_stored are ignored (set by
 *                the store); ingest_time 0 means now. source_path must be NUL-terminated.
 * @param meta    the META record, or NULL to link @p doc_id to an already
 *                stored @p hash (then @p layers must be NULL / n_layers 0).
 * @param layers  n_layers LAYER records, layer 0 first.
 * @param status  out (may be NULL): KVZ_STORE_WRITTEN / LINKED / UNCHANGED / INFO_UPDATED.
 * @return 0; KVZ_ERR_ARG (bad arguments, READONLY store, doc id too long);
 *         kvz_blob_check/kvz_blob_decode_meta errors for a bad record
 *         (KVZ_ERR_FORMAT, KVZ_ERR_CHECKSUM, ...); KVZ_ERR_MODEL;
 *         KVZ_ERR_NOTFOUND (meta NULL and hash not stored); KVZ_ERR_FULL (map
 *         cannot grow further, or the disk is full: store unchanged);
 *         KVZ_ERR_BUSY (growth waited too long for this process's readers);
 *         KVZ_ERR_LMDB; KVZ_ERR_NOMEM.
 */
int kvz_store_put_doc(kvz_store *s, const char *doc_id, const uint8_t hash[16],
                      const kvz_store_doc_info *info, const kvz_store_rec *meta,
                      const kvz_store_rec *layers, uint32_t n_layers, int *status);

/**
 * Remove @p doc_id (one write transaction); its blob's records go too when no
 * other doc id references them.
 * @return 0; KVZ_ERR_NOTFOUND; KVZ_ERR_ARG; KVZ_ERR_FULL; KVZ_ERR_BUSY; KVZ_ERR_LMDB.
 */
int kvz_store_delete_doc(kvz_store *s, const char *doc_id);

/* ------------------------------------------------------------------------- */
/* Reads with an implicit short read transaction                              */

/** Doc info of @p doc_id. @return 0; KVZ_ERR_NOTFOUND; KVZ_ERR_ARG; KVZ_ERR_FORMAT
 *  / KVZ_ERR_VERSION (corrupt entry); KVZ_ERR_LMDB. */
int kvz_store_lookup(kvz_store *s, const char *doc_id, kvz_store_doc_info *info);

/** 1 if records of @p hash are stored, 0 if not, negative KVZ_ERR_* on failure. */
int kvz_store_has_hash(kvz_store *s, const uint8_t hash[16]);

/**
 * Call @p cb for every doc, in doc id byte order, inside one read transaction.
 * @p cb gets a NUL-terminated doc id and its info (both valid during the call
 * only); returning nonzero stops the walk and kvz_store_list returns that value.
 * @p cb must not write to the same store.
 * @return 0, the callback's nonzero value, or a negative KVZ_ERR_*.
 */
int kvz_store_list(kvz_store *s,
                   int (*cb)(void *user, const char *doc_id, const kvz_store_doc_info *info),
                   void *user);

/** Counts and sizes (see kvz_store_stats). @return 0 or KVZ_ERR_LMDB. */
int kvz_store_stats_get(kvz_store *s, kvz_store_stats *st);

/* ------------------------------------------------------------------------- */
/* Streaming reads: an explicit read transaction                              */

/**
 * Begin a read transaction: a consistent snapshot until kvz_store_read_end().
 * @return 0; KVZ_ERR_BUSY; KVZ_ERR_LMDB (e.g. MDB_READERS_FULL); KVZ_ERR_NOMEM.
 */
int kvz_store_read_begin(kvz_store *s, kvz_store_read **r);

/** End the read transaction. Every pointer obtained through @p r dies here. NULL-safe. */
void kvz_store_read_end(kvz_store_read *r);

/** kvz_store_lookup() inside @p r's snapshot. Same errors. */
int kvz_store_read_doc(kvz_store_read *r, const char *doc_id, kvz_store_doc_info *info);

/**
 * The META record of @p hash, verified with kvz_blob_check() (framing + record
 * checksum; the payload is checked when decoded).
 * @param rec,len  out: points into the LMDB map — read only, VALID ONLY UNTIL
 *                 kvz_store_read_end(r). Decode it with kvz_blob_decode_meta().
 * @return 0; KVZ_ERR_NOTFOUND (no such record; but when @p hash is the blob of
 *         the document last read with kvz_store_read_doc(r), a missing record is
 *         damage: KVZ_ERR_FORMAT "store damaged: document 'ID' ... is missing");
 *         KVZ_ERR_CHECKSUM / KVZ_ERR_TRUNCATED / KVZ_ERR_FORMAT / KVZ_ERR_VERSION
 *         (corrupt record); KVZ_ERR_LMDB.
 */
int kvz_store_read_meta(kvz_store_read *r, const uint8_t hash[16], const uint8_t **rec,
                        size_t *len);

/**
 * LAYER record @p l of @p hash, verified like kvz_store_read_meta() (and that
 * it is layer @p l). Pointer VALID ONLY UNTIL kvz_store_read_end(r).
 * Decode with kvz_blob_decode_layer(). Same errors as kvz_store_read_meta().
 */
int kvz_store_read_layer(kvz_store_read *r, const uint8_t hash[16], uint32_t l,
                         const uint8_t **rec, size_t *len);

/** Called by kvz_store_copy_layer() after each piece: bytes [0, @p done) of the
 *  record are in place. A nonzero return stops the copy and is returned. */
typedef int (*kvz_store_piece_fn)(void *user, size_t done);

/**
 * LAYER record @p l of @p hash copied into @p dst with pread() from data.mdb, in
 * pieces of at most 256 KiB (@p piece, may be NULL, runs after each: a reader hashes
 * each piece while it is still in the CPU cache). No page of the map is touched,
 * so there are no page faults on the map, and a data file cut short is a short
 * read (an error), not SIGBUS. For readers that want the bytes in their own
 * memory (the pipelined loader's pinned staging, ingest/kvz_load.c).
 * NOTHING IS VERIFIED here: check the copy (kvz_blob_layer_placed(), or
 * kvz_blob_decode_layer()).
 * @param cap  the length the caller expects; a record of another length is not
 *             copied: *len says its length and 0 is returned.
 * @return 0; KVZ_ERR_NOTFOUND / KVZ_ERR_FORMAT (missing record, as
 *         kvz_store_read_layer()); KVZ_ERR_FORMAT (data.mdb ends inside the record:
 *         store damaged); KVZ_ERR_IO; KVZ_ERR_UNSUPPORTED (the map cannot be matched
 *         to the data file in /proc/self/maps: read through kvz_store_read_layer());
 *         KVZ_ERR_LMDB; what @p piece returned.
 */
int kvz_store_copy_layer(kvz_store_read *r, const uint8_t hash[16], uint32_t l, void *dst, size_t cap, size_t *len,
                         kvz_store_piece_fn piece, void *user);

/**
 * LAYER record @p l of @p hash where it lies in the map, for a reader that uses the
 * bytes in place (the CUDA loader uploads them straight from the map, registered
 * with the driver): @p piece runs over the record in pieces of at most 256 KiB as
 * kvz_store_copy_layer() runs it (the reader hashes and checks them), under the
 * store's fault guard, so a page that cannot be read is an error, not SIGBUS.
 * @param cap  the length the caller expects; for a record of another length *rec is
 *             NULL, *len its length and 0 is returned (nothing read).
 * @param rec  the record in the map, set before @p piece first runs (the callback
 *             reads the bytes through it) and NULL again on an error: VALID ONLY UNTIL kvz_store_read_end(r), and
 *             while no writer can reuse its pages: the caller keeps this transaction
 *             (or an older one of this environment) open while it uses the bytes.
 * @return 0; KVZ_ERR_NOTFOUND / KVZ_ERR_FORMAT (as kvz_store_copy_layer(); also a
 *         data.mdb shorter than the record's end); KVZ_ERR_UNSUPPORTED (the map
 *         cannot be matched to the data file); KVZ_ERR_LMDB; what @p piece returned.
 */
int kvz_store_map_layer(kvz_store_read *r, const uint8_t hash[16], uint32_t l, size_t cap, const uint8_t **rec,
                        size_t *len, kvz_store_piece_fn piece, void *user);

/**
 * Where LAYER record @p l of @p hash lies in the map, without reading it: the checks
 * of kvz_store_map_layer() before its pieces (the record is @p cap bytes long and
 * inside data.mdb), and its first @p head_len bytes copied to @p head under the fault
 * guard (the CUDA loader reads the record header there, starts the upload, and then
 * verifies the whole record with kvz_store_map_layer()). For a record of another
 * length *rec is NULL, *len its length and 0 is returned. Same validity and errors as
 * kvz_store_map_layer().
 */
int kvz_store_map_peek(kvz_store_read *r, const uint8_t hash[16], uint32_t l, size_t cap, const uint8_t **rec,
                       size_t *len, void *head, size_t head_len);

/** Who pins pages of the map for kvz_store_pin() (the CUDA loader: cudaHostRegister),
 *  with no dependency of the store on that library. */
typedef struct kvz_store_pinner {
    int (*pin)(const void *p, size_t n, void **handle); /**< 0, or a KVZ_ERR_* */
    void (*unpin)(void *handle);
    uint64_t budget; /**< most bytes of the map pinned at once */
} kvz_store_pinner;

/**
 * Keep [@p p, @p p + @p n) — bytes of the map read in transaction @p r (e.g. a record
 * from kvz_store_map_layer) — pinned by @p pinner until the store closes: whole
 * 64 MiB pieces of the map are pinned the first time a record in them is (the
 * data file's end cuts the last piece; a piece the file has grown past is pinned
 * on), so later reads of the same region pay nothing. Every pin is undone before
 * the map may move (a resize of this process, or adopting another's) and by
 * kvz_store_close(). The first pinner stays the store's. Thread-safe.
 * A copy from pinned memory must not cross from one pin into the next (CUDA refuses
 * it): @p cuts receives the offsets in (0, n), ascending, where a pin starts inside
 * the range (*@p n_cuts of them, at most @p max_cuts; NULL/0 when the caller does
 * not need them).
 * @return 0; KVZ_ERR_FULL (the budget would be passed: nothing more is pinned);
 *   KVZ_ERR_UNSUPPORTED (the range is not in the data file, another pinner, or more
 *   than max_cuts cuts); what pin() returned; KVZ_ERR_NOMEM.
 */
int kvz_store_pin(kvz_store_read *r, const void *p, size_t n, const kvz_store_pinner *pinner, size_t *cuts,
                  int max_cuts, int *n_cuts);

/** Bytes of the map kvz_store_pin() holds pinned now. */
uint64_t kvz_store_pinned_bytes(kvz_store *s);

/** kvz_store_copy_layer() for record @p l of the shared prefix blob @p hash
 *  (kvz_store_read_prefix()'s records). Same results; KVZ_ERR_NOTFOUND when the
 *  store has no such record. */
int kvz_store_copy_prefix(kvz_store_read *r, const uint8_t hash[16], uint32_t l, void *dst, size_t cap,
                          size_t *len, kvz_store_piece_fn piece, void *user);

/**
 * The first document whose id sorts after @p after (NULL or "": the first one), in
 * @p r's snapshot: its id into @p id (NUL-terminated) and its info. One step of a
 * walk that can go on past a damaged stretch of "docs" by seeking further on.
 * @return 0; KVZ_ERR_NOTFOUND (no more); KVZ_ERR_FORMAT / KVZ_ERR_VERSION (an entry
 *         that does not decode: @p id is set when its key was readable, "" if not;
 *         or a damaged page); KVZ_ERR_LMDB.
 */
int kvz_store_read_next_doc(kvz_store_read *r, const char *after, char id[KVZ_STORE_DOC_ID_MAX + 1],
                            kvz_store_doc_info *info);

/* ------------------------------------------------------------------------- */
/* Maintenance: verify, garbage-collect, compact                              */

/** kvz_store_verify() output. */
typedef struct kvz_store_verify_result {
    uint64_t n_docs;      /**< doc entries checked */
    uint64_t n_blobs;     /**< refs entries (blobs) checked */
    uint64_t n_records;   /**< records read and decoded */
    uint64_t n_problems;  /**< problems reported through the callback */
    uint64_t n_prefixes;  /**< shared prefix blobs checked (kvz_store_put_doc_shared) */
} kvz_store_verify_result;

/**
 * Problem callback of kvz_store_verify(): @p err is the KVZ_ERR_* class of the
 * problem, @p msg one line without a newline naming the doc id / blob hash /
 * record and what is wrong (valid during the call only). Return nonzero to stop.
 */
typedef int (*kvz_store_problem_fn)(void *user, int err, const char *msg);

/**
 * Check the whole store inside one read transaction (a consistent snapshot;
 * writers may run meanwhile). Checks:
 *   - meta: format_version (checked at open), model_fp 16 bytes when present,
 *     no "retired" marker;
 *   - every "docs" entry decodes, its hash has a "refs" entry, and its
 *     n_records / bytes_stored equal that entry's;
 *   - every "refs" entry: refcount = number of doc ids naming the hash (>= 1),
 *     n_records = 1 + n_layer, bytes = sum of its record lengths;
 *   - every blob: the META record decodes with the store's model fingerprint
 *     (kvz_blob_decode_meta), every LAYER record 0..n_layer-1 is present and
 *     decodes completely (record checksum, zstd, payload checksum, positions),
 *     no other record carries its hash;
 *   - every "blobs" key is 20 bytes and belongs to a hash in "refs" (no orphans);
 *   - a blob with a shared prefix (version 2, policy SHARED): its prefix blob is
 *     stored and matches it (model, dims, dtype, n_prefix); every stored prefix
 *     blob decodes completely (checked once, however many blobs share it).
 * Each problem is reported once through @p cb (may be NULL) and counted.
 * Memory: one layer's decoded arrays at a time.
 * @param res  out (may be NULL).
 * @return 0 when the walk completed (look at res->n_problems), the callback's
 *         nonzero value, or KVZ_ERR_LMDB / KVZ_ERR_BUSY / KVZ_ERR_NOMEM when the
 *         store could not be walked.
 */
int kvz_store_verify(kvz_store *s, kvz_store_problem_fn cb, void *user,
                     kvz_store_verify_result *res);

/** kvz_store_gc() output. */
typedef struct kvz_store_gc_result {
    uint64_t blobs_dropped;    /**< refs entries no doc id names, deleted with their records */
    uint64_t records_dropped;  /**< records deleted (of dropped blobs and orphans) */
    uint64_t bytes_dropped;    /**< their bytes */
    uint64_t orphan_records;   /**< records whose hash had no refs entry (included above) */
    uint64_t refs_fixed;       /**< refcounts rewritten to the number of names */
    uint64_t prefixes_dropped; /**< shared prefix blobs no stored blob references any more
                                    (their records are counted in records/bytes_dropped) */
} kvz_store_gc_result;

/**
 * Garbage-collect in ONE write transaction: recount the doc ids naming each
 * hash; delete every blob no doc id names (its refs entry and records); fix
 * refcounts that disagree with the names; delete records whose hash has no refs
 * entry; delete shared prefix blobs that no remaining blob's META references (a
 * prefix is kept while any blob references it; if some META does not decode,
 * every prefix is kept). With the normal write path refcounts never drift, so on a healthy store
 * this finds nothing and commits nothing. Doc ids whose blob is missing are
 * left alone (kvz_store_verify reports them; re-ingest or delete them).
 * The freed pages are reused by later writes; the file does not shrink (see
 * kvz_store_compact()).
 * @param res  out (may be NULL).
 * @return 0; KVZ_ERR_ARG (READONLY); KVZ_ERR_FORMAT (a doc entry that does not
 *         decode: nothing deleted); KVZ_ERR_FULL; KVZ_ERR_BUSY; KVZ_ERR_LMDB; KVZ_ERR_NOMEM.
 */
int kvz_store_gc(kvz_store *s, kvz_store_gc_result *res);

/**
 * Replace the store's files by a compacted copy (free pages dropped, pages
 * renumbered), so data.mdb shrinks to what is in use. Steps:
 *   1. begin a write transaction on @p s: this holds LMDB's writer lock, so no
 *      writer of any process can commit while the copy is made;
 *   2. mdb_env_copy2(MDB_CP_COMPACT) of the last committed snapshot into a new
 *      directory ".<name>.compact.<pid>" beside the store (same filesystem),
 *      fsync'd and re-opened read-only as a check;
 *   3. swap the two directories atomically (renameat2 RENAME_EXCHANGE; where the
 *      filesystem lacks it, two renames with a short window in which the store
 *      path is missing);
 *   4. write a "retired" marker into the OLD environment and commit, releasing
 *      the writer lock; delete the old files.
 * Other processes: one that opens the store after step 3 sees the new files.
 * One that had it open before keeps the old (deleted) files mapped: its reads
 * still see a consistent (old) snapshot, and every write it attempts — including
 * writers that were blocked on the lock during the copy — fails with
 * KVZ_ERR_BUSY ("replaced by a compacted copy; reopen") because of the marker,
 * so no committed write is lost. The one gap: a crash between steps 3 and 4
 * leaves the old files unmarked, and a process that still has them open could
 * then commit into them unseen. So: run compaction when no ingest is running
 * (kvzip-store gc --compact documents this too). A crash before step 3 leaves
 * the store as it was plus a stale ".compact." directory, removed by the next
 * compaction.
 * After success @p s is retired: every write through it fails with
 * KVZ_ERR_BUSY; close it and open the store again.
 * Needs free disk space for the copy (about the size of the data in use).
 * @param bytes_before,bytes_after  out (may be NULL): data.mdb sizes.
 * @return 0; KVZ_ERR_ARG (READONLY, NULL); KVZ_ERR_IO (mkdir/rename/fsync,
 *         errno in detail); KVZ_ERR_FULL (disk full during the copy: store
 *         untouched); KVZ_ERR_BUSY; KVZ_ERR_LMDB; KVZ_ERR_NOMEM.
 */
int kvz_store_compact(kvz_store *s, uint64_t *bytes_before, uint64_t *bytes_after);

/* ------------------------------------------------------------------------- */
/* Shared system prefix (docs/FORMAT.md §3.1, §6.6)                            */
/*
 * The system prefix's K/V is identical in every document of a model, so a
 * version-2 blob with prefix policy SHARED does not hold it: it names a prefix
 * blob (an ordinary KVZB blob with n_context 0) by its content hash, stored once
 * in the database "prefixes" (key hash[16] || u32 BE record index, value the
 * record, as in "blobs"; no refcount: kvz_store_gc drops a prefix once no blob
 * references it). The database is created by the first shared put.
 */

/** 1 if the prefix blob @p hash is stored (its META record), 0 if not, or a
 *  negative KVZ_ERR_* (KVZ_ERR_LMDB). */
int kvz_store_has_prefix(kvz_store *s, const uint8_t hash[16]);

/**
 * kvz_store_put_doc() for a blob with a shared prefix, in ONE write transaction:
 * write the prefix blob's records if @p prefix_hash is not stored yet, then do
 * exactly what kvz_store_put_doc() does with the document's records. Before
 * anything is written the records are verified as kvz_store_put_doc() does, and:
 * the document META has policy SHARED and prefix_ref == @p prefix_hash; the
 * prefix META (when given) has n_context 0, policy KEEP, the document's model,
 * dims, dtype and n_prefix, and one LAYER record per layer.
 * @param pmeta,players  the prefix blob's META and n_layer LAYER records, or NULL
 *                 when the caller knows it is stored (if it is not, e.g. a
 *                 concurrent gc dropped it: KVZ_ERR_NOTFOUND, nothing written).
 * @param status   as kvz_store_put_doc(); @p prefix_written (may be NULL): 1 when
 *                 the prefix records were written by this call.
 * @return kvz_store_put_doc()'s codes.
 */
int kvz_store_put_doc_shared(kvz_store *s, const char *doc_id, const uint8_t hash[16],
                             const kvz_store_doc_info *info, const kvz_store_rec *meta,
                             const kvz_store_rec *layers, uint32_t n_layers,
                             const uint8_t prefix_hash[16], const kvz_store_rec *pmeta,
                             const kvz_store_rec *players, int *status, int *prefix_written);

/**
 * Record @p index (a layer, or KVZ_BLOB_META_LAYER) of prefix blob @p hash,
 * verified with kvz_blob_check() (and that it is that record). Pointer into the
 * map: VALID ONLY UNTIL kvz_store_read_end(r).
 * @return 0; KVZ_ERR_NOTFOUND (no such prefix record); kvz_blob_check() errors;
 *         KVZ_ERR_LMDB.
 */
int kvz_store_read_prefix(kvz_store_read *r, const uint8_t hash[16], uint32_t index,
                          const uint8_t **rec, size_t *len);

/** Bytes of all stored prefix records, and their number of prefix blobs (either
 *  out may be NULL). @return 0 or KVZ_ERR_LMDB. */
int kvz_store_prefix_stats(kvz_store *s, uint64_t *n_prefixes, uint64_t *bytes);
/** kvz_store_salvage() output. */
typedef struct kvz_store_salvage_result {
    uint64_t n_docs;    /**< documents found in the source */
    uint64_t n_copied;  /**< copied to the new store, every record decoded intact */
    uint64_t n_lost;    /**< documents found but not copied (damaged) */
    uint64_t n_gaps;    /**< stretches of "docs" that could not be read (ids unknown) */
} kvz_store_salvage_result;

/**
 * Lost-document callback of kvz_store_salvage(): @p doc_id is the document (NULL
 * for a stretch of the index that could not be read), @p msg one line. Return
 * nonzero to stop.
 */
typedef int (*kvz_store_lost_fn)(void *user, const char *doc_id, int err, const char *msg);

/**
 * Copy every document of @p src whose entry and records read back intact (the
 * META record decodes with the store's model, every layer decodes completely)
 * into a new store in @p dst_dir, keeping ids, doc info and shared blobs. Reads
 * go on past damaged pages: an unreadable stretch of the doc index is skipped by
 * seeking to the next possible ids. @p src may be opened with
 * KVZ_STORE_READONLY | KVZ_STORE_SALVAGE (a data.mdb cut short).
 * When nothing could be copied and something was lost (or the walk failed), the new
 * store is removed again (and @p dst_dir, if this call made it): no empty store is
 * left that could pass for the salvage.
 * @return 0 when the walk completed (look at res->n_lost / n_gaps); KVZ_ERR_ARG
 *         (@p dst_dir already holds a store); the callback's nonzero value; or an
 *         error opening / writing the new store (KVZ_ERR_IO, KVZ_ERR_FULL, ...).
 */
int kvz_store_salvage(kvz_store *src, const char *dst_dir, kvz_store_lost_fn cb, void *user,
                      kvz_store_salvage_result *res);

/* ------------------------------------------------------------------------- */
/* Scale-out: user metadata and snapshots (docs/SCALE.md)                       */

/**
 * Set metadata @p key (1..64 bytes, not one of the store's own keys
 * format_version, created_by, model_fp, retired) to @p len bytes (<= 4096), in
 * one write transaction; no commit when the value is already that.
 * @return 0; KVZ_ERR_ARG (reserved or bad key, READONLY); KVZ_ERR_FULL; KVZ_ERR_BUSY; KVZ_ERR_LMDB.
 */
int kvz_store_meta_set(kvz_store *s, const char *key, const void *val, size_t len);

/**
 * Read metadata @p key into @p buf (at most @p cap bytes copied); *len = its full size.
 * @return 0; KVZ_ERR_NOTFOUND; KVZ_ERR_ARG; KVZ_ERR_LMDB.
 */
int kvz_store_meta_get(kvz_store *s, const char *key, void *buf, size_t cap, size_t *len);

/**
 * Write a consistent, compacted copy of the store into folder @p dir
 * (mdb_env_copy2 with MDB_CP_COMPACT inside one read transaction: the last
 * snapshot committed when the copy began; writers of any process go on
 * meanwhile). The copy is made in a hidden sibling folder, fsync'd, checked to
 * open as a kvzip store, and renamed to @p dir, so @p dir never holds a partial
 * copy. @p dir must not exist or be an empty folder.
 * @return 0; KVZ_ERR_ARG (dir non-empty, not a folder, the store itself);
 *         KVZ_ERR_IO; KVZ_ERR_FULL (disk full); KVZ_ERR_LMDB.
 */
int kvz_store_snapshot(kvz_store *s, const char *dir);

#ifdef __cplusplus
}
#endif
#endif /* KVZ_STORE_H */
