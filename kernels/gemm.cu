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

/* Batch-1 linear layer (decode): y[r] = w[r,:]·x (+ beta·y[r]), fp32 accumulate.
 * Memory-bound: the weights are read once, streaming (evict-first). One warp takes
 * GEMV_R = 2 adjacent rows; every lane keeps GEMV_U × GEMV_R = 8 independent 16-byte
 * weight loads in flight (4 KB per warp) and reuses each 16-byte x load (L1-resident)
 * for both rows. 8 warps per block (16 rows). R = 4 measured slower on the 4096-wide
 * layers (fewer warps in flight); R = 1 within noise of R = 2. On sm_90 the kernel is launched with
 * programmatic stream serialization (PDL): its blocks may start while the previous
 * kernel drains, load their first weights (which no kernel writes), and only then
 * wait for the previous grid (griddepcontrol.wait) before reading x and y. That hides
 * most of the launch gap and first-load latency, which is 25-30% of a 4096x4096 GEMV. */
#define GEMV_WARPS 8
#ifndef GEMV_R
#define GEMV_R 2
#endif
#ifndef GEMV_U
#define GEMV_U 4
#endif
template <typename YT, int R, int U>
__global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_kernel(int n_in, int n_out, const bf16 *__restrict__ x,
                                                               const bf16 *__restrict__ w, YT *__restrict__ y,
                                                               float beta)
{
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * R;
    const uint4 *xv = (const uint4 *)x;
    const uint4 *wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) wr[r] = (const uint4 *)(w + (size_t)min(row0 + r, n_out - 1) * n_in);
    const int nv = n_in / 8;
    /* first weight chunk before the dependency wait */
    const bool pre = row0 < n_out && lane + 32 * (U - 1) < nv;
    uint4 a[U][R];
    if (pre) {
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) a[u][r] = __ldcs(wr[r] + lane + 32 * u);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory"); /* no-op without a PDL launch */
#endif
    if (row0 >= n_out) return;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    auto dot8 = [](float &s, uint4 a, uint4 b) {
        const __nv_bfloat162 *a2 = (const __nv_bfloat162 *)&a, *b2 = (const __nv_bfloat162 *)&b;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float2 fa = __bfloat1622float2(a2[e]), fb = __bfloat1622float2(b2[e]);
            s = fmaf(fa.x, fb.x, s);
            s = fmaf(fa.y, fb.y, s);
        }
    };
    auto step = [&](int i) { /* a[][] holds chunks i + 32u of the R rows */
        uint4 b[U];
#pragma unroll
        for (int u = 0; u < U; u++) b[u] = __ldg(xv + i + 32 * u);
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) dot8(acc[r], a[u][r], b[u]);
    };
    int i = lane;
    if (pre) { step(i); i += 32 * U; }
    for (; i + 32 * (U - 1) < nv; i += 32 * U) {
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) a[u][r] = __ldcs(wr[r] + i + 32 * u);
        step(i);
    }
    for (; i < nv; i += 32) {
        uint4 b = __ldg(xv + i);
#pragma unroll
        for (int r = 0; r < R; r++) dot8(acc[r], __ldcs(wr[r] + i), b);
    }
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = kvz_warp_sum(acc[r]);
    float mine = acc[0];
#pragma unroll
    for (int r = 1; r < R; r++) if (lane == r) mine = acc[r];
    const int row = row0 + lane;
    if (lane < R && row < n_out) {
        float prev = beta != 0.f ? kvz_to_f<YT>(y[row]) * beta : 0.f;
        y[row] = kvz_from_f<YT>(mine + prev);
    }
}

/* PDL launch on sm_90+ unless KVZ_CUDA_GEMV_PDL=0 (read once, with the compute
 * capability of the device current at the first call). */
static int gemv_pdl(void)
{
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("KVZ_CUDA_GEMV_PDL");
        int dev = 0, major = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
            cudaGetLastError();
            major = 0;
        }
        on = major >= 9 && !(e && e[0] == '0');
    }
    return on;
}

template <typename YT>
static cudaError_t gemv_launch(cudaStream_t s, int n_in, int n_out, const bf16 *x, const bf16 *w, YT *y, float beta)
{
    const int rows_per_block = GEMV_WARPS * GEMV_R;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)((n_out + rows_per_block - 1) / rows_per_block));
    cfg.blockDim = dim3(32 * GEMV_WARPS);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = gemv_pdl() ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, gemv_kernel<YT, GEMV_R, GEMV_U>, n_in, n_out, x, w, y, beta);
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
        cudaError_t e = y_type == KVZ_CUDA_F32
            ? gemv_launch<float>(s, n_in, n_out, (const bf16 *)x, (const bf16 *)w, (float *)y, beta)
            : gemv_launch<bf16>(s, n_in, n_out, (const bf16 *)x, (const bf16 *)w, (bf16 *)y, beta);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return kvz_error_set(KVZ_ERR_CUDA, "launch gemv: %s", cudaGetErrorString(e));
        }
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
