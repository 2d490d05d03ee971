/* KVzip scoring (CPU hook over the repeat pass) and global / uniform selection. */
#include "kvz_kvzip.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#ifdef KVZ_HAVE_CUDA
#include "kvz_model_impl.h" /* kvz_cuda_kvzip_repeat: the device scoring pass */
#endif

void kvz_kvzip_defaults(kvz_kvzip_params *p)
{
    p->ratio = 0.3f;
    p->mode = KVZ_EVICT_GLOBAL;
    p->chunk = KVZ_KVZIP_CHUNK;
    p->overlap = KVZ_KVZIP_OVERLAP;
    p->prefill_chunk = 4096;
}

int kvz_kvzip_repeat_input(const kvz_tokenizer *tok, const int32_t *ctx, int32_t n_ctx,
                           int32_t t, const kvz_kvzip_params *p, kvz_tokens *out)
{
    const int32_t c0 = t * p->chunk;
    const int32_t c1 = c0 + p->chunk < n_ctx ? c0 + p->chunk : n_ctx;
    if (c0 >= n_ctx || t < 0) return kvz_error_set(KVZ_ERR_ARG, "repeat chunk %d out of range", t);
    const char *instr = t == 0 ? KVZ_REPEAT_FIRST : KVZ_REPEAT_NEXT;
    int rc = kvz_tokenizer_encode(tok, instr, strlen(instr), 0, out);
    if (!rc && t > 0) {
        const int32_t k = p->overlap < c0 ? p->overlap : c0;
        for (int32_t i = c0 - k; i < c0 && !rc; i++) rc = kvz_tokens_push(out, ctx[i]);
    }
    if (!rc) rc = kvz_chat_postfix(tok, out);
    for (int32_t i = c0; i < c1 && !rc; i++) rc = kvz_tokens_push(out, ctx[i]);
    return rc;
}

int64_t kvz_kvzip_cache_rows(const kvz_tokenizer *tok, int32_t n_prefix, int32_t n_ctx,
                             const kvz_kvzip_params *p)
{
    kvz_tokens t = {0};
    int64_t extra = 0;
    if (kvz_tokenizer_encode(tok, KVZ_REPEAT_NEXT, strlen(KVZ_REPEAT_NEXT), 0, &t) == 0 &&
        kvz_chat_postfix(tok, &t) == 0)
        extra = (int64_t)t.n;
    kvz_tokens_free(&t);
    const int32_t longest = n_ctx < p->chunk ? n_ctx : p->chunk;
    return (int64_t)n_prefix + n_ctx + extra + p->overlap + longest + 16;
}

/* ------------------------------------------------------------------------ */

int kvz_kvzip_score(kvz_model *m, kvz_kv *kv, const int32_t *prefix, int32_t n_prefix,
                    const int32_t *ctx, int32_t n_ctx, const kvz_kvzip_params *p, float *scores,
                    kvz_progress_fn progress, void *progress_ctx)
{
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    if (!tok) return kvz_error_set(KVZ_ERR_ARG, "kvzip: the model has no tokenizer");
    if (n_ctx <= 0 || n_prefix < 0 || p->chunk <= 0 || p->overlap < 0)
        return kvz_error_set(KVZ_ERR_ARG, "kvzip: bad lengths or parameters");
    const int32_t n_chunks = (n_ctx + p->chunk - 1) / p->chunk;
    int64_t total = (int64_t)n_prefix + n_ctx, done = 0;
    for (int32_t t = 0; t < n_chunks; t++) {
        int32_t mc = n_ctx - t * p->chunk < p->chunk ? n_ctx - t * p->chunk : p->chunk;
        total += mc + 32;
    }
    /* prefill prefix + context in bounded passes */
    int32_t *all = malloc(sizeof(int32_t) * ((size_t)n_prefix + n_ctx));
    if (!all) return KVZ_ERR_NOMEM;
    memcpy(all, prefix, sizeof(int32_t) * (size_t)n_prefix);
    memcpy(all + n_prefix, ctx, sizeof(int32_t) * (size_t)n_ctx);
    int rc = 0;
    const int32_t n_all = n_prefix + n_ctx, step = p->prefill_chunk > 0 ? p->prefill_chunk : 4096;
    for (int32_t s = 0; s < n_all && !rc; s += step) {
        const int32_t nb = n_all - s < step ? n_all - s : step;
        rc = kvz_forward(m, kv, all + s, nb, s, NULL, KVZ_FWD_NO_LOGITS, NULL);
        done += nb;
        if (!rc && progress) rc = progress(progress_ctx, done, total);
    }
    free(all);
    if (rc) return rc;

#ifdef KVZ_HAVE_CUDA
    if (kvz_model_device(m) == KVZ_DEVICE_CUDA) {
        /* device: fused score kernel per layer inside the repeat pass */
        kvz_tokens rin = {0};
        for (int32_t t = 0; t < n_chunks && !rc; t++) {
            rin.n = 0;
            if ((rc = kvz_kvzip_repeat_input(tok, ctx, n_ctx, t, p, &rin))) break;
            const int32_t c0 = t * p->chunk, c1 = c0 + p->chunk < n_ctx ? c0 + p->chunk : n_ctx;
            rc = kvz_cuda_kvzip_repeat(m, kv, rin.ids, (int32_t)rin.n, n_all, n_prefix, c0, c1,
                                       scores, n_ctx);
            done += c1 - c0 + 32;
            if (!rc && progress) rc = progress(progress_ctx, done < total ? done : total, total);
        }
        kvz_tokens_free(&rin);
        return rc;
    }
#endif
    /* CPU: the repeat pass's own attention scores the chunk (kvz_kv_probe) */
    kvz_tokens rin = {0};
    for (int32_t t = 0; t < n_chunks && !rc; t++) {
        rin.n = 0;
        if ((rc = kvz_kvzip_repeat_input(tok, ctx, n_ctx, t, p, &rin))) break;
        const int32_t c0 = t * p->chunk, c1 = c0 + p->chunk < n_ctx ? c0 + p->chunk : n_ctx;
        for (int32_t l = 0; l < c->n_layer; l++)
            for (int32_t h = 0; h < c->n_kv_head; h++)
                memset(scores + ((size_t)l * c->n_kv_head + h) * n_ctx + c0, 0,
                       sizeof(float) * (size_t)(c1 - c0));
        const kvz_kv_probe pr = {.n_prefix = n_prefix, .c0 = (int64_t)n_prefix + c0,
                                 .c1 = (int64_t)n_prefix + c1, .rep_row0 = n_all,
                                 .scores = scores, .stride = n_ctx, .off = c0};
        if ((rc = kvz_kv_set_probe(kv, &pr))) break;
        rc = kvz_forward(m, kv, rin.ids, (int32_t)rin.n, n_all, NULL,
                         KVZ_FWD_NO_LOGITS | KVZ_FWD_DISCARD, NULL);
        kvz_kv_set_probe(kv, NULL);
        done += c1 - c0 + 32;
        if (!rc && progress) rc = progress(progress_ctx, done < total ? done : total, total);
    }
    kvz_tokens_free(&rin);
    return rc;
}

/* ------------------------------------------------------------------------ */

typedef struct scored { float s; uint32_t i; } scored;

static int cmp_scored(const void *a, const void *b)
{
    const scored *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1; /* higher score first */
    return x->i < y->i ? -1 : x->i > y->i;          /* then lower flat index */
}

/* Keep the top k of items (by score desc, index asc); sets keep[item.i]. */
static void keep_top(scored *items, size_t n, size_t k, uint8_t *keep)
{
    if (k == 0) return;
    if (k < n) qsort(items, n, sizeof *items, cmp_scored);
    for (size_t j = 0; j < k && j < n; j++) keep[items[j].i] = 1;
}

int64_t kvz_kvzip_select(const float *scores, int32_t n_layer, int32_t n_kv_head, int32_t n_ctx,
                         float ratio, int32_t mode, uint8_t *keep, uint32_t *counts)
{
    if (!(ratio > 0.0f && ratio <= 1.0f) || n_ctx <= 0)
        return kvz_error_set(KVZ_ERR_ARG, "ratio must be in (0, 1]");
    const size_t heads = (size_t)n_layer * n_kv_head, N = heads * (size_t)n_ctx;
    if (N > UINT32_MAX) return kvz_error_set(KVZ_ERR_ARG, "too many KV pairs");
    memset(keep, 0, N);
    int64_t kept = 0;
    if (mode == KVZ_EVICT_GLOBAL) {
        const size_t k = (size_t)llround((double)N * ratio);
        scored *it = malloc(N * sizeof *it);
        if (!it) return KVZ_ERR_NOMEM;
        for (size_t i = 0; i < N; i++) it[i] = (scored){scores[i], (uint32_t)i};
        keep_top(it, N, k, keep);
        free(it);
        kept = (int64_t)k;
    } else if (mode == KVZ_EVICT_UNIFORM) {
        const size_t k = (size_t)llround((double)n_ctx * ratio);
        scored *it = malloc((size_t)n_ctx * sizeof *it);
        if (!it) return KVZ_ERR_NOMEM;
        for (size_t h = 0; h < heads; h++) {
            for (int32_t j = 0; j < n_ctx; j++)
                it[j] = (scored){scores[h * n_ctx + j], (uint32_t)(h * n_ctx + j)};
            keep_top(it, (size_t)n_ctx, k, keep);
        }
        free(it);
        kept = (int64_t)(k * heads);
    } else {
        return kvz_error_set(KVZ_ERR_ARG, "unknown eviction mode %d", mode);
    }
    if (counts)
        for (size_t h = 0; h < heads; h++) {
            uint32_t cnt = 0;
            for (int32_t j = 0; j < n_ctx; j++) cnt += keep[h * n_ctx + j];
            counts[h] = cnt;
        }
    return kept;
}
