/* Overlapped corpus ingest (kvz_pipeline.h). Threads: the caller (model work on the GPU),
 * `threads` encoders (one task = one record), one writer (one store transaction per
 * document, in submission order). */
#include "kvz_pipeline.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_kvdtype.h"
#include "kvz_backend.h" /* the device's KVzip selection, export and pinned memory */

static size_t al256(size_t x) { return (x + 255) & ~(size_t)255; }

typedef struct pbuf { /* host buffer of one document's kept rows, reused across documents */
    void *p;
    size_t bytes;
    int busy;
} pbuf;

typedef struct job {
    char *doc_id;
    void *user;
    int rc;
    char detail[512];
    kvz_ingest_result res;
    kvz_store_doc_info info;
    int link;              /* records already stored: name only */
    int skipped;           /* not attempted: the pipeline had stopped */
    kvz_blob_meta bm;
    uint32_t *counts;      /* (n_layer * n_kv) incl. prefix */
    pbuf *buf;             /* kept rows: per layer K, V, pos at off[l] */
    size_t *off;           /* (n_layer) */
    uint8_t **recs;        /* 2 (n_layer + 1): layers, META, then the prefix blob's layers, META */
    size_t *lens;
    int pending;           /* encode tasks not finished */
    int next_task;         /* next record to hand out (index into recs) */
    int n_task;            /* n_layer + 1, or 2 (n_layer + 1) with the prefix blob */
    int skip;              /* prefix rows per head in the exported rows but not in the document
                              blob (shared system prefix: they go to the prefix blob) */
    uint8_t phash[16];     /* shared prefix: its blob's content hash */
    kvz_blob_meta pm;      /* its META (counts: pcounts) */
    uint32_t *pcounts;
    int done;              /* committed or failed: completion ready */
    double t0;
    struct job *next;      /* FIFO of all jobs in submission order */
} job;

typedef struct cpu_item { /* a CPU submit waiting for its batch (kvz_ingest_docs) */
    char *doc_id, *path;
    int32_t *ctx;
    int32_t n_ctx;
    uint32_t part;
    void *user;
} cpu_item;

struct kvz_pipeline {
    kvz_model *m;
    kvz_store *st;
    kvz_ingest_opts o;
    kvz_pipeline_done_fn done_fn;
    void *done_ctx;
    int gpu;
    const kvz_backend *be; /* the model's */
    int n_layer, n_kv, hd;
    pthread_mutex_t mu;
    pthread_cond_t cv;       /* any state change */
    job *head, *tail;        /* all jobs not yet delivered, in order */
    int stop;
    int fatal;
    char fatal_detail[512];
    pbuf bufs[KVZ_PIPELINE_DEPTH];
    void *pin;               /* pinned staging of one layer (the GPU export lands here) */
    size_t pin_bytes;
    pthread_t *workers;
    int n_workers;
    pthread_t writer;
    int writer_started;
    cpu_item *cq;            /* CPU: submitted documents not yet computed, in order */
    int cq_n, cq_cap;
    int64_t cq_tokens;       /* their estimated pass tokens (2 n_ctx + 20 each) */
};

static int fatal_rc(int rc)
{
    return rc == KVZ_ERR_FULL || rc == KVZ_ERR_MODEL || rc == KVZ_ERR_LMDB || rc == KVZ_ERR_BUSY;
}

static void job_free(kvz_pipeline *p, job *j)
{
    if (j->recs)
        for (int l = 0; l < 2 * (p->n_layer + 1); l++) free(j->recs[l]);
    free(j->pcounts);
    free(j->recs);
    free(j->lens);
    free(j->off);
    free(j->counts);
    free(j->doc_id);
    free(j);
}

/* encoders: take the first job with records left to encode */
static void *encode_worker(void *arg)
{
    kvz_pipeline *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        job *j = p->head;
        while (j && !(j->buf && j->next_task < j->n_task)) j = j->next;
        if (!j) {
            if (p->stop) break;
            pthread_cond_wait(&p->cv, &p->mu);
            continue;
        }
        const int t = j->next_task++;
        pthread_mutex_unlock(&p->mu);
        int rc = 0;
        size_t len = 0;
        uint8_t *rec = NULL;
        if (!j->rc) {
            const int L = p->n_layer, pre = t > L; /* the prefix blob's records come second */
            const int tl = pre ? t - L - 1 : t;
            const kvz_blob_meta *bm = pre ? &j->pm : &j->bm;
            if (tl == L) {
                rc = kvz_blob_encode_meta(bm, p->o.zstd_level, &rec, &len);
            } else { /* per head: the document's rows past the prefix, or the prefix rows */
                const uint32_t *cnt = j->bm.counts + (size_t)tl * p->n_kv;
                uint64_t rows = 0;
                for (int h = 0; h < p->n_kv; h++) rows += (uint64_t)j->skip + cnt[h];
                const size_t rb = kvz_kv_row_bytes(j->bm.dtype, j->bm.head_dim), kb = al256((size_t)rows * rb);
                const uint8_t *b = (const uint8_t *)j->buf->p + j->off[tl];
                const uint32_t *hp[64];
                const void *hk[64], *hv[64];
                size_t o = 0;
                for (int h = 0; h < p->n_kv; h++) {
                    const size_t first = pre ? o : o + (size_t)j->skip;
                    hp[h] = (const uint32_t *)(b + 2 * kb) + first;
                    hk[h] = b + first * rb;
                    hv[h] = b + kb + first * rb;
                    o += (size_t)j->skip + cnt[h];
                }
                rc = kvz_blob_encode_layer_heads(bm, (uint32_t)tl, hp, hk, hv, p->o.zstd_level, &rec, &len);
            }
        }
        char det[512] = "";
        if (rc) snprintf(det, sizeof det, "%s record %d: %.400s", t > p->n_layer ? "prefix blob" : "document",
                         t % (p->n_layer + 1) == p->n_layer ? -1 : t % (p->n_layer + 1), kvz_error_detail());
        pthread_mutex_lock(&p->mu);
        j->recs[t] = rec;
        j->lens[t] = len;
        if (rc && !j->rc) {
            j->rc = rc;
            snprintf(j->detail, sizeof j->detail, "%s", det);
        }
        if (--j->pending == 0) { /* the rows are encoded: the buffer can take the next document */
            j->buf->busy = 0;
            j->buf = NULL;
            pthread_cond_broadcast(&p->cv);
        }
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* writer: commit the oldest job once its records are ready */
static void *writer_thread(void *arg)
{
    kvz_pipeline *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        job *j = p->head;
        while (j && j->done) j = j->next;
        if (!j || j->pending) {
            if (p->stop && !j) break;
            pthread_cond_wait(&p->cv, &p->mu);
            continue;
        }
        const int fatal = p->fatal;
        pthread_mutex_unlock(&p->mu);
        int rc = j->rc;
        char det[512] = "";
        if (!rc && fatal) {
            rc = fatal;
            j->skipped = 1;
            snprintf(det, sizeof det, "not stored: %.400s", p->fatal_detail);
        } else if (!rc) {
            kvz_store_rec mrec = {NULL, 0};
            kvz_store_rec *srec = NULL;
            if (!j->link) {
                srec = calloc((size_t)p->n_layer, sizeof *srec);
                if (!srec) rc = kvz_error_set(KVZ_ERR_NOMEM, "store records");
                for (int l = 0; srec && l < p->n_layer; l++) srec[l] = (kvz_store_rec){j->recs[l], j->lens[l]};
                mrec = (kvz_store_rec){j->recs[p->n_layer], j->lens[p->n_layer]};
            }
            kvz_store_rec *psrec = NULL, pmrec = {NULL, 0};
            const int with_prefix = !j->link && j->n_task > p->n_layer + 1;
            if (!rc && with_prefix) {
                if (!(psrec = calloc((size_t)p->n_layer, sizeof *psrec))) rc = kvz_error_set(KVZ_ERR_NOMEM, "store records");
                for (int l = 0; psrec && l < p->n_layer; l++)
                    psrec[l] = (kvz_store_rec){j->recs[p->n_layer + 1 + l], j->lens[p->n_layer + 1 + l]};
                pmrec = (kvz_store_rec){j->recs[2 * p->n_layer + 1], j->lens[2 * p->n_layer + 1]};
            }
            if (!rc && !j->link && j->skip) /* shared system prefix: one transaction for both blobs */
                rc = kvz_store_put_doc_shared(p->st, j->doc_id, j->res.hash, &j->info, &mrec, srec, (uint32_t)p->n_layer,
                                              j->phash, with_prefix ? &pmrec : NULL, with_prefix ? psrec : NULL,
                                              &j->res.status, NULL);
            else if (!rc)
                rc = kvz_store_put_doc(p->st, j->doc_id, j->res.hash, &j->info, j->link ? NULL : &mrec, srec,
                                       j->link ? 0 : (uint32_t)p->n_layer, &j->res.status);
            free(psrec);
            if (rc) snprintf(det, sizeof det, "%s", kvz_error_detail());
            free(srec);
            kvz_store_doc_info now;
            if (!rc && kvz_store_lookup(p->st, j->doc_id, &now) == 0) {
                j->res.bytes_stored = now.bytes_stored;
                if (j->link) j->res.bytes_kept = now.bytes_kv_kept;
            }
            kvz_error_clear();
        }
        pthread_mutex_lock(&p->mu);
        if (rc && !j->rc) {
            j->rc = rc;
            snprintf(j->detail, sizeof j->detail, "%s", det);
        }
        if (rc && fatal_rc(rc) && !p->fatal) {
            p->fatal = rc;
            snprintf(p->fatal_detail, sizeof p->fatal_detail, "%s", det);
        }
        for (int l = 0; j->recs && l < 2 * (p->n_layer + 1); l++) { /* the bytes are in the store now */
            free(j->recs[l]);
            j->recs[l] = NULL;
        }
        j->res.seconds = kvz_now() - j->t0;
        j->done = 1;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* deliver finished jobs at the head (p->mu held; released around the callbacks) */
static void deliver(kvz_pipeline *p)
{
    while (p->head && p->head->done) {
        job *j = p->head;
        p->head = j->next;
        if (!p->head) p->tail = NULL;
        pthread_mutex_unlock(&p->mu);
        if (p->done_fn)
            p->done_fn(p->done_ctx, j->doc_id, j->rc, j->rc ? j->detail : "", j->skipped ? NULL : &j->res, j->user);
        job_free(p, j);
        pthread_mutex_lock(&p->mu);
    }
}

int kvz_pipeline_create(kvz_model *m, kvz_store *st, const kvz_ingest_opts *o, int threads,
                        kvz_pipeline_done_fn done, void *ctx, kvz_pipeline **out)
{
    *out = NULL;
    kvz_pipeline *p = calloc(1, sizeof *p);
    if (!p) return kvz_error_set(KVZ_ERR_NOMEM, "pipeline");
    const kvz_config *c = kvz_model_config(m);
    p->m = m;
    p->st = st;
    p->o = *o;
    p->done_fn = done;
    p->done_ctx = ctx;
    p->n_layer = c->n_layer;
    p->n_kv = c->n_kv_head;
    p->hd = c->head_dim;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->be = kvz_model_backend(m);
    p->gpu = p->be->kvzip_select != NULL; /* the backend scores, selects and exports on its device */
    if (!p->gpu) {
        *out = p;
        return 0;
    }
    if (threads <= 0) { /* zstd keeps up with the GPU on a few cores; the caller's thread
                           drives the GPU and must not wait for a core */
        long n = sysconf(_SC_NPROCESSORS_ONLN) - 2;
        threads = n < 2 ? 2 : n > 8 ? 8 : (int)n;
    }
    p->workers = calloc((size_t)threads, sizeof *p->workers);
    if (!p->workers) {
        kvz_pipeline_free(p);
        return kvz_error_set(KVZ_ERR_NOMEM, "pipeline");
    }
    for (int i = 0; i < threads; i++) {
        if (pthread_create(&p->workers[i], NULL, encode_worker, p)) break;
        p->n_workers++;
    }
    if (p->n_workers == 0 || pthread_create(&p->writer, NULL, writer_thread, p)) {
        kvz_pipeline_free(p);
        return kvz_error_set(KVZ_ERR_NOMEM, "cannot start the pipeline threads");
    }
    p->writer_started = 1;
    *out = p;
    return 0;
}

int kvz_pipeline_failed(const kvz_pipeline *p) { return p->fatal; }

/* append j to the FIFO (p->mu held) */
static void enqueue(kvz_pipeline *p, job *j)
{
    j->next = NULL;
    if (p->tail) p->tail->next = j;
    else p->head = j;
    p->tail = j;
    pthread_cond_broadcast(&p->cv);
}

static void fail_job(job *j, int rc)
{
    j->rc = rc;
    snprintf(j->detail, sizeof j->detail, "%s", kvz_error_detail());
    j->pending = 0;
}

/* score, select and export on the GPU into a pipeline buffer (calling thread) */
static int gpu_part(kvz_pipeline *p, job *j, const int32_t *all, int32_t n_prefix, const int32_t *ctx, int32_t n_ctx)
{
    const kvz_ingest_opts *o = &p->o;
    const int nlh = p->n_layer * p->n_kv;
    const size_t rb = kvz_kv_row_bytes(o->dtype, (size_t)p->hd);
    if (!rb) return kvz_error_set(KVZ_ERR_ARG, "unknown KV dtype %u", o->dtype);
    kvz_kv *kv = NULL;
    int rc;
    const int64_t cap = kvz_kvzip_cache_rows(p->m, n_prefix, n_ctx, &o->kp);
    if (cap < 0) return (int)cap;
    if ((rc = kvz_kv_create(p->m, cap, 0, &kv))) return rc;
    rc = kvz_kvzip_score(p->m, kv, all, n_prefix, ctx, n_ctx, &o->kp, NULL, o->progress, o->progress_ctx);
    int64_t kept = 0;
    if (!rc) {
        kept = p->be->kvzip_select(kv, n_prefix, n_ctx, o->kp.ratio, o->kp.mode, NULL, j->counts);
        if (kept < 0) rc = (int)kept;
    }
    if (rc) {
        kvz_kv_free(kv);
        return rc;
    }
    j->res.pairs_kept = kept;
    if (!j->skip) /* (n_prefix 0: nothing to add) */
        for (int i = 0; i < nlh; i++) j->counts[i] += (uint32_t)n_prefix;
    j->res.bytes_kept = (uint64_t)(kept + (int64_t)nlh * n_prefix) * 2u * rb;
    j->info.bytes_kv_kept = j->res.bytes_kept;
    size_t need = 0, layer_max = 0;
    for (int l = 0; l < p->n_layer; l++) {
        j->off[l] = need;
        const uint64_t k = kvz_blob_layer_kept(&j->bm, (uint32_t)l) + (uint64_t)j->skip * p->n_kv; /* exported rows */
        const size_t lb = 2 * al256((size_t)k * rb) + al256((size_t)k * 4);
        need += lb;
        layer_max = lb > layer_max ? lb : layer_max;
    }
    /* pinned staging of one layer: grown rarely (pinning costs ~0.7 s/GB), so the rows of
     * a whole document go to ordinary (pageable, reused) memory from there */
    if (p->pin_bytes < layer_max) {
        p->be->host_free(p->pin);
        p->pin = NULL;
        p->pin_bytes = 0;
        const size_t want = layer_max + layer_max / 2 > ((size_t)64 << 20) ? layer_max + layer_max / 2 : (size_t)64 << 20;
        if ((rc = p->be->host_alloc(&p->pin, want))) {
            kvz_kv_free(kv);
            return rc;
        }
        p->pin_bytes = want;
    }
    /* a free host buffer (the encoders give them back) */
    pthread_mutex_lock(&p->mu);
    pbuf *b = NULL;
    for (;;) {
        for (int i = 0; i < KVZ_PIPELINE_DEPTH && !b; i++)
            if (!p->bufs[i].busy) b = &p->bufs[i];
        if (b) break;
        pthread_cond_wait(&p->cv, &p->mu);
    }
    b->busy = 1;
    pthread_mutex_unlock(&p->mu);
    if (b->bytes < need) {
        free(b->p);
        b->bytes = 0;
        if (!(b->p = malloc(need + need / 4))) {
            rc = kvz_error_set(KVZ_ERR_NOMEM, "kept rows (%.1f MiB)", need / 1048576.0);
            goto fail;
        }
        b->bytes = need + need / 4;
    }
    for (int l = 0; l < p->n_layer && !rc; l++) {
        const uint64_t k = kvz_blob_layer_kept(&j->bm, (uint32_t)l) + (uint64_t)j->skip * p->n_kv;
        const size_t kb = al256((size_t)k * rb), lb = 2 * kb + (size_t)k * 4;
        uint8_t *pin = p->pin, *d = (uint8_t *)b->p + j->off[l];
        rc = p->be->kv_export_layer_to(kv, l, o->dtype, pin, pin + kb, (uint32_t *)(pin + 2 * kb));
        const long nblk = (long)((lb + ((size_t)1 << 20) - 1) >> 20);
#pragma omp parallel for schedule(static) if (nblk > 4)
        for (long i = 0; i < nblk; i++) {
            const size_t o0 = (size_t)i << 20, n = lb - o0 < ((size_t)1 << 20) ? lb - o0 : ((size_t)1 << 20);
            memcpy(d + o0, pin + o0, n);
        }
    }
fail:
    kvz_kv_free(kv);
    if (rc) {
        pthread_mutex_lock(&p->mu);
        b->busy = 0;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        return rc;
    }
    j->buf = b;
    j->pending = j->n_task;
    return 0;
}

static void cpu_done(kvz_pipeline *p, const char *doc_id, int rc, const kvz_ingest_result *res, void *user)
{
    char det[512];
    snprintf(det, sizeof det, "%s", rc ? kvz_error_detail() : "");
    if (rc && fatal_rc(rc) && !p->fatal) {
        p->fatal = rc;
        snprintf(p->fatal_detail, sizeof p->fatal_detail, "%s", det);
    }
    if (p->done_fn) p->done_fn(p->done_ctx, doc_id, rc, det, res, user);
}

/* CPU: compute the queued documents (several short ones per forward pass) and report
 * each, in order; after a store error that stops everything, the rest are reported
 * with it, not attempted (as a submit after it would be). */
static int cpu_item_done(void *ctx, int32_t i, int rc, const kvz_ingest_result *res)
{
    kvz_pipeline *p = ctx;
    const cpu_item *it = &p->cq[i];
    cpu_done(p, it->doc_id, rc, res, it->user);
    return p->fatal != 0;
}

static void cpu_flush(kvz_pipeline *p)
{
    if (!p->cq_n) return;
    kvz_ingest_item *items = calloc((size_t)p->cq_n, sizeof *items);
    int32_t done = 0;
    if (items) {
        for (int i = 0; i < p->cq_n; i++)
            items[i] = (kvz_ingest_item){p->cq[i].doc_id, p->cq[i].path, p->cq[i].ctx, p->cq[i].n_ctx, p->cq[i].part};
        done = kvz_ingest_docs(p->m, p->st, items, p->cq_n, &p->o, cpu_item_done, p);
        free(items);
    }
    for (int i = done; i < p->cq_n; i++) {
        if (p->fatal) { /* queued when the store stopped: not attempted (res NULL) */
            char det[600];
            snprintf(det, sizeof det, "not stored: %.400s", p->fatal_detail);
            if (p->done_fn) p->done_fn(p->done_ctx, p->cq[i].doc_id, p->fatal, det, NULL, p->cq[i].user);
            continue;
        }
        kvz_ingest_result r;
        memset(&r, 0, sizeof r);
        kvz_error_set(KVZ_ERR_NOMEM, "ingest: no memory for the batch");
        cpu_done(p, p->cq[i].doc_id, KVZ_ERR_NOMEM, &r, p->cq[i].user);
    }
    for (int i = 0; i < p->cq_n; i++) {
        free(p->cq[i].doc_id);
        free(p->cq[i].path);
        free(p->cq[i].ctx);
    }
    p->cq_n = 0;
    p->cq_tokens = 0;
}

/* CPU: queue one document; compute the queue once it holds a few passes' worth. */
static int cpu_submit(kvz_pipeline *p, const char *doc_id, const char *source_path, const int32_t *ctx,
                      int32_t n_ctx, uint32_t part, void *user)
{
    if (p->cq_n == p->cq_cap) {
        const int cap = p->cq_cap ? 2 * p->cq_cap : 64;
        cpu_item *q = realloc(p->cq, sizeof *q * (size_t)cap);
        if (q) {
            p->cq = q;
            p->cq_cap = cap;
        }
    }
    cpu_item *it = p->cq_n < p->cq_cap ? &p->cq[p->cq_n] : NULL;
    if (it) {
        memset(it, 0, sizeof *it);
        it->doc_id = strdup(doc_id);
        it->path = strdup(source_path ? source_path : "");
        it->ctx = malloc(sizeof(int32_t) * (size_t)(n_ctx > 0 ? n_ctx : 1));
    }
    if (!it || !it->doc_id || !it->path || !it->ctx) { /* no room to queue it: compute it now */
        if (it) {
            free(it->doc_id);
            free(it->path);
            free(it->ctx);
        }
        cpu_flush(p);
        kvz_ingest_result r;
        kvz_ingest_opts po = p->o;
        po.part = part;
        int rc = kvz_ingest_doc(p->m, p->st, doc_id, source_path, ctx, n_ctx, &po, &r);
        cpu_done(p, doc_id, rc, &r, user);
        return p->fatal;
    }
    if (n_ctx > 0) memcpy(it->ctx, ctx, sizeof(int32_t) * (size_t)n_ctx);
    it->n_ctx = n_ctx;
    it->part = part;
    it->user = user;
    p->cq_n++;
    p->cq_tokens += 2 * (int64_t)(n_ctx > 0 ? n_ctx : 0) + 20;
    /* two passes' worth: few documents computed but not yet committed at any time (a
     * kill loses them, never part of one), passes still nearly full */
    if (p->o.kp.batch_tokens <= 0 || p->cq_tokens >= 2 * (int64_t)p->o.kp.batch_tokens || p->cq_n >= 256)
        cpu_flush(p);
    return p->fatal;
}

int kvz_pipeline_submit(kvz_pipeline *p, const char *doc_id, const char *source_path, const int32_t *ctx,
                        int32_t n_ctx, void *user)
{
    return kvz_pipeline_submit_part(p, doc_id, source_path, ctx, n_ctx, p->o.part, user);
}

int kvz_pipeline_submit_part(kvz_pipeline *p, const char *doc_id, const char *source_path, const int32_t *ctx,
                             int32_t n_ctx, uint32_t part, void *user)
{
    if (!p->gpu) { /* the CPU backend: queued, then kvz_ingest_docs (several per pass) */
        kvz_ingest_result r;
        if (p->fatal) {
            cpu_flush(p);
            memset(&r, 0, sizeof r);
            kvz_error_set(p->fatal, "not stored: %.400s", p->fatal_detail);
            cpu_done(p, doc_id, p->fatal, &r, user);
            return p->fatal;
        }
        return cpu_submit(p, doc_id, source_path, ctx, n_ctx, part, user);
    }
    const double t0 = kvz_now();
    pthread_mutex_lock(&p->mu);
    deliver(p);
    pthread_mutex_unlock(&p->mu);
    const kvz_model *m = p->m;
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    const int nlh = p->n_layer * p->n_kv;
    job *j = calloc(1, sizeof *j);
    if (!j) return kvz_error_set(KVZ_ERR_NOMEM, "pipeline job");
    j->t0 = t0;
    j->user = user;
    j->doc_id = strdup(doc_id);
    j->counts = calloc((size_t)nlh, sizeof *j->counts);
    j->off = calloc((size_t)p->n_layer, sizeof *j->off);
    j->recs = calloc(2 * ((size_t)p->n_layer + 1), sizeof *j->recs);
    j->lens = calloc(2 * ((size_t)p->n_layer + 1), sizeof *j->lens);
    j->pcounts = calloc((size_t)nlh, sizeof *j->pcounts);
    kvz_tokens all = {0};
    int rc = 0;
    if (!j->doc_id || !j->counts || !j->off || !j->recs || !j->lens || !j->pcounts)
        rc = kvz_error_set(KVZ_ERR_NOMEM, "pipeline job");
    else if (p->fatal) {
        rc = kvz_error_set(p->fatal, "not stored: %.400s", p->fatal_detail);
        j->skipped = 1;
    }
    else if (!tok) rc = kvz_error_set(KVZ_ERR_ARG, "ingest needs a model with a tokenizer");
    else if (n_ctx <= 0) rc = kvz_error_set(KVZ_ERR_EMPTY, "document has no tokens");
    else if (n_ctx > kvz_ingest_max_part_tokens(m))
        rc = kvz_error_set(KVZ_ERR_CONTEXT, "%d tokens exceed the %d-token part limit", n_ctx,
                           kvz_ingest_max_part_tokens(m));
    else if (!kvz_kv_row_bytes(p->o.dtype, (size_t)p->hd))
        rc = kvz_error_set(KVZ_ERR_ARG, "unknown KV dtype %u", p->o.dtype);
    int32_t n_prefix = 0;
    if (!rc) rc = kvz_chat_prefix(tok, &all);
    if (!rc) {
        n_prefix = (int32_t)all.n;
        for (int32_t i = 0; i < n_ctx && !rc; i++) rc = kvz_tokens_push(&all, ctx[i]);
    }
    if (!rc) {
        const size_t rb = kvz_kv_row_bytes(p->o.dtype, (size_t)p->hd);
        j->res.n_prefix = n_prefix;
        j->res.n_ctx = n_ctx;
        j->res.pairs_total = (int64_t)nlh * n_ctx;
        j->res.bytes_full = (uint64_t)nlh * (uint64_t)(n_prefix + n_ctx) * 2u * rb;
        kvz_ingest_blob_meta(m, &p->o, n_prefix, n_ctx, j->counts, &j->bm);
        uint8_t params[KVZ_BLOB_PARAMS_SIZE];
        j->n_task = p->n_layer + 1;
        if (n_prefix > 0) { /* the system prefix is stored once, as kvz_ingest_doc stores it */
            j->skip = n_prefix;
            j->bm.prefix_policy = KVZ_PREFIX_SHARED;
            kvz_ingest_prefix_meta(&j->bm, j->pcounts, &j->pm);
            kvz_blob_params_bytes(&j->pm, params);
            kvz_blob_content_hash(j->pm.fingerprint, params, sizeof params, (size_t)n_prefix, all.ids, j->phash);
            memcpy(j->bm.prefix_ref, j->phash, 16);
        }
        kvz_blob_params_bytes(&j->bm, params);
        kvz_blob_content_hash(j->bm.fingerprint, params, sizeof params, all.n, all.ids, j->res.hash);
        snprintf(j->info.source_path, sizeof j->info.source_path, "%s", source_path ? source_path : "");
        j->info.n_tokens = all.n;
        j->info.part = part; /* the ID#N part policy (ingest/kvz_parts.h), as kvz_ingest_doc records it */
        j->info.ratio = p->o.kp.ratio;
        j->info.mode = j->bm.mode;
        j->info.bytes_kv_full = j->res.bytes_full;
        const int have = kvz_store_has_hash(p->st, j->res.hash);
        if (have < 0) {
            rc = have;
        } else if (have) { /* stored already (this id or another): the writer links it */
            kvz_store_doc_info old;
            j->link = 1;
            if (kvz_store_lookup(p->st, doc_id, &old) == 0 && !memcmp(old.hash, j->res.hash, 16))
                j->info.bytes_kv_kept = old.bytes_kv_kept;
            kvz_error_clear();
        } else {
            const int have_prefix = j->skip ? kvz_store_has_prefix(p->st, j->phash) : 1;
            if (have_prefix < 0) rc = have_prefix;
            else if (!have_prefix) j->n_task = 2 * (p->n_layer + 1); /* its records go with this document */
            if (!rc) rc = gpu_part(p, j, all.ids, n_prefix, ctx, n_ctx);
        }
    }
    kvz_tokens_free(&all);
    if (rc) fail_job(j, rc);
    pthread_mutex_lock(&p->mu);
    enqueue(p, j);
    deliver(p);
    const int fatal = p->fatal;
    pthread_mutex_unlock(&p->mu);
    return fatal;
}

int kvz_pipeline_drain(kvz_pipeline *p)
{
    if (!p->gpu) {
        cpu_flush(p);
        return p->fatal;
    }
    pthread_mutex_lock(&p->mu);
    for (;;) {
        deliver(p);
        if (!p->head) break;
        pthread_cond_wait(&p->cv, &p->mu);
    }
    const int fatal = p->fatal;
    pthread_mutex_unlock(&p->mu);
    return fatal;
}

void kvz_pipeline_free(kvz_pipeline *p)
{
    if (!p) return;
    if (p->writer_started || !p->gpu) kvz_pipeline_drain(p);
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_workers; i++) pthread_join(p->workers[i], NULL);
    if (p->writer_started) pthread_join(p->writer, NULL);
    while (p->head) { /* only when the threads could not start */
        job *j = p->head;
        p->head = j->next;
        job_free(p, j);
    }
    for (int i = 0; i < KVZ_PIPELINE_DEPTH; i++) free(p->bufs[i].p);
    if (p->pin) p->be->host_free(p->pin);
    free(p->cq);
    free(p->workers);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}
