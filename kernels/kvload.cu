/* Stored KV rows -> the bf16 device cache in one kernel (the load path), and the
 * reverse for the quantized types (the ingest path's export).
 *
 * Stored row layouts: common/kvz_kvdtype.h (f32, f16, bf16, q8, q4). Every row is
 * self-contained, so the input is the flat head-major array of one layer exactly as
 * the blob decoder writes it (head h's rows start at off[h]) and each thread owns 8
 * elements of one row: it reads the row's scale(s), dequantises in fp32 and stores 16
 * bytes of bf16 (round to nearest even, the same bits as runtime/kvz_quant.c
 * kvz_fp32_to_bf16 of the same fp32 value). */
#include <unistd.h>

#include "kvz_cuda_common.cuh"
#include "kvz_cuda_verify.h"
#include "kvz_kvdtype.h"

#define LOAD_MAX_KV 64
struct load_args { int off[LOAD_MAX_KV + 1]; };

__device__ __forceinline__ float ld_f16(const uint8_t *p)
{
    const uint16_t u = (uint16_t)p[0] | (uint16_t)p[1] << 8;
    return __half2float(__ushort_as_half(u));
}

/* 8 elements [e0, e0+8) of one stored row -> fp32 */
template <int DT>
__device__ __forceinline__ void row8(const uint8_t *row, int hd, int e0, float *x)
{
    if (DT == KVZ_KV_F32) {
        const float4 *p = (const float4 *)(row + 4 * e0);
        const float4 a = p[0], b = p[1];
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
        x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
    } else if (DT == KVZ_KV_F16 || DT == KVZ_KV_BF16) {
        const uint4 v = *(const uint4 *)(row + 2 * e0);
        const uint16_t *h = (const uint16_t *)&v;
#pragma unroll
        for (int i = 0; i < 8; i++)
            x[i] = DT == KVZ_KV_F16 ? __half2float(__ushort_as_half(h[i])) : __uint_as_float((uint32_t)h[i] << 16);
    } else if (DT == KVZ_KV_Q8) {
        const int ng = hd / KVZ_KV_QGROUP;
        const float d = ld_f16(row + 2 * (e0 / KVZ_KV_QGROUP));
        const int8_t *q = (const int8_t *)(row + 2 * ng + e0);
#pragma unroll
        for (int i = 0; i < 8; i++) x[i] = d * (float)q[i];
    } else { /* Q4 */
        const int ng = hd / KVZ_KV_QGROUP, g = e0 / KVZ_KV_QGROUP;
        const float d = ld_f16(row + 4 * g), m = ld_f16(row + 4 * g + 2);
        const uint8_t *q = row + 4 * ng + e0 / 2;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            x[2 * i] = __fmaf_rn(d, (float)(q[i] & 15), m); /* one rounding: fmaf on the host too */
            x[2 * i + 1] = __fmaf_rn(d, (float)(q[i] >> 4), m);
        }
    }
}

/* 1 when the scale block of elements [e0, e0+8) of a q8/q4 row is one kvz_kvrow_check
 * refuses (format/kvz_kvrow.c chk_q8/chk_q4, on the f16 bits): a scale with the sign bit
 * set or exponent all ones (NaN, Inf, negative, -0), a q4 m that is NaN or Inf, a q8 -128.
 * Every scale of a row is read by the threads of its group and every q8 value by one
 * thread, so the threads of a row together check all of it. */
template <int DT>
__device__ __forceinline__ bool row8_bad(const uint8_t *row, int hd, int e0)
{
    const int ng = hd / KVZ_KV_QGROUP, g = e0 / KVZ_KV_QGROUP;
    if (DT == KVZ_KV_Q8) {
        const uint16_t dh = (uint16_t)row[2 * g] | (uint16_t)row[2 * g + 1] << 8;
        bool bad = (dh & 0x8000) || (dh & 0x7c00) == 0x7c00;
        const uint8_t *q = row + 2 * ng + e0;
#pragma unroll
        for (int i = 0; i < 8; i++) bad |= q[i] == 0x80;
        return bad;
    }
    if (DT == KVZ_KV_Q4) {
        const uint16_t dh = (uint16_t)row[4 * g] | (uint16_t)row[4 * g + 1] << 8;
        const uint16_t mh = (uint16_t)row[4 * g + 2] | (uint16_t)row[4 * g + 3] << 8;
        return (dh & 0x8000) || (dh & 0x7c00) == 0x7c00 || (mh & 0x7c00) == 0x7c00;
    }
    return false;
}

/* grid (blocks, n_kv): block row y = head h; threads stride over its rows x (hd/8).
 * bad != NULL (q8/q4): the first bad row's index in the record (K rows, then V rows)
 * is atomicMin'd into *bad. */
template <int DT>
__global__ void kv_load_kernel(kvz_cuda_kv kv, load_args la, size_t row_bytes, const uint8_t *__restrict__ ks,
                               const uint8_t *__restrict__ vs, const uint32_t *__restrict__ ps, int row0,
                               unsigned long long *bad)
{
    const int h = blockIdx.y, vpr = kv.hd / 8;
    const int r0 = la.off[h], n = la.off[h + 1] - r0;
    uint4 *dk = (uint4 *)kv.k + ((size_t)h * kv.cap + row0) * vpr;
    uint4 *dv = (uint4 *)kv.v + ((size_t)h * kv.cap + row0) * vpr;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n * vpr; i += gridDim.x * blockDim.x) {
        const int r = i / vpr, e0 = (i - r * vpr) * 8;
        const size_t src = (size_t)(r0 + r) * row_bytes;
#pragma unroll
        for (int w = 0; w < 2; w++) {
            float x[8];
            if ((DT == KVZ_KV_Q8 || DT == KVZ_KV_Q4) && bad && row8_bad<DT>((w ? vs : ks) + src, kv.hd, e0))
                atomicMin(bad, (unsigned long long)(w ? la.off[kv.n_kv] : 0) + (unsigned long long)(r0 + r));
            row8<DT>((w ? vs : ks) + src, kv.hd, e0, x);
            uint4 o;
            __nv_bfloat16 *b = (__nv_bfloat16 *)&o;
#pragma unroll
            for (int e = 0; e < 8; e++) b[e] = __float2bfloat16_rn(x[e]);
            (w ? dv : dk)[i] = o;
        }
        if (e0 == 0) kv.pos[(size_t)h * kv.cap + row0 + r] = (int32_t)ps[r0 + r];
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) kv.len[h] = row0 + n;
}

extern "C" int kvz_cuda_kv_load(cudaStream_t s, const kvz_cuda_kv *kv, int dtype, const int32_t *rows, int32_t row0,
                                const void *k_src, const void *v_src, const uint32_t *pos_src)
{
    return kvz_cuda_kv_load_checked(s, kv, dtype, rows, row0, k_src, v_src, pos_src, NULL);
}

extern "C" int kvz_cuda_kv_load_checked(cudaStream_t s, const kvz_cuda_kv *kv, int dtype, const int32_t *rows,
                                        int32_t row0, const void *k_src, const void *v_src, const uint32_t *pos_src,
                                        unsigned long long *bad)
{
    KVZ_ARG(row0 >= 0);
    KVZ_ARG(kv && kv->k && kv->v && kv->pos && kv->len && rows && k_src && v_src && pos_src);
    KVZ_ARG(kv->n_kv > 0 && kv->n_kv <= LOAD_MAX_KV && kv->hd % 8 == 0);
    const size_t rb = kvz_kv_row_bytes(dtype, (size_t)kv->hd);
    KVZ_ARG(rb != 0);
    if (dtype == KVZ_KV_F32 || dtype == KVZ_KV_F16 || dtype == KVZ_KV_BF16)
        KVZ_ARG(((uintptr_t)k_src & 15) == 0 && ((uintptr_t)v_src & 15) == 0);
    load_args la;
    int mx = 0;
    la.off[0] = 0;
    for (int h = 0; h < kv->n_kv; h++) {
        KVZ_ARG(rows[h] >= 0 && (int64_t)row0 + rows[h] <= kv->cap);
        la.off[h + 1] = la.off[h] + rows[h];
        mx = rows[h] > mx ? rows[h] : mx;
    }
    int blocks = (mx * (kv->hd / 8) + 255) / 256;
    if (blocks < 1) blocks = 1;
    if (blocks > 1024) blocks = 1024;
    dim3 grid(blocks, kv->n_kv);
    const uint8_t *ks = (const uint8_t *)k_src, *vs = (const uint8_t *)v_src;
    switch (dtype) {
    case KVZ_KV_F32: kv_load_kernel<KVZ_KV_F32><<<grid, 256, 0, s>>>(*kv, la, rb, ks, vs, pos_src, row0, bad); break;
    case KVZ_KV_F16: kv_load_kernel<KVZ_KV_F16><<<grid, 256, 0, s>>>(*kv, la, rb, ks, vs, pos_src, row0, bad); break;
    case KVZ_KV_BF16: kv_load_kernel<KVZ_KV_BF16><<<grid, 256, 0, s>>>(*kv, la, rb, ks, vs, pos_src, row0, bad); break;
    case KVZ_KV_Q8: kv_load_kernel<KVZ_KV_Q8><<<grid, 256, 0, s>>>(*kv, la, rb, ks, vs, pos_src, row0, bad); break;
    default: kv_load_kernel<KVZ_KV_Q4><<<grid, 256, 0, s>>>(*kv, la, rb, ks, vs, pos_src, row0, bad); break;
    }
    KVZ_LAUNCH_CHECK("kv_load");
    return 0;
}

/* ---------------------------------------------------------------- quantized export */

/* f16 bits of a scale, saturated at +-65504 as format/kvz_kvrow.c does (finite input,
 * finite scale) */
__device__ __forceinline__ uint16_t f2h_bits(float f)
{
    return __half_as_ushort(__float2half_rn(fminf(fmaxf(f, -65504.f), 65504.f)));
}

/* one thread per row (K and V: blockIdx.z), its groups in turn, every byte of the row
 * written by that thread through aligned 4-byte stores (byte stores of the scales from
 * one thread per group came out with the low byte zero on the H200; not understood) */
template <int DT>
__global__ void kv_export_q_kernel(kvz_cuda_kv kv, load_args la, size_t row_bytes, uint8_t *__restrict__ ko,
                                   uint8_t *__restrict__ vo, uint32_t *__restrict__ po)
{
    const int h = blockIdx.y, gpr = kv.hd / KVZ_KV_QGROUP, w = blockIdx.z;
    const int r0 = la.off[h], n = la.off[h + 1] - r0;
    const __nv_bfloat16 *src = (const __nv_bfloat16 *)(w ? kv.v : kv.k) + (size_t)h * kv.cap * kv.hd;
    uint8_t *out = w ? vo : ko;
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += gridDim.x * blockDim.x) {
        uint32_t *row = (uint32_t *)(out + (size_t)(r0 + r) * row_bytes); /* 4-byte aligned: checked by the caller */
        uint32_t sw = 0; /* scale words being assembled */
        for (int g = 0; g < gpr; g++) {
            const __nv_bfloat16 *p = src + (size_t)r * kv.hd + g * KVZ_KV_QGROUP;
            float x[32];
#pragma unroll
            for (int e = 0; e < 32; e++) x[e] = __bfloat162float(p[e]);
            if (DT == KVZ_KV_Q8) {
                float mx = 0.f;
#pragma unroll
                for (int e = 0; e < 32; e++) mx = fmaxf(mx, fabsf(x[e]));
                const uint32_t dh = f2h_bits(mx / 127.f);
                const float d = __half2float(__ushort_as_half((unsigned short)dh));
                if (g & 1) row[g / 2] = sw | dh << 16; /* scales: 2 per word */
                else sw = dh;
                uint32_t *q = row + gpr / 2 + g * 8;
#pragma unroll
                for (int e = 0; e < 32; e += 4) {
                    uint32_t word = 0;
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        float t = d > 0.f ? roundf(x[e + k] / d) : 0.f; /* roundf: half away from zero */
                        t = fminf(fmaxf(t, -127.f), 127.f);
                        word |= ((uint32_t)(int)t & 0xffu) << (8 * k);
                    }
                    q[e / 4] = word;
                }
            } else {
                float lo = x[0], hi = x[0];
#pragma unroll
                for (int e = 1; e < 32; e++) { /* comparisons as kvz_kvrow.c (-0 vs +0 kept) */
                    if (x[e] < lo) lo = x[e];
                    if (x[e] > hi) hi = x[e];
                }
                const uint32_t dh = f2h_bits((hi - lo) / 15.f), mh = f2h_bits(lo);
                const float d = __half2float(__ushort_as_half((unsigned short)dh));
                const float m = __half2float(__ushort_as_half((unsigned short)mh));
                row[g] = dh | mh << 16;
                uint32_t *q = row + gpr + g * 4;
#pragma unroll
                for (int e = 0; e < 32; e += 8) {
                    uint32_t word = 0;
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        float t = d > 0.f ? roundf((x[e + k] - m) / d) : 0.f;
                        t = fminf(fmaxf(t, 0.f), 15.f);
                        word |= (uint32_t)(int)t << (4 * k);
                    }
                    q[e / 8] = word;
                }
            }
        }
        if (w == 0) po[r0 + r] = (uint32_t)kv.pos[(size_t)h * kv.cap + r];
    }
}

extern "C" int kvz_cuda_kv_export_q(cudaStream_t s, const kvz_cuda_kv *kv, int dtype, const int32_t *rows,
                                    void *k_out, void *v_out, uint32_t *pos_out)
{
    KVZ_ARG(kv && kv->k && kv->v && kv->pos && rows && k_out && v_out && pos_out);
    KVZ_ARG(dtype == KVZ_KV_Q8 || dtype == KVZ_KV_Q4);
    KVZ_ARG(kv->n_kv > 0 && kv->n_kv <= LOAD_MAX_KV && kv->hd % (2 * KVZ_KV_QGROUP) == 0);
    KVZ_ARG(((uintptr_t)k_out & 3) == 0 && ((uintptr_t)v_out & 3) == 0);
    const size_t rb = kvz_kv_row_bytes(dtype, (size_t)kv->hd);
    load_args la;
    int mx = 0;
    la.off[0] = 0;
    for (int h = 0; h < kv->n_kv; h++) {
        KVZ_ARG(rows[h] >= 0 && rows[h] <= kv->cap);
        la.off[h + 1] = la.off[h] + rows[h];
        mx = rows[h] > mx ? rows[h] : mx;
    }
    if (mx == 0) return 0;
    int blocks = (mx + 127) / 128;
    if (blocks > 1024) blocks = 1024;
    dim3 grid(blocks, kv->n_kv, 2);
    if (dtype == KVZ_KV_Q8)
        kv_export_q_kernel<KVZ_KV_Q8><<<grid, 128, 0, s>>>(*kv, la, rb, (uint8_t *)k_out, (uint8_t *)v_out, pos_out);
    else
        kv_export_q_kernel<KVZ_KV_Q4><<<grid, 128, 0, s>>>(*kv, la, rb, (uint8_t *)k_out, (uint8_t *)v_out, pos_out);
    KVZ_LAUNCH_CHECK("kv_export_q");
    return 0;
}

extern "C" int kvz_cuda_host_register(const void *p, size_t n, void **base)
{
    KVZ_ARG(p && n && base);
    const long pg = sysconf(_SC_PAGESIZE);
    const uintptr_t ps = pg > 0 ? (uintptr_t)pg : 4096;
    const uintptr_t lo = (uintptr_t)p & ~(ps - 1), hi = ((uintptr_t)p + n + ps - 1) & ~(ps - 1);
    const cudaError_t e = cudaHostRegister((void *)lo, hi - lo, cudaHostRegisterPortable | cudaHostRegisterReadOnly);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *base = NULL;
        return kvz_error_set(KVZ_ERR_CUDA, "cudaHostRegister of %zu bytes: %s", (size_t)(hi - lo), cudaGetErrorString(e));
    }
    *base = (void *)lo;
    return 0;
}

extern "C" void kvz_cuda_host_unregister(void *base)
{
    if (base && cudaHostUnregister(base) != cudaSuccess) cudaGetLastError();
}
