/**
 * @file kvz_xxh3.h
 * @brief Streaming XXH3-64 (seeded) for the loader's record checksum, at the speed
 *        of the CPU it runs on: the xxHash header built for AVX2 where the CPU has
 *        it (kvz_xxh3_avx2.c, chosen at run time), else the system libxxhash (built
 *        for SSE2 on x86-64, 2-4x slower on the megabyte pieces the loader hashes).
 *        Same hash values either way (XXH3 is defined independently of the vector
 *        path). Reentrant; nothing global but the one-time CPU check.
 */
#ifndef KVZ_XXH3_H
#define KVZ_XXH3_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** One running hash; room for an XXH3_state_t (checked where it is used). */
typedef struct kvz_xxh3 {
    _Alignas(64) unsigned char st[704];
    int avx2;
} kvz_xxh3;

void kvz_xxh3_reset(kvz_xxh3 *h, uint64_t seed);
void kvz_xxh3_update(kvz_xxh3 *h, const void *p, size_t n);
uint64_t kvz_xxh3_digest(const kvz_xxh3 *h);

/** 1 when the AVX2 build is used on this CPU. */
int kvz_xxh3_avx2(void);

/* the AVX2 build (kvz_xxh3_avx2.c); only called when kvz_xxh3_avx2() is 1 */
void kvz_xxh3_avx2_reset(void *st, uint64_t seed);
void kvz_xxh3_avx2_update(void *st, const void *p, size_t n);
uint64_t kvz_xxh3_avx2_digest(const void *st);

#ifdef __cplusplus
}
#endif
#endif
