/* kvzip-eval --device cuda against --device cpu on the real model (KVZ_MODEL, SmolLM2):
 * samples/questions.jsonl, 2 documents x 2 questions, ratios 0.3 and 1.0, every
 * baseline (kvzip, random, window, snapkv: the SnapKV hook runs on the device cache),
 * --max-tokens 24, --json from both runs, compared:
 *  - exact (no arithmetic in it): the same documents with the same prefix/context
 *    token counts, the same questions, the same runs per question, and each run's KV MB
 *    (the kept-row count: every method keeps round(n·r) rows per head or round(N·r)
 *    in all, whatever the scores); the JSON says which device ran;
 *  - within noise: the CPU computes in fp32 with an fp32 cache, CUDA with bf16
 *    weights, activations and cache (logits ‖Δ‖/‖cpu‖ ~1e-2, tests/gpu/test_backend.c).
 *    On SmolLM2's logit scale that moves a token's log-probability by up to a few
 *    tenths of a nat (the CPU's own dots use int8 activations, and Q4_1 weights are
 *    rounded to bf16 on the device), so:
 *      full cache:  per question |NLL_cuda − NLL_cpu| <= 0.25 + 0.10·NLL_cpu, and
 *                   the greedy answers identical or the accuracy equal;
 *      compressed:  per question |ΔNLL| <= 0.50 + 0.15·NLL_cpu (the kept sets come
 *                   from bf16 scores: near-tied rows may swap), and per method and
 *                   ratio the accuracy within one question of four (25 points).
 *    (Set before a GPU measurement: wrong rows or positions move NLL by nats.) Every
 *    difference is printed, measured beside its bound;
 *  - exact on the device: kvzip at ratio 1.0 is the full cache read back through
 *    kvz_kv_get_head and written by kvz_kv_set_layer (bf16 -> fp32 -> bf16 is exact),
 *    so its NLL equals the full cache's (|d| <= 1e-3) for every question.
 * Exits 77 (skip) without a usable GPU or without the model file. */
#include "kvz_test.h"

#include <jansson.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvz_backend.h"
#include "kvz_error.h"

#define TOL_FULL_ABS 0.25
#define TOL_FULL_REL 0.10
#define TOL_COMP_ABS 0.50
#define TOL_COMP_REL 0.15
#define TOL_SAME 1e-3     /* kvzip at 1.0 on the device: the full cache's rows, round-tripped */
#define TOL_ACC 25.0      /* accuracy in the JSON is in percent: one question of four */

static json_t *run_eval(const char *dev, const char *dir, double *secs)
{
    const char *bin = getenv("KVZ_BINARY_DIR"), *src = getenv("KVZ_SOURCE_DIR");
    char out[512], cmd[4096];
    snprintf(out, sizeof out, "%s/%s.json", dir, dev);
    snprintf(cmd, sizeof cmd,
             "'%s/bin/kvzip-eval' --device %s --model '%s' --docs halcyon_warranty_returns,lab_b214_safety_sop "
             "--per-doc 2 --ratios 0.3,1.0 --baselines random,window,snapkv --max-tokens 24 --json '%s' "
             "'%s/samples/questions.jsonl' >'%s/%s.md' 2>'%s/%s.log'",
             bin ? bin : "build", dev, kvz_test_model(), out, src ? src : ".", dir, dev, dir, dev);
    const double t0 = (double)time(NULL);
    int st = system(cmd);
    *secs = (double)time(NULL) - t0;
    if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "kvzip-eval --device %s failed (status %d); its log:\n", dev, st);
        snprintf(cmd, sizeof cmd, "cat '%s/%s.log' >&2", dir, dev);
        if (system(cmd)) {}
        return NULL;
    }
    json_error_t err;
    json_t *j = json_load_file(out, 0, &err);
    if (!j) fprintf(stderr, "%s: %s (line %d)\n", out, err.text, err.line);
    return j;
}

static double num(const json_t *o, const char *k) { return json_number_value(json_object_get(o, k)); }
static const char *str(const json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "";
}

int main(void)
{
    const kvz_backend *be;
    if (kvz_backend_pick(KVZ_DEVICE_CUDA, &be)) {
        printf("skip: no usable GPU (%s)\n", kvz_error_detail());
        return 77;
    }
    struct stat sb;
    if (stat(kvz_test_model(), &sb)) {
        printf("skip: model %s missing (scripts/setup, or set KVZ_MODEL)\n", kvz_test_model());
        return 77;
    }
    char dir[] = "/tmp/kvz_test_eval_cuda_XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL);
    double t_cpu, t_gpu;
    json_t *jc = run_eval("cpu", dir, &t_cpu), *jg = run_eval("cuda", dir, &t_gpu);
    REQUIRE(jc && jg);
    printf("wall: cpu %.0f s, cuda %.0f s (model load included)\n", t_cpu, t_gpu);
    CHECK(!strcmp(str(json_object_get(jc, "settings"), "device"), "cpu"));
    CHECK(!strcmp(str(json_object_get(jg, "settings"), "device"), "cuda"));

    const json_t *dc = json_object_get(jc, "docs"), *dg = json_object_get(jg, "docs");
    CHECK(json_array_size(dc) == 2 && json_array_size(dg) == 2);
    for (size_t d = 0; d < json_array_size(dc) && d < json_array_size(dg); d++) {
        const json_t *a = json_array_get(dc, d), *b = json_array_get(dg, d);
        CHECK(!strcmp(str(a, "doc"), str(b, "doc")));
        CHECK(num(a, "n_prefix") == num(b, "n_prefix") && num(a, "n_ctx") == num(b, "n_ctx"));
        printf("%s: %.0f context tokens, scored in %.2f s (cpu) / %.2f s (cuda)\n", str(a, "doc"),
               num(a, "n_ctx"), num(a, "score_s"), num(b, "score_s"));
    }

    const json_t *qc = json_object_get(jc, "questions"), *qg = json_object_get(jg, "questions");
    REQUIRE(json_array_size(qc) == 4 && json_array_size(qg) == 4);
    int full_same = 1, full_acc_c = 0, full_acc_g = 0;
    double worst_full = 0, worst_comp = 0;
    for (size_t i = 0; i < 4; i++) {
        const json_t *a = json_array_get(qc, i), *b = json_array_get(qg, i);
        CHECK(!strcmp(str(a, "question"), str(b, "question")));
        const json_t *fa = json_object_get(a, "full"), *fb = json_object_get(b, "full");
        const double na = num(fa, "nll"), nb = num(fb, "nll"), bound = TOL_FULL_ABS + TOL_FULL_REL * na;
        printf("q%zu full: nll cpu %.4f cuda %.4f |d| %.4f (bound %.4f)\n   cpu:  %s\n   cuda: %s\n", i, na, nb,
               fabs(na - nb), bound, str(fa, "answer"), str(fb, "answer"));
        CHECKF(fabs(na - nb) <= bound, "q%zu full-cache NLL %.4f vs %.4f", i, na, nb);
        worst_full = fmax(worst_full, fabs(na - nb));
        full_same &= !strcmp(str(fa, "answer"), str(fb, "answer"));
        full_acc_c += json_is_true(json_object_get(fa, "correct"));
        full_acc_g += json_is_true(json_object_get(fb, "correct"));
        const json_t *ra = json_object_get(a, "runs"), *rb = json_object_get(b, "runs");
        CHECKF(json_array_size(ra) == json_array_size(rb) && json_array_size(ra) > 0, "q%zu: %zu vs %zu runs", i,
               json_array_size(ra), json_array_size(rb));
        for (size_t k = 0; k < json_array_size(ra) && k < json_array_size(rb); k++) {
            const json_t *x = json_array_get(ra, k), *y = json_array_get(rb, k);
            CHECK(!strcmp(str(x, "method"), str(y, "method")) && num(x, "ratio") == num(y, "ratio"));
            CHECKF(num(x, "kv_mb") == num(y, "kv_mb"), "q%zu %s %.2f: KV MB %.4f vs %.4f", i, str(x, "method"),
                   num(x, "ratio"), num(x, "kv_mb"), num(y, "kv_mb"));
            const double xa = num(x, "nll"), ya = num(y, "nll"), cb = TOL_COMP_ABS + TOL_COMP_REL * xa;
            CHECKF(fabs(xa - ya) <= cb, "q%zu %s %.2f: NLL %.4f vs %.4f (bound %.4f)", i, str(x, "method"),
                   num(x, "ratio"), xa, ya, cb);
            worst_comp = fmax(worst_comp, fabs(xa - ya));
            if (!strcmp(str(y, "method"), "kvzip") && num(y, "ratio") == 1.0)
                CHECKF(fabs(ya - nb) <= TOL_SAME, "q%zu: cuda kvzip 1.0 NLL %.6f vs its full cache %.6f", i, ya, nb);
        }
    }
    printf("full cache: answers %s, accuracy cpu %d/4 cuda %d/4; worst |dNLL| full %.4f, compressed %.4f\n",
           full_same ? "identical" : "differ", full_acc_c, full_acc_g, worst_full, worst_comp);
    CHECKF(full_same || full_acc_c == full_acc_g, "full-cache answers differ and so does the accuracy");

    const json_t *sc = json_object_get(jc, "results"), *sg = json_object_get(jg, "results");
    CHECK(json_array_size(sc) == json_array_size(sg) && json_array_size(sc) == 8); /* 4 methods x 2 ratios */
    for (size_t k = 0; k < json_array_size(sc) && k < json_array_size(sg); k++) {
        const json_t *x = json_array_get(sc, k), *y = json_array_get(sg, k);
        printf("%-8s %.2f  accuracy cpu %.2f cuda %.2f  agreement cpu %.2f cuda %.2f  dNLL cpu %.4f cuda %.4f\n",
               str(x, "method"), num(x, "ratio"), num(x, "accuracy"), num(y, "accuracy"), num(x, "agreement"),
               num(y, "agreement"), num(x, "delta_nll"), num(y, "delta_nll"));
        CHECKF(fabs(num(x, "accuracy") - num(y, "accuracy")) <= TOL_ACC + 1e-9, "%s %.2f accuracy %.2f vs %.2f",
               str(x, "method"), num(x, "ratio"), num(x, "accuracy"), num(y, "accuracy"));
        CHECK(num(x, "kv_mb") == num(y, "kv_mb"));
    }
    json_decref(jc);
    json_decref(jg);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) {}
    return kvz_test_summary();
}
