/**
 * @file kvz_store_report.h
 * @brief The store's reports as JSON objects (jansson): one document's entry and
 *        full description, store totals, and the results of verify, gc, salvage
 *        and merge. kvzip-store --json prints exactly these; a server or binding
 *        that reports on a store can return the same objects. The same reports as
 *        text lines (kvz_store_report_print_*): what kvzip-store prints without --json.
 *
 * Its own library (kvz_store_report, like the evaluation's kvz_eval) because it
 * links jansson, which libkvzip does not. Every function returns a new reference
 * (release with json_decref) or NULL when out of memory. Keys keep the order they
 * are listed in here (jansson keeps insertion order). Strings that are not valid
 * UTF-8 (ids and paths are bytes) carry U+FFFD for each bad byte. Figures that are
 * ratios are rounded as the reports have always printed them: a kept ratio to 4
 * decimals, compression and seconds to 3; dump with JSON_REAL_PRECISION(15) (or
 * less) to print them short.
 */
#ifndef KVZ_STORE_REPORT_H
#define KVZ_STORE_REPORT_H

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

#include "kvz_store.h"
#include "kvz_store_admin.h"
#include "kvz_store_merge.h"

#ifdef __cplusplus
extern "C" {
#endif

/** A JSON string of the bytes of @p s: valid UTF-8 as is, every byte that is not
 *  part of a valid UTF-8 sequence as U+FFFD. */
json_t *kvz_report_text(const char *s);

/** One document's entry (kvzip-store ls): id, tokens, ratio, mode, bytes_stored,
 *  bytes_kv_full, bytes_kv_kept, compression (full / stored), records, hash,
 *  ingest_time, date (UTC), source. */
json_t *kvz_report_doc(const char *id, const kvz_store_doc_info *in);

/** Everything about one document (kvzip-store show): id, source, hash, tokens,
 *  ingest_time, date, records, bytes_stored, bytes_kv_full, bytes_kv_kept,
 *  compression, and "blob": model_fp, n_layer, n_head, n_kv_head, head_dim, dtype,
 *  mode, prefix_policy, ratio, chunk, overlap, n_prefix, n_context, pairs_kept,
 *  context_pairs, context_pairs_kept, kept_per_head_min, kept_per_head_max,
 *  bytes_raw, bytes_records, meta_record_bytes, and "layers": per layer {layer,
 *  kept, heads: [kept per KV head], bytes_raw, bytes_record}. */
json_t *kvz_report_doc_detail(const char *id, const kvz_store_doc_detail *d);

/** Store totals (kvzip-store stats) of the store in folder @p dir: store, docs,
 *  blobs, records, tokens, bytes_kv_full, bytes_kv_kept, bytes_stored_docs,
 *  bytes_records, compression (full / stored), eviction (full / kept), zstd (kept /
 *  stored), map_size, map_used, file_bytes, page_size, last_txnid, model_fp (hex or
 *  null when no document was stored yet). */
json_t *kvz_report_summary(const char *dir, const kvz_store_summary *s);

/** kvz_store_verify()'s result: ok (no problems), docs, blobs, records, problems,
 *  and cpu_s, the CPU seconds the caller measured. */
json_t *kvz_report_verify(const kvz_store_verify_result *r, double cpu_s);

/** kvz_store_gc_compact()'s result: blobs_dropped, records_dropped, bytes_dropped,
 *  orphan_records, refs_fixed, prefixes_dropped; with a compaction also
 *  file_bytes_before and file_bytes_after. */
json_t *kvz_report_gc(const kvz_store_gc_compact_result *r);

/** kvz_store_salvage()'s result for store @p src copied into @p dst: store, into,
 *  docs, copied, lost, unreadable_stretches. */
json_t *kvz_report_salvage(const char *src, const char *dst, const kvz_store_salvage_result *r);

/** kvz_store_merge()'s result into @p into: into, docs, copied, linked, unchanged,
 *  replaced, bad, conflicts_resolved, mixed_corpus (boolean), bytes_copied. */
json_t *kvz_report_merge(const char *into, const kvz_merge_result *r);

/* ---- as text: each writes its lines to @p f (the caller's stream; nothing else is
 * printed). Ids and paths are escaped (kvz_escape: control characters and invalid
 * UTF-8 as \xHH ...), so a file name cannot drive the terminal or fake a row; byte
 * counts read "812 B", "53.2 kB", "1.4 MB", "2.05 GB". */

/** The header row of the document list (kvzip-store ls). */
void kvz_store_report_print_ls_header(FILE *f);
/** One row of the list: id, tokens, kept ratio, stored bytes, compression (full KV /
 *  stored), ingest date (UTC). */
void kvz_store_report_print_ls_row(FILE *f, const char *id, const kvz_store_doc_info *in);
/** Everything about one document (kvzip-store show), ending in one row per layer
 *  with the kept pairs of its first 16 KV heads. */
void kvz_store_report_print_doc_detail(FILE *f, const char *id, const kvz_store_doc_detail *d);
/** Store totals (kvzip-store stats) of the store in folder @p dir. */
void kvz_store_report_print_summary(FILE *f, const char *dir, const kvz_store_summary *s);
/** verify's one line for the store in folder @p dir: counts, then "ok" or "PROBLEMS". */
void kvz_store_report_print_verify(FILE *f, const char *dir, const kvz_store_verify_result *r);
/** gc's line, and with a compaction (r->compacted) the data.mdb sizes around it. */
void kvz_store_report_print_gc(FILE *f, const kvz_store_gc_compact_result *r);
/** salvage's line: documents copied from @p src to @p dst, lost, unreadable index. */
void kvz_store_report_print_salvage(FILE *f, const char *src, const char *dst, const kvz_store_salvage_result *r);
/** merge's line: documents from @p n_sources stores into @p into, by outcome. */
void kvz_store_report_print_merge(FILE *f, const char *into, int n_sources, const kvz_merge_result *r);
/** snapshot's line: @p src copied to @p dst, @p bytes the copy's data.mdb. */
void kvz_store_report_print_snapshot(FILE *f, const char *src, const char *dst, uint64_t bytes);

/* ---- problem lines (kvzip-store prints them on stderr), each led by @p prog ---- */

/** "PROG: error: no document 'ID' in DIR", with the part ids when the document
 *  was stored in @p n_parts parts (kvz_store_count_parts), else a pointer to ls. */
void kvz_store_report_print_no_doc(FILE *f, const char *prog, const char *dir, const char *id, uint32_t n_parts);
/** One problem verify found (a kvz_store_problem_fn report): "PROG: verify: MSG (CLASS)". */
void kvz_store_report_print_problem(FILE *f, const char *prog, int err, const char *msg);
/** One document salvage could not copy (@p id NULL: a stretch of the doc index it
 *  could not read; a kvz_store_lost_fn report): "PROG: salvage: lost 'ID': MSG (CLASS)". */
void kvz_store_report_print_lost(FILE *f, const char *prog, const char *id, int err, const char *msg);
/** salvage's error line when documents were lost (r->n_lost or r->n_gaps): how many,
 *  and where the rest went (@p dst, or that nothing could be copied and @p dst was
 *  not created). */
void kvz_store_report_print_salvage_loss(FILE *f, const char *prog, const char *src, const char *dst,
                                         const kvz_store_salvage_result *r);
/** One merge report (kvz_merge_report_fn) of @p kind: a document's line as it is, a
 *  corpus "note: ..." as "PROG: merge: warning: ...", a conflict or a blob that does
 *  not verify as "PROG: merge: conflict: ..." / "PROG: merge: error: ..."; @p msg
 *  escaped (it quotes ids and paths as they are stored). */
void kvz_store_report_print_merge_event(FILE *f, const char *prog, int kind, const char *msg);

#ifdef __cplusplus
}
#endif
#endif /* KVZ_STORE_REPORT_H */
