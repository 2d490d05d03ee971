/* The ID#N part policy (ingest/kvz_parts.h) against a real LMDB store: a part's doc
 * entry records its part number; pruning the leftovers of a longer version removes
 * only this document's parts (never an independently stored `X#1`), old entries
 * without a part number count as parts only when their source is the same file,
 * and no part overwrites another document's entry. Issue 18, item 1. */
#include "blob_fixture.h"
#include "kvz_blob.h"
#include "kvz_error.h"
#include "kvz_parts.h"
#include "kvz_store.h"
#include "kvz_test.h"

#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

static uint8_t *g_meta;
static size_t g_meta_len;
static kvz_store_rec g_layers[FX_L];
static uint8_t g_fp[16];
static int g_hash;

static void make_records(void)
{
    static fx_cache c;
    fx_make(&c, KVZ_DTYPE_F16);
    memcpy(g_fp, c.meta.fingerprint, 16);
    if (kvz_blob_encode_meta(&c.meta, 1, &g_meta, &g_meta_len)) abort();
    for (uint32_t l = 0; l < FX_L; l++) {
        uint8_t *rec;
        size_t n;
        if (kvz_blob_encode_layer(&c.meta, l, c.pos[l], c.k[l], c.v[l], 1, &rec, &n)) abort();
        g_layers[l] = (kvz_store_rec){rec, n};
    }
}

/* Store an entry: id, source path, part number (0 = whole / written before parts). */
static int put(kvz_store *s, const char *id, const char *src, uint32_t part, int *status)
{
    kvz_store_doc_info in;
    memset(&in, 0, sizeof in);
    snprintf(in.source_path, sizeof in.source_path, "%s", src);
    in.n_tokens = 12;
    in.ratio = 0.5f;
    in.part = part;
    uint8_t h[16] = {0x51};
    h[15] = (uint8_t)++g_hash;
    return kvz_store_put_doc(s, id, h, &in, &(kvz_store_rec){g_meta, g_meta_len}, g_layers, FX_L,
                             status);
}

static int has(kvz_store *s, const char *id)
{
    kvz_store_doc_info info;
    int rc = kvz_store_lookup(s, id, &info);
    kvz_error_clear();
    return rc == 0;
}

int main(void)
{
    make_records();
    char dir[] = "/tmp/kvz_parts_XXXXXX";
    REQUIRE(mkdtemp(dir));
    char sp[600];
    snprintf(sp, sizeof sp, "%s/store", dir);
    kvz_store *s;
    REQUIRE(kvz_store_open(sp, KVZ_STORE_CREATE, 0, g_fp, &s) == 0);

    /* the part number survives the round trip; a new part number alone rewrites the entry */
    int status = 0;
    CHECK(put(s, "r#2", "r.md", 2, &status) == 0 && status == KVZ_STORE_WRITTEN);
    kvz_store_doc_info info;
    CHECK(kvz_store_lookup(s, "r#2", &info) == 0 && info.part == 2);
    kvz_store_doc_info same = info;
    same.part = 0;
    CHECK(kvz_store_put_doc(s, "r#2", info.hash, &same, NULL, NULL, 0, &status) == 0 &&
          status == KVZ_STORE_INFO_UPDATED);
    CHECK(kvz_store_lookup(s, "r#2", &info) == 0 && info.part == 0);
    CHECK(kvz_store_put_doc(s, "r#2", info.hash, &same, NULL, NULL, 0, &status) == 0 &&
          status == KVZ_STORE_UNCHANGED);
    same.part = KVZ_STORE_PART_MAX + 1;
    CHECK(kvz_store_put_doc(s, "r#2", info.hash, &same, NULL, NULL, 0, &status) == KVZ_ERR_ARG);

    /* the reproduction: c/notes and an independent c/notes#1 */
    CHECK(put(s, "notes", "c/notes", 0, NULL) == 0);
    CHECK(put(s, "notes#1", "c/notes#1", 0, NULL) == 0);
    int32_t removed = -1;
    CHECK(kvz_ingest_parts_prune(s, "notes", "c/notes", 1, &removed) == 0 && removed == 0);
    CHECK(has(s, "notes#1"));
    CHECK(has(s, "notes"));
    /* notes grown to 2 parts would overwrite notes#1: refused before any model work */
    CHECK(kvz_ingest_parts_check(s, "notes", "c/notes", 2) == KVZ_ERR_ARG);
    CHECKF(strstr(kvz_error_detail(), "'notes#1'") != NULL, "%s", kvz_error_detail());
    kvz_error_clear();
    CHECK(kvz_ingest_parts_check(s, "notes", "c/notes", 1) == 0);
    CHECK(kvz_ingest_parts_check(s, "notes#1", "c/notes#1", 1) == 0);

    /* a split document shrinking to one part: its own parts go, and only those */
    CHECK(put(s, "big#1", "big.md", 1, NULL) == 0);
    CHECK(put(s, "big#2", "big.md", 2, NULL) == 0);
    CHECK(put(s, "big#3", "big.md", 3, NULL) == 0);
    CHECK(put(s, "big#4", "elsewhere/big#4", 0, NULL) == 0); /* independent, same pattern */
    CHECK(put(s, "big#5", "big.md", 5, NULL) == 0);          /* a gap-free probe reaches it */
    /* an independent document may not take the id of another document's part */
    CHECK(kvz_ingest_parts_check(s, "big#1", "other/big#1", 1) == KVZ_ERR_ARG);
    CHECKF(strstr(kvz_error_detail(), "part 1 of another document") != NULL, "%s", kvz_error_detail());
    kvz_error_clear();
    CHECK(kvz_ingest_parts_check(s, "big", "big.md", 3) == 0);
    CHECK(kvz_ingest_parts_prune(s, "big", "big.md", 2, &removed) == 0 && removed == 2);
    CHECK(has(s, "big#1") && has(s, "big#2") && !has(s, "big#3") && has(s, "big#4") &&
          !has(s, "big#5"));
    CHECK(kvz_ingest_parts_prune(s, "big", "big.md", 1, &removed) == 0 && removed == 2);
    CHECK(!has(s, "big#1") && !has(s, "big#2") && has(s, "big#4"));
    /* now stored in parts again: the whole-document entry of the shorter version goes */
    CHECK(put(s, "big", "big.md", 0, NULL) == 0);
    CHECK(put(s, "big#1", "big.md", 1, NULL) == 0);
    CHECK(kvz_ingest_parts_prune(s, "big", "big.md", 1, &removed) == 0 && removed == 1);
    CHECK(!has(s, "big#1") && has(s, "big"));
    CHECK(put(s, "big#1", "big.md", 1, NULL) == 0 && put(s, "big#2", "big.md", 2, NULL) == 0);
    CHECK(kvz_ingest_parts_prune(s, "big", "big.md", 2, &removed) == 0 && removed == 1);
    CHECK(!has(s, "big") && has(s, "big#1") && has(s, "big#2"));
    /* an entry named like a whole document but recording a part is someone's part */
    CHECK(put(s, "x#1", "x.md", 1, NULL) == 0);
    CHECK(kvz_ingest_parts_check(s, "x#1", "x.md", 1) == KVZ_ERR_ARG);
    kvz_error_clear();

    /* entries written before parts were recorded (part 0): the same source file only */
    char real[700], link[700], rel_other[700];
    snprintf(real, sizeof real, "%s/old.md", dir);
    snprintf(link, sizeof link, "%s/old-link.md", dir);
    snprintf(rel_other, sizeof rel_other, "%s/old#2", dir);
    FILE *f = fopen(real, "w");
    REQUIRE(f);
    fputs("text\n", f);
    fclose(f);
    REQUIRE(symlink(real, link) == 0);
    f = fopen(rel_other, "w");
    REQUIRE(f);
    fputs("other\n", f);
    fclose(f);
    CHECK(put(s, "old#1", real, 0, NULL) == 0);
    CHECK(put(s, "old#2", rel_other, 0, NULL) == 0);     /* an independent file "old#2" */
    CHECK(put(s, "old#3", real, 0, NULL) == 0);
    CHECK(kvz_ingest_parts_check(s, "old", link, 3) == KVZ_ERR_ARG); /* would overwrite old#2 */
    kvz_error_clear();
    /* the same file through another path (a link): same device and inode */
    CHECK(kvz_ingest_parts_prune(s, "old", link, 1, &removed) == 0 && removed == 2);
    CHECK(!has(s, "old#1") && has(s, "old#2") && !has(s, "old#3"));
    CHECK(put(s, "old#1", "gone/away.md", 0, NULL) == 0); /* source unknown: kept */
    CHECK(kvz_ingest_parts_prune(s, "old", real, 1, &removed) == 0 && removed == 0);
    CHECK(has(s, "old#1"));
    CHECK(kvz_ingest_parts_prune(s, "old", NULL, 1, &removed) == 0 && removed == 0);

    /* ids and spans */
    char id[KVZ_STORE_DOC_ID_MAX + 1], longid[KVZ_STORE_DOC_ID_MAX + 2];
    memset(longid, 'a', sizeof longid);
    longid[509] = 0;
    CHECK(kvz_ingest_part_id(longid, 9, 9, id) == 0 && strlen(id) == 511 && !strcmp(id + 509, "#9"));
    CHECK(kvz_ingest_part_id(longid, 10, 10, id) == KVZ_ERR_ARG);
    CHECK(strstr(kvz_error_detail(), "512 bytes") != NULL);
    kvz_error_clear();
    CHECK(kvz_ingest_part_id(longid, 1, 1, id) == 0 && !strcmp(id, longid));
    longid[509] = 'a';
    longid[512] = 0;
    CHECK(kvz_ingest_part_id(longid, 1, 1, id) == KVZ_ERR_ARG);
    CHECK(kvz_ingest_part_id("", 1, 1, id) == KVZ_ERR_ARG);
    kvz_error_clear();
    CHECK(kvz_ingest_n_parts(100, 30) == 4 && kvz_ingest_n_parts(90, 30) == 3 &&
          kvz_ingest_n_parts(1, 30) == 1 && kvz_ingest_n_parts(0, 30) == 0);
    int32_t prev = 0, s0, s1;
    for (int32_t p = 0; p < 4; p++) {
        kvz_ingest_part_span(100, 4, p, &s0, &s1);
        CHECK(s0 == prev && s1 - s0 <= 30 && s1 - s0 >= 24);
        prev = s1;
    }
    CHECK(prev == 100);

    kvz_store_close(s);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) fprintf(stderr, "cleanup failed\n");
    free(g_meta);
    for (int l = 0; l < FX_L; l++) free((void *)g_layers[l].data);
    return kvz_test_summary();
}
