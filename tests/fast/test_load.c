/* The pipelined loader (ingest/kvz_load.h) and the document cache against independent
 * truth, on a real LMDB store holding hand-made blobs (synthetic tiny-llama shape):
 *   - every stored type (f32, f16, bf16, q8, q4): the loaded cache holds exactly the
 *     rows kvz_kvrow_decode gives (CPU), with 1 and 3 decode threads, and equals
 *     what the old one-thread loader (kvz_doc_load) gives;
 *   - a document stored with a SHARED system prefix (blob v2: the prefix in a blob of
 *     its own) loads to the same cache as the same document stored with the prefix
 *     kept (KEEP);
 *   - errors: unknown id, a SHARED document whose prefix blob is missing (one line,
 *     KVZ_ERR_FORMAT naming the document);
 *   - the composition (kvz_docs_load) reads records with the same routine: three
 *     documents per stored type, KEEP and SHARED prefix, parallel and sequential,
 *     1 and 3 workers, through the copy route and the map route (map_only), against
 *     the documents' rows (prefix once, positions moved, keys re-rotated) and each
 *     other bit for bit; a byte flipped in data.mdb is KVZ_ERR_CHECKSUM naming the
 *     document and the record;
 *   - the document cache: a second get is a hit and hands back the same rows; a
 *     re-ingested id (new content hash) is not served from the cache; budget 0 keeps
 *     nothing.
 * On a CUDA build with a usable GPU the same documents are also loaded with
 * --device cuda and compared with the CPU cache rounded to bf16 (bit for bit); there
 * the direct route (records uploaded from the pinned map) verifies its records on the
 * device (checksum kernels, row check in the load kernel), and a bad q8 scale and a
 * byte flipped in data.mdb must fail it as they fail the host-verified direct route,
 * the copy route and the map route (same error codes and messages). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvz_test.h"

#include "kvz_blob.h"
#include "kvz_compose.h"
#include "kvz_doc_cache.h"
#include "kvz_error.h"
#include "kvz_ingest.h"
#include "kvz_kvrow.h"
#include "kvz_load.h"
#include "kvz_load_rec.h"
#include "kvz_model.h"
#include "kvz_quant.h"
#include "kvz_rope_shift.h"
#include "kvz_store.h"
#include <lmdb.h>
#include <xxhash.h>

#define NP 5   /* system-prefix tokens */
#define NC 60  /* context tokens */

/* a pinner that records what it is asked (kvz_store_pin's bookkeeping, on any device) */
typedef struct { uintptr_t lo, hi; int live; } pin_rec;
static pin_rec g_pins[256];
static int g_npin;
static int rec_pin(const void *p, size_t n, void **h)
{
    if (g_npin >= 256) return KVZ_ERR_NOMEM;
    g_pins[g_npin] = (pin_rec){(uintptr_t)p, (uintptr_t)p + n, 1};
    *h = &g_pins[g_npin++];
    return 0;
}
static void rec_unpin(void *h) { ((pin_rec *)h)->live = 0; }
static int pins_live(void)
{
    int n = 0;
    for (int i = 0; i < g_npin; i++) n += g_pins[i].live;
    return n;
}

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static double rnd(void)
{
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) / 9007199254740992.0;
}

typedef struct doc {
    uint32_t *counts;  /* (L, H) incl. prefix */
    uint32_t **pos;    /* per layer, flat head-major */
    uint8_t **k, **v;  /* per layer, stored rows */
} doc;

/* a random document: per head NP prefix rows (positions 0..NP-1) + a random subset of
 * the context, rows random in [-2, 2) encoded to dtype */
static void make_doc(doc *d, int L, int H, int hd, int dtype)
{
    const size_t rb = kvz_kv_row_bytes(dtype, (size_t)hd);
    d->counts = calloc((size_t)L * H, sizeof *d->counts);
    d->pos = calloc((size_t)L, sizeof *d->pos);
    d->k = calloc((size_t)L, sizeof *d->k);
    d->v = calloc((size_t)L, sizeof *d->v);
    float *x = malloc(sizeof(float) * (size_t)hd);
    for (int l = 0; l < L; l++) {
        d->pos[l] = malloc(sizeof(uint32_t) * (size_t)H * (NP + NC));
        d->k[l] = malloc(rb * (size_t)H * (NP + NC));
        d->v[l] = malloc(rb * (size_t)H * (NP + NC));
        size_t row = 0;
        for (int h = 0; h < H; h++) {
            uint32_t c = 0;
            for (int p = 0; p < NP + NC; p++) {
                if (p >= NP && rnd() > 0.4) continue;
                d->pos[l][row] = (uint32_t)p;
                for (int w = 0; w < 2; w++) {
                    for (int e = 0; e < hd; e++) x[e] = (float)(4 * rnd() - 2);
                    kvz_kvrow_encode(dtype, x, 1, (size_t)hd, (w ? d->v[l] : d->k[l]) + row * rb);
                }
                row++;
                c++;
            }
            d->counts[l * H + h] = c;
        }
    }
    free(x);
}

static void free_doc(doc *d, int L)
{
    for (int l = 0; l < L; l++) { free(d->pos[l]); free(d->k[l]); free(d->v[l]); }
    free(d->pos); free(d->k); free(d->v); free(d->counts);
}

static void meta_of(const kvz_model *m, int dtype, uint8_t policy, uint32_t np, uint32_t nc, uint32_t *counts,
                    kvz_blob_meta *bm)
{
    const kvz_config *c = kvz_model_config(m);
    memset(bm, 0, sizeof *bm);
    kvz_model_fingerprint(m, bm->fingerprint);
    bm->n_layer = (uint32_t)c->n_layer;
    bm->n_head = (uint32_t)c->n_head;
    bm->n_kv_head = (uint32_t)c->n_kv_head;
    bm->head_dim = (uint32_t)c->head_dim;
    bm->dtype = (uint8_t)dtype;
    bm->mode = KVZ_MODE_GLOBAL;
    bm->prefix_policy = policy;
    bm->ratio = 0.5f;
    bm->chunk = 2000;
    bm->overlap = 8;
    bm->n_prefix = np;
    bm->n_context = nc;
    bm->counts = counts;
}

/* encode the records of one blob: layer l's rows are those of d's heads, all (sel 0),
 * the prefix rows only (sel 1) or the context rows only (sel 2); caller frees */
static int enc_blob(kvz_blob_meta *bm, const doc *d, int sel, uint8_t **mrec, size_t *mlen, kvz_store_rec **out)
{
    const int L = (int)bm->n_layer, H = (int)bm->n_kv_head, hd = (int)bm->head_dim;
    const size_t rb = kvz_kv_row_bytes(bm->dtype, (size_t)hd);
    uint32_t *cnt = calloc((size_t)L * H, sizeof *cnt);
    for (int i = 0; i < L * H; i++) cnt[i] = sel == 0 ? d->counts[i] : sel == 1 ? NP : d->counts[i] - NP;
    bm->counts = cnt;
    int rc = kvz_blob_encode_meta(bm, 0, mrec, mlen);
    kvz_store_rec *recs = calloc((size_t)L, sizeof *recs);
    uint32_t *pos = malloc(sizeof(uint32_t) * (size_t)H * (NP + NC));
    uint8_t *k = malloc(rb * (size_t)H * (NP + NC)), *v = malloc(rb * (size_t)H * (NP + NC));
    for (int l = 0; l < L && !rc; l++) {
        size_t src = 0, dst = 0;
        for (int h = 0; h < H; h++)
            for (uint32_t r = 0; r < d->counts[l * H + h]; r++, src++) {
                const int pre = r < NP;
                if ((sel == 1 && !pre) || (sel == 2 && pre)) continue;
                pos[dst] = d->pos[l][src];
                memcpy(k + dst * rb, d->k[l] + src * rb, rb);
                memcpy(v + dst * rb, d->v[l] + src * rb, rb);
                dst++;
            }
        uint8_t *rec;
        size_t len;
        rc = kvz_blob_encode_layer(bm, (uint32_t)l, pos, k, v, 0, &rec, &len);
        recs[l].data = rec;
        recs[l].len = len;
    }
    free(pos); free(k); free(v); free(cnt);
    bm->counts = NULL;
    *out = recs;
    return rc;
}

static void free_recs(kvz_store_rec *r, uint8_t *m, int L)
{
    for (int l = 0; l < L; l++) free((void *)r[l].data);
    free(r);
    free(m);
}

/* one blob under @p id: KEEP (sel 0) with kvz_store_put_doc, or SHARED (sel 2) with its
 * prefix blob @p pm (sel 1) through kvz_store_put_doc_shared */
static int put_blob(kvz_store *st, const char *id, const uint8_t hash[16], kvz_blob_meta *bm, const doc *d, int sel,
                    kvz_blob_meta *pm, const uint8_t phash[16])
{
    const int L = (int)bm->n_layer;
    kvz_store_doc_info info;
    memset(&info, 0, sizeof info);
    info.n_tokens = bm->n_prefix + bm->n_context;
    info.ratio = bm->ratio;
    uint8_t *m = NULL, *pmr = NULL;
    size_t ml = 0, pml = 0;
    kvz_store_rec *recs = NULL, *precs = NULL;
    int rc = enc_blob(bm, d, sel, &m, &ml, &recs);
    if (!rc && pm) rc = enc_blob(pm, d, 1, &pmr, &pml, &precs);
    kvz_store_rec mr = {m, ml}, pr = {pmr, pml};
    if (!rc && !pm) rc = kvz_store_put_doc(st, id, hash, &info, &mr, recs, (uint32_t)L, NULL);
    if (!rc && pm) rc = kvz_store_put_doc_shared(st, id, hash, &info, &mr, recs, (uint32_t)L, phash, &pr, precs, NULL, NULL);
    free_recs(recs, m, L);
    if (precs) free_recs(precs, pmr, L);
    return rc;
}

/* the cache holds exactly d's rows (decoded on the CPU; bf16-rounded when bf != 0) */
static long diff_cache(const kvz_kv *kv, const doc *d, int L, int H, int hd, int dtype, int bf)
{
    const size_t rb = kvz_kv_row_bytes(dtype, (size_t)hd);
    float *want = malloc(sizeof(float) * (size_t)hd), *gk = malloc(sizeof(float) * (size_t)(NP + NC) * hd);
    float *gv = malloc(sizeof(float) * (size_t)(NP + NC) * hd);
    int32_t *gp = malloc(sizeof(int32_t) * (NP + NC));
    long bad = 0;
    for (int l = 0; l < L; l++) {
        size_t src = 0;
        for (int h = 0; h < H; h++) {
            const uint32_t c = d->counts[l * H + h];
            if (kvz_kv_len(kv, l, h) != (int64_t)c) { bad++; src += c; continue; }
            if (kvz_kv_get_head(kv, l, h, gk, gv, gp)) { bad++; src += c; continue; }
            for (uint32_t r = 0; r < c; r++, src++) {
                bad += gp[r] != (int32_t)d->pos[l][src];
                for (int w = 0; w < 2; w++) {
                    kvz_kvrow_decode(dtype, (w ? d->v[l] : d->k[l]) + src * rb, 1, (size_t)hd, want);
                    const float *got = (w ? gv : gk) + (size_t)r * hd;
                    for (int e = 0; e < hd; e++) {
                        const float x = bf ? kvz_bf16_to_fp32(kvz_fp32_to_bf16(want[e])) : want[e];
                        bad += memcmp(&x, &got[e], 4) != 0;
                    }
                }
            }
        }
    }
    free(want); free(gk); free(gv); free(gp);
    return bad;
}

/* XOR @p x into the middle payload byte of every copy of record @p rec in data.mdb
 * (LMDB can leave stale copies of pages in the file): how many copies */
static int flip_in_store(const char *dir, const uint8_t *rec, size_t len, uint8_t x)
{
    char path[96];
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    FILE *f = fopen(path, "r+b");
    if (!f) return 0;
    fseek(f, 0, SEEK_END);
    const long fsz = ftell(f);
    uint8_t *all = malloc((size_t)fsz);
    int n = 0;
    if (all && fseek(f, 0, SEEK_SET) == 0 && fread(all, 1, (size_t)fsz, f) == (size_t)fsz)
        for (long i = 0; i + (long)len <= fsz; i++)
            if (!memcmp(all + i, rec, len)) {
                const long at = i + 56 + (long)(len - 56) / 2;
                uint8_t b = all[at] ^ x;
                fseek(f, at, SEEK_SET);
                n += fwrite(&b, 1, 1, f) == 1;
            }
    fclose(f);
    free(all);
    return n;
}


/* ------------------------------------------------------------ composition (kvz_docs_load) */

/* give @p d the system-prefix rows of @p base (the same prefix, as ingest stores it) */
static void share_prefix(doc *d, const doc *base, int L, int H, size_t rb)
{
    for (int l = 0; l < L; l++) {
        size_t rd = 0, rs = 0;
        for (int h = 0; h < H; h++) {
            memcpy(d->k[l] + rd * rb, base->k[l] + rs * rb, NP * rb);
            memcpy(d->v[l] + rd * rb, base->v[l] + rs * rb, NP * rb);
            rd += d->counts[l * H + h];
            rs += base->counts[l * H + h];
        }
    }
}

/* The composed cache against independent truth: head h of layer l holds docs[0]'s NP
 * prefix rows, then every document's context rows in order; context positions moved by
 * d * NC when @p seq (keys re-rotated by the same Δ: kvz_rope_shift on the decoded row),
 * kept when not. bf: rows rounded to bf16 (the CUDA cache; moved keys, re-rotated on
 * the device after the rounding, within a tolerance). Returns mismatching values. */
static long diff_composed(const kvz_model *m, const kvz_kv *kv, doc *const *docs, int nd, int L, int H, int hd,
                          int dtype, int seq, int bf)
{
    const size_t rb = kvz_kv_row_bytes(dtype, (size_t)hd);
    const size_t cap = (size_t)nd * (NP + NC);
    float *want = malloc(sizeof(float) * (size_t)hd), *gk = malloc(sizeof(float) * cap * hd);
    float *gv = malloc(sizeof(float) * cap * hd);
    int32_t *gp = malloc(sizeof(int32_t) * cap);
    long bad = 0;
    for (int l = 0; l < L; l++) {
        size_t start[16] = {0}; /* each document's first row of head h */
        for (int h = 0; h < H; h++) {
            int64_t n = 0;
            for (int d = 0; d < nd; d++) n += docs[d]->counts[l * H + h] - (d ? NP : 0);
            if (kvz_kv_len(kv, l, h) != n || kvz_kv_get_head(kv, l, h, gk, gv, gp)) {
                bad++;
            } else {
                int64_t r = 0;
                for (int d = 0; d < nd; d++) {
                    const uint32_t c = docs[d]->counts[l * H + h];
                    for (uint32_t i = d ? NP : 0; i < c; i++, r++) {
                        const size_t src = start[d] + i;
                        const uint32_t p = docs[d]->pos[l][src];
                        const int32_t dl = seq && p >= NP ? d * NC : 0;
                        bad += gp[r] != (int32_t)p + dl;
                        for (int w = 0; w < 2; w++) {
                            kvz_kvrow_decode(dtype, (w ? docs[d]->v[l] : docs[d]->k[l]) + src * rb, 1, (size_t)hd,
                                             want);
                            if (!w && dl) kvz_rope_shift(m, want, 1, dl);
                            const float *got = (w ? gv : gk) + (size_t)r * hd;
                            /* the device re-rotates the bf16 keys in HBM (rounded before and after):
                             * within 2^-5 of the row's largest value (the roundings are < 2^-6); a
                             * position off by one moves pair 0 by 1 radian */
                            float tol = 0;
                            for (int e = 0; bf && !w && dl && e < hd; e++)
                                tol = fabsf(want[e]) > tol ? fabsf(want[e]) : tol;
                            tol /= 32;
                            for (int e = 0; e < hd; e++) {
                                const float x = bf ? kvz_bf16_to_fp32(kvz_fp32_to_bf16(want[e])) : want[e];
                                bad += tol > 0 ? !(fabsf(x - got[e]) <= tol) : memcmp(&x, &got[e], 4) != 0;
                            }
                        }
                    }
                }
            }
            for (int d = 0; d < nd; d++) start[d] += docs[d]->counts[l * H + h];
        }
    }
    free(want); free(gk); free(gv); free(gp);
    return bad;
}

/* values (K, V, positions, lengths) that differ between two composed caches */
static long diff_kv(const kvz_kv *a, const kvz_kv *b, int L, int H, int hd, size_t cap)
{
    float *ak = malloc(sizeof(float) * cap * hd), *av = malloc(sizeof(float) * cap * hd);
    float *bk = malloc(sizeof(float) * cap * hd), *bv = malloc(sizeof(float) * cap * hd);
    int32_t *ap = malloc(sizeof(int32_t) * cap), *bp = malloc(sizeof(int32_t) * cap);
    long bad = 0;
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++) {
            const int64_t n = kvz_kv_len(a, l, h);
            if (n != kvz_kv_len(b, l, h) || n > (int64_t)cap || kvz_kv_get_head(a, l, h, ak, av, ap) ||
                kvz_kv_get_head(b, l, h, bk, bv, bp)) {
                bad++;
                continue;
            }
            bad += memcmp(ak, bk, sizeof(float) * (size_t)n * hd) != 0;
            bad += memcmp(av, bv, sizeof(float) * (size_t)n * hd) != 0;
            bad += memcmp(ap, bp, sizeof(int32_t) * (size_t)n) != 0;
        }
    free(ak); free(av); free(bk); free(bv); free(ap); free(bp);
    return bad;
}

/* Three documents per stored type, once with the prefix kept in each (KEEP) and once
 * with it in a shared blob (SHARED), composed through the copy route and through the
 * map (map_only): both equal the truth above and each other bit for bit, with 1 and 3
 * workers; the profile shows which route read how many records. Then a byte flipped
 * inside a record in data.mdb: the composition refuses it with KVZ_ERR_CHECKSUM naming
 * the document and the record, on both routes. */
static int compose_tests(kvz_model *m, kvz_store *st, const char *dir, int device)
{
    const char *dev = device == KVZ_DEVICE_CPU ? "cpu" : "cuda";
    const kvz_config *c = kvz_model_config(m);
    const int L = c->n_layer, H = c->n_kv_head, hd = c->head_dim, bf = device != KVZ_DEVICE_CPU;
    const size_t cap = 3 * (NP + NC);
    for (int dt = KVZ_KV_F32; dt <= KVZ_KV_Q4; dt++) {
        const size_t rb = kvz_kv_row_bytes(dt, (size_t)hd);
        doc d[3];
        doc *dp[3] = {&d[0], &d[1], &d[2]};
        for (int i = 0; i < 3; i++) {
            make_doc(&d[i], L, H, hd, dt);
            if (i) share_prefix(&d[i], &d[0], L, H, rb);
        }
        char idk[3][32], ids[3][32];
        const char *kid[3], *sid[3];
        const uint8_t hp[16] = {7, 0, (uint8_t)dt, (uint8_t)device};
        for (int i = 0; i < 3; i++) {
            snprintf(idk[i], sizeof idk[i], "ck%d-%d", dt, i);
            snprintf(ids[i], sizeof ids[i], "cs%d-%d", dt, i);
            kid[i] = idk[i];
            sid[i] = ids[i];
            const uint8_t hk[16] = {7, 1, (uint8_t)dt, (uint8_t)device, (uint8_t)i},
                          hs[16] = {7, 2, (uint8_t)dt, (uint8_t)device, (uint8_t)i};
            kvz_blob_meta bm, pm;
            meta_of(m, dt, KVZ_PREFIX_KEEP, NP, NC, NULL, &bm);
            CHECKF(put_blob(st, idk[i], hk, &bm, &d[i], 0, NULL, NULL) == 0, "%s put %s: %s", dev, idk[i],
                   kvz_error_detail());
            meta_of(m, dt, KVZ_PREFIX_KEEP, NP, 0, NULL, &pm);
            meta_of(m, dt, KVZ_PREFIX_SHARED, NP, NC, NULL, &bm);
            memcpy(bm.prefix_ref, hp, 16);
            CHECKF(put_blob(st, ids[i], hs, &bm, &d[i], 2, &pm, hp) == 0, "%s put %s: %s", dev, ids[i],
                   kvz_error_detail());
        }
        for (int shared = 0; shared < 2; shared++)
            for (int seq = 0; seq < 2; seq++) {
                kvz_kv *kv[2] = {NULL, NULL};
                for (int mo = 0; mo < 2; mo++)
                    for (int t = 1; t <= 3; t += 2) {
                        kvz_compose_opts co;
                        kvz_compose_defaults(&co);
                        kvz_load_profile pf;
                        co.placement = seq ? KVZ_PLACE_SEQUENTIAL : KVZ_PLACE_PARALLEL;
                        co.threads = t;
                        co.map_only = mo;
                        co.profile = &pf;
                        kvz_compose_meta cm;
                        kvz_kv *k = NULL;
                        int rc = kvz_docs_load(m, st, shared ? sid : kid, 3, &co, 4, 0, &k, &cm, NULL);
                        CHECKF(rc == 0, "%s compose %s dtype %d: %s", dev, shared ? "shared" : "keep", dt,
                               kvz_error_detail());
                        if (rc) continue;
                        const long bad = diff_composed(m, k, dp, 3, L, H, hd, dt, seq, bf);
                        const uint64_t nrec = (uint64_t)L * (shared ? 4 : 3);
                        printf("  %s compose %s %-5s %-10s %s route, %d worker(s): %ld mismatches; records %llu copied, "
                               "%llu zstd, %llu mapped\n", dev, kvz_kv_dtype_name(dt), shared ? "SHARED" : "KEEP",
                               seq ? "sequential" : "parallel", mo ? "map " : "copy", t, bad,
                               (unsigned long long)pf.records_copied, (unsigned long long)pf.records_zstd,
                               (unsigned long long)pf.records_mapped);
                        CHECKF(bad == 0, "%s compose dtype %d: %ld values differ from the truth", dev, dt, bad);
                        CHECK(cm.n_docs == 3 && cm.q_pos == NP + (seq ? 3 : 1) * NC);
                        if (mo) CHECK(pf.records_mapped == nrec && pf.records_copied + pf.records_zstd == 0);
                        else CHECK(pf.records_mapped == 0 && pf.records_copied + pf.records_zstd == nrec);
                        if (t == 3) {
                            kv[mo] = k; /* the copy route vs the map route, 3 workers each */
                            continue;
                        }
                        kvz_kv_free(k);
                    }
                if (kv[0] && kv[1]) {
                    const long nd = diff_kv(kv[0], kv[1], L, H, hd, cap);
                    CHECKF(nd == 0, "%s compose dtype %d: copy and map routes differ in %ld heads", dev, dt, nd);
                }
                kvz_kv_free(kv[0]);
                kvz_kv_free(kv[1]);
            }
        for (int i = 0; i < 3; i++) free_doc(&d[i], L);
    }
    /* a byte flipped in data.mdb inside layer 0 of the second document */
    doc a, b;
    make_doc(&a, L, H, hd, KVZ_KV_Q8);
    make_doc(&b, L, H, hd, KVZ_KV_Q8);
    share_prefix(&b, &a, L, H, kvz_kv_row_bytes(KVZ_KV_Q8, (size_t)hd));
    kvz_blob_meta bm;
    const uint8_t ha[16] = {7, 8, 1, (uint8_t)device}, hb[16] = {7, 8, 2, (uint8_t)device};
    meta_of(m, KVZ_KV_Q8, KVZ_PREFIX_KEEP, NP, NC, NULL, &bm);
    CHECK(put_blob(st, "cflip-a", ha, &bm, &a, 0, NULL, NULL) == 0);
    meta_of(m, KVZ_KV_Q8, KVZ_PREFIX_KEEP, NP, NC, NULL, &bm);
    CHECK(put_blob(st, "cflip-b", hb, &bm, &b, 0, NULL, NULL) == 0);
    uint8_t *mr = NULL;
    size_t ml = 0;
    kvz_store_rec *recs = NULL;
    meta_of(m, KVZ_KV_Q8, KVZ_PREFIX_KEEP, NP, NC, NULL, &bm);
    REQUIRE(enc_blob(&bm, &b, 0, &mr, &ml, &recs) == 0);
    const char *fid[2] = {"cflip-a", "cflip-b"};
    for (int mo = 0; mo < 2; mo++) { /* intact first: both routes compose it */
        kvz_compose_opts co;
        kvz_compose_defaults(&co);
        co.map_only = mo;
        kvz_compose_meta cm;
        kvz_kv *kv = NULL;
        CHECKF(kvz_docs_load(m, st, fid, 2, &co, 0, 0, &kv, &cm, NULL) == 0, "%s cflip intact: %s", dev,
               kvz_error_detail());
        kvz_kv_free(kv);
    }
    const int nf = flip_in_store(dir, recs[0].data, recs[0].len, 0x10);
    CHECKF(nf >= 1, "%s: layer 0 record of cflip-b not found in data.mdb", dev);
    for (int mo = 0; mo < 2 && nf; mo++)
        for (int t = 1; t <= 3; t += 2) {
            kvz_compose_opts co;
            kvz_compose_defaults(&co);
            co.map_only = mo;
            co.threads = t;
            kvz_compose_meta cm;
            kvz_kv *kv = NULL;
            const int rc = kvz_docs_load(m, st, fid, 2, &co, 0, 0, &kv, &cm, NULL);
            printf("  %s compose, byte flipped in data.mdb (%s route, %d worker(s)): %s (%s)\n", dev,
                   mo ? "map" : "copy", t, kvz_strerror(rc), kvz_error_detail());
            CHECK(rc == KVZ_ERR_CHECKSUM && kv == NULL && cm.n_docs == 0 &&
                  strstr(kvz_error_detail(), "document 'cflip-b' layer record 0: "));
        }
    free_recs(recs, mr, L);
    free_doc(&a, L);
    free_doc(&b, L);
    return 0;
}

static int run(int device)
{
    kvz_model_opts mo = {.device = device, .n_threads = 2};
    kvz_model *m;
    if (kvz_model_synthetic("tiny-llama", &mo, &m)) {
        CHECKF(device != KVZ_DEVICE_CPU, "tiny-llama on the CPU: %s", kvz_error_detail());
        return 0;
    }
    const char *dev = device == KVZ_DEVICE_CPU ? "cpu" : "cuda";
    const kvz_config *c = kvz_model_config(m);
    const int L = c->n_layer, H = c->n_kv_head, hd = c->head_dim;
    char dir[] = "/tmp/kvz_test_load_XXXXXX";
    REQUIRE(mkdtemp(dir));
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    kvz_store *st;
    REQUIRE(kvz_store_open(dir, KVZ_STORE_CREATE, 0, fp, &st) == 0);
    for (int dt = KVZ_KV_F32; dt <= KVZ_KV_Q4; dt++) {
        doc d;
        make_doc(&d, L, H, hd, dt);
        uint8_t hk[16] = {1, (uint8_t)dt, (uint8_t)device}, hp[16] = {2, (uint8_t)dt, (uint8_t)device},
                hs[16] = {3, (uint8_t)dt, (uint8_t)device};
        char idk[32], idp[32], ids[32];
        snprintf(idk, sizeof idk, "keep-%d", dt);
        snprintf(idp, sizeof idp, "prefix-%d", dt);
        snprintf(ids, sizeof ids, "shared-%d", dt);
        (void)idp;
        kvz_blob_meta bm, pm;
        meta_of(m, dt, KVZ_PREFIX_KEEP, NP, NC, NULL, &bm);
        CHECKF(put_blob(st, idk, hk, &bm, &d, 0, NULL, NULL) == 0, "%s put keep-%d: %s", dev, dt, kvz_error_detail());
        meta_of(m, dt, KVZ_PREFIX_KEEP, NP, 0, NULL, &pm); /* the prefix blob: n_context 0, KEEP */
        meta_of(m, dt, KVZ_PREFIX_SHARED, NP, NC, NULL, &bm);
        memcpy(bm.prefix_ref, hp, 16);
        CHECKF(put_blob(st, ids, hs, &bm, &d, 2, &pm, hp) == 0, "%s put shared-%d: %s", dev, dt, kvz_error_detail());
        const int bf = device != KVZ_DEVICE_CPU;
        for (int t = 1, nd = 0; t <= 3; nd = !nd, t += 2 * !nd) { /* CUDA: uploads from the map, then copied */
            if (nd && !bf) continue;
            kvz_load_profile pf;
            kvz_load_opts lo = {.threads = t, .direct_min = 1, .direct = !nd, .profile = &pf};
            const char *ids2[2] = {idk, ids};
            for (int w = 0; w < 2; w++) {
                kvz_kv *kv;
                kvz_doc_meta dm;
                int rc = kvz_load_doc(m, st, ids2[w], 16, 0, &lo, &kv, &dm);
                CHECKF(rc == 0, "%s load %s: %s", dev, ids2[w], kvz_error_detail());
                if (rc) continue;
                long bad = diff_cache(kv, &d, L, H, hd, dt, bf);
                printf("  %s %-9s %d thread(s): %ld mismatches, %llu rows, n_prefix %d; records %llu straight from "
                       "the map, %llu copied, %llu zstd\n", dev, ids2[w], t, bad, (unsigned long long)dm.rows,
                       dm.n_prefix, (unsigned long long)pf.records_direct, (unsigned long long)pf.records_copied,
                       (unsigned long long)pf.records_zstd);
                CHECKF(bad == 0 && dm.n_prefix == NP && dm.n_ctx == NC, "%s %s: %ld mismatches", dev, ids2[w], bad);
                kvz_kv_free(kv);
            }
        }
        if (dt <= KVZ_KV_BF16 || device == KVZ_DEVICE_CPU) { /* the old loader agrees (v1-era types; CPU q8/q4 too) */
            kvz_kv *kv;
            kvz_doc_meta dm;
            int rc = kvz_doc_load(m, st, idk, 16, 0, &kv, &dm);
            CHECKF(rc == 0, "%s kvz_doc_load %s: %s", dev, idk, kvz_error_detail());
            if (!rc) {
                CHECKF(diff_cache(kv, &d, L, H, hd, dt, bf) == 0, "%s kvz_doc_load differs", dev);
                kvz_kv_free(kv);
            }
        }
        free_doc(&d, L);
    }
    /* errors: unknown id; a shared prefix that is gone */
    kvz_kv *kv = NULL;
    kvz_doc_meta dm;
    CHECK(kvz_load_doc(m, st, "nope", 0, 0, NULL, &kv, &dm) == KVZ_ERR_NOTFOUND && kv == NULL);
    CHECK(strstr(kvz_error_detail(), "no document 'nope'") != NULL);
    { /* a SHARED blob naming a prefix the store lacks is refused (so no load ever meets one) */
        doc d;
        make_doc(&d, L, H, hd, KVZ_KV_F16);
        kvz_blob_meta bm;
        meta_of(m, KVZ_KV_F16, KVZ_PREFIX_SHARED, NP, NC, NULL, &bm);
        const uint8_t hx[16] = {9, 9, 9}, hq[16] = {8, 8, 8};
        memcpy(bm.prefix_ref, hq, 16);
        uint8_t *mr = NULL;
        size_t ml = 0;
        kvz_store_rec *recs = NULL;
        int rc = enc_blob(&bm, &d, 2, &mr, &ml, &recs);
        kvz_store_doc_info info;
        memset(&info, 0, sizeof info);
        kvz_store_rec mrec = {mr, ml};
        if (!rc) rc = kvz_store_put_doc_shared(st, "orphan", hx, &info, &mrec, recs, (uint32_t)L, hq, NULL, NULL, NULL, NULL);
        printf("  %s SHARED blob without its prefix: %s (%s)\n", dev, kvz_strerror(rc), kvz_error_detail());
        CHECK(rc == KVZ_ERR_NOTFOUND);
        CHECK(kvz_load_doc(m, st, "orphan", 0, 0, NULL, &kv, &dm) == KVZ_ERR_NOTFOUND && kv == NULL);
        free_recs(recs, mr, L);
        free_doc(&d, L);
    }

    { /* the copy route: codec-none records are copied with pread() and hashed once
       * (profile counts), the map route gives the same cache; a resealed bad q8 scale
       * and a byte flipped in data.mdb are still refused */
        doc d;
        make_doc(&d, L, H, hd, KVZ_KV_Q8);
        kvz_blob_meta bm;
        meta_of(m, KVZ_KV_Q8, KVZ_PREFIX_KEEP, NP, NC, NULL, &bm);
        const uint8_t h1[16] = {5, 1, (uint8_t)device}, h2[16] = {5, 2, (uint8_t)device};
        CHECK(put_blob(st, "q8-copy", h1, &bm, &d, 0, NULL, NULL) == 0);
        kvz_load_profile pf;
        /* routes: 0 direct (CUDA: from the registered map for every record: direct_min 1, the
         * records verified on the device; the CPU copies), 1 through the map, 2 (CUDA) the copy
         * route (the default), 3 (CUDA) direct with every record verified on the host */
        const int nroute = device == KVZ_DEVICE_CPU ? 2 : 4;
        static const char *route_name[4] = {"direct", "map", "copy", "direct, host-verified"};
        for (int mo2 = 0; mo2 < nroute; mo2++) {
            kvz_load_opts lo = {.threads = 2, .profile = &pf, .map_only = mo2 == 1, .direct = mo2 == 0 || mo2 == 3,
                                .direct_min = 1, .host_verify = mo2 == 3};
            int rc = kvz_load_doc(m, st, "q8-copy", 0, 0, &lo, &kv, &dm);
            CHECKF(rc == 0, "%s q8-copy: %s", dev, kvz_error_detail());
            if (rc) continue;
            long bad = diff_cache(kv, &d, L, H, hd, KVZ_KV_Q8, device != KVZ_DEVICE_CPU);
            printf("  %s q8 %s route: %llu records straight from the map (%llu verified on the device), %llu copied, "
                   "%llu through the map, %ld mismatches\n", dev, route_name[mo2], (unsigned long long)pf.records_direct,
                   (unsigned long long)pf.records_dev_verified, (unsigned long long)pf.records_copied,
                   (unsigned long long)pf.records_mapped, bad);
            CHECK(bad == 0 && pf.records_copied + pf.records_direct == (mo2 == 1 ? 0u : (uint64_t)L) &&
                  pf.records_mapped == (mo2 == 1 ? (uint64_t)L : 0u));
            /* the direct route on CUDA: records of their own pages take it (a record sharing a page with
             * another is registered once only; the rest are copied) */
            const int direct = (mo2 == 0 || mo2 == 3) && device != KVZ_DEVICE_CPU;
            if (direct) CHECK(pf.records_direct >= 1);
            else CHECK(pf.records_direct == 0);
            /* the GPU-verified direct route ran (its records over 240 payload bytes), and only there */
            if (direct && mo2 == 0) CHECK(pf.records_dev_verified >= 1 && pf.records_dev_verified <= pf.records_direct);
            else CHECK(pf.records_dev_verified == 0);
            kvz_kv_free(kv);
        }
        /* layer 1, K row 0: a NaN scale, both checksums fixed (the store takes it) */
        uint8_t *mr = NULL;
        size_t ml = 0;
        kvz_store_rec *recs = NULL;
        meta_of(m, KVZ_KV_Q8, KVZ_PREFIX_KEEP, NP, NC, NULL, &bm);
        REQUIRE(enc_blob(&bm, &d, 0, &mr, &ml, &recs) == 0);
        { /* the direct route's read (any device): each record verified where it lies in the map is the
           * record that was stored, byte for byte */
            kvz_load_reader rd;
            REQUIRE(kvz_load_reader_begin(&rd, st, 0) == 0);
            const size_t rbq = kvz_kv_row_bytes(KVZ_KV_Q8, (size_t)hd);
            bm.counts = d.counts; /* q8-copy's counts (enc_blob gives its copy back) */
            int same = 0;
            for (int l = 0; l < L; l++) {
                const uint8_t *rec = NULL;
                const kvz_load_at at = kvz_load_place(0, kvz_blob_layer_kept(&bm, (uint32_t)l), rbq);
                const int rc = kvz_load_record_mapped(&rd, &bm, h1, (uint32_t)l, at, &rec);
                CHECKF(rc == 0 && rec, "%s layer %d in the map: %s", dev, l, kvz_error_detail());
                same += rc == 0 && rec && at.len == recs[l].len && !memcmp(rec, recs[l].data, at.len);
            }
            printf("  %s q8 records verified in the map: %d of %d equal the stored bytes\n", dev, same, L);
            CHECK(same == L && rd.pf.records_direct == (uint64_t)L);
            { /* the direct route's first step: found by its header, nothing verified; the same place */
                int found = 0, other = 0;
                for (int l = 0; l < L; l++) {
                    const uint8_t *rec = NULL, *pk = NULL;
                    const kvz_load_at at = kvz_load_place(0, kvz_blob_layer_kept(&bm, (uint32_t)l), rbq);
                    found += kvz_load_record_peek(&rd, (uint32_t)l, h1, at, &pk) == 0 &&
                             kvz_load_record_mapped(&rd, &bm, h1, (uint32_t)l, at, &rec) == 0 && pk == rec;
                    kvz_load_at wrong = at;
                    wrong.len++; /* not the record's length: the other routes */
                    other += kvz_load_record_peek(&rd, (uint32_t)l, h1, wrong, &pk) == KVZ_ERR_UNSUPPORTED && !pk;
                    uint8_t hdr[KVZ_BLOB_HEADER_SIZE];
                    memcpy(hdr, recs[l].data, sizeof hdr);
                    other += kvz_blob_header_codec(hdr) == KVZ_BLOB_CODEC_NONE;
                    hdr[0] ^= 1; /* bad magic */
                    other += kvz_blob_header_codec(hdr) == -1;
                }
                printf("  %s records found by their header in the map: %d of %d at the verified place\n", dev, found, L);
                CHECK(found == L && other == 3 * L);
            }
            if (device == KVZ_DEVICE_CPU) { /* kvz_store_pin's bookkeeping with a recording pinner */
                kvz_store_pinner pn = {rec_pin, rec_unpin, (uint64_t)1 << 40};
                int ok = 1;
                for (int l = 0; l < L; l++) {
                    const uint8_t *rec = NULL;
                    size_t len = 0;
                    const kvz_load_at at = kvz_load_place(0, kvz_blob_layer_kept(&bm, (uint32_t)l), rbq);
                    ok &= kvz_store_map_layer(rd.r, h1, (uint32_t)l, at.len, &rec, &len, NULL, NULL) == KVZ_ERR_ARG;
                    const int g0 = g_npin;
                    ok &= kvz_load_record_mapped(&rd, &bm, h1, (uint32_t)l, at, &rec) == 0;
                    size_t cuts[8];
                    int ncut = -1;
                    const int prc = kvz_store_pin(rd.r, rec, at.len, &pn, cuts, 8, &ncut);
                    ok &= ncut == 0; /* a small file: one pin */
                    CHECKF(prc == 0, "kvz_store_pin: %s", kvz_error_detail());
                    ok &= prc == 0;
                    ok &= kvz_store_pin(rd.r, rec, at.len, &pn, NULL, 0, NULL) == 0 && (l > 0 || g_npin > g0); /* again: no new pin */
                    int covered = 0; /* the record lies in one pinned range, or across adjacent ones */
                    for (int i = 0; i < g_npin; i++)
                        covered |= g_pins[i].live && g_pins[i].lo <= (uintptr_t)rec && (uintptr_t)rec + at.len <= g_pins[i].hi;
                    ok &= covered || g_npin > 1;
                }
                const int n1 = g_npin;
                uint64_t sum = 0;
                for (int i = 0; i < g_npin; i++) {
                    sum += g_pins[i].hi - g_pins[i].lo;
                    for (int k2 = 0; k2 < i; k2++) /* never overlapping */
                        ok &= g_pins[i].hi <= g_pins[k2].lo || g_pins[k2].hi <= g_pins[i].lo;
                    ok &= (g_pins[i].lo & 4095) == 0 && (g_pins[i].hi & 4095) == 0;
                }
                ok &= sum == kvz_store_pinned_bytes(st) && n1 >= 1;
                printf("  %s kvz_store_pin: %d pinned range(s), %llu bytes, every record inside: %s\n", dev, n1,
                       (unsigned long long)sum, ok ? "yes" : "NO");
                CHECK(ok);
            }
            kvz_load_reader_end(&rd);
            bm.counts = NULL;
        }
        uint32_t kept1 = 0;
        for (int h = 0; h < H; h++) kept1 += d.counts[H + h];
        uint8_t *r1 = (uint8_t *)recs[1].data;
        const size_t n1 = recs[1].len;
        REQUIRE(r1[7] == KVZ_BLOB_CODEC_NONE);
        r1[56 + 4 * kept1] = 0x00;
        r1[57 + 4 * kept1] = 0x7e;
        uint64_t ph = XXH3_64bits(r1 + 56, n1 - 56);
        memcpy(r1 + 40, &ph, 8);
        uint64_t rh = XXH3_64bits_withSeed(r1 + 56, n1 - 56, XXH3_64bits(r1, 48));
        memcpy(r1 + 48, &rh, 8);
        kvz_store_doc_info info;
        memset(&info, 0, sizeof info);
        kvz_store_rec mrec = {mr, ml};
        CHECK(kvz_store_put_doc(st, "q8-badscale", h2, &info, &mrec, recs, (uint32_t)L, NULL) == 0);
        for (int mo2 = 0; mo2 < nroute; mo2++) {
            kvz_load_opts lo = {.threads = 2, .map_only = mo2 == 1, .direct = mo2 == 0 || mo2 == 3, .direct_min = 1,
                                .host_verify = mo2 == 3};
            kv = NULL;
            int rc = kvz_load_doc(m, st, "q8-badscale", 0, 0, &lo, &kv, &dm);
            printf("  %s q8 bad scale (%s route): %s (%s)\n", dev, route_name[mo2], kvz_strerror(rc),
                   kvz_error_detail());
            CHECK(rc == KVZ_ERR_FORMAT && kv == NULL && strstr(kvz_error_detail(), "layer 1 K row 0: bad q8 scale"));
        }
        /* one payload byte of layer 0 flipped in data.mdb itself (a codec-none record,
         * then a zstd one: a q8 document whose rows all repeat row 0) */
        doc z;
        make_doc(&z, L, H, hd, KVZ_KV_Q8);
        const size_t rbq = kvz_kv_row_bytes(KVZ_KV_Q8, (size_t)hd);
        for (int l = 0; l < L; l++)
            for (size_t i = 1; i < (size_t)H * (NP + NC); i++) {
                memcpy(z.k[l] + i * rbq, z.k[l], rbq);
                memcpy(z.v[l] + i * rbq, z.k[l], rbq);
            }
        const uint8_t h3[16] = {5, 3, (uint8_t)device};
        meta_of(m, KVZ_KV_Q8, KVZ_PREFIX_KEEP, NP, NC, NULL, &bm);
        CHECK(put_blob(st, "q8-zstd", h3, &bm, &z, 0, NULL, NULL) == 0);
        {
            kvz_load_opts lo = {.threads = 2, .profile = &pf};
            int rc = kvz_load_doc(m, st, "q8-zstd", 0, 0, &lo, &kv, &dm);
            CHECKF(rc == 0, "%s q8-zstd: %s", dev, kvz_error_detail());
            if (!rc) {
                long bad = diff_cache(kv, &z, L, H, hd, KVZ_KV_Q8, device != KVZ_DEVICE_CPU);
                printf("  %s q8 zstd records: %llu copied, %llu zstd, %llu through the map, %ld mismatches\n", dev,
                       (unsigned long long)pf.records_copied, (unsigned long long)pf.records_zstd,
                       (unsigned long long)pf.records_mapped, bad);
                CHECK(bad == 0 && pf.records_zstd == (uint64_t)L && pf.records_copied == 0 && pf.records_mapped == 0);
                kvz_kv_free(kv);
            }
        }
        uint8_t *zm = NULL;
        size_t zml = 0;
        kvz_store_rec *zrecs = NULL;
        meta_of(m, KVZ_KV_Q8, KVZ_PREFIX_KEEP, NP, NC, NULL, &bm);
        REQUIRE(enc_blob(&bm, &z, 0, &zm, &zml, &zrecs) == 0);
        CHECK(zrecs[0].data[7] == KVZ_BLOB_CODEC_ZSTD);
        const char *fid[2] = {"q8-copy", "q8-zstd"};
        const kvz_store_rec *frec[2] = {&recs[0], &zrecs[0]};
        for (int w = 0; w < 2; w++) {
            const int nf = flip_in_store(dir, frec[w]->data, frec[w]->len, 0x10);
            CHECKF(nf >= 1, "%s: layer 0 record of %s not found in data.mdb", dev, fid[w]);
            for (int mo2 = 0; mo2 < nroute && nf; mo2++) {
                kvz_load_opts lo = {.threads = 2, .map_only = mo2 == 1, .direct = mo2 == 0 || mo2 == 3,
                                    .direct_min = 1, .host_verify = mo2 == 3};
                kv = NULL;
                int rc = kvz_load_doc(m, st, fid[w], 0, 0, &lo, &kv, &dm);
                printf("  %s %s: byte flipped in data.mdb (%d copies; %s route): %s (%s)\n", dev, fid[w], nf,
                       route_name[mo2], kvz_strerror(rc), kvz_error_detail());
                CHECK(rc == KVZ_ERR_CHECKSUM && kv == NULL && strstr(kvz_error_detail(), "layer record 0"));
            }
            if (w == 0 && nf) { /* the direct route's read refuses it too */
                kvz_load_reader rd;
                REQUIRE(kvz_load_reader_begin(&rd, st, 0) == 0);
                kvz_blob_meta fm; /* q8-copy's meta: its counts are d's */
                meta_of(m, KVZ_KV_Q8, KVZ_PREFIX_KEEP, NP, NC, d.counts, &fm);
                const uint8_t *rec = NULL;
                const kvz_load_at at = kvz_load_place(0, kvz_blob_layer_kept(&fm, 0),
                                                      kvz_kv_row_bytes(KVZ_KV_Q8, (size_t)hd));
                const uint8_t *pk = NULL;
                CHECK(kvz_load_record_peek(&rd, 0, h1, at, &pk) == 0 && pk); /* found: the header is intact */
                int rc = kvz_load_record_mapped(&rd, &fm, h1, 0, at, &rec);
                printf("  %s q8-copy: byte flipped, read in the map: %s (%s)\n", dev, kvz_strerror(rc), kvz_error_detail());
                CHECK(rc == KVZ_ERR_CHECKSUM && rec == NULL);
                kvz_load_reader_end(&rd);
            }
        }
        free_recs(zrecs, zm, L);
        free_doc(&z, L);
        free_recs(recs, mr, L);
        free_doc(&d, L);
    }

    compose_tests(m, st, dir, device);

    /* the document cache */
    kvz_doc_cache *dc;
    REQUIRE(kvz_doc_cache_create(m, (uint64_t)1 << 30, NULL, &dc) == 0);
    int hit = -1;
    kvz_kv *a = NULL, *b = NULL;
    CHECK(kvz_doc_cache_get(dc, st, "keep-1", 8, 0, &a, &dm, &hit) == 0 && hit == 0);
    CHECK(kvz_doc_cache_get(dc, st, "keep-1", 8, 0, &b, &dm, &hit) == 0 && hit == 0 && b != a); /* a is lent */
    CHECK(kvz_doc_cache_put(dc, b) == 0);
    CHECK(kvz_doc_cache_put(dc, a) == 0);
    CHECK(kvz_doc_cache_put(dc, a) == KVZ_ERR_ARG); /* not lent any more */
    kvz_kv *c1 = NULL;
    CHECK(kvz_doc_cache_get(dc, st, "keep-1", 8, 0, &c1, &dm, &hit) == 0 && hit == 1);
    CHECK(c1 == a || c1 == b);
    CHECK(kvz_doc_cache_put(dc, c1) == 0);
    kvz_doc_cache_stats cs;
    kvz_doc_cache_get_stats(dc, &cs);
    CHECKF(cs.hits == 1 && cs.misses == 2 && cs.entries == 2, "cache stats %llu hits %llu misses %u entries",
           (unsigned long long)cs.hits, (unsigned long long)cs.misses, cs.entries);
    /* the id now names other content: not served from the cache */
    uint8_t h2[16];
    kvz_store_doc_info info;
    REQUIRE(kvz_store_lookup(st, "keep-2", &info) == 0);
    memcpy(h2, info.hash, 16);
    REQUIRE(kvz_store_put_doc(st, "keep-1", h2, &info, NULL, NULL, 0, NULL) == 0);
    CHECK(kvz_doc_cache_get(dc, st, "keep-1", 8, 0, &c1, &dm, &hit) == 0 && hit == 0);
    CHECK(memcmp(dm.info.hash, h2, 16) == 0);
    CHECK(kvz_doc_cache_put(dc, c1) == 0);
    kvz_doc_cache_free(dc);
    REQUIRE(kvz_doc_cache_create(m, 0, NULL, &dc) == 0); /* budget 0: nothing kept */
    CHECK(kvz_doc_cache_get(dc, st, "keep-3", 8, 0, &c1, &dm, &hit) == 0 && hit == 0);
    CHECK(kvz_doc_cache_put(dc, c1) == 0);
    kvz_doc_cache_get_stats(dc, &cs);
    CHECK(cs.entries == 0 && cs.evictions == 1);
    kvz_doc_cache_free(dc);

    const int live = pins_live();
    kvz_store_close(st);
    if (device == KVZ_DEVICE_CPU) { /* every pin of the recording pinner is undone by the close (or a resize) */
        printf("  %s pins live before close: %d, after: %d\n", dev, live, pins_live());
        CHECK(g_npin >= 1 && pins_live() == 0);
    }
    { /* a layer record gone from the B-tree (a damaged key) while the META names it: store
       * damaged (KVZ_ERR_FORMAT, exit 5), not "no document", on every route */
        REQUIRE(kvz_store_open(dir, 0, 0, fp, &st) == 0);
        doc d;
        make_doc(&d, L, H, hd, KVZ_KV_Q8);
        kvz_blob_meta bm;
        meta_of(m, KVZ_KV_Q8, KVZ_PREFIX_KEEP, NP, NC, NULL, &bm);
        const uint8_t hl[16] = {7, 7, (uint8_t)device};
        CHECK(put_blob(st, "lost-layer", hl, &bm, &d, 0, NULL, NULL) == 0);
        free_doc(&d, L);
        kvz_store_close(st);
        MDB_env *env = NULL;
        MDB_txn *txn = NULL;
        MDB_dbi dbi;
        uint8_t key[20];
        memcpy(key, hl, 16);
        key[16] = key[17] = key[18] = 0;
        key[19] = 1; /* layer 1, big-endian (store/kvz_store.c make_key) */
        MDB_val k = {sizeof key, key};
        int del = mdb_env_create(&env) || mdb_env_set_maxdbs(env, 8) || mdb_env_open(env, dir, 0, 0644) ||
                  mdb_txn_begin(env, NULL, 0, &txn) || mdb_dbi_open(txn, "blobs", 0, &dbi) ||
                  mdb_del(txn, dbi, &k, NULL) || mdb_txn_commit(txn);
        if (env) mdb_env_close(env);
        CHECK(del == 0);
        REQUIRE(kvz_store_open(dir, 0, 0, fp, &st) == 0);
        for (int route = 0; route < 3; route++) {
            kvz_load_opts lo = {.threads = 2, .map_only = route == 1, .direct = route == 2, .direct_min = 1};
            int rc = kvz_load_doc(m, st, "lost-layer", 0, 0, &lo, &kv, &dm);
            printf("  %s layer record deleted, route %d: %s (%s)\n", dev, route, kvz_strerror(rc), kvz_error_detail());
            CHECK(rc == KVZ_ERR_FORMAT && kv == NULL && strstr(kvz_error_detail(), "layer record 1"));
        }
        kvz_store_close(st);
    }
    kvz_model_free(m);
    char cmd[96];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    return 0;
}

int main(void)
{
    run(KVZ_DEVICE_CPU);
    run(KVZ_DEVICE_CUDA); /* skipped (model creation fails) without a CUDA build or a usable GPU */
    return kvz_test_summary();
}
