/* Per-process cache of loaded documents (kvz_doc_cache.h): byte budget, LRU. */
#include "kvz_doc_cache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"

typedef struct entry {
    char *doc_id;
    uint8_t hash[16];
    int64_t extra_rows;
    int32_t out_slots;
    kvz_kv *kv;
    kvz_doc_meta meta;
    uint64_t bytes;
    uint64_t last_use;
    int borrowed;
    struct entry *next;
} entry;

struct kvz_doc_cache {
    kvz_model *m;
    uint64_t budget;
    kvz_load_opts lo;
    pthread_mutex_t mu;       /* the list and the counters */
    pthread_mutex_t load_mu;  /* one load at a time */
    entry *head;
    uint64_t tick;
    kvz_doc_cache_stats st;
};

int kvz_doc_cache_create(kvz_model *m, uint64_t budget_bytes, const kvz_load_opts *lo, kvz_doc_cache **out)
{
    *out = NULL;
    kvz_doc_cache *c = calloc(1, sizeof *c);
    if (!c) return kvz_error_set(KVZ_ERR_NOMEM, "document cache");
    c->m = m;
    c->budget = budget_bytes;
    if (lo) c->lo = *lo;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->load_mu, NULL);
    *out = c;
    return 0;
}

static void entry_free(entry *e)
{
    kvz_kv_free(e->kv);
    free(e->doc_id);
    free(e);
}

/* unlink and free e (c->mu held) */
static void drop(kvz_doc_cache *c, entry *e)
{
    for (entry **p = &c->head; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            break;
        }
    c->st.bytes -= e->bytes;
    c->st.entries--;
    entry_free(e);
}

/* evict least-recently-used unborrowed entries until the budget holds (c->mu held) */
static void shrink(kvz_doc_cache *c)
{
    while (c->st.bytes > c->budget) {
        entry *lru = NULL;
        for (entry *e = c->head; e; e = e->next)
            if (!e->borrowed && (!lru || e->last_use < lru->last_use)) lru = e;
        if (!lru) break;
        drop(c, lru);
        c->st.evictions++;
    }
}

void kvz_doc_cache_free(kvz_doc_cache *c)
{
    if (!c) return;
    while (c->head) {
        entry *e = c->head;
        c->head = e->next;
        entry_free(e);
    }
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->load_mu);
    free(c);
}

int kvz_doc_cache_get(kvz_doc_cache *c, kvz_store *st, const char *doc_id, int64_t extra_rows,
                      int32_t out_slots, kvz_kv **kv, kvz_doc_meta *meta, int *hit)
{
    *kv = NULL;
    if (hit) *hit = 0;
    kvz_store_doc_info info;
    int rc = kvz_store_lookup(st, doc_id, &info);
    if (rc == KVZ_ERR_NOTFOUND) return kvz_error_set(rc, "no document '%s' in the store", doc_id);
    if (rc) return rc;
    pthread_mutex_lock(&c->mu);
    for (entry *e = c->head, *nx; e; e = nx) {
        nx = e->next;
        if (strcmp(e->doc_id, doc_id)) continue;
        if (memcmp(e->hash, info.hash, 16)) { /* stale: the id points elsewhere now */
            if (!e->borrowed) drop(c, e);
            continue;
        }
        if (e->borrowed || e->extra_rows != extra_rows || e->out_slots != out_slots) continue;
        e->borrowed = 1;
        e->last_use = ++c->tick;
        c->st.hits++;
        *kv = e->kv;
        *meta = e->meta;
        pthread_mutex_unlock(&c->mu);
        if (hit) *hit = 1;
        return 0;
    }
    c->st.misses++;
    pthread_mutex_unlock(&c->mu);

    entry *e = calloc(1, sizeof *e);
    if (!e || !(e->doc_id = strdup(doc_id))) {
        free(e);
        return kvz_error_set(KVZ_ERR_NOMEM, "document cache entry");
    }
    pthread_mutex_lock(&c->load_mu);
    rc = kvz_load_doc(c->m, st, doc_id, extra_rows, out_slots, &c->lo, &e->kv, &e->meta);
    pthread_mutex_unlock(&c->load_mu);
    if (rc) {
        free(e->doc_id);
        free(e);
        return rc;
    }
    kvz_kv_checkpoint(e->kv);
    kvz_kv_stats ks;
    kvz_kv_get_stats(e->kv, &ks);
    memcpy(e->hash, e->meta.info.hash, 16);
    e->extra_rows = extra_rows;
    e->out_slots = out_slots;
    e->bytes = ks.bytes_alloc;
    e->borrowed = 1;
    pthread_mutex_lock(&c->mu);
    e->last_use = ++c->tick;
    e->next = c->head;
    c->head = e;
    c->st.bytes += e->bytes;
    c->st.entries++;
    shrink(c); /* make room among the unborrowed ones now */
    pthread_mutex_unlock(&c->mu);
    *kv = e->kv;
    *meta = e->meta;
    return 0;
}

int kvz_doc_cache_put(kvz_doc_cache *c, kvz_kv *kv)
{
    pthread_mutex_lock(&c->mu);
    entry *e = c->head;
    while (e && e->kv != kv) e = e->next;
    if (!e || !e->borrowed) {
        pthread_mutex_unlock(&c->mu);
        return kvz_error_set(KVZ_ERR_ARG, "document cache: this KV cache was not lent by it");
    }
    kvz_kv_rollback(kv);
    e->borrowed = 0;
    e->last_use = ++c->tick;
    shrink(c);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

void kvz_doc_cache_clear(kvz_doc_cache *c)
{
    pthread_mutex_lock(&c->mu);
    for (entry *e = c->head, *nx; e; e = nx) {
        nx = e->next;
        if (!e->borrowed) drop(c, e);
    }
    pthread_mutex_unlock(&c->mu);
}

void kvz_doc_cache_get_stats(kvz_doc_cache *c, kvz_doc_cache_stats *st)
{
    pthread_mutex_lock(&c->mu);
    *st = c->st;
    pthread_mutex_unlock(&c->mu);
}
