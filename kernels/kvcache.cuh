/* kvcache.cu: KV append, LongFlow output-buffer writes, compaction after eviction. */
#pragma once
#include "kvz_cuda_common.cuh"
