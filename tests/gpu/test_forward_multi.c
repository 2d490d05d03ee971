/* Continuous batching on the CUDA backend (kvz_forward_multi → kvz_cuda_forward_multi):
 * the batched step over n different caches against twin caches stepped one at a time
 * with kvz_forward (the single-cache decode path kvzip-query uses), on synthetic models
 * of head_dim 64 (smollm2-135m: llama rope, GQA 3; tiny-qwen3: q/k norm) and 128
 * (qwen2.5-7b: qkv bias, GQA 7).
 *
 * Each model: NC caches, each with its own random document of a different length,
 * then compacted per head to different lengths (a random subset of rows kept per
 * (layer, head), the same rows for the twin: kvz_kv_clear + kvz_kv_set_layer), a
 * LongFlow output buffer of 8..16 slots (differing per cache) with 2 sinks, so the
 * buffers fill and then evict inside the run. STEPS steps; each step a random subset of
 * the caches (1..NC of them, random order: sequences join and leave) takes one token at
 * its own next position; then CHURN_STEPS steps of NC - 1 caches where the member left
 * out alternates between caches 1 and 2 (membership changes every step, the coarse
 * shape does not: the longest head's bucket and the largest buffer stay, the row sums
 * move by a few %), so the graph kept for that shape must be replayed across membership
 * changes (counted by kvz_step_io.path: >= CHURN_STEPS - 2 replays); the last
 * GRAPH_STEPS steps take every cache in one fixed batch (replayed too). Every step goes
 * through kvz_forward_multi_top with argmax ids; every third step asks for the logits of
 * the even rows only. Asserted:
 *   - the device argmax ids equal the host argmax (kvz_argmax) of the returned logits of
 *     the same step, every wanted row; a row not wanted keeps the bytes it had (nothing
 *     written) and its id is checked against the single path's argmax like a row's;
 *   - logits: ‖batched − single‖ / ‖single‖ <= TOL for every row of every step. Both are
 *     bf16 GEMMs with fp32 accumulation, but the single path's batch-1 GEMVs sum in
 *     another order than cuBLAS's n-row GEMM and the attention runs with another split
 *     count, so bf16-rounded activations differ by an ulp here and there and the
 *     difference grows through the layers (printed; worst seen on the H200 over 7 runs
 *     of the 3 models: 2.1e-2); 5e-2, the tolerance test_backend allows GPU vs CPU, is
 *     above that and far below what a wrong cache, position or slot gives (O(1));
 *   - argmax equal on every row, unless the single path's top two are within TIE·std
 *     (a near-tie an ulp can flip; counted and printed, at most 1 in 20 rows);
 *   - host mirrors equal: out_used, newest, evictions of every cache after every step
 *     (deterministic bookkeeping);
 *   - LongFlow choices: the slot positions of every (cache, layer) equal between the
 *     batched cache and its twin in >= 75% of (cache, layer, step) checks. The victim is
 *     an argmin of S_j, nearly flat on random weights, and the two sides' S_j differ at
 *     the bf16 level, so an exact match every time cannot be promised; a wrong slot or a
 *     victim read from another sequence gives far lower agreement;
 *   - after the run, the output-buffer K/V rows of every (cache, layer) whose slot
 *     positions agree: relative error <= TOL.
 * Bad input: n = 0, a repeated cache, a cache of another model → KVZ_ERR_ARG.
 * Exit 77 (SKIP) when no CUDA device is usable. */
#include "kvz_test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvz_cuda_backend.h"
#include "kvz_error.h"
#include "kvz_model.h"
#include "kvz_model_impl.h" /* white-box: the host mirror of the output buffer */

#define TOL 5e-2
#define TIE 0.05
#define NC 6
#define STEPS 28
#define GRAPH_STEPS 6 /* last steps with every cache in one fixed batch */
#define CHURN_STEPS 8 /* before them: NC - 1 caches, cache 1 or 2 left out in turn */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static int32_t rnd(int32_t n)
{
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (int32_t)(g_rng % (uint64_t)n);
}

static double rel_err(const float *g, const float *c, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (g[i] != g[i]) return INFINITY;
        double d = (double)g[i] - c[i];
        num += d * d;
        den += (double)c[i] * c[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* top-1 minus top-2 over the standard deviation */
static double gap_std(const float *x, int32_t n)
{
    int32_t b = argmax(x, n);
    float s2 = -INFINITY;
    double s = 0, ss = 0;
    for (int32_t i = 0; i < n; i++) {
        if (i != b && x[i] > s2) s2 = x[i];
        s += x[i];
        ss += (double)x[i] * x[i];
    }
    s /= n;
    double sd = sqrt(ss / n - s * s);
    return sd > 0 ? (x[b] - s2) / sd : INFINITY;
}

static double bf_rel(const uint16_t *a, const uint16_t *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t ua = (uint32_t)a[i] << 16, ub = (uint32_t)b[i] << 16;
        float fa, fb;
        memcpy(&fa, &ua, 4);
        memcpy(&fb, &ub, 4);
        num += ((double)fa - fb) * ((double)fa - fb);
        den += (double)fb * fb;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

#define OK(call)                                                                             \
    do {                                                                                     \
        int rc_ = (call);                                                                    \
        CHECKF(rc_ == 0, "%s -> %d %s (%s)", #call, rc_, kvz_strerror(rc_), kvz_error_detail()); \
        if (rc_) goto out;                                                                   \
    } while (0)

/* Document of @p len random tokens into @p a, compacted per head (a random subset of
 * rows kept, at least one) and the same rows set into the twin @p b. */
static int make_doc(kvz_model *m, kvz_kv *a, kvz_kv *b, int32_t len)
{
    const kvz_config *c = kvz_model_config(m);
    const int32_t nkv = c->n_kv_head, hd = c->head_dim, V = c->n_vocab;
    int rc = 0;
    int32_t *toks = malloc(sizeof(int32_t) * len);
    float *k = malloc(sizeof(float) * (size_t)len * hd), *v = malloc(sizeof(float) * (size_t)len * hd);
    int32_t *p1 = malloc(sizeof(int32_t) * len);
    float *Ks = NULL, *Vs = NULL;
    int32_t *Ps = NULL;
    uint32_t *cnt = NULL;
    if (!toks || !k || !v || !p1) { rc = KVZ_ERR_NOMEM; goto done; }
    for (int32_t i = 0; i < len; i++) toks[i] = rnd(V);
    if ((rc = kvz_forward(m, a, toks, len, 0, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_TO_DOC, NULL))) goto done;
    Ks = malloc(sizeof(float) * (size_t)c->n_layer * len * nkv * hd);
    Vs = malloc(sizeof(float) * (size_t)c->n_layer * len * nkv * hd);
    Ps = malloc(sizeof(int32_t) * (size_t)c->n_layer * len * nkv);
    cnt = malloc(sizeof(uint32_t) * (size_t)c->n_layer * nkv);
    if (!Ks || !Vs || !Ps || !cnt) { rc = KVZ_ERR_NOMEM; goto done; }
    for (int32_t l = 0; l < c->n_layer && !rc; l++) {
        size_t off = 0;
        for (int32_t h = 0; h < nkv; h++) {
            if ((rc = kvz_kv_get_head(a, l, h, k, v, p1))) break;
            const int32_t keep_pct = 40 + rnd(60); /* 40..99% of the rows of this head */
            uint32_t n = 0;
            for (int32_t r = 0; r < len; r++) {
                if (r != 0 && rnd(100) >= keep_pct) continue; /* row 0 always kept */
                size_t o = (size_t)l * len * nkv + off + n;
                memcpy(Ks + o * hd, k + (size_t)r * hd, sizeof(float) * hd);
                memcpy(Vs + o * hd, v + (size_t)r * hd, sizeof(float) * hd);
                Ps[o] = p1[r];
                n++;
            }
            cnt[(size_t)l * nkv + h] = n;
            off += n;
        }
    }
    if (!rc) {
        kvz_kv_clear(a);
        kvz_kv_clear(b);
        for (int32_t l = 0; l < c->n_layer && !rc; l++) {
            size_t o = (size_t)l * len * nkv;
            rc = kvz_kv_set_layer(a, l, cnt + (size_t)l * nkv, Ps + o, Ks + o * hd, Vs + o * hd);
            if (!rc) rc = kvz_kv_set_layer(b, l, cnt + (size_t)l * nkv, Ps + o, Ks + o * hd, Vs + o * hd);
        }
    }
done:
    free(toks); free(k); free(v); free(p1); free(cnt);
    free(Ks); free(Vs); free(Ps);
    return rc;
}

static void test_model(const char *name, int32_t len0, kvz_model *other)
{
    kvz_model_opts og = {.device = KVZ_DEVICE_CUDA};
    kvz_model *m = NULL;
    kvz_kv *A[NC] = {0}, *T[NC] = {0};
    float *lm = NULL, *ls = NULL;
    uint16_t *ka = NULL, *va = NULL, *kb = NULL, *vb = NULL;
    int32_t B[NC], P[NC], tok[NC], L[NC];
    OK(kvz_model_synthetic(name, &og, &m));
    const kvz_config *c = kvz_model_config(m);
    const int32_t Vn = c->n_vocab, NL = c->n_layer, nkv = c->n_kv_head, hd = c->head_dim;
    printf("[%s] head_dim %d, %d caches, %d steps\n", name, hd, NC, STEPS);
    lm = malloc(sizeof(float) * (size_t)NC * Vn);
    ls = malloc(sizeof(float) * Vn);
    for (int i = 0; i < NC; i++) {
        L[i] = len0 + 37 * i + rnd(20);
        B[i] = 8 + (i * 3) % 9; /* 8..16 */
        OK(kvz_kv_create(m, L[i] + 4, B[i], &A[i]));
        OK(kvz_kv_create(m, L[i] + 4, B[i], &T[i]));
        kvz_kv_set_sinks(A[i], 2);
        kvz_kv_set_sinks(T[i], 2);
        OK(make_doc(m, A[i], T[i], L[i]));
        P[i] = L[i];
        tok[i] = rnd(Vn);
    }
    {
        int64_t mn = INT64_MAX, mx = 0;
        for (int i = 0; i < NC; i++)
            for (int32_t l = 0; l < NL; l++)
                for (int32_t h = 0; h < nkv; h++) {
                    int64_t n = kvz_kv_len(A[i], l, h);
                    mn = n < mn ? n : mn;
                    mx = n > mx ? n : mx;
                }
        printf("  document rows per (cache, layer, head): %lld..%lld\n", (long long)mn, (long long)mx);
    }
    /* bad input */
    {
        kvz_kv *rep[2] = {A[0], A[0]};
        int32_t tk[2] = {1, 1}, ps[2] = {P[0], P[0]};
        CHECK(kvz_forward_multi(m, rep, tk, ps, 0, lm) == KVZ_ERR_ARG);
        CHECK(kvz_forward_multi(m, rep, tk, ps, 2, lm) == KVZ_ERR_ARG);
        if (other) {
            kvz_kv *ko = NULL;
            if (kvz_kv_create(other, 16, 8, &ko) == 0) {
                kvz_kv *mix[2] = {A[0], ko};
                CHECK(kvz_forward_multi(m, mix, tk, ps, 2, lm) == KVZ_ERR_ARG);
                kvz_kv_free(ko);
            }
        }
        kvz_error_clear();
    }
    const uint64_t g0 = kvz_cuda_multi_graph_launches();
    double emax = 0;
    int64_t rows = 0, ties = 0, am_bad = 0, set_eq = 0, set_n = 0, batched_steps = 0, mirror_bad = 0;
    int64_t top_bad = 0, top_n = 0, skipped_rows = 0, written_bad = 0, churn_replays = 0, paths[4] = {0};
    int32_t *pa = malloc(sizeof(int32_t) * 16), *pb = malloc(sizeof(int32_t) * 16);
    const int total = STEPS + CHURN_STEPS;
    for (int st = 0; st < total; st++) {
        /* a random subset in random order: n = 1 sometimes (the single path), else 2..NC */
        int32_t idx[NC], n = st % 7 == 3 ? 1 : 2 + rnd(NC - 1);
        const int same = st >= total - GRAPH_STEPS; /* the last steps: one batch, so its CUDA graph replays */
        const int churn = !same && st >= total - GRAPH_STEPS - CHURN_STEPS;
        if (same) n = NC;
        for (int i = 0; i < NC; i++) idx[i] = i;
        for (int i = NC - 1; i > 0 && !same && !churn; i--) {
            int j = rnd(i + 1), t = idx[i];
            idx[i] = idx[j];
            idx[j] = t;
        }
        if (churn) { /* every cache but 1 or 2, in turn */
            const int out = 1 + st % 2;
            n = 0;
            for (int i = 0; i < NC; i++)
                if (i != out) idx[n++] = i;
        }
        kvz_kv *sel[NC];
        int32_t tk[NC], ps[NC], top[NC];
        uint8_t want[NC];
        const int part = n >= 2 && st % 3 == 1; /* logits of the even rows only */
        for (int j = 0; j < n; j++) {
            sel[j] = A[idx[j]]; tk[j] = tok[idx[j]]; ps[j] = P[idx[j]];
            want[j] = !part || j % 2 == 0;
            if (!want[j]) memset(lm + (size_t)j * Vn, 0xA5, sizeof(float) * Vn); /* must stay */
            top[j] = -1;
        }
        kvz_step_io io = {.want_logits = part ? want : NULL, .top = top, .path = -1};
        OK(kvz_forward_multi_top(m, sel, tk, ps, n, lm, &io));
        CHECK(io.path >= KVZ_STEP_PASSES && io.path <= KVZ_STEP_REPLAY);
        if (io.path >= 0 && io.path < 4) paths[io.path]++;
        churn_replays += churn && io.path == KVZ_STEP_REPLAY;
        batched_steps += n >= 2;
        for (int j = 0; j < n; j++) {
            const int i = idx[j];
            OK(kvz_forward(m, T[i], &tk[j], 1, ps[j], ls, KVZ_FWD_LOGITS_LAST, NULL));
            const float *row = lm + (size_t)j * Vn;
            int32_t got;
            if (want[j]) {
                double e = rel_err(row, ls, (size_t)Vn);
                emax = e > emax ? e : emax;
                top_bad += top[j] != kvz_argmax(row, Vn); /* the device's rule = the host's, same logits */
                top_n++;
                got = argmax(row, Vn);
            } else {
                const uint8_t *u = (const uint8_t *)row;
                int bad = 0;
                for (size_t b = 0; b < sizeof(float) * (size_t)Vn; b++) bad |= u[b] != 0xA5;
                written_bad += bad;
                skipped_rows++;
                got = top[j];
            }
            rows++;
            if (got != argmax(ls, Vn)) {
                if (gap_std(ls, Vn) < TIE) ties++;
                else am_bad++;
            }
            /* host mirrors */
            kvz_kv_stats sa, sb;
            kvz_kv_get_stats(A[i], &sa);
            kvz_kv_get_stats(T[i], &sb);
            int bad = sa.evictions != sb.evictions;
            for (int32_t l = 0; l < NL; l++)
                bad |= A[i]->out_used[l] != T[i]->out_used[l] || A[i]->newest[l] != T[i]->newest[l];
            for (int32_t l = 0; l < NL; l++)
                for (int32_t s = 0; s < B[i]; s++)
                    bad |= A[i]->opos[(size_t)l * B[i] + s] != T[i]->opos[(size_t)l * B[i] + s];
            mirror_bad += bad;
            for (int32_t l = 0; l < NL; l++) {
                OK(kvz_cuda_kv_out_pos(A[i], l, pa));
                OK(kvz_cuda_kv_out_pos(T[i], l, pb));
                set_eq += memcmp(pa, pb, sizeof(int32_t) * B[i]) == 0;
                set_n++;
            }
            P[i]++;
            tok[i] = argmax(ls, Vn); /* both follow the single path's tokens */
        }
    }
    const uint64_t launches = kvz_cuda_multi_graph_launches() - g0;
    printf("  steps: %lld passes, %lld eager, %lld captured, %lld replayed (%llu graph launches); %lld of %d "
           "churn steps (membership changing every step) replayed\n", (long long)paths[0], (long long)paths[1],
           (long long)paths[2], (long long)paths[3], (unsigned long long)launches, (long long)churn_replays,
           CHURN_STEPS);
    printf("  device argmax: %lld/%lld rows differ from the host argmax of the same logits; %lld rows without "
           "logits, %lld of them written\n", (long long)top_bad, (long long)top_n, (long long)skipped_rows,
           (long long)written_bad);
    CHECK(top_bad == 0 && top_n > 0);
    CHECK(skipped_rows > 0 && written_bad == 0);
    CHECK(launches == (uint64_t)(paths[2] + paths[3]));
    {
        const char *ge = getenv("KVZ_CUDA_GRAPH");
        if (!(ge && ge[0] == '0')) {
            CHECK(paths[3] >= GRAPH_STEPS - 2); /* eager, capture, then replays */
            CHECKF(churn_replays >= CHURN_STEPS - 2, "churn steps replayed %lld of %d", (long long)churn_replays,
                   CHURN_STEPS);
        } else {
            CHECK(paths[2] == 0 && paths[3] == 0);
        }
    }
    int64_t evs = 0;
    for (int i = 0; i < NC; i++) {
        kvz_kv_stats sa;
        kvz_kv_get_stats(A[i], &sa);
        evs += sa.evictions;
    }
    /* output-buffer rows after the run */
    double kv_err = 0;
    int64_t kv_cmp = 0;
    {
        const size_t nb = (size_t)nkv * 16 * hd;
        ka = malloc(nb * 2); va = malloc(nb * 2); kb = malloc(nb * 2); vb = malloc(nb * 2);
        for (int i = 0; i < NC; i++)
            for (int32_t l = 0; l < NL; l++) {
                OK(kvz_cuda_kv_out_pos(A[i], l, pa));
                OK(kvz_cuda_kv_out_pos(T[i], l, pb));
                if (memcmp(pa, pb, sizeof(int32_t) * B[i])) continue;
                OK(kvz_cuda_kv_out_rows(A[i], l, ka, va));
                OK(kvz_cuda_kv_out_rows(T[i], l, kb, vb));
                const size_t ne = (size_t)nkv * B[i] * hd;
                double e = bf_rel(ka, kb, ne), e2 = bf_rel(va, vb, ne);
                e = e2 > e ? e2 : e;
                kv_err = e > kv_err ? e : kv_err;
                kv_cmp++;
            }
    }
    printf("  %lld rows in %lld batched steps: logits rel err worst %.3e (tol %.0e); argmax differs %lld "
           "(near-ties %lld); host mirrors differ %lld; evictions %lld; slot positions equal %lld/%lld "
           "(cache, layer, step); buffer K/V rel err worst %.3e over %lld agreeing (cache, layer)\n",
           (long long)rows, (long long)batched_steps, emax, TOL, (long long)am_bad, (long long)ties,
           (long long)mirror_bad, (long long)evs, (long long)set_eq, (long long)set_n, kv_err, (long long)kv_cmp);
    CHECKF(emax <= TOL, "%s logits %.3e", name, emax);
    CHECK(am_bad == 0);
    CHECK(ties * 20 <= rows);
    CHECK(mirror_bad == 0);
    CHECK(evs > 0); /* the buffers filled and evicted within the run */
    CHECK(batched_steps >= STEPS / 2);
    /* one eviction that differs (a near-tie of the LongFlow score: random weights make it
     * nearly flat, and the two paths round differently) leaves that (cache, layer)'s
     * buffer unequal for every later step, so the share wanders with the seed: 86-100 %
     * seen on the H200 (tiny-qwen3's 8-slot buffers lowest). A wrong victim choice would
     * differ almost everywhere. */
    CHECKF(set_eq * 4 >= set_n * 3, "slot positions equal %lld/%lld", (long long)set_eq, (long long)set_n);
    CHECK(kv_cmp > 0);
    CHECKF(kv_err <= TOL, "buffer K/V %.3e", kv_err);
    free(pa); free(pb);
out:
    for (int i = 0; i < NC; i++) { kvz_kv_free(A[i]); kvz_kv_free(T[i]); }
    free(lm); free(ls); free(ka); free(va); free(kb); free(vb);
    kvz_model_free(m);
}

int main(void)
{
    if (!kvz_cuda_available()) {
        printf("SKIP: no usable CUDA device\n");
        return 77;
    }
    const char *se = getenv("KVZ_SEED");
    g_rng = se ? strtoull(se, NULL, 10) : (uint64_t)time(NULL);
    if (!g_rng) g_rng = 1;
    printf("seed %llu (KVZ_SEED reproduces)\n", (unsigned long long)g_rng);
    kvz_model_opts og = {.device = KVZ_DEVICE_CUDA};
    kvz_model *other = NULL;
    REQUIRE(kvz_model_synthetic("tiny-llama", &og, &other) == 0);
    test_model("smollm2-135m", 60, other);
    test_model("tiny-qwen3", 90, other);
    test_model("qwen2.5-7b", 150, other);
    kvz_model_free(other);
    return kvz_test_summary();
}
