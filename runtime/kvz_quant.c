/* ggml tensor types: block geometry and dequantization to fp32.
 *
 * Layouts follow ggml (ggml-common.h / ggml-quants.c); docs/GGUF.md has the
 * byte maps. All block structs are read through byte offsets + memcpy, so the
 * source needs no alignment. Little-endian host assumed (as GGUF is LE). */
#include "kvz_quant.h"

#include <string.h>

#include "kvz_error.h"
#include "kvz_qdot.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvz_quant.c assumes a little-endian host"
#endif

#define QK 32   /* elements per block of the legacy Q4_0..Q8_1 types */
#define QK_K 256 /* elements per super-block of the k-quants */

/* ------------------------------------------------------------------------ */
/* Type table                                                               */

typedef struct {
    uint32_t type;
    const char *name;
    int64_t blck;   /* elements per block */
    int64_t bytes;  /* bytes per block */
    int supported;  /* kvz_dequantize handles it */
} type_info;

static const type_info g_types[] = {
    {KVZ_TYPE_F32, "F32", 1, 4, 1},
    {KVZ_TYPE_F16, "F16", 1, 2, 1},
    {KVZ_TYPE_BF16, "BF16", 1, 2, 1},
    {KVZ_TYPE_Q4_0, "Q4_0", QK, 2 + QK / 2, 1},               /* d, qs[16] */
    {KVZ_TYPE_Q4_1, "Q4_1", QK, 4 + QK / 2, 1},               /* d, m, qs[16] */
    {KVZ_TYPE_Q5_0, "Q5_0", QK, 2 + 4 + QK / 2, 1},           /* d, qh[4], qs[16] */
    {KVZ_TYPE_Q5_1, "Q5_1", QK, 4 + 4 + QK / 2, 1},           /* d, m, qh[4], qs[16] */
    {KVZ_TYPE_Q8_0, "Q8_0", QK, 2 + QK, 1},                   /* d, qs[32] */
    {KVZ_TYPE_Q8_1, "Q8_1", QK, 4 + QK, 0},                   /* d, s, qs[32] */
    {KVZ_TYPE_Q2_K, "Q2_K", QK_K, QK_K / 16 + QK_K / 4 + 4, 0},
    {KVZ_TYPE_Q3_K, "Q3_K", QK_K, QK_K / 8 + QK_K / 4 + 12 + 2, 0},
    {KVZ_TYPE_Q4_K, "Q4_K", QK_K, 4 + 12 + QK_K / 2, 1},      /* d, dmin, scales[12], qs[128] */
    {KVZ_TYPE_Q5_K, "Q5_K", QK_K, 4 + 12 + QK_K / 8 + QK_K / 2, 1}, /* + qh[32] */
    {KVZ_TYPE_Q6_K, "Q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2, 1}, /* ql, qh, sc, d */
    {KVZ_TYPE_Q8_K, "Q8_K", QK_K, 4 + QK_K + QK_K / 8, 0},    /* f32 d, qs[256], bsums[16] */
};

static const type_info *find_type(uint32_t type)
{
    for (size_t i = 0; i < sizeof g_types / sizeof g_types[0]; i++)
        if (g_types[i].type == type) return &g_types[i];
    return NULL;
}

int64_t kvz_type_block_elems(uint32_t type)
{
    const type_info *t = find_type(type);
    return t ? t->blck : 0;
}

int64_t kvz_type_block_bytes(uint32_t type)
{
    const type_info *t = find_type(type);
    return t ? t->bytes : 0;
}

const char *kvz_type_name(uint32_t type)
{
    const type_info *t = find_type(type);
    return t ? t->name : "?";
}

int kvz_type_supported(uint32_t type)
{
    const type_info *t = find_type(type);
    return t ? t->supported : 0;
}

int64_t kvz_type_nbytes(uint32_t type, int64_t n)
{
    const type_info *t = find_type(type);
    if (!t || n < 0 || n % t->blck != 0) return -1;
    int64_t nb = n / t->blck;
    if (nb > INT64_MAX / t->bytes) return -1;
    return nb * t->bytes;
}

/* ------------------------------------------------------------------------ */
/* fp16 / bf16                                                              */

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

float kvz_fp16_to_fp32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0x1f) /* inf / nan: keep payload */
        return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);
        /* subnormal: man * 2^-24, exact in fp32 */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t kvz_fp32_to_fp16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* nan: quiet, keep top payload bits */
        return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000u) /* >= 65520 rounds to inf */
        return (uint16_t)(sign | 0x7c00);
    if (a < 0x38800000u) { /* below 2^-14: fp16 subnormal or zero */
        if (a < 0x33000000u) return sign; /* < 2^-25: rounds to 0 (2^-25 ties to even 0) */
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffff) | 0x800000;
        uint32_t shift = 126 - e; /* value = m * 2^(e-150); want units of 2^-24 */
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    /* normal: rebias exponent, round mantissa to 10 bits (carry may bump exp) */
    uint32_t r = a - (112u << 23);
    r += 0xfff + ((r >> 13) & 1);
    return (uint16_t)(sign | (r >> 13));
}

float kvz_bf16_to_fp32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t kvz_fp32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* nan: force quiet */
        return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* ------------------------------------------------------------------------ */
/* Legacy 32-element blocks                                                 */

static void deq_q4_0(const uint8_t *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += 18, y += QK) {
        const float d = kvz_quant_f16(x);
        const uint8_t *qs = x + 2;
        for (int j = 0; j < QK / 2; j++) {
            y[j] = (float)((qs[j] & 0x0f) - 8) * d;
            y[j + QK / 2] = (float)((qs[j] >> 4) - 8) * d;
        }
    }
}

static void deq_q4_1(const uint8_t *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += 20, y += QK) {
        const float d = kvz_quant_f16(x), m = kvz_quant_f16(x + 2);
        const uint8_t *qs = x + 4;
        for (int j = 0; j < QK / 2; j++) {
            y[j] = (float)(qs[j] & 0x0f) * d + m;
            y[j + QK / 2] = (float)(qs[j] >> 4) * d + m;
        }
    }
}

static void deq_q5_0(const uint8_t *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += 22, y += QK) {
        const float d = kvz_quant_f16(x);
        uint32_t qh;
        memcpy(&qh, x + 2, 4); /* bit j = 5th bit of element j */
        const uint8_t *qs = x + 6;
        for (int j = 0; j < QK / 2; j++) {
            const int h0 = (int)((qh >> j) << 4) & 0x10;
            const int h1 = (int)(qh >> (j + 12)) & 0x10;
            y[j] = (float)(((qs[j] & 0x0f) | h0) - 16) * d;
            y[j + QK / 2] = (float)(((qs[j] >> 4) | h1) - 16) * d;
        }
    }
}

static void deq_q5_1(const uint8_t *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += 24, y += QK) {
        const float d = kvz_quant_f16(x), m = kvz_quant_f16(x + 2);
        uint32_t qh;
        memcpy(&qh, x + 4, 4);
        const uint8_t *qs = x + 8;
        for (int j = 0; j < QK / 2; j++) {
            const int h0 = (int)((qh >> j) << 4) & 0x10;
            const int h1 = (int)(qh >> (j + 12)) & 0x10;
            y[j] = (float)((qs[j] & 0x0f) | h0) * d + m;
            y[j + QK / 2] = (float)((qs[j] >> 4) | h1) * d + m;
        }
    }
}

static void deq_q8_0(const uint8_t *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += 34, y += QK) {
        const float d = kvz_quant_f16(x);
        const int8_t *qs = (const int8_t *)(x + 2);
        for (int j = 0; j < QK; j++) y[j] = (float)qs[j] * d;
    }
}

/* ------------------------------------------------------------------------ */
/* k-quants: 256-element super-blocks                                       */

static void deq_q4_k(const uint8_t *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += 144) {
        const float d = kvz_quant_f16(x), dmin = kvz_quant_f16(x + 2);
        const uint8_t *scales = x + 4;
        const uint8_t *q = x + 16;
        for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, q += 32) {
            int sc, m;
            kvz_kq_scale_min(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            kvz_kq_scale_min(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) y[l] = d1 * (float)(q[l] & 0x0f) - m1;
            for (int l = 0; l < 32; l++) y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
            y += 64;
        }
    }
}

static void deq_q5_k(const uint8_t *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += 176) {
        const float d = kvz_quant_f16(x), dmin = kvz_quant_f16(x + 2);
        const uint8_t *scales = x + 4;
        const uint8_t *qh = x + 16;
        const uint8_t *ql = x + 48;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, ql += 32) {
            int sc, m;
            kvz_kq_scale_min(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            kvz_kq_scale_min(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++)
                y[l] = d1 * (float)((ql[l] & 0x0f) + (qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++)
                y[l + 32] = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
            y += 64;
            u1 = (uint8_t)(u1 << 2);
            u2 = (uint8_t)(u2 << 2);
        }
    }
}

static void deq_q6_k(const uint8_t *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += 210) {
        const uint8_t *ql = x;         /* [128] low 4 bits */
        const uint8_t *qh = x + 128;   /* [64]  high 2 bits */
        const int8_t *sc = (const int8_t *)(x + 192); /* [16] */
        const float d = kvz_quant_f16(x + 208);
        for (int n = 0; n < QK_K; n += 128) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * sc[is + 0] * (float)q1;
                y[l + 32] = d * sc[is + 2] * (float)q2;
                y[l + 64] = d * sc[is + 4] * (float)q3;
                y[l + 96] = d * sc[is + 6] * (float)q4;
            }
            y += 128;
            ql += 64;
            qh += 32;
            sc += 8;
        }
    }
}

/* ------------------------------------------------------------------------ */
/* AVX2 row kernels for the types the models here use (3-8x the scalar loops,
 * which matters for prefill: every batched pass dequantizes every weight). They
 * evaluate the scalar expressions with the same scale products; the types with an
 * offset (Q4_1 q·d + m, Q4_K d1·q − m1) use one FMA, as the scalar code does
 * where the compiler contracts it, so they are within half an ulp of the product
 * of the scalar result and the product-only types (Q5_0, Q8_0, Q6_K) give the
 * same bits: tests/fast/test_quant checks both on random blocks. The target
 * options are their own (the build's -march does not matter); kvz_dequantize runs
 * them when the CPU has AVX2 (kvz_qdot_active_isa: KVZ_QDOT_ISA=scalar turns them
 * off too). */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVZ_DEQ_X86 1
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

/* 32 bytes (unsigned, or signed when sgn) -> fp32 v·a + b in one FMA (b = NULL: v·a) */
static inline void st32(float *y, __m256i v, int sgn, __m256 a, const __m256 *b)
{
    const __m128i h[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
    for (int k = 0; k < 4; k++) {
        const __m128i e = k & 1 ? _mm_srli_si128(h[k >> 1], 8) : h[k >> 1];
        const __m256 f = _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(e) : _mm256_cvtepu8_epi32(e));
        _mm256_storeu_ps(y + 8 * k, b ? _mm256_fmadd_ps(f, a, *b) : _mm256_mul_ps(f, a));
    }
}

/* low nibbles of 16 bytes -> bytes 0..15, high nibbles -> 16..31 */
static inline __m256i nib32(const uint8_t *p)
{
    const __m128i r = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r, 4), r), _mm256_set1_epi8(15));
}

static void deq_q4_1_avx2(const uint8_t *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += 20, y += QK) {
        const __m256 m = _mm256_set1_ps(kvz_quant_f16(x + 2));
        st32(y, nib32(x + 4), 0, _mm256_set1_ps(kvz_quant_f16(x)), &m);
    }
}

static void deq_q8_0_avx2(const uint8_t *x, float *y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += 34, y += QK)
        st32(y, _mm256_loadu_si256((const __m256i *)(x + 2)), 1, _mm256_set1_ps(kvz_quant_f16(x)), NULL);
}

static void deq_q5_0_avx2(const uint8_t *x, float *y, int64_t nb)
{
    const __m256i idx = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                          0x0101010101010101LL, 0);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    for (int64_t i = 0; i < nb; i++, x += 22, y += QK) {
        uint32_t qh;
        memcpy(&qh, x + 2, 4); /* bit e = 5th bit of element e */
        __m256i h = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), idx), sel);
        h = _mm256_and_si256(_mm256_cmpeq_epi8(h, sel), _mm256_set1_epi8(0x10));
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nib32(x + 6), h), _mm256_set1_epi8(16));
        st32(y, q, 1, _mm256_set1_ps(kvz_quant_f16(x)), NULL);
    }
}

static void deq_q4_k_avx2(const uint8_t *x, float *y, int64_t nb)
{
    const __m256i lo = _mm256_set1_epi8(15);
    for (int64_t i = 0; i < nb; i++, x += 144) {
        const float d = kvz_quant_f16(x), dmin = kvz_quant_f16(x + 2);
        const uint8_t *q = x + 16;
        for (int is = 0; is < 8; is += 2, q += 32, y += 64) {
            int sc, mn;
            kvz_kq_scale_min(is, x + 4, &sc, &mn);
            const __m256 m1 = _mm256_set1_ps(-(dmin * mn));
            const __m256 d1 = _mm256_set1_ps(d * sc);
            kvz_kq_scale_min(is + 1, x + 4, &sc, &mn);
            const __m256 m2 = _mm256_set1_ps(-(dmin * mn));
            const __m256 d2 = _mm256_set1_ps(d * sc);
            const __m256i v = _mm256_loadu_si256((const __m256i *)q);
            /* d1·u − m1 == d1·u + (−m1) exactly */
            st32(y, _mm256_and_si256(v, lo), 0, d1, &m1);
            st32(y + 32, _mm256_and_si256(_mm256_srli_epi16(v, 4), lo), 0, d2, &m2);
        }
    }
}

static void deq_q6_k_avx2(const uint8_t *x, float *y, int64_t nb)
{
    const __m256i lo = _mm256_set1_epi8(15), hi2 = _mm256_set1_epi8(0x30), b32 = _mm256_set1_epi8(32);
    for (int64_t i = 0; i < nb; i++, x += 210) {
        const uint8_t *ql = x, *qh = x + 128;
        const int8_t *sc = (const int8_t *)(x + 192);
        const float d = kvz_quant_f16(x + 208);
        for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32, sc += 8, y += 128) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, lo), _mm256_and_si256(_mm256_slli_epi16(h, 4), hi2));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, lo), _mm256_and_si256(_mm256_slli_epi16(h, 2), hi2));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), lo), _mm256_and_si256(h, hi2));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), lo),
                                   _mm256_and_si256(_mm256_srli_epi16(h, 2), hi2));
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_sub_epi8(q[k], b32);
                /* 16 elements per scale: split the 32 bytes in halves */
                const __m128i hv[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
                for (int s = 0; s < 2; s++) {
                    const __m256 a = _mm256_set1_ps(d * sc[2 * k + s]);
                    _mm256_storeu_ps(y + 32 * k + 16 * s,
                                     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hv[s])), a));
                    _mm256_storeu_ps(y + 32 * k + 16 * s + 8,
                                     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hv[s], 8))), a));
                }
            }
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif /* KVZ_DEQ_X86 */

/* The AVX2 kernel of a type, or NULL. */
typedef void (*deq_fn)(const uint8_t *, float *, int64_t);
static deq_fn deq_avx2(uint32_t type)
{
#ifdef KVZ_DEQ_X86
    switch (type) {
    case KVZ_TYPE_Q4_1: return deq_q4_1_avx2;
    case KVZ_TYPE_Q5_0: return deq_q5_0_avx2;
    case KVZ_TYPE_Q8_0: return deq_q8_0_avx2;
    case KVZ_TYPE_Q4_K: return deq_q4_k_avx2;
    case KVZ_TYPE_Q6_K: return deq_q6_k_avx2;
    default: break;
    }
#endif
    (void)type;
    return NULL;
}

/* ------------------------------------------------------------------------ */

int kvz_dequantize(uint32_t type, const void *src, float *dst, int64_t n)
{
    static int isa = -1;
    if (isa < 0) isa = kvz_qdot_active_isa();
    return kvz_dequantize_isa(isa, type, src, dst, n);
}

int kvz_dequantize_isa(int isa, uint32_t type, const void *src, float *dst, int64_t n)
{
    const type_info *t = find_type(type);
    if (!t || !t->supported)
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "dequantize: type %u (%s) not supported",
                             type, kvz_type_name(type));
    if (n < 0 || n % t->blck != 0)
        return kvz_error_set(KVZ_ERR_ARG, "dequantize: %lld elements is not a multiple of %lld (%s)",
                             (long long)n, (long long)t->blck, t->name);
    if (n == 0) return 0;
    const uint8_t *x = src;
    const int64_t nb = n / t->blck;
    const deq_fn fast = isa >= KVZ_ISA_AVX2 && kvz_qdot_cpu_isa() >= KVZ_ISA_AVX2 ? deq_avx2(type) : NULL;
    if (fast) {
        fast(x, dst, nb);
        return 0;
    }
    switch (type) {
    case KVZ_TYPE_F32: memcpy(dst, src, (size_t)n * 4); break;
    case KVZ_TYPE_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = kvz_quant_f16(x + 2 * i);
        break;
    case KVZ_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, x + 2 * i, 2);
            dst[i] = kvz_bf16_to_fp32(h);
        }
        break;
    case KVZ_TYPE_Q4_0: deq_q4_0(x, dst, nb); break;
    case KVZ_TYPE_Q4_1: deq_q4_1(x, dst, nb); break;
    case KVZ_TYPE_Q5_0: deq_q5_0(x, dst, nb); break;
    case KVZ_TYPE_Q5_1: deq_q5_1(x, dst, nb); break;
    case KVZ_TYPE_Q8_0: deq_q8_0(x, dst, nb); break;
    case KVZ_TYPE_Q4_K: deq_q4_k(x, dst, nb); break;
    case KVZ_TYPE_Q5_K: deq_q5_k(x, dst, nb); break;
    case KVZ_TYPE_Q6_K: deq_q6_k(x, dst, nb); break;
    default: return kvz_error_set(KVZ_ERR_INTERNAL, "dequantize: type %u in table but no kernel", type);
    }
    return 0;
}
