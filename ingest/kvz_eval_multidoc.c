/* Multi-document evaluation (kvz_eval_multidoc.h, docs/EVAL.md "Multi-document",
 * docs/MULTIDOC.md).
 *
 * Every document (or each part of a long one, cut as kvzip-ingest cuts it) is
 * scored once with KVzip and held in memory (fp32 rows). Per ratio, each part is
 * selected on its own (global threshold, as kvzip-ingest stores it), the selected
 * caches are composed by kvz_docs_compose_mem (the placement rules and the RoPE
 * re-rotation of kvz_docs_load), and every question is answered from the
 * composition: teacher-forced NLL of the reference answer, then a greedy answer.
 * One record per (question, method, ratio) is appended to the results file as it is
 * measured; a rerun with the same file skips what is there. */
#include "kvz_eval_multidoc.h"

#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "kvz_compose_mem.h"
#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_ingest.h"
#include "kvz_kvzip.h"
#include "kvz_parts.h"

const char *const kvz_eval_md_method_name[KVZ_EVAL_MD_N_METHOD] = {"sequential", "parallel", "oracle"};
const char *const kvz_eval_md_kind_name[KVZ_EVAL_MD_N_KIND] = {"long", "retrieval", "cross"};
#define md_method_name kvz_eval_md_method_name
#define md_kinds kvz_eval_md_kind_name
enum { MD_SEQ = KVZ_EVAL_MD_SEQUENTIAL, MD_PAR = KVZ_EVAL_MD_PARALLEL, MD_ORACLE = KVZ_EVAL_MD_ORACLE,
       MD_N_METHOD = KVZ_EVAL_MD_N_METHOD, MD_N_KIND = KVZ_EVAL_MD_N_KIND };

static char *jdup(const json_t *v)
{
    return json_is_string(v) ? strndup(json_string_value(v), json_string_length(v)) : NULL;
}

/* er = "FILE:LINE: message" about a bad input line; returns rc. */
__attribute__((format(printf, 5, 6)))
static int bad_line(kvz_eval_error *er, int rc, const char *file, int line, const char *fmt, ...)
{
    char msg[sizeof er->msg - 64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvz_eval_fail(er, rc, 1, 0, "%s:%d: %s", file, line, msg);
}

int kvz_eval_md_kind(const char *s)
{
    for (int k = 0; k < MD_N_KIND; k++)
        if (!strcmp(s, md_kinds[k])) return k;
    return -1;
}

/* A comma-separated list of names from names[n] -> use[]; what = the option. */
static int parse_names(const char *list, const char *const *names, int n, int *use, const char *what,
                       const char *noun)
{
    char **v = NULL;
    const int nv = kvz_eval_split_list(list, &v);
    int rc = nv < 0 ? nv : nv == 0 ? kvz_error_set(KVZ_ERR_ARG, "%s is empty", what) : 0;
    memset(use, 0, sizeof(int) * (size_t)n);
    for (int i = 0; i < nv && !rc; i++) {
        int k = 0;
        while (k < n && strcmp(v[i], names[k])) k++;
        if (k < n) use[k] = 1;
        else rc = kvz_error_set(KVZ_ERR_ARG, "%s: unknown %s '%s' (%s, %s, %s)", what, noun, v[i], names[0],
                                names[1], names[2]);
    }
    kvz_eval_list_free(v, nv);
    return rc;
}

int kvz_eval_md_parse_methods(const char *list, int use[KVZ_EVAL_MD_N_METHOD])
{
    return parse_names(list, md_method_name, MD_N_METHOD, use, "--methods", "method");
}

int kvz_eval_md_parse_kinds(const char *list, int use_kind[KVZ_EVAL_MD_N_KIND])
{
    return parse_names(list, md_kinds, MD_N_KIND, use_kind, "--kinds", "kind");
}

typedef struct md_file {
    char *name, *path;
    kvz_tokens toks;
    int32_t n_parts;
    int first_unit;
} md_file;

typedef struct md_unit {        /* a document, or one part of a split one */
    char *id;                   /* NAME or NAME#N */
    int file;
    int32_t s0, s1;             /* token span in the file */
    float *k, *v;               /* (n_layer, n_kv_head, n_prefix + n_ctx, head_dim) once scored */
    float *scores;              /* (n_layer, n_kv_head, n_ctx) */
    uint8_t *keep;
    double keep_ratio;          /* the ratio keep holds, 0 = none */
    double score_s;
} md_unit;

typedef struct md_q {
    char *id, *question, *answer;
    int kind;
    char **accept;
    int n_accept;
    char **docs;                /* as written */
    int n_docs;
    json_t *oracle;             /* as written (int, string or array), NULL = none */
    int *units, n_units;        /* docs expanded to units */
    int *ounits, n_ounits;      /* oracle expanded; 0 = no oracle */
    int line;
    kvz_tokens qt, at;
} md_q;

typedef struct md_rec {         /* one line of --out */
    char *qid;
    int method;
    double ratio;
    int correct;
    double nll;
    int64_t q_pos;
    double rows_per_head;
    kvz_tokens tokens;
} md_rec;

typedef struct md_comp {        /* one composed context and who is answered from it */
    int placement;
    int *units, n_units;
    int *q, *m, n;              /* (question, method) pairs */
} md_comp;

struct kvz_eval_md {
    kvz_model *m;
    const kvz_config *c;
    const kvz_tokenizer *tok;
    kvz_eval_io io;
    int max_tokens;
    double t_score, seconds;
    int64_t n_answers;
    int use_kind[MD_N_KIND];
    char **want;                /* --ids (n_want) */
    int n_want;
    long limit;
    char *root;                 /* DOC paths are relative to it ("" or ends in '/'), NULL = the file's folder */
    char *qa_path;
    char header[1024];
    md_file *files;
    int nfiles;
    md_unit *units;
    int nunits;
    md_q *q;
    int nq;
    md_rec *recs;
    int nrecs;
    md_comp *comps;
    int ncomps;
    double *ratios;
    int nr;
    int use[MD_N_METHOD];
    float key_scale;
    int32_t max_part;
    kvz_tokens prefix;
    FILE *out;
    char *out_path;
    int need_nl;                /* --out's last line lacks its newline */
};
typedef struct kvz_eval_md md;
typedef kvz_eval_answer run;

/* "NAME#N" -> base length and N (0 when the id names no part). */
static size_t md_split_id(const char *id, int *part)
{
    *part = 0;
    const char *h = strrchr(id, '#');
    if (!h || !h[1]) return strlen(id);
    long v = 0;
    for (const char *p = h + 1; *p; p++) {
        if (*p < '0' || *p > '9' || v > 100000) return strlen(id);
        v = v * 10 + (*p - '0');
    }
    if (v < 1) return strlen(id);
    *part = (int)v;
    return (size_t)(h - id);
}

static int md_find_file(md *d, const char *name, size_t n)
{
    for (int i = 0; i < d->nfiles; i++)
        if (strlen(d->files[i].name) == n && !strncmp(d->files[i].name, name, n)) return i;
    return -1;
}

/* Parse and check one question line (no model needed). Returns 0, KVZ_ERR_FORMAT
 * (bad line) or KVZ_ERR_NOTFOUND (unknown document) with the message in er. */
static int md_parse_line(md *d, const char *qa_path, const char *root, int line_no, const char *p,
                         size_t len, md_q *q, kvz_eval_error *er)
{
    memset(q, 0, sizeof *q);
    q->line = line_no;
    json_error_t err;
    json_t *o = json_loadb(p, len, 0, &err);
    if (!o || !json_is_object(o)) {
        bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no, "%s",
                      !o && strstr(err.text, "end of file expected") ? "text after the object" : "not a JSON object");
        json_decref(o);
        return KVZ_ERR_FORMAT;
    }
    int rc = KVZ_ERR_FORMAT;
    const json_t *id = json_object_get(o, "id"), *kind = json_object_get(o, "kind"),
                 *docs = json_object_get(o, "docs"), *qs = json_object_get(o, "question"),
                 *an = json_object_get(o, "answer"), *ac = json_object_get(o, "accept"),
                 *or = json_object_get(o, "oracle");
    if (!json_is_string(id) || !json_is_string(kind) || !json_is_string(qs) || !json_is_string(an) ||
        !json_string_length(id) || !json_string_length(qs) || !json_string_length(an)) {
        bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no,
                 "\"id\", \"kind\", \"question\" and \"answer\" must be non-empty strings");
        goto out;
    }
    q->id = jdup(id);
    q->question = jdup(qs);
    q->answer = jdup(an);
    if (!q->id || !q->question || !q->answer) {
        rc = kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "%s:%d: out of memory", qa_path, line_no);
        goto out;
    }
    if ((q->kind = kvz_eval_md_kind(json_string_value(kind))) < 0) {
        bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no,
                 "question '%s': kind '%s' unknown (long, retrieval, cross)",
                    q->id, json_string_value(kind));
        goto out;
    }
    if (!json_is_array(docs) || json_array_size(docs) < 1 || json_array_size(docs) > KVZ_COMPOSE_MAX_DOCS) {
        bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no,
                 "question '%s': \"docs\" must be an array of 1 to %d document ids",
                    q->id, KVZ_COMPOSE_MAX_DOCS);
        goto out;
    }
    q->n_docs = (int)json_array_size(docs);
    if (!(q->docs = calloc((size_t)q->n_docs, sizeof *q->docs))) {
        q->n_docs = 0;
        rc = kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "%s:%d: out of memory", qa_path, line_no);
        goto out;
    }
    for (int i = 0; i < q->n_docs; i++) {
        q->docs[i] = jdup(json_array_get(docs, i));
        if (!q->docs[i] || !q->docs[i][0]) {
            bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no,
                     "question '%s': \"docs\" must hold non-empty strings", q->id);
            goto out;
        }
        int pi, pj;
        size_t bi = md_split_id(q->docs[i], &pi);
        for (int j = 0; j < i; j++) {
            size_t bj = md_split_id(q->docs[j], &pj);
            if (bi == bj && !strncmp(q->docs[i], q->docs[j], bi) && (pi == 0 || pj == 0 || pi == pj)) {
                if (strcmp(q->docs[i], q->docs[j]))
                    bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no,
                             "question '%s': document '%s' is named twice (as '%s' and '%s')",
                                q->id, pi ? q->docs[j] : q->docs[i],
                                q->docs[j], q->docs[i]);
                else
                    bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no,
                             "question '%s': document '%s' is named twice",
                                q->id, q->docs[i]);
                goto out;
            }
        }
        if (md_find_file(d, q->docs[i], bi) < 0) {
            char *path = malloc(strlen(root) + bi + 2);
            md_file *nf = realloc(d->files, sizeof *d->files * (size_t)(d->nfiles + 1));
            if (nf) d->files = nf;
            if (!path || !nf) {
                free(path);
                rc = kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "%s:%d: out of memory", qa_path, line_no);
                goto out;
            }
            sprintf(path, "%s%.*s", root, (int)bi, q->docs[i]);
            struct stat st;
            if (stat(path, &st) || !S_ISREG(st.st_mode)) {
                bad_line(er, KVZ_ERR_NOTFOUND, qa_path, line_no,
                         "question '%s': unknown document '%s' (no file %s)",
                            q->id, q->docs[i], path);
                free(path);
                rc = KVZ_ERR_NOTFOUND;
                goto out;
            }
            md_file *f = &d->files[d->nfiles];
            memset(f, 0, sizeof *f);
            if (!(f->name = strndup(q->docs[i], bi))) {
                free(path);
                rc = kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "%s:%d: out of memory", qa_path, line_no);
                goto out;
            }
            f->path = path;
            d->nfiles++;
        }
    }
    if (ac) {
        if (!json_is_array(ac)) {
            bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no,
                     "question '%s': \"accept\" must be an array of strings", q->id);
            goto out;
        }
        if (!(q->accept = calloc(json_array_size(ac) + 1, sizeof *q->accept))) {
            rc = kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "%s:%d: out of memory", qa_path, line_no);
            goto out;
        }
        for (size_t i = 0; i < json_array_size(ac); i++) {
            if (!(q->accept[q->n_accept] = jdup(json_array_get(ac, i)))) {
                bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no,
                         "question '%s': \"accept\" must be an array of strings", q->id);
                goto out;
            }
            q->n_accept++;
        }
    }
    if (q->n_accept == 0) {
        free(q->accept);
        if (!(q->accept = malloc(sizeof *q->accept)) || !(q->accept[0] = strdup(q->answer))) {
            rc = kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "%s:%d: out of memory", qa_path, line_no);
            goto out;
        }
        q->n_accept = 1;
    }
    if (or && !json_is_null(or)) {
        int ok = 1;
        if (json_is_integer(or)) {
            ok = q->n_docs == 1 && json_integer_value(or) >= 1;
        } else if (json_is_string(or) || json_is_array(or)) {
            size_t n = json_is_string(or) ? 1 : json_array_size(or);
            ok = n >= 1;
            for (size_t k = 0; k < n && ok; k++) {
                const json_t *x = json_is_string(or) ? or : json_array_get(or, k);
                int hit = 0;
                for (int i = 0; json_is_string(x) && i < q->n_docs; i++) hit |= !strcmp(json_string_value(x), q->docs[i]);
                ok = hit;
            }
        } else {
            ok = 0;
        }
        if (!ok) {
            bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no,
                     "question '%s': \"oracle\" must be a part number (one split "
                        "document) or ids taken from \"docs\"", q->id);
            goto out;
        }
        q->oracle = json_incref((json_t *)or);
    }
    for (int i = 0; i < d->nq; i++)
        if (!strcmp(d->q[i].id, q->id)) {
            bad_line(er, KVZ_ERR_FORMAT, qa_path, line_no,
                     "question id '%s' given twice (also line %d)", q->id, d->q[i].line);
            goto out;
        }
    rc = 0;
out:
    json_decref(o);
    return rc;
}

/* docs id -> units appended to *v (a split file's id means all its parts).
 * KVZ_ERR_NOTFOUND: no such file or part; KVZ_ERR_NOMEM. */
static int md_expand(md *d, const char *id, int **v, int *n)
{
    int part;
    size_t b = md_split_id(id, &part);
    int fi = md_find_file(d, id, b);
    if (fi < 0) return KVZ_ERR_NOTFOUND;
    const md_file *f = &d->files[fi];
    if (part > 0 && (f->n_parts == 1 || part > f->n_parts)) return KVZ_ERR_NOTFOUND;
    const int a = part ? f->first_unit + part - 1 : f->first_unit;
    const int e = part ? a + 1 : f->first_unit + f->n_parts;
    for (int u = a; u < e; u++) {
        int *nv = realloc(*v, sizeof **v * (size_t)(*n + 1));
        if (!nv) return KVZ_ERR_NOMEM;
        *v = nv;
        (*v)[(*n)++] = u;
    }
    return 0;
}

/* A new zeroed record at the end of d->recs, NULL when out of memory. */
static md_rec *md_push_rec(md *d)
{
    md_rec *v = realloc(d->recs, sizeof *d->recs * (size_t)(d->nrecs + 1));
    if (!v) return NULL;
    d->recs = v;
    memset(&v[d->nrecs], 0, sizeof *v);
    return &v[d->nrecs++];
}

static int md_record_done(const md *d, const char *qid, int method, double ratio)
{
    for (int i = 0; i < d->nrecs; i++)
        if (d->recs[i].method == method && fabs(d->recs[i].ratio - ratio) < 1e-9 && !strcmp(d->recs[i].qid, qid))
            return 1;
    return 0;
}

static const md_rec *md_find_rec(const md *d, const char *qid, int method, double ratio)
{
    for (int i = 0; i < d->nrecs; i++)
        if (d->recs[i].method == method && fabs(d->recs[i].ratio - ratio) < 1e-9 && !strcmp(d->recs[i].qid, qid))
            return &d->recs[i];
    return NULL;
}

/* Settings a results file is bound to: a rerun must use the same. */
static void md_header(const md *d, const char *model_path, char *buf, size_t n)
{
    const char *base = strrchr(model_path, '/');
    snprintf(buf, n, "{\"kvzip_eval_multidoc\": 1, \"model\": \"%s\", \"max_tokens\": %d, "
             "\"key_scale\": %g, \"part_tokens\": %d}", base ? base + 1 : model_path, d->max_tokens,
             (double)d->key_scale, d->max_part);
}

/* Read an existing --out: check its header against ours, load its records. A last
 * line cut short by a crash is dropped (the file is truncated to the last whole line). */
int kvz_eval_md_read_results(kvz_eval_md *d, const char *header, kvz_eval_error *er)
{
    if (header != d->header) snprintf(d->header, sizeof d->header, "%s", header);
    char *text = NULL;
    FILE *f = fopen(d->out_path, "r");
    if (!f) return 0; /* a new file */
    size_t cap = 0, len = 0;
    for (;;) {
        if (len + 65536 > cap) {
            char *t = realloc(text, cap = cap * 2 + 65536);
            if (!t) {
                free(text);
                fclose(f);
                return kvz_eval_fail(er, kvz_error_set(KVZ_ERR_NOMEM, "%zu bytes", cap), 0, 1, "cannot read %s", d->out_path);
            }
            text = t;
        }
        size_t r = fread(text + len, 1, cap - len - 1, f);
        len += r;
        if (r == 0) break;
    }
    const int read_error = ferror(f);
    fclose(f);
    text[len] = 0;
    int line_no = 0, rc = 0;
    /* a file not read whole, or with a NUL byte, is not cut back to its "last whole line" */
    if (read_error) {
        free(text);
        return kvz_eval_fail(er, kvz_error_set(KVZ_ERR_IO, "read error"), 0, 1, "cannot read %s", d->out_path);
    }
    const char *nul = memchr(text, 0, len);
    if (nul) {
        for (const char *p = text; p <= nul; p++) line_no += p == text || p[-1] == '\n';
        free(text);
        return kvz_eval_fail(er, KVZ_ERR_FORMAT, 1, 0, "%s:%d: a NUL byte: not a kvzip-eval --multidoc results file",
                             d->out_path, line_no);
    }
    size_t good = 0; /* bytes up to the end of the last whole, valid line */
    for (char *p = text; *p && !rc;) {
        char *nl = strchr(p, '\n');
        const size_t l = nl ? (size_t)(nl - p) : strlen(p);
        line_no++;
        json_error_t err;
        json_t *o = json_loadb(p, l, 0, &err);
        if (!o && !nl) {
            kvz_eval_say(&d->io, 1, "kvzip-eval: %s: dropping an incomplete last line (an interrupted run)",
                         d->out_path);
            break;
        }
        if (!json_is_object(o)) {
            bad_line(er, KVZ_ERR_FORMAT, d->out_path, line_no,
                     "not a JSON object: not a kvzip-eval --multidoc results file");
            rc = KVZ_ERR_FORMAT;
        } else if (line_no == 1) {
            json_t *h = json_loads(header, 0, NULL);
            if (!json_equal(o, h)) {
                char *s = json_dumps(o, JSON_COMPACT);
                kvz_eval_fail(er, KVZ_ERR_ARG, 1, 0, "%s was written with other settings (%s); use the same "
                        "model, --max-tokens, --key-scale and --part-tokens, or another --out (see kvzip-eval --help)",
                        d->out_path, s ? (s) : "?");
                free(s);
                rc = KVZ_ERR_ARG;
            }
            json_decref(h);
        } else {
            const json_t *qid = json_object_get(o, "id"), *me = json_object_get(o, "method"),
                         *ra = json_object_get(o, "ratio"), *co = json_object_get(o, "correct"),
                         *nl2 = json_object_get(o, "nll"), *tk = json_object_get(o, "tokens"),
                         *qp = json_object_get(o, "q_pos"), *rw = json_object_get(o, "rows_per_head");
            int m = -1;
            for (int k = 0; json_is_string(me) && k < MD_N_METHOD; k++)
                if (!strcmp(json_string_value(me), md_method_name[k])) m = k;
            int tokens_ok = json_is_array(tk);
            for (size_t i = 0; tokens_ok && i < json_array_size(tk); i++) {
                const json_t *t = json_array_get(tk, i);
                tokens_ok = json_is_integer(t) && json_integer_value(t) >= 0 && json_integer_value(t) <= INT32_MAX;
            }
            if (!json_is_string(qid) || m < 0 || !json_is_number(ra) || !json_is_boolean(co) ||
                !json_is_number(nl2) || !tokens_ok || !json_is_integer(qp) || !json_is_number(rw)) {
                bad_line(er, KVZ_ERR_FORMAT, d->out_path, line_no,
                         "a record without id, method, ratio, correct, nll, "
                            "tokens, q_pos or rows_per_head");
                rc = KVZ_ERR_FORMAT;
            } else {
                md_rec *r = md_push_rec(d);
                if (!r || !(r->qid = jdup(qid))) {
                    json_decref(o);
                    free(text);
                    return kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "%s: out of memory", d->out_path);
                }
                r->method = m;
                r->ratio = json_number_value(ra);
                r->correct = json_is_true(co);
                r->nll = json_number_value(nl2);
                r->q_pos = json_integer_value(qp);
                r->rows_per_head = json_number_value(rw);
                for (size_t i = 0; i < json_array_size(tk) && !rc; i++)
                    if (kvz_tokens_push(&r->tokens, (int32_t)json_integer_value(json_array_get(tk, i))))
                        rc = kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "%s: out of memory", d->out_path);
            }
        }
        json_decref(o);
        if (!nl) { /* a whole record without its newline (an edited file): end the line first */
            good = len;
            d->need_nl = 1;
            break;
        }
        good = (size_t)(nl + 1 - text);
        p = nl + 1;
    }
    free(text);
    if (!rc && good < len && truncate(d->out_path, (off_t)good)) {
        rc = kvz_eval_fail(er, KVZ_ERR_IO, 0, 0, "%s: cannot drop the incomplete last line", d->out_path);
    }
    return rc;
}

static int md_write_rec(md *d, const md_q *q, int method, double ratio, const kvz_compose_meta *cm,
                        const run *r, const kvz_tokens *gen, double compose_s, double answer_s)
{
    FILE *f = d->out;
    const double rph = (double)cm->rows / ((double)d->c->n_layer * d->c->n_kv_head);
    fprintf(f, "{\"id\": ");
    kvz_eval_json_str(f, q->id);
    fprintf(f, ", \"kind\": \"%s\", \"method\": \"%s\", \"ratio\": %g, \"placement\": \"%s\", "
            "\"units\": %d, \"n_prefix\": %d, \"q_pos\": %d, \"rows_per_head\": %.1f, \"rows_full_per_head\": %.1f, "
            "\"correct\": %s, \"nll\": %.6f, \"compose_s\": %.3f, \"answer_s\": %.3f, \"answer\": ",
            md_kinds[q->kind], md_method_name[method], ratio,
            cm->placement == KVZ_PLACE_PARALLEL ? "parallel" : "sequential", cm->n_docs, cm->n_prefix, cm->q_pos, rph,
            (double)cm->rows_full / ((double)d->c->n_layer * d->c->n_kv_head),
            r->correct ? "true" : "false", r->nll, compose_s, answer_s);
    kvz_eval_json_str(f, r->answer ? r->answer : "");
    fprintf(f, ", \"tokens\": [");
    for (size_t i = 0; i < gen->n; i++) fprintf(f, "%s%d", i ? "," : "", gen->ids[i]);
    fprintf(f, "]}\n");
    if (fflush(f) || ferror(f) || fsync(fileno(f)))
        return kvz_error_set(KVZ_ERR_IO, "%s: write failed", d->out_path);
    md_rec *x = md_push_rec(d);
    if (!x || !(x->qid = strdup(q->id))) return kvz_error_set(KVZ_ERR_NOMEM, "records");
    x->method = method;
    x->ratio = ratio;
    x->correct = r->correct;
    x->nll = r->nll;
    x->q_pos = cm->q_pos;
    x->rows_per_head = rph;
    for (size_t i = 0; i < gen->n; i++)
        if (kvz_tokens_push(&x->tokens, gen->ids[i])) return kvz_error_set(KVZ_ERR_NOMEM, "records");
    return 0;
}

/* Prefill and KVzip-score unit u; keep its rows (fp32) and scores. */
static int md_score_unit(md *d, int u)
{
    md_unit *un = &d->units[u];
    if (un->k) return 0;
    const kvz_config *c = d->c;
    const md_file *f = &d->files[un->file];
    const int32_t P = (int32_t)d->prefix.n, nc = un->s1 - un->s0;
    kvz_kvzip_params kp;
    kvz_kvzip_defaults(&kp);
    /* cache rows (a device batches chunks' repeat inputs: more rows) and positions (each
     * repeat input starts after the context, however batched: one chunk per pass) */
    kvz_kvzip_params kp1 = kp;
    kp1.repeat_rows = 0;
    const int64_t cap = kvz_kvzip_cache_rows(d->m, P, nc, &kp), span = kvz_kvzip_cache_rows(d->m, P, nc, &kp1);
    if (cap < 0 || span < 0) return (int)(cap < 0 ? cap : span);
    if (span > c->n_ctx)
        return kvz_error_set(KVZ_ERR_CONTEXT, "%s: %d tokens + scoring room exceed the model's %d-token "
                             "context (lower --part-tokens)", un->id, P + nc, c->n_ctx);
    const size_t L = (size_t)c->n_layer, H = (size_t)c->n_kv_head, hd = (size_t)c->head_dim;
    const size_t rows = (size_t)(P + nc);
    un->scores = malloc(sizeof(float) * L * H * (size_t)nc);
    un->k = malloc(sizeof(float) * L * H * rows * hd);
    un->v = malloc(sizeof(float) * L * H * rows * hd);
    un->keep = malloc(L * H * (size_t)nc);
    if (!un->scores || !un->k || !un->v || !un->keep) return kvz_error_set(KVZ_ERR_NOMEM, "%s: rows", un->id);
    kvz_kv *kv = NULL;
    int rc = kvz_kv_create(d->m, cap, 0, &kv);
    if (rc) return rc;
    const double t0 = kvz_now();
    kvz_eval_say(&d->io, 0, "  scoring %s (%d tokens)", un->id, nc);
    rc = kvz_kvzip_score(d->m, kv, d->prefix.ids, P, f->toks.ids + un->s0, nc, &kp, un->scores, NULL, NULL);
    /* the rows to the host through kvz_kv_get_head: any backend (a CUDA cache is bf16
     * on the device; the CPU backend copies its fp32 rows as they are) */
    int32_t *pos = rc ? NULL : malloc(sizeof(int32_t) * rows);
    if (!rc && !pos) rc = kvz_error_set(KVZ_ERR_NOMEM, "%s: rows", un->id);
    for (size_t l = 0; l < L && !rc; l++)
        for (size_t h = 0; h < H && !rc; h++) {
            const int64_t len = kvz_kv_len(kv, (int32_t)l, (int32_t)h);
            if (len != (int64_t)rows) { rc = kvz_error_set(KVZ_ERR_INTERNAL, "%s: %lld rows after scoring", un->id, (long long)len); break; }
            if ((rc = kvz_kv_get_head(kv, (int32_t)l, (int32_t)h, un->k + (l * H + h) * rows * hd,
                                      un->v + (l * H + h) * rows * hd, pos)))
                break;
            for (size_t j = 0; j < rows; j++)
                if (pos[j] != (int32_t)j) { rc = kvz_error_set(KVZ_ERR_INTERNAL, "%s: row %zu at position %d", un->id, j, pos[j]); break; }
        }
    free(pos);
    kvz_kv_free(kv);
    un->score_s = kvz_now() - t0;
    d->t_score += un->score_s;
    if (!rc) kvz_eval_say(&d->io, 0, "  scored %s in %.1f s", un->id, un->score_s);
    return rc;
}

static int md_add_comp(md *d, int placement, const int *units, int n, int qi, int method)
{
    if (n == 1) placement = KVZ_PLACE_SEQUENTIAL; /* one document: both placements are the same cache */
    int c = 0;
    for (; c < d->ncomps; c++) {
        const md_comp *x = &d->comps[c];
        if (x->placement == placement && x->n_units == n && !memcmp(x->units, units, sizeof(int) * (size_t)n)) break;
    }
    if (c == d->ncomps) {
        md_comp *v = realloc(d->comps, sizeof *d->comps * (size_t)(d->ncomps + 1));
        if (!v) return KVZ_ERR_NOMEM;
        d->comps = v;
        md_comp *x = &d->comps[d->ncomps];
        memset(x, 0, sizeof *x);
        x->placement = placement;
        x->n_units = n;
        if (!(x->units = malloc(sizeof(int) * (size_t)n))) return KVZ_ERR_NOMEM;
        memcpy(x->units, units, sizeof(int) * (size_t)n);
        d->ncomps++;
    }
    md_comp *x = &d->comps[c];
    int *nq = realloc(x->q, sizeof(int) * (size_t)(x->n + 1));
    if (nq) x->q = nq;
    int *nm = realloc(x->m, sizeof(int) * (size_t)(x->n + 1));
    if (nm) x->m = nm;
    if (!nq || !nm) return KVZ_ERR_NOMEM;
    x->q[x->n] = qi;
    x->m[x->n++] = method;
    return 0;
}

/* Answer every pending question of composition ci at ratio index ri. */
static int md_run_comp(md *d, int ci, int ri, kvz_eval_scratch *s, int *done_comps, int todo_comps)
{
    md_comp *x = &d->comps[ci];
    const double ratio = d->ratios[ri];
    int pending = 0;
    for (int i = 0; i < x->n; i++) pending += !md_record_done(d, d->q[x->q[i]].id, x->m[i], ratio);
    if (!pending) return 0;
    const kvz_config *c = d->c;
    int rc = 0;
    kvz_compose_src *src = calloc((size_t)x->n_units, sizeof *src);
    if (!src) return KVZ_ERR_NOMEM;
    int32_t max_seq = 0;
    for (int i = 0; i < x->n; i++) {
        const md_q *q = &d->q[x->q[i]];
        int32_t need = (int32_t)q->qt.n + (int32_t)(q->at.n > (size_t)d->max_tokens ? q->at.n : (size_t)d->max_tokens);
        if (need > max_seq) max_seq = need;
    }
    for (int k = 0; k < x->n_units && !rc; k++) {
        md_unit *un = &d->units[x->units[k]];
        if ((rc = md_score_unit(d, x->units[k]))) break;
        const int32_t nc = un->s1 - un->s0;
        if (ratio < 1.0 && un->keep_ratio != ratio) {
            int64_t kept = kvz_kvzip_select(un->scores, c->n_layer, c->n_kv_head, nc, (float)ratio,
                                            KVZ_EVICT_GLOBAL, un->keep, NULL);
            if (kept < 0) { rc = (int)kept; break; }
            un->keep_ratio = ratio;
        }
        src[k] = (kvz_compose_src){.k = un->k, .v = un->v, .keep = ratio < 1.0 ? un->keep : NULL,
                                   .n_prefix = (int32_t)d->prefix.n, .n_ctx = nc};
    }
    kvz_kv *kv = NULL;
    kvz_compose_meta cm;
    kvz_compose_opts co;
    kvz_compose_defaults(&co);
    co.placement = x->placement;
    co.key_scale = d->key_scale;
    co.reserve = max_seq;
    double t0 = kvz_now();
    if (!rc) rc = kvz_docs_compose_mem(d->m, src, x->n_units, &co, max_seq + 1, 0, &kv, &cm);
    const double compose_s = kvz_now() - t0;
    free(src);
    if (!rc)
        kvz_eval_say(&d->io, 0, "[r=%g %d/%d] %d part%s %s (%s%s), %.0f rows/head, q at %d: %d answer%s", ratio,
                *done_comps + 1, todo_comps, x->n_units, x->n_units == 1 ? "" : "s",
                x->placement == KVZ_PLACE_PARALLEL ? "parallel" : "sequential",
                d->units[x->units[0]].id, x->n_units > 1 ? ", ..." : "",
                (double)cm.rows / ((double)c->n_layer * c->n_kv_head), cm.q_pos, pending, pending == 1 ? "" : "s");
    /* one answer per question; every method answered from this cache gets a record */
    for (int i = 0; i < x->n && !rc; i++) {
        md_q *q = &d->q[x->q[i]];
        int first = 1;
        for (int j = 0; j < i; j++) first &= x->q[j] != x->q[i];
        if (!first) continue;
        int need = 0;
        for (int j = i; j < x->n; j++) need |= x->q[j] == x->q[i] && !md_record_done(d, q->id, x->m[j], ratio);
        if (!need) continue;
        run r = {0};
        t0 = kvz_now();
        if ((rc = kvz_eval_answer_question(d->m, s, kv, cm.q_pos, &q->qt, &q->at, d->max_tokens, NULL, &r))) break;
        d->n_answers++;
        const double answer_s = kvz_now() - t0;
        for (int a = 0; a < q->n_accept && !r.correct; a++) r.correct = kvz_eval_contains_ci(r.answer, q->accept[a]);
        for (int j = i; j < x->n && !rc; j++)
            if (x->q[j] == x->q[i] && !md_record_done(d, q->id, x->m[j], ratio))
                rc = md_write_rec(d, q, x->m[j], ratio, &cm, &r, &s->gen, compose_s, answer_s);
        kvz_eval_say(&d->io, 0, "  %s %s: %s (%.1f s) %s", q->id, md_method_name[x->m[i]], r.correct ? "correct" : "wrong",
                    answer_s, (r.answer));
        free(r.answer);
    }
    kvz_kv_free(kv);
    (*done_comps)++;
    return rc;
}

typedef struct md_agg {
    int n, correct, oracle_correct, n_agree_pairs, agree, n_dnll, n_dnll1;
    double dnll, dnll1, rows, qpos;
} md_agg;

static md_agg md_aggregate(const md *d, int kind, int method, double ratio)
{
    md_agg a = {0};
    for (int i = 0; i < d->nq; i++) {
        const md_q *q = &d->q[i];
        if (q->kind != kind) continue;
        const md_rec *r = md_find_rec(d, q->id, method, ratio);
        if (!r) continue;
        a.n++;
        a.correct += r->correct;
        a.rows += r->rows_per_head;
        a.qpos += (double)r->q_pos;
        const md_rec *o = md_find_rec(d, q->id, MD_ORACLE, ratio), *o1 = md_find_rec(d, q->id, MD_ORACLE, 1.0);
        if (o) {
            a.oracle_correct += o->correct;
            a.n_agree_pairs++;
            a.agree += r->tokens.n == o->tokens.n &&
                       (r->tokens.n == 0 || !memcmp(r->tokens.ids, o->tokens.ids, sizeof(int32_t) * r->tokens.n));
            a.n_dnll++;
            a.dnll += r->nll - o->nll;
        }
        if (o1) {
            a.n_dnll1++;
            a.dnll1 += r->nll - o1->nll;
        }
    }
    return a;
}

int kvz_eval_md_n_records(const kvz_eval_md *d)
{
    return d->nrecs;
}

int kvz_eval_md_write_tables(const kvz_eval_md *d, FILE *o)
{
    const double seconds = d->seconds;
    fprintf(o, "## kvzip-eval --multidoc: %d questions\n", d->nq);
    for (int k = 0; k < MD_N_KIND; k++) {
        int nk = 0;
        for (int i = 0; i < d->nq; i++) nk += d->q[i].kind == k;
        if (!nk) continue;
        fprintf(o, "\n### %s (%d questions)\n\n", md_kinds[k], nk);
        fprintf(o, "| method | ratio | n | correct | accuracy %% | vs oracle | agreement with oracle %% | "
               "ΔNLL vs oracle | ΔNLL vs oracle r=1 | rows/head | question at |\n");
        fprintf(o, "|---|---|---|---|---|---|---|---|---|---|---|\n");
        for (int ri = 0; ri < d->nr; ri++)
            for (int m = 0; m < MD_N_METHOD; m++) {
                if (!d->use[m]) continue;
                md_agg a = md_aggregate(d, k, m, d->ratios[ri]);
                if (!a.n) continue;
                char vs[32] = "–", ag[32] = "–", dn[32] = "–", dn1[32] = "–";
                if (a.n_agree_pairs && m != MD_ORACLE) {
                    if (a.oracle_correct) snprintf(vs, sizeof vs, "%d/%d = %.0f%%", a.correct, a.oracle_correct,
                                                   100.0 * a.correct / a.oracle_correct);
                    else snprintf(vs, sizeof vs, "%d/0", a.correct);
                    snprintf(ag, sizeof ag, "%.1f", 100.0 * a.agree / a.n_agree_pairs);
                    snprintf(dn, sizeof dn, "%+.3f", a.dnll / a.n_dnll);
                }
                if (a.n_dnll1 && !(m == MD_ORACLE && d->ratios[ri] == 1.0)) snprintf(dn1, sizeof dn1, "%+.3f", a.dnll1 / a.n_dnll1);
                fprintf(o, "| %s | %.2f | %d | %d | %.1f | %s | %s | %s | %s | %.0f | %.0f |\n", md_method_name[m],
                       d->ratios[ri], a.n, a.correct, 100.0 * a.correct / a.n, vs, ag, dn, dn1, a.rows / a.n,
                       a.qpos / a.n);
            }
    }
    fprintf(o, "\nvs oracle: correct answers of the method / of the oracle over the same questions. "
           "Agreement: greedy answer token-for-token equal to the oracle's at the same ratio. "
           "ΔNLL: mean NLL of the reference-answer tokens (teacher-forced) minus the oracle's, "
           "at the same ratio and against the oracle at r = 1. rows/head: composed KV rows per "
           "(layer, KV head), prefix included. question at: the position the question starts.\n");
    if (seconds > 0)
        fprintf(o, "\nThis run: %.1f s (KVzip scoring %.1f s, %lld answers).\n", seconds, d->t_score,
               (long long)d->n_answers);
    return ferror(o) ? kvz_error_set(KVZ_ERR_IO, "cannot write the tables") : 0;
}


/* ------------------------------------------------------------------------ */
/* Life cycle                                                                */

static void md_q_free(md_q *q)
{
    free(q->id); free(q->question); free(q->answer);
    for (int i = 0; i < q->n_accept; i++) free(q->accept[i]);
    free(q->accept);
    for (int i = 0; i < q->n_docs; i++) free(q->docs[i]);
    free(q->docs);
    json_decref(q->oracle);
    free(q->units); free(q->ounits);
    kvz_tokens_free(&q->qt);
    kvz_tokens_free(&q->at);
    memset(q, 0, sizeof *q);
}

int kvz_eval_md_create(const kvz_eval_md_opts *o, const kvz_eval_io *io, kvz_eval_md **out)
{
    *out = NULL;
    if (o->n_ratios < 1 || !o->out_path || !io->read_text)
        return kvz_error_set(KVZ_ERR_ARG, "kvz_eval_md_create: no ratio, results file or reader");
    md *d = calloc(1, sizeof *d);
    if (!d) return kvz_error_set(KVZ_ERR_NOMEM, "evaluation");
    d->io = *io;
    d->ratios = malloc(sizeof(double) * (size_t)o->n_ratios);
    d->out_path = strdup(o->out_path);
    int bad = !d->ratios || !d->out_path;
    if (!bad) memcpy(d->ratios, o->ratios, sizeof(double) * (size_t)o->n_ratios);
    d->nr = o->n_ratios;
    if (o->ids && !bad) bad = (d->n_want = kvz_eval_split_list(o->ids, &d->want)) < 0;
    if (o->root && !bad) {
        const size_t n = strlen(o->root);
        if ((d->root = malloc(n + 2)))
            sprintf(d->root, "%s%s", o->root, n && o->root[n - 1] != '/' ? "/" : "");
        bad = !d->root;
    }
    if (bad) {
        kvz_eval_md_free(d);
        return kvz_error_set(KVZ_ERR_NOMEM, "evaluation");
    }
    memcpy(d->use, o->use, sizeof d->use);
    memcpy(d->use_kind, o->use_kind, sizeof d->use_kind);
    d->limit = o->limit;
    d->max_tokens = o->max_tokens;
    d->key_scale = o->key_scale;
    d->max_part = o->part_tokens;
    *out = d;
    return 0;
}

void kvz_eval_md_free(kvz_eval_md *d)
{
    if (!d) return;
    for (int i = 0; i < d->nq; i++) md_q_free(&d->q[i]);
    for (int f = 0; f < d->nfiles; f++) {
        free(d->files[f].name); free(d->files[f].path);
        kvz_tokens_free(&d->files[f].toks);
    }
    for (int u = 0; u < d->nunits; u++) {
        md_unit *x = &d->units[u];
        free(x->id); free(x->k); free(x->v); free(x->scores); free(x->keep);
    }
    for (int i = 0; i < d->nrecs; i++) {
        free(d->recs[i].qid);
        kvz_tokens_free(&d->recs[i].tokens);
    }
    for (int c = 0; c < d->ncomps; c++) {
        free(d->comps[c].units); free(d->comps[c].q); free(d->comps[c].m);
    }
    if (d->n_want > 0) kvz_eval_list_free(d->want, d->n_want);
    kvz_tokens_free(&d->prefix);
    if (d->out) fclose(d->out);
    free(d->q); free(d->files); free(d->units); free(d->recs); free(d->comps);
    free(d->ratios); free(d->root); free(d->qa_path); free(d->out_path);
    free(d);
}

int kvz_eval_md_add_questions(kvz_eval_md *d, const char *qa_path, const char *text, size_t len,
                              kvz_eval_error *er)
{
    if (!d->root) {
        if (!(d->root = strdup(qa_path))) return kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "out of memory");
        char *slash = strrchr(d->root, '/');
        if (slash) slash[1] = 0;
        else d->root[0] = 0;
    }
    free(d->qa_path);
    if (!(d->qa_path = strdup(qa_path))) return kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "out of memory");
    int *hit = calloc((size_t)d->n_want + 1, sizeof *hit);
    if (!hit) return kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "out of memory");
    int line_no = 0, n_lines = 0, rc = 0;
    for (const char *p = text, *end = text + len; p < end && *p && !rc;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const size_t n = nl ? (size_t)(nl - p) : strnlen(p, (size_t)(end - p));
        line_no++;
        size_t k = 0;
        while (k < n && isspace((unsigned char)p[k])) k++;
        if (k < n) {
            md_q q;
            n_lines++;
            if ((rc = md_parse_line(d, qa_path, d->root, line_no, p, n, &q, er))) {
                md_q_free(&q);
                break;
            }
            int keep = d->use_kind[q.kind] && (!d->limit || d->nq < d->limit);
            if (d->n_want) {
                int h = 0;
                for (int w = 0; w < d->n_want; w++)
                    if (!strcmp(d->want[w], q.id)) h = hit[w] = 1;
                keep &= h;
            }
            md_q *nq = keep ? realloc(d->q, sizeof *d->q * (size_t)(d->nq + 1)) : NULL;
            if (nq) {
                d->q = nq;
                d->q[d->nq++] = q;
            } else {
                md_q_free(&q);
                if (keep) rc = kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "%s: out of memory", qa_path);
            }
        }
        p = nl ? nl + 1 : p + n;
    }
    for (int w = 0; w < d->n_want && !rc; w++)
        if (!hit[w])
            rc = kvz_eval_fail(er, KVZ_ERR_NOTFOUND, 1, 0, "--ids: %s has no question '%s'", qa_path, d->want[w]);
    if (!rc && d->nq == 0)
        rc = kvz_eval_fail(er, KVZ_ERR_FORMAT, 1, 0, "%s: no questions selected (%d lines)", qa_path, n_lines);
    free(hit);
    return rc;
}

int kvz_eval_md_open_results(kvz_eval_md *d, kvz_model *m, const char *model_path, kvz_eval_error *er)
{
    d->m = m;
    d->c = kvz_model_config(m);
    d->tok = kvz_model_tokenizer(m);
    const int32_t max_part = kvz_ingest_max_part_tokens(m);
    if (d->max_part <= 0 || d->max_part > max_part) d->max_part = max_part;
    md_header(d, model_path, d->header, sizeof d->header);
    return kvz_eval_md_read_results(d, d->header, er);
}

/* Tokenize the files, cut them into parts, expand every question's documents into
 * units and register its compositions. Returns the longest question + answer. */
static int md_prepare(md *d, int32_t *max_seq_out, kvz_eval_error *er)
{
    const char *qa_path = d->qa_path;
    int rc;
    if ((rc = kvz_chat_prefix(d->tok, &d->prefix)))
        return kvz_eval_fail(er, rc, 0, 1, "cannot build the system prefix");
    for (int f = 0; f < d->nfiles; f++) {
        md_file *fl = &d->files[f];
        char *text = NULL;
        size_t len = 0;
        if ((rc = d->io.read_text(fl->path, (size_t)256 << 20, &text, &len)) ||
            (rc = kvz_tokenizer_encode(d->tok, text, len, 0, &fl->toks))) {
            free(text);
            return kvz_eval_fail(er, rc, 1, 1, "cannot use document %s", fl->path);
        }
        free(text);
        fl->n_parts = kvz_ingest_n_parts((int32_t)fl->toks.n, d->max_part);
        fl->first_unit = d->nunits;
        for (int32_t p = 0; p < fl->n_parts; p++) {
            md_unit *nu = realloc(d->units, sizeof *d->units * (size_t)(d->nunits + 1));
            if (!nu) return kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "out of memory");
            d->units = nu;
            md_unit *u = &d->units[d->nunits++];
            memset(u, 0, sizeof *u);
            u->file = f;
            kvz_ingest_part_span((int32_t)fl->toks.n, fl->n_parts, p, &u->s0, &u->s1);
            if (!(u->id = malloc(strlen(fl->name) + 16))) return kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "out of memory");
            if (fl->n_parts == 1) strcpy(u->id, fl->name);
            else sprintf(u->id, "%s#%d", fl->name, p + 1);
        }
    }
    int32_t max_seq = 0;
    for (int i = 0; i < d->nq; i++) {
        md_q *q = &d->q[i];
        for (int k = 0; k < q->n_docs; k++)
            if ((rc = md_expand(d, q->docs[k], &q->units, &q->n_units)) == KVZ_ERR_NOMEM) {
                return kvz_eval_fail(er, rc, 0, 0, "out of memory");
            } else if (rc) {
                int part;
                const md_file *fl = &d->files[md_find_file(d, q->docs[k], md_split_id(q->docs[k], &part))];
                return bad_line(er, KVZ_ERR_NOTFOUND, qa_path, q->line,
                                "question '%s': unknown document '%s' (%s has %d part%s of at most "
                            "%d tokens)", q->id, q->docs[k], fl->name,
                            fl->n_parts, fl->n_parts == 1 ? "" : "s", d->max_part);
            }
        if (q->oracle && json_is_integer(q->oracle)) {
            int part;
            const md_file *fl = &d->files[md_find_file(d, q->docs[0], md_split_id(q->docs[0], &part))];
            const json_int_t n = json_integer_value(q->oracle);
            if (part || fl->n_parts < 2 || n > fl->n_parts) {
                bad_line(er, KVZ_ERR_FORMAT, qa_path, q->line,
                         "question '%s': oracle part %lld, but '%s' has %d part%s here "
                            "(parts hold the default --part-tokens)", q->id, (long long)n,
                            q->docs[0], part ? 1 : fl->n_parts, (part ? 1 : fl->n_parts) == 1 ? "" : "s");
                return KVZ_ERR_FORMAT;
            }
            if (!(q->ounits = malloc(sizeof(int)))) return kvz_eval_fail(er, KVZ_ERR_NOMEM, 0, 0, "out of memory");
            q->ounits[0] = fl->first_unit + (int)n - 1;
            q->n_ounits = 1;
        } else if (q->oracle) {
            const size_t n = json_is_string(q->oracle) ? 1 : json_array_size(q->oracle);
            for (int k = 0; k < q->n_docs; k++) /* in the order of docs */
                for (size_t j = 0; j < n; j++) {
                    const json_t *x = json_is_string(q->oracle) ? q->oracle : json_array_get(q->oracle, j);
                    if (!strcmp(json_string_value(x), q->docs[k]) &&
                        (rc = md_expand(d, q->docs[k], &q->ounits, &q->n_ounits)))
                        return kvz_eval_fail(er, rc, 0, 0, "out of memory");
                }
        }
        for (int a = 0; a < q->n_units; a++)
            for (int b = 0; b < a; b++)
                if (q->units[a] == q->units[b]) {
                    bad_line(er, KVZ_ERR_FORMAT, qa_path, q->line,
                             "question '%s': document '%s' is named twice",
                                q->id, d->units[q->units[a]].id);
                    return KVZ_ERR_FORMAT;
                }
        if ((rc = kvz_chat_question(d->tok, q->question, &q->qt)) ||
            (rc = kvz_tokenizer_encode(d->tok, q->answer, strlen(q->answer), 0, &q->at))) {
            return kvz_eval_fail(er, rc, 1, 1, "question '%s': cannot tokenize", q->id);
        }
        if (q->at.n == 0) {
            bad_line(er, KVZ_ERR_FORMAT, qa_path, q->line, "question '%s': the answer has no tokens", q->id);
            return KVZ_ERR_FORMAT;
        }
        int32_t need = (int32_t)q->qt.n + (int32_t)(q->at.n > (size_t)d->max_tokens ? q->at.n : (size_t)d->max_tokens);
        if (need > max_seq) max_seq = need;
        if ((d->use[MD_SEQ] && (rc = md_add_comp(d, KVZ_PLACE_SEQUENTIAL, q->units, q->n_units, i, MD_SEQ))) ||
            (d->use[MD_PAR] && (rc = md_add_comp(d, KVZ_PLACE_PARALLEL, q->units, q->n_units, i, MD_PAR))) ||
            (d->use[MD_ORACLE] && q->n_ounits &&
             (rc = md_add_comp(d, KVZ_PLACE_SEQUENTIAL, q->ounits, q->n_ounits, i, MD_ORACLE))))
            return kvz_eval_fail(er, rc, 0, 0, "out of memory");
    }
    *max_seq_out = max_seq;
    return 0;
}

int kvz_eval_md_run(kvz_eval_md *d, kvz_eval_error *er)
{
    int32_t max_seq = 0;
    int rc = md_prepare(d, &max_seq, er);
    if (rc) return rc;
    int todo = 0, done = 0;
    for (int ri = 0; ri < d->nr; ri++)
        for (int c = 0; c < d->ncomps; c++) {
            int pend = 0;
            for (int i = 0; i < d->comps[c].n; i++)
                pend |= !md_record_done(d, d->q[d->comps[c].q[i]].id, d->comps[c].m[i], d->ratios[ri]);
            todo += pend;
        }
    kvz_eval_say(&d->io, 0, "kvzip-eval --multidoc: %d questions, %d files (%d parts of <= %d tokens), %d ratios, "
                 "%d compositions to run, %d answers recorded in %s", d->nq, d->nfiles, d->nunits, d->max_part,
                 d->nr, todo, d->nrecs, d->out_path);
    /* the results file: header on a new file */
    struct stat st;
    const int fresh = stat(d->out_path, &st) || st.st_size == 0;
    if (!(d->out = fopen(d->out_path, "a")))
        return kvz_eval_fail(er, KVZ_ERR_IO, 0, 0, "%s: cannot open for appending", d->out_path);
    if (fresh) fprintf(d->out, "%s\n", d->header);
    else if (d->need_nl) fputc('\n', d->out);
    fflush(d->out);
    kvz_eval_scratch s;
    if ((rc = kvz_eval_scratch_init(&s, d->m, max_seq)))
        return kvz_eval_fail(er, rc, 0, 1, "cannot allocate the answer buffers");
    const double t_start = kvz_now();
    for (int ri = 0; ri < d->nr && !rc; ri++)
        for (int c = 0; c < d->ncomps && !rc; c++) rc = md_run_comp(d, c, ri, &s, &done, todo);
    d->seconds = kvz_now() - t_start;
    kvz_eval_scratch_free(&s);
    const int closed = fclose(d->out);
    d->out = NULL;
    if (closed && !rc) rc = kvz_error_set(KVZ_ERR_IO, "%s: write failed", d->out_path);
    if (rc) return kvz_eval_fail(er, rc, 0, 1, "multi-document evaluation failed");
    return 0;
}
