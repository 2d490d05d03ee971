/* kvz_qgemm: the int8 GEMM of quantized weight rows with n activation rows, for
 * every type it handles, against (a) the per-row dot product kvz_qdot (scalar
 * reference ISA) on the same quantized activations and (b) an independent float64
 * truth: the weights dequantized by kvz_dequantize times the activations
 * dequantized from their int8 blocks.
 *
 * Random quant bytes, fp16 scales from subnormal to 6e4, zero and negative
 * scales, activation blocks spanning 1e-6..1e3 with outliers and all-zero blocks.
 * Odd shapes: n = 1, 3, 4, 5, 17 tokens; 1, 5, 8, 13, 37 rows (tiles of 8 rows with
 * a partial last tile); 1 and 3 weight blocks per row; results written into a
 * wider output (ldy > rows) whose other columns must stay untouched; then the
 * same product accumulated onto existing values. k up to 37 blocks, so that the
 * GEMM's k chunks (1024 elements) are crossed.
 *
 * Tolerance: both sides accumulate in fp32 over k/32 blocks in different orders,
 * so |gemm - qdot| <= 4e-6 · Σ|w_e·a_e| · sqrt(k/32) + 1e-30, and against the
 * float64 truth 2e-6 · Σ|w·a| · sqrt(k/32) + 1e-30 as in test_qdot. A wrong nibble,
 * scale, offset or row/token mix-up moves a result by ~Σ|w·a|/k or more. */
#include <math.h>
#include <stdint.h>

#include "kvz_qdot.h"
#include "kvz_qgemm.h"
#include "kvz_quant.h"
#include "kvz_test.h"

static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static uint32_t rnd(void)
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float rndu(void) { return (float)(rnd() & 0xffffff) / 16777216.0f; }

static uint16_t rnd_scale(void)
{
    float v;
    switch (rnd() % 8) {
    case 0: v = 0.0f; break;
    case 1: v = 6.0e4f * rndu(); break;           /* near the fp16 maximum */
    case 2: v = 1.0e-7f * (1.0f + rndu()); break; /* fp16 subnormal */
    case 3: v = -0.05f * rndu(); break;           /* negative */
    default: v = 0.001f + 0.05f * rndu(); break;
    }
    return kvz_fp32_to_fp16(v);
}
static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

static void fill_blocks(uint32_t t, uint8_t *w, int64_t nbytes)
{
    for (int64_t i = 0; i < nbytes; i++) w[i] = (uint8_t)rnd();
    const int64_t bb = kvz_type_block_bytes(t);
    for (uint8_t *x = w; x < w + nbytes; x += bb) {
        switch (t) {
        case KVZ_TYPE_Q4_0: case KVZ_TYPE_Q5_0: case KVZ_TYPE_Q8_0: put16(x, rnd_scale()); break;
        case KVZ_TYPE_Q4_1: case KVZ_TYPE_Q5_1: case KVZ_TYPE_Q4_K: case KVZ_TYPE_Q5_K:
            put16(x, rnd_scale()); put16(x + 2, rnd_scale()); break;
        case KVZ_TYPE_Q6_K: put16(x + 208, rnd_scale()); break;
        }
    }
}

static void fill_act(float *x, int64_t n)
{
    for (int64_t b = 0; b < n / 32; b++) {
        const int kind = (int)(rnd() % 6);
        const float mag = kind == 0 ? 0.0f : kind == 1 ? 1e3f : kind == 2 ? 1e-6f : 1.0f;
        for (int i = 0; i < 32; i++) x[32 * b + i] = mag * (2.0f * rndu() - 1.0f);
        if (kind == 3) x[32 * b + rnd() % 32] = 50.0f;
    }
}

static const uint32_t TYPES[] = {KVZ_TYPE_Q8_0, KVZ_TYPE_Q4_0, KVZ_TYPE_Q4_1, KVZ_TYPE_Q5_0,
                                 KVZ_TYPE_Q5_1, KVZ_TYPE_Q4_K, KVZ_TYPE_Q5_K, KVZ_TYPE_Q6_K};
static const int NS[] = {1, 3, 4, 5, 17};
static const int NRS[] = {1, 5, 8, 13, 37};

#define SENTINEL 12345.0f

static void test_type(uint32_t t)
{
    const int64_t be = kvz_type_block_elems(t);
    int fails = 0, cases = 0;
    double worst_q = 0, worst_t = 0;
    for (size_t ni = 0; ni < sizeof NS / sizeof NS[0]; ni++)
        for (size_t ri = 0; ri < sizeof NRS / sizeof NRS[0]; ri++)
            for (int kb = 1; kb <= 37; kb += kb == 1 ? 2 : 34) { /* 37 blocks: more than one k chunk */
                const int n = NS[ni], nr = NRS[ri];
                const int64_t k = be * kb, ldy = nr + 3;
                const size_t rb = (size_t)kvz_type_nbytes(t, k);
                uint8_t *w = malloc(rb * (size_t)nr);
                float *x = malloc(sizeof(float) * (size_t)(n * k)), *wf = malloc(sizeof(float) * (size_t)k);
                uint8_t *act = malloc(kvz_qgemm_act_bytes(n, k)), *q8 = malloc(kvz_q8_row_bytes(k));
                void *panel = malloc(kvz_qgemm_panel_bytes(k));
                float *y = malloc(sizeof(float) * (size_t)(n * ldy)), *y0 = malloc(sizeof(float) * (size_t)(n * ldy));
                fill_blocks(t, w, (int64_t)rb * nr);
                fill_act(x, n * k);
                /* in two calls, as threads would split it */
                kvz_qgemm_quantize(x, n, k, 0, n / 2, act);
                kvz_qgemm_quantize(x, n, k, n / 2, n, act);
                CHECK(nr <= kvz_qgemm_panel_rows(k));
                for (int i = 0; i < n * ldy; i++) y[i] = SENTINEL;
                kvz_qgemm_rows(t, w, rb, nr, k, act, n, y, ldy, 0, panel);
                /* accumulate onto y/4 (exact): must give fl(y/4 + y) */
                for (int i = 0; i < n * ldy; i++) y0[i] = y[i] == SENTINEL ? SENTINEL : 0.25f * y[i];
                kvz_qgemm_rows(t, w, rb, nr, k, act, n, y0, ldy, 1, panel);
                for (int tk = 0; tk < n; tk++) {
                    kvz_q8_quantize(x + (size_t)tk * k, k, q8); /* what kvz_qdot would see */
                    for (int r = 0; r < nr; r++) {
                        const uint8_t *row = w + (size_t)r * rb;
                        if (kvz_dequantize(t, row, wf, k) != 0) { CHECK(0); continue; }
                        double truth = 0, mag = 0;
                        for (int64_t e = 0; e < k; e++) {
                            float d;
                            memcpy(&d, q8 + k + 4 * (e / 32), 4);
                            const double a = (double)((const int8_t *)q8)[e] * d;
                            truth += (double)wf[e] * a;
                            mag += fabs((double)wf[e] * a);
                        }
                        const float ref = kvz_qdot_isa(KVZ_ISA_SCALAR, t, row, q8, k);
                        const float got = y[(size_t)tk * ldy + r], acc = y0[(size_t)tk * ldy + r];
                        const double sq = sqrt((double)k / 32);
                        const double tq = 4e-6 * mag * sq + 1e-30, tt = 2e-6 * mag * sq + 1e-30;
                        const double e1 = fabs((double)got - ref), e3 = fabs((double)got - truth);
                        /* accumulated: y/4 + the product, within the product's tolerance and the
                         * rounding of the additions (over k chunks the partial sums add onto y/4) */
                        const double e2 = fabs((double)acc - 0.25 * (double)got - ref);
                        if (!(e1 <= tq) || !(e3 <= tt) || !(e2 <= tq + ldexp(1.25 * fabs((double)got), -22))) {
                            if (fails++ < 3)
                                fprintf(stderr, "%s n=%d rows=%d k=%lld token %d row %d: gemm %.9g, accumulated onto "
                                        "gemm/4: %.9g, qdot %.9g, truth %.9g (tol %.3g)\n", kvz_type_name(t), n, nr,
                                        (long long)k, tk, r, got, acc, ref, truth, tq);
                        }
                        if (mag > 0) {
                            worst_q = fmax(worst_q, e1 / mag);
                            worst_t = fmax(worst_t, e3 / mag);
                        }
                    }
                    for (int r = nr; r < ldy; r++)
                        if ((y[(size_t)tk * ldy + r] != SENTINEL || y0[(size_t)tk * ldy + r] != SENTINEL) && fails++ < 3)
                            fprintf(stderr, "%s: column %d outside the rows was written\n", kvz_type_name(t), r);
                }
                cases++;
                free(w); free(x); free(wf); free(act); free(q8); free(panel); free(y); free(y0);
            }
    printf("%-5s %d shapes, worst |gemm-qdot|/sum|w*a| = %.2g, |gemm-truth|/sum|w*a| = %.2g\n", kvz_type_name(t), cases,
           worst_q, worst_t);
    CHECKF(fails == 0, "%s: %d results out of tolerance", kvz_type_name(t), fails);
}

int main(void)
{
    printf("qgemm: %s (qdot ISA %s)\n", kvz_qgemm_available() ? "AVX2 microkernel" : "per-row qdot fallback",
           kvz_isa_name(kvz_qdot_active_isa()));
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++) {
        CHECK(kvz_qgemm_supported(TYPES[i]));
        test_type(TYPES[i]);
    }
    CHECK(!kvz_qgemm_supported(KVZ_TYPE_F32) && !kvz_qgemm_supported(KVZ_TYPE_Q2_K));
    int pbad = 0;
    for (int64_t k = 32; k <= 20000; k += 32)
        if (kvz_qgemm_panel_rows(k) < 8 || kvz_qgemm_panel_rows(k) % 8 || kvz_qgemm_panel_bytes(k) > KVZ_QGEMM_PANEL_MAX_BYTES)
            pbad++;
    CHECKF(pbad == 0, "%d widths with a bad panel size", pbad);
    return kvz_test_summary();
}
