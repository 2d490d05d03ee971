/* The corpus walker and id checks (ingest/kvz_corpus.h) on a real temp tree:
 *  - a walk lists *.txt, *.md and extension-less files, sorted, ids relative to
 *    the folder; hidden entries and other extensions are neither listed nor reported
 *  - FIFOs and dangling links are reported SKIPPED at the walk; a link back to an
 *    ancestor or to its own folder is reported DIR_WALKED once each and adds nothing
 *  - binary, non-UTF-8 and empty files are SKIPPED when read (named: UNREADABLE)
 *  - two inputs with one id are a COLLISION (path_ids separates them); the same
 *    file named twice is kept once; ids over 511 bytes (a deep walk, an explicit
 *    id) are ID_LENGTH; a missing input is MISSING; an id for a folder is an error
 *  - part ids (ID#N) that hit another document's id are found after tokenizing
 *  - sharding keeps each document in exactly one of N shards
 * Every report is checked against what the tree holds, path by path. */
#include <errno.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvz_corpus.h"
#include "kvz_error.h"
#include "kvz_model.h"
#include "kvz_parts.h"
#include "kvz_test.h"

#define REQUIRE_VOID(cond)                                                           \
    do {                                                                             \
        if (!(cond)) { fprintf(stderr, "%s:%d: REQUIRE failed: %s\n", __FILE__,      \
                               __LINE__, #cond);                                     \
                       kvz_t_fail++; return; }                                       \
    } while (0)

#define MAXEV 64
typedef struct rec {
    int n;
    kvz_corpus_what what[MAXEV];
    char path[MAXEV][1024], detail[MAXEV][256], id[MAXEV][700], path2[MAXEV][1024];
    int rc[MAXEV];
    int32_t part[MAXEV], n_parts[MAXEV], part2[MAXEV], n_parts2[MAXEV];
} rec;

static void on_event(void *user, const kvz_corpus_event *e)
{
    rec *r = user;
    if (r->n >= MAXEV) return;
    const int i = r->n++;
    r->what[i] = e->what;
    r->rc[i] = e->rc;
    snprintf(r->path[i], sizeof r->path[i], "%s", e->path ? e->path : "");
    /* failures carry their text in the error detail, as the CLIs print it */
    snprintf(r->detail[i], sizeof r->detail[i], "%s", e->detail ? e->detail : e->rc ? kvz_error_detail() : "");
    snprintf(r->id[i], sizeof r->id[i], "%s", e->id ? e->id : "");
    snprintf(r->path2[i], sizeof r->path2[i], "%s", e->path2 ? e->path2 : "");
    r->part[i] = e->part;
    r->n_parts[i] = e->n_parts;
    r->part2[i] = e->part2;
    r->n_parts2[i] = e->n_parts2;
}

/* Index of the report of kind @p what about @p path (suffix match), or -1. */
static int find(const rec *r, kvz_corpus_what what, const char *path_end)
{
    for (int i = 0; i < r->n; i++) {
        const size_t a = strlen(r->path[i]), b = strlen(path_end);
        if (r->what[i] == what && a >= b && !strcmp(r->path[i] + a - b, path_end)) return i;
    }
    return -1;
}

static int count(const rec *r, kvz_corpus_what what)
{
    int k = 0;
    for (int i = 0; i < r->n; i++) k += r->what[i] == what;
    return k;
}

static char root[256];

static void put(const char *rel, const void *data, size_t n)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", root, rel);
    FILE *f = fopen(p, "wb");
    if (!f) { fprintf(stderr, "cannot write %s: %s\n", p, strerror(errno)); exit(1); }
    fwrite(data, 1, n, f);
    fclose(f);
}

static void dir(const char *rel)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", root, rel);
    if (mkdir(p, 0755)) { fprintf(stderr, "mkdir %s: %s\n", p, strerror(errno)); exit(1); }
}

static void lnk(const char *target, const char *rel)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", root, rel);
    if (symlink(target, p)) { fprintf(stderr, "symlink %s: %s\n", p, strerror(errno)); exit(1); }
}

static const char *at(const char *rel)
{
    static char p[4][1024];
    static int k;
    k = (k + 1) % 4;
    snprintf(p[k], sizeof p[k], "%s/%s", root, rel);
    return p[k];
}

static void test_walk(void)
{
    dir("t");
    put("t/a.txt", "alpha text\n", 11);
    put("t/noext", "no extension\n", 13);
    put("t/.hidden.txt", "hidden\n", 7);
    dir("t/.git");
    put("t/.git/x.txt", "in a hidden folder\n", 19);
    put("t/img.png", "\x89PNG", 4);
    put("t/bin.txt", "ab\0cd", 5);
    put("t/latin1.md", "caf\xe9\n", 5);
    put("t/empty.txt", " \n\t\n", 4);
    REQUIRE_VOID(mkfifo(at("t/fifo.txt"), 0644) == 0);
    lnk("nowhere.txt", "t/dangling.txt");
    dir("t/sub");
    put("t/sub/b.md", "# b\n", 4);
    lnk("..", "t/sub/up");     /* back to t: already walked */
    lnk(".", "t/sub/self");    /* itself */

    rec r = {0};
    kvz_corpus c;
    kvz_corpus_init(&c, on_event, &r);
    CHECK(kvz_corpus_add(&c, at("t"), NULL, 0) == 0);
    /* listed, sorted bytewise, ids relative to t */
    static const char *const want[] = {"a.txt", "bin.txt", "empty.txt", "latin1.md", "noext", "sub/b.md"};
    CHECKF(c.n == 6, "listed %zu", c.n);
    for (size_t i = 0; i < c.n && i < 6; i++) {
        CHECKF(!strcmp(c.v[i].id, want[i]), "doc %zu id '%s', want '%s'", i, c.v[i].id, want[i]);
        char p[1024];
        snprintf(p, sizeof p, "%s/t/%s", root, want[i]);
        CHECKF(!strcmp(c.v[i].path, p), "path %s", c.v[i].path);
        CHECK(c.v[i].named == 0);
    }
    /* the walk's reports: fifo and dangling link skipped, two links back not walked */
    int k = find(&r, KVZ_CORPUS_SKIPPED, "/t/fifo.txt");
    CHECK(k >= 0 && strstr(r.detail[k], "not a regular file"));
    k = find(&r, KVZ_CORPUS_SKIPPED, "/t/dangling.txt");
    CHECK(k >= 0 && strstr(r.detail[k], "dangling symbolic link"));
    CHECK(find(&r, KVZ_CORPUS_DIR_WALKED, "/t/sub/up") >= 0);
    CHECK(find(&r, KVZ_CORPUS_DIR_WALKED, "/t/sub/self") >= 0);
    CHECKF(r.n == 4, "%d reports after the walk", r.n);
    CHECK(c.skipped == 2 && c.failed == 0);
    for (int i = 0; i < r.n; i++) CHECK(!strstr(r.path[i], "hidden") && !strstr(r.path[i], ".git") &&
                                        !strstr(r.path[i], "img.png"));

    CHECK(kvz_corpus_check_ids(&c) == 0);
    CHECK(kvz_corpus_read(&c, 1) == 3);
    /* binary, non-UTF-8, empty: skipped when read, each with its reason */
    k = find(&r, KVZ_CORPUS_SKIPPED, "/t/bin.txt");
    CHECK(k >= 0 && strstr(r.detail[k], "not UTF-8") && strstr(r.detail[k], "0x00 at offset 2"));
    k = find(&r, KVZ_CORPUS_SKIPPED, "/t/latin1.md");
    CHECK(k >= 0 && strstr(r.detail[k], "0xe9 at offset 3"));
    k = find(&r, KVZ_CORPUS_SKIPPED, "/t/empty.txt");
    CHECK(k >= 0 && strstr(r.detail[k], "is empty"));
    CHECK(c.skipped == 5 && c.failed == 0 && r.n == 7);
    for (size_t i = 0; i < c.n; i++) {
        const int ok = !strcmp(c.v[i].id, "a.txt") || !strcmp(c.v[i].id, "noext") || !strcmp(c.v[i].id, "sub/b.md");
        CHECKF(c.v[i].usable == ok, "%s usable %d", c.v[i].id, c.v[i].usable);
        if (ok) CHECK(c.v[i].text && c.v[i].len == strlen(c.v[i].text));
    }
    kvz_corpus_free(&c);

    /* a named file that is not text is an error, not a skip */
    memset(&r, 0, sizeof r);
    kvz_corpus_init(&c, on_event, &r);
    CHECK(kvz_corpus_add(&c, at("t/bin.txt"), NULL, 0) == 0);
    CHECK(kvz_corpus_add(&c, at("t/fifo.txt"), NULL, 0) == 0); /* listed; rejected when read, not blocking */
    CHECK(c.n == 2 && c.v[0].named && !strcmp(c.v[0].id, "bin.txt") && !strcmp(c.v[1].id, "fifo.txt"));
    CHECK(kvz_corpus_read(&c, 0) == 0);
    k = find(&r, KVZ_CORPUS_UNREADABLE, "/t/bin.txt");
    CHECK(k >= 0 && r.rc[k] == KVZ_ERR_ENCODING);
    k = find(&r, KVZ_CORPUS_UNREADABLE, "/t/fifo.txt");
    CHECK(k >= 0 && r.rc[k] == KVZ_ERR_IO && strstr(r.detail[k], "a FIFO"));
    CHECK(c.failed == 2 && c.skipped == 0);
    /* missing input; an explicit id for a folder */
    CHECK(kvz_corpus_add(&c, at("t/none.txt"), NULL, 0) == 0);
    k = find(&r, KVZ_CORPUS_MISSING, "/t/none.txt");
    CHECK(k >= 0 && strstr(r.detail[k], "No such file"));
    CHECK(c.failed == 3 && c.n == 2);
    CHECK(kvz_corpus_add(&c, at("t"), "x", 0) == KVZ_ERR_ARG);
    kvz_error_clear();
    kvz_corpus_free(&c);
}

static void test_ids(void)
{
    dir("u");
    dir("u/x");
    dir("u/y");
    put("u/x/same.txt", "one\n", 4);
    put("u/y/same.txt", "two\n", 4);
    rec r = {0};
    kvz_corpus c;
    kvz_corpus_init(&c, on_event, &r);
    CHECK(kvz_corpus_add(&c, at("u/x"), NULL, 0) == 0 && kvz_corpus_add(&c, at("u/y"), NULL, 0) == 0);
    CHECK(kvz_corpus_check_ids(&c) == 1 && c.collisions == 1);
    int k = find(&r, KVZ_CORPUS_COLLISION, "/u/x/same.txt");
    CHECK(k >= 0 && !strcmp(r.id[k], "same.txt") && !strcmp(r.path2[k], at("u/y/same.txt")) &&
          r.n_parts[k] == 1 && r.n_parts2[k] == 1);
    kvz_corpus_free(&c);

    /* --path-ids: the folder's own name leads the ids */
    memset(&r, 0, sizeof r);
    kvz_corpus_init(&c, on_event, &r);
    CHECK(kvz_corpus_add(&c, at("u/x"), NULL, 1) == 0 && kvz_corpus_add(&c, at("u/y/"), NULL, 1) == 0);
    CHECK(c.n == 2 && !strcmp(c.v[0].id, "x/same.txt") && !strcmp(c.v[1].id, "y/same.txt"));
    CHECK(kvz_corpus_check_ids(&c) == 0 && r.n == 0);
    kvz_corpus_free(&c);

    /* the same file twice (a path and a link to it): stored once, no collision */
    lnk("same.txt", "u/x/alias");
    memset(&r, 0, sizeof r);
    kvz_corpus_init(&c, on_event, &r);
    CHECK(kvz_corpus_add(&c, at("u/x/same.txt"), NULL, 0) == 0);
    CHECK(kvz_corpus_add(&c, at("u/x/alias"), "same.txt", 0) == 0);
    CHECK(kvz_corpus_check_ids(&c) == 0 && r.n == 0);
    CHECK(c.n == 2 && !c.v[0].dropped && c.v[1].dropped);
    kvz_corpus_free(&c);

    /* ids over 511 bytes: a deep walk, and an explicit one; 511 itself is fine */
    char d1[200], rel[1024] = "v";
    memset(d1, 'd', 199);
    d1[199] = 0;
    dir("v");
    for (int i = 0; i < 3; i++) {
        snprintf(rel + strlen(rel), sizeof rel - strlen(rel), "/%s", d1);
        dir(rel);
    }
    char deep[1100];
    snprintf(deep, sizeof deep, "%s/f.txt", rel);
    put(deep, "deep\n", 5);
    put("v/ok.txt", "fine\n", 5);
    char id511[512], id512[513];
    memset(id511, 'i', 511);
    id511[511] = 0;
    memset(id512, 'j', 512);
    id512[512] = 0;
    memset(&r, 0, sizeof r);
    kvz_corpus_init(&c, on_event, &r);
    CHECK(kvz_corpus_add(&c, at("v"), NULL, 0) == 0);
    CHECK(kvz_corpus_add(&c, at("v/ok.txt"), id511, 0) == 0);
    CHECK(kvz_corpus_add(&c, at("v/ok.txt"), id512, 0) == 0);
    CHECK(c.n == 4);
    CHECK(kvz_corpus_check_ids(&c) == 0);
    CHECK(count(&r, KVZ_CORPUS_ID_LENGTH) == 2 && c.failed == 2);
    k = find(&r, KVZ_CORPUS_ID_LENGTH, "/f.txt");
    CHECK(k >= 0 && strlen(r.id[k]) == 3 * 200 + 5); /* "ddd.../ddd.../ddd.../f.txt" */
    k = find(&r, KVZ_CORPUS_ID_LENGTH, "/v/ok.txt");
    CHECK(k >= 0 && !strcmp(r.id[k], id512));
    int kept = 0;
    for (size_t i = 0; i < c.n; i++) kept += !c.v[i].dropped;
    CHECK(kept == 2); /* ok.txt under its own name and under the 511-byte id */
    CHECK(kvz_corpus_read(&c, 0) == 2);
    kvz_corpus_free(&c);
}

/* Part ids: a long document split into parts, and another input named like one of them. */
static void test_part_ids(void)
{
    kvz_model *m;
    kvz_model_opts mo = {.device = KVZ_DEVICE_CPU, .n_threads = 1};
    REQUIRE_VOID(kvz_model_synthetic("tiny-llama", &mo, &m) == 0);
    dir("w");
    char big[400];
    for (int i = 0; i < 399; i++) big[i] = (char)('a' + i % 26);
    big[399] = '\n';
    put("w/doc", big, sizeof big);
    put("w/doc#2", "named like part two\n", 20);
    put("w/other.txt", "short\n", 6);
    rec r = {0};
    kvz_corpus c;
    kvz_corpus_init(&c, on_event, &r);
    CHECK(kvz_corpus_add(&c, at("w"), NULL, 0) == 0);
    CHECK(kvz_corpus_part_ids_may_collide(&c) == 1);
    CHECK(kvz_corpus_check_ids(&c) == 0);
    CHECK(kvz_corpus_read(&c, 1) == 3);
    kvz_tokens toks[3] = {{0}};
    int64_t total = -1;
    CHECK(c.n == 3 && !strcmp(c.v[0].id, "doc") && !strcmp(c.v[1].id, "doc#2"));
    const int bad = kvz_corpus_tokenize(&c, kvz_model_tokenizer(m), 64, toks, &total);
    CHECKF(bad == 1, "collisions %d", bad);
    const int k = find(&r, KVZ_CORPUS_COLLISION, "/w/doc");
    const int32_t np = c.v[0].n_parts;
    CHECKF(np >= 2 && (int64_t)np * 64 >= (int64_t)toks[0].n && (int64_t)(np - 1) * 64 < (int64_t)toks[0].n,
           "%d parts of %zu tokens", np, toks[0].n);
    CHECK(k >= 0 && !strcmp(r.id[k], "doc#2") && r.part[k] == 2 && r.n_parts[k] == np &&
          r.n_parts2[k] == 1 && !strcmp(r.path2[k], at("w/doc#2")));
    CHECK(total == 2 * (int64_t)(toks[0].n + toks[1].n + toks[2].n));
    for (int i = 0; i < 3; i++) {
        CHECK(toks[i].n > 0 && c.v[i].text == NULL);
        kvz_tokens_free(&toks[i]);
    }
    kvz_corpus_free(&c);

    /* without the look-alike there is nothing to find */
    memset(&r, 0, sizeof r);
    kvz_corpus_init(&c, on_event, &r);
    CHECK(kvz_corpus_add(&c, at("w/doc"), NULL, 0) == 0 && kvz_corpus_add(&c, at("w/other.txt"), NULL, 0) == 0);
    CHECK(kvz_corpus_part_ids_may_collide(&c) == 0);
    CHECK(kvz_corpus_read(&c, 1) == 2);
    CHECK(kvz_corpus_tokenize(&c, kvz_model_tokenizer(m), 64, NULL, &total) == 0 && r.n == 0);
    kvz_corpus_free(&c);
    kvz_model_free(m);
}

/* Shards: each document in exactly one shard; the listing hash covers the whole list. */
static void test_shard(void)
{
    dir("s");
    char name[32];
    for (int i = 0; i < 40; i++) {
        snprintf(name, sizeof name, "s/f%02d.txt", i);
        put(name, "x\n", 2);
    }
    uint64_t h0 = 0, h;
    size_t n_ids, total = 0;
    int seen[40] = {0};
    for (uint32_t s = 0; s < 3; s++) {
        kvz_corpus c;
        kvz_corpus_init(&c, NULL, NULL);
        CHECK(kvz_corpus_add(&c, at("s"), NULL, 0) == 0);
        const kvz_shard sh = {s, 3, "test"};
        CHECK(kvz_corpus_shard(&c, &sh, &h, &n_ids) == 0 && n_ids == 40);
        if (s == 0) h0 = h;
        CHECK(h == h0);
        for (size_t i = 0; i < c.n; i++) {
            CHECK(kvz_shard_of(c.v[i].id, 3) == s);
            seen[atoi(c.v[i].id + 1)]++;
        }
        total += c.n;
        kvz_corpus_free(&c);
    }
    CHECK(total == 40);
    for (int i = 0; i < 40; i++) CHECK(seen[i] == 1);
}

int main(void)
{
    snprintf(root, sizeof root, "%s/kvz_corpus_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    REQUIRE(mkdtemp(root));
    test_walk();
    test_ids();
    test_part_ids();
    test_shard();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", root);
    return kvz_test_summary();
}
