/* Multi-document composition on the CUDA backend (docs/MULTIDOC.md):
 *  1. the re-rotation kernel (kvz_cuda_rope_shift_rows) against the CPU
 *     kvz_rope_shift_rows on random bf16 rows: adjacent (llama) and half-split
 *     (qwen2/qwen3) layouts, the vector and the one-pair paths, plain and scaled
 *     (llama3-style rope_freqs) frequencies, Δ from 1 to 100000, several documents and
 *     a key scale in one launch. Every element within one bf16 step of the correctly
 *     rounded CPU value; rows outside the segments untouched, bit for bit; the same
 *     output against the CPU shifted by Δ + 1 is far off (the check can fail).
 *  2. end to end on synthetic models (no model file; tiny-qwen3: half-split, smollm2-135m:
 *     adjacent): two caches ingested at r = 1.0 composed sequentially on the device.
 *     Independent reference: document B prefilled by the GPU model at the shifted
 *     positions over a prefix only (the boundary masked), joined to A's cache. Checked:
 *     B's moved keys equal the host path's (fp32 CPU re-rotation of the same stored rows,
 *     one rounding) within one bf16 step per element, and the reference's within
 *     TOL_KEYS; the question logits match the reference within TOL_SEQ and the host path
 *     within TOL_HOST; composing with Δ − 1 or Δ + 1 moves the keys ~0.25 (> OFF_KEYS,
 *     > 10x) and the logits > OFF_FACTOR times more, so an off-by-one fails. Positions
 *     of the composed rows; parallel placement with a key scale (scaled in the kernel)
 *     vs the host path; the composition with its records read through the LMDB map
 *     (map_only) equal to the one through the copy route, bit for bit.
 * Exit 77 (SKIP) without a usable CUDA device. */
#include "kvz_test.h"

#include <math.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "kvz_compose.h"
#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_ingest.h"
#include "kvz_model.h"
#include "kvz_cuda_backend.h"
#include "kvz_rope_shift.h"
#include "kvz_rope_shift_cuda.h"
#include "kvz_store.h"

/* Bounds. A synthetic model's random weights in bf16 make the network chaotic: keys that
 * differed by 5e-5 (relative; θj in float vs double in an earlier host route) moved the
 * smollm2-135m question logits by 8e-3, and the independent reference (B prefilled at
 * other absolute positions, bf16 all along) differs from the composition by 4e-3 .. 1e-2
 * in keys and logits, while a shift off by one moves the logits by only ~3e-2 (2.4e-2 ..
 * 3.3e-2 with fp32 on the CPU). The keys separate by far more: ≤ one bf16 step against
 * ~0.25 for an off-by-one. */
#define TOL_KEYS_HOST 4e-3 /* moved keys, device vs host path (fp32 rotation, one rounding) */
#define OFF_KEYS 0.05      /* ... and the same with Δ ± 1 must be at least this far */
#define TOL_KEYS 2e-2      /* moved keys vs the keys prefilled at the shifted positions */
#define TOL_SEQ 2e-2       /* question logits, composed vs shifted-prefill reference */
#define OFF_FACTOR 2.5     /* an off-by-one shift must move the logits this many times more */
#define TOL_HOST 2e-2      /* question logits, device path vs host path */

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static uint64_t rng(void)
{
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return g_rng;
}
static float rnd_sym(void) { return (float)((double)(rng() >> 11) / 9007199254740992.0 * 2.0 - 1.0); }

static uint16_t f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float bf2f(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define CU(call)                                                                            \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) {                                                            \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

/* ---------------------------------------------------------------- 1. kernel */
typedef struct kcase {
    const char *name;
    int hd, adjacent, scaled;
    float key_scale;
} kcase;

/* llama3-style rope_freqs: long wavelengths slowed by 8, a smooth band between */
static void inv_freq_of(int hd, double theta, int scaled, float *f)
{
    for (int j = 0; j < hd / 2; j++) {
        double x = pow(theta, -2.0 * j / hd);
        if (scaled) {
            const double wl = 2 * M_PI / x, lo = 8192.0 / 1.0, hi = 8192.0 / 4.0;
            if (wl > lo) x /= 8.0;
            else if (wl > hi) {
                const double sm = (8192.0 / wl - 1.0) / 3.0;
                x = (1 - sm) * x / 8.0 + sm * x;
            }
        }
        f[j] = (float)x;
    }
}

static void kernel_case(const kcase *kc)
{
    const int hd = kc->hd, half = hd / 2, nlh = 6, cap = 700, ndoc = 3;
    const int32_t deltas[3] = {1, 4097, 100000};
    float *inv = malloc(sizeof(float) * (size_t)half);
    inv_freq_of(hd, 500000.0, kc->scaled, inv);
    const size_t n = (size_t)nlh * cap * hd;
    uint16_t *h = malloc(n * 2), *g = malloc(n * 2);
    for (size_t i = 0; i < n; i++) h[i] = f2bf(rnd_sym() * 3.0f);
    /* segments: per (lh, doc) a run of rows; some lh get none */
    kvz_cuda_shift_seg segs[64];
    int ns = 0;
    int32_t mx = 0;
    for (int lh = 0; lh < nlh; lh++) {
        if (lh == 2) continue;
        int32_t row = (int32_t)(rng() % 16);
        for (int d = 0; d < ndoc && row < cap; d++) {
            int32_t nr = 1 + (int32_t)(rng() % 200);
            if (row + nr > cap) nr = cap - row;
            segs[ns++] = (kvz_cuda_shift_seg){lh, row, nr, d};
            mx = nr > mx ? nr : mx;
            row += nr + (int32_t)(rng() % 8);
        }
    }
    float *cs = malloc(sizeof(float) * (size_t)ndoc * half), *sn = malloc(sizeof(float) * (size_t)ndoc * half);
    for (int d = 0; d < ndoc; d++) kvz_rope_shift_angles(inv, half, deltas[d], cs + d * half, sn + d * half);
    void *dk, *dsg, *dcs, *dsn;
    CU(cudaMalloc(&dk, n * 2));
    CU(cudaMalloc(&dsg, sizeof segs));
    CU(cudaMalloc(&dcs, sizeof(float) * (size_t)ndoc * half));
    CU(cudaMalloc(&dsn, sizeof(float) * (size_t)ndoc * half));
    CU(cudaMemcpy(dk, h, n * 2, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dsg, segs, sizeof segs, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dcs, cs, sizeof(float) * (size_t)ndoc * half, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dsn, sn, sizeof(float) * (size_t)ndoc * half, cudaMemcpyHostToDevice));
    int rc = kvz_cuda_rope_shift_rows(0, dk, cap, hd, kc->adjacent, dsg, ns, mx, dcs, dsn, kc->key_scale);
    CHECKF(rc == 0, "rope_shift_rows: %s", kvz_error_detail());
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(g, dk, n * 2, cudaMemcpyDeviceToHost));
    /* reference: the CPU re-rotation of the same bf16 inputs in fp32, times the key scale */
    uint8_t *in_seg = calloc((size_t)nlh * cap, 1);
    size_t bad = 0, untouched_bad = 0;
    double num = 0, den = 0, num_off = 0;
    float *x = malloc(sizeof(float) * (size_t)hd), *xo = malloc(sizeof(float) * (size_t)hd);
    for (int s = 0; s < ns; s++) {
        for (int32_t r = segs[s].row0; r < segs[s].row0 + segs[s].n; r++) {
            const size_t o = ((size_t)segs[s].lh * cap + (size_t)r) * hd;
            in_seg[(size_t)segs[s].lh * cap + (size_t)r] = 1;
            for (int e = 0; e < hd; e++) x[e] = xo[e] = bf2f(h[o + e]);
            kvz_rope_shift_rows(x, 1, hd, inv, kc->adjacent, deltas[segs[s].doc]);
            kvz_rope_shift_rows(xo, 1, hd, inv, kc->adjacent, deltas[segs[s].doc] + 1);
            for (int e = 0; e < hd; e++) {
                const double ref = (double)x[e] * kc->key_scale, got = bf2f(g[o + e]);
                /* one bf16 step of the reference (2^-7 relative), plus a floor for values near 0 */
                if (!(fabs(got - ref) <= fabs(ref) * 0x1p-7 + 1e-6)) bad++;
                num += (got - ref) * (got - ref);
                den += ref * ref;
                const double refo = (double)xo[e] * kc->key_scale;
                num_off += (got - refo) * (got - refo);
            }
        }
    }
    for (size_t i = 0; i < (size_t)nlh * cap; i++)
        if (!in_seg[i] && memcmp(g + i * hd, h + i * hd, (size_t)hd * 2)) untouched_bad++;
    const double err = sqrt(num / den), err_off = sqrt(num_off / den);
    printf("  kernel %-34s hd %3d: %d segments, rel err %.2e, elements off by > 1 bf16 step %zu, "
           "rows outside changed %zu; vs CPU shifted by Δ+1: rel err %.2e\n",
           kc->name, hd, ns, err, bad, untouched_bad, err_off);
    CHECK(bad == 0);
    CHECK(untouched_bad == 0);
    CHECK(err < 4e-3);
    CHECKF(err_off > 100 * err, "a shift off by one is not told apart: %.2e vs %.2e", err_off, err);
    CU(cudaFree(dk)); CU(cudaFree(dsg)); CU(cudaFree(dcs)); CU(cudaFree(dsn));
    free(inv); free(h); free(g); free(cs); free(sn); free(in_seg); free(x); free(xo);
}

/* ---------------------------------------------------------------- 2. end to end */
static double rel_err(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] != a[i]) return INFINITY;
        const double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static int question_logits(kvz_model *m, kvz_kv *kv, const int32_t *q, int32_t nq, int32_t pos0, float *out)
{
    kvz_kv_checkpoint(kv);
    int rc = kvz_forward(m, kv, q, nq, pos0, out, KVZ_FWD_LOGITS_ALL, NULL);
    kvz_kv_rollback(kv);
    return rc;
}

static int g_map_only; /* compose(): read the records through the LMDB map (kvz_compose_opts.map_only) */

static kvz_kv *compose(kvz_model *m, kvz_store *st, const char **ids, int n, int place, int bias, float ks,
                       int host, int64_t extra, kvz_compose_meta *cm)
{
    kvz_compose_opts co;
    kvz_compose_defaults(&co);
    co.map_only = g_map_only;
    co.placement = place;
    co.shift_bias = bias;
    co.key_scale = ks;
    co.host_path = host;
    kvz_kv *kv = NULL;
    int rc = kvz_docs_load(m, st, ids, n, &co, extra, 0, &kv, cm, NULL);
    CHECKF(rc == 0, "kvz_docs_load: %s (%s)", kvz_strerror(rc), kvz_error_detail());
    return kv;
}

static int e2e(const char *name, int32_t na, int32_t nb, int device)
{
    char dir[] = "/tmp/kvz_test_compose_cuda_XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL);
    kvz_model_opts mo = {.device = device};
    kvz_model *m;
    REQUIRE(kvz_model_synthetic(name, &mo, &m) == 0);
    const kvz_config *c = kvz_model_config(m);
    kvz_tokens pre = {0};
    REQUIRE(kvz_chat_prefix(kvz_model_tokenizer(m), &pre) == 0);
    const int32_t np = (int32_t)pre.n, nq = 12, qpos = np + na + nb;
    int32_t *a = malloc(sizeof(int32_t) * (size_t)na), *b = malloc(sizeof(int32_t) * (size_t)nb), q[12];
    for (int32_t i = 0; i < na; i++) a[i] = 32 + (int32_t)(rng() % 95);
    for (int32_t i = 0; i < nb; i++) b[i] = 32 + (int32_t)(rng() % 95);
    for (int32_t i = 0; i < nq; i++) q[i] = 32 + (int32_t)(rng() % 95);
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    kvz_store *st;
    REQUIRE(kvz_store_open(dir, KVZ_STORE_CREATE, 0, fp, &st) == 0);
    kvz_ingest_opts io;
    kvz_ingest_defaults(&io);
    io.kp.ratio = 1.0f;
    io.dtype = KVZ_DTYPE_F32;
    kvz_ingest_result r;
    REQUIRE(kvz_ingest_doc(m, st, "A", "a", a, na, &io, &r) == 0);
    REQUIRE(kvz_ingest_doc(m, st, "B", "b", b, nb, &io, &r) == 0);

    /* reference: A prefilled normally; B (with its own prefix copy, both moved by n_A)
     * prefilled at np + na .. over that prefix only; joined (the copy dropped) */
    kvz_kv *ka, *kb, *ref;
    REQUIRE(kvz_kv_create(m, np + na, 0, &ka) == 0);
    REQUIRE(kvz_kv_create(m, np + nb, 0, &kb) == 0);
    REQUIRE(kvz_kv_create(m, qpos + nq, 0, &ref) == 0);
    int32_t *all = malloc(sizeof(int32_t) * (size_t)(np + na));
    memcpy(all, pre.ids, sizeof(int32_t) * (size_t)np);
    memcpy(all + np, a, sizeof(int32_t) * (size_t)na);
    REQUIRE(kvz_forward(m, ka, all, np + na, 0, NULL, KVZ_FWD_NO_LOGITS, NULL) == 0);
    REQUIRE(kvz_forward(m, kb, pre.ids, np, na, NULL, KVZ_FWD_NO_LOGITS, NULL) == 0);
    REQUIRE(kvz_forward(m, kb, b, nb, np + na, NULL, KVZ_FWD_NO_LOGITS, NULL) == 0);
    const size_t hd = (size_t)c->head_dim, per = (size_t)qpos, nkv = (size_t)c->n_kv_head;
    float *K = malloc(sizeof(float) * per * hd * nkv), *V = malloc(sizeof(float) * per * hd * nkv);
    int32_t *P = malloc(sizeof(int32_t) * per * nkv);
    uint32_t *cnt = malloc(sizeof(uint32_t) * nkv);
    float *tk = malloc(sizeof(float) * (size_t)(np + nb) * hd), *tv = malloc(sizeof(float) * (size_t)(np + nb) * hd);
    int32_t *tp = malloc(sizeof(int32_t) * (size_t)(np + nb));
    for (int32_t l = 0; l < c->n_layer; l++) {
        for (int32_t h = 0; h < c->n_kv_head; h++) {
            const size_t o0 = (size_t)h * per;
            REQUIRE(kvz_kv_get_head(ka, l, h, K + o0 * hd, V + o0 * hd, P + o0) == 0);
            REQUIRE(kvz_kv_get_head(kb, l, h, tk, tv, tp) == 0);
            memcpy(K + (o0 + (size_t)(np + na)) * hd, tk + (size_t)np * hd, sizeof(float) * (size_t)nb * hd);
            memcpy(V + (o0 + (size_t)(np + na)) * hd, tv + (size_t)np * hd, sizeof(float) * (size_t)nb * hd);
            memcpy(P + o0 + np + na, tp + np, sizeof(int32_t) * (size_t)nb);
            cnt[h] = (uint32_t)per;
        }
        REQUIRE(kvz_kv_set_layer(ref, l, cnt, P, K, V) == 0);
    }
    const size_t nl = (size_t)nq * (size_t)c->n_vocab;
    float *lr = malloc(sizeof(float) * nl), *lc = malloc(sizeof(float) * nl), *lh = malloc(sizeof(float) * nl);
    REQUIRE(question_logits(m, ref, q, nq, qpos, lr) == 0);

    const char *ab[] = {"A", "B"};
    kvz_compose_meta cm;
    double d[3], dk[3], dkh[3];
    size_t bad = 0; /* moved key elements more than one bf16 step from the host path's */
    float *K2 = malloc(sizeof(float) * per * hd), *K3 = malloc(sizeof(float) * per * hd);
    kvz_kv *kh = compose(m, st, ab, 2, KVZ_PLACE_SEQUENTIAL, 0, 0.f, 1, nq, &cm); /* host path */
    REQUIRE(kh != NULL);
    REQUIRE(question_logits(m, kh, q, nq, qpos, lh) == 0);
    for (int bias = -1; bias <= 1; bias++) {
        kvz_kv *kv = compose(m, st, ab, 2, KVZ_PLACE_SEQUENTIAL, bias, 0.f, 0, nq, &cm);
        REQUIRE(kv != NULL);
        /* the moved keys themselves (document B's rows) against the reference's and the
         * host path's */
        double num = 0, den = 0, numh = 0, denh = 0;
        for (int32_t l = 0; l < c->n_layer; l++)
            for (int32_t h = 0; h < c->n_kv_head; h++) {
                REQUIRE(kvz_kv_get_head(ref, l, h, K, NULL, NULL) == 0);
                REQUIRE(kvz_kv_get_head(kv, l, h, K2, NULL, NULL) == 0);
                REQUIRE(kvz_kv_get_head(kh, l, h, K3, NULL, NULL) == 0);
                for (size_t i = (size_t)(np + na) * hd; i < per * hd; i++) {
                    num += ((double)K2[i] - K[i]) * ((double)K2[i] - K[i]);
                    den += (double)K[i] * K[i];
                    numh += ((double)K2[i] - K3[i]) * ((double)K2[i] - K3[i]);
                    denh += (double)K3[i] * K3[i];
                }
                /* per element: one bf16 step of the host value, plus fp32 rounding of the
                 * row's magnitude (where a pair's rotation cancels to near 0, the two fp32
                 * evaluations — FMA or not — differ by ~2^-23 of the inputs, not of the result) */
                for (size_t r = (size_t)(np + na); bias == 0 && r < per; r++) {
                    double mx = 0;
                    for (size_t e = 0; e < hd; e++) mx = fmax(mx, fabs((double)K3[r * hd + e]));
                    for (size_t e = r * hd; e < (r + 1) * hd; e++)
                        if (!(fabs((double)K2[e] - K3[e]) <= fabs((double)K3[e]) * 0x1p-7 + mx * 0x1p-18)) bad++;
                }
            }
        dk[bias + 1] = sqrt(num / den);
        dkh[bias + 1] = sqrt(numh / denh);
        CHECK(cm.n_docs == 2 && cm.placement == KVZ_PLACE_SEQUENTIAL && cm.q_pos == qpos && cm.n_prefix == np);
        CHECK(cm.rows == (uint64_t)qpos * (uint64_t)c->n_layer * nkv);
        if (bias == 0) { /* positions of one head: 0 .. qpos-1 in order */
            int ok = 1;
            for (int32_t l = 0; l < c->n_layer; l += c->n_layer > 1 ? c->n_layer - 1 : 1)
                for (int32_t h = 0; h < c->n_kv_head; h++) {
                    REQUIRE(kvz_kv_get_head(kv, l, h, NULL, NULL, P) == 0);
                    ok &= kvz_kv_len(kv, l, h) == qpos;
                    for (int32_t i = 0; i < qpos; i++) ok &= P[i] == i;
                }
            CHECKF(ok, "composed positions are not 0 .. %d", qpos - 1);
        }
        REQUIRE(question_logits(m, kv, q, nq, qpos, lc) == 0);
        d[bias + 1] = rel_err(lc, lr, nl);
        kvz_kv_free(kv);
    }
    kvz_kv_free(kh);
    kvz_kv *kv = compose(m, st, ab, 2, KVZ_PLACE_SEQUENTIAL, 0, 0.f, 0, nq, &cm);
    REQUIRE(question_logits(m, kv, q, nq, qpos, lc) == 0);
    { /* the same composition with every record read through the LMDB map (the route before
       * the copy reads): the same bits in every head (keys, values, positions, lengths) */
        g_map_only = 1;
        kvz_kv *km = compose(m, st, ab, 2, KVZ_PLACE_SEQUENTIAL, 0, 0.f, 0, nq, &cm);
        g_map_only = 0;
        REQUIRE(km != NULL);
        float *V2 = malloc(sizeof(float) * per * hd);
        int32_t *P2 = malloc(sizeof(int32_t) * per);
        size_t heads = 0;
        for (int32_t l = 0; l < c->n_layer; l++)
            for (int32_t h = 0; h < c->n_kv_head; h++) {
                const int64_t n = kvz_kv_len(kv, l, h);
                REQUIRE(n == kvz_kv_len(km, l, h) && n <= (int64_t)per);
                REQUIRE(kvz_kv_get_head(kv, l, h, K2, V, P) == 0);
                REQUIRE(kvz_kv_get_head(km, l, h, K3, V2, P2) == 0);
                heads += memcmp(K2, K3, sizeof(float) * (size_t)n * hd) || memcmp(V, V2, sizeof(float) * (size_t)n * hd) ||
                         memcmp(P, P2, sizeof(int32_t) * (size_t)n);
            }
        printf("  [%s] sequential, records through the copy route vs through the map: %zu heads differ\n", name, heads);
        CHECKF(heads == 0, "the copy and the map route compose different caches (%zu heads)", heads);
        kvz_kv_free(km);
        free(V2);
        free(P2);
    }
    kvz_kv_free(kv);
    const double dh = rel_err(lc, lh, nl), dhr = rel_err(lh, lr, nl);
    printf("  [%s %s, %s RoPE, hd %d] A+B (%d + %d + %d tokens), r = 1.0, B's moved keys:\n"
           "    vs the host path (fp32 re-rotation): %.2e (bound %.0e), elements > 1 bf16 step apart %zu; "
           "shift off by -1: %.2e, by +1: %.2e (bound > %.2f)\n"
           "    vs the shifted-prefill reference: %.2e (bound %.0e); shift off by -1: %.2e, by +1: %.2e (bound > 10x)\n",
           name, device == KVZ_DEVICE_CUDA ? "cuda" : "cpu", c->rope_adjacent ? "adjacent" : "half-split",
           c->head_dim, np, na, nb, dkh[1], TOL_KEYS_HOST, bad, dkh[0], dkh[2], OFF_KEYS, dk[1], TOL_KEYS, dk[0],
           dk[2]);
    printf("    question logits: composed vs shifted-prefill reference %.2e (bound %.0e); shift off by -1: %.2e, "
           "by +1: %.2e (bound > %.1fx); device vs host path %.2e (bound %.0e; host path vs reference %.2e)\n",
           d[1], TOL_SEQ, d[0], d[2], OFF_FACTOR, dh, TOL_HOST, dhr);
    CHECKF(dkh[1] < TOL_KEYS_HOST && bad == 0, "device keys differ from the host path's: %.3g, %zu elements", dkh[1],
           bad);
    CHECKF(dkh[0] > OFF_KEYS && dkh[2] > OFF_KEYS, "off-by-one keys not told apart from the host path's: %.3g / %.3g",
           dkh[0], dkh[2]);
    CHECKF(dk[1] < TOL_KEYS, "composed keys differ from the reference by %.3g", dk[1]);
    CHECKF(dk[0] > 10 * dk[1] && dk[2] > 10 * dk[1], "off-by-one keys not told apart: %.3g / %.3g vs %.3g",
           dk[0], dk[2], dk[1]);
    CHECKF(d[1] < TOL_SEQ, "composed logits differ from the reference by %.3g", d[1]);
    CHECKF(d[0] > OFF_FACTOR * d[1] && d[2] > OFF_FACTOR * d[1], "an off-by-one shift is not caught: %.3g / %.3g vs %.3g",
           d[0], d[2], d[1]);
    CHECKF(dh < TOL_HOST, "device and host composition differ by %.3g", dh);

    /* parallel with a key scale: the device path (scale in the kernel) vs the host path */
    const int32_t qp = np + (na > nb ? na : nb);
    kv = compose(m, st, ab, 2, KVZ_PLACE_PARALLEL, 0, 0.8f, 0, nq, &cm);
    REQUIRE(kv != NULL && cm.q_pos == qp);
    REQUIRE(kvz_kv_get_head(kv, 0, 0, NULL, NULL, P) == 0);
    CHECK(P[np + na] == np && P[np + na + nb - 1] == np + nb - 1);
    REQUIRE(question_logits(m, kv, q, nq, qp, lc) == 0);
    kvz_kv_free(kv);
    kv = compose(m, st, ab, 2, KVZ_PLACE_PARALLEL, 0, 0.8f, 1, nq, &cm);
    REQUIRE(question_logits(m, kv, q, nq, qp, lh) == 0);
    kvz_kv_free(kv);
    kv = compose(m, st, ab, 2, KVZ_PLACE_PARALLEL, 0, 1.0f, 0, nq, &cm);
    REQUIRE(question_logits(m, kv, q, nq, qp, lr) == 0);
    kvz_kv_free(kv);
    const double dp = rel_err(lc, lh, nl), dps = rel_err(lc, lr, nl);
    printf("  [%s] parallel, key scale 0.8: device vs host path %.2e (bound %.0e); vs no scale %.2e\n", name, dp,
           TOL_HOST, dps);
    CHECK(dp < TOL_HOST);
    CHECK(dps > OFF_FACTOR * dp); /* the scale was applied */

    kvz_kv_free(ka); kvz_kv_free(kb); kvz_kv_free(ref);
    free(a); free(b); free(all); free(K); free(K2); free(K3); free(V); free(P); free(cnt); free(tk); free(tv); free(tp);
    free(lr); free(lc); free(lh);
    kvz_tokens_free(&pre);
    kvz_store_close(st);
    kvz_model_free(m);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
    return 0;
}

int main(void)
{
    const char *se = getenv("KVZ_SEED");
    g_rng = se ? strtoull(se, NULL, 10) : (uint64_t)time(NULL);
    if (!g_rng) g_rng = 1;
    printf("seed %llu (KVZ_SEED reproduces)\n", (unsigned long long)g_rng);
    if (!kvz_cuda_available()) {
        /* KVZ_COMPOSE_ON_CPU=1: the end-to-end part on the CPU backend (calibration) */
        const char *cpu = getenv("KVZ_COMPOSE_ON_CPU");
        if (!(cpu && cpu[0] == '1')) {
            printf("SKIP: no usable CUDA device\n");
            return 77;
        }
        e2e(getenv("KVZ_COMPOSE_MODEL") ? getenv("KVZ_COMPOSE_MODEL") : "tiny-qwen3", 300, 250, KVZ_DEVICE_CPU);
        return kvz_test_summary();
    }
    const kcase kc[] = {
        {"adjacent (llama)", 128, 1, 0, 1.0f},
        {"adjacent, scaled frequencies", 128, 1, 1, 1.0f},
        {"half-split (qwen2/qwen3)", 128, 0, 0, 1.0f},
        {"half-split, scaled, key scale 0.9", 64, 0, 1, 0.9f},
        {"adjacent, one-pair path", 36, 1, 0, 1.0f},
        {"half-split, one-pair path", 72, 0, 0, 1.0f},
    };
    for (size_t i = 0; i < sizeof kc / sizeof kc[0]; i++) kernel_case(&kc[i]);
    /* the CUDA KVzip scoring needs head_dim 64 or 128: tiny-qwen3 (half-split) and
     * smollm2-135m (adjacent) run end to end; hd 128 is covered by the kernel cases */
    e2e("tiny-qwen3", 300, 250, KVZ_DEVICE_CUDA);
    e2e("smollm2-135m", 400, 350, KVZ_DEVICE_CUDA);
    return kvz_test_summary();
}
