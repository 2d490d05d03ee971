/* The backend table (runtime/kvz_backend.h): the device choice in one place, the CPU
 * table's entries, and a synthetic model's cache driven through it (rows set, read
 * back, lengths, held bytes from the row counts); the CUDA table is checked for
 * completeness when this build and machine have it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_test.h"

#include "kvz_backend.h"
#include "kvz_dispatch.h"
#include "kvz_error.h"
#include "kvz_model.h"

static void check_common(const kvz_backend *b)
{
    CHECK(b->name && b->name[0]);
    CHECK(b->model_init && b->model_free && b->kv_init && b->kv_free);
    CHECK(b->kv_set_layer && b->kv_get_head && b->forward);
}

static int test_pick(void)
{
    const kvz_backend *b = NULL;
    CHECK(kvz_backend_pick(KVZ_DEVICE_CPU, &b) == 0);
    REQUIRE(b);
    CHECK(b == kvz_backend_cpu());
    CHECK(!strcmp(b->name, "cpu") && b->device == KVZ_DEVICE_CPU && b->kv_elt_bytes == 4);
    check_common(b);
    /* the CPU scores inside its forward pass and selects on the host: no device entries */
    CHECK(!b->kvzip_repeat && !b->kvzip_select && !b->kv_export_layer && !b->kv_export_layer_to);
    CHECK(!b->host_alloc && !b->load_slots && !b->load_rows && !b->kv_shift && b->load_max_slots == 0);

    b = (const kvz_backend *)1;
    CHECK(kvz_backend_pick(7, &b) == KVZ_ERR_ARG);
    CHECK(b == NULL);
    CHECKF(strstr(kvz_error_detail(), "unknown device") != NULL, "detail: %s", kvz_error_detail());

    int rc = kvz_backend_pick(KVZ_DEVICE_CUDA, &b);
    if (rc == 0) { /* a CUDA build on a machine with a GPU: every entry is there */
        CHECK(b->device == KVZ_DEVICE_CUDA && !strcmp(b->name, "cuda") && b->kv_elt_bytes == 2);
        check_common(b);
        CHECK(b->kv_sync && b->kvzip_repeat && b->kvzip_select && b->kv_export_layer && b->kv_export_layer_to);
        CHECK(b->host_alloc && b->host_free && b->load_slots && b->load_layer && b->load_wait);
        CHECK(b->load_finish && b->load_release && b->load_rows && b->kv_shift && b->load_max_slots > 0);
        printf("cuda backend present\n");
    } else {
        CHECKF(rc == KVZ_ERR_NODEV, "pick cuda: %d %s", rc, kvz_error_detail());
        CHECK(b == NULL);
        CHECKF(strstr(kvz_error_detail(), "--device cuda") != NULL, "detail: %s", kvz_error_detail());
        printf("no cuda backend here: %s\n", kvz_error_detail());
    }
    /* AUTO falls back to the CPU exactly when CUDA is not usable */
    const kvz_backend *a = NULL;
    CHECK(kvz_backend_pick(KVZ_DEVICE_AUTO, &a) == 0);
    REQUIRE(a);
    CHECK(a->device == (rc == 0 ? KVZ_DEVICE_CUDA : KVZ_DEVICE_CPU));

    /* the GPU count of the dispatcher is the backend's */
    int n1 = -1, n2 = -1;
    int r1 = kvz_backend_gpu_count(&n1), r2 = kvz_dispatch_gpu_count(&n2);
    CHECK(r1 == r2 && n1 == n2);
    if (r1) CHECK(r1 == KVZ_ERR_NODEV && n1 == 0);
    if (rc == 0) CHECK(r1 == 0 && n1 > 0);
    return 0;
}

/* a model reports its table; a cache made through it holds what was set, per head */
static int test_cpu_cache(void)
{
    kvz_model_opts mo = {.device = KVZ_DEVICE_CPU, .n_threads = 1};
    kvz_model *m = NULL;
    REQUIRE(kvz_model_synthetic("tiny-llama", &mo, &m) == 0);
    CHECK(kvz_model_backend(m) == kvz_backend_cpu());
    CHECK(kvz_model_device(m) == KVZ_DEVICE_CPU);
    const kvz_config *c = kvz_model_config(m);
    const int H = c->n_kv_head, hd = c->head_dim;
    kvz_kv *kv = NULL;
    REQUIRE(kvz_kv_create(m, 16, 4, &kv) == 0);
    uint32_t counts[64];
    REQUIRE(H <= 64);
    size_t total = 0;
    for (int h = 0; h < H; h++) total += counts[h] = (uint32_t)(3 + 2 * h) % 17;
    float *k = malloc(sizeof(float) * (total + 1) * (size_t)hd), *v = malloc(sizeof(float) * (total + 1) * (size_t)hd);
    int32_t *pos = malloc(sizeof(int32_t) * (total + 1));
    float *gk = malloc(sizeof(float) * 16 * (size_t)hd), *gv = malloc(sizeof(float) * 16 * (size_t)hd);
    int32_t *gp = malloc(sizeof(int32_t) * 16);
    REQUIRE(k && v && pos && gk && gv && gp);
    for (size_t i = 0; i < total * (size_t)hd; i++) {
        k[i] = (float)i * 0.25f;
        v[i] = -(float)i;
    }
    for (size_t r = 0; r < total; r++) pos[r] = (int32_t)(100 + r);
    const int layer = c->n_layer - 1;
    CHECK(kvz_kv_set_layer(kv, layer, counts, pos, k, v) == 0);
    size_t off = 0;
    int64_t rows = 0;
    for (int h = 0; h < H; h++) {
        CHECK(kvz_kv_len(kv, layer, h) == (int64_t)counts[h]);
        CHECK(kvz_kv_get_head(kv, layer, h, gk, gv, gp) == 0);
        CHECK(!memcmp(gk, k + off * hd, counts[h] * (size_t)hd * sizeof(float)));
        CHECK(!memcmp(gv, v + off * hd, counts[h] * (size_t)hd * sizeof(float)));
        CHECK(!memcmp(gp, pos + off, counts[h] * sizeof(int32_t)));
        off += counts[h];
        rows += counts[h];
    }
    kvz_kv_stats st;
    kvz_kv_get_stats(kv, &st);
    CHECK(st.doc_rows == rows);
    CHECK(st.bytes_held == (uint64_t)rows * 2u * (uint64_t)hd * 4u); /* fp32 K and V */
    /* too many rows for the capacity: refused before the backend sees them */
    counts[0] = 17;
    CHECK(kvz_kv_set_layer(kv, 0, counts, pos, k, v) == KVZ_ERR_CONTEXT);
    kvz_kv_truncate(kv, 0);
    for (int h = 0; h < H; h++) CHECK(kvz_kv_len(kv, layer, h) == 0);
    free(k); free(v); free(pos); free(gk); free(gv); free(gp);
    kvz_kv_free(kv);
    kvz_model_free(m);

    /* an unknown device is refused when the model is made */
    mo.device = 9;
    m = (kvz_model *)1;
    CHECK(kvz_model_synthetic("tiny-llama", &mo, &m) == KVZ_ERR_ARG);
    CHECK(m == NULL);
    return 0;
}

int main(void)
{
    int rc = test_pick(); /* non-zero: a REQUIRE failed (summary printed) */
    if (!rc) rc = test_cpu_cache();
    return rc ? rc : kvz_test_summary();
}
