/* The chat layout read from the real SmolLM2 GGUF: recognised as SmolLM's ChatML with
 * its own default system text, and the cached prefix is byte-identical to the constant
 * layout every existing store, golden and content hash was made with. */
#include "kvz_test.h"

#include "kvz_generate.h"
#include "kvz_model.h"

int main(void)
{
    kvz_model *m;
    kvz_model_opts o = {.device = KVZ_DEVICE_CPU, .n_threads = 1};
    REQUIRE(kvz_model_load(kvz_test_model(), &o, &m) == 0);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    REQUIRE(kvz_tokenizer_chat_template(tok) != NULL);
    kvz_chat_tmpl t;
    kvz_chat_template(tok, &t);
    CHECKF(!strcmp(t.name, "smollm"), "name %s", t.name);
    CHECKF(!strcmp(t.system, KVZ_SYSTEM_TEXT), "system '%s'", t.system);

    static const char old[] = "<|im_start|>system\n" KVZ_SYSTEM_TEXT "<|im_end|>\n<|im_start|>user\n"
                              KVZ_INSTRUCTION "\n\n";
    /* the question as before: three encodes (the user's text without special tokens) */
    static const char q0[] = "\n\nQuestion: ", q1[] = "What is the PIN?",
                      q2[] = "<|im_end|>\n<|im_start|>assistant\n";
    kvz_tokens a = {0}, b = {0};
    REQUIRE(kvz_tokenizer_encode(tok, old, strlen(old), KVZ_TOK_SPECIAL, &a) == 0);
    REQUIRE(kvz_chat_prefix(tok, &b) == 0);
    CHECKF(a.n == b.n && !memcmp(a.ids, b.ids, a.n * sizeof *a.ids), "%zu vs %zu tokens", a.n, b.n);
    a.n = b.n = 0;
    REQUIRE(kvz_tokenizer_encode(tok, q0, strlen(q0), KVZ_TOK_SPECIAL, &a) == 0);
    REQUIRE(kvz_tokenizer_encode(tok, q1, strlen(q1), 0, &a) == 0);
    REQUIRE(kvz_tokenizer_encode(tok, q2, strlen(q2), KVZ_TOK_SPECIAL, &a) == 0);
    REQUIRE(kvz_chat_question(tok, q1, &b) == 0);
    CHECK(a.n == b.n && !memcmp(a.ids, b.ids, a.n * sizeof *a.ids));
    CHECK(kvz_chat_is_stop(tok, kvz_tokenizer_find(tok, "<|im_end|>")));
    kvz_tokens_free(&a);
    kvz_tokens_free(&b);
    kvz_model_free(m);
    return kvz_test_summary();
}
