/* Ingest one document into a store and answer a question from its compressed cache,
 * through the installed library only:
 *
 *     cc ask.c $(pkg-config --cflags --libs kvzip) -o ask
 *     ./ask MODEL.gguf STORE_DIR DOCUMENT.md "question"
 *
 * The answer streams to stdout; the figures of the answer go to stderr. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvzip.h>

static int fail(int rc, const char *what)
{
    fprintf(stderr, "ask: %s: %s (%s)\n", what, kvzip_strerror(rc), kvzip_errdetail());
    return 1;
}

static int print_piece(void *user, const char *piece, size_t len, int32_t token)
{
    (void)user;
    (void)token;
    fwrite(piece, 1, len, stdout);
    fflush(stdout);
    return 0;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) buf[n] = 0, *len = (size_t)n;
    return buf;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: ask MODEL.gguf STORE_DIR DOCUMENT QUESTION\n");
        return 2;
    }
    size_t len;
    char *text = read_file(argv[3], &len);
    if (!text) {
        perror(argv[3]);
        return 1;
    }
    const char *id = strrchr(argv[3], '/') ? strrchr(argv[3], '/') + 1 : argv[3];

    kvzip_model_opts mo;
    kvzip_model_defaults(&mo);
    mo.device = KVZIP_DEVICE_CPU;
    kvzip_model *m;
    kvzip_store *s;
    kvzip_session *ss;
    int rc;
    if ((rc = kvzip_model_open(argv[1], &mo, &m))) return fail(rc, "cannot load the model");
    if ((rc = kvzip_store_open(argv[2], KVZIP_STORE_CREATE, m, &s))) return fail(rc, "cannot open the store");
    kvzip_ingest_result r;
    if ((rc = kvzip_ingest(m, s, id, text, len, NULL, &r))) return fail(rc, "ingest failed");
    fprintf(stderr, "ask: %s: %lld tokens, %lld of %lld context KV pairs kept, %.1f s\n", id,
            (long long)r.tokens, (long long)r.pairs_kept, (long long)r.pairs_total, r.seconds);
    if ((rc = kvzip_session_open(m, s, id, NULL, &ss))) return fail(rc, "cannot load the document");
    kvzip_answer_stats st;
    if ((rc = kvzip_ask(ss, argv[4], print_piece, NULL, NULL, &st))) return fail(rc, "no answer");
    printf("\n");
    fprintf(stderr, "ask: %d answer tokens, first after %.3f s; KV held %.2f MB, output cache %lld of "
            "%lld slots\n", st.answer_tokens, st.ttft_s, st.kv_bytes_held / 1e6, (long long)st.out_used,
            (long long)st.out_slots);
    kvzip_session_close(ss);
    kvzip_store_close(s);
    kvzip_model_close(m);
    free(text);
    return 0;
}
