/* kvz_gguf: parse small GGUF files written by a tiny writer below; reject
 * corrupt ones with the right error code; never read out of bounds (every
 * prefix of a valid file must fail cleanly). */
#include <stdint.h>
#include <unistd.h>

#include "kvz_error.h"
#include "kvz_gguf.h"
#include "kvz_quant.h"
#include "kvz_test.h"

/* ------------------------------------------------------------------------ */
/* Tiny GGUF writer                                                         */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} gb;

static void put(gb *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void u8(gb *b, uint8_t v) { put(b, &v, 1); }
static void u16(gb *b, uint16_t v) { put(b, &v, 2); }
static void u32(gb *b, uint32_t v) { put(b, &v, 4); }
static void u64(gb *b, uint64_t v) { put(b, &v, 8); }
static void f32(gb *b, float v) { put(b, &v, 4); }
static void f64(gb *b, double v) { put(b, &v, 8); }
static void str(gb *b, const char *s) { u64(b, strlen(s)); put(b, s, strlen(s)); }
static void pad(gb *b, size_t align) { while (b->n % align) u8(b, 0); }
static void hdr(gb *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    put(b, "GGUF", 4);
    u32(b, version);
    u64(b, n_tensors);
    u64(b, n_kv);
}
static void key(gb *b, const char *k, uint32_t type) { str(b, k); u32(b, type); }
static void tinfo(gb *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type, uint64_t off)
{
    str(b, name);
    u32(b, n_dims);
    for (uint32_t i = 0; i < n_dims; i++) u64(b, ne[i]);
    u32(b, type);
    u64(b, off);
}

/* REQUIRE for void helpers: count a failure and leave the function. */
#define NEED(cond) do { int ok_ = !!(cond); CHECKF(ok_, "%s", #cond); if (!ok_) return; } while (0)

static char g_dir[256];
static int g_nfile;

/* Write bytes to a fresh temp file and open it. */
static int open_bytes(const void *p, size_t n, kvz_gguf **g)
{
    char path[512];
    snprintf(path, sizeof path, "%s/f%d.gguf", g_dir, g_nfile++);
    FILE *f = fopen(path, "wb");
    if (!f) return -1000;
    if (n && fwrite(p, 1, n, f) != n) { fclose(f); return -1000; }
    fclose(f);
    int rc = kvz_gguf_open(path, g);
    unlink(path);
    return rc;
}

static int open_gb(const gb *b)
{
    kvz_gguf *g = (kvz_gguf *)1;
    int rc = open_bytes(b->p, b->n, &g);
    if (rc == 0) kvz_gguf_close(g);
    else if (g != NULL) rc = -999; /* *out must be NULL on error */
    return rc;
}

/* ------------------------------------------------------------------------ */
/* The valid file                                                           */

#define ALIGN 64
#define N_KV 21

/* Tensors: a F32 [4,3], b Q8_0 [64,2], c F16 [8] (no padding after the last). */
static void build_valid(gb *b, uint32_t version, size_t *data_start)
{
    hdr(b, version, 3, N_KV);
    key(b, "k.u8", KVZ_GGUF_U8); u8(b, 200);
    key(b, "k.i8", KVZ_GGUF_I8); u8(b, (uint8_t)-5);
    key(b, "k.u16", KVZ_GGUF_U16); u16(b, 65000);
    key(b, "k.i16", KVZ_GGUF_I16); u16(b, (uint16_t)-1234);
    key(b, "k.u32", KVZ_GGUF_U32); u32(b, 4000000000u);
    key(b, "k.i32", KVZ_GGUF_I32); u32(b, (uint32_t)-70000);
    key(b, "k.f32", KVZ_GGUF_F32); f32(b, 100000.0f);
    key(b, "k.bool", KVZ_GGUF_BOOL); u8(b, 1);
    key(b, "k.str", KVZ_GGUF_STRING); str(b, "llama");
    key(b, "k.u64", KVZ_GGUF_U64); u64(b, 1ull << 40);
    key(b, "k.u64big", KVZ_GGUF_U64); u64(b, UINT64_MAX);
    key(b, "k.i64", KVZ_GGUF_I64); u64(b, (uint64_t)-5000000000ll);
    key(b, "k.f64", KVZ_GGUF_F64); f64(b, 0.25);
    key(b, "k.emptystr", KVZ_GGUF_STRING); str(b, "");
    key(b, "k.arr_i32", KVZ_GGUF_ARRAY); u32(b, KVZ_GGUF_I32); u64(b, 3);
    u32(b, 7); u32(b, (uint32_t)-8); u32(b, 9);
    key(b, "k.arr_str", KVZ_GGUF_ARRAY); u32(b, KVZ_GGUF_STRING); u64(b, 3);
    str(b, "he"); str(b, ""); str(b, "llo");
    key(b, "k.arr_empty", KVZ_GGUF_ARRAY); u32(b, KVZ_GGUF_F32); u64(b, 0);
    /* array of arrays: [[1,2],[3]] of u8, and [["x"],[]] of strings */
    key(b, "k.arr_arr", KVZ_GGUF_ARRAY); u32(b, KVZ_GGUF_ARRAY); u64(b, 2);
    u32(b, KVZ_GGUF_U8); u64(b, 2); u8(b, 1); u8(b, 2);
    u32(b, KVZ_GGUF_U8); u64(b, 1); u8(b, 3);
    key(b, "k.arr_arr_str", KVZ_GGUF_ARRAY); u32(b, KVZ_GGUF_ARRAY); u64(b, 2);
    u32(b, KVZ_GGUF_STRING); u64(b, 1); str(b, "x");
    u32(b, KVZ_GGUF_STRING); u64(b, 0);
    key(b, "general.alignment", KVZ_GGUF_U32); u32(b, ALIGN);
    key(b, "k.last", KVZ_GGUF_BOOL); u8(b, 0);

    const uint64_t ne_a[2] = {4, 3}, ne_b[2] = {64, 2}, ne_c[1] = {8};
    /* data layout: a at 0 (48 B), b at 64 (4*34 = 136 B), c at 256 (16 B) */
    tinfo(b, "a", 2, ne_a, KVZ_TYPE_F32, 0);
    tinfo(b, "b", 2, ne_b, KVZ_TYPE_Q8_0, 64);
    tinfo(b, "c", 1, ne_c, KVZ_TYPE_F16, 256);
    pad(b, ALIGN);
    *data_start = b->n;
    for (int i = 0; i < 12; i++) f32(b, (float)i * 0.5f);
    pad(b, ALIGN);
    for (int i = 0; i < 136; i++) u8(b, (uint8_t)(i + 1));
    pad(b, ALIGN);
    for (int i = 0; i < 8; i++) u16(b, kvz_fp32_to_fp16((float)-i));
}

static void test_valid(void)
{
    gb b = {0};
    size_t ds;
    build_valid(&b, 3, &ds);
    kvz_gguf *g = NULL;
    int rc = open_bytes(b.p, b.n, &g);
    CHECKF(rc == 0, "open valid: %d %s", rc, kvz_error_detail());
    if (rc) { free(b.p); return; }

    CHECK(kvz_gguf_version(g) == 3);
    CHECK(kvz_gguf_n_kv(g) == N_KV);
    CHECK(kvz_gguf_n_tensors(g) == 3);
    CHECK(kvz_str_eq(kvz_gguf_kv_at(g, 0)->key, "k.u8"));
    CHECK(kvz_str_eq(kvz_gguf_kv_at(g, N_KV - 1)->key, "k.last"));
    CHECK(kvz_gguf_kv_at(g, N_KV) == NULL);

    int64_t v = 0;
    CHECK(kvz_gguf_get_i64(g, "k.u8", &v) == 0 && v == 200);
    CHECK(kvz_gguf_get_i64(g, "k.i8", &v) == 0 && v == -5);
    CHECK(kvz_gguf_get_i64(g, "k.u16", &v) == 0 && v == 65000);
    CHECK(kvz_gguf_get_i64(g, "k.i16", &v) == 0 && v == -1234);
    CHECK(kvz_gguf_get_i64(g, "k.u32", &v) == 0 && v == 4000000000ll);
    CHECK(kvz_gguf_get_i64(g, "k.i32", &v) == 0 && v == -70000);
    CHECK(kvz_gguf_get_i64(g, "k.bool", &v) == 0 && v == 1);
    CHECK(kvz_gguf_get_i64(g, "k.u64", &v) == 0 && v == (1ll << 40));
    CHECK(kvz_gguf_get_i64(g, "k.i64", &v) == 0 && v == -5000000000ll);
    CHECK(kvz_gguf_get_i64(g, "k.u64big", &v) == KVZ_ERR_FORMAT);
    CHECK(kvz_gguf_get_i64(g, "k.f32", &v) == KVZ_ERR_FORMAT);
    CHECK(kvz_gguf_get_i64(g, "k.str", &v) == KVZ_ERR_FORMAT);
    CHECK(kvz_gguf_get_i64(g, "nope", &v) == KVZ_ERR_NOTFOUND);
    CHECK(kvz_gguf_get_i64(g, "general.alignment", &v) == 0 && v == ALIGN);

    float f = 0;
    CHECK(kvz_gguf_get_f32(g, "k.f32", &f) == 0 && f == 100000.0f);
    CHECK(kvz_gguf_get_f32(g, "k.f64", &f) == 0 && f == 0.25f);
    CHECK(kvz_gguf_get_f32(g, "k.i32", &f) == 0 && f == -70000.0f);
    CHECK(kvz_gguf_get_f32(g, "k.str", &f) == KVZ_ERR_FORMAT);
    CHECK(kvz_gguf_get_f32(g, "k.bool", &f) == KVZ_ERR_FORMAT);
    CHECK(kvz_gguf_get_f32(g, "k.missing", &f) == KVZ_ERR_NOTFOUND);

    kvz_str s;
    CHECK(kvz_gguf_get_str(g, "k.str", &s) == 0 && kvz_str_eq(s, "llama"));
    CHECK(kvz_gguf_get_str(g, "k.emptystr", &s) == 0 && s.len == 0 && kvz_str_eq(s, ""));
    CHECK(kvz_gguf_get_str(g, "k.u8", &s) == KVZ_ERR_FORMAT);
    CHECK(kvz_gguf_get_str(g, "k.strx", &s) == KVZ_ERR_NOTFOUND);

    kvz_str *sv = NULL;
    uint64_t n = 0;
    CHECK(kvz_gguf_get_str_array(g, "k.arr_str", &sv, &n) == 0 && n == 3);
    if (sv && n == 3) {
        CHECK(kvz_str_eq(sv[0], "he") && kvz_str_eq(sv[1], "") && kvz_str_eq(sv[2], "llo"));
    }
    free(sv);
    CHECK(kvz_gguf_get_str_array(g, "k.arr_i32", &sv, &n) == KVZ_ERR_FORMAT);
    CHECK(kvz_gguf_get_str_array(g, "k.arr_arr_str", &sv, &n) == KVZ_ERR_FORMAT);

    uint32_t et = 0;
    const void *data = NULL;
    CHECK(kvz_gguf_get_array(g, "k.arr_i32", &et, &n, &data) == 0 && et == KVZ_GGUF_I32 && n == 3);
    if (data) {
        int32_t iv[3];
        memcpy(iv, data, sizeof iv);
        CHECK(iv[0] == 7 && iv[1] == -8 && iv[2] == 9);
    }
    CHECK(kvz_gguf_get_array(g, "k.arr_empty", &et, &n, &data) == 0 && et == KVZ_GGUF_F32 && n == 0);
    CHECK(kvz_gguf_get_array(g, "k.arr_arr", &et, &n, &data) == 0 && et == KVZ_GGUF_ARRAY && n == 2);
    CHECK(kvz_gguf_find(g, "k.arr_arr")->nbytes == 12 + 2 + 12 + 1);
    CHECK(kvz_gguf_find(g, "k.arr_str")->nbytes == 8 * 3 + 5);
    CHECK(kvz_gguf_get_array(g, "k.u8", &et, &n, &data) == KVZ_ERR_FORMAT);
    CHECK(kvz_gguf_find(g, "k.") == NULL && kvz_gguf_find(g, "") == NULL && kvz_gguf_find(g, "k.lastx") == NULL);
    CHECK(kvz_gguf_find(g, "k.arr_arr_str") != NULL && kvz_gguf_find(g, "k.arr_arr_str")->arr_n == 2);

    const kvz_gguf_tensor *ta = kvz_gguf_find_tensor(g, "a");
    const kvz_gguf_tensor *tb = kvz_gguf_find_tensor(g, "b");
    const kvz_gguf_tensor *tc = kvz_gguf_find_tensor(g, "c");
    CHECK(kvz_gguf_find_tensor(g, "d") == NULL && kvz_gguf_find_tensor(g, "") == NULL);
    CHECK(kvz_gguf_tensor_at(g, 1) == tb && kvz_gguf_tensor_at(g, 3) == NULL);
    NEED(ta && tb && tc);
    CHECK(ta->n_dims == 2 && ta->ne[0] == 4 && ta->ne[1] == 3 && ta->ne[2] == 1 && ta->ne[3] == 1);
    CHECK(ta->type == KVZ_TYPE_F32 && ta->nbytes == 48 && ta->offset == 0);
    CHECK(tb->type == KVZ_TYPE_Q8_0 && tb->nbytes == 136 && tb->offset == 64 && tb->ne[1] == 2);
    CHECK(tc->n_dims == 1 && tc->ne[0] == 8 && tc->nbytes == 16 && tc->offset == 256);
    /* data pointers are at data_start (aligned to ALIGN) + offset */
    float fa[12];
    memcpy(fa, ta->data, sizeof fa);
    CHECK(fa[0] == 0.0f && fa[11] == 5.5f);
    CHECK(((const uint8_t *)tb->data)[0] == 1 && ((const uint8_t *)tb->data)[135] == 136);
    CHECK((const uint8_t *)tb->data - (const uint8_t *)ta->data == 64);
    CHECK(ds % ALIGN == 0 && kvz_gguf_data_offset(g) == ds && kvz_gguf_alignment(g) == ALIGN);
    float fc[8];
    CHECK(kvz_dequantize(tc->type, tc->data, fc, 8) == 0 && fc[0] == 0.0f && fc[7] == -7.0f);

    kvz_gguf_close(g);
    free(b.p);
}

/* Version 2 and default alignment 32. */
static void test_v2_default_align(void)
{
    gb b = {0};
    hdr(&b, 2, 2, 1);
    key(&b, "general.architecture", KVZ_GGUF_STRING); str(&b, "llama");
    const uint64_t ne[1] = {8};
    tinfo(&b, "x", 1, ne, KVZ_TYPE_F32, 0);
    tinfo(&b, "y", 1, ne, KVZ_TYPE_F32, 32);
    size_t meta = b.n;
    pad(&b, 32);
    size_t ds = b.n;
    CHECK(ds != meta); /* the test needs real padding */
    for (int i = 0; i < 8; i++) f32(&b, 1.0f);
    for (int i = 0; i < 8; i++) f32(&b, 2.0f);
    kvz_gguf *g = NULL;
    int rc = open_bytes(b.p, b.n, &g);
    CHECKF(rc == 0, "v2: %d %s", rc, kvz_error_detail());
    if (!rc) {
        CHECK(kvz_gguf_version(g) == 2);
        const kvz_gguf_tensor *y = kvz_gguf_find_tensor(g, "y");
        float v;
        NEED(y != NULL);
        memcpy(&v, y->data, 4);
        CHECK(v == 2.0f && (const uint8_t *)y->data - (const uint8_t *)kvz_gguf_find_tensor(g, "x")->data == 32);
        kvz_gguf_close(g);
    }
    /* v3 with zero tensors and no data section at all */
    gb e = {0};
    hdr(&e, 3, 0, 1);
    key(&e, "a", KVZ_GGUF_U8); u8(&e, 1);
    CHECK(open_gb(&e) == 0);
    free(e.p);
    free(b.p);
}

static void test_truncation(void)
{
    gb b = {0};
    size_t ds;
    build_valid(&b, 3, &ds);
    int bad = 0, not_trunc = 0;
    for (size_t len = 0; len < b.n; len++) {
        kvz_gguf *g = (kvz_gguf *)1;
        int rc = open_bytes(b.p, len, &g);
        if (rc >= 0 || g != NULL) {
            bad++;
            if (rc == 0) kvz_gguf_close(g);
        } else if (rc != KVZ_ERR_TRUNCATED) {
            if (not_trunc++ < 3) fprintf(stderr, "  prefix %zu: %d %s\n", len, rc, kvz_error_detail());
        }
    }
    CHECKF(bad == 0, "%d prefixes opened", bad);
    CHECKF(not_trunc == 0, "%d prefixes failed with a code other than TRUNCATED", not_trunc);
    CHECK(open_gb(&b) == 0);
    free(b.p);
}

/* One-kv file: header + key + caller-written value. */
#define ONE_KV(b, type) do { hdr(&b, 3, 0, 1); key(&b, "k", type); } while (0)

static void test_rejects(void)
{
    kvz_gguf *g = (kvz_gguf *)1;
    CHECK(kvz_gguf_open("/nonexistent/dir/x.gguf", &g) == KVZ_ERR_NOTFOUND && g == NULL);
    CHECK(kvz_gguf_open(g_dir, &g) == KVZ_ERR_IO && g == NULL); /* a directory */

    gb b = {0};
    size_t ds;
    build_valid(&b, 3, &ds);
    gb m = {0};
    put(&m, b.p, b.n);

    m.p[0] = 'X';
    CHECK(open_gb(&m) == KVZ_ERR_FORMAT);
    memcpy(m.p, b.p, b.n);
    uint32_t ver = 1;
    memcpy(m.p + 4, &ver, 4);
    CHECK(open_gb(&m) == KVZ_ERR_VERSION);
    ver = 4;
    memcpy(m.p + 4, &ver, 4);
    CHECK(open_gb(&m) == KVZ_ERR_VERSION);
    ver = 0x03000000; /* big-endian file */
    memcpy(m.p + 4, &ver, 4);
    CHECK(open_gb(&m) == KVZ_ERR_VERSION);
    memcpy(m.p, b.p, b.n);

    /* absurd counts: above the caps -> FORMAT; plausible but beyond the file -> TRUNCATED */
    uint64_t cnt = 1ull << 40;
    memcpy(m.p + 16, &cnt, 8);
    CHECK(open_gb(&m) == KVZ_ERR_FORMAT);
    cnt = UINT64_MAX;
    memcpy(m.p + 16, &cnt, 8);
    CHECK(open_gb(&m) == KVZ_ERR_FORMAT);
    cnt = 100000;
    memcpy(m.p + 16, &cnt, 8);
    CHECK(open_gb(&m) == KVZ_ERR_TRUNCATED);
    memcpy(m.p, b.p, b.n);
    cnt = 1ull << 62;
    memcpy(m.p + 8, &cnt, 8);
    CHECK(open_gb(&m) == KVZ_ERR_FORMAT);
    cnt = 5; /* more tensors than the table holds: parses data bytes as a table */
    memcpy(m.p + 8, &cnt, 8);
    CHECK(open_gb(&m) < 0);
    free(m.p);

    gb x;
#define REJECT(expect, ...) do { x = (gb){0}; __VA_ARGS__; int rc_ = open_gb(&x); \
        CHECKF(rc_ == (expect), "got %d (%s), want %d", rc_, kvz_error_detail(), expect); free(x.p); } while (0)

    /* strings */
    REJECT(KVZ_ERR_FORMAT, hdr(&x, 3, 0, 1); u64(&x, 1ull << 62); put(&x, "k", 1); u32(&x, 0); u8(&x, 0));
    REJECT(KVZ_ERR_FORMAT, hdr(&x, 3, 0, 1); u64(&x, UINT64_MAX); put(&x, "k", 1); u32(&x, 0); u8(&x, 0));
    REJECT(KVZ_ERR_TRUNCATED, hdr(&x, 3, 0, 1); u64(&x, 1000); put(&x, "k", 1); u32(&x, 0); u8(&x, 0));
    REJECT(KVZ_ERR_FORMAT, ONE_KV(x, KVZ_GGUF_STRING); u64(&x, 1ull << 63); u64(&x, 0));
    REJECT(KVZ_ERR_TRUNCATED, ONE_KV(x, KVZ_GGUF_STRING); u64(&x, 1ull << 20); u64(&x, 0));
    /* value types */
    REJECT(KVZ_ERR_FORMAT, ONE_KV(x, 13); u64(&x, 0));
    REJECT(KVZ_ERR_FORMAT, ONE_KV(x, 0xffffffffu); u64(&x, 0));
    REJECT(KVZ_ERR_TRUNCATED, ONE_KV(x, KVZ_GGUF_U64); u32(&x, 0));
    /* arrays */
    REJECT(KVZ_ERR_FORMAT, ONE_KV(x, KVZ_GGUF_ARRAY); u32(&x, KVZ_GGUF_U8); u64(&x, 1ull << 60));
    REJECT(KVZ_ERR_FORMAT, ONE_KV(x, KVZ_GGUF_ARRAY); u32(&x, KVZ_GGUF_U64); u64(&x, UINT64_MAX / 4));
    REJECT(KVZ_ERR_TRUNCATED, ONE_KV(x, KVZ_GGUF_ARRAY); u32(&x, KVZ_GGUF_U64); u64(&x, 1ull << 31); u64(&x, 0));
    REJECT(KVZ_ERR_TRUNCATED, ONE_KV(x, KVZ_GGUF_ARRAY); u32(&x, KVZ_GGUF_STRING); u64(&x, 1ull << 30); u64(&x, 0));
    REJECT(KVZ_ERR_TRUNCATED, ONE_KV(x, KVZ_GGUF_ARRAY); u32(&x, KVZ_GGUF_STRING); u64(&x, 2); str(&x, "a");
           u64(&x, 1000));
    REJECT(KVZ_ERR_FORMAT, ONE_KV(x, KVZ_GGUF_ARRAY); u32(&x, 77); u64(&x, 1); u64(&x, 0));
    REJECT(KVZ_ERR_FORMAT, ONE_KV(x, KVZ_GGUF_ARRAY); u32(&x, KVZ_GGUF_ARRAY); u64(&x, 1);
           u32(&x, 99); u64(&x, 0));
    /* arrays nested 20 deep */
    REJECT(KVZ_ERR_FORMAT, ONE_KV(x, KVZ_GGUF_ARRAY);
           for (int i = 0; i < 20; i++) { u32(&x, KVZ_GGUF_ARRAY); u64(&x, 1); }
           u32(&x, KVZ_GGUF_U8); u64(&x, 0));
    /* alignment */
    REJECT(KVZ_ERR_FORMAT, hdr(&x, 3, 0, 1); key(&x, "general.alignment", KVZ_GGUF_U32); u32(&x, 48));
    REJECT(KVZ_ERR_FORMAT, hdr(&x, 3, 0, 1); key(&x, "general.alignment", KVZ_GGUF_U32); u32(&x, 0));
    REJECT(KVZ_ERR_FORMAT, hdr(&x, 3, 0, 1); key(&x, "general.alignment", KVZ_GGUF_U64); u64(&x, 32));
    /* duplicate key */
    REJECT(KVZ_ERR_FORMAT, hdr(&x, 3, 0, 3); key(&x, "a", KVZ_GGUF_U8); u8(&x, 1);
           key(&x, "b", KVZ_GGUF_U8); u8(&x, 1); key(&x, "a", KVZ_GGUF_U8); u8(&x, 2));

    /* tensors */
    const uint64_t ne8[1] = {8}, ne0[2] = {8, 0}, nebig[4] = {1ull << 32, 1ull << 32, 1, 1};
    const uint64_t ne33[1] = {33}, ne5[5] = {1, 1, 1, 1, 1};
#define T1(...) hdr(&x, 3, 1, 0); __VA_ARGS__; pad(&x, 32); for (int i_ = 0; i_ < 64; i_++) u8(&x, 0)
    REJECT(0, T1(tinfo(&x, "t", 1, ne8, KVZ_TYPE_F32, 0)));                    /* control: valid */
    REJECT(KVZ_ERR_TRUNCATED, T1(tinfo(&x, "t", 1, ne8, KVZ_TYPE_F32, 64)));   /* beyond EOF */
    REJECT(KVZ_ERR_TRUNCATED, T1(tinfo(&x, "t", 1, ne8, KVZ_TYPE_F32, 1ull << 40)));
    REJECT(KVZ_ERR_FORMAT, T1(tinfo(&x, "t", 1, ne8, KVZ_TYPE_F32, UINT64_MAX)));      /* unaligned */
    REJECT(KVZ_ERR_TRUNCATED, T1(tinfo(&x, "t", 1, ne8, KVZ_TYPE_F32, UINT64_MAX - 31)));
    REJECT(KVZ_ERR_FORMAT, T1(tinfo(&x, "t", 1, ne8, KVZ_TYPE_F32, 16)));      /* unaligned */
    REJECT(KVZ_ERR_UNSUPPORTED, T1(tinfo(&x, "t", 1, ne8, 4, 0)));              /* removed Q4_2 */
    REJECT(KVZ_ERR_UNSUPPORTED, T1(tinfo(&x, "t", 1, ne8, 1000, 0)));
    REJECT(KVZ_ERR_FORMAT, T1(tinfo(&x, "t", 2, ne0, KVZ_TYPE_F32, 0)));        /* zero dim */
    REJECT(KVZ_ERR_FORMAT, T1(tinfo(&x, "t", 0, ne8, KVZ_TYPE_F32, 0)));        /* no dims */
    REJECT(KVZ_ERR_FORMAT, T1(tinfo(&x, "t", 5, ne5, KVZ_TYPE_F32, 0)));        /* too many dims */
    REJECT(KVZ_ERR_FORMAT, T1(tinfo(&x, "t", 4, nebig, KVZ_TYPE_F32, 0)));      /* nel overflows */
    REJECT(KVZ_ERR_FORMAT, T1(tinfo(&x, "t", 1, ne33, KVZ_TYPE_Q8_0, 0)));      /* not a block multiple */
    REJECT(KVZ_ERR_FORMAT, hdr(&x, 3, 2, 0); tinfo(&x, "t", 1, ne8, KVZ_TYPE_F32, 0);
           tinfo(&x, "t", 1, ne8, KVZ_TYPE_F32, 32); pad(&x, 32); for (int i = 0; i < 64; i++) u8(&x, 0));
    REJECT(KVZ_ERR_FORMAT, T1(str(&x, "t"); u32(&x, 1); u64(&x, 1ull << 63); u32(&x, 0); u64(&x, 0)));
#undef T1
#undef REJECT
    free(b.p);
}

static void test_fingerprint(void)
{
    gb b = {0};
    size_t ds;
    build_valid(&b, 3, &ds);
    uint8_t f1[16], f2[16], f3[16], z[16] = {0};
    kvz_gguf *g = NULL;
    NEED(open_bytes(b.p, b.n, &g) == 0);
    kvz_gguf_fingerprint(g, f1);
    kvz_gguf_fingerprint(g, f2); /* cached */
    kvz_gguf_close(g);
    CHECK(memcmp(f1, f2, 16) == 0 && memcmp(f1, z, 16) != 0);
    NEED(open_bytes(b.p, b.n, &g) == 0);
    kvz_gguf_fingerprint(g, f2);
    kvz_gguf_close(g);
    CHECK(memcmp(f1, f2, 16) == 0);

    /* a tensor byte (last byte of the file: tensor c) */
    b.p[b.n - 1] ^= 1;
    NEED(open_bytes(b.p, b.n, &g) == 0);
    kvz_gguf_fingerprint(g, f3);
    kvz_gguf_close(g);
    CHECK(memcmp(f1, f3, 16) != 0);
    b.p[b.n - 1] ^= 1;

    /* a metadata byte: the 'l' of "llama" */
    size_t at = 0;
    for (size_t i = 0; i + 5 <= b.n; i++)
        if (memcmp(b.p + i, "llama", 5) == 0) { at = i; break; }
    NEED(at != 0);
    b.p[at] = 'L';
    NEED(open_bytes(b.p, b.n, &g) == 0);
    kvz_gguf_fingerprint(g, f3);
    kvz_gguf_close(g);
    CHECK(memcmp(f1, f3, 16) != 0);
    b.p[at] = 'l';

    /* padding between tensors is not hashed: a's data ends at ds+48, b starts at ds+64 */
    b.p[ds + 50] = 0xAA;
    NEED(open_bytes(b.p, b.n, &g) == 0);
    kvz_gguf_fingerprint(g, f3);
    kvz_gguf_close(g);
    CHECK(memcmp(f1, f3, 16) == 0);
    free(b.p);
}

int main(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/kvz_test_gguf_XXXXXX", tmp ? tmp : "/tmp");
    REQUIRE(mkdtemp(g_dir) != NULL);
    test_valid();
    test_v2_default_align();
    test_truncation();
    test_rejects();
    test_fingerprint();
    rmdir(g_dir);
    return kvz_test_summary();
}
