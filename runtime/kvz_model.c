/* Model loading (GGUF or synthetic), configuration and the KV cache. */
#include "kvz_model_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "kvz_error.h"
#include "kvz_qdot.h"
#include "kvz_quant.h"

/* ======================================================================== */
/* configuration                                                             */

static int get_i32(const kvz_gguf *g, const char *arch, const char *suffix, int32_t *out,
                   int required)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int64_t v;
    int rc = kvz_gguf_get_i64(g, key, &v);
    if (rc == KVZ_ERR_NOTFOUND && !required) return 0;
    if (rc) return kvz_error_set(rc, "GGUF metadata key %s: %s", key, kvz_strerror(rc));
    if (v <= 0 || v > (1 << 30))
        return kvz_error_set(KVZ_ERR_FORMAT, "GGUF metadata key %s = %lld is out of range",
                             key, (long long)v);
    *out = (int32_t)v;
    return 0;
}

static int config_from_gguf(const kvz_gguf *g, kvz_config *c)
{
    kvz_str s;
    int rc = kvz_gguf_get_str(g, "general.architecture", &s);
    if (rc) return kvz_error_set(rc, "GGUF has no general.architecture");
    char arch[32];
    snprintf(arch, sizeof arch, "%.*s", (int)(s.len < 31 ? s.len : 31), s.ptr);
    memset(c, 0, sizeof *c);
    if (!strcmp(arch, "llama")) c->arch = KVZ_ARCH_LLAMA;
    else if (!strcmp(arch, "qwen2")) c->arch = KVZ_ARCH_QWEN2;
    else if (!strcmp(arch, "qwen3")) c->arch = KVZ_ARCH_QWEN3;
    else return kvz_error_set(KVZ_ERR_UNSUPPORTED, "architecture '%s' is not supported "
                              "(llama, qwen2, qwen3)", arch);
    if ((rc = get_i32(g, arch, "block_count", &c->n_layer, 1)) ||
        (rc = get_i32(g, arch, "embedding_length", &c->n_embd, 1)) ||
        (rc = get_i32(g, arch, "feed_forward_length", &c->n_ff, 1)) ||
        (rc = get_i32(g, arch, "attention.head_count", &c->n_head, 1)) ||
        (rc = get_i32(g, arch, "context_length", &c->n_ctx, 1)))
        return rc;
    c->n_kv_head = c->n_head;
    if ((rc = get_i32(g, arch, "attention.head_count_kv", &c->n_kv_head, 0))) return rc;
    c->head_dim = c->n_embd / c->n_head;
    if ((rc = get_i32(g, arch, "attention.key_length", &c->head_dim, 0))) return rc;
    char key[128];
    snprintf(key, sizeof key, "%s.rope.freq_base", arch);
    c->rope_theta = 10000.0f;
    if (kvz_gguf_find(g, key) && (rc = kvz_gguf_get_f32(g, key, &c->rope_theta))) return rc;
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", arch);
    c->norm_eps = 1e-5f;
    if (kvz_gguf_find(g, key) && (rc = kvz_gguf_get_f32(g, key, &c->norm_eps))) return rc;
    uint32_t et;
    uint64_t nv;
    const void *d;
    if ((rc = kvz_gguf_get_array(g, "tokenizer.ggml.tokens", &et, &nv, &d)))
        return kvz_error_set(rc, "GGUF has no tokenizer.ggml.tokens");
    c->n_vocab = (int32_t)nv;
    c->rope_adjacent = c->arch == KVZ_ARCH_LLAMA;
    c->qkv_bias = c->arch == KVZ_ARCH_QWEN2;
    c->qk_norm = c->arch == KVZ_ARCH_QWEN3;
    c->tied_embd = kvz_gguf_find_tensor(g, "output.weight") == NULL;
    if (kvz_gguf_get_str(g, "general.name", &s) == 0)
        snprintf(c->name, sizeof c->name, "%.*s", (int)(s.len < 63 ? s.len : 63), s.ptr);
    else
        snprintf(c->name, sizeof c->name, "%s", arch);
    if (c->n_head % c->n_kv_head || c->head_dim % 2 || c->head_dim > 256)
        return kvz_error_set(KVZ_ERR_FORMAT, "inconsistent head configuration (%d heads, "
                             "%d kv heads, head_dim %d)", c->n_head, c->n_kv_head, c->head_dim);
    return 0;
}

/* ======================================================================== */
/* weights                                                                   */

static uint64_t phys_mem_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 0;
}

static float *alloc_f32(kvz_model *m, int64_t n)
{
    float *p = malloc((size_t)n * sizeof(float));
    if (p) m->weight_bytes += (uint64_t)n * sizeof(float);
    return p;
}

/* Dequantize tensor @p name of shape (rows, cols) [cols contiguous] into dst. */
static int load_tensor(const kvz_gguf *g, const char *name, int64_t cols, int64_t rows,
                       float *dst, int optional)
{
    const kvz_gguf_tensor *t = kvz_gguf_find_tensor(g, name);
    if (!t) {
        if (optional) return 1;
        return kvz_error_set(KVZ_ERR_NOTFOUND, "tensor %s is missing", name);
    }
    int64_t ne1 = 1;
    for (uint32_t i = 1; i < t->n_dims; i++) ne1 *= t->ne[i];
    if (t->ne[0] != cols || ne1 != rows)
        return kvz_error_set(KVZ_ERR_FORMAT, "tensor %s has shape [%lld, %lld], expected "
                             "[%lld, %lld]", name, (long long)t->ne[0], (long long)ne1,
                             (long long)cols, (long long)rows);
    if (!kvz_type_supported(t->type))
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "tensor %s has unsupported type %s", name,
                             kvz_type_name(t->type));
    int rc = kvz_dequantize(t->type, t->data, dst, cols * rows);
    if (rc) return kvz_error_set(rc, "tensor %s: cannot dequantize", name);
    return 0;
}

static int load_weights_gguf(kvz_model *m)
{
    const kvz_config *c = &m->cfg;
    const kvz_gguf *g = m->gguf;
    const int64_t d = c->n_embd, qd = (int64_t)c->n_head * c->head_dim,
                  kvd = (int64_t)c->n_kv_head * c->head_dim, ff = c->n_ff;
    int rc;
    if (!(m->tok_embd = alloc_f32(m, (int64_t)c->n_vocab * d)) || !(m->out_norm = alloc_f32(m, d)))
        return KVZ_ERR_NOMEM;
    if ((rc = load_tensor(g, "token_embd.weight", d, c->n_vocab, m->tok_embd, 0)) ||
        (rc = load_tensor(g, "output_norm.weight", d, 1, m->out_norm, 0)))
        return rc;
    if (c->tied_embd) {
        m->output = m->tok_embd;
    } else {
        if (!(m->output = alloc_f32(m, (int64_t)c->n_vocab * d))) return KVZ_ERR_NOMEM;
        if ((rc = load_tensor(g, "output.weight", d, c->n_vocab, m->output, 0))) return rc;
    }
    /* llama3-style per-frequency scaling, when present */
    const kvz_gguf_tensor *rf = kvz_gguf_find_tensor(g, "rope_freqs.weight");
    if (rf) {
        float tmp[128];
        if (rf->ne[0] != c->head_dim / 2 || c->head_dim / 2 > 128)
            return kvz_error_set(KVZ_ERR_FORMAT, "rope_freqs.weight has a wrong shape");
        if ((rc = load_tensor(g, "rope_freqs.weight", c->head_dim / 2, 1, tmp, 0))) return rc;
        for (int j = 0; j < c->head_dim / 2; j++) m->rope_inv_freq[j] /= tmp[j];
    }
    char nm[96];
    for (int32_t l = 0; l < c->n_layer; l++) {
        kvz_layer_w *L = &m->layers[l];
        if (!(L->attn_norm = alloc_f32(m, d)) || !(L->wqkv = alloc_f32(m, (qd + 2 * kvd) * d)) ||
            !(L->wo = alloc_f32(m, d * qd)) || !(L->ffn_norm = alloc_f32(m, d)) ||
            !(L->wgu = alloc_f32(m, 2 * ff * d)) || !(L->wdown = alloc_f32(m, d * ff)))
            return KVZ_ERR_NOMEM;
#define LT(suffix, cols, rows, dst)                                             \
    do {                                                                        \
        snprintf(nm, sizeof nm, "blk.%d.%s", (int)l, suffix);                   \
        if ((rc = load_tensor(g, nm, cols, rows, dst, 0))) return rc;           \
    } while (0)
        LT("attn_norm.weight", d, 1, L->attn_norm);
        LT("attn_q.weight", d, qd, L->wqkv);
        LT("attn_k.weight", d, kvd, L->wqkv + qd * d);
        LT("attn_v.weight", d, kvd, L->wqkv + (qd + kvd) * d);
        LT("attn_output.weight", qd, d, L->wo);
        LT("ffn_norm.weight", d, 1, L->ffn_norm);
        LT("ffn_gate.weight", d, ff, L->wgu);
        LT("ffn_up.weight", d, ff, L->wgu + ff * d);
        LT("ffn_down.weight", ff, d, L->wdown);
        if (c->qkv_bias) {
            if (!(L->bqkv = alloc_f32(m, qd + 2 * kvd))) return KVZ_ERR_NOMEM;
            LT("attn_q.bias", qd, 1, L->bqkv);
            LT("attn_k.bias", kvd, 1, L->bqkv + qd);
            LT("attn_v.bias", kvd, 1, L->bqkv + qd + kvd);
        }
        if (c->qk_norm) {
            if (!(L->q_norm = alloc_f32(m, c->head_dim)) || !(L->k_norm = alloc_f32(m, c->head_dim)))
                return KVZ_ERR_NOMEM;
            LT("attn_q_norm.weight", c->head_dim, 1, L->q_norm);
            LT("attn_k_norm.weight", c->head_dim, 1, L->k_norm);
        }
#undef LT
    }
    return 0;
}

/* ---- CPU backend on quantized weights: views into the mmap'd GGUF ---------- */

/* Tensor @p name (rows, cols) as a kvz_wmat: a view of the file's blocks when
 * kvz_qdot reads its type (or it is F32), else an fp32 copy owned by the model. */
static int load_wmat(kvz_model *m, const char *name, int64_t cols, int64_t rows, kvz_wmat *w)
{
    const kvz_gguf_tensor *t = kvz_gguf_find_tensor(m->gguf, name);
    if (!t) return kvz_error_set(KVZ_ERR_NOTFOUND, "tensor %s is missing", name);
    int64_t ne1 = 1;
    for (uint32_t i = 1; i < t->n_dims; i++) ne1 *= t->ne[i];
    if (t->ne[0] != cols || ne1 != rows)
        return kvz_error_set(KVZ_ERR_FORMAT, "tensor %s has shape [%lld, %lld], expected "
                             "[%lld, %lld]", name, (long long)t->ne[0], (long long)ne1,
                             (long long)cols, (long long)rows);
    if (!kvz_type_supported(t->type))
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "tensor %s has unsupported type %s", name,
                             kvz_type_name(t->type));
    w->rows = (int32_t)rows;
    w->cols = (int32_t)cols;
    if (t->type == KVZ_TYPE_F32 || (kvz_qdot_supported(t->type) && cols % 32 == 0)) {
        w->data = t->data;
        w->type = t->type;
        w->row_bytes = (size_t)kvz_type_nbytes(t->type, cols);
        m->weight_bytes += (uint64_t)w->row_bytes * (uint64_t)rows;
        return 0;
    }
    void **o = realloc(m->owned, sizeof *o * (size_t)(m->n_owned + 1));
    if (!o) return KVZ_ERR_NOMEM;
    m->owned = o;
    float *f = alloc_f32(m, cols * rows);
    if (!f) return KVZ_ERR_NOMEM;
    m->owned[m->n_owned++] = f;
    int rc = kvz_dequantize(t->type, t->data, f, cols * rows);
    if (rc) return kvz_error_set(rc, "tensor %s: cannot dequantize", name);
    w->data = f;
    w->type = KVZ_TYPE_F32;
    w->row_bytes = sizeof(float) * (size_t)cols;
    return 0;
}

static int load_weights_quant(kvz_model *m)
{
    const kvz_config *c = &m->cfg;
    const int64_t d = c->n_embd, qd = (int64_t)c->n_head * c->head_dim,
                  kvd = (int64_t)c->n_kv_head * c->head_dim, ff = c->n_ff;
    int rc;
    m->quant_cpu = 1;
    if (!(m->out_norm = alloc_f32(m, d))) return KVZ_ERR_NOMEM;
    if ((rc = load_wmat(m, "token_embd.weight", d, c->n_vocab, &m->m_tok)) ||
        (rc = load_tensor(m->gguf, "output_norm.weight", d, 1, m->out_norm, 0)))
        return rc;
    if (c->tied_embd) m->m_out = m->m_tok;
    else if ((rc = load_wmat(m, "output.weight", d, c->n_vocab, &m->m_out))) return rc;
    const kvz_gguf_tensor *rf = kvz_gguf_find_tensor(m->gguf, "rope_freqs.weight");
    if (rf) {
        float tmp[128];
        if (rf->ne[0] != c->head_dim / 2 || c->head_dim / 2 > 128)
            return kvz_error_set(KVZ_ERR_FORMAT, "rope_freqs.weight has a wrong shape");
        if ((rc = load_tensor(m->gguf, "rope_freqs.weight", c->head_dim / 2, 1, tmp, 0))) return rc;
        for (int j = 0; j < c->head_dim / 2; j++) m->rope_inv_freq[j] /= tmp[j];
    }
    char nm[96];
    for (int32_t l = 0; l < c->n_layer; l++) {
        kvz_layer_w *L = &m->layers[l];
        if (!(L->attn_norm = alloc_f32(m, d)) || !(L->ffn_norm = alloc_f32(m, d))) return KVZ_ERR_NOMEM;
#define LW(suffix, cols, rows, dst)                                             \
    do {                                                                        \
        snprintf(nm, sizeof nm, "blk.%d.%s", (int)l, suffix);                   \
        if ((rc = load_wmat(m, nm, cols, rows, dst))) return rc;                \
    } while (0)
#define LT(suffix, cols, rows, dst)                                             \
    do {                                                                        \
        snprintf(nm, sizeof nm, "blk.%d.%s", (int)l, suffix);                   \
        if ((rc = load_tensor(m->gguf, nm, cols, rows, dst, 0))) return rc;     \
    } while (0)
        LT("attn_norm.weight", d, 1, L->attn_norm);
        LT("ffn_norm.weight", d, 1, L->ffn_norm);
        LW("attn_q.weight", d, qd, &L->mqkv[0]);
        LW("attn_k.weight", d, kvd, &L->mqkv[1]);
        LW("attn_v.weight", d, kvd, &L->mqkv[2]);
        L->n_mqkv = 3;
        LW("attn_output.weight", qd, d, &L->mo);
        LW("ffn_gate.weight", d, ff, &L->mgu[0]);
        LW("ffn_up.weight", d, ff, &L->mgu[1]);
        L->n_mgu = 2;
        LW("ffn_down.weight", ff, d, &L->mdown);
        if (c->qkv_bias) {
            if (!(L->bqkv = alloc_f32(m, qd + 2 * kvd))) return KVZ_ERR_NOMEM;
            LT("attn_q.bias", qd, 1, L->bqkv);
            LT("attn_k.bias", kvd, 1, L->bqkv + qd);
            LT("attn_v.bias", kvd, 1, L->bqkv + qd + kvd);
        }
        if (c->qk_norm) {
            if (!(L->q_norm = alloc_f32(m, c->head_dim)) || !(L->k_norm = alloc_f32(m, c->head_dim)))
                return KVZ_ERR_NOMEM;
            LT("attn_q_norm.weight", c->head_dim, 1, L->q_norm);
            LT("attn_k_norm.weight", c->head_dim, 1, L->k_norm);
        }
#undef LW
#undef LT
    }
    return 0;
}

/* CPU backend on fp32 host weights: kvz_wmat views of the arrays. */
static kvz_wmat f32_view(const float *p, int64_t rows, int64_t cols)
{
    kvz_wmat w = {p, KVZ_TYPE_F32, (int32_t)rows, (int32_t)cols, sizeof(float) * (size_t)cols};
    return w;
}

static void wire_f32(kvz_model *m)
{
    const kvz_config *c = &m->cfg;
    const int64_t d = c->n_embd, qd = (int64_t)c->n_head * c->head_dim,
                  kvd = (int64_t)c->n_kv_head * c->head_dim, ff = c->n_ff;
    m->m_tok = f32_view(m->tok_embd, c->n_vocab, d);
    m->m_out = f32_view(m->output, c->n_vocab, d);
    for (int32_t l = 0; l < c->n_layer; l++) {
        kvz_layer_w *L = &m->layers[l];
        L->mqkv[0] = f32_view(L->wqkv, qd + 2 * kvd, d);
        L->n_mqkv = 1;
        L->mo = f32_view(L->wo, d, qd);
        L->mgu[0] = f32_view(L->wgu, 2 * ff, d);
        L->n_mgu = 1;
        L->mdown = f32_view(L->wdown, d, ff);
    }
}

/* ---- synthetic weights: counter-based, bf16-exact, identical on every backend */

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi), rounded to bf16. Tensor @p tid, element @p i.
 * The affine map runs in double: (hi-lo)·u is exact there, so the result does not
 * depend on whether a compiler contracts it into an FMA. The CUDA backend
 * (runtime/cuda/kvz_cuda_weights.cu, synth_kernel) reproduces this bit for bit. */
static void synth_fill(float *dst, int64_t n, uint64_t seed, uint64_t tid, float lo, float hi)
{
    const uint64_t base = mix64(seed ^ mix64(tid + 0x9e3779b97f4a7c15ULL));
    const double span = (double)(hi - lo);
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = mix64(base + (uint64_t)i * 0x9e3779b97f4a7c15ULL);
        double u = (double)(r >> 40) * (1.0 / 16777216.0);
        dst[i] = kvz_bf16_to_fp32(kvz_fp32_to_bf16((float)((double)lo + span * u)));
    }
}

typedef struct synth_spec {
    const char *name;
    kvz_config cfg;
} synth_spec;

static const synth_spec SYNTH[] = {
    {"smollm2-135m", {KVZ_ARCH_LLAMA, 30, 576, 9, 3, 64, 1536, 49152, 8192, 100000.f, 1e-5f, 1, 1, 0, 0, ""}},
    {"llama3-8b", {KVZ_ARCH_LLAMA, 32, 4096, 32, 8, 128, 14336, 128256, 131072, 500000.f, 1e-5f, 1, 0, 0, 0, ""}},
    {"qwen2.5-7b", {KVZ_ARCH_QWEN2, 28, 3584, 28, 4, 128, 18944, 152064, 32768, 1000000.f, 1e-6f, 0, 0, 1, 0, ""}},
    {"tiny-llama", {KVZ_ARCH_LLAMA, 2, 128, 4, 2, 32, 256, 512, 4096, 10000.f, 1e-5f, 1, 1, 0, 0, ""}},
    {"tiny-qwen2", {KVZ_ARCH_QWEN2, 2, 192, 6, 2, 32, 384, 512, 4096, 1000000.f, 1e-6f, 0, 0, 1, 0, ""}},
    {"tiny-qwen3", {KVZ_ARCH_QWEN3, 2, 128, 4, 2, 64, 256, 512, 4096, 1000000.f, 1e-6f, 0, 1, 0, 1, ""}},
};

int kvz_synthetic_config(const char *name, kvz_config *out)
{
    for (size_t i = 0; i < sizeof SYNTH / sizeof SYNTH[0]; i++) {
        if (!strcmp(SYNTH[i].name, name)) {
            *out = SYNTH[i].cfg;
            snprintf(out->name, sizeof out->name, "synthetic:%s", name);
            return 0;
        }
    }
    return kvz_error_set(KVZ_ERR_NOTFOUND, "unknown synthetic model '%s' (smollm2-135m, "
                         "llama3-8b, qwen2.5-7b, tiny-llama, tiny-qwen2, tiny-qwen3)", name);
}

static int load_weights_synth(kvz_model *m, uint64_t seed)
{
    const kvz_config *c = &m->cfg;
    const int64_t d = c->n_embd, qd = (int64_t)c->n_head * c->head_dim,
                  kvd = (int64_t)c->n_kv_head * c->head_dim, ff = c->n_ff;
    uint64_t tid = 0;
    if (!(m->tok_embd = alloc_f32(m, (int64_t)c->n_vocab * d)) || !(m->out_norm = alloc_f32(m, d)))
        return KVZ_ERR_NOMEM;
    synth_fill(m->tok_embd, (int64_t)c->n_vocab * d, seed, tid++, -1.0f, 1.0f);
    synth_fill(m->out_norm, d, seed, tid++, 0.8f, 1.2f);
    if (c->tied_embd) {
        m->output = m->tok_embd;
        tid++;
    } else {
        if (!(m->output = alloc_f32(m, (int64_t)c->n_vocab * d))) return KVZ_ERR_NOMEM;
        float a = sqrtf(3.0f / (float)d);
        synth_fill(m->output, (int64_t)c->n_vocab * d, seed, tid++, -a, a);
    }
    for (int32_t l = 0; l < c->n_layer; l++) {
        kvz_layer_w *L = &m->layers[l];
        tid = 16 + (uint64_t)l * 16;
        if (!(L->attn_norm = alloc_f32(m, d)) || !(L->wqkv = alloc_f32(m, (qd + 2 * kvd) * d)) ||
            !(L->wo = alloc_f32(m, d * qd)) || !(L->ffn_norm = alloc_f32(m, d)) ||
            !(L->wgu = alloc_f32(m, 2 * ff * d)) || !(L->wdown = alloc_f32(m, d * ff)))
            return KVZ_ERR_NOMEM;
        float ad = sqrtf(3.0f / (float)d), aq = sqrtf(3.0f / (float)qd), af = sqrtf(3.0f / (float)ff);
        synth_fill(L->attn_norm, d, seed, tid++, 0.8f, 1.2f);
        synth_fill(L->wqkv, (qd + 2 * kvd) * d, seed, tid++, -ad, ad);
        synth_fill(L->wo, d * qd, seed, tid++, -aq, aq);
        synth_fill(L->ffn_norm, d, seed, tid++, 0.8f, 1.2f);
        synth_fill(L->wgu, 2 * ff * d, seed, tid++, -ad, ad);
        synth_fill(L->wdown, d * ff, seed, tid++, -af, af);
        if (c->qkv_bias) {
            if (!(L->bqkv = alloc_f32(m, qd + 2 * kvd))) return KVZ_ERR_NOMEM;
            synth_fill(L->bqkv, qd + 2 * kvd, seed, tid++, -0.1f, 0.1f);
        }
        if (c->qk_norm) {
            if (!(L->q_norm = alloc_f32(m, c->head_dim)) || !(L->k_norm = alloc_f32(m, c->head_dim)))
                return KVZ_ERR_NOMEM;
            synth_fill(L->q_norm, c->head_dim, seed, tid++, 0.8f, 1.2f);
            synth_fill(L->k_norm, c->head_dim, seed, tid++, 0.8f, 1.2f);
        }
    }
    return 0;
}

/* ======================================================================== */

static uint64_t host_weight_bytes(const kvz_config *c)
{
    const uint64_t d = c->n_embd, qd = (uint64_t)c->n_head * c->head_dim,
                   kvd = (uint64_t)c->n_kv_head * c->head_dim, ff = c->n_ff;
    uint64_t per = d * (qd + 2 * kvd) + d * qd + 3 * d * ff + 2 * d + qd + 2 * kvd;
    return 4 * (per * c->n_layer + (uint64_t)c->n_vocab * d * (c->tied_embd ? 1 : 2));
}

static int model_init(kvz_model *m, const kvz_model_opts *opts, int synthetic, int quant)
{
    const kvz_config *c = &m->cfg;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    m->n_threads = opts && opts->n_threads > 0 ? opts->n_threads : (int32_t)(ncpu > 0 ? ncpu : 1);
    int rc = kvz_backend_pick(opts ? opts->device : KVZ_DEVICE_CPU, &m->be);
    if (rc) return rc;
    const int32_t dev = m->device = m->be->device;
    /* synthetic weights on the GPU are generated there: no host copy */
    /* no fp32 host copy: synthetic weights on the GPU are generated there, and the CPU
     * backend on a GGUF reads the quantized blocks in place (quant) */
    uint64_t need = (synthetic && dev == KVZ_DEVICE_CUDA) || (quant && !synthetic && dev == KVZ_DEVICE_CPU)
                        ? 0 : host_weight_bytes(c);
    uint64_t have = phys_mem_bytes();
    if (have && need > have / 10 * 8)
        return kvz_error_set(KVZ_ERR_NOMEM, "%s needs %.1f GiB of host memory for fp32 weights; "
                             "this machine has %.1f GiB", c->name, need / 1073741824.0,
                             have / 1073741824.0);
    if (!(m->layers = calloc((size_t)c->n_layer, sizeof *m->layers)) ||
        !(m->rope_inv_freq = malloc(sizeof(float) * (size_t)(c->head_dim / 2))))
        return KVZ_ERR_NOMEM;
    for (int j = 0; j < c->head_dim / 2; j++)
        m->rope_inv_freq[j] = (float)pow((double)c->rope_theta, -2.0 * j / c->head_dim);
    return 0;
}

void kvz_model_free_host_weights(kvz_model *m)
{
    if (m->layers) {
        for (int32_t l = 0; l < m->cfg.n_layer; l++) {
            kvz_layer_w *L = &m->layers[l];
            free(L->attn_norm); free(L->wqkv); free(L->bqkv); free(L->q_norm);
            free(L->k_norm); free(L->wo); free(L->ffn_norm); free(L->wgu); free(L->wdown);
            memset(L, 0, sizeof *L);
        }
    }
    if (m->output != m->tok_embd) free(m->output);
    free(m->tok_embd);
    free(m->out_norm);
    m->tok_embd = m->output = m->out_norm = NULL;
    for (int32_t i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    m->owned = NULL;
    m->n_owned = 0;
    memset(&m->m_tok, 0, sizeof m->m_tok);
    memset(&m->m_out, 0, sizeof m->m_out);
}

static int finish_load(kvz_model *m) { return m->be->model_init(m); }

int kvz_model_load(const char *path, const kvz_model_opts *opts, kvz_model **out)
{
    *out = NULL;
    kvz_model *m = calloc(1, sizeof *m);
    if (!m) return KVZ_ERR_NOMEM;
    int rc = kvz_gguf_open(path, &m->gguf);
    if (!rc) rc = config_from_gguf(m->gguf, &m->cfg);
    /* CPU: compute on the file's quantized blocks unless fp32 is asked for; the CUDA
     * backend takes fp32 host weights and converts them at upload */
    const int want_quant = !(opts && opts->f32_weights);
    if (!rc) rc = model_init(m, opts, 0, want_quant);
    if (!rc && m->device != KVZ_DEVICE_CPU) rc = load_weights_gguf(m);
    else if (!rc && want_quant) rc = load_weights_quant(m);
    else if (!rc) {
        rc = load_weights_gguf(m);
        if (!rc) wire_f32(m);
    }
    if (!rc) rc = kvz_tokenizer_from_gguf(m->gguf, &m->tok);
    if (!rc) {
        kvz_gguf_fingerprint(m->gguf, m->fingerprint);
        rc = finish_load(m);
    }
    if (rc) {
        kvz_model_free(m);
        return rc;
    }
    *out = m;
    return 0;
}

int kvz_model_synthetic(const char *name, const kvz_model_opts *opts, kvz_model **out)
{
    *out = NULL;
    kvz_model *m = calloc(1, sizeof *m);
    if (!m) return KVZ_ERR_NOMEM;
    uint64_t seed = opts && opts->seed ? opts->seed : 0x6b767a6970ULL;
    int rc = kvz_synthetic_config(name, &m->cfg);
    if (!rc) rc = model_init(m, opts, 1, 0);
    m->synthetic = 1;
    m->synth_seed = seed;
    /* CUDA: kvz_cuda_model_init generates the same values on the device */
    if (!rc && m->device != KVZ_DEVICE_CUDA) {
        rc = load_weights_synth(m, seed);
        if (!rc) wire_f32(m);
    }
    if (!rc) rc = kvz_tokenizer_bytes(m->cfg.n_vocab, &m->tok);
    if (!rc) {
        char spec[128];
        int n = snprintf(spec, sizeof spec, "kvzip-synthetic-v1:%s:%llu", name,
                         (unsigned long long)seed);
        XXH128_hash_t h = XXH3_128bits(spec, (size_t)n);
        XXH128_canonical_t cano;
        XXH128_canonicalFromHash(&cano, h);
        memcpy(m->fingerprint, cano.digest, 16);
        rc = finish_load(m);
    }
    if (rc) {
        kvz_model_free(m);
        return rc;
    }
    *out = m;
    return 0;
}

void kvz_model_free(kvz_model *m)
{
    if (!m) return;
    if (m->be) m->be->model_free(m);
    kvz_model_free_host_weights(m);
    free(m->layers);
    free(m->rope_inv_freq);
    kvz_tokenizer_free(m->tok);
    kvz_gguf_close(m->gguf);
    free(m);
}

const kvz_config *kvz_model_config(const kvz_model *m) { return &m->cfg; }
const kvz_tokenizer *kvz_model_tokenizer(const kvz_model *m) { return m->tok; }
void kvz_model_fingerprint(const kvz_model *m, uint8_t out[16]) { memcpy(out, m->fingerprint, 16); }
int32_t kvz_model_device(const kvz_model *m) { return m->device; }
const kvz_backend *kvz_model_backend(const kvz_model *m) { return m->be; }
uint64_t kvz_model_weight_bytes(const kvz_model *m) { return m->weight_bytes; }

uint64_t kvz_model_tok_embd_bytes(const kvz_model *m)
{
    if (!m->m_tok.data || m->m_tok.data == m->m_out.data) return 0;
    return (uint64_t)m->m_tok.row_bytes * (uint64_t)m->m_tok.rows;
}

int kvz_forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                float *logits, int flags, const kvz_layer_hook *hook)
{
    if (n <= 0 || pos0 < 0) return kvz_error_set(KVZ_ERR_ARG, "forward: n=%d pos0=%d", n, pos0);
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->cfg.n_vocab)
            return kvz_error_set(KVZ_ERR_ARG, "token id %d is out of range", tokens[i]);
    return m->be->forward(m, kv, tokens, n, pos0, logits, flags, hook);
}

int32_t kvz_argmax(const float *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

int kvz_forward_multi(kvz_model *m, kvz_kv *const *kv, const int32_t *tokens, const int32_t *pos,
                      int32_t n, float *logits)
{
    if (!logits) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: logits is NULL");
    return kvz_forward_multi_top(m, kv, tokens, pos, n, logits, NULL);
}

int kvz_forward_multi_top(kvz_model *m, kvz_kv *const *kv, const int32_t *tokens, const int32_t *pos,
                          int32_t n, float *logits, kvz_step_io *io)
{
    if (n < 1 || !kv || !tokens || !pos) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: n=%d", n);
    int need = !io || !io->want_logits;
    for (int32_t i = 0; i < n && !need; i++) need = io->want_logits[i] != 0;
    if (need && !logits) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: logits is NULL");
    for (int32_t i = 0; i < n; i++) {
        if (!kv[i]) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: cache %d is NULL", i);
        if (tokens[i] < 0 || tokens[i] >= m->cfg.n_vocab)
            return kvz_error_set(KVZ_ERR_ARG, "token id %d is out of range", tokens[i]);
        if (pos[i] < 0) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: position %d", pos[i]);
        for (int32_t j = 0; j < i; j++)
            if (kv[j] == kv[i]) return kvz_error_set(KVZ_ERR_ARG, "forward_multi: cache %d repeats cache %d", i, j);
    }
    if (io) io->path = KVZ_STEP_PASSES;
    if (m->be->forward_multi) return m->be->forward_multi(m, kv, tokens, pos, n, logits, io);
    return kvz_forward_each(m, kv, tokens, pos, n, logits, io);
}

int kvz_forward_each(kvz_model *m, kvz_kv *const *kv, const int32_t *tokens, const int32_t *pos, int32_t n,
                     float *logits, kvz_step_io *io)
{
    /* one pass per cache; a row whose logits are not wanted goes through a scratch row */
    if (io) io->path = KVZ_STEP_PASSES;
    const size_t V = (size_t)m->cfg.n_vocab;
    float *scratch = NULL;
    int rc = 0;
    for (int32_t i = 0; i < n && !rc; i++) {
        float *row = logits ? logits + (size_t)i * V : NULL;
        if (io && io->want_logits && !io->want_logits[i]) row = NULL;
        if (!row && (!io || !io->top)) { /* neither logits nor the id: the pass still runs (cache update) */
            rc = m->be->forward(m, kv[i], tokens + i, 1, pos[i], NULL, KVZ_FWD_NO_LOGITS, NULL);
            continue;
        }
        if (!row && io->scratch) row = io->scratch;
        if (!row) {
            if (!scratch && !(scratch = malloc(V * sizeof *scratch))) {
                rc = kvz_error_set(KVZ_ERR_NOMEM, "forward_multi: a logits row");
                break;
            }
            row = scratch;
        }
        rc = m->be->forward(m, kv[i], tokens + i, 1, pos[i], row, KVZ_FWD_LOGITS_LAST, NULL);
        if (!rc && io && io->top) io->top[i] = kvz_argmax(row, (int32_t)V);
    }
    free(scratch);
    return rc;
}
