/* CUDA model backend: turns the kernels of kvz_cuda.h into a device for
 * kvz_forward (runtime/kvz_model_impl.h entry points).
 *
 * Weights: bf16 matrices, fp32 norms/biases, uploaded from the host fp32 copies
 * (which are then freed) or, for synthetic models, generated on the device by
 * synth_kernel, bit-identical to synth_fill (runtime/kvz_model.c).
 *
 * Cache: per layer K/V (n_kv, cap, hd) bf16 + pos (n_kv, cap) + len (n_kv) on the
 * device, LongFlow output buffer (n_kv, B, hd) + slot_pos (B). The host keeps the
 * lengths (kv->len, out_used) as the source of truth; the device len follows by
 * kv_append and is re-pushed (kvz_cuda_kv_sync) whenever the host changes it.
 * The LongFlow victim is chosen inside the decode attention kernel of step t and
 * read on the device by step t+1's write: no host round trip.
 *
 * Forward of T tokens, per layer (residual stream x fp32, GEMM operands bf16):
 *   xn = rmsnorm(x)·w  →  qkv = xn·Wqkvᵀ (+b)  →  rope(q,k) (+qwen3 q/k norm)
 *   → append k,v (doc region or output buffer)  →  attention (prefill kernel, or the
 *   split decode kernel when T·G <= 32)  →  x += att·Woᵀ (GEMM beta = 1)
 *   →  xn = rmsnorm(x)  →  gu = xn·Wguᵀ  →  h = silu(g)·u  →  x += h·Wdownᵀ.
 * T = 1 (decode) runs the same math in fewer launches: rmsnorm inside the qkv and
 * gate|up GEMVs (and the LM head), silu(g)·u in the gate|up GEMV's epilogue, rope
 * fused with the k/v write (kvz_cuda_linear_rmsnorm*, kvz_cuda_rope_kv_append,
 * kvz_cuda_rope_outbuf_write).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>
#include <unordered_map>

#include "kvz_cuda_common.cuh"

#ifndef KVZ_HAVE_CUDA
#define KVZ_HAVE_CUDA 1 /* this file is the backend: see its entry points */
#endif
extern "C" {
#include "kvz_model_impl.h"
#include "kvz_cuda_loader.h"
#include "kvz_rope_shift_cuda.h"
}

/* eviction modes of ingest/kvz_kvzip.h (KVZ_EVICT_GLOBAL / KVZ_EVICT_UNIFORM) */
enum { EVICT_GLOBAL = 0, EVICT_UNIFORM = 1 };

/* host bf16 <-> fp32, round to nearest even (same as kvz_quant.c) */
static inline uint16_t h_f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float h_bf2f(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define KVZ_GPU_MAX_BATCH 8192   /* tokens per internal pass (bounds activation memory) */
#define KVZ_GPU_LOGIT_ROWS 512   /* logits rows per GEMM when every row is wanted */

/* ====================================================================== */
/* device memory with accounting                                           */

static std::mutex g_mem_mu;
static std::unordered_map<void *, size_t> g_mem_sizes;
static uint64_t g_mem_cur, g_mem_peak;

static void mem_track(void *p, size_t bytes)
{
    std::lock_guard<std::mutex> g(g_mem_mu);
    g_mem_sizes[p] = bytes;
    g_mem_cur += bytes;
    if (g_mem_cur > g_mem_peak) g_mem_peak = g_mem_cur;
}

static void mem_untrack(void *p)
{
    std::lock_guard<std::mutex> g(g_mem_mu);
    auto it = g_mem_sizes.find(p);
    if (it != g_mem_sizes.end()) {
        g_mem_cur -= it->second;
        g_mem_sizes.erase(it);
    }
}

static int dmalloc(void **p, size_t bytes, const char *what)
{
    *p = NULL;
    if (bytes == 0) bytes = 256;
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *p = NULL;
        return kvz_error_set(e == cudaErrorMemoryAllocation ? KVZ_ERR_NOMEM : KVZ_ERR_CUDA,
                             "cudaMalloc %s (%.1f MiB): %s", what, bytes / 1048576.0,
                             cudaGetErrorString(e));
    }
    mem_track(*p, bytes);
    return 0;
}

static void dfree(void *p)
{
    if (!p) return;
    cudaFree(p);
    mem_untrack(p);
}

/* Short-lived scratch (selection, compaction): stream-ordered from the device's default
 * pool, which is set to keep freed blocks, so the next document's selection takes
 * nothing from the driver (cudaMalloc + the synchronising cudaFree cost ~3 ms per
 * document). Accounted like dmalloc while allocated; falls back to it where the device
 * has no memory pools. */
static int tmp_pools(void) /* 1: cudaMallocAsync from a default pool that keeps freed blocks */
{
    static int pools = -1;
    if (pools < 0) {
        int dev = 0, ok = 0;
        cudaMemPool_t pool;
        uint64_t keep = UINT64_MAX;
        pools = cudaGetDevice(&dev) == cudaSuccess &&
                cudaDeviceGetAttribute(&ok, cudaDevAttrMemoryPoolsSupported, dev) == cudaSuccess && ok &&
                cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess &&
                cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) == cudaSuccess;
        cudaGetLastError();
    }
    return pools;
}

static int dmalloc_tmp(void **p, size_t bytes, cudaStream_t s, const char *what)
{
    const int pools = tmp_pools();
    if (!pools) return dmalloc(p, bytes, what);
    *p = NULL;
    if (bytes == 0) bytes = 256;
    cudaError_t e = cudaMallocAsync(p, bytes, s);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *p = NULL;
        return kvz_error_set(e == cudaErrorMemoryAllocation ? KVZ_ERR_NOMEM : KVZ_ERR_CUDA,
                             "cudaMallocAsync %s (%.1f MiB): %s", what, bytes / 1048576.0, cudaGetErrorString(e));
    }
    mem_track(*p, bytes);
    return 0;
}

static void dfree_tmp(void *p, cudaStream_t s)
{
    if (!p) return;
    mem_untrack(p);
    if (tmp_pools())
        cudaFreeAsync(p, s);
    else
        cudaFree(p);
    cudaGetLastError();
}

extern "C" uint64_t kvz_cuda_mem_peak(void)
{
    std::lock_guard<std::mutex> g(g_mem_mu);
    return g_mem_peak;
}

#define TRY(x)                                                                   \
    do {                                                                         \
        int rc_ = (x);                                                           \
        if (rc_) return rc_;                                                     \
    } while (0)

/* ====================================================================== */
/* model                                                                    */

typedef struct cuda_layer {
    float *attn_norm, *ffn_norm; /* (d) */
    float *bqkv;                 /* (nqkv) or NULL */
    float *q_norm, *k_norm;      /* (hd) or NULL */
    bf16 *wqkv;                  /* (nqkv, d) */
    bf16 *wo;                    /* (d, qd) */
    bf16 *wgu;                   /* (2 ff, d) */
    bf16 *wdown;                 /* (d, ff) */
} cuda_layer;

struct kvz_cuda_model {
    cudaStream_t s;
    kvz_cuda_blas *blas;
    bf16 *tok_embd;   /* (n_vocab, d) */
    bf16 *output;     /* (n_vocab, d); == tok_embd when tied */
    float *out_norm;  /* (d) */
    cuda_layer *L;    /* (n_layer) */
    float *staging;   /* upload staging (fp32) */
    size_t staging_n;
    /* pipelined loader (kvz_cuda_load_*): pinned host slots, one device staging
     * buffer per slot, an event per slot marking its upload done */
    void *ld_h[KVZ_CUDA_LOAD_MAX_SLOTS];
    void *ld_d[KVZ_CUDA_LOAD_MAX_SLOTS];
    cudaEvent_t ld_ev[KVZ_CUDA_LOAD_MAX_SLOTS];
    size_t ld_bytes;  /* bytes of each slot */
    int ld_n;         /* slots allocated */
};

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
    for (int i = 0; i < g->ld_n; i++) {
        cudaFreeHost(g->ld_h[i]);
        dfree(g->ld_d[i]);
        cudaEventDestroy(g->ld_ev[i]);
    }
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

/* ====================================================================== */
/* cache                                                                    */

struct kvz_cuda_cache {
    kvz_cuda_kv *L;       /* (n_layer) per-layer views for the kernels */
    kvz_cuda_outbuf *O;   /* (n_layer) or NULL */
    bf16 *k, *v;          /* (n_layer, n_kv, cap, hd) */
    int32_t *pos;         /* (n_layer, n_kv, cap) */
    int32_t *len;         /* (n_layer, n_kv) device */
    bf16 *ok, *ov;        /* (n_layer, n_kv, B, hd) */
    int32_t *opos;        /* (n_layer, B) */
    int32_t *evict;       /* (n_layer) LongFlow victim chosen by the last attention */
    int32_t *len_h;       /* (n_layer, n_kv) host staging for len pushes */
    /* work memory, grown on demand */
    void *act;            /* activations for act_T tokens */
    int32_t act_T;
    void *dec_ws;         /* decode attention workspace */
    size_t dec_ws_bytes;
    void *score_ws;       /* kvzip score workspace */
    size_t score_ws_bytes;
    float *logits;        /* (KVZ_GPU_LOGIT_ROWS, n_vocab) */
    float *scores;        /* (n_layer, n_kv, n_ctx) KVzip scores */
    int64_t scores_n;
    /* export of kept rows (kvz_cuda_kv_export_layer): device staging + pinned host copy */
    void *exp_d, *exp_h;
    size_t exp_d_bytes, exp_h_bytes;
    /* CUDA-graph decode step (batch 1): inputs {token, position, fill slot} in device
     * memory, fed from a pinned ring (an event guards each entry's reuse) */
    int32_t *step_d;      /* (4) device */
    int32_t *step_h;      /* (GRAPH_RING, 4) pinned */
    cudaEvent_t step_ev[16];
    int step_i;
    cudaGraphExec_t gexec;
    struct graph_key { const void *k, *ok, *act, *logits; int act_T, doc, want, n_sink, policy; } gkey;
    int gseen;            /* eager runs with the current key (capture on the second) */
    int gdisabled;        /* capture failed once: eager from then on */
};
#define GRAPH_RING 16

static uint64_t g_graph_launches;
extern "C" uint64_t kvz_cuda_graph_launches(void) { return g_graph_launches; }

static inline size_t al256(size_t x) { return (x + 255) & ~(size_t)255; }

/* activation layout for T tokens */
typedef struct act_view {
    float *x;      /* (T, d) fp32 residual */
    bf16 *xn;      /* (T, d) */
    bf16 *qkv;     /* (T, nqkv) */
    bf16 *att;     /* (T, qd) */
    bf16 *gu;      /* (T, 2 ff) */
    bf16 *hb;      /* (T, ff) */
    bf16 *att1;    /* (1, qd) scratch for the eviction-only decode call */
    int32_t *tok;  /* (T) */
    int32_t *pos;  /* (T) */
} act_view;

static size_t act_layout(const kvz_config *c, int32_t T, act_view *v, char *base)
{
    const size_t d = (size_t)c->n_embd, qd = (size_t)c->n_head * c->head_dim,
                 nqkv = qd + 2 * (size_t)c->n_kv_head * c->head_dim, ff = (size_t)c->n_ff;
    size_t off = 0;
#define SUB(field, type, count)                                          \
    do {                                                                 \
        if (v) v->field = (type *)(base + off);                          \
        off += al256((size_t)(count) * sizeof(type));                    \
    } while (0)
    SUB(x, float, T * d);
    SUB(xn, bf16, T * d);
    SUB(qkv, bf16, T * nqkv);
    SUB(att, bf16, T * qd);
    SUB(gu, bf16, T * 2 * ff);
    SUB(hb, bf16, T * ff);
    SUB(att1, bf16, qd);
    SUB(tok, int32_t, T);
    SUB(pos, int32_t, T);
#undef SUB
    return off;
}

static int ensure_act(kvz_kv *kv, int32_t T, act_view *v)
{
    kvz_cuda_cache *cc = kv->cuda;
    const kvz_config *c = &kv->m->cfg;
    if (T > cc->act_T) {
        int32_t nt = T < 64 ? 64 : T;
        dfree(cc->act); /* cudaFree synchronises the device */
        cc->act = NULL;
        cc->act_T = 0;
        TRY(dmalloc(&cc->act, act_layout(c, nt, NULL, NULL), "activations"));
        cc->act_T = nt;
    }
    act_layout(c, cc->act_T, v, (char *)cc->act);
    return 0;
}

extern "C" int kvz_cuda_kv_sync(kvz_kv *kv, int reset_out)
{
    kvz_cuda_cache *cc = kv->cuda;
    if (!cc) return 0;
    const size_t nlh = (size_t)kv->n_layer * kv->n_kv_head;
    for (size_t i = 0; i < nlh; i++) cc->len_h[i] = (int32_t)kv->len[i];
    const cudaStream_t s = kv->m->cuda->s;
    KVZ_CUDA_TRY(cudaMemcpyAsync(cc->len, cc->len_h, nlh * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    if (reset_out && cc->opos) {
        KVZ_CUDA_TRY(cudaMemsetAsync(cc->opos, 0xff, (size_t)kv->n_layer * kv->out_slots * sizeof(int32_t), s));
        KVZ_CUDA_TRY(cudaMemsetAsync(cc->evict, 0xff, (size_t)kv->n_layer * sizeof(int32_t), s));
    }
    KVZ_CUDA_TRY(cudaStreamSynchronize(s)); /* len_h is pageable and reused */
    return 0;
}

static void cache_views(kvz_kv *kv)
{
    kvz_cuda_cache *cc = kv->cuda;
    const size_t hd = (size_t)kv->head_dim, nkv = (size_t)kv->n_kv_head, cap = (size_t)kv->cap;
    for (int32_t l = 0; l < kv->n_layer; l++) {
        kvz_cuda_kv *L = &cc->L[l];
        L->k = cc->k + (size_t)l * nkv * cap * hd;
        L->v = cc->v + (size_t)l * nkv * cap * hd;
        L->pos = cc->pos + (size_t)l * nkv * cap;
        L->len = cc->len + (size_t)l * nkv;
        L->n_kv = (int32_t)nkv;
        L->cap = (int32_t)cap;
        L->hd = (int32_t)hd;
    }
}

static int kv_init(kvz_kv *kv)
{
    const kvz_model *m = kv->m;
    const kvz_config *c = &m->cfg;
    if (kv->cap > INT32_MAX / 2) return kvz_error_set(KVZ_ERR_ARG, "CUDA cache: capacity too large");
    kvz_cuda_cache *cc = (kvz_cuda_cache *)calloc(1, sizeof *cc);
    if (!cc) return KVZ_ERR_NOMEM;
    kv->cuda = cc;
    const size_t nl = (size_t)c->n_layer, nkv = (size_t)c->n_kv_head, hd = (size_t)c->head_dim;
    const size_t cap = (size_t)(kv->cap > 0 ? kv->cap : 1), B = (size_t)kv->out_slots;
    cc->L = (kvz_cuda_kv *)calloc(nl, sizeof *cc->L);
    cc->len_h = (int32_t *)calloc(nl * nkv, sizeof(int32_t));
    if (!cc->L || !cc->len_h) return KVZ_ERR_NOMEM;
    TRY(dmalloc((void **)&cc->k, nl * nkv * cap * hd * 2, "KV cache K"));
    TRY(dmalloc((void **)&cc->v, nl * nkv * cap * hd * 2, "KV cache V"));
    TRY(dmalloc((void **)&cc->pos, nl * nkv * cap * 4, "KV cache pos"));
    TRY(dmalloc((void **)&cc->len, nl * nkv * 4, "KV cache len"));
    TRY(dmalloc((void **)&cc->evict, nl * 4, "LongFlow victims"));
    cache_views(kv);
    if (B) {
        cc->O = (kvz_cuda_outbuf *)calloc(nl, sizeof *cc->O);
        kv->opos = (int32_t *)malloc(nl * B * sizeof(int32_t)); /* host mirror (window policy) */
        if (!cc->O || !kv->opos) return KVZ_ERR_NOMEM;
        TRY(dmalloc((void **)&cc->ok, nl * nkv * B * hd * 2, "output buffer K"));
        TRY(dmalloc((void **)&cc->ov, nl * nkv * B * hd * 2, "output buffer V"));
        TRY(dmalloc((void **)&cc->opos, nl * B * 4, "output buffer pos"));
        for (size_t l = 0; l < nl; l++) {
            kvz_cuda_outbuf *O = &cc->O[l];
            O->k = cc->ok + l * nkv * B * hd;
            O->v = cc->ov + l * nkv * B * hd;
            O->slot_pos = cc->opos + l * B;
            O->n_slot = (int32_t)B;
            O->n_sink = kv->n_sink;
        }
        for (size_t i = 0; i < nl * B; i++) kv->opos[i] = -1;
    }
    /* decode workspace sized for the largest decode call this cache can see */
    const int G = c->n_head / c->n_kv_head, Tmax = 32 / G > 0 ? 32 / G : 1;
    cc->dec_ws_bytes = kvz_cuda_attn_decode_ws_size(Tmax, c->n_head, c->head_dim, (int)cap, (int)B);
    if (cc->dec_ws_bytes) TRY(dmalloc(&cc->dec_ws, cc->dec_ws_bytes, "decode workspace"));
    memset(kv->len, 0, nl * nkv * sizeof *kv->len);
    return kvz_cuda_kv_sync(kv, 1);
}

extern "C" int kvz_cuda_kv_init(kvz_kv *kv)
{
    int rc = kv_init(kv);
    if (rc) kvz_cuda_kv_free(kv);
    return rc;
}

extern "C" void kvz_cuda_kv_free(kvz_kv *kv)
{
    kvz_cuda_cache *cc = kv->cuda;
    if (!cc) return;
    if (kv->m->cuda) cudaStreamSynchronize(kv->m->cuda->s);
    dfree(cc->k); dfree(cc->v); dfree(cc->pos); dfree(cc->len); dfree(cc->evict);
    dfree(cc->ok); dfree(cc->ov); dfree(cc->opos);
    dfree(cc->act); dfree(cc->dec_ws); dfree(cc->score_ws); dfree(cc->logits); dfree(cc->scores);
    dfree(cc->exp_d); dfree(cc->step_d);
    if (cc->exp_h) cudaFreeHost(cc->exp_h);
    if (cc->step_h) {
        cudaFreeHost(cc->step_h);
        for (int i = 0; i < GRAPH_RING; i++) cudaEventDestroy(cc->step_ev[i]);
    }
    if (cc->gexec) cudaGraphExecDestroy(cc->gexec);
    free(cc->L); free(cc->O); free(cc->len_h);
    free(cc);
    kv->cuda = NULL;
}

extern "C" int kvz_cuda_kv_set_layer(kvz_kv *kv, int32_t layer, const uint32_t *counts,
                                     const int32_t *pos, const float *k, const float *v)
{
    kvz_cuda_cache *cc = kv->cuda;
    const size_t hd = (size_t)kv->head_dim, cap = (size_t)kv->cap;
    size_t total = 0;
    for (int32_t h = 0; h < kv->n_kv_head; h++) total += counts[h];
    uint16_t *kb = (uint16_t *)malloc((total ? total : 1) * hd * 2);
    uint16_t *vb = (uint16_t *)malloc((total ? total : 1) * hd * 2);
    if (!kb || !vb) { free(kb); free(vb); return KVZ_ERR_NOMEM; }
    for (size_t i = 0; i < total * hd; i++) {
        kb[i] = h_f2bf(k[i]);
        vb[i] = h_f2bf(v[i]);
    }
    const cudaStream_t s = kv->m->cuda->s;
    size_t off = 0;
    int rc = 0;
    for (int32_t h = 0; h < kv->n_kv_head && !rc; h++) {
        const size_t n = counts[h], seg = (size_t)layer * kv->n_kv_head + (size_t)h;
        if (n &&
            (cudaMemcpyAsync(cc->k + seg * cap * hd, kb + off * hd, n * hd * 2, cudaMemcpyHostToDevice, s) ||
             cudaMemcpyAsync(cc->v + seg * cap * hd, vb + off * hd, n * hd * 2, cudaMemcpyHostToDevice, s) ||
             cudaMemcpyAsync(cc->pos + seg * cap, pos + off, n * 4, cudaMemcpyHostToDevice, s)))
            rc = kvz_error_set(KVZ_ERR_CUDA, "set_layer: cudaMemcpyAsync failed");
        kv->len[seg] = (int64_t)n;
        off += n;
    }
    if (!rc) rc = kvz_cuda_kv_sync(kv, 0);
    free(kb);
    free(vb);
    return rc;
}

extern "C" int kvz_cuda_kv_get_head(const kvz_kv *kv, int32_t layer, int32_t head, float *k,
                                    float *v, int32_t *pos)
{
    kvz_cuda_cache *cc = kv->cuda;
    const size_t hd = (size_t)kv->head_dim, cap = (size_t)kv->cap;
    const size_t seg = (size_t)layer * kv->n_kv_head + (size_t)head, n = (size_t)kv->len[seg];
    KVZ_CUDA_TRY(cudaStreamSynchronize(kv->m->cuda->s));
    if (n == 0) return 0;
    uint16_t *b = (uint16_t *)malloc(n * hd * 2);
    if (!b) return KVZ_ERR_NOMEM;
    int rc = 0;
    for (int which = 0; which < 2 && !rc; which++) {
        float *dst = which ? v : k;
        if (!dst) continue;
        const bf16 *src = (which ? cc->v : cc->k) + seg * cap * hd;
        if (cudaMemcpy(b, src, n * hd * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
            rc = kvz_error_set(KVZ_ERR_CUDA, "get_head: cudaMemcpy failed");
            break;
        }
        for (size_t i = 0; i < n * hd; i++) dst[i] = h_bf2f(b[i]);
    }
    if (!rc && pos && cudaMemcpy(pos, cc->pos + seg * cap, n * 4, cudaMemcpyDeviceToHost) != cudaSuccess)
        rc = kvz_error_set(KVZ_ERR_CUDA, "get_head: cudaMemcpy failed");
    free(b);
    return rc;
}

/* One layer's rows [0, len[h]) of every head, back to back, converted on the device to
 * the stored dtype and copied once through pinned memory. Returned pointers are valid
 * until the next call on this cache or kvz_kv_free. */
extern "C" int kvz_cuda_kv_export_layer(const kvz_kv *kv, int32_t layer, uint8_t dtype,
                                        const uint32_t **pos, const void **k, const void **v)
{
    kvz_cuda_cache *cc = kv->cuda;
    if (!cc || layer < 0 || layer >= kv->n_layer || kv->n_kv_head > 64 || dtype > 2)
        return kvz_error_set(KVZ_ERR_ARG, "kv_export_layer: bad arguments");
    /* KVZ_DTYPE_F32 = 0, F16 = 1, BF16 = 2 (format/kvz_blob.h) */
    const kvz_cuda_dtype dt = dtype == 0 ? KVZ_CUDA_F32 : dtype == 1 ? KVZ_CUDA_F16 : KVZ_CUDA_BF16;
    const size_t esz = dtype == 0 ? 4 : 2, hd = (size_t)kv->head_dim;
    int32_t rows[64];
    size_t total = 0;
    for (int32_t h = 0; h < kv->n_kv_head; h++) {
        rows[h] = (int32_t)kv->len[(size_t)layer * kv->n_kv_head + h];
        total += (size_t)rows[h];
    }
    const size_t kb = al256(total * hd * esz), need = 2 * kb + al256(total * 4);
    if (need > cc->exp_d_bytes) {
        dfree(cc->exp_d);
        cc->exp_d = NULL;
        cc->exp_d_bytes = 0;
        TRY(dmalloc(&cc->exp_d, need, "export staging"));
        cc->exp_d_bytes = need;
    }
    if (need > cc->exp_h_bytes) {
        if (cc->exp_h) cudaFreeHost(cc->exp_h);
        cc->exp_h = NULL;
        cc->exp_h_bytes = 0;
        KVZ_CUDA_TRY(cudaHostAlloc(&cc->exp_h, need, cudaHostAllocDefault));
        cc->exp_h_bytes = need;
    }
    const cudaStream_t s = kv->m->cuda->s;
    char *d = (char *)cc->exp_d, *h = (char *)cc->exp_h;
    TRY(kvz_cuda_kv_export(s, &cc->L[layer], rows, dt, d, d + kb, (int32_t *)(d + 2 * kb)));
    const size_t used = 2 * kb + total * 4;
    KVZ_CUDA_TRY(cudaMemcpyAsync(h, d, used, cudaMemcpyDeviceToHost, s));
    KVZ_CUDA_TRY(cudaStreamSynchronize(s));
    *k = h;
    *v = h + kb;
    *pos = (const uint32_t *)(h + 2 * kb);
    return 0;
}

/* ====================================================================== */
/* small kernels                                                            */

__global__ void iota_kernel(int32_t *p, int32_t v0, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v0 + i;
}

/* evict[l] < 0 (no evictable slot: B too small for the sinks) → last slot, as on the CPU */
__global__ void evict_fix_kernel(int32_t *evict, int B)
{
    if (threadIdx.x == 0 && *evict < 0) *evict = B - 1;
}

__device__ __forceinline__ float blk_max(float v, float *sh)
{
    v = kvz_warp_max(v);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = -INFINITY;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) r = fmaxf(r, sh[i]);
    return r;
}

/* Reference attention for head dims the tiled kernels do not cover (tests' tiny
 * shapes): one block per (query, head), 128 keys per tile, online softmax. */
#define NA_THREADS 128
__global__ void naive_attn_kernel(const bf16 *__restrict__ q, int ldq, const int32_t *__restrict__ qpos,
                                  kvz_cuda_kv kv, kvz_cuda_outbuf ob, int n_slot, int G,
                                  bf16 *__restrict__ o, int ldo)
{
    __shared__ float qs[256];
    __shared__ float p[NA_THREADS];
    __shared__ float red[NA_THREADS / 32];
    const int t = blockIdx.x, h = blockIdx.y, kh = h / G, hd = kv.hd, tid = threadIdx.x;
    const int32_t qp = qpos[t];
    const float scale = rsqrtf((float)hd);
    for (int i = tid; i < hd; i += NA_THREADS) qs[i] = __bfloat162float(q[(size_t)t * ldq + (size_t)h * hd + i]);
    const int len = kv.len[kh], nk = len + n_slot;
    float m = -INFINITY, l = 0.f, acc0 = 0.f, acc1 = 0.f;
    __syncthreads();
    for (int base = 0; base < nk; base += NA_THREADS) {
        const int j = base + tid;
        float s = -INFINITY;
        if (j < nk) {
            const bf16 *kr = NULL;
            if (j < len) {
                if (kv.pos[(size_t)kh * kv.cap + j] <= qp) kr = (const bf16 *)kv.k + ((size_t)kh * kv.cap + j) * hd;
            } else {
                int sl = j - len, sp = ob.slot_pos[sl];
                if (sp >= 0 && sp <= qp) kr = (const bf16 *)ob.k + ((size_t)kh * n_slot + sl) * hd;
            }
            if (kr) {
                float acc = 0.f;
                for (int i = 0; i < hd; i++) acc += qs[i] * __bfloat162float(kr[i]);
                s = acc * scale;
            }
        }
        const float tm = blk_max(s, red);
        const float nm = fmaxf(m, tm);
        if (nm == -INFINITY) continue; /* uniform across the block */
        const float pj = s == -INFINITY ? 0.f : __expf(s - nm);
        p[tid] = pj;
        const float corr = m == -INFINITY ? 0.f : __expf(m - nm);
        const float ts = kvz_block_sum(pj); /* syncs: p visible */
        l = l * corr + ts;
        acc0 *= corr;
        acc1 *= corr;
        const int tn = min(NA_THREADS, nk - base);
        for (int jj = 0; jj < tn; jj++) {
            const float w = p[jj];
            if (w == 0.f) continue;
            const int jk = base + jj;
            const bf16 *vr = jk < len ? (const bf16 *)kv.v + ((size_t)kh * kv.cap + jk) * hd
                                      : (const bf16 *)ob.v + ((size_t)kh * n_slot + (jk - len)) * hd;
            if (tid < hd) acc0 += w * __bfloat162float(vr[tid]);
            if (tid + NA_THREADS < hd) acc1 += w * __bfloat162float(vr[tid + NA_THREADS]);
        }
        m = nm;
        __syncthreads();
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    bf16 *orow = o + (size_t)t * ldo + (size_t)h * hd;
    if (tid < hd) orow[tid] = __float2bfloat16_rn(acc0 * inv);
    if (tid + NA_THREADS < hd) orow[tid + NA_THREADS] = __float2bfloat16_rn(acc1 * inv);
}

/* ====================================================================== */
/* forward                                                                  */

/* A batch of KVzip repeat inputs (kvz_cuda_kvzip_repeat): chunk i owns batch rows
 * [r0[i], r0[i] + ch[i].n) and cache rows ctx_end + r0[i]..; pos: host positions of
 * every batch row. */
typedef struct score_args {
    int32_t n_prefix, n_ctx, n_ch;
    const kvz_repeat_chunk *ch;
    const int32_t *r0, *pos;
} score_args;

static int attention(kvz_model *m, kvz_kv *kv, int32_t l, int32_t n, act_view *a, int use_ob,
                     int want_evict, int graph)
{
    const kvz_config *c = &m->cfg;
    kvz_cuda_cache *cc = kv->cuda;
    const cudaStream_t s = m->cuda->s;
    const int hd = c->head_dim, G = c->n_head / c->n_kv_head, qd = c->n_head * hd;
    const int nqkv = qd + 2 * c->n_kv_head * hd;
    kvz_cuda_outbuf *ob = use_ob ? &cc->O[l] : NULL;
    if (ob) ob->n_sink = kv->n_sink;
    int64_t max_len = 0;
    for (int32_t h = 0; h < c->n_kv_head; h++) {
        int64_t v = kv->len[(size_t)l * c->n_kv_head + h];
        max_len = v > max_len ? v : max_len;
    }
    if (graph) max_len = kv->cap; /* fixed split grid: splits past len[h] exit at once */
    int32_t *evict = want_evict ? cc->evict + l : NULL;
    if (hd != 64 && hd != 128) {
        if (want_evict)
            return kvz_error_set(KVZ_ERR_UNSUPPORTED, "CUDA LongFlow eviction needs head_dim 64 or 128");
        naive_attn_kernel<<<dim3(n, c->n_head), NA_THREADS, 0, s>>>(
            a->qkv, nqkv, a->pos, cc->L[l], ob ? *ob : kvz_cuda_outbuf{}, ob ? ob->n_slot : 0, G, a->att, qd);
        KVZ_LAUNCH_CHECK("naive_attn");
        return 0;
    }
    if (n * G <= 32) {
        TRY(kvz_cuda_attn_decode(s, n, c->n_head, a->qkv, nqkv, a->pos, &cc->L[l], (int)max_len, ob,
                                 a->att, qd, cc->dec_ws, cc->dec_ws_bytes, NULL, evict));
    } else {
        TRY(kvz_cuda_attn_prefill(s, n, c->n_head, a->qkv, nqkv, a->pos, &cc->L[l], ob, a->att, qd));
        if (evict) /* the prefill kernel has no LongFlow scores: one decode call for the last query */
            TRY(kvz_cuda_attn_decode(s, 1, c->n_head, a->qkv + (size_t)(n - 1) * nqkv, nqkv,
                                     a->pos + n - 1, &cc->L[l], (int)max_len, ob, a->att1, qd,
                                     cc->dec_ws, cc->dec_ws_bytes, NULL, evict));
    }
    if (evict && ob->n_slot <= kv->n_sink + 1) { /* no evictable slot possible: CPU's fallback */
        evict_fix_kernel<<<1, 32, 0, s>>>(evict, ob->n_slot);
        KVZ_LAUNCH_CHECK("evict_fix");
    }
    return 0;
}

/* Window policy: victim = oldest position among evictable slots (host mirror). */
static int32_t window_victim(const kvz_kv *kv, int32_t l, int32_t newest)
{
    const int32_t B = kv->out_slots, *OP = kv->opos + (size_t)l * B;
    int32_t best = -1;
    for (int32_t j = kv->n_sink; j < B; j++) {
        if (j == newest) continue;
        if (best < 0 || OP[j] < OP[best]) best = j;
    }
    return best >= 0 ? best : B - 1;
}

/* Per-layer work of one pass, enqueued on the model stream. graph = 1: the batch-1
 * decode step in its capturable form (token, position and fill slot read from
 * cc->step_d, fixed attention split grid, output-buffer slot chosen on the device,
 * no host state touched here); the caller updates the host lengths afterwards. */
static int layers_enqueue(kvz_model *m, kvz_kv *kv, int32_t n, int32_t pos0, act_view *a, int doc,
                          int32_t slot0, int want_evict, int graph, int32_t *newest, const score_args *sa)
{
    const kvz_config *c = &m->cfg;
    kvz_cuda_model *g = m->cuda;
    kvz_cuda_cache *cc = kv->cuda;
    const cudaStream_t s = g->s;
    const int d = c->n_embd, hd = c->head_dim, qd = c->n_head * hd, kvd = c->n_kv_head * hd,
              ff = c->n_ff, nqkv = qd + 2 * kvd, nkv = c->n_kv_head;
    const kvz_cuda_rope_layout rl = c->rope_adjacent ? KVZ_ROPE_ADJACENT : KVZ_ROPE_HALF;
    const int32_t B = kv->out_slots;
    TRY(kvz_cuda_embed(s, g->tok_embd, c->n_vocab, d, a->tok, n, a->x, KVZ_CUDA_F32));
    for (int32_t l = 0; l < c->n_layer; l++) {
        const cuda_layer *L = &g->L[l];
        if (n == 1) { /* decode: RMSNorm inside the qkv GEMV; RoPE fused with the K/V write */
            TRY(kvz_cuda_linear_rmsnorm(g->blas, s, d, nqkv, a->x, L->attn_norm, c->norm_eps, L->wqkv, L->bqkv,
                                        a->qkv, KVZ_CUDA_BF16, 0.f, a->xn));
            if (doc) {
                TRY(kvz_cuda_rope_kv_append(s, c->n_head, nkv, hd, a->qkv, a->pos, c->rope_theta, rl, L->q_norm,
                                            L->k_norm, c->norm_eps, &cc->L[l]));
                if (!graph)
                    for (int h = 0; h < nkv; h++) kv->len[(size_t)l * nkv + h] += 1;
            } else {
                int32_t slot = -1;
                const int32_t *d_fill = NULL, *d_evict = cc->evict + l;
                if (graph) d_fill = cc->step_d + 2;
                else if (slot0 >= 0) slot = slot0;
                else if (kv->out_policy == KVZ_OUT_WINDOW) {
                    slot = window_victim(kv, l, kv->newest[l]);
                    kv->opos[(size_t)l * B + slot] = pos0;
                    *newest = slot;
                }
                TRY(kvz_cuda_rope_outbuf_write(s, c->n_head, nkv, hd, a->qkv, a->pos, c->rope_theta, rl, L->q_norm,
                                               L->k_norm, c->norm_eps, &cc->O[l], slot, d_fill, d_evict));
            }
        } else {
            TRY(kvz_cuda_rmsnorm(s, n, d, c->norm_eps, a->x, NULL, KVZ_CUDA_F32, L->attn_norm, a->xn, KVZ_CUDA_BF16));
            TRY(kvz_cuda_linear(g->blas, s, n, d, nqkv, a->xn, d, L->wqkv, L->bqkv, a->qkv, KVZ_CUDA_BF16, nqkv, 0.f));
            TRY(kvz_cuda_rope(s, n, c->n_head, nkv, hd, a->qkv, nqkv, a->qkv + qd, nqkv, a->pos, c->rope_theta,
                              rl, L->q_norm, L->k_norm, c->norm_eps));
            const bf16 *kn = a->qkv + qd, *vn = a->qkv + qd + kvd;
            if (doc) {
                TRY(kvz_cuda_kv_append(s, &cc->L[l], n, kn, nqkv, vn, nqkv, a->pos));
                if (!graph)
                    for (int h = 0; h < nkv; h++) kv->len[(size_t)l * nkv + h] += n;
            } else if (graph) {
                TRY(kvz_cuda_outbuf_write_dev(s, &cc->O[l], nkv, hd, kn, nqkv, vn, nqkv, a->pos, cc->step_d + 2,
                                              cc->evict + l));
            } else if (slot0 >= 0) {
                TRY(kvz_cuda_outbuf_write(s, &cc->O[l], nkv, hd, n, kn, nqkv, vn, nqkv, a->pos, slot0, NULL));
            } else if (kv->out_policy == KVZ_OUT_WINDOW) {
                int32_t v = window_victim(kv, l, kv->newest[l]);
                TRY(kvz_cuda_outbuf_write(s, &cc->O[l], nkv, hd, 1, kn, nqkv, vn, nqkv, a->pos, v, NULL));
                kv->opos[(size_t)l * B + v] = pos0;
                *newest = v;
            } else {
                TRY(kvz_cuda_outbuf_write(s, &cc->O[l], nkv, hd, 1, kn, nqkv, vn, nqkv, a->pos, -1, cc->evict + l));
            }
        }
        if (sa) {
            const int32_t ctx_end = sa->n_prefix + sa->n_ctx;
            const int last = l == c->n_layer - 1;
            for (int32_t i = 0; i < sa->n_ch; i++) {
                const kvz_repeat_chunk *k = &sa->ch[i];
                const kvz_cuda_kvzip_rows rows = {sa->n_prefix, sa->n_prefix + k->c0, sa->n_prefix + k->c1, ctx_end,
                                                  ctx_end + sa->r0[i], ctx_end + sa->r0[i] + k->n};
                const bf16 *q = a->qkv + (size_t)sa->r0[i] * nqkv;
                const int32_t *qp = a->pos + sa->r0[i];
                float *sc = cc->scores + (size_t)l * nkv * sa->n_ctx + k->c0;
                if (last) {
                    /* last layer: its scores are all the repeat pass still needs, so score over
                     * the key subset alone (two passes over K̄) and skip the attention over the
                     * whole context, the output projection and the MLP */
                    TRY(kvz_cuda_kvzip_score(s, k->n, c->n_head, q, nqkv, qp, &cc->L[l], &rows, sc, sa->n_ctx,
                                             cc->score_ws, cc->score_ws_bytes, a->att + (size_t)sa->r0[i] * qd, qd));
                    continue;
                }
                /* the attention the hidden states need, with the subset statistics fused in;
                 * then one pass over the chunk keys */
                TRY(kvz_cuda_attn_prefill_kvzip(s, k->n, c->n_head, q, nqkv, qp, &cc->L[l],
                                                a->att + (size_t)sa->r0[i] * qd, qd, &rows, cc->score_ws,
                                                cc->score_ws_bytes));
                TRY(kvz_cuda_kvzip_score_fused(s, k->n, c->n_head, q, nqkv, qp, &cc->L[l], rows.c0, rows.c1, sc,
                                               sa->n_ctx, cc->score_ws, cc->score_ws_bytes));
            }
            if (last) break;
        } else {
            TRY(attention(m, kv, l, n, a, !doc, want_evict, graph));
        }
        TRY(kvz_cuda_linear(g->blas, s, n, qd, d, a->att, qd, L->wo, NULL, a->x, KVZ_CUDA_F32, d, 1.f));
        if (n == 1) { /* decode: RMSNorm and SwiGLU inside the gate|up GEMV */
            TRY(kvz_cuda_linear_rmsnorm_swiglu(g->blas, s, d, ff, a->x, L->ffn_norm, c->norm_eps, L->wgu, a->hb,
                                               a->xn, a->gu));
        } else {
            TRY(kvz_cuda_rmsnorm(s, n, d, c->norm_eps, a->x, NULL, KVZ_CUDA_F32, L->ffn_norm, a->xn, KVZ_CUDA_BF16));
            TRY(kvz_cuda_linear(g->blas, s, n, d, 2 * ff, a->xn, d, L->wgu, NULL, a->gu, KVZ_CUDA_BF16, 2 * ff, 0.f));
            TRY(kvz_cuda_swiglu(s, n, ff, a->gu, 2 * ff, a->gu + ff, 2 * ff, a->hb, ff));
        }
        TRY(kvz_cuda_linear(g->blas, s, n, ff, d, a->hb, ff, L->wdown, NULL, a->x, KVZ_CUDA_F32, d, 1.f));
    }
    return 0;
}

static int graph_wanted(void)
{
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("KVZ_CUDA_GRAPH");
        on = !(e && e[0] == '0');
    }
    return on;
}

/* Batch-1 decode step through a CUDA graph: captured on the second step with the same
 * shape (the first runs the same kernels eagerly), replayed afterwards. Inputs go to
 * cc->step_d from a pinned ring; logits (if wanted) come back after the replay. */
static int decode_graph_step(kvz_model *m, kvz_kv *kv, int32_t tok, int32_t pos0, float *logits,
                             int doc, int32_t slot0, int want_evict)
{
    const kvz_config *c = &m->cfg;
    kvz_cuda_cache *cc = kv->cuda;
    const cudaStream_t s = m->cuda->s;
    const size_t V = (size_t)c->n_vocab;
    act_view a;
    TRY(ensure_act(kv, 1, &a));
    if (logits && !cc->logits) TRY(dmalloc((void **)&cc->logits, (size_t)KVZ_GPU_LOGIT_ROWS * V * 4, "logits"));
    if (!cc->step_d) {
        TRY(dmalloc((void **)&cc->step_d, 16, "decode step inputs"));
        KVZ_CUDA_TRY(cudaHostAlloc((void **)&cc->step_h, GRAPH_RING * 16, cudaHostAllocDefault));
        for (int i = 0; i < GRAPH_RING; i++)
            KVZ_CUDA_TRY(cudaEventCreateWithFlags(&cc->step_ev[i], cudaEventDisableTiming));
    }
    int32_t *in = cc->step_h + 4 * cc->step_i;
    KVZ_CUDA_TRY(cudaEventSynchronize(cc->step_ev[cc->step_i])); /* this entry's last copy is done */
    in[0] = tok;
    in[1] = pos0;
    in[2] = slot0; /* >= 0: filling slot; -1: the victim of the last step (evict[l]) */
    in[3] = 0;
    KVZ_CUDA_TRY(cudaMemcpyAsync(cc->step_d, in, 16, cudaMemcpyHostToDevice, s));
    KVZ_CUDA_TRY(cudaEventRecord(cc->step_ev[cc->step_i], s));
    cc->step_i = (cc->step_i + 1) % GRAPH_RING;
    a.tok = cc->step_d;
    a.pos = cc->step_d + 1;

    kvz_cuda_cache::graph_key key;
    memset(&key, 0, sizeof key);
    key.k = cc->k; key.ok = cc->ok; key.act = cc->act; key.logits = logits ? cc->logits : NULL;
    key.act_T = cc->act_T; key.doc = doc; key.want = logits != NULL; key.n_sink = kv->n_sink; key.policy = kv->out_policy;
    if (memcmp(&key, &cc->gkey, sizeof key)) {
        if (cc->gexec) cudaGraphExecDestroy(cc->gexec);
        cc->gexec = NULL;
        cc->gkey = key;
        cc->gseen = 0;
    }
    int32_t newest = -1;
    auto enqueue = [&]() -> int {
        TRY(layers_enqueue(m, kv, 1, pos0, &a, doc, slot0, want_evict, 1, &newest, NULL));
        if (logits) {
            TRY(kvz_cuda_linear_rmsnorm(m->cuda->blas, s, c->n_embd, c->n_vocab, a.x, m->cuda->out_norm,
                                        c->norm_eps, m->cuda->output, NULL, cc->logits, KVZ_CUDA_F32, 0.f, a.xn));
        }
        return 0;
    };
    if (!cc->gexec && cc->gseen >= 1 && !cc->gdisabled) {
        cudaGraph_t graph = NULL;
        int rc = 0;
        if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) rc = KVZ_ERR_CUDA;
        if (!rc) {
            rc = enqueue();
            cudaError_t e = cudaStreamEndCapture(s, &graph);
            if (!rc && e != cudaSuccess) rc = KVZ_ERR_CUDA;
        }
        if (!rc && cudaGraphInstantiate(&cc->gexec, graph, 0) != cudaSuccess) {
            cc->gexec = NULL;
            rc = KVZ_ERR_CUDA;
        }
        if (graph) cudaGraphDestroy(graph);
        if (rc) { /* fall back to eager launches for this cache */
            cudaGetLastError();
            kvz_error_clear();
            cc->gdisabled = 1;
        }
    }
    if (cc->gexec) {
        KVZ_CUDA_TRY(cudaGraphLaunch(cc->gexec, s));
        g_graph_launches++;
    } else {
        TRY(enqueue());
        cc->gseen++;
    }
    if (logits) {
        KVZ_CUDA_TRY(cudaMemcpyAsync(logits, cc->logits, V * 4, cudaMemcpyDeviceToHost, s));
        KVZ_CUDA_TRY(cudaStreamSynchronize(s));
    }
    return 0;
}

static int forward_batch(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                         float *logits, int want, int to_doc, const score_args *sa)
{
    const kvz_config *c = &m->cfg;
    kvz_cuda_model *g = m->cuda;
    kvz_cuda_cache *cc = kv->cuda;
    const cudaStream_t s = g->s;
    const int d = c->n_embd, hd = c->head_dim, nkv = c->n_kv_head;
    const int doc = kv->out_slots == 0 || to_doc;
    const size_t nlh = (size_t)c->n_layer * nkv;
    if (doc) {
        for (size_t i = 0; i < nlh; i++)
            if (kv->len[i] + n > kv->cap)
                return kvz_error_set(KVZ_ERR_CONTEXT, "KV cache full: %lld + %d rows exceed "
                                     "capacity %lld", (long long)kv->len[i], n, (long long)kv->cap);
    } else if (n > 1 && kv->out_used[0] + n > kv->out_slots) {
        return kvz_error_set(KVZ_ERR_CONTEXT, "%d tokens do not fit the output buffer (%d of %d "
                             "slots used); a multi-token pass must fit in the free slots",
                             n, kv->out_used[0], kv->out_slots);
    }
    const int32_t B = kv->out_slots;
    const int tiled = hd == 64 || hd == 128;

    /* output-buffer slots of this pass (same for every layer: they fill in lockstep) */
    int32_t slot0 = -1, newest = -1;
    int full_before = 0, full_after = 0;
    if (!doc) {
        full_before = kv->out_used[0] >= B;
        full_after = full_before || kv->out_used[0] + n >= B;
        if (!full_before) slot0 = kv->out_used[0];
    }
    /* LongFlow: a decode step always scores the buffer (victim unused while it fills),
     * so a step costs the same whether the buffer is filling or full */
    const int longflow = !doc && kv->out_policy == KVZ_OUT_LONGFLOW;
    const int want_evict = longflow && (full_after || (n == 1 && tiled));
    const int graph = n == 1 && !sa && tiled && c->n_head / nkv <= 32 && graph_wanted() &&
                      (doc || longflow) && (want == KVZ_FWD_NO_LOGITS || logits);
    if (graph) {
        TRY(decode_graph_step(m, kv, tokens[0], pos0, want == KVZ_FWD_NO_LOGITS ? NULL : logits, doc, slot0,
                              want_evict));
        if (doc)
            for (size_t i = 0; i < nlh; i++) kv->len[i] += 1; /* checked against cap above */
    } else {
        act_view a;
        TRY(ensure_act(kv, n, &a));
        KVZ_CUDA_TRY(cudaMemcpyAsync(a.tok, tokens, (size_t)n * 4, cudaMemcpyHostToDevice, s));
        if (sa) {
            KVZ_CUDA_TRY(cudaMemcpyAsync(a.pos, sa->pos, (size_t)n * 4, cudaMemcpyHostToDevice, s));
        } else {
            iota_kernel<<<(n + 255) / 256, 256, 0, s>>>(a.pos, pos0, n);
            KVZ_LAUNCH_CHECK("iota");
        }
        TRY(layers_enqueue(m, kv, n, pos0, &a, doc, slot0, want_evict, 0, &newest, sa));
        if (want != KVZ_FWD_NO_LOGITS && logits) {
            const int32_t first = want == KVZ_FWD_LOGITS_ALL ? 0 : n - 1;
            const size_t V = (size_t)c->n_vocab;
            if (!cc->logits) TRY(dmalloc((void **)&cc->logits, (size_t)KVZ_GPU_LOGIT_ROWS * V * 4, "logits"));
            for (int32_t r0 = first; r0 < n; r0 += KVZ_GPU_LOGIT_ROWS) {
                const int32_t rows = n - r0 < KVZ_GPU_LOGIT_ROWS ? n - r0 : KVZ_GPU_LOGIT_ROWS;
                TRY(kvz_cuda_rmsnorm(s, rows, d, c->norm_eps, a.x + (size_t)r0 * d, NULL, KVZ_CUDA_F32,
                                     g->out_norm, a.xn, KVZ_CUDA_BF16));
                TRY(kvz_cuda_linear(g->blas, s, rows, d, c->n_vocab, a.xn, d, g->output, NULL, cc->logits,
                                    KVZ_CUDA_F32, c->n_vocab, 0.f));
                KVZ_CUDA_TRY(cudaMemcpyAsync(logits + (size_t)(r0 - first) * V, cc->logits,
                                             (size_t)rows * V * 4, cudaMemcpyDeviceToHost, s));
                KVZ_CUDA_TRY(cudaStreamSynchronize(s));
            }
        }
    }
    /* host bookkeeping of the output buffer (mirrors kvz_cpu.c append_kv) */
    if (!doc) {
        for (int32_t l = 0; l < c->n_layer; l++) {
            if (slot0 >= 0) {
                for (int32_t i = 0; i < n; i++) kv->opos[(size_t)l * B + slot0 + i] = pos0 + i;
                kv->out_used[l] += n;
                kv->newest[l] = slot0 + n - 1;
            } else {
                kv->evictions++;
                if (newest >= 0) kv->newest[l] = newest;
            }
        }
    }
    return 0;
}

static int forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n, int32_t pos0,
                   float *logits, int flags, const score_args *sa)
{
    const int want = flags & 3;
    const int discard = (flags & KVZ_FWD_DISCARD) != 0;
    if (!kv->cuda) return kvz_error_set(KVZ_ERR_ARG, "CUDA forward: the cache is not on the device");
    if (discard && kv->out_slots && !(flags & KVZ_FWD_TO_DOC))
        return kvz_error_set(KVZ_ERR_ARG, "forward: DISCARD works on the document region only");
    const size_t nlh = (size_t)m->cfg.n_layer * m->cfg.n_kv_head;
    int64_t *saved = NULL;
    if (discard) {
        if (!(saved = (int64_t *)malloc(nlh * sizeof *saved))) return KVZ_ERR_NOMEM;
        memcpy(saved, kv->len, nlh * sizeof *saved);
    }
    int rc = 0;
    for (int32_t s0 = 0; s0 < n && !rc; s0 += KVZ_GPU_MAX_BATCH) {
        const int32_t nb = n - s0 < KVZ_GPU_MAX_BATCH ? n - s0 : KVZ_GPU_MAX_BATCH;
        const int last = s0 + nb == n;
        float *lg = NULL;
        int w = KVZ_FWD_NO_LOGITS;
        if (logits && want == KVZ_FWD_LOGITS_ALL) {
            lg = logits + (size_t)s0 * m->cfg.n_vocab;
            w = KVZ_FWD_LOGITS_ALL;
        } else if (logits && want == KVZ_FWD_LOGITS_LAST && last) {
            lg = logits;
            w = KVZ_FWD_LOGITS_LAST;
        }
        rc = forward_batch(m, kv, tokens + s0, nb, pos0 + s0, lg, w, (flags & KVZ_FWD_TO_DOC) != 0, sa);
    }
    if (discard) {
        memcpy(kv->len, saved, nlh * sizeof *saved);
        free(saved);
        int rc2 = kvz_cuda_kv_sync(kv, 0);
        if (!rc) rc = rc2;
    }
    return rc;
}

extern "C" int kvz_cuda_forward(kvz_model *m, kvz_kv *kv, const int32_t *tokens, int32_t n,
                                int32_t pos0, float *logits, int flags, const kvz_layer_hook *hook)
{
    if (hook && hook->fn)
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "layer hooks run on the CPU backend only "
                             "(KVzip scoring on CUDA uses kvz_cuda_kvzip_repeat)");
    return forward(m, kv, tokens, n, pos0, logits, flags, NULL);
}

/* ====================================================================== */
/* KVzip on the device                                                      */

extern "C" int kvz_cuda_kvzip_repeat(kvz_model *m, kvz_kv *kv, const int32_t *tokens, const kvz_repeat_chunk *ch,
                                     int32_t n_ch, int32_t pos0, int32_t n_prefix, float *scores, int32_t n_ctx)
{
    const kvz_config *c = &m->cfg;
    kvz_cuda_cache *cc = kv->cuda;
    if (!cc || kv->out_slots) return kvz_error_set(KVZ_ERR_ARG, "kvzip: needs a device cache without output buffer");
    if (c->head_dim != 64 && c->head_dim != 128)
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "CUDA KVzip scoring needs head_dim 64 or 128");
    int64_t n = 0;
    for (int32_t i = 0; i < n_ch; i++) {
        if (ch[i].n <= 0 || ch[i].c0 < 0 || ch[i].c0 > ch[i].c1 || ch[i].c1 > n_ctx)
            return kvz_error_set(KVZ_ERR_ARG, "kvzip_repeat: bad chunk %d (%d tokens, context %d..%d of %d)", i,
                                 ch[i].n, ch[i].c0, ch[i].c1, n_ctx);
        n += ch[i].n;
    }
    if (n_ch <= 0 || n > KVZ_GPU_MAX_BATCH || n_prefix < 0 || n_ctx <= 0)
        return kvz_error_set(KVZ_ERR_ARG, "kvzip_repeat: %d chunks of %lld tokens in all (at most %d per pass)",
                             n_ch, (long long)n, KVZ_GPU_MAX_BATCH);
    const size_t nlh = (size_t)c->n_layer * c->n_kv_head;
    for (size_t i = 0; i < nlh; i++)
        if (kv->len[i] != (int64_t)n_prefix + n_ctx)
            return kvz_error_set(KVZ_ERR_ARG, "kvzip_repeat: the cache must hold exactly prefix + context");
    const int64_t N = (int64_t)nlh * n_ctx;
    if (cc->scores_n != N) {
        dfree(cc->scores);
        cc->scores = NULL;
        cc->scores_n = 0;
        TRY(dmalloc((void **)&cc->scores, (size_t)N * 4, "kvzip scores"));
        cc->scores_n = N;
        KVZ_CUDA_TRY(cudaMemsetAsync(cc->scores, 0, (size_t)N * 4, m->cuda->s));
    }
    int32_t longest = 0;
    for (int32_t i = 0; i < n_ch; i++) longest = ch[i].n > longest ? ch[i].n : longest;
    const size_t wsb = kvz_cuda_kvzip_score_ws_size(longest, c->n_head); /* chunks run one after another */
    if (wsb > cc->score_ws_bytes) {
        dfree(cc->score_ws);
        cc->score_ws = NULL;
        cc->score_ws_bytes = 0;
        TRY(dmalloc(&cc->score_ws, wsb, "kvzip score workspace"));
        cc->score_ws_bytes = wsb;
    }
    int32_t *r0 = (int32_t *)malloc(sizeof(int32_t) * ((size_t)n_ch + (size_t)n));
    if (!r0) return KVZ_ERR_NOMEM;
    int32_t *pos = r0 + n_ch;
    for (int32_t i = 0, r = 0; i < n_ch; r += ch[i].n, i++) {
        r0[i] = r;
        for (int32_t j = 0; j < ch[i].n; j++) pos[r + j] = pos0 + j;
    }
    const score_args sa = {n_prefix, n_ctx, n_ch, ch, r0, pos};
    int rc = forward(m, kv, tokens, (int32_t)n, pos0, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_DISCARD, &sa);
    free(r0);
    TRY(rc);
    if (!scores) return 0; /* they stay on the device (kvz_cuda_kvzip_select) */
    for (int32_t i = 0; i < n_ch; i++)
        if (ch[i].c1 > ch[i].c0)
            KVZ_CUDA_TRY(cudaMemcpy2DAsync(scores + ch[i].c0, (size_t)n_ctx * 4, cc->scores + ch[i].c0,
                                           (size_t)n_ctx * 4, (size_t)(ch[i].c1 - ch[i].c0) * 4, nlh,
                                           cudaMemcpyDeviceToHost, m->cuda->s));
    KVZ_CUDA_TRY(cudaStreamSynchronize(m->cuda->s));
    return 0;
}

static int64_t kvzip_select(kvz_kv *kv, int32_t n_prefix, int32_t n_ctx, float ratio, int32_t mode,
                            uint8_t *keep, uint32_t *counts)
{
    const kvz_model *m = kv->m;
    const kvz_config *c = &m->cfg;
    kvz_cuda_cache *cc = kv->cuda;
    const cudaStream_t s = m->cuda->s;
    const size_t nlh = (size_t)c->n_layer * c->n_kv_head, N = nlh * (size_t)n_ctx;
    if (!cc || !cc->scores || cc->scores_n != (int64_t)N)
        return kvz_error_set(KVZ_ERR_ARG, "kvzip_select: no device scores for %d context tokens", n_ctx);
    if (!(ratio > 0.0f && ratio <= 1.0f)) return kvz_error_set(KVZ_ERR_ARG, "ratio must be in (0, 1]");
    if (N > INT32_MAX) return kvz_error_set(KVZ_ERR_ARG, "too many KV pairs");
    for (size_t i = 0; i < nlh; i++)
        if (kv->len[i] != (int64_t)n_prefix + n_ctx)
            return kvz_error_set(KVZ_ERR_ARG, "kvzip_select: the cache must hold exactly prefix + context");
    uint8_t *d_keep = NULL;
    int32_t *d_counts = NULL;
    void *ws = NULL;
    bf16 *sk = NULL, *sv = NULL;
    int32_t *spos = NULL;
    int32_t *hc = (int32_t *)malloc(nlh * sizeof(int32_t));
    int64_t kept = 0;
    int rc = hc ? 0 : KVZ_ERR_NOMEM;
    if (!rc) rc = dmalloc_tmp((void **)&d_keep, N, s, "keep mask");
    if (!rc) rc = dmalloc_tmp((void **)&d_counts, nlh * 4, s, "keep counts");
    if (!rc && mode == EVICT_GLOBAL) {
        kept = (int64_t)llround((double)N * ratio);
        size_t wsb = kvz_cuda_topk_ws_size((int64_t)N);
        rc = dmalloc_tmp(&ws, wsb, s, "top-k workspace");
        if (!rc) rc = kvz_cuda_topk_global(s, cc->scores, (int64_t)N, kept, d_keep, ws, wsb);
    } else if (!rc && mode == EVICT_UNIFORM) {
        int k = (int)llround((double)n_ctx * ratio);
        kept = (int64_t)k * (int64_t)nlh;
        rc = kvz_cuda_topk_rows(s, cc->scores, (int)nlh, n_ctx, k, d_keep);
    } else if (!rc) {
        rc = kvz_error_set(KVZ_ERR_ARG, "unknown eviction mode %d", mode);
    }
    if (!rc) rc = kvz_cuda_keep_counts(s, d_keep, (int)nlh, n_ctx, d_counts);
    /* compact layer by layer through a scratch layer of prefix + context rows per head,
     * then copy the kept rows back: the cache keeps its buffers (a fresh cache-sized
     * pair of arrays cost ~4 ms of cudaMalloc/cudaFree per document even at 2K tokens) */
    const size_t hd = (size_t)c->head_dim, rows_s = (size_t)c->n_kv_head * (size_t)(n_prefix + n_ctx);
    kvz_cuda_kv tmp = cc->L[0];
    tmp.cap = n_prefix + n_ctx;
    if (!rc) rc = dmalloc_tmp((void **)&sk, rows_s * hd * 2, s, "compaction scratch K");
    if (!rc) rc = dmalloc_tmp((void **)&sv, rows_s * hd * 2, s, "compaction scratch V");
    if (!rc) rc = dmalloc_tmp((void **)&spos, rows_s * 4 + (size_t)c->n_kv_head * 4, s, "compaction scratch pos");
    tmp.k = sk; tmp.v = sv; tmp.pos = spos; tmp.len = spos + rows_s;
    for (int32_t l = 0; l < c->n_layer && !rc; l++) {
        rc = kvz_cuda_kv_compact(s, &cc->L[l], n_prefix, n_ctx, d_keep + (size_t)l * c->n_kv_head * n_ctx, &tmp);
        if (!rc) rc = kvz_cuda_kv_copy(s, &tmp, &cc->L[l], n_prefix + n_ctx);
    }
    if (!rc && cudaMemcpyAsync(hc, d_counts, nlh * 4, cudaMemcpyDeviceToHost, s) != cudaSuccess)
        rc = kvz_error_set(KVZ_ERR_CUDA, "kvzip_select: counts copy failed");
    if (!rc && keep && cudaMemcpyAsync(keep, d_keep, N, cudaMemcpyDeviceToHost, s) != cudaSuccess)
        rc = kvz_error_set(KVZ_ERR_CUDA, "kvzip_select: keep copy failed");
    if (!rc && cudaStreamSynchronize(s) != cudaSuccess)
        rc = kvz_error_set(KVZ_ERR_CUDA, "kvzip_select: %s", cudaGetErrorString(cudaGetLastError()));
    if (!rc) {
        for (size_t i = 0; i < nlh; i++) {
            kv->len[i] = (int64_t)n_prefix + hc[i];
            if (counts) counts[i] = (uint32_t)hc[i];
        }
        rc = kvz_cuda_kv_sync(kv, 0);
    }
    dfree_tmp(d_keep, s); dfree_tmp(d_counts, s); dfree_tmp(ws, s);
    dfree_tmp(sk, s); dfree_tmp(sv, s); dfree_tmp(spos, s);
    free(hc);
    return rc ? rc : kept;
}

extern "C" int64_t kvz_cuda_kvzip_select(kvz_kv *kv, int32_t n_prefix, int32_t n_ctx, float ratio,
                                         int32_t mode, uint8_t *keep, uint32_t *counts)
{
    return kvzip_select(kv, n_prefix, n_ctx, ratio, mode, keep, counts);
}

extern "C" int kvz_cuda_kv_out_pos(const kvz_kv *kv, int32_t layer, int32_t *pos)
{
    if (!kv->cuda || !kv->out_slots) return kvz_error_set(KVZ_ERR_ARG, "no device output buffer");
    KVZ_CUDA_TRY(cudaStreamSynchronize(kv->m->cuda->s));
    KVZ_CUDA_TRY(cudaMemcpy(pos, kv->cuda->opos + (size_t)layer * kv->out_slots,
                            (size_t)kv->out_slots * 4, cudaMemcpyDeviceToHost));
    return 0;
}

/* ====================================================================== */
/* pipelined loader (kvz_cuda_loader.h)                                     */

static void load_free_slots(kvz_cuda_model *g)
{
    for (int i = 0; i < g->ld_n; i++) {
        cudaFreeHost(g->ld_h[i]);
        dfree(g->ld_d[i]);
        cudaEventDestroy(g->ld_ev[i]);
        g->ld_h[i] = g->ld_d[i] = NULL;
    }
    g->ld_n = 0;
    g->ld_bytes = 0;
}

extern "C" int kvz_cuda_load_slots(kvz_model *m, size_t slot_bytes, int nslot, void **slots)
{
    kvz_cuda_model *g = m->cuda;
    if (!g || nslot < 1 || nslot > KVZ_CUDA_LOAD_MAX_SLOTS || !slots)
        return kvz_error_set(KVZ_ERR_ARG, "load_slots: bad arguments");
    slot_bytes = al256(slot_bytes ? slot_bytes : 1);
    if (slot_bytes > g->ld_bytes || nslot > g->ld_n) {
        KVZ_CUDA_TRY(cudaStreamSynchronize(g->s));
        const size_t bytes = slot_bytes > g->ld_bytes ? slot_bytes + slot_bytes / 4 : g->ld_bytes;
        const int n = nslot > g->ld_n ? nslot : g->ld_n;
        load_free_slots(g);
        for (int i = 0; i < n; i++) {
            cudaError_t e = cudaHostAlloc(&g->ld_h[i], bytes, cudaHostAllocDefault);
            if (e == cudaSuccess) e = cudaEventCreateWithFlags(&g->ld_ev[i], cudaEventDisableTiming);
            if (e != cudaSuccess) {
                cudaGetLastError();
                if (g->ld_h[i]) cudaFreeHost(g->ld_h[i]);
                g->ld_h[i] = NULL;
                g->ld_n = i;
                load_free_slots(g);
                return kvz_error_set(e == cudaErrorMemoryAllocation ? KVZ_ERR_NOMEM : KVZ_ERR_CUDA,
                                     "pinned load staging (%d x %.1f MiB): %s", n, bytes / 1048576.0,
                                     cudaGetErrorString(e));
            }
            int rc = dmalloc(&g->ld_d[i], bytes, "load staging");
            g->ld_n = i + 1;
            if (rc) {
                load_free_slots(g);
                return rc;
            }
        }
        g->ld_bytes = bytes;
    }
    for (int i = 0; i < nslot; i++) slots[i] = g->ld_h[i];
    return 0;
}

extern "C" int kvz_cuda_load_layer(kvz_kv *kv, int32_t layer, int slot, int dtype, const uint32_t *counts,
                                   int32_t row0, size_t k_off, size_t v_off, size_t pos_off, size_t bytes)
{
    kvz_cuda_cache *cc = kv->cuda;
    kvz_cuda_model *g = kv->m->cuda;
    if (!cc || !g || slot < 0 || slot >= g->ld_n || bytes > g->ld_bytes || layer < 0 ||
        layer >= kv->n_layer || kv->n_kv_head > 64)
        return kvz_error_set(KVZ_ERR_ARG, "load_layer: bad arguments");
    int32_t rows[64];
    for (int32_t h = 0; h < kv->n_kv_head; h++) {
        if ((int64_t)counts[h] + row0 > kv->cap)
            return kvz_error_set(KVZ_ERR_CONTEXT, "layer %d head %d: %lld rows exceed the cache capacity %lld",
                                 layer, h, (long long)counts[h] + row0, (long long)kv->cap);
        rows[h] = (int32_t)counts[h];
    }
    const cudaStream_t s = g->s;
    char *d = (char *)g->ld_d[slot];
    if (bytes) KVZ_CUDA_TRY(cudaMemcpyAsync(d, g->ld_h[slot], bytes, cudaMemcpyHostToDevice, s));
    TRY(kvz_cuda_kv_load(s, &cc->L[layer], dtype, rows, row0, d + k_off, d + v_off, (const uint32_t *)(d + pos_off)));
    KVZ_CUDA_TRY(cudaEventRecord(g->ld_ev[slot], s));
    for (int32_t h = 0; h < kv->n_kv_head; h++) kv->len[(size_t)layer * kv->n_kv_head + h] = row0 + rows[h];
    return 0;
}

extern "C" int kvz_cuda_load_layer_src(kvz_kv *kv, int32_t layer, int slot, const void *src, size_t bytes, int dtype,
                                       const uint32_t *counts, int32_t row0, size_t k_off, size_t v_off,
                                       size_t pos_off, const size_t *cuts, int n_cuts)
{
    kvz_cuda_cache *cc = kv->cuda;
    kvz_cuda_model *g = kv->m->cuda;
    const size_t shift = (16 - k_off % 16) % 16; /* the kernel reads f16/bf16/f32 rows 16 bytes at a time */
    if (!cc || !g || !src || slot < 0 || slot >= g->ld_n || bytes + shift > g->ld_bytes || layer < 0 ||
        layer >= kv->n_layer || kv->n_kv_head > 64 || row0 < 0)
        return kvz_error_set(KVZ_ERR_ARG, "load_layer_src: bad arguments");
    int32_t rows[64];
    for (int32_t h = 0; h < kv->n_kv_head; h++) {
        if ((int64_t)counts[h] + row0 > kv->cap)
            return kvz_error_set(KVZ_ERR_CONTEXT, "layer %d head %d: %lld rows exceed the cache capacity %lld",
                                 layer, h, (long long)counts[h] + row0, (long long)kv->cap);
        rows[h] = (int32_t)counts[h];
    }
    const cudaStream_t s = g->s;
    char *d = (char *)g->ld_d[slot] + shift;
    for (int i = 0; i <= n_cuts; i++) { /* one copy per registration the source lies in */
        const size_t lo = i ? cuts[i - 1] : 0, hi = i < n_cuts ? cuts[i] : bytes;
        if (hi < lo || hi > bytes) return kvz_error_set(KVZ_ERR_ARG, "load_layer_src: bad cuts");
        if (hi > lo)
            KVZ_CUDA_TRY(cudaMemcpyAsync(d + lo, (const char *)src + lo, hi - lo, cudaMemcpyHostToDevice, s));
    }
    TRY(kvz_cuda_kv_load(s, &cc->L[layer], dtype, rows, row0, d + k_off, d + v_off, (const uint32_t *)(d + pos_off)));
    KVZ_CUDA_TRY(cudaEventRecord(g->ld_ev[slot], s));
    for (int32_t h = 0; h < kv->n_kv_head; h++) kv->len[(size_t)layer * kv->n_kv_head + h] = row0 + rows[h];
    return 0;
}

extern "C" int kvz_cuda_load_wait(kvz_model *m, int slot)
{
    kvz_cuda_model *g = m->cuda;
    if (!g || slot < 0 || slot >= g->ld_n) return kvz_error_set(KVZ_ERR_ARG, "load_wait: bad slot");
    KVZ_CUDA_TRY(cudaEventSynchronize(g->ld_ev[slot]));
    return 0;
}

extern "C" int kvz_cuda_load_finish(kvz_model *m)
{
    if (!m->cuda) return 0;
    KVZ_CUDA_TRY(cudaStreamSynchronize(m->cuda->s));
    return 0;
}

extern "C" void kvz_cuda_load_release(kvz_model *m)
{
    if (!m->cuda) return;
    cudaStreamSynchronize(m->cuda->s);
    load_free_slots(m->cuda);
}

extern "C" int kvz_cuda_kv_export_layer_q(const kvz_kv *kv, int32_t layer, int dtype, const uint32_t **pos,
                                          const void **k, const void **v)
{
    kvz_cuda_cache *cc = kv->cuda;
    if (!cc || layer < 0 || layer >= kv->n_layer || kv->n_kv_head > 64)
        return kvz_error_set(KVZ_ERR_ARG, "kv_export_layer_q: bad arguments");
    const size_t rb = kvz_kv_row_bytes(dtype, (size_t)kv->head_dim);
    if (!rb || (dtype != KVZ_KV_Q8 && dtype != KVZ_KV_Q4))
        return kvz_error_set(KVZ_ERR_ARG, "kv_export_layer_q: dtype %d is not q8/q4 for head_dim %d", dtype,
                             kv->head_dim);
    int32_t rows[64];
    size_t total = 0;
    for (int32_t h = 0; h < kv->n_kv_head; h++) {
        rows[h] = (int32_t)kv->len[(size_t)layer * kv->n_kv_head + h];
        total += (size_t)rows[h];
    }
    const size_t kb = al256(total * rb), need = 2 * kb + al256(total * 4);
    if (need > cc->exp_d_bytes) {
        dfree(cc->exp_d);
        cc->exp_d = NULL;
        cc->exp_d_bytes = 0;
        TRY(dmalloc(&cc->exp_d, need, "export staging"));
        cc->exp_d_bytes = need;
    }
    if (need > cc->exp_h_bytes) {
        if (cc->exp_h) cudaFreeHost(cc->exp_h);
        cc->exp_h = NULL;
        cc->exp_h_bytes = 0;
        KVZ_CUDA_TRY(cudaHostAlloc(&cc->exp_h, need, cudaHostAllocDefault));
        cc->exp_h_bytes = need;
    }
    const cudaStream_t s = kv->m->cuda->s;
    char *d = (char *)cc->exp_d, *h = (char *)cc->exp_h;
    TRY(kvz_cuda_kv_export_q(s, &cc->L[layer], dtype, rows, d, d + kb, (uint32_t *)(d + 2 * kb)));
    KVZ_CUDA_TRY(cudaMemcpyAsync(h, d, 2 * kb + total * 4, cudaMemcpyDeviceToHost, s));
    KVZ_CUDA_TRY(cudaStreamSynchronize(s));
    *k = h;
    *v = h + kb;
    *pos = (const uint32_t *)(h + 2 * kb);
    return 0;
}

extern "C" int kvz_cuda_kv_export_layer_to(const kvz_kv *kv, int32_t layer, int dtype, void *k_dst, void *v_dst,
                                           uint32_t *pos_dst)
{
    kvz_cuda_cache *cc = kv->cuda;
    const size_t rb = kvz_kv_row_bytes(dtype, (size_t)kv->head_dim);
    if (!cc || layer < 0 || layer >= kv->n_layer || kv->n_kv_head > 64 || !rb || !k_dst || !v_dst || !pos_dst)
        return kvz_error_set(KVZ_ERR_ARG, "kv_export_layer_to: bad arguments");
    int32_t rows[64];
    size_t total = 0;
    for (int32_t h = 0; h < kv->n_kv_head; h++) {
        rows[h] = (int32_t)kv->len[(size_t)layer * kv->n_kv_head + h];
        total += (size_t)rows[h];
    }
    if (!total) return 0;
    const size_t kb = al256(total * rb), need = 2 * kb + al256(total * 4);
    if (need > cc->exp_d_bytes) {
        dfree(cc->exp_d);
        cc->exp_d = NULL;
        cc->exp_d_bytes = 0;
        TRY(dmalloc(&cc->exp_d, need, "export staging"));
        cc->exp_d_bytes = need;
    }
    const cudaStream_t s = kv->m->cuda->s;
    char *d = (char *)cc->exp_d;
    if (dtype == KVZ_KV_Q8 || dtype == KVZ_KV_Q4) {
        TRY(kvz_cuda_kv_export_q(s, &cc->L[layer], dtype, rows, d, d + kb, (uint32_t *)(d + 2 * kb)));
    } else {
        const kvz_cuda_dtype dt = dtype == KVZ_KV_F32 ? KVZ_CUDA_F32 : dtype == KVZ_KV_F16 ? KVZ_CUDA_F16 : KVZ_CUDA_BF16;
        TRY(kvz_cuda_kv_export(s, &cc->L[layer], rows, dt, d, d + kb, (int32_t *)(d + 2 * kb)));
    }
    KVZ_CUDA_TRY(cudaMemcpyAsync(k_dst, d, total * rb, cudaMemcpyDeviceToHost, s));
    KVZ_CUDA_TRY(cudaMemcpyAsync(v_dst, d + kb, total * rb, cudaMemcpyDeviceToHost, s));
    KVZ_CUDA_TRY(cudaMemcpyAsync(pos_dst, d + 2 * kb, total * 4, cudaMemcpyDeviceToHost, s));
    KVZ_CUDA_TRY(cudaStreamSynchronize(s));
    return 0;
}

extern "C" int kvz_cuda_host_alloc(void **p, size_t bytes)
{
    *p = NULL;
    cudaError_t e = cudaHostAlloc(p, bytes ? bytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *p = NULL;
        return kvz_error_set(e == cudaErrorMemoryAllocation ? KVZ_ERR_NOMEM : KVZ_ERR_CUDA, "pinned host memory "
                             "(%.1f MiB): %s", bytes / 1048576.0, cudaGetErrorString(e));
    }
    return 0;
}

extern "C" void kvz_cuda_host_free(void *p)
{
    if (p) cudaFreeHost(p);
}

/* ====================================================================== */
/* multi-document composition (kvz_rope_shift_cuda.h, ingest/kvz_compose.c) */

extern "C" int kvz_cuda_load_rows(kvz_kv *kv, int32_t layer, int slot, int dtype, const uint32_t *src_row,
                                  const uint32_t *rows, const uint32_t *dst_row, size_t k_off, size_t v_off,
                                  size_t pos_off, size_t bytes)
{
    kvz_cuda_cache *cc = kv->cuda;
    kvz_cuda_model *g = kv->m->cuda;
    if (!cc || !g || slot < 0 || slot >= g->ld_n || bytes > g->ld_bytes || layer < 0 || layer >= kv->n_layer)
        return kvz_error_set(KVZ_ERR_ARG, "load_rows: bad arguments");
    const size_t rb = kvz_kv_row_bytes(dtype, (size_t)kv->head_dim), hd = (size_t)kv->head_dim, cap = (size_t)kv->cap;
    if (!rb) return kvz_error_set(KVZ_ERR_ARG, "load_rows: stored dtype %d unknown", dtype);
    for (int32_t h = 0; h < kv->n_kv_head; h++)
        if ((int64_t)dst_row[h] + rows[h] > kv->cap)
            return kvz_error_set(KVZ_ERR_CONTEXT, "layer %d head %d: %lld rows exceed the cache capacity %lld",
                                 layer, h, (long long)dst_row[h] + rows[h], (long long)kv->cap);
    const cudaStream_t s = g->s;
    char *d = (char *)g->ld_d[slot];
    if (bytes) KVZ_CUDA_TRY(cudaMemcpyAsync(d, g->ld_h[slot], bytes, cudaMemcpyHostToDevice, s));
    const kvz_cuda_kv *L = &cc->L[layer];
    for (int32_t h = 0; h < kv->n_kv_head; h++) {
        const size_t seg = (size_t)layer * kv->n_kv_head + (size_t)h;
        kv->len[seg] = (int64_t)dst_row[h] + rows[h];
        if (!rows[h]) continue;
        kvz_cuda_kv one = *L; /* head h alone: its rows, its length */
        one.k = (bf16 *)L->k + (size_t)h * cap * hd;
        one.v = (bf16 *)L->v + (size_t)h * cap * hd;
        one.pos = L->pos + (size_t)h * cap;
        one.len = L->len + h;
        one.n_kv = 1;
        const int32_t n = (int32_t)rows[h];
        const size_t o = (size_t)src_row[h];
        TRY(kvz_cuda_kv_load(s, &one, dtype, &n, (int32_t)dst_row[h], d + k_off + o * rb, d + v_off + o * rb,
                             (const uint32_t *)(d + pos_off) + o));
    }
    KVZ_CUDA_TRY(cudaEventRecord(g->ld_ev[slot], s));
    return 0;
}

extern "C" int kvz_cuda_kv_shift(kvz_kv *kv, const kvz_cuda_shift_seg *segs, int n_seg, const float *cs,
                                 const float *sn, int n_doc, float key_scale)
{
    kvz_cuda_cache *cc = kv->cuda;
    if (!cc || n_seg < 0 || (n_seg && (!segs || !cs || !sn || n_doc < 1)))
        return kvz_error_set(KVZ_ERR_ARG, "kv_shift: bad arguments");
    if (n_seg) {
        const cudaStream_t s = kv->m->cuda->s;
        const size_t half = (size_t)kv->head_dim / 2, sb = (size_t)n_seg * sizeof *segs,
                     tb = (size_t)n_doc * half * sizeof(float);
        int32_t mx = 0;
        for (int i = 0; i < n_seg; i++) {
            const kvz_cuda_shift_seg *q = &segs[i];
            if (q->lh < 0 || q->lh >= kv->n_layer * kv->n_kv_head || q->row0 < 0 || q->n < 0 ||
                (int64_t)q->row0 + q->n > kv->cap || q->doc < 0 || q->doc >= n_doc)
                return kvz_error_set(KVZ_ERR_ARG, "kv_shift: segment %d out of range", i);
            mx = q->n > mx ? q->n : mx;
        }
        char *d = NULL;
        TRY(dmalloc_tmp((void **)&d, sb + 2 * tb + 32, s, "re-rotation tables"));
        kvz_cuda_shift_seg *dsg = (kvz_cuda_shift_seg *)d;
        float *dcs = (float *)(d + ((sb + 15) & ~(size_t)15)), *dsn = dcs + (size_t)n_doc * half;
        int rc = 0;
        /* pageable sources: each copy returns once its bytes are staged */
        if (cudaMemcpyAsync(dsg, segs, sb, cudaMemcpyHostToDevice, s) != cudaSuccess ||
            cudaMemcpyAsync(dcs, cs, tb, cudaMemcpyHostToDevice, s) != cudaSuccess ||
            cudaMemcpyAsync(dsn, sn, tb, cudaMemcpyHostToDevice, s) != cudaSuccess)
            rc = kvz_error_set(KVZ_ERR_CUDA, "kv_shift: cudaMemcpyAsync: %s", cudaGetErrorString(cudaGetLastError()));
        if (!rc)
            rc = kvz_cuda_rope_shift_rows(s, cc->k, kv->cap, kv->head_dim, kv->m->cfg.rope_adjacent, dsg, n_seg, mx,
                                          dcs, dsn, key_scale);
        dfree_tmp(d, s);
        if (rc) return rc;
    }
    return kvz_cuda_kv_sync(kv, 0);
}
