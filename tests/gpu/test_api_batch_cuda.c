/* Continuous batching (kvzip_batch_*) on the CUDA backend (synthetic smollm2-135m shape,
 * no model file). Four text sessions with different documents and questions (one
 * sampled) answer alone with kvzip_ask, then together in one batch (two joining at a
 * later step). The first token comes from the same question prefill on both routes
 * and must be equal; the later tokens agree while kvz_forward_multi runs one
 * single-token pass per cache, and may part once a batched CUDA pass (other GEMM
 * shapes, other bf16 rounding) replaces it: the count of identical answers is printed. Meanwhile a second thread opens and closes sessions (device
 * work under the model's lock) while the batch steps: its longest wait for the FIFO
 * lock is printed and must stay under 2 s. Exits 77 (skip) without a usable GPU. */
#include "kvz_test.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "kvzip.h"

#define NS 4
#define MAXT 24

static const char *DOCS[NS] = {
    "The Quillmark 7 label printer ships with firmware 4.2. Its service PIN is 7731.",
    "Pump P-7 in bay 3 runs at 1450 rpm. The seal temperature is logged every four days.",
    "The north vault is opened with access code 7319. Visitors wear a blue badge.",
    "The loading dock closes at 18:00 and the night shift starts at 22:00 on weekdays."};
static const char *QS[NS] = {"What is the service PIN?", "How fast does the pump run?",
                             "What is the access code?", "When does the dock close?"};

typedef struct ans {
    int32_t ids[MAXT];
    int32_t n;
    int done, rc;
} ans;

static int on_tok(void *user, const char *piece, size_t len, int32_t token)
{
    (void)piece;
    (void)len;
    ans *a = user;
    if (a->n < MAXT) a->ids[a->n] = token;
    a->n++;
    return 0;
}

static void on_done(void *user, int rc, const kvzip_answer_stats *st)
{
    (void)st;
    ans *a = user;
    a->done++;
    a->rc = rc;
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

typedef struct loader {
    kvzip_model *m;
    atomic_int stop;
    int opens, rc;
    double worst;
} loader;

static void *load_loop(void *arg)
{
    loader *l = arg;
    while (!atomic_load(&l->stop) && !l->rc) {
        kvzip_session *ss;
        const double t0 = now();
        l->rc = kvzip_session_open_text(l->m, DOCS[0], strlen(DOCS[0]), NULL, &ss);
        const double w = now() - t0;
        if (w > l->worst) l->worst = w;
        kvzip_session_close(ss);
        l->opens++;
    }
    return NULL;
}

int main(void)
{
    kvzip_model_opts mo;
    kvzip_model_defaults(&mo);
    mo.device = KVZIP_DEVICE_CUDA;
    mo.synthetic = "smollm2-135m";
    kvzip_model *m;
    int rc = kvzip_model_open(NULL, &mo, &m);
    if (rc == KVZIP_ERR_NODEV) {
        printf("skip: no usable GPU (%s)\n", kvzip_errdetail());
        return 77;
    }
    REQUIRE(rc == 0);
    kvzip_session *ss[NS];
    ans ref[NS], got[NS];
    memset(got, 0, sizeof got);
    for (int i = 0; i < NS; i++) {
        kvzip_session_opts o;
        kvzip_session_defaults(&o);
        o.max_tokens = MAXT;
        o.budget = i == 1 ? 64 : 1024;
        if (i == 2) {
            o.temperature = 0.8f;
            o.seed = 5;
        }
        REQUIRE(kvzip_session_open_text(m, DOCS[i], strlen(DOCS[i]), &o, &ss[i]) == 0);
        memset(&ref[i], 0, sizeof ref[i]);
        REQUIRE(kvzip_ask(ss[i], QS[i], on_tok, &ref[i], NULL, NULL) == 0);
    }
    kvzip_batch *b;
    REQUIRE(kvzip_batch_open(m, NULL, &b) == 0);
    loader l = {.m = m};
    pthread_t th;
    REQUIRE(pthread_create(&th, NULL, load_loop, &l) == 0);
    CHECK(kvzip_batch_submit(b, ss[0], QS[0], on_tok, on_done, &got[0]) == 0);
    CHECK(kvzip_batch_submit(b, ss[1], QS[1], on_tok, on_done, &got[1]) == 0);
    int steps = 0, maxsize = 0;
    double t0 = now();
    for (;;) {
        const int r = kvzip_batch_step(b);
        REQUIRE(r >= 0 && steps < 500);
        steps++;
        kvzip_batch_info bi;
        kvzip_batch_info_get(b, &bi);
        if (bi.last_step_size > maxsize) maxsize = bi.last_step_size;
        if (steps == 3) {
            CHECK(kvzip_batch_submit(b, ss[2], QS[2], on_tok, on_done, &got[2]) == 0);
            CHECK(kvzip_batch_submit(b, ss[3], QS[3], on_tok, on_done, &got[3]) == 0);
        } else if (r == 0 && steps > 3) {
            break;
        }
    }
    const double batch_s = now() - t0;
    atomic_store(&l.stop, 1);
    pthread_join(th, NULL);
    CHECKF(l.rc == 0, "loader thread: %s", kvzip_strerror(l.rc));
    printf("batch: %d steps in %.3f s, largest decode step %d; loader: %d sessions opened meanwhile, "
           "longest open %.1f ms\n", steps, batch_s, maxsize, l.opens, 1e3 * l.worst);
    CHECK(maxsize >= 3);
    CHECKF(l.worst < 2.0, "a session open waited %.3f s for the device", l.worst);
    int identical = 0;
    for (int i = 0; i < NS; i++) {
        CHECKF(got[i].done == 1 && got[i].rc == 0, "answer %d: done %d rc %d", i, got[i].done, got[i].rc);
        int same = got[i].n == ref[i].n;
        for (int k = 0; k < got[i].n && k < ref[i].n && k < MAXT; k++)
            if (got[i].ids[k] != ref[i].ids[k]) {
                same = 0;
                CHECKF(k >= 1, "answer %d differs from kvzip_ask's at token %d", i, k);
                break;
            }
        identical += same;
    }
    printf("answers identical to kvzip_ask's: %d of %d\n", identical, NS);
    CHECK(kvzip_batch_close(b) == 0);
    for (int i = 0; i < NS; i++) {
        ans again = {0};
        CHECK(kvzip_ask(ss[i], QS[i], on_tok, &again, NULL, NULL) == 0 && again.n == ref[i].n &&
              !memcmp(again.ids, ref[i].ids, sizeof(int32_t) * (size_t)(again.n < MAXT ? again.n : MAXT)));
        CHECK(kvzip_session_close(ss[i]) == 0);
    }
    kvzip_model_close(m);
    return kvz_test_summary();
}
