/* The device verification of stored records (kernels/kvz_cuda_verify.h) against
 * independent truth on the host:
 *   - XXH3-64 with a seed (kvz_cuda_xxh3_sums + kvz_cuda_xxh3_chain) against
 *     libxxhash's XXH3_64bits_withSeed: every length 241..5000 (random seeds, start
 *     offsets 0 and 4), lengths around multiples of 64 and 1024 up to 70 KB, and a
 *     40 MB buffer (timed: the sums pass and the chain, beside the time to read 40 MB);
 *   - the q8/q4 row check of kvz_cuda_kv_load_checked against format/kvz_kvrow.c's
 *     kvz_kvrow_check (first bad row, K rows then V rows) on rows with a NaN, Inf,
 *     negative or -0 scale, a q8 -128, a q4 m that is Inf, and clean rows (no flag).
 * Exit 77 (SKIP) when no CUDA device is usable. */
#include "kvz_test.h"
#include "kvz_gpu_test_util.h"

#include <xxhash.h>

#include "kvz_cuda.h"
#include "kvz_cuda_verify.h"
#include "kvz_error.h"
#include "kvz_kvdtype.h"
#include "kvz_kvrow.h"

static cudaStream_t g_s;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* hash jobs[i] = (off[i], len[i], seed[i]) of the device buffer @p d in one chain launch */
static void hash_many(const uint8_t *d, int n, const uint64_t *off, const uint64_t *len, const uint64_t *seed,
                      uint64_t *out)
{
    uint64_t tot = 0;
    for (int i = 0; i < n; i++) tot += kvz_cuda_xxh3_sums_len(len[i]);
    uint64_t *sums = dalloc(tot * 8);
    kvz_cuda_xxh3_job *jobs = malloc(sizeof *jobs * (size_t)n);
    uint64_t at = 0;
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        jobs[i] = (kvz_cuda_xxh3_job){len[i], seed[i], at};
        rc = kvz_cuda_xxh3_sums(g_s, d + off[i], len[i], seed[i], sums + at);
        at += kvz_cuda_xxh3_sums_len(len[i]);
    }
    CHECKF(rc == 0, "xxh3_sums: %s", kvz_error_detail());
    kvz_cuda_xxh3_job *dj = dup_to_dev(jobs, sizeof *jobs * (size_t)n);
    uint64_t *dd = dalloc((size_t)n * 8);
    rc = kvz_cuda_xxh3_chain(g_s, dj, n, sums, dd);
    CHECKF(rc == 0, "xxh3_chain: %s", kvz_error_detail());
    CU(cudaStreamSynchronize(g_s));
    to_host(out, dd, (size_t)n * 8);
    cudaFree(sums);
    cudaFree(dj);
    cudaFree(dd);
    free(jobs);
}

static void test_hash(void)
{
    const size_t BIG = (size_t)40 << 20;
    uint8_t *h = malloc(BIG + 64);
    for (size_t i = 0; i < BIG + 64; i++) h[i] = (uint8_t)rng_u64();
    uint8_t *d = dup_to_dev(h, BIG + 64);

    /* every length 241..5000, start 0 or 4 */
    enum { NL = 5000 - 241 + 1 };
    static uint64_t off[NL + 2000], len[NL + 2000], sd[NL + 2000], got[NL + 2000];
    int n = 0;
    for (uint64_t L = 241; L <= 5000; L++, n++) {
        off[n] = (L & 1) ? 4 : 0;
        len[n] = L;
        sd[n] = (L % 7 == 0) ? 0 : (L % 7 == 1) ? ~0ull : rng_u64();
    }
    for (uint64_t m = 5120; m <= 70000 && n < NL + 2000 - 4; m += 64) /* stripe and block edges */
        for (int k = -1; k <= 1; k++) {
            if (m % 1024 && k) continue;
            off[n] = 4 * (m % 3);
            len[n] = m + (uint64_t)(int64_t)k;
            sd[n] = rng_u64();
            n++;
        }
    hash_many(d, n, off, len, sd, got);
    long bad = 0;
    for (int i = 0; i < n; i++) {
        const uint64_t want = XXH3_64bits_withSeed(h + off[i], len[i], sd[i]);
        if (got[i] != want && bad++ < 5)
            fprintf(stderr, "  length %llu at +%llu seed %016llx: %016llx, libxxhash %016llx\n",
                    (unsigned long long)len[i], (unsigned long long)off[i], (unsigned long long)sd[i],
                    (unsigned long long)got[i], (unsigned long long)want);
    }
    printf("  xxh3 on the device, %d lengths (241..5000, 64/1024 edges to 70 KB): %ld differ from libxxhash\n", n, bad);
    CHECK(bad == 0);

    /* 40 MB, timed */
    const uint64_t s40 = rng_u64(), want = XXH3_64bits_withSeed(h + 4, BIG, s40);
    uint64_t *sums = dalloc(kvz_cuda_xxh3_sums_len(BIG) * 8);
    kvz_cuda_xxh3_job jb = {BIG, s40, 0};
    kvz_cuda_xxh3_job *dj = dup_to_dev(&jb, sizeof jb);
    uint64_t *dd = dalloc(8), dig = 0;
    cudaEvent_t e0, e1, e2;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    CU(cudaEventCreate(&e2));
    float best_s = 1e9f, best_c = 1e9f;
    for (int it = 0; it < 5; it++) {
        CU(cudaEventRecord(e0, g_s));
        CHECK(kvz_cuda_xxh3_sums(g_s, d + 4, BIG, s40, sums) == 0);
        CU(cudaEventRecord(e1, g_s));
        CHECK(kvz_cuda_xxh3_chain(g_s, dj, 1, sums, dd) == 0);
        CU(cudaEventRecord(e2, g_s));
        CU(cudaEventSynchronize(e2));
        float ms1 = 0, ms2 = 0;
        CU(cudaEventElapsedTime(&ms1, e0, e1));
        CU(cudaEventElapsedTime(&ms2, e1, e2));
        if (ms1 < best_s) best_s = ms1;
        if (ms2 < best_c) best_c = ms2;
    }
    to_host(&dig, dd, 8);
    /* the read bound: one device-to-device copy of 40 MB reads and writes it once */
    float best_cp = 1e9f;
    uint8_t *d2 = dalloc(BIG);
    for (int it = 0; it < 5; it++) {
        CU(cudaEventRecord(e0, g_s));
        CU(cudaMemcpyAsync(d2, d, BIG, cudaMemcpyDeviceToDevice, g_s));
        CU(cudaEventRecord(e1, g_s));
        CU(cudaEventSynchronize(e1));
        float ms = 0;
        CU(cudaEventElapsedTime(&ms, e0, e1));
        if (ms < best_cp) best_cp = ms;
    }
    const double t0 = now_s();
    const uint64_t host = XXH3_64bits_withSeed(h + 4, BIG, s40);
    const double th = now_s() - t0;
    printf("  xxh3 of 40 MB on the device: %016llx (libxxhash %016llx); sums %.3f ms (%.0f GB/s), chain %.3f ms; "
           "device copy of 40 MB %.3f ms (%.0f GB/s read+write); host libxxhash one thread %.2f ms\n",
           (unsigned long long)dig, (unsigned long long)want, best_s, BIG / (best_s * 1e6), best_c, best_cp,
           2.0 * BIG / (best_cp * 1e6), th * 1e3);
    CHECK(dig == want && host == want);
    cudaFree(sums);
    cudaFree(dj);
    cudaFree(dd);
    cudaFree(d2);
    cudaFree(d);
    free(h);
}

/* q8/q4 records of 3 heads with bad rows where @p plant puts them: the device's first
 * bad row must be kvz_kvrow_check's over K rows then V rows (UINT64_MAX: none) */
static void row_case(int dt, const char *what, int plant_v, int row, int kind, int also_k13)
{
    const int H = 3, hd = 64, cnt[3] = {5, 0, 9}, tot = 14;
    const size_t rb = kvz_kv_row_bytes(dt, hd);
    float *x = malloc(sizeof(float) * (size_t)tot * hd);
    for (int i = 0; i < tot * hd; i++) x[i] = rng_sym();
    uint8_t *k = malloc(rb * tot), *v = malloc(rb * tot);
    if (kvz_kvrow_encode(dt, x, (size_t)tot, hd, k) || kvz_kvrow_encode(dt, x, (size_t)tot, hd, v)) {
        CHECKF(0, "encode: %s", kvz_error_detail());
        return;
    }
    for (int t = 0; t < 1 + also_k13; t++) {
    uint8_t *r = t ? k + (size_t)(tot - 1) * rb : (plant_v ? v : k) + (size_t)row * rb;
    const int g = 1; /* second scale group */
    switch (kind) {
    case 0: break; /* clean */
    case 1: r[dt == KVZ_KV_Q8 ? 2 * g + 1 : 4 * g + 1] = 0x7e; break; /* d NaN */
    case 2: r[dt == KVZ_KV_Q8 ? 2 * g + 1 : 4 * g + 1] = 0x7c, r[dt == KVZ_KV_Q8 ? 2 * g : 4 * g] = 0; break; /* +Inf */
    case 3: r[dt == KVZ_KV_Q8 ? 2 * g + 1 : 4 * g + 1] |= 0x80; break; /* negative */
    case 4: r[dt == KVZ_KV_Q8 ? 2 * g + 1 : 4 * g + 1] = 0x80, r[dt == KVZ_KV_Q8 ? 2 * g : 4 * g] = 0; break; /* -0 */
    case 5: r[2 * (hd / 32) + 37] = 0x80; break; /* q8 value -128 */
    case 6: r[4 * g + 3] = 0xfc, r[4 * g + 2] = 0; break; /* q4 m = -Inf */
    }
    }
    /* host truth: K rows 0..tot-1, then V rows tot..2tot-1 */
    uint64_t want = UINT64_MAX, b = 0;
    if (kvz_kvrow_check(dt, k, (size_t)tot, hd, &b)) want = b;
    else if (kvz_kvrow_check(dt, v, (size_t)tot, hd, &b)) want = (uint64_t)tot + b;
    kvz_cuda_kv kv = {dalloc((size_t)H * 16 * hd * 2), dalloc((size_t)H * 16 * hd * 2), dalloc((size_t)H * 16 * 4),
                      dalloc((size_t)H * 4), H, 16, hd};
    uint32_t pos[14];
    for (int i = 0; i < tot; i++) pos[i] = (uint32_t)i;
    void *dk = dup_to_dev(k, rb * tot), *dv = dup_to_dev(v, rb * tot), *dp = dup_to_dev(pos, sizeof pos);
    unsigned long long init = ~0ull, got = 0;
    unsigned long long *dbad = dup_to_dev(&init, 8);
    const int rc = kvz_cuda_kv_load_checked(g_s, &kv, dt, cnt, 1, dk, dv, dp, dbad);
    CU(cudaStreamSynchronize(g_s));
    to_host(&got, dbad, 8);
    printf("  %s rows, %-22s device first bad row %lld, kvz_kvrow_check %lld\n", kvz_kv_dtype_name(dt), what,
           got == ~0ull ? -1LL : (long long)got, want == UINT64_MAX ? -1LL : (long long)want);
    CHECK(rc == 0 && (uint64_t)got == want);
    CHECK(kind == 0 ? want == UINT64_MAX : want != UINT64_MAX);
    cudaFree(kv.k); cudaFree(kv.v); cudaFree(kv.pos); cudaFree(kv.len);
    cudaFree(dk); cudaFree(dv); cudaFree(dp); cudaFree(dbad);
    free(x); free(k); free(v);
}

static void test_rows(void)
{
    static const char *names[7] = {"clean:", "NaN scale (K row 3):", "Inf scale:", "negative scale:", "-0 scale:",
                                   "q8 value -128:", "q4 m -Inf:"};
    for (int dt = KVZ_KV_Q8; dt <= KVZ_KV_Q4; dt++)
        for (int kind = 0; kind < 7; kind++) {
            if ((kind == 5 && dt != KVZ_KV_Q8) || (kind == 6 && dt != KVZ_KV_Q4)) continue;
            row_case(dt, names[kind], 0, 3, kind, 0);
            if (!kind) continue;
            row_case(dt, names[kind], 1, 12, kind, 0); /* a V row in the last head */
            row_case(dt, names[kind], 1, 2, kind, 1);  /* V row 2 and K row 13: K rows come first */
            row_case(dt, names[kind], 0, 3, kind, 1);  /* K rows 3 and 13: the lower */
        }
}

int main(void)
{
    int ndev = 0;
    if (kvz_cuda_device_count(&ndev) != 0 || ndev == 0) {
        printf("SKIP: no usable CUDA device (%s)\n", kvz_error_detail());
        return 77;
    }
    const char *se = getenv("KVZ_SEED");
    const uint64_t seed = se ? strtoull(se, NULL, 10) : (uint64_t)time(NULL);
    rng_seed(seed);
    printf("xxh3 / row check on the device, seed %llu (KVZ_SEED=n reproduces)\n", (unsigned long long)seed);
    CU(cudaStreamCreate(&g_s));
    test_hash();
    test_rows();
    cudaStreamDestroy(g_s);
    return kvz_test_summary();
}
