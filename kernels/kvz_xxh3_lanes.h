/**
 * @file kvz_xxh3_lanes.h
 * @brief XXH3-64 with a seed, long inputs (> 240 bytes), written in the parallel form
 *        the GPU verification of stored records uses (kernels/xxh3.cu), as inline
 *        functions that compile both as C (the host reference, tests/fast/test_xxh3_lanes.c)
 *        and as CUDA __host__ __device__ code. Same value as libxxhash's
 *        XXH3_64bits_withSeed(p, n, seed) for every n > 240 (the XXH3 specification;
 *        the test checks it against libxxhash).
 *
 * XXH3's long path, restated: a 192-byte secret is derived from the default one (each
 * 16-byte pair: low u64 + seed, high u64 - seed); eight u64 accumulators start at fixed
 * values; the input is cut into 1024-byte blocks of 16 stripes of 64 bytes; every
 * stripe s of a block adds, for each lane i, data[i ^ 1] + lo32(d) * hi32(d) with
 * d = data[i] ^ secret_u64(8 s + 8 i) to acc[i]; after each FULL block acc[i] is
 * scrambled (acc ^= acc >> 47; acc ^= secret_u64(128 + 8 i); acc *= PRIME32_1). The
 * nb = (n - 1) / 1024 full blocks are scrambled; the rest (the last, partial block: its
 * (n - 1 - 1024 nb) / 64 stripes with the same secret offsets, and the input's last 64
 * bytes as one stripe with the secret at byte 121) only adds. Then the lanes are merged
 * (secret at byte 11, start n * PRIME64_1) and avalanched.
 *
 * Parallel form: within a block every lane's addition is a sum mod 2^64 of per-stripe
 * terms, and a lane's scramble reads that lane only. So S[b][i] (the block's sum for
 * lane i) can be computed for every block at once, and the hash is then
 *   acc[i] = init[i]; for b < nb: acc[i] = scramble_i(acc[i] + S[b][i]);
 *   acc[i] += T[i] (the tail's sum); digest = merge(acc).
 * kvz_xxh3l_block_lane() is S, kvz_xxh3l_tail_lane() is T, kvz_xxh3l_hash() the whole
 * thing on one thread. Inputs are read 8 bytes at a time as little-endian u64; on the
 * device the input must start 4-byte aligned (two 32-bit loads; its last stripe may
 * lie anywhere).
 */
#ifndef KVZ_XXH3_LANES_H
#define KVZ_XXH3_LANES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define KVZ_XXH3L_FN static __host__ __device__ __forceinline__
#else
#define KVZ_XXH3L_FN static inline
#endif

#define KVZ_XXH3L_BLOCK 1024u  /**< bytes of one block (16 stripes of 64) */
#define KVZ_XXH3L_MIN_LEN 241u /**< the shortest input this form computes (XXH3's long path) */

/** 8 little-endian bytes of @p p, any alignment (device: two 32-bit loads where @p p
 *  is 4-byte aligned, as every full block's are; bytes otherwise: the last stripe of
 *  an input whose length is not a multiple of 4). */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_rd64(const uint8_t *p)
{
#ifdef __CUDA_ARCH__
    if (((uintptr_t)p & 3) == 0) {
        const uint32_t *q = (const uint32_t *)p;
        return (uint64_t)q[0] | (uint64_t)q[1] << 32;
    }
    uint64_t v = 0;
    for (int b = 7; b >= 0; b--) v = v << 8 | p[b];
    return v;
#else
    uint64_t v;
    memcpy(&v, p, 8); /* x86-64 and the GPU are little-endian */
    return v;
#endif
}

/** u64 word @p w (0..23) of XXH3's default secret, read little-endian. */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_ksecret(int w)
{
    const uint64_t k[24] = {
        0xbe4ba423396cfeb8ull, 0x1cad21f72c81017cull, 0xdb979083e96dd4deull, 0x1f67b3b7a4a44072ull,
        0x78e5c0cc4ee679cbull, 0x2172ffcc7dd05a82ull, 0x8e2443f7744608b8ull, 0x4c263a81e69035e0ull,
        0xcb00c391bb52283cull, 0xa32e531b8b65d088ull, 0x4ef90da297486471ull, 0xd8acdea946ef1938ull,
        0x3f349ce33f76faa8ull, 0x1d4f0bc7c7bbdcf9ull, 0x3159b4cd4be0518aull, 0x647378d9c97e9fc8ull,
        0xc3ebd33483acc5eaull, 0xeb6313faffa081c5ull, 0x49daf0b751dd0d17ull, 0x9e68d429265516d3ull,
        0xfca1477d58be162bull, 0xce31d07ad1b8f88full, 0x280416958f3acb45ull, 0x7e404bbbcafbd7afull};
    return k[w];
}

/** u64 word @p w (0..23) of the secret derived from @p seed: low word of a pair + seed,
 *  high word - seed. */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_secret_word(uint64_t seed, int w)
{
    return kvz_xxh3l_ksecret(w) + ((w & 1) ? (uint64_t)0 - seed : seed);
}

/** 8 bytes of the derived secret at byte @p off (0..184), any alignment. */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_key(uint64_t seed, int off)
{
    const int w = off >> 3, r = off & 7;
    const uint64_t lo = kvz_xxh3l_secret_word(seed, w);
    return r ? lo >> (8 * r) | kvz_xxh3l_secret_word(seed, w + 1) << (64 - 8 * r) : lo;
}

/** Initial value of accumulator lane @p i. */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_init(int i)
{
    const uint64_t a[8] = {0xC2B2AE3Dull, 0x9E3779B185EBCA87ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
                           0x85EBCA77C2B2AE63ull, 0x85EBCA77ull, 0x27D4EB2F165667C5ull, 0x9E3779B1ull};
    return a[i];
}

/** What one 64-byte stripe at @p p adds to lane @p i with secret word @p key
 *  (= the derived secret's 8 bytes at the stripe's offset + 8 i). */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_stripe_lane(const uint8_t *p, int i, uint64_t key)
{
    const uint64_t d = kvz_xxh3l_rd64(p + 8 * i) ^ key;
    return kvz_xxh3l_rd64(p + 8 * (i ^ 1)) + (uint64_t)(uint32_t)d * (d >> 32);
}

/** Number of full (scrambled) blocks of an @p n-byte input. */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_nblocks(uint64_t n) { return (n - 1) / KVZ_XXH3L_BLOCK; }

/** S: the sum lane @p i gets from the full block at @p p (16 stripes). */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_block_lane(const uint8_t *p, int i, uint64_t seed)
{
    uint64_t s = 0;
    for (int k = 0; k < 16; k++) s += kvz_xxh3l_stripe_lane(p + 64 * k, i, kvz_xxh3l_secret_word(seed, k + i));
    return s;
}

/** T: the sum lane @p i gets after the last scramble of the @p n-byte input at @p in:
 *  the partial block's stripes, then the last 64 bytes (secret at byte 121). */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_tail_lane(const uint8_t *in, uint64_t n, int i, uint64_t seed)
{
    const uint64_t nb = kvz_xxh3l_nblocks(n);
    const uint8_t *p = in + nb * KVZ_XXH3L_BLOCK;
    const int ns = (int)((n - 1 - nb * KVZ_XXH3L_BLOCK) / 64);
    uint64_t s = 0;
    for (int k = 0; k < ns; k++) s += kvz_xxh3l_stripe_lane(p + 64 * k, i, kvz_xxh3l_secret_word(seed, k + i));
    return s + kvz_xxh3l_stripe_lane(in + n - 64, i, kvz_xxh3l_key(seed, 192 - 64 - 7 + 8 * i));
}

/** One scramble with lane key @p key (= kvz_xxh3l_secret_word(seed, 16 + lane)). */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_scramble_k(uint64_t acc, uint64_t key)
{
    acc ^= acc >> 47;
    acc ^= key;
    return acc * 0x9E3779B1ull;
}

/** One scramble of lane @p i (after a full block). */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_scramble(uint64_t acc, int i, uint64_t seed)
{
    return kvz_xxh3l_scramble_k(acc, kvz_xxh3l_secret_word(seed, 16 + i));
}

/** high 64 bits of a * b */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_mulhi(uint64_t a, uint64_t b)
{
#ifdef __CUDA_ARCH__
    return __umul64hi(a, b);
#else
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
#endif
}

/** The digest from the final lanes @p acc of an @p n-byte input. */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_merge(const uint64_t acc[8], uint64_t n, uint64_t seed)
{
    uint64_t r = n * 0x9E3779B185EBCA87ull;
    for (int k = 0; k < 4; k++) {
        const uint64_t a = acc[2 * k] ^ kvz_xxh3l_key(seed, 11 + 16 * k);
        const uint64_t b = acc[2 * k + 1] ^ kvz_xxh3l_key(seed, 11 + 16 * k + 8);
        r += a * b ^ kvz_xxh3l_mulhi(a, b);
    }
    r ^= r >> 37;
    r *= 0x165667919E3779F9ull;
    return r ^ r >> 32;
}

/** XXH3_64bits_withSeed(@p in, @p n, @p seed) for @p n >= KVZ_XXH3L_MIN_LEN, computed
 *  in the parallel form on one thread (block sums, the lanes' chain, the tail). */
KVZ_XXH3L_FN uint64_t kvz_xxh3l_hash(const uint8_t *in, uint64_t n, uint64_t seed)
{
    uint64_t acc[8];
    const uint64_t nb = kvz_xxh3l_nblocks(n);
    for (int i = 0; i < 8; i++) {
        uint64_t a = kvz_xxh3l_init(i);
        for (uint64_t b = 0; b < nb; b++)
            a = kvz_xxh3l_scramble(a + kvz_xxh3l_block_lane(in + b * KVZ_XXH3L_BLOCK, i, seed), i, seed);
        acc[i] = a + kvz_xxh3l_tail_lane(in, n, i, seed);
    }
    return kvz_xxh3l_merge(acc, n, seed);
}

#endif
