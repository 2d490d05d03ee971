/* The text side of the reports: common/kvz_escape (terminal and JSON escaping, the
 * UTF-8 check, the one-line error), the store's text lines (kvz_store_report_print_*)
 * and an ingest run's (kvz_ingest_report_*), each written to a memory stream and
 * compared with the line written out by hand here. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_escape.h"
#include "kvz_ingest_report.h"
#include "kvz_store_report.h"
#include "kvz_test.h"

/* What @p fn wrote into a memory stream (static buffer, valid until the next call). */
static char g_out[8192];
static FILE *mem_open(void)
{
    memset(g_out, 0, sizeof g_out);
    return fmemopen(g_out, sizeof g_out - 1, "w");
}
#define OUT_IS(want) CHECKF(!strcmp(g_out, (want)), "got [%s] want [%s]", g_out, (want))

static void test_escape(void)
{
    CHECK(!strcmp(kvz_escape("plain id.txt"), "plain id.txt"));
    CHECK(!strcmp(kvz_escape(NULL), ""));
    CHECK(!strcmp(kvz_escape("a\\b"), "a\\\\b"));
    CHECK(!strcmp(kvz_escape("l1\nl2\r\t"), "l1\\nl2\\r\\t"));
    CHECK(!strcmp(kvz_escape("\x1b[2J\x7f\x01"), "\\x1b[2J\\x7f\\x01"));
    CHECK(!strcmp(kvz_escape("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"));
    CHECK(!strcmp(kvz_escape("\xc2\x9b" "31m"), "\\u009b31m"));            /* C1 CSI */
    CHECK(!strcmp(kvz_escape("\xc0\xaf"), "\\xc0\\xaf"));                   /* overlong '/' */
    CHECK(!strcmp(kvz_escape("\xed\xa0\x80"), "\\xed\\xa0\\x80"));          /* surrogate */
    CHECK(!strcmp(kvz_escape("x\xff" "y"), "x\\xffy"));
    CHECK(!strcmp(kvz_escape("\xe2\x82"), "\\xe2\\x82"));                   /* cut sequence */
    char *big = malloc(5000);
    memset(big, 'a', 4999);
    big[4999] = 0;
    const char *e = kvz_escape(big);
    CHECK(strlen(e) == 4095 + 3 && !strcmp(e + 4095, "..."));
    free(big);
    /* 8 rotating buffers: the first of 8 calls is intact after the other 7 */
    const char *v[8];
    char id[8][4];
    for (int i = 0; i < 8; i++) { snprintf(id[i], 4, "%d", i); v[i] = kvz_escape(id[i]); }
    for (int i = 0; i < 8; i++) CHECK(!strcmp(v[i], id[i]));

    size_t bad = 99;
    CHECK(kvz_utf8_valid("ok \xc3\xa9", 5, &bad) && bad == 99);
    CHECK(!kvz_utf8_valid("ab\0c", 4, &bad) && bad == 2);
    CHECK(!kvz_utf8_valid("abc\xf4\x90\x80\x80", 7, &bad) && bad == 3); /* above U+10FFFF */

    FILE *f = mem_open();
    kvz_escape_json(f, "q\"b\\s\n\x01\xc3\xa9", 9);
    fclose(f);
    OUT_IS("\"q\\\"b\\\\s\\n\\u0001\xc3\xa9\"");

    f = mem_open();
    kvz_error_set(KVZ_ERR_IO, "disk\nfull");
    kvz_escape_error(f, "tool", KVZ_ERR_IO, "cannot write \x1b" "x");
    CHECK(kvz_error_detail()[0] == 0); /* cleared */
    kvz_escape_error(f, "tool", KVZ_ERR_NOTFOUND, "doc");
    fclose(f);
    char want[512];
    snprintf(want, sizeof want, "tool: error: cannot write \\x1bx: disk\\nfull (%s)\ntool: error: doc: %s\n",
             kvz_strerror(KVZ_ERR_IO), kvz_strerror(KVZ_ERR_NOTFOUND));
    OUT_IS(want);
}

static void test_store_text(void)
{
    kvz_store_doc_info in;
    memset(&in, 0, sizeof in);
    in.n_tokens = 1234;
    in.ratio = 0.3f;
    in.bytes_stored = 70015;       /* 70.0 kB */
    in.bytes_kv_full = 697680;     /* / stored = 9.96x */
    in.ingest_time = 86400 + 3661; /* 1970-01-02 01:01:01 UTC */
    FILE *f = mem_open();
    kvz_store_report_print_ls_header(f);
    kvz_store_report_print_ls_row(f, "dir/a\x1b.txt", &in);
    fclose(f);
    OUT_IS("ID                                         TOKENS  RATIO     STORED    COMPR  DATE (UTC)\n"
           "dir/a\\x1b.txt                                1234  0.300    70.0 kB    9.96x  1970-01-02 01:01:01\n");

    /* byte counts: B below 10000, then kB, MB, GB */
    const uint64_t b[4] = {9999, 10000, 10000000, 10000000000ull};
    const char *bw[4] = {"9999 B", "10.0 kB", "10.0 MB", "10.00 GB"};
    for (int i = 0; i < 4; i++) {
        f = mem_open();
        kvz_store_report_print_snapshot(f, "s", "d", b[i]);
        fclose(f);
        char want[128];
        snprintf(want, sizeof want, "snapshot: s -> d (%s, compacted)\n", bw[i]);
        OUT_IS(want);
    }

    kvz_store_gc_compact_result gr;
    memset(&gr, 0, sizeof gr);
    gr.gc.blobs_dropped = 2;
    gr.gc.orphan_records = 1;
    gr.gc.records_dropped = 62;
    gr.gc.bytes_dropped = 140030;
    f = mem_open();
    kvz_store_report_print_gc(f, &gr);
    gr.compacted = 1;
    gr.file_bytes_before = 2080768;
    gr.file_bytes_after = 1040384;
    kvz_store_report_print_gc(f, &gr);
    fclose(f);
    OUT_IS("gc: dropped 2 unreferenced blobs and 1 orphan records (62 records, 140.0 kB); fixed 0 refcounts; "
           "dropped 0 unreferenced shared prefixes\n"
           "gc: dropped 2 unreferenced blobs and 1 orphan records (62 records, 140.0 kB); fixed 0 refcounts; "
           "dropped 0 unreferenced shared prefixes\ncompact: data.mdb 2080.8 kB -> 1040.4 kB\n");

    f = mem_open();
    kvz_store_report_print_no_doc(f, "kvzip-store", "st", "big.txt", 0);
    kvz_store_report_print_no_doc(f, "kvzip-store", "st", "big.txt", 1);
    kvz_store_report_print_no_doc(f, "kvzip-store", "st", "big.txt", 3);
    fclose(f);
    OUT_IS("kvzip-store: error: no document 'big.txt' in st (list them with kvzip-store ls)\n"
           "kvzip-store: error: no document 'big.txt' in st: it was stored in parts: 'big.txt#1' (kvzip-store ls "
           "lists them)\n"
           "kvzip-store: error: no document 'big.txt' in st: it was stored in parts: 'big.txt#1'..'big.txt#3' "
           "(kvzip-store ls lists them)\n");

    /* merge's lines quote stored ids: escaped like the rest (a raw ESC would reach the terminal) */
    f = mem_open();
    kvz_store_report_print_merge_event(f, "kvzip-store", KVZ_MERGE_DOC, "copied    a\x1b[2J.txt (from s)");
    kvz_store_report_print_merge_event(f, "kvzip-store", KVZ_MERGE_CONFLICT, "'b\x01' differs between sources");
    kvz_store_report_print_merge_event(f, "kvzip-store", KVZ_MERGE_CORPUS, "note: shard 2 of 4 is missing");
    kvz_store_report_print_merge_event(f, "kvzip-store", KVZ_MERGE_BAD_BLOB, "'c' in s: blob does not verify");
    fclose(f);
    OUT_IS("copied    a\\x1b[2J.txt (from s)\n"
           "kvzip-store: merge: conflict: 'b\\x01' differs between sources\n"
           "kvzip-store: merge: warning: shard 2 of 4 is missing\n"
           "kvzip-store: merge: error: 'c' in s: blob does not verify\n");

    kvz_store_salvage_result sr;
    memset(&sr, 0, sizeof sr);
    sr.n_docs = 3;
    sr.n_copied = 2;
    sr.n_lost = 1;
    f = mem_open();
    kvz_store_report_print_salvage(f, "bad", "new", &sr);
    kvz_store_report_print_salvage_loss(f, "kvzip-store", "bad", "new", &sr);
    sr.n_copied = 0;
    sr.n_lost = 3;
    sr.n_gaps = 1;
    kvz_store_report_print_salvage_loss(f, "kvzip-store", "bad", "new", &sr);
    fclose(f);
    OUT_IS("salvage: 2 of 3 documents copied from bad to new; 1 lost\n"
           "kvzip-store: error: bad: 1 document lost (the rest is in new)\n"
           "kvzip-store: error: bad: 3 documents lost and unreadable stretches of the doc index; nothing could "
           "be copied, so new was not created\n");
}

static void test_ingest_text(void)
{
    kvz_batch_stats s;
    memset(&s, 0, sizeof s);
    s.parts = 3;
    s.written = 2;
    s.linked = 1;
    s.tokens = 300;
    s.tokens_written = 200;
    s.pairs_total = 1000;
    s.pairs_kept = 300;
    s.bytes_full = 4000000;
    s.bytes_kept = 2000000;
    s.bytes_stored = 500000;
    s.seconds = 1.25;
    FILE *f = mem_open();
    kvz_ingest_report_summary(f, "kvzip-ingest", "st\"x", 3, &s, 1, 2, 0.3f, 1);
    kvz_ingest_report_summary(f, "kvzip-ingest", "st", 3, &s, 1, 2, 0.3f, 0);
    fclose(f);
    OUT_IS("{\"store\": \"st\\\"x\", \"documents\": 3, \"parts\": 3, \"ingested\": 2, \"unchanged\": 0, "
           "\"linked\": 1, \"failed\": 1, \"skipped\": 2, \"tokens\": 300, \"tokens_ingested\": 200, "
           "\"ratio\": 0.3000, \"pairs_total\": 1000, \"pairs_kept\": 300, \"bytes_kv_full\": 4000000, "
           "\"bytes_kv_kept\": 2000000, \"bytes_stored\": 500000, \"seconds\": 1.250}\n"
           "kvzip-ingest: 2 ingested, 1 linked, 0 unchanged, 1 failed, 2 skipped | 300 tokens in 1.2 s | "
           "ingested KV: full 4.00 MB, kept 2.00 MB (30% of the context pairs, 50% of the bytes with the "
           "prefix), stored 0.50 MB (zstd 4.00x)\n");

    /* half way: 15 cells, 50%, 100 tok/s, 5 s left */
    f = mem_open();
    kvz_ingest_report_progress(f, "doc\x1b", 500, 1000, 5.0);
    fclose(f);
    OUT_IS("\r[===============>              ]  50% 500/1000 tok  100 tok/s  ETA 0:05  doc\\x1b"
           "                         ");

    kvz_corpus c;
    kvz_corpus_init(&c, NULL, NULL);
    kvz_corpus_doc d[3] = {{.id = "a.txt"}, {.id = "gone", .dropped = 1}, {.id = "b\n.md"}};
    c.v = d;
    c.n = 3;
    const kvz_shard sh = {1, 4, "--shard"}, none = {0, 0, NULL};
    f = mem_open();
    kvz_ingest_report_list(f, &c, &sh, 0xabcull, 9, 0);
    kvz_ingest_report_list(f, &c, &none, 0xabcull, 9, 1);
    kvz_ingest_report_shard(f, "kvzip-ingest", &sh, 2, 9, 0xabcull);
    c.skipped = 2;
    kvz_ingest_report_no_usable(f, "kvzip-ingest", &c, &none, 0);
    kvz_ingest_report_no_usable(f, "kvzip-ingest", &c, &sh, 1);
    kvz_ingest_report_no_usable(f, "kvzip-ingest", &c, &sh, 0); /* an empty shard, quiet: nothing */
    c.failed = 1;
    kvz_ingest_report_no_usable(f, "kvzip-ingest", &c, &none, 1); /* the failure was reported */
    fclose(f);
    OUT_IS("a.txt\nb\\n.md\n"
           "{\"shard\": \"0/1\", \"corpus\": \"0000000000000abc\", \"corpus_documents\": 9, \"documents\": "
           "[\"a.txt\", \"b\\n.md\"]}\n"
           "kvzip-ingest: shard 1/4 (from --shard): 2 of 9 documents (corpus listing 0000000000000abc)\n"
           "kvzip-ingest: error: no usable document: 2 files skipped\n"
           "kvzip-ingest: shard 1/4: no usable document (2 skipped)\n");
}

int main(void)
{
    test_escape();
    test_store_text();
    test_ingest_text();
    return kvz_test_summary();
}
