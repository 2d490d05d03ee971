/* kvzip-query: answer questions about a document from its KV cache. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_util.h"
#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_model.h"

static void usage(void)
{
    printf(
        "usage: kvzip-query --text FILE [options] QUESTION [QUESTION ...]\n"
        "\n"
        "Answers each QUESTION about a document. The document's KV cache is built once\n"
        "and every question is answered against that same cache.\n"
        "\n"
        "Document:\n"
        "  --text FILE        prefill FILE (UTF-8 text) into a full, uncompressed cache\n"
        "\n"
        "Model and device:\n"
        "  --model PATH       GGUF model (default: $KVZ_MODEL or %s)\n"
        "  --threads N        CPU threads (default: all cores)\n"
        "  --device D         cpu, cuda or auto (default: auto = cuda when a GPU is usable)\n"
        "\n"
        "Decoding:\n"
        "  --max-tokens N     stop after N answer tokens (default 256)\n"
        "  --temperature T    0 = greedy (default); > 0 samples\n"
        "  --top-p P          nucleus sampling mass (default 1 = off)\n"
        "  --seed N           sampling seed (default 1)\n"
        "\n"
        "Output:\n"
        "  --json             one JSON object per question: answer, token counts, timings\n"
        "  --stats            timings and KV-cache figures on stderr\n"
        "  -h, --help         this text\n"
        "\n"
        "Exit status: 0 ok, 2 usage, 3 bad input document or too long, 4 model problem,\n"
        "6 file not found, 1 other errors (docs/ERRORS.md).\n",
        KVZ_DEFAULT_MODEL);
}

typedef struct answer_buf {
    const kvz_tokenizer *tok;
    char *text;
    size_t len, cap;
    int stream;
} answer_buf;

static int on_token(void *ctx, int32_t id)
{
    answer_buf *a = ctx;
    char piece[256];
    int n = kvz_tokenizer_decode(a->tok, id, piece, sizeof piece);
    if (n < 0) return n;
    if ((size_t)n > sizeof piece) n = sizeof piece;
    if (a->len + (size_t)n + 1 > a->cap) {
        size_t nc = (a->cap ? a->cap * 2 : 1024) + (size_t)n;
        char *p = realloc(a->text, nc);
        if (!p) return KVZ_ERR_NOMEM;
        a->text = p;
        a->cap = nc;
    }
    memcpy(a->text + a->len, piece, (size_t)n);
    a->len += (size_t)n;
    a->text[a->len] = 0;
    if (a->stream) {
        fwrite(piece, 1, (size_t)n, stdout);
        fflush(stdout);
    }
    return 0;
}

int main(int argc, char **argv)
{
    cli_prog = "kvzip-query";
    const char *text_path = NULL, *model_flag = NULL;
    long max_tokens = 256, threads = 0, seed = 1;
    double temperature = 0.0, top_p = 1.0;
    int json = 0, stats = 0;
    int32_t device = KVZ_DEVICE_AUTO;
    const char **questions = calloc((size_t)argc, sizeof *questions);
    int nq = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        else if (!strcmp(a, "--text")) text_path = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--model")) model_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--threads")) threads = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "--device")) device = cli_parse_device(cli_value(argc, argv, &i));
        else if (!strcmp(a, "--max-tokens")) max_tokens = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1 << 20);
        else if (!strcmp(a, "--temperature")) temperature = cli_parse_double(a, cli_value(argc, argv, &i), 0, 100);
        else if (!strcmp(a, "--top-p")) top_p = cli_parse_double(a, cli_value(argc, argv, &i), 1e-6, 1);
        else if (!strcmp(a, "--seed")) seed = cli_parse_long(a, cli_value(argc, argv, &i), 0, 0x7fffffffL);
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--stats")) stats = 1;
        else if (a[0] == '-' && a[1] == '-') cli_usage_error("unknown option '%s'", a);
        else questions[nq++] = a;
    }
    if (!text_path) cli_usage_error("give the document with --text FILE");
    if (nq == 0) cli_usage_error("no question given");
    for (int i = 0; i < nq; i++)
        if (!questions[i][0]) cli_usage_error("question %d is empty", i + 1);

    char *doc;
    size_t doc_len;
    int rc = cli_read_text(text_path, (size_t)64 << 20, &doc, &doc_len);
    if (rc) {
        cli_error(rc, "cannot use document");
        return cli_exit_code(rc);
    }
    kvz_model *m;
    if ((rc = cli_load_model(cli_model_path(model_flag), NULL, device, (int32_t)threads, &m)))
        return cli_exit_code(rc);
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);

    kvz_tokens prompt = {0}, qt = {0};
    if ((rc = kvz_chat_prefix(tok, &prompt)) ||
        (rc = kvz_tokenizer_encode(tok, doc, doc_len, 0, &prompt))) {
        cli_error(rc, "cannot tokenize the document");
        return cli_exit_code(rc);
    }
    const int32_t n_doc = (int32_t)prompt.n;
    int32_t max_q = 0;
    for (int i = 0; i < nq; i++) {
        qt.n = 0;
        if ((rc = kvz_chat_question(tok, questions[i], &qt))) {
            cli_error(rc, "cannot tokenize question %d", i + 1);
            return cli_exit_code(rc);
        }
        if ((int32_t)qt.n > max_q) max_q = (int32_t)qt.n;
    }
    if ((int64_t)n_doc + max_q + max_tokens > c->n_ctx) {
        fprintf(stderr, "kvzip-query: error: document (%d tokens with the system prefix) + "
                "question (%d) + --max-tokens (%ld) exceed the model context of %d tokens\n",
                n_doc, max_q, max_tokens, c->n_ctx);
        return EXIT_INPUT;
    }
    kvz_kv *kv;
    if ((rc = kvz_kv_create(m, n_doc + max_q + max_tokens, 0, &kv))) {
        cli_error(rc, "cannot allocate the KV cache");
        return cli_exit_code(rc);
    }
    double t0 = kvz_now();
    rc = kvz_forward(m, kv, prompt.ids, n_doc, 0, NULL, KVZ_FWD_NO_LOGITS, NULL);
    double t_doc = kvz_now() - t0;
    if (rc) {
        cli_error(rc, "prefill failed");
        return cli_exit_code(rc);
    }
    if (stats)
        fprintf(stderr, "kvzip-query: document %d tokens prefilled in %.2f s (%.0f tok/s)\n",
                n_doc, t_doc, n_doc / t_doc);
    for (int i = 0; i < nq && !rc; i++) {
        qt.n = 0;
        kvz_chat_question(tok, questions[i], &qt);
        answer_buf ab = {.tok = tok, .stream = !json};
        kvz_gen_opts go = {.max_tokens = (int32_t)max_tokens, .on_token = on_token, .ctx = &ab,
                           .stop_on_eos = 1};
        kvz_sampler_init(&go.sampler, (float)temperature, (float)top_p, (uint64_t)seed);
        if (!json && nq > 1) printf("Q: %s\nA: ", questions[i]);
        kvz_gen_stats gs;
        rc = kvz_generate(m, kv, qt.ids, (int32_t)qt.n, n_doc, &go, NULL, NULL, &gs);
        if (rc) {
            if (!json) putchar('\n');
            cli_error(rc, "generation failed");
            break;
        }
        if (json) {
            printf("{\"question\": ");
            cli_json_str(stdout, questions[i], strlen(questions[i]));
            printf(", \"answer\": ");
            cli_json_str(stdout, ab.text ? ab.text : "", ab.len);
            printf(", \"doc_tokens\": %d, \"question_tokens\": %d, \"answer_tokens\": %d, "
                   "\"stopped\": %s, \"doc_prefill_s\": %.4f, \"ttft_s\": %.4f, "
                   "\"decode_tok_s\": %.2f}\n", n_doc, gs.n_prompt, gs.n_gen,
                   gs.stopped ? "true" : "false", t_doc, gs.prefill_s,
                   gs.decode_s > 0 ? (gs.n_gen - 1) / gs.decode_s : 0.0);
        } else {
            putchar('\n');
        }
        if (stats)
            fprintf(stderr, "kvzip-query: question %d: %d prompt tokens, first token %.3f s, "
                    "%d tokens at %.1f tok/s\n", i + 1, gs.n_prompt, gs.prefill_s, gs.n_gen,
                    gs.decode_s > 0 ? (gs.n_gen - 1) / gs.decode_s : 0.0);
        free(ab.text);
        kvz_kv_truncate(kv, n_doc); /* back to the document for the next question */
    }
    fflush(stdout);
    kvz_kv_free(kv);
    kvz_tokens_free(&prompt);
    kvz_tokens_free(&qt);
    kvz_model_free(m);
    free(doc);
    free(questions);
    return rc ? cli_exit_code(rc) : 0;
}
