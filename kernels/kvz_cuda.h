/**
 * @file kvz_cuda.h
 * @brief C-callable CUDA kernels for the kvzip GPU model backend.
 *
 * Every function enqueues work on the caller's stream and returns 0 or a negative
 * KVZ_ERR_* code (common/kvz_error.h):
 *   - KVZ_ERR_ARG   a host-side argument is invalid (checked before any launch);
 *   - KVZ_ERR_CUDA  a CUDA / cuBLAS call or a launch failed; kvz_error_detail()
 *                   holds cudaGetErrorString() (or the cuBLAS status) and the call.
 * Launch errors are caught with cudaGetLastError(); faults that happen while a
 * kernel runs surface at the caller's next synchronisation, as with any CUDA code.
 *
 * Conventions
 *   - All pointers to tensors are DEVICE pointers unless a parameter says "host".
 *   - bf16 is `__nv_bfloat16` (2 bytes); the API passes it as void*.
 *   - "ld" parameters are row strides in ELEMENTS (not bytes), so a tensor can be
 *     a column slice of a wider fused output (e.g. q/k/v of one QKV GEMM).
 *   - Activations: the residual stream is fp32 (T, d); everything that feeds a GEMM
 *     or the KV cache is bf16. Norm weights are fp32 (tiny, keeps CPU parity).
 *   - Functions hold no global state except kvz_cuda_blas handles; they are
 *     thread-safe as long as two threads do not share a stream/handle concurrently.
 *
 * KV cache layout (one layer)                                   kvz_cuda_kv
 *   K, V : (n_kv, cap, hd) bf16  — head h's rows start at h*cap; head h holds
 *          len[h] rows (per-head variable-length segments, never re-padded).
 *   pos  : (n_kv, cap) int32     — original token position of each row.
 *   len  : (n_kv) int32 DEVICE   — rows in use per head.
 *   Requirement: within one head, pos is non-decreasing along rows [0, len[h])
 *   (true for appends in position order and for kvz_cuda_kv_compact, which keeps
 *   order). Attention uses it to stop early on causal prefill.
 *
 * LongFlow output buffer (one layer)                           kvz_cuda_outbuf
 *   K, V     : (n_kv, n_slot, hd) bf16 — same head-major layout as the cache, so
 *              slot j of head h is row h*n_slot + j.
 *   slot_pos : (n_slot) int32, -1 = empty; one slot index is shared by all heads.
 *   Slots are not required to be position-sorted.
 *
 * Visibility everywhere: key visible to a query iff key_pos <= query_pos (and the
 * row / slot is in use). Softmax scale is 1/sqrt(hd).
 */
#ifndef KVZ_CUDA_H
#define KVZ_CUDA_H

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Element type selector for the few tensors that may be either. */
typedef enum kvz_cuda_dtype {
    KVZ_CUDA_F32 = 0,  /**< float */
    KVZ_CUDA_BF16 = 1, /**< __nv_bfloat16 */
    KVZ_CUDA_F16 = 2,  /**< IEEE half (only kvz_cuda_kv_export writes it) */
} kvz_cuda_dtype;

/** RoPE pairing. */
typedef enum kvz_cuda_rope_layout {
    KVZ_ROPE_ADJACENT = 0, /**< rotate (x[2j], x[2j+1]) — llama GGUF (permuted Q/K rows) */
    KVZ_ROPE_HALF = 1,     /**< rotate (x[j], x[j+hd/2]) — qwen2 / qwen3 (NeoX style) */
} kvz_cuda_rope_layout;

/** One layer's KV cache (see file comment). Plain struct passed by pointer; the
 *  kernels copy it by value at launch, so it may live on the caller's stack. */
typedef struct kvz_cuda_kv {
    void *k;        /**< (n_kv, cap, hd) bf16 */
    void *v;        /**< (n_kv, cap, hd) bf16 */
    int32_t *pos;   /**< (n_kv, cap) int32 original positions */
    int32_t *len;   /**< (n_kv) int32 device: rows in use per head */
    int32_t n_kv;   /**< KV heads */
    int32_t cap;    /**< rows allocated per head */
    int32_t hd;     /**< head dim: 64 or 128 */
} kvz_cuda_kv;

/** One layer's LongFlow output buffer (see file comment). */
typedef struct kvz_cuda_outbuf {
    void *k;            /**< (n_kv, n_slot, hd) bf16 */
    void *v;            /**< (n_kv, n_slot, hd) bf16 */
    int32_t *slot_pos;  /**< (n_slot) int32, -1 = empty */
    int32_t n_slot;     /**< B */
    int32_t n_sink;     /**< slots [0, n_sink) are never evicted */
} kvz_cuda_outbuf;

/** One sequence of a batched decode step (continuous batching: one token for each of
 *  n different caches). An array of these, one per sequence, lives in DEVICE memory
 *  (the runtime uploads one per layer per step: layer-major); the batched kernels read
 *  sequence z's entry with z from the grid, so a step costs one launch per op whatever n. */
typedef struct kvz_cuda_seq {
    kvz_cuda_kv kv;      /**< the sequence's document rows (this layer), ragged per head */
    kvz_cuda_outbuf ob;  /**< its LongFlow output buffer (this layer); ob.k == NULL: none */
    int32_t slot;        /**< output-buffer slot the new token takes: >= 0 (filling), or -1:
                          *   the victim *evict chosen by this sequence's previous step */
    int32_t pad_;
    int32_t *evict;      /**< device int32 (this layer): read by the write, then rewritten
                          *   by the attention with this step's LongFlow choice; NULL: none */
} kvz_cuda_seq;

/* ========================================================================== */
/* Device                                                                     */

/** Number of CUDA devices in @p n (0 when the driver/runtime reports none or fails).
 *  Returns 0, or KVZ_ERR_NODEV when there is no usable device (detail says why). */
int kvz_cuda_device_count(int *n);

/* ========================================================================== */
/* GEMM (cuBLAS)                                                              */

typedef struct kvz_cuda_blas kvz_cuda_blas;

/** Create a cuBLAS handle wrapper. KVZ_ERR_NOMEM, KVZ_ERR_CUDA. Not thread-safe
 *  to share between threads calling concurrently. */
int kvz_cuda_blas_create(kvz_cuda_blas **out);
/** Destroy (NULL ok). */
void kvz_cuda_blas_destroy(kvz_cuda_blas *b);

/**
 * Linear layer: y = x · Wᵀ + bias + beta·y, fp32 accumulate.
 * @param x     (T, n_in) bf16, row stride ldx (>= n_in)
 * @param w     (n_out, n_in) bf16 row-major (HF Linear / GGUF [in,out] bytes)
 * @param bias  (n_out) fp32 or NULL (added by a separate small kernel)
 * @param y     (T, n_out) of y_type (fp32 for the LM head or to accumulate into
 *              the fp32 residual with beta = 1), row stride ldy (>= n_out)
 * @param beta  0 to overwrite y, 1 to accumulate (residual add fused in the GEMM)
 * Errors: KVZ_ERR_ARG (sizes, strides, odd alignment), KVZ_ERR_CUDA (cuBLAS status).
 */
int kvz_cuda_linear(kvz_cuda_blas *b, cudaStream_t s, int T, int n_in, int n_out,
                    const void *x, int ldx, const void *w, const float *bias,
                    void *y, kvz_cuda_dtype y_type, int ldy, float beta);

/**
 * Batch-1 linear layer on the RMSNorm of the fp32 residual (T = 1, the decode step):
 *   y = bf16(x / sqrt(mean(x²) + eps) · norm_w) · Wᵀ + bias + beta·y
 * with the same expression and bf16 rounding of the normalised x as kvz_cuda_rmsnorm
 * followed by kvz_cuda_linear (Σx² summed in another order: fp32-level differences),
 * in one launch: every block normalises x into shared memory itself. With a bias,
 * a bf16 y is rounded before the bias is added, as kvz_cuda_linear's bias kernel does.
 * @param x      (n_in) fp32 residual, read only
 * @param norm_w (n_in) fp32
 * @param w      (n_out, n_in) bf16 row-major;  @param bias (n_out) fp32 or NULL
 * @param y      (n_out) of y_type;  @param beta 0 (overwrite) or 1 (accumulate)
 * @param xn     (n_in) bf16 scratch, written only by the fallback (rmsnorm + linear)
 *               taken when the GEMV path is off (KVZ_CUDA_GEMV=0), n_in % 8 != 0,
 *               n_in > 16384 or a pointer is not 16-byte aligned; contents afterwards
 *               unspecified.
 * Launched with programmatic dependent launch on sm_90 (capturable in a CUDA graph).
 * Errors: KVZ_ERR_ARG, KVZ_ERR_CUDA.
 */
int kvz_cuda_linear_rmsnorm(kvz_cuda_blas *b, cudaStream_t s, int n_in, int n_out,
                            const float *x, const float *norm_w, float eps, const void *w,
                            const float *bias, void *y, kvz_cuda_dtype y_type, float beta,
                            void *xn);

/**
 * Batch-1 MLP input half (T = 1): out = SwiGLU(RMSNorm(x) · W_guᵀ), i.e.
 *   g = bf16(xn·W_gu[p]), u = bf16(xn·W_gu[n_ff + p]), out[p] = bf16(silu(g)·u)
 * — the values of kvz_cuda_rmsnorm, kvz_cuda_linear (bf16 out) and kvz_cuda_swiglu
 * in sequence, in one launch (a warp computes gate row p and up row p together).
 * @param x      (n_in) fp32 residual, read only;  @param norm_w (n_in) fp32
 * @param w_gu   (2·n_ff, n_in) bf16: gate rows, then up rows
 * @param out    (n_ff) bf16
 * @param xn     (n_in) bf16 scratch and @param gu (2·n_ff) bf16 scratch, used only by
 *               the fallback (same conditions as kvz_cuda_linear_rmsnorm).
 * Errors: KVZ_ERR_ARG, KVZ_ERR_CUDA.
 */
int kvz_cuda_linear_rmsnorm_swiglu(kvz_cuda_blas *b, cudaStream_t s, int n_in, int n_ff,
                                   const float *x, const float *norm_w, float eps,
                                   const void *w_gu, void *out, void *xn, void *gu);

/* ========================================================================== */
/* Elementwise / row ops                                                      */

/** Embedding gather: x[t] = table[ids[t]].
 *  @param table (n_vocab, d) bf16; @param ids (T) int32 device;
 *  @param x (T, d) of x_type. Ids outside [0, n_vocab) give a zero row. */
int kvz_cuda_embed(cudaStream_t s, const void *table, int n_vocab, int d,
                   const int32_t *ids, int T, void *x, kvz_cuda_dtype x_type);

/**
 * RMSNorm with optional fused residual add, fp32 accumulation:
 *   if add: x += add (written back to x);  out = x / sqrt(mean(x²) + eps) · w
 * @param x   (T, d) fp32 residual stream, in/out (row stride d)
 * @param add (T, d) of add_type or NULL
 * @param w   (d) fp32
 * @param out (T, d) of out_type, or NULL to only do the add
 */
int kvz_cuda_rmsnorm(cudaStream_t s, int T, int d, float eps, float *x,
                     const void *add, kvz_cuda_dtype add_type, const float *w,
                     void *out, kvz_cuda_dtype out_type);

/**
 * RoPE in place on q and k, optionally preceded by the qwen3 per-head RMSNorm.
 * @param q  (T, n_head, hd) bf16, row stride ldq (elements between tokens); NULL skips q
 * @param k  (T, n_kv, hd) bf16, row stride ldk; NULL skips k
 * @param pos (T) int32 device positions; angle = pos · theta^(-2j/hd), computed in fp64
 * @param q_norm_w, k_norm_w (hd) fp32 or NULL: if given, x ← x/sqrt(mean(x²)+eps)·w
 *        per head before rotating (qwen3).
 * hd must be even and <= 256.
 */
int kvz_cuda_rope(cudaStream_t s, int T, int n_head, int n_kv, int hd, void *q, int ldq,
                  void *k, int ldk, const int32_t *pos, float theta,
                  kvz_cuda_rope_layout layout, const float *q_norm_w,
                  const float *k_norm_w, float eps);

/**
 * One decode token (T = 1): RoPE (and the optional qwen3 q/k norm) in place on q and
 * k exactly as kvz_cuda_rope, then k and v appended to every head of the cache as
 * kvz_cuda_kv_append(T = 1) does (row len[h], pos, len[h] += 1; nothing written and
 * len unchanged when len[h] == cap), in one launch (PDL on sm_90).
 * @param qkv (n_head·hd + 2·n_kv·hd) bf16: the fused q | k | v row of one token
 * @param pos (1) int32 device
 * @param kv  the layer's cache; kv->n_kv == n_kv and kv->hd == hd
 */
int kvz_cuda_rope_kv_append(cudaStream_t s, int n_head, int n_kv, int hd, void *qkv,
                            const int32_t *pos, float theta, kvz_cuda_rope_layout layout,
                            const float *q_norm_w, const float *k_norm_w, float eps,
                            const kvz_cuda_kv *kv);

/**
 * One decode token (T = 1): RoPE in place on q and k as kvz_cuda_rope_kv_append, then
 * k and v written to one LongFlow output-buffer slot and slot_pos set, in one launch.
 * Slot: @p slot when >= 0 (host value), else *d_fill when d_fill is given and
 * *d_fill >= 0, else *d_evict when d_evict is given; nothing is written when the
 * result is < 0 or >= n_slot. Covers kvz_cuda_outbuf_write (T = 1) and
 * kvz_cuda_outbuf_write_dev. d_fill, d_evict: device int32 or NULL.
 */
int kvz_cuda_rope_outbuf_write(cudaStream_t s, int n_head, int n_kv, int hd, void *qkv,
                               const int32_t *pos, float theta, kvz_cuda_rope_layout layout,
                               const float *q_norm_w, const float *k_norm_w, float eps,
                               const kvz_cuda_outbuf *ob, int slot, const int32_t *d_fill,
                               const int32_t *d_evict);

/** SwiGLU: out = silu(gate) · up, fp32 math.
 *  gate, up, out: (T, n_ff) bf16 with row strides ldg, ldu, ldo (may alias a fused
 *  gate|up GEMM output: up = gate + n_ff, ldg = ldu = 2·n_ff). */
int kvz_cuda_swiglu(cudaStream_t s, int T, int n_ff, const void *gate, int ldg,
                    const void *up, int ldu, void *out, int ldo);

/** bf16 → fp32, n elements. */
int kvz_cuda_bf16_to_f32(cudaStream_t s, const void *src, float *dst, size_t n);
/** fp32 → bf16 (round to nearest even), n elements. */
int kvz_cuda_f32_to_bf16(cudaStream_t s, const float *src, void *dst, size_t n);

/** Greedy sampling: out[r] = argmax_j logits[r·ld + j], j < n_vocab; ties → lowest j;
 *  NaN never wins (a NaN at j = 0, or all NaN: 0), exactly the host scan of kvz_argmax.
 *  One block per row (graph-capturable). @param logits (n_rows, ld) fp32; @param out
 *  (n_rows) int32 device. */
int kvz_cuda_argmax(cudaStream_t s, const float *logits, int n_rows, int n_vocab,
                    int ld, int32_t *out);

/* ========================================================================== */
/* KV cache writes                                                            */

/**
 * Append T tokens to every head: rows len[h] .. len[h]+T-1 get k/v/pos, then
 * len[h] += T. The caller keeps host lengths and guarantees len[h] + T <= cap
 * (rows past cap are dropped and len is clamped to cap — no device-side error).
 * @param k_new, v_new (T, n_kv, hd) bf16 with row strides ldk, ldv (post-RoPE k)
 * @param pos (T) int32 device
 */
int kvz_cuda_kv_append(cudaStream_t s, const kvz_cuda_kv *kv, int T, const void *k_new,
                       int ldk, const void *v_new, int ldv, const int32_t *pos);

/**
 * Write T tokens into the LongFlow output buffer. Token t goes to slot
 * (slot + t) when @p slot >= 0 (host value, the filling phase), else to slot
 * *d_slot (device int, T must be 1; the eviction choice of the previous decode
 * step; nothing is written if *d_slot < 0). Sets slot_pos for the slot.
 * @param k_new, v_new (T, n_kv, hd) bf16 with row strides; @param pos (T) int32 device
 */
int kvz_cuda_outbuf_write(cudaStream_t s, const kvz_cuda_outbuf *ob, int n_kv, int hd,
                          int T, const void *k_new, int ldk, const void *v_new, int ldv,
                          const int32_t *pos, int slot, const int32_t *d_slot);

/**
 * Like kvz_cuda_outbuf_write for one token (T = 1), with the slot read on the
 * device: slot = *d_fill when *d_fill >= 0 (the filling phase), else *d_evict (the
 * victim chosen by the previous step; nothing is written if it is < 0). Both are
 * device ints, so one captured CUDA graph serves every decode step.
 */
int kvz_cuda_outbuf_write_dev(cudaStream_t s, const kvz_cuda_outbuf *ob, int n_kv, int hd,
                              const void *k_new, int ldk, const void *v_new, int ldv,
                              const int32_t *pos, const int32_t *d_fill, const int32_t *d_evict);

/**
 * Batched output-buffer write (continuous batching): token z (one per sequence) goes to
 * sequence z's buffer slot seq[z].slot when >= 0, else *seq[z].evict (nothing written
 * when that is < 0 or >= n_slot, or when seq[z].ob.k is NULL); slot_pos set to pos[z].
 * The same bytes as kvz_cuda_outbuf_write / _write_dev per sequence, in one launch.
 * @param k_new, v_new (n_seq, n_kv, hd) bf16, row stride ldk, ldv (post-RoPE k)
 * @param pos (n_seq) int32 device;  @param seq (n_seq) device descriptors
 */
int kvz_cuda_outbuf_write_multi(cudaStream_t s, int n_seq, int n_kv, int hd, const void *k_new, int ldk,
                                const void *v_new, int ldv, const int32_t *pos, const kvz_cuda_seq *seq);

/**
 * Export of one layer's cache rows for storage: for every head h in order, rows
 * [0, rows[h]) (host counts, <= cap), back to back, converted from bf16 to @p dt
 * (KVZ_CUDA_F32, KVZ_CUDA_BF16 = copy, KVZ_CUDA_F16 = round to nearest even, the
 * same bits as runtime/kvz_quant.c kvz_fp32_to_fp16).
 * @param k_out, v_out (Σ rows, hd) of dt, device;  @param pos_out (Σ rows) int32 device
 * n_kv <= 64. Errors: KVZ_ERR_ARG, KVZ_ERR_CUDA.
 */
int kvz_cuda_kv_export(cudaStream_t s, const kvz_cuda_kv *kv, const int32_t *rows,
                       kvz_cuda_dtype dt, void *k_out, void *v_out, int32_t *pos_out);

/* ========================================================================== */
/* Attention                                                                  */

/**
 * Prefill attention: tiled causal GQA flash attention (bf16 tensor cores: wgmma on
 * sm_90a Hopper builds, mma.sync elsewhere or with KVZ_CUDA_FA=mma;
 * fp32 online softmax, nothing N×N in memory). Queries t in [0,T), heads n_head
 * (n_head % n_kv == 0), over head kv(h)'s cache rows [0, len[h]) — which already
 * hold the new keys — plus the output-buffer slots when @p ob is not NULL.
 * @param q    (T, n_head, hd) bf16, row stride ldq (post-RoPE)
 * @param qpos (T) int32 device
 * @param o    (T, n_head, hd) bf16, row stride ldo. A query that sees no key gets 0.
 * hd in {64, 128}; n_head/n_kv <= 16.
 */
int kvz_cuda_attn_prefill(cudaStream_t s, int T, int n_head, const void *q, int ldq,
                          const int32_t *qpos, const kvz_cuda_kv *kv,
                          const kvz_cuda_outbuf *ob, void *o, int ldo);

/** Workspace bytes for kvz_cuda_attn_decode with these sizes (host function). */
size_t kvz_cuda_attn_decode_ws_size(int T, int n_head, int hd, int max_len, int n_slot);

/**
 * Decode attention (few queries, split over the sequence / flash-decoding), same
 * visibility as prefill, over cache rows [0, len[h]) plus the output buffer.
 * With @p ob it also computes, for the LAST query t = T-1, the LongFlow slot score
 *   S_j = Σ_h p_{h,j} · ‖v_{kv(h),j}‖₁   (p = softmax over doc ∪ buffer, combined
 * over splits) and the eviction choice argmin_j S_j over slots j that are in use,
 * j >= n_sink and slot_pos[j] != qpos[T-1] (not the newest token); ties → lowest j;
 * -1 if none. Computed from logits and ‖v‖₁ taken while the split pass has the
 * tiles in shared memory: no extra pass over K/V. Deterministic (no atomics).
 * n_head <= 256. Output o is bf16 (T, n_head, hd), row stride ldo.
 * @param q       (T, n_head, hd) bf16, 16-byte aligned, row stride ldq (ldq % 8 == 0)
 * @param max_len host upper bound of max_h len[h] (sizes the split grid); <= cap
 * @param T       1 .. 32/(n_head/n_kv) queries (T·G <= 32)
 * @param ws      device workspace of kvz_cuda_attn_decode_ws_size(...) bytes
 * @param slot_score (n_slot) fp32 device or NULL;  @param evict_slot device int32 or NULL
 */
int kvz_cuda_attn_decode(cudaStream_t s, int T, int n_head, const void *q, int ldq,
                         const int32_t *qpos, const kvz_cuda_kv *kv, int max_len,
                         const kvz_cuda_outbuf *ob, void *o, int ldo, void *ws,
                         size_t ws_bytes, float *slot_score, int32_t *evict_slot);

/** Workspace bytes for kvz_cuda_attn_decode_multi with these sizes (host function). */
size_t kvz_cuda_attn_decode_multi_ws_size(int n_seq, int n_head, int n_kv, int hd, int max_len, int max_slot);

/**
 * Batched decode attention (continuous batching): one query per sequence, sequence z
 * (q row z, position qpos[z], output row z) over ITS cache seq[z].kv (rows [0, len[h])
 * of each head, ragged) plus its output buffer seq[z].ob; the math of
 * kvz_cuda_attn_decode with T = 1, in four launches for all sequences (grids with a
 * sequence dimension). With a buffer and seq[z].evict set, it also writes the LongFlow
 * choice (argmin S_j, as kvz_cuda_attn_decode's evict_slot) to *seq[z].evict; when the
 * buffer has no evictable slot by construction (n_slot <= n_sink + 1) it writes
 * n_slot - 1 instead of -1 (the single-sequence caller's fallback).
 * Splits: every split takes a fixed run of key tiles, sized from the total work of the
 * batch (@p sum_len: host sum of len[h] over all sequences and KV heads, 0 if unknown)
 * so that heads of very different lengths (KVzip-compressed caches) are cut into
 * similar pieces; the split count follows the longest head (@p max_len: host upper
 * bound of every sequence's max_h len[h]); splits past a head's length exit at once.
 * The workspace bound (kvz_cuda_attn_decode_multi_ws_size) holds for any sum_len.
 * @param q    (n_seq, n_head, hd) bf16, 16-byte aligned, row stride ldq (% 8 == 0)
 * @param max_slot host upper bound of every seq[z].ob.n_slot (0: no sequence has a buffer)
 * @param o    (n_seq, n_head, hd) bf16, row stride ldo
 * @param ws   kvz_cuda_attn_decode_multi_ws_size(...) bytes, device
 * hd in {64, 128}; n_head / n_kv <= 32; n_head <= 256; every seq[z].kv has n_kv heads
 * and head dim hd. Errors: KVZ_ERR_ARG, KVZ_ERR_CUDA.
 */
int kvz_cuda_attn_decode_multi(cudaStream_t s, int n_seq, int n_head, int n_kv, int hd, const void *q, int ldq,
                               const int32_t *qpos, const kvz_cuda_seq *seq, int max_len, long long sum_len,
                               int max_slot, void *o, int ldo, void *ws, size_t ws_bytes);

/** Workspace bytes for kvz_cuda_kvzip_score (host function). */
size_t kvz_cuda_kvzip_score_ws_size(int R, int n_head);

/**
 * Cache rows of one KVzip repeat pass over one context chunk. The cache (full,
 * uncompressed, uniform over heads) holds the document, rows [0, ctx_end) = prefix
 * rows [0, n_prefix) then the context, followed by the repeat inputs of one or more
 * chunks, appended one after another; this chunk's R repeat rows are [rep0, rep1).
 * The repeat queries attend to [0, ctx_end) ∪ [rep0, rep1) (by position, so their own
 * rows causally) and never to another chunk's repeat rows. The KVzip key subset is
 * K̄ = [0, n_prefix) ∪ [c0, c1) ∪ [rep0, rep1), the chunk being [c0, c1).
 * Requires 0 <= n_prefix <= c0 <= c1 <= ctx_end <= rep0 <= rep1 <= cap.
 */
typedef struct kvz_cuda_kvzip_rows {
    int32_t n_prefix, c0, c1, ctx_end, rep0, rep1;
} kvz_cuda_kvzip_rows;

/**
 * KVzip importance scores for one layer and one context chunk (DESIGN §3 step 3).
 * For each KV head h and chunk row j in [c0, c1) (see kvz_cuda_kvzip_rows):
 *   score[h·ld_score + (j-c0)] = max over repeat queries i and heads g of h's group of
 *   softmax_{i,g}(j), the softmax over the visible keys of K̄.
 * Two fused passes (row max/sum over K̄, then the chunk's probabilities max-reduced),
 * no R×N matrix in memory. The score region is zeroed by this call first.
 * @param q    (R, n_head, hd) bf16 post-RoPE repeat queries, row stride ldq
 * @param qpos (R) int32 device
 * @param score (n_kv, ld_score) fp32 device; columns [0, c1-c0) are written —
 *        point it at column (c0 - n_prefix) of an (n_layer, n_kv, n_ctx) array with
 *        ld_score = n_ctx to fill the global score array directly.
 * @param o_scratch NULL, or (R, n_head·hd) bf16 device memory (row stride ldo) that
 *        the first pass may overwrite: it then runs as attention over K̄ (faster on
 *        Hopper than the statistics-only kernel); the contents are meaningless after.
 */
int kvz_cuda_kvzip_score(cudaStream_t s, int R, int n_head, const void *q, int ldq,
                         const int32_t *qpos, const kvz_cuda_kv *kv, const kvz_cuda_kvzip_rows *rows,
                         float *score, int ld_score, void *ws, size_t ws_bytes, void *o_scratch, int ldo);

/**
 * The repeat pass's attention with the KVzip statistics fused in: the attention
 * output of the R repeat queries over [0, ctx_end) ∪ [rep0, rep1) (as
 * kvz_cuda_attn_prefill computes it over a cache of just those rows), and in @p ws,
 * per query row, (m, l̄) with m the row max over all visible keys and l̄ = Σ exp(s - m)
 * over the visible keys of K̄ — kvz_cuda_kvzip_score's subset denominator at the full
 * row max (the same ratios), so each key's logit is computed once for both. Follow
 * with kvz_cuda_kvzip_score_fused.
 * @param ws kvz_cuda_kvzip_score_ws_size(R, n_head) bytes, device
 */
int kvz_cuda_attn_prefill_kvzip(cudaStream_t s, int R, int n_head, const void *q, int ldq,
                                const int32_t *qpos, const kvz_cuda_kv *kv, void *o, int ldo,
                                const kvz_cuda_kvzip_rows *rows, void *ws, size_t ws_bytes);

/**
 * Second half of the fused KVzip scoring: with @p ws filled by
 * kvz_cuda_attn_prefill_kvzip for the same queries and cache, writes
 * score[h·ld_score + (j-c0)] for chunk rows j in [c0, c1) exactly as
 * kvz_cuda_kvzip_score does (the region is zeroed first). One pass over the chunk keys.
 */
int kvz_cuda_kvzip_score_fused(cudaStream_t s, int R, int n_head, const void *q, int ldq,
                               const int32_t *qpos, const kvz_cuda_kv *kv, int c0, int c1,
                               float *score, int ld_score, const void *ws, size_t ws_bytes);

/* ========================================================================== */
/* Eviction: top-k selection and compaction                                   */

/** Workspace bytes for kvz_cuda_topk_global (host function). */
size_t kvz_cuda_topk_ws_size(int64_t n);

/**
 * Global top-k keep mask: keep[i] = 1 for exactly K of the n scores (fp32, >= 0,
 * no NaN), the K largest; among equal scores the lower flat index wins. Radix
 * select on the float bits (4 passes of 8-bit histograms) + an ordered scan for
 * the tie at the threshold; no host sort, no host synchronisation.
 * K = round(n · r) is the caller's choice (llround). 0 <= K <= n <= 2^31-1.
 * @param scores (n) fp32, e.g. (n_layer, n_kv, n_ctx) flattened
 * @param keep   (n) uint8 output
 */
int kvz_cuda_topk_global(cudaStream_t s, const float *scores, int64_t n, int64_t K,
                         uint8_t *keep, void *ws, size_t ws_bytes);

/** Per-row uniform top-k: for each of n_rows rows of n_cols scores (row stride
 *  n_cols), keep exactly k (k <= n_cols), same tie-break (lower column wins). */
int kvz_cuda_topk_rows(cudaStream_t s, const float *scores, int n_rows, int n_cols,
                       int k, uint8_t *keep);

/** counts[r] = Σ_c keep[r·n_cols + c], for sizing compacted caches (int32 device). */
int kvz_cuda_keep_counts(cudaStream_t s, const uint8_t *keep, int n_rows, int n_cols,
                         int32_t *counts);

/**
 * Compaction of one layer: for each head h, dst rows = src rows [0, n_prefix)
 * (always kept) followed, in order, by the context rows n_prefix + c (c < n_ctx)
 * with keep[h·n_ctx + c] != 0; dst->len[h] = n_prefix + kept_h. K, V and pos move
 * together. src and dst must not overlap. Rows that would pass dst->cap are
 * dropped (size dst from kvz_cuda_keep_counts). src->len is not read.
 * @param keep (n_kv, n_ctx) uint8 for this layer
 */
int kvz_cuda_kv_compact(cudaStream_t s, const kvz_cuda_kv *src, int n_prefix, int n_ctx,
                        const uint8_t *keep, const kvz_cuda_kv *dst);

/**
 * Copy rows [0, src->len[h]) of every head h (K, V, pos; at most dst->cap) to dst and
 * set dst->len = src->len. @p max_rows: an upper bound of src->len (sizes the grid;
 * rows past it are not copied). src and dst must not overlap.
 */
int kvz_cuda_kv_copy(cudaStream_t s, const kvz_cuda_kv *src, const kvz_cuda_kv *dst, int max_rows);

/* ========================================================================== */
/* Load path: stored rows <-> the bf16 cache (kernels/kvload.cu)             */

/**
 * One layer of stored rows into the cache in one launch: for every head h, cache rows
 * [row0, row0 + rows[h]) (host counts, row0 + rows[h] <= cap) come from the flat head-major source arrays
 * (head h's rows start at rows[0] + ... + rows[h-1]) in stored type @p dtype
 * (kvz_kv_dtype of common/kvz_kvdtype.h: F32, F16, BF16, Q8 or Q4, row layouts
 * there), are dequantised in fp32 and written as bf16 (round to nearest even: the
 * bits of kvz_fp32_to_bf16 on the same fp32 value); pos (u32, same order) is copied
 * and the device len[h] set to row0 + rows[h]. Rows below row0 are not touched (a
 * shared system prefix loaded by an earlier call).
 * @param k_src, v_src device, (Σ rows) rows of kvz_kv_row_bytes(dtype, hd) bytes;
 *        16-byte aligned for F32/F16/BF16.  @param pos_src (Σ rows) u32 device.
 * n_kv <= 64, hd % 8 == 0 (% 32 for Q8/Q4). Errors: KVZ_ERR_ARG, KVZ_ERR_CUDA.
 */
int kvz_cuda_kv_load(cudaStream_t s, const kvz_cuda_kv *kv, int dtype, const int32_t *rows, int32_t row0,
                     const void *k_src, const void *v_src, const uint32_t *pos_src);

/**
 * Quantized export (the reverse for the ingest): rows [0, rows[h]) of every head, back
 * to back, quantized to @p dtype = KVZ_KV_Q8 or KVZ_KV_Q4 exactly as
 * common/kvz_kvdtype.h specifies (scales rounded to f16 first; q8 round half away
 * from zero). @param k_out, v_out (Σ rows) rows of kvz_kv_row_bytes(dtype, hd) bytes,
 * device, 4-byte aligned; @param pos_out (Σ rows) u32 device. hd % 64 == 0, n_kv <= 64.
 */
int kvz_cuda_kv_export_q(cudaStream_t s, const kvz_cuda_kv *kv, int dtype, const int32_t *rows,
                         void *k_out, void *v_out, uint32_t *pos_out);

#ifdef __cplusplus
}
#endif
#endif /* KVZ_CUDA_H */
