/* Many documents into one store with the part policy over the pipeline (kvz_batch.h). */
#include "kvz_batch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_parts.h"
#include "kvz_pipeline.h"

struct kvz_batch {
    kvz_batch_opts o;             /* o.ingest.progress is batch_progress */
    kvz_store *st;
    kvz_pipeline *pl;             /* NULL when it did not start */
    int32_t max_part;
    int64_t tokens_done;          /* both passes, every part submitted so far */
    int64_t base;                 /* tokens_done when the current part was submitted */
    char cur[KVZ_STORE_DOC_ID_MAX + 1];  /* the part submitted last (progress) */
    kvz_batch_stats s;
    double t0;
};

/* One document in flight: alive until its last submitted part is reported. */
typedef struct pdoc {
    char *id, *path;
    int32_t n_parts, submitted, reported, ok;
    int failed, closed;   /* closed: no more parts will be submitted */
} pdoc;

static void pdoc_release(pdoc *d)
{
    if (!d->closed || d->reported < d->submitted) return;
    free(d->id);
    free(d->path);
    free(d);
}

static void report(kvz_batch *b, kvz_batch_what what, const char *id, int rc, const kvz_ingest_result *res,
                   const char *status)
{
    const kvz_batch_event ev = {what, id, rc, res, status};
    if (b->o.report) b->o.report(b->o.user, &ev);
    kvz_error_clear();
}

static void doc_fail(kvz_batch *b, pdoc *d)
{
    if (!d->failed) b->s.failed++;
    d->failed = 1;
}

static int batch_progress(void *ctx, int64_t done, int64_t total)
{
    kvz_batch *b = ctx;
    (void)total;
    if (b->o.progress) b->o.progress(b->o.user, b->cur, b->base + done, b->o.total_tokens, kvz_now() - b->t0);
    return 0;
}

/* The pipeline's outcome of one part, in submission order. */
static void on_done(void *ctx, const char *id, int rc, const char *detail, const kvz_ingest_result *r, void *user)
{
    kvz_batch *b = ctx;
    pdoc *d = user;
    d->reported++;
    if (!r) { /* not attempted: the store had stopped taking documents (reported once) */
        report(b, KVZ_BATCH_NOT_TRIED, id, 0, NULL, NULL);
        doc_fail(b, d);
    } else if (rc) {
        kvz_error_set(rc, "%s", detail);
        report(b, KVZ_BATCH_PART, id, rc, NULL, NULL);
        doc_fail(b, d);
    } else {
        const char *status;
        b->s.parts++;
        d->ok++;
        if (r->status == KVZ_STORE_WRITTEN) {
            status = "ingested";
            b->s.written++;
            b->s.tokens_written += r->n_ctx;
            b->s.pairs_total += r->pairs_total;
            b->s.pairs_kept += r->pairs_kept;
            b->s.bytes_full += r->bytes_full;
            b->s.bytes_kept += r->bytes_kept;
            b->s.bytes_stored += r->bytes_stored;
        } else if (r->status == KVZ_STORE_LINKED) {
            status = "linked";
            b->s.linked++;
        } else {
            status = "unchanged"; /* UNCHANGED, or INFO_UPDATED: same content, entry refreshed */
            b->s.unchanged++;
        }
        report(b, KVZ_BATCH_PART, id, 0, r, status);
        if (d->ok == d->n_parts && !d->failed) {
            /* every part committed: what an older version of this document left behind */
            const int prc = kvz_ingest_parts_prune(b->st, d->id, d->path, d->n_parts, NULL);
            if (prc) {
                report(b, KVZ_BATCH_DOC_FAILED, d->id, prc, NULL, NULL);
                doc_fail(b, d);
            }
        }
    }
    pdoc_release(d);
}

int32_t kvz_batch_max_part(const kvz_model *m, int32_t part_tokens)
{
    const int32_t max_part = kvz_ingest_max_part_tokens(m);
    return part_tokens > 0 && part_tokens < max_part ? part_tokens : max_part;
}

int kvz_batch_store_stops(int rc)
{
    return rc == KVZ_ERR_FULL || rc == KVZ_ERR_MODEL || rc == KVZ_ERR_LMDB || rc == KVZ_ERR_BUSY;
}

int kvz_batch_open(kvz_model *m, const kvz_batch_opts *o, kvz_batch **out)
{
    *out = NULL;
    kvz_batch *b = calloc(1, sizeof *b);
    if (!b) return KVZ_ERR_NOMEM;
    b->o = *o;
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    const uint64_t map0 = o->max_map && o->max_map < KVZ_STORE_DEFAULT_MAP ? o->max_map : 0;
    int rc = kvz_store_open(o->store_path, KVZ_STORE_CREATE, map0, fp, &b->st);
    if (rc) {
        free(b);
        return rc;
    }
    if (o->max_map) kvz_store_set_max_map(b->st, o->max_map);
    b->max_part = kvz_batch_max_part(m, o->part_tokens);
    b->o.ingest.progress = batch_progress;
    b->o.ingest.progress_ctx = b;
    b->t0 = kvz_now();
    if ((rc = kvz_pipeline_create(m, b->st, &b->o.ingest, 0, on_done, b, &b->pl))) {
        b->pl = NULL;
        b->s.failed++;
        report(b, KVZ_BATCH_NOT_STARTED, NULL, rc, NULL, NULL);
    }
    *out = b;
    return 0;
}

int kvz_batch_stopped(const kvz_batch *b)
{
    return !b->pl || kvz_pipeline_failed(b->pl);
}

kvz_store *kvz_batch_store(kvz_batch *b)
{
    return b->st;
}

int kvz_batch_add(kvz_batch *b, const char *id, const char *path, const kvz_tokens *t)
{
    if (kvz_batch_stopped(b)) return 0;
    const int32_t n = (int32_t)t->n;
    const int32_t parts = kvz_ingest_n_parts(n, b->max_part);
    /* nothing is computed when one of its ids belongs to another document */
    int rc = parts < 1 ? kvz_error_set(KVZ_ERR_EMPTY, "document has no tokens")
                       : kvz_ingest_parts_check(b->st, id, path, parts);
    if (rc) {
        b->s.failed++;
        report(b, KVZ_BATCH_DOC_FAILED, id, rc, NULL, NULL);
        return rc;
    }
    pdoc *d = calloc(1, sizeof *d);
    if (!d || !(d->id = strdup(id)) || !(d->path = strdup(path))) {
        if (d) free(d->id);
        free(d);
        b->s.failed++;
        report(b, KVZ_BATCH_DOC_FAILED, id, KVZ_ERR_NOMEM, NULL, NULL);
        return KVZ_ERR_NOMEM;
    }
    d->n_parts = parts;
    for (int32_t p = 0; p < parts && !d->failed && !kvz_pipeline_failed(b->pl); p++) {
        char pid[KVZ_STORE_DOC_ID_MAX + 1];
        int32_t s0, s1;
        kvz_ingest_part_span(n, parts, p, &s0, &s1);
        kvz_ingest_part_id(id, p + 1, parts, pid); /* kvz_ingest_parts_check checked every id */
        snprintf(b->cur, sizeof b->cur, "%s", pid);
        b->base = b->tokens_done;
        d->submitted++;
        kvz_pipeline_submit_part(b->pl, pid, path, t->ids + s0, s1 - s0, parts > 1 ? (uint32_t)(p + 1) : 0, d);
        b->tokens_done += 2 * (int64_t)(s1 - s0);
    }
    d->closed = 1;
    pdoc_release(d); /* freed here when every part was reported already */
    return 0;
}

int kvz_batch_add_corpus(kvz_batch *b, const kvz_corpus *c, const kvz_tokens *toks)
{
    for (size_t i = 0; i < c->n && !kvz_batch_stopped(b); i++) {
        if (!c->v[i].usable) continue;
        const int rc = kvz_batch_add(b, c->v[i].id, c->v[i].path, &toks[i]);
        if (rc && kvz_batch_store_stops(rc)) return rc; /* the store cannot take more: stop */
    }
    return 0;
}

int kvz_batch_drain(kvz_batch *b)
{
    return b->pl ? kvz_pipeline_drain(b->pl) : 0;
}

void kvz_batch_close(kvz_batch *b, kvz_batch_stats *stats)
{
    if (!b) {
        if (stats) *stats = (kvz_batch_stats){0};
        return;
    }
    kvz_pipeline_free(b->pl); /* waits for the last commits (and their prunes) */
    b->s.tokens = b->tokens_done / 2;
    b->s.seconds = kvz_now() - b->t0;
    if (stats) *stats = b->s;
    kvz_store_close(b->st);
    free(b);
}

int kvz_batch_run(kvz_model *m, kvz_corpus *c, const kvz_batch_opts *o, kvz_batch_stats *stats, int *ran)
{
    *ran = 0;
    *stats = (kvz_batch_stats){0};
    kvz_batch_opts bo = *o;
    kvz_tokens *toks = calloc(c->n ? c->n : 1, sizeof *toks);
    if (!toks) return KVZ_ERR_NOMEM;
    int rc = kvz_corpus_tokenize(c, kvz_model_tokenizer(m), kvz_batch_max_part(m, o->part_tokens), toks,
                                 &bo.total_tokens);
    int any = 0;
    for (size_t i = 0; i < c->n; i++) any |= c->v[i].usable;
    if (rc == 0 && any) { /* with nothing left to store, no store is created */
        kvz_batch *b;
        if ((rc = kvz_batch_open(m, &bo, &b)) == 0) {
            kvz_batch_add_corpus(b, c, toks); /* stops when the store cannot take more */
            kvz_batch_close(b, stats);
            *ran = 1;
        }
    }
    for (size_t i = 0; i < c->n; i++) kvz_tokens_free(&toks[i]);
    free(toks);
    return rc > 0 ? 0 : rc; /* collisions (> 0) were reported and counted in c */
}
