/* Tokenizer units with a tiny hand-built vocabulary (no model file): GPT-2 byte
 * map, merge order, special tokens, dropped bytes, errors, and the split regexes
 * of every pre-tokenizer against HF `tokenizers` (tests/golden/pretok_splits.tsv). */
#include <stdint.h>

#include "kvz_error.h"
#include "kvz_test.h"
#include "kvz_tokenizer.h"

/* GPT-2 bytes_to_unicode, written out independently of the library. */
static uint32_t b2u[256];
static void init_b2u(void)
{
    int n = 0;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        b2u[b] = keep ? (uint32_t)b : 256u + (uint32_t)n++;
    }
}

static size_t utf8(uint32_t cp, char *o)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    o[0] = (char)(0xC0 | cp >> 6);
    o[1] = (char)(0x80 | (cp & 63));
    return 2; /* byte map stays below U+0800 */
}

#define MAXV 300
static char store[MAXV][16];
static kvz_str toks[MAXV];
static int32_t types[MAXV];
static int nv;

static int add_tok(const char *s, int32_t type)
{
    snprintf(store[nv], sizeof store[nv], "%s", s);
    toks[nv].ptr = store[nv];
    toks[nv].len = strlen(s);
    types[nv] = type;
    return nv++;
}

/* byte-level spelling of a raw string, e.g. " a" -> "Ġa" */
static const char *bl(const char *raw, char *buf)
{
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)raw; *p; p++) o += utf8(b2u[*p], buf + o);
    buf[o] = 0;
    return buf;
}

static int enc(const kvz_tokenizer *t, const char *s, int flags, const int32_t *want, size_t nw)
{
    kvz_tokens v = {0};
    int rc = kvz_tokenizer_encode(t, s, strlen(s), flags, &v);
    int ok = rc == 0 && v.n == nw && (nw == 0 || memcmp(v.ids, want, nw * sizeof *want) == 0);
    if (!ok) {
        fprintf(stderr, "encode \"%s\":", s);
        for (size_t i = 0; i < v.n; i++) fprintf(stderr, " %d", (int)v.ids[i]);
        fprintf(stderr, "\n");
    }
    kvz_tokens_free(&v);
    return ok;
}

static int hexval(int c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; }

int main(void)
{
    init_b2u();
    CHECK(b2u[' '] == 0x120 && b2u['\n'] == 0x10A && b2u[0] == 0x100 && b2u[0x7F] == 0x121 &&
          b2u[0xAD] == 0x143 && b2u['A'] == 'A');

    /* vocabulary: ids 0..255 are the bytes, then merged pieces and specials */
    char u[8], b[64];
    for (int i = 0; i < 256; i++) { u[utf8(b2u[i], u)] = 0; add_tok(u, 1); }
    /* a missing byte: 0x7F's symbol is renamed so it is not found */
    snprintf(store[0x7F], sizeof store[0x7F], "%s", "<missing>");
    toks[0x7F].len = strlen(store[0x7F]);
    int bc = add_tok("bc", 1), ab = add_tok("ab", 1), abc = add_tok("abc", 1), aa = add_tok("aa", 1);
    int sp_a = add_tok(bl(" a", b), 1), xy = add_tok("xy", 1), yz = add_tok("yz", 1), xyz = add_tok("xyz", 1);
    int bang2 = add_tok("!!", 1), sp_sp = add_tok(bl("  ", b), 1);
    int s_short = add_tok("<|lo", 3), s_long = add_tok("<|long|>", 3), s_user = add_tok("[U]", 4);
    const char *mstr[] = {"b c", "a b", "a bc", "a a", "\xC4\xA0 a", "x y", "y z", "xy z", "q r",
                          "! !", "\xC4\xA0 \xC4\xA0"};
    kvz_str merges[16];
    size_t nm = sizeof mstr / sizeof mstr[0];
    for (size_t i = 0; i < nm; i++) { merges[i].ptr = mstr[i]; merges[i].len = strlen(mstr[i]); }

    kvz_tokenizer *t = NULL;
    REQUIRE(kvz_tokenizer_from_vocab(toks, types, (uint64_t)nv, merges, nm, "smollm", 1, 2, &t) == 0);
    CHECK(kvz_tokenizer_n_vocab(t) == nv);
    CHECK(kvz_tokenizer_bos(t) == 1 && kvz_tokenizer_eos(t) == 2);
    CHECK(kvz_tokenizer_find(t, "xyz") == xyz && kvz_tokenizer_find(t, "zz") == -1);
    CHECK(kvz_tokenizer_byte_token(t, 'a') == 'a' && kvz_tokenizer_byte_token(t, 0x7F) == -1);
    CHECK(kvz_tokenizer_is_special(t, s_long) && kvz_tokenizer_is_special(t, s_user) &&
          !kvz_tokenizer_is_special(t, abc) && !kvz_tokenizer_is_special(t, -3));

    /* merges by rank, leftmost first on ties */
    { int32_t w[] = {abc}; CHECK(enc(t, "abc", 0, w, 1)); }          /* b c, then a bc */
    { int32_t w[] = {aa, 'a'}; CHECK(enc(t, "aaa", 0, w, 2)); }
    { int32_t w[] = {aa, aa}; CHECK(enc(t, "aaaa", 0, w, 2)); }
    { int32_t w[] = {xyz}; CHECK(enc(t, "xyz", 0, w, 1)); }
    { int32_t w[] = {'w', yz}; CHECK(enc(t, "wyz", 0, w, 2)); }
    { int32_t w[] = {xy}; CHECK(enc(t, "xy", 0, w, 1)); }
    { int32_t w[] = {'z', bc}; CHECK(enc(t, "zbc", 0, w, 2)); }
    { int32_t w[] = {ab, 'x'}; CHECK(enc(t, "abx", 0, w, 2)); }
    { int32_t w[] = {'a', sp_a}; CHECK(enc(t, "a a", 0, w, 2)); }
    { int32_t w[] = {'q', 'r'}; CHECK(enc(t, "qr", 0, w, 2)); }        /* merge to an unknown piece */
    { int32_t w[] = {sp_sp, sp_a}; CHECK(enc(t, "   a", 0, w, 2)); }   /* "  " + " a" */
    { int32_t w[] = {'a', '1', '2'}; CHECK(enc(t, "a12", 0, w, 3)); }  /* smollm: digits alone */
    CHECK(enc(t, "", 0, NULL, 0));
    /* a byte without a token is dropped and its neighbours merge */
    { int32_t w[] = {bang2}; CHECK(enc(t, "!\x7F!", 0, w, 1)); }
    /* special tokens: longest match, only with the flag */
    { int32_t w[] = {s_long}; CHECK(enc(t, "<|long|>", KVZ_TOK_SPECIAL, w, 1)); }
    { int32_t w[] = {s_short, 'n'}; CHECK(enc(t, "<|lon", KVZ_TOK_SPECIAL, w, 2)); }
    { int32_t w[] = {'a', s_user, 'b'}; CHECK(enc(t, "a[U]b", KVZ_TOK_SPECIAL, w, 3)); }
    { int32_t w[] = {'[', 'U', ']'}; CHECK(enc(t, "[U]", 0, w, 3)); }

    /* decode */
    char buf[16];
    CHECK(kvz_tokenizer_decode(t, sp_a, buf, sizeof buf) == 2 && memcmp(buf, " a", 2) == 0);
    CHECK(kvz_tokenizer_decode(t, '\n', buf, sizeof buf) == 1 && buf[0] == '\n');
    CHECK(kvz_tokenizer_decode(t, 0xAD, buf, sizeof buf) == 1 && (unsigned char)buf[0] == 0xAD);
    CHECK(kvz_tokenizer_decode(t, s_long, buf, sizeof buf) == 8 && memcmp(buf, "<|long|>", 8) == 0);
    CHECK(kvz_tokenizer_decode(t, s_long, buf, 2) == 8);
    CHECK(kvz_tokenizer_decode(t, nv, buf, sizeof buf) == KVZ_ERR_ARG);

    /* pretokenize */
    {
        size_t ends[8], n = 0;
        CHECK(kvz_tokenizer_pretokenize(t, "Hi 12<|lo", 9, KVZ_TOK_SPECIAL, ends, 8, &n) == 0);
        CHECK(n == 5 && ends[0] == 2 && ends[1] == 3 && ends[2] == 4 && ends[3] == 5 && ends[4] == 9);
        CHECK(kvz_tokenizer_pretokenize(t, "Hi 12<|lo", 9, 0, NULL, 0, &n) == 0 && n == 6);
    }

    /* errors */
    {
        kvz_tokenizer *x = (kvz_tokenizer *)1;
        CHECK(kvz_tokenizer_from_vocab(toks, types, (uint64_t)nv, merges, nm, "llama3", -1, -1, &x) ==
              KVZ_ERR_UNSUPPORTED && x == NULL);
        CHECK(kvz_tokenizer_from_vocab(toks, types, 0, merges, nm, "gpt2", -1, -1, &x) == KVZ_ERR_ARG);
        kvz_str bad = {"nospace", 7};
        CHECK(kvz_tokenizer_from_vocab(toks, types, (uint64_t)nv, &bad, 1, "gpt2", -1, -1, &x) == KVZ_ERR_FORMAT);
        CHECK(kvz_tokenizer_from_vocab(toks, NULL, (uint64_t)nv, NULL, 0, NULL, 99999, -5, &x) == 0);
        CHECK(kvz_tokenizer_bos(x) == -1 && kvz_tokenizer_eos(x) == -1 && !kvz_tokenizer_is_special(x, s_long));
        kvz_tokenizer_free(x);
    }

    /* kvz_tokens growth */
    {
        kvz_tokens v = {0};
        int ok = 1;
        for (int i = 0; i < 10000; i++) ok &= kvz_tokens_push(&v, i) == 0;
        CHECK(ok && v.n == 10000 && v.ids[9999] == 9999);
        kvz_tokens_free(&v);
        CHECK(v.ids == NULL && v.n == 0);
    }

    /* split regexes vs HF, per pre-tokenizer */
    kvz_tokenizer *pre[3] = {NULL, NULL, NULL};
    const char *names[3] = {"gpt2", "smollm", "qwen2"};
    for (int i = 0; i < 3; i++)
        REQUIRE(kvz_tokenizer_from_vocab(toks, types, (uint64_t)nv, merges, nm, names[i], -1, -1, &pre[i]) == 0);
    char path[1024];
    char *gold = kvz_test_read_file(kvz_test_path(path, sizeof path, "tests/golden/pretok_splits.tsv"), NULL);
    REQUIRE(gold != NULL);
    int lines = 0, good[3] = {0, 0, 0}, count[3] = {0, 0, 0};
    static char text[1 << 16];
    static size_t want[1 << 14], got[1 << 14];
    for (char *line = gold; *line;) {
        char *eol = strchr(line, '\n');
        if (!eol) eol = line + strlen(line);
        char *t1 = memchr(line, '\t', (size_t)(eol - line));
        char *t2 = t1 ? memchr(t1 + 1, '\t', (size_t)(eol - t1 - 1)) : NULL;
        REQUIRE(t1 && t2);
        int k = -1;
        for (int i = 0; i < 3; i++)
            if ((size_t)(t1 - line) == strlen(names[i]) && memcmp(line, names[i], strlen(names[i])) == 0) k = i;
        REQUIRE(k >= 0);
        size_t n = 0, nw = 0, ng = 0;
        for (char *p = t1 + 1; p + 1 < t2; p += 2) text[n++] = (char)(hexval(p[0]) << 4 | hexval(p[1]));
        for (char *p = t2 + 1; p < eol;) {
            char *end;
            unsigned long v = strtoul(p, &end, 10);
            if (end == p) break;
            want[nw++] = v;
            p = *end == ',' ? end + 1 : end;
        }
        kvz_tokenizer_pretokenize(pre[k], text, n, 0, got, sizeof got / sizeof got[0], &ng);
        int ok = ng == nw && memcmp(got, want, nw * sizeof *want) == 0;
        if (!ok) {
            fprintf(stderr, "%s split mismatch, line %d: %.*s\n  want:", names[k], lines + 1,
                    (int)(t2 - t1 - 1), t1 + 1);
            for (size_t i = 0; i < nw; i++) fprintf(stderr, " %zu", want[i]);
            fprintf(stderr, "\n  got: ");
            for (size_t i = 0; i < ng; i++) fprintf(stderr, " %zu", got[i]);
            fprintf(stderr, "\n");
        }
        CHECK(ok);
        good[k] += ok;
        count[k]++;
        lines++;
        line = *eol ? eol + 1 : eol;
    }
    for (int i = 0; i < 3; i++) printf("splits %-6s: %d/%d match HF\n", names[i], good[i], count[i]);
    CHECK(count[0] >= 300 && count[1] >= 300 && count[2] >= 300);
    free(gold);
    for (int i = 0; i < 3; i++) kvz_tokenizer_free(pre[i]);
    kvz_tokenizer_free(t);
    return kvz_test_summary();
}
