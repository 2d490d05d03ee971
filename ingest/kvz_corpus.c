/* The document list of an ingest run (kvz_corpus.h): folder walk, ids, reading, tokenizing. */
#include "kvz_corpus.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kvz_error.h"
#include "kvz_parts.h"
#include "kvz_store.h"
#include "kvz_text.h"

static void report(kvz_corpus *c, const kvz_corpus_event *ev)
{
    if (c->report) c->report(c->user, ev);
}

/* A left-out entry or a failure about one path: reported and counted. */
static void note(kvz_corpus *c, kvz_corpus_what what, int rc, const char *path, const char *detail)
{
    kvz_corpus_event ev = {.what = what, .rc = rc, .path = path, .detail = detail};
    report(c, &ev);
    if (what == KVZ_CORPUS_SKIPPED || what == KVZ_CORPUS_DIR_UNREADABLE) c->skipped++;
    else if (what != KVZ_CORPUS_DIR_WALKED) c->failed++;
    kvz_error_clear();
}

void kvz_corpus_init(kvz_corpus *c, kvz_corpus_fn fn, void *user)
{
    *c = (kvz_corpus){.report = fn, .user = user};
}

static void doc_free(kvz_corpus_doc *d)
{
    free(d->path);
    free(d->id);
    free(d->text);
}

void kvz_corpus_free(kvz_corpus *c)
{
    for (size_t i = 0; i < c->n; i++) doc_free(&c->v[i]);
    free(c->v);
    c->v = NULL;
    c->n = c->cap = 0;
}

static int push_doc(kvz_corpus *c, const char *path, const char *id, int named)
{
    if (c->n == c->cap) {
        const size_t cap = c->cap ? c->cap * 2 : 64;
        kvz_corpus_doc *v = realloc(c->v, cap * sizeof *v);
        if (!v) return KVZ_ERR_NOMEM;
        c->v = v;
        c->cap = cap;
    }
    kvz_corpus_doc *d = &c->v[c->n];
    *d = (kvz_corpus_doc){.path = strdup(path), .id = strdup(id), .named = named};
    if (!d->path || !d->id) {
        doc_free(d);
        return KVZ_ERR_NOMEM;
    }
    c->n++;
    return 0;
}

/* ---- folder walk ---- */

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

/* Real folders already walked under one input: (st_dev, st_ino). */
typedef struct dir_set {
    struct { dev_t dev; ino_t ino; } *v;
    size_t n, cap;
} dir_set;

/* 1 if the folder was new (and is now recorded), 0 if already walked, or KVZ_ERR_NOMEM. */
static int dir_set_add(dir_set *s, const struct stat *st)
{
    for (size_t i = 0; i < s->n; i++)
        if (s->v[i].dev == st->st_dev && s->v[i].ino == st->st_ino) return 0;
    if (s->n == s->cap) {
        const size_t cap = s->cap ? s->cap * 2 : 16;
        void *v = realloc(s->v, cap * sizeof *s->v);
        if (!v) return KVZ_ERR_NOMEM;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n].dev = st->st_dev;
    s->v[s->n].ino = st->st_ino;
    s->n++;
    return 1;
}

/* Walk @p dir (sorted, recursive); ids are paths relative to the root, under @p rel.
 * Symbolic links are followed, but each real folder is walked at most once (@p seen),
 * so a link to an ancestor or a second link to a folder adds nothing. */
static int walk(kvz_corpus *c, const char *dir, const char *rel, dir_set *seen)
{
    DIR *d = opendir(dir);
    if (!d) {
        note(c, KVZ_CORPUS_DIR_UNREADABLE, 0, dir, strerror(errno));
        return 0;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    struct dirent *e;
    while (!rc && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        if (n == cap) {
            char **v = realloc(names, (cap = cap ? cap * 2 : 32) * sizeof *names);
            if (!v) { rc = KVZ_ERR_NOMEM; break; }
            names = v;
        }
        if (!(names[n] = strdup(e->d_name))) rc = KVZ_ERR_NOMEM;
        else n++;
    }
    closedir(d);
    if (n) qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n; i++) {
        char path[PATH_MAX], id[PATH_MAX];
        const int pl = snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        const int il = snprintf(id, sizeof id, "%s%s%s", rel, rel[0] ? "/" : "", names[i]);
        struct stat st, lst;
        if (rc) {
            /* out of memory: free the rest */
        } else if (pl >= (int)sizeof path || il >= (int)sizeof id) {
            note(c, KVZ_CORPUS_SKIPPED, 0, path, "path longer than 4095 bytes");
        } else if (stat(path, &st) != 0) {
            /* never look at st after a failed stat: a dangling link is skipped wherever it sorts */
            const int e2 = errno;
            if (lstat(path, &lst) == 0 && S_ISLNK(lst.st_mode) && e2 == ENOENT)
                note(c, KVZ_CORPUS_SKIPPED, 0, path, "dangling symbolic link");
            else
                note(c, KVZ_CORPUS_SKIPPED, 0, path, strerror(e2));
        } else if (S_ISDIR(st.st_mode)) {
            const int fresh = dir_set_add(seen, &st);
            if (fresh < 0) rc = fresh;
            else if (fresh) rc = walk(c, path, id, seen);
            else note(c, KVZ_CORPUS_DIR_WALKED, 0, path, NULL);
        } else if (wanted_name(names[i])) {
            if (S_ISREG(st.st_mode)) rc = push_doc(c, path, id, 0);
            else note(c, KVZ_CORPUS_SKIPPED, 0, path, "not a regular file");
        }
        free(names[i]);
    }
    free(names);
    return rc;
}

int kvz_corpus_add(kvz_corpus *c, const char *input, const char *id, int path_ids)
{
    struct stat st;
    if (stat(input, &st)) {
        note(c, KVZ_CORPUS_MISSING, 0, input, strerror(errno));
        return 0;
    }
    if (!S_ISDIR(st.st_mode)) { /* a FIFO or device is rejected when read, without blocking */
        const char *base = strrchr(input, '/'), *given = input;
        while (given[0] == '.' && given[1] == '/') given += 2;
        return push_doc(c, input, id ? id : path_ids ? given : (base ? base + 1 : input), 1);
    }
    if (id) return kvz_error_set(KVZ_ERR_ARG, "%s is a folder: an id names one file", input);
    char root[PATH_MAX];
    if (snprintf(root, sizeof root, "%s", input) >= (int)sizeof root)
        return kvz_error_set(KVZ_ERR_ARG, "folder path longer than %d bytes", PATH_MAX - 1);
    size_t rl = strlen(root);
    while (rl > 1 && root[rl - 1] == '/') root[--rl] = 0;
    dir_set seen = {0};
    int rc = dir_set_add(&seen, &st);
    char *real = path_ids ? realpath(root, NULL) : NULL; /* "." -> its real name */
    const char *name = real ? strrchr(real, '/') + 1 : "";
    if (rc >= 0) rc = walk(c, root, name, &seen);
    free(real);
    free(seen.v);
    return rc;
}

int kvz_corpus_shard(kvz_corpus *c, const kvz_shard *sh, uint64_t *hash, size_t *n_ids)
{
    const char **ids = malloc((c->n ? c->n : 1) * sizeof *ids);
    if (!ids) return KVZ_ERR_NOMEM;
    for (size_t i = 0; i < c->n; i++) ids[i] = c->v[i].id;
    const int rc = kvz_corpus_hash(ids, c->n, hash);
    free(ids);
    if (rc) return rc;
    *n_ids = c->n;
    if (!sh || !sh->n) return 0;
    size_t k = 0;
    for (size_t i = 0; i < c->n; i++) {
        if (kvz_shard_of(c->v[i].id, sh->n) == sh->index) c->v[k++] = c->v[i];
        else doc_free(&c->v[i]);
    }
    c->n = k;
    return 0;
}

/* ---- ids: each stored id comes from exactly one input ---- */
typedef struct id_ref {
    const char *id;   /* the stored id (owned by the doc, or by `own`) */
    char *own;
    size_t doc;       /* index into the list */
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

/* Report every id two documents would both be stored under; drop exact repeats of one
 * file (the same path or the same file twice). Returns the number of collisions. */
static int id_collisions(kvz_corpus *c, id_ref *r, size_t n)
{
    int bad = 0;
    if (n) qsort(r, n, sizeof *r, cmp_id_ref);
    for (size_t i = 1; i < n; i++) {
        if (strcmp(r[i - 1].id, r[i].id) || r[i - 1].doc == r[i].doc) continue;
        kvz_corpus_doc *a = &c->v[r[i - 1].doc], *b = &c->v[r[i].doc];
        if (r[i - 1].n_parts <= 1 && r[i].n_parts <= 1 && same_file(a->path, b->path)) {
            b->dropped = 1; /* the same file named twice: store it once */
            const id_ref t = r[i]; /* compare what follows with the one kept (swap: each */
            r[i] = r[i - 1];       /* entry keeps its own allocation) */
            r[i - 1] = t;
            continue;
        }
        kvz_corpus_event ev = {.what = KVZ_CORPUS_COLLISION, .path = a->path, .path2 = b->path,
                               .id = r[i].id, .part = r[i - 1].part, .n_parts = r[i - 1].n_parts,
                               .part2 = r[i].part, .n_parts2 = r[i].n_parts};
        report(c, &ev);
        bad++;
    }
    c->collisions += bad;
    return bad;
}

int kvz_corpus_check_ids(kvz_corpus *c)
{
    for (size_t i = 0; i < c->n; i++) {
        const size_t n = strlen(c->v[i].id);
        if (n == 0 || n > KVZ_STORE_DOC_ID_MAX) {
            kvz_corpus_event ev = {.what = KVZ_CORPUS_ID_LENGTH, .path = c->v[i].path, .id = c->v[i].id};
            report(c, &ev);
            c->v[i].dropped = 1; /* not read, not stored */
            c->failed++;
        }
    }
    id_ref *r = malloc((c->n + 1) * sizeof *r);
    if (!r) return KVZ_ERR_NOMEM;
    size_t nr = 0;
    for (size_t i = 0; i < c->n; i++)
        if (!c->v[i].dropped) r[nr++] = (id_ref){c->v[i].id, NULL, i, 1, 1};
    const int bad = id_collisions(c, r, nr);
    free(r);
    return bad;
}

/* ---- reading and tokenizing ---- */

int kvz_corpus_read_file(kvz_corpus *c, const char *path, int named, char **text, size_t *len)
{
    const int rc = kvz_text_read(path, KVZ_CORPUS_MAX_FILE, text, len);
    if ((rc == KVZ_ERR_ENCODING || rc == KVZ_ERR_EMPTY) && !named) {
        note(c, KVZ_CORPUS_SKIPPED, 0, path, kvz_error_detail());
        return 1;
    }
    if (rc) note(c, KVZ_CORPUS_UNREADABLE, rc, path, NULL);
    return rc;
}

int kvz_corpus_read(kvz_corpus *c, int keep_text)
{
    int n_usable = 0;
    for (size_t i = 0; i < c->n; i++) {
        kvz_corpus_doc *d = &c->v[i];
        if (d->dropped) continue;
        if (kvz_corpus_read_file(c, d->path, d->named, &d->text, &d->len)) continue;
        if (!keep_text) {
            free(d->text);
            d->text = NULL;
        }
        d->usable = 1;
        n_usable++;
    }
    return n_usable;
}

int kvz_corpus_tokenize(kvz_corpus *c, const kvz_tokenizer *tok, int32_t max_part, kvz_tokens *toks,
                        int64_t *total)
{
    size_t n_ids = 0;
    *total = 0;
    for (size_t i = 0; i < c->n; i++) {
        kvz_corpus_doc *d = &c->v[i];
        if (!d->usable) continue;
        kvz_tokens own = {0}, *t = toks ? &toks[i] : &own;
        int rc = d->text ? kvz_tokenizer_encode(tok, d->text, d->len, 0, t)
                         : kvz_error_set(KVZ_ERR_ARG, "%s: text not kept for tokenizing", d->path);
        free(d->text);
        d->text = NULL;
        kvz_corpus_what what = KVZ_CORPUS_UNTOKENIZED;
        if (!rc) {
            char last[KVZ_STORE_DOC_ID_MAX + 1];
            d->n_parts = kvz_ingest_n_parts((int32_t)t->n, max_part);
            what = KVZ_CORPUS_NO_PARTS;
            if (d->n_parts < 1) rc = kvz_error_set(KVZ_ERR_EMPTY, "%s has no tokens", d->path);
            else rc = kvz_ingest_part_id(d->id, d->n_parts, d->n_parts, last);
            if (!rc) {
                n_ids += (size_t)d->n_parts;
                *total += (int64_t)t->n * 2;
            }
        }
        kvz_tokens_free(&own);
        if (rc) {
            d->usable = 0;
            note(c, what, rc, d->path, NULL);
        }
    }
    id_ref *r = malloc((n_ids + 1) * sizeof *r);
    if (!r) return KVZ_ERR_NOMEM;
    size_t nr = 0;
    int rc = 0;
    for (size_t i = 0; i < c->n && !rc; i++) {
        const kvz_corpus_doc *d = &c->v[i];
        if (!d->usable) continue;
        for (int32_t p = 1; p <= d->n_parts; p++) {
            char id[KVZ_STORE_DOC_ID_MAX + 1];
            kvz_ingest_part_id(d->id, p, d->n_parts, id); /* the last (longest) one fitted */
            r[nr] = (id_ref){NULL, strdup(id), i, p, d->n_parts};
            if (!r[nr].own) { rc = KVZ_ERR_NOMEM; break; }
            r[nr].id = r[nr].own;
            nr++;
        }
    }
    const int bad = rc ? rc : id_collisions(c, r, nr);
    for (size_t k = 0; k < nr; k++) free(r[k].own);
    free(r);
    return bad;
}

int kvz_corpus_part_ids_may_collide(const kvz_corpus *c)
{
    const char **ids = malloc((c->n ? c->n : 1) * sizeof *ids);
    if (!ids) return 1;
    size_t n = 0;
    for (size_t i = 0; i < c->n; i++)
        if (!c->v[i].dropped) ids[n++] = c->v[i].id;
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
