/* kvz_forward_multi_top on the CPU backend (kvz_forward_each) and the shared greedy rule
 * kvz_argmax, on the synthetic tiny-llama (random weights, no model file).
 *
 * kvz_argmax: planted ties (lowest index wins), a NaN in the middle (skipped), a NaN
 * first (0, as the scan from best = 0 gives), all -inf (0), one element.
 *
 * The step: NC caches with their own random documents and LongFlow buffers of 6 slots
 * (so they evict within the run), and twin caches stepped one at a time with kvz_forward.
 * STEPS steps over a changing subset; row i asks for its logits on some steps only;
 * odd steps lend a scratch row (kvz_step_io.scratch) for the unwanted rows' ids.
 * Asserted every row: a wanted row equals the twin's logits exactly (the same forward
 * pass), a row not wanted keeps the bytes it had, the argmax id equals kvz_argmax of the
 * twin's logits, path is KVZ_STEP_PASSES. Bad input: logits NULL while a row wants them,
 * kvz_forward_multi with NULL logits → KVZ_ERR_ARG; logits NULL with no row wanted is
 * accepted (ids only). */
#include "kvz_test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_model.h"

#define NC 3
#define STEPS 12

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static int32_t rnd(int32_t n)
{
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (int32_t)(g_rng % (uint64_t)n);
}

static void test_argmax(void)
{
    float x[8] = {1, 5, 2, 5, -1, 0, 5, 3};
    CHECK(kvz_argmax(x, 8) == 1);              /* ties: the lowest index */
    x[2] = NAN;
    CHECK(kvz_argmax(x, 8) == 1);              /* a NaN never wins */
    x[0] = NAN;
    CHECK(kvz_argmax(x, 8) == 0);              /* ... but a NaN first stays the pick */
    float y[3] = {-INFINITY, -INFINITY, -INFINITY};
    CHECK(kvz_argmax(y, 3) == 0);
    CHECK(kvz_argmax(y, 1) == 0);
    float z[4] = {0, 0, 7, 7};
    CHECK(kvz_argmax(z, 4) == 2);
}

int main(void)
{
    test_argmax();
    kvz_model_opts o = {.device = KVZ_DEVICE_CPU};
    kvz_model *m = NULL;
    REQUIRE(kvz_model_synthetic("tiny-llama", &o, &m) == 0);
    const int32_t V = kvz_model_config(m)->n_vocab;
    kvz_kv *A[NC], *T[NC];
    int32_t P[NC], tok[NC];
    for (int i = 0; i < NC; i++) {
        const int32_t len = 20 + 7 * i;
        int32_t doc[64];
        for (int32_t j = 0; j < len; j++) doc[j] = rnd(V);
        REQUIRE(kvz_kv_create(m, 64, 6, &A[i]) == 0);
        REQUIRE(kvz_kv_create(m, 64, 6, &T[i]) == 0);
        kvz_kv_set_sinks(A[i], 1);
        kvz_kv_set_sinks(T[i], 1);
        REQUIRE(kvz_forward(m, A[i], doc, len, 0, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_TO_DOC, NULL) == 0);
        REQUIRE(kvz_forward(m, T[i], doc, len, 0, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_TO_DOC, NULL) == 0);
        P[i] = len;
        tok[i] = rnd(V);
    }
    float *lm = malloc(sizeof(float) * (size_t)NC * V), *ls = malloc(sizeof(float) * (size_t)V);
    float *scr = malloc(sizeof(float) * (size_t)V); /* io.scratch on odd steps */
    REQUIRE(lm && ls && scr);
    /* bad input */
    {
        kvz_kv *two[2] = {A[0], A[1]};
        int32_t tk[2] = {1, 2}, ps[2] = {P[0], P[1]}, top[2];
        uint8_t want[2] = {0, 1};
        kvz_step_io io = {.want_logits = want, .top = top};
        CHECK(kvz_forward_multi_top(m, two, tk, ps, 2, NULL, &io) == KVZ_ERR_ARG);
        CHECK(kvz_forward_multi(m, two, tk, ps, 2, NULL) == KVZ_ERR_ARG);
        kvz_error_clear();
    }
    int64_t rows = 0, logit_bad = 0, kept_bad = 0, top_bad = 0, path_bad = 0, skipped = 0, ids_only = 0;
    for (int st = 0; st < STEPS; st++) {
        int32_t idx[NC], n = 1 + st % NC;
        for (int i = 0; i < NC; i++) idx[i] = (i + st) % NC;
        kvz_kv *sel[NC];
        int32_t tk[NC], ps[NC], top[NC];
        uint8_t want[NC];
        const int none = st % 4 == 3; /* ids only: logits NULL */
        for (int j = 0; j < n; j++) {
            sel[j] = A[idx[j]]; tk[j] = tok[idx[j]]; ps[j] = P[idx[j]];
            want[j] = !none && (j + st) % 2 == 0;
            memset(lm + (size_t)j * V, 0x5A, sizeof(float) * V);
            top[j] = -1;
        }
        kvz_step_io io = {.want_logits = want, .top = top, .path = -1, .scratch = st % 2 ? scr : NULL};
        const int rc = kvz_forward_multi_top(m, sel, tk, ps, n, none ? NULL : lm, &io);
        CHECKF(rc == 0, "step %d: %s (%s)", st, kvz_strerror(rc), kvz_error_detail());
        if (rc) break;
        ids_only += none;
        path_bad += io.path != KVZ_STEP_PASSES;
        for (int j = 0; j < n; j++) {
            const int i = idx[j];
            REQUIRE(kvz_forward(m, T[i], &tk[j], 1, ps[j], ls, KVZ_FWD_LOGITS_LAST, NULL) == 0);
            const float *row = lm + (size_t)j * V;
            if (want[j]) {
                logit_bad += memcmp(row, ls, sizeof(float) * V) != 0;
            } else {
                const uint8_t *u = (const uint8_t *)row;
                int bad = 0;
                for (size_t b = 0; b < sizeof(float) * (size_t)V; b++) bad |= u[b] != 0x5A;
                kept_bad += bad;
                skipped++;
            }
            top_bad += top[j] != kvz_argmax(ls, V);
            rows++;
            P[i]++;
            tok[i] = top[j];
        }
    }
    int64_t evictions = 0;
    for (int i = 0; i < NC; i++) {
        kvz_kv_stats sa;
        kvz_kv_get_stats(A[i], &sa);
        evictions += sa.evictions;
    }
    printf("%lld rows (%lld without logits, %lld ids-only steps): logits differ %lld, unwanted rows written %lld, "
           "ids differ %lld, wrong path %lld; evictions %lld\n", (long long)rows, (long long)skipped,
           (long long)ids_only, (long long)logit_bad, (long long)kept_bad, (long long)top_bad, (long long)path_bad,
           (long long)evictions);
    CHECK(rows > 0 && skipped > 0 && ids_only > 0);
    CHECK(logit_bad == 0 && kept_bad == 0 && top_bad == 0 && path_bad == 0);
    CHECK(evictions > 0);
    for (int i = 0; i < NC; i++) { kvz_kv_free(A[i]); kvz_kv_free(T[i]); }
    free(lm);
    free(ls);
    free(scr);
    kvz_model_free(m);
    return kvz_test_summary();
}
