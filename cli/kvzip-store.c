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
    kvz_store_report_print_no_doc(stderr, cli_prog, path, id, kvz_store_count_parts(s, id));
    return EXIT_NOTFOUND;
}

static int ls_cb(void *u, const char *id, const kvz_store_doc_info *in)
{
    int *n = u;
    if (!json) kvz_store_report_print_ls_row(stdout, id, in);
    else if (fputs(*n ? ",\n    " : "\n    ", stdout), dump(kvz_report_doc(id, in), ""))
        return 1; /* ends the walk */
    (*n)++;
    return 0;
}

static int cmd_ls(kvz_store *s, const char *path, const char *arg)
{
    int n = 0, rc;
    (void)arg;
    if (!json) kvz_store_report_print_ls_header(stdout);
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
    if (rc == KVZ_ERR_NOTFOUND && d->failed == KVZ_DETAIL_DOC) ex = no_doc(s, path, id);
    else if (rc && d->failed == KVZ_DETAIL_READ) ex = FAIL(rc, "cannot read %s", path);
    else if (rc && d->failed == KVZ_DETAIL_DOC) ex = FAIL(rc, "cannot read document '%s'", id);
    else if (rc && d->failed == KVZ_DETAIL_META) ex = FAIL(rc, "document '%s': cannot read its blob's META record", id);
    else if (rc && d->failed == KVZ_DETAIL_LAYER) ex = FAIL(rc, "document '%s': layer %u record", id, d->failed_layer);
    else if (rc) ex = FAIL(rc, "show");
    else if (json) ex = dump(kvz_report_doc_detail(id, d), "\n");
    else kvz_store_report_print_doc_detail(stdout, id, d);
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
    kvz_store_report_print_problem(stderr, cli_prog, err, msg);
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
    if (!json) kvz_store_report_print_verify(stdout, path, &vr);
    if (!vr.n_problems) return EXIT_OK;
    fprintf(stderr, "kvzip-store: error: %s: %" PRIu64 " problem%s found\n", E(path), vr.n_problems,
            vr.n_problems == 1 ? "" : "s");
    return EXIT_STORE;
}

static int cmd_gc(kvz_store *s, const char *path, const char *arg)
{
    kvz_store_gc_compact_result r;
    int rc = kvz_store_gc_compact(s, compact, &r);
    (void)arg;
    if (rc) return r.gc_done ? FAIL(rc, "compacting %s failed (store unchanged)", path) : FAIL(rc, "gc of %s failed", path);
    if (json) return dump(kvz_report_gc(&r), "\n");
    kvz_store_report_print_gc(stdout, &r);
    return EXIT_OK;
}

static int on_lost(void *u, const char *id, int err, const char *msg)
{
    (void)u;
    kvz_store_report_print_lost(stderr, cli_prog, id, err, msg);
    return 0;
}

static int cmd_salvage(kvz_store *s, const char *path, const char *dst)
{
    kvz_store_salvage_result r;
    int rc = kvz_store_salvage(s, dst, on_lost, NULL, &r);
    if (rc) return FAIL(rc, "salvage of %s into %s failed", path, dst);
    if (json && dump(kvz_report_salvage(path, dst, &r), "\n")) return EXIT_FAIL;
    if (!json) kvz_store_report_print_salvage(stdout, path, dst, &r);
    if (!r.n_lost && !r.n_gaps) return EXIT_OK;
    kvz_store_report_print_salvage_loss(stderr, cli_prog, path, dst, &r);
    return EXIT_STORE;
}

static int cmd_stats(kvz_store *s, const char *path, const char *arg)
{
    kvz_store_summary t;
    int rc = kvz_store_summary_get(s, path, &t);
    (void)arg;
    if (rc) return FAIL(rc, "cannot read %s", path);
    if (json) return dump(kvz_report_summary(path, &t), "\n");
    kvz_store_report_print_summary(stdout, path, &t);
    return EXIT_OK;
}

static int cmd_snapshot(kvz_store *s, const char *path, const char *dir)
{
    int rc = kvz_store_snapshot(s, dir);
    if (rc == KVZ_ERR_ARG) return cli_error_detail(rc), EXIT_FAIL;
    if (rc) return FAIL(rc, "snapshot of %s into %s failed (nothing left there)", path, dir);
    const uint64_t bytes = kvz_store_file_bytes(dir);
    if (json) return dump(json_pack("{s:o, s:I}", "snapshot", kvz_report_text(dir), "bytes", (json_int_t)bytes), "\n");
    kvz_store_report_print_snapshot(stdout, path, dir, bytes);
    return EXIT_OK;
}

/* merge (docs/SCALE.md): the library reports each document, conflict and problem */
static int on_merge(void *u, int kind, const char *msg)
{
    if (kind != KVZ_MERGE_DOC || (!*(const int *)u && !json)) /* a document's line unless --quiet */
        kvz_store_report_print_merge_event(stderr, cli_prog, kind, msg);
    return 0;
}

static int cmd_merge(const char **srcs, int n, const char *into, const kvz_merge_opts *o, int quiet)
{
    kvz_merge_result r;
    int rc = kvz_store_merge(srcs, (size_t)n, into, o, on_merge, &quiet, &r);
    if (rc == KVZ_ERR_MODEL || rc == KVZ_ERR_ARG || rc == KVZ_ERR_NOTFOUND) {
        cli_error_detail(rc);
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
    if (!json) kvz_store_report_print_merge(stdout, into, n, &r);
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
