#!/usr/bin/env python3
"""Generate tests/golden/kvzip_scores_smollm2.bin: reference KVzip importance scores.

Model: models/SmolLM2-135M-Instruct.Q4_1.gguf via HF transformers (fp32, CPU, eager
attention).  Tokenizer: scripts/golden/reftok.py.  Document: tests/golden/kvzip_doc.txt.

Exact definitions (DESIGN.md section 3; the C code implements the same):

  * Prefix string
        P = "<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by
             Hugging Face<|im_end|>\\n<|im_start|>user\\nGiven the context, answer to the
             following question or request without explanation.\\n\\n"
    (one line in the code, no line breaks besides the \\n shown), encoded with special
    tokens matched.  Context C = encode(doc text) with no specials.  The ids are
    concatenated (P ids then C ids; never re-tokenized together).
    n_prefix = len(P ids), n_ctx = len(C ids), N0 = n_prefix + n_ctx.
  * Prefill P+C (positions 0..N0-1) -> KV cache (keys stored after RoPE).
  * Chunks: C is split in chunks of m = 2000 tokens; chunk t (t = 1..T, T = ceil(n_ctx/m))
    is C[(t-1)m : min(tm, n_ctx)], the last one shorter.
  * Repeat input R_t:
        t = 1: encode("\\n\\nRepeat the previous context exactly.")
        t > 1: encode("\\n\\nRepeat the part of the previous context exactly, starting with ")
               + the last 8 ids of chunk t-1
    then + encode("<|im_end|>\\n<|im_start|>assistant\\n") (specials matched)
    + the ids of chunk t.  Each piece is encoded separately and the ids concatenated.
  * R_t sits at positions N0 .. N0+len(R_t)-1 and is run teacher-forced (one forward
    pass, nothing generated) with the full prefix+context cache as past: full causal
    attention to everything, so hidden states are the normal model's.  Its KV is
    discarded afterwards (every chunk sees the same P+C cache).
  * In every layer l, capture the post-RoPE queries of all R_t tokens and the
    post-RoPE keys of the cache and of R_t (here: the q/k tensors handed to the
    attention kernel, i.e. after apply_rotary_pos_emb and after the cache update).
  * For each KV head h, each query head g of h's GQA group (g // (n_head/n_kv_head) == h,
    i.e. g in {3h, 3h+1, 3h+2} for SmolLM2) and each R_t query i:
        K_bar = [prefix keys (n_prefix), chunk-t keys, R_t keys 0..i (causal)]
        A     = softmax over K_bar of  q_{g,i} . k / sqrt(head_dim)
    (the softmax normalizes over that subset only, not over the full context).
        score(l, h, j) = max over i and g of A[j], for every chunk-t key j.
    Computed in float64 from the fp32 q/k.  Every context token gets exactly one score
    per (l, h), from the chunk that contains it.

Output, little-endian:
    char magic[4] = "KVZS"
    u32  version = 1
    u32  n_layer, n_kv_head, n_prefix, n_ctx, m (= 2000)
    u32  ids[n_prefix + n_ctx]
    for t = 1..T:  u32 len(R_t), u32 R_t ids[len(R_t)]
    f32  scores[n_layer][n_kv_head][n_ctx]
(T is not stored: T = ceil(n_ctx / m).)

Note: HF's llama-from-GGUF un-permutes q/k weights and rotates half-split pairs while the
C code rotates adjacent pairs of the permuted GGUF weights; the dot products q.k are
identical either way, so the scores are comparable.
"""
import copy
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reftok  # noqa: E402

M = 2000
N_OVERLAP = 8
KEEP_RATIO = 0.3
PREFIX = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nGiven the context, answer to the following question or request without explanation.\n\n")
REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with "
POSTFIX = "<|im_end|>\n<|im_start|>assistant\n"

_CAPTURE = None  # dict layer_idx -> (q, k) while capturing


def _install_capture():
    from transformers.models.llama import modeling_llama as ml
    orig = ml.eager_attention_forward

    def wrapped(module, query, key, value, attention_mask, *args, **kwargs):
        if _CAPTURE is not None:
            # query [1, n_head, q_len, d] post-RoPE; key [1, n_kv_head, past+q_len, d] post-RoPE
            _CAPTURE[module.layer_idx] = (query.detach().clone(), key.detach().clone())
        return orig(module, query, key, value, attention_mask, *args, **kwargs)

    ml.eager_attention_forward = wrapped


def chunk_scores(q, k, n_prefix, c0, c1, n0):
    """q: [n_head, L, d], k: [n_kv, n0+L, d] (float64). Returns [n_kv, c1-c0] scores."""
    n_head, L, d = q.shape
    n_kv = k.shape[0]
    grp = n_head // n_kv
    sel = torch.cat([torch.arange(0, n_prefix), torch.arange(n_prefix + c0, n_prefix + c1),
                     torch.arange(n0, n0 + L)])
    kb = k[:, sel, :]                                   # [n_kv, nK, d]
    n_fixed = n_prefix + (c1 - c0)
    causal = torch.zeros(L, kb.shape[1], dtype=torch.bool)
    causal[:, n_fixed:] = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
    out = torch.empty(n_kv, c1 - c0, dtype=torch.float64)
    for h in range(n_kv):
        best = torch.full((c1 - c0,), -1.0, dtype=torch.float64)
        for g in range(h * grp, (h + 1) * grp):
            s = (q[g] @ kb[h].T) / np.sqrt(d)           # [L, nK]
            s = s.masked_fill(causal, float("-inf"))
            a = torch.softmax(s, dim=-1)
            best = torch.maximum(best, a[:, n_prefix:n_fixed].max(dim=0).values)
        out[h] = best
    return out


def main():
    global _CAPTURE
    out_path = os.path.join(reftok.GOLDEN_DIR, "kvzip_scores_smollm2.bin")
    doc = open(os.path.join(reftok.GOLDEN_DIR, "kvzip_doc.txt"), encoding="utf-8").read()
    tok, _ = reftok.build(reftok.MODEL_PATH)
    model = reftok.load_model()
    _install_capture()
    cfg = model.config
    n_layer, n_head, n_kv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads

    p_ids = reftok.encode(tok, PREFIX, True)
    c_ids = reftok.encode(tok, doc, False)
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
            r = reftok.encode(tok, REPEAT_FIRST, False)
        else:
            r = reftok.encode(tok, REPEAT_NEXT, False) + c_ids[c0 - N_OVERLAP:c0]
        r = r + reftok.encode(tok, POSTFIX, True) + c_ids[c0:c1]
        r_all.append(r)
        L = len(r)
        _CAPTURE = {}
        with torch.no_grad():
            o = model(torch.tensor([r]), past_key_values=copy.deepcopy(cache), use_cache=True,
                      position_ids=torch.arange(n0, n0 + L)[None])
        # sanity: how well does the model "repeat" (teacher-forced next-token argmax accuracy
        # over the chunk tokens, each predicted from the previous R_t position)
        pred = o.logits[0, L - (c1 - c0) - 1:L - 1].argmax(-1).numpy()
        acc = float(np.mean(pred == np.asarray(c_ids[c0:c1])))
        cap, _CAPTURE = _CAPTURE, None
        assert sorted(cap) == list(range(n_layer)), "attention capture failed"
        for l in range(n_layer):
            q, k = cap[l]
            assert q.shape == (1, n_head, L, 64) and k.shape == (1, n_kv, n0 + L, 64), (q.shape, k.shape)
            if l == 0:  # the cached part of k must be the prefill cache (post-RoPE)
                assert torch.equal(k[0, :, :n0], cache.layers[0].keys[0])
            scores[l, :, c0:c1] = chunk_scores(q[0].double(), k[0].double(), n_prefix, c0, c1, n0).numpy()
        print(f"chunk {t}: tokens [{c0},{c1}) len(R_t)={L} teacher-forced repeat accuracy={acc:.3f}  "
              f"R_t head ids={r[:24]}")
    assert (scores > 0).all() and (scores <= 1).all()

    blobs = [b"KVZS", struct.pack("<IIIIII", 1, n_layer, n_kv, n_prefix, n_ctx, M),
             np.asarray(p_ids + c_ids, "<u4").tobytes()]
    for r in r_all:
        blobs += [struct.pack("<I", len(r)), np.asarray(r, "<u4").tobytes()]
    s32 = scores.astype("<f4")
    blobs.append(s32.tobytes())
    data = b"".join(blobs)
    with open(out_path, "wb") as f:
        f.write(data)
    print(f"wrote {out_path} ({len(data)} bytes)")

    # Sanity view: global top-30% threshold over all (layer, kv head, context token).
    flat = s32.astype(np.float64).ravel()
    n_keep = int(round(flat.size * KEEP_RATIO))
    order = np.argsort(-flat, kind="stable")  # ties: lower flat index first
    keep = np.zeros(flat.size, dtype=bool)
    keep[order[:n_keep]] = True
    keep = keep.reshape(s32.shape)
    thr = flat[order[n_keep - 1]]
    print(f"global top-{KEEP_RATIO:.0%}: keep {n_keep} of {flat.size} pairs, threshold score {thr:.6g}")
    print("kept fraction per layer (and per kv head):")
    for l in range(n_layer):
        per_h = " ".join(f"{keep[l, h].mean():.3f}" for h in range(n_kv))
        print(f"  layer {l:2d}: {keep[l].mean():.3f}   [{per_h}]")
    print(f"score stats: min {flat.min():.3e} median {np.median(flat):.3e} max {flat.max():.3e}")


if __name__ == "__main__":
    main()
