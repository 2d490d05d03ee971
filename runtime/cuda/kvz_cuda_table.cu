/* CUDA backend: its kvz_backend table (runtime/kvz_backend.h) */
#include <stddef.h>

#include "kvz_cuda_impl.cuh"

/* kvz_kv_shift_seg (runtime/kvz_backend.h) is kvz_cuda_shift_seg (kernels/) field for field */
static_assert(sizeof(kvz_kv_shift_seg) == sizeof(kvz_cuda_shift_seg) &&
                  offsetof(kvz_kv_shift_seg, lh) == offsetof(kvz_cuda_shift_seg, lh) &&
                  offsetof(kvz_kv_shift_seg, row0) == offsetof(kvz_cuda_shift_seg, row0) &&
                  offsetof(kvz_kv_shift_seg, n) == offsetof(kvz_cuda_shift_seg, n) &&
                  offsetof(kvz_kv_shift_seg, doc) == offsetof(kvz_cuda_shift_seg, doc),
              "shift segment layouts differ");

static_assert(KVZ_CUDA_LOAD_MAX_SLOTS <= KVZ_BACKEND_MAX_LOAD_SLOTS, "loader slots");

static int kv_shift(kvz_kv *kv, const kvz_kv_shift_seg *segs, int n_seg, const float *cs, const float *sn,
                    int n_doc, float key_scale)
{
    return kvz_cuda_kv_shift(kv, reinterpret_cast<const kvz_cuda_shift_seg *>(segs), n_seg, cs, sn, n_doc,
                             key_scale);
}

static kvz_backend make_table(void)
{
    kvz_backend b;
    memset(&b, 0, sizeof b);
    b.name = "cuda";
    b.device = KVZ_DEVICE_CUDA;
    b.kv_elt_bytes = 2; /* bf16 */
    b.model_init = kvz_cuda_model_init;
    b.model_free = kvz_cuda_model_free;
    b.kv_init = kvz_cuda_kv_init;
    b.kv_free = kvz_cuda_kv_free;
    b.kv_sync = kvz_cuda_kv_sync;
    b.kv_set_layer = kvz_cuda_kv_set_layer;
    b.kv_get_head = kvz_cuda_kv_get_head;
    b.forward = kvz_cuda_forward;
    b.forward_multi = kvz_cuda_forward_multi;
    b.kvzip_repeat = kvz_cuda_kvzip_repeat;
    b.kvzip_select = kvz_cuda_kvzip_select;
    b.kv_export_layer = kvz_cuda_kv_export_layer;
    b.kv_export_layer_to = kvz_cuda_kv_export_layer_to;
    b.host_alloc = kvz_cuda_host_alloc;
    b.host_free = kvz_cuda_host_free;
    b.load_max_slots = KVZ_CUDA_LOAD_MAX_SLOTS;
    b.load_slots = kvz_cuda_load_slots;
    b.load_layer = kvz_cuda_load_layer;
    b.load_layer_src = kvz_cuda_load_layer_src;
    b.host_register = kvz_cuda_host_register;
    b.host_unregister = kvz_cuda_host_unregister;
    b.load_wait = kvz_cuda_load_wait;
    b.load_finish = kvz_cuda_load_finish;
    b.load_release = kvz_cuda_load_release;
    b.load_rows = kvz_cuda_load_rows;
    b.kv_shift = kv_shift;
    b.load_verify_begin = kvz_cuda_load_verify_begin;
    b.load_layer_verified = kvz_cuda_load_layer_verified;
    b.load_verify_end = kvz_cuda_load_verify_end;
    return b;
}

extern "C" const kvz_backend *kvz_backend_cuda(void)
{
    static const kvz_backend table = make_table(); /* built on first use (thread-safe) */
    return &table;
}
