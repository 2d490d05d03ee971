/* CUDA backend: KVzip on the device (DESIGN §3 steps 2-4): batched repeat passes
 * scored by fused kernels, then selection (radix top-k) and in-place compaction. */
#include "kvz_cuda_impl.cuh"

/* ====================================================================== */
/* KVzip on the device                                                      */

extern "C" int kvz_cuda_kvzip_repeat(kvz_model *m, kvz_kv *kv, const int32_t *tokens, const kvz_repeat_chunk *ch,
                                     int32_t n_ch, int32_t pos0, int32_t n_prefix, float *scores, int32_t n_ctx)
{
    const kvz_config *c = &m->cfg;
    kvz_cuda_cache *cc = kv->cuda;
    if (!cc || kv->out_slots) return kvz_error_set(KVZ_ERR_ARG, "kvzip: needs a device cache without output buffer");
    if (c->head_dim != 64 && c->head_dim != 128)
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "CUDA KVzip scoring needs head_dim 64 or 128");
    int64_t n = 0;
    for (int32_t i = 0; i < n_ch; i++) {
        if (ch[i].n <= 0 || ch[i].c0 < 0 || ch[i].c0 > ch[i].c1 || ch[i].c1 > n_ctx)
            return kvz_error_set(KVZ_ERR_ARG, "kvzip_repeat: bad chunk %d (%d tokens, context %d..%d of %d)", i,
                                 ch[i].n, ch[i].c0, ch[i].c1, n_ctx);
        n += ch[i].n;
    }
    if (n_ch <= 0 || n > KVZ_GPU_MAX_BATCH || n_prefix < 0 || n_ctx <= 0)
        return kvz_error_set(KVZ_ERR_ARG, "kvzip_repeat: %d chunks of %lld tokens in all (at most %d per pass)",
                             n_ch, (long long)n, KVZ_GPU_MAX_BATCH);
    const size_t nlh = (size_t)c->n_layer * c->n_kv_head;
    for (size_t i = 0; i < nlh; i++)
        if (kv->len[i] != (int64_t)n_prefix + n_ctx)
            return kvz_error_set(KVZ_ERR_ARG, "kvzip_repeat: the cache must hold exactly prefix + context");
    const int64_t N = (int64_t)nlh * n_ctx;
    if (cc->scores_n != N) {
        dfree(cc->scores);
        cc->scores = NULL;
        cc->scores_n = 0;
        TRY(dmalloc((void **)&cc->scores, (size_t)N * 4, "kvzip scores"));
        cc->scores_n = N;
        KVZ_CUDA_TRY(cudaMemsetAsync(cc->scores, 0, (size_t)N * 4, m->cuda->s));
    }
    int32_t longest = 0;
    for (int32_t i = 0; i < n_ch; i++) longest = ch[i].n > longest ? ch[i].n : longest;
    const size_t wsb = kvz_cuda_kvzip_score_ws_size(longest, c->n_head); /* chunks run one after another */
    if (wsb > cc->score_ws_bytes) {
        dfree(cc->score_ws);
        cc->score_ws = NULL;
        cc->score_ws_bytes = 0;
        TRY(dmalloc(&cc->score_ws, wsb, "kvzip score workspace"));
        cc->score_ws_bytes = wsb;
    }
    int32_t *r0 = (int32_t *)malloc(sizeof(int32_t) * ((size_t)n_ch + (size_t)n));
    if (!r0) return KVZ_ERR_NOMEM;
    int32_t *pos = r0 + n_ch;
    for (int32_t i = 0, r = 0; i < n_ch; r += ch[i].n, i++) {
        r0[i] = r;
        for (int32_t j = 0; j < ch[i].n; j++) pos[r + j] = pos0 + j;
    }
    const score_args sa = {n_prefix, n_ctx, n_ch, ch, r0, pos};
    int rc = forward(m, kv, tokens, (int32_t)n, pos0, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_DISCARD, &sa, NULL);
    free(r0);
    TRY(rc);
    if (!scores) return 0; /* they stay on the device (kvz_cuda_kvzip_select) */
    for (int32_t i = 0; i < n_ch; i++)
        if (ch[i].c1 > ch[i].c0)
            KVZ_CUDA_TRY(cudaMemcpy2DAsync(scores + ch[i].c0, (size_t)n_ctx * 4, cc->scores + ch[i].c0,
                                           (size_t)n_ctx * 4, (size_t)(ch[i].c1 - ch[i].c0) * 4, nlh,
                                           cudaMemcpyDeviceToHost, m->cuda->s));
    KVZ_CUDA_TRY(cudaStreamSynchronize(m->cuda->s));
    return 0;
}

static int64_t kvzip_select(kvz_kv *kv, int32_t n_prefix, int32_t n_ctx, float ratio, int32_t mode,
                            uint8_t *keep, uint32_t *counts)
{
    const kvz_model *m = kv->m;
    const kvz_config *c = &m->cfg;
    kvz_cuda_cache *cc = kv->cuda;
    const cudaStream_t s = m->cuda->s;
    const size_t nlh = (size_t)c->n_layer * c->n_kv_head, N = nlh * (size_t)n_ctx;
    if (!cc || !cc->scores || cc->scores_n != (int64_t)N)
        return kvz_error_set(KVZ_ERR_ARG, "kvzip_select: no device scores for %d context tokens", n_ctx);
    if (!(ratio > 0.0f && ratio <= 1.0f)) return kvz_error_set(KVZ_ERR_ARG, "ratio must be in (0, 1]");
    if (N > INT32_MAX) return kvz_error_set(KVZ_ERR_ARG, "too many KV pairs");
    for (size_t i = 0; i < nlh; i++)
        if (kv->len[i] != (int64_t)n_prefix + n_ctx)
            return kvz_error_set(KVZ_ERR_ARG, "kvzip_select: the cache must hold exactly prefix + context");
    uint8_t *d_keep = NULL;
    int32_t *d_counts = NULL;
    void *ws = NULL;
    bf16 *sk = NULL, *sv = NULL;
    int32_t *spos = NULL;
    int32_t *hc = (int32_t *)malloc(nlh * sizeof(int32_t));
    int64_t kept = 0;
    int rc = hc ? 0 : KVZ_ERR_NOMEM;
    if (!rc) rc = dmalloc_tmp((void **)&d_keep, N, s, "keep mask");
    if (!rc) rc = dmalloc_tmp((void **)&d_counts, nlh * 4, s, "keep counts");
    if (!rc && mode == EVICT_GLOBAL) {
        kept = (int64_t)llround((double)N * ratio);
        size_t wsb = kvz_cuda_topk_ws_size((int64_t)N);
        rc = dmalloc_tmp(&ws, wsb, s, "top-k workspace");
        if (!rc) rc = kvz_cuda_topk_global(s, cc->scores, (int64_t)N, kept, d_keep, ws, wsb);
    } else if (!rc && mode == EVICT_UNIFORM) {
        int k = (int)llround((double)n_ctx * ratio);
        kept = (int64_t)k * (int64_t)nlh;
        rc = kvz_cuda_topk_rows(s, cc->scores, (int)nlh, n_ctx, k, d_keep);
    } else if (!rc) {
        rc = kvz_error_set(KVZ_ERR_ARG, "unknown eviction mode %d", mode);
    }
    if (!rc) rc = kvz_cuda_keep_counts(s, d_keep, (int)nlh, n_ctx, d_counts);
    /* compact layer by layer through a scratch layer of prefix + context rows per head,
     * then copy the kept rows back: the cache keeps its buffers (a fresh cache-sized
     * pair of arrays cost ~4 ms of cudaMalloc/cudaFree per document even at 2K tokens) */
    const size_t hd = (size_t)c->head_dim, rows_s = (size_t)c->n_kv_head * (size_t)(n_prefix + n_ctx);
    kvz_cuda_kv tmp = cc->L[0];
    tmp.cap = n_prefix + n_ctx;
    if (!rc) rc = dmalloc_tmp((void **)&sk, rows_s * hd * 2, s, "compaction scratch K");
    if (!rc) rc = dmalloc_tmp((void **)&sv, rows_s * hd * 2, s, "compaction scratch V");
    if (!rc) rc = dmalloc_tmp((void **)&spos, rows_s * 4 + (size_t)c->n_kv_head * 4, s, "compaction scratch pos");
    tmp.k = sk; tmp.v = sv; tmp.pos = spos; tmp.len = spos + rows_s;
    for (int32_t l = 0; l < c->n_layer && !rc; l++) {
        rc = kvz_cuda_kv_compact(s, &cc->L[l], n_prefix, n_ctx, d_keep + (size_t)l * c->n_kv_head * n_ctx, &tmp);
        if (!rc) rc = kvz_cuda_kv_copy(s, &tmp, &cc->L[l], n_prefix + n_ctx);
    }
    if (!rc && cudaMemcpyAsync(hc, d_counts, nlh * 4, cudaMemcpyDeviceToHost, s) != cudaSuccess)
        rc = kvz_error_set(KVZ_ERR_CUDA, "kvzip_select: counts copy failed");
    if (!rc && keep && cudaMemcpyAsync(keep, d_keep, N, cudaMemcpyDeviceToHost, s) != cudaSuccess)
        rc = kvz_error_set(KVZ_ERR_CUDA, "kvzip_select: keep copy failed");
    if (!rc && cudaStreamSynchronize(s) != cudaSuccess)
        rc = kvz_error_set(KVZ_ERR_CUDA, "kvzip_select: %s", cudaGetErrorString(cudaGetLastError()));
    if (!rc) {
        for (size_t i = 0; i < nlh; i++) {
            kv->len[i] = (int64_t)n_prefix + hc[i];
            if (counts) counts[i] = (uint32_t)hc[i];
        }
        rc = kvz_cuda_kv_sync(kv, 0);
    }
    dfree_tmp(d_keep, s); dfree_tmp(d_counts, s); dfree_tmp(ws, s);
    dfree_tmp(sk, s); dfree_tmp(sv, s); dfree_tmp(spos, s);
    free(hc);
    return rc ? rc : kept;
}

extern "C" int64_t kvz_cuda_kvzip_select(kvz_kv *kv, int32_t n_prefix, int32_t n_ctx, float ratio,
                                         int32_t mode, uint8_t *keep, uint32_t *counts)
{
    return kvzip_select(kv, n_prefix, n_ctx, ratio, mode, keep, counts);
}
