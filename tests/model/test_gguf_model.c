/* kvz_gguf + kvz_quant on the real default model (SmolLM2-135M-Instruct Q4_1):
 * metadata values we rely on, tensor table, full dequantization (finite, timed),
 * and fingerprint stability / sensitivity to one flipped tensor byte. */
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "kvz_error.h"
#include "kvz_gguf.h"
#include "kvz_quant.h"
#include "kvz_test.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int copy_file(const char *src, const char *dst)
{
    FILE *in = fopen(src, "rb"), *out = fopen(dst, "wb");
    int ok = in && out;
    static char buf[1 << 20];
    size_t n;
    while (ok && (n = fread(buf, 1, sizeof buf, in)) > 0) ok = fwrite(buf, 1, n, out) == n;
    if (in) fclose(in);
    if (out && fclose(out) != 0) ok = 0;
    return ok;
}

static int64_t geti(const kvz_gguf *g, const char *k)
{
    int64_t v = -1;
    int rc = kvz_gguf_get_i64(g, k, &v);
    CHECKF(rc == 0, "%s: %d %s", k, rc, kvz_error_detail());
    return v;
}

int main(void)
{
    const char *path = kvz_test_model();
    if (access(path, R_OK) != 0) {
        fprintf(stderr, "model %s not found (bash scripts/fetch-model): skipping\n", path);
        return 77;
    }
    kvz_gguf *g = NULL;
    int rc = kvz_gguf_open(path, &g);
    CHECKF(rc == 0, "open %s: %d %s", path, rc, kvz_error_detail());
    REQUIRE(rc == 0);

    CHECK(kvz_gguf_version(g) == 3);
    kvz_str s;
    CHECK(kvz_gguf_get_str(g, "general.architecture", &s) == 0 && kvz_str_eq(s, "llama"));
    CHECK(geti(g, "llama.block_count") == 30);
    CHECK(geti(g, "llama.embedding_length") == 576);
    CHECK(geti(g, "llama.feed_forward_length") == 1536);
    CHECK(geti(g, "llama.attention.head_count") == 9);
    CHECK(geti(g, "llama.attention.head_count_kv") == 3);
    CHECK(geti(g, "llama.context_length") == 8192);
    CHECK(geti(g, "llama.rope.dimension_count") == 64);
    float f = 0;
    CHECK(kvz_gguf_get_f32(g, "llama.rope.freq_base", &f) == 0 && f == 100000.0f);
    CHECK(kvz_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &f) == 0 && f > 0 && f < 1e-3f);
    CHECK(kvz_gguf_get_str(g, "tokenizer.ggml.model", &s) == 0 && kvz_str_eq(s, "gpt2"));
    CHECK(kvz_gguf_get_str(g, "tokenizer.ggml.pre", &s) == 0 && kvz_str_eq(s, "smollm"));
    kvz_str *tok = NULL;
    uint64_t n_tok = 0;
    CHECK(kvz_gguf_get_str_array(g, "tokenizer.ggml.tokens", &tok, &n_tok) == 0 && n_tok == 49152);
    if (tok && n_tok > 2) CHECK(kvz_str_eq(tok[1], "<|im_start|>") && kvz_str_eq(tok[2], "<|im_end|>"));
    free(tok);
    uint32_t et;
    uint64_t n;
    const void *data;
    CHECK(kvz_gguf_get_array(g, "tokenizer.ggml.token_type", &et, &n, &data) == 0 && et == KVZ_GGUF_I32 &&
          n == 49152);
    CHECK(kvz_gguf_get_array(g, "tokenizer.ggml.merges", &et, &n, &data) == 0 && et == KVZ_GGUF_STRING &&
          n > 40000);

    const kvz_gguf_tensor *emb = kvz_gguf_find_tensor(g, "token_embd.weight");
    REQUIRE(emb != NULL);
    CHECK(emb->type == KVZ_TYPE_Q8_0 && emb->n_dims == 2 && emb->ne[0] == 576 && emb->ne[1] == 49152);
    const kvz_gguf_tensor *q = kvz_gguf_find_tensor(g, "blk.29.attn_q.weight");
    CHECK(q && q->type == KVZ_TYPE_Q4_1 && q->ne[0] == 576 && q->ne[1] == 576);
    const kvz_gguf_tensor *k = kvz_gguf_find_tensor(g, "blk.0.attn_k.weight");
    CHECK(k && k->ne[0] == 576 && k->ne[1] == 192);
    CHECK(kvz_gguf_find_tensor(g, "output_norm.weight") != NULL);
    CHECK(kvz_gguf_n_tensors(g) == 272);

    /* dequantize everything: all values finite, timed against the load budget */
    double t0 = now_s(), elems = 0;
    int bad_tensors = 0;
    float *buf = NULL;
    int64_t cap = 0;
    for (uint64_t i = 0; i < kvz_gguf_n_tensors(g); i++) {
        const kvz_gguf_tensor *t = kvz_gguf_tensor_at(g, i);
        int64_t ne = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        if (ne > cap) {
            free(buf);
            buf = malloc((size_t)ne * sizeof *buf);
            cap = ne;
        }
        REQUIRE(buf != NULL);
        if (kvz_dequantize(t->type, t->data, buf, ne) != 0) { bad_tensors++; continue; }
        for (int64_t j = 0; j < ne; j++)
            if (!isfinite(buf[j])) { bad_tensors++; break; }
        elems += (double)ne;
    }
    double dt = now_s() - t0;
    free(buf);
    CHECKF(bad_tensors == 0, "%d tensors failed to dequantize or are not finite", bad_tensors);
    CHECKF(elems > 1.3e8 && elems < 1.4e8, "%.0f elements", elems);
    printf("dequantized %.1f M weights in %.3f s (incl. finiteness scan and page-in)\n", elems * 1e-6, dt);

    /* fingerprint: stable across opens */
    uint8_t f1[16], f2[16], f3[16];
    t0 = now_s();
    kvz_gguf_fingerprint(g, f1);
    printf("fingerprint in %.3f s: ", now_s() - t0);
    for (int i = 0; i < 16; i++) printf("%02x", f1[i]);
    printf("\n");
    uint64_t flip_at = kvz_gguf_data_offset(g) + q->offset + q->nbytes / 2;
    kvz_gguf_close(g);
    g = NULL;
    REQUIRE(kvz_gguf_open(path, &g) == 0);
    kvz_gguf_fingerprint(g, f2);
    kvz_gguf_close(g);
    CHECK(memcmp(f1, f2, 16) == 0);

    /* ... and changes when one byte inside a tensor changes */
    char tmp[512];
    const char *td = getenv("TMPDIR");
    snprintf(tmp, sizeof tmp, "%s/kvz_test_gguf_model_%d.gguf", td ? td : "/tmp", (int)getpid());
    REQUIRE(copy_file(path, tmp));
    FILE *fp = fopen(tmp, "r+b");
    REQUIRE(fp != NULL);
    int c = -1;
    if (fseek(fp, (long)flip_at, SEEK_SET) == 0) c = fgetc(fp);
    if (c >= 0 && fseek(fp, (long)flip_at, SEEK_SET) == 0) fputc(c ^ 0x10, fp);
    fclose(fp);
    CHECK(c >= 0);
    g = NULL;
    rc = kvz_gguf_open(tmp, &g);
    CHECK(rc == 0);
    if (rc == 0) {
        kvz_gguf_fingerprint(g, f3);
        kvz_gguf_close(g);
        CHECK(memcmp(f1, f3, 16) != 0);
    }
    unlink(tmp);
    return kvz_test_summary();
}
