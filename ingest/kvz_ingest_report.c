/* An ingest run's reports as text and JSON lines (kvz_ingest_report.h). */
#include "kvz_ingest_report.h"

#include <string.h>

#include "kvz_error.h"
#include "kvz_escape.h"
#include "kvz_store.h"

#define E kvz_escape

void kvz_ingest_report_corpus_event(FILE *f, const char *prog, const kvz_corpus_event *e)
{
    const char *p = E(e->path);
    char pa[64] = "", pb[64] = "";
    switch (e->what) {
    case KVZ_CORPUS_SKIPPED: fprintf(f, "%s: warning: skipping %s: %s\n", prog, p, E(e->detail)); break;
    case KVZ_CORPUS_DIR_UNREADABLE:
        fprintf(f, "%s: warning: cannot read folder %s: %s\n", prog, p, e->detail);
        break;
    case KVZ_CORPUS_DIR_WALKED:
        fprintf(f, "%s: warning: skipping %s: folder already walked (a symbolic link to it or to an "
                "ancestor)\n", prog, p);
        break;
    case KVZ_CORPUS_MISSING: fprintf(f, "%s: error: %s: %s\n", prog, p, e->detail); break;
    case KVZ_CORPUS_ID_LENGTH:
        fprintf(f, "%s: error: %s: document id of %zu bytes is outside 1..%d bytes (ingest the FILE "
                "alone with a shorter --id)\n", prog, p, strlen(e->id), KVZ_STORE_DOC_ID_MAX);
        break;
    case KVZ_CORPUS_COLLISION:
        if (e->n_parts > 1) snprintf(pa, sizeof pa, " (part %d of %d)", e->part, e->n_parts);
        if (e->n_parts2 > 1) snprintf(pb, sizeof pb, " (part %d of %d)", e->part2, e->n_parts2);
        fprintf(f, "%s: error: %s%s and %s%s would both be stored as '%s'; nothing stored (use "
                "--path-ids, ingest them separately, or name one FILE with --id)\n", prog, p, pa,
                E(e->path2), pb, E(e->id));
        break;
    case KVZ_CORPUS_UNREADABLE: case KVZ_CORPUS_UNTOKENIZED: case KVZ_CORPUS_NO_PARTS: {
        char what[1024]; /* as cli_error: the message cut at 1023 bytes */
        snprintf(what, sizeof what, "%s%s", e->what == KVZ_CORPUS_UNREADABLE ? "cannot read "
                 : e->what == KVZ_CORPUS_UNTOKENIZED ? "cannot tokenize " : "", e->path);
        kvz_escape_error(f, prog, e->rc, what);
        break;
    }
    }
}

void kvz_ingest_report_batch_event(FILE *f, const char *prog, const kvz_batch_event *e)
{
    if (e->what == KVZ_BATCH_NOT_TRIED) return;
    if (e->what == KVZ_BATCH_NOT_STARTED) kvz_escape_error(f, prog, e->rc, "cannot start the ingest pipeline");
    else if (e->rc) kvz_escape_error(f, prog, e->rc, e->id); /* a part, or a document before or after its parts */
    else fprintf(f, "%-10s %s  %d tokens  %.1f s\n", e->status, E(e->id), e->res->n_ctx, e->res->seconds);
}

void kvz_ingest_report_progress(FILE *f, const char *id, int64_t done, int64_t total, double seconds)
{
    char name[64], bar[31];
    snprintf(name, sizeof name, "%s", E(id));
    const double rate = seconds > 0 ? done / seconds : 0;
    const double frac = total ? (double)done / (double)total : 0, eta = rate > 0 ? (total - done) / rate : 0;
    for (int i = 0, fill = (int)(frac * 30); i < 30; i++) bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
    bar[30] = 0;
    fprintf(f, "\r[%s] %3.0f%% %lld/%lld tok  %.0f tok/s  ETA %d:%02d  %-32.32s", bar, frac * 100,
            (long long)done, (long long)total, rate, (int)eta / 60, (int)eta % 60, name);
}

void kvz_ingest_report_list(FILE *f, const kvz_corpus *c, const kvz_shard *sh, uint64_t corpus_hash,
                            size_t n_ids, int json)
{
    if (json)
        fprintf(f, "{\"shard\": \"%u/%u\", \"corpus\": \"%016llx\", \"corpus_documents\": %zu, \"documents\": [",
                sh->n ? sh->index : 0, sh->n ? sh->n : 1, (unsigned long long)corpus_hash, n_ids);
    for (size_t i = 0, first = 1; i < c->n; i++) {
        if (c->v[i].dropped) continue;
        if (!json) { fprintf(f, "%s\n", E(c->v[i].id)); continue; }
        fputs(first ? "" : ", ", f);
        kvz_escape_json(f, c->v[i].id, strlen(c->v[i].id));
        first = 0;
    }
    if (json) fputs("]}\n", f);
}

void kvz_ingest_report_summary(FILE *f, const char *prog, const char *store_path, size_t n_docs,
                               const kvz_batch_stats *s, int failed, int skipped, float ratio, int json)
{
    if (json) {
        fputs("{\"store\": ", f);
        kvz_escape_json(f, store_path, strlen(store_path));
        fprintf(f, ", \"documents\": %zu, \"parts\": %d, \"ingested\": %d, \"unchanged\": %d, "
                "\"linked\": %d, \"failed\": %d, \"skipped\": %d, \"tokens\": %lld, "
                "\"tokens_ingested\": %lld, \"ratio\": %.4f, "
                "\"pairs_total\": %lld, \"pairs_kept\": %lld, \"bytes_kv_full\": %llu, "
                "\"bytes_kv_kept\": %llu, \"bytes_stored\": %llu, \"seconds\": %.3f}\n",
                n_docs, s->parts, s->written, s->unchanged, s->linked, failed, skipped,
                (long long)s->tokens, (long long)s->tokens_written, ratio, (long long)s->pairs_total,
                (long long)s->pairs_kept, (unsigned long long)s->bytes_full,
                (unsigned long long)s->bytes_kept, (unsigned long long)s->bytes_stored, s->seconds);
        return;
    }
    char kv[256] = "";
    if (s->written && s->bytes_full && s->bytes_stored && s->pairs_total)
        snprintf(kv, sizeof kv, " | ingested KV: full %.2f MB, kept %.2f MB (%.0f%% of the "
                 "context pairs, %.0f%% of the bytes with the prefix), stored %.2f MB (zstd "
                 "%.2fx)", s->bytes_full / 1e6, s->bytes_kept / 1e6,
                 100.0 * (double)s->pairs_kept / (double)s->pairs_total,
                 100.0 * (double)s->bytes_kept / (double)s->bytes_full, s->bytes_stored / 1e6,
                 (double)s->bytes_kept / (double)s->bytes_stored);
    fprintf(f, "%s: %d ingested, %d linked, %d unchanged, %d failed, %d skipped | %lld tokens in %.1f s%s\n",
            prog, s->written, s->linked, s->unchanged, failed, skipped, (long long)s->tokens, s->seconds, kv);
}

void kvz_ingest_report_workers_start(FILE *f, const char *prog, size_t n_docs, int n_workers, int gpus,
                                     const char *device, int threads)
{
    char last[16];
    snprintf(last, sizeof last, "%d", n_workers - 1);
    fprintf(f, "%s: %zu documents, longest first, to %d worker%s (%s%s, %d thread%s each)\n", prog, n_docs,
            n_workers, n_workers == 1 ? "" : "s", gpus ? "one per GPU: cuda:0.." : "device ",
            gpus ? last : device, threads, threads == 1 ? "" : "s");
}

void kvz_ingest_report_workers_lost(FILE *f, const char *prog, const kvz_workers_result *r, int n_workers)
{
    for (int w = 0; w < n_workers; w++) {
        const kvz_workers_one *p = &r->per[w];
        if (p->w.exit_code < 0)
            fprintf(f, "%s: error: worker %d (%s) was killed by signal %d after taking %llu documents; "
                    "rerun to finish them (stored documents are skipped)\n", prog, w, p->device,
                    p->w.signal, (unsigned long long)p->w.claimed);
        else if (p->w.exit_code && !p->summarized)
            fprintf(f, "%s: error: worker %d (%s) exited with status %d before ingesting\n", prog, w,
                    p->device, p->w.exit_code);
    }
}

void kvz_ingest_report_workers_summary(FILE *f, const char *prog, const char *store_path,
                                       const kvz_workers_result *r, int n_workers, size_t n_docs,
                                       int failed, int skipped, int json)
{
    const int nw = n_workers;
    if (json) {
        fputs("{\"store\": ", f);
        kvz_escape_json(f, store_path, strlen(store_path));
        fprintf(f, ", \"workers\": %d, \"documents\": %zu, \"parts\": %lld, \"ingested\": %lld, \"unchanged\": "
                "%lld, \"linked\": %lld, \"failed\": %d, \"skipped\": %d, \"tokens\": %lld, \"bytes_stored\": "
                "%llu, \"worker_errors\": %d, \"seconds\": %.3f, \"per_worker\": [",
                nw, n_docs, (long long)r->parts, (long long)r->ingested, (long long)r->unchanged,
                (long long)r->linked, failed, skipped, (long long)r->tokens,
                (unsigned long long)r->bytes_stored, r->bad_workers, r->seconds);
        for (int w = 0; w < nw; w++)
            fprintf(f, "%s{\"device\": \"%s\", \"documents\": %llu, \"exit\": %d}", w ? ", " : "",
                    r->per[w].device, (unsigned long long)r->per[w].w.claimed, r->per[w].w.exit_code);
        fputs("]}\n", f);
        return;
    }
    fprintf(f, "%s: %d workers: %lld ingested, %lld linked, %lld unchanged, %d failed, %d skipped | %lld "
            "tokens in %.1f s (%.0f tok/s) | stored %.2f MB\n", prog, nw, (long long)r->ingested,
            (long long)r->linked, (long long)r->unchanged, failed, skipped, (long long)r->tokens, r->seconds,
            r->seconds > 0 ? r->tokens / r->seconds : 0, r->bytes_stored / 1e6);
    for (int w = 0; w < nw; w++)
        fprintf(f, "  worker %d (%s): %llu document%s\n", w, r->per[w].device,
                (unsigned long long)r->per[w].w.claimed, r->per[w].w.claimed == 1 ? "" : "s");
}

void kvz_ingest_report_shard(FILE *f, const char *prog, const kvz_shard *sh, size_t n_docs, size_t n_ids,
                             uint64_t corpus_hash)
{
    fprintf(f, "%s: shard %u/%u (from %s): %zu of %zu documents (corpus listing %016llx)\n", prog, sh->index,
            sh->n, sh->source, n_docs, n_ids, (unsigned long long)corpus_hash);
}

void kvz_ingest_report_listing_changed(FILE *f, const char *prog, const char *path, const char *old,
                                       uint64_t corpus_hash, size_t n_ids)
{
    fprintf(f, "%s: warning: %s was filled from corpus listing %s before, this run's listing is %016llx "
            "%zu: the corpus changed; re-run every shard before merging\n", prog, E(path), E(old),
            (unsigned long long)corpus_hash, n_ids);
}

void kvz_ingest_report_no_usable(FILE *f, const char *prog, const kvz_corpus *c, const kvz_shard *sh,
                                 int verbose)
{
    if (c->failed) return;
    if (sh->n && c->skipped && verbose)
        fprintf(f, "%s: shard %u/%u: no usable document (%d skipped)\n", prog, sh->index, sh->n, c->skipped);
    else if (!sh->n && c->skipped)
        fprintf(f, "%s: error: no usable document: %d file%s skipped\n", prog, c->skipped,
                c->skipped == 1 ? "" : "s");
    else if (!sh->n)
        fprintf(f, "%s: error: no .txt, .md or extension-less documents found\n", prog);
}

void kvz_ingest_report_worker_line(FILE *f, int w, const char *device, const char *line, uint64_t claimed,
                                   size_t n_docs)
{
    fprintf(f, "[w%d %s] %s  (%llu/%zu handed out)\n", w, device, line, (unsigned long long)claimed, n_docs);
}

void kvz_ingest_report_on_corpus(void *term, const kvz_corpus_event *e)
{
    const kvz_ingest_term *t = term;
    kvz_ingest_report_corpus_event(t->f, t->prog, e);
}

void kvz_ingest_report_on_batch(void *term, const kvz_batch_event *e)
{
    const kvz_ingest_term *t = term;
    if (t->bar && (e->what == KVZ_BATCH_PART || e->what == KVZ_BATCH_NOT_TRIED)) fprintf(t->f, "\r\033[K");
    if (e->rc || t->lines) kvz_ingest_report_batch_event(t->f, t->prog, e);
}

void kvz_ingest_report_on_progress(void *term, const char *id, int64_t done, int64_t total, double seconds)
{
    const kvz_ingest_term *t = term;
    if (!t->bar) return;
    kvz_ingest_report_progress(t->f, id, done, total, seconds);
    fflush(t->f);
}
