/**
 * @file kvz_eval.h
 * @brief Question-answer evaluation of KVzip against eviction baselines (DESIGN §6,
 *        docs/EVAL.md): question files, the SnapKV / window / random baselines, the
 *        cache built from a keep mask, teacher-forced NLL, greedy answers, the summary
 *        tables and the --json / --plot outputs. kvzip-eval is a thin CLI over it;
 *        the multi-document runner (kvz_eval_multidoc.h) shares its answer step.
 *
 * Internal module (not in include/kvzip.h); it is built as its own library
 * (kvz_eval: ingest/kvz_eval*.c) because it reads and writes JSON with jansson,
 * which libkvzip does not link. Like every module it never prints and never exits:
 * functions return 0 or a negative KVZ_ERR_*, describe the failure in a
 * kvz_eval_error, and report progress through the caller's kvz_eval_io callbacks.
 *
 * Threading: one evaluation per thread; an evaluation uses the model it is given, on
 * either backend: the SnapKV hook and the cache builder read the CPU cache in place
 * (kvz_kv_view) and copy a device cache to the host (kvz_kv_get_head).
 */
#ifndef KVZ_EVAL_H
#define KVZ_EVAL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvz_model.h"

/** How a call failed, for the caller to print. */
typedef struct kvz_eval_error {
    int rc;           /**< the KVZ_ERR_* returned */
    int input;        /**< 1: the input (question file, results file, a document) is at fault */
    int with_detail;  /**< 1: msg says what failed; kvz_error_detail() holds why.
                           0: msg is the whole one-line message */
    char msg[2048];
} kvz_eval_error;

/** The caller's side: progress lines and the document reader. */
typedef struct kvz_eval_io {
    /** One progress or warning line (no newline; any bytes of ids, paths and model
     *  answers may be in it: escape before showing). NULL = silent. */
    void (*log)(void *ctx, const char *line);
    /** Scoring progress of one document (may be NULL). Returns 0. */
    int (*progress)(void *ctx, int64_t done, int64_t total);
    /** Read a text document into a malloc'd NUL-terminated buffer: the CLIs pass
     *  cli_read_text (regular file, UTF-8, at most max_bytes). Required. */
    int (*read_text)(const char *path, size_t max_bytes, char **out, size_t *len);
    void *ctx;
    int quiet;        /**< 1: only warnings reach log */
} kvz_eval_io;

/* ------------------------------------------------------------------------ */
/* Shared by both evaluation modes                                          */

/** Scratch of one answering thread; zero-initialise, kvz_eval_scratch_free after. */
typedef struct kvz_eval_scratch {
    float *logits;    /**< (max_seq, n_vocab) */
    int32_t *seq;     /**< (max_seq) */
    kvz_tokens gen;   /**< the last greedy answer's tokens */
    char *text;
    size_t text_cap;
} kvz_eval_scratch;

/** Allocate s for question + answer sequences of up to max_seq tokens. KVZ_ERR_NOMEM. */
int kvz_eval_scratch_init(kvz_eval_scratch *s, const kvz_model *m, int32_t max_seq);
void kvz_eval_scratch_free(kvz_eval_scratch *s);

/** One measured answer. */
typedef struct kvz_eval_answer {
    int done, agree, correct;
    double nll;       /**< mean NLL of the reference answer tokens (nats/token) */
    double kv_bytes;  /**< fp16 K+V of the cache answered from */
    char *answer;     /**< malloc'd greedy answer text */
} kvz_eval_answer;

/**
 * Answer one question from @p kv (checkpointed at the document, n_doc rows):
 * teacher-forced NLL of the reference answer @p at after the question @p qt (with
 * @p hook on that pass, may be NULL), then a greedy answer of at most max_tokens
 * (stops on end of turn) into s->gen and out->answer. The cache is rolled back after
 * each pass. Returns 0, KVZ_ERR_NOMEM or the forward pass's error.
 */
int kvz_eval_answer_question(kvz_model *m, kvz_eval_scratch *s, kvz_kv *kv, int32_t n_doc,
                             const kvz_tokens *qt, const kvz_tokens *at, int max_tokens,
                             const kvz_layer_hook *hook, kvz_eval_answer *out);

/** Host fp32 copies of one (layer, KV head) of a cache, for caches the host cannot view
 *  (a device cache): zero-initialise, grown as needed, kvz_eval_kvbuf_free after. */
typedef struct kvz_eval_kvbuf {
    float *k, *v;
    int32_t *pos;
    size_t rows;      /**< capacity in rows */
} kvz_eval_kvbuf;
void kvz_eval_kvbuf_free(kvz_eval_kvbuf *b);

/**
 * SnapKV observation (the snapkv baselines; exposed for the tests): a kvz_layer_hook
 * on the full cache's teacher-forced pass of [question][answer] after n_doc = row_doc
 * rows. For each window query i (the first n_win tokens of the pass), layer l and
 * query head g, p = softmax over every key visible to i of q·k/√d, and
 * acc[(l·n_head + g)·n_ctx + j] += p of context row n_prefix + j. The keys are read
 * from the cache: kvz_kv_view where the host holds it (CPU), else kvz_kv_get_head
 * (any backend, e.g. CUDA; or always when copy_kv is set). Zero acc before the pass;
 * free with kvz_eval_snap_free.
 */
typedef struct kvz_eval_snap {
    const kvz_config *c;
    int32_t n_prefix, n_ctx;
    int32_t n_win;       /**< window = the question + postfix tokens */
    int64_t row_doc;     /**< rows of prefix + context = row of the first window token */
    float *acc;          /**< (n_layer, n_head, n_ctx), the caller's */
    int copy_kv;         /**< 1: read K by kvz_kv_get_head even where kvz_kv_view works */
    float *work;         /**< scratch, owned */
    size_t work_floats;
    kvz_eval_kvbuf kb;   /**< scratch, owned */
} kvz_eval_snap;
int kvz_eval_snap_hook(void *ctx, int32_t layer, const float *q, const float *k_new, int32_t n,
                       int64_t row0, const kvz_kv *kv);
void kvz_eval_snap_free(kvz_eval_snap *s);

/** 1 if @p hay contains @p needle, ASCII case-insensitively (an empty needle matches). */
int kvz_eval_contains_ci(const char *hay, const char *needle);

/** Write @p s as a JSON string literal (jansson's escaping; a byte that is not valid
 *  UTF-8 is written as U+FFFD, so the file always reads back). */
void kvz_eval_json_str(FILE *f, const char *s);

/** Split a comma-separated list into *out (malloc'd items; empty items dropped).
 *  Returns the count (0 for an empty list) or KVZ_ERR_NOMEM. */
int kvz_eval_split_list(const char *list, char ***out);
void kvz_eval_list_free(char **v, int n);

/** --ratios: comma-separated, each in (0, 1], none twice. *ratios is malloc'd.
 *  KVZ_ERR_ARG with the complaint in kvz_error_detail(); KVZ_ERR_NOMEM. */
int kvz_eval_parse_ratios(const char *list, double **ratios, int *n);

/** printf-style line to io->log (skipped when io->quiet unless @p warn). */
void kvz_eval_say(const kvz_eval_io *io, int warn, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/** Fill @p er (printf-style message) and return @p rc. */
int kvz_eval_fail(kvz_eval_error *er, int rc, int input, int with_detail, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* ------------------------------------------------------------------------ */
/* Single-document evaluation                                               */

/** One line of a question file: {"doc", "question", "answer", "accept"?}. */
typedef struct kvz_eval_qa {
    char *doc;          /**< as written in the file */
    char *path;         /**< resolved against the file's folder */
    char *question, *answer;
    char **accept;      /**< (n_accept); default [answer] */
    int n_accept;
    int doc_idx;        /**< index into the document table */
    int idx_in_doc;     /**< 0-based order among the selected questions of its document */
} kvz_eval_qa;

/**
 * Parse one question line with jansson. Returns 0, or KVZ_ERR_FORMAT with a reason
 * in *why (static text: "not a JSON object", "text after the object", "missing ...",
 * "... must be strings", "empty ...", "\"accept\" must be an array of strings");
 * KVZ_ERR_NOMEM. On failure q is zeroed. Free with kvz_eval_qa_free.
 */
int kvz_eval_parse_qa(const char *line, size_t len, kvz_eval_qa *q, const char **why);
void kvz_eval_qa_free(kvz_eval_qa *q);

enum { KVZ_EVAL_KVZIP, KVZ_EVAL_RANDOM, KVZ_EVAL_WINDOW, KVZ_EVAL_SNAPKV, KVZ_EVAL_SNAPKV_Q1,
       KVZ_EVAL_N_METHOD };
/** "kvzip", "random", "window", "snapkv", "snapkv-q1". */
extern const char *const kvz_eval_method_name[KVZ_EVAL_N_METHOD];

/** --baselines: "none" or any of random,window,snapkv (snapkv also turns on
 *  snapkv-q1) into use[] (kvzip always on). KVZ_ERR_ARG with the complaint in
 *  kvz_error_detail(); KVZ_ERR_NOMEM. */
int kvz_eval_parse_baselines(const char *list, int use[KVZ_EVAL_N_METHOD]);

typedef struct kvz_eval_opts {
    const double *ratios;     /**< (n_ratios) in (0, 1], copied */
    int n_ratios;
    int use[KVZ_EVAL_N_METHOD]; /**< methods to run (kvzip always runs) */
    int max_tokens;           /**< greedy answer length limit */
    uint64_t seed;            /**< random eviction */
    int kv_dtype;             /**< stored-type round trip of compressed caches (KVZ_DTYPE_*), -1 none */
    int copy_kv;              /**< 1: read the full cache through kvz_kv_get_head even where the
                                   host can view it (tests: the device route on the CPU) */
} kvz_eval_opts;

typedef struct kvz_eval kvz_eval;

/** New evaluation (no questions yet). KVZ_ERR_NOMEM, KVZ_ERR_ARG (no ratio). */
int kvz_eval_create(const kvz_eval_opts *o, const kvz_eval_io *io, kvz_eval **out);
void kvz_eval_free(kvz_eval *e);

/**
 * Read the questions of a file (its text, @p len bytes; @p qa_path names it in
 * messages and resolves the documents' relative paths). Selection, in this order:
 * @p docs (comma-separated names or prefixes of file names; NULL = all), @p limit questions
 * in all, @p per_doc per document (0 = no limit). Then checks every selected
 * document exists. Errors (er->input set): KVZ_ERR_FORMAT a bad line ("FILE:LINE:
 * why"), KVZ_ERR_NOTFOUND a --docs name without questions or a missing document,
 * KVZ_ERR_EMPTY no questions; KVZ_ERR_NOMEM.
 */
int kvz_eval_add_questions(kvz_eval *e, const char *qa_path, const char *text, size_t len,
                           const char *docs, long limit, long per_doc, kvz_eval_error *er);

/**
 * Evaluate every question on @p m: per document, KVzip scoring once, the full
 * cache's answers (and SnapKV observations), then every method and ratio.
 * Errors: the model's, the document reader's, KVZ_ERR_CONTEXT (document too long
 * for the model), KVZ_ERR_NOMEM; er->msg names the document.
 */
int kvz_eval_run(kvz_eval *e, kvz_model *m, kvz_eval_error *er);

/** The markdown tables of a finished run (docs/EVAL.md). KVZ_ERR_IO on a write error. */
int kvz_eval_write_tables(const kvz_eval *e, FILE *f);
/** Every summary row and every answer as JSON into @p path. KVZ_ERR_IO. */
int kvz_eval_write_json(const kvz_eval *e, const char *path, const char *model_path,
                        const char *qa_path);
/** Accuracy and agreement vs ratio as a PNG (runs gnuplot, pngcairo). KVZ_ERR_IO. */
int kvz_eval_write_plot(const kvz_eval *e, const char *path);

#endif /* KVZ_EVAL_H */
