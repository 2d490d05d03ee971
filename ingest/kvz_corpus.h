/**
 * @file kvz_corpus.h
 * @brief The document list of an ingest run: walk folders for text files,
 *        give each document its id, check every id before anything is
 *        computed, read and tokenize the documents.
 *
 * The steps, in the order kvzip-ingest runs them (each optional but the first):
 *   1. kvz_corpus_add          each input: a folder is walked (sorted, recursive;
 *                              hidden entries and names other than *.txt, *.md or
 *                              extension-less are ignored; symbolic links are
 *                              followed, each real folder once), a file is taken
 *                              as it is. Ids: paths relative to the folder, or the
 *                              file's name (or the id given; path_ids: see below).
 *   2. kvz_corpus_shard        keep one shard's documents (kvz_shard.h).
 *   3. kvz_corpus_check_ids    every id 1..KVZ_STORE_DOC_ID_MAX bytes and stored by
 *                              one input only (the same file named twice: kept once).
 *   4. kvz_corpus_read         read each file as text (kvz_text.h).
 *   5. kvz_corpus_tokenize     tokenize, count parts (kvz_parts.h) and check every
 *                              part id ("ID#N") the same way.
 * No step reads a file or loads a model that a later one needs first: an id
 * problem is found before any file is read.
 *
 * Reporting: every file left out and every per-document failure is one call of
 * the kvz_corpus_fn given to kvz_corpus_init, in input order, and is counted in
 * skipped (left out, not an error) or failed; collisions are counted apart.
 * Library code: nothing prints or exits.
 *
 * Threading: a kvz_corpus is used by one thread at a time.
 */
#ifndef KVZ_CORPUS_H
#define KVZ_CORPUS_H

#include <stddef.h>
#include <stdint.h>

#include "kvz_shard.h"
#include "kvz_tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Largest document file read (bytes); a larger one fails with KVZ_ERR_CONTEXT. */
#define KVZ_CORPUS_MAX_FILE ((size_t)256 << 20)

/** One document of the list. Strings are owned by the corpus. */
typedef struct kvz_corpus_doc {
    char *path;       /**< file to read */
    char *id;         /**< document id (its parts are id#1, id#2, ...) */
    int named;        /**< an input itself, not found by a folder walk: not text is an error */
    int usable;       /**< read (and after step 5 tokenized) without error */
    int dropped;      /**< left out by step 3: a repeat of an earlier input, or id out of range */
    char *text;       /**< the text between kvz_corpus_read(keep_text) and kvz_corpus_tokenize */
    size_t len;       /**< text bytes (kept after the text is freed) */
    int32_t n_parts;  /**< after step 5 */
} kvz_corpus_doc;

/** What a report is about. */
typedef enum kvz_corpus_what {
    KVZ_CORPUS_SKIPPED = 1,      /**< a walked entry left out (skipped): path, detail */
    KVZ_CORPUS_DIR_UNREADABLE,   /**< a folder that cannot be listed (skipped): path, detail */
    KVZ_CORPUS_DIR_WALKED,       /**< a folder reached again through a symbolic link: path (not counted) */
    KVZ_CORPUS_MISSING,          /**< an input that cannot be stat'ed (failed): path, detail */
    KVZ_CORPUS_ID_LENGTH,        /**< id outside 1..KVZ_STORE_DOC_ID_MAX bytes (failed): path, id */
    KVZ_CORPUS_COLLISION,        /**< two inputs would be stored as one id (collisions): path,
                                  *   part, n_parts, path2, part2, n_parts2, id */
    KVZ_CORPUS_UNREADABLE,       /**< a file that cannot be read as text (failed): path, rc */
    KVZ_CORPUS_UNTOKENIZED,      /**< the tokenizer failed (failed): path, rc */
    KVZ_CORPUS_NO_PARTS,         /**< no tokens, or a part id longer than allowed (failed): path, rc */
} kvz_corpus_what;

/** One report. Pointers are valid during the call only. */
typedef struct kvz_corpus_event {
    kvz_corpus_what what;
    int rc;                  /**< KVZ_ERR_* for UNREADABLE / UNTOKENIZED / NO_PARTS, with the
                              *   detail in kvz_error_detail() during the call; else 0 */
    const char *path;        /**< the file or folder (as reached: input or input/sub/name) */
    const char *detail;      /**< SKIPPED, DIR_UNREADABLE, MISSING: why, one line; else NULL */
    const char *id;          /**< ID_LENGTH, COLLISION: the id */
    const char *path2;       /**< COLLISION: the other input (the later one in the list) */
    int32_t part, n_parts;   /**< COLLISION: which part of path (n_parts 1 = the whole document) */
    int32_t part2, n_parts2; /**< COLLISION: the same for path2 */
} kvz_corpus_event;

typedef void (*kvz_corpus_fn)(void *user, const kvz_corpus_event *ev);

/** The list. Read the fields; change them only through the functions below. */
typedef struct kvz_corpus {
    kvz_corpus_doc *v;  /**< documents, in input order (walks sorted bytewise) */
    size_t n, cap;
    int skipped;        /**< entries left out, reported as SKIPPED or DIR_UNREADABLE */
    int failed;         /**< failures reported (MISSING, ID_LENGTH, UNREADABLE, ...) */
    int collisions;     /**< COLLISION reports: nonzero means nothing may be stored */
    kvz_corpus_fn report;
    void *user;
} kvz_corpus;

/** An empty list reporting to @p report (may be NULL: nothing reported, still counted). */
void kvz_corpus_init(kvz_corpus *c, kvz_corpus_fn report, void *user);
/** Free every document; the list is empty again (reporting kept). */
void kvz_corpus_free(kvz_corpus *c);

/**
 * Add one input: a folder is walked, anything else is one document (read in
 * step 4: a FIFO or device is rejected then, without blocking).
 * @param id        the document id of a FILE input (NULL: derived).
 * @param path_ids  ids keep where the input came from: a folder's own name
 *                  (its real name for ".") leads its ids ("dir1/x.txt"), a file's
 *                  id is its path as given, without leading "./".
 * @return 0 (a missing input too: reported MISSING, counted in failed);
 *         KVZ_ERR_ARG (@p id given for a folder); KVZ_ERR_NOMEM.
 */
int kvz_corpus_add(kvz_corpus *c, const char *input, const char *id, int path_ids);

/**
 * Corpus listing hash of every id now in the list (kvz_corpus_hash) into
 * *hash and their count into *n_ids, then keep only the documents of shard
 * @p sh (all of them when sh is NULL or sh->n is 0).
 * @return 0; KVZ_ERR_NOMEM.
 */
int kvz_corpus_shard(kvz_corpus *c, const kvz_shard *sh, uint64_t *hash, size_t *n_ids);

/**
 * Step 3, no file read: an id outside 1..KVZ_STORE_DOC_ID_MAX bytes is
 * reported (ID_LENGTH) and its document dropped; two documents with one id are
 * reported (COLLISION) unless they are the same file (then the later one is
 * dropped).
 * @return the number of collisions found (also added to c->collisions);
 *         KVZ_ERR_NOMEM.
 */
int kvz_corpus_check_ids(kvz_corpus *c);

/**
 * Step 4: read every document not dropped (kvz_text_read, at most
 * KVZ_CORPUS_MAX_FILE bytes). One found by a walk that is empty, binary or not
 * UTF-8 is SKIPPED; any other error, and any error of a named file, is
 * UNREADABLE. Sets usable and len; keeps the text only when @p keep_text.
 * @return the number of usable documents.
 */
int kvz_corpus_read(kvz_corpus *c, int keep_text);

/**
 * Read one file the way step 4 does (for a worker handed a document).
 * @return 0 and *text (malloc'd, NUL-terminated; the caller frees it) and *len;
 *         1 when it was SKIPPED (counted); or the KVZ_ERR_* reported as
 *         UNREADABLE (counted in failed).
 */
int kvz_corpus_read_file(kvz_corpus *c, const char *path, int named, char **text, size_t *len);

/**
 * Step 5: tokenize the text of every usable document (kept by step 4) with
 * @p tok and free the text, count its parts of at most @p max_part tokens,
 * then check every id each part will be stored under, as step 3 does.
 * A document that fails (UNTOKENIZED, NO_PARTS) is no longer usable.
 * @param toks   c->n entries, zero-initialised; document i's tokens in toks[i]
 *               (the caller frees each with kvz_tokens_free). NULL: freed here.
 * @param total  out: tokens of every usable document, counted twice (the
 *               prefill and KVzip's repeat pass), for progress.
 * @return the number of collisions (also added to c->collisions); KVZ_ERR_NOMEM.
 */
int kvz_corpus_tokenize(kvz_corpus *c, const kvz_tokenizer *tok, int32_t max_part, kvz_tokens *toks,
                        int64_t *total);

/**
 * 1 when some part id of one document could equal another document's id: some
 * id not dropped is "X#N" (N a decimal from 1) with X another document's id.
 * Only then is step 5 needed to find every collision (ids of whole documents
 * are checked by step 3). On KVZ_ERR_NOMEM it answers 1.
 */
int kvz_corpus_part_ids_may_collide(const kvz_corpus *c);

#ifdef __cplusplus
}
#endif
#endif
