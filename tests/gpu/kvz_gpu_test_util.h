/* Host helpers shared by the GPU test and the GPU bench: bf16 rounding, random
 * numbers, device buffers, normalised error. Header-only, C11. */
#ifndef KVZ_GPU_TEST_UTIL_H
#define KVZ_GPU_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

static inline uint16_t h_f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float h_bf2f(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float h_round_bf(float f) { return h_bf2f(h_f2bf(f)); }

static uint64_t g_rng = 88172645463325252ull;
static inline void rng_seed(uint64_t s) { g_rng = s ? s : 1; }
static inline uint64_t rng_u64(void)
{
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return g_rng;
}
static inline double rng_uni(void) { return (double)(rng_u64() >> 11) * (1.0 / 9007199254740992.0); }
/* uniform in [-1, 1), never exactly zero */
static inline float rng_sym(void)
{
    float v = (float)(2.0 * rng_uni() - 1.0);
    return v == 0.f ? 0.5f : v;
}
static inline int rng_int(int n) { return (int)(rng_u64() % (uint64_t)n); }

/* fill host fp32 array with values rounded to bf16, and the bf16 copy */
static inline void fill_bf(float *f, uint16_t *b, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) {
        b[i] = h_f2bf(rng_sym() * scale);
        f[i] = h_bf2f(b[i]);
    }
}

static inline double rel_err_d(const float *out, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)out[i] - ref[i];
        if (!(out[i] == out[i])) return INFINITY;
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

#define CU(call)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,               \
                    cudaGetErrorString(e_));                                              \
            exit(2);                                                                      \
        }                                                                                 \
    } while (0)

static inline void *dalloc(size_t bytes)
{
    void *p = NULL;
    CU(cudaMalloc(&p, bytes ? bytes : 16));
    CU(cudaMemset(p, 0xff, bytes ? bytes : 16)); /* poison: NaN for bf16/fp32, -1 for ints */
    return p;
}
static inline void *dup_to_dev(const void *h, size_t bytes)
{
    void *p = dalloc(bytes);
    CU(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice));
    return p;
}
static inline void to_host(void *h, const void *d, size_t bytes)
{
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}
/* bf16 device buffer → host fp32 */
static inline float *bf_to_host(const void *d, size_t n)
{
    uint16_t *b = (uint16_t *)malloc(n * 2);
    float *f = (float *)malloc(n * 4);
    to_host(b, d, n * 2);
    for (size_t i = 0; i < n; i++) f[i] = h_bf2f(b[i]);
    free(b);
    return f;
}

#endif
