/* CPU forward with fp32 weights (kvz_model_opts.f32_weights) vs HF transformers
 * (fp32) on the same GGUF: logits on 3 prompts, 64-token greedy continuations, and
 * prefill-then-decode == one-shot prefill.
 * Golden: tests/golden/logits_smollm2.bin (scripts/golden/gen_logits_golden.py).
 * The default CPU path (quantized weights) is tested in test_forward_quant.c.
 *
 * Tolerances: both sides compute in fp32 from identical dequantized weights; the
 * only differences are summation order (OpenBLAS vs PyTorch GEMMs) and libm
 * exp/cos. Measured (2026-11-29): max |dlogit| 1.1e-4 over the top-16 of every
 * position, relative L2 error 1.1e-6 over the full last-position vector. We allow
 * 2e-3 absolute and 2e-5 relative: ~20x above what we measure, and ~1000x below
 * what a real bug does (a wrong RoPE layout or a missing bias moves logits by
 * whole units). */
#include "golden_logits.h"

int main(void)
{
    gl_golden g;
    REQUIRE(gl_load("tests/golden/logits_smollm2.bin", &g) == 0);
    REQUIRE(g.np == 3 && g.nv == 49152);
    kvz_model *m;
    kvz_model_opts o = {.device = KVZ_DEVICE_CPU, .f32_weights = 1};
    REQUIRE(kvz_model_load(kvz_test_model(), &o, &m) == 0);
    REQUIRE(kvz_model_config(m)->n_vocab == (int32_t)g.nv);
    for (uint32_t k = 0; k < g.np; k++) CHECK(g.p[k].n >= 100);
    gl_check_f32(m, &g, 2e-3f, 2e-5);
    kvz_model_free(m);
    gl_free(&g);
    return kvz_test_summary();
}
