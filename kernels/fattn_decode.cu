/* Decode attention (flash-decoding), two launches (four with LongFlow).
 * Phase 1, grid (split, kv head), 4 warps per block. The key sequence of KV head h is
 * its cache rows [0, len[h]) followed by the output-buffer slots, cut into tiles of
 * DEC_BN = 64 keys; split s takes a contiguous, balanced range of those tiles. The
 * ranges follow the current len[h] on the device; the split count depends only on
 * (max_len, n_slot, n_kv, SM count), so the grid is fixed under a CUDA graph, and is
 * about one wave of resident blocks (2 per SM for hd 128, 3 for hd 64). Tiles stream
 * through a 3-stage cp.async ring (tile i+2 loads while tile i is used: 2 tiles, 64 KB
 * at hd 128, in flight per block). Warp w owns keys [16w, 16w+16) of every tile and
 * keeps its own online softmax over them: Sᵀ = K·Qᵀ on tensor cores (keys = M, the
 * T·G query rows of the GQA group = N, padded to 8/16/32), P moved into the B-operand
 * layout in registers by movmatrix, Oᵀ += Vᵀ·Pᵀ (head dims = M). The 4 warps merge
 * at the end of the block into one partial (m, l, unnormalised o) per split. Buffer
 * tiles also keep the last query's raw logits and ‖v‖₁ per slot.
 * Phase 2: combine the splits per row (global max M and sum L).
 * Phase 3 (LongFlow only): S_j over many small blocks (the per-slot loop over heads is
 * latency-bound: one block took ~45 µs at 32 heads, B = 2048), then a one-block argmin.
 * Every K/V byte is read once, in phase 1. */
#include <float.h>
#include <limits.h>

#include "kvz_cuda_common.cuh"
#include "mma.cuh"

#define DEC_BN 64
#define DEC_WARPS 4
#define DEC_THREADS (32 * DEC_WARPS)
#define DEC_STAGES 3
#define DEC_MAX_OCC 4 /* upper bound of resident split blocks per SM (sizes the workspace) */

struct dec_params {
    const bf16 *q;
    int ldq;
    const int32_t *qpos;
    int T, G, n_head, RT; /* RT = T·G rows per KV head */
    kvz_cuda_kv kv;
    kvz_cuda_outbuf ob; /* ob.k == NULL → none */
    int n_ot;           /* buffer tiles per head (0 without a buffer) */
    int n_split;        /* splits per KV head */
    int per;            /* > 0: split s takes tiles [s·per, (s+1)·per) (batched kernel); 0: balanced */
    float scale_log2;
    float *po, *pm, *pl; /* (n_kv, n_split, RT[, HD]) */
    float *blog;         /* (n_head, n_slot) last query's buffer logits (base-2 scaled) */
    float *vnorm;        /* (n_kv, n_slot) */
    float *ML;           /* (n_head, 2) last query's global M, L */
    bf16 *o;
    int ldo;
};

/* 8x8 b16 transpose within the warp (sm_75+): C-fragment → B-fragment layout. */
__device__ __forceinline__ uint32_t dec_movmatrix_t(uint32_t a)
{
    uint32_t d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
    return d;
}
/* 4-byte async copy global → shared; pred false zero-fills. */
__device__ __forceinline__ void dec_cp_async4(void *smem, const void *g, bool pred)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(kvz_smem_addr(smem)), "l"(g),
                 "r"(pred ? 4 : 0));
}

template <int HD, int NT> struct dec_smem {
    bf16 kv[DEC_STAGES][2][DEC_BN][HD + 8]; /* K, V; +16 B per row: conflict-free ldmatrix */
    int kpos[DEC_STAGES][DEC_BN];
    bf16 q[8 * NT][HD + 8];
    float m[DEC_WARPS][8 * NT], l[DEC_WARPS][8 * NT];
};

/* One (split, KV head) block of phase 1. NT = n-tiles of 8 query rows (RT <= 8·NT).
 * A body shared by the single-sequence kernel (grid (n_split, n_kv)) and the batched
 * one (grid (n_split, n_kv, n_seq), parameters per sequence from a descriptor). */
template <int HD, int NT>
__device__ __forceinline__ void dec_split_body(const dec_params p, const int split, const int h)
{
    constexpr int RMAX = 8 * NT, CPR = HD / 8; /* CPR: 16-byte chunks per K/V row */
    static_assert(sizeof(bf16) * DEC_STAGES * 2 * DEC_BN * (HD + 8) >= sizeof(float) * DEC_WARPS * RMAX * (HD + 4),
                  "merge buffer must fit in the stage buffers");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    dec_smem<HD, NT> &sm = *(dec_smem<HD, NT> *)smem_raw;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;

    /* Q rows r = t·G + g (zero rows up to RMAX): first cp.async group */
    for (int i = tid; i < RMAX * CPR; i += DEC_THREADS) {
        int r = i / CPR, c = (i % CPR) * 8;
        bool ok = r < p.RT;
        const bf16 *src = p.q;
        if (ok) {
            int t = r / p.G, g = r - t * p.G;
            src = p.q + (size_t)t * p.ldq + (size_t)(h * p.G + g) * HD + c;
        }
        kvz_cp_async16(&sm.q[r][c], src, ok);
    }

    const int len_h = p.kv.len[h];
    const int n_ct = (len_h + DEC_BN - 1) / DEC_BN, n_t = n_ct + p.n_ot;
    int t0, n;
    if (p.per > 0) {
        t0 = split * p.per;
        n = min(p.per, n_t - t0);
    } else {
        t0 = (int)((long long)split * n_t / p.n_split);
        n = (int)((long long)(split + 1) * n_t / p.n_split) - t0;
    }
    const size_t sidx = ((size_t)h * p.n_split + split) * p.RT;
    if (n <= 0) {
        kvz_cp_wait<0>();
        for (int r = tid; r < p.RT; r += DEC_THREADS) { p.pm[sidx + r] = -INFINITY; p.pl[sidx + r] = 0.f; }
        return;
    }

    /* tile vt of the head's key sequence: cache rows, then buffer slots */
    auto tile_rows = [&](int vt, int &row0, int &nv) -> bool {
        if (vt < n_ct) { row0 = vt * DEC_BN; nv = min(DEC_BN, len_h - row0); return false; }
        row0 = (vt - n_ct) * DEC_BN;
        nv = min(DEC_BN, p.ob.n_slot - row0);
        return true;
    };
    auto load_tile = [&](int vt, int st) {
        int row0, nv;
        const bf16 *kb, *vb;
        const int32_t *pb;
        if (!tile_rows(vt, row0, nv)) {
            size_t b = (size_t)h * p.kv.cap + row0;
            kb = (const bf16 *)p.kv.k + b * HD; vb = (const bf16 *)p.kv.v + b * HD; pb = p.kv.pos + b;
        } else {
            size_t b = (size_t)h * p.ob.n_slot + row0;
            kb = (const bf16 *)p.ob.k + b * HD; vb = (const bf16 *)p.ob.v + b * HD; pb = p.ob.slot_pos + row0;
        }
#pragma unroll
        for (int j = 0; j < DEC_BN * CPR / DEC_THREADS; j++) {
            int i = tid + j * DEC_THREADS, r = i / CPR, c = (i % CPR) * 8;
            bool ok = r < nv;
            size_t off = ok ? (size_t)r * HD + c : 0;
            kvz_cp_async16(&sm.kv[st][0][r][c], kb + off, ok);
            kvz_cp_async16(&sm.kv[st][1][r][c], vb + off, ok);
        }
        if (tid < DEC_BN) dec_cp_async4(&sm.kpos[st][tid], tid < nv ? pb + tid : pb, tid < nv);
    };

#pragma unroll
    for (int s = 0; s < DEC_STAGES - 1; s++) {
        if (s < n) load_tile(t0 + s, s);
        kvz_cp_commit();
    }

    /* this lane's query rows: ra = 8j + 2tq, rb = ra + 1 (N columns of the C fragments) */
    int qpa[NT], qpb[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        int ra = 8 * j + 2 * tq, rb = ra + 1;
        qpa[j] = ra < p.RT ? p.qpos[ra / p.G] : -1;
        qpb[j] = rb < p.RT ? p.qpos[rb / p.G] : -1;
    }
    const int rlast = (p.T - 1) * p.G; /* first row of the last query */
    const int kw = warp * 16;          /* this warp's keys in every tile */

    float o[HD / 16][NT][4]; /* Oᵀ fragments: dims (M) × rows (N) */
    float mrow[NT][2], lrow[NT][2];
#pragma unroll
    for (int mt = 0; mt < HD / 16; mt++)
#pragma unroll
        for (int j = 0; j < NT; j++) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
#pragma unroll
    for (int j = 0; j < NT; j++) mrow[j][0] = mrow[j][1] = -INFINITY, lrow[j][0] = lrow[j][1] = 0.f;

    for (int i = 0; i < n; i++) {
        const int st = i % DEC_STAGES;
        kvz_cp_wait<DEC_STAGES - 2>(); /* tile i (and Q) landed for this thread's copies */
        __syncthreads();               /* ... for all threads; stage (i-1)%S is free again */
        if (i + DEC_STAGES - 1 < n) load_tile(t0 + i + DEC_STAGES - 1, (i + DEC_STAGES - 1) % DEC_STAGES);
        kvz_cp_commit();
        int row0, nv;
        const bool is_ob = tile_rows(t0 + i, row0, nv);

        /* Sᵀ = K·Qᵀ: 16 keys × RMAX rows */
        float sc[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk += 2) {
            uint32_t a[2][4];
#pragma unroll
            for (int u = 0; u < 2; u++)
                kvz_ldsm_x4(a[u][0], a[u][1], a[u][2], a[u][3],
                            &sm.kv[st][0][kw + (lane & 7) + 8 * ((lane >> 3) & 1)][(kk + u) * 16 + 8 * (lane >> 4)]);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                uint32_t b0, b1, b2, b3;
                kvz_ldsm_x4(b0, b1, b2, b3, &sm.q[8 * j + (lane & 7)][kk * 16 + 8 * (lane >> 3)]);
                kvz_mma_bf16(sc[j], a[0][0], a[0][1], a[0][2], a[0][3], b0, b1);
                kvz_mma_bf16(sc[j], a[1][0], a[1][1], a[1][2], a[1][3], b2, b3);
            }
        }
        /* scale + mask: keys ka = kw+gq (c0, c1) and kb = ka+8 (c2, c3); rows ra (c0, c2), rb (c1, c3) */
        const int ka = kw + gq, kb = ka + 8;
        int kpa = sm.kpos[st][ka], kpb = sm.kpos[st][kb];
        if (ka >= nv || kpa < 0) kpa = INT_MAX;
        if (kb >= nv || kpb < 0) kpb = INT_MAX;
#pragma unroll
        for (int j = 0; j < NT; j++) {
            sc[j][0] = kpa <= qpa[j] ? sc[j][0] * p.scale_log2 : -INFINITY;
            sc[j][1] = kpa <= qpb[j] ? sc[j][1] * p.scale_log2 : -INFINITY;
            sc[j][2] = kpb <= qpa[j] ? sc[j][2] * p.scale_log2 : -INFINITY;
            sc[j][3] = kpb <= qpb[j] ? sc[j][3] * p.scale_log2 : -INFINITY;
        }
        if (is_ob) {
            /* last query's raw logits per (q head, slot), -inf where masked */
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int r = 8 * j + 2 * tq + e;
                    if (r >= rlast && r < p.RT) {
                        float *bl = p.blog + (size_t)(h * p.G + r - rlast) * p.ob.n_slot + row0;
                        if (ka < nv) bl[ka] = sc[j][e];
                        if (kb < nv) bl[kb] = sc[j][2 + e];
                    }
                }
            /* ‖v‖₁ per slot: lane pair per key, half the dims each. An empty slot's V
             * row (never written, may hold any bits) is zeroed so that P = 0 times it
             * stays 0 in P·V. Only this warp reads its 16 V rows. */
            const int key = kw + (lane >> 1), half = lane & 1;
            bf16 *vr = &sm.kv[st][1][key][half * (HD / 2)];
            const bool empty = key < nv && sm.kpos[st][key] < 0;
            float s1 = 0.f;
#pragma unroll
            for (int c = 0; c < HD / 2; c += 8) {
                uint4 u = *(const uint4 *)(vr + c);
                const __nv_bfloat162 *b2 = (const __nv_bfloat162 *)&u;
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 f = __bfloat1622float2(b2[e]);
                    s1 += fabsf(f.x) + fabsf(f.y);
                }
                if (empty) *(uint4 *)(vr + c) = make_uint4(0, 0, 0, 0);
            }
            s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
            if (half == 0 && key < nv) p.vnorm[(size_t)h * p.ob.n_slot + row0 + key] = s1;
            __syncwarp();
        }

        /* online softmax (base 2); a row's 16 keys sit in the 8 lanes of equal tq */
        uint32_t pb0[NT], pb1[NT];
#pragma unroll
        for (int j = 0; j < NT; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float mx = fmaxf(sc[j][e], sc[j][2 + e]);
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                const float mn = fmaxf(mrow[j][e], mx);
                const float mu = mn == -INFINITY ? 0.f : mn; /* nothing visible yet: all terms 0 */
                const float al = exp2f(mrow[j][e] - mu);
                sc[j][e] = exp2f(sc[j][e] - mu);
                sc[j][2 + e] = exp2f(sc[j][2 + e] - mu);
                lrow[j][e] = lrow[j][e] * al + sc[j][e] + sc[j][2 + e];
                mrow[j][e] = mn;
#pragma unroll
                for (int mt = 0; mt < HD / 16; mt++) { o[mt][j][e] *= al; o[mt][j][2 + e] *= al; }
            }
            /* C fragment (key, row) → B fragment (row, key) of Pᵀ: keys 0-7 and 8-15 */
            pb0[j] = dec_movmatrix_t(kvz_pack_bf16(sc[j][0], sc[j][1]));
            pb1[j] = dec_movmatrix_t(kvz_pack_bf16(sc[j][2], sc[j][3]));
        }
        /* Oᵀ += Vᵀ·Pᵀ: A = Vᵀ (16 dims × 16 keys) by transposed ldmatrix of V rows */
#pragma unroll
        for (int mt = 0; mt < HD / 16; mt++) {
            uint32_t a0, a1, a2, a3;
            kvz_ldsm_x4_t(a0, a1, a2, a3, &sm.kv[st][1][kw + (lane & 7) + 8 * (lane >> 4)][mt * 16 + 8 * ((lane >> 3) & 1)]);
#pragma unroll
            for (int j = 0; j < NT; j++) kvz_mma_bf16(o[mt][j], a0, a1, a2, a3, pb0[j], pb1[j]);
        }
    }
    kvz_cp_wait<0>();

    /* merge the 4 warps: (m, l) per row, o through shared memory (aliases the stages) */
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            float l = lrow[j][e];
            l += __shfl_xor_sync(0xffffffffu, l, 4);
            l += __shfl_xor_sync(0xffffffffu, l, 8);
            l += __shfl_xor_sync(0xffffffffu, l, 16);
            lrow[j][e] = l;
        }
    __syncthreads(); /* every warp is done with the stage buffers */
    float *mo = (float *)&sm.kv[0][0][0][0]; /* (DEC_WARPS, RMAX, HD + 4) */
#pragma unroll
    for (int mt = 0; mt < HD / 16; mt++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                mo[(warp * RMAX + 8 * j + 2 * tq + (c & 1)) * (HD + 4) + mt * 16 + gq + 8 * (c >> 1)] = o[mt][j][c];
    if (gq == 0) {
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                sm.m[warp][8 * j + 2 * tq + e] = mrow[j][e];
                sm.l[warp][8 * j + 2 * tq + e] = lrow[j][e];
            }
    }
    __syncthreads();
    for (int i = tid; i < p.RT * HD; i += DEC_THREADS) {
        const int r = i / HD, d = i % HD;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) M = fmaxf(M, sm.m[w][r]);
        float acc = 0.f, L = 0.f;
        if (M != -INFINITY) {
#pragma unroll
            for (int w = 0; w < DEC_WARPS; w++) {
                const float mw = sm.m[w][r];
                if (mw == -INFINITY) continue;
                const float wt = exp2f(mw - M);
                acc += wt * mo[(w * RMAX + r) * (HD + 4) + d];
                L += wt * sm.l[w][r];
            }
        }
        p.po[(sidx + r) * HD + d] = acc;
        if (d == 0) { p.pm[sidx + r] = M; p.pl[sidx + r] = L; }
    }
}

/* Grid (n_split, n_kv). */
template <int HD, int NT>
__global__ void __launch_bounds__(DEC_THREADS) dec_split_kernel(const dec_params p)
{
    dec_split_body<HD, NT>(p, blockIdx.x, blockIdx.y);
}

/* grid (RT, n_kv), HD threads, n_split floats of dynamic shared memory: per row, the
 * global max M over the splits, weights exp2(m_s - M) (0 for an empty split, whose o
 * is never read), L and o. */
template <int HD>
__device__ __forceinline__ void dec_combine_body(const dec_params p, const int r, const int h)
{
    extern __shared__ float sw[];
    __shared__ float red[HD / 32];
    const int d = threadIdx.x, ns = p.n_split;
    const size_t base = (size_t)h * ns * p.RT + r;
    float M = -INFINITY;
    for (int s = d; s < ns; s += HD) M = fmaxf(M, p.pm[base + (size_t)s * p.RT]);
    M = kvz_warp_max(M);
    if ((d & 31) == 0) red[d >> 5] = M;
    __syncthreads();
    M = red[0];
#pragma unroll
    for (int w = 1; w < HD / 32; w++) M = fmaxf(M, red[w]);
    for (int s = d; s < ns; s += HD) {
        float m = p.pm[base + (size_t)s * p.RT];
        sw[s] = m == -INFINITY ? 0.f : exp2f(m - M);
    }
    __syncthreads();
    float L = 0.f, acc = 0.f;
#pragma unroll 8
    for (int s = 0; s < ns; s++) {
        const float w = sw[s];
        const float l = p.pl[base + (size_t)s * p.RT], v = p.po[(base + (size_t)s * p.RT) * HD + d];
        if (w != 0.f) { L = fmaf(l, w, L); acc = fmaf(v, w, acc); } /* select: never 0·(stale) */
    }
    int t = r / p.G, g = r % p.G, hq = h * p.G + g;
    p.o[(size_t)t * p.ldo + (size_t)hq * HD + d] = __float2bfloat16_rn(L > 0.f ? acc / L : 0.f);
    if (d == 0 && t == p.T - 1 && p.ML) { p.ML[hq * 2] = M; p.ML[hq * 2 + 1] = L; }
}

template <int HD>
__global__ void __launch_bounds__(HD) dec_combine_kernel(const dec_params p)
{
    dec_combine_body<HD>(p, blockIdx.x, blockIdx.y);
}

/* S_j for every slot: grid ceil(B/64), thread = slot (many small blocks: the loop
 * over heads is latency-bound, so spread it over SMs). */
__device__ __forceinline__ void dec_slot_score_body(const dec_params p, float *S)
{
    __shared__ float sML[2 * 256];
    for (int i = threadIdx.x; i < 2 * p.n_head; i += blockDim.x) sML[i] = p.ML[i];
    __syncthreads();
    const int B = p.ob.n_slot, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= B) return;
    float acc = 0.f;
#pragma unroll 16
    for (int hq = 0; hq < p.n_head; hq++) {
        float M = sML[hq * 2], L = sML[hq * 2 + 1];
        float lg = p.blog[(size_t)hq * B + j];
        float vn = p.vnorm[(size_t)(hq / p.G) * B + j];
        if (lg != -INFINITY && L > 0.f) acc += exp2f(lg - M) / L * vn;
    }
    S[j] = acc;
}

__global__ void __launch_bounds__(64) dec_slot_score_kernel(const dec_params p, float *S)
{
    dec_slot_score_body(p, S);
}

/* One block: argmin of S over evictable slots (lowest index on ties). @p none: what
 * *evict gets when no slot is evictable (-1; the batched path gives B - 1 when
 * B <= n_sink + 1, as evict_fix_kernel does after the single-sequence call). */
__device__ __forceinline__ void dec_argmin_body(const dec_params p, const float *S, int32_t *evict, const int none)
{
    const int B = p.ob.n_slot;
    const int qlast = p.qpos[p.T - 1];
    float best = INFINITY;
    int bi = INT_MAX;
    for (int j = threadIdx.x; j < B; j += blockDim.x) {
        float v = S[j];
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
        if (lane == 0) *evict = bi == INT_MAX ? none : bi;
    }
}

__global__ void __launch_bounds__(1024) dec_argmin_kernel(const dec_params p, const float *S, int32_t *evict)
{
    dec_argmin_body(p, S, evict, -1);
}

static size_t al256(size_t x) { return (x + 255) & ~(size_t)255; }

/* Splits per KV head: about one wave of resident split blocks (occ per SM) over all
 * KV heads, then evened out so every split gets the same number of tiles at max_len.
 * n_kv = 1, occ = DEC_MAX_OCC gives the upper bound used to size the workspace. */
static int dec_num_splits(int max_len, int n_slot, int n_kv, int occ)
{
    int n_t = (max_len + DEC_BN - 1) / DEC_BN + (n_slot + DEC_BN - 1) / DEC_BN;
    if (n_t <= 0) return 1;
    int target = (occ * kvz_cuda_sm_count() + n_kv - 1) / n_kv;
    if (target < 1) target = 1;
    int per = (n_t + target - 1) / target; /* tiles per split */
    return (n_t + per - 1) / per;
}

struct dec_layout { size_t po, pm, pl, blog, vnorm, ML, S, total; };

static dec_layout dec_ws_layout(int T, int n_head, int hd, int n_split, int n_slot)
{
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
    return dec_ws_layout(T, n_head, hd, dec_num_splits(max_len, n_slot, 1, DEC_MAX_OCC), n_slot).total;
}

template <int HD, int NT>
static int dec_launch_split(const dec_params &p, cudaStream_t s)
{
    size_t smem = sizeof(dec_smem<HD, NT>);
    auto kern = dec_split_kernel<HD, NT>;
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
    KVZ_ARG(!ob || (((uintptr_t)ob->k & 15) == 0 && ((uintptr_t)ob->v & 15) == 0));
    const int n_slot = ob ? ob->n_slot : 0, occ = kv->hd == 64 ? 3 : 2;
    const int n_split = dec_num_splits(max_len, n_slot, kv->n_kv, occ);
    dec_layout L = dec_ws_layout(T, n_head, kv->hd, n_split, n_slot);
    KVZ_ARG(ws && ws_bytes >= L.total);
    dec_params p = {};
    p.q = (const bf16 *)q; p.ldq = ldq; p.qpos = qpos;
    p.T = T; p.G = n_head / kv->n_kv; p.n_head = n_head; p.RT = T * p.G;
    p.kv = *kv;
    if (ob) p.ob = *ob;
    p.n_ot = (n_slot + DEC_BN - 1) / DEC_BN;
    p.n_split = n_split;
    p.scale_log2 = 1.4426950408889634f / sqrtf((float)kv->hd);
    char *w = (char *)ws;
    p.po = (float *)(w + L.po); p.pm = (float *)(w + L.pm); p.pl = (float *)(w + L.pl);
    p.blog = (float *)(w + L.blog); p.vnorm = (float *)(w + L.vnorm);
    p.ML = ob ? (float *)(w + L.ML) : nullptr;
    p.o = (bf16 *)o; p.ldo = ldo;
    int rc;
    if (kv->hd == 64)
        rc = p.RT <= 8 ? dec_launch_split<64, 1>(p, s)
           : p.RT <= 16 ? dec_launch_split<64, 2>(p, s) : dec_launch_split<64, 4>(p, s);
    else
        rc = p.RT <= 8 ? dec_launch_split<128, 1>(p, s)
           : p.RT <= 16 ? dec_launch_split<128, 2>(p, s) : dec_launch_split<128, 4>(p, s);
    if (rc) return rc;
    const size_t csm = (size_t)n_split * sizeof(float);
    if (kv->hd == 64) dec_combine_kernel<64><<<dim3(p.RT, kv->n_kv), 64, csm, s>>>(p);
    else dec_combine_kernel<128><<<dim3(p.RT, kv->n_kv), 128, csm, s>>>(p);
    KVZ_LAUNCH_CHECK("attn_decode_combine");
    if (ob && (slot_score || evict_slot)) { /* S_j over many blocks, then the argmin */
        float *S = slot_score ? slot_score : (float *)(w + L.S);
        dec_slot_score_kernel<<<(n_slot + 63) / 64, 64, 0, s>>>(p, S);
        KVZ_LAUNCH_CHECK("attn_decode_slot_score");
        if (evict_slot) {
            dec_argmin_kernel<<<1, 1024, 0, s>>>(p, S, evict_slot);
            KVZ_LAUNCH_CHECK("attn_decode_argmin");
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- batched (one token per sequence) */
/* Sequence z's parameters: the shared ones of @p p with z's cache, buffer, query row,
 * position, output row and workspace slice (@p stride bytes per sequence). */
__device__ __forceinline__ dec_params dec_seq_params(dec_params p, const kvz_cuda_seq *__restrict__ seq, int z,
                                                     size_t stride)
{
    const kvz_cuda_seq *d = seq + z;
    p.kv = d->kv;
    p.ob = d->ob;
    p.n_ot = p.ob.k ? (p.ob.n_slot + DEC_BN - 1) / DEC_BN : 0;
    p.q += (size_t)z * p.ldq;
    p.qpos += z;
    p.o += (size_t)z * p.ldo;
    const size_t off = (size_t)z * stride;
    p.po = (float *)((char *)p.po + off);
    p.pm = (float *)((char *)p.pm + off);
    p.pl = (float *)((char *)p.pl + off);
    p.blog = (float *)((char *)p.blog + off);
    p.vnorm = (float *)((char *)p.vnorm + off);
    p.ML = p.ob.k ? (float *)((char *)p.ML + off) : nullptr;
    return p;
}

template <int HD, int NT>
__global__ void __launch_bounds__(DEC_THREADS)
    dec_split_multi_kernel(const dec_params p, const kvz_cuda_seq *__restrict__ seq, size_t stride)
{
    dec_split_body<HD, NT>(dec_seq_params(p, seq, blockIdx.z, stride), blockIdx.x, blockIdx.y);
}

template <int HD>
__global__ void __launch_bounds__(HD)
    dec_combine_multi_kernel(const dec_params p, const kvz_cuda_seq *__restrict__ seq, size_t stride)
{
    dec_combine_body<HD>(dec_seq_params(p, seq, blockIdx.z, stride), blockIdx.x, blockIdx.y);
}

/* LongFlow choice of the batched step, one block (1024 threads) per sequence: S_j as
 * dec_slot_score_body computes it, with the heads spread over 4 thread groups (the
 * per-slot loop over heads is latency-bound: 32 dependent iterations took ~25 µs per
 * launch), the 4 partial sums added in group order, written to the sequence's S slice;
 * then the argmin of dec_argmin_body over the same block. */
#define DEC_SA_GROUPS 4
__global__ void __launch_bounds__(1024)
    dec_score_argmin_multi_kernel(const dec_params p0, const kvz_cuda_seq *__restrict__ seq, size_t stride,
                                  size_t s_off)
{
    __shared__ float sML[2 * 256];
    __shared__ float part[DEC_SA_GROUPS][256];
    const int z = blockIdx.x;
    int32_t *ev = seq[z].evict;
    if (!seq[z].ob.k || !ev) return; /* uniform over the block */
    const dec_params p = dec_seq_params(p0, seq, z, stride);
    float *S = (float *)((char *)p0.po + (size_t)z * stride + s_off);
    const int tid = threadIdx.x, B = p.ob.n_slot, jj = tid & 255, g = tid >> 8;
    for (int i = tid; i < 2 * p.n_head; i += blockDim.x) sML[i] = p.ML[i];
    __syncthreads();
    for (int j0 = 0; j0 < B; j0 += 256) {
        const int j = j0 + jj;
        float acc = 0.f;
        if (j < B) {
#pragma unroll 8
            for (int hq = g; hq < p.n_head; hq += DEC_SA_GROUPS) {
                const float M = sML[hq * 2], L = sML[hq * 2 + 1];
                const float lg = p.blog[(size_t)hq * B + j];
                const float vn = p.vnorm[(size_t)(hq / p.G) * B + j];
                if (lg != -INFINITY && L > 0.f) acc += exp2f(lg - M) / L * vn;
            }
        }
        part[g][jj] = acc;
        __syncthreads();
        if (g == 0 && j < B) {
            float t = part[0][jj];
#pragma unroll
            for (int k = 1; k < DEC_SA_GROUPS; k++) t += part[k][jj];
            S[j] = t;
        }
        __syncthreads(); /* S visible to the block; part free again */
    }
    const int none = p.ob.n_slot <= p.ob.n_sink + 1 ? p.ob.n_slot - 1 : -1;
    dec_argmin_body(p, S, ev, none);
}

/* Batched split geometry. The per-head lengths of compressed caches are very uneven
 * (KVzip global selection keeps most rows of some heads and few of others), so the
 * splits are sized from the total work, not from the longest head: every split takes a
 * fixed run of `per` tiles, per chosen so the real blocks (sum over sequences and heads
 * of ceil(tiles / per)) fill about two waves of resident blocks, and at least
 * DEC_MULTI_MIN_PER tiles (a split's fixed costs: Q load, warp merge, partial write).
 * n_split = ceil(longest head's tiles / per); splits past a head's tiles exit at once.
 * @p sum_len: host sum of len[h] over sequences and KV heads (0: unknown, use max_len
 * for every head). */
#define DEC_MULTI_MIN_PER 8
static void dec_multi_geometry(int n_seq, int n_head, int n_kv, int hd, int max_len, long long sum_len,
                               int max_slot, int *n_split, int *per, dec_layout *L)
{
    const int occ = hd == 64 ? 3 : 2;
    const int ot = (max_slot + DEC_BN - 1) / DEC_BN, mt = (max_len + DEC_BN - 1) / DEC_BN + ot;
    const long long heads = (long long)n_seq * n_kv;
    if (sum_len <= 0) sum_len = (long long)max_len * heads;
    const long long total = sum_len / DEC_BN + heads * (ot + 1); /* tiles, rounding each head up */
    const long long slots = 2LL * occ * kvz_cuda_sm_count();
    long long pr = (total + slots - 1) / slots;
    if (pr < DEC_MULTI_MIN_PER) pr = DEC_MULTI_MIN_PER;
    if (pr > mt) pr = mt > 0 ? mt : 1;
    *per = (int)pr;
    *n_split = mt > 0 ? (int)((mt + pr - 1) / pr) : 1;
    *L = dec_ws_layout(1, n_head, hd, *n_split, max_slot);
}

extern "C" size_t kvz_cuda_attn_decode_multi_ws_size(int n_seq, int n_head, int n_kv, int hd, int max_len,
                                                     int max_slot)
{
    if (n_seq <= 0 || n_head <= 0 || n_kv <= 0 || hd <= 0 || max_len < 0 || max_slot < 0) return 0;
    /* the most splits any sum_len gives: per = DEC_MULTI_MIN_PER */
    const int mt = (max_len + DEC_BN - 1) / DEC_BN + (max_slot + DEC_BN - 1) / DEC_BN;
    const int ns = mt > 0 ? (mt + DEC_MULTI_MIN_PER - 1) / DEC_MULTI_MIN_PER : 1;
    return (size_t)n_seq * dec_ws_layout(1, n_head, hd, ns, max_slot).total;
}

template <int HD, int NT>
static int dec_launch_split_multi(const dec_params &p, int n_seq, const kvz_cuda_seq *seq, size_t stride,
                                  cudaStream_t s)
{
    size_t smem = sizeof(dec_smem<HD, NT>);
    auto kern = dec_split_multi_kernel<HD, NT>;
    KVZ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kern<<<dim3(p.n_split, p.kv.n_kv, n_seq), DEC_THREADS, smem, s>>>(p, seq, stride);
    KVZ_LAUNCH_CHECK("attn_decode_multi_split");
    return 0;
}

extern "C" int kvz_cuda_attn_decode_multi(cudaStream_t s, int n_seq, int n_head, int n_kv, int hd, const void *q,
                                          int ldq, const int32_t *qpos, const kvz_cuda_seq *seq, int max_len,
                                          long long sum_len, int max_slot, void *o, int ldo, void *ws,
                                          size_t ws_bytes)
{
    KVZ_ARG(n_seq > 0 && n_seq <= 65535 && seq && q && qpos && o);
    KVZ_ARG(hd == 64 || hd == 128);
    KVZ_ARG(n_kv > 0 && n_head > 0 && n_head <= 256 && n_head % n_kv == 0 && n_head / n_kv <= 32);
    KVZ_ARG(ldq % 8 == 0 && ((uintptr_t)q & 15) == 0);
    KVZ_ARG(ldq >= n_head * hd && ldo >= n_head * hd && ldo % 2 == 0);
    KVZ_ARG(max_len >= 0 && max_slot >= 0);
    int n_split, per;
    dec_layout L;
    dec_multi_geometry(n_seq, n_head, n_kv, hd, max_len, sum_len, max_slot, &n_split, &per, &L);
    KVZ_ARG(n_split <= 65535);
    KVZ_ARG(ws && ws_bytes >= (size_t)n_seq * L.total);
    dec_params p = {};
    p.q = (const bf16 *)q; p.ldq = ldq; p.qpos = qpos;
    p.T = 1; p.G = n_head / n_kv; p.n_head = n_head; p.RT = p.G;
    p.kv.n_kv = n_kv; /* the rest per sequence */
    p.n_split = n_split;
    p.per = per;
    p.scale_log2 = 1.4426950408889634f / sqrtf((float)hd);
    char *w = (char *)ws;
    p.po = (float *)(w + L.po); p.pm = (float *)(w + L.pm); p.pl = (float *)(w + L.pl);
    p.blog = (float *)(w + L.blog); p.vnorm = (float *)(w + L.vnorm); p.ML = (float *)(w + L.ML);
    p.o = (bf16 *)o; p.ldo = ldo;
    const size_t stride = L.total, s_off = L.S - L.po;
    int rc;
    if (hd == 64)
        rc = p.RT <= 8 ? dec_launch_split_multi<64, 1>(p, n_seq, seq, stride, s)
           : p.RT <= 16 ? dec_launch_split_multi<64, 2>(p, n_seq, seq, stride, s)
                        : dec_launch_split_multi<64, 4>(p, n_seq, seq, stride, s);
    else
        rc = p.RT <= 8 ? dec_launch_split_multi<128, 1>(p, n_seq, seq, stride, s)
           : p.RT <= 16 ? dec_launch_split_multi<128, 2>(p, n_seq, seq, stride, s)
                        : dec_launch_split_multi<128, 4>(p, n_seq, seq, stride, s);
    if (rc) return rc;
    const size_t csm = (size_t)n_split * sizeof(float);
    if (hd == 64) dec_combine_multi_kernel<64><<<dim3(p.RT, n_kv, n_seq), 64, csm, s>>>(p, seq, stride);
    else dec_combine_multi_kernel<128><<<dim3(p.RT, n_kv, n_seq), 128, csm, s>>>(p, seq, stride);
    KVZ_LAUNCH_CHECK("attn_decode_multi_combine");
    if (max_slot > 0) {
        dec_score_argmin_multi_kernel<<<n_seq, 1024, 0, s>>>(p, seq, stride, s_off);
        KVZ_LAUNCH_CHECK("attn_decode_multi_score_argmin");
    }
    return 0;
}
