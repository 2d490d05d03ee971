/* Top-k selection without sorting. Scores are fp32 >= 0, so their bit patterns
 * order like the values (as uint32). Four 8-bit radix passes (most significant
 * first) find the K-th largest bit pattern `thr` and how many elements equal to it
 * must be kept (need_eq); then an ordered scan keeps the first need_eq elements
 * equal to thr by flat index (lower index wins). Global version: multi-kernel, state
 * in the workspace, no host synchronisation. Per-row version: one block per row. */
#include <limits.h>

#include "kvz_cuda_common.cuh"

#define TK_CHUNK 4096 /* elements per block in the mask pass: 256 threads × 16 */

struct tk_state {
    uint32_t prefix, mask, kremain, pad;
};

__global__ void tk_hist_kernel(const float *__restrict__ x, int64_t n, int shift,
                               const tk_state *__restrict__ st, uint32_t *__restrict__ hist)
{
    __shared__ uint32_t sh[256];
    sh[threadIdx.x] = 0;
    __syncthreads();
    uint32_t prefix = st->prefix, mask = st->mask;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t b = __float_as_uint(x[i]);
        if ((b & mask) == prefix) atomicAdd(&sh[(b >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (sh[threadIdx.x]) atomicAdd(&hist[threadIdx.x], sh[threadIdx.x]);
}

/* one warp: choose the digit, clear the histogram */
__global__ void tk_pick_kernel(int shift, tk_state *st, uint32_t *hist)
{
    if (threadIdx.x == 0) {
        uint32_t k = st->kremain, cum = 0;
        int b = 255;
        for (; b > 0; b--) {
            if (cum + hist[b] >= k) break;
            cum += hist[b];
        }
        st->prefix |= (uint32_t)b << shift;
        st->mask |= 255u << shift;
        st->kremain = k - cum;
    }
    __syncwarp();
    for (int i = threadIdx.x; i < 256; i += 32) hist[i] = 0;
}

/* Block-wide exclusive scan of one uint32 per thread (256 threads). */
__device__ uint32_t tk_block_excl_scan(uint32_t v, uint32_t *total)
{
    __shared__ uint32_t ws[8];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    uint32_t inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        uint32_t y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    __syncthreads();
    if (lane == 31) ws[w] = inc;
    __syncthreads();
    uint32_t off = 0, tot = 0;
    for (int i = 0; i < 8; i++) { if (i < w) off += ws[i]; tot += ws[i]; }
    if (total) *total = tot;
    return off + inc - v;
}

/* count elements equal to the threshold per chunk */
__global__ void tk_eqcount_kernel(const float *__restrict__ x, int64_t n, const tk_state *st, uint32_t *cnt)
{
    uint32_t thr = st->prefix, c = 0;
    int64_t base = (int64_t)blockIdx.x * TK_CHUNK;
    for (int e = 0; e < 16; e++) {
        int64_t i = base + threadIdx.x * 16 + e;
        if (i < n && __float_as_uint(x[i]) == thr) c++;
    }
    c = (uint32_t)kvz_block_sum((float)c); /* <= 4096: exact */
    if (threadIdx.x == 0) cnt[blockIdx.x] = c;
}

/* single block: exclusive scan over chunk counts in place */
__global__ void tk_scan_kernel(uint32_t *cnt, int nb)
{
    __shared__ uint32_t carry;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int b0 = 0; b0 < nb; b0 += 256) {
        int i = b0 + threadIdx.x;
        uint32_t v = i < nb ? cnt[i] : 0, tot;
        uint32_t ex = tk_block_excl_scan(v, &tot);
        if (i < nb) cnt[i] = carry + ex;
        __syncthreads();
        if (threadIdx.x == 0) carry += tot;
        __syncthreads();
    }
}

__global__ void tk_mask_kernel(const float *__restrict__ x, int64_t n, const tk_state *st,
                               const uint32_t *__restrict__ cnt, uint8_t *__restrict__ keep)
{
    uint32_t thr = st->prefix, need = st->kremain;
    int64_t base = (int64_t)blockIdx.x * TK_CHUNK + threadIdx.x * 16;
    uint32_t b[16], c = 0;
#pragma unroll
    for (int e = 0; e < 16; e++) {
        int64_t i = base + e;
        b[e] = i < n ? __float_as_uint(x[i]) : 0u;
        c += (i < n && b[e] == thr);
    }
    uint32_t rank = cnt[blockIdx.x] + tk_block_excl_scan(c, nullptr);
#pragma unroll
    for (int e = 0; e < 16; e++) {
        int64_t i = base + e;
        if (i >= n) break;
        uint8_t k = b[e] > thr;
        if (b[e] == thr) { k = rank < need; rank++; }
        keep[i] = k;
    }
}

__global__ void tk_init_kernel(tk_state *st, uint32_t *hist, uint32_t K)
{
    if (threadIdx.x == 0) { st->prefix = 0; st->mask = 0; st->kremain = K; st->pad = 0; }
    hist[threadIdx.x] = 0;
}

extern "C" size_t kvz_cuda_topk_ws_size(int64_t n)
{
    if (n < 0) n = 0;
    return 256 + 256 * 4 + (size_t)((n + TK_CHUNK - 1) / TK_CHUNK) * 4;
}

extern "C" int kvz_cuda_topk_global(cudaStream_t s, const float *scores, int64_t n, int64_t K,
                                    uint8_t *keep, void *ws, size_t ws_bytes)
{
    KVZ_ARG(n >= 0 && n <= INT_MAX && K >= 0 && K <= n && (n == 0 || (scores && keep)));
    if (n == 0) return 0;
    if (K == 0 || K == n) {
        KVZ_CUDA_TRY(cudaMemsetAsync(keep, K == 0 ? 0 : 1, (size_t)n, s));
        return 0;
    }
    KVZ_ARG(ws && ws_bytes >= kvz_cuda_topk_ws_size(n));
    tk_state *st = (tk_state *)ws;
    uint32_t *hist = (uint32_t *)((char *)ws + 256);
    uint32_t *cnt = hist + 256;
    tk_init_kernel<<<1, 256, 0, s>>>(st, hist, (uint32_t)K);
    KVZ_LAUNCH_CHECK("topk_init");
    int hb = (int)((n + 255) / 256);
    if (hb > 1024) hb = 1024;
    for (int shift = 24; shift >= 0; shift -= 8) {
        tk_hist_kernel<<<hb, 256, 0, s>>>(scores, n, shift, st, hist);
        KVZ_LAUNCH_CHECK("topk_hist");
        tk_pick_kernel<<<1, 32, 0, s>>>(shift, st, hist);
        KVZ_LAUNCH_CHECK("topk_pick");
    }
    int nb = (int)((n + TK_CHUNK - 1) / TK_CHUNK);
    tk_eqcount_kernel<<<nb, 256, 0, s>>>(scores, n, st, cnt);
    KVZ_LAUNCH_CHECK("topk_eqcount");
    tk_scan_kernel<<<1, 256, 0, s>>>(cnt, nb);
    KVZ_LAUNCH_CHECK("topk_scan");
    tk_mask_kernel<<<nb, 256, 0, s>>>(scores, n, st, cnt, keep);
    KVZ_LAUNCH_CHECK("topk_mask");
    return 0;
}

/* ---------------------------------------------------------------- per row */
__global__ void tk_rows_kernel(const float *__restrict__ x, int n_cols, int k, uint8_t *__restrict__ keep)
{
    __shared__ uint32_t hist[256];
    __shared__ uint32_t s_prefix, s_mask, s_k;
    const float *row = x + (size_t)blockIdx.x * n_cols;
    uint8_t *kr = keep + (size_t)blockIdx.x * n_cols;
    if (k <= 0 || k >= n_cols) {
        for (int i = threadIdx.x; i < n_cols; i += blockDim.x) kr[i] = k > 0;
        return;
    }
    if (threadIdx.x == 0) { s_prefix = 0; s_mask = 0; s_k = (uint32_t)k; }
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (threadIdx.x < 256) hist[threadIdx.x] = 0;
        __syncthreads();
        uint32_t prefix = s_prefix, mask = s_mask;
        for (int i = threadIdx.x; i < n_cols; i += blockDim.x) {
            uint32_t b = __float_as_uint(row[i]);
            if ((b & mask) == prefix) atomicAdd(&hist[(b >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t kk = s_k, cum = 0;
            int b = 255;
            for (; b > 0; b--) {
                if (cum + hist[b] >= kk) break;
                cum += hist[b];
            }
            s_prefix |= (uint32_t)b << shift;
            s_mask |= 255u << shift;
            s_k = kk - cum;
        }
        __syncthreads();
    }
    uint32_t thr = s_prefix, need = s_k, base = 0;
    /* ordered pass, 256-thread blocks: each thread one element per step */
    for (int c0 = 0; c0 < n_cols; c0 += blockDim.x) {
        int i = c0 + threadIdx.x;
        uint32_t b = i < n_cols ? __float_as_uint(row[i]) : 0u;
        uint32_t eq = i < n_cols && b == thr, tot;
        uint32_t r = base + tk_block_excl_scan(eq, &tot);
        if (i < n_cols) kr[i] = b > thr || (eq && r < need);
        base += tot;
        __syncthreads();
    }
}

extern "C" int kvz_cuda_topk_rows(cudaStream_t s, const float *scores, int n_rows, int n_cols, int k,
                                  uint8_t *keep)
{
    KVZ_ARG(n_rows >= 0 && n_cols > 0 && k >= 0 && k <= n_cols && (n_rows == 0 || (scores && keep)));
    if (n_rows == 0) return 0;
    tk_rows_kernel<<<n_rows, 256, 0, s>>>(scores, n_cols, k, keep);
    KVZ_LAUNCH_CHECK("topk_rows");
    return 0;
}

__global__ void keep_count_kernel(const uint8_t *__restrict__ keep, int n_cols, int32_t *counts)
{
    const uint8_t *r = keep + (size_t)blockIdx.x * n_cols;
    int c = 0;
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) c += r[i] != 0;
    c = (int)kvz_block_sum((float)c);
    if (threadIdx.x == 0) counts[blockIdx.x] = c;
}

extern "C" int kvz_cuda_keep_counts(cudaStream_t s, const uint8_t *keep, int n_rows, int n_cols,
                                    int32_t *counts)
{
    KVZ_ARG(n_rows >= 0 && n_cols >= 0 && (n_rows == 0 || (keep && counts)));
    if (n_rows == 0) return 0;
    if (n_cols == 0) { KVZ_CUDA_TRY(cudaMemsetAsync(counts, 0, (size_t)n_rows * 4, s)); return 0; }
    keep_count_kernel<<<n_rows, 256, 0, s>>>(keep, n_cols, counts);
    KVZ_LAUNCH_CHECK("keep_counts");
    return 0;
}
