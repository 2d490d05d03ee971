/**
 * @file kvz_parts.h
 * @brief Documents longer than one cache: the `ID#N` part policy.
 *
 * A document whose context is longer than a part may hold is stored as near-equal
 * parts under the ids `ID#1`, `ID#2`, ... (a short one under `ID` itself). Each
 * part's doc entry records its part number (kvz_store_doc_info.part), so a part
 * names its parent: the entry `ID#N` with part N belongs to the document `ID`.
 *
 * Ownership: an entry is *this document's* (it may be overwritten or removed by
 * ingesting `ID`) when it is
 *   - the entry `ID` itself, unless it records a part number (then `ID` is part of
 *     another document: `ID` = `P#N`);
 *   - an entry `ID#N` that records part N;
 *   - an entry `ID#N` written before parts were recorded (part 0) whose source path
 *     is the path this document is read from (the same string, or the same file by
 *     device and inode). Such an entry from another path is kept: it may be an
 *     independent document that happens to be named `ID#N`.
 * Anything else is another document's and is never overwritten or removed.
 */
#ifndef KVZ_PARTS_H
#define KVZ_PARTS_H

#include <stdint.h>

#include "kvz_ingest.h"
#include "kvz_store.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Parts needed for @p n_tokens context tokens at most @p max_part each (1 when it fits;
 *  0 when n_tokens <= 0 or max_part <= 0). */
int32_t kvz_ingest_n_parts(int32_t n_tokens, int32_t max_part);

/** Token span [*s0, *s1) of part @p p (0-based) of @p n_parts near-equal parts. */
void kvz_ingest_part_span(int32_t n_tokens, int32_t n_parts, int32_t p, int32_t *s0, int32_t *s1);

/**
 * The id part @p part (1-based) of @p n_parts is stored under: @p doc_id when
 * n_parts is 1, else "doc_id#part". @p out holds KVZ_STORE_DOC_ID_MAX + 1 bytes.
 * @return 0; KVZ_ERR_ARG when the id would be empty or longer than
 *   KVZ_STORE_DOC_ID_MAX bytes (detail gives the length), or part out of range.
 */
int kvz_ingest_part_id(const char *doc_id, int32_t part, int32_t n_parts,
                       char out[KVZ_STORE_DOC_ID_MAX + 1]);

/**
 * 1 when the entry @p info stored under @p id is document @p doc_id's own (see the
 * ownership rules above) for the slot @p part (0 = the whole-document id, N = `doc_id#N`),
 * read from @p source_path (may be NULL: then old part-0 entries are never its own).
 */
int kvz_ingest_owns(const char *doc_id, const char *source_path, int32_t part,
                    const kvz_store_doc_info *info);

/**
 * Check, without model work, that storing @p doc_id in @p n_parts parts overwrites
 * only entries of its own.
 * @return 0; KVZ_ERR_ARG naming the first id held by another document (or an id
 *   over the length limit); kvz_store_lookup errors.
 */
int kvz_ingest_parts_check(kvz_store *st, const char *doc_id, const char *source_path,
                           int32_t n_parts);

/**
 * Remove what an older version of @p doc_id left behind once it is stored in
 * @p n_parts parts: the whole-document entry when n_parts > 1, and the parts
 * `doc_id#N`, N > n_parts (N >= 1 when n_parts is 1), that are its own. Probes
 * N upwards until an id is not stored; entries of other documents are skipped.
 * @param removed  out (may be NULL): entries deleted.
 * @return 0; kvz_store_lookup / kvz_store_delete_doc errors.
 */
int kvz_ingest_parts_prune(kvz_store *st, const char *doc_id, const char *source_path,
                           int32_t n_parts, int32_t *removed);

/** What kvz_ingest_document() reports after each part (valid during the call only). */
typedef struct kvz_part_report {
    const char *id;                /**< the id the part went to */
    int32_t part, n_parts;         /**< 1-based part number; n_parts 1 = a whole document */
    int32_t n_tokens;              /**< context tokens of this part */
    int rc;                        /**< 0, or the part's error (kvz_error_detail() has the detail) */
    const kvz_ingest_result *res;  /**< valid when rc == 0 */
} kvz_part_report;

/** Called after each part; nonzero stops the document (its value is returned). */
typedef int (*kvz_part_fn)(void *user, const kvz_part_report *rep);

/**
 * Store one document of @p n_ctx context tokens: split it into
 * kvz_ingest_n_parts(n_ctx, max_part) parts (kvz_ingest_parts_check first, so
 * nothing is computed when an id belongs to another document), kvz_ingest_doc each
 * part with its part number recorded, then kvz_ingest_parts_prune. Each part is
 * its own transaction; a failed part stops the document (earlier parts stay
 * stored, nothing is pruned).
 * @param max_part  tokens per part, at most kvz_ingest_max_part_tokens(m) (0 = that).
 * @param cb        may be NULL.
 * @return 0; KVZ_ERR_EMPTY (no tokens); kvz_ingest_parts_check / kvz_ingest_doc /
 *   kvz_ingest_parts_prune errors; the callback's nonzero value.
 */
int kvz_ingest_document(kvz_model *m, kvz_store *st, const char *doc_id, const char *source_path,
                        const int32_t *ctx, int32_t n_ctx, int32_t max_part,
                        const kvz_ingest_opts *o, kvz_part_fn cb, void *user);

#ifdef __cplusplus
}
#endif
#endif
