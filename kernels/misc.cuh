/* misc.cu: embedding, RMSNorm, SwiGLU, dtype conversion, argmax, device query. */
#pragma once
#include "kvz_cuda_common.cuh"
