#include "kvz_ingest.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_generate.h"
#include "kvz_kvrow.h"
#ifdef KVZ_HAVE_CUDA
#include "kvz_model_impl.h" /* kvz_cuda_kvzip_select: selection + compaction on the device */
#endif

/* Positions past the document: the repeat pass uses up to chunk + ~64 of them;
 * questions and answers reuse the same positions afterwards, so they get about as
 * many before leaving the trained context. */
#define KVZ_ANSWER_RESERVE 256

void kvz_ingest_defaults(kvz_ingest_opts *o)
{
    memset(o, 0, sizeof *o);
    kvz_kvzip_defaults(&o->kp);
    o->dtype = KVZ_DTYPE_F16;
}

int32_t kvz_ingest_max_part_tokens(const kvz_model *m)
{
    const kvz_config *c = kvz_model_config(m);
    int32_t n = c->n_ctx - 64 /* prefix */ - KVZ_KVZIP_CHUNK - 64 /* repeat prompt */ -
                KVZ_ANSWER_RESERVE;
    return n > 256 ? n : 256;
}

static void fill_meta(const kvz_model *m, const kvz_ingest_opts *o, int32_t n_prefix,
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


int kvz_ingest_doc(kvz_model *m, kvz_store *st, const char *doc_id, const char *source_path,
                   const int32_t *ctx, int32_t n_ctx, const kvz_ingest_opts *o,
                   kvz_ingest_result *res)
{
    const kvz_config *c = kvz_model_config(m);
    const kvz_tokenizer *tok = kvz_model_tokenizer(m);
    memset(res, 0, sizeof *res);
    const double t0 = kvz_now();
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

    kvz_tokens all = {0};
    int rc = kvz_chat_prefix(tok, &all);
    const int32_t n_prefix = (int32_t)all.n;
    for (int32_t i = 0; i < n_ctx && !rc; i++) rc = kvz_tokens_push(&all, ctx[i]);
    if (rc) {
        kvz_tokens_free(&all);
        return rc;
    }
    const int nlh = c->n_layer * c->n_kv_head;
    const int hd = c->head_dim;
    res->n_prefix = n_prefix;
    res->n_ctx = n_ctx;
    res->pairs_total = (int64_t)nlh * n_ctx;
    res->bytes_full = (uint64_t)nlh * (uint64_t)(n_prefix + n_ctx) * 2u * rb;

    uint32_t *counts = calloc((size_t)nlh, sizeof *counts);
    kvz_blob_meta bm;
    fill_meta(m, o, n_prefix, n_ctx, counts, &bm);
    uint8_t params[KVZ_BLOB_PARAMS_SIZE];
    kvz_blob_params_bytes(&bm, params);
    kvz_blob_content_hash(bm.fingerprint, params, sizeof params, all.n, all.ids, res->hash);

    kvz_store_doc_info info;
    memset(&info, 0, sizeof info);
    snprintf(info.source_path, sizeof info.source_path, "%s", source_path ? source_path : "");
    info.n_tokens = all.n;
    info.ratio = o->kp.ratio;
    info.mode = bm.mode;
    info.bytes_kv_full = res->bytes_full;

    /* already stored (this id or another): link without model work */
    kvz_store_doc_info old;
    int have = kvz_store_has_hash(st, res->hash);
    if (have < 0) {
        rc = have;
        goto done;
    }
    if (have) {
        if (kvz_store_lookup(st, doc_id, &old) == 0 && !memcmp(old.hash, res->hash, 16))
            info.bytes_kv_kept = old.bytes_kv_kept;
        else
            info.bytes_kv_kept = 0; /* filled from the stored meta by the reader if needed */
        rc = kvz_store_put_doc(st, doc_id, res->hash, &info, NULL, NULL, 0, &res->status);
        if (!rc && kvz_store_lookup(st, doc_id, &old) == 0) {
            res->bytes_stored = old.bytes_stored;
            res->bytes_kept = old.bytes_kv_kept;
        }
        goto done;
    }

    /* score, select */
    kvz_kv *kv = NULL;
    float *scores = malloc(sizeof(float) * (size_t)res->pairs_total);
    uint8_t *keep = malloc((size_t)res->pairs_total);
    uint8_t **recs = calloc((size_t)c->n_layer + 1, sizeof *recs);
    kvz_store_rec *srec = calloc((size_t)c->n_layer, sizeof *srec);
    if (!scores || !keep || !recs || !srec || !counts) {
        rc = KVZ_ERR_NOMEM;
        goto free_work;
    }
    const int64_t cap = kvz_kvzip_cache_rows(m, n_prefix, n_ctx, &o->kp);
    if (cap < 0) {
        rc = (int)cap;
        goto free_work;
    }
    if ((rc = kvz_kv_create(m, cap, 0, &kv)))
        goto free_work;
    int compact = 0; /* device: scores stay there; top-k and compaction on the GPU */
#ifdef KVZ_HAVE_CUDA
    compact = kvz_model_device(m) == KVZ_DEVICE_CUDA;
#endif
    if ((rc = kvz_kvzip_score(m, kv, all.ids, n_prefix, ctx, n_ctx, &o->kp, compact ? NULL : scores,
                              o->progress, o->progress_ctx)))
        goto free_work;
    int64_t kept;
#ifdef KVZ_HAVE_CUDA
    if (compact) { /* the cache then holds only kept rows */
        kept = kvz_cuda_kvzip_select(kv, n_prefix, n_ctx, o->kp.ratio, o->kp.mode, keep, counts);
    } else
#endif
        kept = kvz_kvzip_select(scores, c->n_layer, c->n_kv_head, n_ctx, o->kp.ratio,
                                o->kp.mode, keep, counts);
    if (kept < 0) {
        rc = (int)kept;
        goto free_work;
    }
    res->pairs_kept = kept;
    for (int i = 0; i < nlh; i++) counts[i] += (uint32_t)n_prefix; /* prefix always kept */
    res->bytes_kept = (uint64_t)(kept + (int64_t)nlh * n_prefix) * 2u * rb;
    info.bytes_kv_kept = res->bytes_kept;

    /* encode: one META + one LAYER record per layer */
    size_t meta_len;
    if ((rc = kvz_blob_encode_meta(&bm, o->zstd_level, &recs[c->n_layer], &meta_len))) goto free_work;
    {
        uint32_t max_rows = 0;
        for (int i = 0; i < nlh; i++) max_rows = counts[i] > max_rows ? counts[i] : max_rows;
        uint32_t *pos = malloc(sizeof(uint32_t) * (size_t)max_rows * c->n_kv_head);
        uint8_t *kb = malloc(rb * (size_t)max_rows * c->n_kv_head);
        uint8_t *vb = malloc(rb * (size_t)max_rows * c->n_kv_head);
        float *kf = malloc(sizeof(float) * (size_t)(n_prefix + n_ctx) * hd);
        float *vf = malloc(sizeof(float) * (size_t)(n_prefix + n_ctx) * hd);
        int32_t *pf = malloc(sizeof(int32_t) * (size_t)(n_prefix + n_ctx));
        if (!pos || !kb || !vb || !kf || !vf || !pf) rc = KVZ_ERR_NOMEM;
        for (int l = 0; l < c->n_layer && !rc; l++) {
            size_t row = 0;
#ifdef KVZ_HAVE_CUDA
            if (compact) { /* the compacted device cache holds exactly the stored rows:
                              converted on the GPU, one pinned copy per layer */
                const uint32_t *dp;
                const void *dk, *dv;
                size_t len = 0;
                const int quant = o->dtype > KVZ_DTYPE_BF16; /* q8/q4: fp32 rows, quantised here */
                rc = kvz_cuda_kv_export_layer(kv, l, quant ? KVZ_DTYPE_F32 : o->dtype, &dp, &dk, &dv);
                if (!rc && quant) {
                    const size_t n = kvz_blob_layer_kept(&bm, (uint32_t)l);
                    if (!(rc = kvz_kvrow_encode(o->dtype, dk, n, (size_t)hd, kb)))
                        rc = kvz_kvrow_encode(o->dtype, dv, n, (size_t)hd, vb);
                    dk = kb;
                    dv = vb;
                }
                if (!rc) rc = kvz_blob_encode_layer(&bm, (uint32_t)l, dp, dk, dv, o->zstd_level, &recs[l], &len);
                srec[l].data = recs[l];
                srec[l].len = len;
                continue;
            }
#endif
            for (int h = 0; h < c->n_kv_head && !rc; h++) {
                if ((rc = kvz_kv_get_head(kv, l, h, kf, vf, pf))) break;
                const uint8_t *kp = keep + ((size_t)l * c->n_kv_head + h) * n_ctx;
                const int32_t nrows = compact ? (int32_t)counts[(size_t)l * c->n_kv_head + h]
                                              : n_prefix + n_ctx;
                for (int32_t j = 0; j < nrows; j++) {
                    if (!compact && j >= n_prefix && !kp[j - n_prefix]) continue;
                    pos[row] = (uint32_t)pf[j];
                    if ((rc = kvz_kvrow_encode(o->dtype, kf + (size_t)j * hd, 1, (size_t)hd, kb + row * rb)) ||
                        (rc = kvz_kvrow_encode(o->dtype, vf + (size_t)j * hd, 1, (size_t)hd, vb + row * rb)))
                        break;
                    row++;
                }
            }
            size_t len = 0;
            if (!rc) rc = kvz_blob_encode_layer(&bm, (uint32_t)l, pos, kb, vb, o->zstd_level, &recs[l], &len);
            srec[l].data = recs[l];
            srec[l].len = len;
        }
        free(pos); free(kb); free(vb); free(kf); free(vf); free(pf);
    }
    if (rc) goto free_work;
    kvz_store_rec mrec = {recs[c->n_layer], meta_len};
    rc = kvz_store_put_doc(st, doc_id, res->hash, &info, &mrec, srec, (uint32_t)c->n_layer, &res->status);
    if (!rc && kvz_store_lookup(st, doc_id, &old) == 0) res->bytes_stored = old.bytes_stored;
free_work:
    if (recs)
        for (int l = 0; l <= c->n_layer; l++) free(recs[l]);
    free(recs);
    free(srec);
    free(scores);
    free(keep);
    kvz_kv_free(kv);
done:
    free(counts);
    kvz_tokens_free(&all);
    res->seconds = kvz_now() - t0;
    return rc;
}

/* Prefix the error detail with the record it came from ("layer 3 record: ..."). */
static int record_err(int rc, const char *what, uint32_t l)
{
    char d[400];
    snprintf(d, sizeof d, "%s", kvz_error_detail());
    if (l == KVZ_BLOB_META_LAYER) return kvz_error_set(rc, "%sMETA record: %s", what, d);
    return kvz_error_set(rc, "%slayer %u record: %s", what, l, d);
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
    kvz_blob_meta bm;
    memset(&bm, 0, sizeof bm);
    kvz_kv *kv = NULL;
    float *kf = NULL, *vf = NULL;
    int32_t *pf = NULL;
    uint32_t *pos = NULL;
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
    meta->n_prefix = (int32_t)bm.n_prefix;
    meta->n_ctx = (int32_t)bm.n_context;
    meta->ratio = bm.ratio;
    meta->dtype = bm.dtype;
    meta->mode = bm.mode;
    uint32_t max_rows = 0, max_layer = 0;
    for (uint32_t l = 0; l < bm.n_layer; l++) {
        const uint64_t k = kvz_blob_layer_kept(&bm, l);
        meta->rows += k;
        if (k > max_layer) max_layer = (uint32_t)k;
        for (uint32_t h = 0; h < bm.n_kv_head; h++)
            if (bm.counts[l * bm.n_kv_head + h] > max_rows) max_rows = bm.counts[l * bm.n_kv_head + h];
    }
    if ((rc = kvz_kv_create(m, (int64_t)max_rows + extra_rows, out_slots, &kv))) goto out;
    const size_t rb = kvz_blob_kv_row_bytes(&bm), hd = bm.head_dim;
    pos = malloc(sizeof(uint32_t) * (max_layer + 1));
    pf = malloc(sizeof(int32_t) * (max_layer + 1));
    kb = malloc(rb * (max_layer + 1));
    vb = malloc(rb * (max_layer + 1));
    kf = malloc(sizeof(float) * (max_layer + 1) * hd);
    vf = malloc(sizeof(float) * (max_layer + 1) * hd);
    if (!pos || !pf || !kb || !vb || !kf || !vf) {
        rc = KVZ_ERR_NOMEM;
        goto out;
    }
    for (uint32_t l = 0; l < bm.n_layer; l++) {
        if ((rc = kvz_store_read_layer(r, meta->info.hash, l, &rec, &len)) ||
            (rc = kvz_blob_decode_layer(&bm, l, rec, len, pos, kb, vb))) {
            rc = record_err(rc, "", l);
            goto out;
        }
        const uint64_t n = kvz_blob_layer_kept(&bm, l);
        for (uint64_t i = 0; i < n; i++) pf[i] = (int32_t)pos[i];
        if ((rc = kvz_kvrow_decode(bm.dtype, kb, n, hd, kf)) || (rc = kvz_kvrow_decode(bm.dtype, vb, n, hd, vf)))
            goto out;
        if ((rc = kvz_kv_set_layer(kv, (int32_t)l, bm.counts + l * bm.n_kv_head, pf, kf, vf))) goto out;
    }
out:
    kvz_store_read_end(r);
    kvz_blob_meta_free(&bm);
    free(pos); free(pf); free(kb); free(vb); free(kf); free(vf);
    if (rc) {
        kvz_kv_free(kv);
        return rc;
    }
    meta->load_s = kvz_now() - t0;
    *out = kv;
    return 0;
}
