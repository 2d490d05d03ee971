/* libFuzzer target for the document text check (cli/cli_util.h cli_is_text),
 * differential against an independent table-driven UTF-8 validator written
 * from RFC 3629 section 4 (well-formed byte sequences; NUL rejected as binary):
 * both must agree on the verdict and on the offset of the first bad sequence. */
#include "cli_util.h"

#include <stddef.h>
#include <stdint.h>

static int ref_is_text(const uint8_t *s, size_t n, size_t *bad)
{
    size_t i = 0;
    while (i < n) {
        const uint8_t c = s[i];
        size_t need;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c == 0) goto fail;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) { need = 2; lo = 0xA0; }
        else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) need = 2;
        else if (c == 0xED) { need = 2; hi = 0x9F; }
        else if (c == 0xF0) { need = 3; lo = 0x90; }
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else if (c == 0xF4) { need = 3; hi = 0x8F; }
        else goto fail;
        if (i + need >= n) goto fail;
        if (s[i + 1] < lo || s[i + 1] > hi) goto fail;
        for (size_t k = 2; k <= need; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF) goto fail;
        i += need + 1;
    }
    return 1;
fail:
    *bad = i;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t bad_a = (size_t)-1, bad_b = (size_t)-1;
    const int a = cli_is_text((const char *)data, size, &bad_a);
    const int b = ref_is_text(data, size, &bad_b);
    if (a != b || (!a && bad_a != bad_b)) __builtin_trap();
    return 0;
}
