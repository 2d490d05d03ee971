/* gemm.cu: cuBLAS wrapper for y = x·Wᵀ (+bias) (+beta·y). */
#pragma once
#include "kvz_cuda_common.cuh"
