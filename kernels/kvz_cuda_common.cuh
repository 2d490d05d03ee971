/* Shared helpers for CUDA code over the op library: the kernels here and the
 * runtime's CUDA backend (runtime/cuda/, which launches a few kernels of its own).
 * Part of kernels/' interface for CUDA sources, with kvz_cuda.h; not installed. */
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "kvz_cuda.h"
#include "kvz_error.h"

typedef __nv_bfloat16 bf16;

/* Return KVZ_ERR_CUDA with the CUDA error text from the enclosing function. */
#define KVZ_CUDA_TRY(call)                                                          \
    do {                                                                            \
        cudaError_t kvz_e_ = (call);                                                \
        if (kvz_e_ != cudaSuccess)                                                  \
            return kvz_error_set(KVZ_ERR_CUDA, "%s: %s (%s:%d)", #call,             \
                                 cudaGetErrorString(kvz_e_), __FILE__, __LINE__);   \
    } while (0)

/* Check the last launch. */
#define KVZ_LAUNCH_CHECK(name)                                                      \
    do {                                                                            \
        cudaError_t kvz_e_ = cudaGetLastError();                                    \
        if (kvz_e_ != cudaSuccess)                                                  \
            return kvz_error_set(KVZ_ERR_CUDA, "launch %s: %s", name,               \
                                 cudaGetErrorString(kvz_e_));                       \
    } while (0)

/* 1 when kernels may be launched with programmatic stream serialization (PDL): the
 * device current at the call is sm_90+ and the environment variable @p env (NULL:
 * none) is unset or does not start with '0'. Host only; not cached: each caller
 * keeps the answer in a static (first call before any graph capture). */
static inline int kvz_cuda_pdl_allowed(const char *env)
{
    const char *e = env ? getenv(env) : NULL;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
        cudaGetLastError();
        major = 0;
    }
    return major >= 9 && !(e && e[0] == '0');
}

#define KVZ_ARG(cond)                                                               \
    do {                                                                            \
        if (!(cond))                                                                \
            return kvz_error_set(KVZ_ERR_ARG, "%s: invalid argument: %s", __func__, \
                                 #cond);                                            \
    } while (0)

template <typename T> __device__ __forceinline__ float kvz_to_f(T v);
template <> __device__ __forceinline__ float kvz_to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float kvz_to_f<bf16>(bf16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T kvz_from_f(float v);
template <> __device__ __forceinline__ float kvz_from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 kvz_from_f<bf16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float kvz_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float kvz_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Block-wide sum (blockDim.x multiple of 32, <= 1024). All threads get the result. */
__device__ __forceinline__ float kvz_block_sum(float v)
{
    __shared__ float sh[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = kvz_warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        float x = lane < (int)(blockDim.x >> 5) ? sh[lane] : 0.f;
        x = kvz_warp_sum(x);
        if (lane == 0) total = x;
    }
    __syncthreads();
    return total;
}

/* SMs of the current device (cached per device; 132, the H200's, if the query fails). */
static inline int kvz_cuda_sm_count(void)
{
    static int cache[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) { cudaGetLastError(); dev = 0; }
    if (dev >= 0 && dev < 64 && cache[dev] > 0) return cache[dev];
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
        cudaGetLastError();
        n = 132;
    }
    if (dev >= 0 && dev < 64) cache[dev] = n;
    return n;
}
