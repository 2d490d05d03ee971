/* Layer hooks on the CUDA backend (kvz_model.h kvz_layer_hook) against the CPU backend,
 * synthetic tiny-llama (head_dim 32: the reference attention kernel) and smollm2-135m
 * (head_dim 64: the tiled kernels), identical weights on both, no model file:
 *  - a 20-token pass after a 300-token prefill calls the hook once per layer with the
 *    same n and row0 as the CPU backend;
 *  - q agrees with the CPU's fp32 q within ‖Δ‖/‖cpu‖ <= 5e-2 per layer (bf16 weights,
 *    activations and cache: the tolerance of test_backend.c's logits);
 *  - k_new equals the cache's rows [row0, row0 + n) read by kvz_kv_get_head, bit for
 *    bit (both are the device's bf16 keys widened), and kvz_kv_view refuses the cache;
 *  - the hook does not change the pass: the logits of every position equal those of
 *    the same pass without a hook, bit for bit;
 *  - a one-token decode step with a hook calls it per layer with n = 1;
 *  - the eval module's SnapKV observation (kvz_eval_snap_hook, keys through
 *    kvz_kv_get_head on the device) agrees with the CPU's within 5e-2;
 *  - a hook's error stops the pass with that error.
 * Exits 77 (skip) without a usable GPU. */
#include "kvz_test.h"

#include <stdint.h>

#include "kvz_backend.h"
#include "kvz_error.h"
#include "kvz_eval.h"
#include "kvz_model.h"

#define P 300
#define T 20
#define NW 12
#define TOL 5e-2

typedef struct rec {
    const kvz_config *c;
    int calls, fail_at, device;
    int32_t n[64];
    int64_t row0[64];
    float *q;          /* (n_layer, T, qd) */
    int kv_exact, view_refused;
    kvz_eval_snap *snap;
} rec;

static int rec_hook(void *vctx, int32_t l, const float *q, const float *k_new, int32_t n, int64_t row0,
                    const kvz_kv *kv)
{
    rec *r = vctx;
    const kvz_config *c = r->c;
    const size_t qd = (size_t)c->n_head * c->head_dim, hd = (size_t)c->head_dim;
    if (++r->calls == r->fail_at) return KVZ_ERR_IO;
    if (l < 0 || l >= 64 || n > T) return KVZ_ERR_INTERNAL;
    r->n[l] = n;
    r->row0[l] = row0;
    memcpy(r->q + (size_t)l * T * qd, q, sizeof(float) * (size_t)n * qd);
    const float *vk;
    int64_t vl;
    if (r->device) r->view_refused &= kvz_kv_view(kv, l, 0, &vk, NULL, NULL, &vl) == KVZ_ERR_UNSUPPORTED;
    float *k = malloc(sizeof(float) * (size_t)(row0 + n) * hd);
    if (!k) return KVZ_ERR_NOMEM;
    for (int h = 0; h < c->n_kv_head; h++) {
        if (kvz_kv_get_head(kv, l, h, k, NULL, NULL)) { free(k); return KVZ_ERR_INTERNAL; }
        for (int32_t i = 0; i < n; i++)
            r->kv_exact &= !memcmp(k + (size_t)(row0 + i) * hd, k_new + ((size_t)i * c->n_kv_head + h) * hd,
                                   sizeof(float) * hd);
    }
    free(k);
    return r->snap ? kvz_eval_snap_hook(r->snap, l, q, k_new, n, row0, kv) : 0;
}

static double rel(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] != a[i]) return INFINITY;
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void run(const char *name)
{
    printf("[%s]\n", name);
    kvz_model *m[2] = {NULL, NULL};
    kvz_kv *kv[2] = {NULL, NULL};
    rec r[2];
    float *acc[2] = {NULL, NULL}, *lg = NULL, *lg2 = NULL;
    memset(r, 0, sizeof r);
    int32_t toks[P + T + 1];
    uint64_t st = 99;
    for (int i = 0; i < P + T + 1; i++) toks[i] = (int32_t)((st = st * 6364136223846793005ULL + 1442695040888963407ULL) >> 56);
    for (int d = 0; d < 2; d++) {
        kvz_model_opts o = {.device = d ? KVZ_DEVICE_CUDA : KVZ_DEVICE_CPU};
        if (kvz_model_synthetic(name, &o, &m[d]) || kvz_kv_create(m[d], P + T + 8, 0, &kv[d]) ||
            kvz_forward(m[d], kv[d], toks, P, 0, NULL, KVZ_FWD_NO_LOGITS, NULL)) {
            CHECKF(0, "%s: setup on %s: %s", name, d ? "cuda" : "cpu", kvz_error_detail());
            goto out;
        }
        kvz_kv_checkpoint(kv[d]);
    }
    const kvz_config *c = kvz_model_config(m[0]);
    const size_t qd = (size_t)c->n_head * c->head_dim, A = (size_t)c->n_layer * c->n_head * P;
    lg = malloc(sizeof(float) * (size_t)T * c->n_vocab);
    lg2 = malloc(sizeof(float) * (size_t)T * c->n_vocab);
    for (int d = 0; d < 2; d++) {
        acc[d] = calloc(A, sizeof(float));
        r[d] = (rec){.c = c, .device = d, .kv_exact = 1, .view_refused = 1,
                     .q = malloc(sizeof(float) * (size_t)c->n_layer * T * qd)};
        if (!r[d].q || !acc[d] || !lg || !lg2) { CHECK(0); goto out; }
        kvz_eval_snap sn = {.c = c, .n_prefix = 0, .n_ctx = P, .n_win = NW, .row_doc = P, .acc = acc[d]};
        r[d].snap = &sn;
        const kvz_layer_hook hook = {.fn = rec_hook, .ctx = &r[d]};
        int rc = kvz_forward(m[d], kv[d], toks + P, T, P, lg, KVZ_FWD_LOGITS_ALL, &hook);
        kvz_kv_rollback(kv[d]);
        kvz_eval_snap_free(&sn);
        r[d].snap = NULL;
        CHECKF(rc == 0, "%s %s: hooked pass -> %d (%s)", name, d ? "cuda" : "cpu", rc, kvz_error_detail());
        CHECKF(r[d].calls == c->n_layer, "%s: %d hook calls", name, r[d].calls);
        CHECK(r[d].kv_exact);
        if (d) {
            CHECK(r[d].view_refused);
            /* the same pass without a hook: the same logits, bit for bit */
            CHECK(kvz_forward(m[d], kv[d], toks + P, T, P, lg2, KVZ_FWD_LOGITS_ALL, NULL) == 0);
            kvz_kv_rollback(kv[d]);
            CHECKF(!memcmp(lg, lg2, sizeof(float) * (size_t)T * c->n_vocab), "%s: the hook changed the logits", name);
        }
    }
    double worst = 0;
    for (int32_t l = 0; l < c->n_layer; l++) {
        CHECKF(r[1].n[l] == r[0].n[l] && r[1].row0[l] == r[0].row0[l] && r[0].n[l] == T && r[0].row0[l] == P,
               "%s layer %d: n %d/%d row0 %lld/%lld", name, l, r[0].n[l], r[1].n[l], (long long)r[0].row0[l],
               (long long)r[1].row0[l]);
        const double e = rel(r[1].q + (size_t)l * T * qd, r[0].q + (size_t)l * T * qd, (size_t)T * qd);
        worst = e > worst ? e : worst;
    }
    printf("  q: worst layer ||cuda-cpu||/||cpu|| %.3e (tol %.0e)\n", worst, TOL);
    CHECKF(worst <= TOL, "%s: q rel err %.3e", name, worst);
    const double ea = rel(acc[1], acc[0], A);
    printf("  SnapKV observation: ||cuda-cpu||/||cpu|| %.3e (tol %.0e)\n", ea, TOL);
    CHECKF(ea <= TOL, "%s: snapkv acc rel err %.3e", name, ea);

    /* one decode step with a hook (the graph is bypassed): n = 1 per layer */
    rec d1 = {.c = c, .device = 1, .kv_exact = 1, .view_refused = 1, .q = r[1].q};
    const kvz_layer_hook h1 = {.fn = rec_hook, .ctx = &d1};
    CHECK(kvz_forward(m[1], kv[1], toks + P, 1, P, lg, KVZ_FWD_LOGITS_LAST, &h1) == 0);
    CHECK(d1.calls == c->n_layer && d1.n[0] == 1 && d1.row0[0] == P && d1.kv_exact);
    kvz_kv_rollback(kv[1]);
    /* an error from the hook stops the pass with it */
    rec bad = {.c = c, .device = 1, .kv_exact = 1, .view_refused = 1, .q = r[1].q, .fail_at = 2};
    const kvz_layer_hook hb = {.fn = rec_hook, .ctx = &bad};
    CHECK(kvz_forward(m[1], kv[1], toks + P, T, P, NULL, KVZ_FWD_NO_LOGITS, &hb) == KVZ_ERR_IO && bad.calls == 2);
    kvz_kv_rollback(kv[1]);
out:
    for (int d = 0; d < 2; d++) {
        free(r[d].q);
        free(acc[d]);
        kvz_kv_free(kv[d]);
        kvz_model_free(m[d]);
    }
    free(lg);
    free(lg2);
}

int main(void)
{
    const kvz_backend *be;
    if (kvz_backend_pick(KVZ_DEVICE_CUDA, &be)) {
        printf("skip: no usable GPU (%s)\n", kvz_error_detail());
        return 77;
    }
    run("tiny-llama");
    run("smollm2-135m");
    return kvz_test_summary();
}
