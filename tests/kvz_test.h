/* Minimal test harness: CHECK macros that count, report and never abort early,
 * plus helpers to find golden files and the model. Each test main() ends with
 * `return kvz_test_summary();` which prints "N passed, N failed" and returns 0
 * only when nothing failed. */
#ifndef KVZ_TEST_H
#define KVZ_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int kvz_t_pass, kvz_t_fail;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (cond) kvz_t_pass++;                                                      \
        else { kvz_t_fail++; fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, \
                                     __LINE__, #cond); }                             \
    } while (0)

#define CHECKF(cond, ...)                                                            \
    do {                                                                             \
        if (cond) kvz_t_pass++;                                                      \
        else { kvz_t_fail++; fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__,  \
                                     __LINE__, #cond);                               \
               fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); }                  \
    } while (0)

/* Abort the test when a precondition fails (counts as a failure). */
#define REQUIRE(cond)                                                                \
    do {                                                                             \
        if (!(cond)) { fprintf(stderr, "%s:%d: REQUIRE failed: %s\n", __FILE__,      \
                               __LINE__, #cond);                                     \
                       kvz_t_fail++; return kvz_test_summary(); }                    \
    } while (0)

static inline int kvz_test_summary(void)
{
    printf("%d passed, %d failed\n", kvz_t_pass, kvz_t_fail);
    return kvz_t_fail == 0 && kvz_t_pass > 0 ? 0 : 1;
}

/* Path under the source tree: kvz_test_path(buf, "tests/golden/x.bin"). */
static inline const char *kvz_test_path(char *buf, size_t cap, const char *rel)
{
    const char *root = getenv("KVZ_SOURCE_DIR");
    snprintf(buf, cap, "%s/%s", root ? root : ".", rel);
    return buf;
}

static inline const char *kvz_test_model(void)
{
    const char *m = getenv("KVZ_MODEL");
    return m ? m : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

/* Read a whole file; returns malloc'd buffer (NUL-terminated) or NULL. */
static inline char *kvz_test_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) { free(buf); buf = NULL; }
    fclose(f);
    if (buf) { buf[n] = 0; if (len) *len = (size_t)n; }
    return buf;
}

#endif
