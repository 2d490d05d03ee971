/* The pipelined loader (kvz_load.h): store -> KV cache with a decode thread pool and,
 * on the CUDA backend, pinned staging slots uploaded while later layers decode. */
#include "kvz_load.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_kvdtype.h"
#include "kvz_kvrow.h"
#ifdef KVZ_HAVE_CUDA
#include "kvz_cuda_loader.h"
#endif

#define MAX_THREADS 12

int kvz_load_threads(const kvz_load_opts *o)
{
    if (o && o->threads > 0) return o->threads > 64 ? 64 : o->threads;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
}

static size_t al256(size_t x) { return (x + 255) & ~(size_t)255; }

typedef struct load_job {
    kvz_model *m;
    kvz_kv *kv;
    kvz_store *st;
    const char *doc_id;
    const uint8_t *hash;
    const kvz_blob_meta *bm;
    size_t rb;          /* stored bytes of one row */
    int gpu;
    int nslot;
    void *slots[16];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t next;      /* next layer to claim */
    uint32_t freed;     /* layers [0, freed) have given their slot back */
    uint8_t *ready;     /* (n_layer) decoded */
    int err;            /* first error (0: none) */
    char detail[512];
} load_job;

/* per-layer slot layout: K at 0, V at voff, positions at 2 * voff */
static size_t layer_voff(const load_job *j, uint64_t kept) { return al256((size_t)kept * j->rb); }

static void job_fail(load_job *j, int rc, uint32_t layer)
{
    pthread_mutex_lock(&j->mu);
    if (!j->err) {
        j->err = rc;
        if (layer == UINT32_MAX)
            snprintf(j->detail, sizeof j->detail, "document '%s': %s", j->doc_id, kvz_error_detail());
        else
            snprintf(j->detail, sizeof j->detail, "document '%s' layer record %u: %s", j->doc_id, layer,
                     kvz_error_detail());
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

static void *load_worker(void *arg)
{
    load_job *j = arg;
    const kvz_blob_meta *bm = j->bm;
    const size_t hd = bm->head_dim;
    kvz_store_read *r = NULL;
    int rc = kvz_store_read_begin(j->st, &r);
    if (rc) {
        job_fail(j, rc, UINT32_MAX);
        return NULL;
    }
    /* CPU path buffers, sized for the largest layer */
    uint64_t maxk = 0;
    for (uint32_t l = 0; l < bm->n_layer; l++) {
        uint64_t k = kvz_blob_layer_kept(bm, l);
        maxk = k > maxk ? k : maxk;
    }
    uint8_t *kb = NULL, *vb = NULL;
    uint32_t *pu = NULL;
    float *kf = NULL, *vf = NULL;
    if (!j->gpu) {
        kb = malloc(maxk * j->rb + 1);
        vb = malloc(maxk * j->rb + 1);
        pu = malloc(maxk * 4 + 4);
        kf = malloc(maxk * hd * sizeof(float) + 4);
        vf = malloc(maxk * hd * sizeof(float) + 4);
        if (!kb || !vb || !pu || !kf || !vf) {
            job_fail(j, kvz_error_set(KVZ_ERR_NOMEM, "load buffers"), UINT32_MAX);
            goto out;
        }
    }
    for (;;) {
        pthread_mutex_lock(&j->mu);
        if (j->err || j->next >= bm->n_layer) {
            pthread_mutex_unlock(&j->mu);
            break;
        }
        const uint32_t l = j->next++;
        while (j->gpu && !j->err && j->freed + (uint32_t)j->nslot < l + 1) pthread_cond_wait(&j->cv, &j->mu);
        const int stop = j->err;
        pthread_mutex_unlock(&j->mu);
        if (stop) break;
        const uint8_t *rec;
        size_t len;
        const uint64_t kept = kvz_blob_layer_kept(bm, l);
        rc = kvz_store_read_layer(r, j->hash, l, &rec, &len);
        if (!rc && j->gpu) {
            uint8_t *s = j->slots[l % (uint32_t)j->nslot];
            const size_t vo = layer_voff(j, kept);
            rc = kvz_blob_decode_layer(bm, l, rec, len, (uint32_t *)(s + 2 * vo), s, s + vo);
        } else if (!rc) {
            rc = kvz_blob_decode_layer(bm, l, rec, len, pu, kb, vb);
            if (!rc) rc = kvz_kvrow_decode(bm->dtype, kb, kept, hd, kf);
            if (!rc) rc = kvz_kvrow_decode(bm->dtype, vb, kept, hd, vf);
            /* u32 positions < 2^30 (blob limit) are the same int32 values */
            if (!rc)
                rc = kvz_kv_set_layer(j->kv, (int32_t)l, bm->counts + (size_t)l * bm->n_kv_head, (const int32_t *)pu,
                                      kf, vf);
        }
        if (rc) {
            job_fail(j, rc, l);
            break;
        }
        pthread_mutex_lock(&j->mu);
        j->ready[l] = 1;
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
    }
out:
    kvz_store_read_end(r);
    free(kb); free(vb); free(pu); free(kf); free(vf);
    return NULL;
}

#ifdef KVZ_HAVE_CUDA
/* the calling thread: upload layers in order as the workers finish them */
static void upload_loop(load_job *j)
{
    const kvz_blob_meta *bm = j->bm;
    for (uint32_t l = 0; l < bm->n_layer; l++) {
        pthread_mutex_lock(&j->mu);
        while (!j->ready[l] && !j->err) pthread_cond_wait(&j->cv, &j->mu);
        const int stop = j->err;
        pthread_mutex_unlock(&j->mu);
        if (stop) return;
        const uint64_t kept = kvz_blob_layer_kept(bm, l);
        const size_t vo = layer_voff(j, kept);
        int rc = kvz_cuda_load_layer(j->kv, (int32_t)l, (int)(l % (uint32_t)j->nslot), bm->dtype,
                                     bm->counts + (size_t)l * bm->n_kv_head, 0, vo, 2 * vo,
                                     2 * vo + (size_t)kept * 4);
        if (!rc && l > 0) rc = kvz_cuda_load_wait(j->m, (int)((l - 1) % (uint32_t)j->nslot));
        if (rc) {
            job_fail(j, rc, l);
            return;
        }
        pthread_mutex_lock(&j->mu);
        j->freed = l; /* layers [0, l) uploaded: their slots are free */
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
    }
    int rc = kvz_cuda_load_finish(j->m);
    if (rc) job_fail(j, rc, UINT32_MAX);
}
#endif

int kvz_load_doc(kvz_model *m, kvz_store *st, const char *doc_id, int64_t extra_rows, int32_t out_slots,
                 const kvz_load_opts *o, kvz_kv **out, kvz_doc_meta *meta)
{
    const kvz_config *c = kvz_model_config(m);
    *out = NULL;
    memset(meta, 0, sizeof *meta);
    const double t0 = kvz_now();
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    kvz_blob_meta bm;
    memset(&bm, 0, sizeof bm);
    kvz_kv *kv = NULL;
    load_job j;
    memset(&j, 0, sizeof j);
    pthread_t th[64];
    int nth = 0;
    int rc;
    {
        kvz_store_read *r;
        if ((rc = kvz_store_read_begin(st, &r))) return rc;
        const uint8_t *rec;
        size_t len;
        rc = kvz_store_read_doc(r, doc_id, &meta->info);
        if (rc == KVZ_ERR_NOTFOUND) kvz_error_set(rc, "no document '%s' in the store", doc_id);
        if (!rc) rc = kvz_store_read_meta(r, meta->info.hash, &rec, &len);
        if (!rc) rc = kvz_blob_decode_meta(rec, len, fp, &bm);
        kvz_store_read_end(r);
        if (rc) return rc;
    }
    if (bm.n_layer != (uint32_t)c->n_layer || bm.n_kv_head != (uint32_t)c->n_kv_head ||
        bm.head_dim != (uint32_t)c->head_dim || bm.n_head != (uint32_t)c->n_head) {
        rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s': blob dims differ from the model's", doc_id);
        goto out;
    }
    j.rb = kvz_kv_row_bytes(bm.dtype, bm.head_dim);
    if (!j.rb) {
        rc = kvz_error_set(KVZ_ERR_UNSUPPORTED, "document '%s': stored KV dtype %u is unknown to this build",
                           doc_id, bm.dtype);
        goto out;
    }
    meta->n_prefix = (int32_t)bm.n_prefix;
    meta->n_ctx = (int32_t)bm.n_context;
    meta->ratio = bm.ratio;
    meta->dtype = bm.dtype;
    meta->mode = bm.mode;
    uint32_t max_rows = 0;
    uint64_t max_layer = 0;
    for (uint32_t l = 0; l < bm.n_layer; l++) {
        const uint64_t k = kvz_blob_layer_kept(&bm, l);
        meta->rows += k;
        if (k > max_layer) max_layer = k;
        for (uint32_t h = 0; h < bm.n_kv_head; h++)
            if (bm.counts[l * bm.n_kv_head + h] > max_rows) max_rows = bm.counts[l * bm.n_kv_head + h];
    }
    if ((rc = kvz_kv_create(m, (int64_t)max_rows + extra_rows, out_slots, &kv))) goto out;

    j.m = m;
    j.kv = kv;
    j.st = st;
    j.doc_id = doc_id;
    j.hash = meta->info.hash;
    j.bm = &bm;
    j.ready = calloc(bm.n_layer, 1);
    if (!j.ready) {
        rc = KVZ_ERR_NOMEM;
        goto out;
    }
    int want = kvz_load_threads(o);
    if ((uint32_t)want > bm.n_layer) want = (int)bm.n_layer;
#ifdef KVZ_HAVE_CUDA
    j.gpu = kvz_model_device(m) == KVZ_DEVICE_CUDA;
    if (j.gpu) {
        j.nslot = want + 2;
        if (j.nslot > KVZ_CUDA_LOAD_MAX_SLOTS) j.nslot = KVZ_CUDA_LOAD_MAX_SLOTS;
        if ((uint32_t)j.nslot > bm.n_layer) j.nslot = (int)bm.n_layer;
        if (want > j.nslot) want = j.nslot;
        const size_t vo = al256((size_t)max_layer * j.rb);
        if ((rc = kvz_cuda_load_slots(m, 2 * vo + (size_t)max_layer * 4, j.nslot, j.slots))) goto out;
    }
#endif
    pthread_mutex_init(&j.mu, NULL);
    pthread_cond_init(&j.cv, NULL);
    /* on the CPU the calling thread decodes too; on the GPU it uploads */
    const int spawn = j.gpu ? want : want - 1;
    for (int i = 0; i < spawn; i++) {
        if (pthread_create(&th[nth], NULL, load_worker, &j)) break;
        nth++;
    }
    if (j.gpu && nth == 0) {
        job_fail(&j, kvz_error_set(KVZ_ERR_NOMEM, "cannot start a decode thread"), UINT32_MAX);
    }
#ifdef KVZ_HAVE_CUDA
    if (j.gpu && nth) upload_loop(&j);
#endif
    if (!j.gpu) load_worker(&j);
    for (int i = 0; i < nth; i++) pthread_join(th[i], NULL);
#ifdef KVZ_HAVE_CUDA
    if (j.gpu && j.err) kvz_cuda_load_finish(m); /* nothing in flight reads the slots after this */
#endif
    pthread_mutex_destroy(&j.mu);
    pthread_cond_destroy(&j.cv);
    if (j.err) rc = kvz_error_set(j.err, "%s", j.detail);
out:
    free(j.ready);
    kvz_blob_meta_free(&bm);
    if (rc) {
        kvz_kv_free(kv);
        return rc;
    }
    meta->load_s = kvz_now() - t0;
    *out = kv;
    return 0;
}
