/* fattn.cu: tiled flash attention on bf16 tensor cores (mma.sync m16n8k16) for
 * prefill, plus the two KVzip scoring passes built on the same tile loop. */
#pragma once
#include "kvz_cuda_common.cuh"
#include "mma.cuh"
