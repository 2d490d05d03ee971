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
 * After the LM head, the argmax of every row on the device (kvz_cuda_argmax: the host
 * rule of kvz_argmax); only the ids and the logits rows the caller wants come back.
 *
 * CUDA graphs survive membership changes: the launch configuration depends only on a
 * coarse shape (n, the largest buffer, the longest head rounded up to a quarter octave,
 * and per layer a representative row sum, which only sizes the attention's splits);
 * the exact lengths, slots and positions are read on the device from the descriptors.
 * Up to KVZ_MB_GRAPHS shapes keep their graph (LRU); see graph_step.
 *
 * Anything else (n == 1, a plain or window-policy cache, other head dims) runs the
 * single-cache forward once per cache, so a batch of one is kvzip-query's path. */
#include "kvz_cuda_impl.cuh"

/* The batched step's graphs (struct mb_graph: one per coarse shape). */
struct mb_graph {
    cudaGraphExec_t exec; /* NULL: seen once, not captured yet */
    int32_t n, max_slot;
    int64_t max_len;      /* the longest head's bucket (mb_bucket) */
    long long *sum;       /* (n_layer) the row sums the split geometry was made from */
    uint64_t used;        /* LRU clock */
};

static void mb_graphs_clear(kvz_cuda_model *g)
{
    for (int32_t i = 0; i < g->mb_ng; i++) {
        if (g->mb_g[i].exec) cudaGraphExecDestroy(g->mb_g[i].exec);
        free(g->mb_g[i].sum);
    }
    g->mb_ng = 0;
}

void kvz_cuda_multi_free(kvz_cuda_model *g)
{
    if (g->mb_g) mb_graphs_clear(g);
    free(g->mb_g);
    g->mb_g = NULL;
}

/* Model-level buffers for n sequences (grown on demand; cudaFree synchronises). The
 * attention workspace is sized for the rows allocated and the bucketed longest head,
 * so it holds for any batch of the graphs' shapes. Any reallocation drops the graphs
 * (they hold the old addresses). */
static int mb_ensure(kvz_model *m, int32_t n, int64_t max_len_b, int32_t max_slot, act_view *a)
{
    kvz_cuda_model *g = m->cuda;
    const kvz_config *c = &m->cfg;
    if (n > g->mb_n) {
        const int32_t nn = n < 32 ? 32 : n;
        mb_graphs_clear(g);
        dfree(g->mb_act);
        g->mb_act = NULL;
        g->mb_n = 0;
        TRY(dmalloc(&g->mb_act, kvz_cuda_act_layout(c, nn, NULL, NULL), "batched activations"));
        g->mb_n = nn;
    }
    kvz_cuda_act_layout(c, g->mb_n, a, (char *)g->mb_act); /* att1: unused here */
    if (n > g->mb_seq_n) {
        const int32_t nn = n < 32 ? 32 : n;
        const size_t bytes = (size_t)c->n_layer * nn * sizeof(kvz_cuda_seq);
        mb_graphs_clear(g);
        dfree(g->mb_seq_d);
        g->mb_seq_d = NULL;
        if (g->mb_seq_h) cudaFreeHost(g->mb_seq_h);
        g->mb_seq_h = NULL;
        g->mb_seq_n = 0;
        TRY(dmalloc((void **)&g->mb_seq_d, bytes, "batch descriptors"));
        /* pinned staging: descriptors, then tokens (nn), positions (nn), argmax ids (nn) */
        KVZ_CUDA_TRY(cudaHostAlloc((void **)&g->mb_seq_h, bytes + 12 * (size_t)nn, cudaHostAllocDefault));
        g->mb_seq_n = nn;
    }
    const size_t ws_bytes = max_len_b > INT32_MAX ? 0 : kvz_cuda_attn_decode_multi_ws_size(g->mb_n, c->n_head,
                                                         c->n_kv_head, c->head_dim, (int)max_len_b, max_slot);
    if (!ws_bytes) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: attention workspace size");
    if (ws_bytes > g->mb_ws_bytes) { /* room for twice the bucket: longer documents joining later keep the graphs */
        const int64_t more = 2 * max_len_b > INT32_MAX ? max_len_b : 2 * max_len_b;
        const size_t want = kvz_cuda_attn_decode_multi_ws_size(g->mb_n, c->n_head, c->n_kv_head, c->head_dim,
                                                               (int)more, max_slot);
        mb_graphs_clear(g);
        dfree(g->mb_ws);
        g->mb_ws = NULL;
        g->mb_ws_bytes = 0;
        TRY(dmalloc(&g->mb_ws, want > ws_bytes ? want : ws_bytes, "batched decode attention workspace"));
        g->mb_ws_bytes = want > ws_bytes ? want : ws_bytes;
    }
    if (n > g->mb_logits_n) {
        const int32_t nn = n < 32 ? 32 : n;
        mb_graphs_clear(g);
        dfree(g->mb_logits);
        g->mb_logits = NULL;
        g->mb_logits_n = 0;
        TRY(dmalloc((void **)&g->mb_logits, (size_t)nn * c->n_vocab * 4 + (size_t)nn * 4, "batched logits"));
        g->mb_logits_n = nn;
    }
    return 0;
}

/* The argmax ids after the logits (mb_ensure). */
static int32_t *mb_top_d(const kvz_model *m)
{
    return (int32_t *)(m->cuda->mb_logits + (size_t)m->cuda->mb_logits_n * m->cfg.n_vocab);
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

/* Longest-head bucket: 64 rows at least, then quarter octaves (2^e·(1 + k/4)), so a
 * bucket is at most 25% above any length in it. */
static int64_t mb_bucket(int64_t v)
{
    if (v <= 64) return 64;
    int e = 0;
    while (((int64_t)1 << (e + 1)) < v) e++; /* 2^e < v <= 2^(e+1) */
    const int64_t step = ((int64_t)1 << e) / 4;
    return (v + step - 1) / step * step;
}

/* a and b within 25% of each other (row sums; both 0 matches) */
static int mb_close(long long a, long long b) { return 4 * a <= 5 * b && 4 * b <= 5 * a; }

/* Run the enqueued step, through a CUDA graph when its coarse shape repeats. What a
 * graph bakes in: n (grids, GEMM shapes, the descriptor stride), max_slot (workspace
 * stride, the LongFlow launch), the longest head's bucket (split count: every head up
 * to the bucket is covered), per layer the row sum that set the split size, and the
 * buffer addresses (a reallocation empties the cache). Everything per step (lengths,
 * slots, victims, positions, tokens) is read from device memory uploaded before the
 * launch. A kept graph serves a step with the same n, max_slot and bucket whose row
 * sums are each within 25% of the graph's (only the split size, i.e. the speed, depends
 * on them); the step then runs with the graph's sums, eager or replayed alike, so a
 * shape's results do not depend on the route. A new shape runs eagerly once (kept as
 * seen); its second step captures and launches; later ones replay. At most
 * KVZ_MB_GRAPHS shapes, the least recently used dropped. A failed capture turns graphs
 * off for the model (eager from then on, as the single-cache decode step does).
 * @p enqueue(sum) enqueues the step with per-layer row sums @p sum. */
template <typename F>
static int graph_step(kvz_model *m, int32_t n, int64_t max_len_b, int32_t max_slot, const long long *sum_len,
                      F enqueue, int32_t *path)
{
    kvz_cuda_model *g = m->cuda;
    const cudaStream_t s = g->s;
    const int32_t NL = m->cfg.n_layer;
    *path = KVZ_STEP_EAGER;
    if (!graph_on() || g->mb_gdisabled) return enqueue(sum_len);
    if (!g->mb_g && !(g->mb_g = (mb_graph *)calloc(KVZ_MB_GRAPHS, sizeof(mb_graph)))) return enqueue(sum_len);
    mb_graph *e = NULL;
    for (int32_t i = 0; i < g->mb_ng; i++) {
        mb_graph *c = &g->mb_g[i];
        if (c->n != n || c->max_slot != max_slot || c->max_len != max_len_b || (e && c->used < e->used)) continue;
        int32_t l = 0;
        while (l < NL && mb_close(sum_len[l], c->sum[l])) l++;
        if (l == NL) e = c;
    }
    g->mb_clock++;
    if (!e) { /* first sight: keep the shape, run eagerly */
        long long *sum = (long long *)malloc((size_t)NL * sizeof(long long));
        if (!sum) return enqueue(sum_len);
        if (g->mb_ng == KVZ_MB_GRAPHS) { /* drop the least recently used */
            mb_graph *lru = &g->mb_g[0];
            for (int32_t i = 1; i < g->mb_ng; i++)
                if (g->mb_g[i].used < lru->used) lru = &g->mb_g[i];
            if (lru->exec) cudaGraphExecDestroy(lru->exec);
            free(lru->sum);
            *lru = g->mb_g[--g->mb_ng];
        }
        e = &g->mb_g[g->mb_ng++];
        memcpy(sum, sum_len, (size_t)NL * sizeof(long long));
        e->exec = NULL;
        e->n = n;
        e->max_slot = max_slot;
        e->max_len = max_len_b;
        e->sum = sum;
        e->used = g->mb_clock;
        return enqueue(e->sum);
    }
    e->used = g->mb_clock;
    if (!e->exec) { /* second sight: capture */
        cudaGraph_t graph = NULL;
        int rc = 0;
        if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) rc = KVZ_ERR_CUDA;
        if (!rc) {
            rc = enqueue(e->sum);
            cudaError_t ce = cudaStreamEndCapture(s, &graph);
            if (!rc && ce != cudaSuccess) rc = KVZ_ERR_CUDA;
        }
        if (!rc && cudaGraphInstantiate(&e->exec, graph, 0) != cudaSuccess) {
            e->exec = NULL;
            rc = KVZ_ERR_CUDA;
        }
        if (graph) cudaGraphDestroy(graph);
        if (rc) { /* eager from now on for this model */
            cudaGetLastError();
            kvz_error_clear();
            g->mb_gdisabled = 1;
            e->exec = NULL;
            return enqueue(e->sum);
        }
        *path = KVZ_STEP_CAPTURE;
    } else {
        *path = KVZ_STEP_REPLAY;
    }
    KVZ_CUDA_TRY(cudaGraphLaunch(e->exec, s));
    g_mb_graph_launches++;
    return 0;
}

extern "C" int kvz_cuda_forward_multi(kvz_model *m, kvz_kv *const *kv, const int32_t *tokens, const int32_t *pos,
                                      int32_t n, float *logits, kvz_step_io *io)
{
    const kvz_config *c = &m->cfg;
    const size_t V = (size_t)c->n_vocab;
    for (int32_t i = 0; i < n; i++) {
        if (kv[i]->m != m) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: cache %d belongs to another model", i);
        if (!kv[i]->cuda) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: cache %d is not on the device", i);
    }
    if (!batchable(m, kv, n)) return kvz_forward_each(m, kv, tokens, pos, n, logits, io);
    kvz_cuda_model *g = m->cuda;
    const cudaStream_t s = g->s;
    const int d = c->n_embd, hd = c->head_dim, nkv = c->n_kv_head, qd = c->n_head * hd, kvd = nkv * hd,
              ff = c->n_ff, nqkv = qd + 2 * kvd, NL = c->n_layer;
    const kvz_cuda_rope_layout rl = c->rope_adjacent ? KVZ_ROPE_ADJACENT : KVZ_ROPE_HALF;

    /* the coarse shape: the longest head's bucket, the largest buffer, per-layer row sums */
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
    const int64_t max_len_b = mb_bucket(max_len);
    act_view a;
    int rc = mb_ensure(m, n, max_len_b, max_slot, &a);
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
    int32_t *top_h = th + 2 * (size_t)g->mb_seq_n;
    int32_t *top_d = mb_top_d(m);
    memcpy(th, tokens, (size_t)n * 4);
    memcpy(th + n, pos, (size_t)n * 4);
    int32_t path = KVZ_STEP_EAGER;
    do {
#define STEP(x)                  \
    if ((rc = (x)) != 0) break
        if (cudaMemcpyAsync(g->mb_seq_d, sh, seq_bytes, cudaMemcpyHostToDevice, s) != cudaSuccess ||
            cudaMemcpyAsync(a.tok, th, (size_t)n * 4, cudaMemcpyHostToDevice, s) != cudaSuccess ||
            cudaMemcpyAsync(a.pos, th + n, (size_t)n * 4, cudaMemcpyHostToDevice, s) != cudaSuccess) {
            rc = kvz_error_set(KVZ_ERR_CUDA, "forward_multi: upload: %s", cudaGetErrorString(cudaGetLastError()));
            break;
        }
        /* the whole step for row sums @p sum (they size the attention's splits only) */
        auto enqueue = [&](const long long *sum) -> int {
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
                STEP(kvz_cuda_attn_decode_multi(s, n, c->n_head, nkv, hd, a.qkv, nqkv, a.pos, sd, (int)max_len_b, sum[l],
                                                max_slot, a.att, qd, g->mb_ws, g->mb_ws_bytes));
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
            STEP(kvz_cuda_argmax(s, g->mb_logits, n, c->n_vocab, c->n_vocab, top_d));
            } while (0);
            return rc;
        };
        rc = graph_step(m, n, max_len_b, max_slot, sum_len, enqueue, &path);
        if (rc) break;
        /* back: the argmax ids, and the wanted logits rows (runs of consecutive rows) */
        cudaError_t e = cudaSuccess;
        if (io && io->top) e = cudaMemcpyAsync(top_h, top_d, (size_t)n * 4, cudaMemcpyDeviceToHost, s);
        for (int32_t i = 0; i < n && e == cudaSuccess;) {
            if (io && io->want_logits && !io->want_logits[i]) { i++; continue; }
            int32_t j = i + 1;
            while (j < n && !(io && io->want_logits && !io->want_logits[j])) j++;
            e = cudaMemcpyAsync(logits + (size_t)i * V, g->mb_logits + (size_t)i * V, (size_t)(j - i) * V * 4,
                                cudaMemcpyDeviceToHost, s);
            i = j;
        }
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
    if (io) {
        io->path = path;
        if (io->top) memcpy(io->top, top_h, (size_t)n * 4);
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
