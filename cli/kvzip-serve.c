/* kvzip-serve: OpenAI-compatible HTTP server answering from stored KVzip caches.
 * A thin main: flags -> model + store (public API) -> serve/kvz_serve.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli_util.h"
#include "kvz_serve.h"
#include "kvzip.h"
#include "kvzip-serve.help.h" /* cli_help: generated from cli/help/kvzip-serve.txt */

static void usage(void) { fputs(cli_help, stdout); } /* cli/help/kvzip-serve.txt */

int main(int argc, char **argv)
{
    cli_init("kvzip-serve", argv);
    kvz_serve_opts o;
    kvz_serve_defaults(&o);
    const char *model_flag = NULL, *store_flag = NULL, *synth_flag = NULL;
    int32_t device = KVZIP_DEVICE_AUTO;
    long threads = 0;
    int warmup = 1;
    o.api_key = getenv("KVZ_API_KEY");
    o.max_batch = 0; /* not given: by device, below */
    if (o.api_key && !o.api_key[0]) o.api_key = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        else if (!strcmp(a, "--model")) model_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--synthetic")) synth_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--device")) device = cli_parse_device(cli_value(argc, argv, &i));
        else if (!strcmp(a, "--threads")) threads = cli_parse_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "--store")) store_flag = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--host")) o.host = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--port")) o.port = (int)cli_parse_long(a, cli_value(argc, argv, &i), 0, 65535);
        else if (!strcmp(a, "--workers")) o.workers = (int)cli_parse_long(a, cli_value(argc, argv, &i), 1, 256);
        else if (!strcmp(a, "--max-queue")) o.max_queue = (int)cli_parse_long(a, cli_value(argc, argv, &i), 1, 100000);
        else if (!strcmp(a, "--max-batch")) o.max_batch = (int)cli_parse_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "--max-body")) o.max_body = (size_t)cli_parse_long(a, cli_value(argc, argv, &i), 1024, 1L << 30);
        else if (!strcmp(a, "--max-tokens-limit")) o.max_tokens_limit = (int)cli_parse_long(a, cli_value(argc, argv, &i), 1, 1 << 20);
        else if (!strcmp(a, "--max-tokens")) o.default_max_tokens = (int)cli_parse_long(a, cli_value(argc, argv, &i), 1, 1 << 20);
        else if (!strcmp(a, "--max-docs")) o.max_docs = (int)cli_parse_long(a, cli_value(argc, argv, &i), 1, 256);
        else if (!strcmp(a, "--budget")) o.budget = (int32_t)cli_parse_long(a, cli_value(argc, argv, &i), 0, 1 << 20);
        else if (!strcmp(a, "--cache-mem")) o.cache_mem = (uint64_t)cli_parse_long(a, cli_value(argc, argv, &i), 0, 1L << 40);
        else if (!strcmp(a, "--timeout")) o.timeout_s = cli_parse_double(a, cli_value(argc, argv, &i), 0, 86400);
        else if (!strcmp(a, "--api-key")) o.api_key = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--model-name")) o.model_name = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--no-warmup")) warmup = 0;
        else cli_usage_error("unknown option '%s'", a);
    }
    if (model_flag && synth_flag) cli_usage_error("--model and --synthetic exclude each other");
    if (o.budget > 0 && o.budget < 16) cli_usage_error("--budget must be 0 (unbounded) or at least 16");
    if (o.default_max_tokens > o.max_tokens_limit)
        cli_usage_error("--max-tokens %d is over --max-tokens-limit %d", o.default_max_tokens, o.max_tokens_limit);
    if (o.api_key && !o.api_key[0]) cli_usage_error("--api-key is empty");

    const char *model_path = cli_model_path(model_flag);
    struct stat mst;
    if (!synth_flag && stat(model_path, &mst)) {
        fprintf(stderr, "kvzip-serve: error: model file %s not found (pass --model or set KVZ_MODEL)\n", model_path);
        return EXIT_NOTFOUND;
    }
    kvzip_model *m;
    /* a long-lived process: documents are uploaded straight from the pinned store map (CUDA) */
    kvzip_model_opts mo = {.device = device, .n_threads = (int32_t)threads, .pin_store_map = 1,
                           .synthetic = synth_flag};
    int rc = kvzip_model_open(model_path, &mo, &m);
    if (rc) {
        if (synth_flag) cli_error(rc, "cannot build synthetic model '%s'", synth_flag);
        else cli_error(rc, "cannot load model %s", model_path);
        return cli_model_exit(rc);
    }
    kvzip_model_info mi;
    kvzip_model_info_get(m, &mi);
    /* continuous batching pays on the GPU (one pass for all); the CPU default stays one
     * request per worker */
    if (!o.max_batch) o.max_batch = mi.device == KVZIP_DEVICE_CUDA ? 32 : 1;
    if (!o.model_name || !strcmp(o.model_name, "kvzip")) o.model_name = mi.name[0] ? mi.name : "kvzip";
    const char *sp = cli_store_path(store_flag);
    kvzip_store *st;
    if ((rc = kvzip_store_open(sp, KVZIP_STORE_READONLY, m, &st))) {
        cli_error(rc, "cannot open store %s", sp);
        kvzip_model_close(m);
        return cli_store_exit(rc);
    }
    if (warmup) { /* CUDA: load staging sized before the first request, not on its path */
        char wid[1024];
        double ws = 0;
        int wr = kvzip_model_prepare(m, st, wid, sizeof wid, &ws);
        if (wr)
            fprintf(stderr, "kvzip-serve: warning: warm-up skipped: %s (%s)\n", kvzip_strerror(wr), kvzip_errdetail());
        else if (wid[0])
            fprintf(stderr, "kvzip-serve: warm-up: load staging sized for '%s', the longest stored document, in %.3f s\n",
                    wid, ws);
    }
    rc = kvz_serve_run(m, st, &o);
    if (rc == KVZIP_ERR_ARG) fprintf(stderr, "kvzip-serve: error: --host %s is not an IPv4 address\n", o.host);
    else if (rc) fprintf(stderr, "kvzip-serve: error: cannot listen on %s:%d (%s)\n", o.host, o.port,
                         kvzip_strerror(rc));
    kvzip_store_close(st);
    kvzip_model_close(m);
    return rc == KVZIP_ERR_ARG ? EXIT_USAGE : rc ? 1 : 0;
}
