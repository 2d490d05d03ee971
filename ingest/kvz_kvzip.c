/* KVzip scoring (CPU hook over the repeat pass) and global / uniform selection. */
#include "kvz_kvzip.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_backend.h" /* kvzip_repeat: the device scoring pass, where the backend has one */

void kvz_kvzip_defaults(kvz_kvzip_params *p)
{
    p->ratio = 0.3f;
    p->mode = KVZ_EVICT_GLOBAL;
    p->chunk = KVZ_KVZIP_CHUNK;
    p->overlap = KVZ_KVZIP_OVERLAP;
    p->prefill_chunk = 4096;
    p->repeat_rows = 8192;
    p->one_pass = KVZ_KVZIP_ONE_PASS_MAX;
    p->batch_tokens = KVZ_KVZIP_BATCH_TOKENS;
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

/* Tokens of chunk t's repeat input (kvz_kvzip_repeat_input without building it):
 * instr[0|1] = tokens of the first / next instruction, post = of the postfix. */
static int32_t repeat_len(int32_t n_ctx, int32_t t, const kvz_kvzip_params *p, const int32_t instr[2], int32_t post)
{
    const int32_t c0 = t * p->chunk, c1 = c0 + p->chunk < n_ctx ? c0 + p->chunk : n_ctx;
    const int32_t k = t > 0 ? (p->overlap < c0 ? p->overlap : c0) : 0;
    return instr[t > 0] + k + post + (c1 - c0);
}

int32_t kvz_kvzip_passes(const kvz_model *m, int32_t n_ctx, const kvz_kvzip_params *p, int32_t *first,
                         int64_t *max_tokens)
{
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    if (!tok) return kvz_error_set(KVZ_ERR_ARG, "kvzip: the model has no tokenizer");
    if (n_ctx <= 0 || p->chunk <= 0 || p->overlap < 0) return kvz_error_set(KVZ_ERR_ARG, "kvzip: bad lengths or parameters");
    int32_t instr[2] = {0, 0}, post = 0;
    kvz_tokens t = {0};
    int rc = kvz_tokenizer_encode(tok, KVZ_REPEAT_FIRST, strlen(KVZ_REPEAT_FIRST), 0, &t);
    instr[0] = (int32_t)t.n;
    t.n = 0;
    if (!rc) rc = kvz_tokenizer_encode(tok, KVZ_REPEAT_NEXT, strlen(KVZ_REPEAT_NEXT), 0, &t);
    instr[1] = (int32_t)t.n;
    t.n = 0;
    if (!rc) rc = kvz_chat_postfix(tok, &t);
    post = (int32_t)t.n;
    kvz_tokens_free(&t);
    if (rc) return rc;

    const int32_t n_chunks = (n_ctx + p->chunk - 1) / p->chunk;
    int32_t budget = 0;
    if (kvz_model_backend(m)->kvzip_repeat) budget = p->repeat_rows; /* batched device passes */
    int64_t left = 0, longest = 0;
    for (int32_t c = 0; c < n_chunks; c++) left += repeat_len(n_ctx, c, p, instr, post);
    /* as few passes as the budget allows, as even as the chunk boundaries allow */
    int32_t n_pass = 0, c = 0;
    const int64_t want = budget > 0 ? (left + budget - 1) / budget : n_chunks;
    while (c < n_chunks) {
        const int64_t passes_left = want - n_pass > 1 ? want - n_pass : 1;
        const int64_t target = (left + passes_left - 1) / passes_left;
        int64_t sum = 0;
        first[n_pass++] = c;
        do {
            const int32_t len = repeat_len(n_ctx, c, p, instr, post);
            sum += len;
            c++;
            if (c == n_chunks) break;
            const int32_t nx = repeat_len(n_ctx, c, p, instr, post);
            if (budget <= 0 || sum + nx > budget || sum + nx / 2 > target) break;
        } while (1);
        left -= sum;
        if (sum > longest) longest = sum;
    }
    first[n_pass] = n_chunks;
    if (max_tokens) *max_tokens = longest;
    return n_pass;
}

int64_t kvz_kvzip_cache_rows(const kvz_model *m, int32_t n_prefix, int32_t n_ctx, const kvz_kvzip_params *p)
{
    if (n_ctx <= 0) return (int64_t)n_prefix + 16;
    const int32_t n_chunks = p->chunk > 0 ? (n_ctx + p->chunk - 1) / p->chunk : 1;
    int32_t *first = malloc(sizeof(int32_t) * ((size_t)n_chunks + 1));
    if (!first) return KVZ_ERR_NOMEM;
    int64_t longest = 0;
    const int32_t rc = kvz_kvzip_passes(m, n_ctx, p, first, &longest);
    free(first);
    if (rc < 0) return rc;
    return (int64_t)n_prefix + n_ctx + longest + 16;
}

/* ------------------------------------------------------------------------ */

int kvz_kvzip_score(kvz_model *m, kvz_kv *kv, const int32_t *prefix, int32_t n_prefix,
                    const int32_t *ctx, int32_t n_ctx, const kvz_kvzip_params *p, float *scores,
                    kvz_progress_fn progress, void *progress_ctx)
{
    return kvz_kvzip_prefill_score(m, kv, prefix, n_prefix, 0, ctx, n_ctx, p, scores, progress,
                                   progress_ctx);
}

/* CPU, a document of one chunk: [prefix rows not cached ; context ; repeat input] as one
 * causal pass. The repeat queries see exactly what the second pass of the two-pass
 * scoring sees (prefix, context, their own earlier rows) at the same positions, and the
 * probe takes only their rows (q_pos0); the context rows are the prefill's. Then the
 * repeat rows are dropped. Saves one pass's fixed cost (dequantising every weight tile). */
static int score_one_pass(kvz_model *m, kvz_kv *kv, const int32_t *prefix, int32_t n_prefix,
                          int32_t n_cached, const int32_t *ctx, int32_t n_ctx, const kvz_tokens *rin,
                          float *scores)
{
    const kvz_config *c = kvz_model_config(m);
    const int32_t n_all = n_prefix + n_ctx, n_new = n_all - n_cached, n = n_new + (int32_t)rin->n;
    int32_t *seq = malloc(sizeof(int32_t) * (size_t)n);
    if (!seq) return KVZ_ERR_NOMEM;
    memcpy(seq, prefix + n_cached, sizeof(int32_t) * (size_t)(n_prefix - n_cached));
    memcpy(seq + (n_prefix - n_cached), ctx, sizeof(int32_t) * (size_t)n_ctx);
    memcpy(seq + n_new, rin->ids, sizeof(int32_t) * rin->n);
    memset(scores, 0, sizeof(float) * (size_t)c->n_layer * c->n_kv_head * (size_t)n_ctx);
    const kvz_kv_probe pr = {.n_prefix = n_prefix, .c0 = n_prefix, .c1 = n_all, .rep_row0 = n_all,
                             .scores = scores, .stride = n_ctx, .off = 0, .q_pos0 = n_all};
    int rc = kvz_kv_set_probe(kv, &pr);
    if (!rc) rc = kvz_forward(m, kv, seq, n, n_cached, NULL, KVZ_FWD_NO_LOGITS, NULL);
    kvz_kv_set_probe(kv, NULL);
    if (!rc) kvz_kv_truncate(kv, n_all); /* the repeat input's rows */
    free(seq);
    return rc;
}

int kvz_kvzip_prefill_score(kvz_model *m, kvz_kv *kv, const int32_t *prefix, int32_t n_prefix,
                            int32_t n_cached, const int32_t *ctx, int32_t n_ctx,
                            const kvz_kvzip_params *p, float *scores, kvz_progress_fn progress,
                            void *progress_ctx)
{
    if (n_ctx <= 0 || n_prefix < 0 || n_cached < 0 || n_cached > n_prefix || p->chunk <= 0 ||
        p->overlap < 0)
        return kvz_error_set(KVZ_ERR_ARG, "kvzip: bad lengths or parameters");
    const int32_t n_chunks = (n_ctx + p->chunk - 1) / p->chunk;
    const int32_t n_all = n_prefix + n_ctx, step = p->prefill_chunk > 0 ? p->prefill_chunk : 4096;
    int64_t total = (int64_t)n_all - n_cached, done = 0;
    for (int32_t t = 0; t < n_chunks; t++) {
        int32_t mc = n_ctx - t * p->chunk < p->chunk ? n_ctx - t * p->chunk : p->chunk;
        total += mc + 32;
    }
    int rc = 0;
    if (p->one_pass > 0 && n_chunks == 1 && scores && kvz_model_device(m) == KVZ_DEVICE_CPU) {
        const kvz_tokenizer *tok = kvz_model_tokenizer(m);
        if (!tok) return kvz_error_set(KVZ_ERR_ARG, "kvzip: the model has no tokenizer");
        kvz_tokens rin = {0};
        rc = kvz_kvzip_repeat_input(tok, ctx, n_ctx, 0, p, &rin);
        const int64_t n = (int64_t)(n_all - n_cached) + (int64_t)rin.n;
        const int fits = !rc && n <= step && n <= p->one_pass;
        if (fits) rc = score_one_pass(m, kv, prefix, n_prefix, n_cached, ctx, n_ctx, &rin, scores);
        kvz_tokens_free(&rin);
        if (rc) return rc;
        if (fits) return progress ? progress(progress_ctx, total, total) : 0;
    }
    /* prefill the rest of the prefix + the context in bounded passes, then score */
    int32_t *all = malloc(sizeof(int32_t) * ((size_t)n_all - n_cached));
    if (!all) return KVZ_ERR_NOMEM;
    memcpy(all, prefix + n_cached, sizeof(int32_t) * (size_t)(n_prefix - n_cached));
    memcpy(all + (n_prefix - n_cached), ctx, sizeof(int32_t) * (size_t)n_ctx);
    for (int32_t s = n_cached; s < n_all && !rc; s += step) {
        const int32_t nb = n_all - s < step ? n_all - s : step;
        rc = kvz_forward(m, kv, all + (s - n_cached), nb, s, NULL, KVZ_FWD_NO_LOGITS, NULL);
        done += nb;
        if (!rc && progress) rc = progress(progress_ctx, done, total);
    }
    free(all);
    if (rc) return rc;
    return kvz_kvzip_score_chunks(m, kv, n_prefix, ctx, n_ctx, p, scores, progress, progress_ctx, done, total);
}

int kvz_kvzip_score_chunks(kvz_model *m, kvz_kv *kv, int32_t n_prefix, const int32_t *ctx, int32_t n_ctx,
                           const kvz_kvzip_params *p, float *scores, kvz_progress_fn progress,
                           void *progress_ctx, int64_t done, int64_t total)
{
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    if (!tok) return kvz_error_set(KVZ_ERR_ARG, "kvzip: the model has no tokenizer");
    if (n_ctx <= 0 || n_prefix < 0 || p->chunk <= 0 || p->overlap < 0)
        return kvz_error_set(KVZ_ERR_ARG, "kvzip: bad lengths or parameters");
    const int32_t n_chunks = (n_ctx + p->chunk - 1) / p->chunk, n_all = n_prefix + n_ctx;
    int32_t *first = malloc(sizeof(int32_t) * ((size_t)n_chunks + 1));
    if (!first) return KVZ_ERR_NOMEM;
    const int32_t n_pass = kvz_kvzip_passes(m, n_ctx, p, first, NULL);
    int rc = n_pass < 0 ? n_pass : 0;
    kvz_tokens rin = {0};

    const kvz_backend *be = kvz_model_backend(m);
    if (be->kvzip_repeat) {
        /* device: the chunks of a pass run as one batch; fused score kernels per layer */
        kvz_repeat_chunk *ch = malloc(sizeof *ch * (size_t)n_chunks);
        if (!ch) rc = KVZ_ERR_NOMEM;
        for (int32_t i = 0; i < n_pass && !rc; i++) {
            rin.n = 0;
            int32_t nc = 0;
            for (int32_t t = first[i]; t < first[i + 1] && !rc; t++, nc++) {
                const size_t before = rin.n;
                if ((rc = kvz_kvzip_repeat_input(tok, ctx, n_ctx, t, p, &rin))) break;
                ch[nc].n = (int32_t)(rin.n - before);
                ch[nc].c0 = t * p->chunk;
                ch[nc].c1 = ch[nc].c0 + p->chunk < n_ctx ? ch[nc].c0 + p->chunk : n_ctx;
                done += ch[nc].c1 - ch[nc].c0 + 32;
            }
            if (!rc) rc = be->kvzip_repeat(m, kv, rin.ids, ch, nc, n_all, n_prefix, scores, n_ctx);
            if (!rc && progress) rc = progress(progress_ctx, done < total ? done : total, total);
        }
        free(ch);
        kvz_tokens_free(&rin);
        free(first);
        return rc;
    }
    /* CPU: the repeat pass's own attention scores the chunk (kvz_kv_probe) */
    if (!rc && !scores) rc = kvz_error_set(KVZ_ERR_ARG, "kvzip: the CPU backend needs a score array");
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
    free(first);
    return rc;
}

int32_t kvz_kvzip_batch_len(const kvz_model *m, int32_t n_ctx, const kvz_kvzip_params *p)
{
    if (n_ctx <= 0 || p->chunk <= 0 || p->overlap < 0) return kvz_error_set(KVZ_ERR_ARG, "kvzip: bad lengths or parameters");
    if (kvz_model_device(m) != KVZ_DEVICE_CPU || p->one_pass <= 0 || n_ctx > p->chunk) return 0;
    int32_t first[2];
    int64_t len = 0;
    const int32_t rc = kvz_kvzip_passes(m, n_ctx, p, first, &len);
    if (rc < 0) return rc;
    const int32_t step = p->prefill_chunk > 0 ? p->prefill_chunk : 4096;
    len += n_ctx;
    return len <= p->one_pass && len <= step && len <= 1024 ? (int32_t)len : 0;
}

int kvz_kvzip_score_batch(kvz_model *m, kvz_kv *kv, int32_t n_prefix, const int32_t *const *ctx,
                          const int32_t *n_ctx, int32_t n_doc, const kvz_kvzip_params *p,
                          float *const *scores, int64_t *row0)
{
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    if (!tok) return kvz_error_set(KVZ_ERR_ARG, "kvzip: the model has no tokenizer");
    if (n_doc <= 0 || n_prefix < 0) return kvz_error_set(KVZ_ERR_ARG, "kvzip: bad batch");
    for (int32_t l = 0; l < c->n_layer; l++)
        for (int32_t h = 0; h < c->n_kv_head; h++)
            if (kvz_kv_len(kv, l, h) != n_prefix)
                return kvz_error_set(KVZ_ERR_ARG, "kvzip batch: the cache must hold exactly the prefix");
    kvz_kv_seg *seg = calloc((size_t)n_doc, sizeof *seg);
    kvz_tokens seq = {0};
    int rc = seg ? 0 : KVZ_ERR_NOMEM;
    for (int32_t i = 0; i < n_doc && !rc; i++) {
        const int32_t want = kvz_kvzip_batch_len(m, n_ctx[i], p);
        if (want <= 0) {
            rc = want < 0 ? want : kvz_error_set(KVZ_ERR_ARG, "kvzip batch: document %d does not qualify", i);
            break;
        }
        row0[i] = (int64_t)seq.n;
        for (int32_t j = 0; j < n_ctx[i] && !rc; j++) rc = kvz_tokens_push(&seq, ctx[i][j]);
        if (!rc) rc = kvz_kvzip_repeat_input(tok, ctx[i], n_ctx[i], 0, p, &seq);
        if (rc) break;
        seg[i] = (kvz_kv_seg){.n = (int32_t)((int64_t)seq.n - row0[i]), .n_score = n_ctx[i], .scores = scores[i]};
        if (seg[i].n != want) rc = kvz_error_set(KVZ_ERR_ARG, "kvzip batch: segment length %d, expected %d", seg[i].n, want);
        else memset(scores[i], 0, sizeof(float) * (size_t)c->n_layer * c->n_kv_head * (size_t)n_ctx[i]);
    }
    if (!rc && seq.n > 1024) rc = kvz_error_set(KVZ_ERR_ARG, "kvzip batch: %zu tokens exceed one pass (1024)", seq.n);
    if (!rc) rc = kvz_kv_set_segments(kv, seg, n_doc, n_prefix);
    if (!rc) rc = kvz_forward(m, kv, seq.ids, (int32_t)seq.n, n_prefix, NULL, KVZ_FWD_NO_LOGITS, NULL);
    kvz_kv_set_segments(kv, NULL, 0, 0);
    kvz_tokens_free(&seq);
    free(seg);
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
