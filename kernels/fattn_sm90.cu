/* Flash attention on Hopper warpgroup MMA (sm_90a): the prefill output (with the
 * KVzip subset statistics fused in) and the key-major KVzip chunk score. See fattn.cu for the
 * mma.sync kernels these replace on Hopper and the modes' definitions. */
#include <stdlib.h>
#include <string.h>

#include <cuda.h> /* CUtensorMap (types only; the encoder comes through the runtime) */

#include "fattn_common.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

/* ========================================================================== */
/* Hopper (sm_90a) prefill kernel: FA_OUT (+ subset statistics) on wgmma.
 * Block = 2 warpgroups = 128 query rows (64 each, one m64 wgmma tile per warpgroup),
 * keys in tiles of 128 through a 2-stage cp.async ring. Q, K and V sit in shared
 * memory in the 128-byte-swizzled layout wgmma reads directly: per 64-column atom,
 * row r's 16-byte chunk c at atom + r·128 + ((c ^ (r & 7)) << 4). S = Q·Kᵀ reads both
 * operands from shared memory (K-major); P stays in registers (the S accumulator
 * layout is the A-fragment layout) and O += P·V reads V as an MN-major operand. */
#define F9_BM 128
#define F9_BN 128
#define F9_THREADS 256

template <int HD> struct f9_layout {
    static constexpr int QB = F9_BM * HD * 2; /* Q bytes */
    static constexpr int TB = F9_BN * HD * 2; /* one K or V tile */
    static constexpr int Q = 0;
    static constexpr int KV0 = QB;              /* stage s: K at KV0 + 2·s·TB, V at + TB */
    static constexpr int KPOS = KV0 + 4 * TB;   /* int[2][BN] */
    static constexpr int KSUB = KPOS + 2 * F9_BN * 4; /* float[2][BN] */
    static constexpr int SEG = KSUB + 2 * F9_BN * 4;  /* seg_lo[4] seg_n[4] seg_t0[5] scratch */
    static constexpr int TOTAL = SEG + 16 * 4;
    static constexpr int ALLOC = TOTAL + 1024; /* room to align the base to 1024 */
};

__device__ __forceinline__ int f9_swz(int r, int c16, int rows)
{
    return (c16 >> 3) * (rows * 128) + r * 128 + (((c16 & 7) ^ (r & 7)) << 4);
}

__global__ void fa9_probe_kernel(int *out)
{
#ifdef KVZ_HAVE_WGMMA
    *out = 1;
#else
    *out = 0;
#endif
}

template <int HD, bool SUB>
__global__ void __launch_bounds__(F9_THREADS, 1) fa9_kernel(const fa_params p)
{
#ifdef KVZ_HAVE_WGMMA
    using LY = f9_layout<HD>;
    constexpr int CPR = HD / 8; /* 16-byte chunks per row */
    constexpr int NO = HD / 2;  /* O accumulator registers */
    extern __shared__ __align__(16) unsigned char f9_raw[];
    unsigned char *sm = f9_raw + ((1024u - (kvz_smem_addr(f9_raw) & 1023u)) & 1023u);
    const uint32_t sbase = kvz_smem_addr(sm);
    int *kpos_s = (int *)(sm + LY::KPOS);
    float *ksub_s = (float *)(sm + LY::KSUB);
    int *seg = (int *)(sm + LY::SEG); /* lo 0..3, n 4..7, t0 8..12, scratch 13 */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wq = warp & 3;
    const int gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.y;
    const int nrows = p.T * p.G;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * F9_BM; /* the longest (causal) blocks start first */

    fa_block_segments(p, h, r0, F9_BM, F9_BN, seg, seg + 4, seg + 8, seg + 13);
    const int n_tiles = seg[8 + FA_MAXSEG];
    const int n_segs = p.n_cseg + (p.ob.k ? 1 : 0);

    /* Q → shared memory (swizzled); rows past the end are zero */
    for (int i = tid; i < F9_BM * CPR; i += F9_THREADS) {
        int r = i / CPR, c = i % CPR, row = r0 + r;
        bool ok = row < nrows;
        const bf16 *src = ok ? p.q + (size_t)(row / p.G) * p.ldq + (size_t)(h * p.G + row % p.G) * HD + c * 8 : p.q;
        kvz_cp_async16(sm + LY::Q + f9_swz(r, c, F9_BM), src, ok);
    }
    auto load_tile = [&](int it, int buf) {
        int s = 0;
        while (s + 1 < n_segs && it >= seg[8 + s + 1]) s++;
        int lt = it - seg[8 + s];
        int row0 = seg[s] + lt * F9_BN;
        int nv = min(F9_BN, seg[4 + s] - lt * F9_BN);
        bool is_ob = p.ob.k && s == p.n_cseg;
        const bf16 *kb, *vb;
        const int32_t *pb;
        if (is_ob) {
            kb = (const bf16 *)p.ob.k + ((size_t)h * p.ob.n_slot + row0) * HD;
            vb = (const bf16 *)p.ob.v + ((size_t)h * p.ob.n_slot + row0) * HD;
            pb = p.ob.slot_pos + row0;
        } else {
            kb = (const bf16 *)p.kv.k + ((size_t)h * p.kv.cap + row0) * HD;
            vb = (const bf16 *)p.kv.v + ((size_t)h * p.kv.cap + row0) * HD;
            pb = p.kv.pos + (size_t)h * p.kv.cap + row0;
        }
        unsigned char *kd = sm + LY::KV0 + buf * 2 * LY::TB, *vd = kd + LY::TB;
#pragma unroll 4
        for (int i = tid; i < F9_BN * CPR; i += F9_THREADS) {
            int r = i / CPR, c = i % CPR;
            bool ok = r < nv;
            size_t go = ok ? (size_t)r * HD + c * 8 : 0;
            int so = f9_swz(r, c, F9_BN);
            kvz_cp_async16(kd + so, kb + go, ok);
            kvz_cp_async16(vd + so, vb + go, ok);
        }
        for (int r = tid; r < F9_BN; r += F9_THREADS) {
            int kp = INT_MAX;
            float fl = 0.f;
            if (r < nv) {
                kp = pb[r];
                if (kp < 0) kp = INT_MAX;
                if (SUB) fl = !is_ob && fa_in_subset(p, row0 + r) ? 1.f : 0.f;
            }
            kpos_s[buf * F9_BN + r] = kp;
            if (SUB) ksub_s[buf * F9_BN + r] = fl;
        }
    };

    const int ra = r0 + wg * 64 + wq * 16 + gq, rb = ra + 8;
    const int qpa = ra < nrows ? p.qpos[ra / p.G] : -1;
    const int qpb = rb < nrows ? p.qpos[rb / p.G] : -1;

    float o[NO], sc[F9_BN / 2];
#pragma unroll
    for (int i = 0; i < NO; i++) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < F9_BN / 2; i++) sc[i] = 0.f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f, ls_a = 0.f, ls_b = 0.f;

    if (n_tiles > 0) load_tile(0, 0);
    kvz_cp_commit(); /* Q (+ tile 0) */
    for (int it = 0; it < n_tiles; it++) {
        const int buf = it & 1;
        kvz_cp_wait<0>();
        kvz_fence_proxy_async();
        __syncthreads(); /* tile `it` visible; everyone is done with the other stage */
        if (it + 1 < n_tiles) { load_tile(it + 1, buf ^ 1); kvz_cp_commit(); }

        const uint32_t kaddr = sbase + LY::KV0 + buf * 2 * LY::TB;
        const int *kp_t = kpos_s + buf * F9_BN;
        /* S = Q Kᵀ (64 rows of this warpgroup × 128 keys) */
        kvz_wg_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint64_t da = kvz_wg_desc(sbase + LY::Q + (kk >> 2) * (F9_BM * 128) + wg * 64 * 128 + (kk & 3) * 32, 16, 1024);
            uint64_t db = kvz_wg_desc(kaddr + (kk >> 2) * (F9_BN * 128) + (kk & 3) * 32, 16, 1024);
            kvz_wg_m64n128k16_ss(sc, da, db, kk > 0);
        }
        kvz_wg_commit();
        kvz_wg_wait<0>();
        kvz_wg_reg_fence(sc);

        /* scale + causal mask (skipped when every key is visible to all of this warp's rows) */
        {
            int kmax = max(max(kp_t[lane], kp_t[lane + 32]), max(kp_t[lane + 64], kp_t[lane + 96]));
            kmax = __reduce_max_sync(0xffffffffu, kmax);
            int qmin = __reduce_min_sync(0xffffffffu, min(qpa, qpb));
            if (kmax <= qmin) {
#pragma unroll
                for (int i = 0; i < F9_BN / 2; i++) sc[i] *= p.scale_log2;
            } else {
#pragma unroll
                for (int j = 0; j < F9_BN / 8; j++) {
                    int2 kp = *(const int2 *)&kp_t[j * 8 + 2 * tq];
                    sc[4 * j + 0] = kp.x <= qpa ? sc[4 * j + 0] * p.scale_log2 : -INFINITY;
                    sc[4 * j + 1] = kp.y <= qpa ? sc[4 * j + 1] * p.scale_log2 : -INFINITY;
                    sc[4 * j + 2] = kp.x <= qpb ? sc[4 * j + 2] * p.scale_log2 : -INFINITY;
                    sc[4 * j + 3] = kp.y <= qpb ? sc[4 * j + 3] * p.scale_log2 : -INFINITY;
                }
            }
        }
        /* online softmax (base 2) */
        float mxa = -INFINITY, mxb = -INFINITY;
#pragma unroll
        for (int j = 0; j < F9_BN / 8; j++) {
            mxa = fmaxf(mxa, fmaxf(sc[4 * j + 0], sc[4 * j + 1]));
            mxb = fmaxf(mxb, fmaxf(sc[4 * j + 2], sc[4 * j + 3]));
        }
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
        const float mna = fmaxf(m_a, mxa), mnb = fmaxf(m_b, mxb);
        const float ala = mna == -INFINITY ? 1.f : exp2f(m_a - mna);
        const float alb = mnb == -INFINITY ? 1.f : exp2f(m_b - mnb);
        const float ba = mna == -INFINITY ? 0.f : mna, bb = mnb == -INFINITY ? 0.f : mnb;
        float sa = 0.f, sb = 0.f, ssa = 0.f, ssb = 0.f;
#pragma unroll
        for (int j = 0; j < F9_BN / 8; j++) {
            sc[4 * j + 0] = exp2f(sc[4 * j + 0] - ba);
            sc[4 * j + 1] = exp2f(sc[4 * j + 1] - ba);
            sc[4 * j + 2] = exp2f(sc[4 * j + 2] - bb);
            sc[4 * j + 3] = exp2f(sc[4 * j + 3] - bb);
            sa += sc[4 * j + 0] + sc[4 * j + 1];
            sb += sc[4 * j + 2] + sc[4 * j + 3];
            if (SUB) {
                float2 f = *(const float2 *)&ksub_s[buf * F9_BN + j * 8 + 2 * tq];
                ssa += sc[4 * j + 0] * f.x + sc[4 * j + 1] * f.y;
                ssb += sc[4 * j + 2] * f.x + sc[4 * j + 3] * f.y;
            }
        }
        l_a = l_a * ala + sa;
        l_b = l_b * alb + sb;
        if (SUB) { ls_a = ls_a * ala + ssa; ls_b = ls_b * alb + ssb; }
        m_a = mna; m_b = mnb;
#pragma unroll
        for (int j = 0; j < HD / 8; j++) {
            o[4 * j + 0] *= ala; o[4 * j + 1] *= ala; o[4 * j + 2] *= alb; o[4 * j + 3] *= alb;
        }
        /* O += P V: P (bf16) straight from the S registers as the A fragments */
        const uint32_t vaddr = kaddr + LY::TB;
        uint32_t pa[F9_BN / 4];
#pragma unroll
        for (int i = 0; i < F9_BN / 4; i++) pa[i] = kvz_pack_bf16(sc[2 * i], sc[2 * i + 1]);
        kvz_wg_fence();
#pragma unroll
        for (int kk = 0; kk < F9_BN / 16; kk++) {
            uint64_t dv = kvz_wg_desc(vaddr + kk * 2048, F9_BN * 128, 1024);
            if constexpr (HD == 128)
                kvz_wg_m64n128k16_rs_t(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3], dv, 1);
            else
                kvz_wg_m64n64k16_rs_t(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3], dv, 1);
        }
        kvz_wg_commit();
        kvz_wg_wait<0>();
        kvz_wg_reg_fence(o);
    }
    kvz_cp_wait<0>();

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    if (SUB) {
        ls_a += __shfl_xor_sync(0xffffffffu, ls_a, 1);
        ls_a += __shfl_xor_sync(0xffffffffu, ls_a, 2);
        ls_b += __shfl_xor_sync(0xffffffffu, ls_b, 1);
        ls_b += __shfl_xor_sync(0xffffffffu, ls_b, 2);
        if (tq == 0) {
            if (ra < nrows) {
                size_t i = ((size_t)(ra / p.G) * p.n_head + h * p.G + ra % p.G) * 2;
                p.ml_sub[i] = m_a; p.ml_sub[i + 1] = ls_a;
            }
            if (rb < nrows) {
                size_t i = ((size_t)(rb / p.G) * p.n_head + h * p.G + rb % p.G) * 2;
                p.ml_sub[i] = m_b; p.ml_sub[i + 1] = ls_b;
            }
        }
    }
    const float ia = l_a > 0.f ? 1.f / l_a : 0.f, ib = l_b > 0.f ? 1.f / l_b : 0.f;
    bf16 *oa = ra < nrows ? p.o + (size_t)(ra / p.G) * p.ldo + (size_t)(h * p.G + ra % p.G) * HD : nullptr;
    bf16 *ob = rb < nrows ? p.o + (size_t)(rb / p.G) * p.ldo + (size_t)(h * p.G + rb % p.G) * HD : nullptr;
#pragma unroll
    for (int j = 0; j < HD / 8; j++) {
        int d = j * 8 + 2 * tq;
        if (oa) *(uint32_t *)(oa + d) = kvz_pack_bf16(o[4 * j + 0] * ia, o[4 * j + 1] * ia);
        if (ob) *(uint32_t *)(ob + d) = kvz_pack_bf16(o[4 * j + 2] * ib, o[4 * j + 3] * ib);
    }
#endif
}

/* 1 when the sm_90a kernel is in this binary and the device is a Hopper; KVZ_CUDA_FA=mma
 * forces the mma.sync kernel (A/B runs). Probed once, before any graph capture
 * (prefill is never captured). */
static int fa9_usable(void)
{
    static int ok = -1;
    if (ok >= 0) return ok;
    ok = 0;
    const char *e = getenv("KVZ_CUDA_FA");
    if (e && !strcmp(e, "mma")) return ok;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        major != 9) {
        cudaGetLastError();
        return ok;
    }
    int *d = NULL, h = 0;
    if (cudaMalloc(&d, sizeof(int)) == cudaSuccess) {
        fa9_probe_kernel<<<1, 1>>>(d);
        if (cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess) ok = h == 1;
        cudaFree(d);
    }
    cudaGetLastError();
    return ok;
}

template <int HD, bool SUB>
static int fa9_launch(const fa_params &p, cudaStream_t s)
{
    auto kern = fa9_kernel<HD, SUB>;
    KVZ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, f9_layout<HD>::ALLOC));
    int nrows = p.T * p.G;
    dim3 grid((nrows + F9_BM - 1) / F9_BM, p.kv.n_kv);
    kern<<<grid, F9_THREADS, f9_layout<HD>::ALLOC, s>>>(p);
    KVZ_LAUNCH_CHECK("flash_attn_sm90");
    return 0;
}

/* ========================================================================== */
/* KVzip chunk score, key-major: score[key] = max over query rows of
 * exp2(s·scale − m) / l = exp2(max over rows of (s·scale − m − log2 l)), so the max
 * is taken on the exponent and one exp2 per key remains. A block owns 256 chunk keys
 * of one KV head (128 per warpgroup: two m64 tiles, the M rows of Sᵀ = K·Qᵀ, kept in
 * shared memory) and streams every qsplit-th 128-row query tile (with the rows' m, l
 * and positions) through a 3-stage cp.async ring; each thread keeps its four keys'
 * running max in registers. Blocks of the same keys (qsplit > 1 when there are too
 * few key blocks for one per SM) meet in one atomicMax per key at the end. Key
 * positions are checked only in tiles where some key is not visible to every row
 * (never, for a repeat pass scoring its chunk). */
#define KS_BK 256
#define KS_BQ 128
#define KS_STAGES 3
#define KS_THREADS 256

template <int HD> struct ks_layout {
    static constexpr int TB = KS_BQ * HD * 2;
    static constexpr int K = 0;                                 /* KS_BK keys */
    static constexpr int Q0 = KS_BK * HD * 2;                   /* stage s at Q0 + s·TB */
    static constexpr int ML = Q0 + KS_STAGES * TB;              /* float2[S][BQ]: the rows' (m, l), copied */
    static constexpr int QP = ML + KS_STAGES * KS_BQ * 8;       /* int[S][BQ]: query positions, copied */
    static constexpr int QM = QP + KS_STAGES * KS_BQ * 4;       /* float[S][BQ]: m + log2 l (+inf: no row) */
    static constexpr int QMIN = QM + KS_STAGES * KS_BQ * 4;     /* int[S][4]: per-warp min position */
    static constexpr int KPOS = QMIN + KS_STAGES * 4 * 4;       /* int[BK] */
    static constexpr int TOTAL = KPOS + KS_BK * 4 + 16;         /* + the block's max key position */
    static constexpr int ALLOC = TOTAL + 1024;
};

/* 4- or 8-byte async copy global → shared (through L1; the row statistics are tiny). */
template <int BYTES> __device__ __forceinline__ void ks_cp_async(void *smem, const void *g)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(kvz_smem_addr(smem)), "l"(g), "n"(BYTES));
}

static_assert(KS_BK == KS_THREADS && 2 * KS_BQ == KS_THREADS, "ks9: one thread per key, two per query row");

template <int HD>
__global__ void __launch_bounds__(KS_THREADS, 1) ks9_kernel(const fa_params p, int qsplit)
{
#ifdef KVZ_HAVE_WGMMA
    using LY = ks_layout<HD>;
    constexpr int CPR = HD / 8;
    extern __shared__ __align__(16) unsigned char ks_raw[];
    unsigned char *sm = ks_raw + ((1024u - (kvz_smem_addr(ks_raw) & 1023u)) & 1023u);
    const uint32_t sbase = kvz_smem_addr(sm);
    float2 *ml_s = (float2 *)(sm + LY::ML);
    float *qm_s = (float *)(sm + LY::QM);
    int *qp_s = (int *)(sm + LY::QP), *qmin_s = (int *)(sm + LY::QMIN), *kpos_s = (int *)(sm + LY::KPOS);
    int *kmax_s = kpos_s + KS_BK;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wq = warp & 3;
    const int gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.y, nrows = p.T * p.G;
    const int k0 = p.lo[0] + blockIdx.x * KS_BK, nk = min(KS_BK, p.hi[0] - k0);
    const int n_qt = (nrows + KS_BQ - 1) / KS_BQ;

    /* the block's keys and their positions (rows past the chunk: zero, never visible) */
    const bf16 *kb = (const bf16 *)p.kv.k + ((size_t)h * p.kv.cap + k0) * HD;
    for (int i = tid; i < KS_BK * CPR; i += KS_THREADS) {
        int r = i / CPR, c = i % CPR;
        bool ok = r < nk;
        kvz_cp_async16(sm + LY::K + f9_swz(r, c, KS_BK), ok ? kb + (size_t)r * HD + c * 8 : kb, ok);
    }
    if (tid == 0) *kmax_s = INT_MIN;
    __syncthreads();
    {
        int kp = INT_MAX;
        if (tid < nk) {
            kp = p.kv.pos[(size_t)h * p.kv.cap + k0 + tid];
            if (kp < 0) kp = INT_MAX;
        }
        kpos_s[tid] = kp; /* KS_BK == KS_THREADS */
        int mx = __reduce_max_sync(0xffffffffu, kp == INT_MAX ? INT_MIN : kp);
        if (lane == 0) atomicMax(kmax_s, mx);
    }
    /* this block's i-th query tile → stage i % KS_STAGES: Q rows, the rows' (m, l) and
     * positions, all async; past the last tile nothing (the group stays empty) */
    auto load_q = [&](int i) {
        const int qt = blockIdx.z + i * qsplit, st = i % KS_STAGES;
        if (qt >= n_qt) return;
        const int r0 = qt * KS_BQ;
        unsigned char *qd = sm + LY::Q0 + st * LY::TB;
        { /* two threads a row, half the row's 16-byte chunks each: one division per tile */
            const int r = tid >> 1, row = r0 + r, c0 = (tid & 1) * (CPR / 2);
            const bool ok = row < nrows;
            const bf16 *src = ok ? p.q + (size_t)(row / p.G) * p.ldq + (size_t)(h * p.G + row % p.G) * HD : p.q;
#pragma unroll
            for (int c = c0; c < c0 + CPR / 2; c++) kvz_cp_async16(qd + f9_swz(r, c, KS_BQ), ok ? src + c * 8 : src, ok);
        }
        if (tid < KS_BQ) {
            const int row = r0 + tid;
            if (row < nrows) {
                ks_cp_async<8>(&ml_s[st * KS_BQ + tid], p.ml + ((size_t)(row / p.G) * p.n_head + h * p.G + row % p.G) * 2);
                ks_cp_async<4>(&qp_s[st * KS_BQ + tid], p.qpos + row / p.G);
            } else { /* no row: l = 0 makes it lose everywhere; visible everywhere */
                ml_s[st * KS_BQ + tid] = make_float2(0.f, 0.f);
                qp_s[st * KS_BQ + tid] = INT_MAX;
            }
        }
    };

    const int n_my = blockIdx.z < n_qt ? (n_qt - 1 - blockIdx.z) / qsplit + 1 : 0;
    const int ka = wg * 128 + wq * 16 + gq; /* this thread's keys: ka, ka + 8, ka + 64, ka + 72 */
    float v[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, sc[2][KS_BQ / 2];
#pragma unroll
    for (int i = 0; i < KS_BQ / 2; i++) sc[0][i] = sc[1][i] = 0.f;
    load_q(0);
    kvz_cp_commit(); /* K + tile 0 */
    load_q(1);
    kvz_cp_commit();
    for (int i = 0; i < n_my; i++) {
        const int st = i % KS_STAGES;
        kvz_cp_wait<1>(); /* everything but the newest group: tile i */
        kvz_fence_proxy_async();
        __syncthreads(); /* tile i visible; everyone is done with tile i-1's stage */
        load_q(i + 2);
        kvz_cp_commit();

        kvz_wg_fence();
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                uint64_t da = kvz_wg_desc(sbase + LY::K + (kk >> 2) * (KS_BK * 128) + (wg * 128 + mt * 64) * 128 +
                                              (kk & 3) * 32, 16, 1024);
                uint64_t db = kvz_wg_desc(sbase + LY::Q0 + st * LY::TB + (kk >> 2) * (KS_BQ * 128) + (kk & 3) * 32, 16,
                                          1024);
                kvz_wg_m64n128k16_ss(sc[mt], da, db, kk > 0);
            }
        kvz_wg_commit();
        if (tid < KS_BQ) { /* while the products run: m + log2 l and the tile's first position */
            const float2 ml = ml_s[st * KS_BQ + tid];
            qm_s[st * KS_BQ + tid] = ml.y > 0.f ? ml.x + __log2f(ml.y) : INFINITY;
            const int mn = __reduce_min_sync(0xffffffffu, qp_s[st * KS_BQ + tid]);
            if (lane == 0) qmin_s[st * 4 + warp] = mn;
        }
        kvz_wg_wait<0>();
        kvz_wg_reg_fence(sc[0]);
        kvz_wg_reg_fence(sc[1]);
        __syncthreads(); /* qm, qmin of this tile */

        const float *qm = qm_s + st * KS_BQ;
        const int *qp = qp_s + st * KS_BQ, *qmn = qmin_s + st * 4;
        const int qmin = min(min(qmn[0], qmn[1]), min(qmn[2], qmn[3]));
        if (*kmax_s <= qmin) { /* every key of the block visible to every row of the tile */
            float w[8]; /* two max chains per key (even / odd column blocks): half the dependent depth */
#pragma unroll
            for (int e = 0; e < 8; e++) w[e] = -INFINITY;
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int j = 0; j < KS_BQ / 8; j++) {
                    const float2 m2 = *(const float2 *)&qm[j * 8 + 2 * tq];
                    const float *c4 = &sc[mt][4 * j];
                    float *wa = &w[4 * mt + (j & 1)], *wb = wa + 2;
                    *wa = fmaxf(*wa, fmaxf(fmaf(c4[0], p.scale_log2, -m2.x), fmaf(c4[1], p.scale_log2, -m2.y)));
                    *wb = fmaxf(*wb, fmaxf(fmaf(c4[2], p.scale_log2, -m2.x), fmaf(c4[3], p.scale_log2, -m2.y)));
                }
#pragma unroll
            for (int e = 0; e < 4; e++) v[e] = fmaxf(v[e], fmaxf(w[2 * e], w[2 * e + 1]));
        } else {
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const int kpa = kpos_s[ka + 64 * mt], kpb = kpos_s[ka + 64 * mt + 8];
#pragma unroll
                for (int j = 0; j < KS_BQ / 8; j++) {
                    const float2 m2 = *(const float2 *)&qm[j * 8 + 2 * tq];
                    const int2 q2 = *(const int2 *)&qp[j * 8 + 2 * tq];
                    const float *c4 = &sc[mt][4 * j];
                    if (kpa <= q2.x) v[2 * mt] = fmaxf(v[2 * mt], fmaf(c4[0], p.scale_log2, -m2.x));
                    if (kpa <= q2.y) v[2 * mt] = fmaxf(v[2 * mt], fmaf(c4[1], p.scale_log2, -m2.y));
                    if (kpb <= q2.x) v[2 * mt + 1] = fmaxf(v[2 * mt + 1], fmaf(c4[2], p.scale_log2, -m2.x));
                    if (kpb <= q2.y) v[2 * mt + 1] = fmaxf(v[2 * mt + 1], fmaf(c4[3], p.scale_log2, -m2.y));
                }
            }
        }
    }
    kvz_cp_wait<0>();
    float *row = p.score + (size_t)h * p.ld_score + (k0 - p.c0);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float x = fmaxf(v[e], __shfl_xor_sync(0xffffffffu, v[e], 1));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
        const int key = ka + 64 * (e >> 1) + 8 * (e & 1);
        const float pr = exp2f(x); /* exp2(-inf) = 0: no visible row */
        if (tq == 0 && key < nk && pr > 0.f) atomicMax((int *)&row[key], __float_as_int(pr));
    }
#endif
}

template <int HD>
static int ks9_launch(const fa_params &p, cudaStream_t s)
{
    auto kern = ks9_kernel<HD>;
    KVZ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, ks_layout<HD>::ALLOC));
    const int nk = p.hi[0] - p.lo[0], n_qt = (p.T * p.G + KS_BQ - 1) / KS_BQ;
    const int kblocks = (nk + KS_BK - 1) / KS_BK * p.kv.n_kv;
    /* one wave of one block per SM; each split still streams >= 4 query tiles */
    int qsplit = kvz_cuda_sm_count() / kblocks;
    qsplit = max(1, min(qsplit, n_qt / 4));
    dim3 grid((nk + KS_BK - 1) / KS_BK, p.kv.n_kv, qsplit);
    kern<<<grid, KS_THREADS, ks_layout<HD>::ALLOC, s>>>(p, qsplit);
    KVZ_LAUNCH_CHECK("kvzip_score_sm90");
    return 0;
}

/* ========================================================================== */
/* Warp-specialised FA_OUT for long key ranges (no output buffer): warpgroup 0's first
 * warp is the producer — it writes each tile's key positions and starts the bulk
 * tensor copies (TMA, 128-byte swizzle, completion on an mbarrier) of K and V into a
 * 2-stage ring; warpgroups 1 and 2 each own 64 query rows and run S = QKᵀ, the
 * online softmax and O += PV on their own schedule, waiting on "full" barriers and
 * releasing stages through "empty" ones. No block-wide barrier in the tile loop, so
 * one warpgroup's softmax overlaps the other's matrix products. Registers move to
 * the consumers with setmaxnreg (producer 24, consumers 240). */
#define F10_THREADS 384
#define F10_STAGES 2

template <int HD> struct f10_layout {
    static constexpr int QB = F9_BM * HD * 2;
    static constexpr int TB = F9_BN * HD * 2;
    static constexpr int Q = 0;
    static constexpr int KV0 = QB;                                  /* stage s: K at KV0 + 2·s·TB, V at + TB */
    static constexpr int KPOS = KV0 + 2 * F10_STAGES * TB;          /* int[S][BN] */
    static constexpr int KSUB = KPOS + F10_STAGES * F9_BN * 4;      /* float[S][BN] */
    static constexpr int NV = KSUB + F10_STAGES * F9_BN * 4;        /* int[S]: valid rows of the tile */
    static constexpr int BAR = NV + 16;                             /* u64 full_k[S], full_v[S], empty[S] */
    static constexpr int SEG = BAR + 3 * F10_STAGES * 8;            /* seg_lo[4] seg_n[4] seg_t0[5] scratch */
    static constexpr int TOTAL = SEG + 16 * 4;
    static constexpr int ALLOC = TOTAL + 1024;
};

#ifdef KVZ_HAVE_WGMMA
__device__ __forceinline__ void f10_bar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void f10_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void f10_arrive_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void f10_wait(uint32_t bar, int parity)
{
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
__device__ __forceinline__ void f10_tma_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void f10_wg_bar(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
#endif

template <int HD, bool SUB>
__global__ void __launch_bounds__(F10_THREADS, 1)
fa10_kernel(const __grid_constant__ CUtensorMap tmk, const __grid_constant__ CUtensorMap tmv, const fa_params p)
{
#ifdef KVZ_HAVE_WGMMA
    using LY = f10_layout<HD>;
    constexpr int CPR = HD / 8, NO = HD / 2;
    extern __shared__ __align__(16) unsigned char f10_raw[];
    unsigned char *sm = f10_raw + ((1024u - (kvz_smem_addr(f10_raw) & 1023u)) & 1023u);
    const uint32_t sbase = kvz_smem_addr(sm);
    int *kpos_s = (int *)(sm + LY::KPOS);
    float *ksub_s = (float *)(sm + LY::KSUB);
    int *nv_s = (int *)(sm + LY::NV);
    int *seg = (int *)(sm + LY::SEG);
    const uint32_t bar_full_k = sbase + LY::BAR, bar_full_v = bar_full_k + 8 * F10_STAGES,
                   bar_empty = bar_full_v + 8 * F10_STAGES;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int h = blockIdx.y;
    const int nrows = p.T * p.G;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * F9_BM;

    if (tid == 0) {
        for (int s = 0; s < F10_STAGES; s++) {
            f10_bar_init(bar_full_k + 8 * s, 32);  /* the producer warp's lanes (positions) + K bytes */
            f10_bar_init(bar_full_v + 8 * s, 1);   /* V bytes */
            f10_bar_init(bar_empty + 8 * s, 256);  /* every consumer thread */
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    fa_block_segments(p, h, r0, F9_BM, F9_BN, seg, seg + 4, seg + 8, seg + 13); /* __syncthreads inside */
    const int n_tiles = seg[8 + FA_MAXSEG];

    if (wg == 0) {
        /* ---------------- producer ---------------- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (warp != 0) return;
        for (int it = 0; it < n_tiles; it++) {
            const int s = it % F10_STAGES, k = it / F10_STAGES;
            if (it >= F10_STAGES) f10_wait(bar_empty + 8 * s, (k - 1) & 1);
            int sg = 0;
            while (sg + 1 < p.n_cseg && it >= seg[8 + sg + 1]) sg++;
            const int lt = it - seg[8 + sg];
            const int row0 = seg[sg] + lt * F9_BN;
            const int nv = min(F9_BN, seg[4 + sg] - lt * F9_BN);
            const int32_t *pb = p.kv.pos + (size_t)h * p.kv.cap + row0;
#pragma unroll
            for (int i = 0; i < F9_BN / 32; i++) {
                const int r = lane + 32 * i;
                int kp = INT_MAX;
                float fl = 0.f;
                if (r < nv) {
                    kp = pb[r];
                    if (kp < 0) kp = INT_MAX;
                    if (SUB) fl = fa_in_subset(p, row0 + r) ? 1.f : 0.f;
                }
                kpos_s[s * F9_BN + r] = kp;
                if (SUB) ksub_s[s * F9_BN + r] = fl;
            }
            int mode = 0; /* SUB: 1 every valid key of the tile in K̄, 2 some, 0 none */
            if (SUB) {
                bool all_in = true, any_in = false;
#pragma unroll
                for (int i = 0; i < F9_BN / 32; i++) {
                    const int r = lane + 32 * i;
                    const bool in = r < nv && ksub_s[s * F9_BN + r] != 0.f;
                    all_in = all_in && (in || r >= nv);
                    any_in = any_in || in;
                }
                mode = __all_sync(0xffffffffu, all_in) ? 1 : __any_sync(0xffffffffu, any_in) ? 2 : 0;
            }
            if (lane == 0) nv_s[s] = nv | mode << 16;
            __syncwarp();
            if (lane == 0) {
                const int crow = h * p.kv.cap + row0;
                const uint32_t kd = sbase + LY::KV0 + s * 2 * LY::TB;
                f10_arrive_tx(bar_full_k + 8 * s, LY::TB);
#pragma unroll
                for (int a = 0; a < HD / 64; a++) f10_tma_2d(kd + a * F9_BN * 128, &tmk, a * 64, crow, bar_full_k + 8 * s);
                f10_arrive_tx(bar_full_v + 8 * s, LY::TB);
#pragma unroll
                for (int a = 0; a < HD / 64; a++)
                    f10_tma_2d(kd + LY::TB + a * F9_BN * 128, &tmv, a * 64, crow, bar_full_v + 8 * s);
            } else {
                f10_arrive(bar_full_k + 8 * s);
            }
        }
        return;
    }

    /* ---------------- consumers ---------------- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int cw = wg - 1, ct = tid - 128 - cw * 128; /* consumer warpgroup, thread in it */
    const int wq = (ct >> 5), gq = lane >> 2, tq = lane & 3;
    /* this warpgroup's 64 Q rows → shared memory (swizzled); rows past the end are zero */
    for (int i = ct; i < 64 * CPR; i += 128) {
        int r = cw * 64 + i / CPR, c = i % CPR, row = r0 + r;
        bool ok = row < nrows;
        const bf16 *src = ok ? p.q + (size_t)(row / p.G) * p.ldq + (size_t)(h * p.G + row % p.G) * HD + c * 8 : p.q;
        kvz_cp_async16(sm + LY::Q + f9_swz(r, c, F9_BM), src, ok);
    }
    kvz_cp_commit();
    kvz_cp_wait<0>();
    kvz_fence_proxy_async();
    f10_wg_bar(1 + cw);

    const int ra = r0 + cw * 64 + wq * 16 + gq, rb = ra + 8;
    const int qpa = ra < nrows ? p.qpos[ra / p.G] : -1;
    const int qpb = rb < nrows ? p.qpos[rb / p.G] : -1;
    float o[NO], sc[F9_BN / 2];
#pragma unroll
    for (int i = 0; i < NO; i++) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < F9_BN / 2; i++) sc[i] = 0.f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f, ls_a = 0.f, ls_b = 0.f;

    for (int it = 0; it < n_tiles; it++) {
        const int s = it % F10_STAGES, par = (it / F10_STAGES) & 1;
        const uint32_t kaddr = sbase + LY::KV0 + s * 2 * LY::TB, vaddr = kaddr + LY::TB;
        f10_wait(bar_full_k + 8 * s, par);
        kvz_wg_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint64_t da = kvz_wg_desc(sbase + LY::Q + (kk >> 2) * (F9_BM * 128) + cw * 64 * 128 + (kk & 3) * 32, 16, 1024);
            uint64_t db = kvz_wg_desc(kaddr + (kk >> 2) * (F9_BN * 128) + (kk & 3) * 32, 16, 1024);
            kvz_wg_m64n128k16_ss(sc, da, db, kk > 0);
        }
        kvz_wg_commit();
        kvz_wg_wait<0>();
        kvz_wg_reg_fence(sc);

        const int *kp_t = kpos_s + s * F9_BN;
        {
            int kmax = max(max(kp_t[lane], kp_t[lane + 32]), max(kp_t[lane + 64], kp_t[lane + 96]));
            kmax = __reduce_max_sync(0xffffffffu, kmax);
            int qmin = __reduce_min_sync(0xffffffffu, min(qpa, qpb));
            if (kmax <= qmin) {
#pragma unroll
                for (int i = 0; i < F9_BN / 2; i++) sc[i] *= p.scale_log2;
            } else {
#pragma unroll
                for (int j = 0; j < F9_BN / 8; j++) {
                    int2 kp = *(const int2 *)&kp_t[j * 8 + 2 * tq];
                    sc[4 * j + 0] = kp.x <= qpa ? sc[4 * j + 0] * p.scale_log2 : -INFINITY;
                    sc[4 * j + 1] = kp.y <= qpa ? sc[4 * j + 1] * p.scale_log2 : -INFINITY;
                    sc[4 * j + 2] = kp.x <= qpb ? sc[4 * j + 2] * p.scale_log2 : -INFINITY;
                    sc[4 * j + 3] = kp.y <= qpb ? sc[4 * j + 3] * p.scale_log2 : -INFINITY;
                }
            }
        }
        float mxa = -INFINITY, mxb = -INFINITY;
#pragma unroll
        for (int j = 0; j < F9_BN / 8; j++) {
            mxa = fmaxf(mxa, fmaxf(sc[4 * j + 0], sc[4 * j + 1]));
            mxb = fmaxf(mxb, fmaxf(sc[4 * j + 2], sc[4 * j + 3]));
        }
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
        const float mna = fmaxf(m_a, mxa), mnb = fmaxf(m_b, mxb);
        const float ala = mna == -INFINITY ? 1.f : exp2f(m_a - mna);
        const float alb = mnb == -INFINITY ? 1.f : exp2f(m_b - mnb);
        const float ba = mna == -INFINITY ? 0.f : mna, bb = mnb == -INFINITY ? 0.f : mnb;
        float sa = 0.f, sb = 0.f, ssa = 0.f, ssb = 0.f;
#pragma unroll
        for (int j = 0; j < F9_BN / 8; j++) {
            sc[4 * j + 0] = exp2f(sc[4 * j + 0] - ba);
            sc[4 * j + 1] = exp2f(sc[4 * j + 1] - ba);
            sc[4 * j + 2] = exp2f(sc[4 * j + 2] - bb);
            sc[4 * j + 3] = exp2f(sc[4 * j + 3] - bb);
            sa += sc[4 * j + 0] + sc[4 * j + 1];
            sb += sc[4 * j + 2] + sc[4 * j + 3];
        }
        l_a = l_a * ala + sa;
        l_b = l_b * alb + sb;
        if (SUB) { /* per key only in tiles that straddle K̄'s edges */
            const int mode = nv_s[s] >> 16;
            if (mode == 2) {
#pragma unroll
                for (int j = 0; j < F9_BN / 8; j++) {
                    float2 f = *(const float2 *)&ksub_s[s * F9_BN + j * 8 + 2 * tq];
                    ssa += sc[4 * j + 0] * f.x + sc[4 * j + 1] * f.y;
                    ssb += sc[4 * j + 2] * f.x + sc[4 * j + 3] * f.y;
                }
            } else if (mode == 1) {
                ssa = sa; ssb = sb;
            }
            ls_a = ls_a * ala + ssa;
            ls_b = ls_b * alb + ssb;
        }
        m_a = mna; m_b = mnb;
#pragma unroll
        for (int j = 0; j < HD / 8; j++) {
            o[4 * j + 0] *= ala; o[4 * j + 1] *= ala; o[4 * j + 2] *= alb; o[4 * j + 3] *= alb;
        }
        uint32_t pa[F9_BN / 4];
#pragma unroll
        for (int i = 0; i < F9_BN / 4; i++) pa[i] = kvz_pack_bf16(sc[2 * i], sc[2 * i + 1]);
        f10_wait(bar_full_v + 8 * s, par);
        const int nv = nv_s[s] & 0xffff;
        if (nv < F9_BN) {
            /* rows past the tile's end hold whatever the cache has there (even NaN):
             * P is 0 for them, but 0·NaN is not, so clear them. Both warpgroups write
             * the same zeros; each fences its own writes before its wgmma reads them. */
            for (int i = ct; i < (F9_BN - nv) * CPR; i += 128) {
                int r = nv + i / CPR, c = i % CPR;
                *(uint4 *)(sm + LY::KV0 + s * 2 * LY::TB + LY::TB + f9_swz(r, c, F9_BN)) = make_uint4(0, 0, 0, 0);
            }
            kvz_fence_proxy_async();
            f10_wg_bar(1 + cw);
        }
        kvz_wg_fence();
#pragma unroll
        for (int kk = 0; kk < F9_BN / 16; kk++) {
            uint64_t dv = kvz_wg_desc(vaddr + kk * 2048, F9_BN * 128, 1024);
            if constexpr (HD == 128)
                kvz_wg_m64n128k16_rs_t(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3], dv, 1);
            else
                kvz_wg_m64n64k16_rs_t(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3], dv, 1);
        }
        kvz_wg_commit();
        kvz_wg_wait<0>();
        kvz_wg_reg_fence(o);
        f10_arrive(bar_empty + 8 * s);
    }

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    if (SUB) {
        ls_a += __shfl_xor_sync(0xffffffffu, ls_a, 1);
        ls_a += __shfl_xor_sync(0xffffffffu, ls_a, 2);
        ls_b += __shfl_xor_sync(0xffffffffu, ls_b, 1);
        ls_b += __shfl_xor_sync(0xffffffffu, ls_b, 2);
        if (tq == 0) {
            if (ra < nrows) {
                size_t i = ((size_t)(ra / p.G) * p.n_head + h * p.G + ra % p.G) * 2;
                p.ml_sub[i] = m_a; p.ml_sub[i + 1] = ls_a;
            }
            if (rb < nrows) {
                size_t i = ((size_t)(rb / p.G) * p.n_head + h * p.G + rb % p.G) * 2;
                p.ml_sub[i] = m_b; p.ml_sub[i + 1] = ls_b;
            }
        }
    }
    const float ia = l_a > 0.f ? 1.f / l_a : 0.f, ib = l_b > 0.f ? 1.f / l_b : 0.f;
    bf16 *oa = ra < nrows ? p.o + (size_t)(ra / p.G) * p.ldo + (size_t)(h * p.G + ra % p.G) * HD : nullptr;
    bf16 *ob = rb < nrows ? p.o + (size_t)(rb / p.G) * p.ldo + (size_t)(h * p.G + rb % p.G) * HD : nullptr;
#pragma unroll
    for (int j = 0; j < HD / 8; j++) {
        int d = j * 8 + 2 * tq;
        if (oa) *(uint32_t *)(oa + d) = kvz_pack_bf16(o[4 * j + 0] * ia, o[4 * j + 1] * ia);
        if (ob) *(uint32_t *)(ob + d) = kvz_pack_bf16(o[4 * j + 2] * ib, o[4 * j + 3] * ib);
    }
#endif
}

/* cuTensorMapEncodeTiled from the driver, through the runtime (no -lcuda). */
typedef CUresult (*f10_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                  const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static f10_encode_fn f10_encoder(void)
{
    static int state = 0; /* 0 unknown, 1 ok, -1 unavailable */
    static f10_encode_fn fn = NULL;
    if (state == 0) {
        void *f = NULL;
        cudaDriverEntryPointQueryResult q;
        const char *e = getenv("KVZ_CUDA_FA");
        if (!(e && !strcmp(e, "sm90-cpasync")) &&
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess && f) {
            fn = (f10_encode_fn)f;
            state = 1;
        } else {
            cudaGetLastError();
            state = -1;
        }
    }
    return state > 0 ? fn : NULL;
}

/* K or V of one layer as a 2-D bf16 tensor (hd, n_kv·cap): boxes of 64 × 128 rows. */
static int f10_map(CUtensorMap *map, const void *base, const kvz_cuda_kv &kv)
{
    f10_encode_fn enc = f10_encoder();
    if (!enc) return 1;
    cuuint64_t dims[2] = {(cuuint64_t)kv.hd, (cuuint64_t)kv.n_kv * (cuuint64_t)kv.cap};
    cuuint64_t strides[1] = {(cuuint64_t)kv.hd * 2};
    cuuint32_t box[2] = {64, F9_BN}, es[2] = {1, 1};
    CUresult r = enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)base, dims, strides, box, es,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : 1;
}

template <int HD, bool SUB>
static int fa10_launch(const fa_params &p, cudaStream_t s)
{
    CUtensorMap mk, mv;
    if (f10_map(&mk, p.kv.k, p.kv) || f10_map(&mv, p.kv.v, p.kv)) return 1;
    auto kern = fa10_kernel<HD, SUB>;
    KVZ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, f10_layout<HD>::ALLOC));
    dim3 grid((p.T * p.G + F9_BM - 1) / F9_BM, p.kv.n_kv);
    kern<<<grid, F10_THREADS, f10_layout<HD>::ALLOC, s>>>(mk, mv, p);
    KVZ_LAUNCH_CHECK("flash_attn_sm90_tma");
    return 0;
}

/* ========================================================================== */
/* The chunk score, warp-specialised (same result as ks9_kernel, which stays for GQA
 * groups that do not divide 128): warpgroup 0's first warp is the producer — one TMA
 * box per 64 columns brings a 128-row query tile (32 tokens × G heads of the group, a
 * 3-D map over (hd, heads, tokens)), and its lanes turn the rows' (m, l) into
 * m + log2 l and copy the positions into the same stage before arriving on its "full"
 * barrier. Warpgroups 1 and 2 each own 128 of the block's 256 keys (kept in shared
 * memory from the start) and run S^T = K·Q^T and the max on their own schedule,
 * releasing a stage through its "empty" barrier once its row values are in registers,
 * so one consumer's epilogue overlaps the other's products (ncu on ks9: the tensor
 * pipe was 32% busy behind block barriers). */
#define KS10_STAGES 4
#define KS10_THREADS 384

template <int HD> struct ks10_layout {
    static constexpr int TB = KS_BQ * HD * 2;
    static constexpr int K = 0;                               /* 256 keys */
    static constexpr int Q0 = KS_BK * HD * 2;                 /* stage s at Q0 + s·TB */
    static constexpr int QM = Q0 + KS10_STAGES * TB;          /* float[S][BQ]: m + log2 l (+inf: no row) */
    static constexpr int QP = QM + KS10_STAGES * KS_BQ * 4;   /* int[S][BQ]: positions */
    static constexpr int QMIN = QP + KS10_STAGES * KS_BQ * 4; /* int[S] */
    static constexpr int KPOS = QMIN + 16;                    /* int[BK] + the block's max key position */
    static constexpr int BAR = KPOS + KS_BK * 4 + 16;         /* u64 full[S], empty[S] */
    static constexpr int TOTAL = BAR + 2 * KS10_STAGES * 8;
    static constexpr int ALLOC = TOTAL + 1024;
};

#ifdef KVZ_HAVE_WGMMA
__device__ __forceinline__ void ks10_tma_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}
#endif

template <int HD>
__global__ void __launch_bounds__(KS10_THREADS, 1)
ks10_kernel(const __grid_constant__ CUtensorMap tmq, const fa_params p, int qsplit)
{
#ifdef KVZ_HAVE_WGMMA
    using LY = ks10_layout<HD>;
    constexpr int CPR = HD / 8;
    extern __shared__ __align__(16) unsigned char ks10_raw[];
    unsigned char *sm = ks10_raw + ((1024u - (kvz_smem_addr(ks10_raw) & 1023u)) & 1023u);
    const uint32_t sbase = kvz_smem_addr(sm);
    float *qm_s = (float *)(sm + LY::QM);
    int *qp_s = (int *)(sm + LY::QP), *qmin_s = (int *)(sm + LY::QMIN), *kpos_s = (int *)(sm + LY::KPOS);
    int *kmax_s = kpos_s + KS_BK;
    const uint32_t bar_full = sbase + LY::BAR, bar_empty = bar_full + 8 * KS10_STAGES;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int h = blockIdx.y, nrows = p.T * p.G;
    const int k0 = p.lo[0] + blockIdx.x * KS_BK, nk = min(KS_BK, p.hi[0] - k0);
    const int n_qt = (nrows + KS_BQ - 1) / KS_BQ;
    const int n_my = blockIdx.z < n_qt ? (n_qt - 1 - blockIdx.z) / qsplit + 1 : 0;

    if (tid == 0) {
        for (int s = 0; s < KS10_STAGES; s++) {
            f10_bar_init(bar_full + 8 * s, 32);   /* the producer's lanes (row values), + Q bytes as tx */
            f10_bar_init(bar_empty + 8 * s, 256); /* every consumer thread */
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        /* ---------------- producer ---------------- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (warp != 0) return;
        const int tpt = KS_BQ / p.G; /* tokens per tile */
        for (int i = 0; i < n_my; i++) {
            const int s = i % KS10_STAGES, qt = blockIdx.z + i * qsplit;
            if (i >= KS10_STAGES) f10_wait(bar_empty + 8 * s, (i / KS10_STAGES - 1) & 1);
            if (lane == 0) {
                asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar_full + 8 * s), "r"((uint32_t)LY::TB)
                             : "memory");
#pragma unroll
                for (int a = 0; a < HD / 64; a++)
                    ks10_tma_3d(sbase + LY::Q0 + s * LY::TB + a * KS_BQ * 128, &tmq, a * 64, h * p.G, qt * tpt,
                                bar_full + 8 * s);
            }
            int mn = INT_MAX;
#pragma unroll
            for (int k = 0; k < KS_BQ / 32; k++) {
                const int r = lane + 32 * k, row = qt * KS_BQ + r;
                float mq = INFINITY;
                int qp = INT_MAX; /* no row: l = 0 makes it lose everywhere; visible everywhere */
                if (row < nrows) {
                    const float2 ml = *(const float2 *)(p.ml + ((size_t)(row / p.G) * p.n_head + h * p.G + row % p.G) * 2);
                    if (ml.y > 0.f) mq = ml.x + __log2f(ml.y);
                    qp = p.qpos[row / p.G];
                }
                qm_s[s * KS_BQ + r] = mq;
                qp_s[s * KS_BQ + r] = qp;
                mn = min(mn, qp);
            }
            mn = __reduce_min_sync(0xffffffffu, mn);
            if (lane == 0) qmin_s[s] = mn;
            __syncwarp();
            f10_arrive(bar_full + 8 * s); /* every lane after its own row values (release) */
        }
        return;
    }

    /* ---------------- consumers ---------------- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int cw = wg - 1, ct = tid - 128; /* consumer warpgroup, thread among the 256 consumers */
    const int wq = warp & 3, gq = lane >> 2, tq = lane & 3;
    const bf16 *kb = (const bf16 *)p.kv.k + ((size_t)h * p.kv.cap + k0) * HD;
    for (int e = ct; e < KS_BK * CPR; e += 256) {
        int r = e / CPR, c = e % CPR;
        bool ok = r < nk;
        kvz_cp_async16(sm + LY::K + f9_swz(r, c, KS_BK), ok ? kb + (size_t)r * HD + c * 8 : kb, ok);
    }
    kvz_cp_commit();
    {
        int kp = INT_MAX;
        if (ct < nk) {
            kp = p.kv.pos[(size_t)h * p.kv.cap + k0 + ct];
            if (kp < 0) kp = INT_MAX;
        }
        kpos_s[ct] = kp;
        int mx = __reduce_max_sync(0xffffffffu, kp == INT_MAX ? INT_MIN : kp);
        if (ct == 0) *kmax_s = INT_MIN;
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        if (lane == 0) atomicMax(kmax_s, mx);
    }
    kvz_cp_wait<0>();
    kvz_fence_proxy_async();
    asm volatile("bar.sync 1, 256;\n" ::: "memory"); /* K, key positions and their max visible */
    const int kmax = *kmax_s;

    const int ka = cw * 128 + wq * 16 + gq; /* this thread's keys: ka, ka + 8, ka + 64, ka + 72 */
    float v[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, sc[2][KS_BQ / 2];
#pragma unroll
    for (int i = 0; i < KS_BQ / 2; i++) sc[0][i] = sc[1][i] = 0.f;
    for (int i = 0; i < n_my; i++) {
        const int s = i % KS10_STAGES;
        f10_wait(bar_full + 8 * s, (i / KS10_STAGES) & 1);
        kvz_wg_fence();
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                uint64_t da = kvz_wg_desc(sbase + LY::K + (kk >> 2) * (KS_BK * 128) + (cw * 128 + mt * 64) * 128 +
                                              (kk & 3) * 32, 16, 1024);
                uint64_t db = kvz_wg_desc(sbase + LY::Q0 + s * LY::TB + (kk >> 2) * (KS_BQ * 128) + (kk & 3) * 32, 16,
                                          1024);
                kvz_wg_m64n128k16_ss(sc[mt], da, db, kk > 0);
            }
        kvz_wg_commit();
        /* while the products run: this thread's columns' m + log2 l into registers */
        const bool fast = kmax <= qmin_s[s]; /* every key visible to every row of the tile (block-uniform) */
        float2 m2[KS_BQ / 8];
#pragma unroll
        for (int j = 0; j < KS_BQ / 8; j++) m2[j] = *(const float2 *)&qm_s[s * KS_BQ + j * 8 + 2 * tq];
        kvz_wg_wait<0>();
        kvz_wg_reg_fence(sc[0]);
        kvz_wg_reg_fence(sc[1]);
        if (fast) {
            f10_arrive(bar_empty + 8 * s); /* stage s (Q and the row values) may be refilled */
            float w[8];
#pragma unroll
            for (int e = 0; e < 8; e++) w[e] = -INFINITY;
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int j = 0; j < KS_BQ / 8; j++) {
                    const float *c4 = &sc[mt][4 * j];
                    float *wa = &w[4 * mt + (j & 1)], *wb = wa + 2;
                    *wa = fmaxf(*wa, fmaxf(fmaf(c4[0], p.scale_log2, -m2[j].x), fmaf(c4[1], p.scale_log2, -m2[j].y)));
                    *wb = fmaxf(*wb, fmaxf(fmaf(c4[2], p.scale_log2, -m2[j].x), fmaf(c4[3], p.scale_log2, -m2[j].y)));
                }
#pragma unroll
            for (int e = 0; e < 4; e++) v[e] = fmaxf(v[e], fmaxf(w[2 * e], w[2 * e + 1]));
        } else { /* positions from the stage, which is released only afterwards */
            const int *qp = qp_s + s * KS_BQ;
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const int kpa = kpos_s[ka + 64 * mt], kpb = kpos_s[ka + 64 * mt + 8];
#pragma unroll
                for (int j = 0; j < KS_BQ / 8; j++) {
                    const int2 q2 = *(const int2 *)&qp[j * 8 + 2 * tq];
                    const float *c4 = &sc[mt][4 * j];
                    if (kpa <= q2.x) v[2 * mt] = fmaxf(v[2 * mt], fmaf(c4[0], p.scale_log2, -m2[j].x));
                    if (kpa <= q2.y) v[2 * mt] = fmaxf(v[2 * mt], fmaf(c4[1], p.scale_log2, -m2[j].y));
                    if (kpb <= q2.x) v[2 * mt + 1] = fmaxf(v[2 * mt + 1], fmaf(c4[2], p.scale_log2, -m2[j].x));
                    if (kpb <= q2.y) v[2 * mt + 1] = fmaxf(v[2 * mt + 1], fmaf(c4[3], p.scale_log2, -m2[j].y));
                }
            }
            f10_arrive(bar_empty + 8 * s);
        }
    }
    float *row = p.score + (size_t)h * p.ld_score + (k0 - p.c0);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float x = fmaxf(v[e], __shfl_xor_sync(0xffffffffu, v[e], 1));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
        const int key = ka + 64 * (e >> 1) + 8 * (e & 1);
        const float pr = exp2f(x); /* exp2(-inf) = 0: no visible row */
        if (tq == 0 && key < nk && pr > 0.f) atomicMax((int *)&row[key], __float_as_int(pr));
    }
#endif
}

/* Queries of one KV head group as a 3-D bf16 tensor (hd, n_head, T) with row stride ldq:
 * a box of (64, G, 128/G) is a 128-row query tile, rows t·G + g, 128-byte swizzled. */
static int ks10_map(CUtensorMap *map, const fa_params &p)
{
    f10_encode_fn enc = f10_encoder();
    if (!enc) return 1;
    cuuint64_t dims[3] = {(cuuint64_t)p.kv.hd, (cuuint64_t)p.n_head, (cuuint64_t)p.T};
    cuuint64_t strides[2] = {(cuuint64_t)p.kv.hd * 2, (cuuint64_t)p.ldq * 2};
    cuuint32_t box[3] = {64, (cuuint32_t)p.G, (cuuint32_t)(KS_BQ / p.G)}, es[3] = {1, 1, 1};
    CUresult r = enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void *)p.q, dims, strides, box, es,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : 1;
}

/* 1 when it does not apply (a GQA group that does not divide 128, no tensor-map encoder) */
template <int HD>
static int ks10_launch(const fa_params &p, cudaStream_t s)
{
    CUtensorMap mq;
    if (KS_BQ % p.G != 0 || p.T <= 0 || ks10_map(&mq, p)) return 1;
    auto kern = ks10_kernel<HD>;
    KVZ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, ks10_layout<HD>::ALLOC));
    const int nk = p.hi[0] - p.lo[0], n_qt = (p.T * p.G + KS_BQ - 1) / KS_BQ;
    const int kblocks = (nk + KS_BK - 1) / KS_BK * p.kv.n_kv;
    int qsplit = kvz_cuda_sm_count() / kblocks; /* one wave of one block per SM */
    qsplit = max(1, min(qsplit, n_qt / 4));
    dim3 grid((nk + KS_BK - 1) / KS_BK, p.kv.n_kv, qsplit);
    kern<<<grid, KS10_THREADS, ks10_layout<HD>::ALLOC, s>>>(mq, p, qsplit);
    KVZ_LAUNCH_CHECK("kvzip_score_sm90_tma");
    return 0;
}

int fa_sm90_dispatch(const fa_params &p, int mode, cudaStream_t s)
{
    if (mode == FA_STATS || !fa9_usable() || p.ldq % 8 != 0 || ((uintptr_t)p.q & 15) != 0) return 1;
    if (mode == FA_SCORE) { /* one key segment: the chunk */
        const char *e = getenv("KVZ_CUDA_SCORE");
        if (!(e && !strcmp(e, "cpasync"))) {
            int rc = p.kv.hd == 64 ? ks10_launch<64>(p, s) : ks10_launch<128>(p, s);
            if (rc <= 0) return rc;
        }
        return p.kv.hd == 64 ? ks9_launch<64>(p, s) : ks9_launch<128>(p, s);
    }
    if (!p.ob.k && p.kv.hd == 128) { /* warp-specialised TMA kernel; 1 = no tensor-map encoder */
        int rc = p.ml_sub ? fa10_launch<128, true>(p, s) : fa10_launch<128, false>(p, s);
        if (rc <= 0) return rc;
    }
    if (p.kv.hd == 64)
        return p.ml_sub ? fa9_launch<64, true>(p, s) : fa9_launch<64, false>(p, s);
    return p.ml_sub ? fa9_launch<128, true>(p, s) : fa9_launch<128, false>(p, s);
}
