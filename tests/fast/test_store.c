/* LMDB store: put/lookup/read back, no-op re-put, replacement frees old records,
 * refcounted sharing, delete, persistence, map growth from a tiny map, model
 * mismatch, on-disk corruption detected on read, and crash consistency under
 * SIGKILL of a writing child. */
#include "kvz_blob.h"
#include "kvz_error.h"
#include "kvz_store.h"
#include "kvz_test.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NEED(cond) do { if (!(cond)) { CHECK(cond); return; } } while (0)

static const uint8_t FP_A[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const uint8_t FP_B[16] = {0xB, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

/* ------------------------------------------------------------------------- */
/* A synthetic blob: random (incompressible) K/V, deterministic in the seed.   */

typedef struct {
    kvz_blob_meta m;
    uint8_t *meta;
    size_t meta_len;
    kvz_store_rec *layers;
    uint8_t hash[16];
} tblob;

static uint64_t mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int gen(tblob *b, uint64_t seed, const uint8_t fp[16], uint32_t L, uint32_t H, uint32_t hd,
               uint32_t n_ctx)
{
    memset(b, 0, sizeof *b);
    kvz_blob_meta *m = &b->m;
    memcpy(m->fingerprint, fp, 16);
    m->n_layer = L; m->n_head = 3 * H; m->n_kv_head = H; m->head_dim = hd;
    m->dtype = KVZ_DTYPE_F16; m->mode = KVZ_MODE_GLOBAL; m->prefix_policy = KVZ_PREFIX_KEEP;
    m->ratio = 0.3f; m->chunk = 2000; m->overlap = 8; m->n_prefix = 4; m->n_context = n_ctx;
    m->counts = malloc(sizeof(uint32_t) * L * H);
    uint64_t s = seed;
    for (uint32_t i = 0; i < L * H; i++) m->counts[i] = 4 + (uint32_t)(mix(&s) % (n_ctx / 2 + 1));
    int err = kvz_blob_encode_meta(m, 1, &b->meta, &b->meta_len);
    b->layers = calloc(L, sizeof *b->layers);
    for (uint32_t l = 0; l < L && !err; l++) {
        uint64_t kept = kvz_blob_layer_kept(m, l), off[64 + 1];
        kvz_blob_layer_offsets(m, l, off);
        uint32_t *pos = malloc(kept * 4 + 4);
        uint8_t *k = malloc(kept * hd * 2 + 8), *v = malloc(kept * hd * 2 + 8);
        for (uint32_t h = 0; h < H; h++)
            for (uint64_t i = 0; i < off[h + 1] - off[h]; i++)
                pos[off[h] + i] = i < 4 ? (uint32_t)i : (uint32_t)(4 + 2 * (i - 4) + (mix(&s) & 1));
        for (uint64_t i = 0; i < kept * hd * 2; i += 8) {
            uint64_t r1 = mix(&s), r2 = mix(&s);
            memcpy(k + i, &r1, 8);
            memcpy(v + i, &r2, 8);
        }
        uint8_t *rec;
        size_t n;
        err = kvz_blob_encode_layer(m, l, pos, k, v, 1, &rec, &n);
        b->layers[l].data = rec;
        b->layers[l].len = n;
        free(pos); free(k); free(v);
    }
    uint8_t pb[KVZ_BLOB_PARAMS_SIZE];
    kvz_blob_params_bytes(m, pb);
    int32_t tok[16];
    for (int i = 0; i < 16; i++) tok[i] = (int32_t)(seed * 1000 + (uint64_t)i);
    kvz_blob_content_hash(fp, pb, sizeof pb, 16, tok, b->hash);
    return err;
}

static void tfree(tblob *b)
{
    for (uint32_t l = 0; b->layers && l < b->m.n_layer; l++) free((void *)b->layers[l].data);
    free(b->layers);
    free(b->meta);
    free(b->m.counts);
    memset(b, 0, sizeof *b);
}

static kvz_store_doc_info mkinfo(const char *src)
{
    kvz_store_doc_info i;
    memset(&i, 0, sizeof i);
    snprintf(i.source_path, sizeof i.source_path, "%s", src);
    i.n_tokens = 1234;
    i.ratio = 0.3f;
    i.mode = KVZ_MODE_GLOBAL;
    i.bytes_kv_full = 1000;
    i.bytes_kv_kept = 300;
    return i;
}

static int put(kvz_store *s, const char *id, const tblob *b, const char *src, int *status)
{
    kvz_store_doc_info i = mkinfo(src);
    return kvz_store_put_doc(s, id, b->hash, &i, &(kvz_store_rec){b->meta, b->meta_len}, b->layers,
                             b->m.n_layer, status);
}

/* Read every record of @p hash back, decode it, and (if given) compare with @p b. */
static int verify_doc(kvz_store *s, const char *id, const uint8_t *fp, const tblob *b)
{
    kvz_store_read *r;
    int err = kvz_store_read_begin(s, &r);
    if (err) return err;
    kvz_store_doc_info info;
    kvz_blob_meta m = {0};
    const uint8_t *rec;
    size_t n;
    if ((err = kvz_store_read_doc(r, id, &info))) goto out;
    if (b && memcmp(info.hash, b->hash, 16)) { err = 1; goto out; }
    if ((err = kvz_store_read_meta(r, info.hash, &rec, &n))) goto out;
    if (b && (n != b->meta_len || memcmp(rec, b->meta, n))) { err = 2; goto out; }
    if ((err = kvz_blob_decode_meta(rec, n, fp, &m))) goto out;
    uint64_t bytes = n;
    if (info.n_records != m.n_layer + 1) { err = 3; goto out; }
    for (uint32_t l = 0; l < m.n_layer && !err; l++) {
        if ((err = kvz_store_read_layer(r, info.hash, l, &rec, &n))) break;
        bytes += n;
        if (b && (n != b->layers[l].len || memcmp(rec, b->layers[l].data, n))) { err = 4; break; }
        uint64_t kept = kvz_blob_layer_kept(&m, l);
        uint32_t *pos = malloc(kept * 4 + 4);
        uint8_t *k = malloc(kept * m.head_dim * 2 + 1), *v = malloc(kept * m.head_dim * 2 + 1);
        err = kvz_blob_decode_layer(&m, l, rec, n, pos, k, v);
        free(pos); free(k); free(v);
    }
    if (!err && bytes != info.bytes_stored) err = 5;
out:
    kvz_blob_meta_free(&m);
    kvz_store_read_end(r);
    return err;
}

static char g_root[256];
static int list_cb(void *u, const char *id, const kvz_store_doc_info *in);

static void mkdir_tmp(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", g_root, name);
}

static uint64_t txnid(kvz_store *s)
{
    kvz_store_stats st;
    kvz_store_stats_get(s, &st);
    return st.last_txnid;
}

/* ------------------------------------------------------------------------- */

static void test_basic(void)
{
    char dir[512];
    mkdir_tmp(dir, sizeof dir, "basic");
    kvz_store *s;
    CHECK(kvz_store_open(dir, 0, 0, FP_A, &s) == KVZ_ERR_NOTFOUND);
    CHECK(kvz_store_open(dir, KVZ_STORE_READONLY, 0, FP_A, &s) == KVZ_ERR_NOTFOUND);
    NEED(kvz_store_open(dir, KVZ_STORE_CREATE, 0, FP_A, &s) == 0);
    tblob b1, b2;
    NEED(gen(&b1, 1, FP_A, 3, 2, 16, 64) == 0 && gen(&b2, 2, FP_A, 3, 2, 16, 64) == 0);
    int st;
    kvz_store_doc_info info;

    /* put / lookup / read back */
    CHECK(put(s, "doc1", &b1, "/corpus/a.txt", &st) == 0 && st == KVZ_STORE_WRITTEN);
    CHECK(kvz_store_lookup(s, "doc1", &info) == 0);
    CHECK(!memcmp(info.hash, b1.hash, 16) && !strcmp(info.source_path, "/corpus/a.txt"));
    CHECK(info.n_tokens == 1234 && info.ratio == 0.3f && info.bytes_kv_kept == 300 && info.ingest_time > 0);
    CHECK(info.n_records == 4);
    CHECKF(verify_doc(s, "doc1", FP_A, &b1) == 0, "%s", kvz_error_detail());
    CHECK(kvz_store_has_hash(s, b1.hash) == 1);

    /* unchanged re-put: no write transaction at all */
    uint64_t t0 = txnid(s);
    CHECK(put(s, "doc1", &b1, "/corpus/a.txt", &st) == 0 && st == KVZ_STORE_UNCHANGED);
    CHECK(txnid(s) == t0);
    /* same content, other path: info only */
    CHECK(put(s, "doc1", &b1, "/corpus/moved.txt", &st) == 0 && st == KVZ_STORE_INFO_UPDATED);
    CHECK(kvz_store_lookup(s, "doc1", &info) == 0 && !strcmp(info.source_path, "/corpus/moved.txt"));
    CHECK(info.n_records == 4 && info.bytes_stored > 0);

    /* changed content replaces and frees the old records */
    CHECK(put(s, "doc1", &b2, "/corpus/a.txt", &st) == 0 && st == KVZ_STORE_WRITTEN);
    CHECK(kvz_store_has_hash(s, b1.hash) == 0 && kvz_store_has_hash(s, b2.hash) == 1);
    CHECK(verify_doc(s, "doc1", FP_A, &b2) == 0);
    kvz_store_stats ss;
    CHECK(kvz_store_stats_get(s, &ss) == 0 && ss.n_docs == 1 && ss.n_blobs == 1 && ss.n_records == 4);
    CHECK(ss.has_model && !memcmp(ss.model_fp, FP_A, 16));

    /* two names share one hash (refcount) */
    kvz_store_doc_info i2 = mkinfo("/corpus/copy.txt");
    CHECK(kvz_store_put_doc(s, "doc2", b2.hash, &i2, NULL, NULL, 0, &st) == 0 && st == KVZ_STORE_LINKED);
    CHECK(put(s, "doc3", &b2, "/corpus/copy3.txt", &st) == 0 && st == KVZ_STORE_LINKED);
    CHECK(kvz_store_stats_get(s, &ss) == 0 && ss.n_docs == 3 && ss.n_blobs == 1 && ss.n_records == 4);
    CHECK(verify_doc(s, "doc2", FP_A, &b2) == 0);
    CHECK(kvz_store_delete_doc(s, "doc1") == 0);
    CHECK(kvz_store_has_hash(s, b2.hash) == 1);
    CHECK(put(s, "doc3", &b1, "/corpus/copy3.txt", &st) == 0 && st == KVZ_STORE_WRITTEN);
    CHECK(kvz_store_has_hash(s, b2.hash) == 1); /* doc2 still holds it */
    CHECK(kvz_store_delete_doc(s, "doc2") == 0);
    CHECK(kvz_store_has_hash(s, b2.hash) == 0);
    CHECK(kvz_store_stats_get(s, &ss) == 0 && ss.n_docs == 1 && ss.n_blobs == 1 && ss.n_records == 4);

    /* missing things */
    CHECK(kvz_store_lookup(s, "nope", &info) == KVZ_ERR_NOTFOUND);
    CHECK(kvz_store_delete_doc(s, "nope") == KVZ_ERR_NOTFOUND);
    CHECK(kvz_store_put_doc(s, "doc9", b2.hash, &i2, NULL, NULL, 0, &st) == KVZ_ERR_NOTFOUND);
    kvz_store_read *r;
    const uint8_t *rec;
    size_t n;
    CHECK(kvz_store_read_begin(s, &r) == 0);
    CHECK(kvz_store_read_meta(r, b2.hash, &rec, &n) == KVZ_ERR_NOTFOUND);
    CHECK(kvz_store_read_layer(r, b1.hash, 7, &rec, &n) == KVZ_ERR_NOTFOUND);
    CHECK(kvz_store_read_layer(r, b1.hash, 2, &rec, &n) == 0);
    kvz_store_read_end(r);

    /* argument checks, and a record set that is not one blob */
    char longid[600];
    memset(longid, 'x', sizeof longid - 1);
    longid[sizeof longid - 1] = 0;
    CHECK(put(s, longid, &b1, "", &st) == KVZ_ERR_ARG);
    CHECK(put(s, "", &b1, "", &st) == KVZ_ERR_ARG);
    kvz_store_doc_info i3 = mkinfo("x");
    CHECK(kvz_store_put_doc(s, "bad", b1.hash, &i3, &(kvz_store_rec){b1.meta, b1.meta_len},
                            b2.layers, 3, &st) == KVZ_ERR_FORMAT);
    CHECK(kvz_store_put_doc(s, "bad", b1.hash, &i3, &(kvz_store_rec){b1.meta, b1.meta_len},
                            b1.layers, 2, &st) == KVZ_ERR_ARG);
    CHECK(kvz_store_lookup(s, "bad", &info) == KVZ_ERR_NOTFOUND);

    /* list */
    CHECK(put(s, "a-first", &b1, "", &st) == 0 && st == KVZ_STORE_LINKED);
    int count = 0;
    CHECK(kvz_store_list(s, list_cb, &count) == 0 && count == 2);
    kvz_store_close(s);

    /* reopen: persistence, read-only */
    NEED(kvz_store_open(dir, KVZ_STORE_READONLY, 0, FP_A, &s) == 0);
    CHECK(verify_doc(s, "doc3", FP_A, &b1) == 0 && verify_doc(s, "a-first", FP_A, &b1) == 0);
    CHECK(put(s, "doc4", &b1, "", &st) == KVZ_ERR_ARG);
    kvz_store_close(s);
    NEED(kvz_store_open(dir, 0, 4096, NULL, &s) == 0); /* tiny map request: keeps file size */
    CHECK(verify_doc(s, "doc3", FP_A, &b1) == 0);
    kvz_store_close(s);

    /* another model */
    CHECK(kvz_store_open(dir, 0, 0, FP_B, &s) == KVZ_ERR_MODEL);
    CHECK(strstr(kvz_error_detail(), "0b02") != NULL);
    NEED(kvz_store_open(dir, 0, 0, NULL, &s) == 0);
    tblob bb;
    NEED(gen(&bb, 5, FP_B, 2, 2, 8, 16) == 0);
    CHECK(put(s, "other", &bb, "", &st) == KVZ_ERR_MODEL);
    kvz_store_close(s);
    char dir2[512];
    mkdir_tmp(dir2, sizeof dir2, "fresh");
    NEED(kvz_store_open(dir2, KVZ_STORE_CREATE, 0, FP_A, &s) == 0);
    CHECK(put(s, "other", &bb, "", &st) == KVZ_ERR_MODEL); /* first put must match the opener */
    kvz_store_close(s);

    /* not a kvzip store */
    char dir3[512];
    mkdir_tmp(dir3, sizeof dir3, "junk");
    mkdir(dir3, 0755);
    char path[600];
    snprintf(path, sizeof path, "%s/data.mdb", dir3);
    FILE *f = fopen(path, "wb");
    for (int i = 0; i < 10000; i++) fputc(i * 7, f);
    fclose(f);
    int e = kvz_store_open(dir3, 0, 0, FP_A, &s);
    CHECKF(e == KVZ_ERR_FORMAT || e == KVZ_ERR_VERSION, "junk store: %d %s", e, kvz_error_detail());
    tfree(&b1); tfree(&b2); tfree(&bb);
}

static int list_cb(void *u, const char *id, const kvz_store_doc_info *in)
{
    (void)in;
    int *count = u;
    if (*count == 0 && strcmp(id, "a-first")) return 99; /* byte order */
    (*count)++;
    return 0;
}

static void test_growth(void)
{
    char dir[512];
    mkdir_tmp(dir, sizeof dir, "growth");
    kvz_store *s;
    NEED(kvz_store_open(dir, KVZ_STORE_CREATE, 64 << 10, FP_A, &s) == 0);
    kvz_store_stats st0, st1;
    CHECK(kvz_store_stats_get(s, &st0) == 0 && st0.map_size == 64 << 10);
    enum { N = 24 };
    tblob b[N];
    int ok = 1, status;
    for (int i = 0; i < N; i++) { /* ~4 layers x 2 heads x 64 x ~1000 rows x 2 x 2 B: ~1 MB each */
        ok &= gen(&b[i], 100 + (uint64_t)i, FP_A, 4, 2, 64, 2000) == 0;
        char id[32];
        snprintf(id, sizeof id, "big%02d", i);
        int e = put(s, id, &b[i], "", &status);
        if (e) { ok = 0; fprintf(stderr, "growth put %d: %s\n", i, kvz_error_detail()); }
    }
    CHECK(ok);
    CHECK(kvz_store_stats_get(s, &st1) == 0 && st1.n_docs == N && st1.map_size > st0.map_size);
    CHECKF(st1.map_size >= st1.map_used, "%llu %llu", (unsigned long long)st1.map_size, (unsigned long long)st1.map_used);
    printf("map grew from %llu to %llu bytes (%llu used, %llu record bytes)\n",
           (unsigned long long)st0.map_size, (unsigned long long)st1.map_size,
           (unsigned long long)st1.map_used, (unsigned long long)st1.bytes_records);
    kvz_store_close(s);
    NEED(kvz_store_open(dir, 0, 64 << 10, FP_A, &s) == 0);
    for (int i = 0; i < N; i++) {
        char id[32];
        snprintf(id, sizeof id, "big%02d", i);
        CHECKF(verify_doc(s, id, FP_A, &b[i]) == 0, "%s", id);
    }
    /* a cap the next blob cannot fit under: KVZ_ERR_FULL and nothing changed */
    kvz_store_stats_get(s, &st0);
    kvz_store_set_max_map(s, st0.map_used + 4096);
    tblob huge;
    NEED(gen(&huge, 999, FP_A, 8, 2, 64, 4000) == 0);
    CHECK(put(s, "huge", &huge, "", &status) == KVZ_ERR_FULL);
    kvz_store_doc_info info;
    CHECK(kvz_store_lookup(s, "huge", &info) == KVZ_ERR_NOTFOUND);
    CHECK(kvz_store_stats_get(s, &st1) == 0 && st1.n_docs == N && st1.last_txnid == st0.last_txnid);
    kvz_store_set_max_map(s, KVZ_STORE_DEFAULT_MAX_MAP);
    CHECK(put(s, "huge", &huge, "", &status) == 0);
    CHECK(verify_doc(s, "huge", FP_A, &huge) == 0);
    kvz_store_close(s);
    for (int i = 0; i < N; i++) tfree(&b[i]);
    tfree(&huge);
}

/* Readers on other threads while the writer grows the map. */
typedef struct { kvz_store *s; volatile int stop; int errors; int reads; } rd_arg;

static void *reader_thread(void *p)
{
    rd_arg *a = p;
    while (!a->stop) {
        int e = verify_doc(a->s, "seed", FP_A, NULL);
        if (e) a->errors++;
        a->reads++;
    }
    return NULL;
}

static void test_threads(void)
{
    char dir[512];
    mkdir_tmp(dir, sizeof dir, "threads");
    kvz_store *s;
    NEED(kvz_store_open(dir, KVZ_STORE_CREATE, 64 << 10, FP_A, &s) == 0);
    tblob seed;
    NEED(gen(&seed, 7, FP_A, 2, 2, 16, 64) == 0);
    int st;
    NEED(put(s, "seed", &seed, "", &st) == 0);
    rd_arg a = {s, 0, 0, 0};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, reader_thread, &a);
    int ok = 1;
    for (int i = 0; i < 12; i++) {
        tblob b;
        ok &= gen(&b, 300 + (uint64_t)i, FP_A, 4, 2, 64, 1000) == 0;
        char id[32];
        snprintf(id, sizeof id, "t%d", i);
        ok &= put(s, id, &b, "", &st) == 0;
        tfree(&b);
    }
    a.stop = 1;
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    CHECK(ok);
    CHECKF(a.errors == 0 && a.reads > 0, "%d errors in %d reads", a.errors, a.reads);
    kvz_store_close(s);
    tfree(&seed);
}

/* Flip a byte inside a stored layer record in data.mdb: reads must report it. */
static void test_corruption(void)
{
    char dir[512], path[600];
    mkdir_tmp(dir, sizeof dir, "corrupt");
    kvz_store *s;
    NEED(kvz_store_open(dir, KVZ_STORE_CREATE, 0, FP_A, &s) == 0);
    tblob b;
    NEED(gen(&b, 42, FP_A, 3, 2, 32, 400) == 0);
    int st;
    NEED(put(s, "victim", &b, "", &st) == 0);
    kvz_store_close(s);
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    size_t n;
    char *file = kvz_test_read_file(path, &n);
    NEED(file != NULL);
    const kvz_store_rec *L1 = &b.layers[1];
    char *hit = memmem(file, n, L1->data + 100, 64); /* unique: random K/V bytes */
    NEED(hit != NULL);
    size_t at = (size_t)(hit - file) + 10;
    int fd = open(path, O_WRONLY);
    uint8_t byte = (uint8_t)(file[at] ^ 0x20);
    CHECK(pwrite(fd, &byte, 1, (off_t)at) == 1);
    close(fd);
    free(file);
    NEED(kvz_store_open(dir, 0, 0, FP_A, &s) == 0);
    kvz_store_read *r;
    const uint8_t *rec;
    NEED(kvz_store_read_begin(s, &r) == 0);
    CHECK(kvz_store_read_layer(r, b.hash, 0, &rec, &n) == 0);
    CHECK(kvz_store_read_layer(r, b.hash, 1, &rec, &n) == KVZ_ERR_CHECKSUM);
    kvz_store_read_end(r);
    CHECK(verify_doc(s, "victim", FP_A, NULL) == KVZ_ERR_CHECKSUM);
    kvz_store_close(s);
    tfree(&b);
}

/* A child puts/deletes in a loop and is SIGKILLed at random moments; afterwards
 * every doc must be complete and every record intact, refcounts consistent. */
static int crash_child(const char *dir, int round, int wfd)
{
    kvz_store *s;
    if (kvz_store_open(dir, KVZ_STORE_CREATE, 256 << 10, FP_A, &s)) return 1;
    for (int i = 0;; i++) {
        tblob b;
        uint64_t seed = 1000 + (uint64_t)round * 100000 + (uint64_t)i;
        if (gen(&b, seed, FP_A, 6, 2, 32, 300 + (i % 5) * 200)) return 2;
        char id[32];
        snprintf(id, sizeof id, "c%d", i % 7);
        int st;
        if (i % 11 == 10) {
            int e = kvz_store_delete_doc(s, id);
            if (e && e != KVZ_ERR_NOTFOUND) return 3;
        } else if (i % 5 == 4) {
            char other[32];
            snprintf(other, sizeof other, "c%d", (i + 3) % 7);
            kvz_store_doc_info info;
            if (kvz_store_lookup(s, other, &info) == 0) {
                kvz_store_doc_info ni = mkinfo("linked");
                if (kvz_store_put_doc(s, id, info.hash, &ni, NULL, NULL, 0, &st)) return 4;
            }
        } else if (put(s, id, &b, "crash", &st)) {
            return 5;
        }
        if (write(wfd, &i, sizeof i) != sizeof i) return 6;
        tfree(&b);
    }
}

static int verify_all_cb(void *u, const char *id, const kvz_store_doc_info *in)
{
    (void)in;
    void **a = u;
    int e = verify_doc(a[0], id, FP_A, NULL);
    if (e) { fprintf(stderr, "doc %s: %d %s\n", id, e, kvz_error_detail()); (*(int *)a[1])++; }
    (*(int *)a[2])++;
    return 0;
}

static void test_crash(void)
{
    char dir[512];
    mkdir_tmp(dir, sizeof dir, "crash");
    uint64_t rs = (uint64_t)time(NULL) ^ (uint64_t)getpid();
    int progressed = 0;
    for (int round = 0; round < 16; round++) {
        int p[2];
        NEED(pipe(p) == 0);
        pid_t pid = fork();
        if (pid == 0) {
            close(p[0]);
            _exit(crash_child(dir, round, p[1]));
        }
        close(p[1]);
        /* let it commit at least a few times, then kill at a random moment */
        int got = 0, v;
        while (got < 3 && read(p[0], &v, sizeof v) == sizeof v) got++;
        usleep((useconds_t)(mix(&rs) % 40000));
        kill(pid, SIGKILL);
        int wst;
        waitpid(pid, &wst, 0);
        while (read(p[0], &v, sizeof v) == sizeof v) got++;
        close(p[0]);
        CHECKF(WIFSIGNALED(wst), "child exited by itself: status %d", WEXITSTATUS(wst));
        progressed += got;

        kvz_store *s;
        NEED(kvz_store_open(dir, 0, 0, FP_A, &s) == 0);
        int bad = 0, docs = 0;
        void *arg[3] = {s, &bad, &docs};
        CHECK(kvz_store_list(s, verify_all_cb, arg) == 0);
        CHECKF(bad == 0, "round %d: %d of %d docs damaged", round, bad, docs);
        /* refcounts: every stored blob is referenced, nothing leaks */
        kvz_store_stats st;
        CHECK(kvz_store_stats_get(s, &st) == 0);
        CHECKF(st.n_records == st.n_blobs * 7, "round %d: %llu records for %llu blobs", round,
               (unsigned long long)st.n_records, (unsigned long long)st.n_blobs);
        CHECK(st.n_blobs <= st.n_docs);
        kvz_store_close(s);
    }
    printf("crash test: %d committed writes across 16 killed children\n", progressed);
}

int main(void)
{
    const char *base = getenv("KVZ_BINARY_DIR");
    snprintf(g_root, sizeof g_root, "%s/kvz_store_test.XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(g_root)) { perror("mkdtemp"); return 1; }
    test_basic();
    test_growth();
    test_threads();
    test_corruption();
    test_crash();
    if (kvz_t_fail == 0) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
        if (system(cmd)) fprintf(stderr, "could not remove %s\n", g_root);
    } else {
        fprintf(stderr, "stores kept in %s\n", g_root);
    }
    return kvz_test_summary();
}
