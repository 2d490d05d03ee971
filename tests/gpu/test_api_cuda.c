/* The public API on the CUDA backend (synthetic smollm2-135m shape, no model file):
 * ingest through kvzip_ingest, then two threads, each with its own session on ONE
 * shared CUDA model, answer at the same time; each answer equals the answer the same
 * question gets alone (the library serialises device work per model: kvzip.h
 * THREADING). Exits 77 (skip) without a usable GPU. */
#include "kvz_test.h"

#include <pthread.h>
#include <unistd.h>

#include "kvzip.h"

static const char *DOC =
    "The Quillmark 7 label printer ships with firmware 4.2. Its service PIN is 7731 and the "
    "maintenance interval is 90 days. Support: call extension 4410 between 8 and 16 o'clock.";

typedef struct job {
    kvzip_model *m;
    kvzip_store *s;
    const char *q;
    char *answer;
    int rc;
} job;

static void *run(void *arg)
{
    job *j = arg;
    kvzip_session_opts o;
    kvzip_session_defaults(&o);
    o.max_tokens = 32;
    kvzip_session *ss;
    j->rc = kvzip_session_open(j->m, j->s, "quill.txt", &o, &ss);
    for (int k = 0; k < 4 && !j->rc; k++) {
        char *a = NULL;
        j->rc = kvzip_ask(ss, j->q, NULL, NULL, &a, NULL);
        if (!j->rc && j->answer && strcmp(a, j->answer)) j->rc = -1000;
        free(j->answer);
        j->answer = a;
    }
    kvzip_session_close(ss);
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
    kvzip_model_info mi;
    REQUIRE(kvzip_model_info_get(m, &mi) == 0 && mi.device == KVZIP_DEVICE_CUDA);
    char dir[] = "/tmp/kvz_test_api_cuda_XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL);
    kvzip_store *s;
    REQUIRE(kvzip_store_open(dir, KVZIP_STORE_CREATE, m, &s) == 0);
    kvzip_ingest_opts io;
    kvzip_ingest_defaults(&io);
    io.ratio = 0.5f;
    kvzip_ingest_result r;
    REQUIRE(kvzip_ingest(m, s, "quill.txt", DOC, strlen(DOC), &io, &r) == 0);
    CHECK(r.parts == 1 && r.written == 1);
    { /* the server's warm-up: staging sized for the longest document (here the only one);
       * the loads below then run on it */
        char wid[64] = "";
        double ws = -1;
        CHECK(kvzip_model_prepare(m, s, wid, sizeof wid, &ws) == 0);
        CHECKF(!strcmp(wid, "quill.txt") && ws >= 0, "prepared for '%s' in %f s", wid, ws);
    }

    job a1 = {m, s, "What is the service PIN?", NULL, 0}, a2 = {m, s, "Which extension is support?", NULL, 0};
    run(&a1);
    run(&a2);
    REQUIRE(a1.rc == 0 && a2.rc == 0);
    job t1 = {m, s, a1.q, NULL, 0}, t2 = {m, s, a2.q, NULL, 0};
    pthread_t h1, h2;
    REQUIRE(pthread_create(&h1, NULL, run, &t1) == 0 && pthread_create(&h2, NULL, run, &t2) == 0);
    pthread_join(h1, NULL);
    pthread_join(h2, NULL);
    CHECKF(t1.rc == 0 && t2.rc == 0, "rc %d %d", t1.rc, t2.rc);
    CHECK(t1.answer && !strcmp(t1.answer, a1.answer));
    CHECK(t2.answer && !strcmp(t2.answer, a2.answer));
    free(a1.answer); free(a2.answer); free(t1.answer); free(t2.answer);
    CHECK(kvzip_store_close(s) == 0);
    CHECK(kvzip_model_close(m) == 0);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    return kvz_test_summary();
}
