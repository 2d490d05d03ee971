#!/usr/bin/env python3
"""Generate tests/golden/dequant.bin: ggml dequantization golden vectors.

What it does
  * For every tensor type present in the default model
    (models/SmolLM2-135M-Instruct.Q4_1.gguf: F32, Q8_0, Q4_1) it takes the raw
    bytes of the first 4096 elements' worth of blocks (or the whole tensor if
    smaller) of the first and the last tensor of that type (for a type with a
    single tensor, e.g. Q8_0 token_embd: its first and its last 4096 elements).
  * For types not in the model (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
    Q5_K, Q6_K) it draws random blocks with a fixed seed: random quant bytes,
    fp16 scale fields that are finite and modest (|d| in [1e-4, 1], a few
    fp16-subnormal ones), random bit patterns for F16/BF16 (inf/nan included).
  * Expected values come from the reference Python implementation,
    gguf.quants.dequantize (PyPI `gguf`), independent of our C code.

File format (little-endian), read by tests/fast/test_quant.c:
    char[8]  magic "KVZDQ001"
    u32      n_records
    n_records x {
        u32  ggml type code
        u32  label length L, then L bytes of ASCII label (e.g. "Q4_1:blk.0.attn_q.weight")
        u64  n_elems
        u64  n_bytes
        u8   raw block bytes [n_bytes]
        f32  expected values [n_elems]
    }

Rerun (from the repository root):
    python3 -m venv .venv-golden && .venv-golden/bin/pip install gguf numpy
    bash scripts/fetch-model            # if models/ is empty
    .venv-golden/bin/python scripts/golden/gen_dequant_golden.py
The output is deterministic for a given gguf/numpy version and model file.
"""
import os
import struct
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.environ.get("KVZ_MODEL", os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
OUT = os.path.join(ROOT, "tests", "golden", "dequant.bin")
N_ELEMS = 4096


def record(qtype, label, raw):
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    blck, nbytes = GGML_QUANT_SIZES[qtype]
    assert raw.size % nbytes == 0
    n = raw.size // nbytes * blck
    if qtype == T.F32:
        exp = raw.view(np.float32).copy()
    else:
        exp = dequantize(raw.reshape(1, -1), qtype).astype(np.float32).reshape(-1)
    assert exp.size == n, (label, exp.size, n)
    lab = label.encode()
    return (struct.pack("<II", int(qtype), len(lab)) + lab + struct.pack("<QQ", n, raw.size)
            + raw.tobytes() + exp.astype("<f4").tobytes())


def real_records():
    r = GGUFReader(MODEL)
    by_type = {}
    for t in r.tensors:
        by_type.setdefault(t.tensor_type, []).append(t)
    recs = []
    for qtype, ts in sorted(by_type.items(), key=lambda kv: int(kv[0])):
        # first and last tensor of the type; a type with one tensor gives its
        # first and its last N_ELEMS elements
        picks = [(ts[0], "head"), (ts[-1], "head")] if len(ts) > 1 else [(ts[0], "head"), (ts[0], "tail")]
        for t, where in picks:
            blck, nbytes = GGML_QUANT_SIZES[qtype]
            raw = np.asarray(t.data).view(np.uint8).reshape(-1)
            n_blocks = min(N_ELEMS // blck, raw.size // nbytes)
            part = raw[: n_blocks * nbytes] if where == "head" else raw[raw.size - n_blocks * nbytes:]
            recs.append(record(qtype, f"{qtype.name}:{t.name}:{where}", part))
    return recs


def fp16_scales(rng, n):
    """Finite fp16 bytes with modest magnitude; every 16th one is fp16-subnormal."""
    mag = 10.0 ** rng.uniform(-4, 0, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    d = (mag * sign).astype(np.float16)
    d[::16] = (rng.integers(1, 1024, d[::16].size).astype(np.uint16)).view(np.float16)
    return d.view(np.uint8).reshape(n, 2)


def random_blocks(rng, qtype, n_blocks):
    blck, nbytes = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    # offsets of fp16 scale fields per block layout (see docs/GGUF.md)
    fields = {
        T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
        T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    }[qtype]
    for off in fields:
        b[:, off:off + 2] = fp16_scales(rng, n_blocks)
    return b


def random_records():
    rng = np.random.default_rng(20240611)
    recs = []
    # F16 / BF16: random bit patterns plus hand-picked edge values.
    edge16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x3c00, 0xbc00, 0x7bff,
                       0xfbff, 0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xfe00, 0x3555], dtype=np.uint16)
    for qtype in (T.F16, T.BF16):
        bits = rng.integers(0, 65536, N_ELEMS - edge16.size, dtype=np.uint16)
        allb = np.concatenate([edge16, bits]).astype("<u2")
        recs.append(record(qtype, f"{qtype.name}:random", allb.view(np.uint8)))
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K):
        blck, _ = GGML_QUANT_SIZES[qtype]
        recs.append(record(qtype, f"{qtype.name}:random", random_blocks(rng, qtype, N_ELEMS // blck)))
    return recs


def main():
    if not os.path.exists(MODEL):
        sys.exit(f"model not found: {MODEL} (run: bash scripts/fetch-model)")
    recs = real_records() + random_records()
    with open(OUT, "wb") as f:
        f.write(b"KVZDQ001" + struct.pack("<I", len(recs)))
        for r in recs:
            f.write(r)
    print(f"wrote {OUT}: {len(recs)} records, {os.path.getsize(OUT)} bytes")


if __name__ == "__main__":
    main()
