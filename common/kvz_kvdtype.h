/**
 * @file kvz_kvdtype.h
 * @brief The one numbering of stored KV row types, shared by format/, runtime/ and
 *        kernels/ (header-only, no dependencies).
 *
 * A KV "row" is one key or one value vector of head_dim elements for one
 * (layer, KV head, token). Every stored row type is self-contained: a row can be
 * decoded without its neighbours, so a GPU block (or a CPU thread) owns one row.
 *
 * Row layouts (little-endian; head_dim a multiple of 32 for q8/q4):
 *   F32   head_dim x float32
 *   F16   head_dim x IEEE half
 *   BF16  head_dim x bfloat16
 *   Q8    head_dim/32 x f16 scale d_g, then head_dim x int8 q_i
 *         x_i = d_g * q_i, g = i / 32; d_g = max|x| over the group / 127,
 *         q_i = round-half-away(x_i / d_g) clamped to [-127, 127]; d_g = 0 -> q_i = 0.
 *   Q4    head_dim/32 x (f16 d_g, f16 m_g), then head_dim/2 bytes of nibbles:
 *         byte j holds element 2j in its low nibble and 2j+1 in its high nibble.
 *         x_i = m_g + d_g * q_i, q_i in [0, 15]; m_g = min over the group,
 *         d_g = (max - min) / 15, q_i = round((x_i - m_g) / d_g) clamped to [0, 15];
 *         d_g = 0 -> q_i = 0.
 * The scales are rounded to f16 before the q_i are computed, so encoder and every
 * decoder agree on the exact dequantised value d_g * q_i (+ m_g), computed in fp32.
 */
#ifndef KVZ_KVDTYPE_H
#define KVZ_KVDTYPE_H

#include <stddef.h>
#include <stdint.h>

/** Stored KV row type. The numbers are on disk (blob byte "dtype"): never renumber. */
typedef enum {
    KVZ_KV_F32 = 0,
    KVZ_KV_F16 = 1,
    KVZ_KV_BF16 = 2,
    KVZ_KV_Q8 = 3, /**< blob format version >= 2 */
    KVZ_KV_Q4 = 4, /**< blob format version >= 2 */
} kvz_kv_dtype;

#define KVZ_KV_QGROUP 32 /**< elements per q8/q4 scale group */

/** Bytes of one stored row of @p head_dim elements; 0 for an unknown type or a
 *  head_dim that the type cannot hold (q8/q4 need a multiple of 32). */
static inline size_t kvz_kv_row_bytes(int dtype, size_t head_dim)
{
    switch (dtype) {
    case KVZ_KV_F32: return 4 * head_dim;
    case KVZ_KV_F16:
    case KVZ_KV_BF16: return 2 * head_dim;
    case KVZ_KV_Q8:
        return head_dim % KVZ_KV_QGROUP ? 0 : 2 * (head_dim / KVZ_KV_QGROUP) + head_dim;
    case KVZ_KV_Q4:
        return head_dim % KVZ_KV_QGROUP ? 0 : 4 * (head_dim / KVZ_KV_QGROUP) + head_dim / 2;
    default: return 0;
    }
}

/** Name as the CLIs spell it ("f32", "f16", "bf16", "q8", "q4"), NULL if unknown. */
static inline const char *kvz_kv_dtype_name(int dtype)
{
    static const char *const names[] = {"f32", "f16", "bf16", "q8", "q4"};
    return dtype >= 0 && dtype <= KVZ_KV_Q4 ? names[dtype] : NULL;
}

#endif /* KVZ_KVDTYPE_H */
