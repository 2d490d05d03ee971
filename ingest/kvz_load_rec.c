/* One stored record read + verified into the caller's memory, and the worker-pool
 * plumbing shared by the loader and the composition (kvz_load_rec.h). */
#include "kvz_load_rec.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_kvdtype.h"
#include "kvz_kvrow.h"
#include "kvz_xxh3.h"

kvz_load_at kvz_load_place(size_t at, uint64_t kept, size_t rb)
{
    kvz_load_at r;
    r.x = at + (16 - (KVZ_BLOB_HEADER_SIZE + 4 * (size_t)kept) % 16) % 16;
    r.pos = r.x + KVZ_BLOB_HEADER_SIZE;
    r.k = r.pos + 4 * (size_t)kept;
    r.v = r.k + (size_t)kept * rb;
    r.len = KVZ_BLOB_HEADER_SIZE + (size_t)kept * (4 + 2 * rb);
    r.end = r.x + r.len;
    return r;
}

int kvz_load_reader_begin(kvz_load_reader *w, kvz_store *st, int map_only)
{
    memset(w, 0, sizeof *w);
    w->map_only = map_only;
    return kvz_store_read_begin(st, &w->r);
}

/* Scratch buffers of zstd records kept between loads, process-wide: a fresh 20-40 MB
 * malloc is fresh pages, and faulting them in cost a 32K-token load's zstd layer about
 * as much as its read (bench/RESULTS.md, issue 12, sixth pass). At most SCR_KEEP
 * buffers and SCR_BYTES bytes are kept. */
#define SCR_KEEP 16
#define SCR_BYTES ((size_t)512 << 20)
static pthread_mutex_t g_scr_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { uint8_t *p; size_t n; } g_scr[SCR_KEEP];
static size_t g_scr_bytes;

/* a kept buffer of at least @p n bytes (the smallest), else a new one; NULL: no memory */
static uint8_t *scratch_get(size_t n, size_t *got)
{
    int best = -1;
    pthread_mutex_lock(&g_scr_mu);
    for (int i = 0; i < SCR_KEEP; i++)
        if (g_scr[i].p && g_scr[i].n >= n && (best < 0 || g_scr[i].n < g_scr[best].n)) best = i;
    uint8_t *p = NULL;
    if (best >= 0) {
        p = g_scr[best].p;
        *got = g_scr[best].n;
        g_scr_bytes -= g_scr[best].n;
        g_scr[best].p = NULL;
    }
    pthread_mutex_unlock(&g_scr_mu);
    if (!p && (p = malloc(n))) *got = n;
    return p;
}

/* keep @p p for a later load when there is room, else free it */
static void scratch_put(uint8_t *p, size_t n)
{
    if (!p) return;
    pthread_mutex_lock(&g_scr_mu);
    for (int i = 0; i < SCR_KEEP && p; i++)
        if (!g_scr[i].p && g_scr_bytes + n <= SCR_BYTES) {
            g_scr[i].p = p;
            g_scr[i].n = n;
            g_scr_bytes += n;
            p = NULL;
        }
    pthread_mutex_unlock(&g_scr_mu);
    free(p);
}

void kvz_load_reader_end(kvz_load_reader *w)
{
    kvz_store_read_end(w->r);
    w->r = NULL;
    scratch_put(w->scratch, w->scratch_n);
    w->scratch = NULL;
    w->scratch_n = 0;
    free(w->head);
    w->head = NULL;
    w->head_n = 0;
}

/* kvz_store_copy_layer's piece callback: hash the bytes that arrived (the record
 * checksum, seeded from the header) and check the q8/q4 rows that are complete
 * (the same check and message as kvz_blob_decode_layer) */
typedef struct piece_st {
    kvz_xxh3 hs;
    const uint8_t *base;
    size_t hashed;       /* bytes [0, hashed) hashed (the header: seeded) */
    int seeded, rows;
    int dtype;
    size_t hd, rb, row0, nrows, checked; /* rows at base + row0, [0, checked) checked */
    uint64_t bad;        /* first bad row (K rows, then V rows), UINT64_MAX: none */
    double s;
} piece_st;

static int on_piece(void *u, size_t done)
{
    piece_st *p = u;
    const double t0 = kvz_now();
    if (!p->seeded && done >= KVZ_BLOB_HEADER_SIZE) {
        kvz_xxh3_reset(&p->hs, kvz_blob_record_seed(p->base));
        p->hashed = KVZ_BLOB_HEADER_SIZE;
        p->seeded = 1;
        p->rows = p->rows && p->base[7] == KVZ_BLOB_CODEC_NONE; /* header byte 7: codec (unverified yet) */
    }
    if (p->seeded && done > p->hashed) {
        kvz_xxh3_update(&p->hs, p->base + p->hashed, done - p->hashed);
        p->hashed = done;
    }
    if (p->rows && p->bad == UINT64_MAX && done > p->row0) {
        size_t have = (done - p->row0) / p->rb;
        if (have > p->nrows) have = p->nrows;
        uint64_t bad;
        if (have > p->checked &&
            kvz_kvrow_check(p->dtype, p->base + p->row0 + p->checked * p->rb, have - p->checked, p->hd, &bad))
            p->bad = p->checked + bad;
        p->checked = have;
    }
    p->s += kvz_now() - t0;
    return 0;
}

static int copy_rec(kvz_load_reader *w, const uint8_t *hash, int prefix, uint32_t l, uint8_t *dst, size_t cap,
                    size_t *len, piece_st *ps)
{
    const double t0 = kvz_now();
    const int rc = prefix ? kvz_store_copy_prefix(w->r, hash, l, dst, cap, len, on_piece, ps)
                          : kvz_store_copy_layer(w->r, hash, l, dst, cap, len, on_piece, ps);
    w->pf.copy_s += kvz_now() - t0 - ps->s;
    w->pf.hash_s += ps->s;
    return rc;
}

/* kvz_store_map_layer's piece callback: on_piece over the record in the map */
typedef struct map_piece_st {
    piece_st ps;
    const uint8_t *const *rec;
} map_piece_st;

static int on_map_piece(void *u, size_t done)
{
    map_piece_st *mp = u;
    mp->ps.base = *mp->rec;
    return on_piece(&mp->ps, done);
}

int kvz_load_bad_rows(const kvz_blob_meta *m, uint32_t l, uint64_t kept, uint64_t bad)
{
    const int isv = bad >= kept;
    return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u %s row %llu: bad %s scale block (NaN, Inf or negative "
                         "scale, or q8 value -128)", l, isv ? "V" : "K",
                         (unsigned long long)(isv ? bad - kept : bad), kvz_kv_dtype_name(m->dtype));
}

/* A LAYER record that is not in the store although the META record read in the same
 * transaction names it: the store is damaged (a B-tree key lost, e.g.), not a missing
 * document (KVZ_ERR_FORMAT: exit 5, like every other damage the loader finds). */
static int missing(int prefix, uint32_t l)
{
    return kvz_error_set(KVZ_ERR_FORMAT, prefix ? "its shared prefix blob has no layer %u (store damaged)"
                                                : "its META record names layer %u, which is not in the store "
                                                  "(store damaged)", l);
}

int kvz_load_record_peek(kvz_load_reader *w, uint32_t l, const uint8_t hash[16], kvz_load_at at, const uint8_t **rec)
{
    *rec = NULL;
    if (w->map_only) return KVZ_ERR_UNSUPPORTED;
    uint8_t hdr[KVZ_BLOB_HEADER_SIZE];
    const uint8_t *r = NULL;
    size_t len = 0;
    const double t0 = kvz_now();
    int rc = at.len >= sizeof hdr ? kvz_store_map_peek(w->r, hash, l, at.len, &r, &len, hdr, sizeof hdr) : 0;
    w->pf.hash_s += kvz_now() - t0;
    if (rc == KVZ_ERR_NOTFOUND) return missing(0, l);
    if (rc) return rc;
    if (!r || kvz_blob_header_codec(hdr) != KVZ_BLOB_CODEC_NONE) return KVZ_ERR_UNSUPPORTED; /* the other routes */
    *rec = r;
    return 0;
}

int kvz_load_record_mapped(kvz_load_reader *w, const kvz_blob_meta *m, const uint8_t hash[16], uint32_t l,
                           kvz_load_at at, const uint8_t **rec)
{
    *rec = NULL;
    if (w->map_only) return KVZ_ERR_UNSUPPORTED;
    const uint64_t kept = kvz_blob_layer_kept(m, l);
    map_piece_st mp;
    memset(&mp, 0, sizeof mp);
    const uint8_t *r = NULL;
    mp.rec = &r;
    mp.ps.rows = m->dtype == KVZ_KV_Q8 || m->dtype == KVZ_KV_Q4;
    mp.ps.dtype = m->dtype;
    mp.ps.hd = m->head_dim;
    mp.ps.rb = kvz_blob_kv_row_bytes(m);
    mp.ps.row0 = at.k - at.x;
    mp.ps.nrows = 2 * (size_t)kept;
    mp.ps.bad = UINT64_MAX;
    size_t len = 0;
    const double t0 = kvz_now();
    int rc = kvz_store_map_layer(w->r, hash, l, at.len, &r, &len, on_map_piece, &mp);
    w->pf.hash_s += kvz_now() - t0;
    if (rc == KVZ_ERR_NOTFOUND) return missing(0, l);
    if (rc) return rc;
    if (!r) return KVZ_ERR_UNSUPPORTED; /* not a codec-none record: the other routes */
    const double t1 = kvz_now();
    rc = kvz_blob_layer_placed(m, l, r, len, kvz_xxh3_digest(&mp.ps.hs));
    w->pf.check_s += kvz_now() - t1;
    if (!rc && mp.ps.bad != UINT64_MAX) rc = kvz_load_bad_rows(m, l, kept, mp.ps.bad);
    if (rc == KVZ_ERR_UNSUPPORTED) return rc; /* a zstd record of that length: the copy route decodes it */
    if (rc) return rc;
    w->pf.records_direct++;
    w->pf.bytes += len;
    *rec = r;
    return 0;
}

int kvz_load_record_head(kvz_load_reader *w, const kvz_blob_meta *m, const uint8_t hash[16], uint32_t l,
                         kvz_load_at at, const uint8_t **rec, uint64_t *seed, uint64_t *want)
{
    *rec = NULL;
    if (w->map_only) return KVZ_ERR_UNSUPPORTED;
    const size_t hl = at.pos - at.x + 4 * (size_t)kvz_blob_layer_kept(m, l); /* header + positions */
    if (hl > at.len) return kvz_error_set(KVZ_ERR_ARG, "kvz_load_record_head: layout");
    if (hl > w->head_n) {
        free(w->head);
        w->head_n = 0;
        if (!(w->head = malloc(hl + 16))) return kvz_error_set(KVZ_ERR_NOMEM, "load: record head (%zu bytes)", hl);
        w->head_n = hl;
    }
    const uint8_t *r = NULL;
    size_t len = 0;
    const double t0 = kvz_now();
    int rc = kvz_store_map_peek(w->r, hash, l, at.len, &r, &len, w->head, hl);
    w->pf.hash_s += kvz_now() - t0;
    if (rc == KVZ_ERR_NOTFOUND) return missing(0, l);
    if (rc) return rc;
    if (!r || kvz_blob_header_codec(w->head) != KVZ_BLOB_CODEC_NONE) return KVZ_ERR_UNSUPPORTED; /* the other routes */
    const double t1 = kvz_now();
    rc = kvz_blob_layer_head(m, l, w->head, at.len);
    w->pf.check_s += kvz_now() - t1;
    if (rc == KVZ_ERR_UNSUPPORTED) return rc;
    if (rc) { /* damaged: the error the host route gives (it compares the checksum before the later checks) */
        const uint8_t *r2 = NULL;
        const int rc2 = kvz_load_record_mapped(w, m, hash, l, at, &r2);
        return rc2 && rc2 != KVZ_ERR_UNSUPPORTED ? rc2 : rc;
    }
    *seed = kvz_blob_record_seed(w->head);
    memcpy(want, w->head + 48, 8); /* rec_xxh3 (docs/FORMAT.md §1), compared by kvz_blob_record_checksum */
    *rec = r;
    return 0;
}

int kvz_load_record(kvz_load_reader *w, const kvz_blob_meta *m, const uint8_t hash[16], int prefix, uint32_t l,
                    uint8_t *dst, kvz_load_at at)
{
    kvz_load_profile *pf = &w->pf;
    const uint64_t kept = kvz_blob_layer_kept(m, l);
    int rc = KVZ_ERR_UNSUPPORTED;
    size_t len = 0;
    if (!w->map_only) {
        piece_st ps;
        memset(&ps, 0, sizeof ps);
        ps.base = dst + at.x;
        ps.rows = m->dtype == KVZ_KV_Q8 || m->dtype == KVZ_KV_Q4;
        ps.dtype = m->dtype;
        ps.hd = m->head_dim;
        ps.rb = kvz_blob_kv_row_bytes(m);
        ps.row0 = at.k - at.x;
        ps.nrows = 2 * (size_t)kept;
        ps.bad = UINT64_MAX;
        rc = copy_rec(w, hash, prefix, l, dst + at.x, at.len, &len, &ps);
        if (!rc && len == at.len) { /* codec none: in place */
            const double t1 = kvz_now();
            rc = kvz_blob_layer_placed(m, l, dst + at.x, len, kvz_xxh3_digest(&ps.hs));
            pf->check_s += kvz_now() - t1;
            if (!rc && ps.bad != UINT64_MAX) rc = kvz_load_bad_rows(m, l, kept, ps.bad);
            if (rc != KVZ_ERR_UNSUPPORTED) { /* UNSUPPORTED: a zstd record of that length */
                pf->records_copied++;
                pf->bytes += len;
                return rc;
            }
        } else if (!rc && (len > at.len || len < KVZ_BLOB_HEADER_SIZE)) {
            rc = KVZ_ERR_UNSUPPORTED; /* not what codec none or zstd gives (damaged, or a v1 record zstd grew): the
                                       * map route checks it and says what is wrong */
        } else if (!rc) { /* a zstd record (shorter): copied + hashed into scratch, decompressed into place */
            if (len > w->scratch_n) {
                scratch_put(w->scratch, w->scratch_n);
                w->scratch_n = 0;
                if (!(w->scratch = scratch_get(len, &w->scratch_n)))
                    return kvz_error_set(KVZ_ERR_NOMEM, "load scratch (%zu bytes)", len);
            }
            memset(&ps, 0, sizeof ps);
            ps.base = w->scratch;
            ps.bad = UINT64_MAX;
            size_t len2 = 0;
            rc = copy_rec(w, hash, prefix, l, w->scratch, len, &len2, &ps);
            if (!rc && len2 == len) {
                const double t3 = kvz_now();
                rc = kvz_blob_decode_layer_hashed(m, l, w->scratch, len, kvz_xxh3_digest(&ps.hs),
                                                  (uint32_t *)(dst + at.pos), dst + at.k, dst + at.v);
                pf->zstd_s += kvz_now() - t3;
                pf->records_zstd++;
                pf->bytes += len;
                return rc;
            }
            if (!rc) rc = KVZ_ERR_UNSUPPORTED; /* changed under us? the map route says */
        }
        if (rc == KVZ_ERR_NOTFOUND) return missing(prefix, l);
        if (rc != KVZ_ERR_UNSUPPORTED) return rc;
    }
    const double t0 = kvz_now();
    const uint8_t *rec;
    rc = prefix ? kvz_store_read_prefix(w->r, hash, l, &rec, &len) : kvz_store_read_layer(w->r, hash, l, &rec, &len);
    if (rc == KVZ_ERR_NOTFOUND) return missing(prefix, l);
    if (!rc) rc = kvz_blob_decode_layer(m, l, rec, len, (uint32_t *)(dst + at.pos), dst + at.k, dst + at.v);
    pf->map_s += kvz_now() - t0;
    pf->records_mapped++;
    pf->bytes += len;
    return rc;
}

void kvz_load_profile_add(kvz_load_profile *t, const kvz_load_profile *p)
{
    t->copy_s += p->copy_s;
    t->hash_s += p->hash_s;
    t->check_s += p->check_s;
    t->zstd_s += p->zstd_s;
    t->map_s += p->map_s;
    t->convert_s += p->convert_s;
    t->slot_wait_s += p->slot_wait_s;
    t->records_copied += p->records_copied;
    t->records_zstd += p->records_zstd;
    t->records_mapped += p->records_mapped;
    t->records_direct += p->records_direct;
    t->register_s += p->register_s;
    t->bytes += p->bytes;
    t->records_dev_verified += p->records_dev_verified;
}

void kvz_load_sync_init(kvz_load_sync *s)
{
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->err = 0;
    s->detail[0] = 0;
}

void kvz_load_sync_destroy(kvz_load_sync *s)
{
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
}

void kvz_load_sync_fail(kvz_load_sync *s, int rc, const char *doc, uint32_t layer)
{
    const char *d = kvz_error_detail();
    if (!d || !d[0]) d = kvz_strerror(rc);
    pthread_mutex_lock(&s->mu);
    if (!s->err) {
        s->err = rc;
        if (layer == UINT32_MAX)
            snprintf(s->detail, sizeof s->detail, "document '%s': %s", doc, d);
        else
            snprintf(s->detail, sizeof s->detail, "document '%s' layer record %u: %s", doc, layer, d);
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

int kvz_load_spawn(pthread_t *th, int n, void *(*fn)(void *), void *arg)
{
    int k = 0;
    while (k < n && pthread_create(&th[k], NULL, fn, arg) == 0) k++;
    return k;
}

void kvz_load_join(pthread_t *th, int n)
{
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

int kvz_load_plan_slots(int *want, uint32_t ntask, int max_slots)
{
    int n = *want + 2;
    if (n > max_slots) n = max_slots;
    if ((uint32_t)n > ntask) n = (int)ntask;
    if (*want > n) *want = n;
    return n;
}
