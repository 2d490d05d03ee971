#include "kvz_escape.h"

#include <stdint.h>
#include <string.h>

#include "kvz_error.h"

int kvz_utf8_valid(const char *s, size_t len, size_t *bad)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        unsigned c = p[i];
        size_t n;
        uint32_t cp;
        if (c == 0) goto fail;
        if (c < 0x80) { i++; continue; }
        if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; }
        else goto fail;
        for (size_t k = 1; k <= n; k++) {
            if (i + k >= len || (p[i + k] & 0xC0) != 0x80) goto fail;
            cp = (cp << 6) | (p[i + k] & 0x3F);
        }
        if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
            cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            goto fail;
        i += n + 1;
    }
    return 1;
fail:
    if (bad) *bad = i;
    return 0;
}

const char *kvz_escape(const char *s)
{
    enum { IN_MAX = 4095, OUT_CAP = IN_MAX * 6 + 8 };
    static _Thread_local char bufs[8][OUT_CAP];
    static _Thread_local unsigned next;
    char *out = bufs[next++ % 8];
    static const char hx[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)(s ? s : "");
    size_t len = strlen((const char *)p), o = 0, i = 0;
    const size_t lim = len > IN_MAX ? IN_MAX : len;
    while (i < lim) {
        unsigned c = p[i];
        if (c == '\\') { out[o++] = '\\'; out[o++] = '\\'; i++; continue; }
        if (c == '\n' || c == '\r' || c == '\t') {
            out[o++] = '\\';
            out[o++] = c == '\n' ? 'n' : c == '\r' ? 'r' : 't';
            i++;
            continue;
        }
        if (c < 0x20 || c == 0x7f) {
            o += (size_t)sprintf(out + o, "\\x%c%c", hx[c >> 4], hx[c & 15]);
            i++;
            continue;
        }
        if (c < 0x80) { out[o++] = (char)c; i++; continue; }
        /* one UTF-8 sequence: valid and not a C1 control -> as is; else \xHH per byte */
        const size_t n = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        if (n && i + n <= lim && kvz_utf8_valid((const char *)p + i, n, NULL)) {
            if (c == 0xC2 && p[i + 1] < 0xA0) /* U+0080..U+009F: C1 controls (CSI, ...) */
                o += (size_t)sprintf(out + o, "\\u00%c%c", hx[p[i + 1] >> 4], hx[p[i + 1] & 15]);
            else {
                memcpy(out + o, p + i, n);
                o += n;
            }
            i += n;
            continue;
        }
        o += (size_t)sprintf(out + o, "\\x%c%c", hx[c >> 4], hx[c & 15]);
        i++;
    }
    if (len > lim) { memcpy(out + o, "...", 3); o += 3; }
    out[o] = 0;
    return out;
}

void kvz_escape_json(FILE *f, const char *s, size_t len)
{
    fputc('"', f);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': fputs("\\\"", f); break;
        case '\\': fputs("\\\\", f); break;
        case '\n': fputs("\\n", f); break;
        case '\r': fputs("\\r", f); break;
        case '\t': fputs("\\t", f); break;
        default:
            if (c < 0x20) fprintf(f, "\\u%04x", c);
            else fputc(c, f);
        }
    }
    fputc('"', f);
}

void kvz_escape_error(FILE *f, const char *prog, int rc, const char *what)
{
    /* ids, paths and details may hold any bytes: one line, no terminal controls */
    const char *detail = kvz_error_detail();
    if (detail[0])
        fprintf(f, "%s: error: %s: %s (%s)\n", prog, kvz_escape(what), kvz_escape(detail), kvz_strerror(rc));
    else
        fprintf(f, "%s: error: %s: %s\n", prog, kvz_escape(what), kvz_strerror(rc));
    kvz_error_clear();
}
