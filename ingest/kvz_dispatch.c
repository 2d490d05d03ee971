/* kvz_dispatch.c — worker processes for kvzip-ingest --workers / --gpus (kvz_dispatch.h). */
#include "kvz_dispatch.h"

#include "kvz_backend.h" /* kvz_backend_gpu_count */
#include "kvz_error.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAGIC "KVZCLAIM"
#define HDR 32  /* magic[8], n u64, claimed u64, list offset u64 */

typedef struct {
    char magic[8];
    uint64_t n;
    uint64_t claimed;
    uint64_t list_off;
} hdr;

struct kvz_claims {
    void *map;
    size_t len;
    hdr *h;
    uint32_t *claim;
    const char **path, **id;
    uint8_t *named;
    uint32_t me;
};

static hdr *g_parent_hdr; /* for kvz_dispatch_claimed() during a run */

uint64_t kvz_dispatch_claimed(void)
{
    return g_parent_hdr ? __atomic_load_n(&g_parent_hdr->claimed, __ATOMIC_RELAXED) : 0;
}

static int cmp_doc(const void *a, const void *b)
{
    const kvz_dispatch_doc *x = a, *y = b;
    if (x->size != y->size) return x->size < y->size ? 1 : -1;
    return strcmp(x->id, y->id);
}

/* One worker's pipe reader: partial line kept until its newline. */
typedef struct {
    int fd, w, is_out;
    char *buf;
    size_t n, cap;
} reader;

static void flush_lines(reader *r, const kvz_dispatch_opts *o, int final)
{
    size_t start = 0;
    for (size_t i = 0; i < r->n; i++) {
        if (r->buf[i] != '\n' && r->buf[i] != '\r') continue;
        r->buf[i] = 0;
        if (i > start && o->on_line) o->on_line(o->user, r->w, r->is_out, r->buf + start);
        start = i + 1;
    }
    if (final && start < r->n) {
        if (r->n == r->cap) { char *b = realloc(r->buf, r->cap + 1); if (!b) return; r->buf = b; r->cap++; }
        r->buf[r->n] = 0;
        if (o->on_line) o->on_line(o->user, r->w, r->is_out, r->buf + start);
        start = r->n;
    }
    memmove(r->buf, r->buf + start, r->n - start);
    r->n -= start;
}

int kvz_dispatch_run(kvz_dispatch_doc *docs, size_t n, const kvz_dispatch_opts *o,
                     kvz_dispatch_worker *out)
{
    if (!o || !o->exe || !o->argv || !o->device || o->n_workers < 1 ||
        o->n_workers > KVZ_DISPATCH_MAX_WORKERS || (n && !docs))
        return kvz_error_set(KVZ_ERR_ARG, "dispatch: bad arguments");
    const int W = o->n_workers;
    if (n) qsort(docs, n, sizeof *docs, cmp_doc);
    /* the shared list */
    size_t list = 0;
    for (size_t i = 0; i < n; i++) list += 1 + strlen(docs[i].path) + 1 + strlen(docs[i].id) + 1;
    const size_t off = HDR + ((n * 4 + 7) & ~(size_t)7), total = off + list;
    int fd = memfd_create("kvzip-claims", 0); /* inherited by the workers */
    if (fd < 0) return kvz_error_set(KVZ_ERR_IO, "dispatch: memfd_create: %s", strerror(errno));
    if (ftruncate(fd, (off_t)total)) {
        int e = errno;
        close(fd);
        return kvz_error_set(KVZ_ERR_IO, "dispatch: ftruncate: %s", strerror(e));
    }
    uint8_t *map = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        int e = errno;
        close(fd);
        return kvz_error_set(KVZ_ERR_IO, "dispatch: mmap: %s", strerror(e));
    }
    hdr *h = (hdr *)map;
    memcpy(h->magic, MAGIC, 8);
    h->n = n;
    h->claimed = 0;
    h->list_off = off;
    uint8_t *p = map + off;
    for (size_t i = 0; i < n; i++) {
        *p++ = (uint8_t)(docs[i].named != 0);
        size_t a = strlen(docs[i].path) + 1, b = strlen(docs[i].id) + 1;
        memcpy(p, docs[i].path, a);
        p += a;
        memcpy(p, docs[i].id, b);
        p += b;
    }
    g_parent_hdr = h;

    /* worker argv: common args + --device D [--threads T] --claim-fd FD --worker-tag W */
    size_t na = 0;
    while (o->argv[na]) na++;
    const char **av = calloc(na + 12, sizeof *av);
    reader *rd = calloc((size_t)W * 2, sizeof *rd);
    pid_t *pids = calloc((size_t)W, sizeof *pids);
    int err = 0, started = 0;
    if (!av || !rd || !pids) { err = kvz_error_set(KVZ_ERR_NOMEM, "dispatch"); goto out; }
    char fdbuf[16], thbuf[16];
    snprintf(fdbuf, sizeof fdbuf, "%d", fd);
    snprintf(thbuf, sizeof thbuf, "%d", o->threads);
    for (int w = 0; w < W; w++) {
        int po[2], pe[2];
        if (pipe2(po, O_CLOEXEC)) { err = kvz_error_set(KVZ_ERR_IO, "dispatch: pipe: %s", strerror(errno)); break; }
        if (pipe2(pe, O_CLOEXEC)) {
            err = kvz_error_set(KVZ_ERR_IO, "dispatch: pipe: %s", strerror(errno));
            close(po[0]); close(po[1]);
            break;
        }
        char tag[16];
        snprintf(tag, sizeof tag, "%d", w);
        size_t k = 0;
        for (size_t i = 0; i < na; i++) av[k++] = o->argv[i];
        av[k++] = "--device";
        av[k++] = o->device[w];
        if (o->threads > 0) { av[k++] = "--threads"; av[k++] = thbuf; }
        av[k++] = "--claim-fd";
        av[k++] = fdbuf;
        av[k++] = "--worker-tag";
        av[k++] = tag;
        av[k] = NULL;
        fflush(NULL);
        pid_t pid = fork();
        if (pid < 0) {
            err = kvz_error_set(KVZ_ERR_IO, "dispatch: fork: %s", strerror(errno));
            close(po[0]); close(po[1]); close(pe[0]); close(pe[1]);
            break;
        }
        if (pid == 0) {
            dup2(po[1], 1);
            dup2(pe[1], 2);
            execv(o->exe, (char *const *)av);
            fprintf(stderr, "cannot run %s: %s\n", o->exe, strerror(errno));
            _exit(127);
        }
        close(po[1]);
        close(pe[1]);
        pids[w] = pid;
        rd[2 * w] = (reader){po[0], w, 1, NULL, 0, 0};
        rd[2 * w + 1] = (reader){pe[0], w, 0, NULL, 0, 0};
        started++;
    }
    /* forward output until every pipe is closed */
    struct pollfd *pf = calloc((size_t)W * 2, sizeof *pf);
    int *map_idx = calloc((size_t)W * 2, sizeof *map_idx);
    if (!pf || !map_idx) {
        if (!err) err = kvz_error_set(KVZ_ERR_NOMEM, "dispatch");
    }
    for (;;) {
        int np = 0;
        for (int i = 0; pf && map_idx && i < started * 2; i++)
            if (rd[i].fd >= 0) {
                pf[np] = (struct pollfd){rd[i].fd, POLLIN, 0};
                map_idx[np++] = i;
            }
        if (np == 0) break;
        if (poll(pf, (nfds_t)np, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        for (int j = 0; j < np; j++) {
            if (!(pf[j].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            reader *r = &rd[map_idx[j]];
            if (r->cap - r->n < 4096) {
                size_t cap = r->cap ? r->cap * 2 : 8192;
                char *b = realloc(r->buf, cap);
                if (!b) { close(r->fd); r->fd = -1; continue; }
                r->buf = b;
                r->cap = cap;
            }
            ssize_t got = read(r->fd, r->buf + r->n, r->cap - r->n - 1);
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) {
                flush_lines(r, o, 1);
                close(r->fd);
                r->fd = -1;
                continue;
            }
            r->n += (size_t)got;
            flush_lines(r, o, 0);
        }
    }
    free(pf);
    free(map_idx);
    for (int w = 0; w < started; w++) {
        int st = 0;
        while (waitpid(pids[w], &st, 0) < 0 && errno == EINTR) {}
        if (out) {
            out[w].pid = pids[w];
            out[w].exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
            out[w].signal = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
            out[w].claimed = 0;
        }
    }
    if (out) {
        uint32_t *claim = (uint32_t *)(map + HDR);
        for (size_t i = 0; i < n; i++)
            if (claim[i] && claim[i] <= (uint32_t)started) out[claim[i] - 1].claimed++;
    }
out:
    for (int i = 0; rd && i < started * 2; i++) {
        if (rd[i].fd >= 0) close(rd[i].fd);
        free(rd[i].buf);
    }
    g_parent_hdr = NULL;
    munmap(map, total);
    close(fd);
    free(av);
    free(rd);
    free(pids);
    return err;
}

int kvz_claims_open(int fd, int worker, kvz_claims **out)
{
    if (!out || fd < 0 || worker < 0 || worker >= KVZ_DISPATCH_MAX_WORKERS)
        return kvz_error_set(KVZ_ERR_ARG, "--claim-fd: bad arguments");
    *out = NULL;
    struct stat st;
    if (fstat(fd, &st)) return kvz_error_set(KVZ_ERR_IO, "--claim-fd %d: %s", fd, strerror(errno));
    if ((size_t)st.st_size < HDR) return kvz_error_set(KVZ_ERR_ARG, "--claim-fd %d: not a document list", fd);
    kvz_claims *c = calloc(1, sizeof *c);
    if (!c) return kvz_error_set(KVZ_ERR_NOMEM, "claims");
    c->len = (size_t)st.st_size;
    c->map = mmap(NULL, c->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (c->map == MAP_FAILED) {
        free(c);
        return kvz_error_set(KVZ_ERR_IO, "--claim-fd %d: mmap: %s", fd, strerror(errno));
    }
    c->h = c->map;
    const uint64_t n = c->h->n;
    if (memcmp(c->h->magic, MAGIC, 8) || c->h->list_off < HDR + n * 4 || c->h->list_off > c->len) {
        kvz_claims_close(c);
        return kvz_error_set(KVZ_ERR_ARG, "--claim-fd %d: not a document list", fd);
    }
    c->claim = (uint32_t *)((uint8_t *)c->map + HDR);
    c->path = calloc(n ? n : 1, sizeof *c->path);
    c->id = calloc(n ? n : 1, sizeof *c->id);
    c->named = calloc(n ? n : 1, 1);
    if (!c->path || !c->id || !c->named) { kvz_claims_close(c); return kvz_error_set(KVZ_ERR_NOMEM, "claims"); }
    const char *p = (const char *)c->map + c->h->list_off, *end = (const char *)c->map + c->len;
    for (uint64_t i = 0; i < n; i++) {
        if (p >= end) goto bad;
        c->named[i] = (uint8_t)*p++;
        const char *z = memchr(p, 0, (size_t)(end - p));
        if (!z) goto bad;
        c->path[i] = p;
        p = z + 1;
        z = p < end ? memchr(p, 0, (size_t)(end - p)) : NULL;
        if (!z) goto bad;
        c->id[i] = p;
        p = z + 1;
    }
    c->me = (uint32_t)worker + 1;
    *out = c;
    return 0;
bad:
    kvz_claims_close(c);
    return kvz_error_set(KVZ_ERR_ARG, "--claim-fd %d: document list is cut short", fd);
}

size_t kvz_claims_count(const kvz_claims *c) { return c ? (size_t)c->h->n : 0; }

void kvz_claims_doc(const kvz_claims *c, size_t i, const char **path, const char **id, int *named)
{
    *path = c->path[i];
    *id = c->id[i];
    *named = c->named[i];
}

int kvz_claims_take(kvz_claims *c, size_t i)
{
    if (!c || i >= c->h->n) return 0;
    uint32_t zero = 0;
    if (!__atomic_compare_exchange_n(&c->claim[i], &zero, c->me, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return 0;
    __atomic_add_fetch(&c->h->claimed, 1, __ATOMIC_RELAXED);
    return 1;
}

void kvz_claims_close(kvz_claims *c)
{
    if (!c) return;
    if (c->map && c->map != MAP_FAILED) munmap(c->map, c->len);
    free(c->path);
    free(c->id);
    free(c->named);
    free(c);
}

int kvz_dispatch_gpu_count(int *n) { return kvz_backend_gpu_count(n); }

int kvz_dispatch_gpus(long want, int *workers)
{
    int have = 0;
    const int rc = kvz_backend_gpu_count(&have);
    if (rc) return rc;
    if (want > have)
        return kvz_error_set(KVZ_ERR_NODEV, "this host has %d usable GPU%s", have, have == 1 ? "" : "s");
    *workers = want > 0 ? (int)want : have;
    return 0;
}
