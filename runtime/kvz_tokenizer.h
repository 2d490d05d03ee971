/**
 * @file kvz_tokenizer.h
 * @brief Byte-level BPE tokenizer built from a GGUF's tokenizer.ggml.* metadata.
 *
 * Supports `tokenizer.ggml.model = "gpt2"` vocabularies with pre-tokenizers
 * `smollm` (each digit alone, then the GPT-2 split regex) and `qwen2` (the
 * Qwen2 regex: \p{N} single digits, case-insensitive contractions, ...), plus the
 * GPT-2 default. Special (control / user-defined) tokens are matched literally
 * first when KVZ_TOK_SPECIAL is given. A tokenizer is immutable after creation
 * and safe to use from many threads.
 */
#ifndef KVZ_TOKENIZER_H
#define KVZ_TOKENIZER_H

#include <stdint.h>
#include <stddef.h>

#include "kvz_gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvz_tokenizer kvz_tokenizer;

/** Growable token vector. Zero-initialise, then kvz_tokens_free(). */
typedef struct kvz_tokens {
    int32_t *ids;
    size_t n, cap;
} kvz_tokens;

int kvz_tokens_push(kvz_tokens *t, int32_t id);        /**< 0 or KVZ_ERR_NOMEM */
void kvz_tokens_free(kvz_tokens *t);

enum {
    KVZ_TOK_SPECIAL = 1, /**< match special-token strings (e.g. "<|im_start|>") literally */
};

/**
 * Build from GGUF metadata (tokens, merges, token_type, pre, bos/eos ids).
 * Copies what it needs: the GGUF may be closed afterwards.
 * @return 0, KVZ_ERR_NOTFOUND (missing key), KVZ_ERR_UNSUPPORTED (model type or
 *   pre-tokenizer), KVZ_ERR_FORMAT, KVZ_ERR_NOMEM.
 */
int kvz_tokenizer_from_gguf(const kvz_gguf *g, kvz_tokenizer **out);
void kvz_tokenizer_free(kvz_tokenizer *t);

/**
 * Encode @p len bytes of @p text, appending ids to @p out. Bytes that are not
 * valid UTF-8 are encoded as their byte-level tokens (as HF does).
 * @return 0 or KVZ_ERR_NOMEM.
 */
int kvz_tokenizer_encode(const kvz_tokenizer *t, const char *text, size_t len, int flags,
                         kvz_tokens *out);

/**
 * The raw bytes token @p id stands for (byte-level map undone), written to @p buf.
 * @return number of bytes (may exceed @p cap: then only cap were written), or
 *   KVZ_ERR_ARG for an id out of range.
 */
int kvz_tokenizer_decode(const kvz_tokenizer *t, int32_t id, char *buf, size_t cap);

int32_t kvz_tokenizer_n_vocab(const kvz_tokenizer *t);
/** Id of a vocabulary entry by its exact piece string, or -1. */
int32_t kvz_tokenizer_find(const kvz_tokenizer *t, const char *piece);
int32_t kvz_tokenizer_bos(const kvz_tokenizer *t);     /**< -1 if none */
int32_t kvz_tokenizer_eos(const kvz_tokenizer *t);     /**< -1 if none */
/** 1 if @p id is a control / special token (not printed in answers). */
int kvz_tokenizer_is_special(const kvz_tokenizer *t, int32_t id);

#ifdef __cplusplus
}
#endif
#endif
