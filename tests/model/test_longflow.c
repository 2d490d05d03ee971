/* LongFlow-bounded output cache on the real model (DESIGN §5, issue 4).
 *
 *  1. B >= output length reproduces unbounded decoding (out_slots 0) bit for bit:
 *     200 greedy tokens after ~1000 document tokens of samples/aquila_aq300_manual.md,
 *     every token and every logit compared with memcmp, at B = question + 199 (the
 *     buffer is exactly full at the end, no eviction) and B = 1024.
 *  2. With eviction (B = 64, both policies) the document rows are byte-identical
 *     before and after decoding, doc_rows is unchanged, evictions = tokens - B.
 *  3. A question longer than the free slots: kvz_forward returns KVZ_ERR_CONTEXT
 *     and leaves the cache untouched; kvzip-query --budget 16 prints a clear error.
 */
#include "kvz_test.h"

#include <stdint.h>
#include <unistd.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_model.h"

#define N_DOC_TOKENS 1000
#define N_GEN 200
#define QUESTION "Describe the AQ300 in as much detail as you can, section by section."

typedef struct run {
    kvz_tokens out;
    float *logits; /* (N_GEN, n_vocab) */
} run;

/* The document prefilled once (document region); make_cache copies it. */
static kvz_kv *g_doc_kv;

/* A fresh cache holding the prefilled document rows, checkpointed. */
static int make_cache(kvz_model *m, const kvz_tokens *doc, int64_t extra, int32_t B, kvz_kv **kv)
{
    const kvz_config *c = kvz_model_config(m);
    int rc = 0;
    if (!g_doc_kv) {
        rc = kvz_kv_create(m, (int64_t)doc->n, 0, &g_doc_kv);
        if (!rc) rc = kvz_forward(m, g_doc_kv, doc->ids, (int32_t)doc->n, 0, NULL, KVZ_FWD_NO_LOGITS, NULL);
        if (rc) return rc;
    }
    const size_t n = doc->n, hd = (size_t)c->head_dim, nkv = (size_t)c->n_kv_head;
    float *k = malloc(sizeof(float) * n * hd * nkv), *v = malloc(sizeof(float) * n * hd * nkv);
    int32_t *pos = malloc(sizeof(int32_t) * n * nkv);
    uint32_t *counts = malloc(sizeof(uint32_t) * nkv);
    if (!k || !v || !pos || !counts) rc = KVZ_ERR_NOMEM;
    if (!rc) rc = kvz_kv_create(m, (int64_t)n + extra, B, kv);
    for (int32_t l = 0; l < c->n_layer && !rc; l++) {
        for (size_t h = 0; h < nkv && !rc; h++) {
            counts[h] = (uint32_t)n;
            rc = kvz_kv_get_head(g_doc_kv, l, (int32_t)h, k + h * n * hd, v + h * n * hd, pos + h * n);
        }
        if (!rc) rc = kvz_kv_set_layer(*kv, l, counts, pos, k, v);
    }
    if (!rc) kvz_kv_checkpoint(*kv);
    free(k); free(v); free(pos); free(counts);
    return rc;
}

static int generate(kvz_model *m, kvz_kv *kv, const kvz_tokens *doc, const kvz_tokens *q,
                    int32_t n_gen, run *r)
{
    kvz_gen_opts go = {.max_tokens = n_gen};
    kvz_sampler_init(&go.sampler, 0.0f, 1.0f, 1);
    r->out.n = 0;
    return kvz_generate(m, kv, q->ids, (int32_t)q->n, (int32_t)doc->n, &go, &r->out, r->logits, NULL);
}

/* Concatenated document K/V of every (layer, head). */
static float *snapshot_doc(const kvz_kv *kv, const kvz_config *c, size_t *n_floats)
{
    size_t total = 0;
    for (int32_t l = 0; l < c->n_layer; l++)
        for (int32_t h = 0; h < c->n_kv_head; h++) total += (size_t)kvz_kv_len(kv, l, h);
    const size_t hd = (size_t)c->head_dim;
    float *s = malloc(total * 2 * hd * sizeof(float) + 1);
    size_t off = 0;
    for (int32_t l = 0; l < c->n_layer && s; l++)
        for (int32_t h = 0; h < c->n_kv_head; h++) {
            const size_t n = (size_t)kvz_kv_len(kv, l, h);
            kvz_kv_get_head(kv, l, h, s + off, s + off + n * hd, NULL);
            off += 2 * n * hd;
        }
    *n_floats = off;
    return s;
}

int main(void)
{
    char path[1024];
    kvz_model *m = NULL;
    kvz_model_opts mo = {.device = KVZ_DEVICE_CPU};
    int rc = kvz_model_load(kvz_test_model(), &mo, &m);
    if (rc == KVZ_ERR_IO || rc == KVZ_ERR_NOTFOUND) {
        fprintf(stderr, "skip: no model at %s\n", kvz_test_model());
        return 77;
    }
    REQUIRE(rc == 0);
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    const size_t nv = (size_t)c->n_vocab;

    size_t dlen;
    char *text = kvz_test_read_file(kvz_test_path(path, sizeof path, "samples/aquila_aq300_manual.md"), &dlen);
    REQUIRE(text != NULL);
    kvz_tokens doc = {0}, body = {0}, q = {0};
    REQUIRE(kvz_chat_prefix(tok, &doc) == 0);
    REQUIRE(kvz_tokenizer_encode(tok, text, dlen, 0, &body) == 0);
    REQUIRE(body.n > N_DOC_TOKENS);
    for (size_t i = 0; i < N_DOC_TOKENS; i++) kvz_tokens_push(&doc, body.ids[i]);
    REQUIRE(kvz_chat_question(tok, QUESTION, &q) == 0);
    const int32_t nq = (int32_t)q.n;

    /* 1. unbounded reference vs B >= output length */
    run ref = {.logits = malloc(sizeof(float) * nv * N_GEN)};
    kvz_kv *kv0;
    REQUIRE(make_cache(m, &doc, nq + N_GEN, 0, &kv0) == 0);
    REQUIRE(generate(m, kv0, &doc, &q, N_GEN, &ref) == 0);
    REQUIRE(ref.out.n == N_GEN);
    int distinct = 0;
    for (size_t i = 0; i < ref.out.n; i++) {
        int seen = 0;
        for (size_t j = 0; j < i; j++) seen |= ref.out.ids[j] == ref.out.ids[i];
        distinct += !seen;
    }
    CHECKF(distinct >= 20, "reference output is degenerate (%d distinct tokens)", distinct);
    kvz_kv_free(kv0);

    /* the last generated token is never forwarded: nq + N_GEN - 1 slots are used */
    const int32_t budgets[] = {nq + N_GEN - 1, 1024};
    for (size_t bi = 0; bi < 2; bi++) {
        const int32_t B = budgets[bi];
        run r = {.logits = malloc(sizeof(float) * nv * N_GEN)};
        kvz_kv *kv;
        REQUIRE(make_cache(m, &doc, 0, B, &kv) == 0);
        REQUIRE(generate(m, kv, &doc, &q, N_GEN, &r) == 0);
        CHECKF(r.out.n == ref.out.n && !memcmp(r.out.ids, ref.out.ids, sizeof(int32_t) * ref.out.n),
               "B=%d: tokens differ from unbounded decoding", B);
        size_t first_diff = N_GEN * nv;
        for (size_t i = 0; i < N_GEN * nv; i++)
            if (memcmp(&r.logits[i], &ref.logits[i], sizeof(float))) { first_diff = i; break; }
        CHECKF(first_diff == N_GEN * nv, "B=%d: logits not bit-identical, first at step %zu "
               "(%.9g vs %.9g)", B, first_diff / nv, first_diff < N_GEN * nv ? r.logits[first_diff] : 0,
               first_diff < N_GEN * nv ? ref.logits[first_diff] : 0);
        kvz_kv_stats st;
        kvz_kv_get_stats(kv, &st);
        CHECK(st.evictions == 0);
        CHECK(st.out_used == nq + N_GEN - 1);
        printf("B=%d: %d tokens, logits %s\n", B, N_GEN, first_diff == N_GEN * nv ? "bit-identical" : "DIFFER");
        kvz_kv_free(kv);
        free(r.logits);
        kvz_tokens_free(&r.out);
    }

    /* 2. eviction leaves the document alone */
    for (int policy = KVZ_OUT_LONGFLOW; policy <= KVZ_OUT_WINDOW; policy++) {
        const int32_t B = 64;
        run r = {.logits = NULL};
        kvz_kv *kv;
        REQUIRE(make_cache(m, &doc, 0, B, &kv) == 0);
        kvz_kv_set_out_policy(kv, policy);
        kvz_kv_stats st0, st1;
        kvz_kv_get_stats(kv, &st0);
        size_t n0, n1;
        float *before = snapshot_doc(kv, c, &n0);
        REQUIRE(generate(m, kv, &doc, &q, N_GEN, &r) == 0);
        float *after = snapshot_doc(kv, c, &n1);
        kvz_kv_get_stats(kv, &st1);
        CHECK(n0 == n1 && n0 > 0 && !memcmp(before, after, n0 * sizeof(float)));
        CHECK(st1.doc_rows == st0.doc_rows);
        CHECK(st1.out_used == B);
        /* tokens through the buffer: nq question + N_GEN - 1 forwarded answers */
        CHECKF(st1.evictions == nq + N_GEN - 1 - B, "policy %d: %lld evictions, want %d", policy,
               (long long)st1.evictions, nq + N_GEN - 1 - B);
        int agree = 0;
        for (size_t i = 0; i < r.out.n && i < ref.out.n; i++) agree += r.out.ids[i] == ref.out.ids[i];
        printf("policy %s B=%d: free-running agreement with unbounded %d/%d\n",
               policy == KVZ_OUT_LONGFLOW ? "longflow" : "window", B, agree, N_GEN);
        /* rollback empties the buffer, keeps the document */
        kvz_kv_rollback(kv);
        kvz_kv_get_stats(kv, &st1);
        CHECK(st1.out_used == 0 && st1.evictions == 0 && st1.doc_rows == st0.doc_rows);
        free(before);
        free(after);
        kvz_tokens_free(&r.out);
        kvz_kv_free(kv);
    }

    /* 3. a question longer than the free slots */
    {
        kvz_kv *kv;
        REQUIRE(make_cache(m, &doc, 0, 16, &kv) == 0);
        REQUIRE(nq > 16);
        float *lg = malloc(sizeof(float) * nv);
        rc = kvz_forward(m, kv, q.ids, nq, (int32_t)doc.n, lg, KVZ_FWD_LOGITS_LAST, NULL);
        CHECKF(rc == KVZ_ERR_CONTEXT, "rc %d", rc);
        kvz_kv_stats st;
        kvz_kv_get_stats(kv, &st);
        CHECK(st.out_used == 0);
        /* fits exactly, then one more multi-token pass does not */
        CHECK(kvz_forward(m, kv, q.ids, 16, (int32_t)doc.n, lg, KVZ_FWD_LOGITS_LAST, NULL) == 0);
        CHECK(kvz_forward(m, kv, q.ids, 2, (int32_t)doc.n + 16, lg, KVZ_FWD_LOGITS_LAST, NULL) ==
              KVZ_ERR_CONTEXT);
        CHECK(kvz_forward(m, kv, q.ids, 1, (int32_t)doc.n + 16, lg, KVZ_FWD_LOGITS_LAST, NULL) == 0);
        kvz_kv_get_stats(kv, &st);
        CHECK(st.out_used == 16 && st.evictions == 1);
        free(lg);
        kvz_kv_free(kv);
    }
    {
        /* the CLI refuses with a message naming the budget */
        const char *bin = getenv("KVZ_BINARY_DIR");
        char cmd[4096], tmp[] = "/tmp/kvz_lf_XXXXXX", txt[] = "/tmp/kvz_lf_doc_XXXXXX";
        int fd = mkstemp(tmp), fd2 = mkstemp(txt);
        REQUIRE(fd >= 0 && fd2 >= 0);
        static const char small_doc[] = "The AQ300 is a water pump. It weighs 4 kg.\n";
        REQUIRE(write(fd2, small_doc, sizeof small_doc - 1) == (ssize_t)(sizeof small_doc - 1));
        close(fd);
        close(fd2);
        snprintf(cmd, sizeof cmd, "%s/bin/kvzip-query --device cpu --model %s --text %s --budget 16 "
                 "--max-tokens 4 '%s' 2>%s >/dev/null", bin ? bin : "build", kvz_test_model(), txt,
                 QUESTION, tmp);
        int st = system(cmd);
        size_t elen = 0;
        char *err = kvz_test_read_file(tmp, &elen);
        CHECKF(st != 0, "kvzip-query accepted a question longer than --budget");
        CHECKF(err && strstr(err, "--budget 16"), "stderr: %s", err ? err : "(none)");
        free(err);
        remove(tmp);
        remove(txt);
    }

    kvz_tokens_free(&ref.out);
    free(ref.logits);
    kvz_kv_free(g_doc_kv);
    kvz_tokens_free(&doc);
    kvz_tokens_free(&body);
    kvz_tokens_free(&q);
    free(text);
    kvz_model_free(m);
    return kvz_test_summary();
}
