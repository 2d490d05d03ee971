/* The eval module's parsers of outside input, on malformed input: question lines
 * (single-document and --multidoc), the --multidoc results file, the option lists, and
 * the JSON string writer (read back by jansson, the independent decoder). Every bad
 * input must give its error code and a message naming file and line, never a crash,
 * and a results file is never cut back unless its last line is an interrupted one. */
#include "kvz_test.h"

#include <jansson.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvz_error.h"
#include "kvz_eval.h"
#include "kvz_eval_multidoc.h"

static char g_dir[256];
static int g_warnings;

static void count_log(void *ctx, const char *line)
{
    (void)ctx;
    g_warnings += strstr(line, "dropping an incomplete last line") != NULL;
}

/* never called: these tests stop before any document is read */
static int no_reader(const char *path, size_t max, char **out, size_t *len)
{
    (void)path; (void)max; (void)out; (void)len;
    return kvz_error_set(KVZ_ERR_IO, "not in this test");
}

static int qa_rc(const char *line, const char **why)
{
    kvz_eval_qa q;
    int rc = kvz_eval_parse_qa(line, strlen(line), &q, why);
    if (rc == 0) kvz_eval_qa_free(&q);
    else CHECKF(q.doc == NULL && q.accept == NULL && q.n_accept == 0, "q zeroed on failure: %s", line);
    return rc;
}

static void test_qa_lines(void)
{
    const char *why = "";
    kvz_eval_qa q;
    const char *ok = "{\"doc\": \"a.md\", \"question\": \"Q?\", \"answer\": \"forty\"}";
    CHECK(kvz_eval_parse_qa(ok, strlen(ok), &q, &why) == 0);
    CHECK(q.n_accept == 1 && !strcmp(q.accept[0], "forty") && !strcmp(q.doc, "a.md"));
    kvz_eval_qa_free(&q);
    const char *acc = "{\"doc\": \"a.md\", \"question\": \"Q?\", \"answer\": \"40\", \"accept\": [\"forty\", \"40\"]}";
    CHECK(kvz_eval_parse_qa(acc, strlen(acc), &q, &why) == 0 && q.n_accept == 2 && !strcmp(q.accept[0], "forty"));
    kvz_eval_qa_free(&q);

    struct { const char *line, *why; } bad[] = {
        {"{\"doc\": \"a.md\", \"question\": \"Q?\"", "not a JSON object"},                     /* truncated */
        {"{\"doc\": \"a.md\", \"question\": \"Q?\", \"answer\": \"x\"} tail", "text after the object"},
        {"{\"doc\": 5, \"question\": \"Q?\", \"answer\": \"x\"}", "\"doc\", \"question\" and \"answer\" must be strings"},
        {"{\"doc\": \"a\", \"question\": [\"Q?\"], \"answer\": \"x\"}", "\"doc\", \"question\" and \"answer\" must be strings"},
        {"{\"doc\": {\"x\": [[{\"y\": null}]]}, \"question\": \"q\", \"answer\": \"x\"}",
         "\"doc\", \"question\" and \"answer\" must be strings"},                                 /* nested junk */
        {"{\"doc\": \"a\", \"question\": \"q\"}", "missing \"doc\", \"question\" or \"answer\""},
        {"{\"doc\": \"\", \"question\": \"q\", \"answer\": \"x\"}", "empty \"doc\", \"question\" or \"answer\""},
        {"{\"doc\": \"a\", \"question\": \"q\", \"answer\": \"x\", \"accept\": \"x\"}", "\"accept\" must be an array of strings"},
        {"{\"doc\": \"a\", \"question\": \"q\", \"answer\": \"x\", \"accept\": [1]}", "\"accept\" must be an array of strings"},
        {"{\"doc\": \"a\", \"question\": \"q\", \"answer\": \"x\", \"accept\": [123456789012345678901234567890]}",
         "not a JSON object"},                                                                    /* huge integer */
        {"{\"doc\": \"a\", \"question\": \"q\", \"answer\": \"x\", \"n\": 1e999}", "not a JSON object"}, /* huge real */
        {"{\"doc\": \"a\xff\", \"question\": \"q\", \"answer\": \"x\"}", "not a JSON object"},  /* invalid UTF-8 */
        {"{\"doc\": \"a\xc0\xaf\", \"question\": \"q\", \"answer\": \"x\"}", "not a JSON object"}, /* overlong */
        {"{\"doc\": \"a\\u0000b\", \"question\": \"q\", \"answer\": \"x\"}", "not a JSON object"}, /* NUL */
        {"[1, 2]", "not a JSON object"},
        {"\"doc\"", "not a JSON object"},
        {"", "not a JSON object"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = qa_rc(bad[i].line, &why);
        CHECKF(rc == KVZ_ERR_FORMAT && !strcmp(why, bad[i].why), "line %zu: rc %d why '%s'", i, rc, why);
    }
    /* every proper prefix of a valid line is refused */
    int prefix_ok = 1;
    for (size_t k = 0; k < strlen(acc); k++) {
        kvz_eval_qa p;
        if (kvz_eval_parse_qa(acc, k, &p, &why) != KVZ_ERR_FORMAT) prefix_ok = 0;
    }
    CHECK(prefix_ok);
    /* 20,000 nested arrays: jansson's depth limit, not the stack */
    size_t n = 20000;
    char *deep = malloc(2 * n + 1);
    if (!deep) { CHECK(0); return; }
    memset(deep, '[', n);
    memset(deep + n, ']', n);
    deep[2 * n] = 0;
    CHECK(qa_rc(deep, &why) == KVZ_ERR_FORMAT);
    free(deep);
    /* every single-byte change of a valid line: 0 with non-empty fields, or FORMAT */
    char buf[256];
    int flips_ok = 1;
    for (size_t i = 0; i < strlen(acc); i++)
        for (int b = 0; b < 256; b += 7) {
            strcpy(buf, acc);
            buf[i] = (char)b;
            kvz_eval_qa p;
            int rc = kvz_eval_parse_qa(buf, strlen(acc), &p, &why);
            if (rc == 0) {
                flips_ok &= p.doc[0] && p.question[0] && p.answer[0] && p.n_accept >= 1;
                kvz_eval_qa_free(&p);
            } else flips_ok &= rc == KVZ_ERR_FORMAT;
        }
    CHECK(flips_ok);
}

static void test_qa_file(void)
{
    char path[512];
    kvz_test_path(path, sizeof path, "samples/questions.jsonl");
    kvz_eval_opts o = {.ratios = (double[]){1.0}, .n_ratios = 1, .max_tokens = 8, .kv_dtype = -1};
    kvz_eval_io io = {.read_text = no_reader};
    kvz_eval *e = NULL;
    kvz_eval_error er = {0};
    if (kvz_eval_create(&o, &io, &e)) { CHECK(0); return; }
    const char *text = "{\"doc\": \"halcyon_warranty_returns.md\", \"question\": \"q\", \"answer\": \"a\"}\n"
                       "\n"
                       "{\"doc\": \"halcyon_warranty_returns.md\", \"question\": \"q\"\n";
    int rc = kvz_eval_add_questions(e, path, text, strlen(text), NULL, 0, 0, &er);
    char want[600];
    snprintf(want, sizeof want, "%s:3: not a JSON object", path);
    CHECKF(rc == KVZ_ERR_FORMAT && er.input && !er.with_detail && !strcmp(er.msg, want), "msg '%s'", er.msg);
    kvz_eval_free(e);

    e = NULL;
    if (kvz_eval_create(&o, &io, &e)) { CHECK(0); return; }
    text = "{\"doc\": \"no_such_document.md\", \"question\": \"q\", \"answer\": \"a\"}\n";
    rc = kvz_eval_add_questions(e, path, text, strlen(text), NULL, 0, 0, &er);
    CHECKF(rc == KVZ_ERR_NOTFOUND && er.input && strstr(er.msg, "no_such_document.md not found"), "msg '%s'", er.msg);
    kvz_eval_free(e);

    e = NULL;
    if (kvz_eval_create(&o, &io, &e)) { CHECK(0); return; }
    text = "{\"doc\": \"halcyon_warranty_returns.md\", \"question\": \"q\", \"answer\": \"a\"}\n";
    rc = kvz_eval_add_questions(e, path, text, strlen(text), "lab_b214", 0, 0, &er);
    CHECKF(rc == KVZ_ERR_NOTFOUND && strstr(er.msg, "--docs: no question"), "msg '%s'", er.msg);
    kvz_eval_free(e);

    e = NULL;
    if (kvz_eval_create(&o, &io, &e)) { CHECK(0); return; }
    rc = kvz_eval_add_questions(e, path, "\n \n", 3, NULL, 0, 0, &er);
    CHECKF(rc == KVZ_ERR_EMPTY && strstr(er.msg, "has no questions"), "msg '%s'", er.msg);
    kvz_eval_free(e);
}

/* One --multidoc question line against samples/; returns rc, message in er. */
static int md_line(const char *line, kvz_eval_error *er)
{
    char root[512];
    kvz_eval_md_opts o = {.ratios = (double[]){1.0}, .n_ratios = 1, .use = {1, 1, 1}, .use_kind = {1, 1, 1},
                          .root = kvz_test_path(root, sizeof root, "samples"), .max_tokens = 8,
                          .key_scale = 1.0f, .out_path = "unused.jsonl"};
    kvz_eval_io io = {.read_text = no_reader};
    kvz_eval_md *d = NULL;
    if (kvz_eval_md_create(&o, &io, &d)) return 1;
    memset(er, 0, sizeof *er);
    int rc = kvz_eval_md_add_questions(d, "q.jsonl", line, strlen(line), er);
    kvz_eval_md_free(d);
    return rc;
}

static void test_md_lines(void)
{
#define A "\"halcyon_warranty_returns.md\""
    kvz_eval_error er;
    CHECK(md_line("{\"id\": \"a\", \"kind\": \"long\", \"docs\": [" A "], \"question\": \"q\", \"answer\": \"x\"}", &er) == 0);
    struct { const char *line; int rc; const char *msg; } bad[] = {
        {"{\"id\": \"a\", \"kind\": \"long\", \"docs\": [" A "], \"question\": \"q\"", KVZ_ERR_FORMAT,
         "q.jsonl:1: not a JSON object"},
        {"{\"id\": 5, \"kind\": \"long\", \"docs\": [" A "], \"question\": \"q\", \"answer\": \"x\"}", KVZ_ERR_FORMAT,
         "must be non-empty strings"},
        {"{\"id\": \"a\", \"kind\": 7, \"docs\": [" A "], \"question\": \"q\", \"answer\": \"x\"}", KVZ_ERR_FORMAT,
         "must be non-empty strings"},
        {"{\"id\": \"a\", \"kind\": \"long\", \"docs\": " A ", \"question\": \"q\", \"answer\": \"x\"}", KVZ_ERR_FORMAT,
         "\"docs\" must be an array of 1 to"},
        {"{\"id\": \"a\", \"kind\": \"long\", \"docs\": [], \"question\": \"q\", \"answer\": \"x\"}", KVZ_ERR_FORMAT,
         "\"docs\" must be an array of 1 to"},
        {"{\"id\": \"a\", \"kind\": \"long\", \"docs\": [[" A "]], \"question\": \"q\", \"answer\": \"x\"}", KVZ_ERR_FORMAT,
         "\"docs\" must hold non-empty strings"},
        {"{\"id\": \"a\", \"kind\": \"long\", \"docs\": [" A "], \"question\": \"q\", \"answer\": \"x\", \"accept\": {}}",
         KVZ_ERR_FORMAT, "\"accept\" must be an array of strings"},
        {"{\"id\": \"a\", \"kind\": \"long\", \"docs\": [" A "], \"question\": \"q\", \"answer\": \"x\", \"oracle\": 1.5}",
         KVZ_ERR_FORMAT, "\"oracle\" must be"},
        {"{\"id\": \"a\", \"kind\": \"long\", \"docs\": [" A "], \"question\": \"q\", \"answer\": \"x\", \"oracle\": -1}",
         KVZ_ERR_FORMAT, "\"oracle\" must be"},
        {"{\"id\": \"a\", \"kind\": \"long\", \"docs\": [" A "], \"question\": \"q\", \"answer\": \"x\", "
         "\"oracle\": 99999999999999999999999}", KVZ_ERR_FORMAT, "q.jsonl:1: not a JSON object"},
        {"{\"id\": \"a\xfe\", \"kind\": \"long\", \"docs\": [" A "], \"question\": \"q\", \"answer\": \"x\"}",
         KVZ_ERR_FORMAT, "q.jsonl:1: not a JSON object"},
        {"{\"id\": \"a\", \"kind\": \"long\", \"docs\": [\"nope.md\"], \"question\": \"q\", \"answer\": \"x\"}",
         KVZ_ERR_NOTFOUND, "unknown document 'nope.md'"},
        {"{\"id\": \"a\", \"kind\": \"long\", \"docs\": [" A "], \"question\": \"q\", \"answer\": \"x\"}\n"
         "{\"id\": \"a\", \"kind\": \"long\", \"docs\": [" A "], \"question\": \"q\", \"answer\": \"x\"}",
         KVZ_ERR_FORMAT, "q.jsonl:2: question id 'a' given twice (also line 1)"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = md_line(bad[i].line, &er);
        CHECKF(rc == bad[i].rc && er.rc == rc && er.input && strstr(er.msg, bad[i].msg),
               "md line %zu: rc %d msg '%s'", i, rc, er.msg);
    }
#undef A
}

static void put_file(const char *path, const char *bytes, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(bytes, 1, n, f);
        fclose(f);
    }
}

static long file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) ? -1 : (long)st.st_size;
}

#define HEADER "{\"kvzip_eval_multidoc\": 1, \"model\": \"m.gguf\", \"max_tokens\": 8, \"key_scale\": 1, \"part_tokens\": 512}"
#define REC(extra) "{\"id\": \"t-1\", \"kind\": \"long\", \"method\": \"oracle\", \"ratio\": 0.3, \"correct\": true, " \
                   "\"nll\": 1.5, \"q_pos\": 700, \"rows_per_head\": 210.5, \"answer\": \"x\", \"tokens\": [1, 2]" extra "}"

/* Read @p bytes as a results file; returns rc; *n records. */
static int read_results(const char *bytes, size_t len, kvz_eval_error *er, int *n, long *size_after)
{
    char path[600];
    snprintf(path, sizeof path, "%s/results.jsonl", g_dir);
    unlink(path);
    if (bytes) put_file(path, bytes, len);
    kvz_eval_md_opts o = {.ratios = (double[]){1.0}, .n_ratios = 1, .use = {1, 1, 1}, .use_kind = {1, 1, 1},
                          .max_tokens = 8, .key_scale = 1.0f, .out_path = path};
    kvz_eval_io io = {.log = count_log, .read_text = no_reader};
    kvz_eval_md *d = NULL;
    if (kvz_eval_md_create(&o, &io, &d)) return 1;
    memset(er, 0, sizeof *er);
    int rc = kvz_eval_md_read_results(d, HEADER, er);
    *n = kvz_eval_md_n_records(d);
    *size_after = file_size(path);
    kvz_eval_md_free(d);
    return rc;
}

static void test_results_file(void)
{
    kvz_eval_error er;
    int n;
    long size;
    CHECK(read_results(NULL, 0, &er, &n, &size) == 0 && n == 0 && size == -1); /* a new file */
    const char good[] = HEADER "\n" REC("") "\n";
    CHECK(read_results(good, strlen(good), &er, &n, &size) == 0 && n == 1 && size == (long)strlen(good));
    /* a whole last record without its newline is kept */
    CHECK(read_results(good, strlen(good) - 1, &er, &n, &size) == 0 && n == 1);
    /* an interrupted last line is dropped: the file is cut back to the whole lines */
    char cut[1024];
    snprintf(cut, sizeof cut, "%s%.40s", good, REC(""));
    g_warnings = 0;
    CHECK(read_results(cut, strlen(cut), &er, &n, &size) == 0 && n == 1 && size == (long)strlen(good));
    CHECK(g_warnings == 1);
    /* the same cut line inside the file is an error, and the file is left whole */
    snprintf(cut, sizeof cut, "%s\n%.40s\n%s\n", HEADER, REC(""), REC(""));
    int rc = read_results(cut, strlen(cut), &er, &n, &size);
    CHECKF(rc == KVZ_ERR_FORMAT && er.input && strstr(er.msg, "results.jsonl:2: not a JSON object") &&
           size == (long)strlen(cut), "rc %d msg '%s' size %ld", rc, er.msg, size);
    /* another header: a usage error */
    const char other[] = "{\"kvzip_eval_multidoc\": 1, \"model\": \"m.gguf\", \"max_tokens\": 9, \"key_scale\": 1, "
                         "\"part_tokens\": 512}\n";
    rc = read_results(other, strlen(other), &er, &n, &size);
    CHECKF(rc == KVZ_ERR_ARG && er.input && strstr(er.msg, "written with other settings"), "msg '%s'", er.msg);
    /* bad records in the middle of the file: wrong types, huge numbers, invalid UTF-8, nested junk */
    const char *bad[] = {
        "{\"id\": \"t-1\", \"method\": \"oracle\", \"ratio\": 0.3, \"correct\": \"yes\", \"nll\": 1, \"q_pos\": 7, "
        "\"rows_per_head\": 2, \"tokens\": [1]}",
        "{\"id\": \"t-1\", \"method\": \"oracle\", \"ratio\": \"0.3\", \"correct\": true, \"nll\": 1, \"q_pos\": 7, "
        "\"rows_per_head\": 2, \"tokens\": [1]}",
        "{\"id\": \"t-1\", \"method\": \"best\", \"ratio\": 0.3, \"correct\": true, \"nll\": 1, \"q_pos\": 7, "
        "\"rows_per_head\": 2, \"tokens\": [1]}",
        "{\"id\": \"t-1\", \"method\": \"oracle\", \"ratio\": 0.3, \"correct\": true, \"nll\": 1, \"q_pos\": 7.5, "
        "\"rows_per_head\": 2, \"tokens\": [1]}",
        "{\"id\": \"t-1\", \"method\": \"oracle\", \"ratio\": 0.3, \"correct\": true, \"nll\": 1, \"q_pos\": 7, "
        "\"rows_per_head\": 2, \"tokens\": [1.5]}",
        "{\"id\": \"t-1\", \"method\": \"oracle\", \"ratio\": 0.3, \"correct\": true, \"nll\": 1, \"q_pos\": 7, "
        "\"rows_per_head\": 2, \"tokens\": [-1]}",
        "{\"id\": \"t-1\", \"method\": \"oracle\", \"ratio\": 0.3, \"correct\": true, \"nll\": 1, \"q_pos\": 7, "
        "\"rows_per_head\": 2, \"tokens\": [4294967296]}",
        "{\"id\": \"t-1\", \"method\": \"oracle\", \"ratio\": 0.3, \"correct\": true, \"nll\": 1e999, \"q_pos\": 7, "
        "\"rows_per_head\": 2, \"tokens\": [1]}",
        "{\"id\": \"t-1\", \"method\": \"oracle\", \"ratio\": 0.3, \"correct\": true, \"nll\": 1, "
        "\"q_pos\": 99999999999999999999999, \"rows_per_head\": 2, \"tokens\": [1]}",
        "{\"id\": \"t-\xff\", \"method\": \"oracle\", \"ratio\": 0.3, \"correct\": true, \"nll\": 1, \"q_pos\": 7, "
        "\"rows_per_head\": 2, \"tokens\": [1]}",
        "{\"id\": {\"a\": [{\"b\": [null]}]}, \"method\": \"oracle\", \"ratio\": 0.3, \"correct\": true, \"nll\": 1, "
        "\"q_pos\": 7, \"rows_per_head\": 2, \"tokens\": [1]}",
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
        "{\"id\": \"t-1\"}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[2048];
        snprintf(text, sizeof text, "%s\n%s\n%s\n", HEADER, bad[i], REC(""));
        rc = read_results(text, strlen(text), &er, &n, &size);
        CHECKF(rc == KVZ_ERR_FORMAT && er.input && strstr(er.msg, "results.jsonl:2: ") && size == (long)strlen(text),
               "record %zu: rc %d msg '%s'", i, rc, er.msg);
    }
    /* a NUL byte: refused, not cut back */
    char nul[1024];
    const int len = snprintf(nul, sizeof nul, "%s\n%s\n%s\n", HEADER, REC(""), REC(""));
    nul[strlen(HEADER) + 1 + 10] = 0;
    rc = read_results(nul, (size_t)len, &er, &n, &size);
    CHECKF(rc == KVZ_ERR_FORMAT && strstr(er.msg, "results.jsonl:2: a NUL byte") && size == len, "msg '%s'", er.msg);
}

/* kvz_eval_json_str, read back by jansson */
static void test_json_str(void)
{
    struct { const char *in, *want; } cases[] = {
        {"plain", "plain"},
        {"q\"uo\\te\n\t\r\x01\x1f", "q\"uo\\te\n\t\r\x01\x1f"},
        {"\xce\x94NLL \xe2\x82\xac \xf0\x9f\x98\x80", "\xce\x94NLL \xe2\x82\xac \xf0\x9f\x98\x80"},
        {"cut \xe2\x82", "cut \xef\xbf\xbd\xef\xbf\xbd"},          /* a character cut short */
        {"\xff\xfe ok", "\xef\xbf\xbd\xef\xbf\xbd ok"},
        {"\xc0\xaf over", "\xef\xbf\xbd\xef\xbf\xbd over"},         /* overlong */
        {"\xed\xa0\x80 surrogate", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd surrogate"},
        {"", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *buf = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&buf, &len);
        if (!f) { CHECK(0); return; }
        kvz_eval_json_str(f, cases[i].in);
        fclose(f);
        json_error_t err;
        json_t *v = json_loadb(buf, len, JSON_DECODE_ANY, &err);
        CHECKF(json_is_string(v) && !strcmp(json_string_value(v), cases[i].want), "case %zu: %s", i, buf);
        json_decref(v);
        free(buf);
    }
}

static void test_option_lists(void)
{
    double *r = NULL;
    int n = 0;
    CHECK(kvz_eval_parse_ratios("1,0.5,0.3", &r, &n) == 0 && n == 3 && r[1] == 0.5);
    free(r);
    CHECK(kvz_eval_parse_ratios("0,0.5", &r, &n) == KVZ_ERR_ARG && strstr(kvz_error_detail(), "0 is not in (0, 1]"));
    CHECK(kvz_eval_parse_ratios("0.5,0.5", &r, &n) == KVZ_ERR_ARG && strstr(kvz_error_detail(), "given twice"));
    CHECK(kvz_eval_parse_ratios("1e999", &r, &n) == KVZ_ERR_ARG);
    CHECK(kvz_eval_parse_ratios("nan", &r, &n) == KVZ_ERR_ARG);
    CHECK(kvz_eval_parse_ratios(",,", &r, &n) == KVZ_ERR_ARG && strstr(kvz_error_detail(), "empty"));
    int use[KVZ_EVAL_N_METHOD];
    CHECK(kvz_eval_parse_baselines("window,snapkv", use) == 0 && use[KVZ_EVAL_KVZIP] && use[KVZ_EVAL_WINDOW] &&
          use[KVZ_EVAL_SNAPKV_Q1] && !use[KVZ_EVAL_RANDOM]);
    CHECK(kvz_eval_parse_baselines("none", use) == 0 && use[KVZ_EVAL_KVZIP] && !use[KVZ_EVAL_SNAPKV]);
    CHECK(kvz_eval_parse_baselines("h2o", use) == KVZ_ERR_ARG && strstr(kvz_error_detail(), "'h2o'"));
    int mu[KVZ_EVAL_MD_N_METHOD];
    CHECK(kvz_eval_md_parse_methods("oracle", mu) == 0 && mu[KVZ_EVAL_MD_ORACLE] && !mu[KVZ_EVAL_MD_PARALLEL]);
    CHECK(kvz_eval_md_parse_methods("best", mu) == KVZ_ERR_ARG);
    int ku[KVZ_EVAL_MD_N_KIND];
    CHECK(kvz_eval_md_parse_kinds("cross,long", ku) == 0 && ku[0] && !ku[1] && ku[2]);
}

int main(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/kvz_eval_parse_XXXXXX");
    if (!mkdtemp(g_dir)) { fprintf(stderr, "mkdtemp failed\n"); return 1; }
    test_qa_lines();
    test_qa_file();
    test_md_lines();
    test_results_file();
    test_json_str();
    test_option_lists();
    char path[600];
    snprintf(path, sizeof path, "%s/results.jsonl", g_dir);
    unlink(path);
    rmdir(g_dir);
    return kvz_test_summary();
}
