/* The store's reports as jansson objects (kvz_store_report.h). */
#include "kvz_store_report.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Length of the valid UTF-8 sequence at p (n bytes left), 0 when it is not one:
 * no overlong forms, no surrogates, nothing above U+10FFFF. */
static size_t utf8_len(const unsigned char *p, size_t n)
{
    const unsigned c = p[0];
    if (c < 0x80) return 1;
    size_t len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!len || len > n) return 0;
    for (size_t i = 1; i < len; i++)
        if ((p[i] & 0xC0) != 0x80) return 0;
    if (c == 0xE0 && p[1] < 0xA0) return 0;  /* overlong 3-byte */
    if (c == 0xED && p[1] > 0x9F) return 0;  /* UTF-16 surrogates */
    if (c == 0xF0 && p[1] < 0x90) return 0;  /* overlong 4-byte */
    if (c == 0xF4 && p[1] > 0x8F) return 0;  /* above U+10FFFF */
    return len;
}

json_t *kvz_report_text(const char *s)
{
    if (!s) s = "";
    json_t *j = json_string(s);
    if (j) return j;
    /* not UTF-8 (json_string checks): each bad byte becomes U+FFFD (3 bytes) */
    const size_t n = strlen(s);
    char *buf = malloc(3 * n + 1);
    if (!buf) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        const size_t len = utf8_len((const unsigned char *)s + i, n - i);
        if (len) {
            memcpy(buf + o, s + i, len);
            o += len;
            i += len;
        } else {
            memcpy(buf + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    j = json_stringn(buf, o);
    free(buf);
    return j;
}

/* @p x rounded to @p places decimals; null when it is not finite (JSON has no NaN). */
static json_t *real(double x, int places)
{
    if (!isfinite(x)) return json_null();
    const double f = pow(10.0, places);
    return json_real(round(x * f) / f);
}

static json_t *hex(const uint8_t b[16])
{
    char h[33];
    kvz_store_hex16(b, h);
    return json_string(h);
}

static json_t *date(int64_t t)
{
    char d[32];
    kvz_store_fmt_date(t, d);
    return json_string(d);
}

#define I(x) ((json_int_t)(x))

json_t *kvz_report_doc(const char *id, const kvz_store_doc_info *in)
{
    return json_pack("{s:o, s:I, s:o, s:s, s:I, s:I, s:I, s:o, s:I, s:o, s:I, s:o, s:o}",
                     "id", kvz_report_text(id), "tokens", I(in->n_tokens),
                     "ratio", real(in->ratio, 4), "mode", kvz_store_mode_name(in->mode),
                     "bytes_stored", I(in->bytes_stored), "bytes_kv_full", I(in->bytes_kv_full),
                     "bytes_kv_kept", I(in->bytes_kv_kept),
                     "compression", real(kvz_store_ratio(in->bytes_kv_full, in->bytes_stored), 3),
                     "records", I(in->n_records), "hash", hex(in->hash),
                     "ingest_time", I(in->ingest_time), "date", date(in->ingest_time),
                     "source", kvz_report_text(in->source_path));
}

static json_t *layers(const kvz_store_doc_detail *d)
{
    const kvz_blob_meta *m = &d->meta;
    json_t *a = json_array();
    for (uint32_t l = 0; a && l < m->n_layer; l++) {
        json_t *heads = json_array();
        for (uint32_t h = 0; heads && h < m->n_kv_head; h++)
            if (json_array_append_new(heads, json_integer(m->counts[l * m->n_kv_head + h]))) {
                json_decref(heads);
                heads = NULL;
            }
        json_t *e = json_pack("{s:I, s:I, s:o, s:I, s:I}", "layer", I(l), "kept",
                              I(kvz_blob_layer_kept(m, l)), "heads", heads, "bytes_raw",
                              I(d->raw_bytes[l]), "bytes_record", I(d->rec_bytes[l]));
        if (json_array_append_new(a, e)) {
            json_decref(a);
            a = NULL;
        }
    }
    return a;
}

json_t *kvz_report_doc_detail(const char *id, const kvz_store_doc_detail *d)
{
    const kvz_store_doc_info *in = &d->info;
    const kvz_blob_meta *m = &d->meta;
    json_t *blob = json_pack(
        "{s:o, s:I, s:I, s:I, s:I, s:s, s:s, s:s, s:o, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I,"
        " s:I, s:I, s:I, s:o}",
        "model_fp", hex(m->fingerprint), "n_layer", I(m->n_layer), "n_head", I(m->n_head),
        "n_kv_head", I(m->n_kv_head), "head_dim", I(m->head_dim), "dtype",
        kvz_store_dtype_name(m->dtype), "mode", kvz_store_mode_name(m->mode), "prefix_policy",
        kvz_store_prefix_name(m->prefix_policy), "ratio", real(m->ratio, 4), "chunk", I(m->chunk),
        "overlap", I(m->overlap), "n_prefix", I(m->n_prefix), "n_context", I(m->n_context),
        "pairs_kept", I(d->pairs_kept), "context_pairs", I(d->context_pairs), "context_pairs_kept",
        I(d->context_pairs_kept), "kept_per_head_min", I(d->kept_min), "kept_per_head_max",
        I(d->kept_max), "bytes_raw", I(d->bytes_raw), "bytes_records", I(d->bytes_records),
        "meta_record_bytes", I(d->meta_bytes), "layers", layers(d));
    return json_pack("{s:o, s:o, s:o, s:I, s:I, s:o, s:I, s:I, s:I, s:I, s:o, s:o}",
                     "id", kvz_report_text(id), "source", kvz_report_text(in->source_path),
                     "hash", hex(in->hash), "tokens", I(in->n_tokens),
                     "ingest_time", I(in->ingest_time), "date", date(in->ingest_time),
                     "records", I(in->n_records), "bytes_stored", I(in->bytes_stored),
                     "bytes_kv_full", I(in->bytes_kv_full), "bytes_kv_kept", I(in->bytes_kv_kept),
                     "compression", real(kvz_store_ratio(in->bytes_kv_full, in->bytes_stored), 3),
                     "blob", blob);
}

json_t *kvz_report_summary(const char *dir, const kvz_store_summary *s)
{
    const kvz_store_stats *st = &s->st;
    return json_pack(
        "{s:o, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:o, s:o, s:o, s:I, s:I, s:I, s:I, s:I, s:o}",
        "store", kvz_report_text(dir), "docs", I(st->n_docs), "blobs", I(st->n_blobs),
        "records", I(st->n_records), "tokens", I(s->tokens), "bytes_kv_full", I(s->bytes_kv_full),
        "bytes_kv_kept", I(s->bytes_kv_kept), "bytes_stored_docs", I(s->bytes_stored_docs),
        "bytes_records", I(st->bytes_records),
        "compression", real(kvz_store_ratio(s->bytes_kv_full, s->bytes_stored_docs), 3),
        "eviction", real(kvz_store_ratio(s->bytes_kv_full, s->bytes_kv_kept), 3),
        "zstd", real(kvz_store_ratio(s->bytes_kv_kept, s->bytes_stored_docs), 3),
        "map_size", I(st->map_size), "map_used", I(st->map_used), "file_bytes", I(s->file_bytes),
        "page_size", I(st->page_size), "last_txnid", I(st->last_txnid),
        "model_fp", st->has_model ? hex(st->model_fp) : json_null());
}

json_t *kvz_report_verify(const kvz_store_verify_result *r, double cpu_s)
{
    return json_pack("{s:b, s:I, s:I, s:I, s:I, s:o}", "ok", r->n_problems == 0, "docs",
                     I(r->n_docs), "blobs", I(r->n_blobs), "records", I(r->n_records), "problems",
                     I(r->n_problems), "cpu_s", real(cpu_s, 3));
}

json_t *kvz_report_gc(const kvz_store_gc_compact_result *r)
{
    const kvz_store_gc_result *g = &r->gc;
    json_t *o = json_pack("{s:I, s:I, s:I, s:I, s:I, s:I}", "blobs_dropped", I(g->blobs_dropped),
                          "records_dropped", I(g->records_dropped), "bytes_dropped",
                          I(g->bytes_dropped), "orphan_records", I(g->orphan_records),
                          "refs_fixed", I(g->refs_fixed), "prefixes_dropped", I(g->prefixes_dropped));
    if (o && r->compacted &&
        (json_object_set_new(o, "file_bytes_before", json_integer(I(r->file_bytes_before))) ||
         json_object_set_new(o, "file_bytes_after", json_integer(I(r->file_bytes_after))))) {
        json_decref(o);
        return NULL;
    }
    return o;
}

json_t *kvz_report_salvage(const char *src, const char *dst, const kvz_store_salvage_result *r)
{
    return json_pack("{s:o, s:o, s:I, s:I, s:I, s:I}", "store", kvz_report_text(src), "into",
                     kvz_report_text(dst), "docs", I(r->n_docs), "copied", I(r->n_copied), "lost",
                     I(r->n_lost), "unreadable_stretches", I(r->n_gaps));
}

json_t *kvz_report_merge(const char *into, const kvz_merge_result *r)
{
    return json_pack("{s:o, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:b, s:I}", "into",
                     kvz_report_text(into), "docs", I(r->n_docs), "copied", I(r->copied), "linked",
                     I(r->linked), "unchanged", I(r->unchanged), "replaced", I(r->replaced), "bad",
                     I(r->bad), "conflicts_resolved", I(r->conflicts), "mixed_corpus",
                     r->mixed_corpus != 0, "bytes_copied", I(r->bytes_copied));
}
