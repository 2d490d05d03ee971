/* Continuous batching through the public API (kvzip_batch_*) on the real SmolLM2, CPU.
 * Three sample documents are ingested at r = 0.3 into a temporary store; four sessions
 * (two on one document) with different questions and options (one sampled with
 * temperature/top_p/seed) first answer alone with kvzip_ask: that is the truth. Then:
 *  1. all four answer in one batch: two submitted at once, the others joining at later
 *     steps, one canceled by its token callback after 3 tokens. Every answer must be
 *     kvzip_ask's token for token (the canceled one its first 3 tokens), with the same
 *     answer_tokens / stopped / prompt_tokens; admission obeys max_admit; the steps
 *     really batch (a decode step of more than one answer happened). The greedy answers
 *     take their token from the step's argmax ids (kvz_forward_multi_top), only the
 *     sampled one gets its logits row: rows_logits counts exactly its decode steps, below
 *     the answer-steps run, and every step is counted as one pass per answer (CPU).
 *  2. afterwards each session answers with kvzip_ask exactly as before (rolled back).
 *  3. bad input: NULL arguments, an empty question, a question over the output cache,
 *     a full batch, a session submitted twice, kvzip_ask / kvzip_session_close on a
 *     session that is in a batch, a session of another model; kvzip_batch_close ends a
 *     waiting answer with KVZIP_ERR_CLOSED and its session answers again afterwards. */
#include "kvz_test.h"

#include <unistd.h>

#include "kvzip.h"

#define NS 4
#define MAXT 16

typedef struct ans {
    int32_t ids[MAXT + 1];
    int32_t n;
    int cancel_after;          /* > 0: the callback stops after this many tokens */
    int done, rc;
    kvzip_answer_stats st;
} ans;

static int on_tok(void *user, const char *piece, size_t len, int32_t token)
{
    (void)piece;
    (void)len;
    ans *a = user;
    if (a->n <= MAXT) a->ids[a->n] = token;
    a->n++;
    return a->cancel_after > 0 && a->n >= a->cancel_after;
}

static void on_done(void *user, int rc, const kvzip_answer_stats *st)
{
    ans *a = user;
    a->done++;
    a->rc = rc;
    a->st = *st;
}

static int same(const ans *a, const ans *ref, int32_t n)
{
    if (a->n != n) return 0;
    for (int32_t i = 0; i < n && i <= MAXT; i++)
        if (a->ids[i] != ref->ids[i]) return 0;
    return 1;
}

static int ask(kvzip_session *ss, const char *q, ans *a)
{
    memset(a, 0, sizeof *a);
    return kvzip_ask(ss, q, on_tok, a, NULL, &a->st);
}

static int ingest_file(kvzip_model *m, kvzip_store *s, const char *rel, const char *id)
{
    char path[1024];
    size_t len;
    char *doc = kvz_test_read_file(kvz_test_path(path, sizeof path, rel), &len);
    if (!doc) return -1;
    int rc = kvzip_ingest(m, s, id, doc, len, NULL, NULL);
    free(doc);
    return rc;
}

int main(void)
{
    if (access(kvz_test_model(), R_OK)) {
        printf("SKIP: model %s missing\n", kvz_test_model());
        return 77;
    }
    char dir[] = "/tmp/kvz_test_api_batch_XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL);
    kvzip_model_opts mo;
    kvzip_model_defaults(&mo);
    mo.device = KVZIP_DEVICE_CPU;
    kvzip_model *m;
    kvzip_store *s;
    REQUIRE(kvzip_model_open(kvz_test_model(), &mo, &m) == 0);
    REQUIRE(kvzip_store_open(dir, KVZIP_STORE_CREATE, m, &s) == 0);
    REQUIRE(ingest_file(m, s, "samples/lab_b214_safety_sop.md", "lab") == 0);
    REQUIRE(ingest_file(m, s, "samples/halcyon_warranty_returns.md", "warranty") == 0);
    REQUIRE(ingest_file(m, s, "samples/orrery_onboarding_guide.md", "orrery") == 0);

    const char *docs[NS] = {"lab", "warranty", "orrery", "lab"};
    const char *qs[NS] = {"What is the emergency extension?", "How long is the warranty period?",
                          "Who should a new hire contact first?", "Who is the lab manager?"};
    kvzip_session *ss[NS];
    for (int i = 0; i < NS; i++) {
        kvzip_session_opts o;
        kvzip_session_defaults(&o);
        o.max_tokens = MAXT;
        o.budget = i == 1 ? 64 : 1024; /* one small output cache: evictions inside the batch */
        if (i == 2) { /* sampled: the batch must use the session's own sampler and seed */
            o.temperature = 0.8f;
            o.top_p = 0.9f;
            o.seed = 7;
        }
        REQUIRE(kvzip_session_open(m, s, docs[i], &o, &ss[i]) == 0);
    }
    ans ref[NS];
    for (int i = 0; i < NS; i++) {
        REQUIRE(ask(ss[i], qs[i], &ref[i]) == 0);
        printf("alone %d: %d tokens, stopped %d\n", i, ref[i].n, ref[i].st.stopped);
        CHECK(ref[i].n >= 3);
    }

    /* ---- 1. one batch: joins, a cancel, admission bounds ---- */
    kvzip_batch_opts bo;
    kvzip_batch_defaults(&bo);
    bo.max_seqs = NS;
    bo.max_admit = 1;
    kvzip_batch *b;
    REQUIRE(kvzip_batch_open(m, &bo, &b) == 0);
    CHECK(kvzip_batch_wait(b, 0.05) == 0);    /* idle: times out */
    CHECK(kvzip_batch_step(b) == 0);          /* nothing to do */
    ans got[NS];
    memset(got, 0, sizeof got);
    got[3].cancel_after = 3;
    CHECK(kvzip_batch_submit(b, ss[0], qs[0], on_tok, on_done, &got[0]) == 0);
    CHECK(kvzip_batch_submit(b, ss[1], qs[1], on_tok, on_done, &got[1]) == 0);
    CHECK(kvzip_batch_wait(b, 1.0) == 2);
    CHECK(kvzip_batch_submit(b, ss[0], qs[0], on_tok, on_done, &got[0]) == KVZIP_ERR_BUSY); /* twice */
    CHECK(kvzip_ask(ss[0], qs[0], NULL, NULL, NULL, NULL) == KVZIP_ERR_BUSY);
    CHECK(kvzip_session_close(ss[0]) == KVZIP_ERR_BUSY);
    int r = kvzip_batch_step(b);
    kvzip_batch_info bi;
    CHECK(kvzip_batch_info_get(b, &bi) == 0);
    CHECKF(r == 2 && bi.running == 1 && bi.waiting == 1 && bi.last_admitted == 1,
           "step 1: %d live, %d running, %d waiting, %d admitted (max_admit 1)", r, bi.running, bi.waiting,
           bi.last_admitted);
    int steps = 1, maxsize = bi.last_step_size, joined = 0;
    long long answer_steps = bi.last_step_size;
    while ((r = kvzip_batch_step(b)) > 0 || !joined) {
        REQUIRE(r >= 0 && steps < 200);
        steps++;
        kvzip_batch_info_get(b, &bi);
        if (bi.last_step_size > maxsize) maxsize = bi.last_step_size;
        answer_steps += bi.last_step_size;
        if (steps == 3) { /* two more join while the first ones run */
            CHECK(kvzip_batch_submit(b, ss[2], qs[2], on_tok, on_done, &got[2]) == 0);
            CHECK(kvzip_batch_submit(b, ss[3], qs[3], on_tok, on_done, &got[3]) == 0);
            /* full: 4 answers are live */
            kvzip_session *extra;
            REQUIRE(kvzip_session_open(m, s, "orrery", NULL, &extra) == 0);
            CHECK(kvzip_batch_submit(b, extra, qs[2], on_tok, on_done, &got[2]) == KVZIP_ERR_BUSY);
            CHECK(kvzip_session_close(extra) == 0);
            joined = 1;
        }
    }
    kvzip_batch_info_get(b, &bi);
    printf("batch: %d steps, largest decode step %d answers, %llu tokens\n", steps, maxsize,
           (unsigned long long)bi.tokens);
    CHECKF(maxsize >= 3, "the decode steps batched at most %d answers", maxsize);
    /* answer 2 (sampled) is in every decode step after its admission until it ends: one
     * step per token after the first, plus the one that sampled a stop token */
    printf("batch: %llu of %lld answer-steps with a logits row; paths: %llu passes, %llu eager, %llu captured, "
           "%llu replayed\n", (unsigned long long)bi.rows_logits, answer_steps, (unsigned long long)bi.steps_passes,
           (unsigned long long)bi.steps_eager, (unsigned long long)bi.steps_captured,
           (unsigned long long)bi.steps_replayed);
    CHECKF(bi.rows_logits + 1 >= (uint64_t)ref[2].n && bi.rows_logits <= (uint64_t)ref[2].n,
           "logits rows %llu for a sampled answer of %d tokens", (unsigned long long)bi.rows_logits, ref[2].n);
    CHECK((long long)bi.rows_logits < answer_steps);
    CHECK(bi.steps_passes == bi.steps && bi.steps_eager == 0 && bi.steps_captured == 0 && bi.steps_replayed == 0);
    for (int i = 0; i < NS; i++) {
        CHECKF(got[i].done == 1, "answer %d: done called %d times", i, got[i].done);
        if (i == 3) {
            CHECKF(got[i].rc == KVZIP_ERR_CANCELED && same(&got[i], &ref[i], 3),
                   "canceled answer: rc %d, %d tokens", got[i].rc, got[i].n);
            CHECK(got[i].st.answer_tokens == 3);
            continue;
        }
        CHECKF(got[i].rc == 0 && same(&got[i], &ref[i], ref[i].n),
               "answer %d: rc %d, %d tokens vs %d alone (first differs?)", i, got[i].rc, got[i].n, ref[i].n);
        CHECK(got[i].st.answer_tokens == ref[i].st.answer_tokens && got[i].st.stopped == ref[i].st.stopped &&
              got[i].st.prompt_tokens == ref[i].st.prompt_tokens && got[i].st.out_slots == ref[i].st.out_slots);
        CHECK(got[i].st.ttft_s > 0 && got[i].st.kv_doc_rows == ref[i].st.kv_doc_rows);
    }
    CHECK(got[1].st.evictions == ref[1].st.evictions && got[1].st.out_used == ref[1].st.out_used);

    /* ---- 2. the sessions were rolled back: the same answers again ---- */
    for (int i = 0; i < NS; i++) {
        ans again;
        CHECK(ask(ss[i], qs[i], &again) == 0);
        CHECKF(same(&again, &ref[i], ref[i].n), "session %d after the batch: %d tokens", i, again.n);
    }

    /* ---- 3. bad input ---- */
    CHECK(kvzip_batch_submit(NULL, ss[0], qs[0], NULL, on_done, &got[0]) == KVZIP_ERR_ARG);
    CHECK(kvzip_batch_submit(b, NULL, qs[0], NULL, on_done, &got[0]) == KVZIP_ERR_ARG);
    CHECK(kvzip_batch_submit(b, ss[0], NULL, NULL, on_done, &got[0]) == KVZIP_ERR_ARG);
    CHECK(kvzip_batch_submit(b, ss[0], qs[0], NULL, NULL, &got[0]) == KVZIP_ERR_ARG);
    CHECK(kvzip_batch_submit(b, ss[0], "", NULL, on_done, &got[0]) == KVZIP_ERR_EMPTY);
    char longq[2048] = "";
    for (int i = 0; i < 100; i++) strcat(longq, "word ");
    CHECK(kvzip_batch_submit(b, ss[1], longq, NULL, on_done, &got[1]) == KVZIP_ERR_CONTEXT); /* budget 64 */
    CHECK(kvzip_batch_step(NULL) == KVZIP_ERR_ARG && kvzip_batch_wait(NULL, 0) == KVZIP_ERR_ARG);
    CHECK(kvzip_batch_info_get(b, NULL) == KVZIP_ERR_ARG);
    kvzip_batch *b2 = (kvzip_batch *)&bi;
    CHECK(kvzip_batch_open(NULL, NULL, &b2) == KVZIP_ERR_ARG && b2 == NULL);
    bo.max_seqs = 0;
    CHECK(kvzip_batch_open(m, &bo, &b2) == KVZIP_ERR_ARG && b2 == NULL);
    CHECK(kvzip_batch_open(m, NULL, NULL) == KVZIP_ERR_ARG);
    kvzip_model_opts so;
    kvzip_model_defaults(&so);
    so.device = KVZIP_DEVICE_CPU;
    so.synthetic = "tiny-llama";
    kvzip_model *m2;
    REQUIRE(kvzip_model_open(NULL, &so, &m2) == 0);
    REQUIRE(kvzip_batch_open(m2, NULL, &b2) == 0);
    CHECK(kvzip_batch_submit(b2, ss[0], qs[0], NULL, on_done, &got[0]) == KVZIP_ERR_ARG); /* other model */
    CHECK(kvzip_batch_close(b2) == 0);
    CHECK(kvzip_model_close(m2) == 0);
    /* close with an answer waiting: it ends with KVZIP_ERR_CLOSED, the session is free */
    memset(&got[0], 0, sizeof got[0]);
    CHECK(kvzip_batch_submit(b, ss[0], qs[0], on_tok, on_done, &got[0]) == 0);
    CHECK(kvzip_batch_close(b) == 0);
    CHECK(got[0].done == 1 && got[0].rc == KVZIP_ERR_CLOSED && got[0].n == 0);
    ans again;
    CHECK(ask(ss[0], qs[0], &again) == 0 && same(&again, &ref[0], ref[0].n));

    for (int i = 0; i < NS; i++) CHECK(kvzip_session_close(ss[i]) == 0);
    kvzip_store_close(s);
    kvzip_model_close(m);
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
    return kvz_test_summary();
}
