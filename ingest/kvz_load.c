/* The pipelined loader (kvz_load.h): store -> KV cache with a decode thread pool and,
 * on the CUDA backend, pinned staging slots uploaded while later layers decode. */
#include "kvz_load.h"
#include "kvz_load_rec.h"

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
#include "kvz_store.h"
#include "kvz_backend.h"
#include "kvz_xxh3_lanes.h" /* KVZ_XXH3L_MIN_LEN: the shortest record payload the device hashes */

#define MAX_THREADS 16
#define MAX_CUTS 8 /* pins a record may cross (64 MiB pieces: a record of ~448 MiB) */

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
    const kvz_backend *be; /* the model's: a device loader when be->load_slots (else the host writes the cache) */
    int gpu;
    int map_only;
    int direct;         /* GPU: codec-none records of the document uploaded straight from the map */
    int dev_verify;     /* direct: ... and verified on the device (checksum, rows), not by the workers */
    size_t direct_min;  /* ... when at least this long */
    int nslot;
    void *slots[KVZ_BACKEND_MAX_LOAD_SLOTS];
    kvz_load_sync sy;   /* lock, condition, first error */
    uint32_t next;      /* next entry of order[] to claim */
    uint32_t *order;    /* (n_layer) the claim order: zstd records (the slowest) first */
    int free_slot[KVZ_BACKEND_MAX_LOAD_SLOTS];  /* GPU: staging slots no layer holds (any layer takes any slot) */
    int nfree;
    int8_t *slot_of;    /* (n_layer) the slot layer l was decoded into */
    uint8_t *ready;     /* (n_layer) decoded */
    const uint8_t **src; /* (n_layer, direct) the verified record in the pinned map, else NULL */
    size_t (*cuts)[MAX_CUTS]; /* (n_layer, direct) where src[l] crosses into the next pin */
    int *n_cuts;
    uint8_t *on_dev;    /* (n_layer, dev_verify) record verified on the device */
    uint64_t *seed, *want; /* (n_layer, dev_verify) its checksum's seed and expected value */
    kvz_store_pinner pinner; /* (direct) the driver pins the map's pages for the store's life */
    kvz_load_profile prof; /* summed over the workers (sy.mu) */
    kvz_load_layer_time *trace; /* NULL or (n_layer) */
    double t0;          /* the load's start (trace) */
} load_job;

/* slot layout of layer l: the document's record at 0, the shared prefix's after it */
static kvz_load_at doc_at(const load_job *j, uint32_t l) { return kvz_load_place(0, kvz_blob_layer_kept(j->bm, l), j->rb); }
static kvz_load_at pre_at(const load_job *j, uint32_t l)
{
    return kvz_load_place(al256(doc_at(j, l).end), kvz_blob_layer_kept(j->pm, l), j->prb);
}
static size_t layer_bytes(const load_job *j, uint32_t l) { return j->pm ? pre_at(j, l).end : doc_at(j, l).end; }

static void job_fail(load_job *j, int rc, uint32_t layer) { kvz_load_sync_fail(&j->sy, rc, j->doc_id, layer); }

static void *load_worker(void *arg)
{
    load_job *j = arg;
    const kvz_blob_meta *bm = j->bm;
    const size_t hd = bm->head_dim;
    kvz_load_reader rd;
    kvz_load_profile *pf = &rd.pf;
    int rc = kvz_load_reader_begin(&rd, j->st, j->map_only);
    if (rc) {
        job_fail(j, rc, UINT32_MAX);
        return NULL;
    }
    /* CPU path buffers, sized for the largest layer */
    uint64_t maxk = 0;
    size_t maxrec = 0;
    for (uint32_t l = 0; l < bm->n_layer; l++) {
        uint64_t k = kvz_blob_layer_kept(bm, l);
        maxk = k > maxk ? k : maxk;
        maxrec = layer_bytes(j, l) > maxrec ? layer_bytes(j, l) : maxrec;
    }
    const uint32_t np = j->pm ? j->pm->n_prefix : 0, nkv = bm->n_kv_head;
    const uint64_t maxp = (uint64_t)np * nkv; /* prefix rows of a layer */
    uint8_t *buf = NULL; /* records, laid out as a GPU slot */
    float *kf = NULL, *vf = NULL, *pkf = NULL, *pvf = NULL, *ck = NULL, *cv = NULL;
    int32_t *cp = NULL;
    uint32_t cc[1024];
    if (!j->gpu) {
        buf = malloc(maxrec + 16);
        kf = malloc(maxk * hd * sizeof(float) + 4);
        vf = malloc(maxk * hd * sizeof(float) + 4);
        if (j->pm) {
            pkf = malloc(maxp * hd * sizeof(float) + 4);
            pvf = malloc(maxp * hd * sizeof(float) + 4);
            ck = malloc((maxk + maxp) * hd * sizeof(float) + 4);
            cv = malloc((maxk + maxp) * hd * sizeof(float) + 4);
            cp = malloc((maxk + maxp) * 4 + 4);
        }
        if (!buf || !kf || !vf || (j->pm && (!pkf || !pvf || !ck || !cv || !cp))) {
            job_fail(j, kvz_error_set(KVZ_ERR_NOMEM, "load buffers"), UINT32_MAX);
            goto out;
        }
    }
    for (;;) {
        pthread_mutex_lock(&j->sy.mu);
        if (j->sy.err || j->next >= bm->n_layer) {
            pthread_mutex_unlock(&j->sy.mu);
            break;
        }
        const uint32_t l = j->order[j->next++];
        const double tw = kvz_now();
        while (j->gpu && !j->sy.err && j->nfree == 0) pthread_cond_wait(&j->sy.cv, &j->sy.mu);
        pf->slot_wait_s += kvz_now() - tw;
        const int stop = j->sy.err;
        const int slot = j->gpu && !stop ? j->free_slot[--j->nfree] : -1;
        pthread_mutex_unlock(&j->sy.mu);
        if (stop) break;
        const kvz_load_profile before = rd.pf;
        if (j->trace) j->trace[l].claim_s = kvz_now() - j->t0;
        uint8_t *s = j->gpu ? j->slots[slot] : buf;
        const kvz_load_at da = doc_at(j, l);
        rc = KVZ_ERR_UNSUPPORTED;
        const uint8_t *spec = NULL; /* direct: the record in the pinned map, uploaded while it is verified */
        /* verified on the device: the checksum's long form needs more than 240 bytes */
        const int dev = j->dev_verify && da.len >= KVZ_BLOB_HEADER_SIZE + KVZ_XXH3L_MIN_LEN;
        if (j->direct && da.len >= j->direct_min) { /* no host copy */
            const uint8_t *rec;
            rc = dev ? kvz_load_record_head(&rd, bm, j->hash, l, da, &rec, &j->seed[l], &j->want[l])
                     : kvz_load_record_peek(&rd, l, j->hash, da, &rec);
            if (!rc) {
                const double t0 = kvz_now();
                if (kvz_store_pin(rd.r, rec, da.len, &j->pinner, j->cuts[l], MAX_CUTS, &j->n_cuts[l]))
                    rc = KVZ_ERR_UNSUPPORTED; /* over the budget, or the driver cannot pin: copy instead */
                else
                    spec = rec;
                pf->register_s += kvz_now() - t0;
            }
        }
        if (rc == KVZ_ERR_UNSUPPORTED) rc = kvz_load_record(&rd, bm, j->hash, 0, l, s, da);
        if (!rc && j->pm) rc = kvz_load_record(&rd, j->pm, j->pm_hash, 1, l, s, pre_at(j, l));
        if (!rc && spec) {
            /* the upload starts now; the record is verified meanwhile (checksum, q8/q4 rows,
             * header, positions; dev: header and positions were, the device does the rest,
             * compared in dev_results) and a failure fails the load, so its rows are never
             * used: the bytes cannot change while the load's read transaction is open */
            if (j->trace) j->trace[l].ready_s = kvz_now() - j->t0;
            pthread_mutex_lock(&j->sy.mu);
            j->src[l] = spec;
            if (dev) j->on_dev[l] = 1; /* header and positions checked; the device does the rest */
            j->slot_of[l] = (int8_t)slot;
            j->ready[l] = 1;
            pthread_cond_broadcast(&j->sy.cv);
            pthread_mutex_unlock(&j->sy.mu);
            const uint8_t *rec = spec;
            if (!dev) {
                rc = kvz_load_record_mapped(&rd, bm, j->hash, l, da, &rec);
            } else {
                rd.pf.records_direct++;
                rd.pf.records_dev_verified++;
                rd.pf.bytes += da.len;
            }
            if (rc == KVZ_ERR_UNSUPPORTED || (!rc && rec != spec))
                rc = kvz_error_set(KVZ_ERR_INTERNAL, "layer %u: the record changed in the map during the load", l);
        }
        if (!rc && !j->gpu) {
            const double t0 = kvz_now();
            const uint64_t kept = kvz_blob_layer_kept(bm, l);
            const uint32_t *pu = (const uint32_t *)(s + da.pos);
            rc = kvz_kvrow_decode(bm->dtype, s + da.k, kept, hd, kf);
            if (!rc) rc = kvz_kvrow_decode(bm->dtype, s + da.v, kept, hd, vf);
            const uint32_t *cnt = bm->counts + (size_t)l * nkv;
            /* u32 positions < 2^30 (blob limit) are the same int32 values */
            if (!rc && !j->pm) rc = kvz_kv_set_layer(j->kv, (int32_t)l, cnt, (const int32_t *)pu, kf, vf);
            if (!rc && j->pm) { /* each head: the shared prefix rows, then the document's */
                const kvz_load_at pa = pre_at(j, l);
                const uint64_t pk = kvz_blob_layer_kept(j->pm, l);
                const uint32_t *ppu = (const uint32_t *)(s + pa.pos);
                rc = kvz_kvrow_decode(j->pm->dtype, s + pa.k, pk, hd, pkf);
                if (!rc) rc = kvz_kvrow_decode(j->pm->dtype, s + pa.v, pk, hd, pvf);
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
            pf->convert_s += kvz_now() - t0;
        }
        if (rc) {
            job_fail(j, rc, l);
            break;
        }
        if (j->trace) {
            kvz_load_layer_time *tr = &j->trace[l];
            tr->checked_s = kvz_now() - j->t0;
            if (!spec) tr->ready_s = tr->checked_s;
            tr->bytes = rd.pf.bytes - before.bytes;
            tr->zstd_s = rd.pf.zstd_s - before.zstd_s;
            tr->raw = da.len + (j->pm ? pre_at(j, l).len : 0);
            tr->route = rd.pf.records_dev_verified > before.records_dev_verified ? 'g'
                      : rd.pf.records_direct > before.records_direct ? 'd'
                      : rd.pf.records_zstd > before.records_zstd   ? 'z'
                      : rd.pf.records_mapped > before.records_mapped ? 'm' : 'c';
        }
        if (spec) continue; /* published above */
        pthread_mutex_lock(&j->sy.mu);
        if (j->gpu) j->slot_of[l] = (int8_t)slot;
        j->ready[l] = 1;
        pthread_cond_broadcast(&j->sy.cv);
        pthread_mutex_unlock(&j->sy.mu);
    }
out:
    kvz_load_reader_end(&rd);
    free(buf); free(kf); free(vf);
    free(pkf); free(pvf); free(ck); free(cv); free(cp);
    pthread_mutex_lock(&j->sy.mu);
    kvz_load_profile_add(&j->prof, pf);
    pthread_mutex_unlock(&j->sy.mu);
    return NULL;
}

/* the device's verification of the records it hashed (after the upload): their
 * checksums and first bad q8/q4 rows back in one copy, compared as the host compares
 * them (kvz_blob_record_checksum, then the rows: the host route's order), so a damaged
 * record fails the load with the host route's error; the first layer that fails wins */
static void dev_results(load_job *j)
{
    const double t0 = kvz_now();
    const uint32_t L = j->bm->n_layer;
    uint64_t *got = malloc(2 * (size_t)L * sizeof *got);
    if (!got) {
        job_fail(j, kvz_error_set(KVZ_ERR_NOMEM, "load verification results"), UINT32_MAX);
        return;
    }
    int rc = j->be->load_verify_end(j->m, got, got + L);
    if (rc) job_fail(j, rc, UINT32_MAX);
    for (uint32_t l = 0; l < L && !rc; l++) {
        if (!j->on_dev[l]) continue;
        uint8_t hdr[KVZ_BLOB_HEADER_SIZE] = {0}; /* kvz_blob_record_checksum reads rec_xxh3 (bytes 48..55) */
        memcpy(hdr + 48, &j->want[l], 8);
        rc = kvz_blob_record_checksum(hdr, got[l]);
        if (!rc && got[L + l] != UINT64_MAX)
            rc = kvz_load_bad_rows(j->bm, l, kvz_blob_layer_kept(j->bm, l), got[L + l]);
        if (rc) job_fail(j, rc, l);
    }
    free(got);
    j->prof.dev_verify_s += kvz_now() - t0;
}

/* a decoded layer not uploaded yet (ready 1 -> 2 when taken), else UINT32_MAX; j->sy.mu held */
static uint32_t take_ready(load_job *j)
{
    for (uint32_t l = 0; l < j->bm->n_layer; l++)
        if (j->ready[l] == 1) {
            j->ready[l] = 2;
            return l;
        }
    return UINT32_MAX;
}

/* give slot @p s back once the device has read it; j->sy.mu not held */
static int release_slot(load_job *j, int s)
{
    int rc = j->be->load_wait(j->m, s);
    pthread_mutex_lock(&j->sy.mu);
    j->free_slot[j->nfree++] = s;
    pthread_cond_broadcast(&j->sy.cv);
    pthread_mutex_unlock(&j->sy.mu);
    return rc;
}

/* the calling thread: upload layers as the workers finish them, in any order (each
 * layer has its own part of the cache); a slot goes back to the workers as soon as
 * the device has copied it, so one slow layer (a big zstd record) holds one slot,
 * not the layers after it */
static void upload_loop(load_job *j)
{
    const kvz_blob_meta *bm = j->bm;
    int prev = -1; /* the slot uploaded last, not yet given back */
    int rc = 0;
    for (uint32_t done = 0; done < bm->n_layer && !rc; done++) {
        const double tw = kvz_now();
        pthread_mutex_lock(&j->sy.mu);
        uint32_t l = take_ready(j);
        if (l == UINT32_MAX && prev >= 0 && !j->sy.err) { /* nothing to send: give the last slot back first */
            pthread_mutex_unlock(&j->sy.mu);
            rc = release_slot(j, prev);
            prev = -1;
            pthread_mutex_lock(&j->sy.mu);
            l = take_ready(j);
        }
        while (l == UINT32_MAX && !j->sy.err && !rc) {
            pthread_cond_wait(&j->sy.cv, &j->sy.mu);
            l = take_ready(j);
        }
        const int stop = j->sy.err;
        const int slot = l == UINT32_MAX ? -1 : j->slot_of[l];
        pthread_mutex_unlock(&j->sy.mu);
        const double tu = kvz_now();
        j->prof.ready_wait_s += tu - tw; /* this thread only */
        if (stop || rc) break;
        if (j->trace) j->trace[l].take_s = tu - j->t0;
        const kvz_load_at da = doc_at(j, l);
        const uint32_t *cnt = bm->counts + (size_t)l * bm->n_kv_head;
        if (j->src && j->src[l]) { /* straight from the registered map (the record starts at da.x); the shared
                                    * prefix, if any, from its part of the slot first */
            int32_t r0 = 0;
            if (j->pm) {
                const kvz_load_at pa = pre_at(j, l);
                rc = j->be->load_layer_src(j->kv, (int32_t)l, slot, (uint8_t *)j->slots[slot] + pa.x, pa.len,
                                             j->pm->dtype, j->pm->counts + (size_t)l * bm->n_kv_head, 0,
                                             pa.k - pa.x, pa.v - pa.x, pa.pos - pa.x, NULL, 0);
                r0 = (int32_t)j->pm->n_prefix;
            }
            if (!rc && j->on_dev && j->on_dev[l]) /* + its checksum and rows on the device */
                rc = j->be->load_layer_verified(j->kv, (int32_t)l, slot, j->src[l], da.len, bm->dtype, cnt, r0,
                                                da.k - da.x, da.v - da.x, da.pos - da.x, j->cuts[l], j->n_cuts[l],
                                                (int)l, KVZ_BLOB_HEADER_SIZE, j->seed[l]);
            else if (!rc)
                rc = j->be->load_layer_src(j->kv, (int32_t)l, slot, j->src[l], da.len, bm->dtype, cnt, r0,
                                             da.k - da.x, da.v - da.x, da.pos - da.x, j->cuts[l], j->n_cuts[l]);
        } else if (j->pm) { /* the shared prefix first (rows 0..n_prefix-1 of every head); one copy of the slot */
            const kvz_load_at pa = pre_at(j, l);
            rc = j->be->load_layer(j->kv, (int32_t)l, slot, j->pm->dtype, j->pm->counts + (size_t)l * bm->n_kv_head,
                                     0, pa.k, pa.v, pa.pos, layer_bytes(j, l));
            if (!rc)
                rc = j->be->load_layer(j->kv, (int32_t)l, slot, bm->dtype, cnt, (int32_t)j->pm->n_prefix, da.k, da.v,
                                         da.pos, 0);
        } else {
            rc = j->be->load_layer(j->kv, (int32_t)l, slot, bm->dtype, cnt, 0, da.k, da.v, da.pos, layer_bytes(j, l));
        }
        if (j->trace) j->trace[l].upload_s = kvz_now() - j->t0;
        if (!rc && prev >= 0) rc = release_slot(j, prev);
        prev = slot;
        j->prof.upload_s += kvz_now() - tu;
        if (rc) job_fail(j, rc, l);
    }
    if (rc) job_fail(j, rc, UINT32_MAX); /* the first error wins: a layer's, when it was one */
    if (rc || j->sy.err) return;
    const double tu = kvz_now();
    rc = j->be->load_finish(j->m);
    j->prof.upload_s += kvz_now() - tu;
    if (rc) job_fail(j, rc, UINT32_MAX);
    if (!rc && j->dev_verify) dev_results(j);
}

/* KVZ_LOAD_GPU_VERIFY=0 in the environment keeps the direct route's verification on the host */
static int getenv_verify_on(void)
{
    const char *e = getenv("KVZ_LOAD_GPU_VERIFY");
    return !(e && e[0] == '0');
}

/* the claim order: records stored shorter than their codec-none layout (zstd: decoded
 * on the CPUs, the slowest) first, then the rest in layer order. Their lengths come from
 * the B-tree alone (a length that cannot match, so no page of a record is read); a
 * layer whose length cannot be had keeps its place (its worker reports the problem) */
static void claim_zstd_first(load_job *j, kvz_store_read *r)
{
    const uint32_t L = j->bm->n_layer;
    uint32_t n = 0;
    uint8_t *first = calloc(L, 1);
    for (uint32_t l = 0; first && l < L; l++) {
        const uint8_t *rec = NULL;
        size_t len = 0;
        const size_t cl = doc_at(j, l).len;
        if (kvz_store_map_peek(r, j->hash, l, cl + 1, &rec, &len, NULL, 0) == 0 && len && len < cl) {
            first[l] = 1;
            j->order[n++] = l;
        }
    }
    for (uint32_t l = 0; l < L; l++)
        if (!first || !first[l]) j->order[n++] = l;
    free(first);
}

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
    /* this read transaction stays open until the load is over: it is older than the
     * workers', so no writer reuses a page the device still reads (direct route) */
    kvz_store_read *r;
    if ((rc = kvz_store_read_begin(st, &r))) return rc;
    {
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
        if (rc) {
            kvz_store_read_end(r);
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
    j.t0 = t0;
    j.trace = o ? o->trace : NULL;
    if (j.trace) memset(j.trace, 0, bm.n_layer * sizeof *j.trace);
    j.doc_id = doc_id;
    j.hash = meta->info.hash;
    j.bm = &bm;
    j.ready = calloc(bm.n_layer, 1);
    j.slot_of = calloc(bm.n_layer, 1);
    j.order = calloc(bm.n_layer, sizeof *j.order);
    if (!j.ready || !j.slot_of || !j.order) {
        rc = KVZ_ERR_NOMEM;
        goto out;
    }
    for (uint32_t l = 0; l < bm.n_layer; l++) j.order[l] = l;
    int want = kvz_load_threads(o);
    if ((uint32_t)want > bm.n_layer) want = (int)bm.n_layer;
    j.be = kvz_model_backend(m);
    j.gpu = j.be->load_slots != NULL;
    /* CPU: the workers place rows in the cache, so it comes first. GPU: the workers only
     * fill pinned slots, so the device cache is allocated while they decode */
    j.map_only = o && o->map_only;
    double ta = kvz_now();
    if (!j.gpu && (rc = kvz_kv_create(m, (int64_t)max_rows + extra_rows, out_slots, &kv))) goto out;
    j.prof.alloc_s += kvz_now() - ta;
    j.kv = kv;
    if (j.gpu) {
        j.direct = !j.map_only && o && o->direct && j.be->host_register && j.be->load_layer_src;
        j.direct_min = o && o->direct_min ? o->direct_min : (size_t)64 << 10;
        if (j.direct) {
            j.src = calloc(bm.n_layer, sizeof *j.src);
            j.cuts = calloc(bm.n_layer, sizeof *j.cuts);
            j.n_cuts = calloc(bm.n_layer, sizeof *j.n_cuts);
            if (!j.src || !j.cuts || !j.n_cuts) {
                rc = KVZ_ERR_NOMEM;
                goto out;
            }
            const long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
            j.pinner.pin = j.be->host_register;
            j.pinner.unpin = j.be->host_unregister;
            j.pinner.budget = o->direct_budget ? o->direct_budget
                              : pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz / 4 : (uint64_t)1 << 30;
        }
        if (j.direct && j.be->load_verify_begin && !(o && o->host_verify) && getenv_verify_on()) {
            j.on_dev = calloc(bm.n_layer, 1);
            j.seed = calloc(bm.n_layer, sizeof *j.seed);
            j.want = calloc(bm.n_layer, sizeof *j.want);
            uint64_t *hashed = calloc(bm.n_layer, sizeof *hashed);
            if (!j.on_dev || !j.seed || !j.want || !hashed) {
                free(hashed);
                rc = KVZ_ERR_NOMEM;
                goto out;
            }
            for (uint32_t l = 0; l < bm.n_layer; l++) { /* the payload of each codec-none record */
                const size_t n = doc_at(&j, l).len - KVZ_BLOB_HEADER_SIZE;
                hashed[l] = n >= KVZ_XXH3L_MIN_LEN ? n : 0;
            }
            rc = j.be->load_verify_begin(m, (int)bm.n_layer, hashed);
            free(hashed);
            if (rc) goto out;
            j.dev_verify = 1;
        }
        if (j.direct) claim_zstd_first(&j, r);
        j.nslot = kvz_load_plan_slots(&want, bm.n_layer, j.be->load_max_slots);
        /* + 16: a direct record is shifted so that its K rows land 16-byte aligned */
        const double tsl = kvz_now();
        rc = j.be->load_slots(m, max_bytes + 16, j.nslot, j.slots);
        j.prof.slots_s += kvz_now() - tsl;
        if (rc || (o && o->staging_only)) goto out; /* staging_only: *out stays NULL */
        for (int i = 0; i < j.nslot; i++) j.free_slot[j.nfree++] = i;
    }
    kvz_load_sync_init(&j.sy);
    /* on the CPU the calling thread decodes too; on the GPU it uploads */
    nth = kvz_load_spawn(th, j.gpu ? want : want - 1, load_worker, &j);
    if (j.gpu && nth == 0) {
        job_fail(&j, kvz_error_set(KVZ_ERR_NOMEM, "cannot start a decode thread"), UINT32_MAX);
    } else if (j.gpu) {
        ta = kvz_now();
        if ((rc = kvz_kv_create(m, (int64_t)max_rows + extra_rows, out_slots, &kv))) job_fail(&j, rc, UINT32_MAX);
        j.prof.alloc_s += kvz_now() - ta;
        j.kv = kv; /* read by the upload loop only (this thread) */
        rc = 0;
    }
    if (j.gpu && nth) upload_loop(&j);
    if (!j.gpu) load_worker(&j);
    kvz_load_join(th, nth);
    if (j.gpu && j.sy.err) j.be->load_finish(m); /* nothing in flight reads the slots after this */
    kvz_load_sync_destroy(&j.sy);
    if (j.sy.err) rc = kvz_error_set(j.sy.err, "%s", j.sy.detail);
out:
    kvz_store_read_end(r);
    free(j.ready);
    free(j.slot_of);
    free(j.order);
    free(j.on_dev);
    free(j.seed);
    free(j.want);
    free(j.src);
    free(j.cuts);
    free(j.n_cuts);
    kvz_blob_meta_free(&bm);
    kvz_blob_meta_free(&pm);
    if (rc) {
        kvz_kv_free(kv);
        return rc;
    }
    meta->load_s = kvz_now() - t0;
    if (o && o->profile) {
        j.prof.total_s = meta->load_s;
        *o->profile = j.prof;
    }
    *out = kv;
    return 0;
}
