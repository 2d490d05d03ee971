/**
 * @file kvz_escape.h
 * @brief Bytes that came from outside (ids, paths, error details, model text)
 *        made safe to print: for a terminal line and for a JSON string, and the
 *        UTF-8 check both rely on.
 *
 * The text renderers of the modules (kvz_store_report_print_*, kvz_batch_print_*,
 * ...) and the CLIs print every outside string through these, so a file name
 * cannot move the cursor, change colours, start a fake line or break a JSON line.
 */
#ifndef KVZ_ESCAPE_H
#define KVZ_ESCAPE_H

#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/** 1 if @p s (@p len bytes) is valid UTF-8 (no overlong forms, surrogates or code
 *  points above U+10FFFF) with no NUL byte; else 0 and *bad (may be NULL) = the
 *  offset of the first byte that is not. */
int kvz_utf8_valid(const char *s, size_t len, size_t *bad);

/**
 * @p s for a human-readable line: control characters (C0, DEL, C1), invalid UTF-8
 * bytes and backslashes escaped (\\n \\r \\t \\\\ \\xHH \\u0080..\\u009f); valid
 * UTF-8 otherwise as it is. NULL reads as "".
 * @return one of 8 rotating thread-local buffers: valid until the 8th next call on
 *         the same thread (use at most 8 in one printf). Over 4095 input bytes the
 *         text is cut and ends in "...".
 */
const char *kvz_escape(const char *s);

/** Write @p len bytes of @p s to @p f as a JSON string literal (with its quotes):
 *  '"', '\\' and control characters below 0x20 escaped, every other byte as it is. */
void kvz_escape_json(FILE *f, const char *s, size_t len);

/** The one-line error report of failure @p rc about @p what: "PROG: error: WHAT:
 *  DETAIL (CLASS)" with the thread's kvz_error_detail(), or "PROG: error: WHAT:
 *  CLASS" when there is none (WHAT and DETAIL escaped, CLASS kvz_strerror(rc));
 *  then the detail is cleared. */
void kvz_escape_error(FILE *f, const char *prog, int rc, const char *what);

#ifdef __cplusplus
}
#endif
#endif /* KVZ_ESCAPE_H */
