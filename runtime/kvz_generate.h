/**
 * @file kvz_generate.h
 * @brief Sampling, the ChatML prompt layout shared by ingest and query, and the
 *        decode loop.
 */
#ifndef KVZ_GENERATE_H
#define KVZ_GENERATE_H

#include <stdint.h>

#include "kvz_model.h"
#include "kvz_tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/** System text and instruction line of the cached prefix (DESIGN §3). */
#define KVZ_SYSTEM_TEXT "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#define KVZ_INSTRUCTION "Given the context, answer to the following question or request without explanation."

/**
 * Tokens of the system prefix kept in every cache:
 * "<|im_start|>system\n" SYSTEM "<|im_end|>\n<|im_start|>user\n" INSTRUCTION "\n\n".
 * Appends to @p out. @return 0, KVZ_ERR_NOMEM.
 */
int kvz_chat_prefix(const kvz_tokenizer *tok, kvz_tokens *out);

/**
 * Tokens that follow the context for a question:
 * "\n\nQuestion: " QUESTION "<|im_end|>\n<|im_start|>assistant\n". Appends to @p out.
 */
int kvz_chat_question(const kvz_tokenizer *tok, const char *question, kvz_tokens *out);

/** The assistant-turn postfix "<|im_end|>\n<|im_start|>assistant\n". Appends to @p out. */
int kvz_chat_postfix(const kvz_tokenizer *tok, kvz_tokens *out);

/** 1 if @p id ends an answer (EOS or <|im_end|>). */
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
