/**
 * @file kvz_model_names.h
 * @brief Named models fetched by scripts/fetch-model into models/ (`--model NAME`).
 */
#ifndef KVZ_MODEL_NAMES_H
#define KVZ_MODEL_NAMES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvz_named_model {
    const char *name;   /**< "qwen2.5-coder-1.5b" */
    const char *file;   /**< GGUF file name under models/ */
    uint64_t bytes;     /**< file size */
} kvz_named_model;

/** The known models (same list as scripts/fetch-model), NULL-name terminated. */
const kvz_named_model *kvz_named_models(void);

/**
 * Path of the fetched model @p name: models/<file> relative to the working
 * directory, else relative to the running executable (<root>/build/bin/tool ->
 * <root>/models/<file>). Writes the first existing path to @p out.
 * @return 0 found; KVZ_ERR_NOTFOUND (a known name, not fetched: @p out gets
 *   models/<file>); KVZ_ERR_ARG (not a known name; @p out untouched).
 */
int kvz_model_find(const char *name, char *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
