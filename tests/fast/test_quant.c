/* kvz_quant: type table, fp16/bf16 conversions, dequantization vs golden
 * vectors from gguf-py (tests/golden/dequant.bin, made by
 * scripts/golden/gen_dequant_golden.py).
 *
 * Tolerance: the golden values are computed by numpy with separate multiply
 * and add roundings. Our C build may contract `d*q - m` / `q*d + m` into one
 * FMA (-ffp-contract=fast is GCC's default with -march=x86-64-v3), which moves
 * the result by at most half an ulp of the product term. The product is bounded
 * by the block's largest |value|, so we accept |got - want| <= 2^-22 * blockmax.
 * Types whose formula is a single product (F16, BF16, Q4_0, Q5_0, Q8_0, Q6_K's
 * (d*sc)*q) must match bit for bit.
 *
 * The AVX2 kernels (kvz_dequantize's default on this CPU) against the scalar
 * reference (kvz_dequantize_isa(KVZ_ISA_SCALAR, ..)) on random blocks with extreme
 * scales (max fp16, subnormal, zero, negative): bit for bit for the product-only
 * types, within the same 2^-22 * blockmax for Q4_1 / Q4_K (one FMA vs maybe two
 * roundings). */
#include <stdint.h>
#include <time.h>

#include "kvz_error.h"
#include "kvz_qdot.h"
#include "kvz_quant.h"
#include "kvz_test.h"

static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ------------------------------------------------------------------------ */

static void test_type_table(void)
{
    CHECK(kvz_type_block_elems(KVZ_TYPE_F32) == 1 && kvz_type_block_bytes(KVZ_TYPE_F32) == 4);
    CHECK(kvz_type_block_elems(KVZ_TYPE_F16) == 1 && kvz_type_block_bytes(KVZ_TYPE_F16) == 2);
    CHECK(kvz_type_block_elems(KVZ_TYPE_BF16) == 1 && kvz_type_block_bytes(KVZ_TYPE_BF16) == 2);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q4_0) == 18);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q4_1) == 20);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q5_0) == 22);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q5_1) == 24);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q8_0) == 34);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q8_1) == 36);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q2_K) == 84);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q3_K) == 110);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q4_K) == 144);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q5_K) == 176);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q6_K) == 210);
    CHECK(kvz_type_block_bytes(KVZ_TYPE_Q8_K) == 292);
    CHECK(kvz_type_block_elems(KVZ_TYPE_Q4_K) == 256 && kvz_type_block_elems(KVZ_TYPE_Q8_0) == 32);
    CHECK(kvz_type_block_elems(99) == 0 && kvz_type_block_bytes(99) == 0);
    CHECK(strcmp(kvz_type_name(KVZ_TYPE_Q6_K), "Q6_K") == 0 && strcmp(kvz_type_name(4), "?") == 0);
    CHECK(kvz_type_supported(KVZ_TYPE_Q4_K) && !kvz_type_supported(KVZ_TYPE_Q2_K) && !kvz_type_supported(99));
    CHECK(kvz_type_nbytes(KVZ_TYPE_Q4_1, 576) == 18 * 20);
    CHECK(kvz_type_nbytes(KVZ_TYPE_Q4_1, 33) == -1);
    CHECK(kvz_type_nbytes(KVZ_TYPE_Q4_1, -32) == -1);
    CHECK(kvz_type_nbytes(99, 32) == -1);
    CHECK(kvz_type_nbytes(KVZ_TYPE_F32, INT64_MAX) == -1); /* overflow */

    float out[256];
    uint8_t in[210] = {0};
    CHECK(kvz_dequantize(KVZ_TYPE_Q2_K, in, out, 256) == KVZ_ERR_UNSUPPORTED);
    CHECK(kvz_dequantize(99, in, out, 256) == KVZ_ERR_UNSUPPORTED);
    CHECK(kvz_dequantize(KVZ_TYPE_Q6_K, in, out, 100) == KVZ_ERR_ARG);
    CHECK(kvz_dequantize(KVZ_TYPE_Q6_K, in, out, 0) == 0);
}

/* ------------------------------------------------------------------------ */

/* Independent reference: value of an fp16 bit pattern via ldexp. */
static double fp16_ref(uint16_t h)
{
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

static void test_fp16(void)
{
    int bad_val = 0, bad_rt = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kvz_fp16_to_fp32((uint16_t)h);
        double r = fp16_ref((uint16_t)h);
        if (isnan(r)) {
            if (!isnan(f) || (signbit(f) != 0) != ((h >> 15) != 0)) bad_val++;
            uint16_t back = kvz_fp32_to_fp16(f);
            if ((back & 0x7c00) != 0x7c00 || (back & 0x3ff) == 0 || (back & 0x8000) != (h & 0x8000)) bad_rt++;
            continue;
        }
        if ((double)f != r || !signbit(f) != !signbit(r)) bad_val++;
        if (kvz_fp32_to_fp16(f) != h) bad_rt++;
    }
    CHECKF(bad_val == 0, "%d fp16 values decode wrongly", bad_val);
    CHECKF(bad_rt == 0, "%d fp16 values do not round-trip", bad_rt);

    /* rounding edges */
    CHECK(kvz_fp32_to_fp16(65504.0f) == 0x7bff);
    CHECK(kvz_fp32_to_fp16(65519.996f) == 0x7bff);
    CHECK(kvz_fp32_to_fp16(65520.0f) == 0x7c00);   /* tie -> even = inf */
    CHECK(kvz_fp32_to_fp16(1e10f) == 0x7c00);
    CHECK(kvz_fp32_to_fp16(-INFINITY) == 0xfc00);
    CHECK(kvz_fp32_to_fp16(ldexpf(1, -24)) == 0x0001); /* smallest subnormal */
    CHECK(kvz_fp32_to_fp16(ldexpf(1, -25)) == 0x0000); /* tie -> even = 0 */
    CHECK(kvz_fp32_to_fp16(ldexpf(1.5f, -25)) == 0x0001);
    CHECK(kvz_fp32_to_fp16(ldexpf(3, -25)) == 0x0002); /* 1.5 ulp tie -> even 2 */
    CHECK(kvz_fp32_to_fp16(-ldexpf(1, -30)) == 0x8000);
    CHECK(kvz_fp32_to_fp16(ldexpf(1023.5f, -24)) == 0x0400); /* rounds up into the normals */
    CHECK(kvz_fp32_to_fp16(1.0f + ldexpf(1, -11)) == 0x3c00);          /* tie -> even */
    CHECK(kvz_fp32_to_fp16(1.0f + 3 * ldexpf(1, -11)) == 0x3c02);      /* tie -> even */
    CHECK(kvz_fp32_to_fp16(1.0f + ldexpf(1, -11) + ldexpf(1, -20)) == 0x3c01);
    uint16_t qn = kvz_fp32_to_fp16(NAN);
    CHECK((qn & 0x7c00) == 0x7c00 && (qn & 0x3ff) != 0);
    qn = kvz_fp32_to_fp16(bits_f32(0x7f800001)); /* signalling nan with low payload */
    CHECK((qn & 0x7c00) == 0x7c00 && (qn & 0x3ff) != 0);
    CHECK(isinf(kvz_fp16_to_fp32(0x7c00)) && kvz_fp16_to_fp32(0xfc00) < 0);
    CHECK(kvz_fp16_to_fp32(0x0001) == ldexpf(1, -24));
    CHECK(f32_bits(kvz_fp16_to_fp32(0x8000)) == 0x80000000u);

    /* fp32 -> fp16 on random floats against the compiler's _Float16 (RNE) */
#ifdef __FLT16_MAX__
    uint32_t s = 12345, bad = 0;
    for (int i = 0; i < 2000000; i++) {
        s = s * 1664525u + 1013904223u;
        /* exponents concentrated around the fp16 range */
        uint32_t u = (s & 0x807fffffu) | ((uint32_t)(96 + (s >> 8) % 64) << 23);
        float f = bits_f32(u);
        _Float16 r = (_Float16)f;
        uint16_t rb;
        memcpy(&rb, &r, 2);
        if (kvz_fp32_to_fp16(f) != rb) bad++;
    }
    CHECKF(bad == 0, "%u random fp32->fp16 conversions differ from _Float16", bad);
#endif
}

static void test_bf16(void)
{
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kvz_bf16_to_fp32((uint16_t)h);
        if (f32_bits(f) != h << 16) bad++;
        uint16_t back = kvz_fp32_to_bf16(f);
        if (isnan(f) ? !isnan(kvz_bf16_to_fp32(back)) || (back & 0x8000) != (h & 0x8000) : back != h) bad++;
    }
    CHECKF(bad == 0, "%d bf16 values fail", bad);
    CHECK(kvz_fp32_to_bf16(bits_f32(0x3f808000)) == 0x3f80); /* tie -> even */
    CHECK(kvz_fp32_to_bf16(bits_f32(0x3f818000)) == 0x3f82); /* tie -> even (up) */
    CHECK(kvz_fp32_to_bf16(bits_f32(0x3f808001)) == 0x3f81);
    CHECK(kvz_fp32_to_bf16(3.4028235e38f) == 0x7f80);        /* FLT_MAX rounds to inf */
    CHECK(kvz_fp32_to_bf16(INFINITY) == 0x7f80 && kvz_fp32_to_bf16(-INFINITY) == 0xff80);
    CHECK(kvz_fp32_to_bf16(bits_f32(0x7f800001)) == 0x7fc0);   /* snan -> quiet, not inf */
    CHECK(kvz_fp32_to_bf16(bits_f32(0xffc00000)) == 0xffc0);
    CHECK(kvz_fp32_to_bf16(bits_f32(0x00000001)) == 0x0000);   /* fp32 subnormal */
    CHECK(kvz_fp32_to_bf16(bits_f32(0x00018000)) == 0x0002);
}

/* ------------------------------------------------------------------------ */

typedef struct {
    const uint8_t *p, *end;
} rd;

static int take(rd *r, void *dst, size_t n)
{
    if ((size_t)(r->end - r->p) < n) return 0;
    if (dst) memcpy(dst, r->p, n);
    r->p += n;
    return 1;
}

static int exact_type(uint32_t t)
{
    return t == KVZ_TYPE_F32 || t == KVZ_TYPE_F16 || t == KVZ_TYPE_BF16 || t == KVZ_TYPE_Q4_0 ||
           t == KVZ_TYPE_Q5_0 || t == KVZ_TYPE_Q8_0 || t == KVZ_TYPE_Q6_K;
}

static void test_golden(void)
{
    char path[4096];
    size_t len = 0;
    uint8_t *buf = (uint8_t *)kvz_test_read_file(kvz_test_path(path, sizeof path, "tests/golden/dequant.bin"), &len);
    CHECKF(buf != NULL, "cannot read %s", path);
    if (!buf) return;
    rd r = {buf, buf + len};
    char magic[8];
    uint32_t n_rec = 0;
    CHECK(take(&r, magic, 8) && memcmp(magic, "KVZDQ001", 8) == 0);
    CHECK(take(&r, &n_rec, 4) && n_rec >= 10);
    int seen[32] = {0};
    for (uint32_t i = 0; i < n_rec; i++) {
        uint32_t type, ll;
        uint64_t n, nb;
        char label[256] = {0};
        if (!take(&r, &type, 4) || !take(&r, &ll, 4) || ll >= sizeof label || !take(&r, label, ll) ||
            !take(&r, &n, 8) || !take(&r, &nb, 8) || (size_t)(r.end - r.p) < nb + 4 * n) {
            CHECKF(0, "golden record %u malformed", i);
            break;
        }
        const uint8_t *raw = r.p;
        const uint8_t *want_b = r.p + nb;
        r.p += nb + 4 * n;
        CHECKF(kvz_type_nbytes(type, (int64_t)n) == (int64_t)nb, "%s: size %llu for %llu elems", label,
               (unsigned long long)nb, (unsigned long long)n);
        float *got = malloc(n * sizeof *got), *want = malloc(n * sizeof *want);
        memcpy(want, want_b, 4 * n);
        int rc = kvz_dequantize(type, raw, got, (int64_t)n);
        CHECKF(rc == 0, "%s: rc %d", label, rc);
        int64_t blk = kvz_type_block_elems(type);
        uint64_t n_exact = 0, n_bad = 0;
        for (uint64_t b = 0; b < n; b += (uint64_t)blk) {
            float bmax = 0;
            for (int64_t j = 0; j < blk; j++)
                if (isfinite(want[b + j]) && fabsf(want[b + j]) > bmax) bmax = fabsf(want[b + j]);
            for (int64_t j = 0; j < blk; j++) {
                float g = got[b + j], w = want[b + j];
                if (f32_bits(g) == f32_bits(w) || (isnan(g) && isnan(w))) { n_exact++; continue; }
                if (!exact_type(type) && fabsf(g - w) <= ldexpf(bmax, -22)) continue;
                if (n_bad++ < 3)
                    fprintf(stderr, "  %s[%llu]: got %.9g want %.9g\n", label,
                            (unsigned long long)(b + j), g, w);
            }
        }
        CHECKF(n_bad == 0, "%s: %llu of %llu values differ", label, (unsigned long long)n_bad,
               (unsigned long long)n);
        printf("  %-40s %6llu elems, %6llu bit-exact\n", label, (unsigned long long)n,
               (unsigned long long)n_exact);
        if (type < 32) seen[type] = 1;
        free(got);
        free(want);
    }
    const uint32_t must[] = {KVZ_TYPE_F32, KVZ_TYPE_F16, KVZ_TYPE_BF16, KVZ_TYPE_Q8_0, KVZ_TYPE_Q4_0,
                             KVZ_TYPE_Q4_1, KVZ_TYPE_Q5_0, KVZ_TYPE_Q5_1, KVZ_TYPE_Q4_K, KVZ_TYPE_Q5_K,
                             KVZ_TYPE_Q6_K};
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++)
        CHECKF(seen[must[i]], "no golden record for %s", kvz_type_name(must[i]));
    free(buf);
}

/* Throughput, informational: the default model dequantizes ~135M weights at load. */
static void bench(void)
{
    const uint32_t types[] = {KVZ_TYPE_Q4_1, KVZ_TYPE_Q8_0, KVZ_TYPE_Q4_K, KVZ_TYPE_Q6_K};
    const int64_t n = 1 << 22;
    float *dst = malloc((size_t)n * sizeof *dst);
    uint8_t *src = malloc((size_t)kvz_type_nbytes(KVZ_TYPE_Q8_0, n));
    memset(dst, 0, (size_t)n * sizeof *dst); /* fault the pages in before timing */
    for (int64_t i = 0; i < kvz_type_nbytes(KVZ_TYPE_Q8_0, n); i++) src[i] = (uint8_t)(i * 7 + 3);
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        /* keep scale fields small finite fp16 values: 0x2000 */
        int64_t bb = kvz_type_block_bytes(types[t]);
        for (int64_t b = 0; b < kvz_type_nbytes(types[t], n) / bb; b++) {
            uint8_t *blk = src + b * bb;
            if (types[t] == KVZ_TYPE_Q6_K) { blk[208] = 0; blk[209] = 0x20; }
            else { blk[0] = 0; blk[1] = 0x20; blk[2] = 0; blk[3] = 0x20; }
        }
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        CHECK(kvz_dequantize(types[t], src, dst, n) == 0);
        clock_gettime(CLOCK_MONOTONIC, &b);
        double s = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
        printf("  dequantize %-5s %.1f M elems/s\n", kvz_type_name(types[t]), (double)n / s * 1e-6);
    }
    free(dst);
    free(src);
}

/* fp16 scale fields: random finite values, with the extremes mixed in */
static uint16_t rand_scale(uint32_t *st)
{
    static const uint16_t ext[] = {0x7bff, 0xfbff, 0x0001, 0x8001, 0x03ff, 0x0000, 0x8000, 0x3c00, 0x0400};
    *st = *st * 1664525u + 1013904223u;
    const uint32_t r = *st >> 8;
    if (r % 4 == 0) return ext[(r >> 4) % (sizeof ext / sizeof ext[0])];
    uint16_t h = (uint16_t)(r >> 3);
    if ((h & 0x7c00) == 0x7c00) h &= 0xbfff; /* no inf / nan */
    return h;
}

static void test_isa(void)
{
    const int isa = kvz_qdot_cpu_isa();
    printf("dequantize: %s kernels vs scalar\n", kvz_isa_name(isa >= KVZ_ISA_AVX2 ? KVZ_ISA_AVX2 : isa));
    if (isa < KVZ_ISA_AVX2) printf("  (this CPU has no AVX2: both sides run the scalar code)\n");
    static const struct { uint32_t type; int exact; int nscale; int scale_off[2]; } ts[] = {
        {KVZ_TYPE_Q4_1, 0, 2, {0, 2}}, {KVZ_TYPE_Q5_0, 1, 1, {0, 0}}, {KVZ_TYPE_Q8_0, 1, 1, {0, 0}},
        {KVZ_TYPE_Q4_K, 0, 2, {0, 2}}, {KVZ_TYPE_Q6_K, 1, 1, {208, 0}},
        {KVZ_TYPE_Q4_0, 1, 1, {0, 0}}, {KVZ_TYPE_Q5_1, 0, 2, {0, 4}}, {KVZ_TYPE_Q5_K, 0, 2, {0, 2}},
    };
    uint32_t st = 12345;
    for (size_t t = 0; t < sizeof ts / sizeof ts[0]; t++) {
        const int64_t be = kvz_type_block_elems(ts[t].type), bb = kvz_type_block_bytes(ts[t].type);
        const int64_t nblk = 4096, n = nblk * be;
        uint8_t *src = malloc((size_t)(nblk * bb));
        float *a = malloc((size_t)n * sizeof *a), *b = malloc((size_t)n * sizeof *b);
        if (!src || !a || !b) { CHECK(0); return; }
        for (int64_t i = 0; i < nblk * bb; i++) {
            st = st * 1664525u + 1013904223u;
            src[i] = (uint8_t)(st >> 24);
        }
        for (int64_t k = 0; k < nblk; k++)
            for (int s = 0; s < ts[t].nscale; s++) {
                const uint16_t h = rand_scale(&st);
                memcpy(src + k * bb + ts[t].scale_off[s], &h, 2);
            }
        CHECK(kvz_dequantize_isa(KVZ_ISA_SCALAR, ts[t].type, src, a, n) == 0);
        CHECK(kvz_dequantize_isa(KVZ_ISA_AVX2, ts[t].type, src, b, n) == 0);
        int64_t bad = 0;
        double worst = 0;
        for (int64_t k = 0; k < nblk; k++) {
            double bmax = 0;
            for (int64_t j = 0; j < be; j++) bmax = fmax(bmax, fabs((double)a[k * be + j]));
            for (int64_t j = 0; j < be; j++) {
                const float x = a[k * be + j], y = b[k * be + j];
                const double d = fabs((double)x - (double)y);
                if (ts[t].exact ? f32_bits(x) != f32_bits(y) : d > ldexp(bmax, -22)) bad++;
                if (bmax > 0) worst = fmax(worst, d / bmax);
            }
        }
        printf("  %-5s %lld blocks: %lld differ%s, max |d| / blockmax %.3g\n", kvz_type_name(ts[t].type),
               (long long)nblk, (long long)bad, ts[t].exact ? " in any bit" : " beyond 2^-22 blockmax", worst);
        CHECKF(bad == 0, "%s: AVX2 and scalar dequantization differ", kvz_type_name(ts[t].type));
        free(src);
        free(a);
        free(b);
    }
}

int main(void)
{
    test_type_table();
    test_fp16();
    test_bf16();
    test_golden();
    test_isa();
    bench();
    return kvz_test_summary();
}
