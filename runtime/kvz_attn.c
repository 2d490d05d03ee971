/* Decode attention kernels (see kvz_attn.h). */
#include "kvz_attn.h"

#include "kvz_qdot.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVZ_ATTN_X86 1
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------------ */
/* scalar reference                                                         */

static void scores_ref(const float *q, int grp, int hd, const float *k, int64_t ldk, int64_t nt, float scale,
                       float *s, int64_t lds)
{
    for (int g = 0; g < grp; g++)
        for (int64_t t = 0; t < nt; t++) {
            const float *qg = q + (size_t)g * hd, *kt = k + (size_t)t * ldk;
            float acc = 0.0f;
            for (int d = 0; d < hd; d++) acc += qg[d] * kt[d];
            s[(size_t)g * lds + t] = scale * acc;
        }
}

static void pv_ref(const float *p, int64_t ldp, int grp, const float *v, int64_t ldv, int64_t nt, int hd,
                   float *o)
{
    for (int g = 0; g < grp; g++)
        for (int64_t t = 0; t < nt; t++) {
            const float w = p[(size_t)g * ldp + t], *vt = v + (size_t)t * ldv;
            float *og = o + (size_t)g * hd;
            for (int d = 0; d < hd; d++) og[d] += w * vt[d];
        }
}

/* ------------------------------------------------------------------------ */
/* AVX2 + FMA                                                               */

#ifdef KVZ_ATTN_X86
#define AVX2_TARGET __attribute__((target("avx2,fma")))

/* lane j of the result = the sum of the 8 lanes of a[j] (the same arithmetic for
 * every j, whatever the other inputs) */
AVX2_TARGET static inline __m256 hsum8x8(const __m256 a[8])
{
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    /* h0123 = [a0 a1 a2 a3 (low 128) | a0 a1 a2 a3 (high 128)] partial sums */
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

/* hd % 8 == 0. Keys go 8 at a time; a short last group repeats its last key in the
 * missing lanes (discarded), so every key is reduced the same way wherever it sits. */
AVX2_TARGET static void scores_avx2(const float *q, int grp, int hd, const float *k, int64_t ldk, int64_t nt,
                                    float scale, float *s, int64_t lds)
{
    const __m256 vs = _mm256_set1_ps(scale);
    for (int64_t t0 = 0; t0 < nt; t0 += 8) {
        const int r = nt - t0 < 8 ? (int)(nt - t0) : 8;
        const float *kp[8];
        for (int j = 0; j < 8; j++) kp[j] = k + (size_t)(t0 + (j < r ? j : r - 1)) * ldk;
        for (int g = 0; g < grp; g++) {
            const float *qg = q + (size_t)g * hd;
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
            for (int d = 0; d < hd; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + d);
                for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[j] + d), a[j]);
            }
            const __m256 res = _mm256_mul_ps(hsum8x8(a), vs);
            float *sg = s + (size_t)g * lds + t0;
            if (r == 8) {
                _mm256_storeu_ps(sg, res);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, res);
                for (int j = 0; j < r; j++) sg[j] = tmp[j];
            }
        }
    }
}

/* hd % 32 == 0: 32 output floats of one query head in 4 registers over all t */
AVX2_TARGET static void pv_avx2(const float *p, int64_t ldp, int grp, const float *v, int64_t ldv, int64_t nt,
                                int hd, float *o)
{
    for (int g = 0; g < grp; g++) {
        const float *pg = p + (size_t)g * ldp;
        for (int d = 0; d < hd; d += 32) {
            float *od = o + (size_t)g * hd + d;
            __m256 o0 = _mm256_loadu_ps(od), o1 = _mm256_loadu_ps(od + 8);
            __m256 o2 = _mm256_loadu_ps(od + 16), o3 = _mm256_loadu_ps(od + 24);
            const float *vt = v + d;
            for (int64_t t = 0; t < nt; t++, vt += ldv) {
                const __m256 w = _mm256_broadcast_ss(pg + t);
                o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt), o0);
                o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8), o1);
                o2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 16), o2);
                o3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 24), o3);
            }
            _mm256_storeu_ps(od, o0);
            _mm256_storeu_ps(od + 8, o1);
            _mm256_storeu_ps(od + 16, o2);
            _mm256_storeu_ps(od + 24, o3);
        }
    }
}
#endif

/* ------------------------------------------------------------------------ */
/* dispatch                                                                 */

static int use_avx2(int isa)
{
#ifdef KVZ_ATTN_X86
    return isa >= KVZ_ISA_AVX2 && kvz_qdot_cpu_isa() >= KVZ_ISA_AVX2;
#else
    (void)isa;
    return 0;
#endif
}

void kvz_attn_scores(int isa, const float *q, int grp, int hd, const float *k, int64_t ldk, int64_t nt,
                     float scale, float *s, int64_t lds)
{
#ifdef KVZ_ATTN_X86
    if (use_avx2(isa) && hd % 8 == 0) {
        scores_avx2(q, grp, hd, k, ldk, nt, scale, s, lds);
        return;
    }
#endif
    scores_ref(q, grp, hd, k, ldk, nt, scale, s, lds);
}

void kvz_attn_pv(int isa, const float *p, int64_t ldp, int grp, const float *v, int64_t ldv, int64_t nt,
                 int hd, float *o)
{
#ifdef KVZ_ATTN_X86
    if (use_avx2(isa) && hd % 32 == 0) {
        pv_avx2(p, ldp, grp, v, ldv, nt, hd, o);
        return;
    }
#endif
    pv_ref(p, ldp, grp, v, ldv, nt, hd, o);
}
