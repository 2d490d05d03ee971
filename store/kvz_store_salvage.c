/* kvz_store_salvage.c — copy what is intact out of a damaged store (kvz_store.h).
 * Uses only the public store API: every read it makes is fault-guarded there. */
#include "kvz_store.h"

#include "kvz_blob.h"
#include "kvz_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    kvz_store *src, *dst;
    kvz_store_read *r;
    const uint8_t *fp; /* source model fingerprint, or NULL when unreadable */
    kvz_store_lost_fn cb;
    void *user;
    kvz_store_salvage_result res;
    int stop;
} salv;

/* A fresh snapshot: a damaged page can leave a read transaction unusable. */
static int renew(salv *sv)
{
    kvz_store_read_end(sv->r);
    sv->r = NULL;
    return kvz_store_read_begin(sv->src, &sv->r);
}

static void lost(salv *sv, const char *id, int err, const char *fmt, const char *detail)
{
    char msg[1400];
    snprintf(msg, sizeof msg, fmt, detail);
    if (id) sv->res.n_lost++;
    else sv->res.n_gaps++;
    if (sv->cb && !sv->stop) sv->stop = sv->cb(sv->user, id, err, msg);
}

/* Read, decode and copy one document's records; 0 or the error that lost it
 * (detail set); a failed write to the new store goes to *write_err instead.
 * Records are copied out of the map before writing. */
static int copy_doc(salv *sv, const char *id, const kvz_store_doc_info *info, int *write_err)
{
    *write_err = 0;
    const uint8_t *rec;
    size_t len;
    kvz_blob_meta m;
    memset(&m, 0, sizeof m);
    int err = kvz_store_read_doc(sv->r, id, &(kvz_store_doc_info){0}); /* doc context for reads */
    if (!err) err = kvz_store_read_meta(sv->r, info->hash, &rec, &len);
    if (!err) err = kvz_blob_decode_meta(rec, len, sv->fp, &m);
    if (err) return err;
    kvz_store_rec meta = {NULL, len};
    kvz_store_rec pmeta = {NULL, 0}, *players = NULL; /* shared prefix records */
    kvz_store_rec *layers = calloc(m.n_layer ? m.n_layer : 1, sizeof *layers);
    uint8_t *mcopy = malloc(len);
    if (!layers || !mcopy) { err = kvz_error_set(KVZ_ERR_NOMEM, "salvage: out of memory"); goto out; }
    memcpy(mcopy, rec, len);
    meta.data = mcopy;
    for (uint32_t l = 0; l < m.n_layer && !err; l++) {
        if ((err = kvz_store_read_layer(sv->r, info->hash, l, &rec, &len))) break;
        const uint64_t kept = kvz_blob_layer_kept(&m, l);
        const uint64_t kvb = kept * kvz_blob_kv_row_bytes(&m); /* q8/q4 rows too */
        uint32_t *pos = malloc(kept * 4 + 4);
        uint8_t *kb = malloc(kvb + 1), *vb = malloc(kvb + 1), *copy = malloc(len);
        if (!pos || !kb || !vb || !copy) err = kvz_error_set(KVZ_ERR_NOMEM, "salvage: out of memory");
        else err = kvz_blob_decode_layer(&m, l, rec, len, pos, kb, vb);
        if (!err) {
            memcpy(copy, rec, len);
            layers[l] = (kvz_store_rec){copy, len};
            copy = NULL;
        }
        free(pos); free(kb); free(vb); free(copy);
    }
    /* a blob with a shared system prefix (FORMAT §6.6) needs its prefix records in
     * the new store: copy them (verified) with the document's own transaction */
    if (!err && m.prefix_policy == KVZ_PREFIX_SHARED) {
        players = calloc(m.n_layer ? m.n_layer : 1, sizeof *players);
        if (!players) err = kvz_error_set(KVZ_ERR_NOMEM, "salvage: out of memory");
        for (uint32_t l = 0; !err && l <= m.n_layer; l++) {
            const uint32_t idx = l < m.n_layer ? l : KVZ_BLOB_META_LAYER;
            if ((err = kvz_store_read_prefix(sv->r, m.prefix_ref, idx, &rec, &len))) break;
            uint8_t *copy = malloc(len ? len : 1);
            if (!copy) { err = kvz_error_set(KVZ_ERR_NOMEM, "salvage: out of memory"); break; }
            memcpy(copy, rec, len);
            if (l < m.n_layer) players[l] = (kvz_store_rec){copy, len};
            else pmeta = (kvz_store_rec){copy, len};
        }
    }
    if (!err) {
        kvz_store_doc_info ni = *info;
        int status;
        if (m.prefix_policy == KVZ_PREFIX_SHARED)
            *write_err = kvz_store_put_doc_shared(sv->dst, id, info->hash, &ni, &meta, layers,
                                                  m.n_layer, m.prefix_ref, &pmeta, players,
                                                  &status, NULL);
        else
            *write_err = kvz_store_put_doc(sv->dst, id, info->hash, &ni, &meta, layers, m.n_layer,
                                           &status);
    }
out:
    if (players)
        for (uint32_t l = 0; l < m.n_layer; l++) free((void *)players[l].data);
    free(players);
    free((void *)pmeta.data);
    if (layers)
        for (uint32_t l = 0; l < m.n_layer; l++) free((void *)layers[l].data);
    free(layers);
    free(mcopy);
    kvz_blob_meta_free(&m);
    return err;
}

/* Ids that sort after every id starting with a prefix of @p after: the prefix of
 * length k with its last byte raised by one (shortest last), for skipping a
 * damaged stretch of the index. Writes candidate @p i into @p out; 0 if none. */
static int skip_candidate(const char *after, int i, char *out)
{
    const size_t n = strlen(after);
    int seen = 0;
    for (size_t k = n; k >= 1; k--) {
        unsigned char last = (unsigned char)after[k - 1];
        if (last == 0xff) continue;
        if (seen++ < i) continue;
        memcpy(out, after, k - 1);
        out[k - 1] = (char)(last + 1);
        out[k] = 0;
        return 1;
    }
    return 0;
}

int kvz_store_salvage(kvz_store *src, const char *dst_dir, kvz_store_lost_fn cb, void *user,
                      kvz_store_salvage_result *res)
{
    if (res) memset(res, 0, sizeof *res);
    if (!src || !dst_dir) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: salvage: NULL argument");
    char p[4200];
    struct stat st;
    snprintf(p, sizeof p, "%s/data.mdb", dst_dir);
    if (stat(p, &st) == 0)
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: salvage: %s already holds a store; give a new "
                             "folder", dst_dir);
    salv sv;
    memset(&sv, 0, sizeof sv);
    sv.src = src;
    sv.cb = cb;
    sv.user = user;
    kvz_store_stats ss;
    uint8_t fp[16];
    if (kvz_store_stats_get(src, &ss) == 0 && ss.has_model) {
        memcpy(fp, ss.model_fp, 16);
        sv.fp = fp;
    }
    kvz_error_clear();
    const int dir_was = stat(dst_dir, &st) == 0;
    int err = kvz_store_open(dst_dir, KVZ_STORE_CREATE, 0, sv.fp, &sv.dst);
    if (err) return err;
    if ((err = kvz_store_read_begin(src, &sv.r))) goto done;
    kvz_store_doc_info *info = malloc(sizeof *info);
    char *id = malloc(KVZ_STORE_DOC_ID_MAX + 1), *after = malloc(KVZ_STORE_DOC_ID_MAX + 2);
    char *cand = malloc(KVZ_STORE_DOC_ID_MAX + 2);
    if (!info || !id || !after || !cand) { err = kvz_error_set(KVZ_ERR_NOMEM, "salvage"); goto free; }
    int have_after = 0;
    /* bounded: each step either moves past an id or tries one more skip candidate */
    for (uint64_t steps = 0; !sv.stop && steps < 100000000; steps++) {
        int rc = kvz_store_read_next_doc(sv.r, have_after ? after : NULL, id, info);
        if (rc == KVZ_ERR_NOTFOUND) break;
        if (rc && id[0]) { /* an entry that does not decode: lost, go on after it */
            sv.res.n_docs++;
            lost(&sv, id, rc, "its doc entry does not decode: %s", kvz_error_detail());
            snprintf(after, KVZ_STORE_DOC_ID_MAX + 2, "%s", id);
            have_after = 1;
            continue;
        }
        if (rc) { /* the index itself is damaged here: skip ahead */
            char where[600];
            snprintf(where, sizeof where, "%s", kvz_error_detail());
            lost(&sv, NULL, rc, "the doc index cannot be read here: %s", where);
            if ((err = renew(&sv))) goto free;
            if (!have_after) break; /* its first page: nothing more can be found */
            int moved = 0;
            for (int i = 0; skip_candidate(after, i, cand) && !moved; i++) {
                /* an id equal to the candidate itself, then the ones after it */
                kvz_store_doc_info ci;
                if (kvz_store_read_doc(sv.r, cand, &ci) == 0) {
                    snprintf(id, KVZ_STORE_DOC_ID_MAX + 1, "%s", cand);
                    *info = ci;
                    moved = 2;
                    break;
                }
                rc = kvz_store_read_next_doc(sv.r, cand, id, info);
                if (rc == 0) moved = 2;
                else if (rc == KVZ_ERR_NOTFOUND) moved = 1; /* nothing after: done */
                else if ((err = renew(&sv))) goto free;
            }
            if (moved != 2) break;
        }
        sv.res.n_docs++;
        int werr = 0, e = copy_doc(&sv, id, info, &werr);
        if (werr) { err = werr; goto free; } /* the new store cannot take it: stop */
        if (e) {
            lost(&sv, id, e, "%s", kvz_error_detail());
            if ((err = renew(&sv))) goto free;
        } else {
            sv.res.n_copied++;
        }
        snprintf(after, KVZ_STORE_DOC_ID_MAX + 2, "%s", id);
        have_after = 1;
    }
    if (!err && sv.stop) err = sv.stop;
free:
    free(info);
    free(id);
    free(after);
    free(cand);
done:
    kvz_store_read_end(sv.r);
    kvz_store_close(sv.dst);
    if (sv.res.n_copied == 0 && (err || sv.res.n_lost || sv.res.n_gaps)) {
        /* nothing was saved: leave no empty store behind that could pass for the salvage */
        snprintf(p, sizeof p, "%s/data.mdb", dst_dir);
        unlink(p);
        snprintf(p, sizeof p, "%s/lock.mdb", dst_dir);
        unlink(p);
        if (!dir_was) rmdir(dst_dir);
    }
    if (res) *res = sv.res;
    return err;
}
