/* libkvzip: the public API (include/kvzip.h) over the modules: runtime/ (model,
 * KV cache, chat layout, decode loop), ingest/ (KVzip pipeline, stored-cache
 * loading), store/ (LMDB). It adds what a long-lived caller needs and the CLIs
 * used to do in main(): handle lifetimes with references, argument checks, the
 * part policy, the question session, the per-model device lock. */
#include "kvzip.h"
#include "kvz_api.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_compose.h"
#include "kvz_doc_cache.h"
#include "kvz_error.h"
#include "kvz_kvdtype.h"
#include "kvz_generate.h"
#include "kvz_ingest.h"
#include "kvz_load.h"
#include "kvz_model.h"
#include "kvz_parts.h"
#include "kvz_store.h"

/* The public codes are the internal ones (plus two of the API's own). */
_Static_assert((int)KVZIP_ERR_NOMEM == (int)KVZ_ERR_NOMEM && (int)KVZIP_ERR_IO == (int)KVZ_ERR_IO &&
               (int)KVZIP_ERR_FORMAT == (int)KVZ_ERR_FORMAT && (int)KVZIP_ERR_TRUNCATED == (int)KVZ_ERR_TRUNCATED &&
               (int)KVZIP_ERR_UNSUPPORTED == (int)KVZ_ERR_UNSUPPORTED && (int)KVZIP_ERR_ARG == (int)KVZ_ERR_ARG &&
               (int)KVZIP_ERR_NOTFOUND == (int)KVZ_ERR_NOTFOUND && (int)KVZIP_ERR_CHECKSUM == (int)KVZ_ERR_CHECKSUM &&
               (int)KVZIP_ERR_MODEL == (int)KVZ_ERR_MODEL && (int)KVZIP_ERR_VERSION == (int)KVZ_ERR_VERSION &&
               (int)KVZIP_ERR_LMDB == (int)KVZ_ERR_LMDB && (int)KVZIP_ERR_ZSTD == (int)KVZ_ERR_ZSTD &&
               (int)KVZIP_ERR_CUDA == (int)KVZ_ERR_CUDA && (int)KVZIP_ERR_FULL == (int)KVZ_ERR_FULL &&
               (int)KVZIP_ERR_CONTEXT == (int)KVZ_ERR_CONTEXT && (int)KVZIP_ERR_EMPTY == (int)KVZ_ERR_EMPTY &&
               (int)KVZIP_ERR_ENCODING == (int)KVZ_ERR_ENCODING && (int)KVZIP_ERR_BUSY == (int)KVZ_ERR_BUSY &&
               (int)KVZIP_ERR_NODEV == (int)KVZ_ERR_NODEV && (int)KVZIP_ERR_INTERNAL == (int)KVZ_ERR_INTERNAL,
               "kvzip.h error codes must equal common/kvz_error.h");
_Static_assert((int)KVZIP_DEVICE_CPU == (int)KVZ_DEVICE_CPU && (int)KVZIP_DEVICE_CUDA == (int)KVZ_DEVICE_CUDA &&
               (int)KVZIP_DEVICE_AUTO == (int)KVZ_DEVICE_AUTO, "device numbers");
_Static_assert((int)KVZIP_EVICT_GLOBAL == (int)KVZ_EVICT_GLOBAL && (int)KVZIP_EVICT_UNIFORM == (int)KVZ_EVICT_UNIFORM,
               "eviction modes");
_Static_assert((int)KVZIP_KV_F32 == (int)KVZ_KV_F32 && (int)KVZIP_KV_F16 == (int)KVZ_KV_F16 &&
                   (int)KVZIP_KV_BF16 == (int)KVZ_KV_BF16 && (int)KVZIP_KV_Q8 == (int)KVZ_KV_Q8 &&
                   (int)KVZIP_KV_Q4 == (int)KVZ_KV_Q4,
               "kvzip.h stored K/V types must equal the on-disk numbering (kvz_kvdtype.h)");

#define PREFILL_STEP 4096   /* tokens per prefill pass of a text session */
#define DOC_CACHE_MB 512    /* loaded documents kept per model (KVZIP_DOC_CACHE_MB overrides) */

/* ------------------------------------------------------------------------- */
/* Handles and references (the structs: api/kvz_api.h)                         */

static void ref_init(ref *r)
{
    pthread_mutex_init(&r->mu, NULL);
    r->refs = 1;
    r->closed = 0;
}

/* 0, or KVZIP_ERR_CLOSED when the caller's handle is closed (take: add a reference). */
static int ref_check(ref *r, int take, const char *what)
{
    pthread_mutex_lock(&r->mu);
    const int closed = r->closed;
    if (!closed && take) r->refs++;
    pthread_mutex_unlock(&r->mu);
    return closed ? kvz_error_set(KVZIP_ERR_CLOSED, "%s handle was closed", what) : 0;
}

/* Drop one reference (close: the caller's); 1 when it was the last. */
static int ref_drop(ref *r, int close, int *err)
{
    pthread_mutex_lock(&r->mu);
    *err = 0;
    if (close) {
        if (r->closed) *err = KVZIP_ERR_CLOSED;
        r->closed = 1;
    }
    const int last = !*err && --r->refs == 0;
    pthread_mutex_unlock(&r->mu);
    return last;
}

static void model_free(kvzip_model *m)
{
    kvz_doc_cache_free(m->dc); /* every session is closed: nothing is borrowed */
    kvz_model_free(m->m);
    pthread_mutex_destroy(&m->dev);
    pthread_cond_destroy(&m->dev_cv);
    pthread_mutex_destroy(&m->r.mu);
    free(m);
}

static void store_free(kvzip_store *s)
{
    kvz_store_close(s->s);
    pthread_mutex_destroy(&s->r.mu);
    free(s);
}

void kvz_api_model_unref(kvzip_model *m)
{
    int err;
    if (m && ref_drop(&m->r, 0, &err)) model_free(m);
}

int kvz_api_model_ref(kvzip_model *m)
{
    return ref_check(&m->r, 1, "model");
}

static void store_unref(kvzip_store *s)
{
    int err;
    if (s && ref_drop(&s->r, 0, &err)) store_free(s);
}

/* Device work on CUDA takes the model's lock in arrival order (a ticket lock: a
 * pthread mutex lets the thread that just released it take it again, so a batch
 * scheduler stepping in a loop would starve a session loading on another thread);
 * CPU sessions run in parallel and take nothing. */
void kvz_api_dev_lock(kvzip_model *m)
{
    if (kvz_model_device(m->m) != KVZ_DEVICE_CUDA) return;
    pthread_mutex_lock(&m->dev);
    const uint64_t t = m->dev_next++;
    while (t != m->dev_serving) pthread_cond_wait(&m->dev_cv, &m->dev);
    pthread_mutex_unlock(&m->dev);
}

void kvz_api_dev_unlock(kvzip_model *m)
{
    if (kvz_model_device(m->m) != KVZ_DEVICE_CUDA) return;
    pthread_mutex_lock(&m->dev);
    m->dev_serving++;
    pthread_cond_broadcast(&m->dev_cv);
    pthread_mutex_unlock(&m->dev);
}

/* ------------------------------------------------------------------------- */
/* Errors, version                                                             */

const char *kvzip_version(void)
{
    return "0.1.0";
}

const char *kvzip_strerror(int err)
{
    if (err == KVZIP_ERR_CLOSED) return "handle closed";
    if (err == KVZIP_ERR_CANCELED) return "canceled by the token callback";
    return kvz_strerror(err);
}

const char *kvzip_errdetail(void)
{
    return kvz_error_detail();
}

void kvzip_free(void *p)
{
    free(p);
}

#define NEED(x) \
    do { if (!(x)) return kvz_error_set(KVZIP_ERR_ARG, "%s: %s is NULL", __func__, #x); } while (0)

/* 0 if @p s[0..len) is UTF-8 text without NUL bytes and not only whitespace. */
static int check_text(const char *s, size_t len, const char *what)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, ink = 0;
    while (i < len) {
        const unsigned c = p[i];
        if (c == 0) return kvz_error_set(KVZIP_ERR_ENCODING, "%s has a NUL byte at offset %zu", what, i);
        if (c < 0x80) {
            if (c != ' ' && c != '\n' && c != '\t' && c != '\r') ink = 1;
            i++;
            continue;
        }
        size_t n;
        uint32_t cp;
        if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; }
        else return kvz_error_set(KVZIP_ERR_ENCODING, "%s is not UTF-8 (offset %zu)", what, i);
        for (size_t k = 1; k <= n; k++) {
            if (i + k >= len || (p[i + k] & 0xC0) != 0x80)
                return kvz_error_set(KVZIP_ERR_ENCODING, "%s is not UTF-8 (offset %zu)", what, i);
            cp = (cp << 6) | (p[i + k] & 0x3F);
        }
        if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
            cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return kvz_error_set(KVZIP_ERR_ENCODING, "%s is not UTF-8 (offset %zu)", what, i);
        ink = 1;
        i += n + 1;
    }
    return ink ? 0 : kvz_error_set(KVZIP_ERR_EMPTY, "%s is empty", what);
}

/* ------------------------------------------------------------------------- */
/* Model                                                                       */

void kvzip_model_defaults(kvzip_model_opts *o)
{
    memset(o, 0, sizeof *o);
    o->device = KVZIP_DEVICE_AUTO;
}

int kvzip_model_open(const char *path, const kvzip_model_opts *opts, kvzip_model **out)
{
    NEED(out);
    *out = NULL;
    kvzip_model_opts o;
    if (opts) o = *opts;
    else kvzip_model_defaults(&o);
    if (!o.synthetic && !path) return kvz_error_set(KVZIP_ERR_ARG, "no model path and no synthetic shape");
    if (o.device < KVZIP_DEVICE_CPU || o.device > KVZIP_DEVICE_AUTO || o.n_threads < 0)
        return kvz_error_set(KVZIP_ERR_ARG, "device %d / threads %d out of range", o.device, o.n_threads);
    kvzip_model *m = calloc(1, sizeof *m);
    if (!m) return KVZIP_ERR_NOMEM;
    kvz_model_opts mo = {.device = o.device, .n_threads = o.n_threads, .seed = o.seed};
    const double t0 = kvz_now();
    int rc = o.synthetic ? kvz_model_synthetic(o.synthetic, &mo, &m->m) : kvz_model_load(path, &mo, &m->m);
    if (rc) {
        free(m);
        return rc;
    }
    m->load_s = kvz_now() - t0;
    uint64_t cache_mb = DOC_CACHE_MB;
    const char *env = getenv("KVZIP_DOC_CACHE_MB");
    if (env && *env) cache_mb = strtoull(env, NULL, 10);
    const kvz_load_opts lo = {.direct = o.pin_store_map != 0};
    if ((rc = kvz_doc_cache_create(m->m, cache_mb << 20, &lo, &m->dc))) {
        kvz_model_free(m->m);
        free(m);
        return rc;
    }
    m->pin_map = o.pin_store_map != 0;
    ref_init(&m->r);
    pthread_mutex_init(&m->dev, NULL);
    pthread_cond_init(&m->dev_cv, NULL);
    *out = m;
    return 0;
}

int kvzip_model_close(kvzip_model *m)
{
    if (!m) return 0;
    int err;
    if (ref_drop(&m->r, 1, &err)) model_free(m);
    return err ? kvz_error_set(err, "model handle closed twice") : 0;
}

int kvzip_model_info_get(const kvzip_model *m, kvzip_model_info *out)
{
    NEED(m);
    NEED(out);
    int rc = ref_check((ref *)&m->r, 0, "model");
    if (rc) return rc;
    static const char *archs[] = {"llama", "qwen2", "qwen3"};
    const kvz_config *c = kvz_model_config(m->m);
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", c->name);
    snprintf(out->arch, sizeof out->arch, "%s", c->arch < 3 ? archs[c->arch] : "?");
    kvz_chat_tmpl t;
    kvz_chat_template(kvz_model_tokenizer(m->m), &t);
    snprintf(out->chat, sizeof out->chat, "%s", t.name);
    out->device = kvz_model_device(m->m);
    out->n_layer = c->n_layer;
    out->n_head = c->n_head;
    out->n_kv_head = c->n_kv_head;
    out->head_dim = c->head_dim;
    out->n_vocab = c->n_vocab;
    out->n_ctx = c->n_ctx;
    out->max_part_tokens = kvz_ingest_max_part_tokens(m->m);
    out->weight_bytes = kvz_model_weight_bytes(m->m);
    out->load_s = m->load_s;
    kvz_model_fingerprint(m->m, out->fingerprint);
    return 0;
}

int kvzip_question_tokens(const kvzip_model *m, const char *question, int32_t *n_tokens)
{
    NEED(m);
    NEED(question);
    NEED(n_tokens);
    int rc = ref_check((ref *)&m->r, 0, "model");
    if (rc) return rc;
    kvz_tokens t = {0};
    rc = kvz_chat_question(kvz_model_tokenizer(m->m), question, &t);
    *n_tokens = (int32_t)t.n;
    kvz_tokens_free(&t);
    return rc;
}

/* ------------------------------------------------------------------------- */
/* Store                                                                       */

int kvzip_store_open(const char *dir, unsigned flags, const kvzip_model *m, kvzip_store **out)
{
    NEED(out);
    *out = NULL;
    NEED(dir);
    if ((flags & ~3u) || flags == 3u)
        return kvz_error_set(KVZIP_ERR_ARG, "store flags 0x%x: READONLY and CREATE exclude each other", flags);
    uint8_t fp[16];
    if (m) {
        int rc = ref_check((ref *)&m->r, 0, "model");
        if (rc) return rc;
        kvz_model_fingerprint(m->m, fp);
    }
    kvzip_store *s = calloc(1, sizeof *s);
    if (!s) return KVZIP_ERR_NOMEM;
    const unsigned f = (flags & KVZIP_STORE_READONLY ? KVZ_STORE_READONLY : 0) |
                       (flags & KVZIP_STORE_CREATE ? KVZ_STORE_CREATE : 0);
    int rc = kvz_store_open(dir, f, 0, m ? fp : NULL, &s->s);
    if (rc) {
        free(s);
        return rc;
    }
    s->flags = flags;
    ref_init(&s->r);
    *out = s;
    return 0;
}

typedef struct {
    char id[1024];
    uint64_t tokens;
} longest_doc;

static int pick_longest(void *user, const kvzip_doc_entry *d)
{
    longest_doc *b = user;
    if (d->tokens > b->tokens && strlen(d->id) < sizeof b->id) {
        b->tokens = d->tokens;
        snprintf(b->id, sizeof b->id, "%s", d->id);
    }
    return 0;
}

int kvzip_model_prepare(kvzip_model *m, kvzip_store *s, char *doc_id, size_t doc_id_cap, double *seconds)
{
    NEED(m);
    NEED(s);
    if (seconds) *seconds = 0;
    if (doc_id && doc_id_cap) doc_id[0] = 0;
    int rc = ref_check(&m->r, 0, "model");
    if (!rc) rc = ref_check(&s->r, 0, "store");
    if (rc) return rc;
    if (kvz_model_device(m->m) != KVZ_DEVICE_CUDA) return 0; /* the CPU loader has no staging */
    longest_doc b = {.tokens = 0};
    if ((rc = kvzip_store_list(s, pick_longest, &b))) return rc;
    if (!b.tokens) return 0; /* an empty store */
    const double t0 = kvz_now();
    kvz_load_opts lo = {.direct = m->pin_map, .staging_only = 1};
    kvz_kv *kv = NULL;
    kvz_doc_meta dm;
    kvz_api_dev_lock(m);
    rc = kvz_load_doc(m->m, s->s, b.id, 0, 0, &lo, &kv, &dm);
    kvz_api_dev_unlock(m);
    kvz_kv_free(kv);
    if (rc) return rc;
    if (doc_id && doc_id_cap) snprintf(doc_id, doc_id_cap, "%s", b.id);
    if (seconds) *seconds = kvz_now() - t0;
    return 0;
}

int kvzip_store_close(kvzip_store *s)
{
    if (!s) return 0;
    int err;
    if (ref_drop(&s->r, 1, &err)) store_free(s);
    return err ? kvz_error_set(err, "store handle closed twice") : 0;
}

int kvzip_store_has_doc(kvzip_store *s, const char *doc_id)
{
    NEED(s);
    NEED(doc_id);
    int rc = ref_check(&s->r, 0, "store");
    if (rc) return rc;
    kvz_store_doc_info info;
    rc = kvz_store_lookup(s->s, doc_id, &info);
    if (rc == KVZ_ERR_NOTFOUND) {
        kvz_error_clear();
        return 0;
    }
    return rc ? rc : 1;
}

typedef struct {
    kvzip_doc_fn cb;
    void *user;
} list_ctx;

static int list_one(void *user, const char *doc_id, const kvz_store_doc_info *info)
{
    const list_ctx *lc = user;
    kvzip_doc_entry d = {.id = doc_id, .tokens = info->n_tokens, .ratio = info->ratio,
                         .part = info->part, .bytes_stored = info->bytes_stored,
                         .bytes_kv_full = info->bytes_kv_full, .bytes_kv_kept = info->bytes_kv_kept,
                         .ingest_time = info->ingest_time, .source_path = info->source_path};
    memcpy(d.hash, info->hash, sizeof d.hash);
    return lc->cb(lc->user, &d);
}

int kvzip_store_list(kvzip_store *s, kvzip_doc_fn cb, void *user)
{
    NEED(s);
    NEED(cb);
    int rc = ref_check(&s->r, 0, "store");
    if (rc) return rc;
    list_ctx lc = {cb, user};
    return kvz_store_list(s->s, list_one, &lc);
}

static int copy_entry(void *user, const kvzip_doc_entry *d)
{
    *(kvzip_doc_entry *)user = *d;
    return 0;
}

int kvzip_store_doc(kvzip_store *s, const char *doc_id, kvzip_doc_entry *out)
{
    NEED(s);
    NEED(doc_id);
    NEED(out);
    int rc = ref_check(&s->r, 0, "store");
    if (rc) return rc;
    static _Thread_local kvz_store_doc_info info;
    static _Thread_local char id[512];
    if ((rc = kvz_store_lookup(s->s, doc_id, &info))) return rc;
    snprintf(id, sizeof id, "%s", doc_id);
    list_ctx lc = {copy_entry, out};
    return list_one(&lc, id, &info);
}

/* ------------------------------------------------------------------------- */
/* Ingest                                                                      */

void kvzip_ingest_defaults(kvzip_ingest_opts *o)
{
    memset(o, 0, sizeof *o);
    kvz_ingest_opts d;
    kvz_ingest_defaults(&d);
    o->ratio = d.kp.ratio;
    o->mode = d.kp.mode;
    o->kv_dtype = d.dtype; /* the pipeline's default (q8): the public numbering is the on-disk one */
}

/* The ID#N part policy is ingest/kvz_parts.c's (one home, shared with kvzip-ingest):
 * an id held by another document is refused before any model work, and only this
 * document's own leftover parts are pruned. */
static int on_part(void *user, const kvz_part_report *rep)
{
    kvzip_ingest_result *res = user;
    if (rep->rc) return 0; /* kvz_ingest_document stops the document and returns it */
    const kvz_ingest_result *r = rep->res;
    res->parts++;
    if (r->status == KVZ_STORE_UNCHANGED || r->status == KVZ_STORE_INFO_UPDATED) res->unchanged++;
    else if (r->status == KVZ_STORE_LINKED) res->linked++;
    else res->written++;
    res->pairs_total += r->pairs_total;
    res->pairs_kept += r->pairs_kept;
    res->bytes_full += r->bytes_full;
    res->bytes_kept += r->bytes_kept;
    res->bytes_stored += r->bytes_stored;
    return 0;
}

static int ingest_parts(kvz_model *m, kvz_store *st, const char *doc_id, const char *source,
                        const kvz_tokens *tok, int32_t max_part, kvz_ingest_opts *o,
                        kvzip_ingest_result *res)
{
    int rc = kvz_ingest_document(m, st, doc_id, source, tok->ids, (int32_t)tok->n, max_part, o,
                                 on_part, res);
    if (!rc) kvz_error_clear();
    return rc;
}

int kvzip_ingest(kvzip_model *m, kvzip_store *s, const char *doc_id, const char *text, size_t len,
                 const kvzip_ingest_opts *opts, kvzip_ingest_result *res)
{
    NEED(m);
    NEED(s);
    NEED(doc_id);
    NEED(text);
    kvzip_ingest_opts io;
    if (opts) io = *opts;
    else kvzip_ingest_defaults(&io);
    kvzip_ingest_result r = {0};
    if (res) *res = r;
    const size_t idl = strlen(doc_id);
    if (idl == 0 || idl > KVZ_STORE_DOC_ID_MAX - 12) /* room for "#N" part suffixes */
        return kvz_error_set(KVZIP_ERR_ARG, "document id must be 1..%d bytes", KVZ_STORE_DOC_ID_MAX - 12);
    if (!(io.ratio > 0.0f && io.ratio <= 1.0f) || (io.mode != KVZIP_EVICT_GLOBAL && io.mode != KVZIP_EVICT_UNIFORM) ||
        io.kv_dtype < KVZIP_KV_F32 || io.kv_dtype > KVZIP_KV_Q4 || io.part_tokens < 0)
        return kvz_error_set(KVZIP_ERR_ARG, "ingest options out of range (ratio %g, mode %d, dtype %d, "
                             "part_tokens %d)", io.ratio, io.mode, io.kv_dtype, io.part_tokens);
    if (io.part_tokens > 0 && io.part_tokens < 16)
        return kvz_error_set(KVZIP_ERR_ARG, "part_tokens must be 0 or at least 16");
    int rc = ref_check(&m->r, 0, "model");
    if (!rc) rc = ref_check(&s->r, 0, "store");
    if (rc) return rc;
    if (s->flags & KVZIP_STORE_READONLY)
        return kvz_error_set(KVZIP_ERR_ARG, "the store was opened read-only");
    if ((rc = check_text(text, len, "document"))) return rc;

    kvz_ingest_opts o;
    kvz_ingest_defaults(&o);
    o.kp.ratio = io.ratio;
    o.kp.mode = io.mode;
    o.dtype = (uint8_t)io.kv_dtype; /* same numbering as kvz_kv_dtype */
    int32_t max_part = kvz_ingest_max_part_tokens(m->m);
    if (io.part_tokens > 0 && io.part_tokens < max_part) max_part = io.part_tokens;

    kvz_tokens t = {0};
    const double t0 = kvz_now();
    rc = kvz_tokenizer_encode(kvz_model_tokenizer(m->m), text, len, 0, &t);
    if (!rc && t.n == 0) rc = kvz_error_set(KVZIP_ERR_EMPTY, "document has no tokens");
    if (!rc) {
        r.tokens = (int64_t)t.n;
        kvz_api_dev_lock(m);
        rc = ingest_parts(m->m, s->s, doc_id, io.source_path ? io.source_path : "", &t, max_part, &o, &r);
        kvz_api_dev_unlock(m);
    }
    kvz_tokens_free(&t);
    r.seconds = kvz_now() - t0;
    if (res) *res = r;
    return rc;
}

/* ------------------------------------------------------------------------- */
/* Sessions                                                                    */

void kvzip_session_defaults(kvzip_session_opts *o)
{
    memset(o, 0, sizeof *o);
    o->budget = 1024;
    o->max_tokens = 256;
    o->max_question_tokens = 512;
    o->top_p = 1.0f;
    o->seed = 1;
}

static int session_opts(const kvzip_session_opts *in, kvzip_session_opts *o)
{
    if (in) *o = *in;
    else kvzip_session_defaults(o);
    if (o->budget < 0 || (o->budget > 0 && o->budget < 16) || o->budget > (1 << 20))
        return kvz_error_set(KVZIP_ERR_ARG, "budget %d: must be 0 (unbounded) or 16..%d", o->budget, 1 << 20);
    if (o->max_tokens < 1 || o->max_tokens > (1 << 20) || o->max_question_tokens < 1 ||
        o->max_question_tokens > (1 << 20))
        return kvz_error_set(KVZIP_ERR_ARG, "max_tokens %d / max_question_tokens %d out of range",
                             o->max_tokens, o->max_question_tokens);
    if (!(o->temperature >= 0.0f && o->temperature <= 100.0f) || !(o->top_p > 0.0f && o->top_p <= 1.0f))
        return kvz_error_set(KVZIP_ERR_ARG, "temperature %g / top_p %g out of range", o->temperature, o->top_p);
    o->system = NULL; /* used during open only; never kept */
    return 0;
}

/* Rows per head a session reserves beyond the document: without an output
 * buffer, question and answer rows go to the document region. */
static int64_t extra_rows(const kvzip_session_opts *o)
{
    return o->budget > 0 ? 0 : (int64_t)o->max_question_tokens + o->max_tokens;
}

static int session_new(kvzip_model *m, kvzip_store *s, const kvzip_session_opts *o, kvzip_session **out)
{
    kvzip_session *ss = calloc(1, sizeof *ss);
    if (!ss) return KVZIP_ERR_NOMEM;
    int rc = ref_check(&m->r, 1, "model");
    if (rc) {
        free(ss);
        return rc;
    }
    if (s && (rc = ref_check(&s->r, 1, "store"))) {
        kvz_api_model_unref(m);
        free(ss);
        return rc;
    }
    ss->model = m;
    ss->store = s;
    ss->o = *o;
    *out = ss;
    return 0;
}

int kvzip_session_open(kvzip_model *m, kvzip_store *s, const char *doc_id,
                       const kvzip_session_opts *opts, kvzip_session **out)
{
    NEED(out);
    *out = NULL;
    NEED(m);
    NEED(s);
    NEED(doc_id);
    kvzip_session_opts o;
    int rc = session_opts(opts, &o);
    kvzip_session *ss;
    if (rc || (rc = session_new(m, s, &o, &ss))) return rc;
    kvz_doc_meta dm;
    int hit = 0;
    const double t0 = kvz_now();
    kvz_api_dev_lock(m);
    /* the pipelined loader (ingest/kvz_load.h) through the model's document cache:
     * checkpointed at the document, rolled back and kept when the session closes */
    rc = kvz_doc_cache_get(m->dc, s->s, doc_id, extra_rows(&o), o.budget, &ss->kv, &dm, &hit);
    if (!rc) ss->borrowed = 1;
    kvz_api_dev_unlock(m);
    if (rc) {
        kvzip_session_close(ss);
        return rc;
    }
    const kvz_config *c = kvz_model_config(m->m);
    ss->info.doc_tokens = dm.n_prefix + dm.n_ctx;
    ss->info.prefix_tokens = dm.n_prefix;
    ss->info.from_store = 1;
    ss->info.ratio = dm.ratio;
    ss->info.rows_kept = dm.rows;
    ss->info.rows_full = (uint64_t)ss->info.doc_tokens * (uint64_t)c->n_layer * (uint64_t)c->n_kv_head;
    ss->info.load_s = hit ? kvz_now() - t0 : dm.load_s;
    *out = ss;
    return 0;
}

/* kvzip_session_open_text / _chat: the chat prefix, then @p text (len 0: nothing),
 * prefilled into a full cache; arguments checked by the callers */
static int open_prefilled(kvzip_model *m, const char *text, size_t len, const kvzip_session_opts *opts,
                          const kvzip_session_opts *oin, kvzip_session **out)
{
    kvzip_session_opts o = *oin;
    int rc = 0;
    const kvz_tokenizer *tok = kvz_model_tokenizer(m->m);
    kvz_tokens prompt = {0};
    int32_t n_prefix = 0;
    if (!(rc = kvz_chat_prefix_sys(tok, opts ? opts->system : NULL, &prompt))) {
        n_prefix = (int32_t)prompt.n;
        if (len) rc = kvz_tokenizer_encode(tok, text, len, 0, &prompt);
    }
    if (!rc && prompt.n > (size_t)1 << 30) rc = kvz_error_set(KVZIP_ERR_CONTEXT, "document too long");
    kvzip_session *ss = NULL;
    if (!rc) rc = session_new(m, NULL, &o, &ss);
    if (rc) {
        kvz_tokens_free(&prompt);
        return rc;
    }
    const int32_t n_doc = (int32_t)prompt.n;
    kvz_api_dev_lock(m);
    rc = kvz_kv_create(m->m, n_doc + extra_rows(&o), o.budget, &ss->kv);
    const double t0 = kvz_now();
    /* the document always goes to the document region, in bounded passes */
    for (int32_t s0 = 0; s0 < n_doc && !rc; s0 += PREFILL_STEP) {
        const int32_t nb = n_doc - s0 < PREFILL_STEP ? n_doc - s0 : PREFILL_STEP;
        rc = kvz_forward(m->m, ss->kv, prompt.ids + s0, nb, s0, NULL, KVZ_FWD_NO_LOGITS | KVZ_FWD_TO_DOC, NULL);
    }
    if (!rc) kvz_kv_checkpoint(ss->kv);
    kvz_api_dev_unlock(m);
    kvz_tokens_free(&prompt);
    if (rc) {
        kvzip_session_close(ss);
        return rc;
    }
    const kvz_config *c = kvz_model_config(m->m);
    ss->info.doc_tokens = n_doc;
    ss->info.prefix_tokens = n_prefix;
    ss->info.ratio = 1.0f;
    ss->info.rows_full = ss->info.rows_kept = (uint64_t)n_doc * (uint64_t)c->n_layer * (uint64_t)c->n_kv_head;
    ss->info.load_s = kvz_now() - t0;
    *out = ss;
    return 0;
}

int kvzip_session_open_text(kvzip_model *m, const char *text, size_t len,
                            const kvzip_session_opts *opts, kvzip_session **out)
{
    NEED(out);
    *out = NULL;
    NEED(m);
    NEED(text);
    kvzip_session_opts o;
    int rc = session_opts(opts, &o);
    if (rc || (rc = ref_check(&m->r, 0, "model")) || (rc = check_text(text, len, "document"))) return rc;
    return open_prefilled(m, text, len, opts, &o, out);
}

int kvzip_session_open_chat(kvzip_model *m, const kvzip_session_opts *opts, kvzip_session **out)
{
    NEED(out);
    *out = NULL;
    NEED(m);
    kvzip_session_opts o;
    int rc = session_opts(opts, &o);
    if (rc || (rc = ref_check(&m->r, 0, "model"))) return rc;
    return open_prefilled(m, "", 0, opts, &o, out);
}

int kvzip_session_close(kvzip_session *ss)
{
    if (!ss) return 0;
    if (atomic_load(&ss->in_batch))
        return kvz_error_set(KVZIP_ERR_BUSY, "the session is answering in a batch: close it after its done callback");
    if (ss->kv) {
        kvz_api_dev_lock(ss->model);
        if (!ss->borrowed || kvz_doc_cache_put(ss->model->dc, ss->kv)) kvz_kv_free(ss->kv);
        kvz_api_dev_unlock(ss->model);
    }
    kvz_api_model_unref(ss->model);
    store_unref(ss->store);
    free(ss);
    return 0;
}

int kvzip_session_info_get(const kvzip_session *ss, kvzip_session_info *out)
{
    NEED(ss);
    NEED(out);
    *out = ss->info;
    return 0;
}

typedef struct ask_ctx {
    const kvz_tokenizer *tok;
    kvzip_token_fn cb;
    void *user;
    char *text;           /* the answer so far, or NULL when not asked for */
    size_t len, cap;
    int want_text, canceled;
} ask_ctx;

int kvz_api_question(const kvzip_session *ss, const char *question, kvz_tokens *q)
{
    if (!question[0]) return kvz_error_set(KVZIP_ERR_EMPTY, "the question is empty");
    int rc = kvz_chat_question(kvz_model_tokenizer(ss->model->m), question, q);
    const int32_t nq = (int32_t)q->n, B = ss->o.budget;
    if (!rc && B > 0 && nq > B - QUESTION_SLACK)
        rc = kvz_error_set(KVZIP_ERR_CONTEXT, "the question is %d tokens; an output cache of %d slots "
                           "holds at most %d", nq, B, B - QUESTION_SLACK);
    if (!rc && B == 0 && nq > ss->o.max_question_tokens)
        rc = kvz_error_set(KVZIP_ERR_CONTEXT, "the question is %d tokens; the session reserved %d "
                           "(max_question_tokens)", nq, ss->o.max_question_tokens);
    if (rc) kvz_tokens_free(q);
    return rc;
}

int kvz_api_piece(const kvz_tokenizer *tok, int32_t id, char piece[256])
{
    int n = kvz_tokenizer_decode(tok, id, piece, 256);
    return n > 256 ? 256 : n;
}

static int on_token(void *ctx, int32_t id)
{
    ask_ctx *a = ctx;
    char piece[256];
    int n = kvz_api_piece(a->tok, id, piece);
    if (n < 0) return n;
    if (a->want_text) {
        if (a->len + (size_t)n + 1 > a->cap) {
            const size_t nc = (a->cap ? a->cap * 2 : 1024) + (size_t)n;
            char *p = realloc(a->text, nc);
            if (!p) return KVZIP_ERR_NOMEM;
            a->text = p;
            a->cap = nc;
        }
        memcpy(a->text + a->len, piece, (size_t)n);
        a->len += (size_t)n;
        a->text[a->len] = 0;
    }
    if (a->cb && a->cb(a->user, piece, (size_t)n, id)) {
        a->canceled = 1;
        return KVZIP_ERR_CANCELED;
    }
    return 0;
}

int kvzip_ask(kvzip_session *ss, const char *question, kvzip_token_fn cb, void *user,
              char **answer, kvzip_answer_stats *st)
{
    if (answer) *answer = NULL;
    if (st) memset(st, 0, sizeof *st);
    NEED(ss);
    NEED(question);
    if (atomic_load(&ss->in_batch))
        return kvz_error_set(KVZIP_ERR_BUSY, "the session is answering in a batch (kvzip_batch_submit)");
    kvzip_model *m = ss->model;
    const kvz_tokenizer *tok = kvz_model_tokenizer(m->m);
    kvz_tokens q = {0};
    int rc = kvz_api_question(ss, question, &q);
    if (rc) return rc;
    const int32_t nq = (int32_t)q.n;
    ask_ctx a = {.tok = tok, .cb = cb, .user = user, .want_text = answer != NULL};
    kvz_gen_opts go = {.max_tokens = ss->o.max_tokens, .on_token = on_token, .ctx = &a, .stop_on_eos = 1};
    kvz_sampler_init(&go.sampler, ss->o.temperature, ss->o.top_p, ss->o.seed);
    kvz_gen_stats gs;
    kvz_api_dev_lock(m);
    rc = kvz_generate(m->m, ss->kv, q.ids, nq, ss->info.doc_tokens, &go, NULL, NULL, &gs);
    kvz_kv_stats ks;
    kvz_kv_get_stats(ss->kv, &ks);
    kvz_kv_rollback(ss->kv); /* back to the document for the next question */
    kvz_api_dev_unlock(m);
    kvz_tokens_free(&q);
    if (st) {
        st->prompt_tokens = gs.n_prompt;
        st->answer_tokens = gs.n_gen;
        st->stopped = gs.stopped;
        st->ttft_s = gs.prefill_s;
        st->decode_s = gs.decode_s;
        st->decode_tok_s = gs.decode_s > 0 && gs.n_gen > 1 ? (gs.n_gen - 1) / gs.decode_s : 0.0;
        st->kv_bytes_held = ks.bytes_held;
        st->kv_doc_rows = ks.doc_rows;
        st->out_used = ks.out_used;
        st->out_slots = ks.out_slots;
        st->evictions = ks.evictions;
    }
    if (answer && (!rc || a.canceled)) {
        if (!a.text) a.text = calloc(1, 1);
        if (!a.text) rc = KVZIP_ERR_NOMEM;
        *answer = a.text;
    } else {
        free(a.text);
    }
    if (rc == KVZIP_ERR_CANCELED) kvz_error_set(rc, "the token callback stopped the answer");
    return rc;
}

/* ------------------------------------------------------------------------- */
/* Multi-document sessions                                                     */

void kvzip_docs_defaults(kvzip_docs_opts *o)
{
    memset(o, 0, sizeof *o);
    o->placement = KVZIP_PLACE_AUTO;
}

int kvzip_session_open_docs(kvzip_model *m, kvzip_store *s, const char *const *doc_ids, int32_t n,
                            const kvzip_session_opts *opts, const kvzip_docs_opts *dopts,
                            kvzip_session **out)
{
    NEED(out);
    *out = NULL;
    NEED(m);
    NEED(s);
    NEED(doc_ids);
    if (n < 1) return kvz_error_set(KVZIP_ERR_ARG, "no document given");
    for (int32_t i = 0; i < n; i++) NEED(doc_ids[i]);
    kvzip_docs_opts d;
    if (dopts) d = *dopts;
    else kvzip_docs_defaults(&d);
    if (d.placement < KVZIP_PLACE_AUTO || d.placement > KVZIP_PLACE_PARALLEL)
        return kvz_error_set(KVZIP_ERR_ARG, "placement %d unknown", d.placement);
    if (!(d.key_scale >= 0.0f && d.key_scale <= 100.0f))
        return kvz_error_set(KVZIP_ERR_ARG, "key_scale %g out of range", d.key_scale);
    kvzip_session_opts o;
    int rc = session_opts(opts, &o);
    kvzip_session *ss;
    if (rc || (rc = session_new(m, s, &o, &ss))) return rc;
    kvz_compose_opts co;
    kvz_compose_defaults(&co);
    co.placement = d.placement; /* KVZIP_PLACE_* == KVZ_PLACE_* */
    co.key_scale = d.key_scale;
    co.reserve = o.max_question_tokens + o.max_tokens;
    kvz_compose_meta cm;
    kvz_api_dev_lock(m);
    rc = kvz_docs_load(m->m, s->s, doc_ids, n, &co, extra_rows(&o), o.budget, &ss->kv, &cm, NULL);
    if (!rc) kvz_kv_checkpoint(ss->kv);
    kvz_api_dev_unlock(m);
    if (rc) {
        kvzip_session_close(ss);
        return rc;
    }
    ss->info.doc_tokens = cm.q_pos;
    ss->info.prefix_tokens = cm.n_prefix;
    ss->info.from_store = 1;
    ss->info.ratio = cm.ratio_min;
    ss->info.rows_kept = cm.rows;
    ss->info.rows_full = cm.rows_full;
    ss->info.load_s = cm.load_s;
    ss->docs.n_docs = cm.n_docs;
    ss->docs.placement = cm.placement;
    ss->docs.span = cm.span_seq;
    ss->docs.max_doc_tokens = cm.max_ctx;
    *out = ss;
    return 0;
}

int kvzip_session_docs_info(const kvzip_session *ss, kvzip_docs_info *out)
{
    NEED(ss);
    NEED(out);
    if (ss->docs.n_docs) {
        *out = ss->docs;
    } else {
        memset(out, 0, sizeof *out);
        out->n_docs = 1;
        out->span = ss->info.doc_tokens;
        out->max_doc_tokens = ss->info.doc_tokens - ss->info.prefix_tokens;
    }
    return 0;
}
