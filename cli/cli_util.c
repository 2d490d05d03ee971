#include "cli_util.h"
#include "kvz_model_names.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvz_error.h"
#include "kvz_escape.h"
#include "kvz_text.h"

const char *cli_prog = "kvzip";

void cli_init(const char *prog, char **argv)
{
    cli_prog = prog;
    /* Past a file-size limit (ulimit -f) a write should fail with EFBIG, which the store
     * reports as a full store with the transaction rolled back, not kill the process. */
    signal(SIGXFSZ, SIG_IGN);
    if (getenv("OMP_WAIT_POLICY")) return;
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv); /* returns only on failure: then run as we are */
}

void cli_error(int rc, const char *fmt, ...)
{
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    kvz_escape_error(stderr, cli_prog, rc, what);
}

void cli_error_detail(int rc)
{
    fprintf(stderr, "%s: error: %s (%s)\n", cli_prog, cli_escape(kvz_error_detail()), kvz_strerror(rc));
    kvz_error_clear();
}

void cli_usage_error(const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* the message quotes arguments as given: escaped, so it stays one line */
    fprintf(stderr, "%s: %s (see %s --help)\n", cli_prog, cli_escape(msg), cli_prog);
    exit(EXIT_USAGE);
}

int cli_exit_code(int rc)
{
    switch (rc) {
    case KVZ_OK: return EXIT_OK;
    case KVZ_ERR_ARG: return EXIT_USAGE;
    case KVZ_ERR_EMPTY: case KVZ_ERR_ENCODING: case KVZ_ERR_CONTEXT: return EXIT_INPUT;
    case KVZ_ERR_MODEL: case KVZ_ERR_UNSUPPORTED: return EXIT_MODEL;
    case KVZ_ERR_LMDB: case KVZ_ERR_FULL: case KVZ_ERR_CHECKSUM: case KVZ_ERR_VERSION:
    case KVZ_ERR_BUSY: return EXIT_STORE;
    case KVZ_ERR_NOTFOUND: return EXIT_NOTFOUND;
    default: return EXIT_FAIL;
    }
}

int cli_model_exit(int rc)
{
    if (rc == KVZ_ERR_NOTFOUND) return EXIT_NOTFOUND;
    if (rc == KVZ_ERR_NOMEM || rc == KVZ_ERR_IO) return EXIT_FAIL;
    return EXIT_MODEL;
}

int cli_store_exit(int rc)
{
    if (rc == KVZ_ERR_NOTFOUND) return EXIT_NOTFOUND;
    if (rc == KVZ_ERR_MODEL) return EXIT_MODEL;
    if (rc == KVZ_ERR_NOMEM) return EXIT_FAIL;
    return EXIT_STORE;
}

long cli_parse_long(const char *flag, const char *s, long lo, long hi)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        cli_usage_error("%s expects an integer in [%ld, %ld], got '%s'", flag, lo, hi, s);
    return v;
}

double cli_parse_double(const char *flag, const char *s, double lo, double hi)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        cli_usage_error("%s expects a number in [%g, %g], got '%s'", flag, lo, hi, s);
    return v;
}

int cli_arg_kind(const char *a, int *ended)
{
    if (*ended) return 0;
    if (!strcmp(a, "--")) {
        *ended = 1;
        return -1;
    }
    return a[0] == '-' && a[1] != 0;
}

const char *cli_value(int argc, char **argv, int *i)
{
    if (*i + 1 >= argc) cli_usage_error("%s needs a value", argv[*i]);
    return argv[++*i];
}

static int file_exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

const char *cli_model_path(const char *flag_value)
{
    if (flag_value) { /* --model NAME: a model fetched by scripts/fetch-model (kvz_model_names.h) */
        static char named[PATH_MAX];
        if (!file_exists(flag_value) && kvz_model_find(flag_value, named, sizeof named) != KVZ_ERR_ARG)
            return named;
        return flag_value;
    }
    const char *env = getenv("KVZ_MODEL");
    if (env && *env) return env;
    if (file_exists(KVZ_DEFAULT_MODEL)) return KVZ_DEFAULT_MODEL;
    /* installed next to the build tree: <root>/build/bin/tool -> <root>/models/... */
    static char path[PATH_MAX];
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            snprintf(path, sizeof path, "%.*s/../../%s", (int)(sizeof path - 64), exe,
                     KVZ_DEFAULT_MODEL);
            if (file_exists(path)) return path;
        }
    }
    return KVZ_DEFAULT_MODEL;
}

const char *cli_store_path(const char *flag_value)
{
    if (flag_value) return flag_value;
    const char *env = getenv("KVZ_STORE");
    return env && *env ? env : KVZ_DEFAULT_STORE;
}

int32_t cli_parse_device(const char *s)
{
    if (!strcmp(s, "cpu")) return KVZ_DEVICE_CPU;
    if (!strcmp(s, "cuda")) return KVZ_DEVICE_CUDA;
    if (!strcmp(s, "auto")) return KVZ_DEVICE_AUTO;
    cli_usage_error("--device expects cpu, cuda or auto, got '%s'", s);
}

int cli_open_regular(const char *path, struct stat *st)
{
    return kvz_text_open_regular(path, st);
}

int cli_load_model(const char *path, const char *synthetic, int32_t device, int32_t threads,
                   kvz_model **out)
{
    kvz_model_opts o = {.device = device, .n_threads = threads};
    int rc;
    if (synthetic) {
        rc = kvz_model_synthetic(synthetic, &o, out);
        if (rc) cli_error(rc, "cannot build synthetic model '%s'", synthetic);
    } else {
        if (!file_exists(path)) {
            fprintf(stderr, "%s: error: model file %s not found (run scripts/setup, or pass "
                    "--model / set KVZ_MODEL)\n", cli_prog, cli_escape(path));
            return KVZ_ERR_NOTFOUND;
        }
        /* a FIFO, device or folder: say so instead of blocking in open() or mapping it */
        struct stat st;
        int fd = cli_open_regular(path, &st);
        if (fd < 0) {
            cli_error(fd, "cannot load model %s", path);
            return fd;
        }
        close(fd);
        rc = kvz_model_load(path, &o, out);
        if (rc) cli_error(rc, "cannot load model %s", path);
    }
    return rc;
}

int cli_is_text(const char *s, size_t len, size_t *bad)
{
    return kvz_text_valid(s, len, bad);
}

int cli_read_text(const char *path, size_t max_bytes, char **out, size_t *len)
{
    return kvz_text_read(path, max_bytes, out, len);
}

void cli_json_str(FILE *f, const char *s, size_t len) { kvz_escape_json(f, s, len); }

const char *cli_escape(const char *s) { return kvz_escape(s); }
