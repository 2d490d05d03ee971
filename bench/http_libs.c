/* HTTP library bench for kvzip-serve: libmicrohttpd vs civetweb vs h2o (Debian packages).
 *
 * One run of this program measures all three. Each library serves from its own forked
 * child process (so its CPU time and memory are its own, read with getrusage in the
 * child), on 127.0.0.1 at an ephemeral port, configured the way kvzip-serve needs it:
 *   POST /json  : read a 1,024-byte JSON body, answer 200 with a 400-byte JSON reply
 *   POST /sse   : read the body, answer 200 text/event-stream: 64 chunks of 80 bytes,
 *                 --delay-ms between chunks (token streaming), chunked encoding
 *   POST /cut   : as /sse with --cut-delay-ms between chunks; the client hangs up after
 *                 8 chunks and the bench times how long the server takes to notice
 * The parent is the client: plain sockets, HTTP/1.1 keep-alive, N concurrent
 * connections (one thread each) for a fixed time. Libraries are interleaved
 * (A B C, A B C, ...) for --rounds rounds; the table gives the median and the spread.
 *
 * How each server is set up (as kvzip-serve would use it):
 *   microhttpd: MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD (what
 *     serve/kvz_serve.c uses); the stream is a content-reader callback that sleeps
 *     between chunks; the end of a stream is seen in the response's free callback
 *     (kvzip-serve adds MHD_USE_ERROR_LOG; left out here so the disconnect test's
 *     expected send failures do not print).
 *   civetweb: a worker pool (num_threads = connections + 8, since a keep-alive
 *     connection holds its worker) and tcp_nodelay; the handler writes each reply
 *     and each chunk with one mg_write and sleeps between chunks; a failed write is
 *     the disconnect notice.
 *   h2o (libh2o-evloop): one event-loop thread; the stream is a generator whose proceed
 *     callback arms an h2o timeout for the next chunk; the generator's stop callback is
 *     the disconnect notice.
 *
 * Run: build/bin/http_libs [--seconds S] [--rounds R] [--conc 1,16,64] [--delay-ms D]
 *      [--cut-delay-ms D] [--cuts K] [--libs mhd,civetweb,h2o]
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ctype.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <civetweb.h>
#include <microhttpd.h>
#define H2O_USE_EPOLL 1
#include <h2o.h>

#define BODY_LEN 1024
#define REPLY_LEN 400
#define CHUNK_LEN 80
#define NCHUNKS 64
#define CUT_AFTER 8

static char g_body[BODY_LEN + 1], g_reply[REPLY_LEN + 1], g_chunk[CHUNK_LEN + 1];
static int g_delay_ms = 2, g_cut_delay_ms = 20;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

/* Fill s[0..n) with a JSON-looking text of exactly n bytes (pad inside a string). */
static void make_text(char *s, size_t n, const char *head, const char *tail)
{
    size_t h = strlen(head), t = strlen(tail);
    memcpy(s, head, h);
    for (size_t i = h; i < n - t; i++) s[i] = (char)('a' + i % 26);
    memcpy(s + n - t, tail, t);
    s[n] = 0;
}

/* ---------------- server side (runs in a child process) ---------------- */

/* what the child tells the parent on request */
typedef struct {
    double cpu_s;       /* user + system CPU of the whole server process */
    long maxrss_kb;     /* VmHWM: peak RSS of this process image */
    long rss_kb;        /* VmRSS now */
    long threads;       /* Threads now */
    uint64_t served;    /* requests answered in full */
    uint64_t aborts;    /* streams ended early (client gone) */
    int64_t last_abort; /* CLOCK_MONOTONIC ns of the latest abort notice */
    uint64_t bad;       /* requests with a wrong body */
} srv_stats;

static atomic_uint_fast64_t s_served, s_aborts, s_bad;
static _Atomic int64_t s_last_abort;

static void note_abort(void)
{
    atomic_store(&s_last_abort, now_ns());
    atomic_fetch_add(&s_aborts, 1);
}

static int body_ok(const char *b, size_t n) { return n == BODY_LEN && b[0] == '{' && b[n - 1] == '}'; }

/* 0 json, 1 sse, 2 cut, -1 unknown */
static int route(const char *url)
{
    if (!strcmp(url, "/json")) return 0;
    if (!strcmp(url, "/sse")) return 1;
    if (!strcmp(url, "/cut")) return 2;
    return -1;
}

/* --- libmicrohttpd --- */
typedef struct {
    char body[BODY_LEN];
    size_t n;
    int over;
} mhd_req;

typedef struct {
    int sent, delay;
} mhd_stream;

static ssize_t mhd_read(void *cls, uint64_t pos, char *out, size_t max)
{
    (void)pos;
    mhd_stream *s = cls;
    if (s->sent == NCHUNKS) return MHD_CONTENT_READER_END_OF_STREAM;
    if (s->sent > 0 && s->delay > 0) sleep_ms(s->delay);
    if (max < CHUNK_LEN) return 0;
    memcpy(out, g_chunk, CHUNK_LEN);
    s->sent++;
    return CHUNK_LEN;
}

static void mhd_free(void *cls)
{
    mhd_stream *s = cls;
    if (s->sent < NCHUNKS) note_abort();
    else atomic_fetch_add(&s_served, 1);
    free(s);
}

static enum MHD_Result mhd_handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *data, size_t *size, void **con_cls)
{
    (void)cls, (void)version;
    mhd_req *r = *con_cls;
    if (!r) {
        if (!(r = calloc(1, sizeof *r))) return MHD_NO;
        *con_cls = r;
        return MHD_YES;
    }
    if (*size) {
        if (r->n + *size > BODY_LEN) r->over = 1;
        else memcpy(r->body + r->n, data, *size), r->n += *size;
        *size = 0;
        return MHD_YES;
    }
    int rt = route(url);
    if (strcmp(method, "POST") || rt < 0 || r->over || !body_ok(r->body, r->n)) {
        atomic_fetch_add(&s_bad, 1);
        static const char e[] = "{\"error\":\"bad request\"}";
        struct MHD_Response *x = MHD_create_response_from_buffer(sizeof e - 1, (void *)e, MHD_RESPMEM_PERSISTENT);
        enum MHD_Result ok = MHD_queue_response(c, 400, x);
        MHD_destroy_response(x);
        return ok;
    }
    struct MHD_Response *x;
    if (rt == 0) {
        x = MHD_create_response_from_buffer(REPLY_LEN, g_reply, MHD_RESPMEM_PERSISTENT);
        MHD_add_response_header(x, "Content-Type", "application/json");
        atomic_fetch_add(&s_served, 1);
    } else {
        mhd_stream *s = calloc(1, sizeof *s);
        if (!s) return MHD_NO;
        s->delay = rt == 1 ? g_delay_ms : g_cut_delay_ms;
        x = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, mhd_read, s, mhd_free);
        MHD_add_response_header(x, "Content-Type", "text/event-stream");
        MHD_add_response_header(x, "Cache-Control", "no-cache");
    }
    enum MHD_Result ok = MHD_queue_response(c, 200, x);
    MHD_destroy_response(x);
    return ok;
}

static void mhd_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode t)
{
    (void)cls, (void)c, (void)t;
    free(*con_cls);
    *con_cls = NULL;
}

static int mhd_start(int maxconn)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD, 0, NULL, NULL, mhd_handle,
        NULL, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&a, MHD_OPTION_NOTIFY_COMPLETED, mhd_completed, NULL,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)(maxconn + 8), MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)30,
        MHD_OPTION_END);
    if (!d) return -1;
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    return di ? di->port : -1;
}

/* --- civetweb --- */
static int cw_handle(struct mg_connection *c, void *cbdata)
{
    (void)cbdata;
    const struct mg_request_info *ri = mg_get_request_info(c);
    char body[BODY_LEN + 1];
    size_t n = 0;
    int k, over = 0;
    char sink[512];
    while (n < sizeof body && (k = mg_read(c, body + n, sizeof body - n)) > 0) n += (size_t)k;
    while ((k = mg_read(c, sink, sizeof sink)) > 0) over = 1;
    int rt = route(ri->local_uri);
    if (strcmp(ri->request_method, "POST") || rt < 0 || over || !body_ok(body, n)) {
        atomic_fetch_add(&s_bad, 1);
        static const char e[] = "{\"error\":\"bad request\"}";
        mg_printf(c, "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                  sizeof e - 1);
        mg_write(c, e, sizeof e - 1);
        return 400;
    }
    /* Each reply goes out in one mg_write: civetweb's own helpers (mg_send_http_ok,
     * mg_send_chunk) make one send() per header line or chunk part, which measured
     * 4-5x slower here with tcp_nodelay on. */
    char out[REPLY_LEN + 256];
    if (rt == 0) {
        int h = snprintf(out, sizeof out,
                         "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", REPLY_LEN);
        memcpy(out + h, g_reply, REPLY_LEN);
        mg_write(c, out, (size_t)h + REPLY_LEN);
        atomic_fetch_add(&s_served, 1);
        return 200;
    }
    const int delay = rt == 1 ? g_delay_ms : g_cut_delay_ms;
    static const char head[] = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                               "Transfer-Encoding: chunked\r\n\r\n";
    int n0 = snprintf(out, sizeof out, "%s", head), h;
    for (int i = 0; i < NCHUNKS; i++) {
        if (i > 0 && delay > 0) sleep_ms(delay);
        h = snprintf(out + n0, sizeof out - (size_t)n0, "%x\r\n", CHUNK_LEN);
        memcpy(out + n0 + h, g_chunk, CHUNK_LEN);
        size_t len = (size_t)n0 + (size_t)h + CHUNK_LEN;
        memcpy(out + len, "\r\n", 2);
        len += 2;
        if (i == NCHUNKS - 1) memcpy(out + len, "0\r\n\r\n", 5), len += 5;
        if (mg_write(c, out, len) <= 0) {
            note_abort();
            return 200;
        }
        n0 = 0;
    }
    atomic_fetch_add(&s_served, 1);
    return 200;
}

static int cw_start(int maxconn)
{
    mg_init_library(0);
    char threads[32];
    snprintf(threads, sizeof threads, "%d", maxconn + 8);
    const char *opt[] = {"listening_ports", "127.0.0.1:0", "num_threads", threads, "enable_keep_alive", "yes",
                         "keep_alive_timeout_ms", "30000", "request_timeout_ms", "30000",
                         /* without it a reply written as header + body waits ~40 ms for the delayed ACK */
                         "tcp_nodelay", "1", NULL};
    struct mg_callbacks cb;
    memset(&cb, 0, sizeof cb);
    struct mg_context *ctx = mg_start(&cb, NULL, opt);
    if (!ctx) return -1;
    mg_set_request_handler(ctx, "/json$", cw_handle, NULL);
    mg_set_request_handler(ctx, "/sse$", cw_handle, NULL);
    mg_set_request_handler(ctx, "/cut$", cw_handle, NULL);
    struct mg_server_port p[4];
    int np = mg_get_server_ports(ctx, 4, p);
    return np > 0 ? p[0].port : -1;
}

/* --- h2o (evloop) --- */
static h2o_globalconf_t h2_config;
static h2o_context_t h2_ctx;
static h2o_accept_ctx_t h2_accept;
static h2o_timeout_t h2_tmo_sse, h2_tmo_cut;

typedef struct {
    h2o_generator_t super;
    h2o_req_t *req;
    h2o_timeout_entry_t timer;
    h2o_timeout_t *tmo;
    int sent;
} h2_stream;

static void h2_send_next(h2_stream *s)
{
    h2o_iovec_t b = h2o_iovec_init(g_chunk, CHUNK_LEN);
    s->sent++;
    const int last = s->sent == NCHUNKS;
    if (last) atomic_fetch_add(&s_served, 1);
    h2o_send(s->req, &b, 1, last ? H2O_SEND_STATE_FINAL : H2O_SEND_STATE_IN_PROGRESS);
}

static void h2_on_timer(h2o_timeout_entry_t *e) { h2_send_next(H2O_STRUCT_FROM_MEMBER(h2_stream, timer, e)); }

static void h2_proceed(h2o_generator_t *g, h2o_req_t *req)
{
    (void)req;
    h2_stream *s = (h2_stream *)g;
    h2o_timeout_link(h2_ctx.loop, s->tmo, &s->timer);
}

static void h2_stop(h2o_generator_t *g, h2o_req_t *req)
{
    (void)req;
    h2_stream *s = (h2_stream *)g;
    if (h2o_timeout_is_linked(&s->timer)) h2o_timeout_unlink(&s->timer);
    if (s->sent < NCHUNKS) note_abort();
}

static int h2_handle(h2o_handler_t *self, h2o_req_t *req)
{
    (void)self;
    char path[16] = "";
    if (req->path_normalized.len < sizeof path) {
        memcpy(path, req->path_normalized.base, req->path_normalized.len);
        path[req->path_normalized.len] = 0;
    }
    int rt = route(path);
    if (!h2o_memis(req->method.base, req->method.len, H2O_STRLIT("POST")) || rt < 0 ||
        !body_ok(req->entity.base ? req->entity.base : "", req->entity.len)) {
        atomic_fetch_add(&s_bad, 1);
        req->res.status = 400;
        req->res.reason = "Bad Request";
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL, H2O_STRLIT("application/json"));
        h2o_send_inline(req, H2O_STRLIT("{\"error\":\"bad request\"}"));
        return 0;
    }
    req->res.status = 200;
    req->res.reason = "OK";
    if (rt == 0) {
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL, H2O_STRLIT("application/json"));
        atomic_fetch_add(&s_served, 1);
        h2o_send_inline(req, g_reply, REPLY_LEN);
        return 0;
    }
    h2_stream *s = h2o_mem_alloc_pool(&req->pool, sizeof *s);
    memset(s, 0, sizeof *s);
    s->super.proceed = h2_proceed;
    s->super.stop = h2_stop;
    s->req = req;
    s->timer.cb = h2_on_timer;
    s->tmo = rt == 1 ? &h2_tmo_sse : &h2_tmo_cut;
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL, H2O_STRLIT("text/event-stream"));
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CACHE_CONTROL, NULL, H2O_STRLIT("no-cache"));
    h2o_start_response(req, &s->super);
    h2_send_next(s);
    return 0;
}

static void h2_on_accept(h2o_socket_t *listener, const char *err)
{
    if (err) return;
    h2o_socket_t *sock = h2o_evloop_socket_accept(listener);
    if (sock) h2o_accept(&h2_accept, sock);
}

static void *h2_loop(void *arg)
{
    (void)arg;
    for (;;) h2o_evloop_run(h2_ctx.loop, INT32_MAX);
    return NULL;
}

static int h2_start(int maxconn)
{
    (void)maxconn;
    h2o_config_init(&h2_config);
    h2o_hostconf_t *host = h2o_config_register_host(&h2_config, h2o_iovec_init(H2O_STRLIT("default")), 65535);
    h2o_pathconf_t *pc = h2o_config_register_path(host, "/", 0);
    h2o_handler_t *h = h2o_create_handler(pc, sizeof *h);
    h->on_req = h2_handle;
    h2o_context_init(&h2_ctx, h2o_evloop_create(), &h2_config);
    h2o_timeout_init(h2_ctx.loop, &h2_tmo_sse, (uint64_t)g_delay_ms);
    h2o_timeout_init(h2_ctx.loop, &h2_tmo_cut, (uint64_t)g_cut_delay_ms);
    h2_accept.ctx = &h2_ctx;
    h2_accept.hosts = h2_config.hosts;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
        bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 1024) || getsockname(fd, (struct sockaddr *)&a, &al))
        return -1;
    h2o_socket_t *ls = h2o_evloop_socket_create(h2_ctx.loop, fd, H2O_SOCKET_FLAG_DONT_READ);
    h2o_socket_read_start(ls, h2_on_accept);
    pthread_t t;
    if (pthread_create(&t, NULL, h2_loop, NULL)) return -1;
    return ntohs(a.sin_port);
}

static const char *const LIB_NAME[] = {"microhttpd", "civetweb", "h2o"};
static const char *const LIB_KEY[] = {"mhd", "civetweb", "h2o"};
static int (*const LIB_START[])(int) = {mhd_start, cw_start, h2_start};
#define NLIBS 3

static long proc_status_kb(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long v = -1;
    size_t kl = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl) && line[kl] == ':') {
            v = atol(line + kl + 1);
            break;
        }
    fclose(f);
    return v;
}

static int read_full(int fd, void *p, size_t n)
{
    for (size_t d = 0; d < n;) {
        ssize_t k = read(fd, (char *)p + d, n - d);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            return -1;
        }
        d += (size_t)k;
    }
    return 0;
}

static int write_full(int fd, const void *p, size_t n)
{
    for (size_t d = 0; d < n;) {
        ssize_t k = write(fd, (const char *)p + d, n - d);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            return -1;
        }
        d += (size_t)k;
    }
    return 0;
}

/* The child: start the server, send its port, then answer 's' (stats) until 'q'. */
static void child_main(int lib, int maxconn, int in, int out)
{
    int port = LIB_START[lib](maxconn);
    if (write_full(out, &port, sizeof port) || port <= 0) _exit(1);
    char cmd;
    while (!read_full(in, &cmd, 1) && cmd == 's') {
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        srv_stats st = {
            .cpu_s = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
                     ru.ru_stime.tv_usec * 1e-6,
            .maxrss_kb = proc_status_kb("VmHWM"), /* not ru_maxrss: Linux carries that over exec from the forked client */
            .rss_kb = proc_status_kb("VmRSS"),
            .threads = proc_status_kb("Threads"),
            .served = atomic_load(&s_served),
            .aborts = atomic_load(&s_aborts),
            .last_abort = atomic_load(&s_last_abort),
            .bad = atomic_load(&s_bad),
        };
        if (write_full(out, &st, sizeof st)) break;
    }
    _exit(0); /* the server threads go with the process */
}

typedef struct {
    pid_t pid;
    int in, out, port;
} server;

static int server_start(server *s, int lib, int maxconn)
{
    int a[2], b[2];
    if (pipe(a) || pipe(b)) return -1;
    fflush(NULL);
    pid_t p = fork();
    if (p < 0) return -1;
    if (p == 0) {
        /* a fresh image, so the server's RSS holds nothing of the client's memory */
        close(a[1]);
        close(b[0]);
        char arg[6][16];
        const int v[6] = {lib, maxconn, g_delay_ms, g_cut_delay_ms, a[0], b[1]};
        for (int i = 0; i < 6; i++) snprintf(arg[i], sizeof arg[i], "%d", v[i]);
        execl("/proc/self/exe", "http_libs", "--serve-child", arg[0], arg[1], arg[2], arg[3], arg[4], arg[5],
              (char *)NULL);
        _exit(127);
    }
    close(a[0]);
    close(b[1]);
    s->pid = p;
    s->in = a[1];
    s->out = b[0];
    if (read_full(s->out, &s->port, sizeof s->port) || s->port <= 0) return -1;
    return 0;
}

static int server_stats(server *s, srv_stats *st)
{
    char c = 's';
    return write_full(s->in, &c, 1) || read_full(s->out, st, sizeof *st) ? -1 : 0;
}

static void server_stop(server *s)
{
    char c = 'q';
    (void)!write(s->in, &c, 1);
    close(s->in);
    close(s->out);
    int status;
    waitpid(s->pid, &status, 0);
}

/* ---------------- client side ---------------- */

typedef struct {
    int fd;
    char buf[16384];
    size_t off, len;
} conn;

static int conn_open(conn *c, int port)
{
    c->off = c->len = 0;
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0) return -1;
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv = {10, 0};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(c->fd, (struct sockaddr *)&a, sizeof a)) {
        close(c->fd);
        c->fd = -1;
        return -1;
    }
    return 0;
}

static void conn_close(conn *c)
{
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
}

/* make at least n bytes available at buf+off */
static int need(conn *c, size_t n)
{
    if (c->len - c->off >= n) return 0;
    if (c->off) {
        memmove(c->buf, c->buf + c->off, c->len - c->off);
        c->len -= c->off;
        c->off = 0;
    }
    if (n > sizeof c->buf) return -1;
    while (c->len < n) {
        ssize_t k = recv(c->fd, c->buf + c->len, sizeof c->buf - c->len, 0);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            return -1;
        }
        c->len += (size_t)k;
    }
    return 0;
}

/* a line ending in CRLF; returns its length without CRLF, or -1 */
static long read_line(conn *c, char **line)
{
    for (size_t scanned = 0;;) {
        char *b = c->buf + c->off;
        size_t have = c->len - c->off;
        for (size_t i = scanned; i + 1 < have; i++)
            if (b[i] == '\r' && b[i + 1] == '\n') {
                *line = b;
                c->off += i + 2;
                return (long)i;
            }
        scanned = have ? have - 1 : 0;
        if (need(c, have + 1)) return -1;
    }
}

static int send_request(conn *c, const char *path)
{
    char req[BODY_LEN + 256];
    int h = snprintf(req, sizeof req,
                     "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: %d\r\n\r\n",
                     path, BODY_LEN);
    memcpy(req + h, g_body, BODY_LEN);
    size_t n = (size_t)h + BODY_LEN;
    for (size_t d = 0; d < n;) {
        ssize_t k = send(c->fd, req + d, n - d, MSG_NOSIGNAL);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            return -1;
        }
        d += (size_t)k;
    }
    return 0;
}

/* Read one response. Returns the body length, or -1. *t_first: time the first body byte arrived.
 * stop_after > 0: return once that many body bytes came (the connection is then unusable). */
static long read_response(conn *c, int *status, int *closes, int64_t *t_first, long stop_after)
{
    char *l;
    long n = read_line(c, &l);
    if (n < 12 || strncmp(l, "HTTP/1.1 ", 9)) return -1;
    *status = atoi(l + 9);
    long clen = -1;
    int chunked = 0;
    *closes = 0;
    while ((n = read_line(c, &l)) > 0) {
        if (n > 15 && !strncasecmp(l, "Content-Length:", 15)) clen = atol(l + 15);
        else if (n > 18 && !strncasecmp(l, "Transfer-Encoding:", 18)) {
            for (long i = 18; i + 7 <= n; i++)
                if (!strncasecmp(l + i, "chunked", 7)) chunked = 1;
        } else if (n > 11 && !strncasecmp(l, "Connection:", 11)) {
            for (long i = 11; i + 5 <= n; i++)
                if (!strncasecmp(l + i, "close", 5)) *closes = 1;
        }
    }
    if (n < 0) return -1;
    long got = 0;
    if (!chunked) {
        if (clen < 0) return -1;
        if (clen > 0) {
            if (need(c, 1)) return -1;
            *t_first = now_ns();
        }
        while (got < clen) {
            size_t want = (size_t)(clen - got) < sizeof c->buf ? (size_t)(clen - got) : sizeof c->buf;
            if (need(c, want)) return -1;
            c->off += want;
            got += (long)want;
        }
        return got;
    }
    for (;;) {
        if ((n = read_line(c, &l)) <= 0) return -1;
        long sz = strtol(l, NULL, 16);
        if (sz < 0) return -1;
        if (sz == 0) {
            while ((n = read_line(c, &l)) > 0) { /* trailers */
            }
            return n < 0 ? -1 : got;
        }
        if (got == 0) *t_first = now_ns();
        while (sz > 0) {
            size_t want = (size_t)sz < sizeof c->buf ? (size_t)sz : sizeof c->buf;
            if (need(c, want)) return -1;
            c->off += want;
            sz -= (long)want;
            got += (long)want;
        }
        if (need(c, 2) || c->buf[c->off] != '\r' || c->buf[c->off + 1] != '\n') return -1;
        c->off += 2;
        if (stop_after > 0 && got >= stop_after) return got;
    }
}

typedef struct {
    int port, sse;
    int64_t t_start, t_end; /* requests that end inside [t_start, t_end] count; none starts after t_end */
    double *lat, *ttfb;     /* seconds */
    size_t n, cap;
    long errors, reconnects;
} worker;

static atomic_int g_go;

static void *worker_main(void *arg)
{
    worker *w = arg;
    conn c = {.fd = -1};
    const char *path = w->sse ? "/sse" : "/json";
    const long expect = w->sse ? NCHUNKS * CHUNK_LEN : REPLY_LEN;
    while (!atomic_load(&g_go)) {
    }
    for (;;) {
        int64_t t0 = now_ns();
        if (t0 >= w->t_end) break;
        if (c.fd < 0) {
            if (conn_open(&c, w->port)) {
                w->errors++;
                sleep_ms(10);
                continue;
            }
            if (t0 >= w->t_start) w->reconnects++;
        }
        int status = 0, closes = 0;
        int64_t tf = 0;
        long got = -1;
        if (!send_request(&c, path)) got = read_response(&c, &status, &closes, &tf, 0);
        int64_t t1 = now_ns();
        if (got != expect || status != 200) {
            w->errors++;
            conn_close(&c);
            continue;
        }
        if (closes) conn_close(&c);
        if (t1 < w->t_start || t1 > w->t_end) continue; /* warm-up, or past the end */
        if (w->n == w->cap) {
            w->cap = w->cap ? 2 * w->cap : 4096;
            w->lat = realloc(w->lat, w->cap * sizeof *w->lat);
            w->ttfb = realloc(w->ttfb, w->cap * sizeof *w->ttfb);
            if (!w->lat || !w->ttfb) abort();
        }
        w->lat[w->n] = (double)(t1 - t0) * 1e-9;
        w->ttfb[w->n] = (double)(tf - t0) * 1e-9;
        w->n++;
    }
    conn_close(&c);
    return NULL;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, size_t n, double p)
{
    if (!n) return 0;
    size_t i = (size_t)(p * (double)(n - 1) + 0.5);
    return v[i];
}

typedef struct {
    double rps, p50, p99, ttfc50, ttfc99, cpu_us, maxrss_mb, rss_mb;
    long errors, reconnects, threads, bad; /* threads: the server's, sampled once all connections are open */
} load_res;

static int run_load(server *s, int sse, int conc, double secs, load_res *r)
{
    worker *w = calloc((size_t)conc, sizeof *w);
    pthread_t *t = calloc((size_t)conc, sizeof *t);
    if (!w || !t) return -1;
    const double warm = 0.3;
    int64_t t0 = now_ns();
    atomic_store(&g_go, 0);
    for (int i = 0; i < conc; i++) {
        w[i] = (worker){.port = s->port, .sse = sse, .t_start = t0 + (int64_t)(warm * 1e9),
                        .t_end = t0 + (int64_t)((warm + secs) * 1e9)};
        if (pthread_create(&t[i], NULL, worker_main, &w[i])) return -1;
    }
    srv_stats a, b;
    atomic_store(&g_go, 1);
    sleep_ms((int)(warm * 1000));
    if (server_stats(s, &a)) return -1;
    int64_t ta = now_ns();
    for (int i = 0; i < conc; i++) pthread_join(t[i], NULL);
    /* the requests in flight at t_end finish inside the join (not counted for the client figures) */
    if (server_stats(s, &b)) return -1;
    int64_t tb = now_ns();
    size_t n = 0;
    long err = 0, rec = 0;
    for (int i = 0; i < conc; i++) n += w[i].n, err += w[i].errors, rec += w[i].reconnects;
    double *lat = malloc((n + 1) * sizeof *lat), *tf = malloc((n + 1) * sizeof *tf);
    size_t k = 0;
    for (int i = 0; i < conc; i++) {
        memcpy(lat + k, w[i].lat, w[i].n * sizeof *lat);
        memcpy(tf + k, w[i].ttfb, w[i].n * sizeof *tf);
        k += w[i].n;
        free(w[i].lat);
        free(w[i].ttfb);
    }
    qsort(lat, n, sizeof *lat, cmp_d);
    qsort(tf, n, sizeof *tf, cmp_d);
    (void)ta, (void)tb;
    r->rps = (double)n / secs;
    r->p50 = pct(lat, n, 0.50);
    r->p99 = pct(lat, n, 0.99);
    r->ttfc50 = pct(tf, n, 0.50);
    r->ttfc99 = pct(tf, n, 0.99);
    /* server CPU per answered request, over the same window the server counted */
    uint64_t served = b.served - a.served;
    r->cpu_us = served ? (b.cpu_s - a.cpu_s) / (double)served * 1e6 : 0;
    r->maxrss_mb = (double)b.maxrss_kb / 1024.0;
    r->rss_mb = (double)b.rss_kb / 1024.0;
    r->threads = a.threads;
    r->errors = err;
    r->reconnects = rec;
    r->bad = (long)(b.bad - a.bad);
    free(lat);
    free(tf);
    free(w);
    free(t);
    return 0;
}

/* One disconnect trial: read CUT_AFTER chunks of /cut, close, wait for the server's notice.
 * Returns the notice latency in seconds, or -1 (none within 3 s). */
static double cut_trial(server *s)
{
    srv_stats a, b;
    if (server_stats(s, &a)) return -1;
    conn c = {.fd = -1};
    if (conn_open(&c, s->port) || send_request(&c, "/cut")) {
        conn_close(&c);
        return -1;
    }
    int status, closes;
    int64_t tf = 0;
    long got = read_response(&c, &status, &closes, &tf, CUT_AFTER * CHUNK_LEN);
    int64_t tc = now_ns();
    conn_close(&c);
    if (got < CUT_AFTER * CHUNK_LEN) return -1;
    while (now_ns() - tc < 3000000000LL) {
        if (server_stats(s, &b)) return -1;
        if (b.aborts > a.aborts) return (double)(b.last_abort - tc) * 1e-9;
        sleep_ms(1);
    }
    return -1;
}

/* ---------------- main ---------------- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: http_libs [--seconds S] [--rounds R] [--conc LIST] [--delay-ms D] [--cut-delay-ms D]\n"
            "                 [--cuts K] [--libs LIST]\n"
            "Benchmarks libmicrohttpd, civetweb and h2o as kvzip-serve's HTTP layer (loopback only).\n"
            "  --seconds S       measured time per load point (default 3; plus 0.3 s warm-up)\n"
            "  --rounds R        interleaved rounds over the libraries (default 2)\n"
            "  --conc LIST       concurrent keep-alive connections (default 1,16,64)\n"
            "  --delay-ms D      pause between the 64 SSE chunks under load (default 2)\n"
            "  --cut-delay-ms D  pause between chunks in the disconnect test (default 20)\n"
            "  --cuts K          disconnect trials per library per round (default 5)\n"
            "  --libs LIST       any of mhd,civetweb,h2o (default all three, in that order)\n");
}

static void make_payloads(void)
{
    make_text(g_body, BODY_LEN, "{\"model\":\"kvzip\",\"documents\":[\"a.md\"],\"messages\":[{\"role\":\"user\",\"content\":\"",
              "\"}],\"max_tokens\":64}");
    make_text(g_reply, REPLY_LEN,
              "{\"id\":\"chatcmpl-kvzip-0\",\"object\":\"chat.completion\",\"choices\":[{\"index\":0,\"message\":"
              "{\"role\":\"assistant\",\"content\":\"",
              "\"},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":748,\"completion_tokens\":15}}");
    make_text(g_chunk, CHUNK_LEN, "data: {\"object\":\"chat.completion.chunk\",\"delta\":{\"content\":\"", "\"}}\n\n");
}

#define MAXC 8
#define MAXR 16
#define MAXCUT 32

static int cmp_lr_rps(const void *a, const void *b) { return cmp_d(&((const load_res *)a)->rps, &((const load_res *)b)->rps); }

int main(int argc, char **argv)
{
    double secs = 3;
    int rounds = 2, cuts = 5, conc[MAXC] = {1, 16, 64}, nconc = 3, libs[NLIBS] = {0, 1, 2}, nlibs = 3;
    make_payloads();
    if (argc == 8 && !strcmp(argv[1], "--serve-child")) { /* server_start's child */
        signal(SIGPIPE, SIG_IGN);
        int lib = atoi(argv[2]);
        g_delay_ms = atoi(argv[4]);
        g_cut_delay_ms = atoi(argv[5]);
        if (lib < 0 || lib >= NLIBS) return 2;
        child_main(lib, atoi(argv[3]), atoi(argv[6]), atoi(argv[7]));
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        static const char *const known[] = {"--seconds", "--rounds", "--cuts", "--delay-ms",
                                            "--cut-delay-ms", "--conc", "--libs"};
        int is_known = 0;
        for (size_t k = 0; k < sizeof known / sizeof *known; k++) is_known |= !strcmp(a, known[k]);
        if (!is_known) {
            fprintf(stderr, "http_libs: unknown option %s (see --help)\n", a);
            return 2;
        }
        if (!v) {
            fprintf(stderr, "http_libs: %s needs a value\n", a);
            return 2;
        }
        i++;
        char *end;
        if (!strcmp(a, "--seconds")) {
            secs = strtod(v, &end);
            if (*end || secs <= 0 || secs > 600) goto bad;
        } else if (!strcmp(a, "--rounds")) {
            rounds = (int)strtol(v, &end, 10);
            if (*end || rounds < 1 || rounds > MAXR) goto bad;
        } else if (!strcmp(a, "--cuts")) {
            cuts = (int)strtol(v, &end, 10);
            if (*end || cuts < 0 || cuts > MAXCUT) goto bad;
        } else if (!strcmp(a, "--delay-ms")) {
            g_delay_ms = (int)strtol(v, &end, 10);
            if (*end || g_delay_ms < 0 || g_delay_ms > 1000) goto bad;
        } else if (!strcmp(a, "--cut-delay-ms")) {
            g_cut_delay_ms = (int)strtol(v, &end, 10);
            if (*end || g_cut_delay_ms < 1 || g_cut_delay_ms > 1000) goto bad;
        } else if (!strcmp(a, "--conc")) {
            nconc = 0;
            for (char *p = (char *)v; *p;) {
                long x = strtol(p, &end, 10);
                if (end == p || x < 1 || x > 512 || nconc == MAXC) goto bad;
                conc[nconc++] = (int)x;
                p = *end == ',' ? end + 1 : end;
                if (*end && *end != ',') goto bad;
            }
            if (!nconc) goto bad;
        } else if (!strcmp(a, "--libs")) {
            nlibs = 0;
            char tmp[64];
            snprintf(tmp, sizeof tmp, "%s", v);
            for (char *sv, *tok = strtok_r(tmp, ",", &sv); tok; tok = strtok_r(NULL, ",", &sv)) {
                int f = -1;
                for (int l = 0; l < NLIBS; l++)
                    if (!strcmp(tok, LIB_KEY[l])) f = l;
                for (int l = 0; l < nlibs; l++)
                    if (libs[l] == f) f = -1; /* named twice */
                if (f < 0 || nlibs == NLIBS) goto bad;
                libs[nlibs++] = f;
            }
            if (!nlibs) goto bad;
        } else {
            fprintf(stderr, "http_libs: unknown option %s (see --help)\n", a);
            return 2;
        }
        continue;
    bad:
        fprintf(stderr, "http_libs: bad value for %s: %s\n", a, v);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
int maxconn = 0;
    for (int i = 0; i < nconc; i++) maxconn = conc[i] > maxconn ? conc[i] : maxconn;

    static load_res res[NLIBS][2][MAXC][MAXR];
    static double cut[NLIBS][MAXR * MAXCUT];
    static int ncut[NLIBS], cutfail[NLIBS];
    static long idle_rss[NLIBS][MAXR], idle_thr[NLIBS][MAXR];
    printf("http_libs: %d round(s) x %d librar%s, %.1f s per point, SSE %d x %d B every %d ms, "
           "body %d B, reply %d B\n",
           rounds, nlibs, nlibs == 1 ? "y" : "ies", secs, NCHUNKS, CHUNK_LEN, g_delay_ms, BODY_LEN, REPLY_LEN);
    int failed = 0;
    for (int r = 0; r < rounds; r++)
        for (int li = 0; li < nlibs; li++) {
            int lib = libs[li];
            server s;
            if (server_start(&s, lib, maxconn)) {
                fprintf(stderr, "http_libs: %s did not start\n", LIB_NAME[lib]);
                return 1;
            }
            srv_stats st0;
            if (server_stats(&s, &st0)) return 1;
            idle_rss[lib][r] = st0.rss_kb;
            idle_thr[lib][r] = st0.threads;
            for (int sse = 0; sse < 2; sse++)
                for (int ci = 0; ci < nconc; ci++) {
                    load_res *x = &res[lib][sse][ci][r];
                    if (run_load(&s, sse, conc[ci], secs, x)) {
                        fprintf(stderr, "http_libs: %s: the load run failed\n", LIB_NAME[lib]);
                        return 1;
                    }
                    printf("  round %d %-10s %-4s c=%-3d %8.0f req/s p50 %7.2f ms p99 %7.2f ms first %6.2f ms "
                           "cpu %6.1f us/req rss %5.1f MB thr %ld err %ld reconn %ld\n",
                           r + 1, LIB_NAME[lib], sse ? "sse" : "json", conc[ci], x->rps, x->p50 * 1e3, x->p99 * 1e3,
                           x->ttfc50 * 1e3, x->cpu_us, x->rss_mb, x->threads, x->errors + x->bad, x->reconnects);
                    fflush(stdout);
                    if (x->errors || x->bad) failed = 1;
                }
            for (int k = 0; k < cuts; k++) {
                double d = cut_trial(&s);
                if (d < 0) cutfail[lib]++;
                else cut[lib][ncut[lib]++] = d;
            }
            server_stop(&s);
        }

    printf("\n| library | load | conns | req/s (spread) | p50 ms | p99 ms (spread) | first SSE chunk p50 / p99 ms "
           "| server CPU us/req | server threads | peak RSS MB | errors |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int li = 0; li < nlibs; li++) {
        int lib = libs[li];
        for (int sse = 0; sse < 2; sse++)
            for (int ci = 0; ci < nconc; ci++) {
                load_res v[MAXR];
                memcpy(v, res[lib][sse][ci], (size_t)rounds * sizeof *v);
                qsort(v, (size_t)rounds, sizeof *v, cmp_lr_rps);
                const load_res *m = &v[(rounds - 1) / 2]; /* the median round by req/s (lower median) */
                long err = 0;
                double rss = 0, p99lo = v[0].p99, p99hi = v[0].p99;
                for (int r = 0; r < rounds; r++) {
                    err += v[r].errors + v[r].bad;
                    rss = v[r].maxrss_mb > rss ? v[r].maxrss_mb : rss;
                    p99lo = v[r].p99 < p99lo ? v[r].p99 : p99lo;
                    p99hi = v[r].p99 > p99hi ? v[r].p99 : p99hi;
                }
                char first[48] = "-";
                if (sse) snprintf(first, sizeof first, "%.2f / %.2f", m->ttfc50 * 1e3, m->ttfc99 * 1e3);
                const int dp = v[0].rps < 100 ? 1 : 0; /* req/s decimals */
                printf("| %s | %s | %d | %.*f (%.*f-%.*f) | %.2f | %.2f (%.2f-%.2f) | %s | %.1f | %ld | %.1f | %ld |\n",
                       LIB_NAME[lib], sse ? "SSE" : "JSON", conc[ci], dp, m->rps, dp, v[0].rps, dp, v[rounds - 1].rps,
                       m->p50 * 1e3, m->p99 * 1e3, p99lo * 1e3, p99hi * 1e3, first, m->cpu_us, m->threads, rss, err);
            }
    }
    printf("\n| library | idle RSS MB | threads idle | disconnect noticed after, ms: median (min-max) | missed |\n"
           "|---|---|---|---|---|\n");
    for (int li = 0; li < nlibs; li++) {
        int lib = libs[li];
        qsort(cut[lib], (size_t)ncut[lib], sizeof(double), cmp_d);
        char d[64] = "-";
        if (ncut[lib])
            snprintf(d, sizeof d, "%.1f (%.1f-%.1f)", cut[lib][(ncut[lib] - 1) / 2] * 1e3, cut[lib][0] * 1e3,
                     cut[lib][ncut[lib] - 1] * 1e3);
        printf("| %s | %.1f | %ld | %s | %d of %d |\n", LIB_NAME[lib], (double)idle_rss[lib][0] / 1024.0,
               idle_thr[lib][0], d, cutfail[lib], ncut[lib] + cutfail[lib]);
        if (cutfail[lib]) failed = 1;
    }
    printf("\n(disconnect test: the client reads %d chunks of a stream that sends one every %d ms, then closes)\n",
           CUT_AFTER, g_cut_delay_ms);
    if (failed) fprintf(stderr, "http_libs: some requests failed or a disconnect went unnoticed (see above)\n");
    return failed ? 1 : 0;
}
