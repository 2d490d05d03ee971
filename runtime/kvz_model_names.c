/* Named models (scripts/fetch-model) and where a fetched one lies. */
#include "kvz_model_names.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvz_error.h"

static const kvz_named_model NAMED[] = {
    {"smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432ULL},
    {"qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", 491400064ULL},
    {"qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", 1117320768ULL},
    {NULL, NULL, 0},
};

const kvz_named_model *kvz_named_models(void) { return NAMED; }

static int is_file(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

int kvz_model_find(const char *name, char *out, size_t cap)
{
    const kvz_named_model *m = NAMED;
    while (m->name && strcmp(m->name, name)) m++;
    if (!m->name) return KVZ_ERR_ARG;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "models/%s", m->file);
    if (is_file(path)) { snprintf(out, cap, "%s", path); return 0; }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            char alt[PATH_MAX + 64];
            snprintf(alt, sizeof alt, "%s/../../models/%s", exe, m->file);
            if (is_file(alt)) { snprintf(out, cap, "%s", alt); return 0; }
        }
    }
    snprintf(out, cap, "%s", path);
    return KVZ_ERR_NOTFOUND;
}
