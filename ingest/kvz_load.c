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

#define MAX_THREADS 16

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
    const kvz_blob_meta *pm; /* shared system prefix (policy SHARED), else NULL */
    const uint8_t *pm_hash;  /* its content hash (bm->prefix_ref) */
    size_t rb;          /* stored bytes of one row */
    size_t prb;         /* the prefix blob's */
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

/* per-layer slot layout: the document's K at 0, V at voff, positions at 2 * voff; with a
 * shared prefix, the prefix blob's K, V, positions after them (from layer_poff) */
static size_t layer_voff(const load_job *j, uint64_t kept) { return al256((size_t)kept * j->rb); }
static size_t layer_poff(const load_job *j, uint64_t kept) { return 2 * layer_voff(j, kept) + al256((size_t)kept * 4); }
static size_t pre_voff(const load_job *j, uint64_t pk) { return al256((size_t)pk * j->prb); }
static size_t layer_bytes(const load_job *j, uint32_t l)
{
    const uint64_t kept = kvz_blob_layer_kept(j->bm, l);
    if (!j->pm) return 2 * layer_voff(j, kept) + (size_t)kept * 4;
    const uint64_t pk = kvz_blob_layer_kept(j->pm, l);
    return layer_poff(j, kept) + 2 * pre_voff(j, pk) + (size_t)pk * 4;
}

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
    const uint32_t np = j->pm ? j->pm->n_prefix : 0, nkv = bm->n_kv_head;
    const uint64_t maxp = (uint64_t)np * nkv; /* prefix rows of a layer */
    uint8_t *kb = NULL, *vb = NULL, *pkb = NULL, *pvb = NULL;
    uint32_t *pu = NULL, *ppu = NULL;
    float *kf = NULL, *vf = NULL, *pkf = NULL, *pvf = NULL, *ck = NULL, *cv = NULL;
    int32_t *cp = NULL;
    uint32_t cc[1024];
    if (!j->gpu) {
        kb = malloc(maxk * j->rb + 1);
        vb = malloc(maxk * j->rb + 1);
        pu = malloc(maxk * 4 + 4);
        kf = malloc(maxk * hd * sizeof(float) + 4);
        vf = malloc(maxk * hd * sizeof(float) + 4);
        if (j->pm) {
            pkb = malloc(maxp * j->prb + 1);
            pvb = malloc(maxp * j->prb + 1);
            ppu = malloc(maxp * 4 + 4);
            pkf = malloc(maxp * hd * sizeof(float) + 4);
            pvf = malloc(maxp * hd * sizeof(float) + 4);
            ck = malloc((maxk + maxp) * hd * sizeof(float) + 4);
            cv = malloc((maxk + maxp) * hd * sizeof(float) + 4);
            cp = malloc((maxk + maxp) * 4 + 4);
        }
        if (!kb || !vb || !pu || !kf || !vf ||
            (j->pm && (!pkb || !pvb || !ppu || !pkf || !pvf || !ck || !cv || !cp))) {
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
        const uint8_t *prec = NULL;
        size_t plen = 0;
        if (!rc && j->pm && (rc = kvz_store_read_prefix(r, j->pm_hash, l, &prec, &plen)) == KVZ_ERR_NOTFOUND)
            rc = kvz_error_set(KVZ_ERR_FORMAT, "its shared prefix blob has no layer %u", l);
        const uint64_t pk = j->pm ? kvz_blob_layer_kept(j->pm, l) : 0;
        if (!rc && j->gpu) {
            uint8_t *s = j->slots[l % (uint32_t)j->nslot];
            const size_t vo = layer_voff(j, kept);
            rc = kvz_blob_decode_layer(bm, l, rec, len, (uint32_t *)(s + 2 * vo), s, s + vo);
            if (!rc && j->pm) {
                uint8_t *p = s + layer_poff(j, kept);
                const size_t pvo = pre_voff(j, pk);
                rc = kvz_blob_decode_layer(j->pm, l, prec, plen, (uint32_t *)(p + 2 * pvo), p, p + pvo);
            }
        } else if (!rc) {
            rc = kvz_blob_decode_layer(bm, l, rec, len, pu, kb, vb);
            if (!rc) rc = kvz_kvrow_decode(bm->dtype, kb, kept, hd, kf);
            if (!rc) rc = kvz_kvrow_decode(bm->dtype, vb, kept, hd, vf);
            const uint32_t *cnt = bm->counts + (size_t)l * nkv;
            /* u32 positions < 2^30 (blob limit) are the same int32 values */
            if (!rc && !j->pm) rc = kvz_kv_set_layer(j->kv, (int32_t)l, cnt, (const int32_t *)pu, kf, vf);
            if (!rc && j->pm) { /* each head: the shared prefix rows, then the document's */
                rc = kvz_blob_decode_layer(j->pm, l, prec, plen, ppu, pkb, pvb);
                if (!rc) rc = kvz_kvrow_decode(j->pm->dtype, pkb, pk, hd, pkf);
                if (!rc) rc = kvz_kvrow_decode(j->pm->dtype, pvb, pk, hd, pvf);
                size_t o = 0, od = 0;
                for (uint32_t h = 0; h < nkv && !rc; h++) {
                    memcpy(ck + o * hd, pkf + (size_t)h * np * hd, (size_t)np * hd * sizeof(float));
                    memcpy(cv + o * hd, pvf + (size_t)h * np * hd, (size_t)np * hd * sizeof(float));
                    for (uint32_t i = 0; i < np; i++) cp[o + i] = (int32_t)ppu[(size_t)h * np + i];
                    o += np;
                    memcpy(ck + o * hd, kf + od * hd, (size_t)cnt[h] * hd * sizeof(float));
                    memcpy(cv + o * hd, vf + od * hd, (size_t)cnt[h] * hd * sizeof(float));
                    for (uint32_t i = 0; i < cnt[h]; i++) cp[o + i] = (int32_t)pu[od + i];
                    o += cnt[h];
                    od += cnt[h];
                    cc[h] = np + cnt[h];
                }
                if (!rc) rc = kvz_kv_set_layer(j->kv, (int32_t)l, cc, cp, ck, cv);
            }
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
    free(pkb); free(pvb); free(ppu); free(pkf); free(pvf); free(ck); free(cv); free(cp);
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
        const int slot = (int)(l % (uint32_t)j->nslot);
        int rc = 0, row0 = 0;
        if (j->pm) { /* the shared prefix first (rows 0..n_prefix-1 of every head); one copy of the slot */
            const uint64_t pk = kvz_blob_layer_kept(j->pm, l);
            const size_t po = layer_poff(j, kept), pvo = pre_voff(j, pk);
            rc = kvz_cuda_load_layer(j->kv, (int32_t)l, slot, j->pm->dtype, j->pm->counts + (size_t)l * bm->n_kv_head,
                                     0, po, po + pvo, po + 2 * pvo, layer_bytes(j, l));
            row0 = (int)j->pm->n_prefix;
        }
        if (!rc)
            rc = kvz_cuda_load_layer(j->kv, (int32_t)l, slot, bm->dtype, bm->counts + (size_t)l * bm->n_kv_head,
                                     row0, 0, vo, 2 * vo, j->pm ? 0 : layer_bytes(j, l));
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
    kvz_blob_meta bm, pm;
    memset(&bm, 0, sizeof bm);
    memset(&pm, 0, sizeof pm);
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
        if (!rc && (rc = kvz_store_read_meta(r, meta->info.hash, &rec, &len)) == 0)
            rc = kvz_blob_decode_meta(rec, len, fp, &bm);
        if (rc && rc != KVZ_ERR_NOTFOUND) {
            char d[400];
            snprintf(d, sizeof d, "%s", kvz_error_detail());
            kvz_error_set(rc, "document '%s' META record: %s", doc_id, d);
        } else if (rc == KVZ_ERR_NOTFOUND && meta->info.n_records) {
            rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s': its META record is missing", doc_id);
        }
        if (!rc && bm.prefix_policy == KVZ_PREFIX_SHARED) { /* the system prefix, stored once */
            rc = kvz_store_read_prefix(r, bm.prefix_ref, KVZ_BLOB_META_LAYER, &rec, &len);
            if (rc == KVZ_ERR_NOTFOUND)
                rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s': its shared prefix blob is not in the store", doc_id);
            else if (!rc)
                rc = kvz_blob_decode_meta(rec, len, fp, &pm);
            int bad = !rc && (pm.n_layer != bm.n_layer || pm.n_kv_head != bm.n_kv_head || pm.head_dim != bm.head_dim ||
                              pm.n_head != bm.n_head || pm.n_context != 0 || pm.prefix_policy != KVZ_PREFIX_KEEP ||
                              pm.n_prefix != bm.n_prefix);
            for (uint32_t i = 0; !rc && !bad && i < pm.n_layer * pm.n_kv_head; i++) bad = pm.counts[i] != pm.n_prefix;
            if (bad)
                rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s': its shared prefix blob does not hold the %u-token "
                                   "prefix of this model's shape", doc_id, bm.n_prefix);
        }
        kvz_store_read_end(r);
        if (rc) {
            kvz_blob_meta_free(&bm);
            kvz_blob_meta_free(&pm);
            return rc;
        }
    }
    if (bm.n_layer != (uint32_t)c->n_layer || bm.n_kv_head != (uint32_t)c->n_kv_head ||
        bm.head_dim != (uint32_t)c->head_dim || bm.n_head != (uint32_t)c->n_head) {
        rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s': blob dims differ from the model's", doc_id);
        goto out;
    }
    j.rb = kvz_kv_row_bytes(bm.dtype, bm.head_dim);
    if (bm.prefix_policy == KVZ_PREFIX_SHARED) {
        j.pm = &pm;
        j.pm_hash = bm.prefix_ref;
        j.prb = kvz_kv_row_bytes(pm.dtype, pm.head_dim);
    }
    if (!j.rb || (j.pm && !j.prb)) {
        rc = kvz_error_set(KVZ_ERR_UNSUPPORTED, "document '%s': stored KV dtype %u is unknown to this build",
                           doc_id, j.rb ? pm.dtype : bm.dtype);
        goto out;
    }
    if (bm.n_kv_head > 1024) {
        rc = kvz_error_set(KVZ_ERR_FORMAT, "document '%s': %u KV heads", doc_id, bm.n_kv_head);
        goto out;
    }
    meta->n_prefix = (int32_t)bm.n_prefix;
    meta->n_ctx = (int32_t)bm.n_context;
    meta->ratio = bm.ratio;
    meta->dtype = bm.dtype;
    meta->mode = bm.mode;
    uint32_t max_rows = 0;
    size_t max_bytes = 0;
    const uint32_t np = j.pm ? pm.n_prefix : 0;
    j.bm = &bm;
    for (uint32_t l = 0; l < bm.n_layer; l++) {
        meta->rows += kvz_blob_layer_kept(&bm, l) + (uint64_t)np * bm.n_kv_head;
        const size_t lb = layer_bytes(&j, l);
        if (lb > max_bytes) max_bytes = lb;
        for (uint32_t h = 0; h < bm.n_kv_head; h++)
            if (bm.counts[l * bm.n_kv_head + h] + np > max_rows) max_rows = bm.counts[l * bm.n_kv_head + h] + np;
    }
    j.m = m;
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
#endif
    /* CPU: the workers place rows in the cache, so it comes first. GPU: the workers only
     * fill pinned slots, so the device cache is allocated while they decode */
    if (!j.gpu && (rc = kvz_kv_create(m, (int64_t)max_rows + extra_rows, out_slots, &kv))) goto out;
    j.kv = kv;
#ifdef KVZ_HAVE_CUDA
    if (j.gpu) {
        j.nslot = want + 2;
        if (j.nslot > KVZ_CUDA_LOAD_MAX_SLOTS) j.nslot = KVZ_CUDA_LOAD_MAX_SLOTS;
        if ((uint32_t)j.nslot > bm.n_layer) j.nslot = (int)bm.n_layer;
        if (want > j.nslot) want = j.nslot;
        if ((rc = kvz_cuda_load_slots(m, max_bytes, j.nslot, j.slots))) goto out;
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
    } else if (j.gpu) {
        if ((rc = kvz_kv_create(m, (int64_t)max_rows + extra_rows, out_slots, &kv))) job_fail(&j, rc, UINT32_MAX);
        j.kv = kv; /* read by the upload loop only (this thread) */
        rc = 0;
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
    kvz_blob_meta_free(&pm);
    if (rc) {
        kvz_kv_free(kv);
        return rc;
    }
    meta->load_s = kvz_now() - t0;
    *out = kv;
    return 0;
}
