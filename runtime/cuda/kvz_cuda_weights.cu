/* CUDA backend: model weights on the device (bf16 matrices, fp32 norms/biases),
 * uploaded from the host fp32 copies (then freed) or, for synthetic models, generated
 * on the device bit-identical to synth_fill (runtime/kvz_model.c). */
#include "kvz_cuda_impl.cuh"

/* ====================================================================== */
/* model                                                                    */

extern "C" int kvz_cuda_available(void)
{
    static int cached = -1;
    if (cached < 0) {
        int n = 0;
        cached = kvz_cuda_device_count(&n) == 0 && n > 0;
        kvz_error_clear();
    }
    return cached;
}

/* ---- synthetic weights on the device (mirror of synth_fill) ----------- */

static inline uint64_t h_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

__device__ __forceinline__ uint64_t d_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

template <typename T>
__global__ void synth_kernel(T *dst, int64_t n, uint64_t base, float lo, double span)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t r = d_mix64(base + (uint64_t)i * 0x9e3779b97f4a7c15ULL);
        double u = (double)(r >> 40) * (1.0 / 16777216.0);
        float f = __double2float_rn(__dadd_rn((double)lo, __dmul_rn(span, u)));
        dst[i] = kvz_from_f<T>(__bfloat162float(__float2bfloat16_rn(f)));
    }
}

template <typename T>
static int synth_gen(cudaStream_t s, T *dst, int64_t n, uint64_t seed, uint64_t tid, float lo, float hi)
{
    const uint64_t base = h_mix64(seed ^ h_mix64(tid + 0x9e3779b97f4a7c15ULL));
    int64_t blocks = (n + 255) / 256;
    if (blocks > 65536) blocks = 65536;
    synth_kernel<T><<<(unsigned)blocks, 256, 0, s>>>(dst, n, base, lo, (double)(hi - lo));
    KVZ_LAUNCH_CHECK("synth");
    return 0;
}

/* ---- upload of host fp32 weights -------------------------------------- */

static int up_bf16(kvz_cuda_model *g, const float *h, size_t n, bf16 **out, const char *what)
{
    TRY(dmalloc((void **)out, n * sizeof(bf16), what));
    for (size_t off = 0; off < n; off += g->staging_n) {
        size_t c = n - off < g->staging_n ? n - off : g->staging_n;
        KVZ_CUDA_TRY(cudaMemcpyAsync(g->staging, h + off, c * sizeof(float), cudaMemcpyHostToDevice, g->s));
        TRY(kvz_cuda_f32_to_bf16(g->s, g->staging, *out + off, c));
    }
    return 0;
}

static int up_f32(kvz_cuda_model *g, const float *h, size_t n, float **out, const char *what)
{
    TRY(dmalloc((void **)out, n * sizeof(float), what));
    KVZ_CUDA_TRY(cudaMemcpyAsync(*out, h, n * sizeof(float), cudaMemcpyHostToDevice, g->s));
    return 0;
}

/* One tensor: from the host copy when present, else generated (synthetic). */
typedef struct wsrc {
    kvz_model *m;
    kvz_cuda_model *g;
    int gen;
} wsrc;

static int w_bf16(wsrc *w, const float *h, size_t n, uint64_t tid, float lo, float hi, bf16 **out,
                  const char *what)
{
    if (!w->gen) return up_bf16(w->g, h, n, out, what);
    TRY(dmalloc((void **)out, n * sizeof(bf16), what));
    return synth_gen<bf16>(w->g->s, *out, (int64_t)n, w->m->synth_seed, tid, lo, hi);
}

static int w_f32(wsrc *w, const float *h, size_t n, uint64_t tid, float lo, float hi, float **out,
                 const char *what)
{
    if (!w->gen) return up_f32(w->g, h, n, out, what);
    TRY(dmalloc((void **)out, n * sizeof(float), what));
    return synth_gen<float>(w->g->s, *out, (int64_t)n, w->m->synth_seed, tid, lo, hi);
}

static int model_init(kvz_model *m)
{
    const kvz_config *c = &m->cfg;
    if (c->head_dim % 8 || c->head_dim > 256)
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "CUDA backend: head_dim %d (needs a multiple "
                             "of 8, <= 256)", c->head_dim);
    for (int j = 0; j < c->head_dim / 2; j++) {
        double ref = pow((double)c->rope_theta, -2.0 * j / c->head_dim);
        if (fabs(m->rope_inv_freq[j] - ref) > 1e-6 * ref)
            return kvz_error_set(KVZ_ERR_UNSUPPORTED, "CUDA backend: per-frequency RoPE scaling "
                                 "(rope_freqs.weight) is not supported");
    }
    kvz_cuda_model *g = (kvz_cuda_model *)calloc(1, sizeof *g);
    if (!g) return KVZ_ERR_NOMEM;
    m->cuda = g;
    KVZ_CUDA_TRY(cudaStreamCreate(&g->s));
    TRY(kvz_cuda_blas_create(&g->blas));
    if (!(g->L = (cuda_layer *)calloc((size_t)c->n_layer, sizeof *g->L))) return KVZ_ERR_NOMEM;
    wsrc w = {m, g, m->synthetic && !m->tok_embd};
    if (!w.gen) {
        g->staging_n = (size_t)32 << 20;
        TRY(dmalloc((void **)&g->staging, g->staging_n * sizeof(float), "staging"));
    }
    const size_t d = (size_t)c->n_embd, qd = (size_t)c->n_head * c->head_dim,
                 kvd = (size_t)c->n_kv_head * c->head_dim, ff = (size_t)c->n_ff, V = (size_t)c->n_vocab;
    /* tensor ids and ranges: exactly load_weights_synth (runtime/kvz_model.c) */
    uint64_t bytes = 0;
    TRY(w_bf16(&w, m->tok_embd, V * d, 0, -1.0f, 1.0f, &g->tok_embd, "token_embd"));
    TRY(w_f32(&w, m->out_norm, d, 1, 0.8f, 1.2f, &g->out_norm, "output_norm"));
    bytes += V * d * 2 + d * 4;
    if (c->tied_embd) {
        g->output = g->tok_embd;
    } else {
        float a = sqrtf(3.0f / (float)d);
        TRY(w_bf16(&w, m->output, V * d, 2, -a, a, &g->output, "output"));
        bytes += V * d * 2;
    }
    for (int32_t l = 0; l < c->n_layer; l++) {
        kvz_layer_w *H = &m->layers[l];
        cuda_layer *L = &g->L[l];
        uint64_t tid = 16 + (uint64_t)l * 16;
        float ad = sqrtf(3.0f / (float)d), aq = sqrtf(3.0f / (float)qd), af = sqrtf(3.0f / (float)ff);
        TRY(w_f32(&w, H->attn_norm, d, tid++, 0.8f, 1.2f, &L->attn_norm, "attn_norm"));
        TRY(w_bf16(&w, H->wqkv, (qd + 2 * kvd) * d, tid++, -ad, ad, &L->wqkv, "wqkv"));
        TRY(w_bf16(&w, H->wo, d * qd, tid++, -aq, aq, &L->wo, "wo"));
        TRY(w_f32(&w, H->ffn_norm, d, tid++, 0.8f, 1.2f, &L->ffn_norm, "ffn_norm"));
        TRY(w_bf16(&w, H->wgu, 2 * ff * d, tid++, -ad, ad, &L->wgu, "wgu"));
        TRY(w_bf16(&w, H->wdown, d * ff, tid++, -af, af, &L->wdown, "wdown"));
        bytes += 2 * ((qd + 2 * kvd) * d + d * qd + 3 * ff * d) + 8 * d;
        if (c->qkv_bias) {
            TRY(w_f32(&w, H->bqkv, qd + 2 * kvd, tid++, -0.1f, 0.1f, &L->bqkv, "bqkv"));
            bytes += 4 * (qd + 2 * kvd);
        }
        if (c->qk_norm) {
            TRY(w_f32(&w, H->q_norm, (size_t)c->head_dim, tid++, 0.8f, 1.2f, &L->q_norm, "q_norm"));
            TRY(w_f32(&w, H->k_norm, (size_t)c->head_dim, tid++, 0.8f, 1.2f, &L->k_norm, "k_norm"));
            bytes += 8 * (uint64_t)c->head_dim;
        }
        if (!w.gen) KVZ_CUDA_TRY(cudaStreamSynchronize(g->s)); /* staging reused per tensor */
    }
    KVZ_CUDA_TRY(cudaStreamSynchronize(g->s));
    dfree(g->staging);
    g->staging = NULL;
    m->weight_bytes = bytes;
    kvz_model_free_host_weights(m);
    return 0;
}

extern "C" int kvz_cuda_model_init(kvz_model *m)
{
    int rc = model_init(m);
    if (rc) kvz_cuda_model_free(m); /* kvz_model_free frees the rest */
    return rc;
}

extern "C" void kvz_cuda_model_free(kvz_model *m)
{
    kvz_cuda_model *g = m->cuda;
    if (!g) return;
    if (g->s) cudaStreamSynchronize(g->s);
    if (g->L) {
        for (int32_t l = 0; l < m->cfg.n_layer; l++) {
            cuda_layer *L = &g->L[l];
            dfree(L->attn_norm); dfree(L->ffn_norm); dfree(L->bqkv); dfree(L->q_norm);
            dfree(L->k_norm); dfree(L->wqkv); dfree(L->wo); dfree(L->wgu); dfree(L->wdown);
        }
        free(g->L);
    }
    if (g->output != g->tok_embd) dfree(g->output);
    dfree(g->tok_embd);
    dfree(g->out_norm);
    dfree(g->staging);
    dfree(g->mb_act);
    dfree(g->mb_seq_d);
    if (g->mb_seq_h) cudaFreeHost(g->mb_seq_h);
    dfree(g->mb_ws);
    dfree(g->mb_logits);
    kvz_cuda_multi_free(g);
    kvz_cuda_load_free(g);
    kvz_cuda_load_verify_free(g);
    kvz_cuda_blas_destroy(g->blas);
    if (g->s) cudaStreamDestroy(g->s);
    free(g);
    m->cuda = NULL;
}

/* bf16 device tensor vs host fp32: mismatching elements */
static int64_t diff_bf16(const bf16 *d, const float *h, size_t n)
{
    if (!d || !h) return (d || h) ? (int64_t)n : 0;
    uint16_t *b = (uint16_t *)malloc(n * 2);
    if (!b) return KVZ_ERR_NOMEM;
    if (cudaMemcpy(b, d, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess) { free(b); return KVZ_ERR_CUDA; }
    int64_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)b[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        bad += f != h[i];
    }
    free(b);
    return bad;
}

static int64_t diff_f32(const float *d, const float *h, size_t n)
{
    if (!d || !h) return (d || h) ? (int64_t)n : 0;
    float *b = (float *)malloc(n * 4);
    if (!b) return KVZ_ERR_NOMEM;
    if (cudaMemcpy(b, d, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess) { free(b); return KVZ_ERR_CUDA; }
    int64_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += memcmp(&b[i], &h[i], 4) != 0;
    free(b);
    return bad;
}

extern "C" int64_t kvz_cuda_weights_diff(const kvz_model *gpu, const kvz_model *cpu)
{
    const kvz_config *c = &cpu->cfg;
    const kvz_cuda_model *g = gpu->cuda;
    if (!g || cpu->cuda || !cpu->tok_embd) return KVZ_ERR_ARG;
    const size_t d = (size_t)c->n_embd, qd = (size_t)c->n_head * c->head_dim,
                 kvd = (size_t)c->n_kv_head * c->head_dim, ff = (size_t)c->n_ff, V = (size_t)c->n_vocab;
    int64_t bad = diff_bf16(g->tok_embd, cpu->tok_embd, V * d) + diff_f32(g->out_norm, cpu->out_norm, d);
    if (!c->tied_embd) bad += diff_bf16(g->output, cpu->output, V * d);
    for (int32_t l = 0; l < c->n_layer; l++) {
        const cuda_layer *L = &g->L[l];
        const kvz_layer_w *H = &cpu->layers[l];
        bad += diff_f32(L->attn_norm, H->attn_norm, d) + diff_f32(L->ffn_norm, H->ffn_norm, d);
        bad += diff_bf16(L->wqkv, H->wqkv, (qd + 2 * kvd) * d) + diff_bf16(L->wo, H->wo, d * qd);
        bad += diff_bf16(L->wgu, H->wgu, 2 * ff * d) + diff_bf16(L->wdown, H->wdown, d * ff);
        bad += diff_f32(L->bqkv, H->bqkv, c->qkv_bias ? qd + 2 * kvd : 0);
        bad += diff_f32(L->q_norm, H->q_norm, c->qk_norm ? (size_t)c->head_dim : 0);
        bad += diff_f32(L->k_norm, H->k_norm, c->qk_norm ? (size_t)c->head_dim : 0);
    }
    return bad;
}
