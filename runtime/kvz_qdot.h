/**
 * @file kvz_qdot.h
 * @brief Dot products of quantized weight rows with 8-bit activations (CPU).
 *
 * Activations are quantized per 32-element block to int8 with one fp32 scale
 * (q = round(x / d), d = max|x| / 127), as llama.cpp does for its integer dot
 * products; each block also keeps the sums of its two 16-element halves so that
 * the weight types with an offset (Q4_1 min, Q5_0 -16, Q6_K -32, k-quant mins)
 * need no extra pass. A weight row of type Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
 * Q5_K or Q6_K is read in its GGUF block layout (docs/GGUF.md), products are
 * summed in int32 per block and accumulated in fp32.
 *
 * Three implementations: a scalar reference (tests), AVX2 and AVX-512 (BW/VL/DQ),
 * chosen once at run time from cpuid (the environment variable KVZ_QDOT_ISA =
 * scalar | avx2 | avx512 lowers the choice; it never raises it above what the CPU
 * has). All functions are pure and thread-safe.
 */
#ifndef KVZ_QDOT_H
#define KVZ_QDOT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { KVZ_ISA_SCALAR = 0, KVZ_ISA_AVX2 = 1, KVZ_ISA_AVX512 = 2 };

/** Bytes of one quantized activation row of @p n elements (n a multiple of 32). */
size_t kvz_q8_row_bytes(int64_t n);
/** Quantize @p n fp32 values (n a multiple of 32) into @p dst (kvz_q8_row_bytes(n)
 *  bytes, any alignment). */
void kvz_q8_quantize(const float *x, int64_t n, void *dst);
/** The scalar reference of kvz_q8_quantize (the AVX2 path writes the same bytes). */
void kvz_q8_quantize_ref(const float *x, int64_t n, void *dst);

/** 1 if kvz_qdot handles weight type @p type (KVZ_TYPE_* of kvz_quant.h). */
int kvz_qdot_supported(uint32_t type);
/** Dot product of one weight row (@p n elements of @p type, n a multiple of the
 *  type's block) with a quantized activation row, with the ISA chosen at run time. */
float kvz_qdot(uint32_t type, const void *w, const void *q8, int64_t n);
/** Same with an explicit ISA (falls back to scalar when the CPU lacks it). */
float kvz_qdot_isa(int isa, uint32_t type, const void *w, const void *q8, int64_t n);
/** The ISA kvz_qdot uses (KVZ_ISA_*), and the best one this CPU has. */
int kvz_qdot_active_isa(void);
int kvz_qdot_cpu_isa(void);
const char *kvz_isa_name(int isa);

#ifdef __cplusplus
}
#endif
#endif
