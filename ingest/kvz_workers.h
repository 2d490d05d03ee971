/**
 * @file kvz_workers.h
 * @brief Scale-out drivers of an ingest run (docs/SCALE.md): marking a shard's
 *        store, the parent that hands a corpus to worker processes
 *        (kvz_dispatch.h), and the worker's loop over the documents it claims.
 *
 * The workers are processes of the calling program (kvz_workers_opts.exe) run
 * with the caller's arguments plus --device, [--threads], --claim-fd and
 * --worker-tag (kvz_dispatch_run); each ends by printing, as its last stdout
 * line, its summary: a flat JSON object whose integer fields "parts",
 * "ingested", "unchanged", "linked", "failed", "skipped", "tokens" and
 * "bytes_stored" the parent adds up (kvzip-ingest --json prints it).
 *
 * Library code: nothing prints; worker output reaches the caller line by line.
 */
#ifndef KVZ_WORKERS_H
#define KVZ_WORKERS_H

#include <stddef.h>
#include <stdint.h>

#include "kvz_batch.h"
#include "kvz_corpus.h"
#include "kvz_dispatch.h"
#include "kvz_model.h"
#include "kvz_shard.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Open (create) the store at @p path without a model and record shard @p sh
 * and the corpus listing (kvz_shard_record).
 * @param old  out, 128 bytes: the listing recorded by an earlier run when it
 *             differs from this one ("<16 hex> <n ids>"), else "".
 * @return 0; a kvz_store_open or kvz_shard_record error.
 */
int kvz_workers_mark_store(const char *path, const kvz_shard *sh, uint64_t corpus_hash, size_t n_ids,
                           char old[128]);

/**
 * Worker side: walk the parent's list in order, claim each document no other
 * worker has, read it (kvz_corpus_read_file: reported through @p rep, counted
 * there), tokenize it with @p m's tokenizer and add it to @p b. Near the end of
 * the list a CPU worker computes each document at once, so that it does not
 * claim the last ones ahead of idle workers.
 * @param n_taken  out: documents claimed.
 * @return 0; the error after which the store cannot take more (the loop stopped).
 */
int kvz_workers_take(kvz_batch *b, kvz_model *m, kvz_claims *claims, kvz_corpus *rep, size_t *n_taken);

/** A stderr line of worker @p w (on device @p device); @p claimed of @p n_docs handed out. */
typedef void (*kvz_workers_line_fn)(void *user, int w, const char *device, const char *line,
                                    uint64_t claimed, size_t n_docs);

typedef struct kvz_workers_opts {
    int n_workers;               /**< 1..KVZ_DISPATCH_MAX_WORKERS */
    int gpus;                    /**< 1: worker w runs on "cuda:w"; 0: every one on @p device */
    const char *device;          /**< --device of every worker when !gpus */
    int threads;                 /**< --threads of each worker (>= 1) */
    const char *exe;             /**< the worker program ("/proc/self/exe") */
    const char *const *argv;     /**< common worker arguments, NULL-terminated, argv[0] first */
    kvz_workers_line_fn on_line; /**< may be NULL */
    void *user;
} kvz_workers_opts;

/** One worker's outcome. */
typedef struct kvz_workers_one {
    char device[32];             /**< "cpu", "cuda:3", ... */
    kvz_dispatch_worker w;       /**< pid, exit code (-1: killed), signal, documents claimed */
    int summarized;              /**< it printed a summary line */
} kvz_workers_one;

/** What the workers did together (sums of their summary lines). */
typedef struct kvz_workers_result {
    size_t n_docs;               /**< documents handed out */
    int bad_workers;             /**< workers that exited nonzero or were killed */
    int64_t parts, ingested, unchanged, linked, failed, skipped, tokens;
    uint64_t bytes_stored;
    double seconds;
    kvz_workers_one *per;        /**< n_workers entries (kvz_workers_result_free) */
} kvz_workers_result;

/**
 * The common worker arguments of a parent command line (kvz_workers_opts.argv):
 * argv[0], then each option of @p forward (NULL-terminated names of options that
 * take a value) with its value, as the parent gave them before any "--", then
 * "--store" @p store and "--json". NULL-terminated; free the array (not its strings,
 * which are the caller's). NULL: out of memory.
 */
const char **kvz_workers_argv(int argc, char *const *argv, const char *const *forward, const char *store);

/**
 * Parent side: hand every usable document of @p c to the workers, longest
 * first, and wait for all of them; their stderr lines go to o->on_line, the
 * last stdout line of each is its summary.
 * @return 0 (look at r->bad_workers and r->per[].w.exit_code); a
 *         kvz_dispatch_run error (KVZ_ERR_IO: memfd, pipe, fork or exec
 *         failed; KVZ_ERR_ARG); KVZ_ERR_NOMEM. r->per is set in every case.
 */
int kvz_workers_run(const kvz_corpus *c, const kvz_workers_opts *o, kvz_workers_result *r);

void kvz_workers_result_free(kvz_workers_result *r);

#ifdef __cplusplus
}
#endif
#endif
