#include "kvz_error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char g_detail[512];

const char *kvz_strerror(int err)
{
    switch (err) {
    case KVZ_OK: return "success";
    case KVZ_ERR_NOMEM: return "out of memory";
    case KVZ_ERR_IO: return "I/O error";
    case KVZ_ERR_FORMAT: return "corrupt or malformed data";
    case KVZ_ERR_TRUNCATED: return "truncated data";
    case KVZ_ERR_UNSUPPORTED: return "unsupported";
    case KVZ_ERR_ARG: return "invalid argument";
    case KVZ_ERR_NOTFOUND: return "not found";
    case KVZ_ERR_CHECKSUM: return "checksum mismatch";
    case KVZ_ERR_MODEL: return "made by another model";
    case KVZ_ERR_VERSION: return "unsupported format version";
    case KVZ_ERR_LMDB: return "LMDB error";
    case KVZ_ERR_ZSTD: return "zstd error";
    case KVZ_ERR_CUDA: return "CUDA error";
    case KVZ_ERR_FULL: return "store is full";
    case KVZ_ERR_CONTEXT: return "input too long";
    case KVZ_ERR_EMPTY: return "empty input";
    case KVZ_ERR_ENCODING: return "not UTF-8 text";
    case KVZ_ERR_BUSY: return "busy";
    case KVZ_ERR_NODEV: return "no GPU available";
    case KVZ_ERR_INTERNAL: return "internal error";
    default: return "unknown error";
    }
}

int kvz_error_set(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_detail, sizeof g_detail, fmt, ap);
    va_end(ap);
    return err;
}

const char *kvz_error_detail(void) { return g_detail; }

void kvz_error_clear(void) { g_detail[0] = '\0'; }
