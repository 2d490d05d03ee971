/* kvz_blob.c — encoder/decoder of the KVZB record format (docs/FORMAT.md). */
#include "kvz_blob.h"

#include "kvz_error.h"
#include "kvz_kvrow.h"

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>
#include <zstd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvz_blob: the format is little-endian and this code copies arrays as-is"
#endif

/* ========================================================================= */
/* Byte helpers (little-endian, unaligned-safe)                                */

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* Header field offsets (docs/FORMAT.md §2). */
enum {
    H_MAGIC = 0, H_VERSION = 4, H_KIND = 6, H_CODEC = 7, H_LAYER = 8, H_RESERVED = 12,
    H_BLOB_ID = 16, H_RAW_SIZE = 24, H_COMP_SIZE = 32, H_RAW_XXH3 = 40, H_REC_XXH3 = 48,
};

/* META payload field offsets (docs/FORMAT.md §3). */
enum {
    M_FP = 0, M_N_LAYER = 16, M_N_HEAD = 20, M_N_KV_HEAD = 24, M_HEAD_DIM = 28, M_DTYPE = 32,
    M_MODE = 33, M_PREFIX = 34, M_RESERVED = 35, M_RATIO = 36, M_CHUNK = 40, M_OVERLAP = 44,
    M_N_PREFIX = 48, M_N_CONTEXT = 52, M_TOTAL_KEPT = 56, M_KV_BYTES = 64,
    M_PREFIX_REF = 72, /* version 2 only; counts follow the fixed part */
};

static unsigned meta_version(const kvz_blob_meta *m) { return m->version ? m->version : KVZ_BLOB_VERSION; }

static size_t meta_fixed_size(unsigned version)
{
    return version >= 2 ? KVZ_BLOB_META_FIXED_SIZE_V2 : KVZ_BLOB_META_FIXED_SIZE;
}

/* rec_xxh3: XXH3-64 of the compressed bytes, seeded with XXH3-64 of header[0,48). */
static uint64_t record_hash(const uint8_t *hdr, const uint8_t *comp, size_t comp_size)
{
    return XXH3_64bits_withSeed(comp, comp_size, XXH3_64bits(hdr, H_REC_XXH3));
}

/* ========================================================================= */
/* Meta helpers                                                                */

size_t kvz_blob_dtype_size(uint8_t dtype)
{
    switch (dtype) {
    case KVZ_DTYPE_F32: return 4;
    case KVZ_DTYPE_F16: return 2;
    case KVZ_DTYPE_BF16: return 2;
    default: return 0;
    }
}

size_t kvz_blob_kv_row_bytes(const kvz_blob_meta *m) { return kvz_kv_row_bytes(m->dtype, m->head_dim); }

uint64_t kvz_blob_layer_kept(const kvz_blob_meta *m, uint32_t l)
{
    uint64_t s = 0;
    for (uint32_t h = 0; h < m->n_kv_head; h++) s += m->counts[(size_t)l * m->n_kv_head + h];
    return s;
}

void kvz_blob_layer_offsets(const kvz_blob_meta *m, uint32_t l, uint64_t *off)
{
    off[0] = 0;
    for (uint32_t h = 0; h < m->n_kv_head; h++)
        off[h + 1] = off[h] + m->counts[(size_t)l * m->n_kv_head + h];
}

static uint64_t row_bytes(const kvz_blob_meta *m)
{
    return 4 + 2 * (uint64_t)kvz_kv_row_bytes(m->dtype, m->head_dim);
}

uint64_t kvz_blob_layer_raw_size(const kvz_blob_meta *m, uint32_t l)
{
    return kvz_blob_layer_kept(m, l) * row_bytes(m);
}

static uint64_t total_kept(const kvz_blob_meta *m)
{
    uint64_t s = 0;
    for (size_t i = 0; i < (size_t)m->n_layer * m->n_kv_head; i++) s += m->counts[i];
    return s;
}

uint64_t kvz_blob_kv_bytes(const kvz_blob_meta *m) { return total_kept(m) * row_bytes(m); }

/* Returns NULL when valid, else a static description of the first bad field. */
static const char *meta_problem(const kvz_blob_meta *m)
{
    if (m->n_layer < 1 || m->n_layer > KVZ_BLOB_MAX_LAYERS) return "n_layer out of range";
    if (m->n_kv_head < 1 || m->n_kv_head > KVZ_BLOB_MAX_HEADS) return "n_kv_head out of range";
    if (m->n_head < 1 || m->n_head > KVZ_BLOB_MAX_HEADS) return "n_head out of range";
    if (m->n_head % m->n_kv_head) return "n_head not a multiple of n_kv_head";
    if (m->head_dim < 1 || m->head_dim > KVZ_BLOB_MAX_HEAD_DIM) return "head_dim out of range";
    const unsigned ver = meta_version(m);
    if (ver < KVZ_BLOB_VERSION_MIN || ver > KVZ_BLOB_VERSION) return "unknown version";
    const kvz_kvrow_codec *rc = kvz_kvrow_codec_get(m->dtype);
    if (!rc || rc->min_blob_version > ver) return "unknown dtype";
    if (!kvz_kv_row_bytes(m->dtype, m->head_dim)) return "head_dim not a multiple of 32 for q8/q4";
    if (m->mode > KVZ_MODE_UNIFORM) return "unknown mode";
    if (m->prefix_policy > (ver >= 2 ? KVZ_PREFIX_SHARED : KVZ_PREFIX_NONE)) return "unknown prefix policy";
    static const uint8_t zero[16];
    if ((m->prefix_policy == KVZ_PREFIX_SHARED) == !memcmp(m->prefix_ref, zero, 16))
        return m->prefix_policy == KVZ_PREFIX_SHARED ? "shared prefix without prefix_ref"
                                                     : "prefix_ref set without a shared prefix";
    if (m->prefix_policy == KVZ_PREFIX_SHARED && m->n_prefix == 0) return "shared prefix of 0 tokens";
    if (!(m->ratio > 0.0f && m->ratio <= 1.0f)) return "ratio not in (0, 1]";
    if (m->chunk < 1) return "chunk is 0";
    if ((uint64_t)m->n_prefix + m->n_context > KVZ_BLOB_MAX_TOKENS) return "too many tokens";
    if (!m->counts) return "counts is NULL";
    uint32_t lo = m->prefix_policy == KVZ_PREFIX_KEEP ? m->n_prefix : 0;
    uint32_t hi = m->prefix_policy == KVZ_PREFIX_KEEP ? m->n_prefix + m->n_context : m->n_context;
    for (size_t i = 0; i < (size_t)m->n_layer * m->n_kv_head; i++)
        if (m->counts[i] < lo || m->counts[i] > hi) return "kept count out of range";
    return NULL;
}

int kvz_blob_meta_validate(const kvz_blob_meta *m)
{
    if (!m) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: meta is NULL");
    const char *p = meta_problem(m);
    return p ? kvz_error_set(KVZ_ERR_ARG, "kvz_blob: invalid meta: %s", p) : 0;
}

/* Fixed part of the META payload (72 bytes in v1, 88 in v2); counts follow as u32 LE. */
static void meta_fixed(const kvz_blob_meta *m, uint8_t b[KVZ_BLOB_META_FIXED_SIZE_V2])
{
    memset(b, 0, KVZ_BLOB_META_FIXED_SIZE_V2);
    if (meta_version(m) >= 2) memcpy(b + M_PREFIX_REF, m->prefix_ref, 16);
    memcpy(b + M_FP, m->fingerprint, 16);
    put32(b + M_N_LAYER, m->n_layer);
    put32(b + M_N_HEAD, m->n_head);
    put32(b + M_N_KV_HEAD, m->n_kv_head);
    put32(b + M_HEAD_DIM, m->head_dim);
    b[M_DTYPE] = m->dtype;
    b[M_MODE] = m->mode;
    b[M_PREFIX] = m->prefix_policy;
    memcpy(b + M_RATIO, &m->ratio, 4);
    put32(b + M_CHUNK, m->chunk);
    put32(b + M_OVERLAP, m->overlap);
    put32(b + M_N_PREFIX, m->n_prefix);
    put32(b + M_N_CONTEXT, m->n_context);
    put64(b + M_TOTAL_KEPT, total_kept(m));
    put64(b + M_KV_BYTES, kvz_blob_kv_bytes(m));
}

static size_t meta_counts_bytes(const kvz_blob_meta *m)
{
    return (size_t)m->n_layer * m->n_kv_head * 4;
}

uint64_t kvz_blob_meta_id(const kvz_blob_meta *m)
{
    uint8_t fixed[KVZ_BLOB_META_FIXED_SIZE_V2];
    meta_fixed(m, fixed);
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, fixed, meta_fixed_size(meta_version(m)));
    XXH3_64bits_update(&st, m->counts, meta_counts_bytes(m));
    return XXH3_64bits_digest(&st);
}

void kvz_blob_params_bytes(const kvz_blob_meta *m, uint8_t out[KVZ_BLOB_PARAMS_SIZE])
{
    memset(out, 0, KVZ_BLOB_PARAMS_SIZE);
    out[0] = m->dtype;
    out[1] = m->mode;
    out[2] = m->prefix_policy;
    memcpy(out + 4, &m->ratio, 4);
    put32(out + 8, m->chunk);
    put32(out + 12, m->overlap);
}

void kvz_blob_content_hash(const uint8_t fp[16], const uint8_t *params, size_t params_len,
                           size_t n, const int32_t *tokens, uint8_t out[16])
{
    uint8_t pre[4 + 4 + 16 + 4];
    memcpy(pre, "KVZH", 4);
    put32(pre + 4, 1);
    memcpy(pre + 8, fp, 16);
    put32(pre + 24, (uint32_t)params_len);
    uint8_t nb[8];
    put64(nb, (uint64_t)n);
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, pre, sizeof pre);
    if (params_len) XXH3_128bits_update(&st, params, params_len);
    XXH3_128bits_update(&st, nb, 8);
    if (n) XXH3_128bits_update(&st, tokens, n * sizeof(int32_t)); /* int32 LE == u32 LE bits */
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&st));
    memcpy(out, c.digest, 16);
}

void kvz_blob_meta_free(kvz_blob_meta *m)
{
    if (!m) return;
    free(m->counts);
    memset(m, 0, sizeof *m);
}

/* Positions of layer l: strictly ascending per head, in range, prefix policy. */
static const char *positions_problem(const kvz_blob_meta *m, uint32_t l, const uint32_t *const *pos)
{
    uint64_t n_total = (uint64_t)m->n_prefix + m->n_context;
    for (uint32_t h = 0; h < m->n_kv_head; h++) {
        uint32_t c = m->counts[(size_t)l * m->n_kv_head + h];
        const uint32_t *p = pos[h];
        for (uint32_t i = 0; i < c; i++) {
            if (p[i] >= n_total) return "position >= n_prefix + n_context";
            if (i && p[i] <= p[i - 1]) return "positions not strictly ascending";
            if (m->prefix_policy == KVZ_PREFIX_KEEP && i < m->n_prefix && p[i] != i)
                return "prefix positions are not 0..n_prefix-1";
            if (m->prefix_policy != KVZ_PREFIX_KEEP && p[i] < m->n_prefix)
                return "prefix position stored under prefix policy NONE/SHARED";
        }
    }
    return NULL;
}

/* ========================================================================= */
/* Encoding                                                                    */

typedef struct { const void *p; size_t n; } piece;

/* The concatenation of pieces into header || payload: a zstd frame, or (version
 * 2) the raw bytes when zstd is not asked for or saves too little. */
static int encode_record(unsigned version, uint8_t kind, uint32_t layer, uint64_t blob_id,
                         const piece *pieces, size_t n_pieces, int level, uint8_t **out,
                         size_t *out_len)
{
    const int try_zstd = version < 2 || level != KVZ_BLOB_LEVEL_NONE;
    if (level == 0 || level == KVZ_BLOB_LEVEL_NONE) level = KVZ_BLOB_DEFAULT_LEVEL;
    if (level < 1 || level > ZSTD_maxCLevel())
        return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: zstd level %d out of range", level);
    uint64_t raw = 0;
    for (size_t i = 0; i < n_pieces; i++) raw += pieces[i].n;
    size_t bound = ZSTD_compressBound((size_t)raw);
    if (ZSTD_isError(bound)) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: payload too large");
    if (bound < raw) bound = (size_t)raw;
    uint8_t *buf = malloc(KVZ_BLOB_HEADER_SIZE + bound);
    ZSTD_CCtx *cc = try_zstd ? ZSTD_createCCtx() : NULL;
    XXH3_state_t *hs = XXH3_createState();
    int err = 0;
    uint8_t codec = KVZ_BLOB_CODEC_ZSTD;
    if (!buf || (try_zstd && !cc) || !hs) { err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_blob: encode"); goto done; }
    ZSTD_outBuffer ob = {buf + KVZ_BLOB_HEADER_SIZE, bound, 0};
    if (!try_zstd) {
        XXH3_64bits_reset(hs);
        for (size_t i = 0; i < n_pieces; i++)
            if (pieces[i].n) XXH3_64bits_update(hs, pieces[i].p, pieces[i].n);
        goto raw_payload;
    }

    size_t zr;
    if (ZSTD_isError(zr = ZSTD_CCtx_setParameter(cc, ZSTD_c_compressionLevel, level)) ||
        ZSTD_isError(zr = ZSTD_CCtx_setParameter(cc, ZSTD_c_checksumFlag, 0)) ||
        ZSTD_isError(zr = ZSTD_CCtx_setParameter(cc, ZSTD_c_contentSizeFlag, 1)) ||
        ZSTD_isError(zr = ZSTD_CCtx_setPledgedSrcSize(cc, raw))) {
        err = kvz_error_set(KVZ_ERR_ZSTD, "kvz_blob: zstd setup: %s", ZSTD_getErrorName(zr));
        goto done;
    }
    /* Version 2 LAYER records over one frame's worth of raw bytes are written as
     * independent frames of KVZ_BLOB_ZSTD_FRAME_RAW raw bytes each (codec zstd-frames),
     * so a reader can decode them on several threads; anything else is one frame. */
    const int framed = version >= 2 && kind == KVZ_BLOB_KIND_LAYER && raw > KVZ_BLOB_ZSTD_FRAME_RAW;
    uint64_t frame_left = framed ? KVZ_BLOB_ZSTD_FRAME_RAW : raw, done_raw = 0;
    if (framed && ZSTD_isError(zr = ZSTD_CCtx_setPledgedSrcSize(cc, frame_left))) {
        err = kvz_error_set(KVZ_ERR_ZSTD, "kvz_blob: zstd setup: %s", ZSTD_getErrorName(zr));
        goto done;
    }
    XXH3_64bits_reset(hs);
    for (size_t i = 0; i <= n_pieces; i++) {
        const int last = i == n_pieces;
        const uint8_t *src = last ? NULL : pieces[i].p;
        size_t n = last ? 0 : pieces[i].n;
        if (n) XXH3_64bits_update(hs, src, n);
        else if (!last) continue;
        if (last && raw) break; /* every frame, the last too, ended with its final byte */
        do { /* the bytes of this piece that belong to the current frame */
            const size_t take = n < frame_left ? n : (size_t)frame_left;
            const int end = (take == frame_left && raw) || last; /* raw 0: one empty frame */
            ZSTD_inBuffer ib = {src, take, 0};
            for (;;) {
                zr = ZSTD_compressStream2(cc, &ob, &ib, end ? ZSTD_e_end : ZSTD_e_continue);
                if (ZSTD_isError(zr)) {
                    err = kvz_error_set(KVZ_ERR_ZSTD, "kvz_blob: zstd compress: %s", ZSTD_getErrorName(zr));
                    goto done;
                }
                if (end ? zr == 0 : ib.pos == ib.size) break;
            }
            src += take;
            n -= take;
            frame_left -= take;
            done_raw += take;
            if (!frame_left && done_raw < raw) { /* the next frame */
                frame_left = raw - done_raw < KVZ_BLOB_ZSTD_FRAME_RAW ? raw - done_raw : KVZ_BLOB_ZSTD_FRAME_RAW;
                if (ZSTD_isError(zr = ZSTD_CCtx_setPledgedSrcSize(cc, frame_left))) {
                    err = kvz_error_set(KVZ_ERR_ZSTD, "kvz_blob: zstd setup: %s", ZSTD_getErrorName(zr));
                    goto done;
                }
            }
        } while (n);
    }
    if (framed) codec = KVZ_BLOB_CODEC_ZSTD_FRAMES;
    /* zstd only where it pays: more than KVZ_BLOB_ZSTD_MIN_SAVING_PCT % smaller */
    if (version >= 2 && (uint64_t)ob.pos * 100 >= raw * (100 - KVZ_BLOB_ZSTD_MIN_SAVING_PCT)) {
raw_payload:
        codec = KVZ_BLOB_CODEC_NONE;
        ob.pos = 0;
        for (size_t i = 0; i < n_pieces; i++) {
            if (pieces[i].n) memcpy(buf + KVZ_BLOB_HEADER_SIZE + ob.pos, pieces[i].p, pieces[i].n);
            ob.pos += pieces[i].n;
        }
    }
    uint8_t *h = buf;
    memset(h, 0, KVZ_BLOB_HEADER_SIZE);
    memcpy(h + H_MAGIC, KVZ_BLOB_MAGIC, 4);
    put16(h + H_VERSION, (uint16_t)version);
    h[H_KIND] = kind;
    h[H_CODEC] = codec;
    put32(h + H_LAYER, layer);
    uint64_t raw_hash = XXH3_64bits_digest(hs);
    put64(h + H_BLOB_ID, kind == KVZ_BLOB_KIND_META ? raw_hash : blob_id);
    put64(h + H_RAW_SIZE, raw);
    put64(h + H_COMP_SIZE, ob.pos);
    put64(h + H_RAW_XXH3, raw_hash);
    put64(h + H_REC_XXH3, record_hash(h, buf + KVZ_BLOB_HEADER_SIZE, ob.pos));
    *out_len = KVZ_BLOB_HEADER_SIZE + ob.pos;
    uint8_t *shrunk = realloc(buf, *out_len);
    *out = shrunk ? shrunk : buf;
    buf = NULL;
done:
    free(buf);
    ZSTD_freeCCtx(cc);
    XXH3_freeState(hs);
    return err;
}

int kvz_blob_encode_meta(const kvz_blob_meta *m, int level, uint8_t **out, size_t *out_len)
{
    if (!out || !out_len) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: NULL output");
    *out = NULL;
    *out_len = 0;
    int err = kvz_blob_meta_validate(m);
    if (err) return err;
    uint8_t fixed[KVZ_BLOB_META_FIXED_SIZE_V2];
    meta_fixed(m, fixed);
    const unsigned ver = meta_version(m);
    piece pc[2] = {{fixed, meta_fixed_size(ver)}, {m->counts, meta_counts_bytes(m)}};
    return encode_record(ver, KVZ_BLOB_KIND_META, KVZ_BLOB_META_LAYER, 0, pc, 2, level, out, out_len);
}

int kvz_blob_encode_layer_heads(const kvz_blob_meta *m, uint32_t l, const uint32_t *const *pos,
                                const void *const *k, const void *const *v, int level,
                                uint8_t **out, size_t *out_len)
{
    if (!out || !out_len) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: NULL output");
    *out = NULL;
    *out_len = 0;
    int err = kvz_blob_meta_validate(m);
    if (err) return err;
    if (l >= m->n_layer) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: layer %u >= n_layer %u", l, m->n_layer);
    if (!pos || !k || !v) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: NULL head array");
    uint32_t H = m->n_kv_head;
    const uint32_t *cnt = m->counts + (size_t)l * H;
    for (uint32_t h = 0; h < H; h++)
        if (cnt[h] && (!pos[h] || !k[h] || !v[h]))
            return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: NULL array for head %u", h);
    const char *p = positions_problem(m, l, pos);
    if (p) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: layer %u: %s", l, p);
    for (uint32_t h = 0; h < H; h++) /* q8/q4 scale blocks a reader would reject */
        if (cnt[h] && (kvz_kvrow_check(m->dtype, k[h], cnt[h], m->head_dim, NULL) ||
                       kvz_kvrow_check(m->dtype, v[h], cnt[h], m->head_dim, NULL)))
            return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: layer %u head %u: %s", l, h, kvz_error_detail());

    size_t rowkv = kvz_blob_kv_row_bytes(m);
    piece *pc = malloc(sizeof(piece) * 3 * H);
    if (!pc) return kvz_error_set(KVZ_ERR_NOMEM, "kvz_blob: encode");
    for (uint32_t h = 0; h < H; h++) {
        pc[h] = (piece){pos[h], (size_t)cnt[h] * 4};
        pc[H + h] = (piece){k[h], (size_t)cnt[h] * rowkv};
        pc[2 * H + h] = (piece){v[h], (size_t)cnt[h] * rowkv};
    }
    err = encode_record(meta_version(m), KVZ_BLOB_KIND_LAYER, l, kvz_blob_meta_id(m), pc, 3 * (size_t)H,
                        level, out, out_len);
    free(pc);
    return err;
}

int kvz_blob_encode_layer(const kvz_blob_meta *m, uint32_t l, const uint32_t *pos, const void *k,
                          const void *v, int level, uint8_t **out, size_t *out_len)
{
    if (!out || !out_len) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: NULL output");
    *out = NULL;
    *out_len = 0;
    int err = kvz_blob_meta_validate(m);
    if (err) return err;
    if (l >= m->n_layer) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: layer %u >= n_layer %u", l, m->n_layer);
    uint32_t H = m->n_kv_head;
    uint64_t *off = malloc(sizeof(uint64_t) * (H + 1));
    const void **ptrs = malloc(sizeof(void *) * 3 * H);
    if (!off || !ptrs) { free(off); free(ptrs); return kvz_error_set(KVZ_ERR_NOMEM, "kvz_blob: encode"); }
    kvz_blob_layer_offsets(m, l, off);
    if (off[H] && (!pos || !k || !v)) {
        free(off); free(ptrs);
        return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: NULL flat array");
    }
    size_t rowkv = kvz_blob_kv_row_bytes(m);
    for (uint32_t h = 0; h < H; h++) {
        int any = off[h + 1] > off[h];
        ptrs[h] = any ? pos + off[h] : NULL;
        ptrs[H + h] = any ? (const uint8_t *)k + off[h] * rowkv : NULL;
        ptrs[2 * H + h] = any ? (const uint8_t *)v + off[h] * rowkv : NULL;
    }
    err = kvz_blob_encode_layer_heads(m, l, (const uint32_t *const *)ptrs, ptrs + H, ptrs + 2 * H,
                                      level, out, out_len);
    free(off);
    free(ptrs);
    return err;
}

/* ========================================================================= */
/* Decoding                                                                    */

int kvz_blob_record_checksum(const uint8_t *hdr, uint64_t got)
{
    const uint64_t want = get64(hdr + H_REC_XXH3);
    if (want != got)
        return kvz_error_set(KVZ_ERR_CHECKSUM, "kvz_blob: record checksum %016llx, expected %016llx",
                             (unsigned long long)got, (unsigned long long)want);
    return 0;
}

/* kvz_blob_check(); @p hashed: the record checksum computed by the caller while it
 * copied the bytes (kvz_blob_record_seed()), NULL: compute it here; @p defer: not
 * compared at all (the caller compares it later: kvz_blob_layer_head) */
static int check_rec(const uint8_t *rec, size_t len, kvz_blob_info *info, const uint64_t *hashed, int defer)
{
    if (!rec) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: NULL record");
    if (len < KVZ_BLOB_HEADER_SIZE)
        return kvz_error_set(KVZ_ERR_TRUNCATED, "kvz_blob: record of %zu bytes is shorter than the "
                             "%u-byte header", len, KVZ_BLOB_HEADER_SIZE);
    if (memcmp(rec + H_MAGIC, KVZ_BLOB_MAGIC, 4))
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: bad magic (not a KVZB record)");
    uint16_t ver = get16(rec + H_VERSION);
    if (ver < KVZ_BLOB_VERSION_MIN || ver > KVZ_BLOB_VERSION)
        return kvz_error_set(KVZ_ERR_VERSION, "kvz_blob: format version %u, this build reads %u..%u",
                             ver, KVZ_BLOB_VERSION_MIN, KVZ_BLOB_VERSION);
    uint64_t comp = get64(rec + H_COMP_SIZE);
    if (comp > len - KVZ_BLOB_HEADER_SIZE)
        return kvz_error_set(KVZ_ERR_TRUNCATED, "kvz_blob: header says %llu compressed bytes, "
                             "record holds %zu", (unsigned long long)comp, len - KVZ_BLOB_HEADER_SIZE);
    if (!defer) {
        const int err = kvz_blob_record_checksum(rec, hashed ? *hashed : record_hash(rec, rec + KVZ_BLOB_HEADER_SIZE,
                                                                                     (size_t)comp));
        if (err) return err;
    }
    if (comp != len - KVZ_BLOB_HEADER_SIZE)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: %zu trailing bytes after the record",
                             (size_t)(len - KVZ_BLOB_HEADER_SIZE - comp));
    uint8_t kind = rec[H_KIND];
    uint32_t layer = get32(rec + H_LAYER);
    if (kind != KVZ_BLOB_KIND_META && kind != KVZ_BLOB_KIND_LAYER)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: unknown record kind %u", kind);
    const uint8_t codec = rec[H_CODEC];
    if (codec != KVZ_BLOB_CODEC_ZSTD &&
        (ver < 2 || (codec != KVZ_BLOB_CODEC_NONE && (codec != KVZ_BLOB_CODEC_ZSTD_FRAMES || kind != KVZ_BLOB_KIND_LAYER))))
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: unknown codec %u for version %u%s", codec, ver,
                             codec == KVZ_BLOB_CODEC_ZSTD_FRAMES && ver >= 2 ? " in a META record" : "");
    if (codec == KVZ_BLOB_CODEC_NONE && get64(rec + H_RAW_SIZE) != comp)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: codec none with %llu stored bytes for a "
                             "%llu-byte payload", (unsigned long long)comp,
                             (unsigned long long)get64(rec + H_RAW_SIZE));
    if (get32(rec + H_RESERVED))
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: reserved header bytes are not zero");
    if (kind == KVZ_BLOB_KIND_META ? layer != KVZ_BLOB_META_LAYER : layer >= KVZ_BLOB_MAX_LAYERS)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: bad layer index %u for kind %u", layer, kind);
    if (info) {
        info->kind = kind;
        info->layer = layer;
        info->blob_id = get64(rec + H_BLOB_ID);
        info->raw_size = get64(rec + H_RAW_SIZE);
        info->comp_size = comp;
        info->raw_xxh3 = get64(rec + H_RAW_XXH3);
        info->version = ver;
        info->codec = codec;
    }
    return 0;
}

int kvz_blob_check(const uint8_t *rec, size_t len, kvz_blob_info *info)
{
    return check_rec(rec, len, info, NULL, 0);
}

int kvz_blob_header_codec(const uint8_t *hdr)
{
    if (!hdr || memcmp(hdr + H_MAGIC, KVZ_BLOB_MAGIC, 4) || hdr[H_KIND] != KVZ_BLOB_KIND_LAYER) return -1;
    const uint16_t ver = get16(hdr + H_VERSION);
    if (ver < KVZ_BLOB_VERSION_MIN || ver > KVZ_BLOB_VERSION) return -1;
    return hdr[H_CODEC];
}

uint64_t kvz_blob_record_seed(const uint8_t *hdr)
{
    return XXH3_64bits(hdr, H_REC_XXH3);
}

/* The header of LAYER record @p l against its META (both decoders). */
static int check_layer_hdr(const kvz_blob_meta *m, uint32_t l, const kvz_blob_info *in)
{
    if (in->kind != KVZ_BLOB_KIND_LAYER)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: expected a LAYER record, got kind %u", in->kind);
    if (in->layer != l)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: record is layer %u, wanted %u", in->layer, l);
    if (in->version != meta_version(m))
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u is version %u, its META version %u",
                             l, in->version, meta_version(m));
    if (in->blob_id != kvz_blob_meta_id(m))
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u belongs to another blob", l);
    uint64_t kept = kvz_blob_layer_kept(m, l);
    if (in->raw_size != kept * row_bytes(m))
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u payload %llu bytes, counts imply %llu",
                             l, (unsigned long long)in->raw_size, (unsigned long long)(kept * row_bytes(m)));
    return 0;
}

/* kvz_blob_layer_placed (@p rec_hash: the record checksum) and kvz_blob_layer_head
 * (NULL: not compared; @p rec holds the header and the positions only) */
static int layer_placed(const kvz_blob_meta *m, uint32_t l, const uint8_t *rec, size_t len, const uint64_t *rec_hash)
{
    int err = kvz_blob_meta_validate(m);
    if (err) return err;
    if (l >= m->n_layer) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: layer %u >= n_layer %u", l, m->n_layer);
    if (!rec || ((uintptr_t)(rec + KVZ_BLOB_HEADER_SIZE) & 3))
        return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: placed record NULL or its payload not 4-byte aligned");
    kvz_blob_info in = {0};
    if ((err = check_rec(rec, len, &in, rec_hash, rec_hash == NULL))) return err;
    if (in.codec != KVZ_BLOB_CODEC_NONE)
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "kvz_blob: layer %u is a zstd record (kvz_blob_decode_layer)", l);
    if ((err = check_layer_hdr(m, l, &in))) return err;
    const uint32_t H = m->n_kv_head;
    const uint32_t *pos = (const uint32_t *)(rec + KVZ_BLOB_HEADER_SIZE);
    const uint32_t **hp = malloc(sizeof(*hp) * H);
    if (!hp) return kvz_error_set(KVZ_ERR_NOMEM, "kvz_blob: placed layer");
    uint64_t o = 0;
    for (uint32_t h = 0; h < H; h++) { hp[h] = pos + o; o += m->counts[(size_t)l * H + h]; }
    const char *p = positions_problem(m, l, hp);
    free(hp);
    if (p) return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u: %s", l, p);
    return 0;
}

int kvz_blob_layer_placed(const kvz_blob_meta *m, uint32_t l, const uint8_t *rec, size_t len, uint64_t rec_hash)
{
    return layer_placed(m, l, rec, len, &rec_hash);
}

int kvz_blob_layer_head(const kvz_blob_meta *m, uint32_t l, const uint8_t *head, size_t len)
{
    return layer_placed(m, l, head, len, NULL);
}

int kvz_blob_decode_meta(const uint8_t *rec, size_t len, const uint8_t *expected_fp,
                         kvz_blob_meta *m)
{
    if (!m) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: NULL meta");
    memset(m, 0, sizeof *m);
    kvz_blob_info in = {0};
    int err = kvz_blob_check(rec, len, &in);
    if (err) return err;
    if (in.kind != KVZ_BLOB_KIND_META)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: expected a META record, got kind %u", in.kind);
    const uint64_t fixed = meta_fixed_size(in.version);
    uint64_t max_raw = fixed + 4ull * KVZ_BLOB_MAX_LAYERS * KVZ_BLOB_MAX_HEADS;
    if (in.raw_size < fixed || in.raw_size > max_raw || (in.raw_size - fixed) % 4)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: META payload size %llu invalid",
                             (unsigned long long)in.raw_size);
    if (in.blob_id != in.raw_xxh3)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: META blob id differs from its payload hash");
    const uint8_t *comp = rec + KVZ_BLOB_HEADER_SIZE;
    uint8_t *buf = NULL;        /* zstd: the decompressed payload */
    const uint8_t *raw = comp;  /* codec none: the payload in place */
    if (in.codec == KVZ_BLOB_CODEC_ZSTD) {
        unsigned long long fcs = ZSTD_getFrameContentSize(comp, in.comp_size);
        if (fcs != in.raw_size)
            return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: META zstd frame content size %llu, header "
                                 "says %llu", fcs, (unsigned long long)in.raw_size);
        if (!(buf = malloc(in.raw_size))) return kvz_error_set(KVZ_ERR_NOMEM, "kvz_blob: META payload");
        size_t zr = ZSTD_decompress(buf, in.raw_size, comp, in.comp_size);
        if (ZSTD_isError(zr) || zr != in.raw_size) {
            err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: META zstd frame: %s",
                                ZSTD_isError(zr) ? ZSTD_getErrorName(zr) : "wrong size");
            goto fail;
        }
        raw = buf;
    }
    if (XXH3_64bits(raw, in.raw_size) != in.raw_xxh3) {
        err = kvz_error_set(KVZ_ERR_CHECKSUM, "kvz_blob: META payload checksum mismatch");
        goto fail;
    }
    memcpy(m->fingerprint, raw + M_FP, 16);
    m->n_layer = get32(raw + M_N_LAYER);
    m->n_head = get32(raw + M_N_HEAD);
    m->n_kv_head = get32(raw + M_N_KV_HEAD);
    m->head_dim = get32(raw + M_HEAD_DIM);
    m->dtype = raw[M_DTYPE];
    m->mode = raw[M_MODE];
    m->prefix_policy = raw[M_PREFIX];
    memcpy(&m->ratio, raw + M_RATIO, 4);
    m->chunk = get32(raw + M_CHUNK);
    m->overlap = get32(raw + M_OVERLAP);
    m->n_prefix = get32(raw + M_N_PREFIX);
    m->n_context = get32(raw + M_N_CONTEXT);
    m->version = in.version;
    if (in.version >= 2) memcpy(m->prefix_ref, raw + M_PREFIX_REF, 16);
    if (raw[M_RESERVED]) {
        err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: META reserved byte is not zero");
        goto fail;
    }
    if (m->n_layer < 1 || m->n_layer > KVZ_BLOB_MAX_LAYERS || m->n_kv_head < 1 ||
        m->n_kv_head > KVZ_BLOB_MAX_HEADS ||
        in.raw_size != fixed + 4ull * m->n_layer * m->n_kv_head) {
        err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: META dims (%u layers, %u kv heads) do not "
                            "match its size", m->n_layer, m->n_kv_head);
        goto fail;
    }
    m->counts = malloc(meta_counts_bytes(m));
    if (!m->counts) { err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_blob: META counts"); goto fail; }
    memcpy(m->counts, raw + fixed, meta_counts_bytes(m));
    const char *p = meta_problem(m);
    if (p) { err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: META invalid: %s", p); goto fail; }
    if (get64(raw + M_TOTAL_KEPT) != total_kept(m) || get64(raw + M_KV_BYTES) != kvz_blob_kv_bytes(m)) {
        err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: META totals disagree with its counts");
        goto fail;
    }
    if (expected_fp && memcmp(expected_fp, m->fingerprint, 16)) {
        char a[33], b[33];
        for (int i = 0; i < 16; i++) {
            static const char hx[] = "0123456789abcdef";
            a[2 * i] = hx[m->fingerprint[i] >> 4]; a[2 * i + 1] = hx[m->fingerprint[i] & 15];
            b[2 * i] = hx[expected_fp[i] >> 4]; b[2 * i + 1] = hx[expected_fp[i] & 15];
        }
        a[32] = b[32] = 0;
        err = kvz_error_set(KVZ_ERR_MODEL, "kvz_blob: made by model %s, running model %s", a, b);
        goto fail;
    }
    free(buf);
    return 0;
fail:
    free(buf);
    kvz_blob_meta_free(m);
    return err;
}

/* kvz_blob_decode_layer(); @p hashed: the record checksum computed by the caller
 * (kvz_blob_decode_layer_hashed): the payload checksum is then not recomputed */
static int decode_layer(const kvz_blob_meta *m, uint32_t l, const uint8_t *rec, size_t len, const uint64_t *hashed,
                        uint32_t *pos, void *k, void *v);

int kvz_blob_decode_layer(const kvz_blob_meta *m, uint32_t l, const uint8_t *rec, size_t len,
                          uint32_t *pos, void *k, void *v)
{
    return decode_layer(m, l, rec, len, NULL, pos, k, v);
}

int kvz_blob_decode_layer_hashed(const kvz_blob_meta *m, uint32_t l, const uint8_t *rec, size_t len,
                                 uint64_t rec_hash, uint32_t *pos, void *k, void *v)
{
    return decode_layer(m, l, rec, len, &rec_hash, pos, k, v);
}

typedef struct { void *p; size_t n; } outseg;

/* CPUs not decoding zstd-frames records, process-wide: every decode counts itself
 * (so sixteen loader workers decoding sixteen records at once add no threads) and
 * adds threads only from what is left (a record decoded alone, e.g. the largest
 * layer at the end of a load, gets its KVZ_BLOB_DECODE_THREADS). */
static atomic_long g_spare_threads = LONG_MIN;

/* Count the caller, then take up to @p want more; give back 1 + the result. */
static size_t take_threads(size_t want)
{
    long cur = atomic_load(&g_spare_threads);
    if (cur == LONG_MIN) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        if (atomic_compare_exchange_strong(&g_spare_threads, &cur, n > 0 ? n : 1)) cur = n > 0 ? n : 1;
    }
    cur = atomic_fetch_sub(&g_spare_threads, 1) - 1;
    for (;;) {
        const long take = cur < (long)want ? cur : (long)want;
        if (take <= 0) return 0;
        if (atomic_compare_exchange_weak(&g_spare_threads, &cur, cur - take)) return (size_t)take;
    }
}

/* One frame of a zstd-frames payload: where it lies and where its bytes go. */
typedef struct { size_t off, len, raw_off, raw_len; } frame_at;

typedef struct {
    const uint8_t *comp;
    const frame_at *fr;
    size_t nfr;
    uint8_t *dst;          /* contiguous output (positions || K || V) */
    pthread_mutex_t mu;
    size_t next;           /* next frame to take */
    size_t bad;            /* first frame that failed (nfr: none) */
    const char *why;
} frames_job;

static void *frames_worker(void *arg)
{
    frames_job *j = arg;
    ZSTD_DCtx *dc = ZSTD_createDCtx();
    for (;;) {
        pthread_mutex_lock(&j->mu);
        const size_t i = j->bad < j->nfr ? j->nfr : j->next++;
        if (!dc && i < j->nfr && i < j->bad) { j->bad = i; j->why = "out of memory"; }
        pthread_mutex_unlock(&j->mu);
        if (i >= j->nfr || !dc) break;
        const frame_at *f = &j->fr[i];
        const size_t got = ZSTD_decompressDCtx(dc, j->dst + f->raw_off, f->raw_len, j->comp + f->off, f->len);
        if (ZSTD_isError(got) || got != f->raw_len) {
            pthread_mutex_lock(&j->mu);
            if (i < j->bad) {
                j->bad = i;
                j->why = ZSTD_isError(got) ? ZSTD_getErrorName(got) : "shorter than its content size";
            }
            pthread_mutex_unlock(&j->mu);
        }
    }
    ZSTD_freeDCtx(dc);
    return NULL;
}

/* Payload bytes [raw_off, raw_off + n) of @p src into the three output segments. */
static void scatter(const outseg *seg, size_t raw_off, const uint8_t *src, size_t n)
{
    size_t base = 0;
    for (int s = 0; s < 3 && n; s++) {
        if (raw_off < base + seg[s].n) {
            const size_t o = raw_off - base, take = seg[s].n - o < n ? seg[s].n - o : n;
            memcpy((uint8_t *)seg[s].p + o, src, take);
            src += take;
            n -= take;
            raw_off += take;
        }
        base += seg[s].n;
    }
}

/* Codec zstd-frames: every frame independent, with its content size:
 * KVZ_BLOB_ZSTD_FRAME_RAW raw bytes each, the last one the rest, at least two, and
 * nothing after the last. Checked in full before a byte is decoded. Adjacent
 * segments (the loader's staging layout) are decoded straight into place on up to
 * KVZ_BLOB_DECODE_THREADS threads; else one frame at a time through a buffer.
 * @p raw_xxh3 non-NULL: check the payload checksum. */
static int decode_frames(uint32_t l, const uint8_t *comp, size_t comp_size, size_t raw_size, const outseg *seg,
                         const uint64_t *raw_xxh3)
{
    const size_t F = KVZ_BLOB_ZSTD_FRAME_RAW;
    const size_t nfr = raw_size / F + (raw_size % F != 0);
    if (nfr < 2)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u: codec zstd-frames for a %zu-byte payload "
                             "(one frame's worth)", l, raw_size);
    frame_at *fr = malloc(sizeof *fr * nfr);
    if (!fr) return kvz_error_set(KVZ_ERR_NOMEM, "kvz_blob: decode");
    int err = 0;
    size_t off = 0;
    for (size_t i = 0; i < nfr; i++) {
        const size_t want = i + 1 < nfr ? F : raw_size - i * F;
        const size_t fsz = off < comp_size ? ZSTD_findFrameCompressedSize(comp + off, comp_size - off) : 0;
        if (off >= comp_size || ZSTD_isError(fsz)) {
            err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u zstd frame %zu of %zu: %s", l, i, nfr,
                                off >= comp_size ? "missing" : ZSTD_getErrorName(fsz));
            goto done;
        }
        const unsigned long long fcs = ZSTD_getFrameContentSize(comp + off, fsz);
        if (fcs != want) {
            err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u zstd frame %zu of %zu holds %s bytes, "
                                "expected %zu", l, i, nfr, fcs == ZSTD_CONTENTSIZE_UNKNOWN ? "an unknown number of" :
                                fcs == ZSTD_CONTENTSIZE_ERROR ? "a bad header and" : "another number of", want);
            goto done;
        }
        fr[i] = (frame_at){off, fsz, i * F, want};
        off += fsz;
    }
    if (off != comp_size) {
        err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u: %zu bytes after the last zstd frame", l,
                            comp_size - off);
        goto done;
    }
    if ((uint8_t *)seg[0].p + seg[0].n == (uint8_t *)seg[1].p && (uint8_t *)seg[1].p + seg[1].n == (uint8_t *)seg[2].p) {
        frames_job j = {.comp = comp, .fr = fr, .nfr = nfr, .dst = seg[0].p, .bad = nfr};
        pthread_mutex_init(&j.mu, NULL);
        const size_t extra = take_threads((nfr < KVZ_BLOB_DECODE_THREADS ? nfr : KVZ_BLOB_DECODE_THREADS) - 1);
        pthread_t th[KVZ_BLOB_DECODE_THREADS];
        size_t started = 0;
        for (size_t t = 0; t < extra; t++) /* the calling thread is one more */
            if (!pthread_create(&th[started], NULL, frames_worker, &j)) started++;
        frames_worker(&j);
        for (size_t t = 0; t < started; t++) pthread_join(th[t], NULL);
        atomic_fetch_add(&g_spare_threads, (long)extra + 1);
        pthread_mutex_destroy(&j.mu);
        if (j.bad < nfr) {
            err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u zstd frame %zu of %zu: %s", l, j.bad, nfr, j.why);
            goto done;
        }
        if (raw_xxh3 && XXH3_64bits(seg[0].p, raw_size) != *raw_xxh3)
            err = kvz_error_set(KVZ_ERR_CHECKSUM, "kvz_blob: layer %u payload checksum mismatch", l);
        goto done;
    }
    {
        uint8_t *buf = malloc(F);
        ZSTD_DCtx *dc = ZSTD_createDCtx();
        XXH3_state_t *hs = XXH3_createState();
        if (!buf || !dc || !hs) err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_blob: decode");
        if (hs) XXH3_64bits_reset(hs);
        for (size_t i = 0; i < nfr && !err; i++) {
            const size_t got = ZSTD_decompressDCtx(dc, buf, fr[i].raw_len, comp + fr[i].off, fr[i].len);
            if (ZSTD_isError(got) || got != fr[i].raw_len) {
                err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u zstd frame %zu of %zu: %s", l, i, nfr,
                                    ZSTD_isError(got) ? ZSTD_getErrorName(got) : "shorter than its content size");
                break;
            }
            if (raw_xxh3) XXH3_64bits_update(hs, buf, got);
            scatter(seg, fr[i].raw_off, buf, got);
        }
        if (!err && raw_xxh3 && XXH3_64bits_digest(hs) != *raw_xxh3)
            err = kvz_error_set(KVZ_ERR_CHECKSUM, "kvz_blob: layer %u payload checksum mismatch", l);
        free(buf);
        ZSTD_freeDCtx(dc);
        XXH3_freeState(hs);
    }
done:
    free(fr);
    return err;
}

static int decode_layer(const kvz_blob_meta *m, uint32_t l, const uint8_t *rec, size_t len, const uint64_t *hashed,
                        uint32_t *pos, void *k, void *v)
{
    int err = kvz_blob_meta_validate(m);
    if (err) return err;
    if (l >= m->n_layer) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: layer %u >= n_layer %u", l, m->n_layer);
    kvz_blob_info in = {0};
    if ((err = check_rec(rec, len, &in, hashed, 0))) return err;
    if ((err = check_layer_hdr(m, l, &in))) return err;
    uint64_t kept = kvz_blob_layer_kept(m, l);
    if (kept && (!pos || !k || !v)) return kvz_error_set(KVZ_ERR_ARG, "kvz_blob: NULL output array");

    const uint8_t *comp = rec + KVZ_BLOB_HEADER_SIZE;
    size_t kvb = (size_t)kept * kvz_blob_kv_row_bytes(m);
    outseg seg[3] = {{pos, (size_t)kept * 4}, {k, kvb}, {v, kvb}};
    ZSTD_DCtx *dc = NULL;
    XXH3_state_t *hs = NULL;
    if (in.codec == KVZ_BLOB_CODEC_NONE) { /* raw payload (comp_size == raw_size, checked) */
        size_t o = 0;
        for (int s = 0; s < 3; s++) {
            if (seg[s].n) memcpy(seg[s].p, comp + o, seg[s].n);
            o += seg[s].n;
        }
        if (!hashed && XXH3_64bits(comp, in.comp_size) != in.raw_xxh3) {
            err = kvz_error_set(KVZ_ERR_CHECKSUM, "kvz_blob: layer %u payload checksum mismatch", l);
            goto done;
        }
        goto placed;
    }
    if (in.codec == KVZ_BLOB_CODEC_ZSTD_FRAMES) {
        err = decode_frames(l, comp, (size_t)in.comp_size, (size_t)in.raw_size, seg, hashed ? NULL : &in.raw_xxh3);
        if (err) return err;
        goto placed;
    }
    unsigned long long fcs = ZSTD_getFrameContentSize(comp, in.comp_size);
    if (fcs != in.raw_size)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u zstd frame content size %llu, "
                             "header says %llu", l, fcs, (unsigned long long)in.raw_size);
    dc = ZSTD_createDCtx();
    hs = XXH3_createState();
    if (!dc || !hs) { err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_blob: decode"); goto done; }
    XXH3_64bits_reset(hs);
    ZSTD_inBuffer ib = {comp, in.comp_size, 0};
    size_t zr = 1; /* nonzero: frame not finished */
    for (int s = 0; s < 3; s++) {
        ZSTD_outBuffer ob = {seg[s].p, seg[s].n, 0};
        while (ob.pos < ob.size) {
            size_t in0 = ib.pos, out0 = ob.pos;
            zr = ZSTD_decompressStream(dc, &ob, &ib);
            if (ZSTD_isError(zr)) {
                err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u zstd: %s", l, ZSTD_getErrorName(zr));
                goto done;
            }
            if ((zr == 0 && ob.pos < ob.size) || (ib.pos == in0 && ob.pos == out0)) {
                err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u zstd frame ends early", l);
                goto done;
            }
        }
        if (seg[s].n && !hashed) XXH3_64bits_update(hs, seg[s].p, seg[s].n);
    }
    while (zr != 0) { /* all bytes placed: the frame must end here */
        uint8_t extra;
        ZSTD_outBuffer ob = {&extra, 1, 0};
        size_t in0 = ib.pos;
        zr = ZSTD_decompressStream(dc, &ob, &ib);
        if (ZSTD_isError(zr) || ob.pos || (zr && ib.pos == in0)) {
            err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u zstd frame %s", l,
                                ZSTD_isError(zr) ? ZSTD_getErrorName(zr) : ob.pos ? "too long" : "incomplete");
            goto done;
        }
    }
    if (ib.pos != ib.size) {
        err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u: bytes after the zstd frame", l);
        goto done;
    }
    if (!hashed && XXH3_64bits_digest(hs) != in.raw_xxh3) {
        err = kvz_error_set(KVZ_ERR_CHECKSUM, "kvz_blob: layer %u payload checksum mismatch", l);
        goto done;
    }
placed:
    {
        uint32_t H = m->n_kv_head;
        const uint32_t **hp = malloc(sizeof(*hp) * H);
        if (!hp) { err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_blob: decode"); goto done; }
        uint64_t o = 0;
        for (uint32_t h = 0; h < H; h++) { hp[h] = pos ? pos + o : NULL; o += m->counts[(size_t)l * H + h]; }
        const char *p = positions_problem(m, l, hp);
        free(hp);
        if (p) { err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u: %s", l, p); goto done; }
    }
    uint64_t bad;
    for (int s = 1; s < 3 && kept; s++) /* q8/q4: never hand out a NaN/Inf/negative scale */
        if (kvz_kvrow_check(m->dtype, seg[s].p, kept, m->head_dim, &bad)) {
            err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_blob: layer %u %s row %llu: bad %s scale block "
                                "(NaN, Inf or negative scale, or q8 value -128)", l, s == 1 ? "K" : "V",
                                (unsigned long long)bad, kvz_kv_dtype_name(m->dtype));
            goto done;
        }
done:
    ZSTD_freeDCtx(dc);
    XXH3_freeState(hs);
    return err;
}
