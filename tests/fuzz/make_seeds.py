#!/usr/bin/env python3
"""Write the seed corpora of the fuzz targets into tests/fuzz/seeds/ (committed;
rerun after a format change):  python3 tests/fuzz/make_seeds.py"""
import os, struct

root = os.path.dirname(os.path.abspath(__file__))
src = os.path.dirname(os.path.dirname(root))
seeds = os.path.join(root, "seeds")


def put(target, name, data):
    d = os.path.join(seeds, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# blob: flags u8 (bit 0 = reseal), u16 LE META length, META record, LAYER record
def records(b):
    out, i = [], 0
    while i + 56 <= len(b):
        comp = struct.unpack_from("<Q", b, i + 32)[0]
        out.append(b[i:i + 56 + comp])
        i += 56 + comp
    return out

for dt in ("f16", "f32", "v2_f16", "v2_q8", "v2_q4_shared", "v2_f32_small"):
    recs = records(open(os.path.join(src, "tests/golden/blob_%s.kvzb" % dt), "rb").read())
    meta = recs[0]
    for li, layer in enumerate(recs[1:]):
        for flags in (0, 1):
            put("blob", "%s_l%d_%d" % (dt, li, flags),
                bytes([flags]) + struct.pack("<H", len(meta)) + meta + layer)


# gguf: small valid v3 files
def gstr(s):
    s = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(s)) + s

def kv(key, typ, payload):
    return gstr(key) + struct.pack("<I", typ) + payload

def gguf(kvs, tensors, align=32):
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs)
    info, data = b"", b""
    for name, dims, typ, blob in tensors:
        while len(data) % align:
            data += b"\0"
        info += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        info += struct.pack("<IQ", typ, len(data))
        data += blob
    body = head + info
    while len(body) % align:
        body += b"\0"
    return body + data

def arr_str(items):
    return struct.pack("<IQ", 8, len(items)) + b"".join(gstr(s) for s in items)

toks = ["a", "b", "ab", "\u0120", "\u0120a", "<|im_start|>"]
kvs = [kv("general.architecture", 8, gstr("llama")),
       kv("general.alignment", 4, struct.pack("<I", 32)),
       kv("llama.block_count", 4, struct.pack("<I", 1)),
       kv("llama.rope.freq_base", 6, struct.pack("<f", 10000.0)),
       kv("tokenizer.ggml.model", 8, gstr("gpt2")),
       kv("tokenizer.ggml.pre", 8, gstr("smollm")),
       kv("tokenizer.ggml.tokens", 9, arr_str(toks)),
       kv("tokenizer.ggml.token_type", 9, struct.pack("<IQ", 5, len(toks)) +
          b"".join(struct.pack("<i", 3 if t.startswith("<|") else 1) for t in toks)),
       kv("tokenizer.ggml.merges", 9, arr_str(["a b", "\u0120 a"])),
       kv("tokenizer.ggml.bos_token_id", 4, struct.pack("<I", 5))]
f32 = struct.pack("<8f", *range(8))
q4_1 = struct.pack("<ee", 0.5, -1.0) + bytes(range(16))   # one Q4_1 block: 32 weights
put("gguf", "tiny_v3.gguf", gguf(kvs, [("w.f32", [8], 0, f32), ("w.q4_1", [32], 3, q4_1)]))
put("gguf", "meta_only.gguf", gguf(kvs[:4], []))
put("gguf", "nested.gguf", gguf([kv("a.nested", 9, struct.pack("<IQ", 9, 1) +
                                    struct.pack("<IQ", 4, 2) + struct.pack("<II", 1, 2))], []))

# tokenizer and text: UTF-8 and not
texts = {
    "ascii": b"The blue valve on line 3 must be closed before cleaning.\n",
    "digits": b"Call 555-0142 x9 before 12:30, version 2.10.7 (1234567).",
    "special": b"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "unicode": "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f600 \u0391\u03b2\u03b3 \u00a0\u2003x".encode(),
    "contractions": b"I'm you're they'll it's WE'D  \t\n\n  spaces   ",
    "invalid": b"ok \xff\xfe bad \xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80 \xe2\x82 end \x00 nul",
    "doc": open(os.path.join(src, "samples/halcyon_warranty_returns.md"), "rb").read()[:1500],
}
for name, t in texts.items():
    put("tokenizer", name, t)
    put("text", name, t)
print("seeds written to", seeds)
