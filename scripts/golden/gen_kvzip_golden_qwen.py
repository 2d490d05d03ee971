#!/usr/bin/env python3
"""Generate tests/golden/kvzip_scores_qwen25_coder_05b.bin: reference KVzip importance
scores of Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, `scripts/fetch-model
qwen2.5-coder-0.5b`), the qwen2 path (q/k/v biases, 7 query heads per KV head,
half-split RoPE, ChatML with the model's system text).

Same definitions, document (tests/golden/kvzip_doc.txt), float64 score computation
and "KVZS" v1 output format as gen_kvzip_golden.py (read its docstring); only the
model, the tokenizer and the prefix differ:

  * Model and tokenizer: transformers loads the GGUF (dequantized to fp32, CPU, eager
    attention) and builds the tokenizer from the GGUF's vocab and merges, as
    gen_logits_golden_qwen.py does. The post-RoPE q/k are captured in
    transformers.models.qwen2.modeling_qwen2.eager_attention_forward.
  * Prefix string
        "<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful
         assistant.<|im_end|>\\n<|im_start|>user\\nGiven the context, answer to the
         following question or request without explanation.\\n\\n"
    (the system text of the GGUF's chat template; one line in the code).

Runs in ~20 min on 2 shared cores (two forwards over ~2.8K cached tokens plus the float64
softmaxes of 24 layers x 14 heads).
"""
import copy
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_kvzip_golden import (M, N_OVERLAP, POSTFIX, REPEAT_FIRST, REPEAT_NEXT,  # noqa: E402
                              chunk_scores)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL_DIR = os.path.join(ROOT, "models")
MODEL_FILE = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")
OUT = os.path.join(GOLDEN_DIR, "kvzip_scores_qwen25_coder_05b.bin")
PREFIX = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
          "<|im_start|>user\nGiven the context, answer to the following question or request without explanation.\n\n")

_CAPTURE = None  # dict layer_idx -> (q, k) while capturing


def _install_capture():
    from transformers.models.qwen2 import modeling_qwen2 as mq
    orig = mq.eager_attention_forward

    def wrapped(module, query, key, value, attention_mask, *args, **kwargs):
        if _CAPTURE is not None:
            _CAPTURE[module.layer_idx] = (query.detach().clone(), key.detach().clone())
        return orig(module, query, key, value, attention_mask, *args, **kwargs)

    mq.eager_attention_forward = wrapped


def main():
    global _CAPTURE
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(os.path.join(MODEL_DIR, MODEL_FILE)):
        sys.exit("missing models/%s: run `scripts/fetch-model qwen2.5-coder-0.5b`" % MODEL_FILE)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    _install_capture()
    cfg = model.config
    assert cfg.model_type == "qwen2", cfg.model_type
    assert not getattr(cfg, "use_sliding_window", False)
    n_layer, n_head, n_kv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // n_head
    assert (n_layer, n_head, n_kv, hd) == (24, 14, 2, 64), (n_layer, n_head, n_kv, hd)

    def enc(text, specials):
        ids = tok(text, add_special_tokens=False, split_special_tokens=not specials)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=False) == text, text
        return ids

    doc = open(os.path.join(GOLDEN_DIR, "kvzip_doc.txt"), encoding="utf-8").read()
    p_ids = enc(PREFIX, True)
    c_ids = enc(doc, False)
    n_prefix, n_ctx = len(p_ids), len(c_ids)
    n0 = n_prefix + n_ctx
    T = (n_ctx + M - 1) // M
    print(f"n_prefix={n_prefix} n_ctx={n_ctx} chunks={T} doc_chars={len(doc)}")
    assert T >= 2

    with torch.no_grad():
        pre = model(torch.tensor([p_ids + c_ids]), use_cache=True)
    cache = pre.past_key_values
    assert cache.get_seq_length() == n0

    scores = np.zeros((n_layer, n_kv, n_ctx), dtype=np.float64)
    r_all = []
    for t in range(1, T + 1):
        c0, c1 = (t - 1) * M, min(t * M, n_ctx)
        if t == 1:
            r = enc(REPEAT_FIRST, False)
        else:
            r = enc(REPEAT_NEXT, False) + c_ids[c0 - N_OVERLAP:c0]
        r = r + enc(POSTFIX, True) + c_ids[c0:c1]
        r_all.append(r)
        L = len(r)
        _CAPTURE = {}
        with torch.no_grad():
            o = model(torch.tensor([r]), past_key_values=copy.deepcopy(cache), use_cache=True,
                      position_ids=torch.arange(n0, n0 + L)[None])
        pred = o.logits[0, L - (c1 - c0) - 1:L - 1].argmax(-1).numpy()
        acc = float(np.mean(pred == np.asarray(c_ids[c0:c1])))
        cap, _CAPTURE = _CAPTURE, None
        assert sorted(cap) == list(range(n_layer)), "attention capture failed"
        for l in range(n_layer):
            q, k = cap[l]
            assert q.shape == (1, n_head, L, hd) and k.shape == (1, n_kv, n0 + L, hd), (q.shape, k.shape)
            if l == 0:  # the cached part of k must be the prefill cache (post-RoPE)
                assert torch.equal(k[0, :, :n0], cache.layers[0].keys[0])
            scores[l, :, c0:c1] = chunk_scores(q[0].double(), k[0].double(), n_prefix, c0, c1, n0).numpy()
        print(f"chunk {t}: tokens [{c0},{c1}) len(R_t)={L} teacher-forced repeat accuracy={acc:.3f}", flush=True)
    assert (scores > 0).all() and (scores <= 1).all()

    blobs = [b"KVZS", struct.pack("<IIIIII", 1, n_layer, n_kv, n_prefix, n_ctx, M),
             np.asarray(p_ids + c_ids, "<u4").tobytes()]
    for r in r_all:
        blobs += [struct.pack("<I", len(r)), np.asarray(r, "<u4").tobytes()]
    s32 = scores.astype("<f4")
    blobs.append(s32.tobytes())
    data = b"".join(blobs)
    with open(OUT, "wb") as f:
        f.write(data)
    print(f"wrote {OUT} ({len(data)} bytes)")
    flat = s32.astype(np.float64).ravel()
    print(f"score stats: min {flat.min():.3e} median {np.median(flat):.3e} max {flat.max():.3e}")


if __name__ == "__main__":
    main()
