/* kvzip-eval: KVzip against eviction baselines on a question/answer set (DESIGN §6).
 *
 * Data flow per document (everything in memory, no store):
 *   tokens -> kvz_kvzip_score (once; the cache then holds prefix + context = "full")
 *          -> per question on the full cache: teacher-forced pass of question +
 *             reference answer (NLL, and the SnapKV hook records the question's
 *             attention to the context), then a greedy answer
 *          -> per ratio and method: keep mask -> gather kept rows into a second
 *             cache (fp32, original positions) -> the same two passes per question.
 * Only this file prints; the libraries return codes. */
#include <cblas.h>
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "cli_util.h"
#include "kvz_error.h"
#include "kvz_compose_mem.h"
#include "kvz_generate.h"
#include "kvz_ingest.h"
#include "kvz_kvrow.h"
#include "kvz_kvzip.h"
#include "kvz_model.h"
#include "kvz_parts.h"

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

/* ------------------------------------------------------------------------ */
/* QA set (JSON lines)                                                       */

typedef struct qa {
    char *doc;          /* as written in the file */
    char *path;         /* resolved against the file's folder */
    char *question, *answer;
    char **accept;
    int n_accept;
    int doc_idx;        /* index into the document table */
    int idx_in_doc;     /* 0-based order among the selected questions of its document */
} qa;

static void qa_free(qa *q)
{
    free(q->doc); free(q->path); free(q->question); free(q->answer);
    for (int i = 0; i < q->n_accept; i++) free(q->accept[i]);
    free(q->accept);
}

/* A JSON string value -> malloc'd UTF-8 copy (jansson has checked the encoding and
 * rejected \u0000); NULL when @p v is not a string. */
static char *jdup(const json_t *v)
{
    return json_is_string(v) ? strndup(json_string_value(v), json_string_length(v)) : NULL;
}

/* One line -> q, parsed by jansson. Returns 0, or -1 with a reason in why. */
static int parse_qa(const char *line, size_t len, qa *q, const char **why)
{
    memset(q, 0, sizeof *q);
    *why = "not a JSON object";
    json_error_t err;
    json_t *o = json_loadb(line, len, 0, &err); /* also rejects text after the object */
    if (!o) {
        if (strstr(err.text, "end of file expected")) *why = "text after the object";
        return -1;
    }
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
    if (!(q->doc = jdup(d)) || !(q->question = jdup(qs)) || !(q->answer = jdup(an))) goto bad;
    if (ac) {
        *why = "\"accept\" must be an array of strings";
        if (!json_is_array(ac)) goto bad;
        size_t n = json_array_size(ac);
        if (n && !(q->accept = calloc(n, sizeof *q->accept))) goto bad;
        for (size_t i = 0; i < n; i++) {
            if (!(q->accept[i] = jdup(json_array_get(ac, i)))) goto bad;
            q->n_accept++;
        }
    }
    if (!q->doc[0] || !q->question[0] || !q->answer[0]) { *why = "empty \"doc\", \"question\" or \"answer\""; goto bad; }
    if (q->n_accept == 0) {
        free(q->accept);
        q->accept = malloc(sizeof *q->accept);
        if (!q->accept || !(q->accept[0] = strdup(q->answer))) goto bad;
        q->n_accept = 1;
    }
    json_decref(o);
    return 0;
bad:
    json_decref(o);
    qa_free(q);
    memset(q, 0, sizeof *q);
    return -1;
}

/* 1 if hay contains needle, ASCII case-insensitively. */
static int contains_ci(const char *hay, const char *needle)
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

/* ------------------------------------------------------------------------ */
/* Methods and results                                                       */

enum { M_KVZIP, M_RANDOM, M_WINDOW, M_SNAPKV, M_SNAPKV_Q1, N_METHOD };
static const char *const method_name[N_METHOD] = {"kvzip", "random", "window", "snapkv", "snapkv-q1"};
static const char *const method_color[N_METHOD] = {"#9400d3", "#009e73", "#56b4e9", "#e69f00", "#d55e00"};
#define N_SINK 4        /* window baseline: first context tokens always kept */
#define SNAP_POOL 7     /* SnapKV max-pool kernel over the token axis */

typedef struct run {
    int done;
    int agree, correct;
    double nll;          /* mean NLL of the reference answer tokens */
    double kv_bytes;     /* fp16 K+V of the cache answered from */
    char *answer;
} run;

typedef struct docinfo {
    char *name, *path;
    int32_t n_prefix, n_ctx, n_q;
    double score_s, total_s;
} docinfo;

typedef struct eval {
    kvz_model *m;
    const kvz_config *c;
    const kvz_tokenizer *tok;
    qa *q;
    int nq;
    docinfo *docs;
    int ndocs;
    double *ratios;
    int nr;
    int use[N_METHOD];
    int max_tokens;
    uint64_t seed;
    int quiet, tty;
    int kv_dtype;        /* stored-type round trip of compressed caches, -1 none */
    run *full;           /* (nq) */
    kvz_tokens *full_gen;/* (nq) greedy tokens on the full cache */
    run *runs;           /* (nq, N_METHOD, nr) */
    double t_score, t_answer;
    int64_t n_answers;
} eval;

static run *R(eval *e, int qi, int m, int r) { return &e->runs[((size_t)qi * N_METHOD + m) * e->nr + r]; }

/* ------------------------------------------------------------------------ */
/* SnapKV observation: attention of the window queries to the context        */

typedef struct snap_ctx {
    const kvz_config *c;
    int32_t n_prefix, n_ctx;
    int32_t n_win;       /* window = the question + postfix tokens */
    int64_t row_doc;     /* cache rows of prefix + context = row of the first window token */
    float *acc;          /* (n_layer, n_head, n_ctx): sum over window queries of softmax prob */
    float *work;
    size_t work_floats;
} snap_ctx;

/* Hook on the full cache's teacher-forced pass. For query head g of KV head h and
 * each window query i, p = softmax over every key visible to i (prefix, context,
 * window tokens up to i) of q·k/√d; acc[l, g, j] += p[context token j]. Queries
 * after the window (the reference answer) are ignored. */
static int snap_hook(void *vctx, int32_t l, const float *q, const float *k_new, int32_t n,
                     int64_t row0, const kvz_kv *kv)
{
    (void)k_new;
    snap_ctx *s = vctx;
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
        int rc = kvz_kv_view(kv, l, h, &K, NULL, NULL, &len);
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
static int build_cache(const eval *e, const kvz_kv *full, kvz_kv *dst, int32_t n_prefix,
                       int32_t n_ctx, const uint8_t *keep, float *kb, float *vb, int32_t *pb,
                       uint64_t *rows)
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
            int rc = kvz_kv_view(full, l, h, &k, &v, &pos, &len);
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

typedef struct scratch {
    float *logits;       /* (max seq, n_vocab) */
    int32_t *seq;
    kvz_tokens gen;
    char *text;
    size_t text_cap;
} scratch;

static int decode_text(eval *e, scratch *s, const kvz_tokens *t)
{
    size_t len = 0;
    for (size_t i = 0; i < t->n; i++) {
        char piece[256];
        int n = kvz_tokenizer_decode(e->tok, t->ids[i], piece, sizeof piece);
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

/* Answer one question from kv (checkpointed at the document): teacher-forced
 * NLL of the reference answer after the question, then a greedy answer into
 * s->gen. The cache is rolled back after each pass. */
static int answer(eval *e, scratch *s, kvz_kv *kv, int32_t n_doc, const kvz_tokens *qt,
                  const kvz_tokens *at, const kvz_layer_hook *hook, run *out)
{
    const int32_t nq = (int32_t)qt->n, na = (int32_t)at->n, V = e->c->n_vocab;
    memcpy(s->seq, qt->ids, sizeof(int32_t) * (size_t)nq);
    memcpy(s->seq + nq, at->ids, sizeof(int32_t) * (size_t)na);
    int rc = kvz_forward(e->m, kv, s->seq, nq + na, n_doc, s->logits, KVZ_FWD_LOGITS_ALL, hook);
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
    kvz_gen_opts go = {.max_tokens = e->max_tokens, .stop_on_eos = 1};
    kvz_sampler_init(&go.sampler, 0.0f, 1.0f, 1);
    rc = kvz_generate(e->m, kv, qt->ids, nq, n_doc, &go, &s->gen, NULL, NULL);
    kvz_kv_rollback(kv);
    if (rc) return rc;
    if ((rc = decode_text(e, s, &s->gen))) return rc;
    out->answer = strdup(s->text);
    if (!out->answer) return KVZ_ERR_NOMEM;
    e->n_answers++;
    return 0;
}

static void judge(eval *e, int qi, run *r, const kvz_tokens *gen)
{
    const kvz_tokens *f = &e->full_gen[qi];
    r->agree = gen->n == f->n && (gen->n == 0 || !memcmp(gen->ids, f->ids, sizeof(int32_t) * gen->n));
    r->correct = 0;
    for (int a = 0; a < e->q[qi].n_accept && !r->correct; a++)
        r->correct = contains_ci(r->answer, e->q[qi].accept[a]);
    r->done = 1;
}

static uint64_t splitmix(uint64_t *st)
{
    uint64_t z = (*st += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static int progress_cb(void *ctx, int64_t done, int64_t total)
{
    const eval *e = ctx;
    if (!e->quiet && e->tty) fprintf(stderr, "\r  scoring %3d%%", (int)(100 * done / (total ? total : 1)));
    return 0;
}

/* Evaluate every selected question of document d. */
static int eval_doc(eval *e, int d)
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
    int rc = cli_read_text(di->path, (size_t)16 << 20, &text, &text_len);
    if (rc) {
        cli_error(rc, "cannot use document %s", di->path);
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
        cli_error(rc, "cannot tokenize document %s or its questions", di->name);
        goto out_early;
    }
    di->n_prefix = (int32_t)prefix.n;
    di->n_ctx = (int32_t)ctx.n;
    const int32_t n_prefix = di->n_prefix, n_ctx = di->n_ctx, n_doc = n_prefix + n_ctx;
    kvz_kvzip_params kp;
    kvz_kvzip_defaults(&kp);
    int64_t cap_full = kvz_kvzip_cache_rows(e->m, n_prefix, n_ctx, &kp);
    if (cap_full < 0) {
        rc = (int)cap_full;
        cli_error(rc, "cannot evaluate document");
        goto out_early;
    }
    if (cap_full < (int64_t)n_doc + max_seq + 1) cap_full = (int64_t)n_doc + max_seq + 1;
    if (cap_full > c->n_ctx) {
        rc = kvz_error_set(KVZ_ERR_CONTEXT, "%s: %d tokens + scoring/question room exceed the "
                           "model's %d-token context", di->name, n_doc, c->n_ctx);
        cli_error(rc, "cannot evaluate document");
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
    scratch s = {.logits = malloc(sizeof(float) * (size_t)max_seq * c->n_vocab),
                 .seq = malloc(sizeof(int32_t) * (size_t)max_seq)};
    snap_ctx sc = {.c = c, .n_prefix = n_prefix, .n_ctx = n_ctx, .row_doc = n_doc, .acc = acc};
    if (!kz || !aux || !snap || !acc || !keep || !kb || !vb || !pb || !tmp || !s.logits || !s.seq) {
        rc = kvz_error_set(KVZ_ERR_NOMEM, "evaluation buffers for %s", di->name);
        goto out;
    }
    if ((rc = kvz_kv_create(e->m, cap_full, 0, &full)) ||
        (rc = kvz_kv_create(e->m, (int64_t)n_doc + max_seq + 1, 0, &ck)))
        goto out;

    /* 1. KVzip scores (the cache then holds prefix + context) */
    double t0 = kvz_now();
    rc = kvz_kvzip_score(e->m, full, prefix.ids, n_prefix, ctx.ids, n_ctx, &kp, kz, progress_cb, e);
    di->score_s = kvz_now() - t0;
    e->t_score += di->score_s;
    if (!e->quiet) fprintf(stderr, "%s  scored %d context tokens in %.1f s\n", e->tty ? "\r" : "", n_ctx, di->score_s);
    if (rc) goto out;
    kvz_kv_checkpoint(full);

    /* 2. full cache: reference answers, NLL, and SnapKV observations */
    t0 = kvz_now();
    const double full_bytes = (double)heads * n_doc * 2 * hd * 2;
    for (int i = 0; i < nq && !rc; i++) {
        const int qi = qs[i];
        memset(acc, 0, sizeof(float) * (size_t)c->n_layer * c->n_head * n_ctx);
        sc.n_win = (int32_t)qt[i].n;
        kvz_layer_hook hook = {.fn = snap_hook, .ctx = &sc};
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
    if (!e->quiet) fprintf(stderr, "  full cache: %d questions in %.1f s\n", nq, kvz_now() - t0);

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
                if ((rc = build_cache(e, full, ck, n_prefix, n_ctx, keep, kb, vb, pb, &rows))) break;
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
                    if ((rc = build_cache(e, full, ck, n_prefix, n_ctx, keep, kb, vb, pb, &rows))) break;
                    run *r = R(e, qs[i], m, ri);
                    if ((rc = answer(e, &s, ck, n_doc, &qt[i], &at[i], NULL, r))) break;
                    r->kv_bytes = (double)rows * 2 * hd * 2;
                    judge(e, qs[i], r, &s.gen);
                }
            }
        }
        if (!e->quiet && !rc) fprintf(stderr, "  ratio %.2f: %.1f s\n", ratio, kvz_now() - t0);
    }
    if (rc) cli_error(rc, "evaluation of %s failed", di->name);
out:
    free(kz); free(aux); free(snap); free(acc); free(keep); free(kb); free(vb); free(pb); free(tmp);
    free(s.logits); free(s.seq); free(s.text); kvz_tokens_free(&s.gen);
    free(sc.work);
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

/* ------------------------------------------------------------------------ */
/* Aggregation and output                                                    */

typedef struct agg { int n; double agree, correct, dnll, mb; } agg;

/* Mean over questions qi with sel(qi) of method m at ratio r (m < 0: the full cache). */
static agg aggregate(eval *e, int m, int r, int multi_only)
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

static void table_row(const char *name, double ratio, agg a)
{
    printf("| %s | %.2f | %.1f | %.1f | %+.3f | %.2f |\n", name, ratio, a.agree, a.correct, a.dnll, a.mb);
}

static void print_tables(eval *e, double seconds)
{
    int n_multi = aggregate(e, -1, 0, 1).n;
    agg f = aggregate(e, -1, 0, 0);
    double nll_full = 0.0;
    for (int qi = 0; qi < e->nq; qi++) nll_full += e->full[qi].nll;
    printf("## kvzip-eval: %d questions over %d documents\n\n", e->nq, e->ndocs);
    printf("| method | ratio | agreement %% | accuracy %% | mean ΔNLL | KV MB |\n");
    printf("|---|---|---|---|---|---|\n");
    table_row("full", 1.0, f);
    for (int m = 0; m < N_METHOD; m++) {
        if (!e->use[m] || m == M_SNAPKV_Q1) continue;
        for (int r = 0; r < e->nr; r++) table_row(method_name[m], e->ratios[r], aggregate(e, m, r, 0));
    }
    printf("\nFull-cache mean NLL of the reference answers: %.3f nats/token. KV MB: fp16 K+V of "
           "the cache each question was answered from (prefix included), mean over questions. "
           "snapkv compresses per question with that question's own attention.\n",
           e->nq ? nll_full / e->nq : 0.0);
    if (e->use[M_SNAPKV_Q1] && n_multi > 0) {
        printf("\n### Multi-query: questions 2..n of documents with >= 3 questions (%d questions)\n\n", n_multi);
        printf("One compressed cache per document answers all of them. kvzip is question-"
               "agnostic; snapkv-q1 compressed with question 1's attention; snapkv (own question) "
               "is shown as the optimistic reference.\n\n");
        printf("| method | ratio | agreement %% | accuracy %% | mean ΔNLL | KV MB |\n");
        printf("|---|---|---|---|---|---|\n");
        table_row("full", 1.0, aggregate(e, -1, 0, 1));
        const int ms[] = {M_KVZIP, M_SNAPKV_Q1, M_SNAPKV};
        for (int k = 0; k < 3; k++) {
            if (!e->use[ms[k]]) continue;
            for (int r = 0; r < e->nr; r++) table_row(ms[k] == M_SNAPKV ? "snapkv (own q)" : method_name[ms[k]],
                                                      e->ratios[r], aggregate(e, ms[k], r, 1));
        }
    }
    printf("\nRuntime: %.1f s total (KVzip scoring %.1f s, %lld answers in %.1f s).\n", seconds,
           e->t_score, (long long)e->n_answers, e->t_answer);
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
    cli_json_str(f, x->answer ? x->answer : "", x->answer ? strlen(x->answer) : 0);
}

static int write_json(eval *e, const char *path, const char *model_path, const char *qa_path,
                      double seconds)
{
    FILE *f = fopen(path, "w");
    if (!f) return kvz_error_set(KVZ_ERR_IO, "%s: cannot create", path);
    fprintf(f, "{\n  \"model\": ");
    cli_json_str(f, model_path, strlen(model_path));
    fprintf(f, ",\n  \"file\": ");
    cli_json_str(f, qa_path, strlen(qa_path));
    fprintf(f, ",\n  \"ratios\": [");
    for (int r = 0; r < e->nr; r++) fprintf(f, "%s%g", r ? ", " : "", e->ratios[r]);
    fprintf(f, "],\n  \"methods\": [");
    int first = 1;
    for (int m = 0; m < N_METHOD; m++)
        if (e->use[m]) { fprintf(f, "%s\"%s\"", first ? "" : ", ", method_name[m]); first = 0; }
    fprintf(f, "],\n  \"settings\": {\"max_tokens\": %d, \"seed\": %llu, \"random\": \"per-head uniform\", "
            "\"window_sinks\": %d, \"snapkv_pool\": %d, \"snapkv_window\": \"question + postfix tokens\", "
            "\"kv_dtype_for_mb\": \"f16\"},\n", e->max_tokens, (unsigned long long)e->seed, N_SINK, SNAP_POOL);
    fprintf(f, "  \"seconds\": {\"total\": %.2f, \"scoring\": %.2f, \"answering\": %.2f, \"answers\": %lld},\n",
            seconds, e->t_score, e->t_answer, (long long)e->n_answers);
    fprintf(f, "  \"docs\": [\n");
    for (int d = 0; d < e->ndocs; d++) {
        fprintf(f, "    {\"doc\": ");
        cli_json_str(f, e->docs[d].name, strlen(e->docs[d].name));
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
        cli_json_str(f, q->doc, strlen(q->doc));
        fprintf(f, ", \"question\": ");
        cli_json_str(f, q->question, strlen(q->question));
        fprintf(f, ", \"reference\": ");
        cli_json_str(f, q->answer, strlen(q->answer));
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

static int write_plot(eval *e, const char *path)
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

/* ------------------------------------------------------------------------ */

static int name_matches(const char *doc, const char *want)
{
    const char *base = strrchr(doc, '/');
    base = base ? base + 1 : doc;
    return !strcmp(doc, want) || !strncmp(base, want, strlen(want));
}

/* ------------------------------------------------------------------------ */
/* Multi-document mode (--multidoc, issue 14; docs/EVAL.md "Multi-document")  */
/*
 * Every document (or each part of a long one, cut as kvzip-ingest cuts it) is
 * scored once with KVzip and held in memory (fp32 rows). Per ratio, each part is
 * selected on its own (global threshold, as kvzip-ingest stores it), the selected
 * caches are composed by kvz_docs_compose_mem (the placement rules and the RoPE
 * re-rotation of kvz_docs_load), and every question is answered from the
 * composition: teacher-forced NLL of the reference answer, then a greedy answer.
 * One record per (question, method, ratio) is appended to --out as it is measured;
 * a rerun with the same --out skips what is there.
 */

enum { MD_SEQ, MD_PAR, MD_ORACLE, MD_N_METHOD };
static const char *const md_method_name[MD_N_METHOD] = {"sequential", "parallel", "oracle"};
static const char *const md_kinds[] = {"long", "retrieval", "cross"};
#define MD_N_KIND 3

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

typedef struct md {
    eval e;                     /* model, tokenizer, max_tokens, answer counter */
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
    const char *out_path;
    int need_nl;                /* --out's last line lacks its newline */
} md;

static void md_err_line(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void md_err_line(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvzip-eval: error: %s:%d: ", cli_escape(file), line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

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

static int md_kind(const char *s)
{
    for (int k = 0; k < MD_N_KIND; k++)
        if (!strcmp(s, md_kinds[k])) return k;
    return -1;
}

/* Parse and check one question line (no model needed). Returns 0 or an exit code
 * after printing the one error line. */
static int md_parse_line(md *d, const char *qa_path, const char *root, int line_no, const char *p,
                         size_t len, md_q *q)
{
    memset(q, 0, sizeof *q);
    q->line = line_no;
    json_error_t err;
    json_t *o = json_loadb(p, len, 0, &err);
    if (!o || !json_is_object(o)) {
        md_err_line(qa_path, line_no, "%s", !o && strstr(err.text, "end of file expected")
                    ? "text after the object" : "not a JSON object");
        json_decref(o);
        return EXIT_INPUT;
    }
    int rc = EXIT_INPUT;
    const json_t *id = json_object_get(o, "id"), *kind = json_object_get(o, "kind"),
                 *docs = json_object_get(o, "docs"), *qs = json_object_get(o, "question"),
                 *an = json_object_get(o, "answer"), *ac = json_object_get(o, "accept"),
                 *or = json_object_get(o, "oracle");
    if (!json_is_string(id) || !json_is_string(kind) || !json_is_string(qs) || !json_is_string(an) ||
        !json_string_length(id) || !json_string_length(qs) || !json_string_length(an)) {
        md_err_line(qa_path, line_no, "\"id\", \"kind\", \"question\" and \"answer\" must be non-empty strings");
        goto out;
    }
    q->id = jdup(id);
    q->question = jdup(qs);
    q->answer = jdup(an);
    if ((q->kind = md_kind(json_string_value(kind))) < 0) {
        md_err_line(qa_path, line_no, "question '%s': kind '%s' unknown (long, retrieval, cross)",
                    cli_escape(q->id), cli_escape(json_string_value(kind)));
        goto out;
    }
    if (!json_is_array(docs) || json_array_size(docs) < 1 || json_array_size(docs) > KVZ_COMPOSE_MAX_DOCS) {
        md_err_line(qa_path, line_no, "question '%s': \"docs\" must be an array of 1 to %d document ids",
                    cli_escape(q->id), KVZ_COMPOSE_MAX_DOCS);
        goto out;
    }
    q->n_docs = (int)json_array_size(docs);
    q->docs = calloc((size_t)q->n_docs, sizeof *q->docs);
    for (int i = 0; i < q->n_docs; i++) {
        q->docs[i] = jdup(json_array_get(docs, i));
        if (!q->docs[i] || !q->docs[i][0]) {
            md_err_line(qa_path, line_no, "question '%s': \"docs\" must hold non-empty strings", cli_escape(q->id));
            goto out;
        }
        int pi, pj;
        size_t bi = md_split_id(q->docs[i], &pi);
        for (int j = 0; j < i; j++) {
            size_t bj = md_split_id(q->docs[j], &pj);
            if (bi == bj && !strncmp(q->docs[i], q->docs[j], bi) && (pi == 0 || pj == 0 || pi == pj)) {
                if (strcmp(q->docs[i], q->docs[j]))
                    md_err_line(qa_path, line_no, "question '%s': document '%s' is named twice (as '%s' and '%s')",
                                cli_escape(q->id), cli_escape(pi ? q->docs[j] : q->docs[i]),
                                cli_escape(q->docs[j]), cli_escape(q->docs[i]));
                else
                    md_err_line(qa_path, line_no, "question '%s': document '%s' is named twice",
                                cli_escape(q->id), cli_escape(q->docs[i]));
                goto out;
            }
        }
        if (md_find_file(d, q->docs[i], bi) < 0) {
            char *path = malloc(strlen(root) + bi + 2);
            sprintf(path, "%s%.*s", root, (int)bi, q->docs[i]);
            struct stat st;
            if (stat(path, &st) || !S_ISREG(st.st_mode)) {
                md_err_line(qa_path, line_no, "question '%s': unknown document '%s' (no file %s)",
                            cli_escape(q->id), cli_escape(q->docs[i]), cli_escape(path));
                free(path);
                rc = EXIT_NOTFOUND;
                goto out;
            }
            d->files = realloc(d->files, sizeof *d->files * (size_t)(d->nfiles + 1));
            md_file *f = &d->files[d->nfiles++];
            memset(f, 0, sizeof *f);
            f->name = strndup(q->docs[i], bi);
            f->path = path;
        }
    }
    if (ac) {
        if (!json_is_array(ac)) {
            md_err_line(qa_path, line_no, "question '%s': \"accept\" must be an array of strings", cli_escape(q->id));
            goto out;
        }
        q->accept = calloc(json_array_size(ac) + 1, sizeof *q->accept);
        for (size_t i = 0; i < json_array_size(ac); i++) {
            if (!(q->accept[q->n_accept] = jdup(json_array_get(ac, i)))) {
                md_err_line(qa_path, line_no, "question '%s': \"accept\" must be an array of strings", cli_escape(q->id));
                goto out;
            }
            q->n_accept++;
        }
    }
    if (q->n_accept == 0) {
        free(q->accept);
        q->accept = malloc(sizeof *q->accept);
        q->accept[0] = strdup(q->answer);
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
            md_err_line(qa_path, line_no, "question '%s': \"oracle\" must be a part number (one split "
                        "document) or ids taken from \"docs\"", cli_escape(q->id));
            goto out;
        }
        q->oracle = json_incref((json_t *)or);
    }
    for (int i = 0; i < d->nq; i++)
        if (!strcmp(d->q[i].id, q->id)) {
            md_err_line(qa_path, line_no, "question id '%s' given twice (also line %d)", cli_escape(q->id), d->q[i].line);
            goto out;
        }
    rc = 0;
out:
    json_decref(o);
    return rc;
}

/* docs id -> units appended to *v (a split file's id means all its parts). */
static int md_expand(md *d, const char *id, int **v, int *n)
{
    int part;
    size_t b = md_split_id(id, &part);
    int fi = md_find_file(d, id, b);
    if (fi < 0) return -1;
    const md_file *f = &d->files[fi];
    if (part > 0 && (f->n_parts == 1 || part > f->n_parts)) return -1;
    const int a = part ? f->first_unit + part - 1 : f->first_unit;
    const int e = part ? a + 1 : f->first_unit + f->n_parts;
    for (int u = a; u < e; u++) {
        *v = realloc(*v, sizeof **v * (size_t)(*n + 1));
        (*v)[(*n)++] = u;
    }
    return 0;
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
             "\"key_scale\": %g, \"part_tokens\": %d}", base ? base + 1 : model_path, d->e.max_tokens,
             (double)d->key_scale, d->max_part);
}

/* Read an existing --out: check its header against ours, load its records. A last
 * line cut short by a crash is dropped (the file is truncated to the last whole line). */
static int md_load_out(md *d, const char *header)
{
    char *text = NULL;
    FILE *f = fopen(d->out_path, "r");
    if (!f) return 0; /* a new file */
    size_t cap = 0, len = 0;
    for (;;) {
        if (len + 65536 > cap) {
            char *t = realloc(text, cap = cap * 2 + 65536);
            if (!t) { free(text); fclose(f); cli_error(KVZ_ERR_NOMEM, "cannot read %s", d->out_path); return EXIT_FAIL; }
            text = t;
        }
        size_t r = fread(text + len, 1, cap - len - 1, f);
        len += r;
        if (r == 0) break;
    }
    fclose(f);
    text[len] = 0;
    int line_no = 0, rc = 0;
    size_t good = 0; /* bytes up to the end of the last whole, valid line */
    for (char *p = text; *p && !rc;) {
        char *nl = strchr(p, '\n');
        const size_t l = nl ? (size_t)(nl - p) : strlen(p);
        line_no++;
        json_error_t err;
        json_t *o = json_loadb(p, l, 0, &err);
        if (!o && !nl) {
            fprintf(stderr, "kvzip-eval: %s: dropping an incomplete last line (an interrupted run)\n",
                    cli_escape(d->out_path));
            break;
        }
        if (!json_is_object(o)) {
            md_err_line(d->out_path, line_no, "not a JSON object: not a kvzip-eval --multidoc results file");
            rc = EXIT_INPUT;
        } else if (line_no == 1) {
            json_t *h = json_loads(header, 0, NULL);
            if (!json_equal(o, h)) {
                char *s = json_dumps(o, JSON_COMPACT);
                fprintf(stderr, "kvzip-eval: %s was written with other settings (%s); use the same "
                        "model, --max-tokens, --key-scale and --part-tokens, or another --out (see kvzip-eval --help)\n",
                        cli_escape(d->out_path), s ? cli_escape(s) : "?");
                free(s);
                rc = EXIT_USAGE;
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
            if (!json_is_string(qid) || m < 0 || !json_is_number(ra) || !json_is_boolean(co) ||
                !json_is_number(nl2) || !json_is_array(tk) || !json_is_integer(qp) || !json_is_number(rw)) {
                md_err_line(d->out_path, line_no, "a record without id, method, ratio, correct, nll, "
                            "tokens, q_pos or rows_per_head");
                rc = EXIT_INPUT;
            } else {
                d->recs = realloc(d->recs, sizeof *d->recs * (size_t)(d->nrecs + 1));
                md_rec *r = &d->recs[d->nrecs++];
                memset(r, 0, sizeof *r);
                r->qid = jdup(qid);
                r->method = m;
                r->ratio = json_number_value(ra);
                r->correct = json_is_true(co);
                r->nll = json_number_value(nl2);
                r->q_pos = json_integer_value(qp);
                r->rows_per_head = json_number_value(rw);
                for (size_t i = 0; i < json_array_size(tk); i++)
                    kvz_tokens_push(&r->tokens, (int32_t)json_integer_value(json_array_get(tk, i)));
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
        fprintf(stderr, "kvzip-eval: error: %s: cannot drop the incomplete last line\n", cli_escape(d->out_path));
        rc = EXIT_FAIL;
    }
    return rc;
}

static int md_write_rec(md *d, const md_q *q, int method, double ratio, const kvz_compose_meta *cm,
                        const run *r, const kvz_tokens *gen, double compose_s, double answer_s)
{
    FILE *f = d->out;
    const double rph = (double)cm->rows / ((double)d->e.c->n_layer * d->e.c->n_kv_head);
    fprintf(f, "{\"id\": ");
    cli_json_str(f, q->id, strlen(q->id));
    fprintf(f, ", \"kind\": \"%s\", \"method\": \"%s\", \"ratio\": %g, \"placement\": \"%s\", "
            "\"units\": %d, \"n_prefix\": %d, \"q_pos\": %d, \"rows_per_head\": %.1f, \"rows_full_per_head\": %.1f, "
            "\"correct\": %s, \"nll\": %.6f, \"compose_s\": %.3f, \"answer_s\": %.3f, \"answer\": ",
            md_kinds[q->kind], md_method_name[method], ratio,
            cm->placement == KVZ_PLACE_PARALLEL ? "parallel" : "sequential", cm->n_docs, cm->n_prefix, cm->q_pos, rph,
            (double)cm->rows_full / ((double)d->e.c->n_layer * d->e.c->n_kv_head),
            r->correct ? "true" : "false", r->nll, compose_s, answer_s);
    cli_json_str(f, r->answer ? r->answer : "", r->answer ? strlen(r->answer) : 0);
    fprintf(f, ", \"tokens\": [");
    for (size_t i = 0; i < gen->n; i++) fprintf(f, "%s%d", i ? "," : "", gen->ids[i]);
    fprintf(f, "]}\n");
    if (fflush(f) || ferror(f) || fsync(fileno(f)))
        return kvz_error_set(KVZ_ERR_IO, "%s: write failed", d->out_path);
    d->recs = realloc(d->recs, sizeof *d->recs * (size_t)(d->nrecs + 1));
    md_rec *x = &d->recs[d->nrecs++];
    memset(x, 0, sizeof *x);
    x->qid = strdup(q->id);
    x->method = method;
    x->ratio = ratio;
    x->correct = r->correct;
    x->nll = r->nll;
    x->q_pos = cm->q_pos;
    x->rows_per_head = rph;
    for (size_t i = 0; i < gen->n; i++) kvz_tokens_push(&x->tokens, gen->ids[i]);
    return 0;
}

/* Prefill and KVzip-score unit u; keep its rows (fp32) and scores. */
static int md_score_unit(md *d, int u)
{
    md_unit *un = &d->units[u];
    if (un->k) return 0;
    const kvz_config *c = d->e.c;
    const md_file *f = &d->files[un->file];
    const int32_t P = (int32_t)d->prefix.n, nc = un->s1 - un->s0;
    kvz_kvzip_params kp;
    kvz_kvzip_defaults(&kp);
    const int64_t cap = kvz_kvzip_cache_rows(d->e.m, P, nc, &kp);
    if (cap < 0) return (int)cap;
    if (cap > c->n_ctx)
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
    int rc = kvz_kv_create(d->e.m, cap, 0, &kv);
    if (rc) return rc;
    const double t0 = kvz_now();
    if (!d->e.quiet) fprintf(stderr, "  scoring %s (%d tokens)\n", un->id, nc);
    rc = kvz_kvzip_score(d->e.m, kv, d->prefix.ids, P, f->toks.ids + un->s0, nc, &kp, un->scores, NULL, NULL);
    for (size_t l = 0; l < L && !rc; l++)
        for (size_t h = 0; h < H && !rc; h++) {
            const float *k, *v;
            const int32_t *pos;
            int64_t len;
            if ((rc = kvz_kv_view(kv, (int32_t)l, (int32_t)h, &k, &v, &pos, &len))) break;
            if (len != (int64_t)rows) { rc = kvz_error_set(KVZ_ERR_INTERNAL, "%s: %lld rows after scoring", un->id, (long long)len); break; }
            for (size_t j = 0; j < rows; j++)
                if (pos[j] != (int32_t)j) { rc = kvz_error_set(KVZ_ERR_INTERNAL, "%s: row %zu at position %d", un->id, j, pos[j]); break; }
            memcpy(un->k + (l * H + h) * rows * hd, k, sizeof(float) * rows * hd);
            memcpy(un->v + (l * H + h) * rows * hd, v, sizeof(float) * rows * hd);
        }
    kvz_kv_free(kv);
    un->score_s = kvz_now() - t0;
    d->e.t_score += un->score_s;
    if (!rc && !d->e.quiet) fprintf(stderr, "  scored %s in %.1f s\n", un->id, un->score_s);
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
        d->comps = realloc(d->comps, sizeof *d->comps * (size_t)(d->ncomps + 1));
        md_comp *x = &d->comps[d->ncomps++];
        memset(x, 0, sizeof *x);
        x->placement = placement;
        x->n_units = n;
        x->units = malloc(sizeof(int) * (size_t)n);
        memcpy(x->units, units, sizeof(int) * (size_t)n);
    }
    md_comp *x = &d->comps[c];
    x->q = realloc(x->q, sizeof(int) * (size_t)(x->n + 1));
    x->m = realloc(x->m, sizeof(int) * (size_t)(x->n + 1));
    x->q[x->n] = qi;
    x->m[x->n++] = method;
    return 0;
}

/* Answer every pending question of composition ci at ratio index ri. */
static int md_run_comp(md *d, int ci, int ri, scratch *s, int *done_comps, int todo_comps)
{
    md_comp *x = &d->comps[ci];
    const double ratio = d->ratios[ri];
    int pending = 0;
    for (int i = 0; i < x->n; i++) pending += !md_record_done(d, d->q[x->q[i]].id, x->m[i], ratio);
    if (!pending) return 0;
    const kvz_config *c = d->e.c;
    int rc = 0;
    kvz_compose_src *src = calloc((size_t)x->n_units, sizeof *src);
    if (!src) return KVZ_ERR_NOMEM;
    int32_t max_seq = 0;
    for (int i = 0; i < x->n; i++) {
        const md_q *q = &d->q[x->q[i]];
        int32_t need = (int32_t)q->qt.n + (int32_t)(q->at.n > (size_t)d->e.max_tokens ? q->at.n : (size_t)d->e.max_tokens);
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
    if (!rc) rc = kvz_docs_compose_mem(d->e.m, src, x->n_units, &co, max_seq + 1, 0, &kv, &cm);
    const double compose_s = kvz_now() - t0;
    free(src);
    if (!rc && !d->e.quiet)
        fprintf(stderr, "[r=%g %d/%d] %d part%s %s (%s%s), %.0f rows/head, q at %d: %d answer%s\n", ratio,
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
        if ((rc = answer(&d->e, s, kv, cm.q_pos, &q->qt, &q->at, NULL, &r))) break;
        const double answer_s = kvz_now() - t0;
        for (int a = 0; a < q->n_accept && !r.correct; a++) r.correct = contains_ci(r.answer, q->accept[a]);
        for (int j = i; j < x->n && !rc; j++)
            if (x->q[j] == x->q[i] && !md_record_done(d, q->id, x->m[j], ratio))
                rc = md_write_rec(d, q, x->m[j], ratio, &cm, &r, &s->gen, compose_s, answer_s);
        if (!d->e.quiet)
            fprintf(stderr, "  %s %s: %s (%.1f s) %s\n", q->id, md_method_name[x->m[i]], r.correct ? "correct" : "wrong",
                    answer_s, cli_escape(r.answer));
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

static void md_print_tables(const md *d, double seconds)
{
    printf("## kvzip-eval --multidoc: %d questions\n", d->nq);
    for (int k = 0; k < MD_N_KIND; k++) {
        int nk = 0;
        for (int i = 0; i < d->nq; i++) nk += d->q[i].kind == k;
        if (!nk) continue;
        printf("\n### %s (%d questions)\n\n", md_kinds[k], nk);
        printf("| method | ratio | n | correct | accuracy %% | vs oracle | agreement with oracle %% | "
               "ΔNLL vs oracle | ΔNLL vs oracle r=1 | rows/head | question at |\n");
        printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
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
                printf("| %s | %.2f | %d | %d | %.1f | %s | %s | %s | %s | %.0f | %.0f |\n", md_method_name[m],
                       d->ratios[ri], a.n, a.correct, 100.0 * a.correct / a.n, vs, ag, dn, dn1, a.rows / a.n,
                       a.qpos / a.n);
            }
    }
    printf("\nvs oracle: correct answers of the method / of the oracle over the same questions. "
           "Agreement: greedy answer token-for-token equal to the oracle's at the same ratio. "
           "ΔNLL: mean NLL of the reference-answer tokens (teacher-forced) minus the oracle's, "
           "at the same ratio and against the oracle at r = 1. rows/head: composed KV rows per "
           "(layer, KV head), prefix included. question at: the position the question starts.\n");
    if (seconds > 0)
        printf("\nThis run: %.1f s (KVzip scoring %.1f s, %lld answers).\n", seconds, d->e.t_score,
               (long long)d->e.n_answers);
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

/* --ratios LIST: comma-separated, each in (0, 1], none twice (usage error otherwise). */
static void parse_ratios(const char *list, double **ratios, int *n)
{
    char *dup = strdup(list), *save = NULL;
    if (!dup) { cli_error(KVZ_ERR_NOMEM, "--ratios"); exit(EXIT_FAIL); }
    for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        const double r = cli_parse_double("--ratios", t, 0.0, 1.0);
        if (r <= 0.0) cli_usage_error("--ratios: %s is not in (0, 1]", t);
        for (int k = 0; k < *n; k++)
            if ((*ratios)[k] == r) cli_usage_error("--ratios: %s given twice", t);
        double *nr = realloc(*ratios, sizeof(double) * (size_t)(*n + 1));
        if (!nr) { cli_error(KVZ_ERR_NOMEM, "--ratios"); exit(EXIT_FAIL); }
        *ratios = nr;
        (*ratios)[(*n)++] = r;
    }
    free(dup);
    if (*n == 0) cli_usage_error("--ratios is empty");
}

static int md_main(int argc, char **argv)
{
    md d;
    memset(&d, 0, sizeof d);
    const char *qa_path = NULL, *model_flag = NULL, *root_s = NULL;
    const char *ratios_s = "1,0.3,0.2", *methods_s = "sequential,parallel,oracle", *kinds_s = NULL, *ids_s = NULL;
    long limit = 0, max_tokens = 48, threads = 0, part_tokens = 0;
    int quiet = 0, report = 0;
    double key_scale = 1.0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { md_usage(); return 0; }
        else if (!strcmp(a, "--multidoc")) continue;
        else if (!strcmp(a, "--out")) d.out_path = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--root")) root_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--ratios")) ratios_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--methods")) methods_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--kinds")) kinds_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--ids")) ids_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--limit")) limit = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1 << 30);
        else if (!strcmp(a, "--max-tokens")) max_tokens = cli_parse_long(a, cli_value(argc, argv, &i), 1, 4096);
        else if (!strcmp(a, "--part-tokens")) part_tokens = cli_parse_long(a, cli_value(argc, argv, &i), 16, 1 << 30);
        else if (!strcmp(a, "--key-scale")) key_scale = cli_parse_double(a, cli_value(argc, argv, &i), 0.01, 100.0);
        else if (!strcmp(a, "--model")) model_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--threads")) threads = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "--report")) report = 1;
        else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) quiet = 1;
        else if (a[0] == '-' && a[1]) cli_usage_error("unknown option '%s' in --multidoc mode", a);
        else if (qa_path) cli_usage_error("only one FILE.jsonl may be given");
        else qa_path = a;
    }
    if (!qa_path) cli_usage_error("no FILE.jsonl given");
    if (!d.out_path) cli_usage_error("--multidoc needs --out RESULTS.jsonl (answers are recorded there as they are measured)");
    d.e.max_tokens = (int)max_tokens;
    d.e.quiet = quiet;
    d.key_scale = (float)key_scale;
    parse_ratios(ratios_s, &d.ratios, &d.nr);
    {
        char *dup = strdup(methods_s), *save = NULL;
        for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            int m = -1;
            for (int k = 0; k < MD_N_METHOD; k++)
                if (!strcmp(t, md_method_name[k])) m = k;
            if (m < 0) cli_usage_error("--methods: unknown method '%s' (sequential, parallel, oracle)", t);
            d.use[m] = 1;
        }
        free(dup);
        if (!d.use[0] && !d.use[1] && !d.use[2]) cli_usage_error("--methods is empty");
    }
    int use_kind[MD_N_KIND] = {1, 1, 1};
    if (kinds_s) {
        memset(use_kind, 0, sizeof use_kind);
        char *dup = strdup(kinds_s), *save = NULL;
        for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            int k = md_kind(t);
            if (k < 0) cli_usage_error("--kinds: unknown kind '%s' (long, retrieval, cross)", t);
            use_kind[k] = 1;
        }
        free(dup);
    }
    char *qa_text = NULL;
    size_t qa_len = 0;
    int rc = cli_read_text(qa_path, (size_t)64 << 20, &qa_text, &qa_len);
    if (rc) {
        cli_error(rc, "cannot read %s", qa_path);
        return cli_exit_code(rc);
    }
    char *root;
    if (root_s) {
        root = malloc(strlen(root_s) + 2);
        sprintf(root, "%s%s", root_s, root_s[0] && root_s[strlen(root_s) - 1] != '/' ? "/" : "");
    } else {
        root = strdup(qa_path);
        char *slash = strrchr(root, '/');
        if (slash) slash[1] = 0;
        else root[0] = 0;
    }
    /* --ids: each must name a question */
    char **want = NULL;
    int n_want = 0, *want_hit = NULL;
    if (ids_s) {
        char *dup = strdup(ids_s), *save = NULL;
        for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            want = realloc(want, sizeof *want * (size_t)(n_want + 1));
            want[n_want++] = strdup(t);
        }
        free(dup);
        want_hit = calloc((size_t)n_want + 1, sizeof *want_hit);
        if (!n_want) cli_usage_error("--ids is empty");
    }
    int line_no = 0, n_lines = 0;
    for (char *p = qa_text; *p;) {
        char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        line_no++;
        size_t k = 0;
        while (k < len && isspace((unsigned char)p[k])) k++;
        if (k < len) {
            md_q q;
            n_lines++;
            if ((rc = md_parse_line(&d, qa_path, root, line_no, p, len, &q))) return rc;
            int keep = use_kind[q.kind] && (!limit || d.nq < limit);
            if (n_want) {
                int hit = 0;
                for (int w = 0; w < n_want; w++)
                    if (!strcmp(want[w], q.id)) hit = want_hit[w] = 1;
                keep &= hit;
            }
            if (keep) {
                d.q = realloc(d.q, sizeof *d.q * (size_t)(d.nq + 1));
                d.q[d.nq++] = q;
            } /* else: dropped (a few bytes; the process is short-lived) */
        }
        p = nl ? nl + 1 : p + len;
    }
    free(qa_text);
    for (int w = 0; w < n_want; w++)
        if (!want_hit[w]) {
            fprintf(stderr, "kvzip-eval: error: --ids: %s has no question '%s'\n", cli_escape(qa_path), cli_escape(want[w]));
            return EXIT_NOTFOUND;
        }
    if (d.nq == 0) {
        fprintf(stderr, "kvzip-eval: error: %s: no questions selected (%d lines)\n", cli_escape(qa_path), n_lines);
        return EXIT_INPUT;
    }

    const char *model_path = cli_model_path(model_flag);
    if ((rc = cli_load_model(model_path, NULL, KVZ_DEVICE_CPU, (int32_t)threads, &d.e.m))) return cli_exit_code(rc);
    d.e.c = kvz_model_config(d.e.m);
    d.e.tok = kvz_model_tokenizer(d.e.m);
    d.max_part = kvz_ingest_max_part_tokens(d.e.m);
    if (part_tokens > 0 && part_tokens < d.max_part) d.max_part = (int32_t)part_tokens;
    char header[1024];
    md_header(&d, model_path, header, sizeof header);
    if ((rc = md_load_out(&d, header))) return rc;
    if (report) {
        md_print_tables(&d, 0.0);
        return 0;
    }

    /* tokenize the files, cut them into parts, expand every question's documents */
    if ((rc = kvz_chat_prefix(d.e.tok, &d.prefix))) {
        cli_error(rc, "cannot build the system prefix");
        return EXIT_FAIL;
    }
    for (int f = 0; f < d.nfiles; f++) {
        md_file *fl = &d.files[f];
        char *text = NULL;
        size_t len = 0;
        if ((rc = cli_read_text(fl->path, (size_t)256 << 20, &text, &len)) ||
            (rc = kvz_tokenizer_encode(d.e.tok, text, len, 0, &fl->toks))) {
            cli_error(rc, "cannot use document %s", fl->path);
            return cli_exit_code(rc) == EXIT_FAIL ? EXIT_INPUT : cli_exit_code(rc);
        }
        free(text);
        fl->n_parts = kvz_ingest_n_parts((int32_t)fl->toks.n, d.max_part);
        fl->first_unit = d.nunits;
        for (int32_t p = 0; p < fl->n_parts; p++) {
            d.units = realloc(d.units, sizeof *d.units * (size_t)(d.nunits + 1));
            md_unit *u = &d.units[d.nunits++];
            memset(u, 0, sizeof *u);
            u->file = f;
            kvz_ingest_part_span((int32_t)fl->toks.n, fl->n_parts, p, &u->s0, &u->s1);
            u->id = malloc(strlen(fl->name) + 16);
            if (fl->n_parts == 1) strcpy(u->id, fl->name);
            else sprintf(u->id, "%s#%d", fl->name, p + 1);
        }
    }
    int32_t max_seq = 0;
    for (int i = 0; i < d.nq; i++) {
        md_q *q = &d.q[i];
        for (int k = 0; k < q->n_docs; k++)
            if (md_expand(&d, q->docs[k], &q->units, &q->n_units)) {
                int part;
                const md_file *fl = &d.files[md_find_file(&d, q->docs[k], md_split_id(q->docs[k], &part))];
                md_err_line(qa_path, q->line, "question '%s': unknown document '%s' (%s has %d part%s of at most "
                            "%d tokens)", cli_escape(q->id), cli_escape(q->docs[k]), cli_escape(fl->name),
                            fl->n_parts, fl->n_parts == 1 ? "" : "s", d.max_part);
                return EXIT_NOTFOUND;
            }
        if (q->oracle && json_is_integer(q->oracle)) {
            int part;
            const md_file *fl = &d.files[md_find_file(&d, q->docs[0], md_split_id(q->docs[0], &part))];
            const json_int_t n = json_integer_value(q->oracle);
            if (part || fl->n_parts < 2 || n > fl->n_parts) {
                md_err_line(qa_path, q->line, "question '%s': oracle part %lld, but '%s' has %d part%s here "
                            "(parts hold the default --part-tokens)", cli_escape(q->id), (long long)n,
                            cli_escape(q->docs[0]), part ? 1 : fl->n_parts, (part ? 1 : fl->n_parts) == 1 ? "" : "s");
                return EXIT_INPUT;
            }
            q->ounits = malloc(sizeof(int));
            q->ounits[0] = fl->first_unit + (int)n - 1;
            q->n_ounits = 1;
        } else if (q->oracle) {
            const size_t n = json_is_string(q->oracle) ? 1 : json_array_size(q->oracle);
            for (int k = 0; k < q->n_docs; k++) /* in the order of docs */
                for (size_t j = 0; j < n; j++) {
                    const json_t *x = json_is_string(q->oracle) ? q->oracle : json_array_get(q->oracle, j);
                    if (!strcmp(json_string_value(x), q->docs[k])) md_expand(&d, q->docs[k], &q->ounits, &q->n_ounits);
                }
        }
        for (int a = 0; a < q->n_units; a++)
            for (int b = 0; b < a; b++)
                if (q->units[a] == q->units[b]) {
                    md_err_line(qa_path, q->line, "question '%s': document '%s' is named twice",
                                cli_escape(q->id), cli_escape(d.units[q->units[a]].id));
                    return EXIT_INPUT;
                }
        if ((rc = kvz_chat_question(d.e.tok, q->question, &q->qt)) ||
            (rc = kvz_tokenizer_encode(d.e.tok, q->answer, strlen(q->answer), 0, &q->at))) {
            cli_error(rc, "question '%s': cannot tokenize", q->id);
            return EXIT_INPUT;
        }
        if (q->at.n == 0) {
            md_err_line(qa_path, q->line, "question '%s': the answer has no tokens", cli_escape(q->id));
            return EXIT_INPUT;
        }
        int32_t need = (int32_t)q->qt.n + (int32_t)(q->at.n > (size_t)max_tokens ? q->at.n : (size_t)max_tokens);
        if (need > max_seq) max_seq = need;
        if (d.use[MD_SEQ]) md_add_comp(&d, KVZ_PLACE_SEQUENTIAL, q->units, q->n_units, i, MD_SEQ);
        if (d.use[MD_PAR]) md_add_comp(&d, KVZ_PLACE_PARALLEL, q->units, q->n_units, i, MD_PAR);
        if (d.use[MD_ORACLE] && q->n_ounits) md_add_comp(&d, KVZ_PLACE_SEQUENTIAL, q->ounits, q->n_ounits, i, MD_ORACLE);
    }
    int todo = 0, done = 0;
    for (int ri = 0; ri < d.nr; ri++)
        for (int c = 0; c < d.ncomps; c++) {
            int pend = 0;
            for (int i = 0; i < d.comps[c].n; i++) pend |= !md_record_done(&d, d.q[d.comps[c].q[i]].id, d.comps[c].m[i], d.ratios[ri]);
            todo += pend;
        }
    if (!quiet)
        fprintf(stderr, "kvzip-eval --multidoc: %d questions, %d files (%d parts of <= %d tokens), %d ratios, "
                "%d compositions to run, %d answers recorded in %s\n", d.nq, d.nfiles, d.nunits, d.max_part,
                d.nr, todo, d.nrecs, cli_escape(d.out_path));
    /* the results file: header on a new file */
    struct stat st;
    const int fresh = stat(d.out_path, &st) || st.st_size == 0;
    if (!(d.out = fopen(d.out_path, "a"))) {
        fprintf(stderr, "kvzip-eval: error: %s: cannot open for appending\n", cli_escape(d.out_path));
        return EXIT_FAIL;
    }
    if (fresh) fprintf(d.out, "%s\n", header);
    else if (d.need_nl) fputc('\n', d.out);
    fflush(d.out);
    scratch s = {.logits = malloc(sizeof(float) * (size_t)max_seq * d.e.c->n_vocab),
                 .seq = malloc(sizeof(int32_t) * (size_t)max_seq)};
    if (!s.logits || !s.seq) {
        cli_error(KVZ_ERR_NOMEM, "cannot allocate the answer buffers");
        return EXIT_FAIL;
    }
    const double t_start = kvz_now();
    for (int ri = 0; ri < d.nr && !rc; ri++)
        for (int c = 0; c < d.ncomps && !rc; c++) rc = md_run_comp(&d, c, ri, &s, &done, todo);
    const double seconds = kvz_now() - t_start;
    if (fclose(d.out) && !rc) rc = kvz_error_set(KVZ_ERR_IO, "%s: write failed", d.out_path);
    if (rc) {
        cli_error(rc, "multi-document evaluation failed");
        return cli_exit_code(rc);
    }
    md_print_tables(&d, seconds);
    /* the process ends here: the OS takes the remaining buffers back */
    for (int u = 0; u < d.nunits; u++) {
        free(d.units[u].k); free(d.units[u].v); free(d.units[u].scores); free(d.units[u].keep);
    }
    free(s.logits); free(s.seq); free(s.text); kvz_tokens_free(&s.gen);
    kvz_model_free(d.e.m);
    return 0;
}

int main(int argc, char **argv)
{
    cli_init("kvzip-eval", argv);
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--multidoc")) return md_main(argc, argv);
        else if (!strcmp(argv[i], "--")) break;
    const char *qa_path = NULL, *model_flag = NULL, *json_path = NULL, *plot_path = NULL;
    const char *ratios_s = "1,0.5,0.3,0.2,0.1", *baselines_s = "random,window,snapkv", *docs_s = NULL;
    long limit = 0, per_doc = 0, max_tokens = 48, threads = 0, seed = 1;
    int quiet = 0, kv_dtype = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        else if (!strcmp(a, "--ratios")) ratios_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--baselines")) baselines_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--docs")) docs_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--limit")) limit = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1 << 30);
        else if (!strcmp(a, "--per-doc")) per_doc = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1 << 30);
        else if (!strcmp(a, "--max-tokens")) max_tokens = cli_parse_long(a, cli_value(argc, argv, &i), 1, 4096);
        else if (!strcmp(a, "--seed")) seed = cli_parse_long(a, cli_value(argc, argv, &i), 0, 0x7fffffffL);
        else if (!strcmp(a, "--json")) json_path = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--plot")) plot_path = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--model")) model_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--threads")) threads = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) quiet = 1;
        else if (!strcmp(a, "--kv-dtype")) {
            const char *v = cli_value(argc, argv, &i);
            const kvz_kvrow_codec *kc = kvz_kvrow_codec_find(v);
            if (!kc) cli_usage_error("--kv-dtype expects f32, f16, bf16, q8 or q4, got '%s'", v);
            kv_dtype = kc->dtype;
        }
        else if (a[0] == '-' && a[1]) cli_usage_error("unknown option '%s'", a);
        else if (qa_path) cli_usage_error("only one FILE.jsonl may be given");
        else qa_path = a;
    }
    if (!qa_path) cli_usage_error("no FILE.jsonl given");

    eval e = {.max_tokens = (int)max_tokens, .seed = (uint64_t)seed, .quiet = quiet,
              .tty = isatty(2), .kv_dtype = kv_dtype};
    parse_ratios(ratios_s, &e.ratios, &e.nr);
    e.use[M_KVZIP] = 1;
    if (strcmp(baselines_s, "none")) {
        char *dup = strdup(baselines_s), *save = NULL;
        for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            if (!strcmp(t, "random")) e.use[M_RANDOM] = 1;
            else if (!strcmp(t, "window")) e.use[M_WINDOW] = 1;
            else if (!strcmp(t, "snapkv")) e.use[M_SNAPKV] = e.use[M_SNAPKV_Q1] = 1;
            else cli_usage_error("--baselines: unknown method '%s' (random, window, snapkv, none)", t);
        }
        free(dup);
    }

    /* QA set */
    char *qa_text = NULL;
    size_t qa_len = 0;
    int rc = cli_read_text(qa_path, (size_t)64 << 20, &qa_text, &qa_len);
    if (rc) {
        cli_error(rc, "cannot read %s", qa_path);
        return cli_exit_code(rc);
    }
    char *dir = strdup(qa_path);
    char *slash = strrchr(dir, '/');
    if (slash) slash[1] = 0;
    else dir[0] = 0;
    char **want = NULL;
    int n_want = 0;
    int *want_hit = NULL;
    if (docs_s) {
        char *dup = strdup(docs_s), *save = NULL;
        for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            want = realloc(want, sizeof *want * (size_t)(n_want + 1));
            want[n_want++] = strdup(t);
        }
        free(dup);
        want_hit = calloc((size_t)n_want + 1, sizeof *want_hit);
        if (n_want == 0) cli_usage_error("--docs is empty");
    }
    int line_no = 0;
    for (char *p = qa_text; *p;) {
        char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        line_no++;
        size_t k = 0;
        while (k < len && isspace((unsigned char)p[k])) k++;
        if (k < len) {
            qa q;
            const char *why;
            if (parse_qa(p, len, &q, &why)) {
                fprintf(stderr, "kvzip-eval: error: %s:%d: %s\n", qa_path, line_no, why);
                return EXIT_INPUT;
            }
            int keep_it = !docs_s;
            for (int w = 0; w < n_want; w++)
                if (name_matches(q.doc, want[w])) { keep_it = 1; want_hit[w] = 1; }
            if (keep_it && limit && e.nq >= limit) keep_it = 0;
            int d = 0;
            if (keep_it) {
                for (d = 0; d < e.ndocs && strcmp(e.docs[d].name, q.doc); d++) {}
                int in_doc = 0;
                for (int i = 0; i < e.nq; i++) in_doc += e.q[i].doc_idx == d && d < e.ndocs;
                if (per_doc && in_doc >= per_doc) keep_it = 0;
                q.idx_in_doc = in_doc;
            }
            if (!keep_it) {
                qa_free(&q);
            } else {
                if (d == e.ndocs) {
                    e.docs = realloc(e.docs, sizeof *e.docs * (size_t)(e.ndocs + 1));
                    docinfo *di = &e.docs[e.ndocs++];
                    memset(di, 0, sizeof *di);
                    di->name = strdup(q.doc);
                    if (q.doc[0] == '/') di->path = strdup(q.doc);
                    else {
                        di->path = malloc(strlen(dir) + strlen(q.doc) + 1);
                        strcpy(di->path, dir);
                        strcat(di->path, q.doc);
                    }
                }
                q.doc_idx = d;
                q.path = strdup(e.docs[d].path);
                e.q = realloc(e.q, sizeof *e.q * (size_t)(e.nq + 1));
                e.q[e.nq++] = q;
            }
        }
        p = nl ? nl + 1 : p + len;
    }
    free(qa_text);
    for (int w = 0; w < n_want; w++)
        if (!want_hit[w]) {
            fprintf(stderr, "kvzip-eval: error: --docs: no question of %s is about a document "
                    "matching '%s'\n", qa_path, want[w]);
            return EXIT_NOTFOUND;
        }
    if (e.nq == 0) {
        fprintf(stderr, "kvzip-eval: error: %s has no questions\n", qa_path);
        return EXIT_INPUT;
    }
    for (int d = 0; d < e.ndocs; d++) {
        struct stat st;
        if (stat(e.docs[d].path, &st)) {
            fprintf(stderr, "kvzip-eval: error: document %s not found (paths are relative to %s)\n",
                    e.docs[d].path, dir[0] ? dir : "the current folder");
            return EXIT_NOTFOUND;
        }
    }

    const char *model_path = cli_model_path(model_flag);
    if ((rc = cli_load_model(model_path, NULL, KVZ_DEVICE_CPU, (int32_t)threads, &e.m)))
        return cli_exit_code(rc);
    e.c = kvz_model_config(e.m);
    e.tok = kvz_model_tokenizer(e.m);
    e.full = calloc((size_t)e.nq, sizeof *e.full);
    e.full_gen = calloc((size_t)e.nq, sizeof *e.full_gen);
    e.runs = calloc((size_t)e.nq * N_METHOD * e.nr, sizeof *e.runs);
    if (!e.full || !e.full_gen || !e.runs) {
        cli_error(KVZ_ERR_NOMEM, "cannot allocate results");
        return EXIT_FAIL;
    }
    if (!quiet)
        fprintf(stderr, "kvzip-eval: %d questions, %d documents, %d ratios, methods:%s%s%s%s\n", e.nq,
                e.ndocs, e.nr, " kvzip", e.use[M_RANDOM] ? " random" : "", e.use[M_WINDOW] ? " window" : "",
                e.use[M_SNAPKV] ? " snapkv snapkv-q1" : "");
    const double t_start = kvz_now();
    for (int d = 0; d < e.ndocs && !rc; d++) {
        int nd = 0;
        for (int i = 0; i < e.nq; i++) nd += e.q[i].doc_idx == d;
        if (!quiet) fprintf(stderr, "[%d/%d] %s (%d questions)\n", d + 1, e.ndocs, e.docs[d].name, nd);
        rc = eval_doc(&e, d);
        if (!quiet && !rc)
            fprintf(stderr, "  done in %.1f s (%.1f s elapsed)\n", e.docs[d].total_s, kvz_now() - t_start);
    }
    const double seconds = kvz_now() - t_start;
    e.t_answer = seconds - e.t_score;
    int exit_code = rc ? cli_exit_code(rc) : 0;
    if (!rc) {
        print_tables(&e, seconds);
        fflush(stdout);
        if (json_path && (rc = write_json(&e, json_path, model_path, qa_path, seconds))) {
            cli_error(rc, "cannot write --json");
            exit_code = EXIT_FAIL;
        }
        if (plot_path && (rc = write_plot(&e, plot_path))) {
            cli_error(rc, "cannot write --plot");
            exit_code = EXIT_FAIL;
        }
    }
    for (int qi = 0; qi < e.nq; qi++) {
        free(e.full[qi].answer);
        kvz_tokens_free(&e.full_gen[qi]);
        for (int m = 0; m < N_METHOD; m++)
            for (int r = 0; r < e.nr; r++) free(R(&e, qi, m, r)->answer);
        qa_free(&e.q[qi]);
    }
    for (int d = 0; d < e.ndocs; d++) { free(e.docs[d].name); free(e.docs[d].path); }
    for (int w = 0; w < n_want; w++) free(want[w]);
    free(want); free(want_hit); free(dir);
    free(e.q); free(e.docs); free(e.ratios); free(e.full); free(e.full_gen); free(e.runs);
    kvz_model_free(e.m);
    return exit_code;
}
