/* kvz_qdot: quantized weight row · 8-bit activation row, for every supported type
 * and every ISA this CPU has, on random blocks (random quant bytes, random fp16
 * scales from subnormal to 6e4, zero scales, activation rows spanning 1e-6..1e3
 * and all-zero blocks).
 *
 * Truth is independent of the code under test: the weight row dequantized by
 * kvz_dequantize (tests/fast/test_quant.c checks it against gguf-py) times the
 * activation row dequantized from its int8 blocks (q·d), summed in double.
 * Tolerance: every implementation accumulates in fp32, so we accept
 * |got - truth| <= 2e-6 · Σ|w_e·a_e| · sqrt(n/32) + 1e-30 (fp32 rounding of
 * n/32 partial sums of that magnitude); a wrong nibble, scale or offset moves the
 * result by ~Σ|w·a|/n or more. The activation quantizer is checked separately:
 * |x - q·d| <= d/2 (+1 ulp) and d = max|x|/127 per block. */
#include <stdint.h>

#include "kvz_qdot.h"
#include "kvz_quant.h"
#include "kvz_test.h"

static uint64_t rng = 0x1234567887654321ULL;
static uint32_t rnd(void)
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float rndu(void) { return (float)(rnd() & 0xffffff) / 16777216.0f; }

/* an fp16 scale: mostly ordinary, sometimes extreme (tiny/subnormal, huge, zero, negative) */
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

/* random bytes, then valid fp16 scale fields for the type */
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
        if (kind == 3) x[32 * b + rnd() % 32] = 50.0f; /* one outlier */
    }
}

static const uint32_t TYPES[] = {KVZ_TYPE_Q8_0, KVZ_TYPE_Q4_0, KVZ_TYPE_Q4_1, KVZ_TYPE_Q5_0,
                                 KVZ_TYPE_Q5_1, KVZ_TYPE_Q4_K, KVZ_TYPE_Q5_K, KVZ_TYPE_Q6_K};

typedef void (*quantize_fn)(const float *, int64_t, void *);

static void test_quantize_fn(quantize_fn fn, const char *name, const float *x, int N, uint8_t *buf)
{
    fn(x, N, buf);
    const int8_t *q = (const int8_t *)buf;
    int bad = 0;
    for (int b = 0; b < N / 32; b++) {
        float amax = 0, db;
        int s0 = 0, s1 = 0;
        memcpy(&db, buf + N + 4 * b, 4);
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[32 * b + i]));
        if (fabsf(db - amax / 127.0f) > 1e-7f * amax) bad++;
        for (int i = 0; i < 32; i++) {
            const float err = fabsf(x[32 * b + i] - (float)q[32 * b + i] * db);
            if (err > 0.5f * db * (1.0f + 1e-5f) + 1e-30f || q[32 * b + i] == -128) bad++;
            *(i < 16 ? &s0 : &s1) += q[32 * b + i];
        }
        int16_t h[2];
        memcpy(h, buf + N + 4 * (N / 32) + 4 * b, 4);
        if (h[0] != s0 || h[1] != s1) bad++;
    }
    CHECKF(bad == 0, "%s: %d activation quantization errors", name, bad);
}

/* The dispatched quantizer (AVX2 where the CPU has it) and the scalar reference both
 * meet the bounds, and write the same bytes (decode and prefill quantize with the
 * dispatched one, the tests' truths with either). Block 0 holds exact .5 ties
 * (d = 1: round half to even), block 1 is all zeros, block 2 has -0.0 and a single
 * negative maximum. */
static void test_quantize(void)
{
    enum { N = 32 * 67 };
    static float x[N];
    fill_act(x, N);
    for (int i = 0; i < 32; i++) x[i] = i == 0 ? 127.0f : (float)(i - 16) + 0.5f;
    for (int i = 0; i < 32; i++) x[32 + i] = 0.0f;
    for (int i = 0; i < 32; i++) x[64 + i] = i == 5 ? -3.0f : i == 6 ? -0.0f : 0.01f * (float)i;
    uint8_t *a = malloc(kvz_q8_row_bytes(N)), *r = malloc(kvz_q8_row_bytes(N));
    test_quantize_fn(kvz_q8_quantize, "dispatched", x, N, a);
    test_quantize_fn(kvz_q8_quantize_ref, "scalar", x, N, r);
    CHECKF(memcmp(a, r, kvz_q8_row_bytes(N)) == 0, "dispatched (%s) and scalar quantizer bytes differ",
           kvz_isa_name(kvz_qdot_active_isa()));
    CHECKF(((const int8_t *)r)[1] == -14 && ((const int8_t *)r)[2] == -14 && ((const int8_t *)r)[31] == 16,
           "ties: got %d %d %d, want -14 -14 16 (half to even)", ((const int8_t *)r)[1], ((const int8_t *)r)[2],
           ((const int8_t *)r)[31]);
    free(a);
    free(r);
}

static void test_type(uint32_t t)
{
    const int64_t be = kvz_type_block_elems(t);
    const int cpu = kvz_qdot_cpu_isa();
    int worst_isa = -1;
    double worst = 0;
    int fails[3] = {0, 0, 0}, runs = 0;
    for (int trial = 0; trial < 300; trial++) {
        /* 1..7 weight blocks: odd counts of 32-element blocks exercise the SIMD tails */
        const int64_t n = be * (1 + (int64_t)(rnd() % 7));
        const int64_t nbytes = kvz_type_nbytes(t, n);
        uint8_t *w = malloc((size_t)nbytes);
        float *x = malloc(sizeof(float) * (size_t)n), *wf = malloc(sizeof(float) * (size_t)n);
        uint8_t *q8 = malloc(kvz_q8_row_bytes(n));
        fill_blocks(t, w, nbytes);
        fill_act(x, n);
        kvz_q8_quantize(x, n, q8);
        if (kvz_dequantize(t, w, wf, n) != 0) { CHECK(0); break; }
        double truth = 0, mag = 0;
        for (int64_t i = 0; i < n; i++) {
            float d;
            memcpy(&d, q8 + n + 4 * (i / 32), 4);
            const double a = (double)((const int8_t *)q8)[i] * d;
            truth += (double)wf[i] * a;
            mag += fabs((double)wf[i] * a);
        }
        const double tol = 2e-6 * mag * sqrt((double)n / 32) + 1e-30;
        for (int isa = KVZ_ISA_SCALAR; isa <= cpu; isa++) {
            const float got = kvz_qdot_isa(isa, t, w, q8, n);
            const double err = fabs((double)got - truth);
            if (!(err <= tol)) {
                if (fails[isa]++ < 3)
                    fprintf(stderr, "%s %s n=%lld: got %.9g truth %.9g (|err| %.3g > tol %.3g)\n",
                            kvz_type_name(t), kvz_isa_name(isa), (long long)n, got, truth, err, tol);
            }
            if (mag > 0 && err / mag > worst) { worst = err / mag; worst_isa = isa; }
        }
        runs++;
        free(w); free(x); free(wf); free(q8);
    }
    printf("%-5s %d rows, ISAs scalar..%s, worst |err|/sum|w*a| = %.2g (%s)\n", kvz_type_name(t), runs,
           kvz_isa_name(cpu), worst, worst_isa >= 0 ? kvz_isa_name(worst_isa) : "-");
    for (int isa = 0; isa <= cpu; isa++)
        CHECKF(fails[isa] == 0, "%s: %d of %d rows out of tolerance on %s", kvz_type_name(t), fails[isa], runs,
               kvz_isa_name(isa));
}

int main(void)
{
    printf("qdot: CPU ISA %s, active %s\n", kvz_isa_name(kvz_qdot_cpu_isa()), kvz_isa_name(kvz_qdot_active_isa()));
    test_quantize();
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++) {
        CHECK(kvz_qdot_supported(TYPES[i]));
        test_type(TYPES[i]);
    }
    CHECK(!kvz_qdot_supported(KVZ_TYPE_F32) && !kvz_qdot_supported(KVZ_TYPE_Q2_K));
    CHECK(isnan(kvz_qdot_isa(KVZ_ISA_SCALAR, KVZ_TYPE_Q4_K, NULL, NULL, 32))); /* n not a block multiple */
    return kvz_test_summary();
}
