/* topk.cu: exact top-k keep masks by radix select on float bits (global and per row). */
#pragma once
#include "kvz_cuda_common.cuh"
