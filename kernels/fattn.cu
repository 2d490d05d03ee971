/* Flash attention, FA2 style (mma.sync, any sm_80+), one kernel template with three modes:
 *   FA_OUT   : O = softmax(QKᵀ/√d)·V                       (prefill)
 *   FA_STATS : per query row m (base-2 scaled max) and l (sum)  (KVzip pass 1)
 *   FA_SCORE : score[key] = max_rows exp2(s-m)/l, atomicMax     (KVzip pass 2)
 * Block = 4 warps = 64 query rows of one KV head; rows are (token, group head)
 * pairs r = t·G + g, so each K/V tile in shared memory serves the whole GQA group.
 * Keys stream in tiles of 64 through a cp.async double buffer. The key set is a
 * list of segments: up to 3 cache row ranges of head h plus the output buffer.
 * On Hopper builds (sm_90a) fattn_sm90.cu takes FA_OUT and FA_SCORE; this kernel
 * remains for FA_STATS, other GPUs and KVZ_CUDA_FA=mma. */
#include "kvz_cuda_common.cuh"
#include "mma.cuh"
#include "fattn_common.cuh"

#define FA_BM 64
#define FA_BN 64
#define FA_WARPS 4

template <int HD> struct fa_smem {
    bf16 k[2][FA_BN][HD + 8];
    bf16 v[2][FA_BN][HD + 8];
    int kpos[2][FA_BN];
    float ksub[2][FA_BN]; /* 1 for keys of the KVzip subset (ml_sub), else 0 */
    float red[FA_WARPS][FA_BN];
    int seg_lo[FA_MAXSEG], seg_n[FA_MAXSEG], seg_t0[FA_MAXSEG + 1];
    int maxq;
};

/* 3 blocks/SM for hd 128 (<= 168 registers), 4 for hd 64: 12-16 warps per SM. */
template <int HD, int MODE>
__global__ void __launch_bounds__(FA_WARPS * 32, HD == 64 ? 4 : 3)
fa_kernel(const fa_params p)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    fa_smem<HD> &sm = *(fa_smem<HD> *)smem_raw;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.y;
    const int nrows = p.T * p.G;
    const int r0 = blockIdx.x * FA_BM;
    fa_block_segments(p, h, r0, FA_BM, FA_BN, sm.seg_lo, sm.seg_n, sm.seg_t0, &sm.maxq);
    const int n_tiles = sm.seg_t0[FA_MAXSEG];
    const int n_segs = p.n_cseg + (p.ob.k ? 1 : 0);

    /* tile loader: tile index → (segment, rows), K (and V) rows + positions */
    auto load_tile = [&](int it, int buf) {
        int s = 0;
        while (s + 1 < n_segs && it >= sm.seg_t0[s + 1]) s++;
        int lt = it - sm.seg_t0[s];
        int row0 = sm.seg_lo[s] + lt * FA_BN;
        int nv = min(FA_BN, sm.seg_n[s] - lt * FA_BN);
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
        constexpr int CPR = HD / 8;
        for (int i = tid; i < FA_BN * CPR; i += blockDim.x) {
            int r = i / CPR, c = (i % CPR) * 8;
            bool ok = r < nv;
            kvz_cp_async16(&sm.k[buf][r][c], ok ? kb + (size_t)r * HD + c : kb, ok);
            if (MODE == FA_OUT) kvz_cp_async16(&sm.v[buf][r][c], ok ? vb + (size_t)r * HD + c : vb, ok);
        }
        for (int r = tid; r < FA_BN; r += blockDim.x) {
            int kp = INT_MAX;
            float fl = 0.f;
            if (r < nv) {
                kp = pb[r];
                if (kp < 0) kp = INT_MAX;
                fl = !is_ob && fa_in_subset(p, row0 + r) ? 1.f : 0.f;
            }
            sm.kpos[buf][r] = kp;
            sm.ksub[buf][r] = fl;
        }
        return row0;
    };

    /* this thread's two query rows */
    const int ra = r0 + warp * 16 + gq, rb = ra + 8;
    const int qpa = ra < nrows ? p.qpos[ra / p.G] : -1;
    const int qpb = rb < nrows ? p.qpos[rb / p.G] : -1;
    auto qrow_ptr = [&](int r) -> const bf16 * {
        int t = r / p.G, g = r % p.G;
        return p.q + (size_t)t * p.ldq + (size_t)(h * p.G + g) * HD;
    };

    /* Q fragments (registers, whole head dim) */
    uint32_t qf[HD / 16][4];
    {
        const bf16 *qa = ra < nrows ? qrow_ptr(ra) : nullptr;
        const bf16 *qb = rb < nrows ? qrow_ptr(rb) : nullptr;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            int d0 = kk * 16 + 2 * tq;
            qf[kk][0] = qa ? *(const uint32_t *)(qa + d0) : 0u;
            qf[kk][1] = qb ? *(const uint32_t *)(qb + d0) : 0u;
            qf[kk][2] = qa ? *(const uint32_t *)(qa + d0 + 8) : 0u;
            qf[kk][3] = qb ? *(const uint32_t *)(qb + d0 + 8) : 0u;
        }
    }

    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
    float inv_la = 0.f, inv_lb = 0.f;
    const bool sub = MODE == FA_OUT && p.ml_sub != nullptr;
    float ls_a = 0.f, ls_b = 0.f; /* subset sums (sub) */
    if (MODE == FA_SCORE) {
        if (ra < nrows) {
            int t = ra / p.G, g = ra % p.G;
            size_t i = ((size_t)t * p.n_head + h * p.G + g) * 2;
            m_a = p.ml[i]; l_a = p.ml[i + 1];
        }
        if (rb < nrows) {
            int t = rb / p.G, g = rb % p.G;
            size_t i = ((size_t)t * p.n_head + h * p.G + g) * 2;
            m_b = p.ml[i]; l_b = p.ml[i + 1];
        }
        inv_la = l_a > 0.f ? 1.f / l_a : 0.f;
        inv_lb = l_b > 0.f ? 1.f / l_b : 0.f;
    }
    float acc[MODE == FA_OUT ? HD / 8 : 1][4];
#pragma unroll
    for (int i = 0; i < (MODE == FA_OUT ? HD / 8 : 1); i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    int row0_next = 0, row0_cur = 0;
    if (n_tiles > 0) { row0_next = load_tile(0, 0); kvz_cp_commit(); }
    for (int it = 0; it < n_tiles; it++) {
        const int buf = it & 1;
        row0_cur = row0_next;
        if (it + 1 < n_tiles) { row0_next = load_tile(it + 1, buf ^ 1); kvz_cp_commit(); kvz_cp_wait<1>(); }
        else kvz_cp_wait<0>();
        __syncthreads();

        /* S = Q Kᵀ for this warp's 16 rows × 64 keys */
        float sc[FA_BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_BN / 8; nt++) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
        for (int nt = 0; nt < FA_BN / 8; nt++) {
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk += 2) {
                uint32_t b0, b1, b2, b3;
                kvz_ldsm_x4(b0, b1, b2, b3, &sm.k[buf][nt * 8 + (lane & 7)][kk * 16 + 8 * (lane >> 3)]);
                kvz_mma_bf16(sc[nt], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0, b1);
                kvz_mma_bf16(sc[nt], qf[kk + 1][0], qf[kk + 1][1], qf[kk + 1][2], qf[kk + 1][3], b2, b3);
            }
        }
        /* scale + mask; a tile every key of which is visible to every row of this
         * warp (the common case away from the diagonal) skips the per-element test */
        {
            int kmax = max(sm.kpos[buf][lane], sm.kpos[buf][lane + 32]);
            kmax = __reduce_max_sync(0xffffffffu, kmax);
            int qmin = min(qpa, qpb);
            qmin = __reduce_min_sync(0xffffffffu, qmin);
            if (kmax <= qmin) {
#pragma unroll
                for (int nt = 0; nt < FA_BN / 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) sc[nt][e] *= p.scale_log2;
            } else {
#pragma unroll
                for (int nt = 0; nt < FA_BN / 8; nt++) {
                    int2 kp = *(const int2 *)&sm.kpos[buf][nt * 8 + 2 * tq];
                    sc[nt][0] = kp.x <= qpa ? sc[nt][0] * p.scale_log2 : -INFINITY;
                    sc[nt][1] = kp.y <= qpa ? sc[nt][1] * p.scale_log2 : -INFINITY;
                    sc[nt][2] = kp.x <= qpb ? sc[nt][2] * p.scale_log2 : -INFINITY;
                    sc[nt][3] = kp.y <= qpb ? sc[nt][3] * p.scale_log2 : -INFINITY;
                }
            }
        }

        if (MODE == FA_SCORE) {
            /* p = exp2(s - m)/l; max over this block's rows per key column */
#pragma unroll
            for (int nt = 0; nt < FA_BN / 8; nt++) {
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    float pa = sc[nt][e2] == -INFINITY ? 0.f : exp2f(sc[nt][e2] - m_a) * inv_la;
                    float pb = sc[nt][2 + e2] == -INFINITY ? 0.f : exp2f(sc[nt][2 + e2] - m_b) * inv_lb;
                    float v = fmaxf(pa, pb);
                    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
                    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
                    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
                    if (gq == 0) sm.red[warp][nt * 8 + 2 * tq + e2] = v;
                }
            }
            __syncthreads();
            if (tid < FA_BN) {
                float v = sm.red[0][tid];
#pragma unroll
                for (int w = 1; w < FA_WARPS; w++) v = fmaxf(v, sm.red[w][tid]);
                int row = row0_cur + tid;
                if (sm.kpos[buf][tid] != INT_MAX && v > 0.f)
                    atomicMax((int *)&p.score[(size_t)h * p.ld_score + (row - p.c0)], __float_as_int(v));
            }
        } else {
            /* online softmax (base 2) */
            float mxa = -INFINITY, mxb = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < FA_BN / 8; nt++) {
                mxa = fmaxf(mxa, fmaxf(sc[nt][0], sc[nt][1]));
                mxb = fmaxf(mxb, fmaxf(sc[nt][2], sc[nt][3]));
            }
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
            float mna = fmaxf(m_a, mxa), mnb = fmaxf(m_b, mxb);
            float ala = mna == -INFINITY ? 1.f : exp2f(m_a - mna);
            float alb = mnb == -INFINITY ? 1.f : exp2f(m_b - mnb);
            float sa = 0.f, sb = 0.f, ssa = 0.f, ssb = 0.f;
#pragma unroll
            for (int nt = 0; nt < FA_BN / 8; nt++) {
                sc[nt][0] = mna == -INFINITY ? 0.f : exp2f(sc[nt][0] - mna);
                sc[nt][1] = mna == -INFINITY ? 0.f : exp2f(sc[nt][1] - mna);
                sc[nt][2] = mnb == -INFINITY ? 0.f : exp2f(sc[nt][2] - mnb);
                sc[nt][3] = mnb == -INFINITY ? 0.f : exp2f(sc[nt][3] - mnb);
                sa += sc[nt][0] + sc[nt][1];
                sb += sc[nt][2] + sc[nt][3];
                if (sub) {
                    float2 f = *(const float2 *)&sm.ksub[buf][nt * 8 + 2 * tq];
                    ssa += sc[nt][0] * f.x + sc[nt][1] * f.y;
                    ssb += sc[nt][2] * f.x + sc[nt][3] * f.y;
                }
            }
            l_a = l_a * ala + sa;
            l_b = l_b * alb + sb;
            ls_a = ls_a * ala + ssa;
            ls_b = ls_b * alb + ssb;
            m_a = mna; m_b = mnb;
            if (MODE == FA_OUT) {
#pragma unroll
                for (int nd = 0; nd < HD / 8; nd++) {
                    acc[nd][0] *= ala; acc[nd][1] *= ala; acc[nd][2] *= alb; acc[nd][3] *= alb;
                }
#pragma unroll
                for (int kk = 0; kk < FA_BN / 16; kk++) {
                    uint32_t a0 = kvz_pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
                    uint32_t a1 = kvz_pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
                    uint32_t a2 = kvz_pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
                    uint32_t a3 = kvz_pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
                    for (int nd = 0; nd < HD / 8; nd += 2) {
                        uint32_t b0, b1, b2, b3;
                        kvz_ldsm_x4_t(b0, b1, b2, b3,
                                      &sm.v[buf][kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)][nd * 8 + 8 * (lane >> 4)]);
                        kvz_mma_bf16(acc[nd], a0, a1, a2, a3, b0, b1);
                        kvz_mma_bf16(acc[nd + 1], a0, a1, a2, a3, b2, b3);
                    }
                }
            }
        }
        __syncthreads();
    }

    if (MODE == FA_SCORE) return;
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    if (MODE == FA_STATS) {
        if (tq == 0) {
            if (ra < nrows) {
                size_t i = ((size_t)(ra / p.G) * p.n_head + h * p.G + ra % p.G) * 2;
                p.ml[i] = m_a; p.ml[i + 1] = l_a;
            }
            if (rb < nrows) {
                size_t i = ((size_t)(rb / p.G) * p.n_head + h * p.G + rb % p.G) * 2;
                p.ml[i] = m_b; p.ml[i + 1] = l_b;
            }
        }
        return;
    }
    if (sub) {
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
    float ia = l_a > 0.f ? 1.f / l_a : 0.f, ib = l_b > 0.f ? 1.f / l_b : 0.f;
    bf16 *oa = ra < nrows ? p.o + (size_t)(ra / p.G) * p.ldo + (size_t)(h * p.G + ra % p.G) * HD : nullptr;
    bf16 *ob = rb < nrows ? p.o + (size_t)(rb / p.G) * p.ldo + (size_t)(h * p.G + rb % p.G) * HD : nullptr;
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++) {
        int d = nd * 8 + 2 * tq;
        if (oa) *(uint32_t *)(oa + d) = kvz_pack_bf16(acc[nd][0] * ia, acc[nd][1] * ia);
        if (ob) *(uint32_t *)(ob + d) = kvz_pack_bf16(acc[nd][2] * ib, acc[nd][3] * ib);
    }
}

template <int HD, int MODE>
static int fa_launch(const fa_params &p, cudaStream_t s)
{
    size_t smem = sizeof(fa_smem<HD>);
    auto kern = fa_kernel<HD, MODE>;
    KVZ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int nrows = p.T * p.G;
    dim3 grid((nrows + FA_BM - 1) / FA_BM, p.kv.n_kv);
    kern<<<grid, FA_WARPS * 32, smem, s>>>(p);
    KVZ_LAUNCH_CHECK("flash_attn");
    return 0;
}

static int fa_dispatch(const fa_params &p, int mode, cudaStream_t s)
{
    int rc = fa_sm90_dispatch(p, mode, s);
    if (rc <= 0) return rc;
    if (p.kv.hd == 64) {
        if (mode == FA_OUT) return fa_launch<64, FA_OUT>(p, s);
        if (mode == FA_STATS) return fa_launch<64, FA_STATS>(p, s);
        return fa_launch<64, FA_SCORE>(p, s);
    }
    if (mode == FA_OUT) return fa_launch<128, FA_OUT>(p, s);
    if (mode == FA_STATS) return fa_launch<128, FA_STATS>(p, s);
    return fa_launch<128, FA_SCORE>(p, s);
}

static int fa_check_common(int T, int n_head, const void *q, int ldq, const int32_t *qpos,
                           const kvz_cuda_kv *kv)
{
    KVZ_ARG(kv && kv->k && kv->v && kv->pos && kv->len && kv->n_kv > 0 && kv->cap > 0);
    KVZ_ARG(kv->hd == 64 || kv->hd == 128);
    KVZ_ARG(q && qpos && T >= 0 && n_head > 0 && n_head % kv->n_kv == 0 && n_head / kv->n_kv <= 16);
    KVZ_ARG(ldq >= n_head * kv->hd && ldq % 2 == 0 && ((uintptr_t)q & 3) == 0);
    KVZ_ARG(((uintptr_t)kv->k & 15) == 0 && ((uintptr_t)kv->v & 15) == 0);
    KVZ_ARG((long)T * (n_head / kv->n_kv) < (1L << 30));
    return 0;
}

extern "C" int kvz_cuda_attn_prefill(cudaStream_t s, int T, int n_head, const void *q, int ldq,
                                     const int32_t *qpos, const kvz_cuda_kv *kv,
                                     const kvz_cuda_outbuf *ob, void *o, int ldo)
{
    int rc = fa_check_common(T, n_head, q, ldq, qpos, kv);
    if (rc) return rc;
    KVZ_ARG(o && ldo >= n_head * kv->hd && ldo % 2 == 0);
    KVZ_ARG(!ob || (ob->k && ob->v && ob->slot_pos && ob->n_slot > 0));
    if (T == 0) return 0;
    fa_params p = {};
    p.q = (const bf16 *)q; p.ldq = ldq; p.qpos = qpos;
    p.T = T; p.G = n_head / kv->n_kv; p.n_head = n_head;
    p.kv = *kv;
    p.n_cseg = 1; p.lo[0] = 0; p.hi[0] = -1; p.sorted[0] = 1;
    if (ob) p.ob = *ob;
    p.o = (bf16 *)o; p.ldo = ldo;
    p.scale_log2 = 1.4426950408889634f / sqrtf((float)kv->hd);
    return fa_dispatch(p, FA_OUT, s);
}

extern "C" size_t kvz_cuda_kvzip_score_ws_size(int R, int n_head)
{
    return (size_t)(R > 0 ? R : 0) * (size_t)(n_head > 0 ? n_head : 0) * 2 * sizeof(float);
}

static int kvzip_rows_check(const kvz_cuda_kvzip_rows *r, const kvz_cuda_kv *kv)
{
    KVZ_ARG(r);
    KVZ_ARG(0 <= r->n_prefix && r->n_prefix <= r->c0 && r->c0 <= r->c1 && r->c1 <= r->ctx_end);
    KVZ_ARG(r->ctx_end <= r->rep0 && r->rep0 <= r->rep1 && r->rep1 <= kv->cap);
    return 0;
}

extern "C" int kvz_cuda_kvzip_score(cudaStream_t s, int R, int n_head, const void *q, int ldq,
                                    const int32_t *qpos, const kvz_cuda_kv *kv, const kvz_cuda_kvzip_rows *rows,
                                    float *score, int ld_score, void *ws, size_t ws_bytes, void *o_scratch,
                                    int ldo)
{
    int rc = fa_check_common(R, n_head, q, ldq, qpos, kv);
    if (!rc) rc = kvzip_rows_check(rows, kv);
    if (rc) return rc;
    const int c0 = rows->c0, c1 = rows->c1;
    KVZ_ARG(score && ld_score >= c1 - c0);
    KVZ_ARG(ws && ws_bytes >= kvz_cuda_kvzip_score_ws_size(R, n_head));
    KVZ_ARG(!o_scratch || (ldo >= n_head * kv->hd && ldo % 2 == 0));
    if (c1 == c0) return 0;
    KVZ_CUDA_TRY(cudaMemset2DAsync(score, (size_t)ld_score * sizeof(float), 0,
                                   (size_t)(c1 - c0) * sizeof(float), kv->n_kv, s));
    if (R == 0) return 0;
    fa_params p = {};
    p.q = (const bf16 *)q; p.ldq = ldq; p.qpos = qpos;
    p.T = R; p.G = n_head / kv->n_kv; p.n_head = n_head;
    p.kv = *kv;
    p.ml = (float *)ws;
    p.scale_log2 = 1.4426950408889634f / sqrtf((float)kv->hd);
    /* pass 1: m, l over prefix ∪ chunk ∪ this chunk's repeat rows. With a scratch
     * output the attention kernel computes them (its subset sum over keys that are all
     * in K̄ is l; on Hopper the fastest kernel we have), else the statistics kernel. */
    p.n_cseg = 3;
    p.lo[0] = 0; p.hi[0] = rows->n_prefix; p.sorted[0] = 1;
    p.lo[1] = c0; p.hi[1] = c1; p.sorted[1] = 1;
    p.lo[2] = rows->rep0; p.hi[2] = rows->rep1; p.sorted[2] = 1;
    if (o_scratch) {
        p.o = (bf16 *)o_scratch; p.ldo = ldo;
        p.ml_sub = (float *)ws;
        p.sub_np = rows->n_prefix; p.sub_c0 = c0; p.sub_c1 = c1; p.sub_rep0 = rows->rep0;
        rc = fa_dispatch(p, FA_OUT, s);
        p.ml_sub = NULL;
        p.o = NULL;
    } else {
        rc = fa_dispatch(p, FA_STATS, s);
    }
    if (rc) return rc;
    /* pass 2: normalised probabilities of the chunk keys, max-reduced */
    p.n_cseg = 1;
    p.lo[0] = c0; p.hi[0] = c1; p.sorted[0] = 1;
    p.score = score; p.ld_score = ld_score; p.c0 = c0;
    return fa_dispatch(p, FA_SCORE, s);
}

extern "C" int kvz_cuda_attn_prefill_kvzip(cudaStream_t s, int R, int n_head, const void *q, int ldq,
                                           const int32_t *qpos, const kvz_cuda_kv *kv, void *o, int ldo,
                                           const kvz_cuda_kvzip_rows *rows, void *ws, size_t ws_bytes)
{
    int rc = fa_check_common(R, n_head, q, ldq, qpos, kv);
    if (!rc) rc = kvzip_rows_check(rows, kv);
    if (rc) return rc;
    KVZ_ARG(o && ldo >= n_head * kv->hd && ldo % 2 == 0);
    KVZ_ARG(ws && ws_bytes >= kvz_cuda_kvzip_score_ws_size(R, n_head));
    if (R == 0) return 0;
    fa_params p = {};
    p.q = (const bf16 *)q; p.ldq = ldq; p.qpos = qpos;
    p.T = R; p.G = n_head / kv->n_kv; p.n_head = n_head;
    p.kv = *kv;
    /* the whole document, then this chunk's own repeat rows (other chunks' are skipped) */
    p.n_cseg = 2;
    p.lo[0] = 0; p.hi[0] = rows->ctx_end; p.sorted[0] = 1;
    p.lo[1] = rows->rep0; p.hi[1] = rows->rep1; p.sorted[1] = 1;
    p.o = (bf16 *)o; p.ldo = ldo;
    p.scale_log2 = 1.4426950408889634f / sqrtf((float)kv->hd);
    p.ml_sub = (float *)ws;
    p.sub_np = rows->n_prefix; p.sub_c0 = rows->c0; p.sub_c1 = rows->c1; p.sub_rep0 = rows->rep0;
    return fa_dispatch(p, FA_OUT, s);
}

extern "C" int kvz_cuda_kvzip_score_fused(cudaStream_t s, int R, int n_head, const void *q, int ldq,
                                          const int32_t *qpos, const kvz_cuda_kv *kv, int c0, int c1,
                                          float *score, int ld_score, const void *ws, size_t ws_bytes)
{
    int rc = fa_check_common(R, n_head, q, ldq, qpos, kv);
    if (rc) return rc;
    KVZ_ARG(0 <= c0 && c0 <= c1 && c1 <= kv->cap);
    KVZ_ARG(score && ld_score >= c1 - c0);
    KVZ_ARG(ws && ws_bytes >= kvz_cuda_kvzip_score_ws_size(R, n_head));
    if (c1 == c0) return 0;
    KVZ_CUDA_TRY(cudaMemset2DAsync(score, (size_t)ld_score * sizeof(float), 0,
                                   (size_t)(c1 - c0) * sizeof(float), kv->n_kv, s));
    if (R == 0) return 0;
    fa_params p = {};
    p.q = (const bf16 *)q; p.ldq = ldq; p.qpos = qpos;
    p.T = R; p.G = n_head / kv->n_kv; p.n_head = n_head;
    p.kv = *kv;
    p.ml = (float *)ws;
    p.scale_log2 = 1.4426950408889634f / sqrtf((float)kv->hd);
    p.n_cseg = 1;
    p.lo[0] = c0; p.hi[0] = c1; p.sorted[0] = 1;
    p.score = score; p.ld_score = ld_score; p.c0 = c0;
    return fa_dispatch(p, FA_SCORE, s);
}
