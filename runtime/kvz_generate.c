#include "kvz_generate.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvz_error.h"

double kvz_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int encode_special(const kvz_tokenizer *tok, const char *s, kvz_tokens *out)
{
    return kvz_tokenizer_encode(tok, s, strlen(s), KVZ_TOK_SPECIAL, out);
}

/* The literal system text a ChatML template inserts when the conversation has none:
 * what follows "<|im_start|>system" and a newline (written raw or as the Jinja escape
 * \n) up to "<|im_end|>", if it is plain text (no Jinja inside). 1 if found. */
static int chatml_default_system(const char *t, char *out, size_t cap)
{
    static const char open[] = "<|im_start|>system";
    for (const char *p = strstr(t, open); p; p = strstr(p + 1, open)) {
        const char *q = p + sizeof open - 1;
        if (*q == '\n') q++;
        else if (q[0] == '\\' && q[1] == 'n') q += 2;
        else continue;
        const char *e = strstr(q, "<|im_end|>");
        if (!e || (size_t)(e - q) >= cap || e == q) continue;
        if (memchr(q, '{', (size_t)(e - q)) || memchr(q, '\'', (size_t)(e - q)) ||
            memchr(q, '"', (size_t)(e - q)) || memchr(q, '\\', (size_t)(e - q)))
            continue;
        memcpy(out, q, (size_t)(e - q));
        out[e - q] = 0;
        return 1;
    }
    return 0;
}

void kvz_chat_template(const kvz_tokenizer *tok, kvz_chat_tmpl *out)
{
    kvz_chat_template_parse(tok ? kvz_tokenizer_chat_template(tok) : NULL, out);
}

void kvz_chat_template_parse(const char *t, kvz_chat_tmpl *out)
{
    memset(out, 0, sizeof *out);
    if (t && strstr(t, "<|start_header_id|>")) {
        out->family = KVZ_CHAT_LLAMA3;
        snprintf(out->name, sizeof out->name, "llama3");
        return; /* Llama-3's template has no default system text */
    }
    out->family = KVZ_CHAT_CHATML;
    if (t && strstr(t, "<|im_start|>")) {
        if (chatml_default_system(t, out->system, sizeof out->system)) {
            snprintf(out->name, sizeof out->name, "%s", strstr(out->system, "SmolLM") ? "smollm" :
                     strstr(out->system, "Qwen") ? "qwen2.5" : "chatml");
            return;
        }
        snprintf(out->name, sizeof out->name, "chatml"); /* no default system turn */
        return;
    }
    snprintf(out->name, sizeof out->name, "chatml");
    snprintf(out->system, sizeof out->system, "%s", KVZ_SYSTEM_TEXT);
}

int kvz_chat_prefix(const kvz_tokenizer *tok, kvz_tokens *out)
{
    return kvz_chat_prefix_sys(tok, NULL, out);
}

int kvz_chat_prefix_sys(const kvz_tokenizer *tok, const char *system, kvz_tokens *out)
{
    kvz_chat_tmpl ct;
    kvz_chat_template(tok, &ct);
    if (system && strlen(system) >= KVZ_CHAT_SYSTEM_MAX)
        return kvz_error_set(KVZ_ERR_ARG, "system text longer than %d bytes", KVZ_CHAT_SYSTEM_MAX - 1);
    if (!system) system = ct.system;
    const int llama3 = ct.family == KVZ_CHAT_LLAMA3;
    int rc = 0;
    if (llama3) rc = encode_special(tok, "<|begin_of_text|>", out);
    if (!rc && system[0]) {
        rc = encode_special(tok, llama3 ? "<|start_header_id|>system<|end_header_id|>\n\n" :
                            "<|im_start|>system\n", out);
        if (!rc) rc = kvz_tokenizer_encode(tok, system, strlen(system), 0, out);
        if (!rc) rc = encode_special(tok, llama3 ? "<|eot_id|>" : "<|im_end|>\n", out);
    }
    if (!rc)
        rc = encode_special(tok, llama3 ? "<|start_header_id|>user<|end_header_id|>\n\n" KVZ_INSTRUCTION "\n\n" :
                            "<|im_start|>user\n" KVZ_INSTRUCTION "\n\n", out);
    return rc;
}

int kvz_chat_postfix(const kvz_tokenizer *tok, kvz_tokens *out)
{
    kvz_chat_tmpl ct;
    kvz_chat_template(tok, &ct);
    return encode_special(tok, ct.family == KVZ_CHAT_LLAMA3 ?
                          "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n" :
                          "<|im_end|>\n<|im_start|>assistant\n", out);
}

int kvz_chat_question(const kvz_tokenizer *tok, const char *question, kvz_tokens *out)
{
    int rc = encode_special(tok, "\n\nQuestion: ", out);
    /* the user's text is data: special-token strings in it are not parsed */
    if (!rc) rc = kvz_tokenizer_encode(tok, question, strlen(question), 0, out);
    if (!rc) rc = kvz_chat_postfix(tok, out);
    return rc;
}

int kvz_chat_is_stop(const kvz_tokenizer *tok, int32_t id)
{
    static const char *stops[] = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"};
    if (id == kvz_tokenizer_eos(tok)) return 1;
    for (size_t i = 0; i < sizeof stops / sizeof stops[0]; i++)
        if (id == kvz_tokenizer_find(tok, stops[i])) return 1;
    return 0;
}

void kvz_sampler_init(kvz_sampler *s, float temperature, float top_p, uint64_t seed)
{
    s->temperature = temperature;
    s->top_p = top_p > 0.0f && top_p <= 1.0f ? top_p : 1.0f;
    s->state = seed ? seed : 0x853c49e6748fea9bULL;
}

static uint64_t rng_next(uint64_t *st)
{
    uint64_t z = (*st += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static int cmp_desc(const void *a, const void *b)
{
    const float *x = a, *y = b; /* pairs (prob, id) */
    if (x[0] != y[0]) return x[0] < y[0] ? 1 : -1;
    return x[1] < y[1] ? -1 : x[1] > y[1];
}

int32_t kvz_sample(kvz_sampler *s, const float *logits, int32_t n, float *work)
{
    const int32_t best = kvz_argmax(logits, n);
    if (s->temperature <= 0.0f || !work) return best;
    const float mx = logits[best];
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        float p = expf((logits[i] - mx) / s->temperature);
        work[2 * i] = p;
        work[2 * i + 1] = (float)i;
        sum += p;
    }
    const double u = (double)(rng_next(&s->state) >> 11) * (1.0 / 9007199254740992.0);
    if (s->top_p >= 1.0f) {
        double acc = 0.0, target = u * sum;
        for (int32_t i = 0; i < n; i++) {
            acc += work[2 * i];
            if (acc >= target) return i;
        }
        return n - 1;
    }
    qsort(work, (size_t)n, 2 * sizeof(float), cmp_desc);
    double acc = 0.0;
    int32_t k = 0;
    while (k < n && acc < s->top_p * sum) acc += work[2 * k++];
    double target = u * acc, run = 0.0;
    for (int32_t i = 0; i < k; i++) {
        run += work[2 * i];
        if (run >= target) return (int32_t)work[2 * i + 1];
    }
    return (int32_t)work[2 * (k - 1) + 1];
}

void kvz_gen_seq_init(kvz_gen_seq *s, const kvz_gen_opts *opts, const kvz_tokenizer *tok, int32_t pos)
{
    memset(s, 0, sizeof *s);
    s->sampler = opts->sampler;
    s->tok = opts->stop_on_eos ? tok : NULL;
    s->max_tokens = opts->max_tokens;
    s->pos = pos;
}

int kvz_gen_seq_sample(kvz_gen_seq *s, const float *logits, int32_t n_vocab, float *work, int32_t *id)
{
    if (s->stopped || s->n_gen >= s->max_tokens) return 0;
    *id = kvz_sample(&s->sampler, logits, n_vocab, work);
    return kvz_gen_seq_take(s, *id);
}

int kvz_gen_seq_greedy(const kvz_gen_seq *s)
{
    return s->sampler.temperature <= 0.0f;
}

int kvz_gen_seq_take(kvz_gen_seq *s, int32_t id)
{
    if (s->stopped || s->n_gen >= s->max_tokens) return 0;
    if (s->tok && kvz_chat_is_stop(s->tok, id)) {
        s->stopped = 1;
        return 0;
    }
    s->n_gen++;
    return 1;
}

int kvz_gen_seq_more(const kvz_gen_seq *s)
{
    return !s->stopped && s->n_gen < s->max_tokens;
}

int kvz_generate(kvz_model *m, kvz_kv *kv, const int32_t *prompt, int32_t n_prompt,
                 int32_t pos0, const kvz_gen_opts *opts, kvz_tokens *out, float *logits_out,
                 kvz_gen_stats *stats)
{
    const kvz_config *c = kvz_model_config(m);
    kvz_gen_stats st = {.n_prompt = n_prompt};
    float *logits = malloc(sizeof(float) * (size_t)c->n_vocab * 3);
    if (!logits) return KVZ_ERR_NOMEM;
    float *work = logits + c->n_vocab;
    kvz_gen_seq sq;
    kvz_gen_seq_init(&sq, opts, kvz_model_tokenizer(m), pos0 + n_prompt);
    double t0 = kvz_now();
    int rc = kvz_forward(m, kv, prompt, n_prompt, pos0, logits, KVZ_FWD_LOGITS_LAST, NULL);
    st.prefill_s = kvz_now() - t0;
    double t1 = kvz_now();
    int32_t id;
    while (!rc) {
        if (logits_out && sq.n_gen < sq.max_tokens)
            memcpy(logits_out + (size_t)sq.n_gen * c->n_vocab, logits, sizeof(float) * c->n_vocab);
        if (!kvz_gen_seq_sample(&sq, logits, c->n_vocab, work, &id)) break;
        if (out && (rc = kvz_tokens_push(out, id))) break;
        if (opts->on_token && (rc = opts->on_token(opts->ctx, id))) break;
        if (!kvz_gen_seq_more(&sq)) break;
        rc = kvz_forward(m, kv, &id, 1, sq.pos++, logits, KVZ_FWD_LOGITS_LAST, NULL);
    }
    st.decode_s = kvz_now() - t1;
    st.n_gen = sq.n_gen;
    st.stopped = sq.stopped;
    free(logits);
    if (stats) *stats = st;
    return rc;
}
