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
#include "kvz_shard.h"
#include "kvzip-eval.help.h" /* cli_help, cli_help_multidoc: from cli/help/kvzip-eval*.txt */

static void usage(void) { fputs(cli_help, stdout); }

static void md_usage(void) { fputs(cli_help_multidoc, stdout); }

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

/* --device D as kvzip-ingest's (kvz_device_parse: cpu, cuda, cuda:K, auto) */
static int32_t g_device = KVZ_DEVICE_CPU, g_ordinal = -1;
static const char *g_device_s = "cpu";

/* Load the model on --device (cuda:K is selected before anything touches CUDA); the
 * error is printed. Returns the exit code: 0, 4 when no GPU is usable, else the model's. */
static int load_model(const char *path, long threads, kvz_model **m)
{
    int rc = g_ordinal >= 0 ? kvz_device_select(g_ordinal) : 0;
    if (rc) cli_error(rc, "--device %s", g_device_s);
    else rc = cli_load_model(path, NULL, g_device, (int32_t)threads, m);
    return rc == KVZ_ERR_NODEV ? EXIT_MODEL : cli_exit_code(rc);
}

static int device_opt(const char *a, int argc, char **argv, int *i)
{
    if (strcmp(a, "--device")) return 0;
    if (kvz_device_parse(g_device_s = cli_value(argc, argv, i), &g_device, &g_ordinal))
        cli_usage_error("%s", kvz_error_detail());
    return 1;
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
        else if (device_opt(a, argc, argv, &i)) continue;
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
    } else if ((code = load_model(model_path, threads, &m))) {
        /* printed by load_model */
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
        else if (device_opt(a, argc, argv, &i)) continue;
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
    } else if ((code = load_model(model_path, threads, &m))) {
        /* printed by load_model */
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
