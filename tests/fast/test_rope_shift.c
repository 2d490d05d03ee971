/* kvz_rope_shift_rows against a direct float64 RoPE, on both layouts (adjacent
 * pairs = llama, half-split = qwen2/qwen3) and with scaled frequencies (as a GGUF
 * rope_freqs.weight gives): rotating a key stored at position p by Δ must equal the
 * key computed at p + Δ; the same check with Δ ± 1 must fail by orders of magnitude. */
#include "kvz_test.h"

#include <math.h>
#include <stdint.h>

#include "kvz_rope_shift.h"

#define HD 64

static void rope_f64(const double *x, double *y, int hd, int64_t pos, const float *inv_freq, int adjacent)
{
    const int half = hd / 2;
    for (int i = 0; i < hd; i++) y[i] = x[i];
    for (int j = 0; j < half; j++) {
        const double a = (double)pos * (double)inv_freq[j], c = cos(a), s = sin(a);
        const int i0 = adjacent ? 2 * j : j, i1 = adjacent ? 2 * j + 1 : j + half;
        y[i0] = x[i0] * c - x[i1] * s;
        y[i1] = x[i0] * s + x[i1] * c;
    }
}

static uint64_t rng = 88172645463325252ull;
static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

/* max |shift(rope(x, p), delta + err) - rope(x, p + delta)| over a few random rows */
static double shift_error(const float *inv_freq, int adjacent, int64_t p, int32_t delta, int32_t err)
{
    double worst = 0;
    for (int r = 0; r < 8; r++) {
        double x[HD], a[HD], b[HD];
        float k[HD];
        for (int i = 0; i < HD; i++) x[i] = 3.0 * urand();
        rope_f64(x, a, HD, p, inv_freq, adjacent);
        for (int i = 0; i < HD; i++) k[i] = (float)a[i];
        kvz_rope_shift_rows(k, 1, HD, inv_freq, adjacent, delta + err);
        rope_f64(x, b, HD, p + delta, inv_freq, adjacent);
        for (int i = 0; i < HD; i++) {
            const double d = fabs((double)k[i] - b[i]);
            if (d > worst) worst = d;
        }
    }
    return worst;
}

int main(void)
{
    float plain[HD / 2], scaled[HD / 2];
    for (int j = 0; j < HD / 2; j++) {
        plain[j] = (float)pow(10000.0, -2.0 * j / HD);
        /* llama-3 style: low frequencies divided by a factor up to 8 */
        scaled[j] = plain[j] / (float)(1.0 + 7.0 * j / (HD / 2 - 1));
    }
    const float *freqs[2] = {plain, scaled};
    const int64_t ps[] = {0, 7, 371, 5399};
    const int32_t ds[] = {1, 42, 5398, 16000, -5};
    for (int f = 0; f < 2; f++)
        for (int adjacent = 0; adjacent < 2; adjacent++)
            for (size_t i = 0; i < sizeof ps / sizeof *ps; i++)
                for (size_t j = 0; j < sizeof ds / sizeof *ds; j++) {
                    const double e0 = shift_error(freqs[f], adjacent, ps[i], ds[j], 0);
                    const double ep = shift_error(freqs[f], adjacent, ps[i], ds[j], 1);
                    const double em = shift_error(freqs[f], adjacent, ps[i], ds[j], -1);
                    CHECKF(e0 < 1e-5, "%s %s p=%lld delta=%d: error %g", f ? "scaled" : "plain",
                           adjacent ? "adjacent" : "half", (long long)ps[i], ds[j], e0);
                    CHECKF(ep > 1e3 * e0 && em > 1e3 * e0 && ep > 1e-2 && em > 1e-2,
                           "off-by-one not detected: exact %g, +1 %g, -1 %g", e0, ep, em);
                    if (i == 3 && j == 3)
                        printf("%s freqs, %s pairs, p=%lld delta=%d: |err| %.2e (delta+1: %.2e, delta-1: %.2e)\n",
                               f ? "scaled" : "plain", adjacent ? "adjacent" : "half-split",
                               (long long)ps[i], ds[j], e0, ep, em);
                }
    /* delta 0 and n 0 leave the rows untouched */
    float k[HD], k0[HD];
    for (int i = 0; i < HD; i++) k[i] = k0[i] = (float)urand();
    kvz_rope_shift_rows(k, 1, HD, plain, 1, 0);
    kvz_rope_shift_rows(k, 0, HD, plain, 1, 99);
    CHECK(!memcmp(k, k0, sizeof k));
    /* the two layouts are different rotations */
    float a[HD], b[HD];
    memcpy(a, k0, sizeof a);
    memcpy(b, k0, sizeof b);
    kvz_rope_shift_rows(a, 1, HD, plain, 1, 3);
    kvz_rope_shift_rows(b, 1, HD, plain, 0, 3);
    CHECK(memcmp(a, b, sizeof a) != 0);
    /* the angle table the device re-rotation applies (kvz_rope_shift_angles) holds the
     * numbers kvz_rope_shift_rows uses: rotating by hand with it agrees to fp32 rounding */
    for (int adjacent = 0; adjacent < 2; adjacent++) {
        float cs[HD / 2], sn[HD / 2], x[HD], y[HD];
        kvz_rope_shift_angles(scaled, HD / 2, 12345, cs, sn);
        for (int i = 0; i < HD; i++) x[i] = y[i] = (float)urand();
        kvz_rope_shift_rows(x, 1, HD, scaled, adjacent, 12345);
        for (int j = 0; j < HD / 2; j++) {
            const int i0 = adjacent ? 2 * j : j, i1 = adjacent ? 2 * j + 1 : j + HD / 2;
            const float a0 = y[i0], b0 = y[i1];
            volatile float t0 = a0 * cs[j], t1 = b0 * sn[j], t2 = a0 * sn[j], t3 = b0 * cs[j];
            y[i0] = t0 - t1;
            y[i1] = t2 + t3;
        }
        double worst = 0;
        for (int i = 0; i < HD; i++) worst = fmax(worst, fabs((double)x[i] - y[i]));
        CHECKF(worst < 1e-6, "%s: the angle table differs from the rotation (%g)", adjacent ? "adjacent" : "half", worst);
    }
    return kvz_test_summary();
}
