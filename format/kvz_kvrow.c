/* kvz_kvrow.c — KV row codecs (layouts: common/kvz_kvdtype.h, exactness: kvz_kvrow.h). */
#include "kvz_kvrow.h"

#include "kvz_error.h"

#include <float.h>
#include <math.h>
#include <string.h>

#define F16_MAX 65504.0f

/* ========================================================================= */
/* Scalars                                                                     */

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline uint16_t ld16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline void st16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

float kvz_kvrow_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        float v = (float)man * 0x1p-24f; /* subnormal (or zero): exact */
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t kvz_kvrow_f32_to_f16(float f)
{
    uint32_t u = f32_bits(f), a = u & 0x7fffffffu;
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff)); /* NaN, quiet */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);                       /* >= 65520: inf */
    if (a < 0x38800000u) { /* below 2^-14: subnormal or zero, in units of 2^-24 */
        if (a < 0x33000000u) return sign;
        uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = a - (112u << 23); /* rebias; round the mantissa to 10 bits, ties to even */
    r += 0xfff + ((r >> 13) & 1);
    return (uint16_t)(sign | (r >> 13));
}

float kvz_kvrow_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t kvz_kvrow_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64); /* NaN, quiet */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* f16 scale of a non-negative fp32 value, saturated at the f16 maximum. */
static inline uint16_t scale16(float s) { return kvz_kvrow_f32_to_f16(s > F16_MAX ? F16_MAX : s); }

/* ========================================================================= */
/* Row codecs                                                                  */

static int enc_f32(const float *x, size_t n, uint8_t *d) { memcpy(d, x, 4 * n); return 0; }
static int dec_f32(const uint8_t *s, size_t n, float *y) { memcpy(y, s, 4 * n); return 0; }

static int enc_f16(const float *x, size_t n, uint8_t *d)
{
    for (size_t i = 0; i < n; i++) st16(d + 2 * i, kvz_kvrow_f32_to_f16(x[i]));
    return 0;
}
static int dec_f16(const uint8_t *s, size_t n, float *y)
{
    for (size_t i = 0; i < n; i++) y[i] = kvz_kvrow_f16_to_f32(ld16(s + 2 * i));
    return 0;
}
static int enc_bf16(const float *x, size_t n, uint8_t *d)
{
    for (size_t i = 0; i < n; i++) st16(d + 2 * i, kvz_kvrow_f32_to_bf16(x[i]));
    return 0;
}
static int dec_bf16(const uint8_t *s, size_t n, float *y)
{
    for (size_t i = 0; i < n; i++) y[i] = kvz_kvrow_bf16_to_f32(ld16(s + 2 * i));
    return 0;
}

/* Q8: [G x f16 d][n x i8 q] */
static int enc_q8(const float *x, size_t n, uint8_t *d)
{
    const size_t G = n / KVZ_KV_QGROUP;
    int8_t *q = (int8_t *)(d + 2 * G);
    for (size_t g = 0; g < G; g++) {
        const float *xg = x + g * KVZ_KV_QGROUP;
        float amax = 0.0f;
        for (int i = 0; i < KVZ_KV_QGROUP; i++) {
            float a = fabsf(xg[i]);
            if (!(a <= FLT_MAX)) return KVZ_ERR_ARG; /* NaN or Inf */
            if (a > amax) amax = a;
        }
        const uint16_t dh = scale16(amax / 127.0f);
        const float df = kvz_kvrow_f16_to_f32(dh);
        st16(d + 2 * g, dh);
        for (int i = 0; i < KVZ_KV_QGROUP; i++) {
            float r = df > 0.0f ? roundf(xg[i] / df) : 0.0f;
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            q[g * KVZ_KV_QGROUP + i] = (int8_t)r;
        }
    }
    return 0;
}

static int dec_q8(const uint8_t *s, size_t n, float *y)
{
    const size_t G = n / KVZ_KV_QGROUP;
    const int8_t *q = (const int8_t *)(s + 2 * G);
    for (size_t g = 0; g < G; g++) {
        const uint16_t dh = ld16(s + 2 * g);
        if ((dh & 0x8000) || (dh & 0x7c00) == 0x7c00) return KVZ_ERR_FORMAT;
        const float df = kvz_kvrow_f16_to_f32(dh);
        for (int i = 0; i < KVZ_KV_QGROUP; i++) {
            const int8_t v = q[g * KVZ_KV_QGROUP + i];
            if (v == -128) return KVZ_ERR_FORMAT;
            y[g * KVZ_KV_QGROUP + i] = df * (float)v;
        }
    }
    return 0;
}

/* Q4: [G x (f16 d, f16 m)][n/2 bytes: element 2j low nibble, 2j+1 high nibble] */
static int enc_q4(const float *x, size_t n, uint8_t *d)
{
    const size_t G = n / KVZ_KV_QGROUP;
    uint8_t *nib = d + 4 * G;
    for (size_t g = 0; g < G; g++) {
        const float *xg = x + g * KVZ_KV_QGROUP;
        float mn = xg[0], mx = xg[0];
        for (int i = 0; i < KVZ_KV_QGROUP; i++) {
            if (!(fabsf(xg[i]) <= FLT_MAX)) return KVZ_ERR_ARG;
            if (xg[i] < mn) mn = xg[i];
            if (xg[i] > mx) mx = xg[i];
        }
        const float m = mn < -F16_MAX ? -F16_MAX : mn > F16_MAX ? F16_MAX : mn;
        const uint16_t mh = kvz_kvrow_f32_to_f16(m), dh = scale16((mx - mn) / 15.0f);
        const float mf = kvz_kvrow_f16_to_f32(mh), df = kvz_kvrow_f16_to_f32(dh);
        st16(d + 4 * g, dh);
        st16(d + 4 * g + 2, mh);
        for (int i = 0; i < KVZ_KV_QGROUP; i += 2) {
            uint8_t b = 0;
            for (int k = 0; k < 2; k++) {
                float r = df > 0.0f ? roundf((xg[i + k] - mf) / df) : 0.0f;
                r = r > 15.0f ? 15.0f : r < 0.0f ? 0.0f : r;
                b |= (uint8_t)((uint8_t)r << (4 * k));
            }
            nib[(g * KVZ_KV_QGROUP + i) / 2] = b;
        }
    }
    return 0;
}

static int dec_q4(const uint8_t *s, size_t n, float *y)
{
    const size_t G = n / KVZ_KV_QGROUP;
    const uint8_t *nib = s + 4 * G;
    for (size_t g = 0; g < G; g++) {
        const uint16_t dh = ld16(s + 4 * g), mh = ld16(s + 4 * g + 2);
        if ((dh & 0x8000) || (dh & 0x7c00) == 0x7c00 || (mh & 0x7c00) == 0x7c00) return KVZ_ERR_FORMAT;
        const float df = kvz_kvrow_f16_to_f32(dh), mf = kvz_kvrow_f16_to_f32(mh);
        for (int i = 0; i < KVZ_KV_QGROUP; i++) {
            const size_t e = g * KVZ_KV_QGROUP + i;
            const int qv = (nib[e / 2] >> (4 * (e & 1))) & 15;
            y[e] = mf + df * (float)qv;
        }
    }
    return 0;
}

static int chk_q8(const uint8_t *s, size_t n)
{
    const size_t G = n / KVZ_KV_QGROUP;
    for (size_t g = 0; g < G; g++) {
        const uint16_t dh = ld16(s + 2 * g);
        if ((dh & 0x8000) || (dh & 0x7c00) == 0x7c00) return KVZ_ERR_FORMAT;
    }
    /* any byte 0x80 (-128)? eight at a time: b ^ 0x80 is zero exactly there, and
     * (x - 0x01..) & ~x & 0x80.. is nonzero iff some byte of x is zero */
    const uint8_t *q = s + 2 * G;
    uint64_t hit = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, q + i, 8);
        w ^= 0x8080808080808080ull;
        hit |= (w - 0x0101010101010101ull) & ~w & 0x8080808080808080ull;
    }
    for (; i < n; i++) hit |= q[i] == 0x80;
    return hit ? KVZ_ERR_FORMAT : 0;
}

static int chk_q4(const uint8_t *s, size_t n)
{
    const size_t G = n / KVZ_KV_QGROUP;
    for (size_t g = 0; g < G; g++) {
        const uint16_t dh = ld16(s + 4 * g), mh = ld16(s + 4 * g + 2);
        if ((dh & 0x8000) || (dh & 0x7c00) == 0x7c00 || (mh & 0x7c00) == 0x7c00) return KVZ_ERR_FORMAT;
    }
    return 0;
}

static const kvz_kvrow_codec CODECS[] = {
    {KVZ_KV_F32, "f32", 1, enc_f32, dec_f32},
    {KVZ_KV_F16, "f16", 1, enc_f16, dec_f16},
    {KVZ_KV_BF16, "bf16", 1, enc_bf16, dec_bf16},
    {KVZ_KV_Q8, "q8", 2, enc_q8, dec_q8},
    {KVZ_KV_Q4, "q4", 2, enc_q4, dec_q4},
};

const kvz_kvrow_codec *kvz_kvrow_codec_get(int dtype)
{
    return dtype >= 0 && dtype < (int)(sizeof CODECS / sizeof CODECS[0]) ? &CODECS[dtype] : NULL;
}

const kvz_kvrow_codec *kvz_kvrow_codec_find(const char *name)
{
    for (size_t i = 0; name && i < sizeof CODECS / sizeof CODECS[0]; i++)
        if (!strcmp(name, CODECS[i].name)) return &CODECS[i];
    return NULL;
}

/* ========================================================================= */
/* Many rows                                                                   */

static int args(int dtype, const void *a, const void *b, size_t n_rows, size_t hd, size_t *rb,
                const kvz_kvrow_codec **c)
{
    *c = kvz_kvrow_codec_get(dtype);
    if (!*c) return kvz_error_set(KVZ_ERR_ARG, "kvz_kvrow: unknown KV dtype %d", dtype);
    *rb = kvz_kv_row_bytes(dtype, hd);
    if (!*rb || hd == 0)
        return kvz_error_set(KVZ_ERR_ARG, "kvz_kvrow: %s cannot hold rows of %zu elements (q8/q4: "
                             "a multiple of %d)", (*c)->name, hd, KVZ_KV_QGROUP);
    if (n_rows && (!a || !b)) return kvz_error_set(KVZ_ERR_ARG, "kvz_kvrow: NULL rows");
    return 0;
}

int kvz_kvrow_encode(int dtype, const float *src, size_t n_rows, size_t head_dim, void *dst)
{
    size_t rb;
    const kvz_kvrow_codec *c;
    int err = args(dtype, src, dst, n_rows, head_dim, &rb, &c);
    for (size_t r = 0; r < n_rows && !err; r++)
        if (c->encode(src + r * head_dim, head_dim, (uint8_t *)dst + r * rb))
            err = kvz_error_set(KVZ_ERR_ARG, "kvz_kvrow: row %zu holds NaN or Inf: %s cannot "
                                "encode it", r, c->name);
    return err;
}

int kvz_kvrow_decode(int dtype, const void *src, size_t n_rows, size_t head_dim, float *dst)
{
    size_t rb;
    const kvz_kvrow_codec *c;
    int err = args(dtype, src, dst, n_rows, head_dim, &rb, &c);
    for (size_t r = 0; r < n_rows && !err; r++)
        if (c->decode((const uint8_t *)src + r * rb, head_dim, dst + r * head_dim))
            err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_kvrow: %s row %zu: bad scale block (NaN, "
                                "Inf or negative scale, or q8 value -128)", c->name, r);
    return err;
}

int kvz_kvrow_check(int dtype, const void *src, size_t n_rows, size_t head_dim, uint64_t *bad_row)
{
    size_t rb;
    const kvz_kvrow_codec *c;
    int err = args(dtype, src, src, n_rows, head_dim, &rb, &c);
    if (err || (dtype != KVZ_KV_Q8 && dtype != KVZ_KV_Q4)) return err;
    for (size_t r = 0; r < n_rows; r++) {
        const uint8_t *s = (const uint8_t *)src + r * rb;
        if (dtype == KVZ_KV_Q8 ? chk_q8(s, head_dim) : chk_q4(s, head_dim)) {
            if (bad_row) *bad_row = r;
            return kvz_error_set(KVZ_ERR_FORMAT, "kvz_kvrow: %s row %zu: bad scale block (NaN, "
                                 "Inf or negative scale, or q8 value -128)", c->name, r);
        }
    }
    return 0;
}

int kvz_kvrow_round_trip(int dtype, float *rows, size_t n_rows, size_t head_dim)
{
    size_t rb;
    const kvz_kvrow_codec *c;
    int err = args(dtype, rows, rows, n_rows, head_dim, &rb, &c);
    if (err) return err;
    if (head_dim > 1024) return kvz_error_set(KVZ_ERR_ARG, "kvz_kvrow: head_dim %zu > 1024", head_dim);
    uint8_t buf[4 * 1024];
    for (size_t r = 0; r < n_rows; r++) {
        float *x = rows + r * head_dim;
        if (c->encode(x, head_dim, buf))
            return kvz_error_set(KVZ_ERR_ARG, "kvz_kvrow: row %zu holds NaN or Inf", r);
        if (c->decode(buf, head_dim, x))
            return kvz_error_set(KVZ_ERR_INTERNAL, "kvz_kvrow: %s row %zu does not decode", c->name, r);
    }
    return 0;
}
