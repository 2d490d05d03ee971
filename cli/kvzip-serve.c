/* kvzip-serve: OpenAI-compatible HTTP server answering from stored KVzip caches.
 * A thin main: flags -> model + store (public API) -> serve/kvz_serve.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli_util.h"
#include "kvz_serve.h"
#include "kvzip.h"

static void usage(const kvz_serve_opts *d)
{
    printf(
        "usage: kvzip-serve [options]\n"
        "\n"
        "OpenAI-compatible HTTP server: POST /v1/chat/completions answers the last user\n"
        "message from the stored documents named in \"documents\" (or, without them, as a\n"
        "plain chat); GET /v1/models, /v1/documents, /health, /metrics. docs/SERVER.md.\n"
        "\n"
        "  --model PATH         GGUF model (default: $KVZ_MODEL or %s)\n"
        "  --device D           cpu, cuda or auto (default auto)\n"
        "  --threads N          CPU threads per forward pass (default: all cores)\n"
        "  --store DIR          store folder, opened read-only (default: $KVZ_STORE or ./%s);\n"
        "                       documents ingested meanwhile are seen by the next request\n"
        "  --host ADDR          IPv4 address to bind (default %s)\n"
        "  --port N             TCP port (default %d; 0 = any free port, printed on stderr)\n"
        "  --workers N          requests answered at once, one session each (default %d)\n"
        "  --max-queue N        requests waiting beyond those; more get 503 + Retry-After (default %d)\n"
        "  --max-batch N        reserved for batched GPU decoding; only 1 is supported\n"
        "  --max-body BYTES     request body limit; larger gets 413 (default %zu)\n"
        "  --max-tokens-limit N largest max_tokens a request may ask (default %d)\n"
        "  --max-tokens N       max_tokens when a request gives none (default %d)\n"
        "  --max-docs N         documents per request (default %d)\n"
        "  --budget B           LongFlow output-cache slots per layer (default %d; 0 = unbounded)\n"
        "  --cache-mem BYTES    keep idle decoded sessions (one whole document + the same decoding\n"
        "                       options) up to this many K/V bytes, least recently used out;\n"
        "                       a re-ingested document is not reused (default %llu; 0 = none)\n"
        "  --timeout S          per-request limit in seconds, queue + generation; 504 after\n"
        "                       (default %.0f; 0 = none)\n"
        "  --api-key KEY        require \"Authorization: Bearer KEY\" on /v1/* (default: $KVZ_API_KEY,\n"
        "                       else no key)\n"
        "  --model-name NAME    model id in responses and /v1/models (default: the GGUF's name)\n"
        "  -h, --help           this text\n"
        "\n"
        "Stops on SIGINT/SIGTERM. Exit status: 0 after a clean stop, 2 usage, 4 model problem,\n"
        "5 store problem, 6 store or model not found, 1 other errors (cannot bind).\n",
        KVZ_DEFAULT_MODEL, KVZ_DEFAULT_STORE, d->host, d->port, d->workers, d->max_queue, d->max_body,
        d->max_tokens_limit, d->default_max_tokens, d->max_docs, d->budget, (unsigned long long)d->cache_mem, d->timeout_s);
}

int main(int argc, char **argv)
{
    cli_init("kvzip-serve", argv);
    kvz_serve_opts o;
    kvz_serve_defaults(&o);
    const char *model_flag = NULL, *store_flag = NULL;
    int32_t device = KVZIP_DEVICE_AUTO;
    long threads = 0;
    o.api_key = getenv("KVZ_API_KEY");
    if (o.api_key && !o.api_key[0]) o.api_key = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(&o); return 0; }
        else if (!strcmp(a, "--model")) model_flag = cli_value(argc, argv, &i);
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
        else cli_usage_error("unknown option '%s'", a);
    }
    if (o.max_batch != 1)
        cli_usage_error("--max-batch %d: batched decoding is not implemented (CPU workers run one "
                        "request each); use 1", o.max_batch);
    if (o.budget > 0 && o.budget < 16) cli_usage_error("--budget must be 0 (unbounded) or at least 16");
    if (o.default_max_tokens > o.max_tokens_limit)
        cli_usage_error("--max-tokens %d is over --max-tokens-limit %d", o.default_max_tokens, o.max_tokens_limit);
    if (o.api_key && !o.api_key[0]) cli_usage_error("--api-key is empty");

    const char *model_path = cli_model_path(model_flag);
    struct stat mst;
    if (stat(model_path, &mst)) {
        fprintf(stderr, "kvzip-serve: error: model file %s not found (pass --model or set KVZ_MODEL)\n", model_path);
        return EXIT_NOTFOUND;
    }
    kvzip_model *m;
    /* a long-lived process: documents are uploaded straight from the pinned store map (CUDA) */
    kvzip_model_opts mo = {.device = device, .n_threads = (int32_t)threads, .pin_store_map = 1};
    int rc = kvzip_model_open(model_path, &mo, &m);
    if (rc) {
        cli_error(rc, "cannot load model %s", model_path);
        return cli_model_exit(rc);
    }
    kvzip_model_info mi;
    kvzip_model_info_get(m, &mi);
    if (!o.model_name || !strcmp(o.model_name, "kvzip")) o.model_name = mi.name[0] ? mi.name : "kvzip";
    const char *sp = cli_store_path(store_flag);
    kvzip_store *st;
    if ((rc = kvzip_store_open(sp, KVZIP_STORE_READONLY, m, &st))) {
        cli_error(rc, "cannot open store %s", sp);
        kvzip_model_close(m);
        return cli_store_exit(rc);
    }
    rc = kvz_serve_run(m, st, &o);
    if (rc == KVZIP_ERR_ARG) fprintf(stderr, "kvzip-serve: error: --host %s is not an IPv4 address\n", o.host);
    else if (rc) fprintf(stderr, "kvzip-serve: error: cannot listen on %s:%d (%s)\n", o.host, o.port,
                         kvzip_strerror(rc));
    kvzip_store_close(st);
    kvzip_model_close(m);
    return rc == KVZIP_ERR_ARG ? EXIT_USAGE : rc ? 1 : 0;
}
