/* Elementwise / row kernels: embedding, RMSNorm (+residual), SwiGLU, conversions,
 * argmax. All memory-bound; one block per row where a row reduction is needed. */
#include "kvz_cuda_common.cuh"

extern "C" int kvz_cuda_device_count(int *n)
{
    int c = 0;
    cudaError_t e = cudaGetDeviceCount(&c);
    if (n) *n = (e == cudaSuccess) ? c : 0;
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kvz_error_set(KVZ_ERR_NODEV, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
    }
    if (c == 0) return kvz_error_set(KVZ_ERR_NODEV, "no CUDA device");
    return 0;
}

/* ---------------------------------------------------------------- embedding */
template <typename T>
__global__ void embed_kernel(const bf16 *__restrict__ table, int n_vocab, int d,
                             const int32_t *__restrict__ ids, T *__restrict__ x)
{
    int t = blockIdx.x;
    int id = ids[t];
    bool ok = id >= 0 && id < n_vocab;
    const bf16 *row = table + (size_t)(ok ? id : 0) * d;
    T *out = x + (size_t)t * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        out[i] = kvz_from_f<T>(ok ? __bfloat162float(row[i]) : 0.f);
}

extern "C" int kvz_cuda_embed(cudaStream_t s, const void *table, int n_vocab, int d,
                              const int32_t *ids, int T, void *x, kvz_cuda_dtype x_type)
{
    KVZ_ARG(table && ids && x && n_vocab > 0 && d > 0 && T >= 0);
    if (T == 0) return 0;
    if (x_type == KVZ_CUDA_F32)
        embed_kernel<float><<<T, 256, 0, s>>>((const bf16 *)table, n_vocab, d, ids, (float *)x);
    else
        embed_kernel<bf16><<<T, 256, 0, s>>>((const bf16 *)table, n_vocab, d, ids, (bf16 *)x);
    KVZ_LAUNCH_CHECK("embed");
    return 0;
}

/* ---------------------------------------------------------------- RMSNorm */
template <typename TA, typename TO>
__global__ void rmsnorm_kernel(int d, float eps, float *__restrict__ x,
                               const TA *__restrict__ add, const float *__restrict__ w,
                               TO *__restrict__ out)
{
    int t = blockIdx.x;
    float *xr = x + (size_t)t * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = xr[i];
        if (add) { v += kvz_to_f<TA>(add[(size_t)t * d + i]); xr[i] = v; }
        ss += v * v;
    }
    if (!out) return;
    ss = kvz_block_sum(ss);
    float r = rsqrtf(ss / (float)d + eps);
    TO *o = out + (size_t)t * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = kvz_from_f<TO>(xr[i] * r * w[i]);
}

template <typename TA>
static void rmsnorm_launch2(cudaStream_t s, int T, int d, float eps, float *x, const void *add,
                            const float *w, void *out, kvz_cuda_dtype ot)
{
    int th = d >= 1024 ? 1024 : ((d + 31) / 32) * 32;
    if (ot == KVZ_CUDA_F32)
        rmsnorm_kernel<TA, float><<<T, th, 0, s>>>(d, eps, x, (const TA *)add, w, (float *)out);
    else
        rmsnorm_kernel<TA, bf16><<<T, th, 0, s>>>(d, eps, x, (const TA *)add, w, (bf16 *)out);
}

extern "C" int kvz_cuda_rmsnorm(cudaStream_t s, int T, int d, float eps, float *x,
                                const void *add, kvz_cuda_dtype add_type, const float *w,
                                void *out, kvz_cuda_dtype out_type)
{
    KVZ_ARG(x && d > 0 && T >= 0 && (w || !out));
    if (T == 0) return 0;
    if (add_type == KVZ_CUDA_F32) rmsnorm_launch2<float>(s, T, d, eps, x, add, w, out, out_type);
    else rmsnorm_launch2<bf16>(s, T, d, eps, x, add, w, out, out_type);
    KVZ_LAUNCH_CHECK("rmsnorm");
    return 0;
}

/* ---------------------------------------------------------------- SwiGLU */
__global__ void swiglu_kernel(int n_ff, const bf16 *__restrict__ g, int ldg,
                              const bf16 *__restrict__ u, int ldu, bf16 *__restrict__ o, int ldo)
{
    int t = blockIdx.y;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_ff; i += gridDim.x * blockDim.x) {
        float a = __bfloat162float(g[(size_t)t * ldg + i]);
        float b = __bfloat162float(u[(size_t)t * ldu + i]);
        o[(size_t)t * ldo + i] = __float2bfloat16_rn(a / (1.f + __expf(-a)) * b);
    }
}

extern "C" int kvz_cuda_swiglu(cudaStream_t s, int T, int n_ff, const void *gate, int ldg,
                               const void *up, int ldu, void *out, int ldo)
{
    KVZ_ARG(gate && up && out && n_ff > 0 && T >= 0 && ldg >= n_ff && ldu >= n_ff && ldo >= n_ff);
    if (T == 0) return 0;
    KVZ_ARG(T <= 65535);
    dim3 grid((n_ff + 255) / 256 < 64 ? (n_ff + 255) / 256 : 64, T);
    swiglu_kernel<<<grid, 256, 0, s>>>(n_ff, (const bf16 *)gate, ldg, (const bf16 *)up, ldu,
                                      (bf16 *)out, ldo);
    KVZ_LAUNCH_CHECK("swiglu");
    return 0;
}

/* ---------------------------------------------------------------- conversions */
__global__ void bf16_to_f32_kernel(const bf16 *__restrict__ a, float *__restrict__ b, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        b[i] = __bfloat162float(a[i]);
}
__global__ void f32_to_bf16_kernel(const float *__restrict__ a, bf16 *__restrict__ b, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        b[i] = __float2bfloat16_rn(a[i]);
}

static unsigned grid_for(size_t n)
{
    size_t g = (n + 255) / 256;
    return (unsigned)(g > 4096 ? 4096 : (g ? g : 1));
}

extern "C" int kvz_cuda_bf16_to_f32(cudaStream_t s, const void *src, float *dst, size_t n)
{
    KVZ_ARG((src && dst) || n == 0);
    if (!n) return 0;
    bf16_to_f32_kernel<<<grid_for(n), 256, 0, s>>>((const bf16 *)src, dst, n);
    KVZ_LAUNCH_CHECK("bf16_to_f32");
    return 0;
}

extern "C" int kvz_cuda_f32_to_bf16(cudaStream_t s, const float *src, void *dst, size_t n)
{
    KVZ_ARG((src && dst) || n == 0);
    if (!n) return 0;
    f32_to_bf16_kernel<<<grid_for(n), 256, 0, s>>>(src, (bf16 *)dst, n);
    KVZ_LAUNCH_CHECK("f32_to_bf16");
    return 0;
}

/* ---------------------------------------------------------------- argmax */
__device__ __forceinline__ void amax_merge(float &v, int &i, float v2, int i2)
{
    /* NaN never wins; larger wins; equal → lower index. */
    bool take = (v2 == v2) && (!(v == v) || v2 > v || (v2 == v && i2 < i));
    if (take) { v = v2; i = i2; }
}

__global__ void argmax_kernel(const float *__restrict__ logits, int n, int ld, int32_t *out)
{
    const float *row = logits + (size_t)blockIdx.x * ld;
    float bv = __int_as_float(0xffc00000); /* NaN: loses to anything */
    int bi = 0x7fffffff;
    for (int j = threadIdx.x; j < n; j += blockDim.x) amax_merge(bv, bi, row[j], j);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
        int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
        amax_merge(bv, bi, v2, i2);
    }
    __shared__ float sv[32];
    __shared__ int si[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) { sv[w] = bv; si[w] = bi; }
    __syncthreads();
    if (w == 0) {
        int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : __int_as_float(0xffc00000);
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
            int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
            amax_merge(bv, bi, v2, i2);
        }
        /* the host scan's rule (kvz_argmax): a NaN first element stays the pick */
        if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff || row[0] != row[0] ? 0 : bi;
    }
}

extern "C" int kvz_cuda_argmax(cudaStream_t s, const float *logits, int n_rows, int n_vocab,
                               int ld, int32_t *out)
{
    KVZ_ARG(logits && out && n_rows >= 0 && n_vocab > 0 && ld >= n_vocab);
    if (!n_rows) return 0;
    argmax_kernel<<<n_rows, 1024, 0, s>>>(logits, n_vocab, ld, out);
    KVZ_LAUNCH_CHECK("argmax");
    return 0;
}
