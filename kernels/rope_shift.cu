/* Re-rotation of cached bf16 keys by a per-document angle table (kvz_rope_shift_cuda.h).
 *
 * Grid (n_seg, y): block x = one segment, its rows strided over the y blocks. A thread
 * owns 8 elements: adjacent layout, one 16-byte chunk = 4 pairs; half-split layout
 * (hd % 16 == 0), chunk c of the first half with chunk c of the second = 8 pairs; any
 * other even hd falls back to one pair per thread. Per element: bf16 -> fp32, the
 * rotation x0·c − x1·s, x0·s + x1·c (as runtime/kvz_rope_shift.c), × key_scale, one
 * rounding to bf16. Memory-bound: 4 bytes read + written per key element. */
#include "kvz_cuda_common.cuh"
#include "kvz_rope_shift_cuda.h"

__device__ __forceinline__ void rot(float a, float b, float c, float s, float ks, float *oa, float *ob)
{
    *oa = (a * c - b * s) * ks;
    *ob = (a * s + b * c) * ks;
}

__device__ __forceinline__ void unpack8(const uint4 &v, float *x)
{
    const __nv_bfloat16 *h = (const __nv_bfloat16 *)&v;
#pragma unroll
    for (int i = 0; i < 8; i++) x[i] = __bfloat162float(h[i]);
}

__device__ __forceinline__ uint4 pack8(const float *x)
{
    uint4 o;
    __nv_bfloat16 *b = (__nv_bfloat16 *)&o;
#pragma unroll
    for (int i = 0; i < 8; i++) b[i] = __float2bfloat16_rn(x[i]);
    return o;
}

/* MODE 0: adjacent, 8 elements; 1: half-split, 2 x 8 elements; 2: one pair (either layout) */
template <int MODE>
__global__ void rope_shift_kernel(bf16 *__restrict__ k, int64_t cap, int hd, int adjacent,
                                  const kvz_cuda_shift_seg *__restrict__ segs, const float *__restrict__ cs,
                                  const float *__restrict__ sn, float ks)
{
    const kvz_cuda_shift_seg sg = segs[blockIdx.x];
    const int half = hd / 2;
    const int units = MODE == 0 ? hd / 8 : MODE == 1 ? hd / 16 : half; /* threads per row */
    const float *c = cs + (size_t)sg.doc * half, *s = sn + (size_t)sg.doc * half;
    bf16 *base = k + ((size_t)sg.lh * cap + sg.row0) * hd;
    const int64_t n = (int64_t)sg.n * units;
    for (int64_t i = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.y * blockDim.x) {
        const int64_t r = i / units;
        const int u = (int)(i - r * units);
        bf16 *x = base + r * hd;
        if (MODE == 0) {
            uint4 *p = (uint4 *)(x + 8 * u);
            float v[8], o[8];
            unpack8(*p, v);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int j = 4 * u + q;
                rot(v[2 * q], v[2 * q + 1], c[j], s[j], ks, &o[2 * q], &o[2 * q + 1]);
            }
            *p = pack8(o);
        } else if (MODE == 1) {
            uint4 *pa = (uint4 *)(x + 8 * u), *pb = (uint4 *)(x + half + 8 * u);
            float a[8], b[8], oa[8], ob[8];
            unpack8(*pa, a);
            unpack8(*pb, b);
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int j = 8 * u + q;
                rot(a[q], b[q], c[j], s[j], ks, &oa[q], &ob[q]);
            }
            *pa = pack8(oa);
            *pb = pack8(ob);
        } else {
            const int ia = adjacent ? 2 * u : u, ib = adjacent ? 2 * u + 1 : u + half;
            float oa, ob;
            rot(__bfloat162float(x[ia]), __bfloat162float(x[ib]), c[u], s[u], ks, &oa, &ob);
            x[ia] = __float2bfloat16_rn(oa);
            x[ib] = __float2bfloat16_rn(ob);
        }
    }
}

extern "C" int kvz_cuda_rope_shift_rows(cudaStream_t s, void *k, int64_t cap, int hd, int adjacent,
                                        const kvz_cuda_shift_seg *segs, int n_seg, int32_t max_rows, const float *cs,
                                        const float *sn, float key_scale)
{
    KVZ_ARG(hd > 0 && hd % 2 == 0 && hd <= 512 && cap > 0 && n_seg >= 0 && max_rows >= 0);
    if (n_seg == 0 || max_rows == 0) return 0;
    KVZ_ARG(k && segs && cs && sn && ((uintptr_t)k & 15) == 0);
    const int mode = adjacent && hd % 8 == 0 ? 0 : !adjacent && hd % 16 == 0 ? 1 : 2;
    const int units = mode == 0 ? hd / 8 : mode == 1 ? hd / 16 : hd / 2;
    int64_t yb = ((int64_t)max_rows * units + 255) / 256;
    if (yb > 1024) yb = 1024;
    dim3 grid((unsigned)n_seg, (unsigned)yb);
    bf16 *kb = (bf16 *)k;
    if (mode == 0) rope_shift_kernel<0><<<grid, 256, 0, s>>>(kb, cap, hd, adjacent, segs, cs, sn, key_scale);
    else if (mode == 1) rope_shift_kernel<1><<<grid, 256, 0, s>>>(kb, cap, hd, adjacent, segs, cs, sn, key_scale);
    else rope_shift_kernel<2><<<grid, 256, 0, s>>>(kb, cap, hd, adjacent, segs, cs, sn, key_scale);
    KVZ_LAUNCH_CHECK("rope_shift");
    return 0;
}
