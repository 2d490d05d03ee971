/* The real model's tokenizer against HF `tokenizers` golden ids
 * (tests/golden/tokenizer_smollm2.tsv, scripts/golden/gen_tokenizer_golden.py),
 * round trips of golden strings, invalid UTF-8 and random bytes, and speed. */
#include <stdint.h>
#include <time.h>

#include "kvz_error.h"
#include "kvz_gguf.h"
#include "kvz_test.h"
#include "kvz_tokenizer.h"

static int hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Concatenated decode of ids; returns malloc'd bytes, length in *n. */
static char *detok(const kvz_tokenizer *t, const kvz_tokens *v, size_t *n)
{
    size_t cap = 64, len = 0;
    char *out = malloc(cap);
    for (size_t i = 0; out && i < v->n; i++) {
        int k = kvz_tokenizer_decode(t, v->ids[i], NULL, 0);
        if (k < 0) { free(out); return NULL; }
        while (len + (size_t)k > cap) {
            cap *= 2;
            char *p = realloc(out, cap);
            if (!p) { free(out); return NULL; }
            out = p;
        }
        kvz_tokenizer_decode(t, v->ids[i], out + len, (size_t)k);
        len += (size_t)k;
    }
    *n = len;
    return out;
}

/* decode(encode(s)) must equal s less the bytes the vocabulary cannot hold. */
static int roundtrip(const kvz_tokenizer *t, const char *s, size_t n, int flags)
{
    kvz_tokens v = {0};
    if (kvz_tokenizer_encode(t, s, n, flags, &v)) return 0;
    size_t m;
    char *d = detok(t, &v, &m);
    char *want = malloc(n + 1);
    size_t w = 0;
    for (size_t i = 0; i < n; i++)
        if (kvz_tokenizer_byte_token(t, (uint8_t)s[i]) >= 0) want[w++] = s[i];
    int ok = d && m == w && memcmp(d, want, w) == 0;
    free(d);
    free(want);
    kvz_tokens_free(&v);
    return ok;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(void)
{
    kvz_gguf *g = NULL;
    int rc = kvz_gguf_open(kvz_test_model(), &g);
    if (rc == KVZ_ERR_IO) {
        fprintf(stderr, "SKIP: model %s not found (bash scripts/fetch-model)\n", kvz_test_model());
        return 77;
    }
    REQUIRE(rc == 0);
    kvz_tokenizer *t = NULL;
    rc = kvz_tokenizer_from_gguf(g, &t);
    if (rc) fprintf(stderr, "from_gguf: %s: %s\n", kvz_strerror(rc), kvz_error_detail());
    REQUIRE(rc == 0);
    kvz_gguf_close(g); /* the tokenizer keeps its own copies */

    CHECK(kvz_tokenizer_n_vocab(t) == 49152);
    CHECK(kvz_tokenizer_bos(t) == 1);
    CHECK(kvz_tokenizer_eos(t) == 2);
    CHECK(kvz_tokenizer_find(t, "<|im_end|>") == 2);
    CHECK(kvz_tokenizer_find(t, "Hello") == 19556);
    CHECK(kvz_tokenizer_find(t, "\xC4\xA0world") == 905); /* "Ġworld" */
    CHECK(kvz_tokenizer_find(t, "no-such-piece-xyz") == -1);
    CHECK(kvz_tokenizer_is_special(t, 1) && !kvz_tokenizer_is_special(t, 19556));
    char buf[64];
    CHECK(kvz_tokenizer_decode(t, 905, buf, sizeof buf) == 6 && memcmp(buf, " world", 6) == 0);
    CHECK(kvz_tokenizer_decode(t, 1, buf, sizeof buf) == 12 && memcmp(buf, "<|im_start|>", 12) == 0);
    CHECK(kvz_tokenizer_decode(t, 1, buf, 3) == 12 && memcmp(buf, "<|i", 3) == 0);
    CHECK(kvz_tokenizer_decode(t, -1, buf, sizeof buf) == KVZ_ERR_ARG);
    CHECK(kvz_tokenizer_decode(t, 49152, buf, sizeof buf) == KVZ_ERR_ARG);

    /* the published example */
    {
        kvz_tokens v = {0};
        CHECK(kvz_tokenizer_encode(t, "Hello world! 123", 16, KVZ_TOK_SPECIAL, &v) == 0);
        static const int32_t want[] = {19556, 905, 17, 216, 33, 34, 35};
        CHECK(v.n == 7 && memcmp(v.ids, want, sizeof want) == 0);
        kvz_tokens_free(&v);
    }
    /* specials only with the flag */
    {
        kvz_tokens a = {0}, b = {0};
        CHECK(kvz_tokenizer_encode(t, "<|im_end|>", 10, KVZ_TOK_SPECIAL, &a) == 0);
        CHECK(a.n == 1 && a.ids[0] == 2);
        CHECK(kvz_tokenizer_encode(t, "<|im_end|>", 10, 0, &b) == 0);
        CHECK(b.n > 1);
        for (size_t i = 0; i < b.n; i++) CHECK(!kvz_tokenizer_is_special(t, b.ids[i]));
        kvz_tokens_free(&a);
        kvz_tokens_free(&b);
    }

    /* golden file: every line exactly */
    char path[1024];
    size_t glen = 0;
    char *gold = kvz_test_read_file(kvz_test_path(path, sizeof path, "tests/golden/tokenizer_smollm2.tsv"), &glen);
    REQUIRE(gold != NULL);
    int lines = 0, exact = 0, rt = 0;
    size_t gold_tokens = 0, gold_bytes = 0;
    char *text = malloc(glen + 1);
    int32_t *ids = malloc((glen + 1) * sizeof *ids);
    REQUIRE(text && ids);
    for (char *line = gold; *line;) {
        char *eol = strchr(line, '\n');
        if (!eol) eol = line + strlen(line);
        char *tab = memchr(line, '\t', (size_t)(eol - line));
        REQUIRE(tab != NULL);
        size_t n = 0;
        for (char *p = line; p + 1 < tab; p += 2) text[n++] = (char)(hexval(p[0]) << 4 | hexval(p[1]));
        size_t ni = 0;
        for (char *p = tab + 1; p < eol;) {
            char *end;
            long id = strtol(p, &end, 10);
            if (end == p) break;
            ids[ni++] = (int32_t)id;
            p = end;
        }
        kvz_tokens v = {0};
        rc = kvz_tokenizer_encode(t, text, n, KVZ_TOK_SPECIAL, &v);
        int ok = rc == 0 && v.n == ni && (ni == 0 || memcmp(v.ids, ids, ni * sizeof *ids) == 0);
        if (!ok) {
            fprintf(stderr, "golden line %d mismatch: %.*s\n  want:", lines + 1, (int)(tab - line), line);
            for (size_t i = 0; i < ni; i++) fprintf(stderr, " %d", (int)ids[i]);
            fprintf(stderr, "\n  got: ");
            for (size_t i = 0; i < v.n; i++) fprintf(stderr, " %d", (int)v.ids[i]);
            fprintf(stderr, "\n");
        }
        exact += ok;
        CHECK(ok);
        int r = roundtrip(t, text, n, KVZ_TOK_SPECIAL) && roundtrip(t, text, n, 0);
        rt += r;
        CHECKF(r, "round trip of golden line %d", lines + 1);
        gold_tokens += ni;
        gold_bytes += n;
        kvz_tokens_free(&v);
        lines++;
        line = *eol ? eol + 1 : eol;
    }
    printf("golden: %d/%d lines exact (%zu tokens, %zu bytes), %d round trips\n", exact, lines,
           gold_tokens, gold_bytes, rt);
    CHECK(lines >= 300);

    /* invalid UTF-8: stray continuations, overlongs, surrogates, > U+10FFFF, truncation */
    static const char *bad[] = {
        "\x80", "abc\x80\x81xyz", "\xC3", "caf\xC3", "\xC3\x28", "\xE2\x82", "\xE2\x82(",
        "\xF0\x9F\x98", "x\xF0\x9F\x98 y", "\xC0\xAF", "\xE0\x80\xAF", "\xED\xA0\x80",
        "\xED\xBF\xBF surrogate", "\xF4\x90\x80\x80", "\xF8\x88\x80\x80\x80", "\xFF\xFE\xFD",
        "  \x80\x80  ", "123\x80" "456", "don\x92t", "\xA0\xA0 nbsp latin1", "r\xE9sum\xE9",
        "<|im_end|>\x80<|im_start|>", "\x80<|endoftext|>", "\n\x85\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t n = strlen(bad[i]);
        CHECKF(roundtrip(t, bad[i], n, KVZ_TOK_SPECIAL) && roundtrip(t, bad[i], n, 0),
               "round trip of invalid case %zu", i);
    }
    /* every single byte, and a few bytes with NULs */
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        CHECKF(roundtrip(t, &c, 1, 0), "byte 0x%02X", b);
    }
    CHECK(roundtrip(t, "a\0b\0\0c", 6, 0));

    /* random bytes: uniform, and biased towards UTF-8-looking sequences */
    uint64_t st = 0x9E3779B97F4A7C15ull;
    int rnd_ok = 0;
    for (int k = 0; k < 2000; k++) {
        char s[256];
        size_t n = (size_t)(k % 97) + 1;
        for (size_t i = 0; i < n; i++) {
            st ^= st << 13; st ^= st >> 7; st ^= st << 17;
            uint8_t b = (uint8_t)st;
            if (k & 1) { /* UTF-8-ish: mostly ASCII, lead and continuation bytes */
                static const uint8_t pool[] = {' ', 'a', '1', '\'', '\n', 0xC3, 0xA9, 0xE4, 0xB8, 0xAD,
                                               0xF0, 0x9F, 0x98, 0x80, 0xED, 0xA0, '<', '|', '>'};
                b = pool[(st >> 8) % sizeof pool];
            }
            s[i] = (char)b;
        }
        rnd_ok += roundtrip(t, s, n, k & 2 ? KVZ_TOK_SPECIAL : 0);
    }
    printf("random bytes: %d/2000 round trips\n", rnd_ok);
    CHECK(rnd_ok == 2000);

    /* speed: a ~6,000-token document built from the golden strings */
    size_t cap = 64 * 1024, dn = 0;
    char *doc = malloc(cap);
    REQUIRE(doc);
    const char *para =
        "KVzip scores every key/value pair by how much the model needs it to reconstruct "
        "the document, keeps 30% of them, and stores the rest in LMDB. In 2024, the method "
        "reached 3-4x compression at negligible loss on 12 benchmarks.\n"
        "def score(q, k):\n    return (q @ k.T / 8.0).softmax(-1).max(0)\n\n"
        "Ünïcödé text: 日本語のテキスト, Русский текст, emoji 👨‍👩‍👧 and numbers 1,234,567.89.\n";
    while (dn + strlen(para) < cap) { memcpy(doc + dn, para, strlen(para)); dn += strlen(para); }
    kvz_tokens v = {0};
    CHECK(kvz_tokenizer_encode(t, doc, dn, 0, &v) == 0); /* warm-up */
    size_t ntok = v.n;
    const int reps = 10;
    double t0 = now_s();
    for (int r = 0; r < reps; r++) {
        v.n = 0;
        kvz_tokenizer_encode(t, doc, dn, 0, &v);
    }
    double dt = (now_s() - t0) / reps;
    printf("encode speed: %zu bytes -> %zu tokens in %.2f ms (%.1f MB/s, %.2f Mtok/s)\n", dn, ntok,
           dt * 1e3, dn / dt / 1e6, ntok / dt / 1e6);
    CHECK(ntok >= 6000);
    CHECKF(dt < 0.1, "encoding %zu tokens took %.1f ms", ntok, dt * 1e3);
    CHECK(roundtrip(t, doc, dn, 0));
    kvz_tokens_free(&v);

    free(doc);
    free(text);
    free(ids);
    free(gold);
    kvz_tokenizer_free(t);
    return kvz_test_summary();
}
