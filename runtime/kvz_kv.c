/* The KV cache: document segments per (layer, KV head) + LongFlow output buffer.
 * Device-neutral: the storage and its transfers are the model's backend's
 * (runtime/kvz_backend.h); this file keeps the host lengths and the policy state. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_model_impl.h"

int kvz_kv_create(const kvz_model *m, int64_t cap, int32_t out_slots, kvz_kv **out)
{
    *out = NULL;
    if (cap < 0 || out_slots < 0) return kvz_error_set(KVZ_ERR_ARG, "kv: negative capacity");
    const kvz_config *c = &m->cfg;
    kvz_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return KVZ_ERR_NOMEM;
    kv->m = m;
    kv->n_layer = c->n_layer;
    kv->n_kv_head = c->n_kv_head;
    kv->head_dim = c->head_dim;
    kv->cap = cap;
    kv->out_slots = out_slots;
    kv->n_sink = 4;
    const size_t nlh = (size_t)c->n_layer * (size_t)c->n_kv_head;
    kv->len = calloc(nlh, sizeof *kv->len);
    kv->out_used = calloc((size_t)c->n_layer, sizeof(int32_t));
    kv->victim = calloc((size_t)c->n_layer, sizeof(int32_t));
    kv->newest = calloc((size_t)c->n_layer, sizeof(int32_t));
    if (!kv->len || !kv->out_used || !kv->victim || !kv->newest) goto nomem;
    {
        int rc = m->be->kv_init(kv); /* storage; the cache starts empty */
        if (rc) {
            kvz_kv_free(kv);
            return rc;
        }
    }
    *out = kv;
    return 0;
nomem:
    kvz_kv_free(kv);
    return kvz_error_set(KVZ_ERR_NOMEM, "cannot allocate the KV cache (%lld rows per head)",
                         (long long)cap);
}

void kvz_kv_free(kvz_kv *kv)
{
    if (!kv) return;
    kv->m->be->kv_free(kv);
    free(kv->len); free(kv->mark); free(kv->k); free(kv->v); free(kv->pos);
    free(kv->ok); free(kv->ov); free(kv->opos);
    free(kv->out_used); free(kv->victim); free(kv->newest);
    free(kv->scratch);
    free(kv->probe_part);
    free(kv);
}

/* Empty the output buffer and push the host lengths to the device cache. */
static void reset_output(kvz_kv *kv)
{
    memset(kv->out_used, 0, sizeof(int32_t) * (size_t)kv->n_layer);
    memset(kv->victim, 0, sizeof(int32_t) * (size_t)kv->n_layer);
    memset(kv->newest, 0, sizeof(int32_t) * (size_t)kv->n_layer);
    kv->evictions = 0;
    if (kv->opos)
        for (size_t i = 0; i < (size_t)kv->n_layer * (size_t)kv->out_slots; i++) kv->opos[i] = -1;
    if (kv->m->be->kv_sync) kv->m->be->kv_sync(kv, 1); /* errors surface at the next forward */
}

void kvz_kv_clear(kvz_kv *kv)
{
    memset(kv->len, 0, sizeof *kv->len * (size_t)kv->n_layer * (size_t)kv->n_kv_head);
    reset_output(kv);
}

int kvz_kv_set_probe(kvz_kv *kv, const kvz_kv_probe *p)
{
    if (!p) {
        memset(&kv->probe, 0, sizeof kv->probe);
        return 0;
    }
    if (kv->m->be->device != KVZ_DEVICE_CPU)
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "the KVzip probe runs on the CPU backend");
    if (p->c1 < p->c0 || p->c0 < p->n_prefix || p->rep_row0 < p->c1 || !p->scores)
        return kvz_error_set(KVZ_ERR_ARG, "kv probe: bad row ranges");
    const int nt = omp_get_max_threads() > kv->m->n_threads ? omp_get_max_threads() : kv->m->n_threads;
    const size_t need = (size_t)nt * (size_t)kv->n_kv_head * (size_t)(p->c1 - p->c0);
    if (need > kv->probe_part_cap) {
        float *w = realloc(kv->probe_part, need * sizeof(float));
        if (!w) return KVZ_ERR_NOMEM;
        kv->probe_part = w;
        kv->probe_part_cap = need;
    }
    kv->probe = *p;
    return 0;
}

int kvz_kv_set_segments(kvz_kv *kv, const kvz_kv_seg *segs, int32_t n_seg, int64_t n_prefix)
{
    if (!segs || n_seg <= 0) {
        kv->segs = NULL;
        kv->n_segs = 0;
        kv->seg_prefix = 0;
        return 0;
    }
    if (kv->m->be->device != KVZ_DEVICE_CPU)
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "segmented passes run on the CPU backend");
    if (n_prefix < 0) return kvz_error_set(KVZ_ERR_ARG, "kv segments: negative prefix");
    for (int32_t s = 0; s < n_seg; s++)
        if (segs[s].n <= 0 || segs[s].n_score < 0 || segs[s].n_score > segs[s].n)
            return kvz_error_set(KVZ_ERR_ARG, "kv segments: segment %d has bad lengths", s);
    kv->segs = segs;
    kv->n_segs = n_seg;
    kv->seg_prefix = n_prefix;
    return 0;
}

void kvz_kv_checkpoint(kvz_kv *kv)
{
    const size_t n = (size_t)kv->n_layer * (size_t)kv->n_kv_head;
    if (!kv->mark && !(kv->mark = malloc(n * sizeof *kv->mark))) return;
    memcpy(kv->mark, kv->len, n * sizeof *kv->mark);
}

void kvz_kv_rollback(kvz_kv *kv)
{
    const size_t n = (size_t)kv->n_layer * (size_t)kv->n_kv_head;
    if (kv->mark) memcpy(kv->len, kv->mark, n * sizeof *kv->len);
    else memset(kv->len, 0, n * sizeof *kv->len);
    reset_output(kv);
}

int64_t kvz_kv_len(const kvz_kv *kv, int32_t layer, int32_t head)
{
    return kv->len[(size_t)layer * kv->n_kv_head + head];
}

int64_t kvz_kv_cap(const kvz_kv *kv) { return kv->cap; }

void kvz_kv_truncate(kvz_kv *kv, int64_t n)
{
    for (size_t i = 0; i < (size_t)kv->n_layer * (size_t)kv->n_kv_head; i++)
        if (kv->len[i] > n) kv->len[i] = n;
    if (kv->m->be->kv_sync) kv->m->be->kv_sync(kv, 0);
}

void kvz_kv_set_sinks(kvz_kv *kv, int32_t n_sink) { kv->n_sink = n_sink < 0 ? 0 : n_sink; }

void kvz_kv_set_out_policy(kvz_kv *kv, int32_t policy) { kv->out_policy = policy; }

int kvz_kv_view(const kvz_kv *kv, int32_t layer, int32_t head, const float **k,
                const float **v, const int32_t **pos, int64_t *len)
{
    if (!kv->k && kv->cap > 0) return KVZ_ERR_UNSUPPORTED;
    const size_t seg = (size_t)layer * kv->n_kv_head + (size_t)head;
    const size_t row0 = seg * (size_t)kv->cap;
    if (k) *k = kv->k + row0 * (size_t)kv->head_dim;
    if (v) *v = kv->v + row0 * (size_t)kv->head_dim;
    if (pos) *pos = kv->pos + row0;
    if (len) *len = kv->len[seg];
    return 0;
}

int kvz_kv_set_layer(kvz_kv *kv, int32_t layer, const uint32_t *counts, const int32_t *pos,
                     const float *k, const float *v)
{
    for (int32_t h = 0; h < kv->n_kv_head; h++)
        if ((int64_t)counts[h] > kv->cap)
            return kvz_error_set(KVZ_ERR_CONTEXT, "layer %d head %d: %u rows exceed the cache "
                                 "capacity %lld", layer, h, counts[h], (long long)kv->cap);
    return kv->m->be->kv_set_layer(kv, layer, counts, pos, k, v);
}

int kvz_kv_get_head(const kvz_kv *kv, int32_t layer, int32_t head, float *k, float *v,
                    int32_t *pos)
{
    return kv->m->be->kv_get_head(kv, layer, head, k, v, pos);
}

void kvz_kv_get_stats(const kvz_kv *kv, kvz_kv_stats *st)
{
    memset(st, 0, sizeof *st);
    st->out_slots = kv->out_slots;
    for (int32_t l = 0; l < kv->n_layer; l++) {
        if (kv->out_used[l] > st->out_used) st->out_used = kv->out_used[l];
        for (int32_t h = 0; h < kv->n_kv_head; h++) st->doc_rows += kv->len[(size_t)l * kv->n_kv_head + h];
    }
    st->evictions = kv->n_layer ? kv->evictions / kv->n_layer : 0;
    const uint64_t elt = kv->m->be->kv_elt_bytes, row = 2 * (uint64_t)kv->head_dim * elt;
    int64_t out_rows = 0;
    for (int32_t l = 0; l < kv->n_layer; l++) out_rows += (int64_t)kv->out_used[l] * kv->n_kv_head;
    st->bytes_held = row * (uint64_t)(st->doc_rows + out_rows);
    st->bytes_alloc = row * ((uint64_t)kv->cap * (uint64_t)kv->n_layer * (uint64_t)kv->n_kv_head +
                             (uint64_t)kv->out_slots * (uint64_t)kv->n_layer * (uint64_t)kv->n_kv_head);
}
