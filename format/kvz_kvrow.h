/**
 * @file kvz_kvrow.h
 * @brief KV row codec registry: the one place on the CPU that converts K/V rows
 *        between fp32 and the stored types of common/kvz_kvdtype.h (f32, f16,
 *        bf16, q8, q4). Ingest encodes with it, the CPU loader and kvzip-eval
 *        decode with it, the blob reader validates q8/q4 scale blocks with it.
 *
 * A row is head_dim elements of one key or value vector (layout and exact
 * arithmetic: common/kvz_kvdtype.h). Rows are independent: encoding or decoding
 * n rows is n independent row operations, so any split across threads gives the
 * same bytes.
 *
 * Exactness (what every decoder, CPU or GPU, must reproduce bit for bit):
 *   f16/bf16  fp32 -> 16 bit: round to nearest even, NaN kept quiet; back: exact.
 *   q8        d = f16(max|x| / 127), q = round-half-away(x / d) clamped to
 *             [-127, 127] (IEEE fp32 division, not a reciprocal multiply);
 *             decoded value d * q (exact in fp32: 11 x 7 bit product).
 *   q4        m = f16(min x), d = f16((max x - min x) / 15),
 *             q = round-half-away((x - m) / d) clamped to [0, 15];
 *             decoded value m + d * q (d * q exact in fp32, one rounding in the add).
 *   d = 0 gives q = 0. Scales (and m) saturate at +-65504, the f16 maximum, so
 *   finite input always gives finite scales.
 *
 * Threading: stateless, reentrant. Nothing prints or exits.
 */
#ifndef KVZ_KVROW_H
#define KVZ_KVROW_H

#include <stddef.h>
#include <stdint.h>

#include "kvz_kvdtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/** One stored row type. */
typedef struct kvz_kvrow_codec {
    uint8_t dtype;    /**< kvz_kv_dtype (the on-disk number) */
    const char *name; /**< "f32", "f16", "bf16", "q8", "q4" */
    uint8_t min_blob_version; /**< first blob format version that may hold it (1 or 2) */
    /** fp32 (head_dim) -> one stored row (kvz_kv_row_bytes bytes).
     *  @return 0, KVZ_ERR_ARG (NaN or Inf in a q8/q4 row: no scale can hold it). */
    int (*encode)(const float *src, size_t head_dim, uint8_t *dst);
    /** One stored row -> fp32 (head_dim).
     *  @return 0, KVZ_ERR_FORMAT (q8/q4: a scale that is NaN, Inf or negative, or
     *  a q8 value of -128, which no encoder writes); @p dst is then unspecified. */
    int (*decode)(const uint8_t *src, size_t head_dim, float *dst);
} kvz_kvrow_codec;

/** The codec of @p dtype, NULL if unknown. */
const kvz_kvrow_codec *kvz_kvrow_codec_get(int dtype);

/** The codec named @p name ("f16", "q8", ...), NULL if unknown. */
const kvz_kvrow_codec *kvz_kvrow_codec_find(const char *name);

/**
 * Encode @p n_rows fp32 rows (n_rows, head_dim) into stored rows
 * (n_rows, kvz_kv_row_bytes(dtype, head_dim)).
 * @return 0; KVZ_ERR_ARG (unknown dtype, head_dim the type cannot hold, NULL
 *         with rows, NaN/Inf in a q8/q4 row: detail names the row).
 */
int kvz_kvrow_encode(int dtype, const float *src, size_t n_rows, size_t head_dim, void *dst);

/**
 * Decode @p n_rows stored rows into fp32 (n_rows, head_dim).
 * @return 0; KVZ_ERR_ARG (unknown dtype / head_dim / NULL); KVZ_ERR_FORMAT (bad
 *         scale block or value: detail names the row).
 */
int kvz_kvrow_decode(int dtype, const void *src, size_t n_rows, size_t head_dim, float *dst);

/**
 * Validate stored rows without converting: for q8/q4 every scale finite and
 * non-negative (m finite) and no q8 value -128; f32/f16/bf16 always pass.
 * @param bad_row out (may be NULL): index of the first bad row.
 * @return 0; KVZ_ERR_ARG (unknown dtype / head_dim); KVZ_ERR_FORMAT.
 */
int kvz_kvrow_check(int dtype, const void *src, size_t n_rows, size_t head_dim, uint64_t *bad_row);

/** Encode then decode in place, one row at a time: @p rows (n_rows, head_dim)
 *  fp32 become exactly what a reader of type @p dtype sees (kvzip-eval --kv-dtype).
 *  @return as kvz_kvrow_encode(); KVZ_ERR_ARG also for head_dim > 1024. */
int kvz_kvrow_round_trip(int dtype, float *rows, size_t n_rows, size_t head_dim);

/** IEEE half <-> fp32 (round to nearest even; NaN kept quiet). */
uint16_t kvz_kvrow_f32_to_f16(float f);
float kvz_kvrow_f16_to_f32(uint16_t h);
/** bfloat16 <-> fp32 (round to nearest even; NaN kept quiet). */
uint16_t kvz_kvrow_f32_to_bf16(float f);
float kvz_kvrow_bf16_to_f32(uint16_t h);

#ifdef __cplusplus
}
#endif
#endif /* KVZ_KVROW_H */
