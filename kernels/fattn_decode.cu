/* Decode attention. Phase 1: grid (split, kv head); each block takes one tile of
 * DEC_BN keys (cache rows or output-buffer slots) into shared memory, computes the
 * logits of all T·G query rows of its KV head (fp32 FMA: decode is memory-bound),
 * a tile-local softmax, and an unnormalised partial P·V. Buffer tiles also keep the
 * last query's raw logits and ‖v‖₁ per slot. Phase 2: combine the splits per row
 * (global max M and sum L). Phase 3 (LongFlow only, one block): S_j and argmin.
 * Every K/V byte is read once, in phase 1. */
#include <float.h>
#include <limits.h>

#include "fattn_decode.cuh"
#include "mma.cuh"

#define DEC_BN 128
#define DEC_THREADS 128

struct dec_params {
    const bf16 *q;
    int ldq;
    const int32_t *qpos;
    int T, G, n_head, RT; /* RT = T·G rows per KV head */
    kvz_cuda_kv kv;
    kvz_cuda_outbuf ob; /* ob.k == NULL → none */
    int n_cs, n_split;  /* cache splits, total splits */
    float scale_log2;
    float *po, *pm, *pl; /* (n_kv, n_split, RT[, HD]) */
    float *blog;         /* (n_head, n_slot) last query's buffer logits (base-2 scaled) */
    float *vnorm;        /* (n_kv, n_slot) */
    float *ML;           /* (n_head, 2) last query's global M, L */
    bf16 *o;
    int ldo;
};

template <int HD, int RMAX> struct dec_smem {
    float q[RMAX][HD];
    bf16 k[DEC_BN][HD + 8]; /* +16 B: conflict-free 16-byte row reads, cp.async aligned */
    bf16 v[DEC_BN][HD + 8];
    float p[RMAX][DEC_BN];
    int kpos[DEC_BN];
    int qp[RMAX];
};

template <int HD, int RMAX>
__global__ void __launch_bounds__(DEC_THREADS) dec_split_kernel(const dec_params p)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    dec_smem<HD, RMAX> &sm = *(dec_smem<HD, RMAX> *)smem_raw;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x, h = blockIdx.y;
    const bool is_ob = split >= p.n_cs;
    int row0, nv;
    const bf16 *kb, *vb;
    const int32_t *pb;
    if (!is_ob) {
        row0 = split * DEC_BN;
        nv = min(DEC_BN, p.kv.len[h] - row0);
        kb = (const bf16 *)p.kv.k + ((size_t)h * p.kv.cap + row0) * HD;
        vb = (const bf16 *)p.kv.v + ((size_t)h * p.kv.cap + row0) * HD;
        pb = p.kv.pos + (size_t)h * p.kv.cap + row0;
    } else {
        row0 = (split - p.n_cs) * DEC_BN;
        nv = min(DEC_BN, p.ob.n_slot - row0);
        kb = (const bf16 *)p.ob.k + ((size_t)h * p.ob.n_slot + row0) * HD;
        vb = (const bf16 *)p.ob.v + ((size_t)h * p.ob.n_slot + row0) * HD;
        pb = p.ob.slot_pos + row0;
    }
    size_t sidx = ((size_t)h * p.n_split + split) * p.RT;
    if (nv <= 0) {
        for (int r = tid; r < p.RT; r += blockDim.x) { p.pm[sidx + r] = -INFINITY; p.pl[sidx + r] = 0.f; }
        return;
    }
    /* stage K, V with cp.async (whole tile in flight at once), then positions, Q (fp32) */
    constexpr int CPR = HD / 8;
#pragma unroll 4
    for (int i = tid; i < DEC_BN * CPR; i += DEC_THREADS) {
        int r = i / CPR, c = (i % CPR) * 8;
        bool ok = r < nv;
        kvz_cp_async16(&sm.k[r][c], ok ? kb + (size_t)r * HD + c : kb, ok);
        kvz_cp_async16(&sm.v[r][c], ok ? vb + (size_t)r * HD + c : vb, ok);
    }
    kvz_cp_commit();
    for (int r = tid; r < DEC_BN; r += blockDim.x) {
        int kp = INT_MAX;
        if (r < nv) { kp = pb[r]; if (kp < 0) kp = INT_MAX; }
        sm.kpos[r] = kp;
    }
    /* Q: 8 bf16 per 16-byte load, all issued before any use */
    for (int i = tid; i < RMAX * HD / 8; i += blockDim.x) {
        int r = i / (HD / 8), d = (i % (HD / 8)) * 8;
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (r < p.RT) {
            int t = r / p.G, g = r % p.G;
            raw = *(const uint4 *)(p.q + (size_t)t * p.ldq + (size_t)(h * p.G + g) * HD + d);
        }
        const __nv_bfloat162 *b2 = (const __nv_bfloat162 *)&raw;
        float2 f0 = __bfloat1622float2(b2[0]), f1 = __bfloat1622float2(b2[1]);
        float2 f2 = __bfloat1622float2(b2[2]), f3 = __bfloat1622float2(b2[3]);
        *(float4 *)&sm.q[r][d] = make_float4(f0.x, f0.y, f1.x, f1.y);
        *(float4 *)&sm.q[r][d + 4] = make_float4(f2.x, f2.y, f3.x, f3.y);
    }
    for (int r = tid; r < RMAX; r += blockDim.x) sm.qp[r] = r < p.RT ? p.qpos[r / p.G] : -1;
    kvz_cp_wait<0>();
    __syncthreads();

    /* logits: thread = key */
    {
        const int k = tid;
        float acc[RMAX];
#pragma unroll
        for (int r = 0; r < RMAX; r++) acc[r] = 0.f;
#pragma unroll 2
        for (int d = 0; d < HD; d += 8) {
            uint4 kr = *(const uint4 *)&sm.k[k][d];
            float2 k0 = __bfloat1622float2(*(const __nv_bfloat162 *)&kr.x);
            float2 k1 = __bfloat1622float2(*(const __nv_bfloat162 *)&kr.y);
            float2 k2 = __bfloat1622float2(*(const __nv_bfloat162 *)&kr.z);
            float2 k3 = __bfloat1622float2(*(const __nv_bfloat162 *)&kr.w);
#pragma unroll
            for (int r = 0; r < RMAX; r++) {
                if (r < p.RT) {
                    float4 qa = *(const float4 *)&sm.q[r][d], qb = *(const float4 *)&sm.q[r][d + 4];
                    acc[r] += qa.x * k0.x + qa.y * k0.y + qa.z * k1.x + qa.w * k1.y
                            + qb.x * k2.x + qb.y * k2.y + qb.z * k3.x + qb.w * k3.y;
                }
            }
        }
        const int kp = sm.kpos[k];
#pragma unroll
        for (int r = 0; r < RMAX; r++) {
            if (r < p.RT) {
                float sv = kp <= sm.qp[r] ? acc[r] * p.scale_log2 : -INFINITY;
                sm.p[r][k] = sv;
                if (is_ob && r / p.G == p.T - 1 && k < nv)
                    p.blog[(size_t)(h * p.G + r % p.G) * p.ob.n_slot + row0 + k] = sv;
            }
        }
        if (is_ob && k < nv) {
            float n1 = 0.f;
            for (int d = 0; d < HD; d += 2) {
                float2 vf = __bfloat1622float2(*(const __nv_bfloat162 *)&sm.v[k][d]);
                n1 += fabsf(vf.x) + fabsf(vf.y);
            }
            p.vnorm[(size_t)h * p.ob.n_slot + row0 + k] = n1;
        }
    }
    __syncthreads();
    /* tile softmax: warp per row */
    for (int r = warp; r < p.RT; r += DEC_THREADS / 32) {
        float mx = -INFINITY;
        for (int k = lane; k < DEC_BN; k += 32) mx = fmaxf(mx, sm.p[r][k]);
        mx = kvz_warp_max(mx);
        float sum = 0.f;
        for (int k = lane; k < DEC_BN; k += 32) {
            float e = mx == -INFINITY ? 0.f : exp2f(sm.p[r][k] - mx);
            sm.p[r][k] = e;
            sum += e;
        }
        sum = kvz_warp_sum(sum);
        if (lane == 0) { p.pm[sidx + r] = mx; p.pl[sidx + r] = sum; }
    }
    __syncthreads();
    /* partial P·V: thread = (dim pair, row group) */
    constexpr int NDP = HD / 2, NRG = DEC_THREADS / NDP, RPT = (RMAX + NRG - 1) / NRG;
    const int dp = tid % NDP, rg = tid / NDP;
    float ox[RPT], oy[RPT];
#pragma unroll
    for (int i = 0; i < RPT; i++) ox[i] = oy[i] = 0.f;
    for (int k = 0; k < nv; k++) {
        float2 vf = __bfloat1622float2(*(const __nv_bfloat162 *)&sm.v[k][2 * dp]);
#pragma unroll
        for (int i = 0; i < RPT; i++) {
            int r = rg + i * NRG;
            if (r < p.RT) { float pv = sm.p[r][k]; ox[i] += pv * vf.x; oy[i] += pv * vf.y; }
        }
    }
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        int r = rg + i * NRG;
        if (r < p.RT) *(float2 *)&p.po[(sidx + r) * HD + 2 * dp] = make_float2(ox[i], oy[i]);
    }
}

/* grid (RT, n_kv), HD threads. */
template <int HD>
__global__ void dec_combine_kernel(const dec_params p)
{
    const int r = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const size_t base = (size_t)h * p.n_split * p.RT + r;
    float M = -INFINITY;
    for (int s = 0; s < p.n_split; s++) M = fmaxf(M, p.pm[base + (size_t)s * p.RT]);
    float L = 0.f, acc = 0.f;
    if (M != -INFINITY) {
#pragma unroll 4
        for (int s = 0; s < p.n_split; s++) {
            float m = p.pm[base + (size_t)s * p.RT];
            if (m == -INFINITY) continue;
            float w = exp2f(m - M);
            L += p.pl[base + (size_t)s * p.RT] * w;
            acc += p.po[(base + (size_t)s * p.RT) * HD + d] * w;
        }
    }
    int t = r / p.G, g = r % p.G, hq = h * p.G + g;
    p.o[(size_t)t * p.ldo + (size_t)hq * HD + d] = __float2bfloat16_rn(L > 0.f ? acc / L : 0.f);
    if (d == 0 && t == p.T - 1 && p.ML) { p.ML[hq * 2] = M; p.ML[hq * 2 + 1] = L; }
}

/* S_j for every slot: grid ceil(B/256), thread = slot. */
__global__ void dec_slot_score_kernel(const dec_params p, float *S)
{
    __shared__ float sML[2 * 256];
    for (int i = threadIdx.x; i < 2 * p.n_head; i += blockDim.x) sML[i] = p.ML[i];
    __syncthreads();
    const int B = p.ob.n_slot, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= B) return;
    float acc = 0.f;
#pragma unroll 8
    for (int hq = 0; hq < p.n_head; hq++) {
        float M = sML[hq * 2], L = sML[hq * 2 + 1];
        float lg = p.blog[(size_t)hq * B + j];
        float vn = p.vnorm[(size_t)(hq / p.G) * B + j];
        if (lg != -INFINITY && L > 0.f) acc += exp2f(lg - M) / L * vn;
    }
    S[j] = acc;
}

/* One block: S_j of every slot (same arithmetic as dec_slot_score_kernel; written to
 * S when S != NULL) and the argmin over evictable slots (lowest index on ties). */
__global__ void dec_longflow_kernel(const dec_params p, float *S, int32_t *evict)
{
    __shared__ float sML[2 * 256];
    for (int i = threadIdx.x; i < 2 * p.n_head; i += blockDim.x) sML[i] = p.ML[i];
    __syncthreads();
    const int B = p.ob.n_slot;
    const int qlast = p.qpos[p.T - 1];
    float best = INFINITY;
    int bi = INT_MAX;
    for (int j = threadIdx.x; j < B; j += blockDim.x) {
        float v = 0.f;
#pragma unroll 8
        for (int hq = 0; hq < p.n_head; hq++) {
            float M = sML[hq * 2], L = sML[hq * 2 + 1];
            float lg = p.blog[(size_t)hq * B + j];
            float vn = p.vnorm[(size_t)(hq / p.G) * B + j];
            if (lg != -INFINITY && L > 0.f) v += exp2f(lg - M) / L * vn;
        }
        if (S) S[j] = v;
        int sp = p.ob.slot_pos[j];
        bool ev = sp >= 0 && j >= p.ob.n_sink && sp != qlast;
        if (ev && (v < best || (v == best && j < bi))) { best = v; bi = j; }
    }
    __shared__ float sb[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float b2 = __shfl_xor_sync(0xffffffffu, best, o);
        int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
        if (b2 < best || (b2 == best && i2 < bi)) { best = b2; bi = i2; }
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) { sb[w] = best; si[w] = bi; }
    __syncthreads();
    if (w == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? sb[lane] : INFINITY;
        bi = lane < nw ? si[lane] : INT_MAX;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float b2 = __shfl_xor_sync(0xffffffffu, best, o);
            int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
            if (b2 < best || (b2 == best && i2 < bi)) { best = b2; bi = i2; }
        }
        if (lane == 0 && evict) *evict = bi == INT_MAX ? -1 : bi;
    }
}

static size_t al256(size_t x) { return (x + 255) & ~(size_t)255; }

struct dec_layout { size_t po, pm, pl, blog, vnorm, ML, S, total; };

static dec_layout dec_ws_layout(int T, int n_head, int hd, int max_len, int n_slot)
{
    int n_split = (max_len + DEC_BN - 1) / DEC_BN + (n_slot + DEC_BN - 1) / DEC_BN;
    size_t rows = (size_t)T * n_head * n_split;
    dec_layout L;
    L.po = 0;
    L.pm = L.po + al256(rows * hd * 4);
    L.pl = L.pm + al256(rows * 4);
    L.blog = L.pl + al256(rows * 4);
    L.vnorm = L.blog + al256((size_t)n_head * n_slot * 4);
    L.ML = L.vnorm + al256((size_t)n_head * n_slot * 4);
    L.S = L.ML + al256((size_t)n_head * 2 * 4);
    L.total = L.S + al256((size_t)n_slot * 4);
    return L;
}

extern "C" size_t kvz_cuda_attn_decode_ws_size(int T, int n_head, int hd, int max_len, int n_slot)
{
    if (T <= 0 || n_head <= 0 || hd <= 0 || max_len < 0 || n_slot < 0) return 0;
    return dec_ws_layout(T, n_head, hd, max_len, n_slot).total;
}

template <int HD, int RMAX>
static int dec_launch_split(const dec_params &p, cudaStream_t s)
{
    size_t smem = sizeof(dec_smem<HD, RMAX>);
    auto kern = dec_split_kernel<HD, RMAX>;
    KVZ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kern<<<dim3(p.n_split, p.kv.n_kv), DEC_THREADS, smem, s>>>(p);
    KVZ_LAUNCH_CHECK("attn_decode_split");
    return 0;
}

extern "C" int kvz_cuda_attn_decode(cudaStream_t s, int T, int n_head, const void *q, int ldq,
                                    const int32_t *qpos, const kvz_cuda_kv *kv, int max_len,
                                    const kvz_cuda_outbuf *ob, void *o, int ldo, void *ws,
                                    size_t ws_bytes, float *slot_score, int32_t *evict_slot)
{
    KVZ_ARG(kv && kv->k && kv->v && kv->pos && kv->len && kv->n_kv > 0 && kv->cap > 0);
    KVZ_ARG(kv->hd == 64 || kv->hd == 128);
    KVZ_ARG(q && qpos && o && T > 0 && n_head > 0 && n_head <= 256 && n_head % kv->n_kv == 0);
    KVZ_ARG(ldq % 8 == 0 && ((uintptr_t)q & 15) == 0);
    KVZ_ARG(T * (n_head / kv->n_kv) <= 32);
    KVZ_ARG(ldq >= n_head * kv->hd && ldo >= n_head * kv->hd && ldo % 2 == 0);
    KVZ_ARG(max_len >= 0 && max_len <= kv->cap);
    KVZ_ARG(!ob || (ob->k && ob->v && ob->slot_pos && ob->n_slot > 0));
    KVZ_ARG(((uintptr_t)kv->k & 15) == 0 && ((uintptr_t)kv->v & 15) == 0);
    int n_slot = ob ? ob->n_slot : 0;
    dec_layout L = dec_ws_layout(T, n_head, kv->hd, max_len, n_slot);
    KVZ_ARG(ws && ws_bytes >= L.total);
    dec_params p = {};
    p.q = (const bf16 *)q; p.ldq = ldq; p.qpos = qpos;
    p.T = T; p.G = n_head / kv->n_kv; p.n_head = n_head; p.RT = T * p.G;
    p.kv = *kv;
    if (ob) p.ob = *ob;
    p.n_cs = (max_len + DEC_BN - 1) / DEC_BN;
    p.n_split = p.n_cs + (n_slot + DEC_BN - 1) / DEC_BN;
    if (p.n_split == 0) p.n_split = p.n_cs = 1; /* empty cache: one empty split writes m = -inf */
    p.scale_log2 = 1.4426950408889634f / sqrtf((float)kv->hd);
    char *w = (char *)ws;
    p.po = (float *)(w + L.po); p.pm = (float *)(w + L.pm); p.pl = (float *)(w + L.pl);
    p.blog = (float *)(w + L.blog); p.vnorm = (float *)(w + L.vnorm);
    p.ML = ob ? (float *)(w + L.ML) : nullptr;
    p.o = (bf16 *)o; p.ldo = ldo;
    int rc;
    if (kv->hd == 64)
        rc = p.RT <= 8 ? dec_launch_split<64, 8>(p, s)
           : p.RT <= 16 ? dec_launch_split<64, 16>(p, s) : dec_launch_split<64, 32>(p, s);
    else
        rc = p.RT <= 8 ? dec_launch_split<128, 8>(p, s)
           : p.RT <= 16 ? dec_launch_split<128, 16>(p, s) : dec_launch_split<128, 32>(p, s);
    if (rc) return rc;
    if (kv->hd == 64) dec_combine_kernel<64><<<dim3(p.RT, kv->n_kv), 64, 0, s>>>(p);
    else dec_combine_kernel<128><<<dim3(p.RT, kv->n_kv), 128, 0, s>>>(p);
    KVZ_LAUNCH_CHECK("attn_decode_combine");
    if (ob && evict_slot) { /* fused S_j + argmin: one launch */
        dec_longflow_kernel<<<1, 1024, 0, s>>>(p, slot_score, evict_slot);
        KVZ_LAUNCH_CHECK("attn_decode_longflow");
    } else if (ob && slot_score) {
        dec_slot_score_kernel<<<(n_slot + 255) / 256, 256, 0, s>>>(p, slot_score);
        KVZ_LAUNCH_CHECK("attn_decode_slot_score");
    }
    return 0;
}
