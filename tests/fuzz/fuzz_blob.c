/* libFuzzer target for the KVZB record parsers (format/kvz_blob.h).
 * Input: flags byte (bit 0: reseal the records so mutations get past the record
 * checksum), u16 LE META length, META record bytes, LAYER record bytes.
 * Any input must give an error code or succeed; never crash, over-read, or
 * allocate more than the verified sizes allow. Covers format versions 1 and 2
 * (codec none/zstd, q8/q4 rows and their scale blocks, shared-prefix META).
 * Seeds: tests/golden/blob_*.kvzb (v1) and blob_v2_*.kvzb wrapped in that framing.
 * Built by CMake with -DKVZ_FUZZ=ON (CC=clang); by hand:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -Iformat -Icommon \
 *     tests/fuzz/fuzz_blob.c format/kvz_blob.c format/kvz_kvrow.c common/kvz_error.c -lzstd -lxxhash -o fuzz_blob */
#include "kvz_blob.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* Fix rec_xxh3 (docs/FORMAT.md 2.1) so mutations reach the payload checks. */
static void reseal(uint8_t *r, size_t n)
{
    if (n < KVZ_BLOB_HEADER_SIZE) return;
    uint64_t comp;
    memcpy(&comp, r + 32, 8);
    if (comp > n - KVZ_BLOB_HEADER_SIZE) return;
    uint64_t h = XXH3_64bits_withSeed(r + 56, comp, XXH3_64bits(r, 48));
    memcpy(r + 48, &h, 8);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3) return 0; /* byte 0: flags, bytes 1-2: META length (u16 LE) */
    size_t split = (size_t)data[1] | (size_t)data[2] << 8;
    size_t meta_n = split < size - 3 ? split : size - 3, layer_n = size - 3 - meta_n;
    const uint8_t *meta = data + 3, *layer = data + 3 + meta_n;
    uint8_t *mcopy = NULL, *lcopy = NULL;
    if (data[0] & 1) { /* odd first byte: reseal both records */
        mcopy = malloc(meta_n + 1);
        lcopy = malloc(layer_n + 1);
        memcpy(mcopy, meta, meta_n);
        memcpy(lcopy, layer, layer_n);
        reseal(mcopy, meta_n);
        reseal(lcopy, layer_n);
        meta = mcopy;
        layer = lcopy;
    }
    kvz_blob_info info;
    (void)kvz_blob_check(meta, meta_n, &info);
    kvz_blob_meta m;
    if (kvz_blob_decode_meta(meta, meta_n, NULL, &m) != 0) {
        /* still exercise the layer path against small fixed metas: v1 f16, v2 q8 */
        static uint32_t counts[2] = {2, 3};
        kvz_blob_meta f = {{0}, 1, 2, 2, 4, 1, 0, 0, 0.5f, 2000, 8, 1, 8, counts, {0}, 1};
        uint32_t pos[5];
        uint16_t k[20], v[20];
        (void)kvz_blob_decode_layer(&f, 0, layer, layer_n, pos, k, v);
        kvz_blob_meta q = {{0}, 1, 2, 2, 32, KVZ_DTYPE_Q8, 0, 0, 0.5f, 2000, 8, 1, 8, counts, {0}, 2};
        uint8_t qk[5 * 34], qv[5 * 34];
        (void)kvz_blob_decode_layer(&q, 0, layer, layer_n, pos, qk, qv);
        free(mcopy);
        free(lcopy);
        return 0;
    }
    for (uint32_t l = 0; l < m.n_layer && l < 4; l++) {
        uint64_t bytes = kvz_blob_layer_raw_size(&m, l);
        if (bytes > (64u << 20)) break; /* caller's budget, as a real reader would have */
        uint64_t kept = kvz_blob_layer_kept(&m, l);
        size_t kv = (size_t)kept * kvz_blob_kv_row_bytes(&m);
        uint32_t *pos = malloc(kept * 4 + 1);
        uint8_t *k = malloc(kv + 1), *v = malloc(kv + 1);
        if (pos && k && v) (void)kvz_blob_decode_layer(&m, l, layer, layer_n, pos, k, v);
        free(pos); free(k); free(v);
    }
    kvz_blob_meta_free(&m);
    free(mcopy);
    free(lcopy);
    return 0;
}
