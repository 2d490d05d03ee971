/* RoPE in place, one warp per (token, head) row. Optional qwen3 q/k RMSNorm first
 * (fp32). Angles in fp64 so long positions keep full precision. */
#include "kvz_cuda_common.cuh"

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

/* ---------------------------------------------------------------- RoPE fused with the KV write */
/* One token (decode): warp h < n_head rotates q head h in place; warp n_head + j rotates
 * k head j in place (rope_row, as rope_kernel), then, after __syncwarp makes the
 * rotated row visible to the whole warp, copies k and v head j to its destination —
 * the cache row len[j] (then pos and len[j] += 1, as kv_append_kernel + kv_bump_kernel)
 * or the output-buffer slot (as outbuf_write / outbuf_write_dev). One launch instead of
 * two or three; launched with PDL on sm_90 (griddepcontrol.wait before any load). */
__global__ void rope_kv_kernel(int n_head, int n_kv, int hd, bf16 *q, bf16 *k, const bf16 *__restrict__ v,
                               const int32_t *__restrict__ pos, double theta, int layout,
                               const float *qw, const float *kw, float eps, kvz_cuda_kv kv,
                               kvz_cuda_outbuf ob, int slot, const int32_t *d_fill, const int32_t *d_evict)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory"); /* no-op without a PDL launch */
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    const int lane = threadIdx.x & 31;
    const int h = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (h >= n_head + n_kv) return;
    const int p = pos[0];
    if (h < n_head) {
        rope_row(q + (size_t)h * hd, hd, p, theta, layout, qw, eps, lane);
        return;
    }
    const int j = h - n_head;
    bf16 *kr = k + (size_t)j * hd;
    const bf16 *vr = v + (size_t)j * hd;
    rope_row(kr, hd, p, theta, layout, kw, eps, lane);
    __syncwarp();
    bf16 *kd, *vd;
    if (kv.k) {
        const int row = kv.len[j];
        __syncwarp(); /* every lane has read len[j] before lane 0 bumps it */
        if (row >= kv.cap) return;
        const size_t dst = ((size_t)j * kv.cap + row) * hd;
        kd = (bf16 *)kv.k + dst;
        vd = (bf16 *)kv.v + dst;
        if (lane == 0) {
            kv.pos[(size_t)j * kv.cap + row] = p;
            kv.len[j] = row + 1;
        }
    } else {
        int sl = slot;
        if (sl < 0) sl = d_fill && *d_fill >= 0 ? *d_fill : (d_evict ? *d_evict : -1);
        if (sl < 0 || sl >= ob.n_slot) return;
        const size_t dst = ((size_t)j * ob.n_slot + sl) * hd;
        kd = (bf16 *)ob.k + dst;
        vd = (bf16 *)ob.v + dst;
        if (lane == 0 && j == 0) ob.slot_pos[sl] = p;
    }
    for (int i = lane; i < hd; i += 32) { kd[i] = kr[i]; vd[i] = vr[i]; }
}

/* PDL on sm_90+ (compute capability of the device current at the first call). */
static int rope_pdl(void)
{
    static int on = -1;
    if (on < 0) on = kvz_cuda_pdl_allowed(NULL);
    return on;
}

static int rope_kv_launch(cudaStream_t s, int n_head, int n_kv, int hd, void *qkv, const int32_t *pos,
                          float theta, kvz_cuda_rope_layout layout, const float *qw, const float *kw,
                          float eps, const kvz_cuda_kv *kv, const kvz_cuda_outbuf *ob, int slot,
                          const int32_t *d_fill, const int32_t *d_evict)
{
    bf16 *q = (bf16 *)qkv, *k = q + (size_t)n_head * hd;
    const bf16 *v = k + (size_t)n_kv * hd;
    const int wpb = 8, rows = n_head + n_kv;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)((rows + wpb - 1) / wpb));
    cfg.blockDim = dim3(32 * wpb);
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = rope_pdl();
    kvz_cuda_kv kz = {};
    kvz_cuda_outbuf oz = {};
    cudaError_t e = cudaLaunchKernelEx(&cfg, rope_kv_kernel, n_head, n_kv, hd, q, k, v, pos, (double)theta,
                                       (int)layout, qw, kw, eps, kv ? *kv : kz, ob ? *ob : oz, slot, d_fill,
                                       d_evict);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kvz_error_set(KVZ_ERR_CUDA, "launch rope_kv: %s", cudaGetErrorString(e));
    }
    KVZ_LAUNCH_CHECK("rope_kv");
    return 0;
}

extern "C" int kvz_cuda_rope_kv_append(cudaStream_t s, int n_head, int n_kv, int hd, void *qkv,
                                       const int32_t *pos, float theta, kvz_cuda_rope_layout layout,
                                       const float *q_norm_w, const float *k_norm_w, float eps,
                                       const kvz_cuda_kv *kv)
{
    KVZ_ARG(qkv && pos && n_head > 0 && n_kv > 0 && hd > 0 && hd % 2 == 0 && hd <= 64 * ROPE_MAXP && theta > 0.f);
    KVZ_ARG(layout == KVZ_ROPE_ADJACENT || layout == KVZ_ROPE_HALF);
    KVZ_ARG(kv && kv->k && kv->v && kv->pos && kv->len && kv->n_kv == n_kv && kv->hd == hd && kv->cap > 0);
    return rope_kv_launch(s, n_head, n_kv, hd, qkv, pos, theta, layout, q_norm_w, k_norm_w, eps, kv, NULL,
                          -1, NULL, NULL);
}

extern "C" int kvz_cuda_rope_outbuf_write(cudaStream_t s, int n_head, int n_kv, int hd, void *qkv,
                                          const int32_t *pos, float theta, kvz_cuda_rope_layout layout,
                                          const float *q_norm_w, const float *k_norm_w, float eps,
                                          const kvz_cuda_outbuf *ob, int slot, const int32_t *d_fill,
                                          const int32_t *d_evict)
{
    KVZ_ARG(qkv && pos && n_head > 0 && n_kv > 0 && hd > 0 && hd % 2 == 0 && hd <= 64 * ROPE_MAXP && theta > 0.f);
    KVZ_ARG(layout == KVZ_ROPE_ADJACENT || layout == KVZ_ROPE_HALF);
    KVZ_ARG(ob && ob->k && ob->v && ob->slot_pos && ob->n_slot > 0);
    KVZ_ARG(slot < ob->n_slot && (slot >= 0 || d_fill || d_evict));
    return rope_kv_launch(s, n_head, n_kv, hd, qkv, pos, theta, layout, q_norm_w, k_norm_w, eps, NULL, ob,
                          slot, d_fill, d_evict);
}
