/* Prefill A/B of the batched-pass routes in one process: the int8 GEMM (default)
 * and the dequantize + SGEMM route (KVZ_QGEMM=0), alternating, ROUNDS times, on
 * the same model and token counts as kvz_bench_cpu's prefill rows (KV cache of T
 * rows, no logits). Prints per run tok/s of wall time and of process CPU time
 * (clock(): on a machine shared with other work, CPU time is stretched less by
 * preemption than wall time), and per route the best wall figure.
 *
 *   build/bin/qdot_bench_prefill MODEL.gguf [T=512] [ROUNDS=3] [ROUTES=2]
 *
 * ROUTES=1 runs the default (int8 GEMM) route only (for profiling).
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvz_error.h"
#include "kvz_model.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: qdot_bench_prefill MODEL.gguf [T=512] [ROUNDS=3] [ROUTES=2]\n");
        return 2;
    }
    const int32_t T = argc > 2 ? atoi(argv[2]) : 512;
    const int rounds = argc > 3 ? atoi(argv[3]) : 3;
    const int routes = argc > 4 ? atoi(argv[4]) : 2;
    if (T < 1 || rounds < 1 || routes < 1 || routes > 2) {
        fprintf(stderr, "qdot_bench_prefill: T and ROUNDS must be positive, ROUTES 1 or 2\n");
        return 2;
    }
    kvz_model *m;
    kvz_model_opts o = {.device = KVZ_DEVICE_CPU};
    if (kvz_model_load(argv[1], &o, &m) != 0) {
        fprintf(stderr, "qdot_bench_prefill: cannot load %s\n", argv[1]);
        return 1;
    }
    const kvz_config *c = kvz_model_config(m);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
    for (int32_t i = 0; i < T; i++) ids[i] = (int32_t)((i * 7919u + 13) % (uint32_t)c->n_vocab);
    double best[2] = {0, 0};
    int rc = 0;
    for (int r = 0; r < rounds && !rc; r++)
        for (int route = 0; route < routes && !rc; route++) {
            if (route) setenv("KVZ_QGEMM", "0", 1);
            else unsetenv("KVZ_QGEMM");
            kvz_kv *kv;
            if (kvz_kv_create(m, T, 0, &kv)) { rc = 1; break; }
            const double t0 = now();
            const clock_t c0 = clock();
            rc = kvz_forward(m, kv, ids, T, 0, NULL, KVZ_FWD_NO_LOGITS, NULL);
            const double wall = now() - t0, cpu = (double)(clock() - c0) / CLOCKS_PER_SEC;
            kvz_kv_free(kv);
            printf("round %d %-11s T=%d: %6.1f tok/s wall, %6.1f tok/s of process CPU time (%.2f s wall, %.2f s CPU)\n",
                   r + 1, route ? "SGEMM" : "int8-GEMM", T, T / wall, T / cpu, wall, cpu);
            fflush(stdout);
            if (T / wall > best[route]) best[route] = T / wall;
        }
    if (rc) fprintf(stderr, "qdot_bench_prefill: forward failed: %s\n", kvz_error_detail());
    else if (routes == 2) printf("best wall: int8 GEMM %.1f tok/s, SGEMM %.1f tok/s, ratio %.2fx\n", best[0], best[1], best[0] / best[1]);
    free(ids);
    kvz_model_free(m);
    return rc ? 1 : 0;
}
