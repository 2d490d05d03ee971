/**
 * @file kvz_qgemm.h
 * @brief Matrix–matrix product of quantized weight rows with n 8-bit activation
 *        rows (CPU, batched passes).
 *
 * The activations are quantized once per product (kvz_q8_quantize rows, the same
 * int8 blocks of 32 as kvz_qdot, plus per-block fp32 terms). A panel of weight
 * rows is unpacked once into tiles of 8 rows: per 32-element block the raw quants
 * of the 8 rows interleaved 4 bytes at a time (so one 32-byte vector holds 4
 * consecutive elements of each row), the integer sub-block scales, the fp32 block
 * scale and offset per row. An AVX2 microkernel then multiplies a tile with up to
 * 4 tokens at once (vpmaddubsw against the broadcast activation bytes, int16 sums
 * while they cannot saturate, vpmaddwd with the integer scales, fp32 per block):
 * the unpacking is paid once per weight row and product, not once per token.
 *
 * Each output equals kvz_qdot of the same row and activation row up to the fp32
 * summation order. Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; AVX2
 * only (kvz_qgemm_available() is 0 without it). Pure and thread-safe: callers
 * split the rows across threads, each with its own panel buffer.
 */
#ifndef KVZ_QGEMM_H
#define KVZ_QGEMM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** 1 if this CPU runs the int8 GEMM (AVX2) and KVZ_QDOT_ISA does not ask for scalar. */
int kvz_qgemm_available(void);
/** 1 if kvz_qgemm_rows handles weight type @p type (KVZ_TYPE_*). */
int kvz_qgemm_supported(uint32_t type);

/** Bytes of the quantized activations of @p n rows of width @p k (k a multiple of 32). */
size_t kvz_qgemm_act_bytes(int64_t n, int64_t k);
/** Quantize @p n rows of @p k floats (row stride k) into @p act (kvz_qgemm_act_bytes,
 *  4-byte aligned). Rows [i0, i1) only, so that callers can split the rows across
 *  threads; the buffer is complete when all rows are done. */
void kvz_qgemm_quantize(const float *x, int64_t n, int64_t k, int64_t i0, int64_t i1, void *act);

/** Upper bound of kvz_qgemm_panel_bytes over all k. */
#define KVZ_QGEMM_PANEL_MAX_BYTES ((size_t)256 << 10)
/** Weight rows per panel for width @p k (a multiple of 8) and the bytes of the
 *  per-thread panel buffer kvz_qgemm_rows needs (<= KVZ_QGEMM_PANEL_MAX_BYTES). */
int64_t kvz_qgemm_panel_rows(int64_t k);
size_t kvz_qgemm_panel_bytes(int64_t k);

/**
 * y[t·ldy + r] = (or += when @p accumulate) Σ_e W_r[e]·x_t[e] for the @p nr weight
 * rows at @p w (row stride @p row_bytes, at most kvz_qgemm_panel_rows(k) rows) and
 * the @p n activation rows in @p act (from kvz_qgemm_quantize with the same n, k).
 * @p panel: kvz_qgemm_panel_bytes(k) bytes of scratch (any alignment).
 */
void kvz_qgemm_rows(uint32_t type, const void *w, size_t row_bytes, int64_t nr, int64_t k, const void *act,
                    int64_t n, float *y, int64_t ldy, int accumulate, void *panel);

#ifdef __cplusplus
}
#endif
#endif
