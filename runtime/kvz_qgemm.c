/* Quantized weight rows × n 8-bit activation rows (see kvz_qgemm.h).
 *
 * Every weight block is reduced to the form kvz_qdot uses, per 32-element block
 * b and half h (elements 16h..16h+15):
 *     w_e = dw · isc_h · u_e + off_h     (u_e the raw quant, isc_h an integer)
 *     dot_b = d_b · (dw · Σ_h isc_h Σ_e u_e q_e) + Σ_h off_h · d_b · s_h
 * with the activation block scale d_b and half sums s_h of kvz_q8_quantize.
 *
 * Activation buffer: fp32 aux[n][k/32][8] = {d_b, d_b·(s_0+s_1), d_b·s_0, d_b·s_1,
 * int32 s_0+s_1, 0, 0, 0}, then n kvz_q8_quantize rows.
 *
 * Tile of 8 weight rows, one record of REC bytes per 32-element block:
 *   u[8 groups][8 rows][4]  raw quants, group g = elements 4g..4g+3 (Q8_0: signed)
 *   isc[2][16] int16        integer scale of half h, twice per row (vpmaddwd pairs)
 *   dw[8] fp32              block scale per row
 *   off[2][8] fp32          offset of half h per row
 * One vector of u holds 4 elements of each of the 8 rows; vpmaddubsw against the
 * 4 activation bytes broadcast to every lane, summed over the 8 groups, gives each
 * 32-bit lane the dot of one row with the block: the outputs of 8 rows for a token
 * come out as one fp32 vector, with no horizontal sums.
 *
 * int16 saturation: vpmaddubsw adds two products u·q with |q| <= 127, so a sum of
 * L results stays below 2^15 when L·2·umax·127 < 32768: 4-bit quants (umax 15)
 * could sum all 8 groups (30480) but sum 4 like 5-bit ones (31496; with 8 the
 * compiler's add tree spills registers, and no speed difference showed on the
 * shared machine), 6-bit (63) 2 (32004);
 * Q8_0 (signed, by the sign trick: |w| <= 128) goes to int32 after every group. */
#include "kvz_qgemm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_qdot.h"
#include "kvz_quant.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVZ_QGEMM_X86 1
#include <immintrin.h>
#endif

#ifndef NTMAX
#define NTMAX 4
#endif
#define REC 416
#define OFF_ISC 256
#define OFF_DW 320
#define OFF_OFF 352
/* per-thread panel budget: the unpacked tiles stay in L2 while every token group
 * runs over them */
#define PANEL_BUDGET KVZ_QGEMM_PANEL_MAX_BYTES
/* the k dimension goes in chunks of this many elements (a multiple of 256): a
 * token group's activation bytes of one chunk stay in L1 across the panel's tiles,
 * and the panel holds more rows; the outputs accumulate over the chunks in fp32 */
#define KCHUNK 1024

/* U4/U5: 4/5-bit quants with an fp32 offset per row; U4O/U5O: Q4_0/Q5_0, whose
 * offset (-8, -16 times the scale) is subtracted in int32 as 8·s, 16·s */
enum { V_U4, V_U5, V_U6, V_S8, V_U4O, V_U5O, V_NONE };

static int variant(uint32_t t)
{
    switch (t) {
    case KVZ_TYPE_Q4_0: return V_U4O;
    case KVZ_TYPE_Q5_0: return V_U5O;
    case KVZ_TYPE_Q4_1: case KVZ_TYPE_Q4_K: return V_U4;
    case KVZ_TYPE_Q5_1: case KVZ_TYPE_Q5_K: return V_U5;
    case KVZ_TYPE_Q6_K: return V_U6;
    case KVZ_TYPE_Q8_0: return V_S8;
    default: return V_NONE;
    }
}

int kvz_qgemm_supported(uint32_t type) { return variant(type) != V_NONE; }

int kvz_qgemm_available(void)
{
#ifdef KVZ_QGEMM_X86
    return kvz_qdot_active_isa() >= KVZ_ISA_AVX2;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------ */
/* activations                                                              */

size_t kvz_qgemm_act_bytes(int64_t n, int64_t k)
{
    return (size_t)n * ((size_t)(k / 32) * 32 + kvz_q8_row_bytes(k));
}

static float *act_aux(const void *act, int64_t k, int64_t t) { return (float *)act + (size_t)t * (size_t)(k / 32) * 8; }
static const uint8_t *act_row(const void *act, int64_t n, int64_t k, int64_t t)
{
    return (const uint8_t *)act + (size_t)n * (size_t)(k / 32) * 32 + (size_t)t * kvz_q8_row_bytes(k);
}

void kvz_qgemm_quantize(const float *x, int64_t n, int64_t k, int64_t i0, int64_t i1, void *act)
{
    for (int64_t t = i0; t < i1; t++) {
        uint8_t *row = (uint8_t *)act_row(act, n, k, t);
        kvz_q8_quantize(x + (size_t)t * (size_t)k, k, row);
        float *aux = act_aux(act, k, t);
        for (int64_t b = 0; b < k / 32; b++) {
            float d;
            int16_t s[2];
            memcpy(&d, row + k + 4 * b, 4);
            memcpy(s, row + k + 4 * (k / 32) + 4 * b, 4);
            const int32_t ss = s[0] + s[1];
            float *a = aux + 8 * b;
            a[0] = d;
            a[1] = d * (float)ss;
            a[2] = d * (float)s[0];
            a[3] = d * (float)s[1];
            memcpy(a + 4, &ss, 4);
            a[5] = a[6] = a[7] = 0.0f;
        }
    }
}

/* ------------------------------------------------------------------------ */
/* weight blocks                                                            */

/* Block b of a row: integer scales isc, block scale dw and offsets off per half
 * (the raw quants come from unpack_u below). */
static void block_scales(uint32_t t, const uint8_t *w, int64_t b, int isc[2], float *dw, float off[2])
{
    isc[0] = isc[1] = 1;
    off[0] = off[1] = 0.0f;
    switch (t) {
    case KVZ_TYPE_Q8_0: *dw = kvz_quant_f16(w + 34 * b); break;
    case KVZ_TYPE_Q4_0: *dw = kvz_quant_f16(w + 18 * b); off[0] = off[1] = -8.0f * *dw; break;
    case KVZ_TYPE_Q4_1: *dw = kvz_quant_f16(w + 20 * b); off[0] = off[1] = kvz_quant_f16(w + 20 * b + 2); break;
    case KVZ_TYPE_Q5_0: *dw = kvz_quant_f16(w + 22 * b); off[0] = off[1] = -16.0f * *dw; break;
    case KVZ_TYPE_Q5_1: *dw = kvz_quant_f16(w + 24 * b); off[0] = off[1] = kvz_quant_f16(w + 24 * b + 2); break;
    case KVZ_TYPE_Q4_K: case KVZ_TYPE_Q5_K: {
        const uint8_t *x = w + (t == KVZ_TYPE_Q4_K ? 144 : 176) * (b >> 3);
        int sc, m;
        kvz_kq_scale_min((int)(b & 7), x + 4, &sc, &m);
        isc[0] = isc[1] = sc;
        *dw = kvz_quant_f16(x);
        off[0] = off[1] = -kvz_quant_f16(x + 2) * (float)m;
        break;
    }
    case KVZ_TYPE_Q6_K: {
        const int j = (int)(b & 7);
        const uint8_t *x = w + 210 * (b >> 3);
        const int8_t *sc = (const int8_t *)(x + 192) + 2 * j;
        *dw = kvz_quant_f16(x + 208);
        for (int h = 0; h < 2; h++) { isc[h] = sc[h]; off[h] = -32.0f * (*dw * (float)sc[h]); }
        break;
    }
    }
}

static int64_t kchunk(int64_t k) { return k < KCHUNK ? k : KCHUNK; }

int64_t kvz_qgemm_panel_rows(int64_t k)
{
    const size_t per_row = (size_t)(kchunk(k) / 32) * REC / 8;
    int64_t p = per_row ? (int64_t)(PANEL_BUDGET / per_row) / 8 * 8 : 512;
    return p < 8 ? 8 : p > 512 ? 512 : p;
}

size_t kvz_qgemm_panel_bytes(int64_t k) { return (size_t)(kvz_qgemm_panel_rows(k) / 8) * (size_t)(kchunk(k) / 32) * REC; }

/* ------------------------------------------------------------------------ */
/* AVX2 microkernel: one tile (8 rows) × NT tokens (1..4)                   */

#ifdef KVZ_QGEMM_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

/* low nibbles of 16 bytes -> elements 0..15, high nibbles -> 16..31 */
static inline __m256i nib16(const uint8_t *p)
{
    const __m128i r = _mm_loadu_si128((const __m128i *)(const void *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r, 4), r), _mm256_set1_epi8(15));
}
/* byte e = 0x10 if bit e of the u32 at p is set */
static inline __m256i bit4_32(const uint8_t *p)
{
    uint32_t qh;
    memcpy(&qh, p, 4);
    const __m256i idx = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), idx), sel);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, sel), _mm256_set1_epi8(0x10));
}

/* The 32 raw quants of block b of a row (Q8_0: the signed values). */
static inline __m256i unpack_u(uint32_t t, const uint8_t *w, int64_t b)
{
    const __m256i m4 = _mm256_set1_epi8(15);
    switch (t) {
    case KVZ_TYPE_Q8_0: return _mm256_loadu_si256((const __m256i *)(const void *)(w + 34 * b + 2));
    case KVZ_TYPE_Q4_0: return nib16(w + 18 * b + 2);
    case KVZ_TYPE_Q4_1: return nib16(w + 20 * b + 4);
    case KVZ_TYPE_Q5_0: return _mm256_or_si256(nib16(w + 22 * b + 6), bit4_32(w + 22 * b + 2));
    case KVZ_TYPE_Q5_1: return _mm256_or_si256(nib16(w + 24 * b + 8), bit4_32(w + 24 * b + 4));
    case KVZ_TYPE_Q4_K: case KVZ_TYPE_Q5_K: {
        const int j = (int)(b & 7);
        const uint8_t *x = w + (t == KVZ_TYPE_Q4_K ? 144 : 176) * (b >> 3);
        const __m256i v = _mm256_loadu_si256(
            (const __m256i *)(const void *)(x + (t == KVZ_TYPE_Q4_K ? 16 : 48) + 32 * (j >> 1)));
        __m256i u = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, m4);
        if (t == KVZ_TYPE_Q5_K) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)(x + 16));
            const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
            u = _mm256_or_si256(u, _mm256_slli_epi16(hb, 4));
        }
        return u;
    }
    case KVZ_TYPE_Q6_K: {
        const int j = (int)(b & 7), half = j >> 2, g = j & 3;
        const uint8_t *x = w + 210 * (b >> 3);
        const __m256i l4 = _mm256_loadu_si256((const __m256i *)(const void *)(x + 64 * half + 32 * (g & 1)));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)(x + 128 + 32 * half));
        const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(l4, 4) : l4, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    default: return _mm256_setzero_si256();
    }
}

/* Unpack rows [0, nr) (nr <= 8; missing rows are zero) of blocks [b0, b0 + nb) into
 * a tile: each row's 32 quants as 8 dwords, transposed 8 x 8 so that group g holds
 * dword g of every row. */
static void pack_tile(uint32_t t, const uint8_t *w, size_t row_bytes, int nr, int64_t b0, int64_t nb, uint8_t *tile)
{
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *rec = tile + (size_t)b * REC;
        int16_t isc16[2][16];
        float dwv[8], offv[2][8];
        __m256i R[8];
        for (int r = 0; r < 8; r++) {
            int isc[2] = {0, 0};
            float dw = 0.0f, off[2] = {0.0f, 0.0f};
            if (r < nr) {
                const uint8_t *row = w + (size_t)r * row_bytes;
                R[r] = unpack_u(t, row, b0 + b);
                block_scales(t, row, b0 + b, isc, &dw, off);
            } else {
                R[r] = _mm256_setzero_si256();
            }
            for (int h = 0; h < 2; h++) {
                isc16[h][2 * r] = isc16[h][2 * r + 1] = (int16_t)isc[h];
                offv[h][r] = off[h];
            }
            dwv[r] = dw;
        }
        __m256i T[8], S[8];
        for (int i = 0; i < 4; i++) {
            T[2 * i] = _mm256_unpacklo_epi32(R[2 * i], R[2 * i + 1]);
            T[2 * i + 1] = _mm256_unpackhi_epi32(R[2 * i], R[2 * i + 1]);
        }
        for (int i = 0; i < 2; i++) { /* rows 4i..4i+3 */
            S[4 * i] = _mm256_unpacklo_epi64(T[4 * i], T[4 * i + 2]);     /* dwords 0 | 4 */
            S[4 * i + 1] = _mm256_unpackhi_epi64(T[4 * i], T[4 * i + 2]); /* 1 | 5 */
            S[4 * i + 2] = _mm256_unpacklo_epi64(T[4 * i + 1], T[4 * i + 3]); /* 2 | 6 */
            S[4 * i + 3] = _mm256_unpackhi_epi64(T[4 * i + 1], T[4 * i + 3]); /* 3 | 7 */
        }
        for (int g = 0; g < 4; g++) {
            _mm256_storeu_si256((__m256i *)(void *)(rec + 32 * g), _mm256_permute2x128_si256(S[g], S[4 + g], 0x20));
            _mm256_storeu_si256((__m256i *)(void *)(rec + 32 * (g + 4)), _mm256_permute2x128_si256(S[g], S[4 + g], 0x31));
        }
        memcpy(rec + OFF_ISC, isc16, sizeof isc16);
        memcpy(rec + OFF_DW, dwv, sizeof dwv);
        memcpy(rec + OFF_OFF, offv, sizeof offv);
    }
}

typedef void (*kern_fn)(const uint8_t *tile, int64_t nb, const int8_t *const *aq, const float *const *ax,
                        float *const *out, int nvalid, int accumulate);

static inline __attribute__((always_inline)) void tile_kernel(const uint8_t *tile, int64_t nb,
                                                              const int8_t *const *aq, const float *const *ax,
                                                              float *const *out, int nvalid, int accumulate,
                                                              const int NT, const int L, const int HALVES,
                                                              const int SIGNED, const int ISHIFT)
{
    __m256 acc[4];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = tile + (size_t)b * REC;
        const __m256i isc0 = _mm256_loadu_si256((const __m256i *)(const void *)(rec + OFF_ISC));
        const __m256i isc1 = HALVES ? _mm256_loadu_si256((const __m256i *)(const void *)(rec + OFF_ISC + 32)) : isc0;
        __m256i i32[4], s16[4];
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(const void *)(rec + 32 * g));
            const __m256i wa = SIGNED ? _mm256_sign_epi8(w, w) : w;
            const __m256i sc = g < 4 ? isc0 : isc1;
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                int32_t v;
                memcpy(&v, aq[t] + 32 * b + 4 * g, 4);
                __m256i a = _mm256_set1_epi32(v);
                if (SIGNED) a = _mm256_sign_epi8(a, w);
                const __m256i p = _mm256_maddubs_epi16(wa, a);
                s16[t] = g % L == 0 ? p : _mm256_add_epi16(s16[t], p);
                if (g % L == L - 1) {
                    const __m256i m = _mm256_madd_epi16(s16[t], sc);
                    i32[t] = g == L - 1 ? m : _mm256_add_epi32(i32[t], m);
                }
            }
        }
        const __m256 dw = _mm256_loadu_ps((const float *)(const void *)(rec + OFF_DW));
        const __m256 off0 = _mm256_loadu_ps((const float *)(const void *)(rec + OFF_OFF));
        const __m256 off1 = _mm256_loadu_ps((const float *)(const void *)(rec + OFF_OFF + 32));
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const float *xa = ax[t] + 8 * b;
            if (ISHIFT) { /* integer offset: - (8 or 16) · Σ q */
                int32_t ss;
                memcpy(&ss, xa + 4, 4);
                i32[t] = _mm256_sub_epi32(i32[t], _mm256_set1_epi32(ss * (1 << ISHIFT)));
            }
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[t]), _mm256_mul_ps(dw, _mm256_broadcast_ss(xa)), acc[t]);
            if (!SIGNED && !ISHIFT) {
                if (HALVES) {
                    acc[t] = _mm256_fmadd_ps(off0, _mm256_broadcast_ss(xa + 2), acc[t]);
                    acc[t] = _mm256_fmadd_ps(off1, _mm256_broadcast_ss(xa + 3), acc[t]);
                } else {
                    acc[t] = _mm256_fmadd_ps(off0, _mm256_broadcast_ss(xa + 1), acc[t]);
                }
            }
        }
    }
    for (int t = 0; t < NT; t++) {
        if (nvalid == 8 && !accumulate) {
            _mm256_storeu_ps(out[t], acc[t]);
        } else if (nvalid == 8) {
            _mm256_storeu_ps(out[t], _mm256_add_ps(_mm256_loadu_ps(out[t]), acc[t]));
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, acc[t]);
            for (int r = 0; r < nvalid; r++) out[t][r] = accumulate ? out[t][r] + tmp[r] : tmp[r];
        }
    }
}

#define KDEF(NAME, NT, L, H, S, I)                                                                       \
    static void NAME(const uint8_t *tile, int64_t nb, const int8_t *const *aq, const float *const *ax,   \
                     float *const *out, int nvalid, int accumulate)                                     \
    {                                                                                                    \
        tile_kernel(tile, nb, aq, ax, out, nvalid, accumulate, NT, L, H, S, I);                          \
    }
#define KDEF4(P, L, H, S, I) KDEF(P##1, 1, L, H, S, I) KDEF(P##2, 2, L, H, S, I) KDEF(P##3, 3, L, H, S, I) \
    KDEF(P##4, 4, L, H, S, I)
KDEF4(k_u4_, 4, 0, 0, 0)
KDEF4(k_u5_, 4, 0, 0, 0)
KDEF4(k_u6_, 2, 1, 0, 0)
KDEF4(k_s8_, 1, 0, 1, 0)
KDEF4(k_u4o_, 4, 0, 0, 3)
KDEF4(k_u5o_, 4, 0, 0, 4)

static const kern_fn KERN[6][4] = {
    {k_u4_1, k_u4_2, k_u4_3, k_u4_4},
    {k_u5_1, k_u5_2, k_u5_3, k_u5_4},
    {k_u6_1, k_u6_2, k_u6_3, k_u6_4},
    {k_s8_1, k_s8_2, k_s8_3, k_s8_4},
    {k_u4o_1, k_u4o_2, k_u4o_3, k_u4o_4},
    {k_u5o_1, k_u5o_2, k_u5o_3, k_u5o_4},
};

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif /* KVZ_QGEMM_X86 */

/* ------------------------------------------------------------------------ */

void kvz_qgemm_rows(uint32_t type, const void *w, size_t row_bytes, int64_t nr, int64_t k, const void *act,
                    int64_t n, float *y, int64_t ldy, int accumulate, void *panel)
{
    const int v = variant(type);
    const int64_t nb = k / 32;
#ifdef KVZ_QGEMM_X86
    if (v != V_NONE && kvz_qgemm_available()) {
        const int64_t ntile = (nr + 7) / 8;
        for (int64_t kc0 = 0; kc0 < k; kc0 += KCHUNK) {
            const int64_t b0 = kc0 / 32, nbc = (k - kc0 < KCHUNK ? k - kc0 : KCHUNK) / 32;
            const size_t tile_bytes = (size_t)nbc * REC;
            for (int64_t i = 0; i < ntile; i++)
                pack_tile(type, (const uint8_t *)w + (size_t)(8 * i) * row_bytes, row_bytes,
                          (int)(nr - 8 * i < 8 ? nr - 8 * i : 8), b0, nbc, (uint8_t *)panel + (size_t)i * tile_bytes);
            for (int64_t t0 = 0; t0 < n; t0 += NTMAX) {
                const int nt = (int)(n - t0 < NTMAX ? n - t0 : NTMAX);
                const int8_t *aq[4];
                const float *ax[4];
                float *out[4];
                for (int t = 0; t < nt; t++) {
                    aq[t] = (const int8_t *)act_row(act, n, k, t0 + t) + kc0;
                    ax[t] = act_aux(act, k, t0 + t) + 8 * b0;
                }
                for (int64_t i = 0; i < ntile; i++) {
                    for (int t = 0; t < nt; t++) out[t] = y + (size_t)(t0 + t) * (size_t)ldy + 8 * i;
                    KERN[v][nt - 1]((const uint8_t *)panel + (size_t)i * tile_bytes, nbc, aq, ax, out,
                                    (int)(nr - 8 * i < 8 ? nr - 8 * i : 8), accumulate || kc0 > 0);
                }
            }
        }
        return;
    }
#endif
    (void)panel;
    (void)nb;
    /* no AVX2: the per-row dot products on the same activations */
    for (int64_t r = 0; r < nr; r++)
        for (int64_t t = 0; t < n; t++) {
            const float val = kvz_qdot(type, (const uint8_t *)w + (size_t)r * row_bytes, act_row(act, n, k, t), k);
            float *o = y + (size_t)t * (size_t)ldy + r;
            *o = accumulate ? *o + val : val;
        }
}
