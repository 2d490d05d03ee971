#include "kvz_parts.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "kvz_error.h"

int32_t kvz_ingest_n_parts(int32_t n_tokens, int32_t max_part)
{
    if (n_tokens <= 0 || max_part <= 0) return 0;
    return (int32_t)(((int64_t)n_tokens + max_part - 1) / max_part);
}

void kvz_ingest_part_span(int32_t n_tokens, int32_t n_parts, int32_t p, int32_t *s0, int32_t *s1)
{
    *s0 = (int32_t)((int64_t)n_tokens * p / n_parts);
    *s1 = (int32_t)((int64_t)n_tokens * (p + 1) / n_parts);
}

int kvz_ingest_part_id(const char *doc_id, int32_t part, int32_t n_parts,
                       char out[KVZ_STORE_DOC_ID_MAX + 1])
{
    out[0] = 0;
    if (!doc_id || !doc_id[0]) return kvz_error_set(KVZ_ERR_ARG, "empty document id");
    if (n_parts < 1 || part < 1 || part > n_parts || (uint32_t)n_parts > KVZ_STORE_PART_MAX)
        return kvz_error_set(KVZ_ERR_ARG, "part %d of %d is out of range", part, n_parts);
    const size_t n = strlen(doc_id);
    char suffix[16] = "";
    if (n_parts > 1) snprintf(suffix, sizeof suffix, "#%d", part);
    const size_t total = n + strlen(suffix);
    if (total > KVZ_STORE_DOC_ID_MAX)
        return kvz_error_set(KVZ_ERR_ARG, "document id of %zu bytes is over the %d-byte limit",
                             total, KVZ_STORE_DOC_ID_MAX);
    memcpy(out, doc_id, n);
    memcpy(out + n, suffix, strlen(suffix) + 1);
    return 0;
}

/* Same file: the same string, or both exist with the same device and inode. */
static int same_source(const char *a, const char *b)
{
    if (!a || !b || !a[0] || !b[0]) return 0;
    if (!strcmp(a, b)) return 1;
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

int kvz_ingest_owns(const char *doc_id, const char *source_path, int32_t part,
                    const kvz_store_doc_info *info)
{
    (void)doc_id; /* the slot's id is doc_id or doc_id#part: the caller looked it up */
    if (part == 0) return info->part == 0;
    if (info->part == (uint32_t)part) return 1;
    if (info->part == 0) return same_source(info->source_path, source_path);
    return 0;
}

/* Look up the entry at the slot; 1 if present (in *info), 0 if not, or an error. */
static int slot_lookup(kvz_store *st, const char *id, kvz_store_doc_info *info)
{
    int rc = kvz_store_lookup(st, id, info);
    if (rc == KVZ_ERR_NOTFOUND) {
        kvz_error_clear();
        return 0;
    }
    return rc ? rc : 1;
}

int kvz_ingest_parts_check(kvz_store *st, const char *doc_id, const char *source_path,
                           int32_t n_parts)
{
    char id[KVZ_STORE_DOC_ID_MAX + 1];
    kvz_store_doc_info info;
    for (int32_t p = 1; p <= n_parts; p++) {
        int rc = kvz_ingest_part_id(doc_id, p, n_parts, id);
        if (rc) return rc;
        rc = slot_lookup(st, id, &info);
        if (rc < 0) return rc;
        if (rc && !kvz_ingest_owns(doc_id, source_path, n_parts > 1 ? p : 0, &info)) {
            if (info.part)
                return kvz_error_set(KVZ_ERR_ARG, "id '%s' is part %u of another document; "
                                     "not overwritten", id, info.part);
            return kvz_error_set(KVZ_ERR_ARG, "id '%s' is another document's (from %s); not "
                                 "overwritten", id, info.source_path[0] ? info.source_path : "?");
        }
    }
    return 0;
}

int kvz_ingest_parts_prune(kvz_store *st, const char *doc_id, const char *source_path,
                           int32_t n_parts, int32_t *removed)
{
    if (removed) *removed = 0;
    kvz_store_doc_info info;
    int rc;
    if (n_parts > 1) { /* an older, shorter version stored whole */
        if ((rc = slot_lookup(st, doc_id, &info)) < 0) return rc;
        if (rc && kvz_ingest_owns(doc_id, source_path, 0, &info)) {
            if ((rc = kvz_store_delete_doc(st, doc_id))) return rc;
            if (removed) ++*removed;
        }
    }
    for (uint32_t p = n_parts > 1 ? (uint32_t)n_parts + 1 : 1; p <= KVZ_STORE_PART_MAX; p++) {
        char id[KVZ_STORE_DOC_ID_MAX + 16];
        snprintf(id, sizeof id, "%s#%u", doc_id, p);
        if (strlen(id) > KVZ_STORE_DOC_ID_MAX) break; /* no such id can be stored */
        if ((rc = slot_lookup(st, id, &info)) < 0) return rc;
        if (!rc) break;
        if (!kvz_ingest_owns(doc_id, source_path, (int32_t)p, &info)) continue;
        if ((rc = kvz_store_delete_doc(st, id))) return rc;
        if (removed) ++*removed;
    }
    return 0;
}

int kvz_ingest_document(kvz_model *m, kvz_store *st, const char *doc_id, const char *source_path,
                        const int32_t *ctx, int32_t n_ctx, int32_t max_part,
                        const kvz_ingest_opts *o, kvz_part_fn cb, void *user)
{
    const int32_t limit = kvz_ingest_max_part_tokens(m);
    if (max_part <= 0 || max_part > limit) max_part = limit;
    const int32_t parts = kvz_ingest_n_parts(n_ctx, max_part);
    if (parts < 1) return kvz_error_set(KVZ_ERR_EMPTY, "document has no tokens");
    int rc = kvz_ingest_parts_check(st, doc_id, source_path, parts);
    if (rc) return rc;
    kvz_ingest_opts po = *o;
    for (int32_t p = 0; p < parts; p++) {
        char id[KVZ_STORE_DOC_ID_MAX + 1];
        int32_t s0, s1;
        kvz_ingest_part_span(n_ctx, parts, p, &s0, &s1);
        if ((rc = kvz_ingest_part_id(doc_id, p + 1, parts, id))) return rc;
        po.part = parts > 1 ? (uint32_t)(p + 1) : 0;
        kvz_ingest_result r;
        rc = kvz_ingest_doc(m, st, id, source_path, ctx + s0, s1 - s0, &po, &r);
        if (cb) {
            kvz_part_report rep = {id, p + 1, parts, s1 - s0, rc, &r};
            int stop = cb(user, &rep);
            if (!rc && stop) return stop;
        }
        if (rc) return rc;
    }
    return kvz_ingest_parts_prune(st, doc_id, source_path, parts, NULL);
}
