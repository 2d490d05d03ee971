/* kvz_store.c — LMDB store of KVZB blobs (layout: docs/FORMAT.md §6). */
#include "kvz_store.h"

#include "kvz_blob.h"
#include "kvz_error.h"

#include <dirent.h>
#include <limits.h>
#include <errno.h>
#include <fcntl.h>
#include <lmdb.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

struct kvz_store {
    MDB_env *env;
    MDB_dbi blobs, refs, docs, meta;
    int readonly;
    int retired;         /* kvz_store_compact replaced the files under this handle */
    char *dir;           /* store directory as given to open */
    int have_open_fp;
    uint8_t open_fp[16]; /* fingerprint given to open (immutable) */
    uint64_t max_map;
    /* Held shared by every transaction of this process, exclusively while the
     * map is resized (mdb_env_set_mapsize needs no live transaction). */
    pthread_rwlock_t lock;
    /* shared system prefixes (docs/FORMAT.md §6.6): "prefixes" database, opened at
     * open when present, else created by the first kvz_store_put_doc_shared */
    MDB_dbi prefixes;
    volatile int have_prefixes;
    /* copy reads (kvz_store_copy_layer): the mapping of data.mdb, found in
     * /proc/self/maps; forgotten whenever the map is resized (under the exclusive lock) */
    pthread_mutex_t map_mu;
    int map_known;
    uintptr_t map_lo, map_hi;
    uint64_t map_off;
    /* kvz_store_pin: per PIN_CHUNK of the map, how far from its start it is pinned
     * (pin_end[c] = 0: not at all), the handles to unpin, under map_mu; all released
     * before the map may move (resize, under the exclusive lock) and at close */
    kvz_store_pinner pinner;
    uintptr_t pin_base;     /* the map's address when the pins were made */
    uintptr_t *pin_end;
    size_t n_pin_chunk;
    void **pin_h;
    uintptr_t *pin_lo;      /* where each pin starts (an upload must not cross one: the cuts) */
    size_t n_pin_h, cap_pin_h;
    uint64_t pinned;
};

struct kvz_store_read {
    kvz_store *s;
    MDB_txn *txn;
    int have_doc;                         /* the last read_doc: its blob's records must exist */
    uint8_t doc_hash[16];
    char doc_id[KVZ_STORE_DOC_ID_MAX + 1];
};

/* shared-prefix hooks of gc and verify (defined with the prefix API at the end) */
static int gc_prefixes(kvz_store *s, MDB_txn *txn, kvz_store_gc_result *r);
typedef struct vstate vstate;
static void verify_prefix_ref(kvz_store *s, MDB_txn *txn, vstate *v, const char *hx,
                              const kvz_blob_meta *m, const uint8_t *fp);
static void verify_prefix_blobs(kvz_store *s, MDB_txn *txn, vstate *v, const uint8_t *fp);

#define KEY_SIZE 20            /* hash[16] || u32 BE record index */
#define REFS_SIZE 16           /* u32 refcount, u32 n_records, u64 bytes */
#define INFO_FIXED 72          /* doc info bytes before the source path */
#define INFO_VERSION 1u
#define GROW_WAIT_S 60
#define MAP_FULL_INTERNAL 1    /* body -> runner: MDB_MAP_FULL, grow and retry */
#define NOOP_INTERNAL 2        /* body -> runner: nothing to write, abort */
#define RETIRED_KEY "retired"  /* meta key in the old files of a compacted store */

/* ========================================================================= */
/* Small helpers                                                               */

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static int lmdb_err(int rc, const char *what)
{
    int kvz;
    switch (rc) {
    case MDB_NOTFOUND: case ENOENT: kvz = KVZ_ERR_NOTFOUND; break;
    case MDB_MAP_FULL: case MDB_TXN_FULL: case ENOSPC: case EDQUOT: kvz = KVZ_ERR_FULL; break;
    case MDB_VERSION_MISMATCH: kvz = KVZ_ERR_VERSION; break;
    case MDB_INVALID: case MDB_CORRUPTED: case MDB_PAGE_NOTFOUND: case MDB_INCOMPATIBLE:
        kvz = KVZ_ERR_FORMAT; break;
    case EACCES: case EROFS: case EIO: case EPERM: kvz = KVZ_ERR_IO; break;
    case ENOMEM: kvz = KVZ_ERR_NOMEM; break;
    default: kvz = KVZ_ERR_LMDB; break;
    }
    return kvz_error_set(kvz, "kvz_store: %s: %s (lmdb rc %d)", what, mdb_strerror(rc), rc);
}

/* Map an LMDB return code inside a write body: MAP_FULL asks for growth. */
static int body_rc(int rc, const char *what)
{
    if (rc == MDB_MAP_FULL) return MAP_FULL_INTERNAL;
    return rc ? lmdb_err(rc, what) : 0;
}

static void hex16(const uint8_t *b, char out[33])
{
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) { out[2 * i] = hx[b[i] >> 4]; out[2 * i + 1] = hx[b[i] & 15]; }
    out[32] = 0;
}

static void make_key(uint8_t key[KEY_SIZE], const uint8_t hash[16], uint32_t index)
{
    memcpy(key, hash, 16);
    key[16] = (uint8_t)(index >> 24); /* big-endian: LMDB's byte order = numeric order */
    key[17] = (uint8_t)(index >> 16);
    key[18] = (uint8_t)(index >> 8);
    key[19] = (uint8_t)index;
}

static int check_doc_id(const char *doc_id, size_t *n)
{
    if (!doc_id) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: doc id is NULL");
    *n = strlen(doc_id);
    if (*n < 1 || *n > KVZ_STORE_DOC_ID_MAX)
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: doc id must be 1..%d bytes, got %zu",
                             KVZ_STORE_DOC_ID_MAX, *n);
    return 0;
}

/* ========================================================================= */
/* Damaged files: LMDB trusts its file                                         */
/*
 * A data.mdb cut short (SIGBUS on a page past the end) or a damaged B-tree page
 * (a child pointer into garbage: SIGSEGV inside liblmdb) would kill the process.
 * Every LMDB call that walks pages runs under guarded(): a SIGBUS/SIGSEGV while a
 * guard is active on this thread jumps back to it, and the call ends with a
 * "store damaged" error. A fault with no guard active goes to the handler that was
 * there before (the default: the process dies as before). The handlers are
 * installed once, on first use, with SA_NODEFER so the jump needs no mask restore.
 * What a guarded call leaves behind on a fault: its LMDB transaction is aborted by
 * the caller (the writer lock released, nothing committed); a cursor may leak.
 */
typedef struct fault_guard {
    sigjmp_buf jb;
    struct fault_guard *prev;
    volatile sig_atomic_t sig;
} fault_guard;

static __thread fault_guard *g_fault_top;
static struct sigaction g_old_bus, g_old_segv;
static pthread_once_t g_fault_once = PTHREAD_ONCE_INIT;

static void on_fault(int sig, siginfo_t *si, void *uc)
{
    (void)uc;
    fault_guard *g = g_fault_top;
    if (g && si && si->si_code > 0) { /* a real memory fault inside a guarded call */
        g->sig = sig;
        g_fault_top = g->prev;
        siglongjmp(g->jb, 1);
    }
    /* not ours: the previous disposition takes over (the access faults again) */
    sigaction(sig, sig == SIGBUS ? &g_old_bus : &g_old_segv, NULL);
    if (!si || si->si_code <= 0) raise(sig);
}

static __thread char g_assert_msg[200];

/* LMDB's own consistency checks (mdb_assert: a page of the wrong kind, a root
 * page number out of range, ...) call this before abort(): inside a guarded call
 * that is damage like a fault, so jump back the same way. */
static void on_lmdb_assert(MDB_env *env, const char *msg)
{
    (void)env;
    fault_guard *g = g_fault_top;
    if (!g) return; /* LMDB aborts, as without the callback */
    snprintf(g_assert_msg, sizeof g_assert_msg, "%s", msg ? msg : "?");
    g->sig = SIGABRT;
    g_fault_top = g->prev;
    siglongjmp(g->jb, 1);
}

static void fault_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_old_bus);
    sigaction(SIGSEGV, &sa, &g_old_segv);
}

#define FAULT_INTERNAL 3 /* guarded() -> caller: the call faulted (signal in *sig) */

/* Run fn(ctx) with a fault guard. Returns fn's value, or FAULT_INTERNAL with the
 * signal in *sig. Anything fn must hand back on a fault goes through ctx. */
static int guarded(int (*fn)(void *), void *ctx, int *sig)
{
    fault_guard g;
    pthread_once(&g_fault_once, fault_install);
    g.prev = g_fault_top;
    g.sig = 0;
    g_fault_top = &g;
    if (sigsetjmp(g.jb, 0)) {
        *sig = g.sig; /* the handler popped g */
        return FAULT_INTERNAL;
    }
    int rc = fn(ctx);
    g_fault_top = g.prev;
    return rc;
}

static const char *sig_name(int sig)
{
    return sig == SIGBUS ? "SIGBUS" : sig == SIGSEGV ? "SIGSEGV" : "LMDB assertion";
}

#define DAMAGED_HINT "restore a snapshot or run kvzip-store salvage: docs/ERRORS.md"

/* The error of a guarded call that faulted while doing @p what. */
static int fault_err(int sig, const char *what)
{
    if (sig == SIGABRT)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: store damaged: %s failed LMDB's check "
                             "'%s' (%s)", what, g_assert_msg, DAMAGED_HINT);
    return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: store damaged: %s hit an unreadable page of "
                         "data.mdb (%s) (%s)", what,
                         sig == SIGBUS ? "SIGBUS: the file is shorter than its B-tree says"
                                       : "SIGSEGV: a damaged B-tree page", DAMAGED_HINT);
}

__attribute__((format(printf, 1, 2)))
static int damaged(const char *fmt, ...)
{
    char msg[1400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: store damaged: %s (%s)", msg, DAMAGED_HINT);
}

/* Upper bound on the entries any walk of this environment can meet: no page holds
 * more than psize / 8 nodes. Loops over entries stop there (a damaged tree can
 * point back into itself). */
static uint64_t entry_bound(MDB_env *env)
{
    MDB_envinfo ei;
    MDB_stat es;
    mdb_env_info(env, &ei);
    mdb_env_stat(env, &es);
    return ((uint64_t)ei.me_last_pgno + 2) * (es.ms_psize / 8 + 1) + 64;
}

typedef struct { MDB_txn *txn; int rc; } commit_ctx;

static int commit_fn(void *vc)
{
    commit_ctx *c = vc;
    c->rc = mdb_txn_commit(c->txn); /* frees the txn whatever the outcome */
    return 0;
}

/* mdb_txn_commit under a fault guard (it reads the free list's pages). On a fault
 * the txn is aborted here. Returns 0 with LMDB's code in *rc, or an error. */
static int guarded_commit(MDB_txn *txn, int *rc, const char *what)
{
    commit_ctx c = {txn, 0};
    int sig = 0;
    *rc = 0;
    if (guarded(commit_fn, &c, &sig) == FAULT_INTERNAL) {
        mdb_txn_abort(txn);
        return fault_err(sig, what);
    }
    *rc = c.rc;
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Doc info <-> bytes (docs/FORMAT.md §6.3)                                    */

static size_t info_encode(const kvz_store_doc_info *in, uint8_t *b)
{
    size_t S = strnlen(in->source_path, KVZ_STORE_SOURCE_MAX - 1);
    memset(b, 0, INFO_FIXED);
    b[0] = (uint8_t)INFO_VERSION;
    b[1] = (uint8_t)(INFO_VERSION >> 8);
    b[2] = (uint8_t)S;
    b[3] = (uint8_t)(S >> 8);
    memcpy(b + 4, in->hash, 16);
    b[20] = in->mode;
    b[21] = (uint8_t)in->part; /* part number, u24 LE: bytes 21..23 were reserved 0 */
    b[22] = (uint8_t)(in->part >> 8);
    b[23] = (uint8_t)(in->part >> 16);
    memcpy(b + 24, &in->ratio, 4);
    put32(b + 28, in->n_records);
    put64(b + 32, in->n_tokens);
    put64(b + 40, in->bytes_stored);
    put64(b + 48, in->bytes_kv_full);
    put64(b + 56, in->bytes_kv_kept);
    put64(b + 64, (uint64_t)in->ingest_time);
    memcpy(b + INFO_FIXED, in->source_path, S);
    return INFO_FIXED + S;
}

static int info_decode(const MDB_val *v, kvz_store_doc_info *out)
{
    const uint8_t *b = v->mv_data;
    if (v->mv_size < INFO_FIXED)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: doc info of %zu bytes", v->mv_size);
    unsigned ver = b[0] | (unsigned)b[1] << 8;
    if (ver != INFO_VERSION)
        return kvz_error_set(KVZ_ERR_VERSION, "kvz_store: doc info version %u", ver);
    size_t S = b[2] | (size_t)b[3] << 8;
    if (S >= KVZ_STORE_SOURCE_MAX || v->mv_size != INFO_FIXED + S)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: doc info size mismatch");
    memset(out, 0, sizeof *out);
    memcpy(out->hash, b + 4, 16);
    out->mode = b[20];
    out->part = b[21] | (uint32_t)b[22] << 8 | (uint32_t)b[23] << 16;
    memcpy(&out->ratio, b + 24, 4);
    out->n_records = get32(b + 28);
    out->n_tokens = get64(b + 32);
    out->bytes_stored = get64(b + 40);
    out->bytes_kv_full = get64(b + 48);
    out->bytes_kv_kept = get64(b + 56);
    out->ingest_time = (int64_t)get64(b + 64);
    memcpy(out->source_path, b + INFO_FIXED, S);
    out->source_path[S] = 0;
    return 0;
}

/* ========================================================================= */
/* Map growth and the write-transaction runner                                 */

static int lock_exclusive(kvz_store *s)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += GROW_WAIT_S;
    int rc = pthread_rwlock_timedwrlock(&s->lock, &ts);
    if (rc == ETIMEDOUT)
        return kvz_error_set(KVZ_ERR_BUSY, "kvz_store: map resize waited %d s for read "
                             "transactions of this process to end", GROW_WAIT_S);
    if (rc) return kvz_error_set(KVZ_ERR_INTERNAL, "kvz_store: rwlock: %s", strerror(rc));
    return 0;
}

/* Undo every kvz_store_pin (the caller holds the exclusive lock, or closes). */
static void unpin_all(kvz_store *s)
{
    for (size_t i = 0; i < s->n_pin_h; i++) s->pinner.unpin(s->pin_h[i]);
    free(s->pin_h);
    free(s->pin_lo);
    free(s->pin_end);
    s->pin_h = NULL;
    s->pin_lo = NULL;
    s->pin_end = NULL;
    s->n_pin_h = s->cap_pin_h = s->n_pin_chunk = 0;
    s->pinned = 0;
}

/* Another process grew the map: adopt its size. */
static int adopt_mapsize(kvz_store *s)
{
    int err = lock_exclusive(s);
    if (err) return err;
    unpin_all(s); /* the map may move */
    int rc = mdb_env_set_mapsize(s->env, 0);
    s->map_known = 0; /* the map may have moved */
    pthread_rwlock_unlock(&s->lock);
    return rc ? lmdb_err(rc, "adopt new map size") : 0;
}

/* Grow the map to hold at least @p need more bytes (and at least double). */
static int grow_map(kvz_store *s, uint64_t need)
{
    int err = lock_exclusive(s);
    if (err) return err;
    MDB_envinfo ei;
    mdb_env_info(s->env, &ei);
    uint64_t cur = ei.me_mapsize;
    if (cur >= s->max_map) {
        pthread_rwlock_unlock(&s->lock);
        return kvz_error_set(KVZ_ERR_FULL, "kvz_store: map is full at its maximum of %llu bytes",
                             (unsigned long long)s->max_map);
    }
    uint64_t want = cur * 2 > cur + 2 * need ? cur * 2 : cur + 2 * need;
    want = (want + 4095) & ~4095ull;
    if (want > s->max_map) want = s->max_map;
    unpin_all(s); /* the map may move */
    int rc = mdb_env_set_mapsize(s->env, (size_t)want);
    s->map_known = 0; /* the map may have moved */
    pthread_rwlock_unlock(&s->lock);
    if (rc)
        return kvz_error_set(KVZ_ERR_FULL, "kvz_store: growing the map to %llu bytes failed: %s "
                             "(rc %d)", (unsigned long long)want, mdb_strerror(rc), rc);
    return 0;
}

typedef int (*write_body)(kvz_store *s, MDB_txn *txn, void *ctx);

/* A compaction swapped new files in under this environment (kvz_store_compact). */
static int check_retired(kvz_store *s, MDB_txn *txn)
{
    MDB_val k = {sizeof RETIRED_KEY - 1, RETIRED_KEY}, v;
    if (!s->retired && mdb_get(txn, s->meta, &k, &v) != 0) return 0;
    s->retired = 1;
    return kvz_error_set(KVZ_ERR_BUSY, "kvz_store: the store was replaced by a compacted copy "
                         "while this process had it open; reopen it");
}

/* A failed commit. LMDB reports a short page write as EIO (pwrite wrote less than asked
 * and set no errno), which is what a full disk or a file-size limit produce: look at
 * both and say which, so the user learns the store is full, not broken. The failed
 * transaction left the committed data untouched. */
static int commit_err(const kvz_store *s, int rc, uint64_t need)
{
    if (rc == EIO || rc == ENOSPC || rc == EFBIG || rc == EDQUOT) {
        char path[4096];
        snprintf(path, sizeof path, "%s/data.mdb", s->dir);
        struct statvfs vfs;
        struct stat st;
        struct rlimit lim;
        const uint64_t want = need > 0 ? need : 1;
        if (statvfs(s->dir, &vfs) == 0 && (uint64_t)vfs.f_bavail * vfs.f_frsize < want)
            return kvz_error_set(KVZ_ERR_FULL, "kvz_store: commit: no space left on the device holding %s "
                                 "(%llu bytes free, about %llu needed); the store is unchanged",
                                 s->dir, (unsigned long long)vfs.f_bavail * vfs.f_frsize,
                                 (unsigned long long)want);
        if (getrlimit(RLIMIT_FSIZE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY && stat(path, &st) == 0 &&
            (uint64_t)st.st_size + want > (uint64_t)lim.rlim_cur)
            return kvz_error_set(KVZ_ERR_FULL, "kvz_store: commit: %s would grow past this process's file-size "
                                 "limit (ulimit -f: %llu bytes); the store is unchanged",
                                 path, (unsigned long long)lim.rlim_cur);
    }
    return lmdb_err(rc, "commit");
}

typedef struct {
    kvz_store *s;
    MDB_txn *txn;
    write_body body;
    void *ctx;
} write_ctx;

static int write_fn(void *vc)
{
    write_ctx *w = vc;
    int err = check_retired(w->s, w->txn);
    return err ? err : w->body(w->s, w->txn, w->ctx);
}

/* Run @p body in one write transaction (under a fault guard: a damaged page ends
 * it with "store damaged", the transaction aborted and the writer lock released);
 * on MDB_MAP_FULL abort, grow, redo all. */
static int run_write(kvz_store *s, write_body body, void *ctx, uint64_t need)
{
    if (s->readonly) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: store opened read-only");
    for (int attempt = 0; attempt < 64; attempt++) {
        pthread_rwlock_rdlock(&s->lock);
        MDB_txn *txn;
        int rc = mdb_txn_begin(s->env, NULL, 0, &txn);
        if (rc == MDB_MAP_RESIZED) {
            pthread_rwlock_unlock(&s->lock);
            int err = adopt_mapsize(s);
            if (err) return err;
            continue;
        }
        if (rc) { pthread_rwlock_unlock(&s->lock); return lmdb_err(rc, "begin write txn"); }
        write_ctx wc = {s, txn, body, ctx};
        int sig = 0, err = guarded(write_fn, &wc, &sig);
        if (err == FAULT_INTERNAL) err = fault_err(sig, "a write transaction");
        if (err) {
            mdb_txn_abort(txn);
            pthread_rwlock_unlock(&s->lock);
            if (err == NOOP_INTERNAL) return 0;
            if (err != MAP_FULL_INTERNAL) return err;
            if ((err = grow_map(s, need))) return err;
            continue;
        }
        err = guarded_commit(txn, &rc, "committing a write transaction");
        pthread_rwlock_unlock(&s->lock);
        if (err) return err;
        if (rc == MDB_MAP_FULL) {
            if ((err = grow_map(s, need))) return err;
            continue;
        }
        return rc ? commit_err(s, rc, need) : 0;
    }
    return kvz_error_set(KVZ_ERR_FULL, "kvz_store: write still does not fit after 64 map growths");
}

/* ========================================================================= */
/* Open / close                                                                */

static const char *DB_NAMES[4] = {"blobs", "refs", "docs", "meta"};

typedef struct { kvz_store *s; MDB_txn *txn; int create; } open_ctx;

static int open_body(void *vc)
{
    open_ctx *oc = vc;
    kvz_store *s = oc->s;
    MDB_txn *txn = oc->txn;
    const int create = oc->create;
    int rc;
    MDB_dbi *dbis[4] = {&s->blobs, &s->refs, &s->docs, &s->meta};
    int err = 0;
    for (int i = 0; i < 4 && !err; i++) {
        rc = mdb_dbi_open(txn, DB_NAMES[i], s->readonly ? 0 : MDB_CREATE, dbis[i]);
        if (rc == MDB_NOTFOUND || rc == MDB_INCOMPATIBLE)
            err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: not a kvzip store (no '%s' database)",
                                DB_NAMES[i]);
        else if (rc)
            err = lmdb_err(rc, "open database");
    }
    if (!err) { /* optional: present once a shared prefix was stored */
        rc = mdb_dbi_open(txn, "prefixes", 0, &s->prefixes);
        s->have_prefixes = rc == 0;
        if (rc && rc != MDB_NOTFOUND) err = lmdb_err(rc, "open database");
    }
    MDB_val k = {14, "format_version"}, v;
    if (!err) {
        rc = mdb_get(txn, s->meta, &k, &v);
        if (rc == MDB_NOTFOUND && create && !s->readonly) {
            uint8_t ver[4];
            put32(ver, KVZ_STORE_VERSION);
            MDB_val vv = {4, ver};
            char by[64];
            snprintf(by, sizeof by, "kvzip store v%u (blob format v%u)", KVZ_STORE_VERSION,
                     KVZ_BLOB_VERSION);
            MDB_val kb = {10, "created_by"}, vb = {strlen(by), by};
            rc = mdb_put(txn, s->meta, &k, &vv, 0);
            if (!rc) rc = mdb_put(txn, s->meta, &kb, &vb, 0);
            if (rc) err = lmdb_err(rc, "initialise store");
        } else if (rc == MDB_NOTFOUND) {
            err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: not a kvzip store (no format_version)");
        } else if (rc) {
            err = lmdb_err(rc, "read format_version");
        } else if (v.mv_size != 4 || get32(v.mv_data) != KVZ_STORE_VERSION) {
            err = kvz_error_set(KVZ_ERR_VERSION, "kvz_store: store format version %u, this build "
                                "reads %u", v.mv_size == 4 ? get32(v.mv_data) : 0, KVZ_STORE_VERSION);
        }
    }
    if (!err && !s->readonly) err = check_retired(s, txn);
    if (!err && s->have_open_fp) {
        MDB_val kf = {8, "model_fp"}, vf;
        rc = mdb_get(txn, s->meta, &kf, &vf);
        if (rc == 0 && (vf.mv_size != 16 || memcmp(vf.mv_data, s->open_fp, 16))) {
            char a[33] = "?", b[33];
            if (vf.mv_size == 16) hex16(vf.mv_data, a);
            hex16(s->open_fp, b);
            err = kvz_error_set(KVZ_ERR_MODEL, "kvz_store: store holds blobs of model %s, opened "
                                "with model %s", a, b);
        } else if (rc && rc != MDB_NOTFOUND) {
            err = lmdb_err(rc, "read model_fp");
        }
    }
    return err;
}

static int open_init(kvz_store *s, int create)
{
    open_ctx oc = {s, NULL, create};
    int rc = mdb_txn_begin(s->env, NULL, s->readonly ? MDB_RDONLY : 0, &oc.txn);
    if (rc) return lmdb_err(rc, "begin open txn");
    int sig = 0, err = guarded(open_body, &oc, &sig);
    if (err == FAULT_INTERNAL) err = fault_err(sig, "opening the store");
    if (err) { mdb_txn_abort(oc.txn); return err; }
    if ((err = guarded_commit(oc.txn, &rc, "opening the store"))) return err;
    return rc ? lmdb_err(rc, "commit open txn") : 0;
}

/* LMDB's on-disk meta page (lmdb.h / mdb.c, 64-bit build): a 16-byte page header,
 * then MDB_meta: u32 magic 0xBEEFC0DE, u32 version (1), address, mapsize, two
 * 48-byte MDB_db (free, main; the free DB's md_pad holds the page size in meta page
 * 0), u64 last used page number, u64 txn id. Meta page 1 starts at page size. */
#define MDB_META_MAGIC 0xBEEFC0DEu
#define META_OFF_MAGIC 16
#define META_OFF_PSIZE (16 + 24)
#define META_OFF_LAST_PG (16 + 120)
#define META_OFF_TXNID (16 + 128)
#define META_BYTES (16 + 136)

/* Before LMDB sees the file: what it does not check. An empty data.mdb would be
 * taken for a new store (a writer silently starts over; a reader fails with EBADF);
 * one shorter than its two meta pages cannot be read. Files that are not LMDB at
 * all are left to mdb_env_open (MDB_INVALID). */
static int check_data_file(const char *dir)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0; /* mdb_env_open reports it */
    uint8_t m0[META_BYTES];
    ssize_t n0 = pread(fd, m0, sizeof m0, 0);
    struct stat st;
    int rc = fstat(fd, &st);
    close(fd);
    if (rc || !S_ISREG(st.st_mode)) return 0;
    if (st.st_size == 0)
        return damaged("%s is empty (0 bytes): the store's data is gone", path);
    if (n0 < (ssize_t)sizeof m0) {
        if (n0 >= 20 && get32(m0 + META_OFF_MAGIC) == MDB_META_MAGIC)
            return damaged("%s is %lld bytes, shorter than one LMDB meta page", path,
                           (long long)st.st_size);
        return 0;
    }
    if (get32(m0 + META_OFF_MAGIC) != MDB_META_MAGIC) return 0;
    const uint32_t psize = get32(m0 + META_OFF_PSIZE);
    if (psize < 512 || psize > 65536 || (psize & (psize - 1))) return 0; /* LMDB decides */
    if ((uint64_t)st.st_size < 2ull * psize)
        return damaged("%s is %lld bytes, shorter than its two %u-byte meta pages", path,
                       (long long)st.st_size, psize);
    return 0;
}

/* After mdb_env_open: the pages the meta page names must be in the file. LMDB
 * does not always write its last page (a page freed in the transaction that
 * allocated it stays unwritten), so pages past the end are fine when every one of
 * them is on the free list; any other is a page of the B-tree that was cut off. */
typedef struct {
    kvz_store *s;
    MDB_txn *txn;
    MDB_cursor *c; /* open while walking: closed by the caller after a fault */
    uint64_t have, need, free_missing;
} tail_ctx;

static int tail_walk(void *vc)
{
    tail_ctx *t = vc;
    MDB_cursor *c;
    int rc = mdb_cursor_open(t->txn, 0 /* FREE_DBI */, &c);
    if (rc) return lmdb_err(rc, "free list");
    t->c = c;
    MDB_val k, v;
    const uint64_t bound = entry_bound(t->s->env);
    uint64_t steps = 0;
    for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); rc == 0 && steps < bound;
         rc = mdb_cursor_get(c, &k, &v, MDB_NEXT), steps++) {
        if (v.mv_size < sizeof(size_t)) continue;
        const size_t *ids = v.mv_data;
        size_t n = ids[0];
        if (n > v.mv_size / sizeof(size_t) - 1) n = v.mv_size / sizeof(size_t) - 1;
        for (size_t i = 1; i <= n; i++)
            if (ids[i] >= t->have && ids[i] < t->need) t->free_missing++;
    }
    mdb_cursor_close(c);
    t->c = NULL;
    return rc == MDB_NOTFOUND || rc == 0 ? 0 : lmdb_err(rc, "free list");
}

static int check_tail(kvz_store *s)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/data.mdb", s->dir);
    MDB_envinfo ei;
    MDB_stat es;
    struct stat st;
    mdb_env_info(s->env, &ei);
    mdb_env_stat(s->env, &es);
    if (stat(path, &st) || !es.ms_psize) return 0;
    tail_ctx t = {s, NULL, NULL, (uint64_t)st.st_size / es.ms_psize, (uint64_t)ei.me_last_pgno + 1, 0};
    if (t.have >= t.need) return 0;
    int rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &t.txn);
    if (rc) return lmdb_err(rc, "begin read txn");
    int sig = 0, err = guarded(tail_walk, &t, &sig);
    if (t.c) mdb_cursor_close(t.c);
    mdb_txn_abort(t.txn);
    if (err == FAULT_INTERNAL || (!err && t.free_missing < t.need - t.have))
        return damaged("%s is %lld bytes, but its B-tree uses %llu pages of %u bytes (%llu "
                       "bytes): the file was cut short", path, (long long)st.st_size,
                       (unsigned long long)t.need, es.ms_psize,
                       (unsigned long long)t.need * es.ms_psize);
    return err;
}

int kvz_store_open(const char *dir, unsigned flags, uint64_t map_size, const uint8_t *fp,
                   kvz_store **out)
{
    if (!out) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL out");
    *out = NULL;
    int create = !!(flags & KVZ_STORE_CREATE), ro = !!(flags & KVZ_STORE_READONLY);
    const int salvage = !!(flags & KVZ_STORE_SALVAGE);
    if (!dir || (create && ro) || (flags & ~7u) || (salvage && !ro))
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: bad open arguments");
    size_t dl = strlen(dir);
    char *path = malloc(dl + 16);
    if (!path) return kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: open");
    snprintf(path, dl + 16, "%s/data.mdb", dir);
    struct stat st;
    int exists = stat(path, &st) == 0;
    free(path);
    if (!exists) {
        if (!create) return kvz_error_set(KVZ_ERR_NOTFOUND, "kvz_store: no store in %s", dir);
        if (mkdir(dir, 0755) && errno != EEXIST)
            return kvz_error_set(KVZ_ERR_IO, "kvz_store: mkdir %s: %s", dir, strerror(errno));
    } else {
        int derr = check_data_file(dir);
        if (derr) return derr;
    }
    kvz_store *s = calloc(1, sizeof *s);
    if (!s) return kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: open");
    s->readonly = ro;
    s->dir = strdup(dir);
    if (!s->dir) { free(s); return kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: open"); }
    s->max_map = KVZ_STORE_DEFAULT_MAX_MAP;
    if (fp) { s->have_open_fp = 1; memcpy(s->open_fp, fp, 16); }
    /* writer-preferring so map growth is not starved by a stream of readers; the
     * timed wrlock bounds the stall when a thread nests read transactions */
    pthread_rwlockattr_t ra;
    pthread_rwlockattr_init(&ra);
    pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&s->lock, &ra);
    pthread_rwlockattr_destroy(&ra);
    pthread_mutex_init(&s->map_mu, NULL);
    int err = 0, rc = mdb_env_create(&s->env);
    if (rc) { err = lmdb_err(rc, "mdb_env_create"); s->env = NULL; goto fail; }
    mdb_env_set_maxdbs(s->env, 8);
    mdb_env_set_assert(s->env, on_lmdb_assert);
    mdb_env_set_mapsize(s->env, (size_t)(map_size ? map_size : KVZ_STORE_DEFAULT_MAP));
    rc = mdb_env_open(s->env, dir, MDB_NOTLS | (ro ? MDB_RDONLY : 0), 0644);
    if (rc) {
        err = lmdb_err(rc, "mdb_env_open");
        char tmp[256];
        snprintf(tmp, sizeof tmp, "%s", kvz_error_detail());
        kvz_error_set(err, "%s [%s]", tmp, dir);
        goto fail;
    }
    int dead = 0;
    mdb_reader_check(s->env, &dead); /* clear reader slots of killed processes */
    if (exists && !salvage && (err = check_tail(s))) goto fail;
    if ((err = open_init(s, create))) goto fail;
    *out = s;
    return 0;
fail:
    if (s->env) mdb_env_close(s->env);
    pthread_rwlock_destroy(&s->lock);
    pthread_mutex_destroy(&s->map_mu);
    free(s->dir);
    free(s);
    return err;
}

void kvz_store_close(kvz_store *s)
{
    if (!s) return;
    unpin_all(s);
    mdb_env_close(s->env);
    pthread_rwlock_destroy(&s->lock);
    pthread_mutex_destroy(&s->map_mu);
    free(s->dir);
    free(s);
}

void kvz_store_set_max_map(kvz_store *s, uint64_t max_bytes)
{
    if (s) s->max_map = max_bytes;
}

/* ========================================================================= */
/* Scale-out primitives: user metadata, snapshot (kvz_store.h "Scale-out")     */

static int meta_key_ok(const char *key, size_t *n)
{
    static const char *const reserved[] = {"format_version", "created_by", "model_fp", RETIRED_KEY};
    if (!key || !(*n = strlen(key)) || *n > 64)
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: metadata key must be 1..64 bytes");
    for (size_t i = 0; i < sizeof reserved / sizeof *reserved; i++)
        if (!strcmp(key, reserved[i]))
            return kvz_error_set(KVZ_ERR_ARG, "kvz_store: metadata key '%s' is reserved", key);
    return 0;
}

typedef struct { const char *key; size_t klen; const void *val; size_t vlen; } meta_ctx;

static int meta_body(kvz_store *s, MDB_txn *txn, void *vctx)
{
    meta_ctx *c = vctx;
    MDB_val k = {c->klen, (void *)c->key}, v = {c->vlen, (void *)c->val}, old;
    int rc = mdb_get(txn, s->meta, &k, &old);
    if (rc == 0 && old.mv_size == c->vlen && !memcmp(old.mv_data, c->val, c->vlen)) return NOOP_INTERNAL;
    if (rc && rc != MDB_NOTFOUND) return body_rc(rc, "read meta");
    return body_rc(mdb_put(txn, s->meta, &k, &v, 0), "write meta");
}

int kvz_store_meta_set(kvz_store *s, const char *key, const void *val, size_t len)
{
    size_t kl = 0;
    int err;
    if (!s || (!val && len)) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    if ((err = meta_key_ok(key, &kl))) return err;
    if (len > 4096) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: metadata value over 4096 bytes");
    meta_ctx c = {key, kl, val ? val : "", len};
    return run_write(s, meta_body, &c, 1 << 16);
}

int kvz_store_meta_get(kvz_store *s, const char *key, void *buf, size_t cap, size_t *len)
{
    size_t kl = 0;
    int err;
    if (len) *len = 0;
    if (!s || !len || (!buf && cap)) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    if ((err = meta_key_ok(key, &kl))) return err;
    kvz_store_read *r;
    if ((err = kvz_store_read_begin(s, &r))) return err;
    MDB_val k = {kl, (void *)key}, v;
    int rc = mdb_get(r->txn, s->meta, &k, &v);
    if (rc == MDB_NOTFOUND) err = kvz_error_set(KVZ_ERR_NOTFOUND, "kvz_store: no metadata '%s'", key);
    else if (rc) err = lmdb_err(rc, "read meta");
    else {
        *len = v.mv_size;
        memcpy(buf, v.mv_data, v.mv_size < cap ? v.mv_size : cap);
    }
    kvz_store_read_end(r);
    return err;
}

static int check_copy(const char *dir);
static int fsync_path(const char *p);
static int pathf(char *out, size_t cap, const char *fmt, ...);
static void rm_store_dir(const char *d);

int kvz_store_snapshot(kvz_store *s, const char *dir)
{
    if (!s || !dir || !*dir) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    char d[4096], tmp[4200], parent[4096];
    if (pathf(d, sizeof d, "%s", dir)) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: path too long");
    size_t dl = strlen(d);
    while (dl > 1 && d[dl - 1] == '/') d[--dl] = 0;
    /* the destination: missing, or an empty folder (replaced atomically by rename) */
    struct stat st;
    if (stat(d, &st) == 0) {
        if (!S_ISDIR(st.st_mode))
            return kvz_error_set(KVZ_ERR_ARG, "kvz_store: snapshot target %s exists and is not a folder", d);
        DIR *dd = opendir(d);
        if (!dd) return kvz_error_set(KVZ_ERR_IO, "kvz_store: %s: %s", d, strerror(errno));
        struct dirent *e;
        int empty = 1;
        while ((e = readdir(dd)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) { empty = 0; break; }
        closedir(dd);
        if (!empty)
            return kvz_error_set(KVZ_ERR_ARG, "kvz_store: snapshot target %s exists and is not empty "
                                 "(give a new folder)", d);
    } else if (errno != ENOENT) {
        return kvz_error_set(KVZ_ERR_IO, "kvz_store: %s: %s", d, strerror(errno));
    }
    char real_src[PATH_MAX], real_parent[PATH_MAX];
    const char *slash = strrchr(d, '/');
    if (!slash) snprintf(parent, sizeof parent, ".");
    else if (slash == d) snprintf(parent, sizeof parent, "/");
    else snprintf(parent, sizeof parent, "%.*s", (int)(slash - d), d);
    if (!realpath(parent, real_parent))
        return kvz_error_set(KVZ_ERR_IO, "kvz_store: snapshot folder's parent %s: %s", parent, strerror(errno));
    if (realpath(s->dir, real_src) && stat(d, &st) == 0) {
        char real_dst[PATH_MAX];
        if (realpath(d, real_dst) && !strcmp(real_dst, real_src))
            return kvz_error_set(KVZ_ERR_ARG, "kvz_store: snapshot target is the store itself");
    }
    if (pathf(tmp, sizeof tmp, "%s/.%s.snapshot.%ld", real_parent, slash ? slash + 1 : d, (long)getpid()))
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: path too long");
    rm_store_dir(tmp); /* a leftover of this pid: only our two files */
    if (mkdir(tmp, 0755))
        return kvz_error_set(KVZ_ERR_IO, "kvz_store: mkdir %s: %s", tmp, strerror(errno));
    /* a read transaction's snapshot, compacted; writers of any process go on meanwhile */
    int err = 0, rc;
    pthread_rwlock_rdlock(&s->lock);
    rc = mdb_env_copy2(s->env, tmp, MDB_CP_COMPACT);
    pthread_rwlock_unlock(&s->lock);
    char p[4300];
    pathf(p, sizeof p, "%s/data.mdb", tmp);
    if (rc) err = lmdb_err(rc, "snapshot copy");
    else if (fsync_path(p) || fsync_path(tmp))
        err = kvz_error_set(errno == ENOSPC ? KVZ_ERR_FULL : KVZ_ERR_IO, "kvz_store: fsync %s: %s", p,
                            strerror(errno));
    else err = check_copy(tmp);
    /* rename(2) replaces an empty folder atomically; a non-empty one fails (ENOTEMPTY) */
    if (!err && rename(tmp, d))
        err = kvz_error_set(errno == ENOTEMPTY || errno == EEXIST ? KVZ_ERR_ARG : KVZ_ERR_IO,
                            "kvz_store: moving the snapshot to %s: %s", d, strerror(errno));
    if (err) { rm_store_dir(tmp); return err; }
    fsync_path(real_parent);
    return 0;
}

/* ========================================================================= */
/* Writes                                                                      */

/* Drop one reference to @p hash; delete its records at zero. */
static int unref(kvz_store *s, MDB_txn *txn, const uint8_t hash[16])
{
    MDB_val k = {16, (void *)hash}, v;
    int rc = mdb_get(txn, s->refs, &k, &v);
    if (rc == MDB_NOTFOUND) return 0; /* nothing to release */
    if (rc) return body_rc(rc, "read refs");
    if (v.mv_size != REFS_SIZE) return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: corrupt refs entry");
    uint8_t r[REFS_SIZE];
    memcpy(r, v.mv_data, REFS_SIZE);
    uint32_t n = get32(r);
    if (n > 1) {
        put32(r, n - 1);
        MDB_val nv = {REFS_SIZE, r};
        return body_rc(mdb_put(txn, s->refs, &k, &nv, 0), "write refs");
    }
    if ((rc = mdb_del(txn, s->refs, &k, NULL))) return body_rc(rc, "delete refs");
    MDB_cursor *c;
    if ((rc = mdb_cursor_open(txn, s->blobs, &c))) return body_rc(rc, "cursor");
    uint8_t key[KEY_SIZE];
    make_key(key, hash, 0);
    MDB_val ck = {KEY_SIZE, key}, cv;
    rc = mdb_cursor_get(c, &ck, &cv, MDB_SET_RANGE);
    const uint64_t bound = entry_bound(s->env);
    uint64_t steps = 0;
    while (rc == 0 && ck.mv_size == KEY_SIZE && !memcmp(ck.mv_data, hash, 16)) {
        if (++steps > bound) { mdb_cursor_close(c); return damaged("deleting a blob's records does not end"); }
        if ((rc = mdb_cursor_del(c, 0))) break;
        ck = (MDB_val){KEY_SIZE, key}; /* re-seek: no reliance on post-delete cursor state */
        rc = mdb_cursor_get(c, &ck, &cv, MDB_SET_RANGE);
    }
    mdb_cursor_close(c);
    return rc == MDB_NOTFOUND ? 0 : body_rc(rc, "delete records");
}

typedef struct {
    const char *doc_id;
    size_t id_len;
    const uint8_t *hash;
    const kvz_store_doc_info *info;
    const kvz_store_rec *meta, *layers;
    uint32_t n_layers;
    const uint8_t *meta_fp; /* fingerprint inside the META record (when meta given) */
    uint64_t bytes;
    int status;
} put_ctx;

static int put_body(kvz_store *s, MDB_txn *txn, void *vctx)
{
    put_ctx *c = vctx;
    int rc, err;
    /* 1. one model per store */
    MDB_val kf = {8, "model_fp"}, vf;
    rc = mdb_get(txn, s->meta, &kf, &vf);
    if (rc && rc != MDB_NOTFOUND) return body_rc(rc, "read model_fp");
    if (c->meta_fp) {
        const uint8_t *want = rc == 0 ? vf.mv_data : s->have_open_fp ? s->open_fp : NULL;
        if (rc == 0 && vf.mv_size != 16) return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: corrupt model_fp");
        if (want && memcmp(want, c->meta_fp, 16)) {
            char a[33], b[33];
            hex16(c->meta_fp, a);
            hex16(want, b);
            return kvz_error_set(KVZ_ERR_MODEL, "kvz_store: blob made by model %s, store holds "
                                 "model %s", a, b);
        }
        if (rc == MDB_NOTFOUND) {
            MDB_val nv = {16, (void *)c->meta_fp};
            if ((err = body_rc(mdb_put(txn, s->meta, &kf, &nv, 0), "write model_fp"))) return err;
        }
    }
    /* 2. where does the name point now? */
    MDB_val kd = {c->id_len, (void *)c->doc_id}, vd;
    kvz_store_doc_info old;
    int have_old = 0;
    rc = mdb_get(txn, s->docs, &kd, &vd);
    if (rc == 0) {
        if ((err = info_decode(&vd, &old))) return err;
        have_old = 1;
    } else if (rc != MDB_NOTFOUND) {
        return body_rc(rc, "read docs");
    }
    kvz_store_doc_info ni = *c->info;
    memcpy(ni.hash, c->hash, 16);
    if (!ni.ingest_time) ni.ingest_time = (int64_t)time(NULL);
    if (have_old && !memcmp(old.hash, c->hash, 16)) {
        if (!strncmp(old.source_path, ni.source_path, KVZ_STORE_SOURCE_MAX) && old.part == ni.part) {
            c->status = KVZ_STORE_UNCHANGED;
            return NOOP_INTERNAL;
        }
        ni.n_records = old.n_records;
        ni.bytes_stored = old.bytes_stored;
        c->status = KVZ_STORE_INFO_UPDATED;
    } else {
        /* 3. the records: reuse or write */
        MDB_val kr = {16, (void *)c->hash}, vr;
        rc = mdb_get(txn, s->refs, &kr, &vr);
        uint8_t r[REFS_SIZE];
        if (rc == 0) {
            if (vr.mv_size != REFS_SIZE) return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: corrupt refs entry");
            memcpy(r, vr.mv_data, REFS_SIZE);
            put32(r, get32(r) + 1);
            c->status = KVZ_STORE_LINKED;
        } else if (rc == MDB_NOTFOUND) {
            if (!c->meta) return kvz_error_set(KVZ_ERR_NOTFOUND, "kvz_store: hash not stored, "
                                               "nothing to link");
            for (uint32_t i = 0; i <= c->n_layers; i++) {
                uint8_t key[KEY_SIZE];
                const kvz_store_rec *rec = i == 0 ? c->meta : &c->layers[i - 1];
                make_key(key, c->hash, i == 0 ? KVZ_BLOB_META_LAYER : i - 1);
                MDB_val k = {KEY_SIZE, key}, v = {rec->len, (void *)rec->data};
                if ((err = body_rc(mdb_put(txn, s->blobs, &k, &v, 0), "write record"))) return err;
            }
            put32(r, 1);
            put32(r + 4, c->n_layers + 1);
            put64(r + 8, c->bytes);
            c->status = KVZ_STORE_WRITTEN;
        } else {
            return body_rc(rc, "read refs");
        }
        MDB_val nr = {REFS_SIZE, r};
        if ((err = body_rc(mdb_put(txn, s->refs, &kr, &nr, 0), "write refs"))) return err;
        ni.n_records = get32(r + 4);
        ni.bytes_stored = get64(r + 8);
    }
    /* 4. the name */
    uint8_t *ib = malloc(INFO_FIXED + KVZ_STORE_SOURCE_MAX);
    if (!ib) return kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: put");
    MDB_val nv = {info_encode(&ni, ib), ib};
    err = body_rc(mdb_put(txn, s->docs, &kd, &nv, 0), "write docs");
    free(ib);
    if (err) return err;
    /* 5. release what the name pointed at before */
    if (have_old && c->status != KVZ_STORE_INFO_UPDATED) return unref(s, txn, old.hash);
    return 0;
}

int kvz_store_put_doc(kvz_store *s, const char *doc_id, const uint8_t hash[16],
                      const kvz_store_doc_info *info, const kvz_store_rec *meta,
                      const kvz_store_rec *layers, uint32_t n_layers, int *status)
{
    if (status) *status = 0;
    size_t id_len = 0;
    int err;
    if (!s || !hash || !info) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    if ((err = check_doc_id(doc_id, &id_len))) return err;
    if (!memchr(info->source_path, 0, KVZ_STORE_SOURCE_MAX))
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: source path not NUL-terminated");
    if (info->part > KVZ_STORE_PART_MAX)
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: part number %u over %u", info->part,
                             KVZ_STORE_PART_MAX);
    put_ctx c = {doc_id, id_len, hash, info, meta, layers, n_layers, NULL, 0, 0};
    kvz_blob_meta m = {0};
    if (meta) {
        /* verify the whole blob before touching the store */
        if ((err = kvz_blob_decode_meta(meta->data, meta->len, NULL, &m))) return err;
        if (n_layers != m.n_layer || !layers) {
            err = kvz_error_set(KVZ_ERR_ARG, "kvz_store: %u layer records for a %u-layer blob",
                                n_layers, m.n_layer);
            goto out;
        }
        uint64_t id = kvz_blob_meta_id(&m);
        c.bytes = meta->len;
        for (uint32_t l = 0; l < n_layers; l++) {
            kvz_blob_info bi;
            if (!layers[l].data) { err = kvz_error_set(KVZ_ERR_ARG, "kvz_store: layer %u NULL", l); goto out; }
            if ((err = kvz_blob_check(layers[l].data, layers[l].len, &bi))) goto out;
            if (bi.kind != KVZ_BLOB_KIND_LAYER || bi.layer != l || bi.blob_id != id ||
                bi.raw_size != kvz_blob_layer_raw_size(&m, l)) {
                err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: record %u is not layer %u of this blob",
                                    l, l);
                goto out;
            }
            c.bytes += layers[l].len;
        }
        c.meta_fp = m.fingerprint;
    } else if (layers || n_layers) {
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: layer records without a META record");
    }
    err = run_write(s, put_body, &c, c.bytes + INFO_FIXED + KVZ_STORE_SOURCE_MAX + 64 * 1024);
    if (!err && status) *status = c.status;
out:
    kvz_blob_meta_free(&m);
    return err;
}

typedef struct { const char *doc_id; size_t id_len; } del_ctx;

static int del_body(kvz_store *s, MDB_txn *txn, void *vctx)
{
    del_ctx *c = vctx;
    MDB_val k = {c->id_len, (void *)c->doc_id}, v;
    int rc = mdb_get(txn, s->docs, &k, &v);
    if (rc == MDB_NOTFOUND) return kvz_error_set(KVZ_ERR_NOTFOUND, "kvz_store: no doc '%s'", c->doc_id);
    if (rc) return body_rc(rc, "read docs");
    kvz_store_doc_info old;
    int err = info_decode(&v, &old);
    if (err) return err;
    if ((rc = mdb_del(txn, s->docs, &k, NULL))) return body_rc(rc, "delete doc");
    return unref(s, txn, old.hash);
}

int kvz_store_delete_doc(kvz_store *s, const char *doc_id)
{
    size_t n = 0;
    int err;
    if (!s) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL store");
    if ((err = check_doc_id(doc_id, &n))) return err;
    del_ctx c = {doc_id, n};
    return run_write(s, del_body, &c, 1 << 20);
}

/* ========================================================================= */
/* Reads                                                                       */

int kvz_store_read_begin(kvz_store *s, kvz_store_read **out)
{
    if (!s || !out) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    *out = NULL;
    kvz_store_read *r = malloc(sizeof *r);
    if (!r) return kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: read_begin");
    r->have_doc = 0;
    for (int attempt = 0; attempt < 8; attempt++) {
        pthread_rwlock_rdlock(&s->lock);
        int rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &r->txn);
        if (rc == 0) {
            r->s = s;
            *out = r;
            return 0; /* the shared lock is held until read_end */
        }
        pthread_rwlock_unlock(&s->lock);
        int err = rc == MDB_MAP_RESIZED ? adopt_mapsize(s) : lmdb_err(rc, "begin read txn");
        if (err) { free(r); return err; }
    }
    free(r);
    return kvz_error_set(KVZ_ERR_BUSY, "kvz_store: map keeps being resized");
}

void kvz_store_read_end(kvz_store_read *r)
{
    if (!r) return;
    mdb_txn_abort(r->txn);
    pthread_rwlock_unlock(&r->s->lock);
    free(r);
}

/* Doc ids in messages: at most 200 bytes of them (the CLIs escape what they print). */
#define ID_FMT "%.200s"

typedef struct {
    kvz_store_read *r;
    MDB_val k;
    int rc;
    kvz_store_doc_info *info;
    int err;
} getdoc_ctx;

static int getdoc_fn(void *vc)
{
    getdoc_ctx *g = vc;
    MDB_val v;
    g->rc = mdb_get(g->r->txn, g->r->s->docs, &g->k, &v);
    if (g->rc == 0) g->err = info_decode(&v, g->info);
    return 0;
}

int kvz_store_read_doc(kvz_store_read *r, const char *doc_id, kvz_store_doc_info *info)
{
    size_t n = 0;
    int err;
    if (!r || !info) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    if ((err = check_doc_id(doc_id, &n))) return err;
    r->have_doc = 0;
    getdoc_ctx g = {r, {n, (void *)doc_id}, 0, info, 0};
    int sig = 0;
    if (guarded(getdoc_fn, &g, &sig) == FAULT_INTERNAL) {
        char what[300];
        snprintf(what, sizeof what, "reading document '" ID_FMT "'", doc_id);
        return fault_err(sig, what);
    }
    if (g.rc == MDB_NOTFOUND) return kvz_error_set(KVZ_ERR_NOTFOUND, "kvz_store: no doc '%s'", doc_id);
    if (g.rc) return lmdb_err(g.rc, "read docs");
    if (g.err) return g.err;
    r->have_doc = 1;
    memcpy(r->doc_hash, info->hash, 16);
    snprintf(r->doc_id, sizeof r->doc_id, "%s", doc_id);
    return 0;
}

typedef struct {
    kvz_store_read *r;
    uint8_t key[KEY_SIZE];
    MDB_val v;
    int rc, err;
    kvz_blob_info bi;
} getrec_ctx;

static int getrec_fn(void *vc)
{
    getrec_ctx *g = vc;
    MDB_val k = {KEY_SIZE, g->key};
    g->rc = mdb_get(g->r->txn, g->r->s->blobs, &k, &g->v);
    /* the record check reads every byte: a page cut off faults here, under the guard */
    if (g->rc == 0) g->err = kvz_blob_check(g->v.mv_data, g->v.mv_size, &g->bi);
    return 0;
}

static int read_record(kvz_store_read *r, const uint8_t hash[16], uint32_t index,
                       const uint8_t **rec, size_t *len)
{
    if (!r || !hash || !rec || !len) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    *rec = NULL;
    *len = 0;
    getrec_ctx g;
    memset(&g, 0, sizeof g);
    g.r = r;
    make_key(g.key, hash, index);
    const int of_doc = r->have_doc && !memcmp(r->doc_hash, hash, 16);
    char hx[33], what[400], recname[32];
    hex16(hash, hx);
    if (index == KVZ_BLOB_META_LAYER) snprintf(recname, sizeof recname, "META record");
    else snprintf(recname, sizeof recname, "layer %u record", index);
    if (of_doc) snprintf(what, sizeof what, "document '" ID_FMT "' (blob %s, %s)", r->doc_id, hx, recname);
    else snprintf(what, sizeof what, "blob %s, %s", hx, recname);
    int sig = 0;
    if (guarded(getrec_fn, &g, &sig) == FAULT_INTERNAL) {
        char w2[440];
        snprintf(w2, sizeof w2, "reading %s", what);
        return fault_err(sig, w2);
    }
    if (g.rc == MDB_NOTFOUND) {
        /* a document names this blob, so its records must be there */
        if (of_doc) return damaged("%s is missing", what);
        return kvz_error_set(KVZ_ERR_NOTFOUND, "kvz_store: no record %08x of blob %s", index, hx);
    }
    if (g.rc) return lmdb_err(g.rc, "read record");
    if (g.err) return g.err;
    if (g.bi.layer != index)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: record %08x holds layer %08x", index, g.bi.layer);
    *rec = g.v.mv_data;
    *len = g.v.mv_size;
    return 0;
}

int kvz_store_read_meta(kvz_store_read *r, const uint8_t hash[16], const uint8_t **rec, size_t *len)
{
    return read_record(r, hash, KVZ_BLOB_META_LAYER, rec, len);
}

int kvz_store_read_layer(kvz_store_read *r, const uint8_t hash[16], uint32_t l,
                         const uint8_t **rec, size_t *len)
{
    if (l == KVZ_BLOB_META_LAYER) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: bad layer index");
    return read_record(r, hash, l, rec, len);
}

int kvz_store_lookup(kvz_store *s, const char *doc_id, kvz_store_doc_info *info)
{
    kvz_store_read *r;
    int err = kvz_store_read_begin(s, &r);
    if (err) return err;
    err = kvz_store_read_doc(r, doc_id, info);
    kvz_store_read_end(r);
    return err;
}

typedef struct {
    kvz_store *s;
    MDB_txn *txn;
    const uint8_t *hash;
    int rc;
} hashq_ctx;

static int hashq_fn(void *vc)
{
    hashq_ctx *h = vc;
    MDB_val k = {16, (void *)h->hash}, v;
    h->rc = mdb_get(h->txn, h->s->refs, &k, &v);
    return 0;
}

int kvz_store_has_hash(kvz_store *s, const uint8_t hash[16])
{
    if (!hash) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL hash");
    kvz_store_read *r;
    int err = kvz_store_read_begin(s, &r);
    if (err) return err;
    hashq_ctx h = {s, r->txn, hash, 0};
    int sig = 0;
    err = guarded(hashq_fn, &h, &sig);
    kvz_store_read_end(r);
    if (err == FAULT_INTERNAL) return fault_err(sig, "looking up a blob");
    if (h.rc == MDB_NOTFOUND) return 0;
    return h.rc ? lmdb_err(h.rc, "read refs") : 1;
}

/* One step of a walk over "docs": the first entry after @p after (NULL: the first),
 * copied out. */
typedef struct {
    kvz_store *s;
    MDB_txn *txn;
    const char *after;
    size_t after_len;
    char id[KVZ_STORE_DOC_ID_MAX + 1];
    kvz_store_doc_info *info;
    MDB_cursor *c; /* open while stepping: closed by the caller after a fault */
    int rc, err;
} docstep_ctx;

static int docstep_fn(void *vc)
{
    docstep_ctx *d = vc;
    MDB_cursor *c;
    d->rc = mdb_cursor_open(d->txn, d->s->docs, &c);
    if (d->rc) return 0;
    d->c = c;
    MDB_val k, v;
    if (!d->after) {
        d->rc = mdb_cursor_get(c, &k, &v, MDB_FIRST);
    } else {
        k = (MDB_val){d->after_len, (void *)d->after};
        d->rc = mdb_cursor_get(c, &k, &v, MDB_SET_RANGE);
        if (d->rc == 0 && k.mv_size == d->after_len && !memcmp(k.mv_data, d->after, d->after_len))
            d->rc = mdb_cursor_get(c, &k, &v, MDB_NEXT);
    }
    if (d->rc == 0) {
        if (k.mv_size < 1 || k.mv_size > KVZ_STORE_DOC_ID_MAX || memchr(k.mv_data, 0, k.mv_size)) {
            d->err = damaged("a doc id of %zu bytes in 'docs'", k.mv_size);
        } else {
            memcpy(d->id, k.mv_data, k.mv_size);
            d->id[k.mv_size] = 0;
            if (d->info) d->err = info_decode(&v, d->info);
        }
    }
    mdb_cursor_close(c);
    d->c = NULL;
    return 0;
}

int kvz_store_read_next_doc(kvz_store_read *r, const char *after, char id[KVZ_STORE_DOC_ID_MAX + 1],
                            kvz_store_doc_info *info)
{
    if (!r || !id || !info) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    id[0] = 0; /* set again only when an entry's key was read */
    docstep_ctx d;
    memset(&d, 0, sizeof d);
    d.s = r->s;
    d.txn = r->txn;
    d.after = after;
    d.after_len = after ? strlen(after) : 0;
    d.info = info;
    if (after && !d.after_len) d.after = NULL;
    int sig = 0;
    if (guarded(docstep_fn, &d, &sig) == FAULT_INTERNAL) {
        if (d.c) mdb_cursor_close(d.c);
        char what[300];
        if (after) snprintf(what, sizeof what, "listing the documents after '" ID_FMT "'", after);
        else snprintf(what, sizeof what, "listing the documents");
        return fault_err(sig, what);
    }
    if (d.rc == MDB_NOTFOUND) return KVZ_ERR_NOTFOUND;
    if (d.rc) return lmdb_err(d.rc, "walk docs");
    memcpy(id, d.id, strlen(d.id) + 1); /* also when only its entry does not decode */
    return d.err;
}

int kvz_store_list(kvz_store *s,
                   int (*cb)(void *user, const char *doc_id, const kvz_store_doc_info *info),
                   void *user)
{
    if (!cb) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL callback");
    kvz_store_read *r;
    int err = kvz_store_read_begin(s, &r);
    if (err) return err;
    kvz_store_doc_info *info = malloc(sizeof *info);
    char *id = malloc(2 * (KVZ_STORE_DOC_ID_MAX + 1));
    if (!info || !id) err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: list");
    /* one guarded step per entry (re-seeking from the last id), so a damaged page
     * ends the walk with an error and the callback never runs under the guard */
    const uint64_t bound = entry_bound(s->env);
    char *prev = id ? id + KVZ_STORE_DOC_ID_MAX + 1 : NULL;
    for (uint64_t steps = 0; !err; steps++) {
        if (steps > bound) { err = damaged("the 'docs' B-tree does not end"); break; }
        err = kvz_store_read_next_doc(r, steps ? prev : NULL, id, info);
        if (err == KVZ_ERR_NOTFOUND) { err = 0; break; }
        if (err) break;
        if ((err = cb(user, id, info))) break;
        memcpy(prev, id, strlen(id) + 1);
    }
    free(info);
    free(id);
    kvz_store_read_end(r);
    return err;
}

typedef struct {
    kvz_store *s;
    MDB_txn *txn;
    kvz_store_stats *st;
    int rc;
} stats_ctx;

static int stats_fn(void *vc)
{
    stats_ctx *x = vc;
    kvz_store *s = x->s;
    kvz_store_stats *st = x->st;
    MDB_stat ms;
    int rc = mdb_stat(x->txn, s->docs, &ms);
    if (!rc) { st->n_docs = ms.ms_entries; rc = mdb_stat(x->txn, s->refs, &ms); }
    if (!rc) { st->n_blobs = ms.ms_entries; rc = mdb_stat(x->txn, s->blobs, &ms); }
    if (!rc) st->n_records = ms.ms_entries;
    MDB_cursor *c = NULL;
    if (!rc) rc = mdb_cursor_open(x->txn, s->refs, &c);
    if (!rc) {
        MDB_val k, v;
        const uint64_t bound = entry_bound(s->env);
        uint64_t steps = 0;
        for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); rc == 0 && steps++ < bound;
             rc = mdb_cursor_get(c, &k, &v, MDB_NEXT))
            if (v.mv_size == REFS_SIZE) st->bytes_records += get64((const uint8_t *)v.mv_data + 8);
        if (rc == MDB_NOTFOUND) rc = 0;
        else if (rc == 0) rc = MDB_CORRUPTED; /* the walk did not end */
        mdb_cursor_close(c);
    }
    MDB_val kf = {8, "model_fp"}, vf;
    if (!rc && mdb_get(x->txn, s->meta, &kf, &vf) == 0 && vf.mv_size == 16) {
        st->has_model = 1;
        memcpy(st->model_fp, vf.mv_data, 16);
    }
    x->rc = rc;
    return 0;
}

int kvz_store_stats_get(kvz_store *s, kvz_store_stats *st)
{
    if (!s || !st) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    memset(st, 0, sizeof *st);
    kvz_store_read *r;
    int err = kvz_store_read_begin(s, &r);
    if (err) return err;
    stats_ctx x = {s, r->txn, st, 0};
    int sig = 0;
    err = guarded(stats_fn, &x, &sig);
    kvz_store_read_end(r);
    if (err == FAULT_INTERNAL) return fault_err(sig, "counting the store's entries");
    if (x.rc) return lmdb_err(x.rc, "stats");
    MDB_envinfo ei;
    MDB_stat es;
    mdb_env_info(s->env, &ei);
    mdb_env_stat(s->env, &es);
    st->map_size = ei.me_mapsize;
    st->page_size = es.ms_psize;
    st->map_used = (uint64_t)(ei.me_last_pgno + 1) * es.ms_psize;
    st->last_txnid = ei.me_last_txnid;
    return 0;
}

/* ========================================================================= */
/* Maintenance: verify, gc, compact                                            */

/* Hashes of every doc entry, sorted: how many names each blob has. */
typedef struct {
    uint8_t (*h)[16];
    size_t n;
} hash_set;

static int cmp_hash(const void *a, const void *b) { return memcmp(a, b, 16); }

static int collect_doc_hashes(kvz_store *s, MDB_txn *txn, hash_set *hs, int strict)
{
    memset(hs, 0, sizeof *hs);
    MDB_stat ms;
    int rc = mdb_stat(txn, s->docs, &ms);
    if (rc) return lmdb_err(rc, "stat docs");
    hs->h = malloc((ms.ms_entries + 1) * 16);
    if (!hs->h) return kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: doc hashes");
    MDB_cursor *c;
    if ((rc = mdb_cursor_open(txn, s->docs, &c))) return lmdb_err(rc, "cursor");
    MDB_val k, v;
    int err = 0;
    kvz_store_doc_info *info = malloc(sizeof *info);
    if (!info) err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: doc hashes");
    const uint64_t bound = entry_bound(s->env);
    uint64_t steps = 0;
    for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); !err && rc == 0;
         rc = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        if (hs->n >= ms.ms_entries + 1 || ++steps > bound) {
            err = damaged("'docs' holds more entries than its count of %zu", ms.ms_entries);
            break;
        }
        if (info_decode(&v, info)) {
            if (strict) err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: doc '%.*s' does not decode; "
                                            "nothing collected", k.mv_size > 200 ? 200 : (int)k.mv_size,
                                            (char *)k.mv_data);
            continue; /* verify reports it in its own pass */
        }
        memcpy(hs->h[hs->n++], info->hash, 16);
    }
    free(info);
    mdb_cursor_close(c);
    if (!err && rc && rc != MDB_NOTFOUND) err = lmdb_err(rc, "walk docs");
    if (err) { free(hs->h); hs->h = NULL; hs->n = 0; return err; }
    qsort(hs->h, hs->n, 16, cmp_hash);
    return 0;
}

static uint64_t names_of(const hash_set *hs, const uint8_t *hash)
{
    size_t lo = 0, hi = hs->n; /* first index >= hash */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (memcmp(hs->h[mid], hash, 16) < 0) lo = mid + 1;
        else hi = mid;
    }
    uint64_t n = 0;
    while (lo + n < hs->n && !memcmp(hs->h[lo + n], hash, 16)) n++;
    return n;
}

/* ---- verify ---- */

struct vstate {
    kvz_store_problem_fn cb;
    void *user;
    kvz_store_verify_result r;
    int stop;
};

__attribute__((format(printf, 3, 4)))
static void problem(vstate *v, int err, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    v->r.n_problems++;
    if (v->cb && !v->stop) v->stop = v->cb(v->user, err, msg);
}

/* One blob: META decodes with the store's model, every layer decodes, nothing extra. */
static void verify_blob(kvz_store *s, MDB_txn *txn, vstate *v, const uint8_t *hash,
                        const uint8_t *fp, uint32_t ref_records, uint64_t ref_bytes)
{
    char hx[33];
    hex16(hash, hx);
    uint8_t key[KEY_SIZE];
    make_key(key, hash, KVZ_BLOB_META_LAYER);
    MDB_val k = {KEY_SIZE, key}, val;
    int rc = mdb_get(txn, s->blobs, &k, &val);
    if (rc) {
        problem(v, rc == MDB_NOTFOUND ? KVZ_ERR_NOTFOUND : KVZ_ERR_LMDB,
                "blob %s: META record %s", hx, rc == MDB_NOTFOUND ? "missing" : mdb_strerror(rc));
        return;
    }
    v->r.n_records++;
    kvz_blob_meta m;
    int err = kvz_blob_decode_meta(val.mv_data, val.mv_size, fp, &m);
    if (err) {
        problem(v, err, "blob %s: META record: %s", hx, kvz_error_detail());
        return;
    }
    if (m.prefix_policy == KVZ_PREFIX_SHARED) verify_prefix_ref(s, txn, v, hx, &m, fp);
    uint64_t bytes = val.mv_size;
    uint32_t found = 1;
    for (uint32_t l = 0; l < m.n_layer && !v->stop; l++) {
        make_key(key, hash, l);
        k = (MDB_val){KEY_SIZE, key};
        rc = mdb_get(txn, s->blobs, &k, &val);
        if (rc) {
            problem(v, rc == MDB_NOTFOUND ? KVZ_ERR_NOTFOUND : KVZ_ERR_LMDB,
                    "blob %s: layer %u record %s", hx, l,
                    rc == MDB_NOTFOUND ? "missing" : mdb_strerror(rc));
            continue;
        }
        v->r.n_records++;
        found++;
        bytes += val.mv_size;
        const uint64_t kept = kvz_blob_layer_kept(&m, l);
        const uint64_t kvb = kept * kvz_blob_kv_row_bytes(&m);
        if (kvb > (1ull << 32)) {
            problem(v, KVZ_ERR_FORMAT, "blob %s: layer %u claims %llu bytes", hx, l,
                    (unsigned long long)kvb);
            continue;
        }
        uint32_t *pos = malloc(kept * 4 + 1);
        uint8_t *kb = malloc(kvb + 1), *vb = malloc(kvb + 1);
        if (!pos || !kb || !vb) {
            problem(v, KVZ_ERR_NOMEM, "blob %s: layer %u: out of memory", hx, l);
        } else if ((err = kvz_blob_decode_layer(&m, l, val.mv_data, val.mv_size, pos, kb, vb))) {
            problem(v, err, "blob %s: layer %u record: %s", hx, l, kvz_error_detail());
        }
        free(pos); free(kb); free(vb);
    }
    /* records carrying this hash: exactly META + n_layer LAYER records */
    MDB_cursor *c;
    uint64_t total = 0;
    if (mdb_cursor_open(txn, s->blobs, &c) == 0) {
        make_key(key, hash, 0);
        MDB_val ck = {KEY_SIZE, key}, cv;
        const uint64_t bound = entry_bound(s->env);
        for (rc = mdb_cursor_get(c, &ck, &cv, MDB_SET_RANGE);
             rc == 0 && ck.mv_size >= 16 && !memcmp(ck.mv_data, hash, 16) && total <= bound;
             rc = mdb_cursor_get(c, &ck, &cv, MDB_NEXT))
            total++;
        mdb_cursor_close(c);
    }
    if (total != (uint64_t)m.n_layer + 1)
        problem(v, KVZ_ERR_FORMAT, "blob %s: %llu records stored, expected %u (META + %u layers)",
                hx, (unsigned long long)total, m.n_layer + 1, m.n_layer);
    if (found == m.n_layer + 1 && (ref_records != found || ref_bytes != bytes))
        problem(v, KVZ_ERR_FORMAT, "blob %s: refs entry says %u records / %llu bytes, stored "
                "%u / %llu", hx, ref_records, (unsigned long long)ref_bytes, found,
                (unsigned long long)bytes);
    kvz_blob_meta_free(&m);
}

/* The walks of kvz_store_verify, each under a fault guard: a damaged page ends that
 * walk with a problem naming where it was, and the next walk still runs. */
typedef struct {
    kvz_store *s;
    MDB_txn *txn;
    vstate *v;
    hash_set hs;
    kvz_store_doc_info *info;
    const uint8_t *fpp;
    uint8_t fp[16];
    uint64_t bound;
    char where[300]; /* the entry being read, for a fault's problem line */
    int err;         /* walk could not run (LMDB, memory) */
    const uint8_t *hash; /* verify_blob_fn's arguments */
    uint32_t ref_records;
    uint64_t ref_bytes;
} vwalk;

static int vmeta_fn(void *vc)
{
    vwalk *w = vc;
    MDB_val kf = {8, "model_fp"}, kr = {sizeof RETIRED_KEY - 1, RETIRED_KEY}, val;
    if (mdb_get(w->txn, w->s->meta, &kf, &val) == 0) {
        if (val.mv_size == 16) { memcpy(w->fp, val.mv_data, 16); w->fpp = w->fp; }
        else problem(w->v, KVZ_ERR_FORMAT, "meta: model_fp is %zu bytes, not 16", val.mv_size);
    }
    if (mdb_get(w->txn, w->s->meta, &kr, &val) == 0)
        problem(w->v, KVZ_ERR_BUSY, "meta: these are the old files of a compacted store");
    return 0;
}

static int vnames_fn(void *vc)
{
    vwalk *w = vc;
    return collect_doc_hashes(w->s, w->txn, &w->hs, 0);
}

static int vdocs_fn(void *vc)
{
    vwalk *w = vc;
    vstate *v = w->v;
    MDB_txn *txn = w->txn;
    MDB_cursor *c;
    MDB_val k, val;
    int rc = mdb_cursor_open(txn, w->s->docs, &c);
    if (rc) { w->err = lmdb_err(rc, "cursor"); return 0; }
    uint64_t steps = 0;
    for (rc = mdb_cursor_get(c, &k, &val, MDB_FIRST); rc == 0 && !v->stop;
         rc = mdb_cursor_get(c, &k, &val, MDB_NEXT)) {
        if (++steps > w->bound) { rc = MDB_CORRUPTED; break; }
        v->r.n_docs++;
        const int idl = k.mv_size > 200 ? 200 : (int)k.mv_size;
        const char *id = k.mv_data;
        snprintf(w->where, sizeof w->where, "doc '%.*s'", idl, id);
        if (k.mv_size < 1 || k.mv_size > KVZ_STORE_DOC_ID_MAX || memchr(id, 0, k.mv_size))
            problem(v, KVZ_ERR_FORMAT, "doc '%.*s': invalid doc id (%zu bytes)", idl, id, k.mv_size);
        int err = info_decode(&val, w->info);
        if (err) {
            problem(v, err, "doc '%.*s': entry does not decode: %s", idl, id, kvz_error_detail());
            continue;
        }
        const kvz_store_doc_info *info = w->info;
        char hx[33];
        hex16(info->hash, hx);
        MDB_val kh = {16, (void *)info->hash}, vr;
        int rc2 = mdb_get(txn, w->s->refs, &kh, &vr);
        if (rc2 == MDB_NOTFOUND) {
            problem(v, KVZ_ERR_NOTFOUND, "doc '%.*s': names blob %s, which is not stored", idl, id, hx);
        } else if (rc2) {
            problem(v, KVZ_ERR_LMDB, "doc '%.*s': %s", idl, id, mdb_strerror(rc2));
        } else if (vr.mv_size == REFS_SIZE &&
                   (get32((const uint8_t *)vr.mv_data + 4) != info->n_records ||
                    get64((const uint8_t *)vr.mv_data + 8) != info->bytes_stored)) {
            problem(v, KVZ_ERR_FORMAT, "doc '%.*s': says %u records / %llu bytes, blob %s has "
                    "%u / %llu", idl, id, info->n_records, (unsigned long long)info->bytes_stored,
                    hx, get32((const uint8_t *)vr.mv_data + 4),
                    (unsigned long long)get64((const uint8_t *)vr.mv_data + 8));
        }
    }
    mdb_cursor_close(c);
    if (rc && rc != MDB_NOTFOUND)
        problem(v, KVZ_ERR_FORMAT, "docs: the walk stopped after %s: %s", w->where, mdb_strerror(rc));
    return 0;
}

static int vblob_fn(void *vc)
{
    vwalk *w = vc;
    verify_blob(w->s, w->txn, w->v, w->hash, w->fpp, w->ref_records, w->ref_bytes);
    return 0;
}

static int vrefs_fn(void *vc)
{
    vwalk *w = vc;
    vstate *v = w->v;
    MDB_cursor *c;
    MDB_val k, val;
    int rc = mdb_cursor_open(w->txn, w->s->refs, &c);
    if (rc) { w->err = lmdb_err(rc, "cursor"); return 0; }
    uint64_t steps = 0;
    for (rc = mdb_cursor_get(c, &k, &val, MDB_FIRST); rc == 0 && !v->stop;
         rc = mdb_cursor_get(c, &k, &val, MDB_NEXT)) {
        if (++steps > w->bound) { rc = MDB_CORRUPTED; break; }
        v->r.n_blobs++;
        if (k.mv_size != 16 || val.mv_size != REFS_SIZE) {
            problem(v, KVZ_ERR_FORMAT, "refs: entry of %zu/%zu bytes (want 16/%d)", k.mv_size,
                    val.mv_size, REFS_SIZE);
            continue;
        }
        char hx[33];
        hex16(k.mv_data, hx);
        snprintf(w->where, sizeof w->where, "blob %s", hx);
        const uint8_t *rv = val.mv_data;
        const uint64_t names = names_of(&w->hs, k.mv_data);
        if (names == 0)
            problem(v, KVZ_ERR_FORMAT, "blob %s: no doc id names it (refcount %u; kvzip-store gc "
                    "drops it)", hx, get32(rv));
        else if (get32(rv) != names)
            problem(v, KVZ_ERR_FORMAT, "blob %s: refcount %u but %llu doc ids name it", hx,
                    get32(rv), (unsigned long long)names);
        uint8_t hash[16];
        memcpy(hash, k.mv_data, 16);
        w->hash = hash;
        w->ref_records = get32(rv + 4);
        w->ref_bytes = get64(rv + 8);
        int sig = 0;
        if (guarded(vblob_fn, w, &sig) == FAULT_INTERNAL)
            problem(v, KVZ_ERR_FORMAT, "blob %s: reading its records hit a damaged page (%s)",
                    hx, sig_name(sig));
    }
    mdb_cursor_close(c);
    if (rc && rc != MDB_NOTFOUND)
        problem(v, KVZ_ERR_FORMAT, "refs: the walk stopped after %s: %s", w->where, mdb_strerror(rc));
    return 0;
}

static int vorphans_fn(void *vc)
{
    vwalk *w = vc;
    vstate *v = w->v;
    MDB_cursor *c;
    MDB_val k, val;
    int rc = mdb_cursor_open(w->txn, w->s->blobs, &c);
    if (rc) { w->err = lmdb_err(rc, "cursor"); return 0; }
    uint8_t last[16];
    int have_last = 0;
    uint64_t steps = 0;
    for (rc = mdb_cursor_get(c, &k, &val, MDB_FIRST); rc == 0 && !v->stop;
         rc = mdb_cursor_get(c, &k, &val, MDB_NEXT)) {
        if (++steps > w->bound) { rc = MDB_CORRUPTED; break; }
        if (k.mv_size != KEY_SIZE) {
            problem(v, KVZ_ERR_FORMAT, "blobs: key of %zu bytes (want %d)", k.mv_size, KEY_SIZE);
            continue;
        }
        if (have_last && !memcmp(last, k.mv_data, 16)) continue; /* one report per hash */
        memcpy(last, k.mv_data, 16);
        have_last = 1;
        char hx[33];
        hex16(last, hx);
        snprintf(w->where, sizeof w->where, "the records of blob %s", hx);
        MDB_val kh = {16, last}, vr;
        if (mdb_get(w->txn, w->s->refs, &kh, &vr) == MDB_NOTFOUND)
            problem(v, KVZ_ERR_FORMAT, "blob %s: records stored without a refs entry (orphans; "
                    "kvzip-store gc drops them)", hx);
    }
    mdb_cursor_close(c);
    if (rc && rc != MDB_NOTFOUND)
        problem(v, KVZ_ERR_FORMAT, "blobs: the walk stopped after %s: %s", w->where, mdb_strerror(rc));
    return 0;
}

/* shared prefix blobs (docs/FORMAT.md §6.6), each decoded once */
static int vprefix_fn(void *p)
{
    vwalk *w = p;
    verify_prefix_blobs(w->s, w->txn, w->v, w->fpp);
    return 0;
}

int kvz_store_verify(kvz_store *s, kvz_store_problem_fn cb, void *user,
                     kvz_store_verify_result *res)
{
    if (res) memset(res, 0, sizeof *res);
    if (!s) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL store");
    vstate v = {.cb = cb, .user = user};
    kvz_store_read *r;
    int err = kvz_store_read_begin(s, &r);
    if (err) return err;
    vwalk w;
    memset(&w, 0, sizeof w);
    w.s = s;
    w.txn = r->txn;
    w.v = &v;
    w.bound = entry_bound(s->env);
    w.info = malloc(sizeof *w.info);
    if (!w.info) { err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: verify"); goto out; }
    static const struct { int (*fn)(void *); const char *name; } walks[] = {
        {vmeta_fn, "meta"}, {vnames_fn, "docs"}, {vdocs_fn, "docs"}, {vrefs_fn, "refs"},
        {vorphans_fn, "blobs"}, {vprefix_fn, "prefixes"},
    };
    for (size_t i = 0; i < sizeof walks / sizeof walks[0] && !err && !v.stop; i++) {
        snprintf(w.where, sizeof w.where, "its start");
        /* a damaged page met by the last walk leaves the txn unusable (MDB_BAD_TXN):
         * take a fresh snapshot so the next walk still runs */
        MDB_cursor *probe;
        if (mdb_cursor_open(w.txn, s->meta, &probe) == MDB_BAD_TXN) {
            mdb_txn_reset(w.txn);
            int rc = mdb_txn_renew(w.txn);
            if (rc) { err = lmdb_err(rc, "renew read txn"); break; }
        } else {
            mdb_cursor_close(probe);
        }
        int sig = 0, rc = guarded(walks[i].fn, &w, &sig);
        if (rc == FAULT_INTERNAL) {
            problem(&v, KVZ_ERR_FORMAT, "%s: reading %s hit a damaged page (%s); the rest of "
                    "'%s' was not checked", walks[i].name, w.where, sig_name(sig), walks[i].name);
            if (walks[i].fn == vnames_fn) { free(w.hs.h); w.hs.h = NULL; w.hs.n = 0; }
        } else if (rc && walks[i].fn == vnames_fn && rc == KVZ_ERR_FORMAT) {
            problem(&v, rc, "docs: %s", kvz_error_detail());
        } else if (rc) {
            err = rc;
        }
        if (w.err) err = w.err;
    }
out:
    free(w.hs.h);
    free(w.info);
    kvz_store_read_end(r);
    if (res) *res = v.r;
    if (!err && v.stop) err = v.stop;
    return err;
}

/* ---- gc ---- */

typedef struct {
    kvz_store_gc_result r;
} gc_ctx;

/* Delete every record of @p hash; count them. */
static int drop_records(kvz_store *s, MDB_txn *txn, const uint8_t *hash, gc_ctx *g)
{
    MDB_cursor *c;
    int rc = mdb_cursor_open(txn, s->blobs, &c);
    if (rc) return body_rc(rc, "cursor");
    uint8_t key[KEY_SIZE];
    make_key(key, hash, 0);
    MDB_val ck = {KEY_SIZE, key}, cv;
    /* bounded: on a damaged tree a delete may not take the record away */
    const uint64_t bound = entry_bound(s->env);
    uint64_t n = 0;
    uint8_t prev[KEY_SIZE];
    size_t prev_len = 0;
    rc = mdb_cursor_get(c, &ck, &cv, MDB_SET_RANGE);
    while (rc == 0 && ck.mv_size >= 16 && !memcmp(ck.mv_data, hash, 16)) {
        if (++n > bound || (ck.mv_size == prev_len && !memcmp(prev, ck.mv_data, prev_len))) {
            mdb_cursor_close(c);
            char hx[33];
            hex16(hash, hx);
            return damaged("deleting the records of blob %s does not remove them", hx);
        }
        prev_len = ck.mv_size <= KEY_SIZE ? ck.mv_size : 0;
        memcpy(prev, ck.mv_data, prev_len);
        g->r.records_dropped++;
        g->r.bytes_dropped += cv.mv_size;
        if ((rc = mdb_cursor_del(c, 0))) break;
        ck = (MDB_val){KEY_SIZE, key};
        rc = mdb_cursor_get(c, &ck, &cv, MDB_SET_RANGE);
    }
    mdb_cursor_close(c);
    return rc == MDB_NOTFOUND ? 0 : body_rc(rc, "delete records");
}

static int gc_body(kvz_store *s, MDB_txn *txn, void *vctx)
{
    gc_ctx *g = vctx;
    memset(&g->r, 0, sizeof g->r); /* the body may be re-run after map growth */
    hash_set hs;
    int err = collect_doc_hashes(s, txn, &hs, 1);
    if (err) return err;
    /* pass 1: refs entries -> drop or fix (collected first: no writes under a cursor) */
    MDB_stat ms;
    int rc = mdb_stat(txn, s->refs, &ms);
    uint8_t (*drop)[16] = NULL, (*fix)[16 + REFS_SIZE] = NULL;
    size_t n_drop = 0, n_fix = 0;
    MDB_cursor *c = NULL;
    if (!rc) {
        drop = malloc((ms.ms_entries + 1) * 16);
        fix = malloc((ms.ms_entries + 1) * (16 + REFS_SIZE));
        if (!drop || !fix) { err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: gc"); goto out; }
        rc = mdb_cursor_open(txn, s->refs, &c);
    }
    MDB_val k, v;
    /* every loop below is bounded by the pages of the file: a damaged tree can
     * lead a cursor in circles, and gc holds the writer lock */
    const uint64_t bound = entry_bound(s->env);
    uint64_t steps = 0;
    if (!rc) {
        for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); rc == 0; rc = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
            if (++steps > bound) {
                err = damaged("the 'refs' B-tree does not end");
                goto out;
            }
            if (k.mv_size != 16 || v.mv_size != REFS_SIZE) {
                err = damaged("a 'refs' entry of %zu/%zu bytes (gc deletes nothing)", k.mv_size,
                              v.mv_size);
                goto out;
            }
            const uint64_t names = names_of(&hs, k.mv_data);
            if (names == 0 && n_drop <= ms.ms_entries) {
                memcpy(drop[n_drop++], k.mv_data, 16);
            } else if (names != get32(v.mv_data) && n_fix <= ms.ms_entries) {
                memcpy(fix[n_fix], k.mv_data, 16);
                memcpy(fix[n_fix] + 16, v.mv_data, REFS_SIZE);
                put32(fix[n_fix] + 16, names > UINT32_MAX ? UINT32_MAX : (uint32_t)names);
                n_fix++;
            }
        }
        mdb_cursor_close(c);
        c = NULL;
        rc = rc == MDB_NOTFOUND ? 0 : rc;
    }
    if (rc) { err = body_rc(rc, "walk refs"); goto out; }
    for (size_t i = 0; i < n_drop && !err; i++) {
        MDB_val kh = {16, drop[i]};
        if ((err = body_rc(mdb_del(txn, s->refs, &kh, NULL), "delete refs"))) break;
        err = drop_records(s, txn, drop[i], g);
        g->r.blobs_dropped++;
    }
    for (size_t i = 0; i < n_fix && !err; i++) {
        MDB_val kh = {16, fix[i]}, nv = {REFS_SIZE, fix[i] + 16};
        err = body_rc(mdb_put(txn, s->refs, &kh, &nv, 0), "write refs");
        g->r.refs_fixed++;
    }
    if (err) goto out;
    /* pass 2: records whose hash has no refs entry, one hash at a time */
    for (uint64_t round = 0;; round++) {
        uint8_t orphan[16];
        int found = 0;
        if (round > bound) { err = damaged("gc keeps finding orphan records"); goto out; }
        if ((rc = mdb_cursor_open(txn, s->blobs, &c))) { err = body_rc(rc, "cursor"); goto out; }
        rc = mdb_cursor_get(c, &k, &v, MDB_FIRST);
        steps = 0;
        while (rc == 0) {
            if (++steps > bound) {
                err = damaged("the 'blobs' B-tree does not end");
                goto out;
            }
            if (k.mv_size != KEY_SIZE) { /* not a record key: the tree is damaged */
                err = damaged("a key of %zu bytes in 'blobs' (kvzip-store verify lists the damage; "
                              "gc deletes nothing)", k.mv_size);
                goto out;
            }
            MDB_val kh = {16, k.mv_data}, vr;
            if (mdb_get(txn, s->refs, &kh, &vr) == MDB_NOTFOUND) {
                memcpy(orphan, k.mv_data, 16);
                found = 1;
                break;
            }
            /* jump to the first record of the next hash: (hash + 1) || 0 */
            uint8_t next[KEY_SIZE] = {0};
            memcpy(next, k.mv_data, 16);
            int carry = 1;
            for (int i = 15; i >= 0 && carry; i--) carry = ++next[i] == 0;
            if (carry) { rc = MDB_NOTFOUND; break; }
            k = (MDB_val){KEY_SIZE, next};
            rc = mdb_cursor_get(c, &k, &v, MDB_SET_RANGE);
        }
        mdb_cursor_close(c);
        c = NULL;
        if (rc && rc != MDB_NOTFOUND) { err = body_rc(rc, "walk blobs"); goto out; }
        if (!found) break;
        uint64_t before = g->r.records_dropped;
        if ((err = drop_records(s, txn, orphan, g))) goto out;
        if (g->r.records_dropped == before) {
            char hx[33];
            hex16(orphan, hx);
            err = damaged("blob %s: orphan records found by a walk are not found by a seek", hx);
            goto out;
        }
        g->r.orphan_records += g->r.records_dropped - before;
    }
    if ((err = gc_prefixes(s, txn, &g->r))) goto out; /* after the blobs: their META name the prefixes */
    if (!g->r.blobs_dropped && !g->r.refs_fixed && !g->r.orphan_records && !g->r.prefixes_dropped)
        err = NOOP_INTERNAL;
out:
    if (c) mdb_cursor_close(c);
    free(drop);
    free(fix);
    free(hs.h);
    return err;
}

int kvz_store_gc(kvz_store *s, kvz_store_gc_result *res)
{
    if (res) memset(res, 0, sizeof *res);
    if (!s) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL store");
    gc_ctx g;
    memset(&g, 0, sizeof g);
    int err = run_write(s, gc_body, &g, 1 << 20);
    if (!err && res) *res = g.r;
    return err;
}

/* ---- compact ---- */

/* snprintf into a path buffer; -1 when it does not fit. */
static int pathf(char *out, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out, cap, fmt, ap);
    va_end(ap);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

/* Remove a store directory we made (data.mdb, lock.mdb, the folder); nothing else. */
static void rm_store_dir(const char *d)
{
    char p[4200];
    pathf(p, sizeof p, "%s/data.mdb", d);
    unlink(p);
    pathf(p, sizeof p, "%s/lock.mdb", d);
    unlink(p);
    rmdir(d);
}

/* Leftovers of a compaction that crashed: ".<base>.compact.*" / ".<base>.old.*". */
static void clean_stale(const char *parent, const char *base)
{
    DIR *d = opendir(parent);
    if (!d) return;
    char pre1[512], pre2[512];
    pathf(pre1, sizeof pre1, ".%s.compact.", base);
    pathf(pre2, sizeof pre2, ".%s.old.", base);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, pre1, strlen(pre1)) && strncmp(e->d_name, pre2, strlen(pre2))) continue;
        char p[4200];
        pathf(p, sizeof p, "%s/%s", parent, e->d_name);
        rm_store_dir(p);
    }
    closedir(d);
}

static int fsync_path(const char *p)
{
    int fd = open(p, O_RDONLY);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* The copy opens as a kvzip store of our version. */
static int check_copy(const char *dir)
{
    MDB_env *env;
    MDB_txn *txn = NULL;
    MDB_dbi dbi;
    MDB_val k = {14, "format_version"}, v;
    int rc = mdb_env_create(&env);
    if (rc) return lmdb_err(rc, "mdb_env_create");
    mdb_env_set_maxdbs(env, 8);
    rc = mdb_env_open(env, dir, MDB_RDONLY | MDB_NOLOCK | MDB_NOTLS, 0644);
    if (!rc) rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    if (!rc) rc = mdb_dbi_open(txn, "meta", 0, &dbi);
    if (!rc) rc = mdb_get(txn, dbi, &k, &v);
    int err = rc ? lmdb_err(rc, "check compacted copy") : 0;
    if (!err && (v.mv_size != 4 || get32(v.mv_data) != KVZ_STORE_VERSION))
        err = kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: compacted copy has no valid format_version");
    if (txn) mdb_txn_abort(txn);
    mdb_env_close(env);
    return err;
}

typedef struct { MDB_env *env; const char *dir; int rc; } copy_ctx;

static int copy_fn(void *vc)
{
    copy_ctx *c = vc;
    c->rc = mdb_env_copy2(c->env, c->dir, MDB_CP_COMPACT);
    return 0;
}

/* Give @p path the owner, group and permission bits of @p want (creating it empty
 * first when @p create). chown before chmod: chown may clear set-id bits. */
static int same_owner_mode(const char *path, const struct stat *want, int create)
{
    if (create) {
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0) return -1;
        close(fd);
    }
    struct stat cur;
    if (stat(path, &cur)) return -1;
    if ((cur.st_uid != want->st_uid || cur.st_gid != want->st_gid) &&
        chown(path, want->st_uid, want->st_gid))
        return -1;
    return chmod(path, want->st_mode & 07777);
}

int kvz_store_compact(kvz_store *s, uint64_t *bytes_before, uint64_t *bytes_after)
{
    if (bytes_before) *bytes_before = 0;
    if (bytes_after) *bytes_after = 0;
    if (!s) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL store");
    if (s->readonly) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: store opened read-only");
    /* parent folder and name of the store directory */
    char dir[4096], parent[4096], tmp[4200], old[4200];
    snprintf(dir, sizeof dir, "%s", s->dir);
    size_t dl = strlen(dir);
    while (dl > 1 && dir[dl - 1] == '/') dir[--dl] = 0;
    const char *slash = strrchr(dir, '/');
    const char *base = slash ? slash + 1 : dir;
    if (!slash) snprintf(parent, sizeof parent, ".");
    else if (slash == dir) snprintf(parent, sizeof parent, "/");
    else snprintf(parent, sizeof parent, "%.*s", (int)(slash - dir), dir);
    if (!*base || !strcmp(base, ".") || !strcmp(base, ".."))
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: cannot compact '%s': give the store "
                             "folder by name", s->dir);
    if (strlen(s->dir) >= sizeof dir ||
        pathf(tmp, sizeof tmp, "%s/.%s.compact.%ld", parent, base, (long)getpid()) ||
        pathf(old, sizeof old, "%s/.%s.old.%ld", parent, base, (long)getpid()))
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: store path too long");

    /* 1. the writer lock, through a write transaction held until the end */
    MDB_txn *w = NULL;
    int rc, err = 0;
    for (int attempt = 0; attempt < 8 && !w; attempt++) {
        pthread_rwlock_rdlock(&s->lock);
        rc = mdb_txn_begin(s->env, NULL, 0, &w);
        if (rc == 0) break;
        pthread_rwlock_unlock(&s->lock);
        w = NULL;
        err = rc == MDB_MAP_RESIZED ? adopt_mapsize(s) : lmdb_err(rc, "begin write txn");
        if (err) return err;
    }
    if (!w) return kvz_error_set(KVZ_ERR_BUSY, "kvz_store: map keeps being resized");
    if ((err = check_retired(s, w))) goto abort;
    clean_stale(parent, base);

    /* 2. the compacted copy */
    char p[4300];
    struct stat st;
    pathf(p, sizeof p, "%s/data.mdb", dir);
    if (stat(p, &st) == 0 && bytes_before) *bytes_before = (uint64_t)st.st_size;
    /* the copy gets the store's mode and owner (a compaction run by root must not
     * lock the owner out): folder, data.mdb and lock.mdb as they are now */
    struct stat st_dir, st_data, st_lock;
    int have_lock;
    pathf(p, sizeof p, "%s/data.mdb", dir);
    if (stat(dir, &st_dir) || stat(p, &st_data)) {
        err = kvz_error_set(KVZ_ERR_IO, "kvz_store: stat %s: %s", p, strerror(errno));
        goto abort;
    }
    pathf(p, sizeof p, "%s/lock.mdb", dir);
    have_lock = stat(p, &st_lock) == 0;
    if (mkdir(tmp, 0700)) {
        err = kvz_error_set(KVZ_ERR_IO, "kvz_store: mkdir %s: %s", tmp, strerror(errno));
        goto abort;
    }
    copy_ctx cc = {s->env, tmp, 0};
    int sig = 0;
    if (guarded(copy_fn, &cc, &sig) == FAULT_INTERNAL) {
        err = fault_err(sig, "the compacting copy");
        goto cleanup;
    }
    if ((rc = cc.rc)) { err = lmdb_err(rc, "compacting copy"); goto cleanup; }
    pathf(p, sizeof p, "%s/data.mdb", tmp);
    if (fsync_path(p) || fsync_path(tmp)) {
        err = kvz_error_set(errno == ENOSPC ? KVZ_ERR_FULL : KVZ_ERR_IO, "kvz_store: fsync %s: %s",
                            p, strerror(errno));
        goto cleanup;
    }
    if (same_owner_mode(p, &st_data, 0)) {
        err = kvz_error_set(KVZ_ERR_IO, "kvz_store: giving %s the store's owner and mode: %s (store "
                            "unchanged)", p, strerror(errno));
        goto cleanup;
    }
    pathf(p, sizeof p, "%s/lock.mdb", tmp);
    if (have_lock && same_owner_mode(p, &st_lock, 1)) {
        err = kvz_error_set(KVZ_ERR_IO, "kvz_store: giving %s the store's owner and mode: %s (store "
                            "unchanged)", p, strerror(errno));
        goto cleanup;
    }
    if (same_owner_mode(tmp, &st_dir, 0)) {
        err = kvz_error_set(KVZ_ERR_IO, "kvz_store: giving %s the store's owner and mode: %s (store "
                            "unchanged)", tmp, strerror(errno));
        goto cleanup;
    }
    pathf(p, sizeof p, "%s/data.mdb", tmp);
    if (stat(p, &st) == 0 && bytes_after) *bytes_after = (uint64_t)st.st_size;
    if ((err = check_copy(tmp))) goto cleanup;

    /* 3. swap */
    const char *gone = tmp; /* where the old files end up */
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, dir, RENAME_EXCHANGE)) {
        if (errno != EINVAL && errno != ENOSYS) {
            err = kvz_error_set(KVZ_ERR_IO, "kvz_store: swapping %s and %s: %s", tmp, dir,
                                strerror(errno));
            goto cleanup;
        }
        if (rename(dir, old)) {
            err = kvz_error_set(KVZ_ERR_IO, "kvz_store: rename %s: %s", dir, strerror(errno));
            goto cleanup;
        }
        if (rename(tmp, dir)) {
            err = kvz_error_set(KVZ_ERR_IO, "kvz_store: rename %s: %s", tmp, strerror(errno));
            rename(old, dir); /* put the original back */
            goto cleanup;
        }
        gone = old;
    }
    fsync_path(parent);

    /* 4. mark the old files so writers that still have them open fail cleanly */
    MDB_val k = {sizeof RETIRED_KEY - 1, RETIRED_KEY}, v = {1, "1"};
    if (mdb_put(w, s->meta, &k, &v, 0) == 0) mdb_txn_commit(w);
    else mdb_txn_abort(w);
    pthread_rwlock_unlock(&s->lock);
    s->retired = 1;
    rm_store_dir(gone);
    return 0;

cleanup:
    rm_store_dir(tmp);
abort:
    mdb_txn_abort(w);
    pthread_rwlock_unlock(&s->lock);
    return err;
}

/* ========================================================================= */
/* Shared system prefix (docs/FORMAT.md §3.1, §6.6)                            */

#define PREFIX_DB "prefixes"

/* The "prefixes" handle for @p txn: the one opened at open, else opened now
 * (created when @p create, in a write transaction). 1 = none exists. */
static int prefix_dbi(kvz_store *s, MDB_txn *txn, int create, MDB_dbi *out)
{
    if (s->have_prefixes) { *out = s->prefixes; return 0; }
    int rc = mdb_dbi_open(txn, PREFIX_DB, create ? MDB_CREATE : 0, out);
    if (rc == MDB_NOTFOUND) return 1;
    return rc ? body_rc(rc, "open prefixes database") : 0;
}

int kvz_store_read_prefix(kvz_store_read *r, const uint8_t hash[16], uint32_t index,
                          const uint8_t **rec, size_t *len)
{
    if (!r || !hash || !rec || !len) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    *rec = NULL;
    *len = 0;
    char hx[33];
    hex16(hash, hx);
    MDB_dbi dbi;
    int err = prefix_dbi(r->s, r->txn, 0, &dbi);
    if (err < 0) return err;
    uint8_t key[KEY_SIZE];
    make_key(key, hash, index);
    MDB_val k = {KEY_SIZE, key}, v;
    int rc = err == 1 ? MDB_NOTFOUND : mdb_get(r->txn, dbi, &k, &v);
    if (rc == MDB_NOTFOUND)
        return kvz_error_set(KVZ_ERR_NOTFOUND, "kvz_store: shared prefix %s: no record %08x", hx, index);
    if (rc) return lmdb_err(rc, "read prefix record");
    kvz_blob_info bi;
    if ((err = kvz_blob_check(v.mv_data, v.mv_size, &bi))) return err;
    if (bi.layer != index)
        return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: prefix record %08x holds layer %08x", index, bi.layer);
    *rec = v.mv_data;
    *len = v.mv_size;
    return 0;
}

int kvz_store_has_prefix(kvz_store *s, const uint8_t hash[16])
{
    if (!s || !hash) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    kvz_store_read *r;
    int err = kvz_store_read_begin(s, &r);
    if (err) return err;
    MDB_dbi dbi;
    err = prefix_dbi(s, r->txn, 0, &dbi);
    if (err == 0) {
        uint8_t key[KEY_SIZE];
        make_key(key, hash, KVZ_BLOB_META_LAYER);
        MDB_val k = {KEY_SIZE, key}, v;
        int rc = mdb_get(r->txn, dbi, &k, &v);
        err = rc == 0 ? 1 : rc == MDB_NOTFOUND ? 0 : lmdb_err(rc, "read prefix");
    } else if (err == 1) {
        err = 0;
    }
    kvz_store_read_end(r);
    return err;
}

int kvz_store_prefix_stats(kvz_store *s, uint64_t *n_prefixes, uint64_t *bytes)
{
    if (n_prefixes) *n_prefixes = 0;
    if (bytes) *bytes = 0;
    if (!s) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL store");
    kvz_store_read *r;
    int err = kvz_store_read_begin(s, &r);
    if (err) return err;
    MDB_dbi dbi;
    MDB_cursor *c;
    err = prefix_dbi(s, r->txn, 0, &dbi);
    if (err == 0 && !(err = mdb_cursor_open(r->txn, dbi, &c))) {
        MDB_val k, v;
        int rc;
        for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); rc == 0; rc = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
            if (bytes) *bytes += v.mv_size;
            if (n_prefixes && k.mv_size == KEY_SIZE && get32((const uint8_t *)k.mv_data + 16) == 0xFFFFFFFFu)
                (*n_prefixes)++;
        }
        mdb_cursor_close(c);
        err = rc == MDB_NOTFOUND ? 0 : lmdb_err(rc, "walk prefixes");
    } else if (err > 0) {
        err = err == 1 ? 0 : lmdb_err(err, "cursor");
    }
    kvz_store_read_end(r);
    return err;
}

/* Verify a blob's records before a write (as kvz_store_put_doc does): META
 * decodes, n_layers LAYER records of this blob in order. @p m: decoded META. */
static int check_records(const kvz_store_rec *meta, const kvz_store_rec *layers, uint32_t n_layers,
                         kvz_blob_meta *m, uint64_t *bytes, const char *what)
{
    int err = kvz_blob_decode_meta(meta->data, meta->len, NULL, m);
    if (err) return err;
    if (n_layers != m->n_layer || !layers)
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: %s: %u layer records for a %u-layer blob", what,
                             n_layers, m->n_layer);
    const uint64_t id = kvz_blob_meta_id(m);
    *bytes = meta->len;
    for (uint32_t l = 0; l < n_layers; l++) {
        kvz_blob_info bi;
        if (!layers[l].data) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: %s: layer %u NULL", what, l);
        if ((err = kvz_blob_check(layers[l].data, layers[l].len, &bi))) return err;
        if (bi.kind != KVZ_BLOB_KIND_LAYER || bi.layer != l || bi.blob_id != id ||
            bi.raw_size != kvz_blob_layer_raw_size(m, l))
            return kvz_error_set(KVZ_ERR_FORMAT, "kvz_store: %s: record %u is not layer %u of this blob",
                                 what, l, l);
        *bytes += layers[l].len;
    }
    return 0;
}

/* Does prefix blob META @p p fit document blob META @p d? NULL when it does. */
static const char *prefix_mismatch(const kvz_blob_meta *p, const kvz_blob_meta *d)
{
    if (memcmp(p->fingerprint, d->fingerprint, 16)) return "made by another model";
    if (p->n_layer != d->n_layer || p->n_head != d->n_head || p->n_kv_head != d->n_kv_head ||
        p->head_dim != d->head_dim)
        return "other dims";
    if (p->dtype != d->dtype) return "other dtype";
    if (p->n_prefix != d->n_prefix) return "other n_prefix";
    if (p->n_context != 0 || p->prefix_policy != KVZ_PREFIX_KEEP) return "not a prefix blob";
    return NULL;
}

typedef struct {
    put_ctx pc;                 /* the document (put_body) */
    const uint8_t *prefix_hash;
    const kvz_store_rec *pmeta, *players;
    uint32_t n_players;
    MDB_dbi dbi;
    int written;
} shared_ctx;

static int put_shared_body(kvz_store *s, MDB_txn *txn, void *vctx)
{
    shared_ctx *c = vctx;
    c->written = 0;
    int err = prefix_dbi(s, txn, 1, &c->dbi);
    if (err) return err < 0 ? err : kvz_error_set(KVZ_ERR_LMDB, "kvz_store: cannot create prefixes");
    uint8_t key[KEY_SIZE];
    make_key(key, c->prefix_hash, KVZ_BLOB_META_LAYER);
    MDB_val k = {KEY_SIZE, key}, v;
    int rc = mdb_get(txn, c->dbi, &k, &v);
    if (rc == MDB_NOTFOUND) {
        if (!c->pmeta) {
            char hx[33];
            hex16(c->prefix_hash, hx);
            return kvz_error_set(KVZ_ERR_NOTFOUND, "kvz_store: shared prefix %s is not stored", hx);
        }
        for (uint32_t i = 0; i <= c->n_players; i++) {
            const kvz_store_rec *rec = i == 0 ? c->pmeta : &c->players[i - 1];
            make_key(key, c->prefix_hash, i == 0 ? KVZ_BLOB_META_LAYER : i - 1);
            MDB_val kk = {KEY_SIZE, key}, vv = {rec->len, (void *)rec->data};
            if ((err = body_rc(mdb_put(txn, c->dbi, &kk, &vv, 0), "write prefix record"))) return err;
        }
        c->written = 1;
    } else if (rc) {
        return body_rc(rc, "read prefix");
    }
    err = put_body(s, txn, &c->pc);
    if (err == NOOP_INTERNAL && c->written) err = 0; /* the prefix alone is worth a commit */
    return err;
}

int kvz_store_put_doc_shared(kvz_store *s, const char *doc_id, const uint8_t hash[16],
                             const kvz_store_doc_info *info, const kvz_store_rec *meta,
                             const kvz_store_rec *layers, uint32_t n_layers,
                             const uint8_t prefix_hash[16], const kvz_store_rec *pmeta,
                             const kvz_store_rec *players, int *status, int *prefix_written)
{
    if (status) *status = 0;
    if (prefix_written) *prefix_written = 0;
    size_t id_len = 0;
    int err;
    if (!s || !hash || !info || !prefix_hash) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    if ((err = check_doc_id(doc_id, &id_len))) return err;
    if (!memchr(info->source_path, 0, KVZ_STORE_SOURCE_MAX))
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: source path not NUL-terminated");
    if (!meta && (layers || n_layers))
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: layer records without a META record");
    shared_ctx c = {{doc_id, id_len, hash, info, meta, layers, n_layers, NULL, 0, 0},
                    prefix_hash, pmeta, players, 0, 0, 0};
    kvz_blob_meta m = {0}, pm = {0};
    uint64_t pbytes = 0;
    if (meta) {
        if ((err = check_records(meta, layers, n_layers, &m, &c.pc.bytes, "document blob"))) goto out;
        if (m.prefix_policy != KVZ_PREFIX_SHARED || memcmp(m.prefix_ref, prefix_hash, 16)) {
            err = kvz_error_set(KVZ_ERR_ARG, "kvz_store: document blob does not reference this prefix");
            goto out;
        }
        c.pc.meta_fp = m.fingerprint;
    }
    if (pmeta) {
        if ((err = check_records(pmeta, players, meta ? m.n_layer : 0, &pm, &pbytes, "prefix blob"))) goto out;
        c.n_players = pm.n_layer;
        const char *why = meta ? prefix_mismatch(&pm, &m) : NULL;
        if (why) { err = kvz_error_set(KVZ_ERR_ARG, "kvz_store: prefix blob %s", why); goto out; }
    }
    err = run_write(s, put_shared_body, &c, c.pc.bytes + pbytes + INFO_FIXED + KVZ_STORE_SOURCE_MAX + 64 * 1024);
    if (!err) {
        if (!s->have_prefixes) { /* handle of a committed create: valid for the env from now on */
            s->prefixes = c.dbi;
            s->have_prefixes = 1;
        }
        if (status) *status = c.pc.status;
        if (prefix_written) *prefix_written = c.written;
    }
out:
    kvz_blob_meta_free(&m);
    kvz_blob_meta_free(&pm);
    return err;
}

/* ---- gc: drop prefixes no blob references ---- */

static int gc_prefixes(kvz_store *s, MDB_txn *txn, kvz_store_gc_result *res)
{
    MDB_dbi dbi;
    int err = prefix_dbi(s, txn, 0, &dbi);
    if (err) return err < 0 ? err : 0; /* no prefixes database: nothing to do */
    /* 1. prefix_ref of every remaining blob (META = the last record of each hash) */
    uint8_t (*ref)[16] = NULL;
    size_t n_ref = 0, cap = 0;
    int keep_all = 0;
    MDB_cursor *c = NULL;
    MDB_val k, v;
    int rc = mdb_cursor_open(txn, s->blobs, &c);
    if (rc) return body_rc(rc, "cursor");
    rc = mdb_cursor_get(c, &k, &v, MDB_FIRST);
    while (rc == 0) {
        if (k.mv_size != KEY_SIZE) { rc = mdb_cursor_get(c, &k, &v, MDB_NEXT); continue; }
        uint8_t mk[KEY_SIZE];
        memcpy(mk, k.mv_data, 16);
        mk[16] = mk[17] = mk[18] = mk[19] = 0xFF;
        k = (MDB_val){KEY_SIZE, mk};
        rc = mdb_cursor_get(c, &k, &v, MDB_SET_KEY);
        if (rc == 0) {
            kvz_blob_meta m;
            if (kvz_blob_decode_meta(v.mv_data, v.mv_size, NULL, &m)) {
                keep_all = 1; /* cannot tell what it references: keep every prefix */
            } else {
                if (m.prefix_policy == KVZ_PREFIX_SHARED) {
                    if (n_ref == cap) {
                        cap = cap ? 2 * cap : 64;
                        void *nr = realloc(ref, cap * 16);
                        if (!nr) { kvz_blob_meta_free(&m); err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: gc"); goto out; }
                        ref = nr;
                    }
                    memcpy(ref[n_ref++], m.prefix_ref, 16);
                }
                kvz_blob_meta_free(&m);
            }
            rc = mdb_cursor_get(c, &k, &v, MDB_NEXT);
        } else if (rc == MDB_NOTFOUND) { /* a hash without META: move past it */
            k = (MDB_val){KEY_SIZE, mk};
            rc = mdb_cursor_get(c, &k, &v, MDB_SET_RANGE);
        }
    }
    mdb_cursor_close(c);
    c = NULL;
    if (rc != MDB_NOTFOUND) { err = body_rc(rc, "walk blobs"); goto out; }
    if (keep_all) goto out;
    if (n_ref) qsort(ref, n_ref, 16, cmp_hash);
    /* 2. delete the records of every unreferenced prefix, one hash at a time */
    for (;;) {
        uint8_t victim[16];
        int found = 0;
        if ((rc = mdb_cursor_open(txn, dbi, &c))) { err = body_rc(rc, "cursor"); goto out; }
        for (rc = mdb_cursor_get(c, &k, &v, MDB_FIRST); rc == 0; rc = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
            if (k.mv_size < 16) continue;
            if (!n_ref || !bsearch(k.mv_data, ref, n_ref, 16, cmp_hash)) {
                memcpy(victim, k.mv_data, 16);
                found = 1;
                break;
            }
        }
        mdb_cursor_close(c);
        c = NULL;
        if (rc && rc != MDB_NOTFOUND) { err = body_rc(rc, "walk prefixes"); goto out; }
        if (!found) break;
        uint8_t key[KEY_SIZE];
        make_key(key, victim, 0);
        if ((rc = mdb_cursor_open(txn, dbi, &c))) { err = body_rc(rc, "cursor"); goto out; }
        MDB_val ck = {KEY_SIZE, key}, cv;
        rc = mdb_cursor_get(c, &ck, &cv, MDB_SET_RANGE);
        while (rc == 0 && ck.mv_size >= 16 && !memcmp(ck.mv_data, victim, 16)) {
            res->records_dropped++;
            res->bytes_dropped += cv.mv_size;
            if ((rc = mdb_cursor_del(c, 0))) break;
            ck = (MDB_val){KEY_SIZE, key};
            rc = mdb_cursor_get(c, &ck, &cv, MDB_SET_RANGE);
        }
        mdb_cursor_close(c);
        c = NULL;
        if (rc && rc != MDB_NOTFOUND) { err = body_rc(rc, "delete prefix records"); goto out; }
        res->prefixes_dropped++;
    }
out:
    if (c) mdb_cursor_close(c);
    free(ref);
    return err;
}

/* ---- verify ---- */

/* A SHARED blob: its prefix blob's META is stored and fits. */
static void verify_prefix_ref(kvz_store *s, MDB_txn *txn, vstate *v, const char *hx,
                              const kvz_blob_meta *m, const uint8_t *fp)
{
    char px[33];
    hex16(m->prefix_ref, px);
    MDB_dbi dbi;
    int err = prefix_dbi(s, txn, 0, &dbi);
    uint8_t key[KEY_SIZE];
    make_key(key, m->prefix_ref, KVZ_BLOB_META_LAYER);
    MDB_val k = {KEY_SIZE, key}, val;
    int rc = err ? MDB_NOTFOUND : mdb_get(txn, dbi, &k, &val);
    if (err < 0 || (rc && rc != MDB_NOTFOUND)) {
        problem(v, KVZ_ERR_LMDB, "blob %s: shared prefix %s: %s", hx, px, err < 0 ? kvz_error_detail() : mdb_strerror(rc));
        return;
    }
    if (rc) {
        problem(v, KVZ_ERR_NOTFOUND, "blob %s: shared prefix %s is missing", hx, px);
        return;
    }
    kvz_blob_meta pm;
    if ((err = kvz_blob_decode_meta(val.mv_data, val.mv_size, fp, &pm))) {
        problem(v, err, "blob %s: shared prefix %s META record: %s", hx, px, kvz_error_detail());
        return;
    }
    const char *why = prefix_mismatch(&pm, m);
    if (why) problem(v, KVZ_ERR_FORMAT, "blob %s: shared prefix %s does not fit: %s", hx, px, why);
    kvz_blob_meta_free(&pm);
}

/* Every stored prefix blob decodes completely; no stray records. */
static void verify_prefix_blobs(kvz_store *s, MDB_txn *txn, vstate *v, const uint8_t *fp)
{
    MDB_dbi dbi;
    int err = prefix_dbi(s, txn, 0, &dbi);
    if (err) {
        if (err < 0) problem(v, err, "prefixes: %s", kvz_error_detail());
        return;
    }
    MDB_cursor *c;
    int rc = mdb_cursor_open(txn, dbi, &c);
    if (rc) { problem(v, KVZ_ERR_LMDB, "prefixes: cursor: %s", mdb_strerror(rc)); return; }
    MDB_val k, val;
    kvz_blob_meta m = {0}; /* META of the current prefix; counts NULL when unusable */
    int tracking = 0;
    uint8_t cur[16];
    char hx[33];
    /* records of one hash come in index order, META (0xFFFFFFFF) last */
    uint32_t expect = 0;
    for (rc = mdb_cursor_get(c, &k, &val, MDB_FIRST); rc == 0 && !v->stop;
         rc = mdb_cursor_get(c, &k, &val, MDB_NEXT)) {
        if (k.mv_size != KEY_SIZE) {
            problem(v, KVZ_ERR_FORMAT, "prefixes: key of %zu bytes (want %d)", k.mv_size, KEY_SIZE);
            continue;
        }
        const uint8_t *kb = k.mv_data;
        const uint32_t idx = (uint32_t)kb[16] << 24 | (uint32_t)kb[17] << 16 | (uint32_t)kb[18] << 8 | kb[19];
        if (!tracking || memcmp(cur, kb, 16)) { /* first record of a new prefix */
            kvz_blob_meta_free(&m);
            tracking = 1;
            memcpy(cur, kb, 16);
            hex16(cur, hx);
            expect = 0;
            uint8_t mk[KEY_SIZE];
            make_key(mk, cur, KVZ_BLOB_META_LAYER);
            MDB_val kk = {KEY_SIZE, mk}, mv;
            v->r.n_prefixes++;
            if ((rc = mdb_get(txn, dbi, &kk, &mv))) {
                problem(v, KVZ_ERR_NOTFOUND, "shared prefix %s: META record missing", hx);
                rc = 0;
            } else if ((err = kvz_blob_decode_meta(mv.mv_data, mv.mv_size, fp, &m))) {
                problem(v, err, "shared prefix %s: META record: %s", hx, kvz_error_detail());
            } else if (m.n_context != 0 || m.prefix_policy != KVZ_PREFIX_KEEP) {
                problem(v, KVZ_ERR_FORMAT, "shared prefix %s: not a prefix blob", hx);
                kvz_blob_meta_free(&m);
            } else {
                v->r.n_records++;
            }
        }
        if (idx == KVZ_BLOB_META_LAYER) {
            if (m.counts && expect != m.n_layer)
                problem(v, KVZ_ERR_NOTFOUND, "shared prefix %s: %u of %u layer records", hx, expect, m.n_layer);
            continue;
        }
        if (!m.counts) continue; /* reported above */
        if (idx != expect || idx >= m.n_layer) {
            problem(v, KVZ_ERR_FORMAT, "shared prefix %s: unexpected record %08x", hx, idx);
            expect = idx + 1;
            continue;
        }
        expect++;
        v->r.n_records++;
        const uint64_t kept = kvz_blob_layer_kept(&m, idx), kvb = kept * kvz_blob_kv_row_bytes(&m);
        uint32_t *pos = malloc(kept * 4 + 1);
        uint8_t *kk = malloc(kvb + 1), *vv = malloc(kvb + 1);
        if (!pos || !kk || !vv)
            problem(v, KVZ_ERR_NOMEM, "shared prefix %s: layer %u: out of memory", hx, idx);
        else if ((err = kvz_blob_decode_layer(&m, idx, val.mv_data, val.mv_size, pos, kk, vv)))
            problem(v, err, "shared prefix %s: layer %u record: %s", hx, idx, kvz_error_detail());
        free(pos); free(kk); free(vv);
    }
    if (rc && rc != MDB_NOTFOUND) problem(v, KVZ_ERR_LMDB, "prefixes: walk: %s", mdb_strerror(rc));
    mdb_cursor_close(c);
    kvz_blob_meta_free(&m);
}

/* ========================================================================= */
/* Copy reads: a record's bytes with pread() (kvz_store_copy_layer)            */

/* The file offset of @p p, a pointer into the map of data.mdb: the line of
 * /proc/self/maps that holds it must name data.mdb itself (the device and inode of
 * the environment's file descriptor), else -1 (the caller reads through the map). */
static int map_offset(kvz_store *s, const void *p, size_t n, uint64_t *off)
{
    const uintptr_t a = (uintptr_t)p;
    pthread_mutex_lock(&s->map_mu);
    if (!s->map_known || a < s->map_lo || a >= s->map_hi) { /* (re)read: the map may span several lines */
        s->map_known = 0;
        int fd;
        struct stat st;
        FILE *f = NULL;
        if (mdb_env_get_fd(s->env, &fd) == 0 && fstat(fd, &st) == 0) f = fopen("/proc/self/maps", "re");
        char line[4608];
        while (f && fgets(line, sizeof line, f)) {
            unsigned long lo, hi, fo, ino;
            unsigned maj, mnr;
            if (sscanf(line, "%lx-%lx %*s %lx %x:%x %lu", &lo, &hi, &fo, &maj, &mnr, &ino) != 6) continue;
            if (a < lo || a >= hi) continue;
            if (ino == (unsigned long)st.st_ino && makedev(maj, mnr) == st.st_dev) {
                s->map_lo = lo;
                s->map_hi = hi;
                s->map_off = fo;
                s->map_known = 1;
            }
            break;
        }
        if (f) fclose(f);
    }
    const int ok = s->map_known && a >= s->map_lo && n <= s->map_hi - a;
    if (ok) *off = s->map_off + (a - s->map_lo);
    pthread_mutex_unlock(&s->map_mu);
    return ok ? 0 : -1;
}

typedef struct {
    MDB_txn *txn;
    MDB_dbi dbi;
    uint8_t key[KEY_SIZE];
    MDB_val v;
    int rc;
} getval_ctx;

static int getval_fn(void *vc)
{
    getval_ctx *g = vc;
    MDB_val k = {KEY_SIZE, g->key};
    g->rc = mdb_get(g->txn, g->dbi, &k, &g->v); /* walks B-tree pages only: the value is not read */
    return 0;
}

#define COPY_PIECE ((size_t)256 << 10) /* fits L2 with room: the caller hashes it while it is there */

/* Look record @p index of @p hash up (B-tree pages only: the value is not read) into
 * @p g; @p what names it for messages. 0 or the error (a missing record of the
 * transaction's document is damage). */
static int find_record(kvz_store_read *r, MDB_dbi dbi, int prefix, const uint8_t hash[16], uint32_t index,
                       getval_ctx *g, char what[400])
{
    memset(g, 0, sizeof *g);
    g->txn = r->txn;
    g->dbi = dbi;
    make_key(g->key, hash, index);
    char hx[33];
    hex16(hash, hx);
    const int of_doc = !prefix && r->have_doc && !memcmp(r->doc_hash, hash, 16);
    if (of_doc) snprintf(what, 400, "document '" ID_FMT "' (blob %s, layer %u record)", r->doc_id, hx, index);
    else snprintf(what, 400, "%s %s, layer %u record", prefix ? "shared prefix" : "blob", hx, index);
    int sig = 0;
    if (guarded(getval_fn, g, &sig) == FAULT_INTERNAL) {
        char w2[440];
        snprintf(w2, sizeof w2, "reading %s", what);
        return fault_err(sig, w2);
    }
    if (g->rc == MDB_NOTFOUND) {
        if (of_doc) return damaged("%s is missing", what);
        return kvz_error_set(KVZ_ERR_NOTFOUND, "kvz_store: no record %08x of %s %s", index,
                             prefix ? "shared prefix" : "blob", hx);
    }
    if (g->rc) return lmdb_err(g->rc, "read record");
    return 0;
}

static int copy_record(kvz_store_read *r, MDB_dbi dbi, int prefix, const uint8_t hash[16], uint32_t index,
                       void *dst, size_t cap, size_t *len, kvz_store_piece_fn piece, void *user)
{
    if (!r || !hash || !len || (cap && !dst)) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    *len = 0;
    getval_ctx g;
    char what[400];
    const int frc = find_record(r, dbi, prefix, hash, index, &g, what);
    if (frc) return frc;
    *len = g.v.mv_size;
    if (g.v.mv_size != cap) return 0; /* not the record the caller expects: nothing copied */
    uint64_t off;
    if (map_offset(r->s, g.v.mv_data, g.v.mv_size, &off))
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "kvz_store: the map of data.mdb is not found in /proc/self/maps");
    int fd;
    if (mdb_env_get_fd(r->s->env, &fd)) return kvz_error_set(KVZ_ERR_UNSUPPORTED, "kvz_store: no data file descriptor");
    size_t done = 0;
    while (done < cap) {
        const size_t want = cap - done < COPY_PIECE ? cap - done : COPY_PIECE;
        const ssize_t got = pread(fd, (uint8_t *)dst + done, want, (off_t)(off + done));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return kvz_error_set(KVZ_ERR_IO, "kvz_store: reading %s from data.mdb: %s", what, strerror(errno));
        if (got == 0) return damaged("%s: data.mdb ends at byte %llu, inside it (the file is shorter than its B-tree says)",
                                     what, (unsigned long long)(off + done));
        done += (size_t)got;
        if (piece) {
            const int rc = piece(user, done);
            if (rc) return rc;
        }
    }
    return 0;
}

int kvz_store_copy_layer(kvz_store_read *r, const uint8_t hash[16], uint32_t l, void *dst, size_t cap, size_t *len,
                         kvz_store_piece_fn piece, void *user)
{
    if (!r) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    if (l == KVZ_BLOB_META_LAYER) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: bad layer index");
    return copy_record(r, r->s->blobs, 0, hash, l, dst, cap, len, piece, user);
}

typedef struct {
    size_t cap;
    kvz_store_piece_fn piece;
    void *user;
    int rc;
} map_pieces_ctx;

static int map_pieces_fn(void *vc)
{
    map_pieces_ctx *c = vc;
    for (size_t done = 0; done < c->cap && !c->rc;) {
        done += c->cap - done < COPY_PIECE ? c->cap - done : COPY_PIECE;
        c->rc = c->piece(c->user, done);
    }
    return 0;
}

/* LAYER record @p l of @p hash in the map when it is @p cap bytes long (else *rec NULL,
 * *len its length), after the checks that it lies inside data.mdb; @p what names it */
static int map_record(kvz_store_read *r, const uint8_t hash[16], uint32_t l, size_t cap, const uint8_t **rec,
                      size_t *len, char what[400])
{
    *rec = NULL;
    *len = 0;
    getval_ctx g;
    const int frc = find_record(r, r->s->blobs, 0, hash, l, &g, what);
    if (frc) return frc;
    *len = g.v.mv_size;
    if (g.v.mv_size != cap) return 0; /* not the record the caller expects */
    uint64_t off;
    int fd;
    struct stat st;
    if (map_offset(r->s, g.v.mv_data, g.v.mv_size, &off) || mdb_env_get_fd(r->s->env, &fd) || fstat(fd, &st))
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "kvz_store: the map of data.mdb is not found in /proc/self/maps");
    if ((uint64_t)st.st_size < off + cap)
        return damaged("%s: data.mdb ends at byte %llu, inside it (the file is shorter than its B-tree says)", what,
                       (unsigned long long)st.st_size);
    *rec = g.v.mv_data;
    return 0;
}

int kvz_store_map_layer(kvz_store_read *r, const uint8_t hash[16], uint32_t l, size_t cap, const uint8_t **rec,
                        size_t *len, kvz_store_piece_fn piece, void *user)
{
    if (!r || !hash || !rec || !len || !piece) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    if (l == KVZ_BLOB_META_LAYER) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: bad layer index");
    char what[400];
    int rc = map_record(r, hash, l, cap, rec, len, what);
    if (rc || !*rec) {
        *rec = NULL;
        return rc;
    }
    map_pieces_ctx c = {cap, piece, user, 0};
    int sig = 0;
    if (guarded(map_pieces_fn, &c, &sig) == FAULT_INTERNAL) {
        char w2[440];
        snprintf(w2, sizeof w2, "reading %s", what);
        *rec = NULL;
        return fault_err(sig, w2);
    }
    if (c.rc) *rec = NULL;
    return c.rc;
}

typedef struct {
    const uint8_t *src;
    void *dst;
    size_t n;
} peek_ctx;

static int peek_fn(void *vc)
{
    peek_ctx *c = vc;
    memcpy(c->dst, c->src, c->n);
    return 0;
}

int kvz_store_map_peek(kvz_store_read *r, const uint8_t hash[16], uint32_t l, size_t cap, const uint8_t **rec,
                       size_t *len, void *head, size_t head_len)
{
    if (!r || !hash || !rec || !len || (head_len && !head)) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    if (l == KVZ_BLOB_META_LAYER) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: bad layer index");
    char what[400];
    int rc = map_record(r, hash, l, cap, rec, len, what);
    if (rc || !*rec) {
        *rec = NULL;
        return rc;
    }
    peek_ctx c = {*rec, head, head_len < cap ? head_len : cap};
    int sig = 0;
    if (c.n && guarded(peek_fn, &c, &sig) == FAULT_INTERNAL) {
        char w2[440];
        snprintf(w2, sizeof w2, "reading %s", what);
        *rec = NULL;
        return fault_err(sig, w2);
    }
    return 0;
}

#define PIN_CHUNK ((uintptr_t)64 << 20) /* pins are whole 64 MiB pieces of the map (the file's end cuts the last) */

int kvz_store_pin(kvz_store_read *r, const void *p, size_t n, const kvz_store_pinner *pinner, size_t *cuts,
                  int max_cuts, int *n_cuts)
{
    if (!r || !p || !n || !pinner || !pinner->pin || !pinner->unpin || (max_cuts && !cuts))
        return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    if (n_cuts) *n_cuts = 0;
    kvz_store *s = r->s;
    int fd;
    struct stat st;
    uint64_t off;
    if (map_offset(s, p, n, &off) || mdb_env_get_fd(s->env, &fd) || fstat(fd, &st))
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "kvz_store: the map of data.mdb is not found in /proc/self/maps");
    const uintptr_t a = (uintptr_t)p, b = a + n, base = a - (uintptr_t)off; /* the map of file byte 0 */
    const long pg = sysconf(_SC_PAGESIZE);
    const uintptr_t ps = pg > 0 ? (uintptr_t)pg : 4096;
    const uintptr_t fend = base + ((uintptr_t)st.st_size & ~(ps - 1)); /* LMDB writes whole pages */
    if (a < base || b > fend) return kvz_error_set(KVZ_ERR_UNSUPPORTED, "kvz_store: the range is not in the data file");
    int err = 0;
    pthread_mutex_lock(&s->map_mu);
    if (s->n_pin_h && (s->pin_base != base || s->pinner.pin != pinner->pin || s->pinner.unpin != pinner->unpin))
        err = kvz_error_set(KVZ_ERR_UNSUPPORTED, "kvz_store: the map is pinned by another pinner");
    const size_t c1 = (size_t)((b - 1 - base) / PIN_CHUNK);
    if (!err && c1 >= s->n_pin_chunk) { /* room for the chunks up to the file's end */
        const size_t want = (size_t)((fend - 1 - base) / PIN_CHUNK) + 1;
        uintptr_t *e = realloc(s->pin_end, want * sizeof *e);
        if (!e) err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: pin table");
        else {
            memset(e + s->n_pin_chunk, 0, (want - s->n_pin_chunk) * sizeof *e);
            s->pin_end = e;
            s->n_pin_chunk = want;
        }
    }
    if (!err && !s->n_pin_h) {
        s->pinner = *pinner;
        s->pin_base = base;
    }
    for (size_t c = (size_t)((a - base) / PIN_CHUNK); !err && c <= c1; c++) {
        const uintptr_t lo = base + c * PIN_CHUNK;
        const uintptr_t hi = lo + PIN_CHUNK < fend ? lo + PIN_CHUNK : fend;
        const uintptr_t need = b < hi ? b : hi;
        const uintptr_t from = s->pin_end[c] ? s->pin_end[c] : lo;
        if (from >= need) continue; /* pinned already */
        if (s->pinned + (hi - from) > pinner->budget) {
            err = kvz_error_set(KVZ_ERR_FULL, "kvz_store: pinning %llu more bytes of the map would pass the budget of "
                                "%llu", (unsigned long long)(hi - from), (unsigned long long)pinner->budget);
            break;
        }
        if (s->n_pin_h == s->cap_pin_h) {
            const size_t cap = s->cap_pin_h ? 2 * s->cap_pin_h : 64;
            void **h = realloc(s->pin_h, cap * sizeof *h);
            if (h) s->pin_h = h;
            uintptr_t *lo2 = h ? realloc(s->pin_lo, cap * sizeof *lo2) : NULL;
            if (lo2) s->pin_lo = lo2;
            if (!h || !lo2) {
                err = kvz_error_set(KVZ_ERR_NOMEM, "kvz_store: pin table");
                break;
            }
            s->cap_pin_h = cap;
        }
        void *h = NULL;
        if ((err = pinner->pin((const void *)from, hi - from, &h))) break;
        s->pin_lo[s->n_pin_h] = from;
        s->pin_h[s->n_pin_h++] = h;
        s->pin_end[c] = hi;
        s->pinned += hi - from;
    }
    int nc = 0; /* the pins that start inside the range: an upload copies each piece on its own */
    for (size_t i = 0; !err && i < s->n_pin_h; i++) {
        if (s->pin_lo[i] <= a || s->pin_lo[i] >= b) continue;
        if (nc >= max_cuts) {
            err = kvz_error_set(KVZ_ERR_UNSUPPORTED, "kvz_store: the range crosses more than %d pins", max_cuts);
            break;
        }
        cuts[nc++] = (size_t)(s->pin_lo[i] - a);
    }
    pthread_mutex_unlock(&s->map_mu);
    if (!err && n_cuts) {
        for (int i = 1; i < nc; i++) /* ascending */
            for (int k = i; k > 0 && cuts[k - 1] > cuts[k]; k--) {
                const size_t t = cuts[k];
                cuts[k] = cuts[k - 1];
                cuts[k - 1] = t;
            }
        *n_cuts = nc;
    }
    return err;
}

uint64_t kvz_store_pinned_bytes(kvz_store *s)
{
    if (!s) return 0;
    pthread_mutex_lock(&s->map_mu);
    const uint64_t n = s->pinned;
    pthread_mutex_unlock(&s->map_mu);
    return n;
}

int kvz_store_copy_prefix(kvz_store_read *r, const uint8_t hash[16], uint32_t l, void *dst, size_t cap,
                          size_t *len, kvz_store_piece_fn piece, void *user)
{
    if (!r || !len) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: NULL argument");
    if (l == KVZ_BLOB_META_LAYER) return kvz_error_set(KVZ_ERR_ARG, "kvz_store: bad layer index");
    MDB_dbi dbi;
    const int err = prefix_dbi(r->s, r->txn, 0, &dbi);
    if (err < 0) return err;
    if (err == 1) {
        char hx[33];
        hex16(hash, hx);
        *len = 0;
        return kvz_error_set(KVZ_ERR_NOTFOUND, "kvz_store: shared prefix %s: no record %08x", hx, l);
    }
    return copy_record(r, dbi, 1, hash, l, dst, cap, len, piece, user);
}
