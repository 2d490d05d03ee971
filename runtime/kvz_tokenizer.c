/* Byte-level BPE tokenizer (GPT-2 family) built from GGUF tokenizer metadata.
 *
 * Pipeline of kvz_tokenizer_encode, matching HF `tokenizers`:
 *   1. special tokens (CONTROL / USER_DEFINED) split out literally, leftmost-longest
 *      (only with KVZ_TOK_SPECIAL);
 *   2. pre-tokenizer by tokenizer.ggml.pre:
 *        smollm  Digits(individual_digits) -> each \p{N} char alone, then the GPT-2
 *                split regex on the pieces between them;
 *        gpt2    the GPT-2 split regex;
 *        qwen2   the Qwen2 split regex (no NFC normalisation, see header);
 *      the regexes are hand-written matchers with the same leftmost-alternative
 *      backtracking results as Oniguruma;
 *   3. each piece's bytes -> GPT-2 byte tokens -> merges by rank with a binary heap
 *      (the same order as HF's Word::merge_all: lowest rank, then leftmost).
 * Invalid UTF-8: every byte that does not start a valid sequence is a character of
 * its own, of class "other" (not \p{L}, \p{N}, \s), and goes to BPE as its byte.
 */
#include "kvz_tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "kvz_error.h"
#include "kvz_unicode_tables.h"

/* ------------------------------------------------------------------------- */
/* Token vector                                                              */

int kvz_tokens_push(kvz_tokens *t, int32_t id)
{
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        int32_t *p = realloc(t->ids, cap * sizeof *p);
        if (!p) return KVZ_ERR_NOMEM;
        t->ids = p;
        t->cap = cap;
    }
    t->ids[t->n++] = id;
    return 0;
}

void kvz_tokens_free(kvz_tokens *t)
{
    free(t->ids);
    t->ids = NULL;
    t->n = t->cap = 0;
}

/* ------------------------------------------------------------------------- */
/* Tokenizer object                                                          */

enum { PRE_GPT2 = 0, PRE_SMOLLM = 1, PRE_QWEN2 = 2 };
enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER = 4, TT_UNUSED = 5, TT_BYTE = 6 };

struct kvz_tokenizer {
    int32_t n_vocab;
    int pre;                  /* PRE_* */
    int32_t bos, eos;
    char *piece;              /* vocab strings as stored (byte-level form), NUL after each */
    uint32_t *piece_off;      /* (n_vocab + 1) offsets into piece */
    uint8_t *type;            /* (n_vocab) token_type */
    char *dec;                /* raw bytes of every token, concatenated */
    uint32_t *dec_off;        /* (n_vocab + 1) offsets into dec */
    int32_t *vslot;           /* vocab hash: id or -1; (vmask + 1) slots */
    uint32_t vmask;
    uint64_t *mkey;           /* merge hash: (left << 32 | right) or UINT64_MAX */
    int32_t *mrank, *mnew;    /* rank, merged id per slot */
    uint32_t mmask;
    int32_t byte_tok[256];    /* id of the single byte-level char for each byte, or -1 */
    int32_t *spec;            /* special ids, longest string first */
    int32_t n_spec;
    uint8_t spec_first[256];  /* 1 if some special string starts with this byte */
    char *chat_template;      /* GGUF tokenizer.chat_template (Jinja source), or NULL */
};

/* ------------------------------------------------------------------------- */
/* GPT-2 bytes_to_unicode                                                    */

static uint32_t byte_to_cp(int b)
{
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
        return (uint32_t)b;
    int n = 0; /* rank of b among the remapped bytes */
    for (int c = 0; c < b; c++)
        if (!((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF))) n++;
    return 256u + (uint32_t)n;
}

static int put_utf8(uint32_t cp, char *o)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | cp >> 6); o[1] = (char)(0x80 | (cp & 63)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12); o[1] = (char)(0x80 | (cp >> 6 & 63));
        o[2] = (char)(0x80 | (cp & 63)); return 3;
    }
    o[0] = (char)(0xF0 | cp >> 18); o[1] = (char)(0x80 | (cp >> 12 & 63));
    o[2] = (char)(0x80 | (cp >> 6 & 63)); o[3] = (char)(0x80 | (cp & 63)); return 4;
}

/* ------------------------------------------------------------------------- */
/* UTF-8 and code-point classes                                              */

#define CP_INVALID 0x110000u

/* Decode the character at s[i] (i < n). Invalid or truncated sequences yield
 * CP_INVALID with length 1, so every byte belongs to exactly one character. */
static inline uint32_t utf8_at(const uint8_t *s, size_t n, size_t i, size_t *len)
{
    uint32_t b0 = s[i];
    *len = 1;
    if (b0 < 0x80) return b0;
    size_t need;
    uint32_t cp, lo = 0x80, hi = 0xBF;
    if (b0 < 0xC2) return CP_INVALID;
    else if (b0 < 0xE0) { need = 1; cp = b0 & 0x1F; }
    else if (b0 < 0xF0) {
        need = 2; cp = b0 & 0x0F;
        if (b0 == 0xE0) lo = 0xA0;
        if (b0 == 0xED) hi = 0x9F;
    } else if (b0 < 0xF5) {
        need = 3; cp = b0 & 0x07;
        if (b0 == 0xF0) lo = 0x90;
        if (b0 == 0xF4) hi = 0x8F;
    } else return CP_INVALID;
    if (n - i <= need) return CP_INVALID;
    for (size_t k = 1; k <= need; k++) {
        uint32_t c = s[i + k];
        if (c < lo || c > hi) return CP_INVALID;
        lo = 0x80; hi = 0xBF;
        cp = cp << 6 | (c & 0x3F);
    }
    *len = need + 1;
    return cp;
}

static inline int uc_class(uint32_t cp)
{
    if (cp < 0x80) {
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return KVZ_UC_L;
        if (cp >= '0' && cp <= '9') return KVZ_UC_N;
        if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return KVZ_UC_S;
        return KVZ_UC_OTHER;
    }
    if (cp >= CP_INVALID) return KVZ_UC_OTHER;
    size_t lo = 0, hi = KVZ_UC_N_RANGES; /* first range with lo > cp */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (kvz_uc_lo[mid] <= cp) lo = mid + 1;
        else hi = mid;
    }
    if (lo == 0) return KVZ_UC_OTHER;
    uint32_t hc = kvz_uc_hi_cls[lo - 1];
    return cp <= (hc >> 2) ? (int)(hc & 3) : KVZ_UC_OTHER;
}

/* One decoded character: code point, class, byte length. */
typedef struct { uint32_t cp; int cl; size_t len; } uch;

static inline uch ch_at(const uint8_t *s, size_t n, size_t i)
{
    uch c;
    c.cp = utf8_at(s, n, i, &c.len);
    c.cl = uc_class(c.cp);
    return c;
}

/* End of the run of class @p cl starting at byte i (s[i] is of that class). */
static inline size_t run_of(const uint8_t *s, size_t n, size_t i, int cl)
{
    while (i < n) {
        uch c = ch_at(s, n, i);
        if (c.cl != cl) break;
        i += c.len;
    }
    return i;
}

/* Whitespace tail shared by both regexes: `\s+(?!\S)|\s+` from i (s[i] is \s).
 * @p last is set to the start of the last whitespace character of the run. */
static inline size_t ws_run(const uint8_t *s, size_t n, size_t i, size_t *last)
{
    size_t j = i;
    *last = i;
    while (j < n) {
        uch c = ch_at(s, n, j);
        if (c.cl != KVZ_UC_S) break;
        *last = j;
        j += c.len;
    }
    return j;
}

/* ------------------------------------------------------------------------- */
/* Split regexes: return the end of the match starting at byte i (< n).      */

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t match_gpt2(const uint8_t *s, size_t n, size_t i)
{
    uint8_t x = s[i];
    if (x == '\'' && i + 1 < n) {
        uint8_t y = s[i + 1];
        if (y == 's' || y == 't' || y == 'm' || y == 'd') return i + 2;
        if (i + 2 < n) {
            uint8_t z = s[i + 2];
            if ((y == 'r' && z == 'e') || (y == 'v' && z == 'e') || (y == 'l' && z == 'l')) return i + 3;
        }
    }
    size_t k = (x == ' ' && i + 1 < n) ? i + 1 : i;
    uch c = ch_at(s, n, k);
    if (c.cl != KVZ_UC_S) return run_of(s, n, k + c.len, c.cl);
    /* whitespace at i (either s[i] is \s or it is ' ' followed by \s) */
    size_t last, j = ws_run(s, n, i, &last);
    if (j == n) return j;
    return last > i ? last : j;
}

static inline int lower_ascii(uint8_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

/* Qwen2: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}
 *        | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t match_qwen2(const uint8_t *s, size_t n, size_t i)
{
    uint8_t x = s[i];
    if (x == '\'' && i + 1 < n) {
        int y = lower_ascii(s[i + 1]);
        if (y == 's' || y == 't' || y == 'm' || y == 'd') return i + 2;
        if (i + 2 < n) {
            int z = lower_ascii(s[i + 2]);
            if ((y == 'r' && z == 'e') || (y == 'v' && z == 'e') || (y == 'l' && z == 'l')) return i + 3;
        }
    }
    uch c = ch_at(s, n, i);
    if (c.cl == KVZ_UC_L) return run_of(s, n, i + c.len, KVZ_UC_L);
    if (c.cl != KVZ_UC_N && x != '\r' && x != '\n' && i + c.len < n) {
        uch d = ch_at(s, n, i + c.len);
        if (d.cl == KVZ_UC_L) return run_of(s, n, i + c.len + d.len, KVZ_UC_L);
    }
    if (c.cl == KVZ_UC_N) return i + c.len;
    size_t k = i;
    if (x == ' ' && i + 1 < n) { k = i + 1; c = ch_at(s, n, k); }
    if (c.cl == KVZ_UC_OTHER) {
        size_t j = run_of(s, n, k + c.len, KVZ_UC_OTHER);
        while (j < n && (s[j] == '\r' || s[j] == '\n')) j++;
        return j;
    }
    /* whitespace at i */
    size_t last, j = ws_run(s, n, i, &last);
    for (size_t p = j; p > i; p--) /* \s*[\r\n]+ : up to the last CR/LF of the run */
        if (s[p - 1] == '\r' || s[p - 1] == '\n') return p;
    if (j == n) return j;
    return last > i ? last : j;
}

/* ------------------------------------------------------------------------- */
/* Hash maps                                                                 */

static uint32_t hash_bytes(const char *p, size_t n)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)p[i]) * 16777619u;
    return h;
}

static inline uint32_t hash_pair(uint64_t k)
{
    k *= 0x9E3779B97F4A7C15ull;
    return (uint32_t)(k >> 32);
}

static int32_t vocab_find(const kvz_tokenizer *t, const char *p, size_t n)
{
    for (uint32_t h = hash_bytes(p, n) & t->vmask;; h = (h + 1) & t->vmask) {
        int32_t id = t->vslot[h];
        if (id < 0) return -1;
        size_t len = t->piece_off[id + 1] - t->piece_off[id] - 1;
        if (len == n && memcmp(t->piece + t->piece_off[id], p, n) == 0) return id;
    }
}

static inline int merge_find(const kvz_tokenizer *t, int32_t a, int32_t b, int32_t *rank, int32_t *nid)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (uint32_t h = hash_pair(key) & t->mmask;; h = (h + 1) & t->mmask) {
        if (t->mkey[h] == key) { *rank = t->mrank[h]; *nid = t->mnew[h]; return 1; }
        if (t->mkey[h] == UINT64_MAX) return 0;
    }
}

static uint32_t pow2_at_least(uint64_t n)
{
    uint32_t p = 16;
    while (p < n) p <<= 1;
    return p;
}

/* ------------------------------------------------------------------------- */
/* Construction                                                              */

void kvz_tokenizer_free(kvz_tokenizer *t)
{
    if (!t) return;
    free(t->piece); free(t->piece_off); free(t->type);
    free(t->dec); free(t->dec_off); free(t->vslot);
    free(t->mkey); free(t->mrank); free(t->mnew); free(t->spec);
    free(t->chat_template);
    free(t);
}

static int pre_from_name(const char *pre, size_t len, int *out)
{
    static const struct { const char *name; int pre; } names[] = {
        {"default", PRE_GPT2}, {"gpt2", PRE_GPT2}, {"gpt-2", PRE_GPT2},
        {"smollm", PRE_SMOLLM}, {"qwen2", PRE_QWEN2},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i].name) == len && memcmp(names[i].name, pre, len) == 0) {
            *out = names[i].pre;
            return 0;
        }
    return kvz_error_set(KVZ_ERR_UNSUPPORTED, "tokenizer pre-tokenizer '%.*s' is not supported",
                         (int)len, pre);
}

static int cmp_spec_len(const void *a, const void *b, void *ctx)
{
    const kvz_tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = t->piece_off[x + 1] - t->piece_off[x], ly = t->piece_off[y + 1] - t->piece_off[y];
    if (lx != ly) return lx > ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

int kvz_tokenizer_from_vocab(const kvz_str *tokens, const int32_t *types, uint64_t n_vocab,
                             const kvz_str *merges, uint64_t n_merges, const char *pre,
                             int32_t bos, int32_t eos, kvz_tokenizer **out)
{
    *out = NULL;
    if (!tokens || n_vocab == 0 || n_vocab > (uint64_t)INT32_MAX / 2 || (n_merges && !merges))
        return kvz_error_set(KVZ_ERR_ARG, "tokenizer: bad vocabulary arguments");
    int pre_kind = 0;
    const char *pname = pre ? pre : "default";
    int rc = pre_from_name(pname, strlen(pname), &pre_kind);
    if (rc) return rc;

    kvz_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return KVZ_ERR_NOMEM;
    t->n_vocab = (int32_t)n_vocab;
    t->pre = pre_kind;
    t->bos = (bos >= 0 && (uint64_t)bos < n_vocab) ? bos : -1;
    t->eos = (eos >= 0 && (uint64_t)eos < n_vocab) ? eos : -1;

    /* strings */
    uint64_t total = 0;
    for (uint64_t i = 0; i < n_vocab; i++) total += tokens[i].len + 1;
    if (total > UINT32_MAX) { kvz_tokenizer_free(t); return kvz_error_set(KVZ_ERR_FORMAT, "tokenizer: vocabulary too large"); }
    t->piece = malloc(total);
    t->dec = malloc(total);     /* decoded form is never longer than the stored one */
    t->piece_off = malloc((n_vocab + 1) * sizeof *t->piece_off);
    t->dec_off = malloc((n_vocab + 1) * sizeof *t->dec_off);
    t->type = malloc(n_vocab);
    t->vmask = pow2_at_least(n_vocab * 2) - 1;
    t->vslot = malloc(((size_t)t->vmask + 1) * sizeof *t->vslot);
    if (!t->piece || !t->dec || !t->piece_off || !t->dec_off || !t->type || !t->vslot) {
        kvz_tokenizer_free(t);
        return KVZ_ERR_NOMEM;
    }
    memset(t->vslot, 0xFF, ((size_t)t->vmask + 1) * sizeof *t->vslot);

    int16_t cp_to_byte[324];
    for (int i = 0; i < 324; i++) cp_to_byte[i] = -1;
    for (int b = 0; b < 256; b++) cp_to_byte[byte_to_cp(b)] = (int16_t)b;

    uint32_t po = 0, dof = 0;
    for (uint64_t i = 0; i < n_vocab; i++) {
        int32_t ty = types ? types[i] : TT_NORMAL;
        t->type[i] = (uint8_t)(ty >= 0 && ty <= 255 ? ty : 0);
        t->piece_off[i] = po;
        t->dec_off[i] = dof;
        const char *p = tokens[i].ptr;
        size_t len = (size_t)tokens[i].len;
        if (len) memcpy(t->piece + po, p, len);
        t->piece[po + len] = 0;
        po += (uint32_t)len + 1;
        /* raw bytes: special tokens as they are; others with the byte-level map undone */
        if (ty == TT_CONTROL || ty == TT_USER) {
            if (len) memcpy(t->dec + dof, p, len);
            dof += (uint32_t)len;
        } else {
            for (size_t k = 0; k < len;) {
                size_t cl;
                uint32_t cp = utf8_at((const uint8_t *)p, len, k, &cl);
                if (cp < 324 && cp_to_byte[cp] >= 0) t->dec[dof++] = (char)cp_to_byte[cp];
                else { memcpy(t->dec + dof, p + k, cl); dof += (uint32_t)cl; }
                k += cl;
            }
        }
        if (len) { /* later duplicates win, as in a Python dict built in id order */
            uint32_t h = hash_bytes(p, len) & t->vmask;
            for (;; h = (h + 1) & t->vmask) {
                int32_t id = t->vslot[h];
                if (id < 0) { t->vslot[h] = (int32_t)i; break; }
                size_t l2 = t->piece_off[id + 1] - t->piece_off[id] - 1;
                if (l2 == len && memcmp(t->piece + t->piece_off[id], p, len) == 0) { t->vslot[h] = (int32_t)i; break; }
            }
        }
    }
    t->piece_off[n_vocab] = po;
    t->dec_off[n_vocab] = dof;

    for (int b = 0; b < 256; b++) {
        char u[4];
        int l = put_utf8(byte_to_cp(b), u);
        t->byte_tok[b] = vocab_find(t, u, (size_t)l);
    }

    /* merges: "left right" -> (rank, id(left right)) */
    t->mmask = pow2_at_least(n_merges * 2 + 1) - 1;
    t->mkey = malloc(((size_t)t->mmask + 1) * sizeof *t->mkey);
    t->mrank = malloc(((size_t)t->mmask + 1) * sizeof *t->mrank);
    t->mnew = malloc(((size_t)t->mmask + 1) * sizeof *t->mnew);
    char *buf = NULL;
    size_t buf_cap = 0;
    if (!t->mkey || !t->mrank || !t->mnew) { kvz_tokenizer_free(t); return KVZ_ERR_NOMEM; }
    memset(t->mkey, 0xFF, ((size_t)t->mmask + 1) * sizeof *t->mkey);
    for (uint64_t r = 0; r < n_merges; r++) {
        const char *m = merges[r].ptr;
        size_t len = (size_t)merges[r].len, sp = 1;
        while (sp < len && m[sp] != ' ') sp++;
        if (sp >= len) {
            free(buf);
            kvz_tokenizer_free(t);
            return kvz_error_set(KVZ_ERR_FORMAT, "tokenizer: merge %llu has no space", (unsigned long long)r);
        }
        int32_t a = vocab_find(t, m, sp), b = vocab_find(t, m + sp + 1, len - sp - 1);
        if (len > buf_cap) {
            free(buf);
            buf_cap = len * 2;
            buf = malloc(buf_cap);
            if (!buf) { kvz_tokenizer_free(t); return KVZ_ERR_NOMEM; }
        }
        memcpy(buf, m, sp);
        memcpy(buf + sp, m + sp + 1, len - sp - 1);
        int32_t c = vocab_find(t, buf, len - 1);
        if (a < 0 || b < 0 || c < 0) continue; /* out of vocabulary: HF refuses these; skip */
        uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
        uint32_t h = hash_pair(key) & t->mmask;
        while (t->mkey[h] != UINT64_MAX && t->mkey[h] != key) h = (h + 1) & t->mmask;
        if (t->mkey[h] == key) continue; /* a repeated pair keeps its first (lowest) rank */
        t->mkey[h] = key;
        t->mrank[h] = (int32_t)r;
        t->mnew[h] = c;
    }
    free(buf);

    /* special tokens, longest first so the first hit at a position is the longest */
    int32_t ns = 0;
    for (uint64_t i = 0; i < n_vocab; i++)
        if ((t->type[i] == TT_CONTROL || t->type[i] == TT_USER) && tokens[i].len) ns++;
    t->spec = malloc((size_t)(ns ? ns : 1) * sizeof *t->spec);
    if (!t->spec) { kvz_tokenizer_free(t); return KVZ_ERR_NOMEM; }
    for (uint64_t i = 0; i < n_vocab; i++)
        if ((t->type[i] == TT_CONTROL || t->type[i] == TT_USER) && tokens[i].len) {
            t->spec[t->n_spec++] = (int32_t)i;
            t->spec_first[(uint8_t)tokens[i].ptr[0]] = 1;
        }
    qsort_r(t->spec, (size_t)t->n_spec, sizeof *t->spec, cmp_spec_len, t);

    *out = t;
    return 0;
}

int kvz_tokenizer_from_gguf(const kvz_gguf *g, kvz_tokenizer **out)
{
    *out = NULL;
    kvz_str model, pre;
    int rc = kvz_gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (rc) return kvz_error_set(rc, "tokenizer.ggml.model: %s", kvz_strerror(rc));
    if (!kvz_str_eq(model, "gpt2"))
        return kvz_error_set(KVZ_ERR_UNSUPPORTED, "tokenizer model '%.*s' is not supported (need gpt2)",
                             (int)model.len, model.ptr);
    char pre_name[64] = "default";
    rc = kvz_gguf_get_str(g, "tokenizer.ggml.pre", &pre);
    if (rc == 0) {
        if (pre.len >= sizeof pre_name)
            return kvz_error_set(KVZ_ERR_UNSUPPORTED, "tokenizer pre-tokenizer name too long");
        memcpy(pre_name, pre.ptr, pre.len);
        pre_name[pre.len] = 0;
    } else if (rc != KVZ_ERR_NOTFOUND) {
        return kvz_error_set(rc, "tokenizer.ggml.pre: %s", kvz_strerror(rc));
    }
    int dummy;
    if ((rc = pre_from_name(pre_name, strlen(pre_name), &dummy))) return rc;

    kvz_str *tokens = NULL, *merges = NULL;
    uint64_t n_vocab = 0, n_merges = 0;
    rc = kvz_gguf_get_str_array(g, "tokenizer.ggml.tokens", &tokens, &n_vocab);
    if (rc) return kvz_error_set(rc, "tokenizer.ggml.tokens: %s", kvz_strerror(rc));
    rc = kvz_gguf_get_str_array(g, "tokenizer.ggml.merges", &merges, &n_merges);
    if (rc) { free(tokens); return kvz_error_set(rc, "tokenizer.ggml.merges: %s", kvz_strerror(rc)); }

    int32_t *types = NULL;
    uint32_t et;
    uint64_t nt;
    const void *tdata;
    rc = kvz_gguf_get_array(g, "tokenizer.ggml.token_type", &et, &nt, &tdata);
    if (rc == 0) {
        if ((et != KVZ_GGUF_I32 && et != KVZ_GGUF_U32) || nt != n_vocab) {
            rc = kvz_error_set(KVZ_ERR_FORMAT, "tokenizer.ggml.token_type: %llu entries of type %u for %llu tokens",
                               (unsigned long long)nt, et, (unsigned long long)n_vocab);
            goto done;
        }
        types = malloc(n_vocab * sizeof *types);
        if (!types) { rc = KVZ_ERR_NOMEM; goto done; }
        memcpy(types, tdata, n_vocab * sizeof *types); /* may be unaligned in the mapping */
    } else if (rc != KVZ_ERR_NOTFOUND) {
        goto done;
    }

    int64_t v;
    int32_t bos = -1, eos = -1;
    if (kvz_gguf_get_i64(g, "tokenizer.ggml.bos_token_id", &v) == 0 && v >= 0 && v < INT32_MAX) bos = (int32_t)v;
    if (kvz_gguf_get_i64(g, "tokenizer.ggml.eos_token_id", &v) == 0 && v >= 0 && v < INT32_MAX) eos = (int32_t)v;
    kvz_error_clear();
    rc = kvz_tokenizer_from_vocab(tokens, types, n_vocab, merges, n_merges, pre_name, bos, eos, out);
    kvz_str tmpl; /* optional: the chat layout is recognised from it (kvz_generate.c) */
    if (rc == 0 && kvz_gguf_get_str(g, "tokenizer.chat_template", &tmpl) == 0 && tmpl.len < (1u << 20)) {
        if (!((*out)->chat_template = strndup(tmpl.ptr, tmpl.len))) {
            kvz_tokenizer_free(*out);
            *out = NULL;
            rc = KVZ_ERR_NOMEM;
        }
    }
    kvz_error_clear();
done:
    free(types);
    free(tokens);
    free(merges);
    return rc;
}

/* ------------------------------------------------------------------------- */
/* BPE                                                                       */

typedef struct { int32_t id, prev, next; } bpe_sym;
typedef struct { int32_t rank, pos, id; } bpe_merge;

typedef struct {
    bpe_sym *sym;
    bpe_merge *heap;
    size_t cap; /* symbols; heap holds 3 * cap */
} bpe_scratch;

static inline int merge_less(bpe_merge a, bpe_merge b)
{
    return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos;
}

static void heap_push(bpe_merge *h, size_t *n, bpe_merge m)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!merge_less(m, h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = m;
}

static bpe_merge heap_pop(bpe_merge *h, size_t *n)
{
    bpe_merge top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && merge_less(h[c + 1], h[c])) c++;
        if (!merge_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static inline void try_pair(const kvz_tokenizer *t, const bpe_sym *s, int32_t pos, bpe_merge *h, size_t *hn)
{
    int32_t nx = s[pos].next, rank, nid;
    if (nx < 0) return;
    if (merge_find(t, s[pos].id, s[nx].id, &rank, &nid)) {
        bpe_merge m = {rank, pos, nid};
        heap_push(h, hn, m);
    }
}

static int bpe_piece(const kvz_tokenizer *t, const uint8_t *p, size_t n, bpe_scratch *sc, kvz_tokens *out)
{
    if (n == 1) return t->byte_tok[p[0]] >= 0 ? kvz_tokens_push(out, t->byte_tok[p[0]]) : 0;
    if (n > (size_t)INT32_MAX / 4) return kvz_error_set(KVZ_ERR_NOMEM, "tokenizer: pre-token of %zu bytes", n);
    if (n > sc->cap) {
        size_t cap = n < 256 ? 256 : n * 2;
        bpe_sym *s = realloc(sc->sym, cap * sizeof *s);
        if (!s) return KVZ_ERR_NOMEM;
        sc->sym = s;
        bpe_merge *h = realloc(sc->heap, 3 * cap * sizeof *h);
        if (!h) return KVZ_ERR_NOMEM;
        sc->heap = h;
        sc->cap = cap;
    }
    bpe_sym *s = sc->sym;
    bpe_merge *h = sc->heap;
    size_t hn = 0;
    /* A byte without a byte-level token is dropped and its neighbours become
     * adjacent, as HF's BPE does when there is no unk token. */
    int32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_tok[p[i]];
        if (id < 0) continue;
        s[m].id = id;
        s[m].prev = m - 1;
        s[m].next = m + 1;
        m++;
    }
    if (m == 0) return 0;
    s[m - 1].next = -1;
    for (int32_t i = 0; i + 1 < m; i++) try_pair(t, s, i, h, &hn);
    while (hn) {
        bpe_merge m = heap_pop(h, &hn);
        bpe_sym *a = &s[m.pos];
        if (a->id == INT32_MIN || a->next < 0) continue;   /* merged away / now last */
        int32_t rank, nid;
        if (!merge_find(t, a->id, s[a->next].id, &rank, &nid) || nid != m.id) continue; /* stale */
        int32_t b = a->next;
        a->id = nid;
        a->next = s[b].next;
        if (a->next >= 0) s[a->next].prev = m.pos;
        s[b].id = INT32_MIN;
        if (a->prev >= 0) try_pair(t, s, a->prev, h, &hn);
        try_pair(t, s, m.pos, h, &hn);
    }
    for (int32_t i = 0; i >= 0; i = s[i].next)
        if (s[i].id >= 0) {
            int rc = kvz_tokens_push(out, s[i].id);
            if (rc) return rc;
        }
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Encoding                                                                  */

/* Receives each piece in order: text pieces with special = -1, special tokens
 * with their id. Returns 0 or an error that stops the walk. */
typedef int (*piece_fn)(void *ctx, const uint8_t *p, size_t n, int32_t special);

/* Pre-tokenize one stretch of text that holds no special token. */
static int split_text(const kvz_tokenizer *t, const uint8_t *s, size_t n, piece_fn fn, void *ctx)
{
    int rc = 0;
    if (t->pre == PRE_QWEN2) {
        for (size_t i = 0; i < n && !rc;) {
            size_t j = match_qwen2(s, n, i);
            rc = fn(ctx, s + i, j - i, -1);
            i = j;
        }
        return rc;
    }
    size_t i = 0;
    while (i < n && !rc) {
        /* smollm: every \p{N} character is a piece of its own; regex between them */
        size_t e = n, dl = 0;
        if (t->pre == PRE_SMOLLM) {
            for (e = i; e < n;) {
                uch c = ch_at(s, n, e);
                if (c.cl == KVZ_UC_N) { dl = c.len; break; }
                e += c.len;
            }
        }
        while (i < e && !rc) {
            size_t j = match_gpt2(s, e, i);
            rc = fn(ctx, s + i, j - i, -1);
            i = j;
        }
        if (dl && !rc) {
            rc = fn(ctx, s + e, dl, -1);
            i = e + dl;
        }
    }
    return rc;
}

/* Special tokens first (leftmost, longest), then split_text on the gaps. */
static int split_all(const kvz_tokenizer *t, const uint8_t *s, size_t len, int flags, piece_fn fn, void *ctx)
{
    int rc = 0;
    size_t start = 0;
    if ((flags & KVZ_TOK_SPECIAL) && t->n_spec) {
        for (size_t i = 0; i < len && !rc;) {
            int32_t hit = -1;
            size_t hl = 0;
            if (t->spec_first[s[i]])
                for (int32_t k = 0; k < t->n_spec; k++) { /* longest first */
                    int32_t id = t->spec[k];
                    size_t l = t->piece_off[id + 1] - t->piece_off[id] - 1;
                    if (l <= len - i && memcmp(s + i, t->piece + t->piece_off[id], l) == 0) {
                        hit = id;
                        hl = l;
                        break;
                    }
                }
            if (hit < 0) { i++; continue; }
            if (i > start) rc = split_text(t, s + start, i - start, fn, ctx);
            if (!rc) rc = fn(ctx, s + i, hl, hit);
            i += hl;
            start = i;
        }
    }
    if (!rc && start < len) rc = split_text(t, s + start, len - start, fn, ctx);
    return rc;
}

typedef struct { const kvz_tokenizer *t; bpe_scratch sc; kvz_tokens *out; } enc_ctx;

static int enc_piece(void *ctx, const uint8_t *p, size_t n, int32_t special)
{
    enc_ctx *c = ctx;
    return special >= 0 ? kvz_tokens_push(c->out, special) : bpe_piece(c->t, p, n, &c->sc, c->out);
}

int kvz_tokenizer_encode(const kvz_tokenizer *t, const char *text, size_t len, int flags, kvz_tokens *out)
{
    enc_ctx c = {t, {0}, out};
    int rc = split_all(t, (const uint8_t *)text, len, flags, enc_piece, &c);
    free(c.sc.sym);
    free(c.sc.heap);
    return rc;
}

typedef struct { const uint8_t *base; size_t *ends, cap, n; } pre_ctx;

static int pre_piece(void *ctx, const uint8_t *p, size_t n, int32_t special)
{
    pre_ctx *c = ctx;
    (void)special;
    if (c->n < c->cap) c->ends[c->n] = (size_t)(p - c->base) + n;
    c->n++;
    return 0;
}

int kvz_tokenizer_pretokenize(const kvz_tokenizer *t, const char *text, size_t len, int flags,
                              size_t *ends, size_t cap, size_t *n_pieces)
{
    pre_ctx c = {(const uint8_t *)text, ends, ends ? cap : 0, 0};
    split_all(t, (const uint8_t *)text, len, flags, pre_piece, &c);
    *n_pieces = c.n;
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Queries                                                                   */

int kvz_tokenizer_decode(const kvz_tokenizer *t, int32_t id, char *buf, size_t cap)
{
    if (id < 0 || id >= t->n_vocab) return kvz_error_set(KVZ_ERR_ARG, "token id %d out of range", (int)id);
    size_t n = t->dec_off[id + 1] - t->dec_off[id];
    if (buf && cap) memcpy(buf, t->dec + t->dec_off[id], n < cap ? n : cap);
    return (int)n;
}

int32_t kvz_tokenizer_n_vocab(const kvz_tokenizer *t) { return t->n_vocab; }
int32_t kvz_tokenizer_byte_token(const kvz_tokenizer *t, uint8_t byte) { return t->byte_tok[byte]; }
int32_t kvz_tokenizer_bos(const kvz_tokenizer *t) { return t->bos; }
int32_t kvz_tokenizer_eos(const kvz_tokenizer *t) { return t->eos; }
const char *kvz_tokenizer_chat_template(const kvz_tokenizer *t) { return t->chat_template; }

int32_t kvz_tokenizer_find(const kvz_tokenizer *t, const char *piece)
{
    return piece ? vocab_find(t, piece, strlen(piece)) : -1;
}

int kvz_tokenizer_is_special(const kvz_tokenizer *t, int32_t id)
{
    if (id < 0 || id >= t->n_vocab) return 0;
    return t->type[id] == TT_CONTROL || t->type[id] == TT_USER;
}

/* ------------------------------------------------------------------------- */
/* Byte-level fallback (synthetic models)                                    */

int kvz_tokenizer_bytes(int32_t n_vocab, kvz_tokenizer **out)
{
    *out = NULL;
    if (n_vocab < 256) return kvz_error_set(KVZ_ERR_ARG, "byte tokenizer: n_vocab %d < 256", n_vocab);
    kvz_str *tok = calloc((size_t)n_vocab, sizeof *tok);
    int32_t *types = malloc((size_t)n_vocab * sizeof *types);
    char *chars = malloc(256 * 4);
    if (!tok || !types || !chars) {
        free(tok); free(types); free(chars);
        return KVZ_ERR_NOMEM;
    }
    for (int32_t i = 0; i < n_vocab; i++) types[i] = TT_NORMAL;
    for (int b = 0; b < 256; b++) {
        tok[b].ptr = chars + 4 * b;
        tok[b].len = (uint64_t)put_utf8(byte_to_cp(b), chars + 4 * b);
    }
    int32_t eos = -1;
    if (n_vocab > 257) {
        static const char s0[] = "<|im_start|>", s1[] = "<|im_end|>";
        tok[256] = (kvz_str){s0, sizeof s0 - 1};
        tok[257] = (kvz_str){s1, sizeof s1 - 1};
        types[256] = types[257] = TT_CONTROL;
        eos = 257;
    }
    int rc = kvz_tokenizer_from_vocab(tok, types, (uint64_t)n_vocab, NULL, 0, "default", -1, eos, out);
    free(tok); free(types); free(chars);
    return rc;
}
