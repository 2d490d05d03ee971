/* Single-document QA evaluation: KVzip against the random, window and SnapKV
 * baselines at equal ratios (kvz_eval.h, docs/EVAL.md, DESIGN §6).
 *
 * Data flow per document (everything in memory, no store):
 *   tokens -> kvz_kvzip_score (once; the cache then holds prefix + context = "full")
 *          -> per question on the full cache: teacher-forced pass of question +
 *             reference answer (NLL, and the SnapKV hook records the question's
 *             attention to the context), then a greedy answer
 *          -> per ratio and method: keep mask -> gather kept rows into a second
 *             cache (fp32, original positions) -> the same two passes per question. */
#include "kvz_eval.h"

#include <cblas.h>
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_kvrow.h"
#include "kvz_kvzip.h"

/* ------------------------------------------------------------------------ */
/* Shared by both modes                                                      */

int kvz_eval_scratch_init(kvz_eval_scratch *s, const kvz_model *m, int32_t max_seq)
{
    memset(s, 0, sizeof *s);
    s->logits = malloc(sizeof(float) * (size_t)max_seq * kvz_model_config(m)->n_vocab);
    s->seq = malloc(sizeof(int32_t) * (size_t)max_seq);
    if (s->logits && s->seq) return 0;
    kvz_eval_scratch_free(s);
    return kvz_error_set(KVZ_ERR_NOMEM, "answer buffers for %d tokens", max_seq);
}

void kvz_eval_scratch_free(kvz_eval_scratch *s)
{
    free(s->logits);
    free(s->seq);
    free(s->text);
    kvz_tokens_free(&s->gen);
    memset(s, 0, sizeof *s);
}

static int decode_text(const kvz_tokenizer *tok, kvz_eval_scratch *s, const kvz_tokens *t)
{
    size_t len = 0;
    for (size_t i = 0; i < t->n; i++) {
        char piece[256];
        int n = kvz_tokenizer_decode(tok, t->ids[i], piece, sizeof piece);
        if (n < 0) return n;
        if ((size_t)n > sizeof piece) n = sizeof piece;
        if (len + (size_t)n + 1 > s->text_cap) {
            size_t nc = s->text_cap * 2 + (size_t)n + 256;
            char *p = realloc(s->text, nc);
            if (!p) return KVZ_ERR_NOMEM;
            s->text = p;
            s->text_cap = nc;
        }
        memcpy(s->text + len, piece, (size_t)n);
        len += (size_t)n;
    }
    if (!s->text && !(s->text = malloc(s->text_cap = 256))) return KVZ_ERR_NOMEM;
    s->text[len] = 0;
    return 0;
}

int kvz_eval_answer_question(kvz_model *m, kvz_eval_scratch *s, kvz_kv *kv, int32_t n_doc,
                             const kvz_tokens *qt, const kvz_tokens *at, int max_tokens,
                             const kvz_layer_hook *hook, kvz_eval_answer *out)
{
    const int32_t nq = (int32_t)qt->n, na = (int32_t)at->n, V = kvz_model_config(m)->n_vocab;
    memcpy(s->seq, qt->ids, sizeof(int32_t) * (size_t)nq);
    memcpy(s->seq + nq, at->ids, sizeof(int32_t) * (size_t)na);
    int rc = kvz_forward(m, kv, s->seq, nq + na, n_doc, s->logits, KVZ_FWD_LOGITS_ALL, hook);
    kvz_kv_rollback(kv);
    if (rc) return rc;
    double nll = 0.0;
    for (int32_t k = 0; k < na; k++) {
        const float *lg = s->logits + (size_t)(nq + k - 1) * V;
        float mx = lg[0];
        for (int32_t v = 1; v < V; v++) mx = lg[v] > mx ? lg[v] : mx;
        double sum = 0.0;
        for (int32_t v = 0; v < V; v++) sum += exp((double)(lg[v] - mx));
        nll += log(sum) - (double)(lg[at->ids[k]] - mx);
    }
    out->nll = nll / na;
    s->gen.n = 0;
    kvz_gen_opts go = {.max_tokens = max_tokens, .stop_on_eos = 1};
    kvz_sampler_init(&go.sampler, 0.0f, 1.0f, 1);
    rc = kvz_generate(m, kv, qt->ids, nq, n_doc, &go, &s->gen, NULL, NULL);
    kvz_kv_rollback(kv);
    if (rc) return rc;
    if ((rc = decode_text(kvz_model_tokenizer(m), s, &s->gen))) return rc;
    out->answer = strdup(s->text);
    return out->answer ? 0 : KVZ_ERR_NOMEM;
}

int kvz_eval_contains_ci(const char *hay, const char *needle)
{
    size_t n = strlen(needle);
    if (n == 0) return 1;
    for (const char *h = hay; *h; h++) {
        size_t k = 0;
        while (k < n && h[k] && tolower((unsigned char)h[k]) == tolower((unsigned char)needle[k])) k++;
        if (k == n) return 1;
    }
    return 0;
}

/* Length of the valid UTF-8 sequence at p (1..4), 0 if invalid (RFC 3629: no
 * overlongs, surrogates or code points past U+10FFFF). */
static int utf8_len(const unsigned char *p, size_t left)
{
    const unsigned char c = p[0];
    int n = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    if (n == 0 || (size_t)n > left) return 0;
    for (int i = 1; i < n; i++)
        if ((p[i] & 0xc0) != 0x80) return 0;
    if ((c == 0xe0 && p[1] < 0xa0) || (c == 0xed && p[1] > 0x9f) || (c == 0xf0 && p[1] < 0x90) ||
        (c == 0xf4 && p[1] > 0x8f))
        return 0;
    return n;
}

void kvz_eval_json_str(FILE *f, const char *s)
{
    /* jansson's dump refuses a string with invalid UTF-8 (a greedy answer cut inside a
     * character), so valid runs go through jansson and each bad byte becomes U+FFFD:
     * the file always reads back. */
    const unsigned char *p = (const unsigned char *)s;
    const size_t len = strlen(s);
    fputc('"', f);
    for (size_t i = 0; i < len;) {
        size_t j = i;
        int n;
        while (j < len && (n = utf8_len(p + j, len - j)) > 0) j += (size_t)n;
        if (j > i) {
            json_t *v = json_stringn_nocheck(s + i, j - i);
            char *d = v ? json_dumps(v, JSON_ENCODE_ANY) : NULL;
            if (d) fwrite(d + 1, 1, strlen(d) - 2, f); /* without its quotes */
            free(d);
            json_decref(v);
        }
        if (j < len) fputs("\\ufffd", f), j++;
        i = j;
    }
    fputc('"', f);
}

int kvz_eval_split_list(const char *list, char ***out)
{
    *out = NULL;
    char *dup = strdup(list), *save = NULL;
    int n = 0;
    if (!dup) return kvz_error_set(KVZ_ERR_NOMEM, "list");
    for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char **v = realloc(*out, sizeof **out * (size_t)(n + 1));
        if (!v || !(v[n] = strdup(t))) {
            if (v) *out = v;
            kvz_eval_list_free(*out, n);
            *out = NULL;
            free(dup);
            return kvz_error_set(KVZ_ERR_NOMEM, "list");
        }
        *out = v;
        n++;
    }
    free(dup);
    return n;
}

void kvz_eval_list_free(char **v, int n)
{
    for (int i = 0; i < n; i++) free(v[i]);
    free(v);
}

int kvz_eval_parse_ratios(const char *list, double **ratios, int *n)
{
    char **v = NULL;
    int nv = kvz_eval_split_list(list, &v), rc = 0;
    *ratios = NULL;
    *n = 0;
    if (nv < 0) return nv;
    if (nv == 0) return kvz_error_set(KVZ_ERR_ARG, "--ratios is empty");
    if (!(*ratios = malloc(sizeof(double) * (size_t)nv))) rc = kvz_error_set(KVZ_ERR_NOMEM, "--ratios");
    for (int i = 0; i < nv && !rc; i++) {
        char *end;
        const double r = strtod(v[i], &end);
        if (end == v[i] || *end || !(r >= 0.0 && r <= 1.0))
            rc = kvz_error_set(KVZ_ERR_ARG, "--ratios expects a number in [0, 1], got '%s'", v[i]);
        else if (r <= 0.0)
            rc = kvz_error_set(KVZ_ERR_ARG, "--ratios: %s is not in (0, 1]", v[i]);
        for (int k = 0; k < *n && !rc; k++)
            if ((*ratios)[k] == r) rc = kvz_error_set(KVZ_ERR_ARG, "--ratios: %s given twice", v[i]);
        if (!rc) (*ratios)[(*n)++] = r;
    }
    kvz_eval_list_free(v, nv);
    if (rc) {
        free(*ratios);
        *ratios = NULL;
        *n = 0;
    }
    return rc;
}

/* printf to io->log as one line; warn = 1 also when quiet */
void kvz_eval_say(const kvz_eval_io *io, int warn, const char *fmt, ...)
{
    if (!io->log || (io->quiet && !warn)) return;
    char line[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    io->log(io->ctx, line);
}

int kvz_eval_fail(kvz_eval_error *er, int rc, int input, int with_detail, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(er->msg, sizeof er->msg, fmt, ap);
    va_end(ap);
    er->rc = rc;
    er->input = input;
    er->with_detail = with_detail;
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Question file                                                             */

void kvz_eval_qa_free(kvz_eval_qa *q)
{
    free(q->doc); free(q->path); free(q->question); free(q->answer);
    for (int i = 0; i < q->n_accept; i++) free(q->accept[i]);
    free(q->accept);
    memset(q, 0, sizeof *q);
}

/* A JSON string value -> malloc'd UTF-8 copy (jansson has checked the encoding and
 * rejected \u0000); NULL when @p v is not a string. */
static char *jdup(const json_t *v)
{
    return json_is_string(v) ? strndup(json_string_value(v), json_string_length(v)) : NULL;
}

int kvz_eval_parse_qa(const char *line, size_t len, kvz_eval_qa *q, const char **why)
{
    memset(q, 0, sizeof *q);
    *why = "not a JSON object";
    json_error_t err;
    json_t *o = json_loadb(line, len, 0, &err); /* also rejects text after the object */
    if (!o) {
        if (strstr(err.text, "end of file expected")) *why = "text after the object";
        return KVZ_ERR_FORMAT;
    }
    int rc = KVZ_ERR_FORMAT;
    if (!json_is_object(o)) goto bad;
    const json_t *d = json_object_get(o, "doc"), *qs = json_object_get(o, "question"),
                 *an = json_object_get(o, "answer"), *ac = json_object_get(o, "accept");
    if ((d && !json_is_string(d)) || (qs && !json_is_string(qs)) || (an && !json_is_string(an))) {
        *why = "\"doc\", \"question\" and \"answer\" must be strings";
        goto bad;
    }
    if (!d || !qs || !an) {
        *why = "missing \"doc\", \"question\" or \"answer\"";
        goto bad;
    }
    rc = KVZ_ERR_NOMEM;
    *why = "out of memory";
    if (!(q->doc = jdup(d)) || !(q->question = jdup(qs)) || !(q->answer = jdup(an))) goto bad;
    if (ac) {
        rc = KVZ_ERR_FORMAT;
        *why = "\"accept\" must be an array of strings";
        if (!json_is_array(ac)) goto bad;
        size_t n = json_array_size(ac);
        if (n && !(q->accept = calloc(n, sizeof *q->accept))) goto bad;
        for (size_t i = 0; i < n; i++) {
            if (!(q->accept[i] = jdup(json_array_get(ac, i)))) goto bad;
            q->n_accept++;
        }
    }
    if (!q->doc[0] || !q->question[0] || !q->answer[0]) {
        rc = KVZ_ERR_FORMAT;
        *why = "empty \"doc\", \"question\" or \"answer\"";
        goto bad;
    }
    if (q->n_accept == 0) {
        rc = KVZ_ERR_NOMEM;
        *why = "out of memory";
        free(q->accept);
        q->accept = malloc(sizeof *q->accept);
        if (!q->accept || !(q->accept[0] = strdup(q->answer))) goto bad;
        q->n_accept = 1;
    }
    json_decref(o);
    return 0;
bad:
    json_decref(o);
    kvz_eval_qa_free(q);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Methods and results                                                       */

const char *const kvz_eval_method_name[KVZ_EVAL_N_METHOD] = {"kvzip", "random", "window", "snapkv", "snapkv-q1"};

int kvz_eval_parse_baselines(const char *list, int use[KVZ_EVAL_N_METHOD])
{
    memset(use, 0, sizeof(int) * KVZ_EVAL_N_METHOD);
    use[KVZ_EVAL_KVZIP] = 1;
    if (!strcmp(list, "none")) return 0;
    char **v = NULL;
    const int n = kvz_eval_split_list(list, &v);
    int rc = n < 0 ? n : 0;
    for (int i = 0; i < n && !rc; i++) {
        if (!strcmp(v[i], "random")) use[KVZ_EVAL_RANDOM] = 1;
        else if (!strcmp(v[i], "window")) use[KVZ_EVAL_WINDOW] = 1;
        else if (!strcmp(v[i], "snapkv")) use[KVZ_EVAL_SNAPKV] = use[KVZ_EVAL_SNAPKV_Q1] = 1;
        else rc = kvz_error_set(KVZ_ERR_ARG, "--baselines: unknown method '%s' (random, window, snapkv, none)", v[i]);
    }
    kvz_eval_list_free(v, n);
    return rc;
}
static const char *const method_color[KVZ_EVAL_N_METHOD] = {"#9400d3", "#009e73", "#56b4e9", "#e69f00", "#d55e00"};
enum { M_KVZIP = KVZ_EVAL_KVZIP, M_RANDOM = KVZ_EVAL_RANDOM, M_WINDOW = KVZ_EVAL_WINDOW,
       M_SNAPKV = KVZ_EVAL_SNAPKV, M_SNAPKV_Q1 = KVZ_EVAL_SNAPKV_Q1, N_METHOD = KVZ_EVAL_N_METHOD };
#define method_name kvz_eval_method_name
#define N_SINK 4        /* window baseline: first context tokens always kept */
#define SNAP_POOL 7     /* SnapKV max-pool kernel over the token axis */

typedef kvz_eval_answer run;
typedef kvz_eval_qa qa;

typedef struct docinfo {
    char *name, *path;
    int32_t n_prefix, n_ctx, n_q;
    double score_s, total_s;
} docinfo;

struct kvz_eval {
    kvz_model *m;
    const kvz_config *c;
    const kvz_tokenizer *tok;
    kvz_eval_io io;
    qa *q;
    int nq;
    docinfo *docs;
    int ndocs;
    double *ratios;
    int nr;
    int use[N_METHOD];
    int max_tokens;
    uint64_t seed;
    int kv_dtype;        /* stored-type round trip of compressed caches, -1 none */
    int copy_kv;         /* read the full cache through kvz_kv_get_head on every backend */
    run *full;           /* (nq) */
    kvz_tokens *full_gen;/* (nq) greedy tokens on the full cache */
    run *runs;           /* (nq, N_METHOD, nr) */
    double seconds, t_score, t_answer;
    int64_t n_answers;
};

static run *R(const kvz_eval *e, int qi, int m, int r) { return &e->runs[((size_t)qi * N_METHOD + m) * e->nr + r]; }

int kvz_eval_create(const kvz_eval_opts *o, const kvz_eval_io *io, kvz_eval **out)
{
    *out = NULL;
    if (o->n_ratios < 1 || !io->read_text) return kvz_error_set(KVZ_ERR_ARG, "kvz_eval_create: no ratio or reader");
    kvz_eval *e = calloc(1, sizeof *e);
    if (!e || !(e->ratios = malloc(sizeof(double) * (size_t)o->n_ratios))) {
        free(e);
        return kvz_error_set(KVZ_ERR_NOMEM, "evaluation");
    }
    memcpy(e->ratios, o->ratios, sizeof(double) * (size_t)o->n_ratios);
    e->nr = o->n_ratios;
    memcpy(e->use, o->use, sizeof e->use);
    e->use[M_KVZIP] = 1;
    e->max_tokens = o->max_tokens;
    e->seed = o->seed;
    e->kv_dtype = o->kv_dtype;
    e->copy_kv = o->copy_kv;
    e->io = *io;
    *out = e;
    return 0;
}

void kvz_eval_free(kvz_eval *e)
{
    if (!e) return;
    for (int qi = 0; qi < e->nq; qi++) {
        if (e->full) free(e->full[qi].answer);
        if (e->full_gen) kvz_tokens_free(&e->full_gen[qi]);
        for (int m = 0; e->runs && m < N_METHOD; m++)
            for (int r = 0; r < e->nr; r++) free(R(e, qi, m, r)->answer);
        kvz_eval_qa_free(&e->q[qi]);
    }
    for (int d = 0; d < e->ndocs; d++) { free(e->docs[d].name); free(e->docs[d].path); }
    free(e->q); free(e->docs); free(e->ratios); free(e->full); free(e->full_gen); free(e->runs);
    free(e);
}

static int name_matches(const char *doc, const char *want)
{
    const char *base = strrchr(doc, '/');
    base = base ? base + 1 : doc;
    return !strcmp(doc, want) || !strncmp(base, want, strlen(want));
}

/* Append q (moved) as question of document doc (new entry when d == ndocs). */
static int add_question(kvz_eval *e, qa *q, int d, const char *dir)
{
    if (d == e->ndocs) {
        docinfo *nd = realloc(e->docs, sizeof *e->docs * (size_t)(e->ndocs + 1));
        if (!nd) return KVZ_ERR_NOMEM;
        e->docs = nd;
        docinfo *di = &e->docs[e->ndocs];
        memset(di, 0, sizeof *di);
        di->name = strdup(q->doc);
        di->path = malloc(strlen(dir) + strlen(q->doc) + 1);
        if (!di->name || !di->path) { free(di->name); free(di->path); return KVZ_ERR_NOMEM; }
        if (q->doc[0] == '/') strcpy(di->path, q->doc);
        else {
            strcpy(di->path, dir);
            strcat(di->path, q->doc);
        }
        e->ndocs++;
    }
    qa *nq = realloc(e->q, sizeof *e->q * (size_t)(e->nq + 1));
    if (!nq || !(q->path = strdup(e->docs[d].path))) {
        if (nq) e->q = nq;
        return KVZ_ERR_NOMEM;
    }
    e->q = nq;
    q->doc_idx = d;
    e->q[e->nq++] = *q;
    return 0;
}

int kvz_eval_add_questions(kvz_eval *e, const char *qa_path, const char *text, size_t len,
                           const char *docs_list, long limit, long per_doc, kvz_eval_error *er)
{
    char **docs = NULL;
    const int n_docs = docs_list ? kvz_eval_split_list(docs_list, &docs) : 0;
    char *dir = strdup(qa_path);
    int *hit = n_docs >= 0 ? calloc((size_t)n_docs + 1, sizeof *hit) : NULL;
    int rc = 0;
    if (!dir || !hit) {
        rc = kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "cannot read %s: out of memory", qa_path);
        goto out;
    }
    char *slash = strrchr(dir, '/');
    if (slash) slash[1] = 0;
    else dir[0] = 0;
    int line_no = 0;
    for (const char *p = text, *end = text + len; p < end && *p && !rc;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const size_t n = nl ? (size_t)(nl - p) : strnlen(p, (size_t)(end - p));
        line_no++;
        size_t k = 0;
        while (k < n && isspace((unsigned char)p[k])) k++;
        if (k < n) {
            qa q;
            const char *why;
            if ((rc = kvz_eval_parse_qa(p, n, &q, &why))) {
                kvz_eval_fail(er, rc, rc != KVZ_ERR_NOMEM, 0, "%s:%d: %s", qa_path, line_no, why);
                break;
            }
            int keep = !docs_list;
            for (int w = 0; w < n_docs; w++)
                if (name_matches(q.doc, docs[w])) keep = hit[w] = 1;
            if (keep && limit && e->nq >= limit) keep = 0;
            int d = 0;
            if (keep) {
                for (d = 0; d < e->ndocs && strcmp(e->docs[d].name, q.doc); d++) {}
                int in_doc = 0;
                for (int i = 0; i < e->nq; i++) in_doc += e->q[i].doc_idx == d && d < e->ndocs;
                if (per_doc && in_doc >= per_doc) keep = 0;
                q.idx_in_doc = in_doc;
            }
            if (!keep) kvz_eval_qa_free(&q);
            else if ((rc = add_question(e, &q, d, dir))) {
                kvz_eval_qa_free(&q);
                kvz_eval_fail(er, rc, 0, 0, "%s: out of memory", qa_path);
            }
        }
        p = nl ? nl + 1 : p + n;
    }
    for (int w = 0; w < n_docs && !rc; w++)
        if (!hit[w])
            rc = kvz_eval_fail(er, KVZ_ERR_NOTFOUND, 1, 0, "--docs: no question of %s is about a "
                               "document matching '%s'", qa_path, docs[w]);
    if (!rc && e->nq == 0) rc = kvz_eval_fail(er, KVZ_ERR_EMPTY, 1, 0, "%s has no questions", qa_path);
    for (int d = 0; d < e->ndocs && !rc; d++) {
        struct stat st;
        if (stat(e->docs[d].path, &st))
            rc = kvz_eval_fail(er, KVZ_ERR_NOTFOUND, 1, 0, "document %s not found (paths are relative to %s)",
                               e->docs[d].path, dir[0] ? dir : "the current folder");
    }
out:
    free(dir);
    free(hit);
    kvz_eval_list_free(docs, n_docs);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* SnapKV observation: attention of the window queries to the context        */

/* Rows of (layer, head) of @p kv as host fp32: the cache's own arrays through kvz_kv_view
 * where the backend keeps them on the host (CPU), else (a device cache, or @p copy set) a
 * copy by kvz_kv_get_head into the scratch @p sb, grown as needed. v and pos may be NULL. */
static int kv_rows(const kvz_kv *kv, int32_t l, int32_t h, size_t hd, int copy, kvz_eval_kvbuf *sb,
                   const float **k, const float **v, const int32_t **pos, int64_t *len)
{
    if (!copy) {
        const int rc = kvz_kv_view(kv, l, h, k, v, pos, len);
        if (rc != KVZ_ERR_UNSUPPORTED) return rc;
    }
    const int64_t n = kvz_kv_len(kv, l, h);
    if ((size_t)n > sb->rows) {
        float *nk = realloc(sb->k, sizeof(float) * (size_t)n * hd);
        if (nk) sb->k = nk;
        float *nv = nk ? realloc(sb->v, sizeof(float) * (size_t)n * hd) : NULL;
        if (nv) sb->v = nv;
        int32_t *np = nv ? realloc(sb->pos, sizeof(int32_t) * (size_t)n) : NULL;
        if (np) sb->pos = np;
        if (!np) return kvz_error_set(KVZ_ERR_NOMEM, "cache rows: cannot allocate");
        sb->rows = (size_t)n;
    }
    const int rc = kvz_kv_get_head(kv, l, h, sb->k, v ? sb->v : NULL, pos ? sb->pos : NULL);
    if (rc) return rc;
    *k = sb->k;
    if (v) *v = sb->v;
    if (pos) *pos = sb->pos;
    *len = n;
    return 0;
}

void kvz_eval_kvbuf_free(kvz_eval_kvbuf *b)
{
    free(b->k);
    free(b->v);
    free(b->pos);
    memset(b, 0, sizeof *b);
}

void kvz_eval_snap_free(kvz_eval_snap *s)
{
    free(s->work);
    s->work = NULL;
    s->work_floats = 0;
    kvz_eval_kvbuf_free(&s->kb);
}

/* Hook on the full cache's teacher-forced pass. For query head g of KV head h and
 * each window query i, p = softmax over every key visible to i (prefix, context,
 * window tokens up to i) of q·k/√d; acc[l, g, j] += p[context token j]. Queries
 * after the window (the reference answer) are ignored. Keys are read from the cache
 * (kv_rows), not from k_new, so both backends take the same route. */
int kvz_eval_snap_hook(void *vctx, int32_t l, const float *q, const float *k_new, int32_t n,
                       int64_t row0, const kvz_kv *kv)
{
    (void)k_new;
    kvz_eval_snap *s = vctx;
    const kvz_config *c = s->c;
    const int hd = c->head_dim, grp = c->n_head / c->n_kv_head;
    const int64_t qoff = row0 - s->row_doc;
    const int32_t nw = (int32_t)(s->n_win - qoff < n ? s->n_win - qoff : n);
    if (qoff < 0) return kvz_error_set(KVZ_ERR_INTERNAL, "snapkv hook: rows before the document end");
    if (nw <= 0) return 0;
    const int64_t W = row0 + nw; /* keys visible to the last window query */
    const size_t need = (size_t)nw * grp * ((size_t)hd + (size_t)W);
    if (need > s->work_floats) {
        float *w = realloc(s->work, need * sizeof(float));
        if (!w) return kvz_error_set(KVZ_ERR_NOMEM, "snapkv: cannot allocate");
        s->work = w;
        s->work_floats = need;
    }
    const float scale = 1.0f / sqrtf((float)hd);
    for (int h = 0; h < c->n_kv_head; h++) {
        const float *K;
        int64_t len;
        int rc = kv_rows(kv, l, h, (size_t)hd, s->copy_kv, &s->kb, &K, NULL, NULL, &len);
        if (rc) return rc;
        if (len < W) return kvz_error_set(KVZ_ERR_INTERNAL, "snapkv hook: window rows missing");
        float *Q = s->work, *S = s->work + (size_t)nw * grp * hd;
        for (int32_t i = 0; i < nw; i++)
            memcpy(Q + (size_t)i * grp * hd, q + ((size_t)i * c->n_head + (size_t)h * grp) * hd,
                   sizeof(float) * (size_t)grp * hd);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nw * grp, (int)W, hd, scale, Q, hd, K,
                    hd, 0.0f, S, (int)W);
        for (int32_t i = 0; i < nw; i++) {
            const int64_t vis = row0 + i + 1;
            for (int g = 0; g < grp; g++) {
                float *row = S + ((size_t)i * grp + g) * (size_t)W;
                float mx = row[0];
                for (int64_t j = 1; j < vis; j++) mx = row[j] > mx ? row[j] : mx;
                double sum = 0.0;
                for (int64_t j = 0; j < vis; j++) sum += (row[j] = expf(row[j] - mx));
                const float inv = (float)(1.0 / sum);
                float *a = s->acc + ((size_t)l * c->n_head + (size_t)h * grp + g) * s->n_ctx;
                const float *pc = row + s->n_prefix;
                for (int32_t j = 0; j < s->n_ctx; j++) a[j] += pc[j] * inv;
            }
        }
    }
    return 0;
}

/* acc (n_layer, n_head, n_ctx) -> scores (n_layer, n_kv_head, n_ctx): max over the
 * GQA group, then max-pool with kernel SNAP_POOL (stride 1, window clipped at the ends). */
static void snap_finish(const kvz_config *c, int32_t n_ctx, const float *acc, float *scores, float *tmp)
{
    const int grp = c->n_head / c->n_kv_head;
    for (int32_t l = 0; l < c->n_layer; l++)
        for (int32_t h = 0; h < c->n_kv_head; h++) {
            for (int32_t j = 0; j < n_ctx; j++) {
                float v = 0.0f;
                for (int g = 0; g < grp; g++) {
                    float a = acc[((size_t)l * c->n_head + (size_t)h * grp + g) * n_ctx + j];
                    v = a > v ? a : v;
                }
                tmp[j] = v;
            }
            float *dst = scores + ((size_t)l * c->n_kv_head + h) * n_ctx;
            for (int32_t j = 0; j < n_ctx; j++) {
                float v = tmp[j];
                for (int32_t d = -SNAP_POOL / 2; d <= SNAP_POOL / 2; d++)
                    if (j + d >= 0 && j + d < n_ctx && tmp[j + d] > v) v = tmp[j + d];
                dst[j] = v;
            }
        }
}

/* ------------------------------------------------------------------------ */
/* Caches and answering                                                      */

/* Gather the prefix and the kept context rows of @p full into @p dst (cleared
 * first), per (layer, head), at their original positions; checkpoint dst.
 * keep: (n_layer, n_kv_head, n_ctx). *rows: rows kept, prefix included. */
static int build_cache(const kvz_eval *e, const kvz_kv *full, kvz_kv *dst, int32_t n_prefix,
                       int32_t n_ctx, const uint8_t *keep, float *kb, float *vb, int32_t *pb,
                       kvz_eval_kvbuf *kvb, uint64_t *rows)
{
    const kvz_config *c = e->c;
    const size_t hd = (size_t)c->head_dim;
    uint32_t counts[64];
    if (c->n_kv_head > 64) return kvz_error_set(KVZ_ERR_UNSUPPORTED, "more than 64 KV heads");
    kvz_kv_clear(dst);
    *rows = 0;
    for (int32_t l = 0; l < c->n_layer; l++) {
        size_t off = 0;
        for (int32_t h = 0; h < c->n_kv_head; h++) {
            const float *k, *v;
            const int32_t *pos;
            int64_t len;
            int rc = kv_rows(full, l, h, hd, e->copy_kv, kvb, &k, &v, &pos, &len);
            if (rc) return rc;
            if (len != (int64_t)n_prefix + n_ctx)
                return kvz_error_set(KVZ_ERR_INTERNAL, "full cache has %lld rows, expected %d",
                                     (long long)len, n_prefix + n_ctx);
            const uint8_t *kp = keep + ((size_t)l * c->n_kv_head + h) * n_ctx;
            const size_t off0 = off;
            for (int32_t j = 0; j < n_prefix + n_ctx; j++) {
                if (j >= n_prefix && !kp[j - n_prefix]) continue;
                memcpy(kb + off * hd, k + (size_t)j * hd, sizeof(float) * hd);
                memcpy(vb + off * hd, v + (size_t)j * hd, sizeof(float) * hd);
                pb[off++] = pos[j];
            }
            counts[h] = (uint32_t)(off - off0);
        }
        int rc = 0;
        if (e->kv_dtype >= 0 && !(rc = kvz_kvrow_round_trip(e->kv_dtype, kb, off, hd)))
            rc = kvz_kvrow_round_trip(e->kv_dtype, vb, off, hd);
        if (!rc) rc = kvz_kv_set_layer(dst, l, counts, pb, kb, vb);
        if (rc) return rc;
        *rows += off;
    }
    kvz_kv_checkpoint(dst);
    return 0;
}

static int answer(kvz_eval *e, kvz_eval_scratch *s, kvz_kv *kv, int32_t n_doc, const kvz_tokens *qt,
                  const kvz_tokens *at, const kvz_layer_hook *hook, run *out)
{
    int rc = kvz_eval_answer_question(e->m, s, kv, n_doc, qt, at, e->max_tokens, hook, out);
    if (!rc) e->n_answers++;
    return rc;
}

static void judge(kvz_eval *e, int qi, run *r, const kvz_tokens *gen)
{
    const kvz_tokens *f = &e->full_gen[qi];
    r->agree = gen->n == f->n && (gen->n == 0 || !memcmp(gen->ids, f->ids, sizeof(int32_t) * gen->n));
    r->correct = 0;
    for (int a = 0; a < e->q[qi].n_accept && !r->correct; a++)
        r->correct = kvz_eval_contains_ci(r->answer, e->q[qi].accept[a]);
    r->done = 1;
}

static uint64_t splitmix(uint64_t *st)
{
    uint64_t z = (*st += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Evaluate every selected question of document d. */
static int eval_doc(kvz_eval *e, int d, kvz_eval_error *er)
{
    docinfo *di = &e->docs[d];
    const kvz_config *c = e->c;
    const double t_doc0 = kvz_now();
    int *qs = malloc(sizeof(int) * (size_t)e->nq);
    int nq = 0;
    if (!qs) return KVZ_ERR_NOMEM;
    for (int i = 0; i < e->nq; i++)
        if (e->q[i].doc_idx == d) qs[nq++] = i;
    di->n_q = nq;

    char *text = NULL;
    size_t text_len = 0;
    int rc = e->io.read_text(di->path, (size_t)16 << 20, &text, &text_len);
    if (rc) {
        kvz_eval_fail(er, rc, 0, 1, "cannot use document %s", di->path);
        free(qs);
        return rc;
    }
    kvz_tokens prefix = {0}, ctx = {0};
    kvz_tokens *qt = calloc((size_t)nq, sizeof *qt), *at = calloc((size_t)nq, sizeof *at);
    if (!qt || !at) rc = KVZ_ERR_NOMEM;
    if (!rc) rc = kvz_chat_prefix(e->tok, &prefix);
    if (!rc) rc = kvz_tokenizer_encode(e->tok, text, text_len, 0, &ctx);
    int32_t max_seq = 0;
    for (int i = 0; i < nq && !rc; i++) {
        const qa *q = &e->q[qs[i]];
        rc = kvz_chat_question(e->tok, q->question, &qt[i]);
        if (!rc) rc = kvz_tokenizer_encode(e->tok, q->answer, strlen(q->answer), 0, &at[i]);
        if (!rc && at[i].n == 0) rc = kvz_error_set(KVZ_ERR_EMPTY, "reference answer has no tokens");
        int32_t need = (int32_t)qt[i].n + (int32_t)(at[i].n > (size_t)e->max_tokens ? at[i].n : (size_t)e->max_tokens);
        if (need > max_seq) max_seq = need;
    }
    free(text);
    if (rc) {
        kvz_eval_fail(er, rc, 0, 1, "cannot tokenize document %s or its questions", di->name);
        goto out_early;
    }
    di->n_prefix = (int32_t)prefix.n;
    di->n_ctx = (int32_t)ctx.n;
    const int32_t n_prefix = di->n_prefix, n_ctx = di->n_ctx, n_doc = n_prefix + n_ctx;
    kvz_kvzip_params kp;
    kvz_kvzip_defaults(&kp);
    /* rows the full cache needs (a device batches several chunks' repeat inputs into one
     * pass: more rows), and the positions it uses (every chunk's repeat input starts at
     * n_doc, however the chunks are batched: the one-chunk-per-pass count) */
    kvz_kvzip_params kp1 = kp;
    kp1.repeat_rows = 0;
    int64_t cap_full = kvz_kvzip_cache_rows(e->m, n_prefix, n_ctx, &kp),
            span = kvz_kvzip_cache_rows(e->m, n_prefix, n_ctx, &kp1);
    if (cap_full < 0 || span < 0) {
        rc = (int)(cap_full < 0 ? cap_full : span);
        kvz_eval_fail(er, rc, 0, 1, "cannot evaluate document");
        goto out_early;
    }
    if (cap_full < (int64_t)n_doc + max_seq + 1) cap_full = (int64_t)n_doc + max_seq + 1;
    if (span < (int64_t)n_doc + max_seq + 1) span = (int64_t)n_doc + max_seq + 1;
    if (span > c->n_ctx) {
        rc = kvz_error_set(KVZ_ERR_CONTEXT, "%s: %d tokens + scoring/question room exceed the "
                           "model's %d-token context", di->name, n_doc, c->n_ctx);
        kvz_eval_fail(er, rc, 0, 1, "cannot evaluate document");
        goto out_early;
    }

    const size_t heads = (size_t)c->n_layer * c->n_kv_head, N = heads * (size_t)n_ctx;
    const size_t hd = (size_t)c->head_dim;
    kvz_kv *full = NULL, *ck = NULL;
    float *kz = malloc(sizeof(float) * N), *aux = malloc(sizeof(float) * N);
    float *snap = malloc(sizeof(float) * N * (size_t)(nq ? nq : 1));
    float *acc = malloc(sizeof(float) * (size_t)c->n_layer * c->n_head * n_ctx);
    uint8_t *keep = malloc(N);
    float *kb = malloc(sizeof(float) * (size_t)c->n_kv_head * n_doc * hd);
    float *vb = malloc(sizeof(float) * (size_t)c->n_kv_head * n_doc * hd);
    int32_t *pb = malloc(sizeof(int32_t) * (size_t)c->n_kv_head * n_doc);
    float *tmp = malloc(sizeof(float) * (size_t)n_ctx);
    kvz_eval_scratch s = {0};
    kvz_eval_snap sc = {.c = c, .n_prefix = n_prefix, .n_ctx = n_ctx, .row_doc = n_doc, .acc = acc,
                        .copy_kv = e->copy_kv};
    kvz_eval_kvbuf kvb = {0};
    if (!kz || !aux || !snap || !acc || !keep || !kb || !vb || !pb || !tmp || (rc = kvz_eval_scratch_init(&s, e->m, max_seq))) {
        rc = kvz_error_set(KVZ_ERR_NOMEM, "evaluation buffers for %s", di->name);
        goto out;
    }
    if ((rc = kvz_kv_create(e->m, cap_full, 0, &full)) ||
        (rc = kvz_kv_create(e->m, (int64_t)n_doc + max_seq + 1, 0, &ck)))
        goto out;

    /* 1. KVzip scores (the cache then holds prefix + context) */
    double t0 = kvz_now();
    rc = kvz_kvzip_score(e->m, full, prefix.ids, n_prefix, ctx.ids, n_ctx, &kp, kz,
                        e->io.quiet ? NULL : e->io.progress, e->io.ctx);
    di->score_s = kvz_now() - t0;
    e->t_score += di->score_s;
    kvz_eval_say(&e->io, 0, "  scored %d context tokens in %.1f s", n_ctx, di->score_s);
    if (rc) goto out;
    kvz_kv_checkpoint(full);

    /* 2. full cache: reference answers, NLL, and SnapKV observations */
    t0 = kvz_now();
    const double full_bytes = (double)heads * n_doc * 2 * hd * 2;
    for (int i = 0; i < nq && !rc; i++) {
        const int qi = qs[i];
        memset(acc, 0, sizeof(float) * (size_t)c->n_layer * c->n_head * n_ctx);
        sc.n_win = (int32_t)qt[i].n;
        kvz_layer_hook hook = {.fn = kvz_eval_snap_hook, .ctx = &sc};
        run *r = &e->full[qi];
        if ((rc = answer(e, &s, full, n_doc, &qt[i], &at[i], e->use[M_SNAPKV] ? &hook : NULL, r))) break;
        kvz_tokens *fg = &e->full_gen[qi];
        fg->n = 0;
        for (size_t k = 0; k < s.gen.n && !rc; k++) rc = kvz_tokens_push(fg, s.gen.ids[k]);
        r->kv_bytes = full_bytes;
        judge(e, qi, r, &s.gen);
        if (e->use[M_SNAPKV]) snap_finish(c, n_ctx, acc, snap + N * i, tmp);
    }
    if (rc) goto out;
    kvz_eval_say(&e->io, 0, "  full cache: %d questions in %.1f s", nq, kvz_now() - t0);

    /* 3. compressed caches */
    for (int ri = 0; ri < e->nr && !rc; ri++) {
        const float ratio = (float)e->ratios[ri];
        t0 = kvz_now();
        for (int m = 0; m < N_METHOD && !rc; m++) {
            if (!e->use[m] || (m == M_SNAPKV_Q1 && nq < 3)) continue;
            int64_t kept;
            if (m == M_RANDOM || m == M_WINDOW) {
                if (m == M_RANDOM) {
                    uint64_t st = e->seed;
                    for (size_t i = 0; i < N; i++) aux[i] = (float)(splitmix(&st) >> 40) * 0x1p-24f;
                } else {
                    for (size_t h = 0; h < heads; h++)
                        for (int32_t j = 0; j < n_ctx; j++)
                            aux[h * n_ctx + j] = j < N_SINK ? 2.0f : (float)(j + 1) / (float)(n_ctx + 1);
                }
                kept = kvz_kvzip_select(aux, c->n_layer, c->n_kv_head, n_ctx, ratio, KVZ_EVICT_UNIFORM, keep, NULL);
            } else if (m == M_KVZIP) {
                kept = kvz_kvzip_select(kz, c->n_layer, c->n_kv_head, n_ctx, ratio, KVZ_EVICT_GLOBAL, keep, NULL);
            } else {
                kept = 0; /* per question below */
            }
            if (kept < 0) { rc = (int)kept; break; }
            /* ratio 1.0 keeps every pair: the cache equals kvzip's at 1.0; share its result */
            if (m != M_KVZIP && (size_t)llround((double)n_ctx * ratio) == (size_t)n_ctx &&
                (size_t)llround((double)N * ratio) == N && e->use[M_KVZIP]) {
                for (int i = (m == M_SNAPKV_Q1); i < nq; i++) {
                    run *src = R(e, qs[i], M_KVZIP, ri), *dst = R(e, qs[i], m, ri);
                    *dst = *src;
                    dst->answer = strdup(src->answer ? src->answer : "");
                }
                continue;
            }
            uint64_t rows = 0;
            if (m == M_KVZIP || m == M_RANDOM || m == M_WINDOW || m == M_SNAPKV_Q1) {
                if (m == M_SNAPKV_Q1) {
                    kept = kvz_kvzip_select(snap, c->n_layer, c->n_kv_head, n_ctx, ratio, KVZ_EVICT_UNIFORM, keep, NULL);
                    if (kept < 0) { rc = (int)kept; break; }
                }
                if ((rc = build_cache(e, full, ck, n_prefix, n_ctx, keep, kb, vb, pb, &kvb, &rows))) break;
                for (int i = (m == M_SNAPKV_Q1); i < nq && !rc; i++) {
                    run *r = R(e, qs[i], m, ri);
                    if ((rc = answer(e, &s, ck, n_doc, &qt[i], &at[i], NULL, r))) break;
                    r->kv_bytes = (double)rows * 2 * hd * 2;
                    judge(e, qs[i], r, &s.gen);
                }
            } else { /* M_SNAPKV: one cache per question, from its own observation */
                for (int i = 0; i < nq && !rc; i++) {
                    kept = kvz_kvzip_select(snap + N * i, c->n_layer, c->n_kv_head, n_ctx, ratio,
                                            KVZ_EVICT_UNIFORM, keep, NULL);
                    if (kept < 0) { rc = (int)kept; break; }
                    if ((rc = build_cache(e, full, ck, n_prefix, n_ctx, keep, kb, vb, pb, &kvb, &rows))) break;
                    run *r = R(e, qs[i], m, ri);
                    if ((rc = answer(e, &s, ck, n_doc, &qt[i], &at[i], NULL, r))) break;
                    r->kv_bytes = (double)rows * 2 * hd * 2;
                    judge(e, qs[i], r, &s.gen);
                }
            }
        }
        if (!rc) kvz_eval_say(&e->io, 0, "  ratio %.2f: %.1f s", ratio, kvz_now() - t0);
    }
    if (rc && !er->msg[0]) kvz_eval_fail(er, rc, 0, 1, "evaluation of %s failed", di->name);
out:
    free(kz); free(aux); free(snap); free(acc); free(keep); free(kb); free(vb); free(pb); free(tmp);
    kvz_eval_scratch_free(&s);
    kvz_eval_snap_free(&sc);
    kvz_eval_kvbuf_free(&kvb);
    kvz_kv_free(full);
    kvz_kv_free(ck);
out_early:
    for (int i = 0; i < nq; i++) {
        if (qt) kvz_tokens_free(&qt[i]);
        if (at) kvz_tokens_free(&at[i]);
    }
    free(qt); free(at); free(qs);
    kvz_tokens_free(&prefix);
    kvz_tokens_free(&ctx);
    di->total_s = kvz_now() - t_doc0;
    return rc;
}

int kvz_eval_run(kvz_eval *e, kvz_model *m, kvz_eval_error *er)
{
    e->m = m;
    e->c = kvz_model_config(m);
    e->tok = kvz_model_tokenizer(m);
    e->full = calloc((size_t)e->nq, sizeof *e->full);
    e->full_gen = calloc((size_t)e->nq, sizeof *e->full_gen);
    e->runs = calloc((size_t)e->nq * N_METHOD * e->nr, sizeof *e->runs);
    if (!e->full || !e->full_gen || !e->runs)
        return kvz_eval_fail(er, kvz_error_set(KVZ_ERR_NOMEM, "%d questions", e->nq), 0, 1, "cannot allocate results");
    kvz_eval_say(&e->io, 0, "kvzip-eval: %d questions, %d documents, %d ratios, on %s, methods:%s%s%s%s", e->nq,
                 e->ndocs, e->nr, kvz_model_device(m) == KVZ_DEVICE_CUDA ? "cuda" : "cpu", " kvzip", e->use[M_RANDOM] ? " random" : "", e->use[M_WINDOW] ? " window" : "",
                 e->use[M_SNAPKV] ? " snapkv snapkv-q1" : "");
    const double t_start = kvz_now();
    int rc = 0;
    er->msg[0] = 0;
    for (int d = 0; d < e->ndocs && !rc; d++) {
        int nd = 0;
        for (int i = 0; i < e->nq; i++) nd += e->q[i].doc_idx == d;
        kvz_eval_say(&e->io, 0, "[%d/%d] %s (%d questions)", d + 1, e->ndocs, e->docs[d].name, nd);
        rc = eval_doc(e, d, er);
        if (rc && !er->msg[0]) kvz_eval_fail(er, rc, 0, 1, "evaluation of %s failed", e->docs[d].name);
        if (!rc)
            kvz_eval_say(&e->io, 0, "  done in %.1f s (%.1f s elapsed)", e->docs[d].total_s, kvz_now() - t_start);
    }
    e->seconds = kvz_now() - t_start;
    e->t_answer = e->seconds - e->t_score;
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Aggregation and output                                                    */

typedef struct agg { int n; double agree, correct, dnll, mb; } agg;

/* Mean over questions qi with sel(qi) of method m at ratio r (m < 0: the full cache). */
static agg aggregate(const kvz_eval *e, int m, int r, int multi_only)
{
    agg a = {0};
    for (int qi = 0; qi < e->nq; qi++) {
        if (multi_only && (e->docs[e->q[qi].doc_idx].n_q < 3 || e->q[qi].idx_in_doc == 0)) continue;
        const run *x = m < 0 ? &e->full[qi] : R(e, qi, m, r);
        if (!x->done) continue;
        a.n++;
        a.agree += x->agree;
        a.correct += x->correct;
        a.dnll += x->nll - e->full[qi].nll;
        a.mb += x->kv_bytes / 1e6;
    }
    if (a.n) {
        a.agree *= 100.0 / a.n; a.correct *= 100.0 / a.n;
        a.dnll /= a.n; a.mb /= a.n;
    }
    return a;
}

static void table_row(FILE *o, const char *name, double ratio, agg a)
{
    fprintf(o, "| %s | %.2f | %.1f | %.1f | %+.3f | %.2f |\n", name, ratio, a.agree, a.correct, a.dnll, a.mb);
}

int kvz_eval_write_tables(const kvz_eval *e, FILE *o)
{
    const double seconds = e->seconds;
    int n_multi = aggregate(e, -1, 0, 1).n;
    agg f = aggregate(e, -1, 0, 0);
    double nll_full = 0.0;
    for (int qi = 0; qi < e->nq; qi++) nll_full += e->full[qi].nll;
    fprintf(o, "## kvzip-eval: %d questions over %d documents\n\n", e->nq, e->ndocs);
    fprintf(o, "| method | ratio | agreement %% | accuracy %% | mean ΔNLL | KV MB |\n");
    fprintf(o, "|---|---|---|---|---|---|\n");
    table_row(o, "full", 1.0, f);
    for (int m = 0; m < N_METHOD; m++) {
        if (!e->use[m] || m == M_SNAPKV_Q1) continue;
        for (int r = 0; r < e->nr; r++) table_row(o, method_name[m], e->ratios[r], aggregate(e, m, r, 0));
    }
    fprintf(o, "\nFull-cache mean NLL of the reference answers: %.3f nats/token. KV MB: fp16 K+V of "
           "the cache each question was answered from (prefix included), mean over questions. "
           "snapkv compresses per question with that question's own attention.\n",
           e->nq ? nll_full / e->nq : 0.0);
    if (e->use[M_SNAPKV_Q1] && n_multi > 0) {
        fprintf(o, "\n### Multi-query: questions 2..n of documents with >= 3 questions (%d questions)\n\n", n_multi);
        fprintf(o, "One compressed cache per document answers all of them. kvzip is question-"
               "agnostic; snapkv-q1 compressed with question 1's attention; snapkv (own question) "
               "is shown as the optimistic reference.\n\n");
        fprintf(o, "| method | ratio | agreement %% | accuracy %% | mean ΔNLL | KV MB |\n");
        fprintf(o, "|---|---|---|---|---|---|\n");
        table_row(o, "full", 1.0, aggregate(e, -1, 0, 1));
        const int ms[] = {M_KVZIP, M_SNAPKV_Q1, M_SNAPKV};
        for (int k = 0; k < 3; k++) {
            if (!e->use[ms[k]]) continue;
            for (int r = 0; r < e->nr; r++) table_row(o, ms[k] == M_SNAPKV ? "snapkv (own q)" : method_name[ms[k]],
                                                      e->ratios[r], aggregate(e, ms[k], r, 1));
        }
    }
    fprintf(o, "\nRuntime: %.1f s total (KVzip scoring %.1f s, %lld answers in %.1f s).\n", seconds,
           e->t_score, (long long)e->n_answers, e->t_answer);
    return ferror(o) ? kvz_error_set(KVZ_ERR_IO, "cannot write the tables") : 0;
}

static void json_agg(FILE *f, agg a)
{
    fprintf(f, "\"n\": %d, \"agreement\": %.4f, \"accuracy\": %.4f, \"delta_nll\": %.6f, \"kv_mb\": %.4f",
            a.n, a.agree, a.correct, a.dnll, a.mb);
}

static void json_run(FILE *f, const run *x)
{
    fprintf(f, "\"agree\": %s, \"correct\": %s, \"nll\": %.6f, \"kv_mb\": %.4f, \"answer\": ",
            x->agree ? "true" : "false", x->correct ? "true" : "false", x->nll, x->kv_bytes / 1e6);
    kvz_eval_json_str(f, x->answer ? x->answer : "");
}

int kvz_eval_write_json(const kvz_eval *e, const char *path, const char *model_path,
                        const char *qa_path)
{
    const double seconds = e->seconds;
    FILE *f = fopen(path, "w");
    if (!f) return kvz_error_set(KVZ_ERR_IO, "%s: cannot create", path);
    fprintf(f, "{\n  \"model\": ");
    kvz_eval_json_str(f, model_path);
    fprintf(f, ",\n  \"file\": ");
    kvz_eval_json_str(f, qa_path);
    fprintf(f, ",\n  \"ratios\": [");
    for (int r = 0; r < e->nr; r++) fprintf(f, "%s%g", r ? ", " : "", e->ratios[r]);
    fprintf(f, "],\n  \"methods\": [");
    int first = 1;
    for (int m = 0; m < N_METHOD; m++)
        if (e->use[m]) { fprintf(f, "%s\"%s\"", first ? "" : ", ", method_name[m]); first = 0; }
    fprintf(f, "],\n  \"settings\": {\"max_tokens\": %d, \"seed\": %llu, \"random\": \"per-head uniform\", "
            "\"window_sinks\": %d, \"snapkv_pool\": %d, \"snapkv_window\": \"question + postfix tokens\", "
            "\"kv_dtype_for_mb\": \"f16\", \"device\": \"%s\"},\n", e->max_tokens, (unsigned long long)e->seed, N_SINK,
            SNAP_POOL, e->m && kvz_model_device(e->m) == KVZ_DEVICE_CUDA ? "cuda" : "cpu");
    fprintf(f, "  \"seconds\": {\"total\": %.2f, \"scoring\": %.2f, \"answering\": %.2f, \"answers\": %lld},\n",
            seconds, e->t_score, e->t_answer, (long long)e->n_answers);
    fprintf(f, "  \"docs\": [\n");
    for (int d = 0; d < e->ndocs; d++) {
        fprintf(f, "    {\"doc\": ");
        kvz_eval_json_str(f, e->docs[d].name);
        fprintf(f, ", \"n_prefix\": %d, \"n_ctx\": %d, \"questions\": %d, \"score_s\": %.2f, \"total_s\": %.2f}%s\n",
                e->docs[d].n_prefix, e->docs[d].n_ctx, e->docs[d].n_q, e->docs[d].score_s,
                e->docs[d].total_s, d + 1 < e->ndocs ? "," : "");
    }
    fprintf(f, "  ],\n  \"full\": {");
    json_agg(f, aggregate(e, -1, 0, 0));
    fprintf(f, "},\n  \"results\": [\n");
    first = 1;
    for (int m = 0; m < N_METHOD; m++) {
        if (!e->use[m] || m == M_SNAPKV_Q1) continue;
        for (int r = 0; r < e->nr; r++) {
            fprintf(f, "%s    {\"method\": \"%s\", \"ratio\": %g, ", first ? "" : ",\n", method_name[m], e->ratios[r]);
            json_agg(f, aggregate(e, m, r, 0));
            fputc('}', f);
            first = 0;
        }
    }
    fprintf(f, "\n  ],\n  \"multi_query\": [\n");
    first = 1;
    const int ms[] = {M_KVZIP, M_SNAPKV_Q1, M_SNAPKV};
    const int n_multi = aggregate(e, -1, 0, 1).n;
    for (int k = 0; k < 3 && e->use[M_SNAPKV_Q1] && n_multi > 0; k++) {
        if (!e->use[ms[k]]) continue;
        for (int r = 0; r < e->nr; r++) {
            fprintf(f, "%s    {\"method\": \"%s\", \"ratio\": %g, ", first ? "" : ",\n", method_name[ms[k]], e->ratios[r]);
            json_agg(f, aggregate(e, ms[k], r, 1));
            fputc('}', f);
            first = 0;
        }
    }
    fprintf(f, "\n  ],\n  \"questions\": [\n");
    for (int qi = 0; qi < e->nq; qi++) {
        const qa *q = &e->q[qi];
        fprintf(f, "    {\"doc\": ");
        kvz_eval_json_str(f, q->doc);
        fprintf(f, ", \"question\": ");
        kvz_eval_json_str(f, q->question);
        fprintf(f, ", \"reference\": ");
        kvz_eval_json_str(f, q->answer);
        fprintf(f, ",\n     \"full\": {");
        json_run(f, &e->full[qi]);
        fprintf(f, "},\n     \"runs\": [");
        first = 1;
        for (int m = 0; m < N_METHOD; m++)
            for (int r = 0; r < e->nr; r++) {
                const run *x = R(e, qi, m, r);
                if (!x->done) continue;
                fprintf(f, "%s\n       {\"method\": \"%s\", \"ratio\": %g, ", first ? "" : ",", method_name[m], e->ratios[r]);
                json_run(f, x);
                fputc('}', f);
                first = 0;
            }
        fprintf(f, "]}%s\n", qi + 1 < e->nq ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    int bad = ferror(f);
    if (fclose(f) || bad) return kvz_error_set(KVZ_ERR_IO, "%s: write failed", path);
    return 0;
}

int kvz_eval_write_plot(const kvz_eval *e, const char *path)
{
    FILE *g = popen("gnuplot 2>&1", "w");
    if (!g) return kvz_error_set(KVZ_ERR_IO, "cannot run gnuplot");
    const int n_multi = aggregate(e, -1, 0, 1).n;
    const int panels = e->use[M_SNAPKV_Q1] && n_multi > 0 ? 3 : 2;
    fprintf(g, "set terminal pngcairo size %d,480 enhanced font 'sans,10'\n", 520 * panels);
    fprintf(g, "set output '");
    for (const char *p = path; *p; p++) {
        if (*p == '\'') fputc('\'', g);
        fputc(*p, g);
    }
    fprintf(g, "'\nset multiplot layout 1,%d title 'kvzip-eval: %d questions, %d documents'\n", panels, e->nq, e->ndocs);
    fprintf(g, "set xlabel 'ratio of context KV pairs kept'\nset xrange [0:1.05]\nset yrange [0:105]\n"
               "set grid\nset key top left\nset style data linespoints\n");
    /* data blocks: per method, "ratio accuracy agreement" sorted by ratio */
    for (int pass = 0; pass < 2; pass++)
        for (int m = 0; m < N_METHOD; m++) {
            if (!e->use[m] || (pass == 0 && m == M_SNAPKV_Q1) || (pass == 1 && panels < 3)) continue;
            if (pass == 1 && m != M_KVZIP && m != M_SNAPKV && m != M_SNAPKV_Q1) continue;
            fprintf(g, "$%s%s << EOD\n", pass ? "mq_" : "", m == M_SNAPKV_Q1 ? "snapkv_q1" : method_name[m]);
            int order[64], n = 0;
            for (int r = 0; r < e->nr && n < 64; r++) order[n++] = r;
            for (int a = 1; a < n; a++)
                for (int b = a; b > 0 && e->ratios[order[b]] < e->ratios[order[b - 1]]; b--) {
                    int t = order[b]; order[b] = order[b - 1]; order[b - 1] = t;
                }
            for (int k = 0; k < n; k++) {
                agg a = aggregate(e, m, order[k], pass);
                fprintf(g, "%g %.3f %.3f\n", e->ratios[order[k]], a.correct, a.agree);
            }
            fprintf(g, "EOD\n");
        }
    const agg f = aggregate(e, -1, 0, 0), fm = aggregate(e, -1, 0, 1);
    for (int col = 2; col <= 3; col++) {
        fprintf(g, "set title '%s (all questions)'\nset ylabel '%s %%'\nplot ",
                col == 2 ? "Accuracy" : "Agreement with full-cache answer",
                col == 2 ? "accuracy" : "agreement");
        for (int m = 0; m < N_METHOD; m++)
            if (e->use[m] && m != M_SNAPKV_Q1)
                fprintf(g, "$%s using 1:%d title '%s' lw 2 lc rgb '%s', ", method_name[m], col,
                        method_name[m], method_color[m]);
        if (col == 2) fprintf(g, "%.3f title 'full cache' dt 2 lc rgb 'black'\n", f.correct);
        else fprintf(g, "100 notitle dt 2 lc rgb 'black'\n");
    }
    if (panels == 3) {
        fprintf(g, "set title 'Multi-query: questions 2..n (%d q)'\nset ylabel 'accuracy %%'\nplot ", n_multi);
        fprintf(g, "$mq_kvzip using 1:2 title 'kvzip' lw 2 lc rgb '%s', $mq_snapkv_q1 using 1:2 "
                "title 'snapkv-q1 (compressed with question 1)' lw 2 lc rgb '%s', ",
                method_color[M_KVZIP], method_color[M_SNAPKV_Q1]);
        if (e->use[M_SNAPKV])
            fprintf(g, "$mq_snapkv using 1:2 title 'snapkv (own question)' lw 2 dt 3 lc rgb '%s', ",
                    method_color[M_SNAPKV]);
        fprintf(g, "%.3f title 'full cache' dt 2 lc rgb 'black'\n", fm.correct);
    }
    fprintf(g, "unset multiplot\n");
    int st = pclose(g);
    if (st != 0) return kvz_error_set(KVZ_ERR_IO, "gnuplot failed (status %d) writing %s", st, path);
    return 0;
}

