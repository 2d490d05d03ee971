/* The default CPU path on SmolLM2's quantized blocks (Q4_1 / Q8_0 read in place by
 * kvz_qdot, no fp32 copy) vs HF transformers and vs the fp32 path
 * (tests/golden/logits_smollm2.bin; checks described in golden_logits.h).
 *
 * Tolerances: batched passes (>= 16 tokens) on the SGEMM route (KVZ_QGEMM=0)
 * dequantize weight rows into fp32 and run the same SGEMMs as the fp32 path: same
 * 2e-3 / 2e-5 as test_forward.c. The default route, the int8 GEMM (kvz_qgemm),
 * quantizes the activations like decode and is held to the decode bounds below
 * against the SGEMM route on the last 8 positions (measured 2026-12-02: max
 * |dlogit| 0.74-1.34, rel L2 0.053-0.13; over all positions 1.45-2.22 / 0.16-0.23,
 * printed, not bounded: the first positions have flat logits).
 * Decode steps quantize activations to int8 per 32-element block: each product
 * carries a relative error of ~1/254 of its block's largest activation, which
 * compounds over 30 layers of this small model. Measured (2026-12-01): max
 * |dlogit| 0.67-1.01 over the whole vocabulary on the last 8 positions of the 3
 * prompts (logits span about ±40), relative L2 0.025-0.104. We allow 2.0 and 0.15;
 * the fast test test_qdot checks each type's arithmetic exactly.
 * Greedy (measured): identical to HF for 2 / 2 / 7 tokens, then a token where the
 * fp32 top-2 gap is 0.035 / 0.030 / 0.135 (below the int8 noise) flips. */
#include "golden_logits.h"

int main(void)
{
    gl_golden g;
    REQUIRE(gl_load("tests/golden/logits_smollm2.bin", &g) == 0);
    REQUIRE(g.np == 3 && g.nv == 49152);
    kvz_model *mq, *mf;
    kvz_model_opts oq = {.device = KVZ_DEVICE_CPU}, of = {.device = KVZ_DEVICE_CPU, .f32_weights = 1};
    REQUIRE(kvz_model_load(kvz_test_model(), &oq, &mq) == 0);
    REQUIRE(kvz_model_load(kvz_test_model(), &of, &mf) == 0);
    const uint64_t qb = kvz_model_weight_bytes(mq), fb = kvz_model_weight_bytes(mf);
    printf("weights in memory: quantized %.1f MB, fp32 %.1f MB\n", qb / 1e6, fb / 1e6);
    CHECK(qb * 3 < fb); /* the quantized path holds no fp32 copy */
    gl_check_quant(mq, mf, &g, 2e-3f, 2e-5, 2.0f, 0.15);
    kvz_model_free(mq);
    kvz_model_free(mf);
    gl_free(&g);
    return kvz_test_summary();
}
