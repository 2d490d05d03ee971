/* Linear layers through cuBLAS (bf16 operands, fp32 accumulate). Row-major
 * y (T, n_out) = x (T, n_in) · Wᵀ is, in cuBLAS's column-major view,
 * yᵀ (n_out, T) = W_cm(n_in, n_out)ᵀ · xᵀ(n_in, T): op(A) = T on W, op(B) = N on x. */
#include <stdlib.h>

#include <cublas_v2.h>

#include "gemm.cuh"

struct kvz_cuda_blas {
    cublasHandle_t h;
};

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
    *out = b;
    return 0;
}

extern "C" void kvz_cuda_blas_destroy(kvz_cuda_blas *b)
{
    if (!b) return;
    cublasDestroy(b->h);
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

extern "C" int kvz_cuda_linear(kvz_cuda_blas *b, cudaStream_t s, int T, int n_in, int n_out,
                               const void *x, int ldx, const void *w, const float *bias,
                               void *y, kvz_cuda_dtype y_type, int ldy, float beta)
{
    KVZ_ARG(b && x && w && y && T >= 0 && n_in > 0 && n_out > 0 && ldx >= n_in && ldy >= n_out);
    if (T == 0) return 0;
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
    if (bias) {
        KVZ_ARG(T <= 65535);
        dim3 grid((n_out + 255) / 256, T);
        if (y_type == KVZ_CUDA_F32) bias_kernel<float><<<grid, 256, 0, s>>>((float *)y, ldy, n_out, bias);
        else bias_kernel<bf16><<<grid, 256, 0, s>>>((bf16 *)y, ldy, n_out, bias);
        KVZ_LAUNCH_CHECK("bias");
    }
    return 0;
}
