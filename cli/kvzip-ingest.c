/* kvzip-ingest: compress documents' KV caches with KVzip into the LMDB store. */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_util.h"
#include "kvz_dispatch.h"
#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_ingest.h"
#include "kvz_kvrow.h"
#include "kvz_parts.h"
#include "kvz_pipeline.h"
#include "kvz_shard.h"
#include "kvz_store.h"
#include "kvz_store_merge.h"

static void usage(void)
{
    printf(
        "usage: kvzip-ingest [options] [--] DIR|FILE [DIR|FILE ...]\n"
        "\n"
        "Prefills each document through the model, scores every KV pair by how much the\n"
        "model needs it to reconstruct the document (KVzip), evicts the weakest, and\n"
        "stores the compressed cache in the store. Folders are walked recursively for\n"
        ".txt, .md and extension-less text files (hidden entries and other extensions\n"
        "are ignored; empty, binary or non-UTF-8 files, dangling links, FIFOs, sockets\n"
        "and devices found there are skipped with a warning; symbolic links are\n"
        "followed, each real folder once). A FILE named on the command line must be text\n"
        "(a regular file): otherwise it is an error. A document already stored with the\n"
        "same content, model and parameters is not recomputed: under its own id it is\n"
        "'unchanged', under a new id 'linked' to the stored cache.\n"
        "\n"
        "Document ids are paths relative to the DIR argument, or the file name for a\n"
        "FILE argument (or --id); at most 511 bytes. Two inputs that would get the same\n"
        "id are an error before anything is computed (nothing is stored; see\n"
        "--path-ids); the same file named twice is stored once. A document longer\n"
        "than the model allows per cache (%s) is split into parts stored as\n"
        "ID#1, ID#2, ...; query a part by that id. Each part records that it is a part\n"
        "of ID: re-ingesting a shorter version removes only ID's own parts, never an\n"
        "independent document named like one, and a part never overwrites another\n"
        "document's id (that document fails instead).\n"
        "\n"
        "  --store DIR        store folder (default: $KVZ_STORE or ./%s)\n"
        "  --max-map BYTES    cap on the store's LMDB map (it grows on demand up to this,\n"
        "                     default 1 TiB); ingest stops with 'store full' beyond it\n"
        "  --model PATH|NAME  GGUF model, or a name fetched by scripts/fetch-model\n"
        "                     (default: $KVZ_MODEL or %s)\n"
        "  --synthetic NAME   random-weight model of a named shape instead of --model\n"
        "                     (smollm2-135m, llama3-8b, qwen2.5-7b, tiny-llama, tiny-qwen2,\n"
        "                     tiny-qwen3); byte-level tokenizer, for tests and benchmarks\n"
        "  --ratio R          fraction of context KV pairs kept, in (0, 1] (default 0.3)\n"
        "  --mode M           global (one threshold over all heads, default) or uniform\n"
        "  --kv-dtype T       stored K/V type: q8 (default: int8, one f16 scale per 32\n"
        "                     values), q4 (4-bit, f16 scale + minimum per 32), f16, bf16\n"
        "                     or f32\n"
        "  --id ID            document id (one FILE argument only)\n"
        "  --path-ids         ids keep where the input came from: a DIR argument's own\n"
        "                     name leads its ids (dir1/same.txt), a FILE argument's id is\n"
        "                     its path as given (a/x.txt); for inputs whose plain ids collide\n"
        "  --part-tokens N    split documents longer than N tokens into parts (default and\n"
        "                     maximum: what the model allows)\n"
        "  --threads N        CPU threads (default: all cores)\n"
        "  --device D         cpu, cuda (= cuda:0), cuda:K (GPU ordinal K) or auto (default)\n"
        "  --json             print the summary as one JSON object on stdout\n"
        "  --quiet            no progress bar and no per-document lines\n"
        "  -h, --help         this text\n"
        "  --                 end of options: every later argument is a DIR or FILE\n"
        "\n"
        "Scale-out (docs/SCALE.md):\n"
        "  --shard I/N        ingest only shard I (0..N-1) of the corpus: the documents whose\n"
        "                     XXH64(id) mod N is I (all parts of a document in one shard); the\n"
        "                     N shards together hold every document once. Without it:\n"
        "                     SLURM_ARRAY_TASK_ID with SLURM_ARRAY_TASK_COUNT or --shards N, or\n"
        "                     JOB_COMPLETION_INDEX with --shards N, when set. The store records\n"
        "                     the shard and the corpus listing (hash of all ids) so kvzip-store\n"
        "                     merge can report shards of different listings. Id collisions are\n"
        "                     checked within the shard (one id is always in one shard); a shard\n"
        "                     whose documents are all skipped is an empty shard (exit 0)\n"
        "  --shards N         shard count, with an index from the environment\n"
        "  --list             print the ids this run would ingest (after --shard and the id\n"
        "                     checks) and exit, without loading the model or reading files\n"
        "  --workers N        N worker processes on --device, each with --threads (default\n"
        "                     cores / N) CPU threads, documents handed out longest first to\n"
        "                     whichever worker is free, all writing into the one store. Ids\n"
        "                     and files are checked once, in this process (which loads the\n"
        "                     model on the CPU to count parts only when an id looks like\n"
        "                     another's part, X#N)\n"
        "  --gpus all|N       one worker process per GPU (cuda:0 .. cuda:N-1), as --workers\n"
        "\n"
        "The summary counts ingested (computed), linked and unchanged documents (a part\n"
        "counts as one); its KV figures cover only the caches computed in this run.\n"
        "\n"
        "Exit status: 0 all documents stored or unchanged; 1 some document failed, or\n"
        "two inputs map to one id; 2 usage; 3 no usable document found; 4 model problem;\n"
        "5 store problem (docs/ERRORS.md).\n",
        "5,808 tokens for the default model: its context minus room for the repeat pass", KVZ_DEFAULT_STORE, KVZ_DEFAULT_MODEL);
}

typedef struct doc_item {
    char *path;    /* file to read */
    char *id;      /* doc id */
    int named;     /* named on the command line (not found by a folder walk) */
    int usable;    /* read (and later tokenized) without error */
    int dup;       /* left out: the same file as an earlier input, or an id out of range */
    char *text;    /* file contents until tokenized */
    size_t len;
    int32_t n_parts;
} doc_item;

typedef struct doc_list {
    doc_item *v;
    size_t n, cap;
    int skipped;   /* ignored candidates (binary, empty, dangling links, FIFOs) */
} doc_list;

static _Noreturn void oom(void)
{
    fprintf(stderr, "kvzip-ingest: error: out of memory\n");
    exit(EXIT_FAIL);
}

static void *xrealloc(void *p, size_t n)
{
    p = realloc(p, n);
    if (!p) oom();
    return p;
}

static void push_doc(doc_list *l, const char *path, const char *id)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 64;
        l->v = xrealloc(l->v, l->cap * sizeof *l->v);
    }
    memset(&l->v[l->n], 0, sizeof l->v[l->n]);
    l->v[l->n].path = strdup(path);
    l->v[l->n].id = strdup(id);
    if (!l->v[l->n].path || !l->v[l->n].id) oom();
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

/* Real folders already walked under one DIR argument: (st_dev, st_ino). */
typedef struct dir_set {
    struct { dev_t dev; ino_t ino; } *v;
    size_t n, cap;
} dir_set;

/* 1 if the folder was new (and is now recorded), 0 if already walked. */
static int dir_set_add(dir_set *s, const struct stat *st)
{
    for (size_t i = 0; i < s->n; i++)
        if (s->v[i].dev == st->st_dev && s->v[i].ino == st->st_ino) return 0;
    if (s->n == s->cap) s->v = xrealloc(s->v, (s->cap = s->cap ? s->cap * 2 : 16) * sizeof *s->v);
    s->v[s->n].dev = st->st_dev;
    s->v[s->n].ino = st->st_ino;
    s->n++;
    return 1;
}

static void walk_skip(doc_list *l, const char *path, const char *why)
{
    fprintf(stderr, "kvzip-ingest: warning: skipping %s: %s\n", cli_escape(path), why);
    l->skipped++;
}

/* Walk @p dir (sorted, recursive); ids are paths relative to the root. Symbolic links
 * are followed, but each real folder is walked at most once (@p seen), so a link to
 * an ancestor or a second link to a folder adds nothing. */
static void walk(doc_list *l, const char *dir, const char *rel, dir_set *seen)
{
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "kvzip-ingest: warning: cannot read folder %s: %s\n", cli_escape(dir),
                strerror(errno));
        l->skipped++;
        return;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        if (n == cap) names = xrealloc(names, (cap = cap ? cap * 2 : 32) * sizeof *names);
        if (!(names[n++] = strdup(e->d_name))) oom();
    }
    closedir(d);
    if (n) qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n; i++) {
        char path[4096], id[4096];
        const int pl = snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        const int il = snprintf(id, sizeof id, "%s%s%s", rel, rel[0] ? "/" : "", names[i]);
        struct stat st, lst;
        if (pl >= (int)sizeof path || il >= (int)sizeof id) {
            walk_skip(l, path, "path longer than 4095 bytes");
        } else if (stat(path, &st) != 0) {
            /* never look at st after a failed stat: a dangling link is skipped wherever it sorts */
            const int e2 = errno;
            if (lstat(path, &lst) == 0 && S_ISLNK(lst.st_mode) && e2 == ENOENT)
                walk_skip(l, path, "dangling symbolic link");
            else
                walk_skip(l, path, strerror(e2));
        } else if (S_ISDIR(st.st_mode)) {
            if (dir_set_add(seen, &st)) {
                walk(l, path, id, seen);
            } else {
                fprintf(stderr, "kvzip-ingest: warning: skipping %s: folder already walked "
                        "(a symbolic link to it or to an ancestor)\n", cli_escape(path));
            }
        } else if (wanted_name(names[i])) {
            if (S_ISREG(st.st_mode)) push_doc(l, path, id);
            else walk_skip(l, path, "not a regular file");
        }
        free(names[i]);
    }
    free(names);
}

/* ---- ids: each stored id comes from exactly one input ---- */
typedef struct id_ref {
    const char *id;   /* the stored id (owned by the doc, or by `own`) */
    char *own;
    size_t doc;       /* index into the doc list */
    int32_t part, n_parts;
} id_ref;

static int cmp_id_ref(const void *a, const void *b)
{
    const id_ref *x = a, *y = b;
    int c = strcmp(x->id, y->id);
    if (c) return c;
    return x->doc < y->doc ? -1 : x->doc > y->doc;
}

static int same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    if (!strcmp(a, b)) return 1;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/* Report every id two inputs would both be stored under; drop exact repeats of one
 * file (the same path or the same file twice). Returns the number of collisions. */
static int id_collisions(doc_list *l, id_ref *r, size_t n)
{
    int bad = 0;
    qsort(r, n, sizeof *r, cmp_id_ref);
    for (size_t i = 1; i < n; i++) {
        if (strcmp(r[i - 1].id, r[i].id)) continue;
        doc_item *a = &l->v[r[i - 1].doc], *b = &l->v[r[i].doc];
        if (r[i - 1].doc == r[i].doc) continue;
        if (r[i - 1].n_parts <= 1 && r[i].n_parts <= 1 && same_file(a->path, b->path)) {
            b->dup = 1; /* the same file named twice: store it once */
            const id_ref t = r[i]; /* compare what follows with the one kept (swap: each */
            r[i] = r[i - 1];       /* entry keeps its own allocation) */
            r[i - 1] = t;
            continue;
        }
        char pa[64] = "", pb[64] = "";
        if (r[i - 1].n_parts > 1) snprintf(pa, sizeof pa, " (part %d of %d)", r[i - 1].part, r[i - 1].n_parts);
        if (r[i].n_parts > 1) snprintf(pb, sizeof pb, " (part %d of %d)", r[i].part, r[i].n_parts);
        fprintf(stderr, "kvzip-ingest: error: %s%s and %s%s would both be stored as '%s'; nothing "
                "stored (use --path-ids, ingest them separately, or name one FILE with --id)\n",
                cli_escape(a->path), pa, cli_escape(b->path), pb, cli_escape(r[i].id));
        bad++;
    }
    return bad;
}

/* ---- progress bar ---- */
typedef struct progress {
    int tty, quiet;
    int64_t base, total;   /* corpus tokens done before this doc, corpus total */
    double t0;
    char name[64];         /* the document's id, escaped and cut */
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

/* ---- each document's parts through the ingest pipeline ----
 * The ID#N part policy of kvz_ingest_document (ingest/kvz_parts.h) with the parts
 * ingested by kvz_pipeline (ingest/kvz_pipeline.h: on the CUDA backend the GPU scores
 * the next part while the last ones are encoded and committed; on the CPU submits are
 * queued and computed by kvz_ingest_docs, several short documents per forward pass):
 * kvz_ingest_parts_check before the first part is submitted,
 * each part's number recorded in its entry, kvz_ingest_parts_prune once every part of
 * the document is committed; a failed part stops the document (earlier parts stay,
 * nothing is pruned). Results arrive in submission order through on_done. */
typedef struct run_state {
    progress *pr;
    kvz_store *st;
    int quiet;         /* no per-part lines */
    int n_written, n_linked, n_unchanged, n_parts;
    int failed;        /* documents that failed in the pipeline (or their prune) */
    int64_t tokens_done, pairs_total, pairs_kept, tokens_written;
    uint64_t b_full, b_kept, b_stored;
} run_state;

/* One document in flight: alive until its last submitted part is reported. */
typedef struct pdoc {
    char *id, *path;
    int32_t n_parts, submitted, reported, ok;
    int failed, closed;   /* closed: no more parts will be submitted */
} pdoc;

static void pdoc_release(pdoc *d)
{
    if (!d->closed || d->reported < d->submitted) return;
    free(d->id);
    free(d->path);
    free(d);
}

static void doc_fail(run_state *rs, pdoc *d)
{
    if (!d->failed) rs->failed++;
    d->failed = 1;
}

static void on_done(void *ctx, const char *id, int rc, const char *detail, const kvz_ingest_result *r,
                    void *user)
{
    run_state *rs = ctx;
    pdoc *d = user;
    d->reported++;
    if (rs->pr->tty && !rs->pr->quiet) fprintf(stderr, "\r\033[K");
    if (!r) { /* not attempted: the store had stopped taking documents (reported once) */
        doc_fail(rs, d);
    } else if (rc) {
        kvz_error_set(rc, "%s", detail);
        cli_error(rc, "%s", id);
        doc_fail(rs, d);
    } else {
        const char *what;
        rs->n_parts++;
        d->ok++;
        if (r->status == KVZ_STORE_WRITTEN) {
            /* only computed caches have figures of their own: a linked or unchanged
             * document shares records stored earlier */
            what = "ingested";
            rs->n_written++;
            rs->tokens_written += r->n_ctx;
            rs->pairs_total += r->pairs_total;
            rs->pairs_kept += r->pairs_kept;
            rs->b_full += r->bytes_full;
            rs->b_kept += r->bytes_kept;
            rs->b_stored += r->bytes_stored;
        } else if (r->status == KVZ_STORE_LINKED) {
            what = "linked";
            rs->n_linked++;
        } else {
            what = "unchanged"; /* UNCHANGED, or INFO_UPDATED: same content, entry refreshed */
            rs->n_unchanged++;
        }
        if (!rs->quiet)
            fprintf(stderr, "%-10s %s  %d tokens  %.1f s\n", what, cli_escape(id), r->n_ctx, r->seconds);
        if (d->ok == d->n_parts && !d->failed) {
            /* every part committed: what an older version of this document left behind */
            const int prc = kvz_ingest_parts_prune(rs->st, d->id, d->path, d->n_parts, NULL);
            if (prc) {
                cli_error(prc, "%s", d->id);
                doc_fail(rs, d);
            }
        }
    }
    pdoc_release(d);
}

/* Score, evict and store one document with the part policy, its parts submitted to
 * @p pl. Returns the error found before anything was submitted (printed; the caller
 * counts it); a part's error comes later through on_done (counted in rs->failed). */
static int ingest_one(kvz_pipeline *pl, const char *id, const char *path, const kvz_tokens *t,
                      int32_t max_part, run_state *rs)
{
    const int32_t n = (int32_t)t->n;
    const int32_t parts = kvz_ingest_n_parts(n, max_part);
    /* nothing is computed when one of its ids belongs to another document */
    int rc = parts < 1 ? kvz_error_set(KVZ_ERR_EMPTY, "document has no tokens")
                       : kvz_ingest_parts_check(rs->st, id, path, parts);
    if (rc) {
        cli_error(rc, "%s", id);
        return rc;
    }
    pdoc *d = calloc(1, sizeof *d);
    if (!d || !(d->id = strdup(id)) || !(d->path = strdup(path))) oom();
    d->n_parts = parts;
    for (int32_t p = 0; p < parts && !d->failed && !kvz_pipeline_failed(pl); p++) {
        char pid[KVZ_STORE_DOC_ID_MAX + 1];
        int32_t s0, s1;
        kvz_ingest_part_span(n, parts, p, &s0, &s1);
        kvz_ingest_part_id(id, p + 1, parts, pid); /* kvz_ingest_parts_check checked every id */
        snprintf(rs->pr->name, sizeof rs->pr->name, "%s", cli_escape(pid));
        rs->pr->base = rs->tokens_done;
        d->submitted++;
        kvz_pipeline_submit_part(pl, pid, path, t->ids + s0, s1 - s0, parts > 1 ? (uint32_t)(p + 1) : 0, d);
        rs->tokens_done += 2 * (int64_t)(s1 - s0);
    }
    d->closed = 1;
    pdoc_release(d); /* freed here when every part was reported already */
    return 0;
}

/* The pipeline of one process: progress through @p pr, results counted in @p rs. */
static int pipeline_open(kvz_model *m, kvz_store *st, kvz_ingest_opts *o, run_state *rs, kvz_pipeline **pl)
{
    o->progress = on_progress;
    o->progress_ctx = rs->pr;
    int rc = kvz_pipeline_create(m, st, o, 0, on_done, rs, pl);
    if (rc) cli_error(rc, "cannot start the ingest pipeline");
    return rc;
}

/* 1 when after error @p rc the store cannot take more: stop the run. */
static int store_stops(int rc)
{
    return rc == KVZ_ERR_FULL || rc == KVZ_ERR_MODEL || rc == KVZ_ERR_LMDB || rc == KVZ_ERR_BUSY;
}

static void print_summary(const char *store_path, size_t n_docs, const run_state *rs, int failed,
                          int skipped, float ratio, double secs, int json, int quiet)
{
    if (json) {
        printf("{\"store\": ");
        cli_json_str(stdout, store_path, strlen(store_path));
        printf(", \"documents\": %zu, \"parts\": %d, \"ingested\": %d, \"unchanged\": %d, "
               "\"linked\": %d, \"failed\": %d, \"skipped\": %d, \"tokens\": %lld, "
               "\"tokens_ingested\": %lld, \"ratio\": %.4f, "
               "\"pairs_total\": %lld, \"pairs_kept\": %lld, \"bytes_kv_full\": %llu, "
               "\"bytes_kv_kept\": %llu, \"bytes_stored\": %llu, \"seconds\": %.3f}\n",
               n_docs, rs->n_parts, rs->n_written, rs->n_unchanged, rs->n_linked, failed, skipped,
               (long long)(rs->tokens_done / 2), (long long)rs->tokens_written, ratio,
               (long long)rs->pairs_total, (long long)rs->pairs_kept, (unsigned long long)rs->b_full,
               (unsigned long long)rs->b_kept, (unsigned long long)rs->b_stored, secs);
    } else if (!quiet) {
        char kv[256] = "";
        if (rs->n_written && rs->b_full && rs->b_stored && rs->pairs_total)
            snprintf(kv, sizeof kv, " | ingested KV: full %.2f MB, kept %.2f MB (%.0f%% of the "
                     "context pairs, %.0f%% of the bytes with the prefix), stored %.2f MB (zstd "
                     "%.2fx)", rs->b_full / 1e6, rs->b_kept / 1e6,
                     100.0 * (double)rs->pairs_kept / (double)rs->pairs_total,
                     100.0 * (double)rs->b_kept / (double)rs->b_full, rs->b_stored / 1e6,
                     (double)rs->b_kept / (double)rs->b_stored);
        fprintf(stderr, "kvzip-ingest: %d ingested, %d linked, %d unchanged, %d failed, %d skipped "
                "| %lld tokens in %.1f s%s\n", rs->n_written, rs->n_linked, rs->n_unchanged, failed,
                skipped, (long long)(rs->tokens_done / 2), secs, kv);
    }
}

static void free_docs(doc_list *docs)
{
    for (size_t i = 0; i < docs->n; i++) {
        free(docs->v[i].path);
        free(docs->v[i].id);
        free(docs->v[i].text);
    }
    free(docs->v);
    docs->v = NULL;
    docs->n = 0;
}

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
    int have = 0;
    const int rcg = kvz_dispatch_gpu_count(&have);
    if (!strcmp(a->gpus, "all")) {
        if (rcg) { cli_error(rcg, "--gpus all"); return EXIT_MODEL; }
        a->workers = have;
        return 0;
    }
    a->workers = cli_parse_long("--gpus", a->gpus, 1, KVZ_DISPATCH_MAX_WORKERS);
    if (rcg) { cli_error(rcg, "--gpus %ld", a->workers); return EXIT_MODEL; }
    if (a->workers > have) {
        fprintf(stderr, "kvzip-ingest: error: --gpus %ld: this host has %d usable GPU%s\n", a->workers,
                have, have == 1 ? "" : "s");
        return EXIT_MODEL;
    }
    return 0;
}

/* ---- the document list ---- */

/* Every DIR (walked) and FILE argument into @p docs; a missing one fails. */
static void collect_inputs(doc_list *docs, const char **inputs, int ni, const ingest_args *a, int *failed)
{
    for (int i = 0; i < ni; i++) {
        struct stat st;
        if (stat(inputs[i], &st)) {
            fprintf(stderr, "kvzip-ingest: error: %s: %s\n", cli_escape(inputs[i]), strerror(errno));
            (*failed)++;
            continue;
        }
        if (S_ISDIR(st.st_mode)) {
            if (a->id) cli_usage_error("--id takes a FILE, not a folder");
            char root[4096];
            snprintf(root, sizeof root, "%s", inputs[i]);
            size_t rl = strlen(root);
            while (rl > 1 && root[rl - 1] == '/') root[--rl] = 0;
            dir_set seen = {0};
            dir_set_add(&seen, &st);
            char *real = a->path_ids ? realpath(root, NULL) : NULL; /* "." -> its real name */
            const char *name = real ? strrchr(real, '/') + 1 : "";
            walk(docs, root, name, &seen);
            free(real);
            free(seen.v);
        } else { /* a FIFO or device is rejected when read, without blocking */
            const char *base = strrchr(inputs[i], '/'), *given = inputs[i];
            while (given[0] == '.' && given[1] == '/') given += 2;
            push_doc(docs, inputs[i], a->id ? a->id : a->path_ids ? given : (base ? base + 1 : inputs[i]));
            docs->v[docs->n - 1].named = 1;
        }
    }
}

/* Keep only the documents of shard @p sh (all of them when sh->n is 0); *corpus is the
 * listing hash of every id before, *n_corpus their count. */
static void shard_filter(doc_list *l, const kvz_shard *sh, uint64_t *corpus, size_t *n_corpus)
{
    const char **ids = xrealloc(NULL, (l->n ? l->n : 1) * sizeof *ids);
    for (size_t i = 0; i < l->n; i++) ids[i] = l->v[i].id;
    if (kvz_corpus_hash(ids, l->n, corpus)) oom();
    free(ids);
    *n_corpus = l->n;
    if (!sh->n) return;
    size_t k = 0;
    for (size_t i = 0; i < l->n; i++) {
        if (kvz_shard_of(l->v[i].id, sh->n) == sh->index) l->v[k++] = l->v[i];
        else { free(l->v[i].path); free(l->v[i].id); free(l->v[i].text); }
    }
    l->n = k;
}

/* Step 1, no file read and no model: every id within 1..KVZ_STORE_DOC_ID_MAX bytes (one
 * outside fails and is left out) and stored by one input only (the same file named twice
 * is kept once). Returns the number of collisions: nonzero means nothing may be stored. */
static int check_ids(doc_list *docs, int *failed)
{
    for (size_t i = 0; i < docs->n; i++) {
        size_t n = strlen(docs->v[i].id);
        if (n == 0 || n > KVZ_STORE_DOC_ID_MAX) {
            fprintf(stderr, "kvzip-ingest: error: %s: document id of %zu bytes is outside 1..%d "
                    "bytes (ingest the FILE alone with a shorter --id)\n", cli_escape(docs->v[i].path), n,
                    KVZ_STORE_DOC_ID_MAX);
            docs->v[i].dup = 1; /* not read, not stored */
            (*failed)++;
        }
    }
    id_ref *r = xrealloc(NULL, (docs->n + 1) * sizeof *r);
    size_t nr = 0;
    for (size_t i = 0; i < docs->n; i++)
        if (!docs->v[i].dup) r[nr++] = (id_ref){docs->v[i].id, NULL, i, 1, 1};
    int bad = id_collisions(docs, r, nr);
    free(r);
    return bad;
}

/* Step 2: read every file before any model or store work: one named on the command line
 * that is not usable text fails, one found by a walk is skipped with a warning. Keeps the
 * text for tokenizing when @p keep_text. Returns the number of usable documents. */
static int read_docs(doc_list *docs, int keep_text, int *failed)
{
    int n_usable = 0;
    for (size_t i = 0; i < docs->n; i++) {
        doc_item *d = &docs->v[i];
        if (d->dup) continue;
        int rc = cli_read_text(d->path, (size_t)256 << 20, &d->text, &d->len);
        if ((rc == KVZ_ERR_ENCODING || rc == KVZ_ERR_EMPTY) && !d->named) {
            fprintf(stderr, "kvzip-ingest: warning: skipping %s: %s\n", cli_escape(d->path),
                    cli_escape(kvz_error_detail()));
            kvz_error_clear();
            docs->skipped++;
            continue;
        }
        if (rc) {
            cli_error(rc, "cannot read %s", d->path);
            (*failed)++;
            continue;
        }
        if (!keep_text) {
            free(d->text);
            d->text = NULL;
        }
        d->usable = 1;
        n_usable++;
    }
    return n_usable;
}

/* Step 3, model loaded, nothing scored: tokenize, count parts, then check every stored id
 * (parts included) for length and uniqueness. *total = tokens of both passes. Returns the
 * number of collisions: nonzero means nothing may be stored. */
static int tokenize_docs(doc_list *docs, const kvz_tokenizer *tok, int32_t max_part, kvz_tokens *toks,
                         int64_t *total, int *failed)
{
    size_t n_ids = 0;
    for (size_t i = 0; i < docs->n; i++) {
        doc_item *d = &docs->v[i];
        if (!d->usable) continue;
        int rc = kvz_tokenizer_encode(tok, d->text, d->len, 0, &toks[i]);
        free(d->text);
        d->text = NULL;
        if (rc) {
            cli_error(rc, "cannot tokenize %s", d->path);
            d->usable = 0;
            (*failed)++;
            continue;
        }
        d->n_parts = kvz_ingest_n_parts((int32_t)toks[i].n, max_part);
        char last[KVZ_STORE_DOC_ID_MAX + 1];
        if (d->n_parts < 1) {
            rc = kvz_error_set(KVZ_ERR_EMPTY, "%s has no tokens", d->path);
        } else if ((rc = kvz_ingest_part_id(d->id, d->n_parts, d->n_parts, last)) == 0) {
            n_ids += (size_t)d->n_parts;
            *total += (int64_t)toks[i].n * 2;
            continue;
        }
        cli_error(rc, "%s", d->path);
        d->usable = 0;
        (*failed)++;
    }
    id_ref *r = xrealloc(NULL, (n_ids + 1) * sizeof *r);
    size_t nr = 0;
    for (size_t i = 0; i < docs->n; i++) {
        const doc_item *d = &docs->v[i];
        if (!d->usable) continue;
        for (int32_t p = 1; p <= d->n_parts; p++) {
            char id[KVZ_STORE_DOC_ID_MAX + 1];
            kvz_ingest_part_id(d->id, p, d->n_parts, id);
            r[nr] = (id_ref){NULL, strdup(id), i, p, d->n_parts};
            if (!r[nr].own) oom();
            r[nr].id = r[nr].own;
            nr++;
        }
    }
    int bad = id_collisions(docs, r, nr);
    for (size_t k = 0; k < nr; k++) free(r[k].own);
    free(r);
    return bad;
}

/* --list: the ids this run would ingest, one a line or one JSON object. */
static void list_docs(const doc_list *docs, const kvz_shard *sh, uint64_t corpus, size_t n_corpus, int json)
{
    if (json) {
        printf("{\"shard\": \"%u/%u\", \"corpus\": \"%016llx\", \"corpus_documents\": %zu, \"documents\": [",
               sh->n ? sh->index : 0, sh->n ? sh->n : 1, (unsigned long long)corpus, n_corpus);
        int first = 1;
        for (size_t i = 0; i < docs->n; i++) {
            if (docs->v[i].dup) continue;
            printf("%s", first ? "" : ", ");
            cli_json_str(stdout, docs->v[i].id, strlen(docs->v[i].id));
            first = 0;
        }
        printf("]}\n");
    } else {
        for (size_t i = 0; i < docs->n; i++)
            if (!docs->v[i].dup) printf("%s\n", cli_escape(docs->v[i].id));
    }
}

/* ---- one process: steps 3 and 4 ---- */
static int ingest_local(doc_list *docs, ingest_args *a, int failed)
{
    kvz_model *m;
    int rc = cli_load_model(cli_model_path(a->model), a->synth, a->device, (int32_t)a->threads, &m);
    if (rc) return cli_model_exit(rc);
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    int32_t max_part = kvz_ingest_max_part_tokens(m);
    if (a->part_tokens > 0 && a->part_tokens < max_part) max_part = (int32_t)a->part_tokens;
    kvz_tokens *toks = calloc(docs->n ? docs->n : 1, sizeof *toks);
    if (!toks) oom();
    int64_t total = 0;
    const int bad = tokenize_docs(docs, kvz_model_tokenizer(m), max_part, toks, &total, &failed);
    int any = 0;
    for (size_t i = 0; i < docs->n; i++) any |= docs->v[i].usable;

    const char *store_path = cli_store_path(a->store);
    kvz_store *st = NULL;
    int ex = failed ? EXIT_FAIL : 0;
    if (bad) ex = EXIT_FAIL;
    else if (any) { /* with nothing left to store, no store is created */
        const uint64_t map0 = a->max_map && (uint64_t)a->max_map < KVZ_STORE_DEFAULT_MAP ? (uint64_t)a->max_map : 0;
        if ((rc = kvz_store_open(store_path, KVZ_STORE_CREATE, map0, fp, &st))) {
            cli_error(rc, "cannot open store %s", store_path);
            ex = cli_store_exit(rc);
            any = 0;
        } else if (a->max_map) {
            kvz_store_set_max_map(st, (uint64_t)a->max_map);
        }
    }
    if (!bad && any) {
        /* 4. score, evict, store */
        progress pr = {.tty = isatty(2), .quiet = a->quiet || a->json, .total = total, .t0 = kvz_now()};
        run_state rs = {.pr = &pr, .st = st, .quiet = a->quiet || a->json};
        kvz_pipeline *pl = NULL;
        const double t_start = kvz_now();
        if (pipeline_open(m, st, &a->o, &rs, &pl)) failed++;
        for (size_t i = 0; pl && i < docs->n && !kvz_pipeline_failed(pl); i++) {
            const doc_item *d = &docs->v[i];
            if (!d->usable) continue;
            rc = ingest_one(pl, d->id, d->path, &toks[i], max_part, &rs);
            if (rc) {
                failed++;
                if (store_stops(rc)) break; /* the store cannot take more: stop */
            }
        }
        kvz_pipeline_free(pl); /* waits for the last commits (and their prunes) */
        failed += rs.failed;
        print_summary(store_path, docs->n, &rs, failed, docs->skipped, a->o.kp.ratio,
                      kvz_now() - t_start, a->json, a->quiet);
        ex = failed ? EXIT_FAIL : 0;
    }
    for (size_t i = 0; i < docs->n; i++) kvz_tokens_free(&toks[i]);
    free(toks);
    kvz_store_close(st);
    kvz_model_free(m);
    return ex;
}

/* ---- scale-out: shard stores, worker processes (docs/SCALE.md) ---- */

/* Workers ingest at once, so ingest_one's kvz_ingest_parts_check that a part id is not
 * another document's cannot stand in for step 3 (two workers could both pass it). A part id can
 * equal another input's id only when some id is "X#N" with X another input's id: 1 then. */
static int part_ids_may_collide(const doc_list *docs)
{
    const char **ids = xrealloc(NULL, (docs->n ? docs->n : 1) * sizeof *ids);
    size_t n = 0;
    for (size_t i = 0; i < docs->n; i++)
        if (!docs->v[i].dup) ids[n++] = docs->v[i].id;
    if (n) qsort(ids, n, sizeof *ids, cmp_str);
    int maybe = 0;
    for (size_t i = 0; i < n && !maybe; i++) {
        const char *hash = strrchr(ids[i], '#');
        if (!hash || hash == ids[i] || hash[1] < '1' || hash[1] > '9' ||
            strspn(hash + 1, "0123456789") != strlen(hash + 1))
            continue;
        char parent[KVZ_STORE_DOC_ID_MAX + 1];
        snprintf(parent, sizeof parent, "%.*s", (int)(hash - ids[i]), ids[i]);
        const char *key = parent;
        maybe = bsearch(&key, ids, n, sizeof *ids, cmp_str) != NULL;
    }
    free(ids);
    return maybe;
}

/* Step 3 in the parent of --workers (part_ids_may_collide): load the model on the CPU,
 * tokenize, and check every part id before anything is handed out. 0 or an exit code. */
static int check_part_ids(doc_list *docs, const ingest_args *a, int *failed)
{
    kvz_model *m;
    int rc = cli_load_model(cli_model_path(a->model), a->synth, KVZ_DEVICE_CPU, (int32_t)a->threads, &m);
    if (rc) return cli_model_exit(rc);
    int32_t max_part = kvz_ingest_max_part_tokens(m);
    if (a->part_tokens > 0 && a->part_tokens < max_part) max_part = (int32_t)a->part_tokens;
    kvz_tokens *toks = calloc(docs->n ? docs->n : 1, sizeof *toks);
    if (!toks) oom();
    int64_t total = 0;
    const int bad = tokenize_docs(docs, kvz_model_tokenizer(m), max_part, toks, &total, failed);
    for (size_t i = 0; i < docs->n; i++) kvz_tokens_free(&toks[i]);
    free(toks);
    kvz_model_free(m);
    return bad ? EXIT_FAIL : 0;
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
                        cli_escape(path), cli_escape(old), now);
        }
        kvz_error_clear();
        rc = kvz_shard_record(st, sh, corpus, n_corpus);
        kvz_store_close(st);
    }
    if (rc) { cli_error(rc, "cannot record the shard in store %s", path); return cli_store_exit(rc); }
    return 0;
}

/* A worker of --workers / --gpus: walk the parent's list in order, take each document no
 * other worker has, and ingest it; per-part lines and the JSON summary go to the parent. */
static int run_worker(kvz_claims *claims, ingest_args *a)
{
    kvz_model *m;
    int rc = cli_load_model(cli_model_path(a->model), a->synth, a->device, (int32_t)a->threads, &m);
    if (rc) return cli_model_exit(rc);
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    const char *store_path = cli_store_path(a->store);
    kvz_store *st;
    const uint64_t map0 = a->max_map && (uint64_t)a->max_map < KVZ_STORE_DEFAULT_MAP ? (uint64_t)a->max_map : 0;
    if ((rc = kvz_store_open(store_path, KVZ_STORE_CREATE, map0, fp, &st))) {
        cli_error(rc, "cannot open store %s", store_path);
        kvz_model_free(m);
        return cli_store_exit(rc);
    }
    if (a->max_map) kvz_store_set_max_map(st, (uint64_t)a->max_map);
    int32_t max_part = kvz_ingest_max_part_tokens(m);
    if (a->part_tokens > 0 && a->part_tokens < max_part) max_part = (int32_t)a->part_tokens;

    progress pr = {.tty = 0, .quiet = 1, .t0 = kvz_now()};
    run_state rs = {.pr = &pr, .st = st, .quiet = a->quiet}; /* lines reach the parent also under --json */
    size_t n_taken = 0;
    int failed = 0, skipped = 0;
    kvz_pipeline *pl = NULL;
    const double t_start = kvz_now();
    if (pipeline_open(m, st, &a->o, &rs, &pl)) failed++;
    /* a document is claimed when this worker submits it: on CUDA the next one is
     * scored while the last ones are encoded and committed */
    for (size_t j = 0; pl && j < kvz_claims_count(claims) && !kvz_pipeline_failed(pl); j++) {
        if (!kvz_claims_take(claims, j)) continue; /* another worker has it */
        n_taken++;
        const char *path, *id;
        int named;
        kvz_claims_doc(claims, j, &path, &id, &named);
        char *text;
        size_t len;
        kvz_tokens t = {0};
        rc = cli_read_text(path, (size_t)256 << 20, &text, &len); /* the parent read it: a change since */
        if ((rc == KVZ_ERR_ENCODING || rc == KVZ_ERR_EMPTY) && !named) {
            fprintf(stderr, "kvzip-ingest: warning: skipping %s: %s\n", cli_escape(path),
                    cli_escape(kvz_error_detail()));
            kvz_error_clear();
            skipped++;
            continue;
        }
        if (rc) { cli_error(rc, "cannot read %s", path); failed++; continue; }
        rc = kvz_tokenizer_encode(kvz_model_tokenizer(m), text, len, 0, &t);
        free(text);
        if (rc) { cli_error(rc, "cannot tokenize %s", path); failed++; continue; }
        rc = ingest_one(pl, id, path, &t, max_part, &rs); /* the pipeline copies the tokens */
        kvz_tokens_free(&t);
        /* on the CPU a submit only queues a short document (computed a few dozen at a
         * time); near the end of the list compute each at once, so that this worker does
         * not claim the last documents ahead of the others */
        if (!rc && kvz_model_device(m) == KVZ_DEVICE_CPU && kvz_claims_count(claims) - j <= 64)
            kvz_pipeline_drain(pl);
        if (rc) {
            failed++;
            if (store_stops(rc)) break;
        }
    }
    kvz_pipeline_free(pl); /* waits for the last commits (and their prunes) */
    failed += rs.failed;
    print_summary(store_path, n_taken, &rs, failed, skipped, a->o.kp.ratio, kvz_now() - t_start,
                  a->json, a->quiet);
    kvz_store_close(st);
    kvz_model_free(m);
    return failed ? EXIT_FAIL : 0;
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

/* Parent of --workers / --gpus: hand the usable documents (read in step 2, so unusable
 * files are dropped once, not by every worker) to worker processes, longest first. */
static int run_workers(const doc_list *docs, int argc, char **argv, const ingest_args *a,
                       int failed, int skipped)
{
    const int n_workers = (int)a->workers, gpus = a->gpus != NULL;
    const char *store_path = cli_store_path(a->store);
    kvz_dispatch_doc *dd = calloc(docs->n ? docs->n : 1, sizeof *dd);
    const char **av = calloc((size_t)argc + 4, sizeof *av);
    char **devs = calloc((size_t)n_workers, sizeof *devs);
    par_state ps = {(const char *const *)devs, a->quiet, a->json, 0, calloc((size_t)n_workers, sizeof(char *))};
    kvz_dispatch_worker *wk = calloc((size_t)n_workers, sizeof *wk);
    if (!dd || !av || !devs || !ps.summary || !wk) oom();
    size_t n = 0;
    for (size_t i = 0; i < docs->n; i++) {
        const doc_item *d = &docs->v[i];
        if (d->usable) dd[n++] = (kvz_dispatch_doc){d->path, d->id, d->named, (uint64_t)d->len};
    }
    ps.n_docs = n;
    /* worker arguments: the model, store and ingest settings of this command */
    static const char *const with_value[] = {"--store", "--max-map", "--model", "--synthetic", "--ratio",
                                             "--mode", "--kv-dtype", "--part-tokens", NULL};
    int k = 0;
    av[k++] = argv[0];
    for (int i = 1; i < argc && strcmp(argv[i], "--"); i++) {
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
        else snprintf(b, sizeof b, "%s", a->device_str);
        if (!(devs[w] = strdup(b))) oom();
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int per = a->threads > 0 ? (int)a->threads : (int)(ncpu / n_workers > 0 ? ncpu / n_workers : 1);
    if (!a->quiet && !a->json)
        fprintf(stderr, "kvzip-ingest: %zu documents, longest first, to %d worker%s (%s%s, %d thread%s each)\n",
                n, n_workers, n_workers == 1 ? "" : "s", gpus ? "one per GPU: cuda:0.." : "device ",
                gpus ? devs[n_workers - 1] + 5 : a->device_str, per, per == 1 ? "" : "s");
    kvz_dispatch_opts o = {n_workers, "/proc/self/exe", av, (const char *const *)devs, per, on_worker_line, &ps};
    const double t0 = kvz_now();
    int rc = n ? kvz_dispatch_run(dd, n, &o, wk) : 0;
    const double secs = kvz_now() - t0;
    int bad_workers = 0;
    long long ing = 0, unch = 0, linked = 0, wfail = 0, wskip = 0, toks = 0, parts = 0;
    unsigned long long stored = 0;
    for (int w = 0; n && !rc && w < n_workers; w++) {
        const char *js = ps.summary[w];
        ing += json_num(js, "ingested");
        unch += json_num(js, "unchanged");
        linked += json_num(js, "linked");
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
    if (a->json) {
        printf("{\"store\": ");
        cli_json_str(stdout, store_path, strlen(store_path));
        printf(", \"workers\": %d, \"documents\": %zu, \"parts\": %lld, \"ingested\": %lld, \"unchanged\": %lld, "
               "\"linked\": %lld, \"failed\": %d, \"skipped\": %d, \"tokens\": %lld, \"bytes_stored\": %llu, "
               "\"worker_errors\": %d, \"seconds\": %.3f, \"per_worker\": [",
               n_workers, n, parts, ing, unch, linked, failed, skipped, toks, stored, bad_workers, secs);
        for (int w = 0; w < n_workers; w++)
            printf("%s{\"device\": \"%s\", \"documents\": %llu, \"exit\": %d}", w ? ", " : "", devs[w],
                   (unsigned long long)wk[w].claimed, wk[w].exit_code);
        printf("]}\n");
    } else if (!a->quiet) {
        fprintf(stderr, "kvzip-ingest: %d workers: %lld ingested, %lld linked, %lld unchanged, %d failed, "
                "%d skipped | %lld tokens in %.1f s (%.0f tok/s) | stored %.2f MB\n", n_workers, ing, linked,
                unch, failed, skipped, toks, secs, secs > 0 ? toks / secs : 0, stored / 1e6);
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
    if (ex) return ex;
    if (a.dev_ordinal >= 0 && !a.workers) { /* before anything touches CUDA */
        int rcd = kvz_device_select(a.dev_ordinal);
        if (rcd) { cli_error(rcd, "--device %s", a.device_str); return EXIT_MODEL; }
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
    doc_list docs = {0};
    int failed = 0;
    collect_inputs(&docs, inputs, ni, &a, &failed);
    free(inputs);
    if (docs.n == 0 && !failed) {
        fprintf(stderr, "kvzip-ingest: error: no .txt, .md or extension-less documents found\n");
        return EXIT_INPUT;
    }
    uint64_t corpus_hash = 0;
    size_t n_corpus = 0;
    shard_filter(&docs, &shard, &corpus_hash, &n_corpus);
    if (shard.n && !a.json && (!a.quiet || a.list_only))
        fprintf(stderr, "kvzip-ingest: shard %u/%u (from %s): %zu of %zu documents (corpus listing %016llx)\n",
                shard.index, shard.n, shard.source, docs.n, n_corpus, (unsigned long long)corpus_hash);
    /* 1. ids (an id is in one shard: checking the shard's share finds every collision once) */
    if (check_ids(&docs, &failed)) {
        free_docs(&docs);
        return EXIT_FAIL;
    }
    if (a.list_only) {
        list_docs(&docs, &shard, corpus_hash, n_corpus, a.json);
        free_docs(&docs);
        return failed ? EXIT_FAIL : 0;
    }
    if (shard.n && (ex = shard_mark_store(cli_store_path(a.store), &shard, corpus_hash, n_corpus))) {
        free_docs(&docs);
        return ex;
    }
    /* 2. read every file (the text is kept for step 3 in this process) */
    const int parts_here = a.workers > 0 && part_ids_may_collide(&docs);
    const int n_usable = read_docs(&docs, a.workers == 0 || parts_here, &failed);
    if (n_usable == 0) { /* no store is created or opened for nothing */
        if (shard.n && !failed) {
            /* the shard's share of the corpus is empty or all skipped: an empty shard, not
             * an error (the other shards hold the rest) */
            if (docs.skipped && !a.quiet && !a.json)
                fprintf(stderr, "kvzip-ingest: shard %u/%u: no usable document (%d skipped)\n",
                        shard.index, shard.n, docs.skipped);
            ex = 0;
        } else if (!failed) {
            if (docs.skipped)
                fprintf(stderr, "kvzip-ingest: error: no usable document: %d file%s skipped\n",
                        docs.skipped, docs.skipped == 1 ? "" : "s");
            else
                fprintf(stderr, "kvzip-ingest: error: no .txt, .md or extension-less documents found\n");
            ex = EXIT_INPUT;
        } else {
            ex = EXIT_FAIL;
        }
        free_docs(&docs);
        return ex;
    }
    /* 3. and 4. here, or in worker processes */
    if (a.workers == 0) ex = ingest_local(&docs, &a, failed);
    else if (!parts_here || !(ex = check_part_ids(&docs, &a, &failed)))
        ex = run_workers(&docs, argc, argv, &a, failed, docs.skipped);
    free_docs(&docs);
    return ex;
}
