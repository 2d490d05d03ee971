/**
 * @file kvz_text.h
 * @brief Reading a document file as text: a regular file (never blocking on a
 *        FIFO or device), not empty, valid UTF-8 without NUL bytes.
 *
 * Used by the corpus walker (kvz_corpus.h), the CLIs and the evaluation.
 * Library code: nothing prints; every failure is a KVZ_ERR_* with a one-line
 * detail in kvz_error_detail() that names the path. Thread-safe (no state).
 */
#ifndef KVZ_TEXT_H
#define KVZ_TEXT_H

#include <stddef.h>
#include <sys/stat.h>

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Open @p path for reading without ever blocking (O_NONBLOCK, so a FIFO with no
 * writer does not hang the open) and check it is a regular file.
 * @return the fd (blocking mode restored; the caller closes it), *st filled; or
 *         KVZ_ERR_NOTFOUND (missing), KVZ_ERR_IO ("<path>: not a regular file (a
 *         FIFO)" / folder / device / socket, or the errno text).
 */
int kvz_text_open_regular(const char *path, struct stat *st);

/**
 * 1 if @p s[0..len) is valid UTF-8 (shortest forms, no surrogates, at most
 * U+10FFFF) with no NUL byte; else 0 and *bad (if not NULL) = offset of the
 * first bad byte.
 */
int kvz_text_valid(const char *s, size_t len, size_t *bad);

/**
 * Read a document file whole.
 * @param out  on success a malloc'd, NUL-terminated copy (the caller frees it).
 * @param len  its length in bytes (may be NULL).
 * @return 0; KVZ_ERR_NOTFOUND / KVZ_ERR_IO (missing, unreadable, not a regular
 *         file); KVZ_ERR_EMPTY (empty or only white space); KVZ_ERR_ENCODING
 *         (binary or not UTF-8; the detail names the byte and its offset);
 *         KVZ_ERR_CONTEXT (larger than @p max_bytes); KVZ_ERR_NOMEM.
 */
int kvz_text_read(const char *path, size_t max_bytes, char **out, size_t *len);

#ifdef __cplusplus
}
#endif
#endif
