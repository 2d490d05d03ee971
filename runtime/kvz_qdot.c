/* Quantized weight rows · 8-bit activations (see kvz_qdot.h).
 *
 * Activation row layout (kvz_q8_row_bytes(n) bytes): int8 q[n] | f32 d[n/32] |
 * i16 s[n/16] (sum of q over each 16-element half block), read with memcpy/loadu
 * so no alignment is needed.
 *
 * Every weight block is reduced to the same form per 32-element activation block
 * b and half h (elements 16h..16h+15 of the block):
 *     w_e = A_h · u_e + B_h            (u_e the raw quant, A_h, B_h fp32)
 *     dot_b = d_b · Σ_h (A_h · Σ_e u_e q_e + B_h · s_h)
 * The scalar reference evaluates exactly that. The SIMD paths compute Σ u_e q_e
 * with maddubs (u unsigned bytes × q signed bytes; Q8_0, and Q4_0 / Q5_0 as the
 * signed u - 8 / u - 16, by the sign trick), fold
 * the integer sub-block scale in with madd, and accumulate fs · int in fp32; the
 * offset terms B_h · s_h are summed in a scalar. */
#include "kvz_qdot.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_quant.h"

/* The SIMD paths carry their own target options (they do not depend on the
 * build's -march): the run-time check decides whether they run. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVZ_QDOT_X86 1
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------------ */
/* activations                                                              */

size_t kvz_q8_row_bytes(int64_t n) { return (size_t)n + (size_t)(n / 32) * 4 + (size_t)(n / 16) * 2; }

#ifdef KVZ_QDOT_X86
/* The same arithmetic as the scalar loop below, 8 lanes at a time: |x| max (no NaN
 * in activations, so max == fmaxf), one scalar division for d and 1/d, round to
 * nearest even (nearbyintf in the default rounding mode), clamp, integer half sums:
 * the bytes written are identical (tests/fast/test_qdot.c checks it). The scalar
 * loop compiled to a libm fmaxf call per element: 7-11 % of a prefill. */
__attribute__((target("avx2,fma"))) static void q8_quantize_avx2(const float *x, int64_t n, void *dst)
{
    int8_t *q = dst;
    uint8_t *dp = (uint8_t *)dst + n, *sp = dp + (n / 32) * 4;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(xb + 8 * j);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i iv[4];
        for (int j = 0; j < 4; j++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
            iv[j] = _mm256_cvtps_epi32(r);
        }
        /* int32 -> int8 in element order: packs work per 128-bit lane */
        const __m256i p01 = _mm256_packs_epi32(iv[0], iv[1]), p23 = _mm256_packs_epi32(iv[2], iv[3]);
        __m256i p8 = _mm256_packs_epi16(p01, p23);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), p8);
        int32_t h[2];
        for (int k = 0; k < 2; k++) {
            const __m256i s8 = _mm256_add_epi32(iv[2 * k], iv[2 * k + 1]);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            h[k] = _mm_cvtsi128_si32(s4);
        }
        memcpy(dp + 4 * b, &d, 4);
        for (int k = 0; k < 2; k++) {
            int16_t s16 = (int16_t)h[k];
            memcpy(sp + 4 * b + 2 * k, &s16, 2);
        }
    }
}
#endif

void kvz_q8_quantize(const float *x, int64_t n, void *dst)
{
#ifdef KVZ_QDOT_X86
    static int isa = -1;
    if (isa < 0) isa = kvz_qdot_active_isa();
    if (isa >= KVZ_ISA_AVX2) {
        q8_quantize_avx2(x, n, dst);
        return;
    }
#endif
    kvz_q8_quantize_ref(x, n, dst);
}

void kvz_q8_quantize_ref(const float *x, int64_t n, void *dst)
{
    int8_t *q = dst;
    uint8_t *dp = (uint8_t *)dst + n, *sp = dp + (n / 32) * 4;
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int s[2] = {0, 0};
        for (int i = 0; i < 32; i++) {
            float v = nearbyintf(xb[i] * id);
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            q[32 * b + i] = (int8_t)v;
            s[i >> 4] += (int)v;
        }
        memcpy(dp + 4 * b, &d, 4);
        for (int h = 0; h < 2; h++) {
            int16_t s16 = (int16_t)s[h];
            memcpy(sp + 4 * b + 2 * h, &s16, 2);
        }
    }
}

typedef struct q8v {
    const int8_t *q;
    const uint8_t *d, *s; /* f32 / i16 arrays, unaligned */
} q8v;

static inline q8v q8_view(const void *p, int64_t n)
{
    q8v v = {p, (const uint8_t *)p + n, (const uint8_t *)p + n + (n / 32) * 4};
    return v;
}
static inline float q8_d(const q8v *a, int64_t b) { float d; memcpy(&d, a->d + 4 * b, 4); return d; }
static inline int q8_s(const q8v *a, int64_t b, int h) { int16_t s; memcpy(&s, a->s + 4 * b + 2 * h, 2); return s; }

/* ------------------------------------------------------------------------ */
/* weight types                                                             */

static int64_t wblock_elems(uint32_t t) { return t == KVZ_TYPE_Q4_K || t == KVZ_TYPE_Q5_K || t == KVZ_TYPE_Q6_K ? 256 : 32; }

int kvz_qdot_supported(uint32_t t)
{
    switch (t) {
    case KVZ_TYPE_Q4_0: case KVZ_TYPE_Q4_1: case KVZ_TYPE_Q5_0: case KVZ_TYPE_Q5_1:
    case KVZ_TYPE_Q8_0: case KVZ_TYPE_Q4_K: case KVZ_TYPE_Q5_K: case KVZ_TYPE_Q6_K: return 1;
    default: return 0;
    }
}

/* ------------------------------------------------------------------------ */
/* scalar reference: raw quants u[32] and (A, B) per half of activation block b */

static void ref_block(uint32_t t, const uint8_t *w, int64_t b, int u[32], float A[2], float B[2])
{
    switch (t) {
    case KVZ_TYPE_Q8_0: {
        const uint8_t *x = w + 34 * b;
        for (int i = 0; i < 32; i++) u[i] = (int8_t)x[2 + i];
        A[0] = A[1] = kvz_quant_f16(x);
        B[0] = B[1] = 0.0f;
        break;
    }
    case KVZ_TYPE_Q4_0: case KVZ_TYPE_Q4_1: {
        const int o = t == KVZ_TYPE_Q4_0 ? 2 : 4;
        const uint8_t *x = w + (t == KVZ_TYPE_Q4_0 ? 18 : 20) * b;
        for (int i = 0; i < 16; i++) { u[i] = x[o + i] & 15; u[i + 16] = x[o + i] >> 4; }
        A[0] = A[1] = kvz_quant_f16(x);
        B[0] = B[1] = t == KVZ_TYPE_Q4_0 ? -8.0f * kvz_quant_f16(x) : kvz_quant_f16(x + 2);
        break;
    }
    case KVZ_TYPE_Q5_0: case KVZ_TYPE_Q5_1: {
        const int o = t == KVZ_TYPE_Q5_0 ? 2 : 4;
        const uint8_t *x = w + (t == KVZ_TYPE_Q5_0 ? 22 : 24) * b;
        uint32_t qh;
        memcpy(&qh, x + o, 4);
        for (int i = 0; i < 16; i++) {
            u[i] = (x[o + 4 + i] & 15) | (int)(((qh >> i) & 1) << 4);
            u[i + 16] = (x[o + 4 + i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
        }
        A[0] = A[1] = kvz_quant_f16(x);
        B[0] = B[1] = t == KVZ_TYPE_Q5_0 ? -16.0f * kvz_quant_f16(x) : kvz_quant_f16(x + 2);
        break;
    }
    case KVZ_TYPE_Q4_K: case KVZ_TYPE_Q5_K: {
        const int j = (int)(b & 7);
        const uint8_t *x = w + (t == KVZ_TYPE_Q4_K ? 144 : 176) * (b >> 3);
        const uint8_t *qs = x + (t == KVZ_TYPE_Q4_K ? 16 : 48) + 32 * (j >> 1);
        for (int i = 0; i < 32; i++) {
            u[i] = j & 1 ? qs[i] >> 4 : qs[i] & 15;
            if (t == KVZ_TYPE_Q5_K) u[i] |= ((x[16 + i] >> j) & 1) << 4;
        }
        int sc, m;
        kvz_kq_scale_min(j, x + 4, &sc, &m);
        A[0] = A[1] = kvz_quant_f16(x) * (float)sc;
        B[0] = B[1] = -kvz_quant_f16(x + 2) * (float)m;
        break;
    }
    case KVZ_TYPE_Q6_K: {
        const int j = (int)(b & 7), half = j >> 2, g = j & 3;
        const uint8_t *x = w + 210 * (b >> 3);
        const uint8_t *ql = x + 64 * half + 32 * (g & 1), *qh = x + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(x + 192) + 8 * half + 2 * g;
        for (int i = 0; i < 32; i++)
            u[i] = (g >> 1 ? ql[i] >> 4 : ql[i] & 15) | (((qh[i] >> (2 * g)) & 3) << 4);
        const float d = kvz_quant_f16(x + 208);
        for (int h = 0; h < 2; h++) { A[h] = d * (float)sc[h]; B[h] = -32.0f * A[h]; }
        break;
    }
    }
}

static float qdot_ref(uint32_t t, const void *w, const void *q8, int64_t n)
{
    const q8v a = q8_view(q8, n);
    float sum = 0.0f;
    for (int64_t b = 0; b < n / 32; b++) {
        int u[32] = {0}; /* ref_block fills them for every known type; newer gccs cannot see it */
        float A[2] = {0}, B[2] = {0};
        ref_block(t, w, b, u, A, B);
        const float d = q8_d(&a, b);
        for (int h = 0; h < 2; h++) {
            int32_t is = 0;
            for (int i = 16 * h; i < 16 * h + 16; i++) is += u[i] * a.q[32 * b + i];
            sum += d * (A[h] * (float)is + B[h] * (float)q8_s(&a, b, h));
        }
    }
    return sum;
}

/* ------------------------------------------------------------------------ */
/* AVX2 / AVX-512                                                           */

#ifdef KVZ_QDOT_X86

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

static inline float h2f_x86(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
static inline int s32(const q8v *a, int64_t b) { return q8_s(a, b, 0) + q8_s(a, b, 1); }

/* low nibbles of 16 bytes -> elements 0..15, high nibbles -> 16..31 */
static inline __m256i nib16(const uint8_t *p)
{
    const __m128i r = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r, 4), r), _mm256_set1_epi8(15));
}
/* byte e = 0x10 if bit e of qh is set */
static inline __m256i bit4_32(const uint8_t *p)
{
    uint32_t qh;
    memcpy(&qh, p, 4);
    const __m256i idx = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                          0x0101010101010101LL, 0);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), idx), sel);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, sel), _mm256_set1_epi8(0x10));
}

/* Unpack activation block b of a row: unsigned (or signed, Q8_0) bytes *wv, int16
 * multipliers *sv, fp32 factor *fs; the offset term goes into *corr. */
#define UNPACK_ARGS const uint8_t *w, int64_t b, const q8v *a, __m256i *wv, __m256i *sv, float *fs, float *corr

static inline void up_q8_0(UNPACK_ARGS)
{
    const uint8_t *x = w + 34 * b;
    *wv = _mm256_loadu_si256((const __m256i *)(x + 2));
    *sv = _mm256_set1_epi16(1);
    *fs = h2f_x86(x) * q8_d(a, b);
    (void)corr;
}
static inline void up_q4_0(UNPACK_ARGS)
{
    const uint8_t *x = w + 18 * b;
    *wv = _mm256_sub_epi8(nib16(x + 2), _mm256_set1_epi8(8));
    *sv = _mm256_set1_epi16(1);
    *fs = h2f_x86(x) * q8_d(a, b);
    (void)corr;
}
static inline void up_q4_1(UNPACK_ARGS)
{
    const uint8_t *x = w + 20 * b;
    const float da = q8_d(a, b);
    *wv = nib16(x + 4);
    *sv = _mm256_set1_epi16(1);
    *fs = h2f_x86(x) * da;
    *corr += h2f_x86(x + 2) * da * (float)s32(a, b);
}
/* byte e = 0xF0 if bit e of qh is clear, else 0: OR-ed onto a nibble it gives
 * the signed value nibble + 16·bit - 16 */
static inline __m256i neg16_32(const uint8_t *p)
{
    uint32_t qh;
    memcpy(&qh, p, 4);
    const __m256i idx = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                          0x0101010101010101LL, 0);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), idx), sel);
    return _mm256_andnot_si256(_mm256_cmpeq_epi8(v, sel), _mm256_set1_epi8((char)0xF0));
}
/* Q5_0 and Q4_0 as signed bytes (u - 16, u - 8), multiplied with the sign trick:
 * no offset term, so no scalar work per block beyond the two scales */
static inline void up_q5_0(UNPACK_ARGS)
{
    const uint8_t *x = w + 22 * b;
    *wv = _mm256_or_si256(nib16(x + 6), neg16_32(x + 2));
    *sv = _mm256_set1_epi16(1);
    *fs = h2f_x86(x) * q8_d(a, b);
    (void)corr;
}
static inline void up_q5_1(UNPACK_ARGS)
{
    const uint8_t *x = w + 24 * b;
    const float da = q8_d(a, b);
    *wv = _mm256_or_si256(nib16(x + 8), bit4_32(x + 4));
    *sv = _mm256_set1_epi16(1);
    *fs = h2f_x86(x) * da;
    *corr += h2f_x86(x + 2) * da * (float)s32(a, b);
}
static inline void up_q4_k(UNPACK_ARGS)
{
    const int j = (int)(b & 7);
    const uint8_t *x = w + 144 * (b >> 3);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(x + 16 + 32 * (j >> 1)));
    *wv = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
    int sc, m;
    kvz_kq_scale_min(j, x + 4, &sc, &m);
    const float da = q8_d(a, b);
    *sv = _mm256_set1_epi16((short)sc);
    *fs = h2f_x86(x) * da;
    *corr -= h2f_x86(x + 2) * (float)m * da * (float)s32(a, b);
}
static inline void up_q5_k(UNPACK_ARGS)
{
    const int j = (int)(b & 7);
    const uint8_t *x = w + 176 * (b >> 3);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(x + 48 + 32 * (j >> 1)));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(x + 16));
    const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1));
    *wv = _mm256_or_si256(_mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15)),
                          _mm256_slli_epi16(hb, 4));
    int sc, m;
    kvz_kq_scale_min(j, x + 4, &sc, &m);
    const float da = q8_d(a, b);
    *sv = _mm256_set1_epi16((short)sc);
    *fs = h2f_x86(x) * da;
    *corr -= h2f_x86(x + 2) * (float)m * da * (float)s32(a, b);
}
static inline void up_q6_k(UNPACK_ARGS)
{
    const int j = (int)(b & 7), half = j >> 2, g = j & 3;
    const uint8_t *x = w + 210 * (b >> 3);
    const __m256i l4 = _mm256_loadu_si256((const __m256i *)(x + 64 * half + 32 * (g & 1)));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(x + 128 + 32 * half));
    const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(l4, 4) : l4, _mm256_set1_epi8(15));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * g), _mm256_set1_epi8(3));
    *wv = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    const int8_t *sc = (const int8_t *)(x + 192) + 8 * half + 2 * g;
    *sv = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
    const float f = h2f_x86(x + 208) * q8_d(a, b);
    *fs = f;
    *corr -= 32.0f * f * (float)(sc[0] * q8_s(a, b, 0) + sc[1] * q8_s(a, b, 1));
}

static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one activation block with 256-bit ops: acc += fs · Σ sv · (w · q) */
#define BLOCK256(UP, SIGNED, bi, acc, corr)                                                     \
    do {                                                                                    \
        __m256i wv_, sv_;                                                                   \
        float fs_;                                                                          \
        UP(w, bi, &a, &wv_, &sv_, &fs_, &corr);                                              \
        __m256i av_ = _mm256_loadu_si256((const __m256i *)(a.q + 32 * (bi)));               \
        if (SIGNED) {                                                                       \
            av_ = _mm256_sign_epi8(av_, wv_);                                               \
            wv_ = _mm256_abs_epi8(wv_);                                                     \
        }                                                                                   \
        const __m256i p_ = _mm256_madd_epi16(_mm256_maddubs_epi16(wv_, av_), sv_);          \
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fs_), _mm256_cvtepi32_ps(p_), acc);            \
    } while (0)

#define DEF_AVX2(NAME, UP, SIGNED)                                                          \
    static float NAME(const uint8_t *w, const void *q8, int64_t n)                          \
    {                                                                                       \
        const q8v a = q8_view(q8, n);                                                       \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                      \
        float corr = 0.0f;                                                                  \
        int64_t b = 0;                                                                      \
        for (; b + 1 < n / 32; b += 2) {                                                    \
            BLOCK256(UP, SIGNED, b, acc0, corr);                                            \
            BLOCK256(UP, SIGNED, b + 1, acc1, corr);                                        \
        }                                                                                   \
        for (; b < n / 32; b++) BLOCK256(UP, SIGNED, b, acc0, corr);                           \
        return hsum256(_mm256_add_ps(acc0, acc1)) + corr;                                   \
    }

DEF_AVX2(dot2_q8_0, up_q8_0, 1)
DEF_AVX2(dot2_q4_0, up_q4_0, 1)
DEF_AVX2(dot2_q4_1, up_q4_1, 0)
DEF_AVX2(dot2_q5_0, up_q5_0, 1)
DEF_AVX2(dot2_q5_1, up_q5_1, 0)
DEF_AVX2(dot2_q5_k, up_q5_k, 0)

/* Q4_K a super-block (256 elements, 8 activation blocks) at a time: the 6-bit
 * scales and mins, d and dmin are decoded once per super-block instead of once per
 * activation block, one 32-byte load gives two blocks' nibbles, and the min term
 * dmin · Σ_j m_j · d_j · s_j is summed in a vector (per-block version above: 0.18
 * ns/element on one Zen core, bench/qdot_bench). */
static float dot2_q4_k_sb(const uint8_t *w, const void *q8, int64_t n)
{
    const q8v a = q8_view(q8, n);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t sb = 0; sb < n / 256; sb++) {
        const uint8_t *x = w + 144 * sb;
        int32_t sc[8], mn[8];
        for (int j = 0; j < 8; j++) kvz_kq_scale_min(j, x + 4, &sc[j], &mn[j]);
        const __m256 da = _mm256_loadu_ps((const float *)(const void *)(a.d + 4 * 8 * sb));
        float fs[8];
        _mm256_storeu_ps(fs, _mm256_mul_ps(_mm256_set1_ps(h2f_x86(x)), da));
        /* Σ of each block's two half sums (int16 pairs) */
        const __m256i s16 = _mm256_loadu_si256((const __m256i *)(const void *)(a.s + 4 * 8 * sb));
        const __m256 sf = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
        const __m256 mf = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(const void *)mn));
        accm = _mm256_fmadd_ps(_mm256_set1_ps(h2f_x86(x + 2)), _mm256_mul_ps(_mm256_mul_ps(mf, da), sf), accm);
        const int8_t *aq = a.q + 256 * sb;
        for (int j = 0; j < 8; j += 2) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(x + 16 + 16 * j));
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            const __m256i p0 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(const void *)(aq + 32 * j))),
                _mm256_set1_epi16((short)sc[j]));
            const __m256i p1 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(const void *)(aq + 32 * j + 32))),
                _mm256_set1_epi16((short)sc[j + 1]));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(fs[j]), _mm256_cvtepi32_ps(p0), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(fs[j + 1]), _mm256_cvtepi32_ps(p1), acc1);
        }
    }
    return hsum256(_mm256_add_ps(acc0, acc1)) - hsum256(accm);
}

/* Q6_K a super-block at a time: 32 bytes of ql give the low nibbles of two blocks,
 * 32 bytes of qh the high bits of four; the 16 int8 scales are in block order
 * (block j, half h: scales[2j + h]), so the -32 offset term 32 · d · Σ_j d_j ·
 * Σ_h sc · s_h is one madd of the scales with the activation half sums. */
static float dot2_q6_k_sb(const uint8_t *w, const void *q8, int64_t n)
{
    const q8v a = q8_view(q8, n);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    for (int64_t sb = 0; sb < n / 256; sb++) {
        const uint8_t *x = w + 210 * sb;
        const int8_t *sc = (const int8_t *)(x + 192);
        const float d = h2f_x86(x + 208);
        const __m256 da = _mm256_loadu_ps((const float *)(const void *)(a.d + 4 * 8 * sb));
        float fs[8];
        _mm256_storeu_ps(fs, _mm256_mul_ps(_mm256_set1_ps(d), da));
        const __m256i s16 = _mm256_loadu_si256((const __m256i *)(const void *)(a.s + 4 * 8 * sb));
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)sc));
        const __m256 ss = _mm256_cvtepi32_ps(_mm256_madd_epi16(sc16, s16));
        accm = _mm256_fmadd_ps(_mm256_set1_ps(32.0f * d), _mm256_mul_ps(da, ss), accm);
        const int8_t *aq = a.q + 256 * sb;
        for (int half = 0; half < 2; half++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(const void *)(x + 64 * half));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(const void *)(x + 64 * half + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)(x + 128 + 32 * half));
            __m256i u[4];
            u[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
            u[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
            u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
            u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
            for (int g = 0; g < 4; g += 2) {
                const int j = 4 * half + g;
                const __m256i s0 = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
                const __m256i s1 = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 3]), _mm_set1_epi16(sc[2 * j + 2]));
                const __m256i p0 = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(u[g], _mm256_loadu_si256((const __m256i *)(const void *)(aq + 32 * j))), s0);
                const __m256i p1 = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(u[g + 1],
                                         _mm256_loadu_si256((const __m256i *)(const void *)(aq + 32 * j + 32))),
                    s1);
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(fs[j]), _mm256_cvtepi32_ps(p0), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(fs[j + 1]), _mm256_cvtepi32_ps(p1), acc1);
            }
        }
    }
    return hsum256(_mm256_add_ps(acc0, acc1)) - hsum256(accm);
}

static float qdot_avx2(uint32_t t, const void *w, const void *q8, int64_t n)
{
    switch (t) {
    case KVZ_TYPE_Q8_0: return dot2_q8_0(w, q8, n);
    case KVZ_TYPE_Q4_0: return dot2_q4_0(w, q8, n);
    case KVZ_TYPE_Q4_1: return dot2_q4_1(w, q8, n);
    case KVZ_TYPE_Q5_0: return dot2_q5_0(w, q8, n);
    case KVZ_TYPE_Q5_1: return dot2_q5_1(w, q8, n);
    case KVZ_TYPE_Q4_K: return dot2_q4_k_sb(w, q8, n);
    case KVZ_TYPE_Q5_K: return dot2_q5_k(w, q8, n);
    case KVZ_TYPE_Q6_K: return dot2_q6_k_sb(w, q8, n);
    default: return NAN;
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#define AVX512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))

/* two activation blocks (b, b+1) per 512-bit step, a tail block with 256-bit ops */
#define DEF_AVX512(NAME, UP, SIGNED)                                                        \
    AVX512_TARGET static float NAME(const uint8_t *w, const void *q8, int64_t n)           \
    {                                                                                       \
        const q8v a = q8_view(q8, n);                                                       \
        __m512 acc = _mm512_setzero_ps();                                                   \
        float corr = 0.0f;                                                                  \
        int64_t b = 0;                                                                      \
        for (; b + 1 < n / 32; b += 2) {                                                    \
            __m256i w0, s0, w1, s1;                                                         \
            float f0, f1;                                                                   \
            UP(w, b, &a, &w0, &s0, &f0, &corr);                                             \
            UP(w, b + 1, &a, &w1, &s1, &f1, &corr);                                         \
            __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);             \
            const __m512i sv = _mm512_inserti64x4(_mm512_castsi256_si512(s0), s1, 1);       \
            __m512i av = _mm512_loadu_si512((const void *)(a.q + 32 * b));                  \
            if (SIGNED) {                                                                   \
                av = _mm512_mask_sub_epi8(av, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), av); \
                wv = _mm512_abs_epi8(wv);                                                   \
            }                                                                               \
            const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(wv, av), sv);          \
            const __m512 fv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(f0)), \
                                                 _mm256_set1_ps(f1), 1);                    \
            acc = _mm512_fmadd_ps(fv, _mm512_cvtepi32_ps(p), acc);                          \
        }                                                                                   \
        __m256 acc2 = _mm256_setzero_ps();                                                  \
        for (; b < n / 32; b++) BLOCK256(UP, SIGNED, b, acc2, corr);                           \
        return _mm512_reduce_add_ps(acc) + hsum256(acc2) + corr;                            \
    }

DEF_AVX512(dot5_q8_0, up_q8_0, 1)
DEF_AVX512(dot5_q4_0, up_q4_0, 1)
DEF_AVX512(dot5_q4_1, up_q4_1, 0)
DEF_AVX512(dot5_q5_0, up_q5_0, 1)
DEF_AVX512(dot5_q5_1, up_q5_1, 0)
DEF_AVX512(dot5_q4_k, up_q4_k, 0)
DEF_AVX512(dot5_q5_k, up_q5_k, 0)
DEF_AVX512(dot5_q6_k, up_q6_k, 0)

static float qdot_avx512(uint32_t t, const void *w, const void *q8, int64_t n)
{
    switch (t) {
    case KVZ_TYPE_Q8_0: return dot5_q8_0(w, q8, n);
    case KVZ_TYPE_Q4_0: return dot5_q4_0(w, q8, n);
    case KVZ_TYPE_Q4_1: return dot5_q4_1(w, q8, n);
    case KVZ_TYPE_Q5_0: return dot5_q5_0(w, q8, n);
    case KVZ_TYPE_Q5_1: return dot5_q5_1(w, q8, n);
    case KVZ_TYPE_Q4_K: return dot5_q4_k(w, q8, n);
    case KVZ_TYPE_Q5_K: return dot5_q5_k(w, q8, n);
    case KVZ_TYPE_Q6_K: return dot5_q6_k(w, q8, n);
    default: return NAN;
    }
}
#endif /* KVZ_QDOT_X86 */

/* ------------------------------------------------------------------------ */
/* dispatch                                                                 */

int kvz_qdot_cpu_isa(void)
{
#ifdef KVZ_QDOT_X86
    static int isa = -1;
    if (isa < 0) {
        __builtin_cpu_init();
        int v = KVZ_ISA_SCALAR;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) v = KVZ_ISA_AVX2;
        if (v == KVZ_ISA_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
            v = KVZ_ISA_AVX512;
        isa = v;
    }
    return isa;
#else
    return KVZ_ISA_SCALAR;
#endif
}

int kvz_qdot_active_isa(void)
{
    static int isa = -1;
    if (isa < 0) {
        int v = kvz_qdot_cpu_isa();
        const char *e = getenv("KVZ_QDOT_ISA");
        if (e && !strcmp(e, "scalar")) v = KVZ_ISA_SCALAR;
        else if (e && !strcmp(e, "avx2") && v > KVZ_ISA_AVX2) v = KVZ_ISA_AVX2;
        isa = v;
    }
    return isa;
}

const char *kvz_isa_name(int isa)
{
    return isa == KVZ_ISA_AVX512 ? "avx512" : isa == KVZ_ISA_AVX2 ? "avx2" : "scalar";
}

float kvz_qdot_isa(int isa, uint32_t type, const void *w, const void *q8, int64_t n)
{
    if (!kvz_qdot_supported(type) || n % wblock_elems(type)) return NAN;
    if (isa > kvz_qdot_cpu_isa()) isa = KVZ_ISA_SCALAR;
#ifdef KVZ_QDOT_X86
    if (isa == KVZ_ISA_AVX512) return qdot_avx512(type, w, q8, n);
    if (isa == KVZ_ISA_AVX2) return qdot_avx2(type, w, q8, n);
#endif
    return qdot_ref(type, w, q8, n);
}

float kvz_qdot(uint32_t type, const void *w, const void *q8, int64_t n)
{
#ifdef KVZ_QDOT_X86
    static int isa = -1;
    if (isa < 0) isa = kvz_qdot_active_isa();
    if (isa == KVZ_ISA_AVX512) return qdot_avx512(type, w, q8, n);
    if (isa == KVZ_ISA_AVX2) return qdot_avx2(type, w, q8, n);
#endif
    return qdot_ref(type, w, q8, n);
}
