/* The CPU backend's table (runtime/kvz_backend.h): host fp32 cache, the forward pass
 * of kvz_cpu.c. KVzip scoring runs inside that forward pass (kvz_kv_probe) and the
 * selection on the host (ingest/kvz_kvzip.c), so the device KVzip entries are NULL. */
#include <stdlib.h>
#include <string.h>

#include "kvz_backend.h"
#include "kvz_error.h"
#include "kvz_model_impl.h"

static int cpu_model_init(kvz_model *m)
{
    (void)m; /* the host weights are what the CPU computes with */
    return 0;
}

static void cpu_model_free(kvz_model *m) { (void)m; }

static int cpu_kv_init(kvz_kv *kv)
{
    const size_t nlh = (size_t)kv->n_layer * (size_t)kv->n_kv_head, hd = (size_t)kv->head_dim;
    const size_t rows = nlh * (size_t)kv->cap;
    if (kv->cap > 0) {
        kv->k = malloc(rows * hd * sizeof(float));
        kv->v = malloc(rows * hd * sizeof(float));
        kv->pos = malloc(rows * sizeof(int32_t));
        if (!kv->k || !kv->v || !kv->pos) goto nomem;
    }
    if (kv->out_slots > 0) {
        const size_t orows = (size_t)kv->n_layer * (size_t)kv->out_slots;
        kv->ok = malloc(orows * (size_t)kv->n_kv_head * hd * sizeof(float));
        kv->ov = malloc(orows * (size_t)kv->n_kv_head * hd * sizeof(float));
        kv->opos = malloc(orows * sizeof(int32_t));
        if (!kv->ok || !kv->ov || !kv->opos) goto nomem;
    }
    kvz_kv_clear(kv);
    return 0;
nomem: /* kvz_kv_free frees what was allocated */
    return kvz_error_set(KVZ_ERR_NOMEM, "cannot allocate the KV cache (%lld rows per head)",
                         (long long)kv->cap);
}

static void cpu_kv_free(kvz_kv *kv) { (void)kv; /* host arrays: kvz_kv_free */ }

static int cpu_kv_set_layer(kvz_kv *kv, int32_t layer, const uint32_t *counts, const int32_t *pos,
                            const float *k, const float *v)
{
    const size_t hd = (size_t)kv->head_dim;
    size_t off = 0;
    for (int32_t h = 0; h < kv->n_kv_head; h++) {
        const size_t seg = (size_t)layer * kv->n_kv_head + (size_t)h, c = counts[h];
        const size_t row0 = seg * (size_t)kv->cap;
        memcpy(kv->k + row0 * hd, k + off * hd, c * hd * sizeof(float));
        memcpy(kv->v + row0 * hd, v + off * hd, c * hd * sizeof(float));
        memcpy(kv->pos + row0, pos + off, c * sizeof(int32_t));
        kv->len[seg] = (int64_t)c;
        off += c;
    }
    return 0;
}

static int cpu_kv_get_head(const kvz_kv *kv, int32_t layer, int32_t head, float *k, float *v,
                           int32_t *pos)
{
    const float *pk = NULL, *pv = NULL;
    const int32_t *pp = NULL;
    int64_t n = 0;
    int rc = kvz_kv_view(kv, layer, head, &pk, &pv, &pp, &n);
    if (rc) return rc;
    if (k) memcpy(k, pk, (size_t)n * (size_t)kv->head_dim * sizeof(float));
    if (v) memcpy(v, pv, (size_t)n * (size_t)kv->head_dim * sizeof(float));
    if (pos) memcpy(pos, pp, (size_t)n * sizeof(int32_t));
    return 0;
}

static const kvz_backend cpu_backend = {
    .name = "cpu",
    .device = KVZ_DEVICE_CPU,
    .kv_elt_bytes = 4,
    .model_init = cpu_model_init,
    .model_free = cpu_model_free,
    .kv_init = cpu_kv_init,
    .kv_free = cpu_kv_free,
    .kv_sync = NULL, /* the host arrays are the cache */
    .kv_set_layer = cpu_kv_set_layer,
    .kv_get_head = cpu_kv_get_head,
    .forward = kvz_cpu_forward,
    /* KVzip on the device, loader: none (host paths) */
};

const kvz_backend *kvz_backend_cpu(void) { return &cpu_backend; }
