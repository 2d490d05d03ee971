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
#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_ingest.h"
#include "kvz_parts.h"
#include "kvz_store.h"
#include "kvz_kvrow.h"
#include "kvz_pipeline.h"

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
        "  --path-ids         ids keep where the input came from: a DIR argument's own\n"
        "                     name leads its ids (dir1/same.txt), a FILE argument's id is\n"
        "                     its path as given (a/x.txt); for inputs whose plain ids collide\n"
        "  --part-tokens N    split documents longer than N tokens into parts (default and\n"
        "                     maximum: what the model allows)\n"
        "  --threads N        CPU threads (default: all cores)\n"
        "  --device D         cpu, cuda or auto (default auto)\n"
        "  --json             print the summary as one JSON object on stdout\n"
        "  --quiet            no progress bar and no per-document lines\n"
        "  -h, --help         this text\n"
        "  --                 end of options: every later argument is a DIR or FILE\n"
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

/* ---- each document's parts through the ingest pipeline ----
 * The ID#N part policy of kvz_ingest_document (ingest/kvz_parts.h) with the parts
 * ingested by kvz_pipeline (ingest/kvz_pipeline.h: on the CUDA backend the GPU scores
 * the next part while the last ones are encoded and committed; on the CPU a submit is
 * kvz_ingest_doc itself): kvz_ingest_parts_check before the first part is submitted,
 * each part's number recorded in its entry, kvz_ingest_parts_prune once every part of
 * the document is committed. Results arrive in submission order through on_done. */
typedef struct run_state {
    kvz_store *st;
    doc_list *docs;
    progress *pr;
    int quiet;
    int n_written, n_linked, n_unchanged, n_parts, failed;
    int64_t tokens_done, pairs_total, pairs_kept, tokens_written;
    uint64_t b_full, b_kept, b_stored;
    int32_t *parts_left;   /* per document: parts not reported yet */
    int *doc_failed;       /* per document: a part failed or was not attempted */
} run_state;

static void doc_fail(run_state *rs, size_t i)
{
    if (!rs->doc_failed[i]) rs->failed++;
    rs->doc_failed[i] = 1;
}

static void on_done(void *ctx, const char *id, int rc, const char *detail, const kvz_ingest_result *r,
                    void *user)
{
    run_state *rs = ctx;
    const size_t i = (size_t)user;
    const doc_item *d = &rs->docs->v[i];
    if (rs->pr->tty && !rs->pr->quiet) fprintf(stderr, "\r\033[K");
    if (!r) { /* not attempted: the store had stopped taking documents (reported once) */
        doc_fail(rs, i);
        return;
    }
    if (rc) {
        kvz_error_set(rc, "%s", detail);
        cli_error(rc, "%s", id);
        doc_fail(rs, i); /* earlier parts stay stored, nothing is pruned */
        return;
    }
    const char *what;
    rs->n_parts++;
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
    if (--rs->parts_left[i] > 0 || rs->doc_failed[i]) return;
    /* every part committed: what an older version of this document left behind */
    int prc = kvz_ingest_parts_prune(rs->st, d->id, d->path, d->n_parts, NULL);
    if (prc) {
        cli_error(prc, "%s", d->id);
        doc_fail(rs, i);
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
}

int main(int argc, char **argv)
{
    cli_init("kvzip-ingest", argv);
    const char *store_flag = NULL, *model_flag = NULL, *synth_flag = NULL, *id_flag = NULL;
    long threads = 0, part_tokens = 0, max_map = 0;
    int json = 0, quiet = 0, ended = 0, path_ids = 0;
    int32_t device = KVZ_DEVICE_AUTO;
    kvz_ingest_opts o;
    kvz_ingest_defaults(&o);
    const char **inputs = calloc((size_t)argc, sizeof *inputs);
    if (!inputs) oom();
    int ni = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int kind = cli_arg_kind(a, &ended); /* "--" ends the options */
        if (kind < 0) continue;
        if (kind == 0) { inputs[ni++] = a; continue; }
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
        else if (!strcmp(a, "--path-ids")) path_ids = 1;
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--quiet")) quiet = 1;
        else if (a[0] == '-' && a[1] == '-') cli_usage_error("unknown option '%s'", a);
        else inputs[ni++] = a;
    }
    if (ni == 0) cli_usage_error("no document or folder given");
    if (id_flag && ni != 1) cli_usage_error("--id takes exactly one FILE argument");

    /* 1. the document list: nothing below reads a file or loads the model until
     *    every id is known to be valid and unique */
    doc_list docs = {0};
    int failed = 0;
    for (int i = 0; i < ni; i++) {
        struct stat st;
        if (stat(inputs[i], &st)) {
            fprintf(stderr, "kvzip-ingest: error: %s: %s\n", cli_escape(inputs[i]), strerror(errno));
            failed++;
            continue;
        }
        if (S_ISDIR(st.st_mode)) {
            if (id_flag) cli_usage_error("--id takes a FILE, not a folder");
            char root[4096];
            snprintf(root, sizeof root, "%s", inputs[i]);
            size_t rl = strlen(root);
            while (rl > 1 && root[rl - 1] == '/') root[--rl] = 0;
            dir_set seen = {0};
            dir_set_add(&seen, &st);
            char *real = path_ids ? realpath(root, NULL) : NULL; /* "." -> its real name */
            const char *name = real ? strrchr(real, '/') + 1 : "";
            walk(&docs, root, name, &seen);
            free(real);
            free(seen.v);
        } else { /* a FIFO or device is rejected when read, without blocking */
            const char *base = strrchr(inputs[i], '/'), *given = inputs[i];
            while (given[0] == '.' && given[1] == '/') given += 2;
            push_doc(&docs, inputs[i], id_flag ? id_flag : path_ids ? given : (base ? base + 1 : inputs[i]));
            docs.v[docs.n - 1].named = 1;
        }
    }
    for (size_t i = 0; i < docs.n; i++) {
        size_t n = strlen(docs.v[i].id);
        if (n == 0 || n > KVZ_STORE_DOC_ID_MAX) {
            fprintf(stderr, "kvzip-ingest: error: %s: document id of %zu bytes is outside 1..%d "
                    "bytes (ingest the FILE alone with a shorter --id)\n", cli_escape(docs.v[i].path), n,
                    KVZ_STORE_DOC_ID_MAX);
            docs.v[i].dup = 1; /* not read, not stored */
            failed++;
        }
    }
    {
        id_ref *r = xrealloc(NULL, (docs.n + 1) * sizeof *r);
        size_t nr = 0;
        for (size_t i = 0; i < docs.n; i++)
            if (!docs.v[i].dup) r[nr++] = (id_ref){docs.v[i].id, NULL, i, 1, 1};
        int bad = id_collisions(&docs, r, nr);
        free(r);
        if (bad) {
            free_docs(&docs);
            free(inputs);
            return EXIT_FAIL;
        }
    }

    /* 2. read every file: unusable ones fail (named) or are skipped (walk) before
     *    any model or store work */
    int n_usable = 0;
    for (size_t i = 0; i < docs.n; i++) {
        doc_item *d = &docs.v[i];
        if (d->dup) continue;
        int rc = cli_read_text(d->path, (size_t)256 << 20, &d->text, &d->len);
        if ((rc == KVZ_ERR_ENCODING || rc == KVZ_ERR_EMPTY) && !d->named) {
            fprintf(stderr, "kvzip-ingest: warning: skipping %s: %s\n", cli_escape(d->path),
                    cli_escape(kvz_error_detail()));
            kvz_error_clear();
            docs.skipped++;
            continue;
        }
        if (rc) {
            cli_error(rc, "cannot read %s", d->path);
            failed++;
            continue;
        }
        d->usable = 1;
        n_usable++;
    }
    if (n_usable == 0) { /* no store is created or opened for nothing */
        if (!failed) {
            if (docs.skipped)
                fprintf(stderr, "kvzip-ingest: error: no usable document: %d file%s skipped\n",
                        docs.skipped, docs.skipped == 1 ? "" : "s");
            else
                fprintf(stderr, "kvzip-ingest: error: no .txt, .md or extension-less documents found\n");
        }
        free_docs(&docs);
        free(inputs);
        return failed ? EXIT_FAIL : EXIT_INPUT;
    }

    kvz_model *m;
    int rc = cli_load_model(cli_model_path(model_flag), synth_flag, device, (int32_t)threads, &m);
    if (rc) return cli_model_exit(rc);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);

    /* 3. tokenize: part counts, then every stored id (parts included) checked for
     *    length and uniqueness before the model scores anything */
    int32_t max_part = kvz_ingest_max_part_tokens(m);
    if (part_tokens > 0 && part_tokens < max_part) max_part = (int32_t)part_tokens;
    kvz_tokens *toks = calloc(docs.n, sizeof *toks);
    if (!toks) oom();
    int64_t total = 0;
    size_t n_ids = 0;
    for (size_t i = 0; i < docs.n; i++) {
        doc_item *d = &docs.v[i];
        if (!d->usable) continue;
        rc = kvz_tokenizer_encode(tok, d->text, d->len, 0, &toks[i]);
        free(d->text);
        d->text = NULL;
        if (rc) {
            cli_error(rc, "cannot tokenize %s", d->path);
            d->usable = 0;
            failed++;
            continue;
        }
        d->n_parts = kvz_ingest_n_parts((int32_t)toks[i].n, max_part);
        char last[KVZ_STORE_DOC_ID_MAX + 1];
        if (d->n_parts < 1) {
            rc = kvz_error_set(KVZ_ERR_EMPTY, "%s has no tokens", d->path);
        } else if ((rc = kvz_ingest_part_id(d->id, d->n_parts, d->n_parts, last)) == 0) {
            n_ids += (size_t)d->n_parts;
            total += (int64_t)toks[i].n * 2;
            continue;
        }
        cli_error(rc, "%s", d->path);
        d->usable = 0;
        failed++;
    }
    {
        id_ref *r = xrealloc(NULL, (n_ids + 1) * sizeof *r);
        size_t nr = 0;
        for (size_t i = 0; i < docs.n; i++) {
            const doc_item *d = &docs.v[i];
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
        int bad = id_collisions(&docs, r, nr);
        for (size_t k = 0; k < nr; k++) free(r[k].own);
        free(r);
        if (bad) {
            for (size_t i = 0; i < docs.n; i++) kvz_tokens_free(&toks[i]);
            free(toks);
            free_docs(&docs);
            free(inputs);
            kvz_model_free(m);
            return EXIT_FAIL;
        }
    }

    const char *store_path = cli_store_path(store_flag);
    kvz_store *st = NULL;
    int any = 0;
    for (size_t i = 0; i < docs.n; i++) any |= docs.v[i].usable;
    if (!any) goto summary_free; /* nothing left to store: no store is created */
    const uint64_t map0 = max_map && (uint64_t)max_map < KVZ_STORE_DEFAULT_MAP ? (uint64_t)max_map : 0;
    if ((rc = kvz_store_open(store_path, KVZ_STORE_CREATE, map0, fp, &st))) {
        cli_error(rc, "cannot open store %s", store_path);
        return cli_store_exit(rc);
    }
    if (max_map) kvz_store_set_max_map(st, (uint64_t)max_map);

    /* 4. score, evict, store: kvz_ingest_document owns the ID#N part policy */
    progress pr = {.tty = isatty(2), .quiet = quiet || json, .total = total, .t0 = kvz_now()};
    run_state rs = {.st = st, .docs = &docs, .pr = &pr, .quiet = quiet || json};
    rs.parts_left = calloc(docs.n ? docs.n : 1, sizeof *rs.parts_left);
    rs.doc_failed = calloc(docs.n ? docs.n : 1, sizeof *rs.doc_failed);
    if (!rs.parts_left || !rs.doc_failed) oom();
    o.progress = on_progress;
    o.progress_ctx = &pr;
    kvz_pipeline *pl = NULL;
    if ((rc = kvz_pipeline_create(m, st, &o, 0, on_done, &rs, &pl))) {
        cli_error(rc, "cannot start the ingest pipeline");
        kvz_store_close(st);
        return cli_exit_code(rc);
    }
    const double t_start = kvz_now();
    for (size_t i = 0; i < docs.n && !kvz_pipeline_failed(pl); i++) {
        doc_item *d = &docs.v[i];
        if (!d->usable) continue;
        /* nothing is computed when one of its ids belongs to another document */
        if ((rc = kvz_ingest_parts_check(st, d->id, d->path, d->n_parts))) {
            cli_error(rc, "%s", d->id);
            failed++;
            if (rc == KVZ_ERR_FULL || rc == KVZ_ERR_MODEL || rc == KVZ_ERR_LMDB || rc == KVZ_ERR_BUSY)
                break; /* the store cannot take more: stop */
            continue;
        }
        rs.parts_left[i] = d->n_parts;
        for (int32_t p = 0; p < d->n_parts && !rs.doc_failed[i] && !kvz_pipeline_failed(pl); p++) {
            char id[KVZ_STORE_DOC_ID_MAX + 1], name[64];
            int32_t s0, s1;
            kvz_ingest_part_span((int32_t)toks[i].n, d->n_parts, p, &s0, &s1);
            kvz_ingest_part_id(d->id, p + 1, d->n_parts, id); /* checked in step 3 */
            snprintf(name, sizeof name, "%s", cli_escape(id));
            pr.name = name;
            pr.base = rs.tokens_done;
            kvz_pipeline_submit_part(pl, id, d->path, toks[i].ids + s0, s1 - s0,
                                     d->n_parts > 1 ? (uint32_t)(p + 1) : 0, (void *)i);
            rs.tokens_done += 2 * (int64_t)(s1 - s0);
        }
    }
    kvz_pipeline_free(pl); /* waits for the last commits (and their prunes) */
    failed += rs.failed;
    free(rs.parts_left);
    free(rs.doc_failed);
    const double secs = kvz_now() - t_start;
    if (json) {
        printf("{\"store\": ");
        cli_json_str(stdout, store_path, strlen(store_path));
        printf(", \"documents\": %zu, \"parts\": %d, \"ingested\": %d, \"unchanged\": %d, "
               "\"linked\": %d, \"failed\": %d, \"skipped\": %d, \"tokens\": %lld, "
               "\"tokens_ingested\": %lld, \"ratio\": %.4f, "
               "\"pairs_total\": %lld, \"pairs_kept\": %lld, \"bytes_kv_full\": %llu, "
               "\"bytes_kv_kept\": %llu, \"bytes_stored\": %llu, \"seconds\": %.3f}\n",
               docs.n, rs.n_parts, rs.n_written, rs.n_unchanged, rs.n_linked, failed, docs.skipped,
               (long long)(rs.tokens_done / 2), (long long)rs.tokens_written, o.kp.ratio,
               (long long)rs.pairs_total, (long long)rs.pairs_kept, (unsigned long long)rs.b_full,
               (unsigned long long)rs.b_kept, (unsigned long long)rs.b_stored, secs);
    } else if (!quiet) {
        char kv[256] = "";
        if (rs.n_written && rs.b_full && rs.b_stored && rs.pairs_total)
            snprintf(kv, sizeof kv, " | ingested KV: full %.2f MB, kept %.2f MB (%.0f%% of the "
                     "context pairs, %.0f%% of the bytes with the prefix), stored %.2f MB (zstd "
                     "%.2fx)", rs.b_full / 1e6, rs.b_kept / 1e6,
                     100.0 * (double)rs.pairs_kept / (double)rs.pairs_total,
                     100.0 * (double)rs.b_kept / (double)rs.b_full, rs.b_stored / 1e6,
                     (double)rs.b_kept / (double)rs.b_stored);
        fprintf(stderr, "kvzip-ingest: %d ingested, %d linked, %d unchanged, %d failed, %d skipped "
                "| %lld tokens in %.1f s%s\n", rs.n_written, rs.n_linked, rs.n_unchanged, failed,
                docs.skipped, (long long)(rs.tokens_done / 2), secs, kv);
    }
summary_free:
    for (size_t i = 0; i < docs.n; i++) kvz_tokens_free(&toks[i]);
    free_docs(&docs);
    free(toks);
    free(inputs);
    kvz_store_close(st);
    kvz_model_free(m);
    return failed ? EXIT_FAIL : 0;
}
