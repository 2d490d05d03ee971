/**
 * @file kvz_generate.h
 * @brief Sampling, the chat prompt layout (from the model's chat template) shared by
 *        ingest and query, and the decode loop.
 */
#ifndef KVZ_GENERATE_H
#define KVZ_GENERATE_H

#include <stdint.h>

#include "kvz_model.h"
#include "kvz_tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Chat layout (DESIGN §3). Every cache starts with a system prefix that ends with the
 * instruction line; the document follows; a question closes the user turn and opens
 * the assistant turn. The layout comes from the model's GGUF `tokenizer.chat_template`
 * (kvz_chat_template), recognised by its control tokens:
 *
 *   ChatML (SmolLM2, Qwen2.5, ...):
 *     prefix   "<|im_start|>system\n" SYSTEM "<|im_end|>\n<|im_start|>user\n" INSTRUCTION "\n\n"
 *     question "\n\nQuestion: " QUESTION "<|im_end|>\n<|im_start|>assistant\n"
 *   Llama-3:
 *     prefix   "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" SYSTEM "<|eot_id|>"
 *              "<|start_header_id|>user<|end_header_id|>\n\n" INSTRUCTION "\n\n"
 *     question "\n\nQuestion: " QUESTION "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
 *
 * SYSTEM is a parameter; its default is the family's own: the literal system text the
 * template inserts when the conversation has none (SmolLM2: KVZ_SYSTEM_TEXT; Qwen2.5:
 * "You are Qwen, created by Alibaba Cloud. ..."), none for Llama-3 (the system turn is
 * then left out, as its template does), and KVZ_SYSTEM_TEXT for a model without a
 * template (synthetic models, older GGUFs: ChatML as before). An empty SYSTEM leaves the
 * system turn out. A template that is neither layout falls back to ChatML.
 *
 * The stored caches depend on these tokens: for SmolLM2 the prefix is byte-identical to
 * the one every existing store and golden was made with (tests/fast/test_chat.c).
 */
#define KVZ_SYSTEM_TEXT "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#define KVZ_INSTRUCTION "Given the context, answer to the following question or request without explanation."
#define KVZ_CHAT_SYSTEM_MAX 1024   /**< bytes of system text, incl. NUL */

enum { KVZ_CHAT_CHATML = 0, KVZ_CHAT_LLAMA3 = 1 };

/** A recognised chat layout. */
typedef struct kvz_chat_tmpl {
    int32_t family;                   /**< KVZ_CHAT_* */
    char name[16];                    /**< "smollm", "qwen2.5", "chatml", "llama3" */
    char system[KVZ_CHAT_SYSTEM_MAX]; /**< the family's default system text ("" = none) */
} kvz_chat_tmpl;

/**
 * Recognise @p tok's chat template (kvz_tokenizer_chat_template). Never fails: an
 * absent or unknown template gives ChatML with KVZ_SYSTEM_TEXT ("chatml").
 */
void kvz_chat_template(const kvz_tokenizer *tok, kvz_chat_tmpl *out);
/** The same from the Jinja source @p jinja (NULL: no template). */
void kvz_chat_template_parse(const char *jinja, kvz_chat_tmpl *out);

/**
 * Tokens of the system prefix kept in every cache, with the default system text.
 * Appends to @p out. @return 0, KVZ_ERR_NOMEM.
 */
int kvz_chat_prefix(const kvz_tokenizer *tok, kvz_tokens *out);

/**
 * Same with system text @p system (NULL: the family's default; "": no system turn).
 * The system text is data: special-token strings in it are not parsed.
 * @return 0, KVZ_ERR_NOMEM, KVZ_ERR_ARG (@p system longer than KVZ_CHAT_SYSTEM_MAX - 1).
 */
int kvz_chat_prefix_sys(const kvz_tokenizer *tok, const char *system, kvz_tokens *out);

/** Tokens that follow the context for a question (see above). Appends to @p out. */
int kvz_chat_question(const kvz_tokenizer *tok, const char *question, kvz_tokens *out);

/** The assistant-turn postfix (ChatML "<|im_end|>\n<|im_start|>assistant\n"). Appends to @p out. */
int kvz_chat_postfix(const kvz_tokenizer *tok, kvz_tokens *out);

/** 1 if @p id ends an answer (EOS, <|im_end|>, <|endoftext|>, <|eot_id|>, <|end_of_text|>). */
int kvz_chat_is_stop(const kvz_tokenizer *tok, int32_t id);

typedef struct kvz_sampler {
    float temperature;   /**< <= 0: greedy (argmax, lowest id wins ties) */
    float top_p;         /**< nucleus mass in (0, 1]; 1 = off */
    uint64_t state;      /**< RNG state; seed with kvz_sampler_init */
} kvz_sampler;

void kvz_sampler_init(kvz_sampler *s, float temperature, float top_p, uint64_t seed);
/**
 * Pick a token from @p logits (n_vocab). @p work must hold 2*n_vocab floats for
 * top-p sampling (may be NULL for greedy). Deterministic for a given seed.
 */
int32_t kvz_sample(kvz_sampler *s, const float *logits, int32_t n_vocab, float *work);

typedef struct kvz_gen_opts {
    int32_t max_tokens;        /**< stop after this many generated tokens */
    kvz_sampler sampler;
    /** Called with each generated token (not the stop token); nonzero aborts. */
    int (*on_token)(void *ctx, int32_t id);
    void *ctx;
    int stop_on_eos;           /**< 1: stop on EOS / <|im_end|> (tokenizer needed) */
} kvz_gen_opts;

typedef struct kvz_gen_stats {
    int32_t n_prompt, n_gen;
    double prefill_s;          /**< prompt pass, i.e. time to first token */
    double decode_s;           /**< all later steps */
    int stopped;               /**< 1: stop token, 0: max_tokens */
} kvz_gen_stats;

/**
 * One answer's decode state, stepped by whoever runs the forward passes: kvz_generate
 * (one sequence, one pass per token) and the public library's batch scheduler (many
 * sequences, one kvz_forward_multi per step). Both sample, stop and count through the
 * functions below, so an answer is the same token for token on either route.
 */
typedef struct kvz_gen_seq {
    kvz_sampler sampler;       /**< this sequence's own sampler (seeded per answer) */
    const kvz_tokenizer *tok;  /**< for the stop tokens; NULL = never stop on one */
    int32_t max_tokens;        /**< generated tokens at most */
    int32_t n_gen;             /**< tokens generated so far (the stop token not counted) */
    int32_t pos;               /**< position of the next token fed to the model */
    int32_t stopped;           /**< 1: a stop token ended the answer */
} kvz_gen_seq;

/** Start a sequence whose prompt ends at position @p pos - 1 (opts: max_tokens,
 *  sampler, stop_on_eos; the callbacks are the caller's). */
void kvz_gen_seq_init(kvz_gen_seq *s, const kvz_gen_opts *opts, const kvz_tokenizer *tok, int32_t pos);

/**
 * Sample the next token from @p logits (n_vocab; @p work as kvz_sample).
 * @return 1 with *id set and counted in n_gen: a generated token, for the caller to
 *   emit; 0: the answer is over (a stop token: stopped = 1; or max_tokens reached
 *   before this call), nothing emitted.
 */
int kvz_gen_seq_sample(kvz_gen_seq *s, const float *logits, int32_t n_vocab, float *work, int32_t *id);

/** 1 when the sequence's next token is the argmax of its logits and nothing else of
 *  them is used (greedy sampler: temperature <= 0), so kvz_gen_seq_take(kvz_argmax(logits))
 *  is kvz_gen_seq_sample. */
int kvz_gen_seq_greedy(const kvz_gen_seq *s);

/** kvz_gen_seq_sample with the token already chosen (@p id: for a greedy sequence, the
 *  argmax of its logits, e.g. from kvz_forward_multi_top): the same stop and count rules. */
int kvz_gen_seq_take(kvz_gen_seq *s, int32_t id);

/** 1 when the token just emitted must be fed back (at s->pos, then pos++) for another
 *  step; 0 when max_tokens are generated. */
int kvz_gen_seq_more(const kvz_gen_seq *s);

/**
 * Run @p prompt at positions pos0.. then decode. Generated ids are appended to @p out
 * (may be NULL). @p logits_out, when not NULL, receives the logits of every decode
 * step (max_tokens, n_vocab) for tests.
 * @return 0 or any kvz_forward error.
 */
int kvz_generate(kvz_model *m, kvz_kv *kv, const int32_t *prompt, int32_t n_prompt,
                 int32_t pos0, const kvz_gen_opts *opts, kvz_tokens *out, float *logits_out,
                 kvz_gen_stats *stats);

/** Monotonic seconds. */
double kvz_now(void);

#ifdef __cplusplus
}
#endif
#endif
