/* GGUF v2/v3 reader over a private read-only mmap.
 *
 * File layout (all little-endian):
 *   u32 magic "GGUF", u32 version, u64 n_tensors, u64 n_kv,
 *   n_kv x { str key, u32 type, value },
 *   n_tensors x { str name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset },
 *   padding to general.alignment (default 32), tensor data.
 *   str = u64 len + bytes; array value = u32 elem_type, u64 n, elements.
 *
 * Every read goes through a bounds-checked cursor: a length that would run past
 * the end of the file is KVZ_ERR_TRUNCATED; counts and lengths beyond hard
 * sanity caps are KVZ_ERR_FORMAT. */
#include "kvz_gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "kvz_error.h"
#include "kvz_quant.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvz_gguf.c assumes a little-endian host"
#endif

#define GGUF_MAGIC 0x46554747u /* "GGUF" read as LE u32 */
#define GGUF_DEFAULT_ALIGNMENT 32u

/* Sanity caps: anything above is corrupt, whatever the file size. */
#define CAP_N_KV (1ull << 20)
#define CAP_N_TENSORS (1ull << 20)
#define CAP_KEY_LEN (1ull << 16)
#define CAP_STR_LEN (1ull << 30)
#define CAP_ARR_N (1ull << 32)
#define CAP_ARR_DEPTH 8

struct kvz_gguf {
    const uint8_t *map;   /* (size) bytes, PROT_READ */
    uint64_t size;
    uint32_t version;
    uint32_t alignment;
    uint64_t n_kv;
    kvz_gguf_kv *kv;      /* (n_kv) */
    uint32_t *kv_sorted;  /* (n_kv) indices into kv, sorted by key */
    uint64_t n_tensors;
    kvz_gguf_tensor *t;   /* (n_tensors) */
    uint32_t *t_sorted;   /* (n_tensors) indices into t, sorted by name */
    uint64_t meta_end;    /* end of the tensor-info table */
    uint64_t data_start;  /* start of the data section (aligned) */
    int have_fp;
    uint8_t fp[16];
};

/* ------------------------------------------------------------------------ */
/* Bounds-checked cursor                                                    */

typedef struct {
    const uint8_t *p;
    uint64_t size;
    uint64_t pos;
} cursor;

static int need(cursor *c, uint64_t n, const char *what)
{
    if (n > c->size - c->pos)
        return kvz_error_set(KVZ_ERR_TRUNCATED, "gguf: %s at offset %llu needs %llu bytes, file has %llu",
                             what, (unsigned long long)c->pos, (unsigned long long)n,
                             (unsigned long long)(c->size - c->pos));
    return 0;
}

static int rd_u32(cursor *c, uint32_t *v, const char *what)
{
    int rc = need(c, 4, what);
    if (rc) return rc;
    memcpy(v, c->p + c->pos, 4);
    c->pos += 4;
    return 0;
}

static int rd_u64(cursor *c, uint64_t *v, const char *what)
{
    int rc = need(c, 8, what);
    if (rc) return rc;
    memcpy(v, c->p + c->pos, 8);
    c->pos += 8;
    return 0;
}

static int rd_str(cursor *c, kvz_str *s, uint64_t cap, const char *what)
{
    uint64_t len;
    int rc = rd_u64(c, &len, what);
    if (rc) return rc;
    if (len > cap)
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: %s length %llu exceeds cap %llu", what,
                             (unsigned long long)len, (unsigned long long)cap);
    if ((rc = need(c, len, what))) return rc;
    s->ptr = (const char *)(c->p + c->pos);
    s->len = len;
    c->pos += len;
    return 0;
}

/* Fixed size of a scalar metadata type; 0 for string/array/unknown. */
static uint64_t scalar_size(uint32_t type)
{
    switch (type) {
    case KVZ_GGUF_U8: case KVZ_GGUF_I8: case KVZ_GGUF_BOOL: return 1;
    case KVZ_GGUF_U16: case KVZ_GGUF_I16: return 2;
    case KVZ_GGUF_U32: case KVZ_GGUF_I32: case KVZ_GGUF_F32: return 4;
    case KVZ_GGUF_U64: case KVZ_GGUF_I64: case KVZ_GGUF_F64: return 8;
    default: return 0;
    }
}

static int skip_value(cursor *c, uint32_t type, int depth);

/* Array body after its u32 elem type: u64 n, then n elements. */
static int skip_array(cursor *c, uint32_t *elem_type, uint64_t *n_out, int depth)
{
    uint32_t et;
    uint64_t n;
    int rc;
    if (depth > CAP_ARR_DEPTH)
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: arrays nested deeper than %d", CAP_ARR_DEPTH);
    if ((rc = rd_u32(c, &et, "array type")) || (rc = rd_u64(c, &n, "array length"))) return rc;
    if (n > CAP_ARR_N)
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: array length %llu exceeds cap", (unsigned long long)n);
    uint64_t es = scalar_size(et);
    if (es) {
        if ((rc = need(c, n * es, "array data"))) return rc; /* n <= 2^32, es <= 8: no overflow */
        c->pos += n * es;
    } else if (et == KVZ_GGUF_STRING || et == KVZ_GGUF_ARRAY) {
        /* each element needs at least 8 (string) or 12 (array) bytes: reject early */
        uint64_t min = et == KVZ_GGUF_STRING ? 8 : 12;
        if ((rc = need(c, n * min, "array data"))) return rc;
        for (uint64_t i = 0; i < n; i++)
            if ((rc = skip_value(c, et, depth + 1))) return rc;
    } else {
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: unknown array element type %u", et);
    }
    *elem_type = et;
    *n_out = n;
    return 0;
}

static int skip_value(cursor *c, uint32_t type, int depth)
{
    uint64_t es = scalar_size(type);
    if (es) {
        int rc = need(c, es, "value");
        if (rc) return rc;
        c->pos += es;
        return 0;
    }
    if (type == KVZ_GGUF_STRING) {
        kvz_str s;
        return rd_str(c, &s, CAP_STR_LEN, "string");
    }
    if (type == KVZ_GGUF_ARRAY) {
        uint32_t et;
        uint64_t n;
        return skip_array(c, &et, &n, depth);
    }
    return kvz_error_set(KVZ_ERR_FORMAT, "gguf: unknown value type %u", type);
}

/* ------------------------------------------------------------------------ */
/* Sorted indices for lookup and duplicate detection                        */

static int str_cmp(kvz_str a, kvz_str b)
{
    uint64_t n = a.len < b.len ? a.len : b.len;
    int r = n ? memcmp(a.ptr, b.ptr, (size_t)n) : 0;
    if (r) return r;
    return a.len < b.len ? -1 : a.len > b.len ? 1 : 0;
}

static int str_cmp_c(kvz_str a, const char *s)
{
    kvz_str b = {s, strlen(s)};
    return str_cmp(a, b);
}

/* qsort has no context argument: sort pairs of (name, index) instead. */
typedef struct {
    kvz_str name;
    uint32_t idx;
} name_idx;

static int name_idx_cmp(const void *a, const void *b)
{
    return str_cmp(((const name_idx *)a)->name, ((const name_idx *)b)->name);
}

/* Fill out[n] with indices sorted by name; FORMAT on a duplicate name. */
static int sort_names(const kvz_str *names, size_t stride, uint64_t n, uint32_t *out, const char *what)
{
    if (n == 0) return 0;
    name_idx *tmp = malloc((size_t)n * sizeof *tmp);
    if (!tmp) return kvz_error_set(KVZ_ERR_NOMEM, "gguf: sorting %s", what);
    for (uint64_t i = 0; i < n; i++) {
        memcpy(&tmp[i].name, (const uint8_t *)names + i * stride, sizeof(kvz_str));
        tmp[i].idx = (uint32_t)i;
    }
    qsort(tmp, (size_t)n, sizeof *tmp, name_idx_cmp);
    int rc = 0;
    for (uint64_t i = 0; i < n; i++) {
        out[i] = tmp[i].idx;
        if (i && !rc && str_cmp(tmp[i - 1].name, tmp[i].name) == 0) {
            int len = tmp[i].name.len > 200 ? 200 : (int)tmp[i].name.len;
            rc = kvz_error_set(KVZ_ERR_FORMAT, "gguf: duplicate %s '%.*s'", what, len, tmp[i].name.ptr);
        }
    }
    free(tmp);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Open / close                                                             */

static int parse(kvz_gguf *g)
{
    cursor c = {g->map, g->size, 0};
    uint32_t magic;
    int rc;
    if ((rc = rd_u32(&c, &magic, "magic"))) return rc;
    if (magic != GGUF_MAGIC)
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: bad magic 0x%08x", magic);
    if ((rc = rd_u32(&c, &g->version, "version"))) return rc;
    if (g->version != 2 && g->version != 3)
        return kvz_error_set(KVZ_ERR_VERSION, "gguf: version %u (only 2 and 3 are supported)", g->version);
    if ((rc = rd_u64(&c, &g->n_tensors, "tensor count")) || (rc = rd_u64(&c, &g->n_kv, "kv count")))
        return rc;
    if (g->n_tensors > CAP_N_TENSORS)
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: %llu tensors exceeds cap", (unsigned long long)g->n_tensors);
    if (g->n_kv > CAP_N_KV)
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: %llu keys exceeds cap", (unsigned long long)g->n_kv);
    /* minimum entry sizes: kv 8+0+4+1, tensor info 8+0+4+8+4+8 */
    if ((rc = need(&c, g->n_kv * 13 + g->n_tensors * 32, "tables"))) return rc;

    g->kv = calloc((size_t)g->n_kv + 1, sizeof *g->kv);
    g->kv_sorted = calloc((size_t)g->n_kv + 1, sizeof *g->kv_sorted);
    g->t = calloc((size_t)g->n_tensors + 1, sizeof *g->t);
    g->t_sorted = calloc((size_t)g->n_tensors + 1, sizeof *g->t_sorted);
    if (!g->kv || !g->kv_sorted || !g->t || !g->t_sorted)
        return kvz_error_set(KVZ_ERR_NOMEM, "gguf: tables");

    /* --- metadata --- */
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        kvz_gguf_kv *kv = &g->kv[i];
        if ((rc = rd_str(&c, &kv->key, CAP_KEY_LEN, "key"))) return rc;
        if ((rc = rd_u32(&c, &kv->type, "value type"))) return rc;
        uint64_t start = c.pos;
        if (kv->type == KVZ_GGUF_ARRAY) {
            if ((rc = skip_array(&c, &kv->arr_type, &kv->arr_n, 1))) return rc;
            start += 12; /* data points at the first element */
        } else if ((rc = skip_value(&c, kv->type, 0))) {
            return rc;
        }
        kv->data = g->map + start;
        kv->nbytes = c.pos - start;
        if (kvz_str_eq(kv->key, "general.alignment")) {
            uint32_t a;
            if (kv->type != KVZ_GGUF_U32)
                return kvz_error_set(KVZ_ERR_FORMAT, "gguf: general.alignment has type %u, not u32", kv->type);
            memcpy(&a, kv->data, 4);
            if (a == 0 || (a & (a - 1)))
                return kvz_error_set(KVZ_ERR_FORMAT, "gguf: general.alignment %u is not a power of two", a);
            g->alignment = a;
        }
    }
    if ((rc = sort_names(&g->kv[0].key, sizeof(kvz_gguf_kv), g->n_kv, g->kv_sorted, "key"))) return rc;

    /* --- tensor infos --- */
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        kvz_gguf_tensor *t = &g->t[i];
        if ((rc = rd_str(&c, &t->name, CAP_KEY_LEN, "tensor name"))) return rc;
        if ((rc = rd_u32(&c, &t->n_dims, "tensor n_dims"))) return rc;
        if (t->n_dims == 0 || t->n_dims > KVZ_GGUF_MAX_DIMS)
            return kvz_error_set(KVZ_ERR_FORMAT, "gguf: tensor %llu has %u dims",
                                 (unsigned long long)i, t->n_dims);
        int64_t nel = 1;
        for (uint32_t d = 0; d < KVZ_GGUF_MAX_DIMS; d++) {
            uint64_t ne = 1;
            if (d < t->n_dims && (rc = rd_u64(&c, &ne, "tensor dim"))) return rc;
            if (ne == 0 || ne > (uint64_t)INT64_MAX || (int64_t)ne > INT64_MAX / nel)
                return kvz_error_set(KVZ_ERR_FORMAT, "gguf: tensor %llu dim %u = %llu is zero or overflows",
                                     (unsigned long long)i, d, (unsigned long long)ne);
            t->ne[d] = (int64_t)ne;
            nel *= (int64_t)ne;
        }
        if ((rc = rd_u32(&c, &t->type, "tensor type")) || (rc = rd_u64(&c, &t->offset, "tensor offset")))
            return rc;
        if (kvz_type_block_elems(t->type) == 0)
            return kvz_error_set(KVZ_ERR_UNSUPPORTED, "gguf: tensor %llu has unknown type %u",
                                 (unsigned long long)i, t->type);
        if (t->ne[0] % kvz_type_block_elems(t->type) != 0)
            return kvz_error_set(KVZ_ERR_FORMAT, "gguf: tensor %llu row of %lld is not a multiple of the %s block",
                                 (unsigned long long)i, (long long)t->ne[0], kvz_type_name(t->type));
        int64_t nb = kvz_type_nbytes(t->type, nel);
        if (nb < 0)
            return kvz_error_set(KVZ_ERR_FORMAT, "gguf: tensor %llu size overflows", (unsigned long long)i);
        t->nbytes = (uint64_t)nb;
        if (t->offset % g->alignment != 0)
            return kvz_error_set(KVZ_ERR_FORMAT, "gguf: tensor %llu offset %llu not aligned to %u",
                                 (unsigned long long)i, (unsigned long long)t->offset, g->alignment);
    }
    if ((rc = sort_names(&g->t[0].name, sizeof(kvz_gguf_tensor), g->n_tensors, g->t_sorted, "tensor")))
        return rc;

    /* --- data section --- */
    g->meta_end = c.pos;
    g->data_start = (c.pos + g->alignment - 1) / g->alignment * g->alignment; /* pos < 2^63: no overflow */
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        kvz_gguf_tensor *t = &g->t[i];
        if (g->data_start > g->size || t->offset > g->size - g->data_start ||
            t->nbytes > g->size - g->data_start - t->offset)
            return kvz_error_set(KVZ_ERR_TRUNCATED, "gguf: tensor '%.*s' [%llu, +%llu) lies beyond the end of the file",
                                 t->name.len > 200 ? 200 : (int)t->name.len, t->name.ptr,
                                 (unsigned long long)(g->data_start + t->offset), (unsigned long long)t->nbytes);
        t->data = g->map + g->data_start + t->offset;
    }
    return 0;
}

int kvz_gguf_open(const char *path, kvz_gguf **out)
{
    if (!out) return kvz_error_set(KVZ_ERR_ARG, "gguf: out is NULL");
    *out = NULL;
    if (!path) return kvz_error_set(KVZ_ERR_ARG, "gguf: path is NULL");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvz_error_set(errno == ENOENT ? KVZ_ERR_NOTFOUND : KVZ_ERR_IO,
                                     "gguf: open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kvz_error_set(KVZ_ERR_IO, "gguf: stat %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kvz_error_set(KVZ_ERR_IO, "gguf: %s is not a regular file", path);
    }
    if (st.st_size < 24) {
        close(fd);
        return kvz_error_set(KVZ_ERR_TRUNCATED, "gguf: %s has %lld bytes, shorter than a header",
                             path, (long long)st.st_size);
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return kvz_error_set(KVZ_ERR_IO, "gguf: mmap %s: %s", path, strerror(e));

    kvz_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        munmap(map, (size_t)st.st_size);
        return kvz_error_set(KVZ_ERR_NOMEM, "gguf: handle");
    }
    g->map = map;
    g->size = (uint64_t)st.st_size;
    int rc = parse(g);
    if (rc) {
        kvz_gguf_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

void kvz_gguf_close(kvz_gguf *g)
{
    if (!g) return;
    if (g->map) munmap((void *)g->map, (size_t)g->size);
    free(g->kv);
    free(g->kv_sorted);
    free(g->t);
    free(g->t_sorted);
    free(g);
}

/* ------------------------------------------------------------------------ */
/* Accessors                                                                */

uint32_t kvz_gguf_version(const kvz_gguf *g) { return g->version; }
uint64_t kvz_gguf_n_kv(const kvz_gguf *g) { return g->n_kv; }
uint64_t kvz_gguf_n_tensors(const kvz_gguf *g) { return g->n_tensors; }
uint64_t kvz_gguf_data_offset(const kvz_gguf *g) { return g->data_start; }
uint32_t kvz_gguf_alignment(const kvz_gguf *g) { return g->alignment; }

const kvz_gguf_kv *kvz_gguf_kv_at(const kvz_gguf *g, uint64_t i)
{
    return i < g->n_kv ? &g->kv[i] : NULL;
}

const kvz_gguf_tensor *kvz_gguf_tensor_at(const kvz_gguf *g, uint64_t i)
{
    return i < g->n_tensors ? &g->t[i] : NULL;
}

int kvz_str_eq(kvz_str s, const char *cstr)
{
    size_t n = strlen(cstr);
    return s.len == n && (n == 0 || memcmp(s.ptr, cstr, n) == 0);
}

const kvz_gguf_kv *kvz_gguf_find(const kvz_gguf *g, const char *key)
{
    uint64_t lo = 0, hi = g->n_kv;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int r = str_cmp_c(g->kv[g->kv_sorted[mid]].key, key);
        if (r == 0) return &g->kv[g->kv_sorted[mid]];
        if (r < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

const kvz_gguf_tensor *kvz_gguf_find_tensor(const kvz_gguf *g, const char *name)
{
    uint64_t lo = 0, hi = g->n_tensors;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int r = str_cmp_c(g->t[g->t_sorted[mid]].name, name);
        if (r == 0) return &g->t[g->t_sorted[mid]];
        if (r < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

static const kvz_gguf_kv *find_or_err(const kvz_gguf *g, const char *key, int *rc)
{
    const kvz_gguf_kv *kv = kvz_gguf_find(g, key);
    *rc = kv ? 0 : kvz_error_set(KVZ_ERR_NOTFOUND, "gguf: key %s not found", key);
    return kv;
}

int kvz_gguf_get_i64(const kvz_gguf *g, const char *key, int64_t *out)
{
    int rc;
    const kvz_gguf_kv *kv = find_or_err(g, key, &rc);
    if (!kv) return rc;
    const uint8_t *p = kv->data;
    switch (kv->type) {
    case KVZ_GGUF_U8: case KVZ_GGUF_BOOL: *out = p[0]; return 0;
    case KVZ_GGUF_I8: *out = (int8_t)p[0]; return 0;
    case KVZ_GGUF_U16: { uint16_t v; memcpy(&v, p, 2); *out = v; return 0; }
    case KVZ_GGUF_I16: { int16_t v; memcpy(&v, p, 2); *out = v; return 0; }
    case KVZ_GGUF_U32: { uint32_t v; memcpy(&v, p, 4); *out = v; return 0; }
    case KVZ_GGUF_I32: { int32_t v; memcpy(&v, p, 4); *out = v; return 0; }
    case KVZ_GGUF_I64: { int64_t v; memcpy(&v, p, 8); *out = v; return 0; }
    case KVZ_GGUF_U64: {
        uint64_t v;
        memcpy(&v, p, 8);
        if (v > (uint64_t)INT64_MAX)
            return kvz_error_set(KVZ_ERR_FORMAT, "gguf: %s = %llu does not fit int64", key, (unsigned long long)v);
        *out = (int64_t)v;
        return 0;
    }
    default: return kvz_error_set(KVZ_ERR_FORMAT, "gguf: %s has type %u, not an integer", key, kv->type);
    }
}

int kvz_gguf_get_f32(const kvz_gguf *g, const char *key, float *out)
{
    int rc;
    const kvz_gguf_kv *kv = find_or_err(g, key, &rc);
    if (!kv) return rc;
    if (kv->type == KVZ_GGUF_F32) { memcpy(out, kv->data, 4); return 0; }
    if (kv->type == KVZ_GGUF_F64) {
        double d;
        memcpy(&d, kv->data, 8);
        *out = (float)d;
        return 0;
    }
    if (kv->type == KVZ_GGUF_BOOL)
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: %s is a bool, not a number", key);
    int64_t v;
    if ((rc = kvz_gguf_get_i64(g, key, &v))) return rc;
    *out = (float)v;
    return 0;
}

int kvz_gguf_get_str(const kvz_gguf *g, const char *key, kvz_str *out)
{
    int rc;
    const kvz_gguf_kv *kv = find_or_err(g, key, &rc);
    if (!kv) return rc;
    if (kv->type != KVZ_GGUF_STRING)
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: %s has type %u, not a string", key, kv->type);
    memcpy(&out->len, kv->data, 8); /* validated at open */
    out->ptr = (const char *)kv->data + 8;
    return 0;
}

int kvz_gguf_get_str_array(const kvz_gguf *g, const char *key, kvz_str **out, uint64_t *n)
{
    int rc;
    *out = NULL;
    *n = 0;
    const kvz_gguf_kv *kv = find_or_err(g, key, &rc);
    if (!kv) return rc;
    if (kv->type != KVZ_GGUF_ARRAY || kv->arr_type != KVZ_GGUF_STRING)
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: %s is not a string array", key);
    kvz_str *v = malloc(((size_t)kv->arr_n + 1) * sizeof *v);
    if (!v) return kvz_error_set(KVZ_ERR_NOMEM, "gguf: %s: %llu strings", key, (unsigned long long)kv->arr_n);
    const uint8_t *p = kv->data; /* all lengths were validated at open */
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        memcpy(&v[i].len, p, 8);
        v[i].ptr = (const char *)p + 8;
        p += 8 + v[i].len;
    }
    *out = v;
    *n = kv->arr_n;
    return 0;
}

int kvz_gguf_get_array(const kvz_gguf *g, const char *key, uint32_t *elem_type,
                       uint64_t *n, const void **data)
{
    int rc;
    const kvz_gguf_kv *kv = find_or_err(g, key, &rc);
    if (!kv) return rc;
    if (kv->type != KVZ_GGUF_ARRAY)
        return kvz_error_set(KVZ_ERR_FORMAT, "gguf: %s has type %u, not an array", key, kv->type);
    *elem_type = kv->arr_type;
    *n = kv->arr_n;
    *data = kv->data;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Fingerprint                                                              */

void kvz_gguf_fingerprint(kvz_gguf *g, uint8_t out[16])
{
    if (!g->have_fp) {
        XXH3_state_t st; /* on the stack: no allocation that could fail */
        XXH3_INITSTATE(&st);
        XXH3_128bits_reset(&st);
        XXH3_128bits_update(&st, g->map, (size_t)g->meta_end);
        for (uint64_t i = 0; i < g->n_tensors; i++)
            XXH3_128bits_update(&st, g->t[i].data, (size_t)g->t[i].nbytes);
        XXH128_canonical_t cano;
        XXH128_canonicalFromHash(&cano, XXH3_128bits_digest(&st));
        memcpy(g->fp, cano.digest, 16);
        g->have_fp = 1;
    }
    memcpy(out, g->fp, 16);
}
