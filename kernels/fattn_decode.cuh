/* fattn_decode.cu: split-K (flash-decoding) attention for a few queries, with the
 * LongFlow slot score and eviction argmin folded into the split/combine steps. */
#pragma once
#include "kvz_cuda_common.cuh"
