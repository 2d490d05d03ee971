/* The xxHash header's own XXH3 built for AVX2 (kvz_xxh3.h): every function of this
 * file may use AVX2, so kvz_xxh3.c calls it only after the CPU said it has it.
 * GCC's target pragma also defines __AVX2__, which makes xxhash.h pick its AVX2 path;
 * a compiler that does not gets the SSE2 path here (same values, slower). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2")
#ifndef __AVX2__
#error "the target pragma did not define __AVX2__: xxhash.h would not take its AVX2 path"
#endif
#endif
#include <stddef.h>
#include <stdint.h>
#define XXH_INLINE_ALL /* private copies (XXH_INLINE_ names), not the library's */
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "kvz_xxh3.h"

_Static_assert(sizeof(XXH3_state_t) <= sizeof(((kvz_xxh3 *)0)->st), "kvz_xxh3: state too small");

void kvz_xxh3_avx2_reset(void *st, uint64_t seed) { XXH3_64bits_reset_withSeed((XXH3_state_t *)st, seed); }
void kvz_xxh3_avx2_update(void *st, const void *p, size_t n) { XXH3_64bits_update((XXH3_state_t *)st, p, n); }
uint64_t kvz_xxh3_avx2_digest(const void *st) { return XXH3_64bits_digest((const XXH3_state_t *)st); }
