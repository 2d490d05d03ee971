/* The SnapKV observation hook of the eval module (kvz_eval_snap_hook) on the synthetic
 * tiny-llama, CPU backend (no model file):
 *  - the route kvzip-eval takes on a device cache (keys copied by kvz_kv_get_head,
 *    forced here with copy_kv = 1) gives the same scores, bit for bit, as the CPU's
 *    in-place route (kvz_kv_view);
 *  - both equal an independent double-precision computation of the definition from
 *    the q the forward pass hands the hook and the cache's keys: acc[l, g, j] = sum over
 *    the window queries i of softmax_j'(q_i·k_j'/sqrt(d)) over every key visible to i,
 *    taken at context row j (|d| <= 1e-5);
 *  - queries after the window (the reference answer) add nothing: the window's sum
 *    over every visible key is n_win per query head, the context's share below it;
 *  - a hook that returns an error stops the pass with that error.
 */
#include "kvz_test.h"

#include <math.h>
#include <stdint.h>

#include "kvz_error.h"
#include "kvz_eval.h"
#include "kvz_model.h"

#define NP 6      /* prefix rows */
#define NC 41     /* context rows */
#define NW 7      /* window: question tokens */
#define NA 5      /* reference answer tokens after the window */

typedef struct rec {
    kvz_eval_snap *snap;
    const kvz_config *c;
    double *ref;          /* (n_layer, n_head, NC) */
    int calls, fail_at;
} rec;

/* Wraps the hook: computes the reference from the same q and the cache's keys first. */
static int rec_hook(void *vctx, int32_t l, const float *q, const float *k_new, int32_t n, int64_t row0,
                    const kvz_kv *kv)
{
    rec *r = vctx;
    const kvz_config *c = r->c;
    const int hd = c->head_dim, grp = c->n_head / c->n_kv_head;
    r->calls++;
    if (r->fail_at && r->calls == r->fail_at) return KVZ_ERR_IO;
    float *k = malloc(sizeof(float) * (size_t)(row0 + n) * hd);
    if (!k) return KVZ_ERR_NOMEM;
    for (int h = 0; h < c->n_kv_head; h++) {
        if (kvz_kv_len(kv, l, h) != row0 + n || kvz_kv_get_head(kv, l, h, k, NULL, NULL)) { free(k); return KVZ_ERR_INTERNAL; }
        for (int g = 0; g < grp; g++)
            for (int32_t i = 0; i < n && row0 + i < NP + NC + NW; i++) {
                const float *qi = q + ((size_t)i * c->n_head + (size_t)h * grp + g) * hd;
                const int64_t vis = row0 + i + 1;
                double *s = malloc(sizeof(double) * (size_t)vis), mx = -INFINITY, sum = 0;
                if (!s) { free(k); return KVZ_ERR_NOMEM; }
                for (int64_t j = 0; j < vis; j++) {
                    double d = 0;
                    for (int x = 0; x < hd; x++) d += (double)qi[x] * k[(size_t)j * hd + x];
                    s[j] = d / sqrt((double)hd);
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int64_t j = 0; j < vis; j++) sum += (s[j] = exp(s[j] - mx));
                for (int j = 0; j < NC; j++)
                    r->ref[((size_t)l * c->n_head + (size_t)h * grp + g) * NC + j] += s[NP + j] / sum;
                free(s);
            }
    }
    /* the new keys the hook is handed are the cache's rows [row0, row0 + n) */
    int same = 1;
    for (int h = 0; h < c->n_kv_head && same; h++) {
        kvz_kv_get_head(kv, l, h, k, NULL, NULL);
        for (int32_t i = 0; i < n; i++)
            same &= !memcmp(k + (size_t)(row0 + i) * hd, k_new + ((size_t)i * c->n_kv_head + h) * hd,
                            sizeof(float) * (size_t)hd);
    }
    free(k);
    if (!same) return KVZ_ERR_INTERNAL;
    return kvz_eval_snap_hook(r->snap, l, q, k_new, n, row0, kv);
}

int main(void)
{
    kvz_model_opts mo = {.device = KVZ_DEVICE_CPU, .n_threads = 2};
    kvz_model *m = NULL;
    REQUIRE(kvz_model_synthetic("tiny-llama", &mo, &m) == 0);
    const kvz_config *c = kvz_model_config(m);
    const size_t A = (size_t)c->n_layer * c->n_head * NC;
    int32_t doc[NP + NC], pass[NW + NA];
    uint64_t st = 12345;
    for (int i = 0; i < NP + NC; i++) doc[i] = (int32_t)((st = st * 6364136223846793005ULL + 1442695040888963407ULL) >> 56);
    for (int i = 0; i < NW + NA; i++) pass[i] = (int32_t)((st = st * 6364136223846793005ULL + 1442695040888963407ULL) >> 56);
    kvz_kv *kv = NULL;
    REQUIRE(kvz_kv_create(m, 128, 0, &kv) == 0);
    REQUIRE(kvz_forward(m, kv, doc, NP + NC, 0, NULL, KVZ_FWD_NO_LOGITS, NULL) == 0);
    kvz_kv_checkpoint(kv);

    float *acc[2];
    double *ref[2];
    for (int copy = 0; copy < 2; copy++) {
        acc[copy] = calloc(A, sizeof(float));
        ref[copy] = calloc(A, sizeof(double));
        REQUIRE(acc[copy] && ref[copy]);
        kvz_eval_snap sn = {.c = c, .n_prefix = NP, .n_ctx = NC, .n_win = NW, .row_doc = NP + NC,
                            .acc = acc[copy], .copy_kv = copy};
        rec r = {.snap = &sn, .c = c, .ref = ref[copy]};
        const kvz_layer_hook hook = {.fn = rec_hook, .ctx = &r};
        CHECK(kvz_forward(m, kv, pass, NW + NA, NP + NC, NULL, KVZ_FWD_NO_LOGITS, &hook) == 0);
        kvz_kv_rollback(kv);
        CHECKF(r.calls == c->n_layer, "%d hook calls", r.calls);
        CHECK(copy ? sn.kb.rows >= NP + NC + NW : sn.kb.rows == 0); /* which route ran */
        kvz_eval_snap_free(&sn);
        CHECK(sn.work == NULL && sn.kb.k == NULL);
    }
    CHECKF(!memcmp(acc[0], acc[1], A * sizeof(float)), "the get_head route differs from the view route");
    double md = 0, tot = 0;
    for (size_t i = 0; i < A; i++) {
        const double d = fabs(acc[0][i] - ref[0][i]);
        md = d > md || d != d ? d : md;
        tot += acc[0][i];
    }
    CHECKF(md <= 1e-5, "max |acc - reference| = %g", md);
    /* each window query's probabilities sum to 1 over all its keys: the context's share
     * over n_layer * n_head query heads is at most n_win each, and not nothing */
    CHECKF(tot > 0 && tot <= (double)c->n_layer * c->n_head * NW + 1e-3, "context mass %g", tot);

    /* a failing hook stops the pass with its error, at the layer it failed */
    kvz_eval_snap sn = {.c = c, .n_prefix = NP, .n_ctx = NC, .n_win = NW, .row_doc = NP + NC, .acc = acc[0]};
    rec r = {.snap = &sn, .c = c, .ref = ref[0], .fail_at = 2};
    const kvz_layer_hook hook = {.fn = rec_hook, .ctx = &r};
    CHECK(kvz_forward(m, kv, pass, NW + NA, NP + NC, NULL, KVZ_FWD_NO_LOGITS, &hook) == KVZ_ERR_IO);
    CHECK(r.calls == 2);
    kvz_kv_rollback(kv);
    kvz_eval_snap_free(&sn);

    for (int i = 0; i < 2; i++) { free(acc[i]); free(ref[i]); }
    kvz_kv_free(kv);
    kvz_model_free(m);
    return kvz_test_summary();
}
