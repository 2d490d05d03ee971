/* Deterministic tiny KV cache used by the blob golden files and the store tests:
 * 2 layers x 2 KV heads (4 query heads) x head_dim 4, n_prefix 2, n_context 10,
 * prefix kept, global mode, ratio 0.5. Values are small multiples of 1/4, exact
 * in f32, f16 and bf16. Regenerate the golden files with
 *     build/tests/fast_test_blob --write-golden tests/golden
 */
#ifndef KVZ_BLOB_FIXTURE_H
#define KVZ_BLOB_FIXTURE_H

#include "kvz_blob.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FX_L 2
#define FX_H 2
#define FX_HD 4
#define FX_PREFIX 2
#define FX_CONTEXT 10

typedef struct {
    kvz_blob_meta meta;
    uint32_t counts[FX_L * FX_H];
    /* per layer, flat head-major */
    uint32_t pos[FX_L][FX_PREFIX + FX_CONTEXT];              /* (kept) */
    uint8_t k[FX_L][(FX_PREFIX + FX_CONTEXT) * FX_HD * 4];   /* (kept, hd) dtype */
    uint8_t v[FX_L][(FX_PREFIX + FX_CONTEXT) * FX_HD * 4];   /* (kept, hd) dtype */
} fx_cache;

/* float -> f16 bits, exact for the fixture's values (normal or zero). */
static inline uint16_t fx_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    int32_t e = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = (x >> 13) & 0x3ffu;
    if ((x & 0x7fffffffu) == 0) return (uint16_t)sign;
    return (uint16_t)(sign | ((uint32_t)e << 10) | mant);
}

static inline uint16_t fx_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    return (uint16_t)(x >> 16);
}

static inline void fx_store(uint8_t *dst, size_t i, uint8_t dtype, float f)
{
    if (dtype == KVZ_DTYPE_F32) { memcpy(dst + 4 * i, &f, 4); return; }
    uint16_t b = dtype == KVZ_DTYPE_F16 ? fx_f16(f) : fx_bf16(f);
    memcpy(dst + 2 * i, &b, 2);
}

static inline void fx_make(fx_cache *c, uint8_t dtype)
{
    static const uint32_t counts[FX_L * FX_H] = {4, 7, 6, 3};
    memset(c, 0, sizeof *c);
    memcpy(c->counts, counts, sizeof counts);
    kvz_blob_meta *m = &c->meta;
    for (int i = 0; i < 16; i++) m->fingerprint[i] = (uint8_t)(0xA0 + i);
    m->n_layer = FX_L;
    m->n_head = 2 * FX_H;
    m->n_kv_head = FX_H;
    m->head_dim = FX_HD;
    m->dtype = dtype;
    m->mode = KVZ_MODE_GLOBAL;
    m->prefix_policy = KVZ_PREFIX_KEEP;
    m->ratio = 0.5f;
    m->chunk = 2000;
    m->overlap = 8;
    m->n_prefix = FX_PREFIX;
    m->n_context = FX_CONTEXT;
    m->counts = c->counts;
    for (uint32_t l = 0; l < FX_L; l++) {
        uint32_t row = 0;
        for (uint32_t h = 0; h < FX_H; h++) {
            uint32_t n = counts[l * FX_H + h], taken = 0;
            uint8_t pick[FX_PREFIX + FX_CONTEXT] = {0};
            for (uint32_t j = 0; j < FX_PREFIX; j++) pick[j] = 1, taken++;
            for (uint32_t j = FX_PREFIX; j < FX_PREFIX + FX_CONTEXT && taken < n; j++)
                if ((j * 5 + l * 3 + h) % 7 < 4) pick[j] = 1, taken++;
            for (uint32_t j = FX_PREFIX; j < FX_PREFIX + FX_CONTEXT && taken < n; j++)
                if (!pick[j]) pick[j] = 1, taken++;
            for (uint32_t j = 0; j < FX_PREFIX + FX_CONTEXT; j++) {
                if (!pick[j]) continue;
                c->pos[l][row] = j;
                for (uint32_t d = 0; d < FX_HD; d++) {
                    float kf = (float)((int)((l * 31 + h * 17 + j * 5 + d) % 23) - 11) * 0.25f;
                    float vf = (float)((int)((l * 13 + h * 7 + j * 3 + d * 11) % 19) - 9) * 0.5f;
                    fx_store(c->k[l], (size_t)row * FX_HD + d, dtype, kf);
                    fx_store(c->v[l], (size_t)row * FX_HD + d, dtype, vf);
                }
                row++;
            }
        }
    }
}

#endif
