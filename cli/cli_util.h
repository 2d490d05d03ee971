/* Helpers shared by the command-line tools: argument values, error lines,
 * model resolution, document reading, JSON string output. Only CLIs print. */
#ifndef KVZ_CLI_UTIL_H
#define KVZ_CLI_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <sys/stat.h>

#include "kvz_model.h"

#define KVZ_DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define KVZ_DEFAULT_STORE "kvzip-store"

/* Exit codes of every tool (docs/ERRORS.md). */
enum { EXIT_OK = 0, EXIT_FAIL = 1, EXIT_USAGE = 2, EXIT_INPUT = 3, EXIT_MODEL = 4,
       EXIT_STORE = 5, EXIT_NOTFOUND = 6 };

extern const char *cli_prog;

/* Call first in main(): sets the program name and, unless the user chose an OpenMP
 * wait policy, re-executes the program once with OMP_WAIT_POLICY=passive. libgomp
 * reads it only at start-up; its default (spin-waiting threads) costs up to 100x
 * when the cores are shared with other work, and ~nothing is lost when idle. */
void cli_init(const char *prog, char **argv);

/* Print "prog: error: <what>: <detail> (<class>)" on one line, what and detail escaped
 * (cli_escape), then clear the detail. */
void cli_error(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Print "prog: error: <detail> (<class>)" (detail escaped), the library's own one-line
 * account of failure rc, then clear the detail. */
void cli_error_detail(int rc);
/* Print "prog: <msg> (see prog --help)" (msg escaped: cli_escape) and exit(EXIT_USAGE). */
void cli_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
/* Exit code for a library error class. */
int cli_exit_code(int rc);
/* Exit code for a failed model load: 6 file not found, 1 out of memory or not a
 * regular file / unreadable (KVZ_ERR_IO), 4 otherwise (corrupt, truncated or
 * unsupported model). */
int cli_model_exit(int rc);
/* Exit code for a failed store open or document load: 6 not found, 4 another model's
 * store, 1 out of memory, 5 otherwise (corrupt, not LMDB, other version, full). */
int cli_store_exit(int rc);

/* Parse numbers; usage error (exit 2) on garbage or out of [lo, hi]. */
long cli_parse_long(const char *flag, const char *s, long lo, long hi);
double cli_parse_double(const char *flag, const char *s, double lo, double hi);
/* The value after a flag: argv[++*i], or usage error if missing. */
const char *cli_value(int argc, char **argv, int *i);

/* Model path: --model value, else $KVZ_MODEL, else ./models/..., else relative to the binary. */
const char *cli_model_path(const char *flag_value);
/* Store path: --store value, else $KVZ_STORE, else ./kvzip-store. */
const char *cli_store_path(const char *flag_value);
/* Device from "cpu|cuda|auto" (usage error otherwise). */
int32_t cli_parse_device(const char *s);

/* Options and operands: call with each argv[i] of the option loop. Returns 1 when
 * argv[i] looks like an option (begins with '-' and is not a lone "-"; the caller
 * decides what it does with unknown ones), 0 for an operand (everything else, and
 * every argument after "--"), -1 for the first "--" itself (skip it). *ended starts
 * at 0 and is set once "--" is seen. */
int cli_arg_kind(const char *a, int *ended);

/* Open @p path for reading without ever blocking (O_NONBLOCK, so a FIFO with no
 * writer does not hang the open) and check it is a regular file. Returns the fd
 * (blocking mode restored) and fills *st, or a negative KVZ_ERR_*: NOTFOUND (missing),
 * IO ("<path>: not a regular file (a FIFO)" / folder / device / socket, or errno). */
int cli_open_regular(const char *path, struct stat *st);

/* Load the model (or a synthetic one when synthetic != NULL); prints the error. */
int cli_load_model(const char *path, const char *synthetic, int32_t device, int32_t threads,
                   kvz_model **out);

/* Read a document: rejects missing/unreadable (KVZ_ERR_IO / NOTFOUND), empty
 * (KVZ_ERR_EMPTY), binary or non-UTF-8 (KVZ_ERR_ENCODING, with the byte offset in
 * the detail), larger than max_bytes (KVZ_ERR_CONTEXT). *out is malloc'd, NUL-terminated. */
int cli_read_text(const char *path, size_t max_bytes, char **out, size_t *len);
/* 1 if buf is valid UTF-8 with no NUL bytes; else 0 and *bad = offset of the first bad byte. */
int cli_is_text(const char *buf, size_t len, size_t *bad);

/* s for a human-readable line: kvz_escape (common/kvz_escape.h): control characters,
 * invalid UTF-8 and backslashes escaped; one of 8 rotating thread-local buffers. */
const char *cli_escape(const char *s);

/* Write s as a JSON string literal (with quotes): kvz_escape_json. */
void cli_json_str(FILE *f, const char *s, size_t len);

#endif
