/* libFuzzer target for the GGUF reader (runtime/kvz_gguf.h).
 * The input is a whole GGUF file. kvz_gguf_open takes a path and mmaps it, so
 * the bytes go into a memfd opened through /proc/self/fd (no disk). Any input
 * must give an error code or a parsed file whose every accessor stays inside
 * the mapping; the fingerprint (reads every tensor byte) is computed too.
 * Seeds: tests/fuzz/seeds/gguf (tests/fuzz/make_seeds.py). */
#include "kvz_gguf.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static int g_fd = -1;
static char g_path[64];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (g_fd < 0) {
        g_fd = memfd_create("fuzz_gguf", 0);
        if (g_fd < 0) abort();
        snprintf(g_path, sizeof g_path, "/proc/self/fd/%d", g_fd);
    }
    if (ftruncate(g_fd, 0) || pwrite(g_fd, data, size, 0) != (ssize_t)size) abort();
    kvz_gguf *g = NULL;
    if (kvz_gguf_open(g_path, &g) != 0) {
        if (g) __builtin_trap(); /* *out must be NULL on error */
        return 0;
    }
    volatile uint64_t sink = kvz_gguf_version(g);
    for (uint64_t i = 0; i < kvz_gguf_n_kv(g); i++) {
        const kvz_gguf_kv *kv = kvz_gguf_kv_at(g, i);
        /* every byte an accessor points at lies in the mapping: touch them */
        for (uint64_t b = 0; b < kv->key.len; b++) sink += (uint8_t)kv->key.ptr[b];
        for (uint64_t b = 0; b < kv->nbytes; b++) sink += kv->data[b];
        char key[256];
        snprintf(key, sizeof key, "%.*s", (int)(kv->key.len < 255 ? kv->key.len : 255), kv->key.ptr);
        int64_t iv;
        float fv;
        kvz_str sv;
        kvz_str *arr = NULL;
        uint64_t n;
        uint32_t et;
        const void *ad;
        (void)kvz_gguf_get_i64(g, key, &iv);
        (void)kvz_gguf_get_f32(g, key, &fv);
        if (kvz_gguf_get_str(g, key, &sv) == 0)
            for (uint64_t b = 0; b < sv.len; b++) sink += (uint8_t)sv.ptr[b];
        if (kvz_gguf_get_str_array(g, key, &arr, &n) == 0) {
            for (uint64_t j = 0; j < n; j++)
                for (uint64_t b = 0; b < arr[j].len; b++) sink += (uint8_t)arr[j].ptr[b];
            free(arr);
        }
        (void)kvz_gguf_get_array(g, key, &et, &n, &ad);
        /* a key without NUL bytes that fits the buffer must be found by name */
        if (kv->key.len < 255 && !memchr(kv->key.ptr, 0, kv->key.len) && !kvz_gguf_find(g, key))
            __builtin_trap();
    }
    for (uint64_t i = 0; i < kvz_gguf_n_tensors(g); i++) {
        const kvz_gguf_tensor *t = kvz_gguf_tensor_at(g, i);
        if (t->nbytes && t->data) sink += ((const uint8_t *)t->data)[t->nbytes - 1];
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(t->name.len < 255 ? t->name.len : 255), t->name.ptr);
        (void)kvz_gguf_find_tensor(g, name);
    }
    uint8_t fp[16];
    kvz_gguf_fingerprint(g, fp);
    sink += fp[0];
    (void)sink;
    kvz_gguf_close(g);
    return 0;
}
