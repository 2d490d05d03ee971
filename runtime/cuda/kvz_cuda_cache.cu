/* CUDA backend: the KV cache in HBM. Per layer K/V (n_kv, cap, hd) bf16 + pos
 * (n_kv, cap) + len (n_kv), LongFlow output buffer (n_kv, B, hd) + slot_pos (B). The host
 * keeps the lengths (kv->len, out_used) as the source of truth; the device len follows by
 * kv_append and is re-pushed (kvz_cuda_kv_sync) whenever the host changes it. */
#include "kvz_cuda_impl.cuh"

/* ====================================================================== */
/* cache                                                                    */

extern "C" int kvz_cuda_kv_sync(kvz_kv *kv, int reset_out)
{
    kvz_cuda_cache *cc = kv->cuda;
    if (!cc) return 0;
    const size_t nlh = (size_t)kv->n_layer * kv->n_kv_head;
    for (size_t i = 0; i < nlh; i++) cc->len_h[i] = (int32_t)kv->len[i];
    const cudaStream_t s = kv->m->cuda->s;
    KVZ_CUDA_TRY(cudaMemcpyAsync(cc->len, cc->len_h, nlh * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    if (reset_out && cc->opos) {
        KVZ_CUDA_TRY(cudaMemsetAsync(cc->opos, 0xff, (size_t)kv->n_layer * kv->out_slots * sizeof(int32_t), s));
        KVZ_CUDA_TRY(cudaMemsetAsync(cc->evict, 0xff, (size_t)kv->n_layer * sizeof(int32_t), s));
    }
    KVZ_CUDA_TRY(cudaStreamSynchronize(s)); /* len_h is pageable and reused */
    return 0;
}

static void cache_views(kvz_kv *kv)
{
    kvz_cuda_cache *cc = kv->cuda;
    const size_t hd = (size_t)kv->head_dim, nkv = (size_t)kv->n_kv_head, cap = (size_t)kv->cap;
    for (int32_t l = 0; l < kv->n_layer; l++) {
        kvz_cuda_kv *L = &cc->L[l];
        L->k = cc->k + (size_t)l * nkv * cap * hd;
        L->v = cc->v + (size_t)l * nkv * cap * hd;
        L->pos = cc->pos + (size_t)l * nkv * cap;
        L->len = cc->len + (size_t)l * nkv;
        L->n_kv = (int32_t)nkv;
        L->cap = (int32_t)cap;
        L->hd = (int32_t)hd;
    }
}

static int kv_init(kvz_kv *kv)
{
    const kvz_model *m = kv->m;
    const kvz_config *c = &m->cfg;
    if (kv->cap > INT32_MAX / 2) return kvz_error_set(KVZ_ERR_ARG, "CUDA cache: capacity too large");
    kvz_cuda_cache *cc = (kvz_cuda_cache *)calloc(1, sizeof *cc);
    if (!cc) return KVZ_ERR_NOMEM;
    kv->cuda = cc;
    const size_t nl = (size_t)c->n_layer, nkv = (size_t)c->n_kv_head, hd = (size_t)c->head_dim;
    const size_t cap = (size_t)(kv->cap > 0 ? kv->cap : 1), B = (size_t)kv->out_slots;
    cc->L = (kvz_cuda_kv *)calloc(nl, sizeof *cc->L);
    cc->len_h = (int32_t *)calloc(nl * nkv, sizeof(int32_t));
    if (!cc->L || !cc->len_h) return KVZ_ERR_NOMEM;
    /* the large arrays come from the device pool that keeps freed blocks (dmalloc_tmp):
     * a server or an ingest makes and frees a cache per document, and a 1.4 GB cudaMalloc
     * (+ the synchronising cudaFree) was ~1-2 ms of every 32K-token load */
    const cudaStream_t s = m->cuda->s;
    TRY(dmalloc_tmp((void **)&cc->k, nl * nkv * cap * hd * 2, s, "KV cache K"));
    TRY(dmalloc_tmp((void **)&cc->v, nl * nkv * cap * hd * 2, s, "KV cache V"));
    TRY(dmalloc_tmp((void **)&cc->pos, nl * nkv * cap * 4, s, "KV cache pos"));
    TRY(dmalloc((void **)&cc->len, nl * nkv * 4, "KV cache len"));
    TRY(dmalloc((void **)&cc->evict, nl * 4, "LongFlow victims"));
    cache_views(kv);
    if (B) {
        cc->O = (kvz_cuda_outbuf *)calloc(nl, sizeof *cc->O);
        kv->opos = (int32_t *)malloc(nl * B * sizeof(int32_t)); /* host mirror (window policy) */
        if (!cc->O || !kv->opos) return KVZ_ERR_NOMEM;
        TRY(dmalloc((void **)&cc->ok, nl * nkv * B * hd * 2, "output buffer K"));
        TRY(dmalloc((void **)&cc->ov, nl * nkv * B * hd * 2, "output buffer V"));
        TRY(dmalloc((void **)&cc->opos, nl * B * 4, "output buffer pos"));
        for (size_t l = 0; l < nl; l++) {
            kvz_cuda_outbuf *O = &cc->O[l];
            O->k = cc->ok + l * nkv * B * hd;
            O->v = cc->ov + l * nkv * B * hd;
            O->slot_pos = cc->opos + l * B;
            O->n_slot = (int32_t)B;
            O->n_sink = kv->n_sink;
        }
        for (size_t i = 0; i < nl * B; i++) kv->opos[i] = -1;
    }
    /* decode workspace sized for the largest decode call this cache can see */
    const int G = c->n_head / c->n_kv_head, Tmax = 32 / G > 0 ? 32 / G : 1;
    cc->dec_ws_bytes = kvz_cuda_attn_decode_ws_size(Tmax, c->n_head, c->head_dim, (int)cap, (int)B);
    if (cc->dec_ws_bytes) TRY(dmalloc(&cc->dec_ws, cc->dec_ws_bytes, "decode workspace"));
    memset(kv->len, 0, nl * nkv * sizeof *kv->len);
    return kvz_cuda_kv_sync(kv, 1);
}

extern "C" int kvz_cuda_kv_init(kvz_kv *kv)
{
    int rc = kv_init(kv);
    if (rc) kvz_cuda_kv_free(kv);
    return rc;
}

extern "C" void kvz_cuda_kv_free(kvz_kv *kv)
{
    kvz_cuda_cache *cc = kv->cuda;
    if (!cc) return;
    const cudaStream_t s = kv->m->cuda ? kv->m->cuda->s : 0;
    if (kv->m->cuda) cudaStreamSynchronize(s);
    dfree_tmp(cc->k, s); dfree_tmp(cc->v, s); dfree_tmp(cc->pos, s);
    dfree(cc->len); dfree(cc->evict);
    dfree(cc->ok); dfree(cc->ov); dfree(cc->opos);
    dfree(cc->act); dfree(cc->dec_ws); dfree(cc->score_ws); dfree(cc->logits); dfree(cc->scores);
    dfree(cc->exp_d); dfree(cc->step_d);
    if (cc->exp_h) cudaFreeHost(cc->exp_h);
    if (cc->step_h) {
        cudaFreeHost(cc->step_h);
        for (int i = 0; i < GRAPH_RING; i++) cudaEventDestroy(cc->step_ev[i]);
    }
    if (cc->gexec) cudaGraphExecDestroy(cc->gexec);
    free(cc->L); free(cc->O); free(cc->len_h);
    free(cc);
    kv->cuda = NULL;
}

extern "C" int kvz_cuda_kv_set_layer(kvz_kv *kv, int32_t layer, const uint32_t *counts,
                                     const int32_t *pos, const float *k, const float *v)
{
    kvz_cuda_cache *cc = kv->cuda;
    const size_t hd = (size_t)kv->head_dim, cap = (size_t)kv->cap;
    size_t total = 0;
    for (int32_t h = 0; h < kv->n_kv_head; h++) total += counts[h];
    uint16_t *kb = (uint16_t *)malloc((total ? total : 1) * hd * 2);
    uint16_t *vb = (uint16_t *)malloc((total ? total : 1) * hd * 2);
    if (!kb || !vb) { free(kb); free(vb); return KVZ_ERR_NOMEM; }
    for (size_t i = 0; i < total * hd; i++) {
        kb[i] = h_f2bf(k[i]);
        vb[i] = h_f2bf(v[i]);
    }
    const cudaStream_t s = kv->m->cuda->s;
    size_t off = 0;
    int rc = 0;
    for (int32_t h = 0; h < kv->n_kv_head && !rc; h++) {
        const size_t n = counts[h], seg = (size_t)layer * kv->n_kv_head + (size_t)h;
        if (n &&
            (cudaMemcpyAsync(cc->k + seg * cap * hd, kb + off * hd, n * hd * 2, cudaMemcpyHostToDevice, s) ||
             cudaMemcpyAsync(cc->v + seg * cap * hd, vb + off * hd, n * hd * 2, cudaMemcpyHostToDevice, s) ||
             cudaMemcpyAsync(cc->pos + seg * cap, pos + off, n * 4, cudaMemcpyHostToDevice, s)))
            rc = kvz_error_set(KVZ_ERR_CUDA, "set_layer: cudaMemcpyAsync failed");
        kv->len[seg] = (int64_t)n;
        off += n;
    }
    if (!rc) rc = kvz_cuda_kv_sync(kv, 0);
    free(kb);
    free(vb);
    return rc;
}

extern "C" int kvz_cuda_kv_get_head(const kvz_kv *kv, int32_t layer, int32_t head, float *k,
                                    float *v, int32_t *pos)
{
    kvz_cuda_cache *cc = kv->cuda;
    const size_t hd = (size_t)kv->head_dim, cap = (size_t)kv->cap;
    const size_t seg = (size_t)layer * kv->n_kv_head + (size_t)head, n = (size_t)kv->len[seg];
    KVZ_CUDA_TRY(cudaStreamSynchronize(kv->m->cuda->s));
    if (n == 0) return 0;
    uint16_t *b = (uint16_t *)malloc(n * hd * 2);
    if (!b) return KVZ_ERR_NOMEM;
    int rc = 0;
    for (int which = 0; which < 2 && !rc; which++) {
        float *dst = which ? v : k;
        if (!dst) continue;
        const bf16 *src = (which ? cc->v : cc->k) + seg * cap * hd;
        if (cudaMemcpy(b, src, n * hd * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
            rc = kvz_error_set(KVZ_ERR_CUDA, "get_head: cudaMemcpy failed");
            break;
        }
        for (size_t i = 0; i < n * hd; i++) dst[i] = h_bf2f(b[i]);
    }
    if (!rc && pos && cudaMemcpy(pos, cc->pos + seg * cap, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess)
        rc = kvz_error_set(KVZ_ERR_CUDA, "get_head: cudaMemcpy failed");
    free(b);
    return rc;
}

/* One layer's rows [0, len[h]) of every head, back to back, converted on the device to
 * the stored dtype and copied once through pinned memory. Returned pointers are valid
 * until the next call on this cache or kvz_kv_free. */
extern "C" int kvz_cuda_kv_export_layer(const kvz_kv *kv, int32_t layer, uint8_t dtype,
                                        const uint32_t **pos, const void **k, const void **v)
{
    kvz_cuda_cache *cc = kv->cuda;
    if (!cc || layer < 0 || layer >= kv->n_layer || kv->n_kv_head > 64 || dtype > 2)
        return kvz_error_set(KVZ_ERR_ARG, "kv_export_layer: bad arguments");
    /* KVZ_DTYPE_F32 = 0, F16 = 1, BF16 = 2 (format/kvz_blob.h) */
    const kvz_cuda_dtype dt = dtype == 0 ? KVZ_CUDA_F32 : dtype == 1 ? KVZ_CUDA_F16 : KVZ_CUDA_BF16;
    const size_t esz = dtype == 0 ? 4 : 2, hd = (size_t)kv->head_dim;
    int32_t rows[64];
    size_t total = 0;
    for (int32_t h = 0; h < kv->n_kv_head; h++) {
        rows[h] = (int32_t)kv->len[(size_t)layer * kv->n_kv_head + h];
        total += (size_t)rows[h];
    }
    const size_t kb = al256(total * hd * esz), need = 2 * kb + al256(total * 4);
    if (need > cc->exp_d_bytes) {
        dfree(cc->exp_d);
        cc->exp_d = NULL;
        cc->exp_d_bytes = 0;
        TRY(dmalloc(&cc->exp_d, need, "export staging"));
        cc->exp_d_bytes = need;
    }
    if (need > cc->exp_h_bytes) {
        if (cc->exp_h) cudaFreeHost(cc->exp_h);
        cc->exp_h = NULL;
        cc->exp_h_bytes = 0;
        KVZ_CUDA_TRY(cudaHostAlloc(&cc->exp_h, need, cudaHostAllocDefault));
        cc->exp_h_bytes = need;
    }
    const cudaStream_t s = kv->m->cuda->s;
    char *d = (char *)cc->exp_d, *h = (char *)cc->exp_h;
    TRY(kvz_cuda_kv_export(s, &cc->L[layer], rows, dt, d, d + kb, (int32_t *)(d + 2 * kb)));
    const size_t used = 2 * kb + total * 4;
    KVZ_CUDA_TRY(cudaMemcpyAsync(h, d, used, cudaMemcpyDeviceToHost, s));
    KVZ_CUDA_TRY(cudaStreamSynchronize(s));
    *k = h;
    *v = h + kb;
    *pos = (const uint32_t *)(h + 2 * kb);
    return 0;
}

extern "C" int kvz_cuda_kv_out_pos(const kvz_kv *kv, int32_t layer, int32_t *pos)
{
    if (!kv->cuda || !kv->out_slots) return kvz_error_set(KVZ_ERR_ARG, "no device output buffer");
    KVZ_CUDA_TRY(cudaStreamSynchronize(kv->m->cuda->s));
    KVZ_CUDA_TRY(cudaMemcpy(pos, kv->cuda->opos + (size_t)layer * kv->out_slots,
                            (size_t)kv->out_slots * 4, cudaMemcpyDeviceToHost));
    return 0;
}

extern "C" int kvz_cuda_kv_out_rows(const kvz_kv *kv, int32_t layer, uint16_t *k, uint16_t *v)
{
    if (!kv->cuda || !kv->out_slots || layer < 0 || layer >= kv->n_layer)
        return kvz_error_set(KVZ_ERR_ARG, "no device output buffer layer %d", layer);
    const kvz_cuda_outbuf *O = &kv->cuda->O[layer];
    const size_t bytes = (size_t)kv->m->cfg.n_kv_head * O->n_slot * kv->m->cfg.head_dim * 2;
    KVZ_CUDA_TRY(cudaStreamSynchronize(kv->m->cuda->s));
    KVZ_CUDA_TRY(cudaMemcpy(k, O->k, bytes, cudaMemcpyDeviceToHost));
    KVZ_CUDA_TRY(cudaMemcpy(v, O->v, bytes, cudaMemcpyDeviceToHost));
    return 0;
}
