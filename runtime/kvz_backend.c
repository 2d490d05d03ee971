/* The one place that knows which backends this build has (runtime/kvz_backend.h). */
#include "kvz_backend.h"

#include "kvz_error.h"

#ifdef KVZ_HAVE_CUDA
#include "kvz_cuda_backend.h" /* runtime/cuda/: the CUDA table */
#endif

int kvz_backend_pick(int32_t device, const kvz_backend **out)
{
    *out = NULL;
    if (device != KVZ_DEVICE_AUTO && device != KVZ_DEVICE_CPU && device != KVZ_DEVICE_CUDA)
        return kvz_error_set(KVZ_ERR_ARG, "unknown device %d", device);
#ifdef KVZ_HAVE_CUDA
    if (device == KVZ_DEVICE_AUTO) device = kvz_cuda_available() ? KVZ_DEVICE_CUDA : KVZ_DEVICE_CPU;
    if (device == KVZ_DEVICE_CUDA) {
        if (!kvz_cuda_available()) return kvz_error_set(KVZ_ERR_NODEV, "--device cuda: no usable CUDA GPU");
        *out = kvz_backend_cuda();
        return 0;
    }
#else
    if (device == KVZ_DEVICE_CUDA)
        return kvz_error_set(KVZ_ERR_NODEV, "--device cuda: this build has no CUDA backend");
#endif
    *out = kvz_backend_cpu();
    return 0;
}

int kvz_backend_gpu_count(int *n)
{
    *n = 0;
#ifdef KVZ_HAVE_CUDA
    return kvz_cuda_device_count(n);
#else
    return kvz_error_set(KVZ_ERR_NODEV, "this build has no CUDA backend");
#endif
}
