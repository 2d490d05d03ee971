/* The parallel form of XXH3-64 (kernels/kvz_xxh3_lanes.h) that the GPU verification
 * of stored records computes, checked on the host against libxxhash's
 * XXH3_64bits_withSeed (the independent truth): every length 241..5000, lengths
 * around multiples of 64 and 1024 up to 70 KB, a few MB, random and edge seeds
 * (0, 1, 2^64-1, seeds from record headers); the block-sum decomposition itself
 * (S sums for every block in any order, then the chain) against the same; and one
 * changed byte anywhere changes the value. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "kvz_test.h"
#include "kvz_xxh3_lanes.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* the decomposition as the kernels run it: every block's lane sums first (here in
 * reverse block order, as independent work), then the per-lane chain, tail, merge */
static uint64_t by_blocks(const uint8_t *p, uint64_t n, uint64_t seed, uint64_t *S)
{
    const uint64_t nb = kvz_xxh3l_nblocks(n);
    for (uint64_t b = nb; b-- > 0;)
        for (int i = 0; i < 8; i++) S[b * 8 + i] = kvz_xxh3l_block_lane(p + b * KVZ_XXH3L_BLOCK, i, seed);
    for (int i = 0; i < 8; i++) S[nb * 8 + i] = kvz_xxh3l_tail_lane(p, n, i, seed);
    uint64_t acc[8];
    for (int i = 0; i < 8; i++) {
        uint64_t a = kvz_xxh3l_init(i);
        for (uint64_t b = 0; b < nb; b++) a = kvz_xxh3l_scramble(a + S[b * 8 + i], i, seed);
        acc[i] = a + S[nb * 8 + i];
    }
    return kvz_xxh3l_merge(acc, n, seed);
}

int main(void)
{
    const size_t MAX = (size_t)4 << 20;
    uint8_t *buf = malloc(MAX + 8);
    uint64_t *S = malloc((MAX / KVZ_XXH3L_BLOCK + 2) * 8 * sizeof *S);
    REQUIRE(buf && S);
    for (size_t i = 0; i < MAX + 8; i++) buf[i] = (uint8_t)next();
    const uint64_t seeds[5] = {0, 1, ~0ull, 0x8000000000000000ull, XXH3_64bits(buf, 48)};

    /* every length 241..5000, each at a random seed and one fixed seed; odd start too */
    long bad = 0, n_len = 0;
    for (uint64_t n = KVZ_XXH3L_MIN_LEN; n <= 5000; n++) {
        const uint64_t sd = next();
        const uint8_t *p = buf + (n & 3); /* the host reads any alignment */
        bad += kvz_xxh3l_hash(p, n, sd) != XXH3_64bits_withSeed(p, n, sd);
        bad += kvz_xxh3l_hash(buf, n, seeds[n % 5]) != XXH3_64bits_withSeed(buf, n, seeds[n % 5]);
        bad += by_blocks(buf, n, sd, S) != XXH3_64bits_withSeed(buf, n, sd);
        n_len++;
    }
    printf("lengths 241..5000 (%ld): %ld mismatches\n", n_len, bad);
    CHECK(bad == 0);

    /* around every multiple of 64 and 1024 up to 70 KB (block and stripe edges), every seed */
    bad = 0;
    long n_edge = 0;
    for (uint64_t m = 256; m <= 70000; m += 64)
        for (int d = -2; d <= 2; d++) {
            const uint64_t n = m + (uint64_t)(int64_t)d;
            if (m % 1024 && d != 0 && d != 1) continue; /* 64-multiples: n and n + 1 */
            for (int s = 0; s < 5; s++) {
                bad += kvz_xxh3l_hash(buf + 4, n, seeds[s]) != XXH3_64bits_withSeed(buf + 4, n, seeds[s]);
                n_edge++;
            }
        }
    printf("lengths near 64/1024 multiples (%ld cases): %ld mismatches\n", n_edge, bad);
    CHECK(bad == 0);

    /* a few MB, block-sum decomposition and whole form, random seeds */
    const uint64_t big[4] = {MAX, MAX - 1, (uint64_t)3 << 20 | 777, (uint64_t)1 << 20};
    for (int k = 0; k < 4; k++) {
        const uint64_t sd = next(), want = XXH3_64bits_withSeed(buf, big[k], sd);
        const uint64_t got = by_blocks(buf, big[k], sd, S), got2 = kvz_xxh3l_hash(buf, big[k], sd);
        printf("%llu bytes, seed %016llx: %016llx %016llx (libxxhash %016llx)\n", (unsigned long long)big[k],
               (unsigned long long)sd, (unsigned long long)got, (unsigned long long)got2, (unsigned long long)want);
        CHECK(got == want && got2 == want);
    }

    /* one flipped bit anywhere (first byte, block edges, the last stripe) changes it */
    const uint64_t n = 5 * KVZ_XXH3L_BLOCK + 100, sd = 42, h0 = kvz_xxh3l_hash(buf, n, sd);
    const uint64_t at[6] = {0, 1023, 1024, 4096, n - 64, n - 1};
    for (int k = 0; k < 6; k++) {
        buf[at[k]] ^= 0x10;
        CHECK(kvz_xxh3l_hash(buf, n, sd) != h0 && kvz_xxh3l_hash(buf, n, sd) == XXH3_64bits_withSeed(buf, n, sd));
        buf[at[k]] ^= 0x10;
    }
    CHECK(kvz_xxh3l_hash(buf, n, sd) == h0 && kvz_xxh3l_hash(buf, n, sd + 1) != h0);
    free(buf);
    free(S);
    return kvz_test_summary();
}
