/* kvzip-store: list, inspect, verify, garbage-collect and compact a kvzip store. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "cli_util.h"
#include "kvz_blob.h"
#include "kvz_kvdtype.h"
#include "kvz_error.h"
#include "kvz_store.h"
#include "kvz_store_merge.h"

static void usage(void)
{
    printf(
        "usage: kvzip-store [--store DIR] [--json] COMMAND [ARG] [--] [ID]\n"
        "\n"
        "Commands:\n"
        "  ls              one line per document: id, tokens, kept ratio, stored bytes,\n"
        "                  compression (full KV cache / stored bytes), ingest date (UTC)\n"
        "  show ID         everything about one document: doc entry, blob dims, dtype,\n"
        "                  eviction parameters, kept pairs per layer and head, record sizes\n"
        "  rm ID           remove a document; its blob goes too when no other id names it\n"
        "  verify          check every record (checksums, decode META with the store's\n"
        "                  model fingerprint, decode every layer), every name -> blob link\n"
        "                  and every refcount; prints one line per problem on stderr\n"
        "  gc [--compact]  drop blobs that no document names and records without a blob\n"
        "                  entry (one transaction). With --compact, also rewrite the store\n"
        "                  into a compacted copy (free pages dropped, file shrinks) and swap\n"
        "                  it in atomically. Run --compact when no kvzip-ingest or other\n"
        "                  writer is running: writers are held off during the copy, and a\n"
        "                  writer that had the store open before fails afterwards with\n"
        "                  'reopen it' instead of writing, but do not rely on that.\n"
        "                  Needs free disk space about the size of the data in use.\n"
        "  stats           totals: documents, blobs, records, tokens, KV bytes (full,\n"
        "                  kept, stored), compression, map and file size, last txn id\n"
        "  salvage DST     copy every document that still reads back intact (entry,\n"
        "                  META and every layer decode) into a new store in folder DST;\n"
        "                  prints one line per document it could not copy. Works on a\n"
        "                  damaged store (a data.mdb cut short or with damaged pages);\n"
        "                  the store itself is only read. Exit 0 when nothing was lost\n"
        "                  and 5 when something was\n"
        "  merge SRC... --into DST [--prefer newest] [--allow-mixed-corpus] [--quiet]\n"
        "                  copy every document of the SRC stores into DST (created when\n"
        "                  missing), one transaction per document: a blob is fully decoded\n"
        "                  first and skipped (reported, exit 1) when it does not verify; a\n"
        "                  content hash DST already has is linked, not copied. An id with\n"
        "                  different content in two sources is a conflict: merge lists the\n"
        "                  conflicts and writes nothing (exit 1), unless --prefer newest\n"
        "                  (the newest ingest wins). Sources made from different corpus\n"
        "                  listings (recorded by kvzip-ingest --shard) are refused the same\n"
        "                  way unless --allow-mixed-corpus. Refuses stores of another model\n"
        "                  (exit 4) and DST among the sources (exit 2). Rerun after an\n"
        "                  interruption to finish (one transaction per document);\n"
        "                  a repeated merge writes nothing.\n"
        "  snapshot DIR    consistent compacted copy of the store (LMDB copy with\n"
        "                  compaction, of one read snapshot) into DIR, which must not exist\n"
        "                  or be empty (exit 1 otherwise); safe while kvzip-ingest writes.\n"
        "                  Ship DIR to query hosts and open it there read-only.\n"
        "\n"
        "Options:\n"
        "  --store DIR     store folder (default: $KVZ_STORE or ./%s)\n"
        "  --json          machine-readable output: one JSON object on stdout\n"
        "  -h, --help      this text\n"
        "  --              end of options: an id that begins with '-' (rm -- -x.txt)\n"
        "\n"
        "Ids and messages are printed with control characters escaped (\\n, \\r, \\t,\n"
        "\\\\, \\xHH, \\u00HH for C1 codes), so a file name cannot drive the terminal or\n"
        "fake an ls row; --json escapes them as JSON does.\n"
        "\n"
        "A damaged store (truncated data.mdb, damaged pages) is refused with 'store\n"
        "damaged: ...' and exit 5 by every command except salvage; docs/ERRORS.md says\n"
        "how to recover.\n"
        "\n"
        "Readers (ls, show, verify, stats) see a consistent snapshot and may run while\n"
        "kvzip-ingest writes. rm and gc wait for a running writer to finish.\n"
        "\n"
        "Exit status: 0 ok; 2 usage; 5 store problem (verify found problems, damaged,\n"
        "corrupt or unreadable store, store full, salvage lost documents); 6 store or\n"
        "document not found; 1 other errors\n"
        "(docs/ERRORS.md).\n",
        KVZ_DEFAULT_STORE);
}

static int json;

/* @p s for a terminal: C0 controls, DEL and backslash as \n \r \t \\ \xHH, UTF-8
 * encoded C1 controls as \u00HH, bytes that are not UTF-8 as \xHH; everything
 * else as is. Returns @p buf (truncated to @p cap). */
static const char *esc(const char *s, char *buf, size_t cap)
{
    static const char hx[] = "0123456789abcdef";
    size_t o = 0;
    const unsigned char *p = (const unsigned char *)s;
    while (*p && o + 8 < cap) {
        unsigned c = *p;
        if (c == '\\') { buf[o++] = '\\'; buf[o++] = '\\'; p++; continue; }
        if (c == '\n' || c == '\r' || c == '\t') {
            buf[o++] = '\\';
            buf[o++] = c == '\n' ? 'n' : c == '\r' ? 'r' : 't';
            p++;
            continue;
        }
        if (c < 0x20 || c == 0x7f) {
            buf[o++] = '\\'; buf[o++] = 'x'; buf[o++] = hx[c >> 4]; buf[o++] = hx[c & 15];
            p++;
            continue;
        }
        if (c < 0x80) { buf[o++] = (char)c; p++; continue; }
        /* a UTF-8 sequence: length from the lead byte, continuation bytes checked */
        int n = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
        int ok = n > 0;
        for (int i = 1; ok && i < n; i++) ok = (p[i] & 0xc0) == 0x80;
        if (!ok) {
            buf[o++] = '\\'; buf[o++] = 'x'; buf[o++] = hx[c >> 4]; buf[o++] = hx[c & 15];
            p++;
            continue;
        }
        if (n == 2 && c == 0xc2 && p[1] < 0xa0) { /* U+0080..U+009F: C1 controls */
            memcpy(buf + o, "\\u00", 4);
            o += 4;
            buf[o++] = hx[p[1] >> 4];
            buf[o++] = hx[p[1] & 15];
            p += 2;
            continue;
        }
        for (int i = 0; i < n; i++) buf[o++] = (char)p[i];
        p += n;
    }
    buf[o] = 0;
    return buf;
}

#define ESC_CAP 8192
/* esc() into one of 4 static slots, so one printf may escape several strings */
static const char *E(const char *s)
{
    static char slots[4][ESC_CAP];
    static int next;
    char *b = slots[next];
    next = (next + 1) % 4;
    return esc(s, b, ESC_CAP);
}

/* The cli_error() line, escaped as a whole: ids and library details may hold any byte. */
__attribute__((format(printf, 2, 3)))
static void store_error(int rc, const char *fmt, ...)
{
    char what[2048], line[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    const char *detail = kvz_error_detail();
    if (detail[0]) snprintf(line, sizeof line, "%s: %s (%s)", what, detail, kvz_strerror(rc));
    else snprintf(line, sizeof line, "%s: %s", what, kvz_strerror(rc));
    fprintf(stderr, "kvzip-store: error: %s\n", E(line));
    kvz_error_clear();
}

/* "no document" for @p id, with a hint when it was stored in parts (ID#1, ID#2, ...). */
static void no_doc(kvz_store *s, const char *path, const char *id)
{
    char part[KVZ_STORE_DOC_ID_MAX + 32];
    kvz_store_doc_info *pi = malloc(sizeof *pi);
    int n = 0;
    while (pi && n < 1000000) {
        snprintf(part, sizeof part, "%s#%d", id, n + 1);
        if (strlen(part) > KVZ_STORE_DOC_ID_MAX || kvz_store_lookup(s, part, pi) != 0) break;
        n++;
    }
    free(pi);
    kvz_error_clear();
    if (n == 1)
        fprintf(stderr, "kvzip-store: error: no document '%s' in %s: it was stored in parts: '%s#1' "
                "(kvzip-store ls lists them)\n", E(id), E(path), E(id));
    else if (n > 1)
        fprintf(stderr, "kvzip-store: error: no document '%s' in %s: it was stored in parts: "
                "'%s#1'..'%s#%d' (kvzip-store ls lists them)\n", E(id), E(path), E(id), E(id), n);
    else
        fprintf(stderr, "kvzip-store: error: no document '%s' in %s (list them with kvzip-store ls)\n",
                E(id), E(path));
}

/* Exit code of a store operation: 6 not found, 2 usage, 1 out of memory or a
 * bug, 5 anything wrong with the store itself (corrupt, other version, LMDB, full). */
static int store_exit(int rc)
{
    switch (rc) {
    case KVZ_OK: return EXIT_OK;
    case KVZ_ERR_NOTFOUND: return EXIT_NOTFOUND;
    case KVZ_ERR_ARG: return EXIT_USAGE;
    case KVZ_ERR_NOMEM: case KVZ_ERR_INTERNAL: return EXIT_FAIL;
    default: return EXIT_STORE;
    }
}

static void hex16(const uint8_t *b, char out[33])
{
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) { out[2 * i] = hx[b[i] >> 4]; out[2 * i + 1] = hx[b[i] & 15]; }
    out[32] = 0;
}

static void fmt_date(int64_t t, char out[32])
{
    time_t tt = (time_t)t;
    struct tm tm;
    if (!gmtime_r(&tt, &tm) || !strftime(out, 32, "%Y-%m-%d %H:%M:%S", &tm))
        snprintf(out, 32, "?");
}

static void fmt_bytes(uint64_t b, char out[32])
{
    if (b < 10000) snprintf(out, 32, "%" PRIu64 " B", b);
    else if (b < 10000000) snprintf(out, 32, "%.1f kB", b / 1e3);
    else if (b < 10000000000ull) snprintf(out, 32, "%.1f MB", b / 1e6);
    else snprintf(out, 32, "%.2f GB", b / 1e9);
}

static double ratio_of(uint64_t a, uint64_t b) { return b ? (double)a / (double)b : 0.0; }

static const char *dtype_name(uint8_t d)
{
    const char *n = kvz_kv_dtype_name(d); /* f32 f16 bf16 q8 q4 (common/kvz_kvdtype.h) */
    return n ? n : "?";
}

static const char *mode_name(uint8_t m)
{
    return m == KVZ_MODE_GLOBAL ? "global" : m == KVZ_MODE_UNIFORM ? "uniform" : "?";
}

/* ========================================================================= */
/* ls                                                                          */

typedef struct {
    int n;
} ls_state;

static int ls_cb(void *u, const char *id, const kvz_store_doc_info *in)
{
    ls_state *st = u;
    char date[32], hx[33];
    fmt_date(in->ingest_time, date);
    hex16(in->hash, hx);
    if (json) {
        printf("%s\n    {\"id\": ", st->n ? "," : "");
        cli_json_str(stdout, id, strlen(id));
        printf(", \"tokens\": %" PRIu64 ", \"ratio\": %.4f, \"mode\": \"%s\", \"bytes_stored\": %"
               PRIu64 ", \"bytes_kv_full\": %" PRIu64 ", \"bytes_kv_kept\": %" PRIu64
               ", \"compression\": %.3f, \"records\": %u, \"hash\": \"%s\", \"ingest_time\": %"
               PRId64 ", \"date\": \"%s\", \"source\": ",
               in->n_tokens, in->ratio, mode_name(in->mode), in->bytes_stored, in->bytes_kv_full,
               in->bytes_kv_kept, ratio_of(in->bytes_kv_full, in->bytes_stored), in->n_records, hx,
               in->ingest_time, date);
        cli_json_str(stdout, in->source_path, strlen(in->source_path));
        printf("}");
    } else {
        char b[32];
        fmt_bytes(in->bytes_stored, b);
        printf("%-40s %8" PRIu64 " %6.3f %10s %7.2fx  %s\n", E(id), in->n_tokens, in->ratio, b,
               ratio_of(in->bytes_kv_full, in->bytes_stored), date);
    }
    st->n++;
    return 0;
}

static int cmd_ls(kvz_store *s, const char *path)
{
    ls_state st = {0};
    if (json) {
        printf("{\"store\": ");
        cli_json_str(stdout, path, strlen(path));
        printf(", \"docs\": [");
    } else {
        printf("%-40s %8s %6s %10s %8s  %s\n", "ID", "TOKENS", "RATIO", "STORED", "COMPR", "DATE (UTC)");
    }
    int rc = kvz_store_list(s, ls_cb, &st);
    if (json) printf("%s]}\n", st.n ? "\n  " : "");
    if (rc) {
        store_error(rc, "cannot list %s", path);
        return store_exit(rc);
    }
    return EXIT_OK;
}

/* ========================================================================= */
/* show                                                                        */

static int cmd_show(kvz_store *s, const char *path, const char *id)
{
    kvz_store_read *r;
    int rc = kvz_store_read_begin(s, &r);
    if (rc) { store_error(rc, "cannot read %s", path); return store_exit(rc); }
    kvz_store_doc_info *in = malloc(sizeof *in);
    kvz_blob_meta m = {0};
    uint64_t *rec_bytes = NULL, *raw_bytes = NULL;
    uint64_t meta_bytes = 0;
    if (!in) { rc = KVZ_ERR_NOMEM; store_error(rc, "show"); goto out; }
    if ((rc = kvz_store_read_doc(r, id, in))) {
        if (rc == KVZ_ERR_NOTFOUND) no_doc(s, path, id);
        else store_error(rc, "cannot read document '%s'", id);
        goto out;
    }
    const uint8_t *rec;
    size_t len;
    if ((rc = kvz_store_read_meta(r, in->hash, &rec, &len)) ||
        (rc = kvz_blob_decode_meta(rec, len, NULL, &m))) {
        store_error(rc, "document '%s': cannot read its blob's META record", id);
        goto out;
    }
    meta_bytes = len;
    rec_bytes = calloc(m.n_layer, sizeof *rec_bytes);
    raw_bytes = calloc(m.n_layer, sizeof *raw_bytes);
    if (!rec_bytes || !raw_bytes) { rc = KVZ_ERR_NOMEM; store_error(rc, "show"); goto out; }
    for (uint32_t l = 0; l < m.n_layer; l++) {
        if ((rc = kvz_store_read_layer(r, in->hash, l, &rec, &len))) {
            store_error(rc, "document '%s': layer %u record", id, l);
            goto out;
        }
        rec_bytes[l] = len;
        raw_bytes[l] = kvz_blob_layer_raw_size(&m, l);
    }
    char hx[33], fp[33], date[32];
    hex16(in->hash, hx);
    hex16(m.fingerprint, fp);
    fmt_date(in->ingest_time, date);
    const uint32_t H = m.n_kv_head;
    uint64_t kept_total = 0, raw_total = 0, rec_total = meta_bytes;
    uint32_t cmin = UINT32_MAX, cmax = 0;
    for (uint32_t l = 0; l < m.n_layer; l++) {
        kept_total += kvz_blob_layer_kept(&m, l);
        raw_total += raw_bytes[l];
        rec_total += rec_bytes[l];
        for (uint32_t h = 0; h < H; h++) {
            uint32_t c = m.counts[l * H + h];
            if (c < cmin) cmin = c;
            if (c > cmax) cmax = c;
        }
    }
    const uint64_t ctx_pairs = (uint64_t)m.n_layer * H * m.n_context;
    const uint64_t kept_ctx = m.prefix_policy == KVZ_PREFIX_KEEP
                                  ? kept_total - (uint64_t)m.n_layer * H * m.n_prefix : kept_total;
    if (json) {
        printf("{\"id\": ");
        cli_json_str(stdout, id, strlen(id));
        printf(", \"source\": ");
        cli_json_str(stdout, in->source_path, strlen(in->source_path));
        printf(", \"hash\": \"%s\", \"tokens\": %" PRIu64 ", \"ingest_time\": %" PRId64
               ", \"date\": \"%s\", \"records\": %u, \"bytes_stored\": %" PRIu64
               ", \"bytes_kv_full\": %" PRIu64 ", \"bytes_kv_kept\": %" PRIu64
               ", \"compression\": %.3f,\n \"blob\": {\"model_fp\": \"%s\", \"n_layer\": %u, "
               "\"n_head\": %u, \"n_kv_head\": %u, \"head_dim\": %u, \"dtype\": \"%s\", \"mode\": "
               "\"%s\", \"prefix_policy\": \"%s\", \"ratio\": %.4f, \"chunk\": %u, \"overlap\": %u, "
               "\"n_prefix\": %u, \"n_context\": %u, \"pairs_kept\": %" PRIu64
               ", \"context_pairs\": %" PRIu64 ", \"context_pairs_kept\": %" PRIu64
               ", \"kept_per_head_min\": %u, \"kept_per_head_max\": %u, \"bytes_raw\": %" PRIu64
               ", \"bytes_records\": %" PRIu64 ", \"meta_record_bytes\": %" PRIu64 ",\n  \"layers\": [",
               hx, in->n_tokens, in->ingest_time, date, in->n_records, in->bytes_stored,
               in->bytes_kv_full, in->bytes_kv_kept, ratio_of(in->bytes_kv_full, in->bytes_stored),
               fp, m.n_layer, m.n_head, m.n_kv_head, m.head_dim, dtype_name(m.dtype),
               mode_name(m.mode), m.prefix_policy == KVZ_PREFIX_KEEP ? "keep" : m.prefix_policy == KVZ_PREFIX_SHARED ? "shared" : "none", m.ratio,
               m.chunk, m.overlap, m.n_prefix, m.n_context, kept_total, ctx_pairs, kept_ctx, cmin,
               cmax, raw_total, rec_total, meta_bytes);
        for (uint32_t l = 0; l < m.n_layer; l++) {
            printf("%s\n   {\"layer\": %u, \"kept\": %" PRIu64 ", \"heads\": [", l ? "," : "", l,
                   kvz_blob_layer_kept(&m, l));
            for (uint32_t h = 0; h < H; h++) printf("%s%u", h ? ", " : "", m.counts[l * H + h]);
            printf("], \"bytes_raw\": %" PRIu64 ", \"bytes_record\": %" PRIu64 "}", raw_bytes[l],
                   rec_bytes[l]);
        }
        printf("]}}\n");
    } else {
        char b1[32], b2[32], b3[32], b4[32];
        printf("document     %s\n", E(id));
        printf("source       %s\n", in->source_path[0] ? E(in->source_path) : "-");
        printf("hash         %s\n", hx);
        printf("ingested     %s UTC\n", date);
        printf("tokens       %" PRIu64 " (%u system prefix + %u context)\n", in->n_tokens,
               m.n_prefix, m.n_context);
        fmt_bytes(in->bytes_kv_full, b1);
        fmt_bytes(in->bytes_kv_kept, b2);
        fmt_bytes(in->bytes_stored, b3);
        printf("KV bytes     full %s, kept %s, stored %s in %u records\n", b1, b2, b3, in->n_records);
        printf("compression  %.2fx overall (eviction %.2fx, zstd %.2fx)\n",
               ratio_of(in->bytes_kv_full, in->bytes_stored),
               ratio_of(in->bytes_kv_full, in->bytes_kv_kept),
               ratio_of(in->bytes_kv_kept, in->bytes_stored));
        printf("model        %s\n", fp);
        printf("dims         %u layers, %u query heads, %u KV heads, head_dim %u, %s\n", m.n_layer,
               m.n_head, m.n_kv_head, m.head_dim, dtype_name(m.dtype));
        printf("eviction     %s, ratio %.3f, chunk %u, overlap %u, prefix %s\n", mode_name(m.mode),
               m.ratio, m.chunk, m.overlap, m.prefix_policy == KVZ_PREFIX_KEEP ? "kept" : m.prefix_policy == KVZ_PREFIX_SHARED ? "shared (one copy per store)" : "not stored");
        printf("kept pairs   %" PRIu64 " (context %" PRIu64 " of %" PRIu64 " = %.3f); per head %u..%u\n",
               kept_total, kept_ctx, ctx_pairs, ratio_of(kept_ctx, ctx_pairs), cmin, cmax);
        fmt_bytes(raw_total, b1);
        fmt_bytes(rec_total, b4);
        printf("records      META %" PRIu64 " B; layers raw %s -> %s (zstd %.2fx)\n", meta_bytes, b1,
               b4, ratio_of(raw_total, rec_total - meta_bytes));
        printf("\n%5s %8s %10s %10s  %s\n", "LAYER", "KEPT", "RAW", "RECORD", "PER KV HEAD");
        for (uint32_t l = 0; l < m.n_layer; l++) {
            printf("%5u %8" PRIu64 " %10" PRIu64 " %10" PRIu64 "  ", l, kvz_blob_layer_kept(&m, l),
                   raw_bytes[l], rec_bytes[l]);
            for (uint32_t h = 0; h < H && h < 16; h++) printf("%s%u", h ? " " : "", m.counts[l * H + h]);
            printf("%s\n", H > 16 ? " ..." : "");
        }
    }
out:
    kvz_blob_meta_free(&m);
    free(rec_bytes);
    free(raw_bytes);
    free(in);
    kvz_store_read_end(r);
    return rc ? store_exit(rc) : EXIT_OK;
}

/* ========================================================================= */
/* rm, verify, gc, stats                                                       */

static int cmd_rm(kvz_store *s, const char *path, const char *id)
{
    int rc = kvz_store_delete_doc(s, id);
    if (rc == KVZ_ERR_NOTFOUND) {
        no_doc(s, path, id);
        return EXIT_NOTFOUND;
    }
    if (rc) { store_error(rc, "cannot remove '%s'", id); return store_exit(rc); }
    if (json) {
        printf("{\"removed\": ");
        cli_json_str(stdout, id, strlen(id));
        printf("}\n");
    } else {
        printf("removed %s\n", E(id));
    }
    return EXIT_OK;
}

static int on_problem(void *u, int err, const char *msg)
{
    (void)u;
    fprintf(stderr, "kvzip-store: verify: %s (%s)\n", E(msg), kvz_strerror(err));
    return 0;
}

static int cmd_verify(kvz_store *s, const char *path)
{
    kvz_store_verify_result vr;
    const double t0 = (double)clock() / CLOCKS_PER_SEC;
    int rc = kvz_store_verify(s, on_problem, NULL, &vr);
    if (rc) { store_error(rc, "cannot verify %s", path); return store_exit(rc); }
    const double secs = (double)clock() / CLOCKS_PER_SEC - t0;
    if (json)
        printf("{\"ok\": %s, \"docs\": %" PRIu64 ", \"blobs\": %" PRIu64 ", \"records\": %" PRIu64
               ", \"problems\": %" PRIu64 ", \"cpu_s\": %.3f}\n", vr.n_problems ? "false" : "true",
               vr.n_docs, vr.n_blobs, vr.n_records, vr.n_problems, secs);
    else
        printf("%s: %" PRIu64 " documents, %" PRIu64 " blobs, %" PRIu64 " records decoded: %s\n",
               E(path), vr.n_docs, vr.n_blobs, vr.n_records, vr.n_problems ? "PROBLEMS" : "ok");
    if (vr.n_problems) {
        fprintf(stderr, "kvzip-store: error: %s: %" PRIu64 " problem%s found\n", E(path),
                vr.n_problems, vr.n_problems == 1 ? "" : "s");
        return EXIT_STORE;
    }
    return EXIT_OK;
}

static int cmd_gc(kvz_store **sp, const char *path, int compact)
{
    kvz_store_gc_result g;
    int rc = kvz_store_gc(*sp, &g);
    if (rc) { store_error(rc, "gc of %s failed", path); return store_exit(rc); }
    uint64_t before = 0, after = 0;
    if (compact) {
        rc = kvz_store_compact(*sp, &before, &after);
        if (rc) { store_error(rc, "compacting %s failed (store unchanged)", path); return store_exit(rc); }
        kvz_store_close(*sp); /* retired by the swap */
        *sp = NULL;
    }
    if (json) {
        printf("{\"blobs_dropped\": %" PRIu64 ", \"records_dropped\": %" PRIu64
               ", \"bytes_dropped\": %" PRIu64 ", \"orphan_records\": %" PRIu64
               ", \"refs_fixed\": %" PRIu64 ", \"prefixes_dropped\": %" PRIu64, g.blobs_dropped,
               g.records_dropped, g.bytes_dropped, g.orphan_records, g.refs_fixed, g.prefixes_dropped);
        if (compact) printf(", \"file_bytes_before\": %" PRIu64 ", \"file_bytes_after\": %" PRIu64, before, after);
        printf("}\n");
    } else {
        char b[32];
        fmt_bytes(g.bytes_dropped, b);
        printf("gc: dropped %" PRIu64 " unreferenced blobs and %" PRIu64 " orphan records (%" PRIu64
               " records, %s); fixed %" PRIu64 " refcounts; dropped %" PRIu64 " unreferenced shared "
               "prefixes\n", g.blobs_dropped, g.orphan_records, g.records_dropped, b, g.refs_fixed,
               g.prefixes_dropped);
        if (compact) {
            char b1[32], b2[32];
            fmt_bytes(before, b1);
            fmt_bytes(after, b2);
            printf("compact: data.mdb %s -> %s\n", b1, b2);
        }
    }
    return EXIT_OK;
}

static int on_lost(void *u, const char *id, int err, const char *msg)
{
    (void)u;
    if (id) fprintf(stderr, "kvzip-store: salvage: lost '%s': %s (%s)\n", E(id), E(msg), kvz_strerror(err));
    else fprintf(stderr, "kvzip-store: salvage: %s (%s)\n", E(msg), kvz_strerror(err));
    return 0;
}

static int cmd_salvage(kvz_store *s, const char *path, const char *dst)
{
    kvz_store_salvage_result r;
    int rc = kvz_store_salvage(s, dst, on_lost, NULL, &r);
    if (rc) { store_error(rc, "salvage of %s into %s failed", path, dst); return store_exit(rc); }
    if (json) {
        printf("{\"store\": ");
        cli_json_str(stdout, path, strlen(path));
        printf(", \"into\": ");
        cli_json_str(stdout, dst, strlen(dst));
        printf(", \"docs\": %" PRIu64 ", \"copied\": %" PRIu64 ", \"lost\": %" PRIu64
               ", \"unreadable_stretches\": %" PRIu64 "}\n", r.n_docs, r.n_copied, r.n_lost, r.n_gaps);
    } else {
        printf("salvage: %" PRIu64 " of %" PRIu64 " documents copied from %s to %s; %" PRIu64 " lost%s\n",
               r.n_copied, r.n_docs, E(path), E(dst), r.n_lost,
               r.n_gaps ? ", and parts of the doc index could not be read (ids unknown)" : "");
    }
    if (r.n_lost || r.n_gaps) {
        if (r.n_copied)
            fprintf(stderr, "kvzip-store: error: %s: %" PRIu64 " document%s lost%s (the rest is in %s)\n",
                    E(path), r.n_lost, r.n_lost == 1 ? "" : "s",
                    r.n_gaps ? " and unreadable stretches of the doc index" : "", E(dst));
        else /* e.g. the shared system prefix every document needs was damaged */
            fprintf(stderr, "kvzip-store: error: %s: %" PRIu64 " document%s lost%s; nothing could be "
                    "copied, so %s was not created\n", E(path), r.n_lost, r.n_lost == 1 ? "" : "s",
                    r.n_gaps ? " and unreadable stretches of the doc index" : "", E(dst));
        return EXIT_STORE;
    }
    return EXIT_OK;
}

typedef struct {
    uint64_t tokens, full, kept, stored;
} totals;

static int tot_cb(void *u, const char *id, const kvz_store_doc_info *in)
{
    (void)id;
    totals *t = u;
    t->tokens += in->n_tokens;
    t->full += in->bytes_kv_full;
    t->kept += in->bytes_kv_kept;
    t->stored += in->bytes_stored;
    return 0;
}

static int cmd_stats(kvz_store *s, const char *path)
{
    kvz_store_stats st;
    totals t = {0};
    int rc = kvz_store_stats_get(s, &st);
    if (!rc) rc = kvz_store_list(s, tot_cb, &t);
    if (rc) { store_error(rc, "cannot read %s", path); return store_exit(rc); }
    char p[4200], fp[33] = "";
    struct stat fs;
    snprintf(p, sizeof p, "%s/data.mdb", path);
    uint64_t file = stat(p, &fs) == 0 ? (uint64_t)fs.st_size : 0;
    if (st.has_model) hex16(st.model_fp, fp);
    if (json) {
        printf("{\"store\": ");
        cli_json_str(stdout, path, strlen(path));
        printf(", \"docs\": %" PRIu64 ", \"blobs\": %" PRIu64 ", \"records\": %" PRIu64
               ", \"tokens\": %" PRIu64 ", \"bytes_kv_full\": %" PRIu64 ", \"bytes_kv_kept\": %" PRIu64
               ", \"bytes_stored_docs\": %" PRIu64 ", \"bytes_records\": %" PRIu64
               ", \"compression\": %.3f, \"eviction\": %.3f, \"zstd\": %.3f, \"map_size\": %" PRIu64
               ", \"map_used\": %" PRIu64 ", \"file_bytes\": %" PRIu64 ", \"page_size\": %u"
               ", \"last_txnid\": %" PRIu64 ", \"model_fp\": %s%s%s}\n",
               st.n_docs, st.n_blobs, st.n_records, t.tokens, t.full, t.kept, t.stored,
               st.bytes_records, ratio_of(t.full, t.stored), ratio_of(t.full, t.kept),
               ratio_of(t.kept, t.stored), st.map_size, st.map_used, file, st.page_size,
               st.last_txnid, st.has_model ? "\"" : "", st.has_model ? fp : "null",
               st.has_model ? "\"" : "");
    } else {
        char b1[32], b2[32], b3[32], b4[32], b5[32], b6[32];
        fmt_bytes(t.full, b1);
        fmt_bytes(t.kept, b2);
        fmt_bytes(st.bytes_records, b3);
        fmt_bytes(st.map_size, b4);
        fmt_bytes(st.map_used, b5);
        fmt_bytes(file, b6);
        printf("store        %s\n", E(path));
        printf("model        %s\n", st.has_model ? fp : "(none yet)");
        printf("documents    %" PRIu64 " (%" PRIu64 " tokens)\n", st.n_docs, t.tokens);
        printf("blobs        %" PRIu64 " (%" PRIu64 " records, %s)\n", st.n_blobs, st.n_records, b3);
        printf("KV bytes     full %s, kept %s, stored %s\n", b1, b2, b3);
        printf("compression  %.2fx overall (eviction %.2fx, zstd %.2fx; per document, before "
               "sharing)\n", ratio_of(t.full, t.stored), ratio_of(t.full, t.kept),
               ratio_of(t.kept, t.stored));
        printf("map          %s in use of %s mapped; data.mdb %s; page %u B\n", b5, b4, b6, st.page_size);
        printf("last txn     %" PRIu64 "\n", st.last_txnid);
    }
    return EXIT_OK;
}

/* ========================================================================= */

/* ========================================================================= */
/* merge, snapshot (docs/SCALE.md)                                             */

static int on_merge(void *u, int kind, const char *msg)
{
    const int *quiet = u;
    if (kind == KVZ_MERGE_DOC) {
        if (!*quiet && !json) fprintf(stderr, "%s\n", msg);
    } else if (kind == KVZ_MERGE_CONFLICT) {
        fprintf(stderr, "kvzip-store: merge: conflict: %s\n", msg);
    } else if (kind == KVZ_MERGE_CORPUS && !strncmp(msg, "note: ", 6)) {
        fprintf(stderr, "kvzip-store: merge: warning: %s\n", msg + 6);
    } else {
        fprintf(stderr, "kvzip-store: merge: %s%s\n", kind == KVZ_MERGE_BAD_BLOB ? "error: " : "", msg);
    }
    return 0;
}

static int cmd_merge(const char **srcs, int n, const char *into, const kvz_merge_opts *o, int quiet)
{
    kvz_merge_result r;
    int rc = kvz_store_merge(srcs, (size_t)n, into, o, on_merge, &quiet, &r);
    if (rc) {
        if (rc == KVZ_ERR_MODEL || rc == KVZ_ERR_ARG || rc == KVZ_ERR_NOTFOUND) {
            fprintf(stderr, "kvzip-store: error: %s (%s)\n", kvz_error_detail(), kvz_strerror(rc));
            kvz_error_clear();
        } else {
            cli_error(rc, "merge into %s stopped (documents merged so far stay; rerun to finish)", into);
        }
        return rc == KVZ_ERR_MODEL ? EXIT_MODEL : store_exit(rc);
    }
    if (r.refused) {
        if (r.conflicts)
            fprintf(stderr, "kvzip-store: error: %" PRIu64 " document id%s with different content in "
                    "two sources; nothing merged (--prefer newest takes the newest ingest)\n",
                    r.conflicts, r.conflicts == 1 ? "" : "s");
        else
            fprintf(stderr, "kvzip-store: error: the sources were made from different corpus "
                    "listings; nothing merged (re-run the stale shards, or --allow-mixed-corpus)\n");
        return EXIT_FAIL;
    }
    if (json) {
        printf("{\"into\": ");
        cli_json_str(stdout, into, strlen(into));
        printf(", \"docs\": %" PRIu64 ", \"copied\": %" PRIu64 ", \"linked\": %" PRIu64
               ", \"unchanged\": %" PRIu64 ", \"replaced\": %" PRIu64 ", \"bad\": %" PRIu64
               ", \"conflicts_resolved\": %" PRIu64 ", \"mixed_corpus\": %s, \"bytes_copied\": %" PRIu64 "}\n",
               r.n_docs, r.copied, r.linked, r.unchanged, r.replaced, r.bad, r.conflicts,
               r.mixed_corpus ? "true" : "false", r.bytes_copied);
    } else {
        printf("merge: %" PRIu64 " documents from %d store%s into %s: %" PRIu64 " copied, %" PRIu64
               " linked, %" PRIu64 " unchanged, %" PRIu64 " replaced, %" PRIu64 " skipped (blob "
               "does not verify), %" PRIu64 " conflicts resolved\n", r.n_docs, n, n == 1 ? "" : "s",
               into, r.copied, r.linked, r.unchanged, r.replaced, r.bad, r.conflicts);
    }
    if (r.bad) {
        fprintf(stderr, "kvzip-store: error: %" PRIu64 " document%s not merged: %s blob did not verify\n",
                r.bad, r.bad == 1 ? "" : "s", r.bad == 1 ? "its" : "their");
        return EXIT_FAIL;
    }
    return EXIT_OK;
}

static int cmd_snapshot(kvz_store *s, const char *path, const char *dir)
{
    int rc = kvz_store_snapshot(s, dir);
    if (rc) {
        if (rc == KVZ_ERR_ARG) {
            fprintf(stderr, "kvzip-store: error: %s (%s)\n", kvz_error_detail(), kvz_strerror(rc));
            kvz_error_clear();
            return EXIT_FAIL;
        }
        cli_error(rc, "snapshot of %s into %s failed (nothing left there)", path, dir);
        return store_exit(rc);
    }
    char p[4200];
    struct stat fs;
    snprintf(p, sizeof p, "%s/data.mdb", dir);
    const uint64_t bytes = stat(p, &fs) == 0 ? (uint64_t)fs.st_size : 0;
    if (json) {
        printf("{\"snapshot\": ");
        cli_json_str(stdout, dir, strlen(dir));
        printf(", \"bytes\": %" PRIu64 "}\n", bytes);
    } else {
        char b[32];
        fmt_bytes(bytes, b);
        printf("snapshot: %s -> %s (%s, compacted)\n", path, dir, b);
    }
    return EXIT_OK;
}

/* `kvzip-store [--json] merge SRC... --into DST ...`: its own argument list. */
static int main_merge(int argc, char **argv)
{
    const char **srcs = calloc((size_t)argc, sizeof *srcs);
    const char *into = NULL;
    int n = 0, seen = 0, quiet = 0;
    kvz_merge_opts o = {0, 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--quiet")) quiet = 1;
        else if (!strcmp(a, "--into")) into = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--prefer")) {
            const char *v = cli_value(argc, argv, &i);
            if (strcmp(v, "newest")) cli_usage_error("--prefer expects 'newest', got '%s'", v);
            o.prefer_newest = 1;
        } else if (!strcmp(a, "--allow-mixed-corpus")) o.allow_mixed_corpus = 1;
        else if (!strcmp(a, "--store")) cli_usage_error("merge names its stores as SRC... --into DST, not with --store");
        else if (a[0] == '-' && a[1] == '-' && a[2]) cli_usage_error("unknown option '%s'", a);
        else if (!seen && !strcmp(a, "merge")) seen = 1;
        else srcs[n++] = a;
    }
    if (!n) cli_usage_error("merge needs at least one source store: merge SRC... --into DST");
    if (!into) cli_usage_error("merge needs --into DST");
    int ex = cmd_merge(srcs, n, into, &o, quiet);
    free(srcs);
    return ex;
}

int main(int argc, char **argv)
{
    cli_init("kvzip-store", argv);
    for (int i = 1; i < argc; i++) { /* merge has its own argument syntax */
        if (!strcmp(argv[i], "--store")) { i++; continue; }
        if (argv[i][0] == '-') continue;
        if (!strcmp(argv[i], "merge")) return main_merge(argc, argv);
        break;
    }
    const char *store_flag = NULL, *cmd = NULL, *arg = NULL;
    int compact = 0, opts_done = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (opts_done) {
            if (!cmd) cmd = a;
            else if (!arg) arg = a;
            else cli_usage_error("unexpected argument '%s'", E(a));
        }
        else if (!strcmp(a, "--")) opts_done = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return EXIT_OK; }
        else if (!strcmp(a, "--store")) store_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--compact")) compact = 1;
        else if (a[0] == '-' && a[1] == '-' && a[2])
            cli_usage_error("unknown option '%s' (an id that begins with '-' goes after --)", E(a));
        else if (!cmd) cmd = a;
        else if (!arg) arg = a;
        else cli_usage_error("unexpected argument '%s'", E(a));
    }
    if (!cmd) cli_usage_error("no command given (ls, show, rm, verify, gc, stats, salvage, merge, snapshot)");
    if (!strcmp(cmd, "snapshot") && !arg) cli_usage_error("snapshot needs a target folder");
    const int salvage = !strcmp(cmd, "salvage");
    int needs_id = !strcmp(cmd, "show") || !strcmp(cmd, "rm") || !strcmp(cmd, "snapshot");
    int known = needs_id || salvage || !strcmp(cmd, "ls") || !strcmp(cmd, "verify") ||
                !strcmp(cmd, "gc") || !strcmp(cmd, "stats");
    if (!known) cli_usage_error("unknown command '%s'", E(cmd));
    if (needs_id && !arg) cli_usage_error("%s needs a document id", cmd);
    if (salvage && !arg) cli_usage_error("salvage needs a new folder DST to copy into");
    if (!needs_id && !salvage && arg) cli_usage_error("%s takes no argument, got '%s'", cmd, E(arg));
    if (compact && strcmp(cmd, "gc")) cli_usage_error("--compact goes with gc");

    const char *path = cli_store_path(store_flag);
    const int writes = !strcmp(cmd, "rm") || !strcmp(cmd, "gc");
    kvz_store *s;
    const unsigned oflags = writes ? 0 : salvage ? KVZ_STORE_READONLY | KVZ_STORE_SALVAGE : KVZ_STORE_READONLY;
    int rc = kvz_store_open(path, oflags, 0, NULL, &s);
    if (rc) {
        if (rc == KVZ_ERR_NOTFOUND) {
            fprintf(stderr, "kvzip-store: error: no store in %s (give --store DIR or set KVZ_STORE)\n",
                    E(path));
            kvz_error_clear();
        } else {
            store_error(rc, "cannot open store %s", path);
        }
        return store_exit(rc);
    }
    int ex;
    if (!strcmp(cmd, "ls")) ex = cmd_ls(s, path);
    else if (!strcmp(cmd, "show")) ex = cmd_show(s, path, arg);
    else if (!strcmp(cmd, "rm")) ex = cmd_rm(s, path, arg);
    else if (!strcmp(cmd, "verify")) ex = cmd_verify(s, path);
    else if (!strcmp(cmd, "gc")) ex = cmd_gc(&s, path, compact);
    else if (salvage) ex = cmd_salvage(s, path, arg);
    else if (!strcmp(cmd, "snapshot")) ex = cmd_snapshot(s, path, arg);
    else ex = cmd_stats(s, path);
    kvz_store_close(s);
    return ex;
}
