/* Several stored caches composed into one KV cache (see kvz_compose.h). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_compose.h"
#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_kvrow.h"
#include "kvz_load.h"
#include "kvz_load_rec.h"
#include "kvz_rope_shift.h"
#include "kvz_backend.h"

void kvz_compose_defaults(kvz_compose_opts *o)
{
    memset(o, 0, sizeof *o);
    o->placement = KVZ_PLACE_AUTO;
}

void kvz_compose_names_free(char **names, int32_t n)
{
    if (!names) return;
    for (int32_t i = 0; i < n; i++) free(names[i]);
    free(names);
}

/* Prefix the current error detail with the document it concerns. */
static int doc_err(int rc, const char *id)
{
    char d[512];
    snprintf(d, sizeof d, "%s", kvz_error_detail());
    if (d[0]) return kvz_error_set(rc, "document '%s': %s", id, d);
    return kvz_error_set(rc, "document '%s': %s", id, kvz_strerror(rc));
}

static int add_name(char ***v, int32_t *n, const char *id)
{
    if (*n >= KVZ_COMPOSE_MAX_DOCS)
        return kvz_error_set(KVZ_ERR_ARG, "more than %d documents in one composition", KVZ_COMPOSE_MAX_DOCS);
    for (int32_t i = 0; i < *n; i++)
        if (!strcmp((*v)[i], id)) return kvz_error_set(KVZ_ERR_ARG, "document '%s' is named twice", id);
    char *s = strdup(id);
    char **nv = s ? realloc(*v, sizeof *nv * (size_t)(*n + 1)) : NULL;
    if (!nv) {
        free(s);
        return KVZ_ERR_NOMEM;
    }
    nv[(*n)++] = s;
    *v = nv;
    return 0;
}

/* @p id itself, or all of its parts id#1..id#n in order. */
static int expand(kvz_store_read *r, const char *id, char ***v, int32_t *n)
{
    kvz_store_doc_info info;
    if (!id || !id[0]) return kvz_error_set(KVZ_ERR_ARG, "an empty document id");
    int rc = kvz_store_read_doc(r, id, &info);
    if (rc != KVZ_ERR_NOTFOUND) return rc ? doc_err(rc, id) : add_name(v, n, id);
    char pid[KVZ_STORE_DOC_ID_MAX + 16];
    uint32_t p = 1;
    for (; p <= KVZ_STORE_PART_MAX; p++) {
        if ((size_t)snprintf(pid, sizeof pid, "%s#%u", id, p) > KVZ_STORE_DOC_ID_MAX) break;
        rc = kvz_store_read_doc(r, pid, &info);
        if (rc == KVZ_ERR_NOTFOUND) break;
        if (rc) return doc_err(rc, pid);
        if (info.part != 0 && info.part != p) break; /* another document's entry */
        if ((rc = add_name(v, n, pid))) return rc;
    }
    if (p == 1) return kvz_error_set(KVZ_ERR_NOTFOUND, "no document '%s' in the store", id);
    return 0;
}

/* The composed cache: @p max_head rows in the fullest head + @p extra free rows. */
static int create_cache(kvz_model *m, char **v, int32_t nd, uint64_t max_head, int64_t extra, int32_t out_slots,
                        kvz_kv **kv, kvz_load_profile *prof)
{
    const double ta = kvz_now();
    int rc = kvz_kv_create(m, (int64_t)max_head + extra, out_slots, kv);
    prof->alloc_s += kvz_now() - ta;
    if (rc == KVZ_ERR_NOMEM)
        rc = kvz_error_set(rc, "the composed cache of %d documents ('%s' .. '%s': %llu rows per "
                           "head at most) does not fit in memory", nd, v[0], v[nd - 1], (unsigned long long)max_head);
    return rc;
}

/* Where the records of a composition come from: source src of layer l is the shared
 * prefix blob (src -1, when the documents have one) or document src. */
typedef struct srcs {
    char **v;                         /* (nd) document ids */
    int32_t nd;
    const kvz_blob_meta *bm;          /* (nd) */
    const kvz_store_doc_info *info;   /* (nd) */
    const kvz_blob_meta *pm;          /* the shared prefix blob, or NULL */
} srcs;

static const kvz_blob_meta *src_meta(const srcs *q, int32_t src) { return src < 0 ? q->pm : &q->bm[src]; }
static const uint8_t *src_hash(const srcs *q, int32_t src) { return src < 0 ? q->bm[0].prefix_ref : q->info[src].hash; }
static const char *src_id(const srcs *q, int32_t src) { return q->v[src < 0 ? 0 : src]; }

/* a record of source @p b's layer @p l, laid out from byte 0 of a buffer */
static kvz_load_at src_at(const kvz_blob_meta *b, uint32_t l)
{
    return kvz_load_place(0, kvz_blob_layer_kept(b, l), kvz_blob_kv_row_bytes(b));
}

/* ------------------------------------------------------------------ device backend (CUDA)
 * Tasks t = (layer l, source i): per layer the shared prefix blob (when the documents
 * have one), then documents 0..nd-1. Host workers read + verify each task's record
 * straight into a pinned slot as the loader does (kvz_load_record: copied with pread()
 * and hashed once, or a zstd record decompressed into place; stored rows, no
 * conversion; positions moved by Δ in place); the calling thread uploads the slots in
 * task order, each head's rows to its composed place (kvz_cuda_load_rows: the device
 * converts to bf16), while the workers read the next tasks. After the last upload one
 * kernel re-rotates every moved key in HBM (kvz_cuda_kv_shift). The host copies no row
 * beyond the slot. */
typedef struct gpu_job {
    kvz_model *m;
    kvz_kv *kv;
    kvz_store *st;
    srcs q;
    const uint32_t *skip;             /* (nd) leading rows of each head not taken (prefix kept once) */
    const int64_t *delta;             /* (nd) position offsets */
    uint32_t n_prefix, per, ntask;    /* per: tasks per layer */
    int32_t nkv;
    int map_only;
    int nslot;
    const kvz_backend *be;
    void *slots[KVZ_BACKEND_MAX_LOAD_SLOTS];
    uint32_t *np;                     /* (ntask, nkv) rows at positions < n_prefix in each head's run */
    kvz_load_sync sy;
    uint32_t next, freed;             /* next task to claim; tasks [0, freed) have given their slot back */
    uint8_t *ready;                   /* (ntask) decoded */
    kvz_load_profile prof;            /* workers' sums (sy.mu) + the upload thread's */
} gpu_job;

/* task t's layer, source (-1: the prefix blob) and blob meta */
static const kvz_blob_meta *task_of(const gpu_job *j, uint32_t t, uint32_t *l, int32_t *src)
{
    *l = t / j->per;
    *src = (int32_t)(t % j->per) - (j->q.pm ? 1 : 0);
    return src_meta(&j->q, *src);
}

static void *gpu_worker(void *arg)
{
    gpu_job *j = arg;
    kvz_load_reader rd;
    int rc = kvz_load_reader_begin(&rd, j->st, j->map_only);
    if (rc) {
        kvz_load_sync_fail(&j->sy, rc, j->q.v[0], UINT32_MAX);
        return NULL;
    }
    for (;;) {
        pthread_mutex_lock(&j->sy.mu);
        if (j->sy.err || j->next >= j->ntask) {
            pthread_mutex_unlock(&j->sy.mu);
            break;
        }
        const uint32_t t = j->next++;
        const double tw = kvz_now();
        while (!j->sy.err && j->freed + (uint32_t)j->nslot < t + 1) pthread_cond_wait(&j->sy.cv, &j->sy.mu);
        rd.pf.slot_wait_s += kvz_now() - tw;
        const int stop = j->sy.err;
        pthread_mutex_unlock(&j->sy.mu);
        if (stop) break;
        uint32_t l;
        int32_t src;
        const kvz_blob_meta *b = task_of(j, t, &l, &src);
        const kvz_load_at at = src_at(b, l);
        uint8_t *s = j->slots[t % (uint32_t)j->nslot];
        rc = kvz_load_record(&rd, b, src_hash(&j->q, src), src < 0, l, s, at);
        if (rc) {
            kvz_load_sync_fail(&j->sy, rc, src_id(&j->q, src), l);
            break;
        }
        /* positions: prefix rows stay, the others move by Δ (in the slot, before the upload) */
        uint32_t *pos = (uint32_t *)(s + at.pos);
        const int64_t dl = src < 0 ? 0 : j->delta[src];
        const uint32_t sk = src < 0 ? 0 : j->skip[src];
        uint64_t off = 0;
        for (int32_t h = 0; h < j->nkv; h++) {
            const uint32_t cnt = b->counts[(size_t)l * j->nkv + h];
            uint32_t np = 0;
            for (uint64_t i = off + sk; i < off + cnt; i++) {
                if (pos[i] < j->n_prefix) np++;
                else pos[i] = (uint32_t)((int64_t)pos[i] + dl);
            }
            j->np[(size_t)t * j->nkv + h] = np;
            off += cnt;
        }
        pthread_mutex_lock(&j->sy.mu);
        j->ready[t] = 1;
        pthread_cond_broadcast(&j->sy.cv);
        pthread_mutex_unlock(&j->sy.mu);
    }
    kvz_load_reader_end(&rd);
    pthread_mutex_lock(&j->sy.mu);
    kvz_load_profile_add(&j->prof, &rd.pf);
    pthread_mutex_unlock(&j->sy.mu);
    return NULL;
}

/* the calling thread: upload the tasks in order, collect the segments to re-rotate,
 * then one re-rotation launch; returns the first error */
static int gpu_upload(gpu_job *j, float ks, int32_t nd)
{
    const int32_t nkv = j->nkv, half = kvz_model_config(j->m)->head_dim / 2;
    kvz_kv_shift_seg *segs = malloc(sizeof *segs * ((size_t)j->ntask * nkv + 1));
    float *cs = malloc(sizeof *cs * (size_t)nd * half), *sn = malloc(sizeof *sn * (size_t)nd * half);
    uint32_t fill[KVZ_BLOB_MAX_HEADS], src_row[KVZ_BLOB_MAX_HEADS], rows[KVZ_BLOB_MAX_HEADS], dst[KVZ_BLOB_MAX_HEADS];
    int nseg = 0, rc = 0;
    if (!segs || !cs || !sn) {
        rc = kvz_error_set(KVZ_ERR_NOMEM, "composition: re-rotation tables");
        goto done;
    }
    for (int32_t d = 0; d < nd; d++) kvz_rope_shift_table(j->m, (int32_t)j->delta[d], cs + (size_t)d * half, sn + (size_t)d * half);
    for (uint32_t t = 0; t < j->ntask && !rc; t++) {
        const double tw = kvz_now();
        pthread_mutex_lock(&j->sy.mu);
        while (!j->ready[t] && !j->sy.err) pthread_cond_wait(&j->sy.cv, &j->sy.mu);
        const int stop = j->sy.err;
        pthread_mutex_unlock(&j->sy.mu);
        const double tu = kvz_now();
        j->prof.ready_wait_s += tu - tw; /* this thread only */
        if (stop) break;
        uint32_t l;
        int32_t src;
        const kvz_blob_meta *b = task_of(j, t, &l, &src);
        if (t % j->per == 0) memset(fill, 0, sizeof fill);
        const uint32_t sk = src < 0 ? 0 : j->skip[src];
        uint32_t off = 0;
        for (int32_t h = 0; h < nkv; h++) {
            const uint32_t cnt = b->counts[(size_t)l * nkv + h];
            src_row[h] = off + sk;
            rows[h] = cnt - sk;
            dst[h] = fill[h];
            fill[h] += rows[h];
            off += cnt;
            const uint32_t np = j->np[(size_t)t * nkv + h];
            if (src >= 0 && (j->delta[src] != 0 || ks != 1.0f) && rows[h] > np)
                segs[nseg++] = (kvz_kv_shift_seg){(int32_t)(l * (uint32_t)nkv + (uint32_t)h), (int32_t)(dst[h] + np),
                                                    (int32_t)(rows[h] - np), src};
        }
        const kvz_load_at at = src_at(b, l);
        const int slot = (int)(t % (uint32_t)j->nslot);
        rc = j->be->load_rows(j->kv, (int32_t)l, slot, b->dtype, src_row, rows, dst, at.k, at.v, at.pos, at.end);
        if (!rc && t > 0) rc = j->be->load_wait(j->m, (int)((t - 1) % (uint32_t)j->nslot));
        j->prof.upload_s += kvz_now() - tu;
        if (rc) {
            kvz_load_sync_fail(&j->sy, rc, src_id(&j->q, src), UINT32_MAX);
            break;
        }
        pthread_mutex_lock(&j->sy.mu);
        j->freed = t; /* tasks [0, t) uploaded: their slots are free */
        pthread_cond_broadcast(&j->sy.cv);
        pthread_mutex_unlock(&j->sy.mu);
    }
    if (!rc && !j->sy.err) {
        const double tu = kvz_now();
        rc = j->be->kv_shift(j->kv, segs, nseg, cs, sn, nd, ks);
        j->prof.upload_s += kvz_now() - tu;
        if (rc) kvz_load_sync_fail(&j->sy, rc, j->q.v[nd - 1], UINT32_MAX);
    }
done:
    free(segs);
    free(cs);
    free(sn);
    return rc;
}

/* the device cache (*kvp, created here once the workers run: they only fill pinned
 * slots, so the allocation overlaps their reads, as in the loader) */
static int compose_gpu(kvz_model *m, kvz_store *st, kvz_kv **kvp, uint64_t max_head, int64_t extra, int32_t out_slots,
                       const srcs *q, const uint32_t *skip, const int64_t *delta, float ks, int want, int map_only,
                       kvz_load_profile *prof)
{
    const kvz_config *c = kvz_model_config(m);
    gpu_job j;
    memset(&j, 0, sizeof j);
    j.m = m;
    j.be = kvz_model_backend(m);
    j.st = st;
    j.q = *q;
    j.skip = skip;
    j.delta = delta;
    j.n_prefix = q->bm[0].n_prefix;
    j.nkv = c->n_kv_head;
    j.map_only = map_only;
    j.per = (uint32_t)q->nd + (q->pm ? 1 : 0);
    j.ntask = j.per * (uint32_t)c->n_layer;
    size_t max_bytes = 0;
    for (uint32_t t = 0; t < j.ntask; t++) {
        uint32_t l;
        int32_t src;
        const kvz_blob_meta *tb = task_of(&j, t, &l, &src);
        const size_t b = src_at(tb, l).end;
        max_bytes = b > max_bytes ? b : max_bytes;
    }
    j.nslot = kvz_load_plan_slots(&want, j.ntask, j.be->load_max_slots);
    j.np = malloc(sizeof *j.np * (size_t)j.ntask * (size_t)j.nkv);
    j.ready = calloc(j.ntask, 1);
    if (!j.np || !j.ready) {
        free(j.np);
        free(j.ready);
        return kvz_error_set(KVZ_ERR_NOMEM, "composition: task tables");
    }
    int rc = j.be->load_slots(m, max_bytes, j.nslot, j.slots);
    if (rc) {
        free(j.np);
        free(j.ready);
        return rc;
    }
    kvz_load_sync_init(&j.sy);
    pthread_t th[KVZ_BACKEND_MAX_LOAD_SLOTS];
    const int nth = kvz_load_spawn(th, want, gpu_worker, &j);
    if (nth == 0) {
        rc = kvz_error_set(KVZ_ERR_NOMEM, "composition: cannot start a decode thread");
    } else if ((rc = create_cache(m, q->v, q->nd, max_head, extra, out_slots, kvp, prof))) {
        pthread_mutex_lock(&j.sy.mu); /* stop the workers; the error is this thread's */
        j.sy.err = rc;
        j.sy.detail[0] = 0;
        pthread_cond_broadcast(&j.sy.cv);
        pthread_mutex_unlock(&j.sy.mu);
    } else {
        j.kv = *kvp; /* read by the upload loop only (this thread) */
        rc = gpu_upload(&j, ks, q->nd);
    }
    kvz_load_join(th, nth);
    j.be->load_finish(m); /* nothing in flight reads the slots after this */
    kvz_load_sync_destroy(&j.sy);
    if (j.sy.err && j.sy.detail[0]) rc = kvz_error_set(j.sy.err, "%s", j.sy.detail);
    kvz_load_profile_add(prof, &j.prof);
    prof->ready_wait_s += j.prof.ready_wait_s;
    prof->upload_s += j.prof.upload_s;
    free(j.np);
    free(j.ready);
    return rc;
}

/* ------------------------------------------------------------------ host route
 * CPU backend (and the CUDA backend's host_path): a pool of workers, one layer per
 * task. A worker reads every source's record of its layer as the loader does
 * (kvz_load_record) into one record buffer, decodes each head's rows to fp32 straight
 * into the composed layer (the prefix once, then every document's rows behind it),
 * re-rotates the moved keys (kvz_rope_shift) and hands the layer to kvz_kv_set_layer:
 * the same copies as loading one document. */
typedef struct host_job {
    kvz_model *m;
    kvz_kv *kv;
    kvz_store *st;
    srcs q;
    const uint32_t *skip;   /* (nd) */
    const int64_t *delta;   /* (nd) */
    const uint32_t *total;  /* (n_layer, n_kv_head) composed rows */
    float ks;
    int map_only;
    size_t rec_bytes;       /* the largest record, laid out (src_at) */
    uint64_t max_layer;     /* composed rows of the largest layer */
    uint32_t next;          /* next layer to claim (sy.mu) */
    kvz_load_sync sy;
    kvz_load_profile prof;  /* summed over the workers (sy.mu) */
} host_job;

/* compose layer @p l into the worker's buffers and the cache; on error returns it and
 * sets *who to the source it concerns (a record error: *rec = 1) */
static int host_layer(host_job *j, kvz_load_reader *rd, uint32_t l, uint8_t *buf, float *kf, float *vf, int32_t *pf,
                      int32_t *who, int *rec)
{
    const kvz_config *c = kvz_model_config(j->m);
    const int32_t nkv = c->n_kv_head;
    const size_t hd = (size_t)c->head_dim;
    const uint32_t *tl = j->total + (size_t)l * nkv;
    /* fill[h]: rows of head h placed so far; head h starts at the sum of the totals before it */
    uint64_t hstart[KVZ_BLOB_MAX_HEADS], fill[KVZ_BLOB_MAX_HEADS];
    uint64_t acc = 0;
    for (int32_t h = 0; h < nkv; h++) {
        hstart[h] = acc;
        fill[h] = 0;
        acc += tl[h];
    }
    int rc = 0;
    for (int32_t src = j->q.pm ? -1 : 0; src < j->q.nd; src++) {
        const kvz_blob_meta *b = src_meta(&j->q, src);
        const kvz_load_at at = src_at(b, l);
        *who = src;
        *rec = 1;
        if ((rc = kvz_load_record(rd, b, src_hash(&j->q, src), src < 0, l, buf, at))) return rc;
        *rec = 0;
        const double t0 = kvz_now();
        const uint32_t *pos = (const uint32_t *)(buf + at.pos);
        const uint8_t *kb = buf + at.k, *vb = buf + at.v;
        const size_t rb = kvz_blob_kv_row_bytes(b);
        const uint32_t sk = src < 0 ? 0 : j->skip[src];
        const int64_t dl = src < 0 ? 0 : j->delta[src];
        uint64_t off = 0;
        for (int32_t h = 0; h < nkv && !rc; h++) {
            const uint32_t cnt = b->counts[(size_t)l * nkv + h];
            const uint64_t s0 = off + sk, nr = cnt - sk;
            const uint64_t dst = hstart[h] + fill[h];
            if ((rc = kvz_kvrow_decode(b->dtype, kb + s0 * rb, nr, hd, kf + dst * hd)) ||
                (rc = kvz_kvrow_decode(b->dtype, vb + s0 * rb, nr, hd, vf + dst * hd)))
                break;
            /* the prefix rows (positions < n_prefix, first in each head) stay put */
            uint64_t np = 0;
            for (uint64_t i = 0; i < nr; i++) {
                const uint32_t p = pos[s0 + i];
                if (p < b->n_prefix) {
                    pf[dst + i] = (int32_t)p;
                    np++;
                } else {
                    pf[dst + i] = (int32_t)(p + dl);
                }
            }
            if (src >= 0) {
                if (dl) kvz_rope_shift(j->m, kf + (dst + np) * hd, (int64_t)(nr - np), (int32_t)dl);
                if (j->ks != 1.0f)
                    for (uint64_t i = np * hd; i < nr * hd; i++) kf[dst * hd + i] *= j->ks;
            }
            fill[h] += nr;
            off += cnt;
        }
        rd->pf.convert_s += kvz_now() - t0;
        if (rc) return rc;
    }
    *who = 0;
    const double t0 = kvz_now();
    rc = kvz_kv_set_layer(j->kv, (int32_t)l, tl, pf, kf, vf);
    rd->pf.convert_s += kvz_now() - t0;
    return rc;
}

static void *host_worker(void *arg)
{
    host_job *j = arg;
    const size_t hd = (size_t)kvz_model_config(j->m)->head_dim;
    kvz_load_reader rd;
    uint8_t *buf = NULL;
    float *kf = NULL, *vf = NULL;
    int32_t *pf = NULL;
    int rc = kvz_load_reader_begin(&rd, j->st, j->map_only);
    if (rc) {
        kvz_load_sync_fail(&j->sy, rc, j->q.v[0], UINT32_MAX);
        goto out;
    }
    buf = malloc(j->rec_bytes + 16);
    kf = malloc(sizeof *kf * (j->max_layer + 1) * hd);
    vf = malloc(sizeof *vf * (j->max_layer + 1) * hd);
    pf = malloc(sizeof *pf * (j->max_layer + 1));
    if (!buf || !kf || !vf || !pf) {
        kvz_error_set(KVZ_ERR_NOMEM, "the composed layer staging (%llu rows) does not fit in memory",
                      (unsigned long long)j->max_layer);
        kvz_load_sync_fail(&j->sy, KVZ_ERR_NOMEM, j->q.v[0], UINT32_MAX);
        goto out;
    }
    for (;;) {
        pthread_mutex_lock(&j->sy.mu);
        const int stop = j->sy.err || j->next >= j->q.bm[0].n_layer;
        const uint32_t l = j->next++;
        pthread_mutex_unlock(&j->sy.mu);
        if (stop) break;
        int32_t who = 0;
        int rec = 0;
        if ((rc = host_layer(j, &rd, l, buf, kf, vf, pf, &who, &rec))) {
            kvz_load_sync_fail(&j->sy, rc, src_id(&j->q, who), rec ? l : UINT32_MAX);
            break;
        }
    }
out:
    kvz_load_reader_end(&rd);
    free(buf);
    free(kf);
    free(vf);
    free(pf);
    pthread_mutex_lock(&j->sy.mu);
    kvz_load_profile_add(&j->prof, &rd.pf);
    pthread_mutex_unlock(&j->sy.mu);
    return NULL;
}

static int compose_host(kvz_model *m, kvz_store *st, kvz_kv *kv, const srcs *q, const uint32_t *skip,
                        const int64_t *delta, const uint32_t *total, uint64_t max_layer, float ks, int want,
                        int map_only, kvz_load_profile *prof)
{
    host_job j;
    memset(&j, 0, sizeof j);
    j.m = m;
    j.kv = kv;
    j.st = st;
    j.q = *q;
    j.skip = skip;
    j.delta = delta;
    j.total = total;
    j.ks = ks;
    j.map_only = map_only;
    j.max_layer = max_layer;
    const uint32_t nl = q->bm[0].n_layer;
    for (uint32_t l = 0; l < nl; l++)
        for (int32_t src = q->pm ? -1 : 0; src < q->nd; src++) {
            const size_t e = src_at(src_meta(q, src), l).end;
            if (e > j.rec_bytes) j.rec_bytes = e;
        }
    if ((uint32_t)want > nl) want = (int)nl;
    kvz_load_sync_init(&j.sy);
    pthread_t th[64];
    const int nth = kvz_load_spawn(th, want - 1, host_worker, &j); /* the calling thread is one of them */
    host_worker(&j);
    kvz_load_join(th, nth);
    kvz_load_sync_destroy(&j.sy);
    kvz_load_profile_add(prof, &j.prof);
    return j.sy.err ? kvz_error_set(j.sy.err, "%s", j.sy.detail) : 0;
}

int kvz_docs_load(kvz_model *m, kvz_store *st, const char *const *ids, int32_t n,
                  const kvz_compose_opts *o, int64_t extra_rows, int32_t out_slots, kvz_kv **out,
                  kvz_compose_meta *meta, char ***names)
{
    const kvz_config *c = kvz_model_config(m);
    kvz_compose_opts dflt;
    if (!o) {
        kvz_compose_defaults(&dflt);
        o = &dflt;
    }
    *out = NULL;
    if (names) *names = NULL;
    memset(meta, 0, sizeof *meta);
    if (n < 1 || !ids) return kvz_error_set(KVZ_ERR_ARG, "no document to compose");
    if (o->placement < KVZ_PLACE_AUTO || o->placement > KVZ_PLACE_PARALLEL)
        return kvz_error_set(KVZ_ERR_ARG, "placement %d unknown", o->placement);
    const double t0 = kvz_now();
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    kvz_store_read *r;
    int rc = kvz_store_read_begin(st, &r);
    if (rc) return rc;
    char **v = NULL;
    int32_t nd = 0;
    kvz_blob_meta *bm = NULL;
    kvz_store_doc_info *info = NULL;
    int64_t *delta = NULL;
    uint32_t *total = NULL, *skip = NULL;
    kvz_kv *kv = NULL;
    kvz_load_profile prof;
    memset(&prof, 0, sizeof prof);
    kvz_blob_meta pm; /* the shared prefix blob of SHARED documents (FORMAT §6.6) */
    memset(&pm, 0, sizeof pm);
    for (int32_t i = 0; i < n && !rc; i++) rc = expand(r, ids[i], &v, &nd);
    if (rc) goto out;
    const size_t nlh = (size_t)c->n_layer * (size_t)c->n_kv_head;
    bm = calloc((size_t)nd, sizeof *bm);
    info = calloc((size_t)nd, sizeof *info);
    delta = calloc((size_t)nd, sizeof *delta);
    skip = calloc((size_t)nd, sizeof *skip);
    total = calloc(nlh, sizeof *total);
    if (!bm || !info || !delta || !skip || !total) {
        rc = KVZ_ERR_NOMEM;
        goto out;
    }
    int64_t sum_ctx = 0;
    meta->ratio_min = 1.0f;
    for (int32_t d = 0; d < nd; d++) {
        const uint8_t *rec;
        size_t len;
        if ((rc = kvz_store_read_doc(r, v[d], &info[d])) ||
            (rc = kvz_store_read_meta(r, info[d].hash, &rec, &len)) ||
            (rc = kvz_blob_decode_meta(rec, len, fp, &bm[d]))) {
            rc = doc_err(rc, v[d]);
            goto out;
        }
        if (bm[d].n_layer != (uint32_t)c->n_layer || bm[d].n_kv_head != (uint32_t)c->n_kv_head ||
            bm[d].head_dim != (uint32_t)c->head_dim || bm[d].n_head != (uint32_t)c->n_head) {
            rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s': blob dims differ from the model's", v[d]);
            goto out;
        }
        if (bm[d].n_prefix != bm[0].n_prefix || bm[d].prefix_policy != bm[0].prefix_policy) {
            rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s' was stored with another system prefix "
                               "(%u tokens) than '%s' (%u tokens): they cannot share one context",
                               v[d], bm[d].n_prefix, v[0], bm[0].n_prefix);
            goto out;
        }
        /* prefix rows come from the first document only */
        skip[d] = d > 0 && bm[d].prefix_policy == KVZ_PREFIX_KEEP ? bm[d].n_prefix : 0;
        delta[d] = sum_ctx;
        sum_ctx += bm[d].n_context;
        if ((int32_t)bm[d].n_context > meta->max_ctx) meta->max_ctx = (int32_t)bm[d].n_context;
        if (bm[d].ratio < meta->ratio_min) meta->ratio_min = bm[d].ratio;
        if (bm[d].ratio > meta->ratio_max) meta->ratio_max = bm[d].ratio;
        for (size_t i = 0; i < nlh; i++) {
            if (bm[d].counts[i] < skip[d]) {
                rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s': a head holds fewer rows than the prefix", v[d]);
                goto out;
            }
            total[i] += bm[d].counts[i] - skip[d];
        }
    }
    /* SHARED blobs hold only context rows: the prefix rows come once, from the prefix
     * blob the first document names, placed first in every head */
    const uint32_t P = bm[0].prefix_policy == KVZ_PREFIX_SHARED ? bm[0].n_prefix : 0;
    if (P) {
        const uint8_t *rec;
        size_t len;
        if ((rc = kvz_store_read_prefix(r, bm[0].prefix_ref, KVZ_BLOB_META_LAYER, &rec, &len)) ||
            (rc = kvz_blob_decode_meta(rec, len, fp, &pm))) {
            rc = doc_err(rc, v[0]);
            goto out;
        }
        if (pm.n_layer != bm[0].n_layer || pm.n_kv_head != bm[0].n_kv_head ||
            pm.head_dim != bm[0].head_dim || pm.n_prefix != P || pm.n_context != 0 ||
            pm.prefix_policy != KVZ_PREFIX_KEEP || pm.n_head != bm[0].n_head) {
            rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s': its shared prefix blob does not fit it", v[0]);
            goto out;
        }
        for (size_t i = 0; i < nlh; i++)
            if (pm.counts[i] != P) {
                rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s': its shared prefix blob does not hold the %u-token "
                                   "prefix in every head", v[0], P);
                goto out;
            }
        for (size_t i = 0; i < nlh; i++) total[i] += P;
    }
    meta->n_docs = nd;
    meta->n_prefix = (int32_t)bm[0].n_prefix;
    meta->span_seq = meta->n_prefix + sum_ctx;
    if (meta->span_seq + o->reserve > KVZ_BLOB_MAX_TOKENS) {
        rc = kvz_error_set(KVZ_ERR_CONTEXT, "%d documents span %lld positions, past the %u-position "
                           "limit (the last is '%s')", nd, (long long)meta->span_seq, KVZ_BLOB_MAX_TOKENS, v[nd - 1]);
        goto out;
    }
    int32_t place = o->placement;
    if (place == KVZ_PLACE_AUTO)
        place = meta->span_seq + o->reserve <= c->n_ctx ? KVZ_PLACE_SEQUENTIAL : KVZ_PLACE_PARALLEL;
    meta->placement = place;
    for (int32_t d = 0; d < nd; d++) {
        if (place == KVZ_PLACE_PARALLEL) delta[d] = 0;
        else if (d > 0) delta[d] += o->shift_bias;
    }
    meta->q_pos = place == KVZ_PLACE_PARALLEL ? meta->n_prefix + meta->max_ctx : (int32_t)meta->span_seq;
    uint64_t max_head = 0, max_layer = 0;
    for (int32_t l = 0; l < c->n_layer; l++) {
        uint64_t lt = 0;
        for (int32_t h = 0; h < c->n_kv_head; h++) {
            const uint64_t t = total[(size_t)l * c->n_kv_head + h];
            lt += t;
            if (t > max_head) max_head = t;
        }
        if (lt > max_layer) max_layer = lt;
        meta->rows += lt;
    }
    meta->rows_full = (uint64_t)meta->span_seq * nlh;
    const float ks = o->key_scale > 0.0f ? o->key_scale : 1.0f;
    kvz_load_opts lo = {.threads = o->threads};
    int want = kvz_load_threads(&lo);
    kvz_store_read_end(r); /* the workers read in their own transactions */
    r = NULL;
    const srcs q = {v, nd, bm, info, P ? &pm : NULL};
    const kvz_backend *be = kvz_model_backend(m);
    if (be->kv_shift && be->load_rows && be->load_slots && !o->host_path) {
        rc = compose_gpu(m, st, &kv, max_head, extra_rows, out_slots, &q, skip, delta, ks, want, o->map_only, &prof);
        goto out;
    }
    if (be->device != KVZ_DEVICE_CPU) want = 1; /* kvz_kv_set_layer uploads: the calling thread only */
    /* the workers place rows in the cache, so it comes first */
    if (!(rc = create_cache(m, v, nd, max_head, extra_rows, out_slots, &kv, &prof)))
        rc = compose_host(m, st, kv, &q, skip, delta, total, max_layer, ks, want, o->map_only, &prof);
out:
    kvz_store_read_end(r);
    kvz_blob_meta_free(&pm);
    if (bm)
        for (int32_t d = 0; d < nd; d++) kvz_blob_meta_free(&bm[d]);
    free(bm); free(info); free(delta); free(skip); free(total);
    if (rc) {
        kvz_kv_free(kv);
        kvz_compose_names_free(v, nd);
        meta->n_docs = 0;
        return rc;
    }
    meta->load_s = kvz_now() - t0;
    if (o->profile) {
        prof.total_s = meta->load_s;
        *o->profile = prof;
    }
    *out = kv;
    if (names) *names = v;
    else kvz_compose_names_free(v, nd);
    return 0;
}
