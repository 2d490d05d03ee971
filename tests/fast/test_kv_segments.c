/* Segmented passes (kvz_kv_set_segments, runtime/kvz_cpu.c attention_segs) on the
 * synthetic tiny-llama (no model file):
 *  - three segments of 30, 45 and 7 tokens in ONE pass after a 20-token cached prefix
 *    give, per segment, the logits, K/V rows and positions of that segment run alone
 *    after the same prefix (rounding only: max |d| of the logits <= 1e-4), and each
 *    segment's probe scores equal kvz_kv_probe's on the pass alone;
 *  - changing segment 0's tokens leaves segments 1 and 2 bit for bit unchanged (a
 *    segment that saw another's rows would fail this);
 *  - bad uses are refused with KVZ_ERR_ARG and change nothing: a pass whose length is
 *    not the segments' sum, a probe set at the same time, n_score > n.
 */
#include "kvz_test.h"

#include <math.h>
#include <stdint.h>

#include "kvz_error.h"
#include "kvz_model.h"

#define NP 20
#define NSEG 3
static const int32_t LEN[NSEG] = {30, 45, 7};
static const int32_t NSC[NSEG] = {12, 20, 3}; /* rows scored by the later queries */

static double maxdiff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - b[i]);
        if (d > m || d != d) m = d != d ? INFINITY : d;
    }
    return m;
}

typedef struct out {
    float *logits[NSEG];  /* (LEN[s], n_vocab) */
    float *scores[NSEG];  /* (n_layer, n_kv, NSC[s]) */
    float *k[NSEG];       /* (n_layer, n_kv, LEN[s], hd) */
    int32_t *pos[NSEG];   /* (n_layer, n_kv, LEN[s]) */
} out;

static void out_alloc(const kvz_config *c, out *o)
{
    const size_t nlh = (size_t)c->n_layer * c->n_kv_head;
    for (int s = 0; s < NSEG; s++) {
        o->logits[s] = malloc(sizeof(float) * LEN[s] * c->n_vocab);
        o->scores[s] = calloc(nlh * NSC[s], sizeof(float));
        o->k[s] = malloc(sizeof(float) * nlh * LEN[s] * c->head_dim);
        o->pos[s] = malloc(sizeof(int32_t) * nlh * LEN[s]);
    }
}

static void out_free(out *o)
{
    for (int s = 0; s < NSEG; s++) {
        free(o->logits[s]);
        free(o->scores[s]);
        free(o->k[s]);
        free(o->pos[s]);
    }
}

/* rows [r0, r0 + n) of every head */
static void grab(const kvz_config *c, const kvz_kv *kv, int64_t r0, int32_t n, float *k, int32_t *pos)
{
    for (int32_t l = 0; l < c->n_layer; l++)
        for (int32_t h = 0; h < c->n_kv_head; h++) {
            const float *kk, *vv;
            const int32_t *pp;
            int64_t len;
            kvz_kv_view(kv, l, h, &kk, &vv, &pp, &len);
            const size_t o = ((size_t)l * c->n_kv_head + h) * n;
            memcpy(k + o * c->head_dim, kk + (size_t)r0 * c->head_dim, sizeof(float) * (size_t)n * c->head_dim);
            memcpy(pos + o, pp + r0, sizeof(int32_t) * (size_t)n);
        }
}

static kvz_kv *with_prefix(kvz_model *m, const int32_t *pre)
{
    kvz_kv *kv = NULL;
    if (kvz_kv_create(m, NP + 200, 0, &kv)) return NULL;
    if (kvz_forward(m, kv, pre, NP, 0, NULL, KVZ_FWD_NO_LOGITS, NULL)) {
        kvz_kv_free(kv);
        return NULL;
    }
    return kv;
}

/* each segment alone after the prefix, with the probe of kvz_kv_probe */
static int alone(kvz_model *m, const int32_t *pre, int32_t *const *seg, out *o)
{
    const kvz_config *c = kvz_model_config(m);
    for (int s = 0; s < NSEG; s++) {
        kvz_kv *kv = with_prefix(m, pre);
        if (!kv) return -1;
        const kvz_kv_probe pr = {.n_prefix = NP, .c0 = NP, .c1 = NP + NSC[s], .rep_row0 = NP + NSC[s],
                                 .scores = o->scores[s], .stride = NSC[s], .off = 0, .q_pos0 = NP + NSC[s]};
        int rc = kvz_kv_set_probe(kv, &pr);
        if (!rc) rc = kvz_forward(m, kv, seg[s], LEN[s], NP, o->logits[s], KVZ_FWD_LOGITS_ALL, NULL);
        kvz_kv_set_probe(kv, NULL);
        if (!rc) grab(c, kv, NP, LEN[s], o->k[s], o->pos[s]);
        kvz_kv_free(kv);
        if (rc) return rc;
    }
    return 0;
}

/* all segments in one pass */
static int together(kvz_model *m, const int32_t *pre, int32_t *const *seg, out *o)
{
    const kvz_config *c = kvz_model_config(m);
    int32_t all[200], n = 0;
    for (int s = 0; s < NSEG; s++)
        for (int32_t i = 0; i < LEN[s]; i++) all[n++] = seg[s][i];
    float *lg = malloc(sizeof(float) * (size_t)n * c->n_vocab);
    kvz_kv *kv = with_prefix(m, pre);
    if (!kv || !lg) return -1;
    kvz_kv_seg sg[NSEG];
    for (int s = 0; s < NSEG; s++) sg[s] = (kvz_kv_seg){.n = LEN[s], .n_score = NSC[s], .scores = o->scores[s]};
    int rc = kvz_kv_set_segments(kv, sg, NSEG, NP);
    if (!rc) rc = kvz_forward(m, kv, all, n, NP, lg, KVZ_FWD_LOGITS_ALL, NULL);
    kvz_kv_set_segments(kv, NULL, 0, 0);
    for (int s = 0, r = 0; !rc && s < NSEG; r += LEN[s], s++) {
        memcpy(o->logits[s], lg + (size_t)r * c->n_vocab, sizeof(float) * (size_t)LEN[s] * c->n_vocab);
        grab(c, kv, NP + r, LEN[s], o->k[s], o->pos[s]);
    }
    free(lg);
    kvz_kv_free(kv);
    return rc;
}

int main(void)
{
    kvz_model *m;
    kvz_model_opts mo = {.device = KVZ_DEVICE_CPU};
    REQUIRE(kvz_model_synthetic("tiny-llama", &mo, &m) == 0);
    const kvz_config *c = kvz_model_config(m);
    const size_t nlh = (size_t)c->n_layer * c->n_kv_head;
    uint64_t x = 88172645463325252ull;
    int32_t pre[NP], s0[64], s1[64], s2[64], s0b[64];
    int32_t *seg[NSEG] = {s0, s1, s2}, *segb[NSEG] = {s0b, s1, s2};
    for (int i = 0; i < NP; i++) pre[i] = (int32_t)((x = x * 6364136223846793005ull + 1) >> 33) % c->n_vocab;
    for (int s = 0; s < NSEG; s++)
        for (int i = 0; i < LEN[s]; i++) seg[s][i] = (int32_t)((x = x * 6364136223846793005ull + 1) >> 33) % c->n_vocab;
    for (int i = 0; i < LEN[0]; i++) s0b[i] = (s0[i] + 17) % c->n_vocab;

    out a, b, b2;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    memset(&b2, 0, sizeof b2);
    out_alloc(c, &a);
    out_alloc(c, &b);
    out_alloc(c, &b2);
    REQUIRE(alone(m, pre, seg, &a) == 0);
    REQUIRE(together(m, pre, seg, &b) == 0);
    for (int s = 0; s < NSEG; s++) {
        const double dl = maxdiff(b.logits[s], a.logits[s], (size_t)LEN[s] * c->n_vocab);
        const double dk = maxdiff(b.k[s], a.k[s], nlh * LEN[s] * c->head_dim);
        const double ds = maxdiff(b.scores[s], a.scores[s], nlh * NSC[s]);
        size_t badpos = 0, scored = 0;
        for (size_t i = 0; i < nlh * LEN[s]; i++) badpos += b.pos[s][i] != NP + (int32_t)(i % LEN[s]) || a.pos[s][i] != b.pos[s][i];
        for (size_t i = 0; i < nlh * NSC[s]; i++) scored += b.scores[s][i] > 0;
        printf("segment %d (%d tokens): logits max |d| %.3g, K %.3g, probe scores %.3g (%zu of %zu set)\n", s,
               LEN[s], dl, dk, ds, scored, nlh * NSC[s]);
        CHECKF(dl <= 1e-4 && dk <= 1e-4, "segment %d differs from the segment alone", s);
        CHECKF(ds <= 1e-5 && scored == nlh * NSC[s], "segment %d: probe scores differ or unset", s);
        CHECKF(badpos == 0, "segment %d: %zu rows at a wrong position", s, badpos);
    }
    /* isolation: segment 0's tokens changed, 1 and 2 bit for bit the same */
    REQUIRE(together(m, pre, segb, &b2) == 0);
    CHECK(memcmp(b2.logits[0], b.logits[0], sizeof(float) * LEN[0] * c->n_vocab) != 0);
    for (int s = 1; s < NSEG; s++) {
        CHECKF(!memcmp(b2.logits[s], b.logits[s], sizeof(float) * LEN[s] * c->n_vocab) &&
               !memcmp(b2.k[s], b.k[s], sizeof(float) * nlh * LEN[s] * c->head_dim) &&
               !memcmp(b2.scores[s], b.scores[s], sizeof(float) * nlh * NSC[s]),
               "segment %d changed with segment 0's tokens: segments see each other", s);
    }

    /* refused uses */
    kvz_kv *kv = with_prefix(m, pre);
    REQUIRE(kv != NULL);
    kvz_kv_seg sg[2] = {{.n = 5, .n_score = 0, .scores = NULL}, {.n = 4, .n_score = 5, .scores = NULL}};
    CHECK(kvz_kv_set_segments(kv, sg, 2, NP) == KVZ_ERR_ARG); /* n_score > n */
    sg[1].n_score = 0;
    REQUIRE(kvz_kv_set_segments(kv, sg, 2, NP) == 0);
    CHECK(kvz_forward(m, kv, s1, 8, NP, NULL, KVZ_FWD_NO_LOGITS, NULL) == KVZ_ERR_ARG); /* 8 != 5 + 4 */
    float sc[64];
    const kvz_kv_probe pr = {.n_prefix = NP, .c0 = NP, .c1 = NP + 2, .rep_row0 = NP + 2, .scores = sc, .stride = 2};
    REQUIRE(kvz_kv_set_probe(kv, &pr) == 0);
    CHECK(kvz_forward(m, kv, s1, 9, NP, NULL, KVZ_FWD_NO_LOGITS, NULL) == KVZ_ERR_ARG); /* probe and segments */
    kvz_kv_set_probe(kv, NULL);
    CHECK(kvz_kv_len(kv, 0, 0) == NP); /* nothing appended by the refused passes */
    CHECK(kvz_forward(m, kv, s1, 9, NP, NULL, KVZ_FWD_NO_LOGITS, NULL) == 0);
    CHECK(kvz_kv_len(kv, 0, 0) == NP + 9);
    kvz_kv_free(kv);

    out_free(&a);
    out_free(&b);
    out_free(&b2);
    kvz_model_free(m);
    return kvz_test_summary();
}
