/* kvzip-query: answer questions about a document from its KV cache. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_util.h"
#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_doc_cache.h"
#include "kvz_ingest.h"
#include "kvz_model.h"
#include "kvz_store.h"

static void usage(void)
{
    printf(
        "usage: kvzip-query (--doc ID | --text FILE) [options] QUESTION [QUESTION ...]\n"
        "\n"
        "Answers each QUESTION about a document. The document's KV cache is built once\n"
        "and every question is answered against that same cache.\n"
        "\n"
        "Document:\n"
        "  --doc ID           load document ID's compressed cache from the store\n"
        "                     (see kvzip-ingest; list ids with kvzip-store ls)\n"
        "  --store DIR        store folder (default: $KVZ_STORE or ./%s)\n"
        "  --text FILE        instead: prefill FILE (UTF-8 text) into a full, uncompressed cache\n"
        "\n"
        "Model and device:\n"
        "  --model PATH       GGUF model (default: $KVZ_MODEL or %s)\n"
        "  --synthetic NAME   random-weight model of a named shape instead of --model\n"
        "                     (smollm2-135m, llama3-8b, qwen2.5-7b, tiny-llama, tiny-qwen2,\n"
        "                     tiny-qwen3); byte-level tokenizer, for tests and benchmarks\n"
        "  --threads N        CPU threads (default: all cores)\n"
        "  --device D         cpu, cuda or auto (default: auto = cuda when a GPU is usable)\n"
        "\n"
        "Decoding:\n"
        "  --max-tokens N     stop after N answer tokens (default 256)\n"
        "  --temperature T    0 = greedy (default); > 0 samples\n"
        "  --top-p P          nucleus sampling mass (default 1 = off)\n"
        "  --seed N           sampling seed (default 1)\n"
        "  --budget B         LongFlow output cache: question and answer tokens live in B\n"
        "                     slots per layer; once full, each new token overwrites the slot\n"
        "                     contributing least to attention (default 1024; 0 = unbounded).\n"
        "                     The question (plus the chat postfix) must fit in B - 8 slots.\n"
        "\n"
        "Output:\n"
        "  --json             one JSON object per question: answer, token counts, timings\n"
        "  --stats            timings and KV-cache figures on stderr\n"
        "  -h, --help         this text\n"
        "\n"
        "Exit status: 0 ok, 2 usage, 3 bad input document or too long, 4 model problem,\n"
        "5 store problem (corrupt blob, other model), 6 document or file not found,\n"
        "1 other errors (docs/ERRORS.md).\n",
        KVZ_DEFAULT_STORE, KVZ_DEFAULT_MODEL);
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
    cli_init("kvzip-query", argv);
    const char *text_path = NULL, *model_flag = NULL, *synth_flag = NULL, *doc_id = NULL, *store_flag = NULL;
    long budget = 1024;
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
        else if (!strcmp(a, "--doc")) doc_id = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--store")) store_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--budget")) budget = cli_parse_long(a, cli_value(argc, argv, &i), 0, 1 << 20);
        else if (!strcmp(a, "--model")) model_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--synthetic")) synth_flag = cli_value(argc, argv, &i);
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
    if (!text_path == !doc_id) cli_usage_error("give the document with --doc ID or --text FILE");
    if (nq == 0) cli_usage_error("no question given");
    for (int i = 0; i < nq; i++)
        if (!questions[i][0]) cli_usage_error("question %d is empty", i + 1);
    if (budget > 0 && budget < 16) cli_usage_error("--budget must be 0 (unbounded) or at least 16");

    char *doc = NULL;
    size_t doc_len = 0;
    int rc;
    if (text_path && (rc = cli_read_text(text_path, (size_t)64 << 20, &doc, &doc_len))) {
        cli_error(rc, "cannot use document");
        return cli_exit_code(rc);
    }
    kvz_model *m;
    if ((rc = cli_load_model(cli_model_path(model_flag), synth_flag, device, (int32_t)threads, &m)))
        return cli_model_exit(rc);
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);

    kvz_tokens prompt = {0}, qt = {0};
    int32_t max_q = 0;
    for (int i = 0; i < nq; i++) {
        qt.n = 0;
        if ((rc = kvz_chat_question(tok, questions[i], &qt))) {
            cli_error(rc, "cannot tokenize question %d", i + 1);
            return cli_exit_code(rc);
        }
        if ((int32_t)qt.n > max_q) max_q = (int32_t)qt.n;
    }
    if (budget > 0 && max_q > budget - 8) {
        fprintf(stderr, "kvzip-query: error: the question is %d tokens; --budget %ld holds at most "
                "%ld (raise --budget or use --budget 0)\n", max_q, budget, budget - 8);
        return EXIT_INPUT;
    }
    /* without an output buffer, question + answer rows go to the document region */
    const int64_t extra = budget > 0 ? 0 : (int64_t)max_q + max_tokens;
    kvz_kv *kv = NULL;
    int32_t n_doc;          /* position where questions start */
    double t_doc;
    kvz_store *st = NULL;
    kvz_doc_cache *dc = NULL; /* --doc: each question borrows the loaded document from it */
    if (doc_id) {
        uint8_t fp[16];
        kvz_model_fingerprint(m, fp);
        const char *sp = cli_store_path(store_flag);
        if ((rc = kvz_store_open(sp, KVZ_STORE_READONLY, 0, fp, &st))) {
            cli_error(rc, "cannot open store %s", sp);
            return cli_store_exit(rc);
        }
        kvz_doc_meta dm;
        if (!(rc = kvz_doc_cache_create(m, UINT64_MAX, NULL, &dc)))
            rc = kvz_doc_cache_get(dc, st, doc_id, extra, (int32_t)budget, &kv, &dm, NULL);
        if (rc) {
            char part[600];
            kvz_store_doc_info pi;
            snprintf(part, sizeof part, "%s#1", doc_id);
            if (rc != KVZ_ERR_NOTFOUND) {
                cli_error(rc, "cannot load document '%s'", doc_id);
            } else if (kvz_store_lookup(st, part, &pi) == 0) {
                kvz_error_clear();
                fprintf(stderr, "kvzip-query: error: document '%s' was stored in parts: query "
                        "'%s#1', '%s#2', ... (kvzip-store ls lists them)\n", doc_id, doc_id, doc_id);
            } else {
                kvz_error_clear();
                fprintf(stderr, "kvzip-query: error: no document '%s' in the store (kvzip-store ls "
                        "lists them)\n", doc_id);
            }
            return cli_store_exit(rc);
        }
        n_doc = dm.n_prefix + dm.n_ctx;
        t_doc = dm.load_s;
        if (stats)
            fprintf(stderr, "kvzip-query: document '%s': %d tokens, ratio %.2f, %llu of %lld KV rows "
                    "kept, loaded in %.3f s\n", doc_id, n_doc, dm.ratio, (unsigned long long)dm.rows,
                    (long long)n_doc * c->n_layer * c->n_kv_head, t_doc);
    } else {
        if ((rc = kvz_chat_prefix(tok, &prompt)) ||
            (rc = kvz_tokenizer_encode(tok, doc, doc_len, 0, &prompt))) {
            cli_error(rc, "cannot tokenize the document");
            return cli_exit_code(rc);
        }
        n_doc = (int32_t)prompt.n;
        if ((rc = kvz_kv_create(m, n_doc + extra, (int32_t)budget, &kv))) {
            cli_error(rc, "cannot allocate the KV cache");
            return cli_exit_code(rc);
        }
        double t0 = kvz_now();
        /* the document always goes to the document region: prefill before the
         * output buffer is used, in bounded passes */
        rc = 0;
        for (int32_t s0 = 0; s0 < n_doc && !rc; s0 += 4096) {
            int32_t nb = n_doc - s0 < 4096 ? n_doc - s0 : 4096;
            rc = kvz_forward(m, kv, prompt.ids + s0, nb, s0, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_TO_DOC, NULL);
        }
        t_doc = kvz_now() - t0;
        if (rc) {
            cli_error(rc, "prefill failed");
            return cli_exit_code(rc);
        }
        if (stats)
            fprintf(stderr, "kvzip-query: document %d tokens prefilled in %.2f s (%.0f tok/s)\n",
                    n_doc, t_doc, n_doc / t_doc);
    }
    if ((int64_t)n_doc + max_q + max_tokens > c->n_ctx) {
        fprintf(stderr, "kvzip-query: warning: document (%d tokens) + question (%d) + --max-tokens "
                "(%ld) exceed the model's trained context of %d tokens\n", n_doc, max_q, max_tokens,
                c->n_ctx);
    }
    if (!dc) kvz_kv_checkpoint(kv);
    for (int i = 0; i < nq && !rc; i++) {
        if (dc && i > 0) { /* the next question: the same document, from the cache (no load) */
            kvz_doc_meta dm;
            int hit = 0;
            if ((rc = kvz_doc_cache_put(dc, kv)) ||
                (rc = kvz_doc_cache_get(dc, st, doc_id, extra, (int32_t)budget, &kv, &dm, &hit))) {
                cli_error(rc, "cannot reuse document '%s'", doc_id);
                kv = NULL;
                break;
            }
            if (stats) fprintf(stderr, "kvzip-query: document '%s' %s\n", doc_id, hit ? "from the cache" : "loaded again");
        }
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
        fflush(stdout); /* the answer line before any --stats line on stderr */
        if (stats)
            fprintf(stderr, "kvzip-query: question %d: %d prompt tokens, first token %.3f s, "
                    "%d tokens at %.1f tok/s\n", i + 1, gs.n_prompt, gs.prefill_s, gs.n_gen,
                    gs.decode_s > 0 ? (gs.n_gen - 1) / gs.decode_s : 0.0);
        free(ab.text);
        if (stats) {
            kvz_kv_stats ks;
            kvz_kv_get_stats(kv, &ks);
            fprintf(stderr, "kvzip-query: KV held %.2f MB (%lld document rows, output buffer %lld of "
                    "%lld slots, %lld evictions)\n", ks.bytes_held / 1e6, (long long)ks.doc_rows,
                    (long long)ks.out_used, (long long)ks.out_slots, (long long)ks.evictions);
        }
        if (!dc) kvz_kv_rollback(kv); /* back to the document for the next question */
    }
    fflush(stdout);
    if (dc) {
        if (kv) kvz_doc_cache_put(dc, kv);
        kvz_doc_cache_free(dc);
    } else {
        kvz_kv_free(kv);
    }
    kvz_tokens_free(&prompt);
    kvz_tokens_free(&qt);
    kvz_store_close(st);
    kvz_model_free(m);
    free(doc);
    free(questions);
    return rc ? cli_exit_code(rc) : 0;
}
