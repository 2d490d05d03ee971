/* Scale-out drivers of an ingest run (kvz_workers.h): shard store marking, the
 * worker-process parent, and the worker's claim loop. */
#include "kvz_workers.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_store.h"
#include "kvz_store_merge.h"

int kvz_workers_mark_store(const char *path, const kvz_shard *sh, uint64_t corpus_hash, size_t n_ids,
                           char old[128])
{
    kvz_store *st;
    old[0] = 0;
    int rc = kvz_store_open(path, KVZ_STORE_CREATE, 0, NULL, &st);
    if (rc) return rc;
    char now[64];
    size_t len = 0;
    snprintf(now, sizeof now, "%016llx %zu", (unsigned long long)corpus_hash, n_ids);
    if (kvz_store_meta_get(st, KVZ_META_CORPUS, old, 127, &len) == 0) {
        old[len < 128 ? len : 127] = 0;
        if (!strcmp(old, now)) old[0] = 0;
    } else {
        old[0] = 0;
    }
    kvz_error_clear();
    rc = kvz_shard_record(st, sh, corpus_hash, n_ids);
    kvz_store_close(st);
    return rc;
}

int kvz_workers_take(kvz_batch *b, kvz_model *m, kvz_claims *claims, kvz_corpus *rep, size_t *n_taken)
{
    *n_taken = 0;
    const size_t n = kvz_claims_count(claims);
    /* a document is claimed when this worker submits it: on CUDA the next one is
     * scored while the last ones are encoded and committed */
    for (size_t j = 0; j < n && !kvz_batch_stopped(b); j++) {
        if (!kvz_claims_take(claims, j)) continue; /* another worker has it */
        (*n_taken)++;
        const char *path, *id;
        int named;
        kvz_claims_doc(claims, j, &path, &id, &named);
        char *text;
        size_t len;
        kvz_tokens t = {0};
        /* the parent read it: a failure here is a change since */
        if (kvz_corpus_read_file(rep, path, named, &text, &len)) continue;
        int rc = kvz_tokenizer_encode(kvz_model_tokenizer(m), text, len, 0, &t);
        free(text);
        if (rc) {
            kvz_corpus_event ev = {.what = KVZ_CORPUS_UNTOKENIZED, .rc = rc, .path = path};
            if (rep->report) rep->report(rep->user, &ev);
            kvz_error_clear();
            rep->failed++;
            continue;
        }
        rc = kvz_batch_add(b, id, path, &t); /* the pipeline copies the tokens */
        kvz_tokens_free(&t);
        /* on the CPU a submit only queues a short document (computed a few dozen at a
         * time); near the end of the list compute each at once, so that this worker does
         * not claim the last documents ahead of the others */
        if (!rc && kvz_model_device(m) == KVZ_DEVICE_CPU && n - j <= 64) kvz_batch_drain(b);
        if (rc && kvz_batch_store_stops(rc)) return rc;
    }
    return 0;
}

/* ---- parent ---- */

typedef struct par_state {
    const kvz_workers_opts *o;
    kvz_workers_result *r;
    char **summary;  /* last stdout line (JSON) per worker */
} par_state;

static void on_worker_line(void *u, int w, int is_out, const char *line)
{
    par_state *p = u;
    if (is_out) {
        free(p->summary[w]);
        p->summary[w] = strdup(line); /* NULL when out of memory: counted as no summary */
        return;
    }
    if (p->o->on_line)
        p->o->on_line(p->o->user, w, p->r->per[w].device, line, kvz_dispatch_claimed(), p->r->n_docs);
}

/* The integer after "key": in a flat JSON object line, 0 when absent. */
static long long json_num(const char *js, const char *key)
{
    char k[64];
    snprintf(k, sizeof k, "\"%s\": ", key);
    const char *p = js ? strstr(js, k) : NULL;
    return p ? strtoll(p + strlen(k), NULL, 10) : 0;
}

int kvz_workers_run(const kvz_corpus *c, const kvz_workers_opts *o, kvz_workers_result *r)
{
    *r = (kvz_workers_result){0};
    const int nw = o->n_workers;
    if (nw < 1 || nw > KVZ_DISPATCH_MAX_WORKERS)
        return kvz_error_set(KVZ_ERR_ARG, "worker count %d outside 1..%d", nw, KVZ_DISPATCH_MAX_WORKERS);
    r->per = calloc((size_t)nw, sizeof *r->per);
    kvz_dispatch_doc *dd = calloc(c->n ? c->n : 1, sizeof *dd);
    const char **devs = calloc((size_t)nw, sizeof *devs);
    kvz_dispatch_worker *wk = calloc((size_t)nw, sizeof *wk);
    par_state ps = {o, r, calloc((size_t)nw, sizeof(char *))};
    int rc = 0;
    if (!r->per || !dd || !devs || !wk || !ps.summary) {
        rc = KVZ_ERR_NOMEM;
        goto out;
    }
    for (size_t i = 0; i < c->n; i++) {
        const kvz_corpus_doc *d = &c->v[i];
        if (d->usable) dd[r->n_docs++] = (kvz_dispatch_doc){d->path, d->id, d->named, (uint64_t)d->len};
    }
    for (int w = 0; w < nw; w++) {
        if (o->gpus) snprintf(r->per[w].device, sizeof r->per[w].device, "cuda:%d", w);
        else snprintf(r->per[w].device, sizeof r->per[w].device, "%s", o->device);
        devs[w] = r->per[w].device;
    }
    const kvz_dispatch_opts dopt = {nw, o->exe, o->argv, devs, o->threads, on_worker_line, &ps};
    const double t0 = kvz_now();
    rc = r->n_docs ? kvz_dispatch_run(dd, r->n_docs, &dopt, wk) : 0;
    r->seconds = kvz_now() - t0;
    for (int w = 0; w < nw; w++) {
        r->per[w].w = wk[w];
        r->per[w].summarized = ps.summary[w] != NULL;
    }
    for (int w = 0; r->n_docs && !rc && w < nw; w++) {
        const char *js = ps.summary[w];
        r->ingested += json_num(js, "ingested");
        r->unchanged += json_num(js, "unchanged");
        r->linked += json_num(js, "linked");
        r->failed += json_num(js, "failed");
        r->skipped += json_num(js, "skipped");
        r->tokens += json_num(js, "tokens");
        r->parts += json_num(js, "parts");
        r->bytes_stored += (uint64_t)json_num(js, "bytes_stored");
        if (wk[w].exit_code != 0) r->bad_workers++;
    }
out:
    if (ps.summary)
        for (int w = 0; w < nw; w++) free(ps.summary[w]);
    free(ps.summary);
    free(wk);
    free(devs);
    free(dd);
    return rc;
}

void kvz_workers_result_free(kvz_workers_result *r)
{
    free(r->per);
    r->per = NULL;
}

const char **kvz_workers_argv(int argc, char *const *argv, const char *const *forward, const char *store)
{
    const char **av = calloc((size_t)argc + 5, sizeof *av);
    if (!av) return NULL;
    int k = 0;
    av[k++] = argv[0];
    for (int i = 1; i < argc && strcmp(argv[i], "--"); i++) {
        int take = 0;
        for (int j = 0; forward[j]; j++) take |= !strcmp(argv[i], forward[j]);
        if (take && i + 1 < argc) {
            av[k++] = argv[i];
            av[k++] = argv[++i];
        }
    }
    av[k++] = "--store";
    av[k++] = store;
    av[k++] = "--json";
    return av;
}
