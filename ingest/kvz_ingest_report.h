/**
 * @file kvz_ingest_report.h
 * @brief An ingest run's reports as text (and its summaries as JSON lines): what
 *        kvzip-ingest prints, beside the modules that produce the data
 *        (kvz_corpus.h, kvz_batch.h, kvz_workers.h).
 *
 * Each function writes to the caller's stream @p f and nothing else; @p prog
 * ("kvzip-ingest") leads the lines that name the program. Ids, paths and error
 * details are escaped (kvz_escape.h), so a file name cannot drive the terminal or
 * fake a line; JSON strings are written with kvz_escape_json.
 */
#ifndef KVZ_INGEST_REPORT_H
#define KVZ_INGEST_REPORT_H

#include <stdint.h>
#include <stdio.h>

#include "kvz_batch.h"
#include "kvz_corpus.h"
#include "kvz_shard.h"
#include "kvz_workers.h"

#ifdef __cplusplus
extern "C" {
#endif

/** One line for a corpus report: "PROG: warning: ..." for what is skipped,
 *  "PROG: error: ..." for what fails (UNREADABLE, UNTOKENIZED, NO_PARTS carry
 *  e->rc and the thread's error detail, which is then cleared). */
void kvz_ingest_report_corpus_event(FILE *f, const char *prog, const kvz_corpus_event *e);

/** One line for a batch report: an error line "PROG: error: ID: ..." when e->rc is
 *  set (NOT_STARTED: "cannot start the ingest pipeline"), else a part's status line
 *  "STATUS ID  N tokens  S s". NOT_TRIED prints nothing (the store's error was
 *  reported once). */
void kvz_ingest_report_batch_event(FILE *f, const char *prog, const kvz_batch_event *e);

/** The terminal side of an ingest run, as the modules' callbacks: give
 *  kvz_ingest_report_on_corpus (kvz_corpus_init), _on_batch and _on_progress
 *  (kvz_batch_opts) a kvz_ingest_term as their user pointer. */
typedef struct kvz_ingest_term {
    FILE *f;          /**< stderr */
    const char *prog; /**< "kvzip-ingest" */
    int bar;          /**< a progress bar on f (a terminal); cleared before each part line */
    int lines;        /**< one line per part (errors are printed either way) */
} kvz_ingest_term;
void kvz_ingest_report_on_corpus(void *term, const kvz_corpus_event *e);
void kvz_ingest_report_on_batch(void *term, const kvz_batch_event *e);
void kvz_ingest_report_on_progress(void *term, const char *id, int64_t done, int64_t total, double seconds);

/** The progress bar, one terminal line that starts with a carriage return (no
 *  newline): a 30-cell bar, percent, @p done / @p total tokens, tokens/s and time left after @p seconds,
 *  and the current @p id (cut to 32 columns). */
void kvz_ingest_report_progress(FILE *f, const char *id, int64_t done, int64_t total, double seconds);

/** The ids @p c would ingest (those not dropped), one a line; with @p json one
 *  object: shard "I/N" (0/1 when not sharded), corpus (the listing hash, 16 hex),
 *  corpus_documents (@p n_ids), documents (the ids). */
void kvz_ingest_report_list(FILE *f, const kvz_corpus *c, const kvz_shard *sh, uint64_t corpus_hash,
                            size_t n_ids, int json);

/** "PROG: shard I/N (from SOURCE): N of M documents (corpus listing HASH)": this
 *  shard's share @p n_docs of the @p n_ids ids of the corpus. */
void kvz_ingest_report_shard(FILE *f, const char *prog, const kvz_shard *sh, size_t n_docs, size_t n_ids,
                             uint64_t corpus_hash);

/** The warning that store @p path was filled from corpus listing @p old (as
 *  kvz_workers_mark_store returns it) and this run's is @p corpus_hash / @p n_ids. */
void kvz_ingest_report_listing_changed(FILE *f, const char *prog, const char *path, const char *old,
                                       uint64_t corpus_hash, size_t n_ids);

/** Why a run has no usable document when none of @p c failed (nothing when some
 *  did: those were reported): an error line without a shard; for a shard (an empty
 *  shard, not an error) a line only when files were skipped and @p verbose. */
void kvz_ingest_report_no_usable(FILE *f, const char *prog, const kvz_corpus *c, const kvz_shard *sh,
                                 int verbose);

/** A run's summary of @p n_docs documents into @p store_path, @p failed and
 *  @p skipped counted by the caller (corpus and batch together). With @p json one
 *  flat JSON object (store, documents, parts, ingested, unchanged, linked, failed,
 *  skipped, tokens, tokens_ingested, ratio, pairs_total, pairs_kept, bytes_kv_full,
 *  bytes_kv_kept, bytes_stored, seconds): the line a worker's parent adds up
 *  (kvz_workers.h). Else one line "PROG: N ingested, ..." with the KV figures of the
 *  computed caches when there are any. */
void kvz_ingest_report_summary(FILE *f, const char *prog, const char *store_path, size_t n_docs,
                               const kvz_batch_stats *s, int failed, int skipped, float ratio, int json);

/** The start line of a run over worker processes: @p n_docs documents to @p n_workers
 *  workers, one per GPU (cuda:0..N-1) or each on @p device, @p threads each. */
void kvz_ingest_report_workers_start(FILE *f, const char *prog, size_t n_docs, int n_workers, int gpus,
                                     const char *device, int threads);

/** Worker @p w's stderr @p line (on @p device), with @p claimed of @p n_docs handed out. */
void kvz_ingest_report_worker_line(FILE *f, int w, const char *device, const char *line, uint64_t claimed,
                                   size_t n_docs);

/** One error line per worker of @p r that was killed, or exited nonzero before its
 *  summary (the first @p n_workers of r->per). */
void kvz_ingest_report_workers_lost(FILE *f, const char *prog, const kvz_workers_result *r, int n_workers);

/** The summary of a run over @p n_workers worker processes: with @p json one object
 *  (store, workers, documents, parts, ingested, unchanged, linked, failed, skipped,
 *  tokens, bytes_stored, worker_errors, seconds, per_worker: [{device, documents,
 *  exit}]); else a line of totals and one line per worker. */
void kvz_ingest_report_workers_summary(FILE *f, const char *prog, const char *store_path,
                                       const kvz_workers_result *r, int n_workers, size_t n_docs,
                                       int failed, int skipped, int json);

#ifdef __cplusplus
}
#endif
#endif /* KVZ_INGEST_REPORT_H */
