/* In-memory documents composed into one KV cache (see kvz_compose_mem.h). */
#include <stdlib.h>
#include <string.h>

#include "kvz_compose_mem.h"
#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_rope_shift.h"

int kvz_docs_compose_mem(kvz_model *m, const kvz_compose_src *src, int32_t n,
                         const kvz_compose_opts *o, int64_t extra_rows, int32_t out_slots,
                         kvz_kv **out, kvz_compose_meta *meta)
{
    const kvz_config *c = kvz_model_config(m);
    kvz_compose_opts dflt;
    if (!o) {
        kvz_compose_defaults(&dflt);
        o = &dflt;
    }
    *out = NULL;
    memset(meta, 0, sizeof *meta);
    if (n < 1 || !src) return kvz_error_set(KVZ_ERR_ARG, "no document to compose");
    if (n > KVZ_COMPOSE_MAX_DOCS)
        return kvz_error_set(KVZ_ERR_ARG, "more than %d documents in one composition", KVZ_COMPOSE_MAX_DOCS);
    if (o->placement < KVZ_PLACE_AUTO || o->placement > KVZ_PLACE_PARALLEL)
        return kvz_error_set(KVZ_ERR_ARG, "placement %d unknown", o->placement);
    const double t0 = kvz_now();
    const int32_t L = c->n_layer, H = c->n_kv_head;
    const size_t hd = (size_t)c->head_dim, nlh = (size_t)L * (size_t)H;
    const int32_t P = src[0].n_prefix;
    int64_t sum_ctx = 0;
    uint64_t kept_ctx = 0, all_ctx = 0;
    for (int32_t d = 0; d < n; d++) {
        if (!src[d].k || !src[d].v || src[d].n_ctx < 0 || src[d].n_prefix < 0)
            return kvz_error_set(KVZ_ERR_ARG, "document %d: no rows", d + 1);
        if (src[d].n_prefix != P)
            return kvz_error_set(KVZ_ERR_ARG, "document %d has a %d-token prefix, document 1 a %d-token "
                                 "one: they cannot share one context", d + 1, src[d].n_prefix, P);
        sum_ctx += src[d].n_ctx;
        if (src[d].n_ctx > meta->max_ctx) meta->max_ctx = src[d].n_ctx;
    }
    meta->n_docs = n;
    meta->n_prefix = P;
    meta->span_seq = P + sum_ctx;
    if (meta->span_seq + o->reserve > KVZ_BLOB_MAX_TOKENS)
        return kvz_error_set(KVZ_ERR_CONTEXT, "%d documents span %lld positions, past the %u-position limit",
                             n, (long long)meta->span_seq, KVZ_BLOB_MAX_TOKENS);
    int32_t place = o->placement;
    if (place == KVZ_PLACE_AUTO)
        place = meta->span_seq + o->reserve <= c->n_ctx ? KVZ_PLACE_SEQUENTIAL : KVZ_PLACE_PARALLEL;
    meta->placement = place;
    meta->q_pos = place == KVZ_PLACE_PARALLEL ? P + meta->max_ctx : (int32_t)meta->span_seq;

    /* rows per (layer, head): prefix once + every document's kept context rows */
    uint32_t *total = calloc(nlh, sizeof *total);
    int64_t *delta = calloc((size_t)n, sizeof *delta);
    if (!total || !delta) {
        free(total);
        free(delta);
        return KVZ_ERR_NOMEM;
    }
    int64_t acc = 0;
    for (int32_t d = 0; d < n; d++) {
        delta[d] = place == KVZ_PLACE_PARALLEL ? 0 : acc + (d > 0 ? o->shift_bias : 0);
        acc += src[d].n_ctx;
    }
    uint64_t max_head = 0, max_layer = 0;
    for (size_t i = 0; i < nlh; i++) {
        uint64_t t = (uint64_t)P;
        for (int32_t d = 0; d < n; d++) {
            const int32_t nc = src[d].n_ctx;
            uint64_t k = (uint64_t)nc;
            if (src[d].keep) {
                k = 0;
                const uint8_t *kp = src[d].keep + i * (size_t)nc;
                for (int32_t j = 0; j < nc; j++) k += kp[j] != 0;
            }
            t += k;
            kept_ctx += k;
            all_ctx += (uint64_t)nc;
        }
        total[i] = (uint32_t)t;
        if (t > max_head) max_head = t;
    }
    for (int32_t l = 0; l < L; l++) {
        uint64_t lt = 0;
        for (int32_t h = 0; h < H; h++) lt += total[(size_t)l * H + h];
        if (lt > max_layer) max_layer = lt;
        meta->rows += lt;
    }
    meta->rows_full = (uint64_t)meta->span_seq * nlh;
    meta->ratio_min = meta->ratio_max = all_ctx ? (float)((double)kept_ctx / (double)all_ctx) : 1.0f;

    kvz_kv *kv = NULL;
    float *kf = malloc(sizeof *kf * (max_layer + 1) * hd), *vf = malloc(sizeof *vf * (max_layer + 1) * hd);
    int32_t *pf = malloc(sizeof *pf * (max_layer + 1));
    int rc = 0;
    if (!kf || !vf || !pf) {
        rc = kvz_error_set(KVZ_ERR_NOMEM, "the composed layer staging (%llu rows) does not fit in memory",
                           (unsigned long long)max_layer);
        goto out;
    }
    if ((rc = kvz_kv_create(m, (int64_t)max_head + extra_rows, out_slots, &kv))) {
        if (rc == KVZ_ERR_NOMEM)
            rc = kvz_error_set(rc, "the composed cache of %d documents (%llu rows per head at most) "
                               "does not fit in memory", n, (unsigned long long)max_head);
        goto out;
    }
    const float ks = o->key_scale > 0.0f ? o->key_scale : 1.0f;
    for (int32_t l = 0; l < L && !rc; l++) {
        uint64_t dst = 0;
        for (int32_t h = 0; h < H; h++) {
            const size_t lh = (size_t)l * H + h;
            /* the prefix, from the first document, at its own positions */
            const size_t r0 = lh * (size_t)(P + src[0].n_ctx);
            memcpy(kf + dst * hd, src[0].k + r0 * hd, sizeof(float) * (size_t)P * hd);
            memcpy(vf + dst * hd, src[0].v + r0 * hd, sizeof(float) * (size_t)P * hd);
            for (int32_t j = 0; j < P; j++) pf[dst + (uint64_t)j] = j;
            dst += (uint64_t)P;
            for (int32_t d = 0; d < n; d++) {
                const int32_t nc = src[d].n_ctx;
                const size_t base = lh * (size_t)(P + nc) + (size_t)P; /* first context row */
                const uint8_t *kp = src[d].keep ? src[d].keep + lh * (size_t)nc : NULL;
                const uint64_t first = dst;
                for (int32_t j = 0; j < nc; j++) {
                    if (kp && !kp[j]) continue;
                    memcpy(kf + dst * hd, src[d].k + (base + (size_t)j) * hd, sizeof(float) * hd);
                    memcpy(vf + dst * hd, src[d].v + (base + (size_t)j) * hd, sizeof(float) * hd);
                    pf[dst] = (int32_t)(P + j + delta[d]);
                    dst++;
                }
                if (delta[d]) kvz_rope_shift(m, kf + first * hd, (int64_t)(dst - first), (int32_t)delta[d]);
                if (ks != 1.0f)
                    for (size_t i = first * hd; i < dst * hd; i++) kf[i] *= ks;
            }
        }
        rc = kvz_kv_set_layer(kv, l, total + (size_t)l * H, pf, kf, vf);
    }
out:
    free(total); free(delta); free(kf); free(vf); free(pf);
    if (rc) {
        kvz_kv_free(kv);
        meta->n_docs = 0;
        return rc;
    }
    kvz_kv_checkpoint(kv);
    meta->load_s = kvz_now() - t0;
    *out = kv;
    return 0;
}
