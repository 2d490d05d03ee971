/* Re-rotation of stored keys by a position offset (see kvz_rope_shift.h). */
#include <math.h>
#include <stdlib.h>

#include "kvz_model_impl.h"
#include "kvz_rope_shift.h"

#define SHIFT_MAX_HALF 512 /* head_dim/2 at most on the stack; larger falls back per row */

/* rotate n rows by the table cs/sn (pairs j < nj); pairs past nj get their angle from
 * inv_freq here (head_dim > 2 * SHIFT_MAX_HALF only) */
static void rotate(float *k, int64_t n, int32_t hd, int adjacent, const float *cs, const float *sn, int32_t nj,
                   const float *inv_freq, int32_t delta)
{
    const int32_t half = hd / 2;
    for (int64_t r = 0; r < n; r++) {
        float *x = k + r * hd;
        for (int32_t j = 0; j < half; j++) {
            float c, s;
            if (j < nj) {
                c = cs[j];
                s = sn[j];
            } else {
                const double a = (double)delta * (double)inv_freq[j];
                c = (float)cos(a);
                s = (float)sin(a);
            }
            const int32_t i0 = adjacent ? 2 * j : j, i1 = adjacent ? 2 * j + 1 : j + half;
            const float a0 = x[i0], b0 = x[i1];
            x[i0] = a0 * c - b0 * s;
            x[i1] = a0 * s + b0 * c;
        }
    }
}

void kvz_rope_shift_rows(float *k, int64_t n, int32_t hd, const float *inv_freq, int adjacent,
                         int32_t delta)
{
    if (delta == 0 || n <= 0) return;
    const int32_t half = hd / 2;
    float cs[SHIFT_MAX_HALF], sn[SHIFT_MAX_HALF];
    const int32_t nj = half < SHIFT_MAX_HALF ? half : SHIFT_MAX_HALF;
    kvz_rope_shift_angles(inv_freq, nj, delta, cs, sn);
    rotate(k, n, hd, adjacent, cs, sn, nj, inv_freq, delta);
}

void kvz_rope_shift_angles(const float *inv_freq, int32_t half, int32_t delta, float *cs, float *sn)
{
    for (int32_t j = 0; j < half; j++) {
        const double a = (double)delta * (double)inv_freq[j];
        cs[j] = (float)cos(a);
        sn[j] = (float)sin(a);
    }
}

void kvz_rope_shift_table(const kvz_model *m, int32_t delta, float *cs, float *sn)
{
    const int32_t hd = m->cfg.head_dim, half = hd / 2;
    if (m->device != KVZ_DEVICE_CUDA) {
        kvz_rope_shift_angles(m->rope_inv_freq, half, delta, cs, sn);
        return;
    }
    for (int32_t j = 0; j < half; j++) { /* as kernels/rope.cu */
        const double a = (double)delta * pow((double)m->cfg.rope_theta, -2.0 * j / (double)hd);
        cs[j] = (float)cos(a);
        sn[j] = (float)sin(a);
    }
}

void kvz_rope_shift(const kvz_model *m, float *k, int64_t n, int32_t delta)
{
    const int32_t hd = m->cfg.head_dim;
    if (m->device != KVZ_DEVICE_CUDA || hd / 2 > SHIFT_MAX_HALF) {
        kvz_rope_shift_rows(k, n, hd, m->rope_inv_freq, m->cfg.rope_adjacent, delta);
        return;
    }
    if (delta == 0 || n <= 0) return;
    float cs[SHIFT_MAX_HALF], sn[SHIFT_MAX_HALF]; /* θj as the CUDA backend's RoPE has them */
    kvz_rope_shift_table(m, delta, cs, sn);
    rotate(k, n, hd, m->cfg.rope_adjacent, cs, sn, hd / 2, m->rope_inv_freq, delta);
}
