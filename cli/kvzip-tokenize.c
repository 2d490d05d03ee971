/* kvzip-tokenize: text on stdin -> token ids or pieces of the model's tokenizer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_util.h"
#include "kvz_error.h"
#include "kvz_gguf.h"
#include "kvz_tokenizer.h"

static void usage(void)
{
    printf("usage: kvzip-tokenize [--ids | --pieces] [--special] [--model PATH|NAME] < text\n"
           "\n"
           "Reads UTF-8 text on standard input and prints its tokens under the model's\n"
           "byte-level BPE tokenizer (loaded from the GGUF; no weights are read).\n"
           "\n"
           "  --ids          space-separated token ids on one line (default)\n"
           "  --pieces       one token per line: id, then the token's bytes as a JSON string\n"
           "  --special      match special-token text such as <|im_start|> literally\n"
           "  --model PATH|NAME  GGUF file, or a name fetched by scripts/fetch-model\n"
           "                 (default: $KVZ_MODEL or %s)\n"
           "  -h, --help     this text\n", KVZ_DEFAULT_MODEL);
}

int main(int argc, char **argv)
{
    cli_init("kvzip-tokenize", argv);
    int pieces = 0, flags = 0;
    const char *model = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ids")) pieces = 0;
        else if (!strcmp(argv[i], "--pieces")) pieces = 1;
        else if (!strcmp(argv[i], "--special")) flags |= KVZ_TOK_SPECIAL;
        else if (!strcmp(argv[i], "--model")) model = cli_value(argc, argv, &i);
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) { usage(); return 0; }
        else cli_usage_error("unknown argument '%s'", argv[i]);
    }
    const char *path = cli_model_path(model);
    kvz_gguf *g;
    int rc = kvz_gguf_open(path, &g);
    if (rc) {
        cli_error(rc, "cannot open model %s", path);
        return cli_exit_code(rc);
    }
    kvz_tokenizer *tok;
    if ((rc = kvz_tokenizer_from_gguf(g, &tok))) {
        cli_error(rc, "cannot build the tokenizer of %s", path);
        kvz_gguf_close(g);
        return cli_exit_code(rc);
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    size_t n;
    while (buf && (n = fread(buf + len, 1, cap - len, stdin)) > 0) {
        len += n;
        if (len == cap) buf = realloc(buf, cap *= 2);
    }
    if (!buf) { fprintf(stderr, "kvzip-tokenize: error: out of memory\n"); return EXIT_FAIL; }
    kvz_tokens t = {0};
    if ((rc = kvz_tokenizer_encode(tok, buf, len, flags, &t))) {
        cli_error(rc, "cannot tokenize the input");
        return cli_exit_code(rc);
    }
    char piece[512];
    for (size_t i = 0; i < t.n; i++) {
        if (pieces) {
            int pn = kvz_tokenizer_decode(tok, t.ids[i], piece, sizeof piece);
            printf("%d\t", t.ids[i]);
            cli_json_str(stdout, piece, pn < (int)sizeof piece ? (size_t)pn : sizeof piece);
            putchar('\n');
        } else {
            printf(i ? " %d" : "%d", t.ids[i]);
        }
    }
    if (!pieces) putchar('\n');
    kvz_tokens_free(&t);
    free(buf);
    kvz_tokenizer_free(tok);
    kvz_gguf_close(g);
    return 0;
}
