/* Store-level operations the tools share (kvz_store_admin.h). */
#include "kvz_store_admin.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "kvz_error.h"
#include "kvz_kvdtype.h"

void kvz_store_doc_detail_free(kvz_store_doc_detail *d)
{
    if (!d) return;
    kvz_blob_meta_free(&d->meta);
    free(d->rec_bytes);
    free(d->raw_bytes);
    d->rec_bytes = d->raw_bytes = NULL;
}

/* The records of d->info.hash inside @p r: sizes and the derived figures. */
static int read_blob(kvz_store_read *r, kvz_store_doc_detail *d)
{
    const uint8_t *rec;
    size_t len;
    int rc;
    d->failed = KVZ_DETAIL_META;
    if ((rc = kvz_store_read_meta(r, d->info.hash, &rec, &len)) ||
        (rc = kvz_blob_decode_meta(rec, len, NULL, &d->meta)))
        return rc;
    const kvz_blob_meta *m = &d->meta;
    d->meta_bytes = len;
    d->bytes_records = len;
    d->failed = 0;
    d->rec_bytes = calloc(m->n_layer ? m->n_layer : 1, sizeof *d->rec_bytes);
    d->raw_bytes = calloc(m->n_layer ? m->n_layer : 1, sizeof *d->raw_bytes);
    if (!d->rec_bytes || !d->raw_bytes) return kvz_error_set(KVZ_ERR_NOMEM, "document detail");
    const uint32_t H = m->n_kv_head;
    d->kept_min = m->n_layer && H ? UINT32_MAX : 0;
    for (uint32_t l = 0; l < m->n_layer; l++) {
        if ((rc = kvz_store_read_layer(r, d->info.hash, l, &rec, &len))) {
            d->failed = KVZ_DETAIL_LAYER;
            d->failed_layer = l;
            return rc;
        }
        d->rec_bytes[l] = len;
        d->raw_bytes[l] = kvz_blob_layer_raw_size(m, l);
        d->bytes_records += len;
        d->bytes_raw += d->raw_bytes[l];
        d->pairs_kept += kvz_blob_layer_kept(m, l);
        for (uint32_t h = 0; h < H; h++) {
            const uint32_t c = m->counts[l * H + h];
            if (c < d->kept_min) d->kept_min = c;
            if (c > d->kept_max) d->kept_max = c;
        }
    }
    d->context_pairs = (uint64_t)m->n_layer * H * m->n_context;
    d->context_pairs_kept = m->prefix_policy == KVZ_PREFIX_KEEP
                                ? d->pairs_kept - (uint64_t)m->n_layer * H * m->n_prefix
                                : d->pairs_kept;
    return 0;
}

int kvz_store_doc_detail_get(kvz_store *s, const char *id, kvz_store_doc_detail *d)
{
    if (!s || !id || !d) return kvz_error_set(KVZ_ERR_ARG, "kvz_store_doc_detail_get: NULL argument");
    memset(d, 0, sizeof *d);
    kvz_store_read *r;
    int rc = kvz_store_read_begin(s, &r);
    if (rc) {
        d->failed = KVZ_DETAIL_READ;
        return rc;
    }
    if ((rc = kvz_store_read_doc(r, id, &d->info))) d->failed = KVZ_DETAIL_DOC;
    else rc = read_blob(r, d);
    kvz_store_read_end(r);
    return rc;
}

static int sum_cb(void *u, const char *id, const kvz_store_doc_info *in)
{
    (void)id;
    kvz_store_summary *t = u;
    t->tokens += in->n_tokens;
    t->bytes_kv_full += in->bytes_kv_full;
    t->bytes_kv_kept += in->bytes_kv_kept;
    t->bytes_stored_docs += in->bytes_stored;
    return 0;
}

int kvz_store_summary_get(kvz_store *s, const char *dir, kvz_store_summary *out)
{
    if (!s || !dir || !out) return kvz_error_set(KVZ_ERR_ARG, "kvz_store_summary_get: NULL argument");
    memset(out, 0, sizeof *out);
    int rc = kvz_store_stats_get(s, &out->st);
    if (!rc) rc = kvz_store_list(s, sum_cb, out);
    if (rc) return rc;
    out->file_bytes = kvz_store_file_bytes(dir);
    return 0;
}

int kvz_store_gc_compact(kvz_store *s, int compact, kvz_store_gc_compact_result *r)
{
    if (!s || !r) return kvz_error_set(KVZ_ERR_ARG, "kvz_store_gc_compact: NULL argument");
    memset(r, 0, sizeof *r);
    int rc = kvz_store_gc(s, &r->gc);
    if (rc) return rc;
    r->gc_done = 1;
    if (!compact) return 0;
    rc = kvz_store_compact(s, &r->file_bytes_before, &r->file_bytes_after);
    if (!rc) r->compacted = 1;
    return rc;
}

uint32_t kvz_store_count_parts(kvz_store *s, const char *id)
{
    char part[KVZ_STORE_DOC_ID_MAX + 32];
    kvz_store_doc_info *pi = malloc(sizeof *pi);
    uint32_t n = 0;
    while (pi && n < KVZ_STORE_PART_MAX) {
        snprintf(part, sizeof part, "%s#%u", id, n + 1);
        if (strlen(part) > KVZ_STORE_DOC_ID_MAX || kvz_store_lookup(s, part, pi) != 0) break;
        n++;
    }
    free(pi);
    kvz_error_clear(); /* the lookup that ended the count is not an error */
    return n;
}

uint64_t kvz_store_file_bytes(const char *dir)
{
    char p[KVZ_STORE_SOURCE_MAX + 16];
    struct stat st;
    if (snprintf(p, sizeof p, "%s/data.mdb", dir) >= (int)sizeof p) return 0;
    return stat(p, &st) == 0 ? (uint64_t)st.st_size : 0;
}

void kvz_store_hex16(const uint8_t b[16], char out[33])
{
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        out[2 * i] = hx[b[i] >> 4];
        out[2 * i + 1] = hx[b[i] & 15];
    }
    out[32] = 0;
}

void kvz_store_fmt_date(int64_t t, char out[32])
{
    const time_t tt = (time_t)t;
    struct tm tm;
    if (!gmtime_r(&tt, &tm) || !strftime(out, 32, "%Y-%m-%d %H:%M:%S", &tm)) snprintf(out, 32, "?");
}

const char *kvz_store_mode_name(uint8_t mode)
{
    return mode == KVZ_MODE_GLOBAL ? "global" : mode == KVZ_MODE_UNIFORM ? "uniform" : "?";
}

const char *kvz_store_prefix_name(uint8_t policy)
{
    return policy == KVZ_PREFIX_KEEP ? "keep" : policy == KVZ_PREFIX_SHARED ? "shared" : "none";
}

const char *kvz_store_dtype_name(uint8_t dtype)
{
    const char *n = kvz_kv_dtype_name(dtype);
    return n ? n : "?";
}
