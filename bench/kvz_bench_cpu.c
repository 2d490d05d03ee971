/* CPU benchmark (the no-GPU default and CI's machine): prefill and decode
 * tokens/s of the real model beside their bounds measured in the same run
 * (OpenBLAS sgemm rate; memory copy bandwidth), a 1-thread baseline, and the
 * KVzip ingest cost as a multiple of a plain prefill of the same document.
 *
 * Weights: by default the CPU backend computes on the GGUF's quantized blocks
 * (kvz_qdot for decode, chunk dequantization + SGEMM for prefill); --f32 loads
 * them as fp32 instead (the previous default). The decode bound is the measured
 * copy bandwidth over the bytes a token must read: the weights as held in memory
 * (quantized: the file's matrix bytes, kvz_model_weight_bytes, less an untied token
 * embedding of which a token reads one row) plus the KV cache.
 *
 *   build/bin/kvz_bench_cpu [--model PATH] [--doc FILE] [--quick] [--f32]
 *                           [--no-baseline] [--no-ingest] [--no-prefill] [--steps N] [--ctx N]
 *
 * --no-prefill skips the prefill rows, --steps sets the decode steps timed at each
 * depth (default 32; more for a steadier figure or a profile of decode alone),
 * --ctx N decodes at depth N only (instead of 512 and 2048).
 */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_ingest.h"
#include "kvz_kvdtype.h"
#include "kvz_load.h"
#include "kvz_store.h"
#include "kvz_kvzip.h"
#include "kvz_model.h"
#include "kvz_qdot.h"

static double sgemm_gflops(int M, int N, int K, int reps)
{
    float *a = malloc(sizeof(float) * (size_t)M * K), *b = malloc(sizeof(float) * (size_t)N * K),
          *c = malloc(sizeof(float) * (size_t)M * N);
    for (size_t i = 0; i < (size_t)M * K; i++) a[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    for (size_t i = 0; i < (size_t)N * K; i++) b[i] = (float)((i * 40503u) % 1000) / 1000.0f - 0.5f;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1, a, K, b, K, 0, c, N);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = kvz_now();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1, a, K, b, K, 0, c, N);
        double t = kvz_now() - t0;
        best = t < best ? t : best;
    }
    free(a); free(b); free(c);
    return 2.0 * M * N * K / best / 1e9;
}

static double copy_gbs(size_t bytes, int reps)
{
    char *a = malloc(bytes), *b = malloc(bytes);
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = kvz_now();
        memcpy(b, a, bytes);
        double t = kvz_now() - t0;
        best = t < best ? t : best;
    }
    volatile char sink = b[bytes / 2];
    (void)sink;
    free(a); free(b);
    return 2.0 * bytes / best / 1e9; /* read + write */
}

/* linear-layer FLOPs per token (2 * weights touched), excluding the LM head */
static double linear_params(const kvz_config *c)
{
    const double d = c->n_embd, qd = (double)c->n_head * c->head_dim, kvd = (double)c->n_kv_head * c->head_dim;
    return c->n_layer * (d * (qd + 2 * kvd) + qd * d + 3.0 * d * c->n_ff);
}

static double prefill_tps(kvz_model *m, int32_t T, double *secs)
{
    const kvz_config *c = kvz_model_config(m);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
    for (int32_t i = 0; i < T; i++) ids[i] = (int32_t)((i * 7919u + 13) % (uint32_t)c->n_vocab);
    kvz_kv *kv;
    kvz_kv_create(m, T, 0, &kv);
    double t0 = kvz_now();
    int rc = kvz_forward(m, kv, ids, T, 0, NULL, KVZ_FWD_NO_LOGITS, NULL);
    double t = kvz_now() - t0;
    kvz_kv_free(kv);
    free(ids);
    if (secs) *secs = t;
    return rc ? -1 : T / t;
}

static double decode_tps(kvz_model *m, int32_t ctx, int32_t steps)
{
    const kvz_config *c = kvz_model_config(m);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)ctx);
    for (int32_t i = 0; i < ctx; i++) ids[i] = (int32_t)((i * 7919u + 13) % (uint32_t)c->n_vocab);
    kvz_kv *kv;
    kvz_kv_create(m, ctx + steps, 0, &kv);
    kvz_forward(m, kv, ids, ctx, 0, NULL, KVZ_FWD_NO_LOGITS, NULL);
    float *logits = malloc(sizeof(float) * (size_t)c->n_vocab);
    int32_t tok = ids[ctx - 1];
    double t0 = kvz_now();
    const clock_t c0 = clock();
    fprintf(stderr, "decode at depth %d starts (%.1f s of process CPU time so far)\n", ctx,
            (double)c0 / CLOCKS_PER_SEC);
    for (int32_t s = 0; s < steps; s++) {
        kvz_forward(m, kv, &tok, 1, ctx + s, logits, KVZ_FWD_LOGITS_LAST, NULL);
        tok = (tok + 1) % c->n_vocab;
    }
    double t = kvz_now() - t0;
    /* CPU time per token: on a shared machine less disturbed by the load than tok/s
     * (idle OpenMP threads sleep under OMP_WAIT_POLICY=passive) */
    fprintf(stderr, "decode at depth %d: %.1f ms of process CPU time per token, %.1f ms wall\n", ctx,
            1e3 * (double)(clock() - c0) / CLOCKS_PER_SEC / steps, 1e3 * t / steps);
    kvz_kv_free(kv);
    free(logits);
    free(ids);
    return steps / t;
}

int main(int argc, char **argv)
{
    const char *model = "models/SmolLM2-135M-Instruct.Q4_1.gguf", *docp = "samples/aquila_aq300_manual.md";
    int quick = 0, f32 = 0, baseline = 1, ingest = 1, prefill = 1, steps = 32, only_ctx = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(argv[i], "--doc") && i + 1 < argc) docp = argv[++i];
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--f32")) f32 = 1;
        else if (!strcmp(argv[i], "--no-baseline")) baseline = 0;
        else if (!strcmp(argv[i], "--no-ingest")) ingest = 0;
        else if (!strcmp(argv[i], "--no-prefill")) prefill = 0;
        else if (!strcmp(argv[i], "--ctx") && i + 1 < argc && atoi(argv[i + 1]) > 0) only_ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc && atoi(argv[i + 1]) > 0) steps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: kvz_bench_cpu [--model PATH] [--doc FILE] [--quick] [--f32] "
                            "[--no-baseline] [--no-ingest] [--no-prefill] [--steps N] [--ctx N]\n");
            return 2;
        }
    }
    const int nthr = omp_get_max_threads();
    printf("# kvzip CPU bench: %d threads, %s weights, qdot ISA %s (CPU has %s)\n\n", nthr,
           f32 ? "fp32" : "quantized", kvz_isa_name(kvz_qdot_active_isa()), kvz_isa_name(kvz_qdot_cpu_isa()));
    /* bounds, measured now */
    const double peak = sgemm_gflops(1024, 1536, 576, 5), peak_big = sgemm_gflops(2048, 2048, 2048, 3);
    const double bw = copy_gbs((size_t)512 << 20, 5);
    printf("bounds: sgemm %.1f GFLOP/s (1024x1536x576, model-shaped), %.1f GFLOP/s (2048^3); "
           "memcpy %.1f GB/s (read+write)\n\n", peak, peak_big, bw);

    kvz_model *m, *m1; /* all threads; the 1-thread baseline (the runtime sets the
                        * OpenMP thread count from the model on every forward) */
    kvz_model_opts o = {.device = KVZ_DEVICE_CPU, .f32_weights = f32},
                   o1 = {.device = KVZ_DEVICE_CPU, .n_threads = 1, .f32_weights = f32};
    m1 = NULL;
    if (kvz_model_load(model, &o, &m) || (baseline && kvz_model_load(model, &o1, &m1))) {
        fprintf(stderr, "cannot load %s\n", model);
        return 1;
    }
    const kvz_config *c = kvz_model_config(m);
    const double P = linear_params(c);
    /* weights read per token: every matrix once (tied embeddings: the output matrix) */
    const double bytes_mem = (double)kvz_model_weight_bytes(m);
    /* a decoded token reads one row of an untied token embedding, not the matrix */
    const double tok_embd = (double)kvz_model_tok_embd_bytes(m); /* 0 when tied */
    const double bytes_w = bytes_mem - (tok_embd - tok_embd / c->n_vocab);
    printf("model %s: %s, weights in memory %.1f MB, read per decoded token %.1f MB\n\n", model, c->name,
           bytes_mem / 1e6, bytes_w / 1e6);

    printf("| what | tokens | tok/s | GFLOP/s | bound | %% of bound | 1-thread baseline tok/s |\n");
    printf("|---|---|---|---|---|---|---|\n");
    const int32_t lens[] = {512, 2048};
    for (int li = 0; li < (!prefill ? 0 : quick ? 1 : 2); li++) {
        const int32_t T = lens[li];
        double secs;
        double base = m1 ? prefill_tps(m1, T, NULL) : NAN;
        double tps = prefill_tps(m, T, &secs);
        const double flops = 2.0 * P * T + 2.0 * 2.0 * (double)T * T / 2.0 * c->head_dim * c->n_head * c->n_layer;
        printf("| prefill | %d | %.0f | %.1f | %.1f GFLOP/s | %.0f%% | %.0f |\n", T, tps, flops / secs / 1e9,
               peak, 100.0 * flops / secs / 1e9 / peak, base);
    }
    for (int li = 0; li < (quick ? 1 : 2); li++) {
        const int32_t ctx = only_ctx ? only_ctx : lens[li];
        if (only_ctx && li) break;
        double base = m1 ? decode_tps(m1, ctx, 16) : NAN;
        double tps = decode_tps(m, ctx, steps);
        const double bytes = bytes_w + 4.0 * 2 * (double)ctx * c->n_layer * c->n_kv_head * c->head_dim;
        const double bound = bw * 1e9 / bytes;
        printf("| decode (ctx) | %d | %.1f | - | %.1f tok/s (%.0f MB/token / %.1f GB/s) | %.0f%% | %.1f |\n",
               ctx, tps, bound, bytes / 1e6, bw, 100.0 * tps / bound, base);
    }

    if (!ingest) {
        kvz_model_free(m);
        kvz_model_free(m1);
        return 0;
    }
    /* ingest vs plain prefill on a real document */
    FILE *f = fopen(docp, "rb");
    if (!f) { fprintf(stderr, "cannot open %s\n", docp); return 1; }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    if (fread(text, 1, (size_t)n, f) != (size_t)n) return 1;
    fclose(f);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    kvz_tokens pre = {0}, ctx = {0};
    kvz_chat_prefix(tok, &pre);
    kvz_tokenizer_encode(tok, text, (size_t)n, 0, &ctx);
    int32_t nctx = (int32_t)ctx.n;
    if (quick && nctx > 2000) nctx = 2000;
    kvz_kvzip_params kp;
    kvz_kvzip_defaults(&kp);
    const int32_t n_all = (int32_t)pre.n + nctx;
    int32_t *all = malloc(sizeof(int32_t) * (size_t)n_all);
    memcpy(all, pre.ids, sizeof(int32_t) * pre.n);
    memcpy(all + pre.n, ctx.ids, sizeof(int32_t) * (size_t)nctx);
    kvz_kv *kv;
    kvz_kv_create(m, kvz_kvzip_cache_rows(m, (int32_t)pre.n, nctx, &kp), 0, &kv);
    double t0 = kvz_now();
    kvz_forward(m, kv, all, n_all, 0, NULL, KVZ_FWD_NO_LOGITS, NULL);
    const double t_prefill = kvz_now() - t0;
    kvz_kv_clear(kv);
    float *scores = malloc(sizeof(float) * (size_t)c->n_layer * c->n_kv_head * nctx);
    uint8_t *keep = malloc((size_t)c->n_layer * c->n_kv_head * nctx);
    t0 = kvz_now();
    kvz_kvzip_score(m, kv, pre.ids, (int32_t)pre.n, ctx.ids, nctx, &kp, scores, NULL, NULL);
    kvz_kvzip_select(scores, c->n_layer, c->n_kv_head, nctx, 0.3f, KVZ_EVICT_GLOBAL, keep, NULL);
    const double t_ingest = kvz_now() - t0;
    /* FLOP ratio: prefill + repeat passes (linear layers + attention over the whole
     * context and the repeat tokens). Scoring adds no QK product on the CPU: it
     * reuses the repeat pass's softmax (kvz_kv_probe). */
    double f_pre = 2.0 * P * n_all + 2.0 * (double)n_all * n_all * c->head_dim * c->n_head * c->n_layer;
    double f_rep = 0;
    for (int32_t s = 0; s < nctx; s += kp.chunk) {
        double r = (nctx - s < kp.chunk ? nctx - s : kp.chunk) + 30;
        f_rep += 2.0 * P * r + 4.0 * r * (n_all + r / 2) * c->head_dim * c->n_head * c->n_layer;
    }
    printf("\n| document | tokens | plain prefill s | KVzip ingest s (prefill+score+select) | ingest / prefill | FLOP ratio |\n");
    printf("|---|---|---|---|---|---|\n");
    printf("| %s | %d | %.2f | %.2f | %.2fx | %.2fx |\n", docp, n_all, t_prefill, t_ingest,
           t_ingest / t_prefill, (f_pre + f_rep) / f_pre);
    kvz_kv_free(kv);

    /* store round trip on the CPU: the document ingested into a real store, then loaded
     * by the one-thread loader (kvz_doc_load) and the pipelined one (kvz_load_doc), best of 3 */
    {
        char dir[] = "/tmp/kvz-bench-cpu-XXXXXX";
        uint8_t fp[16];
        kvz_model_fingerprint(m, fp);
        kvz_store *st = NULL;
        kvz_ingest_opts io;
        kvz_ingest_defaults(&io);
        kvz_ingest_result res;
        double tl[3] = {1e30, 1e30, 1e30}; /* old loader, pipelined, pipelined through the map (the route before) */
        const kvz_load_opts map_route = {.map_only = 1};
        kvz_doc_meta dm;
        if (mkdtemp(dir) && !kvz_store_open(dir, KVZ_STORE_CREATE, 0, fp, &st) &&
            !kvz_ingest_doc(m, st, "doc", NULL, ctx.ids, nctx, &io, &res)) {
            for (int rep = 0; rep < 3; rep++)
                for (int w = 0; w < 3; w++) {
                    kvz_kv *lk = NULL;
                    t0 = kvz_now();
                    int rc = w ? kvz_load_doc(m, st, "doc", 0, 1024, w == 2 ? &map_route : NULL, &lk, &dm)
                               : kvz_doc_load(m, st, "doc", 0, 1024, &lk, &dm);
                    const double t = kvz_now() - t0;
                    if (!rc && t < tl[w]) tl[w] = t;
                    kvz_kv_free(lk);
                }
            printf("\n| store round trip (CPU), %d tokens, %s (ingest default) | stored MB | old load s (1 thread) | pipelined load s (%d threads) | pipelined through the map s (the route before) |\n|---|---|---|---|---|\n",
                   nctx, kvz_kv_dtype_name(io.dtype), kvz_load_threads(NULL));
            printf("| %s | %.1f | %.4f | %.4f | %.4f |\n", docp, res.bytes_stored / 1e6, tl[0], tl[1], tl[2]);
        } else {
            printf("\n(store round trip skipped: %s)\n", kvz_error_detail());
        }
        kvz_store_close(st);
        char cmd[96];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
    }
    free(scores); free(keep); free(all); free(text);
    kvz_tokens_free(&pre); kvz_tokens_free(&ctx);
    kvz_model_free(m);
    kvz_model_free(m1);
    return 0;
}
