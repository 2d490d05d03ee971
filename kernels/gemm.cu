/* Linear layers through cuBLAS (bf16 operands, fp32 accumulate). Row-major
 * y (T, n_out) = x (T, n_in) · Wᵀ is, in cuBLAS's column-major view,
 * yᵀ (n_out, T) = W_cm(n_in, n_out)ᵀ · xᵀ(n_in, T): op(A) = T on W, op(B) = N on x. */
#include <stdlib.h>

#include <cublas_v2.h>

#include "gemm.cuh"

struct kvz_cuda_blas {
    cublasHandle_t h;
    void *ws; /* our own cuBLAS workspace: nothing is allocated while a graph is captured */
};
#define KVZ_BLAS_WS_BYTES ((size_t)32 << 20)

extern "C" int kvz_cuda_blas_create(kvz_cuda_blas **out)
{
    KVZ_ARG(out);
    *out = NULL;
    kvz_cuda_blas *b = (kvz_cuda_blas *)calloc(1, sizeof *b);
    if (!b) return kvz_error_set(KVZ_ERR_NOMEM, "kvz_cuda_blas_create");
    cublasStatus_t st = cublasCreate(&b->h);
    if (st != CUBLAS_STATUS_SUCCESS) {
        free(b);
        return kvz_error_set(KVZ_ERR_CUDA, "cublasCreate: %s", cublasGetStatusString(st));
    }
    if (cudaMalloc(&b->ws, KVZ_BLAS_WS_BYTES) != cudaSuccess ||
        (st = cublasSetWorkspace(b->h, b->ws, KVZ_BLAS_WS_BYTES)) != CUBLAS_STATUS_SUCCESS) {
        cudaGetLastError();
        cublasDestroy(b->h);
        cudaFree(b->ws);
        free(b);
        return kvz_error_set(KVZ_ERR_CUDA, "cuBLAS workspace (32 MiB) could not be set");
    }
    *out = b;
    return 0;
}

extern "C" void kvz_cuda_blas_destroy(kvz_cuda_blas *b)
{
    if (!b) return;
    cublasDestroy(b->h);
    cudaFree(b->ws);
    free(b);
}

template <typename T>
__global__ void bias_kernel(T *y, int ldy, int n_out, const float *__restrict__ bias)
{
    int t = blockIdx.y;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_out; i += gridDim.x * blockDim.x) {
        T *p = y + (size_t)t * ldy + i;
        *p = kvz_from_f<T>(kvz_to_f<T>(*p) + bias[i]);
    }
}

/* Batch-1 linear layer (decode): y[r] = w[r,:]·x (+ beta·y[r]); one warp per output
 * row, 4 independent 16-byte weight loads per lane in flight, streaming (evict-first)
 * weight reads, fp32 accumulate. Memory-bound: the weights are read once. */
#define GEMV_ROWS 8
template <typename YT>
__global__ void __launch_bounds__(32 * GEMV_ROWS) gemv_kernel(int n_in, int n_out, const bf16 *__restrict__ x,
                                                              const bf16 *__restrict__ w, YT *__restrict__ y,
                                                              float beta)
{
    const int lane = threadIdx.x & 31, row = blockIdx.x * GEMV_ROWS + (threadIdx.x >> 5);
    if (row >= n_out) return;
    const uint4 *wr = (const uint4 *)(w + (size_t)row * n_in), *xv = (const uint4 *)x;
    const int nv = n_in / 8;
    float acc = 0.f;
    auto dot8 = [&](uint4 a, uint4 b) {
        const __nv_bfloat162 *a2 = (const __nv_bfloat162 *)&a, *b2 = (const __nv_bfloat162 *)&b;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float2 fa = __bfloat1622float2(a2[e]), fb = __bfloat1622float2(b2[e]);
            acc = fmaf(fa.x, fb.x, acc);
            acc = fmaf(fa.y, fb.y, acc);
        }
    };
    int i = lane;
    for (; i + 96 < nv; i += 128) {
        uint4 a0 = __ldcs(wr + i), a1 = __ldcs(wr + i + 32), a2 = __ldcs(wr + i + 64), a3 = __ldcs(wr + i + 96);
        uint4 b0 = __ldg(xv + i), b1 = __ldg(xv + i + 32), b2 = __ldg(xv + i + 64), b3 = __ldg(xv + i + 96);
        dot8(a0, b0); dot8(a1, b1); dot8(a2, b2); dot8(a3, b3);
    }
    for (; i < nv; i += 32) dot8(__ldcs(wr + i), __ldg(xv + i));
    acc = kvz_warp_sum(acc);
    if (lane == 0) {
        float prev = beta != 0.f ? kvz_to_f<YT>(y[row]) * beta : 0.f;
        y[row] = kvz_from_f<YT>(acc + prev);
    }
}

static int gemv_enabled(void)
{
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("KVZ_CUDA_GEMV");
        on = !(e && e[0] == '0');
    }
    return on;
}

extern "C" int kvz_cuda_linear(kvz_cuda_blas *b, cudaStream_t s, int T, int n_in, int n_out,
                               const void *x, int ldx, const void *w, const float *bias,
                               void *y, kvz_cuda_dtype y_type, int ldy, float beta)
{
    KVZ_ARG(b && x && w && y && T >= 0 && n_in > 0 && n_out > 0 && ldx >= n_in && ldy >= n_out);
    if (T == 0) return 0;
    if (T == 1 && n_in % 8 == 0 && gemv_enabled() && ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & 15) == 0) {
        const unsigned grid = (unsigned)((n_out + GEMV_ROWS - 1) / GEMV_ROWS);
        if (y_type == KVZ_CUDA_F32)
            gemv_kernel<float><<<grid, 32 * GEMV_ROWS, 0, s>>>(n_in, n_out, (const bf16 *)x, (const bf16 *)w,
                                                              (float *)y, beta);
        else
            gemv_kernel<bf16><<<grid, 32 * GEMV_ROWS, 0, s>>>(n_in, n_out, (const bf16 *)x, (const bf16 *)w,
                                                             (bf16 *)y, beta);
        KVZ_LAUNCH_CHECK("gemv");
    } else {
        cublasStatus_t st = cublasSetStream(b->h, s);
        if (st != CUBLAS_STATUS_SUCCESS)
            return kvz_error_set(KVZ_ERR_CUDA, "cublasSetStream: %s", cublasGetStatusString(st));
        float alpha = 1.f;
        cudaDataType_t yt = y_type == KVZ_CUDA_F32 ? CUDA_R_32F : CUDA_R_16BF;
        st = cublasGemmEx(b->h, CUBLAS_OP_T, CUBLAS_OP_N, n_out, T, n_in, &alpha, w, CUDA_R_16BF, n_in,
                          x, CUDA_R_16BF, ldx, &beta, y, yt, ldy, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT);
        if (st != CUBLAS_STATUS_SUCCESS)
            return kvz_error_set(KVZ_ERR_CUDA, "cublasGemmEx(T=%d,in=%d,out=%d): %s", T, n_in, n_out,
                                 cublasGetStatusString(st));
    }
    if (bias) {
        KVZ_ARG(T <= 65535);
        dim3 grid((n_out + 255) / 256, T);
        if (y_type == KVZ_CUDA_F32) bias_kernel<float><<<grid, 256, 0, s>>>((float *)y, ldy, n_out, bias);
        else bias_kernel<bf16><<<grid, 256, 0, s>>>((bf16 *)y, ldy, n_out, bias);
        KVZ_LAUNCH_CHECK("bias");
    }
    return 0;
}
