/* Document files as text (kvz_text.h): moved here from cli/cli_util.c so that the
 * corpus walker and any other user of the library reads files the way the CLIs do. */
#include "kvz_text.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvz_error.h"
#include "kvz_escape.h" /* kvz_text_valid is kvz_utf8_valid */

static const char *file_kind(mode_t m)
{
    if (S_ISDIR(m)) return "a folder";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISSOCK(m)) return "a socket";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    return "not a file";
}

int kvz_text_open_regular(const char *path, struct stat *st)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        const int e = errno;
        if (stat(path, st) == 0 && !S_ISREG(st->st_mode)) /* a socket cannot be opened */
            return kvz_error_set(KVZ_ERR_IO, "%s: not a regular file (%s)", path,
                                 file_kind(st->st_mode));
        return kvz_error_set(e == ENOENT ? KVZ_ERR_NOTFOUND : KVZ_ERR_IO, "%s: %s", path,
                             strerror(e));
    }
    if (fstat(fd, st)) {
        int e = errno;
        close(fd);
        return kvz_error_set(KVZ_ERR_IO, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(st->st_mode)) {
        close(fd);
        return kvz_error_set(KVZ_ERR_IO, "%s: not a regular file (%s)", path,
                             file_kind(st->st_mode));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    return fd;
}

int kvz_text_valid(const char *s, size_t len, size_t *bad) { return kvz_utf8_valid(s, len, bad); }

int kvz_text_read(const char *path, size_t max_bytes, char **out, size_t *len)
{
    *out = NULL;
    struct stat st;
    int fd = kvz_text_open_regular(path, &st); /* never blocks on a FIFO or device */
    if (fd < 0) return fd;
    if ((size_t)st.st_size > max_bytes) {
        close(fd);
        return kvz_error_set(KVZ_ERR_CONTEXT, "%s: %lld bytes is larger than the %zu-byte limit",
                             path, (long long)st.st_size, max_bytes);
    }
    char *buf = malloc((size_t)st.st_size + 1);
    if (!buf) {
        close(fd);
        return KVZ_ERR_NOMEM;
    }
    size_t n = 0;
    while (n < (size_t)st.st_size) {
        ssize_t k = read(fd, buf + n, (size_t)st.st_size - n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        n += (size_t)k;
    }
    int e = errno;
    close(fd);
    if (n != (size_t)st.st_size) {
        free(buf);
        return kvz_error_set(KVZ_ERR_IO, "%s: read failed (%zu of %lld bytes%s%s)", path, n,
                             (long long)st.st_size, n ? "" : ": ", n ? "" : strerror(e));
    }
    buf[n] = 0;
    size_t i = 0;
    while (i < n && (buf[i] == ' ' || buf[i] == '\n' || buf[i] == '\t' || buf[i] == '\r')) i++;
    if (i == n) {
        free(buf);
        return kvz_error_set(KVZ_ERR_EMPTY, "%s is empty", path);
    }
    size_t bad;
    if (!kvz_text_valid(buf, n, &bad)) {
        unsigned char b = (unsigned char)buf[bad];
        free(buf);
        return kvz_error_set(KVZ_ERR_ENCODING, "%s is not UTF-8 text (bad byte 0x%02x at offset "
                             "%zu)", path, b, bad);
    }
    *out = buf;
    if (len) *len = n;
    return 0;
}
