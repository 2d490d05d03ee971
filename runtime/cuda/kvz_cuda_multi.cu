/* CUDA backend: the continuous-batching step (kvz_cuda_forward_multi, the table's
 * forward_multi): one decode token for each of n different caches of one model.
 *
 * n >= 2 caches that all decode into a LongFlow output buffer (out_slots > n_sink + 1),
 * head_dim 64/128, GQA group <= 32: ONE pass over n rows. Per layer
 *   xn = rmsnorm(x) → qkv = xn·Wqkvᵀ (+b) → rope of the n rows at their own positions
 *   (+ qwen3 q/k norm) → row i's k, v into cache i's buffer slot (its filling slot, or
 *   the LongFlow victim its previous step left in evict[l] on the device)
 *   → attention of row i over cache i's ragged document rows + buffer, cache i's next
 *   victim into its evict[l] → x += att·Woᵀ → rmsnorm → gate|up → SwiGLU → x += ·Wdownᵀ,
 * then the final norm and the LM head for the n rows. Per-sequence state reaches the
 * kernels through kvz_cuda_seq descriptors (kernels/kvz_cuda.h), uploaded once per step
 * for every layer (layer-major), so a step is a fixed number of launches per layer
 * whatever n is. The weights are read once per step for all n rows (GEMM instead of n
 * GEMVs): that is where the batching gain comes from.
 * The math is the single-cache decode step's (kvz_cuda_forward.cu) with the batch-1
 * fused GEMVs replaced by rmsnorm + GEMM (another summation order: fp32-level
 * differences before the bf16 roundings) and another split count in the attention.
 *
 * Anything else (n == 1, a plain or window-policy cache, other head dims) runs the
 * single-cache forward once per cache, so a batch of one is kvzip-query's path. */
#include "kvz_cuda_impl.cuh"

/* activation layout of the batched step for n rows */
static size_t mb_layout(const kvz_config *c, int32_t n, act_view *v, char *base)
{
    const size_t d = (size_t)c->n_embd, qd = (size_t)c->n_head * c->head_dim,
                 nqkv = qd + 2 * (size_t)c->n_kv_head * c->head_dim, ff = (size_t)c->n_ff;
    size_t off = 0;
#define SUB(field, type, count)                                          \
    do {                                                                 \
        if (v) v->field = (type *)(base + off);                          \
        off += al256((size_t)(count) * sizeof(type));                    \
    } while (0)
    SUB(x, float, n * d);
    SUB(xn, bf16, n * d);
    SUB(qkv, bf16, n * nqkv);
    SUB(att, bf16, n * qd);
    SUB(gu, bf16, n * 2 * ff);
    SUB(hb, bf16, n * ff);
    SUB(tok, int32_t, n);
    SUB(pos, int32_t, n);
#undef SUB
    if (v) v->att1 = NULL;
    return off;
}

/* Model-level buffers for n sequences (grown on demand; cudaFree synchronises). */
static int mb_ensure(kvz_model *m, int32_t n, size_t ws_bytes, act_view *a)
{
    kvz_cuda_model *g = m->cuda;
    const kvz_config *c = &m->cfg;
    if (n > g->mb_n) {
        const int32_t nn = n < 32 ? 32 : n;
        dfree(g->mb_act);
        g->mb_act = NULL;
        g->mb_n = 0;
        TRY(dmalloc(&g->mb_act, mb_layout(c, nn, NULL, NULL), "batched activations"));
        g->mb_n = nn;
    }
    mb_layout(c, g->mb_n, a, (char *)g->mb_act);
    if (n > g->mb_seq_n) {
        const int32_t nn = n < 32 ? 32 : n;
        const size_t bytes = (size_t)c->n_layer * nn * sizeof(kvz_cuda_seq);
        dfree(g->mb_seq_d);
        g->mb_seq_d = NULL;
        if (g->mb_seq_h) cudaFreeHost(g->mb_seq_h);
        g->mb_seq_h = NULL;
        g->mb_seq_n = 0;
        TRY(dmalloc((void **)&g->mb_seq_d, bytes, "batch descriptors"));
        /* pinned staging: descriptors, then tokens (nn) and positions (nn) */
        KVZ_CUDA_TRY(cudaHostAlloc((void **)&g->mb_seq_h, bytes + 8 * (size_t)nn, cudaHostAllocDefault));
        g->mb_seq_n = nn;
    }
    if (ws_bytes > g->mb_ws_bytes) {
        dfree(g->mb_ws);
        g->mb_ws = NULL;
        g->mb_ws_bytes = 0;
        TRY(dmalloc(&g->mb_ws, ws_bytes, "batched decode attention workspace"));
        g->mb_ws_bytes = ws_bytes;
    }
    if (n > g->mb_logits_n) {
        const int32_t nn = n < 32 ? 32 : n;
        dfree(g->mb_logits);
        g->mb_logits = NULL;
        g->mb_logits_n = 0;
        TRY(dmalloc((void **)&g->mb_logits, (size_t)nn * c->n_vocab * 4, "batched logits"));
        g->mb_logits_n = nn;
    }
    return 0;
}

/* May these caches take the batched pass? (Else: one single-cache forward each.) */
static int batchable(const kvz_model *m, kvz_kv *const *kv, int32_t n)
{
    const kvz_config *c = &m->cfg;
    if (n < 2 || (c->head_dim != 64 && c->head_dim != 128) || c->n_head / c->n_kv_head > 32 || c->n_head > 256)
        return 0;
    for (int32_t i = 0; i < n; i++) {
        const kvz_kv *k = kv[i];
        if (k->out_slots <= 0 || k->out_policy != KVZ_OUT_LONGFLOW || k->out_slots <= k->n_sink + 1) return 0;
    }
    return 1;
}

static uint64_t g_mb_graph_launches;
extern "C" uint64_t kvz_cuda_multi_graph_launches(void) { return g_mb_graph_launches; }

static int graph_on(void)
{
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("KVZ_CUDA_GRAPH");
        on = !(e && e[0] == '0');
    }
    return on;
}

/* Run the enqueued step, through a CUDA graph when the shape repeats: the inputs
 * (descriptors, tokens, positions) are in fixed device buffers uploaded before the
 * launch, so one graph serves any caches of the same shape. Captured on the second
 * step with one shape (the first runs eagerly); a failed capture turns graphs off for
 * the model (eager from then on, as the single-cache decode step does). */
template <typename F>
static int graph_step(kvz_model *m, int32_t n, int64_t max_len, int32_t max_slot, const long long *sum_len,
                      const act_view &a, F enqueue)
{
    kvz_cuda_model *g = m->cuda;
    const cudaStream_t s = g->s;
    const int32_t NL = m->cfg.n_layer;
    if (!graph_on() || g->mb_gdisabled) return enqueue();
    kvz_cuda_model::mb_graph_key key;
    memset(&key, 0, sizeof key);
    key.act = a.x; key.seq = g->mb_seq_d; key.ws = g->mb_ws; key.logits = g->mb_logits;
    key.n = n; key.max_slot = max_slot; key.max_len = max_len;
    if (!g->mb_gsum) {
        g->mb_gsum = (long long *)calloc((size_t)NL, sizeof(long long));
        if (!g->mb_gsum) return enqueue();
    }
    if (memcmp(&key, &g->mb_gkey, sizeof key) || memcmp(sum_len, g->mb_gsum, (size_t)NL * sizeof(long long))) {
        if (g->mb_gexec) cudaGraphExecDestroy(g->mb_gexec);
        g->mb_gexec = NULL;
        g->mb_gkey = key;
        memcpy(g->mb_gsum, sum_len, (size_t)NL * sizeof(long long));
        g->mb_gseen = 0;
    }
    if (!g->mb_gexec && g->mb_gseen >= 1) {
        cudaGraph_t graph = NULL;
        int rc = 0;
        if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) rc = KVZ_ERR_CUDA;
        if (!rc) {
            rc = enqueue();
            cudaError_t e = cudaStreamEndCapture(s, &graph);
            if (!rc && e != cudaSuccess) rc = KVZ_ERR_CUDA;
        }
        if (!rc && cudaGraphInstantiate(&g->mb_gexec, graph, 0) != cudaSuccess) {
            g->mb_gexec = NULL;
            rc = KVZ_ERR_CUDA;
        }
        if (graph) cudaGraphDestroy(graph);
        if (rc) { /* eager from now on for this model */
            cudaGetLastError();
            kvz_error_clear();
            g->mb_gdisabled = 1;
            g->mb_gexec = NULL;
        }
    }
    if (g->mb_gexec) {
        KVZ_CUDA_TRY(cudaGraphLaunch(g->mb_gexec, s));
        g_mb_graph_launches++;
        return 0;
    }
    g->mb_gseen++;
    return enqueue();
}

extern "C" int kvz_cuda_forward_multi(kvz_model *m, kvz_kv *const *kv, const int32_t *tokens, const int32_t *pos,
                                      int32_t n, float *logits)
{
    const kvz_config *c = &m->cfg;
    const size_t V = (size_t)c->n_vocab;
    for (int32_t i = 0; i < n; i++) {
        if (kv[i]->m != m) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: cache %d belongs to another model", i);
        if (!kv[i]->cuda) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: cache %d is not on the device", i);
    }
    if (!batchable(m, kv, n)) {
        for (int32_t i = 0; i < n; i++)
            TRY(forward(m, kv[i], tokens + i, 1, pos[i], logits + (size_t)i * V, KVZ_FWD_LOGITS_LAST, NULL, NULL));
        return 0;
    }
    kvz_cuda_model *g = m->cuda;
    const cudaStream_t s = g->s;
    const int d = c->n_embd, hd = c->head_dim, nkv = c->n_kv_head, qd = c->n_head * hd, kvd = nkv * hd,
              ff = c->n_ff, nqkv = qd + 2 * kvd, NL = c->n_layer;
    const kvz_cuda_rope_layout rl = c->rope_adjacent ? KVZ_ROPE_ADJACENT : KVZ_ROPE_HALF;

    /* split grid and workspace follow the longest cache and the largest buffer */
    int64_t max_len = 0;
    int32_t max_slot = 0;
    long long *sum_len = (long long *)calloc((size_t)NL, sizeof *sum_len); /* per layer, over caches and heads */
    if (!sum_len) return kvz_error_set(KVZ_ERR_NOMEM, "forward_multi: lengths");
    for (int32_t i = 0; i < n; i++) {
        for (int32_t l = 0; l < NL; l++)
            for (int32_t h = 0; h < nkv; h++) {
                const int64_t v = kv[i]->len[(size_t)l * nkv + h];
                max_len = v > max_len ? v : max_len;
                sum_len[l] += v;
            }
        max_slot = kv[i]->out_slots > max_slot ? kv[i]->out_slots : max_slot;
    }
    const size_t ws = max_len > INT32_MAX ? 0 : kvz_cuda_attn_decode_multi_ws_size(n, c->n_head, nkv, hd, (int)max_len, max_slot);
    act_view a;
    int rc = ws ? mb_ensure(m, n, ws, &a) : kvz_error_set(KVZ_ERR_ARG, "forward_multi: attention workspace size");
    if (rc) {
        free(sum_len);
        return rc;
    }

    /* descriptors (layer-major), tokens, positions: one upload. The pinned staging is
     * free: the previous step synchronised before returning. */
    kvz_cuda_seq *sh = g->mb_seq_h;
    int32_t *slot = (int32_t *)malloc((size_t)n * sizeof *slot);
    if (!slot) {
        free(sum_len);
        return kvz_error_set(KVZ_ERR_NOMEM, "forward_multi: slots");
    }
    for (int32_t i = 0; i < n; i++) {
        const kvz_kv *k = kv[i];
        slot[i] = k->out_used[0] < k->out_slots ? k->out_used[0] : -1; /* filling, or the device's victim */
    }
    for (int32_t l = 0; l < NL; l++)
        for (int32_t i = 0; i < n; i++) {
            kvz_cuda_seq *q = sh + (size_t)l * n + i;
            memset(q, 0, sizeof *q);
            q->kv = kv[i]->cuda->L[l];
            q->ob = kv[i]->cuda->O[l];
            q->ob.n_sink = kv[i]->n_sink;
            q->slot = slot[i];
            q->evict = kv[i]->cuda->evict + l;
        }
    const size_t seq_bytes = (size_t)NL * n * sizeof(kvz_cuda_seq);
    int32_t *th = (int32_t *)((char *)sh + (size_t)NL * g->mb_seq_n * sizeof(kvz_cuda_seq));
    memcpy(th, tokens, (size_t)n * 4);
    memcpy(th + n, pos, (size_t)n * 4);
    do {
#define STEP(x)                  \
    if ((rc = (x)) != 0) break
        if (cudaMemcpyAsync(g->mb_seq_d, sh, seq_bytes, cudaMemcpyHostToDevice, s) != cudaSuccess ||
            cudaMemcpyAsync(a.tok, th, (size_t)n * 4, cudaMemcpyHostToDevice, s) != cudaSuccess ||
            cudaMemcpyAsync(a.pos, th + n, (size_t)n * 4, cudaMemcpyHostToDevice, s) != cudaSuccess) {
            rc = kvz_error_set(KVZ_ERR_CUDA, "forward_multi: upload: %s", cudaGetErrorString(cudaGetLastError()));
            break;
        }
        auto enqueue = [&]() -> int {
            int rc = 0;
            do {
            STEP(kvz_cuda_embed(s, g->tok_embd, c->n_vocab, d, a.tok, n, a.x, KVZ_CUDA_F32));
            for (int32_t l = 0; l < NL && !rc; l++) {
                const cuda_layer *L = &g->L[l];
                const kvz_cuda_seq *sd = g->mb_seq_d + (size_t)l * n;
                STEP(kvz_cuda_rmsnorm(s, n, d, c->norm_eps, a.x, NULL, KVZ_CUDA_F32, L->attn_norm, a.xn, KVZ_CUDA_BF16));
                STEP(kvz_cuda_linear(g->blas, s, n, d, nqkv, a.xn, d, L->wqkv, L->bqkv, a.qkv, KVZ_CUDA_BF16, nqkv, 0.f));
                STEP(kvz_cuda_rope(s, n, c->n_head, nkv, hd, a.qkv, nqkv, a.qkv + qd, nqkv, a.pos, c->rope_theta, rl,
                                   L->q_norm, L->k_norm, c->norm_eps));
                STEP(kvz_cuda_outbuf_write_multi(s, n, nkv, hd, a.qkv + qd, nqkv, a.qkv + qd + kvd, nqkv, a.pos, sd));
                STEP(kvz_cuda_attn_decode_multi(s, n, c->n_head, nkv, hd, a.qkv, nqkv, a.pos, sd, (int)max_len, sum_len[l], max_slot,
                                                a.att, qd, g->mb_ws, g->mb_ws_bytes));
                STEP(kvz_cuda_linear(g->blas, s, n, qd, d, a.att, qd, L->wo, NULL, a.x, KVZ_CUDA_F32, d, 1.f));
                STEP(kvz_cuda_rmsnorm(s, n, d, c->norm_eps, a.x, NULL, KVZ_CUDA_F32, L->ffn_norm, a.xn, KVZ_CUDA_BF16));
                STEP(kvz_cuda_linear(g->blas, s, n, d, 2 * ff, a.xn, d, L->wgu, NULL, a.gu, KVZ_CUDA_BF16, 2 * ff, 0.f));
                STEP(kvz_cuda_swiglu(s, n, ff, a.gu, 2 * ff, a.gu + ff, 2 * ff, a.hb, ff));
                STEP(kvz_cuda_linear(g->blas, s, n, ff, d, a.hb, ff, L->wdown, NULL, a.x, KVZ_CUDA_F32, d, 1.f));
            }
            if (rc) break;
            STEP(kvz_cuda_rmsnorm(s, n, d, c->norm_eps, a.x, NULL, KVZ_CUDA_F32, g->out_norm, a.xn, KVZ_CUDA_BF16));
            STEP(kvz_cuda_linear(g->blas, s, n, d, c->n_vocab, a.xn, d, g->output, NULL, g->mb_logits, KVZ_CUDA_F32,
                                 c->n_vocab, 0.f));
            } while (0);
            return rc;
        };
        rc = graph_step(m, n, max_len, max_slot, sum_len, a, enqueue);
        if (rc) break;
        cudaError_t e = cudaMemcpyAsync(logits, g->mb_logits, (size_t)n * V * 4, cudaMemcpyDeviceToHost, s);
        if (e == cudaSuccess) e = cudaStreamSynchronize(s);
        if (e != cudaSuccess) rc = kvz_error_set(KVZ_ERR_CUDA, "forward_multi: %s", cudaGetErrorString(e));
#undef STEP
    } while (0);
    free(sum_len);
    if (rc) {
        cudaStreamSynchronize(s); /* nothing of this step still runs when the caller sees the error */
        free(slot);
        return rc;
    }
    /* host bookkeeping of each output buffer (as forward_batch, one token) */
    for (int32_t i = 0; i < n; i++) {
        kvz_kv *k = kv[i];
        const int32_t B = k->out_slots;
        for (int32_t l = 0; l < NL; l++) {
            if (slot[i] >= 0) {
                k->opos[(size_t)l * B + slot[i]] = pos[i];
                k->out_used[l] += 1;
                k->newest[l] = slot[i];
            } else {
                k->evictions++;
            }
        }
    }
    free(slot);
    return 0;
}
