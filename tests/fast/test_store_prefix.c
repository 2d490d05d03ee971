/* Shared system prefix in the store (docs/FORMAT.md §3.1, §6.6): written once in
 * the document's transaction, reused by later documents, read back byte-exact,
 * checked by verify (and a missing prefix reported), kept by gc while a blob
 * references it and dropped after; mismatched or missing prefixes refused with
 * the store unchanged. Real LMDB in a temporary directory. */
#include "kvz_blob.h"
#include "kvz_error.h"
#include "kvz_kvrow.h"
#include "kvz_store.h"
#include "kvz_test.h"

#include <lmdb.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#define NEED(cond) do { if (!(cond)) { CHECK(cond); goto done; } } while (0)

enum { L = 3, H = 2, HD = 32, NP = 5 };
static const uint8_t FP[16] = {7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

typedef struct {
    kvz_blob_meta m;
    uint32_t counts[L * H];
    kvz_store_rec meta, layers[L];
    uint8_t hash[16];
} tb;

static uint64_t mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* n_ctx == 0: the prefix blob (KEEP, counts NP); else a SHARED document blob. */
static int make(tb *b, uint64_t seed, uint8_t dtype, uint32_t n_ctx, const uint8_t *prefix_ref)
{
    memset(b, 0, sizeof *b);
    kvz_blob_meta *m = &b->m;
    memcpy(m->fingerprint, FP, 16);
    m->n_layer = L; m->n_head = 2 * H; m->n_kv_head = H; m->head_dim = HD; m->dtype = dtype;
    m->n_prefix = NP; m->n_context = n_ctx; m->counts = b->counts;
    if (n_ctx == 0) {
        m->prefix_policy = KVZ_PREFIX_KEEP; m->ratio = 1.0f; m->chunk = 1;
    } else {
        m->prefix_policy = KVZ_PREFIX_SHARED; m->ratio = 0.5f; m->chunk = 2000; m->overlap = 8;
        memcpy(m->prefix_ref, prefix_ref, 16);
    }
    uint64_t s = seed;
    for (int i = 0; i < L * H; i++) b->counts[i] = n_ctx ? (uint32_t)(mix(&s) % (n_ctx + 1)) : NP;
    int err = kvz_blob_encode_meta(m, 0, (uint8_t **)&b->meta.data, &b->meta.len);
    const size_t rb = kvz_blob_kv_row_bytes(m);
    for (uint32_t l = 0; l < L && !err; l++) {
        uint64_t n = kvz_blob_layer_kept(m, l), off[H + 1];
        kvz_blob_layer_offsets(m, l, off);
        uint32_t *pos = malloc(n * 4 + 4);
        float *x = malloc(n * HD * 4 + 4);
        uint8_t *k = malloc(n * rb + 1), *v = malloc(n * rb + 1);
        for (uint32_t h = 0; h < H; h++)
            for (uint64_t i = 0; i < off[h + 1] - off[h]; i++)
                pos[off[h] + i] = (uint32_t)(n_ctx ? NP + i : i); /* context rows start at NP */
        for (uint64_t i = 0; i < n * HD; i++) x[i] = (float)(mix(&s) >> 40) * 0x1p-22f - 2.0f;
        err = kvz_kvrow_encode(dtype, x, n, HD, k);
        if (!err) err = kvz_kvrow_encode(dtype, x, n, HD, v);
        if (!err) err = kvz_blob_encode_layer(m, l, pos, k, v, 0, (uint8_t **)&b->layers[l].data, &b->layers[l].len);
        free(pos); free(x); free(k); free(v);
    }
    uint8_t pb[KVZ_BLOB_PARAMS_SIZE];
    kvz_blob_params_bytes(m, pb);
    int32_t tok[NP + 8];
    for (int i = 0; i < NP + 8; i++) tok[i] = (int32_t)(i < NP ? 100 + i : (int)seed * 10 + i);
    kvz_blob_content_hash(FP, pb, sizeof pb, NP + (n_ctx ? 8 : 0), tok, b->hash);
    return err;
}

static void tfree(tb *b)
{
    free((void *)b->meta.data);
    for (int l = 0; l < L; l++) free((void *)b->layers[l].data);
    memset(b, 0, sizeof *b);
}

static kvz_store_doc_info info(void)
{
    kvz_store_doc_info i;
    memset(&i, 0, sizeof i);
    snprintf(i.source_path, sizeof i.source_path, "src.txt");
    i.n_tokens = NP + 8;
    i.ratio = 0.5f;
    return i;
}

static int put(kvz_store *s, const char *id, const tb *d, const tb *p, int with_prefix, int *status,
               int *written)
{
    kvz_store_doc_info in = info();
    return kvz_store_put_doc_shared(s, id, d->hash, &in, &d->meta, d->layers, L, p->hash,
                                    with_prefix ? &p->meta : NULL, with_prefix ? p->layers : NULL,
                                    status, written);
}

static int problems_seen;
static char last_problem[1024];
static int on_problem(void *u, int err, const char *msg)
{
    (void)u; (void)err;
    problems_seen++;
    snprintf(last_problem, sizeof last_problem, "%s", msg);
    return 0;
}

int main(void)
{
    char dir[] = "/tmp/kvz_prefix_XXXXXX";
    NEED(mkdtemp(dir));
    tb p, p16, d1, d2, d3, dbad;
    NEED(make(&p, 1, KVZ_DTYPE_Q8, 0, NULL) == 0);
    NEED(make(&p16, 2, KVZ_DTYPE_F16, 0, NULL) == 0);
    NEED(make(&d1, 11, KVZ_DTYPE_Q8, 8, p.hash) == 0);
    NEED(make(&d2, 12, KVZ_DTYPE_Q8, 8, p.hash) == 0);
    NEED(make(&d3, 13, KVZ_DTYPE_Q8, 8, p.hash) == 0);
    NEED(make(&dbad, 14, KVZ_DTYPE_F16, 8, p.hash) == 0); /* f16 doc naming a q8 prefix */
    uint64_t pbytes = p.meta.len;
    for (int l = 0; l < L; l++) pbytes += p.layers[l].len;

    kvz_store *s;
    NEED(kvz_store_open(dir, KVZ_STORE_CREATE, 0, FP, &s) == 0);
    CHECK(kvz_store_has_prefix(s, p.hash) == 0);
    int st = 0, w = -1;
    /* a missing prefix and no records for it: refused, nothing written */
    CHECK(put(s, "d1", &d1, &p, 0, &st, &w) == KVZ_ERR_NOTFOUND);
    kvz_store_doc_info got;
    CHECK(kvz_store_lookup(s, "d1", &got) == KVZ_ERR_NOTFOUND);
    /* a prefix of another dtype than the document: refused before the write */
    CHECK(put(s, "bad", &dbad, &p, 1, &st, &w) == KVZ_ERR_ARG);
    kvz_store_doc_info in = info(); /* the f16 prefix, but the META names the q8 one */
    CHECK(kvz_store_put_doc_shared(s, "bad", dbad.hash, &in, &dbad.meta, dbad.layers, L, p16.hash,
                                   &p16.meta, p16.layers, &st, &w) == KVZ_ERR_ARG);
    CHECK(kvz_store_has_prefix(s, p.hash) == 0 && kvz_store_has_prefix(s, p16.hash) == 0);

    /* first document writes the prefix, the next ones only reference it */
    CHECK(put(s, "d1", &d1, &p, 1, &st, &w) == 0 && st == KVZ_STORE_WRITTEN && w == 1);
    CHECK(kvz_store_has_prefix(s, p.hash) == 1);
    CHECK(put(s, "d2", &d2, &p, 1, &st, &w) == 0 && st == KVZ_STORE_WRITTEN && w == 0);
    CHECK(put(s, "d3", &d3, &p, 0, &st, &w) == 0 && st == KVZ_STORE_WRITTEN && w == 0);
    uint64_t np = 0, nb = 0;
    CHECK(kvz_store_prefix_stats(s, &np, &nb) == 0 && np == 1 && nb == pbytes);
    /* read back byte-exact, and decodes */
    kvz_store_read *r;
    NEED(kvz_store_read_begin(s, &r) == 0);
    const uint8_t *rec;
    size_t len;
    CHECK(kvz_store_read_prefix(r, p.hash, KVZ_BLOB_META_LAYER, &rec, &len) == 0 && len == p.meta.len &&
          !memcmp(rec, p.meta.data, len));
    for (uint32_t l = 0; l < L; l++)
        CHECK(kvz_store_read_prefix(r, p.hash, l, &rec, &len) == 0 && len == p.layers[l].len &&
              !memcmp(rec, p.layers[l].data, len));
    CHECK(kvz_store_read_prefix(r, p.hash, L, &rec, &len) == KVZ_ERR_NOTFOUND);
    CHECK(kvz_store_read_prefix(r, p16.hash, KVZ_BLOB_META_LAYER, &rec, &len) == KVZ_ERR_NOTFOUND);
    kvz_store_read_end(r);
    /* the same content under a new name: linked, prefix untouched */
    CHECK(put(s, "d1-again", &d1, &p, 1, &st, &w) == 0 && st == KVZ_STORE_LINKED && w == 0);

    kvz_store_verify_result vr;
    problems_seen = 0;
    CHECK(kvz_store_verify(s, on_problem, NULL, &vr) == 0 && vr.n_problems == 0 && vr.n_prefixes == 1);
    CHECKF(vr.n_records == 3 * (1 + L) + (1 + L), "verify decoded %llu records", (unsigned long long)vr.n_records);

    /* gc keeps the prefix while any blob references it */
    kvz_store_gc_result g;
    CHECK(kvz_store_delete_doc(s, "d1") == 0 && kvz_store_delete_doc(s, "d1-again") == 0 &&
          kvz_store_delete_doc(s, "d2") == 0);
    CHECK(kvz_store_gc(s, &g) == 0 && g.prefixes_dropped == 0);
    CHECK(kvz_store_has_prefix(s, p.hash) == 1);
    /* and drops it after the last one */
    CHECK(kvz_store_delete_doc(s, "d3") == 0);
    CHECK(kvz_store_gc(s, &g) == 0 && g.prefixes_dropped == 1 && g.records_dropped == 1 + L &&
          g.bytes_dropped == pbytes);
    CHECK(kvz_store_has_prefix(s, p.hash) == 0);
    CHECK(kvz_store_prefix_stats(s, &np, &nb) == 0 && np == 0 && nb == 0);
    CHECK(kvz_store_gc(s, &g) == 0 && g.prefixes_dropped == 0);
    CHECK(kvz_store_verify(s, on_problem, NULL, &vr) == 0 && vr.n_problems == 0);

    /* verify reports a blob whose prefix is gone (its META deleted behind the store's back) */
    CHECK(put(s, "d1", &d1, &p, 1, &st, &w) == 0 && w == 1);
    kvz_store_close(s);
    {
        MDB_env *env;
        MDB_txn *txn;
        MDB_dbi dbi;
        NEED(mdb_env_create(&env) == 0 && mdb_env_set_maxdbs(env, 8) == 0 &&
             mdb_env_set_mapsize(env, 1ull << 30) == 0 && mdb_env_open(env, dir, 0, 0600) == 0);
        NEED(mdb_txn_begin(env, NULL, 0, &txn) == 0 && mdb_dbi_open(txn, "prefixes", 0, &dbi) == 0);
        uint8_t key[20];
        memcpy(key, p.hash, 16);
        memset(key + 16, 0xFF, 4);
        MDB_val k = {20, key};
        CHECK(mdb_del(txn, dbi, &k, NULL) == 0);
        CHECK(mdb_txn_commit(txn) == 0);
        mdb_env_close(env);
    }
    NEED(kvz_store_open(dir, 0, 0, FP, &s) == 0);
    problems_seen = 0;
    CHECK(kvz_store_verify(s, on_problem, NULL, &vr) == 0 && vr.n_problems >= 1);
    CHECKF(strstr(last_problem, "shared prefix") != NULL, "verify said: %s", last_problem);
    kvz_store_close(s);
done:
    tfree(&p); tfree(&p16); tfree(&d1); tfree(&d2); tfree(&d3); tfree(&dbad);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) fprintf(stderr, "cannot remove %s\n", dir);
    return kvz_test_summary();
}
