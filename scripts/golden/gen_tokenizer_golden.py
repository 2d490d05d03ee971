#!/usr/bin/env python3
"""Make tests/golden/tokenizer_smollm2.tsv: token ids from an HF `tokenizers`
reference built from the GGUF's own vocabulary, merges and pre-tokenizer.

Usage (from the repository root; re-executes itself inside .venv-golden/,
creating it when missing):
    python3 scripts/golden/gen_tokenizer_golden.py [model.gguf]

Why not transformers' GGUF loader: it converts `gpt2`-type vocabularies with the
plain GPT-2 byte-level split and drops smollm's one-digit-per-token rule. So the
reference is assembled here: models.BPE(vocab, merges) with pre_tokenizer
Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
use_regex=True)]), ByteLevel decoder, and every CONTROL / USER_DEFINED token
added as a special AddedToken. A published id sequence is checked first.

Output lines: `<hex of the UTF-8 input bytes>\\t<space-separated ids>` (the empty
string gives an empty line apart from the tab). Every input is valid UTF-8: HF
takes only Python str, so invalid byte strings have no principled reference here;
the C tests check those for lossless round trip instead.
"""
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.path.join(ROOT, ".venv-golden")
VPY = os.path.join(VENV, "bin", "python")


def ensure_venv():
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return
    if not os.path.exists(VPY):
        subprocess.check_call([sys.executable, "-m", "venv", VENV])
    subprocess.check_call([VPY, "-m", "pip", "install", "-q", "tokenizers", "gguf", "numpy",
                           "unicodedata2==16.0.0"])
    os.execv(VPY, [VPY] + sys.argv)


def read_gguf(path):
    import gguf
    r = gguf.GGUFReader(path)

    def strs(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def one(key):
        f = r.fields[key]
        return bytes(f.parts[-1]).decode("utf-8")

    tokens = strs("tokenizer.ggml.tokens")
    merges = strs("tokenizer.ggml.merges")
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    return tokens, merges, types, one("tokenizer.ggml.model"), one("tokenizer.ggml.pre")


def byte_map():
    """GPT-2 bytes_to_unicode: raw byte -> the character that stands for it."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build(tokens, merges, types, pre):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs))
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), bl])
    elif pre in ("gpt2", "default"):
        tok.pre_tokenizer = bl
    else:
        raise SystemExit(f"pre-tokenizer {pre!r}: this script builds smollm/gpt2 references only")
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (3, 4)])
    return tok


PROSE = [
    "Hello world! 123",
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "I'm sure you'll like it; they've said we'd go, and she's right. Don't!",
    "CONTRACTIONS IN CAPS: IT'S, I'M, WE'LL, THEY'VE, YOU'D, DON'T.",
    "'s 't 're 've 'm 'll 'd ' s 'S 'T 'RE",
    "rock'n'roll o'clock y'all ma'am",
    "The mitochondria is the powerhouse of the cell.",
    "In 1492, Columbus sailed the ocean blue.",
    "Call me Ishmael. Some years ago—never mind how long precisely—having little or no money in my purse...",
    "“Smart quotes” and ‘single ones’ — plus an em dash – and an en dash.",
    "Ellipsis… and non-breaking\u00a0space, thin\u2009space, ideographic\u3000space.",
    "Zero\u200bwidth\u200bspace and soft\u00adhyphen and word\u2060joiner.",
    "A sentence with trailing spaces   ",
    "   leading spaces",
    "multiple     internal     spaces",
    "question? exclamation! interrobang‽ semicolon; colon: comma,",
    "Mr. and Mrs. Dursley, of number four, Privet Drive, were proud to say that they were perfectly normal.",
    "KVzip compresses KV caches query-agnostically by context reconstruction.",
    "e.g. i.e. etc. vs. a.k.a. U.S.A.",
    "Supercalifragilisticexpialidocious",
    "Pneumonoultramicroscopicsilicovolcanoconiosis is a long word.",
    "a",
    " ",
    "  ",
    "\n",
    "\t",
    "!",
    "''",
    "'",
    "a'",
    "hello'",
]

CODE = [
    "def foo(x):\n    return x * 2\n",
    "import numpy as np\n\nclass Model(nn.Module):\n    def __init__(self, dim=576):\n        super().__init__()\n",
    "for (int i = 0; i < n; i++) {\n\tsum += a[i] * b[i];\n}\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "const f = async (a, b) => { await fetch(`/api/${a}?b=${b}`); };\n",
    "SELECT id, name FROM users WHERE age >= 18 AND email LIKE '%@example.com' ORDER BY id DESC;",
    "<html><body><div class=\"main\">Hi &amp; bye</div></body></html>",
    "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello\")\n}\n",
    "public static void main(String[] args) { System.out.println(\"Hi\"); }",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\"; done\n",
    "x <<= 2; y >>= 3; z **= 4; a != b && c == d || !e",
    "if __name__ == '__main__':\n    main()\n",
    "    \n    \n\n\n    indented()",
    "matrix[i][j] = matrix[i-1][j-1] + 1 if s[i] == t[j] else 0",
    "// comment\n/* block\n   comment */\n",
    "lambda x: x**2 + 3*x - 7",
    "std::vector<std::pair<int, std::string>> v{{1, \"a\"}};",
    "$ git commit -m \"fix: handle CRLF\" && git push origin main",
    "@decorator\ndef f(*args, **kwargs) -> None: ...",
    "template <typename T> T max(T a, T b) { return a > b ? a : b; }",
    "0x1F 0b1010 0o777 1_000_000 3.14159 -2.5e-3 1e100",
    "local t = {1, 2, 3}; for i, v in ipairs(t) do print(i, v) end",
    "print(f\"{name!r:>10} {value:.3f}\")",
]

NUMBERS = [
    "0", "7", "42", "123", "1234567890", "00000", "3.14159265358979", "1,234,567.89",
    "1.234.567,89", "10'000'000", "12 345 678", "-17", "+3", "1e-9", "2^10 = 1024",
    "Phone: +1 (555) 123-4567", "Date: 2024-11-29T23:04:05Z", "v1.2.3-rc.4", "192.168.0.1",
    "$1,000.00 and €2.50 and £3 and ¥400", "50% off", "3/4 cup", "1st 2nd 3rd 4th",
    "x1y2z3", "abc123def456", "  123  456  ", "1 2 3 4 5 6 7 8 9 10",
    "٠١٢٣٤٥٦٧٨٩ Arabic-Indic digits", "१२३ Devanagari digits", "１２３ fullwidth digits",
    "² ³ ¹ superscripts, ½ ¼ ¾ fractions, Ⅷ roman, ① circled",
    "99 bottles of beer on the wall, 99 bottles of beer.",
    "3141592653589793238462643383279502884197169399375105820974944592",
]

WHITESPACE = [
    "a\tb\tc", "line1\nline2\nline3", "crlf\r\nline\r\n", "\r\n\r\n", "\n\n\n\n", "\t\t\t",
    " \t \n \r\n ", "trailing newline\n", "word \n word", "word  \n  word", "a \t b",
    "mixed\u00a0\u00a0nbsp", "tab\tthen space \tthen", "\u2028line sep\u2029para sep",
    "\x0bvertical tab\x0cform feed", "\x85NEL", "end with spaces and newline  \n",
    "   ", "\n \n \n", "a  b   c    d     e", " a", "  a", "   a",
    "x\x1cy\x1dz\x1ew\x1f", " \x1c", "\x00null\x00byte", "bell\x07 esc\x1b[0m",
]

ACCENTS_SCRIPTS = [
    "café naïve résumé coöperate façade", "Ünïcödé Çàñ Bé Fûñ", "Straße groß Fußgänger",
    "Ελληνικά γράμματα", "Русский текст, привет мир!", "עברית מימין לשמאל",
    "العربية نص تجريبي", "हिन्दी भाषा", "ภาษาไทย", "한국어 텍스트입니다", "日本語のテキストです。",
    "中文文本测试，你好世界！", "繁體中文測試", "Tiếng Việt có dấu", "Ąčęėįšųūž lietuvių",
    "ǅ ǈ ǋ titlecase digraphs", "e\u0301 combining acute, n\u0303 tilde", "Å vs A\u030a",
    "ﬁ ﬂ ligatures", "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙", "ſ long s", "Ⓐⓑⓒ",
    "x\u1c89y Unicode 16 letter", "a\U0001E030b", "cat\U00010D40dog",
    "ᚠᚢᚦᚨᚱᚲ runes", "ꦗꦮ Javanese", "𐍈 Gothic", "ⴰⵣⵓⵍ Tifinagh",
]

EMOJI = [
    "😀", "Hello 👋 world 🌍!", "👨‍👩‍👧‍👦 family ZWJ", "🏳️‍🌈 flag", "👍🏽 skin tone", "🇺🇸🇫🇷 flags",
    "❤️ heart with VS16", "⌚⌛ watch", "🧑‍💻 technologist", "emoji🎉inside🎉words",
    "🤖🤖🤖🤖🤖", "☃ snowman ★ star ♥ suit", "🫠🫡🫶 newer emoji", "©®™ symbols",
    "∀x∈ℝ: x²≥0 ∑∫∂√∞≈≠≤≥", "→ ← ↑ ↓ ⇒ ⇔", "░▒▓█ box ┌─┐│└┘",
]

SPECIAL = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>", "text<|endoftext|>more text", "<|im_start|><|im_end|><|endoftext|>",
    "<|im_start", "im_end|>", "<|im_start|", "<|im_end|>>", "<<|im_end|>", "< |im_end| >",
    "<repo_name>kvzip<file_sep>main.c<filename>x.py<gh_stars>100",
    "<issue_start>bug<issue_comment>fix<issue_closed>", "<jupyter_start><jupyter_code>print(1)<jupyter_output>1",
    "<jupyter_text>md<jupyter_script><empty_output>", "<reponame><repo_name>",
    "x<|im_end|>y", " <|im_start|> ", "\n<|im_end|>\n", "1<|endoftext|>2",
]

URLS_MD = [
    "https://example.com/path/to/page?query=1&other=two#frag",
    "http://localhost:8080/api/v2/users/123",
    "mailto:someone@example.org", "ftp://files.example.net/pub/file.tar.gz",
    "See [the docs](https://docs.example.com/en/latest/) for details.",
    "# Heading 1\n## Heading 2\n### Heading 3\n", "* item one\n* item two\n  * nested\n",
    "1. first\n2. second\n3. third\n", "**bold** and *italic* and `code` and ~~strike~~",
    "```python\nprint('hi')\n```\n", "> blockquote\n> continues", "| a | b |\n|---|---|\n| 1 | 2 |",
    "---\ntitle: Front matter\ntags: [a, b]\n---\n", "![alt text](image.png \"Title\")",
    "<!-- html comment -->", "C:\\Users\\Name\\Documents\\file.txt", "/usr/local/bin/python3",
    "user@example.com", "#hashtag @mention", "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
]

LONG = [
    "a" * 300, "ab" * 200, " " * 100, "\n" * 50, "x" * 64 + "y" * 64, "9" * 100,
    "!" * 80, "-" * 120, "=" * 77, "Lorem ipsum dolor sit amet, " * 20,
    "antidisestablishmentarianism" * 5, "🙂" * 40, "日本" * 60, "a b " * 50,
]

# fragments for seeded random mixes
FRAGS = ["the", " the", "The", "cat", " sat", "on", " mat", ".", ",", "!", "?", " ", "  ", "\n",
         "\t", "\r\n", "0", "12", "345", "3.5", "'s", "'ll", "'re", "n't", "é", "ñ", "ü", "中", "文",
         "日本", "😀", "👍🏽", "‍", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<", "|", ">",
         "(", ")", "{", "}", "[", "]", "=", "==", "->", "=>", "::", "//", "#", "$", "%", "&",
         "*", "+", "-", "_", "~", "`", "^", "@", "\\", "/", "\"", "'", ":", ";", "λ", "∑", "²",
         "ǅ", "Ω", "ß", "İ", "ı", "\u00a0", "\u3000", "\u200b", "\u2028", "abc", "XYZ", "foo_bar",
         "http://", "www", ".com", "ing", "tion", "ly", "un", "pre", "Ġ", "Ċ", "âĢ"]


def strings():
    out = []
    out += PROSE + CODE + NUMBERS + WHITESPACE + ACCENTS_SCRIPTS + EMOJI + SPECIAL + URLS_MD + LONG
    out.append("")
    rng = random.Random(20241129)
    for _ in range(160):
        n = rng.randint(1, 24)
        out.append("".join(rng.choice(FRAGS) for _ in range(n)))
    # random code points from assorted blocks (valid scalar values only)
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
              (0x900, 0x97F), (0x2000, 0x206F), (0x2100, 0x22FF), (0x3000, 0x30FF),
              (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF),
              (0x10000, 0x1007F), (0x1D400, 0x1D7FF)]
    for _ in range(60):
        n = rng.randint(1, 30)
        s = []
        for _ in range(n):
            lo, hi = rng.choice(blocks)
            s.append(chr(rng.randint(lo, hi)))
        out.append("".join(s))
    # dedupe, keep order
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    return uniq


QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

EXTRA_SPLITS = [
    "'S 'T 'RE 'Ve 'mE 'LL 'D", "(hello) [world] {x}", "\tword\ttab", " \r\n\r\n  x", "a.\n\nb",
    "x;\r\n\r\ny", "  \n  \n  z", "!!!\n\n", "12345 678", "a1b22c333", "$100.00\n",
    "\u00a0word \u3000word", "\n\nword", "end.\r\n", ".\n.\r.\r\n", "   \t\n", "‘quoted’\n",
]


def write_splits():
    """Pre-tokenizer pieces for the regexes alone (no vocabulary needed), so the
    C splitters for pre = gpt2 and qwen2 are pinned too. Lines:
    `<pre>\t<hex of UTF-8 input>\t<comma-separated end byte offsets>`."""
    from tokenizers import Regex, pre_tokenizers
    refs = {
        "gpt2": (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), True),
        "smollm": (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]), True),
        "qwen2": (pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"), False),
    }
    rows = []
    for name, (pt, mapped) in refs.items():
        for s in strings() + EXTRA_SPLITS:
            if not s:
                continue
            ends, pos = [], 0
            for piece, _ in pt.pre_tokenize_str(s):
                pos += len(piece) if mapped else len(piece.encode("utf-8"))  # byte-level: 1 char per byte
                ends.append(pos)
            assert pos == len(s.encode("utf-8")), (name, s)
            rows.append(f"{name}\t{s.encode('utf-8').hex()}\t{','.join(map(str, ends))}")
    dst = os.path.join(ROOT, "tests", "golden", "pretok_splits.tsv")
    with open(dst, "w") as f:
        f.write("\n".join(rows) + "\n")
    print(f"wrote {dst}: {len(rows)} splits")


def main():
    ensure_venv()
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    tokens, merges, types, kind, pre = read_gguf(model)
    assert kind == "gpt2", kind
    tok = build(tokens, merges, types, pre)
    import tokenizers
    got = tok.encode("Hello world! 123", add_special_tokens=False).ids
    assert got == [19556, 905, 17, 216, 33, 34, 35], got
    # bytes with no byte-level token in the vocabulary are dropped by HF's BPE
    # (no unk token); the round-trip check below expects exactly that loss
    vocab = set(tokens)
    missing = {b for b, c in byte_map().items() if c not in vocab}
    rows = []
    for s in strings():
        ids = tok.encode(s, add_special_tokens=False).ids
        want = bytes(b for b in s.encode("utf-8") if b not in missing).decode("utf-8", "replace")
        assert tok.decode(ids, skip_special_tokens=False) == want, repr(s)
        rows.append(s.encode("utf-8").hex() + "\t" + " ".join(map(str, ids)))
    write_splits()
    dst = os.path.join(ROOT, "tests", "golden", "tokenizer_smollm2.tsv")
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(dst, "w") as f:
        f.write("\n".join(rows) + "\n")
    print(f"wrote {dst}: {len(rows)} strings, {sum(len(r.split(chr(9))[1].split()) for r in rows)} tokens "
          f"(tokenizers {tokenizers.__version__}, pre {pre!r})")


if __name__ == "__main__":
    main()
