/* libFuzzer target for the eval module's parsers of outside input (ingest/kvz_eval.h,
 * ingest/kvz_eval_multidoc.h). Byte 0 picks the parser, the rest is its input:
 *   0  one question line of kvzip-eval (kvz_eval_parse_qa)
 *   1  a --multidoc question file (kvz_eval_md_add_questions; DOC paths under
 *      tests/fuzz/eval_docs, so "a.md" exists)
 *   2  a --multidoc results file (kvz_eval_md_read_results, from a temporary file)
 *   3  kvz_eval_json_str, read back by jansson: valid UTF-8 without NUL must come back
 *      byte for byte, anything else must still be a JSON string
 * Every input must give 0 or its documented error code (with a message), never crash,
 * leak or over-read. Built by CMake with -DKVZ_FUZZ=ON (CC=clang). */
#include "kvz_error.h"
#include "kvz_eval.h"
#include "kvz_eval_multidoc.h"

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int no_reader(const char *path, size_t max, char **out, size_t *len)
{
    (void)path; (void)max; (void)out; (void)len;
    return KVZ_ERR_IO;
}

static int md_rc_ok(int rc, const kvz_eval_error *er)
{
    if (rc == 0) return 1;
    return (rc == KVZ_ERR_FORMAT || rc == KVZ_ERR_NOTFOUND || rc == KVZ_ERR_ARG || rc == KVZ_ERR_NOMEM ||
            rc == KVZ_ERR_IO) && er->rc == rc && er->msg[0];
}

static kvz_eval_md *new_md(const char *out_path)
{
    static char root[4096];
    if (!root[0]) {
        const char *src = getenv("KVZ_SOURCE_DIR");
        snprintf(root, sizeof root, "%s/tests/fuzz/eval_docs", src ? src : ".");
    }
    kvz_eval_md_opts o = {.ratios = (double[]){1.0}, .n_ratios = 1, .use = {1, 1, 1}, .use_kind = {1, 1, 1},
                          .root = root, .max_tokens = 8, .key_scale = 1.0f, .out_path = out_path};
    kvz_eval_io io = {.read_text = no_reader};
    kvz_eval_md *d = NULL;
    return kvz_eval_md_create(&o, &io, &d) ? NULL : d;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    const char *in = (const char *)data + 1;
    const size_t n = size - 1;
    switch (data[0] & 3) {
    case 0: {
        kvz_eval_qa q;
        const char *why = NULL;
        int rc = kvz_eval_parse_qa(in, n, &q, &why);
        if (rc == 0) {
            if (!q.doc[0] || !q.question[0] || !q.answer[0] || q.n_accept < 1) abort();
            kvz_eval_qa_free(&q);
        } else if ((rc != KVZ_ERR_FORMAT && rc != KVZ_ERR_NOMEM) || !why || q.doc) {
            abort();
        }
        break;
    }
    case 1: {
        kvz_eval_md *d = new_md("unused.jsonl");
        kvz_eval_error er = {0};
        if (d && !md_rc_ok(kvz_eval_md_add_questions(d, "q.jsonl", in, n, &er), &er)) abort();
        kvz_eval_md_free(d);
        break;
    }
    case 2: {
        char path[64];
        snprintf(path, sizeof path, "/tmp/fuzz_eval_%d.jsonl", (int)getpid());
        FILE *f = fopen(path, "wb");
        if (!f) return 0;
        fwrite(in, 1, n, f);
        fclose(f);
        kvz_eval_md *d = new_md(path);
        kvz_eval_error er = {0};
        const char *header = "{\"kvzip_eval_multidoc\": 1, \"model\": \"m.gguf\", \"max_tokens\": 8, "
                             "\"key_scale\": 1, \"part_tokens\": 512}";
        if (d && !md_rc_ok(kvz_eval_md_read_results(d, header, &er), &er)) abort();
        kvz_eval_md_free(d);
        unlink(path);
        break;
    }
    default: {
        char *s = malloc(n + 1);
        if (!s) return 0;
        memcpy(s, in, n);
        s[n] = 0;
        char *buf = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&buf, &len);
        if (!f) { free(s); return 0; }
        kvz_eval_json_str(f, s);
        fclose(f);
        json_error_t err;
        json_t *v = json_loadb(buf, len, JSON_DECODE_ANY, &err);
        if (!json_is_string(v)) abort();
        /* valid UTF-8 (checked by jansson itself) must come back unchanged */
        json_t *ref = json_stringn(s, strlen(s));
        if (ref && strcmp(json_string_value(v), s)) abort();
        json_decref(ref);
        json_decref(v);
        free(buf);
        free(s);
        break;
    }
    }
    return 0;
}
