/* Shared between the flash-attention translation units: the kernel parameters (key
 * segments, modes), the KVzip subset test and the per-block tile list. */
#pragma once
#include <float.h>
#include <limits.h>

#include "kvz_cuda_common.cuh"

enum { FA_OUT = 0, FA_STATS = 1, FA_SCORE = 2 };
#define FA_MAXSEG 4

struct fa_params {
    const bf16 *q;
    int ldq;
    const int32_t *qpos;
    int T, G, n_head;
    kvz_cuda_kv kv;
    int n_cseg;             /* cache segments */
    int lo[3], hi[3];       /* hi < 0 → len[h] */
    int sorted[3];          /* segment positions non-decreasing → causal cut */
    kvz_cuda_outbuf ob;     /* ob.k == NULL → none */
    bf16 *o;
    int ldo;
    float *ml;              /* (T·n_head, 2) */
    float *score;
    int ld_score, c0;
    float scale_log2;
    /* FA_OUT only: KVzip subset statistics. When ml_sub != NULL every query row also
     * gets (m, l̄): m its max over all visible keys, l̄ = Σ exp2(s - m) over the visible
     * cache rows in [0,sub_np) ∪ [sub_c0,sub_c1) ∪ [sub_rep0, ∞), the softmax
     * denominator of the key subset K̄ expressed at the full row max (same ratio). */
    float *ml_sub;
    int sub_np, sub_c0, sub_c1, sub_rep0;
};

static __device__ __forceinline__ bool fa_in_subset(const fa_params &p, int row)
{
    return row < p.sub_np || (row >= p.sub_c0 && row < p.sub_c1) || row >= p.sub_rep0;
}

/* Block set-up shared by both prefill kernels: the largest query position among rows
 * [r0, r0+bm) (so sorted segments can stop at the causal edge) and the tile list:
 * segment s covers tiles [seg_t0[s], seg_t0[s+1]) of bn keys; seg_t0[FA_MAXSEG] = total.
 * scratch: one int of shared memory. Contains __syncthreads. */
static __device__ void fa_block_segments(const fa_params &p, int h, int r0, int bm, int bn, int *seg_lo, int *seg_n,
                                  int *seg_t0, int *scratch)
{
    const int nrows = p.T * p.G, len_h = p.kv.len[h];
    if (threadIdx.x == 0) *scratch = INT_MIN;
    __syncthreads();
    int mq = INT_MIN;
    for (int r = r0 + threadIdx.x; r < min(r0 + bm, nrows); r += blockDim.x) mq = max(mq, p.qpos[r / p.G]);
    mq = __reduce_max_sync(0xffffffffu, mq);
    if ((threadIdx.x & 31) == 0) atomicMax(scratch, mq);
    __syncthreads();
    if (threadIdx.x == 0) {
        const int m = *scratch;
        int ns = 0, t0 = 0;
        for (int s = 0; s < p.n_cseg; s++) {
            int lo = p.lo[s], hi = p.hi[s] < 0 ? len_h : min(p.hi[s], len_h);
            int n = max(hi - lo, 0);
            if (n > 0 && p.sorted[s]) { /* first row with pos > maxq */
                const int32_t *P = p.kv.pos + (size_t)h * p.kv.cap;
                int a = lo, b = hi;
                while (a < b) { int c = (a + b) >> 1; if (P[c] <= m) a = c + 1; else b = c; }
                n = a - lo;
            }
            seg_lo[ns] = lo; seg_n[ns] = n; seg_t0[ns] = t0;
            t0 += (n + bn - 1) / bn; ns++;
        }
        if (p.ob.k) {
            seg_lo[ns] = 0; seg_n[ns] = p.ob.n_slot; seg_t0[ns] = t0;
            t0 += (p.ob.n_slot + bn - 1) / bn; ns++;
        }
        for (int s = ns; s <= FA_MAXSEG; s++) seg_t0[s] = t0;
    }
    __syncthreads();
}

/* sm_90a kernels (fattn_sm90.cu). Returns 0 when launched, a negative KVZ_ERR_* on
 * error, 1 when it does not apply (no Hopper, not built for sm_90a, KVZ_CUDA_FA=mma,
 * unaligned q, or FA_STATS): the caller then runs the mma.sync kernel. */
int fa_sm90_dispatch(const fa_params &p, int mode, cudaStream_t s);
