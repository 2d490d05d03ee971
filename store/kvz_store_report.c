/* The store's reports as jansson objects and as text lines (kvz_store_report.h). */
#include "kvz_store_report.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_escape.h"

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

/* ---- the same reports as text lines (kvzip-store without --json) ---- */

#define E kvz_escape
#define R kvz_store_ratio

static const char *B(uint64_t b) /* bytes for a text line; 8 rotating buffers */
{
    static _Thread_local char bufs[8][32];
    static _Thread_local unsigned next;
    char *out = bufs[next++ % 8];
    if (b < 10000) snprintf(out, 32, "%" PRIu64 " B", b);
    else if (b < 10000000) snprintf(out, 32, "%.1f kB", b / 1e3);
    else if (b < 10000000000ull) snprintf(out, 32, "%.1f MB", b / 1e6);
    else snprintf(out, 32, "%.2f GB", b / 1e9);
    return out;
}

void kvz_store_report_print_ls_header(FILE *f)
{
    fprintf(f, "%-40s %8s %6s %10s %8s  %s\n", "ID", "TOKENS", "RATIO", "STORED", "COMPR", "DATE (UTC)");
}

void kvz_store_report_print_ls_row(FILE *f, const char *id, const kvz_store_doc_info *in)
{
    char date[32];
    kvz_store_fmt_date(in->ingest_time, date);
    fprintf(f, "%-40s %8" PRIu64 " %6.3f %10s %7.2fx  %s\n", E(id), in->n_tokens, in->ratio,
            B(in->bytes_stored), R(in->bytes_kv_full, in->bytes_stored), date);
}

void kvz_store_report_print_doc_detail(FILE *f, const char *id, const kvz_store_doc_detail *d)
{
    const kvz_store_doc_info *in = &d->info;
    const kvz_blob_meta *m = &d->meta;
    char hx[33], fp[33], date[32];
    kvz_store_hex16(in->hash, hx);
    kvz_store_hex16(m->fingerprint, fp);
    kvz_store_fmt_date(in->ingest_time, date);
    fprintf(f, "document     %s\nsource       %s\nhash         %s\ningested     %s UTC\n", E(id),
            in->source_path[0] ? E(in->source_path) : "-", hx, date);
    fprintf(f, "tokens       %" PRIu64 " (%u system prefix + %u context)\n", in->n_tokens, m->n_prefix,
            m->n_context);
    fprintf(f, "KV bytes     full %s, kept %s, stored %s in %u records\n", B(in->bytes_kv_full),
            B(in->bytes_kv_kept), B(in->bytes_stored), in->n_records);
    fprintf(f, "compression  %.2fx overall (eviction %.2fx, zstd %.2fx)\nmodel        %s\n",
            R(in->bytes_kv_full, in->bytes_stored), R(in->bytes_kv_full, in->bytes_kv_kept),
            R(in->bytes_kv_kept, in->bytes_stored), fp);
    fprintf(f, "dims         %u layers, %u query heads, %u KV heads, head_dim %u, %s\n", m->n_layer,
            m->n_head, m->n_kv_head, m->head_dim, kvz_store_dtype_name(m->dtype));
    fprintf(f, "eviction     %s, ratio %.3f, chunk %u, overlap %u, prefix %s\n", kvz_store_mode_name(m->mode),
            m->ratio, m->chunk, m->overlap, m->prefix_policy == KVZ_PREFIX_KEEP ? "kept"
            : m->prefix_policy == KVZ_PREFIX_SHARED ? "shared (one copy per store)" : "not stored");
    fprintf(f, "kept pairs   %" PRIu64 " (context %" PRIu64 " of %" PRIu64 " = %.3f); per head %u..%u\n",
            d->pairs_kept, d->context_pairs_kept, d->context_pairs,
            R(d->context_pairs_kept, d->context_pairs), d->kept_min, d->kept_max);
    fprintf(f, "records      META %" PRIu64 " B; layers raw %s -> %s (zstd %.2fx)\n", d->meta_bytes,
            B(d->bytes_raw), B(d->bytes_records), R(d->bytes_raw, d->bytes_records - d->meta_bytes));
    fprintf(f, "\n%5s %8s %10s %10s  %s\n", "LAYER", "KEPT", "RAW", "RECORD", "PER KV HEAD");
    for (uint32_t l = 0, H = m->n_kv_head; l < m->n_layer; l++) {
        fprintf(f, "%5u %8" PRIu64 " %10" PRIu64 " %10" PRIu64 "  ", l, kvz_blob_layer_kept(m, l),
                d->raw_bytes[l], d->rec_bytes[l]);
        for (uint32_t h = 0; h < H && h < 16; h++) fprintf(f, "%s%u", h ? " " : "", m->counts[l * H + h]);
        fprintf(f, "%s\n", H > 16 ? " ..." : "");
    }
}

void kvz_store_report_print_summary(FILE *f, const char *dir, const kvz_store_summary *t)
{
    const kvz_store_stats *st = &t->st;
    char fp[33] = "(none yet)";
    if (st->has_model) kvz_store_hex16(st->model_fp, fp);
    fprintf(f, "store        %s\nmodel        %s\n", E(dir), fp);
    fprintf(f, "documents    %" PRIu64 " (%" PRIu64 " tokens)\n", st->n_docs, t->tokens);
    fprintf(f, "blobs        %" PRIu64 " (%" PRIu64 " records, %s)\n", st->n_blobs, st->n_records,
            B(st->bytes_records));
    fprintf(f, "KV bytes     full %s, kept %s, stored %s\n", B(t->bytes_kv_full), B(t->bytes_kv_kept),
            B(st->bytes_records));
    fprintf(f, "compression  %.2fx overall (eviction %.2fx, zstd %.2fx; per document, before sharing)\n",
            R(t->bytes_kv_full, t->bytes_stored_docs), R(t->bytes_kv_full, t->bytes_kv_kept),
            R(t->bytes_kv_kept, t->bytes_stored_docs));
    fprintf(f, "map          %s in use of %s mapped; data.mdb %s; page %u B\nlast txn     %" PRIu64 "\n",
            B(st->map_used), B(st->map_size), B(t->file_bytes), st->page_size, st->last_txnid);
}

void kvz_store_report_print_verify(FILE *f, const char *dir, const kvz_store_verify_result *r)
{
    fprintf(f, "%s: %" PRIu64 " documents, %" PRIu64 " blobs, %" PRIu64 " records decoded: %s\n", E(dir),
            r->n_docs, r->n_blobs, r->n_records, r->n_problems ? "PROBLEMS" : "ok");
}

void kvz_store_report_print_gc(FILE *f, const kvz_store_gc_compact_result *r)
{
    const kvz_store_gc_result *g = &r->gc;
    fprintf(f, "gc: dropped %" PRIu64 " unreferenced blobs and %" PRIu64 " orphan records (%" PRIu64
            " records, %s); fixed %" PRIu64 " refcounts; dropped %" PRIu64 " unreferenced shared "
            "prefixes\n", g->blobs_dropped, g->orphan_records, g->records_dropped, B(g->bytes_dropped),
            g->refs_fixed, g->prefixes_dropped);
    if (r->compacted) fprintf(f, "compact: data.mdb %s -> %s\n", B(r->file_bytes_before), B(r->file_bytes_after));
}

void kvz_store_report_print_salvage(FILE *f, const char *src, const char *dst, const kvz_store_salvage_result *r)
{
    fprintf(f, "salvage: %" PRIu64 " of %" PRIu64 " documents copied from %s to %s; %" PRIu64 " lost%s\n",
            r->n_copied, r->n_docs, E(src), E(dst), r->n_lost,
            r->n_gaps ? ", and parts of the doc index could not be read (ids unknown)" : "");
}

void kvz_store_report_print_merge(FILE *f, const char *into, int n_sources, const kvz_merge_result *r)
{
    fprintf(f, "merge: %" PRIu64 " documents from %d store%s into %s: %" PRIu64 " copied, %" PRIu64
            " linked, %" PRIu64 " unchanged, %" PRIu64 " replaced, %" PRIu64 " skipped (blob "
            "does not verify), %" PRIu64 " conflicts resolved\n", r->n_docs, n_sources,
            n_sources == 1 ? "" : "s", E(into), r->copied, r->linked, r->unchanged, r->replaced, r->bad,
            r->conflicts);
}

void kvz_store_report_print_snapshot(FILE *f, const char *src, const char *dst, uint64_t bytes)
{
    fprintf(f, "snapshot: %s -> %s (%s, compacted)\n", E(src), E(dst), B(bytes));
}

void kvz_store_report_print_no_doc(FILE *f, const char *prog, const char *dir, const char *id, uint32_t n)
{
    fprintf(f, "%s: error: no document '%s' in %s", prog, E(id), E(dir));
    if (!n) fputs(" (list them with kvzip-store ls)\n", f);
    else if (n == 1) fprintf(f, ": it was stored in parts: '%s#1' (kvzip-store ls lists them)\n", E(id));
    else fprintf(f, ": it was stored in parts: '%s#1'..'%s#%u' (kvzip-store ls lists them)\n", E(id), E(id), n);
}

void kvz_store_report_print_problem(FILE *f, const char *prog, int err, const char *msg)
{
    fprintf(f, "%s: verify: %s (%s)\n", prog, E(msg), kvz_strerror(err));
}

void kvz_store_report_print_lost(FILE *f, const char *prog, const char *id, int err, const char *msg)
{
    if (id) fprintf(f, "%s: salvage: lost '%s': %s (%s)\n", prog, E(id), E(msg), kvz_strerror(err));
    else fprintf(f, "%s: salvage: %s (%s)\n", prog, E(msg), kvz_strerror(err));
}

void kvz_store_report_print_merge_event(FILE *f, const char *prog, int kind, const char *msg)
{
    /* the library's lines quote ids and paths as stored: escaped like every other line */
    if (kind == KVZ_MERGE_DOC) fprintf(f, "%s\n", E(msg));
    else if (kind == KVZ_MERGE_CORPUS && !strncmp(msg, "note: ", 6)) fprintf(f, "%s: merge: warning: %s\n", prog, E(msg + 6));
    else fprintf(f, "%s: merge: %s%s\n", prog, kind == KVZ_MERGE_CONFLICT ? "conflict: "
                 : kind == KVZ_MERGE_BAD_BLOB ? "error: " : "", E(msg));
}

void kvz_store_report_print_salvage_loss(FILE *f, const char *prog, const char *src, const char *dst,
                                         const kvz_store_salvage_result *r)
{
    fprintf(f, "%s: error: %s: %" PRIu64 " document%s lost%s", prog, E(src), r->n_lost, r->n_lost == 1 ? "" : "s",
            r->n_gaps ? " and unreadable stretches of the doc index" : "");
    if (r->n_copied) fprintf(f, " (the rest is in %s)\n", E(dst));
    else fprintf(f, "; nothing could be copied, so %s was not created\n", E(dst)); /* e.g. a damaged shared prefix */
}
