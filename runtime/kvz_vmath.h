/**
 * @file kvz_vmath.h
 * @brief Branch-free fp32 exp and softmax helpers that GCC/Clang auto-vectorize
 *        (AVX2 at -O3 -march=x86-64-v3). Relative error of kvz_expf: < 2e-7 on
 *        [-87, 88] (Cephes polynomial); below -87.3 it returns exactly 0, so a
 *        masked logit of -INFINITY or any x < -87.3 contributes nothing.
 */
#ifndef KVZ_VMATH_H
#define KVZ_VMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float kvz_expf(float x)
{
    const float lo = -87.3f, hi = 88.7f;
    const int under = !(x >= lo); /* also true for NaN-free -inf */
    float xc = x < lo ? lo : (x > hi ? hi : x);
    /* round to nearest by the 1.5*2^23 trick: vectorizes, unlike roundf */
    const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    const float y = p * scale;
    return under ? 0.0f : y;
}

/* x[i] = exp(x[i] - shift); returns the sum (fp32 accumulation in 8 lanes). */
static inline float kvz_exp_sub_sum(float *x, int64_t n, float shift)
{
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) {
            const float e = kvz_expf(x[i + k] - shift);
            x[i + k] = e;
            acc[k] += e;
        }
    float s = 0.0f;
    for (; i < n; i++) {
        const float e = kvz_expf(x[i] - shift);
        x[i] = e;
        s += e;
    }
    for (int k = 0; k < 8; k++) s += acc[k];
    return s;
}

static inline float kvz_max(const float *x, int64_t n)
{
    float m[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) m[k] = x[i + k] > m[k] ? x[i + k] : m[k];
    float r = -INFINITY;
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    for (int k = 0; k < 8; k++) r = m[k] > r ? m[k] : r;
    return r;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* kvz_expf on 8 lanes (the same reduction and polynomial, FMA-contracted); lanes
 * below -87.3 give exactly 0. Compiled for AVX2+FMA whatever the build targets, so the
 * run-time dispatched kernels (kvz_attn.c's flash tiles) use it too. */
__attribute__((target("avx2,fma"))) static inline __m256 kvz_expf8(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.7f), big = _mm256_set1_ps(12582912.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_NGE_UQ);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), big), big);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

/* h = silu(g) * u elementwise (SwiGLU). GCC keeps the kvz_expf loop scalar
 * ("control flow in loop"): 8 % of a 512-token SmolLM2 prefill (perf), hence the
 * explicit 8-lane loop where the build targets AVX2. */
static inline void kvz_swiglu(float *restrict h, const float *restrict g, const float *restrict u, int64_t n)
{
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 d = _mm256_add_ps(one, kvz_expf8(_mm256_sub_ps(zero, gv)));
        _mm256_storeu_ps(h + j, _mm256_mul_ps(_mm256_div_ps(gv, d), _mm256_loadu_ps(u + j)));
    }
#endif
    for (; j < n; j++) h[j] = g[j] / (1.0f + kvz_expf(-g[j])) * u[j];
}

static inline void kvz_scale(float *x, int64_t n, float s)
{
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

#endif
