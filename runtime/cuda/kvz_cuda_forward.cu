/* CUDA backend: the forward pass (kvz_cuda_forward) and the CUDA-graph decode step.
 *
 * Forward of T tokens, per layer (residual stream x fp32, GEMM operands bf16):
 *   xn = rmsnorm(x)·w  →  qkv = xn·Wqkvᵀ (+b)  →  rope(q,k) (+qwen3 q/k norm)
 *   → append k,v (doc region or output buffer)  →  attention (prefill kernel, or the
 *   split decode kernel when T·G <= 32)  →  x += att·Woᵀ (GEMM beta = 1)
 *   →  xn = rmsnorm(x)  →  gu = xn·Wguᵀ  →  h = silu(g)·u  →  x += h·Wdownᵀ.
 * T = 1 (decode) runs the same math in fewer launches: rmsnorm inside the qkv and
 * gate|up GEMVs (and the LM head), silu(g)·u in the gate|up GEMV's epilogue, rope
 * fused with the k/v write (kvz_cuda_linear_rmsnorm*, kvz_cuda_rope_kv_append,
 * kvz_cuda_rope_outbuf_write).
 * The LongFlow victim is chosen inside the decode attention kernel of step t and
 * read on the device by step t+1's write: no host round trip.
 */
#include "kvz_cuda_impl.cuh"

static uint64_t g_graph_launches;
extern "C" uint64_t kvz_cuda_graph_launches(void) { return g_graph_launches; }

size_t kvz_cuda_act_layout(const kvz_config *c, int32_t T, act_view *v, char *base)
{
    const size_t d = (size_t)c->n_embd, qd = (size_t)c->n_head * c->head_dim,
                 nqkv = qd + 2 * (size_t)c->n_kv_head * c->head_dim, ff = (size_t)c->n_ff;
    size_t off = 0;
#define SUB(field, type, count)                                          \
    do {                                                                 \
        if (v) v->field = (type *)(base + off);                          \
        off += al256((size_t)(count) * sizeof(type));                    \
    } while (0)
    SUB(x, float, T * d);
    SUB(xn, bf16, T * d);
    SUB(qkv, bf16, T * nqkv);
    SUB(att, bf16, T * qd);
    SUB(gu, bf16, T * 2 * ff);
    SUB(hb, bf16, T * ff);
    SUB(att1, bf16, qd);
    SUB(tok, int32_t, T);
    SUB(pos, int32_t, T);
#undef SUB
    return off;
}

static int ensure_act(kvz_kv *kv, int32_t T, act_view *v)
{
    kvz_cuda_cache *cc = kv->cuda;
    const kvz_config *c = &kv->m->cfg;
    if (T > cc->act_T) {
        int32_t nt = T < 64 ? 64 : T;
        dfree(cc->act); /* cudaFree synchronises the device */
        cc->act = NULL;
        cc->act_T = 0;
        TRY(dmalloc(&cc->act, kvz_cuda_act_layout(c, nt, NULL, NULL), "activations"));
        cc->act_T = nt;
    }
    kvz_cuda_act_layout(c, cc->act_T, v, (char *)cc->act);
    return 0;
}

/* ====================================================================== */
/* small kernels                                                            */

__global__ void iota_kernel(int32_t *p, int32_t v0, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v0 + i;
}

/* evict[l] < 0 (no evictable slot: B too small for the sinks) → last slot, as on the CPU */
__global__ void evict_fix_kernel(int32_t *evict, int B)
{
    if (threadIdx.x == 0 && *evict < 0) *evict = B - 1;
}

__device__ __forceinline__ float blk_max(float v, float *sh)
{
    v = kvz_warp_max(v);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = -INFINITY;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) r = fmaxf(r, sh[i]);
    return r;
}

/* Reference attention for head dims the tiled kernels do not cover (tests' tiny
 * shapes): one block per (query, head), 128 keys per tile, online softmax. */
#define NA_THREADS 128
__global__ void naive_attn_kernel(const bf16 *__restrict__ q, int ldq, const int32_t *__restrict__ qpos,
                                  kvz_cuda_kv kv, kvz_cuda_outbuf ob, int n_slot, int G,
                                  bf16 *__restrict__ o, int ldo)
{
    __shared__ float qs[256];
    __shared__ float p[NA_THREADS];
    __shared__ float red[NA_THREADS / 32];
    const int t = blockIdx.x, h = blockIdx.y, kh = h / G, hd = kv.hd, tid = threadIdx.x;
    const int32_t qp = qpos[t];
    const float scale = rsqrtf((float)hd);
    for (int i = tid; i < hd; i += NA_THREADS) qs[i] = __bfloat162float(q[(size_t)t * ldq + (size_t)h * hd + i]);
    const int len = kv.len[kh], nk = len + n_slot;
    float m = -INFINITY, l = 0.f, acc0 = 0.f, acc1 = 0.f;
    __syncthreads();
    for (int base = 0; base < nk; base += NA_THREADS) {
        const int j = base + tid;
        float s = -INFINITY;
        if (j < nk) {
            const bf16 *kr = NULL;
            if (j < len) {
                if (kv.pos[(size_t)kh * kv.cap + j] <= qp) kr = (const bf16 *)kv.k + ((size_t)kh * kv.cap + j) * hd;
            } else {
                int sl = j - len, sp = ob.slot_pos[sl];
                if (sp >= 0 && sp <= qp) kr = (const bf16 *)ob.k + ((size_t)kh * n_slot + sl) * hd;
            }
            if (kr) {
                float acc = 0.f;
                for (int i = 0; i < hd; i++) acc += qs[i] * __bfloat162float(kr[i]);
                s = acc * scale;
            }
        }
        const float tm = blk_max(s, red);
        const float nm = fmaxf(m, tm);
        if (nm == -INFINITY) continue; /* uniform across the block */
        const float pj = s == -INFINITY ? 0.f : __expf(s - nm);
        p[tid] = pj;
        const float corr = m == -INFINITY ? 0.f : __expf(m - nm);
        const float ts = kvz_block_sum(pj); /* syncs: p visible */
        l = l * corr + ts;
        acc0 *= corr;
        acc1 *= corr;
        const int tn = min(NA_THREADS, nk - base);
        for (int jj = 0; jj < tn; jj++) {
            const float w = p[jj];
            if (w == 0.f) continue;
            const int jk = base + jj;
            const bf16 *vr = jk < len ? (const bf16 *)kv.v + ((size_t)kh * kv.cap + jk) * hd
                                      : (const bf16 *)ob.v + ((size_t)kh * n_slot + (jk - len)) * hd;
            if (tid < hd) acc0 += w * __bfloat162float(vr[tid]);
            if (tid + NA_THREADS < hd) acc1 += w * __bfloat162float(vr[tid + NA_THREADS]);
        }
        m = nm;
        __syncthreads();
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    bf16 *orow = o + (size_t)t * ldo + (size_t)h * hd;
    if (tid < hd) orow[tid] = __float2bfloat16_rn(acc0 * inv);
    if (tid + NA_THREADS < hd) orow[tid + NA_THREADS] = __float2bfloat16_rn(acc1 * inv);
}

/* ====================================================================== */
/* forward                                                                  */

static int attention(kvz_model *m, kvz_kv *kv, int32_t l, int32_t n, act_view *a, int use_ob,
                     int want_evict, int graph)
{
    const kvz_config *c = &m->cfg;
    kvz_cuda_cache *cc = kv->cuda;
    const cudaStream_t s = m->cuda->s;
    const int hd = c->head_dim, G = c->n_head / c->n_kv_head, qd = c->n_head * hd;
    const int nqkv = qd + 2 * c->n_kv_head * hd;
    kvz_cuda_outbuf *ob = use_ob ? &cc->O[l] : NULL;
    if (ob) ob->n_sink = kv->n_sink;
    int64_t max_len = 0;
    for (int32_t h = 0; h < c->n_kv_head; h++) {
        int64_t v = kv->len[(size_t)l * c->n_kv_head + h];
        max_len = v > max_len ? v : max_len;
    }
    if (graph) max_len = kv->cap; /* fixed split grid: splits past len[h] exit at once */
    int32_t *evict = want_evict ? cc->evict + l : NULL;
    if (hd != 64 && hd != 128) {
        if (want_evict)
            return kvz_error_set(KVZ_ERR_UNSUPPORTED, "CUDA LongFlow eviction needs head_dim 64 or 128");
        naive_attn_kernel<<<dim3(n, c->n_head), NA_THREADS, 0, s>>>(
            a->qkv, nqkv, a->pos, cc->L[l], ob ? *ob : kvz_cuda_outbuf{}, ob ? ob->n_slot : 0, G, a->att, qd);
        KVZ_LAUNCH_CHECK("naive_attn");
        return 0;
    }
    if (n * G <= 32) {
        TRY(kvz_cuda_attn_decode(s, n, c->n_head, a->qkv, nqkv, a->pos, &cc->L[l], (int)max_len, ob,
                                 a->att, qd, cc->dec_ws, cc->dec_ws_bytes, NULL, evict));
    } else {
        TRY(kvz_cuda_attn_prefill(s, n, c->n_head, a->qkv, nqkv, a->pos, &cc->L[l], ob, a->att, qd));
        if (evict) /* the prefill kernel has no LongFlow scores: one decode call for the last query */
            TRY(kvz_cuda_attn_decode(s, 1, c->n_head, a->qkv + (size_t)(n - 1) * nqkv, nqkv,
                                     a->pos + n - 1, &cc->L[l], (int)max_len, ob, a->att1, qd,
                                     cc->dec_ws, cc->dec_ws_bytes, NULL, evict));
    }
    if (evict && ob->n_slot <= kv->n_sink + 1) { /* no evictable slot possible: CPU's fallback */
        evict_fix_kernel<<<1, 32, 0, s>>>(evict, ob->n_slot);
        KVZ_LAUNCH_CHECK("evict_fix");
    }
    return 0;
}

/* Window policy: victim = oldest position among evictable slots (host mirror). */
static int32_t window_victim(const kvz_kv *kv, int32_t l, int32_t newest)
{
    const int32_t B = kv->out_slots, *OP = kv->opos + (size_t)l * B;
    int32_t best = -1;
    for (int32_t j = kv->n_sink; j < B; j++) {
        if (j == newest) continue;
        if (best < 0 || OP[j] < OP[best]) best = j;
    }
    return best >= 0 ? best : B - 1;
}

/* Layer hook (kvz_model.h, kvz_layer_hook): the post-RoPE q and k of the pass's n tokens,
 * still in a->qkv (every RoPE path rotates in place), copied to host bf16 and widened to
 * fp32 in @p hb; the stream is synchronised first, so the cache rows the hook reads
 * (kvz_kv_get_head) are written. Only called when a hook is given. */
typedef struct hook_buf {
    const kvz_layer_hook *hook;
    uint16_t *b16;  /* (n, qd + kvd) staging */
    float *f32;     /* q (n, qd), then k (n, kvd) */
} hook_buf;

static int hook_call(kvz_model *m, kvz_kv *kv, int32_t l, int32_t n, int64_t row0, const act_view *a,
                     const hook_buf *hb)
{
    const kvz_config *c = &m->cfg;
    const cudaStream_t s = m->cuda->s;
    const size_t qd = (size_t)c->n_head * c->head_dim, kvd = (size_t)c->n_kv_head * c->head_dim,
                 nqkv = qd + 2 * kvd, rows = (size_t)n;
    KVZ_CUDA_TRY(cudaMemcpy2DAsync(hb->b16, qd * 2, a->qkv, nqkv * 2, qd * 2, rows, cudaMemcpyDeviceToHost, s));
    KVZ_CUDA_TRY(cudaMemcpy2DAsync(hb->b16 + rows * qd, kvd * 2, a->qkv + qd, nqkv * 2, kvd * 2, rows,
                                   cudaMemcpyDeviceToHost, s));
    KVZ_CUDA_TRY(cudaStreamSynchronize(s));
    for (size_t i = 0; i < rows * (qd + kvd); i++) hb->f32[i] = h_bf2f(hb->b16[i]);
    return hb->hook->fn(hb->hook->ctx, l, hb->f32, hb->f32 + rows * qd, n, row0, kv);
}

/* Per-layer work of one pass, enqueued on the model stream. graph = 1: the batch-1
 * decode step in its capturable form (token, position and fill slot read from
 * cc->step_d, fixed attention split grid, output-buffer slot chosen on the device,
 * no host state touched here); the caller updates the host lengths afterwards. */
static int layers_enqueue(kvz_model *m, kvz_kv *kv, int32_t n, int32_t pos0, act_view *a, int doc,
                          int32_t slot0, int want_evict, int graph, int32_t *newest, const score_args *sa,
                          const hook_buf *hb)
{
    const kvz_config *c = &m->cfg;
    kvz_cuda_model *g = m->cuda;
    kvz_cuda_cache *cc = kv->cuda;
    const cudaStream_t s = g->s;
    const int d = c->n_embd, hd = c->head_dim, qd = c->n_head * hd, kvd = c->n_kv_head * hd,
              ff = c->n_ff, nqkv = qd + 2 * kvd, nkv = c->n_kv_head;
    const kvz_cuda_rope_layout rl = c->rope_adjacent ? KVZ_ROPE_ADJACENT : KVZ_ROPE_HALF;
    const int32_t B = kv->out_slots;
    TRY(kvz_cuda_embed(s, g->tok_embd, c->n_vocab, d, a->tok, n, a->x, KVZ_CUDA_F32));
    for (int32_t l = 0; l < c->n_layer; l++) {
        const cuda_layer *L = &g->L[l];
        const int64_t row0 = kv->len[(size_t)l * nkv]; /* the CPU backend's row0: before the append */
        if (n == 1) { /* decode: RMSNorm inside the qkv GEMV; RoPE fused with the K/V write */
            TRY(kvz_cuda_linear_rmsnorm(g->blas, s, d, nqkv, a->x, L->attn_norm, c->norm_eps, L->wqkv, L->bqkv,
                                        a->qkv, KVZ_CUDA_BF16, 0.f, a->xn));
            if (doc) {
                TRY(kvz_cuda_rope_kv_append(s, c->n_head, nkv, hd, a->qkv, a->pos, c->rope_theta, rl, L->q_norm,
                                            L->k_norm, c->norm_eps, &cc->L[l]));
                if (!graph)
                    for (int h = 0; h < nkv; h++) kv->len[(size_t)l * nkv + h] += 1;
            } else {
                int32_t slot = -1;
                const int32_t *d_fill = NULL, *d_evict = cc->evict + l;
                if (graph) d_fill = cc->step_d + 2;
                else if (slot0 >= 0) slot = slot0;
                else if (kv->out_policy == KVZ_OUT_WINDOW) {
                    slot = window_victim(kv, l, kv->newest[l]);
                    kv->opos[(size_t)l * B + slot] = pos0;
                    *newest = slot;
                }
                TRY(kvz_cuda_rope_outbuf_write(s, c->n_head, nkv, hd, a->qkv, a->pos, c->rope_theta, rl, L->q_norm,
                                               L->k_norm, c->norm_eps, &cc->O[l], slot, d_fill, d_evict));
            }
        } else {
            TRY(kvz_cuda_rmsnorm(s, n, d, c->norm_eps, a->x, NULL, KVZ_CUDA_F32, L->attn_norm, a->xn, KVZ_CUDA_BF16));
            TRY(kvz_cuda_linear(g->blas, s, n, d, nqkv, a->xn, d, L->wqkv, L->bqkv, a->qkv, KVZ_CUDA_BF16, nqkv, 0.f));
            TRY(kvz_cuda_rope(s, n, c->n_head, nkv, hd, a->qkv, nqkv, a->qkv + qd, nqkv, a->pos, c->rope_theta,
                              rl, L->q_norm, L->k_norm, c->norm_eps));
            const bf16 *kn = a->qkv + qd, *vn = a->qkv + qd + kvd;
            if (doc) {
                TRY(kvz_cuda_kv_append(s, &cc->L[l], n, kn, nqkv, vn, nqkv, a->pos));
                if (!graph)
                    for (int h = 0; h < nkv; h++) kv->len[(size_t)l * nkv + h] += n;
            } else if (graph) {
                TRY(kvz_cuda_outbuf_write_dev(s, &cc->O[l], nkv, hd, kn, nqkv, vn, nqkv, a->pos, cc->step_d + 2,
                                              cc->evict + l));
            } else if (slot0 >= 0) {
                TRY(kvz_cuda_outbuf_write(s, &cc->O[l], nkv, hd, n, kn, nqkv, vn, nqkv, a->pos, slot0, NULL));
            } else if (kv->out_policy == KVZ_OUT_WINDOW) {
                int32_t v = window_victim(kv, l, kv->newest[l]);
                TRY(kvz_cuda_outbuf_write(s, &cc->O[l], nkv, hd, 1, kn, nqkv, vn, nqkv, a->pos, v, NULL));
                kv->opos[(size_t)l * B + v] = pos0;
                *newest = v;
            } else {
                TRY(kvz_cuda_outbuf_write(s, &cc->O[l], nkv, hd, 1, kn, nqkv, vn, nqkv, a->pos, -1, cc->evict + l));
            }
        }
        if (hb) TRY(hook_call(m, kv, l, n, row0, a, hb));
        if (sa) {
            const int32_t ctx_end = sa->n_prefix + sa->n_ctx;
            const int last = l == c->n_layer - 1;
            for (int32_t i = 0; i < sa->n_ch; i++) {
                const kvz_repeat_chunk *k = &sa->ch[i];
                const kvz_cuda_kvzip_rows rows = {sa->n_prefix, sa->n_prefix + k->c0, sa->n_prefix + k->c1, ctx_end,
                                                  ctx_end + sa->r0[i], ctx_end + sa->r0[i] + k->n};
                const bf16 *q = a->qkv + (size_t)sa->r0[i] * nqkv;
                const int32_t *qp = a->pos + sa->r0[i];
                float *sc = cc->scores + (size_t)l * nkv * sa->n_ctx + k->c0;
                if (last) {
                    /* last layer: its scores are all the repeat pass still needs, so score over
                     * the key subset alone (two passes over K̄) and skip the attention over the
                     * whole context, the output projection and the MLP */
                    TRY(kvz_cuda_kvzip_score(s, k->n, c->n_head, q, nqkv, qp, &cc->L[l], &rows, sc, sa->n_ctx,
                                             cc->score_ws, cc->score_ws_bytes, a->att + (size_t)sa->r0[i] * qd, qd));
                    continue;
                }
                /* the attention the hidden states need, with the subset statistics fused in;
                 * then one pass over the chunk keys */
                TRY(kvz_cuda_attn_prefill_kvzip(s, k->n, c->n_head, q, nqkv, qp, &cc->L[l],
                                                a->att + (size_t)sa->r0[i] * qd, qd, &rows, cc->score_ws,
                                                cc->score_ws_bytes));
                TRY(kvz_cuda_kvzip_score_fused(s, k->n, c->n_head, q, nqkv, qp, &cc->L[l], rows.c0, rows.c1, sc,
                                               sa->n_ctx, cc->score_ws, cc->score_ws_bytes));
            }
            if (last) break;
        } else {
            TRY(attention(m, kv, l, n, a, !doc, want_evict, graph));
        }
        TRY(kvz_cuda_linear(g->blas, s, n, qd, d, a->att, qd, L->wo, NULL, a->x, KVZ_CUDA_F32, d, 1.f));
        if (n == 1) { /* decode: RMSNorm and SwiGLU inside the gate|up GEMV */
            TRY(kvz_cuda_linear_rmsnorm_swiglu(g->blas, s, d, ff, a->x, L->ffn_norm, c->norm_eps, L->wgu, a->hb,
                                               a->xn, a->gu));
        } else {
            TRY(kvz_cuda_rmsnorm(s, n, d, c->norm_eps, a->x, NULL, KVZ_CUDA_F32, L->ffn_norm, a->xn, KVZ_CUDA_BF16));
            TRY(kvz_cuda_linear(g->blas, s, n, d, 2 * ff, a->xn, d, L->wgu, NULL, a->gu, KVZ_CUDA_BF16, 2 * ff, 0.f));
            TRY(kvz_cuda_swiglu(s, n, ff, a->gu, 2 * ff, a->gu + ff, 2 * ff, a->hb, ff));
        }
        TRY(kvz_cuda_linear(g->blas, s, n, ff, d, a->hb, ff, L->wdown, NULL, a->x, KVZ_CUDA_F32, d, 1.f));
    }
    return 0;
}

static int graph_wanted(void)
{
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("KVZ_CUDA_GRAPH");
        on = !(e && e[0] == '0');
    }
    return on;
}

/* Batch-1 decode step through a CUDA graph: captured on the second step with the same
 * shape (the first runs the same kernels eagerly), replayed afterwards. Inputs go to
 * cc->step_d from a pinned ring; logits (if wanted) come back after the replay. */
static int decode_graph_step(kvz_model *m, kvz_kv *kv, int32_t tok, int32_t pos0, float *logits,
                             int doc, int32_t slot0, int want_evict)
{
    const kvz_config *c = &m->cfg;
    kvz_cuda_cache *cc = kv->cuda;
    const cudaStream_t s = m->cuda->s;
    const size_t V = (size_t)c->n_vocab;
    act_view a;
    TRY(ensure_act(kv, 1, &a));
    if (logits && !cc->logits) TRY(dmalloc((void **)&cc->logits, (size_t)KVZ_GPU_LOGIT_ROWS * V * 4, "logits"));
    if (!cc->step_d) {
        TRY(dmalloc((void **)&cc->step_d, 16, "decode step inputs"));
        KVZ_CUDA_TRY(cudaHostAlloc((void **)&cc->step_h, GRAPH_RING * 16, cudaHostAllocDefault));
        for (int i = 0; i < GRAPH_RING; i++)
            KVZ_CUDA_TRY(cudaEventCreateWithFlags(&cc->step_ev[i], cudaEventDisableTiming));
    }
    int32_t *in = cc->step_h + 4 * cc->step_i;
    KVZ_CUDA_TRY(cudaEventSynchronize(cc->step_ev[cc->step_i])); /* this entry's last copy is done */
    in[0] = tok;
    in[1] = pos0;
    in[2] = slot0; /* >= 0: filling slot; -1: the victim of the last step (evict[l]) */
    in[3] = 0;
    KVZ_CUDA_TRY(cudaMemcpyAsync(cc->step_d, in, 16, cudaMemcpyHostToDevice, s));
    KVZ_CUDA_TRY(cudaEventRecord(cc->step_ev[cc->step_i], s));
    cc->step_i = (cc->step_i + 1) % GRAPH_RING;
    a.tok = cc->step_d;
    a.pos = cc->step_d + 1;

    kvz_cuda_cache::graph_key key;
    memset(&key, 0, sizeof key);
    key.k = cc->k; key.ok = cc->ok; key.act = cc->act; key.logits = logits ? cc->logits : NULL;
    key.act_T = cc->act_T; key.doc = doc; key.want = logits != NULL; key.n_sink = kv->n_sink; key.policy = kv->out_policy;
    if (memcmp(&key, &cc->gkey, sizeof key)) {
        if (cc->gexec) cudaGraphExecDestroy(cc->gexec);
        cc->gexec = NULL;
        cc->gkey = key;
        cc->gseen = 0;
    }
    int32_t newest = -1;
    auto enqueue = [&]() -> int {
        TRY(layers_enqueue(m, kv, 1, pos0, &a, doc, slot0, want_evict, 1, &newest, NULL, NULL));
        if (logits) {
            TRY(kvz_cuda_linear_rmsnorm(m->cuda->blas, s, c->n_embd, c->n_vocab, a.x, m->cuda->out_norm,
                                        c->norm_eps, m->cuda->output, NULL, cc->logits, KVZ_CUDA_F32, 0.f, a.xn));
        }
        return 0;
    };
    if (!cc->gexec && cc->gseen >= 1 && !cc->gdisabled) {
        cudaGraph_t graph = NULL;
        int rc = 0;
        if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) rc = KVZ_ERR_CUDA;
        if (!rc) {
            rc = enqueue();
            cudaError_t e = cudaStreamEndCapture(s, &graph);
            if (!rc && e != cudaSuccess) rc = KVZ_ERR_CUDA;
        }
        if (!rc && cudaGraphInstantiate(&cc->gexec, graph, 0) != cudaSuccess) {
            cc->gexec = NULL;
            rc = KVZ_ERR_CUDA;
        }
        if (graph) cudaGraphDestroy(graph);
        if (rc) { /* fall back to eager launches for this cache */
            cudaGetLastError();
            kvz_error_clear();
            cc->gdisabled = 1;
        }
    }
    if (cc->gexec) {
        KVZ_CUDA_TRY(cudaGraphLaunch(cc->gexec, s));
        g_graph_launches++;
    } else {
        TRY(enqueue());
        cc->gseen++;
    }
    if (logits) {
        KVZ_CUDA_TRY(cudaMemcpyAsync(logits, cc->logits, V * 4, cudaMemcpyDeviceToHost, s));
        KVZ_CUDA_TRY(cudaStreamSynchronize(s));
    }
    return 0;
}

static int forward_batch(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                         float *logits, int want, int to_doc, const score_args *sa, const hook_buf *hb)
{
    const kvz_config *c = &m->cfg;
    kvz_cuda_model *g = m->cuda;
    kvz_cuda_cache *cc = kv->cuda;
    const cudaStream_t s = g->s;
    const int d = c->n_embd, hd = c->head_dim, nkv = c->n_kv_head;
    const int doc = kv->out_slots == 0 || to_doc;
    const size_t nlh = (size_t)c->n_layer * nkv;
    if (doc) {
        for (size_t i = 0; i < nlh; i++)
            if (kv->len[i] + n > kv->cap)
                return kvz_error_set(KVZ_ERR_CONTEXT, "KV cache full: %lld + %d rows exceed "
                                     "capacity %lld", (long long)kv->len[i], n, (long long)kv->cap);
    } else if (n > 1 && kv->out_used[0] + n > kv->out_slots) {
        return kvz_error_set(KVZ_ERR_CONTEXT, "%d tokens do not fit the output buffer (%d of %d "
                             "slots used); a multi-token pass must fit in the free slots",
                             n, kv->out_used[0], kv->out_slots);
    }
    const int32_t B = kv->out_slots;
    const int tiled = hd == 64 || hd == 128;

    /* output-buffer slots of this pass (same for every layer: they fill in lockstep) */
    int32_t slot0 = -1, newest = -1;
    int full_before = 0, full_after = 0;
    if (!doc) {
        full_before = kv->out_used[0] >= B;
        full_after = full_before || kv->out_used[0] + n >= B;
        if (!full_before) slot0 = kv->out_used[0];
    }
    /* LongFlow: a decode step always scores the buffer (victim unused while it fills),
     * so a step costs the same whether the buffer is filling or full */
    const int longflow = !doc && kv->out_policy == KVZ_OUT_LONGFLOW;
    const int want_evict = longflow && (full_after || (n == 1 && tiled));
    const int graph = n == 1 && !sa && !hb && tiled && c->n_head / nkv <= 32 && graph_wanted() &&
                      (doc || longflow) && (want == KVZ_FWD_NO_LOGITS || logits);
    if (graph) {
        TRY(decode_graph_step(m, kv, tokens[0], pos0, want == KVZ_FWD_NO_LOGITS ? NULL : logits, doc, slot0,
                              want_evict));
        if (doc)
            for (size_t i = 0; i < nlh; i++) kv->len[i] += 1; /* checked against cap above */
    } else {
        act_view a;
        TRY(ensure_act(kv, n, &a));
        KVZ_CUDA_TRY(cudaMemcpyAsync(a.tok, tokens, (size_t)n * 4, cudaMemcpyHostToDevice, s));
        if (sa) {
            KVZ_CUDA_TRY(cudaMemcpyAsync(a.pos, sa->pos, (size_t)n * 4, cudaMemcpyHostToDevice, s));
        } else {
            iota_kernel<<<(n + 255) / 256, 256, 0, s>>>(a.pos, pos0, n);
            KVZ_LAUNCH_CHECK("iota");
        }
        TRY(layers_enqueue(m, kv, n, pos0, &a, doc, slot0, want_evict, 0, &newest, sa, hb));
        if (want != KVZ_FWD_NO_LOGITS && logits) {
            const int32_t first = want == KVZ_FWD_LOGITS_ALL ? 0 : n - 1;
            const size_t V = (size_t)c->n_vocab;
            if (!cc->logits) TRY(dmalloc((void **)&cc->logits, (size_t)KVZ_GPU_LOGIT_ROWS * V * 4, "logits"));
            for (int32_t r0 = first; r0 < n; r0 += KVZ_GPU_LOGIT_ROWS) {
                const int32_t rows = n - r0 < KVZ_GPU_LOGIT_ROWS ? n - r0 : KVZ_GPU_LOGIT_ROWS;
                TRY(kvz_cuda_rmsnorm(s, rows, d, c->norm_eps, a.x + (size_t)r0 * d, NULL, KVZ_CUDA_F32,
                                     g->out_norm, a.xn, KVZ_CUDA_BF16));
                TRY(kvz_cuda_linear(g->blas, s, rows, d, c->n_vocab, a.xn, d, g->output, NULL, cc->logits,
                                    KVZ_CUDA_F32, c->n_vocab, 0.f));
                KVZ_CUDA_TRY(cudaMemcpyAsync(logits + (size_t)(r0 - first) * V, cc->logits,
                                             (size_t)rows * V * 4, cudaMemcpyDeviceToHost, s));
                KVZ_CUDA_TRY(cudaStreamSynchronize(s));
            }
        }
    }
    /* host bookkeeping of the output buffer (mirrors kvz_cpu.c append_kv) */
    if (!doc) {
        for (int32_t l = 0; l < c->n_layer; l++) {
            if (slot0 >= 0) {
                for (int32_t i = 0; i < n; i++) kv->opos[(size_t)l * B + slot0 + i] = pos0 + i;
                kv->out_used[l] += n;
                kv->newest[l] = slot0 + n - 1;
            } else {
                kv->evictions++;
                if (newest >= 0) kv->newest[l] = newest;
            }
        }
    }
    return 0;
}

int forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                   float *logits, int flags, const score_args *sa, const kvz_layer_hook *hook)
{
    const int want = flags & 3;
    const int discard = (flags & KVZ_FWD_DISCARD) != 0;
    if (!kv->cuda) return kvz_error_set(KVZ_ERR_ARG, "CUDA forward: the cache is not on the device");
    if (discard && kv->out_slots && !(flags & KVZ_FWD_TO_DOC))
        return kvz_error_set(KVZ_ERR_ARG, "forward: DISCARD works on the document region only");
    const size_t nlh = (size_t)m->cfg.n_layer * m->cfg.n_kv_head;
    int64_t *saved = NULL;
    if (discard) {
        if (!(saved = (int64_t *)malloc(nlh * sizeof *saved))) return KVZ_ERR_NOMEM;
        memcpy(saved, kv->len, nlh * sizeof *saved);
    }
    int rc = 0;
    hook_buf hbuf = {hook, NULL, NULL};
    if (hook) { /* host staging for the largest batch of this call */
        const size_t qkd = (size_t)(m->cfg.n_head + m->cfg.n_kv_head) * m->cfg.head_dim,
                     nb = (size_t)(n < KVZ_GPU_MAX_BATCH ? n : KVZ_GPU_MAX_BATCH);
        hbuf.b16 = (uint16_t *)malloc(nb * qkd * 2);
        hbuf.f32 = (float *)malloc(nb * qkd * 4);
        if (!hbuf.b16 || !hbuf.f32) rc = kvz_error_set(KVZ_ERR_NOMEM, "forward: layer hook buffers");
    }
    for (int32_t s0 = 0; s0 < n && !rc; s0 += KVZ_GPU_MAX_BATCH) {
        const int32_t nb = n - s0 < KVZ_GPU_MAX_BATCH ? n - s0 : KVZ_GPU_MAX_BATCH;
        const int last = s0 + nb == n;
        float *lg = NULL;
        int w = KVZ_FWD_NO_LOGITS;
        if (logits && want == KVZ_FWD_LOGITS_ALL) {
            lg = logits + (size_t)s0 * m->cfg.n_vocab;
            w = KVZ_FWD_LOGITS_ALL;
        } else if (logits && want == KVZ_FWD_LOGITS_LAST && last) {
            lg = logits;
            w = KVZ_FWD_LOGITS_LAST;
        }
        rc = forward_batch(m, kv, tokens + s0, nb, pos0 + s0, lg, w, (flags & KVZ_FWD_TO_DOC) != 0, sa,
                           hook ? &hbuf : NULL);
    }
    free(hbuf.b16);
    free(hbuf.f32);
    if (discard) {
        memcpy(kv->len, saved, nlh * sizeof *saved);
        free(saved);
        int rc2 = kvz_cuda_kv_sync(kv, 0);
        if (!rc) rc = rc2;
    }
    return rc;
}

extern "C" int kvz_cuda_forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n,
                                int32_t pos0, float *logits, int flags, const kvz_layer_hook *hook)
{
    return forward(m, kv, tokens, n, pos0, logits, flags, NULL, hook && hook->fn ? hook : NULL);
}
