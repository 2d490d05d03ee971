/* CUDA backend: device memory with accounting (every allocation of the backend goes
 * through dmalloc / dmalloc_tmp, so kvz_cuda_mem_peak is the peak), pinned host memory. */
#include <mutex>
#include <unordered_map>

#include "kvz_cuda_impl.cuh"

/* ====================================================================== */
/* device memory with accounting                                           */

static std::mutex g_mem_mu;
static std::unordered_map<void *, size_t> g_mem_sizes;
static uint64_t g_mem_cur, g_mem_peak;

static void mem_track(void *p, size_t bytes)
{
    std::lock_guard<std::mutex> g(g_mem_mu);
    g_mem_sizes[p] = bytes;
    g_mem_cur += bytes;
    if (g_mem_cur > g_mem_peak) g_mem_peak = g_mem_cur;
}

static void mem_untrack(void *p)
{
    std::lock_guard<std::mutex> g(g_mem_mu);
    auto it = g_mem_sizes.find(p);
    if (it != g_mem_sizes.end()) {
        g_mem_cur -= it->second;
        g_mem_sizes.erase(it);
    }
}

int dmalloc(void **p, size_t bytes, const char *what)
{
    *p = NULL;
    if (bytes == 0) bytes = 256;
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *p = NULL;
        return kvz_error_set(e == cudaErrorMemoryAllocation ? KVZ_ERR_NOMEM : KVZ_ERR_CUDA,
                             "cudaMalloc %s (%.1f MiB): %s", what, bytes / 1048576.0,
                             cudaGetErrorString(e));
    }
    mem_track(*p, bytes);
    return 0;
}

void dfree(void *p)
{
    if (!p) return;
    cudaFree(p);
    mem_untrack(p);
}

/* Short-lived scratch (selection, compaction): stream-ordered from the device's default
 * pool, which is set to keep freed blocks, so the next document's selection takes
 * nothing from the driver (cudaMalloc + the synchronising cudaFree cost ~3 ms per
 * document). Accounted like dmalloc while allocated; falls back to it where the device
 * has no memory pools. */
static int tmp_pools(void) /* 1: cudaMallocAsync from a default pool that keeps freed blocks */
{
    static int pools = -1;
    if (pools < 0) {
        int dev = 0, ok = 0;
        cudaMemPool_t pool;
        uint64_t keep = UINT64_MAX;
        pools = cudaGetDevice(&dev) == cudaSuccess &&
                cudaDeviceGetAttribute(&ok, cudaDevAttrMemoryPoolsSupported, dev) == cudaSuccess && ok &&
                cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess &&
                cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) == cudaSuccess;
        cudaGetLastError();
    }
    return pools;
}

int dmalloc_tmp(void **p, size_t bytes, cudaStream_t s, const char *what)
{
    const int pools = tmp_pools();
    if (!pools) return dmalloc(p, bytes, what);
    *p = NULL;
    if (bytes == 0) bytes = 256;
    cudaError_t e = cudaMallocAsync(p, bytes, s);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *p = NULL;
        return kvz_error_set(e == cudaErrorMemoryAllocation ? KVZ_ERR_NOMEM : KVZ_ERR_CUDA,
                             "cudaMallocAsync %s (%.1f MiB): %s", what, bytes / 1048576.0, cudaGetErrorString(e));
    }
    mem_track(*p, bytes);
    return 0;
}

void dfree_tmp(void *p, cudaStream_t s)
{
    if (!p) return;
    mem_untrack(p);
    if (tmp_pools())
        cudaFreeAsync(p, s);
    else
        cudaFree(p);
    cudaGetLastError();
}

extern "C" uint64_t kvz_cuda_mem_peak(void)
{
    std::lock_guard<std::mutex> g(g_mem_mu);
    return g_mem_peak;
}

extern "C" int kvz_cuda_host_alloc(void **p, size_t bytes)
{
    *p = NULL;
    cudaError_t e = cudaHostAlloc(p, bytes ? bytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *p = NULL;
        return kvz_error_set(e == cudaErrorMemoryAllocation ? KVZ_ERR_NOMEM : KVZ_ERR_CUDA, "pinned host memory "
                             "(%.1f MiB): %s", bytes / 1048576.0, cudaGetErrorString(e));
    }
    return 0;
}

extern "C" void kvz_cuda_host_free(void *p)
{
    if (p) cudaFreeHost(p);
}
