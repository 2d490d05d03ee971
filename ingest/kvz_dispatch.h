/**
 * @file kvz_dispatch.h
 * @brief Several ingest workers on one host (kvzip-ingest --workers / --gpus):
 *        a parent hands documents out dynamically, longest first, to worker
 *        processes that all write into one store.
 *
 * Why processes (docs/SCALE.md): each worker owns one model and one device
 * for its lifetime (CUDA_VISIBLE_DEVICES narrowed to its GPU before CUDA
 * starts, its own OpenMP pool on the CPU); a crash or out-of-memory in one
 * worker does not take the others down; LMDB already serialises writers
 * across processes, and every document is one write transaction.
 *
 * Hand-out: the parent writes the ordered document list (longest file first)
 * and one claim word per document into a shared memory file (memfd) that the
 * workers inherit. A worker walks the list in order and takes document i with
 * an atomic compare-and-swap of claim word i from 0 to its worker number + 1,
 * so each document goes to exactly one worker, and a worker that finishes
 * early takes the next free one.
 *
 * Library code: nothing prints; worker output reaches the caller line by line
 * through a callback.
 */
#ifndef KVZ_DISPATCH_H
#define KVZ_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVZ_DISPATCH_MAX_WORKERS 256

/** One document of the list handed out. */
typedef struct kvz_dispatch_doc {
    const char *path;
    const char *id;
    int named;          /**< named on the command line (errors are not skipped) */
    uint64_t size;      /**< bytes: the hand-out order, largest first */
} kvz_dispatch_doc;

/** Worker-side view of the shared list (kvz_claims_open). */
typedef struct kvz_claims kvz_claims;

/** A line from worker @p w's stderr (@p is_stdout 0) or stdout (1), without newline. */
typedef void (*kvz_dispatch_line_fn)(void *user, int w, int is_stdout, const char *line);

typedef struct kvz_dispatch_opts {
    int n_workers;                  /**< 1..KVZ_DISPATCH_MAX_WORKERS */
    const char *exe;                /**< program to run (e.g. "/proc/self/exe") */
    const char *const *argv;        /**< common worker arguments, NULL-terminated (argv[0] first) */
    const char *const *device;      /**< per worker: value for --device ("cpu", "cuda:1") */
    int threads;                    /**< per worker --threads; 0 = not passed */
    kvz_dispatch_line_fn on_line;
    void *user;
} kvz_dispatch_opts;

/** Per-worker outcome. */
typedef struct kvz_dispatch_worker {
    int pid;
    int exit_code;     /**< exit status, or -1 when killed by a signal */
    int signal;        /**< the signal when killed */
    uint64_t claimed;  /**< documents it took */
} kvz_dispatch_worker;

/**
 * Order @p docs longest first (ties by id) in place, write the shared list,
 * start the workers (each gets: argv..., --device D, [--threads T],
 * --claim-fd FD, --worker-tag W), forward their output lines, wait for all.
 * @param out  n_workers entries (may be NULL).
 * @return 0 when every worker ran to its end (look at out[].exit_code);
 *         KVZ_ERR_ARG; KVZ_ERR_IO (memfd, pipe, fork or exec failed);
 *         KVZ_ERR_NOMEM.
 */
int kvz_dispatch_run(kvz_dispatch_doc *docs, size_t n, const kvz_dispatch_opts *o,
                     kvz_dispatch_worker *out);

/** Documents claimed so far (parent side, during kvz_dispatch_run callbacks). */
uint64_t kvz_dispatch_claimed(void);

/**
 * Worker side: map the list the parent passed as file descriptor @p fd.
 * @return 0; KVZ_ERR_ARG (not a list); KVZ_ERR_IO; KVZ_ERR_NOMEM.
 */
int kvz_claims_open(int fd, int worker, kvz_claims **out);
/** Number of documents in the list. */
size_t kvz_claims_count(const kvz_claims *c);
/** Document @p i of the list (pointers valid until kvz_claims_close). */
void kvz_claims_doc(const kvz_claims *c, size_t i, const char **path, const char **id, int *named);
/** 1 when this worker got document @p i (nobody had it), else 0. */
int kvz_claims_take(kvz_claims *c, size_t i);
void kvz_claims_close(kvz_claims *c);

/** Number of CUDA GPUs this process may use; KVZ_ERR_NODEV without a CUDA build or GPU. */
int kvz_dispatch_gpu_count(int *n);
/** Workers of --gpus: @p want GPUs (0: all this process may use) into *workers.
 *  KVZ_ERR_NODEV without a CUDA build or GPU, or with fewer than @p want (the detail
 *  says how many there are). */
int kvz_dispatch_gpus(long want, int *workers);

#ifdef __cplusplus
}
#endif
#endif
