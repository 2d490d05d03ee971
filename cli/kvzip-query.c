/* kvzip-query: answer questions about a document from its KV cache. A thin main
 * over the public library (include/kvzip.h): flags, printing, exit codes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "cli_util.h"
#include "kvzip-query.help.h" /* cli_help: generated from cli/help/kvzip-query.txt */
#include "kvz_error.h"
#include "kvzip.h"

static void usage(void) { fputs(cli_help, stdout); } /* cli/help/kvzip-query.txt */

static int on_piece(void *user, const char *piece, size_t len, int32_t token)
{
    (void)user;
    (void)token;
    fwrite(piece, 1, len, stdout);
    fflush(stdout);
    return 0;
}

/* One JSON object per question (jansson writes and escapes it). */
static void print_json(const char *q, const char *answer, const kvzip_session_info *si,
                       const kvzip_answer_stats *as)
{
    json_t *o = json_object();
    json_object_set_new(o, "question", json_string(q));
    json_object_set_new(o, "answer", json_string(answer));
    if (!json_is_string(json_object_get(o, "answer"))) /* not UTF-8: bytes as-is, lossy */
        json_object_set_new(o, "answer", json_stringn_nocheck(answer, strlen(answer)));
    json_object_set_new(o, "doc_tokens", json_integer(si->doc_tokens));
    json_object_set_new(o, "question_tokens", json_integer(as->prompt_tokens));
    json_object_set_new(o, "answer_tokens", json_integer(as->answer_tokens));
    json_object_set_new(o, "stopped", json_boolean(as->stopped));
    json_object_set_new(o, "doc_prefill_s", json_real(si->load_s));
    json_object_set_new(o, "ttft_s", json_real(as->ttft_s));
    json_object_set_new(o, "decode_tok_s", json_real(as->decode_tok_s));
    json_object_set_new(o, "from_store", json_boolean(si->from_store));
    json_object_set_new(o, "ratio", json_real(si->ratio));
    json_object_set_new(o, "doc_rows_kept", json_integer((json_int_t)si->rows_kept));
    json_object_set_new(o, "doc_rows_full", json_integer((json_int_t)si->rows_full));
    json_object_set_new(o, "load_s", json_real(si->load_s));
    json_object_set_new(o, "decode_s", json_real(as->decode_s));
    json_object_set_new(o, "kv_held_bytes", json_integer((json_int_t)as->kv_bytes_held));
    json_object_set_new(o, "kv_doc_rows", json_integer(as->kv_doc_rows));
    json_object_set_new(o, "out_slots_used", json_integer(as->out_used));
    json_object_set_new(o, "out_slots", json_integer(as->out_slots));
    json_object_set_new(o, "evictions", json_integer(as->evictions));
    char *txt = json_dumps(o, JSON_REAL_PRECISION(6));
    if (txt) puts(txt);
    free(txt);
    json_decref(o);
}

int main(int argc, char **argv)
{
    cli_init("kvzip-query", argv);
    const char *text_path = NULL, *model_flag = NULL, *synth_flag = NULL, *doc_id = NULL, *store_flag = NULL;
    const char **docs = calloc((size_t)argc, sizeof *docs);
    int ndocs = 0, placement_given = 0;
    kvzip_docs_opts dopts;
    kvzip_docs_defaults(&dopts);
    kvzip_session_opts so;
    kvzip_session_defaults(&so);
    long threads = 0;
    int json = 0, stats = 0, ended = 0;
    int32_t device = KVZIP_DEVICE_AUTO;
    const char **questions = calloc((size_t)argc, sizeof *questions);
    int nq = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int kind = cli_arg_kind(a, &ended); /* "--" ends the options */
        if (kind < 0) continue;
        if (kind == 0) { questions[nq++] = a; continue; }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        else if (!strcmp(a, "--text")) text_path = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--doc")) doc_id = docs[ndocs++] = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--placement")) {
            const char *p = cli_value(argc, argv, &i);
            placement_given = 1;
            if (!strcmp(p, "auto")) dopts.placement = KVZIP_PLACE_AUTO;
            else if (!strcmp(p, "sequential")) dopts.placement = KVZIP_PLACE_SEQUENTIAL;
            else if (!strcmp(p, "parallel")) dopts.placement = KVZIP_PLACE_PARALLEL;
            else cli_usage_error("--placement must be sequential, parallel or auto, not '%s'", p);
        }
        else if (!strcmp(a, "--key-scale")) {
            dopts.key_scale = (float)cli_parse_double(a, cli_value(argc, argv, &i), 0.01, 100);
            placement_given = 1;
        }
        else if (!strcmp(a, "--store")) store_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--budget")) so.budget = (int32_t)cli_parse_long(a, cli_value(argc, argv, &i), 0, 1 << 20);
        else if (!strcmp(a, "--model")) model_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--synthetic")) synth_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--threads")) threads = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "--device")) device = cli_parse_device(cli_value(argc, argv, &i));
        else if (!strcmp(a, "--max-tokens")) so.max_tokens = (int32_t)cli_parse_long(a, cli_value(argc, argv, &i), 1, 1 << 20);
        else if (!strcmp(a, "--temperature")) so.temperature = (float)cli_parse_double(a, cli_value(argc, argv, &i), 0, 100);
        else if (!strcmp(a, "--top-p")) so.top_p = (float)cli_parse_double(a, cli_value(argc, argv, &i), 1e-6, 1);
        else if (!strcmp(a, "--seed")) so.seed = (uint64_t)cli_parse_long(a, cli_value(argc, argv, &i), 0, 0x7fffffffL);
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--stats")) stats = 1;
        else if (a[0] == '-' && a[1] == '-') cli_usage_error("unknown option '%s'", a);
        else questions[nq++] = a;
    }
    if (!text_path == !doc_id) cli_usage_error("give the document with --doc ID or --text FILE");
    if (placement_given && !doc_id) cli_usage_error("--placement and --key-scale need --doc");
    if (nq == 0) cli_usage_error("no question given");
    for (int i = 0; i < nq; i++)
        if (!questions[i][0]) cli_usage_error("question %d is empty", i + 1);
    if (so.budget > 0 && so.budget < 16) cli_usage_error("--budget must be 0 (unbounded) or at least 16");

    char *doc = NULL;
    size_t doc_len = 0;
    int rc;
    if (text_path && (rc = cli_read_text(text_path, (size_t)64 << 20, &doc, &doc_len))) {
        cli_error(rc, "cannot use document");
        return cli_exit_code(rc);
    }
    const char *model_path = cli_model_path(model_flag);
    struct stat mst;
    if (!synth_flag) { /* never block on a FIFO or device named as the model */
        const int fd = cli_open_regular(model_path, &mst);
        if (fd == KVZ_ERR_NOTFOUND) {
            fprintf(stderr, "kvzip-query: error: model file %s not found (run scripts/setup, or pass "
                    "--model / set KVZ_MODEL)\n", cli_escape(model_path));
            return EXIT_NOTFOUND;
        }
        if (fd < 0) {
            cli_error(fd, "cannot load model %s", model_path);
            return cli_model_exit(fd);
        }
        close(fd);
    }
    kvzip_model *m;
    kvzip_model_opts mo = {.device = device, .n_threads = (int32_t)threads, .synthetic = synth_flag};
    if ((rc = kvzip_model_open(model_path, &mo, &m))) {
        if (synth_flag) cli_error(rc, "cannot build synthetic model '%s'", synth_flag);
        else cli_error(rc, "cannot load model %s", model_path);
        return cli_model_exit(rc);
    }
    kvzip_model_info mi;
    kvzip_model_info_get(m, &mi);

    int32_t max_q = 0;
    for (int i = 0; i < nq; i++) {
        int32_t n;
        if ((rc = kvzip_question_tokens(m, questions[i], &n))) {
            cli_error(rc, "cannot tokenize question %d", i + 1);
            return cli_exit_code(rc);
        }
        if (n > max_q) max_q = n;
    }
    if (so.budget > 0 && max_q > so.budget - 8) {
        fprintf(stderr, "kvzip-query: error: the question is %d tokens; --budget %d holds at most "
                "%d (raise --budget or use --budget 0)\n", max_q, so.budget, so.budget - 8);
        return EXIT_INPUT;
    }
    so.max_question_tokens = max_q; /* rows reserved per question when --budget 0 */
    kvzip_session *ss;
    kvzip_session_info si;
    kvzip_store *st = NULL;
    if (doc_id) {
        const char *sp = cli_store_path(store_flag);
        if ((rc = kvzip_store_open(sp, KVZIP_STORE_READONLY, m, &st))) {
            cli_error(rc, "cannot open store %s", sp);
            return cli_store_exit(rc);
        }
        /* one whole document: the plain session; several, or a split one: composed */
        int composed = ndocs > 1 || placement_given;
        if (!composed && (rc = kvzip_session_open(m, st, doc_id, &so, &ss)) == KVZIP_ERR_NOTFOUND)
            composed = 1;
        if (composed && (rc = kvzip_session_open_docs(m, st, docs, ndocs, &so, &dopts, &ss))) {
            if (rc == KVZIP_ERR_NOTFOUND) { /* the detail names the unknown id */
                fprintf(stderr, "kvzip-query: error: %s (kvzip-store ls lists them)\n",
                        cli_escape(kvzip_errdetail()));
                kvz_error_clear();
            } else
                cli_error(rc, ndocs > 1 ? "cannot compose the documents" : "cannot load document '%s'", doc_id);
            return rc == KVZIP_ERR_ARG ? EXIT_USAGE : rc == KVZIP_ERR_CONTEXT ? EXIT_INPUT : cli_store_exit(rc);
        }
        if (rc) {
            cli_error(rc, "cannot load document '%s'", doc_id);
            return cli_store_exit(rc);
        }
        kvzip_session_info_get(ss, &si);
        kvzip_docs_info di;
        kvzip_session_docs_info(ss, &di);
        if (stats && composed)
            fprintf(stderr, "kvzip-query: %d documents composed (%s): span %lld tokens, questions at "
                    "position %d, ratio >= %.2f, %llu of %llu KV rows kept, loaded in %.3f s\n", di.n_docs,
                    di.placement == KVZIP_PLACE_PARALLEL ? "parallel" : "sequential", (long long)di.span,
                    si.doc_tokens, si.ratio, (unsigned long long)si.rows_kept,
                    (unsigned long long)si.rows_full, si.load_s);
        else if (stats)
            fprintf(stderr, "kvzip-query: document '%s': %d tokens, ratio %.2f, %llu of %llu KV rows "
                    "kept, loaded in %.3f s\n", doc_id, si.doc_tokens, si.ratio,
                    (unsigned long long)si.rows_kept, (unsigned long long)si.rows_full, si.load_s);
    } else {
        if ((rc = kvzip_session_open_text(m, doc, doc_len, &so, &ss))) {
            cli_error(rc, rc == KVZIP_ERR_NOMEM || rc == KVZIP_ERR_CUDA ? "prefill failed" :
                      "cannot tokenize the document");
            return cli_exit_code(rc);
        }
        kvzip_session_info_get(ss, &si);
        if (stats)
            fprintf(stderr, "kvzip-query: document %d tokens prefilled in %.2f s (%.0f tok/s)\n",
                    si.doc_tokens, si.load_s, si.doc_tokens / si.load_s);
    }
    if ((int64_t)si.doc_tokens + max_q + so.max_tokens > mi.n_ctx) {
        fprintf(stderr, "kvzip-query: warning: document (%d tokens) + question (%d) + --max-tokens "
                "(%d) exceed the model's trained context of %d tokens\n", si.doc_tokens, max_q,
                so.max_tokens, mi.n_ctx);
    }
    for (int i = 0; i < nq && !rc; i++) {
        if (!json && nq > 1) printf("Q: %s\nA: ", questions[i]);
        char *answer = NULL;
        kvzip_answer_stats as;
        rc = kvzip_ask(ss, questions[i], json ? NULL : on_piece, NULL, json ? &answer : NULL, &as);
        if (rc) {
            if (!json) putchar('\n');
            cli_error(rc, "generation failed");
            break;
        }
        if (json) print_json(questions[i], answer, &si, &as);
        else putchar('\n');
        kvzip_free(answer);
        fflush(stdout); /* the answer line before any --stats line on stderr */
        if (stats) {
            fprintf(stderr, "kvzip-query: question %d: %d prompt tokens, first token %.3f s, "
                    "%d tokens at %.1f tok/s\n", i + 1, as.prompt_tokens, as.ttft_s, as.answer_tokens,
                    as.decode_tok_s);
            fprintf(stderr, "kvzip-query: KV held %.2f MB (%lld document rows, output buffer %lld of "
                    "%lld slots, %lld evictions)\n", as.kv_bytes_held / 1e6, (long long)as.kv_doc_rows,
                    (long long)as.out_used, (long long)as.out_slots, (long long)as.evictions);
        }
    }
    fflush(stdout);
    kvzip_session_close(ss);
    kvzip_store_close(st);
    kvzip_model_close(m);
    free(doc);
    free(questions);
    free(docs);
    return rc ? cli_exit_code(rc) : 0;
}
