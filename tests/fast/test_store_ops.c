/* Store maintenance: kvz_store_verify finds each kind of damage injected through
 * raw LMDB (orphan records, refcount drift, an unnamed blob, a corrupt layer
 * record, a dangling name), kvz_store_gc repairs what it can in one transaction
 * and is a no-op on a healthy store, kvz_store_compact shrinks the file, keeps
 * every document, and makes a writer that had the old files open fail with
 * KVZ_ERR_BUSY instead of writing into them. */
#include "blob_fixture.h"
#include "kvz_blob.h"
#include "kvz_error.h"
#include "kvz_store.h"
#include "kvz_test.h"

#include <lmdb.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

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
    h[0] = 0x40;
    h[15] = (uint8_t)i;
    h[14] = (uint8_t)(i >> 8);
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

/* Problems collected by the verify callback. */
static char g_msgs[64][1024];
static int g_n;

static int collect(void *u, int err, const char *msg)
{
    (void)u;
    (void)err;
    if (g_n < 64) snprintf(g_msgs[g_n++], sizeof g_msgs[0], "%s", msg);
    return 0;
}

static int found(const char *a, const char *b)
{
    for (int i = 0; i < g_n; i++)
        if (strstr(g_msgs[i], a) && (!b || strstr(g_msgs[i], b))) return 1;
    return 0;
}

static uint64_t verify(kvz_store *s)
{
    kvz_store_verify_result r;
    g_n = 0;
    int rc = kvz_store_verify(s, collect, NULL, &r);
    CHECKF(rc == 0, "verify rc %d %s", rc, kvz_error_detail());
    for (int i = 0; i < g_n; i++) fprintf(stderr, "  verify: %s\n", g_msgs[i]);
    return r.n_problems;
}

/* Raw LMDB edits to inject damage (the store handle must be closed). */
typedef struct {
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi blobs, refs, docs;
} raw;

static void raw_open(raw *r, const char *dir)
{
    mdb_env_create(&r->env);
    mdb_env_set_maxdbs(r->env, 8);
    mdb_env_set_mapsize(r->env, 64 << 20);
    if (mdb_env_open(r->env, dir, MDB_NOTLS, 0644) || mdb_txn_begin(r->env, NULL, 0, &r->txn) ||
        mdb_dbi_open(r->txn, "blobs", 0, &r->blobs) || mdb_dbi_open(r->txn, "refs", 0, &r->refs) ||
        mdb_dbi_open(r->txn, "docs", 0, &r->docs))
        abort();
}

static void raw_close(raw *r)
{
    CHECK(mdb_txn_commit(r->txn) == 0);
    mdb_env_close(r->env);
}

static void key_of(uint8_t k[20], int hi, uint32_t idx)
{
    hash_of(hi, k);
    k[16] = (uint8_t)(idx >> 24); k[17] = (uint8_t)(idx >> 16);
    k[18] = (uint8_t)(idx >> 8);  k[19] = (uint8_t)idx;
}

static void raw_put(raw *r, MDB_dbi d, const void *k, size_t kn, const void *v, size_t vn)
{
    MDB_val kk = {kn, (void *)k}, vv = {vn, (void *)v};
    CHECK(mdb_put(r->txn, d, &kk, &vv, 0) == 0);
}

static void put_all_records(raw *r, int hi)
{
    uint8_t k[20];
    key_of(k, hi, 0xFFFFFFFFu);
    raw_put(r, r->blobs, k, 20, g_meta, g_meta_len);
    for (uint32_t l = 0; l < FX_L; l++) {
        key_of(k, hi, l);
        raw_put(r, r->blobs, k, 20, g_layers[l].data, g_layers[l].len);
    }
}

static uint64_t file_size(const char *dir)
{
    char p[512];
    snprintf(p, sizeof p, "%s/data.mdb", dir);
    struct stat st;
    return stat(p, &st) ? 0 : (uint64_t)st.st_size;
}

int main(void)
{
    make_records();
    char root[] = "/tmp/kvz_store_ops_XXXXXX";
    REQUIRE(mkdtemp(root));
    char dir[512];
    snprintf(dir, sizeof dir, "%s/store", root);

    /* healthy store: a, b share blob 1; c has blob 2 */
    kvz_store *s;
    REQUIRE(kvz_store_open(dir, KVZ_STORE_CREATE, 0, g_fp, &s) == 0);
    CHECK(put(s, "a", 1) == 0);
    CHECK(put(s, "b", 1) == 0);
    CHECK(put(s, "c", 2) == 0);
    CHECK(verify(s) == 0);
    kvz_store_stats st0, st1;
    kvz_store_stats_get(s, &st0);
    kvz_store_gc_result g;
    CHECK(kvz_store_gc(s, &g) == 0);
    CHECK(g.blobs_dropped == 0 && g.records_dropped == 0 && g.refs_fixed == 0);
    kvz_store_stats_get(s, &st1);
    CHECKF(st1.last_txnid == st0.last_txnid, "gc of a healthy store committed (%llu -> %llu)",
           (unsigned long long)st0.last_txnid, (unsigned long long)st1.last_txnid);
    kvz_store_close(s);

    /* inject damage */
    raw r;
    raw_open(&r, dir);
    uint8_t k[20], h[16];
    key_of(k, 3, 0);                                     /* orphan record of blob 3 */
    raw_put(&r, r.blobs, k, 20, g_layers[0].data, g_layers[0].len);
    uint8_t ref[16] = {0};                               /* blob 1: refcount 5 instead of 2 */
    hash_of(1, h);
    MDB_val kh = {16, h}, vr;
    CHECK(mdb_get(r.txn, r.refs, &kh, &vr) == 0);
    memcpy(ref, vr.mv_data, 16);
    ref[0] = 5;
    raw_put(&r, r.refs, h, 16, ref, 16);
    ref[0] = 1;                                          /* blob 4: stored, named by nobody */
    hash_of(4, h);
    raw_put(&r, r.refs, h, 16, ref, 16);
    put_all_records(&r, 4);
    key_of(k, 2, 1);                                     /* blob 2: a damaged layer record */
    uint8_t *bad = malloc(g_layers[1].len);
    memcpy(bad, g_layers[1].data, g_layers[1].len);
    bad[g_layers[1].len - 3] ^= 0x40;
    raw_put(&r, r.blobs, k, 20, bad, g_layers[1].len);
    free(bad);
    MDB_val kd = {1, "a"}, vd;                           /* doc d names blob 9 (not stored) */
    CHECK(mdb_get(r.txn, r.docs, &kd, &vd) == 0);
    uint8_t *info = malloc(vd.mv_size);
    memcpy(info, vd.mv_data, vd.mv_size);
    hash_of(9, info + 4);
    raw_put(&r, r.docs, "d", 1, info, vd.mv_size);
    free(info);
    raw_close(&r);

    char hx1[40], hx2[40], hx3[40], hx4[40], hx9[40];
    snprintf(hx1, sizeof hx1, "blob 40%026d%04x", 0, 1);
    snprintf(hx2, sizeof hx2, "blob 40%026d%04x", 0, 2);
    snprintf(hx3, sizeof hx3, "blob 40%026d%04x", 0, 3);
    snprintf(hx4, sizeof hx4, "blob 40%026d%04x", 0, 4);
    snprintf(hx9, sizeof hx9, "40%026d%04x", 0, 9);
    REQUIRE(kvz_store_open(dir, 0, 0, NULL, &s) == 0);
    CHECKF(verify(s) == 5, "problems: %d", g_n);
    CHECK(found(hx1, "refcount 5 but 2"));
    CHECK(found(hx2, "layer 1"));
    CHECK(found(hx3, "orphan"));
    CHECK(found(hx4, "no doc id names it"));
    CHECK(found("doc 'd'", hx9));

    CHECK(kvz_store_gc(s, &g) == 0);
    CHECKF(g.blobs_dropped == 1 && g.refs_fixed == 1 && g.orphan_records == 1 &&
           g.records_dropped == 1 + FX_L + 1, "gc: %llu blobs, %llu fixed, %llu orphans, %llu records",
           (unsigned long long)g.blobs_dropped, (unsigned long long)g.refs_fixed,
           (unsigned long long)g.orphan_records, (unsigned long long)g.records_dropped);
    CHECK(verify(s) == 2);               /* the corrupt record and the dangling name remain */
    CHECK(found(hx2, "layer 1") && found("doc 'd'", hx9));
    CHECK(kvz_store_delete_doc(s, "d") == 0);
    CHECK(kvz_store_delete_doc(s, "c") == 0);
    CHECK(verify(s) == 0);

    /* churn to leave free pages, then compact */
    for (int i = 0; i < 200; i++) {
        char id[32];
        snprintf(id, sizeof id, "churn%03d", i);
        CHECK(put(s, id, 100 + i) == 0);
    }
    for (int i = 0; i < 200; i++) {
        char id[32];
        snprintf(id, sizeof id, "churn%03d", i);
        CHECK(kvz_store_delete_doc(s, id) == 0);
    }
    kvz_store_close(s);

    /* a writer process that opened the store before the compaction */
    int p2c[2], c2p[2];
    REQUIRE(pipe(p2c) == 0 && pipe(c2p) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        kvz_store *cs;
        char b = 0;
        int rc = kvz_store_open(dir, 0, 0, g_fp, &cs);
        if (write(c2p[1], "x", 1) != 1 || read(p2c[0], &b, 1) != 1) _exit(10);
        if (rc) _exit(11);
        rc = put(cs, "late", 7);
        kvz_store_close(cs);
        _exit(rc == KVZ_ERR_BUSY ? 0 : 12);
    }
    char b;
    CHECK(read(c2p[0], &b, 1) == 1);
    REQUIRE(kvz_store_open(dir, 0, 0, g_fp, &s) == 0);
    uint64_t before = 0, after = 0;
    int rc = kvz_store_compact(s, &before, &after);
    CHECKF(rc == 0, "compact: %d %s", rc, kvz_error_detail());
    CHECKF(after < before && after == file_size(dir), "sizes %llu -> %llu (file %llu)",
           (unsigned long long)before, (unsigned long long)after,
           (unsigned long long)file_size(dir));
    CHECK(put(s, "after", 8) == KVZ_ERR_BUSY);   /* this handle is retired */
    kvz_store_close(s);
    CHECK(write(p2c[1], "y", 1) == 1);
    int ws = 0;
    waitpid(pid, &ws, 0);
    CHECKF(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "child writer status %d", ws);

    REQUIRE(kvz_store_open(dir, 0, 0, g_fp, &s) == 0);
    kvz_store_doc_info in;
    CHECK(kvz_store_lookup(s, "a", &in) == 0 && kvz_store_lookup(s, "b", &in) == 0);
    CHECK(kvz_store_lookup(s, "late", &in) == KVZ_ERR_NOTFOUND);
    CHECK(verify(s) == 0);
    CHECK(put(s, "after", 8) == 0);              /* the new files take writes */
    CHECK(verify(s) == 0);
    kvz_store_close(s);

    /* nothing left beside the store: no .compact / .old folders */
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "test $(ls -A %s | wc -l) -eq 1", root);
    CHECK(system(cmd) == 0);
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    CHECK(system(cmd) == 0);
    for (uint32_t l = 0; l < FX_L; l++) free((void *)g_layers[l].data);
    free(g_meta);
    return kvz_test_summary();
}
