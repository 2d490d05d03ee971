/* One-thread speed of the batched products on quantized weights: the int8 GEMM
 * (kvz_qgemm: activation quantization + panel unpacking + microkernel) against the
 * dequantize + OpenBLAS SGEMM route (kvz_dequantize of the rows, cblas_sgemm) and,
 * for N <= 64, the per-row int8 dot products of decode (kvz_qdot per row and token),
 * on Qwen2.5-0.5B's and SmolLM2's shapes, n tokens (default 512). Timed in thread
 * CPU time (CLOCK_THREAD_CPUTIME_ID), so that a loaded machine stretches the wall
 * clock but not the figures; best of 5. Run with OMP_NUM_THREADS=1 (OpenBLAS
 * single-threaded).
 *
 *   build/bin/qdot_bench_gemm [N]
 */
#include <cblas.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvz_qdot.h"
#include "kvz_qgemm.h"
#include "kvz_quant.h"

static double cpu_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void fill(uint32_t t, uint8_t *w, int64_t nbytes)
{
    uint64_t s = 88172645463325252ULL;
    for (int64_t i = 0; i < nbytes; i++) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; w[i] = (uint8_t)s; }
    const int64_t bb = kvz_type_block_bytes(t);
    const uint16_t h = kvz_fp32_to_fp16(0.01f);
    for (uint8_t *x = w; x < w + nbytes; x += bb) {
        if (t == KVZ_TYPE_Q6_K) memcpy(x + 208, &h, 2);
        else { memcpy(x, &h, 2); if (t == KVZ_TYPE_Q4_1 || t == KVZ_TYPE_Q4_K || t == KVZ_TYPE_Q5_1 || t == KVZ_TYPE_Q5_K) memcpy(x + 2, &h, 2); }
    }
}

int main(int argc, char **argv)
{
    const int n = argc > 1 ? atoi(argv[1]) : 512;
    static const struct { uint32_t t; int rows, k; const char *what; } S[] = {
        {KVZ_TYPE_Q5_0, 896, 896, "Qwen q/o"},      {KVZ_TYPE_Q5_0, 4864, 896, "Qwen gate/up"},
        {KVZ_TYPE_Q8_0, 128, 896, "Qwen v (half)"}, {KVZ_TYPE_Q4_K, 896, 4864, "Qwen down"},
        {KVZ_TYPE_Q6_K, 896, 4864, "Qwen down"},    {KVZ_TYPE_Q4_1, 1536, 576, "SmolLM2 gate/up"},
        {KVZ_TYPE_Q4_1, 576, 1536, "SmolLM2 down"}, {KVZ_TYPE_Q4_1, 4864, 896, "(Qwen gate/up shape)"}, {KVZ_TYPE_Q5_0, 576, 1536, "(SmolLM2 down shape)"}, {KVZ_TYPE_Q4_1, 576, 576, "SmolLM2 q/o"},
    };
    if (n < 1) { fprintf(stderr, "usage: qdot_bench_gemm [N >= 1]\n"); return 2; }
    printf("n = %d tokens, one thread, GFLOP/s of thread CPU time (best of 5)\n", n);
    printf("| type | rows x k | shape | int8 GEMM | dequant+SGEMM | GEMM / SGEMM | per-row qdot |\n"
           "|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < sizeof S / sizeof S[0]; i++) {
        const int64_t k = S[i].k, rows = S[i].rows;
        const size_t rb = (size_t)kvz_type_nbytes(S[i].t, k);
        uint8_t *w = malloc(rb * (size_t)rows), *act = malloc(kvz_qgemm_act_bytes(n, k)),
                *panel = malloc(kvz_qgemm_panel_bytes(k));
        float *x = malloc(sizeof(float) * (size_t)n * (size_t)k), *y = malloc(sizeof(float) * (size_t)n * (size_t)rows),
              *wf = malloc(sizeof(float) * (size_t)rows * (size_t)k);
        fill(S[i].t, w, (int64_t)rb * rows);
        for (int64_t j = 0; j < (int64_t)n * k; j++) x[j] = (float)((j * 7919) % 2001 - 1000) / 1000.0f;
        const int64_t P = kvz_qgemm_panel_rows(k);
        double best_q = 1e30, best_s = 1e30, best_d = 1e30;
        for (int rep = 0; rep < 5; rep++) {
            double t0 = cpu_now();
            kvz_qgemm_quantize(x, n, k, 0, n, act);
            for (int64_t r0 = 0; r0 < rows; r0 += P)
                kvz_qgemm_rows(S[i].t, w + (size_t)r0 * rb, rb, rows - r0 < P ? rows - r0 : P, k, act, n, y + r0, rows,
                               0, panel);
            double t1 = cpu_now();
            best_q = t1 - t0 < best_q ? t1 - t0 : best_q;
            t0 = cpu_now();
            for (int64_t r = 0; r < rows; r++) kvz_dequantize(S[i].t, w + (size_t)r * rb, wf + (size_t)r * k, k);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, (int)rows, (int)k, 1.0f, x, (int)k, wf, (int)k,
                        0.0f, y, (int)rows);
            t1 = cpu_now();
            best_s = t1 - t0 < best_s ? t1 - t0 : best_s;
            if (n <= 64) { /* decode's route: quantize each token, one dot per row and token */
                const size_t qb = kvz_q8_row_bytes(k);
                t0 = cpu_now();
                for (int t = 0; t < n; t++) kvz_q8_quantize(x + (size_t)t * k, k, act + (size_t)t * qb);
                for (int64_t r = 0; r < rows; r++)
                    for (int t = 0; t < n; t++)
                        y[(size_t)t * rows + r] = kvz_qdot(S[i].t, w + (size_t)r * rb, act + (size_t)t * qb, k);
                t1 = cpu_now();
                best_d = t1 - t0 < best_d ? t1 - t0 : best_d;
            }
        }
        const double fl = 2.0 * n * (double)rows * (double)k;
        printf("| %s | %lld x %lld | %s | %.1f | %.1f | %.2fx | %.1f |\n", kvz_type_name(S[i].t), (long long)rows,
               (long long)k, S[i].what, fl / best_q / 1e9, fl / best_s / 1e9, best_s / best_q,
               n <= 64 ? fl / best_d / 1e9 : 0.0);
        free(w); free(act); free(panel); free(x); free(y); free(wf);
    }
    return 0;
}
