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
#include "kvz_ingest.h"
#include "kvz_kvrow.h"
#include "kvz_pipeline.h"

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
        "  --kv-dtype T       stored K/V type: q8 (default: int8, one f16 scale per 32\n"
        "                     values), q4 (4-bit, f16 scale + minimum per 32), f16, bf16\n"
        "                     or f32\n"
        "  --id ID            document id (one FILE argument only)\n"
        "  --part-tokens N    split documents longer than N tokens into parts (default and\n"
        "                     maximum: what the model allows)\n"
        "  --threads N        CPU threads (default: all cores)\n"
        "  --device D         cpu, cuda or auto (default auto)\n"
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

/* ---- results of the ingest pipeline, in submission order ---- */
typedef struct ingest_acc {
    kvz_store *st;
    doc_list *docs;
    progress *pr;
    int quiet, json;
    int32_t *parts, *parts_left;  /* per document */
    int *doc_failed;
    int failed, n_written, n_unchanged, n_parts;
    int64_t tokens_done, pairs_total, pairs_kept;
    uint64_t b_full, b_kept, b_stored;
} ingest_acc;

static void on_done(void *ctx, const char *id, int rc, const char *detail, const kvz_ingest_result *r, void *user)
{
    ingest_acc *a = ctx;
    const size_t i = (size_t)user;
    if (!r) return; /* not attempted: the store stopped taking documents (reported once) */
    if (a->pr->tty && !a->pr->quiet) fprintf(stderr, "\r\033[K");
    if (rc) {
        kvz_error_set(rc, "%s", detail);
        cli_error(rc, "%s", id);
        if (!a->doc_failed[i]) a->failed++;
        a->doc_failed[i] = 1;
    } else {
        a->n_parts++;
        if (r->status == KVZ_STORE_UNCHANGED) a->n_unchanged++;
        else a->n_written++;
        a->pairs_total += r->pairs_total;
        a->pairs_kept += r->pairs_kept;
        a->b_full += r->bytes_full;
        a->b_kept += r->bytes_kept;
        a->b_stored += r->bytes_stored;
        if (!a->quiet && !a->json)
            fprintf(stderr, "%-10s %s  %d tokens  %.1f s\n",
                    r->status == KVZ_STORE_UNCHANGED ? "unchanged" :
                    r->status == KVZ_STORE_WRITTEN ? "ingested" : "linked",
                    id, r->n_ctx, r->seconds);
    }
    if (--a->parts_left[i] > 0 || a->doc_failed[i]) return;
    /* every part stored: parts left over from an older, longer version of this document */
    const int32_t parts = a->parts[i];
    const char *base = a->docs->v[i].id;
    char old_id[4096];
    kvz_store_doc_info old;
    if (parts > 1 && kvz_store_lookup(a->st, base, &old) == 0) kvz_store_delete_doc(a->st, base);
    for (int32_t p = parts > 1 ? parts + 1 : 1;; p++) {
        snprintf(old_id, sizeof old_id, "%s#%d", base, p);
        if (kvz_store_lookup(a->st, old_id, &old) != 0 || kvz_store_delete_doc(a->st, old_id) != 0) break;
    }
    kvz_error_clear();
}

int main(int argc, char **argv)
{
    cli_init("kvzip-ingest", argv);
    const char *store_flag = NULL, *model_flag = NULL, *synth_flag = NULL, *id_flag = NULL;
    long threads = 0, part_tokens = 0, max_map = 0;
    int json = 0, quiet = 0;
    int32_t device = KVZ_DEVICE_AUTO;
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
            const kvz_kvrow_codec *kc = kvz_kvrow_codec_find(v);
            if (!kc) cli_usage_error("--kv-dtype expects f16, bf16, f32, q8 or q4, got '%s'", v);
            o.dtype = kc->dtype;
        } else if (!strcmp(a, "--id")) id_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--part-tokens")) part_tokens = cli_parse_long(a, cli_value(argc, argv, &i), 16, 1 << 30);
        else if (!strcmp(a, "--threads")) threads = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "--device")) device = cli_parse_device(cli_value(argc, argv, &i));
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--quiet")) quiet = 1;
        else if (a[0] == '-' && a[1] == '-') cli_usage_error("unknown option '%s'", a);
        else inputs[ni++] = a;
    }
    if (ni == 0) cli_usage_error("no document or folder given");
    if (id_flag && ni != 1) cli_usage_error("--id takes exactly one FILE argument");

    doc_list docs = {0};
    int failed = 0;
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
    if (docs.n == 0 && !failed) {
        fprintf(stderr, "kvzip-ingest: error: no .txt, .md or extension-less documents found\n");
        return EXIT_INPUT;
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
    ingest_acc acc = {.st = st, .docs = &docs, .pr = &pr, .quiet = quiet, .json = json};
    acc.parts_left = calloc(docs.n ? docs.n : 1, sizeof *acc.parts_left);
    acc.doc_failed = calloc(docs.n ? docs.n : 1, sizeof *acc.doc_failed);
    acc.parts = calloc(docs.n ? docs.n : 1, sizeof *acc.parts);
    /* overlapped: the GPU scores the next part while the last ones are encoded and
     * committed (ingest/kvz_pipeline.h); results arrive in order through on_done */
    kvz_pipeline *pl = NULL;
    o.progress = on_progress;
    o.progress_ctx = &pr;
    if ((rc = kvz_pipeline_create(m, st, &o, 0, on_done, &acc, &pl))) {
        cli_error(rc, "cannot start the ingest pipeline");
        return cli_exit_code(rc);
    }
    const double t_start = kvz_now();
    for (size_t i = 0; i < docs.n && !kvz_pipeline_failed(pl); i++) {
        if (!ok[i]) continue;
        const int32_t n = (int32_t)toks[i].n;
        const int32_t parts = (n + max_part - 1) / max_part;
        acc.parts[i] = acc.parts_left[i] = parts;
        for (int32_t p = 0; p < parts && !kvz_pipeline_failed(pl); p++) {
            /* near-equal parts */
            const int32_t s0 = (int32_t)((int64_t)n * p / parts), s1 = (int32_t)((int64_t)n * (p + 1) / parts);
            char id[4096];
            if (parts > 1) snprintf(id, sizeof id, "%s#%d", docs.v[i].id, p + 1);
            else snprintf(id, sizeof id, "%s", docs.v[i].id);
            pr.name = id;
            pr.base = acc.tokens_done;
            kvz_pipeline_submit(pl, id, docs.v[i].path, toks[i].ids + s0, s1 - s0, (void *)i);
            acc.tokens_done += 2 * (int64_t)(s1 - s0);
        }
    }
    kvz_pipeline_free(pl); /* waits for the last commits */
    failed += acc.failed;
    int n_written = acc.n_written, n_unchanged = acc.n_unchanged, n_parts = acc.n_parts;
    int64_t tokens_done = acc.tokens_done, pairs_total = acc.pairs_total, pairs_kept = acc.pairs_kept;
    uint64_t b_full = acc.b_full, b_kept = acc.b_kept, b_stored = acc.b_stored;
    free(acc.parts_left);
    free(acc.doc_failed);
    free(acc.parts);
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
    return failed ? EXIT_FAIL : 0;
}
