/* Blob format: golden bytes, exact round trip, and rejection of every truncation,
 * every single-byte flip, other versions, other models and resealed corruptions.
 * `fast_test_blob --write-golden DIR` regenerates tests/golden/blob_*. */
#include "blob_fixture.h"
#include "kvz_blob.h"
#include "kvz_error.h"
#include "kvz_test.h"

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
        if (!raw) { memcpy(out + *n, b->rec[i], b->len[i]); *n += b->len[i]; continue; }
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

static int write_golden(const char *dir)
{
    char path[1024];
    for (int d = 0; d < 2; d++) {
        fx_cache c;
        fx_blob b = {0};
        fx_make(&c, DTYPES[d]);
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
    for (int d = 0; d < 2; d++) {
        fx_cache c;
        fx_blob b = {0};
        fx_make(&c, DTYPES[d]);
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
                    if (!bad_trunc++) fprintf(stderr, "%s rec %d cut %zu: %d %s\n", DNAMES[d], i, cut, err, kvz_error_detail());
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
                                                 DNAMES[d], i, off, masks[mi], err, want, kvz_error_detail());
                    }
                }
            }
            CHECKF(bad_trunc == 0, "%s record %d: %d truncations misreported", DNAMES[d], i, bad_trunc);
            CHECKF(bad_flip == 0, "%s record %d: %d flips misreported", DNAMES[d], i, bad_flip);
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
    /* other version, even resealed */
    for (int i = 0; i < 1 + FX_L; i++) {
        uint8_t *r = malloc(b.len[i]);
        memcpy(r, b.rec[i], b.len[i]);
        r[4] = 2;
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
    m.dtype = 3;
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
    return kvz_test_summary();
}
