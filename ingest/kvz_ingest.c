#include "kvz_ingest.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_kvrow.h"
#include "kvz_backend.h" /* kvzip_select, kv_export_layer: selection, compaction, export on the device */

/* Positions past the document: the repeat pass uses up to chunk + ~64 of them;
 * questions and answers reuse the same positions afterwards, so they get about as
 * many before leaving the trained context. */
#define KVZ_ANSWER_RESERVE 256

void kvz_ingest_defaults(kvz_ingest_opts *o)
{
    memset(o, 0, sizeof *o);
    kvz_kvzip_defaults(&o->kp);
    o->dtype = KVZ_DTYPE_Q8; /* ~0.54x of f16 at <= 0.01 nats dNLL, no accuracy lost (docs/EVAL.md) */
}

int32_t kvz_ingest_max_part_tokens(const kvz_model *m)
{
    const kvz_config *c = kvz_model_config(m);
    int32_t n = c->n_ctx - 64 /* prefix */ - KVZ_KVZIP_CHUNK - 64 /* repeat prompt */ -
                KVZ_ANSWER_RESERVE;
    return n > 256 ? n : 256;
}

void kvz_ingest_blob_meta(const kvz_model *m, const kvz_ingest_opts *o, int32_t n_prefix,
                          int32_t n_ctx, uint32_t *counts, kvz_blob_meta *bm)
{
    const kvz_config *c = kvz_model_config(m);
    memset(bm, 0, sizeof *bm);
    kvz_model_fingerprint(m, bm->fingerprint);
    bm->n_layer = (uint32_t)c->n_layer;
    bm->n_head = (uint32_t)c->n_head;
    bm->n_kv_head = (uint32_t)c->n_kv_head;
    bm->head_dim = (uint32_t)c->head_dim;
    bm->dtype = o->dtype;
    bm->mode = o->kp.mode == KVZ_EVICT_UNIFORM ? KVZ_MODE_UNIFORM : KVZ_MODE_GLOBAL;
    bm->prefix_policy = KVZ_PREFIX_KEEP;
    bm->ratio = o->kp.ratio;
    bm->chunk = (uint32_t)o->kp.chunk;
    bm->overlap = (uint32_t)o->kp.overlap;
    bm->n_prefix = (uint32_t)n_prefix;
    bm->n_context = (uint32_t)n_ctx;
    bm->counts = counts;
}


/* Prefix the error detail with the record it came from ("layer 3 record: ..."). */
static int record_err(int rc, const char *what, uint32_t l)
{
    char d[400];
    snprintf(d, sizeof d, "%s", kvz_error_detail());
    if (l == KVZ_BLOB_META_LAYER) return kvz_error_set(rc, "%sMETA record: %s", what, d);
    return kvz_error_set(rc, "%slayer %u record: %s", what, l, d);
}

/* The prefix blob's META (docs/FORMAT.md §3.1): n_context 0, policy KEEP, every
 * head holding the n_prefix rows; canonical parameters so its hash depends only
 * on the model, the dtype and the prefix tokens. */
void kvz_ingest_prefix_meta(const kvz_blob_meta *doc, uint32_t *counts, kvz_blob_meta *pm)
{
    *pm = *doc;
    pm->mode = KVZ_MODE_GLOBAL;
    pm->prefix_policy = KVZ_PREFIX_KEEP;
    pm->ratio = 1.0f;
    pm->chunk = 1;
    pm->overlap = 0;
    pm->n_context = 0;
    memset(pm->prefix_ref, 0, 16);
    for (size_t i = 0; i < (size_t)doc->n_layer * doc->n_kv_head; i++) counts[i] = doc->n_prefix;
    pm->counts = counts;
}

/* Load the stored prefix blob @p ph into the empty cache @p kv (positions
 * 0..n_prefix-1 of every head): the cache's start, instead of a prefill. */
static int load_prefix(kvz_store *st, const uint8_t ph[16], const uint8_t fp[16], const kvz_blob_meta *pm,
                       kvz_kv *kv)
{
    const size_t hd = pm->head_dim, rb = kvz_blob_kv_row_bytes(pm), H = pm->n_kv_head;
    const size_t rows = (size_t)pm->n_prefix * H;
    uint32_t *pos = malloc(sizeof(uint32_t) * rows);
    int32_t *pf = malloc(sizeof(int32_t) * rows);
    uint8_t *kb = malloc(rb * rows), *vb = malloc(rb * rows);
    float *kf = malloc(sizeof(float) * rows * hd), *vf = malloc(sizeof(float) * rows * hd);
    kvz_blob_meta sm = {0};
    kvz_store_read *r = NULL;
    const uint8_t *rec;
    size_t len;
    int rc = !pos || !pf || !kb || !vb || !kf || !vf ? KVZ_ERR_NOMEM : kvz_store_read_begin(st, &r);
    if (!rc && ((rc = kvz_store_read_prefix(r, ph, KVZ_BLOB_META_LAYER, &rec, &len)) ||
                (rc = kvz_blob_decode_meta(rec, len, fp, &sm))))
        rc = record_err(rc, "shared prefix ", KVZ_BLOB_META_LAYER);
    if (!rc && kvz_blob_meta_id(&sm) != kvz_blob_meta_id(pm))
        rc = kvz_error_set(KVZ_ERR_FORMAT, "shared prefix META differs from the one this model makes");
    for (uint32_t l = 0; l < pm->n_layer && !rc; l++) {
        if ((rc = kvz_store_read_prefix(r, ph, l, &rec, &len)) ||
            (rc = kvz_blob_decode_layer(&sm, l, rec, len, pos, kb, vb))) {
            rc = record_err(rc, "shared prefix ", l);
            break;
        }
        for (size_t i = 0; i < rows; i++) pf[i] = (int32_t)pos[i];
        if (!(rc = kvz_kvrow_decode(pm->dtype, kb, rows, hd, kf)) &&
            !(rc = kvz_kvrow_decode(pm->dtype, vb, rows, hd, vf)))
            rc = kvz_kv_set_layer(kv, (int32_t)l, pm->counts + (size_t)l * H, pf, kf, vf);
    }
    kvz_store_read_end(r);
    kvz_blob_meta_free(&sm);
    free(pos); free(pf); free(kb); free(vb); free(kf); free(vf);
    return rc;
}

/* What kvz_ingest_doc decides before any model work: tokens, blob METAs, content
 * hashes, the doc entry; and whether the content is stored already (linked then). */
typedef struct doc_prep {
    kvz_tokens all;          /* prefix + context tokens */
    int32_t n_prefix, n_ctx;
    int shared;              /* the prefix goes to a shared prefix blob */
    int have_prefix;         /* the store holds that prefix blob */
    int linked;              /* done without model work (stored already) */
    uint32_t *counts;        /* (n_layer, n_kv_head) context rows kept */
    uint32_t *pcounts;       /* (n_layer, n_kv_head) = n_prefix */
    kvz_blob_meta bm, pm;    /* the document's META, the prefix blob's META */
    uint8_t phash[16];
    kvz_store_doc_info info;
    double t0;
} doc_prep;

static void prep_free(doc_prep *d)
{
    free(d->counts);
    free(d->pcounts);
    kvz_tokens_free(&d->all);
    memset(d, 0, sizeof *d);
}

static int prep_doc(kvz_model *m, kvz_store *st, const char *source_path,
                    const int32_t *ctx, int32_t n_ctx, const kvz_ingest_opts *o, kvz_ingest_result *res,
                    doc_prep *d)
{
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    memset(res, 0, sizeof *res);
    memset(d, 0, sizeof *d);
    d->t0 = kvz_now();
    if (!tok) return kvz_error_set(KVZ_ERR_ARG, "ingest needs a model with a tokenizer");
    if (n_ctx <= 0) return kvz_error_set(KVZ_ERR_EMPTY, "document has no tokens");
    if (n_ctx > kvz_ingest_max_part_tokens(m))
        return kvz_error_set(KVZ_ERR_CONTEXT, "%d tokens exceed the %d-token part limit", n_ctx,
                             kvz_ingest_max_part_tokens(m));
    /* bytes of one stored K (or V) row; dtype conversion: format/kvz_kvrow.h */
    const size_t rb = kvz_kv_row_bytes(o->dtype, (size_t)c->head_dim);
    if (!rb)
        return kvz_error_set(KVZ_ERR_ARG, "KV dtype %u cannot hold the model's head_dim %d "
                             "(q8/q4 need a multiple of %d)", o->dtype, c->head_dim, KVZ_KV_QGROUP);

    int rc = kvz_chat_prefix(tok, &d->all);
    const int32_t n_prefix = (int32_t)d->all.n;
    for (int32_t i = 0; i < n_ctx && !rc; i++) rc = kvz_tokens_push(&d->all, ctx[i]);
    if (rc) return rc;
    const int nlh = c->n_layer * c->n_kv_head;
    d->n_prefix = n_prefix;
    d->n_ctx = n_ctx;
    res->n_prefix = n_prefix;
    res->n_ctx = n_ctx;
    res->pairs_total = (int64_t)nlh * n_ctx;
    res->bytes_full = (uint64_t)nlh * (uint64_t)(n_prefix + n_ctx) * 2u * rb;

    /* The system prefix's K/V is the same in every document: stored once as a
     * prefix blob (docs/FORMAT.md §3.1), named by its content hash, referenced here. */
    d->shared = n_prefix > 0;
    d->counts = calloc((size_t)nlh, sizeof *d->counts);
    d->pcounts = calloc((size_t)nlh, sizeof *d->pcounts);
    if (!d->counts || !d->pcounts) return KVZ_ERR_NOMEM;
    kvz_ingest_blob_meta(m, o, n_prefix, n_ctx, d->counts, &d->bm);
    uint8_t params[KVZ_BLOB_PARAMS_SIZE];
    if (d->shared) {
        d->bm.prefix_policy = KVZ_PREFIX_SHARED;
        kvz_ingest_prefix_meta(&d->bm, d->pcounts, &d->pm);
        kvz_blob_params_bytes(&d->pm, params);
        kvz_blob_content_hash(d->pm.fingerprint, params, sizeof params, (size_t)n_prefix, d->all.ids, d->phash);
        memcpy(d->bm.prefix_ref, d->phash, 16);
    }
    kvz_blob_params_bytes(&d->bm, params);
    kvz_blob_content_hash(d->bm.fingerprint, params, sizeof params, d->all.n, d->all.ids, res->hash);

    kvz_store_doc_info *info = &d->info;
    snprintf(info->source_path, sizeof info->source_path, "%s", source_path ? source_path : "");
    info->n_tokens = d->all.n;
    info->ratio = o->kp.ratio;
    info->mode = d->bm.mode;
    info->part = o->part;
    info->bytes_kv_full = res->bytes_full;

    /* already stored (this id or another): link_doc, without model work */
    const int have = kvz_store_has_hash(st, res->hash);
    if (have < 0) return have;
    if (have) {
        d->linked = 1;
        return 0;
    }
    /* the prefix blob already stored: its K/V is the cache's start (no prefill) */
    d->have_prefix = d->shared ? kvz_store_has_prefix(st, d->phash) : 0;
    return d->have_prefix < 0 ? d->have_prefix : 0;
}

/* A prepared document whose content is stored already: name it (one transaction). */
static int link_doc(kvz_store *st, const char *doc_id, kvz_ingest_result *res, doc_prep *d)
{
    kvz_store_doc_info old;
    if (kvz_store_lookup(st, doc_id, &old) == 0 && !memcmp(old.hash, res->hash, 16))
        d->info.bytes_kv_kept = old.bytes_kv_kept;
    else
        d->info.bytes_kv_kept = 0; /* filled from the stored meta by the reader if needed */
    int rc = kvz_store_put_doc(st, doc_id, res->hash, &d->info, NULL, NULL, 0, &res->status);
    if (!rc && kvz_store_lookup(st, doc_id, &old) == 0) {
        res->bytes_stored = old.bytes_stored;
        res->bytes_kept = old.bytes_kv_kept;
    }
    return rc;
}

/* Select, encode and commit a prepared document whose cache @p kv holds its prefix +
 * context rows (every head) and whose scores are @p scores (NULL: on the device,
 * where the cache is compacted). One store transaction. */
static int finish_doc(kvz_model *m, kvz_store *st, const char *doc_id, const kvz_ingest_opts *o,
                      kvz_ingest_result *res, doc_prep *d, kvz_kv *kv, const float *scores)
{
    const kvz_config *c = kvz_model_config(m);
    const int nlh = c->n_layer * c->n_kv_head, hd = c->head_dim, H = c->n_kv_head;
    const int32_t n_prefix = d->n_prefix, n_ctx = d->n_ctx;
    const int shared = d->shared, have_prefix = d->have_prefix, compact = scores == NULL;
    const size_t rb = kvz_kv_row_bytes(o->dtype, (size_t)hd);
    uint32_t *counts = d->counts;
    kvz_blob_meta *bm = &d->bm, *pm = &d->pm;
    int rc = 0;
    uint8_t *keep = malloc((size_t)res->pairs_total);
    uint8_t **recs = calloc(2 * ((size_t)c->n_layer + 1), sizeof *recs); /* doc, then prefix */
    kvz_store_rec *srec = calloc(2 * (size_t)c->n_layer, sizeof *srec);
    float *kf = malloc(sizeof(float) * (size_t)(n_prefix + n_ctx) * hd);
    float *vf = malloc(sizeof(float) * (size_t)(n_prefix + n_ctx) * hd);
    int32_t *pf = malloc(sizeof(int32_t) * (size_t)(n_prefix + n_ctx));
    uint32_t *pos = malloc(sizeof(uint32_t) * (size_t)(n_prefix + n_ctx) * H);
    uint8_t *kb = malloc(rb * (size_t)(n_prefix + n_ctx) * H);
    uint8_t *vb = malloc(rb * (size_t)(n_prefix + n_ctx) * H);
    if (!keep || !recs || !srec || !kf || !vf || !pf || !pos || !kb || !vb) {
        rc = KVZ_ERR_NOMEM;
        goto free_work;
    }

    /* the prefix blob's records, when the store lacks them: rows 0..n_prefix-1 */
    uint8_t **precs = recs + c->n_layer + 1;
    kvz_store_rec *psrec = srec + c->n_layer;
    size_t pmeta_len = 0;
    if (shared && !have_prefix) {
        rc = kvz_blob_encode_meta(pm, o->zstd_level, &precs[c->n_layer], &pmeta_len);
        for (int l = 0; l < c->n_layer && !rc; l++) {
            size_t row = 0, len = 0;
            for (int h = 0; h < H && !rc; h++) {
                if ((rc = kvz_kv_get_head(kv, l, h, kf, vf, pf))) break;
                for (int32_t j = 0; j < n_prefix; j++, row++) pos[row] = (uint32_t)j;
                if (!(rc = kvz_kvrow_encode(o->dtype, kf, (size_t)n_prefix, (size_t)hd, kb + (row - n_prefix) * rb)))
                    rc = kvz_kvrow_encode(o->dtype, vf, (size_t)n_prefix, (size_t)hd, vb + (row - n_prefix) * rb);
            }
            if (!rc) rc = kvz_blob_encode_layer(pm, (uint32_t)l, pos, kb, vb, o->zstd_level, &precs[l], &len);
            psrec[l] = (kvz_store_rec){precs[l], len};
        }
        if (rc) goto free_work;
    }

    int64_t kept;
    const kvz_backend *be = kvz_model_backend(m);
    if (compact) /* the cache then holds only kept rows */
        kept = be->kvzip_select ? be->kvzip_select(kv, n_prefix, n_ctx, o->kp.ratio, o->kp.mode, keep, counts)
                                : kvz_error_set(KVZ_ERR_ARG, "ingest: no scores");
    else
        kept = kvz_kvzip_select(scores, c->n_layer, H, n_ctx, o->kp.ratio, o->kp.mode, keep, counts);
    if (kept < 0) {
        rc = (int)kept;
        goto free_work;
    }
    res->pairs_kept = kept;
    if (!shared)
        for (int i = 0; i < nlh; i++) counts[i] += (uint32_t)n_prefix; /* (no prefix: +0) */
    res->bytes_kept = (uint64_t)(kept + (int64_t)nlh * n_prefix) * 2u * rb;
    d->info.bytes_kv_kept = res->bytes_kept;

    /* encode: one META + one LAYER record per layer, context rows only (SHARED) */
    size_t meta_len;
    if ((rc = kvz_blob_encode_meta(bm, o->zstd_level, &recs[c->n_layer], &meta_len))) goto free_work;
    const int32_t skip = shared ? n_prefix : 0; /* prefix rows live in the prefix blob */
    for (int l = 0; l < c->n_layer && !rc; l++) {
        size_t row = 0, len = 0;
        if (compact) { /* the compacted device cache holds exactly prefix + kept rows per head:
                          converted on the GPU, one pinned copy per layer */
            const uint32_t *dp;
            const void *dk, *dv;
            const int quant = o->dtype > KVZ_DTYPE_BF16; /* q8/q4: fp32 rows, quantised here */
            rc = be->kv_export_layer(kv, l, quant ? KVZ_DTYPE_F32 : o->dtype, &dp, &dk, &dv);
            size_t n = 0;
            for (int h = 0; h < H; h++) n += skip + counts[(size_t)l * H + h];
            if (!rc && quant) {
                if (!(rc = kvz_kvrow_encode(o->dtype, dk, n, (size_t)hd, kb)))
                    rc = kvz_kvrow_encode(o->dtype, dv, n, (size_t)hd, vb);
                dk = kb;
                dv = vb;
            }
            if (!rc) { /* per head, past its prefix rows */
                const uint32_t *hp[64];
                const void *hk[64], *hv[64];
                size_t off = 0;
                if (H > 64) rc = kvz_error_set(KVZ_ERR_UNSUPPORTED, "more than 64 KV heads");
                for (int h = 0; h < H && !rc; h++) {
                    hp[h] = dp + off + skip;
                    hk[h] = (const uint8_t *)dk + (off + skip) * rb;
                    hv[h] = (const uint8_t *)dv + (off + skip) * rb;
                    off += skip + counts[(size_t)l * H + h];
                }
                if (!rc) rc = kvz_blob_encode_layer_heads(bm, (uint32_t)l, hp, hk, hv, o->zstd_level, &recs[l], &len);
            }
            srec[l] = (kvz_store_rec){recs[l], len};
            continue;
        }
        for (int h = 0; h < H && !rc; h++) {
            if ((rc = kvz_kv_get_head(kv, l, h, kf, vf, pf))) break;
            const uint8_t *kp = keep + ((size_t)l * H + h) * n_ctx;
            for (int32_t j = skip; j < n_prefix + n_ctx; j++) {
                if (j >= n_prefix && !kp[j - n_prefix]) continue;
                pos[row] = (uint32_t)pf[j];
                if ((rc = kvz_kvrow_encode(o->dtype, kf + (size_t)j * hd, 1, (size_t)hd, kb + row * rb)) ||
                    (rc = kvz_kvrow_encode(o->dtype, vf + (size_t)j * hd, 1, (size_t)hd, vb + row * rb)))
                    break;
                row++;
            }
        }
        if (!rc) rc = kvz_blob_encode_layer(bm, (uint32_t)l, pos, kb, vb, o->zstd_level, &recs[l], &len);
        srec[l] = (kvz_store_rec){recs[l], len};
    }
    if (rc) goto free_work;
    kvz_store_rec mrec = {recs[c->n_layer], meta_len};
    if (shared) {
        kvz_store_rec pmrec = {precs[c->n_layer], pmeta_len};
        rc = kvz_store_put_doc_shared(st, doc_id, res->hash, &d->info, &mrec, srec, (uint32_t)c->n_layer, d->phash,
                                      have_prefix ? NULL : &pmrec, have_prefix ? NULL : psrec,
                                      &res->status, NULL);
    } else {
        rc = kvz_store_put_doc(st, doc_id, res->hash, &d->info, &mrec, srec, (uint32_t)c->n_layer, &res->status);
    }
    kvz_store_doc_info now;
    if (!rc && kvz_store_lookup(st, doc_id, &now) == 0) res->bytes_stored = now.bytes_stored;
free_work:
    if (recs)
        for (int l = 0; l < 2 * (c->n_layer + 1); l++) free(recs[l]);
    free(recs);
    free(srec);
    free(keep);
    free(kf); free(vf); free(pf); free(pos); free(kb); free(vb);
    return rc;
}

/* Prefill + score one prepared document in a cache of its own, then finish it. */
static int compute_doc(kvz_model *m, kvz_store *st, const char *doc_id, const int32_t *ctx,
                       const kvz_ingest_opts *o, kvz_ingest_result *res, doc_prep *d)
{
    const int32_t n_prefix = d->n_prefix, n_ctx = d->n_ctx;
    kvz_kv *kv = NULL;
    float *scores = malloc(sizeof(float) * (size_t)res->pairs_total);
    if (!scores) return KVZ_ERR_NOMEM;
    int rc = 0;
    const int64_t cap = kvz_kvzip_cache_rows(m, n_prefix, n_ctx, &o->kp);
    if (cap < 0) rc = (int)cap;
    if (!rc) rc = kvz_kv_create(m, cap, 0, &kv);
    /* device: scores stay there; top-k and compaction on the GPU */
    const int compact = kvz_model_backend(m)->kvzip_select != NULL;
    if (rc) {
    } else if (d->have_prefix) {
        /* stored prefix rows, then prefill only the context and score it */
        if (!(rc = load_prefix(st, d->phash, d->bm.fingerprint, &d->pm, kv)))
            rc = kvz_kvzip_prefill_score(m, kv, d->all.ids, n_prefix, n_prefix, ctx, n_ctx, &o->kp,
                                         compact ? NULL : scores, o->progress, o->progress_ctx);
    } else {
        rc = kvz_kvzip_score(m, kv, d->all.ids, n_prefix, ctx, n_ctx, &o->kp, compact ? NULL : scores,
                             o->progress, o->progress_ctx);
    }
    if (!rc) rc = finish_doc(m, st, doc_id, o, res, d, kv, compact ? NULL : scores);
    free(scores);
    kvz_kv_free(kv);
    return rc;
}

int kvz_ingest_doc(kvz_model *m, kvz_store *st, const char *doc_id, const char *source_path,
                   const int32_t *ctx, int32_t n_ctx, const kvz_ingest_opts *o,
                   kvz_ingest_result *res)
{
    doc_prep d;
    int rc = prep_doc(m, st, source_path, ctx, n_ctx, o, res, &d);
    if (!rc) rc = d.linked ? link_doc(st, doc_id, res, &d) : compute_doc(m, st, doc_id, ctx, o, res, &d);
    res->seconds = kvz_now() - d.t0;
    prep_free(&d);
    return rc;
}

/* ---- several short documents per forward pass (kvz_ingest_docs) ---- */

/* Tokens of a batched pass: batch_tokens, at most one internal CPU pass (1,024). */
static int32_t pass_tokens(const kvz_ingest_opts *o)
{
    return o->kp.batch_tokens < 1024 ? o->kp.batch_tokens : 1024;
}

/* Tokens document @p d takes in a batched pass, or 0 when it goes alone: batching
 * needs the shared prefix stored (the batch cache starts from it) and a short
 * document (kvz_kvzip_batch_len). */
static int32_t batch_len(const kvz_model *m, const kvz_ingest_opts *o, const doc_prep *d)
{
    if (o->kp.batch_tokens <= 0 || !d->shared || d->have_prefix != 1 || d->linked) return 0;
    const int32_t len = kvz_kvzip_batch_len(m, d->n_ctx, &o->kp);
    return len > 0 && len <= pass_tokens(o) ? len : 0;
}

/* Document @p d's prefix + context rows out of the batch cache @p bkv (context at
 * rows n_prefix + row0) into @p kv (cleared first), head-major per layer. */
static int extract_doc(const kvz_model *m, const kvz_kv *bkv, const doc_prep *d, int64_t row0, kvz_kv *kv)
{
    const kvz_config *c = kvz_model_config(m);
    const int H = c->n_kv_head, hd = c->head_dim;
    const int32_t np = d->n_prefix, nc = d->n_ctx, per = np + nc;
    float *k = malloc(sizeof(float) * (size_t)per * H * hd), *v = malloc(sizeof(float) * (size_t)per * H * hd);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)per * H);
    uint32_t *cnt = malloc(sizeof(uint32_t) * (size_t)H);
    int rc = k && v && pos && cnt ? 0 : KVZ_ERR_NOMEM;
    kvz_kv_clear(kv);
    for (int32_t l = 0; l < c->n_layer && !rc; l++) {
        for (int h = 0; h < H && !rc; h++) {
            const float *bk, *bv;
            const int32_t *bp;
            int64_t len;
            if ((rc = kvz_kv_view(bkv, l, h, &bk, &bv, &bp, &len))) break;
            if (len < np + row0 + nc) {
                rc = kvz_error_set(KVZ_ERR_ARG, "batch cache: %lld rows, document needs %lld", (long long)len,
                                   (long long)(np + row0 + nc));
                break;
            }
            const size_t o = (size_t)h * per;
            memcpy(k + o * hd, bk, sizeof(float) * (size_t)np * hd);
            memcpy(v + o * hd, bv, sizeof(float) * (size_t)np * hd);
            memcpy(pos + o, bp, sizeof(int32_t) * (size_t)np);
            memcpy(k + (o + np) * hd, bk + (size_t)(np + row0) * hd, sizeof(float) * (size_t)nc * hd);
            memcpy(v + (o + np) * hd, bv + (size_t)(np + row0) * hd, sizeof(float) * (size_t)nc * hd);
            memcpy(pos + o + np, bp + np + row0, sizeof(int32_t) * (size_t)nc);
            cnt[h] = (uint32_t)per;
        }
        if (!rc) rc = kvz_kv_set_layer(kv, l, cnt, pos, k, v);
    }
    free(k); free(v); free(pos); free(cnt);
    return rc;
}

/* Score the group [g0, g1) of prepared short documents in one pass and finish each;
 * reports through @p done. If the pass itself fails, every document of the group is
 * computed alone instead, so that one bad document cannot take the others with it.
 * @return the number of documents reported; *stop = 1 when the callback stopped. */
static int32_t run_group(kvz_model *m, kvz_store *st, const kvz_ingest_item *it, int32_t g0, int32_t g1,
                         const kvz_ingest_opts *o, doc_prep *dp, kvz_ingest_result *res,
                         kvz_ingest_item_fn done, void *done_ctx, int *stop)
{
    const int32_t k = g1 - g0;
    const doc_prep *d0 = &dp[g0];
    const double t0 = kvz_now();
    const int32_t **ctx = malloc(sizeof *ctx * (size_t)k);
    int32_t *nctx = malloc(sizeof *nctx * (size_t)k);
    float **sc = calloc((size_t)k, sizeof *sc);
    int64_t *row0 = malloc(sizeof *row0 * (size_t)k), rows = d0->n_prefix + 16;
    int32_t max_ctx = 0;
    int rc = ctx && nctx && sc && row0 ? 0 : KVZ_ERR_NOMEM;
    for (int32_t i = 0; i < k && !rc; i++) {
        const doc_prep *d = &dp[g0 + i];
        ctx[i] = it[g0 + i].ctx;
        nctx[i] = d->n_ctx;
        rows += batch_len(m, o, d);
        max_ctx = d->n_ctx > max_ctx ? d->n_ctx : max_ctx;
        if (!(sc[i] = malloc(sizeof(float) * (size_t)res[g0 + i].pairs_total))) rc = KVZ_ERR_NOMEM;
    }
    kvz_kv *bkv = NULL, *kv = NULL;
    if (!rc) rc = kvz_kv_create(m, rows, 0, &bkv);
    if (!rc) rc = kvz_kv_create(m, (int64_t)d0->n_prefix + max_ctx, 0, &kv);
    kvz_ingest_opts po = *o;
    po.progress = NULL; /* reported once per document below */
    if (!rc) rc = load_prefix(st, d0->phash, d0->bm.fingerprint, &d0->pm, bkv);
    if (!rc) rc = kvz_kvzip_score_batch(m, bkv, d0->n_prefix, ctx, nctx, k, &o->kp, sc, row0);
    const double share = (kvz_now() - t0) / k; /* each document's part of the pass */
    int32_t reported = 0;
    for (int32_t i = 0; i < k; i++) {
        const int32_t j = g0 + i;
        const double t1 = kvz_now();
        int drc;
        po.part = it[j].part;
        if (rc) { /* the pass failed: this document alone */
            drc = compute_doc(m, st, it[j].doc_id, it[j].ctx, &po, &res[j], &dp[j]);
        } else {
            drc = extract_doc(m, bkv, &dp[j], row0[i], kv);
            if (!drc) drc = finish_doc(m, st, it[j].doc_id, &po, &res[j], &dp[j], kv, sc[i]);
        }
        res[j].seconds = (rc ? 0 : share) + (kvz_now() - t1);
        if (!drc && o->progress) {
            const int64_t total = 2 * (int64_t)dp[j].n_ctx + 32;
            drc = o->progress(o->progress_ctx, total, total);
        }
        reported++;
        if (done && done(done_ctx, j, drc, &res[j])) {
            *stop = 1;
            break;
        }
    }
    kvz_kv_free(bkv);
    kvz_kv_free(kv);
    for (int32_t i = 0; sc && i < k; i++) free(sc[i]);
    free(sc);
    free(ctx);
    free(nctx);
    free(row0);
    return reported;
}

int32_t kvz_ingest_docs(kvz_model *m, kvz_store *st, const kvz_ingest_item *items, int32_t n,
                        const kvz_ingest_opts *o, kvz_ingest_item_fn done, void *done_ctx)
{
    if (n <= 0) return 0;
    doc_prep *dp = calloc((size_t)n, sizeof *dp);
    kvz_ingest_result *res = calloc((size_t)n, sizeof *res);
    if (!dp || !res) {
        free(dp);
        free(res);
        for (int32_t i = 0; i < n; i++) {
            kvz_error_set(KVZ_ERR_NOMEM, "ingest: no memory for the batch");
            kvz_ingest_result r;
            memset(&r, 0, sizeof r);
            if (done && done(done_ctx, i, KVZ_ERR_NOMEM, &r)) return i + 1;
        }
        return n;
    }
    kvz_ingest_opts po = *o;
    int32_t i = 0, reported = 0;
    while (i < n) {
        po.part = items[i].part;
        int rc = prep_doc(m, st, items[i].source_path, items[i].ctx, items[i].n_ctx, &po,
                          &res[i], &dp[i]);
        const int32_t len = rc ? 0 : batch_len(m, o, &dp[i]);
        if (rc || !len) { /* alone: an error, a link, or a document that does not batch */
            if (!rc) rc = dp[i].linked ? link_doc(st, items[i].doc_id, &res[i], &dp[i])
                                       : compute_doc(m, st, items[i].doc_id, items[i].ctx, &po, &res[i], &dp[i]);
            res[i].seconds = kvz_now() - dp[i].t0;
            prep_free(&dp[i]);
            reported++;
            if (done && done(done_ctx, i, rc, &res[i])) break;
            i++;
            continue;
        }
        /* a group of consecutive short documents: the same prefix blob, distinct ids and
         * contents (a repeat of an earlier member's content is linked after the group) */
        int32_t g1 = i + 1;
        int64_t tokens = len;
        while (g1 < n) {
            po.part = items[g1].part;
            int prc = prep_doc(m, st, items[g1].source_path, items[g1].ctx, items[g1].n_ctx,
                               &po, &res[g1], &dp[g1]);
            const int32_t l = prc ? 0 : batch_len(m, o, &dp[g1]);
            int fits = l > 0 && tokens + l <= pass_tokens(o) && !memcmp(dp[g1].phash, dp[i].phash, 16);
            for (int32_t j = i; j < g1 && fits; j++)
                fits = memcmp(res[j].hash, res[g1].hash, 16) && strcmp(items[j].doc_id, items[g1].doc_id);
            if (!fits) {
                prep_free(&dp[g1]); /* prepared again after the group is stored */
                kvz_error_clear();
                break;
            }
            tokens += l;
            g1++;
        }
        int stop = 0;
        reported += run_group(m, st, items, i, g1, o, dp, res, done, done_ctx, &stop);
        for (int32_t j = i; j < g1; j++) prep_free(&dp[j]);
        if (stop) break;
        i = g1;
    }
    for (int32_t j = 0; j < n; j++) prep_free(&dp[j]);
    free(dp);
    free(res);
    return reported;
}

int kvz_doc_load(kvz_model *m, kvz_store *st, const char *doc_id, int64_t extra_rows,
                 int32_t out_slots, kvz_kv **out, kvz_doc_meta *meta)
{
    const kvz_config *c = kvz_model_config(m);
    *out = NULL;
    memset(meta, 0, sizeof *meta);
    const double t0 = kvz_now();
    uint8_t fp[16];
    kvz_model_fingerprint(m, fp);
    kvz_store_read *r;
    int rc = kvz_store_read_begin(st, &r);
    if (rc) return rc;
    const uint8_t *rec;
    size_t len;
    kvz_blob_meta bm, pm; /* the document's blob; its shared prefix blob (SHARED) */
    memset(&bm, 0, sizeof bm);
    memset(&pm, 0, sizeof pm);
    kvz_kv *kv = NULL;
    float *kf = NULL, *vf = NULL, *ck = NULL, *cv = NULL;
    int32_t *pf = NULL;
    uint32_t *pos = NULL, *cnt = NULL;
    void *kb = NULL, *vb = NULL;
    if ((rc = kvz_store_read_doc(r, doc_id, &meta->info))) {
        if (rc == KVZ_ERR_NOTFOUND) kvz_error_set(rc, "no document '%s' in the store", doc_id);
        goto out;
    }
    if ((rc = kvz_store_read_meta(r, meta->info.hash, &rec, &len)) ||
        (rc = kvz_blob_decode_meta(rec, len, fp, &bm))) {
        rc = record_err(rc, "", KVZ_BLOB_META_LAYER);
        goto out;
    }
    if (bm.n_layer != (uint32_t)c->n_layer || bm.n_kv_head != (uint32_t)c->n_kv_head ||
        bm.head_dim != (uint32_t)c->head_dim || bm.n_head != (uint32_t)c->n_head) {
        rc = kvz_error_set(KVZ_ERR_FORMAT, "blob dims differ from the model's");
        goto out;
    }
    /* SHARED: the prefix rows come from the prefix blob, P per head, placed first */
    const uint32_t P = bm.prefix_policy == KVZ_PREFIX_SHARED ? bm.n_prefix : 0, H = bm.n_kv_head;
    if (P) {
        if ((rc = kvz_store_read_prefix(r, bm.prefix_ref, KVZ_BLOB_META_LAYER, &rec, &len)) ||
            (rc = kvz_blob_decode_meta(rec, len, fp, &pm))) {
            rc = record_err(rc, "shared prefix ", KVZ_BLOB_META_LAYER);
            goto out;
        }
        if (pm.n_layer != bm.n_layer || pm.n_kv_head != H || pm.head_dim != bm.head_dim ||
            pm.n_head != bm.n_head || pm.dtype != bm.dtype || pm.n_prefix != P || pm.n_context != 0 ||
            pm.prefix_policy != KVZ_PREFIX_KEEP) {
            rc = kvz_error_set(KVZ_ERR_FORMAT, "shared prefix blob does not fit the document's blob");
            goto out;
        }
    }
    meta->n_prefix = (int32_t)bm.n_prefix;
    meta->n_ctx = (int32_t)bm.n_context;
    meta->ratio = bm.ratio;
    meta->dtype = bm.dtype;
    meta->mode = bm.mode;
    uint32_t max_rows = 0, max_layer = 0;
    for (uint32_t l = 0; l < bm.n_layer; l++) {
        const uint64_t k = kvz_blob_layer_kept(&bm, l) + (uint64_t)P * H;
        meta->rows += k;
        if (k > max_layer) max_layer = (uint32_t)k;
        for (uint32_t h = 0; h < H; h++)
            if (P + bm.counts[l * H + h] > max_rows) max_rows = P + bm.counts[l * H + h];
    }
    if ((rc = kvz_kv_create(m, (int64_t)max_rows + extra_rows, out_slots, &kv))) goto out;
    const size_t rb = kvz_blob_kv_row_bytes(&bm), hd = bm.head_dim;
    /* (max_layer) rows: the prefix rows (P*H) first, then the document's */
    pos = malloc(sizeof(uint32_t) * (max_layer + 1));
    pf = malloc(sizeof(int32_t) * (max_layer + 1));
    cnt = malloc(sizeof(uint32_t) * H);
    kb = malloc(rb * (max_layer + 1));
    vb = malloc(rb * (max_layer + 1));
    kf = malloc(sizeof(float) * (max_layer + 1) * hd);
    vf = malloc(sizeof(float) * (max_layer + 1) * hd);
    ck = P ? malloc(sizeof(float) * (max_layer + 1) * hd) : NULL;
    cv = P ? malloc(sizeof(float) * (max_layer + 1) * hd) : NULL;
    if (!pos || !pf || !cnt || !kb || !vb || !kf || !vf || (P && (!ck || !cv))) {
        rc = KVZ_ERR_NOMEM;
        goto out;
    }
    const size_t pr = (size_t)P * H; /* prefix rows of a layer */
    for (uint32_t l = 0; l < bm.n_layer; l++) {
        if (P && ((rc = kvz_store_read_prefix(r, bm.prefix_ref, l, &rec, &len)) ||
                  (rc = kvz_blob_decode_layer(&pm, l, rec, len, pos, kb, vb)))) {
            rc = record_err(rc, "shared prefix ", l);
            goto out;
        }
        if ((rc = kvz_store_read_layer(r, meta->info.hash, l, &rec, &len)) ||
            (rc = kvz_blob_decode_layer(&bm, l, rec, len, pos + pr, (uint8_t *)kb + pr * rb,
                                        (uint8_t *)vb + pr * rb))) {
            rc = record_err(rc, "", l);
            goto out;
        }
        const uint64_t n = pr + kvz_blob_layer_kept(&bm, l);
        if ((rc = kvz_kvrow_decode(bm.dtype, kb, n, hd, kf)) || (rc = kvz_kvrow_decode(bm.dtype, vb, n, hd, vf)))
            goto out;
        const float *lk = kf, *lv = vf;
        for (uint64_t i = 0; i < n; i++) pf[i] = (int32_t)pos[i];
        for (uint32_t h = 0; h < H; h++) cnt[h] = P + bm.counts[l * H + h];
        if (P) { /* head-major: head h = its P prefix rows, then its document rows */
            int32_t *cp = (int32_t *)malloc(sizeof(int32_t) * n);
            if (!cp) { rc = KVZ_ERR_NOMEM; goto out; }
            size_t o = 0, d = pr;
            for (uint32_t h = 0; h < H; h++) {
                memcpy(ck + o * hd, kf + (size_t)h * P * hd, sizeof(float) * P * hd);
                memcpy(cv + o * hd, vf + (size_t)h * P * hd, sizeof(float) * P * hd);
                for (uint32_t i = 0; i < P; i++) cp[o + i] = (int32_t)pos[(size_t)h * P + i];
                o += P;
                const size_t c_h = bm.counts[l * H + h];
                memcpy(ck + o * hd, kf + d * hd, sizeof(float) * c_h * hd);
                memcpy(cv + o * hd, vf + d * hd, sizeof(float) * c_h * hd);
                for (size_t i = 0; i < c_h; i++) cp[o + i] = (int32_t)pos[d + i];
                o += c_h;
                d += c_h;
            }
            memcpy(pf, cp, sizeof(int32_t) * n);
            free(cp);
            lk = ck;
            lv = cv;
        }
        if ((rc = kvz_kv_set_layer(kv, (int32_t)l, cnt, pf, lk, lv))) goto out;
    }
out:
    kvz_store_read_end(r);
    kvz_blob_meta_free(&bm);
    kvz_blob_meta_free(&pm);
    free(pos); free(pf); free(cnt); free(kb); free(vb); free(kf); free(vf); free(ck); free(cv);
    if (rc) {
        kvz_kv_free(kv);
        return rc;
    }
    meta->load_s = kvz_now() - t0;
    *out = kv;
    return 0;
}
