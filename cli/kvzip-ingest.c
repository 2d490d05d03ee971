/* kvzip-ingest: compress documents' KV caches with KVzip into the LMDB store. */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_util.h"
#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_dispatch.h"
#include "kvz_ingest.h"
#include "kvz_shard.h"
#include "kvz_store_merge.h"

static void usage(void)
{
    printf(
        "usage: kvzip-ingest [options] DIR|FILE [DIR|FILE ...]\n"
        "\n"
        "Prefills each document through the model, scores every KV pair by how much the\n"
        "model needs it to reconstruct the document (KVzip), evicts the weakest, and\n"
        "stores the compressed cache in the store. Folders are walked recursively for\n"
        ".txt, .md and extension-less text files (hidden entries and other extensions\n"
        "are ignored; empty, binary or non-UTF-8 files found there are skipped with a\n"
        "warning). A FILE named on the command line must be usable text: otherwise it is\n"
        "an error. A document already stored with the same content, model and\n"
        "parameters is not recomputed.\n"
        "\n"
        "Document ids are paths relative to the DIR argument, or the file name for a\n"
        "FILE argument (or --id). A document longer than the model allows per cache\n"
        "(%s) is split into parts stored as ID#1, ID#2, ...; query a part by that id.\n"
        "\n"
        "  --store DIR        store folder (default: $KVZ_STORE or ./%s)\n"
        "  --max-map BYTES    cap on the store's LMDB map (it grows on demand up to this,\n"
        "                     default 1 TiB); ingest stops with 'store full' beyond it\n"
        "  --model PATH       GGUF model (default: $KVZ_MODEL or %s)\n"
        "  --synthetic NAME   random-weight model of a named shape instead of --model\n"
        "                     (smollm2-135m, llama3-8b, qwen2.5-7b, tiny-llama, tiny-qwen2,\n"
        "                     tiny-qwen3); byte-level tokenizer, for tests and benchmarks\n"
        "  --ratio R          fraction of context KV pairs kept, in (0, 1] (default 0.3)\n"
        "  --mode M           global (one threshold over all heads, default) or uniform\n"
        "  --kv-dtype T       stored K/V type: f16 (default), bf16 or f32\n"
        "  --id ID            document id (one FILE argument only)\n"
        "  --part-tokens N    split documents longer than N tokens into parts (default and\n"
        "                     maximum: what the model allows)\n"
        "  --threads N        CPU threads (default: all cores)\n"
        "  --device D         cpu, cuda (= cuda:0), cuda:K (GPU ordinal K) or auto (default)\n"
        "\n"
        "Scale-out (docs/SCALE.md):\n"
        "  --shard I/N        ingest only shard I (0..N-1) of the corpus: the documents whose\n"
        "                     XXH64(id) mod N is I; the N shards together hold every document\n"
        "                     once. Without it: SLURM_ARRAY_TASK_ID with SLURM_ARRAY_TASK_COUNT\n"
        "                     or --shards N, or JOB_COMPLETION_INDEX with --shards N, when set.\n"
        "                     The store records the shard and the corpus listing (hash of all\n"
        "                     ids) so kvzip-store merge can report shards of different listings\n"
        "  --shards N         shard count, with an index from the environment\n"
        "  --list             print the ids this run would ingest (after --shard) and exit,\n"
        "                     without loading the model\n"
        "  --workers N        N worker processes on --device, each with --threads (default\n"
        "                     cores / N) CPU threads, documents handed out longest first to\n"
        "                     whichever worker is free, all writing into the one store\n"
        "  --gpus all|N       one worker process per GPU (cuda:0 .. cuda:N-1), as --workers\n"
        "  --json             print the summary as one JSON object on stdout\n"
        "  --quiet            no progress bar and no per-document lines\n"
        "  -h, --help         this text\n"
        "\n"
        "Exit status: 0 all documents stored or unchanged; 1 some document failed;\n"
        "2 usage; 4 model problem; 5 store problem (docs/ERRORS.md).\n",
        "5,808 tokens for the default model: its context minus room for the repeat pass", KVZ_DEFAULT_STORE, KVZ_DEFAULT_MODEL);
}

typedef struct doc_item {
    char *path;    /* file to read */
    char *id;      /* doc id */
    int named;     /* named on the command line (not found by a folder walk) */
} doc_item;

typedef struct doc_list {
    doc_item *v;
    size_t n, cap;
    int skipped;   /* ignored candidates (binary, empty) */
} doc_list;

static void push_doc(doc_list *l, const char *path, const char *id)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 64;
        l->v = realloc(l->v, l->cap * sizeof *l->v);
        if (!l->v) { fprintf(stderr, "kvzip-ingest: error: out of memory\n"); exit(EXIT_FAIL); }
    }
    l->v[l->n].path = strdup(path);
    l->v[l->n].id = strdup(id);
    l->v[l->n].named = 0;
    l->n++;
}

static int wanted_name(const char *name)
{
    if (name[0] == '.') return 0;
    const char *dot = strrchr(name, '.');
    return !dot || !strcmp(dot, ".txt") || !strcmp(dot, ".md");
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Walk @p dir (sorted, recursive); ids are paths relative to the root. */
static void walk(doc_list *l, const char *dir, const char *rel)
{
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "kvzip-ingest: warning: cannot read folder %s: %s\n", dir, strerror(errno));
        l->skipped++;
        return;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        if (n == cap) names = realloc(names, (cap = cap ? cap * 2 : 32) * sizeof *names);
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    if (n) qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n; i++) {
        char path[4096], id[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        snprintf(id, sizeof id, "%s%s%s", rel, rel[0] ? "/" : "", names[i]);
        struct stat st;
        if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) walk(l, path, id);
        else if (S_ISREG(st.st_mode) && wanted_name(names[i])) push_doc(l, path, id);
        free(names[i]);
    }
    free(names);
}

/* ---- progress bar ---- */
typedef struct progress {
    int tty, quiet;
    int64_t base, total;   /* corpus tokens done before this doc, corpus total */
    double t0;
    const char *name;
} progress;

static int on_progress(void *ctx, int64_t done, int64_t total)
{
    progress *p = ctx;
    (void)total;
    if (!p->tty || p->quiet) return 0;
    const int64_t cur = p->base + done;
    const double el = kvz_now() - p->t0, rate = el > 0 ? cur / el : 0;
    const double frac = p->total ? (double)cur / (double)p->total : 0;
    const double eta = rate > 0 ? (p->total - cur) / rate : 0;
    char bar[31];
    int fill = (int)(frac * 30);
    for (int i = 0; i < 30; i++) bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
    bar[30] = 0;
    fprintf(stderr, "\r[%s] %3.0f%% %lld/%lld tok  %.0f tok/s  ETA %d:%02d  %-32.32s", bar,
            frac * 100, (long long)cur, (long long)p->total, rate, (int)eta / 60, (int)eta % 60,
            p->name);
    fflush(stderr);
    return 0;
}

/* ---- scale-out: shards, --list, worker processes (docs/SCALE.md) ---- */

static void free_docs(doc_list *l)
{
    for (size_t i = 0; i < l->n; i++) { free(l->v[i].path); free(l->v[i].id); }
    free(l->v);
    l->v = NULL;
    l->n = 0;
}

/* Keep only the documents of shard @p sh; *corpus = listing hash of all ids before. */
static void shard_filter(doc_list *l, const kvz_shard *sh, uint64_t *corpus, size_t *n_corpus)
{
    const char **ids = malloc((l->n ? l->n : 1) * sizeof *ids);
    if (!ids) { fprintf(stderr, "kvzip-ingest: error: out of memory\n"); exit(EXIT_FAIL); }
    for (size_t i = 0; i < l->n; i++) ids[i] = l->v[i].id;
    if (kvz_corpus_hash(ids, l->n, corpus)) { fprintf(stderr, "kvzip-ingest: error: out of memory\n"); exit(EXIT_FAIL); }
    free(ids);
    *n_corpus = l->n;
    if (!sh->n) return;
    size_t k = 0;
    for (size_t i = 0; i < l->n; i++) {
        if (kvz_shard_of(l->v[i].id, sh->n) == sh->index) l->v[k++] = l->v[i];
        else { free(l->v[i].path); free(l->v[i].id); }
    }
    l->n = k;
}

/* Open (create) the store without a model and record the shard; 0 or an exit code. */
static int shard_mark_store(const char *path, const kvz_shard *sh, uint64_t corpus, size_t n_corpus)
{
    kvz_store *st;
    int rc = kvz_store_open(path, KVZ_STORE_CREATE, 0, NULL, &st);
    if (!rc) {
        char old[128], now[64];
        size_t len = 0;
        snprintf(now, sizeof now, "%016llx %zu", (unsigned long long)corpus, n_corpus);
        if (kvz_store_meta_get(st, KVZ_META_CORPUS, old, sizeof old - 1, &len) == 0) {
            old[len < sizeof old ? len : sizeof old - 1] = 0;
            if (strcmp(old, now))
                fprintf(stderr, "kvzip-ingest: warning: %s was filled from corpus listing %s before, this "
                        "run's listing is %s: the corpus changed; re-run every shard before merging\n",
                        path, old, now);
        }
        kvz_error_clear();
        rc = kvz_shard_record(st, sh, corpus, n_corpus);
        kvz_store_close(st);
    }
    if (rc) { cli_error(rc, "cannot record the shard in store %s", path); return cli_store_exit(rc); }
    return 0;
}

typedef struct {
    const char *const *dev;
    int quiet, json;
    size_t n_docs;
    char **summary;  /* last stdout line (JSON) per worker */
} par_state;

static void on_worker_line(void *u, int w, int is_out, const char *line)
{
    par_state *p = u;
    if (is_out) {
        free(p->summary[w]);
        p->summary[w] = strdup(line);
        return;
    }
    if (p->quiet && !strstr(line, "error") && !strstr(line, "warning")) return;
    fprintf(stderr, "[w%d %s] %s  (%llu/%zu handed out)\n", w, p->dev[w], line,
            (unsigned long long)kvz_dispatch_claimed(), p->n_docs);
}

static long long json_num(const char *js, const char *key)
{
    char k[64];
    snprintf(k, sizeof k, "\"%s\": ", key);
    const char *p = js ? strstr(js, k) : NULL;
    return p ? strtoll(p + strlen(k), NULL, 10) : 0;
}

/* Parent of --workers / --gpus: hand the documents to worker processes. */
static int run_workers(doc_list *docs, int argc, char **argv, int n_workers, const char *device_str,
                       int gpus, long threads, int json, int quiet, const char *store_path,
                       int failed, int skipped)
{
    /* unusable files are dropped here, once, not by every worker */
    kvz_dispatch_doc *dd = calloc(docs->n ? docs->n : 1, sizeof *dd);
    const char **av = calloc((size_t)argc + 4, sizeof *av);
    char **devs = calloc((size_t)n_workers, sizeof *devs);
    par_state ps = {(const char *const *)devs, quiet, json, 0, calloc((size_t)n_workers, sizeof(char *))};
    kvz_dispatch_worker *wk = calloc((size_t)n_workers, sizeof *wk);
    if (!dd || !av || !devs || !ps.summary || !wk) { fprintf(stderr, "kvzip-ingest: error: out of memory\n"); return EXIT_FAIL; }
    size_t n = 0;
    for (size_t i = 0; i < docs->n; i++) {
        char *text;
        size_t len;
        int rc = cli_read_text(docs->v[i].path, (size_t)256 << 20, &text, &len);
        if ((rc == KVZ_ERR_ENCODING || rc == KVZ_ERR_EMPTY) && !docs->v[i].named) {
            fprintf(stderr, "kvzip-ingest: warning: skipping %s: %s\n", docs->v[i].path, kvz_error_detail());
            kvz_error_clear();
            skipped++;
            continue;
        }
        if (rc) { cli_error(rc, "cannot read %s", docs->v[i].path); failed++; continue; }
        free(text);
        dd[n++] = (kvz_dispatch_doc){docs->v[i].path, docs->v[i].id, docs->v[i].named, (uint64_t)len};
    }
    ps.n_docs = n;
    /* worker arguments: the model, store and ingest settings of this command */
    static const char *const with_value[] = {"--store", "--max-map", "--model", "--synthetic", "--ratio",
                                             "--mode", "--kv-dtype", "--part-tokens", NULL};
    int k = 0;
    av[k++] = argv[0];
    for (int i = 1; i < argc; i++) {
        int take = 0;
        for (int j = 0; with_value[j]; j++) take |= !strcmp(argv[i], with_value[j]);
        if (take && i + 1 < argc) { av[k++] = argv[i]; av[k++] = argv[++i]; }
    }
    av[k++] = "--store";
    av[k++] = store_path;
    av[k++] = "--json";
    av[k] = NULL;
    for (int w = 0; w < n_workers; w++) {
        char b[32];
        if (gpus) snprintf(b, sizeof b, "cuda:%d", w);
        else snprintf(b, sizeof b, "%s", device_str);
        devs[w] = strdup(b);
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int per = threads > 0 ? (int)threads : (int)(ncpu / n_workers > 0 ? ncpu / n_workers : 1);
    if (!quiet && !json)
        fprintf(stderr, "kvzip-ingest: %zu documents, longest first, to %d worker%s (%s%s, %d thread%s each)\n",
                n, n_workers, n_workers == 1 ? "" : "s", gpus ? "one per GPU: cuda:0.." : "device ",
                gpus ? devs[n_workers - 1] + 5 : device_str, per, per == 1 ? "" : "s");
    kvz_dispatch_opts o = {n_workers, "/proc/self/exe", av, (const char *const *)devs, per, on_worker_line, &ps};
    const double t0 = kvz_now();
    int rc = n ? kvz_dispatch_run(dd, n, &o, wk) : 0;
    const double secs = kvz_now() - t0;
    int bad_workers = 0;
    long long ing = 0, unch = 0, wfail = 0, wskip = 0, toks = 0, parts = 0;
    unsigned long long stored = 0;
    for (int w = 0; n && !rc && w < n_workers; w++) {
        const char *js = ps.summary[w];
        ing += json_num(js, "ingested");
        unch += json_num(js, "unchanged");
        wfail += json_num(js, "failed");
        wskip += json_num(js, "skipped");
        toks += json_num(js, "tokens");
        parts += json_num(js, "parts");
        stored += (unsigned long long)json_num(js, "bytes_stored");
        if (wk[w].exit_code != 0) {
            bad_workers++;
            if (wk[w].exit_code < 0)
                fprintf(stderr, "kvzip-ingest: error: worker %d (%s) was killed by signal %d after taking "
                        "%llu documents; rerun to finish them (stored documents are skipped)\n", w, devs[w],
                        wk[w].signal, (unsigned long long)wk[w].claimed);
            else if (!js)
                fprintf(stderr, "kvzip-ingest: error: worker %d (%s) exited with status %d before "
                        "ingesting\n", w, devs[w], wk[w].exit_code);
        }
    }
    if (rc) cli_error(rc, "cannot start the workers");
    failed += (int)wfail;
    skipped += (int)wskip;
    if (json) {
        printf("{\"store\": ");
        cli_json_str(stdout, store_path, strlen(store_path));
        printf(", \"workers\": %d, \"documents\": %zu, \"parts\": %lld, \"ingested\": %lld, \"unchanged\": %lld, "
               "\"failed\": %d, \"skipped\": %d, \"tokens\": %lld, \"bytes_stored\": %llu, "
               "\"worker_errors\": %d, \"seconds\": %.3f, \"per_worker\": [",
               n_workers, n, parts, ing, unch, failed, skipped, toks, stored, bad_workers, secs);
        for (int w = 0; w < n_workers; w++)
            printf("%s{\"device\": \"%s\", \"documents\": %llu, \"exit\": %d}", w ? ", " : "", devs[w],
                   (unsigned long long)wk[w].claimed, wk[w].exit_code);
        printf("]}\n");
    } else if (!quiet) {
        fprintf(stderr, "kvzip-ingest: %d workers: %lld ingested, %lld unchanged, %d failed, %d skipped | "
                "%lld tokens in %.1f s (%.0f tok/s) | stored %.2f MB\n", n_workers, ing, unch, failed,
                skipped, toks, secs, secs > 0 ? toks / secs : 0, stored / 1e6);
        for (int w = 0; w < n_workers; w++)
            fprintf(stderr, "  worker %d (%s): %llu document%s\n", w, devs[w], (unsigned long long)wk[w].claimed,
                    wk[w].claimed == 1 ? "" : "s");
    }
    for (int w = 0; w < n_workers; w++) { free(devs[w]); free(ps.summary[w]); }
    free(devs);
    free(ps.summary);
    free(wk);
    free(dd);
    free(av);
    return rc || failed || bad_workers ? EXIT_FAIL : 0;
}

int main(int argc, char **argv)
{
    cli_init("kvzip-ingest", argv);
    const char *store_flag = NULL, *model_flag = NULL, *synth_flag = NULL, *id_flag = NULL;
    long threads = 0, part_tokens = 0, max_map = 0;
    int json = 0, quiet = 0;
    int32_t device = KVZ_DEVICE_AUTO;
    /* scale-out options (docs/SCALE.md) */
    const char *shard_flag = NULL, *gpus_flag = NULL, *device_str = "auto";
    long shards_flag = 0, workers = 0, claim_fd = -1, worker_tag = 0;
    int list_only = 0;
    int32_t dev_ordinal = -1;
    kvz_ingest_opts o;
    kvz_ingest_defaults(&o);
    const char **inputs = calloc((size_t)argc, sizeof *inputs);
    int ni = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        else if (!strcmp(a, "--store")) store_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--max-map")) max_map = cli_parse_long(a, cli_value(argc, argv, &i), 1 << 16, LONG_MAX);
        else if (!strcmp(a, "--model")) model_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--synthetic")) synth_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--ratio")) {
            o.kp.ratio = (float)cli_parse_double(a, cli_value(argc, argv, &i), 1e-6, 1.0);
        } else if (!strcmp(a, "--mode")) {
            const char *v = cli_value(argc, argv, &i);
            if (!strcmp(v, "global")) o.kp.mode = KVZ_EVICT_GLOBAL;
            else if (!strcmp(v, "uniform")) o.kp.mode = KVZ_EVICT_UNIFORM;
            else cli_usage_error("--mode expects global or uniform, got '%s'", v);
        } else if (!strcmp(a, "--kv-dtype")) {
            const char *v = cli_value(argc, argv, &i);
            if (!strcmp(v, "f16")) o.dtype = KVZ_DTYPE_F16;
            else if (!strcmp(v, "bf16")) o.dtype = KVZ_DTYPE_BF16;
            else if (!strcmp(v, "f32")) o.dtype = KVZ_DTYPE_F32;
            else cli_usage_error("--kv-dtype expects f16, bf16 or f32, got '%s'", v);
        } else if (!strcmp(a, "--id")) id_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--part-tokens")) part_tokens = cli_parse_long(a, cli_value(argc, argv, &i), 16, 1 << 30);
        else if (!strcmp(a, "--threads")) threads = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "--device")) {
            device_str = cli_value(argc, argv, &i);
            if (kvz_device_parse(device_str, &device, &dev_ordinal)) cli_usage_error("%s", kvz_error_detail());
        } else if (!strcmp(a, "--shard")) shard_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--shards")) shards_flag = cli_parse_long(a, cli_value(argc, argv, &i), 1, KVZ_SHARD_MAX);
        else if (!strcmp(a, "--list")) list_only = 1;
        else if (!strcmp(a, "--workers")) workers = cli_parse_long(a, cli_value(argc, argv, &i), 1, KVZ_DISPATCH_MAX_WORKERS);
        else if (!strcmp(a, "--gpus")) gpus_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--claim-fd")) claim_fd = cli_parse_long(a, cli_value(argc, argv, &i), 0, 1 << 20);
        else if (!strcmp(a, "--worker-tag")) worker_tag = cli_parse_long(a, cli_value(argc, argv, &i), 0, KVZ_DISPATCH_MAX_WORKERS - 1);
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--quiet")) quiet = 1;
        else if (a[0] == '-' && a[1] == '-') cli_usage_error("unknown option '%s'", a);
        else inputs[ni++] = a;
    }
    if (ni == 0 && claim_fd < 0) cli_usage_error("no document or folder given");
    kvz_shard shard = {0, 0, NULL};
    kvz_claims *claims = NULL;
    if (claim_fd >= 0) { /* a worker of --workers / --gpus: the parent's list, no sharding */
        if (ni) cli_usage_error("--claim-fd (internal) takes no documents");
        if (kvz_claims_open((int)claim_fd, (int)worker_tag, &claims)) cli_usage_error("%s", kvz_error_detail());
    } else if (kvz_shard_resolve(shard_flag, shards_flag, getenv, &shard)) {
        cli_usage_error("%s", kvz_error_detail());
    }
    if (gpus_flag && workers) cli_usage_error("--gpus and --workers exclude each other");
    if (gpus_flag && device_str && strcmp(device_str, "auto"))
        cli_usage_error("--gpus picks the devices itself (cuda:0..N-1); drop --device");
    if (gpus_flag) {
        int have = 0;
        const int rcg = kvz_dispatch_gpu_count(&have);
        if (!strcmp(gpus_flag, "all")) {
            if (rcg) { cli_error(rcg, "--gpus all"); return EXIT_MODEL; }
            workers = have;
        } else {
            workers = cli_parse_long("--gpus", gpus_flag, 1, KVZ_DISPATCH_MAX_WORKERS);
            if (rcg) { cli_error(rcg, "--gpus %ld", workers); return EXIT_MODEL; }
            if (workers > have) {
                fprintf(stderr, "kvzip-ingest: error: --gpus %ld: this host has %d usable GPU%s\n", workers,
                        have, have == 1 ? "" : "s");
                return EXIT_MODEL;
            }
        }
    }
    if (dev_ordinal >= 0 && !workers) {
        int rcd = kvz_device_select(dev_ordinal);
        if (rcd) { cli_error(rcd, "--device %s", device_str); return EXIT_MODEL; }
    }
    if (id_flag && ni != 1) cli_usage_error("--id takes exactly one FILE argument");

    doc_list docs = {0};
    int failed = 0;
    for (size_t j = 0; claims && j < kvz_claims_count(claims); j++) {
        const char *cp, *cid;
        int named;
        kvz_claims_doc(claims, j, &cp, &cid, &named);
        push_doc(&docs, cp, cid);
        docs.v[docs.n - 1].named = named;
    }
    for (int i = 0; i < ni; i++) {
        struct stat st;
        if (stat(inputs[i], &st)) {
            fprintf(stderr, "kvzip-ingest: error: %s: %s\n", inputs[i], strerror(errno));
            failed++;
            continue;
        }
        if (S_ISDIR(st.st_mode)) {
            if (id_flag) cli_usage_error("--id takes a FILE, not a folder");
            char root[4096];
            snprintf(root, sizeof root, "%s", inputs[i]);
            size_t rl = strlen(root);
            while (rl > 1 && root[rl - 1] == '/') root[--rl] = 0;
            walk(&docs, root, "");
        } else {
            const char *base = strrchr(inputs[i], '/');
            push_doc(&docs, inputs[i], id_flag ? id_flag : (base ? base + 1 : inputs[i]));
            docs.v[docs.n - 1].named = 1;
        }
    }
    if (docs.n == 0 && !failed && !claims) {
        fprintf(stderr, "kvzip-ingest: error: no .txt, .md or extension-less documents found\n");
        return EXIT_INPUT;
    }
    uint64_t corpus_hash = 0;
    size_t n_corpus = 0;
    if (!claims) shard_filter(&docs, &shard, &corpus_hash, &n_corpus);
    if (shard.n && !json && (!quiet || list_only))
        fprintf(stderr, "kvzip-ingest: shard %u/%u (from %s): %zu of %zu documents (corpus listing %016llx)\n",
                shard.index, shard.n, shard.source, docs.n, n_corpus, (unsigned long long)corpus_hash);
    if (list_only) {
        if (json) {
            printf("{\"shard\": \"%u/%u\", \"corpus\": \"%016llx\", \"corpus_documents\": %zu, \"documents\": [",
                   shard.n ? shard.index : 0, shard.n ? shard.n : 1, (unsigned long long)corpus_hash, n_corpus);
            for (size_t i = 0; i < docs.n; i++) {
                printf("%s", i ? ", " : "");
                cli_json_str(stdout, docs.v[i].id, strlen(docs.v[i].id));
            }
            printf("]}\n");
        } else {
            for (size_t i = 0; i < docs.n; i++) printf("%s\n", docs.v[i].id);
        }
        free_docs(&docs);
        free(inputs);
        return failed ? EXIT_FAIL : 0;
    }
    if (shard.n) {
        int ex = shard_mark_store(cli_store_path(store_flag), &shard, corpus_hash, n_corpus);
        if (ex || (docs.n == 0 && !failed)) { /* nothing of the corpus falls in this shard */
            free_docs(&docs);
            free(inputs);
            return ex;
        }
    }
    if (workers > 0) {
        int ex = run_workers(&docs, argc, argv, (int)workers, device_str, gpus_flag != NULL, threads, json,
                             quiet, cli_store_path(store_flag), failed, docs.skipped);
        free_docs(&docs);
        free(inputs);
        return ex;
    }

    kvz_model *m;
    int rc = cli_load_model(cli_model_path(model_flag), synth_flag, device, (int32_t)threads, &m);
    if (rc) return cli_model_exit(rc);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    const char *store_path = cli_store_path(store_flag);
    kvz_store *st;
    const uint64_t map0 = max_map && (uint64_t)max_map < KVZ_STORE_DEFAULT_MAP ? (uint64_t)max_map : 0;
    if ((rc = kvz_store_open(store_path, KVZ_STORE_CREATE, map0, fp, &st))) {
        cli_error(rc, "cannot open store %s", store_path);
        return cli_store_exit(rc);
    }
    if (max_map) kvz_store_set_max_map(st, (uint64_t)max_map);

    /* read + tokenize everything first: totals for the progress bar */
    kvz_tokens *toks = calloc(docs.n, sizeof *toks);
    int *ok = calloc(docs.n, sizeof *ok);
    int64_t total = 0;
    for (size_t i = 0; i < docs.n; i++) {
        char *text;
        size_t len;
        rc = cli_read_text(docs.v[i].path, (size_t)256 << 20, &text, &len);
        if ((rc == KVZ_ERR_ENCODING || rc == KVZ_ERR_EMPTY) && !docs.v[i].named) {
            fprintf(stderr, "kvzip-ingest: warning: skipping %s: %s\n", docs.v[i].path, kvz_error_detail());
            kvz_error_clear();
            docs.skipped++;
            continue;
        }
        if (rc) {
            cli_error(rc, "cannot read %s", docs.v[i].path);
            failed++;
            continue;
        }
        rc = kvz_tokenizer_encode(tok, text, len, 0, &toks[i]);
        free(text);
        if (rc) {
            cli_error(rc, "cannot tokenize %s", docs.v[i].path);
            failed++;
            continue;
        }
        ok[i] = 1;
        total += (int64_t)toks[i].n * 2;
    }

    int32_t max_part = kvz_ingest_max_part_tokens(m);
    if (part_tokens > 0 && part_tokens < max_part) max_part = (int32_t)part_tokens;
    progress pr = {.tty = isatty(2), .quiet = quiet || json, .total = total, .t0 = kvz_now()};
    int n_written = 0, n_unchanged = 0, n_parts = 0;
    int64_t tokens_done = 0, pairs_total = 0, pairs_kept = 0;
    uint64_t b_full = 0, b_kept = 0, b_stored = 0;
    const double t_start = kvz_now();
    for (size_t i = 0; i < docs.n; i++) {
        if (!ok[i]) continue;
        if (claims && !kvz_claims_take(claims, i)) continue; /* another worker has it */
        const int32_t n = (int32_t)toks[i].n;
        const int32_t parts = (n + max_part - 1) / max_part;
        int doc_failed = 0;
        for (int32_t p = 0; p < parts && !doc_failed; p++) {
            /* near-equal parts */
            const int32_t s0 = (int32_t)((int64_t)n * p / parts), s1 = (int32_t)((int64_t)n * (p + 1) / parts);
            char id[4096];
            if (parts > 1) snprintf(id, sizeof id, "%s#%d", docs.v[i].id, p + 1);
            else snprintf(id, sizeof id, "%s", docs.v[i].id);
            kvz_ingest_result r;
            pr.name = id;
            pr.base = tokens_done;
            o.progress = on_progress;
            o.progress_ctx = &pr;
            rc = kvz_ingest_doc(m, st, id, docs.v[i].path, toks[i].ids + s0, s1 - s0, &o, &r);
            tokens_done += 2 * (int64_t)(s1 - s0);
            if (pr.tty && !pr.quiet) fprintf(stderr, "\r\033[K");
            if (rc) {
                cli_error(rc, "%s", id);
                doc_failed = 1;
                if (rc == KVZ_ERR_FULL || rc == KVZ_ERR_MODEL || rc == KVZ_ERR_LMDB) {
                    failed++;
                    goto summary; /* the store cannot take more: stop */
                }
                break;
            }
            n_parts++;
            if (r.status == KVZ_STORE_UNCHANGED) n_unchanged++;
            else n_written++;
            pairs_total += r.pairs_total;
            pairs_kept += r.pairs_kept;
            b_full += r.bytes_full;
            b_kept += r.bytes_kept;
            b_stored += r.bytes_stored;
            if (!quiet && (!json || claims)) /* a worker's lines go to its parent */
                fprintf(stderr, "%-10s %s  %d tokens  %.1f s\n",
                        r.status == KVZ_STORE_UNCHANGED ? "unchanged" :
                        r.status == KVZ_STORE_WRITTEN ? "ingested" : "linked",
                        id, r.n_ctx, r.seconds);
        }
        if (doc_failed) { failed++; continue; }
        /* parts left over from an older, longer version of this document */
        char id[4096];
        kvz_store_doc_info old;
        if (parts > 1 && kvz_store_lookup(st, docs.v[i].id, &old) == 0) kvz_store_delete_doc(st, docs.v[i].id);
        for (int32_t p = parts > 1 ? parts + 1 : 1;; p++) {
            snprintf(id, sizeof id, "%s#%d", docs.v[i].id, p);
            if (kvz_store_lookup(st, id, &old) != 0 || kvz_store_delete_doc(st, id) != 0) break;
        }
    }
summary:;
    const double secs = kvz_now() - t_start;
    if (json) {
        printf("{\"store\": ");
        cli_json_str(stdout, store_path, strlen(store_path));
        printf(", \"documents\": %zu, \"parts\": %d, \"ingested\": %d, \"unchanged\": %d, "
               "\"failed\": %d, \"skipped\": %d, \"tokens\": %lld, \"ratio\": %.4f, "
               "\"pairs_total\": %lld, \"pairs_kept\": %lld, \"bytes_kv_full\": %llu, "
               "\"bytes_kv_kept\": %llu, \"bytes_stored\": %llu, \"seconds\": %.3f}\n",
               docs.n, n_parts, n_written, n_unchanged, failed, docs.skipped,
               (long long)(tokens_done / 2), o.kp.ratio, (long long)pairs_total,
               (long long)pairs_kept, (unsigned long long)b_full, (unsigned long long)b_kept,
               (unsigned long long)b_stored, secs);
    } else if (!quiet) {
        fprintf(stderr, "kvzip-ingest: %d ingested, %d unchanged, %d failed, %d skipped | %lld tokens "
                "in %.1f s | KV full %.2f MB, kept %.2f MB (%.3fx), stored %.2f MB (zstd %.2fx)\n",
                n_written, n_unchanged, failed, docs.skipped, (long long)(tokens_done / 2), secs,
                b_full / 1e6, b_kept / 1e6, b_full ? (double)b_kept / b_full : 0, b_stored / 1e6,
                b_stored ? (double)b_kept / b_stored : 0);
    }
    for (size_t i = 0; i < docs.n; i++) {
        kvz_tokens_free(&toks[i]);
        free(docs.v[i].path);
        free(docs.v[i].id);
    }
    free(docs.v);
    free(toks);
    free(ok);
    free(inputs);
    kvz_store_close(st);
    kvz_model_free(m);
    kvz_claims_close(claims);
    return failed ? EXIT_FAIL : 0;
}
