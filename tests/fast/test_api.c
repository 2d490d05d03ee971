/* The public API (include/kvzip.h) on synthetic tiny models and a real LMDB store:
 *  - every documented bad input returns its code, never a crash (NULL handles, bad
 *    options, read-only store, empty / non-UTF-8 text, unknown id, too-long question);
 *  - a stored cache at ratio 1.0 in f32 answers exactly as the same text prefilled
 *    (independent path: kvzip_session_open_text), and re-ingest is a no-op;
 *  - a model whose fingerprint differs from the store's: KVZIP_ERR_MODEL at store open,
 *    session open and ingest;
 *  - lifetimes: closing the store or the model while a session is open keeps the
 *    session answering, the closed handle gives KVZIP_ERR_CLOSED, the session's close
 *    frees it (ASan build: no leak, no use after free);
 *  - the token callback streams the answer and can cancel it;
 *  - two threads with their own sessions on one shared model answer as one thread does. */
#include "kvz_test.h"

#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

#include "kvzip.h"

static const char *DOC =
    "The Quillmark 7 label printer ships with firmware 4.2. Its service PIN is 7731 and the "
    "maintenance interval is 90 days. Support: call extension 4410 between 8 and 16 o'clock.";

typedef struct collect {
    char buf[4096];
    size_t len;
    int stop_after;  /* cancel after this many pieces (0 = never) */
    int pieces;
} collect;

static int on_piece(void *user, const char *piece, size_t len, int32_t token)
{
    collect *c = user;
    (void)token;
    if (c->len + len < sizeof c->buf) {
        memcpy(c->buf + c->len, piece, len);
        c->len += len;
    }
    return c->stop_after && ++c->pieces >= c->stop_after;
}

typedef struct job {
    kvzip_model *m;
    kvzip_store *s;
    const char *q;
    char *answer;
    int rc;
} job;

static void *run_job(void *arg)
{
    job *j = arg;
    kvzip_session *ss;
    kvzip_session_opts o;
    kvzip_session_defaults(&o);
    o.max_tokens = 24;
    j->rc = kvzip_session_open(j->m, j->s, "quill.txt", &o, &ss);
    for (int k = 0; k < 3 && !j->rc; k++) {   /* several rounds so the threads overlap */
        char *a = NULL;
        j->rc = kvzip_ask(ss, j->q, NULL, NULL, &a, NULL);
        if (!j->rc && j->answer && strcmp(a, j->answer)) j->rc = -1000;  /* unstable answer */
        free(j->answer);
        j->answer = a;
    }
    kvzip_session_close(ss);
    return NULL;
}

int main(void)
{
    char dir[] = "/tmp/kvz_test_api_XXXXXX", ro[64];
    REQUIRE(mkdtemp(dir) != NULL);
    snprintf(ro, sizeof ro, "%s/none", dir);
    kvzip_model *m = NULL, *other = NULL;
    kvzip_store *s = NULL;
    kvzip_session *ss = NULL;
    char *ans = NULL;
    int32_t n;

    /* ---- NULL handles and arguments ---- */
    CHECK(kvzip_model_open(NULL, NULL, NULL) == KVZIP_ERR_ARG);
    CHECK(kvzip_model_open(NULL, NULL, &m) == KVZIP_ERR_ARG && m == NULL);
    CHECK(kvzip_errdetail()[0] != 0);
    CHECK(kvzip_store_open(NULL, 0, NULL, &s) == KVZIP_ERR_ARG);
    CHECK(kvzip_store_open(dir, KVZIP_STORE_READONLY | KVZIP_STORE_CREATE, NULL, &s) == KVZIP_ERR_ARG);
    CHECK(kvzip_store_has_doc(NULL, "x") == KVZIP_ERR_ARG);
    CHECK(kvzip_ingest(NULL, NULL, "x", "y", 1, NULL, NULL) == KVZIP_ERR_ARG);
    CHECK(kvzip_session_open(NULL, NULL, "x", NULL, &ss) == KVZIP_ERR_ARG && ss == NULL);
    CHECK(kvzip_session_open_text(NULL, "x", 1, NULL, &ss) == KVZIP_ERR_ARG);
    CHECK(kvzip_ask(NULL, "q", NULL, NULL, &ans, NULL) == KVZIP_ERR_ARG && ans == NULL);
    CHECK(kvzip_model_info_get(NULL, NULL) == KVZIP_ERR_ARG);
    CHECK(kvzip_session_info_get(NULL, NULL) == KVZIP_ERR_ARG);
    CHECK(kvzip_question_tokens(NULL, "q", &n) == KVZIP_ERR_ARG);
    CHECK(kvzip_model_close(NULL) == 0 && kvzip_store_close(NULL) == 0 && kvzip_session_close(NULL) == 0);
    for (int e = 0; e >= -45; e--) CHECK(kvzip_strerror(e) != NULL);
    CHECK(strstr(kvzip_strerror(KVZIP_ERR_CLOSED), "closed") != NULL);

    /* ---- model ---- */
    kvzip_model_opts mo;
    kvzip_model_defaults(&mo);
    mo.device = KVZIP_DEVICE_CPU;
    mo.n_threads = 2;
    CHECK(kvzip_model_open("/nonexistent/model.gguf", &mo, &m) == KVZIP_ERR_NOTFOUND);
    mo.synthetic = "no-such-shape";
    CHECK(kvzip_model_open(NULL, &mo, &m) == KVZIP_ERR_NOTFOUND);
    mo.synthetic = "tiny-llama";
    mo.device = 7;
    CHECK(kvzip_model_open(NULL, &mo, &m) == KVZIP_ERR_ARG);
    mo.device = KVZIP_DEVICE_CPU;
    REQUIRE(kvzip_model_open(NULL, &mo, &m) == 0);
    mo.seed = 7;   /* same shape, other weights: another fingerprint */
    REQUIRE(kvzip_model_open(NULL, &mo, &other) == 0);
    kvzip_model_info mi, oi;
    REQUIRE(kvzip_model_info_get(m, &mi) == 0 && kvzip_model_info_get(other, &oi) == 0);
    CHECK(mi.n_layer == 2 && mi.device == KVZIP_DEVICE_CPU && !strcmp(mi.arch, "llama"));
    CHECK(memcmp(mi.fingerprint, oi.fingerprint, 16) != 0);
    CHECK(kvzip_question_tokens(m, "abc", &n) == 0 && n > 3);

    /* ---- store and ingest ---- */
    CHECK(kvzip_store_open(ro, KVZIP_STORE_READONLY, m, &s) == KVZIP_ERR_NOTFOUND && s == NULL);
    REQUIRE(kvzip_store_open(dir, KVZIP_STORE_CREATE, m, &s) == 0);
    kvzip_ingest_opts io;
    kvzip_ingest_defaults(&io);
    CHECK(io.ratio > 0.29f && io.ratio < 0.31f);
    io.ratio = 1.0f;
    io.kv_dtype = KVZIP_KV_F32;
    kvzip_ingest_result r;
    CHECK(kvzip_ingest(m, s, "", DOC, strlen(DOC), &io, &r) == KVZIP_ERR_ARG);
    CHECK(kvzip_ingest(m, s, "e", " \n\t", 3, &io, &r) == KVZIP_ERR_EMPTY);
    CHECK(kvzip_ingest(m, s, "e", "ab\xff", 3, &io, &r) == KVZIP_ERR_ENCODING);
    CHECK(kvzip_ingest(m, s, "e", "ab\0c", 4, &io, &r) == KVZIP_ERR_ENCODING);
    io.ratio = 0.0f;
    CHECK(kvzip_ingest(m, s, "e", DOC, strlen(DOC), &io, &r) == KVZIP_ERR_ARG);
    io.ratio = 1.0f;
    REQUIRE(kvzip_ingest(m, s, "quill.txt", DOC, strlen(DOC), &io, &r) == 0);
    CHECK(r.parts == 1 && r.written == 1 && r.tokens == (int64_t)strlen(DOC));  /* byte tokenizer */
    CHECK(r.pairs_kept == r.pairs_total && r.bytes_stored > 0);
    REQUIRE(kvzip_ingest(m, s, "quill.txt", DOC, strlen(DOC), &io, &r) == 0);
    CHECK(r.parts == 1 && r.unchanged == 1 && r.written == 0);
    io.part_tokens = 64;   /* 179 tokens -> 3 parts */
    io.ratio = 0.5f;
    REQUIRE(kvzip_ingest(m, s, "parts.txt", DOC, strlen(DOC), &io, &r) == 0);
    CHECK(r.parts == 3 && r.written == 3);
    CHECK(kvzip_store_has_doc(s, "parts.txt#3") == 1 && kvzip_store_has_doc(s, "parts.txt") == 0);
    CHECK(kvzip_store_has_doc(s, "parts.txt#4") == 0);
    { /* the warm-up: nothing to size on the CPU (no staging), bad handles refused */
        char wid[64] = "x";
        double ws = -1;
        CHECK(kvzip_model_prepare(NULL, s, wid, sizeof wid, &ws) == KVZIP_ERR_ARG);
        CHECK(kvzip_model_prepare(m, NULL, wid, sizeof wid, &ws) == KVZIP_ERR_ARG);
        CHECK(kvzip_model_prepare(m, s, wid, sizeof wid, &ws) == 0 && wid[0] == 0 && ws == 0);
    }

    /* ---- sessions: stored cache (r = 1, f32) == the same text prefilled ---- */
    kvzip_session_opts so;
    kvzip_session_defaults(&so);
    so.max_tokens = 24;
    CHECK(kvzip_session_open(m, s, "nope.txt", &so, &ss) == KVZIP_ERR_NOTFOUND && ss == NULL);
    so.budget = 5;
    CHECK(kvzip_session_open(m, s, "quill.txt", &so, &ss) == KVZIP_ERR_ARG);
    so.budget = 1024;
    so.max_tokens = 0;
    CHECK(kvzip_session_open(m, s, "quill.txt", &so, &ss) == KVZIP_ERR_ARG);
    so.max_tokens = 24;
    kvzip_session *st;
    REQUIRE(kvzip_session_open_text(m, DOC, strlen(DOC), &so, &st) == 0);
    REQUIRE(kvzip_session_open(m, s, "quill.txt", &so, &ss) == 0);
    kvzip_session_info si, ti;
    REQUIRE(kvzip_session_info_get(ss, &si) == 0 && kvzip_session_info_get(st, &ti) == 0);
    CHECK(si.from_store == 1 && ti.from_store == 0 && si.doc_tokens == ti.doc_tokens);
    CHECK(si.rows_kept == si.rows_full && si.rows_full == (uint64_t)si.doc_tokens * 2 * 2);
    const char *Q = "What is the service PIN?";
    char *a_text = NULL, *a_store = NULL;
    kvzip_answer_stats as;
    collect c = {0};
    REQUIRE(kvzip_ask(st, Q, on_piece, &c, &a_text, &as) == 0);
    CHECK(as.answer_tokens > 0 && as.prompt_tokens > (int32_t)strlen(Q));
    CHECK(c.len == strlen(a_text) && !memcmp(c.buf, a_text, c.len));  /* stream == answer */
    CHECK(as.out_slots == 1024 && as.out_used == as.prompt_tokens + as.answer_tokens - 1 + (as.stopped ? 1 : 0));
    REQUIRE(kvzip_ask(ss, Q, NULL, NULL, &a_store, &as) == 0);
    CHECKF(!strcmp(a_text, a_store), "text '%s' vs store '%s'", a_text, a_store);
    CHECK(kvzip_ask(ss, "", NULL, NULL, &ans, NULL) == KVZIP_ERR_EMPTY);
    /* cancel from the callback: partial answer, the session stays usable */
    collect cc = {.stop_after = 2};
    CHECK(kvzip_ask(ss, Q, on_piece, &cc, &ans, NULL) == KVZIP_ERR_CANCELED);
    CHECK(ans && cc.pieces == 2 && strlen(ans) == cc.len);
    kvzip_free(ans);
    kvzip_session_close(st);

    /* ---- no document (plain chat): the chat prefix alone ---- */
    kvzip_session *sc;
    CHECK(kvzip_session_open_chat(NULL, &so, &sc) == KVZIP_ERR_ARG);
    CHECK(kvzip_session_open_chat(m, &so, NULL) == KVZIP_ERR_ARG);
    REQUIRE(kvzip_session_open_chat(m, &so, &sc) == 0);
    kvzip_session_info ci;
    REQUIRE(kvzip_session_info_get(sc, &ci) == 0);
    CHECK(ci.from_store == 0 && ci.prefix_tokens > 0 && ci.prefix_tokens == ti.prefix_tokens);
    CHECK(ci.doc_tokens == ci.prefix_tokens && ci.rows_full == (uint64_t)ci.prefix_tokens * 2 * 2);
    char *a_chat = NULL;
    REQUIRE(kvzip_ask(sc, Q, NULL, NULL, &a_chat, &as) == 0);
    CHECK(as.answer_tokens > 0 && a_chat != NULL);
    kvzip_free(a_chat);
    kvzip_session_close(sc);

    /* a question longer than the output buffer allows */
    kvzip_session *small;
    so.budget = 16;
    REQUIRE(kvzip_session_open(m, s, "quill.txt", &so, &small) == 0);
    CHECK(kvzip_ask(small, "a question much longer than eight slots", NULL, NULL, &ans, NULL) == KVZIP_ERR_CONTEXT);
    kvzip_session_close(small);
    so.budget = 1024;

    /* ---- another model: fingerprint mismatch ---- */
    kvzip_store *s2;
    CHECK(kvzip_store_open(dir, KVZIP_STORE_READONLY, other, &s2) == KVZIP_ERR_MODEL);
    REQUIRE(kvzip_store_open(dir, 0, NULL, &s2) == 0);   /* no check at open */
    CHECK(kvzip_session_open(other, s2, "quill.txt", &so, &st) == KVZIP_ERR_MODEL);
    CHECK(kvzip_ingest(other, s2, "x.txt", DOC, strlen(DOC), NULL, &r) == KVZIP_ERR_MODEL);
    CHECK(kvzip_store_has_doc(s2, "x.txt") == 0);
    kvzip_store_close(s2);
    REQUIRE(kvzip_store_open(dir, KVZIP_STORE_READONLY, NULL, &s2) == 0);
    CHECK(kvzip_ingest(m, s2, "y.txt", DOC, strlen(DOC), NULL, &r) == KVZIP_ERR_ARG);  /* read-only */
    kvzip_store_close(s2);

    /* ---- two threads, one shared model, a session each ---- */
    job j1 = {.m = m, .s = s, .q = Q}, j2 = {.m = m, .s = s, .q = "Which extension is support?"};
    job solo = {.m = m, .s = s, .q = "Which extension is support?"};
    run_job(&solo);
    pthread_t t1, t2;
    REQUIRE(pthread_create(&t1, NULL, run_job, &j1) == 0 && pthread_create(&t2, NULL, run_job, &j2) == 0);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    CHECK(solo.rc == 0 && j1.rc == 0 && j2.rc == 0);
    CHECKF(j1.answer && !strcmp(j1.answer, a_store), "thread 1 '%s'", j1.answer ? j1.answer : "");
    CHECKF(j2.answer && solo.answer && !strcmp(j2.answer, solo.answer), "thread 2 '%s' vs '%s'",
           j2.answer ? j2.answer : "", solo.answer ? solo.answer : "");
    free(j1.answer); free(j2.answer); free(solo.answer);

    /* ---- the model's document cache: a second session reuses the load, two open
     *      sessions on one document have their own caches, a re-ingested id is reloaded ---- */
    {
        static const char DOC2[] = "A shorter note. The gate code is 4417.";
        REQUIRE(kvzip_ingest(m, s, "fresh.txt", DOC, strlen(DOC), NULL, &r) == 0);
        kvzip_session *c1, *c2;
        char *a1 = NULL, *a2 = NULL, *a3 = NULL;
        REQUIRE(kvzip_session_open(m, s, "fresh.txt", &so, &c1) == 0);
        REQUIRE(kvzip_ask(c1, Q, NULL, NULL, &a1, NULL) == 0);
        kvzip_session_close(c1);
        REQUIRE(kvzip_session_open(m, s, "fresh.txt", &so, &c1) == 0);   /* from the cache */
        REQUIRE(kvzip_session_open(m, s, "fresh.txt", &so, &c2) == 0);   /* its own copy */
        REQUIRE(kvzip_ask(c1, Q, NULL, NULL, &a2, NULL) == 0);
        REQUIRE(kvzip_ask(c2, Q, NULL, NULL, &a3, NULL) == 0);
        CHECKF(!strcmp(a1, a2) && !strcmp(a1, a3), "reused '%s' / copy '%s' vs first '%s'", a2, a3, a1);
        kvzip_session_close(c1);
        kvzip_session_close(c2);
        kvzip_free(a1); kvzip_free(a2); kvzip_free(a3);
        kvzip_session_info i1, i2;
        REQUIRE(kvzip_session_open(m, s, "fresh.txt", &so, &c1) == 0);
        REQUIRE(kvzip_session_info_get(c1, &i1) == 0);
        kvzip_session_close(c1);
        REQUIRE(kvzip_ingest(m, s, "fresh.txt", DOC2, strlen(DOC2), NULL, &r) == 0);
        REQUIRE(kvzip_session_open(m, s, "fresh.txt", &so, &c1) == 0);   /* new content: loaded */
        REQUIRE(kvzip_session_info_get(c1, &i2) == 0);
        CHECKF(i1.doc_tokens - i2.doc_tokens == (int32_t)(strlen(DOC) - strlen(DOC2)),
               "doc tokens %d then %d after re-ingest", i1.doc_tokens, i2.doc_tokens);
        kvzip_session_close(c1);
    }

    /* ---- lifetimes: store and model closed while a session is open ---- */
    CHECK(kvzip_store_close(s) == 0);
    CHECK(kvzip_store_has_doc(s, "quill.txt") == KVZIP_ERR_CLOSED);   /* kept alive by ss */
    CHECK(kvzip_session_open(m, s, "quill.txt", &so, &st) == KVZIP_ERR_CLOSED);
    CHECK(kvzip_ingest(m, s, "z.txt", DOC, strlen(DOC), NULL, &r) == KVZIP_ERR_CLOSED);
    CHECK(kvzip_store_close(s) == KVZIP_ERR_CLOSED);
    CHECK(kvzip_model_close(m) == 0);
    CHECK(kvzip_model_info_get(m, &mi) == KVZIP_ERR_CLOSED);
    CHECK(kvzip_session_open_text(m, DOC, strlen(DOC), &so, &st) == KVZIP_ERR_CLOSED);
    CHECK(kvzip_session_open_chat(m, &so, &st) == KVZIP_ERR_CLOSED);
    CHECK(kvzip_store_open(dir, KVZIP_STORE_READONLY, m, &s2) == KVZIP_ERR_CLOSED);
    REQUIRE(kvzip_ask(ss, Q, NULL, NULL, &ans, NULL) == 0);   /* the session still answers */
    CHECK(!strcmp(ans, a_store));
    kvzip_free(ans);
    CHECK(kvzip_session_close(ss) == 0);   /* frees the store and the model */
    kvzip_free(a_text);
    kvzip_free(a_store);
    kvzip_model_close(other);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    return kvz_test_summary();
}
