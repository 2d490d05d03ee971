/* GPU model bench (DESIGN §7): every figure beside its bound, measured in the
 * same run on the same device.
 *
 *   bounds:  bf16 GEMM rate (cuBLAS 8192³, median of 10) and device copy bandwidth
 *            (cudaMemcpy D2D of 2 GiB, read + write bytes, median of 10);
 *   prefill: tokens/s and % of the GEMM rate at each length, FLOPs =
 *            2·params_linear·T + 4·(T²/2)·hd·n_head·n_layer (causal attention);
 *   ingest:  full KVzip ingest (prefill + repeat/scoring passes + device top-k +
 *            compaction + kept rows to the host) ÷ a plain prefill of the same
 *            tokens (system prefix + context, in the same 8K passes), beside the
 *            FLOP ratio (repeat passes: linear layers on R tokens + attention of R
 *            queries over prefix+context+repeat keys; the chunk score pass's extra
 *            QK over the chunk is not counted);
 *   decode:  batch-1 greedy steps (logits to the host every step) at 2K and 8K
 *            context vs the HBM bound = (linear + LM-head weight bytes + KV bytes)
 *            ÷ copy bandwidth;
 *   LongFlow: step time with B = 2048 slots around output tokens 1K, 4K, 16K;
 *   memory:  peak device bytes allocated by the backend.
 * Usage: kvz_bench_gpu [--synthetic NAME] [--lens 2048,8192,32768] [--lf-max N] [--quick]
 *        kvz_bench_gpu --compose [--lens 2048,4096,6144,8192]: multi-document time to first
 *        token (run_compose)
 *        kvz_bench_gpu --multi 1,8,32 [--multi-ctx 8192] [--multi-churn K]: continuous batching,
 *        the batched decode step over n compressed caches, fixed membership and, with K, one
 *        member replaced every K steps (run_multi)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include <dirent.h>
#include <omp.h>
#include <stdint.h>
#include <unistd.h>

#include "kvz_compose.h"
#include "kvz_cuda.h"
#include "kvz_cuda_loader.h"
#include "kvz_doc_cache.h"
#include "kvz_error.h"
#include "kvz_ingest.h"
#include "kvz_kvdtype.h"
#include "kvz_load.h"
#include "kvz_generate.h"
#include "kvz_kvzip.h"
#include "kvz_model.h"
#include "kvz_cuda_backend.h"

#define DIE(...) do { fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); exit(1); } while (0)
#define API(call)                                                                          \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_) DIE("%s: %s (%s)", #call, kvz_strerror(rc_), kvz_error_detail());          \
    } while (0)
#define CU(call)                                                                           \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) DIE("%s: %s", #call, cudaGetErrorString(e_));               \
    } while (0)

static int cmpd(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmpd);
    return v[n / 2];
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ULL;
static int32_t rnd(int32_t n)
{
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return (int32_t)(g_rng % (uint64_t)n);
}

/* ---------------------------------------------------------------- ceilings */
static double gemm_peak(void)
{
    const int n = 8192;
    void *a, *b, *c;
    CU(cudaMalloc(&a, (size_t)n * n * 2));
    CU(cudaMalloc(&b, (size_t)n * n * 2));
    CU(cudaMalloc(&c, (size_t)n * n * 2));
    /* random bf16 in [-1, 1): fill on the host once, small pattern repeated */
    uint16_t *h = malloc((size_t)n * n * 2);
    for (size_t i = 0; i < (size_t)n * n; i++) {
        float f = (float)(rnd(1 << 20)) / (float)(1 << 19) - 1.0f;
        uint32_t u;
        memcpy(&u, &f, 4);
        h[i] = (uint16_t)(u >> 16);
    }
    CU(cudaMemcpy(a, h, (size_t)n * n * 2, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(b, h, (size_t)n * n * 2, cudaMemcpyHostToDevice));
    free(h);
    kvz_cuda_blas *bl;
    API(kvz_cuda_blas_create(&bl));
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    double t[10];
    for (int it = -3; it < 10; it++) {
        CU(cudaEventRecord(e0, 0));
        API(kvz_cuda_linear(bl, 0, n, n, n, a, n, b, NULL, c, KVZ_CUDA_BF16, n, 0.f));
        CU(cudaEventRecord(e1, 0));
        CU(cudaEventSynchronize(e1));
        float ms;
        CU(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 0) t[it] = ms * 1e-3;
    }
    kvz_cuda_blas_destroy(bl);
    cudaFree(a); cudaFree(b); cudaFree(c);
    return 2.0 * n * (double)n * n / median(t, 10);
}

static double copy_bw(void)
{
    const size_t bytes = (size_t)2 << 30;
    void *a, *b;
    CU(cudaMalloc(&a, bytes));
    CU(cudaMalloc(&b, bytes));
    CU(cudaMemset(a, 0x5a, bytes));
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    double t[10];
    for (int it = -2; it < 10; it++) {
        CU(cudaEventRecord(e0, 0));
        CU(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        CU(cudaEventRecord(e1, 0));
        CU(cudaEventSynchronize(e1));
        float ms;
        CU(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 0) t[it] = ms * 1e-3;
    }
    cudaFree(a); cudaFree(b);
    return 2.0 * (double)bytes / median(t, 10);
}

/* ---------------------------------------------------------------- model figures */
typedef struct shape {
    double params_linear; /* per token: every layer's matrices (no LM head) */
    double lm_head;       /* n_vocab · d */
    double attn_unit;     /* hd · n_head · n_layer */
    double kv_row_bytes;  /* K+V bytes of one token over all layers and KV heads (bf16) */
} shape;

static shape shape_of(const kvz_config *c)
{
    const double d = c->n_embd, qd = (double)c->n_head * c->head_dim, kvd = (double)c->n_kv_head * c->head_dim;
    shape s;
    s.params_linear = c->n_layer * (d * (qd + 2 * kvd) + d * qd + 3.0 * d * c->n_ff);
    s.lm_head = (double)c->n_vocab * d;
    s.attn_unit = (double)c->head_dim * c->n_head * c->n_layer;
    s.kv_row_bytes = 2.0 * 2.0 * c->n_layer * kvd;
    return s;
}

static double prefill_flops(const shape *s, double T) { return 2 * s->params_linear * T + 4 * (T * T / 2) * s->attn_unit; }

static double sync_now(void)
{
    CU(cudaDeviceSynchronize());
    return kvz_now();
}

static double run_prefill(kvz_model *m, const int32_t *toks, int32_t T)
{
    kvz_kv *kv;
    API(kvz_kv_create(m, T + 16, 0, &kv));
    double t0 = sync_now();
    API(kvz_forward(m, kv, toks, T, 0, NULL, KVZ_FWD_NO_LOGITS, NULL));
    double t = sync_now() - t0;
    kvz_kv_free(kv);
    return t;
}

/* system prefix + context, the tokens ingest prefills (caller frees) */
static int32_t *doc_tokens(const int32_t *pre, int32_t np, const int32_t *ctx, int32_t T)
{
    int32_t *all = malloc(sizeof(int32_t) * (size_t)(np + T));
    memcpy(all, pre, sizeof(int32_t) * (size_t)np);
    memcpy(all + np, ctx, sizeof(int32_t) * (size_t)T);
    return all;
}

/* prefill n tokens into the document region in passes of `chunk` tokens */
static void prefill_passes(kvz_model *m, kvz_kv *kv, const int32_t *toks, int32_t n, int32_t chunk)
{
    for (int32_t o = 0; o < n; o += chunk) {
        int32_t nb = n - o < chunk ? n - o : chunk;
        API(kvz_forward(m, kv, toks + o, nb, o, NULL, KVZ_FWD_NO_LOGITS, NULL));
    }
}

/* plain prefill of a whole document as ingest feeds it: the system prefix + context, in
 * passes of `chunk` tokens (the ingest's own prefill phase, without anything after it) */
static double run_prefill_doc(kvz_model *m, const int32_t *pre, int32_t np, const int32_t *ctx, int32_t T,
                              int32_t chunk)
{
    int32_t *all = doc_tokens(pre, np, ctx, T);
    kvz_kv *kv;
    API(kvz_kv_create(m, np + T + 16, 0, &kv));
    double t0 = sync_now();
    prefill_passes(m, kv, all, np + T, chunk);
    double t = sync_now() - t0;
    kvz_kv_free(kv);
    free(all);
    return t;
}

/* full ingest, phase by phase (the calls kvz_kvzip_score + kvz_ingest_doc make on the
 * device): prefill of prefix + context (8K passes), the repeat passes with the fused
 * score kernel, device top-k + compaction, and the export of the kept rows as the blob
 * stores them (f16, converted on the GPU, one pinned copy per layer). Not in the total:
 * the same repeat passes without the score kernel (so score = difference) and the old
 * host path (kvz_kv_get_head fp32 per head + host f16 conversion) for comparison. */
typedef struct ingest_times {
    double prefill, repeat, score, select, export_f16, old_copy, total_nocopy, total, flop_ratio;
    int32_t n_pass; /* repeat passes (chunks batched up to kvz_kvzip_params.repeat_rows tokens) */
} ingest_times;

static uint16_t h_f16(float f) /* fp32 -> fp16 RNE (normal range; enough for a timing) */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t a = u & 0x7fffffffu, r = a - (112u << 23);
    r += 0xfff + ((r >> 13) & 1);
    return (uint16_t)(((u >> 16) & 0x8000) | (a < 0x38800000u ? 0 : (r >> 13)));
}

static void run_ingest(kvz_model *m, const int32_t *pre, int32_t np, const int32_t *ctx, int32_t T,
                       const shape *s, ingest_times *it, int diag)
{
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    kvz_kvzip_params p;
    kvz_kvzip_defaults(&p);
    p.prefill_chunk = 8192;
    const size_t nlh = (size_t)c->n_layer * c->n_kv_head;
    uint32_t *counts = malloc(sizeof(uint32_t) * nlh);
    kvz_kv *kv;
    const int64_t cap = kvz_kvzip_cache_rows(m, np, T, &p);
    if (cap < 0) DIE("cache rows: %s (%s)", kvz_strerror((int)cap), kvz_error_detail());
    API(kvz_kv_create(m, cap, 0, &kv));
    int32_t *all = doc_tokens(pre, np, ctx, T);
    const int32_t n_all = np + T, nch = (T + p.chunk - 1) / p.chunk;
    int32_t *first = malloc(sizeof(int32_t) * ((size_t)nch + 1));
    const int32_t n_pass = kvz_kvzip_passes(m, T, &p, first, NULL);
    if (n_pass < 0) DIE("passes: %s (%s)", kvz_strerror(n_pass), kvz_error_detail());
    it->n_pass = n_pass;
    kvz_tokens *rin = calloc((size_t)n_pass, sizeof *rin); /* each pass's repeat inputs, concatenated */
    double rep = 0;
    for (int32_t i = 0; i < n_pass; i++)
        for (int32_t ch = first[i]; ch < first[i + 1]; ch++) {
            const size_t before = rin[i].n;
            API(kvz_kvzip_repeat_input(tok, ctx, T, ch, &p, &rin[i]));
            double R = (double)(rin[i].n - before);
            rep += 2 * s->params_linear * R + 4 * R * ((double)np + T + R / 2) * s->attn_unit;
        }
    it->flop_ratio = (prefill_flops(s, n_all) + rep) / prefill_flops(s, n_all);

    double t0 = sync_now();
    prefill_passes(m, kv, all, n_all, p.prefill_chunk);
    double t1 = sync_now();
    API(kvz_kvzip_score_chunks(m, kv, np, ctx, T, &p, NULL, NULL, NULL, 0, 0)); /* as ingest: scores stay on the GPU */
    double t2 = sync_now();
    int64_t kept = kvz_cuda_kvzip_select(kv, np, T, p.ratio, p.mode, NULL, counts);
    if (kept < 0) DIE("select: %s (%s)", kvz_strerror((int)kept), kvz_error_detail());
    double t3 = sync_now();
    size_t sink = 0;
    for (int32_t l = 0; l < c->n_layer; l++) {
        const uint32_t *dp;
        const void *dk, *dv;
        API(kvz_cuda_kv_export_layer(kv, l, 1 /* KVZ_DTYPE_F16 */, &dp, &dk, &dv));
        sink += dp[0] + ((const uint16_t *)dk)[0] + ((const uint16_t *)dv)[0];
    }
    double t4 = sync_now();
    it->prefill = t1 - t0;
    it->repeat = t2 - t1;
    it->select = t3 - t2;
    it->export_f16 = t4 - t3;
    it->total_nocopy = t3 - t0;
    it->total = t4 - t0;
    if (!diag) {
        kvz_kv_free(kv);
        for (int32_t i = 0; i < n_pass; i++) kvz_tokens_free(&rin[i]);
        free(rin); free(first); free(all); free(counts);
        return;
    }
    /* the old host path on the same kept rows: fp32 per head, then f16 on one core */
    {
        float *kh = malloc(sizeof(float) * (size_t)(np + T) * c->head_dim);
        float *vh = malloc(sizeof(float) * (size_t)(np + T) * c->head_dim);
        int32_t *ph = malloc(sizeof(int32_t) * (size_t)(np + T));
        uint16_t *hb = malloc(2 * (size_t)(np + T) * c->head_dim);
        double u0 = sync_now();
        for (size_t i = 0; i < nlh; i++) {
            const int32_t l = (int32_t)(i / c->n_kv_head), h = (int32_t)(i % c->n_kv_head);
            API(kvz_kv_get_head(kv, l, h, kh, vh, ph));
            const size_t ne = (size_t)kvz_kv_len(kv, l, h) * c->head_dim;
            for (size_t e = 0; e < ne; e++) hb[e] = h_f16(kh[e]);
            for (size_t e = 0; e < ne; e++) hb[e] ^= h_f16(vh[e]);
            sink += hb[0];
        }
        it->old_copy = sync_now() - u0;
        free(kh); free(vh); free(ph); free(hb);
    }
    kvz_kv_free(kv);
    /* the same repeat passes without the score kernel (plain DISCARD forwards) */
    API(kvz_kv_create(m, cap, 0, &kv));
    prefill_passes(m, kv, all, n_all, p.prefill_chunk);
    double u1 = sync_now();
    for (int32_t i = 0; i < n_pass; i++) /* causal over the whole batch: a little more attention */
        API(kvz_forward(m, kv, rin[i].ids, (int32_t)rin[i].n, n_all, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_DISCARD, NULL));
    it->score = it->repeat - (sync_now() - u1);
    kvz_kv_free(kv);
    if (sink == 42) fputc(' ', stderr);
    for (int32_t i = 0; i < n_pass; i++) kvz_tokens_free(&rin[i]);
    free(rin); free(first); free(all); free(counts);
}

/* ms per batch-1 decode step with logits to the host, context T */
static double run_decode(kvz_model *m, const int32_t *toks, int32_t T, int steps)
{
    const int32_t V = kvz_model_config(m)->n_vocab;
    kvz_kv *kv;
    API(kvz_kv_create(m, T + steps + 8, 0, &kv));
    API(kvz_forward(m, kv, toks, T, 0, NULL, KVZ_FWD_NO_LOGITS, NULL));
    float *lg = malloc(sizeof(float) * V);
    int32_t t = toks[0];
    for (int i = 0; i < 4; i++) API(kvz_forward(m, kv, &t, 1, T + i, lg, KVZ_FWD_LOGITS_LAST, NULL));
    double t0 = sync_now();
    for (int i = 4; i < steps + 4; i++) {
        API(kvz_forward(m, kv, &t, 1, T + i, lg, KVZ_FWD_LOGITS_LAST, NULL));
        int32_t b = 0;
        for (int32_t j = 1; j < V; j++) if (lg[j] > lg[b]) b = j;
        t = b;
    }
    double dt = (sync_now() - t0) / steps;
    free(lg);
    kvz_kv_free(kv);
    return dt;
}

/* ---------------------------------------------------------------- store <-> GPU */

/* host memcpy (bytes read + written; one thread, and all threads on 1 MiB blocks) and
 * pinned H2D copy bandwidth, medians of 10 */
static void io_bounds(double *memcpy_bw, double *memcpy_mt_bw, double *h2d_bw)
{
    const size_t bytes = (size_t)1 << 30;
    char *a = malloc(bytes), *b = malloc(bytes);
    if (!a || !b) DIE("host buffers");
    memset(a, 0x5a, bytes);
    memset(b, 0x11, bytes);
    double t[10];
    for (int it = -1; it < 10; it++) {
        double t0 = kvz_now();
        memcpy(b, a, bytes);
        if (it >= 0) t[it] = kvz_now() - t0;
    }
    *memcpy_bw = 2.0 * bytes / median(t, 10);
    const long nblk = (long)(bytes >> 20);
    for (int it = -1; it < 10; it++) {
        double t0 = kvz_now();
#pragma omp parallel for schedule(static)
        for (long i = 0; i < nblk; i++) memcpy(b + (i << 20), a + (i << 20), (size_t)1 << 20);
        if (it >= 0) t[it] = kvz_now() - t0;
    }
    *memcpy_mt_bw = 2.0 * bytes / median(t, 10);
    free(a); free(b);
    void *h, *d;
    CU(cudaHostAlloc(&h, bytes, cudaHostAllocDefault));
    CU(cudaMalloc(&d, bytes));
    memset(h, 0x5a, bytes);
    for (int it = -1; it < 10; it++) {
        double t0 = sync_now();
        CU(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, 0));
        if (it >= 0) t[it] = sync_now() - t0;
    }
    *h2d_bw = (double)bytes / median(t, 10);
    cudaFreeHost(h);
    cudaFree(d);
}

/* ---- host-side bounds of the load path: what the page cache gives, without the loader.
 * The store's data.mdb (just written, so in the page cache) is read in 16 MiB chunks
 * (about one layer record of the 32K document), each claimed by the next free thread,
 * in 256 KiB pieces as kvz_store_copy_layer reads them:
 *  pread  - pread() into pinned memory;
 *  +hash  - the same, each piece hashed with XXH3 after it arrives (the loader's check);
 *  map    - memcpy out of a MAP_POPULATE'd read-only mapping into pinned memory;
 *  to GPU - pread + hash into 32 MiB pinned slots, each slot sent by cudaMemcpyAsync on
 *           one stream as soon as it is full, the slot reused after its copy: the copy
 *           route of the loader with no blob logic, its end-to-end bound.
 * Then the route without a host copy: cudaHostRegister of the mapping (read-only), the
 * registration's cost per GB, and the H2D bandwidth straight from the page cache. */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include "kvz_xxh3.h"

#define HIO_CHUNK ((size_t)16 << 20)
#define HIO_PIECE ((size_t)256 << 10)
#define HIO_SLOT ((size_t)32 << 20)
#define HIO_NSLOT 16

typedef struct hio {
    int fd, mode; /* 0 pread, 1 pread + hash, 2 map memcpy, 3 to GPU */
    const char *map;
    char *dst;    /* pinned, bytes long (modes 0-2) */
    size_t bytes;
    atomic_size_t next;
    /* mode 3 */
    char *slot[HIO_NSLOT];
    void *dev;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int free_slot[HIO_NSLOT], nfree;
    int full[HIO_NSLOT], nfull; /* slot index, FIFO */
    size_t full_off[HIO_NSLOT], full_len[HIO_NSLOT];
    int writers_left;
    uint64_t sink;
} hio;

static void hio_fill(hio *h, char *dst, size_t off, size_t len)
{
    kvz_xxh3 x;
    if (h->mode) kvz_xxh3_reset(&x, 1);
    for (size_t p = 0; p < len; p += HIO_PIECE) {
        const size_t n = len - p < HIO_PIECE ? len - p : HIO_PIECE;
        if (h->mode == 2) memcpy(dst + p, h->map + off + p, n);
        else if (pread(h->fd, dst + p, n, (off_t)(off + p)) != (ssize_t)n) DIE("hostio: short pread");
        if (h->mode == 1 || h->mode == 3) kvz_xxh3_update(&x, dst + p, n);
    }
    if (h->mode == 1 || h->mode == 3) __atomic_fetch_add(&h->sink, kvz_xxh3_digest(&x), __ATOMIC_RELAXED);
}

static void *hio_worker(void *arg)
{
    hio *h = arg;
    for (;;) {
        const size_t off = atomic_fetch_add(&h->next, h->mode == 3 ? HIO_SLOT : HIO_CHUNK);
        if (off >= h->bytes) break;
        const size_t cap = h->mode == 3 ? HIO_SLOT : HIO_CHUNK;
        const size_t len = h->bytes - off < cap ? h->bytes - off : cap;
        if (h->mode != 3) { hio_fill(h, h->dst + off, off, len); continue; }
        pthread_mutex_lock(&h->mu);
        while (!h->nfree) pthread_cond_wait(&h->cv, &h->mu);
        const int s = h->free_slot[--h->nfree];
        pthread_mutex_unlock(&h->mu);
        hio_fill(h, h->slot[s], off, len);
        pthread_mutex_lock(&h->mu);
        h->full[h->nfull] = s; h->full_off[h->nfull] = off; h->full_len[h->nfull] = len; h->nfull++;
        pthread_cond_broadcast(&h->cv);
        pthread_mutex_unlock(&h->mu);
    }
    if (h->mode == 3) {
        pthread_mutex_lock(&h->mu);
        h->writers_left--;
        pthread_cond_broadcast(&h->cv);
        pthread_mutex_unlock(&h->mu);
    }
    return NULL;
}

/* mode 3's upload side, on the calling thread: send full slots in arrival order */
static void hio_upload(hio *h, cudaStream_t st)
{
    cudaEvent_t ev[HIO_NSLOT];
    int inflight[HIO_NSLOT], ninf = 0;
    for (int i = 0; i < HIO_NSLOT; i++) CU(cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming));
    for (;;) {
        pthread_mutex_lock(&h->mu);
        while (!h->nfull && h->writers_left) {
            if (ninf) break;
            pthread_cond_wait(&h->cv, &h->mu);
        }
        int s = -1; size_t off = 0, len = 0;
        if (h->nfull) {
            s = h->full[0]; off = h->full_off[0]; len = h->full_len[0];
            h->nfull--;
            memmove(h->full, h->full + 1, sizeof(int) * (size_t)h->nfull);
            memmove(h->full_off, h->full_off + 1, sizeof(size_t) * (size_t)h->nfull);
            memmove(h->full_len, h->full_len + 1, sizeof(size_t) * (size_t)h->nfull);
        }
        const int done = !h->nfull && !h->writers_left && s < 0;
        pthread_mutex_unlock(&h->mu);
        if (s >= 0) {
            CU(cudaMemcpyAsync((char *)h->dev + (off % ((size_t)1 << 30)), h->slot[s], len, cudaMemcpyHostToDevice, st));
            CU(cudaEventRecord(ev[s], st));
            inflight[ninf++] = s;
        }
        /* give back every slot whose copy has finished */
        for (int i = 0; i < ninf;) {
            cudaError_t q = s < 0 ? cudaEventSynchronize(ev[inflight[i]]) : cudaEventQuery(ev[inflight[i]]);
            if (q == cudaErrorNotReady) { i++; continue; }
            CU(q);
            pthread_mutex_lock(&h->mu);
            h->free_slot[h->nfree++] = inflight[i];
            pthread_cond_broadcast(&h->cv);
            pthread_mutex_unlock(&h->mu);
            inflight[i] = inflight[--ninf];
        }
        if (done && !ninf) break;
    }
    for (int i = 0; i < HIO_NSLOT; i++) cudaEventDestroy(ev[i]);
}

static double hio_run(hio *h, int mode, int nt, cudaStream_t st)
{
    pthread_t th[64];
    h->mode = mode;
    atomic_store(&h->next, 0);
    if (mode == 3) {
        h->nfree = HIO_NSLOT; h->nfull = 0; h->writers_left = nt;
        for (int i = 0; i < HIO_NSLOT; i++) h->free_slot[i] = i;
    }
    double t0 = sync_now();
    for (int i = 0; i < nt; i++)
        if (pthread_create(&th[i], NULL, hio_worker, h)) DIE("hostio: pthread_create");
    if (mode == 3) hio_upload(h, st);
    for (int i = 0; i < nt; i++) pthread_join(th[i], NULL);
    return sync_now() - t0;
}

static void host_io_bounds(const char *dir, double h2d)
{
    char path[512];
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    hio h;
    memset(&h, 0, sizeof h);
    h.fd = open(path, O_RDONLY);
    struct stat sb;
    if (h.fd < 0 || fstat(h.fd, &sb)) DIE("hostio: %s", path);
    h.bytes = (size_t)sb.st_size & ~(HIO_PIECE - 1);
    if (h.bytes > ((size_t)2 << 30)) h.bytes = (size_t)2 << 30;
    h.map = mmap(NULL, h.bytes, PROT_READ, MAP_SHARED | MAP_POPULATE, h.fd, 0);
    if (h.map == MAP_FAILED) DIE("hostio: mmap");
    CU(cudaHostAlloc((void **)&h.dst, h.bytes, cudaHostAllocDefault));
    memset(h.dst, 0, h.bytes);
    for (int i = 0; i < HIO_NSLOT; i++) {
        CU(cudaHostAlloc((void **)&h.slot[i], HIO_SLOT, cudaHostAllocDefault));
        memset(h.slot[i], 0, HIO_SLOT);
    }
    CU(cudaMalloc(&h.dev, (size_t)1 << 30));
    pthread_mutex_init(&h.mu, NULL);
    pthread_cond_init(&h.cv, NULL);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    { /* page the whole file in once */
        uint64_t x = 0;
        for (size_t o = 0; o < h.bytes; o += 4096) x += (unsigned char)h.map[o];
        h.sink += x;
    }
    printf("\nhost-side bounds of the load path (data.mdb of this store, %.2f GB, page cache; 16 MiB chunks, "
           "256 KiB pieces; GB/s of file bytes, best of 3):\n\n| threads | pread -> pinned | pread + XXH3 -> pinned | "
           "map memcpy -> pinned | pread + XXH3 -> 32 MiB pinned slots -> H2D (the copy route's bound) | %% of H2D |\n"
           "|---|---|---|---|---|---|\n", h.bytes / 1e9);
    const int nts[6] = {1, 2, 4, 8, 12, 16};
    for (int k = 0; k < 6; k++) {
        double bw[4];
        for (int mode = 0; mode < 4; mode++) {
            double best = 1e30;
            for (int rep = 0; rep < 3; rep++) {
                double t = hio_run(&h, mode, nts[k], st);
                best = t < best ? t : best;
            }
            bw[mode] = h.bytes / best / 1e9;
        }
        printf("| %d | %.1f | %.1f | %.1f | %.1f | %.0f%% |\n", nts[k], bw[0], bw[1], bw[2], bw[3],
               100 * bw[3] / (h2d / 1e9));
        fflush(stdout);
    }
    /* no host copy: pin the page cache itself */
    double t0 = kvz_now();
    cudaError_t e = cudaHostRegister((void *)h.map, h.bytes, cudaHostRegisterReadOnly);
    const double treg = kvz_now() - t0;
    if (e != cudaSuccess) {
        printf("\ncudaHostRegister of the read-only map: %s (route not available here)\n", cudaGetErrorString(e));
        cudaGetLastError();
    } else {
        double best = 1e30;
        const size_t n = h.bytes < ((size_t)1 << 30) ? h.bytes : (size_t)1 << 30;
        for (int rep = 0; rep < 5; rep++) {
            double t1 = sync_now();
            CU(cudaMemcpyAsync(h.dev, h.map, n, cudaMemcpyHostToDevice, st));
            CU(cudaStreamSynchronize(st));
            double t = sync_now() - t1;
            best = t < best ? t : best;
        }
        t0 = kvz_now();
        CU(cudaHostUnregister((void *)h.map));
        const double tun = kvz_now() - t0;
        printf("\ncudaHostRegister of the read-only map: %.3f s for %.2f GB (%.2f s/GB), unregister %.3f s; "
               "H2D straight from the registered page cache %.1f GB/s (%.0f%% of H2D)\n", treg, h.bytes / 1e9,
               treg / (h.bytes / 1e9), tun, n / best / 1e9, 100 * n / best / h2d);
    }
    printf("(checksum sink %llx)\n", (unsigned long long)h.sink);
    cudaStreamDestroy(st);
    cudaFree(h.dev);
    for (int i = 0; i < HIO_NSLOT; i++) cudaFreeHost(h.slot[i]);
    cudaFreeHost(h.dst);
    munmap((void *)h.map, h.bytes);
    close(h.fd);
    fflush(stdout);
}

/* question + first answer token on a document cache: kvz_generate with one token, as
 * kvzip-query does it (seconds) */
static double first_token(kvz_model *m, kvz_kv *kv, const kvz_tokens *q, int32_t n_doc)
{
    kvz_gen_opts go = {.max_tokens = 1, .stop_on_eos = 0};
    kvz_sampler_init(&go.sampler, 0.f, 1.f, 1);
    kvz_gen_stats gs;
    double t0 = sync_now();
    API(kvz_generate(m, kv, q->ids, (int32_t)q->n, n_doc, &go, NULL, NULL, &gs));
    return sync_now() - t0;
}

/* kvzip-query --text: a full cache, the document prefilled in 4096-token passes, then
 * the question and the first token (seconds) */
static double reprefill_first(kvz_model *m, const int32_t *pre, int32_t np, const int32_t *ctx, int32_t T,
                              const kvz_tokens *q)
{
    int32_t *all = doc_tokens(pre, np, ctx, T);
    kvz_kv *kv;
    double t0 = sync_now();
    API(kvz_kv_create(m, np + T, 1024, &kv));
    for (int32_t o = 0; o < np + T; o += 4096) {
        int32_t nb = np + T - o < 4096 ? np + T - o : 4096;
        API(kvz_forward(m, kv, all + o, nb, o, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_TO_DOC, NULL));
    }
    double t = sync_now() - t0 + first_token(m, kv, q, np + T);
    kvz_kv_free(kv);
    free(all);
    return t;
}

/* Layers of two device caches differing (rows exported as bf16, compared bit for bit),
 * -1 when they cannot be read. */
static int caches_differ(const kvz_kv *a, const kvz_kv *b, const kvz_config *c)
{
    int bad = 0;
    for (int32_t l = 0; l < c->n_layer; l++) {
        int64_t n = 0;
        for (int32_t h = 0; h < c->n_kv_head; h++) {
            if (kvz_kv_len(a, l, h) != kvz_kv_len(b, l, h)) return l + 1;
            n += kvz_kv_len(a, l, h);
        }
        const size_t rb = (size_t)c->head_dim * 2;
        uint8_t *ka = malloc(n * rb + 1), *va = malloc(n * rb + 1), *kb = malloc(n * rb + 1), *vb = malloc(n * rb + 1);
        uint32_t *pa = malloc(n * 4 + 4), *pb = malloc(n * 4 + 4);
        int rc = !ka || !va || !kb || !vb || !pa || !pb;
        if (!rc) rc = kvz_cuda_kv_export_layer_to(a, l, KVZ_KV_BF16, ka, va, pa);
        if (!rc) rc = kvz_cuda_kv_export_layer_to(b, l, KVZ_KV_BF16, kb, vb, pb);
        if (rc) bad = -1;
        else bad += memcmp(ka, kb, n * rb) || memcmp(va, vb, n * rb) || memcmp(pa, pb, n * 4);
        free(ka); free(va); free(kb); free(vb); free(pa); free(pb);
        if (bad < 0) return -1;
    }
    return bad;
}

typedef struct store_row {
    int32_t T;
    const char *dt;
    double ingest, old_load, load_cold, load, ft, reprefill, hit, hit_ft, load_map, load_direct;
    kvz_load_profile prof; /* one more load, default route */
    kvz_load_layer_time trace[128]; /* ... its per-layer timeline */
    kvz_load_layer_time trace_d[128]; /* a warm direct-route load's (records verified on the device) */
    kvz_load_profile prof_d;
    double load_direct_host; /* the direct route with every record verified on the host (A/B) */
    kvz_load_layer_time trace_dh[128]; /* ... a warm load's timeline */
    kvz_load_profile prof_dh;
    kvz_load_profile prof_cold; /* the first load in the process (default route) */
    int differ; /* layers the direct route's cache differs from the default's */
    int n_trace;
    double stored_per_tok, kept_gb, kept_bf16_gb;
    int ok;
} store_row;

static int dtype_of(const char *name)
{
    for (int d = 0; d <= KVZ_KV_Q4; d++)
        if (!strcmp(kvz_kv_dtype_name(d), name)) return d;
    return -1;
}

static void run_store(kvz_model *m, const kvz_tokens *pre, const int32_t *toks, const int32_t *lens, int nlens,
                      const char *dtypes, const shape *s)
{
    double mc, mcmt, h2d;
    io_bounds(&mc, &mcmt, &h2d);
    printf("\nmeasured I/O bounds: host memcpy %.1f GB/s one thread, %.1f GB/s %d threads (read + written bytes), "
           "pinned H2D %.1f GB/s\n", mc / 1e9, mcmt / 1e9, omp_get_max_threads(), h2d / 1e9);
    const kvz_config *c = kvz_model_config(m);
    char dir[] = "/tmp/kvz-bench-store-XXXXXX";
    if (!mkdtemp(dir)) DIE("mkdtemp");
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    kvz_store *st;
    API(kvz_store_open(dir, KVZ_STORE_CREATE, 0, fp, &st));
    kvz_tokens q = {0};
    API(kvz_chat_question(kvz_model_tokenizer(m), "What does the document say about the warranty period?", &q));
    kvz_doc_cache *dc;
    API(kvz_doc_cache_create(m, (uint64_t)64 << 30, NULL, &dc));
    { /* warm-up: the question pass and first decode step with an output buffer (graph capture) */
        kvz_kv *kv;
        API(kvz_kv_create(m, 2048, 1024, &kv));
        API(kvz_forward(m, kv, toks, 1024, 0, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_TO_DOC, NULL));
        kvz_kv_checkpoint(kv);
        for (int i = 0; i < 3; i++) {
            first_token(m, kv, &q, 1024);
            kvz_kv_rollback(kv);
        }
        kvz_kv_free(kv);
    }
    store_row rows[32];
    int nr = 0;
    char dl[64];
    snprintf(dl, sizeof dl, "%s", dtypes);
    for (char *tk = strtok(dl, ","); tk && nr < 32; tk = strtok(NULL, ",")) {
        const int dt = dtype_of(tk);
        if (dt < 0) DIE("unknown dtype %s", tk);
        for (int i = 0; i < nlens && nr < 32; i++) {
            store_row *r = &rows[nr++];
            memset(r, 0, sizeof *r);
            r->T = lens[i];
            r->dt = kvz_kv_dtype_name(dt);
            char id[64];
            snprintf(id, sizeof id, "doc-%d-%s", r->T, r->dt);
            kvz_ingest_opts o;
            kvz_ingest_defaults(&o);
            o.dtype = (uint8_t)dt;
            kvz_ingest_result res;
            double t0 = sync_now();
            int rc = kvz_ingest_doc(m, st, id, NULL, toks, r->T, &o, &res);
            r->ingest = sync_now() - t0;
            if (rc) {
                printf("(%s at %d tokens: ingest failed: %s (%s) - row left out)\n", r->dt, r->T, kvz_strerror(rc),
                       kvz_error_detail());
                nr--;
                continue;
            }
            r->ok = 1;
            r->stored_per_tok = (double)res.bytes_stored / (res.n_prefix + res.n_ctx);
            kvz_kv *kv;
            kvz_doc_meta dm;
            if (dt == KVZ_KV_F16) { /* the old loader, for comparison */
                t0 = sync_now();
                API(kvz_doc_load(m, st, id, 0, 1024, &kv, &dm));
                r->old_load = sync_now() - t0;
                kvz_kv_free(kv);
            }
            for (int rep = 0; rep < 3; rep++) { /* first: cold (pinned slots grow); then best of 2 */
                kvz_load_opts lcold = {.profile = &r->prof_cold};
                t0 = sync_now();
                API(kvz_load_doc(m, st, id, 0, 1024, rep == 0 ? &lcold : NULL, &kv, &dm));
                double tl = sync_now() - t0;
                if (rep == 0) r->load_cold = tl;
                else if (rep == 1 || tl < r->load) r->load = tl;
                if (rep < 2) kvz_kv_free(kv);
            }
            { /* where the time goes (default route: copy), the direct route (codec-none records uploaded from
               * the registered map) and the route before it (through the map), interleaved with the default */
                kvz_kv *k2;
                kvz_load_opts lo = {.profile = &r->prof, .trace = r->trace};
                API(kvz_load_doc(m, st, id, 0, 1024, &lo, &k2, &dm));
                kvz_kv_free(k2);
                r->n_trace = c->n_layer;
                kvz_load_opts lc = {.direct = 1}, lch = {.direct = 1, .host_verify = 1};
                for (int rep = 0; rep < 4; rep++) { /* the first direct load pins the map's regions (cold) */
                    t0 = sync_now();
                    API(kvz_load_doc(m, st, id, 0, 1024, &lc, &k2, &dm));
                    double tl = sync_now() - t0;
                    if (rep == 1 || (rep > 1 && tl < r->load_direct)) r->load_direct = tl;
                    kvz_kv_free(k2);
                    t0 = sync_now(); /* A/B: the same route, every record verified on the host */
                    API(kvz_load_doc(m, st, id, 0, 1024, &lch, &k2, &dm));
                    tl = sync_now() - t0;
                    if (rep == 1 || (rep > 1 && tl < r->load_direct_host)) r->load_direct_host = tl;
                    kvz_kv_free(k2);
                    t0 = sync_now();
                    API(kvz_load_doc(m, st, id, 0, 1024, NULL, &k2, &dm));
                    tl = sync_now() - t0;
                    if (tl < r->load) r->load = tl;
                    kvz_kv_free(k2);
                }
                kvz_load_opts ldh = {.direct = 1, .host_verify = 1, .profile = &r->prof_dh, .trace = r->trace_dh};
                API(kvz_load_doc(m, st, id, 0, 1024, &ldh, &k2, &dm));
                kvz_kv_free(k2);
                kvz_load_opts ld = {.direct = 1, .profile = &r->prof_d, .trace = r->trace_d};
                API(kvz_load_doc(m, st, id, 0, 1024, &ld, &k2, &dm));
                kvz_kv *k3;
                API(kvz_load_doc(m, st, id, 0, 1024, NULL, &k3, &dm));
                r->differ = caches_differ(k2, k3, c);
                kvz_kv_free(k3);
                kvz_kv_free(k2);
                kvz_load_opts lm = {.map_only = 1};
                for (int rep = 0; rep < 2; rep++) {
                    t0 = sync_now();
                    API(kvz_load_doc(m, st, id, 0, 1024, &lm, &k2, &dm));
                    double tl = sync_now() - t0;
                    if (rep == 0 || tl < r->load_map) r->load_map = tl;
                    kvz_kv_free(k2);
                }
            }
            const int32_t n_doc = dm.n_prefix + dm.n_ctx;
            r->ft = first_token(m, kv, &q, n_doc);
            kvz_kv_free(kv);
            const size_t rb = kvz_kv_row_bytes(dm.dtype, (size_t)c->head_dim);
            r->kept_gb = (double)dm.rows * (2.0 * rb + 4) / 1e9;
            r->kept_bf16_gb = (double)dm.rows * 2.0 * c->head_dim * 2 / 1e9;
            r->reprefill = reprefill_first(m, pre->ids, (int32_t)pre->n, toks, r->T, &q);
            double t2 = reprefill_first(m, pre->ids, (int32_t)pre->n, toks, r->T, &q);
            if (t2 < r->reprefill) r->reprefill = t2;
            /* second question on the same document in this process: the cache */
            int hit;
            API(kvz_doc_cache_get(dc, st, id, 0, 1024, &kv, &dm, &hit));
            first_token(m, kv, &q, n_doc);
            API(kvz_doc_cache_put(dc, kv));
            t0 = sync_now();
            API(kvz_doc_cache_get(dc, st, id, 0, 1024, &kv, &dm, &hit));
            r->hit = sync_now() - t0;
            if (!hit) DIE("document cache: no hit on the second get");
            r->hit_ft = first_token(m, kv, &q, n_doc);
            API(kvz_doc_cache_put(dc, kv));
            kvz_doc_cache_clear(dc);
            fflush(stdout);
        }
    }
    host_io_bounds(dir, h2d);
    printf("\n| tokens | stored | ingest s | old load s | load s (cold) | load s | first token s | load + first ÷ re-prefill + first (re-prefill s) | 2nd question: cache get + first token s | ÷ re-prefill | kept K/V stored GB | load GB/s stored (bf16 in HBM) | %% of H2D bound (%.1f GB/s) |\n", h2d / 1e9);
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nr; i++) {
        const store_row *r = &rows[i];
        char old[32] = "-";
        if (r->old_load > 0) snprintf(old, sizeof old, "%.3f", r->old_load);
        printf("| %d | %s | %.3f | %s | %.3f | %.3f | %.3f | **%.3f** (%.3f) | %.5f + %.3f | **%.3f** | %.3f | %.1f (%.1f) | %.0f%% |\n",
               r->T, r->dt, r->ingest, old, r->load_cold, r->load, r->ft, (r->load + r->ft) / r->reprefill,
               r->reprefill, r->hit, r->hit_ft, (r->hit + r->hit_ft) / r->reprefill, r->kept_gb,
               r->kept_gb / r->load, r->kept_bf16_gb / r->load, 100 * r->kept_gb / r->load / (h2d / 1e9));
    }
    printf("\nWhere a cold load goes (the first load of each document in the process; the staging slots grow "
           "(KVZ_STAGING=hostalloc: a cudaHostAlloc per slot, else one registered mapping) when a document needs "
           "longer ones):\n\n| tokens | stored | cold load s | staging slots s | "
           "cache alloc s | upload thread: wait for layers / H2D + kernel s | workers: copy / hash / zstd s |\n"
           "|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nr; i++) {
        const store_row *r = &rows[i];
        const kvz_load_profile *p = &r->prof_cold;
        printf("| %d | %s | %.4f | %.4f | %.4f | %.4f / %.4f | %.4f / %.4f / %.4f |\n", r->T, r->dt, r->load_cold,
               p->slots_s, p->alloc_s, p->ready_wait_s, p->upload_s, p->copy_s, p->hash_s, p->zstd_s);
    }
    printf("\n| tokens | stored | load s | direct route s (uploads from the registered map) | load s through the map (the route before) | "
           "records direct / copied / zstd / mapped | worker s: copy (pread) / hash + row check / header check / zstd / "
           "map route / pin | slot wait s | upload thread s: wait for layers / H2D + kernel / alloc | "
           "total s |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nr; i++) {
        const store_row *r = &rows[i];
        const kvz_load_profile *p = &r->prof;
        printf("| %d | %s | %.4f | %.4f | %.4f | %llu / %llu / %llu / %llu | %.4f / %.4f / %.4f / %.4f / %.4f / %.4f | %.4f "
               "| %.4f / %.4f / %.4f | %.4f |\n", r->T, r->dt, r->load, r->load_direct, r->load_map,
               (unsigned long long)p->records_direct, (unsigned long long)p->records_copied,
               (unsigned long long)p->records_zstd, (unsigned long long)p->records_mapped, p->copy_s, p->hash_s,
               p->check_s, p->zstd_s, p->map_s, p->register_s, p->slot_wait_s,
               p->ready_wait_s, p->upload_s, p->alloc_s, p->total_s);
    }
    printf("\n| tokens | stored | kept K/V stored GB | direct route, verified on the GPU s | GB/s | %% of H2D | "
           "direct route, verified on the host s | GB/s | %% of H2D | copy route s | %% of H2D | records verified on "
           "the GPU | H2D bound %.1f GB/s, 50%% = |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", h2d / 1e9);
    for (int i = 0; i < nr; i++) { /* warm loads, best of 3, the three routes interleaved */
        const store_row *r = &rows[i];
        const double b = h2d / 1e9;
        printf("| %d | %s | %.3f | **%.4f** | %.1f | **%.0f%%** | %.4f | %.1f | %.0f%% | %.4f | %.0f%% | %llu of %llu | "
               "%.4f s |\n", r->T, r->dt, r->kept_gb, r->load_direct, r->kept_gb / r->load_direct,
               100 * r->kept_gb / r->load_direct / b, r->load_direct_host, r->kept_gb / r->load_direct_host,
               100 * r->kept_gb / r->load_direct_host / b, r->load, 100 * r->kept_gb / r->load / b,
               (unsigned long long)r->prof_d.records_dev_verified, (unsigned long long)r->prof_d.records_direct,
               r->kept_gb / (0.5 * b));
    }
    /* the per-layer timeline of the profiled load, longest document of each dtype
     * (every document with KVZ_TRACE_ALL=1) */
    const int trace_all = getenv("KVZ_TRACE_ALL") && atoi(getenv("KVZ_TRACE_ALL"));
    for (int i = 0; i < nr; i++) {
        if ((!trace_all && i + 1 < nr && rows[i + 1].dt == rows[i].dt) || !rows[i].n_trace) continue;
        const store_row *r = &rows[i];
        for (int d = 0; d < 3; d++) {
            static const char *const what[3] = {"default route", "direct route (warm: map pinned), records verified on "
                                                "the GPU where they can be", "direct route (warm: map pinned), every "
                                                "record verified on the host"};
            printf("\nper-layer load timeline, %d tokens %s, %s (ms from the start; route c copied / z zstd / "
                   "d direct, verified on the host / g direct, verified on the GPU after the upload; stored MB of raw "
                   "MB):\n", r->T, r->dt, what[d]);
            for (int l = 0; l < r->n_trace && l < 128; l++) {
                const kvz_load_layer_time *t = d == 2 ? &r->trace_dh[l] : d ? &r->trace_d[l] : &r->trace[l];
                printf("  L%02d %c %6.2f/%6.2f MB claim %6.2f ready %6.2f (zstd %5.2f) take %6.2f upload %6.2f checked %6.2f\n",
                       l, t->route, t->bytes / 1e6, t->raw / 1e6, t->claim_s * 1e3, t->ready_s * 1e3, t->zstd_s * 1e3,
                       t->take_s * 1e3, t->upload_s * 1e3, t->checked_s * 1e3);
            }
            if (d) {
                const kvz_load_profile *p = d == 2 ? &r->prof_dh : &r->prof_d;
                printf("  verification: %llu record(s) on the GPU (checksum kernels + row check in the load kernel; "
                       "results compared after the upload: %.4f s), the rest on the host\n",
                       (unsigned long long)p->records_dev_verified, p->dev_verify_s);
                if (d == 1)
                    printf("  direct route: caches of the two routes differ in %d layer(s) (bf16 rows, positions: bit "
                           "for bit)\n", r->differ);
                printf("  direct route: %.4f s; records direct %llu / copied %llu / zstd %llu; worker s: copy %.4f hash "
                       "%.4f check %.4f zstd %.4f pin %.4f slot wait %.4f; upload thread: wait %.4f H2D + kernel %.4f\n",
                       p->total_s, (unsigned long long)p->records_direct, (unsigned long long)p->records_copied,
                       (unsigned long long)p->records_zstd, p->copy_s, p->hash_s, p->check_s, p->zstd_s, p->register_s,
                       p->slot_wait_s, p->ready_wait_s, p->upload_s);
            }
        }
    }
    /* decode threads vs load time, longest document of each dtype */
    printf("\n| load threads (longest document) | stored | 1 | 2 | 4 | 8 | 12 | 16 | GB/s at best |\n|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nr; i++) {
        if (i + 1 < nr && rows[i + 1].dt == rows[i].dt) continue;
        char id[64];
        snprintf(id, sizeof id, "doc-%d-%s", rows[i].T, rows[i].dt);
        const int nt[6] = {1, 2, 4, 8, 12, 16};
        double best = 1e30;
        printf("| %d | %s |", rows[i].T, rows[i].dt);
        for (int k = 0; k < 6; k++) {
            kvz_load_opts lo = {.threads = nt[k]};
            double tb = 1e30;
            for (int rep = 0; rep < 2; rep++) {
                kvz_kv *kv;
                kvz_doc_meta dm;
                double t0 = sync_now();
                API(kvz_load_doc(m, st, id, 0, 1024, &lo, &kv, &dm));
                double tl = sync_now() - t0;
                tb = tl < tb ? tl : tb;
                kvz_kv_free(kv);
            }
            best = tb < best ? tb : best;
            printf(" %.3f |", tb);
        }
        printf(" %.1f |\n", rows[i].kept_gb / best);
    }
    printf("\n| stored bytes per context token (r = 0.3, global) | tokens | bytes/token | ÷ raw bf16 K/V (%.0f B/token) |\n|---|---|---|---|\n",
           s->kv_row_bytes);
    for (int i = 0; i < nr; i++)
        printf("| %s | %d | %.0f | %.3f |\n", rows[i].dt, rows[i].T, rows[i].stored_per_tok,
               rows[i].stored_per_tok / s->kv_row_bytes);
    fflush(stdout);
    kvz_doc_cache_free(dc);
    kvz_tokens_free(&q);
    kvz_store_close(st);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
}

/* kernel-only ingest of every file in @p dir (what kvz_ingest_doc runs on the device:
 * prefill + repeat passes with scoring + device top-k + compaction; no export, no
 * encoding, no store): the rate the end-to-end kvzip-ingest is compared with */
static void run_corpus_kernels(kvz_model *m, const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) DIE("cannot read %s", dir);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    kvz_tokens pre = {0};
    API(kvz_chat_prefix(tok, &pre));
    struct dirent *e;
    int64_t tokens = 0;
    double secs = 0;
    int n = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        char *buf = malloc(1 << 22);
        size_t len = fread(buf, 1, (1 << 22) - 1, f);
        fclose(f);
        kvz_tokens t = {0};
        API(kvz_tokenizer_encode(tok, buf, len, 0, &t));
        free(buf);
        kvz_kvzip_params p;
        kvz_kvzip_defaults(&p);
        kvz_kv *kv;
        const int64_t cap = kvz_kvzip_cache_rows(m, (int32_t)pre.n, (int32_t)t.n, &p);
        if (cap < 0) DIE("cache rows");
        int32_t *all = doc_tokens(pre.ids, (int32_t)pre.n, t.ids, (int32_t)t.n);
        double t0 = sync_now();
        API(kvz_kv_create(m, cap, 0, &kv));
        API(kvz_kvzip_score(m, kv, all, (int32_t)pre.n, t.ids, (int32_t)t.n, &p, NULL, NULL, NULL));
        int64_t kept = kvz_cuda_kvzip_select(kv, (int32_t)pre.n, (int32_t)t.n, p.ratio, p.mode, NULL, NULL);
        if (kept < 0) DIE("select");
        kvz_kv_free(kv);
        secs += sync_now() - t0;
        tokens += (int64_t)t.n;
        n++;
        free(all);
        kvz_tokens_free(&t);
    }
    closedir(d);
    kvz_tokens_free(&pre);
    printf("corpus kernel-only ingest: %d documents, %lld tokens in %.3f s = %.0f tok/s\n", n, (long long)tokens, secs,
           tokens / secs);
}

/* ---------------------------------------------------------------- multi-document TTFT */
/* kvz_bench_gpu --compose: 4 documents (default 2K, 4K, 6K, 8K tokens, stored as ingest
 * stores them: q8, r = 0.3) composed sequentially for one question. The bound:
 * time to first token <= 1.5 x (sum of the single-document load times) + the question's
 * prefill. Single loads: kvz_load_doc (pipelined, best of 3 after a cold run); the
 * composition: kvz_docs_load on the device path (best of 3 after a cold run), its
 * parallel placement (no re-rotation: the kernel's share) and the host path (fp32
 * re-rotation + kvz_kv_set_layer, the route before the device kernel) once; the
 * question's prefill + first token on the composed cache (kvz_generate, 1 token). The
 * device path's last-token logits are checked against the host path's. After the table,
 * one line of where a composition's time goes (kvz_compose_opts.profile: the workers'
 * copy / hash / zstd / map seconds, slot waits, the upload thread's waits and uploads)
 * and the same composition read through the LMDB map (map_only). */
static void run_compose(kvz_model *m, const int32_t *lens, int nlens)
{
    const kvz_config *c = kvz_model_config(m);
    char dir[] = "/tmp/kvz-bench-compose-XXXXXX";
    if (!mkdtemp(dir)) DIE("mkdtemp");
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    kvz_store *st;
    API(kvz_store_open(dir, KVZ_STORE_CREATE, 0, fp, &st));
    kvz_tokens q = {0};
    API(kvz_chat_question(kvz_model_tokenizer(m), "Which of these documents gives the warranty period, and what is it?", &q));
    char ids[8][32];
    const char *idp[8];
    double single[8], sum = 0;
    int64_t tokens = 0;
    kvz_ingest_opts o;
    kvz_ingest_defaults(&o);
    for (int i = 0; i < nlens; i++) {
        int32_t *t = malloc(sizeof(int32_t) * (size_t)lens[i]);
        for (int32_t k = 0; k < lens[i]; k++) t[k] = 32 + rnd(95);
        snprintf(ids[i], sizeof ids[i], "doc%d-%d", i, lens[i]);
        idp[i] = ids[i];
        kvz_ingest_result res;
        API(kvz_ingest_doc(m, st, ids[i], NULL, t, lens[i], &o, &res));
        tokens += lens[i];
        free(t);
        single[i] = 1e30;
        for (int rep = 0; rep < 4; rep++) { /* first: cold (pinned slots grow); then best of 3 */
            kvz_kv *kv;
            kvz_doc_meta dm;
            double t0 = sync_now();
            API(kvz_load_doc(m, st, ids[i], 0, 1024, NULL, &kv, &dm));
            double tl = sync_now() - t0;
            if (rep > 0 && tl < single[i]) single[i] = tl;
            kvz_kv_free(kv);
        }
        sum += single[i];
    }
    const int64_t extra = (int64_t)q.n + 16;
    double best[2] = {1e30, 1e30}, host = 0, ft = 1e30;
    kvz_compose_meta cm;
    float *lg = malloc(sizeof(float) * (size_t)c->n_vocab), *lh = malloc(sizeof(float) * (size_t)c->n_vocab);
    for (int place = 0; place < 2; place++) {
        kvz_compose_opts co;
        kvz_compose_defaults(&co);
        co.placement = place ? KVZ_PLACE_PARALLEL : KVZ_PLACE_SEQUENTIAL;
        for (int rep = 0; rep < 4; rep++) {
            kvz_kv *kv;
            double t0 = sync_now();
            API(kvz_docs_load(m, st, idp, nlens, &co, extra, 1024, &kv, &cm, NULL));
            double tl = sync_now() - t0;
            if (rep > 0 && tl < best[place]) best[place] = tl;
            if (place == 0 && rep > 0) {
                kvz_kv_checkpoint(kv);
                double f = first_token(m, kv, &q, cm.q_pos);
                ft = f < ft ? f : ft;
                kvz_kv_rollback(kv);
            }
            if (place == 0 && rep == 3) {
                API(kvz_forward(m, kv, q.ids, (int32_t)q.n, cm.q_pos, lg, KVZ_FWD_LOGITS_LAST, NULL));
                kvz_kv_rollback(kv);
            }
            kvz_kv_free(kv);
        }
    }
    { /* the host path once, and its logits */
        kvz_compose_opts co;
        kvz_compose_defaults(&co);
        co.placement = KVZ_PLACE_SEQUENTIAL;
        co.host_path = 1;
        kvz_kv *kv;
        double t0 = sync_now();
        API(kvz_docs_load(m, st, idp, nlens, &co, extra, 1024, &kv, &cm, NULL));
        host = sync_now() - t0;
        kvz_kv_checkpoint(kv);
        API(kvz_forward(m, kv, q.ids, (int32_t)q.n, cm.q_pos, lh, KVZ_FWD_LOGITS_LAST, NULL));
        kvz_kv_free(kv);
    }
    double num = 0, den = 0;
    for (int32_t i = 0; i < c->n_vocab; i++) {
        num += ((double)lg[i] - lh[i]) * ((double)lg[i] - lh[i]);
        den += (double)lh[i] * lh[i];
    }
    const double kept_gb = (double)cm.rows * 2.0 * c->head_dim * 2 / 1e9;
    printf("\nmulti-document composition: %d documents, %lld context tokens + %d prefix, stored q8 r = 0.3, "
           "span %lld, questions at %d; %.2f GB of bf16 K/V composed\n", nlens, (long long)tokens, cm.n_prefix,
           (long long)cm.span_seq, cm.q_pos, kept_gb);
    printf("| single-document loads s (kvz_load_doc, best of 3) | sum s | compose s, sequential (device re-rotation) "
           "| compose s, parallel (no re-rotation) | compose s, host path (old) | question prefill + first token s "
           "| TTFT s | bound 1.5 x sum + question s | TTFT / bound | device vs host path logits |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n|");
    for (int i = 0; i < nlens; i++) printf("%s%.4f", i ? " + " : " ", single[i]);
    const double ttft = best[0] + ft, bound = 1.5 * sum + ft;
    printf(" | %.4f | %.4f | %.4f | %.3f | %.4f | **%.4f** | %.4f | **%.2f** | %.1e |\n", sum, best[0], best[1], host,
           ft, ttft, bound, ttft / bound, sqrt(num / den));
    { /* where the composition's time goes: one more sequential composition with a profile,
       * and one through the LMDB map (map_only: the route before the copy reads) */
        kvz_load_profile pf[2];
        double tl[2];
        for (int mo = 0; mo < 2; mo++) {
            kvz_compose_opts co;
            kvz_compose_defaults(&co);
            co.placement = KVZ_PLACE_SEQUENTIAL;
            co.map_only = mo;
            co.profile = &pf[mo];
            kvz_kv *kv;
            double t0 = sync_now();
            API(kvz_docs_load(m, st, idp, nlens, &co, extra, 1024, &kv, &cm, NULL));
            tl[mo] = sync_now() - t0;
            kvz_kv_free(kv);
        }
        printf("compose profile (sequential, one more run): %.4f s (through the map: %.4f s); records copied / zstd / "
               "mapped %llu / %llu / %llu; workers (%d): copy %.4f / hash + row check %.4f / header check %.4f / zstd "
               "%.4f / map %.4f s, slot wait %.4f s; upload thread: wait for records %.4f s, H2D + kernels + "
               "re-rotation %.4f s; cache alloc %.4f s\n", tl[0], tl[1], (unsigned long long)pf[0].records_copied,
               (unsigned long long)pf[0].records_zstd, (unsigned long long)pf[0].records_mapped, kvz_load_threads(NULL),
               pf[0].copy_s, pf[0].hash_s, pf[0].check_s, pf[0].zstd_s, pf[0].map_s, pf[0].slot_wait_s,
               pf[0].ready_wait_s, pf[0].upload_s, pf[0].alloc_s);
        fflush(stdout);
    }
    free(lg);
    free(lh);
    kvz_tokens_free(&q);
    kvz_store_close(st);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
}

/* ---------------------------------------------------------------- continuous batching */
/* kvz_bench_gpu --multi 1,8,32 [--multi-ctx T] [--multi-churn K]: the batched decode step
 * (kvz_forward_multi) over n caches, each a KVzip-compressed document of T context tokens
 * (r = 0.3, global: the bench's ingest path, prefill + repeat/score passes + device top-k +
 * compaction) with a LongFlow output buffer of 256 slots. Four distinct documents are
 * ingested; cache i gets document i % 4's kept rows (kvz_kv_get_head → kvz_kv_set_layer: the
 * lengths per head are the real compressed ones). Each n, fixed membership: 5 warm steps,
 * then the median of 30 steps (wall time of kvz_forward_multi, all n logits rows into
 * pinned host memory), then the same with the argmax ids alone coming back
 * (kvz_forward_multi_top without logits rows: what kvzip-serve does for greedy answers).
 * Bound of a step: (linear + LM-head weight bytes + the n caches' K/V bytes: document
 * rows + buffer slots) ÷ the measured copy bandwidth. n = 1 is the single-cache decode
 * step (kvz_forward_multi with one cache runs kvz_forward, the CUDA-graph path).
 * Churn (K > 0): four more documents of T/3, T/2, 2T/3 and 5T/6 tokens fill MULTI_SPARE
 * spare caches; per n, from the fixed members (buffers emptied), every K steps one member
 * leaves (round robin; its buffer is emptied and it goes to the back of the spare queue)
 * and the next spare joins at its place: kvzip-serve's pattern of answers ending and
 * others joining, without the server. 5 warm steps, then 100 steps (ids only): median,
 * mean and worst step, how each step ran (CUDA graph replayed / captured / eager / one
 * pass per cache), beside the fixed-membership figure and the mean HBM bound of the
 * steps' memberships. */
#define MULTI_DOCS 4
#define MULTI_B 256
#define MULTI_SINKS 4
#define MULTI_SPARE 8
#define MULTI_CHURN_STEPS 100
static void run_multi(kvz_model *m, const int32_t *pre, int32_t np, const int32_t *ns, int nns, int32_t T,
                      const shape *s, double bw, int churn)
{
    const kvz_config *c = kvz_model_config(m);
    const int32_t NL = c->n_layer, nkv = c->n_kv_head, hd = c->head_dim, V = c->n_vocab;
    int32_t nmax = 1;
    for (int i = 0; i < nns; i++) nmax = ns[i] > nmax ? ns[i] : nmax;
    const int nd = churn > 0 ? 2 * MULTI_DOCS : MULTI_DOCS;
    const int32_t npool = nmax + (churn > 0 ? MULTI_SPARE : 0);
    int32_t Td[2 * MULTI_DOCS];
    for (int d = 0; d < nd; d++) {
        Td[d] = d < MULTI_DOCS ? T : (int32_t)((int64_t)T * (d - MULTI_DOCS + 2) / 6);
        if (Td[d] < 16) Td[d] = 16;
    }
    kvz_kvzip_params p;
    kvz_kvzip_defaults(&p);
    p.prefill_chunk = 8192;
    const size_t nlh = (size_t)NL * nkv;
    /* kept rows of each document, host fp32, per (layer, head) */
    uint32_t *cnt = malloc(sizeof(uint32_t) * nlh * nd);
    float **dk = calloc((size_t)nd * NL, sizeof(float *)), **dv = calloc((size_t)nd * NL, sizeof(float *));
    int32_t **dp = calloc((size_t)nd * NL, sizeof(int32_t *));
    int32_t *ctx = malloc(sizeof(int32_t) * (size_t)T);
    int64_t kept_rows = 0;
    double t_ing = kvz_now();
    for (int d = 0; d < nd; d++) {
        const int32_t Tn = Td[d];
        for (int32_t i = 0; i < Tn; i++) ctx[i] = 32 + rnd(95);
        kvz_kv *kv;
        /* the scoring's repeat chunks follow the document's own length (a shorter spare
         * may need more rows than the longest document's chunking leaves) */
        const int64_t cap = kvz_kvzip_cache_rows(m, np, Tn, &p);
        if (cap < 0) DIE("cache rows: %s (%s)", kvz_strerror((int)cap), kvz_error_detail());
        API(kvz_kv_create(m, cap, 0, &kv));
        int32_t *all = doc_tokens(pre, np, ctx, Tn);
        prefill_passes(m, kv, all, np + Tn, p.prefill_chunk);
        API(kvz_kvzip_score_chunks(m, kv, np, ctx, Tn, &p, NULL, NULL, NULL, 0, 0));
        int64_t kept = kvz_cuda_kvzip_select(kv, np, Tn, p.ratio, p.mode, NULL, cnt + (size_t)d * nlh);
        if (kept < 0) DIE("select: %s (%s)", kvz_strerror((int)kept), kvz_error_detail());
        for (int32_t l = 0; l < NL; l++) {
            size_t rows = 0;
            for (int32_t h = 0; h < nkv; h++) rows += (size_t)kvz_kv_len(kv, l, h);
            float *K = malloc(sizeof(float) * rows * hd), *Vv = malloc(sizeof(float) * rows * hd);
            int32_t *P = malloc(sizeof(int32_t) * rows);
            size_t off = 0;
            for (int32_t h = 0; h < nkv; h++) {
                const int64_t n = kvz_kv_len(kv, l, h);
                API(kvz_kv_get_head(kv, l, h, K + off * hd, Vv + off * hd, P + off));
                cnt[(size_t)d * nlh + (size_t)l * nkv + h] = (uint32_t)n;
                off += (size_t)n;
            }
            if (d < MULTI_DOCS) kept_rows += (int64_t)rows;
            dk[d * NL + l] = K; dv[d * NL + l] = Vv; dp[d * NL + l] = P;
        }
        free(all);
        kvz_kv_free(kv);
    }
    t_ing = kvz_now() - t_ing;
    /* the pool: members 0..nmax-1 (document i % 4), then the spares (documents 4..7) */
    kvz_kv **kvs = calloc((size_t)npool, sizeof *kvs);
    int64_t *rows_of = calloc((size_t)npool, sizeof *rows_of);
    int32_t *tok = malloc(sizeof(int32_t) * npool), *pos = malloc(sizeof(int32_t) * npool);
    for (int32_t i = 0; i < npool; i++) {
        const int d = i < nmax ? i % MULTI_DOCS : MULTI_DOCS + (i - nmax) % MULTI_DOCS;
        int64_t mx = 0;
        for (size_t j = 0; j < nlh; j++) mx = cnt[(size_t)d * nlh + j] > mx ? cnt[(size_t)d * nlh + j] : mx;
        API(kvz_kv_create(m, mx, MULTI_B, &kvs[i]));
        kvz_kv_set_sinks(kvs[i], MULTI_SINKS);
        kvz_kv_clear(kvs[i]);
        for (int32_t l = 0; l < NL; l++)
            API(kvz_kv_set_layer(kvs[i], l, cnt + (size_t)d * nlh + (size_t)l * nkv, dp[d * NL + l], dk[d * NL + l],
                                 dv[d * NL + l]));
        kvz_kv_checkpoint(kvs[i]); /* rollback: back to the document, buffer empty */
        for (size_t j = 0; j < nlh; j++) rows_of[i] += cnt[(size_t)d * nlh + j];
        tok[i] = 32 + rnd(95);
        pos[i] = np + T;
    }
    printf("\n### continuous batching (kvz_forward_multi), synthetic %s\n\n", c->name);
    printf("%d distinct documents of %d context tokens ingested (KVzip r = %.2f, global) in %.1f s: %.0f kept "
           "rows per (layer, head) on average; cache i holds document i %% %d; LongFlow buffer %d slots, "
           "%d sinks\n\n", nd, T, p.ratio, t_ing, (double)kept_rows / (MULTI_DOCS * (double)nlh),
           MULTI_DOCS, MULTI_B, MULTI_SINKS);
    printf("| streams n | ms/step (median of 30) | aggregate tok/s | step ÷ n=1 step (bound <= 2) | tok/s ÷ n=1 "
           "(bound >= 8 at n = 32) | HBM bound ms (weights + K/V ÷ %.2f TB/s) | %% of bound | ms/step, argmax ids "
           "only (median of 30) | ids-only step ÷ n=1 | steps replayed/captured/eager/passes |\n"
           "|---|---|---|---|---|---|---|---|---|---|\n", bw / 1e12);
    float *lg;
    CU(cudaMallocHost((void **)&lg, sizeof(float) * (size_t)nmax * V));
    int32_t *top = malloc(sizeof(int32_t) * npool);
    uint8_t *nowant = calloc((size_t)npool, 1);
    double base = 0, base_top = 0, *fixed_top = calloc((size_t)nns, sizeof(double));
    for (int k = 0; k < nns; k++) {
        const int32_t n = ns[k];
        if (n < 1 || n > nmax) continue;
        double t[30], tt[30];
        int64_t paths[4] = {0};
        for (int it = 0; it < 35; it++) { /* every logits row to the host, argmax there */
            double t0 = kvz_now();
            API(kvz_forward_multi(m, kvs, tok, pos, n, lg));
            double dt = kvz_now() - t0;
            if (it >= 5) t[it - 5] = dt;
            for (int32_t i = 0; i < n; i++) {
                tok[i] = kvz_argmax(lg + (size_t)i * V, V);
                pos[i]++;
            }
        }
        for (int it = 0; it < 35; it++) { /* the argmax ids alone */
            kvz_step_io io = {.want_logits = nowant, .top = top, .path = 0};
            double t0 = kvz_now();
            API(kvz_forward_multi_top(m, kvs, tok, pos, n, NULL, &io));
            double dt = kvz_now() - t0;
            if (it >= 5) {
                tt[it - 5] = dt;
                paths[io.path & 3]++;
            }
            for (int32_t i = 0; i < n; i++) {
                tok[i] = top[i];
                pos[i]++;
            }
        }
        const double ms = median(t, 30) * 1e3, mst = median(tt, 30) * 1e3;
        fixed_top[k] = mst;
        if (base == 0) base = ms;
        if (base_top == 0) base_top = mst;
        double kvb = 0;
        for (int32_t i = 0; i < n; i++) kvb += ((double)rows_of[i] + (double)nlh * MULTI_B) * hd * 2.0 * 2.0;
        const double bound = (2.0 * (s->params_linear + s->lm_head) + kvb) / bw * 1e3;
        printf("| %d | %.3f | %.0f | %.2f | %.2f | %.3f | %.0f%% | %.3f | %.2f | %lld/%lld/%lld/%lld |\n", n, ms,
               n / ms * 1e3, ms / base, (n / ms) / (1.0 / base), bound, 100.0 * bound / ms, mst, mst / base_top,
               (long long)paths[KVZ_STEP_REPLAY], (long long)paths[KVZ_STEP_CAPTURE], (long long)paths[KVZ_STEP_EAGER],
               (long long)paths[KVZ_STEP_PASSES]);
        fflush(stdout);
    }
    printf("\n(ratios are against the first n of the list%s)\n", ns[0] == 1 ? ", n = 1" : "");
    if (churn > 0) {
        printf("\nchurn: every %d steps one member leaves and a spare with a %d/%d/%d/%d-token document joins "
               "(%d steps after 5 warm, argmax ids only)\n\n", churn, Td[4], Td[5], Td[6], Td[7], MULTI_CHURN_STEPS);
        printf("| streams n | churn: ms/step median | mean | worst | fixed membership, ids only (median) | churn mean ÷ "
               "fixed | mean HBM bound ms | steps replayed/captured/eager/passes | members changed |\n"
               "|---|---|---|---|---|---|---|---|---|\n");
        int32_t *mem = malloc(sizeof(int32_t) * npool), *spare = malloc(sizeof(int32_t) * npool);
        kvz_kv **sel = malloc(sizeof(kvz_kv *) * npool);
        int32_t *stok = malloc(sizeof(int32_t) * npool), *spos = malloc(sizeof(int32_t) * npool);
        double tc[MULTI_CHURN_STEPS];
        for (int k = 0; k < nns; k++) {
            const int32_t n = ns[k];
            if (n < 1 || n > nmax) continue;
            for (int32_t i = 0; i < npool; i++) kvz_kv_rollback(kvs[i]);
            for (int32_t i = 0; i < n; i++) mem[i] = i;
            int32_t nsp = 0;
            for (int32_t i = nmax; i < npool; i++) spare[nsp++] = i;
            for (int32_t i = 0; i < n; i++) { stok[i] = 32 + rnd(95); spos[i] = np + T; }
            int64_t paths[4] = {0}, events = 0;
            double bsum = 0, sum = 0, worst = 0;
            for (int it = 0; it < 5 + MULTI_CHURN_STEPS; it++) {
                if (it > 0 && it % churn == 0) { /* member r leaves, the first spare joins */
                    const int32_t r = (int32_t)(events % n), out = mem[r];
                    kvz_kv_rollback(kvs[out]);
                    mem[r] = spare[0];
                    memmove(spare, spare + 1, sizeof(int32_t) * (size_t)(nsp - 1));
                    spare[nsp - 1] = out;
                    stok[r] = 32 + rnd(95);
                    spos[r] = np + T;
                    events++;
                }
                double kvb = 0;
                for (int32_t i = 0; i < n; i++) {
                    sel[i] = kvs[mem[i]];
                    kvb += ((double)rows_of[mem[i]] + (double)nlh * MULTI_B) * hd * 2.0 * 2.0;
                }
                kvz_step_io io = {.want_logits = nowant, .top = top, .path = 0};
                double t0 = kvz_now();
                API(kvz_forward_multi_top(m, sel, stok, spos, n, NULL, &io));
                double dt = kvz_now() - t0;
                if (it >= 5) {
                    tc[it - 5] = dt;
                    sum += dt;
                    worst = dt > worst ? dt : worst;
                    paths[io.path & 3]++;
                    bsum += (2.0 * (s->params_linear + s->lm_head) + kvb) / bw * 1e3;
                }
                for (int32_t i = 0; i < n; i++) {
                    stok[i] = top[i];
                    spos[i]++;
                }
            }
            const double mean = sum / MULTI_CHURN_STEPS * 1e3;
            printf("| %d | %.3f | %.3f | %.3f | %.3f | %.2f | %.3f | %lld/%lld/%lld/%lld | %lld |\n", n,
                   median(tc, MULTI_CHURN_STEPS) * 1e3, mean, worst * 1e3, fixed_top[k], mean / fixed_top[k],
                   bsum / MULTI_CHURN_STEPS, (long long)paths[KVZ_STEP_REPLAY], (long long)paths[KVZ_STEP_CAPTURE],
                   (long long)paths[KVZ_STEP_EAGER], (long long)paths[KVZ_STEP_PASSES], (long long)events);
            fflush(stdout);
        }
        free(mem); free(spare); free(sel); free(stok); free(spos);
    }
    CU(cudaFreeHost(lg));
    for (int32_t i = 0; i < npool; i++) kvz_kv_free(kvs[i]);
    for (int i = 0; i < nd * NL; i++) { free(dk[i]); free(dv[i]); free(dp[i]); }
    free(kvs); free(rows_of); free(tok); free(pos); free(dk); free(dv); free(dp); free(cnt); free(ctx);
    free(top); free(nowant); free(fixed_top);
}

int main(int argc, char **argv)
{
    const char *name = "llama3-8b";
    int32_t lens[8] = {2048, 8192, 32768};
    int nlens = 3, quick = 0, decode_only = 0, store_only = 0, compose = 0, lens_given = 0;
    const char *dtypes = "f16,q8", *corpus = NULL;
    int32_t lf_max = 16384;
    int32_t multi[8], n_multi = 0, multi_ctx = 8192, multi_churn = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--synthetic") && i + 1 < argc) name = argv[++i];
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--decode-only")) decode_only = 1;
        else if (!strcmp(argv[i], "--store-only")) store_only = 1;
        else if (!strcmp(argv[i], "--compose")) compose = 1;
        else if (!strcmp(argv[i], "--dtypes") && i + 1 < argc) dtypes = argv[++i];
        else if (!strcmp(argv[i], "--corpus") && i + 1 < argc) corpus = argv[++i];
        else if (!strcmp(argv[i], "--lf-max") && i + 1 < argc) lf_max = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--multi-ctx") && i + 1 < argc) multi_ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--multi-churn") && i + 1 < argc) {
            multi_churn = atoi(argv[++i]);
            if (multi_churn < 1 || multi_churn > 1000) {
                fprintf(stderr, "kvz_bench_gpu: --multi-churn: steps between membership changes, 1..1000\n");
                return 2;
            }
        }
        else if (!strcmp(argv[i], "--multi") && i + 1 < argc) {
            n_multi = 0;
            for (char *p = argv[++i]; *p && n_multi < 8;) {
                multi[n_multi++] = (int32_t)strtol(p, &p, 10);
                if (*p == ',') p++;
                else if (*p) break;
            }
            for (int k = 0; k < n_multi; k++)
                if (multi[k] < 1 || multi[k] > 1024) { fprintf(stderr, "kvz_bench_gpu: --multi: counts 1..1024\n"); return 2; }
            if (!n_multi) { fprintf(stderr, "kvz_bench_gpu: --multi: a list of stream counts, e.g. 1,8,32\n"); return 2; }
        }
        else if (!strcmp(argv[i], "--lens") && i + 1 < argc) {
            nlens = 0;
            lens_given = 1;
            for (char *s = argv[++i]; *s && nlens < 8;) {
                lens[nlens++] = (int32_t)strtol(s, &s, 10);
                if (*s == ',') s++;
            }
        } else {
            fprintf(stderr, "usage: kvz_bench_gpu [--synthetic NAME] [--lens A,B,..] [--lf-max N] [--quick] [--decode-only]\n"
                            "                     [--store-only [--dtypes f16,q8]] [--corpus DIR]\n"
                            "                     [--compose [--lens 2048,4096,6144,8192]]\n"
                            "                     [--multi 1,8,32 [--multi-ctx 8192] [--multi-churn K]]\n");
            return 2;
        }
    }
    if (!kvz_cuda_available()) { printf("SKIP: no usable CUDA device\n"); return 77; }
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs; model: synthetic %s (bf16)\n", prop.name, prop.multiProcessorCount, name);
    const double peak = gemm_peak(), bw = copy_bw();
    printf("measured ceilings: bf16 GEMM 8192^3 %.1f TFLOP/s, D2D copy %.2f TB/s\n", peak / 1e12, bw / 1e12);

    kvz_model_opts o = {.device = KVZ_DEVICE_CUDA};
    kvz_model *m;
    double tl = kvz_now();
    API(kvz_model_synthetic(name, &o, &m));
    tl = sync_now() - tl;
    const kvz_config *c = kvz_model_config(m);
    const shape s = shape_of(c);
    printf("weights generated on the device in %.2f s (%.2f GB)\n", tl, kvz_model_weight_bytes(m) / 1e9);
    kvz_tokens pre = {0};
    API(kvz_chat_prefix(kvz_model_tokenizer(m), &pre));
    int32_t maxT = 0;
    for (int i = 0; i < nlens; i++) maxT = lens[i] > maxT ? lens[i] : maxT;
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)(maxT + 16));
    for (int32_t i = 0; i < maxT + 16; i++) toks[i] = 32 + rnd(95);
    run_prefill(m, toks, lens[0] < 2048 ? lens[0] : 2048); /* warm-up: cuBLAS heuristics, allocations */
    if (n_multi) {
        if (multi_ctx < 16) { fprintf(stderr, "kvz_bench_gpu: --multi-ctx: at least 16 tokens\n"); return 2; }
        int32_t *mt = malloc(sizeof(int32_t) * 2048);
        for (int32_t i = 0; i < 2048; i++) mt[i] = 32 + rnd(95);
        ingest_times w; /* warm-up ingest */
        run_ingest(m, pre.ids, (int32_t)pre.n, mt, 2048, &s, &w, 0);
        free(mt);
        run_multi(m, pre.ids, (int32_t)pre.n, multi, n_multi, multi_ctx, &s, bw, multi_churn);
        kvz_tokens_free(&pre);
        free(toks);
        kvz_model_free(m);
        return 0;
    }
    if (compose) { /* 4 documents of 2-8K tokens unless --lens says otherwise */
        static const int32_t dl[4] = {2048, 4096, 6144, 8192};
        if (!lens_given) {
            nlens = 4;
            memcpy(lens, dl, sizeof dl);
        }
        ingest_times w; /* warm-up ingest */
        run_ingest(m, pre.ids, (int32_t)pre.n, toks, 2048 < maxT ? 2048 : maxT, &s, &w, 0);
        run_compose(m, lens, nlens);
        kvz_tokens_free(&pre);
        free(toks);
        kvz_model_free(m);
        return 0;
    }
    if (corpus || store_only) {
        ingest_times w; /* warm-up ingest: loads the score / top-k / compaction / export kernels once */
        run_ingest(m, pre.ids, (int32_t)pre.n, toks, lens[0] < 2048 ? lens[0] : 2048, &s, &w, 0);
        if (corpus) run_corpus_kernels(m, corpus);
        if (store_only) run_store(m, &pre, toks, lens, nlens, dtypes, &s);
        kvz_tokens_free(&pre);
        free(toks);
        kvz_model_free(m);
        return 0;
    }

    if (!decode_only) { /* warm-up ingest: loads the score / top-k / compaction / export kernels once */
        ingest_times w;
        run_ingest(m, pre.ids, (int32_t)pre.n, toks, lens[0] < 2048 ? lens[0] : 2048, &s, &w, 0);
    }
    ingest_times its[8];
    if (!decode_only) {
        printf("\n| tokens | prefill s | prefill tok/s | TFLOP/s | %% of GEMM peak (bound %.0f) | plain prefill of the document (prefix + context, 8K passes) s | ingest s, no copy | ÷ prefill | ingest s, + f16 rows to host | ÷ prefill | FLOP ratio (bound x1.1) |\n", peak / 1e12);
        printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
        for (int i = 0; i < nlens; i++) {
            /* every time is the best of 2-3 runs (run-to-run spread is a few %) */
            const int32_t T = lens[i];
            double tp = run_prefill(m, toks, T), t;
            if ((t = run_prefill(m, toks, T)) < tp) tp = t;
            double fl = prefill_flops(&s, T);
            /* the ratio's denominator: the same tokens the ingest prefills (prefix + context) */
            double td = run_prefill_doc(m, pre.ids, (int32_t)pre.n, toks, T, 8192);
            for (int r = 0; r < 2; r++)
                if ((t = run_prefill_doc(m, pre.ids, (int32_t)pre.n, toks, T, 8192)) < td) td = t;
            ingest_times *it = &its[i], again;
            run_ingest(m, pre.ids, (int32_t)pre.n, toks, T, &s, it, 1); /* phases and diagnostics */
            run_ingest(m, pre.ids, (int32_t)pre.n, toks, T, &s, &again, 0);
            if (again.total_nocopy < it->total_nocopy) it->total_nocopy = again.total_nocopy;
            if (again.total < it->total) it->total = again.total;
            printf("| %d | %.3f | %.0f | %.1f | %.1f%% | %.3f | %.3f | %.2f | %.3f | %.2f | %.2f |\n", T, tp, T / tp,
                   fl / tp / 1e12, 100 * fl / tp / peak, td, it->total_nocopy, it->total_nocopy / td, it->total,
                   it->total / td, it->flop_ratio);
            fflush(stdout);
        }
        printf("\n| ingest phases, tokens | prefill s | repeat passes (chunks batched) | repeat s (with score) | score kernels s (repeat − plain forward of the same batches) | top-k + compaction s | kept rows → host f16 (GPU convert, pinned) s | old path: fp32 get_head + host f16 s |\n");
        printf("|---|---|---|---|---|---|---|---|\n");
        for (int i = 0; i < nlens; i++)
            printf("| %d | %.3f | %d | %.3f | %.3f | %.3f | %.3f | %.3f |\n", lens[i], its[i].prefill, its[i].n_pass,
                   its[i].repeat, its[i].score, its[i].select, its[i].export_f16, its[i].old_copy);
        fflush(stdout);
    }

    if (!decode_only) run_store(m, &pre, toks, lens, nlens, dtypes, &s);

    printf("\n| decode context | ms/token | tok/s | HBM bound tok/s (bytes/token ÷ %.2f TB/s) | %% of bound |\n", bw / 1e12);
    printf("|---|---|---|---|---|\n");
    const int32_t dctx[2] = {2048, 8192};
    for (int i = 0; i < 2; i++) {
        if (dctx[i] > maxT) continue;
        double dt = run_decode(m, toks, dctx[i], quick ? 16 : 64);
        double bytes = 2 * (s.params_linear + s.lm_head) + s.kv_row_bytes * dctx[i];
        double bound = bytes / bw;
        printf("| %d | %.3f | %.1f | %.1f | %.1f%% |\n", dctx[i], dt * 1e3, 1 / dt, 1 / bound, 100 * bound / dt);
        printf("(decode steps replayed from a CUDA graph so far: %llu)\n", (unsigned long long)kvz_cuda_graph_launches());
        fflush(stdout);
    }

    /* LongFlow: doc of 2K tokens, B = 2048 output slots, decode past lf_max outputs */
    {
        const int32_t B = 2048, D = 2048 < maxT ? 2048 : maxT;
        kvz_kv *kv;
        API(kvz_kv_create(m, D, B, &kv));
        API(kvz_forward(m, kv, toks, D, 0, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_TO_DOC, NULL));
        const int32_t marks[3] = {1024, 4096, 16384};
        double ms[3] = {0, 0, 0};
        const int W = 64;
        int32_t t = 65;
        int done = 0;
        for (int32_t i = 0; i < lf_max + W && done < 3; i++) {
            int at = -1;
            for (int k = 0; k < 3; k++) if (i == marks[k] - W / 2 && marks[k] <= lf_max) at = k;
            double t0 = at >= 0 ? sync_now() : 0;
            if (at >= 0) {
                for (int j = 0; j < W; j++)
                    API(kvz_forward(m, kv, &t, 1, D + i + j, NULL, KVZ_FWD_NO_LOGITS, NULL));
                ms[at] = (sync_now() - t0) / W * 1e3;
                i += W - 1;
                done++;
                continue;
            }
            API(kvz_forward(m, kv, &t, 1, D + i, NULL, KVZ_FWD_NO_LOGITS, NULL));
        }
        kvz_kv_stats st;
        kvz_kv_get_stats(kv, &st);
        printf("\n| LongFlow B=%d, doc %d | ms/step @1K | @4K | @16K | spread (bound ±5%%) |\n|---|---|---|---|---|\n", B, D);
        double lo = 1e30, hi = 0;
        for (int k = 0; k < 3; k++) if (ms[k] > 0) { lo = ms[k] < lo ? ms[k] : lo; hi = ms[k] > hi ? ms[k] : hi; }
        printf("| evictions %lld | %.3f | %.3f | %.3f | %+.1f%% |\n", (long long)st.evictions, ms[0], ms[1], ms[2],
               hi > 0 ? 100 * (hi - lo) / lo : 0);
        kvz_kv_free(kv);
    }
    size_t fr, tot;
    CU(cudaMemGetInfo(&fr, &tot));
    printf("\npeak device memory allocated by the backend: %.2f GiB (device in use now %.2f of %.2f GiB)\n",
           kvz_cuda_mem_peak() / 1073741824.0, (tot - fr) / 1073741824.0, tot / 1073741824.0);
    kvz_tokens_free(&pre);
    free(toks);
    kvz_model_free(m);
    return 0;
}
