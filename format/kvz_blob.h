/**
 * @file kvz_blob.h
 * @brief Versioned, checksummed blob format for one document's compressed KV
 *        cache (byte-level spec: docs/FORMAT.md). Writers write version 2;
 *        readers read versions 1 and 2.
 *
 * A blob is one META record plus one LAYER record per model layer. Every record
 * is self-contained and independently verifiable, so a query can stream layers
 * one by one out of the store:
 *
 *     record = header (56 bytes, little-endian) || payload (comp_size bytes)
 *
 * The payload is one zstd frame (codec zstd), several independent frames of
 * KVZ_BLOB_ZSTD_FRAME_RAW raw bytes each (codec zstd-frames: version 2 LAYER
 * records larger than one frame, decoded on several threads) or the raw bytes
 * (codec none, version 2 only): the encoder measures zstd on every record and
 * keeps it only when it saves more than KVZ_BLOB_ZSTD_MIN_SAVING_PCT percent.
 *
 * The header carries the magic "KVZB", the format version, the record kind, the
 * layer index, the blob id (ties each LAYER record to its META record), the
 * uncompressed and compressed sizes, an XXH3-64 of the uncompressed payload and
 * an XXH3-64 over the header and the compressed bytes. Readers verify all of it
 * before trusting any field, and bound every allocation by limits in this file.
 *
 * Data model (per layer l, per KV head h, head-major):
 *   c[l][h]                 kept pairs of that head (includes the n_prefix system
 *                           prefix pairs when prefix_policy == KVZ_PREFIX_KEEP)
 *   pos  u32 (c)            original token positions, strictly ascending
 *   K    rows (c, row bytes) post-RoPE keys, stored type dtype (common/kvz_kvdtype.h:
 *                           f32/f16/bf16, or q8/q4 rows with their scale blocks)
 *   V    rows (c, row bytes) values
 * With prefix policy SHARED (version 2) the n_prefix system-prefix pairs are not
 * in the blob: they are stored once, as a blob of their own (n_context 0, policy
 * KEEP) whose content hash is meta.prefix_ref, and the reader prepends them.
 * A layer's flat head-major arrays concatenate the heads: head h starts at row
 * off[h] = c[l][0] + ... + c[l][h-1]; see kvz_blob_layer_offsets(). Queries
 * continue at position n_prefix + n_context.
 *
 * Threading: every function is reentrant; none keeps global state except the
 * thread-local error detail (kvz_error_detail()) and a process-wide count of the
 * threads zstd-frames decodes may add (at most one per CPU in all). Nothing
 * prints or exits.
 * Host byte order must be little-endian (checked at compile time).
 */
#ifndef KVZ_BLOB_H
#define KVZ_BLOB_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------- */
/* Constants                                                                   */

#define KVZ_BLOB_MAGIC "KVZB"           /**< 4 bytes at offset 0 of every record */
#define KVZ_BLOB_VERSION 2u             /**< the version writers write (meta.version 0) */
#define KVZ_BLOB_VERSION_MIN 1u         /**< oldest version this build reads */
#define KVZ_BLOB_HEADER_SIZE 56u        /**< fixed record header size, bytes */
#define KVZ_BLOB_META_FIXED_SIZE 72u    /**< version 1: META payload bytes before the counts */
#define KVZ_BLOB_META_FIXED_SIZE_V2 88u /**< version 2: the same + prefix_ref[16] */
#define KVZ_BLOB_PARAMS_SIZE 16u        /**< bytes of kvz_blob_params_bytes() */
#define KVZ_BLOB_META_LAYER 0xFFFFFFFFu /**< layer field of a META record */
#define KVZ_BLOB_DEFAULT_LEVEL 3        /**< default zstd level */
#define KVZ_BLOB_LEVEL_NONE (-1)        /**< level argument: codec none, no zstd attempt (v2) */
#define KVZ_BLOB_ZSTD_MIN_SAVING_PCT 20 /**< zstd kept only if the frames are < 80% of the raw bytes */
#define KVZ_BLOB_ZSTD_FRAME_RAW (2u << 20) /**< raw bytes per frame of codec zstd-frames */
#define KVZ_BLOB_DECODE_THREADS 16      /**< most threads one zstd-frames record is decoded on (spare CPUs only) */

/* Reader limits: a header outside them is rejected with KVZ_ERR_FORMAT before
 * anything is allocated. They are far above any real model. */
#define KVZ_BLOB_MAX_LAYERS 1024u
#define KVZ_BLOB_MAX_HEADS 1024u     /**< query heads and KV heads */
#define KVZ_BLOB_MAX_HEAD_DIM 1024u
#define KVZ_BLOB_MAX_TOKENS (1u << 30) /**< n_prefix + n_context */

/** Record kinds (header byte 6). */
typedef enum { KVZ_BLOB_KIND_META = 1, KVZ_BLOB_KIND_LAYER = 2 } kvz_blob_kind;

/** Payload codecs (header byte 7). Version 1 knows only zstd. */
typedef enum {
    KVZ_BLOB_CODEC_NONE = 0,       /**< version 2: the payload itself */
    KVZ_BLOB_CODEC_ZSTD = 1,       /**< one zstd frame */
    KVZ_BLOB_CODEC_ZSTD_FRAMES = 2 /**< version 2 LAYER records: 2+ independent zstd frames of
                                        KVZ_BLOB_ZSTD_FRAME_RAW raw bytes each (the last one the rest),
                                        each with its content size, decodable in parallel */
} kvz_blob_codec;

/** Stored KV row types: the numbering of common/kvz_kvdtype.h (f32 4, f16 2, bf16
 *  2 bytes per element; q8/q4 rows with scale blocks, version 2 only, head_dim a
 *  multiple of 32). Row bytes: kvz_kv_row_bytes() / kvz_blob_kv_row_bytes(). */
typedef enum {
    KVZ_DTYPE_F32 = 0, KVZ_DTYPE_F16 = 1, KVZ_DTYPE_BF16 = 2, KVZ_DTYPE_Q8 = 3, KVZ_DTYPE_Q4 = 4
} kvz_blob_dtype;

/** Eviction mode of the pipeline that produced the blob. */
typedef enum {
    KVZ_MODE_GLOBAL = 0,  /**< one threshold over all layers x heads x tokens */
    KVZ_MODE_UNIFORM = 1, /**< per-head top-k, same budget for every head */
} kvz_blob_mode;

/** What happened to the system-prefix pairs. */
typedef enum {
    KVZ_PREFIX_KEEP = 0, /**< stored in every head: each head's first n_prefix
                              positions are exactly 0..n_prefix-1 */
    KVZ_PREFIX_NONE = 1, /**< not stored (the runtime re-prefills them): every
                              position is >= n_prefix */
    KVZ_PREFIX_SHARED = 2, /**< version 2: stored once in the prefix blob named by
                                prefix_ref (shared by every document of the model);
                                this blob holds context pairs only (positions >= n_prefix) */
} kvz_blob_prefix;

/**
 * Everything the META record holds. Sized integer fields; no padding games —
 * the byte layout on disk is defined in docs/FORMAT.md, not by this struct.
 */
typedef struct kvz_blob_meta {
    uint8_t fingerprint[16]; /**< model fingerprint (GGUF / synthetic spec hash) */
    uint32_t n_layer;        /**< 1..KVZ_BLOB_MAX_LAYERS */
    uint32_t n_head;         /**< query heads, multiple of n_kv_head */
    uint32_t n_kv_head;      /**< 1..KVZ_BLOB_MAX_HEADS */
    uint32_t head_dim;       /**< 1..KVZ_BLOB_MAX_HEAD_DIM */
    uint8_t dtype;           /**< kvz_blob_dtype */
    uint8_t mode;            /**< kvz_blob_mode */
    uint8_t prefix_policy;   /**< kvz_blob_prefix */
    float ratio;             /**< fraction of context pairs kept, (0, 1] */
    uint32_t chunk;          /**< scoring chunk size m (default 2000), >= 1 */
    uint32_t overlap;        /**< tokens of chunk t-1 repeated in chunk t's prompt (8) */
    uint32_t n_prefix;       /**< system-prefix tokens */
    uint32_t n_context;      /**< context (document) tokens */
    /** Kept counts, (n_layer, n_kv_head) layer-major: counts[l*n_kv_head + h].
     *  For encoding: caller-owned, read only. After kvz_blob_decode_meta():
     *  malloc'd by the library, release with kvz_blob_meta_free(). */
    uint32_t *counts;
    /* Fields added with version 2 (at the end, so positional initialisers of the
     * fields above keep working; zero-initialised = a version-2 blob without a
     * shared prefix). */
    uint8_t prefix_ref[16]; /**< SHARED: content hash of the prefix blob; else all 0 */
    uint16_t version;       /**< record version: 0 = KVZ_BLOB_VERSION when encoding;
                                 set by kvz_blob_decode_meta() */
} kvz_blob_meta;

/** What kvz_blob_check() learns from a record header (after verifying it). */
typedef struct kvz_blob_info {
    uint8_t kind;       /**< kvz_blob_kind */
    uint32_t layer;     /**< layer index; KVZ_BLOB_META_LAYER for META */
    uint64_t blob_id;   /**< kvz_blob_meta_id() of the blob's META */
    uint64_t raw_size;  /**< uncompressed payload bytes */
    uint64_t comp_size; /**< compressed bytes after the header */
    uint64_t raw_xxh3;  /**< XXH3-64 of the uncompressed payload */
    uint16_t version;   /**< 1 or 2 */
    uint8_t codec;      /**< kvz_blob_codec */
} kvz_blob_info;

/* ------------------------------------------------------------------------- */
/* Helpers                                                                     */

/** Element size in bytes of f32/f16/bf16 (4, 2, 2); 0 for q8/q4 (no whole-byte
 *  element) and unknown types. Size buffers with kvz_blob_kv_row_bytes(). */
size_t kvz_blob_dtype_size(uint8_t dtype);

/** Bytes of one stored K (or V) row of @p m: kvz_kv_row_bytes(dtype, head_dim). */
size_t kvz_blob_kv_row_bytes(const kvz_blob_meta *m);

/**
 * Validate a meta struct (dims within the limits, n_head % n_kv_head == 0,
 * known dtype/mode/prefix policy, 0 < ratio <= 1, chunk >= 1, token counts
 * within KVZ_BLOB_MAX_TOKENS, counts non-NULL and each within what the prefix
 * policy allows).
 * @return 0, KVZ_ERR_ARG (detail says which field).
 */
int kvz_blob_meta_validate(const kvz_blob_meta *m);

/** Sum of counts over the heads of layer @p l (no bounds check on l). */
uint64_t kvz_blob_layer_kept(const kvz_blob_meta *m, uint32_t l);

/**
 * Per-head row offsets of layer @p l in the flat head-major arrays.
 * @param off  out, n_kv_head + 1 entries: off[h] first row of head h,
 *             off[n_kv_head] = total rows of the layer.
 */
void kvz_blob_layer_offsets(const kvz_blob_meta *m, uint32_t l, uint64_t *off);

/** Uncompressed LAYER payload bytes of layer l: kept * (4 + 2*row bytes). */
uint64_t kvz_blob_layer_raw_size(const kvz_blob_meta *m, uint32_t l);

/** Uncompressed bytes of all layers (positions + K + V) of the kept pairs. */
uint64_t kvz_blob_kv_bytes(const kvz_blob_meta *m);

/**
 * Blob id: XXH3-64 (seed 0) of the META payload serialized from @p m. Every
 * LAYER record of the blob carries it, so records of different blobs cannot be
 * mixed. @p m must be valid (kvz_blob_meta_validate).
 */
uint64_t kvz_blob_meta_id(const kvz_blob_meta *m);

/**
 * Canonical pipeline-parameter bytes (dtype, mode, prefix policy, ratio, chunk,
 * overlap; layout in docs/FORMAT.md) used in the content hash.
 */
void kvz_blob_params_bytes(const kvz_blob_meta *m, uint8_t out[KVZ_BLOB_PARAMS_SIZE]);

/**
 * Content hash (store key) = XXH3-128 over "KVZH" || u32 1 || fingerprint[16] ||
 * u32 params_len || params || u64 n || token ids as u32 LE, written in XXH128
 * canonical (big-endian) byte order. Pass the whole cached prompt
 * ([system prefix][context]) as @p tokens so a template change changes the hash.
 * @param params  e.g. kvz_blob_params_bytes(); may be NULL when params_len == 0.
 */
void kvz_blob_content_hash(const uint8_t fp[16], const uint8_t *params, size_t params_len,
                           size_t n, const int32_t *tokens, uint8_t out[16]);

/** Free what kvz_blob_decode_meta() allocated (counts) and zero the struct. NULL-safe. */
void kvz_blob_meta_free(kvz_blob_meta *m);

/* ------------------------------------------------------------------------- */
/* Encoding. Output records are malloc'd; the caller frees them with free().   */

/**
 * Encode the META record.
 * @param m      valid meta (counts caller-owned).
 * Writes version m->version (0: KVZ_BLOB_VERSION). Version 2 measures zstd on
 * the payload and writes codec none unless zstd saves more than
 * KVZ_BLOB_ZSTD_MIN_SAVING_PCT %; version 1 always writes zstd.
 * @param level  zstd level (1..ZSTD_maxCLevel(), or 0 for KVZ_BLOB_DEFAULT_LEVEL),
 *               or KVZ_BLOB_LEVEL_NONE: codec none without trying zstd (version 2).
 * @param out    out: malloc'd record; caller frees with free().
 * @param out_len out: record bytes.
 * @return 0, KVZ_ERR_ARG (invalid meta/level/NULL), KVZ_ERR_NOMEM, KVZ_ERR_ZSTD
 *         (zstd error name in detail).
 */
int kvz_blob_encode_meta(const kvz_blob_meta *m, int level, uint8_t **out, size_t *out_len);

/**
 * Encode LAYER record @p l from per-head arrays (no copying into a flat buffer).
 * @param pos  n_kv_head pointers; pos[h]: u32 (counts[l][h]) positions, strictly
 *             ascending, < n_prefix + n_context, honouring the prefix policy.
 * @param k    n_kv_head pointers; k[h]: (counts[l][h], row bytes) stored-type key rows, post-RoPE.
 * @param v    n_kv_head pointers; v[h]: (counts[l][h], row bytes) value rows.
 *             q8/q4 rows come from kvz_kvrow_encode() (format/kvz_kvrow.h).
 *             Pointers of heads with count 0 may be NULL.
 * @return 0, KVZ_ERR_ARG (invalid meta, l >= n_layer, NULL array, positions not
 *         ascending / out of range / prefix policy violated), KVZ_ERR_NOMEM,
 *         KVZ_ERR_ZSTD.
 */
int kvz_blob_encode_layer_heads(const kvz_blob_meta *m, uint32_t l, const uint32_t *const *pos,
                                const void *const *k, const void *const *v, int level,
                                uint8_t **out, size_t *out_len);

/**
 * Encode LAYER record @p l from flat head-major arrays (rows of head h start at
 * kvz_blob_layer_offsets()[h]). Same bytes as kvz_blob_encode_layer_heads().
 * @param pos  u32 (kept) positions.
 * @param k    (kept, row bytes) key rows.   @param v (kept, row bytes) value rows.
 * @return as kvz_blob_encode_layer_heads().
 */
int kvz_blob_encode_layer(const kvz_blob_meta *m, uint32_t l, const uint32_t *pos, const void *k,
                          const void *v, int level, uint8_t **out, size_t *out_len);

/* ------------------------------------------------------------------------- */
/* Decoding. Input is untrusted: any bytes give an error code, never a crash.  */

/**
 * Verify a record's framing without decompressing: length, magic, version
 * (1 or 2), record checksum, kind, codec (known for the version; codec none:
 * comp_size == raw_size), reserved bytes, size limits.
 * Checks, in order: len < header -> TRUNCATED; magic -> FORMAT; version ->
 * VERSION; record checksum mismatch -> TRUNCATED if the header says more bytes
 * than @p len holds, else CHECKSUM; then kind/codec/reserved/trailing bytes -> FORMAT.
 * @param info  out (may be NULL): header fields.
 * @return 0, KVZ_ERR_ARG (NULL rec), KVZ_ERR_TRUNCATED, KVZ_ERR_FORMAT,
 *         KVZ_ERR_VERSION, KVZ_ERR_CHECKSUM.
 */
int kvz_blob_check(const uint8_t *rec, size_t len, kvz_blob_info *info);

/**
 * Decode and validate a META record.
 * @param rec,len     record bytes (not retained).
 * @param expected_fp model fingerprint the caller runs; NULL skips the check.
 * @param m           out: filled on success (m->counts malloc'd: free with
 *                    kvz_blob_meta_free()); zeroed on failure (nothing to free).
 * @return 0; kvz_blob_check() errors; KVZ_ERR_FORMAT (not a META record, sizes
 *         or fields inconsistent, zstd frame invalid or of the wrong size);
 *         KVZ_ERR_CHECKSUM (payload hash); KVZ_ERR_MODEL (fingerprint differs from
 *         @p expected_fp, both in detail); KVZ_ERR_NOMEM.
 */
int kvz_blob_decode_meta(const uint8_t *rec, size_t len, const uint8_t *expected_fp,
                         kvz_blob_meta *m);

/**
 * The seed of a record's checksum (header field rec_xxh3, docs/FORMAT.md §2): XXH3-64
 * of header bytes [0, 48) of @p hdr (KVZ_BLOB_HEADER_SIZE bytes). The checksum is
 * XXH3_64bits_withSeed(payload, comp_size, seed): a reader that copies a record in
 * pieces can hash each piece while it is in the cache and hand the result to
 * kvz_blob_layer_placed().
 */
uint64_t kvz_blob_record_seed(const uint8_t *hdr);

/**
 * The codec of a LAYER record from its header alone (@p hdr: KVZ_BLOB_HEADER_SIZE
 * bytes; nothing is verified beyond the magic, version and kind): KVZ_BLOB_CODEC_*,
 * or -1 when the header is not a LAYER record's of a version this build reads. For a
 * reader that starts using a codec-none record before its checksum is known; it must
 * still verify the whole record (kvz_blob_layer_placed()) before the data counts.
 */
int kvz_blob_header_codec(const uint8_t *hdr);

/**
 * For a codec-none LAYER record that the caller copied into memory and hashed
 * itself (@p rec_hash, see kvz_blob_record_seed()): every check of
 * kvz_blob_decode_layer() on the record and its positions, without copying or
 * hashing a byte. The payload is then used in place: u32 positions at
 * rec + KVZ_BLOB_HEADER_SIZE (must be 4-byte aligned), K rows after them, V rows
 * after K (flat head-major, kvz_blob_layer_offsets()).
 * Differences from kvz_blob_decode_layer(): the record checksum (over the header
 * and the payload) is the one verification of the payload bytes — the payload
 * checksum, which for codec none hashes the same bytes again, is not recomputed;
 * and q8/q4 scale blocks are NOT checked: check the rows (kvz_kvrow_check()) or
 * decode them (kvz_kvrow_decode() rejects a bad block).
 * @return 0; KVZ_ERR_UNSUPPORTED (a zstd record: use kvz_blob_decode_layer());
 *         the errors of kvz_blob_decode_layer().
 */
int kvz_blob_layer_placed(const kvz_blob_meta *m, uint32_t l, const uint8_t *rec, size_t len, uint64_t rec_hash);

/**
 * kvz_blob_layer_placed() less the record checksum, for a reader that hashes the
 * record elsewhere (the CUDA loader hashes it on the device after the upload): every
 * other check, on the record's first KVZ_BLOB_HEADER_SIZE + 4 * kept bytes alone
 * (@p head: the header and the positions; payload 4-byte aligned) with @p len the
 * whole record's length. The payload counts only once kvz_blob_record_checksum()
 * has passed on the reader's hash (and, for q8/q4, the rows were checked).
 * Where a record fails here, the reader that wants kvz_blob_layer_placed()'s error
 * (the checksum is compared before the later header checks) hashes it and calls that.
 * @return 0; KVZ_ERR_UNSUPPORTED (a zstd record); the errors of
 *         kvz_blob_layer_placed() but KVZ_ERR_CHECKSUM.
 */
int kvz_blob_layer_head(const kvz_blob_meta *m, uint32_t l, const uint8_t *head, size_t len);

/** The record checksum of the record whose header is @p hdr against @p got, the hash of
 *  its payload seeded with kvz_blob_record_seed(hdr): 0, or KVZ_ERR_CHECKSUM with the
 *  message every decoder gives ("record checksum GOT, expected WANT"). The one place
 *  the comparison is made. */
int kvz_blob_record_checksum(const uint8_t *hdr, uint64_t got);

/**
 * kvz_blob_decode_layer() of a record the caller copied and hashed itself
 * (@p rec_hash, see kvz_blob_record_seed()): the record checksum (header + the
 * stored bytes) is the one verification; the payload checksum over the
 * decompressed bytes is not recomputed. Same outputs and errors.
 */
int kvz_blob_decode_layer_hashed(const kvz_blob_meta *m, uint32_t l, const uint8_t *rec, size_t len,
                                 uint64_t rec_hash, uint32_t *pos, void *k, void *v);

/**
 * Decode LAYER record @p l of the blob described by @p m (from
 * kvz_blob_decode_meta) straight into caller-provided flat head-major arrays,
 * streaming (no intermediate buffer of the payload). The rows stay in the stored
 * type (q8/q4 are not dequantised here: kvz_kvrow_decode() or a GPU kernel does
 * that), but every q8/q4 scale block is validated, so a success never hands out
 * a NaN/Inf/negative scale.
 * @param pos  out, u32 (kvz_blob_layer_kept(m, l)).
 * @param k    out, (kept, kvz_blob_kv_row_bytes(m)) bytes.  @param v out, the same.
 *             On error their contents are unspecified.
 * @return 0; kvz_blob_check() errors; KVZ_ERR_ARG (NULL, l out of range);
 *         KVZ_ERR_FORMAT (not a LAYER record, other layer index, blob id of
 *         another META, size not what the counts imply, zstd frame invalid,
 *         positions not ascending / out of range / prefix policy violated,
 *         record version differs from the META's, bad q8/q4 scale block);
 *         KVZ_ERR_CHECKSUM (payload hash); KVZ_ERR_NOMEM.
 */
int kvz_blob_decode_layer(const kvz_blob_meta *m, uint32_t l, const uint8_t *rec, size_t len,
                          uint32_t *pos, void *k, void *v);

#ifdef __cplusplus
}
#endif
#endif /* KVZ_BLOB_H */
