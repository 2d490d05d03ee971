/* kvz_attn: the decode attention kernels (scores q·k, probability-weighted value
 * sums), every ISA this CPU has, on random rows: head sizes 64 and 128 (the SIMD
 * paths) and 24 / 40 (scalar fallback), 1..7 query heads, runs of 1..300 keys
 * (SIMD tails), row strides wider than a row, values from 1e-6 to 1e4 with
 * outliers and zero rows.
 *
 * Truth is computed here in double. Tolerance: fp32 accumulation over hd (or nt)
 * terms, |got - truth| <= 4e-7 · Σ|terms| · sqrt(len) + 1e-30; a wrong row, stride
 * or lane moves a result by a whole term.
 * Also checked: the kernels give bit-identical results when a run is split into
 * two calls (the CPU backend splits a chunk of keys between the document region
 * and the output buffer, and bounded decoding must reproduce unbounded decoding
 * bit for bit). */
#include <stdint.h>
#include <stdlib.h>

#include "kvz_attn.h"
#include "kvz_qdot.h"
#include "kvz_test.h"

static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static uint32_t rnd(void)
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float rndu(void) { return (float)(rnd() & 0xffffff) / 16777216.0f; }

/* a row of values: ordinary, tiny, large, zero, or with one outlier */
static void fill_row(float *x, int n)
{
    const int kind = (int)(rnd() % 6);
    const float mag = kind == 0 ? 0.0f : kind == 1 ? 1e4f : kind == 2 ? 1e-6f : 1.0f;
    for (int i = 0; i < n; i++) x[i] = mag * (2.0f * rndu() - 1.0f);
    if (kind == 3) x[rnd() % (unsigned)n] = 300.0f;
}

static int fails[3], worst_isa = -1;
static double worst;

static void note(int isa, const char *what, double got, double truth, double mag, int len)
{
    const double err = fabs(got - truth), tol = 4e-7 * mag * sqrt((double)len) + 1e-30;
    if (!(err <= tol) && fails[isa]++ < 5)
        fprintf(stderr, "%s %s: got %.9g truth %.9g (|err| %.3g > tol %.3g)\n", what, kvz_isa_name(isa), got,
                truth, err, tol);
    if (mag > 0 && err / mag > worst) { worst = err / mag; worst_isa = isa; }
}

static void trial(int hd, int grp, int64_t nt)
{
    const int64_t ldk = hd + (rnd() % 2 ? 0 : 8 * (int64_t)(1 + rnd() % 3)), lds = nt + (int64_t)(rnd() % 5);
    float *q = malloc(sizeof(float) * (size_t)grp * hd), *k = malloc(sizeof(float) * (size_t)(nt * ldk));
    float *p = malloc(sizeof(float) * (size_t)(grp * lds)), *s = malloc(sizeof(float) * (size_t)(grp * lds));
    float *s2 = malloc(sizeof(float) * (size_t)(grp * lds));
    float *o = malloc(sizeof(float) * (size_t)grp * hd), *o2 = malloc(sizeof(float) * (size_t)grp * hd);
    float *o0 = malloc(sizeof(float) * (size_t)grp * hd);
    for (int g = 0; g < grp; g++) fill_row(q + (size_t)g * hd, hd);
    for (int64_t t = 0; t < nt; t++) fill_row(k + t * ldk, (int)ldk);
    for (int g = 0; g < grp; g++)
        for (int64_t t = 0; t < lds; t++) p[g * lds + t] = rndu() * (rnd() % 4 ? 1.0f : 1e-5f);
    for (int g = 0; g < grp; g++) fill_row(o0 + (size_t)g * hd, hd);
    const float scale = 0.125f + rndu();
    const int64_t cut = nt > 1 ? 1 + (int64_t)(rnd() % (uint32_t)(nt - 1)) : 0;
    for (int isa = KVZ_ISA_SCALAR; isa <= kvz_qdot_cpu_isa(); isa++) {
        /* scores, against double; then split at cut: bit-identical */
        kvz_attn_scores(isa, q, grp, hd, k, ldk, nt, scale, s, lds);
        for (int g = 0; g < grp; g++)
            for (int64_t t = 0; t < nt; t++) {
                double tr = 0, mag = 0;
                for (int d = 0; d < hd; d++) {
                    tr += (double)q[g * hd + d] * k[t * ldk + d];
                    mag += fabs((double)q[g * hd + d] * k[t * ldk + d]);
                }
                note(isa, "scores", s[g * lds + t], scale * tr, scale * mag, hd);
            }
        if (cut) {
            kvz_attn_scores(isa, q, grp, hd, k, ldk, cut, scale, s2, lds);
            kvz_attn_scores(isa, q, grp, hd, k + cut * ldk, ldk, nt - cut, scale, s2 + cut, lds);
            int same = 1;
            for (int g = 0; g < grp; g++)
                for (int64_t t = 0; t < nt; t++) same &= memcmp(&s[g * lds + t], &s2[g * lds + t], 4) == 0;
            CHECKF(same, "scores %s hd=%d grp=%d nt=%lld: split at %lld differs", kvz_isa_name(isa), hd, grp,
                   (long long)nt, (long long)cut);
        }
        /* weighted values: v rows are the k rows; o starts from o0 (accumulates) */
        memcpy(o, o0, sizeof(float) * (size_t)grp * hd);
        kvz_attn_pv(isa, p, lds, grp, k, ldk, nt, hd, o);
        for (int g = 0; g < grp; g++)
            for (int d = 0; d < hd; d++) {
                double tr = o0[g * hd + d], mag = fabs((double)o0[g * hd + d]);
                for (int64_t t = 0; t < nt; t++) {
                    tr += (double)p[g * lds + t] * k[t * ldk + d];
                    mag += fabs((double)p[g * lds + t] * k[t * ldk + d]);
                }
                note(isa, "pv", o[g * hd + d], tr, mag, (int)nt + 1);
            }
        if (cut) {
            memcpy(o2, o0, sizeof(float) * (size_t)grp * hd);
            kvz_attn_pv(isa, p, lds, grp, k, ldk, cut, hd, o2);
            kvz_attn_pv(isa, p + cut, lds, grp, k + cut * ldk, ldk, nt - cut, hd, o2);
            CHECKF(memcmp(o, o2, sizeof(float) * (size_t)grp * hd) == 0,
                   "pv %s hd=%d grp=%d nt=%lld: split at %lld differs", kvz_isa_name(isa), hd, grp, (long long)nt,
                   (long long)cut);
        }
    }
    free(q); free(k); free(p); free(s); free(s2); free(o); free(o2); free(o0);
}

/* Prefill (flash) attention, one KV head's query block: nq queries x grp heads at
 * positions pos0.., keys = nd document rows (row t at position t) then nout output
 * slots (positions opos[j], -1 = empty). Truth: the softmax over the keys each query
 * sees and the weighted value sum in double. Tolerance per output: fp32 error of the
 * scores (4e-7*sqrt(hd)*max_t scale*sum|q*k|, relative in p) and of the sums
 * (4e-7*sqrt(keys)), times max|v| over the seen keys; a key masked wrongly moves an
 * output by p_t*|v_t - o| >= ~|v|/keys (scores kept moderate: qmag <= 1 in most
 * trials). Kinds: 0 causal; 1 a third of the queries see nothing; 2 arbitrary doc
 * visibility; 3 slots in order (what a question pass into the output buffer
 * leaves), which must give the same bytes as those rows in the document region
 * (bounded decoding reproduces unbounded decoding bit for bit); 4 slots shuffled,
 * some empty. Tiles of 64 keys with tails, 6-row groups with padding. */
static int flash_fails[3];
static double flash_worst;

static void flash_trial(int hd, int grp, int nq, int64_t pos0, int kind, float qmag)
{
    const int64_t nall = pos0 + nq, ld = hd + (rnd() % 2 ? 0 : 8), ldq = (int64_t)grp * hd + (rnd() % 2 ? 0 : 16);
    int64_t nd = nall, nout = 0;
    if (kind >= 3) { /* the last rows (at least the queries' own) become slots */
        nout = nq + (int64_t)(rnd() % (uint32_t)(pos0 + 1));
        nd = nall - nout;
    }
    const int64_t oldd = (int64_t)hd * (1 + rnd() % 3);
    float *q = malloc(sizeof(float) * (size_t)(nq * ldq)), *k = malloc(sizeof(float) * (size_t)(nall * ld));
    float *v = malloc(sizeof(float) * (size_t)(nall * ld)), *o = malloc(sizeof(float) * (size_t)(nq * ldq));
    float *o2 = malloc(sizeof(float) * (size_t)(nq * ldq));
    float *ok = malloc(sizeof(float) * (size_t)(nout * oldd + 1)), *ov = malloc(sizeof(float) * (size_t)(nout * oldd + 1));
    int32_t *opos = malloc(sizeof(int32_t) * (size_t)(nout + 1)), *qpos = malloc(sizeof(int32_t) * (size_t)nq);
    int64_t *vis = malloc(sizeof(int64_t) * (size_t)nq), *visall = malloc(sizeof(int64_t) * (size_t)nq);
    float *work = aligned_alloc(32, (kvz_attn_flash_work_floats(nq, grp, hd) * sizeof(float) + 31) / 32 * 32);
    double *pr = malloc(sizeof(double) * (size_t)nall);
    char *seen = malloc((size_t)nall);
    for (int64_t i = 0; i < nq * ldq; i++) q[i] = qmag * (2.0f * rndu() - 1.0f);
    for (int64_t i = 0; i < nall * ld; i++) k[i] = 2.0f * rndu() - 1.0f;
    for (int64_t i = 0; i < nall * ld; i++) v[i] = (rnd() % 50 ? 1.0f : 100.0f) * (2.0f * rndu() - 1.0f);
    for (int64_t j = 0; j < nout; j++) {
        memcpy(ok + j * oldd, k + (nd + j) * ld, sizeof(float) * (size_t)hd);
        memcpy(ov + j * oldd, v + (nd + j) * ld, sizeof(float) * (size_t)hd);
        opos[j] = (int32_t)(nd + j);
    }
    if (kind == 4)
        for (int64_t j = 0; j < nout; j++) {
            const int64_t x = (int64_t)(rnd() % (uint32_t)nout);
            const int32_t tmp = opos[j];
            opos[j] = opos[x];
            opos[x] = tmp;
            if (rnd() % 5 == 0) opos[j] = -1;
        }
    for (int i = 0; i < nq; i++) {
        qpos[i] = (int32_t)(pos0 + i);
        visall[i] = pos0 + i + 1;
        vis[i] = visall[i] < nd ? visall[i] : nd;                  /* causal */
        if (kind == 1 && i < nq / 3) vis[i] = 0;                   /* sees nothing */
        if (kind == 2) vis[i] = (int64_t)(rnd() % (uint32_t)(nd + 1)); /* arbitrary */
    }
    const kvz_attn_keys keys = {k, v, ld, nd, ok, ov, oldd, nout, opos};
    const kvz_attn_keys flat = {k, v, ld, nall, NULL, NULL, 0, 0, NULL};
    const float scale = 1.0f / sqrtf((float)hd);
    for (int isa = KVZ_ISA_SCALAR; isa <= kvz_qdot_cpu_isa(); isa++) {
        for (int64_t i = 0; i < nq * ldq; i++) o[i] = NAN;
        kvz_attn_flash(isa, q, ldq, nq, grp, hd, &keys, vis, qpos, scale, o, ldq, work);
        if (kind == 3) {
            for (int64_t i = 0; i < nq * ldq; i++) o2[i] = NAN;
            kvz_attn_flash(isa, q, ldq, nq, grp, hd, &flat, visall, qpos, scale, o2, ldq, work);
            int same = 1;
            for (int i = 0; i < nq; i++) same &= !memcmp(o + i * ldq, o2 + i * ldq, sizeof(float) * (size_t)grp * hd);
            CHECKF(same, "flash %s hd=%d grp=%d nq=%d: slots in order differ from document rows", kvz_isa_name(isa),
                   hd, grp, nq);
        }
        for (int i = 0; i < nq; i++)
            for (int g = 0; g < grp; g++) {
                const float *qr = q + i * ldq + g * hd;
                double mx = -INFINITY, smag = 0, sum = 0;
                for (int64_t t = 0; t < nall; t++) {
                    seen[t] = t < nd ? t < vis[i] : opos[t - nd] >= 0 && opos[t - nd] <= qpos[i];
                    if (!seen[t]) continue;
                    double sd = 0, m = 0;
                    for (int d = 0; d < hd; d++) {
                        sd += (double)qr[d] * k[t * ld + d];
                        m += fabs((double)qr[d] * k[t * ld + d]);
                    }
                    pr[t] = sd * scale;
                    mx = pr[t] > mx ? pr[t] : mx;
                    smag = m * scale > smag ? m * scale : smag;
                }
                for (int64_t t = 0; t < nall; t++)
                    if (seen[t]) sum += (pr[t] = exp(pr[t] - mx));
                for (int d = 0; d < hd; d++) {
                    double tr = 0, vmax = 0;
                    for (int64_t t = 0; t < nall; t++) {
                        if (!seen[t]) continue;
                        tr += pr[t] / sum * v[t * ld + d];
                        vmax = fabs(v[t * ld + d]) > vmax ? fabs(v[t * ld + d]) : vmax;
                    }
                    const double got = o[i * ldq + g * hd + d], err = fabs(got - tr);
                    const double tol = (4e-7 * sqrt((double)hd) * (1.0 + smag) + 4e-7 * sqrt((double)nall + 1)) * vmax;
                    if (!(err <= tol) && flash_fails[isa]++ < 5)
                        fprintf(stderr, "flash %s hd=%d grp=%d nq=%d pos0=%lld kind=%d q%d g%d d%d: got %.9g truth %.9g (tol %.3g)\n",
                                kvz_isa_name(isa), hd, grp, nq, (long long)pos0, kind, i, g, d, got, tr, tol);
                    if (vmax > 0 && err / vmax > flash_worst) flash_worst = err / vmax;
                }
            }
    }
    free(q); free(k); free(v); free(o); free(o2); free(ok); free(ov); free(opos); free(qpos); free(vis);
    free(visall); free(work); free(pr); free(seen);
}

int main(void)
{
    static const int FHD[] = {64, 128, 16, 40};
    int fruns = 0;
    for (size_t h = 0; h < sizeof FHD / sizeof FHD[0]; h++)
        for (int r = 0; r < 30; r++) {
            const int grp = 1 + (int)(rnd() % 7), nq = 1 + (int)(rnd() % (r < 8 ? 8 : 70));
            const int64_t pos0 = r % 4 == 0 ? 0 : (int64_t)(rnd() % 200);
            flash_trial(FHD[h], grp, nq, pos0, r % 5, r % 6 == 5 ? 8.0f : 1.0f);
            fruns++;
        }
    printf("attn flash: %d runs, worst |err|/max|v| = %.2g\n", fruns, flash_worst);
    for (int isa = 0; isa <= kvz_qdot_cpu_isa(); isa++)
        CHECKF(flash_fails[isa] == 0, "flash: %d results out of tolerance on %s", flash_fails[isa], kvz_isa_name(isa));

    static const int HD[] = {64, 128, 24, 40};
    int runs = 0;
    for (size_t h = 0; h < sizeof HD / sizeof HD[0]; h++)
        for (int r = 0; r < 40; r++) {
            const int grp = 1 + (int)(rnd() % 7);
            const int64_t nt = r < 10 ? 1 + r : 1 + (int64_t)(rnd() % 300);
            trial(HD[h], grp, nt);
            runs++;
        }
    printf("attn: %d runs, ISAs scalar..%s, worst |err|/sum|terms| = %.2g (%s)\n", runs,
           kvz_isa_name(kvz_qdot_cpu_isa()), worst, worst_isa >= 0 ? kvz_isa_name(worst_isa) : "-");
    for (int isa = 0; isa <= kvz_qdot_cpu_isa(); isa++)
        CHECKF(fails[isa] == 0, "%d results out of tolerance on %s", fails[isa], kvz_isa_name(isa));
    return kvz_test_summary();
}
