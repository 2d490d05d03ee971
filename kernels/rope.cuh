/* rope.cu: rotary embedding (adjacent / half-split) with optional per-head RMSNorm. */
#pragma once
#include "kvz_cuda_common.cuh"
