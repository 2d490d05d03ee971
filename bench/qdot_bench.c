/* Single-thread speed of the decode dot products (kvz_qdot) per weight type, on
 * rows that stay in cache (200 rows) and on rows streamed from memory (100,000
 * rows, 60-490 MB): ns per weight element and GB/s of weight bytes. The shapes
 * are Qwen2.5-0.5B's (896-wide Q5_0 / Q8_0 rows, 4864-wide Q4_K / Q6_K rows).
 * Scales are valid small fp16 values (random bytes can make NaN or subnormal
 * scales, which would time something else).
 *
 *   build/bin/qdot_bench [ROWS...]     (default: 200 100000)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvz_qdot.h"
#include "kvz_quant.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void put_scale(uint8_t *p) { const uint16_t h = kvz_fp32_to_fp16(0.01f); memcpy(p, &h, 2); }

int main(int argc, char **argv)
{
    static const uint32_t T[] = {KVZ_TYPE_Q5_0, KVZ_TYPE_Q8_0, KVZ_TYPE_Q4_K, KVZ_TYPE_Q6_K};
    static const int64_t N[] = {896, 896, 4864, 4864};
    long rows_list[8] = {200, 100000};
    int nr = 2;
    if (argc > 1) {
        nr = 0;
        for (int i = 1; i < argc && nr < 8; i++) {
            char *end;
            const long v = strtol(argv[i], &end, 10);
            if (*end || v < 1 || v > 10000000) {
                fprintf(stderr, "qdot_bench: rows must be an integer in 1..10000000 (got '%s')\n", argv[i]);
                return 2;
            }
            rows_list[nr++] = v;
        }
    }
    printf("qdot ISA %s, 1 thread\n", kvz_isa_name(kvz_qdot_active_isa()));
    uint32_t seed = 12345;
    for (int ri = 0; ri < nr; ri++)
        for (size_t ti = 0; ti < sizeof T / sizeof T[0]; ti++) {
            const int64_t n = N[ti], rows = rows_list[ri];
            const size_t rb = (size_t)kvz_type_nbytes(T[ti], n), bb = (size_t)kvz_type_block_bytes(T[ti]);
            uint8_t *w = malloc(rb * (size_t)rows);
            float *x = malloc(sizeof(float) * (size_t)n);
            void *q = malloc(kvz_q8_row_bytes(n));
            if (!w || !x || !q) {
                fprintf(stderr, "qdot_bench: out of memory for %ld rows\n", (long)rows);
                return 1;
            }
            for (size_t i = 0; i < rb * (size_t)rows; i++) w[i] = (uint8_t)((seed = seed * 1103515245u + 12345u) >> 16);
            for (uint8_t *b = w; b < w + rb * (size_t)rows; b += bb) {
                if (T[ti] == KVZ_TYPE_Q6_K) put_scale(b + 208);
                else put_scale(b);
                if (T[ti] == KVZ_TYPE_Q4_K) put_scale(b + 2);
            }
            for (int64_t i = 0; i < n; i++) x[i] = (float)((seed = seed * 1103515245u + 12345u) >> 16) / 65536.0f - 0.5f;
            kvz_q8_quantize(x, n, q);
            const long reps = (long)(4e8 / ((double)n * (double)rows)) + 1;
            float s = 0.0f;
            const double t0 = now();
            for (long k = 0; k < reps; k++)
                for (int64_t r = 0; r < rows; r++) s += kvz_qdot(T[ti], w + (size_t)r * rb, q, n);
            const double t = now() - t0, el = (double)reps * (double)rows * (double)n;
            printf("%-5s %7ld rows x %4lld: %.3f ns/element, %5.2f GB/s of weights (checksum %.3g)\n",
                   kvz_type_name(T[ti]), (long)rows, (long long)n, 1e9 * t / el,
                   (double)reps * (double)rows * (double)rb / t / 1e9, s);
            free(w); free(x); free(q);
        }
    return 0;
}
