/* XXH3-64 (seeded, long inputs) of records already on the device, in the parallel
 * form of kvz_xxh3_lanes.h (kvz_cuda_verify.h): the block sums in one wide kernel,
 * the lanes' chains and the merge in a narrow one. The arithmetic is the header's,
 * shared with the host reference that tests/fast/test_xxh3_lanes.c checks against
 * libxxhash. */
#include "kvz_cuda_common.cuh"
#include "kvz_cuda_verify.h"
#include "kvz_xxh3_lanes.h"

/* thread t: lane t % 8 of block t / 8 (grid-stride over blocks 0..nb, nb = the tail) */
__global__ void xxh3_sums_kernel(const uint8_t *__restrict__ in, uint64_t n, uint64_t seed, uint64_t *__restrict__ sums)
{
    __shared__ uint64_t sw[24]; /* the derived secret's words, once per block */
    if (threadIdx.x < 24) sw[threadIdx.x] = kvz_xxh3l_secret_word(seed, (int)threadIdx.x);
    __syncthreads();
    const int i = threadIdx.x & 7;
    const uint64_t nb = kvz_xxh3l_nblocks(n);
    uint64_t key[16]; /* stripe k's key for lane i: word k + i */
#pragma unroll
    for (int k = 0; k < 16; k++) key[k] = sw[k + i];
    const uint64_t step = ((uint64_t)gridDim.x * blockDim.x) >> 3;
    for (uint64_t b = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 3; b <= nb; b += step) {
        uint64_t s = 0;
        if (b < nb) {
            const uint8_t *p = in + b * KVZ_XXH3L_BLOCK;
#pragma unroll
            for (int k = 0; k < 16; k++) s += kvz_xxh3l_stripe_lane(p + 64 * k, i, key[k]);
        } else {
            s = kvz_xxh3l_tail_lane(in, n, i, seed);
        }
        sums[b * 8 + i] = s;
    }
}

extern "C" int kvz_cuda_xxh3_sums(cudaStream_t s, const void *in, uint64_t n, uint64_t seed, uint64_t *sums)
{
    KVZ_ARG(in && sums && n >= KVZ_XXH3L_MIN_LEN && ((uintptr_t)in & 3) == 0 && ((uintptr_t)sums & 7) == 0);
    const uint64_t items = kvz_cuda_xxh3_sums_len(n); /* threads wanted: one per (block, lane) */
    uint64_t blocks = (items + 255) / 256;
    if (blocks > 8192) blocks = 8192;
    xxh3_sums_kernel<<<(unsigned)blocks, 256, 0, s>>>((const uint8_t *)in, n, seed, sums);
    KVZ_LAUNCH_CHECK("xxh3_sums");
    return 0;
}

/* thread i of the calling block (8 threads) runs lane i's chain of job @p jb; thread 0
 * merges into *@p out */
__device__ __forceinline__ void xxh3_chain_body(const kvz_cuda_xxh3_job &jb, const uint64_t *__restrict__ sums,
                                                uint64_t *out)
{
    __shared__ uint64_t acc[8];
    const int i = threadIdx.x;
    const uint64_t *S = sums + jb.sums_off;
    const uint64_t nb = kvz_xxh3l_nblocks(jb.n), key = kvz_xxh3l_secret_word(jb.seed, 16 + i);
    uint64_t a = kvz_xxh3l_init(i);
#pragma unroll 8
    for (uint64_t b = 0; b < nb; b++) a = kvz_xxh3l_scramble_k(a + S[b * 8 + i], key);
    acc[i] = a + S[nb * 8 + i];
    __syncthreads();
    if (i == 0) *out = kvz_xxh3l_merge(acc, jb.n, jb.seed);
}

/* one block of 8 threads per job */
__global__ void xxh3_chain_kernel(const kvz_cuda_xxh3_job *__restrict__ jobs, const uint64_t *__restrict__ sums,
                                  uint64_t *__restrict__ digest)
{
    const kvz_cuda_xxh3_job jb = jobs[blockIdx.x];
    if (jb.n < KVZ_XXH3L_MIN_LEN) return; /* no job (the whole block leaves) */
    xxh3_chain_body(jb, sums, digest + blockIdx.x);
}

/* one job, passed by value (launched per record as soon as its sums are queued) */
__global__ void xxh3_chain1_kernel(kvz_cuda_xxh3_job jb, const uint64_t *__restrict__ sums, uint64_t *__restrict__ digest)
{
    xxh3_chain_body(jb, sums, digest);
}

extern "C" int kvz_cuda_xxh3_chain1(cudaStream_t s, kvz_cuda_xxh3_job job, const uint64_t *sums, uint64_t *digest)
{
    KVZ_ARG(sums && digest && job.n >= KVZ_XXH3L_MIN_LEN);
    xxh3_chain1_kernel<<<1, 8, 0, s>>>(job, sums, digest);
    KVZ_LAUNCH_CHECK("xxh3_chain1");
    return 0;
}

extern "C" int kvz_cuda_xxh3_chain(cudaStream_t s, const kvz_cuda_xxh3_job *jobs, int n_job, const uint64_t *sums,
                                   uint64_t *digest)
{
    KVZ_ARG(n_job >= 0 && (n_job == 0 || (jobs && sums && digest)));
    if (!n_job) return 0;
    xxh3_chain_kernel<<<n_job, 8, 0, s>>>(jobs, sums, digest);
    KVZ_LAUNCH_CHECK("xxh3_chain");
    return 0;
}
