/**
 * @file kvz_gguf.h
 * @brief Read-only GGUF v3 reader over a private, read-only mmap.
 *
 * Every offset and length is validated against the file size before use; a
 * truncated or corrupt file yields KVZ_ERR_TRUNCATED / KVZ_ERR_FORMAT, never an
 * out-of-bounds read. Strings returned as kvz_str point into the mapping: they
 * are NOT NUL-terminated and live until kvz_gguf_close(). A kvz_gguf is
 * immutable after open and may be read from any number of threads.
 */
#ifndef KVZ_GGUF_H
#define KVZ_GGUF_H

#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/** GGUF metadata value types (on-disk codes). */
enum {
    KVZ_GGUF_U8 = 0, KVZ_GGUF_I8 = 1, KVZ_GGUF_U16 = 2, KVZ_GGUF_I16 = 3,
    KVZ_GGUF_U32 = 4, KVZ_GGUF_I32 = 5, KVZ_GGUF_F32 = 6, KVZ_GGUF_BOOL = 7,
    KVZ_GGUF_STRING = 8, KVZ_GGUF_ARRAY = 9, KVZ_GGUF_U64 = 10, KVZ_GGUF_I64 = 11,
    KVZ_GGUF_F64 = 12,
};

/** A byte string inside the mapping (not NUL-terminated). */
typedef struct kvz_str {
    const char *ptr;
    uint64_t len;
} kvz_str;

/** One metadata key/value. For arrays, @c data points at the first element. */
typedef struct kvz_gguf_kv {
    kvz_str key;
    uint32_t type;        /**< KVZ_GGUF_* */
    uint32_t arr_type;    /**< element type when type == KVZ_GGUF_ARRAY */
    uint64_t arr_n;       /**< element count when type == KVZ_GGUF_ARRAY */
    const uint8_t *data;  /**< raw little-endian value bytes in the mapping */
    uint64_t nbytes;      /**< bytes of the value (whole array for arrays) */
} kvz_gguf_kv;

#define KVZ_GGUF_MAX_DIMS 4

/** One tensor-table entry; @c data points into the mapping. */
typedef struct kvz_gguf_tensor {
    kvz_str name;
    uint32_t n_dims;
    int64_t ne[KVZ_GGUF_MAX_DIMS]; /**< ne[0] is the contiguous dim; unused dims are 1 */
    uint32_t type;                 /**< ggml type code (KVZ_TYPE_* in kvz_quant.h) */
    uint64_t offset;               /**< from the start of the data section */
    const void *data;
    uint64_t nbytes;
} kvz_gguf_tensor;

typedef struct kvz_gguf kvz_gguf;

/**
 * Map and parse a GGUF file (versions 2 and 3).
 * @return 0; KVZ_ERR_NOTFOUND (no such file), KVZ_ERR_IO (cannot open/map,
 *   errno in detail), KVZ_ERR_FORMAT (bad magic, inconsistent tables: counts or
 *   lengths above sanity caps, n_dims not 1..4, a zero dim, a size overflow, an
 *   unknown metadata type, duplicate key or tensor name, general.alignment not a
 *   u32 power of two, a tensor offset not aligned, a row not a block multiple),
 *   KVZ_ERR_TRUNCATED (file too short for what it declares, including tensor
 *   data past the end), KVZ_ERR_VERSION (other GGUF version),
 *   KVZ_ERR_UNSUPPORTED (unknown tensor type), KVZ_ERR_ARG (NULL argument),
 *   KVZ_ERR_NOMEM. On error *out is NULL and kvz_error_detail() says where.
 *   Arrays of arrays are validated and kept as one kv with arr_type ARRAY.
 */
int kvz_gguf_open(const char *path, kvz_gguf **out);
void kvz_gguf_close(kvz_gguf *g);

uint32_t kvz_gguf_version(const kvz_gguf *g);
uint64_t kvz_gguf_n_kv(const kvz_gguf *g);
const kvz_gguf_kv *kvz_gguf_kv_at(const kvz_gguf *g, uint64_t i);
/** The key/value named @p key, or NULL. */
const kvz_gguf_kv *kvz_gguf_find(const kvz_gguf *g, const char *key);

/** Integer value of any integer or bool type; KVZ_ERR_NOTFOUND / KVZ_ERR_FORMAT (wrong type or out of range). */
int kvz_gguf_get_i64(const kvz_gguf *g, const char *key, int64_t *out);
/** Float value of F32/F64 (or an integer type); KVZ_ERR_NOTFOUND / KVZ_ERR_FORMAT. */
int kvz_gguf_get_f32(const kvz_gguf *g, const char *key, float *out);
/** String value; KVZ_ERR_NOTFOUND / KVZ_ERR_FORMAT. */
int kvz_gguf_get_str(const kvz_gguf *g, const char *key, kvz_str *out);
/**
 * A string array as a malloc'd vector of kvz_str pointing into the mapping.
 * Caller frees *out with free(). KVZ_ERR_NOTFOUND / KVZ_ERR_FORMAT / KVZ_ERR_NOMEM.
 */
int kvz_gguf_get_str_array(const kvz_gguf *g, const char *key, kvz_str **out, uint64_t *n);
/** A numeric array: element type, count, raw pointer into the mapping. */
int kvz_gguf_get_array(const kvz_gguf *g, const char *key, uint32_t *elem_type,
                       uint64_t *n, const void **data);

uint64_t kvz_gguf_n_tensors(const kvz_gguf *g);
const kvz_gguf_tensor *kvz_gguf_tensor_at(const kvz_gguf *g, uint64_t i);
/** Tensor named @p name, or NULL. */
const kvz_gguf_tensor *kvz_gguf_find_tensor(const kvz_gguf *g, const char *name);

/** File offset of the data section (tensor t's bytes start at this + t->offset). */
uint64_t kvz_gguf_data_offset(const kvz_gguf *g);
/** Alignment of the data section and tensor offsets (general.alignment, default 32). */
uint32_t kvz_gguf_alignment(const kvz_gguf *g);

/** 1 if @p s equals the NUL-terminated @p cstr. */
int kvz_str_eq(kvz_str s, const char *cstr);

/**
 * Model fingerprint: XXH3-128 (canonical big-endian bytes) over the file from
 * offset 0 to the end of the tensor-info table, then every tensor's bytes in
 * tensor-table order (alignment padding is not hashed). Reads the whole file once (~0.1 s / 100 MB);
 * cached after the first call (thread-safe only if first called before sharing).
 */
void kvz_gguf_fingerprint(kvz_gguf *g, uint8_t out[16]);

#ifdef __cplusplus
}
#endif
#endif
