/* libFuzzer target for the BPE tokenizer (runtime/kvz_tokenizer.h) on arbitrary
 * bytes. Vocabulary: the real model's GGUF when $KVZ_MODEL names a readable
 * file, else a tiny hand-made byte-level vocabulary (all 256 byte symbols, a few
 * merges, one special token). Checks, with and without KVZ_TOK_SPECIAL:
 *   - encode succeeds and every id is in [0, n_vocab);
 *   - the round trip the header promises: the decoded pieces concatenate to the
 *     input minus the bytes the vocabulary lacks (kvz_tokenizer_byte_token -1);
 *   - pretokenize: piece ends strictly ascending, last = input length.
 * Seeds: tests/fuzz/seeds/tokenizer. */
#include "kvz_gguf.h"
#include "kvz_tokenizer.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kvz_tokenizer *g_tok;

/* GPT-2 bytes_to_unicode: the printable byte b is U+00b, the others U+0100 + k. */
static size_t byte_symbol(int b, char *out)
{
    int k = 0, cp = -1;
    for (int x = 0; x < 256; x++) {
        int printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
        int c = printable ? x : 256 + k++;
        if (x == b) { cp = c; break; }
    }
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

static void tiny_vocab(void)
{
    static char sym[256][4];
    static kvz_str toks[256 + 8], merges[4];
    static int32_t types[256 + 8];
    for (int b = 0; b < 256; b++) {
        toks[b].ptr = sym[b];
        toks[b].len = byte_symbol(b, sym[b]);
        types[b] = 1;
    }
    static const char *extra[] = {"th", "the", "\xC4\xA0the", "in", "<|im_start|>"};
    for (int i = 0; i < 5; i++) {
        toks[256 + i] = (kvz_str){extra[i], strlen(extra[i])};
        types[256 + i] = i == 4 ? 3 : 1;
    }
    static const char *m[] = {"t h", "th e", "\xC4\xA0 the", "i n"};
    for (int i = 0; i < 4; i++) merges[i] = (kvz_str){m[i], strlen(m[i])};
    if (kvz_tokenizer_from_vocab(toks, types, 261, merges, 4, "smollm", -1, -1, &g_tok)) abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *model = getenv("KVZ_MODEL");
    kvz_gguf *g = NULL;
    if (model && *model && kvz_gguf_open(model, &g) == 0) {
        if (kvz_tokenizer_from_gguf(g, &g_tok)) g_tok = NULL;
        kvz_gguf_close(g);
    }
    if (g_tok) fprintf(stderr, "fuzz_tokenizer: vocabulary of %s\n", model);
    else tiny_vocab();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const int32_t nv = kvz_tokenizer_n_vocab(g_tok);
    char *want = malloc(size + 1), *got = malloc(4 * size + 64);
    size_t nw = 0;
    for (size_t i = 0; i < size; i++)
        if (kvz_tokenizer_byte_token(g_tok, data[i]) >= 0) want[nw++] = (char)data[i];
    for (int flags = 0; flags <= KVZ_TOK_SPECIAL; flags += KVZ_TOK_SPECIAL) {
        kvz_tokens t = {0};
        if (kvz_tokenizer_encode(g_tok, (const char *)data, size, flags, &t)) __builtin_trap();
        size_t ng = 0;
        for (size_t i = 0; i < t.n; i++) {
            if (t.ids[i] < 0 || t.ids[i] >= nv) __builtin_trap();
            char piece[512];
            int n = kvz_tokenizer_decode(g_tok, t.ids[i], piece, sizeof piece);
            if (n < 0 || n > (int)sizeof piece) __builtin_trap();
            if (ng + (size_t)n > 4 * size + 64) __builtin_trap(); /* more bytes out than in */
            memcpy(got + ng, piece, (size_t)n);
            ng += (size_t)n;
        }
        if (ng != nw || memcmp(got, want, nw)) __builtin_trap();
        kvz_tokens_free(&t);
        size_t ends[64], np = 0;
        kvz_tokenizer_pretokenize(g_tok, (const char *)data, size, flags, ends, 64, &np);
        for (size_t i = 0; i < np && i < 64; i++)
            if ((i && ends[i] <= ends[i - 1]) || ends[i] > size) __builtin_trap();
        if (np && np <= 64 && ends[np - 1] != size) __builtin_trap();
    }
    free(want);
    free(got);
    return 0;
}
