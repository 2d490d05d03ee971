/* The store's reports (store/kvz_store_admin.h, store/kvz_store_report.h) against a
 * small real LMDB store built from the blob fixture: every figure of the document
 * entry, the document detail, the store totals, verify, gc --compact, salvage and
 * merge objects is checked against values computed here from the records we wrote
 * (record lengths, fixture counts, stat of data.mdb), not against the library's own
 * arithmetic. Also: the key order kvzip-store --json prints, U+FFFD for ids that are
 * not UTF-8, the part count of a split id and the failing step of a missing document. */
#include "blob_fixture.h"
#include "kvz_blob.h"
#include "kvz_error.h"
#include "kvz_store.h"
#include "kvz_store_admin.h"
#include "kvz_store_merge.h"
#include "kvz_store_report.h"
#include "kvz_test.h"

#include <jansson.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

static uint8_t *g_meta;
static size_t g_meta_len;
static kvz_store_rec g_layers[FX_L];
static uint64_t g_stored; /* META + layer record bytes, as written */

static void make_records(void)
{
    static fx_cache c;
    fx_make(&c, KVZ_DTYPE_F16);
    if (kvz_blob_encode_meta(&c.meta, 1, &g_meta, &g_meta_len)) abort();
    g_stored = g_meta_len;
    for (uint32_t l = 0; l < FX_L; l++) {
        uint8_t *rec;
        size_t n;
        if (kvz_blob_encode_layer(&c.meta, l, c.pos[l], c.k[l], c.v[l], 1, &rec, &n)) abort();
        g_layers[l] = (kvz_store_rec){rec, n};
        g_stored += n;
    }
}

static int put(kvz_store *s, const char *id, uint8_t hb)
{
    kvz_store_doc_info in;
    memset(&in, 0, sizeof in);
    snprintf(in.source_path, sizeof in.source_path, "src/%s", id);
    in.n_tokens = 12;
    in.ratio = 0.5f;
    in.bytes_kv_full = 1000;
    in.bytes_kv_kept = 400;
    in.ingest_time = 1700000000; /* 2023-11-14 22:13:20 UTC */
    uint8_t h[16];
    memset(h, hb, 16);
    return kvz_store_put_doc(s, id, h, &in, &(kvz_store_rec){g_meta, g_meta_len}, g_layers, FX_L, NULL);
}

static json_int_t geti(const json_t *o, const char *k) { return json_integer_value(json_object_get(o, k)); }
static double getr(const json_t *o, const char *k) { return json_real_value(json_object_get(o, k)); }
static const char *gets(const json_t *o, const char *k) { return json_string_value(json_object_get(o, k)); }

/* The object's keys, in order, joined with ',' */
static int keys_are(const json_t *o, const char *want)
{
    char buf[1024] = "";
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)o, k, v) {
        (void)v;
        if (buf[0]) strncat(buf, ",", sizeof buf - strlen(buf) - 1);
        strncat(buf, k, sizeof buf - strlen(buf) - 1);
    }
    if (strcmp(buf, want)) fprintf(stderr, "keys: %s\nwant: %s\n", buf, want);
    return !strcmp(buf, want);
}

static uint64_t file_size(const char *dir)
{
    char p[512];
    struct stat st;
    snprintf(p, sizeof p, "%s/data.mdb", dir);
    return stat(p, &st) == 0 ? (uint64_t)st.st_size : 0;
}

int main(void)
{
    make_records();
    char dir[] = "/tmp/kvz_report_XXXXXX";
    REQUIRE(mkdtemp(dir));
    char sdir[600], vdir[600], mdir[600];
    snprintf(sdir, sizeof sdir, "%s/s", dir);
    snprintf(vdir, sizeof vdir, "%s/salvaged", dir);
    snprintf(mdir, sizeof mdir, "%s/merged", dir);
    kvz_store *s;
    REQUIRE(kvz_store_open(sdir, KVZ_STORE_CREATE, 0, NULL, &s) == 0);
    kvz_store_stats st0;
    REQUIRE(kvz_store_stats_get(s, &st0) == 0);
    REQUIRE(put(s, "a.txt", 0x11) == 0);
    REQUIRE(put(s, "odd\xff.txt", 0x22) == 0); /* an id that is not UTF-8 */
    REQUIRE(put(s, "p#1", 0x11) == 0);        /* a split document, linked to a.txt's blob */
    REQUIRE(put(s, "p#2", 0x11) == 0);

    /* ---- the ls entry */
    kvz_store_doc_info in;
    REQUIRE(kvz_store_lookup(s, "a.txt", &in) == 0);
    json_t *o = kvz_report_doc("a.txt", &in);
    REQUIRE(o);
    CHECK(keys_are(o, "id,tokens,ratio,mode,bytes_stored,bytes_kv_full,bytes_kv_kept,compression,"
                      "records,hash,ingest_time,date,source"));
    CHECK(!strcmp(gets(o, "id"), "a.txt"));
    CHECK(geti(o, "tokens") == 12);
    CHECK(getr(o, "ratio") == 0.5);
    CHECK(!strcmp(gets(o, "mode"), "global"));
    CHECKF(geti(o, "bytes_stored") == (json_int_t)g_stored, "%lld vs %llu", geti(o, "bytes_stored"),
           (unsigned long long)g_stored);
    CHECK(geti(o, "bytes_kv_full") == 1000 && geti(o, "bytes_kv_kept") == 400);
    CHECK(fabs(getr(o, "compression") - round(1000.0 / g_stored * 1000) / 1000) < 1e-12);
    CHECK(geti(o, "records") == 1 + FX_L);
    CHECK(!strcmp(gets(o, "hash"), "11111111111111111111111111111111"));
    CHECK(geti(o, "ingest_time") == 1700000000);
    CHECK(!strcmp(gets(o, "date"), "2023-11-14 22:13:20"));
    CHECK(!strcmp(gets(o, "source"), "src/a.txt"));
    /* what kvzip-store prints: ", " and ": " separators, short reals */
    char *txt = json_dumps(o, JSON_REAL_PRECISION(15));
    CHECKF(txt && strstr(txt, "{\"id\": \"a.txt\", \"tokens\": 12, \"ratio\": 0.5, "), "%s", txt);
    free(txt);
    json_decref(o);

    /* ---- ids and paths that are not UTF-8: U+FFFD per bad byte; valid text as is */
    REQUIRE(kvz_store_lookup(s, "odd\xff.txt", &in) == 0);
    o = kvz_report_doc("odd\xff.txt", &in);
    CHECK(o && !strcmp(gets(o, "id"), "odd\xEF\xBF\xBD.txt"));
    CHECK(o && !strcmp(gets(o, "source"), "src/odd\xEF\xBF\xBD.txt"));
    json_decref(o);
    o = kvz_report_text("\xC0\x80 caf\xC3\xA9 \xED\xA0\x80 \xF4\x90\x80\x80");
    CHECK(o && !strcmp(json_string_value(o), "\xEF\xBF\xBD\xEF\xBF\xBD caf\xC3\xA9 "
                                            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD "
                                            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"));
    json_decref(o);

    /* ---- show: detail of a.txt against the fixture (f16 rows: head_dim * 2 bytes) */
    kvz_store_doc_detail *d = malloc(sizeof *d);
    REQUIRE(d);
    REQUIRE(kvz_store_doc_detail_get(s, "a.txt", d) == 0);
    static const uint32_t counts[FX_L * FX_H] = {4, 7, 6, 3};
    const uint64_t row = FX_HD * 2;
    CHECK(d->meta_bytes == g_meta_len);
    for (uint32_t l = 0; l < FX_L; l++) {
        CHECK(d->rec_bytes[l] == g_layers[l].len);
        CHECK(d->raw_bytes[l] == (counts[2 * l] + counts[2 * l + 1]) * (4 + 2 * row));
    }
    CHECK(d->pairs_kept == 20);
    CHECK(d->context_pairs == FX_L * FX_H * FX_CONTEXT);
    CHECK(d->context_pairs_kept == 20 - FX_L * FX_H * FX_PREFIX);
    CHECK(d->kept_min == 3 && d->kept_max == 7);
    CHECK(d->bytes_records == g_stored);
    o = kvz_report_doc_detail("a.txt", d);
    REQUIRE(o);
    CHECK(keys_are(o, "id,source,hash,tokens,ingest_time,date,records,bytes_stored,bytes_kv_full,"
                      "bytes_kv_kept,compression,blob"));
    json_t *b = json_object_get(o, "blob");
    CHECK(keys_are(b, "model_fp,n_layer,n_head,n_kv_head,head_dim,dtype,mode,prefix_policy,ratio,"
                      "chunk,overlap,n_prefix,n_context,pairs_kept,context_pairs,context_pairs_kept,"
                      "kept_per_head_min,kept_per_head_max,bytes_raw,bytes_records,meta_record_bytes,layers"));
    CHECK(!strcmp(gets(b, "model_fp"), "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf"));
    CHECK(geti(b, "n_layer") == FX_L && geti(b, "n_head") == 2 * FX_H && geti(b, "n_kv_head") == FX_H);
    CHECK(geti(b, "head_dim") == FX_HD && !strcmp(gets(b, "dtype"), "f16"));
    CHECK(!strcmp(gets(b, "prefix_policy"), "keep") && getr(b, "ratio") == 0.5);
    CHECK(geti(b, "chunk") == 2000 && geti(b, "overlap") == 8);
    CHECK(geti(b, "n_prefix") == FX_PREFIX && geti(b, "n_context") == FX_CONTEXT);
    CHECK(geti(b, "pairs_kept") == 20 && geti(b, "context_pairs_kept") == 12);
    CHECK(geti(b, "kept_per_head_min") == 3 && geti(b, "kept_per_head_max") == 7);
    CHECK(geti(b, "bytes_raw") == 20 * (4 + 2 * (json_int_t)row));
    CHECK(geti(b, "bytes_records") == (json_int_t)g_stored);
    CHECK(geti(b, "meta_record_bytes") == (json_int_t)g_meta_len);
    json_t *ls = json_object_get(b, "layers");
    CHECK(json_array_size(ls) == FX_L);
    for (size_t l = 0; l < json_array_size(ls) && l < FX_L; l++) {
        json_t *e = json_array_get(ls, l), *h = json_object_get(e, "heads");
        CHECK(geti(e, "layer") == (json_int_t)l);
        CHECK(geti(e, "kept") == counts[2 * l] + counts[2 * l + 1]);
        CHECK(json_array_size(h) == FX_H);
        CHECK(json_integer_value(json_array_get(h, 0)) == counts[2 * l] &&
              json_integer_value(json_array_get(h, 1)) == counts[2 * l + 1]);
        CHECK(geti(e, "bytes_record") == (json_int_t)g_layers[l].len);
    }
    json_decref(o);
    kvz_store_doc_detail_free(d);

    /* a missing document: NOTFOUND at the DOC step; its parts are counted */
    CHECK(kvz_store_doc_detail_get(s, "p", d) == KVZ_ERR_NOTFOUND && d->failed == KVZ_DETAIL_DOC);
    kvz_store_doc_detail_free(d);
    kvz_error_clear();
    CHECK(kvz_store_count_parts(s, "p") == 2);
    CHECK(kvz_store_count_parts(s, "a.txt") == 0);

    /* ---- stats: 4 ids, 2 blobs (p#1, p#2 link to a.txt's) */
    kvz_store_summary sm;
    REQUIRE(kvz_store_summary_get(s, sdir, &sm) == 0);
    o = kvz_report_summary(sdir, &sm);
    REQUIRE(o);
    CHECK(keys_are(o, "store,docs,blobs,records,tokens,bytes_kv_full,bytes_kv_kept,bytes_stored_docs,"
                      "bytes_records,compression,eviction,zstd,map_size,map_used,file_bytes,page_size,"
                      "last_txnid,model_fp"));
    CHECK(!strcmp(gets(o, "store"), sdir));
    CHECK(geti(o, "docs") == 4 && geti(o, "blobs") == 2 && geti(o, "records") == 2 * (1 + FX_L));
    CHECK(geti(o, "tokens") == 48 && geti(o, "bytes_kv_full") == 4000 && geti(o, "bytes_kv_kept") == 1600);
    CHECK(geti(o, "bytes_stored_docs") == 4 * (json_int_t)g_stored);
    CHECK(geti(o, "bytes_records") == 2 * (json_int_t)g_stored);
    CHECK(getr(o, "eviction") == 2.5);
    CHECK(fabs(getr(o, "zstd") - round(400.0 / g_stored * 1000) / 1000) < 1e-12);
    CHECK(geti(o, "file_bytes") == (json_int_t)file_size(sdir) && geti(o, "file_bytes") > 0);
    CHECK(geti(o, "last_txnid") == (json_int_t)st0.last_txnid + 4); /* one write transaction per put */
    CHECK(!strcmp(gets(o, "model_fp"), "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf"));
    json_decref(o);

    /* ---- verify */
    kvz_store_verify_result vr;
    REQUIRE(kvz_store_verify(s, NULL, NULL, &vr) == 0);
    o = kvz_report_verify(&vr, 0.12345);
    CHECK(o && keys_are(o, "ok,docs,blobs,records,problems,cpu_s"));
    CHECK(o && json_is_true(json_object_get(o, "ok")) && geti(o, "docs") == 4 && geti(o, "blobs") == 2);
    CHECK(o && geti(o, "records") == 2 * (1 + FX_L) && geti(o, "problems") == 0);
    CHECK(o && getr(o, "cpu_s") == 0.123);
    json_decref(o);

    /* ---- salvage (read-only source) and merge of the salvaged copy */
    kvz_store *ro;
    REQUIRE(kvz_store_open(sdir, KVZ_STORE_READONLY, 0, NULL, &ro) == 0);
    kvz_store_salvage_result sr;
    CHECK(kvz_store_salvage(ro, vdir, NULL, NULL, &sr) == 0);
    kvz_store_close(ro);
    o = kvz_report_salvage(sdir, vdir, &sr);
    CHECK(o && keys_are(o, "store,into,docs,copied,lost,unreadable_stretches"));
    CHECK(o && geti(o, "docs") == 4 && geti(o, "copied") == 4 && geti(o, "lost") == 0);
    CHECK(o && !strcmp(gets(o, "into"), vdir));
    json_decref(o);
    const char *srcs[1] = {vdir};
    kvz_merge_result mr;
    CHECK(kvz_store_merge(srcs, 1, mdir, NULL, NULL, NULL, &mr) == 0);
    o = kvz_report_merge(mdir, &mr);
    CHECK(o && keys_are(o, "into,docs,copied,linked,unchanged,replaced,bad,conflicts_resolved,"
                           "mixed_corpus,bytes_copied"));
    /* 4 ids over 2 blobs: 2 copied, 2 linked to a blob merged before them */
    CHECK(o && geti(o, "docs") == 4 && geti(o, "copied") == 2 && geti(o, "linked") == 2);
    CHECK(o && geti(o, "bytes_copied") == 2 * (json_int_t)g_stored);
    CHECK(o && json_is_false(json_object_get(o, "mixed_corpus")));
    json_decref(o);

    /* ---- gc --compact after removing a document: its blob goes, the file shrinks */
    REQUIRE(kvz_store_delete_doc(s, "odd\xff.txt") == 0);
    const uint64_t before = file_size(sdir);
    kvz_store_gc_compact_result gr;
    CHECK(kvz_store_gc_compact(s, 1, &gr) == 0);
    CHECK(gr.gc_done && gr.compacted);
    o = kvz_report_gc(&gr);
    CHECK(o && keys_are(o, "blobs_dropped,records_dropped,bytes_dropped,orphan_records,refs_fixed,"
                           "prefixes_dropped,file_bytes_before,file_bytes_after"));
    CHECK(o && geti(o, "blobs_dropped") == 0); /* delete_doc already dropped it */
    CHECK(o && geti(o, "file_bytes_before") == (json_int_t)before);
    CHECK(o && geti(o, "file_bytes_after") == (json_int_t)file_size(sdir));
    CHECK(o && geti(o, "file_bytes_after") < geti(o, "file_bytes_before"));
    json_decref(o);
    gr.compacted = 0; /* a plain gc has no file sizes */
    o = kvz_report_gc(&gr);
    CHECK(o && json_object_size(o) == 6 && !json_object_get(o, "file_bytes_after"));
    json_decref(o);
    kvz_store_close(s);

    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
    free(d);
    free(g_meta);
    for (uint32_t l = 0; l < FX_L; l++) free((void *)g_layers[l].data);
    return kvz_test_summary();
}
