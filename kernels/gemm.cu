/* Linear layers through cuBLAS (bf16 operands, fp32 accumulate). Row-major
 * y (T, n_out) = x (T, n_in) · Wᵀ is, in cuBLAS's column-major view,
 * yᵀ (n_out, T) = W_cm(n_in, n_out)ᵀ · xᵀ(n_in, T): op(A) = T on W, op(B) = N on x. */
#include <stdlib.h>

#include <cublas_v2.h>

#include "kvz_cuda_common.cuh"

#define TRY_K(call)                 \
    do {                            \
        int rc_ = (call);           \
        if (rc_) return rc_;        \
    } while (0)

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
 * most of the launch gap and first-load latency, which is 25-30% of a 4096x4096 GEMV.
 * Right after the wait every block signals griddepcontrol.launch_dependents, so the
 * next PDL kernel's blocks can take the SMs this grid's tail leaves free. */
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
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
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
    if (on < 0) on = kvz_cuda_pdl_allowed("KVZ_CUDA_GEMV_PDL");
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

/* ---------------------------------------------------------------- RMSNorm fused into the GEMV */
/* Batch-1 linear layer whose input is RMSNorm(x) of the fp32 residual (the decode
 * step's qkv, gate|up and LM-head GEMVs): every block computes Σx² itself (x is 16 KB
 * and sits in L2), writes xn = bf16((x·r)·nw) to shared memory — the exact expression
 * and rounding of rmsnorm_kernel — and then runs gemv_kernel's loop with x from shared
 * memory. This replaces a one-block rmsnorm launch (and its dependent first load) per
 * GEMV. Blocks loop over groups of 8 warps × 2 rows, the grid capped at the resident
 * block count, so the 32 KB of x and nw a block reads is amortised over several groups
 * of the large GEMVs (gate|up, LM head) instead of adding 25% to their L2 traffic.
 * SWIGLU: a warp's two rows are gate row p and up row p + n_ff (the fused gate|up
 * weight), and the epilogue writes out[p] = bf16(silu(g)·u) from g and u rounded to
 * bf16 first — the values swiglu_kernel would read — so the gate|up output and the
 * SwiGLU launch disappear. Weights of the first group are loaded before
 * griddepcontrol.wait (PDL), as in gemv_kernel. */
template <typename YT, bool SWIGLU, int U>
__global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_norm_kernel(int n_in, int n_out, int n_groups,
                                                                    const float *__restrict__ x,
                                                                    const float *__restrict__ nw, float eps,
                                                                    const bf16 *__restrict__ w,
                                                                    const float *__restrict__ bias,
                                                                    YT *__restrict__ y, float beta)
{
    extern __shared__ uint4 xs[]; /* (n_in / 8) × 8 bf16: the normalised x, then (n_in) fp32: nw */
    float4 *nws = (float4 *)(xs + n_in / 8);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nv = n_in / 8, n4 = n_in / 4;
    auto rows_of = [&](int grp, int &r0, int &r1) -> bool { /* this warp's two weight rows */
        if (SWIGLU) {
            const int p = grp * GEMV_WARPS + warp;
            r0 = min(p, n_out - 1);
            r1 = r0 + n_out;
            return p < n_out;
        }
        const int row0 = (grp * GEMV_WARPS + warp) * 2;
        r0 = min(row0, n_out - 1);
        r1 = min(row0 + 1, n_out - 1);
        return row0 < n_out;
    };
    int grp = blockIdx.x, r0, r1;
    bool valid = rows_of(grp, r0, r1);
    const uint4 *wr[2] = {(const uint4 *)(w + (size_t)r0 * n_in), (const uint4 *)(w + (size_t)r1 * n_in)};
    bool pre = valid && lane + 32 * (U - 1) < nv;
    uint4 a[U][2];
    if (pre) {
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < 2; r++) a[u][r] = __ldcs(wr[r] + lane + 32 * u);
    }
    /* the norm weight is no kernel's output either: to shared memory before the wait */
    const float4 *x4 = (const float4 *)x, *n4g = (const float4 *)nw;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) nws[i] = __ldg(n4g + i);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    /* RMSNorm of x into shared memory: one L2 round trip (x kept in registers when
     * n_in <= 4·4·blockDim, i.e. 4096 with 256 threads) */
    constexpr int XK = 4;
    float4 xr[XK];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < XK; k++) {
        const int i = threadIdx.x + k * (int)blockDim.x;
        if (i < n4) {
            xr[k] = x4[i];
            ss += xr[k].x * xr[k].x + xr[k].y * xr[k].y + xr[k].z * xr[k].z + xr[k].w * xr[k].w;
        }
    }
    for (int i = threadIdx.x + XK * (int)blockDim.x; i < n4; i += blockDim.x) {
        const float4 v = x4[i];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = kvz_block_sum(ss); /* its barriers also publish nws */
    const float rs = rsqrtf(ss / (float)n_in + eps);
    auto put = [&](int i, float4 v) { /* xn[4i .. 4i+3] = bf16((x·r)·nw) */
        const float4 g = nws[i];
        __nv_bfloat162 o[2];
        o[0] = __floats2bfloat162_rn(v.x * rs * g.x, v.y * rs * g.y);
        o[1] = __floats2bfloat162_rn(v.z * rs * g.z, v.w * rs * g.w);
        ((uint2 *)xs)[i] = *(const uint2 *)o;
    };
#pragma unroll
    for (int k = 0; k < XK; k++) {
        const int i = threadIdx.x + k * (int)blockDim.x;
        if (i < n4) put(i, xr[k]);
    }
    for (int i = threadIdx.x + XK * (int)blockDim.x; i < n4; i += blockDim.x) put(i, x4[i]);
    __syncthreads();
    auto dot8 = [](float &s, uint4 a, uint4 b) {
        const __nv_bfloat162 *a2 = (const __nv_bfloat162 *)&a, *b2 = (const __nv_bfloat162 *)&b;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float2 fa = __bfloat1622float2(a2[e]), fb = __bfloat1622float2(b2[e]);
            s = fmaf(fa.x, fb.x, s);
            s = fmaf(fa.y, fb.y, s);
        }
    };
    for (; grp < n_groups; grp += gridDim.x) {
        if (grp != (int)blockIdx.x) {
            valid = rows_of(grp, r0, r1);
            wr[0] = (const uint4 *)(w + (size_t)r0 * n_in);
            wr[1] = (const uint4 *)(w + (size_t)r1 * n_in);
            pre = false;
        }
        if (!valid) continue; /* no barrier below: a warp may skip its rows */
        float acc[2] = {0.f, 0.f};
        auto step = [&](int i) { /* a[][] holds chunks i + 32u of both rows */
#pragma unroll
            for (int u = 0; u < U; u++) {
                uint4 b = xs[i + 32 * u];
#pragma unroll
                for (int r = 0; r < 2; r++) dot8(acc[r], a[u][r], b);
            }
        };
        int i = lane;
        if (pre) { step(i); i += 32 * U; }
        for (; i + 32 * (U - 1) < nv; i += 32 * U) {
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < 2; r++) a[u][r] = __ldcs(wr[r] + i + 32 * u);
            step(i);
        }
        for (; i < nv; i += 32) {
            uint4 b = xs[i];
#pragma unroll
            for (int r = 0; r < 2; r++) dot8(acc[r], __ldcs(wr[r] + i), b);
        }
        acc[0] = kvz_warp_sum(acc[0]);
        acc[1] = kvz_warp_sum(acc[1]);
        if (SWIGLU) {
            if (lane == 0) {
                const float g = __bfloat162float(__float2bfloat16_rn(acc[0]));
                const float u = __bfloat162float(__float2bfloat16_rn(acc[1]));
                y[r0] = kvz_from_f<YT>(__bfloat162float(__float2bfloat16_rn(g / (1.f + __expf(-g)) * u)));
            }
        } else {
            const int row = (grp * GEMV_WARPS + warp) * 2 + lane;
            if (lane < 2 && row < n_out) {
                const float mine = lane ? acc[1] : acc[0];
                float prev = beta != 0.f ? kvz_to_f<YT>(y[row]) * beta : 0.f;
                YT o = kvz_from_f<YT>(mine + prev);
                if (bias) o = kvz_from_f<YT>(kvz_to_f<YT>(o) + bias[row]); /* bias_kernel's rounding */
                y[row] = o;
            }
        }
    }
}

/* Launch of gemv_norm_kernel: grid = min(groups, resident blocks on the device). */
#define GEMV_NORM_MAX_IN 16384 /* 96 KB of shared memory per block */
template <typename YT, bool SWIGLU>
static cudaError_t gemv_norm_launch(cudaStream_t s, int n_in, int n_out, const float *x, const float *nw,
                                    float eps, const bf16 *w, const float *bias, YT *y, float beta)
{
    auto kern = gemv_norm_kernel<YT, SWIGLU, GEMV_U>;
    const size_t smem = (size_t)n_in * (sizeof(bf16) + sizeof(float)); /* xn + nw */
    static int resident = 0; /* per instantiation: device and n_in of the first call (3 blocks/SM on sm_90a) */
    if (!resident) {
        /* past the 48 KB default (which also counts kvz_block_sum's static shared memory) */
        cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             GEMV_NORM_MAX_IN * (int)(sizeof(bf16) + sizeof(float)));
        if (e != cudaSuccess) return e;
        int dev = 0, nsm = 0, per = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kern, 32 * GEMV_WARPS, smem) != cudaSuccess) {
            cudaGetLastError();
            nsm = 132;
            per = 2;
        }
        resident = (per > 0 ? per : 1) * (nsm > 0 ? nsm : 1);
    }
    const int rows_per_group = SWIGLU ? GEMV_WARPS : 2 * GEMV_WARPS;
    const int groups = (n_out + rows_per_group - 1) / rows_per_group;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(groups < resident ? groups : resident));
    cfg.blockDim = dim3(32 * GEMV_WARPS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = gemv_pdl() ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kern, n_in, n_out, groups, x, nw, eps, w, bias, y, beta);
}

/* The fused kernels need 16-byte aligned x / nw / w and 6·n_in bytes of shared memory. */
static int gemv_norm_ok(int n_in, const void *x, const void *nw, const void *w)
{
    return gemv_enabled() && n_in % 8 == 0 && n_in <= GEMV_NORM_MAX_IN && ((uintptr_t)x & 15) == 0 &&
           ((uintptr_t)nw & 15) == 0 && ((uintptr_t)w & 15) == 0;
}

extern "C" int kvz_cuda_linear_rmsnorm(kvz_cuda_blas *b, cudaStream_t s, int n_in, int n_out,
                                       const float *x, const float *norm_w, float eps, const void *w,
                                       const float *bias, void *y, kvz_cuda_dtype y_type, float beta,
                                       void *xn)
{
    KVZ_ARG(b && x && norm_w && w && y && xn && n_in > 0 && n_out > 0);
    if (!gemv_norm_ok(n_in, x, norm_w, w)) {
        TRY_K(kvz_cuda_rmsnorm(s, 1, n_in, eps, (float *)x, NULL, KVZ_CUDA_F32, norm_w, xn, KVZ_CUDA_BF16));
        return kvz_cuda_linear(b, s, 1, n_in, n_out, xn, n_in, w, bias, y, y_type, n_out, beta);
    }
    cudaError_t e = y_type == KVZ_CUDA_F32
        ? gemv_norm_launch<float, false>(s, n_in, n_out, x, norm_w, eps, (const bf16 *)w, bias, (float *)y, beta)
        : gemv_norm_launch<bf16, false>(s, n_in, n_out, x, norm_w, eps, (const bf16 *)w, bias, (bf16 *)y, beta);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kvz_error_set(KVZ_ERR_CUDA, "launch gemv_norm: %s", cudaGetErrorString(e));
    }
    KVZ_LAUNCH_CHECK("gemv_norm");
    return 0;
}

extern "C" int kvz_cuda_linear_rmsnorm_swiglu(kvz_cuda_blas *b, cudaStream_t s, int n_in, int n_ff,
                                              const float *x, const float *norm_w, float eps,
                                              const void *w_gu, void *out, void *xn, void *gu)
{
    KVZ_ARG(b && x && norm_w && w_gu && out && xn && gu && n_in > 0 && n_ff > 0);
    if (!gemv_norm_ok(n_in, x, norm_w, w_gu)) {
        TRY_K(kvz_cuda_rmsnorm(s, 1, n_in, eps, (float *)x, NULL, KVZ_CUDA_F32, norm_w, xn, KVZ_CUDA_BF16));
        TRY_K(kvz_cuda_linear(b, s, 1, n_in, 2 * n_ff, xn, n_in, w_gu, NULL, gu, KVZ_CUDA_BF16, 2 * n_ff, 0.f));
        return kvz_cuda_swiglu(s, 1, n_ff, gu, 2 * n_ff, (const bf16 *)gu + n_ff, 2 * n_ff, out, n_ff);
    }
    cudaError_t e = gemv_norm_launch<bf16, true>(s, n_in, n_ff, x, norm_w, eps, (const bf16 *)w_gu, NULL,
                                                 (bf16 *)out, 0.f);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kvz_error_set(KVZ_ERR_CUDA, "launch gemv_norm_swiglu: %s", cudaGetErrorString(e));
    }
    KVZ_LAUNCH_CHECK("gemv_norm_swiglu");
    return 0;
}
