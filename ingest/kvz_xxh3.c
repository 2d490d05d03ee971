/* Streaming XXH3-64 with a run-time choice of the AVX2 build (kvz_xxh3.h). */
#include "kvz_xxh3.h"

#include <pthread.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t */
#include <xxhash.h>

_Static_assert(sizeof(XXH3_state_t) <= sizeof(((kvz_xxh3 *)0)->st), "kvz_xxh3: state too small");

static int g_avx2;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void probe(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    g_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    g_avx2 = 0;
#endif
}

int kvz_xxh3_avx2(void)
{
    pthread_once(&g_once, probe);
    return g_avx2;
}

void kvz_xxh3_reset(kvz_xxh3 *h, uint64_t seed)
{
    h->avx2 = kvz_xxh3_avx2();
    if (h->avx2) kvz_xxh3_avx2_reset(h->st, seed);
    else XXH3_64bits_reset_withSeed((XXH3_state_t *)(void *)h->st, seed);
}

void kvz_xxh3_update(kvz_xxh3 *h, const void *p, size_t n)
{
    if (h->avx2) kvz_xxh3_avx2_update(h->st, p, n);
    else XXH3_64bits_update((XXH3_state_t *)(void *)h->st, p, n);
}

uint64_t kvz_xxh3_digest(const kvz_xxh3 *h)
{
    if (h->avx2) return kvz_xxh3_avx2_digest(h->st);
    return XXH3_64bits_digest((const XXH3_state_t *)(const void *)h->st);
}
