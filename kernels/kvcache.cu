/* Writes into the head-major KV cache. Rows are hd bf16 = hd/8 16-byte vectors. */
#include "kvz_cuda_common.cuh"

typedef uint4 vec16; /* 8 bf16 */

/* grid (T, n_kv); block copies one row of K and V. */
__global__ void kv_append_kernel(kvz_cuda_kv kv, int T, const bf16 *__restrict__ kn, int ldk,
                                 const bf16 *__restrict__ vn, int ldv, const int32_t *__restrict__ pos)
{
    int t = blockIdx.x, h = blockIdx.y;
    int row = kv.len[h] + t;
    if (row >= kv.cap) return;
    size_t dst = ((size_t)h * kv.cap + row) * kv.hd;
    const bf16 *ks = kn + (size_t)t * ldk + (size_t)h * kv.hd;
    const bf16 *vs = vn + (size_t)t * ldv + (size_t)h * kv.hd;
    bf16 *kd = (bf16 *)kv.k + dst, *vd = (bf16 *)kv.v + dst;
    for (int i = threadIdx.x; i < kv.hd; i += blockDim.x) { kd[i] = ks[i]; vd[i] = vs[i]; }
    if (threadIdx.x == 0) kv.pos[(size_t)h * kv.cap + row] = pos[t];
}

__global__ void kv_bump_kernel(int32_t *len, int n_kv, int T, int cap)
{
    int h = blockIdx.x * blockDim.x + threadIdx.x;
    if (h < n_kv) len[h] = min(len[h] + T, cap);
}

extern "C" int kvz_cuda_kv_append(cudaStream_t s, const kvz_cuda_kv *kv, int T, const void *k_new,
                                  int ldk, const void *v_new, int ldv, const int32_t *pos)
{
    KVZ_ARG(kv && kv->k && kv->v && kv->pos && kv->len && kv->n_kv > 0 && kv->cap > 0 && kv->hd > 0);
    KVZ_ARG(k_new && v_new && pos && T >= 0 && ldk >= kv->n_kv * kv->hd && ldv >= kv->n_kv * kv->hd);
    if (T == 0) return 0;
    KVZ_ARG(kv->n_kv <= 65535);
    kv_append_kernel<<<dim3(T, kv->n_kv), 64, 0, s>>>(*kv, T, (const bf16 *)k_new, ldk,
                                                      (const bf16 *)v_new, ldv, pos);
    KVZ_LAUNCH_CHECK("kv_append");
    kv_bump_kernel<<<(kv->n_kv + 127) / 128, 128, 0, s>>>(kv->len, kv->n_kv, T, kv->cap);
    KVZ_LAUNCH_CHECK("kv_bump");
    return 0;
}

/* grid (T, n_kv). */
__global__ void outbuf_write_kernel(kvz_cuda_outbuf ob, int hd, const bf16 *__restrict__ kn, int ldk,
                                    const bf16 *__restrict__ vn, int ldv,
                                    const int32_t *__restrict__ pos, int slot0, const int32_t *d_slot)
{
    int t = blockIdx.x, h = blockIdx.y;
    int slot = slot0 >= 0 ? slot0 + t : *d_slot;
    if (slot < 0 || slot >= ob.n_slot) return;
    size_t dst = ((size_t)h * ob.n_slot + slot) * hd;
    const bf16 *ks = kn + (size_t)t * ldk + (size_t)h * hd;
    const bf16 *vs = vn + (size_t)t * ldv + (size_t)h * hd;
    bf16 *kd = (bf16 *)ob.k + dst, *vd = (bf16 *)ob.v + dst;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) { kd[i] = ks[i]; vd[i] = vs[i]; }
    if (threadIdx.x == 0 && h == 0) ob.slot_pos[slot] = pos[t];
}

extern "C" int kvz_cuda_outbuf_write(cudaStream_t s, const kvz_cuda_outbuf *ob, int n_kv, int hd,
                                     int T, const void *k_new, int ldk, const void *v_new, int ldv,
                                     const int32_t *pos, int slot, const int32_t *d_slot)
{
    KVZ_ARG(ob && ob->k && ob->v && ob->slot_pos && ob->n_slot > 0 && n_kv > 0 && hd > 0);
    KVZ_ARG(k_new && v_new && pos && T >= 0 && ldk >= n_kv * hd && ldv >= n_kv * hd);
    KVZ_ARG(slot >= 0 ? slot + T <= ob->n_slot : (d_slot != NULL && T <= 1));
    if (T == 0) return 0;
    outbuf_write_kernel<<<dim3(T, n_kv), 64, 0, s>>>(*ob, hd, (const bf16 *)k_new, ldk,
                                                     (const bf16 *)v_new, ldv, pos, slot, d_slot);
    KVZ_LAUNCH_CHECK("outbuf_write");
    return 0;
}

/* grid (1, n_kv): slot from device memory (fill slot, else the LongFlow victim). */
__global__ void outbuf_write_dev_kernel(kvz_cuda_outbuf ob, int hd, const bf16 *__restrict__ kn, int ldk,
                                        const bf16 *__restrict__ vn, int ldv,
                                        const int32_t *__restrict__ pos, const int32_t *d_fill,
                                        const int32_t *d_evict)
{
    const int f = *d_fill;
    int h = blockIdx.y;
    int slot = f >= 0 ? f : *d_evict;
    if (slot < 0 || slot >= ob.n_slot) return;
    size_t dst = ((size_t)h * ob.n_slot + slot) * hd;
    const bf16 *ks = kn + (size_t)h * hd, *vs = vn + (size_t)h * hd;
    bf16 *kd = (bf16 *)ob.k + dst, *vd = (bf16 *)ob.v + dst;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) { kd[i] = ks[i]; vd[i] = vs[i]; }
    if (threadIdx.x == 0 && h == 0) ob.slot_pos[slot] = pos[0];
    (void)ldk; (void)ldv;
}

extern "C" int kvz_cuda_outbuf_write_dev(cudaStream_t s, const kvz_cuda_outbuf *ob, int n_kv, int hd,
                                         const void *k_new, int ldk, const void *v_new, int ldv,
                                         const int32_t *pos, const int32_t *d_fill, const int32_t *d_evict)
{
    KVZ_ARG(ob && ob->k && ob->v && ob->slot_pos && ob->n_slot > 0 && n_kv > 0 && hd > 0);
    KVZ_ARG(k_new && v_new && pos && d_fill && d_evict && ldk >= n_kv * hd && ldv >= n_kv * hd);
    outbuf_write_dev_kernel<<<dim3(1, n_kv), 64, 0, s>>>(*ob, hd, (const bf16 *)k_new, ldk,
                                                         (const bf16 *)v_new, ldv, pos, d_fill, d_evict);
    KVZ_LAUNCH_CHECK("outbuf_write_dev");
    return 0;
}

/* grid (n_seq, n_kv): sequence z's token into its own buffer (kvz_cuda_outbuf_write_multi) */
__global__ void outbuf_write_multi_kernel(int hd, const bf16 *__restrict__ kn, int ldk, const bf16 *__restrict__ vn,
                                          int ldv, const int32_t *__restrict__ pos,
                                          const kvz_cuda_seq *__restrict__ seq)
{
    const int z = blockIdx.x, h = blockIdx.y;
    const kvz_cuda_outbuf ob = seq[z].ob;
    if (!ob.k) return;
    int slot = seq[z].slot;
    if (slot < 0) slot = seq[z].evict ? *seq[z].evict : -1;
    if (slot < 0 || slot >= ob.n_slot) return;
    const size_t dst = ((size_t)h * ob.n_slot + slot) * hd;
    const bf16 *ks = kn + (size_t)z * ldk + (size_t)h * hd;
    const bf16 *vs = vn + (size_t)z * ldv + (size_t)h * hd;
    bf16 *kd = (bf16 *)ob.k + dst, *vd = (bf16 *)ob.v + dst;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) { kd[i] = ks[i]; vd[i] = vs[i]; }
    if (threadIdx.x == 0 && h == 0) ob.slot_pos[slot] = pos[z];
}

extern "C" int kvz_cuda_outbuf_write_multi(cudaStream_t s, int n_seq, int n_kv, int hd, const void *k_new, int ldk,
                                           const void *v_new, int ldv, const int32_t *pos, const kvz_cuda_seq *seq)
{
    KVZ_ARG(n_seq > 0 && n_kv > 0 && n_kv <= 65535 && hd > 0);
    KVZ_ARG(k_new && v_new && pos && seq && ldk >= n_kv * hd && ldv >= n_kv * hd);
    outbuf_write_multi_kernel<<<dim3(n_seq, n_kv), 64, 0, s>>>(hd, (const bf16 *)k_new, ldk, (const bf16 *)v_new,
                                                               ldv, pos, seq);
    KVZ_LAUNCH_CHECK("outbuf_write_multi");
    return 0;
}

/* ---------------------------------------------------------------- export */
/* fp32 -> fp16 bits, round to nearest even: runtime/kvz_quant.c kvz_fp32_to_fp16, verbatim */
__device__ __forceinline__ uint16_t d_f32_to_f16(float f)
{
    uint32_t u = __float_as_uint(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);
    if (a < 0x38800000u) {
        if (a < 0x33000000u) return sign;
        uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = a - (112u << 23);
    r += 0xfff + ((r >> 13) & 1);
    return (uint16_t)(sign | (r >> 13));
}

#define EXPORT_MAX_KV 64
struct export_args { int off[EXPORT_MAX_KV + 1]; };

/* grid (blocks, n_kv), 256 threads; one thread = 8 elements (one 16-byte source vector). */
template <int DT>
__global__ void kv_export_kernel(kvz_cuda_kv kv, export_args ea, void *k_out, void *v_out, int32_t *pos_out)
{
    const int h = blockIdx.y, vpr = kv.hd / 8;
    const int r0 = ea.off[h], n = ea.off[h + 1] - r0;
    const vec16 *sk = (const vec16 *)kv.k + (size_t)h * kv.cap * vpr;
    const vec16 *sv = (const vec16 *)kv.v + (size_t)h * kv.cap * vpr;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n * vpr; i += gridDim.x * blockDim.x) {
        const size_t o = (size_t)r0 * vpr + i; /* output vector index */
        for (int w = 0; w < 2; w++) {
            vec16 x = w ? sv[i] : sk[i];
            void *out = w ? v_out : k_out;
            if (DT == KVZ_CUDA_BF16) {
                ((vec16 *)out)[o] = x;
            } else {
                const __nv_bfloat16 *b = (const __nv_bfloat16 *)&x;
                if (DT == KVZ_CUDA_F32) {
                    float4 *f = (float4 *)out + 2 * o;
                    f[0] = make_float4(__bfloat162float(b[0]), __bfloat162float(b[1]), __bfloat162float(b[2]),
                                       __bfloat162float(b[3]));
                    f[1] = make_float4(__bfloat162float(b[4]), __bfloat162float(b[5]), __bfloat162float(b[6]),
                                       __bfloat162float(b[7]));
                } else {
                    uint16_t hv[8];
#pragma unroll
                    for (int e = 0; e < 8; e++) hv[e] = d_f32_to_f16(__bfloat162float(b[e]));
                    ((vec16 *)out)[o] = *(const vec16 *)hv;
                }
            }
        }
        if (i % vpr == 0) pos_out[r0 + i / vpr] = kv.pos[(size_t)h * kv.cap + i / vpr];
    }
}

extern "C" int kvz_cuda_kv_export(cudaStream_t s, const kvz_cuda_kv *kv, const int32_t *rows,
                                  kvz_cuda_dtype dt, void *k_out, void *v_out, int32_t *pos_out)
{
    KVZ_ARG(kv && kv->k && kv->v && kv->pos && rows && k_out && v_out && pos_out);
    KVZ_ARG(kv->n_kv > 0 && kv->n_kv <= EXPORT_MAX_KV && kv->hd % 8 == 0);
    KVZ_ARG(dt == KVZ_CUDA_F32 || dt == KVZ_CUDA_BF16 || dt == KVZ_CUDA_F16);
    KVZ_ARG(((uintptr_t)k_out & 15) == 0 && ((uintptr_t)v_out & 15) == 0);
    export_args ea;
    int mx = 0;
    ea.off[0] = 0;
    for (int h = 0; h < kv->n_kv; h++) {
        KVZ_ARG(rows[h] >= 0 && rows[h] <= kv->cap);
        ea.off[h + 1] = ea.off[h] + rows[h];
        mx = rows[h] > mx ? rows[h] : mx;
    }
    if (mx == 0) return 0;
    int blocks = (mx * (kv->hd / 8) + 255) / 256;
    if (blocks > 1024) blocks = 1024;
    dim3 grid(blocks, kv->n_kv);
    if (dt == KVZ_CUDA_BF16) kv_export_kernel<KVZ_CUDA_BF16><<<grid, 256, 0, s>>>(*kv, ea, k_out, v_out, pos_out);
    else if (dt == KVZ_CUDA_F16) kv_export_kernel<KVZ_CUDA_F16><<<grid, 256, 0, s>>>(*kv, ea, k_out, v_out, pos_out);
    else kv_export_kernel<KVZ_CUDA_F32><<<grid, 256, 0, s>>>(*kv, ea, k_out, v_out, pos_out);
    KVZ_LAUNCH_CHECK("kv_export");
    return 0;
}

/* ---------------------------------------------------------------- compaction */
#define COMPACT_CHUNK 1024

/* grid (ceil(n_ctx/CHUNK), n_kv), 256 threads. Each block recounts the kept rows of
 * the preceding chunks (a few KB of uint8), scans its own chunk, and copies rows.
 * Block x == 0 also copies the prefix rows and writes dst len. */
__global__ void kv_compact_kernel(kvz_cuda_kv src, kvz_cuda_kv dst, int n_prefix, int n_ctx,
                                  const uint8_t *__restrict__ keep)
{
    __shared__ int s_base;
    __shared__ int s_idx[COMPACT_CHUNK];
    __shared__ int s_wsum[8];
    int h = blockIdx.y, c0 = blockIdx.x * COMPACT_CHUNK;
    const uint8_t *kr = keep + (size_t)h * n_ctx;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;

    int cnt = 0;
    for (int i = threadIdx.x; i < c0; i += blockDim.x) cnt += kr[i] != 0;
    cnt = (int)kvz_block_sum((float)cnt); /* exact below 2^24 */
    if (threadIdx.x == 0) s_base = n_prefix + cnt;
    __syncthreads();

    /* exclusive scan of this chunk: 256 threads × 4 entries */
    int c_end = min(c0 + COMPACT_CHUNK, n_ctx);
    int f[4], sum = 0;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        int c = c0 + threadIdx.x * 4 + e;
        f[e] = c < c_end && kr[c] != 0;
        sum += f[e];
    }
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) s_wsum[w] = incl;
    __syncthreads();
    int woff = 0;
    for (int i = 0; i < w; i++) woff += s_wsum[i];
    int run = s_base + woff + incl - sum;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        s_idx[threadIdx.x * 4 + e] = f[e] ? run : -1;
        run += f[e];
    }
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x == blockDim.x - 1)
        dst.len[h] = min(run, dst.cap);
    __syncthreads();

    int vpr = src.hd / 8; /* 16-byte vectors per row */
    const vec16 *sk = (const vec16 *)src.k + (size_t)h * src.cap * vpr;
    const vec16 *sv = (const vec16 *)src.v + (size_t)h * src.cap * vpr;
    vec16 *dk = (vec16 *)dst.k + (size_t)h * dst.cap * vpr;
    vec16 *dv = (vec16 *)dst.v + (size_t)h * dst.cap * vpr;
    int n_here = c_end - c0;
    for (int i = threadIdx.x; i < n_here * vpr; i += blockDim.x) {
        int r = i / vpr, c = i % vpr;
        int d = s_idx[r];
        if (d < 0 || d >= dst.cap) continue;
        int sr = n_prefix + c0 + r;
        dk[(size_t)d * vpr + c] = sk[(size_t)sr * vpr + c];
        dv[(size_t)d * vpr + c] = sv[(size_t)sr * vpr + c];
        if (c == 0) dst.pos[(size_t)h * dst.cap + d] = src.pos[(size_t)h * src.cap + sr];
    }
    if (blockIdx.x == 0) {
        int np = min(n_prefix, dst.cap);
        for (int i = threadIdx.x; i < np * vpr; i += blockDim.x) {
            int r = i / vpr, c = i % vpr;
            dk[(size_t)r * vpr + c] = sk[(size_t)r * vpr + c];
            dv[(size_t)r * vpr + c] = sv[(size_t)r * vpr + c];
            if (c == 0) dst.pos[(size_t)h * dst.cap + r] = src.pos[(size_t)h * src.cap + r];
        }
    }
}

__global__ void kv_len_prefix_kernel(int32_t *len, int n_kv, int v)
{
    int h = blockIdx.x * blockDim.x + threadIdx.x;
    if (h < n_kv) len[h] = v;
}

extern "C" int kvz_cuda_kv_compact(cudaStream_t s, const kvz_cuda_kv *src, int n_prefix, int n_ctx,
                                   const uint8_t *keep, const kvz_cuda_kv *dst)
{
    KVZ_ARG(src && dst && src->k && src->v && src->pos && dst->k && dst->v && dst->pos && dst->len);
    KVZ_ARG(src->n_kv == dst->n_kv && src->hd == dst->hd && src->hd % 8 == 0 && src->n_kv > 0);
    KVZ_ARG(n_prefix >= 0 && n_ctx >= 0 && n_prefix + n_ctx <= src->cap && (keep || n_ctx == 0));
    if (n_ctx == 0) {
        /* prefix only: reuse the kernel with one empty chunk is awkward; copy directly */
        size_t row = (size_t)src->hd * sizeof(bf16);
        int np = n_prefix < dst->cap ? n_prefix : dst->cap;
        if (np > 0) {
            KVZ_CUDA_TRY(cudaMemcpy2DAsync(dst->k, dst->cap * row, src->k, src->cap * row, np * row,
                                           src->n_kv, cudaMemcpyDeviceToDevice, s));
            KVZ_CUDA_TRY(cudaMemcpy2DAsync(dst->v, dst->cap * row, src->v, src->cap * row, np * row,
                                           src->n_kv, cudaMemcpyDeviceToDevice, s));
            KVZ_CUDA_TRY(cudaMemcpy2DAsync(dst->pos, dst->cap * 4, src->pos, src->cap * 4, np * 4,
                                           src->n_kv, cudaMemcpyDeviceToDevice, s));
        }
        kv_len_prefix_kernel<<<(src->n_kv + 127) / 128, 128, 0, s>>>(dst->len, src->n_kv, np);
        KVZ_LAUNCH_CHECK("kv_len_prefix");
        return 0;
    }
    dim3 grid((n_ctx + COMPACT_CHUNK - 1) / COMPACT_CHUNK, src->n_kv);
    kv_compact_kernel<<<grid, 256, 0, s>>>(*src, *dst, n_prefix, n_ctx, keep);
    KVZ_LAUNCH_CHECK("kv_compact");
    return 0;
}

/* rows [0, src.len[h]) of every head h → dst (same n_kv, hd); dst.len = src.len */
__global__ void kv_copy_rows_kernel(kvz_cuda_kv src, kvz_cuda_kv dst)
{
    const int h = blockIdx.y, n = min(src.len[h], dst.cap), vpr = src.hd / 8;
    const vec16 *sk = (const vec16 *)src.k + (size_t)h * src.cap * vpr;
    const vec16 *sv = (const vec16 *)src.v + (size_t)h * src.cap * vpr;
    vec16 *dk = (vec16 *)dst.k + (size_t)h * dst.cap * vpr;
    vec16 *dv = (vec16 *)dst.v + (size_t)h * dst.cap * vpr;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n * vpr; i += gridDim.x * blockDim.x) {
        dk[i] = sk[i];
        dv[i] = sv[i];
        if (i % vpr == 0) dst.pos[(size_t)h * dst.cap + i / vpr] = src.pos[(size_t)h * src.cap + i / vpr];
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) dst.len[h] = n;
}

extern "C" int kvz_cuda_kv_copy(cudaStream_t s, const kvz_cuda_kv *src, const kvz_cuda_kv *dst, int max_rows)
{
    KVZ_ARG(src && dst && src->k && src->v && src->pos && src->len && dst->k && dst->v && dst->pos && dst->len);
    KVZ_ARG(src->n_kv == dst->n_kv && src->hd == dst->hd && src->hd % 8 == 0 && src->n_kv > 0 && max_rows >= 0);
    const int vpr = src->hd / 8, per_block = 256 * 4;
    const int bx = (int)(((size_t)max_rows * vpr + per_block - 1) / per_block);
    if (bx == 0) return 0;
    kv_copy_rows_kernel<<<dim3(bx, src->n_kv), 256, 0, s>>>(*src, *dst);
    KVZ_LAUNCH_CHECK("kv_copy_rows");
    return 0;
}
