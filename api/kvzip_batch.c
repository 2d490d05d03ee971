/* libkvzip: continuous batching (include/kvzip.h, "Continuous batching"). Many
 * sessions' answers are decoded together: kvzip_batch_submit queues a question from
 * any thread, one scheduler thread calls kvzip_batch_step, which admits waiting
 * questions (prefill + first token) and then runs one kvz_forward_multi_top decode step
 * over every running answer. Sampling, stop tokens and max_tokens go through the
 * decode state kvz_generate uses (kvz_gen_seq), so an answer here equals kvzip_ask's;
 * a greedy answer takes the step's argmax id (kvz_argmax's rule, on the device on CUDA)
 * instead of its logits row. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvz_api.h"
#include "kvz_error.h"
#include "kvz_generate.h"

#define NEED(x) \
    do { if (!(x)) return kvz_error_set(KVZIP_ERR_ARG, "%s: %s is NULL", __func__, #x); } while (0)

/* One submitted answer. */
typedef struct bseq {
    kvzip_session *ss;
    kvz_tokens q;             /* the question in the chat layout */
    kvzip_token_fn cb;
    kvzip_done_fn done;
    void *user;
    kvz_gen_seq g;            /* sampler, counts, position of the next token */
    int32_t next;             /* the token fed at the next decode step */
    double t_submit, t_first, t_last;
    struct bseq *after;       /* the waiting FIFO */
} bseq;

struct kvzip_batch {
    kvzip_model *model;
    kvzip_batch_opts o;
    int32_t n_vocab;
    pthread_mutex_t mu;       /* guards the FIFO, the counts and info */
    pthread_cond_t cv;        /* signalled by submit */
    bseq *wait_head, *wait_tail;
    int32_t n_wait;           /* in the FIFO */
    int32_t n_live;           /* submitted and not ended: the max_seqs bound */
    bseq **run;               /* running answers (the stepping thread's own) */
    int32_t n_run;
    kvzip_batch_info info;
    uint64_t gen_tokens;      /* tokens generated (the stepping thread's count) */
    /* step buffers (the stepping thread's) */
    float *logits, *work;     /* (max_seqs, n_vocab); 2 * n_vocab */
    kvz_kv **kvs;
    int32_t *tok, *pos, *top; /* (max_seqs): fed tokens, positions, argmax ids back */
    uint8_t *want;            /* (max_seqs): 1 = the answer's sampler needs its logits row */
};

void kvzip_batch_defaults(kvzip_batch_opts *o)
{
    memset(o, 0, sizeof *o);
    o->max_seqs = 32;
    o->max_admit = 4;
    o->max_admit_tokens = 1024;
}

/* The batch's arrays and itself (NULL-safe; the locks and the model ref are the caller's). */
static void batch_free(kvzip_batch *b)
{
    if (!b) return;
    free(b->logits);
    free(b->work);
    free(b->kvs);
    free(b->tok);
    free(b->pos);
    free(b->top);
    free(b->want);
    free(b->run);
    free(b);
}

int kvzip_batch_open(kvzip_model *m, const kvzip_batch_opts *opts, kvzip_batch **out)
{
    NEED(out);
    *out = NULL;
    NEED(m);
    kvzip_batch_opts o;
    if (opts) o = *opts;
    else kvzip_batch_defaults(&o);
    if (o.max_seqs < 1 || o.max_seqs > 4096 || o.max_admit < 1 || o.max_admit_tokens < 1)
        return kvz_error_set(KVZIP_ERR_ARG, "batch options out of range (max_seqs %d: 1..4096, max_admit %d, "
                             "max_admit_tokens %d: >= 1)", o.max_seqs, o.max_admit, o.max_admit_tokens);
    int rc = kvz_api_model_ref(m);
    if (rc) return rc;
    kvzip_batch *b = calloc(1, sizeof *b);
    const int32_t V = kvz_model_config(m->m)->n_vocab;
    if (b) {
        b->logits = malloc(sizeof(float) * (size_t)V * (size_t)o.max_seqs);
        b->work = malloc(sizeof(float) * (size_t)V * 2);
        b->kvs = calloc((size_t)o.max_seqs, sizeof *b->kvs);
        b->tok = calloc((size_t)o.max_seqs, sizeof *b->tok);
        b->pos = calloc((size_t)o.max_seqs, sizeof *b->pos);
        b->top = calloc((size_t)o.max_seqs, sizeof *b->top);
        b->want = calloc((size_t)o.max_seqs, sizeof *b->want);
        b->run = calloc((size_t)o.max_seqs, sizeof *b->run);
    }
    if (!b || !b->logits || !b->work || !b->kvs || !b->tok || !b->pos || !b->top || !b->want || !b->run) {
        batch_free(b);
        kvz_api_model_unref(m);
        return kvz_error_set(KVZIP_ERR_NOMEM, "batch of %d answers: %zu MiB of logits", o.max_seqs,
                             sizeof(float) * (size_t)V * (size_t)o.max_seqs >> 20);
    }
    b->model = m;
    b->o = o;
    b->n_vocab = V;
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    *out = b;
    return 0;
}

int kvzip_batch_submit(kvzip_batch *b, kvzip_session *ss, const char *question, kvzip_token_fn cb,
                       kvzip_done_fn done, void *user)
{
    NEED(b);
    NEED(ss);
    NEED(question);
    NEED(done);
    if (ss->model != b->model) return kvz_error_set(KVZIP_ERR_ARG, "the session belongs to another model");
    bseq *s = calloc(1, sizeof *s);
    if (!s) return KVZIP_ERR_NOMEM;
    int rc = kvz_api_question(ss, question, &s->q);
    if (rc) {
        free(s);
        return rc;
    }
    int zero = 0;
    if (!atomic_compare_exchange_strong(&ss->in_batch, &zero, 1)) {
        kvz_tokens_free(&s->q);
        free(s);
        return kvz_error_set(KVZIP_ERR_BUSY, "the session is already answering in a batch");
    }
    s->ss = ss;
    s->cb = cb;
    s->done = done;
    s->user = user;
    s->t_submit = kvz_now();
    kvz_gen_opts go = {.max_tokens = ss->o.max_tokens, .stop_on_eos = 1};
    kvz_sampler_init(&go.sampler, ss->o.temperature, ss->o.top_p, ss->o.seed);
    kvz_gen_seq_init(&s->g, &go, kvz_model_tokenizer(b->model->m), ss->info.doc_tokens + (int32_t)s->q.n);
    pthread_mutex_lock(&b->mu);
    if (b->n_live >= b->o.max_seqs) {
        const int32_t n = b->n_live;
        pthread_mutex_unlock(&b->mu);
        atomic_store(&ss->in_batch, 0);
        kvz_tokens_free(&s->q);
        free(s);
        return kvz_error_set(KVZIP_ERR_BUSY, "the batch holds %d answers (max_seqs %d)", n, b->o.max_seqs);
    }
    if (b->wait_tail) b->wait_tail->after = s;
    else b->wait_head = s;
    b->wait_tail = s;
    b->n_wait++;
    b->n_live++;
    b->info.waiting = b->n_wait;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return 0;
}

/* End answer @p s with @p rc: roll its session back to the document (as kvzip_ask
 * does), report its figures, free it. */
static void retire(kvzip_batch *b, bseq *s, int rc)
{
    kvzip_session *ss = s->ss;
    kvz_kv_stats ks;
    kvz_api_dev_lock(b->model);
    kvz_kv_get_stats(ss->kv, &ks);
    kvz_kv_rollback(ss->kv);
    kvz_api_dev_unlock(b->model);
    kvzip_answer_stats st = {0};
    st.prompt_tokens = (int32_t)s->q.n;
    st.answer_tokens = s->g.n_gen;
    st.stopped = s->g.stopped;
    st.ttft_s = s->t_first > 0 ? s->t_first - s->t_submit : 0.0;
    st.decode_s = s->t_first > 0 ? s->t_last - s->t_first : 0.0;
    st.decode_tok_s = st.decode_s > 0 && s->g.n_gen > 1 ? (s->g.n_gen - 1) / st.decode_s : 0.0;
    st.kv_bytes_held = ks.bytes_held;
    st.kv_doc_rows = ks.doc_rows;
    st.out_used = ks.out_used;
    st.out_slots = ks.out_slots;
    st.evictions = ks.evictions;
    kvz_tokens_free(&s->q);
    pthread_mutex_lock(&b->mu);
    b->n_live--;
    pthread_mutex_unlock(&b->mu);
    if (rc == KVZIP_ERR_CANCELED) kvz_error_set(rc, "the token callback stopped the answer");
    else if (rc == KVZIP_ERR_CLOSED) kvz_error_set(rc, "the batch was closed before the answer ended");
    kvzip_done_fn done = s->done;
    void *user = s->user;
    free(s);
    atomic_store(&ss->in_batch, 0); /* the session is the caller's again */
    done(user, rc, &st);
}

/* Sample answer @p s's next token from @p logits (NULL: a greedy answer whose argmax
 * @p top the step computed; kvz_gen_seq_take applies kvz_gen_seq_sample's rules to it)
 * and pass it on. 1: running on (s->next is fed at the next step); 0: ended and retired. */
static int advance(kvzip_batch *b, bseq *s, const float *logits, int32_t top)
{
    int32_t id = top;
    if (logits ? !kvz_gen_seq_sample(&s->g, logits, b->n_vocab, b->work, &id) : !kvz_gen_seq_take(&s->g, top)) {
        retire(b, s, 0);
        return 0;
    }
    b->gen_tokens++;
    const double t = kvz_now();
    if (s->t_first == 0) s->t_first = t;
    s->t_last = t;
    int rc = 0;
    if (s->cb) {
        char piece[256];
        const int n = kvz_api_piece(kvz_model_tokenizer(b->model->m), id, piece);
        if (n < 0) rc = n;
        else if (s->cb(s->user, piece, (size_t)n, id)) rc = KVZIP_ERR_CANCELED;
    }
    if (rc || !kvz_gen_seq_more(&s->g)) {
        retire(b, s, rc);
        return 0;
    }
    s->next = id;
    return 1;
}

/* Take the next waiting answers within the admission bounds (FIFO order). */
static int32_t take_waiting(kvzip_batch *b, int32_t max_admit, bseq **out)
{
    int32_t k = 0;
    int64_t toks = 0;
    pthread_mutex_lock(&b->mu);
    while (b->wait_head && k < max_admit && b->n_run + k < b->o.max_seqs) {
        bseq *s = b->wait_head;
        if (k > 0 && toks + (int64_t)s->q.n > b->o.max_admit_tokens) break;
        toks += (int64_t)s->q.n;
        b->wait_head = s->after;
        if (!b->wait_head) b->wait_tail = NULL;
        b->n_wait--;
        s->after = NULL;
        out[k++] = s;
    }
    b->info.waiting = b->n_wait;
    pthread_mutex_unlock(&b->mu);
    return k;
}

int kvzip_batch_step(kvzip_batch *b)
{
    NEED(b);
    kvzip_model *m = b->model;
    /* (1) admissions: question prefill, first token */
    bseq *adm[64];
    const int32_t na = take_waiting(b, b->o.max_admit < 64 ? b->o.max_admit : 64, adm);
    const double ta = kvz_now();
    for (int32_t i = 0; i < na; i++) {
        bseq *s = adm[i];
        float *lg = b->logits; /* free until the decode step below */
        kvz_api_dev_lock(m);
        int rc = kvz_forward(m->m, s->ss->kv, s->q.ids, (int32_t)s->q.n, s->ss->info.doc_tokens, lg,
                             KVZ_FWD_LOGITS_LAST, NULL);
        kvz_api_dev_unlock(m);
        if (rc) retire(b, s, rc);
        else if (advance(b, s, lg, 0)) b->run[b->n_run++] = s;
    }
    const double admit_s = kvz_now() - ta;
    /* (2) one decode step over every running answer */
    const int32_t n = b->n_run;
    int rc = 0;
    double step_s = 0;
    char detail[512] = "";
    /* b->work (the sampler's) is free during the step: the per-cache route's scratch row */
    kvz_step_io io = {.want_logits = b->want, .top = b->top, .path = KVZ_STEP_PASSES, .scratch = b->work};
    if (n > 0) {
        for (int32_t i = 0; i < n; i++) {
            b->kvs[i] = b->run[i]->ss->kv;
            b->tok[i] = b->run[i]->next;
            b->pos[i] = b->run[i]->g.pos;
            /* a greedy answer's next token is the argmax (computed with the step, on the
             * device on CUDA): its logits row is not copied back */
            b->want[i] = !kvz_gen_seq_greedy(&b->run[i]->g);
        }
        kvz_api_dev_lock(m);
        const double t0 = kvz_now(); /* the step alone: not the wait for the device lock */
        rc = kvz_forward_multi_top(m->m, b->kvs, b->tok, b->pos, n, b->logits, &io);
        step_s = kvz_now() - t0;
        kvz_api_dev_unlock(m);
        if (rc) snprintf(detail, sizeof detail, "%s", kvz_error_detail());
        int32_t kept = 0;
        for (int32_t i = 0; i < n; i++) {
            bseq *s = b->run[i];
            if (rc) { /* each done callback, and then the caller, sees the step's detail */
                kvz_error_set(rc, "%s", detail);
                retire(b, s, rc);
                continue;
            }
            s->g.pos++;
            if (advance(b, s, b->want[i] ? b->logits + (size_t)i * (size_t)b->n_vocab : NULL, b->top[i]))
                b->run[kept++] = s;
        }
        b->n_run = rc ? 0 : kept;
    }
    pthread_mutex_lock(&b->mu);
    b->info.running = b->n_run;
    b->info.last_admitted = na;
    b->info.last_admit_s = admit_s;
    b->info.last_step_size = n;
    b->info.last_step_s = step_s;
    if (n > 0) {
        b->info.steps++;
        if (!rc) {
            b->info.steps_replayed += io.path == KVZ_STEP_REPLAY;
            b->info.steps_captured += io.path == KVZ_STEP_CAPTURE;
            b->info.steps_eager += io.path == KVZ_STEP_EAGER;
            b->info.steps_passes += io.path == KVZ_STEP_PASSES;
            for (int32_t i = 0; i < n; i++) b->info.rows_logits += b->want[i];
        }
    }
    b->info.tokens = b->gen_tokens;
    const int32_t live = b->n_live;
    pthread_mutex_unlock(&b->mu);
    if (rc) kvz_error_set(rc, "%s", detail);
    return rc ? rc : live;
}

int kvzip_batch_wait(kvzip_batch *b, double timeout_s)
{
    NEED(b);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (timeout_s > 0) {
        const double end = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec + timeout_s;
        ts.tv_sec = (time_t)end;
        ts.tv_nsec = (long)((end - (double)ts.tv_sec) * 1e9);
        if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
    }
    pthread_mutex_lock(&b->mu);
    while (b->n_live == 0 && timeout_s > 0)
        if (pthread_cond_timedwait(&b->cv, &b->mu, &ts)) break;
    const int32_t live = b->n_live;
    pthread_mutex_unlock(&b->mu);
    return live;
}

int kvzip_batch_info_get(kvzip_batch *b, kvzip_batch_info *out)
{
    NEED(b);
    NEED(out);
    pthread_mutex_lock(&b->mu);
    *out = b->info;
    pthread_mutex_unlock(&b->mu);
    return 0;
}

int kvzip_batch_close(kvzip_batch *b)
{
    if (!b) return 0;
    for (int32_t i = 0; i < b->n_run; i++) retire(b, b->run[i], KVZIP_ERR_CLOSED);
    b->n_run = 0;
    for (;;) {
        pthread_mutex_lock(&b->mu);
        bseq *s = b->wait_head;
        if (s) {
            b->wait_head = s->after;
            if (!b->wait_head) b->wait_tail = NULL;
            b->n_wait--;
        }
        pthread_mutex_unlock(&b->mu);
        if (!s) break;
        retire(b, s, KVZIP_ERR_CLOSED);
    }
    kvz_api_model_unref(b->model);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    batch_free(b);
    return 0;
}
