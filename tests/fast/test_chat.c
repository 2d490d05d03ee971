/* Chat layout recognised from a GGUF tokenizer.chat_template (runtime/kvz_generate.c):
 * the Jinja sources below are the templates as SmolLM2-135M-Instruct, Qwen2.5 and
 * Llama-3 ship them (SmolLM2 verbatim; Qwen2.5 and Llama-3 abridged to the parts that
 * carry the layout and the default system turn). Also: the synthetic byte-level
 * tokenizer's prefix is the old constant ChatML string, byte for byte. */
#include "kvz_test.h"

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_tokenizer.h"

static const char *smollm2 =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}";

static const char *qwen25 =
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == "
    "'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are "
    "Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>"
    "system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- "
    "'<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n";

static const char *llama3 =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

static const char *chatml_nosys =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";

int main(void)
{
    kvz_chat_tmpl t;
    kvz_chat_template_parse(smollm2, &t);
    CHECK(t.family == KVZ_CHAT_CHATML);
    CHECKF(!strcmp(t.name, "smollm"), "name %s", t.name);
    CHECKF(!strcmp(t.system, KVZ_SYSTEM_TEXT), "system '%s'", t.system);

    kvz_chat_template_parse(qwen25, &t);
    CHECK(t.family == KVZ_CHAT_CHATML);
    CHECKF(!strcmp(t.name, "qwen2.5"), "name %s", t.name);
    CHECKF(!strcmp(t.system, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
           "system '%s'", t.system);

    kvz_chat_template_parse(llama3, &t);
    CHECK(t.family == KVZ_CHAT_LLAMA3);
    CHECKF(!strcmp(t.name, "llama3"), "name %s", t.name);
    CHECK(t.system[0] == 0);

    kvz_chat_template_parse(chatml_nosys, &t);
    CHECK(t.family == KVZ_CHAT_CHATML && !strcmp(t.name, "chatml") && t.system[0] == 0);

    kvz_chat_template_parse(NULL, &t);   /* no template: ChatML with the SmolLM text, as before */
    CHECK(t.family == KVZ_CHAT_CHATML && !strcmp(t.system, KVZ_SYSTEM_TEXT));
    kvz_chat_template_parse("{{ messages }}", &t);   /* unknown: ChatML fallback */
    CHECK(t.family == KVZ_CHAT_CHATML && !strcmp(t.system, KVZ_SYSTEM_TEXT));

    /* byte-level tokenizer (no template): prefix identical to the old constant layout */
    kvz_tokenizer *tok;
    REQUIRE(kvz_tokenizer_bytes(512, &tok) == 0);
    static const char old[] = "<|im_start|>system\n" KVZ_SYSTEM_TEXT "<|im_end|>\n<|im_start|>user\n"
                              KVZ_INSTRUCTION "\n\n";
    kvz_tokens a = {0}, b = {0}, c = {0}, d = {0};
    REQUIRE(kvz_tokenizer_encode(tok, old, strlen(old), KVZ_TOK_SPECIAL, &a) == 0);
    REQUIRE(kvz_chat_prefix(tok, &b) == 0);
    CHECK(a.n == b.n && !memcmp(a.ids, b.ids, a.n * sizeof *a.ids));
    /* the system text is a parameter; "" leaves the system turn out */
    REQUIRE(kvz_chat_prefix_sys(tok, "Be brief.", &c) == 0);
    static const char custom[] = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                 KVZ_INSTRUCTION "\n\n";
    a.n = 0;
    REQUIRE(kvz_tokenizer_encode(tok, custom, strlen(custom), KVZ_TOK_SPECIAL, &a) == 0);
    CHECK(a.n == c.n && !memcmp(a.ids, c.ids, a.n * sizeof *a.ids));
    REQUIRE(kvz_chat_prefix_sys(tok, "", &d) == 0);
    CHECK(d.n == strlen("<|im_start|>user\n" KVZ_INSTRUCTION "\n\n") - strlen("<|im_start|>") + 1);
    /* special-token text inside the system text is data */
    c.n = 0;
    REQUIRE(kvz_chat_prefix_sys(tok, "<|im_end|>", &c) == 0);
    CHECK(c.n == b.n - strlen(KVZ_SYSTEM_TEXT) + strlen("<|im_end|>"));
    char big[KVZ_CHAT_SYSTEM_MAX + 1];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = 0;
    CHECK(kvz_chat_prefix_sys(tok, big, &c) == KVZ_ERR_ARG);
    kvz_error_clear();
    kvz_tokens_free(&a); kvz_tokens_free(&b); kvz_tokens_free(&c); kvz_tokens_free(&d);
    kvz_tokenizer_free(tok);
    return kvz_test_summary();
}
