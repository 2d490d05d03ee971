/**
 * @file kvz_error.h
 * @brief Error codes shared by every kvzip module.
 *
 * Library functions return 0 on success or a negative KVZ_ERR_* code. They never
 * print and never exit. A module that wraps another library (LMDB, zstd, CUDA)
 * records the underlying code and a short detail string in a thread-local slot
 * readable with kvz_error_detail(); only the CLIs decide what to print.
 */
#ifndef KVZ_ERROR_H
#define KVZ_ERROR_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    KVZ_OK = 0,
    KVZ_ERR_NOMEM = -1,       /**< allocation failed */
    KVZ_ERR_IO = -2,          /**< open/read/write/mmap failed (errno in detail) */
    KVZ_ERR_FORMAT = -3,      /**< input bytes are not what the format says (corrupt) */
    KVZ_ERR_TRUNCATED = -4,   /**< input ends before the format says it should */
    KVZ_ERR_UNSUPPORTED = -5, /**< well-formed but not supported (type, arch, version) */
    KVZ_ERR_ARG = -6,         /**< invalid argument from the caller */
    KVZ_ERR_NOTFOUND = -7,    /**< key, tensor, document or file does not exist */
    KVZ_ERR_CHECKSUM = -8,    /**< stored checksum does not match the bytes */
    KVZ_ERR_MODEL = -9,       /**< made by another model (fingerprint mismatch) */
    KVZ_ERR_VERSION = -10,    /**< format version this build cannot read */
    KVZ_ERR_LMDB = -11,       /**< LMDB call failed (code in detail) */
    KVZ_ERR_ZSTD = -12,       /**< zstd call failed */
    KVZ_ERR_CUDA = -13,       /**< CUDA / cuBLAS call failed */
    KVZ_ERR_FULL = -14,       /**< store map or disk is full and could not grow */
    KVZ_ERR_CONTEXT = -15,    /**< input longer than a limit: model context, cache, budget, file size */
    KVZ_ERR_EMPTY = -16,      /**< empty input where content is required */
    KVZ_ERR_ENCODING = -17,   /**< text is not valid UTF-8 / looks binary */
    KVZ_ERR_BUSY = -18,       /**< resource locked by another writer */
    KVZ_ERR_NODEV = -19,      /**< no usable GPU */
    KVZ_ERR_INTERNAL = -20,   /**< a bug: an invariant did not hold */
};

/** Static, human-readable text for a KVZ_ERR_* code. Never NULL. */
const char *kvz_strerror(int err);

/**
 * Record a detail message for the last error on this thread (printf-style).
 * Returns @p err so callers can write `return kvz_error_set(KVZ_ERR_FORMAT, "...")`.
 */
int kvz_error_set(int err, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/** Detail text of the last kvz_error_set on this thread ("" if none). Thread-local; valid until the next set. */
const char *kvz_error_detail(void);

/** Clear this thread's detail text. */
void kvz_error_clear(void);

#ifdef __cplusplus
}
#endif
#endif /* KVZ_ERROR_H */
