/* CUDA backend: stored rows into the device cache (the pipelined loader of
 * kvz_cuda_loader.h), export of kept rows as stored types, and the multi-document
 * composition (kvz_rope_shift_cuda.h). */
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>

#include "kvz_cuda_impl.cuh"
#include "kvz_xxh3_lanes.h"

/* ====================================================================== */
/* pipelined loader (kvz_cuda_loader.h)                                     */

/* The staging's host side. By default one anonymous mapping for all slots (transparent
 * huge pages asked for), its pages first written by up to 8 threads at once, then
 * registered with the driver (cudaHostRegister): a cudaHostAlloc per slot faults and
 * pins page by page on one thread, 0.36 s for the ~850 MB a 32K-token llama3-8b
 * document's load stages on the H200 (90 % of a process's first load). KVZ_STAGING=
 * hostalloc keeps the cudaHostAlloc per slot (A/B). */
static int staging_mapped(void)
{
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("KVZ_STAGING");
        on = !(e && !strcmp(e, "hostalloc"));
    }
    return on;
}

typedef struct {
    char *p;
    size_t n;
} touch_arg;

static void *touch_pages(void *a)
{
    const touch_arg *t = (const touch_arg *)a;
    memset(t->p, 0, t->n);
    return NULL;
}

static int staging_map(size_t total, void **base)
{
    *base = NULL;
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return kvz_error_set(KVZ_ERR_NOMEM, "load staging: mmap of %zu bytes", total);
    (void)madvise(p, total, MADV_HUGEPAGE); /* a hint: 4 KiB pages work too */
    const size_t piece = (size_t)64 << 20;
    int nt = (int)((total + piece - 1) / piece);
    nt = nt < 1 ? 1 : nt > 8 ? 8 : nt;
    pthread_t th[8];
    touch_arg ta[8];
    const size_t per = ((total / (size_t)nt) + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
    int started[8] = {0};
    for (int i = 0; i < nt; i++) {
        const size_t lo = (size_t)i * per < total ? (size_t)i * per : total;
        const size_t hi = lo + per < total ? lo + per : total;
        ta[i] = touch_arg{(char *)p + lo, hi - lo};
    }
    for (int i = 1; i < nt; i++) started[i] = pthread_create(&th[i], NULL, touch_pages, &ta[i]) == 0;
    for (int i = 0; i < nt; i++) /* piece 0, and any piece whose thread did not start, here */
        if (!started[i]) touch_pages(&ta[i]);
    for (int i = 1; i < nt; i++)
        if (started[i]) pthread_join(th[i], NULL);
    cudaError_t e = cudaHostRegister(p, total, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
        cudaGetLastError();
        munmap(p, total);
        return kvz_error_set(e == cudaErrorMemoryAllocation ? KVZ_ERR_NOMEM : KVZ_ERR_CUDA,
                             "pinned load staging (%.1f MiB registered): %s", total / 1048576.0, cudaGetErrorString(e));
    }
    *base = p;
    return 0;
}

void kvz_cuda_load_free(kvz_cuda_model *g)
{
    for (int i = 0; i < g->ld_n; i++) {
        if (!g->ld_base && g->ld_h[i]) cudaFreeHost(g->ld_h[i]);
        dfree(g->ld_d[i]);
        if (g->ld_ev[i]) cudaEventDestroy(g->ld_ev[i]);
        g->ld_h[i] = g->ld_d[i] = NULL;
        g->ld_ev[i] = NULL;
    }
    if (g->ld_base) {
        cudaHostUnregister(g->ld_base);
        munmap(g->ld_base, g->ld_total);
    }
    g->ld_base = NULL;
    g->ld_total = 0;
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
        kvz_cuda_load_free(g);
        if (staging_mapped()) {
            int rc = staging_map(bytes * (size_t)n, &g->ld_base);
            if (rc) return rc;
            g->ld_total = bytes * (size_t)n;
        }
        for (int i = 0; i < n; i++) {
            cudaError_t e = cudaSuccess;
            if (g->ld_base) g->ld_h[i] = (char *)g->ld_base + (size_t)i * bytes;
            else e = cudaHostAlloc(&g->ld_h[i], bytes, cudaHostAllocDefault);
            g->ld_ev[i] = NULL;
            g->ld_d[i] = NULL;
            if (e == cudaSuccess) e = cudaEventCreateWithFlags(&g->ld_ev[i], cudaEventDisableTiming);
            if (e != cudaSuccess) {
                cudaGetLastError();
                g->ld_n = i + 1;
                kvz_cuda_load_free(g);
                return kvz_error_set(e == cudaErrorMemoryAllocation ? KVZ_ERR_NOMEM : KVZ_ERR_CUDA,
                                     "pinned load staging (%d x %.1f MiB): %s", n, bytes / 1048576.0,
                                     cudaGetErrorString(e));
            }
            int rc = dmalloc(&g->ld_d[i], bytes, "load staging");
            g->ld_n = i + 1;
            if (rc) {
                kvz_cuda_load_free(g);
                return rc;
            }
        }
        g->ld_bytes = bytes;
    }
    for (int i = 0; i < nslot; i++) slots[i] = g->ld_h[i];
    return 0;
}

/* Both layer uploads: @p bytes from @p src (NULL: slot @p slot's pinned buffer) copied,
 * piece by piece at @p cuts, to the slot's device buffer + @p shift, then one kernel
 * converts the rows into cache rows row0.. of each head and an event marks the slot.
 * @p rec >= 0: the device verifies record @p rec of the load (kvz_cuda_load_verify_begin):
 * the load kernel checks q8/q4 rows into its bad-row result, and the block sums of the
 * hash of bytes [hash_off, bytes) with @p seed are computed before the slot is given back. */
static int load_into(kvz_kv *kv, int32_t layer, int slot, const void *src, size_t bytes, size_t shift, int dtype,
                     const uint32_t *counts, int32_t row0, size_t k_off, size_t v_off, size_t pos_off,
                     const size_t *cuts, int n_cuts, int rec = -1, size_t hash_off = 0, uint64_t seed = 0)
{
    kvz_cuda_cache *cc = kv->cuda;
    kvz_cuda_model *g = kv->m->cuda;
    if (!cc || !g || slot < 0 || slot >= g->ld_n || bytes + shift > g->ld_bytes || layer < 0 ||
        layer >= kv->n_layer || kv->n_kv_head > 64 || row0 < 0)
        return kvz_error_set(KVZ_ERR_ARG, "load_layer: bad arguments");
    int32_t rows[64];
    for (int32_t h = 0; h < kv->n_kv_head; h++) {
        if ((int64_t)counts[h] + row0 > kv->cap)
            return kvz_error_set(KVZ_ERR_CONTEXT, "layer %d head %d: %lld rows exceed the cache capacity %lld",
                                 layer, h, (long long)counts[h] + row0, (long long)kv->cap);
        rows[h] = (int32_t)counts[h];
    }
    if (rec >= 0 && (rec >= g->lv_n || hash_off >= bytes || bytes - hash_off < KVZ_XXH3L_MIN_LEN ||
                     g->lv_off[rec] + kvz_cuda_xxh3_sums_len(bytes - hash_off) > g->lv_sums_n))
        return kvz_error_set(KVZ_ERR_ARG, "load_layer: record %d cannot be verified on the device", rec);
    const cudaStream_t s = g->s;
    const char *from = src ? (const char *)src : (const char *)g->ld_h[slot];
    char *d = (char *)g->ld_d[slot] + shift;
    for (int i = 0; i <= n_cuts; i++) { /* one copy per registration the source lies in */
        const size_t lo = i ? cuts[i - 1] : 0, hi = i < n_cuts ? cuts[i] : bytes;
        if (hi < lo || hi > bytes) return kvz_error_set(KVZ_ERR_ARG, "load_layer: bad cuts");
        if (hi > lo) KVZ_CUDA_TRY(cudaMemcpyAsync(d + lo, from + lo, hi - lo, cudaMemcpyHostToDevice, s));
    }
    TRY(kvz_cuda_kv_load_checked(s, &cc->L[layer], dtype, rows, row0, d + k_off, d + v_off,
                                 (const uint32_t *)(d + pos_off),
                                 rec >= 0 ? (unsigned long long *)(g->lv_res_d + g->lv_cap + rec) : NULL));
    if (rec >= 0) { /* the sums read the slot before it is given back; the chain (a few ms for
                     * a 40 MB record: sequential per lane) runs on the side stream meanwhile */
        const uint64_t n = bytes - hash_off;
        TRY(kvz_cuda_xxh3_sums(s, d + hash_off, n, seed, g->lv_sums + g->lv_off[rec]));
        const cudaStream_t cs = g->lv_s[rec % KVZ_CUDA_LV_STREAMS];
        KVZ_CUDA_TRY(cudaEventRecord(g->lv_go, s));
        KVZ_CUDA_TRY(cudaStreamWaitEvent(cs, g->lv_go, 0));
        TRY(kvz_cuda_xxh3_chain1(cs, kvz_cuda_xxh3_job{n, seed, g->lv_off[rec]}, g->lv_sums, g->lv_res_d + rec));
    }
    KVZ_CUDA_TRY(cudaEventRecord(g->ld_ev[slot], s));
    for (int32_t h = 0; h < kv->n_kv_head; h++) kv->len[(size_t)layer * kv->n_kv_head + h] = row0 + rows[h];
    return 0;
}

extern "C" int kvz_cuda_load_layer(kvz_kv *kv, int32_t layer, int slot, int dtype, const uint32_t *counts,
                                   int32_t row0, size_t k_off, size_t v_off, size_t pos_off, size_t bytes)
{
    return load_into(kv, layer, slot, NULL, bytes, 0, dtype, counts, row0, k_off, v_off, pos_off, NULL, 0);
}

extern "C" int kvz_cuda_load_layer_src(kvz_kv *kv, int32_t layer, int slot, const void *src, size_t bytes, int dtype,
                                       const uint32_t *counts, int32_t row0, size_t k_off, size_t v_off,
                                       size_t pos_off, const size_t *cuts, int n_cuts)
{
    if (!src) return kvz_error_set(KVZ_ERR_ARG, "load_layer_src: no source");
    /* shifted so that K lands 16-byte aligned: the kernel reads f16/bf16/f32 rows 16 bytes at a time */
    return load_into(kv, layer, slot, src, bytes, (16 - k_off % 16) % 16, dtype, counts, row0, k_off, v_off, pos_off,
                     cuts, n_cuts);
}

extern "C" int kvz_cuda_load_layer_verified(kvz_kv *kv, int32_t layer, int slot, const void *src, size_t bytes,
                                            int dtype, const uint32_t *counts, int32_t row0, size_t k_off,
                                            size_t v_off, size_t pos_off, const size_t *cuts, int n_cuts, int rec,
                                            size_t hash_off, uint64_t seed)
{
    if (!src || rec < 0) return kvz_error_set(KVZ_ERR_ARG, "load_layer_verified: no source or record");
    return load_into(kv, layer, slot, src, bytes, (16 - k_off % 16) % 16, dtype, counts, row0, k_off, v_off, pos_off,
                     cuts, n_cuts, rec, hash_off, seed);
}

void kvz_cuda_load_verify_free(kvz_cuda_model *g)
{
    for (int k = 0; k < KVZ_CUDA_LV_STREAMS; k++) {
        if (g->lv_s[k]) { /* chains of a load that failed may still read the sums */
            cudaStreamSynchronize(g->lv_s[k]);
            cudaStreamDestroy(g->lv_s[k]);
        }
        g->lv_s[k] = NULL;
    }
    if (g->lv_go) cudaEventDestroy(g->lv_go);
    if (g->lv_done) cudaEventDestroy(g->lv_done);
    g->lv_go = g->lv_done = NULL;
    dfree(g->lv_sums);
    dfree(g->lv_res_d);
    if (g->lv_res_h) cudaFreeHost(g->lv_res_h);
    free(g->lv_off);
    g->lv_sums = g->lv_off = g->lv_res_h = g->lv_res_d = NULL;
    g->lv_sums_n = 0;
    g->lv_cap = g->lv_n = 0;
}

/* the model's stream waits for every chain queued on the side streams */
static int chains_done(kvz_cuda_model *g)
{
    for (int k = 0; k < KVZ_CUDA_LV_STREAMS; k++) {
        KVZ_CUDA_TRY(cudaEventRecord(g->lv_done, g->lv_s[k]));
        KVZ_CUDA_TRY(cudaStreamWaitEvent(g->s, g->lv_done, 0));
    }
    return 0;
}

extern "C" int kvz_cuda_load_verify_begin(kvz_model *m, int n_rec, const uint64_t *hashed)
{
    kvz_cuda_model *g = m->cuda;
    if (!g || n_rec < 0 || (n_rec && !hashed)) return kvz_error_set(KVZ_ERR_ARG, "load_verify_begin: bad arguments");
    size_t sums = 0;
    for (int r = 0; r < n_rec; r++)
        if (hashed[r] >= KVZ_XXH3L_MIN_LEN) sums += kvz_cuda_xxh3_sums_len(hashed[r]);
    if (n_rec > g->lv_cap || sums > g->lv_sums_n) {
        KVZ_CUDA_TRY(cudaStreamSynchronize(g->s)); /* nothing in flight uses the old buffers */
        const int cap = n_rec > g->lv_cap ? n_rec : g->lv_cap;
        const size_t sn = sums > g->lv_sums_n ? sums + sums / 4 : g->lv_sums_n;
        kvz_cuda_load_verify_free(g);
        int rc = dmalloc((void **)&g->lv_sums, sn * 8 + 8, "load verification sums");
        if (!rc) rc = dmalloc((void **)&g->lv_res_d, 16 * (size_t)cap, "load verification results");
        cudaError_t e = cudaSuccess;
        if (!rc) e = cudaHostAlloc((void **)&g->lv_res_h, 16 * (size_t)cap, cudaHostAllocDefault);
        if (!rc && e == cudaSuccess && !(g->lv_off = (uint64_t *)malloc(8 * (size_t)cap))) rc = KVZ_ERR_NOMEM;
        if (!rc && e != cudaSuccess) {
            cudaGetLastError();
            rc = kvz_error_set(KVZ_ERR_CUDA, "load verification (pinned): %s", cudaGetErrorString(e));
        }
        if (rc) {
            kvz_cuda_load_verify_free(g);
            return rc == KVZ_ERR_NOMEM ? kvz_error_set(rc, "load verification buffers") : rc;
        }
        g->lv_cap = cap;
        g->lv_sums_n = sn;
    }
    if (!g->lv_go) {
        cudaError_t e = cudaSuccess;
        for (int k = 0; k < KVZ_CUDA_LV_STREAMS && e == cudaSuccess; k++)
            e = cudaStreamCreateWithFlags(&g->lv_s[k], cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&g->lv_go, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&g->lv_done, cudaEventDisableTiming);
        if (e != cudaSuccess) {
            cudaGetLastError();
            kvz_cuda_load_verify_free(g);
            return kvz_error_set(KVZ_ERR_CUDA, "load verification stream: %s", cudaGetErrorString(e));
        }
    } else { /* a failed load's chains (no verify_end) finish before the results are reset */
        TRY(chains_done(g));
    }
    size_t at = 0;
    for (int r = 0; r < n_rec; r++) {
        g->lv_off[r] = at;
        if (hashed[r] >= KVZ_XXH3L_MIN_LEN) at += kvz_cuda_xxh3_sums_len(hashed[r]);
    }
    g->lv_n = n_rec;
    if (n_rec) { /* digests 0, first bad rows all ones (none) */
        KVZ_CUDA_TRY(cudaMemsetAsync(g->lv_res_d, 0, 8 * (size_t)n_rec, g->s));
        KVZ_CUDA_TRY(cudaMemsetAsync(g->lv_res_d + g->lv_cap, 0xff, 8 * (size_t)n_rec, g->s));
    }
    return 0;
}

extern "C" int kvz_cuda_load_verify_end(kvz_model *m, uint64_t *digest, uint64_t *bad_row)
{
    kvz_cuda_model *g = m->cuda;
    if (!g) return kvz_error_set(KVZ_ERR_ARG, "load_verify_end: no device model");
    const int n = g->lv_n;
    const cudaStream_t s = g->s;
    if (n) { /* the chains (side streams) are done before the results come back */
        TRY(chains_done(g));
        KVZ_CUDA_TRY(cudaMemcpyAsync(g->lv_res_h, g->lv_res_d, 8 * (size_t)n, cudaMemcpyDeviceToHost, s));
        KVZ_CUDA_TRY(cudaMemcpyAsync(g->lv_res_h + g->lv_cap, g->lv_res_d + g->lv_cap, 8 * (size_t)n,
                                     cudaMemcpyDeviceToHost, s));
    }
    KVZ_CUDA_TRY(cudaStreamSynchronize(s));
    for (int r = 0; r < n; r++) {
        if (digest) digest[r] = g->lv_res_h[r];
        if (bad_row) bad_row[r] = g->lv_res_h[g->lv_cap + r];
    }
    g->lv_n = 0;
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
    kvz_cuda_load_free(m->cuda);
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
