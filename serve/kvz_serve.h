/* kvz_serve: the OpenAI-compatible HTTP query server behind kvzip-serve.
 *
 * Lives in serve/ (not api/): it is an application over the public library
 * (include/kvzip.h only, no internal headers), with its own dependencies
 * (libmicrohttpd, jansson) that libkvzip must not pull in. cli/kvzip-serve.c is
 * a thin main: flags -> kvz_serve_opts -> kvz_serve_run.
 *
 * Threads: libmicrohttpd runs one thread per connection (parse, validate, queue,
 * wait, write); a fixed pool of --workers threads takes jobs from one bounded FIFO
 * queue and runs them, each on its own kvzip_session (the CPU runs sessions
 * truly in parallel). With --max-batch N > 1 the workers only open each job's
 * session (LRU or store) and submit it to one kvzip_batch (at most N at once, the
 * rest wait in the queue); one scheduler thread steps the batch, the token
 * callbacks stream from it and the done callback finishes the job. */
#ifndef KVZ_SERVE_H
#define KVZ_SERVE_H

#include <stddef.h>
#include <stdint.h>

#include "kvzip.h"

typedef struct kvz_serve_opts {
    const char *host;          /* bind address (default 127.0.0.1) */
    int port;                  /* 0 = any free port (printed on stderr) */
    int workers;               /* worker threads = sessions at once (default 2) */
    int max_queue;             /* queued requests beyond the workers; more -> 503 */
    int max_batch;             /* > 1: continuous batching of up to this many requests (kvzip_batch) */
    size_t max_body;           /* request body bytes; more -> 413 */
    int max_tokens_limit;      /* largest max_tokens a request may ask for */
    int default_max_tokens;    /* when a request gives none */
    int max_docs;              /* documents per request */
    int32_t budget;            /* LongFlow output cache slots (kvzip_session_opts.budget) */
    double timeout_s;          /* per request, queue wait + generation; 0 = none */
    const char *api_key;       /* non-NULL: require "Authorization: Bearer KEY" */
    const char *model_name;    /* id reported by /v1/models */
    uint64_t cache_mem;        /* bytes of idle decoded sessions kept for reuse; 0 = none */
} kvz_serve_opts;

void kvz_serve_defaults(kvz_serve_opts *o);

/* Serve until SIGINT/SIGTERM. @p m and @p s stay owned by the caller. Prints one
 * "listening on http://HOST:PORT" line on stderr once ready. Returns 0 after a clean
 * shutdown, a negative KVZIP_ERR_* (KVZIP_ERR_IO: cannot bind) otherwise. */
int kvz_serve_run(kvzip_model *m, kvzip_store *s, const kvz_serve_opts *o);

#endif
