/* LongFlow output cache bench (DESIGN §5, issue 4), CPU backend, real model.
 *
 *  (a) speed: decode step time vs output position at B = 256 (LongFlow) beside an
 *      unbounded run (out_slots 0) in the same process. Both runs step in lockstep
 *      on the same token stream (the bounded run is teacher-forced on the unbounded
 *      run's sampled tokens), so machine noise hits both alike.
 *  (b) quality: for each document, one unbounded run samples N tokens (stop tokens
 *      suppressed, so every run is N long); bounded runs at each B and policy are
 *      teacher-forced on those tokens, all in lockstep. Per step we compare the
 *      bounded logits with the unbounded logits at the same step:
 *        top1  = argmax(bounded) == argmax(unbounded)       (1.0 when B = inf)
 *        tok   = argmax(bounded) == the sampled unbounded token
 *                (the unbounded run's own rate is the ceiling, printed as B = inf)
 *        KL    = mean KL(p_unbounded || p_bounded) in nats
 *
 * Usage: longflow_bench [--model PATH] [--threads N] [--part speed|quality|all]
 *          [--speed-model SYNTHETIC (e.g. tiny-llama; default: the GGUF)] [--speed-tokens 4000] [--quality-tokens 1000] [--doc-tokens 1000]
 *          [--docs aquila_aq300_manual,larkspur_payments_api] [--temperature 0.7]
 *          [--seed 1] [--budgets 128,256,512]
 * Documents are samples/<name>.md (run from the source root), full caches of the
 * system prefix + the first --doc-tokens tokens.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_model.h"

#define QUESTION "Rewrite the document above in your own words, section by section, with every detail."
#define MAX_CFG 16

typedef struct run {
    kvz_kv *kv;
    int32_t B, policy;     /* B = 0: unbounded */
    float *logits;         /* (n_vocab) of the last step */
    int64_t top1, tok;     /* agreements */
    double kl;             /* summed */
    double step_s;         /* summed step time in the current window */
} run;

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* log-softmax in place (double accumulation) */
static void log_softmax(float *x, int n)
{
    const float mx = x[argmax(x, n)];
    double s = 0.0;
    for (int i = 0; i < n; i++) s += exp((double)(x[i] - mx));
    const float lse = mx + (float)log(s);
    for (int i = 0; i < n; i++) x[i] -= lse;
}

static double kl_div(const float *lp, const float *lq, int n)
{
    double k = 0.0;
    for (int i = 0; i < n; i++)
        if (lp[i] > -60.0f) k += exp((double)lp[i]) * (double)(lp[i] - lq[i]);
    return k;
}

static const char *opt(int argc, char **argv, int *i)
{
    if (*i + 1 >= argc) { fprintf(stderr, "longflow_bench: %s needs a value\n", argv[*i]); exit(2); }
    return argv[++*i];
}

/* prefix + first n_doc tokens of samples/<name>.md */
static int doc_prompt(const kvz_tokenizer *tok, const char *name, int32_t n_doc, kvz_tokens *out)
{
    char path[512];
    snprintf(path, sizeof path, "samples/%s.md", name);
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "longflow_bench: cannot open %s (run from the source root)\n", path); return -1; }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    if (!text || fread(text, 1, (size_t)len, f) != (size_t)len) { fclose(f); free(text); return -1; }
    fclose(f);
    kvz_tokens body = {0};
    int rc = kvz_chat_prefix(tok, out);
    if (!rc) rc = kvz_tokenizer_encode(tok, text, (size_t)len, 0, &body);
    for (size_t i = 0; !rc && i < body.n && (int32_t)i < n_doc; i++) rc = kvz_tokens_push(out, body.ids[i]);
    kvz_tokens_free(&body);
    free(text);
    return rc;
}

static int new_run(kvz_model *m, const kvz_tokens *doc, int64_t extra, int32_t B, int32_t policy, run *r)
{
    memset(r, 0, sizeof *r);
    r->B = B;
    r->policy = policy;
    r->logits = malloc(sizeof(float) * (size_t)kvz_model_config(m)->n_vocab);
    int rc = r->logits ? kvz_kv_create(m, (int64_t)doc->n + (B ? 0 : extra), B, &r->kv) : KVZ_ERR_NOMEM;
    if (rc) return rc;
    kvz_kv_set_out_policy(r->kv, policy);
    return kvz_forward(m, r->kv, doc->ids, (int32_t)doc->n, 0, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_TO_DOC, NULL);
}

static void free_run(run *r)
{
    kvz_kv_free(r->kv);
    free(r->logits);
}

/* Stop-token ids, found once (kvz_chat_is_stop looks names up: too slow per step). */
static int32_t g_stops[8];
static int g_nstops = -1;

static void suppress_stops(const kvz_tokenizer *tok, float *lg, int n)
{
    if (g_nstops < 0)
        for (int i = g_nstops = 0; i < n && g_nstops < 8; i++)
            if (kvz_chat_is_stop(tok, i)) g_stops[g_nstops++] = i;
    for (int i = 0; i < g_nstops; i++) lg[g_stops[i]] = -INFINITY;
}

/* ------------------------------------------------------------------------ */
/* (a) step time vs output position                                          */

static int bench_speed(kvz_model *m, const kvz_tokens *doc, const kvz_tokens *q, int32_t n_tok,
                       float temperature, uint64_t seed)
{
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    const int nv = c->n_vocab;
    run r[2];
    int rc = new_run(m, doc, (int64_t)q->n + n_tok, 0, KVZ_OUT_LONGFLOW, &r[0]);
    if (!rc) rc = new_run(m, doc, 0, 256, KVZ_OUT_LONGFLOW, &r[1]);
    if (rc) return rc;
    float *work = malloc(sizeof(float) * 2 * (size_t)nv);
    kvz_sampler smp;
    kvz_sampler_init(&smp, temperature, 1.0f, seed);
    for (int k = 0; k < 2 && !rc; k++)
        rc = kvz_forward(m, r[k].kv, q->ids, (int32_t)q->n, (int32_t)doc->n, r[k].logits, KVZ_FWD_LOGITS_LAST, NULL);
    printf("\n(a) decode step time vs output position: %zu document tokens, %zu question tokens\n",
           doc->n, q->n);
    printf("%-13s %12s %12s %8s %14s %14s\n", "tokens", "unbounded ms", "B=256 ms", "ratio",
           "KV unb. MB", "KV B=256 MB");
    const int32_t win = 250;
    int32_t pos = (int32_t)(doc->n + q->n), w0 = 0;
    int64_t agree = 0;
    for (int32_t s = 0; s < n_tok && !rc; s++) {
        agree += argmax(r[0].logits, nv) == argmax(r[1].logits, nv);
        suppress_stops(tok, r[0].logits, nv);
        int32_t id = kvz_sample(&smp, r[0].logits, nv, work);
        for (int k = 0; k < 2 && !rc; k++) {
            const double t0 = kvz_now();
            rc = kvz_forward(m, r[k].kv, &id, 1, pos, r[k].logits, KVZ_FWD_LOGITS_LAST, NULL);
            r[k].step_s += kvz_now() - t0;
        }
        pos++;
        if ((s + 1) % win == 0 || s + 1 == n_tok) {
            kvz_kv_stats st[2];
            kvz_kv_get_stats(r[0].kv, &st[0]);
            kvz_kv_get_stats(r[1].kv, &st[1]);
            char lab[32];
            snprintf(lab, sizeof lab, "%d-%d", w0, s + 1);
            const int32_t n = s + 1 - w0;
            printf("%-13s %12.2f %12.2f %8.3f %14.2f %14.2f\n", lab, 1e3 * r[0].step_s / n,
                   1e3 * r[1].step_s / n, r[1].step_s / r[0].step_s, st[0].bytes_held / 1e6,
                   st[1].bytes_held / 1e6);
            fflush(stdout);
            r[0].step_s = r[1].step_s = 0.0;
            w0 = s + 1;
        }
    }
    kvz_kv_stats st;
    kvz_kv_get_stats(r[1].kv, &st);
    printf("B=256: %lld evictions; teacher-forced top-1 agreement with unbounded over %d tokens: %.1f%%\n",
           (long long)st.evictions, n_tok, 100.0 * (double)agree / n_tok);
    free(work);
    free_run(&r[0]);
    free_run(&r[1]);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* (b) teacher-forced agreement                                              */

static int bench_quality(kvz_model *m, const char *name, const kvz_tokens *doc, const kvz_tokens *q,
                         int32_t n_tok, const int32_t *budgets, int nb, float temperature,
                         uint64_t seed, FILE *table)
{
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    const int nv = c->n_vocab;
    run r[MAX_CFG];
    int nr = 0, rc = new_run(m, doc, (int64_t)q->n + n_tok, 0, KVZ_OUT_LONGFLOW, &r[nr++]);
    for (int b = 0; b < nb && !rc; b++)
        for (int p = KVZ_OUT_LONGFLOW; p <= KVZ_OUT_WINDOW && !rc; p++)
            rc = new_run(m, doc, 0, budgets[b], p, &r[nr++]);
    if (rc) return rc;
    float *work = malloc(sizeof(float) * 2 * (size_t)nv);
    kvz_sampler smp;
    kvz_sampler_init(&smp, temperature, 1.0f, seed);
    for (int k = 0; k < nr && !rc; k++)
        rc = kvz_forward(m, r[k].kv, q->ids, (int32_t)q->n, (int32_t)doc->n, r[k].logits, KVZ_FWD_LOGITS_LAST, NULL);
    int32_t pos = (int32_t)(doc->n + q->n);
    int64_t self_tok = 0;
    const double t_start = kvz_now();
    kvz_tokens out = {0};
    for (int32_t s = 0; s < n_tok && !rc; s++) {
        suppress_stops(tok, r[0].logits, nv);
        const int32_t top = argmax(r[0].logits, nv);
        const int32_t id = kvz_sample(&smp, r[0].logits, nv, work);
        kvz_tokens_push(&out, id);
        self_tok += top == id;
        log_softmax(r[0].logits, nv);
        for (int k = 1; k < nr; k++) {
            suppress_stops(tok, r[k].logits, nv);
            const int32_t a = argmax(r[k].logits, nv);
            r[k].top1 += a == top;
            r[k].tok += a == id;
            log_softmax(r[k].logits, nv);
            r[k].kl += kl_div(r[0].logits, r[k].logits, nv);
        }
        if ((s + 1) % 100 == 0) {
            fprintf(stderr, "\r%s: %d/%d tokens, %.0f s", name, s + 1, n_tok, kvz_now() - t_start);
            if (s + 1 == n_tok) fputc('\n', stderr);
        }
        if (s + 1 == n_tok) break;
        for (int k = 0; k < nr && !rc; k++)
            rc = kvz_forward(m, r[k].kv, &id, 1, pos, r[k].logits, KVZ_FWD_LOGITS_LAST, NULL);
        pos++;
    }
    if (!rc) {
        int distinct = 0;
        for (size_t i = 0; i < out.n; i++) {
            int seen = 0;
            for (size_t j = 0; j < i && !seen; j++) seen = out.ids[j] == out.ids[i];
            distinct += !seen;
        }
        char head[121];
        int hl = 0;
        for (size_t i = 0; i < out.n && hl < 100; i++) {
            int w = kvz_tokenizer_decode(tok, out.ids[i], head + hl, sizeof head - 1 - (size_t)hl);
            if (w < 0) break;
            hl += w;
        }
        head[hl] = 0;
        for (int i = 0; i < hl; i++)
            if (head[i] == '\n') head[i] = ' ';
        printf("\n%s: %zu document + %zu question tokens, %d sampled tokens (%d distinct), %.0f s\n"
               "  starts: \"%s...\"\n", name, doc->n, q->n, n_tok, distinct, kvz_now() - t_start, head);
        printf("  B=inf (unbounded): argmax = sampled token %.1f%%\n", 100.0 * self_tok / n_tok);
        for (int k = 1; k < nr; k++)
            printf("  B=%-4d %-11s top1 %5.1f%%  tok %5.1f%%  KL %.4f\n", r[k].B,
                   r[k].policy == KVZ_OUT_LONGFLOW ? "LongFlow" : "sink+window", 100.0 * r[k].top1 / n_tok,
                   100.0 * r[k].tok / n_tok, r[k].kl / n_tok);
        fflush(stdout);
        fprintf(table, "| %s | inf | (unbounded) | 100.0 | %.1f | 0 | 0 |\n", name, 100.0 * self_tok / n_tok);
        for (int k = 1; k < nr; k++) {
            kvz_kv_stats st;
            kvz_kv_get_stats(r[k].kv, &st);
            fprintf(table, "| %s | %d | %s | %.1f | %.1f | %.4f | %lld |\n", name, r[k].B,
                    r[k].policy == KVZ_OUT_LONGFLOW ? "LongFlow" : "sink+window",
                    100.0 * r[k].top1 / n_tok, 100.0 * r[k].tok / n_tok, r[k].kl / n_tok,
                    (long long)st.evictions);
        }
        fflush(table);
    }
    kvz_tokens_free(&out);
    free(work);
    for (int k = 0; k < nr; k++) free_run(&r[k]);
    return rc;
}

int main(int argc, char **argv)
{
    const char *model = getenv("KVZ_MODEL") ? getenv("KVZ_MODEL") : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    const char *part = "all", *docs = "aquila_aq300_manual,larkspur_payments_api", *speed_model = NULL;
    long threads = 0, speed_tokens = 4000, quality_tokens = 1000, doc_tokens = 1000, seed = 1;
    double temperature = 0.7;
    int32_t budgets[MAX_CFG] = {128, 256, 512};
    int nb = 3;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--model")) model = opt(argc, argv, &i);
        else if (!strcmp(a, "--threads")) threads = atol(opt(argc, argv, &i));
        else if (!strcmp(a, "--part")) part = opt(argc, argv, &i);
        else if (!strcmp(a, "--speed-model")) speed_model = opt(argc, argv, &i);
        else if (!strcmp(a, "--speed-tokens")) speed_tokens = atol(opt(argc, argv, &i));
        else if (!strcmp(a, "--quality-tokens")) quality_tokens = atol(opt(argc, argv, &i));
        else if (!strcmp(a, "--doc-tokens")) doc_tokens = atol(opt(argc, argv, &i));
        else if (!strcmp(a, "--docs")) docs = opt(argc, argv, &i);
        else if (!strcmp(a, "--temperature")) temperature = atof(opt(argc, argv, &i));
        else if (!strcmp(a, "--seed")) seed = atol(opt(argc, argv, &i));
        else if (!strcmp(a, "--budgets")) {
            char *s = (char *)opt(argc, argv, &i), *e;
            for (nb = 0; nb < (MAX_CFG - 1) / 2 && *s; s = *e ? e + 1 : e) budgets[nb++] = (int32_t)strtol(s, &e, 10);
        } else {
            fprintf(stderr, "usage: longflow_bench [--model PATH] [--threads N] [--part speed|quality|all] "
                    "[--speed-model SYNTHETIC] [--speed-tokens N] [--quality-tokens N] [--doc-tokens N] [--docs a,b] "
                    "[--temperature T] [--seed S] [--budgets 128,256,512]\n");
            return 2;
        }
    }
    kvz_model *m;
    kvz_model_opts mo = {.device = KVZ_DEVICE_CPU, .n_threads = (int32_t)threads};
    int rc = kvz_model_load(model, &mo, &m);
    if (rc) { fprintf(stderr, "longflow_bench: cannot load %s: %s\n", model, kvz_strerror(rc)); return 1; }
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    kvz_tokens q = {0};
    kvz_chat_question(tok, QUESTION, &q);
    printf("longflow_bench: %s, CPU backend, %s threads, temperature %.2f seed %ld, question \"%s\"\n",
           kvz_model_config(m)->name, threads ? "given" : "all", temperature, seed, QUESTION);
    const double t0 = kvz_now();
    if (!strcmp(part, "speed") || !strcmp(part, "all")) {
        kvz_model *ms = m;
        if (speed_model && (rc = kvz_model_synthetic(speed_model, &mo, &ms)))
            fprintf(stderr, "longflow_bench: synthetic model %s: %s\n", speed_model, kvz_strerror(rc));
        const kvz_tokenizer *ts = kvz_model_tokenizer(ms);
        kvz_tokens d = {0}, qs = {0};
        if (!rc) rc = doc_prompt(ts, "aquila_aq300_manual", (int32_t)doc_tokens, &d);
        if (!rc) rc = kvz_chat_question(ts, QUESTION, &qs);
        if (!rc) {
            printf("speed model: %s\n", speed_model ? speed_model : kvz_model_config(m)->name);
            rc = bench_speed(ms, &d, &qs, (int32_t)speed_tokens, (float)temperature, (uint64_t)seed);
        }
        kvz_tokens_free(&d);
        kvz_tokens_free(&qs);
        if (ms != m) kvz_model_free(ms);
        g_nstops = -1; /* the speed model may have had another tokenizer */
    }
    if (!rc && (!strcmp(part, "quality") || !strcmp(part, "all"))) {
        char *list = strdup(docs), *save = NULL;
        FILE *table = tmpfile();
        fprintf(table, "| document | B | policy | top-1 = unbounded argmax %% | = unbounded sampled token %% "
                "| mean KL (nats) | evictions |\n|---|---|---|---|---|---|---|\n");
        for (char *name = strtok_r(list, ",", &save); name && !rc; name = strtok_r(NULL, ",", &save)) {
            kvz_tokens d = {0};
            rc = doc_prompt(tok, name, (int32_t)doc_tokens, &d);
            if (!rc) rc = bench_quality(m, name, &d, &q, (int32_t)quality_tokens, budgets, nb,
                                        (float)temperature, (uint64_t)seed, table);
            kvz_tokens_free(&d);
        }
        printf("\n(b) teacher-forced agreement with the unbounded run, %ld tokens per document\n\n",
               quality_tokens);
        rewind(table);
        char line[512];
        while (fgets(line, sizeof line, table)) fputs(line, stdout);
        fclose(table);
        free(list);
    }
    printf("\ntotal %.0f s\n", kvz_now() - t0);
    if (rc) fprintf(stderr, "longflow_bench: %s\n", kvz_strerror(rc));
    kvz_tokens_free(&q);
    kvz_model_free(m);
    return rc ? 1 : 0;
}
