/* Decode attention kernels (see kvz_attn.h). */
#include "kvz_attn.h"

#include "kvz_qdot.h"
#include "kvz_vmath.h"

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

static inline int key_seen(const kvz_attn_keys *kk, const int64_t *vis, const int32_t *qpos, int i, int64_t t)
{
    if (t < kk->n) return t < vis[i];
    const int32_t op = kk->opos[t - kk->n];
    return op >= 0 && op <= qpos[i];
}
static inline const float *key_row(const kvz_attn_keys *kk, int64_t t)
{
    return t < kk->n ? kk->k + (size_t)t * kk->ld : kk->ok + (size_t)(t - kk->n) * kk->old;
}
static inline const float *val_row(const kvz_attn_keys *kk, int64_t t)
{
    return t < kk->n ? kk->v + (size_t)t * kk->ld : kk->ov + (size_t)(t - kk->n) * kk->old;
}
/* one past the last key any query sees */
static int64_t keys_end(const kvz_attn_keys *kk, const int64_t *vis, const int32_t *qpos, int nq)
{
    int64_t e = 0;
    for (int i = 0; i < nq; i++) {
        int64_t ei = vis[i] < kk->n ? vis[i] : kk->n;
        for (int64_t j = kk->nout - 1; j >= 0; j--)
            if (key_seen(kk, vis, qpos, i, kk->n + j)) {
                ei = kk->n + j + 1;
                break;
            }
        e = ei > e ? ei : e;
    }
    return e;
}

/* Keys one at a time, online softmax per row: m = running max, l = running sum of
 * exp(s - m), acc = running sum of exp(s - m) v (rescaled when m grows). */
static void flash_ref(const float *q, int64_t ldq, int nq, int grp, int hd, const kvz_attn_keys *kk,
                      const int64_t *vis, const int32_t *qpos, float scale, float *o, int64_t ldo, float *acc)
{
    const int64_t nt = kk->n + kk->nout;
    for (int i = 0; i < nq; i++)
        for (int g = 0; g < grp; g++) {
            const float *qr = q + (size_t)i * ldq + (size_t)g * hd;
            float m = -INFINITY, l = 0.0f;
            for (int d = 0; d < hd; d++) acc[d] = 0.0f;
            for (int64_t t = 0; t < nt; t++) {
                if (!key_seen(kk, vis, qpos, i, t)) continue;
                const float *kt = key_row(kk, t), *vt = val_row(kk, t);
                float s = 0.0f;
                for (int d = 0; d < hd; d++) s += qr[d] * kt[d];
                s *= scale;
                if (s > m) {
                    const float a = kvz_expf(m - s);
                    l *= a;
                    for (int d = 0; d < hd; d++) acc[d] *= a;
                    m = s;
                }
                const float pt = kvz_expf(s - m);
                l += pt;
                for (int d = 0; d < hd; d++) acc[d] += pt * vt[d];
            }
            float *orow = o + (size_t)i * ldo + (size_t)g * hd;
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (int d = 0; d < hd; d++) orow[d] = acc[d] * inv;
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
/* exp of 8 lanes: kvz_expf's reduction and polynomial (relative error < 2e-7 on
 * [-87, 88]); lanes below -87.3 (and -inf) give exactly 0 */
AVX2_TARGET static inline float hmax8(__m256 a)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
AVX2_TARGET static inline float hsum8(__m256 a)
{
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

enum { FL_RC = 6, FL_KT = KVZ_ATTN_FLASH_KT };

/* work layout: Qs (R6 x hd, scaled queries), O (R6 x hd), KT (hd x KT, the key
 * tile transposed), S (6 x KT), m, l (R6), with R6 = nq*grp rounded up to 6 (all
 * but m and l on 32-byte boundaries: hd % 16 == 0) */
static size_t flash_r6(int nq, int grp) { return ((size_t)nq * grp + FL_RC - 1) / FL_RC * FL_RC; }

/* hd % 16 == 0 */
AVX2_TARGET static void flash_avx2(const float *q, int64_t ldq, int nq, int grp, int hd, const kvz_attn_keys *kk,
                                   const int64_t *vis, const int32_t *qpos, float scale, float *o, int64_t ldo,
                                   float *work)
{
    const size_t R6 = flash_r6(nq, grp), R = (size_t)nq * grp;
    float *Qs = work, *O = Qs + R6 * hd, *KT = O + R6 * hd, *S = KT + (size_t)hd * FL_KT, *M = S + FL_RC * FL_KT,
          *L = M + R6;
    const int64_t kmax = keys_end(kk, vis, qpos, nq);
    for (size_t r = 0; r < R6; r++) {
        float *qs = Qs + r * hd;
        if (r < R) {
            const float *qr = q + (r / grp) * (size_t)ldq + (r % grp) * (size_t)hd;
            for (int d = 0; d < hd; d++) qs[d] = qr[d] * scale;
        } else {
            for (int d = 0; d < hd; d++) qs[d] = 0.0f;
        }
        for (int d = 0; d < hd; d++) O[r * hd + d] = 0.0f;
        M[r] = -INFINITY;
        L[r] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < kmax; t0 += FL_KT) {
        const int tn = kmax - t0 < FL_KT ? (int)(kmax - t0) : FL_KT;
        /* KT[d][j] = k_{t0+j}[d]; zero columns past the run */
        for (int j = 0; j < FL_KT; j++) {
            if (j < tn) {
                const float *kr = key_row(kk, t0 + j);
                for (int d = 0; d < hd; d++) KT[(size_t)d * FL_KT + j] = kr[d];
            } else {
                for (int d = 0; d < hd; d++) KT[(size_t)d * FL_KT + j] = 0.0f;
            }
        }
        for (size_t c0 = 0; c0 < R6; c0 += FL_RC) {
            /* cv[r]: one past the last key of the tile row r sees; a tile reaching
             * into the output slots gets an explicit mask */
            int64_t cv[FL_RC], cmax = 0;
            const int mixed = t0 + tn > kk->n;
            uint8_t mk[FL_RC][FL_KT];
            for (int r = 0; r < FL_RC; r++) {
                if (!mixed) {
                    const int64_t vr = c0 + r < R ? vis[(c0 + r) / grp] - t0 : 0;
                    cv[r] = vr < 0 ? 0 : vr > tn ? tn : vr;
                } else {
                    cv[r] = 0;
                    for (int j = 0; j < FL_KT; j++) {
                        mk[r][j] = c0 + r < R && j < tn && key_seen(kk, vis, qpos, (int)((c0 + r) / grp), t0 + j);
                        if (mk[r][j]) cv[r] = j + 1;
                    }
                }
                cmax = cv[r] > cmax ? cv[r] : cmax;
            }
            if (cmax == 0) continue;
            const int ncol = (int)((cmax + 15) / 16 * 16);
            /* S = Qs KT over the 6 rows, 16 keys at a time */
            const float *qc = Qs + c0 * hd;
            for (int j0 = 0; j0 < ncol; j0 += 16) {
                __m256 a[FL_RC][2];
                for (int r = 0; r < FL_RC; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
                const float *kt = KT + j0;
                for (int d = 0; d < hd; d++, kt += FL_KT) {
                    const __m256 k0 = _mm256_load_ps(kt), k1 = _mm256_load_ps(kt + 8);
                    for (int r = 0; r < FL_RC; r++) {
                        const __m256 qv = _mm256_broadcast_ss(qc + (size_t)r * hd + d);
                        a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
                        a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
                    }
                }
                for (int r = 0; r < FL_RC; r++) {
                    _mm256_store_ps(S + r * FL_KT + j0, a[r][0]);
                    _mm256_store_ps(S + r * FL_KT + j0 + 8, a[r][1]);
                }
            }
            /* online softmax: S becomes exp(s - m_new) (0 where masked) */
            float alpha[FL_RC];
            for (int r = 0; r < FL_RC; r++) {
                float *sr = S + r * FL_KT;
                const size_t row = c0 + r;
                if (cv[r] == 0) {
                    alpha[r] = 1.0f;
                    for (int j = 0; j < ncol; j++) sr[j] = 0.0f;
                    continue;
                }
                if (mixed) {
                    for (int j = 0; j < ncol; j++)
                        if (!mk[r][j]) sr[j] = -INFINITY;
                } else {
                    for (int j = (int)cv[r]; j < ncol; j++) sr[j] = -INFINITY;
                }
                __m256 mv = _mm256_set1_ps(-INFINITY);
                for (int j = 0; j < ncol; j += 8) mv = _mm256_max_ps(mv, _mm256_load_ps(sr + j));
                const float mx = hmax8(mv), mold = M[row], mnew = mx > mold ? mx : mold;
                const __m256 vm = _mm256_set1_ps(mnew);
                __m256 sum = _mm256_setzero_ps();
                for (int j = 0; j < ncol; j += 8) {
                    const __m256 e = kvz_expf8(_mm256_sub_ps(_mm256_load_ps(sr + j), vm));
                    _mm256_store_ps(sr + j, e);
                    sum = _mm256_add_ps(sum, e);
                }
                alpha[r] = mold == -INFINITY ? 0.0f : kvz_expf(mold - mnew);
                M[row] = mnew;
                L[row] = L[row] * alpha[r] + hsum8(sum);
            }
            /* O = alpha O + P V over the keys this group sees */
            float *oc = O + c0 * hd;
            for (int d0 = 0; d0 < hd; d0 += 16) {
                __m256 a[FL_RC][2];
                for (int r = 0; r < FL_RC; r++) {
                    const __m256 al = _mm256_set1_ps(alpha[r]);
                    a[r][0] = _mm256_mul_ps(al, _mm256_load_ps(oc + (size_t)r * hd + d0));
                    a[r][1] = _mm256_mul_ps(al, _mm256_load_ps(oc + (size_t)r * hd + d0 + 8));
                }
                for (int j = 0; j < cmax; j++) {
                    const float *vt = val_row(kk, t0 + j) + d0;
                    const __m256 v0 = _mm256_loadu_ps(vt), v1 = _mm256_loadu_ps(vt + 8);
                    for (int r = 0; r < FL_RC; r++) {
                        const __m256 pv = _mm256_broadcast_ss(S + r * FL_KT + j);
                        a[r][0] = _mm256_fmadd_ps(pv, v0, a[r][0]);
                        a[r][1] = _mm256_fmadd_ps(pv, v1, a[r][1]);
                    }
                }
                for (int r = 0; r < FL_RC; r++) {
                    _mm256_store_ps(oc + (size_t)r * hd + d0, a[r][0]);
                    _mm256_store_ps(oc + (size_t)r * hd + d0 + 8, a[r][1]);
                }
            }
        }
    }
    for (size_t r = 0; r < R; r++) {
        float *orow = o + (r / grp) * (size_t)ldo + (r % grp) * (size_t)hd;
        const float inv = L[r] > 0.0f ? 1.0f / L[r] : 0.0f;
        for (int d = 0; d < hd; d++) orow[d] = O[r * hd + d] * inv;
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

size_t kvz_attn_flash_work_floats(int nq, int grp, int hd)
{
#ifdef KVZ_ATTN_X86
    const size_t R6 = flash_r6(nq, grp);
    return 2 * R6 * (size_t)hd + 2 * R6 + (size_t)hd * FL_KT + (size_t)FL_RC * FL_KT;
#else
    (void)nq;
    (void)grp;
    return (size_t)hd;
#endif
}

void kvz_attn_flash(int isa, const float *q, int64_t ldq, int nq, int grp, int hd, const kvz_attn_keys *keys,
                    const int64_t *vis, const int32_t *qpos, float scale, float *o, int64_t ldo, float *work)
{
#ifdef KVZ_ATTN_X86
    if (use_avx2(isa) && hd % 16 == 0) {
        flash_avx2(q, ldq, nq, grp, hd, keys, vis, qpos, scale, o, ldo, work);
        return;
    }
#endif
    flash_ref(q, ldq, nq, grp, hd, keys, vis, qpos, scale, o, ldo, work);
}
