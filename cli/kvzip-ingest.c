/* kvzip-ingest: compress documents' KV caches with KVzip into the LMDB store. A thin
 * main (flags, printing, exit codes) over library modules: the document list in
 * ingest/kvz_corpus.h, the ingest run in ingest/kvz_batch.h, the worker processes of
 * --workers / --gpus and shard stores in ingest/kvz_workers.h. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_util.h"
#include "kvzip-ingest.help.h" /* cli_help: generated from cli/help/kvzip-ingest.txt */
#include "kvz_batch.h"
#include "kvz_error.h"
#include "kvz_ingest_report.h"
#include "kvz_kvrow.h"
#include "kvz_workers.h"

static void usage(void) { fputs(cli_help, stdout); } /* cli/help/kvzip-ingest.txt */

static _Noreturn void oom(void)
{
    fprintf(stderr, "kvzip-ingest: error: out of memory\n");
    exit(EXIT_FAIL);
}

/* the library's reports, printed on stderr (bar and lines set per run) */
static kvz_ingest_term g_term;

/* ---- options ---- */
typedef struct ingest_args {
    const char *store, *model, *synth, *id;
    long threads, part_tokens, max_map;
    int json, quiet, path_ids;
    int32_t device;
    kvz_ingest_opts o;
    /* scale-out (docs/SCALE.md) */
    const char *shard, *gpus, *device_str;
    long shards, workers, claim_fd, worker_tag;
    int list_only;
    int32_t dev_ordinal;       /* K of --device cuda:K, else -1 */
} ingest_args;
/* Parse argv into @p a; operands go to @p inputs (argc entries), their count to *ni. */
static void parse_args(int argc, char **argv, ingest_args *a, const char **inputs, int *ni)
{
    *a = (ingest_args){.device = KVZ_DEVICE_AUTO, .device_str = "auto", .claim_fd = -1,
                       .dev_ordinal = -1};
    kvz_ingest_defaults(&a->o);
    int ended = 0;
    *ni = 0;
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        const int kind = cli_arg_kind(s, &ended); /* "--" ends the options */
        if (kind < 0) continue;
        if (kind == 0) { inputs[(*ni)++] = s; continue; }
        if (!strcmp(s, "-h") || !strcmp(s, "--help")) { usage(); exit(0); }
        else if (!strcmp(s, "--store")) a->store = cli_value(argc, argv, &i);
        else if (!strcmp(s, "--max-map")) a->max_map = cli_parse_long(s, cli_value(argc, argv, &i), 1 << 16, LONG_MAX);
        else if (!strcmp(s, "--model")) a->model = cli_value(argc, argv, &i);
        else if (!strcmp(s, "--synthetic")) a->synth = cli_value(argc, argv, &i);
        else if (!strcmp(s, "--ratio")) {
            a->o.kp.ratio = (float)cli_parse_double(s, cli_value(argc, argv, &i), 1e-6, 1.0);
        } else if (!strcmp(s, "--mode")) {
            const char *v = cli_value(argc, argv, &i);
            if (!strcmp(v, "global")) a->o.kp.mode = KVZ_EVICT_GLOBAL;
            else if (!strcmp(v, "uniform")) a->o.kp.mode = KVZ_EVICT_UNIFORM;
            else cli_usage_error("--mode expects global or uniform, got '%s'", v);
        } else if (!strcmp(s, "--kv-dtype")) {
            const char *v = cli_value(argc, argv, &i);
            const kvz_kvrow_codec *kc = kvz_kvrow_codec_find(v);
            if (!kc) cli_usage_error("--kv-dtype expects f16, bf16, f32, q8 or q4, got '%s'", v);
            a->o.dtype = kc->dtype;
        } else if (!strcmp(s, "--id")) a->id = cli_value(argc, argv, &i);
        else if (!strcmp(s, "--part-tokens")) a->part_tokens = cli_parse_long(s, cli_value(argc, argv, &i), 16, 1 << 30);
        else if (!strcmp(s, "--threads")) a->threads = cli_parse_long(s, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(s, "--device")) {
            a->device_str = cli_value(argc, argv, &i);
            if (kvz_device_parse(a->device_str, &a->device, &a->dev_ordinal))
                cli_usage_error("%s", kvz_error_detail());
        } else if (!strcmp(s, "--path-ids")) a->path_ids = 1;
        else if (!strcmp(s, "--shard")) a->shard = cli_value(argc, argv, &i);
        else if (!strcmp(s, "--shards")) a->shards = cli_parse_long(s, cli_value(argc, argv, &i), 1, KVZ_SHARD_MAX);
        else if (!strcmp(s, "--list")) a->list_only = 1;
        else if (!strcmp(s, "--workers")) a->workers = cli_parse_long(s, cli_value(argc, argv, &i), 1, KVZ_DISPATCH_MAX_WORKERS);
        else if (!strcmp(s, "--gpus")) a->gpus = cli_value(argc, argv, &i);
        else if (!strcmp(s, "--claim-fd")) a->claim_fd = cli_parse_long(s, cli_value(argc, argv, &i), 0, 1 << 20);
        else if (!strcmp(s, "--worker-tag")) a->worker_tag = cli_parse_long(s, cli_value(argc, argv, &i), 0, KVZ_DISPATCH_MAX_WORKERS - 1);
        else if (!strcmp(s, "--json")) a->json = 1;
        else if (!strcmp(s, "--quiet")) a->quiet = 1;
        else if (s[0] == '-' && s[1] == '-') cli_usage_error("unknown option '%s'", s);
        else inputs[(*ni)++] = s;
    }
}

/* --gpus all|N: the worker count, or a nonzero exit code (no CUDA build, too few GPUs). */
static int resolve_gpus(ingest_args *a)
{
    if (a->gpus && a->workers) cli_usage_error("--gpus and --workers exclude each other");
    if (a->gpus && strcmp(a->device_str, "auto"))
        cli_usage_error("--gpus picks the devices itself (cuda:0..N-1); drop --device");
    if (!a->gpus) return 0;
    const long want = strcmp(a->gpus, "all") ? cli_parse_long("--gpus", a->gpus, 1, KVZ_DISPATCH_MAX_WORKERS) : 0;
    int n = 0;
    const int rc = kvz_dispatch_gpus(want, &n);
    if (rc) cli_error(rc, "--gpus %s", a->gpus);
    a->workers = n;
    return rc ? EXIT_MODEL : 0;
}

/* ---- steps 3 and 4: in this process, in the parent of workers, in a worker ---- */
static kvz_model *load_model(const ingest_args *a, int32_t device, int *ex)
{
    kvz_model *m = NULL;
    const int rc = cli_load_model(cli_model_path(a->model), a->synth, device, (int32_t)a->threads, &m);
    *ex = rc ? cli_model_exit(rc) : 0;
    return m;
}

static kvz_batch_opts batch_opts(const ingest_args *a)
{
    return (kvz_batch_opts){.ingest = a->o, .store_path = cli_store_path(a->store),
                            .max_map = (uint64_t)a->max_map, .part_tokens = (int32_t)a->part_tokens,
                            .report = kvz_ingest_report_on_batch, .progress = kvz_ingest_report_on_progress,
                            .user = &g_term};
}

static int ingest_local(kvz_corpus *c, const ingest_args *a)
{
    int ex, ran;
    kvz_model *m = load_model(a, a->device, &ex);
    if (!m) return ex;
    const kvz_batch_opts bo = batch_opts(a);
    kvz_batch_stats s;
    g_term.bar = isatty(2) && !a->quiet && !a->json;
    g_term.lines = !a->quiet && !a->json;
    const int rc = kvz_batch_run(m, c, &bo, &s, &ran);
    if (rc == KVZ_ERR_NOMEM) oom();
    if (rc) cli_error(rc, "cannot open store %s", bo.store_path);
    if (ran && (a->json || !a->quiet))
        kvz_ingest_report_summary(a->json ? stdout : stderr, cli_prog, bo.store_path, c->n, &s, c->failed + s.failed,
                                  c->skipped, a->o.kp.ratio, a->json);
    kvz_model_free(m);
    return rc ? cli_store_exit(rc) : c->failed || c->collisions || s.failed ? EXIT_FAIL : 0;
}

/* Workers ingest at once, so the part-id check of each document (kvz_batch_add) cannot
 * stand in for step 3 when a part id may be another document's: tokenize here, on the CPU. */
static int check_part_ids(kvz_corpus *c, const ingest_args *a)
{
    int ex;
    kvz_model *m = load_model(a, KVZ_DEVICE_CPU, &ex);
    if (!m) return ex;
    int64_t total;
    if (kvz_corpus_tokenize(c, kvz_model_tokenizer(m), kvz_batch_max_part(m, (int32_t)a->part_tokens), NULL,
                            &total) < 0)
        oom();
    kvz_model_free(m);
    return c->collisions ? EXIT_FAIL : 0;
}

/* A worker of --workers / --gpus: per-part lines and the JSON summary go to the parent. */
static int run_worker(kvz_claims *claims, const ingest_args *a)
{
    int ex;
    kvz_model *m = load_model(a, a->device, &ex);
    if (!m) return ex;
    const kvz_batch_opts bo = batch_opts(a);
    kvz_batch *b;
    g_term.lines = !a->quiet; /* lines reach the parent also under --json */
    int rc = kvz_batch_open(m, &bo, &b);
    if (rc) {
        cli_error(rc, "cannot open store %s", bo.store_path);
        kvz_model_free(m);
        return cli_store_exit(rc);
    }
    kvz_corpus rep; /* reports (and counts) the files this worker skips or cannot read */
    kvz_corpus_init(&rep, kvz_ingest_report_on_corpus, &g_term);
    size_t n_taken;
    kvz_batch_stats s;
    kvz_workers_take(b, m, claims, &rep, &n_taken);
    kvz_batch_close(b, &s);
    const int failed = rep.failed + s.failed;
    if (a->json || !a->quiet)
        kvz_ingest_report_summary(a->json ? stdout : stderr, cli_prog, bo.store_path, n_taken, &s, failed,
                                  rep.skipped, a->o.kp.ratio, a->json);
    kvz_model_free(m);
    return failed ? EXIT_FAIL : 0;
}

static void on_worker_line(void *user, int w, const char *dev, const char *line, uint64_t claimed, size_t n)
{
    const ingest_args *a = user;
    if (!a->quiet || strstr(line, "error") || strstr(line, "warning"))
        kvz_ingest_report_worker_line(stderr, w, dev, line, claimed, n);
}

/* Parent of --workers / --gpus: the usable documents (read in step 2, so unusable files
 * are dropped once, not by every worker) to worker processes, longest first. */
static int run_workers(const kvz_corpus *c, int argc, char **argv, ingest_args *a)
{
    const char *store_path = cli_store_path(a->store);
    /* worker arguments: the model, store and ingest settings of this command */
    static const char *const forward[] = {"--store", "--max-map", "--model", "--synthetic", "--ratio",
                                          "--mode", "--kv-dtype", "--part-tokens", NULL};
    const char **av = kvz_workers_argv(argc, argv, forward, store_path);
    if (!av) oom();
    const int nw = (int)a->workers;
    const long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    const int per = a->threads > 0 ? (int)a->threads : (int)(ncpu / nw > 0 ? ncpu / nw : 1);
    size_t n = 0;
    for (size_t i = 0; i < c->n; i++) n += (size_t)c->v[i].usable;
    if (!a->quiet && !a->json)
        kvz_ingest_report_workers_start(stderr, cli_prog, n, nw, a->gpus != NULL, a->device_str, per);
    const kvz_workers_opts o = {nw, a->gpus != NULL, a->device_str, per, "/proc/self/exe", av, on_worker_line, a};
    kvz_workers_result r;
    const int rc = kvz_workers_run(c, &o, &r);
    if (!r.per) oom();
    if (!rc && n) kvz_ingest_report_workers_lost(stderr, cli_prog, &r, nw);
    if (rc) cli_error(rc, "cannot start the workers");
    const int failed = c->failed + (int)r.failed, skipped = c->skipped + (int)r.skipped;
    if (a->json || !a->quiet)
        kvz_ingest_report_workers_summary(a->json ? stdout : stderr, cli_prog, store_path, &r, nw, n, failed,
                                          skipped, a->json);
    const int bad = rc || failed || r.bad_workers;
    kvz_workers_result_free(&r);
    free(av);
    return bad ? EXIT_FAIL : 0;
}

int main(int argc, char **argv)
{
    cli_init("kvzip-ingest", argv);
    g_term = (kvz_ingest_term){stderr, cli_prog, 0, 0};
    ingest_args a;
    const char **inputs = calloc((size_t)argc, sizeof *inputs);
    if (!inputs) oom();
    int ni = 0;
    parse_args(argc, argv, &a, inputs, &ni);
    if (ni == 0 && a.claim_fd < 0) cli_usage_error("no document or folder given");
    kvz_shard shard = {0, 0, NULL};
    kvz_claims *claims = NULL;
    if (a.claim_fd >= 0) { /* a worker of --workers / --gpus: the parent's list, no sharding */
        if (ni) cli_usage_error("--claim-fd (internal) takes no documents");
        if (kvz_claims_open((int)a.claim_fd, (int)a.worker_tag, &claims)) cli_usage_error("%s", kvz_error_detail());
    } else if (kvz_shard_resolve(a.shard, a.shards, getenv, &shard)) {
        cli_usage_error("%s", kvz_error_detail());
    }
    int ex = resolve_gpus(&a);
    if (!ex && a.dev_ordinal >= 0 && !a.workers) { /* before anything touches CUDA */
        int rcd = kvz_device_select(a.dev_ordinal);
        if (rcd) { cli_error(rcd, "--device %s", a.device_str); ex = EXIT_MODEL; }
    }
    if (ex) {
        free(inputs);
        return ex;
    }
    if (a.id && ni != 1) cli_usage_error("--id takes exactly one FILE argument");
    if (claims) {
        ex = run_worker(claims, &a);
        kvz_claims_close(claims);
        free(inputs);
        return ex;
    }

    /* the document list: nothing below reads a file or loads the model until every id
     * of this shard is known to be valid and unique */
    kvz_corpus c;
    kvz_corpus_init(&c, kvz_ingest_report_on_corpus, &g_term);
    for (int i = 0; i < ni; i++) {
        const int rc = kvz_corpus_add(&c, inputs[i], a.id, a.path_ids);
        if (rc == KVZ_ERR_ARG) cli_usage_error("--id takes a FILE, not a folder");
        if (rc) oom();
    }
    free(inputs);
    if (c.n == 0 && !c.failed) {
        fprintf(stderr, "kvzip-ingest: error: no .txt, .md or extension-less documents found\n");
        return EXIT_INPUT;
    }
    uint64_t corpus_hash = 0;
    size_t n_corpus = 0;
    if (kvz_corpus_shard(&c, &shard, &corpus_hash, &n_corpus)) oom();
    if (shard.n && !a.json && (!a.quiet || a.list_only))
        kvz_ingest_report_shard(stderr, cli_prog, &shard, c.n, n_corpus, corpus_hash);
    /* 1. ids (an id is in one shard: checking the shard's share finds every collision once) */
    const int bad = kvz_corpus_check_ids(&c);
    if (bad < 0) oom();
    ex = bad ? EXIT_FAIL : -1;
    if (!bad && a.list_only) {
        kvz_ingest_report_list(stdout, &c, &shard, corpus_hash, n_corpus, a.json);
        ex = c.failed ? EXIT_FAIL : 0;
    }
    if (ex < 0 && shard.n) {
        const char *path = cli_store_path(a.store);
        char old[128];
        const int rc = kvz_workers_mark_store(path, &shard, corpus_hash, n_corpus, old);
        if (old[0]) kvz_ingest_report_listing_changed(stderr, cli_prog, path, old, corpus_hash, n_corpus);
        if (rc) {
            cli_error(rc, "cannot record the shard in store %s", path);
            ex = cli_store_exit(rc);
        }
    }
    /* 2. read every file (the text is kept for step 3 in this process) */
    const int parts_here = ex < 0 && a.workers > 0 && kvz_corpus_part_ids_may_collide(&c);
    const int n_usable = ex < 0 ? kvz_corpus_read(&c, a.workers == 0 || parts_here) : 0;
    if (ex < 0 && n_usable == 0) { /* no store is created or opened for nothing */
        ex = c.failed ? EXIT_FAIL : shard.n ? 0 : EXIT_INPUT;
        /* a shard whose share is empty or all skipped is an empty shard, not an error */
        kvz_ingest_report_no_usable(stderr, cli_prog, &c, &shard, !a.quiet && !a.json);
    }
    /* 3. and 4. here, or in worker processes */
    if (ex < 0 && a.workers == 0) ex = ingest_local(&c, &a);
    else if (ex < 0 && (!parts_here || !(ex = check_part_ids(&c, &a))))
        ex = run_workers(&c, argc, argv, &a);
    kvz_corpus_free(&c);
    return ex;
}
