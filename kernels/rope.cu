/* RoPE in place, one warp per (token, head) row. Optional qwen3 q/k RMSNorm first
 * (fp32). Angles in fp64 so long positions keep full precision. */
#include "rope.cuh"

#define ROPE_MAXP 4 /* pairs per lane: hd <= 256 */

__device__ void rope_row(bf16 *x, int hd, int p, double theta, int layout,
                         const float *nw, float eps, int lane)
{
    int np = hd / 2;
    float a[ROPE_MAXP], b[ROPE_MAXP];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < ROPE_MAXP; i++) {
        int j = lane + 32 * i;
        if (j < np) {
            int ia = layout == KVZ_ROPE_ADJACENT ? 2 * j : j;
            int ib = layout == KVZ_ROPE_ADJACENT ? 2 * j + 1 : j + np;
            a[i] = __bfloat162float(x[ia]);
            b[i] = __bfloat162float(x[ib]);
            ss += a[i] * a[i] + b[i] * b[i];
        }
    }
    float r = 1.f;
    if (nw) r = rsqrtf(kvz_warp_sum(ss) / (float)hd + eps);
#pragma unroll
    for (int i = 0; i < ROPE_MAXP; i++) {
        int j = lane + 32 * i;
        if (j < np) {
            int ia = layout == KVZ_ROPE_ADJACENT ? 2 * j : j;
            int ib = layout == KVZ_ROPE_ADJACENT ? 2 * j + 1 : j + np;
            float xa = a[i], xb = b[i];
            if (nw) { xa = xa * r * nw[ia]; xb = xb * r * nw[ib]; }
            double freq = pow(theta, -2.0 * j / (double)hd);
            double sn, cs;
            sincos((double)p * freq, &sn, &cs);
            float c = (float)cs, sv = (float)sn;
            x[ia] = __float2bfloat16_rn(xa * c - xb * sv);
            x[ib] = __float2bfloat16_rn(xa * sv + xb * c);
        }
    }
}

__global__ void rope_kernel(int T, int n_head, int n_kv, int hd, bf16 *q, int ldq, bf16 *k,
                            int ldk, const int32_t *__restrict__ pos, double theta, int layout,
                            const float *qw, const float *kw, float eps)
{
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int nh = (q ? n_head : 0) + (k ? n_kv : 0);
    if (row >= T * nh) return;
    int t = row / nh, h = row % nh;
    int p = pos[t];
    if (q && h < n_head) rope_row(q + (size_t)t * ldq + (size_t)h * hd, hd, p, theta, layout, qw, eps, lane);
    else {
        int hk = q ? h - n_head : h;
        rope_row(k + (size_t)t * ldk + (size_t)hk * hd, hd, p, theta, layout, kw, eps, lane);
    }
}

extern "C" int kvz_cuda_rope(cudaStream_t s, int T, int n_head, int n_kv, int hd, void *q, int ldq,
                             void *k, int ldk, const int32_t *pos, float theta,
                             kvz_cuda_rope_layout layout, const float *q_norm_w,
                             const float *k_norm_w, float eps)
{
    KVZ_ARG(pos && T >= 0 && hd > 0 && hd % 2 == 0 && hd <= 64 * ROPE_MAXP && theta > 0.f);
    KVZ_ARG(!q || (n_head > 0 && ldq >= n_head * hd));
    KVZ_ARG(!k || (n_kv > 0 && ldk >= n_kv * hd));
    KVZ_ARG(layout == KVZ_ROPE_ADJACENT || layout == KVZ_ROPE_HALF);
    int nh = (q ? n_head : 0) + (k ? n_kv : 0);
    if (T == 0 || nh == 0) return 0;
    long rows = (long)T * nh;
    int wpb = 8;
    rope_kernel<<<(unsigned)((rows + wpb - 1) / wpb), 32 * wpb, 0, s>>>(
        T, n_head, n_kv, hd, (bf16 *)q, ldq, (bf16 *)k, ldk, pos, (double)theta, (int)layout,
        q_norm_w, k_norm_w, eps);
    KVZ_LAUNCH_CHECK("rope");
    return 0;
}
