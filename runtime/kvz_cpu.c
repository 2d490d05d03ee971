/* CPU backend: forward pass with fp32 activations. The reference for every other
 * backend. Weights are either fp32 (synthetic models, or KVZ f32_weights) or the
 * GGUF's quantized blocks read in place (kvz_qdot): a few tokens at a time
 * (decode) go through int8 dot products on the quantized rows; larger batches
 * go through the int8 GEMM (kvz_qgemm: activations quantized once, weight rows
 * unpacked once per panel and multiplied with all tokens), except Q8_0 matrices
 * and when KVZ_QGEMM=0, which dequantize up to 32 MiB of weight rows at a time
 * into a reused buffer and run one multithreaded OpenBLAS SGEMM on it. Neither
 * keeps an fp32 copy of the model. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_attn.h"
#include "kvz_error.h"
#include "kvz_model_impl.h"
#include "kvz_qdot.h"
#include "kvz_qgemm.h"
#include "kvz_quant.h"
#include "kvz_vmath.h"

#define KVZ_CPU_MAX_BATCH 1024   /* tokens per internal pass (bounds scratch memory) */
#define KVZ_ATTN_BLOCK_FLOATS (4u << 20) /* score block budget: 16 MiB */
/* Keys per GEMM in attention. Chunks are aligned on the key index in the
 * concatenation (document rows ++ output slots), so a token's attention does the
 * same GEMM calls on the same values whether its keys sit in the document region
 * (out_slots 0) or partly in the output buffer: B >= output length reproduces
 * unbounded decoding bit for bit (DESIGN §5). */
#define KVZ_ATTN_KCHUNK 256

/* Batches below this many tokens use int8 dot products on the quantized rows;
 * larger ones the int8 GEMM or the SGEMM route (the unpacking or dequantization
 * is paid once per weight row and batch, so it amortizes over the tokens). */
#define KVZ_QGEMM_MIN_TOKENS 16
/* A batched pass dequantizes up to this many weight floats (32 MiB, in the
 * scratch it shares with attention) and runs one multithreaded SGEMM on them:
 * chunks this large make the SGEMM as efficient as on fp32 weights (it packs the
 * activations once per call, so small tiles repack them over and over: 64-row
 * tiles cost 10-15% of a prefill). Every matrix of SmolLM2-135M fits in one
 * chunk, Qwen2.5-0.5B's gate+up takes two. A row wider than 1/64 of the budget
 * (no model here) gets 64-row chunks. */
#define KVZ_QGEMM_CHUNK_FLOATS ((size_t)8 << 20)
#define KVZ_QGEMM_MIN_ROWS 64

static size_t qgemm_chunk_floats(int in)
{
    const size_t min = (size_t)KVZ_QGEMM_MIN_ROWS * (size_t)in;
    return KVZ_QGEMM_CHUNK_FLOATS > min ? KVZ_QGEMM_CHUNK_FLOATS : min;
}

/* Batched passes multiply the quantized rows with int8 activations (kvz_qgemm)
 * when every matrix's type allows it and the CPU has AVX2; KVZ_QGEMM=0 selects
 * the dequantize + SGEMM route instead (A/B, fallback). */
static int qgemm_on(void)
{
    const char *e = getenv("KVZ_QGEMM"); /* read per product (outside the parallel region): tests switch it */
    return !(e && !strcmp(e, "0")) && kvz_qgemm_available();
}

/* Prefill attention runs on kvz_attn_flash; KVZ_FLASH=0 selects the SGEMM route
 * (score rows of whole query blocks) instead (A/B, read per pass like KVZ_QGEMM). */
static int kvz_flash_on(void)
{
    const char *e = getenv("KVZ_FLASH");
    return !(e && !strcmp(e, "0"));
}

/* Weight types that go through the int8 GEMM in batched passes. Q8_0 does not:
 * its signed bytes need the sign trick and an int32 step per 4 elements, which
 * made it 0.4x the SGEMM route (bench/qdot_bench_gemm). */
static int qgemm_route(uint32_t type) { return kvz_qgemm_supported(type) && type != KVZ_TYPE_Q8_0; }

static size_t qgemm_act_floats(int n, int in) { return (kvz_qgemm_act_bytes(n, in) + 63) / 64 * 16; }

/* Scratch floats linear() needs for n tokens of input width in with nthr threads
 * (the larger of the two batched routes, so that either can run). */
static size_t linear_work_floats(int n, int in, int nthr)
{
    const size_t q8 = ((size_t)n * kvz_q8_row_bytes(in) + 3) / 4;
    if (n < KVZ_QGEMM_MIN_TOKENS) return q8 + 16;
    const size_t sg = qgemm_chunk_floats(in);
    /* the panel allowance does not depend on the width: one scratch serves the
     * products of every width of the layer */
    const size_t qg = in % 32 ? 0 : qgemm_act_floats(n, in) + (size_t)nthr * (KVZ_QGEMM_PANEL_MAX_BYTES / 4 + 16);
    return (sg > qg ? sg : qg) + 16;
}

/* The int8 GEMM route of linear(): activations quantized once (rows split across
 * the threads), then panels of weight rows handed out as threads ask, each
 * unpacked once into the thread's panel buffer and multiplied with all n tokens. */
static void linear_qgemm(const kvz_wmat *W, int nw, const int64_t *off, const float *x, int n, int in, float *y,
                         int ldy, int accumulate, float *work)
{
    uint8_t *act = (uint8_t *)work;
    uint8_t *panels = (uint8_t *)(work + qgemm_act_floats(n, in));
    const size_t pb = KVZ_QGEMM_PANEL_MAX_BYTES + 64;
    /* panels of at most the unpacked budget, and at least 4 per thread in a number
     * that divides among the threads (a 6-panel matrix on 2 threads is 3 + 3; with
     * one short panel it would be 3 + 2 and a tail) */
    const int nthr = omp_get_max_threads();
    int64_t total = 0;
    for (int k = 0; k < nw; k++) total += W[k].rows;
    const int64_t pmax = kvz_qgemm_panel_rows(in);
    int64_t ntask = (total + pmax - 1) / pmax;
    if (ntask < 4 * (int64_t)nthr) ntask = 4 * (int64_t)nthr;
    ntask = (ntask + nthr - 1) / nthr * nthr;
    int64_t P = ((total + ntask - 1) / ntask + 7) / 8 * 8;
    if (P > pmax) P = pmax;
    int64_t first[5] = {0}; /* first task of matrix k */
    for (int k = 0; k < nw; k++) first[k + 1] = first[k] + (W[k].rows + P - 1) / P;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) kvz_qgemm_quantize(x, n, in, i, i + 1, act);
        uint8_t *panel = panels + (size_t)omp_get_thread_num() * pb;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < first[nw]; task++) {
            int k = 0;
            while (task >= first[k + 1]) k++;
            const int64_t r0 = (task - first[k]) * P, nr = W[k].rows - r0 < P ? W[k].rows - r0 : P;
            kvz_qgemm_rows(W[k].type, (const uint8_t *)W[k].data + (size_t)r0 * W[k].row_bytes, W[k].row_bytes, nr,
                           in, act, n, y + off[k] + r0, ldy, accumulate, panel);
        }
    }
}

/* y (n, ·) = x (n, in) · [W_0; W_1; ..]ᵀ: the outputs of matrix k land in columns
 * [Σ_{j<k} rows_j, +rows_k) of y (row stride ldy); beta=1 accumulates into y.
 * @p work holds linear_work_floats(n, in, threads) floats. */
static void linear(const kvz_wmat *W, int nw, const float *x, int n, int in, float *y, int ldy,
                   float beta, float *work)
{
    if (nw == 1 && W[0].type == KVZ_TYPE_F32) {
        const float *w = W[0].data;
        const int out = W[0].rows;
        if (n == 1)
            cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.0f, w, in, x, 1, beta, y, 1);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w, in,
                        beta, y, ldy);
        return;
    }
    int64_t off[4] = {0};
    for (int k = 0; k < nw; k++) off[k + 1] = off[k] + W[k].rows;
    if (n < KVZ_QGEMM_MIN_TOKENS) {
        const size_t rb = kvz_q8_row_bytes(in);
        uint8_t *qa = (uint8_t *)work;
        if (in % 32 == 0) /* else every matrix is F32 (quantized types have blocks of >= 32) */
            for (int i = 0; i < n; i++) kvz_q8_quantize(x + (size_t)i * in, in, qa + (size_t)i * rb);
        /* rows in chunks of 32 handed out as threads ask: a thread the OS preempts
         * (the machine is shared) delays the op by one chunk, not by half of it */
#pragma omp parallel for schedule(dynamic, 32)
        for (int64_t r = 0; r < off[nw]; r++) {
            int k = 0;
            while (r >= off[k + 1]) k++;
            const kvz_wmat *w = &W[k];
            const uint8_t *row = (const uint8_t *)w->data + (size_t)(r - off[k]) * w->row_bytes;
            for (int i = 0; i < n; i++) {
                float v;
                if (w->type == KVZ_TYPE_F32) {
                    const float *wr = (const float *)row, *xi = x + (size_t)i * in;
                    v = 0.0f;
                    for (int j = 0; j < in; j++) v += wr[j] * xi[j];
                } else {
                    v = kvz_qdot(w->type, row, qa + (size_t)i * rb, in);
                }
                float *o = y + (size_t)i * ldy + r;
                *o = beta != 0.0f ? *o + v : v;
            }
        }
        return;
    }
    if (in % 32 == 0 && qgemm_on()) {
        /* the matrices the int8 GEMM is faster on in one call, the others one by one
         * through the SGEMM route below */
        kvz_wmat Wq[3];
        int64_t oq[3];
        int nq = 0;
        for (int k = 0; k < nw; k++)
            if (qgemm_route(W[k].type)) { Wq[nq] = W[k]; oq[nq++] = off[k]; }
        if (nq) {
            linear_qgemm(Wq, nq, oq, x, n, in, y, ldy, beta != 0.0f, work);
            for (int k = 0; k < nw && nq < nw; k++)
                if (!qgemm_route(W[k].type)) linear(&W[k], 1, x, n, in, y + off[k], ldy, beta, work);
            return;
        }
    }
    /* the rows of all matrices, in equal chunks (multiples of 16 rows) that fit the
     * scratch; each chunk: dequantize in parallel, then one multithreaded SGEMM */
    const int64_t total = off[nw], max_rows = (int64_t)(qgemm_chunk_floats(in) / (size_t)in) / 16 * 16;
    const int64_t nch = (total + max_rows - 1) / max_rows;
    const int64_t rows = ((total + nch - 1) / nch + 15) / 16 * 16;
    for (int64_t r0 = 0; r0 < total; r0 += rows) {
        const int64_t nr = total - r0 < rows ? total - r0 : rows;
#pragma omp parallel for schedule(static)
        for (int64_t r = r0; r < r0 + nr; r++) {
            int k = 0;
            while (r >= off[k + 1]) k++;
            const kvz_wmat *w = &W[k];
            kvz_dequantize(w->type, (const uint8_t *)w->data + (size_t)(r - off[k]) * w->row_bytes,
                           work + (size_t)(r - r0) * in, in);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, (int)nr, in, 1.0f, x, in, work, in,
                    beta, y + r0, ldy);
    }
}

static void rmsnorm(float *out, const float *x, const float *w, int n, int d, float eps)
{
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d;
        float *oi = out + (size_t)i * d;
        float ss = 0.0f;
        for (int j = 0; j < d; j++) ss += xi[j] * xi[j];
        const float r = 1.0f / sqrtf(ss / (float)d + eps);
        for (int j = 0; j < d; j++) oi[j] = w[j] * (xi[j] * r);
    }
}

/* Rotate @p nh vectors of length hd at position pos. */
static void rope(float *x, int nh, int hd, int32_t pos, const float *inv_freq, int adjacent)
{
    const int half = hd / 2;
    for (int j = 0; j < half; j++) {
        const float ang = (float)pos * inv_freq[j];
        const float c = cosf(ang), s = sinf(ang);
        for (int h = 0; h < nh; h++) {
            float *v = x + (size_t)h * hd;
            const int i0 = adjacent ? 2 * j : j, i1 = adjacent ? 2 * j + 1 : j + half;
            const float a = v[i0], b = v[i1];
            v[i0] = a * c - b * s;
            v[i1] = a * s + b * c;
        }
    }
}

static float *scratch(kvz_kv *kv, size_t floats)
{
    if (floats > kv->scratch_cap) {
        float *p = realloc(kv->scratch, floats * sizeof(float));
        if (!p) return NULL;
        kv->scratch = p;
        kv->scratch_cap = floats;
    }
    return kv->scratch;
}

/* Number of leading rows with pos <= qpos (positions ascend within a segment). */
static int64_t visible(const int32_t *pos, int64_t len, int32_t qpos)
{
    int64_t lo = 0, hi = len;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (pos[mid] <= qpos) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Rows [t0, t1) of the keys (or values) doc [0, Lb) ++ output slots [0, ..): a
 * direct pointer when they come from one side, else gathered into tmp (hd floats
 * a row). *ld receives the row stride. */
static const float *key_rows(const float *doc, const float *out, int ostride, int64_t Lb,
                             int64_t t0, int64_t t1, int hd, float *tmp, int *ld)
{
    if (t1 <= Lb) { *ld = hd; return doc + (size_t)t0 * hd; }
    if (t0 >= Lb) { *ld = ostride; return out + (size_t)(t0 - Lb) * ostride; }
    for (int64_t t = t0; t < t1; t++)
        memcpy(tmp + (size_t)(t - t0) * hd, t < Lb ? doc + (size_t)t * hd : out + (size_t)(t - Lb) * ostride,
               sizeof(float) * (size_t)hd);
    *ld = hd;
    return tmp;
}

/* The LongFlow victim for layer l's next write from the per-head terms lf (nkv, B). */
static void choose_victim(kvz_kv *kv, int32_t l, const float *lf)
{
    const int nkv = kv->n_kv_head;
    const int32_t B = kv->out_slots;
    int32_t best = -1;
    float bv = INFINITY;
    const int32_t *OP = kv->opos + (size_t)l * B;
    for (int32_t j = kv->n_sink; j < B; j++) {
        if (j == kv->newest[l]) continue;
        float sj;
        if (kv->out_policy == KVZ_OUT_WINDOW) {
            sj = (float)OP[j]; /* oldest position goes first */
        } else {
            sj = 0.0f;
            for (int h = 0; h < nkv; h++) sj += lf[(size_t)h * B + j];
        }
        if (sj < bv) { bv = sj; best = j; }
    }
    kv->victim[l] = best >= 0 ? best : B - 1;
}

/*
 * Decode attention: one query token at qpos, no probe. Tasks (KV head, chunk of
 * KVZ_ATTN_KCHUNK keys of doc [0, Lb) ++ output slots) run in parallel, each
 * computing its chunk's scores (kvz_attn_scores), their max m_c, the exponentials
 * exp(s - m_c) with their sum l_c, and the weighted value sum O_c (kvz_attn_pv);
 * then per head the chunks merge at the common max M: out = Σ_c e^(m_c-M) O_c /
 * Σ_c e^(m_c-M) l_c (c ascending). Chunks start at fixed key indices of the
 * concatenation and every score depends on its own key only, so a key gives the
 * same result in the document region or in the output buffer (bounded decoding
 * reproduces unbounded decoding bit for bit, DESIGN §5). Scratch: nkv·grp·(W +
 * nch·(hd + 2) + 2) floats of @p work; returns 1 (nothing done) when @p avail is
 * less, and the caller takes the general path. LongFlow terms go to lf (nkv, B).
 */
static int attention_decode(kvz_kv *kv, int32_t l, const float *q, int32_t qpos, float *att, float *work,
                            size_t avail, float *lf, int full_after)
{
    const kvz_config *c = &kv->m->cfg;
    const int hd = c->head_dim, nkv = c->n_kv_head, grp = c->n_head / c->n_kv_head;
    const float scale = 1.0f / sqrtf((float)hd);
    const int32_t B = kv->out_slots, used = B ? kv->out_used[l] : 0;
    const int ostride = nkv * hd;
    int64_t wmax = 0;
    for (int h = 0; h < nkv; h++) {
        const size_t seg = (size_t)l * nkv + (size_t)h;
        const int64_t w = visible(kv->pos + seg * (size_t)kv->cap, kv->len[seg], qpos) + used;
        wmax = w > wmax ? w : wmax;
    }
    const int64_t nch = (wmax + KVZ_ATTN_KCHUNK - 1) / KVZ_ATTN_KCHUNK;
    const size_t need = (size_t)nkv * grp * ((size_t)wmax + (size_t)nch * (hd + 2) + 2);
    if (need > avail) return 1;
    float *S = work;                                        /* (nkv, grp, wmax) */
    float *Mc = S + (size_t)nkv * grp * wmax;               /* (nkv, nch, grp) chunk maxima */
    float *Lc = Mc + (size_t)nkv * nch * grp;               /* (nkv, nch, grp) chunk sums */
    float *Oc = Lc + (size_t)nkv * nch * grp;               /* (nkv, nch, grp, hd) */
    float *Mg = Oc + (size_t)nkv * nch * grp * hd, *Lg = Mg + grp; /* (grp) per head, merge */
    const int isa = kvz_qdot_active_isa();
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < nkv * nch; task++) {
        const int h = (int)(task / nch);
        const int64_t ci = task % nch;
        const size_t seg = (size_t)l * nkv + (size_t)h;
        const float *K = kv->k + seg * (size_t)kv->cap * hd, *V = kv->v + seg * (size_t)kv->cap * hd;
        const int64_t Lb = visible(kv->pos + seg * (size_t)kv->cap, kv->len[seg], qpos), W = Lb + used;
        const float *OK = B ? kv->ok + ((size_t)l * B * nkv + (size_t)h) * hd : NULL;
        const float *OV = B ? kv->ov + ((size_t)l * B * nkv + (size_t)h) * hd : NULL;
        const int32_t *OP = B ? kv->opos + (size_t)l * B : NULL;
        const float *qh = q + (size_t)h * grp * hd;
        float *Sh = S + (size_t)h * grp * wmax, *m = Mc + (size_t)task * grp, *ls = Lc + (size_t)task * grp;
        float *O = Oc + (size_t)task * grp * hd;
        const int64_t t0 = ci * KVZ_ATTN_KCHUNK, t1 = t0 + KVZ_ATTN_KCHUNK < W ? t0 + KVZ_ATTN_KCHUNK : W;
        memset(O, 0, sizeof(float) * (size_t)grp * hd);
        if (t0 >= W) {
            for (int g = 0; g < grp; g++) { m[g] = -INFINITY; ls[g] = 0.0f; }
            continue;
        }
        const int64_t dn = t1 < Lb ? t1 : Lb, o0 = t0 > Lb ? t0 : Lb; /* doc [t0, dn), slots [o0, t1) */
        if (t0 < dn) kvz_attn_scores(isa, qh, grp, hd, K + (size_t)t0 * hd, hd, dn - t0, scale, Sh + t0, wmax);
        if (o0 < t1) {
            kvz_attn_scores(isa, qh, grp, hd, OK + (size_t)(o0 - Lb) * ostride, ostride, t1 - o0, scale, Sh + o0,
                            wmax);
            for (int64_t t = o0; t < t1; t++)
                if (OP[t - Lb] < 0 || OP[t - Lb] > qpos)
                    for (int g = 0; g < grp; g++) Sh[(size_t)g * wmax + t] = -INFINITY;
        }
        for (int g = 0; g < grp; g++) {
            float *row = Sh + (size_t)g * wmax + t0;
            m[g] = kvz_max(row, t1 - t0);
            if (m[g] == -INFINITY) {
                memset(row, 0, sizeof(float) * (size_t)(t1 - t0));
                ls[g] = 0.0f;
            } else {
                ls[g] = kvz_exp_sub_sum(row, t1 - t0, m[g]);
            }
        }
        if (t0 < dn) kvz_attn_pv(isa, Sh + t0, wmax, grp, V + (size_t)t0 * hd, hd, dn - t0, hd, O);
        if (o0 < t1) kvz_attn_pv(isa, Sh + o0, wmax, grp, OV + (size_t)(o0 - Lb) * ostride, ostride, t1 - o0, hd, O);
    }
    for (int h = 0; h < nkv; h++) {
        for (int g = 0; g < grp; g++) {
            float mx = -INFINITY, tot = 0.0f;
            for (int64_t ci = 0; ci < nch; ci++) {
                const float v = Mc[((size_t)h * nch + ci) * grp + g];
                mx = v > mx ? v : mx;
            }
            float *out = att + ((size_t)h * grp + g) * hd;
            memset(out, 0, sizeof(float) * (size_t)hd);
            if (mx != -INFINITY)
                for (int64_t ci = 0; ci < nch; ci++) {
                    const size_t tg = ((size_t)h * nch + ci) * grp + g;
                    const float f = kvz_expf(Mc[tg] - mx);
                    tot += f * Lc[tg];
                    const float *o = Oc + tg * hd;
                    for (int d = 0; d < hd; d++) out[d] += f * o[d];
                }
            const float inv = tot > 0.0f ? 1.0f / tot : 0.0f;
            for (int d = 0; d < hd; d++) out[d] *= inv;
            Mg[g] = mx;
            Lg[g] = inv;
        }
        if (full_after) {
            const size_t seg = (size_t)l * nkv + (size_t)h;
            const int64_t Lb = visible(kv->pos + seg * (size_t)kv->cap, kv->len[seg], qpos);
            const float *OV = kv->ov + ((size_t)l * B * nkv + (size_t)h) * hd;
            for (int32_t j = 0; j < used; j++) {
                const float *vj = OV + (size_t)j * ostride;
                float l1 = 0.0f;
                for (int d = 0; d < hd; d++) l1 += fabsf(vj[d]);
                const int64_t t = Lb + j, ci = t / KVZ_ATTN_KCHUNK;
                float p = 0.0f;
                for (int g = 0; g < grp; g++) {
                    const float mc = Mc[((size_t)h * nch + ci) * grp + g];
                    if (Mg[g] != -INFINITY)
                        p += S[((size_t)h * grp + g) * wmax + t] * kvz_expf(mc - Mg[g]) * Lg[g];
                }
                lf[(size_t)h * B + j] = p * l1;
            }
        }
    }
    return 0;
}

/*
 * Prefill attention without a KVzip probe and without a LongFlow eviction after the
 * pass (the common case: a document, a prompt, a question into the output buffer):
 * tasks (KV head, block of QB query tokens) on kvz_attn_flash, the latest (largest
 * causal) blocks first so that the threads end together. Nothing of size queries x
 * keys is stored, and keys past a block's causal edge are never touched. The keys
 * are document rows [0, Lb) then the output slots, indexed as in attention() below,
 * so a question in the output buffer gives the same bytes as in the document region.
 * Returns 1 (nothing done) when the work buffer is too small for one block a thread.
 */
static int attention_flash(kvz_kv *kv, int32_t l, const float *q, int32_t n, int32_t pos0, float *att,
                           float *work, size_t work_floats)
{
    const kvz_config *c = &kv->m->cfg;
    const int hd = c->head_dim, nkv = c->n_kv_head, grp = c->n_head / c->n_kv_head;
    const int32_t B = kv->out_slots, used = B ? kv->out_used[l] : 0;
    enum { QB_MAX = 128 };
    int qb = 96 / grp;
    qb = qb < 4 ? 4 : qb > QB_MAX ? QB_MAX : qb;
    if (qb > n) qb = n;
    const int nthr = omp_get_max_threads();
    const size_t need = (kvz_attn_flash_work_floats(qb, grp, hd) + 7) / 8 * 8 + 8;
    if (need * (size_t)nthr > work_floats) return 1;
    const int isa = kvz_qdot_active_isa();
    const float scale = 1.0f / sqrtf((float)hd);
    const int64_t nblk = (n + qb - 1) / qb, ldq = (int64_t)c->n_head * hd;
    const int ostride = nkv * hd;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < nkv * nblk; task++) {
        const int h = (int)(task % nkv);
        const int32_t i0 = (int32_t)((nblk - 1 - task / nkv) * qb);
        const int32_t nq = n - i0 < qb ? n - i0 : qb;
        float *w = work + (size_t)omp_get_thread_num() * need;
        w += (8 - ((uintptr_t)w / sizeof(float)) % 8) % 8; /* 32-byte boundary */
        const size_t seg = (size_t)l * nkv + (size_t)h;
        const int32_t *P = kv->pos + seg * (size_t)kv->cap;
        const int64_t len = kv->len[seg];
        kvz_attn_keys keys = {kv->k + seg * (size_t)kv->cap * hd, kv->v + seg * (size_t)kv->cap * hd, hd,
                              visible(P, len, pos0 + i0 + nq - 1), NULL, NULL, ostride, used, NULL};
        if (used) {
            keys.ok = kv->ok + ((size_t)l * B * nkv + (size_t)h) * hd;
            keys.ov = kv->ov + ((size_t)l * B * nkv + (size_t)h) * hd;
            keys.opos = kv->opos + (size_t)l * B;
        }
        int64_t vis[QB_MAX];
        int32_t qpos[QB_MAX];
        for (int32_t i = 0; i < nq; i++) {
            qpos[i] = pos0 + i0 + i;
            vis[i] = visible(P, keys.n, qpos[i]);
        }
        const size_t off = ((size_t)i0 * c->n_head + (size_t)h * grp) * hd;
        kvz_attn_flash(isa, q + off, ldq, nq, grp, hd, &keys, vis, qpos, scale, att + off, ldq, w);
    }
    return 0;
}

/*
 * Attention of n queries q (n, n_head, hd) at positions pos0.. over layer l's
 * cache (document segments + output buffer), output att (n, n_head*hd).
 * Tasks (KV head, query block) run in parallel; each thread owns a slice of work.
 * When the output buffer is full after this pass, the LongFlow victim for the
 * next write is chosen from the last query's probabilities:
 * S_j = sum over query heads of p_j * |v_j|_1, argmin over evictable slots.
 */
static int attention(kvz_kv *kv, int32_t l, const float *q, int32_t n, int32_t pos0,
                     float *att, float *work, size_t work_floats)
{
    const kvz_config *c = &kv->m->cfg;
    const int hd = c->head_dim, nkv = c->n_kv_head, grp = c->n_head / c->n_kv_head;
    const float scale = 1.0f / sqrtf((float)hd);
    const int32_t B = kv->out_slots, used = B ? kv->out_used[l] : 0;
    const int full_after = B && used == B;
    float *lf = work + work_floats - (size_t)nkv * B; /* (nkv, B) per-head LongFlow terms */
    if (n == 1 && !kv->probe.scores &&
        !attention_decode(kv, l, q, pos0, att, work, work_floats - (size_t)nkv * B, lf, full_after)) {
        if (full_after) choose_victim(kv, l, lf);
        return 0;
    }
    if (!kv->probe.scores && !full_after && kvz_flash_on() &&
        !attention_flash(kv, l, q, n, pos0, att, work, work_floats - (size_t)nkv * B))
        return 0;
    const int nthr = omp_get_max_threads();
    const size_t slice = (work_floats - (size_t)nkv * B) / (size_t)nthr;
    int64_t wmax = 0;
    for (int h = 0; h < nkv; h++) {
        const int64_t w = kv->len[(size_t)l * nkv + h] + used;
        wmax = w > wmax ? w : wmax;
    }
    const size_t gather = (size_t)KVZ_ATTN_KCHUNK * hd; /* per-thread key_rows buffer */
    int64_t qb = slice > gather ? (int64_t)((slice - gather) / ((size_t)grp * (size_t)(wmax + 2 * hd))) : 0;
    if (qb < 1) return kvz_error_set(KVZ_ERR_NOMEM, "attention work buffer too small");
    if (qb > n) qb = n;
    const int64_t nblk = (n + qb - 1) / qb;
    const int ostride = nkv * hd;
    const kvz_kv_probe *pr = kv->probe.scores ? &kv->probe : NULL;
    const int64_t pm = pr ? pr->c1 - pr->c0 : 0;
    if (pr) memset(kv->probe_part, 0, sizeof(float) * (size_t)nthr * nkv * (size_t)pm);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < nkv * nblk; task++) {
        const int h = (int)(task / nblk);
        const int32_t i0 = (int32_t)((task % nblk) * qb);
        float *Qb = work + (size_t)omp_get_thread_num() * slice; /* (qb*grp, hd) */
        float *Ob = Qb + (size_t)qb * grp * hd;                    /* (qb*grp, hd) */
        float *G = Ob + (size_t)qb * grp * hd;                     /* (KCHUNK, hd) gather */
        float *S = G + gather;                                     /* (qb*grp, Lb + used) */
        const size_t seg = (size_t)l * nkv + (size_t)h;
        const float *K = kv->k + seg * (size_t)kv->cap * hd, *V = kv->v + seg * (size_t)kv->cap * hd;
        const int32_t *P = kv->pos + seg * (size_t)kv->cap;
        const int64_t len = kv->len[seg];
        const float *OK = B ? kv->ok + ((size_t)l * B * nkv + (size_t)h) * hd : NULL;
        const float *OV = B ? kv->ov + ((size_t)l * B * nkv + (size_t)h) * hd : NULL;
        const int32_t *OP = B ? kv->opos + (size_t)l * B : NULL;
        const int32_t nq = (int32_t)((n - i0) < qb ? (n - i0) : qb), R = nq * grp;
        const int64_t Lb = visible(P, len, pos0 + i0 + nq - 1);
        const int64_t W = Lb + used;
        for (int32_t i = 0; i < nq; i++)
            memcpy(Qb + (size_t)i * grp * hd, q + ((size_t)(i0 + i) * c->n_head + (size_t)h * grp) * hd,
                   sizeof(float) * (size_t)grp * hd);
        for (int64_t t0 = 0; t0 < W; t0 += KVZ_ATTN_KCHUNK) {
            const int64_t t1 = t0 + KVZ_ATTN_KCHUNK < W ? t0 + KVZ_ATTN_KCHUNK : W;
            int ld;
            const float *Kc = key_rows(K, OK, ostride, Lb, t0, t1, hd, G, &ld);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, (int)(t1 - t0), hd, scale, Qb, hd,
                        Kc, ld, 0.0f, S + t0, (int)W);
        }
        for (int32_t i = 0; i < nq; i++) {
            const int32_t qpos = pos0 + i0 + i;
            const int64_t vis = i == nq - 1 ? Lb : visible(P, Lb, qpos);
            for (int g = 0; g < grp; g++) {
                float *row = S + ((size_t)i * grp + g) * (size_t)W;
                for (int64_t j = vis; j < Lb; j++) row[j] = -INFINITY;
                for (int32_t j = 0; j < used; j++)
                    if (OP[j] < 0 || OP[j] > qpos) row[Lb + j] = -INFINITY;
                const float mx = kvz_max(row, W);
                const float sum = kvz_exp_sub_sum(row, W, mx);
                kvz_scale(row, W, 1.0f / sum);
                if (pr && qpos >= pr->q_pos0) { /* subset-normalised probabilities of the scored rows */
                    float sub = 0.0f;
                    for (int64_t j = 0; j < pr->n_prefix && j < vis; j++) sub += row[j];
                    for (int64_t j = pr->c0; j < pr->c1 && j < vis; j++) sub += row[j];
                    for (int64_t j = pr->rep_row0; j < vis; j++) sub += row[j];
                    const float inv = sub > 0.0f ? 1.0f / sub : 0.0f;
                    float *part = kv->probe_part + ((size_t)omp_get_thread_num() * nkv + h) * (size_t)pm;
                    const float *a = row + pr->c0;
                    for (int64_t j = 0; j < pm; j++) {
                        const float v = a[j] * inv;
                        part[j] = v > part[j] ? v : part[j];
                    }
                }
            }
        }
        if (W == 0) memset(Ob, 0, sizeof(float) * (size_t)R * hd);
        for (int64_t t0 = 0; t0 < W; t0 += KVZ_ATTN_KCHUNK) {
            const int64_t t1 = t0 + KVZ_ATTN_KCHUNK < W ? t0 + KVZ_ATTN_KCHUNK : W;
            int ld;
            const float *Vc = key_rows(V, OV, ostride, Lb, t0, t1, hd, G, &ld);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, hd, (int)(t1 - t0), 1.0f,
                        S + t0, (int)W, Vc, ld, t0 ? 1.0f : 0.0f, Ob, hd);
        }
        for (int32_t i = 0; i < nq; i++)
            memcpy(att + ((size_t)(i0 + i) * c->n_head + (size_t)h * grp) * hd, Ob + (size_t)i * grp * hd,
                   sizeof(float) * (size_t)grp * hd);
        if (full_after && i0 + nq == n) {
            /* this head group's LongFlow terms from the last query */
            for (int32_t j = 0; j < used; j++) {
                const float *vj = OV + (size_t)j * ostride;
                float l1 = 0.0f;
                for (int d = 0; d < hd; d++) l1 += fabsf(vj[d]);
                float p = 0.0f;
                for (int g = 0; g < grp; g++) p += S[((size_t)(nq - 1) * grp + g) * W + Lb + j];
                lf[(size_t)h * B + j] = p * l1;
            }
        }
    }
    if (pr) {
        for (int h = 0; h < nkv; h++) {
            float *dst = pr->scores + ((size_t)l * nkv + h) * (size_t)pr->stride + pr->off;
            for (int t = 0; t < nthr; t++) {
                const float *src = kv->probe_part + ((size_t)t * nkv + h) * (size_t)pm;
                for (int64_t j = 0; j < pm; j++) dst[j] = src[j] > dst[j] ? src[j] : dst[j];
            }
        }
    }
    if (full_after) choose_victim(kv, l, lf);
    return 0;
}

/*
 * Attention of a segmented pass (kvz_kv_set_segments): the n new rows of every head
 * are segments one after another; query u of segment s attends to the rows the head
 * held before the pass ("shared", e.g. the system prefix) and to rows 0..u of its own
 * segment, never to another segment's. Tasks (KV head, segment) run in parallel, each
 * walking its segment's queries in blocks; the keys of a block are the shared rows
 * followed by the segment's rows (gathered by key_rows as "doc ++ out"). A segment's
 * probe is written by its own task only, so it needs no per-thread maxima.
 */
static int attention_segs(kvz_kv *kv, int32_t l, const float *q, int32_t n, float *att, float *work,
                          size_t work_floats)
{
    const kvz_config *c = &kv->m->cfg;
    const int hd = c->head_dim, nkv = c->n_kv_head, grp = c->n_head / c->n_kv_head;
    const float scale = 1.0f / sqrtf((float)hd);
    const int nthr = omp_get_max_threads();
    const size_t slice = work_floats / (size_t)nthr;
    const size_t gather = (size_t)KVZ_ATTN_KCHUNK * hd;
    const int32_t ns = kv->n_segs;
    int32_t nmax = 0;
    int64_t shared_max = 0;
    for (int32_t s = 0; s < ns; s++) nmax = kv->segs[s].n > nmax ? kv->segs[s].n : nmax;
    for (int h = 0; h < nkv; h++) {
        const int64_t sh = kv->len[(size_t)l * nkv + h] - n;
        shared_max = sh > shared_max ? sh : shared_max;
    }
    const int64_t wmax = shared_max + nmax;
    int64_t qb = slice > gather ? (int64_t)((slice - gather) / ((size_t)grp * (size_t)(wmax + 2 * hd))) : 0;
    if (qb < 1) return kvz_error_set(KVZ_ERR_NOMEM, "attention work buffer too small");
    if (qb > nmax) qb = nmax;
    int32_t *r0 = malloc(sizeof(int32_t) * (size_t)ns); /* first pass row of each segment */
    if (!r0) return kvz_error_set(KVZ_ERR_NOMEM, "attention segments");
    for (int32_t s = 0, r = 0; s < ns; r += kv->segs[s].n, s++) r0[s] = r;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < (int64_t)nkv * ns; task++) {
        const int h = (int)(task / ns);
        const int32_t s = (int32_t)(task % ns);
        const kvz_kv_seg *sg = &kv->segs[s];
        float *Qb = work + (size_t)omp_get_thread_num() * slice; /* (qb*grp, hd) */
        float *Ob = Qb + (size_t)qb * grp * hd;                    /* (qb*grp, hd) */
        float *G = Ob + (size_t)qb * grp * hd;                     /* (KCHUNK, hd) gather */
        float *S = G + gather;                                     /* (qb*grp, shared + i0 + nq) */
        const size_t seg = (size_t)l * nkv + (size_t)h;
        const float *K = kv->k + seg * (size_t)kv->cap * hd, *V = kv->v + seg * (size_t)kv->cap * hd;
        const int64_t sh = kv->len[seg] - n;                        /* rows before the pass */
        const float *SK = K + (size_t)(sh + r0[s]) * hd, *SV = V + (size_t)(sh + r0[s]) * hd;
        const int64_t pre = kv->seg_prefix < sh ? kv->seg_prefix : sh; /* probe subset rows */
        float *dst = sg->scores ? sg->scores + seg * (size_t)sg->n_score : NULL;
        for (int32_t i0 = 0; i0 < sg->n; i0 += (int32_t)qb) {
            const int32_t nq = (int32_t)(sg->n - i0 < qb ? sg->n - i0 : qb), R = nq * grp;
            const int64_t W = sh + i0 + nq;
            for (int32_t i = 0; i < nq; i++)
                memcpy(Qb + (size_t)i * grp * hd,
                       q + ((size_t)(r0[s] + i0 + i) * c->n_head + (size_t)h * grp) * hd,
                       sizeof(float) * (size_t)grp * hd);
            for (int64_t t0 = 0; t0 < W; t0 += KVZ_ATTN_KCHUNK) {
                const int64_t t1 = t0 + KVZ_ATTN_KCHUNK < W ? t0 + KVZ_ATTN_KCHUNK : W;
                int ld;
                const float *Kc = key_rows(K, SK, hd, sh, t0, t1, hd, G, &ld);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, (int)(t1 - t0), hd, scale, Qb, hd,
                            Kc, ld, 0.0f, S + t0, (int)W);
            }
            for (int32_t i = 0; i < nq; i++) {
                const int32_t u = i0 + i;          /* the query's index in its segment */
                const int64_t vis = sh + u + 1;    /* shared rows + own rows 0..u */
                for (int g = 0; g < grp; g++) {
                    float *row = S + ((size_t)i * grp + g) * (size_t)W;
                    for (int64_t j = vis; j < W; j++) row[j] = -INFINITY;
                    const float mx = kvz_max(row, W);
                    const float sum = kvz_exp_sub_sum(row, W, mx);
                    kvz_scale(row, W, 1.0f / sum);
                    if (dst && u >= sg->n_score) { /* subset: probe prefix ∪ own visible rows */
                        float sub = 0.0f;
                        for (int64_t j = 0; j < pre; j++) sub += row[j];
                        for (int64_t j = sh; j < vis; j++) sub += row[j];
                        const float inv = sub > 0.0f ? 1.0f / sub : 0.0f;
                        const float *a = row + sh;
                        for (int32_t j = 0; j < sg->n_score; j++) {
                            const float v = a[j] * inv;
                            dst[j] = v > dst[j] ? v : dst[j];
                        }
                    }
                }
            }
            for (int64_t t0 = 0; t0 < W; t0 += KVZ_ATTN_KCHUNK) {
                const int64_t t1 = t0 + KVZ_ATTN_KCHUNK < W ? t0 + KVZ_ATTN_KCHUNK : W;
                int ld;
                const float *Vc = key_rows(V, SV, hd, sh, t0, t1, hd, G, &ld);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, hd, (int)(t1 - t0), 1.0f,
                            S + t0, (int)W, Vc, ld, t0 ? 1.0f : 0.0f, Ob, hd);
            }
            for (int32_t i = 0; i < nq; i++)
                memcpy(att + ((size_t)(r0[s] + i0 + i) * c->n_head + (size_t)h * grp) * hd,
                       Ob + (size_t)i * grp * hd, sizeof(float) * (size_t)grp * hd);
        }
    }
    free(r0);
    return 0;
}

static void append_kv(kvz_kv *kv, int32_t l, const float *k, const float *v, int32_t n,
                      int32_t pos0, const int32_t *tpos, int to_doc)
{
    const int hd = kv->head_dim, nkv = kv->n_kv_head;
    if (kv->out_slots == 0 || to_doc) {
        for (int h = 0; h < nkv; h++) {
            const size_t seg = (size_t)l * nkv + (size_t)h;
            const size_t row0 = seg * (size_t)kv->cap + (size_t)kv->len[seg];
            for (int32_t i = 0; i < n; i++) {
                memcpy(kv->k + (row0 + i) * hd, k + ((size_t)i * nkv + h) * hd, sizeof(float) * hd);
                memcpy(kv->v + (row0 + i) * hd, v + ((size_t)i * nkv + h) * hd, sizeof(float) * hd);
                kv->pos[row0 + i] = tpos ? tpos[i] : pos0 + i;
            }
            kv->len[seg] += n;
        }
        return;
    }
    const int32_t B = kv->out_slots;
    for (int32_t i = 0; i < n; i++) {
        int32_t slot;
        if (kv->out_used[l] < B) {
            slot = kv->out_used[l]++;
        } else {
            slot = kv->victim[l];
            kv->evictions++;
        }
        const size_t base = ((size_t)l * B + (size_t)slot) * nkv * hd;
        memcpy(kv->ok + base, k + (size_t)i * nkv * hd, sizeof(float) * nkv * hd);
        memcpy(kv->ov + base, v + (size_t)i * nkv * hd, sizeof(float) * nkv * hd);
        kv->opos[(size_t)l * B + slot] = tpos ? tpos[i] : pos0 + i;
        kv->newest[l] = slot;
    }
}

/* KVZ_ERR_CONTEXT unless n more tokens fit: the document region (no output buffer,
 * or to_doc) has room for them, or a multi-token pass fits the free output slots. */
static int check_room(const kvz_kv *kv, int32_t n, int to_doc)
{
    if (kv->out_slots == 0 || to_doc) {
        for (size_t i = 0; i < (size_t)kv->n_layer * kv->n_kv_head; i++)
            if (kv->len[i] + n > kv->cap)
                return kvz_error_set(KVZ_ERR_CONTEXT, "KV cache full: %lld + %d rows exceed "
                                     "capacity %lld", (long long)kv->len[i], n, (long long)kv->cap);
    } else if (n > 1 && kv->out_used[0] + n > kv->out_slots) {
        return kvz_error_set(KVZ_ERR_CONTEXT, "%d tokens do not fit the output buffer (%d of %d "
                             "slots used); a multi-token pass must fit in the free slots",
                             n, kv->out_used[0], kv->out_slots);
    }
    return 0;
}

/* @p tpos: (n) the tokens' positions in a segmented pass, or NULL: pos0 + i */
static int forward_batch(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n,
                         int32_t pos0, const int32_t *tpos, float *logits, int want_logits, int to_doc,
                         const kvz_layer_hook *hook)
{
    const kvz_config *c = &m->cfg;
    const int d = c->n_embd, hd = c->head_dim, qd = c->n_head * hd, kvd = c->n_kv_head * hd,
              ff = c->n_ff, nqkv = qd + 2 * kvd;
    const int room = check_room(kv, n, to_doc); /* before touching any layer */
    if (room) return room;
    int64_t max_keys = 0;
    for (size_t i = 0; i < (size_t)c->n_layer * c->n_kv_head; i++)
        max_keys = kv->len[i] > max_keys ? kv->len[i] : max_keys;
    max_keys += n + kv->out_slots;
    const size_t act = (size_t)n * ((size_t)2 * d + 2 * (size_t)nqkv + qd + 3 * (size_t)ff);
    size_t attn_work = (size_t)KVZ_ATTN_BLOCK_FLOATS;
    const size_t min_work = ((size_t)(c->n_head / c->n_kv_head) * ((size_t)max_keys + 2 * hd + 2) + 64 +
                             (size_t)KVZ_ATTN_KCHUNK * hd) *
                                (size_t)omp_get_max_threads();
    if (attn_work < min_work) attn_work = min_work;
    /* the linear layers use the attention scratch while attention is not running */
    const int lin_in = ff > qd ? (ff > d ? ff : d) : (qd > d ? qd : d);
    const size_t lin_work = linear_work_floats(n, lin_in, omp_get_max_threads());
    if (attn_work < lin_work) attn_work = lin_work;
    /* LongFlow terms (n_kv_head, B) go on top, so that the query blocking (and with
     * it the summation order) does not depend on B */
    attn_work += (size_t)kv->out_slots * c->n_kv_head;
    float *buf = scratch(kv, act + attn_work);
    if (!buf) return kvz_error_set(KVZ_ERR_NOMEM, "forward: cannot allocate work memory");
    float *x = buf;                               /* (n, d) residual stream */
    float *xn = x + (size_t)n * d;                /* (n, d) normed */
    float *qkv = xn + (size_t)n * d;              /* (n, nqkv) */
    float *att = qkv + (size_t)n * nqkv;          /* (n, qd) */
    float *gu = att + (size_t)n * qd;             /* (n, 2ff) */
    float *hb = gu + (size_t)n * 2 * ff;          /* (n, ff) */
    float *qb = hb + (size_t)n * ff;              /* (n, qd) post-RoPE queries */
    float *kb = qb + (size_t)n * qd;              /* (n, kvd) post-RoPE keys */
    float *vb = kb + (size_t)n * kvd;             /* (n, kvd) values */
    float *work = vb + (size_t)n * kvd;           /* attention scratch */

    for (int32_t i = 0; i < n; i++) {
        const uint8_t *row = (const uint8_t *)m->m_tok.data + (size_t)tokens[i] * m->m_tok.row_bytes;
        if (m->m_tok.type == KVZ_TYPE_F32) memcpy(x + (size_t)i * d, row, sizeof(float) * d);
        else kvz_dequantize(m->m_tok.type, row, x + (size_t)i * d, d);
    }

    for (int32_t l = 0; l < c->n_layer; l++) {
        const kvz_layer_w *L = &m->layers[l];
        rmsnorm(xn, x, L->attn_norm, n, d, c->norm_eps);
        linear(L->mqkv, L->n_mqkv, xn, n, d, qkv, nqkv, 0.0f, work);
        /* split (n, [q|k|v]) into contiguous q (n, qd), k (n, kvd), v (n, kvd) */
        for (int32_t i = 0; i < n; i++) {
            const float *r = qkv + (size_t)i * nqkv;
            float *qi = qb + (size_t)i * qd, *ki = kb + (size_t)i * kvd, *vi = vb + (size_t)i * kvd;
            memcpy(qi, r, sizeof(float) * qd);
            memcpy(ki, r + qd, sizeof(float) * kvd);
            memcpy(vi, r + qd + kvd, sizeof(float) * kvd);
            if (L->bqkv) {
                for (int j = 0; j < qd; j++) qi[j] += L->bqkv[j];
                for (int j = 0; j < kvd; j++) ki[j] += L->bqkv[qd + j];
                for (int j = 0; j < kvd; j++) vi[j] += L->bqkv[qd + kvd + j];
            }
            if (L->q_norm) {
                rmsnorm(qi, qi, L->q_norm, c->n_head, hd, c->norm_eps);
                rmsnorm(ki, ki, L->k_norm, c->n_kv_head, hd, c->norm_eps);
            }
            const int32_t p = tpos ? tpos[i] : pos0 + i;
            rope(qi, c->n_head, hd, p, m->rope_inv_freq, c->rope_adjacent);
            rope(ki, c->n_kv_head, hd, p, m->rope_inv_freq, c->rope_adjacent);
        }
        const int64_t row0 = kv->len[(size_t)l * c->n_kv_head];
        append_kv(kv, l, kb, vb, n, pos0, tpos, to_doc);
        if (hook && hook->fn) {
            int rc = hook->fn(hook->ctx, l, qb, kb, n, row0, kv);
            if (rc) return rc;
        }
        int rc = tpos ? attention_segs(kv, l, qb, n, att, work, attn_work)
                      : attention(kv, l, qb, n, pos0, att, work, attn_work);
        if (rc) return rc;
        linear(&L->mo, 1, att, n, qd, x, d, 1.0f, work);
        rmsnorm(xn, x, L->ffn_norm, n, d, c->norm_eps);
        linear(L->mgu, L->n_mgu, xn, n, d, gu, 2 * ff, 0.0f, work);
        for (int32_t i = 0; i < n; i++) {
            const float *g = gu + (size_t)i * 2 * ff;
            kvz_swiglu(hb + (size_t)i * ff, g, g + ff, ff);
        }
        linear(&L->mdown, 1, hb, n, ff, x, d, 1.0f, work);
    }
    if (want_logits == KVZ_FWD_NO_LOGITS || !logits) return 0;
    const int32_t first = want_logits == KVZ_FWD_LOGITS_ALL ? 0 : n - 1;
    const int32_t rows = n - first;
    rmsnorm(xn, x + (size_t)first * d, m->out_norm, rows, d, c->norm_eps);
    linear(&m->m_out, 1, xn, rows, d, logits, c->n_vocab, 0.0f, work);
    return 0;
}

int kvz_cpu_forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                    float *logits, int flags, const kvz_layer_hook *hook)
{
    if (omp_get_max_threads() != m->n_threads) omp_set_num_threads(m->n_threads);
    const int want = flags & 3;
    const int discard = (flags & KVZ_FWD_DISCARD) != 0;
    if (discard && kv->out_slots && !(flags & KVZ_FWD_TO_DOC))
        return kvz_error_set(KVZ_ERR_ARG, "forward: DISCARD works on the document region only");
    /* the whole pass, not only its first internal batch: a refused pass changes nothing */
    int rc = check_room(kv, n, (flags & KVZ_FWD_TO_DOC) != 0);
    if (rc) return rc;
    int32_t *tpos = NULL; /* a segmented pass: positions restart at pos0 in every segment */
    if (kv->n_segs) {
        int64_t sum = 0;
        for (int32_t s = 0; s < kv->n_segs; s++) sum += kv->segs[s].n;
        if (sum != n || n > KVZ_CPU_MAX_BATCH || kv->probe.scores || kv->out_slots)
            return kvz_error_set(KVZ_ERR_ARG, "forward: a segmented pass needs exactly its %lld tokens "
                                 "(got %d), at most %d, no probe and no output buffer", (long long)sum, n,
                                 KVZ_CPU_MAX_BATCH);
        if (!(tpos = malloc(sizeof(int32_t) * (size_t)n))) return KVZ_ERR_NOMEM;
        for (int32_t s = 0, i = 0; s < kv->n_segs; s++)
            for (int32_t u = 0; u < kv->segs[s].n; u++) tpos[i++] = pos0 + u;
    }
    const size_t nlh = (size_t)m->cfg.n_layer * m->cfg.n_kv_head;
    int64_t *saved = NULL;
    if (discard) {
        if (!(saved = malloc(nlh * sizeof *saved))) {
            free(tpos);
            return KVZ_ERR_NOMEM;
        }
        memcpy(saved, kv->len, nlh * sizeof *saved);
    }
    for (int32_t s = 0; s < n && !rc; s += KVZ_CPU_MAX_BATCH) {
        const int32_t nb = n - s < KVZ_CPU_MAX_BATCH ? n - s : KVZ_CPU_MAX_BATCH;
        const int last = s + nb == n;
        float *lg = NULL;
        int w = KVZ_FWD_NO_LOGITS;
        if (logits && want == KVZ_FWD_LOGITS_ALL) {
            lg = logits + (size_t)s * m->cfg.n_vocab;
            w = KVZ_FWD_LOGITS_ALL;
        } else if (logits && want == KVZ_FWD_LOGITS_LAST && last) {
            lg = logits;
            w = KVZ_FWD_LOGITS_LAST;
        }
        rc = forward_batch(m, kv, tokens + s, nb, pos0 + s, tpos, lg, w, (flags & KVZ_FWD_TO_DOC) != 0, hook);
    }
    free(tpos);
    if (discard) {
        memcpy(kv->len, saved, nlh * sizeof *saved);
        free(saved);
    }
    return rc;
}
