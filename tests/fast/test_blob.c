/* Blob format: golden bytes, exact round trip, and rejection of every truncation,
 * every single-byte flip, other versions, other models and resealed corruptions;
 * version 1 (blob_f32/f16.*: still read, and still written when asked) and
 * version 2 (blob_v2_*.*: codec none/zstd, q8/q4 rows, shared prefix), and the
 * KV row codecs of format/kvz_kvrow.h.
 * `fast_test_blob --write-golden DIR` regenerates tests/golden/blob_*. */
#include "blob_fixture.h"
#include "kvz_blob.h"
#include "kvz_error.h"
#include "kvz_kvrow.h"
#include "kvz_quant.h"
#include "kvz_test.h"

#include <math.h>

#include <stdint.h>
#include <xxhash.h>
#include <zstd.h>

#define NEED(cond) do { if (!(cond)) { CHECK(cond); return; } } while (0)
#define PINNED_HASH 0x21, 0xae, 0x89, 0xb0, 0xb0, 0xac, 0x6e, 0xb7, 0x5c, 0x6f, 0x84, 0xd4, 0xb7, 0x65, 0x88, 0xec

static const uint8_t DTYPES[2] = {KVZ_DTYPE_F32, KVZ_DTYPE_F16};
static const char *DNAMES[2] = {"f32", "f16"};

typedef struct {
    uint8_t *rec[1 + FX_L];
    size_t len[1 + FX_L];
} fx_blob;

static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static int encode_fx(const fx_cache *c, fx_blob *b)
{
    int err = kvz_blob_encode_meta(&c->meta, 3, &b->rec[0], &b->len[0]);
    for (uint32_t l = 0; l < FX_L && !err; l++)
        err = kvz_blob_encode_layer(&c->meta, l, c->pos[l], c->k[l], c->v[l], 3, &b->rec[1 + l],
                                    &b->len[1 + l]);
    return err;
}

static void free_blob(fx_blob *b)
{
    for (int i = 0; i < 1 + FX_L; i++) free(b->rec[i]);
    memset(b, 0, sizeof *b);
}

/* Concatenate records (or their decompressed payloads) into one buffer. */
static uint8_t *concat(const fx_blob *b, int raw, size_t *n)
{
    size_t cap = 0;
    for (int i = 0; i < 1 + FX_L; i++) cap += b->len[i] + get64(b->rec[i] + 24);
    uint8_t *out = malloc(cap + 1);
    *n = 0;
    for (int i = 0; i < 1 + FX_L; i++) {
        if (!raw || b->rec[i][7] == KVZ_BLOB_CODEC_NONE) { /* record, or raw payload in place */
            size_t o = raw ? KVZ_BLOB_HEADER_SIZE : 0;
            memcpy(out + *n, b->rec[i] + o, b->len[i] - o);
            *n += b->len[i] - o;
            continue;
        }
        size_t r = ZSTD_decompress(out + *n, cap - *n, b->rec[i] + KVZ_BLOB_HEADER_SIZE,
                                   b->len[i] - KVZ_BLOB_HEADER_SIZE);
        if (ZSTD_isError(r)) { free(out); return NULL; }
        *n += r;
    }
    return out;
}

/* Split a concatenation of records (golden file) using each header's comp_size. */
static int split(const uint8_t *buf, size_t n, fx_blob *b)
{
    size_t o = 0;
    for (int i = 0; i < 1 + FX_L; i++) {
        if (n - o < KVZ_BLOB_HEADER_SIZE) return -1;
        size_t len = KVZ_BLOB_HEADER_SIZE + get64(buf + o + 32);
        if (len > n - o) return -1;
        b->rec[i] = malloc(len);
        memcpy(b->rec[i], buf + o, len);
        b->len[i] = len;
        o += len;
    }
    return o == n ? 0 : -1;
}

static int write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static int decode_equals(const fx_blob *b, const fx_cache *c);
static void reseal(uint8_t *rec, size_t len);
static uint8_t *make_record(const uint8_t *hdr_from, const void *raw, size_t raw_n, size_t *len);
/* ------------------------------------------------------------------------- */
/* Version 2 fixture: head_dim 32 so that q8/q4 apply; K/V made from fp32 values
 * through the row codecs; prefix KEEP or SHARED. */
#define F2_L 2
#define F2_H 2
#define F2_HD 32
#define F2_PREFIX 3
#define F2_CONTEXT 12
#define F2_ROWS (F2_PREFIX + F2_CONTEXT)

typedef struct {
    kvz_blob_meta meta;
    uint32_t counts[F2_L * F2_H];
    uint32_t pos[F2_L][F2_H * F2_ROWS];          /* (kept) */
    float kf[F2_L][F2_H * F2_ROWS * F2_HD], vf[F2_L][F2_H * F2_ROWS * F2_HD]; /* (kept, hd) fp32 source */
    uint8_t k[F2_L][F2_H * F2_ROWS * F2_HD * 4], v[F2_L][F2_H * F2_ROWS * F2_HD * 4]; /* (kept, row bytes) */
    fx_blob b;
} f2_cache;

static int f2_make(f2_cache *c, uint8_t dtype, uint8_t policy)
{
    static const uint32_t keep_counts[F2_L * F2_H] = {7, 15, 9, 4};   /* KEEP: >= n_prefix */
    static const uint32_t shared_counts[F2_L * F2_H] = {4, 12, 6, 0}; /* SHARED: context only */
    memset(c, 0, sizeof *c);
    memcpy(c->counts, policy == KVZ_PREFIX_SHARED ? shared_counts : keep_counts, sizeof c->counts);
    kvz_blob_meta *m = &c->meta;
    for (int i = 0; i < 16; i++) m->fingerprint[i] = (uint8_t)(0xB0 + i);
    m->n_layer = F2_L;
    m->n_head = 3 * F2_H;
    m->n_kv_head = F2_H;
    m->head_dim = F2_HD;
    m->dtype = dtype;
    m->mode = KVZ_MODE_UNIFORM;
    m->prefix_policy = policy;
    m->ratio = 0.3f;
    m->chunk = 2000;
    m->overlap = 8;
    m->n_prefix = F2_PREFIX;
    m->n_context = F2_CONTEXT;
    m->counts = c->counts;
    if (policy == KVZ_PREFIX_SHARED)
        for (int i = 0; i < 16; i++) m->prefix_ref[i] = (uint8_t)(0x51 + 3 * i);
    const uint32_t first = policy == KVZ_PREFIX_KEEP ? 0 : F2_PREFIX;
    for (uint32_t l = 0; l < F2_L; l++) {
        uint32_t row = 0;
        for (uint32_t h = 0; h < F2_H; h++) {
            const uint32_t n = c->counts[l * F2_H + h];
            /* KEEP: the prefix, then the first context tokens; SHARED: every other one */
            for (uint32_t i = 0; i < n; i++, row++) {
                uint32_t j = policy == KVZ_PREFIX_KEEP ? i : first + (n <= F2_CONTEXT / 2 ? 2 * i : i);
                c->pos[l][row] = j;
                for (uint32_t d = 0; d < F2_HD; d++) { /* hashed: incompressible once quantised */
                    uint32_t u = (d + 64 * j + 4096 * h + 65536 * l) * 2654435761u;
                    u ^= u >> 15;
                    u *= 2246822519u;
                    u ^= u >> 13;
                    c->kf[l][row * F2_HD + d] = ((float)(u >> 8) * 0x1p-24f - 0.5f) * 3.4f;
                    c->vf[l][row * F2_HD + d] = ((float)(u & 0xffff) * 0x1p-16f - 0.4f) * 1.2f;
                }
            }
        }
        if (kvz_kvrow_encode(dtype, c->kf[l], row, F2_HD, c->k[l]) ||
            kvz_kvrow_encode(dtype, c->vf[l], row, F2_HD, c->v[l]))
            return -1;
    }
    int err = kvz_blob_encode_meta(m, 0, &c->b.rec[0], &c->b.len[0]);
    for (uint32_t l = 0; l < F2_L && !err; l++)
        err = kvz_blob_encode_layer(m, l, c->pos[l], c->k[l], c->v[l], 0, &c->b.rec[1 + l], &c->b.len[1 + l]);
    return err;
}

/* the version-2 goldens: name, dtype, prefix policy */
static const struct { const char *name; uint8_t dtype, policy; } V2G[] = {
    {"f16", KVZ_DTYPE_F16, KVZ_PREFIX_KEEP},
    {"q8", KVZ_DTYPE_Q8, KVZ_PREFIX_KEEP},
    {"q4_shared", KVZ_DTYPE_Q4, KVZ_PREFIX_SHARED},
};
#define N_V2G (int)(sizeof V2G / sizeof V2G[0])

static int write_golden_v2(const char *dir)
{
    char path[1024];
    for (int g = 0; g < N_V2G + 1; g++) {
        fx_blob b = {0}, *bp = &b;
        f2_cache *c = malloc(sizeof *c);
        fx_cache fc;
        const char *name = "f32_small";
        if (g < N_V2G) { /* head_dim-32 fixture */
            name = V2G[g].name;
            if (!c || f2_make(c, V2G[g].dtype, V2G[g].policy)) { fprintf(stderr, "encode: %s\n", kvz_error_detail()); return 1; }
            bp = &c->b;
        } else { /* the version-1 fixture written as version 2: compressible, codec zstd */
            fx_make(&fc, KVZ_DTYPE_F32);
            if (encode_fx(&fc, &b)) return 1;
        }
        for (int raw = 0; raw < 2; raw++) {
            size_t n;
            uint8_t *all = concat(bp, raw, &n);
            snprintf(path, sizeof path, "%s/blob_v2_%s.%s", dir, name, raw ? "raw" : "kvzb");
            if (!all || write_file(path, all, n)) return 1;
            free(all);
        }
        free_blob(bp);
        free(c);
    }
    return 0;
}

/* Decode an f2 blob and compare with the fixture's stored rows. */
static int f2_decode_equals(const fx_blob *b, const f2_cache *c)
{
    kvz_blob_meta m;
    int err = kvz_blob_decode_meta(b->rec[0], b->len[0], c->meta.fingerprint, &m);
    if (err) return err;
    int same = m.version == 2 && m.dtype == c->meta.dtype && m.prefix_policy == c->meta.prefix_policy &&
               !memcmp(m.prefix_ref, c->meta.prefix_ref, 16) && m.head_dim == F2_HD &&
               !memcmp(m.counts, c->counts, sizeof c->counts) && kvz_blob_meta_id(&m) == kvz_blob_meta_id(&c->meta);
    const size_t rb = kvz_blob_kv_row_bytes(&m);
    for (uint32_t l = 0; l < F2_L && same && !err; l++) {
        uint64_t kept = kvz_blob_layer_kept(&m, l);
        uint32_t pos[F2_H * F2_ROWS];
        uint8_t k[sizeof c->k[0]], v[sizeof c->v[0]];
        err = kvz_blob_decode_layer(&m, l, b->rec[1 + l], b->len[1 + l], pos, k, v);
        same = !err && !memcmp(pos, c->pos[l], kept * 4) && !memcmp(k, c->k[l], kept * rb) &&
               !memcmp(v, c->v[l], kept * rb);
    }
    kvz_blob_meta_free(&m);
    return err ? err : same ? 0 : 1;
}

/* codec the spec prescribes for a payload: zstd (level 3) only if it saves > KVZ_BLOB_ZSTD_MIN_SAVING_PCT % */
static uint8_t expected_codec(const uint8_t *raw, size_t n)
{
    size_t cap = ZSTD_compressBound(n);
    uint8_t *z = malloc(cap);
    size_t zn = ZSTD_compress(z, cap, raw, n, 3);
    free(z);
    return !ZSTD_isError(zn) && zn * 100 < n * (100 - KVZ_BLOB_ZSTD_MIN_SAVING_PCT) ? KVZ_BLOB_CODEC_ZSTD : KVZ_BLOB_CODEC_NONE;
}

static void test_v2_golden(void)
{
    char path[1024], rel[128];
    size_t vn = 0;
    char *gver = kvz_test_read_file(kvz_test_path(path, sizeof path, "tests/golden/blob_zstd_version.txt"), &vn);
    int same_zstd = gver && !strncmp(gver, ZSTD_versionString(), strlen(ZSTD_versionString())) &&
                    gver[strlen(ZSTD_versionString())] == '\n';
    free(gver);
    int codecs_seen[2] = {0, 0};
    for (int g = 0; g < N_V2G + 1; g++) {
        f2_cache *c = calloc(1, sizeof *c);
        fx_cache fc;
        fx_blob b = {0}, gb = {0}, *bp;
        const char *name = g < N_V2G ? V2G[g].name : "f32_small";
        if (g < N_V2G) {
            NEED(f2_make(c, V2G[g].dtype, V2G[g].policy) == 0);
            bp = &c->b;
        } else {
            fx_make(&fc, KVZ_DTYPE_F32);
            NEED(encode_fx(&fc, &b) == 0);
            bp = &b;
        }
        size_t gn = 0, rn = 0, n = 0;
        snprintf(rel, sizeof rel, "tests/golden/blob_v2_%s.kvzb", name);
        uint8_t *gold = (uint8_t *)kvz_test_read_file(kvz_test_path(path, sizeof path, rel), &gn);
        snprintf(rel, sizeof rel, "tests/golden/blob_v2_%s.raw", name);
        uint8_t *graw = (uint8_t *)kvz_test_read_file(kvz_test_path(path, sizeof path, rel), &rn);
        CHECKF(gold && graw, "golden file %s missing", rel);
        if (gold && graw) {
            uint8_t *mine = concat(bp, 0, &n);
            if (same_zstd) CHECKF(n == gn && !memcmp(mine, gold, n), "v2 %s: encoded bytes differ from golden", name);
            free(mine);
            mine = concat(bp, 1, &n);
            CHECKF(mine && n == rn && !memcmp(mine, graw, n), "v2 %s: payload differs from golden", name);
            free(mine);
            CHECK(split(gold, gn, &gb) == 0);
            for (int i = 0; i < 1 + FX_L && gb.rec[i]; i++) {
                /* header: version 2, codec as the saving rule says for that payload */
                CHECK(gb.rec[i][4] == 2 && gb.rec[i][5] == 0);
                uint8_t *p = malloc(get64(gb.rec[i] + 24) + 1);
                size_t pn = get64(gb.rec[i] + 24);
                if (gb.rec[i][7] == KVZ_BLOB_CODEC_NONE) memcpy(p, gb.rec[i] + 56, pn);
                else CHECK(ZSTD_decompress(p, pn, gb.rec[i] + 56, gb.len[i] - 56) == pn);
                CHECKF(gb.rec[i][7] == expected_codec(p, pn), "v2 %s record %d: codec %u", name, i, gb.rec[i][7]);
                if (i) codecs_seen[gb.rec[i][7] & 1]++;
                if (i == 0) { /* META: 88 fixed bytes + counts, prefix_ref at 72, dtype at 32 */
                    CHECK(pn == 88 + 4 * F2_L * F2_H || g == N_V2G);
                    if (g < N_V2G) CHECK(p[32] == V2G[g].dtype && p[34] == V2G[g].policy &&
                                         !memcmp(p + 72, c->meta.prefix_ref, 16));
                }
                free(p);
            }
            if (g < N_V2G) CHECKF(f2_decode_equals(&gb, c) == 0, "v2 %s: golden decode: %s", name, kvz_error_detail());
            else CHECKF(decode_equals(&gb, &fc) == 0, "v2 %s: golden decode: %s", name, kvz_error_detail());
            free_blob(&gb);
        }
        free(gold);
        free(graw);
        free_blob(bp);
        free(c);
    }
    CHECKF(codecs_seen[0] && codecs_seen[1], "goldens cover both codecs (none %d, zstd %d)", codecs_seen[0], codecs_seen[1]);
}

/* Row codecs against independent truth: hand-made rows with exact results, the
 * runtime's fp16/bf16 converters, and the error bound of each type. */
static void test_kvrow(void)
{
    /* q8: max |x| = 127 -> d = 1 exactly, q = round-half-away(x) */
    float x[64], y[64];
    uint8_t row[256];
    for (int i = 0; i < 32; i++) x[i] = (float)(i - 16) * 0.5f;
    x[5] = 127.0f;
    x[32 + 0] = 0.0f;
    for (int i = 32; i < 64; i++) x[i] = 0.0f; /* group of zeros: d = 0, q = 0 */
    NEED(kvz_kvrow_encode(KVZ_KV_Q8, x, 1, 64, row) == 0);
    CHECK(kvz_kv_row_bytes(KVZ_KV_Q8, 64) == 4 + 64);
    CHECK(row[0] == 0x00 && row[1] == 0x3c); /* f16 1.0 */
    CHECK(row[2] == 0 && row[3] == 0);       /* f16 0.0 */
    int bad = 0;
    for (int i = 0; i < 32; i++) {
        float want = i == 5 ? 127.0f : (float)(i - 16) * 0.5f;
        want = want < 0 ? -floorf(-want + 0.5f) : floorf(want + 0.5f); /* half away from zero */
        bad += (int8_t)row[4 + i] != (int)want;
    }
    for (int i = 32; i < 64; i++) bad += row[4 + i] != 0;
    CHECKF(bad == 0, "q8 exact row: %d values wrong", bad);
    NEED(kvz_kvrow_decode(KVZ_KV_Q8, row, 1, 64, y) == 0);
    CHECK(y[0] == -8.0f && y[1] == -8.0f && y[3] == -7.0f && y[5] == 127.0f && y[63] == 0.0f);
    /* q4: min 0, max 15 -> d = 1, m = 0: q = round(x); nibble order low = even element */
    for (int i = 0; i < 32; i++) x[i] = (float)(i % 16) + (i & 16 ? 0.25f : 0.0f);
    x[31] = 15.0f;
    NEED(kvz_kvrow_encode(KVZ_KV_Q4, x, 1, 32, row) == 0);
    CHECK(kvz_kv_row_bytes(KVZ_KV_Q4, 32) == 4 + 16);
    CHECK(row[0] == 0x00 && row[1] == 0x3c && row[2] == 0 && row[3] == 0); /* d 1.0, m 0.0 */
    CHECK(row[4] == 0x10 && row[5] == 0x32 && row[11] == 0xfe); /* (0,1) (2,3) (14,15) */
    NEED(kvz_kvrow_decode(KVZ_KV_Q4, row, 1, 32, y) == 0);
    bad = 0;
    for (int i = 0; i < 32; i++) bad += y[i] != floorf(x[i] + 0.5f);
    CHECKF(bad == 0, "q4 exact row: %d values wrong", bad);
    /* error bounds on random rows: |x - x'| <= d/2 (+ the f16 rounding of m for q4) */
    uint64_t s = 12345;
    double worst8 = 0, worst4 = 0;
    for (int r = 0; r < 2000; r++) {
        float amp = ldexpf(1.0f, (int)(r % 17) - 8);
        for (int i = 0; i < 64; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            x[i] = ((float)(s >> 40) * 0x1p-24f - 0.5f) * 2.0f * amp + (r & 1 ? amp : 0.0f);
        }
        for (int t = 0; t < 2; t++) {
            const int dt = t ? KVZ_KV_Q4 : KVZ_KV_Q8;
            NEED(kvz_kvrow_encode(dt, x, 1, 64, row) == 0);
            NEED(kvz_kvrow_decode(dt, row, 1, 64, y) == 0);
            for (int g = 0; g < 2; g++) {
                float mn = x[32 * g], mx = x[32 * g], am = 0;
                for (int i = 32 * g; i < 32 * g + 32; i++) {
                    mn = fminf(mn, x[i]); mx = fmaxf(mx, x[i]); am = fmaxf(am, fabsf(x[i]));
                }
                double step = t ? (mx - mn) / 15.0 : am / 127.0;
                for (int i = 32 * g; i < 32 * g + 32; i++) {
                    double e = fabs((double)x[i] - y[i]) / step;
                    if (t) worst4 = fmax(worst4, e); else worst8 = fmax(worst8, e);
                }
            }
        }
    }
    /* half a step, plus the f16 rounding of the scale (2^-11 relative) times 127 or
     * 15 steps, plus (q4) the f16 rounding of m */
    CHECKF(worst8 <= 0.5 + 127 * 0x1p-11 + 1e-6, "q8 error %.4f steps", worst8);
    CHECKF(worst4 <= 0.5 + 15 * 0x1p-11 + 0.02, "q4 error %.4f steps", worst4);
    /* f16 / bf16: identical to the runtime's converters (every f16/bf16 pattern
     * back, and many fp32 values forward) */
    bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float a = kvz_kvrow_f16_to_f32((uint16_t)h), b = kvz_fp16_to_fp32((uint16_t)h);
        float c2 = kvz_kvrow_bf16_to_f32((uint16_t)h), d2 = kvz_bf16_to_fp32((uint16_t)h);
        bad += memcmp(&a, &b, 4) != 0;
        bad += memcmp(&c2, &d2, 4) != 0;
    }
    for (uint64_t i = 0; i < 2000000; i++) {
        uint32_t u = (uint32_t)(i * 2654435761u) ^ (uint32_t)(i >> 3);
        float f;
        memcpy(&f, &u, 4);
        bad += kvz_kvrow_f32_to_f16(f) != kvz_fp32_to_fp16(f);
        bad += kvz_kvrow_f32_to_bf16(f) != kvz_fp32_to_bf16(f);
    }
    CHECKF(bad == 0, "f16/bf16 converters differ from the runtime's in %d cases", bad);
    /* bad input: NaN/Inf rows cannot be quantised; bad scales are rejected */
    for (int i = 0; i < 32; i++) x[i] = 1.0f;
    x[7] = NAN;
    CHECK(kvz_kvrow_encode(KVZ_KV_Q8, x, 1, 32, row) == KVZ_ERR_ARG);
    x[7] = INFINITY;
    CHECK(kvz_kvrow_encode(KVZ_KV_Q4, x, 1, 32, row) == KVZ_ERR_ARG);
    CHECK(kvz_kvrow_encode(KVZ_KV_F16, x, 1, 32, row) == 0); /* f16 holds Inf */
    CHECK(kvz_kvrow_encode(KVZ_KV_Q8, x, 1, 48, row) == KVZ_ERR_ARG); /* 48 % 32 */
    CHECK(kvz_kvrow_encode(9, x, 1, 32, row) == KVZ_ERR_ARG);
    x[7] = 1.0f;
    NEED(kvz_kvrow_encode(KVZ_KV_Q8, x, 1, 32, row) == 0);
    static const uint16_t badscale[4] = {0x7c00, 0x7e00, 0xfc00, 0xbc00}; /* Inf NaN -Inf -1 */
    for (int i = 0; i < 4; i++) {
        memcpy(row, &badscale[i], 2);
        CHECK(kvz_kvrow_decode(KVZ_KV_Q8, row, 1, 32, y) == KVZ_ERR_FORMAT);
        CHECK(kvz_kvrow_check(KVZ_KV_Q8, row, 1, 32, NULL) == KVZ_ERR_FORMAT);
    }
    NEED(kvz_kvrow_encode(KVZ_KV_Q8, x, 1, 32, row) == 0);
    row[2 + 3] = 0x80; /* q8 value -128 */
    CHECK(kvz_kvrow_check(KVZ_KV_Q8, row, 1, 32, NULL) == KVZ_ERR_FORMAT);
    NEED(kvz_kvrow_encode(KVZ_KV_Q4, x, 1, 32, row) == 0);
    uint16_t inf = 0x7c00;
    memcpy(row + 2, &inf, 2); /* m = Inf */
    CHECK(kvz_kvrow_decode(KVZ_KV_Q4, row, 1, 32, y) == KVZ_ERR_FORMAT);
    /* registry */
    CHECK(kvz_kvrow_codec_find("q4") && kvz_kvrow_codec_find("q4")->dtype == KVZ_KV_Q4);
    CHECK(kvz_kvrow_codec_find("int8") == NULL && kvz_kvrow_codec_get(5) == NULL);
    CHECK(kvz_kvrow_codec_get(KVZ_KV_Q8)->min_blob_version == 2 && kvz_kvrow_codec_get(KVZ_KV_BF16)->min_blob_version == 1);
    /* saturation: a huge finite value gives a finite scale */
    x[0] = 3e38f;
    NEED(kvz_kvrow_encode(KVZ_KV_Q8, x, 1, 32, row) == 0);
    CHECK(kvz_kvrow_decode(KVZ_KV_Q8, row, 1, 32, y) == 0 && isfinite(y[0]));
}

/* Version-2 bad input: unknown codec/dtype, bad scale blocks (even with every
 * checksum fixed), a raw payload of the wrong size, v1 records with v2 features. */
static void test_v2_bad(void)
{
    f2_cache *c = calloc(1, sizeof *c);
    NEED(c && f2_make(c, KVZ_DTYPE_Q8, KVZ_PREFIX_KEEP) == 0);
    fx_blob *b = &c->b;
    kvz_blob_meta m;
    NEED(kvz_blob_decode_meta(b->rec[0], b->len[0], NULL, &m) == 0);
    uint32_t pos[F2_H * F2_ROWS];
    uint8_t k[sizeof c->k[0]], v[sizeof c->v[0]];
    const size_t n1 = b->len[1];
    NEED(b->rec[1][7] == KVZ_BLOB_CODEC_NONE); /* q8 rows do not compress by 20 % */
    uint8_t *r = malloc(n1);
    /* codec zstd-frames on a record of one frame's worth */
    memcpy(r, b->rec[1], n1);
    r[7] = KVZ_BLOB_CODEC_ZSTD_FRAMES;
    reseal(r, n1);
    CHECK(kvz_blob_decode_layer(&m, 0, r, n1, pos, k, v) == KVZ_ERR_FORMAT);
    CHECK(strstr(kvz_error_detail(), "one frame's worth") != NULL);
    /* unknown codec 3 and 255 */
    for (int cv = 3; cv < 256; cv += 252) {
        memcpy(r, b->rec[1], n1);
        r[7] = (uint8_t)cv;
        reseal(r, n1);
        CHECK(kvz_blob_decode_layer(&m, 0, r, n1, pos, k, v) == KVZ_ERR_FORMAT);
        CHECK(strstr(kvz_error_detail(), "unknown codec") != NULL);
    }
    /* codec none claiming a raw size other than the stored bytes */
    memcpy(r, b->rec[1], n1);
    put64(r + 24, get64(r + 24) + 2);
    reseal(r, n1);
    CHECK(kvz_blob_decode_layer(&m, 0, r, n1, pos, k, v) == KVZ_ERR_FORMAT);
    /* bad scale blocks with the payload hash and the record hash fixed: NaN, Inf,
     * negative scale in K row 2 group 0, and in the last V row */
    const size_t kept = kvz_blob_layer_kept(&m, 0), rb = kvz_blob_kv_row_bytes(&m);
    const size_t koff = 4 * kept, voff = koff + kept * rb;
    static const uint16_t badscale[3] = {0x7e00, 0x7c00, 0xbc00};
    for (int i = 0; i < 6; i++) {
        memcpy(r, b->rec[1], n1);
        size_t at = 56 + (i < 3 ? koff + 2 * rb : voff + (kept - 1) * rb);
        memcpy(r + at, &badscale[i % 3], 2);
        put64(r + 40, XXH3_64bits(r + 56, n1 - 56));
        reseal(r, n1);
        int err = kvz_blob_decode_layer(&m, 0, r, n1, pos, k, v);
        CHECKF(err == KVZ_ERR_FORMAT && strstr(kvz_error_detail(), i < 3 ? "K row 2" : "V row"),
               "bad scale %d: %d %s", i, err, kvz_error_detail());
    }
    /* a payload byte flipped with only the record hash fixed: payload checksum */
    memcpy(r, b->rec[1], n1);
    r[56 + koff + 7] ^= 4;
    reseal(r, n1);
    CHECK(kvz_blob_decode_layer(&m, 0, r, n1, pos, k, v) == KVZ_ERR_CHECKSUM);
    CHECK(kvz_blob_decode_layer(&m, 0, b->rec[1], n1, pos, k, v) == 0);
    kvz_blob_meta_free(&m);
    /* META with an unknown dtype, with q8 under version 1, with policy SHARED in v1:
     * rebuilt as raw v2 / v1 records with valid hashes */
    uint8_t *m0;
    size_t n0;
    NEED(kvz_blob_encode_meta(&c->meta, KVZ_BLOB_LEVEL_NONE, &m0, &n0) == 0 && m0[7] == KVZ_BLOB_CODEC_NONE);
    CHECK(kvz_blob_decode_meta(m0, n0, NULL, &m) == 0 && m.version == 2);
    kvz_blob_meta_free(&m);
    struct { size_t off; uint8_t val; uint16_t ver; } mc[] = {
        {32, 5, 2}, {32, 3, 1}, {34, 2, 1}, {34, 3, 2}, {72, 1, 2} /* prefix_ref set, policy KEEP */
    };
    uint8_t *mr = malloc(n0 + 64);
    for (size_t i = 0; i < sizeof mc / sizeof mc[0]; i++) {
        memcpy(mr, m0, n0);
        mr[56 + mc[i].off] = mc[i].val;
        size_t len = n0;
        if (mc[i].ver == 1) { /* v1: drop prefix_ref (16 bytes at payload offset 72), zstd */
            uint8_t pl[512];
            size_t pn = n0 - 56 - 16;
            memcpy(pl, mr + 56, 72);
            memcpy(pl + 72, mr + 56 + 88, pn - 72);
            uint8_t *rec = make_record(mr, pl, pn, &len);
            rec[4] = 1;
            rec[7] = KVZ_BLOB_CODEC_ZSTD;
            memcpy(mr, rec, len);
            free(rec);
        } else {
            put64(mr + 40, XXH3_64bits(mr + 56, n0 - 56));
        }
        put64(mr + 16, get64(mr + 40));
        reseal(mr, len);
        int err = kvz_blob_decode_meta(mr, len, NULL, &m);
        CHECKF(err == KVZ_ERR_FORMAT, "meta case %zu: got %d (%s)", i, err, kvz_error_detail());
    }
    free(mr);
    free(m0);
    free(r);
    free_blob(b);
    free(c);
    /* every truncation and single-byte flip of a v2 q4/shared blob (codec none) */
    c = calloc(1, sizeof *c);
    NEED(c && f2_make(c, KVZ_DTYPE_Q4, KVZ_PREFIX_SHARED) == 0);
    NEED(kvz_blob_decode_meta(c->b.rec[0], c->b.len[0], NULL, &m) == 0);
    int bad = 0;
    for (int i = 1; i < 1 + F2_L; i++) {
        size_t n = c->b.len[i];
        uint8_t *t = malloc(n);
        for (size_t off = 0; off < n; off++) {
            memcpy(t, c->b.rec[i], n);
            t[off] ^= 0x10;
            int want = off < 4 ? KVZ_ERR_FORMAT : off < 6 ? KVZ_ERR_VERSION
                     : off >= 32 && off < 40 && get64(t + 32) > n - 56 ? KVZ_ERR_TRUNCATED : KVZ_ERR_CHECKSUM;
            int err = kvz_blob_decode_layer(&m, (uint32_t)i - 1, t, n, pos, k, v);
            bad += err != want;
        }
        for (size_t cut = 0; cut < n; cut++) bad += kvz_blob_decode_layer(&m, (uint32_t)i - 1, c->b.rec[i], cut, pos, k, v) != KVZ_ERR_TRUNCATED;
        free(t);
    }
    CHECKF(bad == 0, "v2 q4 flips/truncations: %d misreported", bad);
    kvz_blob_meta_free(&m);
    free_blob(&c->b);
    free(c);
    /* encoder: LEVEL_NONE gives codec none; version 1 never writes codec none */
    fx_cache fc;
    fx_make(&fc, KVZ_DTYPE_F32);
    uint8_t *rec;
    size_t len;
    NEED(kvz_blob_encode_layer(&fc.meta, 0, fc.pos[0], fc.k[0], fc.v[0], KVZ_BLOB_LEVEL_NONE, &rec, &len) == 0);
    CHECK(rec[7] == KVZ_BLOB_CODEC_NONE && get64(rec + 24) == get64(rec + 32));
    free(rec);
    fc.meta.version = 1;
    NEED(kvz_blob_encode_layer(&fc.meta, 0, fc.pos[0], fc.k[0], fc.v[0], KVZ_BLOB_LEVEL_NONE, &rec, &len) == 0);
    CHECK(rec[4] == 1 && rec[7] == KVZ_BLOB_CODEC_ZSTD);
    free(rec);
}

static int write_golden(const char *dir)
{
    char path[1024];
    for (int d = 0; d < 2; d++) {
        fx_cache c;
        fx_blob b = {0};
        fx_make(&c, DTYPES[d]);
        c.meta.version = 1; /* the version-1 goldens */
        if (encode_fx(&c, &b)) { fprintf(stderr, "encode: %s\n", kvz_error_detail()); return 1; }
        size_t n;
        uint8_t *all = concat(&b, 0, &n);
        snprintf(path, sizeof path, "%s/blob_%s.kvzb", dir, DNAMES[d]);
        if (write_file(path, all, n)) return 1;
        free(all);
        all = concat(&b, 1, &n);
        snprintf(path, sizeof path, "%s/blob_%s.raw", dir, DNAMES[d]);
        if (write_file(path, all, n)) return 1;
        free(all);
        free_blob(&b);
    }
    if (write_golden_v2(dir)) return 1;
    snprintf(path, sizeof path, "%s/blob_zstd_version.txt", dir);
    char ver[64];
    snprintf(ver, sizeof ver, "%s\n", ZSTD_versionString());
    if (write_file(path, ver, strlen(ver))) return 1;
    printf("golden blob files written to %s (zstd %s)\n", dir, ZSTD_versionString());
    return 0;
}

/* Decode all records of a blob and compare with the fixture. */
static int decode_equals(const fx_blob *b, const fx_cache *c)
{
    kvz_blob_meta m;
    int err = kvz_blob_decode_meta(b->rec[0], b->len[0], c->meta.fingerprint, &m);
    if (err) return err;
    int same = m.n_layer == FX_L && m.n_head == c->meta.n_head && m.n_kv_head == FX_H &&
               m.head_dim == FX_HD && m.dtype == c->meta.dtype && m.mode == c->meta.mode &&
               m.prefix_policy == c->meta.prefix_policy && m.ratio == c->meta.ratio &&
               m.chunk == 2000 && m.overlap == 8 && m.n_prefix == FX_PREFIX &&
               m.n_context == FX_CONTEXT && !memcmp(m.counts, c->counts, sizeof c->counts) &&
               kvz_blob_meta_id(&m) == kvz_blob_meta_id(&c->meta);
    size_t es = kvz_blob_dtype_size(m.dtype);
    for (uint32_t l = 0; l < FX_L && same && !err; l++) {
        uint64_t kept = kvz_blob_layer_kept(&m, l);
        uint32_t pos[FX_PREFIX + FX_CONTEXT];
        uint8_t k[sizeof c->k[0]], v[sizeof c->v[0]];
        err = kvz_blob_decode_layer(&m, l, b->rec[1 + l], b->len[1 + l], pos, k, v);
        same = !err && !memcmp(pos, c->pos[l], kept * 4) && !memcmp(k, c->k[l], kept * FX_HD * es) &&
               !memcmp(v, c->v[l], kept * FX_HD * es);
    }
    kvz_blob_meta_free(&m);
    return err ? err : same ? 0 : 1;
}

/* Recompute the record checksum after a deliberate edit (the spec's formula). */
static void reseal(uint8_t *rec, size_t len)
{
    uint64_t comp = get64(rec + 32);
    if (comp > len - KVZ_BLOB_HEADER_SIZE) comp = len - KVZ_BLOB_HEADER_SIZE;
    put64(rec + 48, XXH3_64bits_withSeed(rec + 56, comp, XXH3_64bits(rec, 48)));
}

/* Build a record by hand around an arbitrary payload (for content corruptions). */
static uint8_t *make_record(const uint8_t *hdr_from, const void *raw, size_t raw_n, size_t *len)
{
    size_t bound = ZSTD_compressBound(raw_n);
    uint8_t *r = malloc(KVZ_BLOB_HEADER_SIZE + bound);
    memcpy(r, hdr_from, KVZ_BLOB_HEADER_SIZE);
    size_t cn = ZSTD_compress(r + KVZ_BLOB_HEADER_SIZE, bound, raw, raw_n, 3);
    put64(r + 24, raw_n);
    put64(r + 32, cn);
    put64(r + 40, XXH3_64bits(raw, raw_n));
    *len = KVZ_BLOB_HEADER_SIZE + cn;
    reseal(r, *len);
    return r;
}

/* Decode one record of the fixture blob as what it is (meta or layer l). */
static int decode_one(const kvz_blob_meta *m, int i, const uint8_t *rec, size_t len)
{
    if (i == 0) {
        kvz_blob_meta out;
        int err = kvz_blob_decode_meta(rec, len, m->fingerprint, &out);
        kvz_blob_meta_free(&out);
        return err;
    }
    uint32_t pos[FX_PREFIX + FX_CONTEXT];
    uint8_t k[(FX_PREFIX + FX_CONTEXT) * FX_HD * 4], v[sizeof k];
    return kvz_blob_decode_layer(m, (uint32_t)i - 1, rec, len, pos, k, v);
}

static void test_golden(void)
{
    char path[1024];
    size_t vn = 0;
    char *gver = kvz_test_read_file(kvz_test_path(path, sizeof path, "tests/golden/blob_zstd_version.txt"), &vn);
    int same_zstd = gver && !strncmp(gver, ZSTD_versionString(), strlen(ZSTD_versionString())) &&
                    gver[strlen(ZSTD_versionString())] == '\n';
    if (!same_zstd)
        printf("note: golden files made with zstd %s, this is %s: comparing payloads, not frames\n",
               gver ? gver : "?", ZSTD_versionString());
    free(gver);
    for (int d = 0; d < 2; d++) {
        fx_cache c;
        fx_blob b = {0}, g = {0};
        fx_make(&c, DTYPES[d]);
        c.meta.version = 1; /* writers still produce version 1 when asked: byte-exact */
        NEED(encode_fx(&c, &b) == 0);
        char rel[128];
        snprintf(rel, sizeof rel, "tests/golden/blob_%s.kvzb", DNAMES[d]);
        size_t gn = 0, rn = 0, n = 0;
        uint8_t *gold = (uint8_t *)kvz_test_read_file(kvz_test_path(path, sizeof path, rel), &gn);
        snprintf(rel, sizeof rel, "tests/golden/blob_%s.raw", DNAMES[d]);
        uint8_t *graw = (uint8_t *)kvz_test_read_file(kvz_test_path(path, sizeof path, rel), &rn);
        CHECKF(gold && graw, "golden file %s missing", rel);
        if (!gold || !graw) { free(gold); free(graw); free_blob(&b); continue; }
        /* 1. the encoder reproduces the golden bytes */
        uint8_t *mine = concat(&b, 0, &n);
        if (same_zstd) CHECKF(n == gn && !memcmp(mine, gold, n), "%s: encoded bytes differ from golden", DNAMES[d]);
        free(mine);
        /* 2. uncompressed payloads are pinned independently of zstd's version */
        mine = concat(&b, 1, &n);
        CHECKF(mine && n == rn && !memcmp(mine, graw, n), "%s: payload differs from golden", DNAMES[d]);
        free(mine);
        /* 3. the golden records decode to exactly the fixture */
        CHECK(split(gold, gn, &g) == 0);
        CHECKF(decode_equals(&g, &c) == 0, "%s: golden decode: %s", DNAMES[d], kvz_error_detail());
        CHECK(decode_equals(&b, &c) == 0);
        /* header fields land where docs/FORMAT.md says */
        CHECK(!memcmp(g.rec[0], "KVZB", 4) && g.rec[0][4] == 1 && g.rec[0][5] == 0);
        CHECK(g.rec[0][6] == KVZ_BLOB_KIND_META && g.rec[1][6] == KVZ_BLOB_KIND_LAYER);
        CHECK(get64(g.rec[1] + 16) == kvz_blob_meta_id(&c.meta) && get64(g.rec[0] + 16) == get64(g.rec[0] + 40));
        free_blob(&g);
        free(gold);
        free(graw);
        free_blob(&b);
    }
}

static void test_heads_variant(void)
{
    fx_cache c;
    fx_make(&c, KVZ_DTYPE_BF16);
    fx_blob b = {0};
    NEED(encode_fx(&c, &b) == 0);
    CHECK(decode_equals(&b, &c) == 0);
    for (uint32_t l = 0; l < FX_L; l++) {
        const uint32_t *pos[FX_H];
        const void *k[FX_H], *v[FX_H];
        uint64_t off[FX_H + 1];
        kvz_blob_layer_offsets(&c.meta, l, off);
        for (int h = 0; h < FX_H; h++) {
            pos[h] = c.pos[l] + off[h];
            k[h] = c.k[l] + off[h] * FX_HD * 2;
            v[h] = c.v[l] + off[h] * FX_HD * 2;
        }
        uint8_t *r;
        size_t n;
        CHECK(kvz_blob_encode_layer_heads(&c.meta, l, pos, k, v, 0, &r, &n) == 0);
        CHECK(n == b.len[1 + l] && !memcmp(r, b.rec[1 + l], n));
        free(r);
    }
    CHECK(kvz_blob_layer_raw_size(&c.meta, 0) == 11 * (4 + 2 * 4 * 2));
    CHECK(kvz_blob_kv_bytes(&c.meta) == 20 * (4 + 2 * 4 * 2));
    free_blob(&b);
}

static void test_truncation_and_flips(void)
{
    for (int d = 0; d < 4; d++) { /* f32, f16 as version 1, then as version 2 */
        fx_cache c;
        fx_blob b = {0};
        fx_make(&c, DTYPES[d & 1]);
        c.meta.version = d < 2 ? 1 : 2;
        NEED(encode_fx(&c, &b) == 0);
        for (int i = 0; i < 1 + FX_L; i++) {
            size_t n = b.len[i];
            uint8_t *buf = malloc(n);
            int bad_trunc = 0, bad_flip = 0;
            for (size_t cut = 0; cut < n; cut++) {
                memcpy(buf, b.rec[i], cut);
                /* exact-size heap copy so ASan catches any over-read */
                uint8_t *t = malloc(cut ? cut : 1);
                memcpy(t, b.rec[i], cut);
                int err = decode_one(&c.meta, i, t, cut);
                free(t);
                if (err != KVZ_ERR_TRUNCATED) {
                    if (!bad_trunc++) fprintf(stderr, "%s rec %d cut %zu: %d %s\n", DNAMES[d & 1], i, cut, err, kvz_error_detail());
                }
            }
            static const uint8_t masks[3] = {0x01, 0x80, 0xFF};
            for (size_t off = 0; off < n; off++) {
                for (int mi = 0; mi < 3; mi++) {
                    memcpy(buf, b.rec[i], n);
                    buf[off] ^= masks[mi];
                    int want = KVZ_ERR_CHECKSUM;
                    if (off < 4) want = KVZ_ERR_FORMAT;
                    else if (off < 6) want = KVZ_ERR_VERSION;
                    else if (off >= 32 && off < 40)
                        want = get64(buf + 32) > n - KVZ_BLOB_HEADER_SIZE ? KVZ_ERR_TRUNCATED : KVZ_ERR_CHECKSUM;
                    int err = decode_one(&c.meta, i, buf, n);
                    if (err != want) {
                        if (!bad_flip++) fprintf(stderr, "%s rec %d flip %zu^%02x: got %d want %d (%s)\n",
                                                 DNAMES[d & 1], i, off, masks[mi], err, want, kvz_error_detail());
                    }
                }
            }
            CHECKF(bad_trunc == 0, "%s v%u record %d: %d truncations misreported", DNAMES[d & 1], c.meta.version, i, bad_trunc);
            CHECKF(bad_flip == 0, "%s v%u record %d: %d flips misreported", DNAMES[d & 1], c.meta.version, i, bad_flip);
            /* one extra byte */
            uint8_t *longer = malloc(n + 1);
            memcpy(longer, b.rec[i], n);
            longer[n] = 0;
            CHECK(decode_one(&c.meta, i, longer, n + 1) == KVZ_ERR_FORMAT);
            free(longer);
            free(buf);
        }
        free_blob(&b);
    }
}

static void test_version_model_kind(void)
{
    fx_cache c;
    fx_blob b = {0};
    fx_make(&c, KVZ_DTYPE_F16);
    NEED(encode_fx(&c, &b) == 0);
    kvz_blob_meta m;
    /* other version, even resealed: 3 (a future version, e.g. read by this build
     * as a v1-only build reads a v2 record) and 0 */
    for (int i = 0; i < 1 + FX_L; i++) {
        uint8_t *r = malloc(b.len[i]);
        memcpy(r, b.rec[i], b.len[i]);
        r[4] = 3;
        reseal(r, b.len[i]);
        CHECK(decode_one(&c.meta, i, r, b.len[i]) == KVZ_ERR_VERSION);
        CHECK(strstr(kvz_error_detail(), "version 3") != NULL);
        r[4] = 0;
        reseal(r, b.len[i]);
        CHECK(decode_one(&c.meta, i, r, b.len[i]) == KVZ_ERR_VERSION);
        CHECK(kvz_blob_check(r, b.len[i], NULL) == KVZ_ERR_VERSION);
        r[4] = 0;
        r[5] = 1; /* 256: byte order matters */
        CHECK(kvz_blob_check(r, b.len[i], NULL) == KVZ_ERR_VERSION);
        free(r);
    }
    /* other model */
    uint8_t fp[16];
    memcpy(fp, c.meta.fingerprint, 16);
    fp[15] ^= 1;
    CHECK(kvz_blob_decode_meta(b.rec[0], b.len[0], fp, &m) == KVZ_ERR_MODEL);
    CHECK(strstr(kvz_error_detail(), "a0a1a2") != NULL);
    CHECK(m.counts == NULL);
    CHECK(kvz_blob_decode_meta(b.rec[0], b.len[0], NULL, &m) == 0);
    kvz_blob_meta_free(&m);
    /* wrong kind / wrong layer / another blob's layer */
    CHECK(kvz_blob_decode_meta(b.rec[1], b.len[1], NULL, &m) == KVZ_ERR_FORMAT);
    CHECK(decode_one(&c.meta, 1, b.rec[0], b.len[0]) == KVZ_ERR_FORMAT);
    CHECK(decode_one(&c.meta, 1, b.rec[2], b.len[2]) == KVZ_ERR_FORMAT);
    fx_cache c2;
    fx_make(&c2, KVZ_DTYPE_F16);
    c2.meta.ratio = 0.25f; /* same shapes, other META */
    CHECK(decode_one(&c2.meta, 1, b.rec[1], b.len[1]) == KVZ_ERR_FORMAT);
    /* NULL / garbage inputs */
    CHECK(kvz_blob_check(NULL, 10, NULL) == KVZ_ERR_ARG);
    CHECK(kvz_blob_decode_meta(b.rec[0], b.len[0], NULL, NULL) == KVZ_ERR_ARG);
    CHECK(decode_one(&c.meta, 1, b.rec[1], b.len[1]) == 0);
    free_blob(&b);
}

/* Corruptions that keep a valid record checksum: deeper validation must catch them. */
static void test_resealed(void)
{
    fx_cache c;
    fx_blob b = {0};
    fx_make(&c, KVZ_DTYPE_F32);
    c.meta.version = 1; /* zstd frames (the version-2 cases: test_v2_bad) */
    NEED(encode_fx(&c, &b) == 0);
    size_t n0 = b.len[0], n1 = b.len[1];
    uint8_t *r = malloc(n0 > n1 ? n0 + 64 : n1 + 64);
    kvz_blob_meta m;
#define RESEAL_CASE(src, n, stmt, want, idx)                                          \
    do {                                                                             \
        memcpy(r, src, n);                                                           \
        stmt;                                                                        \
        reseal(r, n);                                                                \
        int e_ = decode_one(&c.meta, idx, r, n);                                     \
        CHECKF(e_ == (want), "%s: got %d (%s)", #stmt, e_, kvz_error_detail());      \
    } while (0)
    RESEAL_CASE(b.rec[0], n0, r[6] = 9, KVZ_ERR_FORMAT, 0);           /* unknown kind */
    RESEAL_CASE(b.rec[0], n0, r[7] = 2, KVZ_ERR_FORMAT, 0);           /* unknown codec */
    RESEAL_CASE(b.rec[0], n0, r[12] = 1, KVZ_ERR_FORMAT, 0);          /* reserved */
    RESEAL_CASE(b.rec[0], n0, r[8] = 0, KVZ_ERR_FORMAT, 0);           /* META layer index */
    RESEAL_CASE(b.rec[0], n0, r[16] ^= 1, KVZ_ERR_FORMAT, 0);         /* META blob id */
    RESEAL_CASE(b.rec[0], n0, r[40] ^= 1, KVZ_ERR_FORMAT, 0);         /* raw hash (!= blob id) */
    RESEAL_CASE(b.rec[0], n0, put64(r + 24, 1ull << 60), KVZ_ERR_FORMAT, 0); /* huge raw size */
    RESEAL_CASE(b.rec[0], n0, put64(r + 24, get64(r + 24) + 4), KVZ_ERR_FORMAT, 0);
    RESEAL_CASE(b.rec[1], n1, r[8] = 1, KVZ_ERR_FORMAT, 1);           /* layer index */
    RESEAL_CASE(b.rec[1], n1, r[16] ^= 1, KVZ_ERR_FORMAT, 1);         /* blob id */
    RESEAL_CASE(b.rec[1], n1, r[40] ^= 1, KVZ_ERR_CHECKSUM, 1);       /* payload hash */
    RESEAL_CASE(b.rec[1], n1, put64(r + 24, 1ull << 62), KVZ_ERR_FORMAT, 1);
    RESEAL_CASE(b.rec[1], n1, r[60] ^= 0x40, KVZ_ERR_FORMAT, 1);      /* zstd frame header */
    RESEAL_CASE(b.rec[1], n1, r[n1 - 1] ^= 0x55, KVZ_ERR_FORMAT, 1);  /* zstd block data */
    RESEAL_CASE(b.rec[1], n1, put64(r + 32, get64(r + 32) - 1), KVZ_ERR_FORMAT, 1); /* trailing */
    /* payload content: raw bytes decoded, edited, recompressed, all hashes fixed */
    uint8_t raw[4096];
    size_t rn = ZSTD_decompress(raw, sizeof raw, b.rec[0] + 56, n0 - 56);
    NEED(!ZSTD_isError(rn) && rn == 72 + 16);
    struct { size_t off; uint32_t val; const char *what; } mc[] = {
        {16, 0, "n_layer 0"}, {16, 3, "n_layer 3 vs size"}, {20, 3, "n_head % n_kv_head"},
        {28, 0, "head_dim 0"}, {28, 5000, "head_dim huge"}, {32, 7, "dtype"},
        {36, 0, "ratio 0"}, {36, 0x7fc00000u, "ratio NaN"}, {40, 0, "chunk 0"},
        {48, 0x40000000u, "n_prefix huge"}, {56, 3, "total kept"}, {64, 3, "kv bytes"},
        {72, 1, "count < n_prefix"}, {76, 13, "count > n_prefix+n_context"},
    };
    for (size_t i = 0; i < sizeof mc / sizeof mc[0]; i++) {
        uint8_t e[sizeof raw];
        memcpy(e, raw, rn);
        memcpy(e + mc[i].off, &mc[i].val, 4);
        size_t len;
        uint8_t *rec = make_record(b.rec[0], e, rn, &len);
        put64(rec + 16, get64(rec + 40)); /* META blob id = payload hash */
        reseal(rec, len);
        int err = kvz_blob_decode_meta(rec, len, NULL, &m);
        CHECKF(err == KVZ_ERR_FORMAT, "meta %s: got %d", mc[i].what, err);
        free(rec);
    }
    /* layer content: positions */
    uint8_t lraw[4096];
    size_t ln = ZSTD_decompress(lraw, sizeof lraw, b.rec[1] + 56, n1 - 56);
    NEED(!ZSTD_isError(ln) && ln == 11 * (4 + 32));
    uint32_t pv[4][2] = {{0, 1}, {2, 1}, {1, 0}, {3, 99}}; /* {index, value} */
    const char *pw[4] = {"prefix pos 0 -> 1", "descending", "prefix pos 1 -> 0", "pos out of range"};
    for (int i = 0; i < 4; i++) {
        uint8_t e[sizeof lraw];
        memcpy(e, lraw, ln);
        memcpy(e + 4 * pv[i][0], &pv[i][1], 4);
        size_t len;
        uint8_t *rec = make_record(b.rec[1], e, ln, &len);
        int err = decode_one(&c.meta, 1, rec, len);
        CHECKF(err == KVZ_ERR_FORMAT, "layer %s: got %d", pw[i], err);
        free(rec);
    }
    { /* a frame longer than the header says, with matching header sizes otherwise */
        size_t len;
        uint8_t *rec = make_record(b.rec[1], lraw, ln - 4, &len);
        CHECK(decode_one(&c.meta, 1, rec, len) == KVZ_ERR_FORMAT);
        free(rec);
        rec = make_record(b.rec[1], lraw, ln, &len); /* sanity: untouched payload is fine */
        CHECK(decode_one(&c.meta, 1, rec, len) == 0);
        free(rec);
    }
    free(r);
    free_blob(&b);
}

/* Random multi-byte damage, resealed half of the time: never a crash, never success. */
static void test_fuzz(void)
{
    fx_cache c;
    fx_blob b = {0};
    fx_make(&c, KVZ_DTYPE_F16);
    c.meta.version = 1; /* zstd frames; test_v2_bad covers raw payloads */
    NEED(encode_fx(&c, &b) == 0);
    uint64_t s = 0x9E3779B97F4A7C15ull;
    int bad = 0;
    for (int it = 0; it < 30000; it++) {
        int i = it % (1 + FX_L);
        size_t n = b.len[i];
        uint8_t *r = malloc(n);
        memcpy(r, b.rec[i], n);
        int flips = 1 + (int)(s % 4);
        for (int f = 0; f < flips; f++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            size_t off = (size_t)(s >> 33) % n;
            if (it & 2) off = 56 + (size_t)(s >> 33) % (n - 56); /* payload only */
            r[off] ^= (uint8_t)(s >> 17) | 1;
        }
        if (it & 1) { /* reseal to get past the record checksum */
            if (i == 0) put64(r + 16, get64(r + 40));
            reseal(r, n);
        }
        int err = decode_one(&c.meta, i, r, n);
        if (err == 0 && memcmp(r, b.rec[i], n)) {
            /* a resealed flip inside the frame could decode to the same payload only if
             * zstd ignored the byte; the payload hash makes anything else an error */
            uint8_t raw1[2048], raw2[2048];
            size_t a = ZSTD_decompress(raw1, sizeof raw1, r + 56, n - 56);
            size_t z = ZSTD_decompress(raw2, sizeof raw2, b.rec[i] + 56, n - 56);
            if (ZSTD_isError(a) || a != z || memcmp(raw1, raw2, a)) bad++;
        }
        free(r);
    }
    CHECKF(bad == 0, "%d damaged records decoded to a different payload", bad);
    free_blob(&b);
}

static void test_encode_args(void)
{
    fx_cache c;
    fx_make(&c, KVZ_DTYPE_F16);
    uint8_t *r = NULL;
    size_t n = 0;
    kvz_blob_meta m = c.meta;
    m.ratio = 0.0f;
    CHECK(kvz_blob_encode_meta(&m, 3, &r, &n) == KVZ_ERR_ARG && r == NULL);
    m = c.meta;
    m.n_head = 3;
    CHECK(kvz_blob_encode_meta(&m, 3, &r, &n) == KVZ_ERR_ARG);
    m = c.meta;
    m.dtype = 5; /* unknown */
    CHECK(kvz_blob_encode_meta(&m, 3, &r, &n) == KVZ_ERR_ARG);
    m.dtype = KVZ_DTYPE_Q8; /* head_dim 4: not a multiple of 32 */
    CHECK(kvz_blob_encode_meta(&m, 3, &r, &n) == KVZ_ERR_ARG);
    CHECK(kvz_blob_encode_meta(&c.meta, 99, &r, &n) == KVZ_ERR_ARG);
    CHECK(kvz_blob_encode_layer(&c.meta, 2, c.pos[0], c.k[0], c.v[0], 3, &r, &n) == KVZ_ERR_ARG);
    CHECK(kvz_blob_encode_layer(&c.meta, 0, NULL, c.k[0], c.v[0], 3, &r, &n) == KVZ_ERR_ARG);
    uint32_t save = c.pos[0][3];
    c.pos[0][3] = c.pos[0][2]; /* not strictly ascending */
    CHECK(kvz_blob_encode_layer(&c.meta, 0, c.pos[0], c.k[0], c.v[0], 3, &r, &n) == KVZ_ERR_ARG);
    c.pos[0][3] = save;
    c.pos[0][0] = 1; /* prefix not 0..n_prefix-1 */
    CHECK(kvz_blob_encode_layer(&c.meta, 0, c.pos[0], c.k[0], c.v[0], 3, &r, &n) == KVZ_ERR_ARG);
    c.pos[0][0] = 0;
    /* prefix policy NONE: positions must skip the prefix; counts up to n_context */
    fx_cache d;
    fx_make(&d, KVZ_DTYPE_F32);
    d.meta.prefix_policy = KVZ_PREFIX_NONE;
    CHECK(kvz_blob_encode_layer(&d.meta, 0, d.pos[0], d.k[0], d.v[0], 3, &r, &n) == KVZ_ERR_ARG);
    uint32_t pos2[4] = {2, 5, 7, 11};
    d.counts[0] = 4; d.counts[1] = 0; d.counts[2] = 0; d.counts[3] = 0;
    CHECK(kvz_blob_encode_layer(&d.meta, 0, pos2, d.k[0], d.v[0], 3, &r, &n) == 0);
    kvz_blob_meta dm;
    uint8_t *mr;
    size_t mn;
    CHECK(kvz_blob_encode_meta(&d.meta, 1, &mr, &mn) == 0);
    CHECK(kvz_blob_decode_meta(mr, mn, NULL, &dm) == 0);
    uint32_t p[4];
    uint8_t k[64], v[64];
    CHECK(kvz_blob_decode_layer(&dm, 0, r, n, p, k, v) == 0 && !memcmp(p, pos2, 16));
    free(r);
    /* an empty layer (all counts 0) round-trips with NULL arrays */
    CHECK(kvz_blob_encode_layer(&d.meta, 1, NULL, NULL, NULL, 3, &r, &n) == 0);
    CHECK(kvz_blob_decode_layer(&dm, 1, r, n, NULL, NULL, NULL) == 0);
    free(r);
    free(mr);
    kvz_blob_meta_free(&dm);
}

static void test_content_hash(void)
{
    fx_cache c;
    fx_make(&c, KVZ_DTYPE_F16);
    uint8_t pb[KVZ_BLOB_PARAMS_SIZE], h1[16], h2[16];
    kvz_blob_params_bytes(&c.meta, pb);
    int32_t tok[5] = {1, 2, 3, 49151, 7};
    kvz_blob_content_hash(c.meta.fingerprint, pb, sizeof pb, 5, tok, h1);
    kvz_blob_content_hash(c.meta.fingerprint, pb, sizeof pb, 5, tok, h2);
    CHECK(!memcmp(h1, h2, 16));
    /* pinned: changing this value changes every store key (bump the store version) */
    static const uint8_t pinned[16] = {PINNED_HASH};
    char hx[33];
    for (int i = 0; i < 16; i++) snprintf(hx + 2 * i, 3, "%02x", h1[i]);
    CHECKF(!memcmp(h1, pinned, 16), "content hash changed: %s", hx);
    tok[4] = 8;
    kvz_blob_content_hash(c.meta.fingerprint, pb, sizeof pb, 5, tok, h2);
    CHECK(memcmp(h1, h2, 16));
    tok[4] = 7;
    pb[4] ^= 1;
    kvz_blob_content_hash(c.meta.fingerprint, pb, sizeof pb, 5, tok, h2);
    CHECK(memcmp(h1, h2, 16));
    pb[4] ^= 1;
    kvz_blob_content_hash(c.meta.fingerprint, pb, sizeof pb, 4, tok, h2);
    CHECK(memcmp(h1, h2, 16));
}

/* Codec zstd-frames (version 2 LAYER records over KVZ_BLOB_ZSTD_FRAME_RAW bytes):
 * independent frames of the stated sizes, decoded exactly into separate arrays and
 * (on several threads) into one adjacent buffer, hashed or not; damage refused. */
static void test_frames(void)
{
    enum { H = 2, HD = 128, N = 7000 }; /* 2 x 7000 f16 rows: 7.2 MB, 3 frames + a rest */
    uint32_t counts[H] = {N, N};
    kvz_blob_meta m = {.n_layer = 1, .n_head = 4, .n_kv_head = H, .head_dim = HD, .dtype = KVZ_DTYPE_F16,
                       .mode = 0, .prefix_policy = KVZ_PREFIX_NONE, .ratio = 0.5f, .chunk = 2000, .overlap = 8,
                       .n_prefix = 0, .n_context = 2 * N, .counts = counts};
    const size_t rb = (size_t)HD * 2, raw = (size_t)H * N * (4 + 2 * rb);
    uint32_t *pos = malloc(sizeof(uint32_t) * H * N);
    uint16_t *k = malloc(rb * H * N), *v = malloc(rb * H * N);
    NEED(pos && k && v);
    uint32_t x = 12345;
    for (int h = 0; h < H; h++)
        for (int i = 0; i < N; i++) pos[h * N + i] = (uint32_t)(2 * i + h);
    for (size_t i = 0; i < (size_t)H * N * HD; i++) { /* f16 values from a small set: zstd saves > 20 % */
        x = x * 1103515245u + 12345u;
        k[i] = (uint16_t)(0x3c00 + ((x >> 16) & 0xff));
        v[i] = (uint16_t)(0xbc00 + ((x >> 8) & 0x3f));
    }
    uint8_t *rec = NULL;
    size_t len = 0;
    NEED(kvz_blob_encode_layer(&m, 0, pos, k, v, 0, &rec, &len) == 0);
    CHECK(raw > 3 * (size_t)KVZ_BLOB_ZSTD_FRAME_RAW);
    CHECK(rec[7] == KVZ_BLOB_CODEC_ZSTD_FRAMES);
    CHECK(get64(rec + 24) == raw && get64(rec + 32) + KVZ_BLOB_HEADER_SIZE == len && len < raw * 95 / 100);
    { /* independent frames of FRAME_RAW bytes each, the last one the rest */
        size_t off = KVZ_BLOB_HEADER_SIZE, nfr = 0, got = 0;
        while (off < len) {
            size_t fs = ZSTD_findFrameCompressedSize(rec + off, len - off);
            NEED(!ZSTD_isError(fs));
            unsigned long long cs = ZSTD_getFrameContentSize(rec + off, fs);
            CHECK(cs == (raw - got < KVZ_BLOB_ZSTD_FRAME_RAW ? raw - got : KVZ_BLOB_ZSTD_FRAME_RAW));
            got += (size_t)cs;
            off += fs;
            nfr++;
        }
        CHECK(nfr == (raw + KVZ_BLOB_ZSTD_FRAME_RAW - 1) / KVZ_BLOB_ZSTD_FRAME_RAW && got == raw);
    }
    /* separate arrays (one frame at a time) and one adjacent buffer (threads) */
    uint32_t *p2 = malloc(sizeof(uint32_t) * H * N);
    uint16_t *k2 = malloc(rb * H * N), *v2 = malloc(rb * H * N);
    uint8_t *adj = malloc(raw);
    NEED(p2 && k2 && v2 && adj);
    CHECK(kvz_blob_decode_layer(&m, 0, rec, len, p2, k2, v2) == 0);
    CHECK(!memcmp(p2, pos, sizeof(uint32_t) * H * N) && !memcmp(k2, k, rb * H * N) && !memcmp(v2, v, rb * H * N));
    uint8_t *ka = adj + sizeof(uint32_t) * H * N, *va = ka + rb * H * N;
    CHECK(kvz_blob_decode_layer(&m, 0, rec, len, (uint32_t *)adj, ka, va) == 0);
    CHECK(!memcmp(adj, pos, sizeof(uint32_t) * H * N) && !memcmp(ka, k, rb * H * N) && !memcmp(va, v, rb * H * N));
    memset(adj, 0, raw);
    CHECK(kvz_blob_decode_layer_hashed(&m, 0, rec, len, get64(rec + 48), (uint32_t *)adj, ka, va) == 0);
    CHECK(!memcmp(adj, pos, sizeof(uint32_t) * H * N) && !memcmp(ka, k, rb * H * N) && !memcmp(va, v, rb * H * N));
    /* one byte of the second frame's data changed, checksum resealed: refused on both routes */
    uint8_t *r = malloc(len);
    NEED(r);
    memcpy(r, rec, len);
    size_t f0 = ZSTD_findFrameCompressedSize(r + KVZ_BLOB_HEADER_SIZE, len - KVZ_BLOB_HEADER_SIZE);
    r[KVZ_BLOB_HEADER_SIZE + f0 + 100] ^= 0x5a;
    reseal(r, len);
    int rc1 = kvz_blob_decode_layer(&m, 0, r, len, p2, k2, v2);
    int rc2 = kvz_blob_decode_layer(&m, 0, r, len, (uint32_t *)adj, ka, va);
    CHECK(rc1 == KVZ_ERR_FORMAT || rc1 == KVZ_ERR_CHECKSUM);
    CHECK(rc2 == KVZ_ERR_FORMAT || rc2 == KVZ_ERR_CHECKSUM);
    /* the same frames under codec zstd (one frame): bytes after it */
    memcpy(r, rec, len);
    r[7] = KVZ_BLOB_CODEC_ZSTD;
    reseal(r, len);
    CHECK(kvz_blob_decode_layer(&m, 0, r, len, p2, k2, v2) == KVZ_ERR_FORMAT);
    /* the last frame cut off (sizes in the header fixed): a frame is missing */
    size_t cut = KVZ_BLOB_HEADER_SIZE, last = 0;
    while (cut < len) {
        last = cut;
        cut += ZSTD_findFrameCompressedSize(rec + cut, len - cut);
    }
    memcpy(r, rec, last);
    put64(r + 32, last - KVZ_BLOB_HEADER_SIZE);
    reseal(r, last);
    CHECK(kvz_blob_decode_layer(&m, 0, r, last, (uint32_t *)adj, ka, va) == KVZ_ERR_FORMAT);
    CHECK(strstr(kvz_error_detail(), "missing") != NULL);
    /* version 1 never writes or reads it */
    memcpy(r, rec, len);
    r[4] = 1;
    reseal(r, len);
    CHECK(kvz_blob_decode_layer(&m, 0, r, len, p2, k2, v2) != 0);
    free(r); free(adj); free(p2); free(k2); free(v2); free(rec); free(pos); free(k); free(v);
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--write-golden")) return write_golden(argv[2]);
    test_golden();
    test_heads_variant();
    test_truncation_and_flips();
    test_version_model_kind();
    test_resealed();
    test_fuzz();
    test_encode_args();
    test_content_hash();
    test_kvrow();
    test_v2_golden();
    test_v2_bad();
    test_frames();
    return kvz_test_summary();
}
