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
 *
 * Verified token-for-token against HF `tokenizers` 0.23 (tests/golden/
 * tokenizer_smollm2.tsv, made by scripts/golden/gen_tokenizer_golden.py), and
 * the gpt2 / smollm / qwen2 splits piece-for-piece (tests/golden/pretok_splits.tsv).
 * Character classes (\p{L}, \p{N}, \s) follow Unicode 16.0 as that reference
 * does (runtime/kvz_unicode_tables.h, scripts/gen_unicode_tables.py).
 *
 * Bytes that are not valid UTF-8 (stray continuation bytes, overlong forms,
 * surrogates, truncated sequences, > U+10FFFF) have no HF reference (HF takes
 * only valid strings). Rule here: each such byte is one character of class
 * "other" (neither letter, number nor space), so it joins a punctuation run in
 * the split regex and reaches BPE as its byte-level symbol.
 *
 * Round trip: concatenating kvz_tokenizer_decode() of the ids gives back the
 * input bytes exactly, except bytes whose byte-level symbol is missing from the
 * vocabulary: those are dropped (their neighbours then merge as if adjacent),
 * exactly as HF's BPE does without an unk token. SmolLM2 lacks 21 such bytes:
 * 0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1 0xF1 0xF2 0xF5..0xFF (control
 * characters, bytes never seen in UTF-8, and lead bytes of planes 4..11).
 * kvz_tokenizer_byte_token() tells which.
 *
 * Known gap: the HF Qwen2 tokenizer applies NFC normalisation before splitting;
 * this one does not (text already in NFC, the common case, is unaffected), and
 * its case-insensitive contractions fold ASCII only.
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
 * Byte-level fallback for models without a vocabulary (synthetic weights): id b
 * is raw byte b (0..255); "<|im_start|>" is id 256 and "<|im_end|>" id 257 (also
 * the EOS) when @p n_vocab > 257, so the ChatML layout works; ids from 258 (or 256)
 * up to n_vocab-1 are empty pieces that encoding never produces and that decode
 * to no bytes. No merges: every byte of the text becomes one token.
 * @return 0; KVZ_ERR_ARG (n_vocab < 256); KVZ_ERR_NOMEM.
 */
int kvz_tokenizer_bytes(int32_t n_vocab, kvz_tokenizer **out);

/**
 * Build from vocabulary arrays directly (what kvz_tokenizer_from_gguf does after
 * reading the GGUF; also for tests with a hand-made vocabulary).
 * @param tokens   n_vocab pieces in byte-level form (e.g. "\xC4\xA0the" for " the");
 *                 special tokens as their literal text. Copied.
 * @param types    n_vocab token types (1 normal, 3 control, 4 user-defined, ...),
 *                 or NULL for all normal. Types 3 and 4 are special tokens.
 * @param merges   n_merges "left right" strings, rank = index. Copied. Merges
 *                 whose parts or result are not in the vocabulary are ignored.
 * @param pre      pre-tokenizer name: "smollm", "qwen2", "gpt2"/"gpt-2"/"default"
 *                 (NULL = "default").
 * @param bos,eos  ids or -1.
 * @return 0; KVZ_ERR_ARG (no tokens), KVZ_ERR_UNSUPPORTED (pre-tokenizer),
 *   KVZ_ERR_FORMAT (a merge without a space), KVZ_ERR_NOMEM.
 */
int kvz_tokenizer_from_vocab(const kvz_str *tokens, const int32_t *types, uint64_t n_vocab,
                             const kvz_str *merges, uint64_t n_merges, const char *pre,
                             int32_t bos, int32_t eos, kvz_tokenizer **out);

/**
 * Encode @p len bytes of @p text (need not be NUL-terminated; may hold NULs),
 * appending ids to @p out (on error, @p out may hold a partial result). Without
 * KVZ_TOK_SPECIAL, special-token strings in the text are tokenized as ordinary
 * text (use that for untrusted documents). Bytes that are not valid UTF-8 are
 * encoded as their byte-level tokens (see the file comment). No BOS is added.
 * Cost: O(len log len); about 25 MB/s (10M tokens/s) on one core.
 * @return 0 or KVZ_ERR_NOMEM.
 */
int kvz_tokenizer_encode(const kvz_tokenizer *t, const char *text, size_t len, int flags,
                         kvz_tokens *out);

/**
 * Pre-tokenize only (tests, debugging): the pieces BPE would see, as end byte
 * offsets into @p text (a special token, with KVZ_TOK_SPECIAL, is one piece).
 * Writes min(count, @p cap) offsets to @p ends (may be NULL with cap 0) and the
 * full count to @p n_pieces.
 * @return 0.
 */
int kvz_tokenizer_pretokenize(const kvz_tokenizer *t, const char *text, size_t len, int flags,
                              size_t *ends, size_t cap, size_t *n_pieces);

/**
 * The raw bytes token @p id stands for (byte-level map undone), written to @p buf;
 * special tokens give their literal text. A token may hold part of a UTF-8
 * character: concatenate the bytes of consecutive tokens before printing.
 * @return number of bytes (may exceed @p cap: then only cap were written), or
 *   KVZ_ERR_ARG for an id out of range.
 */
int kvz_tokenizer_decode(const kvz_tokenizer *t, int32_t id, char *buf, size_t cap);

int32_t kvz_tokenizer_n_vocab(const kvz_tokenizer *t);
/** Id of the byte-level token for raw byte @p byte, or -1 when the vocabulary
 *  lacks it (such bytes are dropped by kvz_tokenizer_encode). */
int32_t kvz_tokenizer_byte_token(const kvz_tokenizer *t, uint8_t byte);
/** Id of a vocabulary entry by its exact piece string, or -1. */
int32_t kvz_tokenizer_find(const kvz_tokenizer *t, const char *piece);
int32_t kvz_tokenizer_bos(const kvz_tokenizer *t);     /**< -1 if none */
int32_t kvz_tokenizer_eos(const kvz_tokenizer *t);     /**< -1 if none */
/** GGUF tokenizer.chat_template (Jinja source, owned by the tokenizer), or NULL when the
 *  model has none (and for kvz_tokenizer_bytes / kvz_tokenizer_from_vocab). */
const char *kvz_tokenizer_chat_template(const kvz_tokenizer *t);
/** 1 if @p id is a control / special token (not printed in answers). */
int kvz_tokenizer_is_special(const kvz_tokenizer *t, int32_t id);

#ifdef __cplusplus
}
#endif
#endif
