/* CUDA backend: its kvz_backend table (runtime/kvz_backend.h) */
#include "kvz_cuda_impl.cuh"

/* ====================================================================== */
/* the table (runtime/kvz_backend.h)                                        */

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
    b.kvzip_repeat = kvz_cuda_kvzip_repeat;
    b.kvzip_select = kvz_cuda_kvzip_select;
    b.kv_export_layer = kvz_cuda_kv_export_layer;
    b.kv_export_layer_to = kvz_cuda_kv_export_layer_to;
    b.host_alloc = kvz_cuda_host_alloc;
    b.host_free = kvz_cuda_host_free;
    b.load_slots = kvz_cuda_load_slots;
    b.load_layer = kvz_cuda_load_layer;
    b.load_wait = kvz_cuda_load_wait;
    b.load_finish = kvz_cuda_load_finish;
    b.load_release = kvz_cuda_load_release;
    return b;
}

static const kvz_backend g_cuda_backend = make_table();

extern "C" const kvz_backend *kvz_backend_cuda(void) { return &g_cuda_backend; }
