/* Two threads, each with its own session on ONE shared real SmolLM2 model (CPU),
 * answer at the same time; each answer must equal the answer the same session
 * gives when it runs alone. The document is ingested through the public API at
 * r = 0.3 into a temporary store; the second answer is also checked for the fact
 * the sample states (the supervisor's name). */
#include "kvz_test.h"

#include <pthread.h>
#include <unistd.h>

#include "kvzip.h"

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
    j->rc = kvzip_session_open(j->m, j->s, "lab.md", &o, &ss);
    if (!j->rc) j->rc = kvzip_ask(ss, j->q, NULL, NULL, &j->answer, NULL);
    kvzip_session_close(ss);
    return NULL;
}

int main(void)
{
    char dir[] = "/tmp/kvz_test_api_threads_XXXXXX", path[1024];
    REQUIRE(mkdtemp(dir) != NULL);
    size_t len;
    char *doc = kvz_test_read_file(kvz_test_path(path, sizeof path, "samples/lab_b214_safety_sop.md"), &len);
    REQUIRE(doc != NULL);
    kvzip_model_opts mo;
    kvzip_model_defaults(&mo);
    mo.device = KVZIP_DEVICE_CPU;
    kvzip_model *m;
    kvzip_store *s;
    REQUIRE(kvzip_model_open(kvz_test_model(), &mo, &m) == 0);
    REQUIRE(kvzip_store_open(dir, KVZIP_STORE_CREATE, m, &s) == 0);
    kvzip_ingest_result r;
    REQUIRE(kvzip_ingest(m, s, "lab.md", doc, len, NULL, &r) == 0);
    CHECK(r.parts == 1 && r.written == 1);

    const char *q1 = "What is the emergency extension?", *q2 = "Who is the lab manager?";
    job a1 = {m, s, q1, NULL, 0}, a2 = {m, s, q2, NULL, 0};   /* alone, one after the other */
    run(&a1);
    run(&a2);
    REQUIRE(a1.rc == 0 && a2.rc == 0);
    printf("alone: '%s' | '%s'\n", a1.answer, a2.answer);
    job t1 = {m, s, q1, NULL, 0}, t2 = {m, s, q2, NULL, 0};   /* together */
    pthread_t h1, h2;
    REQUIRE(pthread_create(&h1, NULL, run, &t1) == 0 && pthread_create(&h2, NULL, run, &t2) == 0);
    pthread_join(h1, NULL);
    pthread_join(h2, NULL);
    CHECK(t1.rc == 0 && t2.rc == 0);
    printf("together: '%s' | '%s'\n", t1.answer ? t1.answer : "", t2.answer ? t2.answer : "");
    CHECK(t1.answer && !strcmp(t1.answer, a1.answer));
    CHECK(t2.answer && !strcmp(t2.answer, a2.answer));
    CHECK(strstr(a2.answer, "Marwood") != NULL);
    free(a1.answer); free(a2.answer); free(t1.answer); free(t2.answer);
    kvzip_store_close(s);
    kvzip_model_close(m);
    free(doc);
    snprintf(path, sizeof path, "rm -rf %s", dir);
    CHECK(system(path) == 0);
    return kvz_test_summary();
}
