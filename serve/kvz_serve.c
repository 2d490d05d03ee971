/* kvz_serve: OpenAI-compatible chat completions over stored KVzip caches
 * (see kvz_serve.h for the thread layout, docs/SERVER.md for the API). */
#include "kvz_serve.h"

#include <errno.h>
#include <microhttpd.h>
#include <jansson.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------- */
/* Small helpers                                                               */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    char *p;
    size_t n, cap;
} buf;

static int buf_add(buf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

/* A JSON string of bytes that may not be UTF-8 (a model can emit any byte):
 * invalid bytes become U+FFFD so the response stays valid JSON. */
static json_t *json_text(const char *s, size_t n)
{
    json_t *j = json_stringn(s, n);
    if (j) return j;
    buf b = {0};
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x80) buf_add(&b, (const char *)&c, 1);
        else buf_add(&b, "\xEF\xBF\xBD", 3);
    }
    j = json_stringn(b.p ? b.p : "", b.n);
    free(b.p);
    return j;
}

/* Bytes of @p s (length n) that end on a UTF-8 character boundary: a token may carry
 * only the first bytes of a character, the rest comes with the next token. */
static size_t utf8_complete(const char *s, size_t n)
{
    for (size_t back = 1; back <= 4 && back <= n; back++) {
        unsigned char c = (unsigned char)s[n - back];
        if ((c & 0xC0) == 0x80) continue; /* continuation byte */
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return need > back ? n - back : n;
    }
    return n;
}

/* ------------------------------------------------------------------------- */
/* Metrics                                                                     */

static const double TTFT_B[] = {0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
static const double TOK_B[] = {0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1};
#define NTTFT (sizeof TTFT_B / sizeof TTFT_B[0])
#define NTOK (sizeof TOK_B / sizeof TOK_B[0])
static const double BSIZE_B[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};
static const double STEP_B[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};
#define NBSIZE (sizeof BSIZE_B / sizeof BSIZE_B[0])
#define NSTEP (sizeof STEP_B / sizeof STEP_B[0])
static const int CODES[] = {200, 400, 401, 404, 405, 413, 500, 503, 504};
#define NCODES (sizeof CODES / sizeof CODES[0])

typedef struct {
    uint64_t count[16];
    double sum;
    uint64_t n;
} histo;

typedef struct {
    pthread_mutex_t mu;
    uint64_t requests[NCODES + 1]; /* by status code; last = other */
    uint64_t completions, canceled, timeouts;
    uint64_t prompt_tokens, completion_tokens;
    uint64_t doc_loads;
    double doc_load_s;
    histo ttft, tok;
    histo bsize, bstep;        /* --max-batch > 1: decode step sizes and their forward time */
    uint64_t bsteps;
    uint64_t bpath[4], brows_logits; /* steps replayed / captured / eager / per-answer passes; logits rows back */
    int32_t brunning, bwaiting;
} metrics;

static void histo_add(histo *h, const double *b, size_t nb, double v)
{
    for (size_t i = 0; i < nb; i++)
        if (v <= b[i]) h->count[i]++;
    h->sum += v;
    h->n++;
}

/* ------------------------------------------------------------------------- */
/* Jobs and the queue                                                          */

typedef struct server server;

typedef struct job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    server *srv;
    /* request */
    char *question;            /* last user message (earlier turns folded in) */
    char *text;                /* plain chat: the transcript as the session's text */
    char **docs;
    int ndocs;
    kvzip_session_opts so;
    int stream;
    char id[48];
    long created;
    double t0;                 /* accepted */
    int fd;                    /* client socket, polled for a hang-up */
    /* progress */
    atomic_int cancel;         /* 1: client gone, 2: timed out */
    int started, done, rc, status;
    char detail[512];
    buf out;                   /* stream: SSE bytes; else the answer */
    size_t sent;               /* stream bytes handed to libmicrohttpd */
    buf pend;                  /* stream: bytes of an unfinished UTF-8 character */
    int ntok;
    double t_first, t_last;
    kvzip_answer_stats as;
    int32_t doc_tokens;
    /* --max-batch > 1: the session answering in the batch and its cache key */
    kvzip_session *ss;
    char *key;
} job;

struct server {
    kvzip_model *m;
    kvzip_store *s;
    kvz_serve_opts o;
    kvzip_model_info mi;
    pthread_mutex_t qmu;
    pthread_cond_t qcv;
    job **q;
    int qhead, qlen, stop, busy;
    pthread_t *workers;
    kvzip_batch *batch;        /* --max-batch > 1: the scheduler thread steps it */
    pthread_t sched;
    atomic_int sched_stop;
    metrics mt;
    atomic_ulong seq;
    /* LRU of idle decoded sessions: a whole stored document with the same content
     * hash and the same decoding options is answered without reading the store */
    pthread_mutex_t cmu;
    struct centry {
        char *key;
        kvzip_session *ss;
        uint64_t bytes, used;
    } *cache;
    int ncache;
    uint64_t cache_bytes, cache_tick, cache_hits, cache_misses, cache_evictions;
};

static void job_unref(job *j)
{
    pthread_mutex_lock(&j->mu);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (!last) return;
    free(j->question);
    free(j->text);
    for (int i = 0; i < j->ndocs; i++) free(j->docs[i]);
    free(j->docs);
    free(j->out.p);
    free(j->pend.p);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static int queue_push(server *sv, job *j)
{
    pthread_mutex_lock(&sv->qmu);
    if (sv->qlen >= sv->o.max_queue || sv->stop) {
        pthread_mutex_unlock(&sv->qmu);
        return -1;
    }
    sv->q[(sv->qhead + sv->qlen) % sv->o.max_queue] = j;
    sv->qlen++;
    pthread_cond_signal(&sv->qcv);
    pthread_mutex_unlock(&sv->qmu);
    return 0;
}

static job *queue_pop(server *sv)
{
    pthread_mutex_lock(&sv->qmu);
    /* with a batch, workers only open sessions and submit them: at most --max-batch
     * jobs are taken (busy) until their answers end, the rest wait in the queue */
    while ((!sv->qlen || (sv->batch && sv->busy >= sv->o.max_batch)) && !sv->stop)
        pthread_cond_wait(&sv->qcv, &sv->qmu);
    job *j = NULL;
    if (sv->qlen) {
        j = sv->q[sv->qhead];
        sv->qhead = (sv->qhead + 1) % sv->o.max_queue;
        sv->qlen--;
        sv->busy++;
    }
    pthread_mutex_unlock(&sv->qmu);
    return j;
}

/* ------------------------------------------------------------------------- */
/* Response bodies                                                             */

static json_t *error_obj(const char *msg, const char *type, const char *code, const char *param)
{
    json_t *e = json_object();
    json_object_set_new(e, "message", json_text(msg, strlen(msg)));
    json_object_set_new(e, "type", json_string(type));
    json_object_set_new(e, "param", param ? json_string(param) : json_null());
    json_object_set_new(e, "code", code ? json_string(code) : json_null());
    json_t *o = json_object();
    json_object_set_new(o, "error", e);
    return o;
}

static const char *status_type(int status)
{
    switch (status) {
    case 400: case 404: case 405: case 413: return "invalid_request_error";
    case 401: return "authentication_error";
    case 503: return "server_overloaded";
    case 504: return "timeout";
    default: return "server_error";
    }
}

static json_t *usage_obj(const job *j)
{
    json_t *u = json_object();
    json_int_t p = (json_int_t)j->doc_tokens + j->as.prompt_tokens;
    json_object_set_new(u, "prompt_tokens", json_integer(p));
    json_object_set_new(u, "completion_tokens", json_integer(j->as.answer_tokens));
    json_object_set_new(u, "total_tokens", json_integer(p + j->as.answer_tokens));
    return u;
}

static json_t *chunk_obj(const job *j, const char *model, json_t *delta, const char *finish)
{
    json_t *c = json_object();
    json_object_set_new(c, "index", json_integer(0));
    json_object_set_new(c, "delta", delta);
    json_object_set_new(c, "finish_reason", finish ? json_string(finish) : json_null());
    json_t *a = json_array();
    json_array_append_new(a, c);
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(j->id));
    json_object_set_new(o, "object", json_string("chat.completion.chunk"));
    json_object_set_new(o, "created", json_integer(j->created));
    json_object_set_new(o, "model", json_string(model));
    json_object_set_new(o, "choices", a);
    return o;
}

/* Append "data: JSON\n\n" (takes the reference of @p o). Caller holds j->mu. */
static void sse_add(job *j, json_t *o)
{
    char *t = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!t) return;
    buf_add(&j->out, "data: ", 6);
    buf_add(&j->out, t, strlen(t));
    buf_add(&j->out, "\n\n", 2);
    free(t);
}

/* ------------------------------------------------------------------------- */
/* Workers                                                                     */

static int on_token(void *user, const char *piece, size_t len, int32_t token)
{
    (void)token;
    job *j = user;
    server *sv = j->srv;
    const double t = now_s();
    pthread_mutex_lock(&j->mu);
    if (!j->ntok) j->t_first = t;
    else {
        pthread_mutex_lock(&sv->mt.mu);
        histo_add(&sv->mt.tok, TOK_B, NTOK, t - j->t_last);
        pthread_mutex_unlock(&sv->mt.mu);
    }
    j->t_last = t;
    if (j->stream) {
        if (!j->ntok) {
            json_t *d = json_object();
            json_object_set_new(d, "role", json_string("assistant"));
            json_object_set_new(d, "content", json_string(""));
            sse_add(j, chunk_obj(j, sv->o.model_name, d, NULL));
        }
        buf_add(&j->pend, piece, len);
        size_t n = utf8_complete(j->pend.p, j->pend.n);
        if (n) {
            json_t *d = json_object();
            json_object_set_new(d, "content", json_text(j->pend.p, n));
            sse_add(j, chunk_obj(j, sv->o.model_name, d, NULL));
            memmove(j->pend.p, j->pend.p + n, j->pend.n - n);
            j->pend.n -= n;
        }
    }
    else buf_add(&j->out, piece, len);
    j->ntok++;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (sv->o.timeout_s > 0 && t - j->t0 > sv->o.timeout_s) {
        int zero = 0;
        atomic_compare_exchange_strong(&j->cancel, &zero, 2);
    }
    return atomic_load(&j->cancel) != 0;
}

static int status_of(int rc, int cancel)
{
    switch (rc) {
    case 0: return 200;
    case KVZIP_ERR_NOTFOUND: return 404;
    case KVZIP_ERR_ARG: case KVZIP_ERR_CONTEXT: case KVZIP_ERR_EMPTY: case KVZIP_ERR_ENCODING:
        return 400;
    case KVZIP_ERR_CANCELED: return cancel == 2 ? 504 : 499;
    case KVZIP_ERR_NOMEM: return 503;
    default: return 500;
    }
}

/* The cache key of a job: NULL when its session cannot be reused (text session,
 * several documents, a split document). */
static char *cache_key(server *sv, const job *j)
{
    if (!sv->o.cache_mem || j->ndocs != 1) return NULL;
    kvzip_doc_entry e;
    if (kvzip_store_doc(sv->s, j->docs[0], &e)) return NULL;
    char hex[33], *k = NULL;
    for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", e.hash[i]);
    const kvzip_session_opts *o = &j->so;
    if (asprintf(&k, "%s|%s|%d|%d|%d|%.9g|%.9g|%llu", j->docs[0], hex, o->budget, o->max_tokens,
                 o->budget ? 0 : o->max_question_tokens, o->temperature, o->top_p,
                 (unsigned long long)o->seed) < 0)
        return NULL;
    return k;
}

static kvzip_session *cache_take(server *sv, const char *key)
{
    kvzip_session *ss = NULL;
    pthread_mutex_lock(&sv->cmu);
    for (int i = 0; key && i < sv->ncache; i++)
        if (!strcmp(sv->cache[i].key, key)) {
            ss = sv->cache[i].ss;
            sv->cache_bytes -= sv->cache[i].bytes;
            free(sv->cache[i].key);
            sv->cache[i] = sv->cache[--sv->ncache];
            break;
        }
    if (key) {
        if (ss) sv->cache_hits++;
        else sv->cache_misses++;
    }
    pthread_mutex_unlock(&sv->cmu);
    return ss;
}

/* Keep an idle session (takes @p key and @p ss), evicting the least recently used
 * ones beyond --cache-mem. A session larger than the whole budget is closed. */
static void cache_put(server *sv, char *key, kvzip_session *ss, uint64_t bytes)
{
    kvzip_session *drop[64];
    int nd = 0;
    pthread_mutex_lock(&sv->cmu);
    struct centry *c = bytes <= sv->o.cache_mem ? realloc(sv->cache, (size_t)(sv->ncache + 1) * sizeof *c) : NULL;
    if (!c) {
        pthread_mutex_unlock(&sv->cmu);
        free(key);
        kvzip_session_close(ss);
        return;
    }
    sv->cache = c;
    sv->cache[sv->ncache++] = (struct centry){key, ss, bytes, ++sv->cache_tick};
    sv->cache_bytes += bytes;
    while (sv->cache_bytes > sv->o.cache_mem && nd < 64) {
        int lru = 0;
        for (int i = 1; i < sv->ncache; i++)
            if (sv->cache[i].used < sv->cache[lru].used) lru = i;
        drop[nd++] = sv->cache[lru].ss;
        sv->cache_bytes -= sv->cache[lru].bytes;
        free(sv->cache[lru].key);
        sv->cache[lru] = sv->cache[--sv->ncache];
        sv->cache_evictions++;
    }
    pthread_mutex_unlock(&sv->cmu);
    for (int i = 0; i < nd; i++) kvzip_session_close(drop[i]);
}

/* The job's session: a kept one (cache hit) or opened now. Sets *ssp and *keyp (the
 * cache key, NULL when not cacheable) also on an error. */
static int open_job_session(server *sv, job *j, kvzip_session **ssp, char **keyp)
{
    kvzip_session *ss = NULL;
    int rc = 0;
    char *key = atomic_load(&j->cancel) ? NULL : cache_key(sv, j);
    double tl = now_s();
    int hit = 0;
    if (atomic_load(&j->cancel)) rc = KVZIP_ERR_CANCELED;
    else if ((ss = cache_take(sv, key))) hit = 1;
    else if (!j->ndocs && j->text) rc = kvzip_session_open_text(sv->m, j->text, strlen(j->text), &j->so, &ss);
    else if (!j->ndocs) rc = kvzip_session_open_chat(sv->m, &j->so, &ss);
    else {
        /* as kvzip-query: one whole document opens plainly, a split one or several compose */
        rc = j->ndocs == 1 ? kvzip_session_open(sv->m, sv->s, j->docs[0], &j->so, &ss) : KVZIP_ERR_NOTFOUND;
        if (rc == KVZIP_ERR_NOTFOUND)
            rc = kvzip_session_open_docs(sv->m, sv->s, (const char *const *)j->docs, j->ndocs, &j->so,
                                         NULL, &ss);
    }
    tl = now_s() - tl;
    if (!rc) {
        kvzip_session_info si;
        kvzip_session_info_get(ss, &si);
        j->doc_tokens = j->ndocs ? si.doc_tokens : 0;
        pthread_mutex_lock(&sv->mt.mu);
        if (j->ndocs && !hit) {
            sv->mt.doc_loads++;
            sv->mt.doc_load_s += tl;
        }
        pthread_mutex_unlock(&sv->mt.mu);
    }
    *ssp = ss;
    *keyp = key;
    return rc;
}

/* The job's end: the session back to the LRU (or closed), the response completed
 * (status, final SSE chunks or the answer), the connection thread woken, metrics.
 * @p answer may be NULL (then the text the token callback gathered is the answer). */
static void finish_job(server *sv, job *j, char *key, kvzip_session *ss, int rc, kvzip_answer_stats as,
                       const char *errdetail, const char *answer)
{
    char detail[400];
    snprintf(detail, sizeof detail, "%.399s", rc && errdetail ? errdetail : "");
    /* a session stays usable after an answer, also a canceled one */
    if (key && ss && (!rc || rc == KVZIP_ERR_CANCELED)) cache_put(sv, key, ss, as.kv_bytes_held);
    else {
        free(key);
        kvzip_session_close(ss);
    }
    const int cancel = atomic_load(&j->cancel);
    pthread_mutex_lock(&j->mu);
    j->as = as;
    j->rc = rc;
    j->status = status_of(rc, cancel);
    if (rc) {
        if (rc == KVZIP_ERR_CANCELED)
            snprintf(j->detail, sizeof j->detail, cancel == 2 ? "the request took longer than the "
                     "server's --timeout of %.0f s" : "the client went away", sv->o.timeout_s);
        else
            snprintf(j->detail, sizeof j->detail, "%.80s%s%s", kvzip_strerror(rc), detail[0] ? ": " : "", detail);
    }
    if (j->stream) {
        if (!rc) {
            if (!j->ntok) {
                json_t *d = json_object();
                json_object_set_new(d, "role", json_string("assistant"));
                json_object_set_new(d, "content", json_string(""));
                sse_add(j, chunk_obj(j, sv->o.model_name, d, NULL));
            }
            if (j->pend.n) {
                json_t *d = json_object();
                json_object_set_new(d, "content", json_text(j->pend.p, j->pend.n));
                sse_add(j, chunk_obj(j, sv->o.model_name, d, NULL));
            }
            json_t *c = chunk_obj(j, sv->o.model_name, json_object(), as.stopped ? "stop" : "length");
            json_object_set_new(c, "usage", usage_obj(j));
            sse_add(j, c);
        } else if (j->ntok) { /* the stream has begun: the error goes in it */
            sse_add(j, error_obj(j->detail, status_type(j->status), NULL, NULL));
        }
        if (!rc || j->ntok) buf_add(&j->out, "data: [DONE]\n\n", 14);
    } else if (answer) {
        j->out.n = 0;
        buf_add(&j->out, answer, strlen(answer));
    }
    j->done = 1;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);

    pthread_mutex_lock(&sv->mt.mu);
    if (!rc) {
        sv->mt.completions++;
        sv->mt.prompt_tokens += (uint64_t)(j->doc_tokens + as.prompt_tokens);
        sv->mt.completion_tokens += (uint64_t)as.answer_tokens;
        histo_add(&sv->mt.ttft, TTFT_B, NTTFT, j->t_first - j->t0);
    } else if (rc == KVZIP_ERR_CANCELED) {
        if (cancel == 2) sv->mt.timeouts++;
        else sv->mt.canceled++;
    }
    pthread_mutex_unlock(&sv->mt.mu);
}

static void run_job(server *sv, job *j)
{
    kvzip_session *ss;
    char *key, *answer = NULL;
    kvzip_answer_stats as = {0};
    int rc = open_job_session(sv, j, &ss, &key);
    if (!rc) rc = kvzip_ask(ss, j->question, on_token, j, &answer, &as);
    finish_job(sv, j, key, ss, rc, as, rc ? kvzip_errdetail() : NULL, answer);
    kvzip_free(answer);
}

static void job_released(server *sv)
{
    pthread_mutex_lock(&sv->qmu);
    sv->busy--;
    pthread_cond_broadcast(&sv->qcv); /* a batch slot is free */
    pthread_mutex_unlock(&sv->qmu);
}

/* kvzip_batch's done callback (scheduler thread): the answer ended, the session was
 * rolled back to its document. */
static void batch_done(void *user, int rc, const kvzip_answer_stats *st)
{
    job *j = user;
    server *sv = j->srv;
    finish_job(sv, j, j->key, j->ss, rc, *st, rc ? kvzip_errdetail() : NULL, NULL);
    j->key = NULL;
    j->ss = NULL;
    job_unref(j);
    job_released(sv);
}

/* --max-batch > 1: open the job's session and hand it to the batch; the job ends in
 * batch_done. 1 when it was submitted. */
static int submit_job(server *sv, job *j)
{
    kvzip_session *ss;
    char *key;
    int rc = open_job_session(sv, j, &ss, &key);
    if (!rc) {
        j->ss = ss;
        j->key = key;
        rc = kvzip_batch_submit(sv->batch, ss, j->question, on_token, batch_done, j);
        if (!rc) return 1;
        j->ss = NULL;
        j->key = NULL;
    }
    kvzip_answer_stats as = {0};
    finish_job(sv, j, key, ss, rc, as, kvzip_errdetail(), NULL);
    return 0;
}

/* The scheduler thread (--max-batch > 1): steps the batch while it has answers. */
static void *sched_main(void *arg)
{
    server *sv = arg;
    while (!atomic_load(&sv->sched_stop)) {
        const int n = kvzip_batch_step(sv->batch);
        kvzip_batch_info bi;
        kvzip_batch_info_get(sv->batch, &bi);
        pthread_mutex_lock(&sv->mt.mu);
        if (bi.last_step_size > 0) {
            histo_add(&sv->mt.bsize, BSIZE_B, NBSIZE, bi.last_step_size);
            histo_add(&sv->mt.bstep, STEP_B, NSTEP, bi.last_step_s);
        }
        sv->mt.bsteps = bi.steps;
        sv->mt.bpath[0] = bi.steps_replayed;
        sv->mt.bpath[1] = bi.steps_captured;
        sv->mt.bpath[2] = bi.steps_eager;
        sv->mt.bpath[3] = bi.steps_passes;
        sv->mt.brows_logits = bi.rows_logits;
        sv->mt.brunning = bi.running;
        sv->mt.bwaiting = bi.waiting;
        pthread_mutex_unlock(&sv->mt.mu);
        if (n == 0) kvzip_batch_wait(sv->batch, 0.1);
    }
    return NULL;
}

static void *worker_main(void *arg)
{
    server *sv = arg;
    job *j;
    while ((j = queue_pop(sv))) {
        pthread_mutex_lock(&j->mu);
        j->started = 1;
        pthread_mutex_unlock(&j->mu);
        if (sv->batch) {
            if (submit_job(sv, j)) continue; /* the job's reference and slot go to batch_done */
        } else {
            run_job(sv, j);
        }
        job_unref(j);
        job_released(sv);
    }
    return NULL;
}

/* ------------------------------------------------------------------------- */
/* HTTP                                                                        */

typedef struct {
    buf body;
    int too_big;
} req;

static void count_status(server *sv, int status)
{
    size_t i = 0;
    while (i < NCODES && CODES[i] != status) i++;
    pthread_mutex_lock(&sv->mt.mu);
    sv->mt.requests[i]++;
    pthread_mutex_unlock(&sv->mt.mu);
}

static enum MHD_Result send_text(server *sv, struct MHD_Connection *c, int status, const char *ctype,
                                 char *text, const char *retry_after)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    MHD_add_response_header(r, "Content-Type", ctype);
    if (retry_after) MHD_add_response_header(r, "Retry-After", retry_after);
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    count_status(sv, status);
    return ok;
}

static enum MHD_Result send_json(server *sv, struct MHD_Connection *c, int status, json_t *o)
{
    char *t = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!t) return MHD_NO;
    size_t n = strlen(t);
    char *t2 = realloc(t, n + 2);
    if (t2) {
        t = t2;
        strcpy(t + n, "\n");
    }
    return send_text(sv, c, status, "application/json", t, status == 503 ? "1" : NULL);
}

static enum MHD_Result send_error(server *sv, struct MHD_Connection *c, int status, const char *code,
                                  const char *param, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return send_json(sv, c, status, error_obj(msg, status_type(status), code, param));
}

/* The client closed its side (or the socket failed): stop working for it. */
static int client_gone(int fd)
{
    if (fd < 0) return 0;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* Wait (j->mu held) until @p ready or the client leaves / the request times out. */
static void job_wait(job *j, int (*ready)(const job *))
{
    server *sv = j->srv;
    while (!ready(j)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        if (!j->done && client_gone(j->fd)) {
            int zero = 0;
            atomic_compare_exchange_strong(&j->cancel, &zero, 1);
        }
        if (!j->done && sv->o.timeout_s > 0 && now_s() - j->t0 > sv->o.timeout_s) {
            int zero = 0;
            atomic_compare_exchange_strong(&j->cancel, &zero, 2);
        }
        /* a job still queued is answered here; a running one ends at its next token */
        if (atomic_load(&j->cancel) && !j->started) return;
    }
}

static int ready_done(const job *j) { return j->done; }
static int ready_first(const job *j) { return j->done || j->out.n > 0; }
static int ready_more(const job *j) { return j->done || j->out.n > j->sent; }

static ssize_t stream_read(void *cls, uint64_t pos, char *out, size_t max)
{
    (void)pos;
    job *j = cls;
    pthread_mutex_lock(&j->mu);
    job_wait(j, ready_more);
    ssize_t n;
    if (j->out.n > j->sent) {
        size_t k = j->out.n - j->sent < max ? j->out.n - j->sent : max;
        memcpy(out, j->out.p + j->sent, k);
        j->sent += k;
        n = (ssize_t)k;
    } else if (j->done) n = MHD_CONTENT_READER_END_OF_STREAM;
    else n = MHD_CONTENT_READER_END_WITH_ERROR; /* client gone before the job started */
    pthread_mutex_unlock(&j->mu);
    return n;
}

static void stream_free(void *cls)
{
    job *j = cls;
    int zero = 0;
    atomic_compare_exchange_strong(&j->cancel, &zero, 1); /* no-op when finished */
    job_unref(j);
}

/* Message content: a string, or an array of {"type":"text","text":...} parts. */
static int content_of(json_t *c, buf *out)
{
    if (json_is_string(c)) return buf_add(out, json_string_value(c), json_string_length(c)) ? -1 : 0;
    if (!json_is_array(c)) return 1;
    size_t i;
    json_t *p;
    json_array_foreach(c, i, p) {
        json_t *t = json_object_get(p, "text");
        if (!json_is_string(json_object_get(p, "type")) || strcmp(json_string_value(json_object_get(p, "type")), "text") ||
            !json_is_string(t))
            return 1;
        if (buf_add(out, json_string_value(t), json_string_length(t))) return -1;
    }
    return 0;
}

static enum MHD_Result chat(server *sv, struct MHD_Connection *c, req *rq)
{
    const kvz_serve_opts *o = &sv->o;
    if (rq->too_big)
        return send_error(sv, c, 413, "request_too_large", NULL,
                          "request body larger than the server's limit of %zu bytes", o->max_body);
    json_error_t je;
    json_t *root = json_loadb(rq->body.p ? rq->body.p : "", rq->body.n, JSON_REJECT_DUPLICATES, &je);
    if (!root) return send_error(sv, c, 400, "invalid_json", NULL, "request body is not valid JSON: %s (line %d, column %d)",
                                 je.text, je.line, je.column);
    enum MHD_Result res;
    job *j = calloc(1, sizeof *j);
    buf hist = {0}, last = {0}, sys = {0};
#define FAIL(st, code, param, ...) do { res = send_error(sv, c, st, code, param, __VA_ARGS__); goto out; } while (0)
    if (!j) FAIL(503, NULL, NULL, "out of memory");
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 1;
    j->srv = sv;
    j->fd = -1;
    if (!json_is_object(root)) FAIL(400, "invalid_type", NULL, "the request body must be a JSON object");
    kvzip_session_defaults(&j->so);
    j->so.budget = o->budget;
    j->so.max_tokens = o->default_max_tokens;
    json_t *v;
    if ((v = json_object_get(root, "max_completion_tokens")) || (v = json_object_get(root, "max_tokens"))) {
        if (json_is_null(v)) {
        } else if (!json_is_integer(v) || json_integer_value(v) < 1)
            FAIL(400, "invalid_value", "max_tokens", "max_tokens must be a positive integer");
        else if (json_integer_value(v) > o->max_tokens_limit)
            FAIL(400, "invalid_value", "max_tokens", "max_tokens %lld is over this server's limit of %d",
                 (long long)json_integer_value(v), o->max_tokens_limit);
        else j->so.max_tokens = (int32_t)json_integer_value(v);
    }
    if ((v = json_object_get(root, "temperature")) && !json_is_null(v)) {
        if (!json_is_number(v) || json_number_value(v) < 0 || json_number_value(v) > 2)
            FAIL(400, "invalid_value", "temperature", "temperature must be a number from 0 to 2");
        j->so.temperature = (float)json_number_value(v);
    }
    if ((v = json_object_get(root, "top_p")) && !json_is_null(v)) {
        if (!json_is_number(v) || !(json_number_value(v) > 0) || json_number_value(v) > 1)
            FAIL(400, "invalid_value", "top_p", "top_p must be a number in (0, 1]");
        j->so.top_p = (float)json_number_value(v);
    }
    if ((v = json_object_get(root, "seed")) && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            FAIL(400, "invalid_value", "seed", "seed must be a non-negative integer");
        j->so.seed = (uint64_t)json_integer_value(v);
    }
    if ((v = json_object_get(root, "n")) && !json_is_null(v) && (!json_is_integer(v) || json_integer_value(v) != 1))
        FAIL(400, "invalid_value", "n", "only n = 1 is supported");
    if ((v = json_object_get(root, "stream")) && !json_is_null(v)) {
        if (!json_is_boolean(v)) FAIL(400, "invalid_type", "stream", "stream must be true or false");
        j->stream = json_is_true(v);
    }
    /* messages: the last one is the question; earlier turns precede it */
    json_t *msgs = json_object_get(root, "messages");
    if (!json_is_array(msgs) || !json_array_size(msgs))
        FAIL(400, "invalid_value", "messages", "messages must be a non-empty array");
    size_t nm = json_array_size(msgs);
    for (size_t i = 0; i < nm; i++) {
        json_t *m = json_array_get(msgs, i);
        json_t *role = json_object_get(m, "role");
        if (!json_is_object(m) || !json_is_string(role))
            FAIL(400, "invalid_type", "messages", "messages[%zu] must be an object with a string \"role\"", i);
        const char *r = json_string_value(role);
        int is_sys = !strcmp(r, "system") || !strcmp(r, "developer");
        if (!is_sys && strcmp(r, "user") && strcmp(r, "assistant"))
            FAIL(400, "invalid_value", "messages", "messages[%zu]: unknown role (system, user or assistant)", i);
        buf t = {0};
        int e = content_of(json_object_get(m, "content"), &t);
        if (e) {
            free(t.p);
            FAIL(e < 0 ? 503 : 400, NULL, "messages", e < 0 ? "out of memory" :
                 "messages[%zu].content must be a string or an array of text parts", i);
        }
        if (i == nm - 1) {
            if (strcmp(r, "user")) {
                free(t.p);
                FAIL(400, "invalid_value", "messages", "the last message must have role \"user\"");
            }
            last = t;
        } else if (is_sys) {
            if (sys.n) buf_add(&sys, "\n", 1);
            buf_add(&sys, t.p ? t.p : "", t.n);
            free(t.p);
        } else {
            buf_add(&hist, !strcmp(r, "user") ? "User: " : "Assistant: ", !strcmp(r, "user") ? 6 : 11);
            buf_add(&hist, t.p ? t.p : "", t.n);
            buf_add(&hist, "\n", 1);
            free(t.p);
        }
    }
    if (!last.n) FAIL(400, "invalid_value", "messages", "the last user message is empty");
    /* documents: stored ids (the extension field) */
    json_t *docs = json_object_get(root, "documents");
    if (docs && !json_is_null(docs)) {
        if (!json_is_array(docs)) FAIL(400, "invalid_type", "documents", "documents must be an array of stored document ids");
        size_t nd = json_array_size(docs);
        if ((int)nd > o->max_docs)
            FAIL(400, "invalid_value", "documents", "%zu documents; this server takes at most %d per request",
                 nd, o->max_docs);
        j->docs = calloc(nd ? nd : 1, sizeof *j->docs);
        if (!j->docs) FAIL(503, NULL, NULL, "out of memory");
        for (size_t i = 0; i < nd; i++) {
            json_t *d = json_array_get(docs, i);
            if (!json_is_string(d) || !json_string_length(d) || json_string_length(d) > 499)
                FAIL(400, "invalid_value", "documents", "documents[%zu] must be a document id (1 to 499 bytes)", i);
            const char *id = json_string_value(d);
            for (size_t k = 0; k < i; k++)
                if (!strcmp(j->docs[k], id)) FAIL(400, "invalid_value", "documents", "document '%s' is named twice", id);
            /* a new read transaction per check: documents ingested meanwhile are seen */
            char part[600];
            snprintf(part, sizeof part, "%s#1", id);
            int h = kvzip_store_has_doc(sv->s, id);
            if (h == 0) h = kvzip_store_has_doc(sv->s, part);
            if (h < 0) FAIL(500, NULL, NULL, "store: %s: %s", kvzip_strerror(h), kvzip_errdetail());
            if (!h) FAIL(404, "document_not_found", "documents", "document '%s' not found in the store "
                         "(GET /v1/documents lists them)", id);
            j->docs[j->ndocs++] = strdup(id);
        }
    }
    /* the question: earlier turns, then the last user message */
    buf q = {0};
    if (j->ndocs && hist.n) buf_add(&q, hist.p, hist.n);
    buf_add(&q, last.p, last.n);
    j->question = q.p;
    int32_t qt = 0;
    int rc = kvzip_question_tokens(sv->m, j->question, &qt);
    if (rc) FAIL(400, "invalid_value", "messages", "cannot tokenize the question: %s", kvzip_strerror(rc));
    if (o->budget > 0 && qt > o->budget - 8)
        FAIL(400, "context_length_exceeded", "messages", "the question is %d tokens; this server's output "
             "cache (--budget %d) holds at most %d", qt, o->budget, o->budget - 8);
    j->so.max_question_tokens = qt;
    if (!j->ndocs) {
        /* plain chat: the earlier turns are the session's text; a first turn opens a
         * session on the chat prefix alone (kvzip_session_open_chat) */
        j->so.system = NULL;
        if (hist.n && !(j->text = strndup(hist.p, hist.n))) FAIL(500, "server_error", NULL, "out of memory");
        int32_t tt = 0;
        if (j->text && !kvzip_question_tokens(sv->m, j->text, &tt) && tt + qt + j->so.max_tokens > sv->mi.n_ctx)
            FAIL(400, "context_length_exceeded", "messages", "the conversation (%d tokens) + question (%d) + "
                 "max_tokens (%d) exceed the model's context of %d tokens", tt, qt, j->so.max_tokens, sv->mi.n_ctx);
    }
    /* accepted: queue it */
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    j->fd = ci ? ci->connect_fd : -1;
    j->t0 = now_s();
    j->created = (long)time(NULL);
    snprintf(j->id, sizeof j->id, "chatcmpl-kvzip-%lu", (unsigned long)atomic_fetch_add(&sv->seq, 1));
    j->refs = 2; /* this handler + the worker */
    if (queue_push(sv, j)) {
        j->refs = 1;
        FAIL(503, "queue_full", NULL, "the server is busy (%d requests queued); retry later", o->max_queue);
    }
    pthread_mutex_lock(&j->mu);
    job_wait(j, j->stream ? ready_first : ready_done);
    const int finished = j->done, status = j->status, ntok = j->ntok;
    pthread_mutex_unlock(&j->mu);
    if (!finished && !j->stream) {
        /* gave up waiting (client gone or timed out) while the job was still queued */
        int cancel = atomic_load(&j->cancel);
        FAIL(cancel == 2 ? 504 : 503, NULL, NULL, cancel == 2 ? "timed out in the queue" : "canceled");
    }
    if (!finished && j->stream && !j->out.n) {
        int cancel = atomic_load(&j->cancel);
        FAIL(cancel == 2 ? 504 : 503, NULL, NULL, cancel == 2 ? "timed out in the queue" : "canceled");
    }
    if (finished && status != 200 && !(j->stream && ntok)) {
        int st = status == 499 ? 503 : status;
        FAIL(st, status == 404 ? "document_not_found" : j->rc == KVZIP_ERR_CONTEXT ? "context_length_exceeded" : NULL,
             NULL, "%s", j->detail);
    }
    if (j->stream) {
        pthread_mutex_lock(&j->mu);
        j->refs++;
        pthread_mutex_unlock(&j->mu);
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, j, stream_free);
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        res = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        count_status(sv, 200);
        goto out;
    }
    json_t *msg = json_object();
    json_object_set_new(msg, "role", json_string("assistant"));
    json_object_set_new(msg, "content", json_text(j->out.p ? j->out.p : "", j->out.n));
    json_t *ch = json_object();
    json_object_set_new(ch, "index", json_integer(0));
    json_object_set_new(ch, "message", msg);
    json_object_set_new(ch, "finish_reason", json_string(j->as.stopped ? "stop" : "length"));
    json_t *chs = json_array();
    json_array_append_new(chs, ch);
    json_t *resp = json_object();
    json_object_set_new(resp, "id", json_string(j->id));
    json_object_set_new(resp, "object", json_string("chat.completion"));
    json_object_set_new(resp, "created", json_integer(j->created));
    json_object_set_new(resp, "model", json_string(o->model_name));
    json_object_set_new(resp, "choices", chs);
    json_object_set_new(resp, "usage", usage_obj(j));
    json_t *kx = json_object();
    json_object_set_new(kx, "doc_tokens", json_integer(j->doc_tokens));
    json_object_set_new(kx, "question_tokens", json_integer(j->as.prompt_tokens));
    json_object_set_new(kx, "ttft_s", json_real(j->t_first > 0 ? j->t_first - j->t0 : 0));
    json_object_set_new(kx, "decode_tok_s", json_real(j->as.decode_tok_s));
    json_object_set_new(resp, "kvzip", kx);
    res = send_json(sv, c, 200, resp);
out:
#undef FAIL
    free(hist.p);
    free(last.p);
    free(sys.p);
    json_decref(root);
    if (j) job_unref(j);
    return res;
}

static int list_doc(void *user, const kvzip_doc_entry *d)
{
    json_t *o = json_object();
    json_object_set_new(o, "id", json_text(d->id, strlen(d->id)));
    json_object_set_new(o, "object", json_string("document"));
    json_object_set_new(o, "tokens", json_integer((json_int_t)d->tokens));
    json_object_set_new(o, "ratio", json_real(d->ratio));
    json_object_set_new(o, "part", json_integer(d->part));
    json_object_set_new(o, "bytes", json_integer((json_int_t)d->bytes_stored));
    json_object_set_new(o, "bytes_kv_full", json_integer((json_int_t)d->bytes_kv_full));
    json_object_set_new(o, "bytes_kv_kept", json_integer((json_int_t)d->bytes_kv_kept));
    json_object_set_new(o, "created", json_integer(d->ingest_time));
    json_array_append_new(user, o);
    return 0;
}

static enum MHD_Result metrics_page(server *sv, struct MHD_Connection *c)
{
    buf b = {0};
    char line[256];
#define P(...) do { snprintf(line, sizeof line, __VA_ARGS__); buf_add(&b, line, strlen(line)); } while (0)
    pthread_mutex_lock(&sv->qmu);
    int qd = sv->qlen, busy = sv->busy;
    pthread_mutex_unlock(&sv->qmu);
    pthread_mutex_lock(&sv->mt.mu);
    metrics m = sv->mt;
    pthread_mutex_unlock(&sv->mt.mu);
    P("# HELP kvzip_requests_total HTTP responses by status code.\n# TYPE kvzip_requests_total counter\n");
    for (size_t i = 0; i <= NCODES; i++)
        if (i < NCODES) P("kvzip_requests_total{code=\"%d\"} %llu\n", CODES[i], (unsigned long long)m.requests[i]);
        else P("kvzip_requests_total{code=\"other\"} %llu\n", (unsigned long long)m.requests[i]);
    uint64_t errs = 0;
    for (size_t i = 1; i <= NCODES; i++) errs += m.requests[i];
    P("# TYPE kvzip_errors_total counter\nkvzip_errors_total %llu\n", (unsigned long long)errs);
    P("# TYPE kvzip_completions_total counter\nkvzip_completions_total %llu\n", (unsigned long long)m.completions);
    P("# TYPE kvzip_canceled_total counter\nkvzip_canceled_total %llu\n", (unsigned long long)m.canceled);
    P("# TYPE kvzip_timeouts_total counter\nkvzip_timeouts_total %llu\n", (unsigned long long)m.timeouts);
    P("# TYPE kvzip_prompt_tokens_total counter\nkvzip_prompt_tokens_total %llu\n", (unsigned long long)m.prompt_tokens);
    P("# TYPE kvzip_completion_tokens_total counter\nkvzip_completion_tokens_total %llu\n",
      (unsigned long long)m.completion_tokens);
    P("# HELP kvzip_doc_loads_total Stored caches read and decoded (cache misses and uncacheable requests).\n# TYPE kvzip_doc_loads_total counter\nkvzip_doc_loads_total %llu\n",
      (unsigned long long)m.doc_loads);
    P("# TYPE kvzip_doc_load_seconds_total counter\nkvzip_doc_load_seconds_total %.6f\n", m.doc_load_s);
    pthread_mutex_lock(&sv->cmu);
    P("# HELP kvzip_cache_hits_total Requests answered from a kept decoded session.\n"
      "# TYPE kvzip_cache_hits_total counter\nkvzip_cache_hits_total %llu\n", (unsigned long long)sv->cache_hits);
    P("# TYPE kvzip_cache_misses_total counter\nkvzip_cache_misses_total %llu\n", (unsigned long long)sv->cache_misses);
    P("# TYPE kvzip_cache_evictions_total counter\nkvzip_cache_evictions_total %llu\n",
      (unsigned long long)sv->cache_evictions);
    P("# TYPE kvzip_cache_bytes gauge\nkvzip_cache_bytes %llu\n", (unsigned long long)sv->cache_bytes);
    P("# TYPE kvzip_cache_entries gauge\nkvzip_cache_entries %d\n", sv->ncache);
    pthread_mutex_unlock(&sv->cmu);
    P("# TYPE kvzip_queue_depth gauge\nkvzip_queue_depth %d\n", qd);
    P("# TYPE kvzip_workers_busy gauge\nkvzip_workers_busy %d\n", busy);
    if (sv->batch) {
        P("# HELP kvzip_batch_running Answers decoding in the batch.\n# TYPE kvzip_batch_running gauge\n"
          "kvzip_batch_running %d\n", m.brunning);
        P("# HELP kvzip_batch_waiting Answers submitted to the batch, not admitted yet.\n"
          "# TYPE kvzip_batch_waiting gauge\nkvzip_batch_waiting %d\n", m.bwaiting);
        P("# TYPE kvzip_batch_steps_total counter\nkvzip_batch_steps_total %llu\n", (unsigned long long)m.bsteps);
        P("# HELP kvzip_batch_step_path_total Decode steps by how they ran: replayed from a kept CUDA graph, "
          "captured into a new one, launched eagerly, or one pass per answer (CPU, one answer).\n");
        P("# TYPE kvzip_batch_step_path_total counter\n");
        static const char *paths[4] = {"replay", "capture", "eager", "passes"};
        for (int k = 0; k < 4; k++)
            P("kvzip_batch_step_path_total{path=\"%s\"} %llu\n", paths[k], (unsigned long long)m.bpath[k]);
        P("# HELP kvzip_batch_logits_rows_total Answer-steps whose logits row came to the host (sampling); "
          "greedy answers get the argmax id alone.\n");
        P("# TYPE kvzip_batch_logits_rows_total counter\nkvzip_batch_logits_rows_total %llu\n",
          (unsigned long long)m.brows_logits);
    }
    const struct { const char *name; const histo *h; const double *b; size_t nb; } hs[] = {
        {"kvzip_ttft_seconds", &m.ttft, TTFT_B, NTTFT}, {"kvzip_token_latency_seconds", &m.tok, TOK_B, NTOK},
        {"kvzip_batch_size", &m.bsize, BSIZE_B, NBSIZE}, {"kvzip_batch_step_seconds", &m.bstep, STEP_B, NSTEP}};
    for (int k = 0; k < (sv->batch ? 4 : 2); k++) {
        P("# TYPE %s histogram\n", hs[k].name);
        for (size_t i = 0; i < hs[k].nb; i++)
            P("%s_bucket{le=\"%g\"} %llu\n", hs[k].name, hs[k].b[i], (unsigned long long)hs[k].h->count[i]);
        P("%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.6f\n%s_count %llu\n", hs[k].name, (unsigned long long)hs[k].h->n,
          hs[k].name, hs[k].h->sum, hs[k].name, (unsigned long long)hs[k].h->n);
    }
#undef P
    return send_text(sv, c, 200, "text/plain; version=0.0.4", b.p, NULL);
}

static int authorized(server *sv, struct MHD_Connection *c)
{
    if (!sv->o.api_key) return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncmp(h, "Bearer ", 7)) return 0;
    h += 7;
    /* constant time in the key's length */
    size_t n = strlen(sv->o.api_key), m = strlen(h);
    unsigned diff = n != m;
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)sv->o.api_key[i] ^ (unsigned char)(i < m ? h[i] : 0);
    return !diff;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    (void)version;
    server *sv = cls;
    req *rq = *con_cls;
    if (!rq) {
        if (!(rq = calloc(1, sizeof *rq))) return MHD_NO;
        *con_cls = rq;
        return MHD_YES;
    }
    if (*upload_size) {
        if (!rq->too_big && rq->body.n + *upload_size > sv->o.max_body) rq->too_big = 1;
        if (!rq->too_big && buf_add(&rq->body, upload, *upload_size)) rq->too_big = 1;
        *upload_size = 0;
        return MHD_YES;
    }
    const int get = !strcmp(method, "GET"), post = !strcmp(method, "POST");
    if (!strcmp(url, "/health")) {
        if (!get) return send_error(sv, c, 405, NULL, NULL, "use GET");
        json_t *o = json_object();
        json_object_set_new(o, "status", json_string("ok"));
        json_object_set_new(o, "model", json_string(sv->o.model_name));
        return send_json(sv, c, 200, o);
    }
    if (!strcmp(url, "/metrics")) {
        if (!get) return send_error(sv, c, 405, NULL, NULL, "use GET");
        return metrics_page(sv, c);
    }
    int known = !strcmp(url, "/v1/chat/completions") || !strcmp(url, "/v1/models") || !strcmp(url, "/v1/documents");
    if (!known) return send_error(sv, c, 404, "not_found", NULL, "no such endpoint");
    if (!authorized(sv, c))
        return send_error(sv, c, 401, "invalid_api_key", NULL, "missing or wrong API key (Authorization: Bearer KEY)");
    if (!strcmp(url, "/v1/chat/completions")) {
        if (!post) return send_error(sv, c, 405, NULL, NULL, "use POST");
        return chat(sv, c, rq);
    }
    if (!get) return send_error(sv, c, 405, NULL, NULL, "use GET");
    if (!strcmp(url, "/v1/models")) {
        json_t *mo = json_object();
        json_object_set_new(mo, "id", json_string(sv->o.model_name));
        json_object_set_new(mo, "object", json_string("model"));
        json_object_set_new(mo, "created", json_integer(0));
        json_object_set_new(mo, "owned_by", json_string("kvzip"));
        json_t *a = json_array();
        json_array_append_new(a, mo);
        json_t *o = json_object();
        json_object_set_new(o, "object", json_string("list"));
        json_object_set_new(o, "data", a);
        return send_json(sv, c, 200, o);
    }
    json_t *a = json_array();
    int rc = kvzip_store_list(sv->s, list_doc, a); /* one read txn: the current snapshot */
    if (rc) {
        json_decref(a);
        return send_error(sv, c, 500, NULL, NULL, "cannot list the store: %s", kvzip_strerror(rc));
    }
    json_t *o = json_object();
    json_object_set_new(o, "object", json_string("list"));
    json_object_set_new(o, "data", a);
    return send_json(sv, c, 200, o);
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode t)
{
    (void)cls;
    (void)c;
    (void)t;
    req *rq = *con_cls;
    if (rq) {
        free(rq->body.p);
        free(rq);
    }
    *con_cls = NULL;
}

/* ------------------------------------------------------------------------- */

void kvz_serve_defaults(kvz_serve_opts *o)
{
    memset(o, 0, sizeof *o);
    o->host = "127.0.0.1";
    o->port = 8080;
    o->workers = 2;
    o->max_queue = 64;
    o->max_batch = 1;
    o->max_body = (size_t)1 << 20;
    o->max_tokens_limit = 1024;
    o->default_max_tokens = 256;
    o->max_docs = 16;
    o->budget = 1024;
    o->timeout_s = 300;
    o->model_name = "kvzip";
    o->cache_mem = (uint64_t)256 << 20;
}

int kvz_serve_run(kvzip_model *m, kvzip_store *s, const kvz_serve_opts *o)
{
    server *sv = calloc(1, sizeof *sv);
    if (!sv) return KVZIP_ERR_NOMEM;
    sv->m = m;
    sv->s = s;
    sv->o = *o;
    kvzip_model_info_get(m, &sv->mi);
    pthread_mutex_init(&sv->qmu, NULL);
    pthread_cond_init(&sv->qcv, NULL);
    pthread_mutex_init(&sv->mt.mu, NULL);
    pthread_mutex_init(&sv->cmu, NULL);
    sv->q = calloc((size_t)o->max_queue, sizeof *sv->q);
    sv->workers = calloc((size_t)o->workers, sizeof *sv->workers);
    if (!sv->q || !sv->workers) {
        free(sv->q);
        free(sv->workers);
        free(sv);
        return KVZIP_ERR_NOMEM;
    }
    /* SIGINT/SIGTERM go to sigwait below; SIGPIPE (a client gone mid-write) is ignored */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    int rc = 0, sched = 0;
    if (o->max_batch > 1) {
        kvzip_batch_opts bo;
        kvzip_batch_defaults(&bo);
        bo.max_seqs = o->max_batch;
        if ((rc = kvzip_batch_open(m, &bo, &sv->batch)) == 0) {
            if (pthread_create(&sv->sched, NULL, sched_main, sv)) rc = KVZIP_ERR_NOMEM;
            else sched = 1;
        }
    }
    int nw = 0;
    for (; !rc && nw < o->workers; nw++)
        if (pthread_create(&sv->workers[nw], NULL, worker_main, sv)) break;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o->port)};
    struct MHD_Daemon *d = NULL;
    if (!rc && inet_pton(AF_INET, o->host, &addr.sin_addr) != 1) rc = KVZIP_ERR_ARG;
    if (!rc && nw < o->workers) rc = KVZIP_ERR_NOMEM;
    if (!rc) {
        /* connections: the queue, the running jobs, and some for health/metrics/refusals */
        unsigned limit = (unsigned)(o->max_queue + (sv->batch ? o->max_batch : o->workers) + 32);
        d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG,
                             0, NULL, NULL, handle, sv, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
                             MHD_OPTION_NOTIFY_COMPLETED, completed, sv, MHD_OPTION_CONNECTION_LIMIT, limit,
                             MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)30, MHD_OPTION_END);
        if (!d) rc = KVZIP_ERR_IO;
    }
    if (d) {
        const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
        if (sv->batch)
            fprintf(stderr, "kvzip-serve: listening on http://%s:%u (%d workers, batch %d, queue %d)\n", o->host,
                    di ? di->port : (unsigned)o->port, o->workers, o->max_batch, o->max_queue);
        else
            fprintf(stderr, "kvzip-serve: listening on http://%s:%u (%d workers, queue %d)\n", o->host,
                    di ? di->port : (unsigned)o->port, o->workers, o->max_queue);
        int sig = 0;
        sigwait(&set, &sig);
        fprintf(stderr, "kvzip-serve: signal %d: stopping\n", sig);
        MHD_stop_daemon(d); /* waits for the connection threads, which wait for their jobs */
    }
    pthread_mutex_lock(&sv->qmu);
    sv->stop = 1;
    pthread_cond_broadcast(&sv->qcv);
    pthread_mutex_unlock(&sv->qmu);
    for (int i = 0; i < nw; i++) pthread_join(sv->workers[i], NULL);
    /* the connection threads are gone, so every answer has ended; close ends any left */
    atomic_store(&sv->sched_stop, 1);
    if (sched) pthread_join(sv->sched, NULL);
    kvzip_batch_close(sv->batch);
    for (int i = 0; i < sv->ncache; i++) {
        kvzip_session_close(sv->cache[i].ss);
        free(sv->cache[i].key);
    }
    free(sv->cache);
    free(sv->q);
    free(sv->workers);
    free(sv);
    return rc;
}
