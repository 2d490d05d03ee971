/* GPU kernel bench: times each kvzip CUDA kernel with cudaEvents (3 warm-ups, median
 * of N runs) on random data and prints achieved TFLOP/s or GB/s beside the bound
 * measured in the same run: a large cuBLAS bf16 GEMM (through kvz_cuda_linear) and
 * a device-to-device cudaMemcpy (bytes read + written). Shapes: llama3-8b
 * (32 q heads, 8 kv heads, hd 128) and SmolLM2-135M (9/3, hd 64).
 * Usage: gpu_kernels [quick|attn]. Exit 77 without a GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_gpu_test_util.h"

#include "kvz_cuda.h"
#include "kvz_error.h"

static cudaStream_t S;
static cudaEvent_t E0, E1;
static double g_peak_tflops, g_copy_gbs;

#define OK(call)                                                                              \
    do {                                                                                      \
        int rc_ = (call);                                                                     \
        if (rc_) { fprintf(stderr, "%s:%d %s -> %s (%s)\n", __FILE__, __LINE__, #call,        \
                           kvz_strerror(rc_), kvz_error_detail()); exit(1); }                 \
    } while (0)

static int cmpd(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef void (*bench_fn)(void *);
/* median ms of n timed runs after 3 warm-ups */
static double time_ms(bench_fn f, void *ctx, int n)
{
    for (int i = 0; i < 3; i++) f(ctx);
    CU(cudaStreamSynchronize(S));
    double *t = malloc(n * sizeof(double));
    for (int i = 0; i < n; i++) {
        CU(cudaEventRecord(E0, S));
        f(ctx);
        CU(cudaEventRecord(E1, S));
        CU(cudaEventSynchronize(E1));
        float ms;
        CU(cudaEventElapsedTime(&ms, E0, E1));
        t[i] = ms;
    }
    qsort(t, n, sizeof(double), cmpd);
    double m = t[n / 2];
    free(t);
    return m;
}

static void *drand_bf(size_t n, float scale)
{
    uint16_t *h = malloc(n * 2);
    for (size_t i = 0; i < n; i++) h[i] = h_f2bf(rng_sym() * scale);
    void *d = dup_to_dev(h, n * 2);
    free(h);
    return d;
}
static float *drand_f(size_t n, float lo, float hi)
{
    float *h = malloc(n * 4);
    for (size_t i = 0; i < n; i++) h[i] = lo + (hi - lo) * (float)rng_uni();
    float *d = dup_to_dev(h, n * 4);
    free(h);
    return d;
}

static void report_flops(const char *name, double ms, double flop)
{
    double tf = flop / ms * 1e-9;
    printf("%-48s %9.3f ms %8.1f TFLOP/s  (%5.1f%% of GEMM %.0f)\n", name, ms, tf,
           100 * tf / g_peak_tflops, g_peak_tflops);
}
static void report_bytes(const char *name, double ms, double bytes)
{
    double gb = bytes / ms * 1e-6;
    printf("%-48s %9.3f ms %8.0f GB/s     (%5.1f%% of copy %.0f)\n", name, ms, gb,
           100 * gb / g_copy_gbs, g_copy_gbs);
}

/* ---------------------------------------------------------------- contexts */
typedef struct { kvz_cuda_blas *b; int T, in, out; void *x, *w, *y; kvz_cuda_dtype yt; } gemm_ctx;
static void run_gemm(void *p)
{
    gemm_ctx *c = p;
    OK(kvz_cuda_linear(c->b, S, c->T, c->in, c->out, c->x, c->in, c->w, NULL, c->y, c->yt, c->out, 0.f));
}
typedef struct { void *a, *b; size_t n; } copy_ctx;
static void run_copy(void *p) { copy_ctx *c = p; CU(cudaMemcpyAsync(c->b, c->a, c->n, cudaMemcpyDeviceToDevice, S)); }

typedef struct { int T, nh; void *q; int32_t *qpos; kvz_cuda_kv kv; kvz_cuda_outbuf *ob; void *o; } attn_ctx;
static void run_prefill(void *p)
{
    attn_ctx *c = p;
    OK(kvz_cuda_attn_prefill(S, c->T, c->nh, c->q, c->nh * c->kv.hd, c->qpos, &c->kv, c->ob, c->o, c->nh * c->kv.hd));
}
typedef struct { attn_ctx a; int max_len; void *ws; size_t wsb; float *sc; int32_t *ev; } dec_ctx;
static void run_decode(void *p)
{
    dec_ctx *c = p;
    OK(kvz_cuda_attn_decode(S, c->a.T, c->a.nh, c->a.q, c->a.nh * c->a.kv.hd, c->a.qpos, &c->a.kv,
                            c->max_len, c->a.ob, c->a.o, c->a.nh * c->a.kv.hd, c->ws, c->wsb, c->sc, c->ev));
}
typedef struct { attn_ctx a; kvz_cuda_kvzip_rows r; float *score; void *ws; size_t wsb; } score_ctx;
static void run_score(void *p)
{
    score_ctx *c = p;
    OK(kvz_cuda_kvzip_score(S, c->a.T, c->a.nh, c->a.q, c->a.nh * c->a.kv.hd, c->a.qpos, &c->a.kv, &c->r,
                            c->score, c->r.c1 - c->r.c0, c->ws, c->wsb, c->a.o, c->a.nh * c->a.kv.hd));
}
typedef struct { float *x; int64_t n, K; uint8_t *keep; void *ws; size_t wsb; int rows, cols; } topk_ctx;
static void run_topk(void *p) { topk_ctx *c = p; OK(kvz_cuda_topk_global(S, c->x, c->n, c->K, c->keep, c->ws, c->wsb)); }
static void run_topk_rows(void *p) { topk_ctx *c = p; OK(kvz_cuda_topk_rows(S, c->x, c->rows, c->cols, (int)c->K, c->keep)); }
typedef struct { int T, d; float *x; void *add, *out; float *w; } norm_ctx;
static void run_norm(void *p) { norm_ctx *c = p; OK(kvz_cuda_rmsnorm(S, c->T, c->d, 1e-5f, c->x, c->add, KVZ_CUDA_BF16, c->w, c->out, KVZ_CUDA_BF16)); }
typedef struct { int T, F; void *g, *o; } swi_ctx;
static void run_swiglu(void *p) { swi_ctx *c = p; OK(kvz_cuda_swiglu(S, c->T, c->F, c->g, 2 * c->F, (uint16_t *)c->g + c->F, 2 * c->F, c->o, c->F)); }
typedef struct { int T, nh, nkv, hd; void *qkv; int32_t *pos; } rope_ctx;
static void run_rope(void *p)
{
    rope_ctx *c = p;
    int ld = (c->nh + 2 * c->nkv) * c->hd;
    OK(kvz_cuda_rope(S, c->T, c->nh, c->nkv, c->hd, c->qkv, ld, (uint16_t *)c->qkv + c->nh * c->hd, ld, c->pos,
                     500000.f, KVZ_ROPE_HALF, NULL, NULL, 1e-6f));
}
typedef struct { kvz_cuda_kv src, dst; int n_prefix, n_ctx; uint8_t *keep; } comp_ctx;
static void run_compact(void *p) { comp_ctx *c = p; OK(kvz_cuda_kv_compact(S, &c->src, c->n_prefix, c->n_ctx, c->keep, &c->dst)); }
typedef struct { float *lg; int V; int32_t *out; } am_ctx;
static void run_argmax(void *p) { am_ctx *c = p; OK(kvz_cuda_argmax(S, c->lg, 1, c->V, c->V, c->out)); }

/* cache of n_kv heads × cap rows with len rows each, positions 0..len-1 */
static kvz_cuda_kv make_cache(int n_kv, int cap, int hd, int len)
{
    kvz_cuda_kv kv;
    kv.n_kv = n_kv; kv.cap = cap; kv.hd = hd;
    kv.k = drand_bf((size_t)n_kv * cap * hd, 1.f);
    kv.v = drand_bf((size_t)n_kv * cap * hd, 1.f);
    int32_t *pos = malloc((size_t)n_kv * cap * 4), *lens = malloc(n_kv * 4);
    for (int h = 0; h < n_kv; h++) { lens[h] = len; for (int i = 0; i < cap; i++) pos[(size_t)h * cap + i] = i; }
    kv.pos = dup_to_dev(pos, (size_t)n_kv * cap * 4);
    kv.len = dup_to_dev(lens, n_kv * 4);
    free(pos); free(lens);
    return kv;
}
static void free_cache(kvz_cuda_kv *kv) { cudaFree(kv->k); cudaFree(kv->v); cudaFree(kv->pos); cudaFree(kv->len); }
static int32_t *dev_iota(int n, int base)
{
    int32_t *h = malloc(n * 4);
    for (int i = 0; i < n; i++) h[i] = base + i;
    int32_t *d = dup_to_dev(h, n * 4);
    free(h);
    return d;
}

static void bench_prefill(int nh, int nkv, int hd, int T, int iters)
{
    attn_ctx c = {T, nh, drand_bf((size_t)T * nh * hd, 1.f), dev_iota(T, 0), make_cache(nkv, T, hd, T), NULL,
                  dalloc((size_t)T * nh * hd * 2)};
    double ms = time_ms(run_prefill, &c, iters);
    double flop = 4.0 * hd * nh * ((double)T * (T + 1) / 2); /* causal: QKᵀ + PV */
    char name[96];
    snprintf(name, sizeof name, "prefill attn %d/%d hd%d T=%d causal", nh, nkv, hd, T);
    report_flops(name, ms, flop);
    cudaFree(c.q); cudaFree(c.qpos); cudaFree(c.o); free_cache(&c.kv);
}

static void bench_decode(int nh, int nkv, int hd, int ctx, int B, int iters)
{
    dec_ctx c;
    memset(&c, 0, sizeof c);
    c.a.T = 1; c.a.nh = nh;
    c.a.q = drand_bf((size_t)nh * hd, 1.f);
    c.a.qpos = dev_iota(1, ctx + B);
    c.a.kv = make_cache(nkv, ctx, hd, ctx);
    c.a.o = dalloc((size_t)nh * hd * 2);
    kvz_cuda_outbuf ob;
    if (B) {
        ob.n_slot = B; ob.n_sink = 4;
        ob.k = drand_bf((size_t)nkv * B * hd, 1.f);
        ob.v = drand_bf((size_t)nkv * B * hd, 1.f);
        ob.slot_pos = dev_iota(B, ctx);
        c.a.ob = &ob;
        c.sc = dalloc(B * 4);
        c.ev = dalloc(4);
    }
    c.max_len = ctx;
    c.wsb = kvz_cuda_attn_decode_ws_size(1, nh, hd, ctx, B);
    c.ws = dalloc(c.wsb);
    double ms = time_ms(run_decode, &c, iters);
    double bytes = 2.0 * nkv * (double)(ctx + B) * hd * 2 + (double)nkv * (ctx + B) * 4;
    char name[96];
    snprintf(name, sizeof name, "decode attn %d/%d hd%d ctx=%d%s", nh, nkv, hd, ctx, B ? " +LongFlow B" : "");
    if (B) snprintf(name + strlen(name), sizeof name - strlen(name), "=%d", B);
    report_bytes(name, ms, bytes);
    cudaFree(c.a.q); cudaFree(c.a.qpos); cudaFree(c.a.o); cudaFree(c.ws); free_cache(&c.a.kv);
    if (B) { cudaFree(ob.k); cudaFree(ob.v); cudaFree(ob.slot_pos); cudaFree(c.sc); cudaFree(c.ev); }
}

/* The repeat pass's attention at context n_ctx: R queries after the context over the
 * whole cache (prefix + context + causal repeat rows); plain, and with the KVzip subset
 * statistics fused in followed by the one-pass chunk score (the ingest path). */
typedef struct { score_ctx s; void *o; } rep_ctx;
static void run_repeat_plain(void *p)
{
    rep_ctx *c = p;
    OK(kvz_cuda_attn_prefill(S, c->s.a.T, c->s.a.nh, c->s.a.q, c->s.a.nh * c->s.a.kv.hd, c->s.a.qpos, &c->s.a.kv,
                             NULL, c->o, c->s.a.nh * c->s.a.kv.hd));
}
static void run_repeat_fused(void *p)
{
    rep_ctx *c = p;
    score_ctx *s = &c->s;
    int ld = s->a.nh * s->a.kv.hd;
    OK(kvz_cuda_attn_prefill_kvzip(S, s->a.T, s->a.nh, s->a.q, ld, s->a.qpos, &s->a.kv, c->o, ld, &s->r, s->ws,
                                   s->wsb));
    OK(kvz_cuda_kvzip_score_fused(S, s->a.T, s->a.nh, s->a.q, ld, s->a.qpos, &s->a.kv, s->r.c0, s->r.c1, s->score,
                                  s->r.c1 - s->r.c0, s->ws, s->wsb));
}
static void run_score_fused_only(void *p)
{
    rep_ctx *c = p;
    score_ctx *s = &c->s;
    int ld = s->a.nh * s->a.kv.hd;
    OK(kvz_cuda_kvzip_score_fused(S, s->a.T, s->a.nh, s->a.q, ld, s->a.qpos, &s->a.kv, s->r.c0, s->r.c1, s->score,
                                  s->r.c1 - s->r.c0, s->ws, s->wsb));
}
static void bench_repeat(int nh, int nkv, int hd, int n_prefix, int n_ctx, int chunk, int R, int iters)
{
    rep_ctx c;
    int L = n_prefix + n_ctx + R;
    c.s.a.T = R; c.s.a.nh = nh;
    c.s.a.q = drand_bf((size_t)R * nh * hd, 1.f);
    c.s.a.qpos = dev_iota(R, n_prefix + n_ctx);
    c.s.a.kv = make_cache(nkv, L, hd, L);
    c.s.a.ob = NULL;
    c.o = dalloc((size_t)R * nh * hd * 2);
    c.s.a.o = c.o; /* the two-pass score's scratch output, as the backend's last layer passes it */
    c.s.r = (kvz_cuda_kvzip_rows){n_prefix, n_prefix + n_ctx - chunk, n_prefix + n_ctx, n_prefix + n_ctx,
                                  n_prefix + n_ctx, L};
    c.s.score = dalloc((size_t)nkv * chunk * 4);
    c.s.wsb = kvz_cuda_kvzip_score_ws_size(R, nh);
    c.s.ws = dalloc(c.s.wsb);
    double keys = n_prefix + n_ctx + (R + 1) / 2.0;
    double flop = 4.0 * hd * nh * (double)R * keys;
    char name[96];
    double ms = time_ms(run_repeat_plain, &c, iters);
    snprintf(name, sizeof name, "repeat attn %d/%d hd%d R=%d ctx=%d", nh, nkv, hd, R, n_ctx);
    report_flops(name, ms, flop);
    ms = time_ms(run_repeat_fused, &c, iters);
    snprintf(name, sizeof name, "  + fused kvzip stats + chunk score (%d)", chunk);
    report_flops(name, ms, flop); /* same useful FLOPs: the score's extra QK pass is overhead */
    ms = time_ms(run_score_fused_only, &c, iters);
    snprintf(name, sizeof name, "  (of which the one-pass chunk score)");
    report_flops(name, ms, 2.0 * hd * nh * (double)R * chunk);
    ms = time_ms(run_score, &c.s, iters);
    snprintf(name, sizeof name, "  (two-pass score over K̄ alone: the last layer's)");
    double keys1 = n_prefix + chunk + (R + 1) / 2.0;
    report_flops(name, ms, 2.0 * hd * nh * (double)R * (keys1 + chunk));
    cudaFree(c.s.a.q); cudaFree(c.s.a.qpos); cudaFree(c.s.score); cudaFree(c.s.ws); cudaFree(c.o);
    free_cache(&c.s.a.kv);
}

static void bench_score(int nh, int nkv, int hd, int n_prefix, int n_ctx, int c0, int chunk, int R, int iters)
{
    score_ctx c;
    int L = n_prefix + n_ctx + R;
    c.a.T = R; c.a.nh = nh;
    c.a.q = drand_bf((size_t)R * nh * hd, 1.f);
    c.a.qpos = dev_iota(R, n_prefix + n_ctx);
    c.a.kv = make_cache(nkv, L, hd, L);
    c.a.ob = NULL; c.a.o = NULL;
    c.r = (kvz_cuda_kvzip_rows){n_prefix, n_prefix + c0, n_prefix + c0 + chunk, n_prefix + n_ctx, n_prefix + n_ctx, L};
    c.score = dalloc((size_t)nkv * chunk * 4);
    c.wsb = kvz_cuda_kvzip_score_ws_size(R, nh);
    c.ws = dalloc(c.wsb);
    double ms = time_ms(run_score, &c, iters);
    /* QKᵀ over the subset twice over the chunk (pass 1 + pass 2) */
    double keys1 = n_prefix + chunk + (R + 1) / 2.0;
    double flop = 2.0 * hd * nh * (double)R * (keys1 + chunk);
    char name[96];
    snprintf(name, sizeof name, "kvzip score %d/%d hd%d R=%d chunk=%d (stats kernel)", nh, nkv, hd, R, chunk);
    report_flops(name, ms, flop);
    cudaFree(c.a.q); cudaFree(c.a.qpos); cudaFree(c.score); cudaFree(c.ws); free_cache(&c.a.kv);
}

int main(int argc, char **argv)
{
    int quick = argc > 1 && !strcmp(argv[1], "quick");
    int attn_only = argc > 1 && !strcmp(argv[1], "attn"); /* attention benches only (A/B of kernels) */
    int it = quick ? 5 : 20;
    int n = 0;
    if (kvz_cuda_device_count(&n) || !n) { printf("SKIP: no CUDA device (%s)\n", kvz_error_detail()); return 77; }
    rng_seed((uint64_t)time(NULL));
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    CU(cudaStreamCreate(&S));
    CU(cudaEventCreate(&E0)); CU(cudaEventCreate(&E1));
    kvz_cuda_blas *bl;
    OK(kvz_cuda_blas_create(&bl));

    /* bounds */
    {
        gemm_ctx g = {bl, 8192, 8192, 8192, drand_bf(8192ull * 8192, 1.f), drand_bf(8192ull * 8192, 1.f),
                      dalloc(8192ull * 8192 * 2), KVZ_CUDA_BF16};
        double ms = time_ms(run_gemm, &g, it);
        g_peak_tflops = 2.0 * 8192.0 * 8192.0 * 8192.0 / ms * 1e-9;
        printf("%-48s %9.3f ms %8.1f TFLOP/s  (bound)\n", "cuBLAS bf16 GEMM 8192^3 (kvz_cuda_linear)", ms, g_peak_tflops);
        cudaFree(g.x); cudaFree(g.w); cudaFree(g.y);
        copy_ctx c = {dalloc(2ull << 30), dalloc(2ull << 30), 2ull << 30};
        ms = time_ms(run_copy, &c, it);
        g_copy_gbs = 2.0 * (double)c.n / ms * 1e-6;
        printf("%-48s %9.3f ms %8.0f GB/s     (bound, read+write)\n", "cudaMemcpy D2D 2 GiB", ms, g_copy_gbs);
        cudaFree(c.a); cudaFree(c.b);
    }
    /* GEMM shapes of a llama3-8b layer */
    if (!attn_only) {
        int T = 4096;
        gemm_ctx g = {bl, T, 4096, 14336, drand_bf((size_t)T * 4096, 1.f), drand_bf(14336ull * 4096, 0.02f),
                      dalloc((size_t)T * 14336 * 2), KVZ_CUDA_BF16};
        double ms = time_ms(run_gemm, &g, it);
        report_flops("linear T=4096 4096->14336 (bf16 out)", ms, 2.0 * T * 4096.0 * 14336);
        g.T = 1;
        ms = time_ms(run_gemm, &g, it);
        report_bytes("linear T=1 4096->14336 (weight-read bound)", ms, 14336.0 * 4096 * 2);
        cudaFree(g.x); cudaFree(g.w); cudaFree(g.y);
        gemm_ctx h = {bl, 1, 4096, 128256, drand_bf(4096, 1.f), drand_bf(128256ull * 4096, 0.02f),
                      dalloc(128256ull * 4 * 4), KVZ_CUDA_F32};
        ms = time_ms(run_gemm, &h, it);
        report_bytes("LM head T=1 4096->128256 fp32 out", ms, 128256.0 * 4096 * 2);
        cudaFree(h.x); cudaFree(h.w); cudaFree(h.y);
    }
    /* attention */
    bench_prefill(32, 8, 128, 4096, it);
    if (!quick) bench_prefill(32, 8, 128, 16384, 5);
    bench_prefill(9, 3, 64, 8192, it);
    bench_repeat(32, 8, 128, 64, 8192, 2000, 2078, it);
    bench_repeat(32, 8, 128, 64, 32768, 2000, 2078, attn_only ? it : 5);
    bench_repeat(9, 3, 64, 64, 8192, 2000, 2078, it);
    if (attn_only) goto done;
    bench_decode(32, 8, 128, 32768, 0, it);
    bench_decode(32, 8, 128, 32768, 2048, it);
    bench_decode(32, 8, 128, 4096, 2048, it);
    bench_decode(9, 3, 64, 8192, 2048, it);
    bench_score(32, 8, 128, 64, 8192, 2000, 2000, 2030, it);
    bench_score(9, 3, 64, 64, 8192, 2000, 2000, 2030, it);
    /* eviction */
    {
        int64_t N = 32ll * 8 * 32768;
        topk_ctx t = {drand_f(N, 0.f, 1.f), N, (int64_t)llround(N * 0.3), dalloc(N), NULL, 0, 32 * 8, 32768};
        t.wsb = kvz_cuda_topk_ws_size(N); t.ws = dalloc(t.wsb);
        double ms = time_ms(run_topk, &t, it);
        report_bytes("topk global n=8.4M (32x8x32K), ~6 reads + mask", ms, N * 4.0 * 6 + N);
        t.K = (int64_t)llround(32768 * 0.3);
        ms = time_ms(run_topk_rows, &t, it);
        report_bytes("topk per-row 256 rows x 32K, ~5 reads + mask", ms, N * 4.0 * 5 + N);
        cudaFree(t.x); cudaFree(t.keep); cudaFree(t.ws);
        int nkv = 8, hd = 128, np = 64, nc = 32768;
        comp_ctx c;
        c.src = make_cache(nkv, np + nc, hd, np + nc);
        c.dst = make_cache(nkv, np + nc, hd, 0);
        uint8_t *kh = malloc((size_t)nkv * nc);
        long kept = 0;
        for (size_t i = 0; i < (size_t)nkv * nc; i++) { kh[i] = rng_uni() < 0.3; kept += kh[i]; }
        c.keep = dup_to_dev(kh, (size_t)nkv * nc);
        c.n_prefix = np; c.n_ctx = nc;
        ms = time_ms(run_compact, &c, it);
        report_bytes("kv_compact 8 heads x 32K, hd128, 30% kept", ms,
                     (double)(kept + nkv * np) * (hd * 2 * 2 * 2 + 8) + nkv * (double)nc);
        free(kh); cudaFree(c.keep); free_cache(&c.src); free_cache(&c.dst);
    }
    /* elementwise */
    {
        int T = 8192, d = 4096;
        norm_ctx nc = {T, d, drand_f((size_t)T * d, -1, 1), drand_bf((size_t)T * d, 1.f), dalloc((size_t)T * d * 2),
                       drand_f(d, 0.5f, 1.5f)};
        double ms = time_ms(run_norm, &nc, it);
        report_bytes("rmsnorm+residual T=8192 d=4096 (f32 rw, bf16)", ms, (double)T * d * (4 + 4 + 2 + 2));
        cudaFree(nc.x); cudaFree(nc.add); cudaFree(nc.out); cudaFree(nc.w);
        swi_ctx sc = {T, 14336, drand_bf((size_t)T * 2 * 14336, 2.f), dalloc((size_t)T * 14336 * 2)};
        ms = time_ms(run_swiglu, &sc, it);
        report_bytes("swiglu T=8192 ff=14336", ms, (double)T * 14336 * 6);
        cudaFree(sc.g); cudaFree(sc.o);
        rope_ctx rc = {T, 32, 8, 128, drand_bf((size_t)T * 48 * 128, 1.f), dev_iota(T, 0)};
        ms = time_ms(run_rope, &rc, it);
        report_bytes("rope q+k T=8192 32/8 hd128 (in place)", ms, (double)T * 40 * 128 * 2 * 2);
        cudaFree(rc.qkv); cudaFree(rc.pos);
        am_ctx ac = {drand_f(128256, -5, 5), 128256, dalloc(4)};
        ms = time_ms(run_argmax, &ac, it);
        report_bytes("argmax 1 x 128256", ms, 128256.0 * 4);
        cudaFree(ac.lg); cudaFree(ac.out);
    }
done:
    CU(cudaDeviceSynchronize());
    kvz_cuda_blas_destroy(bl);
    printf("bench done\n");
    return 0;
}
