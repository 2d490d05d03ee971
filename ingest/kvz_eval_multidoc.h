/**
 * @file kvz_eval_multidoc.h
 * @brief Multi-document evaluation (kvzip-eval --multidoc; docs/EVAL.md
 *        "Multi-document"): questions over several documents composed into one
 *        context, answered per placement method and ratio, recorded as JSON lines.
 *
 * Flow: kvz_eval_md_create -> kvz_eval_md_add_questions (parse and check the question
 * file, no model) -> kvz_eval_md_open_results (binds the results file to the model and
 * settings, loads its records) -> kvz_eval_md_run (scores, composes, answers; every
 * answer is appended to the results file as it is measured, so a rerun resumes) ->
 * kvz_eval_md_write_tables. For a report of recorded results, skip kvz_eval_md_run.
 *
 * Errors as in kvz_eval.h: a negative KVZ_ERR_* and the message in a kvz_eval_error.
 * Bad input (er->input): KVZ_ERR_FORMAT (a malformed line, a document named twice, a
 * bad oracle, a bad results file), KVZ_ERR_NOTFOUND (a document or --ids question
 * that does not exist), KVZ_ERR_ARG (a results file written with other settings).
 */
#ifndef KVZ_EVAL_MULTIDOC_H
#define KVZ_EVAL_MULTIDOC_H

#include "kvz_eval.h"

enum { KVZ_EVAL_MD_SEQUENTIAL, KVZ_EVAL_MD_PARALLEL, KVZ_EVAL_MD_ORACLE, KVZ_EVAL_MD_N_METHOD };
enum { KVZ_EVAL_MD_N_KIND = 3 };
/** "sequential", "parallel", "oracle". */
extern const char *const kvz_eval_md_method_name[KVZ_EVAL_MD_N_METHOD];
/** Question kinds: "long", "retrieval", "cross". */
extern const char *const kvz_eval_md_kind_name[KVZ_EVAL_MD_N_KIND];
/** Index of a kind name, -1 if unknown. */
int kvz_eval_md_kind(const char *s);
/** --methods / --kinds: comma-separated names into use[]. KVZ_ERR_ARG (an unknown
 *  name, an empty list) with the complaint in kvz_error_detail(); KVZ_ERR_NOMEM. */
int kvz_eval_md_parse_methods(const char *list, int use[KVZ_EVAL_MD_N_METHOD]);
int kvz_eval_md_parse_kinds(const char *list, int use_kind[KVZ_EVAL_MD_N_KIND]);

typedef struct kvz_eval_md_opts {
    const double *ratios;      /**< (n_ratios) in (0, 1], run in this order; copied */
    int n_ratios;
    int use[KVZ_EVAL_MD_N_METHOD];
    int use_kind[KVZ_EVAL_MD_N_KIND];
    const char *root;          /**< folder of the DOC paths; NULL = the question file's */
    const char *ids;           /**< only these question ids, comma-separated (NULL = all) */
    long limit;                /**< only the first N selected questions (0 = all) */
    int max_tokens;            /**< greedy answer length limit */
    float key_scale;           /**< multiply every document key (1 = off) */
    int32_t part_tokens;       /**< part size; 0 or above the model's = kvzip-ingest's */
    const char *out_path;      /**< the results file (JSON lines); required */
} kvz_eval_md_opts;

typedef struct kvz_eval_md kvz_eval_md;

/** KVZ_ERR_ARG (no ratio, results file or reader), KVZ_ERR_NOMEM. */
int kvz_eval_md_create(const kvz_eval_md_opts *o, const kvz_eval_io *io, kvz_eval_md **out);
void kvz_eval_md_free(kvz_eval_md *d);

/** Parse and check the question file's text (documents must exist; no model yet)
 *  and select by kind, id and limit. KVZ_ERR_FORMAT also when nothing is selected. */
int kvz_eval_md_add_questions(kvz_eval_md *d, const char *qa_path, const char *text, size_t len,
                              kvz_eval_error *er);

/** Bind to @p m: part size, the results file's header line (model file name,
 *  max_tokens, key_scale, part_tokens) and its records. An existing file must carry
 *  the same header (KVZ_ERR_ARG); a last line cut by a crash is dropped (a warning on
 *  io->log; the file is truncated to its last whole line). */
int kvz_eval_md_open_results(kvz_eval_md *d, kvz_model *m, const char *model_path,
                             kvz_eval_error *er);

/** The part of kvz_eval_md_open_results that reads the results file: @p header is
 *  the line an existing file must start with (and a new one gets). Records need an
 *  id, a known method, a numeric ratio, nll and rows_per_head, a boolean correct, an
 *  integer q_pos and an array of token ids in [0, INT32_MAX]: else KVZ_ERR_FORMAT
 *  ("FILE:LINE: ..."). A missing file is a new one (0 records). */
int kvz_eval_md_read_results(kvz_eval_md *d, const char *header, kvz_eval_error *er);
/** Records loaded or written so far. */
int kvz_eval_md_n_records(const kvz_eval_md *d);

/** Measure every (question, method, ratio) not yet recorded, appending each record
 *  (fsync'd) as it is measured. Errors: bad documents (er->input), the model's. */
int kvz_eval_md_run(kvz_eval_md *d, kvz_eval_error *er);

/** One markdown table per question kind from the records of the selected questions
 *  (with this run's time when kvz_eval_md_run ran). KVZ_ERR_IO on a write error. */
int kvz_eval_md_write_tables(const kvz_eval_md *d, FILE *f);

#endif /* KVZ_EVAL_MULTIDOC_H */
