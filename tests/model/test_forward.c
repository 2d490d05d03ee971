/* CPU forward vs HF transformers (fp32) on the same GGUF: logits on 3 prompts,
 * 64-token greedy continuations, and prefill-then-decode == one-shot prefill.
 * Golden: tests/golden/logits_smollm2.bin (scripts/golden/gen_logits_golden.py).
 *
 * Tolerances: both sides compute in fp32 from identical dequantized weights; the
 * only differences are summation order (OpenBLAS vs PyTorch GEMMs) and libm
 * exp/cos. Measured (2026-11-29): max |dlogit| 1.1e-4 over the top-16 of every
 * position, relative L2 error 1.1e-6 over the full last-position vector. We allow
 * 2e-3 absolute and 2e-5 relative: ~20x above what we measure, and ~1000x below
 * what a real bug does (a wrong RoPE layout or a missing bias moves logits by
 * whole units). */
#include "kvz_test.h"

#include <stdint.h>

#include "kvz_generate.h"
#include "kvz_model.h"

#define N_TOP 16
#define ABS_TOL 2e-3f
#define REL_TOL 2e-5

typedef struct prompt_golden {
    uint32_t n;
    uint32_t *ids;
    uint32_t *top_id;    /* (n, 16) */
    float *top_logit;    /* (n, 16) */
    float *last;         /* (n_vocab) */
    uint32_t gen[64];
} prompt_golden;

static const uint8_t *rd(const uint8_t **p, size_t n) { const uint8_t *q = *p; *p += n; return q; }
static uint32_t rd_u32(const uint8_t **p) { uint32_t v; memcpy(&v, rd(p, 4), 4); return v; }

int main(void)
{
    char path[1024];
    size_t glen;
    uint8_t *g = (uint8_t *)kvz_test_read_file(kvz_test_path(path, sizeof path,
                                               "tests/golden/logits_smollm2.bin"), &glen);
    REQUIRE(g != NULL);
    const uint8_t *p = g;
    REQUIRE(memcmp(rd(&p, 4), "KVZL", 4) == 0);
    REQUIRE(rd_u32(&p) == 1);
    const uint32_t np = rd_u32(&p), nv = rd_u32(&p);
    REQUIRE(np == 3 && nv == 49152);
    prompt_golden pg[3];
    for (uint32_t k = 0; k < np; k++) {
        pg[k].n = rd_u32(&p);
        pg[k].ids = (uint32_t *)rd(&p, 4 * pg[k].n);
        pg[k].top_id = malloc(4 * pg[k].n * N_TOP);
        pg[k].top_logit = malloc(4 * pg[k].n * N_TOP);
        for (uint32_t i = 0; i < pg[k].n * N_TOP; i++) {
            pg[k].top_id[i] = rd_u32(&p);
            memcpy(&pg[k].top_logit[i], rd(&p, 4), 4);
        }
        pg[k].last = (float *)rd(&p, 4 * nv);
        REQUIRE(rd_u32(&p) == 64);
        memcpy(pg[k].gen, rd(&p, 4 * 64), 4 * 64);
    }
    REQUIRE((size_t)(p - g) == glen);

    kvz_model *m;
    kvz_model_opts o = {.device = KVZ_DEVICE_CPU};
    REQUIRE(kvz_model_load(kvz_test_model(), &o, &m) == 0);
    const kvz_config *c = kvz_model_config(m);
    REQUIRE(c->n_vocab == (int32_t)nv);

    for (uint32_t k = 0; k < np; k++) {
        const uint32_t n = pg[k].n;
        CHECK(n >= 100);
        int32_t *ids = malloc(4 * (n + 64));
        for (uint32_t i = 0; i < n; i++) ids[i] = (int32_t)pg[k].ids[i];
        float *logits = malloc(sizeof(float) * (size_t)n * nv);
        kvz_kv *kv;
        REQUIRE(kvz_kv_create(m, n + 64, 0, &kv) == 0);
        REQUIRE(kvz_forward(m, kv, ids, (int32_t)n, 0, logits, KVZ_FWD_LOGITS_ALL, NULL) == 0);
        float max_abs = 0;
        int argmax_ok = 0, argmax_close = 0;
        for (uint32_t i = 0; i < n; i++) {
            const float *row = logits + (size_t)i * nv;
            for (int t = 0; t < N_TOP; t++) {
                float d = fabsf(row[pg[k].top_id[i * N_TOP + t]] - pg[k].top_logit[i * N_TOP + t]);
                if (d > max_abs) max_abs = d;
            }
            int32_t am = 0;
            for (uint32_t v = 1; v < nv; v++) if (row[v] > row[am]) am = (int32_t)v;
            if ((uint32_t)am == pg[k].top_id[i * N_TOP]) argmax_ok++;
            else if (pg[k].top_logit[i * N_TOP] - pg[k].top_logit[i * N_TOP + 1] < 2 * ABS_TOL) argmax_close++;
        }
        double num = 0, den = 0;
        const float *last = logits + (size_t)(n - 1) * nv;
        for (uint32_t v = 0; v < nv; v++) {
            double d = (double)last[v] - pg[k].last[v];
            num += d * d;
            den += (double)pg[k].last[v] * pg[k].last[v];
        }
        const double rel = sqrt(num / den);
        printf("prompt %u: %u tokens, max |dlogit| over top-16 = %.3g, last-position rel L2 = %.3g, "
               "argmax agree %d/%u (+%d near-ties)\n", k, n, max_abs, rel, argmax_ok, n, argmax_close);
        CHECKF(max_abs <= ABS_TOL, "prompt %u max abs %g", k, max_abs);
        CHECKF(rel <= REL_TOL, "prompt %u rel %g", k, rel);
        CHECK(argmax_ok + argmax_close == (int)n);

        /* greedy continuation, 64 tokens, no stop */
        kvz_kv_truncate(kv, 0);
        kvz_tokens out = {0};
        kvz_gen_opts go = {.max_tokens = 64, .stop_on_eos = 0};
        kvz_sampler_init(&go.sampler, 0.0f, 1.0f, 1);
        REQUIRE(kvz_generate(m, kv, ids, (int32_t)n, 0, &go, &out, NULL, NULL) == 0);
        int same = out.n == 64;
        int first_diff = -1;
        for (size_t i = 0; i < out.n && i < 64; i++)
            if ((uint32_t)out.ids[i] != pg[k].gen[i]) { same = 0; if (first_diff < 0) first_diff = (int)i; }
        CHECKF(same, "prompt %u: greedy continuation differs from HF at step %d", k, first_diff);

        /* prefill n-8, then decode 8 tokens one by one: same logits as one-shot */
        kvz_kv_truncate(kv, 0);
        REQUIRE(kvz_forward(m, kv, ids, (int32_t)n - 8, 0, NULL, KVZ_FWD_NO_LOGITS, NULL) == 0);
        float *step = malloc(sizeof(float) * nv);
        float dmax = 0;
        for (uint32_t i = n - 8; i < n; i++) {
            REQUIRE(kvz_forward(m, kv, &ids[i], 1, (int32_t)i, step, KVZ_FWD_LOGITS_LAST, NULL) == 0);
            for (uint32_t v = 0; v < nv; v++) {
                float d = fabsf(step[v] - logits[(size_t)i * nv + v]);
                if (d > dmax) dmax = d;
            }
        }
        printf("prompt %u: prefill+decode vs one-shot max |dlogit| = %.3g\n", k, dmax);
        CHECKF(dmax <= 1e-3f, "prompt %u incremental decode differs by %g", k, dmax);
        free(step);
        kvz_tokens_free(&out);
        kvz_kv_free(kv);
        free(logits);
        free(ids);
        free(pg[k].top_id);
        free(pg[k].top_logit);
    }
    kvz_model_free(m);
    free(g);
    return kvz_test_summary();
}
