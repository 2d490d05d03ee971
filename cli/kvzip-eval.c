/* kvzip-eval: KVzip against eviction baselines on a question/answer set (DESIGN §6,
 * docs/EVAL.md). A thin CLI: options, messages and exit codes. The evaluation itself
 * (baselines, caches, scoring, answers, tables, result files) is the eval module,
 * ingest/kvz_eval.h (single documents) and ingest/kvz_eval_multidoc.h (--multidoc). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_util.h"
#include "kvz_error.h"
#include "kvz_eval.h"
#include "kvz_eval_multidoc.h"
#include "kvz_kvrow.h"

static void usage(void)
{
    printf(
        "usage: kvzip-eval [options] FILE.jsonl\n"
        "       kvzip-eval --multidoc [options] --out RESULTS.jsonl FILE.jsonl\n"
        "                  (questions over several composed documents: kvzip-eval --multidoc --help)\n"
        "\n"
        "Evaluates KVzip compression against eviction baselines at equal ratios.\n"
        "FILE.jsonl has one object per line: {\"doc\": PATH, \"question\": ..., \"answer\": ...,\n"
        "\"accept\": [...]} (PATH relative to the file's folder; \"accept\" optional, default\n"
        "[answer]). Each document is scored once with KVzip; every question is answered\n"
        "greedily from the full cache once and from each compressed cache, all in memory.\n"
        "\n"
        "Per method and ratio (fraction of context KV pairs kept; the system prefix is\n"
        "always kept) it reports, over the questions:\n"
        "  agreement  greedy answer token-for-token equal to the full cache's answer\n"
        "  accuracy   answer contains any \"accept\" string (case-insensitive)\n"
        "  dNLL       mean NLL of the reference answer tokens (teacher-forced after the\n"
        "             question) minus the same on the full cache\n"
        "  KV MB      K+V of the cache the question was answered from, counted at\n"
        "             fp16, prefix included; mean over questions\n"
        "\n"
        "Methods: kvzip (global threshold over all layers x heads, DESIGN §3) plus\n"
        "  random     per-head uniform: each (layer, KV head) keeps round(n*r) context\n"
        "             tokens drawn uniformly at random (--seed)\n"
        "  window     per head: the first 4 context tokens (sinks) + the most recent ones\n"
        "  snapkv     query-aware: attention of the question+postfix tokens to the\n"
        "             context on the full cache (softmax over all visible keys, summed\n"
        "             over the window queries, max over the GQA group, max-pool 7 over\n"
        "             tokens), per-head top-k; compressed per question with that question.\n"
        "             Also 'snapkv-q1': for documents with >= 3 questions, compress once\n"
        "             with question 1 and answer questions 2..n (multi-query table).\n"
        "Ratio 1.0 keeps everything, so every method's cache is the same; it is\n"
        "evaluated once (as kvzip) and the result is shared.\n"
        "\n"
        "Options:\n"
        "  --ratios LIST      comma-separated ratios in (0, 1] (default 1,0.5,0.3,0.2,0.1)\n"
        "  --baselines LIST   any of random,window,snapkv, or none (default all)\n"
        "  --docs LIST        only these documents (file names, or prefixes of them)\n"
        "  --limit N          only the first N questions (after --docs)\n"
        "  --per-doc N        only the first N questions of each document\n"
        "  --max-tokens N     greedy answer length limit (default 48; stops on <|im_end|>)\n"
        "  --seed N           random-eviction seed (default 1)\n"
        "  --kv-dtype T       pass every compressed cache's kept K/V rows through the\n"
        "                     stored type T (f32, f16, bf16, q8, q4: encode + decode with\n"
        "                     the same row codecs as kvzip-ingest/the loader); default:\n"
        "                     none (fp32 as computed). The full cache stays fp32.\n"
        "  --json FILE        full results (summary rows and every answer) as JSON\n"
        "  --plot FILE.png    accuracy and agreement vs ratio, one line per method\n"
        "                     (runs gnuplot, pngcairo terminal)\n"
        "  --model PATH|NAME  GGUF model, or a name fetched by scripts/fetch-model\n"
        "                     (default: $KVZ_MODEL or %s)\n"
        "  --threads N        CPU threads (default: all cores). The evaluation runs on the\n"
        "                     CPU backend (its scoring hooks read host KV views).\n"
        "  -q, --quiet        no progress on stderr\n"
        "  -h, --help         this text\n"
        "\n"
        "Output: a markdown table on stdout (rows method x ratio), progress on stderr.\n"
        "Exit status: 0 ok, 2 usage, 3 bad input file or document, 4 model problem,\n"
        "6 file not found, 1 other errors (plot failure included).\n",
        KVZ_DEFAULT_MODEL);
}

static void md_usage(void)
{
    printf(
        "usage: kvzip-eval --multidoc [options] --out RESULTS.jsonl FILE.jsonl\n"
        "\n"
        "Multi-document mode: questions asked over several documents composed into one\n"
        "context. FILE.jsonl has one object per line:\n"
        "  {\"id\": ID, \"kind\": \"long\"|\"retrieval\"|\"cross\", \"docs\": [DOC, ...],\n"
        "   \"question\": ..., \"answer\": ..., \"accept\": [...], \"oracle\": ORACLE}\n"
        "DOC is a file path relative to --root; a document longer than one part\n"
        "(--part-tokens) is cut into parts as kvzip-ingest cuts it, and DOC means all of\n"
        "its parts in order, DOC#N part N. ORACLE (optional) is the context that holds\n"
        "the answer: a part number (of the one split document in docs), an id from docs,\n"
        "or an array of ids from docs. \"accept\" as in the single-document mode.\n"
        "\n"
        "Each part is scored once with KVzip and kept in memory; per ratio each part is\n"
        "selected on its own (global threshold over its layers x heads x tokens, as\n"
        "kvzip-ingest stores it) and the selected caches are composed as kvz_docs_load\n"
        "composes stored ones. Methods (each question is answered once per method and\n"
        "ratio; greedy answer + teacher-forced NLL of the reference answer):\n"
        "  sequential  all docs, each after the previous one (keys re-rotated by RoPE)\n"
        "  parallel    all docs at their own positions after the prefix (APE style)\n"
        "  oracle      only the oracle context (sequential if it is several parts/docs)\n"
        "A composition of one part is the same cache in both placements, and the oracle\n"
        "equal to docs is the sequential cache: such answers are computed once.\n"
        "\n"
        "Every answer is appended to RESULTS.jsonl as one line when it is measured\n"
        "(id, kind, method, ratio, placement, answer, tokens, correct, nll, ...); a\n"
        "rerun with the same --out skips what is recorded (an interrupted last line is\n"
        "dropped), so a long run resumes. The file's first line binds it to the model,\n"
        "--max-tokens, --key-scale and --part-tokens. At the end a markdown table per\n"
        "kind is printed from all records of the selected questions: accuracy, correct\n"
        "vs the oracle's, agreement with the oracle's answer, ΔNLL vs the oracle.\n"
        "\n"
        "Options:\n"
        "  --out FILE         results, one JSON line per answer (required)\n"
        "  --root DIR         folder the DOC paths are relative to (default: FILE's folder)\n"
        "  --ratios LIST      comma-separated, in (0, 1], run in this order (default 1,0.3,0.2)\n"
        "  --methods LIST     any of sequential,parallel,oracle (default all)\n"
        "  --kinds LIST       any of long,retrieval,cross (default all)\n"
        "  --ids LIST         only these question ids\n"
        "  --limit N          only the first N questions (after --kinds/--ids)\n"
        "  --max-tokens N     greedy answer length limit (default 48)\n"
        "  --part-tokens N    split documents into parts of at most N tokens (default and\n"
        "                     maximum: what kvzip-ingest uses for the model)\n"
        "  --key-scale S      multiply every document key by S (APE-style attention\n"
        "                     temperature 1/S; default 1 = off)\n"
        "  --report           print the tables from --out without running the model\n"
        "  --model, --threads, -q/--quiet, -h/--help as in the single-document mode\n"
        "\n"
        "Exit status: 0 ok, 2 usage (also --out written with other settings), 3 bad\n"
        "input line (malformed, a document named twice, a bad oracle, part out of\n"
        "range) or results file, 4 model problem, 6 FILE or a document not found,\n"
        "1 other errors.\n");
}

/* Progress and warnings from the eval module: one escaped line each on stderr. A
 * terminal gets the scoring percentage on one line that the next message replaces. */
static int g_progress_open;

static void log_line(void *ctx, const char *line)
{
    (void)ctx;
    fprintf(stderr, "%s%s\n", g_progress_open ? "\r" : "", cli_escape(line));
    g_progress_open = 0;
}

static int progress(void *ctx, int64_t done, int64_t total)
{
    (void)ctx;
    if (!isatty(2)) return 0;
    fprintf(stderr, "\r  scoring %3d%%", (int)(100 * done / (total ? total : 1)));
    g_progress_open = 1;
    return 0;
}

/* Print a module error; returns the exit code (docs/ERRORS.md). */
static int fail(const kvz_eval_error *er)
{
    if (er->with_detail) cli_error(er->rc, "%s", er->msg);
    else fprintf(stderr, "%s: error: %s\n", cli_prog, cli_escape(er->msg));
    if (!er->input) return cli_exit_code(er->rc);
    return er->rc == KVZ_ERR_NOTFOUND ? EXIT_NOTFOUND : er->rc == KVZ_ERR_ARG ? EXIT_USAGE : EXIT_INPUT;
}

/* A usage error (exit 2) when a list option's parser refused it. */
static void check_list(int rc)
{
    if (rc == KVZ_ERR_NOMEM) { cli_error(rc, "options"); exit(EXIT_FAIL); }
    if (rc) cli_usage_error("%s", kvz_error_detail());
}

static int md_main(int argc, char **argv)
{
    kvz_eval_md_opts o = {.max_tokens = 48, .key_scale = 1.0f, .use_kind = {1, 1, 1}};
    const char *qa_path = NULL, *model_flag = NULL;
    const char *ratios_s = "1,0.3,0.2", *methods_s = "sequential,parallel,oracle", *kinds_s = NULL;
    long threads = 0;
    int quiet = 0, report = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { md_usage(); return 0; }
        else if (!strcmp(a, "--multidoc")) continue;
        else if (!strcmp(a, "--out")) o.out_path = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--root")) o.root = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--ratios")) ratios_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--methods")) methods_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--kinds")) kinds_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--ids")) o.ids = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--limit")) o.limit = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1 << 30);
        else if (!strcmp(a, "--max-tokens")) o.max_tokens = (int)cli_parse_long(a, cli_value(argc, argv, &i), 1, 4096);
        else if (!strcmp(a, "--part-tokens")) o.part_tokens = (int32_t)cli_parse_long(a, cli_value(argc, argv, &i), 16, 1 << 30);
        else if (!strcmp(a, "--key-scale")) o.key_scale = (float)cli_parse_double(a, cli_value(argc, argv, &i), 0.01, 100.0);
        else if (!strcmp(a, "--model")) model_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--threads")) threads = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "--report")) report = 1;
        else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) quiet = 1;
        else if (a[0] == '-' && a[1]) cli_usage_error("unknown option '%s' in --multidoc mode", a);
        else if (qa_path) cli_usage_error("only one FILE.jsonl may be given");
        else qa_path = a;
    }
    if (!qa_path) cli_usage_error("no FILE.jsonl given");
    if (!o.out_path) cli_usage_error("--multidoc needs --out RESULTS.jsonl (answers are recorded there as they are measured)");
    double *ratios = NULL;
    check_list(kvz_eval_parse_ratios(ratios_s, &ratios, &o.n_ratios));
    o.ratios = ratios;
    check_list(kvz_eval_md_parse_methods(methods_s, o.use));
    if (kinds_s) check_list(kvz_eval_md_parse_kinds(kinds_s, o.use_kind));
    if (o.ids && !o.ids[strspn(o.ids, ",")]) cli_usage_error("--ids is empty");
    kvz_eval_io io = {.log = log_line, .read_text = cli_read_text, .quiet = quiet};
    kvz_eval_md *d = NULL;
    kvz_eval_error er = {0};
    kvz_model *m = NULL;
    char *qa_text = NULL;
    size_t qa_len = 0;
    const char *model_path = cli_model_path(model_flag);
    int rc = cli_read_text(qa_path, (size_t)64 << 20, &qa_text, &qa_len), code = 0;
    if (rc) {
        cli_error(rc, "cannot read %s", qa_path);
        code = cli_exit_code(rc);
    } else if ((rc = kvz_eval_md_create(&o, &io, &d))) {
        cli_error(rc, "multi-document evaluation");
        code = cli_exit_code(rc);
    } else if (kvz_eval_md_add_questions(d, qa_path, qa_text, qa_len, &er)) {
        code = fail(&er);
    } else if ((rc = cli_load_model(model_path, NULL, KVZ_DEVICE_CPU, (int32_t)threads, &m))) {
        code = cli_exit_code(rc);
    } else if (kvz_eval_md_open_results(d, m, model_path, &er) || (!report && kvz_eval_md_run(d, &er))) {
        code = fail(&er);
    } else {
        kvz_eval_md_write_tables(d, stdout);
    }
    free(qa_text);
    free(ratios);
    kvz_eval_md_free(d);
    kvz_model_free(m);
    return code;
}

int main(int argc, char **argv)
{
    cli_init("kvzip-eval", argv);
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--multidoc")) return md_main(argc, argv);
        else if (!strcmp(argv[i], "--")) break;
    kvz_eval_opts o = {.max_tokens = 48, .seed = 1, .kv_dtype = -1};
    const char *qa_path = NULL, *model_flag = NULL, *json_path = NULL, *plot_path = NULL;
    const char *ratios_s = "1,0.5,0.3,0.2,0.1", *baselines_s = "random,window,snapkv", *docs_s = NULL;
    long limit = 0, per_doc = 0, threads = 0;
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        else if (!strcmp(a, "--ratios")) ratios_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--baselines")) baselines_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--docs")) docs_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--limit")) limit = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1 << 30);
        else if (!strcmp(a, "--per-doc")) per_doc = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1 << 30);
        else if (!strcmp(a, "--max-tokens")) o.max_tokens = (int)cli_parse_long(a, cli_value(argc, argv, &i), 1, 4096);
        else if (!strcmp(a, "--seed")) o.seed = (uint64_t)cli_parse_long(a, cli_value(argc, argv, &i), 0, 0x7fffffffL);
        else if (!strcmp(a, "--json")) json_path = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--plot")) plot_path = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--model")) model_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--threads")) threads = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) quiet = 1;
        else if (!strcmp(a, "--kv-dtype")) {
            const char *v = cli_value(argc, argv, &i);
            const kvz_kvrow_codec *kc = kvz_kvrow_codec_find(v);
            if (!kc) cli_usage_error("--kv-dtype expects f32, f16, bf16, q8 or q4, got '%s'", v);
            o.kv_dtype = kc->dtype;
        }
        else if (a[0] == '-' && a[1]) cli_usage_error("unknown option '%s'", a);
        else if (qa_path) cli_usage_error("only one FILE.jsonl may be given");
        else qa_path = a;
    }
    if (!qa_path) cli_usage_error("no FILE.jsonl given");
    double *ratios = NULL;
    check_list(kvz_eval_parse_ratios(ratios_s, &ratios, &o.n_ratios));
    o.ratios = ratios;
    check_list(kvz_eval_parse_baselines(baselines_s, o.use));
    if (docs_s && !docs_s[strspn(docs_s, ",")]) cli_usage_error("--docs is empty");
    kvz_eval_io io = {.log = log_line, .progress = progress, .read_text = cli_read_text, .quiet = quiet};
    kvz_eval *e = NULL;
    kvz_eval_error er = {0};
    kvz_model *m = NULL;
    char *qa_text = NULL;
    size_t qa_len = 0;
    const char *model_path = cli_model_path(model_flag);
    int rc = cli_read_text(qa_path, (size_t)64 << 20, &qa_text, &qa_len), code = 0;
    if (rc) {
        cli_error(rc, "cannot read %s", qa_path);
        code = cli_exit_code(rc);
    } else if ((rc = kvz_eval_create(&o, &io, &e))) {
        cli_error(rc, "evaluation");
        code = cli_exit_code(rc);
    } else if (kvz_eval_add_questions(e, qa_path, qa_text, qa_len, docs_s, limit, per_doc, &er)) {
        code = fail(&er);
    } else if ((rc = cli_load_model(model_path, NULL, KVZ_DEVICE_CPU, (int32_t)threads, &m))) {
        code = cli_exit_code(rc);
    } else if (kvz_eval_run(e, m, &er)) {
        code = fail(&er);
    } else {
        kvz_eval_write_tables(e, stdout);
        fflush(stdout);
        if (json_path && (rc = kvz_eval_write_json(e, json_path, model_path, qa_path))) {
            cli_error(rc, "cannot write --json");
            code = EXIT_FAIL;
        }
        if (plot_path && (rc = kvz_eval_write_plot(e, plot_path))) {
            cli_error(rc, "cannot write --plot");
            code = EXIT_FAIL;
        }
    }
    free(qa_text);
    free(ratios);
    kvz_eval_free(e);
    kvz_model_free(m);
    return code;
}
