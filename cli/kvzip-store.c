/* kvzip-store: list, inspect, verify, garbage-collect, compact, salvage, merge and
 * snapshot a kvzip store. A thin main: the work and the --json objects are the store
 * library's (store/kvz_store_admin.h, store/kvz_store_report.h); this file parses
 * flags, prints text lines and chooses exit codes (docs/ERRORS.md). */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli_util.h"
#include "kvzip-store.help.h" /* cli_help: generated from cli/help/kvzip-store.txt */
#include "kvz_error.h"
#include "kvz_store.h"
#include "kvz_store_admin.h"
#include "kvz_store_merge.h"
#include "kvz_store_report.h"

#define E cli_escape
#define R kvz_store_ratio

static void usage(void) { fputs(cli_help, stdout); } /* cli/help/kvzip-store.txt */

static int json, compact;

/* Print a report object (released here) on stdout, then @p end. 1 when it could not
 * be made (out of memory; the error line is printed). */
static int dump(json_t *o, const char *end)
{
    const int bad = !o || json_dumpf(o, stdout, JSON_ENCODE_ANY | JSON_REAL_PRECISION(15));
    json_decref(o);
    if (bad) cli_error(KVZ_ERR_NOMEM, "cannot write the JSON output");
    else fputs(end, stdout);
    return bad;
}

/* Exit code of a store operation: 6 not found, 2 usage, 1 out of memory or a
 * bug, 5 anything wrong with the store itself (corrupt, other version, LMDB, full). */
static int store_exit(int rc)
{
    return rc == KVZ_OK ? EXIT_OK : rc == KVZ_ERR_NOTFOUND ? EXIT_NOTFOUND : rc == KVZ_ERR_ARG ? EXIT_USAGE
         : rc == KVZ_ERR_NOMEM || rc == KVZ_ERR_INTERNAL ? EXIT_FAIL : EXIT_STORE;
}
/* The error line of a failed store operation (cli_error), and its exit code. */
#define FAIL(rc, ...) (cli_error(rc, __VA_ARGS__), store_exit(rc))

/* "no document" for @p id, with a hint when it was stored in parts (ID#1, ID#2, ...). */
static int no_doc(kvz_store *s, const char *path, const char *id)
{
    const uint32_t n = kvz_store_count_parts(s, id);
    fprintf(stderr, "kvzip-store: error: no document '%s' in %s", E(id), E(path));
    if (!n) fputs(" (list them with kvzip-store ls)\n", stderr);
    else if (n == 1) fprintf(stderr, ": it was stored in parts: '%s#1' (kvzip-store ls lists them)\n", E(id));
    else fprintf(stderr, ": it was stored in parts: '%s#1'..'%s#%u' (kvzip-store ls lists them)\n", E(id), E(id), n);
    return EXIT_NOTFOUND;
}

static const char *B(uint64_t b) /* bytes for a text line; 8 rotating buffers */
{
    static char bufs[8][32];
    static unsigned next;
    char *out = bufs[next++ % 8];
    if (b < 10000) snprintf(out, 32, "%" PRIu64 " B", b);
    else if (b < 10000000) snprintf(out, 32, "%.1f kB", b / 1e3);
    else if (b < 10000000000ull) snprintf(out, 32, "%.1f MB", b / 1e6);
    else snprintf(out, 32, "%.2f GB", b / 1e9);
    return out;
}

static int ls_cb(void *u, const char *id, const kvz_store_doc_info *in)
{
    int *n = u;
    char date[32];
    kvz_store_fmt_date(in->ingest_time, date);
    if (!json)
        printf("%-40s %8" PRIu64 " %6.3f %10s %7.2fx  %s\n", E(id), in->n_tokens, in->ratio,
               B(in->bytes_stored), R(in->bytes_kv_full, in->bytes_stored), date);
    else if (fputs(*n ? ",\n    " : "\n    ", stdout), dump(kvz_report_doc(id, in), ""))
        return 1; /* ends the walk */
    (*n)++;
    return 0;
}

static int cmd_ls(kvz_store *s, const char *path, const char *arg)
{
    int n = 0, rc;
    (void)arg;
    if (!json) printf("%-40s %8s %6s %10s %8s  %s\n", "ID", "TOKENS", "RATIO", "STORED", "COMPR", "DATE (UTC)");
    else if (fputs("{\"store\": ", stdout), dump(kvz_report_text(path), ", \"docs\": [")) return EXIT_FAIL;
    rc = kvz_store_list(s, ls_cb, &n);
    if (json) printf("%s]}\n", n ? "\n  " : "");
    return rc == 1 ? EXIT_FAIL : rc ? FAIL(rc, "cannot list %s", path) : EXIT_OK;
}

static int cmd_show(kvz_store *s, const char *path, const char *id)
{
    kvz_store_doc_detail *d = malloc(sizeof *d);
    if (!d) return FAIL(KVZ_ERR_NOMEM, "show");
    int rc = kvz_store_doc_detail_get(s, id, d), ex = EXIT_OK;
    const kvz_store_doc_info *in = &d->info;
    const kvz_blob_meta *m = &d->meta;
    if (rc == KVZ_ERR_NOTFOUND && d->failed == KVZ_DETAIL_DOC) ex = no_doc(s, path, id);
    else if (rc && d->failed == KVZ_DETAIL_READ) ex = FAIL(rc, "cannot read %s", path);
    else if (rc && d->failed == KVZ_DETAIL_DOC) ex = FAIL(rc, "cannot read document '%s'", id);
    else if (rc && d->failed == KVZ_DETAIL_META) ex = FAIL(rc, "document '%s': cannot read its blob's META record", id);
    else if (rc && d->failed == KVZ_DETAIL_LAYER) ex = FAIL(rc, "document '%s': layer %u record", id, d->failed_layer);
    else if (rc) ex = FAIL(rc, "show");
    else if (json) ex = dump(kvz_report_doc_detail(id, d), "\n");
    else {
        char hx[33], fp[33], date[32];
        kvz_store_hex16(in->hash, hx);
        kvz_store_hex16(m->fingerprint, fp);
        kvz_store_fmt_date(in->ingest_time, date);
        printf("document     %s\nsource       %s\nhash         %s\ningested     %s UTC\n", E(id),
               in->source_path[0] ? E(in->source_path) : "-", hx, date);
        printf("tokens       %" PRIu64 " (%u system prefix + %u context)\n", in->n_tokens, m->n_prefix, m->n_context);
        printf("KV bytes     full %s, kept %s, stored %s in %u records\n", B(in->bytes_kv_full),
               B(in->bytes_kv_kept), B(in->bytes_stored), in->n_records);
        printf("compression  %.2fx overall (eviction %.2fx, zstd %.2fx)\nmodel        %s\n",
               R(in->bytes_kv_full, in->bytes_stored), R(in->bytes_kv_full, in->bytes_kv_kept),
               R(in->bytes_kv_kept, in->bytes_stored), fp);
        printf("dims         %u layers, %u query heads, %u KV heads, head_dim %u, %s\n", m->n_layer,
               m->n_head, m->n_kv_head, m->head_dim, kvz_store_dtype_name(m->dtype));
        printf("eviction     %s, ratio %.3f, chunk %u, overlap %u, prefix %s\n", kvz_store_mode_name(m->mode),
               m->ratio, m->chunk, m->overlap, m->prefix_policy == KVZ_PREFIX_KEEP ? "kept"
               : m->prefix_policy == KVZ_PREFIX_SHARED ? "shared (one copy per store)" : "not stored");
        printf("kept pairs   %" PRIu64 " (context %" PRIu64 " of %" PRIu64 " = %.3f); per head %u..%u\n",
               d->pairs_kept, d->context_pairs_kept, d->context_pairs,
               R(d->context_pairs_kept, d->context_pairs), d->kept_min, d->kept_max);
        printf("records      META %" PRIu64 " B; layers raw %s -> %s (zstd %.2fx)\n", d->meta_bytes,
               B(d->bytes_raw), B(d->bytes_records), R(d->bytes_raw, d->bytes_records - d->meta_bytes));
        printf("\n%5s %8s %10s %10s  %s\n", "LAYER", "KEPT", "RAW", "RECORD", "PER KV HEAD");
        for (uint32_t l = 0, H = m->n_kv_head; l < m->n_layer; l++) {
            printf("%5u %8" PRIu64 " %10" PRIu64 " %10" PRIu64 "  ", l, kvz_blob_layer_kept(m, l),
                   d->raw_bytes[l], d->rec_bytes[l]);
            for (uint32_t h = 0; h < H && h < 16; h++) printf("%s%u", h ? " " : "", m->counts[l * H + h]);
            printf("%s\n", H > 16 ? " ..." : "");
        }
    }
    kvz_store_doc_detail_free(d);
    free(d);
    return ex;
}

static int cmd_rm(kvz_store *s, const char *path, const char *id)
{
    int rc = kvz_store_delete_doc(s, id);
    if (rc == KVZ_ERR_NOTFOUND) return no_doc(s, path, id);
    if (rc) return FAIL(rc, "cannot remove '%s'", id);
    if (json) return dump(json_pack("{s:o}", "removed", kvz_report_text(id)), "\n");
    printf("removed %s\n", E(id));
    return EXIT_OK;
}

static int on_problem(void *u, int err, const char *msg)
{
    (void)u;
    fprintf(stderr, "kvzip-store: verify: %s (%s)\n", E(msg), kvz_strerror(err));
    return 0;
}

static int cmd_verify(kvz_store *s, const char *path, const char *arg)
{
    kvz_store_verify_result vr;
    const clock_t t0 = clock();
    int rc = kvz_store_verify(s, on_problem, NULL, &vr);
    (void)arg;
    if (rc) return FAIL(rc, "cannot verify %s", path);
    if (json && dump(kvz_report_verify(&vr, (double)(clock() - t0) / CLOCKS_PER_SEC), "\n")) return EXIT_FAIL;
    if (!json)
        printf("%s: %" PRIu64 " documents, %" PRIu64 " blobs, %" PRIu64 " records decoded: %s\n",
               E(path), vr.n_docs, vr.n_blobs, vr.n_records, vr.n_problems ? "PROBLEMS" : "ok");
    if (!vr.n_problems) return EXIT_OK;
    fprintf(stderr, "kvzip-store: error: %s: %" PRIu64 " problem%s found\n", E(path), vr.n_problems,
            vr.n_problems == 1 ? "" : "s");
    return EXIT_STORE;
}

static int cmd_gc(kvz_store *s, const char *path, const char *arg)
{
    kvz_store_gc_compact_result r;
    const kvz_store_gc_result *g = &r.gc;
    int rc = kvz_store_gc_compact(s, compact, &r);
    (void)arg;
    if (rc) return r.gc_done ? FAIL(rc, "compacting %s failed (store unchanged)", path) : FAIL(rc, "gc of %s failed", path);
    if (json) return dump(kvz_report_gc(&r), "\n");
    printf("gc: dropped %" PRIu64 " unreferenced blobs and %" PRIu64 " orphan records (%" PRIu64
           " records, %s); fixed %" PRIu64 " refcounts; dropped %" PRIu64 " unreferenced shared "
           "prefixes\n", g->blobs_dropped, g->orphan_records, g->records_dropped, B(g->bytes_dropped),
           g->refs_fixed, g->prefixes_dropped);
    if (compact) printf("compact: data.mdb %s -> %s\n", B(r.file_bytes_before), B(r.file_bytes_after));
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
    if (rc) return FAIL(rc, "salvage of %s into %s failed", path, dst);
    if (json && dump(kvz_report_salvage(path, dst, &r), "\n")) return EXIT_FAIL;
    if (!json)
        printf("salvage: %" PRIu64 " of %" PRIu64 " documents copied from %s to %s; %" PRIu64 " lost%s\n",
               r.n_copied, r.n_docs, E(path), E(dst), r.n_lost,
               r.n_gaps ? ", and parts of the doc index could not be read (ids unknown)" : "");
    if (!r.n_lost && !r.n_gaps) return EXIT_OK;
    fprintf(stderr, "kvzip-store: error: %s: %" PRIu64 " document%s lost%s", E(path), r.n_lost,
            r.n_lost == 1 ? "" : "s", r.n_gaps ? " and unreadable stretches of the doc index" : "");
    if (r.n_copied) fprintf(stderr, " (the rest is in %s)\n", E(dst));
    else fprintf(stderr, "; nothing could be copied, so %s was not created\n", E(dst)); /* e.g. a damaged shared prefix */
    return EXIT_STORE;
}

static int cmd_stats(kvz_store *s, const char *path, const char *arg)
{
    kvz_store_summary t;
    const kvz_store_stats *st = &t.st;
    char fp[33] = "(none yet)";
    int rc = kvz_store_summary_get(s, path, &t);
    (void)arg;
    if (rc) return FAIL(rc, "cannot read %s", path);
    if (json) return dump(kvz_report_summary(path, &t), "\n");
    if (st->has_model) kvz_store_hex16(st->model_fp, fp);
    printf("store        %s\nmodel        %s\n", E(path), fp);
    printf("documents    %" PRIu64 " (%" PRIu64 " tokens)\n", st->n_docs, t.tokens);
    printf("blobs        %" PRIu64 " (%" PRIu64 " records, %s)\n", st->n_blobs, st->n_records, B(st->bytes_records));
    printf("KV bytes     full %s, kept %s, stored %s\n", B(t.bytes_kv_full), B(t.bytes_kv_kept), B(st->bytes_records));
    printf("compression  %.2fx overall (eviction %.2fx, zstd %.2fx; per document, before sharing)\n",
           R(t.bytes_kv_full, t.bytes_stored_docs), R(t.bytes_kv_full, t.bytes_kv_kept),
           R(t.bytes_kv_kept, t.bytes_stored_docs));
    printf("map          %s in use of %s mapped; data.mdb %s; page %u B\nlast txn     %" PRIu64 "\n",
           B(st->map_used), B(st->map_size), B(t.file_bytes), st->page_size, st->last_txnid);
    return EXIT_OK;
}

static int cmd_snapshot(kvz_store *s, const char *path, const char *dir)
{
    int rc = kvz_store_snapshot(s, dir);
    if (rc == KVZ_ERR_ARG) {
        fprintf(stderr, "kvzip-store: error: %s (%s)\n", E(kvz_error_detail()), kvz_strerror(rc));
        return kvz_error_clear(), EXIT_FAIL;
    }
    if (rc) return FAIL(rc, "snapshot of %s into %s failed (nothing left there)", path, dir);
    const uint64_t bytes = kvz_store_file_bytes(dir);
    if (json) return dump(json_pack("{s:o, s:I}", "snapshot", kvz_report_text(dir), "bytes", (json_int_t)bytes), "\n");
    printf("snapshot: %s -> %s (%s, compacted)\n", E(path), E(dir), B(bytes));
    return EXIT_OK;
}

/* merge (docs/SCALE.md): the library reports each document, conflict and problem */
static int on_merge(void *u, int kind, const char *msg)
{
    if (kind == KVZ_MERGE_DOC) {
        if (!*(const int *)u && !json) fprintf(stderr, "%s\n", msg);
    } else if (kind == KVZ_MERGE_CORPUS && !strncmp(msg, "note: ", 6)) {
        fprintf(stderr, "kvzip-store: merge: warning: %s\n", msg + 6);
    } else {
        fprintf(stderr, "kvzip-store: merge: %s%s\n", kind == KVZ_MERGE_CONFLICT ? "conflict: "
                : kind == KVZ_MERGE_BAD_BLOB ? "error: " : "", msg);
    }
    return 0;
}

static int cmd_merge(const char **srcs, int n, const char *into, const kvz_merge_opts *o, int quiet)
{
    kvz_merge_result r;
    int rc = kvz_store_merge(srcs, (size_t)n, into, o, on_merge, &quiet, &r);
    if (rc == KVZ_ERR_MODEL || rc == KVZ_ERR_ARG || rc == KVZ_ERR_NOTFOUND) {
        fprintf(stderr, "kvzip-store: error: %s (%s)\n", E(kvz_error_detail()), kvz_strerror(rc));
        kvz_error_clear();
        return rc == KVZ_ERR_MODEL ? EXIT_MODEL : store_exit(rc);
    }
    if (rc) return FAIL(rc, "merge into %s stopped (documents merged so far stay; rerun to finish)", into);
    if (r.refused && r.conflicts)
        fprintf(stderr, "kvzip-store: error: %" PRIu64 " document id%s with different content in two "
                "sources; nothing merged (--prefer newest takes the newest ingest)\n", r.conflicts,
                r.conflicts == 1 ? "" : "s");
    else if (r.refused)
        fprintf(stderr, "kvzip-store: error: the sources were made from different corpus listings; "
                "nothing merged (re-run the stale shards, or --allow-mixed-corpus)\n");
    if (r.refused || (json && dump(kvz_report_merge(into, &r), "\n"))) return EXIT_FAIL;
    if (!json)
        printf("merge: %" PRIu64 " documents from %d store%s into %s: %" PRIu64 " copied, %" PRIu64
               " linked, %" PRIu64 " unchanged, %" PRIu64 " replaced, %" PRIu64 " skipped (blob "
               "does not verify), %" PRIu64 " conflicts resolved\n", r.n_docs, n, n == 1 ? "" : "s",
               E(into), r.copied, r.linked, r.unchanged, r.replaced, r.bad, r.conflicts);
    if (!r.bad) return EXIT_OK;
    fprintf(stderr, "kvzip-store: error: %" PRIu64 " document%s not merged: %s blob did not verify\n",
            r.bad, r.bad == 1 ? "" : "s", r.bad == 1 ? "its" : "their");
    return EXIT_FAIL;
}

/* `kvzip-store [--json] merge SRC... --into DST ...`: its own argument list. */
static int main_merge(int argc, char **argv)
{
    const char **srcs = calloc((size_t)argc, sizeof *srcs), *into = NULL;
    int n = 0, seen = 0, quiet = 0;
    kvz_merge_opts o = {0, 0};
    if (!srcs) return FAIL(KVZ_ERR_NOMEM, "merge");
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

/* The commands on one store: the usage error when ARG is missing (NULL: they take
 * none) and how they open the store. */
#define RO KVZ_STORE_READONLY
static const struct {
    const char *name;
    int (*fn)(kvz_store *s, const char *path, const char *arg);
    const char *needs;
    unsigned open;
} cmds[] = {
    {"ls", cmd_ls, NULL, RO},
    {"show", cmd_show, "show needs a document id", RO},
    {"rm", cmd_rm, "rm needs a document id", 0},
    {"verify", cmd_verify, NULL, RO},
    {"gc", cmd_gc, NULL, 0},
    {"stats", cmd_stats, NULL, RO},
    {"salvage", cmd_salvage, "salvage needs a new folder DST to copy into", RO | KVZ_STORE_SALVAGE},
    {"snapshot", cmd_snapshot, "snapshot needs a target folder", RO},
};

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
    size_t c = 0;
    for (int i = 1, ended = 0; i < argc; i++) {
        const char *a = argv[i], *opt = ended ? "" : a; /* after "--" nothing is an option */
        if (!strcmp(opt, "--")) ended = 1;
        else if (!strcmp(opt, "-h") || !strcmp(opt, "--help")) return usage(), EXIT_OK;
        else if (!strcmp(opt, "--store")) store_flag = cli_value(argc, argv, &i);
        else if (!strcmp(opt, "--json")) json = 1;
        else if (!strcmp(opt, "--compact")) compact = 1;
        else if (opt[0] == '-' && opt[1] == '-' && opt[2])
            cli_usage_error("unknown option '%s' (an id that begins with '-' goes after --)", E(a));
        else if (!cmd) cmd = a;
        else if (!arg) arg = a;
        else cli_usage_error("unexpected argument '%s'", E(a));
    }
    if (!cmd) cli_usage_error("no command given (ls, show, rm, verify, gc, stats, salvage, merge, snapshot)");
    while (c < sizeof cmds / sizeof cmds[0] && strcmp(cmd, cmds[c].name)) c++;
    if (c == sizeof cmds / sizeof cmds[0]) cli_usage_error("unknown command '%s'", E(cmd));
    if (cmds[c].needs && !arg) cli_usage_error("%s", cmds[c].needs);
    if (!cmds[c].needs && arg) cli_usage_error("%s takes no argument, got '%s'", cmd, E(arg));
    if (compact && strcmp(cmd, "gc")) cli_usage_error("--compact goes with gc");

    const char *path = cli_store_path(store_flag);
    kvz_store *s;
    int rc = kvz_store_open(path, cmds[c].open, 0, NULL, &s);
    if (rc == KVZ_ERR_NOTFOUND) {
        fprintf(stderr, "kvzip-store: error: no store in %s (give --store DIR or set KVZ_STORE)\n", E(path));
        return kvz_error_clear(), EXIT_NOTFOUND;
    }
    if (rc) return FAIL(rc, "cannot open store %s", path);
    const int ex = cmds[c].fn(s, path, arg);
    kvz_store_close(s);
    return ex;
}
