/**
 * @file kvz_rope_shift.h
 * @brief Move post-RoPE keys by a position offset (multi-document composition).
 *
 * RoPE rotates each frequency pair j of a key at position p by the angle p·θ_j.
 * Rotations compose, so rotating a stored key once more by Δ·θ_j gives exactly
 * the key the same hidden state would have at position p + Δ. Values carry no
 * position and are unchanged. θ_j is the model's inverse frequency, including any
 * rope scaling the GGUF carries (rope_freqs.weight), so scaled models shift right.
 */
#ifndef KVZ_ROPE_SHIFT_H
#define KVZ_ROPE_SHIFT_H

#include <stdint.h>

#include "kvz_model.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Rotate @p n rows of @p hd floats in place by @p delta positions.
 * @param inv_freq  (hd/2) θ_j.
 * @param adjacent  1: pairs (x[2j], x[2j+1]) (llama); 0: (x[j], x[j+hd/2]) (qwen2/qwen3).
 * The angles are computed in double precision (Δ·θ_j may be large).
 */
void kvz_rope_shift_rows(float *k, int64_t n, int32_t hd, const float *inv_freq, int adjacent,
                         int32_t delta);

/** kvz_rope_shift_rows with model @p m's head_dim, θ_j and layout (θ_j as
 *  kvz_rope_shift_table gives them: on a CUDA model, as its backend's RoPE). */
void kvz_rope_shift(const kvz_model *m, float *k, int64_t n, int32_t delta);

/**
 * The angle table of a shift by @p delta: cs[j] = cos(Δ·θ_j), sn[j] = sin(Δ·θ_j) for
 * j < @p half, computed in double precision and rounded to float — exactly the
 * numbers kvz_rope_shift_rows applies.
 */
void kvz_rope_shift_angles(const float *inv_freq, int32_t half, int32_t delta, float *cs, float *sn);

/**
 * The angle table (head_dim/2 entries each) for model @p m, with θ_j as the model's
 * backend rotates at ingest: the CPU's inv_freq (rope_freqs scaling included); the
 * CUDA backend's theta^(-2j/head_dim) in double (it refuses per-frequency scaling).
 * The device re-rotation (kernels/kvz_rope_shift_cuda.h) applies this table.
 */
void kvz_rope_shift_table(const kvz_model *m, int32_t delta, float *cs, float *sn);

#ifdef __cplusplus
}
#endif
#endif
