/* kvz_store_merge.c — merge kvzip stores through the public store API (kvz_store_merge.h). */
#include "kvz_store_merge.h"

#include "kvz_blob.h"
#include "kvz_error.h"
#include "kvz_store.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    char *id;
    uint32_t src;
    uint8_t hash[16];
    int64_t time;
} entry;

typedef struct {
    entry *v;
    size_t n, cap;
    uint32_t src;
    int nomem;
} entries;

typedef struct {
    kvz_merge_report_fn cb;
    void *user;
    int stop;
} reporter;

static void report(reporter *r, int kind, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void report(reporter *r, int kind, const char *fmt, ...)
{
    if (!r->cb || r->stop) return;
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    r->stop = r->cb(r->user, kind, line);
}

static void hex16(const uint8_t *b, char out[33])
{
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) { out[2 * i] = hx[b[i] >> 4]; out[2 * i + 1] = hx[b[i] & 15]; }
    out[32] = 0;
}

static void fmt_time(int64_t t, char out[32])
{
    time_t tt = (time_t)t;
    struct tm tm;
    if (!gmtime_r(&tt, &tm) || !strftime(out, 32, "%Y-%m-%dT%H:%M:%SZ", &tm)) snprintf(out, 32, "?");
}

static int collect(void *u, const char *id, const kvz_store_doc_info *in)
{
    entries *e = u;
    if (e->n == e->cap) {
        size_t cap = e->cap ? e->cap * 2 : 256;
        entry *v = realloc(e->v, cap * sizeof *v);
        if (!v) { e->nomem = 1; return 1; }
        e->v = v;
        e->cap = cap;
    }
    entry *x = &e->v[e->n];
    if (!(x->id = strdup(id))) { e->nomem = 1; return 1; }
    x->src = e->src;
    memcpy(x->hash, in->hash, 16);
    x->time = in->ingest_time;
    e->n++;
    return 0;
}

static int cmp_entry(const void *a, const void *b)
{
    const entry *x = a, *y = b;
    int c = strcmp(x->id, y->id);
    return c ? c : (x->src > y->src) - (x->src < y->src);
}

/* Read, fully decode and copy one blob of @p src into @p dst under @p id. */
static int copy_doc(kvz_store *src, kvz_store *dst, const char *id, const kvz_store_doc_info *info,
                    const uint8_t fp[16], int *status, uint64_t *bytes)
{
    kvz_store_read *r;
    int err = kvz_store_read_begin(src, &r);
    if (err) return err;
    kvz_blob_meta m = {0};
    kvz_store_rec meta, pmeta, *layers = NULL, *players = NULL;
    uint32_t *pos = NULL;
    uint8_t *kb = NULL, *vb = NULL;
    const uint8_t *rec;
    size_t len;
    if ((err = kvz_store_read_meta(r, info->hash, &rec, &len))) goto out;
    if ((err = kvz_blob_decode_meta(rec, len, fp, &m))) goto out;
    meta = (kvz_store_rec){rec, len};
    *bytes = len;
    if (!(layers = calloc(m.n_layer ? m.n_layer : 1, sizeof *layers))) { err = kvz_error_set(KVZ_ERR_NOMEM, "merge"); goto out; }
    for (uint32_t l = 0; l < m.n_layer; l++) {
        if ((err = kvz_store_read_layer(r, info->hash, l, &rec, &len))) goto out;
        const uint64_t kept = kvz_blob_layer_kept(&m, l);
        const uint64_t kvb = kept * kvz_blob_kv_row_bytes(&m); /* q8/q4 rows too (blob v2) */
        if (kvb > (1ull << 32)) { err = kvz_error_set(KVZ_ERR_FORMAT, "layer %u claims %llu bytes", l, (unsigned long long)kvb); goto out; }
        free(pos); free(kb); free(vb);
        pos = malloc(kept * 4 + 1);
        kb = malloc(kvb + 1);
        vb = malloc(kvb + 1);
        if (!pos || !kb || !vb) { err = kvz_error_set(KVZ_ERR_NOMEM, "merge: layer %u", l); goto out; }
        if ((err = kvz_blob_decode_layer(&m, l, rec, len, pos, kb, vb))) goto out;
        layers[l] = (kvz_store_rec){rec, len};
        *bytes += len;
    }
    /* the source's snapshot stays open (records point into its map) until the write is done */
    if (m.prefix_policy == KVZ_PREFIX_SHARED) {
        /* blob v2 with a shared system prefix (docs/FORMAT.md §3.1): the prefix blob's
         * records go into the same transaction when DST does not hold them yet */
        const int have = kvz_store_has_prefix(dst, m.prefix_ref);
        if (have < 0) { err = have; goto out; }
        if (!have) {
            if (!(players = calloc(m.n_layer ? m.n_layer : 1, sizeof *players))) { err = kvz_error_set(KVZ_ERR_NOMEM, "merge"); goto out; }
            if ((err = kvz_store_read_prefix(r, m.prefix_ref, KVZ_BLOB_META_LAYER, &rec, &len))) goto out;
            pmeta = (kvz_store_rec){rec, len};
            *bytes += len;
            for (uint32_t l = 0; l < m.n_layer; l++) {
                if ((err = kvz_store_read_prefix(r, m.prefix_ref, l, &rec, &len))) goto out;
                players[l] = (kvz_store_rec){rec, len};
                *bytes += len;
            }
        }
        err = kvz_store_put_doc_shared(dst, id, info->hash, info, &meta, layers, m.n_layer, m.prefix_ref,
                                       have ? NULL : &pmeta, have ? NULL : players, status, NULL);
    } else {
        err = kvz_store_put_doc(dst, id, info->hash, info, &meta, layers, m.n_layer, status);
    }
out:
    free(pos); free(kb); free(vb);
    free(layers);
    free(players);
    kvz_blob_meta_free(&m);
    kvz_store_read_end(r);
    return err;
}

/* A DST without data.mdb: create and initialise it beside, then rename it in. */
static int create_dst(const char *dst, const uint8_t *fp)
{
    char p[PATH_MAX + 32], tmp[PATH_MAX + 64];
    struct stat st;
    if (snprintf(p, sizeof p, "%s/data.mdb", dst) >= (int)sizeof p)
        return kvz_error_set(KVZ_ERR_ARG, "merge: destination path too long");
    if (stat(p, &st) == 0) return 0;
    char d[PATH_MAX];
    snprintf(d, sizeof d, "%s", dst);
    size_t dl = strlen(d);
    while (dl > 1 && d[dl - 1] == '/') d[--dl] = 0;
    const char *slash = strrchr(d, '/');
    if (slash)
        snprintf(tmp, sizeof tmp, "%.*s/.%s.merge-new.%ld", (int)(slash - d), d, slash + 1, (long)getpid());
    else
        snprintf(tmp, sizeof tmp, ".%s.merge-new.%ld", d, (long)getpid());
    kvz_store *s;
    int err = kvz_store_open(tmp, KVZ_STORE_CREATE, 0, fp, &s);
    if (err) return err;
    kvz_store_close(s);
    if (rename(tmp, d)) { /* d exists and is not empty (but has no data.mdb): leave it alone */
        const int e = errno;
        char q[PATH_MAX + 80];
        snprintf(q, sizeof q, "%s/data.mdb", tmp); unlink(q);
        snprintf(q, sizeof q, "%s/lock.mdb", tmp); unlink(q);
        rmdir(tmp);
        return kvz_error_set(e == ENOTEMPTY || e == EEXIST ? KVZ_ERR_ARG : KVZ_ERR_IO,
                             "merge: destination %s: %s (give a new or empty folder, or an existing store)",
                             d, e == ENOTEMPTY || e == EEXIST ? "exists, is not empty and holds no store" : strerror(e));
    }
    return 0;
}

int kvz_store_merge(const char *const *src, size_t n_src, const char *dst,
                    const kvz_merge_opts *opts, kvz_merge_report_fn cb, void *user,
                    kvz_merge_result *res)
{
    kvz_merge_result R;
    memset(&R, 0, sizeof R);
    if (res) *res = R;
    if (!src || !n_src || !dst) return kvz_error_set(KVZ_ERR_ARG, "merge: no source stores");
    kvz_merge_opts o = {0, 0};
    if (opts) o = *opts;
    reporter rep = {cb, user, 0};
    kvz_store **ss = calloc(n_src, sizeof *ss);
    char **real = calloc(n_src, sizeof *real);
    entries E = {0};
    kvz_store *d = NULL;
    kvz_store_doc_info *info = malloc(sizeof *info), *dinfo = malloc(sizeof *dinfo);
    int err = 0;
    if (!ss || !real || !info || !dinfo) { err = kvz_error_set(KVZ_ERR_NOMEM, "merge"); goto out; }

    /* 1. sources: distinct, not DST, one model */
    char dreal[PATH_MAX];
    const int dst_exists = realpath(dst, dreal) != NULL;
    for (size_t i = 0; i < n_src; i++) {
        char buf[PATH_MAX];
        if (!realpath(src[i], buf)) {
            err = kvz_error_set(KVZ_ERR_NOTFOUND, "merge: source store %s: no such folder", src[i]);
            goto out;
        }
        if (dst_exists && !strcmp(buf, dreal)) {
            err = kvz_error_set(KVZ_ERR_ARG, "merge: source %s is the destination store itself", src[i]);
            goto out;
        }
        for (size_t j = 0; j < i; j++)
            if (!strcmp(real[j], buf)) {
                err = kvz_error_set(KVZ_ERR_ARG, "merge: store %s is named twice (%s and %s)", buf,
                                    src[j], src[i]);
                goto out;
            }
        if (!(real[i] = strdup(buf))) { err = kvz_error_set(KVZ_ERR_NOMEM, "merge"); goto out; }
    }
    uint8_t fp[16];
    int have_fp = 0;
    size_t fp_src = 0;
    for (size_t i = 0; i < n_src; i++) {
        if ((err = kvz_store_open(src[i], KVZ_STORE_READONLY, 0, NULL, &ss[i]))) {
            char d0[512];
            snprintf(d0, sizeof d0, "%s", kvz_error_detail());
            err = kvz_error_set(err, "merge: source %s: %s", src[i], d0);
            goto out;
        }
        kvz_store_stats st;
        if ((err = kvz_store_stats_get(ss[i], &st))) goto out;
        if (!st.has_model) continue;
        if (!have_fp) { memcpy(fp, st.model_fp, 16); have_fp = 1; fp_src = i; continue; }
        if (memcmp(fp, st.model_fp, 16)) {
            char a[33], b[33];
            hex16(fp, a);
            hex16(st.model_fp, b);
            err = kvz_error_set(KVZ_ERR_MODEL, "merge: %s holds blobs of model %s but %s of model %s: "
                                "stores of different models cannot be merged", src[fp_src], a, src[i], b);
            goto out;
        }
    }

    /* 2. corpus listings recorded by sharded ingests */
    char first_c[256] = "";
    size_t first_i = 0;
    char shard_n[32] = "";
    uint8_t *have_shard = NULL;
    unsigned long shards_n = 0;
    int shards_consistent = 1;
    for (size_t i = 0; i < n_src; i++) {
        char c[256], sh[64];
        size_t len = 0, sl = 0;
        int rc = kvz_store_meta_get(ss[i], KVZ_META_CORPUS, c, sizeof c - 1, &len);
        if (rc == KVZ_ERR_NOTFOUND) { kvz_error_clear(); shards_consistent = 0; continue; }
        if (rc) { err = rc; goto out; }
        c[len < sizeof c ? len : sizeof c - 1] = 0;
        if (!first_c[0]) { snprintf(first_c, sizeof first_c, "%s", c); first_i = i; }
        else if (strcmp(first_c, c)) {
            R.mixed_corpus = 1;
            report(&rep, KVZ_MERGE_CORPUS, "%s was made from corpus listing %s but %s from %s (the "
                   "corpus changed between shards: documents may be missing or stale)",
                   src[first_i], first_c, src[i], c);
        }
        rc = kvz_store_meta_get(ss[i], KVZ_META_SHARD, sh, sizeof sh - 1, &sl);
        if (rc) { kvz_error_clear(); shards_consistent = 0; continue; }
        sh[sl < sizeof sh ? sl : sizeof sh - 1] = 0;
        unsigned long si, sn;
        char tail;
        if (sscanf(sh, "%lu/%lu%c", &si, &sn, &tail) != 2 || sn == 0 || si >= sn || sn > 1000000) {
            shards_consistent = 0;
            continue;
        }
        if (!shards_n) {
            shards_n = sn;
            snprintf(shard_n, sizeof shard_n, "%lu", sn);
            if (!(have_shard = calloc(sn, 1))) { err = kvz_error_set(KVZ_ERR_NOMEM, "merge"); goto out; }
        }
        if (sn != shards_n) shards_consistent = 0;
        else have_shard[si] = 1;
    }
    if (shards_consistent && shards_n && !R.mixed_corpus) {
        char miss[256] = "";
        size_t m = 0, nmiss = 0;
        for (unsigned long k = 0; k < shards_n; k++)
            if (!have_shard[k]) {
                nmiss++;
                if (m < sizeof miss - 16) m += (size_t)snprintf(miss + m, sizeof miss - m, "%s%lu", m ? "," : "", k);
            }
        if (nmiss)
            report(&rep, KVZ_MERGE_CORPUS, "note: shard%s %s of %s %s not among the sources (the "
                   "merged store is missing %s)", nmiss > 1 ? "s" : "", miss, shard_n,
                   nmiss > 1 ? "are" : "is", nmiss > 1 ? "their documents" : "its documents");
    }
    free(have_shard);

    /* 3. plan: every id of every source, conflicts */
    for (size_t i = 0; i < n_src; i++) {
        E.src = (uint32_t)i;
        int rc = kvz_store_list(ss[i], collect, &E);
        if (E.nomem) { err = kvz_error_set(KVZ_ERR_NOMEM, "merge: listing %s", src[i]); goto out; }
        if (rc) { err = rc; goto out; }
    }
    if (E.n) qsort(E.v, E.n, sizeof *E.v, cmp_entry);
    size_t *pick = malloc((E.n ? E.n : 1) * sizeof *pick); /* chosen entry per distinct id */
    size_t n_pick = 0;
    if (!pick) { err = kvz_error_set(KVZ_ERR_NOMEM, "merge"); goto out; }
    for (size_t a = 0; a < E.n;) {
        size_t b = a + 1, best = a;
        int differ = 0;
        while (b < E.n && !strcmp(E.v[b].id, E.v[a].id)) {
            if (memcmp(E.v[b].hash, E.v[a].hash, 16)) differ = 1;
            if (E.v[b].time >= E.v[best].time) best = b;
            b++;
        }
        if (differ) {
            R.conflicts++;
            char line[1800];
            size_t m = 0;
            for (size_t k = a; k < b && m < sizeof line - 200; k++) {
                char hx[33], tm[32];
                hex16(E.v[k].hash, hx);
                fmt_time(E.v[k].time, tm);
                m += (size_t)snprintf(line + m, sizeof line - m, "%s%s: %.12s ingested %s", k > a ? "; " : "",
                                      src[E.v[k].src], hx, tm);
            }
            if (o.prefer_newest)
                report(&rep, KVZ_MERGE_RESOLVED, "'%s' differs between sources (%s): the newest, from %s, wins",
                       E.v[a].id, line, src[E.v[best].src]);
            else
                report(&rep, KVZ_MERGE_CONFLICT, "'%s' differs between sources (%s)", E.v[a].id, line);
        }
        pick[n_pick++] = best;
        a = b;
    }
    R.n_docs = n_pick;
    if ((R.conflicts && !o.prefer_newest) || (R.mixed_corpus && !o.allow_mixed_corpus) || rep.stop) {
        R.refused = 1;
        free(pick);
        goto out;
    }

    /* 4. DST, then one transaction per document. A new DST is initialised under a
     * hidden name and renamed into place, so a kill before its first commit
     * leaves no folder that is not yet a store. */
    if ((err = create_dst(dst, have_fp ? fp : NULL))) { free(pick); goto out; }
    if ((err = kvz_store_open(dst, KVZ_STORE_CREATE, 0, have_fp ? fp : NULL, &d))) {
        char d0[512];
        snprintf(d0, sizeof d0, "%s", kvz_error_detail());
        err = kvz_error_set(err, "merge: destination %s: %s", dst, d0);
        free(pick);
        goto out;
    }
    for (size_t p = 0; p < n_pick && !rep.stop; p++) {
        const entry *e = &E.v[pick[p]];
        kvz_store *s = ss[e->src];
        if ((err = kvz_store_lookup(s, e->id, info))) break;
        int had = kvz_store_lookup(d, e->id, dinfo) == 0;
        kvz_error_clear();
        const int replaced = had && memcmp(dinfo->hash, info->hash, 16);
        int status = 0;
        uint64_t bytes = 0;
        int rc = kvz_store_has_hash(d, info->hash);
        if (rc < 0) { err = rc; break; }
        if (rc == 1) {
            err = kvz_store_put_doc(d, e->id, info->hash, info, NULL, NULL, 0, &status);
        } else {
            err = copy_doc(s, d, e->id, info, fp, &status, &bytes);
            if (err && err != KVZ_ERR_FULL && err != KVZ_ERR_LMDB && err != KVZ_ERR_BUSY &&
                err != KVZ_ERR_NOMEM && err != KVZ_ERR_IO) {
                R.bad++;
                report(&rep, KVZ_MERGE_BAD_BLOB, "'%s' in %s: blob does not verify, not merged: %s (%s)",
                       e->id, src[e->src], kvz_error_detail(), kvz_strerror(err));
                kvz_error_clear();
                err = 0;
                continue;
            }
        }
        if (err) break;
        const char *what;
        if (status == KVZ_STORE_UNCHANGED) { R.unchanged++; what = "unchanged"; }
        else if (replaced) { R.replaced++; what = "replaced"; }
        else if (status == KVZ_STORE_WRITTEN) { R.copied++; what = "copied"; }
        else { R.linked++; what = "linked"; }
        if (status == KVZ_STORE_WRITTEN) R.bytes_copied += bytes;
        report(&rep, KVZ_MERGE_DOC, "%-9s %s (from %s)", what, e->id, src[e->src]);
    }
    free(pick);
out:
    kvz_store_close(d);
    for (size_t i = 0; ss && i < n_src; i++) kvz_store_close(ss[i]);
    for (size_t i = 0; real && i < n_src; i++) free(real[i]);
    for (size_t i = 0; i < E.n; i++) free(E.v[i].id);
    free(E.v);
    free(ss);
    free(real);
    free(info);
    free(dinfo);
    if (res) *res = R;
    return err;
}
