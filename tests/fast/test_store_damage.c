/* Damaged stores through the library (issue 18): kvz_store_open refuses an empty
 * data.mdb (and does not start a new store over it with KVZ_STORE_CREATE), one
 * shorter than its meta pages and one cut short, with KVZ_ERR_FORMAT "store
 * damaged"; READONLY|SALVAGE opens the cut one and kvz_store_salvage copies what
 * reads back intact without crashing; a document whose META record is missing is
 * damage (KVZ_ERR_FORMAT) once read through its doc entry, while a lookup by hash
 * alone stays KVZ_ERR_NOTFOUND; kvz_store_read_next_doc walks the ids in order;
 * salvage of a healthy store copies everything and the copy verifies; salvage
 * refuses a destination that already holds a store. Salvage of the cut file (a
 * SIGBUS per damaged read, each jumping out of an LMDB call and leaking what that
 * call had allocated) is left out under AddressSanitizer, whose leak check would
 * count those; the open-time checks run under it too. */
#include "blob_fixture.h"
#include "kvz_blob.h"
#include "kvz_error.h"
#include "kvz_store.h"
#include "kvz_test.h"

#include <lmdb.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif
#ifndef UNDER_ASAN
#define UNDER_ASAN 0
#endif

static uint8_t *g_meta;
static size_t g_meta_len;
static kvz_store_rec g_layers[FX_L];
static uint8_t g_fp[16];

static void make_records(void)
{
    static fx_cache c;
    fx_make(&c, KVZ_DTYPE_F16);
    memcpy(g_fp, c.meta.fingerprint, 16);
    if (kvz_blob_encode_meta(&c.meta, 1, &g_meta, &g_meta_len)) abort();
    for (uint32_t l = 0; l < FX_L; l++) {
        uint8_t *rec;
        size_t n;
        if (kvz_blob_encode_layer(&c.meta, l, c.pos[l], c.k[l], c.v[l], 1, &rec, &n)) abort();
        g_layers[l] = (kvz_store_rec){rec, n};
    }
}

static void hash_of(int i, uint8_t h[16])
{
    memset(h, 0, 16);
    h[0] = 0x51;
    h[15] = (uint8_t)i;
}

static int put(kvz_store *s, const char *id, int hi)
{
    kvz_store_doc_info in;
    memset(&in, 0, sizeof in);
    snprintf(in.source_path, sizeof in.source_path, "src/%s", id);
    in.n_tokens = 12;
    in.ratio = 0.5f;
    uint8_t h[16];
    hash_of(hi, h);
    return kvz_store_put_doc(s, id, h, &in, &(kvz_store_rec){g_meta, g_meta_len}, g_layers, FX_L, NULL);
}

static void copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    if (!a || !b) abort();
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, a)) > 0) fwrite(buf, 1, n, b);
    fclose(a);
    fclose(b);
}

/* A copy of store @p src in @p dst with data.mdb cut to @p size (-1: as is). */
static void copy_store(const char *src, const char *dst, long long size)
{
    char a[600], b[600];
    mkdir(dst, 0755);
    snprintf(a, sizeof a, "%s/data.mdb", src);
    snprintf(b, sizeof b, "%s/data.mdb", dst);
    copy_file(a, b);
    if (size >= 0 && truncate(b, size)) abort();
}

static long long file_size(const char *dir)
{
    char p[600];
    snprintf(p, sizeof p, "%s/data.mdb", dir);
    struct stat st;
    return stat(p, &st) ? -1 : (long long)st.st_size;
}

static int damaged(int rc) { return rc == KVZ_ERR_FORMAT && strstr(kvz_error_detail(), "store damaged"); }

static int lost_cb(void *u, const char *id, int err, const char *msg)
{
    (void)id; (void)err; (void)msg;
    ++*(int *)u;
    return 0;
}

int main(void)
{
    make_records();
    char root[] = "/tmp/kvz_store_damage_XXXXXX";
    REQUIRE(mkdtemp(root));
    char dir[512], d2[512], d3[512];
    snprintf(dir, sizeof dir, "%s/store", root);

    /* a healthy store: 40 documents over 20 blobs, so the trees have several pages */
    kvz_store *s;
    REQUIRE(kvz_store_open(dir, KVZ_STORE_CREATE, 0, g_fp, &s) == 0);
    for (int i = 0; i < 40; i++) {
        char id[32];
        snprintf(id, sizeof id, "doc%02d", i);
        CHECK(put(s, id, i % 20) == 0);
    }
    kvz_store_close(s);
    const long long size = file_size(dir);
    CHECK(size > 8 * 4096);

    /* empty data.mdb: refused, also by a writer, and not re-initialised */
    snprintf(d2, sizeof d2, "%s/empty", root);
    copy_store(dir, d2, 0);
    CHECK(damaged(kvz_store_open(d2, KVZ_STORE_READONLY, 0, NULL, &s)));
    CHECK(strstr(kvz_error_detail(), "empty (0 bytes)") != NULL);
    CHECK(damaged(kvz_store_open(d2, KVZ_STORE_CREATE, 0, g_fp, &s)));
    CHECK(file_size(d2) == 0);

    /* shorter than the two meta pages */
    snprintf(d2, sizeof d2, "%s/onepage", root);
    copy_store(dir, d2, 4096);
    CHECK(damaged(kvz_store_open(d2, KVZ_STORE_READONLY, 0, NULL, &s)));
    CHECK(strstr(kvz_error_detail(), "meta pages") != NULL);

    /* cut in half: refused (reader and writer), open for salvage */
    snprintf(d2, sizeof d2, "%s/half", root);
    copy_store(dir, d2, size / 2);
    CHECK(damaged(kvz_store_open(d2, KVZ_STORE_READONLY, 0, NULL, &s)));
    CHECK(strstr(kvz_error_detail(), "cut short") != NULL);
    CHECK(damaged(kvz_store_open(d2, 0, 0, g_fp, &s)));
    CHECK(kvz_store_open(d2, KVZ_STORE_SALVAGE, 0, NULL, &s) == KVZ_ERR_ARG); /* needs READONLY */
    if (!UNDER_ASAN) {
        REQUIRE(kvz_store_open(d2, KVZ_STORE_READONLY | KVZ_STORE_SALVAGE, 0, NULL, &s) == 0);
        snprintf(d3, sizeof d3, "%s/salv_half", root);
        kvz_store_salvage_result sr;
        int nlost = 0;
        int rc = kvz_store_salvage(s, d3, lost_cb, &nlost, &sr);
        CHECKF(rc == 0, "salvage of a cut store: %d %s", rc, kvz_error_detail());
        CHECK((uint64_t)nlost == sr.n_lost + sr.n_gaps);
        CHECK(sr.n_copied + sr.n_lost <= 40);
        printf("salvage of the half store: %llu docs found, %llu copied, %llu lost, %llu gaps\n",
               (unsigned long long)sr.n_docs, (unsigned long long)sr.n_copied,
               (unsigned long long)sr.n_lost, (unsigned long long)sr.n_gaps);
        /* every read of it ends in an error, never a crash */
        kvz_store_verify_result vr;
        rc = kvz_store_verify(s, NULL, NULL, &vr);
        CHECK(rc != 0 || vr.n_problems > 0);
        kvz_store_close(s);
        char mdb[600];
        snprintf(mdb, sizeof mdb, "%s/data.mdb", d3);
        if (sr.n_copied == 0) { /* nothing saved: no empty store left that could pass for the salvage */
            CHECKF(access(mdb, F_OK) != 0, "%s exists after a salvage that copied nothing", mdb);
        } else {
            kvz_store *t;
            REQUIRE(kvz_store_open(d3, KVZ_STORE_READONLY, 0, g_fp, &t) == 0);
            CHECK(kvz_store_verify(t, NULL, NULL, &vr) == 0 && vr.n_problems == 0 && vr.n_docs == sr.n_copied);
            kvz_store_close(t);
        }
    }

    /* a document whose META record is missing (deleted through raw LMDB) */
    snprintf(d2, sizeof d2, "%s/missing", root);
    copy_store(dir, d2, -1);
    {
        MDB_env *env;
        MDB_txn *txn;
        MDB_dbi blobs;
        mdb_env_create(&env);
        mdb_env_set_maxdbs(env, 8);
        REQUIRE(mdb_env_open(env, d2, MDB_NOTLS, 0644) == 0);
        REQUIRE(mdb_txn_begin(env, NULL, 0, &txn) == 0);
        REQUIRE(mdb_dbi_open(txn, "blobs", 0, &blobs) == 0);
        uint8_t k[20];
        hash_of(3, k);
        memset(k + 16, 0xff, 4);
        MDB_val kk = {20, k};
        CHECK(mdb_del(txn, blobs, &kk, NULL) == 0);
        CHECK(mdb_txn_commit(txn) == 0);
        mdb_env_close(env);
    }
    REQUIRE(kvz_store_open(d2, KVZ_STORE_READONLY, 0, g_fp, &s) == 0);
    kvz_store_read *r;
    REQUIRE(kvz_store_read_begin(s, &r) == 0);
    kvz_store_doc_info info;
    const uint8_t *rec;
    size_t len;
    uint8_t h3[16];
    hash_of(3, h3);
    CHECK(kvz_store_read_meta(r, h3, &rec, &len) == KVZ_ERR_NOTFOUND); /* no doc context */
    CHECK(kvz_store_read_doc(r, "doc03", &info) == 0);
    CHECK(damaged(kvz_store_read_meta(r, info.hash, &rec, &len)));
    CHECK(strstr(kvz_error_detail(), "document 'doc03'") && strstr(kvz_error_detail(), "META record) is missing"));
    CHECK(kvz_store_read_layer(r, info.hash, 0, &rec, &len) == 0); /* the layers are there */
    CHECK(kvz_store_read_doc(r, "doc04", &info) == 0);
    CHECK(kvz_store_read_meta(r, info.hash, &rec, &len) == 0);
    /* the walk over ids, in order */
    char id[KVZ_STORE_DOC_ID_MAX + 1], prev[KVZ_STORE_DOC_ID_MAX + 1] = "";
    int n = 0, ordered = 1, rc;
    while ((rc = kvz_store_read_next_doc(r, n ? prev : NULL, id, &info)) == 0) {
        if (n && strcmp(prev, id) >= 0) ordered = 0;
        snprintf(prev, sizeof prev, "%s", id);
        n++;
    }
    CHECK(rc == KVZ_ERR_NOTFOUND && n == 40 && ordered);
    kvz_store_read_end(r);
    /* salvage: the two documents on blob 3 are lost, the other 38 copied */
    snprintf(d3, sizeof d3, "%s/salv_missing", root);
    kvz_store_salvage_result sr;
    int nlost = 0;
    CHECK(kvz_store_salvage(s, d3, lost_cb, &nlost, &sr) == 0);
    CHECKF(sr.n_docs == 40 && sr.n_copied == 38 && sr.n_lost == 2 && nlost == 2 && sr.n_gaps == 0,
           "%llu docs, %llu copied, %llu lost", (unsigned long long)sr.n_docs,
           (unsigned long long)sr.n_copied, (unsigned long long)sr.n_lost);
    CHECK(kvz_store_salvage(s, d3, NULL, NULL, &sr) == KVZ_ERR_ARG); /* exists */
    kvz_store_close(s);
    kvz_store *t;
    REQUIRE(kvz_store_open(d3, KVZ_STORE_READONLY, 0, g_fp, &t) == 0);
    kvz_store_verify_result vr;
    CHECK(kvz_store_verify(t, NULL, NULL, &vr) == 0 && vr.n_problems == 0 && vr.n_docs == 38);
    CHECK(kvz_store_lookup(t, "doc03", &info) == KVZ_ERR_NOTFOUND);
    CHECK(kvz_store_lookup(t, "doc05", &info) == 0 && !strcmp(info.source_path, "src/doc05"));
    kvz_store_close(t);

    /* salvage of the healthy store copies all 40 */
    REQUIRE(kvz_store_open(dir, KVZ_STORE_READONLY, 0, g_fp, &s) == 0);
    snprintf(d3, sizeof d3, "%s/salv_all", root);
    CHECK(kvz_store_salvage(s, d3, NULL, NULL, &sr) == 0 && sr.n_copied == 40 && sr.n_lost == 0);
    kvz_store_close(s);
    REQUIRE(kvz_store_open(d3, KVZ_STORE_READONLY, 0, g_fp, &t) == 0);
    kvz_store_stats ss;
    CHECK(kvz_store_stats_get(t, &ss) == 0 && ss.n_docs == 40 && ss.n_blobs == 20);
    kvz_store_close(t);

    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    if (system(cmd)) fprintf(stderr, "cleanup of %s failed\n", root);
    return kvz_test_summary();
}
