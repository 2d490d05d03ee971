/* Sharding, corpus hash, device spec and the worker hand-out (ingest/kvz_shard.h,
 * ingest/kvz_dispatch.h).
 *  - kvz_shard_of against published XXH64 values (seed 0) of "", "a", "abc"
 *  - property: over random ids and shard counts, every id lands in exactly one
 *    shard, the same one whatever the order, and shards are balanced
 *  - shard specs from flags and a fake environment; bad specs are errors
 *  - corpus hash: order-independent, sensitive to any id change
 *  - device specs and CUDA_VISIBLE_DEVICES narrowing
 *  - kvz_dispatch_run with this binary as the worker: every document is taken
 *    by exactly one worker, longest first. */
#include <stdint.h>
#include <unistd.h>

#include "kvz_dispatch.h"
#include "kvz_error.h"
#include "kvz_model.h"
#include "kvz_shard.h"
#include "kvz_test.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static void random_id(char *out, size_t cap)
{
    static const char cs[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./# ";
    size_t n = 1 + next_rand() % (cap - 2 < 60 ? cap - 2 : 60);
    for (size_t i = 0; i < n; i++) out[i] = cs[next_rand() % (sizeof cs - 1)];
    out[n] = 0;
    if (next_rand() % 5 == 0 && n + 3 < cap) memcpy(out + n, "\xc3\xa9", 3); /* some UTF-8 */
}

static void test_known_values(void)
{
    /* XXH64(input, len, seed 0): published reference values */
    const struct { const char *s; uint64_t h; } v[] = {
        {"", 0xEF46DB3751D8E999ull}, {"a", 0xD24EC4F1A98C6E5Bull}, {"abc", 0x44BC2CF5AD770999ull}};
    const uint32_t ns[] = {1, 2, 3, 4, 7, 10, 64, 1000, 1000000};
    for (size_t i = 0; i < 3; i++)
        for (size_t j = 0; j < sizeof ns / sizeof *ns; j++)
            CHECKF(kvz_shard_of(v[i].s, ns[j]) == (uint32_t)(v[i].h % ns[j]), "'%s' mod %u", v[i].s, ns[j]);
}

static void test_partition(void)
{
    enum { NIDS = 20000 };
    char (*ids)[80] = malloc(sizeof(char[80]) * NIDS);
    uint32_t *shard = malloc(sizeof *shard * NIDS);
    if (!ids || !shard) { CHECK(0); free(ids); free(shard); return; }
    for (int i = 0; i < NIDS; i++) random_id(ids[i], sizeof ids[i]);
    int bad_range = 0, bad_repeat = 0, bad_partition = 0, bad_balance = 0;
    for (int trial = 0; trial < 40; trial++) {
        const uint32_t n = trial < 8 ? (uint32_t)(trial + 1) : 1 + (uint32_t)(next_rand() % 300);
        uint64_t *count = calloc(n, sizeof *count);
        for (int i = 0; i < NIDS; i++) {
            shard[i] = kvz_shard_of(ids[i], n);
            if (shard[i] >= n) bad_range++;
            else count[shard[i]]++;
        }
        /* the same id gives the same shard in any order (walk backwards, copies) */
        for (int i = NIDS - 1; i >= 0; i--) {
            char copy[80];
            memcpy(copy, ids[i], sizeof copy);
            if (kvz_shard_of(copy, n) != shard[i]) bad_repeat++;
        }
        /* each shard's filter picks its ids; the filters together pick every id once */
        uint64_t picked = 0;
        for (uint32_t s = 0; s < n && s < 16; s++)
            for (int i = 0; i < NIDS; i++) picked += kvz_shard_of(ids[i], n) == s;
        uint64_t expect_picked = 0;
        for (uint32_t s = 0; s < n && s < 16; s++) expect_picked += count[s];
        if (picked != expect_picked) bad_partition++;
        uint64_t total = 0;
        for (uint32_t s = 0; s < n; s++) total += count[s];
        if (total != NIDS) bad_partition++;
        /* balance where each shard expects >= 1000 ids: within 15% */
        if (NIDS / n >= 1000)
            for (uint32_t s = 0; s < n; s++) {
                const double e = (double)NIDS / n;
                if (count[s] < 0.85 * e || count[s] > 1.15 * e) bad_balance++;
            }
        free(count);
    }
    CHECKF(bad_range == 0, "%d shard numbers out of range", bad_range);
    CHECKF(bad_repeat == 0, "%d ids changed shard on a second look", bad_repeat);
    CHECKF(bad_partition == 0, "%d partitions lost or doubled ids", bad_partition);
    CHECKF(bad_balance == 0, "%d shards off balance by > 15%%", bad_balance);
    CHECK(kvz_shard_of("anything", 1) == 0);
    free(ids);
    free(shard);
}

static void test_parse(void)
{
    kvz_shard s;
    CHECK(kvz_shard_parse("0/1", &s) == 0 && s.index == 0 && s.n == 1);
    CHECK(kvz_shard_parse("3/4", &s) == 0 && s.index == 3 && s.n == 4);
    CHECK(kvz_shard_parse("999999/1000000", &s) == 0 && s.index == 999999);
    const char *bad[] = {"4/4", "x/2", "0/0", "", "1", "/4", "1/", "-1/4", "1/4x", " 1/4", "1/-4",
                         "5/1000001", "1//4", "1/4/5", "0x1/4"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        kvz_error_clear();
        CHECKF(kvz_shard_parse(bad[i], &s) == KVZ_ERR_ARG && kvz_error_detail()[0], "'%s'", bad[i]);
    }
    kvz_shard_parse("4/4", &s);
    CHECK(strstr(kvz_error_detail(), "out of range") != NULL);
}

/* a fake environment for kvz_shard_resolve */
static const char *const *fake_env;
static char *fake_getenv(const char *k)
{
    for (size_t i = 0; fake_env && fake_env[i]; i += 2)
        if (!strcmp(fake_env[i], k)) return (char *)fake_env[i + 1];
    return NULL;
}

static int resolve(const char *spec, long shards, const char *const *env, kvz_shard *out)
{
    fake_env = env;
    return kvz_shard_resolve(spec, shards, fake_getenv, out);
}

static void test_resolve(void)
{
    kvz_shard s;
    const char *none[] = {NULL};
    const char *slurm[] = {"SLURM_ARRAY_TASK_ID", "2", "SLURM_ARRAY_TASK_COUNT", "4", NULL};
    const char *slurm_resub[] = {"SLURM_ARRAY_TASK_ID", "2", "SLURM_ARRAY_TASK_COUNT", "1", NULL};
    const char *slurm_id[] = {"SLURM_ARRAY_TASK_ID", "1", NULL};
    const char *slurm_n[] = {"SLURM_ARRAY_TASK_COUNT", "4", NULL};
    const char *slurm_x[] = {"SLURM_ARRAY_TASK_ID", "x", "SLURM_ARRAY_TASK_COUNT", "4", NULL};
    const char *slurm_4of4[] = {"SLURM_ARRAY_TASK_ID", "4", "SLURM_ARRAY_TASK_COUNT", "4", NULL};
    const char *k8s[] = {"JOB_COMPLETION_INDEX", "5", NULL};
    CHECK(resolve(NULL, 0, none, &s) == 0 && s.n == 0);
    CHECK(resolve("1/3", 0, none, &s) == 0 && s.index == 1 && s.n == 3);
    CHECK(resolve("1/3", 3, slurm, &s) == 0 && s.index == 1 && s.n == 3); /* the flag wins */
    CHECK(resolve("1/3", 4, none, &s) == KVZ_ERR_ARG);                      /* flags disagree */
    CHECK(resolve(NULL, 0, slurm, &s) == 0 && s.index == 2 && s.n == 4);
    CHECK(resolve(NULL, 4, slurm_resub, &s) == 0 && s.index == 2 && s.n == 4);
    CHECK(resolve(NULL, 0, slurm_resub, &s) == KVZ_ERR_ARG);  /* 2 of 1 */
    CHECK(resolve(NULL, 0, slurm_id, &s) == KVZ_ERR_ARG);     /* half-set */
    CHECK(strstr(kvz_error_detail(), "SLURM_ARRAY_TASK_COUNT is not") != NULL);
    CHECK(resolve(NULL, 8, slurm_id, &s) == 0 && s.index == 1 && s.n == 8);
    CHECK(resolve(NULL, 0, slurm_n, &s) == KVZ_ERR_ARG);      /* half-set */
    CHECK(resolve(NULL, 0, slurm_x, &s) == KVZ_ERR_ARG);
    CHECK(resolve(NULL, 0, slurm_4of4, &s) == KVZ_ERR_ARG);
    CHECK(resolve(NULL, 0, k8s, &s) == KVZ_ERR_ARG);          /* needs --shards */
    CHECK(resolve(NULL, 6, k8s, &s) == 0 && s.index == 5 && s.n == 6);
    CHECK(resolve(NULL, 5, k8s, &s) == KVZ_ERR_ARG);          /* 5 of 5 */
    CHECK(resolve(NULL, 4, none, &s) == KVZ_ERR_ARG);         /* --shards without an index */
}

static void test_corpus_hash(void)
{
    const char *a[] = {"x/one.md", "two.txt", "three", "ab", "c"};
    const char *b[] = {"c", "three", "ab", "x/one.md", "two.txt"};
    const char *c[] = {"x/one.md", "two.txt", "three", "ab", "d"};
    const char *d[] = {"x/one.md", "two.txt", "three", "a", "bc"};
    uint64_t ha, hb, hc, hd, h4, h0;
    CHECK(kvz_corpus_hash(a, 5, &ha) == 0);
    CHECK(kvz_corpus_hash(b, 5, &hb) == 0);
    CHECK(kvz_corpus_hash(c, 5, &hc) == 0);
    CHECK(kvz_corpus_hash(d, 5, &hd) == 0);
    CHECK(kvz_corpus_hash(a, 4, &h4) == 0);
    CHECK(kvz_corpus_hash(NULL, 0, &h0) == 0);
    CHECK(ha == hb);
    CHECK(ha != hc && ha != hd && ha != h4 && ha != h0);
}

static void test_device(void)
{
    int32_t dev, ord;
    CHECK(kvz_device_parse("cpu", &dev, &ord) == 0 && dev == KVZ_DEVICE_CPU && ord == -1);
    CHECK(kvz_device_parse("auto", &dev, &ord) == 0 && dev == KVZ_DEVICE_AUTO && ord == -1);
    CHECK(kvz_device_parse("cuda", &dev, &ord) == 0 && dev == KVZ_DEVICE_CUDA && ord == 0);
    CHECK(kvz_device_parse("cuda:3", &dev, &ord) == 0 && dev == KVZ_DEVICE_CUDA && ord == 3);
    const char *bad[] = {"cuda:", "cuda:x", "cuda:1024", "cuda:-1", "gpu", "CUDA", "cuda:1:2", ""};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        CHECKF(kvz_device_parse(bad[i], &dev, &ord) == KVZ_ERR_ARG, "'%s'", bad[i]);
    unsetenv("CUDA_VISIBLE_DEVICES");
    CHECK(kvz_device_select(2) == 0 && !strcmp(getenv("CUDA_VISIBLE_DEVICES"), "2"));
    setenv("CUDA_VISIBLE_DEVICES", "4,5,GPU-abc", 1);
    CHECK(kvz_device_select(1) == 0 && !strcmp(getenv("CUDA_VISIBLE_DEVICES"), "5"));
    setenv("CUDA_VISIBLE_DEVICES", "4,5,GPU-abc", 1);
    CHECK(kvz_device_select(2) == 0 && !strcmp(getenv("CUDA_VISIBLE_DEVICES"), "GPU-abc"));
    setenv("CUDA_VISIBLE_DEVICES", "4,5", 1);
    CHECK(kvz_device_select(2) == KVZ_ERR_NODEV && !strcmp(getenv("CUDA_VISIBLE_DEVICES"), "4,5"));
    unsetenv("CUDA_VISIBLE_DEVICES");
}

/* ---- the hand-out, with this binary as the worker ---- */

enum { NDOCS = 300, NW = 3 };
static int taken[NDOCS], order_bad, took_lines;
static int last_size_seen[NW];

static void on_line(void *u, int w, int is_out, const char *line)
{
    (void)u;
    int idx, size;
    if (is_out && sscanf(line, "took doc%d size %d", &idx, &size) == 2 && idx >= 0 && idx < NDOCS) {
        taken[idx]++;
        took_lines++;
        /* each worker walks the list longest first */
        if (last_size_seen[w] && size > last_size_seen[w]) order_bad++;
        last_size_seen[w] = size;
    } else {
        fprintf(stderr, "worker %d: %s\n", w, line);
    }
}

static int child_main(int argc, char **argv)
{
    int fd = -1, tag = -1;
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--claim-fd")) fd = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--worker-tag")) tag = atoi(argv[i + 1]);
    }
    kvz_claims *c;
    if (kvz_claims_open(fd, tag, &c)) { fprintf(stderr, "open: %s\n", kvz_error_detail()); return 3; }
    for (size_t i = 0; i < kvz_claims_count(c); i++) {
        if (!kvz_claims_take(c, i)) continue;
        const char *path, *id;
        int named;
        kvz_claims_doc(c, i, &path, &id, &named);
        printf("took %s size %s\n", id, path);
        fflush(stdout);
        usleep(200); /* work */
    }
    kvz_claims_close(c);
    return 0;
}

static void test_dispatch(void)
{
    kvz_dispatch_doc docs[NDOCS];
    char ids[NDOCS][16], sizes[NDOCS][16];
    for (int i = 0; i < NDOCS; i++) {
        snprintf(ids[i], sizeof ids[i], "doc%d", i);
        const int size = 1 + (int)(next_rand() % 5000);
        snprintf(sizes[i], sizeof sizes[i], "%d", size); /* the "path" carries the size back */
        docs[i] = (kvz_dispatch_doc){sizes[i], ids[i], 0, (uint64_t)size};
    }
    const char *argv[] = {"test_shard", "--child", NULL};
    const char *dev[NW] = {"cpu", "cpu", "cpu"};
    kvz_dispatch_opts o = {NW, "/proc/self/exe", argv, dev, 1, on_line, NULL};
    kvz_dispatch_worker w[NW];
    int rc = kvz_dispatch_run(docs, NDOCS, &o, w);
    CHECKF(rc == 0, "dispatch: %s", kvz_error_detail());
    int once = 0;
    for (int i = 0; i < NDOCS; i++) once += taken[i] == 1;
    CHECKF(once == NDOCS && took_lines == NDOCS, "%d of %d documents taken exactly once (%d lines)", once,
           NDOCS, took_lines);
    CHECKF(order_bad == 0, "%d documents handed out after a shorter one", order_bad);
    uint64_t sum = 0;
    for (int k = 0; k < NW; k++) {
        CHECKF(w[k].exit_code == 0, "worker %d exit %d signal %d", k, w[k].exit_code, w[k].signal);
        sum += w[k].claimed;
    }
    CHECK(sum == NDOCS);
    for (int i = 1; i < NDOCS; i++) CHECK(docs[i - 1].size >= docs[i].size); /* sorted in place */
    kvz_dispatch_opts bad = o;
    bad.n_workers = 0;
    CHECK(kvz_dispatch_run(docs, NDOCS, &bad, w) == KVZ_ERR_ARG);
    kvz_claims *c;
    CHECK(kvz_claims_open(0, 0, &c) != 0); /* stdin is not a list */
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--child")) return child_main(argc, argv);
    test_known_values();
    test_partition();
    test_parse();
    test_resolve();
    test_corpus_hash();
    test_device();
    test_dispatch();
    return kvz_test_summary();
}
