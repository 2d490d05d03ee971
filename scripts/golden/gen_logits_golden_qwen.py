#!/usr/bin/env python3
"""Generate tests/golden/logits_qwen25_coder_05b.bin: reference logits of
Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, `scripts/fetch-model qwen2.5-coder-0.5b`)
from HF transformers, in the "KVZL" v1 format of gen_logits_golden.py (see
scripts/golden/README.md).

transformers loads the same GGUF (gguf-py dequantizes Q4_K / Q6_K / Q5_0 / Q8_0 to
fp32; CPU, eager attention) and builds the tokenizer from the GGUF's vocab and
merges. The token ids are the model input as is (no BOS: Qwen adds none). Two
prompts keep the file small (the full last-position row is 151,936 floats):
`chat` (ChatML system + user turn with the system text of the GGUF's template)
and `code` (Python).
"""
import os
import struct
import sys

import numpy as np
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL_DIR = os.path.join(ROOT, "models")
MODEL_FILE = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
OUT = os.path.join(ROOT, "tests", "golden", "logits_qwen25_coder_05b.bin")
N_TOP = 16
N_GEN = 64

PROMPT_CHAT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nRead the passage and answer the question.\n\n"
    "The pump station at Kessel Ridge lifts water 86 meters from the river intake to a "
    "reservoir that holds 12,500 cubic meters. It has three pumps; each delivers 140 liters "
    "per second at full speed and draws 165 kilowatts. Normally only two pumps run, and the "
    "third is kept as a standby. In July 2023 the station ran for 612 hours and used "
    "198,000 kilowatt-hours of electricity.\n\n"
    "Question: How long does it take two pumps at full speed to fill the empty reservoir, "
    "in hours?<|im_end|>\n<|im_start|>assistant\n"
)

PROMPT_CODE = (
    "import math\n\n\n"
    "def is_prime(n: int) -> bool:\n"
    "    \"\"\"Return True if n is a prime number.\"\"\"\n"
    "    if n < 2:\n"
    "        return False\n"
    "    if n % 2 == 0:\n"
    "        return n == 2\n"
    "    limit = int(math.isqrt(n))\n"
    "    for d in range(3, limit + 1, 2):\n"
    "        if n % d == 0:\n"
    "            return False\n"
    "    return True\n\n\n"
    "def primes_below(limit: int) -> list[int]:\n"
    "    \"\"\"Return all primes smaller than limit, in increasing order.\"\"\"\n"
    "    return [n for n in range(limit) if is_prime(n)]\n\n\n"
    "def main() -> None:\n"
    "    primes = primes_below(100)\n"
    "    print(len(primes), sum(primes))\n"
)

PROMPTS = [("chat", PROMPT_CHAT), ("code", PROMPT_CODE)]


def main():
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if not os.path.exists(os.path.join(MODEL_DIR, MODEL_FILE)):
        sys.exit("missing models/%s: run `scripts/fetch-model qwen2.5-coder-0.5b`" % MODEL_FILE)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    c = model.config
    assert c.model_type == "qwen2", c.model_type
    assert c.num_hidden_layers == 24 and c.hidden_size == 896, c
    assert c.num_attention_heads == 14 and c.num_key_value_heads == 2, c
    assert c.intermediate_size == 4864, c
    nv = model.lm_head.weight.shape[0]
    print("config:", c.vocab_size, nv, getattr(c, "rope_parameters", None), c.rms_norm_eps, c.tie_word_embeddings)

    blobs = [b"KVZL", struct.pack("<III", 1, len(PROMPTS), nv)]
    for name, text in PROMPTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        n = len(ids)
        assert 100 <= n <= 250, (name, n)
        assert tok.decode(ids, skip_special_tokens=False) == text, name
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
        assert logits.shape == (n, nv)
        order = np.argsort(-logits, axis=1, kind="stable")[:, :N_TOP]
        top_logit = np.take_along_axis(logits, order, axis=1)
        top = np.empty((n, N_TOP), dtype=[("id", "<u4"), ("logit", "<f4")])
        top["id"] = order
        top["logit"] = top_logit
        last = logits[-1].astype("<f4")
        gcfg = GenerationConfig(do_sample=False, max_new_tokens=N_GEN, min_new_tokens=N_GEN, eos_token_id=None,
                                pad_token_id=0, bos_token_id=None)
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), generation_config=gcfg,
                               attention_mask=torch.ones(1, n, dtype=torch.long))
        gen = g[0, n:].tolist()
        assert len(gen) == N_GEN, len(gen)
        assert gen[0] == int(order[-1, 0])
        # greedy gaps, teacher-forced on the continuation
        with torch.no_grad():
            full = model(torch.tensor([ids + gen]), use_cache=False).logits[0, n - 1:n - 1 + N_GEN].float()
        t2 = torch.topk(full, 2).values
        gaps = (t2[:, 0] - t2[:, 1]).numpy()
        agree = all(int(torch.argmax(full[i])) == gen[i] for i in range(N_GEN))
        blobs += [struct.pack("<I", n), np.asarray(ids, "<u4").tobytes(), top.tobytes(),
                  last.tobytes(), struct.pack("<I", N_GEN), np.asarray(gen, "<u4").tobytes()]
        print(f"[{name}] n_tok={n} max|logit|={np.abs(logits).max():.3f}; "
              f"min top1-top2 gap over positions={np.min(top_logit[:, 0]-top_logit[:, 1]):.5f}; "
              f"teacher-forced argmax {'agrees' if agree else 'DIFFERS'}; "
              f"min gap over the 64 greedy steps={gaps.min():.4f} (step {int(gaps.argmin())})")
        print(f"  gen text: {tok.decode(gen, skip_special_tokens=False)!r}")
    data = b"".join(blobs)
    with open(OUT, "wb") as f:
        f.write(data)
    print(f"wrote {OUT} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
