/* Shared by the forward-pass model tests: reader for the "KVZL" logits goldens
 * (scripts/golden/README.md) and the checks of the CPU backend against them.
 *
 * check_f32():   fp32 weights vs HF transformers (fp32): top-16 logits at every
 *                position, full last-position vector, greedy continuation, and
 *                prefill-then-decode == one-shot prefill.
 * check_quant(): the default CPU path on the GGUF's quantized blocks. Batches of
 *                >= 16 tokens dequantize weight tiles for SGEMM (fp32 math on the
 *                same values): held to the fp32 tolerances. Decode steps use int8
 *                activations (kvz_qdot): compared with the fp32 one-shot logits
 *                within dec_tol, argmax equal wherever the fp32 top-2 gap exceeds
 *                dec_tol; the greedy continuation must equal HF's up to its first
 *                divergence, and that divergence must sit at a near-tie of the fp32
 *                reference (top-2 gap < dec_tol), which is printed. */
#ifndef KVZ_TEST_GOLDEN_LOGITS_H
#define KVZ_TEST_GOLDEN_LOGITS_H

#include <stdint.h>

#include "kvz_generate.h"
#include "kvz_model.h"
#include "kvz_test.h"

#define GL_TOP 16
#define GL_GEN 64
#define GL_MAXP 8

typedef struct gl_prompt {
    uint32_t n;
    int32_t *ids;        /* (n) */
    uint32_t *top_id;    /* (n, 16) */
    float *top_logit;    /* (n, 16) */
    const float *last;   /* (n_vocab) */
    uint32_t gen[GL_GEN];
} gl_prompt;

typedef struct gl_golden {
    uint32_t np, nv;
    gl_prompt p[GL_MAXP];
    uint8_t *buf;
} gl_golden;

static inline const uint8_t *gl_rd(const uint8_t **p, size_t n) { const uint8_t *q = *p; *p += n; return q; }
static inline uint32_t gl_u32(const uint8_t **p) { uint32_t v; memcpy(&v, gl_rd(p, 4), 4); return v; }

/* 0, or -1 (message printed) */
static inline int gl_load(const char *rel, gl_golden *g)
{
    char path[1024];
    size_t len;
    memset(g, 0, sizeof *g);
    g->buf = (uint8_t *)kvz_test_read_file(kvz_test_path(path, sizeof path, rel), &len);
    if (!g->buf) { fprintf(stderr, "cannot read %s\n", path); return -1; }
    const uint8_t *p = g->buf;
    if (len < 16 || memcmp(gl_rd(&p, 4), "KVZL", 4) || gl_u32(&p) != 1) return -1;
    g->np = gl_u32(&p);
    g->nv = gl_u32(&p);
    if (g->np > GL_MAXP) return -1;
    for (uint32_t k = 0; k < g->np; k++) {
        gl_prompt *q = &g->p[k];
        q->n = gl_u32(&p);
        q->ids = malloc(4 * ((size_t)q->n + GL_GEN));
        memcpy(q->ids, gl_rd(&p, 4 * (size_t)q->n), 4 * (size_t)q->n);
        q->top_id = malloc(4 * (size_t)q->n * GL_TOP);
        q->top_logit = malloc(4 * (size_t)q->n * GL_TOP);
        for (uint32_t i = 0; i < q->n * GL_TOP; i++) {
            q->top_id[i] = gl_u32(&p);
            memcpy(&q->top_logit[i], gl_rd(&p, 4), 4);
        }
        q->last = (const float *)gl_rd(&p, 4 * (size_t)g->nv);
        if (gl_u32(&p) != GL_GEN) return -1;
        memcpy(q->gen, gl_rd(&p, 4 * GL_GEN), 4 * GL_GEN);
    }
    return (size_t)(p - g->buf) == len ? 0 : -1;
}

static inline void gl_free(gl_golden *g)
{
    for (uint32_t k = 0; k < g->np; k++) { free(g->p[k].ids); free(g->p[k].top_id); free(g->p[k].top_logit); }
    free(g->buf);
}

static inline int32_t gl_argmax(const float *v, uint32_t n, float *gap)
{
    int32_t a = 0, b = -1;
    for (uint32_t i = 1; i < n; i++) {
        if (v[i] > v[a]) { b = a; a = (int32_t)i; }
        else if (b < 0 || v[i] > v[b]) b = (int32_t)i;
    }
    if (gap) *gap = b >= 0 ? v[a] - v[b] : INFINITY;
    return a;
}

/* One-shot prefill logits of prompt k vs the golden top-16 and last row. */
static inline void gl_check_prefill(kvz_model *m, const gl_golden *g, uint32_t k, const float *logits, float abs_tol,
                             double rel_tol, const char *tag)
{
    const gl_prompt *q = &g->p[k];
    const uint32_t nv = g->nv;
    float max_abs = 0;
    int ok = 0, close = 0;
    for (uint32_t i = 0; i < q->n; i++) {
        const float *row = logits + (size_t)i * nv;
        for (int t = 0; t < GL_TOP; t++) {
            float d = fabsf(row[q->top_id[i * GL_TOP + t]] - q->top_logit[i * GL_TOP + t]);
            if (d > max_abs) max_abs = d;
        }
        if ((uint32_t)gl_argmax(row, nv, NULL) == q->top_id[i * GL_TOP]) ok++;
        else if (q->top_logit[i * GL_TOP] - q->top_logit[i * GL_TOP + 1] < 2 * abs_tol) close++;
    }
    double num = 0, den = 0;
    const float *last = logits + (size_t)(q->n - 1) * nv;
    for (uint32_t v = 0; v < nv; v++) {
        double d = (double)last[v] - q->last[v];
        num += d * d;
        den += (double)q->last[v] * q->last[v];
    }
    const double rel = sqrt(num / den);
    printf("%s prompt %u: %u tokens, max |dlogit| over top-16 = %.3g, last-position rel L2 = %.3g, "
           "argmax agree %d/%u (+%d near-ties)\n", tag, k, q->n, max_abs, rel, ok, q->n, close);
    CHECKF(max_abs <= abs_tol, "%s prompt %u max abs %g", tag, k, max_abs);
    CHECKF(rel <= rel_tol, "%s prompt %u rel %g", tag, k, rel);
    CHECK(ok + close == (int)q->n);
    (void)m;
}

static inline int gl_greedy(kvz_model *m, kvz_kv *kv, const gl_prompt *q, int32_t *out64)
{
    kvz_kv_truncate(kv, 0);
    kvz_tokens out = {0};
    kvz_gen_opts go = {.max_tokens = GL_GEN, .stop_on_eos = 0};
    kvz_sampler_init(&go.sampler, 0.0f, 1.0f, 1);
    int rc = kvz_generate(m, kv, q->ids, (int32_t)q->n, 0, &go, &out, NULL, NULL);
    for (int i = 0; i < GL_GEN; i++) out64[i] = i < (int)out.n ? out.ids[i] : -1;
    kvz_tokens_free(&out);
    return rc;
}

/* fp32 weights vs HF (tolerances: see the test files) */
static inline void gl_check_f32(kvz_model *m, const gl_golden *g, float abs_tol, double rel_tol)
{
    const uint32_t nv = g->nv;
    for (uint32_t k = 0; k < g->np; k++) {
        const gl_prompt *q = &g->p[k];
        const uint32_t n = q->n;
        float *logits = malloc(sizeof(float) * (size_t)n * nv);
        kvz_kv *kv;
        if (kvz_kv_create(m, n + GL_GEN, 0, &kv)) { CHECK(0); free(logits); return; }
        CHECK(kvz_forward(m, kv, q->ids, (int32_t)n, 0, logits, KVZ_FWD_LOGITS_ALL, NULL) == 0);
        gl_check_prefill(m, g, k, logits, abs_tol, rel_tol, "f32");
        int32_t gen[GL_GEN];
        CHECK(gl_greedy(m, kv, q, gen) == 0);
        int first = -1;
        for (int i = 0; i < GL_GEN; i++) if ((uint32_t)gen[i] != q->gen[i]) { first = i; break; }
        CHECKF(first < 0, "f32 prompt %u: greedy continuation differs from HF at step %d", k, first);
        /* prefill n-8, then decode 8 tokens one by one: same logits as one-shot */
        kvz_kv_truncate(kv, 0);
        CHECK(kvz_forward(m, kv, q->ids, (int32_t)n - 8, 0, NULL, KVZ_FWD_NO_LOGITS, NULL) == 0);
        float *step = malloc(sizeof(float) * nv), dmax = 0;
        for (uint32_t i = n - 8; i < n; i++) {
            CHECK(kvz_forward(m, kv, &q->ids[i], 1, (int32_t)i, step, KVZ_FWD_LOGITS_LAST, NULL) == 0);
            for (uint32_t v = 0; v < nv; v++) dmax = fmaxf(dmax, fabsf(step[v] - logits[(size_t)i * nv + v]));
        }
        printf("f32 prompt %u: prefill+decode vs one-shot max |dlogit| = %.3g\n", k, dmax);
        CHECKF(dmax <= 1e-3f, "prompt %u incremental decode differs by %g", k, dmax);
        free(step);
        kvz_kv_free(kv);
        free(logits);
    }
}

/* Quantized CPU path @p mq against HF and against the fp32 path @p mf. */
static inline void gl_check_quant(kvz_model *mq, kvz_model *mf, gl_golden *g, float abs_tol, double rel_tol,
                           float dec_tol, double dec_rel)
{
    const uint32_t nv = g->nv;
    for (uint32_t k = 0; k < g->np; k++) {
        gl_prompt *q = &g->p[k];
        const uint32_t n = q->n;
        float *logits = malloc(sizeof(float) * (size_t)n * nv);
        kvz_kv *kv, *kf;
        if (kvz_kv_create(mq, n + GL_GEN, 0, &kv)) { CHECK(0); free(logits); return; }
        if (kvz_kv_create(mf, n + GL_GEN, 0, &kf)) { CHECK(0); kvz_kv_free(kv); free(logits); return; }
        /* batched passes, dequantize + SGEMM route (KVZ_QGEMM=0) vs HF */
        setenv("KVZ_QGEMM", "0", 1);
        CHECK(kvz_forward(mq, kv, q->ids, (int32_t)n, 0, logits, KVZ_FWD_LOGITS_ALL, NULL) == 0);
        unsetenv("KVZ_QGEMM");
        gl_check_prefill(mq, g, k, logits, abs_tol, rel_tol, "quant-prefill sgemm");
        /* the default route, int8 GEMM (int8 activations like decode), vs the SGEMM
         * route: on the last 8 positions (those the decode check below measures) within
         * the decode tolerances; no argmax flip at a clear gap on any position; the
         * figures over all positions are printed (the first positions of a prompt,
         * with flat logits, have larger relative errors) */
        {
            float *l8 = malloc(sizeof(float) * (size_t)n * nv), pmax = 0, amax = 0;
            double prel = 0, arel = 0;
            int pflip = 0;
            kvz_kv_truncate(kv, 0);
            CHECK(l8 && kvz_forward(mq, kv, q->ids, (int32_t)n, 0, l8, KVZ_FWD_LOGITS_ALL, NULL) == 0);
            for (uint32_t i = 0; l8 && i < n; i++) {
                const float *ref = logits + (size_t)i * nv, *got = l8 + (size_t)i * nv;
                double num = 0, den = 0;
                float dm = 0;
                for (uint32_t v = 0; v < nv; v++) {
                    const float d = got[v] - ref[v];
                    dm = fmaxf(dm, fabsf(d));
                    num += (double)d * d;
                    den += (double)ref[v] * ref[v];
                }
                amax = fmaxf(amax, dm);
                arel = fmax(arel, sqrt(num / den));
                if (i + 8 >= n) {
                    pmax = fmaxf(pmax, dm);
                    prel = fmax(prel, sqrt(num / den));
                }
                float gap;
                if (gl_argmax(got, nv, NULL) != gl_argmax(ref, nv, &gap) && gap >= dec_tol) pflip++;
            }
            printf("quant prompt %u: int8 GEMM prefill vs SGEMM route: last 8 positions max |dlogit| = %.3g, "
                   "rel L2 <= %.3g; all %u positions %.3g, %.3g; argmax flips at a clear gap %d\n", k, pmax, prel,
                   n, amax, arel, pflip);
            CHECKF(pmax <= dec_tol, "quant prompt %u: int8 prefill max |dlogit| %g > %g", k, pmax, dec_tol);
            CHECKF(prel <= dec_rel, "quant prompt %u: int8 prefill rel L2 %g > %g", k, prel, dec_rel);
            CHECK(pflip == 0);
            free(l8);
        }
        /* int8 decode steps vs the one-shot logits (same quantized weights, fp32 math) */
        kvz_kv_truncate(kv, 0);
        CHECK(kvz_forward(mq, kv, q->ids, (int32_t)n - 8, 0, NULL, KVZ_FWD_NO_LOGITS, NULL) == 0);
        float *step = malloc(sizeof(float) * nv), dmax = 0;
        double rmax = 0;
        int am_bad = 0;
        for (uint32_t i = n - 8; i < n; i++) {
            CHECK(kvz_forward(mq, kv, &q->ids[i], 1, (int32_t)i, step, KVZ_FWD_LOGITS_LAST, NULL) == 0);
            const float *ref = logits + (size_t)i * nv;
            double num = 0, den = 0;
            for (uint32_t v = 0; v < nv; v++) {
                const float d = step[v] - ref[v];
                dmax = fmaxf(dmax, fabsf(d));
                num += (double)d * d;
                den += (double)ref[v] * ref[v];
            }
            rmax = fmax(rmax, sqrt(num / den));
            float gap;
            const int32_t a = gl_argmax(ref, nv, &gap);
            if (gl_argmax(step, nv, NULL) != a && gap >= dec_tol) am_bad++;
        }
        printf("quant prompt %u: int8 decode vs fp32 one-shot: max |dlogit| = %.3g, rel L2 <= %.3g\n", k, dmax,
               rmax);
        CHECKF(dmax <= dec_tol, "quant prompt %u: decode max |dlogit| %g > %g", k, dmax, dec_tol);
        CHECKF(rmax <= dec_rel, "quant prompt %u: decode rel L2 %g > %g", k, rmax, dec_rel);
        CHECKF(am_bad == 0, "quant prompt %u: %d decode argmax flips at a clear gap", k, am_bad);
        /* greedy: equal to HF up to the first divergence, which must be a near-tie */
        int32_t gen[GL_GEN];
        CHECK(gl_greedy(mq, kv, q, gen) == 0);
        int first = -1;
        for (int i = 0; i < GL_GEN; i++) if ((uint32_t)gen[i] != q->gen[i]) { first = i; break; }
        if (first < 0) {
            printf("quant prompt %u: greedy continuation identical to HF (64 tokens)\n", k);
            CHECK(1);
        } else {
            /* fp32 logits at that step, teacher-forced on HF's continuation */
            for (int i = 0; i < first; i++) q->ids[n + i] = (int32_t)q->gen[i];
            kvz_kv_truncate(kf, 0);
            CHECK(kvz_forward(mf, kf, q->ids, (int32_t)n + first, 0, step, KVZ_FWD_LOGITS_LAST, NULL) == 0);
            float gap;
            const int32_t a = gl_argmax(step, nv, &gap);
            printf("quant prompt %u: greedy equal to HF for %d of 64 tokens; at step %d HF picks %u, int8 "
                   "picks %d; fp32 top-2 gap there = %.4g (fp32 argmax %d)\n", k, first, first, q->gen[first],
                   gen[first], gap, a);
            CHECKF(gap < dec_tol, "quant prompt %u: greedy diverges at step %d where the fp32 gap %g is clear",
                   k, first, gap);
        }
        free(step);
        kvz_kv_free(kv);
        kvz_kv_free(kf);
        free(logits);
    }
}

#endif
