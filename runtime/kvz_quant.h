/**
 * @file kvz_quant.h
 * @brief ggml tensor types: sizes and dequantization to fp32 (CPU reference).
 *
 * Block layouts follow ggml's (see docs/GGUF.md). All functions are pure and
 * thread-safe.
 */
#ifndef KVZ_QUANT_H
#define KVZ_QUANT_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/** ggml type codes as stored in GGUF. */
enum {
    KVZ_TYPE_F32 = 0, KVZ_TYPE_F16 = 1, KVZ_TYPE_Q4_0 = 2, KVZ_TYPE_Q4_1 = 3,
    KVZ_TYPE_Q5_0 = 6, KVZ_TYPE_Q5_1 = 7, KVZ_TYPE_Q8_0 = 8, KVZ_TYPE_Q8_1 = 9,
    KVZ_TYPE_Q2_K = 10, KVZ_TYPE_Q3_K = 11, KVZ_TYPE_Q4_K = 12, KVZ_TYPE_Q5_K = 13,
    KVZ_TYPE_Q6_K = 14, KVZ_TYPE_Q8_K = 15, KVZ_TYPE_BF16 = 30,
};

/** Elements per block (1 for F32/F16/BF16), or 0 if the type is unknown. */
int64_t kvz_type_block_elems(uint32_t type);
/** Bytes per block, or 0 if the type is unknown. */
int64_t kvz_type_block_bytes(uint32_t type);
/** Short name ("Q4_K"), "?" if unknown. */
const char *kvz_type_name(uint32_t type);
/** 1 if kvz_dequantize() supports the type. */
int kvz_type_supported(uint32_t type);
/** Bytes of @p n elements, or -1 if @p n is not a multiple of the block or the type is unknown. */
int64_t kvz_type_nbytes(uint32_t type, int64_t n);

/**
 * Dequantize @p n elements (a multiple of the block size) from @p src to fp32 @p dst.
 * @return 0, KVZ_ERR_UNSUPPORTED (type), KVZ_ERR_ARG (n not a block multiple).
 */
int kvz_dequantize(uint32_t type, const void *src, float *dst, int64_t n);
/** Same with an explicit ISA (KVZ_ISA_* of kvz_qdot.h): KVZ_ISA_SCALAR is the
 *  reference; AVX2 (or higher) runs the AVX2 kernels of Q4_1, Q5_0, Q8_0, Q4_K and
 *  Q6_K when the CPU has AVX2, which give the same bits. kvz_dequantize uses
 *  kvz_qdot_active_isa(). */
int kvz_dequantize_isa(int isa, uint32_t type, const void *src, float *dst, int64_t n);

float kvz_fp16_to_fp32(uint16_t h);
uint16_t kvz_fp32_to_fp16(float f);     /**< round to nearest even */
float kvz_bf16_to_fp32(uint16_t h);
uint16_t kvz_fp32_to_bf16(float f);     /**< round to nearest even, NaN kept */

/** The fp16 value stored at @p p (a block's scale; any alignment). */
static inline float kvz_quant_f16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return kvz_fp16_to_fp32(h);
}

/** 6-bit scale and min of sub-block @p j (0..7) of a Q4_K / Q5_K super-block, from its
 *  12 packed scale bytes @p q (docs/GGUF.md). */
static inline void kvz_kq_scale_min(int j, const uint8_t *q, int *sc, int *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#ifdef __cplusplus
}
#endif
#endif
