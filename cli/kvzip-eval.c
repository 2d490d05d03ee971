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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_util.h"
#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_kvrow.h"
#include "kvz_kvzip.h"
#include "kvz_model.h"

static void usage(void)
{
    printf(
        "usage: kvzip-eval [options] FILE.jsonl\n"
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
        "  --model PATH       GGUF model (default: $KVZ_MODEL or %s)\n"
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

typedef struct jp { const char *s; size_t i, n; } jp;

static void jws(jp *p)
{
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\r' ||
                           p->s[p->i] == '\n'))
        p->i++;
}

static int hex4(jp *p, uint32_t *v)
{
    if (p->i + 4 > p->n) return -1;
    *v = 0;
    for (int k = 0; k < 4; k++) {
        int c = p->s[p->i++], d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return -1;
        *v = *v << 4 | (uint32_t)d;
    }
    return 0;
}

/* A JSON string at p (after whitespace) into a malloc'd UTF-8 string. */
static int jstr(jp *p, char **out)
{
    jws(p);
    if (p->i >= p->n || p->s[p->i] != '"') return -1;
    p->i++;
    char *b = malloc(p->n - p->i + 1);
    size_t o = 0;
    if (!b) return -1;
    while (p->i < p->n && p->s[p->i] != '"') {
        unsigned char c = (unsigned char)p->s[p->i++];
        if (c < 0x20) goto bad;
        if (c != '\\') { b[o++] = (char)c; continue; }
        if (p->i >= p->n) goto bad;
        c = (unsigned char)p->s[p->i++];
        switch (c) {
        case '"': case '\\': case '/': b[o++] = (char)c; break;
        case 'b': b[o++] = '\b'; break;
        case 'f': b[o++] = '\f'; break;
        case 'n': b[o++] = '\n'; break;
        case 'r': b[o++] = '\r'; break;
        case 't': b[o++] = '\t'; break;
        case 'u': {
            uint32_t cp, lo;
            if (hex4(p, &cp)) goto bad;
            if (cp >= 0xD800 && cp < 0xDC00) {
                if (p->i + 6 > p->n || p->s[p->i] != '\\' || p->s[p->i + 1] != 'u') goto bad;
                p->i += 2;
                if (hex4(p, &lo) || lo < 0xDC00 || lo >= 0xE000) goto bad;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp < 0xE000) {
                goto bad;
            }
            if (cp == 0) goto bad;
            if (cp < 0x80) b[o++] = (char)cp;
            else if (cp < 0x800) { b[o++] = (char)(0xC0 | cp >> 6); b[o++] = (char)(0x80 | (cp & 0x3F)); }
            else if (cp < 0x10000) {
                b[o++] = (char)(0xE0 | cp >> 12); b[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                b[o++] = (char)(0x80 | (cp & 0x3F));
            } else {
                b[o++] = (char)(0xF0 | cp >> 18); b[o++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                b[o++] = (char)(0x80 | ((cp >> 6) & 0x3F)); b[o++] = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default: goto bad;
        }
    }
    if (p->i >= p->n) goto bad;
    p->i++;
    b[o] = 0;
    *out = b;
    return 0;
bad:
    free(b);
    return -1;
}

static int jskip(jp *p, int depth)
{
    jws(p);
    if (p->i >= p->n || depth > 64) return -1;
    char c = p->s[p->i];
    if (c == '"') {
        char *s;
        if (jstr(p, &s)) return -1;
        free(s);
        return 0;
    }
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        p->i++;
        jws(p);
        if (p->i < p->n && p->s[p->i] == close) { p->i++; return 0; }
        for (;;) {
            if (c == '{') {
                char *k;
                if (jstr(p, &k)) return -1;
                free(k);
                jws(p);
                if (p->i >= p->n || p->s[p->i++] != ':') return -1;
            }
            if (jskip(p, depth + 1)) return -1;
            jws(p);
            if (p->i >= p->n) return -1;
            if (p->s[p->i] == ',') { p->i++; continue; }
            if (p->s[p->i] == close) { p->i++; return 0; }
            return -1;
        }
    }
    size_t i0 = p->i; /* number, true, false, null */
    while (p->i < p->n && (isalnum((unsigned char)p->s[p->i]) || strchr("+-.", p->s[p->i]))) p->i++;
    return p->i > i0 ? 0 : -1;
}

static void qa_free(qa *q)
{
    free(q->doc); free(q->path); free(q->question); free(q->answer);
    for (int i = 0; i < q->n_accept; i++) free(q->accept[i]);
    free(q->accept);
}

/* One line -> q. Returns 0, or -1 with a reason in why. */
static int parse_qa(const char *line, size_t len, qa *q, const char **why)
{
    jp p = {line, 0, len};
    memset(q, 0, sizeof *q);
    *why = "not a JSON object";
    jws(&p);
    if (p.i >= p.n || line[p.i++] != '{') return -1;
    jws(&p);
    if (p.i < p.n && line[p.i] == '}') p.i++;
    else
        for (;;) {
            char *key;
            if (jstr(&p, &key)) goto bad;
            jws(&p);
            if (p.i >= p.n || line[p.i++] != ':') { free(key); goto bad; }
            char **dst = !strcmp(key, "doc") ? &q->doc : !strcmp(key, "question") ? &q->question
                         : !strcmp(key, "answer") ? &q->answer : NULL;
            int is_accept = !strcmp(key, "accept");
            free(key);
            jws(&p);
            if (dst) {
                free(*dst);
                *dst = NULL;
                if (jstr(&p, dst)) { *why = "\"doc\", \"question\" and \"answer\" must be strings"; goto bad; }
            } else if (is_accept) {
                *why = "\"accept\" must be an array of strings";
                if (p.i >= p.n || line[p.i++] != '[') goto bad;
                jws(&p);
                if (p.i < p.n && line[p.i] == ']') p.i++;
                else
                    for (;;) {
                        char *s;
                        if (jstr(&p, &s)) goto bad;
                        char **na = realloc(q->accept, sizeof *na * (size_t)(q->n_accept + 1));
                        if (!na) { free(s); goto bad; }
                        q->accept = na;
                        q->accept[q->n_accept++] = s;
                        jws(&p);
                        if (p.i < p.n && line[p.i] == ',') { p.i++; continue; }
                        if (p.i < p.n && line[p.i] == ']') { p.i++; break; }
                        goto bad;
                    }
                *why = "not a JSON object";
            } else if (jskip(&p, 0)) {
                goto bad;
            }
            jws(&p);
            if (p.i < p.n && line[p.i] == ',') { p.i++; continue; }
            if (p.i < p.n && line[p.i] == '}') { p.i++; break; }
            goto bad;
        }
    jws(&p);
    if (p.i != p.n) { *why = "text after the object"; goto bad; }
    if (!q->doc || !q->question || !q->answer) {
        *why = "missing \"doc\", \"question\" or \"answer\"";
        goto bad;
    }
    if (!q->doc[0] || !q->question[0] || !q->answer[0]) { *why = "empty \"doc\", \"question\" or \"answer\""; goto bad; }
    if (q->n_accept == 0) {
        q->accept = malloc(sizeof *q->accept);
        if (!q->accept || !(q->accept[0] = strdup(q->answer))) goto bad;
        q->n_accept = 1;
    }
    return 0;
bad:
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

int main(int argc, char **argv)
{
    cli_init("kvzip-eval", argv);
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
    /* ratios */
    {
        char *dup = strdup(ratios_s), *save = NULL;
        for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            double r = cli_parse_double("--ratios", t, 0.0, 1.0);
            if (r <= 0.0) cli_usage_error("--ratios: %s is not in (0, 1]", t);
            for (int k = 0; k < e.nr; k++)
                if (e.ratios[k] == r) cli_usage_error("--ratios: %s given twice", t);
            e.ratios = realloc(e.ratios, sizeof(double) * (size_t)(e.nr + 1));
            e.ratios[e.nr++] = r;
        }
        free(dup);
        if (e.nr == 0) cli_usage_error("--ratios is empty");
    }
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
